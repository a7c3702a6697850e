//! The HTTP/1.1 listener: one task per connection that parses each request
//! head, hands the request to the gateway, and writes the answer.
//!
//! It does what hyper's HTTP/1 server did for idemgate with less work per
//! request: the head is parsed once into a shared buffer the header values
//! point into, a body that came with its head is handed over whole, and an
//! answer whose body is ready goes out in the same write as its head.
//!
//! What it guarantees, as a server in front of an unmodified backend must:
//!
//! - framing by RFC 9112 §6: `Transfer-Encoding` with `Content-Length`,
//!   conflicting or malformed lengths, codings that do not end in one
//!   `chunked`, or any transfer coding on HTTP/1.0 is refused with 400 (a
//!   coding before a final `chunked` with 501) and the connection closed,
//!   and chunk-size lines are read strictly, so no request can be smuggled
//!   past the gateway;
//! - a head over `MAX_HEAD` gets 431 (414 when its request line alone is),
//!   a version besides HTTP/1.0 and 1.1 gets 505, each a problem document;
//! - a head must arrive within `header_read_timeout` (an idle keep-alive
//!   connection too); a body that stops arriving, and an answer the client
//!   stops reading, are cut off after as long without progress;
//! - `Expect: 100-continue` is answered only when the body is wanted; a
//!   request whose body was not read to its end closes its connection;
//! - a client that hangs up cancels its request, as with hyper (a claimed
//!   exchange runs in a task of its own and is not cancelled with it);
//! - pipelined requests are answered in order;
//! - a connection that opens with the HTTP/2 preface is handed back to the
//!   caller, which serves it with hyper (h2c with prior knowledge).

use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::clock::coarse_now;
use crate::proxy::{ClientBody, Feed, Gateway, Peer, Problem, ResponseBody};
use crate::wire::{self, Chunked, LineWatch, MAX_HEAD, MAX_HEADERS};

/// What a client must send first to speak HTTP/2 without TLS.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Bytes read from the client at a time, at least.
const READ_CHUNK: usize = 8 * 1024;
/// Response bytes gathered before a write, at most; a body frame larger
/// than this is written on its own rather than copied.
const WRITE_GATHER: usize = 64 * 1024;
/// How long a closing connection's further bytes are read and dropped (and
/// its close waited for), at most.
const LINGER: Duration = Duration::from_secs(2);

/// How an HTTP/1.1 connection ended.
pub enum Ended<S> {
    /// Closed: by either side, a timeout, an error or shutdown.
    Closed,
    /// It opened with the HTTP/2 preface: the stream and what was read.
    Http2(S, Bytes),
}

/// Serves one connection until it closes or `shutdown` is cancelled (an
/// idle connection closes then; a busy one after its answer).
pub async fn serve<S>(
    io: S,
    gateway: Arc<ArcSwap<Gateway>>,
    peer: Peer,
    header_read_timeout: Duration,
    shutdown: CancellationToken,
) -> Ended<S>
where
    S: AsyncRead + AsyncWrite + Reset + Unpin + Send,
{
    let mut conn = Connection::new(io, header_read_timeout, &shutdown);
    let mut first = true;
    loop {
        let head = match conn.read_head(first).await {
            Ok(Read::Head(head)) => head,
            Ok(Read::Http2) => return Ended::Http2(conn.io, conn.rbuf.freeze()),
            Ok(Read::Closed) => return Ended::Closed,
            Err(refusal) => {
                let _ = conn.refuse(refusal).await;
                return Ended::Closed;
            }
        };
        first = false;
        let Head {
            request,
            framing,
            mut keep_alive,
            expect_continue,
        } = head;
        let head_only = request.method == Method::HEAD;
        let version = request.version;

        // The body: whole when it came with the head, else fed as it is read.
        let (body, feed) = match framing {
            BodyFraming::Length(0) => (ClientBody::Whole(None), None),
            BodyFraming::Length(n) if n <= conn.rbuf.len() as u64 => {
                (ClientBody::whole(conn.rbuf.split_to(n as usize).freeze()), None)
            }
            framing => {
                let length = match framing {
                    BodyFraming::Length(n) => Some(n),
                    BodyFraming::Chunked => None,
                };
                let (feed, body) = ClientBody::feed(length, expect_continue && conn.rbuf.is_empty());
                (body, Some((feed, framing)))
            }
        };
        if request.method == Method::CONNECT {
            // No tunnels: answered like any request, then closed.
            keep_alive = false;
        }
        let request = request.into_request(body);

        // The gateway's answer, while the body is fed and the connection is
        // watched for a hang-up.
        let mut settled = feed.is_none();
        let response = {
            let gateway = gateway.load_full();
            let answer = pin!(gateway.handle(request, peer));
            let watch = pin!(conn.feed_then_watch(feed, &mut settled));
            match futures_util::future::select(answer, watch).await {
                futures_util::future::Either::Left((response, _)) => response,
                // The client hung up: the request is cancelled with it.
                futures_util::future::Either::Right(((), _)) => return Ended::Closed,
            }
        };
        // A body not read to its end leaves the connection mid-message: it
        // cannot carry another request.
        keep_alive &= settled;
        if shutdown.is_cancelled() {
            keep_alive = false;
        }
        let answered = conn.answer(response, version, head_only, &mut keep_alive).await;
        if answered.is_err() || !keep_alive {
            conn.close(answered.is_ok() && !settled).await;
            return Ended::Closed;
        }
    }
}

/// Answers plain HTTP sent to a TLS listener (a client that wrote
/// `http://` for `https://`) with a readable 400, as nginx does, rather
/// than a TLS alert it cannot show; then closes the connection.
pub async fn refuse_plain_http<S>(io: S, timeout: Duration, shutdown: &CancellationToken)
where
    S: AsyncRead + AsyncWrite + Reset + Unpin + Send,
{
    let mut conn = Connection::new(io, timeout, shutdown);
    let _ = conn
        .refuse(Refusal::BadRequest(
            "plain HTTP was sent to a port that speaks HTTPS; use an https:// URL",
        ))
        .await;
}

/// A request as parsed from its head, before its body is known.
struct Parsed {
    method: Method,
    uri: Uri,
    version: Version,
    headers: HeaderMap,
}

impl Parsed {
    fn into_request(self, body: ClientBody) -> Request<ClientBody> {
        let mut request = Request::new(body);
        *request.method_mut() = self.method;
        *request.uri_mut() = self.uri;
        *request.version_mut() = self.version;
        *request.headers_mut() = self.headers;
        request
    }
}

