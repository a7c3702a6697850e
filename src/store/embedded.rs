//! The embedded store: a redb file with a write-ahead log beside it.
//!
//! One writer thread owns every write. Requests send it their operation with
//! a reply channel, on a bounded queue (one past [`QUEUE_OPS`] is refused
//! at once, unsent); it takes everything queued, decides each operation,
//! appends the resulting records to the write-ahead log, syncs the log once
//! (`fdatasync`), and only then publishes the batch and answers it (group
//! commit). A claim is therefore durable before its request is forwarded,
//! and a completion before the last byte of its response leaves.
//!
//! Records the log holds but the database does not yet are kept in memory
//! (the overlay) and read from there first. Every five seconds, or sooner
//! when the overlay grows, the writer starts a new log segment and hands the
//! overlay to the checkpoint thread, which writes it into the redb file in
//! one durable transaction, in key order (recording that the segments below
//! the new one are in the file), and then retires the segments it covered.
//! So a request costs an append to the log, and redb sees each record once,
//! in transactions of tens of thousands: random keys touch most of a large
//! file's leaf pages in any checkpoint, so fewer, larger checkpoints rewrite
//! each page less often. On open, segments a crash left unapplied are
//! applied to the file before anything else happens.
//!
//! A [`KeyFilter`] in memory knows which keys the file holds, so a claim of
//! a new key, found in neither the overlay nor the filter, does not read
//! the file.
//!
//! Log segments are named `<path>-wal.<n>` (see [`Wal`]); each entry
//! carries its length and a CRC-32, and a torn entry at the end of a
//! segment (a crash in the middle of an append) is ignored: it was never
//! acknowledged. A segment the log moves on from is sealed with a last
//! entry naming the next. A segment records may be in that is missing (by
//! the file's record of what was made, a gap, or a seal) is refused at
//! open; an entry damaged in its checksum or length is read whole, and
//! one damaged in its body ends replay of its segment, which is kept aside
//! (see [`Wal::damage_at`]). Spares an earlier run left are removed at open.
//!
//! A failed write, of the log or of a checkpoint into the file, stops the
//! store taking writes (fail-stop, as databases do): after it the kernel
//! may have dropped the data, and redb refuses its file until it is opened
//! again. Every acknowledged record is in the log, so a restart recovers
//! them all; meanwhile [`Store::ping`] fails, so `/readyz` says so. A log
//! that cannot move to a new segment (nothing is checkpointed then) stops
//! the store taking new claims once it is half the overlay's limit past
//! its segment, and writes once it reaches the limit.
//!
//! Replays of completed records are read from the overlay or a read
//! transaction without going through the writer (but for one that
//! restarts a TTL not restarted lately, see [`refreshed_lately`]); a read
//! of the file runs
//! on tokio's blocking pool (at most [`FILE_READS`] at once), so a slow
//! disk stalls no runtime worker. Leases and TTLs are wall-clock deadlines
//! in the record, so a claim of a crashed process runs
//! out after a restart; within a run they are read against the wall clock
//! at start moved on by the monotonic clock (see [`Clock`]), so a step of
//! the system clock does not cut a lease short, and written from the wall
//! clock where it has stepped ahead, so a restart does not find them
//! ended early. An expired record is
//! ignored at once and removed by the checkpoint thread's sweep, which
//! walks the table a batch at a time (a cursor that wraps around), so no
//! second index is kept.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use tokio::sync::oneshot;

use super::codec::{self, Decoded};
use super::filter::KeyFilter;
use super::waiters::Waiters;
use super::{Claim, Fingerprint, KeyMap, Outcome, Owner, Record, RecordKey, Store, StoreError, lock};

/// Record key -> deadline (ms since the epoch, big-endian) ++ [`CHECKED`]
/// ++ the CRC-32 of the deadline and the record (big-endian) ++ encoded
/// record; or, as files
/// written before records were checked hold them, and as the log holds
/// them (its entries have checksums of their own), the deadline ++ the
/// record.
const RECORDS: TableDefinition<&[u8; 32], &[u8]> = TableDefinition::new("records");
/// Where a record's version byte would be, marks a value whose record is
/// checked (see [`RECORDS`]). No record version is this: an idemgate from
/// before reads such a value as a record of an unknown version, refused
/// (503) rather than misread, until its deadline passes.
const CHECKED: u8 = 0xC5;
const _: () = assert!(CHECKED != codec::VERSION);
/// `applied_below`: every log segment numbered below it is in the file.
/// Segment numbers only grow, across restarts too, so a recycled spare's
/// old entries never carry a number in use again.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const APPLIED_BELOW: &str = "applied_below";
/// The log's format: absent in files whose logs were written before log
/// entries were chained (see [`Wal::crc`]), then [`CHAINED`].
const LOG_FORMAT: &str = "log_format";
const CHAINED: u64 = 2;
/// `made`: the number of a segment known to have been made, set when the
/// store opens (once its new segment is made) and at each checkpoint
/// (the segment its `applied_below` names, which the writer made). When it
/// is `applied_below`, that segment must be there: one missing was lost
/// (deleted, or a backup of the file restored without the log), and with
/// it the records it held. Absent in files from before it was kept.
const MADE: &str = "made";
/// Set once a store that seals each segment it moves on from (see
/// [`SEALED`]) has opened the file: the segments it wrote end in seals.
const SEALING: &str = "sealing";

/// Most reads of the file running at once.
const FILE_READS: usize = 64;
/// Most operations decided and synced together.
const MAX_BATCH: usize = 1024;
/// Most operations queued for the writer. Past it (the disk has stalled),
/// an operation is refused at once, unsent, rather than queued behind
/// thousands whose callers gave up at their deadline; a full batch is far
/// below it. (Tests fill a smaller queue.)
const QUEUE_OPS: usize = if cfg!(test) { 256 } else { 16 * MAX_BATCH };
/// The overlay is checkpointed this often, or when it holds this much.
/// (Unit tests checkpoint often, to see records go through the file.)
const CHECKPOINT_EVERY: Duration = if cfg!(test) {
    Duration::from_millis(200)
} else {
    Duration::from_secs(5)
};
const CHECKPOINT_BYTES: usize = 64 << 20;
/// While a checkpoint runs, the writer goes on until the overlay holds this
/// much, then waits for the checkpoint: memory stays bounded. (Tests reach
/// a smaller limit.)
const OVERLAY_LIMIT: usize = if cfg!(test) { 4 << 20 } else { 4 * CHECKPOINT_BYTES };
/// redb's page cache (its default is 1 GiB). Pages it drops are read back
/// from the operating system's cache; recent records are in the overlay.
const CACHE_BYTES: usize = 64 << 20;
/// How often the sweep runs, and how many records it looks at each time,
/// at least (see [`Checkpointer::write`]).
const SWEEP_EVERY: Duration = Duration::from_millis(500);
const SWEEP_BATCH: usize = 4096;

/// The store's clock, in milliseconds since the Unix epoch: the wall clock
/// as it read when the store opened, moved on by the monotonic clock since.
/// Deadlines in the file are wall-clock times, so leases and TTLs run on
/// across a restart; within a run, a step of the system clock (NTP, a
/// virtual machine resumed) can neither cut a working owner's lease short,
/// which would let a second claim reach the upstream, nor keep a record
/// past its TTL. A deadline is written from the wall clock, though, where
/// that has stepped ahead ([`Clock::stamp`]).
struct Clock {
    origin: Instant,
    anchor: u64,
    /// The wall clock (another in tests, to be stepped).
    wall: fn() -> u64,
}

impl Clock {
    fn new(wall: fn() -> u64) -> Clock {
        Clock {
            origin: Instant::now(),
            anchor: wall(),
            wall,
        }
    }

    /// Now, to compare deadlines with.
    fn now(&self) -> u64 {
        anchored(self.origin, self.anchor, Instant::now())
    }

    /// What a deadline written at `now` (a reading of [`Clock::now`]) runs
    /// from: the wall clock where it has stepped more than [`STEP`] ahead
    /// of this clock (NTP setting right a clock that was slow at boot, a
    /// suspend, which the monotonic clock does not count), else `now`. A
    /// restart reads the file by the wall clock; deadlines written by a
    /// clock that fell behind would end early then, and an answer's retry
    /// would run again. Within the run they only last longer.
    fn stamp(&self, now: u64) -> u64 {
        let wall = (self.wall)();
        if wall > now.saturating_add(STEP) { wall } else { now }
    }
}

/// How far the wall clock may run ahead of the store's before deadlines
/// are written from it: the two clocks' readings differ by a millisecond
/// or so anyway, and a record would then read as lasting longer than its
/// TTL.
const STEP: u64 = 1_000;

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `wall` (read at `origin`) moved on to `now` by the monotonic clock.
fn anchored(origin: Instant, wall: u64, now: Instant) -> u64 {
    wall.saturating_add(ms(now.saturating_duration_since(origin)))
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
        /// The claimant found no record, neither in the overlay nor in the
        /// file, when the overlay was at this generation.
        absent_at: Option<u64>,
        reply: oneshot::Sender<Result<Claim, StoreError>>,
    },
    Complete {
        key: RecordKey,
        /// The claim's, for a record written where none is left.
        fingerprint: Fingerprint,
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
    /// Answered with the batch it falls in: the writer is alive and
    /// getting through its work.
    Ping {
        reply: oneshot::Sender<Result<bool, StoreError>>,
    },
}

impl Op {
    /// About how many bytes the operation adds to the log.
    fn log_bytes(&self) -> usize {
        match self {
            Op::Complete {
                outcome: Outcome::Response(response),
                ..
            } => 128 + response.size(),
            Op::Ping { .. } => 0,
            _ => 128,
        }
    }
}

/// Records by key; `None` is a removal not yet in the file.
type Changes = KeyMap<[u8; 32], Option<Stored>>;

/// Records the log holds and the file may not: `active` is being written,
/// `frozen` is being checkpointed. Newer wins: active, then frozen, then
/// the file. Claims still held when their checkpoint lands are carried
/// into `active` too: settling one never reads the file, which redb
/// refuses to read after a failed write (see [`Shared::drain`]).
#[derive(Default)]
struct Overlay {
    active: Changes,
    active_bytes: usize,
    frozen: Arc<Changes>,
    /// How many checkpoints have landed. While it stays the same, every
    /// change made since a lookup is still in the overlay.
    generation: u64,
}

/// What a lookup found, and from which generation of the overlay.
struct Found {
    stored: Option<Stored>,
    generation: u64,
}

/// What the request side, the writer and the checkpoint thread share.
struct Shared {
    db: Database,
    overlay: Mutex<Overlay>,
    /// Signalled when a checkpoint finishes.
    checkpointed: Condvar,
    /// Set when a write of the log failed: the store takes no more writes
    /// (see [`Shared::fail`]).
    failed: OnceLock<String>,
    /// Set when a write of the file failed: no checkpoint can land, so the
    /// store takes no new claims, but the claims it holds still settle
    /// (completed, released, renewed) into the log, which a restart
    /// replays (see [`Shared::drain`]).
    draining: OnceLock<String>,
    /// The keys in the file.
    filter: KeyFilter,
    /// Reads of the file on the blocking pool at once (see
    /// [`Shared::fetch`]): on a disk that hangs, this many threads wait on
    /// it, and further reads wait here, within the store's deadline.
    reads: Arc<tokio::sync::Semaphore>,
    clock: Clock,
}

impl Shared {
    /// Stops the store taking writes, for `failure`; the first failure is
    /// the one kept.
    fn fail(&self, failure: String) {
        self.stop(&self.failed, failure);
    }

    /// Stops the store taking new claims, for `failure`, while the claims
    /// it holds settle into the log: a client given its answer while the
    /// file could not be written gets the replay after a restart, rather
    /// than a second run once the claim's lease has run out.
    fn drain(&self, failure: String) {
        self.stop(&self.draining, failure);
    }

    fn stop(&self, level: &OnceLock<String>, failure: String) {
        let first = {
            // Under the overlay's lock: a writer waiting for a checkpoint
            // looks at `failed` and `draining` under it before it waits,
            // so this wakes it.
            let _overlay = lock(&self.overlay);
            level.set(failure.clone()).is_ok()
        };
        if first {
            tracing::error!("{failure}");
            self.checkpointed.notify_all();
        }
    }

    /// Why the store is not ready: it failed, or is draining.
    fn refusal(&self) -> Option<&String> {
        self.failed.get().or_else(|| self.draining.get())
    }

    /// Adds every key of the file, as `snapshot` (taken before the first
    /// checkpoint or sweep) holds them, to the filter, then lets it answer;
    /// until then every lookup reads the file. Runs beside the checkpoints:
    /// a key they add or remove meanwhile can only be counted once too
    /// often (the snapshot still had it), never once too few, so the
    /// filter errs towards reading the file. (A snapshot taken after a
    /// removal had committed would miss that key while its removal still
    /// counted it out: another key of the same prefix would then read as
    /// absent.)
    fn load_filter(&self, snapshot: Result<redb::ReadTransaction, StoreError>) {
        let started = Instant::now();
        let scan = || -> Result<u64, StoreError> {
            let txn = snapshot?;
            let table = txn.open_table(RECORDS).map_err(unavailable)?;
            let mut keys = 0;
            for entry in table.iter().map_err(unavailable)? {
                let (key, _) = entry.map_err(unavailable)?;
                self.filter.add(key.value());
                keys += 1;
            }
            Ok(keys)
        };
        match scan() {
            Ok(keys) => {
                self.filter.loaded();
                tracing::info!(keys, elapsed = ?started.elapsed(), "embedded store: key filter loaded");
            }
            // Keys a failed scan added stay counted: only ever too many.
            Err(error) => {
                tracing::warn!(%error, "reading the keys of the embedded store failed; every claim reads the file")
            }
        }
    }

    /// The record under `key`, newest first, expired or not, for a
    /// request: a read of the file runs on tokio's blocking pool, so a
    /// slow disk holds neither a runtime worker nor the store's deadline,
    /// which fires all the same.
    async fn fetch(self: &Arc<Self>, key: &RecordKey) -> Result<Found, StoreError> {
        match self.peek(key, None) {
            Ok(found) => Ok(found),
            Err(generation) => {
                let permit = self.reads.clone().acquire_owned().await.map_err(unavailable)?;
                let (shared, key) = (self.clone(), *key);
                tokio::task::spawn_blocking(move || {
                    let _permit = permit;
                    shared.read(&key, generation)
                })
                .await
                .map_err(unavailable)?
            }
        }
    }

    /// The record under `key`, on this thread (the writer's). With
    /// `absent_at`, a record that is not in the overlay is known to be
    /// absent from the file as long as no checkpoint landed since that
    /// generation, and the file is not read.
    fn find(&self, key: &RecordKey, absent_at: Option<u64>) -> Result<Found, StoreError> {
        match self.peek(key, absent_at) {
            Ok(found) => Ok(found),
            Err(generation) => self.read(key, generation),
        }
    }

    /// The record under `key` as memory knows it: from the overlay, or
    /// absent by `absent_at` or the key filter. Otherwise the overlay's
    /// generation, for [`Shared::read`].
    fn peek(&self, key: &RecordKey, absent_at: Option<u64>) -> Result<Found, u64> {
        let generation = {
            let overlay = lock(&self.overlay);
            if let Some(change) = overlay.active.get(&key.0).or_else(|| overlay.frozen.get(&key.0)) {
                return Ok(Found {
                    stored: change.clone(),
                    generation: overlay.generation,
                });
            }
            if absent_at == Some(overlay.generation) {
                return Ok(Found {
                    stored: None,
                    generation: overlay.generation,
                });
            }
            overlay.generation
        };
        // Checked after the overlay: a checkpoint adds a key to the filter
        // before the overlay lets go of it.
        if !self.filter.may_hold(&key.0) {
            return Ok(Found {
                stored: None,
                generation,
            });
        }
        Err(generation)
    }

    /// The record under `key` in the file, after the overlay (at
    /// `generation`) missed it.
    fn read(&self, key: &RecordKey, generation: u64) -> Result<Found, StoreError> {
        // Opened after the overlay missed: a checkpoint that emptied the
        // overlay meanwhile has committed, and this transaction sees it.
        let txn = self.db.begin_read().map_err(unavailable)?;
        let table = txn.open_table(RECORDS).map_err(unavailable)?;
        let found = table.get(&key.0).map_err(unavailable)?;
        // A damaged record is refused whatever its deadline says, which
        // its checksum covers: a deadline damaged into the past would let
        // a retry run again.
        let stored = found.map(|v| split(v.value())).transpose()?;
        Ok(Found { stored, generation })
    }
}

