//! The Redis store's way over a Redis Cluster: each command goes to the
//! primary that serves its key's hash slot, over the worker thread's own
//! [`resp`] connection to that node.
//!
//! Which node serves which slots is asked of the cluster (`CLUSTER
//! SLOTS`, of every URL given and every node known, all at once, the map
//! most answer with taken: see [`agreed_answer`]) before the first
//! command, and again in the background
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

use super::redis::{DEAD_PATH, PerThread, copy_wait, probes};
use super::{lock, resp};
use crate::clock::coarse_now;

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

/// [`SlotOwners`] from a `CLUSTER SLOTS` answer of the node at `asked`.
/// A primary named with no address of its own (`NULL` when its endpoint
/// type is `unknown-endpoint`, empty, or `0.0.0.0` or `::`) is the node
/// asked's host; a range whose primary is named `?` (a hostname endpoint
/// with no hostname set) has none.
pub(super) fn slot_owners(answer: &Value, asked: &str) -> Option<SlotOwners> {
    let Value::Array(ranges) = answer else {
        return None;
    };
    let host = |value: Option<&Value>| {
        let name = match value? {
            Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
            Value::SimpleString(text) => text.clone(),
            Value::Nil => String::new(),
            _ => return None,
        };
        Some(match name.as_str() {
            "" | "0.0.0.0" | "::" => asked.to_owned(),
            _ => name,
        })
    };
    let mut owners = SlotOwners::new();
    for range in ranges {
        let Value::Array(range) = range else {
            return None;
        };
        let (Some(Value::Int(first)), Some(Value::Int(last)), Some(Value::Array(primary))) =
            (range.first(), range.get(1), range.get(2))
        else {
            return None;
        };
        let (Some(host), Some(Value::Int(port))) = (host(primary.first()), primary.get(1)) else {
            return None;
        };
        if host != "?" {
            owners.push((*first, *last, host, *port));
        }
    }
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

    /// The index in `nodes` of the node that serves `slot`.
    fn index(&self, slot: u16) -> Option<usize> {
        let index = *self.slots.get(usize::from(slot))?;
        (index != NO_NODE).then_some(usize::from(index))
    }

    fn node(&self, slot: u16) -> Option<&Node> {
        self.nodes.get(self.index(slot)?)
    }
}

