//! The listeners: the proxy's accept loop (HTTP/1.1 by our own `h1`
//! connection, HTTP/2 by hyper, chosen by ALPN or the HTTP/2 preface), the
//! admin listener, and graceful shutdown.

pub mod admin;
mod h1;
pub mod tls;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::{Buf, Bytes};
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, StoreBackend};
use crate::proxy::{BoxError, ClientBody, Gateway, Peer, ResponseBody, SentClaims, UnreadBodies};
use crate::store::StoreHandle;
use crate::telemetry::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("TLS setup failed")]
    Tls(#[from] tls::TlsError),
}

/// The field that tells `after`'s store from `before`'s: `store.backend`
/// when the kind changed, else the kind's own field (Redis's `url` or
/// `urls`, whichever `after` has).
fn store_field(before: &StoreBackend, after: &StoreBackend) -> Option<&'static str> {
    use StoreBackend::*;
    match (before, after) {
        _ if before == after => None,
        (Memory { .. }, Memory { .. }) => Some("store.max_memory"),
        (Embedded { .. }, Embedded { .. }) => Some("store.path"),
        (Redis { .. } | RedisCluster { .. }, Redis { .. }) => Some("store.url"),
        (Redis { .. } | RedisCluster { .. }, RedisCluster { .. }) => Some("store.urls"),
        _ => Some("store.backend"),
    }
}

/// Checks what a configuration needs from files (certificates, CA roots),
/// so a bad one fails before any port is bound.
pub fn check(config: &Config) -> Result<(), ServerError> {
    if let Some(server_tls) = &config.server.tls {
        tls::acceptor(server_tls)?;
    }
    tls::client_config(config.upstream.ca.as_deref())?;
    Ok(())
}

/// A bound, ready-to-run idemgate.
pub struct Server {
    listener: TcpListener,
    admin: Option<TcpListener>,
    tls: Option<TlsAcceptor>,
    gateway: Arc<ArcSwap<Gateway>>,
    metrics: Arc<Metrics>,
    /// Every claimed exchange, across reloads: drained on shutdown; and
    /// the claims it records as unknown if its grace runs out.
    exchanges: TaskTracker,
    sent: SentClaims,
}

/// Swaps in a new configuration while the server runs.
#[derive(Clone)]
pub struct Reloader {
    gateway: Arc<ArcSwap<Gateway>>,
    metrics: Arc<Metrics>,
    exchanges: TaskTracker,
    sent: SentClaims,
}

/// Applies `config` to every worker, all or none: each is prepared first
/// (with one upstream client for all, its CA file read once, as a file
/// rewritten meanwhile could read otherwise for each), and only once
/// every one can take it are they swapped in. What was applied, logged
/// once by the caller.
pub fn reload_all(reloaders: &[Reloader], config: Config) -> Result<Option<Reloaded>, ReloadError> {
    let client = crate::proxy::upstream::client(&config.upstream)?;
    let prepared = reloaders
        .iter()
        .map(|reloader| reloader.prepare(config.clone(), &client))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(prepared.into_iter().map(Prepared::commit).last())
}

/// A worker's new gateway, made and checked, not yet in use.
struct Prepared {
    target: Arc<ArcSwap<Gateway>>,
    gateway: Gateway,
    reloaded: Reloaded,
}

impl Prepared {
    /// Swaps the new gateway in.
    fn commit(self) -> Reloaded {
        self.target.store(Arc::new(self.gateway));
        self.reloaded
    }
}

impl Reloader {
    /// `server.shutdown_grace` as this worker has it now.
    pub fn shutdown_grace(&self) -> std::time::Duration {
        self.gateway.load().config().server.shutdown_grace
    }

    /// Applies `config` to every request that starts from now on; requests
    /// in flight finish under the configuration they started with. The
    /// listeners and the store stay as they are: changing those needs a
    /// restart, and [`Reloaded::log`] says so. (For one worker; see
    /// [`reload_all`] for several.)
    pub fn apply(&self, config: Config) -> Result<Reloaded, ReloadError> {
        let applied = reload_all(std::slice::from_ref(self), config)?;
        Ok(applied.expect("one worker, applied"))
    }