#[derive(Debug)]
enum BodyFraming {
    Length(u64),
    Chunked,
}

struct Head {
    request: Parsed,
    framing: BodyFraming,
    keep_alive: bool,
    expect_continue: bool,
}

// Returned once per request and taken apart at once: boxing the head would
// cost an allocation for nothing.
#[allow(clippy::large_enum_variant)]
enum Read {
    Head(Head),
    Http2,
    Closed,
}

/// A head that cannot be served: answered, then the connection closed.
/// The statuses are nginx's and RFC 9112's.
#[derive(Debug)]
enum Refusal {
    /// 400.
    BadRequest(&'static str),
    /// 431: over `MAX_HEAD` bytes or `MAX_HEADERS` fields.
    HeadTooLarge,
    /// 414: a request line over `MAX_HEAD` bytes on its own.
    UriTooLong,
    /// 501: a transfer coding besides a final `chunked` (RFC 9112 §6.1).
    CodingNotImplemented,
    /// 505: a well-formed version that is not HTTP/1.0 or HTTP/1.1.
    VersionNotSupported,
}

impl Refusal {
    /// The refusal of a head over `MAX_HEAD` bytes, `buf` its start: 414
    /// when the request line alone is that long, else 431.
    fn too_large(buf: &[u8]) -> Refusal {
        if buf[..buf.len().min(MAX_HEAD)].contains(&b'\n') {
            Refusal::HeadTooLarge
        } else {
            Refusal::UriTooLong
        }
    }

    /// Its `application/problem+json` answer.
    fn response(self) -> Response<ResponseBody> {
        let (status, slug, title, detail) = match self {
            Refusal::BadRequest(why) => return Problem::BadRequest(why.into()).response(),
            Refusal::HeadTooLarge => (
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "head-too-large",
                "Request header fields too large",
                "the request head is over 64 KiB or 128 fields",
            ),
            Refusal::UriTooLong => (
                StatusCode::URI_TOO_LONG,
                "uri-too-long",
                "URI too long",
                "the request line is over 64 KiB",
            ),
            Refusal::CodingNotImplemented => (
                StatusCode::NOT_IMPLEMENTED,
                "coding-not-implemented",
                "Transfer coding not implemented",
                "the only transfer coding accepted is chunked",
            ),
            Refusal::VersionNotSupported => (
                StatusCode::HTTP_VERSION_NOT_SUPPORTED,
                "version-not-supported",
                "HTTP version not supported",
                "the versions served are HTTP/1.0, HTTP/1.1 and HTTP/2",
            ),
        };
        crate::proxy::problem::document(status, slug, title, detail)
    }
}

struct Connection<S> {
    io: S,
    /// Bytes read and not yet used: the next head, or a body's start.
    rbuf: BytesMut,
    /// The answer being gathered for one write.
    wbuf: Vec<u8>,
    /// How much of `wbuf` is written already.
    sent: usize,
    /// The deadline of the current wait for a head or for write progress.
    timer: Pin<Box<Sleep>>,
    timeout: Duration,
    shutdown: Pin<Box<WaitForCancellationFutureOwned>>,
    /// An answer that only the close ends (HTTP/1.0, no length) is being
    /// written: closing cleanly now would make it look complete.
    delimited_by_close: bool,
}

/// A connection that can be reset: closed with a TCP RST, which the client
/// sees as an error, rather than a FIN, which ends a close-delimited body
/// as if it were whole.
pub trait Reset {
    fn reset_on_close(&self);
}

impl Reset for tokio::net::TcpStream {
    fn reset_on_close(&self) {
        // A zero linger makes closing the socket send a reset.
        let _ = socket2::SockRef::from(self).set_linger(Some(Duration::ZERO));
    }
}

impl Reset for tokio_rustls::server::TlsStream<tokio::net::TcpStream> {
    fn reset_on_close(&self) {
        self.get_ref().0.reset_on_close();
    }
}

/// What one wait on the connection produced.
enum Wait {
    Read(usize),
    TimedOut,
    Shutdown,
}

impl<S: AsyncRead + AsyncWrite + Reset + Unpin> Connection<S> {
    fn new(io: S, timeout: Duration, shutdown: &CancellationToken) -> Connection<S> {
        Connection {
            io,
            rbuf: BytesMut::new(),
            wbuf: Vec::new(),
            sent: 0,
            timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
            timeout,
            shutdown: Box::pin(shutdown.clone().cancelled_owned()),
            delimited_by_close: false,
        }
    }

    /// Room for a read, topped up only when little is left, so small
    /// requests share one allocation.
    fn make_room(&mut self) {
        if self.rbuf.capacity() - self.rbuf.len() < 1024 {
            self.rbuf.reserve(READ_CHUNK);
        }
    }

