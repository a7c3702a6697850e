//! Prometheus metrics: per-route outcome counters, latency histograms for
//! the store and the upstream, and gauges. Labels carry route names and
//! outcome names only, never keys or raw paths.
//!
//! Every request updates a dozen of them, from whichever worker thread
//! serves it. Kept in one place, each update would pull the cache line from
//! the other core first; so each metric keeps a slot per thread (see
//! `PerThread`), and the exposition adds the slots up.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Slots per metric. Threads take them in turn as they first count
/// something, so the workers (one per core) have one each on machines of up
/// to this many cores; past that, threads share slots, which stays correct.
const SLOTS: usize = 16;

/// A value per thread slot, each on cache lines of its own (128 bytes: the
/// line and the one the CPU prefetches beside it).
struct PerThread<T> {
    slots: [Slot<T>; SLOTS],
}

#[repr(align(128))]
#[derive(Default)]
struct Slot<T>(T);

impl<T: Default> Default for PerThread<T> {
    fn default() -> Self {
        PerThread {
            slots: std::array::from_fn(|_| Slot::default()),
        }
    }
}

impl<T> PerThread<T> {
    /// This thread's slot.
    fn local(&self) -> &T {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        thread_local! {
            static INDEX: Cell<usize> = const { Cell::new(usize::MAX) };
        }
        let mut index = INDEX.get();
        if index == usize::MAX {
            index = NEXT.fetch_add(1, Ordering::Relaxed) % SLOTS;
            INDEX.set(index);
        }
        &self.slots[index].0
    }

    fn sum<N: std::iter::Sum>(&self, read: impl Fn(&T) -> N) -> N {
        self.slots.iter().map(|slot| read(&slot.0)).sum()
    }
}

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
#[derive(Default)]
pub struct RouteCounters {
    counts: PerThread<[AtomicU64; Outcome::ALL.len()]>,
}

impl RouteCounters {
    /// Counts `outcome`, and records it on the current request span.
    pub fn count(&self, outcome: Outcome) {
        self.count_noted(outcome);
        Self::note(outcome);
    }

    /// Counts `outcome` already [noted](RouteCounters::note) on the
    /// request span (recorded again, the log line would name it twice).
    pub fn count_noted(&self, outcome: Outcome) {
        self.counts.local()[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Records `outcome` on the current request span without counting it:
    /// what the client is being answered before the exchange has ended (a
    /// streamed answer's head), which a later count may overwrite.
    pub fn note(outcome: Outcome) {
        if let Some(span) = super::request_span() {
            span.record("outcome", outcome.name());
        }
    }

    pub fn get(&self, outcome: Outcome) -> u64 {
        self.counts
            .sum(|counts| counts[outcome as usize].load(Ordering::Relaxed))
    }
}

/// A latency histogram with fixed buckets (seconds).
#[derive(Default)]
pub struct Histogram {
    slots: PerThread<HistogramSlot>,
}

#[derive(Default)]
struct HistogramSlot {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

const BUCKETS: [f64; 15] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.5, 5.0, 10.0, 30.0,
];

impl Histogram {
    pub fn observe(&self, elapsed: Duration) {
        let slot = self.slots.local();
        let secs = elapsed.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|b| secs <= *b) {
            slot.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        slot.count.fetch_add(1, Ordering::Relaxed);
        slot.sum_micros.fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
    }

    /// The slots are read one after another while observations go on, so a
    /// scrape may see an observation in its bucket but not yet in the
    /// count: the count is raised to the buckets' total, so that `+Inf` is
    /// never below a bucket.
    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, bound) in BUCKETS.iter().enumerate() {
            cumulative += self.slots.sum(|slot| slot.buckets[i].load(Ordering::Relaxed));
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let count = self
            .slots
            .sum(|slot| slot.count.load(Ordering::Relaxed))
            .max(cumulative);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.slots.sum(|slot| slot.sum_micros.load(Ordering::Relaxed)) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
    }
}

/// Every metric of the process. Survives configuration reloads.
#[derive(Default)]
pub struct Metrics {
    routes: Mutex<BTreeMap<String, Arc<RouteCounters>>>,
    pub store_latency: Histogram,
    pub upstream_latency: Histogram,
    /// Claims taken less claims let go, per thread: a claim taken on one
    /// thread may end on another, so only the sum means anything.
    in_flight: PerThread<AtomicI64>,
}

impl Metrics {
    pub fn claim_taken(&self) {
        self.in_flight.local().fetch_add(1, Ordering::Relaxed);
    }

