//! The admin listener: `GET /healthz` (process alive), `GET /readyz` (store
//! reachable), `GET /metrics` (Prometheus text).

use std::convert::Infallible;
use std::sync::Arc;

use arc_swap::ArcSwap;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::proxy::{Gateway, ResponseBody};
use crate::telemetry::Metrics;

pub async fn serve(
    listener: TcpListener,
    gateway: Arc<ArcSwap<Gateway>>,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<()>,
) {
    let builder = auto::Builder::new(TokioExecutor::new());
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => continue,
            },
            _ = stop.changed() => return,
        };
        let (gateway, metrics) = (gateway.clone(), metrics.clone());
        let service = service_fn(move |request| {
            let (gateway, metrics) = (gateway.load_full(), metrics.clone());
            async move { Ok::<_, Infallible>(answer(request, &gateway, &metrics).await) }
        });
        let connection = builder.serve_connection(TokioIo::new(stream), service).into_owned();
        tokio::spawn(connection);
    }
}

fn text(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<ResponseBody> {
    let mut response = Response::new(ResponseBody::full(body.into()));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

async fn answer(request: Request<Incoming>, gateway: &Gateway, metrics: &Metrics) -> Response<ResponseBody> {
    const PLAIN: &str = "text/plain; charset=utf-8";
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, PLAIN, "GET only\n");
    }
    match request.uri().path() {
        "/healthz" => text(StatusCode::OK, PLAIN, "ok\n"),
        "/readyz" => match gateway.store().ping().await {
            Ok(()) => text(StatusCode::OK, PLAIN, "ready\n"),
            Err(error) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                PLAIN,
                format!("store unavailable: {error}\n"),
            ),
        },
        "/metrics" => text(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            metrics.render(gateway.store().stored_bytes()),
        ),
        _ => text(
            StatusCode::NOT_FOUND,
            PLAIN,
            "not found: try /healthz, /readyz or /metrics\n",
        ),
    }
}