    /// The gateway `config` makes for this worker, and what it changes,
    /// or why it cannot be applied.
    fn prepare(
        &self,
        mut config: Config,
        client: &crate::proxy::upstream::UpstreamClient,
    ) -> Result<Prepared, ReloadError> {
        let old = self.gateway.load();
        // Always the values in force since the start: each reload carries
        // them forward (below).
        let before = old.config();
        admin_stays_guarded(&before.server, &config.server)?;
        // TLS on or off, or other certificate or key files.
        let tls_files = |c: &Config| c.server.tls.as_ref().map(|t| (t.cert.clone(), t.key.clone()));
        let store_changed = store_field(&before.store.backend, &config.store.backend);
        let restart_only = [
            ("server.listen", config.server.listen != before.server.listen),
            (
                "server.admin_listen",
                config.server.admin_listen != before.server.admin_listen,
            ),
            ("server.tls", tls_files(&config) != tls_files(before)),
            (
                "server.header_read_timeout",
                config.server.header_read_timeout != before.server.header_read_timeout,
            ),
            ("server.workers", config.server.workers != before.server.workers),
            (store_changed.unwrap_or("store.backend"), store_changed.is_some()),
            ("store.timeout", config.store.timeout != before.store.timeout),
            ("store.key_prefix", config.store.key_prefix != before.store.key_prefix),
            (
                "store.wait_for_replicas",
                config.store.wait_for_replicas != before.store.wait_for_replicas,
            ),
        ];
        let waiting = restart_only
            .iter()
            .filter(|(_, changed)| *changed)
            .map(|(field, _)| *field);
        let waiting = waiting.collect();
        // The files may have been renewed in place.
        let tls_kept = config.server.tls.is_some() && tls_files(&config) == tls_files(before);
        // What takes a restart keeps its running value in the configuration
        // applied, so the next reload is compared with what is bound (an
        // admin listener moved back to loopback in the file is still where
        // it was bound, and still needs its token), and no part of the
        // process reads a value the rest does not use yet.
        config.server.listen = before.server.listen;
        config.server.admin_listen = before.server.admin_listen;
        config.server.tls = before.server.tls.clone();
        config.server.header_read_timeout = before.server.header_read_timeout;
        config.server.workers = before.server.workers;
        config.store.backend = before.store.backend.clone();
        config.store.timeout = before.store.timeout;
        config.store.key_prefix = before.store.key_prefix.clone();
        config.store.wait_for_replicas = before.store.wait_for_replicas;
        // Of the configuration as applied: a lease is renewed within the
        // store timeout in force, not the one the file asks for next.
        let warnings = crate::config::warnings(&config);
        let gateway = Gateway::with_client(
            Arc::new(config),
            old.store().clone(),
            self.metrics.clone(),
            (self.exchanges.clone(), self.sent.clone()),
            client.clone(),
        );
        let routes = gateway.config().routes.len();
        Ok(Prepared {
            target: self.gateway.clone(),
            gateway,
            reloaded: Reloaded {
                waiting,
                warnings,
                tls_kept,
                routes,
            },
        })
    }
}

/// What a reload applied, and what waits for a restart: logged once for
/// all the workers, which each apply the same file.
#[derive(Debug)]
pub struct Reloaded {
    waiting: Vec<&'static str>,
    /// [`crate::config::warnings`] of the configuration applied, with the
    /// restart-only values still in force.
    warnings: Vec<String>,
    tls_kept: bool,
    routes: usize,
}

impl Reloaded {
    pub fn log(&self) {
        for field in &self.waiting {
            tracing::warn!(
                field,
                "changed: it takes effect after a restart (the rest is applied now)"
            );
        }
        for warning in &self.warnings {
            tracing::warn!("{warning}");
        }
        if self.tls_kept {
            tracing::info!("server.tls: the certificate and key were read at start; a renewed one takes a restart");
        }
        tracing::info!(routes = self.routes, "configuration reloaded");
    }
}

/// Why a reload was refused (the running configuration stays).
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error(
        "server.admin_token: is required while the admin listener stays on {0} (not a loopback address) until a restart: /records can purge records"
    )]
    AdminToken(SocketAddr),
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
}

