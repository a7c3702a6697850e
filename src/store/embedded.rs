//! The embedded store: one durable redb file.
//!
//! One writer thread owns every write. Requests send it their operation with
//! a reply channel; it takes everything queued, applies it in one write
//! transaction, commits once (an fsync), and only then answers the whole
//! batch (group commit). A claim is therefore durable before its request is
//! forwarded, and a completion before the last byte of its response leaves.
//!
//! Replays of completed records are read in a read transaction without
//! going through the writer. Leases and TTLs are wall-clock deadlines in
//! the record, so a claim of a crashed process runs out after a restart.
//! Expired records are swept by the writer, a bounded batch at a time,
//! through an index ordered by deadline.

use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use redb::{Database, ReadableDatabase, ReadableTable, Table, TableDefinition};
use tokio::sync::oneshot;

use super::codec::{self, Decoded};
use super::waiters::Waiters;
use super::{Claim, Fingerprint, Outcome, Owner, RecordKey, Store, StoreError};

/// Record key -> deadline (ms since the epoch, big-endian) ++ encoded record.
const RECORDS: TableDefinition<&[u8; 32], &[u8]> = TableDefinition::new("records");
/// Deadline ++ record key, for the sweeper.
const DEADLINES: TableDefinition<&[u8; 40], ()> = TableDefinition::new("deadlines");

/// Most operations applied in one transaction.
const MAX_BATCH: usize = 1024;
/// How often expired records are swept, and how many at most per sweep.
const SWEEP_EVERY: Duration = Duration::from_millis(500);
const SWEEP_BATCH: usize = 1000;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn unavailable(e: impl std::error::Error + Send + Sync + 'static) -> StoreError {
    StoreError::Unavailable(Box::new(e))
}

#[derive(Debug, thiserror::Error)]
#[error("the embedded store's writer has stopped")]
struct WriterGone;

enum Op {
    Claim {
        key: RecordKey,
        fingerprint: Fingerprint,
        owner: Owner,
        lease: u64,
        refresh: Option<u64>,
        reply: oneshot::Sender<Result<Claim, StoreError>>,
    },
    Complete {
        key: RecordKey,
        owner: Owner,
        outcome: Outcome,
        ttl: u64,
        reply: oneshot::Sender<Result<bool, StoreError>>,
    },
    Release {
        key: RecordKey,
        owner: Owner,
        reply: oneshot::Sender<Result<bool, StoreError>>,
    },
    Renew {
        key: RecordKey,
        owner: Owner,
        lease: u64,
        reply: oneshot::Sender<Result<bool, StoreError>>,
    },
}

pub struct EmbeddedStore {
    db: Arc<Database>,
    ops: std_mpsc::Sender<Op>,
    waiters: Arc<Waiters>,
}

/// A stored record with its deadline.
struct Stored {
    deadline: u64,
    record: Bytes,
}

fn split(value: &[u8]) -> Result<Stored, StoreError> {
    if value.len() < 8 {
        return Err(StoreError::Corrupt("record without deadline"));
    }
    Ok(Stored {
        deadline: u64::from_be_bytes(value[..8].try_into().expect("8 bytes")),
        record: Bytes::copy_from_slice(&value[8..]),
    })
}

fn deadline_key(deadline: u64, key: &RecordKey) -> [u8; 40] {
    let mut k = [0u8; 40];
    k[..8].copy_from_slice(&deadline.to_be_bytes());
    k[8..].copy_from_slice(&key.0);
    k
}

impl EmbeddedStore {
    /// Opens (or creates) the file at `path` and starts the writer thread.
    pub fn open(path: &Path) -> Result<EmbeddedStore, StoreError> {
        let db = Database::create(path).map_err(unavailable)?;
        {
            let txn = db.begin_write().map_err(unavailable)?;
            txn.open_table(RECORDS).map_err(unavailable)?;
            txn.open_table(DEADLINES).map_err(unavailable)?;
            txn.commit().map_err(unavailable)?;
        }
        let db = Arc::new(db);
        let waiters = Arc::new(Waiters::default());
        let (ops, rx) = std_mpsc::channel();
        let writer = Writer {
            db: db.clone(),
            waiters: waiters.clone(),
        };
        std::thread::Builder::new()
            .name("idemgate-embedded-writer".into())
            .spawn(move || writer.run(rx))
            .map_err(unavailable)?;
        Ok(EmbeddedStore { db, ops, waiters })
    }

