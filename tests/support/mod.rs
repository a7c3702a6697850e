//! Test support: the real proxy started in-process on port 0, a real fake
//! upstream (a hyper server on port 0 that counts hits and behaves as told),
//! and a small HTTP client.

#![allow(dead_code)]

pub mod logs;
pub mod redis;

/// A directory for one test's embedded store, removed when dropped: again
/// while the store's threads, which outlive it a moment, still write log
/// segments into it (one try would leave it behind, tens of MiB).
pub struct Scratch(tempfile::TempDir);

pub fn scratch() -> Scratch {
    Scratch(tempfile::tempdir().unwrap())
}

impl Scratch {
    pub fn path(&self) -> &std::path::Path {
        self.0.path()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for _ in 0..200 {
            match std::fs::remove_dir_all(self.0.path()) {
                Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                    std::thread::sleep(std::time::Duration::from_millis(50))
                }
                _ => return,
            }
        }
    }
}

/// The route most tests use: POST and PATCH on /v1/orders, every default.
pub const ORDERS: &str = "[[route]]\nname = \"orders\"\npath = \"/v1/orders\"\n";

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use idemgate::config::Config;
use idemgate::proxy::ResponseBody;
use idemgate::server::Server;
use idemgate::store::{MemoryStore, StoreHandle};
use idemgate::telemetry::Metrics;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// A request as the upstream saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: Method,
    pub uri: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// What the fake upstream does with one request.
#[derive(Clone, Debug)]
pub enum Reply {
    /// Answer after `delay`: status, headers, and the body in chunks with
    /// `gap` between them.
    Answer {
        delay: Duration,
        status: StatusCode,
        headers: Vec<(&'static str, String)>,
        chunks: Vec<Bytes>,
        gap: Duration,
    },
    /// Close the connection without an answer, after `delay`.
    Reset { delay: Duration },
    /// Send a head of this status and the first chunk, then break off.
    BreakOff(StatusCode),
}

impl Reply {
    /// 201 with a small JSON body naming the hit number.
    pub fn created(hit: usize) -> Reply {
        Reply::Answer {
            delay: Duration::ZERO,
            status: StatusCode::CREATED,
            headers: vec![("content-type", "application/json".into()), ("x-hit", hit.to_string())],
            chunks: vec![Bytes::from(format!("{{\"order\":{hit}}}"))],
            gap: Duration::ZERO,
        }
    }

    pub fn status(status: u16, body: &str) -> Reply {
        Reply::Answer {
            delay: Duration::ZERO,
            status: StatusCode::from_u16(status).unwrap(),
            headers: vec![],
            chunks: vec![Bytes::from(body.to_string())],
            gap: Duration::ZERO,
        }
    }

    pub fn delayed(self, by: Duration) -> Reply {
        match self {
            Reply::Answer {
                status,
                headers,
                chunks,
                gap,
                ..
            } => Reply::Answer {
                delay: by,
                status,
                headers,
                chunks,
                gap,
            },
            other => other,
        }
    }
}

type Behaviour = Arc<dyn Fn(usize, &Seen) -> Reply + Send + Sync>;

/// A real HTTP server on a loopback port that counts its hits.
pub struct Upstream {
    pub addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<Seen>>>,
    _stop: oneshot::Sender<()>,
}

impl Upstream {
    /// Answers every request with `behaviour(hit_number, request)`; hits count from 1.
    pub async fn start(behaviour: impl Fn(usize, &Seen) -> Reply + Send + Sync + 'static) -> Upstream {
        Upstream::start_with(None, behaviour).await
    }

