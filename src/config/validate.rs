//! Raw configuration -> validated [`Config`], collecting every problem.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use http::{HeaderName, Method, Uri};

use super::raw::{RawConfig, RawPolicy, RawSize};
use super::*;

/// Collects problems while fields are parsed.
struct Checker {
    problems: Vec<Problem>,
}

impl Checker {
    fn problem(&mut self, field: &str, message: impl Into<String>) {
        self.problems.push(Problem {
            field: field.to_string(),
            message: message.into(),
        });
    }

    /// Parses a field when present, otherwise keeps `default`.
    fn field<R, T>(
        &mut self,
        field: &str,
        raw: Option<&R>,
        default: T,
        parse: impl FnOnce(&R) -> Result<T, String>,
    ) -> T {
        match raw {
            None => default,
            Some(raw) => match parse(raw) {
                Ok(v) => v,
                Err(message) => {
                    self.problem(field, message);
                    default
                }
            },
        }
    }

    fn duration(&mut self, field: &str, raw: Option<&String>, default: Duration) -> Duration {
        self.field(field, raw, default, |s| parse_duration(s))
    }

    fn positive_duration(&mut self, field: &str, raw: Option<&String>, default: Duration) -> Duration {
        self.field(field, raw, default, |s| {
            let d = parse_duration(s)?;
            if d.is_zero() {
                Err("must be longer than zero".to_string())
            } else {
                Ok(d)
            }
        })
    }

    /// A duration of at least `min`, said in the message when it is not.
    fn duration_at_least(
        &mut self,
        field: &str,
        raw: Option<&String>,
        default: Duration,
        min: Duration,
        why: &str,
    ) -> Duration {
        self.field(field, raw, default, |s| {
            let d = parse_duration(s)?;
            if d < min {
                Err(format!("must be at least {}: {why}", humantime::format_duration(min)))
            } else {
                Ok(d)
            }
        })
    }

    fn size(&mut self, field: &str, raw: Option<&RawSize>, default: u64) -> u64 {
        self.field(field, raw, default, parse_size)
    }

    fn headers(&mut self, field: &str, raw: Option<&Vec<String>>, default: &[HeaderName]) -> Vec<HeaderName> {
        self.field(field, raw, default.to_vec(), |names| {
            names.iter().map(|n| header_name(n)).collect()
        })
    }

    fn choice<T: Choice>(&mut self, field: &str, raw: Option<&String>, default: T) -> T {
        self.field(field, raw, default, |s| {
            let options = T::NAMES;
            options
                .iter()
                .find(|(name, _)| name == s)
                .map(|(_, v)| *v)
                .ok_or_else(|| {
                    let names: Vec<String> = options.iter().map(|(n, _)| format!("\"{n}\"")).collect();
                    format!("unknown value \"{s}\": expected one of {}", names.join(", "))
                })
        })
    }
}

/// The longest duration a field takes, `100y` (years of 365.25 days, as
/// the parser counts them): past any TTL or timeout in use, and well short
/// of what a clock reading plus it, or Redis's `PX`, can hold; beyond
/// those every request would fail.
const MAX_DURATION: Duration = Duration::from_secs(100 * 31_557_600);

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s.trim())
        .map_err(|e| format!("`{s}` is not a duration ({e}); write e.g. \"500ms\", \"30s\", \"24h\", \"7d\""))?;
    if d > MAX_DURATION {
        return Err(format!("`{s}` is longer than the longest duration taken, \"100y\""));
    }
    Ok(d)
}

/// Sizes: plain bytes, or a number with B, KiB, MiB or GiB (powers of 1024).
pub fn parse_size(raw: &RawSize) -> Result<u64, String> {
    let text = match raw {
        RawSize::Bytes(n) => return Ok(*n),
        RawSize::Text(t) => t.trim(),
    };
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let unit_size: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => {
            return Err(format!(
                "`{text}` is not a size: write bytes, or a whole number with B, KiB, MiB or GiB, e.g. \"64KiB\""
            ));
        }
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(unit_size))
        .ok_or_else(|| format!("`{text}` is not a size: write a whole number with B, KiB, MiB or GiB, e.g. \"64KiB\""))
}

fn header_name(s: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(s.trim().as_bytes()).map_err(|_| format!("`{s}` is not a valid header name"))
}