    fn read(&self, key: &RecordKey) -> Result<Option<Stored>, StoreError> {
        let txn = self.db.begin_read().map_err(unavailable)?;
        let table = txn.open_table(RECORDS).map_err(unavailable)?;
        let found = table.get(&key.0).map_err(unavailable)?;
        found.map(|v| split(v.value())).transpose()
    }

    async fn send<T>(&self, op: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Op) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.ops.send(op(reply)).map_err(|_| unavailable(WriterGone))?;
        answer.await.map_err(|_| unavailable(WriterGone))?
    }
}

#[async_trait]
impl Store for EmbeddedStore {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        lease: Duration,
        refresh_ttl: Option<Duration>,
    ) -> Result<Claim, StoreError> {
        // A completed record changes only by expiring: answer replays (that
        // refresh nothing) from a read transaction, without the writer.
        if let Some(stored) = self.read(key)?
            && stored.deadline > now_ms()
            && let Decoded::Completed {
                fingerprint: found,
                outcome,
            } = codec::decode(stored.record)?
            && (refresh_ttl.is_none() || found != *fingerprint)
        {
            return Ok(Claim::Completed {
                fingerprint: found,
                outcome,
            });
        }
        let (key, fingerprint) = (*key, *fingerprint);
        self.send(|reply| Op::Claim {
            key,
            fingerprint,
            owner,
            lease: ms(lease),
            refresh: refresh_ttl.map(ms),
            reply,
        })
        .await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: Owner,
        outcome: Outcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let key = *key;
        self.send(|reply| Op::Complete {
            key,
            owner,
            outcome,
            ttl: ms(ttl),
            reply,
        })
        .await
    }

    async fn release(&self, key: &RecordKey, owner: Owner) -> Result<bool, StoreError> {
        let key = *key;
        self.send(|reply| Op::Release { key, owner, reply }).await
    }

    async fn renew(&self, key: &RecordKey, owner: Owner, lease: Duration) -> Result<bool, StoreError> {
        let key = *key;
        self.send(|reply| Op::Renew {
            key,
            owner,
            lease: ms(lease),
            reply,
        })
        .await
    }

    async fn wait(&self, key: &RecordKey, timeout: Duration) -> Result<(), StoreError> {
        let registration = self.waiters.register(*key);
        let notified = registration.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let Some(stored) = self.read(key)? else {
            return Ok(());
        };
        let now = now_ms();
        if stored.deadline <= now || stored.record.get(1) != Some(&codec::IN_FLIGHT) {
            return Ok(());
        }
        // The lease's end is a change nobody announces: wake for it too.
        let until = timeout.min(Duration::from_millis(stored.deadline - now));
        let _ = tokio::time::timeout(until, notified).await;
        Ok(())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.db.begin_read().map(drop).map_err(unavailable)
    }
}

/// The thread that owns every write.
struct Writer {
    db: Arc<Database>,
    waiters: Arc<Waiters>,
}

/// An answer held until the batch's commit succeeds.
enum Pending {
    Claim(oneshot::Sender<Result<Claim, StoreError>>, Result<Claim, StoreError>),
    Flag(
        oneshot::Sender<Result<bool, StoreError>>,
        Result<bool, StoreError>,
        Option<RecordKey>,
    ),
}

