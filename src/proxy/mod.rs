//! The request pipeline. [`Gateway::handle`] reads top to bottom:
//!
//! 1. route: the first `[[route]]` whose host, path and method match, or
//!    pass-through;
//! 2. key: the key header, or a key derived from the listed fields (`key.rs`);
//! 3. body: buffered up to `max_request_body` (413 past it);
//! 4. fingerprint (`fingerprint.rs`) and record key (scope + key);
//! 5. claim: replay, 422, 409 / wait, or claimed;
//! 6. exchange (`exchange.rs`): forward, stream while recording, complete
//!    before the last byte, release on every failure.
//!
//! Every refusal is a [`Problem`]; [`problem`] maps it to HTTP.

mod body;
pub(crate) mod canonical;
mod exchange;
mod fingerprint;
pub mod forward;
mod key;
pub mod problem;
pub(crate) mod upstream;

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use futures_util::future::Either;
use http::header::HOST;
use http::request::Parts;
use http::uri::Scheme;
use http::{HeaderValue, Method, Request, Response, Uri};
use http_body_util::{BodyExt, Limited};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tracing::Instrument;
use tracing::field::Empty;

pub use body::{BoxError, ClientBody, Feed, ResponseBody, UnreadBodies};
pub use forward::Peer;
pub use problem::Problem;
pub(crate) use upstream::sweep_idle_connections;

use crate::config::{Config, DeriveField, Mode, OnInFlight, OnStoreError, Policy, Route, RouteMatch};
use crate::store::{Claim, Outcome as Stored, Owner, StoreError, StoreHandle, StoredResponse};
use crate::telemetry::{self, Metrics, Outcome, RouteCounters};
use exchange::Exchange;
pub use exchange::SentClaims;
use upstream::{OnStale, UpstreamClient};

/// A configured route with what it needs at run time.
struct LiveRoute {
    route: Route,
    /// Where the route's requests go: this worker's own copy (see
    /// [`own_copy`]).
    upstream: Uri,
    counters: Arc<RouteCounters>,
}

/// A copy of `uri` in a buffer of its own. A `Uri`'s parts are counted
/// slices of one buffer, and every forwarded request takes and drops a few
/// references to the upstream's: with one buffer for all workers, each of
/// those atomic counts would first pull its cache line from the other
/// core.
fn own_copy(uri: &Uri) -> Uri {
    Uri::try_from(uri.to_string()).expect("a URI's text parses back into the URI")
}

/// The store, upstream client and metrics, which every exchange holds.
///
/// Each worker thread builds its own gateway, so each has its own context
/// and routes: an exchange references them with counts that stay in its
/// core's cache. The handles inside are shared by every worker, and taking
/// references to those for each request would pull their counts from core
/// to core.
struct Context {
    store: StoreHandle,
    client: UpstreamClient,
    metrics: Arc<Metrics>,
    /// The tasks shutdown drains (within `shutdown_grace`): exchanges
    /// handed off, and completions being retried.
    exchanges: TaskTracker,
    /// The claims a shutdown records as unknown if its grace runs out.
    sent: SentClaims,
}

/// One configuration, ready to serve: routes, store, upstream client.
pub struct Gateway {
    config: Arc<Config>,
    routes: Vec<Arc<LiveRoute>>,
    /// The default upstream: this worker's own copy (see [`own_copy`]).
    upstream: Uri,
    passthrough: Arc<RouteCounters>,
    context: Arc<Context>,
}

/// What [`Gateway::refuse`] is given before the key is read.
const NO_KEYS: (Option<&crate::store::RecordKey>, Option<&str>) = (None, None);

/// How long a waiting request pauses after a store error before it claims
/// again: a dropped connection or a failover is over in moments, and the
/// wait's budget bounds the tries (at most one each pause).
const WAIT_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// After a store error while a request waits on another: pauses, and says
/// to claim again, while `wait_until` leaves time; `false` when it has
/// passed, and the wait ends.
async fn pause_before_claiming_again(wait_until: Instant) -> bool {
    let left = wait_until.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return false;
    }
    tokio::time::sleep(left.min(WAIT_RETRY_PAUSE)).await;
    true
}

/// The scope header values a record was made with, to find it by.
pub enum ScopeValues {
    /// One value a header, in the order of the route's `scope`; headers
    /// past the end were absent.
    Positional(Vec<Vec<u8>>),
    /// Each line of each header by (lower-case) name, in order; a header
    /// of the route's `scope` not named was absent.
    Named(Vec<(String, Vec<u8>)>),
}

