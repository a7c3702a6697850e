//! Step 5 and 6: the claimed exchange. Forward the request, stream the
//! answer to the client while recording it, and complete (or release) the
//! claim before the last byte reaches the client.
//!
//! The exchange cannot be cancelled by a client that hangs up: it moves to
//! a task of its own, reads the rest of the upstream body into the record
//! and completes it, and the client's retry replays. The exchange owns a
//! [`ClaimGuard`] that renews the lease while it lives and releases the
//! claim if the exchange ends without settling it.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use smallvec::SmallVec;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use super::body::{BodySender, ClientBody, ResponseBody};
use super::problem::Problem;
use super::upstream::{Code, HeadBegun, OnStale, UpstreamError};
use super::{Context, LiveRoute};
use crate::config::{OnServerError, OnUpstreamFailure, Policy};
use crate::store::{Fingerprint, Outcome, Owner, Record, RecordKey, StoreError, StoreHandle, StoredResponse};
use crate::telemetry::{self, Outcome as TelemetryOutcome, RouteCounters, error_chain};
use tracing::Instrument;

/// Frames buffered between the exchange task and the client connection.
const CHANNEL_FRAMES: usize = 16;
/// The most frames of a body taken at once, as they arrived with its head,
/// to answer it whole.
const EARLY_FRAMES: usize = 16;

/// Everything the claimed exchange needs, owned, so it can outlive the
/// client's connection.
pub struct Exchange {
    pub context: Arc<Context>,
    /// The route: its policy, and its outcome counters (`forwarded` once
    /// the answer has come and is settled, `upstream_error` when it does
    /// not come, `store_error` when it is held back).
    pub live: Arc<LiveRoute>,
    pub key: RecordKey,
    pub fingerprint: Fingerprint,
    pub owner: Owner,
    /// When the claim was sent: the lease runs from here.
    pub claimed_at: Instant,
    /// When the store answered it: the upstream's deadline runs from here.
    pub answered_at: Instant,
    pub request: Request<ClientBody>,
    pub timeout: Duration,
    /// How long the client may stall a streamed answer.
    pub client_timeout: Duration,
    /// Whether an answer whose record the store failed still goes to the
    /// client whole (`on_error = "pass"`, or shadow mode), or is held back
    /// (see [`ClaimGuard::complete`]).
    pub deliver_unrecorded: bool,
}

/// The claims of requests that may have gone upstream on routes with
/// `on_upstream_failure = "unknown"`, until settled: one set per worker,
/// kept across reloads. A shutdown whose grace runs out records each as an
/// unknown outcome ([`SentClaims::give_up`]); the exchanges are then
/// dropped with their runtime, and a lease left to run out would let a
/// retry run the request again. Every other claim they hold is settled as
/// they are dropped, on the store's own runtime, which outlives the
/// worker's ([`StoreHandle::spawn_kept`]).
#[derive(Clone, Default)]
pub struct SentClaims(Arc<SentState>);

#[derive(Default)]
struct SentState {
    claims: std::sync::Mutex<HashMap<Owner, SentClaim>>,
    /// Set once a shutdown's grace ran out: the worker's runtime, and every
    /// claim its exchanges hold, are about to be dropped.
    given_up: std::sync::atomic::AtomicBool,
}

/// A claim [`SentClaims`] holds, and the `ttl` of its unknown outcome.
struct SentClaim {
    key: RecordKey,
    fingerprint: Fingerprint,
    ttl: Duration,
}

impl SentClaims {
    fn insert(&self, owner: Owner, claim: SentClaim) {
        self.lock().insert(owner, claim);
    }

