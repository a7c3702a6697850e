//! Configuration: the raw TOML mirror (`raw.rs`) is validated into the typed
//! [`Config`] the rest of the crate uses.
//!
//! Loading never panics on bad input: every problem found is collected into
//! one [`ConfigError`] that names the file and each offending field.

mod raw;
mod route;
mod validate;

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::{HeaderName, Method, Uri};

#[cfg(test)]
pub(crate) use route::PATH_AS_IS;
pub use route::{
    PathPattern, RouteMatch, as_backends_may_read, decode_unreserved, remove_dot_segments, slashes_decoded,
};

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub upstream: UpstreamConfig,
    pub store: StoreConfig,
    pub routes: Vec<Route>,
}

#[derive(Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// `None` when `admin_listen = ""`.
    pub admin_listen: Option<SocketAddr>,
    /// Bearer token required by the admin `/records` endpoint, if set.
    pub admin_token: Option<String>,
    pub tls: Option<TlsConfig>,
    pub max_request_body: u64,
    pub header_read_timeout: Duration,
    pub shutdown_grace: Duration,
    /// Accept loops, each a single-threaded runtime on a thread of its own
    /// sharing the port (SO_REUSEPORT). Default: one per core.
    pub workers: usize,
}

/// The admin token shown as whether there is one, so a config printed for
/// debugging shows no secret (as the Redis URLs' passwords are masked).
impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ServerConfig {
            listen,
            admin_listen,
            admin_token,
            tls,
            max_request_body,
            header_read_timeout,
            shutdown_grace,
            workers,
        } = self;
        f.debug_struct("ServerConfig")
            .field("listen", listen)
            .field("admin_listen", admin_listen)
            .field("admin_token", &admin_token.as_ref().map(|_| "<redacted>"))
            .field("tls", tls)
            .field("max_request_body", max_request_body)
            .field("header_read_timeout", header_read_timeout)
            .field("shutdown_grace", shutdown_grace)
            .field("workers", workers)
            .finish()
    }
}

#[derive(Debug, Clone)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    pub url: Uri,
    pub connect_timeout: Duration,
    pub timeout: Duration,
    /// How long a pooled upstream connection may sit idle before it is
    /// closed rather than reused.
    pub idle_timeout: Duration,
    pub ca: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub backend: StoreBackend,
    pub on_error: OnStoreError,
    /// Deadline of one store operation.
    pub timeout: Duration,
    /// Redis: what every record's key begins with, `<key_prefix>:{...}`,
    /// so deployments in front of different services can share a Redis
    /// (a Redis Cluster has one database).
    pub key_prefix: String,
    /// Redis: how many replicas must hold a write before it counts (each
    /// batch of commands is followed by `WAIT`); 0, once the primary has it.
    pub wait_for_replicas: u32,
}

/// The most `store.wait_for_replicas` may ask for.
pub const MAX_WAIT_FOR_REPLICAS: u64 = 64;

/// The longest `store.key_prefix`.
pub const MAX_KEY_PREFIX: usize = 64;

#[derive(Clone, PartialEq, Eq)]
pub enum StoreBackend {
    Memory { max_memory: u64 },
    Embedded { path: PathBuf },
    Redis { url: String },
    RedisCluster { urls: Vec<String> },
}

/// Redis URLs with their passwords masked, so a config printed for
/// debugging shows none.
impl std::fmt::Debug for StoreBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreBackend::Memory { max_memory } => f.debug_struct("Memory").field("max_memory", max_memory).finish(),
            StoreBackend::Embedded { path } => f.debug_struct("Embedded").field("path", path).finish(),
            StoreBackend::Redis { url } => f.debug_struct("Redis").field("url", &masked(url)).finish(),
            StoreBackend::RedisCluster { urls } => f
                .debug_struct("RedisCluster")
                .field("urls", &urls.iter().map(|u| masked(u)).collect::<Vec<_>>())
                .finish(),
        }
    }
}