/// A header a key is derived from (`key.derive`'s `header:`) or a
/// fingerprint reads (`fingerprint.headers`): not one of the connection or
/// of the body's framing, which each hop or client may change, so a retry
/// relayed another way (`TE`, `Connection: close`), sent chunked or over
/// HTTP/2 (no `Content-Length`), or by a client that waits for a 100 only
/// on large bodies (`Expect`, as curl does) would get another key, or a
/// 422.
fn request_header_name(s: &str) -> Result<HeaderName, String> {
    let name = header_name(s)?;
    if crate::wire::is_hop_by_hop(&name) || name == http::header::CONTENT_LENGTH || name == http::header::EXPECT {
        return Err(format!(
            "`{s}` is a header of the connection or of the body's framing, which each hop or client may \
             change: a retry sent another way would not match; name a header of the request"
        ));
    }
    Ok(name)
}

/// A header the key is read from (`key.header`) or forwarded under
/// (`forward_key_header`, `forwarded`): not one of the connection or of
/// the body's framing (hop-by-hop, `Content-Length`, `Host`), which would
/// read the key from them or put it in their place, nor `Expect`, the
/// listener's own, nor one that describes the body (forwarded under:
/// any `Content-*`; read from: its type, coding or language); nor, to
/// forward under, `Forwarded` or an `X-Forwarded-*`, a proxy's word to
/// the upstream, which the client's key would then set (its address,
/// say).
fn key_header_name(s: &str, forwarded: bool) -> Result<HeaderName, String> {
    let name = header_name(s)?;
    if crate::wire::is_hop_by_hop(&name) || name == http::header::CONTENT_LENGTH || name == http::header::HOST {
        return Err(format!(
            "`{s}` is a header of the connection or of the body's framing: the key needs a header of its own"
        ));
    }
    // `X_Forwarded_For` too: a backend that reads `_` as `-` (as CGI
    // does) takes it for the other, which is why idemgate drops those.
    if forwarded && (name.as_str().replace('_', "-").starts_with("x-forwarded-") || name == http::header::FORWARDED) {
        return Err(format!(
            "`{s}` is a proxy's header to the upstream (idemgate sets X-Forwarded-For, -Proto and -Host): \
             the client's key would set it instead"
        ));
    }
    // A credential: forwarded under it, the client's key would stand in
    // for the credential the client sent, which the backend then reads
    // (and a scope on that header would keep the record apart by the one
    // the backend never saw).
    if forwarded
        && [
            http::header::AUTHORIZATION,
            http::header::PROXY_AUTHORIZATION,
            http::header::COOKIE,
        ]
        .contains(&name)
    {
        return Err(format!(
            "`{s}` carries the client's credentials: the client's key would replace them on the way to the \
             upstream"
        ));
    }
    // What the backend reads the body by: forwarded under one, the key
    // would replace its type or coding; read from one, every request of
    // a type would share one key.
    let describes_body = if forwarded {
        // `Content_Type` too, as for `X-Forwarded-*` above.
        name.as_str().replace('_', "-").starts_with("content-")
    } else {
        [
            http::header::CONTENT_TYPE,
            http::header::CONTENT_ENCODING,
            http::header::CONTENT_LANGUAGE,
        ]
        .contains(&name)
    };
    if describes_body {
        return Err(format!(
            "`{s}` describes the request's body: {}",
            if forwarded {
                "the client's key would replace it on the way to the upstream"
            } else {
                "every request of one type would share its key"
            }
        ));
    }
    // The listener's own (it answers `100-continue` itself): forwarded,
    // the key would never reach the upstream; read, every client that
    // waits for a 100 would send the one key `100-continue`.
    if name == http::header::EXPECT {
        return Err(format!(
            "`{s}` belongs to the listener (it answers 100-continue, and does not pass the header on): \
             the key needs a header of its own"
        ));
    }
    Ok(name)
}

