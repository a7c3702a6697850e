//! The admin listener: `GET /healthz` (process alive), `GET /readyz` (store
//! reachable and not draining), `GET /metrics` (Prometheus text), and `GET`
//! / `DELETE` `/records?route=R&key=K[&scope=V...]` (or
//! `[&scope.<header>=V...]`, by name) to look up or purge one record
//! (behind `server.admin_token` when set; without it, for requests to this
//! machine's names alone). `HEAD` answers as `GET`
//! does, without the body; another method on a page is 405 with `Allow`. A
//! record is shown by its state, time left, status and body size: never its
//! body or headers. It serves through the drain and closes after it.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::proxy::{Gateway, RecordKeyError, ResponseBody, ScopeValues};
use crate::store::{Outcome, Record};
use crate::telemetry::Metrics;

/// Where the proxy is in its life, as the admin listener tells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Serving,
    /// Shutting down: the proxy no longer accepts; `/readyz` answers 503.
    Draining,
    /// The drain is over: the admin listener closes too.
    Stopped,
}

/// Serves HTTP/1.1 (what Prometheus, curl and health checks speak) until
/// `phase` is [`Phase::Stopped`]. A connection that sends no complete head
/// within `header_read_timeout`, first or between requests, is closed, as
/// the proxy's listener closes its idle connections.
pub async fn serve(
    listener: TcpListener,
    gateway: Arc<ArcSwap<Gateway>>,
    metrics: Arc<Metrics>,
    header_read_timeout: Duration,
    mut phase: watch::Receiver<Phase>,
) {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of file descriptors, say: pause rather than spin on
                // the worker that also serves the proxy (as its listener does).
                Err(_) => {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    continue;
                }
            },
            () = stopped(&mut phase) => return,
        };
        let (gateway, metrics, phase) = (gateway.clone(), metrics.clone(), phase.clone());
        let service = service_fn(move |request| {
            let (gateway, metrics, phase) = (gateway.load_full(), metrics.clone(), *phase.borrow());
            async move { Ok::<_, Infallible>(answer(request, &gateway, &metrics, phase).await) }
        });
        tokio::spawn(builder.serve_connection(TokioIo::new(stream), service));
    }
}

/// Resolves once the phase is [`Phase::Stopped`], or the server that sets
/// it is gone.
async fn stopped(phase: &mut watch::Receiver<Phase>) {
    let _ = phase.wait_for(|p| *p == Phase::Stopped).await;
}

fn text(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<ResponseBody> {
    let mut response = Response::new(ResponseBody::full(body.into()));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

const PLAIN: &str = "text/plain; charset=utf-8";

/// An admin error, as `application/problem+json` like every error idemgate
/// makes; its title is that of the proxy's problem of the same type, else
/// the status's reason.
fn problem(status: StatusCode, slug: &str, detail: &str) -> Response<ResponseBody> {
    use crate::proxy::problem::{document, title_of};
    let title = title_of(slug).unwrap_or(status.canonical_reason().unwrap_or(""));
    document(status, slug, title, detail)
}

/// 405, with the `Allow` list RFC 9110 §15.5.6 asks of it.
fn not_allowed(allow: &'static str) -> Response<ResponseBody> {
    let mut response = problem(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        &format!("this page answers {allow}"),
    );
    response
        .headers_mut()
        .insert(http::header::ALLOW, HeaderValue::from_static(allow));
    response
}

fn store_unavailable(error: &crate::store::StoreError) -> Response<ResponseBody> {
    let detail = format!(
        "the idempotency store cannot be reached: {}",
        crate::telemetry::error_chain(error)
    );
    problem(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable", &detail)
}

async fn answer(
    request: Request<Incoming>,
    gateway: &Gateway,
    metrics: &Metrics,
    phase: Phase,
) -> Response<ResponseBody> {
    // Two are an error (RFC 9112 §3.2), as on the proxy's listener; and
    // `/records` reads the one, to tell a page rebound to 127.0.0.1.
    if request.headers().get_all(http::header::HOST).iter().nth(1).is_some() {
        return problem(
            StatusCode::BAD_REQUEST,
            "bad-request",
            "a request carries one Host field",
        );
    }
    if request.uri().path() == "/records" {
        return records(&request, gateway).await;
    }
    let page = request.uri().path();
    if !matches!(page, "/healthz" | "/readyz" | "/metrics") {
        return problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "no such page: try /healthz, /readyz, /metrics or /records",
        );
    }
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return not_allowed("GET, HEAD");
    }
    match page {
        "/healthz" => text(StatusCode::OK, PLAIN, "ok\n"),
        "/readyz" if phase != Phase::Serving => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "draining",
            "idemgate is shutting down: it takes no new connections",
        ),
        "/readyz" => match gateway.store().ping().await {
            Ok(()) => text(StatusCode::OK, PLAIN, "ready\n"),
            Err(error) => store_unavailable(&error),
        },
        _ => text(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            metrics.render(gateway.store().stored_bytes()),
        ),
    }
}

