//! Logging through `tracing` (with `warn_throttled!` for the warnings a
//! store that is down would repeat for every request) and the process's
//! metrics.

pub mod metrics;

pub use metrics::{Metrics, Outcome, RouteCounters};

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The current request's span (see `Gateway::handle`), when there is one
/// to record on. It is at DEBUG: above that, one load of the level filter
/// settles it, where looking up the current span would cost more than the
/// request's other bookkeeping.
pub fn request_span() -> Option<tracing::Span> {
    if !tracing::level_enabled!(tracing::Level::DEBUG) {
        return None;
    }
    let span = tracing::Span::current();
    (!span.is_disabled()).then_some(span)
}

/// An error and its sources, for a log line.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        // A cause that says what the error before it said already (the
        // redis crate's errors repeat their own) is said once.
        let said = cause.to_string();
        if !text.ends_with(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = cause.source();
    }
    text
}

/// At most one line a second for a warning that may come with every
/// request, such as a store that is down: the first goes out at once, the
/// others of that second are counted, and the next line that goes out
/// says how many (`suppressed`). The metrics count every one.
pub struct Throttle {
    /// When the next line may go out, on [`crate::clock::coarse_ms`].
    next: AtomicU64,
    suppressed: AtomicU64,
    /// Milliseconds between two lines that go out.
    every: u64,
}

impl Throttle {
    pub const fn new() -> Throttle {
        Throttle::every(Duration::from_secs(1))
    }

    /// At most one line each `period`.
    pub const fn every(period: Duration) -> Throttle {
        Throttle {
            next: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
            every: period.as_millis() as u64,
        }
    }

    /// Whether this line may go out now; if so, how many were held back
    /// since the last one that did.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(crate::clock::coarse_ms())
    }

    fn admit_at(&self, now: u64) -> Option<u64> {
        let next = self.next.load(Ordering::Relaxed);
        if now < next
            || self
                .next
                .compare_exchange(next, now + self.every, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(self.suppressed.swap(0, Ordering::Relaxed))
    }
}

impl Default for Throttle {
    fn default() -> Throttle {
        Throttle::new()
    }
}

/// `tracing::event!(level, fields.., "message")` with `error`'s chain,
/// from each place it is written at most once a second (a [`Throttle`] of
/// its own), with `suppressed`.
macro_rules! throttled {
    ($level:expr, $error:expr, $message:literal, $($field:tt)+) => {{
        static THROTTLE: $crate::telemetry::Throttle = $crate::telemetry::Throttle::new();
        if let Some(suppressed) = THROTTLE.admit() {
            let error = $crate::telemetry::error_chain(&$error);
            tracing::event!($level, $($field)+, %error, suppressed, $message);
        }
    }};
}
pub(crate) use throttled;

/// [`throttled`] at `WARN`.
macro_rules! warn_throttled {
    ($($args:tt)+) => {
        $crate::telemetry::throttled!(tracing::Level::WARN, $($args)+)
    };
}
pub(crate) use warn_throttled;

/// The log filter without `RUST_LOG`: `info`, but the Redis client's
/// own warnings, which it makes for every request while a cluster node is
/// down (over a hundred lines a second, probe), only as errors: idemgate
/// says what failed, a line a second, itself.
pub const DEFAULT_FILTER: &str = "info,redis=error";

/// Libraries whose DEBUG and TRACE lines quote what a client sent (the
/// `h2` crate quotes a malformed path, authority or header value, which
/// may hold a key or a token): held at INFO at most, whatever `RUST_LOG`
/// says, unless it names them itself.
const QUOTING: [&str; 1] = ["h2"];

/// Whether `target` is `module` or one of its modules.
fn within(target: &str, module: &str) -> bool {
    target
        .strip_prefix(module)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
}

/// The log filter of `RUST_LOG`'s value, `spec`: [`DEFAULT_FILTER`]
/// without one, when it is empty (`Environment=RUST_LOG=` under systemd,
/// an unset variable in a compose file), or when it does not parse, with
/// why it did not.
fn env_filter(spec: Option<&str>) -> (tracing_subscriber::EnvFilter, Option<String>) {
    use tracing_subscriber::EnvFilter;
    match spec.map(str::trim).filter(|spec| !spec.is_empty()) {
        None => (EnvFilter::new(DEFAULT_FILTER), None),
        Some(spec) => match EnvFilter::try_new(spec) {
            Ok(filter) => (filter, None),
            Err(error) => (
                EnvFilter::new(DEFAULT_FILTER),
                Some(format!(
                    "RUST_LOG={spec:?} is not a log filter ({error}): logging at {DEFAULT_FILTER}"
                )),
            ),
        },
    }
}

