//! The Redis store: one Redis server or a Redis Cluster, shared by any
//! number of idemgate replicas.
//!
//! One Redis key per record, `<prefix>:{<sha-256 hex>}` (`store.key_prefix`,
//! `idemgate` by default), hash-tagged so a record and everything the
//! scripts touch live in one slot. The value is
//! the [`codec`] record; Redis's own `PX` expiry is the lease or the TTL.
//!
//! Every operation is one round trip. A claim is `SET ... NX PX ... GET`
//! (Redis 7), or, when a replay must refresh the TTL in the same step or
//! the server is older, a Lua script (`EVALSHA`, cached by SHA; sent whole
//! with `EVAL` to a server that lacks it); claims of one request made at
//! once on one thread share one (see [`Claims`]). Completion, release and
//! renewal are scripts that check the owner token first (a completion also
//! lands where the key holds no record). On one
//! server, completions made on a thread in one turn of its runtime share one
//! script call (each still checked against its own owner), which saves
//! Redis the script's fixed cost per completion; a server in cluster mode
//! refuses such a call (`CROSSSLOT`), and then each goes alone. On a
//! Redis Cluster each command goes to the node that serves its key's
//! slot, over the thread's own connection to it ([`super::cluster`]).
//!
//! Replication is asynchronous: with `store.wait_for_replicas`, every
//! batch of commands a connection writes is followed by `WAIT`, and its
//! answers count only once that many replicas hold its writes
//! ([`resp::Target::copied_to`]), so a failover loses no claim or answer
//! a caller was told of. Fewer in time, and the calls fail as unavailable;
//! a primary with fewer replicas connected is warned about at start
//! ([`warn_if_short_of_replicas`]). An answer found by a read, as a
//! completion resent after its connection broke finds its own, counts
//! once a write on it is copied ([`Store::confirm`], `CONFIRM`).
//!
//! Redis must not evict keys (an evicted claim would let a retry through):
//! the store warns about any server whose `maxmemory-policy` is not
//! `noeviction` ([`check_servers`]).
//!
//! Waiting across replicas: a waiter marks the in-flight record as waited
//! on, appending one byte to it (`APPEND` keeps its lease), in the script
//! that reads it. Completion, release and purge read the record anyway to
//! check its owner; only when it carries the mark do they `PUBLISH` the
//! record key on one channel. Each process keeps one subscription to it and
//! wakes its local waiters, re-checking the record at least every second in
//! case a message was lost. Requests that nobody waits on publish nothing
//! and touch no other key. A user the ACL denies the channel still
//! completes (`redis.pcall`); its waiters re-check twice a second.

use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use redis::{RedisError, Script};
use socket2::TcpKeepalive;
use tokio::sync::oneshot;

use super::cluster::Cluster;
use super::codec::{self, Decoded};
use super::resp;
use super::waiters::Waiters;
use super::{Claim, Fingerprint, KeyMap, Outcome, Owner, Record, RecordKey, Store, StoreError, lock};
use crate::clock::coarse_ms;
use crate::telemetry::error_chain;

/// Completions and releases are announced here, payload the record's key.
/// A macro, so the scripts can name it as a literal.
macro_rules! channel {
    () => {
        "idemgate:done"
    };
}
const CHANNEL: &str = channel!();
/// How long data sent to Redis may go unacknowledged by the peer's kernel
/// before the connection counts as dead (`TCP_USER_TIMEOUT`), so it is
/// dropped and made again. Without it a connection whose peer vanished, or
/// whose state a NAT or firewall dropped, fails every command until TCP
/// gives up, about 15 minutes. A slow Redis still acknowledges what it is
/// sent: only a dead path trips this.
pub(super) const DEAD_PATH: Duration = Duration::from_secs(5);

/// An idle connection is probed after this long, then every
/// [`PROBE_EVERY`]: the completion subscription only ever receives, so
/// without probes a path that died quietly (a NAT or firewall that dropped
/// its state) would leave it waiting for messages that never come, and
/// [`DEAD_PATH`], which counts only data sent, would never trip.
const PROBE_AFTER: Duration = Duration::from_secs(15);
const PROBE_EVERY: Duration = Duration::from_secs(5);

pub(super) fn probes() -> TcpKeepalive {
    TcpKeepalive::new()
        .with_time(PROBE_AFTER)
        .with_interval(PROBE_EVERY)
        .with_retries(3)
}

/// The TCP settings of every connection to Redis the redis crate makes:
/// those the URL would give (Nagle's algorithm left on, as before) plus
/// [`DEAD_PATH`] and keepalive probes, as [`resp`] sets its own.
fn tcp_settings() -> redis::io::tcp::TcpSettings {
    redis::io::tcp::TcpSettings::default()
        .set_user_timeout(DEAD_PATH)
        .set_keepalive(probes())
}

/// A client for `url` with [`tcp_settings`].
fn open(url: &str) -> Result<redis::Client, RedisError> {
    use redis::IntoConnectionInfo;
    redis::Client::open(url.into_connection_info()?.set_tcp_settings(tcp_settings()))
}
/// A waiter re-checks its record at least this often.
const RECHECK: Duration = Duration::from_secs(1);

const CLAIM: &str = r"
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return false
end
if ARGV[3] ~= '0' and string.byte(v, 2) == 1 and string.sub(v, 3, 34) == string.sub(ARGV[1], 3, 34) then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return v
";

const OWNED: &str = r"
local v = redis.call('GET', KEYS[1])
if not v or string.byte(v, 2) ~= 0 or string.sub(v, 35, 50) ~= ARGV[1] then return nil end
";

/// Wakes the waiters of `KEYS[1]` if one marked the in-flight record `v`: an
/// unmarked one is 50 bytes (`codec::in_flight`; a test holds the scripts
/// to that). With `pcall`: a user the ACL denies the channel (Redis 7's
/// default for new users) must still complete and release; its waiters
/// then see the change at their next look.
const ANNOUNCE: &str = concat!(
    "if v and string.len(v) > 50 then redis.pcall('PUBLISH', '",
    channel!(),
    "', KEYS[1]) end\n"
);

/// [`OWNED`] for a completion, which also lands on a key that holds no
/// record: its lease ran out (a store that stalled), or its claim was
/// purged, and nobody has claimed it since. The answer (its client's, or
/// the one held back for its retry) is kept, and a retry replays it
/// instead of running again.
const OURS_OR_NONE: &str = r"
local v = redis.call('GET', KEYS[1])
if v and (string.byte(v, 2) ~= 0 or string.sub(v, 35, 50) ~= ARGV[1]) then return nil end
";

const COMPLETE: &str = r"
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
";

const RELEASE: &str = "redis.call('DEL', KEYS[1])\nreturn 1\n";

/// COMPLETE for many records at once (one Redis server only: the keys span
/// slots), each owner-checked on its own as by [`OURS_OR_NONE`], as if one
/// after the other (a key completed earlier in the call is another's):
/// ARGV holds owner token, record and TTL for each key in turn. Returns
/// per key 1 (completed), 0 (another's), -2 (Redis is out of memory) or
/// -1 (Redis refused the write otherwise: that key alone fails, as a
/// script that stops half way would keep what it wrote). A replica's READONLY (before Redis 7, after a prefix) ends
/// the call as an error, so the connection sees it and lets go of the
/// server: a replica writes nothing, so nothing before it in the call was
/// written either. One `MGET` reads
/// them all: a call from Lua costs more than the read (redis-server's
/// instructions per record, batches of nine: -1.7k against a `GET` each).
const COMPLETE_MANY: &str = concat!(
    "local found = redis.call('MGET', unpack(KEYS))\n",
    "local done, written = {}, {}\n",
    "for i = 1, #KEYS do\n",
    "  local a = (i - 1) * 3\n",
    "  local v = found[i]\n",
    "  if written[KEYS[i]] then\n",
    "    done[i] = 0\n",
    "  elseif not v or (string.byte(v, 2) == 0 and string.sub(v, 35, 50) == ARGV[a + 1]) then\n",
    "    local set = redis.pcall('SET', KEYS[i], ARGV[a + 2], 'PX', ARGV[a + 3])\n",
    "    if type(set) == 'table' and set.err then\n",
    "      if string.find(set.err, 'READONLY', 1, true) then return set end\n",
    "      if string.find(set.err, 'OOM', 1, true) then done[i] = -2 else done[i] = -1 end\n",
    "    else\n",
    "      if v and string.len(v) > 50 then redis.pcall('PUBLISH', '",
    channel!(),
    "', KEYS[i]) end\n",
    "      written[KEYS[i]] = true\n",
    "      done[i] = 1\n",
    "    end\n",
    "  else\n",
    "    done[i] = 0\n",
    "  end\n",
    "end\n",
    "return done\n"
);

