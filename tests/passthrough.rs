//! Route matching, pass-through, proxy hygiene (SPEC §4) and shadow mode.

mod support;

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use hyper_util::rt::TokioIo;
use support::{Proxy, Reply, TestClient, Upstream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn unmatched_requests_pass_through_unchanged_and_unbuffered() {
    let upstream = Upstream::start(|hit, seen| Reply::status(200, &format!("{hit}:{}", seen.body.len()))).await;
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
    // A GET on the route's path, another path, a large body: all forwarded.
    let get = client.send("GET", &proxy.url("/v1/orders?page=2"), &[], "").await;
    assert_eq!(get.text(), "1:0");
    let big = "b".repeat(256 * 1024);
    let other = client.send("POST", &proxy.url("/v1/other"), &[], &big).await;
    assert_eq!(other.text(), format!("2:{}", big.len()));
    assert!(!other.replayed());
    assert_eq!(upstream.seen()[0].uri, "/v1/orders?page=2");
    let metrics = proxy.metrics.render(None);
    assert!(
        metrics.contains(r#"idemgate_requests_total{route="",outcome="passthrough"} 2"#),
        "{metrics}"
    );
}

/// A pass-through request body goes upstream as it comes (SPEC §4): the
/// upstream reads the first chunk while the client still holds the rest.
#[tokio::test]
async fn pass_through_request_bodies_stream() {
    let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", upstream.local_addr().unwrap());
    let (first_seen, first_arrived) = tokio::sync::oneshot::channel();
    let backend = tokio::spawn(async move {
        let (mut stream, _) = upstream.accept().await.unwrap();
        let (mut seen, mut buf, mut first_seen) = (Vec::new(), [0u8; 4096], Some(first_seen));
        while !seen.ends_with(b"0\r\n\r\n") {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "{}", String::from_utf8_lossy(&seen));
            seen.extend_from_slice(&buf[..n]);
            if String::from_utf8_lossy(&seen).contains("first-chunk") {
                first_seen.take().map(|s| s.send(()));
            }
        }
        stream
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            .await
            .unwrap();
        String::from_utf8_lossy(&seen).into_owned()
    });
    let proxy = Proxy::start(&url, "").await;
    let mut client = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    client
        .write_all(b"POST /upload HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nb\r\nfirst-chunk\r\n")
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), first_arrived)
        .await
        .expect("the first chunk waited for the rest of the body")
        .unwrap();
    client.write_all(b"5\r\nlater\r\n0\r\n\r\n").await.unwrap();
    let mut response = Vec::new();
    let mut buf = [0u8; 4096];
    while !response.ends_with(b"ok") {
        let n = client.read(&mut buf).await.unwrap();
        assert!(n > 0, "{}", String::from_utf8_lossy(&response));
        response.extend_from_slice(&buf[..n]);
    }
    assert!(response.starts_with(b"HTTP/1.1 200"));
    let seen = backend.await.unwrap();
    assert!(seen.contains("first-chunk") && seen.contains("later"), "{seen}");
}