/// Why no record key could be made.
#[derive(Debug, PartialEq, Eq)]
pub enum RecordKeyError {
    NoRoute,
    /// A named scope header the route's `scope` does not list.
    NotInScope(String),
    /// `key=` (or `key=""`): no request's key is empty.
    EmptyKey,
    /// A key no request's can be (not visible ASCII): why.
    InvalidKey(&'static str),
    /// More values by position than the route has scope headers: how many
    /// it has.
    TooManyScopeValues(usize),
}

/// Where a request goes: through a route's idempotency, or straight on.
enum Routed<'a> {
    Idempotent(&'a Arc<LiveRoute>, RouteMatch),
    PassThrough(&'a Uri),
    /// Refused with 400, for this reason: a target that names no path,
    /// or a path whose dot segments, resolved or as written, lead to two
    /// different places (the backend may read it either way).
    Refused(&'static str),
}

impl Routed<'_> {
    /// Whether both go to one route, or pass through to one upstream.
    fn same_place(&self, other: &Routed<'_>) -> bool {
        match (self, other) {
            (Routed::Idempotent(a, _), Routed::Idempotent(b, _)) => Arc::ptr_eq(a, b),
            // By value: each route keeps its own copy of its upstream's
            // URL, the default one's too.
            (Routed::PassThrough(a), Routed::PassThrough(b)) => a == b,
            _ => false,
        }
    }
}

/// A request body: still streaming from the client, or already buffered.
enum RequestBody {
    Streaming(ClientBody),
    Buffered(Bytes),
}

impl From<RequestBody> for ClientBody {
    fn from(body: RequestBody) -> ClientBody {
        match body {
            RequestBody::Streaming(body) => body,
            RequestBody::Buffered(bytes) => ClientBody::whole(bytes),
        }
    }
}

static REPLAYED: http::HeaderName = http::HeaderName::from_static("idempotent-replayed");

impl Gateway {
    /// `exchanges` tracks every claimed exchange, so shutdown can wait for
    /// them, and `sent` the claims it records as unknown if its grace
    /// runs out; both outlive a reload.
    pub fn new(
        config: Arc<Config>,
        store: StoreHandle,
        metrics: Arc<Metrics>,
        tracked: (TaskTracker, SentClaims),
    ) -> Result<Gateway, crate::server::tls::TlsError> {
        let client = upstream::client(&config.upstream)?;
        Ok(Gateway::with_client(config, store, metrics, tracked, client))
    }

    /// [`Gateway::new`] with an upstream client made for `config` already
    /// (a reload makes one for every worker: its CA file read once).
    pub(crate) fn with_client(
        config: Arc<Config>,
        store: StoreHandle,
        metrics: Arc<Metrics>,
        (exchanges, sent): (TaskTracker, SentClaims),
        client: upstream::UpstreamClient,
    ) -> Gateway {
        let routes = config
            .routes
            .iter()
            .map(|route| {
                Arc::new(LiveRoute {
                    route: route.clone(),
                    upstream: own_copy(config.upstream_of(route)),
                    counters: metrics.route(&route.name),
                })
            })
            .collect();
        Gateway {
            passthrough: metrics.route(""),
            routes,
            upstream: own_copy(&config.upstream.url),
            context: Arc::new(Context {
                client,
                store,
                metrics,
                exchanges,
                sent,
            }),
            config,
        }
    }

    pub fn config(&self) -> &Arc<Config> {
        &self.config
    }

    pub fn store(&self) -> &StoreHandle {
        &self.context.store
    }

    /// Where route `route` keeps the record of `key` sent with these scope
    /// header values, `key` as the client sent it (a token or an
    /// sf-string).
    pub fn record_key(
        &self,
        route: &str,
        scope: &ScopeValues,
        key: &str,
    ) -> Result<crate::store::RecordKey, RecordKeyError> {
        let live = self
            .routes
            .iter()
            .find(|live| live.route.name == route)
            .ok_or(RecordKeyError::NoRoute)?;
        let headers = &live.route.policy.scope;
        // Read as the key header is: `"k1"` is the key k1. A key the
        // proxy refuses names no record. (Not its length: a record made
        // before a reload lowered `max_length` may still be looked up.)
        let key = key::parse(key.as_bytes()).ok_or(RecordKeyError::InvalidKey(
            "a key is a token or a quoted string of visible ASCII",
        ))?;
        if key.is_empty() {
            return Err(RecordKeyError::EmptyKey);
        }
        Ok(match scope {
            ScopeValues::Positional(values) if values.len() > headers.len() => {
                return Err(RecordKeyError::TooManyScopeValues(headers.len()));
            }
            ScopeValues::Positional(values) => {
                let values = headers.iter().enumerate().map(|(i, header)| {
                    let value = values.get(i).map(|value| key::identity(header, value));
                    value.into_iter()
                });
                key::record_key_of(values, &key)
            }
            ScopeValues::Named(named) => {
                if let Some((name, _)) = named
                    .iter()
                    .find(|(name, _)| !headers.iter().any(|h| h.as_str() == name))
                {
                    return Err(RecordKeyError::NotInScope(name.clone()));
                }
                let values = headers.iter().map(|header| {
                    let lines = named.iter().filter(move |(name, _)| header.as_str() == name);
                    lines.map(move |(_, value)| key::identity(header, value))
                });
                key::record_key_of(values, &key)
            }
        })
    }

    /// Answers one client request. Never fails: every error is a response.
    ///
    /// Runs in a `request` span with the route, the outcome and a short hash
    /// of the record key (never the key itself), at DEBUG: an INFO span would
    /// be made, filled in and entered on every poll for every request, to
    /// serve only the rare warning, which names its route or key itself.
    ///
    /// Not an `async fn`: the route is chosen at once, and the future is
    /// that route's own. Each layer of `async fn` would hold its arguments
    /// again and be copied whole into the next, and the request's future
    /// is the one every request moves.
    pub fn handle(
        &self,
        mut request: Request<ClientBody>,
        peer: Peer,
    ) -> impl Future<Output = Response<ResponseBody>> + '_ {
        let mut contradicted = false;
        if request.uri().authority().is_some() {
            // An absolute-form target's host wins over `Host` (RFC 9112
            // §3.2.2); HTTP/2's `:authority` and a `Host` must agree.
            contradicted = request.version() == http::Version::HTTP_2
                && forward::host_contradicts_authority(request.uri(), request.headers());
            let (uri, headers) = (request.uri().clone(), request.headers_mut());
            forward::host_from_target(&uri, headers);
        }
        let span = tracing::debug_span!("request", route = Empty, outcome = Empty, key = Empty);
        let routed = if contradicted {
            Routed::Refused("the host header names another host than :authority (RFC 9113 §8.3.1)")
        } else {
            self.route_for(&request)
        };
        let answer = match routed {
            Routed::Idempotent(live, params) => Either::Left(self.idempotent(live, params, request, peer)),
            Routed::PassThrough(upstream) => {
                self.passthrough.count(Outcome::Passthrough);
                Either::Right(Either::Left(self.forward(
                    request,
                    upstream,
                    OnStale::Resend,
                    peer,
                    None,
                )))
            }
            Routed::Refused(why) => {
                self.passthrough.count(Outcome::BadRequest);
                let problem = Problem::BadRequest(why.into());
                Either::Right(Either::Right(std::future::ready(problem.response())))
            }
        };
        answer
            .inspect(|response| tracing::debug!(status = response.status().as_u16(), "answered"))
            .instrument(span)
    }

    fn route_for(&self, request: &Request<ClientBody>) -> Routed<'_> {
        // Routes match paths. A target without one (authority-form,
        // `host:port`) would pass every route by and reach the backend as
        // `/`; it is CONNECT's alone (RFC 9112 §3.2.3), and idemgate makes
        // no tunnels. `*` is OPTIONS's alone, and passes through.
        let (method, path) = (request.method(), request.uri().path());
        // As nginx: a method is capitals, `_` and `-`. A backend that
        // capitalizes what it gets (Django, Werkzeug) would run `post` as
        // POST, past the route that makes POST idempotent.
        if !method
            .as_str()
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b == b'_' || b == b'-')
        {
            return Routed::Refused("the method must be in capitals (A-Z, `_`, `-`), as `POST`");
        }
        if method == Method::CONNECT {
            return Routed::Refused("CONNECT is not supported: idemgate forwards requests, it makes no tunnels");
        }
        let routable = path.starts_with('/') || (path == "*" && method == Method::OPTIONS);
        if !routable {
            return Routed::Refused("the request target must be a path, an absolute URI, or `*` for OPTIONS");
        }
        // An absolute target's (or HTTP/2's :authority): an http or https
        // URI, without the userinfo RFC 9110 §4.2.4 (and RFC 9113 §8.3.1)
        // says to treat as an error; its host would be read past an `@`.
        let uri = request.uri();
        if uri.scheme().is_some_and(|s| *s != Scheme::HTTP && *s != Scheme::HTTPS)
            || uri.authority().is_some_and(|a| a.as_str().contains('@'))
        {
            return Routed::Refused("an absolute request target must be an http or https URI without userinfo");
        }
        // The HTTP/1.1 listener checks the Host lines it reads; an HTTP/2
        // request's, and a target's own authority (now the Host), are
        // checked here, by the same rules: one host, `host[:port]`. It
        // picks the route and travels on as X-Forwarded-Host.
        if request.version() == http::Version::HTTP_2 || uri.authority().is_some() {
            let headers = request.headers();
            let lines = headers.get_all(HOST).iter().count();
            let bad = headers
                .get(HOST)
                .is_some_and(|host| !crate::wire::valid_host(host.as_bytes()));
            if let Some(why) = crate::wire::host_refusal(lines, bad) {
                return Routed::Refused(why);
            }
        }
        // The target's own host when it has one (absolute-form, HTTP/2's
        // :authority), which RFC 9112 §3.2.2 says wins over Host; without
        // the trailing dot of a fully qualified name, as nginx drops it.
        // A Host's port is its digits after the last colon, however many
        // or few: `api.example.com:` (an empty port, RFC 3986 §3.2.3) and
        // `api.example.com:99999` name the host `api.example.com` to nginx
        // and to the target's own parser, and so must match its route.
        let host = request
            .uri()
            .host()
            .or_else(|| {
                let host = request.headers().get(HOST)?.to_str().ok()?;
                Some(
                    host.rsplit_once(':')
                        .filter(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
                        .map_or(host, |(host, _)| host),
                )
            })
            .map(|host| host.trim_end_matches('.'));
        // Matched as RFC 3986 normalizes it: `/v1/%6Frders` is `/v1/orders`,
        // and `/x/%2E%2E/v1/orders` is `/v1/orders` to a backend that
        // resolves dot segments but `/x/../v1/orders` to one that does not
        // (so are `//v1/orders` and `/v1/orders;a=b` to some): when the
        // two go to different places, the request is refused rather than
        // let past a route either way.
        let decoded = crate::config::decode_unreserved(request.uri().path());
        // A NUL ends the path in C, and a backend that decodes it reads the
        // path that far, or fails: nginx refuses it (400) as it decodes.
        if decoded.contains("%00") {
            return Routed::Refused("the path holds an escaped NUL (%00), which no path may");
        }
        let as_written = self.route_by(host, &decoded, request.method());
        // `/v1%2Forders` is `/v1/orders` to a backend that decodes the path
        // before it routes it, and not to others: refused when, so read, it
        // would be claimed and as written it would not. A path a route
        // takes as written (`/files/a%2Fb`) is claimed either way (records
        // are kept by scope and key, not by route) and goes on.
        if let Some(slashed) = crate::config::slashes_decoded(&decoded)
            && !matches!(as_written, Routed::Idempotent(..))
        {
            let mut readings = crate::config::as_backends_may_read(&slashed);
            readings.push(slashed);
            for reading in &readings {
                if matches!(self.route_by(host, reading, request.method()), Routed::Idempotent(..)) {
                    return Routed::Refused(
                        "the path read with its `%2F` decoded to `/`, as backends may read it, reaches a route \
                         the path as written does not; send it in that form",
                    );
                }
            }
        }
        let readings = crate::config::as_backends_may_read(&decoded);
        if readings.is_empty() {
            return as_written;
        }
        // Every reading must go where the path as written goes.
        let mut first = None;
        for reading in &readings {
            let elsewhere = self.route_by(host, reading, request.method());
            if !elsewhere.same_place(&as_written) {
                return Routed::Refused(
                    "the path read as backends may read it (`.` and `..` resolved, `//` merged, `;` parameters left \
                     out) leads elsewhere than as written; send it in that form",
                );
            }
            first.get_or_insert(elsewhere);
        }
        // The same place: parameters are read from the path with its dot
        // segments resolved (the first reading), as before `//` and `;`
        // were looked at.
        match first {
            Some(resolved) if !decoded.contains(';') && !decoded.contains("//") => resolved,
            _ => as_written,
        }
    }