/// The admin listener stays where it was bound until a restart, whatever
/// the new file says: a token it needs there is needed by the new
/// configuration too, or a reload could open `/records` to the network.
fn admin_stays_guarded(
    running: &crate::config::ServerConfig,
    new: &crate::config::ServerConfig,
) -> Result<(), ReloadError> {
    match running.admin_listen {
        Some(bound) if !bound.ip().is_loopback() && new.admin_token.is_none() => Err(ReloadError::AdminToken(bound)),
        _ => Ok(()),
    }
}

/// Binds `addr` once per accept loop: `count` sockets sharing the port with
/// SO_REUSEPORT (the kernel spreads connections across them), or one plain
/// socket. With port 0, every socket gets the port the first one got.
///
/// A port another process's SO_REUSEPORT group holds is refused, as a plain
/// bind would refuse it: Linux lets sockets of one user share it, so a
/// second idemgate on the same `listen` would otherwise start without
/// complaint and take half the connections, to a store of its own.
pub fn bind_listeners(addr: SocketAddr, count: usize) -> Result<Vec<std::net::TcpListener>, ServerError> {
    let mut addr = addr;
    if count > 1 {
        // A plain socket, let go at once: its bind fails on a port in use.
        addr = bind_one(addr, false)
            .and_then(|probe| probe.local_addr())
            .map_err(|source| ServerError::Bind { addr, source })?;
    }
    let mut listeners = Vec::with_capacity(count);
    for _ in 0..count.max(1) {
        let bound = bind_one(addr, count > 1).map_err(|source| ServerError::Bind { addr, source })?;
        addr = bound
            .local_addr()
            .map_err(|source| ServerError::Bind { addr, source })?;
        listeners.push(bound);
    }
    Ok(listeners)
}

fn bind_one(addr: SocketAddr, reuse_port: bool) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(4096)?;
    Ok(std::net::TcpListener::from(socket))
}

fn listener(std: std::net::TcpListener) -> Result<TcpListener, ServerError> {
    let addr = std.local_addr().map_err(|source| ServerError::Bind {
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
        source,
    })?;
    TcpListener::from_std(std).map_err(|source| ServerError::Bind { addr, source })
}

impl Server {
    /// Binds the listeners around an already opened store: one accept loop
    /// on the current runtime.
    pub async fn bind_with_store(config: Config, store: StoreHandle) -> Result<Server, ServerError> {
        // Everything that can fail on a bad file fails before any port is bound.
        check(&config)?;
        let listen = bind_listeners(config.server.listen, 1)?.remove(0);
        let admin = match config.server.admin_listen {
            Some(addr) => Some(bind_listeners(addr, 1)?.remove(0)),
            None => None,
        };
        Server::from_listeners(config, store, Arc::new(Metrics::default()), listen, admin)
    }