/// A Redis Cluster, reached through any of its URLs.
pub(super) struct Cluster {
    /// The first URL's: how every node is reached (its user, password and
    /// database), at the node's own address.
    template: Box<ConnectionInfo>,
    /// The store's timeout: a command's, and a map request's.
    timeout: Duration,
    /// How many replicas must hold a write (`store.wait_for_replicas`).
    replicas: u32,
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

/// Marks a look at the map finished when dropped: at its end, or when its
/// task is dropped unfinished (a runtime shutting down).
struct Running(Arc<Maps>);

impl Drop for Running {
    fn drop(&mut self) {
        lock(&self.0.refresh).running = false;
    }
}

/// A thread's map and connections.
struct Thread {
    generation: u64,
    map: Arc<SlotMap>,
    /// The connection to each node of `map`, by its index there, once made.
    by_index: Vec<Option<resp::Connection>>,
    /// Every connection, by node: those of the map, the URLs' and those to
    /// nodes redirects named.
    connections: HashMap<Node, resp::Connection>,
}

impl Thread {
    /// Takes up `map`, and lets go of the connections to nodes neither it
    /// nor `seeds` name.
    fn take_up(&mut self, map: Arc<SlotMap>, generation: u64, seeds: &[Node]) {
        self.connections
            .retain(|node, _| map.nodes.contains(node) || seeds.contains(node));
        self.by_index = map.nodes.iter().map(|n| self.connections.get(n).cloned()).collect();
        self.map = map;
        self.generation = generation;
    }
}

impl Cluster {
    /// A cluster found through `urls`; each must be plain TCP.
    /// Its writes count once `replicas` of their node's replicas hold them
    /// ([`resp::Target::copied_to`]).
    pub(super) fn new(urls: &[ConnectionInfo], timeout: Duration, replicas: u32) -> RedisResult<Cluster> {
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
            replicas,
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
    /// after a refusal for a moment (`TRYAGAIN`, `CLUSTERDOWN`, `READONLY`,
    /// a dropped connection), up to [`RETRIES`] times in all; never after
    /// a node left it unanswered, for `store.timeout` (a timer of each
    /// try's own) or until the connection's own timeout, when the command
    /// may yet run.
    ///
    /// A command that `writes` nothing is not held for its node's replicas
    /// ([`resp::Connection::query_as`]). A try that was never written
    /// after one that was (its connection dropped with the answer on the
    /// way, and the next could not connect) fails as a command that may
    /// have run, not as one never sent: a claim may have been taken, and
    /// must be released.
    pub(super) async fn query<T: FromRedisValue>(&self, command: &Cmd, writes: bool) -> RedisResult<T> {
        let mut written = false;
        let result = self.tries(command, writes, &mut written).await;
        result.map_err(|error| {
            if written && error.kind() == redis::ErrorKind::Client {
                resp::broken(format!(
                    "an earlier try was written and its answer lost, so it may have run; the last was not sent: {error}"
                ))
            } else {
                error
            }
        })
    }

    /// [`Cluster::query`]'s tries; `written` is set once one of them was
    /// written to a node.
    async fn tries<T: FromRedisValue>(&self, command: &Cmd, writes: bool, written: &mut bool) -> RedisResult<T> {
        let slot = key_of(command)
            .map(slot_of)
            .ok_or_else(|| resp::not_sent("a command to a Redis Cluster names no key".to_owned()))?;
        let mut unanswered = Unanswered {
            cluster: self,
            since: coarse_now(),
            answered: false,
        };
        let mut retries = 0;
        let mut redirect: Option<(Node, bool)> = None;
        loop {
            let (connection, asking) = match &redirect {
                None => (self.owner(slot).await?, false),
                Some((node, asking)) => (self.connection(node), *asking),
            };
            let sent = async {
                if asking {
                    connection.query_asking(command, writes).await
                } else {
                    connection.query_as(command, writes).await
                }
            };
            // A timer of its own, as the store's deadline does not always
            // end the call: a claim that outlives it is seen through.
            let Ok(result) = tokio::time::timeout(self.timeout, sent).await else {
                return Err(RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the Redis Cluster node did not answer within store.timeout",
                )));
            };
            unanswered.answered = true;
            let Err(error) = &result else {
                return result;
            };
            // Written, and no answer came (a refusal, `MOVED` or `ASK`
            // among them, says it did not run).
            *written |= error.kind() != redis::ErrorKind::Client && error.code().is_none();
            let method = error.retry_method();
            let ask = error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::Ask);
            // Anything but an `ASK` (a slot migrating, as the map says) or
            // a plain refusal of the command may mean a new map.
            let plain = matches!(method, redis::RetryMethod::NoRetry);
            if (!ask && !plain) || error.kind() == redis::ErrorKind::Client || error.is_timeout() {
                self.refresh_soon();
            }
            if retries == RETRIES || error.is_timeout() {
                return result;
            }
            retries += 1;
            let from = redirect.take();
            match method {
                redis::RetryMethod::NoRetry => return result,
                // `READONLY`: the node is a replica now, failed over.
                redis::RetryMethod::WaitAndRetry | redis::RetryMethod::RefreshSlotsAndRetry => {
                    tokio::time::sleep(RETRY_PAUSE * retries).await
                }
                redis::RetryMethod::AskRedirect | redis::RetryMethod::MovedRedirect => {
                    // A node with no address of its own to give names none.
                    let from = from
                        .map(|(node, _)| node.0)
                        .or_else(|| self.thread_node(slot).map(|n| n.0));
                    let Some(node) = redirect_node(error, from.as_deref().unwrap_or_default()) else {
                        return result;
                    };
                    redirect = Some((node, ask));
                }
                // A dropped connection, made again by the next command.
                _ => {}
            }
            unanswered.since = coarse_now();
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
        self.take_up(&mut thread);
        let Some(index) = thread.map.index(slot) else {
            drop(thread);
            self.refresh_soon();
            return Err(resp::not_sent(format!(
                "no node of the Redis Cluster serves hash slot {slot}"
            )));
        };
        if let Some(connection) = &thread.by_index[index] {
            return Ok(connection.clone());
        }
        let node = thread.map.nodes[index].clone();
        let connection = self.connection_in(&mut thread, &node);
        thread.by_index[index] = Some(connection.clone());
        Ok(connection)
    }