    /// Takes `owner`'s claim out; false if a shutdown has taken it.
    fn remove(&self, owner: Owner) -> bool {
        self.lock().remove(&owner).is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Owner, SentClaim>> {
        self.0.claims.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a shutdown has given up on the worker's exchanges.
    fn given_up(&self) -> bool {
        self.0.given_up.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Gives up on the worker's exchanges, whose grace ran out: records
    /// every claim here as an unknown outcome in `store` (the one every
    /// gateway of the worker has had: it changes only with a restart),
    /// each within its deadline, and returns how many were recorded; every
    /// other claim is settled by its guard as the exchange is dropped.
    pub async fn give_up(&self, store: &StoreHandle) -> usize {
        self.0.given_up.store(true, std::sync::atomic::Ordering::Release);
        let claims: Vec<_> = self.lock().drain().collect();
        let recorded = claims.into_iter().map(|(owner, claim)| async move {
            let SentClaim { key, fingerprint, ttl } = claim;
            let done = store.complete(&key, &fingerprint, owner, Outcome::Unknown, ttl).await;
            if let Err(error) = &done {
                tracing::error!(key = %key.tag(), error = %error_chain(error), "recording an unknown outcome at shutdown failed; the lease will run out");
            }
            matches!(done, Ok(true))
        });
        futures_util::future::join_all(recorded)
            .await
            .into_iter()
            .filter(|done| *done)
            .count()
    }
}

/// Holds a claim: renews its lease while the exchange runs long, and when
/// dropped unsettled (the exchange panicked, or a shutdown's grace ran
/// out) settles it as an upstream failure would: released, or completed
/// as unknown once the request may have gone upstream on a route with
/// `on_upstream_failure = "unknown"`, or once the upstream's head said it
/// acted (see [`fail`]).
///
/// Most exchanges end well within a third of the lease, so the renewal task
/// is only spawned once one has run that long (see [`ClaimGuard::renewing_until`]).
struct ClaimGuard {
    /// The store, and the metrics the claim is counted in.
    context: Arc<Context>,
    key: RecordKey,
    /// What the claim was made with; the completed record keeps it.
    fingerprint: Fingerprint,
    owner: Owner,
    lease: Duration,
    /// When the lease began: renewals fall due a third of it on from here.
    claimed_at: Instant,
    renewal: Option<JoinHandle<()>>,
    settled: bool,
    /// Set once the request may have reached the upstream on a route with
    /// `on_upstream_failure = "unknown"`: the `ttl` of the unknown outcome
    /// an unsettled drop records.
    unknown_for: Option<Duration>,
    /// Set once the upstream's head came with a status the route keeps (it
    /// acted): an unsettled drop records an unknown outcome of this `ttl`
    /// whatever `on_upstream_failure` says, as [`fail`] does.
    acted: Option<Duration>,
    /// Made by a drop to settle a claim on the store's home runtime
    /// ([`StoreHandle::spawn_kept`]): what it leaves to do stays there.
    kept: bool,
}

impl ClaimGuard {
    fn new(
        context: Arc<Context>,
        key: RecordKey,
        fingerprint: Fingerprint,
        owner: Owner,
        lease: Duration,
        claimed_at: Instant,
    ) -> ClaimGuard {
        context.metrics.claim_taken();
        ClaimGuard {
            context,
            key,
            fingerprint,
            owner,
            lease,
            claimed_at,
            renewal: None,
            settled: false,
            unknown_for: None,
            acted: None,
            kept: false,
        }
    }

    /// Marks the request as possibly sent: from here, an exchange that ends
    /// unsettled (a panic) must not let a retry run it again when the route
    /// keeps such outcomes as unknown.
    fn sending(&mut self, policy: &Policy) {
        if policy.on_upstream_failure == OnUpstreamFailure::Unknown && self.unknown_for.is_none() {
            self.unknown_for = Some(policy.ttl);
            let claim = SentClaim {
                key: self.key,
                fingerprint: self.fingerprint,
                ttl: policy.ttl,
            };
            self.context.sent.insert(self.owner, claim);
        }
    }

    /// The upstream's head came with a status the route releases (a 429,
    /// a 5xx with `on_server_error = "release"`): the backend did not act,
    /// so the claim is no longer one a drop or a shutdown must record as
    /// unknown (as [`fail`] would release it), unless a shutdown has taken
    /// it to already.
    fn released_head(&mut self) {
        if self.unknown_for.is_some() && self.context.sent.remove(self.owner) {
            self.unknown_for = None;
        }
    }

    fn every(&self) -> Duration {
        (self.lease / 3).max(Duration::from_millis(1))
    }

    /// Renews the lease every third of it, counted from the claim, until
    /// settled: a renewal started early does not renew a fresh lease.
    fn start_renewal(&mut self) {
        if self.renewal.is_some() {
            return;
        }
        let (store, key, owner, lease, every) = (
            self.context.store.clone(),
            self.key,
            self.owner,
            self.lease,
            self.every(),
        );
        let first = self.claimed_at + every;
        self.renewal = Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(first, every);
            loop {
                tick.tick().await;
                match store.renew(&key, owner, lease).await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!(key = %key.tag(), "lease lost before the exchange finished");
                        return;
                    }
                    Err(error) => telemetry::warn_throttled!(error, "lease renewal failed", key = %key.tag()),
                }
            }
        }));
    }

    /// Runs `work` until `deadline` (`None` when it is reached first),
    /// starting the renewal if it lasts a third of the lease. One timer
    /// serves both: it first falls due for the renewal, then is moved on to
    /// the deadline. `work` is pinned by the caller: taken by value, it
    /// would be held here again, and the exchange's future (which is moved
    /// into the heap) would be that much larger.
    async fn renewing_until<F: Future>(&mut self, deadline: Instant, mut work: Pin<&mut F>) -> Option<F::Output> {
        let renew_at = self.claimed_at + self.every();
        let mut timer = std::pin::pin!(tokio::time::sleep_until(renew_at.min(deadline)));
        std::future::poll_fn(|cx| {
            if let Poll::Ready(done) = work.as_mut().poll(cx) {
                return Poll::Ready(Some(done));
            }
            while timer.as_mut().poll(cx).is_ready() {
                if timer.deadline() >= deadline {
                    return Poll::Ready(None);
                }
                self.start_renewal();
                timer.as_mut().reset(deadline);
            }
            Poll::Pending
        })
        .await
    }

    /// Stops the renewal and marks the claim settled; false if a shutdown
    /// has taken it to record as unknown (see [`SentClaims`]).
    fn settle(&mut self) -> bool {
        if let Some(renewal) = self.renewal.take() {
            renewal.abort();
        }
        self.settled = true;
        self.unknown_for.take().is_none() || self.context.sent.remove(self.owner)
    }

    /// Completes the record; false when the store failed the call (it is
    /// retried in the background, the claim kept), so the answer is not
    /// recorded yet and a proxy stopped now could lose it. True when the
    /// store takes no write until a restart ([`StoreHandle::stopped`]):
    /// nothing lands before then, and holding the answer back from its
    /// client would only have its retry run the request again after the
    /// restart. True too when the store refused it as the key is taken (it
    /// takes a completion only where the key is free): another request's
    /// claim or record, or this answer already; holding it back could not
    /// get it replayed.
    async fn complete(mut self, outcome: Outcome, ttl: Duration) -> bool {
        self.settle();
        let started = Instant::now();
        let result = self
            .context
            .store
            .complete(&self.key, &self.fingerprint, self.owner, outcome.clone(), ttl)
            .await;
        self.context.metrics.store_latency.observe(started.elapsed());
        match result {
            Ok(true) => true,
            Ok(false) => {
                // Looked into off the client's way: the store is asked again.
                let (store, key, fingerprint, owner) =
                    (self.context.store.clone(), self.key, self.fingerprint, self.owner);
                self.spawn_follow_up(async move {
                    lost(&store, &key, &fingerprint, owner, &outcome, ttl).await;
                });
                // Its lease was lost to another request: what the store
                // holds is looked into (the answer may be there already).
                true
            }
            // Releasing could let a retry run the request twice, and so could
            // letting the lease run out: keep the claim and keep trying.
            Err(error) => {
                // At most a line a second: a store that fails does so for
                // every exchange in flight.
                telemetry::throttled!(
                    tracing::Level::ERROR,
                    error,
                    "completing the record failed; retrying",
                    key = %self.key.tag()
                );
                // Tracked, so a shutdown gives it `shutdown_grace` to land;
                // the claim it holds stays counted as held until it ends.
                let retry = retry_completion(
                    self.context.store.clone(),
                    self.key,
                    self.fingerprint,
                    self.owner,
                    self.lease,
                    outcome,
                    ttl,
                );
                let held = self.context.metrics.claim_held();
                self.spawn_follow_up(async move {
                    retry.await;
                    drop(held);
                });
                self.context.store.stopped()
            }
        }
    }

    /// Spawns what a settlement leaves to do: tracked with the worker's
    /// exchanges, so a drain gives it `shutdown_grace`; or, once a shutdown
    /// has given up on them, or from a guard a drop made, where the
    /// worker's runtime being dropped does not drop it
    /// ([`StoreHandle::spawn_kept`]).
    fn spawn_follow_up(&self, task: impl Future<Output = ()> + Send + 'static) {
        if self.kept || self.context.sent.given_up() {
            self.context.store.spawn_kept(task);
        } else {
            self.context.exchanges.spawn(task);
        }
    }

    async fn release(mut self) {
        // A shutdown is recording the claim as unknown: released now, the
        // record it writes would land on an empty key, as an unknown
        // outcome for a request the head said may run again; kept, the
        // claim ends as a shutdown leaves every request that may have been
        // sent.
        if !self.settle() {
            return;
        }
        if let Err(error) = self.context.store.release(&self.key, self.owner).await {
            telemetry::warn_throttled!(error, "releasing the claim failed; asking again", key = %self.key.tag());
            self.context.store.release_in_background(self.key, self.owner);
        }
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        self.context.metrics.claim_ended();
        if self.settled {
            return;
        }
        if let Some(renewal) = self.renewal.take() {
            renewal.abort();
        }
        let ttl = match self.unknown_for {
            // A shutdown has recorded it as unknown.
            Some(_) if !self.context.sent.remove(self.owner) => return,
            Some(ttl) => ttl,
            None => match self.acted {
                Some(ttl) => ttl,
                None => return self.context.store.release_in_background(self.key, self.owner),
            },
        };
        // At most a line a second: a shutdown cuts off every open request.
        static THROTTLE: telemetry::Throttle = telemetry::Throttle::new();
        if let Some(suppressed) = THROTTLE.admit() {
            tracing::warn!(key = %self.key.tag(), suppressed, "the request may have been carried out: recording its outcome as unknown");
        }
        // Settled already: dropped unpolled (a runtime shutting down), it
        // must not release the claim; the lease ends it.
        let guard = ClaimGuard {
            context: self.context.clone(),
            renewal: None,
            settled: true,
            unknown_for: None,
            acted: None,
            kept: true,
            ..*self
        };
        // Counted as held again while it completes (this one is no more).
        guard.context.metrics.claim_taken();
        // Where a worker's runtime being dropped (a shutdown, a panic) does
        // not drop it: the claim was answered, so any connection will do.
        self.context.store.spawn_kept(async move {
            guard.complete(Outcome::Unknown, ttl).await;
        });
    }
}

