//! The body types idemgate sends: to the client ([`ResponseBody`]) and to
//! the upstream ([`UpstreamBody`]).

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::sync::mpsc;
use tokio::time::Sleep;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A request body on its way upstream: buffered for idempotent routes,
/// streamed for pass-through.
pub type UpstreamBody = http_body_util::Either<Full<Bytes>, Incoming>;

/// A frame sent by the recording task, or the error that ends the body.
pub type ChannelItem = Result<Frame<Bytes>, BoxError>;

/// A response body on its way to the client.
pub enum ResponseBody {
    /// A whole body: a replay or a problem document.
    Full(Option<Bytes>),
    /// A pass-through upstream body, cut off at the upstream deadline.
    Upstream { body: Incoming, deadline: Pin<Box<Sleep>> },
    /// Frames from the task that records the response.
    Channel(mpsc::Receiver<ChannelItem>),
}

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
            ResponseBody::Channel(rx) => rx.poll_recv(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Full(bytes) => bytes.is_none(),
            ResponseBody::Upstream { body, .. } => body.is_end_stream(),
            ResponseBody::Channel(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Full(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
            ResponseBody::Upstream { body, .. } => body.size_hint(),
            ResponseBody::Channel(_) => SizeHint::default(),
        }
    }
}
