//! The store contract: atomic claims, owner-checked completion (which also
//! lands where no record is left), release and lease renewal, and waiting
//! for a record to change.
//!
//! Every backend implements [`Store`]; the proxy holds a [`StoreHandle`],
//! which puts a deadline on every call so a store that hangs is an error, not
//! a hung request.

mod cluster;
pub mod codec;
mod embedded;
#[cfg(test)]
pub(crate) mod faulty;
mod filter;
mod memory;
mod redis;
mod resp;
mod waiters;

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use http::{HeaderName, HeaderValue, StatusCode};
use smallvec::SmallVec;

pub use embedded::EmbeddedStore;
pub use memory::MemoryStore;
pub use redis::RedisStore;

use crate::config::{StoreBackend, StoreConfig};
use crate::wire::names;

/// Locks `mutex`, poisoned or not: a panic while holding one of the
/// stores' locks cannot leave its data half-updated in a way that matters
/// more than losing the process, so carry on.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A map keyed by record keys (`RecordKey` or its 32 bytes) or by their
/// first 8 bytes as a `u64`, hashed with [`KeyHashing`]. For no other key
/// type: the hasher reads one 32-byte write or one `u64`.
pub(crate) type KeyMap<K, V> = HashMap<K, V, KeyHashing>;

/// Hashing for record keys, which are SHA-256 digests already, so their
/// bits are spread evenly: two of their words, each mixed with a random
/// seed, multiplied together and folded. It costs a fraction of SipHash.
/// The seeds are drawn per map and unknown to clients, so grinding keys
/// cannot aim them at one bucket.
#[derive(Clone)]
pub(crate) struct KeyHashing([u64; 2]);

impl Default for KeyHashing {
    fn default() -> KeyHashing {
        let random = RandomState::new();
        KeyHashing([random.hash_one(1u8), random.hash_one(2u8)])
    }
}

impl BuildHasher for KeyHashing {
    type Hasher = KeyHasher;

    fn build_hasher(&self) -> KeyHasher {
        KeyHasher { seeds: self.0, hash: 0 }
    }
}

pub(crate) struct KeyHasher {
    seeds: [u64; 2],
    hash: u64,
}

impl KeyHasher {
    fn mix(&mut self, a: u64, b: u64) {
        let product = u128::from(a ^ self.seeds[0]) * u128::from(b ^ self.seeds[1]);
        self.hash ^= (product as u64) ^ ((product >> 64) as u64);
    }
}

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        debug_assert_eq!(bytes.len(), 32, "KeyMap is for record keys only");
        let word = |at: usize| {
            bytes
                .get(at..at + 8)
                .map_or(0, |w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
        };
        self.mix(word(0), word(8));
    }

    /// A key's first 8 bytes (the embedded store's key filter).
    fn write_u64(&mut self, prefix: u64) {
        self.mix(prefix, prefix.rotate_left(32));
    }

    /// The length a byte array is prefixed with: always 32 here.
    fn write_usize(&mut self, _: usize) {}

    fn finish(&self) -> u64 {
        self.hash
    }
}

/// Where a record lives: SHA-256 over the scope values and the key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordKey(pub [u8; 32]);

impl RecordKey {
    /// A short, non-reversible tag for logs: never the key itself.
    pub fn tag(&self) -> Tag {
        let mut hex = [0u8; 12];
        hex::encode_to_slice(&self.0[..6], &mut hex).expect("12 hex digits for 6 bytes");
        Tag(hex)
    }
}

/// [`RecordKey::tag`]: twelve hex digits, made without allocating (a
/// request's span records it whether or not anything logs).
#[derive(Clone, Copy)]
pub struct Tag([u8; 12]);

impl Tag {
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).expect("hex digits")
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordKey({})", self.tag())
    }
}

/// SHA-256 of what makes two requests "the same request".
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Fingerprint(pub [u8; 32]);

/// The token of the proxy request that holds a claim. Completion, release
/// and renewal check it, so a holder whose lease ran out can never touch its
/// successor's record.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Owner(pub u128);

