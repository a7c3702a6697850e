//! The raw serde mirror of the TOML file.
//!
//! Every field is optional and every scalar that needs parsing (durations,
//! sizes, enum names) is kept as a string here, so that deserialisation only
//! fails on the shape of the file (unknown fields, wrong types) and all the
//! value problems can be collected and reported together by
//! [`super::validate`].

use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default)]
    pub server: RawServer,
    #[serde(default)]
    pub upstream: RawUpstream,
    #[serde(default)]
    pub store: RawStore,
    #[serde(default)]
    pub defaults: RawPolicy,
    #[serde(default)]
    pub route: Vec<RawRoute>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub listen: Option<String>,
    pub admin_listen: Option<String>,
    pub admin_token: Option<String>,
    pub tls: Option<RawTls>,
    pub max_request_body: Option<RawSize>,
    pub header_read_timeout: Option<String>,
    pub shutdown_grace: Option<String>,
    pub workers: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub cert: String,
    pub key: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub url: Option<String>,
    pub connect_timeout: Option<String>,
    pub timeout: Option<String>,
    pub idle_timeout: Option<String>,
    pub ca: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    pub backend: Option<String>,
    pub path: Option<String>,
    pub url: Option<String>,
    pub urls: Option<Vec<String>>,
    pub max_memory: Option<RawSize>,
    pub on_error: Option<String>,
    pub timeout: Option<String>,
    pub key_prefix: Option<String>,
    pub wait_for_replicas: Option<u64>,
}

/// A size: a plain integer of bytes or a string such as `"64KiB"`.
#[derive(Debug, Clone)]
pub enum RawSize {
    Bytes(u64),
    Text(String),
}

/// By hand rather than `untagged`, whose error names neither: "data did
/// not match any variant of untagged enum RawSize".
impl<'de> Deserialize<'de> for RawSize {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<RawSize, D::Error> {
        struct Size;
        impl serde::de::Visitor<'_> for Size {
            type Value = RawSize;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a size: a whole number of bytes, or a string such as \"64KiB\"")
            }

            fn visit_u64<E: serde::de::Error>(self, bytes: u64) -> Result<RawSize, E> {
                Ok(RawSize::Bytes(bytes))
            }

            fn visit_i64<E: serde::de::Error>(self, bytes: i64) -> Result<RawSize, E> {
                u64::try_from(bytes)
                    .map(RawSize::Bytes)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(bytes), &self))
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<RawSize, E> {
                Ok(RawSize::Text(text.to_owned()))
            }
        }
        deserializer.deserialize_any(Size)
    }
}

/// Declares [`RawPolicy`] and the route table that carries the same fields
/// beside a route's identity, so each policy field is written once.
///
/// The route table is flat for serde rather than a `flatten`ed policy:
/// through `flatten`, serde can neither deny unknown fields nor say which
/// field had the wrong type, and the parser's error would point at the
/// `[[route]]` line instead of the field.
macro_rules! policy_fields {
    ($($(#[$attr:meta])* $field:ident: $ty:ty,)*) => {
        /// The policy fields shared by `[defaults]` and every `[[route]]`.
        #[derive(Debug, Default, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct RawPolicy {
            $($(#[$attr])* pub $field: $ty,)*
        }

        /// One `[[route]]` table as written: its identity and its policy
        /// fields side by side.
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct RouteTable {
            name: Option<String>,
            path: Option<String>,
            host: Option<String>,
            upstream: Option<String>,
            $($(#[$attr])* $field: $ty,)*
        }

        impl From<RouteTable> for RawRoute {
            fn from(table: RouteTable) -> RawRoute {
                RawRoute {
                    name: table.name,
                    path: table.path,
                    host: table.host,
                    upstream: table.upstream,
                    policy: RawPolicy { $($field: table.$field,)* },
                }
            }
        }
    };
}

policy_fields! {
    methods: Option<Vec<String>>,
    ttl: Option<String>,
    lock_timeout: Option<String>,
    scope: Option<Vec<String>>,
    on_in_flight: Option<String>,
    wait_timeout: Option<String>,
    on_server_error: Option<String>,
    on_upstream_failure: Option<String>,
    refresh_ttl_on_replay: Option<bool>,
    max_response_body: Option<RawSize>,
    forward_key_header: Option<String>,
    replay_drop_headers: Option<Vec<String>>,
    mode: Option<String>,
    #[serde(default)]
    key: RawKey,
    #[serde(default)]
    fingerprint: RawFingerprint,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKey {
    pub header: Option<String>,
    pub required: Option<bool>,
    pub max_length: Option<u64>,
    pub derive: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawFingerprint {
    pub headers: Option<Vec<String>>,
    pub body: Option<String>,
    pub ignore: Option<Vec<String>>,
}

/// One `[[route]]`: its identity, and the policy fields it overrides.
#[derive(Debug, Deserialize)]
#[serde(from = "RouteTable")]
pub struct RawRoute {
    pub name: Option<String>,
    pub path: Option<String>,
    pub host: Option<String>,
    pub upstream: Option<String>,
    pub policy: RawPolicy,
}
