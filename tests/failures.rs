//! Failures: SPEC §3 points 5 and 6. Every exit path settles the claim.

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use idemgate::store::{Claim, Fingerprint, MemoryStore, Owner, RecordKey, StoreHandle};
use support::{Proxy, Reply, TestClient, Upstream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn route(extra: &str) -> String {
    format!(
        r#"
[upstream]
timeout = "400ms"
[[route]]
name = "orders"
path = "/v1/orders"
{extra}
"#
    )
}

#[tokio::test]
async fn an_unreachable_upstream_is_502_and_the_claim_is_released() {
    let url = support::unreachable_url();
    // Even with "unknown": the request was never sent.
    let proxy = Proxy::start(&url, &route(r#"on_upstream_failure = "unknown""#)).await;
    let client = TestClient::default();
    for _ in 0..2 {
        let answer = client.post(&proxy.url("/v1/orders"), "k", "{}").await;
        assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
        assert_eq!(answer.problem(), "upstream-unavailable");
    }
}

#[tokio::test]
async fn a_timeout_is_504_and_release_lets_the_retry_run_again() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_secs(2))).await;
    let proxy = Proxy::start(&upstream.url(), &route("")).await;
    let client = TestClient::default();
    for hit in 1..=2 {
        let answer = client.post(&proxy.url("/v1/orders"), "k", "{}").await;
        assert_eq!(answer.status, StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(answer.problem(), "upstream-timeout");
        assert_eq!(upstream.hits(), hit);
    }
}

#[tokio::test]
async fn with_unknown_a_timeout_keeps_the_key_and_retries_get_outcome_unknown() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_secs(2))).await;
    let proxy = Proxy::start(&upstream.url(), &route(r#"on_upstream_failure = "unknown""#)).await;
    let client = TestClient::default();
    let first = client.post(&proxy.url("/v1/orders"), "k", "{}").await;
    assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT);
    for _ in 0..3 {
        let retry = client.post(&proxy.url("/v1/orders"), "k", "{}").await;
        assert_eq!(retry.status, StatusCode::BAD_GATEWAY);
        assert_eq!(retry.problem(), "outcome-unknown");
    }
    assert_eq!(upstream.hits(), 1, "at most once");
}

#[tokio::test]
async fn a_reset_after_sending_follows_on_upstream_failure() {
    let upstream = Upstream::start(|_, _| Reply::Reset {
        delay: Duration::from_millis(20),
    })
    .await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[[route]]
name = "release"
path = "/release"
[[route]]
name = "unknown"
path = "/unknown"
on_upstream_failure = "unknown"
"#,
    )
    .await;
    let client = TestClient::default();
    for _ in 0..2 {
        let answer = client.post(&proxy.url("/release"), "a", "{}").await;
        assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
        assert_eq!(answer.problem(), "upstream-unavailable");
    }
    assert_eq!(upstream.hits(), 2);
    for _ in 0..2 {
        let answer = client.post(&proxy.url("/unknown"), "b", "{}").await;
        assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
        assert_eq!(answer.problem(), "outcome-unknown");
    }
    assert_eq!(upstream.hits(), 3);
}

/// POSTs with `key` to `url`: the answer's status, and whether its body
/// came whole.
async fn post_to_the_end(url: &str, key: &str) -> (StatusCode, bool) {
    use http_body_util::BodyExt;
    let client: hyper_util::client::legacy::Client<_, http_body_util::Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
    let request = http::Request::post(url)
        .header("idempotency-key", key)
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let status = response.status();
    (status, response.into_body().collect().await.is_ok())
}

/// An answer whose head said the backend acted (a 201) and whose body then
/// breaks off is not recorded, and the client sees the break; its key is
/// kept as an unknown outcome, even where `on_upstream_failure =
/// "release"`: released, every retry would run the request again.
#[tokio::test]
async fn a_body_that_breaks_off_after_its_head_keeps_the_key_as_unknown() {
    let upstream = Upstream::start(|_, _| Reply::BreakOff(StatusCode::CREATED)).await;
    let proxy = Proxy::start(&upstream.url(), &route("")).await;
    let (status, whole) = post_to_the_end(&proxy.url("/v1/orders"), "broken").await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(!whole, "a truncated body must not look whole");
    tokio::time::sleep(Duration::from_millis(50)).await;
    // (502 `outcome-unknown`: the backend is not called again.)
    for _ in 0..2 {
        let (retry, _) = post_to_the_end(&proxy.url("/v1/orders"), "broken").await;
        assert_eq!(retry, StatusCode::BAD_GATEWAY);
    }
    assert_eq!(upstream.hits(), 1);
}