impl Owner {
    /// A fresh token: a half of this thread's (the process's random number
    /// plus the thread's own number, so no two threads share one) and the
    /// thread's count. Unique within the process with no counter shared
    /// between threads, whose cache line every request would pull to its
    /// core.
    pub fn new() -> Owner {
        static NONCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        static THREADS: AtomicU64 = AtomicU64::new(0);
        thread_local! {
            static NEXT: std::cell::Cell<Option<(u64, u64)>> = const { std::cell::Cell::new(None) };
        }
        let (half, n) = NEXT.get().unwrap_or_else(|| {
            let nonce = *NONCE.get_or_init(|| RandomState::new().hash_one(std::process::id()));
            (nonce.wrapping_add(THREADS.fetch_add(1, Ordering::Relaxed)), 0)
        });
        NEXT.set(Some((half, n + 1)));
        Owner(((half as u128) << 64) | n as u128)
    }
}

impl Default for Owner {
    fn default() -> Self {
        Owner::new()
    }
}

/// A backend answer kept for replay.
///
/// Its header names, header values and body lie in one buffer: one
/// allocation to make and, when the record goes, one to free. A value is
/// cut from the buffer only as the answer is replayed, so keeping an answer
/// takes no reference counts on it (nor, when it is evicted unreplayed,
/// gives any back). The header list is plain offsets with nothing to drop:
/// evicting a cold record touches its reference count and the buffer's
/// pointer, not each header in turn.
#[derive(Clone)]
pub struct StoredResponse {
    pub status: StatusCode,
    /// Most answers have a handful of headers: held inline, in the same
    /// allocation as the rest.
    headers: SmallVec<[StoredHeader; 6]>,
    block: Bytes,
    body: std::ops::Range<usize>,
}

/// Where a header's name and value lie in the block. Names are valid
/// header names (the name of a `HeaderName`, or checked as one when a
/// record is decoded), so they are ASCII.
#[derive(Clone, Copy)]
struct StoredHeader {
    name_at: u32,
    name_len: u16,
    sensitive: bool,
    at: u32,
    len: u32,
}

impl StoredHeader {
    fn name(&self) -> std::ops::Range<usize> {
        self.name_at as usize..self.name_at as usize + usize::from(self.name_len)
    }

    fn value(&self) -> std::ops::Range<usize> {
        self.at as usize..self.at as usize + self.len as usize
    }
}

