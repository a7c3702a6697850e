//! The upstream client: HTTP/1.1 on keep-alive connections, plain or TLS,
//! pooled per worker thread.
//!
//! Each worker runs a single-threaded runtime, so each keeps its own idle
//! connections (a thread-local pool): a request never takes a lock or wakes
//! another thread to reach the upstream, and the exchange task reads and
//! writes the connection itself, with no connection task in between. A
//! small answer usually arrives with its head, and its body is then taken
//! from the same read.
//!
//! A request is sent once; only one no route claims, with an idempotent
//! method and a whole body, goes again on a new connection when its pooled
//! one turns out closed before any answer ([`OnStale`]).
//!
//! An idle connection is checked before reuse without a system call when
//! possible: the runtime knows whether the socket became readable (an EOF
//! or stray bytes) since the last response was read to its end.

use std::cell::RefCell;
use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header;
use http::uri::{Authority, Scheme};
use http::{Method, Request, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use super::body::{BoxError, ClientBody};
use super::forward;
use crate::clock::coarse_now;
use crate::config::UpstreamConfig;
use crate::server::tls::{self, TlsError};
use crate::wire::{self, Chunked, LineWatch, MAX_HEAD, next_chunk};

const MAX_IDLE_PER_UPSTREAM: usize = 1024;
/// Bytes read from the upstream at a time, at least.
const READ_CHUNK: usize = 16 * 1024;
/// Request bodies up to this size are written with the head, in one write.
const COALESCE: usize = 16 * 1024;

/// The client every route shares, for http:// and https:// upstreams.
#[derive(Clone)]
pub struct UpstreamClient {
    inner: Arc<Inner>,
}

struct Inner {
    /// Tells this client's pooled connections from an earlier one's (a
    /// reload makes a new client).
    id: u64,
    tls: TlsConnector,
    connect_timeout: Duration,
    /// `upstream.idle_timeout`.
    idle_timeout: Duration,
}

/// How long an answer may take to be read after the request failed to go
/// out whole (see [`UpstreamClient::request`]): one sent early has arrived.
const EARLY_ANSWER_WAIT: Duration = Duration::from_secs(1);
/// The most of an answer read while the request's body is still going out
/// to an upstream that answers as it reads (see [`Conn::write_body`]).
const READ_WHILE_WRITING: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("connecting to the upstream failed")]
    Connect(#[source] io::Error),
    #[error("the upstream connection failed")]
    Io(#[source] io::Error),
    #[error("the upstream's answer is not valid HTTP/1.1: {0}")]
    Protocol(&'static str),
    /// An answer with this status that cannot be passed on: a head that
    /// begins as HTTP/1.x with a status, then does not parse, is too
    /// large, or frames its body in a way this hop refuses. Unlike a
    /// timeout or a reset, such an answer says the backend had the request
    /// (one that does not begin so, a `Protocol` error, may be another
    /// service on the port).
    #[error("the upstream's answer ({0}) cannot be passed on: {1}")]
    Refused(Code, &'static str),
    #[error("the request body could not be read")]
    RequestBody(#[source] BoxError),
}

/// The final status of an answer whose head began to arrive and did not
/// end, for a caller whose own deadline may cut the head off: so begun,
/// the head says the backend had the request. Set only when a head comes
/// in pieces, so the usual answer costs nothing.
#[derive(Debug, Default)]
pub struct HeadBegun(AtomicU16);

impl HeadBegun {
    pub fn code(&self) -> Option<Code> {
        // One more than the code, so that 0 is none and `000` a code.
        self.0.load(Ordering::Relaxed).checked_sub(1).map(Code)
    }

    fn note(&self, code: Code) {
        self.0.store(code.0 + 1, Ordering::Relaxed);
    }
}

/// The three digits a status line begins with: a [`StatusCode`] from 100
/// up. One below 100 is none (RFC 9110 §15), yet the head that begins
/// with it still says a backend had the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Code(u16);

impl Code {
    pub fn status(self) -> Option<StatusCode> {
        StatusCode::from_u16(self.0).ok()
    }

    pub fn as_u16(self) -> u16 {
        self.0
    }

    fn is_informational(self) -> bool {
        (100..200).contains(&self.0)
    }
}

impl From<StatusCode> for Code {
    fn from(status: StatusCode) -> Code {
        Code(status.as_u16())
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.status() {
            Some(status) => status.fmt(f),
            None => write!(f, "{:03}, no status", self.0),
        }
    }
}

impl UpstreamError {
    /// The request never reached the upstream: no connection was made, or
    /// not a byte of the request went into a new one.
    pub fn is_connect(&self) -> bool {
        matches!(self, UpstreamError::Connect(_))
    }
}

/// The upstream client: `connect_timeout`, and for https:// the webpki
/// roots plus `upstream.ca`.
pub fn client(config: &UpstreamConfig) -> Result<UpstreamClient, TlsError> {
    static IDS: AtomicU64 = AtomicU64::new(0);
    let mut tls = tls::client_config(config.ca.as_deref())?;
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(UpstreamClient {
        inner: Arc::new(Inner {
            id: IDS.fetch_add(1, Ordering::Relaxed),
            tls: TlsConnector::from(Arc::new(tls)),
            // Capped at half the whole exchange's timeout, so a connection
            // that cannot be made fails as "never sent" (released) before
            // the exchange times out as "sent" (on_upstream_failure decides).
            connect_timeout: config.connect_timeout.min(config.timeout / 2),
            idle_timeout: config.idle_timeout,
        }),
    })
}

/// Where pooled connections go: one client, one runtime (a connection is
/// registered with the runtime that made it), one scheme and authority.
#[derive(Clone)]
struct PoolKey {
    client: u64,
    runtime: Option<tokio::runtime::Id>,
    https: bool,
    authority: Authority,
    /// The client's `idle_timeout` (one per client, so not compared).
    idle_timeout: Duration,
}

/// The authorities compare as written: they come from one configured URL,
/// and `Authority`'s own comparison ignores case byte by byte, twice per
/// request (out of the pool and back). Two spellings of one host would
/// only mean two pools.
impl PartialEq for PoolKey {
    fn eq(&self, other: &PoolKey) -> bool {
        self.client == other.client
            && self.runtime == other.runtime
            && self.https == other.https
            && self.authority.as_str() == other.authority.as_str()
    }
}

thread_local! {
    static POOL: RefCell<Vec<(PoolKey, Vec<Conn>)>> = const { RefCell::new(Vec::new()) };
}

fn checkout(key: &PoolKey) -> Option<Conn> {
    POOL.with_borrow_mut(|pool| {
        let (_, idle) = pool.iter_mut().find(|(k, _)| k == key)?;
        while let Some(mut conn) = idle.pop() {
            if conn.usable(key.idle_timeout) {
                return Some(conn);
            }
        }
        None
    })
}

/// How often a worker drops its pooled connections past their
/// `idle_timeout` when no request comes to return one.
const IDLE_SWEEP: Duration = Duration::from_secs(1);

/// Drops this thread's pooled connections idle longer than their
/// `idle_timeout`, every [`IDLE_SWEEP`], for as long as it runs: after
/// traffic to an upstream stops, its idle connections close within about a
/// second of their time instead of waiting (in `CLOSE_WAIT`, once the
/// upstream closes them) for the next request. For a worker's
/// single-threaded runtime, whose thread's pool it is.
pub async fn sweep_idle_connections() {
    let mut tick = tokio::time::interval(IDLE_SWEEP);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        let now = coarse_now();
        POOL.with_borrow_mut(|pool| {
            for (key, idle) in pool.iter_mut() {
                drop_stale(idle, now, key.idle_timeout);
            }
            pool.retain(|(_, idle)| !idle.is_empty());
        });
    }
}

/// Drops the connections of `idle` (oldest first) idle past `idle_timeout`,
/// looking no further than the first one still in it.
fn drop_stale(idle: &mut Vec<Conn>, now: Instant, idle_timeout: Duration) {
    let stale = idle
        .iter()
        .take_while(|c| now.saturating_duration_since(c.idle_since) > idle_timeout)
        .count();
    idle.drain(..stale);
}

fn checkin(key: PoolKey, mut conn: Conn) {
    let now = coarse_now();
    conn.idle_since = now;
    POOL.with_borrow_mut(|pool| {
        // A connection of a client that a reload replaced is not kept, nor
        // are the older client's idle ones once the newer one pools.
        if pool.iter().any(|(k, _)| k.client > key.client) {
            return;
        }
        pool.retain(|(k, _)| k.client == key.client);
        match pool.iter_mut().find(|(k, _)| *k == key) {
            Some((_, idle)) => {
                // The oldest sit at the bottom.
                drop_stale(idle, now, key.idle_timeout);
                if idle.len() < MAX_IDLE_PER_UPSTREAM {
                    idle.push(conn);
                }
            }
            None => pool.push((key, vec![conn])),
        }
    });
}

enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Stream {
    fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(tcp) => tcp,
            Stream::Tls(tls) => tls.get_ref().0,
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(tcp) => Pin::new(tcp).poll_read(cx, buf),
            Stream::Tls(tls) => Pin::new(tls.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(tcp) => Pin::new(tcp).poll_write(cx, buf),
            Stream::Tls(tls) => Pin::new(tls.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(tcp) => Pin::new(tcp).poll_flush(cx),
            Stream::Tls(tls) => Pin::new(tls.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(tcp) => Pin::new(tcp).poll_shutdown(cx),
            Stream::Tls(tls) => Pin::new(tls.as_mut()).poll_shutdown(cx),
        }
    }
}

/// How long a pooled connection idles before its reuse asks the kernel
/// whether it closed, instead of trusting what the runtime last saw.
const ASK_THE_KERNEL_AFTER: Duration = Duration::from_millis(100);

/// A connection and the bytes read from it but not yet used.
struct Conn {
    stream: Stream,
    buf: BytesMut,
    idle_since: Instant,
    /// A final answer that began before the request's body was sent
    /// whole, by its status code (see [`Conn::write_body`]): such a connection
    /// is not reused, as the upstream may not have read all the body.
    early: Option<Option<Code>>,
}

impl Conn {
    /// Whether an idle connection can carry another request: idle no longer
    /// than `idle_timeout`, and nothing (an EOF, stray bytes, a TLS close)
    /// arrived while it was idle.
    fn usable(&mut self, idle_timeout: Duration) -> bool {
        let idle = coarse_now().saturating_duration_since(self.idle_since);
        if idle > idle_timeout || !self.buf.is_empty() {
            return false;
        }
        if let Stream::Tls(tls) = &mut self.stream {
            match tls.get_mut().1.process_new_packets() {
                Ok(state) if state.plaintext_bytes_to_read() == 0 && !state.peer_has_closed() => {}
                _ => return false,
            }
        }
        // Idle a while, as when an upstream closes idle connections on a
        // timer, and its FIN (or a stray `408`) may have come in since the
        // runtime last asked the kernel: the kernel is asked (a peek, which
        // reads nothing). Busy, no system call unless the runtime saw the
        // socket become readable (or readiness is left from the last read):
        // then a one-byte probe. Any byte means the connection is dropped.
        if idle >= ASK_THE_KERNEL_AFTER {
            let mut probe = [MaybeUninit::<u8>::uninit(); 1];
            let peeked = socket2::SockRef::from(self.stream.tcp()).peek(&mut probe);
            return matches!(peeked, Err(e) if e.kind() == io::ErrorKind::WouldBlock);
        }
        let mut probe = [0u8; 1];
        matches!(self.stream.tcp().try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// Room for a read: the buffer's spare capacity, topped up only when
    /// little is left, so consecutive small answers share one allocation
    /// instead of each taking a fresh one (the frames split off keep theirs
    /// alive until dropped).
    fn make_room(&mut self) {
        if self.buf.capacity() - self.buf.len() < 2048 {
            self.buf.reserve(READ_CHUNK);
        }
    }

    /// Reads more bytes into the buffer; `Ok(0)` at EOF.
    async fn fill(&mut self) -> io::Result<usize> {
        self.make_room();
        self.stream.read_buf(&mut self.buf).await
    }

    /// Writes part of a request's body whole (and flushes it, through
    /// TLS), reading what the upstream sends meanwhile into the buffer
    /// (see [`Conn::poll_upstream`]). An upstream may answer before it has
    /// read the body and then neither read nor close: a write waiting on
    /// it would wait out `upstream.timeout` with the answer unread. So
    /// once an error answer (a 413, a 401) has begun, a write that waits
    /// [`EARLY_ANSWER_WAIT`] fails, and [`early_answer`] reads the answer;
    /// the connection's end fails it at once. An early 2xx or 3xx lets the
    /// body go on as long as it takes (an upstream answering as it reads,
    /// full duplex, gets all of it, its answer read meanwhile up to
    /// [`READ_WHILE_WRITING`]); its status goes to `begun`, so a deadline
    /// that cuts the exchange short settles the claim by it.
    async fn write_body(&mut self, mut data: &[u8], begun: Option<&HeadBegun>) -> io::Result<()> {
        let mut watching = true;
        let mut stalled: Option<Pin<Box<tokio::time::Sleep>>> = None;
        std::future::poll_fn(|cx| {
            loop {
                if watching {
                    match self.poll_upstream(cx, begun) {
                        Poll::Ready(Ok(())) => watching = false,
                        Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                        Poll::Pending => {}
                    }
                }
                let stream = Pin::new(&mut self.stream);
                let went = if data.is_empty() {
                    match stream.poll_flush(cx) {
                        Poll::Ready(done) => return Poll::Ready(done),
                        Poll::Pending => Poll::Pending,
                    }
                } else {
                    stream.poll_write(cx, data)
                };
                match went {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                    Poll::Ready(Ok(n)) => {
                        data = &data[n..];
                        stalled = None;
                    }
                    Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                    Poll::Pending if !self.early.is_some_and(stops_the_body) => return Poll::Pending,
                    Poll::Pending => {
                        let wait = stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(EARLY_ANSWER_WAIT)));
                        ready!(wait.as_mut().poll(cx));
                        let stopped = "the upstream answered with an error and stopped reading the request's body";
                        return Poll::Ready(Err(io::Error::other(stopped)));
                    }
                }
            }
        })
        .await
    }

    /// Reads what the upstream has sent while the request goes out, noting
    /// in `early` (and `begun`) when a final answer begins: `Ready(Ok(()))` when no more
    /// is to be read meanwhile (interim answers past the most a head may
    /// take, or [`READ_WHILE_WRITING`] of an answer), an error at the
    /// connection's end, `Pending` otherwise.
    fn poll_upstream(&mut self, cx: &mut Context<'_>, begun: Option<&HeadBegun>) -> Poll<io::Result<()>> {
        loop {
            if self.early.is_none() {
                match early(&self.buf) {
                    Early::Final(code) => {
                        self.early = Some(code);
                        if let (Some(begun), Some(code)) = (begun, code) {
                            begun.note(code);
                        }
                    }
                    Early::TooLong => return Poll::Ready(Ok(())),
                    Early::NotYet => {}
                }
            }
            if self.early.is_some() && self.buf.len() >= READ_WHILE_WRITING {
                return Poll::Ready(Ok(()));
            }
            self.make_room();
            let read = tokio_util::io::poll_read_buf(Pin::new(&mut self.stream), cx, &mut self.buf);
            if ready!(read)? == 0 {
                let ended = "the upstream closed the connection before the request's body was sent whole";
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::UnexpectedEof, ended)));
            }
        }
    }
}

/// Whether an answer begun early (its status code, `None` for bytes that
/// are no answer) says the upstream wants no more of the body: an error,
/// or a code below 100, which is no status.
fn stops_the_body(code: Option<Code>) -> bool {
    code.and_then(Code::status)
        .is_none_or(|status| status.is_client_error() || status.is_server_error())
}

/// What the bytes an upstream sent while the request was still going out
/// say (see [`Conn::write_body`]).
enum Early {
    /// Nothing, interim answers, or too little to tell.
    NotYet,
    /// A final answer's status code, or `None`: bytes that are not an
    /// answer.
    Final(Option<Code>),
    /// Interim answers past the most a head may take.
    TooLong,
}

fn early(buf: &[u8]) -> Early {
    let mut at = 0;
    loop {
        // Empty lines before a head are skipped, as reading it does.
        at += buf[at..].iter().take_while(|b| matches!(b, b'\r' | b'\n')).count();
        let head = &buf[at..];
        match status_line(head) {
            Some(code) if !code.is_informational() => return Early::Final(Some(code)),
            // An interim answer: what follows it, once it is whole.
            Some(_) => match head.windows(2).position(|w| w == b"\n\n" || w == b"\n\r") {
                Some(end) if head.get(end + 1) == Some(&b'\n') => at += end + 2,
                Some(end) if head.get(end + 2) == Some(&b'\n') => at += end + 3,
                _ if buf.len() > MAX_HEAD => return Early::TooLong,
                _ => return Early::NotYet,
            },
            // Too short yet to say (a status line's first 12 bytes say it).
            None if head.len() < 12 && head.iter().zip(b"HTTP/1.x ").all(|(a, b)| a == b || *b == b'x') => {
                return Early::NotYet;
            }
            None => return Early::Final(None),
        }
    }
}

/// What to do when a request sent on a pooled connection finds it closed:
/// the upstream hung up on the idle connection as the request reached it,
/// or just before (a race no check before sending can close).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum OnStale {
    /// Fail: the upstream may have acted on the request. For the claimed
    /// exchange, whose claim `on_upstream_failure` then settles.
    Fail,
    /// Send it again, once, on a new connection, when its method is
    /// idempotent (RFC 9110 §9.2.2), its body was read whole, and no byte
    /// of an answer came: as nginx's `proxy_next_upstream error` and Go's
    /// client do. For requests no route claims.
    Resend,
}