pub struct EmbeddedStore {
    shared: Arc<Shared>,
    ops: std_mpsc::SyncSender<Op>,
    waiters: Arc<Waiters>,
}

/// A stored record with its deadline. In the log a value is the deadline
/// (8 bytes, big-endian) followed by the record, in the file the same with
/// a checksum of both between them (see [`RECORDS`]); the overlay
/// keeps the two apart, so a record is shared, never copied, to renew or
/// refresh it.
#[derive(Clone)]
struct Stored {
    deadline: u64,
    record: Bytes,
}

/// The deadline at the head of a stored value.
fn deadline_of(value: &[u8]) -> Result<u64, StoreError> {
    let head = value.get(..8).ok_or(StoreError::Corrupt("record without deadline"))?;
    Ok(u64::from_be_bytes(head.try_into().expect("8 bytes")))
}

/// A value read from the file (or the log): its deadline and its record,
/// checked against its checksum when it has one. redb checks its pages
/// only when it repairs a file, so a byte that changed on the disk under a
/// record would otherwise be read, and replayed, as written.
fn parts(value: &[u8]) -> Result<(u64, &[u8]), StoreError> {
    let deadline = deadline_of(value)?;
    let Some((&CHECKED, rest)) = value[8..].split_first() else {
        return Ok((deadline, &value[8..]));
    };
    let (sum, record) = rest
        .split_first_chunk::<4>()
        .ok_or(StoreError::Corrupt("record without its checksum"))?;
    if checksum(deadline, record) != u32::from_be_bytes(*sum) {
        return Err(StoreError::Corrupt(
            "a record in the embedded store's file is damaged: its checksum does not match",
        ));
    }
    Ok((deadline, record))
}

/// [`parts`], its record copied out of the page.
fn split(value: &[u8]) -> Result<Stored, StoreError> {
    let (deadline, record) = parts(value)?;
    Ok(Stored {
        deadline,
        record: Bytes::copy_from_slice(record),
    })
}

/// The file's value for `record` with its `deadline`, written into `buf`:
/// the deadline, [`CHECKED`] and the CRC-32 of the deadline and the
/// record, then the record.
fn value_into<'b>(buf: &'b mut Vec<u8>, deadline: u64, record: &[u8]) -> &'b [u8] {
    buf.clear();
    buf.extend_from_slice(&deadline.to_be_bytes());
    buf.push(CHECKED);
    buf.extend_from_slice(&checksum(deadline, record).to_be_bytes());
    buf.extend_from_slice(record);
    buf
}

/// The CRC-32 a checked value carries: of its deadline (a changed one
/// would end a record early, and let a retry run again, or keep it past
/// its TTL) and its record.
fn checksum(deadline: u64, record: &[u8]) -> u32 {
    let mut crc = crc32fast::Hasher::new();
    crc.update(&deadline.to_be_bytes());
    crc.update(record);
    crc.finalize()
}

impl EmbeddedStore {
    /// Opens (or creates) the file at `path`, applies the log a crash left
    /// behind, and starts the writer and checkpoint threads.
    pub fn open(path: &Path) -> Result<EmbeddedStore, StoreError> {
        EmbeddedStore::open_with(path, Clock::new(wall_ms))
    }

    fn open_with(path: &Path, clock: Clock) -> Result<EmbeddedStore, StoreError> {
        // A file that is not there, or is empty, is made anew. Beside the
        // log segments of an earlier store it was lost (a restore gone
        // wrong, a truncation), and a new one would forget every record
        // the segments do not hold: retries of those would run again.
        let fresh = match fs::metadata(path) {
            Ok(metadata) => metadata.len() == 0,
            Err(error) => error.kind() == std::io::ErrorKind::NotFound,
        };
        if fresh && !Wal::segments(path).map_err(unavailable)?.is_empty() {
            let failure = format!(
                "{} is missing or empty, but the log segments of an earlier store are beside it \
                 ({}.*): restore the file with them, or remove them to start afresh",
                path.display(),
                Wal::named(path, "-wal").display()
            );
            return Err(StoreError::Unavailable(failure.into()));
        }
        let db = Database::builder()
            .set_cache_size(CACHE_BYTES)
            .create(path)
            .map_err(unavailable)?;
        // redb holds the file locked: no other process makes these now.
        Wal::remove_temporaries(path);
        let segments = Wal::segments(path).map_err(unavailable)?;
        let mut damaged_segments = Vec::new();
        let next = {
            let txn = db.begin_write().map_err(unavailable)?;
            let next;
            {
                let mut meta = txn.open_table(META).map_err(unavailable)?;
                let applied_below = meta.get(APPLIED_BELOW).map_err(unavailable)?.map_or(0, |v| v.value());
                let chained = meta.get(LOG_FORMAT).map_err(unavailable)?.map(|v| v.value()) == Some(CHAINED);
                let made = meta.get(MADE).map_err(unavailable)?.map(|v| v.value());
                // Written by a store that seals each segment it moves on from.
                let sealing = meta.get(SEALING).map_err(unavailable)?.is_some();
                Wal::none_missing(path, &segments, applied_below, made)
                    .map_err(|failure| StoreError::Unavailable(failure.into()))?;
                next = segments.last().map_or(1, |(n, _)| n + 1).max(applied_below);
                meta.insert(APPLIED_BELOW, next).map_err(unavailable)?;
                // The segments written from here on; those replayed now are
                // never read again.
                meta.insert(LOG_FORMAT, CHAINED).map_err(unavailable)?;
                meta.insert(SEALING, 1).map_err(unavailable)?;
                let mut table = txn.open_table(RECORDS).map_err(unavailable)?;
                // A replayed entry's value, as the file keeps it.
                let mut checked = Vec::new();
                // The segment before this one, when its entries ended
                // without its seal.
                let mut unsealed = None;
                // Segments below `applied_below` are in the file already
                // (a crash came between a checkpoint and their removal).
                for (n, segment) in segments.iter().filter(|(n, _)| *n >= applied_below) {
                    let bytes = fs::read(segment).map_err(unavailable)?;
                    // Made whole, zero-filled (when written chained): a
                    // shorter one was cut from outside, and what it held
                    // past its end is lost.
                    if bytes.is_empty() {
                        // Made so by hand, as a refusal of a missing one
                        // says, to go on without it.
                        tracing::warn!(segment = %segment.display(), "the embedded store's log segment is empty: replayed as no entries");
                    } else if chained && (bytes.len() as u64) < SEGMENT_BYTES {
                        tracing::error!(
                            segment = %segment.display(),
                            bytes = bytes.len(),
                            "the embedded store's log segment is shorter than it was made (truncated): entries past its end are lost"
                        );
                    }
                    let (entries, damaged, sealed) = Wal::replayable(&bytes, *n, chained);
                    // The log moved on from the segment before, which this
                    // one's entries say, and its seal was not read: its
                    // last entries were lost to damage (two fields of one
                    // entry, or the last entries), with no word of it from
                    // the entries themselves. (A segment made as a crash
                    // came, before the seal was written, holds nothing.)
                    // (Segments to replay follow each other: a gap was
                    // refused above.)
                    if let Some(before) = unsealed.take()
                        && !(entries.is_empty() && damaged.is_empty())
                    {
                        tracing::error!(
                            segment = %Wal::segment_path(path, before).display(),
                            "the embedded store's log is damaged: this segment's last entries, and its seal, \
                             cannot be read (its entries past the last one replayed are lost)"
                        );
                        damaged_segments.push(before);
                    }
                    if sealing && sealed.is_none() && damaged.iter().all(|&(_, repaired)| repaired) {
                        unsealed = Some(*n);
                    }
                    // Sealed for a segment not there: the newest, made
                    // since the last checkpoint, and lost with what it held.
                    if let Some(sealed) = sealed
                        && segments.binary_search_by_key(&sealed, |(n, _)| *n).is_err()
                    {
                        let failure = Wal::missing(path, sealed, sealed, true);
                        return Err(StoreError::Unavailable(failure.into()));
                    }
                    for (key, change) in entries {
                        match change {
                            // One too short to split (never written so)
                            // goes in as it is, refused when read.
                            Some(value) => match parts(value) {
                                Ok((deadline, record)) => table.insert(key, value_into(&mut checked, deadline, record)),
                                Err(_) => table.insert(key, value),
                            },
                            None => table.remove(key),
                        }
                        .map_err(unavailable)?;
                    }
                    for &(offset, repaired) in &damaged {
                        if repaired {
                            tracing::warn!(
                                segment = %segment.display(),
                                offset,
                                "the embedded store's log is damaged: the entry at this offset, damaged in its checksum or length, is read whole (the entry after it vouches for it)"
                            );
                        } else {
                            tracing::error!(
                                segment = %segment.display(),
                                offset,
                                "the embedded store's log is damaged (or an append was cut short by a power loss): the entries from this offset in this segment are not replayed"
                            );
                            damaged_segments.push(*n);
                        }
                    }
                }
            }
            txn.commit().map_err(unavailable)?;
            next
        };
        // A segment whose entries stop at damage is kept aside, as it is,
        // to be looked into (it would be a spare, overwritten, and its
        // entries past the damage may be read by hand); under a name no
        // earlier one has (a restored file repeats numbers).
        for n in &damaged_segments {
            let segment = Wal::segment_path(path, *n);
            let suffixes = std::iter::once(".damaged".to_owned()).chain((2..).map(|k| format!(".damaged.{k}")));
            let aside = suffixes
                .map(|suffix| Wal::named(&segment, &suffix))
                .find(|aside| !aside.exists())
                .expect("a free name");
            fs::rename(&segment, &aside).map_err(unavailable)?;
            tracing::error!(segment = %aside.display(), "the damaged log segment is kept aside");
        }
        let retired = segments
            .iter()
            .map(|(n, _)| *n)
            .filter(|n| !damaged_segments.contains(n));
        // Spares an earlier run left are not reused: after a restore of the
        // file, or a store begun afresh beside them, one may have held a
        // number this run will use again, and a first entry this run
        // writes the same as that life's (a release of the same key) would
        // chain on into its old entries, replayed as this run's. Those
        // retired from here on hold numbers below any this run will use.
        Wal::discard_spares(path).map_err(unavailable)?;
        // The old segments are in the file (below `applied_below`): they
        // become spares first, so the new segment is one of them, and a
        // full disk needs no room for it.
        Wal::retire(path, retired).map_err(unavailable)?;
        let wal = Wal::create(path, next).map_err(unavailable)?;
        {
            let txn = db.begin_write().map_err(unavailable)?;
            txn.open_table(META)
                .map_err(unavailable)?
                .insert(MADE, next)
                .map_err(unavailable)?;
            txn.commit().map_err(unavailable)?;
        }
        Wal::top_up(path);

        let shared = Arc::new(Shared {
            db,
            overlay: Mutex::new(Overlay::default()),
            checkpointed: Condvar::new(),
            failed: OnceLock::new(),
            draining: OnceLock::new(),
            filter: KeyFilter::default(),
            reads: Arc::new(tokio::sync::Semaphore::new(FILE_READS)),
            clock,
        });
        let waiters = Arc::new(Waiters::default());
        let (ops, rx) = std_mpsc::sync_channel(QUEUE_OPS);
        let (checkpoints, checkpoint_rx) = std_mpsc::channel();
        let writer = Writer {
            shared: shared.clone(),
            waiters: waiters.clone(),
            wal,
            checkpoints,
            last_checkpoint: Instant::now(),
            segment_backoff: None,
        };
        let checkpointer = Checkpointer {
            shared: shared.clone(),
            path: path.to_owned(),
            sweep_from: None,
            written_since_sweep: 0,
        };
        let loading = shared.clone();
        let snapshot = shared.db.begin_read().map_err(unavailable);
        std::thread::Builder::new()
            .name("embedded-filter".into())
            .spawn(move || loading.load_filter(snapshot))
            .map_err(unavailable)?;
        std::thread::Builder::new()
            .name("embedded-ckpt".into())
            .spawn(move || checkpointer.run(checkpoint_rx))
            .map_err(unavailable)?;
        std::thread::Builder::new()
            .name("embedded-writer".into())
            .spawn(move || writer.run(rx))
            .map_err(unavailable)?;
        Ok(EmbeddedStore { shared, ops, waiters })
    }

    /// How many records the store holds, expired ones not yet swept
    /// included.
    pub fn records(&self) -> Result<u64, StoreError> {
        let overlay = lock(&self.shared.overlay);
        let txn = self.shared.db.begin_read().map_err(unavailable)?;
        let table = txn.open_table(RECORDS).map_err(unavailable)?;
        let mut count = table.len().map_err(unavailable)?;
        let mut newest = overlay.frozen.as_ref().clone();
        newest.extend(overlay.active.iter().map(|(k, v)| (*k, v.clone())));
        for (key, change) in &newest {
            let in_file = table.get(key).map_err(unavailable)?.is_some();
            match (change.is_some(), in_file) {
                (true, false) => count += 1,
                (false, true) => count -= 1,
                _ => {}
            }
        }
        Ok(count)
    }