/// How long Redis is taken to be out of memory after it refused a write
/// so (see [`OutOfMemory`]).
const FULL_HOLD: Duration = Duration::from_secs(5);
/// Most records kept as refused for want of memory (see
/// [`OutOfMemory::refused`]).
const REFUSED_KEPT: usize = 4096;

/// Whether `error` is Redis's refusal for want of memory.
fn out_of_memory(error: &RedisError) -> bool {
    error.code() == Some("OOM")
}
const OUT_OF_MEMORY: &str = "Redis is out of memory (maxmemory reached under noeviction): no new claim is taken, \
                             as its answer could not be recorded";

/// Whether Redis refuses records for want of memory (`OOM`: `maxmemory`
/// reached under `noeviction`), as its refusals say. A claim is small and
/// may still fit where its answer will not: the completion is then
/// refused on every try, its retries get 409 until `ttl`, and the backend
/// ran a request whose answer is not kept. So for [`FULL_HOLD`] after a
/// refusal ([`OutOfMemory::fill`]) no new claim is taken (503, before the
/// backend sees it), the store is not ready, and records already there
/// are still read and replayed.
struct OutOfMemory {
    /// Until when (on [`crate::clock::coarse_ms`]) Redis is taken to be
    /// out of memory; 0: it is not.
    until: AtomicU64,
    /// At most once a minute (on a Redis Cluster one full node fills the
    /// whole store, and its episodes come and go as completions land on
    /// it or on the others); `told`: this episode was said, so its end is.
    said: crate::telemetry::Throttle,
    told: AtomicBool,
    /// Records whose completion Redis refused, until it lands; `any`:
    /// whether it holds one, read (not locked) on every completion, as
    /// the workers share it.
    refused: Mutex<std::collections::HashSet<RecordKey>>,
    any: AtomicBool,
}

impl OutOfMemory {
    fn new() -> OutOfMemory {
        OutOfMemory {
            until: AtomicU64::new(0),
            said: crate::telemetry::Throttle::every(Duration::from_secs(60)),
            told: AtomicBool::new(false),
            refused: Mutex::default(),
            any: AtomicBool::new(false),
        }
    }

    /// Notes a refusal of a claim, the probe or a wait's mark: Redis has
    /// no room even for a few bytes.
    fn note(&self, error: Option<&RedisError>) {
        if error.is_some_and(out_of_memory) {
            self.fill();
        }
    }

    /// Notes that Redis refused the completion of `key`. Its first refusal
    /// fills the store; its own later ones do not, as one answer larger
    /// than the room left is refused on every try while smaller ones land,
    /// and must not keep new claims out until its `ttl`.
    fn refused(&self, key: &RecordKey) {
        let first = {
            let mut refused = lock(&self.refused);
            // Records given up on (their `ttl` passed) are never removed:
            // bounded by forgetting them all now and then.
            if refused.len() >= REFUSED_KEPT {
                refused.clear();
            }
            self.any.store(true, Ordering::Relaxed);
            refused.insert(*key)
        };
        if first {
            self.fill();
        }
    }

    /// Notes that the completion of `key` landed.
    fn landed(&self, key: &RecordKey) {
        if self.any.load(Ordering::Relaxed) {
            let mut refused = lock(&self.refused);
            refused.remove(key);
            if refused.is_empty() {
                self.any.store(false, Ordering::Relaxed);
            }
        }
    }

    /// Takes Redis to be out of memory for [`FULL_HOLD`] from now.
    fn fill(&self) {
        if self.until.swap(coarse_ms() + ms(FULL_HOLD), Ordering::Relaxed) == 0 && self.said.admit().is_some() {
            self.told.store(true, Ordering::Relaxed);
            tracing::error!(
                "Redis is out of memory (maxmemory, noeviction) and refuses records: new claims are refused \
                 (503) until it takes them again; records already stored are still replayed"
            );
        }
    }

    /// Whether Redis refused a write for want of memory within the last
    /// [`FULL_HOLD`].
    fn full(&self) -> bool {
        let until = self.until.load(Ordering::Relaxed);
        if until == 0 {
            return false;
        }
        if coarse_ms() < until {
            return true;
        }
        if self
            .until
            .compare_exchange(until, 0, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
            && self.told.swap(false, Ordering::Relaxed)
        {
            tracing::info!("Redis refused no write for want of memory for a while: new claims are taken again");
        }
        false
    }
}

/// A batch of completions goes to Redis in calls of at most this many, or
/// about this many bytes: a script blocks the server while it runs.
const BATCH_COUNT: usize = 32;
const BATCH_BYTES: usize = 256 << 10;

const RENEW: &str = r"
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
";

/// The readiness probe: a write, as a claim is, by a script calling what
/// the scripts call (the ACL checks each command a script calls), as
/// completions are.
const PING: &str = r"
redis.call('SET', KEYS[1], '1', 'PX', 10000)
redis.call('APPEND', KEYS[1], 'w')
redis.call('PEXPIRE', KEYS[1], 10000)
redis.call('MGET', KEYS[1])
redis.call('GET', KEYS[1])
redis.call('PTTL', KEYS[1])
redis.call('DEL', KEYS[1])
return 1
";

/// Rewrites the expiry of a completed record holding the answer of
/// fingerprint `ARGV[1]` to itself (to the millisecond; at least 1 ms, as
/// 0 would delete it; one without an expiry, which idemgate never writes,
/// is written again as it is), a write that `WAIT` then covers, and with
/// it every write before it (see [`RedisStore::confirm`]). Only commands
/// every Redis has and the other scripts call. Returns 1, or 0 when the
/// key holds no such record.
const CONFIRM: &str = r"
local v = redis.call('GET', KEYS[1])
if not v or string.byte(v, 2) == 0 or string.sub(v, 3, 34) ~= ARGV[1] then return 0 end
local t = redis.call('PTTL', KEYS[1])
if t == -1 then redis.call('SET', KEYS[1], v) else redis.call('PEXPIRE', KEYS[1], math.max(t, 1)) end
return 1
";

const PEEK: &str = r"
local v = redis.call('GET', KEYS[1])
if not v then return false end
return {v, redis.call('PTTL', KEYS[1])}
";

/// When the record is in flight, marks it as waited on. Returns its first
/// two bytes (enough to tell a claim from an answer: a waiter does not
/// read a stored answer, and a crowd of them would read it once each)
/// and its time left, as PEEK does.
const WATCH: &str = r"
local v = redis.call('GET', KEYS[1])
if not v then return false end
if string.byte(v, 2) == 0 and string.len(v) == 50 then redis.call('APPEND', KEYS[1], 'w') end
return {string.sub(v, 1, 2), redis.call('PTTL', KEYS[1])}
";

/// Deletes the record if it is still the one read before (ARGV[1]; a
/// waiter's mark appended since does not count), so a purge the cluster
/// client sends again after a lost answer cannot delete a newer claim.
const PURGE: &str = r"
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
if v ~= ARGV[1] and v ~= ARGV[1] .. 'w' then return 0 end
redis.call('DEL', KEYS[1])
if string.byte(v, 2) ~= 0 then return 1 end
";

/// A Lua script: run by its SHA-1 (`EVALSHA`), and sent whole (`EVAL`,
/// which also caches it) to a server that does not have it yet; the
/// release always whole (see [`RedisStore`]'s `release`).
#[derive(Clone)]
struct Lua {
    hash: String,
    text: String,
    /// Whether it may write: one that never does is not held for
    /// replicas (`store.wait_for_replicas`).
    writes: bool,
}

impl Lua {
    fn new(text: &str) -> Lua {
        Lua {
            hash: Script::new(text).get_hash().to_owned(),
            text: text.to_owned(),
            writes: true,
        }
    }

    /// A script that only reads.
    fn read_only(text: &str) -> Lua {
        Lua {
            writes: false,
            ..Lua::new(text)
        }
    }
}

struct Scripts {
    claim: Lua,
    complete: Lua,
    complete_many: Lua,
    release: Lua,
    renew: Lua,
    peek: Lua,
    confirm: Lua,
    watch: Lua,
    purge: Lua,
    ping: Lua,
}

impl Scripts {
    fn new() -> Scripts {
        Scripts {
            claim: Lua::new(CLAIM),
            complete: Lua::new(&format!("{OURS_OR_NONE}{ANNOUNCE}{COMPLETE}")),
            complete_many: Lua::new(COMPLETE_MANY),
            release: Lua::new(&format!("{OWNED}{ANNOUNCE}{RELEASE}")),
            renew: Lua::new(&format!("{OWNED}{RENEW}")),
            peek: Lua::read_only(PEEK),
            confirm: Lua::new(CONFIRM),
            watch: Lua::new(WATCH),
            purge: Lua::new(&format!("{PURGE}{ANNOUNCE}return 1\n")),
            ping: Lua::new(PING),
        }
    }
}

/// How the store reaches Redis. Each thread (each worker's runtime) gets a
/// connection of its own to each server, [`resp`]'s lean one, made on first
/// use there, so a request never waits on another thread's connection
/// task. Connections are lazy, so idemgate starts while Redis is down.
enum Connection {
    Single {
        target: Arc<resp::Target>,
        connections: PerThread<resp::Connection>,
    },
    /// Each command to the node that serves its key ([`Cluster`]).
    Cluster(Cluster),
}

/// A connection of either kind.
enum Conn<'a> {
    Single(resp::Connection),
    Cluster(&'a Cluster),
}

impl Conn<'_> {
    /// Sends `command` and reads its answer as `T`.
    async fn query<T: redis::FromRedisValue>(&mut self, command: &redis::Cmd) -> Result<T, RedisError> {
        self.query_as(command, true).await
    }