impl UpstreamClient {
    /// Sends `request` (its URI absolute) and returns the response head,
    /// without its hop-by-hop headers; the body is read as it is polled.
    /// `begun` learns the status of a head that is still coming in.
    pub async fn request(
        &self,
        request: Request<ClientBody>,
        on_stale: OnStale,
        begun: Option<&HeadBegun>,
    ) -> Result<Response<UpstreamResponseBody>, UpstreamError> {
        let (parts, body) = request.into_parts();
        let key = PoolKey {
            client: self.inner.id,
            runtime: tokio::runtime::Handle::try_current().ok().map(|h| h.id()),
            https: parts.uri.scheme() == Some(&Scheme::HTTPS),
            authority: parts.uri.authority().cloned().ok_or_else(|| {
                UpstreamError::Connect(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "the upstream URI has no authority",
                ))
            })?,
            idle_timeout: self.inner.idle_timeout,
        };
        let (mut conn, mut pooled) = match checkout(&key) {
            Some(conn) => (conn, true),
            // Boxed: a new connection is rare, and its future (a TLS
            // handshake's) would otherwise double this one's size.
            None => (Box::pin(self.connect(&key)).await?, false),
        };
        let head_only = parts.method == Method::HEAD;
        // What to send again should the pooled connection turn out closed
        // (a whole body's bytes are shared, not copied).
        let resend = pooled && on_stale == OnStale::Resend && parts.method.is_idempotent();
        let mut again = match &body {
            ClientBody::Whole(bytes) if resend => Some(ClientBody::Whole(bytes.clone())),
            // Ended before a byte was read (an HTTP/2 request whose HEADERS
            // end the stream): as good as none.
            other if resend && other.is_end_stream() => Some(ClientBody::Whole(None)),
            _ => None,
        };
        // Whether body bytes go out: see `keep_alive` below.
        let bodied = !body.is_end_stream() && body.size_hint().exact() != Some(0);
        let mut body = body;
        let (response, framing, keep_alive) = loop {
            let sent = match write_request(&mut conn, &parts, &key.authority, body, begun).await {
                Ok(()) => read_head(&mut conn, head_only, begun).await,
                // Not a byte of the request left: a pooled connection the
                // upstream reset or closed before the runtime noticed is
                // safe to replace, whatever the method (as Go's transport
                // does); a new one means the upstream cannot be reached.
                Err(WriteFailure::Unsent(error, unsent)) => {
                    if !pooled {
                        return Err(UpstreamError::Connect(error));
                    }
                    tracing::debug!(%error, "a pooled upstream connection refused the request; sending it on a new one");
                    body = unsent;
                    pooled = false;
                    // The one resend of a stale connection is this one.
                    again = None;
                    // Boxed: rare, as below.
                    conn = Box::pin(self.connect(&key)).await?;
                    continue;
                }
                // An upstream may answer before it has read the whole body
                // (a 413, a 401) and then close, so the write fails: its
                // answer, if it came first, stands (RFC 9112 §9.3). (Boxed:
                // rare, and the wait would otherwise make every request's
                // future larger.)
                Err(WriteFailure::Sent(UpstreamError::Io(error))) => {
                    Box::pin(early_answer(&mut conn, head_only, error, begun)).await
                }
                Err(WriteFailure::Sent(error)) => Err(error),
            };
            match sent {
                Ok(head) => break head,
                Err(UpstreamError::Io(error)) if conn.buf.is_empty() && again.is_some() => {
                    tracing::debug!(%error, "a pooled upstream connection was closed; sending again on a new one");
                    body = again.take().expect("checked in the guard");
                    pooled = false;
                    // Boxed: rare, as above.
                    conn = Box::pin(self.connect(&key)).await?;
                }
                Err(error) => return Err(error),
            }
        };
        // An upstream that answers an error may not have read a body it
        // got whole (a 401 or 413 from the head alone) and still keep the
        // connection, against RFC 9112 §9.3: the next request written on
        // it would follow the unread bytes. One such error costs a new
        // connection; a body sent into a misread request costs its key.
        let errored = bodied && response.status().as_u16() >= 400;
        let keep_alive = keep_alive && conn.early.is_none() && !errored;
        let mut body = UpstreamResponseBody {
            conn: Some(conn),
            framing,
            key,
            keep_alive,
        };
        body.finish_if_done();
        Ok(response.map(|()| body))
    }

    async fn connect(&self, key: &PoolKey) -> Result<Conn, UpstreamError> {
        let host = key.authority.host().trim_start_matches('[').trim_end_matches(']');
        let port = key.authority.port_u16().unwrap_or(if key.https { 443 } else { 80 });
        let deadline = Instant::now() + self.inner.connect_timeout;
        let connect = async {
            let tcp = connect_any(host, port, deadline).await?;
            tcp.set_nodelay(true)?;
            let keepalive = socket2::TcpKeepalive::new().with_time(Duration::from_secs(60));
            socket2::SockRef::from(&tcp).set_tcp_keepalive(&keepalive)?;
            let stream = if key.https {
                let name = ServerName::try_from(host.to_owned())
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
                Stream::Tls(Box::new(self.inner.tls.connect(name, tcp).await?))
            } else {
                Stream::Plain(tcp)
            };
            Ok(Conn {
                stream,
                buf: BytesMut::new(),
                idle_since: coarse_now(),
                early: None,
            })
        };
        match tokio::time::timeout_at(deadline, connect).await {
            Ok(result) => result.map_err(UpstreamError::Connect),
            Err(_) => Err(UpstreamError::Connect(io::ErrorKind::TimedOut.into())),
        }
    }
}

