//! The Redis store's way over a Redis Cluster: each command goes to the
//! primary that serves its key's hash slot, over the worker thread's own
//! [`resp`] connection to that node.
//!
//! Which node serves which slots is asked of the cluster (`CLUSTER
//! SLOTS`, of every URL given and every node known, all at once, the first
//! answer taken) before the first command, and again in the background
//! when a call says the map may have changed: a redirect, a refusal for a
//! slot no node serves, a node that cannot be reached, or a call given up
//! unanswered after half the store's timeout (a node that stops answering
//! without closing its connections, a hung process or a paused VM, gives
//! no error or redirect to learn from, and the cluster may have failed it
//! over). One such look at a time, at most one every [`REFRESH_EVERY`];
//! calls go on over the map they have meanwhile, and a command a node
//! redirects goes where the redirect says at once.
//!
//! A node that hangs holds up only the calls for its own slots: every
//! node has a connection of its own, and nothing waits on the map. The
//! redis crate's cluster client, used before, stopped every call on its
//! connection, whichever node it was for, while it rebuilt its slot map,
//! and that rebuild, set off by any redirect, waited out the hung node's
//! timeouts (a probe saw calls for healthy nodes fail for 1–2 s at a time
//! while one node was paused and a slot moved).
//!
//! A node's connection stays with the thread for as long as the process
//! runs, so a release goes behind the claim it undoes on the same
//! connection as long as the slot's node has not changed; after a failover
//! the old primary drops what it took once it rejoins as a replica.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::{Cmd, ConnectionAddr, ConnectionInfo, FromRedisValue, RedisError, RedisResult, Value};

use super::redis::{DEAD_PATH, PerThread, probes};
use super::{lock, resp};

/// A Redis Cluster's hash slots.
const SLOTS: usize = 16384;

/// How often, at most, the slot map is asked for again.
const REFRESH_EVERY: Duration = Duration::from_millis(200);

/// How many times a command a cluster refused for a moment (a redirect, a
/// dropped connection, `TRYAGAIN`) is sent again.
const RETRIES: u32 = 2;

/// The pause before sending again a command a cluster said to try later
/// (`TRYAGAIN`, `CLUSTERDOWN`), times the tries so far.
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// A node's address, as the cluster names it.
type Node = (String, u16);

/// Which node serves each range of slots, as `CLUSTER SLOTS` answers:
/// first slot, last slot and the primary's address, in order.
pub(super) type SlotOwners = Vec<(i64, i64, String, i64)>;

/// [`SlotOwners`] from a `CLUSTER SLOTS` answer.
pub(super) fn slot_owners(answer: &Value) -> Option<SlotOwners> {
    let Value::Array(ranges) = answer else {
        return None;
    };
    let text = |value: &Value| match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(text) => Some(text.clone()),
        _ => None,
    };
    let mut owners = ranges
        .iter()
        .map(|range| {
            let Value::Array(range) = range else {
                return None;
            };
            let (Some(Value::Int(first)), Some(Value::Int(last)), Some(Value::Array(primary))) =
                (range.first(), range.get(1), range.get(2))
            else {
                return None;
            };
            let (Some(host), Some(Value::Int(port))) = (primary.first().and_then(text), primary.get(1)) else {
                return None;
            };
            Some((*first, *last, host, *port))
        })
        .collect::<Option<SlotOwners>>()?;
    owners.sort_unstable();
    Some(owners)
}

/// Which node serves each slot.
struct SlotMap {
    owners: SlotOwners,
    nodes: Vec<Node>,
    /// An index into `nodes` per slot; [`NO_NODE`] for a slot none serves.
    slots: Box<[u16]>,
}

const NO_NODE: u16 = u16::MAX;

impl SlotMap {
    fn empty() -> SlotMap {
        SlotMap {
            owners: Vec::new(),
            nodes: Vec::new(),
            slots: vec![NO_NODE; SLOTS].into_boxed_slice(),
        }
    }

    fn new(owners: SlotOwners) -> SlotMap {
        let mut map = SlotMap::empty();
        for (first, last, host, port) in &owners {
            let Ok(port) = u16::try_from(*port) else {
                continue;
            };
            let node = (host.clone(), port);
            let index = match map.nodes.iter().position(|n| *n == node) {
                Some(index) => index,
                None => {
                    map.nodes.push(node);
                    map.nodes.len() - 1
                }
            };
            let (first, last) = ((*first).max(0) as usize, (*last).max(-1) as usize);
            for slot in map.slots.iter_mut().take(last.saturating_add(1).min(SLOTS)).skip(first) {
                *slot = index as u16;
            }
        }
        map.owners = owners;
        map
    }

    fn node(&self, slot: u16) -> Option<&Node> {
        self.nodes.get(usize::from(*self.slots.get(usize::from(slot))?))
    }
}

