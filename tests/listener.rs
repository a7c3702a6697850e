//! The HTTP/1.1 listener on the wire: framing, keep-alive, pipelining,
//! `Expect: 100-continue`, and the heads it refuses.

mod support;

use std::time::Duration;

use support::{Proxy, Reply, TestClient, Upstream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends `wire` and reads until the proxy closes the connection.
async fn until_close(stream: &mut TcpStream, wire: &[u8]) -> String {
    stream.write_all(wire).await.unwrap();
    let mut seen = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut seen))
        .await
        .expect("the connection was left open")
        .unwrap();
    String::from_utf8_lossy(&seen).into_owned()
}

/// Reads until `seen` holds `want`.
async fn read_until(stream: &mut TcpStream, want: &str) -> String {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains(want) {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("no {want:?} in {:?}", String::from_utf8_lossy(&seen)))
            .unwrap();
        assert!(n > 0, "closed before {want:?}: {:?}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&seen).into_owned()
}

fn post(key: &str, body: &str, extra: &str) -> String {
    format!(
        "POST /v1/orders HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\ncontent-length: {}\r\n{extra}\r\n{body}",
        body.len()
    )
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit)).await;
    let proxy = Proxy::start(&upstream.url(), support::ORDERS).await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let wire = [
        post("p1", "{}", ""),
        post("p2", "{}", ""),
        post("p1", "{}", "connection: close\r\n"),
    ]
    .concat();
    let seen = until_close(&mut stream, wire.as_bytes()).await;
    let answers: Vec<&str> = seen.split("HTTP/1.1 ").skip(1).collect();
    assert_eq!(answers.len(), 3, "{seen}");
    assert!(
        answers[0].starts_with("201") && answers[0].contains(r#""order":1"#),
        "{seen}"
    );
    assert!(
        answers[1].starts_with("201") && answers[1].contains(r#""order":2"#),
        "{seen}"
    );
    // The third replays the first.
    assert!(
        answers[2].contains("idempotent-replayed: true") && answers[2].contains(r#""order":1"#),
        "{seen}"
    );
    assert!(answers[2].contains("connection: close"), "{seen}");
    assert_eq!(upstream.hits(), 2);
}

#[tokio::test]
async fn http_1_0_closes_unless_kept_alive() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit)).await;
    let proxy = Proxy::start(&upstream.url(), support::ORDERS).await;

    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let seen = until_close(
        &mut stream,
        b"POST /v1/orders HTTP/1.0\r\nidempotency-key: old\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await;
    assert!(seen.starts_with("HTTP/1.1 201"), "{seen}");
    assert!(seen.contains("content-length: "), "{seen}");

    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let wire = b"GET /a HTTP/1.0\r\nconnection: keep-alive\r\n\r\n";
    stream.write_all(wire).await.unwrap();
    let first = read_until(&mut stream, "\r\n\r\n").await;
    assert!(first.contains("connection: keep-alive"), "{first}");
    let second = until_close(&mut stream, b"GET /b HTTP/1.0\r\n\r\n").await;
    assert!(second.contains("HTTP/1.1 201"), "{second}");

    // Both tokens: close wins.
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let both = until_close(&mut stream, b"GET /c HTTP/1.0\r\nconnection: keep-alive, close\r\n\r\n").await;
    assert!(both.contains("connection: close"), "{both}");
    assert_eq!(upstream.hits(), 4);
}

