//! The in-process store: sharded maps behind `std::sync::Mutex`es (never
//! held across an `.await`), leases and TTLs as deadlines swept by a
//! background task, and a byte budget that evicts the records completed
//! (or refreshed) longest ago first, a few at a time (never an in-flight
//! claim, and a record that answers no replay only once no answer is left
//! to evict in its shard).
//!
//! The sweeper and the eviction read FIFO queues rather than sorted trees:
//! deadlines set with one duration (a route's `ttl`, its `lock_timeout`)
//! come due in the order they were set, so one queue per duration is
//! sorted. The TTL queues are also the eviction order: a TTL is set when a
//! record completes (or is refreshed), and its item carries a sequence
//! number that grows with each, so the oldest record is at the front of
//! one of them. An entry whose deadline changed, or that left early,
//! leaves a stale item behind, which is recognised by its sequence number
//! and skipped when it reaches the front. Every operation on a record is
//! O(1).

use std::collections::VecDeque;
use std::collections::hash_map::Entry as Slot;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use async_trait::async_trait;
use smallvec::SmallVec;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::clock::{coarse_lag, coarse_now};

use super::{Claim, Fingerprint, KeyMap, Outcome, Owner, Record, RecordKey, Store, StoreError, lock};

const SHARDS: usize = 16;
/// Records taken and looked up together, at most, once a shard is over its
/// budget (then evicted only as far as the budget needs: see
/// [`Shard::evict_of`]). The oldest records sit in memory nothing
/// has touched since they were written: looked up and dropped one by one,
/// each waits on a chain of cache misses (its slot in the map, then its
/// answer's count and header list); a batch's lookups, and then its first
/// touches of the answers, run side by side.
const EVICT_BATCH: usize = 8;
/// Bytes a record costs besides its response: its map entry, its queue
/// items and allocator slack, as measured under a new-key load (with the
/// separate completion queue there was before; kept, to err on the side
/// of the budget).
const OVERHEAD: usize = 1024;

pub struct MemoryStore {
    shared: Arc<Shared>,
}

struct Shared {
    shards: Box<[Padded<Mutex<Shard>>]>,
    budget_per_shard: usize,
}

/// A shard's lock and heads on cache lines of their own (128 bytes: the
/// line and the one the CPU prefetches beside it), so workers on two cores
/// using neighbouring shards do not pull each other's lines away.
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

#[derive(Default)]
struct Shard {
    entries: KeyMap<RecordKey, Entry>,
    /// Bytes held by completed entries.
    bytes: usize,
    /// Apart from the entries, so an entry being changed and the deadline
    /// it is given can be borrowed at once: one lookup per operation.
    deadlines: Deadlines,
}

#[derive(Default)]
struct Deadlines {
    /// Lease ends as they were set, one queue per duration, each therefore
    /// in deadline order: for the sweeper. There are a handful of
    /// durations (the routes' leases and TTLs): a list finds one faster
    /// than a map.
    leases: Vec<(Duration, DeadlineQueue)>,
    /// TTL ends of records that hold an answer, likewise: for the
    /// sweeper, and for eviction.
    ttls: Vec<(Duration, DeadlineQueue)>,
    /// TTL ends of records that hold none (outcome unknown, not
    /// replayable), likewise. They are what keeps the backend from a
    /// second call, cost little, and save no call to the backend that an
    /// answer would not: eviction takes them only once a shard has no
    /// answer left to evict.
    guards: Vec<(Duration, DeadlineQueue)>,
    seq: u64,
}

/// Which deadline a queue item is: an in-flight claim's lease end, or a
/// completed record's TTL end, with or without an answer to replay.
#[derive(Clone, Copy)]
enum Due {
    Lease,
    Answer,
    Guard,
}

impl Due {
    fn of(outcome: &Outcome) -> Due {
        if outcome.is_response() { Due::Answer } else { Due::Guard }
    }
}

/// Deadlines of one duration, in the order they were set: when each falls,
/// the sequence number it was set under, and whose it is.
/// A deadline, the sequence number of the entry's deadline it stands for,
/// and the entry's key.
type DeadlineItem = (Instant, u64, RecordKey);
type DeadlineQueue = VecDeque<DeadlineItem>;

struct Entry {
    fingerprint: Fingerprint,
    /// When the entry expires, and the sequence number of the queue item
    /// that stands for this deadline.
    deadline: (Instant, u64),
    state: State,
}

enum State {
    /// `done` is made by the first waiter: most claims have none.
    InFlight {
        owner: Owner,
        done: Option<Arc<Notify>>,
    },
    Done {
        outcome: Outcome,
        size: usize,
    },
}

