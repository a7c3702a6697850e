//! Operations: reload, drain, request logs, metrics.

mod support;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use http::StatusCode;
use support::{Binary, Proxy, Reply, TestClient, Upstream};

/// Everything the tests of this binary log, at debug level.
fn captured() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let sink = logs.clone();
        tracing_subscriber::fmt()
            .with_env_filter("debug")
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .init();
        logs
    })
    .clone()
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn request_logs_name_route_outcome_and_key_hash_but_never_secrets() {
    let logs = captured();
    let upstream = Upstream::start(|hit, _| {
        if hit == 2 {
            Reply::status(500, "boom")
        } else {
            Reply::created(hit)
        }
    })
    .await;
    let proxy = Proxy::start(&upstream.url(), "[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\n").await;
    let client = TestClient::default();
    let secret_key = "key-SECRET-4f1d9a";
    let token = "Bearer TOKEN-7c2e55";
    let body = r#"{"card":"BODY-SECRET-0042"}"#;
    for key in [secret_key, "other-SECRET-key", secret_key] {
        client
            .send(
                "POST",
                &proxy.url("/v1/orders"),
                &[("idempotency-key", key), ("authorization", token)],
                body,
            )
            .await;
    }
    client
        .send("POST", &proxy.url("/v1/orders"), &[("idempotency-key", "")], body)
        .await;
    let text = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    for secret in ["SECRET", "TOKEN-7c2e55"] {
        assert!(!text.contains(secret), "`{secret}` leaked into the logs:\n{text}");
    }
    assert!(
        text.contains("route=\"orders\"") || text.contains("route=orders"),
        "{text}"
    );
    for outcome in ["forwarded", "replayed", "key_invalid"] {
        assert!(
            text.contains(&format!("outcome=\"{outcome}\"")) || text.contains(&format!("outcome={outcome}")),
            "{outcome}: {text}"
        );
    }
    assert!(text.contains("key="), "{text}");
}

#[tokio::test]
async fn a_reload_adds_a_route_and_leaves_requests_in_flight_alone() {
    let _ = captured();
    let upstream = Upstream::start(|hit, seen| {
        if seen.uri.contains("slow") {
            Reply::created(hit).delayed(Duration::from_millis(500))
        } else {
            Reply::created(hit)
        }
    })
    .await;
    let before = "[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\n";
    let proxy = Proxy::start(&upstream.url(), before).await;
    let client = TestClient::default();
    // Not a route yet: passed through, twice.
    for _ in 0..2 {
        assert!(!client.post(&proxy.url("/v1/tickets"), "t", "").await.replayed());
    }
    let slow = tokio::spawn({
        let (client, url) = (client.clone(), proxy.url("/v1/orders?slow"));
        async move { client.post(&url, "slow", "").await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.reload(
        &upstream.url(),
        &format!("{before}[[route]]\nname = \"tickets\"\npath = \"/v1/tickets\"\n"),
    );
    assert_eq!(
        slow.await.unwrap().status,
        StatusCode::CREATED,
        "the old configuration finished it"
    );
    assert!(!client.post(&proxy.url("/v1/tickets"), "t2", "").await.replayed());
    assert!(client.post(&proxy.url("/v1/tickets"), "t2", "").await.replayed());
    assert!(
        client.post(&proxy.url("/v1/orders?slow"), "slow", "").await.replayed(),
        "records survive a reload"
    );
}

#[tokio::test]
async fn sighup_reloads_the_file_and_keeps_the_old_one_when_the_new_is_broken() {
    let upstream = Upstream::created().await;
    let mut gate = Binary::start(&upstream.url(), "[store]\nbackend = \"memory\"\n").await;
    let client = TestClient::default();
    let original = std::fs::read_to_string(gate.config_path()).unwrap();
    assert!(!client.post(&gate.url("/v1/orders"), "k", "").await.replayed());
    assert!(!client.post(&gate.url("/v1/orders"), "k", "").await.replayed());

    std::fs::write(
        gate.config_path(),
        format!("{original}\n[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\n"),
    )
    .unwrap();
    gate.signal("HUP");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        client.post(&gate.url("/v1/orders"), "k2", "").await;
        if client.post(&gate.url("/v1/orders"), "k2", "").await.replayed() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the reload never took effect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    std::fs::write(gate.config_path(), format!("{original}\n[[route]]\nname = 7\n")).unwrap();
    gate.signal("HUP");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        gate.wait(Duration::ZERO).is_none(),
        "a broken reload must not stop the process"
    );
    assert!(
        client.post(&gate.url("/v1/orders"), "k2", "").await.replayed(),
        "the old configuration stays"
    );

    gate.signal("TERM");
    let status = gate.wait(Duration::from_secs(10)).expect("SIGTERM stops the process");
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn shutdown_drains_requests_and_exchanges_whose_clients_left() {
    let _ = captured();
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_millis(700))).await;
    let proxy = Proxy::start(&upstream.url(), "[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\n").await;
    let store = proxy.store.clone();
    let client = TestClient::default();
    let waiting = tokio::spawn({
        let (client, url) = (client.clone(), proxy.url("/v1/orders"));
        async move { client.post(&url, "stays", "").await }
    });
    // A client that hangs up mid-request.
    let left = tokio::spawn({
        let (client, url) = (client.clone(), proxy.url("/v1/orders"));
        async move { client.post(&url, "left", "").await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    left.abort();
    let started = tokio::time::Instant::now();
    proxy.stop().await;
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "stop did not wait for the drain"
    );
    assert_eq!(waiting.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(upstream.hits(), 2);
    // Both records were completed before the drain ended.
    let restarted = Proxy::start_with_store(
        &upstream.url(),
        "[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\n",
        store,
    )
    .await;
    for key in ["stays", "left"] {
        assert!(
            client.post(&restarted.url("/v1/orders"), key, "").await.replayed(),
            "{key}"
        );
    }
}
