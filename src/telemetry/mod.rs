//! Logging through `tracing` and the process's metrics.

pub mod metrics;

pub use metrics::{Metrics, Outcome, RouteCounters};

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
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Installs the global subscriber: `RUST_LOG` filters (default `info`),
/// `IDEMGATE_LOG_FORMAT=json` selects JSON lines instead of text.
pub fn init() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let json = std::env::var("IDEMGATE_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
