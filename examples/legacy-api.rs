//! A sample non-idempotent "legacy API" to try idemgate against.
//!
//!     cargo run --release --example legacy-api   # listens on 127.0.0.1:3000
//!
//! - `POST /v1/orders` creates a new order every time it is called (201),
//!   after `?delay_ms=N` milliseconds if asked, so a lost answer is easy to
//!   simulate with `curl --max-time`.
//! - `PATCH /v1/orders/{id}` appends the body to the order's history.
//! - `POST /api/incidents` opens a new ticket every time.
//! - `GET /v1/orders` lists every order: count the duplicates.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

#[derive(Default)]
struct Books {
    orders: Vec<String>,
    tickets: u64,
}

fn json(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    response
}

async fn handle(request: Request<Incoming>, books: Arc<Mutex<Books>>) -> Response<Full<Bytes>> {
    let delay = request
        .uri()
        .query()
        .and_then(|q| q.split('&').find_map(|p| p.strip_prefix("delay_ms=")))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    let key = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_string();
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let body = request
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let body = String::from_utf8_lossy(&body).into_owned();
    tokio::time::sleep(Duration::from_millis(delay)).await;
    let mut books = books.lock().unwrap();
    match (method, path.as_str()) {
        (Method::POST, "/v1/orders") => {
            books.orders.push(body.clone());
            let id = books.orders.len();
            println!("created order {id} (key {key})");
            json(
                StatusCode::CREATED,
                format!("{{\"order_id\":{id},\"request\":{body:?}}}"),
            )
        }
        (Method::GET, "/v1/orders") => {
            let list: Vec<String> = books.orders.iter().map(|o| format!("{o:?}")).collect();
            json(
                StatusCode::OK,
                format!("{{\"count\":{},\"orders\":[{}]}}", list.len(), list.join(",")),
            )
        }
        (Method::PATCH, p) if p.starts_with("/v1/orders/") => {
            let id: usize = p["/v1/orders/".len()..].parse().unwrap_or(0);
            match books.orders.get_mut(id.wrapping_sub(1)) {
                Some(order) => {
                    order.push_str(&body);
                    json(StatusCode::OK, format!("{{\"order_id\":{id},\"updated\":true}}"))
                }
                None => json(StatusCode::NOT_FOUND, "{\"error\":\"no such order\"}".into()),
            }
        }
        (Method::POST, "/api/incidents") => {
            books.tickets += 1;
            println!("opened ticket {} (key {key})", books.tickets);
            json(StatusCode::CREATED, format!("{{\"ticket\":{}}}", books.tickets))
        }
        _ => json(StatusCode::NOT_FOUND, "{\"error\":\"not found\"}".into()),
    }
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let addr = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:3000".into());
    let listener = TcpListener::bind(&addr).await?;
    println!("legacy API on http://{addr} (not idempotent: every POST creates something)");
    let books = Arc::new(Mutex::new(Books::default()));
    loop {
        let (stream, _) = listener.accept().await?;
        let books = books.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let books = books.clone();
                async move { Ok::<_, Infallible>(handle(request, books).await) }
            });
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
