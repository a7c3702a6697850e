//! A lean connection to one Redis server, for the Redis store's commands.
//!
//! Each worker thread has one to each server (see `RedisStore`; on a
//! Redis Cluster, to each node, see `cluster`). A command is written into
//! the connection's outgoing buffer and a slot for its answer queued behind
//! the others, both under one lock that only that thread takes on the way
//! of a request; a writer task sends whatever has gathered in one write,
//! and a reader task parses the answers as they come and hands each to the
//! oldest slot, as Redis answers in order. Against the redis crate's
//! multiplexed connection behind its reconnecting manager, it skips a
//! channel hop and a boxed future per command and a generic parser per
//! answer (on new keys, 58.8k -> 55.1k instructions per request under
//! callgrind; bench/RESULTS.md).
//!
//! The connection is made on first use and again after it breaks. A broken
//! one fails every command sent on it and not yet answered (each may or
//! may not have run, as with any connection that drops; those it never
//! wrote fail as not sent, so a claim among them is known to have taken
//! nothing and needs no release), and the next
//! command connects anew; at most one connect is in flight, and commands
//! sent meanwhile wait for it in the buffer. A connect that fails (refused,
//! timed out, its greeting turned down) is not tried again for a while
//! ([`Backoff`]: 25 ms, doubling to 1 s); commands meanwhile fail at once,
//! as not sent. A command is written even
//! when its caller has stopped waiting for it: a release or completion
//! that lands late still does its work (each checks its owner), and a
//! claim answered late is released by [`StoreHandle`](super::StoreHandle),
//! which sees it through. A server that stops answering holds at most [`MAX_WAITING`] commands or
//! [`MAX_UNSENT`] bytes of a connection; past that, a command fails at
//! once rather than pile up behind them.
//!
//! A target may ask for copies ([`Target::copied_to`]): each batch that
//! carries a write is then followed by `WAIT`, and the answers of its
//! writes are held until Redis says enough replicas hold them.
//!
//! Every connection opens with its greeting (`AUTH` and `SELECT` as the
//! URL asks, else `PING`), so a server that refuses it (a wrong password,
//! no such database, its client limit reached) fails the connect, never a
//! store command, which the store could take for a refusal of that
//! command. The completion subscription keeps the redis crate's
//! connection.

use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use redis::{Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, FromRedisValue, RedisError, RedisResult, Value};
use socket2::{SockRef, TcpKeepalive};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, oneshot};
use tokio::task::AbortHandle;

use super::lock;

/// Where a connection goes and what it says first.
pub struct Target {
    address: Address,
    db: i64,
    username: Option<String>,
    password: Option<String>,
    connect_timeout: Duration,
    user_timeout: Duration,
    keepalive: TcpKeepalive,
    /// How many replicas must hold each batch's writes, and how long
    /// Redis waits for them (see [`Target::copied_to`]).
    replicas: Option<(u32, Duration)>,
}

enum Address {
    Tcp(String, u16),
    Unix(std::path::PathBuf),
}

impl Target {
    /// The server `info` names (as parsed from a `redis://` or
    /// `redis+unix://` URL), reached within `connect_timeout`; TCP
    /// connections get `user_timeout` (`TCP_USER_TIMEOUT`) and `keepalive`.
    pub fn new(
        info: &ConnectionInfo,
        connect_timeout: Duration,
        user_timeout: Duration,
        keepalive: TcpKeepalive,
    ) -> RedisResult<Target> {
        let address = match info.addr() {
            ConnectionAddr::Tcp(host, port) => Address::Tcp(host.clone(), *port),
            ConnectionAddr::Unix(path) => Address::Unix(path.clone()),
            _ => {
                return Err(RedisError::from((
                    ErrorKind::InvalidClientConfig,
                    "this build of idemgate reaches Redis over plain TCP or a Unix socket, not TLS",
                )));
            }
        };
        let settings = info.redis_settings();
        Ok(Target {
            address,
            db: settings.db(),
            username: settings.username().map(str::to_owned),
            password: settings.password().map(str::to_owned),
            connect_timeout,
            user_timeout,
            keepalive,
            replicas: None,
        })
    }

    /// This target, with every batch of commands written to it that
    /// carries a write followed by `WAIT replicas within`: the answers to
    /// the batch's writes are handed out only once Redis says that many
    /// replicas hold them, and if fewer do within `within`, each (but an
    /// error, a failure anyway) is a [`not_copied`] error instead (the
    /// writes stay on the primary: a claim among them is released). One
    /// `WAIT` covers every command the batch carries, and what gathers
    /// while it is unanswered goes as the next batch, so a busy connection
    /// pays one replica round trip per batch, not one per command.
    /// `replicas` 0 sends none.
    pub fn copied_to(mut self, replicas: u32, within: Duration) -> Target {
        self.replicas = (replicas > 0).then_some((replicas, within.max(Duration::from_millis(1))));
        self
    }

    /// The `WAIT` that follows each batch.
    fn wait_command(&self) -> Option<Vec<u8>> {
        let (replicas, within) = self.replicas?;
        let mut bytes = Vec::new();
        redis::cmd("WAIT")
            .arg(replicas)
            .arg(within.as_millis() as u64)
            .write_packed_command(&mut bytes);
        Some(bytes)
    }

    /// The `AUTH` and `SELECT` a new connection sends before anything else;
    /// `AUTH` names the URL's user `with_user`.
    fn greeting(&self, with_user: bool) -> Vec<Cmd> {
        let mut commands = Vec::new();
        if let Some(password) = &self.password {
            let mut auth = redis::cmd("AUTH");
            if let Some(username) = self.username.as_ref().filter(|_| with_user) {
                auth.arg(username);
            }
            commands.push(auth.arg(password).clone());
        }
        if self.db != 0 {
            commands.push(redis::cmd("SELECT").arg(self.db).clone());
        }
        if commands.is_empty() {
            commands.push(redis::cmd("PING"));
        }
        commands
    }
}

/// How many commands one connection holds unanswered before it refuses
/// more. A server that answers keeps a few per request in flight on the
/// thread; one that stopped (paused, overloaded, its host gone quiet)
/// would otherwise gather every command sent until the callers' deadlines
/// and TCP give up, each with its record.
pub const MAX_WAITING: usize = 1 << 16;

/// How many bytes of commands one connection holds not yet written: the
/// same bound, for commands carrying large records.
pub const MAX_UNSENT: usize = 64 << 20;

/// A handle on this thread's connection; clones share it.
#[derive(Clone)]
pub struct Connection {
    shared: Arc<Shared>,
    written: Arc<Notify>,
}

struct Shared {
    target: Arc<Target>,
    state: Mutex<State>,
}

