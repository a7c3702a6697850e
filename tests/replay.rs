//! Forwarding, recording and replaying: SPEC §3 points 1–5.

mod support;

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use support::{Proxy, Reply, TestClient, Upstream};

const ROUTES: &str = r#"
[[route]]
name = "orders"
path = "/v1/orders"
"#;

#[tokio::test]
async fn a_retry_replays_the_first_answer_without_calling_the_backend() {
    let upstream = Upstream::start(|hit, _| match Reply::created(hit) {
        Reply::Answer {
            status,
            mut headers,
            chunks,
            ..
        } => {
            headers.push(("set-cookie", "session=secret".into()));
            headers.push(("x-request-id", format!("req-{hit}")));
            Reply::Answer {
                delay: Duration::ZERO,
                status,
                headers,
                chunks,
                gap: Duration::ZERO,
            }
        }
        other => other,
    })
    .await;
    let proxy = Proxy::start(&upstream.url(), ROUTES).await;
    let client = TestClient::default();

    let first = client.post(&proxy.url("/v1/orders"), "k-1", r#"{"sku":1}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(first.header("set-cookie"), Some("session=secret"));

    for _ in 0..3 {
        let again = client.post(&proxy.url("/v1/orders"), "k-1", r#"{"sku":1}"#).await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
        assert_eq!(again.header("x-request-id"), Some("req-1"));
        assert_eq!(again.header("content-type"), Some("application/json"));
        assert_eq!(again.header("set-cookie"), None, "replay_drop_headers");
    }
    assert_eq!(upstream.hits(), 1);

    // A new key is a new request.
    let other = client.post(&proxy.url("/v1/orders"), "k-2", r#"{"sku":1}"#).await;
    assert_eq!(other.text(), r#"{"order":2}"#);
    assert_eq!(upstream.hits(), 2);
}

/// A retry whose client escapes its target otherwise (hex in capitals, an
/// unreserved character escaped) is the same request, replayed; the
/// upstream saw the first target as it was sent.
#[tokio::test]
async fn a_retry_escaped_otherwise_is_replayed() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(&upstream.url(), ROUTES).await;
    let client = TestClient::default();
    let key = [("idempotency-key", "escaped")];
    let first = client
        .send("POST", &proxy.url("/v1/orders?ref=a%c3%a9&to=%7Ebob"), &key, "{}")
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = client
        .send("POST", &proxy.url("/v1/orders?ref=a%C3%A9&to=~bob"), &key, "{}")
        .await;
    assert!(retry.replayed(), "{}", retry.status);
    let other = client
        .send("POST", &proxy.url("/v1/orders?ref=a%C3%A9&to=%2Bbob"), &key, "{}")
        .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(upstream.hits(), 1);
    assert_eq!(upstream.seen()[0].uri, "/v1/orders?ref=a%c3%a9&to=%7Ebob");
}

#[tokio::test]
async fn the_key_is_forwarded_under_forward_key_header() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[defaults]
forward_key_header = "X-Request-Key"
[[route]]
name = "orders"
path = "/v1/orders"
[[route]]
name = "quiet"
path = "/v1/quiet"
forward_key_header = ""
"#,
    )
    .await;
    let client = TestClient::default();
    client
        .send("POST", &proxy.url("/v1/orders"), &[("idempotency-key", "\"abc\"")], "")
        .await;
    client
        .send("POST", &proxy.url("/v1/quiet"), &[("idempotency-key", "def")], "")
        .await;
    let seen = upstream.seen();
    assert_eq!(
        seen[0].headers.get("x-request-key").unwrap(),
        "abc",
        "sf-string unwrapped"
    );
    assert!(seen[0].headers.get("idempotency-key").is_none());
    assert!(seen[1].headers.get("x-request-key").is_none());
    assert!(seen[1].headers.get("idempotency-key").is_none());
}

/// What shadow mode forwards though enforce would not (a retry, a key
/// reused) and what a store that is down lets past with `on_error =
/// "pass"` carry the key as a claimed request does: under
/// `forward_key_header`, or not at all (a body too large to buffer
/// too); and, as there, a `Connection` that names that header drops
/// what the client sent under it, not the key put in its place.
#[tokio::test]
async fn forwards_without_a_claim_carry_the_key_under_forward_key_header_too() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[server]
max_request_body = "1KiB"
[defaults]
forward_key_header = "X-Request-Key"
mode = "shadow"
[[route]]
name = "orders"
path = "/v1/orders"
"#,
    )
    .await;
    let client = TestClient::default();
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(2048));
    for body in ["{}", "{}", "{\"other\":1}", &big] {
        let headers = [("idempotency-key", "abc"), ("connection", "x-request-key")];
        client.send("POST", &proxy.url("/v1/orders"), &headers, body).await;
    }
    for (i, seen) in upstream.seen().iter().enumerate() {
        assert_eq!(seen.headers.get("x-request-key").unwrap(), "abc", "request {i}");
        assert!(seen.headers.get("idempotency-key").is_none(), "request {i}");
    }
    assert_eq!(upstream.hits(), 4);

    let store = support::redis::redis_store(&support::unreachable_url().replace("http", "redis"));
    let toml = "[store]\non_error = \"pass\"\n[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\nforward_key_header = \"\"\n";
    let passing = Proxy::start_with_store(&upstream.url(), toml, store).await;
    let answer = client.post(&passing.url("/v1/orders"), "def", "{}").await;
    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.text());
    let seen = upstream.seen();
    assert!(seen[4].headers.get("idempotency-key").is_none());
}

