//! TLS: the listener (rustls, HTTP/2 and HTTP/1.1 by ALPN) and https://
//! upstreams verified against their own CA. Certificates are made here.

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use idemgate::config::{Config, TlsConfig};
use idemgate::server::{Server, tls};
use idemgate::store::{MemoryStore, StoreHandle};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use support::{Proxy, Reply, Upstream};

/// A CA, and a certificate it signed for localhost and 127.0.0.1.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf_key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .unwrap()
            .signed_by(&leaf_key, &issuer)
            .unwrap();
        let other_key = KeyPair::generate().unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        // The chain: leaf, then the CA.
        std::fs::write(dir.path().join("cert.pem"), format!("{}{}", leaf.pem(), ca.pem())).unwrap();
        std::fs::write(dir.path().join("key.pem"), leaf_key.serialize_pem()).unwrap();
        std::fs::write(dir.path().join("other-key.pem"), other_key.serialize_pem()).unwrap();
        std::fs::write(dir.path().join("garbage.pem"), "not a certificate").unwrap();
        Pki { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The `tls` line of a `[server]` table serving this certificate.
    fn listener_toml(&self) -> String {
        format!(
            "tls = {{ cert = \"{}\", key = \"{}\" }}\n",
            toml_path(&self.path("cert.pem")),
            toml_path(&self.path("key.pem"))
        )
    }

    /// A verified TLS connection to `addr` that negotiated HTTP/2.
    async fn connect_h2(&self, addr: std::net::SocketAddr) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
        let connector = tokio_rustls::TlsConnector::from(Arc::new(client_config(&self.path("ca.pem"), &[b"h2"])));
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let stream = connector
            .connect(rustls_pki_types::ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .unwrap();
        assert_eq!(stream.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
        stream
    }

    fn tls(&self) -> TlsConfig {
        TlsConfig {
            cert: self.path("cert.pem"),
            key: self.path("key.pem"),
        }
    }
}

/// A proxy serving TLS with `pki`'s certificate, an `orders` route at
/// `/v1/orders` in front of `upstream`.
async fn orders_over_tls(pki: &Pki, upstream: &Upstream) -> Proxy {
    over_tls(
        pki,
        upstream,
        "",
        "[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\n",
    )
    .await
}

/// A proxy serving TLS with `pki`'s certificate in front of `upstream`,
/// with `server` lines in its `[server]` table and then `routes`.
async fn over_tls(pki: &Pki, upstream: &Upstream, server: &str, routes: &str) -> Proxy {
    let config = format!("[server]\n{server}{}{routes}", pki.listener_toml());
    Proxy::start(&upstream.url(), &config).await
}

fn toml_path(p: &Path) -> String {
    p.display().to_string()
}

/// A client that trusts only `ca`, offering `alpn`.
fn client_config(ca: &Path, alpn: &[&[u8]]) -> rustls::ClientConfig {
    let mut config = tls::client_config(Some(ca)).unwrap();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    config
}

#[tokio::test]
async fn the_listener_serves_http1_and_http2_by_alpn_to_a_verifying_client() {
    let pki = Pki::new();
    let upstream = Upstream::created().await;
    let proxy = orders_over_tls(&pki, &upstream).await;

    // HTTP/1.1 through a client that verifies the test CA.
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(client_config(&pki.path("ca.pem"), &[]))
        .https_only()
        .enable_http1()
        .build();
    let client: hyper_util::client::legacy::Client<_, Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build(https);
    let url = format!("https://localhost:{}/v1/orders", proxy.addr.port());
    for replayed in [false, true] {
        let request = http::Request::post(&url)
            .header("idempotency-key", "tls")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let response = client.request(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(response.headers().contains_key("idempotent-replayed"), replayed);
    }
    assert_eq!(upstream.seen()[0].headers.get("x-forwarded-proto").unwrap(), "https");

    // HTTP/2 negotiated by ALPN.
    let stream = pki.connect_h2(proxy.addr).await;
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let request = http::Request::post(&url)
        .header("idempotency-key", "tls")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.version(), http::Version::HTTP_2);
    assert!(response.headers().contains_key("idempotent-replayed"));
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, Bytes::from_static(br#"{"order":1}"#));
    assert_eq!(upstream.hits(), 1);
}

/// A client that negotiates HTTP/2 and then sends nothing, not even the
/// preface, is let go at shutdown after `header_read_timeout`, not after
/// all of `shutdown_grace`.
#[tokio::test]
async fn a_silent_http2_client_over_tls_does_not_hold_the_drain() {
    let pki = Pki::new();
    let upstream = Upstream::created().await;
    let drain = "header_read_timeout = \"300ms\"\nshutdown_grace = \"20s\"\n";
    let proxy = over_tls(&pki, &upstream, drain, "").await;
    let stream = pki.connect_h2(proxy.addr).await;
    // Past the handshake, into serving, before the stop.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    tokio::time::timeout(std::time::Duration::from_secs(5), proxy.stop())
        .await
        .expect("the drain waited on a client that sent nothing");
    drop(stream);
}

/// A connection that never finishes its TLS handshake (a silent one, or
/// one that sent part of a ClientHello) is let go at shutdown at once, as a
/// silent plain connection is, not after `header_read_timeout`.
#[tokio::test]
async fn an_unfinished_tls_handshake_does_not_hold_the_drain() {
    use tokio::io::AsyncWriteExt;
    let pki = Pki::new();
    let upstream = Upstream::created().await;
    let drain = "header_read_timeout = \"10s\"\nshutdown_grace = \"20s\"\n";
    let proxy = over_tls(&pki, &upstream, drain, "").await;
    let silent = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let mut partial = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    // The first bytes of a TLS record holding a ClientHello.
    partial.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    tokio::time::timeout(std::time::Duration::from_secs(3), proxy.stop())
        .await
        .expect("the drain waited on a handshake");
    drop((silent, partial));
}

/// Plain HTTP sent to the TLS listener (`http://` for `https://`), or
/// any text, gets a readable 400 saying so, as nginx answers, not a TLS
/// alert; the upstream sees nothing.
#[tokio::test]
async fn plain_http_sent_to_the_tls_listener_gets_a_readable_400() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let pki = Pki::new();
    let upstream = Upstream::created().await;
    let proxy = orders_over_tls(&pki, &upstream).await;
    // A request, and any text: a method in small letters, a blank line first.
    for opening in [
        &b"POST /v1/orders HTTP/1.1\r\nhost: localhost\r\nidempotency-key: k\r\ncontent-length: 2\r\n\r\n{}"[..],
        b"get / HTTP/1.1\r\n\r\n",
        b"\r\nGET / HTTP/1.1\r\n\r\n",
    ] {
        let mut plain = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        plain.write_all(opening).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(std::time::Duration::from_secs(5), plain.read_to_end(&mut answer))
            .await
            .expect("the connection was not closed after the answer")
            .unwrap();
        let answer = String::from_utf8(answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
        assert!(answer.contains("application/problem+json"), "{answer}");
        assert!(
            answer.contains("plain HTTP was sent to a port that speaks HTTPS"),
            "{answer}"
        );
    }
    assert_eq!(upstream.hits(), 0);
    // TLS clients on the same port are served as before.
    drop(pki.connect_h2(proxy.addr).await);
}

#[tokio::test]
async fn an_https_upstream_is_verified_against_upstream_ca() {
    let pki = Pki::new();
    let acceptor = tls::acceptor(&pki.tls()).unwrap();
    let upstream = Upstream::start_with(Some(acceptor), |hit, _| Reply::created(hit)).await;
    let url = format!("https://localhost:{}", upstream.addr.port());
    let route = support::ORDERS;
    let trusting = Proxy::start(
        &url,
        &format!("[upstream]\nca = \"{}\"\n{route}", toml_path(&pki.path("ca.pem"))),
    )
    .await;
    let client = support::TestClient::default();
    let answer = client.post(&trusting.url("/v1/orders"), "k", "{}").await;
    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.text());
    assert_eq!(upstream.hits(), 1);

    // Without the CA the upstream's certificate is not trusted: never sent.
    let untrusting = Proxy::start(&url, route).await;
    let refused = client.post(&untrusting.url("/v1/orders"), "k2", "{}").await;
    assert_eq!(refused.status, StatusCode::BAD_GATEWAY);
    assert_eq!(refused.problem(), "upstream-unavailable");
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn bad_or_mismatched_tls_files_are_refused_with_the_file_named() {
    let pki = Pki::new();
    let cases = [
        (
            pki.path("missing.pem"),
            pki.path("key.pem"),
            "server.tls.cert",
            "missing.pem",
        ),
        (
            pki.path("garbage.pem"),
            pki.path("key.pem"),
            "server.tls.cert",
            "garbage.pem",
        ),
        (
            pki.path("cert.pem"),
            pki.path("garbage.pem"),
            "server.tls.key",
            "garbage.pem",
        ),
        (
            pki.path("cert.pem"),
            pki.path("other-key.pem"),
            "server.tls.key",
            "does not fit",
        ),
    ];
    for (cert, key, field, expected) in cases {
        let text = support::with_basics(
            "http://127.0.0.1:1",
            &format!(
                "[server]\ntls = {{ cert = \"{}\", key = \"{}\" }}\n",
                toml_path(&cert),
                toml_path(&key)
            ),
        );
        let config = Config::parse(&text, "tls.toml").unwrap();
        let store = StoreHandle::new(Arc::new(MemoryStore::new(1 << 20)), std::time::Duration::from_secs(1));
        let error = match Server::bind_with_store(config, store).await {
            Ok(_) => panic!("{cert:?} / {key:?} was accepted"),
            Err(error) => format!("{:#}", anyhow::Error::new(error)),
        };
        assert!(
            error.contains(expected) && error.contains(field),
            "{field}, {expected}: {error}"
        );
    }
    // The upstream's CA file, named by its field too.
    for ca in ["missing.pem", "garbage.pem"] {
        let text = support::with_basics("http://127.0.0.1:1", "").replace(
            "[upstream]",
            &format!("[upstream]\nca = \"{}\"", toml_path(&pki.path(ca))),
        );
        let config = Config::parse(&text, "tls.toml").unwrap();
        let error = format!(
            "{:#}",
            anyhow::Error::new(idemgate::server::check(&config).unwrap_err())
        );
        assert!(error.contains("upstream.ca") && error.contains(ca), "{error}");
    }
}