    /// [`Conn::query`] of a command that `writes`, or writes nothing and
    /// so is not held for replicas (`store.wait_for_replicas`).
    async fn query_as<T: redis::FromRedisValue>(
        &mut self,
        command: &redis::Cmd,
        writes: bool,
    ) -> Result<T, RedisError> {
        match self {
            Conn::Single(connection) => connection.query_as(command, writes).await,
            Conn::Cluster(cluster) => cluster.query(command, writes).await,
        }
    }
}

/// One value per thread, found without a lock: one map behind a mutex,
/// looked up on every command, would move the lock's cache line between
/// the workers' cores each time. `ThreadLocal` hands an exited thread's
/// slot to a later thread, so each value is kept with the thread that
/// made it and made again for another: a connection is tied to the
/// runtime it was made on, which may have gone with that thread.
pub(super) struct PerThread<T: Send>(thread_local::ThreadLocal<RefCell<Option<(ThreadId, T)>>>);

impl<T: Clone + Send> PerThread<T> {
    pub(super) fn new() -> PerThread<T> {
        PerThread(thread_local::ThreadLocal::new())
    }

    pub(super) fn get_or(&self, make: impl FnOnce() -> Result<T, RedisError>) -> Result<T, RedisError> {
        let me = this_thread();
        let mut slot = self.0.get_or_default().borrow_mut();
        match &*slot {
            Some((owner, value)) if *owner == me => Ok(value.clone()),
            _ => {
                let value = make()?;
                *slot = Some((me, value.clone()));
                Ok(value)
            }
        }
    }
}

/// The current thread's id, read once per thread.
fn this_thread() -> ThreadId {
    thread_local! {
        static ME: ThreadId = std::thread::current().id();
    }
    ME.with(|me| *me)
}

pub struct RedisStore {
    connection: Connection,
    prefix: KeyPrefix,
    memory: OutOfMemory,
    scripts: Scripts,
    waiters: Arc<Waiters>,
    /// Whether the completion subscription is live.
    listening: Arc<AtomicBool>,
    /// Whether the server takes `SET ... NX ... GET` (Redis 7 and later).
    native_claim: AtomicBool,
    /// Whether the scripts are known to run: a user the ACL denies them,
    /// or a command they call, could claim natively but never complete,
    /// renew or release, and a retry would run the request again once the
    /// lease ran out. Set by the probe ([`PING`], which calls every command
    /// the scripts do), cleared by any refusal; while clear, a claim runs
    /// the probe first, and fails with it.
    scripts_run: AtomicBool,
    /// Completions waiting to go to Redis together, per thread (one Redis
    /// server only; see [`RedisStore::complete`]).
    batches: Option<PerThread<Arc<Mutex<Vec<Completion>>>>>,
    /// Cleared when the server refuses a batch for spanning hash slots (a
    /// node in cluster mode behind `url`): completions go one by one.
    batching: AtomicBool,
    /// Claims sent and not yet answered, per thread (see [`Claims`]).
    claims: PerThread<Claims>,
    /// `store.wait_for_replicas`: writes count once this many replicas
    /// hold them.
    replicas: u32,
    _subscriber: AbortOnDrop,
    _eviction_check: AbortOnDrop,
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A completion queued to go to Redis with others.
struct Completion {
    key: RecordKey,
    owner: Owner,
    record: Vec<u8>,
    ttl: String,
    reply: oneshot::Sender<Result<bool, StoreError>>,
}

/// The claims sent from one thread and not yet answered, by key, each
/// with the same claims made since, which wait for its answer instead of
/// sending their own. A storm of retries of one request (a client's
/// retries, a replayed queue) would otherwise read its whole record from
/// Redis once each, over the thread's one connection: hundreds of retries
/// of a megabyte answer held every other call of the thread behind them
/// past `store.timeout`. Joined, they cost one read per round trip.
type Claims = Arc<Mutex<KeyMap<RecordKey, Sent>>>;

/// What a claim that joined another is told: what the claim found, or
/// why it failed.
type Told = Result<Claim, Failed>;

/// Why a claim joined failed, for each claim that joined it.
#[derive(Clone)]
enum Failed {
    /// The record under the key cannot be read: kept as such, as the
    /// proxy then refuses even where `on_error = "pass"` would forward (it
    /// could run the request twice).
    Corrupt(&'static str),
    /// Any other failure: the joined claims themselves were not sent.
    NotSent(String),
}

impl Failed {
    fn of(error: &StoreError) -> Failed {
        match error {
            StoreError::Corrupt(why) => Failed::Corrupt(why),
            other => Failed::NotSent(format!("the same claim, joined, failed: {}", cause(other))),
        }
    }