fn json(status: StatusCode, value: serde_json::Value) -> Response<ResponseBody> {
    text(status, "application/json", format!("{value}\n"))
}

/// `GET` or `HEAD` (look up) or `DELETE` (purge)
/// `/records?route=R&key=K&scope=V...` (or `&scope.<header>=V...`).
async fn records(request: &Request<Incoming>, gateway: &Gateway) -> Response<ResponseBody> {
    let purge = match *request.method() {
        // HEAD is GET without the body, which hyper leaves out.
        Method::GET | Method::HEAD => false,
        Method::DELETE => true,
        _ => return not_allowed("GET, HEAD, DELETE"),
    };
    if let Some(token) = &gateway.config().server.admin_token {
        let given = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .map_or(&[][..], |v| v.as_bytes());
        // The scheme in any case (RFC 9110 §11.1), then the token; their
        // digests compared without an early exit, so timing tells nothing
        // of the token, its length included.
        let same = given
            .get(..7)
            .is_some_and(|scheme| scheme.eq_ignore_ascii_case(b"bearer "))
            && Sha256::digest(given[7..].trim_ascii())
                .iter()
                .zip(Sha256::digest(token.as_bytes()).iter())
                .fold(0, |acc, (a, b)| acc | (a ^ b))
                == 0;
        if !same {
            let mut response = problem(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "/records needs the admin token: Authorization: Bearer <server.admin_token>",
            );
            // RFC 9110 §15.5.2: a 401 says which scheme it wants.
            response.headers_mut().insert(
                http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"idemgate-admin\""),
            );
            return response;
        }
    } else if !for_this_machine(request) {
        return problem(
            StatusCode::FORBIDDEN,
            "forbidden",
            "without server.admin_token, /records answers only requests for localhost or a loopback \
             address (Host), so a web page cannot reach it by DNS rebinding",
        );
    }
    let (mut route, mut key, mut positional, mut named) = (None, None, Vec::new(), Vec::new());
    // To bytes: a scope value need not be UTF-8.
    let decode = crate::wire::form_decoded;
    for pair in request
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|pair| !pair.is_empty())
    {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let (name, value) = (String::from_utf8_lossy(&decode(name)).into_owned(), decode(value));
        // A mistyped or repeated parameter would name another record than
        // meant, and a purge of it lets that record's request run again:
        // refused, named.
        let once = match name.as_str() {
            "route" => &mut route,
            "key" => &mut key,
            "scope" => {
                positional.push(value);
                continue;
            }
            _ => match name.strip_prefix("scope.") {
                Some(header) => {
                    named.push((header.to_ascii_lowercase(), value));
                    continue;
                }
                None => {
                    let detail = format!("unknown parameter {name:?}: give route=, key= and scope= or scope.<header>=");
                    return problem(StatusCode::BAD_REQUEST, "bad-request", &detail);
                }
            },
        };
        if once.replace(String::from_utf8_lossy(&value).into_owned()).is_some() {
            return problem(StatusCode::BAD_REQUEST, "bad-request", &format!("{name}= given twice"));
        }
    }
    let (Some(route), Some(key)) = (route, key) else {
        return problem(
            StatusCode::BAD_REQUEST,
            "bad-request",
            "give route= and key= (and scope= per scope header, or scope.<header>= per line of each)",
        );
    };
    let scope = match (positional.is_empty(), named.is_empty()) {
        (_, true) => ScopeValues::Positional(positional),
        (true, false) => ScopeValues::Named(named),
        (false, false) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "bad-request",
                "give scope values by position (scope=) or by name (scope.<header>=), not both",
            );
        }
    };
    let record_key = match gateway.record_key(&route, &scope, &key) {
        Ok(record_key) => record_key,
        Err(RecordKeyError::NoRoute) => return problem(StatusCode::NOT_FOUND, "not-found", "no route has this name"),
        Err(RecordKeyError::EmptyKey) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "bad-request",
                "key= is empty, and no request's key is",
            );
        }
        Err(RecordKeyError::InvalidKey(why)) => {
            return problem(StatusCode::BAD_REQUEST, "bad-request", &format!("key=: {why}"));
        }
        Err(RecordKeyError::TooManyScopeValues(headers)) => {
            let detail = format!("route {route} has {headers} scope header(s): give at most that many scope=");
            return problem(StatusCode::BAD_REQUEST, "bad-request", &detail);
        }
        Err(RecordKeyError::NotInScope(header)) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "bad-request",
                &format!("route {route} has no scope header {header}"),
            );
        }
    };
    let store = gateway.store();
    if !purge {
        return match store.inspect(&record_key).await {
            Ok(None) => json(
                StatusCode::NOT_FOUND,
                serde_json::json!({ "record": record_key.tag().as_str(), "state": "absent" }),
            ),
            Ok(Some((record, left))) => {
                let (state, status, body) = match &record {
                    Record::InFlight { .. } => ("in_flight", None, None),
                    Record::Completed { outcome, .. } => match outcome {
                        Outcome::Response(r) => ("completed", Some(r.status.as_u16()), Some(r.body_bytes().len())),
                        Outcome::NotReplayable => ("not_replayable", None, None),
                        Outcome::Unknown => ("outcome_unknown", None, None),
                    },
                };
                json(
                    StatusCode::OK,
                    serde_json::json!({
                        "route": route,
                        "record": record_key.tag().as_str(),
                        "state": state,
                        "expires_in_ms": left.as_millis() as u64,
                        "status": status,
                        "body_bytes": body,
                    }),
                )
            }
            Err(error) => store_unavailable(&error),
        };
    }
    match store.purge(&record_key).await {
        Ok(purged) => {
            if purged {
                tracing::info!(route = %route, key = %record_key.tag(), "record purged by an operator");
            }
            let status = if purged { StatusCode::OK } else { StatusCode::NOT_FOUND };
            json(
                status,
                serde_json::json!({ "record": record_key.tag().as_str(), "purged": purged }),
            )
        }
        Err(error) => store_unavailable(&error),
    }
}