#[tokio::test]
async fn pass_through_responses_stream() {
    let upstream = Upstream::start(|_, _| Reply::Answer {
        delay: Duration::ZERO,
        status: StatusCode::OK,
        headers: vec![],
        chunks: vec![Bytes::from_static(b"one,"), Bytes::from_static(b"two")],
        gap: Duration::from_millis(2000),
    })
    .await;
    let proxy = Proxy::start(&upstream.url(), "").await;
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(b"GET /stream HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&seen).contains("one,") {
        let n = stream.read(&mut buf).await.unwrap();
        assert!(n > 0);
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn hop_by_hop_headers_are_dropped_and_forwarded_headers_set() {
    let upstream = Upstream::start(|_, _| Reply::Answer {
        delay: Duration::ZERO,
        status: StatusCode::OK,
        headers: vec![
            ("connection", "x-upstream-secret".into()),
            ("x-upstream-secret", "1".into()),
            ("keep-alive", "timeout=5".into()),
            ("x-kept", "yes".into()),
        ],
        chunks: vec![Bytes::from_static(b"ok")],
        gap: Duration::ZERO,
    })
    .await;
    let proxy = Proxy::start(&upstream.url(), "").await;
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(
            b"GET /h HTTP/1.1\r\nhost: api.example.com\r\nconnection: keep-alive, x-client-secret\r\n\
              x-client-secret: 1\r\nkeep-alive: timeout=5\r\nproxy-authorization: basic x\r\nte: trailers\r\n\
              upgrade: websocket\r\nx-forwarded-for: 203.0.113.9\r\nx-forwarded-for: 198.51.100.7\r\n\
              x-forwarded-for: proxy-\xe9\r\nx-kept: yes\r\nx_forwarded_for: 6.6.6.6\r\nX_Forwarded-Host: evil\r\n\
              x-forwarded_proto: https\r\nx_kept_too: yes\r\n\
              expect: 100-continue\r\n\r\n",
        )
        .await
        .unwrap();
    let mut response = Vec::new();
    let mut buf = [0u8; 4096];
    while !response.ends_with(b"ok") {
        let n = stream.read(&mut buf).await.unwrap();
        assert!(n > 0);
        response.extend_from_slice(&buf[..n]);
    }
    let response = String::from_utf8_lossy(&response).to_ascii_lowercase();
    assert!(response.contains("x-kept: yes"));
    assert!(!response.contains("x-upstream-secret"), "{response}");
    assert!(!response.contains("keep-alive: timeout"), "{response}");

    let seen = &upstream.seen()[0].headers;
    for gone in [
        "x-client-secret",
        "keep-alive",
        "proxy-authorization",
        "te",
        "upgrade",
        "expect",
    ] {
        assert!(seen.get(gone).is_none(), "{gone} was forwarded");
    }
    assert_eq!(seen.get("x-kept").unwrap(), "yes");
    // Look-alikes of the X-Forwarded-* set here, which CGI and WSGI read
    // as those, go; other names with `_` stay.
    for gone in ["x_forwarded_for", "x_forwarded-host", "x-forwarded_proto"] {
        assert!(seen.get(gone).is_none(), "{gone} was forwarded");
    }
    assert_eq!(seen.get("x_kept_too").unwrap(), "yes");
    // Every earlier line, one past ASCII (obs-text) too, then the client.
    assert_eq!(
        seen.get("x-forwarded-for").unwrap().as_bytes(),
        b"203.0.113.9, 198.51.100.7, proxy-\xe9, 127.0.0.1"
    );
    assert_eq!(seen.get("x-forwarded-proto").unwrap(), "http");
    assert_eq!(seen.get("x-forwarded-host").unwrap(), "api.example.com");
    assert_eq!(seen.get("host").unwrap().to_str().unwrap(), upstream.addr.to_string());
}

/// HTTP/2 clients may send a `Cookie` field per cookie; the HTTP/1.1 hop
/// gets them as one line (RFC 9113 §8.2.3), on routes and off.
#[tokio::test]
async fn cookies_an_http2_client_splits_reach_the_upstream_joined() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(&upstream.url(), "[[route]]\nname = \"orders\"\npath = \"/orders\"\n").await;
    let client = support::h2_client();
    for (path, key) in [("/orders", Some("k-cookies")), ("/elsewhere", None)] {
        let mut request = http::Request::post(proxy.url(path))
            .header("cookie", "session=abc")
            .header("cookie", "csrf=xyz");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let response = client
            .request(
                request
                    .body(http_body_util::Full::new(Bytes::from_static(b"{}")))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(response.version(), http::Version::HTTP_2);
        assert_eq!(response.status(), StatusCode::CREATED, "{path}");
    }
    for seen in upstream.seen() {
        let cookies: Vec<_> = seen.headers.get_all("cookie").iter().collect();
        assert_eq!(cookies, ["session=abc; csrf=xyz"]);
    }
    assert_eq!(upstream.hits(), 2);
}

/// An HTTP/2 request reads as its HTTP/1.1 form would: `:authority` is
/// its `Host` and its `Cookie` fields are one, for the scope as for the
/// upstream. The same request by either protocol is one record, and two
/// hosts are two scopes.
#[tokio::test]
async fn an_http2_request_is_scoped_by_its_authority_and_joined_cookies() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(
        &upstream.url(),
        "[[route]]\nname = \"orders\"\npath = \"/orders\"\nscope = [\"host\", \"cookie\"]\n",
    )
    .await;
    let h2 = |authority: &'static str| {
        let addr = proxy.addr;
        async move {
            let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (mut sender, connection) =
                hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), TokioIo::new(stream))
                    .await
                    .unwrap();
            tokio::spawn(connection);
            let request = http::Request::post(format!("http://{authority}/orders"))
                .header("idempotency-key", "k-scoped")
                .header("cookie", "session=abc")
                .header("cookie", "csrf=xyz")
                .body(http_body_util::Full::new(Bytes::from_static(b"{}")))
                .unwrap();
            let response = sender.send_request(request).await.unwrap();
            assert_eq!(response.version(), http::Version::HTTP_2);
            (
                response.status(),
                response.headers().contains_key("idempotent-replayed"),
            )
        }
    };
    assert_eq!(h2("a.example").await, (StatusCode::CREATED, false));
    assert_eq!(
        h2("b.example").await,
        (StatusCode::CREATED, false),
        "another host, another scope"
    );
    assert_eq!(h2("a.example").await, (StatusCode::CREATED, true));
    // The same request by HTTP/1.1: the same record, its cookies in one
    // line or in two, as some clients send them.
    let one: &[(&str, &str)] = &[("cookie", "session=abc; csrf=xyz")];
    let two: &[(&str, &str)] = &[("cookie", "session=abc"), ("cookie", "csrf=xyz")];
    for cookies in [one, two] {
        let mut headers = vec![("host", "a.example"), ("idempotency-key", "k-scoped")];
        headers.extend_from_slice(cookies);
        let again = TestClient::default()
            .send("POST", &proxy.url("/orders"), &headers, "{}")
            .await;
        assert!(again.replayed(), "{cookies:?}: {}", again.status);
    }
    assert_eq!(upstream.hits(), 2);
}