    fn error(self) -> StoreError {
        match self {
            Failed::Corrupt(why) => StoreError::Corrupt(why),
            Failed::NotSent(why) => StoreError::NotSent(why.into()),
        }
    }
}

/// A claim sent, and the claims that joined it.
struct Sent {
    fingerprint: Fingerprint,
    refresh_ttl: Option<Duration>,
    joined: Vec<oneshot::Sender<Told>>,
}

impl Sent {
    /// Whether a claim with `fingerprint` and `refresh_ttl` is answered by
    /// this one's answer: the same request, read the same way. Sent
    /// instead, behind this one on the thread's connection, it would find
    /// this one's claim of the key, or what this one found, or, if it
    /// reached Redis later, a state since moved on (the answer of a claim
    /// this one found in flight, a purge). A claim that joins may so be
    /// told a state a few moments old, until this one's caller runs again
    /// after the answer comes: a 409 where the answer is just in, or a
    /// replay of a record just purged; never the key for itself, so never
    /// a second run.
    fn joins(&self, fingerprint: &Fingerprint, refresh_ttl: Option<Duration>) -> bool {
        self.fingerprint == *fingerprint && self.refresh_ttl == refresh_ttl
    }
}

/// What a claim does, by [`join`].
enum Turn {
    /// Goes to Redis, taking its place in [`Claims`] for others to join.
    Send,
    /// Goes to Redis alone: the claim on its way is another request's
    /// (another body, or a route that refreshes differently, on one key).
    Alone,
    /// Waits for the answer to the same claim, on its way.
    Wait(oneshot::Receiver<Told>),
}

/// Joins the claim of `key` on its way in `claims`, if it is the same as
/// this one, or takes its place.
fn join(claims: &Claims, key: &RecordKey, fingerprint: &Fingerprint, refresh_ttl: Option<Duration>) -> Turn {
    match lock(claims).entry(*key) {
        Entry::Vacant(vacant) => {
            vacant.insert(Sent {
                fingerprint: *fingerprint,
                refresh_ttl,
                joined: Vec::new(),
            });
            Turn::Send
        }
        Entry::Occupied(mut sent) if sent.get().joins(fingerprint, refresh_ttl) => {
            let (tell, told) = oneshot::channel();
            sent.get_mut().joined.push(tell);
            Turn::Wait(told)
        }
        Entry::Occupied(_) => Turn::Alone,
    }
}

/// A sent claim's place in [`Claims`], until its answer is in. Dropped
/// first (its caller gave up: the client hung up), it leaves; the claims
/// that joined it are told nothing and claim again (one sends, the others
/// join it).
struct Sending {
    claims: Option<Claims>,
    key: RecordKey,
}

impl Sending {
    /// Leaves [`Claims`], with the claims that joined this one. Once: the
    /// key's place may be another claim's after.
    fn finish(&mut self) -> Vec<oneshot::Sender<Told>> {
        let Some(claims) = self.claims.take() else {
            return Vec::new();
        };
        lock(&claims)
            .remove(&self.key)
            .map(|sent| sent.joined)
            .unwrap_or_default()
    }
}

impl Drop for Sending {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Answers every completion of `batch` with `error`.
fn fail(batch: Vec<Completion>, error: &str) {
    for completion in batch {
        let _ = completion
            .reply
            .send(Err(StoreError::Unavailable(error.to_owned().into())));
    }
}

/// What `error` wraps, in words: wrapped again by [`fail`], it would read
/// "store unavailable: store unavailable: ...".
fn cause(error: &StoreError) -> String {
    std::error::Error::source(error).map_or_else(|| error.to_string(), error_chain)
}

/// The queue of the completion that sends the batch, until it takes it.
/// Dropped first (its caller gave up while it waited for the others), it
/// answers them with an error rather than leave them queued with nobody to
/// send them: their exchanges retry their completions.
struct Sender(Option<Arc<Mutex<Vec<Completion>>>>);

impl Sender {
    fn take(&mut self) -> Vec<Completion> {
        let queue = self.0.take().expect("taken once");
        std::mem::take(&mut *lock(&queue))
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        if let Some(queue) = self.0.take() {
            let batch = std::mem::take(&mut *lock(&queue));
            fail(batch, "a batched completion was abandoned");
        }
    }
}

/// Whether `error` is a server's refusal of `SET ... NX ... GET`: before
/// Redis 7, `ERR syntax error`. Any other error (`OOM`, a server going
/// read-only, ...) says nothing of what the server takes.
fn refuses_nx_get(error: &RedisError) -> bool {
    error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError)
        && error.detail().is_some_and(|detail| detail.starts_with("syntax error"))
}

/// A Redis error as the store's: `WRONGTYPE` is a record that cannot be
/// read ([`StoreError::Corrupt`]); one the redis crate raised before the
/// command was sent (our own connection's [`resp`] marks those it never
/// wrote so) is `NotSent`. A server that does not know a command quotes
/// its first arguments back (`..., with args beginning with: 'key' ...`):
/// record keys, owner tokens, records; they are left out
/// ([`resp::unquoted`]), as the error goes to the logs.
fn unavailable(e: RedisError) -> StoreError {
    // Redis answered, and the key holds something idemgate did not write
    // (a hash, a list): as a record it cannot read, refused even where
    // `on_error = "pass"` would forward, as the key is taken.
    if e.code() == Some("WRONGTYPE") || e.detail().is_some_and(|d| d.contains("WRONGTYPE")) {
        return StoreError::Corrupt("the key holds a Redis value of another type");
    }
    let not_sent = e.kind() == redis::ErrorKind::Client;
    let text = e.to_string();
    let error: Box<dyn std::error::Error + Send + Sync> = match resp::unquoted(&text) {
        std::borrow::Cow::Owned(unquoted) => unquoted.into(),
        std::borrow::Cow::Borrowed(_) => Box::new(e),
    };
    if not_sent {
        StoreError::NotSent(error)
    } else {
        StoreError::Unavailable(error)
    }
}

/// How long Redis waits for replicas to copy a batch of writes
/// (`WAIT`'s timeout) under a store timeout of `timeout`: a third of it.
/// A command may wait for the `WAIT` under way on its connection before
/// its own batch goes out behind one of its own: two of them, and the
/// round trips, still end before the store's deadline, so a copy that is
/// late fails a call of one command with its own error (how many
/// replicas hold the write) rather than a timeout that says nothing of
/// replicas. (A call of two, an `EVAL` after `NOSCRIPT` or a first claim
/// after the probe, may still meet the deadline first.)
pub(super) fn copy_wait(timeout: Duration) -> Duration {
    timeout / 3
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// `verb` (`EVALSHA` or `EVAL`) of `script` (its hash or its text) on
/// `keys` with `args`.
fn script_command(verb: &str, script: &str, keys: &[&[u8]], args: &[&[u8]]) -> redis::Cmd {
    // Sized for all of it: built up from nothing, the command's buffers
    // would be regrown (copied) several times over.
    let data = verb.len() + script.len() + 20 + keys.iter().chain(args).map(|a| a.len()).sum::<usize>();
    let mut command = redis::Cmd::with_capacity(3 + keys.len() + args.len(), data);
    command.arg(verb).arg(script).arg(keys.len());
    for arg in keys.iter().chain(args) {
        command.arg(*arg);
    }
    command
}

/// What a record's Redis key begins with: `<store.key_prefix>:{`.
#[derive(Clone)]
struct KeyPrefix(Arc<[u8]>);

impl KeyPrefix {
    /// For `store.key_prefix` `prefix`, which the configuration has checked
    /// (at most [`crate::config::MAX_KEY_PREFIX`] bytes, no braces).
    fn new(prefix: &str) -> KeyPrefix {
        assert!(prefix.len() <= crate::config::MAX_KEY_PREFIX, "a checked key prefix");
        KeyPrefix(format!("{prefix}:{{").into_bytes().into())
    }

    /// The record key a Redis key under this prefix names, if it is one.
    fn record_key_of(&self, redis_key: &[u8]) -> Option<RecordKey> {
        let hex = redis_key.strip_prefix(&*self.0)?.strip_suffix(b"}")?;
        let mut key = [0u8; 32];
        hex::decode_to_slice(hex, &mut key).ok()?;
        Some(RecordKey(key))
    }
}

/// The Redis key of a record, `<prefix>:{<sha-256 hex>}`, built without
/// allocating.
#[derive(Clone)]
struct RedisKey {
    buf: [u8; RedisKey::MAX],
    len: usize,
}

impl RedisKey {
    const MAX: usize = crate::config::MAX_KEY_PREFIX + 2 + 64 + 1;

    fn of(prefix: &KeyPrefix, key: &RecordKey) -> RedisKey {
        let mut buf = [0u8; RedisKey::MAX];
        let head = prefix.0.len();
        buf[..head].copy_from_slice(&prefix.0);
        hex::encode_to_slice(key.0, &mut buf[head..head + 64]).expect("64 hex digits for 32 bytes");
        buf[head + 64] = b'}';
        RedisKey { buf, len: head + 65 }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl RedisStore {
    /// One Redis server at `url`, its records' keys under `prefix`.
    /// Connects lazily and reconnects by itself.
    pub fn single(url: &str, prefix: &str, timeout: Duration) -> Result<RedisStore, StoreError> {
        RedisStore::single_copied(url, prefix, timeout, 0)
    }

    /// [`RedisStore::single`], whose writes count only once `replicas` of
    /// the server's replicas hold them (`store.wait_for_replicas`), each
    /// `WAIT` given a third of `timeout`.
    pub fn single_copied(url: &str, prefix: &str, timeout: Duration, replicas: u32) -> Result<RedisStore, StoreError> {
        let client = open(url).map_err(unavailable)?;
        // Every call already has the store's deadline (`StoreHandle`, `wait`
        // included): a command has no timer of its own.
        let target = resp::Target::new(client.get_connection_info(), timeout, DEAD_PATH, probes())
            .map_err(unavailable)?
            .copied_to(replicas, copy_wait(timeout));
        let connection = Connection::Single {
            target: Arc::new(target),
            connections: PerThread::new(),
        };
        Ok(RedisStore::new(
            connection,
            KeyPrefix::new(prefix),
            vec![client],
            replicas,
        ))
    }

    /// A Redis Cluster, found through any of `urls`, its records' keys
    /// under `prefix`.
    pub fn cluster(urls: &[String], prefix: &str, timeout: Duration) -> Result<RedisStore, StoreError> {
        RedisStore::cluster_copied(urls, prefix, timeout, 0)
    }

    /// [`RedisStore::cluster`], whose writes count only once `replicas` of
    /// their node's replicas hold them (`store.wait_for_replicas`), each
    /// `WAIT` given a third of `timeout`.
    pub fn cluster_copied(
        urls: &[String],
        prefix: &str,
        timeout: Duration,
        replicas: u32,
    ) -> Result<RedisStore, StoreError> {
        // PUBLISH reaches every node of a cluster: subscribe to any of them.
        let nodes = urls
            .iter()
            .map(|u| open(u))
            .collect::<Result<Vec<_>, _>>()
            .map_err(unavailable)?;
        if nodes.is_empty() {
            return Err(StoreError::NotSent("no Redis Cluster URL".into()));
        }
        let infos: Vec<_> = nodes.iter().map(|node| node.get_connection_info().clone()).collect();
        let cluster = Cluster::new(&infos, timeout, replicas).map_err(unavailable)?;
        Ok(RedisStore::new(
            Connection::Cluster(cluster),
            KeyPrefix::new(prefix),
            nodes,
            replicas,
        ))
    }

    fn new(connection: Connection, prefix: KeyPrefix, subscribe_to: Vec<redis::Client>, replicas: u32) -> RedisStore {
        let waiters = Arc::new(Waiters::default());
        let listening = Arc::new(AtomicBool::new(false));
        let eviction_check = tokio::spawn(check_servers(subscribe_to.clone(), replicas));
        let subscriber = tokio::spawn(listen(subscribe_to, prefix.clone(), waiters.clone(), listening.clone()));
        let batches = matches!(connection, Connection::Single { .. }).then(PerThread::new);
        RedisStore {
            connection,
            prefix,
            memory: OutOfMemory::new(),
            scripts: Scripts::new(),
            waiters,
            listening,
            native_claim: AtomicBool::new(true),
            scripts_run: AtomicBool::new(false),
            batches,
            batching: AtomicBool::new(true),
            claims: PerThread::new(),
            replicas,
            _subscriber: AbortOnDrop(subscriber),
            _eviction_check: AbortOnDrop(eviction_check),
        }
    }

    /// The Redis key of the record `key`, under this store's prefix.
    fn redis_key(&self, key: &RecordKey) -> RedisKey {
        RedisKey::of(&self.prefix, key)
    }

    /// This thread's connection.
    fn connection(&self) -> Result<Conn<'_>, StoreError> {
        match &self.connection {
            Connection::Single { target, connections } => connections
                .get_or(|| Ok(resp::Connection::new(target.clone())))
                .map(Conn::Single)
                .map_err(unavailable),
            Connection::Cluster(cluster) => Ok(Conn::Cluster(cluster)),
        }
    }

    /// Runs `script` on the record `key` by `EVALSHA`, or sends it whole
    /// when the server does not have it (a restart, a failover).
    async fn eval<T: redis::FromRedisValue>(&self, script: &Lua, key: &[u8], args: &[&[u8]]) -> Result<T, StoreError> {
        self.eval_on(script, &[key], args).await
    }

    /// [`RedisStore::eval`] on several keys. A script the server lacks is
    /// sent with `EVAL`, which goes where the keys do and caches it there,
    /// in one round trip; `SCRIPT LOAD` would go to every node of a
    /// cluster, then `EVALSHA` again.
    async fn eval_on<T: redis::FromRedisValue>(
        &self,
        script: &Lua,
        keys: &[&[u8]],
        args: &[&[u8]],
    ) -> Result<T, StoreError> {
        let mut connection = self.connection()?;
        let result = Self::eval_with(&mut connection, script, keys, args).await;
        self.note_scripts(result.as_ref().err());
        result.map_err(unavailable)
    }

    /// [`RedisStore::eval`] of a script that writes a few bytes at most (a
    /// claim, the probe, a wait's mark): refused for want of memory, it
    /// fills the store (see [`OutOfMemory`]).
    async fn eval_filling<T: redis::FromRedisValue>(
        &self,
        script: &Lua,
        key: &[u8],
        args: &[&[u8]],
    ) -> Result<T, StoreError> {
        let mut connection = self.connection()?;
        let result = Self::eval_with(&mut connection, script, &[key], args).await;
        self.note_scripts(result.as_ref().err());
        self.memory.note(result.as_ref().err());
        result.map_err(unavailable)
    }

    /// Notes whether a script ran, from its call's `error`; a refusal by
    /// the ACL is logged, throttled.
    fn note_scripts(&self, error: Option<&RedisError>) {
        // Refused the script itself, or a command it calls (Redis 7.0
        // says "can't run this command", 7.2 "no permissions to run"); not
        // `WAIT` after it (`store.wait_for_replicas`), which its own error
        // names.
        let denied = error.is_some_and(|e| {
            (e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm)
                || e.detail()
                    .is_some_and(|d| d.contains("can't run this command") || d.contains("no permissions to run")))
                && !resp::is_not_copied(e)
        });
        if denied {
            crate::telemetry::warn_throttled!(
                error.expect("a refusal is an error"),
                "this Redis user may not run idemgate's scripts: no claim is taken, as its record \
                 could never be completed; grant it EVALSHA, EVAL and the commands they call (see the \
                 README)",
                store = "redis"
            );
        }
        // Written only when it changes: both workers read it on every
        // claim, and a write would pull its cache line from core to core.
        if denied && self.scripts_run.load(Ordering::Relaxed) {
            self.scripts_run.store(false, Ordering::Relaxed);
        }
    }

    /// Runs the probe, [`PING`]: a write, by a script calling every
    /// command the scripts call. Once it runs, the scripts are known to.
    async fn probe(&self) -> Result<(), StoreError> {
        // Under the records' prefix, which a Redis user's key patterns
        // allow (`~<prefix>:*`).
        let key = [&self.prefix.0[..], b"ping}"].concat();
        let result = self.eval_filling::<i64>(&self.scripts.ping, &key, &[]).await;
        // Run, if too few replicas hold its write (`store.wait_for_replicas`;
        // its node's replicas alone, on a cluster): the scripts are known
        // to run all the same.
        let ran = match &result {
            Ok(_) => true,
            Err(StoreError::Unavailable(error)) => error.downcast_ref::<RedisError>().is_some_and(resp::is_not_copied),
            Err(_) => false,
        };
        if ran && !self.scripts_run.load(Ordering::Relaxed) {
            self.scripts_run.store(true, Ordering::Relaxed);
        }
        result.map(drop)
    }

    /// [`RedisStore::eval_on`] on `connection`, with Redis's own error.
    async fn eval_with<T: redis::FromRedisValue>(
        connection: &mut Conn<'_>,
        script: &Lua,
        keys: &[&[u8]],
        args: &[&[u8]],
    ) -> Result<T, RedisError> {
        match connection
            .query_as(&script_command("EVALSHA", &script.hash, keys, args), script.writes)
            .await
        {
            Err(error) if error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                connection
                    .query_as(&script_command("EVAL", &script.text, keys, args), script.writes)
                    .await
            }
            result => result,
        }
    }

    /// The record under `key` and its time left in ms, if there is one: a
    /// read, which Redis answers out of memory too.
    async fn read(&self, key: &RecordKey) -> Result<Option<(Vec<u8>, i64)>, StoreError> {
        self.eval(&self.scripts.peek, self.redis_key(key).as_bytes(), &[]).await
    }

    /// Purges the record under `key` if it is still `record`.
    async fn purge_exact(&self, key: &RedisKey, record: &[u8]) -> Result<bool, StoreError> {
        let removed: i64 = self.eval(&self.scripts.purge, key.as_bytes(), &[record]).await?;
        Ok(removed == 1)
    }

    /// Claims with `SET key claim NX PX lease GET`: one native command, no
    /// script to run. Servers before Redis 7 refuse NX with GET; then the
    /// claim script is used from there on.
    async fn claim_natively(&self, key: &RecordKey, claim: &[u8], lease: u64) -> Result<Option<Vec<u8>>, StoreError> {
        let redis_key = self.redis_key(key);
        // Sized for all of it, as in `script_command`.
        let data = "SET".len() + redis_key.as_bytes().len() + claim.len() + "NXPXGET".len() + 20;
        let mut command = redis::Cmd::with_capacity(7, data);
        command
            .arg("SET")
            .arg(redis_key.as_bytes())
            .arg(claim)
            .arg("NX")
            .arg("PX")
            .arg(lease)
            .arg("GET");
        let mut connection = self.connection()?;
        match connection.query::<Option<Vec<u8>>>(&command).await {
            Ok(found) => Ok(found),
            Err(error) if refuses_nx_get(&error) => {
                tracing::info!(%error, "this Redis refuses SET NX GET; claiming with a script instead");
                self.native_claim.store(false, Ordering::Relaxed);
                self.claim_by_script(key, claim, lease, 0).await
            }
            Err(error) => {
                self.memory.note(Some(&error));
                Err(unavailable(error))
            }
        }
    }

    /// Claims with the claim script; a replayed record with the same
    /// fingerprint gets its TTL set to `refresh` ms (0: left alone).
    async fn claim_by_script(
        &self,
        key: &RecordKey,
        claim: &[u8],
        lease: u64,
        refresh: u64,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let (lease, refresh) = (lease.to_string(), refresh.to_string());
        self.eval_filling(
            &self.scripts.claim,
            self.redis_key(key).as_bytes(),
            &[claim, lease.as_bytes(), refresh.as_bytes()],
        )
        .await
    }

    /// Claims `key` by itself: [`Store::claim`] without joining the same
    /// claim already sent from this thread.
    async fn claim_alone(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        lease: Duration,
        refresh_ttl: Option<Duration>,
    ) -> Result<Claim, StoreError> {
        if !self.scripts_run.load(Ordering::Relaxed)
            && let Err(error) = self.probe().await
            // Failed, but the scripts ran: claimed all the same.
            && !self.scripts_run.load(Ordering::Relaxed)
        {
            // Not sent: the claim waits on the probe.
            return Err(match error {
                StoreError::Unavailable(why) | StoreError::NotSent(why) => StoreError::NotSent(why),
                other => other,
            });
        }
        let claim = codec::in_flight(fingerprint, owner);
        let claimed = if self.memory.full() {
            Err(StoreError::NotSent(OUT_OF_MEMORY.into()))
        } else if refresh_ttl.is_none() && self.native_claim.load(Ordering::Relaxed) {
            self.claim_natively(key, &claim, ms(lease)).await
        } else {
            // A replay that refreshes the TTL must do it in the same step.
            self.claim_by_script(key, &claim, ms(lease), refresh_ttl.map_or(0, ms))
                .await
        };
        let found = match claimed {
            Ok(found) => found,
            Err(error) if !self.memory.full() => return Err(error),
            // Out of memory (just now, or this claim was refused so): what
            // is there is read, a replay answered; nothing new is taken.
            Err(_) => match self.read(key).await? {
                Some((record, _)) => Some(record),
                None => return Err(StoreError::NotSent(OUT_OF_MEMORY.into())),
            },
        };
        let Some(record) = found else {
            return Ok(Claim::Claimed);
        };
        Ok(match codec::decode(Bytes::from(record))? {
            // Our own claim: the cluster client resent the command after a
            // dropped connection, and the first one had taken the key.
            Decoded::InFlight { owner: found, .. } if found == owner => Claim::Claimed,
            Decoded::InFlight { fingerprint, .. } => Claim::InFlight { fingerprint },
            Decoded::Completed { fingerprint, outcome } => Claim::Completed { fingerprint, outcome },
        })
    }

    /// Completes the records of `batch`, in calls of at most
    /// [`BATCH_COUNT`] records or about [`BATCH_BYTES`]. Answers each.
    async fn complete_batch(&self, mut batch: Vec<Completion>) {
        while !batch.is_empty() {
            let mut bytes = 0;
            let count = batch
                .iter()
                .take(BATCH_COUNT)
                .take_while(|c| {
                    let fits = bytes == 0 || bytes + c.record.len() <= BATCH_BYTES;
                    bytes += c.record.len();
                    fits
                })
                .count();
            let rest = batch.split_off(count);
            self.complete_together(batch).await;
            batch = rest;
        }
    }

    /// Completes the records of `batch`: one alone by the completion script,
    /// more by COMPLETE_MANY in one call. Answers each.
    async fn complete_together(&self, mut batch: Vec<Completion>) {
        if batch.len() == 1 {
            self.complete_alone(batch.pop().expect("one")).await;
            return;
        }
        let mut connection = match self.connection() {
            Ok(connection) => connection,
            Err(error) => return fail(batch, &cause(&error)),
        };
        let result: Result<Vec<i64>, RedisError> = {
            let keys: Vec<RedisKey> = batch.iter().map(|c| self.redis_key(&c.key)).collect();
            let tokens: Vec<[u8; 16]> = batch.iter().map(|c| codec::owner_bytes(c.owner)).collect();
            let keys: Vec<&[u8]> = keys.iter().map(RedisKey::as_bytes).collect();
            let args: Vec<&[u8]> = batch
                .iter()
                .zip(&tokens)
                .flat_map(|(c, token)| [&token[..], &c.record[..], c.ttl.as_bytes()])
                .collect();
            Self::eval_with(&mut connection, &self.scripts.complete_many, &keys, &args).await
        };
        self.note_scripts(result.as_ref().err());
        match result {
            // A node in cluster mode (one shard, behind `url`) takes each
            // record but no script on keys of several slots; nothing was
            // written.
            Err(error) if error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::CrossSlot) => {
                if self.batching.swap(false, Ordering::Relaxed) {
                    tracing::warn!(
                        "this Redis is in cluster mode and refuses several records in one call: \
                         completing each alone (give a cluster's nodes as `urls` to spread the records)"
                    );
                }
                futures_util::future::join_all(batch.into_iter().map(|one| self.complete_alone(one))).await;
            }
            Ok(done) if done.len() == batch.len() => {
                for (completion, done) in batch.into_iter().zip(done) {
                    match done {
                        -2 => self.memory.refused(&completion.key),
                        1 => self.memory.landed(&completion.key),
                        _ => {}
                    }
                    let answer = match done {
                        -2 => Err(StoreError::Unavailable(OUT_OF_MEMORY.into())),
                        -1 => Err(StoreError::Unavailable("Redis refused to write the record".into())),
                        done => Ok(done == 1),
                    };
                    let _ = completion.reply.send(answer);
                }
            }
            Ok(_) => fail(batch, "Redis answered a batch of completions with the wrong count"),
            Err(error) => {
                if out_of_memory(&error) {
                    batch.iter().for_each(|c| self.memory.refused(&c.key));
                }
                fail(batch, &cause(&unavailable(error)))
            }
        }
    }