fn upstream_url(s: &str) -> Result<Uri, String> {
    // Checked first, and the URL not repeated: it would carry the password
    // into the message (and, were it accepted, into the Host header).
    let authority = s.split_once("://").map_or(s, |(_, rest)| rest).split('/').next();
    if authority.is_some_and(|a| a.contains('@')) {
        return Err("must not hold a user or password (user@host): the upstream would get it as its Host".into());
    }
    // Shown without its path or query, which may hold a token (as the
    // password above is never shown).
    let shown = match s.split_once("://") {
        Some((scheme, rest)) => &s[..rest.find(['/', '?', '#']).map_or(s.len(), |i| scheme.len() + 3 + i)],
        None => s.split(['/', '?', '#']).next().unwrap_or_default(),
    };
    let uri: Uri = s.parse().map_err(|e| format!("`{shown}` is not a URL ({e})"))?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        _ => return Err(format!("`{shown}` must start with http:// or https://")),
    }
    let (Some(authority), Some(host)) = (uri.authority(), uri.host().filter(|h| !h.is_empty())) else {
        return Err(format!("`{shown}` has no host"));
    };
    // The parser lets any port through, and an unreadable one would be
    // the scheme's (`:80800`, a typo of 8080, would go to port 80).
    if let Some(port) = authority
        .as_str()
        .strip_prefix(host)
        .and_then(|rest| rest.strip_prefix(':'))
        && port.parse::<u16>().map_or(true, |port| port == 0)
    {
        return Err(format!(
            "`{shown}` has the port `{port}`: a port is a number from 1 to 65535"
        ));
    }
    if s.contains('#') {
        return Err(format!(
            "`{shown}` is followed by a fragment (`#...`), which no request carries: give scheme://host[:port] alone"
        ));
    }
    if uri.path() != "/" && !uri.path().is_empty() || uri.query().is_some() {
        return Err(format!(
            "`{shown}` is followed by a path or query (not shown: it may hold a token): \
             give scheme://host[:port] alone"
        ));
    }
    Ok(uri)
}

fn socket_addr(s: &str) -> Result<SocketAddr, String> {
    s.parse()
        .map_err(|_| format!("`{s}` is not an address:port such as \"127.0.0.1:8080\""))
}

/// A JSON pointer's `~` escapes (RFC 6901 §3): `~0` or `~1`, nothing else.
fn escapes(pointer: &str) -> Result<(), String> {
    if pointer.split('~').skip(1).any(|after| !after.starts_with(['0', '1'])) {
        return Err(format!(
            "`{pointer}` is not a JSON pointer: a `~` in a name is written `~0`, a `/` `~1`"
        ));
    }
    Ok(())
}

fn derive_field(s: &str) -> Result<DeriveField, String> {
    let (kind, rest) = s
        .split_once(':')
        .ok_or_else(|| format!("`{s}` must be one of body:/pointer, header:name, path:param, query:name"))?;
    match kind {
        "body" if rest.is_empty() || rest.starts_with('/') => {
            escapes(rest)?;
            Ok(DeriveField::Body(rest.to_string()))
        }
        "body" => Err(format!(
            "`{s}`: a body field is a JSON pointer starting with `/`, e.g. body:/order/id"
        )),
        "header" => request_header_name(rest).map(DeriveField::Header),
        "path" if !rest.is_empty() => Ok(DeriveField::Path(rest.to_string())),
        "query" if !rest.is_empty() => Ok(DeriveField::Query(rest.to_string())),
        _ => Err(format!(
            "`{s}` must be one of body:/pointer, header:name, path:param, query:name"
        )),
    }
}

fn builtin_policy() -> Policy {
    Policy {
        methods: vec![Method::POST, Method::PATCH],
        ttl: Duration::from_secs(24 * 3600),
        lock_timeout: Duration::from_secs(30),
        scope: vec![http::header::AUTHORIZATION],
        on_in_flight: OnInFlight::Reject,
        wait_timeout: Duration::from_secs(10),
        on_server_error: OnServerError::Release,
        on_upstream_failure: OnUpstreamFailure::Release,
        refresh_ttl_on_replay: false,
        max_response_body: 1 << 20,
        forward_key_header: Some(HeaderName::from_static("idempotency-key")),
        replay_drop_headers: vec![http::header::SET_COOKIE],
        mode: Mode::Enforce,
        key: KeyPolicy {
            header: HeaderName::from_static("idempotency-key"),
            required: true,
            max_length: 255,
            derive: Vec::new(),
        },
        fingerprint: FingerprintPolicy {
            headers: vec![http::header::CONTENT_TYPE],
            body: BodyMode::Raw,
            ignore: Vec::new(),
        },
    }
}