/// A Redis Cluster, reached through any of its URLs.
pub(super) struct Cluster {
    /// The first URL's: how every node is reached (its user, password and
    /// database), at the node's own address.
    template: Box<ConnectionInfo>,
    /// The store's timeout: a connect's, and a map request's.
    timeout: Duration,
    /// The URLs' addresses, always asked for the map.
    seeds: Vec<Node>,
    maps: Arc<Maps>,
    /// Held while the first map is asked for: the calls meanwhile wait for
    /// it instead of each asking.
    first: tokio::sync::Mutex<()>,
    threads: PerThread<Arc<Mutex<Thread>>>,
}

/// The map in use, and how asking for the next one stands.
struct Maps {
    map: Mutex<Arc<SlotMap>>,
    /// Bumped with each new map, so each thread takes it up.
    generation: AtomicU64,
    refresh: Mutex<Refresh>,
}

impl Maps {
    fn install(&self, owners: SlotOwners) {
        *lock(&self.map) = Arc::new(SlotMap::new(owners));
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Puts `owners` in use if they differ from the map in use.
    fn take(&self, owners: SlotOwners) {
        if lock(&self.map).owners != owners {
            tracing::debug!("the Redis Cluster's slot map has changed");
            self.install(owners);
        }
    }
}

#[derive(Default)]
struct Refresh {
    /// One is under way.
    running: bool,
    /// When the last one started.
    at: Option<Instant>,
    /// Asking for the first map failed: not again until this says.
    backoff: resp::Backoff,
}

/// A thread's map and connections.
struct Thread {
    generation: u64,
    map: Arc<SlotMap>,
    connections: HashMap<Node, resp::Connection>,
}

impl Cluster {
    /// A cluster found through `urls`; each must be plain TCP.
    pub(super) fn new(urls: &[ConnectionInfo], timeout: Duration) -> RedisResult<Cluster> {
        let template = urls
            .first()
            .cloned()
            .ok_or_else(|| RedisError::from((redis::ErrorKind::InvalidClientConfig, "no Redis Cluster URL")))?;
        let mut seeds = Vec::new();
        for url in urls {
            // Refused here (TLS), not at the first call.
            resp::Target::new(url, timeout, DEAD_PATH, probes())?;
            if let ConnectionAddr::Tcp(host, port) = url.addr() {
                seeds.push((host.clone(), *port));
            }
        }
        Ok(Cluster {
            template: Box::new(template),
            timeout,
            seeds,
            maps: Arc::new(Maps {
                map: Mutex::new(Arc::new(SlotMap::empty())),
                generation: AtomicU64::new(0),
                refresh: Mutex::default(),
            }),
            first: tokio::sync::Mutex::new(()),
            threads: PerThread::new(),
        })
    }