    /// Where a request for `host` and the normalized `path` goes.
    fn route_by(&self, host: Option<&str>, path: &str, method: &http::Method) -> Routed<'_> {
        let mut pass_to = None;
        for live in &self.routes {
            let route = &live.route;
            if let Some(want) = &route.host
                && !host.is_some_and(|h| h.eq_ignore_ascii_case(want))
            {
                continue;
            }
            let Some(params) = route.path.matches(path) else {
                continue;
            };
            if route.accepts(method) {
                return Routed::Idempotent(live, params);
            }
            // Another method on this route's path: pass it through to this
            // route's backend, as a location block would.
            pass_to.get_or_insert(&live.upstream);
        }
        Routed::PassThrough(pass_to.unwrap_or(&self.upstream))
    }

    async fn idempotent(
        &self,
        live: &Arc<LiveRoute>,
        params: RouteMatch,
        request: Request<ClientBody>,
        peer: Peer,
    ) -> Response<ResponseBody> {
        let policy = &live.route.policy;
        let upstream = &live.upstream;
        let (parts, body) = request.into_parts();
        if let Some(span) = telemetry::request_span() {
            span.record("route", live.route.name.as_str());
        }

        // 2. The key header.
        let header_key = match key::from_header(&policy.key, &parts.headers) {
            Ok(k) => k,
            Err(problem) => {
                return self
                    .refuse(live, problem, NO_KEYS, parts, Some(RequestBody::Streaming(body)), peer)
                    .await;
            }
        };
        if header_key.is_none() && policy.key.derive.is_empty() {
            if policy.key.required {
                let problem = Problem::KeyMissing(format!("this route needs an {} header", policy.key.header));
                return self
                    .refuse(live, problem, NO_KEYS, parts, Some(RequestBody::Streaming(body)), peer)
                    .await;
            }
            live.counters.count(Outcome::Passthrough);
            let request = Request::from_parts(parts, body);
            return Box::pin(self.forward(request, upstream, OnStale::Fail, peer, None)).await;
        }

        // 3. The body, buffered.
        let body = match self.read_body(body).await {
            Ok(bytes) => bytes,
            Err((problem, body)) => {
                return self
                    .refuse(live, problem, (None, header_key.as_deref()), parts, body, peer)
                    .await;
            }
        };
        let wants_json = policy.fingerprint.body == crate::config::BodyMode::Json
            || (header_key.is_none() && policy.key.derive.iter().any(|f| matches!(f, DeriveField::Body(_))));
        let json = wants_json.then(|| canonical::parse(&body)).flatten();

        // The key, derived when no header carried it.
        let key = match header_key {
            Some(k) => k,
            None => {
                let source = key::KeySource {
                    route: &live.route.name,
                    headers: &parts.headers,
                    query: parts.uri.query(),
                    params: &params,
                    json: json.as_ref(),
                };
                match key::derive(&policy.key.derive, &source) {
                    Ok(k) => k,
                    Err(problem) => {
                        return self
                            .refuse(live, problem, NO_KEYS, parts, Some(RequestBody::Buffered(body)), peer)
                            .await;
                    }
                }
            }
        };

        // 4. Fingerprint and record key.
        let fingerprint = fingerprint::fingerprint(
            &policy.fingerprint,
            live.route.host.as_deref(),
            &parts,
            &body,
            json.as_ref(),
        );
        let record_key = key::record_key(&policy.scope, &parts.headers, &key);
        if let Some(span) = telemetry::request_span() {
            span.record("key", record_key.tag().as_str());
        }
        drop(json);

        // 5. Claim.
        let refresh = policy.refresh_ttl_on_replay.then_some(policy.ttl);
        // Set when the key is first found in flight.
        let mut wait_until = None;
        // When the claim was sent: the lease's start, as the store may have
        // taken it at any moment after, however late its answer comes. And
        // when it was answered: the upstream's deadline runs from there, so
        // a slow store does not eat into it (`connect_timeout`, capped at
        // half of it, must end first: a request that never left is
        // released, and never taken for one the upstream may have seen).
        let (owner, claimed_at, answered_at) = loop {
            // Each claim an owner of its own: one that failed may yet
            // land, and the release that follows it, owner-checked, must
            // not take a later claim that won.
            let owner = Owner::new();
            let started = Instant::now();
            let claim = self
                .context
                .store
                .claim(&record_key, &fingerprint, owner, policy.lock_timeout, refresh)
                .await;
            let answered = Instant::now();
            self.context.metrics.store_latency.observe(answered - started);
            // Answered: claimed, the exchange's guard takes over; not, the
            // store handle has released whatever a failed call may have
            // taken (as it does when this request is dropped before the
            // answer: its client hung up).
            let problem = match claim {
                Ok(Claim::Claimed) => break (owner, started, answered),
                Ok(Claim::InFlight { fingerprint: f, .. } | Claim::Completed { fingerprint: f, .. })
                    if f != fingerprint =>
                {
                    Problem::KeyReused
                }
                Ok(Claim::Completed { outcome, .. }) => match outcome {
                    Stored::Response(stored) if policy.mode == Mode::Enforce => {
                        live.counters.count(Outcome::Replayed);
                        return replay(&stored, policy);
                    }
                    Stored::Response(_) => {
                        shadowed(live, Outcome::ShadowReplayed, Some(&record_key));
                        let request = Request::from_parts(parts, ClientBody::whole(body));
                        let key = Some((policy, key.as_str()));
                        return Box::pin(self.forward(request, upstream, OnStale::Fail, peer, key)).await;
                    }
                    Stored::NotReplayable => Problem::ResponseNotReplayable,
                    Stored::Unknown => Problem::OutcomeUnknown,
                },
                Ok(Claim::InFlight { .. }) => {
                    // From before the first claim, as the budget covers the claims too.
                    let wait_until = *wait_until.get_or_insert(started + policy.wait_timeout);
                    if policy.on_in_flight == OnInFlight::Wait && policy.mode == Mode::Enforce && answered < wait_until
                    {
                        match self.context.store.wait(&record_key, wait_until - answered).await {
                            Ok(()) => continue,
                            Err(error) => {
                                telemetry::warn_throttled!(error, "waiting on the store failed", route = %live.route.name);
                                if pause_before_claiming_again(wait_until).await {
                                    continue;
                                }
                                // The store said another request holds the key:
                                // even with on_error = "pass", do not forward.
                                Problem::RequestInFlight
                            }
                        }
                    } else {
                        Problem::RequestInFlight
                    }
                }
                // The store answered, and a record it cannot read holds the
                // key: even with on_error = "pass", forwarding could run the
                // request twice.
                Err(error @ StoreError::Corrupt(_)) if policy.mode == Mode::Enforce => {
                    tracing::error!(route = %live.route.name, key = %record_key.tag(), %error, "refused: the record under this key cannot be read");
                    live.counters.count(Outcome::StoreError);
                    return Problem::StoreUnavailable.response();
                }
                Err(error) => {
                    telemetry::warn_throttled!(error, "store claim failed", route = %live.route.name);
                    match wait_until {
                        // Claiming again after a wait, with time left.
                        Some(wait_until) if pause_before_claiming_again(wait_until).await => continue,
                        // The store had said another request holds the
                        // key, so, as when the wait itself fails, do not
                        // forward even with on_error = "pass".
                        Some(_) => Problem::RequestInFlight,
                        None => Problem::StoreUnavailable,
                    }
                }
            };
            // Should it be forwarded all the same (shadow mode, or a store
            // down with on_error = "pass"), the key goes as a claimed one's.
            return self
                .refuse(
                    live,
                    problem,
                    (Some(&record_key), Some(&key)),
                    parts,
                    Some(RequestBody::Buffered(body)),
                    peer,
                )
                .await;
        };

        // 6. The claimed exchange.
        let mut request = Request::from_parts(parts, ClientBody::whole(body));
        forward::prepare(&mut request, upstream, peer);
        forward_key(policy, request.headers_mut(), &key);
        exchange::run(
            &self.context.exchanges,
            Exchange {
                context: self.context.clone(),
                live: live.clone(),
                key: record_key,
                fingerprint,
                owner,
                claimed_at,
                answered_at,
                request,
                timeout: self.config.upstream.timeout,
                client_timeout: self.config.server.header_read_timeout,
                // Shadow mode changes no answer; `pass` puts availability
                // first.
                deliver_unrecorded: policy.mode == Mode::Shadow || self.config.store.on_error == OnStoreError::Pass,
            },
        )
        .await
    }

    /// Answers `problem`, or in shadow mode counts and logs it and forwards
    /// anyway. A store that is down with `on_error = "pass"` forwards too. A
    /// `body` of `None` was partly read already, so it is never forwarded.
    /// `keys`: the record key, once known, names the record in the log;
    /// the key, once read, goes upstream as a claimed request's does.
    async fn refuse(
        &self,
        live: &LiveRoute,
        problem: Problem,
        (record_key, key): (Option<&crate::store::RecordKey>, Option<&str>),
        parts: Parts,
        body: Option<RequestBody>,
        peer: Peer,
    ) -> Response<ResponseBody> {
        let outcome = outcome_of(&problem);
        let upstream = &live.upstream;
        let pass = problem == Problem::StoreUnavailable && self.config.store.on_error == OnStoreError::Pass;
        if let Some(body) = body.filter(|_| live.route.policy.mode == Mode::Shadow || pass) {
            if pass {
                live.counters.count(outcome);
            } else {
                shadowed(live, outcome.shadowed(), record_key);
            }
            let request = Request::from_parts(parts, body.into());
            let key = key.map(|key| (&live.route.policy, key));
            return Box::pin(self.forward(request, upstream, OnStale::Fail, peer, key)).await;
        }
        live.counters.count(outcome);
        problem.response()
    }

    /// Buffers the request body up to `max_request_body`. On failure, hands
    /// back the body when none of it was read yet, so shadow mode can still
    /// forward it.
    async fn read_body(&self, body: ClientBody) -> Result<Bytes, (Problem, Option<RequestBody>)> {
        let limit = self.config.server.max_request_body;
        if let ClientBody::Whole(bytes) = body {
            // Read with the head already: nothing to wait for.
            let bytes = bytes.unwrap_or_default();
            if bytes.len() as u64 > limit {
                return Err((Problem::BodyTooLarge { limit }, Some(RequestBody::Buffered(bytes))));
            }
            return Ok(bytes);
        }
        // The length the framing declared and checked (Content-Length).
        if http_body::Body::size_hint(&body).lower() > limit {
            return Err((Problem::BodyTooLarge { limit }, Some(RequestBody::Streaming(body))));
        }
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        // No deadline here: each kind of body bounds the wait for its next
        // frame itself (`header_read_timeout`).
        let mut body = Limited::new(body, limit);
        // The first frame as it came; later ones copied together, as a
        // frame is a slice of the listener's read buffer and keeping many
        // would keep many buffers (see `exchange::Recorder`).
        let mut first: Option<Bytes> = None;
        let mut rest = BytesMut::new();
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => match frame.into_data() {
                    Ok(data) if data.is_empty() => {}
                    Ok(data) if first.is_none() && rest.is_empty() => first = Some(data),
                    Ok(data) => {
                        if let Some(first) = first.take() {
                            rest.extend_from_slice(&first);
                        }
                        rest.extend_from_slice(&data);
                    }
                    Err(_) => {}
                },
                Err(error) if error.is::<http_body_util::LengthLimitError>() => {
                    return Err((Problem::BodyTooLarge { limit: limit as u64 }, None));
                }
                Err(error) => {
                    let problem = Problem::BadRequest(format!("the request body could not be read: {error}"));
                    return Err((problem, None));
                }
            }
        }
        Ok(first.unwrap_or_else(|| rest.freeze()))
    }

    /// Forwards without recording: pass-through, shadow mode, store bypass.
    /// A request a route takes (its method one the route makes idempotent)
    /// goes with `OnStale::Fail`: the operator has said it is not safe to
    /// send twice, so it is not resent on a new connection when a pooled
    /// one drops it after it went. A `key` read already goes as a claimed
    /// request's does: set after the headers `Connection` names are
    /// dropped, which could name the key's own.
    async fn forward(
        &self,
        mut request: Request<ClientBody>,
        upstream: &Uri,
        on_stale: OnStale,
        peer: Peer,
        key: Option<(&Policy, &str)>,
    ) -> Response<ResponseBody> {
        forward::prepare(&mut request, upstream, peer);
        if let Some((policy, key)) = key {
            forward_key(policy, request.headers_mut(), key);
        }
        let started = Instant::now();
        let deadline = started + self.config.upstream.timeout;
        // The upstream's time: waits on a slow client's upload move the
        // deadline on, as nginx counts only the time between two writes.
        let waits = request.body_mut().count_waits();
        let waited = || waits.as_ref().map_or(std::time::Duration::ZERO, |waits| waits.waited());
        // Boxed: inline, the upstream request (~2 KB) would size the future
        // of every request, including the idempotent ones that reach this
        // path only to refuse or bypass.
        let mut sending = Box::pin(self.context.client.request(request, on_stale, None));
        let sent = loop {
            let until = deadline + waited();
            match tokio::time::timeout_at(until, &mut sending).await {
                Err(_) if deadline + waited() > until => continue,
                sent => break sent,
            }
        };
        self.context.metrics.upstream_latency.observe(started.elapsed());
        match sent {
            Ok(Ok(response)) => {
                let (head, body) = response.into_parts();
                let deadline = Box::pin(tokio::time::sleep_until(deadline + waited()));
                Response::from_parts(
                    head,
                    ResponseBody::Upstream {
                        body: Box::new(body),
                        deadline,
                    },
                )
            }
            // The client's fault, not the upstream's: a body that broke off,
            // was malformed or stopped arriving (the connection is dropped).
            Ok(Err(upstream::UpstreamError::RequestBody(error))) => {
                tracing::debug!(%error, "the request body failed while it was forwarded");
                Problem::BadRequest(format!("the request body could not be read: {error}")).response()
            }
            Ok(Err(error)) => {
                tracing::warn!(error = %crate::telemetry::error_chain(&error), "upstream request failed");
                let detail = match error {
                    _ if error.is_connect() => "the upstream cannot be reached",
                    // It answered, but not so that the answer can be passed on.
                    upstream::UpstreamError::Protocol(_) | upstream::UpstreamError::Refused(..) => {
                        "the upstream's answer cannot be passed on"
                    }
                    _ => "the upstream connection failed",
                };
                Problem::UpstreamUnavailable(detail.into()).response()
            }
            Err(_) => Problem::UpstreamTimeout.response(),
        }
    }
}