/// Whether `request` names this machine as its host (`localhost` or a
/// loopback address, any port), or names none. A web page whose name was
/// rebound to 127.0.0.1 reaches a loopback listener with its own name as
/// the host: that is what a tokenless `/records` refuses.
fn for_this_machine(request: &Request<Incoming>) -> bool {
    let local = |host: &str| {
        let literal = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        host.eq_ignore_ascii_case("localhost") || literal.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
    };
    // An absolute-form target's host too, which hyper keeps as sent.
    if request.uri().host().is_some_and(|host| !local(host)) {
        return false;
    }
    let Some(host) = request.headers().get(http::header::HOST) else {
        return true;
    };
    // A host (`host[:port]`, as the proxy's listener takes one): not
    // `evil.example@localhost`, whose userinfo `Authority` would pass over.
    crate::wire::valid_host(host.as_bytes())
        && host
            .to_str()
            .ok()
            .and_then(|host| host.parse::<http::uri::Authority>().ok())
            .is_some_and(|authority| local(authority.host()))
}

/// A request to an admin listener, for the command line: the status and body.
pub async fn call(
    addr: std::net::SocketAddr,
    method: Method,
    path_and_query: &str,
    token: Option<&str>,
) -> Result<(StatusCode, String), crate::proxy::BoxError> {
    use http_body_util::BodyExt;
    let client: hyper_util::client::legacy::Client<_, http_body_util::Empty<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
    let mut request = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path_and_query}"));
    if let Some(token) = token {
        request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    // A target too long for a URI (a key or scope far over any limit).
    let request = request.body(http_body_util::Empty::new())?;
    let response = client.request(request).await?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}