/// Completes a record whose completion failed (the store did not answer):
/// renews the claim and retries, backing off, until the store takes it,
/// another request turns out to hold the key, or `ttl` has passed. Retries
/// meanwhile get 409. A lease that ran out meanwhile is no reason to stop:
/// the completion still lands where nobody has claimed the key since.
async fn retry_completion(
    store: StoreHandle,
    key: RecordKey,
    fingerprint: Fingerprint,
    owner: Owner,
    lease: Duration,
    outcome: Outcome,
    ttl: Duration,
) {
    let give_up = Instant::now() + ttl;
    let longest = (lease / 3).clamp(Duration::from_millis(1), Duration::from_secs(2));
    let mut pause = Duration::from_millis(100).min(longest);
    loop {
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(longest);
        let _ = store.renew(&key, owner, lease).await;
        match store.complete(&key, &fingerprint, owner, outcome.clone(), ttl).await {
            Ok(true) => return tracing::info!(key = %key.tag(), "record completed on a retry"),
            Ok(false) => {
                lost(&store, &key, &fingerprint, owner, &outcome, ttl).await;
                return;
            }
            Err(error) if Instant::now() >= give_up => {
                return tracing::error!(key = %key.tag(), error = %error_chain(&error), "gave up completing the record");
            }
            Err(_) => {}
        }
    }
}

/// [`lost`]'s look at the record, asked again while the store fails.
async fn look(
    store: &StoreHandle,
    key: &RecordKey,
    outcome: &Outcome,
) -> Result<Option<(Record, Duration)>, StoreError> {
    // A record that cannot be read reads so again.
    let settled = |found: &Result<_, StoreError>| matches!(found, Ok(_) | Err(StoreError::Corrupt(_)));
    asked_again(|| store.inspect_sized(key, outcome.size()), settled).await
}

/// `ask`'s answer, asked again up to [`LOST_LOOKS`] times,
/// [`LOST_LOOK_PAUSE`] apart, until `settled` takes it.
async fn asked_again<T, F: Future<Output = Result<T, StoreError>>>(
    mut ask: impl FnMut() -> F,
    settled: impl Fn(&Result<T, StoreError>) -> bool,
) -> Result<T, StoreError> {
    let mut answer = ask().await;
    for _ in 0..LOST_LOOKS {
        if settled(&answer) {
            break;
        }
        tokio::time::sleep(LOST_LOOK_PAUSE).await;
        answer = ask().await;
    }
    answer
}

/// How long [`lost`] waits on another request's claim to go.
const LOST_WAIT: Duration = Duration::from_secs(5);

/// How many more times [`lost`] asks a failing store, and how long it
/// waits before each.
const LOST_LOOKS: usize = 3;
const LOST_LOOK_PAUSE: Duration = Duration::from_millis(100);

/// How many times [`lost`] looks at a record again that went before it
/// was confirmed kept.
const LOST_ROUNDS: usize = 3;

/// Logs why a completion found another's claim or record, and returns
/// whether the record holds this answer anyway. Usually the lease ran out
/// and another request took the key; but a completion that reached the
/// store and was then sent again (its answer lost with a dropped
/// connection, as a Redis Cluster client resends) finds the record it
/// completed itself. A record keeps no owner, so a retry's identical
/// answer looks the same: both cases stay warnings, each named for what
/// the store holds.
///
/// A store that fails the look (the connection that lost the completion's
/// answer may be failing still) is asked again a few times, and if it
/// never answers that is what is said: not a lost lease it cannot tell.
///
/// A key that holds nothing by then had its record go from the store
/// after the completion was refused: a Redis primary that took the first
/// completion while it was cut off, then was failed over and dropped it,
/// an operator's purge, or another request whose claim it was released
/// it after its own failure (waited for a few seconds when the claim is
/// still there: one whose client got a 503 while the store was down is
/// released as it comes back). The answer (its client's) is written
/// again, as a completion writes where no record is, so a retry replays
/// it instead of running the request a second time.
///
/// A record found holding this answer counts once the store confirms it
/// kept ([`confirmed`]); one that goes meanwhile is looked at again.
async fn lost(
    store: &StoreHandle,
    key: &RecordKey,
    fingerprint: &Fingerprint,
    owner: Owner,
    outcome: &Outcome,
    ttl: Duration,
) -> bool {
    // A record found holding this answer that goes before it is
    // confirmed kept (a failover to a replica that never had it) is
    // looked at again, and so written again.
    for _ in 0..LOST_ROUNDS {
        let mut found = look(store, key, outcome).await;
        if let Ok(Some((Record::InFlight { .. }, _))) = found {
            // Another request's claim: often one given up on (its client
            // got a 503 while the store did not answer, and its release is
            // on the way once the store does). Waited out, for a while, and
            // looked at again.
            let _ = store.wait(key, LOST_WAIT).await;
            found = look(store, key, outcome).await;
        }
        let found = match found {
            Ok(Some(found)) => found,
            Ok(None) => return written_again(store, key, fingerprint, owner, outcome, ttl).await,
            Err(error) => {
                tracing::warn!(
                    key = %key.tag(),
                    error = %error_chain(&error),
                    "the claim was gone, and the record could not be read to tell whether it holds this answer"
                );
                return false;
            }
        };
        let left = match found {
            (
                Record::Completed {
                    fingerprint: found,
                    outcome: kept,
                },
                left,
            ) if found == *fingerprint && kept == *outcome => left,
            _ => return lease_lost(key),
        };
        match confirmed(store, key, fingerprint, left).await {
            Confirmed::Kept => {
                tracing::warn!(
                    key = %key.tag(),
                    "the claim was gone, but the record holds this answer: a completion resent after it landed, \
                     or a retry's identical one"
                );
                return true;
            }
            Confirmed::Gone => {}
            Confirmed::Failed => return false,
        }
    }
    tracing::warn!(key = %key.tag(), "the record holding this answer kept going before it was confirmed kept");
    false
}

/// [`lost`] on a key that holds nothing: the answer (its client's) is
/// written again (asked again while the store fails: in a failover it may
/// still be settling); whether it was.
async fn written_again(
    store: &StoreHandle,
    key: &RecordKey,
    fingerprint: &Fingerprint,
    owner: Owner,
    outcome: &Outcome,
    ttl: Duration,
) -> bool {
    let write = || store.complete(key, fingerprint, owner, outcome.clone(), ttl);
    const GONE: &str = "the claim was gone, and so was any record (another request's claim released, a purge, \
                        or a store that lost it, as in a failover)";
    match asked_again(write, Result::is_ok).await {
        Ok(true) => {
            tracing::warn!(key = %key.tag(), "{GONE}: written again with this answer");
            true
        }
        // Another request claimed the key meanwhile.
        Ok(false) => lease_lost(key),
        Err(error) => {
            tracing::warn!(
                key = %key.tag(),
                error = %error_chain(&error),
                "{GONE}: writing it again with this answer failed"
            );
            false
        }
    }
}

/// Says the key is another request's now; false.
fn lease_lost(key: &RecordKey) -> bool {
    tracing::warn!(key = %key.tag(), "lease lost to another request: this answer was not recorded");
    false
}

/// What [`confirmed`] found.
enum Confirmed {
    Kept,
    /// The record holding the answer is no longer there.
    Gone,
    /// The store never confirmed it while it lasted.
    Failed,
}