/// An HTTP/2 request's host is checked as an HTTP/1.1 request's is: one
/// `host` field, `host[:port]`, or 400 before it picks a route or reaches
/// the backend as X-Forwarded-Host. So is an `:authority`, which wins
/// over `host`; a `host` naming another host than it is refused (RFC 9113
/// §8.3.1), one naming the same in another spelling is not.
#[tokio::test]
async fn an_http2_requests_host_is_checked_as_an_http1_requests() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(&upstream.url(), support::ORDERS).await;
    let mut sender = h2_connect(proxy.addr).await;
    let mut send = async |target: &str, hosts: &[&str]| {
        let hosts: Vec<_> = hosts.iter().map(|host| ("host", *host)).collect();
        h2_post(&mut sender, target, &hosts, Bytes::from_static(b"{}")).await
    };
    for (target, hosts, says) in [
        ("/pass", &["a.example", "b.example"][..], "one host header"),
        ("/pass", &["x/y?z"], "not a host"),
        ("/pass", &["a b"], "not a host"),
        ("/pass", &["a.example, b.example"], "not a host"),
        ("http://a.example:abc/pass", &[], "not a host"),
        ("http://a.example/pass", &["b.example"], "another host than :authority"),
        (
            "http://a.example/pass",
            &["a.example:8080"],
            "another host than :authority",
        ),
        (
            "http://a.example:8080/pass",
            &["a.example"],
            "another host than :authority",
        ),
        // A port that is not one names no endpoint.
        ("http://a.example/pass", &["a.example:99999"], "another host"),
        ("http://a.example/pass", &["a.example:8o"], "another host"),
    ] {
        let (status, body) = send(target, hosts).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{target} {hosts:?}: {body}");
        assert!(body.contains(says), "{target} {hosts:?}: {body}");
    }
    assert_eq!(upstream.hits(), 0);
    for (target, hosts) in [
        ("/pass", &["a.example:8080"][..]),
        ("/pass", &[]),
        ("http://a.example:/pass", &[]),
        ("http://a.example/pass", &["A.Example."]),
        ("http://a.example:80/pass", &["a.example"]),
    ] {
        let (status, body) = send(target, hosts).await;
        assert_eq!(status, StatusCode::CREATED, "{target} {hosts:?}: {body}");
    }
    assert_eq!(upstream.hits(), 5);
}