impl MemoryStore {
    /// A store that keeps at most about `max_memory` bytes of records.
    pub fn new(max_memory: u64) -> MemoryStore {
        let shared = Arc::new(Shared {
            shards: (0..SHARDS).map(|_| Padded(Mutex::new(Shard::default()))).collect(),
            budget_per_shard: usize::try_from(max_memory).unwrap_or(usize::MAX) / SHARDS,
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(sweep(Arc::downgrade(&shared)));
        }
        MemoryStore { shared }
    }

    /// Bytes held by completed records.
    pub fn stored_bytes(&self) -> usize {
        self.shared.shards.iter().map(|s| lock(s).bytes).sum()
    }

    fn shard(&self, key: &RecordKey) -> MutexGuard<'_, Shard> {
        lock(&self.shared.shards[shard_of(key)])
    }
}

/// Record keys are SHA-256 digests, but fold and mix all of it anyway, so
/// shards stay even for any key.
fn shard_of(key: &RecordKey) -> usize {
    let folded = key
        .0
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
        .fold(0, |a, w| a ^ w);
    (folded.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SHARDS.trailing_zeros())) as usize
}

fn outcome_size(outcome: &Outcome) -> usize {
    OVERHEAD
        + match outcome {
            Outcome::Response(r) => r.size(),
            Outcome::NotReplayable | Outcome::Unknown => 0,
        }
}

impl Deadlines {
    /// Queues a deadline `lasting` from `now`; returns it for the entry.
    fn queue(&mut self, key: &RecordKey, now: Instant, lasting: Duration, due: Due) -> (Instant, u64) {
        self.seq += 1;
        let deadline = (now + lasting, self.seq);
        let queues = match due {
            Due::Lease => &mut self.leases,
            Due::Answer => &mut self.ttls,
            Due::Guard => &mut self.guards,
        };
        let queue = match queues.iter().position(|(d, _)| *d == lasting) {
            Some(at) => &mut queues[at].1,
            None => {
                queues.push((lasting, VecDeque::new()));
                &mut queues.last_mut().expect("just pushed").1
            }
        };
        queue.push_back((deadline.0, deadline.1, *key));
        deadline
    }

    /// The TTL queues of answers, or of `guards`.
    fn ttl_queues(&mut self, guards: bool) -> &mut [(Duration, DeadlineQueue)] {
        if guards { &mut self.guards } else { &mut self.ttls }
    }

    /// Which of [`Deadlines::ttl_queues`] has the front record completed
    /// (or refreshed) longest ago: the next to evict.
    fn oldest_ttl(&mut self, guards: bool) -> Option<usize> {
        let queues = self.ttl_queues(guards).iter().enumerate();
        let fronts = queues.filter_map(|(i, (_, queue))| Some((i, queue.front()?.1)));
        fronts.min_by_key(|&(_, seq)| seq).map(|(i, _)| i)
    }
}

/// The entry under `key` in `entries`, unless its deadline has passed
/// (then it is removed, and `bytes` counts it out): one lookup. A miss,
/// rare outside a claim, may make the map room for one more entry, as the
/// next insert would.
fn live<'a>(
    entries: &'a mut KeyMap<RecordKey, Entry>,
    bytes: &mut usize,
    key: &RecordKey,
    now: Instant,
) -> Option<&'a mut Entry> {
    match entries.entry(*key) {
        Slot::Occupied(slot) if slot.get().deadline.0 > now => Some(slot.into_mut()),
        Slot::Occupied(slot) => {
            forget(bytes, &slot.remove());
            None
        }
        Slot::Vacant(_) => None,
    }
}

/// Whether a queued deadline, `seq`, is still the one of the entry under
/// `key` (an entry whose deadline changed, or that left, leaves its old
/// items behind).
fn current(entries: &KeyMap<RecordKey, Entry>, key: &RecordKey, seq: u64) -> bool {
    entries.get(key).is_some_and(|e| e.deadline.1 == seq)
}

/// What an entry leaving the map undoes: its waiters are woken, its bytes
/// counted out.
fn forget(bytes: &mut usize, entry: &Entry) {
    match &entry.state {
        State::InFlight { done, .. } => done.iter().for_each(|done| done.notify_waiters()),
        State::Done { size, .. } => *bytes -= size,
    }
}

/// Puts `entry` into a slot that held no live one: vacant, or expired
/// (forgotten first).
fn fill(bytes: &mut usize, slot: Slot<'_, RecordKey, Entry>, entry: Entry) {
    match slot {
        Slot::Occupied(mut expired) => forget(bytes, &expired.insert(entry)),
        Slot::Vacant(slot) => {
            slot.insert(entry);
        }
    }
}

impl Shard {
    /// The entry under `key`, unless its deadline has passed (then it is removed).
    fn live(&mut self, key: &RecordKey, now: Instant) -> Option<&mut Entry> {
        live(&mut self.entries, &mut self.bytes, key, now)
    }