#[tokio::test]
async fn expect_100_continue_is_answered_only_when_the_body_is_wanted() {
    let upstream = Upstream::start(|hit, seen| Reply::status(201, &format!("{hit}:{}", seen.body.len()))).await;
    let proxy = Proxy::start(&upstream.url(), support::ORDERS).await;

    // Wanted: 100 Continue, then the body, then the answer.
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(
            b"POST /v1/orders HTTP/1.1\r\nhost: x\r\nidempotency-key: ex\r\nexpect: 100-continue\r\ncontent-length: 5\r\n\r\n",
        )
        .await
        .unwrap();
    let interim = read_until(&mut stream, "\r\n\r\n").await;
    assert!(interim.starts_with("HTTP/1.1 100 Continue\r\n\r\n"), "{interim}");
    stream.write_all(b"hello").await.unwrap();
    let answer = read_until(&mut stream, "1:5").await;
    assert!(answer.contains("HTTP/1.1 201"), "{answer}");

    // Unwanted (no key): refused without 100 Continue, and closed, since the
    // body was never read.
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let seen = until_close(
        &mut stream,
        b"POST /v1/orders HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 5\r\n\r\n",
    )
    .await;
    assert!(seen.starts_with("HTTP/1.1 400"), "{seen}");
    assert!(
        seen.contains("key-missing") && seen.contains("connection: close"),
        "{seen}"
    );
    assert!(!seen.contains("100 Continue"), "{seen}");
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn heads_that_could_smuggle_a_request_are_refused() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit)).await;
    let proxy = Proxy::start(&upstream.url(), support::ORDERS).await;
    for (framing, status) in [
        ("content-length: 2\r\ntransfer-encoding: chunked\r\n", 400),
        ("content-length: 2\r\ncontent-length: 3\r\n", 400),
        ("transfer-encoding: chunked, identity\r\n", 400),
        ("content-length: -2\r\n", 400),
        // Framed well, in a coding not implemented: refused all the same.
        ("transfer-encoding: gzip, chunked\r\n", 501),
    ] {
        let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
        let wire = format!(
            "POST /v1/orders HTTP/1.1\r\nhost: x\r\nidempotency-key: s\r\n{framing}\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\n\r\n"
        );
        let seen = until_close(&mut stream, wire.as_bytes()).await;
        assert!(seen.starts_with(&format!("HTTP/1.1 {status}")), "{framing:?}: {seen}");
        assert!(seen.contains("application/problem+json"), "{seen}");
        assert_eq!(seen.matches("HTTP/1.1").count(), 1, "{seen}");
    }
    assert_eq!(upstream.hits(), 0);
}

/// Routes match paths: a target with none is refused, where it passed every
/// route by and reached the backend as `/`. And methods: one not in
/// capitals is refused, where a backend that capitalizes it would run
/// `post` as a POST the route never saw.
#[tokio::test]
async fn targets_without_a_path_are_refused_and_options_star_passes_through() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit)).await;
    // A catch-all route: every POST is idempotent.
    let proxy = Proxy::start(&upstream.url(), "[[route]]\nname = \"all\"\npath = \"/{*rest}\"\n").await;
    for line in [
        "POST api.example.com HTTP/1.1",
        "POST 127.0.0.1:80 HTTP/1.1",
        "CONNECT 127.0.0.1:443 HTTP/1.1",
        "POST * HTTP/1.1",
        "post /v1/orders HTTP/1.1",
        "Post /v1/orders HTTP/1.1",
        "PO!ST /v1/orders HTTP/1.1",
        "get /v1/orders HTTP/1.1",
        // Absolute targets: userinfo (its host read past an `@`), or
        // another scheme than http and https.
        "POST http://a@b@api.example.com/v1/orders HTTP/1.1",
        "POST http://user:pw@api.example.com/v1/orders HTTP/1.1",
        "POST ftp://api.example.com/v1/orders HTTP/1.1",
    ] {
        let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
        let wire = format!(
            "{line}\r\nhost: api.example.com\r\nidempotency-key: t\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}"
        );
        let seen = until_close(&mut stream, wire.as_bytes()).await;
        assert!(seen.starts_with("HTTP/1.1 400"), "{line}: {seen}");
        assert!(seen.contains("application/problem+json"), "{seen}");
    }
    assert_eq!(upstream.hits(), 0);
    // `OPTIONS *` asks about the server as a whole: forwarded as it is.
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let seen = until_close(
        &mut stream,
        b"OPTIONS * HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(seen.starts_with("HTTP/1.1 201"), "{seen}");
    assert_eq!(upstream.seen()[0].uri, "*");
    // Extension methods in capitals pass through.
    for method in ["PROPFIND", "VERSION-CONTROL", "M_SEARCH"] {
        let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
        let wire = format!("{method} /dav HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
        let seen = until_close(&mut stream, wire.as_bytes()).await;
        assert!(seen.starts_with("HTTP/1.1 201"), "{method}: {seen}");
    }
    assert_eq!(upstream.hits(), 4);
}

/// Heads the listener cannot serve get nginx's statuses, each a problem
/// document, and reach nobody.
#[tokio::test]
async fn oversized_heads_get_431() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit)).await;
    let proxy = Proxy::start(&upstream.url(), "").await;
    let many: String = (0..200).map(|i| format!("x-{i}: 1\r\n")).collect();
    for (wire, status, slug) in [
        (
            format!("GET / HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n", "a".repeat(70 * 1024)),
            431,
            "head-too-large",
        ),
        (format!("GET / HTTP/1.1\r\n{many}\r\n"), 431, "head-too-large"),
        // The request line alone is too long: sent whole, and cut short.
        (
            format!("GET /{} HTTP/1.1\r\nhost: x\r\n\r\n", "a".repeat(70 * 1024)),
            414,
            "uri-too-long",
        ),
        (format!("GET /{}", "a".repeat(70 * 1024)), 414, "uri-too-long"),
        (
            "POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip, chunked\r\n\r\n".into(),
            501,
            "coding-not-implemented",
        ),
        ("GET / HTTP/2.0\r\nhost: x\r\n\r\n".into(), 505, "version-not-supported"),
    ] {
        let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
        let seen = until_close(&mut stream, wire.as_bytes()).await;
        assert!(seen.starts_with(&format!("HTTP/1.1 {status}")), "{seen}");
        assert!(seen.contains("application/problem+json"), "{seen}");
        assert!(seen.contains(&format!("urn:idemgate:problem:{slug}")), "{seen}");
    }
    assert_eq!(upstream.hits(), 0);
}