/// Whether the store confirms that the record of `key` found holding this
/// answer is kept as a completion it acknowledged would be: found by a
/// read, it may have been written by a connection that broke before Redis
/// said its replicas held it (`store.wait_for_replicas`), and a failover
/// then would lose it. Asked again, backing off as [`retry_completion`]
/// does, while the store fails, for the record's time `left` (when it
/// would be gone anyway).
async fn confirmed(store: &StoreHandle, key: &RecordKey, fingerprint: &Fingerprint, left: Duration) -> Confirmed {
    let give_up = Instant::now() + left;
    let mut pause = Duration::from_millis(100);
    let failed = loop {
        match store.confirm(key, fingerprint).await {
            Ok(true) => return Confirmed::Kept,
            Ok(false) => return Confirmed::Gone,
            Err(error) if Instant::now() >= give_up => break error,
            Err(_) => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        }
    };
    tracing::error!(
        key = %key.tag(),
        error = %error_chain(&failed),
        "the record holds this answer, but the store never confirmed it kept (copied to its replicas)"
    );
    Confirmed::Failed
}

/// Collects the response for the record, up to `max_response_body` bytes.
/// A streamed body's bytes, copied as they pass: a frame is a slice of the
/// upstream's read buffer, and keeping the slices would keep whole buffers
/// alive for a few bytes each (an answer of one-byte chunks would hold
/// many times `max_response_body`).
struct Recorder {
    body: BytesMut,
    limit: usize,
    over_limit: bool,
}

impl Recorder {
    /// Room for `expected` bytes (at least the body's declared length), so
    /// a body of known length is copied once; one declared past `limit` is
    /// not kept from the start.
    fn new(limit: usize, expected: u64) -> Recorder {
        let expected = usize::try_from(expected).unwrap_or(usize::MAX);
        let over_limit = expected > limit;
        Recorder {
            body: BytesMut::with_capacity(if over_limit { 0 } else { expected }),
            limit,
            over_limit,
        }
    }

    fn push(&mut self, data: &Bytes) {
        if self.over_limit {
            return;
        }
        if self.body.len() + data.len() > self.limit {
            self.over_limit = true;
            self.body = BytesMut::new();
        } else {
            self.body.extend_from_slice(data);
        }
    }
}

/// What a record keeps of an answer: the answer itself (see
/// [`StoredResponse::new`]), or `NotReplayable` when its body went past the
/// limit. `headers` are the kept headers, borrowed, so nothing is cloned
/// (each clone of a slice is an atomic count on the read buffer) only to be
/// copied and dropped; a list rather than the map, which is slower to walk
/// twice.
fn kept(over_limit: bool, status: StatusCode, headers: &[(&HeaderName, &HeaderValue)], chunks: &[Bytes]) -> Outcome {
    if over_limit {
        return Outcome::NotReplayable;
    }
    Outcome::Response(Arc::new(StoredResponse::new(status, headers, chunks)))
}

/// How an upstream exchange failed after the request may have been sent.
#[derive(Clone, Copy)]
enum Failure {
    Timeout,
    Broken,
}

/// Runs the exchange and returns the client's response.
///
/// The exchange runs inside the request's own future while the response is
/// made, which for a small answer is the whole exchange: no task to spawn,
/// no hop between tasks. Whatever is left when the response goes out (the
/// relay of a streamed body), or when the client hangs up and the request's
/// future is dropped, moves to a task of its own: see [`Handoff`].
pub async fn run(tracker: &TaskTracker, exchange: Exchange) -> Response<ResponseBody> {
    let (reply, mut response) = oneshot::channel();
    // In the request's span, so its logs and outcome carry the route and key
    // wherever it ends up running.
    // (When nothing records the span, the future is boxed as it is: the
    // wrapper would only cost a copy of it.)
    let exchange: Pin<Box<dyn Future<Output = ()> + Send>> = match telemetry::request_span() {
        Some(span) => boxed(|| exchange.drive(reply).instrument(span)),
        None => boxed(|| exchange.drive(reply)),
    };
    let mut handoff = Handoff {
        tracker,
        exchange: Some(exchange),
    };
    let response = std::future::poll_fn(|cx| {
        if let Some(exchange) = &mut handoff.exchange {
            // A panic ends the exchange, not the client's connection (as
            // the runtime would for a task): its reply is dropped, so the
            // client gets a 502, and its guard settles the claim.
            match std::panic::catch_unwind(AssertUnwindSafe(|| exchange.as_mut().poll(cx))) {
                Ok(Poll::Pending) => {}
                Ok(Poll::Ready(())) => handoff.exchange = None,
                Err(_) => {
                    tracing::error!("the exchange panicked; its claim is settled as an upstream failure");
                    handoff.exchange = None;
                }
            }
        }
        Pin::new(&mut response).poll(cx)
    })
    .await;
    drop(handoff);
    response.unwrap_or_else(|_| Problem::UpstreamUnavailable("the exchange ended unexpectedly".into()).response())
}

/// The future `make` makes, made in the box it is kept in: the space is
/// taken first, so the future's few kilobytes (sized for every state it
/// goes through) need not be built beside it and copied in.
fn boxed<F: Future + Send + 'static>(make: impl FnOnce() -> F) -> Pin<Box<dyn Future<Output = F::Output> + Send>> {
    let exchange: Box<F> = Box::write(Box::new_uninit(), make());
    Box::into_pin(exchange)
}

/// An exchange that must run to its end: dropped unfinished, it is spawned
/// on the tracker, so a client that hangs up cannot cancel it. It is boxed
/// from the start, so handing it over moves a pointer, not the future.
struct Handoff<'a> {
    tracker: &'a TaskTracker,
    exchange: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl Drop for Handoff<'_> {
    fn drop(&mut self) {
        let Some(exchange) = self.exchange.take() else { return };
        // Without a runtime (it is shutting down) the exchange is dropped:
        // its guard releases the claim as best it can.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(self.tracker.track_future(exchange));
        }
    }
}