    fn remove(&mut self, key: &RecordKey) -> Option<Entry> {
        let entry = self.entries.remove(key)?;
        forget(&mut self.bytes, &entry);
        Some(entry)
    }

    /// Removes up to `limit` entries whose deadline has passed; returns how
    /// many queue items it looked at.
    fn sweep(&mut self, now: Instant, limit: usize) -> usize {
        let mut due = Vec::new();
        let mut looked = 0;
        let Deadlines {
            leases, ttls, guards, ..
        } = &mut self.deadlines;
        for (_, queue) in leases.iter_mut().chain(ttls.iter_mut()).chain(guards.iter_mut()) {
            while looked < limit
                && let Some(&(at, seq, key)) = queue.front()
                && at <= now
            {
                queue.pop_front();
                due.push((seq, key));
                looked += 1;
            }
        }
        leases.retain(|(_, queue)| !queue.is_empty());
        ttls.retain(|(_, queue)| !queue.is_empty());
        guards.retain(|(_, queue)| !queue.is_empty());
        for (seq, key) in due {
            if current(&self.entries, &key, seq) {
                self.remove(&key);
            }
        }
        self.compact();
        looked
    }

    /// Drops stale items from queues that hold many more items than there
    /// are entries: an evicted record's TTL item would otherwise wait a
    /// whole TTL to reach the front. Keeps every queue within twice the
    /// entries (plus a constant), at a cost amortised over the operations
    /// that made the stale items.
    fn compact(&mut self) {
        let bound = 2 * self.entries.len() + 1024;
        let entries = &self.entries;
        let Deadlines {
            leases, ttls, guards, ..
        } = &mut self.deadlines;
        for (_, queue) in leases.iter_mut().chain(ttls.iter_mut()).chain(guards.iter_mut()) {
            if queue.len() > bound {
                queue.retain(|(_, seq, key)| current(entries, key, *seq));
            }
        }
    }

    /// Whether `key` holds a completed record whose TTL item is `seq`.
    fn is_completed(&self, key: &RecordKey, seq: u64) -> bool {
        self.entries
            .get(key)
            .is_some_and(|e| e.deadline.1 == seq && matches!(e.state, State::Done { .. }))
    }

    /// The in-flight entry of `key` if `owner` holds it, with the deadline
    /// queues, so it can be given a new deadline without a second lookup.
    fn owned(&mut self, key: &RecordKey, owner: Owner, now: Instant) -> Option<(&mut Entry, &mut Deadlines)> {
        let entry = live(&mut self.entries, &mut self.bytes, key, now)
            .filter(|e| matches!(e.state, State::InFlight { owner: o, .. } if o == owner))?;
        Some((entry, &mut self.deadlines))
    }

    /// Evicts the records completed (or refreshed) longest ago, a batch at
    /// a time, until the shard fits `budget`: those with an answer first,
    /// then, only if none is left, those without (see
    /// [`Deadlines::guards`]); never `newest`, the record just written: a
    /// record larger than the budget stays rather than vanish as it is
    /// stored. The evicted entries go to `evicted`, to be dropped once the
    /// shard's lock is let go (see [`drop_evicted`]).
    fn evict_to(&mut self, budget: usize, newest: &RecordKey, evicted: &mut Vec<Entry>) {
        self.evict_of(false, budget, newest, evicted);
        self.evict_of(true, budget, newest, evicted);
    }

    /// How many records to take and look up together from a shard over
    /// `budget` (at most: see [`Shard::evict_of`]): as many as the excess
    /// needs, by the shard's average record, and more,
    /// up to [`EVICT_BATCH`], only while they fit in a thirty-second of the
    /// budget below it. Small records go a batch at a time; large ones
    /// (a shard of a few answers near `max_response_body`) one at a time,
    /// as a batch of eight would empty the shard, answers a moment old
    /// among them, whose clients' immediate retries would run again.
    fn batch_for(&self, budget: usize) -> usize {
        let over = self.bytes - budget;
        let average = (self.bytes / self.entries.len().max(1)).max(1);
        let mut wanted = over.div_ceil(average).max(1);
        while wanted < EVICT_BATCH && (wanted + 1) * average <= over + budget / 32 {
            wanted += 1;
        }
        wanted.min(EVICT_BATCH)
    }