    /// Like [`Upstream::start`], speaking TLS with `acceptor`'s certificate.
    pub async fn start_with(
        tls: Option<tokio_rustls::TlsAcceptor>,
        behaviour: impl Fn(usize, &Seen) -> Reply + Send + Sync + 'static,
    ) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let behaviour: Behaviour = Arc::new(behaviour);
        let (stop, mut stopped) = oneshot::channel::<()>();
        let (h, s) = (hits.clone(), seen.clone());
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    accepted = listener.accept() => accepted.unwrap().0,
                    _ = &mut stopped => return,
                };
                let (hits, seen, behaviour) = (h.clone(), s.clone(), behaviour.clone());
                let service = service_fn(move |req: Request<Incoming>| {
                    let (hits, seen, behaviour) = (hits.clone(), seen.clone(), behaviour.clone());
                    async move { answer(req, &hits, &seen, &behaviour).await }
                });
                let tls = tls.clone();
                tokio::spawn(async move {
                    let http = hyper::server::conn::http1::Builder::new();
                    let _ = match tls {
                        None => http.serve_connection(TokioIo::new(stream), service).await,
                        Some(tls) => match tls.accept(stream).await {
                            Ok(stream) => http.serve_connection(TokioIo::new(stream), service).await,
                            Err(_) => return,
                        },
                    };
                });
            }
        });
        Upstream {
            addr,
            hits,
            seen,
            _stop: stop,
        }
    }

    /// Answers 201 to everything.
    pub async fn created() -> Upstream {
        Upstream::start(|hit, _| Reply::created(hit)).await
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    /// Once `n` requests have reached the upstream (counted as each
    /// arrives, before any delay of its answer): for a test that needs a
    /// request in flight, however slowly a loaded host got it there.
    pub async fn reached(&self, n: usize) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while self.hits() < n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} of {n} requests came",
                self.hits()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

#[derive(Debug)]
struct Reset;
impl std::fmt::Display for Reset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("reset by the test upstream")
    }
}
impl std::error::Error for Reset {}

async fn answer(
    req: Request<Incoming>,
    hits: &AtomicUsize,
    seen: &Mutex<Vec<Seen>>,
    behaviour: &Behaviour,
) -> Result<Response<ResponseBody>, Reset> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    let request = Seen {
        method: parts.method,
        uri: parts.uri.to_string(),
        headers: parts.headers,
        body,
    };
    let hit = hits.fetch_add(1, Ordering::SeqCst) + 1;
    seen.lock().unwrap().push(request.clone());
    match behaviour(hit, &request) {
        Reply::Reset { delay } => {
            tokio::time::sleep(delay).await;
            Err(Reset)
        }
        Reply::BreakOff(status) => {
            let (tx, body) = ResponseBody::channel(4);
            tokio::spawn(async move {
                let _ = tx.send(Frame::data(Bytes::from_static(b"partial"))).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
                tx.abort("broken");
            });
            let mut response = Response::new(body);
            *response.status_mut() = status;
            response
                .headers_mut()
                .insert("content-length", HeaderValue::from_static("1000"));
            Ok(response)
        }
        Reply::Answer {
            delay,
            status,
            headers,
            chunks,
            gap,
        } => {
            tokio::time::sleep(delay).await;
            let body = if chunks.len() <= 1 && gap.is_zero() {
                ResponseBody::full(chunks.into_iter().next().unwrap_or_default())
            } else {
                let (tx, body) = ResponseBody::channel(1);
                tokio::spawn(async move {
                    for (i, chunk) in chunks.into_iter().enumerate() {
                        if i > 0 {
                            tokio::time::sleep(gap).await;
                        }
                        if tx.send(Frame::data(chunk)).await.is_err() {
                            return;
                        }
                    }
                    tx.finish();
                });
                body
            };
            let mut response = Response::new(body);
            *response.status_mut() = status;
            for (name, value) in headers {
                response
                    .headers_mut()
                    .append(name, HeaderValue::from_str(&value).unwrap());
            }
            Ok(response)
        }
    }
}

/// The real proxy, served in-process on loopback port 0.
pub struct Proxy {
    pub addr: SocketAddr,
    pub admin: Option<SocketAddr>,
    pub metrics: Arc<Metrics>,
    pub store: StoreHandle,
    pub reloader: idemgate::server::Reloader,
    stop: Option<oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<()>>,
}

impl Proxy {
    /// Starts idemgate with `toml` (its `[upstream]`, `[server].listen` and
    /// `[server].admin_listen` are filled in) in front of `upstream`, on a
    /// memory store.
    pub async fn start(upstream: &str, toml: &str) -> Proxy {
        let store = StoreHandle::new(Arc::new(MemoryStore::new(64 << 20)), Duration::from_secs(1));
        Proxy::start_with_store(upstream, toml, store).await
    }