#[tokio::test]
async fn head_answers_keep_their_length_and_no_body() {
    let upstream = Upstream::start(|_, _| Reply::status(200, "twelve bytes")).await;
    let proxy = Proxy::start(&upstream.url(), "").await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    stream.write_all(b"HEAD /h HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let head = read_until(&mut stream, "\r\n\r\n").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("content-length: 12\r\n"), "{head}");
    assert!(head.contains("date: "), "{head}");
    // No body followed: the next answer on the connection parses cleanly.
    let next = until_close(&mut stream, b"GET /g HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await;
    assert!(next.starts_with("HTTP/1.1 200"), "{next}");
    assert!(next.ends_with("twelve bytes"), "{next}");
}

/// A HEAD that idemgate answers itself (here a 502: nothing listens
/// upstream) declares the length a GET's answer has, and sends no body.
#[tokio::test]
async fn head_answers_made_here_declare_their_length() {
    let proxy = Proxy::start(&support::unreachable_url(), "").await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    stream.write_all(b"HEAD /h HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let head = read_until(&mut stream, "\r\n\r\n").await;
    assert!(head.starts_with("HTTP/1.1 502"), "{head}");
    // Nothing after the head, in its write or a later one (below).
    assert!(head.ends_with("\r\n\r\n"), "{head}");
    let get = until_close(&mut stream, b"GET /h HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await;
    let (get_head, get_body) = get.split_once("\r\n\r\n").unwrap();
    assert!(
        get_head.starts_with("HTTP/1.1 502"),
        "no body came after the HEAD's head: {get}"
    );
    let length = format!("content-length: {}\r\n", get_body.len());
    assert!(head.contains(&length), "{head} against {length}");
}

/// The same over HTTP/2.
#[tokio::test]
async fn http2_head_answers_made_here_declare_their_length() {
    use http_body_util::BodyExt;
    let proxy = Proxy::start(&support::unreachable_url(), "").await;
    let client = support::h2_client();
    let send = |method: &str| {
        let request = http::Request::builder()
            .method(method)
            .uri(proxy.url("/h"))
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        client.request(request)
    };
    let head = send("HEAD").await.unwrap();
    let get = send("GET").await.unwrap();
    assert_eq!((head.status().as_u16(), get.status().as_u16()), (502, 502));
    let length = get.headers().get("content-length").cloned();
    assert!(length.is_some(), "{:?}", get.headers());
    assert_eq!(
        head.headers().get("content-length"),
        length.as_ref(),
        "{:?}",
        head.headers()
    );
    // No DATA frame: an HTTP/2 client resets a HEAD's stream on one.
    let body = head.into_body().collect().await.map(|b| b.to_bytes());
    assert!(body.as_ref().is_ok_and(|b| b.is_empty()), "{body:?}");
    let body = get.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(Some(body.len().to_string().as_str()), length.unwrap().to_str().ok());
}

#[tokio::test]
async fn a_chunked_body_is_the_same_request_as_its_length_framed_twin() {
    let upstream = Upstream::start(|hit, seen| Reply::status(201, &format!("{hit}:{}", seen.body.len()))).await;
    let proxy = Proxy::start(&upstream.url(), support::ORDERS).await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    // Split across writes, so the body is fed as it arrives.
    stream
        .write_all(b"POST /v1/orders HTTP/1.1\r\nhost: x\r\nidempotency-key: ch\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n4\r\n{\"a\"")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let seen = until_close(&mut stream, b"\r\n3\r\n:1}\r\n0\r\n\r\n").await;
    assert!(seen.starts_with("HTTP/1.1 201") && seen.ends_with("1:7"), "{seen}");

    let replay = TestClient::default()
        .post(&proxy.url("/v1/orders"), "ch", r#"{"a":1}"#)
        .await;
    assert!(replay.replayed());
    assert_eq!(replay.text(), "1:7");
    assert_eq!(upstream.hits(), 1);
}

/// A client that closes its sending side is taken as gone once its last
/// request has been read, as with hyper; the requests queued before that
/// one are still answered.
#[tokio::test]
async fn a_half_close_behind_pipelined_requests_cancels_only_the_last() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_millis(100))).await;
    let proxy = Proxy::start(&upstream.url(), support::ORDERS).await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let wire = [post("h1", "{}", ""), post("h2", "{}", "")].concat();
    stream.write_all(wire.as_bytes()).await.unwrap();
    stream.shutdown().await.unwrap();
    let mut seen = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut seen))
        .await
        .expect("the connection was left open")
        .unwrap();
    let seen = String::from_utf8_lossy(&seen);
    assert_eq!(seen.matches("HTTP/1.1 201").count(), 1, "{seen}");
    assert!(seen.contains(r#""order":1"#), "{seen}");
}

#[tokio::test]
async fn a_body_that_stops_coming_is_cut_off() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit)).await;
    let proxy = Proxy::start(
        &upstream.url(),
        &format!("[server]\nheader_read_timeout = \"300ms\"\n{}", support::ORDERS),
    )
    .await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let started = tokio::time::Instant::now();
    let seen = until_close(
        &mut stream,
        b"POST /v1/orders HTTP/1.1\r\nhost: x\r\nidempotency-key: slow\r\ncontent-length: 10\r\n\r\n{}",
    )
    .await;
    assert!(started.elapsed() >= Duration::from_millis(250));
    assert!(
        seen.starts_with("HTTP/1.1 400") && seen.contains("bad-request"),
        "{seen}"
    );
    assert_eq!(upstream.hits(), 0);
}