/// `raw` overrides `base` field by field; problems are named under `at`.
fn policy(c: &mut Checker, raw: &RawPolicy, base: &Policy, at: &str) -> Policy {
    let f = |name: &str| format!("{at}.{name}");
    let methods = c.field(&f("methods"), raw.methods.as_ref(), base.methods.clone(), |ms| {
        ms.iter()
            .map(|m| {
                let m = m.trim();
                if m.is_empty() || !m.bytes().all(|b| b.is_ascii_uppercase()) {
                    return Err(format!("`{m}` is not an HTTP method in capitals, e.g. \"POST\""));
                }
                // Refused by the listener before any route is looked at.
                if m == "CONNECT" {
                    return Err("`CONNECT` asks for a tunnel, which idemgate refuses (400) before any \
                                route: no route can take it"
                        .to_owned());
                }
                Method::from_bytes(m.as_bytes()).map_err(|_| format!("`{m}` is not an HTTP method"))
            })
            .collect()
    });
    let forward_key_header = c.field(
        &f("forward_key_header"),
        raw.forward_key_header.as_ref(),
        base.forward_key_header.clone(),
        |s| {
            if s.is_empty() {
                Ok(None)
            } else {
                key_header_name(s, true).map(Some)
            }
        },
    );
    let key_at = format!("{at}.key");
    let kf = |name: &str| format!("{key_at}.{name}");
    let key = KeyPolicy {
        header: c.field(&kf("header"), raw.key.header.as_ref(), base.key.header.clone(), |s| {
            key_header_name(s, false)
        }),
        required: raw.key.required.unwrap_or(base.key.required),
        max_length: c.field(
            &kf("max_length"),
            raw.key.max_length.as_ref(),
            base.key.max_length,
            |n| {
                if *n == 0 {
                    Err("must be at least 1".to_string())
                } else {
                    usize::try_from(*n).map_err(|_| "is too large".to_string())
                }
            },
        ),
        derive: c.field(
            &kf("derive"),
            raw.key.derive.as_ref(),
            base.key.derive.clone(),
            |list| {
                let mut fields = list.iter().map(|s| derive_field(s)).collect::<Result<Vec<_>, _>>()?;
                fields.sort_by_key(|f| f.to_string());
                fields.dedup();
                Ok(fields)
            },
        ),
    };
    let fp = &raw.fingerprint;
    let fingerprint = FingerprintPolicy {
        headers: c.field(
            &format!("{at}.fingerprint.headers"),
            fp.headers.as_ref(),
            base.fingerprint.headers.clone(),
            |names| names.iter().map(|n| request_header_name(n)).collect(),
        ),
        body: c.choice(
            &format!("{at}.fingerprint.body"),
            fp.body.as_ref(),
            base.fingerprint.body,
        ),
        ignore: c.field(
            &format!("{at}.fingerprint.ignore"),
            fp.ignore.as_ref(),
            base.fingerprint.ignore.clone(),
            |list| {
                for p in list {
                    if !p.starts_with('/') {
                        return Err(format!(
                            "`{p}` is not a JSON pointer: it starts with `/`, e.g. \"/timestamp\""
                        ));
                    }
                    escapes(p)?;
                }
                // Applied in this order, each removes what it names in the
                // body as sent (see `sort_for_removal`).
                let mut list = list.clone();
                crate::proxy::canonical::sort_for_removal(&mut list);
                Ok(list)
            },
        ),
    };
    let policy = Policy {
        methods,
        ttl: c.duration_at_least(
            &f("ttl"),
            raw.ttl.as_ref(),
            base.ttl,
            Duration::from_secs(1),
            "the stores keep time in milliseconds or coarser, and a record must outlive its own write",
        ),
        lock_timeout: c.duration_at_least(
            &f("lock_timeout"),
            raw.lock_timeout.as_ref(),
            base.lock_timeout,
            Duration::from_secs(1),
            "a shorter lease can run out while the claim is still being written, letting a second request in",
        ),
        scope: c.headers(&f("scope"), raw.scope.as_ref(), &base.scope),
        on_in_flight: c.choice(&f("on_in_flight"), raw.on_in_flight.as_ref(), base.on_in_flight),
        wait_timeout: c.positive_duration(&f("wait_timeout"), raw.wait_timeout.as_ref(), base.wait_timeout),
        on_server_error: c.choice(
            &f("on_server_error"),
            raw.on_server_error.as_ref(),
            base.on_server_error,
        ),
        on_upstream_failure: c.choice(
            &f("on_upstream_failure"),
            raw.on_upstream_failure.as_ref(),
            base.on_upstream_failure,
        ),
        refresh_ttl_on_replay: raw.refresh_ttl_on_replay.unwrap_or(base.refresh_ttl_on_replay),
        max_response_body: c.size(
            &f("max_response_body"),
            raw.max_response_body.as_ref(),
            base.max_response_body,
        ),
        forward_key_header,
        replay_drop_headers: c.headers(
            &f("replay_drop_headers"),
            raw.replay_drop_headers.as_ref(),
            &base.replay_drop_headers,
        ),
        mode: c.choice(&f("mode"), raw.mode.as_ref(), base.mode),
        key,
        fingerprint,
    };
    // A header of the connection differs from hop to hop, and a proxy on
    // the way may drop or rewrite it: no scope to keep records apart by.
    if raw.scope.is_some()
        && let Some(name) = policy.scope.iter().find(|name| crate::wire::is_hop_by_hop(name))
    {
        c.problem(
            &f("scope"),
            format!(
                "`{name}` is a header of the connection, which each hop may change: scope by a header of the request"
            ),
        );
    }
    // The header a scope reads, replaced by the key on the way: records
    // kept apart by what the client sent there, the backend reading the
    // key instead.
    if let Some(name) = &policy.forward_key_header
        && policy.scope.contains(name)
        && (raw.forward_key_header.is_some() || raw.scope.is_some())
    {
        c.problem(
            &f("forward_key_header"),
            format!(
                "`{name}` is in this route's scope: the key forwarded under it would replace the value the scope reads"
            ),
        );
    }
    policy
}