impl Exchange {
    async fn drive(self, reply: oneshot::Sender<Response<ResponseBody>>) {
        let Exchange {
            context,
            live,
            key,
            fingerprint,
            owner,
            claimed_at,
            answered_at,
            request,
            timeout,
            client_timeout,
            deliver_unrecorded,
        } = self;
        let (policy, counters) = (&live.route.policy, &live.counters);
        let mut guard = ClaimGuard::new(
            context.clone(),
            key,
            fingerprint,
            owner,
            policy.lock_timeout,
            claimed_at,
        );
        // The claim's answer is when the request goes: the deadline and
        // the latency run from there.
        let started = answered_at;
        let deadline = started + timeout;
        guard.sending(policy);
        let begun = HeadBegun::default();
        // What a head begun and cut off says of the outcome (see `fail`).
        let begun_head = || begun.code().map(|code| !released(code, policy));
        let sent = guard
            .renewing_until(
                deadline,
                std::pin::pin!(context.client.request(request, OnStale::Fail, Some(&begun))),
            )
            .await;
        context.metrics.upstream_latency.observe(started.elapsed());
        let response = match sent {
            // Counted once its body has come whole, or broken off; the
            // request's log line, written as the head goes, says forwarded.
            Some(Ok(response)) => {
                RouteCounters::note(TelemetryOutcome::Forwarded);
                response
            }
            Some(Err(error)) if error.is_connect() => {
                counters.count(TelemetryOutcome::UpstreamError);
                tracing::warn!(route = %live.route.name, key = %key.tag(), error = %error_chain(&error), "upstream unreachable");
                guard.release().await;
                let _ = reply.send(Problem::UpstreamUnavailable("the upstream cannot be reached".into()).response());
                return;
            }
            Some(Err(error @ UpstreamError::Refused(code, _))) => {
                // The backend answered, so it had the request: whatever it
                // did is done, and running it again on a retry (as a
                // released key would) could do it twice. The key is kept
                // as an unknown outcome, whatever `on_upstream_failure`
                // says of failures that leave that in doubt; unless the
                // status says the backend did not act, or is a 5xx the
                // route releases, as a well-formed answer's would be.
                counters.count(TelemetryOutcome::UpstreamError);
                let error = error_chain(&error);
                if released(code, policy) {
                    tracing::warn!(route = %live.route.name, key = %key.tag(), error, "the upstream's answer cannot be passed on");
                    guard.release().await;
                    let problem = Problem::UpstreamUnavailable("the upstream's answer cannot be passed on".into());
                    let _ = reply.send(problem.response());
                } else {
                    tracing::warn!(route = %live.route.name, key = %key.tag(), error, "the upstream's answer cannot be passed on; its outcome is recorded as unknown");
                    guard.complete(Outcome::Unknown, policy.ttl).await;
                    let _ = reply.send(Problem::OutcomeUnknown.response());
                }
                return;
            }
            Some(Err(error)) => {
                counters.count(TelemetryOutcome::UpstreamError);
                tracing::warn!(route = %live.route.name, key = %key.tag(), error = %error_chain(&error), "upstream failed after the request was sent");
                // No head, nothing says whether the backend acted; but a
                // head begun (an early answer's, the write having failed)
                // settles it by its status, as a timeout's does.
                let problem = fail(guard, policy, Failure::Broken, begun_head()).await;
                let _ = reply.send(problem.response());
                return;
            }
            None => {
                counters.count(TelemetryOutcome::UpstreamError);
                // A head cut off by the deadline after its status line is
                // settled by its status, as one cut off by a reset is.
                let status = begun.code().map(|code| code.as_u16());
                tracing::warn!(route = %live.route.name, key = %key.tag(), status, "upstream timed out");
                let problem = fail(guard, policy, Failure::Timeout, begun_head()).await;
                let _ = reply.send(problem.response());
                return;
            }
        };

        let (head, mut body) = response.into_parts();
        let keep = !released(head.status.into(), policy);
        if keep {
            guard.acted = Some(policy.ttl);
        } else {
            guard.released_head();
        }
        let limit = usize::try_from(policy.max_response_body).unwrap_or(usize::MAX);
        let status = head.status;

        // Take the frames that have already arrived. When they are the
        // whole body (the common case for small answers), the record is
        // completed and the answer sent whole: no channel, no added delay.
        // (Inline: a small answer is one or two frames, and a Vec would be an
        // allocation per request.)
        let mut early: SmallVec<[Bytes; 2]> = SmallVec::new();
        let mut early_len = 0;
        let mut whole = body.is_end_stream();
        let mut yielded = false;
        // At most a few frames: each is a slice of the read buffer (see
        // `Recorder`); a body in more is streamed.
        while !whole && early_len <= limit && early.len() < EARLY_FRAMES {
            match body.frame().now_or_never() {
                // The body may be a moment behind the head on the socket:
                // give the runtime one turn to see it, then stream what is
                // missing.
                None if !yielded => {
                    yielded = true;
                    tokio::task::yield_now().await;
                }
                None => break,
                Some(None) => whole = true,
                Some(Some(Ok(frame))) => {
                    // Trailers are not passed on: a replay could not give
                    // them back (see `kept`).
                    if let Ok(data) = frame.into_data() {
                        early_len += data.len();
                        early.push(data);
                    }
                    whole = body.is_end_stream();
                }
                Some(Some(Err(error))) => {
                    counters.count(TelemetryOutcome::UpstreamError);
                    tracing::warn!(route = %live.route.name, key = %key.tag(), %error, "upstream body broke off");
                    let problem = fail(guard, policy, Failure::Broken, Some(keep)).await;
                    let _ = reply.send(problem.response());
                    return;
                }
            }
        }
        if whole {
            let outcome = keep.then(|| {
                let headers: SmallVec<[_; 16]> = kept_headers(&head.headers, policy).collect();
                kept(early_len > limit, status, &headers, &early)
            });
            if !settle_answer(guard, &live, outcome, deliver_unrecorded).await {
                let _ = reply.send(Problem::AnswerUnrecorded.response());
                return;
            }
            let body = match early.len() {
                0 | 1 => early.pop().unwrap_or_default(),
                _ => early.concat().into(),
            };
            let _ = reply.send(Response::from_parts(head, ResponseBody::full(body)));
            return;
        }

        // A streamed body may take its time: keep the lease alive. The
        // head goes to the client first: the record keeps copies.
        guard.start_renewal();
        let headers: Option<Vec<_>> = keep.then(|| {
            let kept = kept_headers(&head.headers, policy);
            kept.map(|(name, value)| (name.clone(), value.clone())).collect()
        });
        // An answer that is not kept is recorded by a recorder that keeps nothing.
        let expected = (early_len as u64).saturating_add(body.size_hint().lower());
        let recorder = Recorder::new(if keep { limit } else { 0 }, expected);
        let (tx, body_to_client) = ResponseBody::channel(CHANNEL_FRAMES);
        let client = reply.send(Response::from_parts(head, body_to_client)).ok().map(|_| tx);
        let mut relay = Relay {
            client,
            held: None,
            recorder,
            key,
            client_timeout,
            waited: Duration::ZERO,
        };
        for data in early {
            relay.data(data).await;
        }
        if !whole {
            loop {
                let frame = match tokio::time::timeout_at(deadline + relay.waited, body.frame()).await {
                    Ok(None) => break,
                    Ok(Some(Ok(frame))) => frame,
                    Ok(Some(Err(error))) => {
                        counters.count(TelemetryOutcome::UpstreamError);
                        tracing::warn!(route = %live.route.name, key = %key.tag(), %error, "upstream body broke off");
                        fail(guard, policy, Failure::Broken, Some(keep)).await;
                        abort(relay.client, "the upstream response broke off");
                        return;
                    }
                    Err(_) => {
                        counters.count(TelemetryOutcome::UpstreamError);
                        tracing::warn!(route = %live.route.name, key = %key.tag(), "upstream body timed out");
                        fail(guard, policy, Failure::Timeout, Some(keep)).await;
                        abort(relay.client, "the upstream response timed out");
                        return;
                    }
                };
                if let Ok(data) = frame.into_data() {
                    relay.data(data).await;
                }
            }
        }
        let Relay {
            client, held, recorder, ..
        } = relay;
        let outcome = headers.map(|headers| {
            let headers: SmallVec<[_; 16]> = headers.iter().map(|(name, value)| (name, value)).collect();
            kept(recorder.over_limit, status, &headers, &[recorder.body.freeze()])
        });
        // The held byte goes only with the record.
        if !settle_answer(guard, &live, outcome, deliver_unrecorded).await {
            return abort(client, "the answer could not be recorded");
        }
        if let Some(tx) = client {
            if let Some(last) = held
                && tokio::time::timeout(client_timeout, tx.send(Frame::data(last))).await != Ok(Ok(()))
            {
                return;
            }
            tx.finish();
        }
    }
}

/// Streams data frames to the client, always holding back the last byte
/// seen, while the recorder keeps a copy.
struct Relay {
    client: Option<BodySender>,
    held: Option<Bytes>,
    recorder: Recorder,
    key: RecordKey,
    /// How long a client may take to accept a frame before it is cut off
    /// (and the exchange goes on recording without it).
    client_timeout: Duration,
    /// Time spent handing frames to the client: the upstream's deadline is
    /// moved on by it, as a slow client holds the upstream back (the frame
    /// queue fills, then the sockets) without the upstream being slow.
    waited: Duration,
}