    /// Sends `command` to the node that serves its key and reads its
    /// answer as `T`, following a redirect at once (`ASK` with `ASKING`
    /// before the command, the two written together) and sending again
    /// after a refusal for a moment (`TRYAGAIN`, `CLUSTERDOWN`, a dropped
    /// connection), up to [`RETRIES`] times in all; never after a node
    /// left it unanswered for `store.timeout` (a timer of its own), when
    /// the command may yet run.
    pub(super) async fn query<T: FromRedisValue>(&self, command: &Cmd) -> RedisResult<T> {
        let slot = key_of(command)
            .map(slot_of)
            .ok_or_else(|| resp::not_sent("a command to a Redis Cluster names no key".to_owned()))?;
        let mut unanswered = Unanswered {
            cluster: self,
            since: Instant::now(),
            answered: false,
        };
        let mut retries = 0;
        let mut redirect: Option<(Node, bool)> = None;
        loop {
            let attempt = async {
                match redirect.take() {
                    None => self.owner(slot).await?.query(command).await,
                    Some((node, true)) => self.connection(&node).query_asking(command).await,
                    Some((node, false)) => self.connection(&node).query(command).await,
                }
            };
            // A timer of its own, as the store's deadline does not always
            // end the call: a claim that outlives it is seen through.
            let Ok(result) = tokio::time::timeout(self.timeout, attempt).await else {
                return Err(RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the Redis Cluster node did not answer within store.timeout",
                )));
            };
            unanswered.answered = true;
            let Err(error) = &result else {
                return result;
            };
            let method = error.retry_method();
            let asking = error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::Ask);
            // Anything but an `ASK` (a slot migrating, as the map says) or
            // a plain refusal of the command may mean a new map.
            if (!asking && !matches!(method, redis::RetryMethod::NoRetry)) || error.kind() == redis::ErrorKind::Client {
                self.refresh_soon();
            }
            if retries == RETRIES {
                return result;
            }
            retries += 1;
            match method {
                redis::RetryMethod::NoRetry => return result,
                redis::RetryMethod::WaitAndRetry => tokio::time::sleep(RETRY_PAUSE * retries).await,
                // `READONLY`: the node is a replica now, failed over.
                redis::RetryMethod::RefreshSlotsAndRetry => {
                    if let Some(owners) = first_answer(self.asks(), self.timeout).await {
                        self.maps.take(owners);
                    }
                }
                redis::RetryMethod::AskRedirect | redis::RetryMethod::MovedRedirect => {
                    let Some(node) = redirect_node(error) else {
                        return result;
                    };
                    redirect = Some((node, asking));
                }
                // A dropped connection, made again by the next command.
                _ => {}
            }
            unanswered.since = Instant::now();
            unanswered.answered = false;
        }
    }

    /// This thread's connection to the node that serves `slot`; the map is
    /// asked for first if there is none yet.
    async fn owner(&self, slot: u16) -> RedisResult<resp::Connection> {
        if self.maps.generation.load(Ordering::Acquire) == 0 {
            self.first_map().await?;
        }
        let thread = self.thread();
        let mut thread = lock(&thread);
        let generation = self.maps.generation.load(Ordering::Acquire);
        if thread.generation != generation {
            thread.map = lock(&self.maps.map).clone();
            thread.generation = generation;
        }
        let Some(node) = thread.map.node(slot).cloned() else {
            drop(thread);
            self.refresh_soon();
            return Err(resp::not_sent(format!(
                "no node of the Redis Cluster serves hash slot {slot}"
            )));
        };
        Ok(self.connection_in(&mut thread, &node))
    }

    /// This thread's connection to `node`, made on first use.
    fn connection(&self, node: &Node) -> resp::Connection {
        let thread = self.thread();
        let mut thread = lock(&thread);
        self.connection_in(&mut thread, node)
    }

    fn connection_in(&self, thread: &mut Thread, node: &Node) -> resp::Connection {
        if let Some(connection) = thread.connections.get(node) {
            return connection.clone();
        }
        let info = self
            .template
            .clone()
            .set_addr(ConnectionAddr::Tcp(node.0.clone(), node.1));
        let target = resp::Target::new(&info, self.timeout, DEAD_PATH, probes())
            .expect("a plain TCP address, as every URL was checked to be");
        let connection = resp::Connection::new(Arc::new(target));
        thread.connections.insert(node.clone(), connection.clone());
        connection
    }

    fn thread(&self) -> Arc<Mutex<Thread>> {
        self.threads
            .get_or(|| {
                Ok(Arc::new(Mutex::new(Thread {
                    generation: 0,
                    map: Arc::new(SlotMap::empty()),
                    connections: HashMap::new(),
                })))
            })
            .expect("made without fail")
    }

    /// Asks for the map before the first command; one at a time, the
    /// others waiting for it. A cluster none of whose nodes answers is not
    /// asked again for a while ([`resp::Backoff`]): calls meanwhile fail
    /// at once, as not sent.
    async fn first_map(&self) -> RedisResult<()> {
        let _first = self.first.lock().await;
        if self.maps.generation.load(Ordering::Acquire) != 0 {
            return Ok(());
        }
        if let Some(why) = lock(&self.maps.refresh).backoff.waiting() {
            return Err(resp::not_sent(why));
        }
        match first_answer(self.asks(), self.timeout).await {
            Some(owners) => {
                self.maps.install(owners);
                lock(&self.maps.refresh).backoff = resp::Backoff::default();
                Ok(())
            }
            None => {
                let why = "the Redis Cluster could not be reached: no node answered which node serves \
                           which slots"
                    .to_owned();
                lock(&self.maps.refresh).backoff.failed(why.clone());
                Err(resp::not_sent(why))
            }
        }
    }

    /// Asks for the map again in the background, unless a look is under
    /// way or one started within [`REFRESH_EVERY`]; a map that differs
    /// replaces the one in use.
    fn refresh_soon(&self) {
        {
            let mut refresh = lock(&self.maps.refresh);
            if refresh.running || refresh.at.is_some_and(|at| at.elapsed() < REFRESH_EVERY) {
                return;
            }
            refresh.running = true;
            refresh.at = Some(Instant::now());
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            lock(&self.maps.refresh).running = false;
            return;
        };
        let (asks, maps, timeout) = (self.asks(), self.maps.clone(), self.timeout);
        runtime.spawn(async move {
            if let Some(owners) = first_answer(asks, timeout).await {
                maps.take(owners);
            }
            lock(&maps.refresh).running = false;
        });
    }

    /// This thread's connections to each URL and each node of the map, to
    /// ask for the map.
    fn asks(&self) -> Vec<resp::Connection> {
        let mut nodes = self.seeds.clone();
        for node in &lock(&self.maps.map).nodes {
            if !nodes.contains(node) {
                nodes.push(node.clone());
            }
        }
        nodes.iter().map(|node| self.connection(node)).collect()
    }
}