/// An idle keep-alive connection closes `header_read_timeout` after its
/// last answer: not earlier (the timer of an earlier wait), not never.
#[tokio::test]
async fn an_idle_connection_closes_a_timeout_after_its_last_answer() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit)).await;
    let proxy = Proxy::start(&upstream.url(), "[server]\nheader_read_timeout = \"1s\"\n").await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let mut last_sent = None;
    for path in ["/a", "/b", "/c"] {
        last_sent = Some(tokio::time::Instant::now());
        stream
            .write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        read_until(&mut stream, r#""order":"#).await;
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest))
        .await
        .expect("the idle connection was left open")
        .unwrap();
    // Counted from the last request's sending, before its answer was
    // written: the right timer closes 1 s after that answer, so over 1 s
    // after the sending (less a coarse clock's tick); one of an earlier
    // wait, 1 s after the answer before, read at least 600 ms before the
    // sending, within 400 ms of it.
    let waited = last_sent.expect("three requests").elapsed();
    assert!(waited >= Duration::from_millis(900), "closed early: {waited:?}");
    assert!(waited < Duration::from_millis(4000), "{waited:?}");
    assert!(rest.is_empty());
}

/// An HTTP/2 connection that opens with the preface and then sends nothing
/// is closed, as an idle HTTP/1.1 connection is: not held forever.
#[tokio::test]
async fn an_http2_connection_that_goes_quiet_is_closed() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit)).await;
    let proxy = Proxy::start(&upstream.url(), "[server]\nheader_read_timeout = \"300ms\"\n").await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    stream.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
    let mut seen = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut seen))
        .await
        .expect("the quiet HTTP/2 connection was left open")
        .unwrap();
}