    /// A server on listeners bound already (see [`bind_listeners`]), for one
    /// of several accept loops that share `store` and `metrics`. Must be
    /// called on the runtime that will run it.
    pub fn from_listeners(
        config: Config,
        store: StoreHandle,
        metrics: Arc<Metrics>,
        listen: std::net::TcpListener,
        admin: Option<std::net::TcpListener>,
    ) -> Result<Server, ServerError> {
        let tls = config.server.tls.as_ref().map(tls::acceptor).transpose()?;
        let (exchanges, sent) = (TaskTracker::new(), SentClaims::default());
        let gateway = Gateway::new(
            Arc::new(config),
            store,
            metrics.clone(),
            (exchanges.clone(), sent.clone()),
        )?;
        Ok(Server {
            listener: listener(listen)?,
            admin: admin.map(listener).transpose()?,
            tls,
            gateway: Arc::new(ArcSwap::from_pointee(gateway)),
            metrics,
            exchanges,
            sent,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().and_then(|l| l.local_addr().ok())
    }

    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// A handle that swaps in a new configuration (SIGHUP).
    pub fn reloader(&self) -> Reloader {
        Reloader {
            gateway: self.gateway.clone(),
            metrics: self.metrics.clone(),
            exchanges: self.exchanges.clone(),
            sent: self.sent.clone(),
        }
    }

    /// Serves until `shutdown` resolves, then stops accepting and lets open
    /// connections and claimed exchanges finish for `shutdown_grace`.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        self.run_keeping_admin(shutdown, std::future::ready(())).await
    }

    /// As [`Server::run`], for one of several accept loops: the admin
    /// listener, if this one serves it, stays open after this loop's own
    /// drain until `others_drained` resolves too.
    pub async fn run_keeping_admin(self, shutdown: impl Future<Output = ()>, others_drained: impl Future<Output = ()>) {
        let Server {
            listener,
            admin,
            tls,
            gateway,
            metrics,
            exchanges,
            sent,
        } = self;
        let config = gateway.load().config().clone();
        let (admin_phase, phase) = tokio::sync::watch::channel(admin::Phase::Serving);
        if let Some(admin) = admin {
            let header_read_timeout = config.server.header_read_timeout;
            tokio::spawn(admin::serve(
                admin,
                gateway.clone(),
                metrics,
                header_read_timeout,
                phase,
            ));
        }
        // This worker's idle upstream connections, swept while it serves.
        let _sweeper = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(crate::proxy::sweep_idle_connections()));

        // Cancelled at shutdown: idle connections close, busy ones after
        // their answer (HTTP/1.1) or their open streams (HTTP/2).
        let stopping = CancellationToken::new();
        let connections = TaskTracker::new();
        let header_read_timeout = config.server.header_read_timeout;
        tracing::debug!(listen = %listener.local_addr().map(|a| a.to_string()).unwrap_or_default(), routes = config.routes.len(), "accept loop serving");

        tokio::pin!(shutdown);
        loop {
            let (stream, addr) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Out of file descriptors and the like: back off
                        // briefly, and say so once a second, not 50 times.
                        crate::telemetry::warn_throttled!(error, "accept failed", listener = "proxy");
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        continue;
                    }
                },
                () = &mut shutdown => break,
            };
            let _ = stream.set_nodelay(true);
            let peer = Peer {
                addr,
                tls: tls.is_some(),
            };
            let (gateway, stopping) = (gateway.clone(), stopping.clone());
            let streams = Streams(connections.clone());
            match &tls {
                None => {
                    connections.spawn(serve_connection(
                        stream,
                        gateway,
                        peer,
                        header_read_timeout,
                        stopping,
                        streams,
                    ));
                }
                Some(acceptor) => {
                    // The handshake runs in the connection's own task, bounded
                    // like a request head, so a slow client stalls nobody; and
                    // given up at shutdown, as an idle connection is, so a
                    // silent one holds no drain for `header_read_timeout`.
                    let acceptor = acceptor.clone();
                    connections.spawn(async move {
                        let opening = async move {
                            if opens_with_plain_http(&stream).await {
                                return Ok(Err(stream));
                            }
                            acceptor.accept(stream).await.map(Ok)
                        };
                        let handshake = tokio::time::timeout(header_read_timeout, opening);
                        let stream = tokio::select! {
                            handshake = handshake => match handshake {
                                Ok(Ok(Ok(stream))) => stream,
                                Ok(Ok(Err(plain))) => {
                                    tracing::debug!("plain HTTP on the TLS listener: refused");
                                    return h1::refuse_plain_http(plain, header_read_timeout, &stopping).await;
                                }
                                Ok(Err(error)) => return tracing::debug!(%error, "TLS handshake failed"),
                                Err(_) => return tracing::debug!("TLS handshake timed out"),
                            },
                            () = stopping.cancelled() => return tracing::debug!("TLS handshake given up at shutdown"),
                        };
                        if stream.get_ref().1.alpn_protocol() == Some(b"h2") {
                            let stream = Rewind::new(Bytes::new(), stream);
                            serve_h2(stream, gateway, peer, header_read_timeout, stopping, streams).await;
                        } else {
                            serve_connection(stream, gateway, peer, header_read_timeout, stopping, streams).await;
                        }
                    });
                }
            }
        }

        drop(listener);
        // The admin listener stays through the drain, as Envoy's does:
        // health checks and scrapes still answer, `/readyz` with 503.
        let _ = admin_phase.send(admin::Phase::Draining);
        let grace = gateway.load().config().server.shutdown_grace;
        tracing::debug!(?grace, "accept loop draining its connections and claimed exchanges");
        // An exchange outlives its connection when the client hung up: wait
        // for those too, so their records are completed.
        exchanges.close();
        connections.close();
        stopping.cancel();
        let drained = async {
            connections.wait().await;
            exchanges.wait().await;
        };
        match tokio::time::timeout(grace, drained).await {
            Ok(()) => tracing::debug!("accept loop drained"),
            Err(_) => {
                // Dropped with the runtime, requests that may have been sent
                // on routes that keep such outcomes as unknown would leave
                // their claims to their leases, and a retry would run them
                // again: recorded as unknown first. The others are settled
                // by their guards as they are dropped.
                let unknown = sent.give_up(gateway.load().store()).await;
                tracing::warn!(
                    connections = connections.len(),
                    exchanges = exchanges.len(),
                    recorded_unknown = unknown,
                    "shutdown grace ran out; requests still open are cut off and their claims released, or \
                     recorded as unknown where the request may have been carried out (on_upstream_failure = \
                     \"unknown\", or an answer with a status the route keeps)"
                );
            }
        }
        others_drained.await;
        let _ = admin_phase.send(admin::Phase::Stopped);
    }
}

