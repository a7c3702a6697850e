//! The body types idemgate moves: from the client and on to the upstream
//! ([`ClientBody`]), and to the client ([`ResponseBody`]).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Sleep;

use super::upstream::UpstreamResponseBody;
use crate::clock::coarse_ms;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A request body as the client sends it, and as it goes upstream: whole
/// for idempotent routes (buffered) and for any body the listener read with
/// its head, streamed otherwise.
pub enum ClientBody {
    /// All of it, read with the head (or none at all).
    Whole(Option<Bytes>),
    /// Read from an HTTP/1.1 connection by its listener as this is polled
    /// (see [`ClientBody::feed`]).
    Fed(Box<Fed>),
    /// The body of an HTTP/2 stream.
    H2(Box<H2Body>),
}

/// An HTTP/2 stream's body, each frame due within `idle` of the last, as
/// the HTTP/1.1 listener bounds its bodies: hyper waits for a stalled
/// stream forever. A wait is not the client's while another body of the
/// connection holds data idemgate has not read ([`UnreadBodies`]).
pub struct H2Body {
    incoming: Incoming,
    idle: Duration,
    /// Made at the first wait and set again at each later one: one timer
    /// for the body, not one per wait.
    timer: Option<Pin<Box<Sleep>>>,
    /// Whether the timer counts the current wait (a frame came since it
    /// was set, or it was never set, when not).
    armed: bool,
    /// When the timer was last set, on [`coarse_ms`].
    armed_at: u64,
    waits: Option<Arc<ClientWaits>>,
    connection: Arc<UnreadBodies>,
    /// Whether this body is counted in `connection` (not waiting in a
    /// poll, and not ended).
    counted: bool,
    ended: bool,
}

/// The request bodies of one HTTP/2 connection that may hold data
/// idemgate has not read: begun, not ended, and not being waited on
/// (a pass-through body whose upstream reads slowly, above all). Data a
/// stream holds unread keeps the connection's flow-control window shut
/// for every stream, so while there is one, another stream's client may
/// have no window to send in, and its body's silence is not a stall.
#[derive(Default)]
pub struct UnreadBodies {
    count: AtomicUsize,
    /// When the count last fell to none, on [`coarse_ms`]: the window such
    /// data held opens then, and a client that had none only begins to
    /// send once the update reaches it.
    emptied_at: AtomicU64,
}

impl UnreadBodies {
    /// Whether a body may have held the window shut at any time since
    /// `since` (on [`coarse_ms`]).
    fn held_since(&self, since: u64) -> bool {
        self.count.load(Ordering::Relaxed) > 0 || self.emptied_at.load(Ordering::Relaxed) > since
    }

    fn count(&self, counted: &mut bool, now: bool) {
        if *counted != now {
            *counted = now;
            if now {
                self.count.fetch_add(1, Ordering::Relaxed);
            } else if self.count.fetch_sub(1, Ordering::Relaxed) == 1 {
                self.emptied_at.store(coarse_ms(), Ordering::Relaxed);
            }
        }
    }
}

impl Drop for H2Body {
    fn drop(&mut self) {
        self.connection.count(&mut self.counted, false);
    }
}

/// How long a streamed body has kept its reader waiting on the client (a
/// slow upload): what a pass-through exchange's `upstream.timeout` leaves
/// out, as it counts the upstream's time. In ms, on
/// [`crate::clock::coarse_ms`].
#[derive(Default)]
pub struct ClientWaits {
    total: AtomicU64,
    /// When the wait going on began (0: none is).
    since: AtomicU64,
}

impl ClientWaits {
    /// The reader found nothing to read.
    fn waiting(&self) {
        if self.since.load(Ordering::Relaxed) == 0 {
            self.since.store(coarse_ms(), Ordering::Relaxed);
        }
    }

    /// Something came (or the end).
    fn came(&self) {
        let since = self.since.swap(0, Ordering::Relaxed);
        if since != 0 {
            self.total
                .fetch_add(coarse_ms().saturating_sub(since), Ordering::Relaxed);
        }
    }

    /// All the waiting so far, the wait going on included.
    pub fn waited(&self) -> Duration {
        let since = self.since.load(Ordering::Relaxed);
        let going_on = if since == 0 {
            0
        } else {
            coarse_ms().saturating_sub(since)
        };
        Duration::from_millis(self.total.load(Ordering::Relaxed) + going_on)
    }
}

#[derive(Debug, thiserror::Error)]
#[error("the request body stopped arriving for {}", humantime::format_duration(*.0))]
pub struct BodyStalled(Duration);

/// What the listener sends into a fed body: data, `None` at the end, or
/// the error that ends it.
pub type FeedItem = Result<Option<Bytes>, BoxError>;

pub struct Fed {
    items: mpsc::Receiver<FeedItem>,
    /// Told on the first poll: the listener answers `100 Continue` then.
    wanted: Option<oneshot::Sender<()>>,
    /// The declared length still to come; `None` when chunked.
    left: Option<u64>,
    ended: bool,
    waits: Option<Arc<ClientWaits>>,
}