/// An HTTP/2 client may send as large a head as an HTTP/1.1 client: a
/// 40 KiB token is forwarded (hyper's own limit would have refused it, with
/// no problem document), a head past the HTTP/1.1 bound is not.
#[tokio::test]
async fn an_http2_head_as_large_as_an_http1_head_is_accepted() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit)).await;
    let proxy = Proxy::start(&upstream.url(), "").await;
    let client = support::h2_client();
    let send = |size: usize| {
        let request = http::Request::post(proxy.url("/v1/orders"))
            .header("idempotency-key", format!("k-large-{size}"))
            .header("x-token", "t".repeat(size))
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap();
        client.request(request)
    };
    let response = send(40 * 1024).await.unwrap();
    assert_eq!(response.version(), http::Version::HTTP_2);
    assert_eq!(response.status(), 201);
    assert_eq!(upstream.seen()[0].headers["x-token"].len(), 40 * 1024);
    // Refused by the HTTP/2 layer (431 or a refused stream), never forwarded.
    if let Ok(response) = send(80 * 1024).await {
        assert_eq!(response.status(), 431);
    }
    assert_eq!(upstream.hits(), 1);
}

/// An HTTP/2 request body that stops arriving gets 400 after
/// `header_read_timeout`, as on HTTP/1.1, instead of holding the request.
#[tokio::test]
async fn an_http2_request_body_that_stops_arriving_gets_400() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit)).await;
    let proxy = Proxy::start(
        &upstream.url(),
        &format!("[server]\nheader_read_timeout = \"300ms\"\n{}", support::ORDERS),
    )
    .await;
    let buffered = stalled_h2_post(&proxy.url("/v1/orders"), ("idempotency-key", "stalled")).await;
    assert_eq!(buffered, 400);
    assert_eq!(upstream.hits(), 0);
    // Passed through, streamed to the upstream as it comes: 400 too, not
    // the upstream's timeout.
    let streamed = stalled_h2_post(&proxy.url("/elsewhere"), ("content-length", "100")).await;
    assert_eq!(streamed, 400);
}

/// An HTTP/2 request body that keeps coming, each frame within the idle
/// bound, is read whole however long it takes altogether: the bound
/// counts from the last frame, not the first.
#[tokio::test]
async fn a_slow_but_steady_http2_request_body_is_read_whole() {
    use http_body_util::StreamBody;

    let upstream = Upstream::start(|hit, seen| Reply::status(201, &format!("{hit}:{}", seen.body.len()))).await;
    let proxy = Proxy::start(
        &upstream.url(),
        &format!("[server]\nheader_read_timeout = \"1s\"\n{}", support::ORDERS),
    )
    .await;
    for (url, key) in [(proxy.url("/v1/orders"), "steady"), (proxy.url("/elsewhere"), "")] {
        type Item = Result<http_body::Frame<bytes::Bytes>, std::convert::Infallible>;
        // Eight frames 250 ms apart: 2 s in all, past the 1 s bound.
        let frames = futures_util::stream::unfold(0, |sent| async move {
            if sent == 8 {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
            let frame: Item = Ok(http_body::Frame::data(bytes::Bytes::from_static(b"0123456789")));
            Some((frame, sent + 1))
        });
        let mut request = http::Request::post(url);
        if !key.is_empty() {
            request = request.header("idempotency-key", key);
        }
        let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http();
        let response = client
            .request(request.body(StreamBody::new(Box::pin(frames))).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), 201, "{key}");
    }
    assert_eq!(upstream.hits(), 2);
    assert!(upstream.seen().iter().all(|seen| seen.body.len() == 80));
}