    async fn send<T>(&self, op: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Op) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.ops.try_send(op(reply)).map_err(|error| match error {
            std_mpsc::TrySendError::Full(_) => StoreError::NotSent("the embedded store's writer is behind".into()),
            std_mpsc::TrySendError::Disconnected(_) => unavailable(WriterGone),
        })?;
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
        // refresh nothing, or were refreshed lately) and other outcomes
        // (never refreshed) from what is published, without the writer.
        let found = self.shared.fetch(key).await?;
        let absent_at = found.stored.is_none().then_some(found.generation);
        let now = self.shared.clock.now();
        if let Some(stored) = found.stored
            && stored.deadline > now
            && let Decoded::Completed {
                fingerprint: found,
                outcome,
            } = codec::decode(stored.record)?
            && (found != *fingerprint
                || !outcome.is_response()
                || refresh_ttl.is_none_or(|ttl| refreshed_lately(stored.deadline, now, ms(ttl))))
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
            absent_at,
            reply,
        })
        .await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        outcome: Outcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let (key, fingerprint) = (*key, *fingerprint);
        self.send(|reply| Op::Complete {
            key,
            fingerprint,
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
        let Some(stored) = self.shared.fetch(key).await?.stored else {
            return Ok(());
        };
        let now = self.shared.clock.now();
        if stored.deadline <= now || stored.record.get(1) != Some(&codec::IN_FLIGHT) {
            return Ok(());
        }
        // The lease's end is a change nobody announces: wake for it too.
        let until = timeout.min(Duration::from_millis(stored.deadline - now));
        let _ = tokio::time::timeout(until, notified).await;
        Ok(())
    }

    fn stopped(&self) -> bool {
        self.shared.failed.get().is_some()
    }

    async fn ping(&self) -> Result<(), StoreError> {
        if let Some(failure) = self.shared.refusal() {
            return Err(StoreError::Unavailable(failure.clone().into()));
        }
        self.shared.db.begin_read().map(drop).map_err(unavailable)?;
        // Through the writer too: one that died or is stuck answers no
        // claim, so the store is not ready; the caller's deadline bounds
        // the wait.
        self.send(|reply| Op::Ping { reply }).await.map(drop)
    }

    async fn inspect(&self, key: &RecordKey) -> Result<Option<(Record, Duration)>, StoreError> {
        let now = self.shared.clock.now();
        match self.shared.fetch(key).await?.stored {
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

/// The write-ahead log: numbered segment files beside the database, each
/// entry `len: u32, crc32: u32, key: [u8; 32], kind: u8, value`.
///
/// Segments are zero-filled to `SEGMENT_BYTES` before use, so an append
/// overwrites allocated blocks and its `fdatasync` flushes data alone, with
/// no file-size change to journal (here about 40% less CPU and latency per
/// sync than appending). Checkpointed segments are recycled as spares,
/// which still hold old entries: the CRC covers the segment's number too,
/// so an entry left from an earlier use ends the segment like a torn one.
struct Wal {
    path: PathBuf,
    segment: u64,
    file: File,
    offset: u64,
    /// The checksum of the last entry written, which the next one's covers.
    link: u32,
}

const PUT: u8 = 1;
const REMOVE: u8 = 0;
/// A segment's last entry once the log has moved on to the next: its value
/// is the next segment's number (and its key all zeros). The newest
/// segment is recorded as made in the file only at the next checkpoint;
/// until then, this is what tells a restart that it was made, so one
/// missing is refused rather than opened over.
const SEALED: u8 = 2;
/// A segment's zero-filled size; a batch that starts within the headroom
/// of the end goes to the next segment. Batches are cut at about the
/// headroom's size, so only a single answer larger than it (up to
/// `max_response_body`) makes a segment outgrow its zero-filled size.
const SEGMENT_BYTES: u64 = 16 << 20;
const SEGMENT_HEADROOM: u64 = 2 << 20;
/// Spare segments kept ready (about 8 ms to zero-fill one here), so the
/// writer never has to make one itself under load.
const SPARES: usize = 3;
/// The room a spare segment may not take: what the log and the file may
/// need meanwhile.
const SPARE_ROOM: u64 = 256 << 20;

/// A log entry: its key, and the value put, or `None` for a removal.
type Entry<'a> = (&'a [u8; 32], Option<&'a [u8]>);

/// A damaged log entry (see [`Wal::damage_at`]): where it is, and, when
/// it can be read whole all the same, how.
#[derive(Debug, PartialEq, Eq)]
struct Damage {
    at: usize,
    repaired: Option<Repaired>,
}

/// A damaged entry read whole: its body, where the entries after it
/// resume, and the checksum they chain from.
#[derive(Debug, PartialEq, Eq)]
struct Repaired {
    body: std::ops::Range<usize>,
    resume: usize,
    link: u32,
}

impl Damage {
    /// The entry at `at`, whole at `len` bytes of body in `bytes`
    /// (chained: else nothing vouches for it); the next chains from the
    /// checksum it holds.
    fn length(at: usize, len: usize, bytes: &[u8], chained: bool) -> Damage {
        let link = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().expect("four bytes"));
        let repaired = Repaired {
            body: at + 8..at + 8 + len,
            resume: at + 8 + len,
            link,
        };
        Damage {
            at,
            repaired: chained.then_some(repaired),
        }
    }
}

/// The entries of a segment, in order, each checked against its
/// checksum, chained from the one before (`link`; `None`: not chained),
/// up to the first that is not whole, chained on and of a known kind, or
/// to the seal that ends it (`sealed`, the next segment's number). Where
/// it stopped otherwise (`at`, `link`) is where [`Wal::damage_at`] looks.
struct Walk<'a> {
    bytes: &'a [u8],
    segment: u64,
    at: usize,
    link: Option<u32>,
    sealed: Option<u64>,
}

impl<'a> Walk<'a> {
    fn new(bytes: &'a [u8], segment: u64, link: Option<u32>) -> Walk<'a> {
        Walk {
            bytes,
            segment,
            at: 0,
            link,
            sealed: None,
        }
    }

    /// Goes on at `at`, after an entry whose checksum is `link`.
    fn resume(&mut self, at: usize, link: u32) {
        self.at = at;
        self.link = self.link.map(|_| link);
    }
}

impl<'a> Iterator for Walk<'a> {
    type Item = Entry<'a>;

    fn next(&mut self) -> Option<Entry<'a>> {
        let (len, crc, body) = Wal::read_at(self.bytes, self.at)?;
        if self.sealed.is_some() || Wal::crc(self.segment, self.link, body) != crc {
            return None;
        }
        if body[32] == SEALED {
            self.sealed = Some(u64::from_le_bytes(body.get(33..41)?.try_into().ok()?));
            self.at += 8 + len;
            return None;
        }
        let entry = Wal::read_entry(body)?;
        self.at += 8 + len;
        self.link = self.link.map(|_| crc);
        Some(entry)
    }
}

impl Wal {
    fn named(path: &Path, suffix: &str) -> PathBuf {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        PathBuf::from(name)
    }

    fn segment_path(path: &Path, n: u64) -> PathBuf {
        Wal::named(path, &format!("-wal.{n:06}"))
    }

    /// The files beside `path` named `<file name><infix><number>`, by number.
    fn numbered(path: &Path, infix: &str) -> std::io::Result<Vec<(u64, PathBuf)>> {
        Wal::numbered_with(path, infix, "")
    }

    /// [`Wal::numbered`], for names that end with `suffix`.
    fn numbered_with(path: &Path, infix: &str, suffix: &str) -> std::io::Result<Vec<(u64, PathBuf)>> {
        let prefix = format!("{}{infix}", path.file_name().unwrap_or_default().to_string_lossy());
        let mut found = Vec::new();
        for entry in fs::read_dir(parent(path))? {
            let entry = entry?;
            let name = entry.file_name();
            if let Some(n) = name
                .to_str()
                .and_then(|n| n.strip_prefix(&prefix))
                .and_then(|n| n.strip_suffix(suffix))
                .and_then(|n| n.parse().ok())
            {
                found.push((n, entry.path()));
            }
        }
        found.sort();
        Ok(found)
    }

    /// Removes the temporary files of zero-fills a crash cut short
    /// (`<segment or spare>.new`, see [`Wal::zero_filled`]): each is up to
    /// a segment of disk nobody would reclaim. Only while the store opens,
    /// when nothing else makes one; a failure is a warning, as the store
    /// works without the room.
    fn remove_temporaries(path: &Path) {
        let removed = || -> std::io::Result<()> {
            for infix in ["-wal.", "-wal-spare."] {
                for (_, temporary) in Wal::numbered_with(path, infix, ".new")? {
                    if fs::symlink_metadata(&temporary)?.is_file() {
                        fs::remove_file(temporary)?;
                    }
                }
            }
            Ok(())
        };
        if let Err(error) = removed() {
            tracing::warn!(%error, "removing the embedded store's half-made log segments failed");
        }
    }

    /// The segments beside `path`, oldest first.
    fn segments(path: &Path) -> std::io::Result<Vec<(u64, PathBuf)>> {
        Wal::numbered(path, "-wal.")
    }

    /// Refuses a log with a segment missing that records may be in: one
    /// between two that are there (each is made before the one after it,
    /// and only those below `applied_below` are retired), or the first to
    /// replay, `applied_below`, when the file says it was made (`made`).
    fn none_missing(
        path: &Path,
        segments: &[(u64, PathBuf)],
        applied_below: u64,
        made: Option<u64>,
    ) -> Result<(), String> {
        let present: Vec<u64> = segments
            .iter()
            .map(|(n, _)| *n)
            .filter(|n| *n >= applied_below)
            .collect();
        let first = match made {
            Some(made) if made == applied_below && applied_below > 0 => applied_below,
            _ => match present.first() {
                Some(first) => *first,
                None => return Ok(()),
            },
        };
        let last = present.last().copied().unwrap_or(first).max(first);
        let Some(missing) = (first..=last).find(|n| present.binary_search(n).is_err()) else {
            return Ok(());
        };
        // The whole gap, to be restored or made empty at once.
        let through = (missing..=last)
            .take_while(|n| present.binary_search(n).is_err())
            .last()
            .unwrap_or(missing);
        // Nothing there after it: later ones may be gone too.
        let open_ended = !present.iter().any(|&n| n > through);
        Err(Wal::missing(path, missing, through, open_ended))
    }

    /// The refusal of a log whose segments `missing` to `through` are not
    /// there, and, `open_ended`, perhaps any made after them (none after
    /// them is there to say).
    fn missing(path: &Path, missing: u64, through: u64, open_ended: bool) -> String {
        let named = |n| Wal::segment_path(path, n).display().to_string();
        let which = if through == missing {
            format!("the log segment {} is missing", named(missing))
        } else {
            format!("the log segments {} to {} are missing", named(missing), named(through))
        };
        let after = if open_ended {
            " (any made after it are missing too, as none after it is there to say: restore them all; \
             touched empty, it would open without them)"
        } else {
            ""
        };
        format!(
            "{which}, and with them the records they held (retries of their requests would run \
             again){after}: restore them, or create them empty (touch each) to go on without them"
        )
    }

    /// Makes segment `n` from a spare, or from a new zero-filled file, and
    /// opens it; its directory entry is synced before it is used. A
    /// spare's first entry is zeroed (and synced) first: one written in an
    /// earlier life under this same number (a file restored from a backup
    /// repeats numbers) would otherwise start a valid chain, replayed if
    /// this life wrote nothing before a restart.
    fn create(path: &Path, n: u64) -> std::io::Result<Wal> {
        use std::os::unix::fs::FileExt;
        let target = Wal::segment_path(path, n);
        let spare = Wal::numbered(path, "-wal-spare.")?.into_iter().next();
        match &spare {
            Some((_, spare)) => fs::rename(spare, &target)?,
            None => Wal::zero_filled(&target)?,
        }
        File::open(parent(path))?.sync_all()?;
        let file = OpenOptions::new().write(true).open(target)?;
        if spare.is_some() {
            file.write_all_at(&[0; 8], 0)?;
            file.sync_data()?;
        }
        Ok(Wal {
            path: path.to_owned(),
            segment: n,
            file,
            offset: 0,
            link: 0,
        })
    }

    /// Writes a zero-filled segment-sized file under a temporary name of
    /// its own (the writer and the checkpoint thread may both be making
    /// one), syncs it, and renames it to `target`.
    /// A failure (the disk full) leaves no temporary file behind.
    fn zero_filled(target: &Path) -> std::io::Result<()> {
        let mut temporary = target.as_os_str().to_owned();
        temporary.push(".new");
        let temporary = PathBuf::from(temporary);
        let fill = || -> std::io::Result<()> {
            let mut file = File::create(&temporary)?;
            let zeros = vec![0u8; 1 << 20];
            for _ in 0..SEGMENT_BYTES / zeros.len() as u64 {
                file.write_all(&zeros)?;
            }
            file.sync_all()?;
            fs::rename(&temporary, target)
        };
        fill().inspect_err(|_| {
            let _ = fs::remove_file(&temporary);
        })
    }

    /// Removes every spare segment.
    fn discard_spares(path: &Path) -> std::io::Result<()> {
        for (_, spare) in Wal::numbered(path, "-wal-spare.")? {
            fs::remove_file(spare)?;
        }
        Ok(())
    }

    /// Retires segments `ns`: the first few become spares, the rest are
    /// removed; then syncs the directory.
    fn retire(path: &Path, ns: impl IntoIterator<Item = u64>) -> std::io::Result<()> {
        let spares = Wal::numbered(path, "-wal-spare.")?;
        let mut next = spares.last().map_or(0, |(k, _)| k + 1);
        let mut count = spares.len();
        for n in ns {
            let segment = Wal::segment_path(path, n);
            // One shorter than it is made (cut, or made empty by hand to go
            // on without a lost one) would be a spare that is not zero-filled.
            let whole = fs::metadata(&segment)?.len() >= SEGMENT_BYTES;
            if count < SPARES && whole {
                fs::rename(segment, Wal::named(path, &format!("-wal-spare.{next}")))?;
                next += 1;
                count += 1;
            } else {
                fs::remove_file(segment)?;
            }
        }
        File::open(parent(path))?.sync_all()
    }

    /// Makes spare segments until `SPARES` are ready, each only while
    /// `SPARE_ROOM` would stay free after it: spares only save the writer
    /// a zero-fill, and must not take the room the log and the file need.
    /// Failing (the disk full) is a warning, not an error: the writer makes
    /// a segment itself when there is no spare.
    fn top_up(path: &Path) {
        let made = || -> std::io::Result<()> {
            let spares = Wal::numbered(path, "-wal-spare.")?;
            let first = spares.last().map_or(0, |(k, _)| k + 1);
            for next in first..first + SPARES.saturating_sub(spares.len()) as u64 {
                if free_bytes(parent(path))? < SEGMENT_BYTES + SPARE_ROOM {
                    tracing::warn!("the embedded store's disk is nearly full: no spare log segment made");
                    break;
                }
                Wal::zero_filled(&Wal::named(path, &format!("-wal-spare.{next}")))?;
            }
            File::open(parent(path))?.sync_all()
        };
        if let Err(error) = made() {
            tracing::warn!(%error, "making spare log segments failed");
        }
    }

    /// An entry's checksum: CRC-32 of its segment's number, of the checksum
    /// of the entry before it in the segment (`link`, 0 for the first), and
    /// of its body. Chained so, what a recycled file holds from its earlier
    /// life (under another number, or under this one: a restored file's
    /// numbers repeat; entries a stored body spells out for a number to
    /// come) does not follow on from what this life wrote, and replay stops
    /// where this life's entries end. No `link`: a log written before
    /// entries were chained, read once, as a store opens on it.
    fn crc(segment: u64, link: Option<u32>, body: &[u8]) -> u32 {
        let mut crc = crc32fast::Hasher::new();
        crc.update(&segment.to_le_bytes());
        if let Some(link) = link {
            crc.update(&link.to_le_bytes());
        }
        crc.update(body);
        crc.finalize()
    }

    /// Appends an entry for segment `segment` after the one whose checksum
    /// is `link` to `buf`: a put of the value `change`, or a removal.
    fn encode(buf: &mut Vec<u8>, (segment, link): (u64, &mut u32), key: &[u8; 32], change: Option<&[u8]>) {
        match change {
            Some(value) => Wal::entry(buf, (segment, link), key, PUT, &[value]),
            None => Wal::entry(buf, (segment, link), key, REMOVE, &[]),
        }
    }

    /// Appends a put of `stored` (the file's value: deadline, then record).
    fn encode_put(buf: &mut Vec<u8>, at: (u64, &mut u32), key: &[u8; 32], stored: &Stored) {
        Wal::entry(buf, at, key, PUT, &[&stored.deadline.to_be_bytes(), &stored.record]);
    }

    /// Appends an entry whose value is `parts`, one after the other, and
    /// makes `link` its checksum.
    fn entry(buf: &mut Vec<u8>, (segment, link): (u64, &mut u32), key: &[u8; 32], kind: u8, parts: &[&[u8]]) {
        let value_len: usize = parts.iter().map(|part| part.len()).sum();
        let len = u32::try_from(33 + value_len).expect("a record is far below 4 GiB");
        let start = buf.len();
        buf.extend_from_slice(&len.to_le_bytes());
        buf.extend_from_slice(&[0; 4]);
        buf.extend_from_slice(key);
        buf.push(kind);
        for part in parts {
            buf.extend_from_slice(part);
        }
        let crc = Wal::crc(segment, Some(*link), &buf[start + 8..]);
        buf[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
        *link = crc;
    }

    /// The entries of segment `segment`, up to the first torn, damaged or
    /// stale one; `chained` unless written before entries were.
    #[cfg(test)]
    fn entries(bytes: &[u8], segment: u64, chained: bool) -> Walk<'_> {
        Walk::new(bytes, segment, chained.then_some(0))
    }

    /// The entries of segment `segment` to replay, in order, the damaged
    /// entries met, each by its offset and whether it was read whole all
    /// the same (see [`Wal::damage_at`]): past one so repaired, replay
    /// goes on; at one that is not, it stops, as at a torn end. And the
    /// segment it was sealed for, if it was.
    fn replayable(bytes: &[u8], segment: u64, chained: bool) -> (Vec<Entry<'_>>, Vec<(usize, bool)>, Option<u64>) {
        let (mut entries, mut damaged) = (Vec::new(), Vec::new());
        let mut walk = Walk::new(bytes, segment, chained.then_some(0));
        loop {
            entries.extend(&mut walk);
            if walk.sealed.is_some() {
                return (entries, damaged, walk.sealed);
            }
            let Some(damage) = Wal::damage_at(bytes, walk.at, segment, walk.link) else {
                return (entries, damaged, None);
            };
            let repaired = damage
                .repaired
                .and_then(|r| Some((Wal::read_entry(&bytes[r.body.clone()])?, r)));
            damaged.push((damage.at, repaired.is_some()));
            let Some((entry, repaired)) = repaired else {
                return (entries, damaged, None);
            };
            entries.push(entry);
            walk.resume(repaired.resume, repaired.link);
        }
    }

    /// The length, checksum and body of the entry at `at` of `bytes`, if
    /// they are there to read (not whether the checksum passes).
    fn read_at(bytes: &[u8], at: usize) -> Option<(usize, u32, &[u8])> {
        let len = u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?) as usize;
        let crc = u32::from_le_bytes(bytes.get(at + 4..at + 8)?.try_into().ok()?);
        let body = bytes.get(at + 8..at + 8 + len).filter(|b| b.len() >= 33)?;
        Some((len, crc, body))
    }

    /// An entry's key and change, from its body.
    fn read_entry(body: &[u8]) -> Option<Entry<'_>> {
        let key: &[u8; 32] = body.get(..32)?.try_into().ok()?;
        match *body.get(32)? {
            PUT => Some((key, Some(&body[33..]))),
            REMOVE => Some((key, None)),
            _ => None,
        }
    }

    /// Whether the entry at `at` of `bytes`, where a segment's entries
    /// (chained from `link`) stopped, is damage that can be seen as such.
    /// One whose checksum fails, followed by one whose checksum passes
    /// chained from the checksum its body has (under this segment's
    /// chain), was damaged in its checksum alone: it is read whole, the
    /// entry after vouching for its body. So is one whose length was
    /// damaged, found by the length its checksum passes at, when the entry
    /// after it passes too. One whose checksum fails followed by one
    /// chained from the checksum it holds was damaged in its body (a
    /// flipped bit), or is an earlier life's entry where this life's end
    /// (a recycled file under the same number, from a restored backup),
    /// which looks the same: replay stops there. So it does at damage to
    /// the last entry's length, or over more than one entry, which looks
    /// like a torn end (`None`), and at any damage in a log written before
    /// entries were chained (no `link`), where nothing vouches for a body.
    fn damage_at(bytes: &[u8], at: usize, segment: u64, link: Option<u32>) -> Option<Damage> {
        // Whether the entry at `next` passes, chained from `from`.
        let chained = link.is_some();
        let passes_after = |next: usize, from: u32| {
            Wal::read_at(bytes, next)
                .is_some_and(|(_, crc, body)| Wal::crc(segment, chained.then_some(from), body) == crc)
        };
        if let Some((len, crc, body)) = Wal::read_at(bytes, at) {
            let next = at + 8 + len;
            let expected = Wal::crc(segment, link, body);
            if expected == crc {
                // Whole, but of no kind this version writes: an end.
                return None;
            }
            if passes_after(next, expected) {
                let repaired = Repaired {
                    body: at + 8..next,
                    resume: next,
                    link: expected,
                };
                return Some(Damage {
                    at,
                    repaired: chained.then_some(repaired),
                });
            }
            if passes_after(next, crc) {
                return Some(Damage { at, repaired: None });
            }
        }
        let len = Wal::damaged_length(bytes, at, segment, link, passes_after)?;
        Some(Damage::length(at, len, bytes, chained))
    }

    /// The length at which the entry at `at` (chained from `link`),
    /// unreadable by its own, is whole: its checksum passes there, and the
    /// next entry after it too (`passes_after`). The usual end, zeros to
    /// the segment's end, is seen at once; an older life's bytes are
    /// searched, a byte at a time (a segment is 16 MiB).
    fn damaged_length(
        bytes: &[u8],
        at: usize,
        segment: u64,
        link: Option<u32>,
        passes_after: impl Fn(usize, u32) -> bool,
    ) -> Option<usize> {
        let crc = u32::from_le_bytes(bytes.get(at + 4..at + 8)?.try_into().ok()?);
        let rest = bytes.get(at + 8..)?;
        if rest.iter().all(|&b| b == 0) {
            return None;
        }
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&segment.to_le_bytes());
        if let Some(link) = link {
            hasher.update(&link.to_le_bytes());
        }
        for (i, byte) in rest.iter().enumerate() {
            hasher.update(std::slice::from_ref(byte));
            let len = i + 1;
            if len >= 33 && hasher.clone().finalize() == crc && passes_after(at + 8 + len, crc) {
                return Some(len);
            }
        }
        None
    }

    /// Writes `buf`, whose last entry's checksum is `link`, at the end of
    /// the log and syncs it.
    fn append(&mut self, buf: &[u8], link: u32) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.file.write_all_at(buf, self.offset)?;
        self.file.sync_data()?;
        self.offset += buf.len() as u64;
        self.link = link;
        Ok(())
    }
}