    /// Reads into the buffer. The deadline is set only when a read first
    /// has to wait (see [`Connection::poll_due`]); shutdown interrupts the
    /// wait only while `idle`.
    async fn fill(&mut self, idle: bool, deadline: &mut Option<Instant>) -> io::Result<Wait> {
        self.make_room();
        std::future::poll_fn(|cx| {
            match tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.rbuf) {
                Poll::Ready(Ok(n)) => return Poll::Ready(Ok(Wait::Read(n))),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
            if idle && self.shutdown.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Ok(Wait::Shutdown));
            }
            self.poll_due(cx, deadline).map(|()| Ok(Wait::TimedOut))
        })
        .await
    }

    /// Ready once `due` has passed; `due` is set to the timeout from now
    /// when the wait first polls. The timer is moved only when it would
    /// fall due after `due`, or when it falls due before it: most waits end
    /// long before their deadline, and moving the timer for every one would
    /// cost a trip through the runtime's timer wheel per request.
    fn poll_due(&mut self, cx: &mut Context<'_>, due: &mut Option<Instant>) -> Poll<()> {
        let timeout = self.timeout;
        let due = *due.get_or_insert_with(|| coarse_now() + timeout);
        if self.timer.deadline() > due {
            self.timer.as_mut().reset(due);
        }
        while self.timer.as_mut().poll(cx).is_ready() {
            if self.timer.deadline() >= due {
                return Poll::Ready(());
            }
            self.timer.as_mut().reset(due);
        }
        Poll::Pending
    }

    /// Reads the next request head; `Closed` when the client closed or went
    /// quiet between requests, or the server is shutting down.
    ///
    /// The whole head must arrive within one `header_read_timeout`, counted
    /// from when it was first waited for.
    async fn read_head(&mut self, first: bool) -> Result<Read, Refusal> {
        let mut deadline = None;
        let mut lines = LineWatch::default();
        loop {
            if let Some(read) = look(&mut self.rbuf, &mut lines, first)? {
                return Ok(read);
            }
            let idle = self.rbuf.is_empty();
            match self.fill(idle, &mut deadline).await {
                Ok(Wait::Read(n)) if n > 0 => {}
                // Closed, even mid-head, timed out or shut down: nobody to answer.
                Ok(_) | Err(_) => return Ok(Read::Closed),
            }
        }
    }

    /// Feeds the request body, if any, then watches the connection while
    /// the answer is made: resolves only when the client hangs up. Bytes of
    /// a pipelined next request are kept for later. `settled` is set once
    /// the body has been read to its end.
    async fn feed_then_watch(&mut self, feed: Option<(Feed, BodyFraming)>, settled: &mut bool) {
        if let Some((feed, framing)) = feed {
            match self.feed(feed, framing).await {
                Fed::All => *settled = true,
                // Unread or broken: there is nothing more to watch for; the
                // connection closes after the answer.
                Fed::Stopped => return std::future::pending().await,
                Fed::Gone => return,
            }
        }
        std::future::poll_fn(|cx| self.poll_hung_up(cx)).await
    }

    /// Ready when the client has hung up (an EOF or an error), watched
    /// while an answer is made. It reads only while nothing is buffered:
    /// bytes of a next (pipelined) request stay for later, and reading then
    /// stops, so a client that sends its requests and then closes its side
    /// gets the answers to all but the last; once that one is read, the
    /// EOF says the client has gone, as with hyper (whose `half_close` is
    /// off by default), and the last is cancelled (a claimed exchange
    /// still runs to its end).
    fn poll_hung_up(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.rbuf.is_empty() {
            return Poll::Pending;
        }
        self.make_room();
        match tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.rbuf) {
            Poll::Ready(Ok(n)) if n > 0 => Poll::Pending,
            Poll::Ready(_) => Poll::Ready(()),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Reads a body into `feed`, answering `100 Continue` first when the
    /// body waits for demand.
    async fn feed(&mut self, mut feed: Feed, framing: BodyFraming) -> Fed {
        if let Some(wanted) = feed.wanted.take() {
            if wanted.await.is_err() {
                return Fed::Stopped;
            }
            // Through the write buffer: if the answer comes before this is
            // all out, the answer's write finishes it first.
            self.wbuf.extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
            if self.flush().await.is_err() {
                return Fed::Gone;
            }
        }
        let mut left = match framing {
            BodyFraming::Length(n) => Some(n),
            BodyFraming::Chunked => None,
        };
        let mut chunked = Chunked::Size;
        loop {
            // What the buffer holds of the body.
            let item = match &mut left {
                Some(0) => Some(Ok(None)),
                Some(left) if !self.rbuf.is_empty() => {
                    let n = (*left).min(self.rbuf.len() as u64);
                    *left -= n;
                    Some(Ok(Some(self.rbuf.split_to(n as usize).freeze())))
                }
                Some(_) => None,
                None => match wire::next_chunk(&mut chunked, &mut self.rbuf) {
                    Ok(Some(frame)) => match frame.into_data() {
                        Ok(data) => Some(Ok(Some(data))),
                        // Trailers are not passed on.
                        Err(_) => continue,
                    },
                    Ok(None) if matches!(chunked, Chunked::Done) => Some(Ok(None)),
                    Ok(None) => None,
                    Err(why) => Some(Err(why)),
                },
            };
            match item {
                Some(Ok(item)) => {
                    let end = item.is_none();
                    if feed.items.send(Ok(item)).await.is_err() {
                        return Fed::Stopped;
                    }
                    if end {
                        return Fed::All;
                    }
                    continue;
                }
                Some(Err(why)) => {
                    let _ = feed.items.send(Err(why.into())).await;
                    return Fed::Stopped;
                }
                None => {}
            }
            // A body must keep coming: no byte for the timeout ends it.
            let mut deadline = None;
            match self.fill(false, &mut deadline).await {
                Ok(Wait::Read(n)) if n > 0 => {}
                Ok(Wait::TimedOut) => {
                    let _ = feed.items.send(Err("the client stopped sending its body".into())).await;
                    return Fed::Stopped;
                }
                _ => {
                    let _ = feed
                        .items
                        .send(Err("the client closed the connection mid-body".into()))
                        .await;
                    return Fed::Gone;
                }
            }
        }
    }

    /// Writes `wbuf` out. Waiting longer than the timeout for the client to
    /// take a byte is an error.
    ///
    /// How much is out is kept in the connection, so a flush dropped midway
    /// (an interim `100 Continue` when the answer comes) is resumed, never
    /// repeated, by the next.
    async fn flush(&mut self) -> io::Result<()> {
        let mut due = None;
        std::future::poll_fn(|cx| {
            while self.sent < self.wbuf.len() {
                match Pin::new(&mut self.io).poll_write(cx, &self.wbuf[self.sent..]) {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                    Poll::Ready(Ok(n)) => {
                        self.sent += n;
                        due = None;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => return self.stalled(cx, &mut due),
                }
            }
            match Pin::new(&mut self.io).poll_flush(cx) {
                Poll::Ready(result) => Poll::Ready(result),
                Poll::Pending => self.stalled(cx, &mut due),
            }
        })
        .await?;
        self.wbuf.clear();
        self.sent = 0;
        Ok(())
    }

    /// A write is waiting on the client: pending until the timeout, counted
    /// from when it started waiting.
    fn stalled(&mut self, cx: &mut Context<'_>, due: &mut Option<Instant>) -> Poll<io::Result<()>> {
        self.poll_due(cx, due).map(|()| Err(io::ErrorKind::TimedOut.into()))
    }

    /// Answers a head that cannot be served.
    async fn refuse(&mut self, refusal: Refusal) -> io::Result<()> {
        self.answer(refusal.response(), Version::HTTP_11, false, &mut false)
            .await?;
        self.close(true).await;
        Ok(())
    }

    /// Closes the connection. With `linger`, what the client still sends
    /// is read and dropped for a moment first, so closing with unread bytes
    /// does not reset the connection before the client has read the answer.
    ///
    /// Bounded: a TLS close waits for the client to take what is buffered,
    /// which a client that stopped reading never does.
    ///
    /// An answer delimited by the close that was cut off is reset instead:
    /// a clean close would end it as if it were whole.
    async fn close(&mut self, linger: bool) {
        if self.delimited_by_close {
            self.io.reset_on_close();
            return;
        }
        let linger = linger || !self.rbuf.is_empty();
        let _ = tokio::time::timeout(LINGER, async {
            if self.io.shutdown().await.is_err() || !linger {
                return;
            }
            let mut sink = [0u8; 4096];
            while matches!(self.io.read(&mut sink).await, Ok(n) if n > 0) {}
        })
        .await;
    }

    /// Writes `response`: the head, then the body as it comes, gathered into
    /// as few writes as it allows. Clears `keep_alive` when the answer ends
    /// the connection (close-delimited, or cut off).
    async fn answer(
        &mut self,
        response: Response<ResponseBody>,
        version: Version,
        head_only: bool,
        keep_alive: &mut bool,
    ) -> io::Result<()> {
        let (parts, mut body) = response.into_parts();
        let status = parts.status;
        let bodiless = head_only
            || status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED;
        // The body's framing: its exact size when known, else the length the
        // answer declares, else chunked (close-delimited for HTTP/1.0).
        let exact = body.size_hint().exact();
        let declared = || wire::content_length(&parts.headers).ok().flatten();
        let framing = if bodiless {
            Out::None
        } else if let Some(n) = exact.or_else(declared) {
            Out::Length(n)
        } else if version == Version::HTTP_11 {
            Out::Chunked
        } else {
            *keep_alive = false;
            Out::Close
        };

        let w = &mut self.wbuf;
        w.extend_from_slice(b"HTTP/1.1 ");
        w.extend_from_slice(status.as_str().as_bytes());
        w.push(b' ');
        w.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
        w.extend_from_slice(b"\r\n");
        let mut has_date = false;
        for (name, value) in &parts.headers {
            // Framing and connection headers are this hop's to set; a
            // bodiless answer keeps the length it declares (HEAD, 304; a
            // 204 has none).
            if name == header::TRANSFER_ENCODING
                || name == header::CONNECTION
                || (name == header::CONTENT_LENGTH && (!bodiless || status == StatusCode::NO_CONTENT))
            {
                continue;
            }
            has_date |= name == header::DATE;
            w.extend_from_slice(name.as_str().as_bytes());
            w.extend_from_slice(b": ");
            w.extend_from_slice(value.as_bytes());
            w.extend_from_slice(b"\r\n");
        }
        if !has_date {
            w.extend_from_slice(b"date: ");
            date::now(w);
            w.extend_from_slice(b"\r\n");
        }
        match framing {
            Out::Length(n) => {
                w.extend_from_slice(b"content-length: ");
                w.extend_from_slice(wire::itoa(n, &mut [0; 20]));
                w.extend_from_slice(b"\r\n");
            }
            Out::Chunked => w.extend_from_slice(b"transfer-encoding: chunked\r\n"),
            // A HEAD answered with a body in hand (a problem, a replay; an
            // upstream's answer to a HEAD has none) declares the length a
            // GET would get, as nginx does (RFC 9110 §9.3.2).
            Out::None if head_only && !status.is_informational() && exact.is_some_and(|n| n > 0) => {
                if !parts.headers.contains_key(header::CONTENT_LENGTH) {
                    w.extend_from_slice(b"content-length: ");
                    w.extend_from_slice(wire::itoa(exact.unwrap_or(0), &mut [0; 20]));
                    w.extend_from_slice(b"\r\n");
                }
            }
            Out::None | Out::Close => {}
        }
        if !*keep_alive {
            w.extend_from_slice(b"connection: close\r\n");
        } else if version == Version::HTTP_10 {
            w.extend_from_slice(b"connection: keep-alive\r\n");
        }
        w.extend_from_slice(b"\r\n");
        if bodiless {
            drop(body);
            return self.flush().await;
        }
        // Until the body is written whole (see `close`).
        self.delimited_by_close = matches!(framing, Out::Close);

        let mut left = match framing {
            Out::Length(n) => Some(n),
            _ => None,
        };
        loop {
            // Take what is ready; write out what was gathered before waiting.
            let frame = match std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx))).await {
                Poll::Ready(frame) => frame,
                Poll::Pending => {
                    self.flush().await?;
                    self.next_frame(&mut body).await?
                }
            };
            let data = match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => data,
                    // Trailers are not passed on.
                    Err(_) => continue,
                },
                None => break,
                Some(Err(_)) => {
                    // Cut off: what was sent stays short of its framing, and
                    // the connection closes, so the client sees a broken
                    // answer rather than a complete-looking one.
                    *keep_alive = false;
                    let _ = self.flush().await;
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
            };
            if data.is_empty() {
                continue;
            }
            if let Some(left) = &mut left {
                if data.len() as u64 > *left {
                    *keep_alive = false;
                    return Err(io::Error::other("the body is longer than its content-length"));
                }
                *left -= data.len() as u64;
            }
            self.gather(&data, matches!(framing, Out::Chunked)).await?;
        }
        if left.is_some_and(|left| left > 0) {
            *keep_alive = false;
            let _ = self.flush().await;
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if matches!(framing, Out::Chunked) {
            self.wbuf.extend_from_slice(b"0\r\n\r\n");
        }
        self.flush().await?;
        self.delimited_by_close = false;
        Ok(())
    }

    /// Waits for the body's next frame, watching the connection meanwhile:
    /// a client that hangs up ends the answer (and drops the body, which
    /// lets a pass-through upstream go).
    async fn next_frame(
        &mut self,
        body: &mut ResponseBody,
    ) -> io::Result<Option<Result<http_body::Frame<Bytes>, crate::proxy::BoxError>>> {
        std::future::poll_fn(|cx| {
            if let Poll::Ready(frame) = Pin::new(&mut *body).poll_frame(cx) {
                return Poll::Ready(Ok(frame));
            }
            self.poll_hung_up(cx)
                .map(|()| Err(io::ErrorKind::ConnectionAborted.into()))
        })
        .await
    }

    /// Adds a data frame to the write buffer (a large one is written
    /// straight after what is gathered, not copied).
    async fn gather(&mut self, data: &Bytes, chunked: bool) -> io::Result<()> {
        if chunked {
            let mut hex = [0u8; 16];
            self.wbuf.extend_from_slice(wire::hex_len(data.len(), &mut hex));
            self.wbuf.extend_from_slice(b"\r\n");
        }
        if data.len() <= WRITE_GATHER {
            self.wbuf.extend_from_slice(data);
        } else {
            self.flush().await?;
            let mut data = data.clone();
            while !data.is_empty() {
                let n = self.write_some(&data).await?;
                let _ = data.split_to(n);
            }
        }
        if chunked {
            self.wbuf.extend_from_slice(b"\r\n");
        }
        if self.wbuf.len() >= WRITE_GATHER {
            self.flush().await?;
        }
        Ok(())
    }

    /// One write of `data`, bounded like [`Connection::flush`].
    async fn write_some(&mut self, data: &[u8]) -> io::Result<usize> {
        let mut due = None;
        std::future::poll_fn(|cx| match Pin::new(&mut self.io).poll_write(cx, data) {
            Poll::Ready(Ok(0)) => Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
            Poll::Ready(result) => Poll::Ready(result),
            Poll::Pending => self.stalled(cx, &mut due).map_ok(|()| 0),
        })
        .await
    }
}