    /// Brings `thread` up to the map in use.
    fn take_up(&self, thread: &mut Thread) {
        let generation = self.maps.generation.load(Ordering::Acquire);
        if thread.generation != generation {
            let map = lock(&self.maps.map).clone();
            thread.take_up(map, generation, &self.seeds);
        }
    }

    /// The node that serves `slot` in this thread's map.
    fn thread_node(&self, slot: u16) -> Option<Node> {
        let thread = self.thread();
        let thread = lock(&thread);
        thread.map.node(slot).cloned()
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
            .expect("a plain TCP address, as every URL was checked to be")
            .copied_to(self.replicas, copy_wait(self.timeout));
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
                    by_index: Vec::new(),
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
        match agreed_answer(self.asks(), self.timeout).await {
            Ok(owners) => {
                self.maps.install(owners);
                lock(&self.maps.refresh).backoff = resp::Backoff::default();
                Ok(())
            }
            Err(why) => {
                let why = format!("the Redis Cluster could not be reached: {why}");
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
        let running = Running(self.maps.clone());
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (asks, timeout) = (self.asks(), self.timeout);
        runtime.spawn(async move {
            if let Ok(owners) = agreed_answer(asks, timeout).await {
                running.0.take(owners);
            }
            drop(running);
        });
    }

    /// This thread's connections to each URL and each node of the map, to
    /// ask for the map, with their nodes' hosts.
    fn asks(&self) -> Vec<(String, resp::Connection)> {
        let mut nodes = self.seeds.clone();
        for node in &lock(&self.maps.map).nodes {
            if !nodes.contains(node) {
                nodes.push(node.clone());
            }
        }
        nodes
            .into_iter()
            .map(|node| {
                let connection = self.connection(&node);
                (node.0, connection)
            })
            .collect()
    }
}

/// How long, after the first answer, a look at the map waits for more
/// nodes to agree with it (or not): nodes on one network answer within a
/// millisecond or two of each other.
const AGREE_WITHIN: Duration = Duration::from_millis(100);

/// The map that most of `asks` answer `CLUSTER SLOTS` with, within
/// `timeout`; else why none answered.
///
/// Not simply the first answer: a primary that resumes after a pause (a
/// stopped process, a frozen VM) answers at once with its view from before
/// the cluster failed it over, until the others tell it, and claims sent
/// by that view would land on a node about to drop them. The answers are
/// tallied as they come, one vote a node (each asked its `CLUSTER MYID`
/// too: a URL and the name the cluster gives the same node are one
/// voter), until one map has more than half the nodes asked behind it, or
/// every node has answered or failed, or [`AGREE_WITHIN`] has passed since
/// the first answer; then the map most answered with (the first to come of
/// those tied) is taken.
async fn agreed_answer(asks: Vec<(String, resp::Connection)>, timeout: Duration) -> Result<SlotOwners, String> {
    use futures_util::StreamExt;

    if asks.is_empty() {
        return Err("no Redis Cluster URL".to_owned());
    }
    let mut tally = Tally::new(asks.len());
    let mut answers: futures_util::stream::FuturesUnordered<_> = asks
        .into_iter()
        .map(|(host, connection)| async move {
            let command = redis::cmd("CLUSTER").arg("SLOTS").clone();
            let answer: Value = connection
                .query_as(&command, false)
                .await
                .map_err(|error| resp::unquoted(&error.to_string()).into_owned())?;
            let owners =
                slot_owners(&answer, &host).ok_or_else(|| "CLUSTER SLOTS answered outside its form".to_owned())?;
            // Asked once the map has come, so a node that cannot be reached
            // fails on the map, as it always did. A user not allowed
            // `CLUSTER MYID` still votes, as a node of its own.
            let id: Option<String> = connection
                .query_as(&redis::cmd("CLUSTER").arg("MYID").clone(), false)
                .await
                .ok();
            Ok::<_, String>((id, owners))
        })
        .collect();
    let mut refused = None;
    let mut deadline = tokio::time::Instant::now() + timeout;
    loop {
        match tokio::time::timeout_at(deadline, answers.next()).await {
            Ok(Some(Ok((id, owners)))) => {
                if tally.is_empty() {
                    deadline = deadline.min(tokio::time::Instant::now() + AGREE_WITHIN);
                }
                if let Some(agreed) = tally.add(id, owners) {
                    return Ok(agreed);
                }
            }
            Ok(Some(Err(error))) => refused = Some(error),
            // Every node answered or failed.
            Ok(None) => break,
            Err(_) if !tally.is_empty() => break,
            Err(_) => {
                let late = "no node answered which node serves which slots in time";
                return Err(refused.map_or_else(|| late.to_owned(), |why| format!("{late} (one refused: {why})")));
            }
        }
    }
    tally
        .most()
        .ok_or_else(|| refused.unwrap_or_else(|| "no node answered which node serves which slots".to_owned()))
}

/// The maps nodes answered with, and how many answered each.
struct Tally {
    /// The nodes asked, less those asked twice under two names.
    asked: usize,
    /// The ids of the nodes that answered.
    voters: Vec<String>,
    maps: Vec<(SlotOwners, usize)>,
}

impl Tally {
    fn new(asked: usize) -> Tally {
        Tally {
            asked,
            voters: Vec::new(),
            maps: Vec::new(),
        }
    }

    fn is_empty(&self) -> bool {
        self.maps.is_empty()
    }

    /// Counts the answer of the node `id` (unknown: a node of its own):
    /// the map more than half the nodes asked have answered with, once one
    /// has. A node answering a second time (asked under two names) is not
    /// counted again, and was one node asked, not two.
    fn add(&mut self, id: Option<String>, owners: SlotOwners) -> Option<SlotOwners> {
        match id {
            Some(id) if self.voters.contains(&id) => self.asked = self.asked.saturating_sub(1),
            id => {
                self.voters.extend(id);
                match self.maps.iter_mut().find(|(map, _)| *map == owners) {
                    Some((_, votes)) => *votes += 1,
                    None => self.maps.push((owners, 1)),
                }
            }
        }
        let asked = self.asked;
        self.maps
            .iter()
            .find(|(_, votes)| votes * 2 > asked)
            .map(|(map, _)| map.clone())
    }

    /// The map most answered with; of those tied, the first to come.
    fn most(self) -> Option<SlotOwners> {
        let top = self.maps.iter().map(|(_, votes)| *votes).max()?;
        self.maps
            .into_iter()
            .find(|(_, votes)| *votes == top)
            .map(|(map, _)| map)
    }
}

/// Asks for the map again when dropped unanswered after half the store's
/// timeout: its node may have stopped, and the cluster failed it over.
struct Unanswered<'a> {
    cluster: &'a Cluster,
    since: tokio::time::Instant,
    answered: bool,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if !self.answered && coarse_now().saturating_duration_since(self.since) >= self.cluster.timeout / 2 {
            self.cluster.refresh_soon();
        }
    }
}