    pub async fn start_with_store(upstream: &str, toml: &str, store: StoreHandle) -> Proxy {
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt().with_test_writer().try_init();
        }
        let text = with_basics(upstream, toml);
        let config = Config::parse(&text, "test.toml").unwrap_or_else(|e| panic!("{e}"));
        let server = Server::bind_with_store(config, store.clone()).await.unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let (addr, admin, metrics) = (server.local_addr(), server.admin_addr(), server.metrics());
        let reloader = server.reloader();
        let done = tokio::spawn(server.run(async {
            let _ = stopped.await;
        }));
        Proxy {
            addr,
            admin,
            metrics,
            store,
            reloader,
            stop: Some(stop),
            done: Some(done),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Applies a new configuration (as SIGHUP does), with the basics filled in.
    pub fn reload(&self, upstream: &str, toml: &str) {
        let config = Config::parse(&with_basics(upstream, toml), "reload.toml").unwrap_or_else(|e| panic!("{e}"));
        self.reloader.apply(config).unwrap().log();
    }

    /// Stops accepting and waits for the drain to finish.
    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.done.take().unwrap().await.unwrap();
    }
}

/// An upstream URL on a loopback port that nothing listens on: a port the
/// kernel handed out and that was let go at once.
pub fn unreachable_url() -> String {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://{}", closed.local_addr().unwrap())
}

/// Puts `[upstream]` and loopback port-0 listeners in front of `toml`.
pub fn with_basics(upstream: &str, toml: &str) -> String {
    let mut text = toml.to_string();
    if !text.contains("[server]") {
        text = format!("[server]\n{text}");
    }
    text = text.replacen(
        "[server]",
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"",
        1,
    );
    if !text.contains("[upstream]") {
        text = format!("[upstream]\nurl = \"{upstream}\"\n{text}");
    } else {
        text = text.replacen("[upstream]", &format!("[upstream]\nurl = \"{upstream}\""), 1);
    }
    text
}

/// An answer as the client saw it.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// The `type` of a problem document, less its prefix.
    pub fn problem(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "not a problem: {self:?}"
        );
        let doc: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(doc["status"], self.status.as_u16(), "{doc}");
        assert!(doc["title"].is_string() && doc["detail"].is_string(), "{doc}");
        let kind = doc["type"].as_str().unwrap();
        let slug = kind.rsplit(':').next().unwrap().to_string();
        // One title per type, whichever listener answers (RFC 9457 §3.1.3).
        if let Some(title) = idemgate::proxy::problem::title_of(&slug) {
            assert_eq!(doc["title"], title, "{doc}");
        }
        slug
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A pooled HTTP/1.1 client for tests.
#[derive(Clone)]
pub struct TestClient {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for TestClient {
    fn default() -> Self {
        TestClient {
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }
}

impl TestClient {
    pub async fn send(&self, method: &str, url: &str, headers: &[(&str, &str)], body: &str) -> Answer {
        let mut request = Request::builder().method(method).uri(url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(Bytes::from(body.to_string()))).unwrap();
        let response = self.client.request(request).await.expect("request failed");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("body failed").to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    /// POST with an Idempotency-Key.
    pub async fn post(&self, url: &str, key: &str, body: &str) -> Answer {
        self.send(
            "POST",
            url,
            &[("idempotency-key", key), ("content-type", "application/json")],
            body,
        )
        .await
    }
}

/// A client that speaks only HTTP/2, with prior knowledge (h2c).
pub fn h2_client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).http2_only(true).build_http()
}

/// The real `idemgate` binary as a child process, for crash tests.
pub struct Binary {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    child: std::process::Child,
    _config: tempfile::NamedTempFile,
    log: tempfile::NamedTempFile,
}

impl Binary {
    /// Runs `idemgate --config` with `toml` (listen port filled in) in front of `upstream`.
    pub async fn start(upstream: &str, toml: &str) -> Binary {
        Binary::start_with_env(upstream, toml, &[]).await
    }