impl StoredResponse {
    /// An answer made of `headers` and a body of `chunks`, copied into a
    /// buffer of its own: the values and chunks are often slices of a
    /// connection's read buffer, which keeping would pin whole (kilobytes
    /// for an answer of a few bytes) for as long as the record.
    pub fn new(status: StatusCode, headers: &[(&HeaderName, &HeaderValue)], chunks: &[Bytes]) -> StoredResponse {
        let head: usize = headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len())
            .sum();
        let body: usize = chunks.iter().map(Bytes::len).sum();
        let mut block = BytesMut::with_capacity(head + body);
        // A head is far smaller than 4 GiB, and a name than 64 KiB.
        let mut put = |bytes: &[u8]| {
            let at = block.len();
            block.extend_from_slice(bytes);
            u32::try_from(at).expect("a head fits in 4 GiB")
        };
        let headers = headers
            .iter()
            .map(|&(name, value)| StoredHeader {
                name_at: put(name.as_str().as_bytes()),
                name_len: u16::try_from(name.as_str().len()).expect("a header name fits in 64 KiB"),
                at: put(value.as_bytes()),
                len: u32::try_from(value.len()).expect("a head fits in 4 GiB"),
                sensitive: value.is_sensitive(),
            })
            .collect();
        for chunk in chunks {
            block.extend_from_slice(chunk);
        }
        StoredResponse {
            status,
            headers,
            block: block.freeze(),
            body: head..head + body,
        }
    }

    /// An answer whose header names, values and body are ranges of `block`
    /// (a decoded record's bytes): nothing is copied. `None` when a range
    /// lies outside the block, or a name or value is not a valid one.
    pub fn in_block(
        status: StatusCode,
        block: Bytes,
        headers: impl IntoIterator<Item = (std::ops::Range<usize>, std::ops::Range<usize>)>,
        body: std::ops::Range<usize>,
    ) -> Option<StoredResponse> {
        let headers = headers
            .into_iter()
            .map(|(name, value)| {
                // Checked as a replay makes it, through the name cache.
                names::intern(block.get(name.clone())?).ok()?;
                HeaderValue::from_bytes(block.get(value.clone())?).ok()?;
                Some(StoredHeader {
                    name_at: u32::try_from(name.start).ok()?,
                    name_len: u16::try_from(name.len()).ok()?,
                    at: u32::try_from(value.start).ok()?,
                    len: u32::try_from(value.len()).ok()?,
                    sensitive: false,
                })
            })
            .collect::<Option<_>>()?;
        block.get(body.clone())?;
        Some(StoredResponse {
            status,
            headers,
            block,
            body,
        })
    }

    /// The headers, in the order they were kept, names and values
    /// borrowed.
    pub fn headers(&self) -> impl ExactSizeIterator<Item = (&str, &[u8])> + '_ {
        self.headers
            .iter()
            .map(|header| (self.name(header), &self.block[header.value()]))
    }

    fn name(&self, header: &StoredHeader) -> &str {
        std::str::from_utf8(&self.block[header.name()]).expect("header names are ASCII")
    }

    /// The headers as they are replayed: each value a slice of the answer's
    /// buffer, each name from the names already made (`wire::names::intern`).
    pub fn header_values(&self) -> impl Iterator<Item = (HeaderName, HeaderValue)> + '_ {
        self.headers.iter().map(|header| {
            let name = names::intern(&self.block[header.name()]).expect("kept from a valid header name");
            let mut value = HeaderValue::from_maybe_shared(self.block.slice(header.value()))
                .expect("kept from a valid header value");
            value.set_sensitive(header.sensitive);
            (name, value)
        })
    }

    pub fn body(&self) -> Bytes {
        self.block.slice(self.body.clone())
    }

    /// The body, borrowed.
    pub fn body_bytes(&self) -> &[u8] {
        &self.block[self.body.clone()]
    }

    /// Approximate bytes the record occupies, for memory accounting.
    pub fn size(&self) -> usize {
        let headers: usize = self
            .headers
            .iter()
            .map(|header| usize::from(header.name_len) + header.len as usize + 64)
            .sum();
        self.body.len() + headers + 64
    }
}

impl PartialEq for StoredResponse {
    fn eq(&self, other: &StoredResponse) -> bool {
        self.status == other.status && self.headers().eq(other.headers()) && self.body_bytes() == other.body_bytes()
    }
}

impl Eq for StoredResponse {}

/// The status, header names and body length: never a value or the body,
/// which may carry anything.
impl fmt::Debug for StoredResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoredResponse")
            .field("status", &self.status)
            .field("headers", &self.headers().map(|(name, _)| name).collect::<Vec<_>>())
            .field("body_len", &self.body.len())
            .finish()
    }
}

/// How a claimed request ended, as kept in its record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The answer, replayed to every retry.
    Response(Arc<StoredResponse>),
    /// Delivered once but too large to keep: retries get `response-not-replayable`.
    NotReplayable,
    /// The upstream may or may not have acted: retries get `outcome-unknown`.
    Unknown,
}

impl Outcome {
    /// About how many bytes the outcome takes in a record.
    pub fn size(&self) -> usize {
        match self {
            Outcome::Response(response) => response.size(),
            Outcome::NotReplayable | Outcome::Unknown => 0,
        }
    }

    /// Whether retries get the answer replayed (the only outcome
    /// `refresh_ttl_on_replay` refreshes).
    pub fn is_response(&self) -> bool {
        matches!(self, Outcome::Response(_))
    }
}

/// A record as stored: in flight, or completed.
pub use codec::Decoded as Record;

/// What a claim found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The key is ours: forward the request.
    Claimed,
    /// Another request holds the key.
    InFlight { fingerprint: Fingerprint },
    /// The key has a completed record.
    Completed { fingerprint: Fingerprint, outcome: Outcome },
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store did not answer within {0:?}")]
    Timeout(Duration),
    /// A claim the store took, but answered only after half its lease
    /// (see [`StoreHandle::claim`]).
    #[error("store answered the claim only after {0:?}, past half its lease of {1:?}")]
    LateClaim(Duration, Duration),
    #[error("store unavailable")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// Unavailable, and the call never reached the store (no connection,
    /// or one that broke before the call was written): it changed nothing.
    #[error("store unavailable, nothing sent")]
    NotSent(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("store record is corrupt: {0}")]
    Corrupt(&'static str),
}