impl Writer {
    fn run(self, ops: std_mpsc::Receiver<Op>) {
        let mut last_sweep = std::time::Instant::now();
        loop {
            let mut batch = Vec::new();
            match ops.recv_timeout(SWEEP_EVERY) {
                Ok(op) => batch.push(op),
                Err(std_mpsc::RecvTimeoutError::Timeout) => {}
                Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
            }
            while batch.len() < MAX_BATCH {
                match ops.try_recv() {
                    Ok(op) => batch.push(op),
                    Err(_) => break,
                }
            }
            let sweep = last_sweep.elapsed() >= SWEEP_EVERY;
            if sweep {
                last_sweep = std::time::Instant::now();
            }
            if batch.is_empty() && !sweep {
                continue;
            }
            self.apply(batch, sweep);
        }
    }

    /// Applies a batch in one transaction and answers it after the commit.
    fn apply(&self, batch: Vec<Op>, sweep: bool) {
        let mut pending = Vec::with_capacity(batch.len());
        let committed = (|| -> Result<(), StoreError> {
            let txn = self.db.begin_write().map_err(unavailable)?;
            {
                let mut records = txn.open_table(RECORDS).map_err(unavailable)?;
                let mut deadlines = txn.open_table(DEADLINES).map_err(unavailable)?;
                let mut tables = Tables {
                    records: &mut records,
                    deadlines: &mut deadlines,
                    now: now_ms(),
                };
                for op in batch {
                    pending.push(tables.apply(op));
                }
                if sweep && let Err(error) = tables.sweep() {
                    tracing::warn!(%error, "sweeping expired records failed");
                }
            }
            txn.commit().map_err(unavailable)
        })();
        for answer in pending {
            match answer {
                Pending::Claim(reply, result) => {
                    let _ = reply.send(committed.as_ref().map_err(copy_error).and(result));
                }
                Pending::Flag(reply, result, wake) => {
                    if committed.is_ok()
                        && let Some(key) = wake
                    {
                        self.waiters.wake(&key);
                    }
                    let _ = reply.send(committed.as_ref().map_err(copy_error).and(result));
                }
            }
        }
        if let Err(error) = &committed {
            tracing::error!(%error, "embedded store commit failed");
        }
    }
}

fn copy_error(error: &StoreError) -> StoreError {
    StoreError::Unavailable(error.to_string().into())
}

struct Tables<'a, 't> {
    records: &'a mut Table<'t, &'static [u8; 32], &'static [u8]>,
    deadlines: &'a mut Table<'t, &'static [u8; 40], ()>,
    now: u64,
}

impl Tables<'_, '_> {
    /// The live record under `key`; an expired one counts as absent.
    fn live(&self, key: &RecordKey) -> Result<Option<Stored>, StoreError> {
        let found = self.records.get(&key.0).map_err(unavailable)?;
        let stored = found.map(|v| split(v.value())).transpose()?;
        Ok(stored.filter(|s| s.deadline > self.now))
    }

    fn put(
        &mut self,
        key: &RecordKey,
        old_deadline: Option<u64>,
        deadline: u64,
        record: &[u8],
    ) -> Result<(), StoreError> {
        if let Some(old) = old_deadline {
            self.deadlines.remove(&deadline_key(old, key)).map_err(unavailable)?;
        }
        let mut value = Vec::with_capacity(8 + record.len());
        value.extend_from_slice(&deadline.to_be_bytes());
        value.extend_from_slice(record);
        let previous = self.records.insert(&key.0, value.as_slice()).map_err(unavailable)?;
        // An expired record being replaced: drop its index entry too.
        if let Some(previous) = previous
            && old_deadline.is_none()
        {
            let previous = split(previous.value())?;
            drop(
                self.deadlines
                    .remove(&deadline_key(previous.deadline, key))
                    .map_err(unavailable)?,
            );
        }
        self.deadlines
            .insert(&deadline_key(deadline, key), ())
            .map_err(unavailable)?;
        Ok(())
    }

    fn remove(&mut self, key: &RecordKey, deadline: u64) -> Result<(), StoreError> {
        self.records.remove(&key.0).map_err(unavailable)?;
        self.deadlines
            .remove(&deadline_key(deadline, key))
            .map_err(unavailable)?;
        Ok(())
    }