pub fn validate(raw: RawConfig) -> Result<Config, Vec<Problem>> {
    let mut c = Checker { problems: Vec::new() };
    let s = &raw.server;
    let server = ServerConfig {
        listen: c.field(
            "server.listen",
            s.listen.as_ref(),
            SocketAddr::from(([127, 0, 0, 1], 8080)),
            |a| socket_addr(a),
        ),
        admin_listen: c.field(
            "server.admin_listen",
            s.admin_listen.as_ref(),
            Some(SocketAddr::from(([127, 0, 0, 1], 9901))),
            |a| {
                if a.is_empty() {
                    Ok(None)
                } else {
                    socket_addr(a).map(Some)
                }
            },
        ),
        admin_token: c.field("server.admin_token", s.admin_token.as_ref(), None, |t| {
            if t.trim().is_empty() || !t.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
                Err("must be non-empty visible ASCII (or left out to need no token)".to_string())
            } else {
                Ok(Some(t.clone()))
            }
        }),
        tls: s.tls.as_ref().map(|t| TlsConfig {
            cert: PathBuf::from(&t.cert),
            key: PathBuf::from(&t.key),
        }),
        max_request_body: c.size("server.max_request_body", s.max_request_body.as_ref(), 1 << 20),
        header_read_timeout: c.positive_duration(
            "server.header_read_timeout",
            s.header_read_timeout.as_ref(),
            Duration::from_secs(10),
        ),
        shutdown_grace: c.duration(
            "server.shutdown_grace",
            s.shutdown_grace.as_ref(),
            Duration::from_secs(30),
        ),
        workers: c.field(
            "server.workers",
            s.workers.as_ref(),
            std::thread::available_parallelism().map_or(1, |n| n.get()),
            |n| match *n {
                1..=1024 => Ok(*n as usize),
                _ => Err("must be from 1 to 1024".to_string()),
            },
        ),
    };
    // (Port 0 picks a free port for each.)
    if server.admin_listen == Some(server.listen) && server.listen.port() != 0 {
        c.problem(
            "server.admin_listen",
            format!(
                "is server.listen's address ({}): give it another port, or \"\" for none",
                server.listen
            ),
        );
    }
    if let Some(admin) = server.admin_listen
        && !admin.ip().is_loopback()
        && server.admin_token.is_none()
    {
        c.problem(
            "server.admin_token",
            format!(
                "is required when server.admin_listen ({admin}) is not a loopback address: /records can purge records"
            ),
        );
    }

    let u = &raw.upstream;
    let placeholder: Uri = Uri::from_static("http://127.0.0.1:3000");
    let url = match &u.url {
        None => {
            c.problem("upstream.url", "is required, e.g. url = \"http://127.0.0.1:3000\"");
            placeholder
        }
        Some(url) => c.field("upstream.url", Some(url), placeholder, |s| upstream_url(s)),
    };
    let upstream = UpstreamConfig {
        url,
        connect_timeout: c.positive_duration(
            "upstream.connect_timeout",
            u.connect_timeout.as_ref(),
            Duration::from_secs(2),
        ),
        timeout: c.positive_duration("upstream.timeout", u.timeout.as_ref(), Duration::from_secs(30)),
        idle_timeout: c.positive_duration("upstream.idle_timeout", u.idle_timeout.as_ref(), Duration::from_secs(4)),
        ca: u.ca.as_ref().map(PathBuf::from),
    };

    let st = &raw.store;
    let backend_name = st.backend.as_deref().unwrap_or("embedded");
    // Read whatever the backend, so a misspelt size is named at once, not
    // when the backend changes. Below a MiB the memory store's shards
    // (a sixteenth each) would evict every other record with each write.
    let max_memory = c.field("store.max_memory", st.max_memory.as_ref(), 256 << 20, |raw| {
        let size = parse_size(raw)?;
        if size < 1 << 20 {
            return Err("must be at least 1MiB: below it each new record would evict the others".to_string());
        }
        Ok(size)
    });
    let backend = match backend_name {
        "memory" => StoreBackend::Memory { max_memory },
        "embedded" => StoreBackend::Embedded {
            path: PathBuf::from(st.path.as_deref().unwrap_or("idemgate.redb")),
        },
        "redis" => match (&st.url, &st.urls) {
            (Some(_), Some(_)) => {
                c.problem(
                    "store.urls",
                    "give either `url` (one Redis) or `urls` (a Redis Cluster), not both",
                );
                StoreBackend::Redis { url: String::new() }
            }
            (None, Some(urls)) if urls.is_empty() => {
                c.problem("store.urls", "lists no cluster node");
                StoreBackend::Redis { url: String::new() }
            }
            (None, Some(urls)) => StoreBackend::RedisCluster { urls: urls.clone() },
            (Some(url), None) if url.is_empty() => {
                c.problem("store.url", "is empty: give a Redis URL (redis://host:port/db)");
                StoreBackend::Redis { url: String::new() }
            }
            (url, None) => StoreBackend::Redis {
                url: url.clone().unwrap_or_else(|| "redis://127.0.0.1:6379/0".to_string()),
            },
        },
        other => {
            c.problem(
                "store.backend",
                format!("unknown value \"{other}\": expected one of \"memory\", \"embedded\", \"redis\""),
            );
            StoreBackend::Memory { max_memory: 0 }
        }
    };
    // Redis's fields under another backend are a mistake, not a no-op:
    // `url` without `backend = "redis"` would run each replica on a store
    // of its own. (`path` and `max_memory` may stay beside another
    // backend, as SPEC's own sample has them.)
    let defaulted = if st.backend.is_none() { " (the default)" } else { "" };
    let redis_fields = [
        ("store.url", st.url.is_some()),
        ("store.urls", st.urls.is_some()),
        ("store.key_prefix", st.key_prefix.is_some()),
        ("store.wait_for_replicas", st.wait_for_replicas.is_some()),
    ];
    for (field, set) in redis_fields {
        if set && matches!(backend_name, "memory" | "embedded") {
            c.problem(
                field,
                format!("is for backend = \"redis\", and backend is \"{backend_name}\"{defaulted}: set backend = \"redis\" or remove it"),
            );
        }
    }
    // What would otherwise fail only when `serve` opens the store, where
    // `check` says nothing of it.
    match &backend {
        StoreBackend::Embedded { path } => {
            let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
            if path.as_os_str().is_empty() || path.file_name().is_none() {
                c.problem("store.path", "must name a file");
            } else if let Some(dir) = parent.filter(|dir| !dir.is_dir()) {
                c.problem("store.path", format!("its directory {} does not exist", dir.display()));
            } else if path.is_dir() {
                c.problem("store.path", "is a directory: name a file (in it, say)");
            }
        }
        StoreBackend::Redis { url } if !url.is_empty() => redis_url(&mut c, "store.url", url),
        StoreBackend::RedisCluster { urls } => {
            let problems = c.problems.len();
            urls.iter().for_each(|url| redis_url(&mut c, "store.urls", url));
            // Each a Redis URL, and together one cluster's.
            if c.problems.len() == problems
                && let Some(why) = not_one_cluster(urls)
            {
                c.problem("store.urls", format!("cannot name one Redis Cluster ({why})"));
            }
        }
        _ => {}
    }
    let key_prefix = c.field(
        "store.key_prefix",
        st.key_prefix.as_ref(),
        "idemgate".to_owned(),
        |prefix| key_prefix(prefix),
    );
    let wait_for_replicas = c.field(
        "store.wait_for_replicas",
        st.wait_for_replicas.as_ref(),
        0,
        |n| match *n {
            0..=MAX_WAIT_FOR_REPLICAS => Ok(*n as u32),
            _ => Err(format!("must be from 0 to {MAX_WAIT_FOR_REPLICAS}")),
        },
    );
    let store = StoreConfig {
        backend,
        on_error: c.choice("store.on_error", st.on_error.as_ref(), OnStoreError::Reject),
        timeout: c.positive_duration("store.timeout", st.timeout.as_ref(), Duration::from_secs(1)),
        key_prefix,
        wait_for_replicas,
    };

    let defaults = policy(&mut c, &raw.defaults, &builtin_policy(), "defaults");
    let mut routes: Vec<Route> = Vec::new();
    for (i, r) in raw.route.iter().enumerate() {
        let at = format!("route[{i}]");
        let name = match &r.name {
            // Names go into metric labels and log lines as they are.
            Some(n) if n.chars().any(char::is_control) => {
                c.problem(&format!("{at}.name"), "must not hold control characters");
                String::new()
            }
            Some(n) if !n.trim().is_empty() => n.clone(),
            _ => {
                c.problem(&format!("{at}.name"), "is required and must not be empty");
                String::new()
            }
        };
        if !name.is_empty() && routes.iter().any(|other| other.name == name) {
            c.problem(
                &format!("{at}.name"),
                format!("\"{name}\" is already the name of another route"),
            );
        }
        let path = match &r.path {
            None => {
                c.problem(&format!("{at}.path"), "is required, e.g. path = \"/v1/orders\"");
                PathPattern::parse("/").expect("`/` is a pattern")
            }
            Some(p) => c.field(
                &format!("{at}.path"),
                Some(p),
                PathPattern::parse("/").expect("`/` is a pattern"),
                |p| PathPattern::parse(p),
            ),
        };
        let upstream = c.field(&format!("{at}.upstream"), r.upstream.as_ref(), None, |s| {
            upstream_url(s).map(Some)
        });
        let policy = policy(&mut c, &r.policy, &defaults, &at);
        // Checked on the route, where both are resolved: [defaults] may set
        // them for routes that each choose their own body.
        if policy.fingerprint.body == BodyMode::Raw && !policy.fingerprint.ignore.is_empty() {
            c.problem(
                &format!("{at}.fingerprint.ignore"),
                "leaves fields out only with fingerprint.body = \"json\": with \"raw\" every byte of the body \
                 counts, those fields too (set body = \"json\", or drop ignore)",
            );
        }
        for field in &policy.key.derive {
            if let DeriveField::Path(param) = field
                && !path.has_param(param)
            {
                c.problem(
                    &format!("{at}.key.derive"),
                    format!("`path:{param}`: the route path `{path}` has no parameter `{{{param}}}`"),
                );
            }
            // A field that holds one the fingerprint leaves out as
            // volatile: a retry that changed it would get another key and
            // run again (`body:`, the whole body, holds every one).
            if let DeriveField::Body(pointer) = field
                && let Some(ignored) = policy.fingerprint.ignore.iter().find(|ignored| {
                    ignored
                        .strip_prefix(pointer.as_str())
                        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
                })
            {
                c.problem(
                    &format!("{at}.key.derive"),
                    format!(
                        "`{field}` holds `{ignored}`, which fingerprint.ignore leaves out as volatile: a retry \
                         that changed it would get another key and run again; derive the key from the fields \
                         that identify the request"
                    ),
                );
            }
        }
        routes.push(Route {
            name,
            path,
            host: c.field(&format!("{at}.host"), r.host.as_ref(), None, |h| {
                route_host(h).map(Some)
            }),
            upstream,
            policy,
        });
    }

    if c.problems.is_empty() {
        Ok(Config {
            server,
            upstream,
            store,
            routes,
        })
    } else {
        Err(c.problems)
    }
}