/// The status of an HTTP/2 POST to `url` whose body sends a few bytes and
/// then nothing more (the stream left open), answered within 5 s.
async fn stalled_h2_post(url: &str, header: (&str, &str)) -> u16 {
    use http_body_util::StreamBody;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    type Item = Result<http_body::Frame<bytes::Bytes>, std::convert::Infallible>;
    let (tx, rx) = tokio::sync::mpsc::channel::<Item>(1);
    tx.send(Ok(http_body::Frame::data(bytes::Bytes::from_static(b"{\"par"))))
        .await
        .unwrap();
    let body = StreamBody::new(Box::pin(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|frame| (frame, rx))
    })));
    let client = Client::builder(TokioExecutor::new()).http2_only(true).build_http();
    let request = http::Request::post(url).header(header.0, header.1).body(body).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(5), client.request(request))
        .await
        .expect("the stalled request was held")
        .unwrap();
    drop(tx);
    response.status().as_u16()
}

/// An HTTP/2 answer that takes longer than the idle bound to stream is
/// not cut: its stream counts as open until its last byte is sent.
#[tokio::test]
async fn a_long_http2_answer_outlives_the_idle_bound() {
    let upstream = Upstream::start(|_, _| Reply::Answer {
        delay: Duration::ZERO,
        status: http::StatusCode::OK,
        headers: vec![],
        chunks: (0..8).map(|i| bytes::Bytes::from(format!("part{i};"))).collect(),
        gap: Duration::from_millis(150),
    })
    .await;
    let proxy = Proxy::start(&upstream.url(), "[server]\nheader_read_timeout = \"200ms\"\n").await;
    let response = support::h2_client()
        .request(
            http::Request::get(proxy.url("/slow"))
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    use http_body_util::BodyExt;
    let body = response
        .into_body()
        .collect()
        .await
        .expect("the whole answer")
        .to_bytes();
    assert_eq!(body, "part0;part1;part2;part3;part4;part5;part6;part7;");
}

/// A malformed body on a request passed through is the client's fault:
/// 400, not a 502 that blames the upstream; and a line broken by a bare LF
/// is answered as it arrives, not once the read times out (5 s here
/// against the listener's 10 s).
#[tokio::test]
async fn a_broken_body_passed_through_is_400_not_502() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit)).await;
    let proxy = Proxy::start(&upstream.url(), support::ORDERS).await;
    for body in [&b"zz\r\n"[..], b"5\n", b"5\r\nhello\n"] {
        let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
        let head = b"POST /elsewhere HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n";
        let seen = until_close(&mut stream, &[&head[..], body].concat()).await;
        assert!(
            seen.starts_with("HTTP/1.1 400") && seen.contains("bad-request"),
            "{body:?}: {seen}"
        );
    }
}