    /// [`Shard::evict_to`]'s work on one kind of record. A batch is taken
    /// from the queues and looked up together; its records are then
    /// evicted in order only while the shard is still over its budget, or
    /// within a thirty-second below it (a shard's average can hide a few
    /// large records among many small ones), and the rest go back to the
    /// front of their queues, as they were.
    fn evict_of(&mut self, guards: bool, budget: usize, newest: &RecordKey, evicted: &mut Vec<Entry>) {
        let floor = budget - budget / 32;
        while self.bytes > budget {
            let wanted = self.batch_for(budget);
            // Each with the queue it came from.
            let mut batch: SmallVec<[(usize, DeadlineItem); EVICT_BATCH]> = SmallVec::new();
            while batch.len() < wanted
                && let Some(at) = self.deadlines.oldest_ttl(guards)
            {
                let queue = &mut self.deadlines.ttl_queues(guards)[at].1;
                let Some(&item) = queue.front() else { break };
                let (_, seq, key) = item;
                // The record just written stays; an older item of its key
                // (from before a purge or expiry) is only stale.
                if key == *newest && current(&self.entries, &key, seq) {
                    break;
                }
                queue.pop_front();
                if key != *newest {
                    batch.push((at, item));
                }
            }
            if batch.is_empty() {
                break;
            }
            // Every lookup first, so their misses overlap; then the removals,
            // which find the slots in the cache.
            let current: [bool; EVICT_BATCH] = std::array::from_fn(|i| {
                batch
                    .get(i)
                    .is_some_and(|&(_, (_, seq, key))| self.is_completed(&key, seq))
            });
            let mut kept = batch.len();
            for (i, &(_, (_, _, key))) in batch.iter().enumerate() {
                if self.bytes <= floor {
                    kept = i;
                    break;
                }
                if current[i] {
                    evicted.extend(self.remove(&key));
                }
            }
            for &(at, item) in batch[kept..].iter().rev() {
                self.deadlines.ttl_queues(guards)[at].1.push_front(item);
            }
        }
    }
}

impl MemoryStore {
    /// [`Store::claim`], answered at once: the memory store never waits, so
    /// the proxy calls it directly, without a boxed future or a deadline.
    pub fn claim_now(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        lease: Duration,
        refresh_ttl: Option<Duration>,
    ) -> Claim {
        let now = coarse_now();
        let mut guard = self.shard(key);
        let shard = &mut *guard;
        // One lookup: the slot found is the one claimed.
        let slot = match shard.entries.entry(*key) {
            Slot::Occupied(slot) if slot.get().deadline.0 > now => {
                let entry = slot.into_mut();
                let found = entry.fingerprint;
                return match &entry.state {
                    State::InFlight { owner: held, .. } if *held == owner => Claim::Claimed,
                    State::InFlight { .. } => Claim::InFlight { fingerprint: found },
                    State::Done { outcome, .. } => {
                        let outcome = outcome.clone();
                        if let Some(ttl) = refresh_ttl.filter(|_| found == *fingerprint && outcome.is_response()) {
                            entry.deadline = shard.deadlines.queue(key, now, ttl, Due::Answer);
                        }
                        Claim::Completed {
                            fingerprint: found,
                            outcome,
                        }
                    }
                };
            }
            slot => slot,
        };
        let claimed = Entry {
            fingerprint: *fingerprint,
            deadline: shard.deadlines.queue(key, now, lease, Due::Lease),
            state: State::InFlight { owner, done: None },
        };
        fill(&mut shard.bytes, slot, claimed);
        Claim::Claimed
    }

    /// [`Store::complete`], answered at once.
    pub fn complete_now(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        outcome: Outcome,
        ttl: Duration,
    ) -> bool {
        let now = coarse_now();
        let (size, due) = (outcome_size(&outcome), Due::of(&outcome));
        let mut guard = self.shard(key);
        let shard = &mut *guard;
        match shard.entries.entry(*key) {
            Slot::Occupied(slot) if slot.get().deadline.0 > now => {
                let entry = slot.into_mut();
                if !matches!(entry.state, State::InFlight { owner: held, .. } if held == owner) {
                    return false;
                }
                let previous = std::mem::replace(&mut entry.state, State::Done { outcome, size });
                if let State::InFlight { done: Some(done), .. } = previous {
                    done.notify_waiters();
                }
                entry.deadline = shard.deadlines.queue(key, now, ttl, due);
            }
            // No live record: the lease ran out, or the claim was purged,
            // and nobody has claimed the key since. The answer is kept.
            slot => {
                let done = Entry {
                    fingerprint: *fingerprint,
                    deadline: shard.deadlines.queue(key, now, ttl, due),
                    state: State::Done { outcome, size },
                };
                fill(&mut shard.bytes, slot, done);
            }
        }
        shard.bytes += size;
        let budget = self.shared.budget_per_shard;
        let mut evicted = Vec::new();
        shard.evict_to(budget, key, &mut evicted);
        drop(guard);
        drop_evicted(evicted);
        true
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        lease: Duration,
        refresh_ttl: Option<Duration>,
    ) -> Result<Claim, StoreError> {
        Ok(self.claim_now(key, fingerprint, owner, lease, refresh_ttl))
    }

    async fn complete(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        outcome: Outcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        Ok(self.complete_now(key, fingerprint, owner, outcome, ttl))
    }