/// Whether a line of `metadata` may be written beside `spec`'s filter:
/// one of the [`QUOTING`] libraries' above INFO only where a directive of
/// `spec` names its module or one around it (`h2`, `h2::codec`), not
/// scoped to a span. A cap of its own, not a directive added to the
/// filter: a directive for a span (`[Connection]=debug`, a span of `h2`'s
/// own) or for a prefix (`h=debug`) enables DEBUG lines a target directive
/// would not hold back.
fn uncapped(spec: Option<&str>) -> impl Fn(&tracing::Metadata<'_>) -> bool + Send + Sync + 'static {
    // A directive scoped to a span (`h2[Connection]=debug`) names no
    // module: it would lift the cap outside the span too.
    let named: Vec<String> = spec
        .unwrap_or_default()
        .split(',')
        .filter(|directive| !directive.contains('['))
        .filter_map(|directive| directive.trim().split('=').next())
        .filter(|target| QUOTING.iter().any(|library| within(target, library)))
        .map(str::to_owned)
        .collect();
    move |metadata| {
        let target = metadata.target();
        *metadata.level() <= tracing::Level::INFO
            || !QUOTING.iter().any(|library| within(target, library))
            || named.iter().any(|module| within(target, module))
    }
}

/// Installs the global subscriber: `RUST_LOG` filters (default
/// [`DEFAULT_FILTER`]; the `h2` crate held at INFO at most unless named),
/// `IDEMGATE_LOG_FORMAT=json` selects JSON lines instead of text. Text is
/// coloured only on a terminal (and without `NO_COLOR`): a service
/// manager, a container runtime or a file gets plain lines.
pub fn init() {
    use std::io::IsTerminal;
    use tracing_subscriber::prelude::*;
    let spec = std::env::var("RUST_LOG").ok();
    let (filter, refused) = env_filter(spec.as_deref());
    let cap = tracing_subscriber::filter::filter_fn(uncapped(spec.as_deref()));
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let layer = tracing_subscriber::fmt::layer()
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    let format = std::env::var("IDEMGATE_LOG_FORMAT").unwrap_or_default();
    let json = format.eq_ignore_ascii_case("json");
    let registry = tracing_subscriber::registry().with(filter);
    let _ = if json {
        registry.with(layer.json().with_filter(cap)).try_init()
    } else {
        registry.with(layer.with_filter(cap)).try_init()
    };
    if let Some(refused) = refused {
        tracing::warn!("{refused}");
    }
    if !json && !format.is_empty() && !format.eq_ignore_ascii_case("text") {
        tracing::warn!("IDEMGATE_LOG_FORMAT is {format:?}, neither \"json\" nor \"text\": logging text");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error, by its text, and its source.
    #[derive(Debug)]
    struct Said(&'static str, Option<Box<Said>>);

    impl std::fmt::Display for Said {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Said {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn a_cause_that_repeats_the_error_before_it_is_said_once() {
        let said = |text, source: Option<Said>| Said(text, source.map(Box::new));
        let repeated = said(
            "store unavailable",
            Some(said("OOM: no room", Some(said("OOM: no room", None)))),
        );
        assert_eq!(error_chain(&repeated), "store unavailable: OOM: no room");
        let distinct = said("a", Some(said("b", Some(said("c", None)))));
        assert_eq!(error_chain(&distinct), "a: b: c");
    }

    /// By default idemgate's own lines from `info` up, and of the Redis
    /// client's only its errors.
    #[test]
    fn the_default_filter_keeps_the_redis_clients_warnings_out() {
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(DEFAULT_FILTER))
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            assert!(tracing::enabled!(target: "idemgate::store", tracing::Level::INFO));
            assert!(!tracing::enabled!(target: "idemgate::store", tracing::Level::DEBUG));
            const REDIS: &str = "redis::cluster_handling::async_connection";
            assert!(!tracing::enabled!(target: REDIS, tracing::Level::WARN));
            assert!(tracing::enabled!(target: REDIS, tracing::Level::ERROR));
        });
    }

    /// At DEBUG or TRACE, the HTTP/2 library, which quotes what clients
    /// send, stays at INFO, unless `RUST_LOG` names it, whether the level
    /// comes from a bare level, a span or a target's prefix; at WARN or
    /// ERROR it is not raised to INFO.
    #[test]
    fn the_http2_library_stays_at_info_at_most_unless_named() {
        // Whether a line is written.
        macro_rules! enabled {
            ($spec:expr, $target:literal, $level:expr) => {
                !written(Some($spec), || tracing::event!(target: $target, $level, "a line")).is_empty()
            };
        }
        use tracing::Level;
        for spec in [
            "trace",
            "debug",
            "idemgate=trace,debug",
            "DEBUG",
            "debug,h2x=debug",
            "info,h=debug,idemgate=debug,hyper_util=debug",
            "info,[Connection]=debug,idemgate=debug,hyper_util=debug",
        ] {
            assert!(enabled!(spec, "idemgate::proxy", Level::DEBUG), "{spec}");
            assert!(!enabled!(spec, "h2::server", Level::DEBUG), "{spec}");
            assert!(enabled!(spec, "h2::server", Level::INFO), "{spec}");
            // Other libraries as asked.
            assert!(enabled!(spec, "hyper_util::client", Level::DEBUG), "{spec}");
        }
        for (spec, info, warn) in [("warn", false, true), ("error", false, false), ("off", false, false)] {
            assert_eq!(enabled!(spec, "h2::server", Level::INFO), info, "{spec}");
            assert_eq!(enabled!(spec, "h2::server", Level::WARN), warn, "{spec}");
        }
        assert!(enabled!("trace,h2=trace", "h2::server", Level::TRACE));
        // A module named holds there; the rest of the library stays capped.
        assert!(enabled!("debug,h2::codec=trace", "h2::codec", Level::TRACE));
        assert!(enabled!(
            "debug,h2::codec=trace",
            "h2::codec::framed_read",
            Level::TRACE
        ));
        assert!(!enabled!("debug,h2::codec=trace", "h2::server", Level::DEBUG));
        // A directive scoped to a span lifts nothing.
        assert!(!enabled!("debug,h2[Connection]=debug", "h2::server", Level::DEBUG));
        // A value that does not parse, or an empty one, is the default's.
        for spec in ["=[", "", " "] {
            assert!(!enabled!(spec, "idemgate::proxy", Level::DEBUG), "{spec:?}");
            assert!(enabled!(spec, "idemgate::proxy", Level::INFO), "{spec:?}");
        }
        assert!(
            env_filter(Some("=["))
                .1
                .is_some_and(|why| why.contains("RUST_LOG=\"=[\""))
        );
        assert!(env_filter(Some("")).1.is_none());
    }

    /// A directive for a span enables the lines inside it (here a span of
    /// `h2`'s own): the library's are held back all the same.
    #[test]
    fn a_span_directive_does_not_lift_the_cap() {
        let written = written(Some("info,[Connection]=debug"), || {
            let span = tracing::info_span!(target: "h2::proto::connection", "Connection");
            let _entered = span.enter();
            tracing::debug!(target: "h2::server", "quoted");
            tracing::debug!(target: "idemgate::proxy", "ours");
        });
        assert!(written.contains("ours") && !written.contains("quoted"), "{written}");
    }

    /// The filters as `init` installs them keep the default's level as the
    /// hint that lets DEBUG callsites (the request span) cost nothing.
    #[test]
    fn the_cap_keeps_the_filters_level_hint() {
        use tracing::Subscriber;
        use tracing_subscriber::filter::LevelFilter;
        use tracing_subscriber::prelude::*;
        for (spec, hint) in [(None, LevelFilter::INFO), (Some("debug"), LevelFilter::DEBUG)] {
            let subscriber = tracing_subscriber::registry().with(env_filter(spec).0).with(
                tracing_subscriber::fmt::layer().with_filter(tracing_subscriber::filter::filter_fn(uncapped(spec))),
            );
            assert_eq!(subscriber.max_level_hint(), Some(hint), "{spec:?}");
        }
    }

    /// What `emit` writes under `spec`'s filters, composed as `init`
    /// composes them.
    fn written(spec: Option<&str>, emit: impl FnOnce()) -> String {
        use tracing_subscriber::prelude::*;
        let written = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
        let writer = {
            let written = written.clone();
            move || Writer(written.clone())
        };
        let cap = tracing_subscriber::filter::filter_fn(uncapped(spec));
        let subscriber = tracing_subscriber::registry()
            .with(env_filter(spec).0)
            .with(tracing_subscriber::fmt::layer().with_writer(writer).with_filter(cap));
        tracing::subscriber::with_default(subscriber, emit);
        String::from_utf8(written.lock().unwrap().clone()).unwrap()
    }

    /// A writer into a shared buffer.
    struct Writer(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Writer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_throttle_lets_one_line_a_second_through_and_counts_the_rest() {
        let throttle = Throttle::new();
        assert_eq!(throttle.admit_at(5), Some(0));
        for at in [5, 6, 500, 1004] {
            assert_eq!(throttle.admit_at(at), None, "at {at} ms");
        }
        assert_eq!(throttle.admit_at(1005), Some(4));
        assert_eq!(throttle.admit_at(1006), None);
        assert_eq!(throttle.admit_at(9000), Some(1));
        assert_eq!(throttle.admit_at(9001), None);
    }
}