/// A host named in `scope` is the same host however it is spelled (case, a
/// fully qualified name's trailing dot), as routes match it: a retry that
/// spells it otherwise is replayed, not run again. Another port or
/// another name is another scope.
#[tokio::test]
async fn a_scope_reads_a_host_without_regard_to_its_spelling() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(
        &upstream.url(),
        "[[route]]\nname = \"orders\"\npath = \"/orders\"\nscope = [\"host\"]\n",
    )
    .await;
    let client = TestClient::default();
    for (host, replayed) in [
        ("api.example.com", false),
        ("API.Example.COM", true),
        ("api.example.com.", true),
        ("api.example.com:", true),
        ("api.example.com:8443", false),
        ("Api.Example.Com.:8443", true),
        ("app.example.com", false),
    ] {
        let answer = client
            .send(
                "POST",
                &proxy.url("/orders"),
                &[("host", host), ("idempotency-key", "k-host")],
                "{}",
            )
            .await;
        assert_eq!(answer.status, StatusCode::CREATED, "{host}");
        assert_eq!(answer.replayed(), replayed, "{host}");
    }
    assert_eq!(upstream.hits(), 3);
}

#[tokio::test]
async fn routes_match_by_host_params_rest_and_method_first_match_wins() {
    let upstream = Upstream::created().await;
    let other = Upstream::created().await;
    let proxy = Proxy::start(
        &upstream.url(),
        &format!(
            r#"
[[route]]
name = "tenant-host"
path = "/v1/orders"
host = "Tenant.Example.COM."
upstream = "{}"
[[route]]
name = "orders"
path = "/v1/orders"
[[route]]
name = "lines"
path = "/v1/orders/{{id}}/lines"
methods = ["PUT"]
[[route]]
name = "files"
path = "/files/{{*rest}}"
"#,
            other.url()
        ),
    )
    .await;
    let client = TestClient::default();
    // Records are kept under (scope, key), whatever the route: one key each.
    let post = |path: &str, host: &str, method: &str| {
        let (client, url, host, method) = (client.clone(), proxy.url(path), host.to_string(), method.to_string());
        let key = format!("{host}{path}");
        async move {
            client
                .send(
                    &method,
                    &url,
                    &[("host", host.as_str()), ("idempotency-key", key.as_str())],
                    "",
                )
                .await
        }
    };
    post("/v1/orders", "tenant.example.com:8080", "POST").await;
    assert_eq!(other.hits(), 1, "host matched, port ignored; the route's own upstream");
    // Another method on that route's path passes through to its backend too.
    let get = client
        .send("GET", &proxy.url("/v1/orders"), &[("host", "tenant.example.com")], "")
        .await;
    assert!(!get.replayed());
    assert_eq!(other.hits(), 2, "pass-through follows the route's upstream");
    post("/v1/orders", "else.example.com", "POST").await;
    assert_eq!(upstream.hits(), 1);
    let lines = post("/v1/orders/42/lines", "x", "PUT").await;
    assert_eq!(lines.status, StatusCode::CREATED);
    assert!(post("/v1/orders/42/lines", "x", "PUT").await.replayed());
    let deep = post("/files/a/b/c", "x", "POST").await;
    assert!(!deep.replayed());
    assert!(post("/files/a/b/c", "x", "POST").await.replayed());
    let metrics = proxy.metrics.render(None);
    for route in ["tenant-host", "orders", "lines", "files"] {
        assert!(
            metrics.contains(&format!(r#"{{route="{route}",outcome="forwarded"}} 1"#)),
            "{route}: {metrics}"
        );
    }
    // The host written fully qualified, in other case: the same route (as
    // nginx drops the trailing dot), so the same upstream.
    post("/v1/orders", "Tenant.Example.com.:8080", "POST").await;
    assert_eq!(other.hits(), 3, "a trailing dot took the request past its route");
    // An empty port, or one past 65535, is still the port: nginx reads
    // the host before it, and so might the backend.
    post("/v1/orders", "tenant.example.com:", "POST").await;
    assert_eq!(other.hits(), 4, "an empty port took the request past its route");
    post("/v1/orders", "tenant.example.com:99999", "POST").await;
    assert_eq!(other.hits(), 5, "a port past 65535 took the request past its route");
}

/// A path that spells an unreserved character as an escape is the same
/// path (RFC 3986 §6.2.2.2), and so is one whose dot segments, written or
/// escaped, resolve to it (as a backend that resolves them would read it):
/// it matches its route, and is forwarded as sent.
#[tokio::test]
async fn escaped_unreserved_characters_do_not_take_a_request_past_its_route() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(&upstream.url(), support::ORDERS).await;
    let client = TestClient::default();
    let url = proxy.url("/v1/%6Frders");
    assert_eq!(client.post(&url, "esc", "{}").await.status, StatusCode::CREATED);
    assert!(client.post(&url, "esc", "{}").await.replayed());
    assert_eq!(upstream.hits(), 1);
    assert_eq!(upstream.seen()[0].uri, "/v1/%6Frders");
}

/// A path with dot segments goes where it goes both resolved (as a backend
/// that resolves them reads it) and as written (as one that does not):
/// when the two differ, it is refused, so neither kind of backend gets it
/// past a route; when they agree, it goes there as sent.
#[tokio::test]
async fn dot_segments_that_change_the_route_are_refused() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[[route]]
name = "docs"
path = "/v1/docs/{name}"
methods = ["PUT"]
[[route]]
name = "files"
path = "/files/{*rest}"
methods = ["PUT"]
"#,
    )
    .await;
    let client = TestClient::default();
    for path in [
        "/v1/docs/%2E%2E",
        "/v1/docs/a/../b",
        "/x/%2E%2e/v1/docs/b",
        "/v1/docs/./b",
    ] {
        let answer = client
            .send("PUT", &proxy.url(path), &[("idempotency-key", path)], "{}")
            .await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{path}");
        assert!(String::from_utf8_lossy(&answer.body).contains("bad-request"), "{path}");
    }
    assert_eq!(upstream.hits(), 0);
    // Both readings pass through to the one upstream: forwarded as sent.
    let answer = client.send("GET", &proxy.url("/static/./a/../b.css"), &[], "").await;
    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(upstream.seen()[0].uri, "/static/./a/../b.css");
    // Both readings take one route: idempotent, forwarded as sent.
    let url = proxy.url("/files/a/../b");
    for replayed in [false, true] {
        let answer = client.send("PUT", &url, &[("idempotency-key", "same")], "{}").await;
        assert_eq!((answer.status, answer.replayed()), (StatusCode::CREATED, replayed));
    }
    assert_eq!(upstream.hits(), 2);
    assert_eq!(upstream.seen()[1].uri, "/files/a/../b");
}