/// `url` with its passwords shown as `***`: that of its user part, and
/// the `pass` (or `password`) of its query, which a Unix socket's URL
/// carries (`redis+unix:///run/redis.sock?pass=...`).
fn masked(url: &str) -> String {
    let (url, query) = match url.split_once('?') {
        Some((url, query)) => (url, Some(query)),
        None => (url, None),
    };
    let mut out = match url.split_once("://") {
        Some((scheme, rest)) => {
            let authority_end = rest.find('/').unwrap_or(rest.len());
            match rest[..authority_end]
                .rfind('@')
                .and_then(|at| Some((rest[..at].split_once(':')?.0, at)))
            {
                Some((user, at)) => format!("{scheme}://{user}:***{}", &rest[at..]),
                None => url.to_string(),
            }
        }
        None => url.to_string(),
    };
    if let Some(query) = query {
        out.push('?');
        for (i, pair) in query.split('&').enumerate() {
            if i > 0 {
                out.push('&');
            }
            match pair.split_once('=') {
                Some((name, _)) if matches!(name, "pass" | "password") => {
                    out.push_str(name);
                    out.push_str("=***");
                }
                _ => out.push_str(pair),
            }
        }
    }
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnStoreError {
    Reject,
    Pass,
}

/// A field that takes one of a few words: each value with its spelling in
/// the TOML, which validation reads and `idemgate check` prints.
pub trait Choice: Copy + PartialEq + 'static {
    const NAMES: &'static [(&'static str, Self)];

    fn name(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(_, value)| *value == self)
            .map(|(name, _)| *name)
            .expect("every value has a name")
    }
}

impl Choice for OnStoreError {
    const NAMES: &'static [(&'static str, Self)] = &[("reject", Self::Reject), ("pass", Self::Pass)];
}

/// One `[[route]]` with every policy field resolved.
#[derive(Debug, Clone)]
pub struct Route {
    pub name: String,
    pub path: PathPattern,
    pub host: Option<String>,
    /// This route's backend, if not `[upstream].url`.
    pub upstream: Option<Uri>,
    pub policy: Policy,
}

/// What idemgate does on a route: `[defaults]` overridden field by field.
#[derive(Debug, Clone)]
pub struct Policy {
    pub methods: Vec<Method>,
    pub ttl: Duration,
    pub lock_timeout: Duration,
    pub scope: Vec<HeaderName>,
    pub on_in_flight: OnInFlight,
    pub wait_timeout: Duration,
    pub on_server_error: OnServerError,
    pub on_upstream_failure: OnUpstreamFailure,
    pub refresh_ttl_on_replay: bool,
    pub max_response_body: u64,
    /// `None` when the key is not forwarded upstream.
    pub forward_key_header: Option<HeaderName>,
    pub replay_drop_headers: Vec<HeaderName>,
    pub mode: Mode,
    pub key: KeyPolicy,
    pub fingerprint: FingerprintPolicy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnInFlight {
    Reject,
    Wait,
}

impl Choice for OnInFlight {
    const NAMES: &'static [(&'static str, Self)] = &[("reject", Self::Reject), ("wait", Self::Wait)];
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnServerError {
    Release,
    Store,
}

impl Choice for OnServerError {
    const NAMES: &'static [(&'static str, Self)] = &[("release", Self::Release), ("store", Self::Store)];
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnUpstreamFailure {
    Release,
    Unknown,
}

impl Choice for OnUpstreamFailure {
    const NAMES: &'static [(&'static str, Self)] = &[("release", Self::Release), ("unknown", Self::Unknown)];
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Enforce,
    Shadow,
}

impl Choice for Mode {
    const NAMES: &'static [(&'static str, Self)] = &[("enforce", Self::Enforce), ("shadow", Self::Shadow)];
}

#[derive(Debug, Clone)]
pub struct KeyPolicy {
    pub header: HeaderName,
    pub required: bool,
    pub max_length: usize,
    /// Fields a key is derived from when the header is absent; empty: none.
    pub derive: Vec<DeriveField>,
}

/// One entry of `key.derive`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeriveField {
    /// `body:/json/pointer`
    Body(String),
    /// `header:name`
    Header(HeaderName),
    /// `path:param`
    Path(String),
    /// `query:name`
    Query(String),
}