/// The map from whichever of `asks` answers `CLUSTER SLOTS` first, within
/// `timeout`; `None` if none does.
async fn first_answer(asks: Vec<resp::Connection>, timeout: Duration) -> Option<SlotOwners> {
    let asks: Vec<_> = asks
        .into_iter()
        .map(|connection| {
            Box::pin(async move {
                let command = redis::cmd("CLUSTER").arg("SLOTS").clone();
                let ask = connection.query(&command);
                let answer: Value = tokio::time::timeout(timeout, ask).await.map_err(drop)?.map_err(drop)?;
                slot_owners(&answer).ok_or(())
            })
        })
        .collect();
    if asks.is_empty() {
        return None;
    }
    futures_util::future::select_ok(asks)
        .await
        .ok()
        .map(|(owners, _)| owners)
}

/// Asks for the map again when dropped unanswered after half the store's
/// timeout: its node may have stopped, and the cluster failed it over.
struct Unanswered<'a> {
    cluster: &'a Cluster,
    since: Instant,
    answered: bool,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if !self.answered && self.since.elapsed() >= self.cluster.timeout / 2 {
            self.cluster.refresh_soon();
        }
    }
}

/// The node a `MOVED` or `ASK` redirect names.
fn redirect_node(error: &RedisError) -> Option<Node> {
    let (node, _slot) = error.redirect_node()?;
    let (host, port) = node.rsplit_once(':')?;
    Some((host.trim_matches(['[', ']']).to_owned(), port.parse().ok()?))
}

/// The key a command acts on: the first, for the commands the store sends
/// (`EVALSHA` and `EVAL` name theirs after the script and the key count).
fn key_of(command: &Cmd) -> Option<&[u8]> {
    let mut args = command.args_iter().map(|arg| match arg {
        redis::Arg::Simple(bytes) => bytes,
        _ => &[],
    });
    let name = args.next()?;
    if name.eq_ignore_ascii_case(b"EVALSHA") || name.eq_ignore_ascii_case(b"EVAL") {
        args.nth(2)
    } else {
        args.next()
    }
}

/// The hash slot of `key`: CRC16 (XMODEM) of its hash tag, the part
/// between its first `{` and the next `}` when not empty, else of all of
/// it, modulo 16384.
fn slot_of(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16(tagged.unwrap_or(key)) % SLOTS as u16
}

fn crc16(bytes: &[u8]) -> u16 {
    bytes.iter().fold(0u16, |crc, &byte| {
        (crc << 8) ^ CRC16[usize::from((crc >> 8) as u8 ^ byte)]
    })
}

/// CRC16-CCITT (XMODEM, polynomial 0x1021) by byte.
const CRC16: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_redis_clusters() {
        // Redis Cluster's specification: CRC16 of "123456789" is 0x31C3.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        // As `CLUSTER KEYSLOT` answers.
        assert_eq!(slot_of(b"foo"), 12182);
        assert_eq!(slot_of(b"{user1000}.following"), slot_of(b"user1000"));
        assert_eq!(slot_of(b"foo{}{bar}"), crc16(b"foo{}{bar}") % 16384);
        assert_eq!(slot_of(b"foo{{bar}}zap"), slot_of(b"{bar"));
    }

    #[test]
    fn a_command_is_routed_by_its_key() {
        let set = redis::cmd("SET").arg("k1").arg("v").clone();
        assert_eq!(key_of(&set), Some(&b"k1"[..]));
        let eval = redis::cmd("EVALSHA").arg("abc").arg(1).arg("k2").arg("x").clone();
        assert_eq!(key_of(&eval), Some(&b"k2"[..]));
    }

    #[test]
    fn a_map_gives_each_slot_its_node() {
        let map = SlotMap::new(vec![
            (0, 5460, "127.0.0.1".into(), 7000),
            (5461, 10922, "127.0.0.1".into(), 7001),
            (10923, 16383, "127.0.0.1".into(), 7000),
        ]);
        assert_eq!(map.node(0), Some(&("127.0.0.1".to_owned(), 7000)));
        assert_eq!(map.node(5461), Some(&("127.0.0.1".to_owned(), 7001)));
        assert_eq!(map.node(16383), Some(&("127.0.0.1".to_owned(), 7000)));
        assert_eq!(map.nodes.len(), 2);
        let gap = SlotMap::new(vec![(0, 99, "127.0.0.1".into(), 7000)]);
        assert_eq!(gap.node(100), None);
    }
}