impl Relay {
    async fn data(&mut self, mut data: Bytes) {
        if data.is_empty() {
            return;
        }
        self.recorder.push(&data);
        let Some(tx) = &self.client else { return };
        let last = data.split_off(data.len() - 1);
        let previous = self.held.replace(last);
        let frames = previous.into_iter().chain((!data.is_empty()).then_some(data));
        for frame in frames {
            let asked = Instant::now();
            let sent = tokio::time::timeout(self.client_timeout, tx.send(Frame::data(frame))).await;
            self.waited += asked.elapsed();
            // A client that left, or stopped reading: go on without it.
            if sent != Ok(Ok(())) {
                tracing::debug!(key = %self.key.tag(), "client gone or stalled; finishing the exchange for the record");
                self.client = None;
                return;
            }
        }
    }
}

/// Settles an answer that came whole from the upstream ([`settle`]) and
/// counts it; whether its client gets it. The record comes before the
/// client holds the whole answer (SPEC §3.5): one the store failed, and
/// may still take (see [`ClaimGuard::complete`]), is held back, as a
/// proxy stopped before the completion's retry lands would lose an answer
/// it gave; but for one never replayed (not kept, or over
/// `max_response_body`), or when `deliver_unrecorded`.
async fn settle_answer(
    guard: ClaimGuard,
    live: &LiveRoute,
    outcome: Option<Outcome>,
    deliver_unrecorded: bool,
) -> bool {
    let key = guard.key;
    let replayable = outcome.as_ref().is_some_and(Outcome::is_response);
    if settle(guard, &live.route.policy, outcome).await || !replayable || deliver_unrecorded {
        live.counters.count_noted(TelemetryOutcome::Forwarded);
        return true;
    }
    // A line a second at most: a store that fails does so for every
    // exchange in flight.
    static THROTTLE: telemetry::Throttle = telemetry::Throttle::new();
    live.counters.count(TelemetryOutcome::StoreError);
    if let Some(suppressed) = THROTTLE.admit() {
        tracing::warn!(route = %live.route.name, key = %key.tag(), suppressed, "the answer is held back from the client: its record did not land (a retry gets it once it does)");
    }
    false
}

/// Completes the record with `outcome`, or releases the claim when nothing
/// is kept (a 5xx with `on_server_error = "release"`); false when the
/// completion failed and may still land (see [`ClaimGuard::complete`]):
/// the callers decide whether that holds the answer back.
async fn settle(guard: ClaimGuard, policy: &Policy, outcome: Option<Outcome>) -> bool {
    match outcome {
        Some(outcome) => guard.complete(outcome, policy.ttl).await,
        None => {
            guard.release().await;
            true
        }
    }
}

/// The response headers a record keeps: all but `replay_drop_headers`
/// (copied out of the read buffer with the body, by [`StoredResponse::new`]).
fn kept_headers<'a>(
    headers: &'a HeaderMap,
    policy: &'a Policy,
) -> impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)> {
    headers
        .iter()
        .filter(|(name, _)| !policy.replay_drop_headers.contains(name))
}

/// Settles an exchange whose answer broke off or timed out, and names the
/// problem the first client gets. Before the answer's head came
/// (`head` None), nothing says whether the backend acted, and
/// `on_upstream_failure` decides. After it, the head did: one the route
/// would keep (`Some(true)`: a 201, say) says the backend acted, so the
/// key is kept as an unknown outcome whatever the policy, as a released
/// key would run the request again on every retry; one it would not keep
/// (a 429, a 5xx that `on_server_error` releases) is released, as its
/// head settled that a retry may run.
async fn fail(guard: ClaimGuard, policy: &Policy, failure: Failure, head: Option<bool>) -> Problem {
    let on_failure = match head {
        None => policy.on_upstream_failure,
        Some(true) => OnUpstreamFailure::Unknown,
        Some(false) => OnUpstreamFailure::Release,
    };
    match on_failure {
        OnUpstreamFailure::Release => guard.release().await,
        OnUpstreamFailure::Unknown => {
            guard.complete(Outcome::Unknown, policy.ttl).await;
        }
    }
    match (failure, on_failure) {
        (Failure::Timeout, _) => Problem::UpstreamTimeout,
        (Failure::Broken, OnUpstreamFailure::Unknown) => Problem::OutcomeUnknown,
        (Failure::Broken, OnUpstreamFailure::Release) => {
            Problem::UpstreamUnavailable("the upstream connection failed after the request was sent".into())
        }
    }
}

/// Ends the client's body with an error, so it sees a broken response
/// rather than a complete-looking truncated one. Never waits: a client that
/// stopped reading must not keep the exchange (and its upstream
/// connection) alive.
fn abort(client: Option<BodySender>, why: &'static str) {
    if let Some(tx) = client {
        tx.abort(why);
    }
}

/// Whether an answer says the backend did not act on the request, which
/// may be sent again later: 408 (it was not received whole), 425 (too
/// early) and 429 (too many requests). Such an answer is delivered and
/// never recorded, whatever `on_server_error`: replayed, a moment's
/// refusal would be the key's answer for its whole TTL, and the retry it
/// asks for would never reach the backend. (Stripe, likewise, saves no
/// result for a request that never began executing.)
fn not_acted_on(status: http::StatusCode) -> bool {
    matches!(status.as_u16(), 408 | 425 | 429)
}