impl fmt::Display for DeriveField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeriveField::Body(p) => write!(f, "body:{p}"),
            DeriveField::Header(h) => write!(f, "header:{h}"),
            DeriveField::Path(p) => write!(f, "path:{p}"),
            DeriveField::Query(q) => write!(f, "query:{q}"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct FingerprintPolicy {
    pub headers: Vec<HeaderName>,
    pub body: BodyMode,
    /// JSON pointers left out with `body = "json"`.
    pub ignore: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyMode {
    Raw,
    Json,
    None,
}

impl Choice for BodyMode {
    const NAMES: &'static [(&'static str, Self)] = &[("raw", Self::Raw), ("json", Self::Json), ("none", Self::None)];
}

/// Everything wrong with one configuration file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The cause is in the message, not a source too: printed with its
    /// chain, it would be said twice.
    #[error("{file}: cannot read: {cause}")]
    Read { file: String, cause: std::io::Error },
    #[error("{file}: {message}")]
    Parse { file: String, message: String },
    #[error("{file}: {} problem(s):\n{}", .problems.len(), list(.problems))]
    Invalid { file: String, problems: Vec<Problem> },
}

/// One invalid field: where it is, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub field: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

fn list(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| format!("  - {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}

impl Config {
    /// Reads and validates the file at `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|cause| ConfigError::Read {
            file: file.clone(),
            cause,
        })?;
        // TOML is UTF-8: where it is not, say where, as for any other error.
        let text = String::from_utf8(bytes).map_err(|error| {
            let before = &error.as_bytes()[..error.utf8_error().valid_up_to()];
            let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
            let line_start = before.iter().rposition(|&b| b == b'\n').map_or(0, |at| at + 1);
            // Valid UTF-8 up to here: its characters count the columns.
            let column = std::str::from_utf8(&before[line_start..]).map_or(0, |l| l.chars().count()) + 1;
            ConfigError::Parse {
                file: file.clone(),
                message: format!("line {line}, column {column}: the file is not UTF-8 text, as TOML must be"),
            }
        })?;
        Config::parse(&text, &file)
    }

    /// Validates TOML `text`; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Config, ConfigError> {
        let raw: raw::RawConfig = toml::from_str(text).map_err(|e| {
            // Where, which field and why, without the line itself, which
            // may hold a token or a password.
            let field = field_of(text)
                .or_else(|| e.span().and_then(|span| key_at(text, span.start)))
                .map(|f| format!("{f}: "))
                .unwrap_or_default();
            let why = without_value(e.message().trim_end());
            ConfigError::Parse {
                file: file.to_string(),
                message: match e.span() {
                    Some(span) => {
                        let before = &text[..span.start.min(text.len())];
                        let line = before.matches('\n').count() + 1;
                        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
                        format!("line {line}, column {column}: {field}{why}")
                    }
                    None => format!("{field}{why}"),
                },
            }
        })?;
        validate::validate(raw).map_err(|problems| ConfigError::Invalid {
            file: file.to_string(),
            problems,
        })
    }

    /// The upstream of `route`.
    pub fn upstream_of<'a>(&'a self, route: &'a Route) -> &'a Uri {
        route.upstream.as_ref().unwrap_or(&self.upstream.url)
    }
}

impl Route {
    /// Whether `method` is one this route makes idempotent.
    pub fn accepts(&self, method: &Method) -> bool {
        self.policy.methods.contains(method)
    }
}

/// The field a file that parses as TOML but not as a config went wrong at,
/// as validation names fields (`route[1].ttl`); `None` for a syntax error.
///
/// The parser's error knows the field but keeps it private; deserialising
/// the parsed table again says it (as ``"…\nin `route.ttl`"``), and the
/// routes one by one say which route.
fn field_of(text: &str) -> Option<String> {
    use serde::Deserialize;

    let table: toml::Table = toml::from_str(text).ok()?;
    let routes = table.get("route").cloned();
    let error = raw::RawConfig::deserialize(toml::Value::Table(table))
        .err()?
        .to_string();
    let (_, path) = error.trim_end().rsplit_once("\nin `")?;
    let path = path.strip_suffix('`')?;
    let Some(within) = path
        .strip_prefix("route")
        .filter(|rest| rest.is_empty() || rest.starts_with('.'))
    else {
        return Some(path.to_string());
    };
    let index = match routes {
        Some(toml::Value::Array(routes)) => routes.into_iter().position(|r| raw::RawRoute::deserialize(r).is_err()),
        _ => None,
    };
    Some(match index {
        Some(i) => format!("route[{i}]{within}"),
        None => path.to_string(),
    })
}