/// The node a `MOVED` or `ASK` redirect names; a redirect that names no
/// host (from a node whose endpoint type is `unknown-endpoint`) names one
/// on `from`, the host of the node that sent it.
fn redirect_node(error: &RedisError, from: &str) -> Option<Node> {
    let (node, _slot) = error.redirect_node()?;
    let (host, port) = node.rsplit_once(':')?;
    let host = match host.trim_matches(['[', ']']) {
        "" => from,
        host => host,
    };
    if host.is_empty() {
        return None;
    }
    Some((host.to_owned(), port.parse().ok()?))
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

    #[test]
    fn the_map_most_nodes_answer_with_is_taken() {
        let map = |port| vec![(0, 16383, "127.0.0.1".to_owned(), port)];
        let node = |id: &str| Some(id.to_owned());
        // Six nodes asked; the first to answer alone in its view.
        let mut tally = Tally::new(6);
        assert_eq!(tally.add(node("a"), map(7000)), None);
        for id in ["b", "c", "d"] {
            assert_eq!(tally.add(node(id), map(7001)), None);
        }
        assert_eq!(tally.add(node("e"), map(7001)), Some(map(7001)), "four of six");
        // Fewer answered than half: the map most answered with, the first
        // to come of those tied.
        let mut tally = Tally::new(6);
        tally.add(node("a"), map(7000));
        tally.add(node("b"), map(7001));
        tally.add(node("c"), map(7001));
        assert_eq!(tally.most(), Some(map(7001)));
        let mut tally = Tally::new(6);
        tally.add(None, map(7002));
        tally.add(None, map(7000));
        assert_eq!(tally.most(), Some(map(7002)));
        assert_eq!(Tally::new(3).most(), None);
        // One node asked: its answer is the map.
        assert_eq!(Tally::new(1).add(None, map(7000)), Some(map(7000)));
        // A node asked under two names (a URL and the cluster's name for
        // it) votes once, and was one node asked: of four asks for three
        // nodes, the two others agreeing are a majority.
        let mut tally = Tally::new(4);
        assert_eq!(tally.add(node("a"), map(7000)), None);
        assert_eq!(tally.add(node("a"), map(7000)), None);
        assert_eq!(tally.add(node("b"), map(7001)), None);
        assert_eq!(tally.add(node("c"), map(7001)), Some(map(7001)));
    }

    /// A look at the map that never starts, or whose task a runtime
    /// shutting down drops, does not keep every later one from starting.
    #[test]
    fn a_look_at_the_map_left_unfinished_is_not_left_running() {
        let url = redis::IntoConnectionInfo::into_connection_info("redis://127.0.0.1:1").unwrap();
        let cluster = Cluster::new(&[url], Duration::from_millis(100), 0).unwrap();
        let running = || lock(&cluster.maps.refresh).running;
        cluster.refresh_soon();
        assert!(!running(), "with no runtime to run it");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            lock(&cluster.maps.refresh).at = None;
            cluster.refresh_soon();
            assert!(running());
        });
        drop(runtime);
        assert!(!running(), "its task dropped unfinished");
    }

    fn parsed(resp: &[u8]) -> Value {
        redis::parse_redis_value(resp).unwrap()
    }

    /// A primary named with no address of its own is the node asked; one
    /// named `?` serves nothing, as the redis crate read them.
    #[test]
    fn a_slot_map_names_each_primary_by_an_address_to_reach() {
        let answer = parsed(
            b"*4\r\n\
              *3\r\n:0\r\n:99\r\n*2\r\n$9\r\n127.0.0.2\r\n:7000\r\n\
              *3\r\n:100\r\n:199\r\n*2\r\n$-1\r\n:7001\r\n\
              *3\r\n:200\r\n:299\r\n*2\r\n$0\r\n\r\n:7002\r\n\
              *3\r\n:300\r\n:399\r\n*2\r\n$1\r\n?\r\n:7003\r\n",
        );
        let owners = slot_owners(&answer, "10.0.0.1").unwrap();
        assert_eq!(
            owners,
            vec![
                (0, 99, "127.0.0.2".to_owned(), 7000),
                (100, 199, "10.0.0.1".to_owned(), 7001),
                (200, 299, "10.0.0.1".to_owned(), 7002),
            ]
        );
        assert_eq!(slot_owners(&parsed(b"$2\r\nno\r\n"), "10.0.0.1"), None);
    }

    #[test]
    fn a_redirect_with_no_host_names_the_node_that_sent_it() {
        let redirect = |resp: &[u8]| parsed(resp).extract_error().unwrap_err();
        let moved = redirect(b"-MOVED 3999 127.0.0.3:6381\r\n");
        assert_eq!(redirect_node(&moved, "10.0.0.1"), Some(("127.0.0.3".to_owned(), 6381)));
        let bare = redirect(b"-MOVED 3999 :6380\r\n");
        assert_eq!(redirect_node(&bare, "10.0.0.1"), Some(("10.0.0.1".to_owned(), 6380)));
        let ask = redirect(b"-ASK 3999 ::1:6382\r\n");
        assert_eq!(redirect_node(&ask, ""), Some(("::1".to_owned(), 6382)));
    }
}