struct State {
    /// Bumped each time a connection breaks, so the tasks of the old one
    /// find it changed and stop.
    epoch: u64,
    link: Link,
    /// Commands not yet written.
    out: Vec<u8>,
    /// A slot for each command sent and not yet answered, oldest first;
    /// the last `unsent` of them are those still in `out`.
    waiting: VecDeque<Slot>,
    unsent: usize,
    /// Whether a command in `out` writes (see [`Connection::send`]).
    writes_unsent: bool,
    /// Whether a `WAIT` is written and not yet answered: meanwhile the
    /// writer holds what gathers, to send it as one batch behind one
    /// `WAIT` once it is answered (Redis would hold it anyway, as a client
    /// blocked in `WAIT` has nothing else run, and then make each batch
    /// written meanwhile wait for a replica round trip of its own).
    copying: bool,
    /// The reader and writer of the live connection.
    tasks: Vec<AbortHandle>,
    backoff: Backoff,
}

/// Where an answer goes.
enum Slot {
    /// To the command's caller (who may have stopped waiting); if the
    /// command writes, once the `WAIT` after its batch says enough
    /// replicas hold it.
    Caller(oneshot::Sender<RedisResult<Value>>, bool),
    /// It is the answer to the `WAIT` after a batch ([`Target::copied_to`]).
    Copies,
}

enum Link {
    Down,
    Connecting,
    Up,
}

impl Drop for Shared {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
        for task in state.tasks.drain(..) {
            task.abort();
        }
    }
}

impl Connection {
    /// A connection to `target`, made on the first command.
    pub fn new(target: Arc<Target>) -> Connection {
        Connection {
            shared: Arc::new(Shared {
                target,
                state: Mutex::new(State {
                    epoch: 0,
                    link: Link::Down,
                    out: Vec::new(),
                    waiting: VecDeque::new(),
                    unsent: 0,
                    writes_unsent: false,
                    copying: false,
                    tasks: Vec::new(),
                    backoff: Backoff::default(),
                }),
            }),
            written: Arc::new(Notify::new()),
        }
    }

    /// Sends `command` and reads its answer as `T`; an error answer is an
    /// `Err` of its kind (`NOSCRIPT`, ...). `writes`: whether it may write.
    /// Where the target asks for copies, the answer to a command that does
    /// not (`CLUSTER SLOTS`, a read) is handed out as it comes, and a batch
    /// of none but such commands is followed by no `WAIT` (which, on a node
    /// whose replicas are missing, would hold the connection for its whole
    /// timeout).
    pub async fn query_as<T: FromRedisValue>(&self, command: &Cmd, writes: bool) -> RedisResult<T> {
        self.query_after(None, command, writes).await
    }

    /// [`Connection::query_as`] with `ASKING` before it, the two queued
    /// together (or neither): nothing comes between them to take the
    /// one-shot flag (`ASKING` lets the node a slot migrates to take a
    /// command for it).
    /// `writes`: as for [`Connection::query_as`].
    pub async fn query_asking<T: FromRedisValue>(&self, command: &Cmd, writes: bool) -> RedisResult<T> {
        self.query_after(Some(&redis::cmd("ASKING")), command, writes).await
    }

    /// [`Connection::query_as`], after `before` if given (see [`Connection::send`]).
    async fn query_after<T: FromRedisValue>(
        &self,
        before: Option<&Cmd>,
        command: &Cmd,
        writes: bool,
    ) -> RedisResult<T> {
        let answer = self.send(before, command, writes)?;
        let value = answer
            .await
            .map_err(|_| broken("the Redis connection was dropped".to_owned()))??;
        Ok(redis::from_redis_value(value.extract_error()?)?)
    }

    /// Queues `command`, after `before` if given (whose answer is let go),
    /// connecting first when there is no connection. A command that
    /// `writes` is answered only once enough replicas hold it, where the
    /// target asks for copies.
    fn send(
        &self,
        before: Option<&Cmd>,
        command: &Cmd,
        writes: bool,
    ) -> RedisResult<oneshot::Receiver<RedisResult<Value>>> {
        let (slot, answer) = oneshot::channel();
        let mut state = lock(&self.shared.state);
        if state.waiting.len() >= MAX_WAITING {
            return Err(not_sent(format!(
                "Redis has not answered the {MAX_WAITING} commands before this one"
            )));
        }
        if state.out.len() >= MAX_UNSENT {
            return Err(not_sent(format!(
                "Redis has not taken the {} bytes of commands before this one",
                state.out.len()
            )));
        }
        let mut connect_on = None;
        let wake = match state.link {
            Link::Up => state.out.is_empty(),
            Link::Connecting => false,
            Link::Down => {
                if let Some(why) = state.backoff.waiting() {
                    return Err(not_sent(why));
                }
                let runtime = tokio::runtime::Handle::try_current()
                    .map_err(|_| not_sent("a Redis connection is made on a Tokio runtime".to_owned()))?;
                state.link = Link::Connecting;
                connect_on = Some((runtime, state.epoch));
                false
            }
        };
        if let Some(before) = before {
            before.write_packed_command(&mut state.out);
            state.waiting.push_back(Slot::Caller(oneshot::channel().0, false));
            state.unsent += 1;
        }
        command.write_packed_command(&mut state.out);
        state.waiting.push_back(Slot::Caller(slot, writes));
        state.unsent += 1;
        state.writes_unsent |= writes;
        drop(state);
        if wake {
            self.written.notify_one();
        }
        // Spawned once the lock is let go: a runtime shutting down drops
        // the task at once, and its guard fails the connection.
        if let Some((runtime, epoch)) = connect_on {
            let ends = EndsWith {
                shared: Arc::downgrade(&self.shared),
                epoch,
            };
            runtime.spawn(connect(ends, self.written.clone()));
        }
        Ok(answer)
    }
}

/// Connects that failed in a row, when the next may start, and why the
/// last one failed. After `n` failures the next waits 25 ms, doubling with
/// each to at most 1 s; calls meanwhile fail at once, as not sent, so a
/// Redis that is down (or a host that refuses it) meets a connect from
/// each thread a few times a second at most rather than one per request,
/// and a Redis back again is used within a second. Each connection keeps
/// one, and so does a cluster's first look at its slot map.
#[derive(Default)]
pub(super) struct Backoff {
    failed: u32,
    retry_at: Option<std::time::Instant>,
    why: String,
}

impl Backoff {
    /// Why no connect may start yet, while the back-off runs.
    pub(super) fn waiting(&self) -> Option<String> {
        let now = std::time::Instant::now();
        let at = self.retry_at.filter(|at| now < *at)?;
        Some(format!(
            "{}; the next attempt is in {} ms",
            self.why,
            (at - now).as_millis() + 1
        ))
    }

    /// No connect for `wait`, for `why`; the count of failures stays.
    pub(super) fn hold(&mut self, why: String, wait: Duration) {
        self.retry_at = Some(std::time::Instant::now() + wait);
        self.why = why;
    }

