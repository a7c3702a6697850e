//! The listeners: the proxy's accept loop (HTTP/1.1 and h2c through
//! hyper-util's auto builder), the admin listener, and graceful shutdown.

mod admin;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::config::Config;
use crate::proxy::{Gateway, Peer};
use crate::store::{OpenError, StoreHandle};
use crate::telemetry::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot open the store")]
    Store(#[from] OpenError),
}

/// A bound, ready-to-run idemgate.
pub struct Server {
    listener: TcpListener,
    admin: Option<TcpListener>,
    gateway: Arc<Gateway>,
    metrics: Arc<Metrics>,
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, ServerError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServerError::Bind { addr, source })
}

impl Server {
    /// Opens the configured store and binds the listeners.
    pub async fn bind(config: Config) -> Result<Server, ServerError> {
        let store = StoreHandle::open(&config.store)?;
        Server::bind_with_store(config, store).await
    }

    /// Binds the listeners around an already opened store.
    pub async fn bind_with_store(config: Config, store: StoreHandle) -> Result<Server, ServerError> {
        let listener = bind(config.server.listen).await?;
        let admin = match config.server.admin_listen {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        let metrics = Arc::new(Metrics::default());
        let gateway = Arc::new(Gateway::new(Arc::new(config), store, metrics.clone()));
        Ok(Server {
            listener,
            admin,
            gateway,
            metrics,
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

    /// Serves until `shutdown` resolves, then stops accepting and lets open
    /// connections finish for `shutdown_grace`.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let Server {
            listener,
            admin,
            gateway,
            metrics,
        } = self;
        let config = gateway.config().clone();
        let (stop_admin, admin_stopped) = tokio::sync::watch::channel(());
        if let Some(admin) = admin {
            tokio::spawn(admin::serve(admin, gateway.clone(), metrics, admin_stopped));
        }

        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(config.server.header_read_timeout);
        builder.http2().timer(TokioTimer::new());
        let graceful = GracefulShutdown::new();
        tracing::info!(listen = %listener.local_addr().map(|a| a.to_string()).unwrap_or_default(), routes = config.routes.len(), "idemgate serving");

        tokio::pin!(shutdown);
        loop {
            let (stream, addr) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Out of file descriptors and the like: back off briefly.
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        continue;
                    }
                },
                () = &mut shutdown => break,
            };
            let _ = stream.set_nodelay(true);
            let peer = Peer { addr, tls: false };
            let gateway = gateway.clone();
            let service = service_fn(move |request| {
                let gateway = gateway.clone();
                async move { Ok::<_, Infallible>(gateway.handle(request, peer).await) }
            });
            let connection = builder.serve_connection(TokioIo::new(stream), service).into_owned();
            let connection = graceful.watch(connection);
            tokio::spawn(async move {
                if let Err(error) = connection.await {
                    tracing::debug!(%error, "connection ended with an error");
                }
            });
        }

        drop(listener);
        let _ = stop_admin.send(());
        tracing::info!(grace = ?config.server.shutdown_grace, "draining connections");
        tokio::select! {
            () = graceful.shutdown() => tracing::info!("all connections closed"),
            () = tokio::time::sleep(config.server.shutdown_grace) => tracing::warn!("shutdown grace ran out; closing"),
        }
    }
}