    /// Completes `one` by the completion script, and answers it.
    async fn complete_alone(&self, one: Completion) {
        let result = self.complete_one(&one.key, one.owner, &one.record, &one.ttl).await;
        let _ = one.reply.send(result);
    }

    /// Completes the record `key` by the completion script (see
    /// [`OutOfMemory::refused`]).
    async fn complete_one(&self, key: &RecordKey, owner: Owner, record: &[u8], ttl: &str) -> Result<bool, StoreError> {
        let token = codec::owner_bytes(owner);
        let redis_key = self.redis_key(key);
        let mut connection = self.connection()?;
        let args: [&[u8]; 3] = [&token, record, ttl.as_bytes()];
        let result: Result<Option<i64>, RedisError> =
            Self::eval_with(&mut connection, &self.scripts.complete, &[redis_key.as_bytes()], &args).await;
        self.note_scripts(result.as_ref().err());
        match &result {
            Ok(_) => self.memory.landed(key),
            Err(error) if out_of_memory(error) => self.memory.refused(key),
            Err(_) => {}
        }
        Ok(result.map_err(unavailable)? == Some(1))
    }

    /// Runs `script` if `owner` holds the claim on `key`; `args` follow the
    /// owner token.
    async fn owned(&self, script: &Lua, key: &RecordKey, owner: Owner, args: &[&[u8]]) -> Result<bool, StoreError> {
        let token = codec::owner_bytes(owner);
        let mut all: [&[u8]; 3] = [&token, &[], &[]];
        all[1..=args.len()].copy_from_slice(args);
        let done: Option<i64> = self
            .eval(script, self.redis_key(key).as_bytes(), &all[..=args.len()])
            .await?;
        Ok(done == Some(1))
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        lease: Duration,
        refresh_ttl: Option<Duration>,
    ) -> Result<Claim, StoreError> {
        let claims = self.claims.get_or(|| Ok(Arc::default())).map_err(unavailable)?;
        loop {
            match join(&claims, key, fingerprint, refresh_ttl) {
                Turn::Send => break,
                Turn::Alone => return self.claim_alone(key, fingerprint, owner, lease, refresh_ttl).await,
                Turn::Wait(told) => match told.await {
                    Ok(Ok(claim)) => return Ok(claim),
                    Ok(Err(failed)) => return Err(failed.error()),
                    // The claim joined was given up unanswered (its client
                    // hung up): sent again, by this one or one it joins.
                    Err(_) => continue,
                },
            }
        }
        let mut sending = Sending {
            claims: Some(claims),
            key: *key,
        };
        let result = self.claim_alone(key, fingerprint, owner, lease, refresh_ttl).await;
        let joined = sending.finish();
        if !joined.is_empty() {
            let told = match &result {
                Ok(Claim::Claimed) => Ok(Claim::InFlight {
                    fingerprint: *fingerprint,
                }),
                Ok(claim) => Ok(claim.clone()),
                Err(error) => Err(Failed::of(error)),
            };
            for tell in joined {
                let _ = tell.send(told.clone());
            }
        }
        result
    }