    async fn release(&self, key: &RecordKey, owner: Owner) -> Result<bool, StoreError> {
        let mut shard = self.shard(key);
        if shard.owned(key, owner, coarse_now()).is_none() {
            return Ok(false);
        }
        shard.remove(key);
        Ok(true)
    }

    async fn renew(&self, key: &RecordKey, owner: Owner, lease: Duration) -> Result<bool, StoreError> {
        let now = coarse_now();
        let mut shard = self.shard(key);
        let Some((entry, deadlines)) = shard.owned(key, owner, now) else {
            return Ok(false);
        };
        entry.deadline = deadlines.queue(key, now, lease, Due::Lease);
        Ok(true)
    }

    async fn wait(&self, key: &RecordKey, timeout: Duration) -> Result<(), StoreError> {
        let now = coarse_now();
        let (done, lease_end) = {
            let mut shard = self.shard(key);
            match shard.live(key, now) {
                Some(Entry {
                    state: State::InFlight { done, .. },
                    deadline,
                    ..
                }) => (done.get_or_insert_with(Default::default).clone(), deadline.0),
                _ => return Ok(()),
            }
        };
        // `notify_waiters` wakes only futures that exist: create and enable
        // one, then check the claim is still the one seen above.
        let notified = done.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let still_in_flight = matches!(
            self.shard(key).live(key, coarse_now()),
            Some(Entry { state: State::InFlight { done: Some(d), .. }, .. }) if Arc::ptr_eq(d, &done)
        );
        if still_in_flight {
            // The lease's end is a change too: nobody may notify for it.
            // The coarse clock lags the precise one by up to its tick (4
            // ms), so the timeout runs from a precise reading (from a coarse
            // one a short wait would end at once), and the wait for the
            // lease lasts a tick past its end (before that a claim still
            // finds it held), at least a millisecond should the coarse clock
            // be later still. Either way a caller would spin.
            let now = Instant::now();
            let lease_over = (lease_end + coarse_lag()).max(now + Duration::from_millis(1));
            let until = (now + timeout).min(lease_over);
            let _ = tokio::time::timeout_at(until, notified).await;
        }
        Ok(())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn stored_bytes(&self) -> Option<usize> {
        Some(MemoryStore::stored_bytes(self))
    }

    async fn inspect(&self, key: &RecordKey) -> Result<Option<(Record, Duration)>, StoreError> {
        let now = coarse_now();
        let mut shard = self.shard(key);
        Ok(shard.live(key, now).map(|entry| {
            let record = match &entry.state {
                State::InFlight { owner, .. } => Record::InFlight {
                    fingerprint: entry.fingerprint,
                    owner: *owner,
                },
                State::Done { outcome, .. } => Record::Completed {
                    fingerprint: entry.fingerprint,
                    outcome: outcome.clone(),
                },
            };
            (record, entry.deadline.0 - now)
        }))
    }

    async fn purge(&self, key: &RecordKey) -> Result<bool, StoreError> {
        let mut shard = self.shard(key);
        Ok(shard.live(key, coarse_now()).is_some() && shard.remove(key).is_some())
    }
}

/// Drops evicted entries, after first reading each answer's count (its
/// header list lies inline beside it): the loads of the whole batch
/// overlap, where dropping each in turn would wait on its misses one after
/// another.
fn drop_evicted(evicted: Vec<Entry>) {
    let counts: usize = evicted
        .iter()
        .filter_map(|entry| match &entry.state {
            State::Done {
                outcome: Outcome::Response(answer),
                ..
            } => Some(Arc::strong_count(answer)),
            _ => None,
        })
        .sum();
    std::hint::black_box(counts);
    drop(evicted);
}

/// Removes entries whose deadline has passed, a bounded batch at a time so a
/// shard's lock is never held for long. Stops when the store is dropped.
async fn sweep(shared: Weak<Shared>) {
    const BATCH: usize = 512;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else { return };
        let now = coarse_now();
        for shard in shared.shards.iter() {
            while lock(shard).sweep(now, BATCH) == BATCH {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoredResponse;
    use bytes::Bytes;
    use http::StatusCode;

    /// Record keys that fall in shard `shard`.
    fn keys_of_shard(shard: usize) -> impl Iterator<Item = RecordKey> {
        (0..u32::MAX)
            .map(|i| {
                let mut k = [0u8; 32];
                k[..4].copy_from_slice(&i.to_be_bytes());
                RecordKey(k)
            })
            .filter(move |k| shard_of(k) == shard)
    }

    fn response(len: usize) -> Outcome {
        Outcome::Response(Arc::new(StoredResponse::new(
            StatusCode::CREATED,
            &[],
            &[Bytes::from(vec![b'x'; len])],
        )))
    }

    #[tokio::test]
    async fn budget_evicts_oldest_completed_never_in_flight() {
        let store = MemoryStore::new((SHARDS * 10_000) as u64);
        let fp = Fingerprint([0; 32]);
        let lease = Duration::from_secs(30);
        let ttl = Duration::from_secs(3600);
        // Eleven keys of one shard.
        let keys: Vec<RecordKey> = keys_of_shard(0).take(11).collect();
        let key = |i: u8| keys[(i as usize).min(10)];
        let in_flight = key(10);
        assert_eq!(
            store.claim(&in_flight, &fp, Owner(1), lease, None).await.unwrap(),
            Claim::Claimed
        );
        for i in 0..10u8 {
            let owner = Owner(100 + i as u128);
            assert_eq!(
                store.claim(&key(i), &fp, owner, lease, None).await.unwrap(),
                Claim::Claimed
            );
            assert!(store.complete(&key(i), &fp, owner, response(3000), ttl).await.unwrap());
        }
        assert!(store.stored_bytes() <= 10_000);
        // The oldest went first, the newest stayed, and the claim is untouched.
        assert_eq!(
            store.claim(&key(0), &fp, Owner(9), lease, None).await.unwrap(),
            Claim::Claimed
        );
        assert!(matches!(
            store.claim(&key(9), &fp, Owner(9), lease, None).await.unwrap(),
            Claim::Completed { .. }
        ));
        assert!(matches!(
            store.claim(&in_flight, &fp, Owner(9), lease, None).await.unwrap(),
            Claim::InFlight { .. }
        ));
    }

    #[tokio::test]
    async fn eviction_follows_completion_order_across_ttls_and_refreshes() {
        // Twenty records of one shard fit its budget: each one more evicts
        // the one completed (or refreshed) longest ago.
        let size = outcome_size(&response(100));
        let store = MemoryStore::new((SHARDS * size * 20) as u64);
        let fp = Fingerprint([0; 32]);
        let lease = Duration::from_secs(30);
        let keys: Vec<RecordKey> = keys_of_shard(0).take(28).collect();
        // Two routes' TTLs, taking turns: two queues.
        let ttl = |i: usize| Duration::from_secs(if i.is_multiple_of(2) { 3600 } else { 7200 });
        for (i, key) in keys[..20].iter().enumerate() {
            let owner = Owner(i as u128 + 1);
            store.claim(key, &fp, owner, lease, None).await.unwrap();
            assert!(store.complete(key, &fp, owner, response(100), ttl(i)).await.unwrap());
        }
        // A replay refreshes the oldest record's TTL: it is now the newest.
        let refreshed = store
            .claim(&keys[0], &fp, Owner(99), lease, Some(ttl(0)))
            .await
            .unwrap();
        assert!(matches!(refreshed, Claim::Completed { .. }));
        for (i, key) in keys.iter().enumerate().skip(20) {
            let owner = Owner(i as u128 + 1);
            store.claim(key, &fp, owner, lease, None).await.unwrap();
            assert!(store.complete(key, &fp, owner, response(100), ttl(i)).await.unwrap());
        }

        let kept = |key: &RecordKey| {
            let shard = store.shard(key);
            shard.entries.contains_key(key)
        };
        // Key 0's stale queue item (from before its refresh) evicted
        // nothing; keys 1 to 8, from both queues, went; the refreshed key 0
        // and keys 9 to 27 stayed.
        for (i, key) in keys.iter().enumerate() {
            assert_eq!(kept(key), !(1..=8).contains(&i), "key {i}");
        }
    }

    /// A record without an answer (outcome unknown, not replayable) is what
    /// keeps a retry from the backend: answers, newer or not, are evicted
    /// before it, and it goes only once no answer is left.
    #[tokio::test]
    async fn records_without_an_answer_are_evicted_last() {
        let size = outcome_size(&response(100));
        // Ten answers of one shard fit its budget.
        let store = MemoryStore::new((SHARDS * size * 10) as u64);
        let fp = Fingerprint([0; 32]);
        let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
        let keys: Vec<RecordKey> = keys_of_shard(7).take(60).collect();
        let store_as = |key: RecordKey, outcome: Outcome| {
            let store = &store;
            async move {
                let owner = Owner(u128::from(key.0[3]) + 1);
                assert_eq!(
                    store.claim(&key, &fp, owner, lease, None).await.unwrap(),
                    Claim::Claimed
                );
                assert!(store.complete(&key, &fp, owner, outcome, ttl).await.unwrap());
            }
        };
        let held = |key: &RecordKey| store.shard(key).entries.contains_key(key);
        store_as(keys[0], Outcome::Unknown).await;
        store_as(keys[1], Outcome::NotReplayable).await;
        // Thirty answers after them: many evictions, none of the two.
        for &key in &keys[2..32] {
            store_as(key, response(100)).await;
        }
        assert!(held(&keys[0]) && held(&keys[1]));
        assert!(!held(&keys[2]) && held(&keys[31]));
        assert!(store.stored_bytes() <= size * 10);
        // A shard of records without answers only: the oldest go.
        for &key in &keys[32..60] {
            store_as(key, Outcome::Unknown).await;
        }
        assert!(store.stored_bytes() <= size * 10);
        assert!(!held(&keys[0]) && held(&keys[59]));
        assert!(
            !(2..32).any(|i| held(&keys[i])),
            "an answer outlived a record without one"
        );
    }

    #[tokio::test]
    async fn eviction_goes_a_batch_below_the_budget_at_most() {
        // Twenty records of one shard fit its budget.
        let size = outcome_size(&response(100));
        let store = MemoryStore::new((SHARDS * size * 20) as u64);
        let fp = Fingerprint([0; 32]);
        for (i, key) in keys_of_shard(3).take(100).enumerate() {
            let owner = Owner(i as u128);
            store
                .claim(&key, &fp, owner, Duration::from_secs(30), None)
                .await
                .unwrap();
            assert!(
                store
                    .complete(&key, &fp, owner, response(100), Duration::from_secs(60))
                    .await
                    .unwrap()
            );
            let held = lock(&store.shared.shards[3]).entries.len();
            assert!(held <= 20, "{held} records held over a budget of 20");
            assert!(
                held + EVICT_BATCH > (i + 1).min(20),
                "{held} records held after {} stored",
                i + 1
            );
            assert_eq!(store.stored_bytes(), held * size);
        }
    }

    /// A shard of a few large answers evicts only what its budget needs:
    /// a batch would take answers a moment old, whose clients' immediate
    /// retries would then run again. Small ones still go a batch at a time.
    #[tokio::test]
    async fn large_answers_are_evicted_only_as_the_budget_needs() {
        for (body, fits, batch) in [(100 * 1024, 8, 1), (100, 4000, EVICT_BATCH)] {
            let size = outcome_size(&response(body));
            let store = MemoryStore::new((SHARDS * size * fits) as u64);
            let fp = Fingerprint([0; 32]);
            let mut least = usize::MAX;
            for (i, key) in keys_of_shard(7).take(fits + 30).enumerate() {
                let owner = Owner(i as u128);
                store
                    .claim(&key, &fp, owner, Duration::from_secs(30), None)
                    .await
                    .unwrap();
                let answer = response(body);
                assert!(
                    store
                        .complete(&key, &fp, owner, answer, Duration::from_secs(60))
                        .await
                        .unwrap()
                );
                let held = lock(&store.shared.shards[7]).entries.len();
                assert!(held <= fits, "{held} records held over a budget of {fits}");
                if i >= fits {
                    least = least.min(held);
                }
            }
            assert_eq!(least, fits + 1 - batch, "records of {body} bytes");
        }
    }

    /// A shard's average hides a few large records among many small ones:
    /// the batch it sizes may hold them all, but they go only as far as
    /// the budget needs, the rest kept in their place.
    #[tokio::test]
    async fn a_few_large_records_among_many_small_go_only_as_the_budget_needs() {
        let (large, small) = (outcome_size(&response(100 * 1024)), outcome_size(&response(100)));
        let share = 4 * large + 200 * small;
        let store = MemoryStore::new((SHARDS * share) as u64);
        let fp = Fingerprint([0; 32]);
        let keys: Vec<RecordKey> = keys_of_shard(9).take(4 + 400).collect();
        for (i, key) in keys.iter().enumerate() {
            let owner = Owner(i as u128);
            store
                .claim(key, &fp, owner, Duration::from_secs(30), None)
                .await
                .unwrap();
            let answer = response(if i < 4 { 100 * 1024 } else { 100 });
            assert!(
                store
                    .complete(key, &fp, owner, answer, Duration::from_secs(60))
                    .await
                    .unwrap()
            );
            let bytes = store.stored_bytes();
            assert!(bytes <= share, "{bytes} bytes held over a budget of {share}");
            assert!(
                i < 4 + 200 || bytes + large >= share - share / 32,
                "{bytes} bytes held of {share} after {} stored",
                i + 1
            );
        }
        // The large ones went one by one, oldest first, as the small came.
        let held = |key: &RecordKey| lock(&store.shared.shards[9]).entries.contains_key(key);
        assert!(!held(&keys[0]) && held(&keys[403]));
    }

    #[tokio::test]
    async fn a_stale_item_of_the_newest_record_does_not_stop_eviction() {
        // Twenty records of one shard fit its budget.
        let size = outcome_size(&response(100));
        let store = MemoryStore::new((SHARDS * size * 20) as u64);
        let fp = Fingerprint([0; 32]);
        let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
        let keys: Vec<RecordKey> = keys_of_shard(5).take(21).collect();
        for (i, key) in keys[..20].iter().enumerate() {
            let owner = Owner(i as u128);
            store.claim(key, &fp, owner, lease, None).await.unwrap();
            assert!(store.complete(key, &fp, owner, response(100), ttl).await.unwrap());
        }
        // The oldest record is purged and stored again: its first TTL item,
        // now stale, is still at the front of the queue.
        assert!(store.purge(&keys[0]).await.unwrap());
        let owner = Owner(100);
        store.claim(&keys[20], &fp, owner, lease, None).await.unwrap();
        assert!(store.complete(&keys[20], &fp, owner, response(100), ttl).await.unwrap());
        let owner = Owner(101);
        store.claim(&keys[0], &fp, owner, lease, None).await.unwrap();
        assert!(store.complete(&keys[0], &fp, owner, response(100), ttl).await.unwrap());
        // Twenty-one records against a budget of twenty: a batch went.
        let held = lock(&store.shared.shards[5]).entries.len();
        assert!(held <= 20, "{held} records held over a budget of 20");
        assert!(matches!(
            store.claim(&keys[0], &fp, Owner(9), lease, None).await.unwrap(),
            Claim::Completed { .. }
        ));
    }

    #[tokio::test]
    async fn sweeping_leaves_no_stale_queue_items_behind() {
        let store = MemoryStore::new(1 << 30);
        let fp = Fingerprint([0; 32]);
        for i in 0..2000u32 {
            let mut k = [0u8; 32];
            k[..4].copy_from_slice(&i.to_be_bytes());
            let key = RecordKey(k);
            let owner = Owner(i as u128);
            store
                .claim(&key, &fp, owner, Duration::from_secs(5), None)
                .await
                .unwrap();
            // A renewal and a refresh leave stale deadline items behind.
            store.renew(&key, owner, Duration::from_secs(5)).await.unwrap();
            // A third hold no answer: their TTLs are queued apart.
            let outcome = if i % 3 == 0 { Outcome::Unknown } else { response(10) };
            store
                .complete(&key, &fp, owner, outcome, Duration::from_millis(20))
                .await
                .unwrap();
            store
                .claim(
                    &key,
                    &fp,
                    Owner(0),
                    Duration::from_secs(5),
                    Some(Duration::from_millis(20)),
                )
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Only the lease items (5 s) are not due yet; they are stale.
        for shard in store.shared.shards.iter() {
            lock(shard).sweep(Instant::now() + Duration::from_secs(6), usize::MAX);
        }
        for shard in store.shared.shards.iter() {
            let shard = lock(shard);
            assert!(shard.entries.is_empty());
            assert!(shard.deadlines.leases.is_empty());
            assert!(shard.deadlines.ttls.is_empty());
            assert!(shard.deadlines.guards.is_empty());
            assert_eq!(shard.bytes, 0);
        }
    }

    #[tokio::test]
    async fn a_record_larger_than_the_budget_is_kept_not_evicted_as_it_is_stored() {
        let store = MemoryStore::new((SHARDS * 1000) as u64);
        let (key, owner) = (RecordKey([7; 32]), Owner(1));
        let fp = Fingerprint([0; 32]);
        store
            .claim(&key, &fp, owner, Duration::from_secs(5), None)
            .await
            .unwrap();
        store
            .complete(&key, &fp, owner, response(50_000), Duration::from_secs(60))
            .await
            .unwrap();
        assert!(matches!(
            store
                .claim(&key, &fp, Owner(2), Duration::from_secs(5), None)
                .await
                .unwrap(),
            Claim::Completed { .. }
        ));
    }

    #[tokio::test]
    async fn evicted_records_leave_no_queue_items_behind_for_long() {
        // A budget of a few records per shard, and a day-long TTL.
        let store = MemoryStore::new((SHARDS * 8 * 1100) as u64);
        let fp = Fingerprint([0; 32]);
        for i in 0..50_000u32 {
            let mut k = [0u8; 32];
            k[..4].copy_from_slice(&i.to_be_bytes());
            let (key, owner) = (RecordKey(k), Owner(i as u128));
            store
                .claim(&key, &fp, owner, Duration::from_secs(30), None)
                .await
                .unwrap();
            store
                .complete(&key, &fp, owner, response(10), Duration::from_secs(86_400))
                .await
                .unwrap();
        }
        for shard in store.shared.shards.iter() {
            lock(shard).sweep(Instant::now(), usize::MAX);
        }
        for shard in store.shared.shards.iter() {
            let shard = lock(shard);
            let bound = 2 * shard.entries.len() + 1024;
            assert!(shard.entries.len() <= 16, "{}", shard.entries.len());
            let Deadlines {
                leases, ttls, guards, ..
            } = &shard.deadlines;
            for (_, queue) in leases.iter().chain(ttls).chain(guards) {
                assert!(
                    queue.len() <= bound,
                    "{} queued for {} entries",
                    queue.len(),
                    shard.entries.len()
                );
            }
        }
    }
}