/// A TCP connection to the first of `host`'s addresses that takes one by
/// `deadline`, each tried in the order the resolver gives them: every one
/// but the last with half the time left, the last with all of it. An
/// address that drops connection attempts (as `localhost` can resolve to
/// `::1` where nothing listens) leaves time for the next, and a slow but
/// healthy first address still has half of `connect_timeout`, however many
/// addresses follow it; one that refuses at once costs the others nothing.
async fn connect_any(host: &str, port: u16, deadline: Instant) -> io::Result<TcpStream> {
    let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host, port)).await?.collect();
    connect_first(&addrs, deadline).await
}

async fn connect_first(addrs: &[std::net::SocketAddr], deadline: Instant) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "the upstream host has no address");
    for (i, addr) in addrs.iter().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now());
        let share = if i + 1 < addrs.len() { left / 2 } else { left };
        match tokio::time::timeout(share, TcpStream::connect(addr)).await {
            Ok(Ok(tcp)) => return Ok(tcp),
            Ok(Err(error)) => last = error,
            Err(_) => last = io::Error::new(io::ErrorKind::TimedOut, format!("connecting to {addr} timed out")),
        }
    }
    Err(last)
}

/// Methods whose requests carry no body unless they say so.
fn bodiless(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS | Method::TRACE | Method::CONNECT
    )
}

