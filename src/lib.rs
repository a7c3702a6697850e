//! idemgate: a reverse proxy that makes state-changing calls to an
//! unmodified API safe to retry.
//!
//! For each configured route it reads the client's `Idempotency-Key` (or
//! derives one from an allow-list of request fields), claims the key in a
//! store before the backend sees anything, records the backend's answer
//! under the key and a fingerprint of the request, and replays that answer
//! to every retry. A retry of a request still in flight gets 409 (or waits);
//! a key reused for a different request gets 422.
//!
//! # Map
//!
//! - [`config`]: the TOML file, as a raw serde mirror validated into
//!   [`config::Config`]; every problem is reported at once, by field.
//! - [`server`]: the accept loop (HTTP/1.1 and HTTP/2, TLS by rustls in
//!   [`server::tls`]), listeners shared by several single-threaded workers
//!   (SO_REUSEPORT), the admin listener (`/healthz`, `/readyz`, `/metrics`,
//!   `/records`), reload and graceful shutdown.
//! - [`proxy`]: the request pipeline, one step a file: route, key, body,
//!   fingerprint, claim, exchange (forward, stream, record), problem; and
//!   the upstream HTTP/1.1 client with its per-worker connection pool.
//! - [`store`]: the [`store::Store`] contract, the record codec, and its
//!   backends: memory, embedded (redb behind a write-ahead log), Redis and
//!   Redis Cluster.
//! - [`telemetry`]: tracing setup, the throttle for warnings a down store
//!   would repeat per request, and the metrics.
//!
//! # The life of a request
//!
//! ```text
//! client ──> route? ──no──> pass-through (streamed both ways)
//!              │yes
//!              v
//!            key (header | derived) ── bad/missing ──> 400
//!              v
//!            body (buffered, ≤ max_request_body) ── larger ──> 413
//!              v
//!            fingerprint + record key (scope, key)
//!              v
//!            claim ── completed, same fingerprint ──> replay (Idempotent-Replayed: true)
//!              │   ── other fingerprint ───────────> 422 key-reused
//!              │   ── in flight ───────────────────> 409 + Retry-After, or wait
//!              │   ── store down ──────────────────> 503, or forward (on_error = "pass")
//!              v claimed (survives a client hang-up in a task of its own, renews its lease)
//!            forward ──> upstream
//!              v
//!            stream the answer, holding back its last byte
//!              v
//!            complete the record (or release on 5xx / failure)
//!              v
//!            last byte ──> client
//! ```

mod clock;
pub mod config;
pub mod proxy;
pub mod server;
pub mod store;
pub mod telemetry;
mod wire;

/// Helpers for the unit tests.
#[cfg(test)]
mod testing {
    /// Numbers below the argument, from a small deterministic generator
    /// (xorshift64): a randomized test repeats exactly, run after run.
    pub fn numbers(mut seed: u64) -> impl FnMut(usize) -> usize {
        move |below| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % below as u64) as usize
        }
    }
}