/// The bytes free to an unprivileged writer on the file system of `dir`.
#[cfg(target_os = "linux")]
fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    let stats = rustix::fs::statvfs(dir)?;
    Ok(stats.f_bavail.saturating_mul(stats.f_frsize))
}

#[cfg(not(target_os = "linux"))]
fn free_bytes(_: &Path) -> std::io::Result<u64> {
    Ok(u64::MAX)
}

fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

/// The thread that owns every write.
struct Writer {
    shared: Arc<Shared>,
    waiters: Arc<Waiters>,
    wal: Wal,
    /// To the checkpoint thread: an overlay and the segments below which
    /// it covers.
    checkpoints: std_mpsc::Sender<(Arc<Changes>, u64)>,
    last_checkpoint: Instant,
    /// Until when no new segment is tried, after one failed.
    segment_backoff: Option<Instant>,
}

/// An answer held until the batch is synced.
enum Pending {
    /// A claim's answer, and whether it stands unlogged: it found a record
    /// already in the log, not one this batch made.
    Claim(
        oneshot::Sender<Result<Claim, StoreError>>,
        Result<Claim, StoreError>,
        bool,
    ),
    Flag(
        oneshot::Sender<Result<bool, StoreError>>,
        Result<bool, StoreError>,
        Option<RecordKey>,
    ),
}

impl Writer {
    fn run(mut self, ops: std_mpsc::Receiver<Op>) {
        loop {
            let mut batch = Vec::new();
            match ops.recv_timeout(CHECKPOINT_EVERY) {
                Ok(op) => batch.push(op),
                Err(std_mpsc::RecvTimeoutError::Timeout) => {}
                Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
            }
            // Bounded in count and in bytes: a batch of large answers stays
            // within a segment's headroom, and its log in one buffer small.
            let mut bytes = batch.iter().map(Op::log_bytes).sum::<usize>();
            while batch.len() < MAX_BATCH && (bytes as u64) < SEGMENT_HEADROOM {
                match ops.try_recv() {
                    Ok(op) => {
                        bytes += op.log_bytes();
                        batch.push(op);
                    }
                    Err(_) => break,
                }
            }
            if !batch.is_empty() {
                self.apply(batch);
            }
            self.maybe_checkpoint();
        }
    }

    /// Decides a batch, logs and syncs it, publishes it, then answers it.
    fn apply(&mut self, batch: Vec<Op>) {
        // Batches go on into this segment, past its end, until one is made
        // (none once the store has failed: nothing more is logged).
        if self.wal.offset + SEGMENT_HEADROOM > SEGMENT_BYTES && self.shared.failed.get().is_none() {
            self.roll();
        }
        let now = self.shared.clock.now();
        let mut changes = Batch {
            segment: self.wal.segment,
            link: self.wal.link,
            shared: &self.shared,
            changes: Changes::default(),
            log: Vec::new(),
            now,
            stamp: self.shared.clock.stamp(now),
        };
        let pending: Vec<Pending> = batch.into_iter().map(|op| changes.apply(op)).collect();
        let Batch { changes, log, link, .. } = changes;
        let synced = if let Some(failure) = self.shared.failed.get() {
            Err(StoreError::Unavailable(failure.clone().into()))
        } else if log.is_empty() {
            Ok(())
        } else {
            self.wal.append(&log, link).map_err(|error| {
                // After a failed write or sync the segment's tail is
                // unknown. What was acknowledged is in the log before it.
                let failure = log_write_failed(&error);
                self.shared.fail(failure.clone());
                StoreError::Unavailable(failure.into())
            })
        };
        if synced.is_ok() && !changes.is_empty() {
            let mut overlay = lock(&self.shared.overlay);
            for (key, change) in changes {
                let size = change.as_ref().map_or(0, |stored| 8 + stored.record.len()) + 64;
                overlay.active.insert(key, change);
                overlay.active_bytes += size;
            }
        }
        for answer in pending {
            match answer {
                // A record found in the log is the answer whether or not
                // the refresh of its TTL was logged (a replay after the store
                // failed); a new claim, or a record this batch made, only
                // once the batch is in the log.
                Pending::Claim(reply, result @ Ok(Claim::Completed { .. } | Claim::InFlight { .. }), true) => {
                    let _ = reply.send(result);
                }
                Pending::Claim(reply, result, _) => {
                    let _ = reply.send(synced.as_ref().map_err(copy_error).and(result));
                }
                Pending::Flag(reply, result, wake) => {
                    if synced.is_ok()
                        && let Some(key) = wake
                    {
                        self.waiters.wake(&key);
                    }
                    let _ = reply.send(synced.as_ref().map_err(copy_error).and(result));
                }
            }
        }
    }

    /// Moves the log on to the segment after this one, if one can be made,
    /// once this one is sealed with an entry that names it (see
    /// [`SEALED`]). A seal that cannot be written fails the store, as any
    /// failed write to the log does; the log stays where it is.
    fn roll(&mut self) -> bool {
        let Some(next) = self.next_segment() else {
            return false;
        };
        let mut seal = Vec::with_capacity(8 + 33 + 8);
        let mut link = self.wal.link;
        let at = (self.wal.segment, &mut link);
        Wal::entry(&mut seal, at, &[0; 32], SEALED, &[&next.segment.to_le_bytes()]);
        if let Err(error) = self.wal.append(&seal, link) {
            self.shared.fail(log_write_failed(&error));
            return false;
        }
        self.wal = next;
        true
    }

    /// The segment after this one, unless making one failed within the
    /// last second: a full disk is tried (and logged) once a second, not
    /// once a batch.
    fn next_segment(&mut self) -> Option<Wal> {
        if self.segment_backoff.is_some_and(|until| Instant::now() < until) {
            return None;
        }
        match Wal::create(&self.wal.path, self.wal.segment + 1) {
            Ok(wal) => {
                self.segment_backoff = None;
                Some(wal)
            }
            Err(error) => {
                let segment = Wal::segment_path(&self.wal.path, self.wal.segment + 1);
                tracing::error!(%error, segment = %segment.display(), "starting a new log segment failed; the current one grows meanwhile");
                self.segment_backoff = Some(Instant::now() + Duration::from_secs(1));
                None
            }
        }
    }

    /// Hands the overlay to the checkpoint thread when it is due and the
    /// last checkpoint is done; waits for that one when the overlay is
    /// over its limit. Once the store has failed, none is made: the log
    /// keeps what the overlay holds for the restart.
    fn maybe_checkpoint(&mut self) {
        let mut overlay = lock(&self.shared.overlay);
        if overlay.active.is_empty() || self.shared.failed.get().is_some() {
            return;
        }
        if self.shared.draining.get().is_some() {
            // No checkpoint could land: the overlay keeps what the log
            // holds, and takes only the settling of claims held, and the
            // refreshes of replays, up to its limit.
            if overlay.active_bytes >= OVERLAY_LIMIT {
                drop(overlay);
                self.shared
                    .fail("the embedded store's file cannot be written and its log is full; restart to recover".into());
            }
            return;
        }
        // Past its segment, the log could not move to a new one (out of
        // descriptors or inodes, a directory that cannot be written), and
        // so nothing is checkpointed: the log and the overlay grow with
        // every batch. Half way to the overlay's limit the store drains,
        // as when the file cannot be written, and at the limit it fails.
        if self.wal.offset > SEGMENT_BYTES + OVERLAY_LIMIT as u64 / 2 {
            drop(overlay);
            self.shared.drain(
                "the embedded store's log cannot move to a new segment and has outgrown the memory its records \
                 are held in; restart to recover"
                    .into(),
            );
            return;
        }
        let due = overlay.active_bytes >= CHECKPOINT_BYTES || self.last_checkpoint.elapsed() >= CHECKPOINT_EVERY;
        if !due {
            return;
        }
        while !overlay.frozen.is_empty() {
            if overlay.active_bytes < OVERLAY_LIMIT || self.shared.refusal().is_some() {
                return;
            }
            overlay = self
                .shared
                .checkpointed
                .wait(overlay)
                .unwrap_or_else(|p| p.into_inner());
        }
        // The new segment is made (a rename or a zero-fill, and a sync)
        // with the overlay let go: lookups read it meanwhile. Nothing it
        // holds changes until this thread, its only writer, takes it again,
        // and only this thread fills `frozen`, which is empty.
        drop(overlay);
        if !self.roll() {
            return;
        }
        let covered_below = self.wal.segment;
        let mut overlay = lock(&self.shared.overlay);
        overlay.frozen = Arc::new(std::mem::take(&mut overlay.active));
        overlay.active_bytes = 0;
        let frozen = overlay.frozen.clone();
        drop(overlay);
        self.last_checkpoint = Instant::now();
        if self.checkpoints.send((frozen, covered_below)).is_err() && self.shared.draining.get().is_none() {
            // Nothing would ever write the overlay into the file. (A file
            // that failed as this checkpoint was handed over left the
            // store draining: `frozen` stays in the overlay, and the log.)
            self.shared
                .fail("the embedded store's checkpoint thread has stopped; restart to recover".into());
        }
    }
}

/// A refreshed TTL restarts at most once every this much of it.
const REFRESH_SLACK: u64 = 64;

/// Whether a record whose TTL a replay would restart to `ttl` ms from
/// `now` was written or refreshed within the last [`REFRESH_SLACK`]th of
/// that TTL: then it is not refreshed again. A refresh writes the whole
/// answer to the log again, and syncs it; a storm of replays of a large
/// answer would write it at every replay (a 1 MB answer replayed a
/// thousand times a second, a gigabyte a second). It expires at most
/// that much sooner than the last replay's TTL would have it.
fn refreshed_lately(deadline: u64, now: u64, ttl: u64) -> bool {
    deadline.saturating_add(ttl / REFRESH_SLACK) >= now.saturating_add(ttl)
}

/// The store's failure once a write or sync of its log failed.
fn log_write_failed(error: &std::io::Error) -> String {
    format!("a write to the embedded store's log failed ({error}); restart to recover")
}

fn copy_error(error: &StoreError) -> StoreError {
    StoreError::Unavailable(error.to_string().into())
}

/// Whether `stored` is a claim held by `owner`.
fn held_by(stored: &Stored, owner: Owner) -> bool {
    stored.record.get(1) == Some(&codec::IN_FLIGHT)
        && stored.record.get(codec::PREFIX..codec::PREFIX + 16) == Some(&codec::owner_bytes(owner)[..])
}

/// One batch being decided: its own changes first, then the store's.
struct Batch<'a> {
    /// The log segment the batch goes to, and the checksum its next entry
    /// covers.
    segment: u64,
    link: u32,
    shared: &'a Shared,
    changes: Changes,
    log: Vec<u8>,
    /// Now, to compare deadlines with, and what deadlines written now run
    /// from (see [`Clock::stamp`]).
    now: u64,
    stamp: u64,
}

