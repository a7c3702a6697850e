//! Operations: reload, drain, request logs, metrics.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::logs::captured;
use support::{Binary, Proxy, Reply, TestClient, Upstream};

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
    let proxy = Proxy::start(&upstream.url(), support::ORDERS).await;
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
    let text = support::logs::text(&logs);
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

/// The binary's own logs, as a service manager or a file receives them:
/// text without terminal colour codes, or JSON lines; request lines at
/// DEBUG; no key, token or body in either.
#[tokio::test]
async fn the_binary_logs_plain_text_or_json_lines_and_never_secrets() {
    let upstream = Upstream::created().await;
    for format in ["text", "json", "xml"] {
        let env = [("RUST_LOG", "debug"), ("IDEMGATE_LOG_FORMAT", format), ("NO_COLOR", "")];
        let config = format!("[store]\nbackend = \"memory\"\n{}", support::ORDERS);
        let gate = Binary::start_with_env(&upstream.url(), &config, &env).await;
        let client = TestClient::default();
        let headers = [
            ("idempotency-key", "key-SECRET-4f1d9a"),
            ("authorization", "Bearer TOKEN-7c2e55"),
        ];
        for _ in 0..2 {
            let answer = client
                .send(
                    "POST",
                    &gate.url("/v1/orders"),
                    &headers,
                    r#"{"card":"BODY-SECRET-0042"}"#,
                )
                .await;
            assert!(answer.status.is_success(), "{}", answer.text());
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !gate.log().contains("replayed") {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no request line:\n{}",
                gate.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let log = gate.log();
        // One line for the process, not one a worker, with both of its
        // addresses.
        assert_eq!(log.matches("idemgate serving").count(), 1, "{log}");
        let serving = log.lines().find(|line| line.contains("idemgate serving")).unwrap();
        for address in [gate.addr, gate.admin] {
            assert!(serving.contains(&address.to_string()), "{serving}");
        }
        assert!(!log.contains('\x1b'), "terminal escapes in a {format} log:\n{log:?}");
        for secret in ["SECRET", "TOKEN-7c2e55"] {
            assert!(!log.contains(secret), "`{secret}` leaked into the {format} log:\n{log}");
        }
        if format == "json" {
            for line in log.lines() {
                let line: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
                assert!(line["level"].is_string(), "{line}");
            }
        }
        // A format it does not know: text, and a warning that says so.
        assert_eq!(log.contains("IDEMGATE_LOG_FORMAT is \"xml\""), format == "xml", "{log}");
    }
}

/// An empty `RUST_LOG` (`Environment=RUST_LOG=` under systemd, an unset
/// variable in a compose file) is no filter, not one that hides every
/// line; one that does not parse is warned of. Either way the default's
/// lines are written (the binary is up once it says it serves).
#[tokio::test]
async fn an_empty_or_unreadable_rust_log_logs_at_the_default() {
    let upstream = Upstream::created().await;
    let config = format!("[store]\nbackend = \"memory\"\n{}", support::ORDERS);
    for spec in ["", "idemgate=verbose"] {
        let gate = Binary::start_with_env(&upstream.url(), &config, &[("RUST_LOG", spec)]).await;
        let log = gate.log();
        assert_eq!(log.matches("idemgate serving").count(), 1, "{spec:?}: {log}");
        assert_eq!(
            log.contains("RUST_LOG=\"idemgate=verbose\" is not a log filter"),
            !spec.is_empty(),
            "{log}"
        );
    }
}

#[tokio::test]
async fn shadow_mode_logs_what_enforce_would_have_done_with_the_key_hashed() {
    let logs = captured();
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[defaults]
mode = "shadow"
[[route]]
name = "shadowed"
path = "/v1/shadowed"
"#,
    )
    .await;
    let client = TestClient::default();
    let url = proxy.url("/v1/shadowed");
    let secret_key = "shadow-SECRET-91c3";
    client.post(&url, secret_key, "a").await;
    client.post(&url, secret_key, "a").await;
    client.post(&url, secret_key, "b").await;
    assert_eq!(upstream.hits(), 3, "shadow mode forwards every one");
    let text = support::logs::text(&logs);
    let lines: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("shadow mode forwarded it") && line.contains("shadowed"))
        .collect();
    assert_eq!(
        lines.len(),
        2,
        "one line per request enforce would not forward:\n{text}"
    );
    for (line, outcome) in lines.iter().zip(["shadow_replayed", "shadow_mismatch"]) {
        assert!(line.contains(" INFO "), "{line}");
        assert!(line.contains(&format!("outcome=\"{outcome}\"")), "{line}");
        assert!(line.contains("key="), "{line}");
        assert!(!line.contains("SECRET"), "{line}");
    }
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
    let before = support::ORDERS;
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

/// With several workers, the admin listener (served by the first) answers
/// until every worker has drained, not only its own: here one request
/// held by whichever of eight workers took it.
#[tokio::test]
async fn the_admin_listener_answers_until_every_worker_has_drained() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_millis(3000))).await;
    let config = format!(
        "[server]\nworkers = 8\n[store]\nbackend = \"memory\"\n{}",
        support::ORDERS
    );
    let mut gate = Binary::start(&upstream.url(), &config).await;
    let client = TestClient::default();
    let slow = tokio::spawn({
        let (client, url) = (client.clone(), gate.url("/v1/orders"));
        async move { client.post(&url, "slow", "").await }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while upstream.hits() == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the request never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The answer comes 3 s after the request arrived: until well before
    // then, the drain is still on.
    let answered = tokio::time::Instant::now() + Duration::from_millis(1200);
    gate.signal("TERM");
    let healthz = format!("http://{}/healthz", gate.admin);
    while tokio::time::Instant::now() < answered {
        // A fresh connection each time: a pooled one could outlive the listener.
        let answer = TestClient::default().send("GET", &healthz, &[], "").await;
        assert_eq!(answer.status, StatusCode::OK);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
    let status = gate.wait(Duration::from_secs(10)).expect("SIGTERM stops the process");
    assert!(status.success(), "{status:?}");
    // Said once for the process, not once a worker.
    let log = gate.log();
    for (line, count) in [
        ("idemgate serving", 1),
        ("draining", 1),
        ("grace=30s", 1),
        ("stopped", 1),
    ] {
        assert_eq!(log.matches(line).count(), count, "{line}: {log}");
    }
}

/// The first line of `gate`'s log that holds `text`, once one does
/// (within 5 s).
async fn logged(gate: &Binary, text: &str) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(line) = gate.log().lines().find(|line| line.contains(text)) {
            return line.to_owned();
        }
        assert!(tokio::time::Instant::now() < deadline, "no {text:?}: {}", gate.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn sighup_reloads_the_file_and_keeps_the_old_one_when_the_new_is_broken() {
    let upstream = Upstream::created().await;
    // Two workers, each applying the reload.
    let config = "[server]\nworkers = 2\n[store]\nbackend = \"memory\"\n";
    let mut gate = Binary::start(&upstream.url(), config).await;
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
    // Said once, not once a worker.
    while !gate.log().contains("configuration reloaded") {
        assert!(tokio::time::Instant::now() < deadline, "{}", gate.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        gate.log().matches("configuration reloaded").count(),
        1,
        "{}",
        gate.log()
    );

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
    // A file with two problems: both named, on the refusal's one line (a
    // collector reading a line per entry keeps it whole).
    std::fs::write(
        gate.config_path(),
        format!("{original}\n[[route]]\nname = \"a\"\npath = \"/a\"\nttl = \"soon\"\nlock_timeout = \"later\"\n"),
    )
    .unwrap();
    gate.signal("HUP");
    let line = logged(&gate, "later").await;
    assert!(
        line.contains("reload refused") && line.contains("].ttl") && line.contains("].lock_timeout"),
        "{}",
        gate.log()
    );
    // A file that parses but names a CA that is not there: refused, and
    // the log says which file and why, as at start.
    let ca = gate.config_path().with_extension("missing-ca.pem");
    let broken = original.replace("[upstream]\n", &format!("[upstream]\nca = \"{}\"\n", ca.display()));
    assert_ne!(broken, original);
    std::fs::write(gate.config_path(), broken).unwrap();
    gate.signal("HUP");
    let line = logged(&gate, "missing-ca.pem").await;
    assert!(
        line.contains("reload refused") && line.contains("upstream.ca"),
        "{line}"
    );
    assert!(line.contains(&gate.config_path().display().to_string()), "{line}");
    assert!(client.post(&gate.url("/v1/orders"), "k2", "").await.replayed());

    gate.signal("TERM");
    let status = gate.wait(Duration::from_secs(10)).expect("SIGTERM stops the process");
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn shutdown_drains_requests_and_exchanges_whose_clients_left() {
    let _ = captured();
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_millis(1500))).await;
    let proxy = Proxy::start(&upstream.url(), support::ORDERS).await;
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
    upstream.reached(2).await;
    left.abort();
    let started = tokio::time::Instant::now();
    let admin = proxy.admin.unwrap();
    let stopping = tokio::spawn(proxy.stop());
    // Through the drain the admin listener answers: alive, not ready.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let page = |page: &str| format!("http://{admin}/{page}");
    assert_eq!(
        client.send("GET", &page("healthz"), &[], "").await.status,
        StatusCode::OK
    );
    let ready = client.send("GET", &page("readyz"), &[], "").await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(ready.problem(), "draining");
    assert_eq!(
        client.send("GET", &page("metrics"), &[], "").await.status,
        StatusCode::OK
    );
    stopping.await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "stop did not wait for the drain"
    );
    // Once drained, it closes too.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while tokio::net::TcpStream::connect(admin).await.is_ok() {
        assert!(tokio::time::Instant::now() < deadline, "admin still listening");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(waiting.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(upstream.hits(), 2);
    // Both records were completed before the drain ended.
    let restarted = Proxy::start_with_store(&upstream.url(), support::ORDERS, store).await;
    for key in ["stays", "left"] {
        assert!(
            client.post(&restarted.url("/v1/orders"), key, "").await.replayed(),
            "{key}"
        );
    }
}

/// A shutdown whose grace runs out while a request that may have reached
/// the upstream is still open, on a route that keeps such outcomes
/// unknown, records it as unknown before the process exits: the retry
/// after the restart gets 502 outcome-unknown, never a second run (left
/// to its lease, the claim would have let the retry run it again). On a
/// route with `on_upstream_failure = "release"` the cut-off request's
/// claim is released, as an upstream failure's would be: its retry runs
/// at once, not a 409 until the lease ends; unless the upstream's head
/// had come (a 201: it acted), when it is recorded as unknown too.
#[tokio::test]
async fn a_shutdown_past_its_grace_records_requests_that_may_have_been_sent_as_unknown() {
    // The first three (one a route) are held past the grace, one of them
    // with its head sent; retries answer at once.
    let upstream = Upstream::start(|hit, seen| match (hit, seen.uri.as_str()) {
        (4.., _) => Reply::created(hit),
        (_, "/v1/payments") => Reply::Answer {
            delay: Duration::ZERO,
            status: StatusCode::CREATED,
            headers: vec![],
            chunks: vec!["{\"paid\":".into(), "1}".into()],
            gap: Duration::from_secs(5),
        },
        _ => Reply::created(hit).delayed(Duration::from_secs(5)),
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "[server]\nshutdown_grace = \"300ms\"\n[store]\nbackend = \"embedded\"\npath = \"{}\"\n\
         [[route]]\nname = \"orders\"\npath = \"/v1/orders\"\non_upstream_failure = \"unknown\"\n\
         [[route]]\nname = \"refunds\"\npath = \"/v1/refunds\"\n\
         [[route]]\nname = \"payments\"\npath = \"/v1/payments\"\n",
        dir.path().join("s.redb").display()
    );
    let mut gate = Binary::start(&upstream.url(), &toml).await;
    let client = TestClient::default();
    let open: Vec<_> = [
        ("/v1/orders", "sent"),
        ("/v1/refunds", "cut"),
        ("/v1/payments", "acted"),
    ]
    .into_iter()
    .map(|(path, key)| {
        let (client, url) = (client.clone(), gate.url(path));
        tokio::spawn(async move { client.post(&url, key, "").await })
    })
    .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while upstream.hits() < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the requests never reached the upstream"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The 201's head on its way back.
    tokio::time::sleep(Duration::from_millis(200)).await;
    gate.signal("TERM");
    gate.wait(Duration::from_secs(10)).expect("SIGTERM stops the process");
    open.iter().for_each(tokio::task::JoinHandle::abort);
    assert!(gate.log().contains("recorded_unknown=1"), "{}", gate.log());

    let restarted = Binary::start(&upstream.url(), &toml).await;
    for (path, key) in [("/v1/orders", "sent"), ("/v1/payments", "acted")] {
        let retry = client.post(&restarted.url(path), key, "").await;
        assert_eq!(retry.problem(), "outcome-unknown", "{path}: {}", retry.text());
    }
    assert_eq!(upstream.hits(), 3);
    let retry = client.post(&restarted.url("/v1/refunds"), "cut", "").await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert_eq!(upstream.hits(), 4);
}

/// What `addr` answers the bytes `wire` on a connection of their own.
async fn exchange_raw(addr: std::net::SocketAddr, wire: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(wire.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    stream.read_to_end(&mut seen).await.unwrap();
    String::from_utf8_lossy(&seen).into_owned()
}

/// Without a token, a loopback admin listener answers /records only to
/// requests for this machine: a web page whose name was rebound to
/// 127.0.0.1 sends its own name as the host, and could purge otherwise.
#[tokio::test]
async fn a_tokenless_records_page_answers_only_requests_for_this_machine() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(&upstream.url(), "[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\n").await;
    let client = TestClient::default();
    let admin = proxy.admin.unwrap();
    let records = format!("http://{admin}/records?route=orders&key=k1");
    for (method, host) in [
        ("GET", "evil.example"),
        ("DELETE", "evil.example:9901"),
        ("GET", "127.0.0.1.evil.example"),
        // Not a host: userinfo, a port that is not digits.
        ("GET", "evil.example@localhost"),
        ("GET", "localhost:abc"),
    ] {
        let refused = client.send(method, &records, &[("host", host)], "").await;
        assert_eq!(refused.status, StatusCode::FORBIDDEN, "{method} {host}");
        assert_eq!(refused.problem(), "forbidden");
    }
    let port = admin.port().to_string();
    for host in ["localhost", &format!("LocalHost:{port}"), "127.0.0.2", "[::1]:9901"] {
        let answered = client.send("GET", &records, &[("host", host)], "").await;
        assert_eq!(answered.status, StatusCode::NOT_FOUND, "{host}: {}", answered.text());
        assert!(answered.text().contains("absent"), "{host}");
    }
    // As the command line and curl send it: the listener's own address.
    assert_eq!(
        client.send("GET", &records, &[], "").await.status,
        StatusCode::NOT_FOUND
    );
    // An absolute-form target names its host too: both must be local.
    for (target, host) in [
        ("http://evil.example/records?route=orders&key=k1", "localhost"),
        ("http://localhost/records?route=orders&key=k1", "localhost"),
    ] {
        let wire = format!("GET {target} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n");
        let seen = exchange_raw(admin, &wire).await;
        let want = if target.contains("evil") {
            "HTTP/1.1 403"
        } else {
            "HTTP/1.1 404"
        };
        assert!(seen.starts_with(want), "{target}: {seen}");
    }
    // Two Host fields are an error (RFC 9112 §3.2), whichever comes first.
    for hosts in ["localhost\r\nhost: evil.example", "evil.example\r\nhost: localhost"] {
        let wire = format!("GET /records?route=orders&key=k1 HTTP/1.1\r\nhost: {hosts}\r\nconnection: close\r\n\r\n");
        let seen = exchange_raw(admin, &wire).await;
        assert!(seen.starts_with("HTTP/1.1 400"), "{hosts}: {seen}");
    }
    // The other pages tell nothing a page could misuse.
    let metrics = format!("http://{admin}/metrics");
    assert_eq!(
        client
            .send("GET", &metrics, &[("host", "evil.example")], "")
            .await
            .status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn operators_look_up_and_purge_records_behind_a_token() {
    let _ = captured();
    let upstream = Upstream::start(|hit, seen| {
        if seen.uri.contains("stuck") {
            Reply::created(hit).delayed(Duration::from_secs(30))
        } else {
            Reply::created(hit)
        }
    })
    .await;
    let proxy = Proxy::start(
        &upstream.url(),
        "[server]\nadmin_token = \"s3cret\"\n[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\n",
    )
    .await;
    let client = TestClient::default();
    let admin = format!(
        "http://{}/records?route=orders&key=k1&scope=Bearer%20alice",
        proxy.admin.unwrap()
    );
    let auth = [("authorization", "Bearer s3cret")];
    client
        .send(
            "POST",
            &proxy.url("/v1/orders"),
            &[("idempotency-key", "k1"), ("authorization", "Bearer alice")],
            "",
        )
        .await;

    // Refusals are problem documents, as every error idemgate makes.
    let denied = client.send("GET", &admin, &[], "").await;
    assert_eq!(denied.status, StatusCode::UNAUTHORIZED);
    assert_eq!(denied.problem(), "unauthorized");
    assert_eq!(
        denied.header("www-authenticate"),
        Some("Bearer realm=\"idemgate-admin\"")
    );
    let nowhere = format!("http://{}/nowhere", proxy.admin.unwrap());
    assert_eq!(client.send("GET", &nowhere, &[], "").await.problem(), "not-found");
    assert_eq!(client.send("POST", &nowhere, &[], "").await.problem(), "not-found");
    let wrong = client
        .send("GET", &admin, &[("authorization", "Bearer s3creT")], "")
        .await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    for wrong in [
        "Bearer s3cret2",
        "Bearer s3cre",
        "Basic s3cret",
        "s3cret",
        "Bearers3cret",
    ] {
        let refused = client.send("GET", &admin, &[("authorization", wrong)], "").await;
        assert_eq!(refused.status, StatusCode::UNAUTHORIZED, "{wrong}");
    }
    // The scheme is case-insensitive (RFC 9110 §11.1).
    let lower = client
        .send("GET", &admin, &[("authorization", "bearer s3cret")], "")
        .await;
    assert_eq!(lower.status, StatusCode::OK, "{}", lower.text());
    let found = client.send("GET", &admin, &auth, "").await;
    assert_eq!(found.status, StatusCode::OK, "{}", found.text());
    let doc: serde_json::Value = serde_json::from_slice(&found.body).unwrap();
    assert_eq!(doc["state"], "completed");
    assert_eq!(doc["status"], 201);
    assert_eq!(doc["body_bytes"], 11);
    assert!(!found.text().contains("\"order\":1"), "the stored body is never shown");
    // The key as a client may send it, an sf-string: the same record.
    let quoted = admin.replace("key=k1", "key=%22k1%22");
    assert_eq!(client.send("GET", &quoted, &auth, "").await.status, StatusCode::OK);
    // A repeated or unknown parameter would name another record than
    // meant: refused. So is an empty key, which no request has.
    for query in [
        "key=k1&key=k2",
        "key=k1&sope=x",
        "route=orders&key=k1",
        "key=",
        "key=%22%22",
    ] {
        let odd = admin.replace("key=k1", query);
        let refused = client.send("DELETE", &odd, &auth, "").await;
        assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{query}: {}", refused.text());
        assert_eq!(refused.problem(), "bad-request", "{query}");
    }
    let other_scope = admin.replace("alice", "bob");
    // Not there: an answer, 404 with the record's tag, not a problem.
    let absent = client.send("GET", &other_scope, &auth, "").await;
    assert_eq!(absent.status, StatusCode::NOT_FOUND);
    assert_eq!(absent.header("content-type"), Some("application/json"));
    let doc: serde_json::Value = serde_json::from_slice(&absent.body).unwrap();
    assert_eq!(doc["state"], "absent");
    assert_eq!(doc["record"].as_str().map(str::len), Some(12), "{doc}");
    // HEAD answers as GET, without the body; another method is 405 with
    // its Allow list, before the token or the query is looked at.
    let head = client.send("HEAD", &admin, &auth, "").await;
    assert_eq!(head.status, StatusCode::OK);
    assert_eq!(head.header("content-type"), Some("application/json"));
    assert!(head.body.is_empty());
    assert_eq!(
        client.send("HEAD", &other_scope, &auth, "").await.status,
        StatusCode::NOT_FOUND
    );
    let put = client.send("PUT", &admin, &[], "").await;
    assert_eq!(put.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(put.header("allow"), Some("GET, HEAD, DELETE"));
    assert_eq!(put.problem(), "method-not-allowed");
    let post = client
        .send("POST", &nowhere.replace("nowhere", "metrics"), &[], "")
        .await;
    assert_eq!(post.header("allow"), Some("GET, HEAD"));
    assert_eq!(post.problem(), "method-not-allowed");
    for page in ["healthz", "readyz", "metrics"] {
        let head = client.send("HEAD", &nowhere.replace("nowhere", page), &[], "").await;
        assert_eq!(head.status, StatusCode::OK, "{page}");
        assert!(head.body.is_empty(), "{page}");
    }

    assert_eq!(client.send("DELETE", &admin, &auth, "").await.status, StatusCode::OK);
    assert_eq!(
        client.send("GET", &admin, &auth, "").await.status,
        StatusCode::NOT_FOUND
    );
    let again = client
        .send(
            "POST",
            &proxy.url("/v1/orders"),
            &[("idempotency-key", "k1"), ("authorization", "Bearer alice")],
            "",
        )
        .await;
    assert!(!again.replayed(), "purged: the next request runs again");

    // A stuck claim, purged, frees the key at once.
    let hits = upstream.hits();
    tokio::spawn({
        let (client, url) = (client.clone(), proxy.url("/v1/orders?stuck"));
        async move { client.send("POST", &url, &[("idempotency-key", "stuck")], "").await }
    });
    upstream.reached(hits + 1).await;
    let stuck = format!("http://{}/records?route=orders&key=stuck", proxy.admin.unwrap());
    let doc: serde_json::Value = serde_json::from_slice(&client.send("GET", &stuck, &auth, "").await.body).unwrap();
    assert_eq!(doc["state"], "in_flight");
    assert_eq!(client.send("DELETE", &stuck, &auth, "").await.status, StatusCode::OK);
    let hits = upstream.hits();
    tokio::spawn({
        let (client, url) = (client.clone(), proxy.url("/v1/orders?stuck"));
        async move { client.send("POST", &url, &[("idempotency-key", "stuck")], "").await }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while upstream.hits() == hits {
        assert!(tokio::time::Instant::now() < deadline, "the purged key was not freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn the_record_and_health_subcommands_talk_to_the_running_proxy() {
    let upstream = Upstream::created().await;
    let gate = Binary::start(
        &upstream.url(),
        "[server]\nadmin_token = \"t0k\"\n[store]\nbackend = \"memory\"\n[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\nscope = [\"x-tenant\"]\n",
    )
    .await;
    TestClient::default().post(&gate.url("/v1/orders"), "cli", "").await;
    let tenant = [("idempotency-key", "scoped"), ("x-tenant", "t1")];
    TestClient::default()
        .send("POST", &gate.url("/v1/orders"), &tenant, "")
        .await;
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args(args)
            .arg("--config")
            .arg(gate.config_path())
            .output()
            .unwrap()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !run(&["health"]).status.success() {
        assert!(std::time::Instant::now() < deadline, "health never passed");
        std::thread::sleep(Duration::from_millis(50));
    }
    let shown = run(&["record", "--route", "orders", "--key", "cli"]);
    assert!(shown.status.success(), "{}", String::from_utf8_lossy(&shown.stderr));
    assert!(String::from_utf8_lossy(&shown.stdout).contains("\"completed\""));
    let purged = run(&["record", "--route", "orders", "--key", "cli", "--purge"]);
    assert!(purged.status.success());
    let gone = run(&["record", "--route", "orders", "--key", "cli"]);
    assert_eq!(gone.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&gone.stdout).contains("absent"));
    // A scope header by name; without `=`, refused before any call.
    let by_name = |line: &str| run(&["record", "--route", "orders", "--key", "scoped", "--scope-header", line]);
    let scoped = by_name("x-tenant=t1");
    assert!(scoped.status.success(), "{}", String::from_utf8_lossy(&scoped.stdout));
    let unnamed = by_name("x-tenant");
    assert!(String::from_utf8_lossy(&unnamed.stderr).contains("NAME=VALUE"));
    // A key too long for any request target: an error, not a panic.
    let long = "k".repeat(70_000);
    let refused = run(&["record", "--route", "orders", "--key", &long]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("too long"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}

/// Scope headers named in the lookup: each line of each, in order, and a
/// scope header not named was absent. So records whose request lacked an
/// earlier scope header and carried a later one, sent one on two lines,
/// or sent bytes that are not UTF-8, can be named too.
#[tokio::test]
async fn records_are_found_by_scope_headers_named_line_by_line() {
    let upstream = Upstream::created().await;
    let route = "[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\nscope = [\"authorization\", \"x-tenant\"]\n";
    let proxy = Proxy::start(&upstream.url(), route).await;
    let client = TestClient::default();
    let post = |key: &str, tenants: &[&str]| {
        let lines: String = tenants.iter().map(|t| format!("x-tenant: {t}\r\n")).collect();
        format!(
            "POST /v1/orders HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\n{lines}content-length: 0\r\nconnection: close\r\n\r\n"
        )
    };
    for wire in [
        post("k1", &["t1"]),
        post("k2", &["a", "b"]),
        post("k3", &["\u{1}"]).replace('\u{1}', "\u{ff}"),
    ] {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        // Latin-1 on the wire: U+00FF as the byte 0xFF.
        let bytes: Vec<u8> = wire.chars().map(|c| c as u8).collect();
        stream.write_all(&bytes).await.unwrap();
        let mut seen = Vec::new();
        stream.read_to_end(&mut seen).await.unwrap();
        assert!(seen.starts_with(b"HTTP/1.1 201"), "{}", String::from_utf8_lossy(&seen));
    }
    assert_eq!(upstream.hits(), 3);
    let admin = proxy.admin.unwrap();
    let look = |query: &str| {
        let url = format!("http://{admin}/records?route=orders&{query}");
        let client = &client;
        async move { client.send("GET", &url, &[], "").await }
    };
    for (query, status) in [
        ("key=k1&scope.x-tenant=t1", 200),
        ("key=k1&scope.X-Tenant=t1", 200),
        // By position, the first is present (empty), not absent.
        ("key=k1&scope=&scope=t1", 404),
        ("key=k2&scope.x-tenant=a&scope.x-tenant=b", 200),
        ("key=k2&scope.x-tenant=b&scope.x-tenant=a", 404),
        // Its two lines are one value, as a proxy on the way may join them.
        ("key=k2&scope.x-tenant=a%2Cb", 200),
        ("key=k3&scope.x-tenant=%FF", 200),
        ("key=k3&scope.x-tenant=%FE", 404),
    ] {
        assert_eq!(look(query).await.status.as_u16(), status, "{query}");
    }
    for (query, says) in [
        ("key=k1&scope=x&scope.x-tenant=t1", "not both"),
        ("key=k1&scope.x-other=1", "no scope header x-other"),
        // Keys no request's can be, and more values than scope headers:
        // no record has them.
        ("key=a%20b&scope.x-tenant=t1", "visible ASCII"),
        ("key=%22k1&scope.x-tenant=t1", "visible ASCII"),
        ("key=k1&scope=a&scope=t1&scope=x", "at most that many"),
    ] {
        let refused = look(query).await;
        assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{query}");
        assert!(refused.text().contains(says), "{query}: {}", refused.text());
    }
}

/// `idemgate health` fails, rather than hangs, on an admin listener that
/// takes the connection and never answers (a stopped process's kernel
/// still completes the handshake).
#[test]
fn the_health_subcommand_gives_up_on_a_listener_that_never_answers() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    std::fs::write(
        &path,
        format!(
            "[upstream]\nurl = \"{}\"\n[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"{}\"\nheader_read_timeout = \"300ms\"\n[store]\nbackend = \"memory\"\ntimeout = \"200ms\"\n",
            support::unreachable_url(),
            silent.local_addr().unwrap()
        ),
    )
    .unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["health", "--config"])
        .arg(&path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("idemgate health still waits after 10 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success());
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains("no answer within 500ms"), "{stderr}");
    drop(silent);
}

#[tokio::test]
async fn metrics_count_every_outcome_by_route() {
    let _ = captured();
    let upstream = Upstream::start(|hit, seen| {
        if seen.uri.contains("slow") {
            Reply::created(hit).delayed(Duration::from_millis(1500))
        } else if seen.uri.contains("fail") {
            Reply::Reset {
                delay: Duration::from_millis(10),
            }
        } else if seen.uri.contains("broken") {
            Reply::BreakOff(StatusCode::CREATED)
        } else if seen.uri.contains("big") {
            Reply::status(201, &"b".repeat(4096))
        } else {
            Reply::created(hit)
        }
    })
    .await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[server]
max_request_body = "1KiB"
[[route]]
name = "orders"
path = "/v1/orders"
max_response_body = "1KiB"
on_upstream_failure = "unknown"
"#,
    )
    .await;
    let client = TestClient::default();
    let url = |q: &str| proxy.url(&format!("/v1/orders{q}"));
    let key = |k: &'static str| [("idempotency-key", k)];
    client.send("POST", &url(""), &key("a"), "").await; // forwarded
    client.send("POST", &url(""), &key("a"), "").await; // replayed
    client.send("POST", &url(""), &key("a"), "other").await; // mismatch
    client.send("POST", &url(""), &[], "").await; // key_missing
    client.send("POST", &url(""), &key(""), "").await; // key_invalid
    client.send("POST", &url(""), &key("b"), &"x".repeat(2048)).await; // too_large
    client.send("POST", &url("?big"), &key("c"), "").await; // forwarded
    client.send("POST", &url("?big"), &key("c"), "").await; // not_replayable
    client.send("POST", &url("?fail"), &key("d"), "").await; // upstream_error
    client.send("POST", &url("?fail"), &key("d"), "").await; // outcome_unknown
    // A head, then a body that breaks off: a failure, not a forward.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        let head = "POST /v1/orders?broken HTTP/1.1\r\nhost: x\r\nidempotency-key: f\r\ncontent-length: 0\r\n\r\n";
        stream.write_all(head.as_bytes()).await.unwrap();
        let _ = stream.read_to_end(&mut Vec::new()).await; // upstream_error
    }
    client.send("GET", &url(""), &[], "").await; // passthrough (the route's path, another method)
    let hits = upstream.hits();
    let slow = tokio::spawn({
        let (client, url) = (client.clone(), url("?slow"));
        async move { client.send("POST", &url, &[("idempotency-key", "e")], "").await }
    });
    upstream.reached(hits + 1).await;
    client.send("POST", &url("?slow"), &key("e"), "").await; // in_flight
    slow.await.unwrap();
    let metrics = client
        .send("GET", &format!("http://{}/metrics", proxy.admin.unwrap()), &[], "")
        .await
        .text();
    for (route, outcome, n) in [
        ("orders", "forwarded", 3),
        ("orders", "upstream_error", 2),
        ("orders", "replayed", 1),
        ("orders", "mismatch", 1),
        ("orders", "key_missing", 1),
        ("orders", "key_invalid", 1),
        ("orders", "too_large", 1),
        ("orders", "not_replayable", 1),
        ("orders", "outcome_unknown", 1),
        ("orders", "in_flight", 1),
        ("", "passthrough", 1),
        // A series is there before its first count.
        ("orders", "store_error", 0),
    ] {
        let line = format!("idemgate_requests_total{{route=\"{route}\",outcome=\"{outcome}\"}} {n}");
        assert!(metrics.contains(&line), "missing `{line}` in:\n{metrics}");
    }
    assert!(metrics.contains("idemgate_claims_in_flight 0"), "{metrics}");
    assert!(metrics.contains("idemgate_stored_bytes"), "{metrics}");
}

#[tokio::test]
async fn a_reload_names_the_fields_that_wait_for_a_restart() {
    let logs = captured();
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(&upstream.url(), support::ORDERS).await;
    proxy.reload(
        &upstream.url(),
        &format!(
            "[server]\nheader_read_timeout = \"3s\"\n[store]\ntimeout = \"2s\"\npath = \"elsewhere.redb\"\n\
             [defaults]\nlock_timeout = \"5s\"\n{}",
            support::ORDERS
        ),
    );
    let text = support::logs::text(&logs);
    for field in ["server.header_read_timeout", "store.timeout", "store.path"] {
        assert!(
            text.lines().any(|l| l.contains(field) && l.contains("after a restart")),
            "no warning for {field} in:\n{text}"
        );
    }
    assert!(!text.contains("store.backend"), "the backend did not change:\n{text}");
    // Warnings are of the store timeout in force (1 s, the default), not
    // of the file's: a 5 s lease is three of it, a 2 s one is not.
    assert!(!text.contains("three times store.timeout"), "{text}");
    proxy.reload(
        &upstream.url(),
        &format!(
            "[store]\ntimeout = \"500ms\"\n[defaults]\nlock_timeout = \"2s\"\n{}",
            support::ORDERS
        ),
    );
    let text = support::logs::text(&logs);
    assert!(
        text.contains("lock_timeout 2s is under three times store.timeout (1s)"),
        "{text}"
    );
    proxy.reload(
        &upstream.url(),
        &format!(
            "[store]\nbackend = \"redis\"\nwait_for_replicas = 1\n{}",
            support::ORDERS
        ),
    );
    let text = support::logs::text(&logs);
    assert!(
        text.lines()
            .any(|l| l.contains("store.wait_for_replicas") && l.contains("after a restart")),
        "{text}"
    );
    proxy.stop().await;
}

/// A Redis that evicts keys when full could drop an in-flight claim and let
/// a retry through: idemgate says so for each server it is given.
#[tokio::test]
async fn a_redis_that_may_evict_keys_is_warned_about() {
    let logs = captured();
    let evicting = support::redis::RedisServer::start_with_args(&["--maxmemory-policy", "allkeys-lru"]);
    let safe = support::redis::RedisServer::start();
    let _stores = [&evicting, &safe]
        .map(|server| idemgate::store::RedisStore::single(&server.url(), "idemgate", Duration::from_secs(2)).unwrap());
    warned_at_start(&logs, evicting.port, safe.port, "maxmemory-policy").await;
    let text = support::logs::text(&logs);
    assert!(text.contains("allkeys-lru") && text.contains(" WARN "), "{text}");
}

/// Waits (up to 10 s) for a log line that names the Redis on `port` and
/// says `what`; then checks, once the other has had time to be asked too,
/// that none names the one on `fine`.
async fn warned_at_start(logs: &std::sync::Mutex<Vec<u8>>, port: u16, fine: u16, what: &str) {
    let warned = |port: u16| {
        let text = support::logs::text(logs);
        text.lines()
            .any(|line| line.contains(&format!("127.0.0.1:{port}")) && line.contains(what))
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !warned(port) {
        assert!(tokio::time::Instant::now() < deadline, "no warning that says {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!warned(fine), "the server on {fine} is fine as it is");
}

/// With `store.wait_for_replicas`, a primary with fewer replicas than it
/// asks for is warned about at start: every write to it would be refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_short_of_the_replicas_asked_for_is_warned_about() {
    let logs = captured();
    let alone = support::redis::RedisServer::start();
    let copied = support::redis::RedisServer::start();
    let _replica = support::redis::RedisServer::start_replica_of(&copied);
    let _stores = [&alone, &copied].map(|server| {
        idemgate::store::RedisStore::single_copied(&server.url(), "idemgate", Duration::from_secs(2), 1).unwrap()
    });
    warned_at_start(&logs, alone.port, copied.port, "fewer replicas connected").await;
}

/// With `store.wait_for_replicas`, a Redis user denied `WAIT` takes no
/// claim, and what is logged names `WAIT`: not a refusal of the scripts,
/// which it may run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_user_denied_wait_is_told_so_and_not_that_scripts_are_denied() {
    use idemgate::store::{Fingerprint, Owner, RecordKey, Store};
    let logs = captured();
    let primary = support::redis::RedisServer::start();
    let _replica = support::redis::RedisServer::start_replica_of(&primary);
    primary
        .cli(&["acl", "setuser", "nowait", "on", ">pw", "~*", "&*", "+@all", "-wait"])
        .unwrap();
    let url = primary.url().replace("redis://", "redis://nowait:pw@");
    let store = idemgate::store::RedisStore::single_copied(&url, "idemgate", Duration::from_secs(2), 1).unwrap();
    for n in 0..2u8 {
        let claim = store
            .claim(
                &RecordKey([n; 32]),
                &Fingerprint([1; 32]),
                Owner::new(),
                Duration::from_secs(30),
                None,
            )
            .await;
        let error = idemgate::telemetry::error_chain(&claim.unwrap_err());
        assert!(
            error.contains("Redis refused WAIT") && error.contains("no permissions to run the 'wait' command"),
            "{error}"
        );
    }
    let text = support::logs::text(&logs);
    assert!(!text.contains("may not run idemgate's scripts"), "{text}");
}

/// A second SIGTERM during the drain ends the process at once, instead of
/// leaving the operator to wait out `shutdown_grace` or reach for SIGKILL.
#[tokio::test]
async fn a_second_sigterm_ends_the_drain_at_once() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_secs(30))).await;
    let mut gate = Binary::start(
        &upstream.url(),
        "[server]\nshutdown_grace = \"60s\"\n[store]\nbackend = \"memory\"\n[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\n",
    )
    .await;
    let client = TestClient::default();
    tokio::spawn({
        let (client, url) = (client.clone(), gate.url("/v1/orders"));
        async move { client.post(&url, "slow", "").await }
    });
    while upstream.hits() < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    gate.signal("TERM");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(gate.wait(Duration::ZERO).is_none(), "the first signal drains");
    gate.signal("TERM");
    let status = gate.wait(Duration::from_secs(5)).expect("the second signal ends it");
    assert_eq!(status.code(), Some(1));
}

/// The admin listener lets go of a connection that sends no head, or a
/// part of one, within `header_read_timeout`, and of a kept-alive one that
/// goes quiet, as the proxy's listener does: none holds a socket for ever.
#[tokio::test]
async fn the_admin_listener_closes_connections_that_send_nothing() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let upstream = Upstream::created().await;
    let proxy = Proxy::start(&upstream.url(), "[server]\nheader_read_timeout = \"300ms\"\n").await;
    let admin = proxy.admin.unwrap();
    for sent in [
        "",
        "GET /healthz HTTP/1.1\r\nhost: x\r\n",
        "GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n",
    ] {
        let mut stream = tokio::net::TcpStream::connect(admin).await.unwrap();
        stream.write_all(sent.as_bytes()).await.unwrap();
        let mut seen = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut seen))
            .await
            .unwrap_or_else(|_| panic!("the admin connection sent {sent:?} was left open"))
            .unwrap();
        // The whole request was answered first.
        let seen = String::from_utf8_lossy(&seen);
        assert_eq!(seen.starts_with("HTTP/1.1 200"), sent.ends_with("\r\n\r\n"), "{seen}");
    }
}

/// Each request in flight holds a client and an upstream socket: under a
/// soft limit of 64 open files, as started, idemgate could take only a few
/// dozen clients at once. It raises the soft limit to the hard one.
#[tokio::test]
async fn hundreds_of_clients_fit_though_started_under_a_low_open_files_limit() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const CLIENTS: usize = 300;
    let mut hard = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only the struct it is given.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut hard) }, 0);
    if hard.rlim_max < 4 * CLIENTS as u64 {
        eprintln!(
            "skipped: the hard open files limit, {}, is below what the test needs",
            hard.rlim_max
        );
        return;
    }
    let upstream = Upstream::created().await;
    let toml = format!("[store]\nbackend = \"memory\"\n{}", support::ORDERS);
    let binary = Binary::start_with_open_files_limit(&upstream.url(), &toml, 64).await;
    // Every client connects and sends before any answer is read, and keeps
    // its connection open after its answer.
    let mut streams = Vec::with_capacity(CLIENTS);
    for i in 0..CLIENTS {
        let mut stream = tokio::net::TcpStream::connect(binary.addr).await.unwrap();
        let wire =
            format!("POST /v1/orders HTTP/1.1\r\nhost: x\r\nidempotency-key: fd-{i}\r\ncontent-length: 2\r\n\r\n{{}}");
        stream.write_all(wire.as_bytes()).await.unwrap();
        streams.push(stream);
    }
    let answers = streams.iter_mut().map(|stream| async move {
        let mut seen = Vec::new();
        let mut buf = [0u8; 1024];
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before an answer");
            seen.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&seen).into_owned()
    });
    let answers = tokio::time::timeout(Duration::from_secs(5), futures_util::future::join_all(answers))
        .await
        .expect("some clients were never answered");
    assert!(
        answers.iter().all(|head| head.starts_with("HTTP/1.1 201")),
        "{:?}",
        answers[0]
    );
    assert_eq!(upstream.hits(), CLIENTS);
}