/// Whether a connection to the TLS listener opened with plain text, as
/// plain HTTP does: its first byte printable ASCII or a line's whitespace
/// (a method in any case, HTTP/2's `PRI` preface, a stray blank line),
/// where a TLS client's opens a handshake record (22), and an SSLv2-style
/// hello with its high bit set.
async fn opens_with_plain_http(stream: &tokio::net::TcpStream) -> bool {
    let mut first = [0u8; 1];
    matches!(stream.peek(&mut first).await, Ok(1)) && (first[0].is_ascii_graphic() || b" \t\r\n".contains(&first[0]))
}

/// Serves a connection as HTTP/1.1, or as HTTP/2 if it opens with the
/// HTTP/2 preface.
async fn serve_connection<S>(
    stream: S,
    gateway: Arc<ArcSwap<Gateway>>,
    peer: Peer,
    header_read_timeout: Duration,
    stopping: CancellationToken,
    streams: Streams,
) where
    S: AsyncRead + AsyncWrite + h1::Reset + Unpin + Send + 'static,
{
    match h1::serve(stream, gateway.clone(), peer, header_read_timeout, stopping.clone()).await {
        h1::Ended::Closed => {}
        h1::Ended::Http2(stream, read) => {
            serve_h2(
                Rewind::new(read, stream),
                gateway,
                peer,
                header_read_timeout,
                stopping,
                streams,
            )
            .await;
        }
    }
}