/// One storage backend. Each operation is atomic on its own.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Claims `key` for `owner` with a lease, or reports what holds it.
    /// A claim that finds `owner`'s own claim is `Claimed` (a command
    /// resent after a dropped connection may find the first one's work).
    /// With `refresh_ttl`, a completed record with the same fingerprint that
    /// holds a response (a replay) has its time-to-live restarted in the
    /// same step; other outcomes (`NotReplayable`, `Unknown`) are not
    /// refreshed, so their refusals end when `ttl` passes.
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        lease: Duration,
        refresh_ttl: Option<Duration>,
    ) -> Result<Claim, StoreError>;

    /// Turns `owner`'s claim into a completed record kept for `ttl`; also
    /// writes it where the key holds no record (the lease ran out, say
    /// while the store stalled, or the claim was purged, and nobody has
    /// claimed the key since), so the answer (its client's, or the one
    /// held back for its retry) is kept and a retry replays it. Returns false (and changes nothing) when another
    /// request holds the key, or its record. Callers pass the
    /// `fingerprint` `owner` claimed with: written into a record made where
    /// none was, and by the Redis store always (sparing the script a read
    /// and a splice); the others keep the claim's own.
    async fn complete(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        outcome: Outcome,
        ttl: Duration,
    ) -> Result<bool, StoreError>;

    /// Drops `owner`'s claim so the next request runs again.
    async fn release(&self, key: &RecordKey, owner: Owner) -> Result<bool, StoreError>;

    /// Extends `owner`'s lease to `lease` from now.
    async fn renew(&self, key: &RecordKey, owner: Owner, lease: Duration) -> Result<bool, StoreError>;

    /// Returns when the in-flight claim on `key` may have ended (completed,
    /// released or expired), or after `timeout`. Returns at once when `key`
    /// is not in flight. Never polls in a loop.
    async fn wait(&self, key: &RecordKey, timeout: Duration) -> Result<(), StoreError>;

    /// Whether the store answers and would take a claim (`/readyz`): a
    /// failed embedded store or a Redis replica is not ready.
    async fn ping(&self) -> Result<(), StoreError>;

    /// The record under `key` and its time left, for operators.
    async fn inspect(&self, key: &RecordKey) -> Result<Option<(Record, Duration)>, StoreError>;

    /// Whether `key` holds a completed record of `fingerprint`'s request
    /// as safely as a completion the store acknowledged would: for a
    /// record found by a read, such as a completion resent after its
    /// connection broke finds, before it is taken as landed. A store that
    /// shows only what it keeps says so at once; a Redis store with
    /// `store.wait_for_replicas` answers once that many replicas hold it.
    async fn confirm(&self, key: &RecordKey, fingerprint: &Fingerprint) -> Result<bool, StoreError> {
        let _ = (key, fingerprint);
        Ok(true)
    }

    /// Removes the record under `key`, whoever holds it (an operator's
    /// purge of a stuck claim), and wakes its waiters; `false` when there
    /// was none (an expired record counts as none).
    async fn purge(&self, key: &RecordKey) -> Result<bool, StoreError>;

    /// Bytes of records held in this process, for stores that hold them.
    fn stored_bytes(&self) -> Option<usize> {
        None
    }

    /// Whether the store takes no write until a restart (the embedded
    /// store after a failed write to its log, a checkpoint thread that
    /// stopped, or a log outgrowing its memory while the file cannot be
    /// written): a completion it failed cannot land before then.
    fn stopped(&self) -> bool {
        false
    }
}

/// How fast a store call is taken to move a record's bytes: a call that
/// writes or reads a record is given its size at this rate on top of the
/// store timeout. A record of many megabytes takes longer than a claim
/// (Redis runs a 60 MB completion's script for most of a second): bounded
/// by the timeout alone, its completion would time out on every try, each
/// sending the whole record again, until its `ttl`.
pub const STORE_BYTES_PER_SECOND: u64 = 16 << 20;

/// Claims given up on (at their timeout, or by a caller that went away)
/// and still seen through, at most (see [`StoreHandle::claim`]).
const MAX_SEEN_THROUGH: usize = 4096;