/// How an answer's body is framed on the wire.
#[derive(Clone, Copy)]
enum Out {
    None,
    Length(u64),
    Chunked,
    Close,
}

/// How feeding a body ended.
enum Fed {
    /// Read to its end.
    All,
    /// Not read to its end (unwanted, malformed): the connection must close
    /// after the answer.
    Stopped,
    /// The client hung up.
    Gone,
}

/// What the bytes read so far, `buf`, come to: a head (taken out of it),
/// HTTP/2's preface on a connection's `first` request, a refusal, or
/// `None` until more come. `lines` says when a parse is worth trying.
fn look(buf: &mut BytesMut, lines: &mut LineWatch, first: bool) -> Result<Option<Read>, Refusal> {
    lines.skip_empty_lines(buf);
    if buf.is_empty() {
        return Ok(None);
    }
    if first && buf.starts_with(H2_PREFACE) {
        return Ok(Some(Read::Http2));
    } else if first && buf.len() < H2_PREFACE.len() && H2_PREFACE.starts_with(buf) {
        // Maybe the HTTP/2 preface: wait for all of it.
    } else if lines.ended_another(buf)
        && let Some(head) = parse_head(buf)?
    {
        return Ok(Some(Read::Head(head)));
    } else if buf.len() > MAX_HEAD {
        return Err(Refusal::too_large(buf));
    }
    Ok(None)
}