thread_local! {
    /// The buffer request heads are written into, kept for the next one.
    static HEAD_BUF: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// The request line and headers, with `host` from the URI and the body's
/// framing: `Some(length)`, or `None` for chunked. Written into this
/// thread's head buffer: hand it back with [`reuse_head`].
fn encode_head(parts: &http::request::Parts, authority: &Authority, length: Option<u64>) -> Vec<u8> {
    let mut head = HEAD_BUF.take();
    head.clear();
    head.extend_from_slice(parts.method.as_str().as_bytes());
    head.push(b' ');
    let target = parts.uri.path_and_query().map_or("", |p| p.as_str());
    // An absolute target's empty path goes as `/` (RFC 9112 §3.2.1):
    // `http://a?x=1` as `/?x=1`, as routes matched it.
    if !target.starts_with('/') && target != "*" {
        head.push(b'/');
    }
    head.extend_from_slice(target.as_bytes());
    head.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    head.extend_from_slice(authority.as_str().as_bytes());
    head.extend_from_slice(b"\r\n");
    for (name, value) in &parts.headers {
        if name == header::HOST || name == header::CONTENT_LENGTH || name == header::TRANSFER_ENCODING {
            continue;
        }
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    match length {
        Some(0) if bodiless(&parts.method) => {}
        Some(length) => {
            head.extend_from_slice(b"content-length: ");
            head.extend_from_slice(wire::itoa(length, &mut [0; 20]));
            head.extend_from_slice(b"\r\n");
        }
        None => head.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    head.extend_from_slice(b"\r\n");
    head
}

/// Keeps a written head's buffer for the next request, unless a large
/// body made it large.
fn reuse_head(head: Vec<u8>) {
    if head.capacity() <= 2 * COALESCE {
        HEAD_BUF.set(head);
    }
}

/// The answer an upstream sent before the request's write failed, if it
/// is there to read already or comes within [`EARLY_ANSWER_WAIT`]; the
/// write's error if not. Such an answer ends its connection.
async fn early_answer(
    conn: &mut Conn,
    head_only: bool,
    error: io::Error,
    begun: Option<&HeadBegun>,
) -> Result<(Response<()>, Framing, bool), UpstreamError> {
    match tokio::time::timeout(EARLY_ANSWER_WAIT, read_head(conn, head_only, begun)).await {
        Ok(Ok((response, framing, _))) => Ok((response, framing, false)),
        // An answer with a status that cannot be passed on (a head cut
        // off after it, say) says the backend had the request, as it
        // would had the write gone through.
        Ok(Err(refused @ UpstreamError::Refused(..))) => Err(refused),
        Ok(Err(_)) | Err(_) => Err(UpstreamError::Io(error)),
    }
}

/// How writing a request failed.
enum WriteFailure {
    /// Not a byte of it left (the body is handed back unread).
    Unsent(io::Error, ClientBody),
    /// Some of it may have reached the upstream.
    Sent(UpstreamError),
}

impl From<UpstreamError> for WriteFailure {
    fn from(error: UpstreamError) -> WriteFailure {
        WriteFailure::Sent(error)
    }
}

impl From<io::Error> for WriteFailure {
    fn from(error: io::Error) -> WriteFailure {
        WriteFailure::Sent(UpstreamError::Io(error))
    }
}

/// Writes the first bytes of a request, `buf`, whole. On a plain
/// connection the first write tells whether the socket took anything: one
/// that fails has sent nothing (`Ok(Err(_))`). Through TLS an error may
/// come after some records went out, so it counts as sent.
async fn write_first(stream: &mut Stream, buf: &[u8]) -> io::Result<Result<(), io::Error>> {
    let taken = match stream {
        Stream::Plain(tcp) => match tcp.write(buf).await {
            Ok(0) => return Ok(Err(io::ErrorKind::WriteZero.into())),
            Ok(n) => n,
            Err(error) => return Ok(Err(error)),
        },
        Stream::Tls(_) => 0,
    };
    stream.write_all(&buf[taken..]).await.map(Ok)
}

async fn write_request(
    conn: &mut Conn,
    parts: &http::request::Parts,
    authority: &Authority,
    body: ClientBody,
    begun: Option<&HeadBegun>,
) -> Result<(), WriteFailure> {
    match body {
        ClientBody::Whole(bytes) => {
            let whole = bytes.as_deref().unwrap_or_default();
            let mut head = encode_head(parts, authority, Some(whole.len() as u64));
            let coalesced = whole.len() <= COALESCE;
            if coalesced {
                head.extend_from_slice(whole);
            }
            if let Err(error) = write_first(&mut conn.stream, &head).await? {
                return Err(WriteFailure::Unsent(error, ClientBody::Whole(bytes)));
            }
            if !coalesced {
                conn.write_body(whole, begun).await?;
            }
            reuse_head(head);
        }
        mut streamed => {
            let length = streamed.size_hint().exact();
            let head = encode_head(parts, authority, length);
            if let Err(error) = write_first(&mut conn.stream, &head).await? {
                return Err(WriteFailure::Unsent(error, streamed));
            }
            reuse_head(head);
            while let Some(frame) = streamed.frame().await {
                let frame = frame.map_err(UpstreamError::RequestBody)?;
                let Ok(data) = frame.into_data() else { continue };
                if data.is_empty() {
                    continue;
                }
                if length.is_none() {
                    // One write per chunk: size line, data and CRLF.
                    let mut chunk = Vec::with_capacity(data.len() + 20);
                    chunk.extend_from_slice(wire::hex_len(data.len(), &mut [0; 16]));
                    chunk.extend_from_slice(b"\r\n");
                    chunk.extend_from_slice(&data);
                    chunk.extend_from_slice(b"\r\n");
                    conn.write_body(&chunk, begun).await?;
                } else {
                    conn.write_body(&data, begun).await?;
                }
            }
            if length.is_none() {
                conn.write_body(b"0\r\n\r\n", begun).await?;
            }
        }
    }
    conn.stream.flush().await?;
    Ok(())
}

/// How a response body ends.
enum Framing {
    /// No body (HEAD, 1xx, 204, 304) or all of it read.
    Empty,
    /// `content-length`: this many bytes still to come.
    Length(u64),
    Chunked(Chunked),
    /// Neither: the body runs until the upstream closes the connection.
    Close,
}

/// The most header fields an upstream's answer may have: more than a
/// client's request may (`wire::MAX_HEADERS`), as nginx bounds an answer's
/// head by its size alone, and a backend's answer refused here cannot be
/// had again. Its 64 KiB (`MAX_HEAD`) still bounds it, and the head is
/// parsed again at most once a line.
const MAX_FIELDS: usize = 256;

/// An answer refused for `why`: by its status when its head began with
/// one (see [`UpstreamError::Refused`]).
fn refused(code: Option<Code>, why: &'static str) -> UpstreamError {
    match code {
        Some(code) => UpstreamError::Refused(code, why),
        None => UpstreamError::Protocol(why),
    }
}

/// The status code of a final answer an HTTP/1.x head in `buf` begins
/// with, if it does: an interim (1xx) answer's says nothing of whether the
/// backend acts on the request (it may yet refuse it), so a head of one
/// that breaks off or is refused is settled as no answer is, by
/// `on_upstream_failure`, as one that came whole and was then cut off is.
fn final_status(buf: &[u8]) -> Option<Code> {
    status_line(buf).filter(|code| !code.is_informational())
}

/// The status code an HTTP/1.x head in `buf` begins with, if it does.
fn status_line(buf: &[u8]) -> Option<Code> {
    let rest = buf.strip_prefix(b"HTTP/1.")?;
    let (minor, rest) = rest.split_first()?;
    let rest = rest.strip_prefix(b" ")?;
    let code = rest.get(..3)?;
    let ended = rest.get(3).is_none_or(|b| matches!(b, b' ' | b'\r' | b'\n'));
    if !minor.is_ascii_digit() || !code.iter().all(u8::is_ascii_digit) || !ended {
        return None;
    }
    Some(Code(code.iter().fold(0, |n, d| n * 10 + u16::from(d - b'0'))))
}

/// Reads the response head (skipping 1xx interim answers) and decides the
/// body's framing and whether the connection can be reused.
async fn read_head(
    conn: &mut Conn,
    head_only: bool,
    begun: Option<&HeadBegun>,
) -> Result<(Response<()>, Framing, bool), UpstreamError> {
    let mut lines = LineWatch::default();
    loop {
        lines.skip_empty_lines(&mut conn.buf);
        if !conn.buf.is_empty() && lines.ended_another(&conn.buf) {
            let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_FIELDS];
            let mut parsed = httparse::Response::new(&mut []);
            let config = httparse::ParserConfig::default();
            match config.parse_response_with_uninit_headers(&mut parsed, &conn.buf, &mut slots) {
                // As when it comes in pieces (below).
                Ok(httparse::Status::Complete(length)) if length > MAX_HEAD => {
                    return Err(refused(final_status(&conn.buf), "the response head is too large"));
                }
                Ok(httparse::Status::Complete(length)) => {
                    let code = parsed.code.unwrap_or(0);
                    let minor = parsed.version.unwrap_or(0);
                    // Offsets of each header in the buffer, to slice it
                    // once it is split off: no copy of the values.
                    let offsets = wire::header_offsets(&conn.buf, parsed.headers);
                    let head = conn.buf.split_to(length).freeze();
                    // httparse reads three digits: one below 100 is no
                    // status, but the backend answered.
                    let status = StatusCode::from_u16(code)
                        .map_err(|_| UpstreamError::Refused(Code(code), "the status is below 100"))?;
                    if status.is_informational() {
                        if status == StatusCode::SWITCHING_PROTOCOLS {
                            return Err(UpstreamError::Refused(status.into(), "the upstream switched protocols"));
                        }
                        // The next head starts the buffer: looked at afresh.
                        lines = LineWatch::default();
                        continue;
                    }
                    let mut response = Response::new(());
                    *response.status_mut() = status;
                    *response.version_mut() = if minor == 1 { Version::HTTP_11 } else { Version::HTTP_10 };
                    let headers = response.headers_mut();
                    headers.reserve(offsets.len());
                    // The hop-by-hop headers stay out of the map (the usual
                    // `Connection: keep-alive` is never inserted to be
                    // removed), but for Transfer-Encoding, read for framing.
                    let noted =
                        wire::append_headers(&head, &offsets, headers, wire::Keep::EndToEnd).map_err(|error| {
                            UpstreamError::Refused(
                                status.into(),
                                match error {
                                    wire::BadHeader::Name => "a header name is not valid",
                                    wire::BadHeader::Value => "a header value is not valid",
                                },
                            )
                        })?;
                    let (framing, keep_alive) =
                        framing(&response, &noted, head_only, minor).map_err(|error| match error {
                            UpstreamError::Protocol(why) => UpstreamError::Refused(status.into(), why),
                            other => other,
                        })?;
                    let headers = response.headers_mut();
                    if !noted.plain_length()
                        && let Ok(Some(length)) = noted.content_length(headers)
                    {
                        // Passed on and recorded as one number, however the
                        // upstream spelled it (RFC 9110 §8.6): HTTP/2
                        // clients take no list, and a bodiless answer has
                        // no body to measure it by again.
                        headers.insert(header::CONTENT_LENGTH, length.into());
                    }
                    if noted.transfer_encoding {
                        // RFC 9112 §6.3: Transfer-Encoding overrides it, and
                        // passed on it would misframe the answer downstream.
                        headers.remove(header::CONTENT_LENGTH);
                        headers.remove(header::TRANSFER_ENCODING);
                    }
                    if noted.connection_names {
                        let connection = offsets.iter().filter(|&&(name_start, name_end, ..)| {
                            head[name_start as usize..name_end as usize].eq_ignore_ascii_case(b"connection")
                        });
                        let values = connection.map(|&(.., start, end)| &head[start as usize..end as usize]);
                        forward::drop_named(headers, values);
                    }
                    return Ok((response, framing, keep_alive));
                }
                Ok(httparse::Status::Partial) => {}
                Err(_) => return Err(refused(final_status(&conn.buf), "the response head does not parse")),
            }
        }
        // Not whole (it would have been parsed as its last line ended).
        if conn.buf.len() > MAX_HEAD {
            return Err(refused(final_status(&conn.buf), "the response head is too large"));
        }
        if let Some(begun) = begun
            && let Some(code) = final_status(&conn.buf)
        {
            begun.note(code);
        }
        if conn.fill().await.map_err(|error| broke_off(&conn.buf, error))? == 0 {
            return Err(broke_off(
                &conn.buf,
                io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the upstream closed the connection before answering",
                ),
            ));
        }
    }
}

/// A connection that failed while an answer's head came in: refused by
/// the head's status when it began with one (the backend had the request:
/// see [`UpstreamError::Refused`]), else a failure no answer explains.
fn broke_off(buf: &[u8], error: io::Error) -> UpstreamError {
    match final_status(buf) {
        Some(code) => UpstreamError::Refused(code, "the answer broke off within its head"),
        None => UpstreamError::Io(error),
    }
}

/// The body's framing (RFC 9112 §6.3) and whether the connection stays open.
fn framing(
    response: &Response<()>,
    noted: &wire::Noted,
    head_only: bool,
    minor: u8,
) -> Result<(Framing, bool), UpstreamError> {
    let headers = response.headers();
    // `close` wins over `keep-alive` when both are sent.
    let keep_alive = !noted.close && (minor == 1 || noted.keep_alive);
    let status = response.status();
    if head_only || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        // No body, but a HEAD's or a 304's Content-Length is passed on:
        // checked as for any answer, so no garbled or conflicting value
        // reaches the client (nginx refuses those too).
        let length = noted.content_length(headers).map_err(UpstreamError::Protocol)?;
        // A 204 may declare neither (RFC 9110 §8.6, RFC 9112 §6.1): one
        // that declares a body may send it, and its bytes would be read as
        // the answer to the next request on this connection.
        let stray = status == StatusCode::NO_CONTENT && (noted.transfer_encoding || length.is_some_and(|l| l > 0));
        // Nor is one after a HEAD: a backend that sends a HEAD's body all
        // the same (a common slip), a moment late, would have it read as
        // the next request's answer, recorded, and replayed.
        return Ok((Framing::Empty, keep_alive && !stray && !head_only));
    }
    if noted.transfer_encoding {
        // Only `chunked` is decoded, and Transfer-Encoding is this hop's:
        // an answer passed on without another coding it declares (gzip, say)
        // would reach the client, and every replay, undeclared. Refused, as
        // nginx does; so is one on HTTP/1.0, whose framing is faulty (RFC
        // 9112 §6.1).
        let mut codings = wire::tokens(headers, header::TRANSFER_ENCODING);
        if minor == 1 && codings.next().is_some_and(|t| t.eq_ignore_ascii_case("chunked")) && codings.next().is_none() {
            // With a Content-Length beside it, the chunked coding frames
            // the body, but the upstream may have meant the other framing:
            // what follows on this connection cannot be trusted (RFC 9112
            // §6.3), so it is not reused.
            return Ok((
                Framing::Chunked(Chunked::Size),
                keep_alive && noted.content_lengths == 0,
            ));
        }
        return Err(UpstreamError::Protocol(
            "the response's transfer coding is not chunked alone",
        ));
    }
    let length = noted.content_length(headers).map_err(UpstreamError::Protocol)?;
    Ok(match length {
        Some(0) => (Framing::Empty, keep_alive),
        Some(length) => (Framing::Length(length), keep_alive),
        None => (Framing::Close, false),
    })
}