/// Doubled slashes and `;` parameters, which some backends read away
/// (nginx and Tomcat merge `//`; Tomcat and Jetty drop `;jsessionid=...`),
/// are refused where they would take a request past its route, and go on
/// as sent where both readings agree.
#[tokio::test]
async fn doubled_slashes_and_path_parameters_that_change_the_route_are_refused() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(&upstream.url(), support::ORDERS).await;
    let client = TestClient::default();
    for path in [
        "//v1/orders",
        "/v1//orders",
        "/v1/orders;jsessionid=1",
        "/v1;x/orders",
        "/v1/x;/../orders",
        // Each reading on its own: dots resolved as written reach the
        // route, where `//` merged or `;` dropped first would not.
        "/v1//../orders",
        "/v1/;/../orders",
        // Only `//` merged (nginx), or only `;` dropped (Jetty).
        "/v1/;//../orders",
        "/v1//../orders;q",
        // Dots resolved first, then `//` merged.
        "/v1//..//orders",
    ] {
        let answer = client.post(&proxy.url(path), path, "{}").await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(answer.problem(), "bad-request", "{path}");
    }
    assert_eq!(upstream.hits(), 0);
    // Elsewhere either way: passed through as sent. (A GET of the
    // route's path goes to the route's upstream, the default's URL: one
    // place.)
    let passed = [
        "//static/a.css",
        "/static/a.css;v=2",
        "/v1/orders/",
        "/v1/orders;jsessionid=1",
        "/v1//orders",
        "/v1/x/../orders",
    ];
    for path in passed {
        let answer = client.send("GET", &proxy.url(path), &[], "").await;
        assert_eq!(answer.status, StatusCode::CREATED, "{path}: {}", answer.text());
    }
    let seen: Vec<String> = upstream.seen().into_iter().map(|s| s.uri).collect();
    assert_eq!(seen, passed);
}