    /// A connect failed, for `why`.
    pub(super) fn failed(&mut self, why: String) {
        self.failed = self.failed.saturating_add(1);
        self.retry_at = Some(std::time::Instant::now() + Backoff::wait(self.failed));
        self.why = why;
    }

    fn wait(failed: u32) -> Duration {
        let doublings = failed.clamp(1, 7) - 1;
        Duration::from_millis(25 << doublings).min(Duration::from_secs(1))
    }
}

/// Empties `buffer`, letting go of what a burst of large records grew.
fn empty(buffer: &mut Vec<u8>) {
    buffer.clear();
    if buffer.capacity() > 1 << 20 {
        *buffer = Vec::new();
    }
}

impl Shared {
    /// Ends the connection of `epoch`, if it is still the live one: every
    /// command on it not yet answered gets `error`, but those never written
    /// get it as [`not_sent`], so that their callers know Redis never saw
    /// them (a claim that failed so has nothing to release).
    fn fail(&self, epoch: u64, error: &RedisError) {
        let (waiting, unsent, tasks) = {
            let mut state = lock(&self.state);
            if state.epoch != epoch {
                return;
            }
            state.epoch += 1;
            state.link = Link::Down;
            empty(&mut state.out);
            state.writes_unsent = false;
            state.copying = false;
            let unsent = std::mem::take(&mut state.unsent);
            (
                std::mem::take(&mut state.waiting),
                unsent,
                std::mem::take(&mut state.tasks),
            )
        };
        for task in tasks {
            task.abort();
        }
        let written = waiting.len() - unsent;
        let never_written = (unsent > 0).then(|| not_sent(error.to_string()));
        // A write that may have run, where copies are asked for: not a
        // dropped connection's error, which a caller may take to send it
        // again, on a connection whose `WAIT` covers only its own writes
        // (see [`Held`]).
        let uncopied = self.target.replicas.is_some().then(|| {
            not_copied(format!(
                "{error}; the write may have run, and is not known to be copied"
            ))
        });
        for (at, slot) in waiting.into_iter().enumerate() {
            let Slot::Caller(caller, writes) = slot else {
                continue;
            };
            let error = match (&never_written, &uncopied) {
                (Some(never_written), _) if at >= written => never_written,
                (_, Some(uncopied)) if writes => uncopied,
                _ => error,
            };
            let _ = caller.send(Err(error.clone()));
        }
    }

    /// Fails the connect of `epoch`, which Redis refused or never
    /// answered: the next waits out its [`Backoff`]. (A connection that
    /// broke once made, or a connect whose task was dropped, is made again
    /// at once.)
    fn connect_failed(&self, epoch: u64, error: &RedisError) {
        {
            let mut state = lock(&self.state);
            if state.epoch != epoch {
                return;
            }
            state.backoff.failed(format!("Redis could not be reached: {error}"));
        }
        self.fail(epoch, error);
    }

    /// Starts the reader and writer of a new connection. They are spawned
    /// with the lock let go, as a task dropped at once (its runtime
    /// shutting down) fails the connection through its guard.
    fn start<R, W>(self: &Arc<Self>, written: Arc<Notify>, epoch: u64, source: R, sink: W)
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        {
            let mut state = lock(&self.state);
            if state.epoch != epoch {
                return;
            }
            state.link = Link::Up;
            state.backoff = Backoff::default();
        }
        let ends = || EndsWith {
            shared: Arc::downgrade(self),
            epoch,
        };
        let tasks = vec![
            tokio::spawn(read(ends(), written.clone(), source)).abort_handle(),
            tokio::spawn(write(ends(), written, sink)).abort_handle(),
        ];
        let mut state = lock(&self.state);
        if state.epoch == epoch {
            state.tasks = tasks;
            return;
        }
        // Failed already (a task ended at once): stop the other.
        drop(state);
        for task in tasks {
            task.abort();
        }
    }
}

/// Ends the connection of its epoch when dropped: a task of it that stops
/// for whatever reason (its work done, a panic, its runtime shut down,
/// before it ever ran) takes the connection down rather than leave
/// commands waiting on nobody. Once the connection has changed it does
/// nothing. Each task gets its guard as an argument, so that it lives in
/// the task's future from the spawn on.
struct EndsWith {
    shared: Weak<Shared>,
    epoch: u64,
}

impl EndsWith {
    /// Keeps the connection when dropped.
    fn disarm(&mut self) {
        self.shared = Weak::new();
    }
}

impl Drop for EndsWith {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.upgrade() {
            shared.fail(self.epoch, &broken("the Redis connection's task stopped".to_owned()));
        }
    }
}

/// The error of a command that was written, or may have been, and whose
/// answer never came: it may have run.
pub(super) fn broken(detail: String) -> RedisError {
    RedisError::from(io::Error::new(io::ErrorKind::ConnectionAborted, detail))
}

/// The error of a command that was never written to Redis, so never run:
/// the redis crate's kind for errors "identified on the client before
/// execution".
pub(super) fn not_sent(detail: String) -> RedisError {
    RedisError::from((ErrorKind::Client, "not sent to Redis", detail))
}

fn protocol(detail: String) -> RedisError {
    RedisError::from((ErrorKind::Parse, "Redis answered outside the protocol", detail))
}

/// Connects for `epoch`, says the greeting, and starts the connection's
/// tasks; or fails the commands that waited for it.
async fn connect(mut ends: EndsWith, written: Arc<Notify>) {
    let (weak, epoch) = (ends.shared.clone(), ends.epoch);
    let Some(target) = weak.upgrade().map(|shared| shared.target.clone()) else {
        return;
    };
    let opened = match tokio::time::timeout(target.connect_timeout, open(&target)).await {
        Ok(opened) => opened,
        Err(_) => Err(broken(format!(
            "no connection to Redis within {:?}",
            target.connect_timeout
        ))),
    };
    let Some(shared) = weak.upgrade() else {
        return;
    };
    ends.disarm();
    match opened {
        Ok(Stream::Tcp(stream)) => {
            let (source, sink) = stream.into_split();
            shared.start(written, epoch, source, sink);
        }
        Ok(Stream::Unix(stream)) => {
            let (source, sink) = stream.into_split();
            shared.start(written, epoch, source, sink);
        }
        Err(error) => shared.connect_failed(epoch, &error),
    }
}