/// A response body, read from the connection as it is polled. The
/// connection goes back to the pool when the body has been read to its end,
/// and is closed if the body is dropped before that.
pub struct UpstreamResponseBody {
    conn: Option<Conn>,
    framing: Framing,
    key: PoolKey,
    keep_alive: bool,
}

impl UpstreamResponseBody {
    /// Returns the connection once nothing of the body is left to read.
    fn finish_if_done(&mut self) {
        let done = match &self.framing {
            Framing::Empty | Framing::Length(0) | Framing::Chunked(Chunked::Done) => true,
            Framing::Length(_) | Framing::Chunked(_) | Framing::Close => false,
        };
        if !done {
            return;
        }
        self.framing = Framing::Empty;
        if let Some(conn) = self.conn.take()
            && self.keep_alive
            && conn.buf.is_empty()
        {
            checkin(self.key.clone(), conn);
        }
    }
}

fn eof() -> UpstreamError {
    UpstreamError::Io(io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the upstream closed the connection in the middle of the body",
    ))
}

impl Body for UpstreamResponseBody {
    type Data = Bytes;
    type Error = UpstreamError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        let this = self.get_mut();
        loop {
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            if !conn.buf.is_empty() {
                let frame = match &mut this.framing {
                    Framing::Empty => None,
                    Framing::Length(left) => {
                        let n = (*left).min(conn.buf.len() as u64);
                        *left -= n;
                        Some(Frame::data(conn.buf.split_to(n as usize).freeze()))
                    }
                    Framing::Close => Some(Frame::data(conn.buf.split().freeze())),
                    Framing::Chunked(state) => match next_chunk(state, &mut conn.buf) {
                        Ok(frame) => frame,
                        Err(error) => {
                            this.conn = None;
                            return Poll::Ready(Some(Err(UpstreamError::Protocol(error))));
                        }
                    },
                };
                this.finish_if_done();
                if let Some(frame) = frame {
                    return Poll::Ready(Some(Ok(frame)));
                }
                if this.conn.is_none() {
                    return Poll::Ready(None);
                }
            } else {
                this.finish_if_done();
                if this.conn.is_none() {
                    return Poll::Ready(None);
                }
            }
            let conn = this.conn.as_mut().expect("checked above");
            conn.make_room();
            let read = ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut conn.stream),
                cx,
                &mut conn.buf
            ));
            match read {
                Ok(0) => {
                    this.conn = None;
                    return match this.framing {
                        Framing::Close => Poll::Ready(None),
                        _ => Poll::Ready(Some(Err(eof()))),
                    };
                }
                Ok(_) => {}
                Err(error) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(UpstreamError::Io(error))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.framing, Framing::Empty)
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Empty => SizeHint::with_exact(0),
            Framing::Length(left) => SizeHint::with_exact(left),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_head_begins_with_a_status_or_does_not() {
        for (head, status) in [
            (&b"HTTP/1.1 201 Created\r\n"[..], Some(201)),
            (b"HTTP/1.0 429\r\n", Some(429)),
            (b"HTTP/1.1 503", Some(503)),
            (b"HTTP/1.1 2011 X\r\n", None),
            (b"HTTP/1.1 099 Weird\r\n", Some(99)),
            (b"HTTP/1.1 000\r\n", Some(0)),
            (b"HTTP/1.1 20x\r\n", None),
            (b"HTTP/2.0 200\r\n", None),
            (b"SSH-2.0-OpenSSH_9.6\r\n", None),
            (b"HTTP/1.1  200\r\n", None),
        ] {
            let found = status_line(head).map(|code| code.0);
            assert_eq!(found, status, "{}", String::from_utf8_lossy(head));
        }
    }

    /// An address that drops connection attempts: a listener whose accept
    /// queue is full (never accepted from), kept alive with its queue.
    fn unanswering() -> (std::net::SocketAddr, socket2::Socket, Vec<std::net::TcpStream>) {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        socket
            .bind(&"127.0.0.2:0".parse::<std::net::SocketAddr>().unwrap().into())
            .unwrap();
        socket.listen(0).unwrap();
        let addr = socket.local_addr().unwrap().as_socket().unwrap();
        // Fill the queue: connections the kernel completes until it is full.
        let mut queued = Vec::new();
        for _ in 0..8 {
            match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(100)) {
                Ok(stream) => queued.push(stream),
                Err(_) => break,
            }
        }
        (addr, socket, queued)
    }

    /// A pooled connection idle a while, and what its peer did meanwhile
    /// (written before the runtime ever looks at the socket again).
    async fn idle_conn(peer_does: impl FnOnce(&mut std::net::TcpStream)) -> (Conn, std::net::TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tcp = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (mut peer, _) = listener.accept().unwrap();
        peer_does(&mut peer);
        // No `.await` from here: the runtime never polls the socket.
        std::thread::sleep(Duration::from_millis(50));
        let idle_since = coarse_now() - ASK_THE_KERNEL_AFTER * 2;
        (
            Conn {
                stream: Stream::Plain(tcp),
                buf: BytesMut::new(),
                idle_since,
                early: None,
            },
            peer,
        )
    }

    /// An upstream that closed an idle connection (here with a stray `408`
    /// first, as some do) is not sent the next request, though the runtime
    /// has not seen the close yet; a quiet one is reused.
    #[tokio::test]
    async fn a_close_the_runtime_has_not_seen_is_still_noticed() {
        use std::io::Write;
        let (mut closed, peer) = idle_conn(|peer| {
            peer.write_all(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n\r\n")
                .unwrap();
            peer.shutdown(std::net::Shutdown::Both).unwrap();
        })
        .await;
        drop(peer);
        assert!(!closed.usable(Duration::from_secs(4)));
        let (mut fin, peer) = idle_conn(|peer| peer.shutdown(std::net::Shutdown::Write).unwrap()).await;
        assert!(!fin.usable(Duration::from_secs(4)));
        drop(peer);
        let (mut quiet, _peer) = idle_conn(|_| {}).await;
        assert!(quiet.usable(Duration::from_secs(4)));
    }

    /// A quiet connection idle past `idle_timeout` is not reused, whether
    /// or not the sweep has come by yet.
    #[tokio::test]
    async fn a_connection_idle_past_its_timeout_is_not_reused() {
        let (mut idle, _peer) = idle_conn(|_| {}).await;
        assert!(!idle.usable(ASK_THE_KERNEL_AFTER));
    }

    /// A pooled connection the upstream reset a moment ago, before the
    /// runtime looked at it again, refuses the request's first write: not
    /// a byte left, so even a POST under `OnStale::Fail` (a claimed one)
    /// goes on a new connection.
    #[tokio::test]
    async fn a_request_no_byte_of_which_left_goes_on_a_new_connection() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let config = UpstreamConfig {
            url: format!("http://{addr}").parse().unwrap(),
            connect_timeout: Duration::from_secs(2),
            timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            ca: None,
        };
        let upstream = client(&config).unwrap();
        let key = PoolKey {
            client: upstream.inner.id,
            runtime: Some(tokio::runtime::Handle::current().id()),
            https: false,
            authority: config.url.authority().unwrap().clone(),
            idle_timeout: config.idle_timeout,
        };
        let post = || {
            Request::post(format!("http://{addr}/orders"))
                .body(ClientBody::Whole(Some(Bytes::from_static(b"{}"))))
                .unwrap()
        };

        let tcp = TcpStream::connect(addr).await.unwrap();
        let (peer, _) = listener.accept().unwrap();
        // The next connection is answered, once.
        let served = std::thread::spawn(move || {
            let (mut next, _) = listener.accept().unwrap();
            let mut seen = [0u8; 1024];
            let n = next.read(&mut seen).unwrap();
            next.write_all(b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n")
                .unwrap();
            (String::from_utf8_lossy(&seen[..n]).into_owned(), listener)
        });
        // No `.await` from here to the request: the runtime never sees the
        // reset before the connection is taken from the pool.
        socket2::SockRef::from(&peer).set_linger(Some(Duration::ZERO)).unwrap();
        drop(peer);
        std::thread::sleep(Duration::from_millis(20));
        checkin(
            key,
            Conn {
                stream: Stream::Plain(tcp),
                buf: BytesMut::new(),
                idle_since: coarse_now(),
                early: None,
            },
        );
        let answer = upstream.request(post(), OnStale::Fail, None).await.unwrap();
        assert_eq!(answer.status(), StatusCode::CREATED);
        let (seen, listener) = served.join().unwrap();
        assert!(seen.starts_with("POST /orders HTTP/1.1\r\n"), "{seen}");
        drop((answer, listener));
    }

    #[tokio::test]
    async fn an_address_that_drops_attempts_leaves_time_for_the_next() {
        let (dead, _socket, _queued) = unanswering();
        let started = Instant::now();
        let attempt = tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(dead)).await;
        assert!(
            attempt.is_err(),
            "the full queue should leave the attempt hanging: {attempt:?}"
        );
        assert!(started.elapsed() >= Duration::from_millis(290));

        let live = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let started = Instant::now();
        let deadline = started + Duration::from_millis(1200);
        let tcp = connect_first(&[dead, live.local_addr().unwrap()], deadline).await;
        assert_eq!(tcp.unwrap().peer_addr().unwrap(), live.local_addr().unwrap());
        // The first address had half the time, the last the rest.
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(590) && took < Duration::from_millis(1200),
            "{took:?}"
        );

        let error = connect_first(&[dead], Instant::now() + Duration::from_millis(100))
            .await
            .unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
    }

    #[test]
    fn framing_follows_rfc_9112() {
        let response = |status: u16, headers: &[(&str, &str)]| {
            let mut r = Response::new(());
            *r.status_mut() = StatusCode::from_u16(status).unwrap();
            for (n, v) in headers {
                r.headers_mut()
                    .append(http::HeaderName::from_bytes(n.as_bytes()).unwrap(), v.parse().unwrap());
            }
            r
        };
        let framing = |r: &Response<()>, head: bool, minor: u8| framing(r, &wire::Noted::of(r.headers()), head, minor);
        let f = |r: &Response<()>, head: bool, minor: u8| framing(r, head, minor).unwrap();
        assert!(matches!(
            f(&response(200, &[("content-length", "3")]), false, 1),
            (Framing::Length(3), true)
        ));
        // A HEAD's answer: bodiless, and its connection not reused.
        assert!(matches!(
            f(&response(200, &[("content-length", "3")]), true, 1),
            (Framing::Empty, false)
        ));
        assert!(matches!(f(&response(204, &[]), false, 1), (Framing::Empty, true)));
        // A 204 that declares a body may send it: not reused. A 304's
        // length and coding are those a 200 would have had.
        for (status, declared) in [(204, ("content-length", "5")), (204, ("transfer-encoding", "chunked"))] {
            assert!(matches!(
                f(&response(status, &[declared]), false, 1),
                (Framing::Empty, false)
            ));
        }
        for (status, declared) in [(204, ("content-length", "0")), (304, ("transfer-encoding", "chunked"))] {
            assert!(matches!(
                f(&response(status, &[declared]), false, 1),
                (Framing::Empty, true)
            ));
        }
        // Bodiless, but the length is still one number.
        assert!(matches!(
            f(&response(304, &[("content-length", "7, 7")]), false, 1),
            (Framing::Empty, true)
        ));
        for (status, head) in [(304, false), (200, true)] {
            for length in ["1, 2", "x", "-1"] {
                let answer = response(status, &[("content-length", length)]);
                assert!(framing(&answer, head, 1).is_err(), "{status} {length}");
            }
        }
        assert!(matches!(
            f(&response(200, &[("transfer-encoding", "Chunked")]), false, 1),
            (Framing::Chunked(_), true)
        ));
        // Codings other than chunked would pass on undeclared: refused.
        for coding in ["gzip, chunked", "gzip", "chunked, chunked", "chunked, gzip"] {
            assert!(
                framing(&response(200, &[("transfer-encoding", coding)]), false, 1).is_err(),
                "{coding}"
            );
        }
        assert!(matches!(f(&response(200, &[]), false, 1), (Framing::Close, false)));
        assert!(matches!(
            f(
                &response(200, &[("content-length", "1"), ("connection", "close")]),
                false,
                1
            ),
            (Framing::Length(1), false)
        ));
        assert!(matches!(
            f(&response(200, &[("content-length", "1")]), false, 0),
            (_, false)
        ));
        assert!(
            framing(
                &response(200, &[("content-length", "1"), ("content-length", "2")]),
                false,
                1
            )
            .is_err()
        );
        assert!(framing(&response(200, &[("content-length", "+3")]), false, 1).is_err());
        assert!(framing(&response(200, &[("content-length", "1, 1")]), false, 1).is_ok());
        // HTTP/1.0 has no transfer codings: its framing is faulty.
        assert!(framing(&response(200, &[("transfer-encoding", "chunked")]), false, 0).is_err());
        // HTTP/1.0 keeps the connection only when asked, and `close` wins.
        let kept = |headers: &[(&str, &str)]| f(&response(200, headers), false, 0).1;
        assert!(kept(&[("content-length", "1"), ("connection", "keep-alive")]));
        assert!(!kept(&[("content-length", "1"), ("connection", "keep-alive, close")]));
        assert!(!kept(&[
            ("content-length", "1"),
            ("connection", "close"),
            ("connection", "keep-alive")
        ]));
    }
}