impl Batch<'_> {
    /// The live record under `key`; an expired one counts as absent.
    fn live(&self, key: &RecordKey) -> Result<Option<Stored>, StoreError> {
        self.live_unless(key, None)
    }

    /// [`Batch::live`], skipping the file when it is known not to hold
    /// `key` (see [`Shared::find`]).
    fn live_unless(&self, key: &RecordKey, absent_at: Option<u64>) -> Result<Option<Stored>, StoreError> {
        let stored = match self.changes.get(&key.0) {
            Some(change) => change.clone(),
            None => self.shared.find(key, absent_at)?.stored,
        };
        Ok(stored.filter(|s| s.deadline > self.now))
    }

    fn put(&mut self, key: &RecordKey, deadline: u64, record: Bytes) {
        let stored = Stored { deadline, record };
        Wal::encode_put(&mut self.log, (self.segment, &mut self.link), &key.0, &stored);
        self.changes.insert(key.0, Some(stored));
    }

    fn remove(&mut self, key: &RecordKey) {
        Wal::encode(&mut self.log, (self.segment, &mut self.link), &key.0, None);
        self.changes.insert(key.0, None);
    }

    /// The live in-flight record of `key` if `owner` holds it.
    fn owned(&self, key: &RecordKey, owner: Owner) -> Result<Option<Stored>, StoreError> {
        Ok(self.live(key)?.filter(|s| held_by(s, owner)))
    }

    fn apply(&mut self, op: Op) -> Pending {
        match op {
            Op::Claim {
                key,
                fingerprint,
                owner,
                lease,
                refresh,
                absent_at,
                reply,
            } => {
                // Its caller gave up (the store's deadline): a claim made
                // now would only block retries until its lease ran out.
                if reply.is_closed() {
                    return Pending::Claim(reply, Err(unavailable(WriterGone)), false);
                }
                let logged = !self.changes.contains_key(&key.0);
                let result = self.claim(&key, &fingerprint, owner, lease, refresh, absent_at);
                Pending::Claim(reply, result, logged)
            }
            Op::Complete {
                key,
                fingerprint,
                owner,
                outcome,
                ttl,
                reply,
            } => {
                let result = self.live(&key).and_then(|found| {
                    let fingerprint = match found {
                        Some(held) if held_by(&held, owner) => codec::fingerprint_of(&held.record)?,
                        Some(_) => return Ok(false),
                        // No live record: the lease ran out, or the claim
                        // was purged, and nobody has claimed the key since.
                        // The answer is kept.
                        None => fingerprint,
                    };
                    let record = codec::completed(&fingerprint, &outcome);
                    self.put(&key, self.stamp.saturating_add(ttl), record.into());
                    Ok(true)
                });
                Pending::Flag(reply, result, Some(key))
            }
            Op::Release { key, owner, reply } => {
                let result = self.owned(&key, owner).map(|held| {
                    let held = held.is_some();
                    if held {
                        self.remove(&key);
                    }
                    held
                });
                Pending::Flag(reply, result, Some(key))
            }
            Op::Purge { key, reply } => {
                // A damaged record is purged too: an operator's way to
                // free a key it holds.
                let result = match self.live(&key) {
                    Ok(found) => Ok(found.is_some()),
                    Err(StoreError::Corrupt(_)) => Ok(true),
                    Err(error) => Err(error),
                };
                if result.is_ok() {
                    self.remove(&key);
                }
                Pending::Flag(reply, result, Some(key))
            }
            Op::Renew {
                key,
                owner,
                lease,
                reply,
            } => {
                let result = self.owned(&key, owner).map(|held| match held {
                    None => false,
                    Some(held) => {
                        self.put(&key, self.stamp.saturating_add(lease), held.record);
                        true
                    }
                });
                Pending::Flag(reply, result, None)
            }
            Op::Ping { reply } => Pending::Flag(reply, Ok(true), None),
        }
    }

    fn claim(
        &mut self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        lease: u64,
        refresh: Option<u64>,
        absent_at: Option<u64>,
    ) -> Result<Claim, StoreError> {
        if let Some(stored) = self.live_unless(key, absent_at)? {
            return Ok(match codec::decode(stored.record.clone())? {
                Decoded::InFlight { owner: held, .. } if held == owner => Claim::Claimed,
                Decoded::InFlight { fingerprint: found, .. } => Claim::InFlight { fingerprint: found },
                Decoded::Completed {
                    fingerprint: found,
                    outcome,
                } => {
                    // Not while draining: the overlay holds what it logs
                    // until a restart, and replays must not fill it.
                    if let Some(ttl) = refresh.filter(|_| found == *fingerprint && outcome.is_response())
                        && self.shared.draining.get().is_none()
                        && !refreshed_lately(stored.deadline, self.now, ttl)
                    {
                        self.put(key, self.stamp.saturating_add(ttl), stored.record.clone());
                    }
                    Claim::Completed {
                        fingerprint: found,
                        outcome,
                    }
                }
            });
        }
        // Refused having taken nothing: no release need follow.
        if let Some(failure) = self.shared.draining.get() {
            return Err(StoreError::NotSent(failure.clone().into()));
        }
        let record = codec::in_flight(fingerprint, owner);
        self.put(key, self.stamp.saturating_add(lease), record.into());
        Ok(Claim::Claimed)
    }
}

/// The live claims of the overlay's frozen part.
fn held_claims(overlay: &Mutex<Overlay>, now: u64) -> Vec<([u8; 32], Stored)> {
    let frozen = lock(overlay).frozen.clone();
    let held = frozen.iter().filter_map(|(key, change)| {
        let stored = change.as_ref()?;
        (stored.deadline > now && stored.record.get(1) == Some(&codec::IN_FLIGHT)).then(|| (*key, stored.clone()))
    });
    held.collect()
}

/// Fails the store if the thread holding it panics: nothing else would
/// write the overlay into the file, and a writer could wait for that.
struct FailOnPanic(Arc<Shared>);

impl Drop for FailOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0
                .fail("the embedded store's checkpoint thread panicked; restart to recover".into());
        }
    }
}

/// The thread that writes overlays into the file and sweeps it.
struct Checkpointer {
    shared: Arc<Shared>,
    path: PathBuf,
    /// Where the next sweep starts; `None`: at the beginning.
    sweep_from: Option<[u8; 32]>,
    /// Records written since the last sweep, which sizes the next one.
    written_since_sweep: usize,
}

impl Checkpointer {
    fn run(mut self, checkpoints: std_mpsc::Receiver<(Arc<Changes>, u64)>) {
        let _stopped = FailOnPanic(self.shared.clone());
        let mut last_sweep = Instant::now();
        loop {
            let checkpoint = match checkpoints.recv_timeout(SWEEP_EVERY) {
                Ok(checkpoint) => Some(checkpoint),
                Err(std_mpsc::RecvTimeoutError::Timeout) => None,
                Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
            };
            let sweep = last_sweep.elapsed() >= SWEEP_EVERY;
            if sweep {
                last_sweep = Instant::now();
            }
            let written = match &checkpoint {
                Some((frozen, covered_below)) => self.write(Some((&**frozen, *covered_below)), sweep),
                None if sweep => self.write(None, true),
                None => Ok(()),
            };
            if let Err(error) = written {
                // redb refuses its file after a failed write until it is
                // opened again, so a retry cannot land. The overlay keeps
                // answering reads and the log keeps the records, and takes
                // the settling of the claims held.
                self.shared.drain(format!(
                    "a write to the embedded store's file failed ({}); new claims are refused, those held settle into its log; restart to recover",
                    crate::telemetry::error_chain(&error)
                ));
                return;
            }
            if let Some((_, covered_below)) = checkpoint {
                match Wal::segments(&self.path) {
                    Ok(segments) => {
                        let covered = segments.into_iter().map(|(n, _)| n).filter(|n| *n < covered_below);
                        if let Err(error) = Wal::retire(&self.path, covered) {
                            tracing::warn!(%error, "removing checkpointed log segments failed");
                        }
                    }
                    Err(error) => tracing::warn!(%error, "listing log segments failed"),
                }
                {
                    // Looked for outside the lock: `frozen` changes no more.
                    let held = held_claims(&self.shared.overlay, self.shared.clock.now());
                    let mut overlay = lock(&self.shared.overlay);
                    overlay.frozen = Arc::default();
                    overlay.generation += 1;
                    for (key, stored) in held {
                        if !overlay.active.contains_key(&key) {
                            overlay.active_bytes += 8 + stored.record.len() + 64;
                            overlay.active.insert(key, Some(stored));
                        }
                    }
                }
                self.shared.checkpointed.notify_all();
                Wal::top_up(&self.path);
            }
        }
    }

    /// Writes `changes` (expired records as removals), which cover the log
    /// segments below the number given, and, if `sweep`, a sweep batch, in
    /// one durable transaction.
    fn write(&mut self, changes: Option<(&Changes, u64)>, sweep: bool) -> Result<(), StoreError> {
        let now = self.shared.clock.now();
        let txn = self.shared.db.begin_write().map_err(unavailable)?;
        let mut sweep_from = self.sweep_from;
        let mut written = self.written_since_sweep;
        let mut removed = Vec::new();
        {
            let mut table = txn.open_table(RECORDS).map_err(unavailable)?;
            if let Some((_, covered_below)) = changes {
                let mut meta = txn.open_table(META).map_err(unavailable)?;
                meta.insert(APPLIED_BELOW, covered_below).map_err(unavailable)?;
                // The writer's segment when the overlay was swapped: made.
                meta.insert(MADE, covered_below).map_err(unavailable)?;
            }
            // In key order: consecutive changes land in the same leaf pages,
            // which are read (and copied on write) once per checkpoint
            // rather than once per change; random keys in hash order would
            // visit the whole tree at random.
            let mut sorted: Vec<_> = changes.into_iter().flat_map(|(changes, _)| changes).collect();
            sorted.sort_unstable_by_key(|(key, _)| **key);
            let mut value = Vec::new();
            for (key, change) in sorted {
                written += 1;
                match change.as_ref().filter(|stored| stored.deadline > now) {
                    Some(stored) => {
                        // Into the filter before the commit: once the
                        // overlay lets go of the key, the filter has it. A
                        // transaction that then fails leaves it counted
                        // (its retry counts it again): too many is safe.
                        if table
                            .insert(key, value_into(&mut value, stored.deadline, &stored.record))
                            .map_err(unavailable)?
                            .is_none()
                        {
                            self.shared.filter.add(key);
                        }
                    }
                    None => {
                        if table.remove(key).map_err(unavailable)?.is_some() {
                            removed.push(*key);
                        }
                    }
                }
            }
            if sweep {
                // Look at twice what was written since the last sweep (at
                // least SWEEP_BATCH): the sweep outpaces any insert rate.
                let budget = SWEEP_BATCH.max(2 * written);
                written = 0;
                let start = sweep_from.unwrap_or([0; 32]);
                let mut expired = Vec::new();
                let mut last = None;
                let mut seen = 0;
                for entry in table.range::<&[u8; 32]>(&start..).map_err(unavailable)? {
                    let (key, value) = entry.map_err(unavailable)?;
                    let key = *key.value();
                    // A record whose checksum fails keeps its key (503)
                    // until a purge: its deadline cannot be trusted, and
                    // swept early, its retry would run again.
                    if parts(value.value()).is_ok_and(|(deadline, _)| deadline <= now) {
                        expired.push(key);
                    }
                    last = Some(key);
                    seen += 1;
                    if seen == budget {
                        break;
                    }
                }
                for key in expired {
                    if table.remove(&key).map_err(unavailable)?.is_some() {
                        removed.push(key);
                    }
                }
                // A short batch reached the end of the table: start over.
                sweep_from = if seen == budget { last } else { None };
            }
        }
        txn.commit().map_err(unavailable)?;
        // Out of the filter only once out of the file.
        for key in &removed {
            self.shared.filter.remove(key);
        }
        self.sweep_from = sweep_from;
        self.written_since_sweep = written;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoredResponse;

    /// A directory for one test's store, removed when dropped: again while
    /// the store's threads, which outlive it a moment, still write log
    /// segments into it (one try would leave it behind, tens of MiB).
    struct Scratch(tempfile::TempDir);

    fn scratch() -> Scratch {
        Scratch(tempfile::tempdir().unwrap())
    }

    impl Scratch {
        fn path(&self) -> &Path {
            self.0.path()
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            for _ in 0..200 {
                match fs::remove_dir_all(self.0.path()) {
                    Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    _ => return,
                }
            }
        }
    }

    /// A 200 answer with `body`, as the gateway records one.
    fn answer(body: &Bytes) -> Outcome {
        Outcome::Response(Arc::new(StoredResponse::new(
            http::StatusCode::OK,
            &[],
            std::slice::from_ref(body),
        )))
    }

    /// A replay restarts its TTL through the writer, which logs the whole
    /// answer again: not when the record was written or refreshed within
    /// the last sixty-fourth of that TTL, so a storm of replays writes
    /// nothing. (Told by the time left: a checkpoint may empty the
    /// overlay at any moment, so what it holds says nothing.)
    #[tokio::test]
    async fn a_replay_refreshes_a_ttl_not_refreshed_lately() {
        let dir = scratch();
        let store = EmbeddedStore::open(&dir.path().join("t.redb")).unwrap();
        let body = Bytes::from(vec![b'r'; 256 * 1024]);
        let (fingerprint, lease) = (Fingerprint([1; 32]), Duration::from_secs(30));
        for (key, ttl, refreshed) in [
            (RecordKey([1; 32]), Duration::from_secs(640), false),
            (RecordKey([2; 32]), Duration::from_millis(6400), true),
        ] {
            let owner = Owner::new();
            store.claim(&key, &fingerprint, owner, lease, None).await.unwrap();
            assert!(
                store
                    .complete(&key, &fingerprint, owner, answer(&body), ttl)
                    .await
                    .unwrap()
            );
            // A sixty-fourth of 6.4 s is 100 ms; of 640 s, 10 s.
            tokio::time::sleep(Duration::from_secs(1)).await;
            for _ in 0..10 {
                let replay = store.claim(&key, &fingerprint, Owner::new(), lease, Some(ttl)).await;
                assert!(matches!(replay, Ok(Claim::Completed { .. })), "{replay:?}");
            }
            // Refreshed, the whole TTL is left again (less the moments
            // since); not, a second less.
            let (_, left) = store.inspect(&key).await.unwrap().unwrap();
            let whole = left > ttl - Duration::from_millis(500);
            assert_eq!(whole, refreshed, "{left:?} of {ttl:?} left");
        }
    }

    #[test]
    fn the_clock_runs_on_the_monotonic_clock_from_the_wall_clock_at_start() {
        let origin = Instant::now();
        let later = origin + Duration::from_millis(2_500);
        assert_eq!(anchored(origin, 1_000_000, later), 1_002_500);
        // An instant before the origin (not one this store makes) reads as it.
        assert_eq!(anchored(later, 7, origin), 7);
        // Anchored within the run, it keeps with the wall clock while that
        // is not stepped.
        let clock = Clock::new(wall_ms);
        let (store, wall) = (clock.now(), wall_ms());
        assert!(store.abs_diff(wall) < 1_000, "store {store} against wall {wall}");
    }

    /// The wall clock steps ahead of the store's (NTP setting right a
    /// clock that was slow at boot) while a store is open: what it writes
    /// must last its TTL by the wall clock a restart starts from, not end
    /// early and let the retry run again.
    #[tokio::test]
    async fn a_wall_clock_stepped_ahead_does_not_cut_short_what_a_restart_reads() {
        use std::sync::atomic::{AtomicU64, Ordering};
        static AHEAD: AtomicU64 = AtomicU64::new(0);
        fn stepped() -> u64 {
            wall_ms() + AHEAD.load(Ordering::Relaxed)
        }
        let dir = scratch();
        let path = dir.path().join("c.redb");
        let store = EmbeddedStore::open_with(&path, Clock::new(stepped)).unwrap();
        AHEAD.store(3_600_000, Ordering::Relaxed);
        let (key, fingerprint, owner) = (RecordKey([70; 32]), Fingerprint([1; 32]), Owner::new());
        let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(600));
        assert_eq!(
            store.claim(&key, &fingerprint, owner, lease, None).await.unwrap(),
            Claim::Claimed
        );
        let outcome = answer(&Bytes::from_static(b"kept"));
        assert!(store.complete(&key, &fingerprint, owner, outcome, ttl).await.unwrap());
        drop(store);

        let store = reopen_with(&path, || Clock::new(stepped));
        let retry = store.claim(&key, &fingerprint, Owner::new(), lease, None).await;
        assert!(matches!(retry, Ok(Claim::Completed { .. })), "{retry:?}");
    }

    #[tokio::test]
    async fn ping_fails_once_the_writer_is_gone() {
        let dir = scratch();
        let mut store = EmbeddedStore::open(&dir.path().join("p.redb")).unwrap();
        store.ping().await.unwrap();
        // A writer that died: its end of the queue is dropped. Reads of the
        // file still work, but no claim would be answered.
        let (ops, gone) = std_mpsc::sync_channel(1);
        drop(gone);
        store.ops = ops;
        assert!(matches!(store.ping().await, Err(StoreError::Unavailable(_))));
    }

    /// A seal ends a segment's entries and names the next segment;
    /// nothing after it is read.
    #[test]
    fn a_sealed_segment_names_the_next() {
        let (mut log, mut link) = (Vec::new(), 0);
        Wal::encode(&mut log, (7, &mut link), &[1; 32], Some(b"kept"));
        Wal::entry(&mut log, (7, &mut link), &[0; 32], SEALED, &[&8u64.to_le_bytes()]);
        Wal::encode(&mut log, (7, &mut link), &[2; 32], Some(b"after"));
        let (replayed, damaged, sealed) = Wal::replayable(&log, 7, true);
        assert_eq!(replayed, vec![(&[1; 32], Some(&b"kept"[..]))]);
        assert_eq!((damaged, sealed), (vec![], Some(8)));
    }