enum Stream {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

async fn open(target: &Target) -> RedisResult<Stream> {
    let mut stream = match &target.address {
        Address::Tcp(host, port) => {
            let stream = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
            let socket = SockRef::from(&stream);
            socket.set_tcp_user_timeout(Some(target.user_timeout))?;
            socket.set_tcp_keepalive(&target.keepalive)?;
            Stream::Tcp(stream)
        }
        Address::Unix(path) => Stream::Unix(tokio::net::UnixStream::connect(path).await?),
    };
    match &mut stream {
        Stream::Tcp(stream) => greet(stream, target).await?,
        Stream::Unix(stream) => greet(stream, target).await?,
    }
    Ok(stream)
}

/// Sends `target`'s greeting and checks that each command was answered
/// without an error; an error answer fails as a connection refused,
/// whatever its kind, and never repeats the password (a server that knows
/// no `AUTH` may quote its arguments). A server before Redis 6 knows no
/// user: one that finds `AUTH user password` one argument too many is
/// greeted again with `AUTH password`, as the redis crate does.
async fn greet<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, target: &Target) -> RedisResult<()> {
    let refusal = match say(stream, &target.greeting(true)).await? {
        Some(refusal)
            if target.username.is_some() && refusal.contains("wrong number of arguments for 'auth' command") =>
        {
            say(stream, &target.greeting(false)).await?
        }
        refusal => refusal,
    };
    let Some(refusal) = refusal else {
        return Ok(());
    };
    let mut refusal = unquoted(&refusal).into_owned();
    if let Some(password) = target.password.as_deref().filter(|p| !p.is_empty()) {
        refusal = masked(&refusal, password);
    }
    Err(RedisError::from(io::Error::new(
        io::ErrorKind::ConnectionRefused,
        format!("Redis refused to set up the connection: {refusal}"),
    )))
}

/// `text` with each occurrence of `secret` that stands on its own (not
/// inside a word) written `<password>`: masked inside words too, a short
/// one (`e`) would mangle the text around it and show which letters it is
/// made of.
fn masked(text: &str, secret: &str) -> String {
    let in_word = |c: Option<char>| c.is_some_and(char::is_alphanumeric);
    let mut out = String::with_capacity(text.len());
    let (mut last, mut from) = (0, 0);
    while let Some(found) = text[from..].find(secret) {
        let (i, end) = (from + found, from + found + secret.len());
        if in_word(text[..i].chars().next_back()) || in_word(text[end..].chars().next()) {
            // One inside a word: one may still begin within it.
            from = i + text[i..].chars().next().map_or(1, char::len_utf8);
            continue;
        }
        out.push_str(&text[last..i]);
        out.push_str("<password>");
        (last, from) = (end, end);
    }
    out.push_str(&text[last..]);
    out
}

/// `text` without the arguments a server that does not know a command
/// quotes back (`..., with args beginning with: 'key' ...`): record keys,
/// owner tokens, records, a password. Each is cut at 128 bytes and its
/// line breaks made spaces, so none could be found whole and masked.
pub(super) fn unquoted(text: &str) -> std::borrow::Cow<'_, str> {
    const QUOTED: &str = ", with args beginning with:";
    match text.find(QUOTED) {
        Some(at) => format!("{}{QUOTED} (left out)", &text[..at]).into(),
        None => text.into(),
    }
}

/// Sends `commands` and reads their answers; returns the first error
/// answer's text, if any.
async fn say<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, commands: &[Cmd]) -> RedisResult<Option<String>> {
    let mut out = Vec::new();
    for command in commands {
        command.write_packed_command(&mut out);
    }
    stream.write_all(&out).await?;
    let mut buf = BytesMut::with_capacity(256);
    let (mut answered, mut refusal) = (0, None);
    while answered < commands.len() {
        if stream.read_buf(&mut buf).await? == 0 {
            // A server turning the connection away (its client limit
            // reached) answers once and closes it.
            return match refusal {
                Some(refusal) => Ok(Some(refusal)),
                None => Err(broken("Redis closed the connection while it was set up".to_owned())),
            };
        }
        while answered < commands.len()
            && let Some((value, used)) = parse(&buf)?
        {
            buf.advance(used);
            answered += 1;
            if let Err(error) = value.extract_error() {
                refusal.get_or_insert_with(|| error.to_string());
            }
        }
    }
    Ok(refusal)
}

/// Writes whatever commands have gathered, in one write (followed by a
/// `WAIT` when the target asks for copies), until the connection of
/// `epoch` ends.
async fn write<W: AsyncWrite + Unpin>(ends: EndsWith, written: Arc<Notify>, mut sink: W) {
    let (weak, epoch) = (ends.shared.clone(), ends.epoch);
    let Some(wait) = weak.upgrade().map(|shared| shared.target.wait_command()) else {
        return;
    };
    let mut batch = Vec::new();
    loop {
        {
            let Some(shared) = weak.upgrade() else {
                return;
            };
            let mut state = lock(&shared.state);
            if state.epoch != epoch {
                return;
            }
            // While a `WAIT` is answered, what gathers is held; its answer
            // wakes this task again.
            if !state.copying {
                std::mem::swap(&mut state.out, &mut batch);
                state.unsent = 0;
                let writes = std::mem::take(&mut state.writes_unsent);
                if let Some(command) = wait.as_ref().filter(|_| writes) {
                    batch.extend_from_slice(command);
                    state.waiting.push_back(Slot::Copies);
                    state.copying = true;
                }
            }
        }
        if batch.is_empty() {
            written.notified().await;
            continue;
        }
        if let Err(error) = sink.write_all(&batch).await {
            if let Some(shared) = weak.upgrade() {
                shared.fail(epoch, &error.into());
            }
            return;
        }
        empty(&mut batch);
    }
}