/// The field whose `key = value` line holds byte `at` of `text`, named
/// as validation names fields (`store.timeout`, `route[1].key.header`):
/// for an error in a file that does not parse as TOML at all (an integer
/// past 64 bits), which [`field_of`] cannot name. `None` on any other
/// line.
fn key_at(text: &str, at: usize) -> Option<String> {
    let start = text[..at.min(text.len())].rfind('\n').map_or(0, |i| i + 1);
    let (key, _) = text[start..].lines().next()?.split_once('=')?;
    let key = key.trim();
    let bare = |name: &str| {
        !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    };
    if !bare(key) {
        return None;
    }
    // The table it is in: the last header before it, a `[[route]]` (or
    // a table under one) by its index.
    let mut table: Option<String> = None;
    let mut routes = 0;
    for header in text[..start].lines().map(str::trim).filter(|l| l.starts_with('[')) {
        let array = header.starts_with("[[");
        let name = header.trim_start_matches('[').split(']').next()?.trim();
        if !bare(name) {
            return None;
        }
        if array && name == "route" {
            routes += 1;
        }
        table = Some(match name.strip_prefix("route") {
            Some(rest) if routes > 0 && (rest.is_empty() || rest.starts_with('.')) => {
                format!("route[{}]{rest}", routes - 1)
            }
            _ => name.to_owned(),
        });
    }
    Some(match table {
        Some(table) => format!("{table}.{key}"),
        None => key.to_owned(),
    })
}

/// A parser's message without the value it quotes: ``invalid type: string
/// "redis://:pw@..."`, expected a sequence`` would put a password or token
/// into the error (and, on a reload, the log).
fn without_value(message: &str) -> String {
    for prefix in ["invalid type: ", "invalid value: "] {
        if let Some(rest) = message.strip_prefix(prefix) {
            let kind = rest.split(['`', '"', ',']).next().unwrap_or("").trim_end();
            let expected = rest.rfind(", expected").map_or("", |at| &rest[at..]);
            return format!("{prefix}{kind}{expected}");
        }
    }
    message.to_string()
}

/// `bytes` as the config would write it: in the largest unit it is a whole
/// number of.
fn size(bytes: u64) -> String {
    [("GiB", 30), ("MiB", 20), ("KiB", 10)]
        .iter()
        .find(|&&(_, shift)| bytes != 0 && bytes.is_multiple_of(1 << shift))
        .map_or_else(
            || bytes.to_string(),
            |&(unit, shift)| format!("{}{unit}", bytes >> shift),
        )
}