    #[test]
    fn log_entries_round_trip_and_stop_at_a_torn_stale_or_damaged_one() {
        let (mut log, mut link) = (Vec::new(), 0);
        Wal::encode(&mut log, (7, &mut link), &[1; 32], Some(b"first"));
        let first = log.len();
        Wal::encode(&mut log, (7, &mut link), &[2; 32], None);
        let whole = log.len();
        Wal::encode(&mut log, (7, &mut link), &[3; 32], Some(b"torn"));
        let entries: Vec<_> = Wal::entries(&log, 7, true).collect();
        assert_eq!(
            entries,
            vec![
                (&[1; 32], Some(&b"first"[..])),
                (&[2; 32], None),
                (&[3; 32], Some(&b"torn"[..]))
            ]
        );

        // Cut in the middle of the last entry, or a flipped bit: it is ignored.
        assert_eq!(Wal::entries(&log[..log.len() - 2], 7, true).count(), 2);
        let mut damaged = log.clone();
        damaged[whole + 40] ^= 1;
        assert_eq!(Wal::entries(&damaged, 7, true).count(), 2);
        // A recycled segment: entries written under another number are stale.
        assert_eq!(Wal::entries(&log, 8, true).count(), 0);
        // Zeros (a fresh segment's tail) end it too.
        let mut padded = log.clone();
        padded.extend_from_slice(&[0; 64]);
        assert_eq!(Wal::entries(&padded, 7, true).count(), 3);
        // A later life under the same number (a restored file's numbers
        // repeat) whose last entry ends where an earlier life's did: what
        // follows is the earlier life's, and not read.
        let (mut later, mut link) = (Vec::new(), 0);
        Wal::encode(&mut later, (7, &mut link), &[9; 32], Some(b"later"));
        assert_eq!(later.len(), first);
        later.extend_from_slice(&log[first..]);
        let entries: Vec<_> = Wal::entries(&later, 7, true).collect();
        assert_eq!(entries, vec![(&[9; 32], Some(&b"later"[..]))]);
        // Nor when replay looks past damage: the earlier life's next entry
        // chains from the one before it, as after a flipped bit, and so
        // stops replay rather than being replayed.
        let (replayed, damaged, _) = Wal::replayable(&later, 7, true);
        assert_eq!(replayed, vec![(&[9; 32], Some(&b"later"[..]))]);
        assert_eq!(damaged, vec![(first, false)]);
    }

    /// Damage inside a segment is told apart from a torn or stale tail,
    /// which ends every segment but the newest. An entry damaged in its
    /// checksum or length is read whole, the entry after it vouching for
    /// it, and replay goes on; one damaged in its body stops it.
    #[test]
    fn damage_inside_a_segment_is_found_and_read_past_where_it_can_be() {
        let keys = |replayed: Vec<Entry<'_>>| replayed.iter().map(|(k, _)| k[0]).collect::<Vec<_>>();
        for chained in [true, false] {
            let (mut log, mut link) = (Vec::new(), 0);
            let mut starts = Vec::new();
            for i in 0..4u8 {
                starts.push(log.len());
                if chained {
                    Wal::encode(&mut log, (5, &mut link), &[i; 32], Some(b"value"));
                } else {
                    let start = log.len();
                    Wal::encode(&mut log, (5, &mut 0), &[i; 32], Some(b"value"));
                    let crc = Wal::crc(5, None, &log[start + 8..]);
                    log[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
                }
            }
            let whole = log.clone();
            log.extend_from_slice(&[0; 64]);
            let (replayed, damaged, _) = Wal::replayable(&log, 5, chained);
            assert_eq!((keys(replayed), damaged), (vec![0, 1, 2, 3], vec![]), "a zeroed tail");
            // A torn last entry, then zeros or an older life's bytes.
            let mut torn = whole[..starts[3] + 20].to_vec();
            torn.extend_from_slice(&[0; 64]);
            let (replayed, damaged, _) = Wal::replayable(&torn, 5, chained);
            assert_eq!((keys(replayed), damaged), (vec![0, 1, 2], vec![]), "a torn tail");
            let (replayed, damaged, _) = Wal::replayable(&whole, 6, chained);
            assert_eq!((replayed.len(), damaged), (0, vec![]), "another segment's entries");
            // The last entry's length: as good as torn.
            let mut last = whole.clone();
            last[starts[3]] ^= 1;
            let (replayed, damaged, _) = Wal::replayable(&last, 5, chained);
            assert_eq!(
                (keys(replayed), damaged),
                (vec![0, 1, 2], vec![]),
                "the last entry's length"
            );
            // A bit of a body stops replay; of a checksum or a length
            // (made one more or less, or past the segment's end), read
            // whole where chained (where not, nothing vouches for it); two.
            let body = (starts[1] + 43, 1);
            let checksum = (starts[1] + 5, 1);
            let (shorter, longer, past) = ((starts[1], 1), (starts[1], 2), (starts[1] + 3, 0x80));
            let stopped = (vec![0], vec![(starts[1], false)]);
            let read_whole = if chained {
                (vec![0, 1, 2, 3], vec![(starts[1], true)])
            } else {
                stopped.clone()
            };
            let two = if chained {
                (vec![0, 1, 2, 3], vec![(starts[0], true), (starts[2], true)])
            } else {
                (vec![], vec![(starts[0], false)])
            };
            for (flips, expected) in [
                (vec![body], stopped.clone()),
                (vec![checksum], read_whole.clone()),
                (vec![shorter], read_whole.clone()),
                (vec![longer], read_whole.clone()),
                (vec![past], read_whole.clone()),
                (vec![(starts[0] + 5, 1), (starts[2] + 3, 0x80)], two),
            ] {
                let mut flipped = whole.clone();
                for &(at, flip) in &flips {
                    flipped[at] ^= flip;
                }
                flipped.extend_from_slice(&[0; 64]);
                let (replayed, damaged, _) = Wal::replayable(&flipped, 5, chained);
                assert_eq!((keys(replayed), damaged), expected, "chained {chained}, {flips:?}");
            }
        }
    }

    #[test]
    fn segments_are_recycled_and_a_reopened_store_ignores_stale_entries() {
        let dir = scratch();
        let path = dir.path().join("s.redb");
        let mut wal = Wal::create(&path, 1).unwrap();
        let (mut log, mut link) = (Vec::new(), 0);
        Wal::encode(&mut log, (1, &mut link), &[1; 32], Some(b"old"));
        wal.append(&log, link).unwrap();
        Wal::retire(&path, [1]).unwrap();
        Wal::top_up(&path);
        assert!(Wal::segments(&path).unwrap().is_empty());
        let spares = Wal::numbered(&path, "-wal-spare.").unwrap();
        assert_eq!(spares.len(), SPARES, "the retired segment and new ones are spares");

        let wal = Wal::create(&path, 2).unwrap();
        assert_eq!(
            std::fs::metadata(Wal::segment_path(&path, 2)).unwrap().len(),
            SEGMENT_BYTES
        );
        drop(wal);
        let bytes = std::fs::read(Wal::segment_path(&path, 2)).unwrap();
        assert_eq!(
            Wal::entries(&bytes, 2, true).count(),
            0,
            "what segment 1 wrote is not segment 2's"
        );

        // A spare that was segment 3 in another life (a restored file's
        // numbers repeat), made segment 3 again: its old chain is not
        // read, though this life has written nothing yet.
        let (mut log, mut link) = (Vec::new(), 0);
        Wal::encode(&mut log, (3, &mut link), &[3; 32], Some(b"other life"));
        let mut wal = Wal::create(&path, 3).unwrap();
        wal.append(&log, link).unwrap();
        drop(wal);
        Wal::retire(&path, [2, 3]).unwrap();
        let spare = Wal::numbered(&path, "-wal-spare.").unwrap().pop().unwrap().1;
        assert_eq!(Wal::entries(&std::fs::read(&spare).unwrap(), 3, true).count(), 1);
        for (_, other) in Wal::numbered(&path, "-wal-spare.").unwrap() {
            if other != spare {
                fs::remove_file(other).unwrap();
            }
        }
        drop(Wal::create(&path, 3).unwrap());
        let bytes = std::fs::read(Wal::segment_path(&path, 3)).unwrap();
        assert_eq!(
            Wal::entries(&bytes, 3, true).count(),
            0,
            "an earlier life's chain was read"
        );
    }

    #[tokio::test]
    async fn a_store_opens_and_works_when_no_spare_segment_can_be_made() {
        let dir = scratch();
        let path = dir.path().join("n.redb");
        // The first spare's temporary name is taken by a directory, so
        // making it fails, as on a full disk.
        fs::create_dir(Wal::named(&path, "-wal-spare.0.new")).unwrap();
        let store = EmbeddedStore::open(&path).unwrap();
        assert!(Wal::numbered(&path, "-wal-spare.").unwrap().is_empty());
        let (key, owner) = (RecordKey([6; 32]), Owner::new());
        let claimed = store.claim(&key, &Fingerprint([1; 32]), owner, Duration::from_secs(30), None);
        assert_eq!(claimed.await.unwrap(), Claim::Claimed);
        store.ping().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_log_grows_past_its_segment_while_no_new_one_can_be_made() {
        let dir = scratch();
        let path = dir.path().join("g.redb");
        let blocked = [
            Wal::named(&path, "-wal-spare.0.new"),
            Wal::named(&path, "-wal.000002.new"),
        ];
        for name in &blocked {
            fs::create_dir(name).unwrap();
        }
        let store = EmbeddedStore::open(&path).unwrap();
        let body = Bytes::from(vec![b'y'; 100 * 1024]);
        let key = |i: u16| {
            let mut key = [9; 32];
            key[..2].copy_from_slice(&i.to_le_bytes());
            RecordKey(key)
        };
        let (fingerprint, ttl) = (Fingerprint([1; 32]), Duration::from_secs(60));
        // Until the log has outgrown its segment by half the overlay's
        // limit: then the store drains, and takes no new claim.
        let mut acknowledged = 0;
        let refused = loop {
            assert!(acknowledged < 1000, "the log grew without bound");
            let owner = Owner::new();
            match store.claim(&key(acknowledged), &fingerprint, owner, ttl, None).await {
                Ok(claimed) => assert_eq!(claimed, Claim::Claimed),
                Err(refused) => break refused,
            }
            assert!(
                store
                    .complete(&key(acknowledged), &fingerprint, owner, answer(&body), ttl)
                    .await
                    .unwrap()
            );
            acknowledged += 1;
        };
        let why = std::error::Error::source(&refused)
            .map(ToString::to_string)
            .unwrap_or_default();
        assert!(why.contains("cannot move to a new segment"), "{refused:?}");
        let segments = Wal::segments(&path).unwrap();
        assert_eq!(segments.len(), 1);
        let grown = fs::metadata(&segments[0].1).unwrap().len();
        assert!(grown > SEGMENT_BYTES, "{grown}");
        assert!(grown < SEGMENT_BYTES + OVERLAY_LIMIT as u64, "{grown}");
        drop(store);

        for name in &blocked {
            fs::remove_dir(name).unwrap();
        }
        let store = reopen(&path);
        for i in 0..acknowledged {
            let found = store
                .claim(&key(i), &fingerprint, Owner::new(), ttl, None)
                .await
                .unwrap();
            assert!(matches!(found, Claim::Completed { .. }), "{i} was lost");
        }
    }

    #[tokio::test]
    async fn a_failed_store_refuses_new_claims_and_still_answers_replays() {
        let dir = scratch();
        let store = EmbeddedStore::open(&dir.path().join("r.redb")).unwrap();
        let (done, fingerprint, owner) = (RecordKey([7; 32]), Fingerprint([1; 32]), Owner::new());
        let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
        store.claim(&done, &fingerprint, owner, lease, None).await.unwrap();
        // An answer (not an outcome): only its replay refreshes the TTL,
        // through the writer.
        let outcome = answer(&Bytes::from_static(b"done"));
        assert!(store.complete(&done, &fingerprint, owner, outcome, ttl).await.unwrap());
        let held = RecordKey([8; 32]);
        store
            .claim(&held, &fingerprint, Owner::new(), lease, None)
            .await
            .unwrap();

        store.shared.fail("a write failed (in a test)".into());
        assert!(store.ping().await.is_err());
        let new = store.claim(&RecordKey([9; 32]), &fingerprint, Owner::new(), lease, None);
        assert!(new.await.is_err(), "a new claim is taken by a failed store");
        // A replay whose TTL would be refreshed goes through the writer; the
        // refresh is not logged, the answer stands.
        let replay = store.claim(&done, &fingerprint, Owner::new(), lease, Some(ttl));
        assert!(matches!(replay.await.unwrap(), Claim::Completed { .. }));
        let conflict = store.claim(&held, &fingerprint, Owner::new(), lease, None);
        assert!(matches!(conflict.await.unwrap(), Claim::InFlight { .. }));
    }

    /// A file lost (removed, or emptied) beside the log of an earlier store
    /// is not made anew: the records already in it would be forgotten.
    #[tokio::test]
    async fn a_lost_file_beside_its_log_is_refused() {
        let dir = scratch();
        let path = dir.path().join("lost.redb");
        let store = EmbeddedStore::open(&path).unwrap();
        let (key, owner) = (RecordKey([30; 32]), Owner::new());
        let claim = store.claim(&key, &Fingerprint([1; 32]), owner, Duration::from_secs(30), None);
        assert_eq!(claim.await.unwrap(), Claim::Claimed);
        drop(store);
        // Once the writer has let go of the file: waited for by redb's
        // own open, whose drop lets go at once, where a store opened to
        // see could still write the file from its threads as it is emptied.
        drop(reopen_db(&path));

        fs::write(&path, b"").unwrap();
        let Err(refused) = EmbeddedStore::open(&path) else {
            panic!("an emptied file was made anew");
        };
        let refused = crate::telemetry::error_chain(&refused);
        assert!(refused.contains("missing or empty"), "{refused}");
        fs::remove_file(&path).unwrap();
        assert!(EmbeddedStore::open(&path).is_err(), "a removed file was made anew");
        // Without the segments, a new store it is.
        for (_, segment) in Wal::segments(&path).unwrap() {
            fs::remove_file(segment).unwrap();
        }
        assert!(EmbeddedStore::open(&path).is_ok());
    }

    /// The newest segment, made since the last checkpoint landed, is not
    /// yet recorded as made in the file; the segment before it, sealed
    /// when the log moved on, says it was. Lost (a crash while a
    /// checkpoint hangs, then the segment deleted), it is refused by name
    /// as any other missing segment: opened over, the claim it held would
    /// be claimed again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_newest_segment_missing_is_refused_before_a_checkpoint_records_it() {
        let dir = scratch();
        let (fingerprint, lease) = (Fingerprint([1; 32]), Duration::from_secs(30));
        let (first, second) = (RecordKey([50; 32]), RecordKey([51; 32]));
        let (copy, segments) = crashed_after_a_roll(dir.path(), &first, &second).await;
        let (newest, _) = segments.last().unwrap();
        let newest = Wal::segment_path(&copy, *newest);
        let saved = fs::read(&newest).unwrap();
        fs::remove_file(&newest).unwrap();
        let refused = match EmbeddedStore::open(&copy) {
            Ok(_) => panic!("opened without {}", newest.display()),
            Err(error) => crate::telemetry::error_chain(&error),
        };
        let name = newest.file_name().unwrap().to_string_lossy().into_owned();
        assert!(refused.contains(&name) && refused.contains("touch"), "{refused}");
        // Restored, it is replayed: both claims stand.
        fs::write(&newest, saved).unwrap();
        let store = reopen(&copy);
        for key in [&first, &second] {
            let claim = store.claim(key, &fingerprint, Owner::new(), lease, None);
            assert!(matches!(claim.await.unwrap(), Claim::InFlight { .. }));
        }
    }

    /// A segment whose last entry (here its only claim) is damaged in both
    /// its length and its checksum reads as if it ended there, and its
    /// seal is lost with it; the segment after it, holding entries, says
    /// the log moved on. The damage is said (the segment kept aside), not
    /// read as a torn end in silence.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_segment_that_lost_its_seal_before_one_with_entries_is_kept_aside() {
        use std::os::unix::fs::FileExt;
        let dir = scratch();
        let (fingerprint, lease) = (Fingerprint([1; 32]), Duration::from_secs(30));
        let (first, second) = (RecordKey([60; 32]), RecordKey([61; 32]));
        let (copy, segments) = crashed_after_a_roll(dir.path(), &first, &second).await;
        // The sealed one's first entry: length and checksum zeroed.
        let (sealed, _) = segments[segments.len() - 2];
        let damaged = Wal::segment_path(&copy, sealed);
        File::options()
            .write(true)
            .open(&damaged)
            .unwrap()
            .write_all_at(&[0; 8], 0)
            .unwrap();
        let store = reopen(&copy);
        assert!(!damaged.exists(), "the damaged segment was taken as whole");
        assert!(Wal::named(&damaged, ".damaged").exists());
        let claim = store.claim(&second, &fingerprint, Owner::new(), lease, None);
        assert!(matches!(claim.await.unwrap(), Claim::InFlight { .. }));
    }