/// An escaped slash is a slash to a backend that decodes the path before it
/// routes it (WSGI servers; nginx's locations): a path that would reach a
/// route only so read is refused; one a route takes as written goes on,
/// protected, whatever its `%2F` is read as.
#[tokio::test]
async fn escaped_slashes_that_would_reach_a_route_are_refused() {
    let upstream = Upstream::created().await;
    let config = format!(
        "{}[[route]]\nname = \"files\"\npath = \"/files/{{name}}\"\nmethods = [\"PUT\"]\n\
         [[route]]\nname = \"trees\"\npath = \"/files/{{*path}}\"\nmethods = [\"PUT\"]\n",
        support::ORDERS
    );
    let proxy = Proxy::start(&upstream.url(), &config).await;
    let client = TestClient::default();
    // (An escaped NUL is refused wherever it goes, as nginx refuses it.)
    for path in [
        "/v1%2Forders",
        "/v1%2forders",
        "/%2Fv1/orders",
        "/v1/x%2F..%2Forders",
        "/v1/orders%00",
    ] {
        let answer = client.post(&proxy.url(path), path, "{}").await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(answer.problem(), "bad-request", "{path}");
    }
    assert_eq!(upstream.hits(), 0);
    // A route takes it as written (another takes it decoded): claimed,
    // replayed, forwarded as sent.
    for replayed in [false, true] {
        let answer = client
            .send("PUT", &proxy.url("/files/a%2Fb"), &[("idempotency-key", "f")], "{}")
            .await;
        assert_eq!((answer.status, answer.replayed()), (StatusCode::CREATED, replayed));
    }
    // No route either way: passed through as sent.
    let answer = client.send("GET", &proxy.url("/v1%2Forders"), &[], "").await;
    assert_eq!(answer.status, StatusCode::CREATED);
    let seen: Vec<String> = upstream.seen().into_iter().map(|s| s.uri).collect();
    assert_eq!(seen, ["/files/a%2Fb", "/v1%2Forders"]);
}

#[tokio::test]
async fn shadow_mode_forwards_everything_and_counts_what_enforce_would_do() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(
        &upstream.url(),
        r#"
[server]
max_request_body = "1KiB"
[defaults]
mode = "shadow"
[[route]]
name = "orders"
path = "/v1/orders"
"#,
    )
    .await;
    let client = TestClient::default();
    let url = proxy.url("/v1/orders");
    assert_eq!(client.post(&url, "k", "a").await.status, StatusCode::CREATED);
    let again = client.post(&url, "k", "a").await;
    assert!(!again.replayed(), "shadow mode never replays");
    client.post(&url, "k", "b").await;
    client.send("POST", &url, &[], "no key").await;
    client.send("POST", &url, &[("idempotency-key", "")], "bad key").await;
    let big = "b".repeat(2048);
    let oversized = client.post(&url, "big", &big).await;
    assert_eq!(
        oversized.status,
        StatusCode::CREATED,
        "declared too large: still forwarded"
    );
    assert_eq!(upstream.seen().last().unwrap().body.len(), 2048, "with its whole body");
    assert_eq!(upstream.hits(), 6);
    let metrics = proxy.metrics.render(None);
    for outcome in [
        "forwarded",
        "shadow_replayed",
        "shadow_mismatch",
        "shadow_key_missing",
        "shadow_key_invalid",
        "shadow_too_large",
    ] {
        assert!(
            metrics.contains(&format!(r#"{{route="orders",outcome="{outcome}"}} 1"#)),
            "{outcome}: {metrics}"
        );
    }
}

#[tokio::test]
async fn the_admin_listener_answers_health_readiness_and_metrics() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(&upstream.url(), support::ORDERS).await;
    let client = TestClient::default();
    client.post(&proxy.url("/v1/orders"), "k", "").await;
    client.post(&proxy.url("/v1/orders"), "k", "").await;
    let admin = proxy.admin.unwrap();
    let health = client.send("GET", &format!("http://{admin}/healthz"), &[], "").await;
    assert_eq!(health.status, StatusCode::OK);
    let ready = client.send("GET", &format!("http://{admin}/readyz"), &[], "").await;
    assert_eq!(ready.status, StatusCode::OK);
    let metrics = client.send("GET", &format!("http://{admin}/metrics"), &[], "").await;
    assert!(metrics.header("content-type").unwrap().starts_with("text/plain"));
    let text = metrics.text();
    assert!(
        text.contains(r#"idemgate_requests_total{route="orders",outcome="replayed"} 1"#),
        "{text}"
    );
    assert!(text.contains("idemgate_store_duration_seconds_count"));
    assert!(text.contains("idemgate_upstream_duration_seconds_bucket"));
    assert!(!text.contains("\"k\""), "keys never appear in metrics");
}

#[tokio::test]
async fn a_client_that_never_finishes_its_head_is_cut_off() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(&upstream.url(), "[server]\nheader_read_timeout = \"300ms\"\n").await;
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    stream.write_all(b"POST /slow HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    let started = tokio::time::Instant::now();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the connection was left open");
    assert!(started.elapsed() >= Duration::from_millis(250));
    assert_eq!(upstream.hits(), 0);
}