/// An answer never recorded (a 429, a 5xx that `on_server_error`
/// releases) whose body breaks off is released too, even where
/// `on_upstream_failure = "unknown"`: its head said the backend did not
/// act, or that the retry may run, and the key must not be locked for its
/// TTL as an unknown outcome.
#[tokio::test]
async fn a_refusal_that_breaks_off_is_released_even_where_outcomes_are_kept_unknown() {
    let upstream = Upstream::start(|hit, _| match hit {
        1 => Reply::BreakOff(StatusCode::TOO_MANY_REQUESTS),
        2 => Reply::BreakOff(StatusCode::SERVICE_UNAVAILABLE),
        _ => Reply::created(hit),
    })
    .await;
    let proxy = Proxy::start(&upstream.url(), &route("on_upstream_failure = \"unknown\"")).await;
    for (hit, refused) in [(1, StatusCode::TOO_MANY_REQUESTS), (2, StatusCode::SERVICE_UNAVAILABLE)] {
        let (status, whole) = post_to_the_end(&proxy.url("/v1/orders"), "refused").await;
        assert_eq!((status, whole), (refused, false));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(upstream.hits(), hit);
    }
    let created = TestClient::default()
        .post(&proxy.url("/v1/orders"), "refused", "")
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    assert_eq!(upstream.hits(), 3);
}

#[tokio::test]
async fn server_errors_are_released_or_stored_per_on_server_error() {
    let upstream = Upstream::start(|hit, _| Reply::status(503, &format!("busy {hit}"))).await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[[route]]
name = "release"
path = "/release"
[[route]]
name = "store"
path = "/store"
on_server_error = "store"
"#,
    )
    .await;
    let client = TestClient::default();
    assert_eq!(client.post(&proxy.url("/release"), "a", "").await.text(), "busy 1");
    assert_eq!(client.post(&proxy.url("/release"), "a", "").await.text(), "busy 2");
    assert_eq!(client.post(&proxy.url("/store"), "b", "").await.text(), "busy 3");
    let replay = client.post(&proxy.url("/store"), "b", "").await;
    assert_eq!(replay.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(replay.replayed());
    assert_eq!(replay.text(), "busy 3");
    assert_eq!(upstream.hits(), 3);
}

#[tokio::test]
async fn answers_that_ask_for_a_retry_later_are_never_replayed() {
    // Each refusal once, then the order is made.
    let upstream = Upstream::start(|hit, _| match hit {
        1 => Reply::status(429, "slow down"),
        3 => Reply::status(408, "too slow"),
        5 => Reply::status(425, "too early"),
        _ => Reply::created(hit),
    })
    .await;
    let proxy = Proxy::start(&upstream.url(), &route("on_server_error = \"store\"")).await;
    let client = TestClient::default();
    for (key, refused) in [("a", 429), ("b", 408), ("c", 425)] {
        let first = client.post(&proxy.url("/v1/orders"), key, "").await;
        assert_eq!(first.status, refused);
        assert!(!first.replayed());
        let retry = client.post(&proxy.url("/v1/orders"), key, "").await;
        assert_eq!(retry.status, StatusCode::CREATED, "{key}: {}", retry.text());
        assert!(!retry.replayed(), "{key}: the retry reached the backend");
        assert!(client.post(&proxy.url("/v1/orders"), key, "").await.replayed());
    }
    assert_eq!(upstream.hits(), 6);
}

#[tokio::test]
async fn a_fail_once_backend_is_retried_then_replayed() {
    let upstream = Upstream::start(|hit, _| {
        if hit == 1 {
            Reply::status(500, "oops")
        } else {
            Reply::created(hit)
        }
    })
    .await;
    let proxy = Proxy::start(&upstream.url(), &route("")).await;
    let client = TestClient::default();
    assert_eq!(client.post(&proxy.url("/v1/orders"), "k", "").await.status, 500);
    assert_eq!(client.post(&proxy.url("/v1/orders"), "k", "").await.status, 201);
    assert!(client.post(&proxy.url("/v1/orders"), "k", "").await.replayed());
    assert_eq!(upstream.hits(), 2);
}