/// Reads answers and hands each to its command's slot, until the
/// connection of `epoch` ends.
async fn read<R: AsyncRead + Unpin>(ends: EndsWith, written: Arc<Notify>, mut source: R) {
    let (weak, epoch) = (ends.shared.clone(), ends.epoch);
    let Some(copies) = weak.upgrade().map(|shared| shared.target.replicas) else {
        return;
    };
    let mut buf = BytesMut::with_capacity(16 << 10);
    let mut answers = Vec::new();
    let mut slots = Vec::new();
    let mut held = Held(Vec::new());
    // Whether the answer at the front has come in pieces: it is then walked
    // to its end before it is parsed, as a long list parsed (its items
    // copied out) at each read would cost its length squared.
    let mut in_pieces = false;
    loop {
        let read = source.read_buf(&mut buf).await;
        let Some(shared) = weak.upgrade() else {
            return;
        };
        match read {
            Ok(0) => return shared.fail(epoch, &broken("Redis closed the connection".to_owned())),
            Err(error) => return shared.fail(epoch, &error.into()),
            Ok(_) => {}
        }
        loop {
            if in_pieces && matches!(parse_at(&buf, 0, 0, false), Ok(None)) {
                break;
            }
            match parse(&buf) {
                Ok(Some((value, used))) => {
                    buf.advance(used);
                    answers.push(value);
                    in_pieces = false;
                }
                Ok(None) => {
                    in_pieces = !buf.is_empty();
                    break;
                }
                Err(error) => return shared.fail(epoch, &error),
            }
        }
        if answers.is_empty() {
            continue;
        }
        {
            let mut state = lock(&shared.state);
            if state.epoch != epoch {
                return;
            }
            if state.waiting.len() - state.unsent < answers.len() {
                drop(state);
                let error = protocol(format!("{} answers to no command", answers.len()));
                return shared.fail(epoch, &error);
            }
            slots.extend(state.waiting.drain(..answers.len()));
            if state.copying && slots.iter().any(|slot| matches!(slot, Slot::Copies)) {
                state.copying = false;
                if !state.out.is_empty() {
                    written.notify_one();
                }
            }
        }
        // A server that became a replica (a failover behind a name or a
        // virtual address) answers every write READONLY and keeps the
        // connection: drop it, so the next connect finds the primary.
        let demoted = answers.iter().any(read_only);
        for (slot, answer) in slots.drain(..).zip(answers.drain(..)) {
            match slot {
                // An error is a failure whatever the replicas hold: passed
                // on as it comes (a `NOSCRIPT` is sent again at once).
                Slot::Caller(caller, true) if copies.is_some() && !matches!(answer, Value::ServerError(_)) => {
                    held.0.push((caller, answer))
                }
                Slot::Caller(caller, _) => {
                    let _ = caller.send(Ok(answer));
                }
                Slot::Copies => {
                    let short = copies.and_then(|(replicas, within)| copied_short(&answer, replicas, within));
                    for (caller, answer) in held.0.drain(..) {
                        let _ = caller.send(match &short {
                            Some(error) => Err(error.clone()),
                            None => Ok(answer),
                        });
                    }
                }
            }
        }
        if demoted {
            let why = "the Redis server is a read-only replica (failed over?)".to_owned();
            lock(&shared.state).backoff.hold(why.clone(), DEMOTED_WAIT);
            return shared.fail(epoch, &broken(why));
        }
    }
}

/// Answers (not errors) Redis gave before it said how many replicas hold
/// their writes (the `WAIT` after their batch), with their callers.
/// Dropped so (the connection broke, its reader stopped), each caller gets
/// an error: the command ran on the primary, and may not outlive a
/// failover.
struct Held(Vec<(oneshot::Sender<RedisResult<Value>>, Value)>);

impl Drop for Held {
    fn drop(&mut self) {
        for (caller, _) in self.0.drain(..) {
            // Not a broken connection's error, which a caller may take to
            // send the command again: on a new connection, whose `WAIT`
            // covers only its own writes, a command resent that writes
            // nothing this time (a claim that finds its own) would pass
            // with the first write never copied.
            let _ = caller.send(Err(not_copied(
                "the Redis connection ended before Redis said how many replicas hold the write".to_owned(),
            )));
        }
    }
}

/// Why the `WAIT` after a batch, asking for `replicas` within `within`,
/// answered with too few, if it did.
fn copied_short(answer: &Value, replicas: u32, within: Duration) -> Option<RedisError> {
    let why = match answer {
        Value::Int(held) if *held >= i64::from(replicas) => return None,
        Value::Int(held) => format!(
            "{held} of the {replicas} replicas store.wait_for_replicas asks for hold the write after {} ms",
            within.as_millis()
        ),
        Value::ServerError(error) => format!("Redis refused WAIT: {error}"),
        other => format!("Redis answered WAIT with {other:?}"),
    };
    Some(not_copied(why))
}

/// The error of a command that Redis ran, but that fewer replicas than
/// asked for hold, or may (see [`Target::copied_to`]): its kind is the
/// redis crate's for an error it does not know, which calls for no retry.
pub(super) fn not_copied(detail: String) -> RedisError {
    RedisError::from((ErrorKind::Extension, NOT_COPIED, detail))
}

const NOT_COPIED: &str = "not copied to enough replicas";

/// Whether `error` is a [`not_copied`] one.
pub(super) fn is_not_copied(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Extension && error.to_string().starts_with(NOT_COPIED)
}

/// How long after a READONLY answer the next connect waits: a replica is
/// asked at most once a second whether it is the primary again, and a
/// failover's new primary is used within a second.
const DEMOTED_WAIT: Duration = Duration::from_secs(1);

/// Whether `answer` is, or holds (a script's `pcall` results), a READONLY
/// error: its own, or, before Redis 7, inside the error of a script whose
/// write it stopped (`ERR Error running script ...: -READONLY ...`).
fn read_only(answer: &Value) -> bool {
    match answer {
        Value::ServerError(error) => {
            error.kind() == Some(redis::ServerErrorKind::ReadOnly)
                || error.details().is_some_and(|d| d.contains(READ_ONLY_REPLICA))
        }
        Value::Array(items) => items.iter().any(read_only),
        _ => false,
    }
}

/// What a read-only replica says to a write, in every version.
const READ_ONLY_REPLICA: &str = "READONLY You can't write against a read only replica";

/// How deep answers nest: the store's scripts answer with at most a list
/// of plain values.
const MAX_DEPTH: usize = 8;

/// The longest line before a bulk string's data (type, length, CRLF), or a
/// simple string or error.
const MAX_LINE: usize = 64 << 10;

/// The longest bulk string Redis sends (its `proto-max-bulk-len`).
const MAX_BULK: usize = 512 << 20;

/// Parses one RESP2 answer from the front of `buf`: the value and the bytes
/// it took, or `None` while it has not all arrived.
fn parse(buf: &[u8]) -> RedisResult<Option<(Value, usize)>> {
    parse_at(buf, 0, 0, true)
}

