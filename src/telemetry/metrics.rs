//! Prometheus metrics: per-route outcome counters, latency histograms for
//! the store and the upstream, and gauges. Labels carry route names and
//! outcome names only, never keys or raw paths.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What became of one request, as counted in `idemgate_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Forwarded,
    Replayed,
    InFlight,
    Mismatch,
    KeyMissing,
    KeyInvalid,
    Passthrough,
    TooLarge,
    NotReplayable,
    OutcomeUnknown,
    StoreError,
    UpstreamError,
    BadRequest,
    ShadowReplayed,
    ShadowInFlight,
    ShadowMismatch,
    ShadowKeyMissing,
    ShadowKeyInvalid,
    ShadowNotReplayable,
    ShadowOutcomeUnknown,
    ShadowTooLarge,
}

impl Outcome {
    pub const ALL: [Outcome; 21] = [
        Outcome::Forwarded,
        Outcome::Replayed,
        Outcome::InFlight,
        Outcome::Mismatch,
        Outcome::KeyMissing,
        Outcome::KeyInvalid,
        Outcome::Passthrough,
        Outcome::TooLarge,
        Outcome::NotReplayable,
        Outcome::OutcomeUnknown,
        Outcome::StoreError,
        Outcome::UpstreamError,
        Outcome::BadRequest,
        Outcome::ShadowReplayed,
        Outcome::ShadowInFlight,
        Outcome::ShadowMismatch,
        Outcome::ShadowKeyMissing,
        Outcome::ShadowKeyInvalid,
        Outcome::ShadowNotReplayable,
        Outcome::ShadowOutcomeUnknown,
        Outcome::ShadowTooLarge,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Outcome::Forwarded => "forwarded",
            Outcome::Replayed => "replayed",
            Outcome::InFlight => "in_flight",
            Outcome::Mismatch => "mismatch",
            Outcome::KeyMissing => "key_missing",
            Outcome::KeyInvalid => "key_invalid",
            Outcome::Passthrough => "passthrough",
            Outcome::TooLarge => "too_large",
            Outcome::NotReplayable => "not_replayable",
            Outcome::OutcomeUnknown => "outcome_unknown",
            Outcome::StoreError => "store_error",
            Outcome::UpstreamError => "upstream_error",
            Outcome::BadRequest => "bad_request",
            Outcome::ShadowReplayed => "shadow_replayed",
            Outcome::ShadowInFlight => "shadow_in_flight",
            Outcome::ShadowMismatch => "shadow_mismatch",
            Outcome::ShadowKeyMissing => "shadow_key_missing",
            Outcome::ShadowKeyInvalid => "shadow_key_invalid",
            Outcome::ShadowNotReplayable => "shadow_not_replayable",
            Outcome::ShadowOutcomeUnknown => "shadow_outcome_unknown",
            Outcome::ShadowTooLarge => "shadow_too_large",
        }
    }

    /// What enforce mode would have done, counted in shadow mode.
    pub fn shadowed(self) -> Outcome {
        match self {
            Outcome::Replayed => Outcome::ShadowReplayed,
            Outcome::InFlight => Outcome::ShadowInFlight,
            Outcome::Mismatch => Outcome::ShadowMismatch,
            Outcome::KeyMissing => Outcome::ShadowKeyMissing,
            Outcome::KeyInvalid => Outcome::ShadowKeyInvalid,
            Outcome::NotReplayable => Outcome::ShadowNotReplayable,
            Outcome::OutcomeUnknown => Outcome::ShadowOutcomeUnknown,
            Outcome::TooLarge => Outcome::ShadowTooLarge,
            other => other,
        }
    }
}

/// The outcome counters of one route.
pub struct RouteCounters {
    counts: [AtomicU64; Outcome::ALL.len()],
}

impl RouteCounters {
    /// Counts `outcome`, and records it on the current request span.
    pub fn count(&self, outcome: Outcome) {
        self.counts[outcome as usize].fetch_add(1, Ordering::Relaxed);
        tracing::Span::current().record("outcome", outcome.name());
    }

    pub fn get(&self, outcome: Outcome) -> u64 {
        self.counts[outcome as usize].load(Ordering::Relaxed)
    }
}

/// A latency histogram with fixed buckets (seconds).
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

const BUCKETS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.5,
];

impl Histogram {
    fn new() -> Histogram {
        Histogram {
            buckets: Default::default(),
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|b| secs <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, bucket) in BUCKETS.iter().zip(&self.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
    }
}

/// Every metric of the process. Survives configuration reloads.
pub struct Metrics {
    routes: Mutex<BTreeMap<String, Arc<RouteCounters>>>,
    pub store_latency: Histogram,
    pub upstream_latency: Histogram,
    pub in_flight: AtomicI64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            routes: Mutex::new(BTreeMap::new()),
            store_latency: Histogram::new(),
            upstream_latency: Histogram::new(),
            in_flight: AtomicI64::new(0),
        }
    }
}

impl Metrics {
    /// The counters of route `name` (`""` for unmatched requests).
    pub fn route(&self, name: &str) -> Arc<RouteCounters> {
        let mut routes = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        routes
            .entry(name.to_string())
            .or_insert_with(|| {
                Arc::new(RouteCounters {
                    counts: Default::default(),
                })
            })
            .clone()
    }

    /// Prometheus text exposition format.
    pub fn render(&self, stored_bytes: Option<usize>) -> String {
        let mut out = String::with_capacity(4096);
        out.push_str("# HELP idemgate_requests_total Requests by route and outcome.\n");
        out.push_str("# TYPE idemgate_requests_total counter\n");
        let routes = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        for (name, counters) in routes.iter() {
            let name = name.replace('\\', "\\\\").replace('"', "\\\"");
            for outcome in Outcome::ALL {
                let n = counters.get(outcome);
                if n > 0 {
                    let _ = writeln!(
                        out,
                        "idemgate_requests_total{{route=\"{name}\",outcome=\"{}\"}} {n}",
                        outcome.name()
                    );
                }
            }
        }
        drop(routes);
        self.store_latency.render(
            "idemgate_store_duration_seconds",
            "Latency of store operations.",
            &mut out,
        );
        self.upstream_latency.render(
            "idemgate_upstream_duration_seconds",
            "Time to the upstream's response head.",
            &mut out,
        );
        let _ = writeln!(
            out,
            "# HELP idemgate_claims_in_flight Claims held by this process.\n# TYPE idemgate_claims_in_flight gauge\nidemgate_claims_in_flight {}",
            self.in_flight.load(Ordering::Relaxed)
        );
        if let Some(bytes) = stored_bytes {
            let _ = writeln!(
                out,
                "# HELP idemgate_stored_bytes Bytes of records held in memory.\n# TYPE idemgate_stored_bytes gauge\nidemgate_stored_bytes {bytes}"
            );
        }
        out
    }
}