#[tokio::test]
async fn scope_keeps_clients_apart() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(&upstream.url(), ROUTES).await;
    let client = TestClient::default();
    let url = proxy.url("/v1/orders");
    let send = |auth: &'static str| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            client
                .send(
                    "POST",
                    &url,
                    &[("idempotency-key", "same"), ("authorization", auth)],
                    "{}",
                )
                .await
        }
    };
    let alice = send("Bearer alice").await;
    let bob = send("Bearer bob").await;
    assert!(!bob.replayed(), "bob must never see alice's answer");
    assert_ne!(alice.body, bob.body);
    assert!(send("Bearer alice").await.replayed());
    assert_eq!(upstream.hits(), 2);
}

#[tokio::test]
async fn a_storm_of_fifty_reaches_the_backend_once() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_millis(200))).await;
    let proxy = Proxy::start(&upstream.url(), ROUTES).await;
    let client = TestClient::default();
    let url = proxy.url("/v1/orders");
    let storm: Vec<_> = (0..50)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move { client.post(&url, "storm", r#"{"sku":7}"#).await })
        })
        .collect();
    let mut created = 0;
    for answer in storm {
        let answer = answer.await.unwrap();
        match answer.status {
            StatusCode::CREATED => {
                created += 1;
                assert_eq!(answer.text(), r#"{"order":1}"#);
            }
            StatusCode::CONFLICT => {
                assert_eq!(answer.problem(), "request-in-flight");
                assert_eq!(answer.header("retry-after"), Some("1"));
            }
            other => panic!("unexpected {other}: {}", answer.text()),
        }
    }
    assert!(created >= 1);
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn a_client_holding_the_whole_answer_always_gets_the_replay() {
    // Streamed in chunks, with Content-Length: the record must be completed
    // before the client can hold the last byte.
    let upstream = Upstream::start(|hit, _| Reply::Answer {
        delay: Duration::ZERO,
        status: StatusCode::CREATED,
        headers: vec![("content-length", "12".into())],
        chunks: vec![
            Bytes::from(format!("{:04}", hit % 10_000)),
            Bytes::from_static(b"abcd"),
            Bytes::from_static(b"efgh"),
        ],
        gap: Duration::from_millis(1),
    })
    .await;
    let proxy = Proxy::start(&upstream.url(), ROUTES).await;
    let client = TestClient::default();
    for i in 0..100 {
        let key = format!("whole-{i}");
        let first = client.post(&proxy.url("/v1/orders"), &key, "{}").await;
        assert_eq!(first.status, StatusCode::CREATED);
        let retry = client.post(&proxy.url("/v1/orders"), &key, "{}").await;
        assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
        assert!(retry.replayed());
        assert_eq!(retry.body, first.body);
    }
    assert_eq!(upstream.hits(), 100);
}

#[tokio::test]
async fn responses_stream_to_the_client_as_they_arrive() {
    use http_body_util::BodyExt;
    let upstream = Upstream::start(|_, _| Reply::Answer {
        delay: Duration::ZERO,
        status: StatusCode::CREATED,
        headers: vec![],
        chunks: vec![Bytes::from_static(b"first,"), Bytes::from_static(b"second")],
        gap: Duration::from_millis(2000),
    })
    .await;
    let proxy = Proxy::start(&upstream.url(), ROUTES).await;
    let client: hyper_util::client::legacy::Client<_, http_body_util::Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
    let request = http::Request::post(proxy.url("/v1/orders"))
        .header("idempotency-key", "stream")
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let started = tokio::time::Instant::now();
    let mut body = client.request(request).await.unwrap().into_body();
    let mut got = Vec::new();
    let mut first_at = None;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            first_at.get_or_insert(started.elapsed());
            got.extend_from_slice(&data);
        }
    }
    assert_eq!(got, b"first,second");
    let first_at = first_at.unwrap();
    assert!(
        first_at < Duration::from_millis(1500),
        "the first chunk waited for the second: {first_at:?}"
    );
    let replay = TestClient::default()
        .send("POST", &proxy.url("/v1/orders"), &[("idempotency-key", "stream")], "")
        .await;
    assert!(replay.replayed());
    assert_eq!(replay.text(), "first,second");
}