/// [`parse`] from `at`, `depth` lists deep. With `build` false it only
/// walks to where the answer ends, its value a placeholder.
fn parse_at(buf: &[u8], at: usize, depth: usize, build: bool) -> RedisResult<Option<(Value, usize)>> {
    let rest = &buf[at..];
    let Some(lf) = rest.iter().take(MAX_LINE).position(|&b| b == b'\n') else {
        if rest.len() >= MAX_LINE {
            return Err(protocol("a line with no end".to_owned()));
        }
        return Ok(None);
    };
    if lf < 2 || rest[lf - 1] != b'\r' {
        return Err(protocol("a line not ended by CRLF".to_owned()));
    }
    let line = &rest[1..lf - 1];
    let next = at + lf + 1;
    let value = match rest[0] {
        b'+' | b'-' if !build => Value::Nil,
        b'+' if line == b"OK" => Value::Okay,
        b'+' => Value::SimpleString(String::from_utf8_lossy(line).into_owned()),
        b'-' => redis::parse_redis_value(&buf[at..next])?,
        b':' => Value::Int(number(line)?),
        b'$' => {
            let Some(len) = length(line)? else {
                return Ok(Some((Value::Nil, next)));
            };
            if len > MAX_BULK {
                return Err(protocol(format!("a bulk string of {len} bytes")));
            }
            let end = next + len;
            if buf.len() < end + 2 {
                return Ok(None);
            }
            if &buf[end..end + 2] != b"\r\n" {
                return Err(protocol("a bulk string longer than it said".to_owned()));
            }
            let value = if build {
                Value::BulkString(buf[next..end].to_vec())
            } else {
                Value::Nil
            };
            return Ok(Some((value, end + 2)));
        }
        b'*' => {
            let Some(count) = length(line)? else {
                return Ok(Some((Value::Nil, next)));
            };
            if depth == MAX_DEPTH {
                return Err(protocol("answers nested too deep".to_owned()));
            }
            let mut items = Vec::with_capacity(if build { count.min(64) } else { 0 });
            let mut at = next;
            for _ in 0..count {
                let Some((item, after)) = parse_at(buf, at, depth + 1, build)? else {
                    return Ok(None);
                };
                if build {
                    items.push(item);
                }
                at = after;
            }
            let value = if build { Value::Array(items) } else { Value::Nil };
            return Ok(Some((value, at)));
        }
        other => return Err(protocol(format!("an answer of type {:?}", other as char))),
    };
    Ok(Some((value, next)))
}

/// A bulk string's or list's length: `None` for -1 (nil).
fn length(digits: &[u8]) -> RedisResult<Option<usize>> {
    match number(digits)? {
        -1 => Ok(None),
        len => usize::try_from(len)
            .map(Some)
            .map_err(|_| protocol(format!("a length of {len}"))),
    }
}