/// Claims seen through now.
static SEEN_THROUGH: AtomicUsize = AtomicUsize::new(0);

/// One of [`SEEN_THROUGH`], until dropped (the task ends, or its claim
/// panics).
struct SeenThrough;

impl Drop for SeenThrough {
    fn drop(&mut self) {
        SEEN_THROUGH.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A claim's call to the store, boxed.
type ClaimCall = Pin<Box<dyn Future<Output = Result<Claim, StoreError>> + Send>>;

/// A claim on its way, until answered: dropped before (its caller went
/// away), it is seen through ([`StoreHandle::see_through`]).
struct Pending<'a> {
    store: &'a StoreHandle,
    claim: Option<ClaimCall>,
    key: RecordKey,
    owner: Owner,
    lease: Duration,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let Some(claim) = self.claim.take() else {
            return;
        };
        // A call that panicked cannot be polled again: released at once.
        if std::thread::panicking() {
            self.store.release_behind_claim(self.key, self.owner);
        } else {
            self.store.see_through(claim, self.key, self.owner, self.lease);
        }
    }
}

/// How many times [`StoreHandle::release_abandoned`] asks a failing store,
/// and its first pause between two (doubled each time: 3.1 s in all).
pub(crate) const RELEASE_TRIES: u32 = 6;
const RELEASE_PAUSE: Duration = Duration::from_millis(100);

/// The store as the proxy uses it: a backend plus a deadline on every call.
#[derive(Clone)]
pub struct StoreHandle {
    store: Arc<dyn Store>,
    /// The same store when it is the memory store, whose claims and
    /// completions answer at once: called directly, they cost no boxed
    /// future and no deadline.
    memory: Option<Arc<MemoryStore>>,
    timeout: Duration,
    at_exit: Arc<AtExit>,
}

/// Where the tasks [`StoreHandle::spawn_kept`] starts run: on the runtime
/// the handle was made on, tracked.
struct AtExit {
    home: Option<tokio::runtime::Handle>,
    tasks: tokio_util::task::TaskTracker,
}

impl AtExit {
    fn here() -> Arc<AtExit> {
        Arc::new(AtExit {
            home: tokio::runtime::Handle::try_current().ok(),
            tasks: tokio_util::task::TaskTracker::new(),
        })
    }
}

impl StoreHandle {
    pub fn new(store: Arc<dyn Store>, timeout: Duration) -> StoreHandle {
        StoreHandle {
            store,
            memory: None,
            timeout,
            at_exit: AtExit::here(),
        }
    }

    /// A handle on a memory store.
    pub fn memory(store: MemoryStore, timeout: Duration) -> StoreHandle {
        let store = Arc::new(store);
        StoreHandle {
            store: store.clone(),
            memory: Some(store),
            timeout,
            at_exit: AtExit::here(),
        }
    }

    /// Opens the backend `config` names.
    pub fn open(config: &StoreConfig) -> Result<StoreHandle, OpenError> {
        let store: Arc<dyn Store> = match &config.backend {
            StoreBackend::Memory { max_memory } => {
                return Ok(StoreHandle::memory(MemoryStore::new(*max_memory), config.timeout));
            }
            StoreBackend::Embedded { path } => {
                Arc::new(EmbeddedStore::open(path).map_err(|source| OpenError::Embedded {
                    path: path.display().to_string(),
                    source,
                })?)
            }
            StoreBackend::Redis { url } => Arc::new(
                RedisStore::single_copied(url, &config.key_prefix, config.timeout, config.wait_for_replicas).map_err(
                    |source| OpenError::Redis {
                        field: "store.url",
                        source,
                    },
                )?,
            ),
            StoreBackend::RedisCluster { urls } => Arc::new(
                RedisStore::cluster_copied(urls, &config.key_prefix, config.timeout, config.wait_for_replicas)
                    .map_err(|source| OpenError::Redis {
                        field: "store.urls",
                        source,
                    })?,
            ),
        };
        Ok(StoreHandle::new(store, config.timeout))
    }

    /// `op`, bounded by the store timeout. The timer starts only when `op`
    /// first has to wait: a memory store answers at once and never pays
    /// for one. (Unlike `tokio::time::timeout`, the timer is not polled
    /// outside the task's cooperative budget: every store call waits on a
    /// channel or a socket rather than spending the budget on each poll.)
    async fn deadline<T>(&self, op: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        self.deadline_for(0, op).await
    }