    async fn complete(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Owner,
        outcome: Outcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let record = codec::completed(fingerprint, &outcome);
        let ttl = ms(ttl).to_string();
        let Some(batches) = self.batches.as_ref().filter(|_| self.batching.load(Ordering::Relaxed)) else {
            return self.complete_one(key, owner, &record, &ttl).await;
        };
        // Completions made on this thread in one turn of its runtime go to
        // Redis in one script call: the first to queue sends them all, once
        // the others of this turn have had their chance to join.
        let queue = batches.get_or(|| Ok(Arc::default())).map_err(unavailable)?;
        let (reply, answer) = oneshot::channel();
        let first = {
            let mut queue = lock(&queue);
            queue.push(Completion {
                key: *key,
                owner,
                record,
                ttl,
                reply,
            });
            queue.len() == 1
        };
        if first {
            let mut sender = Sender(Some(queue));
            tokio::task::yield_now().await;
            let batch = sender.take();
            self.complete_batch(batch).await;
        }
        answer
            .await
            .map_err(|_| StoreError::Unavailable("a batched completion was abandoned".into()))?
    }

    async fn release(&self, key: &RecordKey, owner: Owner) -> Result<bool, StoreError> {
        // Sent whole (`EVAL`), not by its hash: a release is often sent to
        // a Redis that stalled (its claim unanswered), and lands late, after
        // its caller gave up at the store's deadline. By its hash, to a
        // server that lost the script meanwhile (a restart, a failover),
        // it would be answered NOSCRIPT with nobody left to send it whole,
        // and the key would stay claimed for its lease. Releases are rare,
        // and the script short.
        let token = codec::owner_bytes(owner);
        let redis_key = self.redis_key(key);
        let release = script_command("EVAL", &self.scripts.release.text, &[redis_key.as_bytes()], &[&token]);
        let mut connection = self.connection()?;
        let done: Result<Option<i64>, RedisError> = connection.query(&release).await;
        self.note_scripts(done.as_ref().err());
        Ok(done.map_err(unavailable)? == Some(1))
    }