fn number(digits: &[u8]) -> RedisResult<i64> {
    std::str::from_utf8(digits)
        .ok()
        .and_then(|digits| digits.parse().ok())
        .ok_or_else(|| protocol(format!("{:?} is not a number", String::from_utf8_lossy(digits))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(wire: &[u8]) -> Value {
        let (value, used) = parse(wire).unwrap().expect("whole");
        assert_eq!(used, wire.len());
        value
    }

    #[test]
    fn answers_parse_to_the_values_the_redis_crate_makes() {
        for wire in [
            &b"+OK\r\n"[..],
            b"+QUEUED\r\n",
            b":-42\r\n",
            b"$-1\r\n",
            b"*-1\r\n",
            b"$0\r\n\r\n",
            b"$5\r\na\r\nbc\r\n",
            b"*0\r\n",
            b"*3\r\n:1\r\n:0\r\n:-1\r\n",
            b"*2\r\n$3\r\nabc\r\n:1234\r\n",
            b"*2\r\n*1\r\n$-1\r\n+x\r\n",
        ] {
            assert_eq!(whole(wire), redis::parse_redis_value(wire).unwrap(), "{wire:?}");
        }
    }

    /// A connection to whatever listens at `address`.
    fn connection_to(address: std::net::SocketAddr) -> Connection {
        connection_at(&format!("redis://{address}/0"))
    }

    fn connection_at(url: &str) -> Connection {
        use redis::IntoConnectionInfo;
        let target = Target::new(
            &url.into_connection_info().unwrap(),
            Duration::from_secs(2),
            Duration::from_secs(5),
            TcpKeepalive::new(),
        )
        .unwrap();
        Connection::new(Arc::new(target))
    }

    /// Reads from `peer` until `expected` has come (each piece within 5 s),
    /// and checks that it is what came.
    async fn receive(peer: &mut tokio::net::TcpStream, expected: &[u8]) {
        let mut got = Vec::new();
        while got.len() < expected.len() {
            let mut buf = vec![0u8; 1 << 16];
            let n = tokio::time::timeout(Duration::from_secs(5), peer.read(&mut buf))
                .await
                .unwrap_or_else(|_| panic!("{:?} and no more", String::from_utf8_lossy(&got)))
                .unwrap();
            assert!(n > 0, "closed after {} bytes", got.len());
            got.extend_from_slice(&buf[..n]);
        }
        assert!(got == expected, "{:?}", String::from_utf8_lossy(&got));
    }

    fn echo(word: &str) -> Cmd {
        redis::cmd("ECHO").arg(word).clone()
    }

    /// A peer that reads every command and answers none, as a Redis that
    /// stopped answering: a connection holds [`MAX_WAITING`] commands, the
    /// next fails at once, and when the peer goes away every held command
    /// gets the error.
    #[tokio::test]
    async fn a_server_that_stops_answering_holds_a_bounded_number_of_commands() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let connection = connection_to(listener.local_addr().unwrap());
        let ping = redis::cmd("PING");
        let held: Vec<_> = (0..MAX_WAITING)
            .map(|_| connection.send(None, &ping, true).unwrap())
            .collect();
        assert!(connection.send(None, &ping, true).is_err());

        let (mut peer, _) = listener.accept().await.unwrap();
        let packed = ping.get_packed_command();
        receive(&mut peer, &packed).await;
        peer.write_all(b"+PONG\r\n").await.unwrap();
        receive(&mut peer, &packed.repeat(MAX_WAITING)).await;
        drop(peer);
        for answer in held {
            assert!(answer.await.unwrap().is_err());
        }
    }

    /// Commands wait while the connection is set up, and are written in
    /// order once it is, those whose callers stopped waiting too: a release
    /// that timed out still frees its key when it lands.
    #[tokio::test]
    async fn commands_given_up_before_they_are_written_are_still_sent() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let connection = connection_to(listener.local_addr().unwrap());
        let first = connection.send(None, &echo("first"), true).unwrap();
        let kept = connection.send(None, &echo("kept"), true).unwrap();

        let (mut peer, _) = listener.accept().await.unwrap();
        receive(&mut peer, &redis::cmd("PING").get_packed_command()).await;
        drop(first);
        peer.write_all(b"+PONG\r\n").await.unwrap();
        let both = [echo("first").get_packed_command(), echo("kept").get_packed_command()].concat();
        receive(&mut peer, &both).await;
        peer.write_all(b"$5\r\nfirst\r\n$4\r\nkept\r\n").await.unwrap();
        assert_eq!(kept.await.unwrap().unwrap(), Value::BulkString(b"kept".to_vec()));
    }

    /// With copies asked for, each batch is followed by `WAIT`, and its
    /// answers are handed out only once `WAIT` says enough replicas hold
    /// its writes (an error, a failure either way, comes at once); too few
    /// fail them, and a connection that breaks in between fails them too.
    #[tokio::test]
    async fn answers_wait_for_the_replicas_a_target_asks_for() {
        use redis::IntoConnectionInfo;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("redis://{}/0", listener.local_addr().unwrap());
        let target = Target::new(
            &url.into_connection_info().unwrap(),
            Duration::from_secs(2),
            Duration::from_secs(5),
            TcpKeepalive::new(),
        )
        .unwrap()
        .copied_to(2, Duration::from_millis(250));
        let connection = Connection::new(Arc::new(target));
        let wait = redis::cmd("WAIT").arg(2).arg(250).get_packed_command();

        let mut a = connection.send(None, &echo("a"), true).unwrap();
        let (mut peer, _) = listener.accept().await.unwrap();
        receive(&mut peer, &redis::cmd("PING").get_packed_command()).await;
        peer.write_all(b"+PONG\r\n").await.unwrap();
        receive(&mut peer, &[echo("a").get_packed_command(), wait.clone()].concat()).await;
        peer.write_all(b"$1\r\na\r\n").await.unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(100), &mut a).await.is_err(),
            "answered before WAIT was"
        );
        // Sent while a WAIT is unanswered: held, and written as one batch
        // behind one WAIT once it is answered.
        let b = connection.send(None, &echo("b"), true).unwrap();
        tokio::task::yield_now().await;
        let refused = connection.send(None, &echo("refused"), true).unwrap();
        let mut early = [0u8; 1];
        assert!(
            tokio::time::timeout(Duration::from_millis(100), peer.read(&mut early))
                .await
                .is_err(),
            "written while a WAIT was unanswered"
        );
        peer.write_all(b":2\r\n").await.unwrap();
        assert_eq!(a.await.unwrap().unwrap(), Value::BulkString(b"a".to_vec()));

        // One replica of the two holds that batch.
        let both = [echo("b").get_packed_command(), echo("refused").get_packed_command()].concat();
        receive(&mut peer, &[both, wait.clone()].concat()).await;
        peer.write_all(b"$1\r\nb\r\n-ERR no\r\n").await.unwrap();
        // An error, before WAIT is answered.
        let refused = tokio::time::timeout(Duration::from_secs(5), refused).await;
        assert!(matches!(refused, Ok(Ok(Ok(Value::ServerError(_))))), "{refused:?}");
        peer.write_all(b":1\r\n").await.unwrap();
        let short = b.await.unwrap().unwrap_err();
        assert_eq!(short.kind(), ErrorKind::Extension);
        assert!(
            short
                .to_string()
                .contains("1 of the 2 replicas store.wait_for_replicas asks for hold the write after 250 ms"),
            "{short}"
        );

        // A command that writes nothing is answered as it comes, and alone
        // in its batch is followed by no WAIT.
        let read = connection.send(None, &echo("read"), false).unwrap();
        receive(&mut peer, &echo("read").get_packed_command()).await;
        peer.write_all(b"$4\r\nread\r\n").await.unwrap();
        assert_eq!(read.await.unwrap().unwrap(), Value::BulkString(b"read".to_vec()));
        let write = connection.send(None, &echo("w"), true).unwrap();
        let mut read = connection.send(None, &echo("r"), false).unwrap();
        let both = [echo("w").get_packed_command(), echo("r").get_packed_command()].concat();
        receive(&mut peer, &[both, wait.clone()].concat()).await;
        peer.write_all(b"$1\r\nw\r\n$1\r\nr\r\n").await.unwrap();
        let read = tokio::time::timeout(Duration::from_secs(5), &mut read)
            .await
            .expect("answered before WAIT");
        assert_eq!(read.unwrap().unwrap(), Value::BulkString(b"r".to_vec()));
        peer.write_all(b":3\r\n").await.unwrap();
        assert_eq!(write.await.unwrap().unwrap(), Value::BulkString(b"w".to_vec()));

        // Answered, and the connection gone before WAIT was.
        let c = connection.send(None, &echo("c"), true).unwrap();
        receive(&mut peer, &[echo("c").get_packed_command(), wait.clone()].concat()).await;
        peer.write_all(b"$1\r\nc\r\n").await.unwrap();
        drop(peer);
        let broken = c.await.unwrap().unwrap_err();
        assert!(is_not_copied(&broken), "{broken}");
        assert!(
            broken.to_string().contains("before Redis said how many replicas"),
            "{broken}"
        );

        // Written, and the connection gone before it was answered: not a
        // dropped connection's error either, which a Cluster sends again.
        let d = connection.send(None, &echo("d"), true).unwrap();
        let (mut peer, _) = listener.accept().await.unwrap();
        receive(&mut peer, &redis::cmd("PING").get_packed_command()).await;
        peer.write_all(b"+PONG\r\n").await.unwrap();
        receive(&mut peer, &[echo("d").get_packed_command(), wait].concat()).await;
        drop(peer);
        let broken = d.await.unwrap().unwrap_err();
        assert!(is_not_copied(&broken), "{broken}");
        assert!(matches!(broken.retry_method(), redis::RetryMethod::NoRetry), "{broken}");
    }

    #[test]
    fn a_password_is_masked_where_it_stands_on_its_own() {
        let wrong = "WRONGPASS invalid username-password pair or user is disabled.";
        assert_eq!(masked(wrong, "e"), wrong);
        assert_eq!(
            masked("bad 's3cret' and s3cret.", "s3cret"),
            "bad '<password>' and <password>."
        );
        assert_eq!(masked("xs3cret s3cretx s3cret", "s3cret"), "xs3cret s3cretx <password>");
        assert_eq!(masked("xab ab ab", "ab ab"), "xab <password>");
    }

    /// A peer that answers every `PING` it reads, on each connection.
    fn pinged_peer() -> std::net::SocketAddr {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for peer in listener.incoming() {
                let mut peer = peer.unwrap();
                std::thread::spawn(move || {
                    use std::io::{Read, Write};
                    let ping = redis::cmd("PING").get_packed_command();
                    let (mut buf, mut pending) = (vec![0u8; 4096], 0);
                    while let Ok(n @ 1..) = peer.read(&mut buf) {
                        pending += n;
                        let whole = pending / ping.len();
                        pending %= ping.len();
                        if peer.write_all(&b"+PONG\r\n".repeat(whole)).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        address
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// `PING` on `connection`, on `runtime`, answered within 2 s.
    fn ping(runtime: &tokio::runtime::Runtime, connection: &Connection) -> String {
        let command = redis::cmd("PING");
        let answer = runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(2), connection.query_as::<String>(&command, true)).await
        });
        answer.expect("answered in time").unwrap()
    }

    /// The connection's tasks go with the runtime they ran on; the next
    /// command, on another runtime, connects anew instead of waiting on a
    /// writer that is gone.
    #[test]
    fn a_connection_outlives_the_runtime_its_tasks_ran_on() {
        let connection = connection_to(pinged_peer());
        for _ in 0..2 {
            assert_eq!(ping(&runtime(), &connection), "PONG");
        }
    }

    #[test]
    fn connects_back_off_from_25_ms_to_a_second() {
        let waits: Vec<u128> = [1, 2, 3, 6, 7, 8, u32::MAX]
            .map(|n| Backoff::wait(n).as_millis())
            .into();
        assert_eq!(waits, [25, 50, 100, 800, 1000, 1000, 1000]);
    }

    /// A connect spawned on a runtime that never ran it (shut down first)
    /// fails the command that started it, and the next command connects.
    #[test]
    fn a_connect_its_runtime_never_ran_leaves_the_connection_usable() {
        let connection = connection_to(pinged_peer());
        let first = runtime();
        let answer = {
            let _inside = first.enter();
            connection.send(None, &redis::cmd("PING"), true).unwrap()
        };
        drop(first);
        let second = runtime();
        let failed = second.block_on(async { tokio::time::timeout(Duration::from_secs(2), answer).await });
        assert!(matches!(failed, Ok(Ok(Err(_)))), "{failed:?}");
        assert_eq!(ping(&second, &connection), "PONG");
    }

    /// A command sent where no runtime runs fails, and leaves the
    /// connection to the next one.
    #[test]
    fn a_command_sent_outside_a_runtime_fails_and_changes_nothing() {
        let connection = connection_to(pinged_peer());
        assert!(connection.send(None, &redis::cmd("PING"), true).is_err());
        assert_eq!(ping(&runtime(), &connection), "PONG");
    }

    /// A `PING` sent on a connection to a peer of the test's own, the
    /// connection logging in as `login` (`user:password@`, or `:password@`)
    /// to database `db`: the connection, the answer to come and the peer.
    async fn ping_logging_in(
        login: &str,
        db: u8,
    ) -> (Connection, oneshot::Receiver<RedisResult<Value>>, tokio::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let connection = connection_at(&format!("redis://{login}{}/{db}", listener.local_addr().unwrap()));
        let answer = connection.send(None, &redis::cmd("PING"), true).unwrap();
        let (peer, _) = listener.accept().await.unwrap();
        (connection, answer, peer)
    }

    /// A server that knows no `AUTH` quotes its arguments back, whole or
    /// cut short (Redis cuts each at 128 bytes); the error names the
    /// refusal and never the password, nor any part of it.
    #[tokio::test]
    async fn a_refused_greeting_never_repeats_the_password() {
        for quoted in ["'hunter2hunter2' ", "'hunter2hun'"] {
            let (_connection, answer, mut peer) = ping_logging_in(":hunter2hunter2@", 0).await;
            receive(
                &mut peer,
                &redis::cmd("AUTH").arg("hunter2hunter2").get_packed_command(),
            )
            .await;
            let refusal = format!("-ERR unknown command 'AUTH', with args beginning with: {quoted}\r\n");
            peer.write_all(refusal.as_bytes()).await.unwrap();
            let error = answer.await.unwrap().unwrap_err().to_string();
            assert!(error.contains("unknown command 'AUTH'"), "{error}");
            assert!(!error.contains("hunter2"), "{error}");
        }
    }

    /// A server before Redis 6 knows `AUTH password` only: a URL naming a
    /// user is greeted again without it, and its database still selected.
    #[tokio::test]
    async fn a_server_before_redis_6_is_greeted_again_without_the_user() {
        let (_connection, answer, mut peer) = ping_logging_in("gate:s3cret@", 3).await;
        let select = redis::cmd("SELECT").arg(3).get_packed_command();
        let with_user = redis::cmd("AUTH").arg("gate").arg("s3cret").get_packed_command();
        receive(&mut peer, &[with_user, select.clone()].concat()).await;
        peer.write_all(b"-ERR wrong number of arguments for 'auth' command\r\n-NOAUTH Authentication required.\r\n")
            .await
            .unwrap();
        let without = redis::cmd("AUTH").arg("s3cret").get_packed_command();
        receive(&mut peer, &[without, select].concat()).await;
        peer.write_all(b"+OK\r\n+OK\r\n").await.unwrap();
        receive(&mut peer, &redis::cmd("PING").get_packed_command()).await;
        peer.write_all(b"+PONG\r\n").await.unwrap();
        let pong = answer.await.unwrap().unwrap();
        assert_eq!(pong, Value::SimpleString("PONG".to_owned()));
    }

    #[test]
    fn an_error_answer_keeps_its_kind() {
        let value = whole(b"-NOSCRIPT No matching script. Please use EVAL.\r\n");
        let error = value.extract_error().unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Server(redis::ServerErrorKind::NoScript));
        let value = whole(b"*2\r\n:1\r\n-ERR invalid expire time\r\n");
        assert!(value.extract_error().is_err());
    }

    /// A replica's refusal of a write is seen as such on its own, in a
    /// script's list of results, and inside the error of a script it
    /// stopped, as Redis before 7 words that.
    #[test]
    fn a_read_only_replica_is_told_in_every_wording() {
        for wire in [
            &b"-READONLY You can't write against a read only replica.\r\n"[..],
            b"*2\r\n:1\r\n-READONLY You can't write against a read only replica.\r\n",
            b"-ERR Error running script (call to f_3f1c): @user_script:2: @user_script: 2: \
              -READONLY You can't write against a read only replica.\r\n",
        ] {
            assert!(read_only(&whole(wire)), "{}", String::from_utf8_lossy(wire));
        }
        for wire in [&b"-ERR invalid expire time\r\n"[..], b"+READONLY\r\n", b":1\r\n"] {
            assert!(!read_only(&whole(wire)), "{}", String::from_utf8_lossy(wire));
        }
    }

    #[test]
    fn an_answer_cut_anywhere_waits_for_the_rest() {
        let wire = b"*3\r\n$10\r\n0123456789\r\n*2\r\n:7\r\n$-1\r\n+OK\r\n";
        for cut in 0..wire.len() {
            assert!(parse(&wire[..cut]).unwrap().is_none(), "cut at {cut}");
        }
        let mut two = wire.to_vec();
        two.extend_from_slice(b":5\r\n");
        let (_, used) = parse(&two).unwrap().unwrap();
        assert_eq!(used, wire.len());
        assert_eq!(whole(&two[used..]), Value::Int(5));
    }

    #[test]
    fn bytes_outside_the_protocol_are_refused() {
        for wire in [
            &b"?1\r\n"[..],
            b":12a\r\n",
            b"$3\r\nabcd\r\n",
            b"+OK\n",
            b"\r\n",
            b"*9\r\n*9\r\n*9\r\n*9\r\n*9\r\n*9\r\n*9\r\n*9\r\n*9\r\n",
            b"$-2\r\n",
            b"*-5\r\n",
            b"$536870913\r\n",
        ] {
            assert!(parse(wire).is_err(), "{wire:?}");
        }
        let endless = vec![b'+'; MAX_LINE + 1];
        assert!(parse(&endless).is_err());
        assert!(parse(&endless[..100]).unwrap().is_none());
    }
}