/// Whether an answer with status `code` releases its key rather than being
/// recorded: the backend did not act on it ([`not_acted_on`]), or it is a
/// 5xx on a route with `on_server_error = "release"`. A code below 100 is
/// no status, and releases nothing.
fn released(code: Code, policy: &Policy) -> bool {
    code.status().is_some_and(|status| {
        not_acted_on(status) || status.is_server_error() && policy.on_server_error == OnServerError::Release
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[test]
    fn a_recorded_frame_keeps_no_part_of_the_read_buffer() {
        let buffer = Bytes::from(vec![7u8; 16 << 10]);
        let mut recorder = Recorder::new(1 << 20, 0);
        for at in 0..4 {
            recorder.push(&buffer.slice(at..at + 1));
        }
        assert!(buffer.is_unique(), "a frame's slice was kept");
        assert_eq!(&recorder.body[..], &[7u8; 4]);
        recorder.push(&Bytes::from(vec![0u8; 1 << 20]));
        assert!(recorder.over_limit && recorder.body.is_empty());
        // Declared past the limit: nothing reserved, nothing kept.
        let declared = Recorder::new(1 << 20, 2 << 20);
        assert!(declared.over_limit && declared.body.capacity() == 0);
    }

    /// Two routes, "release" and "unknown" after `on_upstream_failure`, and
    /// an exchange's context on a memory store.
    fn routes_and_context() -> (crate::config::Config, StoreHandle, Arc<Context>) {
        let store = StoreHandle::memory(MemoryStore::new(1 << 20), Duration::from_secs(1));
        let (config, context) = routes_and_context_on(store.clone());
        (config, store, context)
    }

    /// [`routes_and_context`] on `store`.
    fn routes_and_context_on(store: StoreHandle) -> (crate::config::Config, Arc<Context>) {
        let config = crate::config::Config::parse(
            "[upstream]\nurl = \"http://127.0.0.1:9\"\n\
             [[route]]\nname = \"release\"\npath = \"/a\"\n\
             [[route]]\nname = \"unknown\"\npath = \"/b\"\non_upstream_failure = \"unknown\"\n",
            "test.toml",
        )
        .unwrap();
        let context = Arc::new(Context {
            store,
            client: super::super::upstream::client(&config.upstream).unwrap(),
            metrics: Arc::default(),
            exchanges: TaskTracker::new(),
            sent: SentClaims::default(),
        });
        (config, context)
    }

    /// A completion retried in the background counts its claim as held
    /// until the retry ends, however it ends: here at a panic of the
    /// store's renewal, the retry's first call.
    #[tokio::test]
    async fn a_completion_retry_that_panics_counts_its_claim_ended() {
        let faulty = Arc::new(crate::store::faulty::Faulty {
            failing_completes: 1.into(),
            renewals_panic: true,
            ..crate::store::faulty::Faulty::new()
        });
        let store = StoreHandle::new(faulty, Duration::from_secs(1));
        let (_, context) = routes_and_context_on(store.clone());
        let (key, _, _, answer) = landed_parts();
        claimed(&context, key)
            .await
            .complete(answer, Duration::from_secs(60))
            .await;
        assert_eq!(context.metrics.claims_in_flight(), 1, "held by the retry");
        context.exchanges.close();
        context.exchanges.wait().await;
        assert_eq!(context.metrics.claims_in_flight(), 0);
    }

    /// A completion the store fails leaves the answer unrecorded, to be
    /// held back from its client; unless the store takes no write until a
    /// restart, when nothing would land first.
    #[tokio::test]
    async fn a_failed_completion_holds_the_answer_back_unless_the_store_stopped() {
        for stopped in [false, true] {
            let faulty = Arc::new(crate::store::faulty::Faulty {
                failing_completes: 1.into(),
                stopped,
                ..crate::store::faulty::Faulty::new()
            });
            let store = StoreHandle::new(faulty, Duration::from_secs(1));
            let (_, context) = routes_and_context_on(store);
            let (key, _, _, answer) = landed_parts();
            let guard = claimed(&context, key).await;
            assert_eq!(guard.complete(answer.clone(), Duration::from_secs(60)).await, stopped);
            // One that lands: delivered.
            let guard = claimed(&context, RecordKey([3; 32])).await;
            assert!(guard.complete(answer, Duration::from_secs(60)).await);
            context.exchanges.close();
            context.exchanges.wait().await;
        }
    }

    /// A release the store fails (a dropped connection) is asked again,
    /// so the key is free well before the lease would end; and a release
    /// that fails every time leaves the claim to its lease.
    #[tokio::test]
    async fn a_release_the_store_fails_is_asked_again() {
        let faulty = Arc::new(crate::store::faulty::Faulty {
            failing_releases: 3.into(),
            ..crate::store::faulty::Faulty::new()
        });
        let store = StoreHandle::new(faulty.clone(), Duration::from_secs(1));
        let (_, context) = routes_and_context_on(store.clone());
        let (fingerprint, lease) = (Fingerprint([2; 32]), Duration::from_secs(30));
        let released = |key: RecordKey| {
            let store = store.clone();
            async move {
                let deadline = std::time::Instant::now() + Duration::from_secs(5);
                loop {
                    match store.inspect(&key).await.unwrap() {
                        None => return true,
                        Some(_) if std::time::Instant::now() > deadline => return false,
                        Some(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                    }
                }
            }
        };
        let (key, owner) = (RecordKey([3; 32]), Owner(3));
        store.claim(&key, &fingerprint, owner, lease, None).await.unwrap();
        ClaimGuard::new(context.clone(), key, fingerprint, owner, lease, Instant::now())
            .release()
            .await;
        assert!(released(key).await, "the release was not asked again");
        assert_eq!(faulty.failing_releases.load(std::sync::atomic::Ordering::Relaxed), 0);

        let (key, owner) = (RecordKey([4; 32]), Owner(4));
        store.claim(&key, &fingerprint, owner, lease, None).await.unwrap();
        faulty.failing_releases.store(100, std::sync::atomic::Ordering::Relaxed);
        ClaimGuard::new(context.clone(), key, fingerprint, owner, lease, Instant::now())
            .release()
            .await;
        // Asked once, then as many times as the retry asks, and no more.
        let failing = || faulty.failing_releases.load(std::sync::atomic::Ordering::Relaxed);
        let asked_last = 100 - 1 - crate::store::RELEASE_TRIES as usize;
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while failing() > asked_last && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(failing(), asked_last);
        let found = store.inspect(&key).await.unwrap().map(|(record, _)| record);
        assert!(matches!(found, Some(Record::InFlight { .. })), "{found:?}");
    }

    /// A guard dropped unsettled (its exchange panicked) releases the claim
    /// before the request may have gone, and after it on a route with
    /// `on_upstream_failure = "release"`; on one with `"unknown"` it records
    /// the outcome as unknown, so a retry cannot run the request again, and
    /// so it does on any route once the upstream's head said it acted; a
    /// head the route releases is released on any route.
    #[tokio::test]
    async fn a_guard_dropped_unsettled_settles_as_an_upstream_failure_would() {
        let (config, store, context) = routes_and_context();
        let lease = Duration::from_secs(30);
        let fingerprint = Fingerprint([2; 32]);
        // Route, sent, the head the route keeps (it acted) or releases.
        let cases = [
            (0, false, None),
            (0, true, None),
            (1, false, None),
            (1, true, None),
            (0, true, Some(true)),
            (1, true, Some(false)),
        ];
        for (n, (policy, sent, head)) in cases.into_iter().enumerate() {
            let (key, owner) = (RecordKey([n as u8; 32]), Owner(n as u128 + 1));
            store.claim(&key, &fingerprint, owner, lease, None).await.unwrap();
            let mut guard = ClaimGuard::new(context.clone(), key, fingerprint, owner, lease, Instant::now());
            if sent {
                guard.sending(&config.routes[policy].policy);
            }
            match head {
                Some(true) => guard.acted = Some(config.routes[policy].policy.ttl),
                Some(false) => guard.released_head(),
                None => {}
            }
            drop(guard);
            let unknown = policy == 1 && sent && head.is_none() || head == Some(true);
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            loop {
                let found = store.inspect(&key).await.unwrap().map(|(record, _)| record);
                match found {
                    None if !unknown => break,
                    Some(Record::Completed {
                        outcome: Outcome::Unknown,
                        ..
                    }) if unknown => break,
                    found => assert!(std::time::Instant::now() < deadline, "case {n}: {found:?}"),
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        // Nothing left for a shutdown to record as unknown (a released
        // head took its claim out of the set).
        assert!(context.sent.lock().is_empty());
        assert_eq!(context.metrics.claims_in_flight(), 0);
    }

    /// A claim a shutdown has taken to record as unknown is not released
    /// by its exchange ending at that moment: released first, the unknown
    /// outcome would land on the empty key all the same.
    #[tokio::test]
    async fn a_claim_a_shutdown_records_as_unknown_is_not_released_meanwhile() {
        let (config, store, context) = routes_and_context();
        let (key, fingerprint, owner, lease) = (
            RecordKey([9; 32]),
            Fingerprint([2; 32]),
            Owner(9),
            Duration::from_secs(30),
        );
        store.claim(&key, &fingerprint, owner, lease, None).await.unwrap();
        let mut guard = ClaimGuard::new(context.clone(), key, fingerprint, owner, lease, Instant::now());
        guard.sending(&config.routes[1].policy);
        // The shutdown takes it; its completion has not landed yet.
        let taken: Vec<_> = context.sent.lock().drain().collect();
        assert_eq!(taken.len(), 1);
        guard.release().await;
        let found = store.inspect(&key).await.unwrap().map(|(record, _)| record);
        assert!(matches!(found, Some(Record::InFlight { .. })), "{found:?}");
    }

    #[tokio::test]
    async fn a_completion_found_already_made_is_told_from_a_lost_lease() {
        let store = StoreHandle::memory(MemoryStore::new(1 << 20), Duration::from_secs(1));
        let (key, fingerprint, owner) = (RecordKey([1; 32]), Fingerprint([2; 32]), Owner(7));
        let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
        let answer = |body: &'static str| {
            let body = Bytes::from_static(body.as_bytes());
            Outcome::Response(Arc::new(StoredResponse::new(StatusCode::CREATED, &[], &[body])))
        };
        let lost = |fingerprint: Fingerprint, outcome: Outcome| {
            let store = store.clone();
            async move { lost(&store, &key, &fingerprint, owner, &outcome, ttl).await }
        };
        store.claim(&key, &fingerprint, Owner(8), lease, None).await.unwrap();
        assert!(!lost(fingerprint, answer("a")).await, "another's claim");
        assert!(matches!(
            store.inspect(&key).await.unwrap(),
            Some((Record::InFlight { .. }, _))
        ));
        store.release(&key, Owner(8)).await.unwrap();
        store.claim(&key, &fingerprint, owner, lease, None).await.unwrap();
        assert!(
            store
                .complete(&key, &fingerprint, owner, answer("a"), ttl)
                .await
                .unwrap()
        );
        // Sent again, as a resent command is: the claim is no longer there.
        assert!(
            !store
                .complete(&key, &fingerprint, owner, answer("a"), ttl)
                .await
                .unwrap()
        );
        assert!(lost(fingerprint, answer("a")).await);
        assert!(!lost(fingerprint, answer("b")).await, "another answer");
        assert!(!lost(Fingerprint([3; 32]), answer("a")).await, "another request");
    }

    /// A completion refused, then a key found holding nothing (a Redis
    /// primary failed over, which dropped the record it had just taken; a
    /// purge), or holding another request's claim that is released a
    /// moment later (its client got a 503 while the store did not answer,
    /// waited out): the answer the client got is written where it
    /// belongs, and a retry replays it.
    #[tokio::test]
    async fn an_answer_whose_record_went_is_written_again() {
        let store = StoreHandle::memory(MemoryStore::new(1 << 20), Duration::from_secs(1));
        let (fingerprint, owner, ttl) = (Fingerprint([2; 32]), Owner(7), Duration::from_secs(60));
        let answer = Outcome::Response(Arc::new(StoredResponse::new(
            StatusCode::CREATED,
            &[],
            &[Bytes::from_static(b"a")],
        )));
        let (gone, claimed) = (RecordKey([1; 32]), RecordKey([3; 32]));
        store
            .claim(&claimed, &fingerprint, Owner(8), Duration::from_secs(30), None)
            .await
            .unwrap();
        let releasing = tokio::spawn({
            let store = store.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                store.release(&claimed, Owner(8)).await.unwrap()
            }
        });
        for key in [gone, claimed] {
            assert!(lost(&store, &key, &fingerprint, owner, &answer, ttl).await);
            let found = store.inspect(&key).await.unwrap();
            assert!(
                matches!(&found, Some((Record::Completed { fingerprint: f, outcome }, _)) if *f == fingerprint && *outcome == answer),
                "{found:?}"
            );
        }
        assert!(releasing.await.unwrap());
    }

    /// The guard of `key`, claimed in `context`'s store with
    /// [`landed_parts`]'s fingerprint and owner, for 30 s.
    async fn claimed(context: &Arc<Context>, key: RecordKey) -> ClaimGuard {
        let (_, fingerprint, owner, _) = landed_parts();
        let lease = Duration::from_secs(30);
        context
            .store
            .claim(&key, &fingerprint, owner, lease, None)
            .await
            .unwrap();
        ClaimGuard::new(context.clone(), key, fingerprint, owner, lease, Instant::now())
    }

    /// The key, fingerprint, owner and answer of [`completed_on`]'s record.
    fn landed_parts() -> (RecordKey, Fingerprint, Owner, Outcome) {
        let answer = Outcome::Response(Arc::new(StoredResponse::new(
            StatusCode::CREATED,
            &[],
            &[Bytes::from_static(b"a")],
        )));
        (RecordKey([1; 32]), Fingerprint([2; 32]), Owner(7), answer)
    }

    /// `store`, behind a handle, holding [`landed_parts`]'s record,
    /// claimed and completed for `ttl`.
    async fn completed_on(store: Arc<crate::store::faulty::Faulty>, ttl: Duration) -> StoreHandle {
        let (key, fingerprint, owner, answer) = landed_parts();
        let handle = StoreHandle::new(store, Duration::from_secs(1));
        handle
            .claim(&key, &fingerprint, owner, Duration::from_secs(30), None)
            .await
            .unwrap();
        assert!(handle.complete(&key, &fingerprint, owner, answer, ttl).await.unwrap());
        handle
    }

    /// A completion found landed by a read counts once the store confirms
    /// it kept (a Redis's replicas hold it, with
    /// `store.wait_for_replicas`), asked again while it fails; never
    /// confirmed while the record lasts, it does not count. One that goes
    /// meanwhile (a failover to a replica that never had it) is written
    /// again.
    #[tokio::test]
    async fn a_completion_found_landed_counts_once_the_store_confirms_it_kept() {
        let (key, fingerprint, owner, answer) = landed_parts();
        let faulty = |failing: usize, purging: usize| {
            Arc::new(crate::store::faulty::Faulty {
                failing_confirms: failing.into(),
                purging_confirms: purging.into(),
                ..crate::store::faulty::Faulty::new()
            })
        };
        let long = Duration::from_secs(60);
        let store = faulty(2, 0);
        let handle = completed_on(store.clone(), long).await;
        assert!(lost(&handle, &key, &fingerprint, owner, &answer, long).await);
        assert_eq!(store.failing_confirms.load(std::sync::atomic::Ordering::Relaxed), 0);

        let short = Duration::from_secs(1);
        let handle = completed_on(faulty(usize::MAX, 0), short).await;
        let started = Instant::now();
        assert!(!lost(&handle, &key, &fingerprint, owner, &answer, short).await);
        assert!(started.elapsed() >= short / 2, "{:?}", started.elapsed());

        let store = faulty(0, 1);
        let handle = completed_on(store.clone(), long).await;
        assert!(lost(&handle, &key, &fingerprint, owner, &answer, long).await);
        assert_eq!(store.purging_confirms.load(std::sync::atomic::Ordering::Relaxed), 0);
        let found = handle.inspect(&key).await.unwrap();
        assert!(
            matches!(&found, Some((Record::Completed { outcome, .. }, _)) if *outcome == answer),
            "{found:?}"
        );
    }

    /// A completion that landed is told from a lost lease even when the
    /// store fails the first looks at the record; one it never lets be
    /// read is neither.
    #[tokio::test]
    async fn a_completion_that_landed_is_found_past_a_failing_look() {
        let (key, fingerprint, owner, answer) = landed_parts();
        for (failures, found) in [(LOST_LOOKS, true), (LOST_LOOKS + 1, false)] {
            let store = Arc::new(crate::store::faulty::Faulty {
                failing_looks: failures.into(),
                ..crate::store::faulty::Faulty::new()
            });
            let ttl = Duration::from_secs(60);
            let handle = completed_on(store, ttl).await;
            assert_eq!(
                lost(&handle, &key, &fingerprint, owner, &answer, ttl).await,
                found,
                "{failures} failures"
            );
        }
    }
}