#[tokio::test]
async fn empty_bodies_are_recorded_before_the_head_leaves() {
    let upstream = Upstream::start(|_, _| Reply::Answer {
        delay: Duration::ZERO,
        status: StatusCode::NO_CONTENT,
        headers: vec![("x-done", "yes".into())],
        chunks: vec![],
        gap: Duration::ZERO,
    })
    .await;
    let proxy = Proxy::start(&upstream.url(), ROUTES).await;
    let client = TestClient::default();
    for i in 0..30 {
        let key = format!("empty-{i}");
        assert_eq!(client.post(&proxy.url("/v1/orders"), &key, "").await.status, 204);
        let retry = client.post(&proxy.url("/v1/orders"), &key, "").await;
        assert_eq!(retry.status, StatusCode::NO_CONTENT);
        assert!(retry.replayed());
        assert_eq!(retry.header("x-done"), Some("yes"));
    }
    assert_eq!(upstream.hits(), 30);
}

#[tokio::test]
async fn re_fired_incidents_with_new_timestamps_make_one_ticket() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[[route]]
name = "incidents"
path = "/api/incidents"
ttl = "1h"
refresh_ttl_on_replay = true
key = { derive = ["body:/element_id", "body:/fault_class", "body:/root_cause_id"] }
fingerprint = { body = "none" }
"#,
    )
    .await;
    let client = TestClient::default();
    let url = proxy.url("/api/incidents");
    let fire = |ts: &str, seq: u32, element: &str| {
        format!(
            r#"{{"timestamp":"{ts}","sequence_no":{seq},"element_id":"{element}","fault_class":"LOS","root_cause_id":{{"site":"A","card":3}}}}"#
        )
    };
    let headers = [("content-type", "application/json")];
    let first = client
        .send("POST", &url, &headers, &fire("2026-11-30T10:00:00Z", 1, "ne-7"))
        .await;
    // Same fault, new timestamp and sequence number, members reordered.
    let body = r#"{"root_cause_id":{"card":3,"site":"A"},"fault_class":"LOS","element_id":"ne-7","sequence_no":2,"timestamp":"2026-11-30T10:05:00Z"}"#;
    let second = client.send("POST", &url, &headers, body).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    assert_eq!(upstream.hits(), 1, "one ticket");

    // Another element is another incident.
    let other = client
        .send("POST", &url, &headers, &fire("2026-11-30T10:06:00Z", 3, "ne-8"))
        .await;
    assert!(!other.replayed());
    assert_eq!(upstream.hits(), 2);
    let seen = upstream.seen();
    let key_of = |i: usize| {
        seen[i]
            .headers
            .get("idempotency-key")
            .unwrap()
            .to_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(key_of(0).len(), 64, "a SHA-256 hex key is forwarded");
    assert_ne!(key_of(0), key_of(1));

    // A field of the allow-list missing: 400 key-missing, nothing forwarded.
    let missing = client
        .send("POST", &url, &headers, r#"{"element_id":"ne-7","fault_class":"LOS"}"#)
        .await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.problem(), "key-missing");
    assert_eq!(upstream.hits(), 2);
}