#[tokio::test]
async fn a_slow_request_renews_its_lease_and_keeps_its_claim() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_secs(5))).await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[upstream]
timeout = "10s"
[[route]]
name = "orders"
path = "/v1/orders"
lock_timeout = "2s"
"#,
    )
    .await;
    let client = TestClient::default();
    let url = proxy.url("/v1/orders");
    let first = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move { client.post(&url, "slow", "{}").await }
    });
    // Retries 1.25 s and 2.5 s after the claim (made before the upstream
    // has the request), the second past the first lease.
    upstream.reached(1).await;
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(1250)).await;
        let retry = client.post(&url, "slow", "{}").await;
        assert_eq!(
            retry.status,
            StatusCode::CONFLICT,
            "the lease ran out under a live request"
        );
    }
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert!(client.post(&url, "slow", "{}").await.replayed());
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn a_client_that_hangs_up_mid_request_loses_no_record_and_leaves_no_claim() {
    let upstream = Upstream::start(|hit, _| Reply::Answer {
        delay: Duration::from_millis(300),
        status: StatusCode::CREATED,
        headers: vec![],
        chunks: vec![Bytes::from(format!("order {hit};")), Bytes::from_static(b" done")],
        gap: Duration::from_millis(300),
    })
    .await;
    let proxy = Proxy::start(&upstream.url(), support::ORDERS).await;

    // Hang up before the head, and hang up after the first chunk.
    for (key, wait) in [("before-head", 100), ("mid-body", 450)] {
        let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        let request =
            format!("POST /v1/orders HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\ncontent-length: 2\r\n\r\n{{}}");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut buf = [0u8; 256];
        let _ = tokio::time::timeout(Duration::from_millis(wait), stream.read(&mut buf)).await;
        drop(stream);
    }
    let client = TestClient::default();
    // 409 while the exchange the client left still runs (under a second).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    for (key, hit) in [("before-head", 1), ("mid-body", 2)] {
        let retry = loop {
            let retry = client
                .send("POST", &proxy.url("/v1/orders"), &[("idempotency-key", key)], "{}")
                .await;
            if retry.status != StatusCode::CONFLICT {
                break retry;
            }
            assert!(tokio::time::Instant::now() < deadline, "{key}: still in flight");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(retry.status, StatusCode::CREATED, "{key}: {}", retry.text());
        assert!(retry.replayed(), "{key}");
        assert_eq!(retry.text(), format!("order {hit}; done"));
    }
    assert_eq!(upstream.hits(), 2);
}