/// What is valid but unwise in `config`, one line each: warned about at
/// start, on a reload and by `idemgate check`.
pub fn warnings(config: &Config) -> Vec<String> {
    let d = |d: Duration| humantime::format_duration(d).to_string();
    let store_timeout = config.store.timeout;
    let leases = config
        .routes
        .iter()
        .enumerate()
        .filter(|(_, route)| route.policy.lock_timeout < store_timeout.saturating_mul(3))
        .map(|(i, route)| {
            format!(
                "route[{i}] {}: lock_timeout {} is under three times store.timeout ({}): a renewal of \
                 the lease, due every third of it, may take longer than what is left, and a second \
                 request then reach the upstream",
                route.name,
                d(route.policy.lock_timeout),
                d(store_timeout),
            )
        });
    // A replay from Redis reads the whole record back within the store
    // timeout (its claim finds it), and nothing can tell its size before:
    // a record larger than that time moves fails every retry's claim.
    let shared = matches!(
        config.store.backend,
        StoreBackend::Redis { .. } | StoreBackend::RedisCluster { .. }
    );
    let readable = (crate::store::STORE_BYTES_PER_SECOND as f64 * store_timeout.as_secs_f64()) as u64;
    let large = config
        .routes
        .iter()
        .enumerate()
        .filter(move |(_, route)| shared && route.policy.max_response_body > readable);
    let large = large.map(|(i, route)| {
        format!(
            "route[{i}] {}: max_response_body ({} bytes) is more than Redis may be counted on to send \
             back within store.timeout ({}, about {readable} bytes): the replay of an answer that \
             large may time out on every retry (503, or forwarded unprotected with on_error = \"pass\")",
            route.name,
            route.policy.max_response_body,
            d(store_timeout),
        )
    });
    // A request for such a path reads elsewhere with `;` dropped or `//`
    // merged, as some backends read it, and is refused (400).
    let unreachable = config
        .routes
        .iter()
        .enumerate()
        .filter(|(_, route)| {
            let path = route.path.to_string();
            path.contains(';') || path.contains("//")
        })
        .map(|(i, route)| {
            format!(
                "route[{i}] {}: path holds `;` or `//`: a request for it reads elsewhere as some \
                 backends read it (parameters dropped, slashes merged) and is refused with 400",
                route.name,
            )
        });
    // `/files/*` or `/orders/:id` as Express, Gin or older axum write
    // them: a route for that literal text, which no request is likely to
    // send.
    let foreign = config.routes.iter().enumerate().filter_map(|(i, route)| {
        let segment = route.path.foreign_wildcard()?;
        Some(format!(
            "route[{i}] {}: path segment `{segment}` is matched as that very text; write {{name}} for \
             any one segment and {{*name}} for the rest of the path",
            route.name,
        ))
    });
    // Routes are matched in order, the first that takes a request's path
    // and method winning: one listed after another that takes all its
    // requests never sees one. (Judged by two sample paths of its own, so
    // `/v1/{a}/x` before `/v1/{b}/{c}`, or `/v1/{id}` before `/v1/{*rest}`,
    // is not taken for a shadow.)
    let shadowed = config.routes.iter().enumerate().filter_map(|(j, later)| {
        let samples = [later.path.sample("x", 1), later.path.sample("y9", 2)];
        let (i, earlier) = config.routes[..j].iter().enumerate().find(|(_, earlier)| {
            let host = match (&earlier.host, &later.host) {
                (None, _) => true,
                (Some(a), Some(b)) => a.eq_ignore_ascii_case(b),
                (Some(_), None) => false,
            };
            host && samples.iter().all(|path| earlier.path.matches(path).is_some())
                && later.policy.methods.iter().all(|m| earlier.accepts(m))
        })?;
        Some(format!(
            "route[{j}] {}: never reached: route[{i}] {}, listed before it, takes every request for its \
             path and methods (routes are matched in order: list the narrower first)",
            later.name, earlier.name,
        ))
    });
    // Legal (requests for its path pass through to its upstream, unless a
    // later route takes them), but more likely a slip than a pass-through
    // route.
    let no_methods = config
        .routes
        .iter()
        .enumerate()
        .filter(|(_, route)| route.policy.methods.is_empty());
    let no_methods = no_methods.map(|(i, route)| {
        format!(
            "route[{i}] {}: methods is empty: it claims no request; requests for its path pass \
             through to its upstream, unless a later route claims them",
            route.name
        )
    });
    leases
        .chain(large)
        .chain(unreachable)
        .chain(foreign)
        .chain(shadowed)
        .chain(no_methods)
        .collect()
}

/// The store and its settings, its passwords masked: for `idemgate check`
/// and the line logged at start.
pub fn store_summary(config: &Config) -> String {
    let copies = match config.store.wait_for_replicas {
        0 => String::new(),
        n => format!(", wait_for_replicas {n}"),
    };
    match &config.store.backend {
        StoreBackend::Memory { max_memory } => format!("memory (max_memory {})", size(*max_memory)),
        StoreBackend::Embedded { path } => format!("embedded (path {})", path.display()),
        StoreBackend::Redis { url } => format!(
            "redis (url {}, key_prefix {}{copies})",
            masked(url),
            config.store.key_prefix
        ),
        StoreBackend::RedisCluster { urls } => {
            let urls: Vec<String> = urls.iter().map(|u| masked(u)).collect();
            format!(
                "redis cluster (urls {}, key_prefix {}{copies})",
                urls.join(", "),
                config.store.key_prefix
            )
        }
    }
}