/// Serves an HTTP/2 connection with hyper until it ends; at shutdown it
/// finishes the streams it has open and takes no more. A connection that
/// has been idle for `idle` (at most twice that; see
/// [`Activity::idle_for`]) is closed the same way, as HTTP/1.1 keep-alive
/// connections are after `header_read_timeout`: hyper's HTTP/2 server
/// never closes an idle connection, nor one that sent its preface and
/// nothing after, nor one whose client stopped reading. Request bodies get
/// `idle` per frame, counted while no other body of the connection holds
/// data unread ([`UnreadBodies`]).
async fn serve_h2<S>(
    mut stream: Rewind<S>,
    gateway: Arc<ArcSwap<Gateway>>,
    peer: Peer,
    idle: Duration,
    stopping: CancellationToken,
    streams: Streams,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity::default());
    stream.activity = Some(activity.clone());
    let unread = Arc::new(UnreadBodies::default());
    let service = service_fn({
        let activity = activity.clone();
        move |request: http::Request<hyper::body::Incoming>| {
            let gateway = gateway.load_full();
            let open = Open::new(&activity);
            let unread = unread.clone();
            async move {
                let (mut parts, body) = request.into_parts();
                let head_only = parts.method == http::Method::HEAD;
                crate::proxy::forward::h2_as_h1(&mut parts.headers);
                let request = http::Request::from_parts(parts, ClientBody::h2(body, idle, unread));
                let mut response = gateway.handle(request, peer).await;
                if head_only {
                    head_answer(&mut response);
                }
                no_content_length(&mut response);
                // Open until its body has been handed to hyper whole (or dropped).
                Ok::<_, Infallible>(response.map(|body| Tracked::new(body, open)))
            }
        }
    });
    let connection = hyper::server::conn::http2::Builder::new(streams)
        .timer(TokioTimer::new())
        // Room on the connection for a few streams' windows (1 MiB each):
        // with hyper's default, the same 1 MiB, one request body left
        // unread upstream would stall every other stream's body, which
        // `idle` would then end as stalled.
        .initial_connection_window_size(H2_CONNECTION_WINDOW)
        // The head an HTTP/1.1 client may send (hyper's default is 16 KiB),
        // counted as HTTP/2 counts a header list: 32 bytes more a field.
        .max_header_list_size((crate::wire::MAX_HEAD + 32 * crate::wire::MAX_HEADERS) as u32)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        () = stopping.cancelled() => {
            connection.as_mut().graceful_shutdown();
            // The drain lets go of an idle or stuck peer as serving does:
            // one that never reads, or never sent its preface (hyper waits
            // out the handshake before it sends GOAWAY), would otherwise
            // hold every stop for all of `shutdown_grace`.
            tokio::select! {
                result = connection.as_mut() => result,
                () = activity.idle_for(idle) => Ok(()),
            }
        }
        () = activity.idle_for(idle) => {
            connection.as_mut().graceful_shutdown();
            // Bounded: a peer that does not read would hold the GOAWAY.
            tokio::time::timeout(idle, connection).await.unwrap_or(Ok(()))
        }
    };
    if let Err(error) = result {
        tracing::debug!(%error, "connection ended with an error");
    }
}

/// Makes an answer to a HEAD bodiless, as HTTP/1.1's writer does and
/// hyper's HTTP/2 server does not: HTTP/2 clients reset a HEAD's stream on
/// a DATA frame. An answer with a body in hand (a problem, a replay)
/// declares the length a GET would get, as nginx does (RFC 9110 §9.3.2);
/// dropping a claimed exchange's body is its client leaving, so its record
/// is still completed.
fn head_answer(response: &mut http::Response<ResponseBody>) {
    use hyper::body::Body;
    let body = response.body();
    if body.is_end_stream() {
        return;
    }
    let exact = body.size_hint().exact().filter(|&n| n > 0);
    if let Some(n) = exact
        && !response.status().is_informational()
    {
        response
            .headers_mut()
            .entry(http::header::CONTENT_LENGTH)
            .or_insert_with(|| n.into());
    }
    *response.body_mut() = ResponseBody::empty();
}

/// Drops a 204's `Content-Length`, as HTTP/1.1's writer does: RFC 9110
/// §8.6 allows none, and an HTTP/2 client resets a stream that has one
/// above 0, whether the upstream sent it or a record kept it.
fn no_content_length(response: &mut http::Response<ResponseBody>) {
    if response.status() == http::StatusCode::NO_CONTENT {
        response.headers_mut().remove(http::header::CONTENT_LENGTH);
    }
}

/// Runs an HTTP/2 connection's streams as tasks the drain waits for, as it
/// waits for the connections: a stream carries its request's exchange, so
/// one whose connection ended first would otherwise be dropped with the
/// runtime, its record neither completed nor released.
#[derive(Clone)]
struct Streams(TaskTracker);

impl<F> hyper::rt::Executor<F> for Streams
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, future: F) {
        self.0.spawn(future);
    }
}

/// The HTTP/2 connection-level flow-control window: four streams' worth.
const H2_CONNECTION_WINDOW: u32 = 4 << 20;

/// An HTTP/2 connection's requests: how many are open, how many have
/// begun, how often their answers' bodies were polled, how many of those
/// have handed hyper a frame it has not taken yet, and how many writes to
/// the client moved bytes.
#[derive(Default)]
struct Activity {
    open: AtomicUsize,
    begun: AtomicU64,
    polls: AtomicU64,
    handed: AtomicUsize,
    writes: AtomicU64,
}