    /// A log segment that records may be in, missing (deleted, or a
    /// backup of the file restored without its log), is refused by name
    /// rather than opened over, which would forget what it held; made
    /// empty by hand, the store opens without it (and does not keep it as
    /// a spare, which must be zero-filled).
    #[tokio::test]
    async fn a_missing_log_segment_is_refused_until_restored_or_made_empty() {
        let dir = scratch();
        let path = dir.path().join("m.redb");
        let (fingerprint, lease) = (Fingerprint([1; 32]), Duration::from_secs(30));
        let (first, second) = (RecordKey([40; 32]), RecordKey([41; 32]));
        let store = EmbeddedStore::open(&path).unwrap();
        let claim = store.claim(&first, &fingerprint, Owner::new(), lease, None);
        assert_eq!(claim.await.unwrap(), Claim::Claimed);
        drop(store);
        // Reopened, the first claim is replayed into the file.
        let store = reopen(&path);
        let claim = store.claim(&second, &fingerprint, Owner::new(), lease, None);
        assert_eq!(claim.await.unwrap(), Claim::Claimed);
        drop(store);
        let (_, last) = Wal::segments(&path).unwrap().pop().unwrap();
        fs::remove_file(&last).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let refused = loop {
            match EmbeddedStore::open(&path) {
                Ok(_) => panic!("opened without {}", last.display()),
                Err(error) if crate::telemetry::error_chain(&error).contains("is missing") => {
                    break crate::telemetry::error_chain(&error);
                }
                Err(error) => assert!(Instant::now() < deadline, "{error}"),
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let name = last.file_name().unwrap().to_string_lossy().into_owned();
        assert!(refused.contains(&name) && refused.contains("touch"), "{refused}");
        File::create(&last).unwrap();
        // No spares: the touched segment, retired, would be the first,
        // and the new segment made from it.
        for (_, spare) in Wal::numbered(&path, "-wal-spare.").unwrap() {
            fs::remove_file(spare).unwrap();
        }
        let store = reopen(&path);
        let claim = store.claim(&first, &fingerprint, Owner::new(), lease, None);
        assert!(matches!(claim.await.unwrap(), Claim::InFlight { .. }));
        drop(store);
        // Neither a spare nor the segment made from one is short.
        let spares = Wal::numbered(&path, "-wal-spare.").unwrap();
        for (_, file) in spares.iter().chain(&Wal::segments(&path).unwrap()) {
            assert!(fs::metadata(file).unwrap().len() >= SEGMENT_BYTES, "{}", file.display());
        }
    }

    /// Which segments must be there: every one between two that are, and
    /// the first to replay when the file says it was made (a store that
    /// stopped before it made it, after it committed its number, is not
    /// refused).
    #[test]
    fn a_segment_is_missing_between_two_or_where_the_file_says_it_was_made() {
        let path = Path::new("/nowhere/s.redb");
        let at = |ns: &[u64]| ns.iter().map(|&n| (n, Wal::segment_path(path, n))).collect::<Vec<_>>();
        let missing = |ns: &[u64], applied_below, made| Wal::none_missing(path, &at(ns), applied_below, made);
        assert!(missing(&[], 0, None).is_ok(), "a new store");
        assert!(missing(&[3, 4], 3, Some(3)).is_ok());
        assert!(missing(&[1, 3, 4], 3, Some(3)).is_ok(), "retired, not yet removed");
        assert!(missing(&[], 3, Some(2)).is_ok(), "stopped before it was made");
        assert!(missing(&[4, 5], 3, None).is_ok(), "a file from before `made`");
        // Named, and, where none after the gap is there, said to be
        // perhaps the first of more.
        for (ns, applied_below, made, name, open_ended) in [
            (&[][..], 3, Some(3), "s.redb-wal.000003", true),
            (&[4, 5][..], 3, Some(3), "s.redb-wal.000003", false),
            (&[3, 5][..], 3, Some(3), "s.redb-wal.000004", false),
            (&[3, 5][..], 3, None, "s.redb-wal.000004", false),
        ] {
            let refused = missing(ns, applied_below, made).unwrap_err();
            assert!(refused.contains(name), "{ns:?}: {refused}");
            assert_eq!(refused.contains("any made after it"), open_ended, "{ns:?}: {refused}");
        }
        // A gap is named whole.
        let refused = missing(&[3, 6], 3, Some(3)).unwrap_err();
        assert!(
            refused.contains("s.redb-wal.000004 to /nowhere/s.redb-wal.000005"),
            "{refused}"
        );
    }

    /// A segment damaged in an entry's body stops replay there: the
    /// entries before it are replayed, and the segment is kept aside as
    /// it was. Damaged in an entry's checksum, the entry is read whole
    /// (the entry after it vouches for it) and replay goes on.
    #[tokio::test]
    async fn a_damaged_log_segment_is_replayed_up_to_the_damage_or_past_it_when_it_can_be() {
        for (flip_at, read_whole) in [(44, false), (5, true)] {
            let dir = scratch();
            let path = dir.path().join("d.redb");
            let (fingerprint, lease) = (Fingerprint([1; 32]), Duration::from_secs(30));
            let keys: Vec<RecordKey> = (50..54).map(|i| RecordKey([i; 32])).collect();
            // The claims' entries in the last segment, in the order written:
            // a checkpoint due meanwhile (every 200 ms here) may take them
            // into the file first, and the claims are then made again.
            let (segment, bytes, order) = loop {
                let store = reopen(&path);
                let claims = keys
                    .iter()
                    .map(|key| store.claim(key, &fingerprint, Owner::new(), lease, None));
                let claims = futures_util::future::join_all(claims).await;
                drop(store);
                let (_, segment) = Wal::segments(&path).unwrap().pop().unwrap();
                let bytes = fs::read(&segment).unwrap();
                let at = |key: &RecordKey| bytes.windows(32).position(|w| w == key.0);
                let mut order: Vec<_> = keys
                    .iter()
                    .enumerate()
                    .filter_map(|(i, key)| Some((at(key)?, i)))
                    .collect();
                if order.len() == keys.len() && claims.iter().all(|c| matches!(c, Ok(Claim::Claimed))) {
                    order.sort();
                    break (segment, bytes, order);
                }
                // Made again under other keys' names would not do: afresh.
                drop(fs::remove_dir_all(dir.path()).and_then(|()| fs::create_dir(dir.path())));
            };
            // The second entry written, its body or its checksum.
            let (key_at, damaged) = order[1];
            let mut flipped = bytes.clone();
            flipped[key_at - 8 + flip_at] ^= 1;
            fs::write(&segment, &flipped).unwrap();
            let store = reopen(&path);
            for (rank, &(_, i)) in order.iter().enumerate() {
                let claim = store
                    .claim(&keys[i], &fingerprint, Owner::new(), lease, None)
                    .await
                    .unwrap();
                let replayed = read_whole || rank < 1;
                assert_eq!(
                    claim != Claim::Claimed,
                    replayed,
                    "key {i} (written {rank}th; damaged {damaged}): {claim:?}"
                );
            }
            let aside = Wal::named(&segment, ".damaged");
            if read_whole {
                assert!(!aside.exists(), "nothing lost, nothing kept aside");
            } else {
                assert_eq!(fs::read(&aside).unwrap(), flipped, "kept aside as it was");
            }
        }
    }

    /// Spares an earlier run left are not reused: one may hold an earlier
    /// life's entries under a number this run will use again (after a
    /// restore), which an identical first entry would chain on into.
    #[tokio::test]
    async fn spares_an_earlier_run_left_are_not_reused() {
        let dir = scratch();
        let path = dir.path().join("s.redb");
        drop(EmbeddedStore::open(&path).unwrap());
        drop(reopen(&path));
        // A spare as an earlier life left it, marked.
        let marker = b"an earlier life's entries";
        let spares = Wal::numbered(&path, "-wal-spare.").unwrap();
        assert!(!spares.is_empty(), "no spare to mark");
        for (_, spare) in &spares {
            let mut bytes = fs::read(spare).unwrap();
            bytes[4096..4096 + marker.len()].copy_from_slice(marker);
            fs::write(spare, bytes).unwrap();
        }
        drop(reopen(&path));
        let files = Wal::numbered(&path, "-wal-spare.").unwrap();
        for (_, file) in files.iter().chain(&Wal::segments(&path).unwrap()) {
            let bytes = fs::read(file).unwrap();
            assert!(
                !bytes.windows(marker.len()).any(|w| w == marker),
                "{} was reused",
                file.display()
            );
        }
    }

    /// A store whose file cannot be written takes no new claims, but the
    /// claims it holds still settle into the log, which a restart replays:
    /// an answer given meanwhile is not run again after the restart.
    #[tokio::test]
    async fn a_draining_store_settles_the_claims_it_holds_into_its_log() {
        let dir = scratch();
        let path = dir.path().join("d.redb");
        let store = EmbeddedStore::open(&path).unwrap();
        let (fingerprint, lease, ttl) = (Fingerprint([1; 32]), Duration::from_secs(30), Duration::from_secs(60));
        let (done, released) = ((RecordKey([20; 32]), Owner::new()), (RecordKey([21; 32]), Owner::new()));
        for (key, owner) in [done, released] {
            let claim = store.claim(&key, &fingerprint, owner, lease, None).await;
            assert_eq!(claim.unwrap(), Claim::Claimed);
        }

        // A checkpoint lands with both claims held: they stay in the
        // overlay, so settling them never reads the file (which redb refuses
        // to read after a failed write).
        tokio::time::sleep(CHECKPOINT_EVERY + Duration::from_millis(50)).await;
        assert!(store.renew(&done.0, done.1, lease).await.unwrap());
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            {
                let overlay = lock(&store.shared.overlay);
                if overlay.generation > 0 {
                    assert!(overlay.active.contains_key(&done.0.0) && overlay.active.contains_key(&released.0.0));
                    break;
                }
            }
            assert!(Instant::now() < deadline, "no checkpoint landed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        store.shared.drain("a write to the file failed (in a test)".into());
        assert!(store.ping().await.is_err());
        let new = store.claim(&RecordKey([22; 32]), &fingerprint, Owner::new(), lease, None);
        assert!(matches!(new.await, Err(StoreError::NotSent(_))));
        let outcome = answer(&Bytes::from_static(b"settled"));
        assert!(
            store
                .complete(&done.0, &fingerprint, done.1, outcome, ttl)
                .await
                .unwrap()
        );
        assert!(store.renew(&released.0, released.1, lease).await.unwrap());
        assert!(store.release(&released.0, released.1).await.unwrap());
        drop(store);

        let store = reopen(&path);
        let replay = store.claim(&done.0, &fingerprint, Owner::new(), lease, None).await;
        let Ok(Claim::Completed { outcome, .. }) = replay else {
            panic!("the completion was lost: {replay:?}");
        };
        assert!(matches!(outcome, Outcome::Response(r) if &r.body()[..] == b"settled"));
        let free = store.claim(&released.0, &fingerprint, Owner::new(), lease, None).await;
        assert_eq!(free.unwrap(), Claim::Claimed);
    }

    /// Stalls the writer of `store`: the checkpoint thread hangs on the
    /// write transaction returned (hold it), and the overlay is filled past
    /// its limit, so the writer waits for that checkpoint and answers
    /// nothing.
    async fn stall(store: &EmbeddedStore) -> redb::WriteTransaction {
        // The checkpoint thread waits for this transaction: checkpoints hang.
        let blocker = store.shared.db.begin_write().unwrap();
        let body = Bytes::from(vec![b'z'; 100 * 1024]);
        let (fingerprint, ttl) = (Fingerprint([1; 32]), Duration::from_secs(60));
        let put = |i: u8| {
            let outcome = answer(&body);
            async move {
                let (key, owner) = (RecordKey([i; 32]), Owner::new());
                store.claim(&key, &fingerprint, owner, ttl, None).await.unwrap();
                assert!(store.complete(&key, &fingerprint, owner, outcome, ttl).await.unwrap());
            }
        };
        // One checkpoint due and handed over (it hangs), then the overlay
        // past its limit: the writer waits for that checkpoint, and a write
        // gets no answer.
        put(0).await;
        tokio::time::sleep(CHECKPOINT_EVERY + Duration::from_millis(50)).await;
        put(1).await;
        tokio::time::sleep(CHECKPOINT_EVERY + Duration::from_millis(50)).await;
        // Waiting, as the writer's own test of it reads: a checkpoint not
        // landed, and the overlay past its limit. (Not a put that takes
        // long: on a loaded machine a sync may, and the writer then goes
        // on answering.)
        let waits = || {
            let overlay = lock(&store.shared.overlay);
            !overlay.frozen.is_empty() && overlay.active_bytes >= OVERLAY_LIMIT
        };
        let mut next = 2;
        while !waits() {
            let _ = tokio::time::timeout(Duration::from_millis(500), put(next)).await;
            next += 1;
            assert!(next < 100, "the writer never waited");
        }
        blocker
    }

    /// A writer that has stalled takes operations up to its queue's bound;
    /// past it, one is refused at once, as never sent.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_writer_refuses_operations_past_its_queue_at_once() {
        let dir = scratch();
        let store = EmbeddedStore::open(&dir.path().join("q.redb")).unwrap();
        let blocker = stall(&store).await;
        let (fingerprint, lease) = (Fingerprint([1; 32]), Duration::from_secs(60));
        let mut queued = 0usize;
        let refused = loop {
            let mut key = RecordKey([0; 32]);
            key.0[..8].copy_from_slice(&(queued as u64 + 1000).to_be_bytes());
            let claim = store.claim(&key, &fingerprint, Owner::new(), lease, None);
            match futures_util::FutureExt::now_or_never(claim) {
                // Queued: its caller gives up.
                None => queued += 1,
                Some(answer) => break answer,
            }
            assert!(queued <= QUEUE_OPS, "the queue took more than {QUEUE_OPS}");
        };
        assert!(matches!(refused, Err(StoreError::NotSent(_))), "{refused:?}");
        assert!(queued >= QUEUE_OPS - 1, "refused after {queued}");
        store.shared.fail("stopped (in a test)".into());
        blocker.abort().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failure_lets_go_of_a_writer_waiting_on_a_checkpoint() {
        let dir = scratch();
        let store = EmbeddedStore::open(&dir.path().join("w.redb")).unwrap();
        let blocker = stall(&store).await;
        let (fingerprint, ttl) = (Fingerprint([1; 32]), Duration::from_secs(60));
        let claim = |i: u8| {
            let store = &store;
            async move {
                let key = RecordKey([i; 32]);
                store.claim(&key, &fingerprint, Owner::new(), ttl, None).await
            }
        };

        store.shared.fail("a checkpoint failed (in a test)".into());
        let refused = tokio::time::timeout(Duration::from_secs(2), claim(52)).await;
        assert!(refused.expect("the writer still waits").is_err());
        blocker.abort().unwrap();
    }

    /// A claim in the same batch as the completion it finds is answered
    /// from that completion only once it is in the log: when the log
    /// write fails, the retry must not replay an answer a restart forgets.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_is_not_answered_from_a_completion_the_log_lost() {
        let dir = scratch();
        let store = EmbeddedStore::open(&dir.path().join("l.redb")).unwrap();
        let (key, fingerprint, owner) = (RecordKey([60; 32]), Fingerprint([1; 32]), Owner::new());
        let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
        assert_eq!(
            store.claim(&key, &fingerprint, owner, lease, None).await.unwrap(),
            Claim::Claimed
        );
        let blocker = stall(&store).await;
        // Queued behind the stalled writer, the two go in one batch; the
        // store fails before it is logged.
        let outcome = answer(&Bytes::from_static(b"lost"));
        let completed = store.complete(&key, &fingerprint, owner, outcome, ttl);
        let retry = store.claim(&key, &fingerprint, Owner::new(), lease, None);
        let failed = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            store.shared.fail("a log write failed (in a test)".into());
        };
        let (completed, retry, ()) = tokio::join!(completed, retry, failed);
        assert!(completed.is_err());
        assert!(retry.is_err(), "the retry was answered {retry:?}");
        blocker.abort().unwrap();
    }

    #[test]
    fn a_segment_that_cannot_be_made_leaves_no_temporary_file() {
        let dir = scratch();
        // Renaming onto a directory that is not empty fails after the fill.
        let target = dir.path().join("s.redb-wal-spare.0");
        fs::create_dir(&target).unwrap();
        fs::write(target.join("occupied"), b"").unwrap();
        assert!(Wal::zero_filled(&target).is_err());
        assert!(!Wal::named(&target, ".new").exists());
    }

    /// Zero-fills a crash cut short leave their temporary files: opening
    /// the store removes them, and nothing else beside it.
    #[tokio::test]
    async fn temporary_files_a_crash_left_are_removed_on_open() {
        let dir = scratch();
        let path = dir.path().join("t.redb");
        drop(EmbeddedStore::open(&path).unwrap());
        let left = ["t.redb-wal.000009.new", "t.redb-wal-spare.7.new"];
        let kept = ["t.redb-wal.x.new", "other.redb-wal.000009.new", "t.redb.new"];
        for name in left.iter().chain(&kept) {
            fs::write(dir.path().join(name), b"partly zero-filled").unwrap();
        }
        let store = reopen(&path);
        for name in left {
            assert!(!dir.path().join(name).exists(), "{name} is still there");
        }
        for name in kept {
            assert!(dir.path().join(name).exists(), "{name} was removed");
        }
        assert!(store.ping().await.is_ok());
    }

    /// What a crash leaves of a store in `dir` that claimed `first`, moved
    /// its log on to a new segment while its checkpoint hung (so the file
    /// never recorded it), and claimed `second` there: a copy of the file
    /// (as of its last commit) and of the log, in `dir/crashed`; with the
    /// segments copied, oldest first.
    async fn crashed_after_a_roll(dir: &Path, first: &RecordKey, second: &RecordKey) -> (PathBuf, Vec<(u64, PathBuf)>) {
        let path = dir.join("s.redb");
        let (fingerprint, lease) = (Fingerprint([1; 32]), Duration::from_secs(30));
        let store = EmbeddedStore::open(&path).unwrap();
        // Checkpoints hang on this transaction: none lands from here on.
        let blocker = store.shared.db.begin_write().unwrap();
        let claim = store.claim(first, &fingerprint, Owner::new(), lease, None);
        assert_eq!(claim.await.unwrap(), Claim::Claimed);
        let before = Wal::segments(&path).unwrap();
        // A checkpoint falls due: the log moves on to a new segment.
        let deadline = Instant::now() + Duration::from_secs(10);
        while Wal::segments(&path).unwrap().len() == before.len() {
            assert!(Instant::now() < deadline, "the log never moved on");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let claim = store.claim(second, &fingerprint, Owner::new(), lease, None);
        assert_eq!(claim.await.unwrap(), Claim::Claimed);
        let crashed = dir.join("crashed");
        fs::create_dir(&crashed).unwrap();
        let copy = crashed.join("s.redb");
        fs::copy(&path, &copy).unwrap();
        let segments = Wal::segments(&path).unwrap();
        for (n, segment) in &segments {
            fs::copy(segment, Wal::segment_path(&copy, *n)).unwrap();
        }
        drop(blocker);
        drop(store);
        (copy, segments)
    }

    /// Opens `path` once the last store on it has let go of the file.
    fn reopen(path: &Path) -> EmbeddedStore {
        reopen_with(path, || Clock::new(wall_ms))
    }

    /// [`reopen`] with the clock `clock` makes.
    fn reopen_with(path: &Path, clock: impl Fn() -> Clock) -> EmbeddedStore {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match EmbeddedStore::open_with(path, clock()) {
                Ok(store) => return store,
                Err(error) if Instant::now() > deadline => panic!("cannot reopen: {error}"),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// Waits until a checkpoint has landed and left the overlay empty.
    async fn checkpointed(store: &EmbeddedStore) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            {
                let overlay = lock(&store.shared.overlay);
                if overlay.active.is_empty() && overlay.frozen.is_empty() {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "no checkpoint");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Reads of the file wait for one of [`FILE_READS`] places: a disk
    /// that hangs ties up no more threads than that.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_of_the_file_wait_for_a_place() {
        let dir = scratch();
        let store = EmbeddedStore::open(&dir.path().join("r.redb")).unwrap();
        let (key, fingerprint, owner) = (RecordKey([6; 32]), Fingerprint([1; 32]), Owner::new());
        let lease = Duration::from_secs(30);
        store.claim(&key, &fingerprint, owner, lease, None).await.unwrap();
        let ttl = Duration::from_secs(60);
        assert!(
            store
                .complete(&key, &fingerprint, owner, Outcome::Unknown, ttl)
                .await
                .unwrap()
        );
        checkpointed(&store).await;
        // Every place taken (as by reads hung on the disk).
        let taken = store
            .shared
            .reads
            .clone()
            .acquire_many_owned(FILE_READS as u32)
            .await
            .unwrap();
        let waiting = store.inspect(&key);
        tokio::pin!(waiting);
        let early = tokio::time::timeout(Duration::from_millis(300), &mut waiting).await;
        assert!(early.is_err(), "read the file with no place free");
        drop(taken);
        let found = waiting.await.unwrap();
        assert!(matches!(found, Some((Record::Completed { .. }, _))), "{found:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_in_the_file_are_found_through_the_key_filter() {
        let dir = scratch();
        let path = dir.path().join("f.redb");
        let (kept, purged, fingerprint) = (RecordKey([3; 32]), RecordKey([4; 32]), Fingerprint([1; 32]));
        let store = EmbeddedStore::open(&path).unwrap();
        for key in [&kept, &purged] {
            let owner = Owner::new();
            let lease = Duration::from_secs(30);
            assert_eq!(
                store.claim(key, &fingerprint, owner, lease, None).await.unwrap(),
                Claim::Claimed
            );
            let ttl = Duration::from_secs(60);
            assert!(
                store
                    .complete(key, &fingerprint, owner, Outcome::Unknown, ttl)
                    .await
                    .unwrap()
            );
        }
        checkpointed(&store).await;
        assert!(store.shared.filter.may_hold(&kept.0) && store.shared.filter.may_hold(&purged.0));
        assert!(!store.shared.filter.may_hold(&[5; 32]));
        // Only in the file now: the filter lets the claim read it.
        let again = store.claim(&kept, &fingerprint, Owner::new(), Duration::from_secs(30), None);
        assert!(matches!(again.await.unwrap(), Claim::Completed { .. }));

        assert!(store.purge(&purged).await.unwrap());
        checkpointed(&store).await;
        assert!(
            !store.shared.filter.may_hold(&purged.0),
            "out of the file, out of the filter"
        );
        assert!(store.shared.filter.may_hold(&kept.0));
        drop(store);

        // Reopened, the filter is loaded from the file.
        let store = reopen(&path);
        let deadline = Instant::now() + Duration::from_secs(10);
        while store.shared.filter.may_hold(&[5; 32]) {
            assert!(Instant::now() < deadline, "the filter never loaded");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(store.shared.filter.may_hold(&kept.0) && !store.shared.filter.may_hold(&purged.0));
        let again = store.claim(&kept, &fingerprint, Owner::new(), Duration::from_secs(30), None);
        assert!(matches!(again.await.unwrap(), Claim::Completed { .. }));
        let fresh = store.claim(&purged, &fingerprint, Owner::new(), Duration::from_secs(30), None);
        assert_eq!(fresh.await.unwrap(), Claim::Claimed);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn segments_already_in_the_file_are_never_applied_again() {
        let dir = scratch();
        let path = dir.path().join("a.redb");
        let key = RecordKey([9; 32]);
        let owner = Owner::new();
        let store = EmbeddedStore::open(&path).unwrap();
        assert!(matches!(
            store
                .claim(&key, &Fingerprint([1; 32]), owner, Duration::from_secs(30), None)
                .await
                .unwrap(),
            Claim::Claimed
        ));
        assert!(
            store
                .complete(
                    &key,
                    &Fingerprint([1; 32]),
                    owner,
                    Outcome::Unknown,
                    Duration::from_secs(30)
                )
                .await
                .unwrap()
        );
        drop(store);
        // Reopening applies the log to the file and moves past it.
        drop(reopen(&path));
        // A segment numbered below that, whose removal a crash undid, holds
        // an older change: it must not be applied over the file.
        let mut log = Vec::new();
        Wal::encode(&mut log, (1, &mut 0), &key.0, None);
        std::fs::write(Wal::segment_path(&path, 1), &log).unwrap();
        let store = reopen(&path);
        let (record, _) = store.inspect(&key).await.unwrap().expect("the record survived");
        assert!(matches!(record, Decoded::Completed { .. }));
        assert!(
            Wal::segments(&path).unwrap().iter().all(|(n, _)| *n > 1),
            "the stale segment was retired"
        );
    }

    /// A log written before entries were chained (its file says no log
    /// format) is replayed as it was written, once.
    #[tokio::test]
    async fn a_log_from_before_entries_were_chained_is_replayed() {
        let dir = scratch();
        let path = dir.path().join("u.redb");
        drop(EmbeddedStore::open(&path).unwrap());
        let db = reopen_db(&path);
        let txn = db.begin_write().unwrap();
        txn.open_table(META).unwrap().remove(LOG_FORMAT).unwrap();
        txn.commit().unwrap();
        drop(db);
        // The segment the store would write to next, as the earlier
        // format wrote it: a completed record.
        let (n, segment) = Wal::segments(&path).unwrap().pop().expect("a segment");
        let key = RecordKey([80; 32]);
        let record = codec::completed(&Fingerprint([1; 32]), &Outcome::Unknown);
        let mut body = key.0.to_vec();
        body.push(PUT);
        body.extend_from_slice(&(wall_ms() + 600_000).to_be_bytes());
        body.extend_from_slice(&record);
        let mut log = (body.len() as u32).to_le_bytes().to_vec();
        log.extend_from_slice(&Wal::crc(n, None, &body).to_le_bytes());
        log.extend_from_slice(&body);
        std::fs::write(&segment, &log).unwrap();

        let store = reopen(&path);
        let (found, _) = store.inspect(&key).await.unwrap().expect("the old log was replayed");
        assert!(matches!(found, Decoded::Completed { .. }));
        drop(store);
        let db = reopen_db(&path);
        let format = db
            .begin_read()
            .unwrap()
            .open_table(META)
            .unwrap()
            .get(LOG_FORMAT)
            .unwrap();
        assert_eq!(format.map(|v| v.value()), Some(CHAINED));
    }

    /// redb checks its pages only when it repairs a file: a record whose
    /// bytes changed on the disk under it, after a clean close, is refused
    /// as damaged (503) rather than replayed changed, until a purge frees
    /// its key: whatever its deadline says, which may be the damage. A
    /// record in the format of files from before records were checked is
    /// read as before.
    #[tokio::test]
    async fn a_record_changed_on_the_disk_is_refused_not_replayed() {
        let dir = scratch();
        let path = dir.path().join("k.redb");
        let store = EmbeddedStore::open(&path).unwrap();
        let (damaged, earlier, expired) = (RecordKey([90; 32]), RecordKey([91; 32]), RecordKey([92; 32]));
        let fingerprint = Fingerprint([1; 32]);
        let (lease, ttl, owner) = (Duration::from_secs(30), Duration::from_secs(600), Owner::new());
        store.claim(&damaged, &fingerprint, owner, lease, None).await.unwrap();
        let paid = answer(&Bytes::from_static(b"paid 100"));
        assert!(store.complete(&damaged, &fingerprint, owner, paid, ttl).await.unwrap());
        checkpointed(&store).await;
        drop(store);
        let db = reopen_db(&path);
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(RECORDS).unwrap();
            let mut value = table.get(&damaged.0).unwrap().expect("in the file").value().to_vec();
            assert_eq!(value[8], CHECKED);
            // "paid 109", as redb would read it back.
            *value.last_mut().unwrap() = b'9';
            table.insert(&damaged.0, value.as_slice()).unwrap();
            let mut value = (wall_ms() + 600_000).to_be_bytes().to_vec();
            value.extend_from_slice(&codec::completed(&fingerprint, &answer(&Bytes::from_static(b"old"))));
            table.insert(&earlier.0, value.as_slice()).unwrap();
            // Damaged, its deadline (which might be the damage) past: kept.
            let mut value = (wall_ms() - 1_000).to_be_bytes().to_vec();
            value.extend_from_slice(&[CHECKED, 0, 0, 0, 0]);
            value.extend_from_slice(&codec::completed(&fingerprint, &Outcome::Unknown));
            table.insert(&expired.0, value.as_slice()).unwrap();
        }
        txn.commit().unwrap();
        drop(db);

        let store = reopen(&path);
        let found = store.claim(&damaged, &fingerprint, Owner::new(), lease, None).await;
        assert!(matches!(found, Err(StoreError::Corrupt(_))), "{found:?}");
        let found = store.claim(&earlier, &fingerprint, Owner::new(), lease, None).await;
        assert!(matches!(found, Ok(Claim::Completed { .. })), "{found:?}");
        // Nor does a sweep take it.
        tokio::time::sleep(SWEEP_EVERY + CHECKPOINT_EVERY).await;
        let found = store.claim(&expired, &fingerprint, Owner::new(), lease, None).await;
        assert!(matches!(found, Err(StoreError::Corrupt(_))), "{found:?}");
        // An operator's purge frees a damaged record's key.
        for key in [damaged, expired] {
            assert!(store.purge(&key).await.unwrap());
            let found = store.claim(&key, &fingerprint, Owner::new(), lease, None).await;
            assert!(matches!(found, Ok(Claim::Claimed)), "{found:?}");
        }
    }

    /// The redb file at `path`, once the last store on it has let go.
    fn reopen_db(path: &Path) -> Database {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match Database::open(path) {
                Ok(db) => return db,
                Err(error) if Instant::now() > deadline => panic!("cannot open: {error}"),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batches_of_large_answers_keep_segments_near_their_size() {
        let dir = scratch();
        let path = dir.path().join("big.redb");
        let store = Arc::new(EmbeddedStore::open(&path).unwrap());
        let body = Bytes::from(vec![b'x'; 100 * 1024]);
        for round in 0..10u8 {
            let tasks: Vec<_> = (0..64u8)
                .map(|i| {
                    let (store, body) = (store.clone(), body.clone());
                    tokio::spawn(async move {
                        let (key, owner) = (
                            RecordKey([
                                round, i, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
                                7, 7, 7, 7,
                            ]),
                            Owner::new(),
                        );
                        store
                            .claim(&key, &Fingerprint([1; 32]), owner, Duration::from_secs(30), None)
                            .await
                            .unwrap();
                        let outcome = answer(&body);
                        assert!(
                            store
                                .complete(&key, &Fingerprint([1; 32]), owner, outcome, Duration::from_secs(30))
                                .await
                                .unwrap()
                        );
                    })
                })
                .collect();
            for task in tasks {
                task.await.unwrap();
            }
        }
        let mut files = Wal::segments(&path).unwrap();
        files.extend(Wal::numbered(&path, "-wal-spare.").unwrap());
        assert!(files.len() > 1);
        for (_, file) in files {
            let size = std::fs::metadata(&file).unwrap().len();
            assert!(size <= SEGMENT_BYTES + 200 * 1024, "{} is {size} bytes", file.display());
        }
    }
}