    /// The live in-flight record of `key` if `owner` holds it.
    fn owned(&self, key: &RecordKey, owner: Owner) -> Result<Option<Stored>, StoreError> {
        Ok(self.live(key)?.filter(|s| {
            s.record.get(1) == Some(&codec::IN_FLIGHT)
                && s.record.get(codec::PREFIX..codec::PREFIX + 16) == Some(&codec::owner_bytes(owner)[..])
        }))
    }

    fn apply(&mut self, op: Op) -> Pending {
        match op {
            Op::Claim {
                key,
                fingerprint,
                owner,
                lease,
                refresh,
                reply,
            } => Pending::Claim(reply, self.claim(&key, &fingerprint, owner, lease, refresh)),
            Op::Complete {
                key,
                owner,
                outcome,
                ttl,
                reply,
            } => {
                let result = self.owned(&key, owner).and_then(|held| match held {
                    None => Ok(false),
                    Some(held) => {
                        let fingerprint = codec::fingerprint_of(&held.record)?;
                        let record = codec::completed(&fingerprint, &outcome);
                        self.put(&key, Some(held.deadline), self.now.saturating_add(ttl), &record)?;
                        Ok(true)
                    }
                });
                Pending::Flag(reply, result, Some(key))
            }
            Op::Release { key, owner, reply } => {
                let result = self.owned(&key, owner).and_then(|held| match held {
                    None => Ok(false),
                    Some(held) => self.remove(&key, held.deadline).map(|()| true),
                });
                Pending::Flag(reply, result, Some(key))
            }
            Op::Renew {
                key,
                owner,
                lease,
                reply,
            } => {
                let result = self.owned(&key, owner).and_then(|held| match held {
                    None => Ok(false),
                    Some(held) => {
                        let record = held.record.clone();
                        self.put(&key, Some(held.deadline), self.now.saturating_add(lease), &record)?;
                        Ok(true)
                    }
                });
                Pending::Flag(reply, result, None)
            }
        }
    }

    fn claim(
        &mut self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        lease: u64,
        refresh: Option<u64>,
    ) -> Result<Claim, StoreError> {
        if let Some(stored) = self.live(key)? {
            let deadline = stored.deadline;
            return Ok(match codec::decode(stored.record.clone())? {
                Decoded::InFlight { fingerprint: found, .. } => Claim::InFlight {
                    fingerprint: found,
                    lease_left: Duration::from_millis(deadline - self.now),
                },
                Decoded::Completed {
                    fingerprint: found,
                    outcome,
                } => {
                    if let Some(ttl) = refresh.filter(|_| found == *fingerprint) {
                        self.put(key, Some(deadline), self.now.saturating_add(ttl), &stored.record)?;
                    }
                    Claim::Completed {
                        fingerprint: found,
                        outcome,
                    }
                }
            });
        }
        let record = codec::in_flight(fingerprint, owner);
        self.put(key, None, self.now.saturating_add(lease), &record)?;
        Ok(Claim::Claimed)
    }

    /// Removes up to `SWEEP_BATCH` records whose deadline has passed.
    fn sweep(&mut self) -> Result<(), StoreError> {
        let bound = deadline_key(self.now, &RecordKey([0; 32]));
        let expired: Vec<[u8; 40]> = self
            .deadlines
            .range::<&[u8; 40]>(..&bound)
            .map_err(unavailable)?
            .take(SWEEP_BATCH)
            .map(|entry| entry.map(|(k, _)| *k.value()))
            .collect::<Result<_, _>>()
            .map_err(unavailable)?;
        for index in expired {
            self.deadlines.remove(&index).map_err(unavailable)?;
            let key: [u8; 32] = index[8..].try_into().expect("32 bytes");
            let deadline = u64::from_be_bytes(index[..8].try_into().expect("8 bytes"));
            // Remove the record only if it is still the one that expired.
            let current = self
                .records
                .get(&key)
                .map_err(unavailable)?
                .map(|v| split(v.value()))
                .transpose()?;
            if current.is_some_and(|s| s.deadline == deadline) {
                self.records.remove(&key).map_err(unavailable)?;
            }
        }
        Ok(())
    }
}