/// Puts `key` under the route's `forward_key_header` (and drops the header
/// it came in, or the whole key when that is ""), as every request a route
/// forwards carries it.
fn forward_key(policy: &Policy, headers: &mut http::HeaderMap, key: &str) {
    // The usual case, the key forwarded under the header it came in, as
    // sent: nothing to change.
    let forwarded_as_sent = policy.forward_key_header.as_ref() == Some(&policy.key.header)
        && headers
            .get(&policy.key.header)
            .is_some_and(|sent| sent.as_bytes() == key.as_bytes());
    if !forwarded_as_sent {
        headers.remove(&policy.key.header);
        if let Some(name) = &policy.forward_key_header {
            // Keys are visible ASCII, or hex when derived: always a valid value.
            headers.insert(
                name.clone(),
                HeaderValue::from_str(key).expect("keys are visible ASCII"),
            );
        }
    }
}

/// The stored answer, with `Idempotent-Replayed: true`.
fn replay(stored: &StoredResponse, policy: &Policy) -> Response<ResponseBody> {
    let mut response = Response::new(ResponseBody::full(stored.body()));
    *response.status_mut() = stored.status;
    let headers = response.headers_mut();
    headers.reserve(stored.headers().len() + 1);
    for (name, value) in stored.header_values() {
        if !policy.replay_drop_headers.contains(&name) {
            headers.append(name, value);
        }
    }
    headers.insert(REPLAYED.clone(), HeaderValue::from_static("true"));
    response
}

