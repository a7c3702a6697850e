//! A memory store with faults put in, for unit tests of what the proxy
//! and the store handle do when a store call fails.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

use async_trait::async_trait;

use super::{Claim, Fingerprint, MemoryStore, Outcome, Owner, Record, RecordKey, Store, StoreError};

pub(crate) struct Faulty {
    pub store: MemoryStore,
    /// Looks at a record (`inspect`) that fail before one goes through, as
    /// a connection still failing after a cut-off completion does.
    pub failing_looks: AtomicUsize,
    /// Confirmations that a record found is kept (`confirm`) that fail
    /// before one goes through, as a Redis whose replicas have not copied
    /// it yet answers with `store.wait_for_replicas`.
    pub failing_confirms: AtomicUsize,
    /// Confirmations that find the record gone, purged as they look (a
    /// failover to a replica that never had it), before one goes through.
    pub purging_confirms: AtomicUsize,
    /// Whether a claim, once it has taken the key and yielded once,
    /// panics (a bug in a store's code).
    pub claims_panic: bool,
    /// Completions that fail (unanswered) before one goes through.
    pub failing_completes: AtomicUsize,
    /// Whether a renewal panics.
    pub renewals_panic: bool,
    /// Releases that fail (unanswered) before one goes through.
    pub failing_releases: AtomicUsize,
    /// What [`Store::stopped`] says.
    pub stopped: bool,
}

impl Faulty {
    pub fn new() -> Faulty {
        Faulty {
            store: MemoryStore::new(1 << 20),
            failing_looks: AtomicUsize::new(0),
            failing_confirms: AtomicUsize::new(0),
            purging_confirms: AtomicUsize::new(0),
            claims_panic: false,
            failing_completes: AtomicUsize::new(0),
            renewals_panic: false,
            failing_releases: AtomicUsize::new(0),
            stopped: false,
        }
    }
}

#[async_trait]
impl Store for Faulty {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        lease: Duration,
        refresh_ttl: Option<Duration>,
    ) -> Result<Claim, StoreError> {
        let claim = self.store.claim(key, fingerprint, owner, lease, refresh_ttl).await;
        if self.claims_panic {
            tokio::task::yield_now().await;
            panic!("a store's claim panicked");
        }
        claim
    }
    async fn complete(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        outcome: Outcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        fails(&self.failing_completes, "connection reset")?;
        self.store.complete(key, fingerprint, owner, outcome, ttl).await
    }
    async fn release(&self, key: &RecordKey, owner: Owner) -> Result<bool, StoreError> {
        fails(&self.failing_releases, "connection reset")?;
        self.store.release(key, owner).await
    }
    async fn renew(&self, key: &RecordKey, owner: Owner, lease: Duration) -> Result<bool, StoreError> {
        assert!(!self.renewals_panic, "a store's renewal panicked");
        self.store.renew(key, owner, lease).await
    }
    async fn wait(&self, key: &RecordKey, timeout: Duration) -> Result<(), StoreError> {
        self.store.wait(key, timeout).await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.store.ping().await
    }
    async fn inspect(&self, key: &RecordKey) -> Result<Option<(Record, Duration)>, StoreError> {
        fails(&self.failing_looks, "connection reset")?;
        self.store.inspect(key).await
    }
    async fn confirm(&self, key: &RecordKey, fingerprint: &Fingerprint) -> Result<bool, StoreError> {
        fails(&self.failing_confirms, "not copied to enough replicas")?;
        if take_one(&self.purging_confirms) {
            self.store.purge(key).await?;
            return Ok(false);
        }
        self.store.confirm(key, fingerprint).await
    }
    async fn purge(&self, key: &RecordKey) -> Result<bool, StoreError> {
        self.store.purge(key).await
    }
    fn stopped(&self) -> bool {
        self.stopped
    }
}

/// Fails with `why` while `failing` counts down.
fn fails(failing: &AtomicUsize, why: &str) -> Result<(), StoreError> {
    match take_one(failing) {
        true => Err(StoreError::Unavailable(std::io::Error::other(why).into())),
        false => Ok(()),
    }
}

/// Takes one off `left` unless it is 0; whether it did.
fn take_one(left: &AtomicUsize) -> bool {
    left.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1)).is_ok()
}