/// An HTTP/2 client that takes nothing of its answer (its flow-control
/// window shut) does not hold the connection and the upstream forever, as
/// an HTTP/1.1 client that stops reading does not.
#[tokio::test]
async fn an_http2_client_that_takes_nothing_is_let_go() {
    use http_body_util::BodyExt;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let big = "x".repeat(200_000);
    let upstream = Upstream::start(move |_, _| Reply::status(200, &big)).await;
    let proxy = Proxy::start(&upstream.url(), "[server]\nheader_read_timeout = \"300ms\"\n").await;
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .http2_initial_stream_window_size(1024)
        .http2_initial_connection_window_size(1024)
        .build_http();
    let response = client
        .request(
            http::Request::get(proxy.url("/big"))
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // Not read for three idle periods: the proxy gives up on it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let read = tokio::time::timeout(Duration::from_secs(5), response.into_body().collect())
        .await
        .expect("reading ends");
    assert!(
        read.is_err(),
        "the whole answer was kept for a client that took none of it"
    );
}

/// Shutdown lets go of an HTTP/2 client that takes nothing of its answer
/// as serving does, after `header_read_timeout`: it does not hold the
/// drain for all of `shutdown_grace`.
#[tokio::test]
async fn an_http2_client_that_takes_nothing_does_not_hold_the_drain() {
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let big = "x".repeat(200_000);
    let upstream = Upstream::start(move |_, _| Reply::status(200, &big)).await;
    let proxy = Proxy::start(
        &upstream.url(),
        "[server]\nheader_read_timeout = \"300ms\"\nshutdown_grace = \"20s\"\n",
    )
    .await;
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .http2_initial_stream_window_size(1024)
        .http2_initial_connection_window_size(1024)
        .build_http();
    let request = http::Request::get(proxy.url("/big"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let response = client.request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    tokio::time::timeout(Duration::from_secs(5), proxy.stop())
        .await
        .expect("the drain waited on a client that reads nothing");
    drop(response);
}

/// A client that reads a large answer slowly is still written to: the
/// idle bound does not cut it, even once the whole answer is with hyper.
#[tokio::test]
async fn a_slow_http2_reader_gets_its_whole_answer() {
    use http_body_util::BodyExt;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let big = "y".repeat(200_000);
    let upstream = Upstream::start({
        let big = big.clone();
        move |_, _| Reply::status(200, &big)
    })
    .await;
    let proxy = Proxy::start(
        &upstream.url(),
        &format!("[server]\nheader_read_timeout = \"1s\"\n{}", support::ORDERS),
    )
    .await;
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .http2_initial_stream_window_size(16 << 10)
        .http2_initial_connection_window_size(16 << 10)
        .build_http();
    let post = || {
        http::Request::post(proxy.url("/v1/orders"))
            .header("idempotency-key", "slow")
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap()
    };
    client
        .request(post())
        .await
        .unwrap()
        .into_body()
        .collect()
        .await
        .unwrap();
    // The replay: one whole frame, handed to hyper at once, then read at
    // 16 KiB per 250 ms, about 3.2 s: longer than the idle bound thrice.
    let replay = client.request(post()).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let mut body = replay.into_body();
    let mut got = 0;
    while let Some(frame) = body.frame().await {
        got += frame.expect("the answer was cut").into_data().map_or(0, |d| d.len());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(got, big.len());
}

/// A path sent with raw UTF-8 or `|` in it (parsers let them through) is
/// the path its escapes spell, as a backend reads it: the route written
/// as text takes it either way, and the fingerprint reads it so too, so a
/// retry spelled the other way is replayed, not refused 422.
#[tokio::test]
async fn a_path_sent_raw_or_escaped_takes_the_same_route() {
    let upstream = Upstream::start(|hit, _| Reply::created(hit)).await;
    let route = "[[route]]\nname = \"cafes\"\npath = \"/cafés/a|b\"\n";
    let proxy = Proxy::start(&upstream.url(), route).await;
    for (path, key) in [("/cafés/a|b", "raw"), ("/caf%C3%A9s/a%7Cb", "escaped")] {
        let request = format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}"
        );
        for replayed in [false, true] {
            let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
            let answer = until_close(&mut stream, request.as_bytes()).await;
            assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
            let said = answer.to_ascii_lowercase().contains("idempotent-replayed: true");
            assert_eq!(said, replayed, "{path}: {answer}");
        }
    }
    // The first request's key, its path spelled the other way.
    let request = "POST /caf%C3%A9s/a%7Cb HTTP/1.1\r\nhost: x\r\nidempotency-key: raw\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}";
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let answer = until_close(&mut stream, request.as_bytes()).await;
    assert!(
        answer.starts_with("HTTP/1.1 201") && answer.to_ascii_lowercase().contains("idempotent-replayed: true"),
        "{answer}"
    );
    assert_eq!(upstream.hits(), 2);
}

/// A second instance started on the `listen` of a running one, several
/// workers or one, is refused the port: sharing it (SO_REUSEPORT lets one
/// user's sockets share) would split the clients across two stores.
#[test]
fn a_listen_address_in_use_is_refused_though_workers_share_theirs() {
    use idemgate::server::bind_listeners;
    let running = bind_listeners("127.0.0.1:0".parse().unwrap(), 2).unwrap();
    let addr = running[0].local_addr().unwrap();
    assert_eq!(running[1].local_addr().unwrap(), addr);
    for workers in [2, 1] {
        let error = bind_listeners(addr, workers).expect_err("the port was shared");
        assert!(error.to_string().contains(&addr.to_string()), "{error}");
    }
    drop(running);
    assert_eq!(bind_listeners(addr, 2).unwrap().len(), 2);
}