    /// [`StoreHandle::deadline`] for a call that moves a record of `bytes`:
    /// the timeout and their time at [`STORE_BYTES_PER_SECOND`].
    async fn deadline_for<T>(
        &self,
        bytes: usize,
        op: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let timeout = self.timeout + Duration::from_secs_f64(bytes as f64 / STORE_BYTES_PER_SECOND as f64);
        let mut op = std::pin::pin!(op);
        let mut timer = std::pin::pin!(None::<tokio::time::Sleep>);
        std::future::poll_fn(|cx| {
            if let std::task::Poll::Ready(result) = op.as_mut().poll(cx) {
                return std::task::Poll::Ready(result);
            }
            if timer.is_none() {
                timer.set(Some(tokio::time::sleep(timeout)));
            }
            let timer = timer.as_mut().as_pin_mut().expect("set above");
            timer.poll(cx).map(|()| Err(StoreError::Timeout(timeout)))
        })
        .await
    }

    /// [`Store::claim`] within the store timeout. A call that fails leaves
    /// nothing behind: what the store may still have taken is released (a
    /// timed-out claim once the store answers it, in the background). A
    /// claim answered only after half its `lease` fails too (a timeout of
    /// the lease) and is released: its lease, counted from the sending, may
    /// have run out on the way, or run out before a renewal as slow as the
    /// claim lands. A call dropped before its answer (the client hung up)
    /// is seen through as a timed-out one is: released unless the store
    /// answers that it did not take it, and meanwhile still answering the
    /// claims that joined it (see [`RedisStore`]'s claims). A call that
    /// was not sent yet when dropped (waiting on a connection, say) is
    /// then sent, and released once answered.
    pub async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        lease: Duration,
        refresh_ttl: Option<Duration>,
    ) -> Result<Claim, StoreError> {
        if let Some(memory) = &self.memory {
            return Ok(memory.claim_now(key, fingerprint, owner, lease, refresh_ttl));
        }
        let store = self.store.clone();
        let (key, fingerprint) = (*key, *fingerprint);
        let sent = std::time::Instant::now();
        let mut pending = Pending {
            store: self,
            claim: Some(Box::pin(async move {
                store.claim(&key, &fingerprint, owner, lease, refresh_ttl).await
            })),
            key,
            owner,
            lease,
        };
        let result = self
            .deadline(pending.claim.as_mut().expect("until answered").as_mut())
            .await;
        let claim = pending.claim.take().expect("until answered");
        match result {
            // Taken, but answered only after half the lease (a deadline
            // longer than that): the lease may have run out on the way, and
            // another request may hold the key now; or it may run out
            // before the first renewal, due at once and as slow, lands. A
            // failure, released.
            Ok(Claim::Claimed) if sent.elapsed() >= lease / 2 => {
                self.release_in_background(key, owner);
                return Err(StoreError::LateClaim(sent.elapsed(), lease));
            }
            Err(StoreError::Timeout(_)) => self.see_through(claim, key, owner, lease),
            // Never sent, it took nothing: a release would only be one more
            // call to a store that is down. A record the store answered
            // with but cannot read took nothing either.
            Err(StoreError::NotSent(_) | StoreError::Corrupt(_)) | Ok(_) => {}
            // The store may have taken the claim before the error (a
            // connection that dropped with the answer on its way), or may
            // yet (a Redis Cluster try whose own timer ran out): released
            // behind it, on this thread's connection.
            Err(_) => self.release_behind_claim(key, owner),
        }
        result
    }

    /// A claim given up on may still reach the store (it was sent, and the
    /// store was slow, or its caller went away): it is seen through in a
    /// task of its own, for as long as its lease, and then released unless
    /// the store answered that it did not take it (a release only ever
    /// removes this owner's claim, so one after a failed or lost answer is
    /// safe). Released at once instead, the release could reach the store
    /// first (another thread's connection, a batch not yet written) and
    /// leave the key claimed by nobody, every retry a 409 until the lease
    /// ran out. At most [`MAX_SEEN_THROUGH`] at a time: past that, as
    /// against a store that has stopped answering altogether, the claim is
    /// dropped and released at once, and if that release loses the race
    /// its lease frees the key.
    fn see_through(&self, claim: ClaimCall, key: RecordKey, owner: Owner, lease: Duration) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let seen = SeenThrough;
        if SEEN_THROUGH.fetch_add(1, Ordering::Relaxed) >= MAX_SEEN_THROUGH {
            drop(seen);
            return self.release_behind_claim(key, owner);
        }
        let store = self.clone();
        runtime.spawn(async move {
            let answer = tokio::time::timeout(lease, claim).await;
            drop(seen);
            // Not taken (a record it cannot read took nothing either):
            // nothing to release. Still unanswered after a whole
            // lease, it may yet be taken (a store that stalled), and is
            // released all the same: the release is owner-checked and goes
            // behind the claim on the same connection. (Taken, it can go
            // on any: released where a worker's runtime at its end does not
            // drop it.)
            match answer {
                Ok(Ok(Claim::InFlight { .. } | Claim::Completed { .. }))
                | Ok(Err(StoreError::NotSent(_) | StoreError::Corrupt(_))) => {}
                Ok(Ok(Claim::Claimed)) => {
                    tracing::debug!(key = %key.tag(), "a claim given up on is released");
                    store.release_in_background(key, owner);
                }
                // An error may leave it unanswered (a Redis Cluster try's
                // own timer does).
                Ok(Err(_)) | Err(_) => {
                    tracing::debug!(key = %key.tag(), "a claim given up on is released");
                    store.release_abandoned(key, owner).await;
                }
            }
        });
    }

    pub async fn complete(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        outcome: Outcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        if let Some(memory) = &self.memory {
            return Ok(memory.complete_now(key, fingerprint, owner, outcome, ttl));
        }
        let bytes = outcome.size();
        self.deadline_for(bytes, self.store.complete(key, fingerprint, owner, outcome, ttl))
            .await
    }

    pub async fn release(&self, key: &RecordKey, owner: Owner) -> Result<bool, StoreError> {
        self.deadline(self.store.release(key, owner)).await
    }

    /// Releases `key` for `owner` in a task of its own: for a drop guard,
    /// which cannot wait. It runs where [`StoreHandle::spawn_kept`] puts
    /// it, so a worker's runtime dropped at shutdown does not drop it; and
    /// so, on Redis, on another thread's connection: only for a claim the
    /// store has answered, which no release can overtake.
    pub fn release_in_background(&self, key: RecordKey, owner: Owner) {
        let store = self.clone();
        self.spawn_kept(async move { store.release_abandoned(key, owner).await });
    }

    /// [`StoreHandle::release_in_background`] of a claim the store has not
    /// answered yet: spawned on this thread's runtime, so on Redis it goes
    /// on this thread's connection, behind the claim, and cannot reach the
    /// store first and leave the claim to land after it. Without a runtime
    /// (the process is ending) the lease ends the claim instead.
    fn release_behind_claim(&self, key: RecordKey, owner: Owner) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = self.clone();
        runtime.spawn(async move { store.release_abandoned(key, owner).await });
    }

    /// Spawns `task` on the runtime this handle was made on (the
    /// process's background one, which outlives the workers'; else the
    /// caller's, if it has one), tracked, so
    /// [`StoreHandle::finish_kept_tasks`] waits for it before the process
    /// exits: for what a claim dropped unsettled leaves to do (release it,
    /// or record its outcome as unknown), which a worker's runtime being
    /// dropped at shutdown would drop unrun.
    pub fn spawn_kept(&self, task: impl Future<Output = ()> + Send + 'static) {
        let home = self
            .at_exit
            .home
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok());
        if let Some(runtime) = home {
            runtime.spawn(self.at_exit.tasks.track_future(task));
        }
    }

    /// Waits, for at most twice `store.timeout`, for the tasks
    /// [`StoreHandle::spawn_kept`] started (releases asked again while the
    /// store fails, outcomes recorded as unknown); run on the handle's own
    /// runtime, once the workers have stopped.
    pub async fn finish_kept_tasks(&self) {
        self.at_exit.tasks.close();
        let _ = tokio::time::timeout(self.timeout * 2, self.at_exit.tasks.wait()).await;
    }

    /// Releases a claim nobody will settle, asked again while the store
    /// fails (a dropped connection, a failover): held, the key would
    /// answer every retry 409 until its lease ran out. The release is
    /// owner-checked, so one that ran before its answer was lost, or
    /// reaches the key after another request claimed it, changes nothing.
    /// Warns (by the key's tag) if the store fails every time: the lease
    /// then ends the claim.
    async fn release_abandoned(&self, key: RecordKey, owner: Owner) {
        let mut pause = RELEASE_PAUSE;
        for tries_left in (0..RELEASE_TRIES).rev() {
            match self.release(&key, owner).await {
                Ok(_) => return,
                Err(error) if tries_left == 0 => {
                    crate::telemetry::warn_throttled!(error, "releasing a claim failed; its lease will run out", key = %key.tag());
                }
                Err(_) => {
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
            }
        }
    }

    pub async fn renew(&self, key: &RecordKey, owner: Owner, lease: Duration) -> Result<bool, StoreError> {
        self.deadline(self.store.renew(key, owner, lease)).await
    }

    /// Waits for `key` to leave flight, up to `timeout`; the store's own
    /// steps (reading the record, marking it waited on) get the store's
    /// deadline on top, so a store that hangs costs no more than that.
    pub async fn wait(&self, key: &RecordKey, timeout: Duration) -> Result<(), StoreError> {
        match tokio::time::timeout(timeout + self.timeout, self.store.wait(key, timeout)).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        self.deadline(self.store.ping()).await
    }

    pub async fn inspect(&self, key: &RecordKey) -> Result<Option<(Record, Duration)>, StoreError> {
        self.deadline(self.store.inspect(key)).await
    }

    /// [`StoreHandle::inspect`] of a record thought to hold about `bytes`,
    /// given their time to be read.
    pub async fn inspect_sized(&self, key: &RecordKey, bytes: usize) -> Result<Option<(Record, Duration)>, StoreError> {
        self.deadline_for(bytes, self.store.inspect(key)).await
    }

    pub async fn confirm(&self, key: &RecordKey, fingerprint: &Fingerprint) -> Result<bool, StoreError> {
        self.deadline(self.store.confirm(key, fingerprint)).await
    }

    pub async fn purge(&self, key: &RecordKey) -> Result<bool, StoreError> {
        self.deadline(self.store.purge(key)).await
    }

    pub fn stored_bytes(&self) -> Option<usize> {
        self.store.stored_bytes()
    }

    /// See [`Store::stopped`].
    pub fn stopped(&self) -> bool {
        self.store.stopped()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("store.path: cannot open the embedded store file {path}")]
    Embedded {
        path: String,
        #[source]
        source: StoreError,
    },
    #[error("{field}: cannot set up the Redis store")]
    Redis {
        /// `store.url`, or `store.urls` for a Cluster.
        field: &'static str,
        #[source]
        source: StoreError,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_are_unique_across_threads() {
        let owners: Vec<Owner> = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..4)
                .map(|_| scope.spawn(|| (0..1000).map(|_| Owner::new()).collect::<Vec<_>>()))
                .collect();
            threads.into_iter().flat_map(|t| t.join().unwrap()).collect()
        });
        let distinct: std::collections::HashSet<_> = owners.iter().collect();
        assert_eq!(distinct.len(), owners.len());
    }

    /// A claim whose call panics (a bug in a store's code) is released, as
    /// it may have taken the key, and is never polled again.
    #[tokio::test]
    async fn a_claim_that_panics_is_released() {
        let store = Arc::new(faulty::Faulty {
            claims_panic: true,
            ..faulty::Faulty::new()
        });
        let handle = StoreHandle::new(store.clone(), Duration::from_secs(1));
        let (key, fingerprint, lease) = (RecordKey([1; 32]), Fingerprint([2; 32]), Duration::from_secs(30));
        let claiming = tokio::spawn({
            let handle = handle.clone();
            async move { handle.claim(&key, &fingerprint, Owner(7), lease, None).await }
        });
        assert!(claiming.await.unwrap_err().is_panic());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while store.store.claim_now(&key, &fingerprint, Owner(8), lease, None) != Claim::Claimed {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the panicked claim still holds the key"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