/// Parses a head from the front of `buf` and takes it out; `None` when the
/// head is not complete yet.
fn parse_head(buf: &mut BytesMut) -> Result<Option<Head>, Refusal> {
    let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut []);
    let length = match parsed.parse_with_uninit_headers(buf, &mut slots) {
        Ok(httparse::Status::Complete(length)) if length > MAX_HEAD => return Err(Refusal::too_large(buf)),
        Ok(httparse::Status::Complete(length)) => length,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(Refusal::HeadTooLarge),
        Err(httparse::Error::Version) => match version_named(buf) {
            Named::Version => return Err(Refusal::VersionNotSupported),
            Named::Maybe => return Ok(None),
            Named::Not => return Err(Refusal::BadRequest("the request head does not parse")),
        },
        Err(_) => return Err(Refusal::BadRequest("the request head does not parse")),
    };
    let bad = Refusal::BadRequest;
    let method = Method::from_bytes(parsed.method.unwrap_or("").as_bytes()).map_err(|_| bad("bad method"))?;
    let version = if parsed.version == Some(1) {
        Version::HTTP_11
    } else {
        Version::HTTP_10
    };
    // Offsets of the target and each header in the buffer, to slice them
    // from the head once it is split off: no copies.
    let base = buf.as_ptr() as usize;
    let path = parsed.path.unwrap_or("");
    let path_at = (path.as_ptr() as usize - base, path.len());
    let offsets = wire::header_offsets(buf, parsed.headers);
    let head = buf.split_to(length).freeze();
    let uri = Uri::from_maybe_shared(head.slice(path_at.0..path_at.0 + path_at.1))
        .map_err(|_| bad("the request target is not valid"))?;
    // Room for the X-Forwarded-* headers the upstream request adds, so the
    // map is not regrown on the way.
    let mut headers = HeaderMap::with_capacity(offsets.len() + 4);
    let noted = wire::append_headers(&head, &offsets, &mut headers, wire::Keep::All).map_err(|error| match error {
        wire::BadHeader::Name => bad("a header name is not valid"),
        wire::BadHeader::Value => bad("a header value is not valid"),
    })?;
    let (framing, keep_alive, expect_continue) = framing(&headers, &noted, version)?;
    // Sent in several lines (RFC 6265 §5.4 says one), as HTTP/2 clients
    // send them: one line, as for HTTP/2 (`h2_as_h1`).
    if noted.cookies > 1 {
        crate::proxy::forward::join_cookies(&mut headers);
    }
    Ok(Some(Head {
        request: Parsed {
            method,
            uri,
            version,
            headers,
        },
        framing,
        keep_alive,
        expect_continue,
    }))
}

/// What a request line that httparse refused for its version ends in.
enum Named {
    /// A well-formed version, `HTTP/<digit>.<digit>`, that is not 1.0 or
    /// 1.1: 505.
    Version,
    /// The start of one, its line not ended yet: wait for the rest, so a
    /// head refused in pieces is refused as it would be whole.
    Maybe,
    /// Anything else: 400.
    Not,
}

/// What the request line at the front of `buf` ends in (see [`Named`]):
/// everything after its second space.
fn version_named(buf: &[u8]) -> Named {
    const SHAPE: &[u8] = b"HTTP/9.9";
    let fits = |version: &[u8]| {
        version.len() <= SHAPE.len()
            && version.iter().zip(SHAPE).all(|(&b, &want)| match want {
                b'9' => b.is_ascii_digit(),
                want => b == want,
            })
    };
    let (line, ended) = match buf.iter().position(|&b| b == b'\n') {
        Some(end) => (&buf[..end], true),
        None => (buf, false),
    };
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    // What follows the method and the target, each a space apart, as
    // httparse read it.
    let version = line.splitn(3, |&b| b == b' ').nth(2).unwrap_or_default();
    match (fits(version), version.len() == SHAPE.len(), ended) {
        (true, true, true) => Named::Version,
        (true, _, false) => Named::Maybe,
        _ => Named::Not,
    }
}

