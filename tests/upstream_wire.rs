//! The upstream client on the wire: every way an HTTP/1.1 answer can be
//! framed, interim answers, and keep-alive reuse, against a raw TCP upstream
//! that writes exactly the bytes given and counts its connections.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::StatusCode;
use support::{Proxy, TestClient};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// What the raw upstream writes for a request path, and whether it then
/// closes the connection.
fn script(path: &str) -> (&'static [u8], bool) {
    match path {
        "/length" => (b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nlength", false),
        "/chunked" => (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3;x=y\r\nchu\r\n4\r\nnked\r\n0\r\nx-sum: 7\r\n\r\n",
            false,
        ),
        // More chunks at once than are taken with the head: streamed.
        "/many-chunks" => (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n1\r\nb\r\n1\r\nc\r\n1\r\nd\r\n1\r\ne\r\n1\r\nf\r\n1\r\ng\r\n1\r\nh\r\n1\r\ni\r\n1\r\nj\r\n1\r\nk\r\n1\r\nl\r\n1\r\nm\r\n1\r\nn\r\n1\r\no\r\n1\r\np\r\n1\r\nq\r\n1\r\nr\r\n1\r\ns\r\n1\r\nt\r\n0\r\n\r\n",
            false,
        ),
        "/until-close" => (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil close", true),
        "/interim" => (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 7\r\n\r\ninterim",
            false,
        ),
        "/no-content" => (b"HTTP/1.1 204 No Content\r\n\r\n", false),
        // One length, spelled as a list and again: read as one, and passed
        // on (a 304 has no body to measure) as one number.
        "/not-modified" => (
            b"HTTP/1.1 304 Not Modified\r\ncontent-length: 7, 7\r\ncontent-length: 7\r\n\r\n",
            false,
        ),
        // A length with a body, spelled as a list: one number downstream,
        // as HTTP/2 clients take no other (recorded and replayed so too).
        "/listed-length" => (b"HTTP/1.1 200 OK\r\ncontent-length: 6, 6\r\n\r\nlisted", false),
        // Both: transfer-encoding wins, and content-length must not reach
        // the client beside a body of another length.
        "/both" => (
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n4\r\nboth\r\n0\r\n\r\n",
            false,
        ),
        // Answers, then hangs up without saying so: the idle connection
        // must not be reused.
        "/then-close" => (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nthen-close", true),
        "/said-close" => (b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 10\r\n\r\nsaid-close", false),
        "/garbage" => (b"HTTP/9 what\r\n\r\n", true),
        // Codings only the client could undo, which would reach it
        // undeclared once this hop's Transfer-Encoding is dropped; and
        // Transfer-Encoding on HTTP/1.0, whose framing is then faulty.
        "/gzip-chunked" => (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n4\r\ngzip\r\n0\r\n\r\n",
            false,
        ),
        "/chunked-1.0" => (
            b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\nten!\r\n0\r\n\r\n",
            true,
        ),
        // Whole answers with more header fields than a request may have
        // (taken), and than an answer may have (refused).
        "/many-headers" => (with_fields(200), false),
        "/too-many-headers" => (with_fields(300), false),
        // A refusal of this hop's framing, with a status that says the
        // backend did not act.
        "/busy-gzip" => (
            b"HTTP/1.1 429 Too Many Requests\r\ntransfer-encoding: gzip, chunked\r\n\r\n4\r\nbusy\r\n0\r\n\r\n",
            false,
        ),
        // Hop-by-hop headers in every spelling and place: a header named
        // by a later `Connection` line, and options beside names.
        "/hop" | "/hop-recorded" => (
            b"HTTP/1.1 200 OK\r\nX-Named: 1\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n\
              connection: X-Named , x-other\r\nx-other: 2\r\nUpgrade: h2c\r\nTrailer: x-sum\r\n\
              Proxy-Connection: keep-alive\r\nTE: trailers\r\nx-kept: yes\r\ncontent-length: 3\r\n\r\nhop",
            false,
        ),
        // A token beside obs-text is still a token: a name, or `close`.
        "/hop-obs" => (
            b"HTTP/1.1 200 OK\r\nConnection: X-Internal, \xe9\r\nX-Internal: secret\r\ncontent-length: 3\r\n\r\nobs",
            false,
        ),
        "/close-obs" => (
            b"HTTP/1.1 200 OK\r\nConnection: close, \xe9\r\ncontent-length: 9\r\n\r\nclose-obs",
            false,
        ),
        // The first request on a connection is answered; a later one is
        // read and the connection closed unanswered (see `raw_upstream`).
        "/dropped" | "/dropped-claimed" => (b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\ndropped", false),
        // Heads cut off after their status: one that says the backend
        // acted, and one that says it did not.
        "/cut-head" => (b"HTTP/1.1 201 Created\r\nlocation: /v1/orders/77\r\n", true),
        // A code below 100 is no status, but an answer all the same.
        "/below-100" => (b"HTTP/1.1 099 Weird\r\ncontent-length: 5\r\n\r\nhello", false),
        "/cut-below-100" => (b"HTTP/1.1 000 Zero\r\ncontent-", true),
        "/cut-busy" => (b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\n", true),
        // Interim heads cut off, and refused: no answer yet.
        "/cut-interim" => (b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n", true),
        "/bad-interim" => (b"HTTP/1.1 103 Early Hints\r\nno colon here\r\n\r\n", true),
        // Heads that stop after their status, the connection left open.
        "/stall-head" => (b"HTTP/1.1 201 Created\r\nlocation: /v1/orders/78\r\n", false),
        "/stall-busy" => (b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\n", false),
        "/stall-continue" => (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\n", false),
        "/stall-interim" => (b"HTTP/1.1 100 Continue\r\n\r\n", false),
        "/stall-below-100" => (b"HTTP/1.1 099 Weird\r\n", false),
        _ => (b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n", false),
    }
}

/// A 201 with `count` header fields besides its `content-length`.
fn with_fields(count: usize) -> &'static [u8] {
    let mut head = b"HTTP/1.1 201 Created\r\n".to_vec();
    for i in 0..count {
        head.extend_from_slice(format!("x-field-{i}: {i}\r\n").as_bytes());
    }
    head.extend_from_slice(b"content-length: 4\r\n\r\nmany");
    Vec::leak(head)
}

struct RawUpstream {
    url: String,
    connections: Arc<AtomicUsize>,
    /// Connections the proxy closed.
    closed: Arc<AtomicUsize>,
    bodies: Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
}

async fn raw_upstream() -> RawUpstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let connections = Arc::new(AtomicUsize::new(0));
    let closed = Arc::new(AtomicUsize::new(0));
    let bodies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (count, seen, hung_up) = (connections.clone(), bodies.clone(), closed.clone());
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            count.fetch_add(1, Ordering::SeqCst);
            let (seen, hung_up) = (seen.clone(), hung_up.clone());
            tokio::spawn(async move {
                let mut buf = Vec::new();
                for served in 0.. {
                    // One request: its head, then its content-length body.
                    let Some(head_end) = head_end(&mut socket, &mut buf).await else {
                        hung_up.fetch_add(1, Ordering::SeqCst);
                        return;
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length: "))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    while buf.len() < head_end + length {
                        let mut chunk = [0u8; 4096];
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    seen.lock().unwrap().push(buf[head_end..head_end + length].to_vec());
                    let path = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
                    buf.drain(..head_end + length);
                    // An idle connection the upstream closes as the next
                    // request reaches it.
                    if path.starts_with("/dropped") && served > 0 {
                        return;
                    }
                    // `/dribble/<path>`: `<path>`'s answer a byte at a time.
                    if let Some(path) = path.strip_prefix("/dribble") {
                        let (answer, close) = script(path);
                        socket.set_nodelay(true).unwrap();
                        for byte in answer {
                            if socket.write_all(&[*byte]).await.is_err() {
                                return;
                            }
                            tokio::time::sleep(Duration::from_micros(200)).await;
                        }
                        if close {
                            return;
                        }
                        continue;
                    }
                    // A 204 that declares a body, and sends it a moment
                    // after the head: stray bytes on the connection.
                    if path == "/no-content-with-body" {
                        let head = b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n";
                        if socket.write_all(head).await.is_err() {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        if socket.write_all(b"stray").await.is_err() {
                            return;
                        }
                        continue;
                    }
                    let (answer, close) = script(&path);
                    if socket.write_all(answer).await.is_err() || close {
                        return;
                    }
                }
            });
        }
    });
    RawUpstream {
        url,
        connections,
        closed,
        bodies,
    }
}

/// The raw upstream behind a proxy configured by `toml`.
async fn behind_proxy(toml: &str) -> (RawUpstream, Proxy) {
    let upstream = raw_upstream().await;
    let proxy = Proxy::start(&upstream.url, toml).await;
    (upstream, proxy)
}

const CHUNKED_ROUTE: &str = "[[route]]\nname = \"chunked\"\npath = \"/chunked\"\n";

/// An answer sent a byte at a time (its head parsed as each line ends, not
/// after each byte) reaches the client as the same answer sent at once,
/// interim answers, chunks, trailers and hop-by-hop headers alike.
#[tokio::test]
async fn answers_sent_a_byte_at_a_time_arrive_as_sent_whole() {
    let (_upstream, proxy) = behind_proxy("").await;
    let client = TestClient::default();
    for path in ["/interim", "/chunked", "/hop", "/length", "/garbage"] {
        let whole = client.send("GET", &proxy.url(path), &[], "").await;
        let dribbled = client
            .send("GET", &proxy.url(&format!("/dribble{path}")), &[], "")
            .await;
        assert_eq!(dribbled.status, whole.status, "{path}");
        assert_eq!(dribbled.body, whole.body, "{path}");
        let headers = |r: &support::Answer| {
            let mut h: Vec<String> = r
                .headers
                .iter()
                .filter(|(n, _)| *n != "date")
                .map(|(n, v)| format!("{n}: {v:?}"))
                .collect();
            h.sort();
            h
        };
        assert_eq!(headers(&dribbled), headers(&whole), "{path}");
    }
}

#[tokio::test]
async fn every_framing_arrives_whole_and_connections_are_reused() {
    let (upstream, proxy) = behind_proxy("").await;
    let client = TestClient::default();
    let get = |path: &'static str| {
        let (client, url) = (client.clone(), proxy.url(path));
        async move { client.send("GET", &url, &[], "").await }
    };

    for _ in 0..5 {
        assert_eq!(get("/length").await.text(), "length");
    }
    assert_eq!(
        upstream.connections.load(Ordering::SeqCst),
        1,
        "one kept-alive connection"
    );

    assert_eq!(get("/chunked").await.text(), "chunked");
    let interim = get("/interim").await;
    assert_eq!(interim.status, StatusCode::CREATED);
    assert_eq!(interim.text(), "interim");
    assert_eq!(get("/no-content").await.status, StatusCode::NO_CONTENT);
    // More fields than a request may have (hyper's client takes 100: read
    // raw).
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(b"GET /many-headers HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut many = Vec::new();
    stream.read_to_end(&mut many).await.unwrap();
    let many = String::from_utf8(many).unwrap();
    assert!(many.starts_with("HTTP/1.1 201"), "{many}");
    assert!(
        many.contains("x-field-199: 199\r\n") && many.ends_with("\r\n\r\nmany"),
        "{many}"
    );
    let not_modified = get("/not-modified").await;
    assert_eq!(not_modified.status, StatusCode::NOT_MODIFIED);
    let lengths: Vec<_> = not_modified.headers.get_all("content-length").iter().collect();
    assert_eq!(lengths, ["7"], "RFC 9110 §8.6: one number");
    assert_eq!(
        upstream.connections.load(Ordering::SeqCst),
        1,
        "still the same connection"
    );

    // Framed both ways: read as chunked, but what follows on that
    // connection cannot be trusted, so it is not reused.
    let both = get("/both").await;
    assert_eq!(both.text(), "both");
    assert_ne!(both.header("content-length"), Some("2"));
    assert_eq!(get("/length").await.text(), "length");
    assert_eq!(
        upstream.connections.load(Ordering::SeqCst),
        2,
        "content-length beside chunked ends the connection"
    );

    assert_eq!(get("/until-close").await.text(), "until close");
    assert_eq!(get("/length").await.text(), "length");
    assert_eq!(
        upstream.connections.load(Ordering::SeqCst),
        3,
        "a body ended by close ends the connection"
    );

    assert_eq!(get("/said-close").await.text(), "said-close");
    assert_eq!(get("/length").await.text(), "length");
    assert_eq!(
        upstream.connections.load(Ordering::SeqCst),
        4,
        "connection: close is honoured"
    );

    // The upstream hangs up an idle connection: the next request notices
    // before sending and takes a new one instead of failing.
    assert_eq!(get("/then-close").await.text(), "then-close");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(get("/length").await.text(), "length");
    assert_eq!(upstream.connections.load(Ordering::SeqCst), 5);

    // A 204 may declare no body (RFC 9110 §8.6): one that does may send
    // it, and those bytes would be read as the answer to the next request
    // on that connection. It is not reused.
    assert_eq!(get("/no-content-with-body").await.status, StatusCode::NO_CONTENT);
    assert_eq!(get("/length").await.text(), "length");
    assert_eq!(upstream.connections.load(Ordering::SeqCst), 6);

    assert_eq!(get("/garbage").await.status, StatusCode::BAD_GATEWAY);
}

/// A pooled connection the upstream closes as a request reaches it (the
/// race between its idle timer and the proxy's reuse): an idempotent
/// request no route claims goes again on a new connection, once, as with
/// nginx; a POST, or a claimed exchange, is never sent twice.
#[tokio::test]
async fn a_request_the_upstream_dropped_on_a_pooled_connection_goes_again_only_if_idempotent() {
    let (upstream, proxy) = behind_proxy("[[route]]\nname = \"claimed\"\npath = \"/dropped-claimed\"\n").await;
    let client = TestClient::default();
    let sent = || upstream.bodies.lock().unwrap().len();
    let connections = || upstream.connections.load(Ordering::SeqCst);
    // The first GET on a new connection; the second on it, dropped, and
    // sent again on another.
    for _ in 0..2 {
        let answer = client.send("GET", &proxy.url("/dropped"), &[], "").await;
        assert_eq!((answer.status, answer.text().as_str()), (StatusCode::OK, "dropped"));
    }
    assert_eq!((sent(), connections()), (3, 2));
    // A POST no route claims, on the pooled connection: dropped, not resent.
    let post = client.send("POST", &proxy.url("/dropped"), &[], "x").await;
    assert_eq!(post.status, StatusCode::BAD_GATEWAY);
    assert_eq!((sent(), connections()), (4, 2));
    // A claimed POST: answered on a new connection; the next key's, on the
    // pooled one, is dropped and not resent.
    assert_eq!(
        client.post(&proxy.url("/dropped-claimed"), "d1", "{}").await.status,
        StatusCode::OK
    );
    let dropped = client.post(&proxy.url("/dropped-claimed"), "d2", "{}").await;
    assert_eq!(dropped.status, StatusCode::BAD_GATEWAY, "{}", dropped.text());
    assert_eq!((sent(), connections()), (6, 3));
}

/// A method a route takes is one the operator has said is not safe to
/// repeat: forwarded without a claim (here a retry shadow mode lets
/// through), it is not resent either when its pooled connection drops it.
#[tokio::test]
async fn a_put_a_route_takes_is_not_resent_when_forwarded_without_a_claim() {
    let route = "[[route]]\nname = \"puts\"\npath = \"/dropped-claimed\"\nmethods = [\"PUT\"]\nmode = \"shadow\"\n";
    let (upstream, proxy) = behind_proxy(route).await;
    let client = TestClient::default();
    let url = proxy.url("/dropped-claimed");
    let put = || client.send("PUT", &url, &[("idempotency-key", "p1")], "{}");
    assert_eq!(put().await.status, StatusCode::OK);
    let again = put().await;
    assert_eq!(again.status, StatusCode::BAD_GATEWAY, "{}", again.text());
    let sent = upstream.bodies.lock().unwrap().len();
    assert_eq!((sent, upstream.connections.load(Ordering::SeqCst)), (2, 1));
}

/// The same over HTTP/2: a GET whose HEADERS end the stream has no body
/// to hold back, and goes again as one over HTTP/1.1 does.
#[tokio::test]
async fn a_bodiless_http2_request_the_upstream_dropped_goes_again_too() {
    let (upstream, proxy) = behind_proxy("").await;
    let client = support::h2_client();
    for _ in 0..2 {
        let request = http::Request::get(proxy.url("/dropped"))
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        let response = client.request(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    let sent = upstream.bodies.lock().unwrap().len();
    assert_eq!((sent, upstream.connections.load(Ordering::SeqCst)), (3, 2));
}

/// Answers this hop cannot pass on are 502s. Through a route, one whose
/// head begins with a status says the backend had the request: even where
/// `on_upstream_failure` releases a key after a reset, the key is kept as
/// an unknown outcome and a retry does not run the request again, unless
/// the status says the backend did not act (a 429). One that is not HTTP
/// at all (another service on the port) is released as a reset is.
#[tokio::test]
async fn answers_this_hop_cannot_pass_on_are_bad_gateways_that_keep_their_keys() {
    let (upstream, proxy) = behind_proxy(
        r#"
[[route]]
name = "refused"
path = "/{answer}"
on_upstream_failure = "release"
"#,
    )
    .await;
    let client = TestClient::default();
    let paths = [
        ("/gzip-chunked", true),
        ("/chunked-1.0", true),
        ("/too-many-headers", true),
        ("/garbage", false),
        ("/busy-gzip", false),
        ("/cut-head", true),
        ("/cut-busy", false),
        ("/below-100", true),
        ("/cut-below-100", true),
    ];
    for (path, _) in paths {
        let answer = client.send("GET", &proxy.url(path), &[], "").await;
        assert_eq!(answer.status, StatusCode::BAD_GATEWAY, "{path}: {}", answer.text());
        // Passed through: the upstream was reached, and answered so.
        assert!(
            answer.text().contains("the upstream's answer cannot be passed on"),
            "{path}: {}",
            answer.text()
        );
    }
    for (path, kept) in paths {
        let key = format!("k{path}");
        for _ in 0..2 {
            let answer = client.post(&proxy.url(path), &key, "{}").await;
            assert_eq!(answer.status, StatusCode::BAD_GATEWAY, "{path}: {}", answer.text());
            let problem = if kept {
                "outcome-unknown"
            } else {
                "upstream-unavailable"
            };
            assert_eq!(answer.problem(), problem, "{path}");
        }
    }
    // Each path's GET and first POST, and the second POST where released.
    let released = paths.iter().filter(|(_, kept)| !kept).count();
    assert_eq!(upstream.bodies.lock().unwrap().len(), 2 * paths.len() + released);
}

/// An interim (1xx) head cut off, or one that does not parse, says
/// nothing of whether the backend acts on the request: as when one came
/// whole and the connection then broke, `on_upstream_failure` settles it
/// (here "release": the retry runs), where a final answer's status would
/// keep the key as an unknown outcome.
#[tokio::test]
async fn an_interim_head_cut_off_or_refused_is_settled_as_no_answer() {
    let (upstream, proxy) = behind_proxy(
        r#"
[[route]]
name = "interim"
path = "/{answer}"
on_upstream_failure = "release"
"#,
    )
    .await;
    let client = TestClient::default();
    let paths = ["/cut-interim", "/bad-interim"];
    for path in paths {
        let key = format!("k{path}");
        for _ in 0..2 {
            let answer = client.post(&proxy.url(path), &key, "{}").await;
            assert_eq!(answer.status, StatusCode::BAD_GATEWAY, "{path}: {}", answer.text());
            assert_eq!(answer.problem(), "upstream-unavailable", "{path}: {}", answer.text());
        }
    }
    assert_eq!(upstream.bodies.lock().unwrap().len(), 2 * paths.len());
}

/// A head that stops after its status line until `upstream.timeout` is
/// a 504, settled by that status as a head cut off by a reset is: one that
/// says the backend acted keeps its key as an unknown outcome, even where
/// `on_upstream_failure = "release"`; a 429 is released. An interim 100
/// says nothing of the outcome: `on_upstream_failure` decides.
#[tokio::test]
async fn a_head_that_stalls_after_its_status_is_settled_by_that_status() {
    let (upstream, proxy) = behind_proxy(
        r#"
[upstream]
timeout = "300ms"
[[route]]
name = "stalled"
path = "/{answer}"
on_upstream_failure = "release"
"#,
    )
    .await;
    let client = TestClient::default();
    let paths = [
        ("/stall-head", true),
        ("/stall-continue", true),
        ("/stall-busy", false),
        ("/stall-interim", false),
        ("/stall-below-100", true),
    ];
    for (path, kept) in paths {
        let key = format!("k{path}");
        let first = client.post(&proxy.url(path), &key, "{}").await;
        assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT, "{path}: {}", first.text());
        assert_eq!(first.problem(), "upstream-timeout", "{path}");
        let retry = client.post(&proxy.url(path), &key, "{}").await;
        if kept {
            assert_eq!(retry.status, StatusCode::BAD_GATEWAY, "{path}: {}", retry.text());
            assert_eq!(retry.problem(), "outcome-unknown", "{path}");
        } else {
            assert_eq!(retry.status, StatusCode::GATEWAY_TIMEOUT, "{path}: {}", retry.text());
        }
    }
    // Each path's first POST, and the retry where released.
    let released = paths.iter().filter(|(_, kept)| !kept).count();
    assert_eq!(upstream.bodies.lock().unwrap().len(), paths.len() + released);
}

/// An upstream that answers before reading the body (here a 413) and
/// closes with the body unread, which resets the connection while the
/// request is still being written: its answer stands, and is recorded.
#[tokio::test]
async fn an_answer_sent_before_the_body_was_read_stands() {
    let (proxy, requests) = answering_early(
        b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 9\r\n\r\ntoo large",
        false,
    )
    .await;
    let client = TestClient::default();
    // Far more than the sockets between them hold, so the write is still
    // going when the reset comes.
    let big = "x".repeat(16 << 20);
    let first = client.post(&proxy.url("/upload"), "u1", &big).await;
    assert_eq!(first.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", first.text());
    assert_eq!(first.text(), "too large");
    let again = client.post(&proxy.url("/upload"), "u1", &big).await;
    assert!(again.replayed());
    assert_eq!(again.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(requests.load(Ordering::SeqCst), 1);
}

/// An early answer whose head is cut off after its status (a 201) says
/// the backend acted, as it would had the write gone through: its key is
/// kept as an unknown outcome, not released to run again.
#[tokio::test]
async fn an_early_answer_cut_off_after_its_status_keeps_its_key() {
    let (proxy, requests) = answering_early(b"HTTP/1.1 201 Created\r\nlocation: /uploads/1\r\n", false).await;
    let client = TestClient::default();
    let big = "x".repeat(16 << 20);
    for _ in 0..2 {
        let answer = client.post(&proxy.url("/upload"), "u2", &big).await;
        assert_eq!(answer.status, StatusCode::BAD_GATEWAY, "{}", answer.text());
        assert_eq!(answer.problem(), "outcome-unknown");
    }
    assert_eq!(requests.load(Ordering::SeqCst), 1);
}

/// An upstream that answers an upload with a 201 once it has the
/// request's head, then neither reads the body nor closes: the body's
/// write waits (a 2xx may come from an upstream that answers as it reads,
/// and goes on reading), until upstream.timeout. The 201 says the backend
/// acted: its key is kept as an unknown outcome, even with `release`,
/// not run again.
#[tokio::test]
async fn a_2xx_sent_before_the_body_was_read_keeps_its_key_when_the_upstream_holds_on() {
    let answer = b"HTTP/1.1 201 Created\r\nlocation: /uploads/3\r\ncontent-length: 7\r\n\r\ncreated";
    let (proxy, requests) = answering_early(answer, true).await;
    let client = TestClient::default();
    let big = "x".repeat(16 << 20);
    let first = client.post(&proxy.url("/upload"), "u3", &big).await;
    assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT, "{}", first.text());
    let again = client.post(&proxy.url("/upload"), "u3", &big).await;
    assert_eq!(again.status, StatusCode::BAD_GATEWAY, "{}", again.text());
    assert_eq!(again.problem(), "outcome-unknown");
    assert_eq!(requests.load(Ordering::SeqCst), 1);
}

/// A connection on which an answer began before the request's body went
/// out whole is not reused: the upstream may not have read the rest of
/// the body (here it answers 413, reads most of it and holds on), and a
/// next request written after it would never be read.
#[tokio::test]
async fn a_connection_that_answered_before_the_body_went_whole_is_not_reused() {
    let (url, connections) = counting_upstream(|mut socket| async move {
        let mut read = Vec::new();
        if head_end(&mut socket, &mut read).await.is_none() {
            return;
        }
        if read.starts_with(b"POST /upload ") {
            let answer = b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 9\r\n\r\ntoo large";
            let _ = socket.write_all(answer).await;
            // Most of the body, then nothing more read: the rest
            // fits in the sockets' buffers, and its write ends.
            let mut taken = 0;
            while taken < 14 << 20 {
                let mut chunk = [0u8; 65536];
                match socket.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => taken += n,
                }
            }
            tokio::time::sleep(Duration::from_secs(30)).await;
        } else {
            let _ = socket
                .write_all(b"HTTP/1.1 201 Created\r\ncontent-length: 7\r\n\r\norder-1")
                .await;
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
    })
    .await;
    let routes = "[server]\nmax_request_body = \"32MiB\"\n[[route]]\nname = \"upload\"\npath = \"/upload\"\n";
    let proxy = Proxy::start(
        &url,
        &format!("[upstream]\ntimeout = \"5s\"\n{routes}{}", support::ORDERS),
    )
    .await;
    let client = TestClient::default();
    let upload = client.post(&proxy.url("/upload"), "u6", &"x".repeat(16 << 20)).await;
    assert_eq!(upload.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", upload.text());
    let order = client.post(&proxy.url("/v1/orders"), "o6", "{}").await;
    assert_eq!(order.status, StatusCode::CREATED, "{}", order.text());
    assert_eq!(connections.load(Ordering::SeqCst), 2);
}

/// An upstream that answers an error without reading a small body, which
/// went out whole with the head, and keeps the connection open (RFC 9112
/// §9.3 says it must read the body or close; a legacy server may not): the
/// connection is not reused, so the unread body never becomes the start of
/// another client's request, which such a server would answer 400, and a
/// claimed request would keep that answer under its key.
#[tokio::test]
async fn a_connection_that_answered_an_error_to_a_request_with_a_body_is_not_reused() {
    let (url, connections) = counting_upstream(|mut socket| async move {
        // A keep-alive server that reads heads only: a body it does not
        // read stays in front of the next head.
        let mut read = Vec::new();
        loop {
            let Some(end) = head_end(&mut socket, &mut read).await else {
                return;
            };
            let head: Vec<u8> = read.drain(..end).collect();
            let answer: &[u8] = if head.starts_with(b"POST /upload ") {
                b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 6\r\n\r\nwho?\r\n"
            } else if head.starts_with(b"POST /v1/orders ") {
                read.drain(..2.min(read.len()));
                b"HTTP/1.1 201 Created\r\ncontent-length: 7\r\n\r\norder-1"
            } else {
                let _ = socket
                    .write_all(b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 7\r\n\r\ngarbage")
                    .await;
                return;
            };
            if socket.write_all(answer).await.is_err() {
                return;
            }
        }
    })
    .await;
    let routes = "[[route]]\nname = \"upload\"\npath = \"/upload\"\n";
    let proxy = Proxy::start(&url, &format!("[server]\nworkers = 1\n{routes}{}", support::ORDERS)).await;
    let client = TestClient::default();
    let upload = client.post(&proxy.url("/upload"), "u7", &"x".repeat(1000)).await;
    assert_eq!(upload.status, StatusCode::UNAUTHORIZED, "{}", upload.text());
    let order = client.post(&proxy.url("/v1/orders"), "o7", "{}").await;
    assert_eq!(order.status, StatusCode::CREATED, "{}", order.text());
    assert_eq!(order.text(), "order-1");
    assert_eq!(connections.load(Ordering::SeqCst), 2);
}

/// A raw upstream on a loopback port of its own (its URL returned) that
/// serves each connection with `serve`, and counts them.
async fn counting_upstream<F, Served>(serve: F) -> (String, Arc<AtomicUsize>)
where
    F: Fn(tokio::net::TcpStream) -> Served + Send + 'static,
    Served: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let connections = Arc::new(AtomicUsize::new(0));
    let count = connections.clone();
    tokio::spawn(async move {
        loop {
            let (socket, _) = listener.accept().await.unwrap();
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve(socket));
        }
    });
    (url, connections)
}

/// Reads from `socket` onto `read` until it holds a whole head; where the
/// head ends, or `None` once the connection closes first.
async fn head_end(socket: &mut tokio::net::TcpStream, read: &mut Vec<u8>) -> Option<usize> {
    loop {
        if let Some(end) = read.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(end + 4);
        }
        let mut chunk = [0u8; 4096];
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => read.extend_from_slice(&chunk[..n]),
        }
    }
}

/// What an upstream sends once it has read a body of this many bytes.
type Last = fn(usize) -> String;

/// An upstream that sends `first` as soon as it has a request's head,
/// then reads the whole body and sends `last` of the body's length.
async fn answering_as_it_reads(first: &'static [u8], last: Last) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut read = Vec::new();
        let end = loop {
            if let Some(end) = read.windows(4).position(|w| w == b"\r\n\r\n") {
                break end + 4;
            }
            let mut chunk = [0u8; 4096];
            let n = socket.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed before the head");
            read.extend_from_slice(&chunk[..n]);
        };
        socket.write_all(first).await.unwrap();
        let head = String::from_utf8_lossy(&read[..end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length: "))
            .and_then(|n| n.trim().parse().ok())
            .expect("a content-length");
        let mut body = read.len() - end;
        while body < length {
            let mut chunk = vec![0u8; 64 * 1024];
            let n = socket.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed with {body} of {length} bytes read");
            body += n;
            // Slower than the proxy writes: its writes wait on this.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        socket.write_all(last(body).as_bytes()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(60)).await;
    });
    url
}

/// An interim answer (`100 Continue`) sent as the upload begins is no
/// early answer: the body goes on whole, and the final answer after it
/// is the one given. So is a final answer sent as the upload begins by an
/// upstream that goes on reading it (a full-duplex one, answering as it
/// reads): all the body is sent.
#[tokio::test]
async fn an_answer_begun_while_the_upstream_reads_the_upload_lets_the_body_go_on() {
    let cases: [(&[u8], Last, StatusCode); 2] = [
        (
            b"HTTP/1.1 100 Continue\r\n\r\n",
            |n| {
                format!(
                    "HTTP/1.1 201 Created\r\ncontent-length: {}\r\n\r\n{n}",
                    n.to_string().len()
                )
            },
            StatusCode::CREATED,
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
            |n| format!("{:x}\r\n{n}\r\n0\r\n\r\n", n.to_string().len()),
            StatusCode::OK,
        ),
    ];
    for (first, last, status) in cases {
        let url = answering_as_it_reads(first, last).await;
        let proxy = Proxy::start(
            &url,
            "[server]\nmax_request_body = \"32MiB\"\n[[route]]\nname = \"upload\"\npath = \"/upload\"\n",
        )
        .await;
        let big = "x".repeat(16 << 20);
        let answer = TestClient::default().post(&proxy.url("/upload"), "u4", &big).await;
        assert_eq!(answer.status, status, "{}", answer.text());
        assert_eq!(answer.text(), (16 << 20).to_string());
    }
}

/// An early answer after an interim one (`100 Continue`, then a 413) from
/// an upstream that then holds the connection, reading nothing: read as
/// it comes, not waited out.
#[tokio::test]
async fn an_early_answer_after_an_interim_one_is_read_while_the_upstream_holds_on() {
    let answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 413 Payload Too Large\r\ncontent-length: 9\r\n\r\ntoo large";
    let (proxy, requests) = answering_early(answer, true).await;
    let big = "x".repeat(16 << 20);
    let first = tokio::time::timeout(
        Duration::from_secs(10),
        TestClient::default().post(&proxy.url("/upload"), "u5", &big),
    )
    .await
    .expect("the early answer was not read while the body was being written");
    assert_eq!(first.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", first.text());
    assert_eq!(first.text(), "too large");
    assert_eq!(requests.load(Ordering::SeqCst), 1);
}

/// A proxy with an `upload` route (`on_upstream_failure = "release"`) in
/// front of an upstream that sends `answer` once it has a request's head,
/// then (unless it holds on, reading nothing, for a minute) closes with
/// the body unread, which resets the connection while the request is
/// still being written; with how many requests it took.
async fn answering_early(answer: &'static [u8], holds_on: bool) -> (Proxy, Arc<AtomicUsize>) {
    // One request a connection.
    let (url, requests) = counting_upstream(move |mut socket| async move {
        if head_end(&mut socket, &mut Vec::new()).await.is_none() {
            return;
        }
        let _ = socket.write_all(answer).await;
        if holds_on {
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        // Dropped with the body unread: the kernel resets the connection.
    })
    .await;
    let proxy = Proxy::start(
        &url,
        r#"
[server]
max_request_body = "32MiB"
[[route]]
name = "upload"
path = "/upload"
on_upstream_failure = "release"
[upstream]
timeout = "3s"
"#,
    )
    .await;
    (proxy, requests)
}

/// Trailers are not passed on, to HTTP/2 clients either: a replay could
/// not give them back, and the first answer is the one replayed.
#[tokio::test]
async fn http2_clients_get_no_trailers_first_time_or_on_replay() {
    use http_body_util::BodyExt;
    let (_upstream, proxy) = behind_proxy(CHUNKED_ROUTE).await;
    let client = support::h2_client();
    for replay in [false, true] {
        let request = http::Request::post(proxy.url("/chunked"))
            .header("idempotency-key", "h2-trailers")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap();
        let response = client.request(request).await.unwrap();
        assert_eq!(response.version(), http::Version::HTTP_2);
        assert_eq!(response.headers().contains_key("idempotent-replayed"), replay);
        let body = response.into_body().collect().await.unwrap();
        assert!(body.trailers().is_none(), "replay {replay}: {:?}", body.trailers());
        assert_eq!(body.to_bytes(), "chunked");
    }
}

/// A 204 that declares a body's length: the length is dropped as it is
/// written (RFC 9110 §8.6), or an HTTP/2 client resets the stream, first
/// time and on every replay.
#[tokio::test]
async fn a_204s_content_length_reaches_no_client() {
    use http_body_util::BodyExt;
    let (_upstream, proxy) = behind_proxy("[[route]]\nname = \"nc\"\npath = \"/no-content-with-body\"\n").await;
    let client = support::h2_client();
    for replay in [false, true] {
        let request = http::Request::post(proxy.url("/no-content-with-body"))
            .header("idempotency-key", "h2-204")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap();
        let response = client.request(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::NO_CONTENT);
        assert_eq!(response.headers().contains_key("idempotent-replayed"), replay);
        assert_eq!(response.headers().get("content-length"), None, "replay {replay}");
        let body = response.into_body().collect().await.unwrap();
        assert!(body.to_bytes().is_empty());
    }
}

#[tokio::test]
async fn bodies_go_upstream_with_their_length_and_chunked_answers_are_recorded() {
    let (upstream, proxy) = behind_proxy(CHUNKED_ROUTE).await;
    let client = TestClient::default();
    let first = client.post(&proxy.url("/chunked"), "k1", r#"{"a":1}"#).await;
    assert_eq!(first.text(), "chunked");
    let replay = client.post(&proxy.url("/chunked"), "k1", r#"{"a":1}"#).await;
    assert!(replay.replayed());
    assert_eq!(replay.text(), "chunked");
    // A pass-through body, streamed: sent with its length.
    let big = "x".repeat(100_000);
    assert_eq!(
        client.send("POST", &proxy.url("/length"), &[], &big).await.text(),
        "length"
    );
    let bodies = upstream.bodies.lock().unwrap().clone();
    assert_eq!(bodies, vec![br#"{"a":1}"#.to_vec(), big.into_bytes()]);
}

/// An answer in more frames than are taken at once with its head is
/// streamed, every byte of it, and recorded whole.
#[tokio::test]
async fn an_answer_in_many_chunks_is_streamed_and_recorded_whole() {
    let (_upstream, proxy) = behind_proxy("[[route]]\nname = \"many\"\npath = \"/many-chunks\"\n").await;
    let client = TestClient::default();
    let first = client.post(&proxy.url("/many-chunks"), "k", "{}").await;
    assert_eq!(first.text(), "abcdefghijklmnopqrst");
    let replay = client.post(&proxy.url("/many-chunks"), "k", "{}").await;
    assert!(replay.replayed());
    assert_eq!(replay.text(), "abcdefghijklmnopqrst");
}

/// The answer the client gets, and the one replayed, carry none of the
/// upstream's hop-by-hop headers, nor any header its `Connection` names.
#[tokio::test]
async fn hop_by_hop_headers_of_an_answer_stay_at_the_hop() {
    let (upstream, proxy) = behind_proxy(
        r#"
[[route]]
name = "hop"
path = "/hop-recorded"
"#,
    )
    .await;
    let client = TestClient::default();
    let answers = [
        client.send("GET", &proxy.url("/hop"), &[], "").await,
        client.post(&proxy.url("/hop-recorded"), "k1", "{}").await,
        client.post(&proxy.url("/hop-recorded"), "k1", "{}").await,
    ];
    assert!(answers[2].replayed());
    for answer in answers {
        assert_eq!(answer.text(), "hop");
        assert_eq!(answer.header("x-kept"), Some("yes"));
        for gone in [
            "x-named",
            "x-other",
            "connection",
            "keep-alive",
            "upgrade",
            "trailer",
            "proxy-connection",
            "te",
        ] {
            assert_eq!(answer.header(gone), None, "{gone} reached the client");
        }
    }
    // The connection was kept for the next request: the Connection lines,
    // left out of the map, still decided that.
    assert_eq!(upstream.connections.load(Ordering::SeqCst), 1);

    let obs = client.send("GET", &proxy.url("/hop-obs"), &[], "").await;
    assert_eq!(obs.text(), "obs");
    assert_eq!(
        obs.header("x-internal"),
        None,
        "a name beside obs-text reached the client"
    );
    assert_eq!(upstream.connections.load(Ordering::SeqCst), 1);
    assert_eq!(
        client.send("GET", &proxy.url("/close-obs"), &[], "").await.text(),
        "close-obs"
    );
    assert_eq!(client.send("GET", &proxy.url("/hop"), &[], "").await.text(), "hop");
    assert_eq!(
        upstream.connections.load(Ordering::SeqCst),
        2,
        "`close` beside obs-text is honoured"
    );
}

/// A pass-through body of unknown length goes upstream chunked.
#[tokio::test]
async fn bodies_of_unknown_length_go_upstream_chunked() {
    let upstream = support::Upstream::start(|_, seen| {
        support::Reply::status(200, &format!("{}", String::from_utf8_lossy(&seen.body)))
    })
    .await;
    let proxy = Proxy::start(&upstream.url(), "").await;
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(
            b"POST /stream HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n\
              5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        )
        .await
        .unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.ends_with("hello world"), "{response}");
    let seen = &upstream.seen()[0];
    assert_eq!(seen.headers.get("transfer-encoding").unwrap(), "chunked");
}

#[tokio::test]
async fn a_connection_idle_past_idle_timeout_is_not_reused() {
    let (upstream, proxy) = behind_proxy("[upstream]\nidle_timeout = \"1s\"\n").await;
    let client = TestClient::default();
    let get = || {
        let (client, url) = (client.clone(), proxy.url("/length"));
        async move { client.send("GET", &url, &[], "").await.text() }
    };

    assert_eq!(get().await, "length");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(get().await, "length");
    assert_eq!(upstream.connections.load(Ordering::SeqCst), 1, "idle 100 ms: reused");

    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert_eq!(get().await, "length");
    assert_eq!(
        upstream.connections.load(Ordering::SeqCst),
        2,
        "idle 1.6 s, past the 1 s idle_timeout: a new connection"
    );
}

#[tokio::test]
async fn idle_connections_close_after_idle_timeout_without_further_traffic() {
    let (upstream, proxy) = behind_proxy("[upstream]\nidle_timeout = \"300ms\"\n").await;
    let client = TestClient::default();
    assert_eq!(
        client.send("GET", &proxy.url("/length"), &[], "").await.text(),
        "length"
    );
    assert_eq!(upstream.closed.load(Ordering::SeqCst), 0);
    // No request returns a connection to the pool from here on: the sweep
    // (every second) closes it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while upstream.closed.load(Ordering::SeqCst) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the idle connection was never closed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(upstream.connections.load(Ordering::SeqCst), 1);
}

/// A body's `Content-Length` spelled as a list (RFC 9110 §8.6 lets a
/// recipient read it as one) reaches HTTP/2 clients as one number, which
/// is all they take, first from the upstream and then from the record.
#[tokio::test]
async fn a_listed_content_length_reaches_http2_clients_as_one_number() {
    let route = "[[route]]\nname = \"listed\"\npath = \"/listed-length\"\nmethods = [\"GET\"]\n";
    let (_upstream, proxy) = behind_proxy(route).await;
    let client = support::h2_client();
    for replayed in [false, true] {
        let request = http::Request::get(proxy.url("/listed-length"))
            .header("idempotency-key", "listed")
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        let response = client.request(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers().contains_key("idempotent-replayed"), replayed);
        let lengths: Vec<_> = response.headers().get_all("content-length").iter().collect();
        assert_eq!(lengths, ["6"], "replayed: {replayed}");
        let body = http_body_util::BodyExt::collect(response.into_body()).await.unwrap();
        assert_eq!(body.to_bytes(), "listed");
    }
}

/// A backend that answers a HEAD and then, a moment late, sends its body
/// all the same (a common slip): the connection is not pooled, so those
/// bytes are never read as the next request's answer, recorded, and
/// replayed.
#[tokio::test]
async fn a_connection_is_not_reused_after_a_head_answer() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut read = Vec::new();
                loop {
                    let mut chunk = [0u8; 4096];
                    match socket.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => read.extend_from_slice(&chunk[..n]),
                    }
                    let Some(end) = read.windows(4).position(|w| w == b"\r\n\r\n") else {
                        continue;
                    };
                    let head = String::from_utf8_lossy(&read[..end]).to_lowercase();
                    read.drain(..end + 4);
                    if head.starts_with("head ") {
                        let _ = socket.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n").await;
                        tokio::time::sleep(Duration::from_millis(30)).await;
                        let _ = socket.write_all(b"STRAY").await;
                    } else {
                        // The request's body, `{}`, then the real answer.
                        read.drain(..2.min(read.len()));
                        tokio::time::sleep(Duration::from_millis(60)).await;
                        let _ = socket
                            .write_all(b"HTTP/1.1 201 Created\r\ncontent-length: 7\r\n\r\norder-1")
                            .await;
                    }
                }
            });
        }
    });
    let proxy = Proxy::start(&url, support::ORDERS).await;
    let client = TestClient::default();
    let head = client.send("HEAD", &proxy.url("/v1/orders"), &[], "").await;
    assert_eq!(head.status, StatusCode::OK);
    let created = client.post(&proxy.url("/v1/orders"), "after-head", "{}").await;
    assert_eq!(
        (created.status, created.text()),
        (StatusCode::CREATED, "order-1".to_owned())
    );
    let replay = client.post(&proxy.url("/v1/orders"), "after-head", "{}").await;
    assert!(replay.replayed());
    assert_eq!(replay.text(), "order-1");
}