/// An absolute-form target's host wins over the Host header (RFC 9112
/// §3.2.2): for the route's host match and for X-Forwarded-Host.
#[tokio::test]
async fn an_absolute_form_target_is_routed_by_its_own_host() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(
        &upstream.url(),
        "[[route]]\nname = \"pay\"\npath = \"/v1/orders\"\nhost = \"pay.example.com\"\n",
    )
    .await;
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(
            b"POST http://pay.example.com/v1/orders HTTP/1.1\r\nhost: other.example.com\r\ncontent-length: 2\r\n\r\n{}",
        )
        .await
        .unwrap();
    let mut response = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&response).contains("\r\n\r\n") {
        let n = stream.read(&mut buf).await.unwrap();
        assert!(n > 0, "{}", String::from_utf8_lossy(&response));
        response.extend_from_slice(&buf[..n]);
    }
    // The route applies: without a key, its default `required` refuses it.
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 400"), "{response}");
    assert!(response.contains("application/problem+json"), "{response}");
    assert_eq!(upstream.hits(), 0);
    // Passed through (no route on this path), the target's host is forwarded.
    stream
        .write_all(b"GET http://pay.example.com/elsewhere HTTP/1.1\r\nhost: other.example.com\r\n\r\n")
        .await
        .unwrap();
    while upstream.hits() < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let seen = &upstream.seen()[0].headers;
    assert_eq!(seen.get("x-forwarded-host").unwrap(), "pay.example.com");
    // An empty path goes as `/` (RFC 9112 §3.2.1), as it was routed.
    stream
        .write_all(b"GET http://pay.example.com?x=1 HTTP/1.1\r\nhost: other.example.com\r\n\r\n")
        .await
        .unwrap();
    for _ in 0..500 {
        if upstream.seen().len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(upstream.seen().get(1).map(|s| s.uri.as_str()), Some("/?x=1"));
}