impl Activity {
    /// Returns once a whole `period` has passed with nothing written to the
    /// client, no request begun, no answer's body polled, and no request
    /// open but those stuck on a frame the client does not take (its
    /// flow-control window shut): as the HTTP/1.1 listener gives up on a
    /// client that stops reading. A slow reader is written to, and an
    /// answer waiting on its upstream is not stuck.
    async fn idle_for(&self, period: Duration) {
        let moved = || {
            (
                self.begun.load(Ordering::SeqCst),
                self.polls.load(Ordering::SeqCst),
                self.writes.load(Ordering::SeqCst),
            )
        };
        let mut seen = moved();
        loop {
            tokio::time::sleep(period).await;
            let now = moved();
            let open = self.open.load(Ordering::SeqCst);
            let stuck = open == 0 || open == self.handed.load(Ordering::SeqCst);
            // Read again: a request may have moved between the loads.
            if now == seen && stuck && moved() == now {
                return;
            }
            seen = now;
        }
    }
}

/// A response body that keeps its request counted as open, and says when
/// it has handed hyper a frame not yet taken (hyper holds the next frame
/// it polls until the client's window has room for it, and polls no more
/// until then).
struct Tracked {
    body: ResponseBody,
    open: Open,
    handed: bool,
}

impl Tracked {
    fn new(body: ResponseBody, open: Open) -> Tracked {
        Tracked {
            body,
            open,
            handed: false,
        }
    }

