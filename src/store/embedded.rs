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
//! An expired record is ignored at once and removed by the writer's sweep,
//! which walks the table a bounded batch at a time (a cursor that wraps
//! around), so no second index has to be written on every operation.

use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, Table, TableDefinition};
use tokio::sync::oneshot;

use super::codec::{self, Decoded};
use super::waiters::Waiters;
use super::{Claim, Fingerprint, Outcome, Owner, Record, RecordKey, Store, StoreError};

/// Record key -> deadline (ms since the epoch, big-endian) ++ encoded record.
const RECORDS: TableDefinition<&[u8; 32], &[u8]> = TableDefinition::new("records");

/// Most operations applied in one transaction.
const MAX_BATCH: usize = 1024;
/// How often the sweep runs, and how many records it looks at each time.
const SWEEP_EVERY: Duration = Duration::from_millis(500);
const SWEEP_BATCH: usize = 4096;

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
    Purge {
        key: RecordKey,
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

impl EmbeddedStore {
    /// Opens (or creates) the file at `path` and starts the writer thread.
    pub fn open(path: &Path) -> Result<EmbeddedStore, StoreError> {
        let db = Database::create(path).map_err(unavailable)?;
        {
            let txn = db.begin_write().map_err(unavailable)?;
            txn.open_table(RECORDS).map_err(unavailable)?;
            txn.commit().map_err(unavailable)?;
        }
        let db = Arc::new(db);
        let waiters = Arc::new(Waiters::default());
        let (ops, rx) = std_mpsc::channel();
        let writer = Writer {
            db: db.clone(),
            waiters: waiters.clone(),
            sweep_from: None,
        };
        std::thread::Builder::new()
            .name("idemgate-embedded-writer".into())
            .spawn(move || writer.run(rx))
            .map_err(unavailable)?;
        Ok(EmbeddedStore { db, ops, waiters })
    }

    /// How many records the file holds, expired ones not yet swept included.
    pub fn records(&self) -> Result<u64, StoreError> {
        let txn = self.db.begin_read().map_err(unavailable)?;
        let table = txn.open_table(RECORDS).map_err(unavailable)?;
        table.len().map_err(unavailable)
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

    async fn inspect(&self, key: &RecordKey) -> Result<Option<(Record, Duration)>, StoreError> {
        let now = now_ms();
        match self.read(key)? {
            Some(stored) if stored.deadline > now => Ok(Some((
                codec::decode(stored.record)?,
                Duration::from_millis(stored.deadline - now),
            ))),
            _ => Ok(None),
        }
    }

    async fn purge(&self, key: &RecordKey) -> Result<bool, StoreError> {
        let key = *key;
        self.send(|reply| Op::Purge { key, reply }).await
    }
}

/// The thread that owns every write.
struct Writer {
    db: Arc<Database>,
    waiters: Arc<Waiters>,
    /// Where the next sweep starts; `None`: at the beginning.
    sweep_from: Option<[u8; 32]>,
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
    fn run(mut self, ops: std_mpsc::Receiver<Op>) {
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
    fn apply(&mut self, batch: Vec<Op>, sweep: bool) {
        let mut pending = Vec::with_capacity(batch.len());
        let committed = (|| -> Result<(), StoreError> {
            let txn = self.db.begin_write().map_err(unavailable)?;
            {
                let mut records = txn.open_table(RECORDS).map_err(unavailable)?;
                let mut tables = Tables {
                    records: &mut records,
                    now: now_ms(),
                };
                for op in batch {
                    pending.push(tables.apply(op));
                }
                if sweep {
                    match tables.sweep(self.sweep_from) {
                        Ok(next) => self.sweep_from = next,
                        Err(error) => tracing::warn!(%error, "sweeping expired records failed"),
                    }
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
    now: u64,
}

impl Tables<'_, '_> {
    /// The live record under `key`; an expired one counts as absent.
    fn live(&self, key: &RecordKey) -> Result<Option<Stored>, StoreError> {
        let found = self.records.get(&key.0).map_err(unavailable)?;
        let stored = found.map(|v| split(v.value())).transpose()?;
        Ok(stored.filter(|s| s.deadline > self.now))
    }

    fn put(&mut self, key: &RecordKey, deadline: u64, record: &[u8]) -> Result<(), StoreError> {
        let mut value = Vec::with_capacity(8 + record.len());
        value.extend_from_slice(&deadline.to_be_bytes());
        value.extend_from_slice(record);
        self.records.insert(&key.0, value.as_slice()).map_err(unavailable)?;
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
                        self.put(&key, self.now.saturating_add(ttl), &record)?;
                        Ok(true)
                    }
                });
                Pending::Flag(reply, result, Some(key))
            }
            Op::Release { key, owner, reply } => {
                let result = self.owned(&key, owner).and_then(|held| match held {
                    None => Ok(false),
                    Some(_) => self.records.remove(&key.0).map(|_| true).map_err(unavailable),
                });
                Pending::Flag(reply, result, Some(key))
            }
            Op::Purge { key, reply } => {
                let result = self.live(&key).and_then(|found| {
                    self.records.remove(&key.0).map_err(unavailable)?;
                    Ok(found.is_some())
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
                        self.put(&key, self.now.saturating_add(lease), &record)?;
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
            return Ok(match codec::decode(stored.record.clone())? {
                Decoded::InFlight { fingerprint: found, .. } => Claim::InFlight { fingerprint: found },
                Decoded::Completed {
                    fingerprint: found,
                    outcome,
                } => {
                    if let Some(ttl) = refresh.filter(|_| found == *fingerprint) {
                        self.put(key, self.now.saturating_add(ttl), &stored.record)?;
                    }
                    Claim::Completed {
                        fingerprint: found,
                        outcome,
                    }
                }
            });
        }
        let record = codec::in_flight(fingerprint, owner);
        self.put(key, self.now.saturating_add(lease), &record)?;
        Ok(Claim::Claimed)
    }

    /// Looks at up to `SWEEP_BATCH` records from `from` on and removes the
    /// expired ones. Returns where the next sweep starts.
    fn sweep(&mut self, from: Option<[u8; 32]>) -> Result<Option<[u8; 32]>, StoreError> {
        let start = from.unwrap_or([0; 32]);
        let mut expired = Vec::new();
        let mut last = None;
        let mut seen = 0;
        for entry in self.records.range::<&[u8; 32]>(&start..).map_err(unavailable)? {
            let (key, value) = entry.map_err(unavailable)?;
            let key = *key.value();
            if split(value.value()).is_ok_and(|s| s.deadline <= self.now) {
                expired.push(key);
            }
            last = Some(key);
            seen += 1;
            if seen == SWEEP_BATCH {
                break;
            }
        }
        for key in &expired {
            self.records.remove(key).map_err(unavailable)?;
        }
        // A short batch reached the end of the table: start over next time.
        Ok(if seen == SWEEP_BATCH { last } else { None })
    }
}
