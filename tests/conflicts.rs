//! Refusals: invalid and missing keys, reused keys, requests in flight,
//! waiting, oversized bodies.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::{Proxy, Reply, TestClient, Upstream};

const ROUTES: &str = r#"
[[route]]
name = "orders"
path = "/v1/orders"
key = { max_length = 8 }
"#;

#[tokio::test]
async fn invalid_keys_get_400_key_invalid_and_reach_nothing() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(&upstream.url(), ROUTES).await;
    let client = TestClient::default();
    let url = proxy.url("/v1/orders");
    let cases: Vec<Vec<(&str, &str)>> = vec![
        vec![("idempotency-key", "")],
        vec![("idempotency-key", "\"\"")],
        vec![("idempotency-key", "123456789")],
        vec![("idempotency-key", "\"123456789\"")],
        vec![("idempotency-key", "a b")],
        vec![("idempotency-key", "\"unterminated")],
        vec![("idempotency-key", "same"), ("idempotency-key", "same")],
    ];
    for headers in cases {
        let answer = client.send("POST", &url, &headers, "{}").await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{headers:?}");
        assert_eq!(answer.problem(), "key-invalid", "{headers:?}");
    }
    // max_length is inclusive.
    let eight = client
        .send("POST", &url, &[("idempotency-key", "12345678")], "{}")
        .await;
    assert_eq!(eight.status, StatusCode::CREATED);
    let quoted = client
        .send("POST", &url, &[("idempotency-key", "\"abcdefgh\"")], "{}")
        .await;
    assert_eq!(quoted.status, StatusCode::CREATED);
    assert_eq!(upstream.hits(), 2);
    let metrics = proxy.metrics.render(None);
    assert!(
        metrics.contains(r#"idemgate_requests_total{route="orders",outcome="key_invalid"} 7"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_missing_key_is_400_unless_the_route_does_not_require_one() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[[route]]
name = "strict"
path = "/strict"
[[route]]
name = "lenient"
path = "/lenient"
key = { required = false }
"#,
    )
    .await;
    let client = TestClient::default();
    let strict = client.send("POST", &proxy.url("/strict"), &[], "{}").await;
    assert_eq!(strict.status, StatusCode::BAD_REQUEST);
    assert_eq!(strict.problem(), "key-missing");
    assert_eq!(upstream.hits(), 0);
    for _ in 0..2 {
        let lenient = client.send("POST", &proxy.url("/lenient"), &[], "{}").await;
        assert_eq!(lenient.status, StatusCode::CREATED);
        assert!(!lenient.replayed());
    }
    assert_eq!(upstream.hits(), 2, "without a key, every request is forwarded");
}