    async fn renew(&self, key: &RecordKey, owner: Owner, lease: Duration) -> Result<bool, StoreError> {
        let lease = ms(lease).to_string();
        self.owned(&self.scripts.renew, key, owner, &[lease.as_bytes()]).await
    }

    async fn wait(&self, key: &RecordKey, timeout: Duration) -> Result<(), StoreError> {
        let registration = self.waiters.register(*key);
        let notified = registration.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let watched = self
            .eval_filling(&self.scripts.watch, self.redis_key(key).as_bytes(), &[])
            .await;
        // Out of memory, the mark is refused: the record is read, and
        // looked at again sooner, as without a subscription.
        let (found, marked): (Option<(Vec<u8>, i64)>, bool) = match watched {
            Ok(found) => (found, true),
            Err(_) if self.memory.full() => (self.read(key).await?, false),
            Err(error) => return Err(error),
        };
        let Some((record, pttl)) = found else {
            return Ok(());
        };
        if record.get(1) != Some(&codec::IN_FLIGHT) {
            return Ok(());
        }
        // Without a live subscription (or the mark), re-check sooner; never
        // spin.
        let recheck = if marked && self.listening.load(Ordering::Relaxed) {
            RECHECK
        } else {
            RECHECK / 2
        };
        let until = timeout.min(recheck).min(Duration::from_millis(pttl.max(1) as u64));
        let _ = tokio::time::timeout(until, notified).await;
        Ok(())
    }

    /// With `store.wait_for_replicas`, a write on the record (`CONFIRM`)
    /// held like any until that many replicas hold it, and so everything
    /// written to the key before it: the answer found may have been
    /// written by a connection that broke before its `WAIT` was answered.
    async fn confirm(&self, key: &RecordKey, fingerprint: &Fingerprint) -> Result<bool, StoreError> {
        if self.replicas == 0 {
            return Ok(true);
        }
        let done: i64 = self
            .eval(&self.scripts.confirm, self.redis_key(key).as_bytes(), &[&fingerprint.0])
            .await?;
        Ok(done == 1)
    }

    async fn inspect(&self, key: &RecordKey) -> Result<Option<(Record, Duration)>, StoreError> {
        self.read(key)
            .await?
            .map(|(record, pttl)| {
                Ok((
                    codec::decode(Bytes::from(record))?,
                    Duration::from_millis(pttl.max(0) as u64),
                ))
            })
            .transpose()
    }

    async fn purge(&self, key: &RecordKey) -> Result<bool, StoreError> {
        let redis_key = self.redis_key(key);
        let mut read = redis::cmd("GET");
        read.arg(redis_key.as_bytes());
        let found: Option<Vec<u8>> = self.connection()?.query(&read).await.map_err(unavailable)?;
        match found {
            None => Ok(false),
            Some(record) => self.purge_exact(&redis_key, &record).await,
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        // A write, as a claim is: a server that answers but is a replica
        // (after a failover), or out of memory, takes no claim; by a
        // script, as completions are: a user the ACL denies scripts could
        // complete nothing.
        // A connection that broke while Redis was away fails its first
        // command and reconnects: ask twice before calling Redis down.
        if self.memory.full() {
            return Err(StoreError::Unavailable(OUT_OF_MEMORY.into()));
        }
        if self.probe().await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.probe().await
    }
}

/// Warns, once for each server named in the config, when it may evict
/// keys to make room: an evicted claim lets a retry reach the upstream a
/// second time, and an evicted record forgets its answer. Redis's
/// `maxmemory-policy` must be `noeviction` (Redis then refuses writes
/// when full, and idemgate answers 503). Asked again every few seconds
/// until the server answers, as it may be down when idemgate starts; a
/// server that refuses `CONFIG` (some managed services) is only noted.
/// With `store.wait_for_replicas` (`replicas`), a primary with fewer
/// replicas connected is warned about too ([`warn_if_short_of_replicas`]).
async fn check_servers(nodes: Vec<redis::Client>, replicas: u32) {
    futures_util::future::join_all(nodes.into_iter().map(|node| async move {
        let address = node.get_connection_info().addr().to_string();
        let asked = loop {
            match tokio::time::timeout(Duration::from_secs(5), eviction_policy(&node)).await {
                Ok(Ok(policy)) => break Ok(policy),
                Ok(Err(error)) if refused(&error) => break Err(error),
                Ok(Err(_)) | Err(_) => tokio::time::sleep(Duration::from_secs(5)).await,
            }
        };
        match asked {
            Ok(Some(policy)) if policy == "noeviction" => {}
            Ok(Some(policy)) => tracing::warn!(
                redis = %address,
                policy,
                "this Redis evicts keys when full (maxmemory-policy): an evicted claim lets a retry \
                 reach the upstream twice, an evicted record loses its answer; set maxmemory-policy \
                 to noeviction"
            ),
            Ok(None) | Err(_) => tracing::info!(
                redis = %address,
                error = asked.err().as_ref().map(tracing::field::display),
                "could not read this Redis's maxmemory-policy; it must be noeviction"
            ),
        }
        if replicas > 0 {
            warn_if_short_of_replicas(&node, &address, replicas).await;
        }
    }))
    .await;
}

/// Warns, once, if `node` is a primary with fewer than `wanted` replicas
/// connected: `store.wait_for_replicas` then refuses every write to it
/// (503) until enough acknowledge. A server that refuses `INFO`, or a
/// replica (a Cluster URL may name one), is passed over.
async fn warn_if_short_of_replicas(node: &redis::Client, address: &str, wanted: u32) {
    let Ok(Ok(info)) = tokio::time::timeout(Duration::from_secs(5), replication(node)).await else {
        return;
    };
    let field = |name: &str| info.lines().find_map(|line| line.strip_prefix(name)).map(str::trim);
    if field("role:") != Some("master") {
        return;
    }
    let connected: u32 = field("connected_slaves:").and_then(|n| n.parse().ok()).unwrap_or(0);
    if connected < wanted {
        tracing::warn!(
            redis = %address,
            connected,
            wait_for_replicas = wanted,
            "this Redis primary has fewer replicas connected than store.wait_for_replicas asks for: \
             every write to it is refused (503) until enough of them acknowledge it"
        );
    }
}

/// `node`'s `INFO replication`.
async fn replication(node: &redis::Client) -> Result<String, RedisError> {
    let mut connection = node.get_multiplexed_async_connection().await?;
    redis::cmd("INFO").arg("replication").query_async(&mut connection).await
}

/// `node`'s `maxmemory-policy`, if it names one.
async fn eviction_policy(node: &redis::Client) -> Result<Option<String>, RedisError> {
    let mut connection = node.get_multiplexed_async_connection().await?;
    let reply: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(&mut connection)
        .await?;
    Ok(reply.into_iter().nth(1))
}

/// Whether a server refused for good (CONFIG disabled, as on some managed
/// services) rather than for a moment: one still loading its data, or a
/// cluster settling, answers soon.
fn refused(error: &RedisError) -> bool {
    use redis::ServerErrorKind::{BusyLoading, ClusterDown, MasterDown, TryAgain};
    matches!(error.kind(), redis::ErrorKind::Server(kind)
        if !matches!(kind, BusyLoading | MasterDown | TryAgain | ClusterDown))
}

/// Keeps one subscription to [`CHANNEL`] alive, trying each node in turn,
/// and wakes the local waiters of every key announced on it. A failure to
/// subscribe (a node down, a user the ACL denies the channel) is logged
/// once until a subscription holds again; the tries back off to one every
/// [`SUBSCRIBE_BACKOFF`].
async fn listen(nodes: Vec<redis::Client>, prefix: KeyPrefix, waiters: Arc<Waiters>, listening: Arc<AtomicBool>) {
    let mut next = 0;
    let mut pause = SUBSCRIBE_AGAIN;
    let mut warned = false;
    loop {
        let node = &nodes[next % nodes.len()];
        next += 1;
        let subscribed = async {
            let mut pubsub = node.get_async_pubsub().await?;
            pubsub.subscribe(CHANNEL).await?;
            Ok::<_, RedisError>(pubsub)
        };
        match subscribed.await {
            Ok(mut pubsub) => {
                listening.store(true, Ordering::Relaxed);
                if warned {
                    tracing::info!("subscribed to Redis completions again");
                }
                (pause, warned) = (SUBSCRIBE_AGAIN, false);
                // Whatever completed while nobody listened: re-check now.
                waiters.wake_all();
                let mut messages = pubsub.on_message();
                while let Some(message) = messages.next().await {
                    // Another deployment's, under another prefix: not ours.
                    if let Some(key) = prefix.record_key_of(message.get_payload_bytes()) {
                        waiters.wake(&key);
                    }
                }
                listening.store(false, Ordering::Relaxed);
                tracing::warn!("lost the Redis completion subscription; reconnecting");
            }
            Err(error) => {
                if !warned {
                    warned = true;
                    // The channel's permission is named only when it is
                    // what is missing, not when Redis is down.
                    let hint = match error.kind() {
                        redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm) => {
                            concat!(" (a Redis user needs the channel: `&", channel!(), "`)")
                        }
                        _ => "",
                    };
                    tracing::warn!(
                        error = %error_chain(&unavailable(error)),
                        "cannot subscribe to Redis completions on channel {CHANNEL}; waiting requests \
                         re-check twice a second until it can{hint}"
                    );
                }
                pause = (pause * 2).min(SUBSCRIBE_BACKOFF);
            }
        }
        waiters.wake_all();
        tokio::time::sleep(pause).await;
    }
}

/// The pause before subscribing again after a subscription ends, and the
/// first between failed tries, which double up to [`SUBSCRIBE_BACKOFF`].
const SUBSCRIBE_AGAIN: Duration = Duration::from_millis(250);
/// The longest pause between tries to subscribe.
const SUBSCRIBE_BACKOFF: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_syntax_error_says_the_server_refuses_set_nx_get() {
        let answer = |wire: &[u8]| redis::parse_redis_value(wire).unwrap().extract_error().unwrap_err();
        assert!(refuses_nx_get(&answer(b"-ERR syntax error\r\n")));
        for other in [
            &b"-ERR max number of clients reached\r\n"[..],
            b"-ERR invalid password\r\n",
            b"-ERR DB index is out of range\r\n",
            b"-OOM command not allowed when used memory > 'maxmemory'.\r\n",
            b"-READONLY You can't write against a read only replica.\r\n",
            b"-NOAUTH Authentication required.\r\n",
        ] {
            assert!(!refuses_nx_get(&answer(other)), "{other:?}");
        }
    }