    /// As [`Binary::start`], with these environment variables set; its
    /// standard error goes to a file ([`Binary::log`]).
    pub async fn start_with_env(upstream: &str, toml: &str, env: &[(&str, &str)]) -> Binary {
        Binary::start_with_command(upstream, toml, |command| {
            command.envs(env.iter().copied());
        })
        .await
    }

    /// As [`Binary::start`], with writes past `bytes` into any file failing
    /// (`RLIMIT_FSIZE`: the binary takes `SIGXFSZ` itself, so the write
    /// fails with `EFBIG`): a disk that fills up, for this process only.
    pub async fn start_with_file_size_limit(upstream: &str, toml: &str, bytes: u64) -> Binary {
        Binary::start_with_command(upstream, toml, |command| {
            // SAFETY: between fork and exec only an async-signal-safe call
            // is made (setrlimit), and nothing is allocated.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(command, move || {
                    let limit = libc::rlimit {
                        rlim_cur: bytes,
                        rlim_max: bytes,
                    };
                    if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        })
        .await
    }

    /// As [`Binary::start`], with the soft limit on open files at `soft`
    /// (the hard limit left as it is).
    pub async fn start_with_open_files_limit(upstream: &str, toml: &str, soft: u64) -> Binary {
        Binary::start_with_command(upstream, toml, |command| {
            // SAFETY: between fork and exec only async-signal-safe calls
            // are made (getrlimit, setrlimit), and nothing is allocated.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(command, move || {
                    let mut limit = libc::rlimit {
                        rlim_cur: 0,
                        rlim_max: 0,
                    };
                    if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    limit.rlim_cur = soft.min(limit.rlim_max);
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        })
        .await
    }

    /// Starts the binary on ports found free. Another test may take one
    /// of them before the binary binds it (a store's replay can take
    /// seconds): the binary then exits, and is started again on others.
    /// It is up once it says it is serving, not when its port answers,
    /// which that other test's listener would too.
    async fn start_with_command(upstream: &str, toml: &str, configure: impl Fn(&mut std::process::Command)) -> Binary {
        let free = || {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        };
        for _attempt in 0..5 {
            let (port, admin_port) = (free(), free());
            let text = with_basics(upstream, toml)
                .replace(
                    "admin_listen = \"127.0.0.1:0\"",
                    &format!("admin_listen = \"127.0.0.1:{admin_port}\""),
                )
                .replace("listen = \"127.0.0.1:0\"", &format!("listen = \"127.0.0.1:{port}\""));
            let mut config = tempfile::NamedTempFile::new().unwrap();
            std::io::Write::write_all(&mut config, text.as_bytes()).unwrap();
            let log = tempfile::NamedTempFile::new().unwrap();
            let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"));
            command
                .arg("--config")
                .arg(config.path())
                .stdout(std::process::Stdio::null())
                .stderr(log.reopen().unwrap())
                // What it is up by is logged at INFO, whatever the test
                // runner's own RUST_LOG (a test may set its own).
                .env("RUST_LOG", "info");
            configure(&mut command);
            let mut binary = Binary {
                addr: format!("127.0.0.1:{port}").parse().unwrap(),
                admin: format!("127.0.0.1:{admin_port}").parse().unwrap(),
                child: command.spawn().unwrap(),
                _config: config,
                log,
            };
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            loop {
                if binary.child.try_wait().unwrap().is_some() {
                    let log = binary.log();
                    assert!(log.contains("in use"), "idemgate exited: {log}");
                    break;
                }
                if binary.log().contains("idemgate serving") {
                    return binary;
                }
                assert!(tokio::time::Instant::now() < deadline, "idemgate did not start");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        panic!("no free ports for idemgate");
    }

    /// What the process wrote to standard error so far.
    pub fn log(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(self.log.path()).unwrap()).into_owned()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn signal(&self, name: &str) {
        let status = std::process::Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits for the process to exit by itself.
    pub fn wait(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + within;
        while std::time::Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn config_path(&self) -> &std::path::Path {
        self._config.path()
    }

    /// The process's resident memory, in bytes.
    pub fn resident_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|line| line.starts_with("VmRSS:")).unwrap();
        let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        kib * 1024
    }

    /// SIGKILL: no cleanup of any kind.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        self.kill9();
    }
}
