//! Every error idemgate answers itself, mapped to HTTP in this one place as
//! an RFC 9457 `application/problem+json` document.
//!
//! Each problem is classified by who is at fault (the client, the upstream,
//! the store) and whether a retry may help; that decides the status code.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};

use super::body::ResponseBody;

/// The problem types of SPEC §3, plus `bad-request` for a request idemgate
/// cannot read at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// No key header, no way to derive one; or a derive field is absent.
    KeyMissing(String),
    /// Empty, too long, not visible ASCII, or sent more than once.
    KeyInvalid(String),
    /// The key belongs to a different request.
    KeyReused,
    /// The same request is still being processed.
    RequestInFlight,
    /// The request body exceeds `server.max_request_body`.
    BodyTooLarge { limit: u64 },
    /// The original answer was delivered but was too large to keep.
    ResponseNotReplayable,
    /// The request never reached the upstream.
    UpstreamUnavailable(String),
    /// The upstream did not answer within `upstream.timeout`.
    UpstreamTimeout,
    /// The upstream may or may not have acted on this key.
    OutcomeUnknown,
    /// The store cannot be reached and `on_error = "reject"`.
    StoreUnavailable,
    /// The upstream answered, but the store failed the record's
    /// completion, which is being retried: the answer is held back (see
    /// `ClaimGuard::complete`). Its type is `store-unavailable`.
    AnswerUnrecorded,
    /// The request could not be read.
    BadRequest(String),
}

/// Who caused a problem; with `retryable`, this is what the status encodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Client,
    Upstream,
    Store,
}

impl Problem {
    pub fn slug(&self) -> &'static str {
        match self {
            Problem::KeyMissing(_) => "key-missing",
            Problem::KeyInvalid(_) => "key-invalid",
            Problem::KeyReused => "key-reused",
            Problem::RequestInFlight => "request-in-flight",
            Problem::BodyTooLarge { .. } => "body-too-large",
            Problem::ResponseNotReplayable => "response-not-replayable",
            Problem::UpstreamUnavailable(_) => "upstream-unavailable",
            Problem::UpstreamTimeout => "upstream-timeout",
            Problem::OutcomeUnknown => "outcome-unknown",
            Problem::StoreUnavailable | Problem::AnswerUnrecorded => "store-unavailable",
            Problem::BadRequest(_) => "bad-request",
        }
    }

    pub fn fault(&self) -> Fault {
        match self {
            Problem::KeyMissing(_)
            | Problem::KeyInvalid(_)
            | Problem::KeyReused
            | Problem::RequestInFlight
            | Problem::BodyTooLarge { .. }
            | Problem::ResponseNotReplayable
            | Problem::BadRequest(_) => Fault::Client,
            Problem::UpstreamUnavailable(_) | Problem::UpstreamTimeout | Problem::OutcomeUnknown => Fault::Upstream,
            Problem::StoreUnavailable | Problem::AnswerUnrecorded => Fault::Store,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Problem::KeyMissing(_) | Problem::KeyInvalid(_) | Problem::BadRequest(_) => StatusCode::BAD_REQUEST,
            Problem::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Problem::RequestInFlight => StatusCode::CONFLICT,
            Problem::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            // The answer existed once and will never come back: gone for good.
            Problem::ResponseNotReplayable => StatusCode::GONE,
            Problem::UpstreamUnavailable(_) | Problem::OutcomeUnknown => StatusCode::BAD_GATEWAY,
            Problem::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Problem::StoreUnavailable | Problem::AnswerUnrecorded => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    fn title(&self) -> &'static str {
        title_of(self.slug()).expect("every problem type has its title")
    }

    fn detail(&self) -> String {
        match self {
            Problem::KeyMissing(d) | Problem::KeyInvalid(d) | Problem::BadRequest(d) => d.clone(),
            Problem::UpstreamUnavailable(d) => d.clone(),
            Problem::KeyReused => {
                "this key was first used with a different request (method, path, query, host, headers or body); use a new key"
                    .to_string()
            }
            Problem::RequestInFlight => {
                "the first request with this key has not finished; retry after the Retry-After delay".to_string()
            }
            Problem::BodyTooLarge { limit } => format!("the request body exceeds the limit of {limit} bytes"),
            Problem::ResponseNotReplayable => {
                "the request was processed, but its response was too large to keep; it is not run again".to_string()
            }
            Problem::UpstreamTimeout => "the upstream did not answer in time".to_string(),
            Problem::OutcomeUnknown => {
                "the upstream failed after receiving a request with this key; it is not run again".to_string()
            }
            Problem::StoreUnavailable => "the idempotency store cannot be reached; retry later".to_string(),
            Problem::AnswerUnrecorded => "the upstream answered, but the idempotency store has not recorded its \
                                          answer yet; retry with the same key to have it replayed"
                .to_string(),
        }
    }

    /// Whether the same request, sent again, may succeed.
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            Problem::RequestInFlight
                | Problem::UpstreamUnavailable(_)
                | Problem::UpstreamTimeout
                | Problem::StoreUnavailable
                | Problem::AnswerUnrecorded
        )
    }

    /// The `application/problem+json` response.
    pub fn response(&self) -> Response<ResponseBody> {
        let mut response = document(self.status(), self.slug(), self.title(), &self.detail());
        if matches!(
            self,
            Problem::RequestInFlight | Problem::StoreUnavailable | Problem::AnswerUnrecorded
        ) {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

/// The title of the problem type `slug`, when it is one of the proxy's:
/// the same for every occurrence of a type (RFC 9457 §3.1.3), whichever
/// listener answers it (the admin listener's `store-unavailable` and
/// `bad-request` too).
pub fn title_of(slug: &str) -> Option<&'static str> {
    Some(match slug {
        "key-missing" => "Idempotency key missing",
        "key-invalid" => "Idempotency key invalid",
        "key-reused" => "Idempotency key reused for a different request",
        "request-in-flight" => "A request with this idempotency key is in progress",
        "body-too-large" => "Request body too large",
        "response-not-replayable" => "Response cannot be replayed",
        "upstream-unavailable" => "Upstream unavailable",
        "upstream-timeout" => "Upstream timed out",
        "outcome-unknown" => "Outcome unknown",
        "store-unavailable" => "Idempotency store unavailable",
        "bad-request" => "Bad request",
        _ => return None,
    })
}

/// An RFC 9457 `application/problem+json` response, its `type`
/// `urn:idemgate:problem:<slug>`: the proxy's problems, and the admin
/// listener's.
pub fn document(status: StatusCode, slug: &str, title: &str, detail: &str) -> Response<ResponseBody> {
    let doc = serde_json::json!({
        "type": format!("urn:idemgate:problem:{slug}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = Response::new(ResponseBody::full(Bytes::from(doc.to_string())));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_follow_fault_and_retryability() {
        for p in [
            Problem::KeyMissing(String::new()),
            Problem::KeyInvalid(String::new()),
            Problem::KeyReused,
            Problem::RequestInFlight,
            Problem::BodyTooLarge { limit: 1 },
            Problem::ResponseNotReplayable,
            Problem::BadRequest(String::new()),
        ] {
            assert_eq!(p.fault(), Fault::Client);
            assert!(p.status().is_client_error(), "{p:?}");
            assert!(!p.title().is_empty());
        }
        for p in [
            Problem::UpstreamUnavailable(String::new()),
            Problem::UpstreamTimeout,
            Problem::OutcomeUnknown,
            Problem::StoreUnavailable,
        ] {
            assert!(p.status().is_server_error(), "{p:?}");
            assert!(!p.title().is_empty());
        }
    }
}