/// A request's body framing (RFC 9112 §6), whether the connection may
/// carry another request, and whether the client waits for `100 Continue`.
fn framing(headers: &HeaderMap, noted: &wire::Noted, version: Version) -> Result<(BodyFraming, bool, bool), Refusal> {
    // `close` wins over `keep-alive` when a client sends both.
    let keep_alive = !noted.close && (version == Version::HTTP_11 || noted.keep_alive);
    // RFC 9112 §3.2, as nginx: one Host on HTTP/1.1, never two.
    if noted.hosts == 0 && version == Version::HTTP_11 {
        return Err(Refusal::BadRequest("an HTTP/1.1 request needs a host header"));
    }
    if let Some(why) = wire::host_refusal(noted.hosts, noted.bad_host) {
        return Err(Refusal::BadRequest(why));
    }
    let expect_continue = version == Version::HTTP_11
        && noted.expect
        && headers
            .get(header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let bad = Refusal::BadRequest;
    if noted.transfer_encoding {
        if version != Version::HTTP_11 {
            return Err(bad("HTTP/1.0 has no transfer codings"));
        }
        if noted.content_lengths > 0 {
            return Err(bad("a request cannot have both transfer-encoding and content-length"));
        }
        // Exactly `chunked`: another coding would reach the backend
        // undeclared once this hop re-frames the body, and a value that is
        // not text must not be read as nothing.
        let mut codings = headers.get_all(header::TRANSFER_ENCODING).iter().map(|v| v.to_str());
        let only_chunked = matches!(codings.next(), Some(Ok(v)) if v.trim().eq_ignore_ascii_case("chunked"))
            && codings.next().is_none();
        if only_chunked {
            return Ok((BodyFraming::Chunked, keep_alive, expect_continue));
        }
        // Codings before a final, single `chunked` would frame the body
        // well but are not implemented (501); any other list leaves its
        // length unknown (400, RFC 9112 §6.3).
        let listed = wire::tokens(headers, header::TRANSFER_ENCODING);
        let (count, chunked, last) = listed.fold((0, 0, ""), |(n, c, _), t| {
            (n + 1, c + usize::from(t.eq_ignore_ascii_case("chunked")), t)
        });
        let text = headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .all(|v| v.to_str().is_ok());
        if text && count > 1 && chunked == 1 && last.eq_ignore_ascii_case("chunked") {
            return Err(Refusal::CodingNotImplemented);
        }
        return Err(bad("the transfer coding does not end in chunked"));
    }
    let length = noted.content_length(headers).map_err(bad)?;
    Ok((BodyFraming::Length(length.unwrap_or(0)), keep_alive, expect_continue))
}

/// The `Date` header's value (RFC 9110 §5.6.7), rendered once a second per
/// thread.
mod date {
    use std::cell::RefCell;
    use std::time::{SystemTime, UNIX_EPOCH};

    thread_local! {
        static CACHE: RefCell<(u64, [u8; 29])> = const { RefCell::new((u64::MAX, [0; 29])) };
    }

    pub fn now(out: &mut Vec<u8>) {
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        CACHE.with_borrow_mut(|(at, text)| {
            if *at != secs {
                *at = secs;
                *text = render(secs);
            }
            out.extend_from_slice(text);
        });
    }

    /// `Sun, 06 Nov 1994 08:49:37 GMT` for `secs` since the epoch.
    pub fn render(secs: u64) -> [u8; 29] {
        const DAYS: [&[u8; 3]; 7] = [b"Thu", b"Fri", b"Sat", b"Sun", b"Mon", b"Tue", b"Wed"];
        const MONTHS: [&[u8; 3]; 12] = [
            b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov", b"Dec",
        ];
        let days = secs / 86_400;
        let rem = secs % 86_400;
        // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
        let z = days as i64 + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        let year = yoe + era * 400 + i64::from(month <= 2);
        let mut out = [0u8; 29];
        let two = |n: u64| [b'0' + (n / 10 % 10) as u8, b'0' + (n % 10) as u8];
        out[..3].copy_from_slice(DAYS[(days % 7) as usize]);
        out[3..5].copy_from_slice(b", ");
        out[5..7].copy_from_slice(&two(day as u64));
        out[7] = b' ';
        out[8..11].copy_from_slice(MONTHS[(month - 1) as usize]);
        out[11] = b' ';
        let year = year as u64;
        out[12..14].copy_from_slice(&two(year / 100));
        out[14..16].copy_from_slice(&two(year));
        out[16] = b' ';
        out[17..19].copy_from_slice(&two(rem / 3600));
        out[19] = b':';
        out[20..22].copy_from_slice(&two(rem / 60 % 60));
        out[22] = b':';
        out[23..25].copy_from_slice(&two(rem % 60));
        out[25..29].copy_from_slice(b" GMT");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses `wire`, given a Host after its request line unless it has one.
    fn parse(wire: &str) -> Result<Option<Head>, Refusal> {
        let wire = match wire.to_ascii_lowercase().contains("\r\nhost:") {
            true => wire.to_owned(),
            false => wire.replacen("\r\n", "\r\nhost: a\r\n", 1),
        };
        parse_head(&mut BytesMut::from(&wire[..]))
    }

    #[test]
    fn a_head_sent_a_byte_at_a_time_is_parsed_once_a_line() {
        let wire = b"POST /orders HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\nx-a: 1\r\n\r\n{}";
        let (mut buf, mut lines, mut parses) = (BytesMut::new(), LineWatch::default(), 0);
        let mut head = None;
        for &byte in wire {
            buf.extend_from_slice(&[byte]);
            if head.is_none() && lines.ended_another(&buf) {
                parses += 1;
                head = parse_head(&mut buf).unwrap();
            }
        }
        let head = head.expect("parsed once the blank line came");
        assert_eq!(head.request.uri.path(), "/orders");
        assert_eq!(&buf[..], b"{}");
        // The first byte, then the request line, three fields and the
        // blank line.
        assert_eq!(parses, 6);
        // A bad line is still refused at its end, before the head's.
        let (mut buf, mut lines) = (BytesMut::new(), LineWatch::default());
        let mut refused = false;
        for &byte in b"GET / HTTP/1.1\r\nbad header\r\n" {
            buf.extend_from_slice(&[byte]);
            if lines.ended_another(&buf) && parse_head(&mut buf).is_err() {
                refused = true;
                break;
            }
        }
        assert!(refused);
    }

    #[test]
    fn empty_lines_before_a_head_are_dropped_as_they_come() {
        let (mut buf, mut lines) = (BytesMut::new(), LineWatch::default());
        for _ in 0..(MAX_HEAD / 2 + 1) {
            for &byte in b"\r\n" {
                buf.extend_from_slice(&[byte]);
                assert!(look(&mut buf, &mut lines, false).unwrap().is_none());
            }
            // Nothing kept to be parsed again.
            assert!(buf.is_empty());
        }
        buf.extend_from_slice(b"\nGET / HTTP/2.0\r\nhost: a\r\n\r\n");
        assert!(matches!(
            look(&mut buf, &mut lines, false),
            Err(Refusal::VersionNotSupported)
        ));
        let mut buf = BytesMut::from(&b"\r\n\nGET /x HTTP/1.1\r\nhost: a\r\n\r\n"[..]);
        let Ok(Some(Read::Head(head))) = look(&mut buf, &mut LineWatch::default(), true) else {
            panic!("no head after the empty lines");
        };
        assert_eq!(head.request.uri.path(), "/x");
    }

    #[test]
    fn a_control_byte_ends_the_wait_for_a_line() {
        // No LF after it: refused as it comes, as when the head came whole.
        for wire in [
            &b"GET / HTTP/1.1\r\nhost: a\r\nx: a\x01"[..],
            b"GET /\x7f",
            b"GET / HTTP/1.1\r\nx\x00",
        ] {
            let (mut buf, mut lines) = (BytesMut::new(), LineWatch::default());
            let refused = wire.iter().any(|&byte| {
                buf.extend_from_slice(&[byte]);
                look(&mut buf, &mut lines, true).is_err()
            });
            assert!(refused, "{wire:?}");
        }
        // A body's bytes after a whole head are the body's.
        let mut buf = BytesMut::from(&b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\n\r\n\x00\x01"[..]);
        let got = look(&mut buf, &mut LineWatch::default(), true);
        assert!(matches!(got, Ok(Some(Read::Head(_)))));
        assert_eq!(&buf[..], b"\x00\x01");
    }

    #[test]
    fn http_1_1_needs_exactly_one_host() {
        let refused = |wire: &str| matches!(parse_head(&mut BytesMut::from(wire)), Err(Refusal::BadRequest(_)));
        assert!(refused("GET / HTTP/1.1\r\n\r\n"));
        assert!(refused("GET / HTTP/1.1\r\nhost: a\r\nHost: b\r\n\r\n"));
        assert!(refused("GET / HTTP/1.0\r\nhost: a\r\nhost: a\r\n\r\n"));
        assert!(!refused("GET / HTTP/1.0\r\n\r\n"));
        assert!(!refused("GET / HTTP/1.1\r\nhost: a\r\n\r\n"));
        // One, and a host.
        for host in [
            "a b", "x/y@z", "user@a", "a?b", "a#b", "[::1", "[]", "[::1]x", "a:x", "a:1:2", "a\\b",
        ] {
            assert!(refused(&format!("GET / HTTP/1.1\r\nhost: {host}\r\n\r\n")), "{host}");
        }
        for host in [
            "",
            "a.example",
            "a.example:8080",
            "127.0.0.1:80",
            "[::1]:8080",
            "xn--bcher-kva.example",
            "a:",
        ] {
            assert!(!refused(&format!("GET / HTTP/1.1\r\nhost: {host}\r\n\r\n")), "{host}");
        }
    }

    #[test]
    fn heads_parse_into_requests_without_copies_of_values() {
        let mut buf = BytesMut::from(
            &b"POST /v1/orders?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nX-A: 1\r\nX-A: 2\r\n\r\n{}"[..],
        );
        let head = parse_head(&mut buf).unwrap().unwrap();
        assert_eq!(&buf[..], b"{}");
        assert_eq!(head.request.method, Method::POST);
        assert_eq!(head.request.uri.path(), "/v1/orders");
        assert_eq!(head.request.uri.query(), Some("x=1"));
        assert_eq!(head.request.headers.get_all("x-a").iter().count(), 2);
        assert!(matches!(head.framing, BodyFraming::Length(2)));
        assert!(head.keep_alive);
        assert!(head.request.version == Version::HTTP_11);

        assert!(parse("POST / HTTP/1.1\r\nHost: a\r\n").unwrap().is_none());
    }

    #[test]
    fn framing_refuses_what_could_be_smuggled() {
        for wire in [
            "POST / HTTP/1.1\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n",
            "POST / HTTP/1.1\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n",
            "POST / HTTP/1.1\r\ncontent-length: +2\r\n\r\n",
            "POST / HTTP/1.1\r\ncontent-length: 0x2\r\n\r\n",
            "POST / HTTP/1.1\r\ncontent-length: 2,\r\n\r\n",
            "POST / HTTP/1.1\r\ncontent-length: 2\u{a0}\r\n\r\n",
            "POST / HTTP/1.1\r\ntransfer-encoding: chunked, gzip\r\n\r\n",
            "POST / HTTP/1.1\r\ntransfer-encoding: chunked, chunked\r\n\r\n",
            "POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ntransfer-encoding: \u{a0}\r\n\r\n",
            "POST / HTTP/1.1\r\ntransfer-encoding: identity\r\n\r\n",
            "POST / HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n",
            "POST / HTTP/1.1\r\nbad header\r\n\r\n",
            "POST  HTTP/1.1\r\n\r\n",
        ] {
            assert!(matches!(parse(wire), Err(Refusal::BadRequest(_))), "{wire:?}");
        }
        // Repeats of one length are one length.
        let h = parse("POST / HTTP/1.1\r\ncontent-length: 2, 2\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(matches!(h.framing, BodyFraming::Length(2)));
        let h = parse("POST / HTTP/1.1\r\ntransfer-encoding: Chunked\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(matches!(h.framing, BodyFraming::Chunked));
    }

    #[test]
    fn keep_alive_and_expect_follow_the_version() {
        let h = |wire: &str| parse(wire).unwrap().unwrap();
        assert!(!h("GET / HTTP/1.1\r\nconnection: close\r\n\r\n").keep_alive);
        assert!(h("GET / HTTP/1.1\r\nconnection: keep-alive, x-y\r\n\r\n").keep_alive);
        assert!(!h("GET / HTTP/1.0\r\n\r\n").keep_alive);
        assert!(h("GET / HTTP/1.0\r\nconnection: Keep-Alive\r\n\r\n").keep_alive);
        assert!(h("POST / HTTP/1.1\r\nexpect: 100-Continue\r\ncontent-length: 1\r\n\r\n").expect_continue);
        assert!(!h("POST / HTTP/1.0\r\nexpect: 100-continue\r\ncontent-length: 1\r\n\r\n").expect_continue);
    }

    #[test]
    fn too_many_headers_is_431() {
        let mut wire = String::from("GET / HTTP/1.1\r\n");
        for i in 0..=MAX_HEADERS {
            wire.push_str(&format!("x-{i}: 1\r\n"));
        }
        wire.push_str("\r\n");
        assert!(matches!(parse(&wire), Err(Refusal::HeadTooLarge)));
    }

    #[test]
    fn codings_and_versions_not_served_get_501_and_505() {
        let te = |value: &str| parse(&format!("POST / HTTP/1.1\r\ntransfer-encoding: {value}\r\n\r\n"));
        for value in ["gzip, chunked", "deflate,chunked", "x-custom , CHUNKED"] {
            assert!(matches!(te(value), Err(Refusal::CodingNotImplemented)), "{value}");
        }
        for value in [
            "gzip",
            "chunked, gzip",
            "chunked, chunked",
            "gzip, chunked, chunked",
            ",",
        ] {
            assert!(matches!(te(value), Err(Refusal::BadRequest(_))), "{value}");
        }
        for version in ["HTTP/2.0", "HTTP/1.2", "HTTP/3.0", "HTTP/0.9"] {
            let got = parse(&format!("GET / {version}\r\n\r\n"));
            assert!(matches!(got, Err(Refusal::VersionNotSupported)), "{version}");
        }
        for version in ["HTTP/1", "HTTP/11.1", "HTTX/1.1", "http/1.1"] {
            let got = parse(&format!("GET / {version}\r\n\r\n"));
            assert!(matches!(got, Err(Refusal::BadRequest(_))), "{version}");
        }
    }

    #[test]
    fn a_request_line_over_the_head_limit_is_414() {
        let long = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(MAX_HEAD));
        assert!(matches!(parse(&long), Err(Refusal::UriTooLong)));
        assert!(matches!(
            Refusal::too_large(&long.as_bytes()[..MAX_HEAD + 1]),
            Refusal::UriTooLong
        ));
        let big_header = format!("GET / HTTP/1.1\r\nx: {}\r\n\r\n", "a".repeat(MAX_HEAD));
        assert!(matches!(parse(&big_header), Err(Refusal::HeadTooLarge)));
    }

    /// What a head fed to the listener in pieces comes to, told apart by
    /// everything its answer depends on.
    fn head_in_pieces(wire: &[u8], cuts: &[usize]) -> String {
        let mut buf = BytesMut::new();
        let mut lines = LineWatch::default();
        let mut at = 0;
        for end in cuts.iter().copied().chain([wire.len()]) {
            buf.extend_from_slice(&wire[at..end]);
            at = end;
            match look(&mut buf, &mut lines, true) {
                Ok(None) => {}
                Ok(Some(Read::Head(head))) => {
                    let r = &head.request;
                    return format!(
                        "{} {} {:?} {:?} {:?} {} {}",
                        r.method, r.uri, r.version, r.headers, head.framing, head.keep_alive, head.expect_continue,
                    );
                }
                Ok(Some(_)) => return "http2 or closed".into(),
                Err(refusal) => return format!("{:?}", refusal.response().status()),
            }
        }
        "unfinished".into()
    }

    /// Random heads, some with one byte changed, come to the same request
    /// or the same refusal whole, cut at random and a byte at a time.
    #[test]
    fn heads_parse_alike_however_they_arrive() {
        let mut next = crate::testing::numbers(0x2545_F491_4F6C_DD1D);
        let pick = |options: &[&'static str], i: usize| options[i % options.len()];
        let alphabet = b"aZ09 :/.\t\r\n\x7f-HTP";
        let mut statuses = std::collections::BTreeMap::new();
        for _ in 0..3000 {
            let mut wire = format!(
                "{}{} {} {}\r\n",
                pick(&["", "", "", "\r\n", "\n\r\n"], next(5)),
                pick(&["GET", "POST", "PUT", "HEAD"], next(4)),
                pick(&["/", "/v1/orders?x=1", "http://a.example/p", "*"], next(4)),
                pick(&["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/1.1", "HTTP/1.1"], next(5)),
            );
            if next(8) != 0 {
                wire.push_str(pick(
                    &["host: a\r\n", "Host: a.example:8080\r\n", "host: a b\r\n"],
                    next(6) / 4,
                ));
            }
            for _ in 0..next(4) {
                wire.push_str(pick(
                    &[
                        "content-length: 2\r\n",
                        "transfer-encoding: chunked\r\n",
                        "transfer-encoding: gzip, chunked\r\n",
                        "connection: close\r\n",
                        "expect: 100-continue\r\n",
                        "x-a: 1\r\n",
                        "x-b:  two words \r\n",
                    ],
                    next(7),
                ));
            }
            wire.push_str("\r\n{}");
            let mut wire = wire.into_bytes();
            if next(2) == 0 {
                let at = next(wire.len());
                wire[at] = alphabet[next(alphabet.len())];
            }
            let expected = head_in_pieces(&wire, &[]);
            for _ in 0..4 {
                let mut cuts: Vec<usize> = (0..next(wire.len().min(8))).map(|_| next(wire.len())).collect();
                cuts.sort_unstable();
                let got = head_in_pieces(&wire, &cuts);
                assert_eq!(got, expected, "{:?} cut at {cuts:?}", String::from_utf8_lossy(&wire));
            }
            let bytewise: Vec<usize> = (1..wire.len()).collect();
            let got = head_in_pieces(&wire, &bytewise);
            assert_eq!(got, expected, "{:?} a byte at a time", String::from_utf8_lossy(&wire));
            let kind = expected.split(' ').next().unwrap_or_default().to_owned();
            *statuses.entry(kind).or_insert(0) += 1;
        }
        // Requests, 400s, 501s and 505s all came up.
        for kind in ["GET", "POST", "400", "501", "505"] {
            assert!(statuses.get(kind).is_some_and(|n| *n > 20), "{statuses:?}");
        }
    }

    #[test]
    fn dates_render_as_imf_fixdate() {
        assert_eq!(&date::render(784_111_777), b"Sun, 06 Nov 1994 08:49:37 GMT");
        assert_eq!(&date::render(0), b"Thu, 01 Jan 1970 00:00:00 GMT");
        assert_eq!(&date::render(951_782_400), b"Tue, 29 Feb 2000 00:00:00 GMT");
        assert_eq!(&date::render(4_102_444_799), b"Thu, 31 Dec 2099 23:59:59 GMT");
    }
}