/// The target's host is the request's for a route's `scope` too: two
/// requests to one absolute target with one key share one record, whatever
/// `Host` they also sent (routes matched the target's).
#[tokio::test]
async fn an_absolute_form_targets_host_is_the_scopes() {
    let upstream = Upstream::created().await;
    let proxy = Proxy::start(
        &upstream.url(),
        "[[route]]\nname = \"pay\"\npath = \"/v1/orders\"\nscope = [\"host\"]\n",
    )
    .await;
    for (host, replayed) in [("a.example.com", false), ("b.example.com", true)] {
        let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        let request = format!(
            "POST http://pay.example.com/v1/orders HTTP/1.1\r\nhost: {host}\r\nidempotency-key: abs-1\r\n\
             connection: close\r\ncontent-length: 2\r\n\r\n{{}}"
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.unwrap();
        let response = String::from_utf8_lossy(&response).to_lowercase();
        assert!(response.starts_with("http/1.1 201"), "{response}");
        assert_eq!(response.contains("idempotent-replayed: true"), replayed, "{response}");
    }
    assert_eq!(upstream.hits(), 1);
}

/// A pass-through upload from a slow client, longer in all than
/// `upstream.timeout`, to an upstream that reads it as it comes: the
/// waits on the client do not count (the upstream's time does), as nginx
/// counts only the time between two writes.
#[tokio::test]
async fn a_slow_clients_pass_through_upload_is_not_cut_at_upstream_timeout() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut read = Vec::new();
        while !read.ends_with(b"0\r\n\r\n") {
            let mut chunk = [0u8; 4096];
            match socket.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => read.extend_from_slice(&chunk[..n]),
            }
        }
        let _ = socket
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\ndone")
            .await;
        tokio::time::sleep(Duration::from_secs(30)).await;
    });
    let proxy = Proxy::start(&url, "[upstream]\ntimeout = \"1s\"\n").await;
    let mut client = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    client
        .write_all(b"POST /uploads HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
        .await
        .unwrap();
    // Two seconds of upload, a chunk every 400 ms.
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        client.write_all(b"5\r\nhello\r\n").await.unwrap();
    }
    client.write_all(b"0\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    while !answer.ends_with(b"done") {
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(10), client.read(&mut chunk))
            .await
            .expect("an answer")
            .unwrap();
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&answer));
        answer.extend_from_slice(&chunk[..n]);
    }
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// Uploads an upstream does not read yet hold an HTTP/2 connection's
/// flow-control window shut, so another stream's client has no window to
/// send its body in: that silence is not a stalled client, and the request
/// is served once the window opens, not refused as stalled after
/// `header_read_timeout`.
#[tokio::test]
async fn an_http2_body_waiting_for_window_that_other_streams_hold_is_not_stalled() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    // Reads nothing until then: the uploads fill its socket, and then the
    // data idemgate holds unread fills the connection's window.
    let opens = tokio::time::Instant::now() + Duration::from_millis(2500);
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                tokio::time::sleep_until(opens).await;
                let mut read = Vec::new();
                let mut chunk = vec![0u8; 1 << 16];
                let length = loop {
                    let n = socket.read(&mut chunk).await.unwrap();
                    assert!(n > 0);
                    read.extend_from_slice(&chunk[..n]);
                    if let Some(end) = read.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&read[..end]).to_ascii_lowercase();
                        let length: usize = head
                            .lines()
                            .find_map(|line| line.strip_prefix("content-length: "))
                            .map_or(0, |n| n.trim().parse().unwrap());
                        break end + 4 + length;
                    }
                };
                while read.len() < length {
                    let n = socket.read(&mut chunk).await.unwrap();
                    assert!(n > 0);
                    read.extend_from_slice(&chunk[..n]);
                }
                let _ = socket
                    .write_all(b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                    .await;
            });
        }
    });
    let proxy = Proxy::start(
        &url,
        &format!("[server]\nheader_read_timeout = \"1s\"\n{}", support::ORDERS),
    )
    .await;
    let sender = h2_connect(proxy.addr).await;
    let send = |path: &'static str, key: Option<&'static str>, body: Bytes| {
        let mut sender = sender.clone();
        let headers: Vec<_> = key.map(|key| ("idempotency-key", key)).into_iter().collect();
        tokio::spawn(async move { h2_post(&mut sender, &format!("http://x{path}"), &headers, body).await })
    };
    let upload = Bytes::from(vec![b'u'; 16 << 20]);
    let uploads: Vec<_> = (0..5).map(|_| send("/uploads", None, upload.clone())).collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let order = send("/v1/orders", Some("k-window"), Bytes::from(vec![b'o'; 20_000]));
    let (status, body) = order.await.unwrap();
    assert_eq!(status, StatusCode::CREATED, "{body}");
    for upload in uploads {
        assert_eq!(upload.await.unwrap().0, StatusCode::CREATED);
    }
}

type H2Sender = hyper::client::conn::http2::SendRequest<http_body_util::Full<Bytes>>;

/// An HTTP/2 connection (h2c with prior knowledge) to `addr`.
async fn h2_connect(addr: std::net::SocketAddr) -> H2Sender {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, connection) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(connection);
    sender
}

/// POSTs `body` to `target` with `headers` on `sender`: the answer's
/// status and body, as text.
async fn h2_post(sender: &mut H2Sender, target: &str, headers: &[(&str, &str)], body: Bytes) -> (StatusCode, String) {
    let mut request = http::Request::post(target);
    for &(name, value) in headers {
        request = request.header(name, value);
    }
    let request = request.body(http_body_util::Full::new(body)).unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status();
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap()
        .to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}