#[tokio::test]
async fn derived_keys_are_the_same_for_both_fires_upstream() {
    let upstream = Upstream::start(|hit, _| Reply::status(500, &format!("fail {hit}"))).await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[[route]]
name = "incidents"
path = "/api/{tenant}/incidents"
key = { derive = ["path:tenant", "query:site", "header:x-source", "body:/element_id"] }
fingerprint = { body = "json", ignore = ["/timestamp"] }
"#,
    )
    .await;
    let client = TestClient::default();
    // 500 + on_server_error = "release": each fire reaches the backend, so
    // both forwarded keys can be compared.
    let send = |ts: &str| {
        let (client, url) = (client.clone(), proxy.url("/api/t1/incidents?site=a&x=1"));
        let body = format!(r#"{{"element_id":"e1","timestamp":"{ts}"}}"#);
        async move { client.send("POST", &url, &[("x-source", "nms")], &body).await }
    };
    assert_eq!(send("t1").await.status, 500);
    assert_eq!(send("t2").await.status, 500);
    let seen = upstream.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        seen[0].headers.get("idempotency-key"),
        seen[1].headers.get("idempotency-key")
    );
}

#[tokio::test]
async fn refresh_ttl_on_replay_keeps_a_re_firing_event_deduplicated() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[[route]]
name = "refreshing"
path = "/r"
ttl = "1500ms"
refresh_ttl_on_replay = true
[[route]]
name = "fixed"
path = "/f"
ttl = "1500ms"
"#,
    )
    .await;
    let client = TestClient::default();
    for path in ["/r", "/f"] {
        client.post(&proxy.url(path), path, "").await;
    }
    // Replays every 500 ms for 2 s: the refreshing record never expires,
    // the fixed one does. (Margins of a second for a loaded machine.)
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(client.post(&proxy.url("/r"), "/r", "").await.replayed());
    }
    assert!(!client.post(&proxy.url("/f"), "/f", "").await.replayed());
    assert_eq!(upstream.hits(), 3);
}

/// A retry that comes over the other protocol (a client library or a load
/// balancer that changed its mind) is the same request: a derived key, a
/// JSON fingerprint and a scope header all read alike from HTTP/1.1 and
/// HTTP/2, so it is a replay, not a 422 or a second run.
#[tokio::test]
async fn a_retry_over_http2_replays_an_http1_answer() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[[route]]
name = "derived"
path = "/v1/events"
scope = ["authorization"]
key = { derive = ["body:/id", "header:x-tenant", "query:ref"] }
fingerprint = { body = "json", headers = ["x-tenant"] }
"#,
    )
    .await;
    let url = proxy.url("/v1/events?ref=a%20b");
    let headers = [
        ("authorization", "Bearer t"),
        ("x-tenant", "acme"),
        ("content-type", "application/json"),
    ];
    let first = TestClient::default()
        .send("POST", &url, &headers, r#"{"id":7,"at":1.5e0}"#)
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let mut request = http::Request::post(&url);
    for (name, value) in headers {
        request = request.header(name, value);
    }
    // Another spelling of the same JSON.
    let body = Bytes::from_static(br#"{ "at": 1.5, "id": 7 }"#);
    let response = support::h2_client()
        .request(request.body(http_body_util::Full::new(body)).unwrap())
        .await
        .unwrap();
    assert_eq!(response.version(), http::Version::HTTP_2);
    assert_eq!(response.status(), StatusCode::CREATED);
    assert!(response.headers().contains_key("idempotent-replayed"));
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn http2_clients_are_served_too() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(&upstream.url(), ROUTES).await;
    let client = support::h2_client();
    for expect_replay in [false, true] {
        let request = http::Request::post(proxy.url("/v1/orders"))
            .header("idempotency-key", "h2")
            .body(http_body_util::Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let response = client.request(request).await.unwrap();
        assert_eq!(response.version(), http::Version::HTTP_2);
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(response.headers().contains_key("idempotent-replayed"), expect_replay);
    }
    assert_eq!(upstream.hits(), 1);
}