/// The listener's half of a fed body.
pub struct Feed {
    pub items: mpsc::Sender<FeedItem>,
    /// Resolves when the body is first polled; an error when it was dropped
    /// unread.
    pub wanted: Option<oneshot::Receiver<()>>,
}

#[derive(Debug, thiserror::Error)]
#[error("the client's body broke off")]
pub struct BodyBrokeOff;

impl ClientBody {
    /// An HTTP/2 stream's body, each frame due within `idle` while no
    /// other body of its `connection` holds data unread.
    pub fn h2(incoming: Incoming, idle: Duration, connection: Arc<UnreadBodies>) -> ClientBody {
        let mut counted = false;
        let ended = incoming.is_end_stream();
        if !ended {
            connection.count(&mut counted, true);
        }
        ClientBody::H2(Box::new(H2Body {
            incoming,
            idle,
            timer: None,
            armed: false,
            armed_at: 0,
            waits: None,
            connection,
            counted,
            ended,
        }))
    }

    /// Counts from here on how long reading this body waits on the client
    /// (none for a whole body).
    pub fn count_waits(&mut self) -> Option<Arc<ClientWaits>> {
        let waits = match self {
            ClientBody::Whole(_) => return None,
            ClientBody::H2(h2) => &mut h2.waits,
            ClientBody::Fed(fed) => &mut fed.waits,
        };
        Some(waits.get_or_insert_default().clone())
    }

    pub fn whole(bytes: Bytes) -> ClientBody {
        ClientBody::Whole(Some(bytes).filter(|b| !b.is_empty()))
    }

    /// A body the listener feeds as it reads it: `length` when declared,
    /// and with `on_demand` nothing is read until the body is first polled
    /// (`Expect: 100-continue`).
    pub fn feed(length: Option<u64>, on_demand: bool) -> (Feed, ClientBody) {
        let (tx, rx) = mpsc::channel(4);
        let (wanted, want) = if on_demand {
            let (tx, rx) = oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let fed = Fed {
            items: rx,
            wanted,
            left: length,
            ended: false,
            waits: None,
        };
        (
            Feed {
                items: tx,
                wanted: want,
            },
            ClientBody::Fed(Box::new(fed)),
        )
    }
}

impl Body for ClientBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            ClientBody::Whole(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            ClientBody::H2(h2) => match Pin::new(&mut h2.incoming).poll_frame(cx) {
                Poll::Ready(frame) => {
                    h2.armed = false;
                    if let Some(waits) = &h2.waits {
                        waits.came();
                    }
                    // Held, if anything is left, until it is polled again.
                    h2.ended |= !matches!(frame, Some(Ok(_)));
                    h2.connection.count(&mut h2.counted, !h2.ended);
                    Poll::Ready(frame.map(|frame| frame.map_err(Into::into)))
                }
                Poll::Pending => {
                    h2.connection.count(&mut h2.counted, false);
                    if let Some(waits) = &h2.waits {
                        waits.waiting();
                    }
                    let idle = h2.idle;
                    loop {
                        if !h2.armed {
                            let due = tokio::time::Instant::now() + idle;
                            match &mut h2.timer {
                                Some(timer) => timer.as_mut().reset(due),
                                None => h2.timer = Some(Box::pin(tokio::time::sleep_until(due))),
                            }
                            h2.armed = true;
                            h2.armed_at = coarse_ms();
                        }
                        let timer = h2.timer.as_mut().expect("set above");
                        ready!(timer.as_mut().poll(cx));
                        // Held meanwhile, even if not now: the window may
                        // have opened only a moment ago.
                        if !h2.connection.held_since(h2.armed_at) {
                            return Poll::Ready(Some(Err(BodyStalled(idle).into())));
                        }
                        // The client may have had no window to send in:
                        // another `idle` from here.
                        h2.armed = false;
                    }
                }
            },
            ClientBody::Fed(fed) => {
                if fed.ended {
                    return Poll::Ready(None);
                }
                if let Some(wanted) = fed.wanted.take() {
                    let _ = wanted.send(());
                }
                let item = match fed.items.poll_recv(cx) {
                    Poll::Ready(item) => item,
                    Poll::Pending => {
                        if let Some(waits) = &fed.waits {
                            waits.waiting();
                        }
                        return Poll::Pending;
                    }
                };
                if let Some(waits) = &fed.waits {
                    waits.came();
                }
                Poll::Ready(match item {
                    Some(Ok(Some(data))) => {
                        if let Some(left) = &mut fed.left {
                            *left = left.saturating_sub(data.len() as u64);
                        }
                        Some(Ok(Frame::data(data)))
                    }
                    Some(Ok(None)) => {
                        fed.ended = true;
                        None
                    }
                    Some(Err(error)) => {
                        fed.ended = true;
                        Some(Err(error))
                    }
                    // The listener went away without saying the body ended.
                    None => {
                        fed.ended = true;
                        Some(Err(BodyBrokeOff.into()))
                    }
                })
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ClientBody::Whole(bytes) => bytes.is_none(),
            ClientBody::H2(h2) => h2.incoming.is_end_stream(),
            ClientBody::Fed(fed) => fed.ended,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ClientBody::Whole(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
            ClientBody::H2(h2) => h2.incoming.size_hint(),
            ClientBody::Fed(fed) if fed.ended => SizeHint::with_exact(0),
            ClientBody::Fed(fed) => fed.left.map_or_else(SizeHint::default, SizeHint::with_exact),
        }
    }
}

/// A frame sent by the recording task, or the error that ends the body.
pub type ChannelItem = Result<Frame<Bytes>, BoxError>;

/// A response body on its way to the client.
pub enum ResponseBody {
    /// A whole body: a replay or a problem document.
    Full(Option<Bytes>),
    /// A pass-through upstream body, cut off at the upstream deadline.
    Upstream {
        body: Box<UpstreamResponseBody>,
        deadline: Pin<Box<Sleep>>,
    },
    /// Frames from the task that records the response, through
    /// [`ResponseBody::channel`].
    Channel {
        frames: mpsc::Receiver<ChannelItem>,
        finished: Arc<AtomicBool>,
    },
}

/// The sending half of [`ResponseBody::channel`].
pub struct BodySender {
    frames: mpsc::Sender<ChannelItem>,
    finished: Arc<AtomicBool>,
}

impl BodySender {
    /// Sends a frame; an error when the client's side is gone.
    pub async fn send(&self, frame: Frame<Bytes>) -> Result<(), ()> {
        self.frames.send(Ok(frame)).await.map_err(drop)
    }