/// Memory that a burst of large answers passed through (their buffers, and
/// records evicted since) goes back to the system once the proxy is idle,
/// as jemalloc left it to the next allocation that came: an idle proxy
/// held tens of MiB more than its store for good.
#[tokio::test]
async fn memory_a_burst_of_large_answers_used_goes_back_to_the_system() {
    let body = bytes::Bytes::from(vec![b'x'; 2 << 20]);
    let upstream = Upstream::start(move |_, _| Reply::Answer {
        delay: Duration::ZERO,
        status: StatusCode::CREATED,
        headers: vec![],
        chunks: vec![body.clone()],
        gap: Duration::ZERO,
    })
    .await;
    let config = format!(
        "[store]\nbackend = \"memory\"\nmax_memory = \"8MiB\"\n[defaults]\nmax_response_body = \"4MiB\"\n{}",
        support::ORDERS
    );
    let gate = Binary::start(&upstream.url(), &config).await;
    let before = gate.resident_bytes();
    let client = TestClient::default();
    for burst in 0..4 {
        let sends = (0..16).map(|i| {
            let (client, url) = (client.clone(), gate.url("/v1/orders"));
            tokio::spawn(async move { client.post(&url, &format!("big-{burst}-{i}"), "").await })
        });
        for send in sends.collect::<Vec<_>>() {
            let answer = send.await.unwrap();
            assert_eq!(answer.status, StatusCode::CREATED);
            assert_eq!(answer.body.len(), 2 << 20);
        }
    }
    let busy = gate.resident_bytes();
    let metrics = TestClient::default()
        .send("GET", &format!("http://{}/metrics", gate.admin), &[], "")
        .await
        .text();
    let stored: u64 = metrics
        .lines()
        .find_map(|line| line.strip_prefix("idemgate_stored_bytes "))
        .unwrap()
        .parse()
        .unwrap();
    // What the store holds and what the proxy had before, and a margin
    // for the allocator's own bookkeeping.
    let expected = before + stored + (12 << 20);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    while gate.resident_bytes() > expected {
        assert!(
            tokio::time::Instant::now() < deadline,
            "resident {} MiB after 40 s idle (at first {}, after the bursts {}, the store holding {} MiB)",
            gate.resident_bytes() >> 20,
            before >> 20,
            busy >> 20,
            stored >> 20
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