/// A route's `host` as requests' hosts are compared with it: lower case,
/// without a fully qualified name's trailing dot. Anything a request's host
/// can never equal (a port, a scheme, a path, a wildcard) is refused rather
/// than left to match nothing, which would pass every request through.
fn route_host(raw: &str) -> Result<String, String> {
    let host = raw.trim_end_matches('.').to_ascii_lowercase();
    let ipv6 = host.strip_prefix('[').and_then(|h| h.strip_suffix(']'));
    if ipv6.is_some_and(|ip| ip.parse::<std::net::Ipv6Addr>().is_ok()) {
        return Ok(host);
    }
    if let Some((name, port)) = host.rsplit_once(':')
        && port.parse::<u16>().is_ok()
        && !name.contains(':')
    {
        return Err(format!(
            "`{raw}`: a route's host matches whatever the port; write it without `:{port}`"
        ));
    }
    let valid = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_');
    if host.is_empty() || !host.bytes().all(valid) {
        return Err(format!(
            "`{raw}` is not a host name or address (e.g. \"api.example.com\", \"10.0.0.7\", \"[::1]\"): \
             no scheme, port, path or wildcard"
        ));
    }
    Ok(host)
}

/// A problem on `field` unless `url` is a Redis URL the client can use.
/// A `store.key_prefix`: what Redis key patterns and `SCAN MATCH` take
/// as written (visible ASCII; no glob characters, which a user's key
/// pattern `~<prefix>:*` would read as such; no braces, which would move
/// the hash tag that keeps a record in one slot; no `:`, so no prefix's
/// pattern, `~a:*`, also covers another's keys, `a:b:{...}`).
fn key_prefix(prefix: &str) -> Result<String, String> {
    if prefix.is_empty() {
        return Err("is empty: give a name, e.g. key_prefix = \"orders\"".into());
    }
    if prefix.len() > MAX_KEY_PREFIX {
        return Err(format!("is {} bytes long: at most {MAX_KEY_PREFIX}", prefix.len()));
    }
    if let Some(bad) = prefix
        .chars()
        .find(|c| !c.is_ascii_graphic() || matches!(c, '{' | '}' | '*' | '?' | '[' | ']' | '\\' | ':'))
    {
        return Err(format!(
            "may not hold {bad:?}: letters, digits and punctuation but for {{ }} * ? [ ] \\ : only"
        ));
    }
    Ok(prefix.to_owned())
}

/// Why `urls`, each a Redis URL, cannot name one Redis Cluster, if they
/// cannot: every node is reached with the first URL's user, password and
/// database, at the TCP address the cluster names it by.
fn not_one_cluster(urls: &[String]) -> Option<&'static str> {
    use redis::IntoConnectionInfo;
    let infos: Vec<_> = urls
        .iter()
        .filter_map(|url| url.as_str().into_connection_info().ok())
        .collect();
    let first = infos.first()?.redis_settings();
    for info in &infos {
        let settings = info.redis_settings();
        if matches!(info.addr(), redis::ConnectionAddr::Unix(_)) {
            return Some("a Unix socket: a cluster names its nodes by TCP address");
        }
        if settings.password() != first.password() {
            return Some("different passwords");
        }
        if settings.username() != first.username() {
            return Some("different users");
        }
        if settings.db() != first.db() {
            return Some("different databases");
        }
    }
    None
}

fn redis_url(c: &mut Checker, field: &str, url: &str) {
    use redis::IntoConnectionInfo;
    if let Err(error) = url.into_connection_info() {
        c.problem(field, format!("is not a Redis URL ({error})"));
    }
}