    pub fn claim_ended(&self) {
        self.in_flight.local().fetch_sub(1, Ordering::Relaxed);
    }

    /// Counts a claim as held until what this returns is dropped, however
    /// the task that holds it ends (a panic, an abort).
    pub fn claim_held(self: &Arc<Self>) -> HeldClaim {
        self.claim_taken();
        HeldClaim(self.clone())
    }

    /// Claims held by this process.
    pub fn claims_in_flight(&self) -> i64 {
        self.in_flight.sum(|claims| claims.load(Ordering::Relaxed))
    }

    /// The counters of route `name` (`""` for unmatched requests).
    pub fn route(&self, name: &str) -> Arc<RouteCounters> {
        let mut routes = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        routes.entry(name.to_string()).or_default().clone()
    }

    /// Prometheus text exposition format.
    pub fn render(&self, stored_bytes: Option<usize>) -> String {
        let mut out = String::with_capacity(4096);
        out.push_str("# HELP idemgate_requests_total Requests by route and outcome.\n");
        out.push_str("# TYPE idemgate_requests_total counter\n");
        let routes = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        // Every series from the start, zeros too: `rate()` and `increase()`
        // see no first count of a series that appears with it.
        for (name, counters) in routes.iter() {
            let name = name.replace('\\', "\\\\").replace('"', "\\\"");
            for outcome in Outcome::ALL {
                let _ = writeln!(
                    out,
                    "idemgate_requests_total{{route=\"{name}\",outcome=\"{}\"}} {}",
                    outcome.name(),
                    counters.get(outcome)
                );
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
            self.claims_in_flight()
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

/// A claim counted as held ([`Metrics::claim_held`]) until dropped.
pub struct HeldClaim(Arc<Metrics>);

impl Drop for HeldClaim {
    fn drop(&mut self) {
        self.0.claim_ended();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts made on many threads (more than there are slots, so some
    /// share one) all reach the exposition, and a claim taken on one thread
    /// and ended on another nets out.
    #[test]
    fn counts_from_every_thread_add_up() {
        let metrics = Metrics::default();
        let counters = metrics.route("orders");
        std::thread::scope(|scope| {
            for _ in 0..SLOTS + 3 {
                scope.spawn(|| {
                    for _ in 0..1000 {
                        counters.count(Outcome::Forwarded);
                        metrics.store_latency.observe(Duration::from_micros(300));
                        metrics.claim_taken();
                    }
                });
            }
        });
        std::thread::scope(|scope| {
            scope.spawn(|| (0..(SLOTS + 3) * 1000).for_each(|_| metrics.claim_ended()));
        });
        let n = (SLOTS + 3) * 1000;
        assert_eq!(counters.get(Outcome::Forwarded), n as u64);
        let text = metrics.render(None);
        assert!(
            text.contains(&format!(
                "idemgate_requests_total{{route=\"orders\",outcome=\"forwarded\"}} {n}"
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!("idemgate_store_duration_seconds_bucket{{le=\"0.0005\"}} {n}")),
            "{text}"
        );
        assert!(
            text.contains("idemgate_store_duration_seconds_bucket{le=\"0.00025\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains(&format!("idemgate_store_duration_seconds_count {n}")),
            "{text}"
        );
        assert!(text.contains("idemgate_claims_in_flight 0"), "{text}");
    }
}