/// Counts and logs what enforce mode would have done with a request that
/// shadow mode forwards: what shadow mode is for. `key`, once known, names
/// the record.
fn shadowed(live: &LiveRoute, outcome: Outcome, key: Option<&crate::store::RecordKey>) {
    live.counters.count(outcome);
    let key = key.map(|key| tracing::field::display(key.tag()));
    tracing::info!(route = %live.route.name, outcome = outcome.name(), key, "shadow mode forwarded it");
}

fn outcome_of(problem: &Problem) -> Outcome {
    match problem {
        Problem::KeyMissing(_) => Outcome::KeyMissing,
        Problem::KeyInvalid(_) => Outcome::KeyInvalid,
        Problem::KeyReused => Outcome::Mismatch,
        Problem::RequestInFlight => Outcome::InFlight,
        Problem::BodyTooLarge { .. } => Outcome::TooLarge,
        Problem::ResponseNotReplayable => Outcome::NotReplayable,
        Problem::OutcomeUnknown => Outcome::OutcomeUnknown,
        Problem::StoreUnavailable | Problem::AnswerUnrecorded => Outcome::StoreError,
        Problem::UpstreamUnavailable(_) | Problem::UpstreamTimeout => Outcome::UpstreamError,
        Problem::BadRequest(_) => Outcome::BadRequest,
    }
}