#[tokio::test]
async fn a_response_over_max_response_body_is_delivered_but_not_replayable() {
    let big = "z".repeat(3000);
    let upstream = Upstream::start(move |_, _| Reply::status(201, &big)).await;
    let proxy = Proxy::start(&upstream.url(), &route(r#"max_response_body = "2KiB""#)).await;
    let client = TestClient::default();
    let first = client.post(&proxy.url("/v1/orders"), "big", "").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body.len(), 3000);
    let retry = client.post(&proxy.url("/v1/orders"), "big", "").await;
    assert_eq!(retry.problem(), "response-not-replayable");
    assert_eq!(upstream.hits(), 1, "the backend is not called again");
}

#[tokio::test]
async fn the_lease_of_a_crashed_proxy_runs_out_and_frees_the_key() {
    let upstream = Upstream::created().await;
    let store = StoreHandle::new(Arc::new(MemoryStore::new(1 << 20)), Duration::from_secs(1));
    let proxy = Proxy::start_with_store(&upstream.url(), &route(""), store.clone()).await;
    let client = TestClient::default();
    // The fingerprint the proxy will compute is unknown here, so claim with
    // a foreign fingerprint: the live claim answers 422, the expired one
    // does not exist any more.
    let scope_free_key = {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(b"idemgate-record-v1");
        h.update([0u8, 2u8]);
        h.update(7u64.to_be_bytes());
        h.update(b"crashed");
        RecordKey(h.finalize().into())
    };
    let claim = store
        .claim(
            &scope_free_key,
            &Fingerprint([9; 32]),
            Owner::new(),
            Duration::from_millis(1500),
            None,
        )
        .await
        .unwrap();
    assert_eq!(claim, Claim::Claimed);
    let held = client.post(&proxy.url("/v1/orders"), "crashed", "{}").await;
    assert_eq!(held.problem(), "key-reused", "the dead proxy's claim is still held");
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let freed = client.post(&proxy.url("/v1/orders"), "crashed", "{}").await;
    assert_eq!(freed.status, StatusCode::CREATED);
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn a_client_that_stops_reading_is_cut_off_and_the_record_still_completes() {
    const CHUNKS: usize = 256;
    let upstream = Upstream::start(|_, _| Reply::Answer {
        delay: Duration::ZERO,
        status: StatusCode::CREATED,
        headers: vec![],
        chunks: (0..CHUNKS)
            .map(|i| Bytes::from(vec![b'a' + (i % 26) as u8; 32 * 1024]))
            .collect(),
        gap: Duration::from_millis(1),
    })
    .await;
    let proxy = Proxy::start(
        &upstream.url(),
        "[server]\nheader_read_timeout = \"500ms\"\n[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\nmax_response_body = \"16MiB\"\n",
    )
    .await;
    // Sends its request, then never reads a byte of the 8 MiB answer.
    let mut stalled = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    stalled
        .write_all(b"POST /v1/orders HTTP/1.1\r\nhost: x\r\nidempotency-key: stall\r\ncontent-length: 0\r\n\r\n")
        .await
        .unwrap();
    let client = TestClient::default();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let retry = client
            .send("POST", &proxy.url("/v1/orders"), &[("idempotency-key", "stall")], "")
            .await;
        if retry.replayed() {
            assert_eq!(retry.body.len(), CHUNKS * 32 * 1024);
            break;
        }
        assert_eq!(retry.status, StatusCode::CONFLICT);
        assert!(tokio::time::Instant::now() < deadline, "a stalled client held the key");
    }
    assert_eq!(upstream.hits(), 1);
    drop(stalled);
}

#[tokio::test]
async fn a_slow_client_does_not_use_up_the_upstreams_time() {
    // 16 MiB at once, more than the sockets and the frame queue hold, then
    // the end of the body 300 ms after the proxy has taken the rest.
    const BIG: usize = 16 << 20;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = hits.clone();
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                if !read_request_head(&mut socket).await {
                    return;
                }
                let start = format!("HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\n\r\n{BIG:x}\r\n");
                socket.write_all(start.as_bytes()).await.unwrap();
                socket.write_all(&vec![b'x'; BIG]).await.unwrap();
                socket.write_all(b"\r\n").await.unwrap();
                tokio::time::sleep(Duration::from_millis(300)).await;
                socket.write_all(b"3\r\nend\r\n0\r\n\r\n").await.unwrap();
                let _ = socket.read(&mut [0; 64]).await;
            });
        }
    });
    let proxy = Proxy::start(
        &url,
        "[server]\nheader_read_timeout = \"6s\"\n[upstream]\ntimeout = \"3s\"\n[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\nmax_response_body = \"32MiB\"\n",
    )
    .await;

    // A client that takes the head, then pauses 3.5 s (past the upstream's
    // 3 s, within its own 6 s per frame) before it reads the body.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(64 * 1024).unwrap();
    let mut slow = socket.connect(proxy.addr).await.unwrap();
    slow.write_all(b"POST /v1/orders HTTP/1.1\r\nhost: x\r\nidempotency-key: slow\r\ncontent-length: 0\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let mut buf = vec![0; 64 * 1024];
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = slow.read(&mut buf).await.unwrap();
        assert!(n > 0, "the connection closed before the head");
        answer.extend_from_slice(&buf[..n]);
    }
    assert!(
        answer.starts_with(b"HTTP/1.1 201"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let read_all = async {
        loop {
            match slow.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
            if answer.ends_with(b"\r\n0\r\n\r\n") {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read_all).await.unwrap();
    assert!(
        answer.ends_with(b"\r\n0\r\n\r\n"),
        "the body was cut off after {} bytes: {:?}",
        answer.len(),
        String::from_utf8_lossy(&answer[answer.len().saturating_sub(40)..])
    );

    // The record was completed, not failed as an upstream timeout: a retry
    // is the replay, and the upstream saw one request.
    let retry = TestClient::default()
        .send("POST", &proxy.url("/v1/orders"), &[("idempotency-key", "slow")], "")
        .await;
    assert!(retry.replayed(), "{:?}", retry.status);
    assert_eq!(retry.body.len(), BIG + 3);
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_cut_off_answer_to_http_1_0_ends_in_a_reset_not_a_clean_close() {
    // Chunked, so the answer to an HTTP/1.0 client has no length and only
    // the close ends it; the upstream breaks off in the middle.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                if !read_request_head(&mut socket).await {
                    return;
                }
                let _ = socket
                    .write_all(b"HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
                    .await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            });
        }
    });
    let proxy = Proxy::start(&url, "[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\n").await;

    let mut client = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    client
        .write_all(b"POST /v1/orders HTTP/1.0\r\nidempotency-key: ten\r\ncontent-length: 0\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let mut buf = [0; 4096];
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match client.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(n) => answer.extend_from_slice(&buf[..n]),
                Err(error) => return Err(error),
            }
        }
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&answer).into_owned();
    assert!(text.starts_with("HTTP/1.1 201"), "{text}");
    assert!(!text.to_lowercase().contains("content-length"), "{text}");
    let error = ended.expect_err("a clean close after a cut-off body looks complete");
    assert_eq!(error.kind(), std::io::ErrorKind::ConnectionReset, "{error}");
}

/// Reads a request's head off `socket` (a raw upstream's); false when the
/// connection closed first.
async fn read_request_head(socket: &mut tokio::net::TcpStream) -> bool {
    let mut head = Vec::new();
    let mut buf = [0; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match socket.read(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    true
}