#[tokio::test]
async fn a_key_reused_for_another_request_gets_422() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(&upstream.url(), ROUTES).await;
    let client = TestClient::default();
    let url = proxy.url("/v1/orders");
    assert_eq!(client.post(&url, "k", r#"{"sku":1}"#).await.status, StatusCode::CREATED);
    let reused = client.post(&url, "k", r#"{"sku":2}"#).await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(reused.problem(), "key-reused");
    // The fingerprint covers the query and the listed headers too.
    let query = client.post(&format!("{url}?x=1"), "k", r#"{"sku":1}"#).await;
    assert_eq!(query.problem(), "key-reused");
    let content_type = client
        .send(
            "POST",
            &url,
            &[("idempotency-key", "k"), ("content-type", "text/plain")],
            r#"{"sku":1}"#,
        )
        .await;
    assert_eq!(content_type.problem(), "key-reused");
    assert_eq!(upstream.hits(), 1);
}

/// Two routes told apart only by `host` front two backends: the same key
/// and body sent to the second is another request (422), never the first
/// backend's answer replayed; a route without `host` keeps one record
/// whatever name a client reaches it by.
#[tokio::test]
async fn a_key_reused_on_another_hosts_route_gets_422_not_its_answer() {
    let first = Upstream::start(|_, _| Reply::status(201, "first backend")).await;
    let second = Upstream::start(|_, _| Reply::status(201, "second backend")).await;
    let proxy = Proxy::start(
        &second.url(),
        &format!(
            "[[route]]\nname = \"a\"\npath = \"/v1/orders\"\nhost = \"a.example\"\nupstream = \"{}\"\n\
             [[route]]\nname = \"any\"\npath = \"/v1/orders\"\n",
            first.url()
        ),
    )
    .await;
    let client = TestClient::default();
    let url = proxy.url("/v1/orders");
    let post = |host: &'static str, key: &'static str| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let headers = [
                ("host", host),
                ("idempotency-key", key),
                ("content-type", "application/json"),
            ];
            client.send("POST", &url, &headers, "{}").await
        }
    };
    assert_eq!(post("a.example", "k").await.text(), "first backend");
    let other = post("b.example", "k").await;
    assert_eq!(other.problem(), "key-reused", "{}", other.text());
    assert!(post("A.Example.", "k").await.replayed());
    assert_eq!((first.hits(), second.hits()), (1, 0));
    // The host-less route: one record, whichever name reached it.
    assert_eq!(post("b.example", "m").await.text(), "second backend");
    let again = post("c.example", "m").await;
    assert!(again.replayed(), "{}", again.text());
    assert_eq!((first.hits(), second.hits()), (1, 1));
}

/// A JSON body whose object names a member twice is not canonicalized
/// (which member a backend reads is its own choice): it is fingerprinted
/// by its bytes, so it never passes for the body with one of the two.
#[tokio::test]
async fn json_with_a_member_named_twice_is_fingerprinted_as_sent() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(
        &upstream.url(),
        "[[route]]\nname = \"pay\"\npath = \"/pay\"\nfingerprint = { body = \"json\" }\n",
    )
    .await;
    let client = TestClient::default();
    let url = proxy.url("/pay");
    assert_eq!(
        client.post(&url, "p", r#"{"amount":100}"#).await.status,
        StatusCode::CREATED
    );
    // Canonical JSON still matches across spacing and member order.
    assert!(client.post(&url, "p", r#"{ "amount" : 100 }"#).await.replayed());
    let twice = client.post(&url, "p", r#"{"amount":1,"amount":100}"#).await;
    assert_eq!(twice.problem(), "key-reused");
    // The same bytes again are the same request.
    let dup = r#"{"amount":1,"amount":100}"#;
    assert_eq!(client.post(&url, "q", dup).await.status, StatusCode::CREATED);
    assert!(client.post(&url, "q", dup).await.replayed());
    assert_eq!(upstream.hits(), 2);
}

#[tokio::test]
async fn a_key_reused_while_in_flight_gets_422_and_the_same_request_409() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_millis(1500))).await;
    let proxy = Proxy::start(&upstream.url(), ROUTES).await;
    let client = TestClient::default();
    let url = proxy.url("/v1/orders");
    let first = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move { client.post(&url, "k", r#"{"sku":1}"#).await }
    });
    upstream.reached(1).await;
    let same = client.post(&url, "k", r#"{"sku":1}"#).await;
    assert_eq!(same.status, StatusCode::CONFLICT);
    assert_eq!(same.problem(), "request-in-flight");
    assert_eq!(same.header("retry-after"), Some("1"));
    let different = client.post(&url, "k", r#"{"sku":2}"#).await;
    assert_eq!(different.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn wait_mode_gives_twenty_concurrent_requests_one_identical_answer() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_millis(300))).await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[[route]]
name = "orders"
path = "/v1/orders"
on_in_flight = "wait"
wait_timeout = "5s"
"#,
    )
    .await;
    let client = TestClient::default();
    let url = proxy.url("/v1/orders");
    let started = tokio::time::Instant::now();
    let all: Vec<_> = (0..20)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move { client.post(&url, "wait", "{}").await })
        })
        .collect();
    let mut replayed = 0;
    for answer in all {
        let answer = answer.await.unwrap();
        assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.text());
        assert_eq!(answer.text(), r#"{"order":1}"#);
        replayed += answer.replayed() as usize;
    }
    assert_eq!(replayed, 19);
    assert_eq!(upstream.hits(), 1);
    // Woken by the completion, not by a poll interval or the timeout.
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
}

#[tokio::test]
async fn wait_mode_gives_up_with_409_after_wait_timeout() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_millis(2500))).await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[[route]]
name = "orders"
path = "/v1/orders"
on_in_flight = "wait"
wait_timeout = "300ms"
"#,
    )
    .await;
    let client = TestClient::default();
    let url = proxy.url("/v1/orders");
    let first = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move { client.post(&url, "slow", "{}").await }
    });
    upstream.reached(1).await;
    let started = tokio::time::Instant::now();
    let waiter = client.post(&url, "slow", "{}").await;
    assert_eq!(waiter.status, StatusCode::CONFLICT);
    assert_eq!(waiter.problem(), "request-in-flight");
    assert!(started.elapsed() >= Duration::from_millis(250));
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
}

#[tokio::test]
async fn oversized_bodies_get_413_whether_declared_or_streamed() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[server]
max_request_body = "1KiB"
[[route]]
name = "orders"
path = "/v1/orders"
"#,
    )
    .await;
    let client = TestClient::default();
    let url = proxy.url("/v1/orders");
    let exact = "x".repeat(1024);
    assert_eq!(client.post(&url, "fits", &exact).await.status, StatusCode::CREATED);
    let over = "x".repeat(1025);
    let declared = client.post(&url, "big", &over).await;
    assert_eq!(declared.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(declared.problem(), "body-too-large");

    // Chunked, no Content-Length: the limit holds while reading.
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let chunk = "y".repeat(800);
    let request = format!(
        "POST /v1/orders HTTP/1.1\r\nhost: x\r\nidempotency-key: chunked\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n{:x}\r\n{chunk}\r\n{:x}\r\n{chunk}\r\n0\r\n\r\n",
        chunk.len(),
        chunk.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response).await;
    assert!(response.starts_with("HTTP/1.1 413"), "{response}");
    assert!(response.contains("body-too-large"));
    assert_eq!(upstream.hits(), 1);
}
