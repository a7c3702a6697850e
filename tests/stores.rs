//! End to end on the durable and shared stores: restarts, crashes, many
//! replicas, and a store that goes away.

mod support;

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use support::redis::{
    RedisCluster, RedisServer, cluster_store_within, copied_store_within, redis_store, redis_store_within,
};
use support::{Binary, Proxy, Reply, TestClient, Upstream};
use tokio::time::Instant;

const ROUTE: &str = r#"
[[route]]
name = "orders"
path = "/v1/orders"
"#;

/// A config with the embedded store in `dir` and the orders route, with
/// `route` added to it.
fn embedded_in(dir: &std::path::Path, route: &str) -> String {
    let path = dir.join("idemgate.redb");
    format!(
        "[store]\nbackend = \"embedded\"\npath = \"{}\"\n{ROUTE}{route}",
        path.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_store_survives_kill_9_with_every_answer_and_claim() {
    let upstream = Upstream::start(|hit, seen| {
        if seen.uri.contains("slow") {
            Reply::created(hit).delayed(Duration::from_secs(30))
        } else {
            Reply::created(hit)
        }
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = embedded_in(dir.path(), "lock_timeout = \"2s\"\n");
    let client = TestClient::default();
    let mut first = Binary::start(&upstream.url(), &config).await;
    let mut answers = Vec::new();
    for i in 0..20 {
        // Half the answers have been checkpointed into the file by the
        // crash (every five seconds), half are only in the log.
        if i == 10 {
            tokio::time::sleep(Duration::from_millis(6000)).await;
        }
        let answer = client.post(&first.url("/v1/orders"), &format!("k{i}"), "{}").await;
        assert_eq!(answer.status, StatusCode::CREATED);
        answers.push(answer.body);
    }
    // A request in flight when the process dies.
    let in_flight = tokio::spawn({
        let url = first.url("/v1/orders?slow");
        async move {
            let client: hyper_util::client::legacy::Client<_, http_body_util::Full<bytes::Bytes>> =
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
            let request = http::Request::post(url)
                .header("idempotency-key", "slow")
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .unwrap();
            client.request(request).await.map(|r| r.status())
        }
    });
    while upstream.hits() < 21 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    first.kill9();
    assert!(in_flight.await.unwrap().is_err(), "the client saw the crash");

    let second = Binary::start(&upstream.url(), &config).await;
    for (i, body) in answers.iter().enumerate() {
        let replay = client.post(&second.url("/v1/orders"), &format!("k{i}"), "{}").await;
        assert!(replay.replayed(), "k{i} was lost");
        assert_eq!(&replay.body, body);
    }
    // The dead process's claim survived the restart until its lease ran out.
    let retry = |client: TestClient, url: String| async move {
        client.send("POST", &url, &[("idempotency-key", "slow")], "").await
    };
    let held = retry(client.clone(), second.url("/v1/orders?slow")).await;
    assert_eq!(held.status, StatusCode::CONFLICT, "{}", held.text());
    assert_eq!(upstream.hits(), 21);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    tokio::spawn(retry(client.clone(), second.url("/v1/orders?slow")));
    let deadline = Instant::now() + Duration::from_secs(3);
    while upstream.hits() < 22 {
        assert!(Instant::now() < deadline, "the key was never freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_store_whose_file_cannot_grow_stops_and_loses_nothing() {
    // 200 KiB answers (256 KiB blocks in redb, whose file grows by
    // doubling), each after 200 ms, to eight clients at once: some 200 in
    // the first five seconds, which outgrow the 24 MiB any file of the
    // first process may reach at the first checkpoint. The log's segments
    // (16 MiB each) fit.
    let upstream = Upstream::start(|hit, _| {
        Reply::status(201, &format!("{hit}{}", "x".repeat(200 << 10))).delayed(Duration::from_millis(200))
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = embedded_in(dir.path(), "");
    let client = TestClient::default();
    let mut first = Binary::start_with_file_size_limit(&upstream.url(), &config, 24 << 20).await;
    // Eight clients at once, so that requests are in flight when the file
    // fails: each is given its answer, and must get it again after the
    // restart (not a second run once its claim's lease has run out).
    let clients: Vec<_> = (0..8)
        .map(|c| {
            let (client, url) = (client.clone(), first.url("/v1/orders"));
            tokio::spawn(async move {
                let mut answers = Vec::new();
                for i in 0..1000 {
                    let key = format!("k{c}-{i}");
                    let answer = client.post(&url, &key, "{}").await;
                    if answer.status == StatusCode::SERVICE_UNAVAILABLE {
                        break; // the store failed already
                    }
                    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.text());
                    answers.push((key, answer.body));
                }
                answers
            })
        })
        .collect();
    let mut answers = Vec::new();
    for client in clients {
        answers.extend(client.await.unwrap());
    }
    assert!(
        answers.len() >= 20,
        "only {} answers before the store failed",
        answers.len()
    );
    // The checkpoint fails: the store says so rather than retrying a file
    // that redb no longer writes.
    let ready = format!("http://{}/readyz", first.admin);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let answer = client.send("GET", &ready, &[], "").await;
        if answer.status == StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        assert!(Instant::now() < deadline, "/readyz stayed {}", answer.status);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let refused = client.post(&first.url("/v1/orders"), "new", "{}").await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE, "{}", refused.text());
    assert_eq!(
        upstream.hits(),
        answers.len(),
        "a key reached the backend with no claim"
    );
    let log = first.log();
    assert!(
        log.contains("a write to the embedded store's file failed (") && log.contains("restart to recover"),
        "{log}"
    );
    assert!(!log.contains("completing the record failed"), "{log}");
    first.kill9();

    // Every answer is in the log, those of requests in flight as the file
    // failed too, and a restart (the disk has room again) puts them into
    // the file.
    let second = Binary::start(&upstream.url(), &config).await;
    for (key, body) in &answers {
        let replay = client.post(&second.url("/v1/orders"), key, "{}").await;
        assert!(replay.replayed(), "{key} was lost: {}", replay.status);
        assert_eq!(&replay.body, body, "{key}");
    }
    assert_eq!(upstream.hits(), answers.len());
    let ready = client
        .send("GET", &format!("http://{}/readyz", second.admin), &[], "")
        .await;
    assert_eq!(ready.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_one_redis_let_one_of_forty_through() {
    let redis = RedisServer::start();
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_millis(300))).await;
    let a = Proxy::start_with_store(&upstream.url(), ROUTE, redis_store(&redis.url())).await;
    let b = Proxy::start_with_store(&upstream.url(), ROUTE, redis_store(&redis.url())).await;
    let client = TestClient::default();
    let storm: Vec<_> = (0..40)
        .map(|i| {
            let url = if i % 2 == 0 {
                a.url("/v1/orders")
            } else {
                b.url("/v1/orders")
            };
            let client = client.clone();
            tokio::spawn(async move { client.post(&url, "shared", r#"{"n":1}"#).await })
        })
        .collect();
    let mut created = 0;
    for answer in storm {
        let answer = answer.await.unwrap();
        match answer.status {
            StatusCode::CREATED => created += 1,
            StatusCode::CONFLICT => assert_eq!(answer.problem(), "request-in-flight"),
            other => panic!("{other}: {}", answer.text()),
        }
    }
    assert!(created >= 1);
    assert_eq!(upstream.hits(), 1);
    let replay = client.post(&b.url("/v1/orders"), "shared", r#"{"n":1}"#).await;
    assert!(replay.replayed());
    assert_eq!(replay.text(), r#"{"order":1}"#);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_on_one_replica_is_woken_by_the_other_on_a_cluster() {
    let cluster = RedisCluster::start();
    let store = || cluster_store_within(&cluster.urls(), Duration::from_secs(2));
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_millis(400))).await;
    let route = "[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\non_in_flight = \"wait\"\n";
    let a = Proxy::start_with_store(&upstream.url(), route, store()).await;
    let b = Proxy::start_with_store(&upstream.url(), route, store()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let client = TestClient::default();
    let first = tokio::spawn({
        let (client, url) = (client.clone(), a.url("/v1/orders"));
        async move { client.post(&url, "w", "{}").await }
    });
    upstream.reached(1).await;
    let started = Instant::now();
    let waiter = client.post(&b.url("/v1/orders"), "w", "{}").await;
    let waited = started.elapsed();
    assert_eq!(waiter.status, StatusCode::CREATED, "{}", waiter.text());
    assert!(waiter.replayed());
    assert_eq!(first.await.unwrap().body, waiter.body);
    // A re-check would come a second after the wait began; the message
    // comes when the first request completes, ~400 ms in.
    assert!(
        waited < Duration::from_millis(1000),
        "woken by a re-check, not a message: {waited:?}"
    );
    assert_eq!(upstream.hits(), 1);
}

/// A TCP forwarder to `target`, as a virtual address or a DNS name of a
/// primary is: new connections go where `target` says now, made ones stay.
async fn virtual_address(target: Arc<std::sync::Mutex<u16>>) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (mut client, _) = listener.accept().await.unwrap();
            let to = *target.lock().unwrap();
            tokio::spawn(async move {
                if let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    port
}

/// A port that forwards to `target`, holding each chunk the client sends
/// for `delay` first: a store that takes that long to answer.
async fn slow_address(target: u16, delay: Duration) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (client, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await else {
                    return;
                };
                let ((mut client_reads, mut client_writes), (mut server_reads, mut server_writes)) =
                    (client.into_split(), server.into_split());
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut server_reads, &mut client_writes).await;
                });
                let mut buf = vec![0u8; 64 << 10];
                while let Ok(n @ 1..) = client_reads.read(&mut buf).await {
                    tokio::time::sleep(delay).await;
                    if server_writes.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// A loopback address that never completes a connection: a listener whose
/// accept queue is full, kept alive with its queue.
fn unanswering() -> (String, socket2::Socket, Vec<std::net::TcpStream>) {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket
        .bind(&"127.0.0.2:0".parse::<std::net::SocketAddr>().unwrap().into())
        .unwrap();
    socket.listen(0).unwrap();
    let addr = socket.local_addr().unwrap().as_socket().unwrap();
    let mut queued = Vec::new();
    for _ in 0..8 {
        match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(100)) {
            Ok(stream) => queued.push(stream),
            Err(_) => break,
        }
    }
    (format!("http://{addr}"), socket, queued)
}

/// The upstream's deadline runs from when the request is sent, not from
/// when the claim was: with a store that answers in 600 ms and
/// `upstream.timeout` of 1 s, an upstream that cannot be reached (its
/// connect capped at 500 ms) is "never sent" and released, not a timeout
/// after sending, which `on_upstream_failure = "unknown"` would keep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_claim_does_not_turn_an_unreachable_upstream_into_a_sent_request() {
    let redis = RedisServer::start();
    let port = slow_address(redis.port, Duration::from_millis(600)).await;
    let store = redis_store_within(&format!("redis://127.0.0.1:{port}/0"), Duration::from_secs(3));
    // Connected, and its scripts known to run (the first claim would
    // probe them first): each claim is then one slow round trip.
    store.ping().await.unwrap();
    let (unreachable, _socket, _queued) = unanswering();
    let config = format!("[upstream]\ntimeout = \"1s\"\n{ROUTE}on_upstream_failure = \"unknown\"\n");
    let proxy = Proxy::start_with_store(&unreachable, &config, store).await;
    let client = TestClient::default();
    for attempt in 0..2 {
        let answer = client.post(&proxy.url("/v1/orders"), "k", "{}").await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_GATEWAY,
            "attempt {attempt}: {}",
            answer.text()
        );
        assert_eq!(answer.problem(), "upstream-unavailable", "attempt {attempt}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_failover_behind_one_address_is_followed_without_a_restart() {
    let (old, new) = (RedisServer::start(), RedisServer::start());
    let target = Arc::new(std::sync::Mutex::new(old.port));
    let port = virtual_address(target.clone()).await;
    let upstream = Upstream::created().await;
    let store = redis_store(&format!("redis://127.0.0.1:{port}/0"));
    let proxy = Proxy::start_with_store(&upstream.url(), ROUTE, store).await;
    let client = TestClient::default();
    let ready = format!("http://{}/readyz", proxy.admin.unwrap());
    assert_eq!(
        client.post(&proxy.url("/v1/orders"), "before", "{}").await.status,
        StatusCode::CREATED
    );
    assert_eq!(client.send("GET", &ready, &[], "").await.status, StatusCode::OK);

    // The failover: the old primary becomes the new one's replica, and the
    // address now leads to the new one. The old stays up and keeps its
    // connections.
    old.cli(&["replicaof", "127.0.0.1", &new.port.to_string()]).unwrap();
    *target.lock().unwrap() = new.port;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut n = 0;
    // Answers held back: claimed on one thread's connection, which has
    // found the new primary, and completed on another's, which has not
    // yet (a READONLY); recorded later, on a retry of the completion.
    let mut held = 0;
    loop {
        n += 1;
        let answer = client.post(&proxy.url("/v1/orders"), &format!("after{n}"), "{}").await;
        if answer.status == StatusCode::CREATED {
            break;
        }
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{}", answer.text());
        held += usize::from(answer.text().contains("has not recorded its answer yet"));
        assert!(Instant::now() < deadline, "still no claim through the new primary");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        new.cli(&["dbsize"]).unwrap().trim() != "0",
        "the claim went to the new primary"
    );
    // Each thread's connection finds out on its own (ready again within
    // a second of its READONLY).
    while client.send("GET", &ready, &[], "").await.status != StatusCode::OK {
        assert!(Instant::now() < deadline, "/readyz never recovered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(upstream.hits(), 2 + held);

    // A store on the replica itself is not ready: it would take no claim.
    let on_replica = Proxy::start_with_store(&upstream.url(), ROUTE, redis_store(&old.url())).await;
    let ready = format!("http://{}/readyz", on_replica.admin.unwrap());
    assert_eq!(
        client.send("GET", &ready, &[], "").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
}

/// `store.wait_for_replicas`: Redis's replication is asynchronous, and a
/// claim or answer the primary took but no replica copied is lost in a
/// failover. With it, a request reaches the backend only once a replica
/// holds its claim, and the client has the answer's last byte only once a
/// replica holds the answer; a replica that does not copy them in time
/// makes the store unavailable (503), and the claim is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wait_for_replicas_a_request_runs_only_once_a_replica_holds_its_claim() {
    let primary = RedisServer::start();
    let replica = RedisServer::start_replica_of(&primary);
    let upstream = Upstream::created().await;
    let store = copied_store_within(&primary.url(), 1, Duration::from_secs(1));
    let proxy = Proxy::start_with_store(&upstream.url(), ROUTE, store).await;
    let client = TestClient::default();
    let orders = proxy.url("/v1/orders");
    let held = |server: &RedisServer| server.cli(&["--scan", "--pattern", "idemgate:*"]).unwrap();

    let copied = client.post(&orders, "copied", "{}").await;
    assert_eq!(copied.status, StatusCode::CREATED, "{}", copied.text());
    let on_replica = held(&replica);
    assert_eq!(on_replica.lines().count(), 1, "{on_replica:?}");
    assert_eq!(
        replica.cli(&["--no-raw", "get", on_replica.trim()]),
        primary.cli(&["--no-raw", "get", on_replica.trim()]),
        "the replica holds the answer, not the claim"
    );

    // Nothing copies: refused before the backend sees anything.
    replica.pause();
    let started = Instant::now();
    let refused = client.post(&orders, "uncopied", "{}").await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE, "{}", refused.text());
    assert_eq!(refused.problem(), "store-unavailable");
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    assert_eq!(upstream.hits(), 1);
    // A read waits for no copy (on Redis 7.0 every command, a read too,
    // moves the client's offset that WAIT waits for; it may also wait for
    // a WAIT under way on its connection, a third of the store timeout).
    let mut read = Err(String::new());
    for _ in 0..3 {
        read = proxy
            .store
            .inspect(&idemgate::store::RecordKey([7; 32]))
            .await
            .map_err(|e| e.to_string());
        if read.is_ok() {
            break;
        }
    }
    assert!(matches!(read, Ok(None)), "{read:?}");

    // Copying again: the refused key was released, and runs once.
    replica.resume();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let again = client.post(&orders, "uncopied", "{}").await;
        if again.status == StatusCode::CREATED && !again.replayed() {
            break;
        }
        assert!(
            again.status == StatusCode::SERVICE_UNAVAILABLE || again.status == StatusCode::CONFLICT,
            "{}",
            again.text()
        );
        assert!(Instant::now() < deadline, "the key never ran: {}", again.text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(upstream.hits(), 2);
    let replayed = client.post(&orders, "copied", "{}").await;
    assert!(replayed.replayed(), "{}", replayed.text());
    assert_eq!(held(&replica).lines().count(), 2);
    assert_eq!(upstream.hits(), 2);
}

/// A completion resent after its connection broke may find the answer
/// it wrote itself, written before Redis said a replica held it. Found
/// by a read over another connection, it is confirmed by a write on the
/// record (its expiry set to itself), which `WAIT` covers with all written
/// before it: while the only replica copies nothing, that is refused, and
/// once it copies again the replica holds the record, its time left kept.
/// A store without the setting confirms at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wait_for_replicas_an_answer_found_by_a_read_is_confirmed_copied() {
    use idemgate::store::{Claim, Fingerprint, Outcome, Owner, RecordKey, StoredResponse};
    let primary = RedisServer::start();
    let replica = RedisServer::start_replica_of(&primary);
    let store = copied_store_within(&primary.url(), 1, Duration::from_secs(1));
    let (key, fingerprint, owner) = (RecordKey([5; 32]), Fingerprint([6; 32]), Owner::new());
    let answer = Outcome::Response(Arc::new(StoredResponse::new(
        StatusCode::CREATED,
        &[],
        &[bytes::Bytes::from_static(b"kept")],
    )));
    let lease = Duration::from_secs(30);
    let claimed = store.claim(&key, &fingerprint, owner, lease, None).await.unwrap();
    assert_eq!(claimed, Claim::Claimed);

    // The completion lands on the primary alone, and is told it failed.
    replica.pause();
    let ttl = Duration::from_secs(3600);
    let completed = store.complete(&key, &fingerprint, owner, answer, ttl).await;
    assert!(completed.is_err(), "{completed:?}");
    let redis_key = primary.cli(&["--scan", "--pattern", "idemgate:*"]).unwrap();
    let redis_key = redis_key.trim();
    let expiry = |server: &RedisServer| {
        let at: u64 = server.cli(&["pexpiretime", redis_key]).unwrap().trim().parse().unwrap();
        at
    };
    let before = expiry(&primary);
    assert!(before > 0, "the answer is on the primary");

    // Found by a read over another connection, as after a reconnect: not
    // confirmed until the replica holds it.
    let again = copied_store_within(&primary.url(), 1, Duration::from_secs(1));
    let refused = again.confirm(&key, &fingerprint).await;
    assert!(refused.is_err(), "{refused:?}");
    let plain = redis_store(&primary.url());
    assert!(plain.confirm(&key, &fingerprint).await.unwrap(), "nothing to wait for");
    replica.resume();
    let deadline = Instant::now() + Duration::from_secs(10);
    while again.confirm(&key, &fingerprint).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "never confirmed once the replica copied again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !again.confirm(&key, &Fingerprint([7; 32])).await.unwrap(),
        "another request's answer"
    );
    assert!(
        !again.confirm(&RecordKey([8; 32]), &fingerprint).await.unwrap(),
        "no record"
    );
    // Its own to the millisecond that PTTL rounds to.
    let after = expiry(&primary);
    assert!(
        after.abs_diff(before) <= 2,
        "the record's time left is its own: {before} then {after}"
    );
    assert_eq!(expiry(&replica), after);
}

/// The failover `store.wait_for_replicas` is for: the primary is killed
/// (SIGKILL) the moment its last answer is out and while a request is in
/// flight, and the replica that acknowledged takes over at the same
/// address, the other following it, as Sentinel would have them. Every
/// answer a client got replays from the new primary, and the key in
/// flight is refused (409), not run again. (On loopback the replica would
/// mostly have had it all without `WAIT` too: the test above is the one
/// that fails without it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wait_for_replicas_a_failover_loses_no_answer_and_no_claim() {
    let mut primary = RedisServer::start();
    let replica = RedisServer::start_replica_of(&primary);
    let other = RedisServer::start_replica_of(&primary);
    // Only `replica` acknowledges, so it holds every write that counted.
    other.pause();
    let target = Arc::new(std::sync::Mutex::new(primary.port));
    let address = virtual_address(target.clone()).await;
    let upstream = Upstream::start(|hit, seen| {
        if seen.body.as_ref() == b"slow" {
            Reply::created(hit).delayed(Duration::from_secs(30))
        } else {
            Reply::created(hit)
        }
    })
    .await;
    let url = format!("redis://127.0.0.1:{address}/0");
    let store = copied_store_within(&url, 1, Duration::from_secs(1));
    let proxy = Proxy::start_with_store(&upstream.url(), ROUTE, store).await;
    let client = TestClient::default();
    let orders = proxy.url("/v1/orders");
    let mut answers = Vec::new();
    for n in 0..20 {
        let answer = client.post(&orders, &format!("done{n}"), "{}").await;
        assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.text());
        answers.push(answer.text());
    }
    let in_flight = {
        let (client, orders) = (client.clone(), orders.clone());
        tokio::spawn(async move { client.post(&orders, "slow", "slow").await })
    };
    upstream.reached(21).await;

    primary.kill();
    replica.cli(&["replicaof", "no", "one"]).unwrap();
    replica
        .cli(&["config", "set", "repl-diskless-sync-delay", "0"])
        .unwrap();
    *target.lock().unwrap() = replica.port;
    other.resume();
    other
        .cli(&["replicaof", "127.0.0.1", &replica.port.to_string()])
        .unwrap();

    // Each asked until the store is reached again, and the new primary's
    // replica acknowledges (503 meanwhile).
    let deadline = Instant::now() + Duration::from_secs(20);
    let settled = |key: String, body: &'static str| {
        let (client, orders) = (client.clone(), orders.clone());
        async move {
            loop {
                let answer = client.post(&orders, &key, body).await;
                if answer.status != StatusCode::SERVICE_UNAVAILABLE {
                    return answer;
                }
                assert!(Instant::now() < deadline, "{key}: the store never came back");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    for (n, first) in answers.iter().enumerate() {
        let again = settled(format!("done{n}"), "{}").await;
        assert!(again.replayed(), "done{n}: {}", again.text());
        assert_eq!(&again.text(), first, "done{n}");
    }
    let again = settled("slow".to_owned(), "slow").await;
    assert_eq!(again.status, StatusCode::CONFLICT, "{}", again.text());
    assert_eq!(again.problem(), "request-in-flight");
    assert_eq!(upstream.hits(), 21);
    in_flight.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_is_503_at_once_and_recovers_by_itself() {
    let mut redis = RedisServer::start();
    let upstream = Upstream::created().await;
    let reject = Proxy::start_with_store(&upstream.url(), ROUTE, redis_store(&redis.url())).await;
    let pass = Proxy::start_with_store(
        &upstream.url(),
        &format!("[store]\non_error = \"pass\"\n{ROUTE}"),
        redis_store(&redis.url()),
    )
    .await;
    let client = TestClient::default();
    assert_eq!(client.post(&reject.url("/v1/orders"), "before", "").await.status, 201);
    let admin = format!("http://{}/readyz", reject.admin.unwrap());
    assert_eq!(client.send("GET", &admin, &[], "").await.status, StatusCode::OK);

    redis.kill();
    for i in 0..3 {
        let started = Instant::now();
        let down = client.post(&reject.url("/v1/orders"), &format!("down{i}"), "").await;
        assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
        assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(down.problem(), "store-unavailable");
        assert_eq!(down.header("retry-after"), Some("1"));
    }
    assert_eq!(
        client.send("GET", &admin, &[], "").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let hits = upstream.hits();
    let passed = client.post(&pass.url("/v1/orders"), "passed", "").await;
    assert_eq!(passed.status, StatusCode::CREATED);
    assert_eq!(upstream.hits(), hits + 1, "on_error = pass forwards");
    assert!(pass.metrics.render(None).contains(r#"outcome="store_error"} 1"#));

    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let answer = client.post(&reject.url("/v1/orders"), "after", "").await;
        if answer.status == StatusCode::CREATED {
            break;
        }
        assert!(Instant::now() < deadline, "no recovery: {}", answer.text());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Each worker thread's connection comes back on its own first use: a
    // retry may still meet a 503 or 409, but never a second execution.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let again = client.post(&reject.url("/v1/orders"), "after", "").await;
        if again.replayed() {
            break;
        }
        // 503: this thread's connection is not back yet; 409: the first
        // completion met such a connection and is being retried.
        assert!(
            [StatusCode::SERVICE_UNAVAILABLE, StatusCode::CONFLICT].contains(&again.status),
            "{}",
            again.text()
        );
        assert!(Instant::now() < deadline, "never replayed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while client.send("GET", &admin, &[], "").await.status != StatusCode::OK {
        assert!(Instant::now() < deadline, "/readyz never recovered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A waiter that Redis's loss wakes claims again, until its `wait_timeout`,
/// and meets the store down: it was told another request holds the key, so
/// even with `on_error = "pass"` it answers 409 rather than forward a
/// certain duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_claim_again_fails_is_409_even_when_store_errors_pass() {
    let mut redis = RedisServer::start();
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_secs(2))).await;
    let proxy = Proxy::start_with_store(
        &upstream.url(),
        &format!("[store]\non_error = \"pass\"\n[defaults]\non_in_flight = \"wait\"\nwait_timeout = \"2s\"\n{ROUTE}"),
        redis_store(&redis.url()),
    )
    .await;
    let client = TestClient::default();
    let post = || {
        let (client, url) = (client.clone(), proxy.url("/v1/orders"));
        tokio::spawn(async move { client.post(&url, "w", "{}").await })
    };
    let first = post();
    let deadline = Instant::now() + Duration::from_secs(5);
    while upstream.hits() == 0 {
        assert!(Instant::now() < deadline, "the first request never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let waiter = post();
    // Waiting: the record carries a waiter's one-byte mark (50 -> 51 bytes).
    let marked = "for _, k in ipairs(redis.call('KEYS', '*')) do \
                  if redis.call('STRLEN', k) == 51 then return 1 end end return 0";
    while redis.cli(&["EVAL", marked, "0"]).as_deref().map(str::trim) != Some("1") {
        assert!(Instant::now() < deadline, "the second request never waited");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    redis.kill();
    let waiter = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter was not woken")
        .unwrap();
    assert_eq!(waiter.status, StatusCode::CONFLICT, "{}", waiter.text());
    assert_eq!(waiter.problem(), "request-in-flight");
    assert_eq!(upstream.hits(), 1, "the waiter was forwarded while the first ran");
    let _ = first.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_request_holds_the_key_until_its_lease_runs_out() {
    let redis = RedisServer::start();
    let upstream = Upstream::start(|hit, _| {
        if hit == 1 {
            Reply::created(hit).delayed(Duration::from_secs(30))
        } else {
            Reply::created(hit)
        }
    })
    .await;
    let config = format!(
        "[store]\nbackend = \"redis\"\nurl = \"{}\"\n[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\nlock_timeout = \"1500ms\"\n",
        redis.url()
    );
    let mut doomed = Binary::start(&upstream.url(), &config).await;
    let survivor = Proxy::start_with_store(&upstream.url(), &config, redis_store(&redis.url())).await;
    let client = TestClient::default();
    tokio::spawn({
        let (client, url) = (client.clone(), doomed.url("/v1/orders"));
        async move { client.post(&url, "crash", "{}").await }
    });
    while upstream.hits() < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    doomed.kill9();
    let killed_at = Instant::now();
    let held = client.post(&survivor.url("/v1/orders"), "crash", "{}").await;
    assert_eq!(held.status, StatusCode::CONFLICT);
    loop {
        let answer = client.post(&survivor.url("/v1/orders"), "crash", "{}").await;
        if answer.status == StatusCode::CREATED {
            break;
        }
        assert_eq!(answer.status, StatusCode::CONFLICT);
        assert!(killed_at.elapsed() < Duration::from_secs(5), "the lease never ran out");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(killed_at.elapsed() >= Duration::from_millis(500), "freed too early");
    assert_eq!(upstream.hits(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_the_store_did_not_take_is_retried_until_it_lands() {
    let redis = RedisServer::start();
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_millis(1000))).await;
    let proxy = Proxy::start_with_store(&upstream.url(), ROUTE, redis_store(&redis.url())).await;
    let client = TestClient::default();
    let first = tokio::spawn({
        let (client, url) = (client.clone(), proxy.url("/v1/orders"));
        async move { client.post(&url, "paused", "{}").await }
    });
    upstream.reached(1).await;
    // Writes stall for 3.5 s: the completion a second after the claim
    // times out (1 s), and the answer is held back, as it is not recorded
    // (a proxy stopped now would lose it): the client is told to retry.
    assert!(redis.cli(&["client", "pause", "3500", "write"]).is_some());
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{}", first.text());
    assert_eq!(first.problem(), "store-unavailable");
    assert!(
        first.text().contains("has not recorded its answer yet"),
        "{}",
        first.text()
    );
    // The claim the retried completion holds is counted as held.
    let claims_held = || async {
        let metrics = client
            .send("GET", &format!("http://{}/metrics", proxy.admin.unwrap()), &[], "")
            .await
            .text();
        let line = metrics.lines().find(|l| l.starts_with("idemgate_claims_in_flight "));
        line.and_then(|l| l.rsplit(' ').next()?.parse::<i64>().ok())
    };
    assert_eq!(claims_held().await, Some(1));
    // Once writes resume, the retried completion lands: a replay, well
    // before the 30 s lease could have run out.
    replay_once_landed(&client, &proxy.url("/v1/orders"), "paused").await;
    assert_eq!(upstream.hits(), 1);
    // Counted out as the retry ends, a moment after the record landed.
    let deadline = Instant::now() + Duration::from_secs(1);
    while claims_held().await != Some(0) {
        assert!(
            Instant::now() < deadline,
            "the landed completion's claim is still counted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A streamed answer whose completion the store fails is cut off before
/// its last byte (the client never holds a whole answer that is not
/// recorded), and its retry replays it once the completion lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_the_store_did_not_record_is_cut_before_its_last_byte() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let redis = RedisServer::start();
    let upstream = Upstream::start(|hit, _| Reply::Answer {
        delay: Duration::ZERO,
        status: StatusCode::CREATED,
        headers: vec![],
        chunks: vec![
            bytes::Bytes::from(format!("order {hit};")),
            bytes::Bytes::from_static(b" done"),
        ],
        gap: Duration::from_millis(1500),
    })
    .await;
    let proxy = Proxy::start_with_store(&upstream.url(), ROUTE, redis_store(&redis.url())).await;
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let request = "POST /v1/orders HTTP/1.1\r\nhost: x\r\nidempotency-key: cut\r\n\
                   content-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
    stream.write_all(request.as_bytes()).await.unwrap();
    upstream.reached(1).await;
    // The body ends 1.5 s in; its completion then times out (1 s).
    assert!(redis.cli(&["client", "pause", "4000", "write"]).is_some());
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0; 4096];
        while let Ok(n @ 1..) = stream.read(&mut buf).await {
            answer.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&answer).into_owned();
    assert!(text.starts_with("HTTP/1.1 201"), "{text}");
    assert!(text.contains("order 1"), "{text}");
    assert!(!text.contains("done") && !text.ends_with("0\r\n\r\n"), "{text}");
    let client = TestClient::default();
    let replay = replay_once_landed(&client, &proxy.url("/v1/orders"), "cut").await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.text(), "order 1; done");
    assert_eq!(upstream.hits(), 1);
}

/// Retries `key` at `url` until its record, whose completion is being
/// retried, lands and replays (within 8 s): 503 while the store's writes
/// stall, 409 while the completion is pending.
async fn replay_once_landed(client: &TestClient, url: &str, key: &str) -> support::Answer {
    let deadline = Instant::now() + Duration::from_secs(8);
    loop {
        let retry = client.post(url, key, "{}").await;
        if retry.replayed() {
            return retry;
        }
        assert!(
            [StatusCode::CONFLICT, StatusCode::SERVICE_UNAVAILABLE].contains(&retry.status),
            "{}",
            retry.text()
        );
        assert!(Instant::now() < deadline, "the completion never landed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// An answer whose record the store failed still goes to the client whole
/// where holding it back would not help: with `on_error = "pass"`
/// (availability first: its retry would be forwarded unprotected), in
/// shadow mode (which changes no answer), and over `max_response_body`
/// (never replayed anyway).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_the_store_did_not_record_is_delivered_where_holding_it_back_would_not_help() {
    let redis = RedisServer::start();
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_millis(1000))).await;
    let configs = [
        format!("[store]\non_error = \"pass\"\n{ROUTE}"),
        format!("{ROUTE}mode = \"shadow\"\n"),
        format!("{ROUTE}max_response_body = \"4B\"\n"),
    ];
    let client = TestClient::default();
    for (n, config) in configs.iter().enumerate() {
        let proxy = Proxy::start_with_store(&upstream.url(), config, redis_store(&redis.url())).await;
        let first = tokio::spawn({
            let (client, url) = (client.clone(), proxy.url("/v1/orders"));
            // A key of its own: the last proxy's completion, retried, may
            // land after the flush below.
            let key = format!("delivered{n}");
            async move { client.post(&url, &key, "{}").await }
        });
        upstream.reached(n + 1).await;
        assert!(redis.cli(&["client", "pause", "2500", "write"]).is_some());
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "{config}: {}", first.text());
        assert_eq!(first.text(), format!(r#"{{"order":{}}}"#, n + 1));
        assert!(redis.cli(&["client", "unpause"]).is_some());
        assert!(redis.cli(&["flushall"]).is_some());
    }
}

/// A completion that writes a large record is given its bytes' time on
/// top of the store timeout: bounded by the timeout alone, a record of
/// many megabytes would time out on every try, each retry sending it
/// whole again, until its `ttl`. Here Redis's writes stall 0.6 s, past
/// the 100 ms timeout: a small record's completion times out, and a 16
/// MiB record's (given about a second more) lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_record_is_given_time_to_be_written() {
    use bytes::Bytes;
    use idemgate::store::{Claim, Fingerprint, Outcome, Owner, RecordKey, StoreError, StoredResponse};
    let redis = RedisServer::start();
    let store = redis_store_within(&redis.url(), Duration::from_millis(100));
    let (small, large, owner) = (RecordKey([1; 32]), RecordKey([2; 32]), Owner::new());
    let fingerprint = Fingerprint([7; 32]);
    let lease = Duration::from_secs(30);
    for key in [&small, &large] {
        let claim = store.claim(key, &fingerprint, owner, lease, None).await.unwrap();
        assert_eq!(claim, Claim::Claimed);
    }
    let outcome = |body: Bytes| Outcome::Response(Arc::new(StoredResponse::new(StatusCode::CREATED, &[], &[body])));
    let ttl = Duration::from_secs(60);
    assert!(redis.cli(&["client", "pause", "600", "write"]).is_some());
    let timed_out = store
        .complete(&small, &fingerprint, owner, outcome(Bytes::from_static(b"{}")), ttl)
        .await;
    assert!(matches!(timed_out, Err(StoreError::Timeout(_))), "{timed_out:?}");
    let body = Bytes::from(vec![b'x'; 16 << 20]);
    let landed = store.complete(&large, &fingerprint, owner, outcome(body), ttl).await;
    assert!(matches!(landed, Ok(true)), "{landed:?}");
}

/// A Redis that cannot be reached (each connection taken, its greeting read,
/// and hung up unanswered) meets a connect a few times a second, backing
/// off, however many claims come; each claim fails at once as not sent,
/// naming the cause.
#[tokio::test]
async fn an_unreachable_redis_is_tried_a_few_times_a_second_not_once_a_claim() {
    use idemgate::store::{Fingerprint, Owner, RecordKey, StoreError};
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = accepted.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            use std::io::Read;
            let mut stream = stream.unwrap();
            let mut first = [0u8; 64];
            let n = stream.read(&mut first).unwrap_or(0);
            // The store's own connections greet so; the redis crate's (for
            // the completion subscription) start otherwise.
            if first[..n] == *b"*1\r\n$4\r\nPING\r\n" {
                counted.fetch_add(1, Ordering::SeqCst);
            }
            drop(stream);
        }
    });
    let store = redis_store(&format!("redis://127.0.0.1:{port}"));
    let started = Instant::now();
    let mut claims = 0u32;
    while started.elapsed() < Duration::from_millis(400) {
        let key = RecordKey([(claims % 251) as u8; 32]);
        let claim = store
            .claim(&key, &Fingerprint([1; 32]), Owner::new(), Duration::from_secs(30), None)
            .await;
        assert!(matches!(claim, Err(StoreError::NotSent(_))), "{claim:?}");
        // Those the back-off turns away still say why the last connect failed.
        let why = format!("{claim:?}");
        assert!(why.contains("closed the connection while it was set up"), "{why}");
        claims += 1;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Attempts at 0, 25, 75, 175 and 375 ms (each failure doubles the wait).
    let connects = accepted.load(Ordering::SeqCst);
    assert!((2..=6).contains(&connects), "{connects} connects for {claims} claims");
    assert!(claims >= 50, "{claims}");
}

/// A claim written to a Redis Cluster node whose answer is lost with the
/// connection, and whose resend then cannot connect, may have been taken:
/// it fails as a store that failed, not as one never sent, so it is
/// released (and asked again until the node is back) rather than left to
/// hold the key for its whole lease.
#[tokio::test]
async fn a_cluster_claim_whose_answer_was_lost_is_released_once_the_node_is_back() {
    use idemgate::store::{Fingerprint, Owner, RecordKey, StoreError};
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let node = RedisServer::start_one_shard_cluster();
    // A relay in front of the node, which the node names as its address:
    // once `armed`, it passes a claim (`SET`) on, then drops the
    // connection before the answer, and turns new connections away
    // (accepted, then closed) while `open` is false.
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_port = relay.local_addr().unwrap().port();
    node.cli(&["config", "set", "cluster-announce-port", &relay_port.to_string()])
        .unwrap();
    let (armed, open) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(true)));
    let (node_port, cut, open_too) = (node.port, armed.clone(), open.clone());
    tokio::spawn(async move {
        loop {
            let (client, _) = relay.accept().await.unwrap();
            if !open_too.load(Ordering::SeqCst) {
                continue;
            }
            let server = tokio::net::TcpStream::connect(("127.0.0.1", node_port)).await.unwrap();
            let (cut, open) = (cut.clone(), open_too.clone());
            tokio::spawn(async move {
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                let mut answers = tokio::spawn(async move { tokio::io::copy(&mut from_server, &mut to_client).await });
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    let n = from_client.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    if buf[..n].windows(5).any(|w| w == b"\r\nSET") && cut.swap(false, Ordering::SeqCst) {
                        open.store(false, Ordering::SeqCst);
                        // No answer goes back from here on; the node runs it.
                        answers.abort();
                        let _ = (&mut answers).await;
                        to_server.write_all(&buf[..n]).await.unwrap();
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        break;
                    }
                    to_server.write_all(&buf[..n]).await.unwrap();
                }
                answers.abort();
            });
        }
    });
    let store = cluster_store_within(&[format!("redis://127.0.0.1:{relay_port}")], Duration::from_secs(1));
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.ping().await.is_err() {
        assert!(Instant::now() < deadline, "the cluster did not answer");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let (key, fingerprint) = (RecordKey([7; 32]), Fingerprint([1; 32]));
    armed.store(true, Ordering::SeqCst);
    let claim = store
        .claim(&key, &fingerprint, Owner::new(), Duration::from_secs(30), None)
        .await;
    assert!(matches!(claim, Err(StoreError::Unavailable(_))), "{claim:?}");
    assert!(!armed.load(Ordering::SeqCst), "the claim never reached the relay");
    tokio::time::sleep(Duration::from_millis(300)).await;
    open.store(true, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match store.inspect(&key).await {
            Ok(None) => break,
            found => assert!(Instant::now() < deadline, "the claim was left to its lease: {found:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A Redis Cluster none of whose nodes can be reached backs off the same
/// way: the first claim fails as not sent, naming the cause; the next, at
/// once, by the back-off, without trying the nodes; one after the back-off
/// tries them again.
#[tokio::test]
async fn an_unreachable_cluster_is_not_tried_again_at_once() {
    use idemgate::store::{Fingerprint, Owner, RecordKey, StoreError};
    let down = support::unreachable_url().replace("http://", "redis://");
    let store = cluster_store_within(&[down], Duration::from_secs(1));
    let claim = || async {
        let claim = store
            .claim(
                &RecordKey([1; 32]),
                &Fingerprint([1; 32]),
                Owner::new(),
                Duration::from_secs(30),
                None,
            )
            .await;
        assert!(matches!(claim, Err(StoreError::NotSent(_))), "{claim:?}");
        format!("{claim:?}")
    };
    let mut sent = std::time::Instant::now();
    let first = claim().await;
    assert!(
        first.contains("could not be reached") && !first.contains("next attempt"),
        "{first}"
    );
    // The back-off is 25 ms after the first failure, doubling: a claim
    // sent within it of the failed one's sending must not try the nodes. A
    // claim that came later (a loaded host) says nothing, and the next is
    // judged against the doubled back-off.
    let mut backoff = Duration::from_millis(25);
    let held = 'tries: {
        for _ in 0..5 {
            let failed = sent;
            sent = std::time::Instant::now();
            let next = claim().await;
            assert!(next.contains("could not be reached"), "{next}");
            if next.contains("next attempt") {
                break 'tries true;
            }
            // The back-off runs from the failure, after the failed claim
            // was sent, and is looked at before this one is answered.
            let answered = std::time::Instant::now();
            assert!(answered - failed >= backoff, "tried again at once: {next}");
            backoff *= 2;
        }
        false
    };
    assert!(held, "no claim came within a back-off: the host is too loaded to tell");
    // Past the longest back-off (a second), the nodes are tried again.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let third = claim().await;
    assert!(!third.contains("next attempt"), "{third}");
}

/// A Redis Cluster node of the test's own, on `listener`: it answers
/// `CLUSTER SLOTS` after `delay` with every slot served by the node on
/// `owner`, `PING` with `PONG` and anything else with an error, and notes
/// every command it reads.
fn fake_node(listener: std::net::TcpListener, owner: u16, delay: Duration) -> Arc<std::sync::Mutex<Vec<String>>> {
    use std::io::{BufRead, Write};
    fn command(reader: &mut impl BufRead) -> Option<Vec<String>> {
        let mut line = String::new();
        reader.read_line(&mut line).ok()?;
        let count: usize = line.trim_end().strip_prefix('*')?.parse().ok()?;
        let mut args = Vec::new();
        for _ in 0..count {
            line.clear();
            reader.read_line(&mut line).ok()?;
            let len: usize = line.trim_end().strip_prefix('$')?.parse().ok()?;
            let mut arg = vec![0; len + 2];
            reader.read_exact(&mut arg).ok()?;
            args.push(String::from_utf8_lossy(&arg[..len]).into_owned());
        }
        Some(args)
    }
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let noted = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let noted = noted.clone();
            std::thread::spawn(move || {
                let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
                while let Some(args) = command(&mut reader) {
                    let line = args.join(" ");
                    noted.lock().unwrap().push(line.clone());
                    let answer = match line.to_ascii_uppercase().as_str() {
                        "PING" => "+PONG\r\n".to_owned(),
                        "CLUSTER SLOTS" => {
                            std::thread::sleep(delay);
                            format!("*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:{owner}\r\n")
                        }
                        _ => "-ERR a node of the test's own\r\n".to_owned(),
                    };
                    if stream.write_all(answer.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    seen
}

/// A node whose slot map the others do not share does not decide where
/// claims go by answering first: a primary that resumes after a pause
/// answers at once with its view from before the cluster failed it over,
/// and claims sent by it would land on a node about to drop them. Here the
/// first node answers at once that it serves every slot, and the other
/// two, 30 ms later, that the second does: the claim goes to the second.
#[tokio::test]
async fn a_node_whose_map_the_others_do_not_share_is_outvoted() {
    use idemgate::store::{Fingerprint, Owner, RecordKey};
    let listeners: Vec<_> = (0..3)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let ports: Vec<u16> = listeners.iter().map(|l| l.local_addr().unwrap().port()).collect();
    let seen: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(node, listener)| match node {
            0 => fake_node(listener, ports[0], Duration::ZERO),
            _ => fake_node(listener, ports[1], Duration::from_millis(30)),
        })
        .collect();
    let urls: Vec<String> = ports.iter().map(|port| format!("redis://127.0.0.1:{port}")).collect();
    let store = cluster_store_within(&urls, Duration::from_secs(2));
    // The nodes answer it with an error: only where it went matters.
    let _ = store
        .claim(
            &RecordKey([3; 32]),
            &Fingerprint([3; 32]),
            Owner::new(),
            Duration::from_secs(30),
            None,
        )
        .await;
    let keyed = |node: usize| {
        let seen = seen[node].lock().unwrap();
        seen.iter().filter(|command| command.contains("idemgate:{")).count()
    };
    assert!(keyed(1) >= 1, "{:?}", seen[1].lock().unwrap());
    assert_eq!(keyed(0), 0, "{:?}", seen[0].lock().unwrap());
    assert_eq!(keyed(2), 0);
}

/// A proxy on a Redis of its own, store calls bounded by `store_timeout`,
/// `route_extra` added to the route; one request answered, then Redis's
/// writes paused for `pause_ms`. With when the pause began.
async fn paused_after_one(
    store_timeout: Duration,
    route_extra: &str,
    pause_ms: &str,
) -> (RedisServer, Upstream, Proxy, TestClient, Instant) {
    let redis = RedisServer::start();
    let upstream = Upstream::created().await;
    let store = redis_store_within(&redis.url(), store_timeout);
    let proxy = Proxy::start_with_store(&upstream.url(), &format!("{ROUTE}{route_extra}"), store).await;
    let client = TestClient::default();
    assert_eq!(client.post(&proxy.url("/v1/orders"), "warm", "{}").await.status, 201);
    assert!(redis.cli(&["client", "pause", pause_ms, "write"]).is_some());
    (redis, upstream, proxy, client, Instant::now())
}

/// A claim the store took only after the proxy stopped waiting for it is
/// released all the same: its retry runs, and does not meet a 409 until the
/// lease (30 s) runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_timed_out_is_released_once_the_store_takes_it() {
    // Writes stall for 2.5 s: the claim is queued, and times out at 1 s.
    let (_redis, upstream, proxy, client, paused_at) = paused_after_one(Duration::from_secs(1), "", "2500").await;
    let stalled = client.post(&proxy.url("/v1/orders"), "stalled", "{}").await;
    assert_eq!(stalled.status, StatusCode::SERVICE_UNAVAILABLE, "{}", stalled.text());
    assert_eq!(stalled.problem(), "store-unavailable");
    assert_eq!(upstream.hits(), 1, "a request without a claim is not forwarded");
    while paused_at.elapsed() < Duration::from_millis(2700) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // 503 while a worker's connection is still catching up.
    let deadline = Instant::now() + Duration::from_secs(5);
    runs_in_the_end(&client, &proxy, "stalled", StatusCode::SERVICE_UNAVAILABLE, deadline).await;
    assert_eq!(upstream.hits(), 2);
}

/// Retries `key` until it runs (201, not a replay) before `deadline`, each
/// answer until then `meanwhile`.
async fn runs_in_the_end(client: &TestClient, proxy: &Proxy, key: &str, meanwhile: StatusCode, deadline: Instant) {
    loop {
        let retry = client.post(&proxy.url("/v1/orders"), key, "{}").await;
        if retry.status == StatusCode::CREATED {
            assert!(!retry.replayed());
            return;
        }
        assert_eq!(retry.status, meanwhile, "{}", retry.text());
        assert!(Instant::now() < deadline, "the claim was not released in time");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A claim the store answers only after half its lease (a store timeout
/// longer than that) is refused, not forwarded: the lease may have run out
/// on the way and another request may hold the key by now, or it would run
/// out before a renewal as slow as the claim lands. It is released, so the
/// retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_answered_after_half_its_lease_is_refused_and_released() {
    // Writes stall for 1.8 s: the claim, sent within 0.8 s of the pause's
    // start, is answered after half its 2 s lease.
    let (_redis, upstream, proxy, client, _) =
        paused_after_one(Duration::from_secs(3), "lock_timeout = \"2s\"\n", "1800").await;
    let late = client.post(&proxy.url("/v1/orders"), "late", "{}").await;
    assert_eq!(late.status, StatusCode::SERVICE_UNAVAILABLE, "{}", late.text());
    assert_eq!(late.problem(), "store-unavailable");
    assert_eq!(upstream.hits(), 1, "not forwarded");
    // Released, the key is free at once; left to its lease, not for 2 s.
    let deadline = Instant::now() + Duration::from_millis(1500);
    runs_in_the_end(&client, &proxy, "late", StatusCode::CONFLICT, deadline).await;
    assert_eq!(upstream.hits(), 2);
}

/// A claim still unanswered a whole lease after it timed out (a store
/// stalled that long) may yet be taken when the store wakes: it is
/// released all the same, and the retry does not meet a 409 for another
/// lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_unanswered_for_a_lease_is_released_all_the_same() {
    // Writes stall for 5 s: the claim times out at 1 s, is seen through
    // for its 3 s lease, and is taken at 5 s with a lease to 8 s.
    let (_redis, upstream, proxy, client, paused_at) =
        paused_after_one(Duration::from_secs(1), "lock_timeout = \"3s\"\n", "5000").await;
    let stalled = client.post(&proxy.url("/v1/orders"), "stalled", "{}").await;
    assert_eq!(stalled.status, StatusCode::SERVICE_UNAVAILABLE, "{}", stalled.text());
    while paused_at.elapsed() < Duration::from_millis(5200) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // 503 while a worker's connection is still catching up, never 409;
    // before 7.9 s, ahead of the stalled claim's own lease freeing the key.
    let deadline = paused_at + Duration::from_millis(7900);
    runs_in_the_end(&client, &proxy, "stalled", StatusCode::SERVICE_UNAVAILABLE, deadline).await;
    assert_eq!(upstream.hits(), 2);
}

/// A record the store holds but cannot read (damaged, or written by a newer
/// version) is not the store being down: with `on_error = "pass"` the
/// request is still refused, as forwarding it could run it twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_record_is_refused_even_when_store_errors_pass() {
    let redis = RedisServer::start();
    let upstream = Upstream::created().await;
    let proxy = Proxy::start_with_store(
        &upstream.url(),
        &format!("[store]\non_error = \"pass\"\n{ROUTE}"),
        redis_store(&redis.url()),
    )
    .await;
    let client = TestClient::default();
    assert_eq!(client.post(&proxy.url("/v1/orders"), "k", "{}").await.status, 201);
    let keys = redis.cli(&["keys", "idemgate:*"]).unwrap();
    let record = keys.lines().find(|k| k.ends_with('}')).expect("the record's key");
    assert_eq!(redis.cli(&["set", record, "\u{7f}garbage"]).unwrap().trim(), "OK");
    let retry = client.post(&proxy.url("/v1/orders"), "k", "{}").await;
    assert_eq!(retry.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(retry.problem(), "store-unavailable");
    assert_eq!(upstream.hits(), 1, "not forwarded");
    // Another key still passes the store by as configured when it is down.
    assert_eq!(client.post(&proxy.url("/v1/orders"), "k2", "{}").await.status, 201);
}

/// A Redis user the ACL denies scripts could claim (`SET NX GET`) but never
/// complete, renew or release: a request would run, and its retry run it
/// again once the lease ran out. The store is not ready, and takes no
/// claim, until scripts are granted.
#[tokio::test]
async fn a_redis_user_denied_scripts_takes_no_claim() {
    use idemgate::store::{Claim, Fingerprint, Outcome, Owner, RecordKey};
    let redis = RedisServer::start();
    redis
        .cli(&["acl", "setuser", "gate", "on", ">pw", "~*", "+@all", "-@scripting"])
        .expect("the user is made");
    let store = redis_store(&redis.url().replace("redis://", "redis://gate:pw@"));
    let (key, fp, lease) = (RecordKey([8; 32]), Fingerprint([1; 32]), Duration::from_secs(30));
    assert!(store.ping().await.is_err(), "ready without scripts");
    assert!(store.claim(&key, &fp, Owner::new(), lease, None).await.is_err());
    assert_eq!(
        redis
            .cli(&["exists", &format!("idemgate:{{{}}}", hex(&key.0))])
            .unwrap()
            .trim(),
        "0"
    );

    // Scripts, but not a command they call: the ACL checks those too.
    redis
        .cli(&["acl", "setuser", "gate", "+@scripting", "-pexpire"])
        .expect("granted");
    assert!(store.ping().await.is_err(), "ready without PEXPIRE");
    // A claim by script would go through (GET and SET); it waits on the
    // probe instead, which calls PEXPIRE as renewals do.
    assert!(store.claim(&key, &fp, Owner::new(), lease, None).await.is_err());

    // The README's user, with no more than it names: all works.
    let readme = [
        "acl",
        "setuser",
        "least",
        "on",
        ">pw",
        "~idemgate:*",
        "&idemgate:done",
        "+set",
        "+get",
        "+mget",
        "+del",
        "+append",
        "+pexpire",
        "+pttl",
        "+publish",
        "+evalsha",
        "+eval",
        "+subscribe",
    ];
    redis.cli(&readme).expect("the user is made");
    let store = redis_store(&redis.url().replace("redis://", "redis://least:pw@"));
    store.ping().await.expect("ready");
    let owner = Owner::new();
    assert_eq!(
        store.claim(&key, &fp, owner, lease, None).await.unwrap(),
        Claim::Claimed
    );
    assert!(store.renew(&key, owner, lease).await.unwrap());
    let done = store.complete(&key, &fp, owner, Outcome::NotReplayable, lease).await;
    assert!(matches!(done, Ok(true)), "{done:?}");
    let replay = store.claim(&key, &fp, Owner::new(), lease, Some(lease)).await.unwrap();
    assert!(matches!(replay, Claim::Completed { .. }), "{replay:?}");
    assert!(store.purge(&key).await.unwrap());
}

/// `bytes` in lower-case hex.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A Redis user the ACL denies the completion channel (Redis 7's default
/// for new users) still completes a record a waiter marked: the
/// announcement is best effort, the write is not.
#[tokio::test]
async fn a_redis_user_denied_the_channel_still_completes_a_waited_on_record() {
    use idemgate::store::{Claim, Fingerprint, Outcome, Owner, RecordKey};
    let redis = RedisServer::start_with_args(&["--acl-pubsub-default", "resetchannels"]);
    redis
        .cli(&["acl", "setuser", "gate", "on", ">pw", "~*", "+@all"])
        .expect("the user is made");
    let url = redis.url().replace("redis://", "redis://gate:pw@");
    let store = redis_store(&url);
    let (key, fp, owner) = (RecordKey([7; 32]), Fingerprint([1; 32]), Owner::new());
    let lease = Duration::from_secs(30);
    assert_eq!(
        store.claim(&key, &fp, owner, lease, None).await.unwrap(),
        Claim::Claimed
    );
    // A waiter marks the record.
    let waiter = tokio::spawn({
        let store = store.clone();
        async move { store.wait(&key, Duration::from_secs(3)).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let done = store
        .complete(&key, &fp, owner, Outcome::NotReplayable, Duration::from_secs(60))
        .await;
    assert!(matches!(done, Ok(true)), "{done:?}");
    let _ = waiter.await;
    assert!(matches!(
        store.claim(&key, &fp, Owner::new(), lease, None).await.unwrap(),
        Claim::Completed { .. }
    ));
}

/// A waiter (`on_in_flight = "wait"`) whose store stops answering for a
/// while claims again, within `wait_timeout`, and gets the first request's
/// answer: a moment's outage is no 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_rides_out_a_store_that_stops_answering_for_a_while() {
    let server = RedisServer::start();
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_millis(1500))).await;
    let route =
        "[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\non_in_flight = \"wait\"\nwait_timeout = \"10s\"\n";
    let store = redis_store_within(&server.url(), Duration::from_millis(300));
    let proxy = Proxy::start_with_store(&upstream.url(), route, store).await;
    let client = TestClient::default();
    let first = tokio::spawn({
        let (client, url) = (client.clone(), proxy.url("/v1/orders"));
        async move { client.post(&url, "w", "{}").await }
    });
    while upstream.hits() < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let waiter = tokio::spawn({
        let (client, url) = (client.clone(), proxy.url("/v1/orders"));
        async move { client.post(&url, "w", "{}").await }
    });
    // The waiter claims again a second into its wait (or when woken), and
    // finds writes paused for two: claims time out until then, and the
    // first request's completion lands on a retry after (its client, told
    // so, gets a 503: its answer was not recorded when it came).
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(server.cli(&["client", "pause", "2000", "write"]).is_some());
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{}", first.text());
    let waiter = waiter.await.unwrap();
    assert_eq!(waiter.status, StatusCode::CREATED, "{}", waiter.text());
    assert!(waiter.replayed());
    assert_eq!(waiter.text(), r#"{"order":1}"#);
    assert_eq!(upstream.hits(), 1);
}

/// Sends each line of `commands` to the Redis on `port`, through one
/// redis-cli (thousands of `CLUSTER SETSLOT`s, say).
fn cli_lines(port: u16, commands: &str) {
    use std::io::Write;
    let mut child = std::process::Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(commands.as_bytes()).unwrap();
    assert!(child.wait().unwrap().success());
}

/// Slots being migrated (`ASK` redirects) under concurrent load, to a node
/// just added, which holds no slots yet: every request is claimed and
/// completed where the slot's keys now go, and its retry replayed.
/// redis-rs's own redirect sends `ASKING` and the command apart, and under
/// load another command took the flag between them: the redirected ones
/// were answered `MOVED`, and the slot map rebuilds that followed stalled
/// the cluster connection (nearly every request 503). And the cluster
/// client keeps no connection to a node that holds no slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_migrating_slots_under_load_answers_every_request() {
    let cluster = RedisCluster::start();
    let added = RedisServer::start_cluster_node();
    let first = &cluster.nodes[0];
    assert!(
        first
            .cli(&["cluster", "meet", "127.0.0.1", &added.port.to_string()])
            .is_some()
    );
    let id = |node: &RedisServer| node.cli(&["cluster", "myid"]).unwrap().trim().to_string();
    let ids = [id(first), id(&added)];
    let deadline = Instant::now() + Duration::from_secs(10);
    for node in cluster.nodes.iter().chain([&added]) {
        while !node
            .cli(&["cluster", "nodes"])
            .is_some_and(|n| n.lines().count() == 4 && !n.contains("handshake") && !n.contains("noaddr"))
        {
            assert!(Instant::now() < deadline, "the node was never met");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let upstream = Upstream::created().await;
    let store = cluster_store_within(&cluster.urls(), Duration::from_secs(2));
    let proxy = Proxy::start_with_store(&upstream.url(), ROUTE, store).await;
    let client = TestClient::default();
    assert_eq!(client.post(&proxy.url("/v1/orders"), "warm", "{}").await.status, 201);
    // The first node's slots (a third of them), on their way to the new one.
    let importing: String = (0..5461)
        .map(|s| format!("cluster setslot {s} importing {}\n", ids[0]))
        .collect();
    cli_lines(added.port, &importing);
    let migrating: String = (0..5461)
        .map(|s| format!("cluster setslot {s} migrating {}\n", ids[1]))
        .collect();
    cli_lines(first.port, &migrating);
    let runs: Vec<_> = (0..300)
        .map(|i| {
            let (client, url) = (client.clone(), proxy.url("/v1/orders"));
            tokio::spawn(async move {
                let key = format!("ask-{i}");
                let first = client.post(&url, &key, "{}").await;
                let again = client.post(&url, &key, "{}").await;
                (first.status.as_u16(), again.status.as_u16(), again.replayed())
            })
        })
        .collect();
    let mut tally = std::collections::BTreeMap::new();
    for run in runs {
        *tally.entry(run.await.unwrap()).or_insert(0) += 1;
    }
    assert_eq!(
        tally,
        [((201, 201, true), 300)].into(),
        "(first, retry, replayed): requests"
    );
    assert_eq!(upstream.hits(), 301);
    // The records of the migrating slots went to the new node.
    let there = added.cli(&["dbsize"]).unwrap();
    assert!(there.trim().parse::<u32>().unwrap() > 50, "{there}");
}