    #[test]
    fn arguments_a_server_quotes_back_stay_out_of_the_error() {
        let answer = redis::parse_redis_value(
            b"-ERR unknown command 'EVALSHA', with args beginning with: '3f1c' '1' 'idem:9a7b' 'tok-SECRET' \r\n",
        )
        .unwrap()
        .extract_error()
        .unwrap_err();
        let error = unavailable(answer);
        let text = crate::telemetry::error_chain(&error);
        assert!(text.contains("unknown command 'EVALSHA'"), "{text}");
        assert!(!text.contains("SECRET") && !text.contains("9a7b"), "{text}");
        assert!(matches!(error, StoreError::Unavailable(_)));
    }

    /// A redis-server of the test's own on a free loopback port, killed
    /// however the test ends: a server left running would keep the test's
    /// output open.
    struct Server {
        child: std::process::Child,
        port: u16,
    }

    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    impl Server {
        /// Runs `redis-cli` against this server.
        fn cli(&self, args: &[&str]) {
            let status = std::process::Command::new("redis-cli")
                .args(["-p", &self.port.to_string()])
                .args(args)
                .stdout(std::process::Stdio::null())
                .status()
                .expect("redis-cli must be installed (apt-get install redis-tools)");
            assert!(status.success(), "redis-cli {args:?}");
        }
    }

    /// A fresh redis-server and a store on it, once it answers.
    async fn server_and_store() -> (Server, RedisStore) {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let server = Server {
            child: std::process::Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("redis-server must be installed (apt-get install redis-server)"),
            port,
        };
        let store = RedisStore::single(
            &format!("redis://127.0.0.1:{port}/0"),
            "idemgate",
            Duration::from_secs(2),
        )
        .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while store.ping().await.is_err() {
            assert!(std::time::Instant::now() < deadline, "redis-server did not start");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        (server, store)
    }

    #[tokio::test]
    async fn a_purge_sent_again_leaves_a_newer_record_alone() {
        let (_server, store) = server_and_store().await;
        let (key, fingerprint) = (RecordKey([5; 32]), Fingerprint([1; 32]));
        let lease = Duration::from_secs(30);
        assert_eq!(
            store
                .claim(&key, &fingerprint, Owner::new(), lease, None)
                .await
                .unwrap(),
            Claim::Claimed
        );
        // The first purge read an earlier record: a newer claim stays.
        let earlier = codec::in_flight(&fingerprint, Owner::new());
        assert!(
            !store
                .purge_exact(&RedisKey::of(&store.prefix, &key), &earlier)
                .await
                .unwrap()
        );
        assert!(store.inspect(&key).await.unwrap().is_some());
        assert!(store.purge(&key).await.unwrap());
        assert!(store.inspect(&key).await.unwrap().is_none());
        assert!(!store.purge(&key).await.unwrap());
    }

    /// A server turned replica under its address (a failover) refuses a
    /// batch of completions READONLY. The connection lets go of it at
    /// once, as after a single command's READONLY, instead of reading from
    /// the replica until the thread's next claim.
    #[tokio::test]
    async fn a_batch_refused_by_a_replica_lets_go_of_its_connection() {
        let (server, store) = server_and_store().await;
        let (keys, fingerprint) = ([RecordKey([6; 32]), RecordKey([7; 32])], Fingerprint([1; 32]));
        let (owners, lease) = ([Owner::new(), Owner::new()], Duration::from_secs(30));
        for (key, owner) in keys.iter().zip(owners) {
            let claim = store.claim(key, &fingerprint, owner, lease, None).await.unwrap();
            assert_eq!(claim, Claim::Claimed);
        }
        // A replica of a primary that is not there keeps its data.
        server.cli(&["replicaof", "127.0.0.1", "1"]);
        let ttl = Duration::from_secs(60);
        let complete = |i: usize| store.complete(&keys[i], &fingerprint, owners[i], Outcome::Unknown, ttl);
        let (first, second) = tokio::join!(complete(0), complete(1));
        for done in [first, second] {
            let error = error_chain(&done.unwrap_err());
            assert!(
                error.starts_with("store unavailable: ReadOnly: You can't write"),
                "{error}"
            );
        }
        let after = store.inspect(&keys[0]).await.map(|found| found.is_some());
        let error = error_chain(&after.unwrap_err());
        assert!(error.contains("read-only replica"), "{error}");
    }

    #[test]
    fn a_thread_never_gets_a_value_another_thread_made() {
        let values = Arc::new(PerThread::<&str>::new());
        let on_a_thread = |made: &'static str| {
            let values = values.clone();
            std::thread::spawn(move || values.get_or(|| Ok(made)).unwrap())
                .join()
                .unwrap()
        };
        assert_eq!(on_a_thread("first"), "first");
        // The first thread has exited: its slot may go to the next one.
        assert_eq!(on_a_thread("second"), "second");
        assert_eq!(values.get_or(|| Ok("here")).unwrap(), "here");
        assert_eq!(values.get_or(|| Ok("again")).unwrap(), "here");
    }

    #[test]
    fn redis_keys_are_hash_tagged_and_reversible() {
        let prefix = KeyPrefix::new("idemgate");
        let key = RecordKey([0xab; 32]);
        let name = RedisKey::of(&prefix, &key);
        assert!(name.as_bytes().starts_with(b"idemgate:{abab") && name.as_bytes().ends_with(b"ab}"));
        assert_eq!(prefix.record_key_of(name.as_bytes()), Some(key));
        let key = RecordKey(std::array::from_fn(|i| i as u8 * 8));
        assert_eq!(
            RedisKey::of(&prefix, &key).as_bytes(),
            format!("idemgate:{{{}}}", hex::encode(key.0)).as_bytes()
        );
        assert_eq!(prefix.record_key_of(b"idemgate:{zz}"), None);
        // Another prefix, as long as one may be: its own keys alone.
        let long = "p".repeat(crate::config::MAX_KEY_PREFIX);
        let other = KeyPrefix::new(&long);
        let name = RedisKey::of(&other, &key);
        assert_eq!(name.as_bytes(), format!("{long}:{{{}}}", hex::encode(key.0)).as_bytes());
        assert_eq!(other.record_key_of(name.as_bytes()), Some(key));
        assert_eq!(prefix.record_key_of(name.as_bytes()), None);
    }

    /// The length of an unmarked in-flight record, as the scripts have it.
    const IN_FLIGHT_LEN: usize = 50;

    #[test]
    fn the_scripts_know_the_length_of_an_in_flight_record() {
        let record = codec::in_flight(&Fingerprint([1; 32]), Owner(7));
        assert_eq!(record.len(), IN_FLIGHT_LEN);
        for script in [WATCH, ANNOUNCE, COMPLETE_MANY] {
            assert!(script.contains(&IN_FLIGHT_LEN.to_string()), "{script}");
        }
    }
}