/// The effective routes, one block each, as `idemgate check` prints them,
/// in the config's own words.
pub fn describe(config: &Config) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let d = |d: Duration| humantime::format_duration(d).to_string();
    let names = |v: &[HeaderName]| v.iter().map(|h| h.as_str()).collect::<Vec<_>>().join(", ");
    let server = &config.server;
    let admin = match (server.admin_listen, &server.admin_token) {
        (None, _) => "off".to_owned(),
        // The token itself is a secret: whether there is one.
        (Some(addr), Some(_)) => format!("{addr} (records: with the token)"),
        (Some(addr), None) => format!("{addr} (records: from this machine only)"),
    };
    let tls = server.tls.as_ref().map_or_else(
        || "off".to_owned(),
        |tls| format!("cert {} key {}", tls.cert.display(), tls.key.display()),
    );
    let _ = writeln!(
        out,
        "server   listen {}  admin {admin}  tls {tls}  workers {}",
        server.listen, server.workers
    );
    let _ = writeln!(
        out,
        "         max_request_body {}  header_read_timeout {}  shutdown_grace {}",
        size(server.max_request_body),
        d(server.header_read_timeout),
        d(server.shutdown_grace)
    );
    let upstream = &config.upstream;
    // As the client applies it.
    let connect = upstream.connect_timeout.min(upstream.timeout / 2);
    let capped = if connect < upstream.connect_timeout {
        " (half of timeout)"
    } else {
        ""
    };
    let _ = writeln!(
        out,
        "upstream {}  connect_timeout {}{capped}  timeout {}  idle_timeout {}  ca {}",
        upstream.url,
        d(connect),
        d(upstream.timeout),
        d(upstream.idle_timeout),
        upstream.ca.as_ref().map_or_else(
            || "(webpki roots)".to_owned(),
            |ca| format!("{} and the webpki roots", ca.display())
        )
    );
    let _ = writeln!(
        out,
        "store    {}, on_error {}  timeout {}",
        store_summary(config),
        config.store.on_error.name(),
        d(config.store.timeout)
    );
    for route in &config.routes {
        let p = &route.policy;
        let methods: Vec<&str> = p.methods.iter().map(Method::as_str).collect();
        let key = if p.key.derive.is_empty() {
            format!("header {} (required: {})", p.key.header, p.key.required)
        } else {
            let fields: Vec<String> = p.key.derive.iter().map(ToString::to_string).collect();
            format!("header {}, else derived from [{}]", p.key.header, fields.join(", "))
        };
        let _ = writeln!(out, "route {}", route.name);
        let _ = writeln!(
            out,
            "  match    {} {}{}",
            methods.join(","),
            route.path,
            route.host.as_ref().map(|h| format!(" host {h}")).unwrap_or_default()
        );
        let _ = writeln!(out, "  upstream {}", config.upstream_of(route));
        let _ = writeln!(
            out,
            "  key      {key}, max_length {}; scope [{}]; forwarded as {}",
            p.key.max_length,
            names(&p.scope),
            p.forward_key_header.as_ref().map_or("(not sent)", HeaderName::as_str)
        );
        let _ = writeln!(
            out,
            "  ttl      {}  lock_timeout {}  refresh_ttl_on_replay {}",
            d(p.ttl),
            d(p.lock_timeout),
            p.refresh_ttl_on_replay
        );
        let _ = writeln!(
            out,
            "  on       in_flight {} (wait {})  server_error {}  upstream_failure {}  mode {}",
            p.on_in_flight.name(),
            d(p.wait_timeout),
            p.on_server_error.name(),
            p.on_upstream_failure.name(),
            p.mode.name()
        );
        let _ = writeln!(
            out,
            "  fingerprint body {} headers [{}] ignore [{}]; max_response_body {}",
            p.fingerprint.body.name(),
            names(&p.fingerprint.headers),
            p.fingerprint.ignore.join(", "),
            size(p.max_response_body)
        );
        let _ = writeln!(out, "  replay   drops [{}]", names(&p.replay_drop_headers));
    }
    out
}