    fn taken(&mut self) {
        if std::mem::take(&mut self.handed) {
            self.open.0.handed.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.taken();
    }
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        this.taken();
        this.open.0.polls.fetch_add(1, Ordering::SeqCst);
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &polled {
            this.handed = true;
            this.open.0.handed.fetch_add(1, Ordering::SeqCst);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A request open on an HTTP/2 connection, until dropped.
struct Open(Arc<Activity>);

impl Open {
    fn new(activity: &Arc<Activity>) -> Open {
        activity.open.fetch_add(1, Ordering::SeqCst);
        activity.begun.fetch_add(1, Ordering::SeqCst);
        Open(activity.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A stream with bytes already read from it put back in front.
/// (For HTTP/2, whose connections it carries, it also counts the writes
/// that moved bytes: see [`Activity`].)
struct Rewind<S> {
    read: Bytes,
    stream: S,
    activity: Option<Arc<Activity>>,
}

impl<S> Rewind<S> {
    fn new(read: Bytes, stream: S) -> Rewind<S> {
        Rewind {
            read,
            stream,
            activity: None,
        }
    }

    fn wrote(&self, written: &Poll<std::io::Result<usize>>) {
        if let (Some(activity), Poll::Ready(Ok(1..))) = (&self.activity, written) {
            activity.writes.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewind<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        if !self.read.is_empty() {
            let n = self.read.len().min(buf.remaining());
            buf.put_slice(&self.read[..n]);
            self.read.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewind<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let written = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.wrote(&written);
        written
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let written = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.wrote(&written);
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(toml: &str) -> crate::config::ServerConfig {
        let text = format!("[server]\n{toml}\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n");
        Config::parse(&text, "t.toml").unwrap_or_else(|e| panic!("{e}")).server
    }

    #[test]
    fn an_http2_204_has_no_content_length() {
        for (status, kept) in [(204, false), (200, true), (304, true)] {
            let mut response = http::Response::new(ResponseBody::empty());
            *response.status_mut() = http::StatusCode::from_u16(status).unwrap();
            response.headers_mut().insert(http::header::CONTENT_LENGTH, 5.into());
            no_content_length(&mut response);
            assert_eq!(
                response.headers().contains_key(http::header::CONTENT_LENGTH),
                kept,
                "{status}"
            );
        }
    }

    #[test]
    fn a_reload_cannot_take_the_token_off_a_public_admin_listener() {
        let public = server("admin_listen = \"0.0.0.0:9901\"\nadmin_token = \"s3cret\"");
        let loopback = server("admin_listen = \"127.0.0.1:9901\"");
        // The new file moves the listener to loopback and drops the token:
        // the listener stays public until a restart, so it is refused.
        let refused = admin_stays_guarded(&public, &loopback);
        assert!(matches!(refused, Err(ReloadError::AdminToken(_))), "{refused:?}");
        assert!(refused.unwrap_err().to_string().starts_with("server.admin_token"));
        assert!(admin_stays_guarded(&public, &public).is_ok());
        // On loopback, or with no admin listener, no token is needed.
        assert!(admin_stays_guarded(&loopback, &loopback).is_ok());
        assert!(admin_stays_guarded(&server("admin_listen = \"\""), &loopback).is_ok());
    }

    /// A config of `toml` under `[server]`, with an upstream.
    fn server_config(toml: &str) -> Config {
        let text = format!("[server]\n{toml}\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n");
        Config::parse(&text, "t.toml").unwrap_or_else(|e| panic!("{e}"))
    }

    /// A worker's reloader, running `running` on a memory store.
    fn reloader(running: Config) -> Reloader {
        let store = StoreHandle::new(
            Arc::new(crate::store::MemoryStore::new(1 << 20)),
            Duration::from_secs(1),
        );
        let metrics = Arc::new(Metrics::default());
        let tracked = (TaskTracker::new(), SentClaims::default());
        let gateway = Gateway::new(Arc::new(running), store, metrics.clone(), tracked.clone()).unwrap();
        Reloader {
            gateway: Arc::new(ArcSwap::from_pointee(gateway)),
            metrics,
            exchanges: tracked.0,
            sent: tracked.1,
        }
    }

    /// A reload every worker cannot take is taken by none: here the
    /// second worker's listener is public and the file drops its token,
    /// and the first, which could take it, keeps running the old file.
    #[tokio::test]
    async fn a_reload_one_worker_refuses_is_applied_by_none() {
        let config = server_config;
        let workers = [
            reloader(config("admin_listen = \"127.0.0.1:9901\"\nshutdown_grace = \"7s\"")),
            reloader(config(
                "admin_listen = \"0.0.0.0:9901\"\nadmin_token = \"s3cret\"\nshutdown_grace = \"7s\"",
            )),
        ];
        let refused = reload_all(
            &workers,
            config("admin_listen = \"127.0.0.1:9901\"\nshutdown_grace = \"3s\""),
        );
        assert!(matches!(refused, Err(ReloadError::AdminToken(_))), "{refused:?}");
        for worker in &workers {
            let running = worker.gateway.load().config().clone();
            assert_eq!(running.server.shutdown_grace, Duration::from_secs(7));
        }
        // One every worker can take is taken by all.
        let applied = reload_all(
            &workers,
            config("admin_listen = \"127.0.0.1:9901\"\nadmin_token = \"s3cret\"\nshutdown_grace = \"3s\""),
        );
        assert!(matches!(applied, Ok(Some(_))), "{applied:?}");
        for worker in &workers {
            let running = worker.gateway.load().config().clone();
            assert_eq!(running.server.shutdown_grace, Duration::from_secs(3));
        }
    }

    /// Two reloads cannot do what one may not: each is compared with what
    /// is bound, not with the file before it.
    #[tokio::test]
    async fn a_reload_is_compared_with_what_is_bound_not_with_the_last_file() {
        let config = server_config;
        let running =
            config("admin_listen = \"0.0.0.0:9901\"\nadmin_token = \"s3cret\"\nheader_read_timeout = \"10s\"");
        let reloader = reloader(running);
        // The file moves the listener to loopback and keeps the token:
        // applied, but the listener is still where it was bound.
        let moved = "admin_listen = \"127.0.0.1:9901\"\nheader_read_timeout = \"1s\"";
        reloader
            .apply(config(&format!("{moved}\nadmin_token = \"s3cret\"")))
            .unwrap();
        let applied = reloader.gateway.load().config().clone();
        assert_eq!(applied.server.admin_listen, Some("0.0.0.0:9901".parse().unwrap()));
        assert_eq!(applied.server.header_read_timeout, Duration::from_secs(10));
        // Dropping the token next is refused: the listener is still public.
        let refused = reloader.apply(config(moved));
        assert!(matches!(refused, Err(ReloadError::AdminToken(_))), "{refused:?}");
    }
}