    /// Ends the body with an error the client sees as a broken response,
    /// at once: with no room left for the error (a client not reading),
    /// the sender is dropped unfinished, which ends the body with
    /// [`CutOff`] just the same once the queued frames are read.
    pub fn abort(self, why: &'static str) {
        let _ = self.frames.try_send(Err(why.into()));
    }

    /// Ends the body normally. A sender dropped without `finish` ends it
    /// with an error instead, so a cut-off body never looks complete.
    pub fn finish(self) {
        self.finished.store(true, Ordering::Release);
    }
}

#[derive(Debug, thiserror::Error)]
#[error("the response was cut off")]
pub struct CutOff;

#[derive(Debug, thiserror::Error)]
#[error("the upstream did not finish its response in time")]
pub struct UpstreamBodyTimeout;

impl ResponseBody {
    pub fn full(bytes: Bytes) -> ResponseBody {
        ResponseBody::Full(Some(bytes).filter(|b| !b.is_empty()))
    }

    pub fn empty() -> ResponseBody {
        ResponseBody::Full(None)
    }

    /// A body fed frame by frame, holding up to `frames` frames.
    pub fn channel(frames: usize) -> (BodySender, ResponseBody) {
        let (tx, rx) = mpsc::channel(frames);
        let finished = Arc::new(AtomicBool::new(false));
        let sender = BodySender {
            frames: tx,
            finished: finished.clone(),
        };
        (sender, ResponseBody::Channel { frames: rx, finished })
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            ResponseBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            ResponseBody::Upstream { body, deadline } => {
                if let Poll::Ready(frame) = Pin::new(body).poll_frame(cx) {
                    return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
                }
                ready!(deadline.as_mut().poll(cx));
                Poll::Ready(Some(Err(UpstreamBodyTimeout.into())))
            }
            ResponseBody::Channel { frames, finished } => match ready!(frames.poll_recv(cx)) {
                None if !finished.load(Ordering::Acquire) => Poll::Ready(Some(Err(CutOff.into()))),
                item => Poll::Ready(item),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Full(bytes) => bytes.is_none(),
            ResponseBody::Upstream { body, .. } => body.is_end_stream(),
            ResponseBody::Channel { .. } => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Full(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
            ResponseBody::Upstream { body, .. } => body.size_hint(),
            ResponseBody::Channel { .. } => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    fn data(frame: Option<Result<Frame<Bytes>, BoxError>>) -> Bytes {
        frame
            .expect("a frame")
            .expect("data, not an error")
            .into_data()
            .expect("data")
    }

    #[tokio::test]
    async fn an_abort_ends_the_body_with_its_error_after_the_queued_frames() {
        let (tx, mut body) = ResponseBody::channel(2);
        tx.send(Frame::data(Bytes::from_static(b"a"))).await.unwrap();
        tx.abort("the upstream response broke off");
        assert_eq!(data(body.frame().await), "a");
        let error = body.frame().await.expect("an error").unwrap_err();
        assert_eq!(error.to_string(), "the upstream response broke off");
    }

    #[tokio::test]
    async fn an_abort_does_not_wait_for_a_client_that_stopped_reading() {
        let (tx, mut body) = ResponseBody::channel(2);
        for frame in ["a", "b"] {
            tx.send(Frame::data(Bytes::from_static(frame.as_bytes())))
                .await
                .unwrap();
        }
        // The queue is full; the abort returns at once all the same (it is
        // not async), and the body still ends broken, not complete.
        tx.abort("the upstream response timed out");
        assert_eq!(data(body.frame().await), "a");
        assert_eq!(data(body.frame().await), "b");
        let error = body.frame().await.expect("an error").unwrap_err();
        assert!(error.is::<CutOff>(), "{error}");
    }
}
