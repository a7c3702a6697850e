//! The configuration file and the command line (SPEC §1 and §2).

use std::process::Command;
use std::time::Duration;

use idemgate::config::{BodyMode, Config, DeriveField, Mode, OnInFlight, StoreBackend};

const EXAMPLE: &str = include_str!("../config.example.toml");

fn idemgate(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(args)
        .output()
        .unwrap()
}

/// A file written for one test, removed with its directory when dropped.
struct TempFile {
    path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl std::ops::Deref for TempFile {
    type Target = std::path::Path;

    fn deref(&self) -> &std::path::Path {
        &self.path
    }
}

fn temp_file(name: &str, text: &str) -> TempFile {
    let dir = tempfile::Builder::new()
        .prefix("idemgate-config-test-")
        .tempdir()
        .unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    TempFile { path, _dir: dir }
}

#[test]
fn the_example_parses_and_mentions_every_option() {
    let config = Config::parse(EXAMPLE, "config.example.toml").unwrap();
    assert_eq!(config.routes.len(), 3);
    let options = [
        "listen",
        "admin_listen",
        "admin_token",
        "tls",
        "max_request_body",
        "header_read_timeout",
        "shutdown_grace",
        "workers",
        "url",
        "connect_timeout",
        "timeout",
        "idle_timeout",
        "ca",
        "backend",
        "path",
        "urls",
        "max_memory",
        "on_error",
        "methods",
        "ttl",
        "lock_timeout",
        "scope",
        "on_in_flight",
        "wait_timeout",
        "on_server_error",
        "on_upstream_failure",
        "refresh_ttl_on_replay",
        "max_response_body",
        "forward_key_header",
        "replay_drop_headers",
        "mode",
        "header",
        "required",
        "max_length",
        "derive",
        "headers",
        "body",
        "ignore",
        "name",
        "host",
        "upstream",
        "key",
        "fingerprint",
    ];
    for option in options {
        let mentioned = EXAMPLE.lines().any(|line| {
            let line = line.trim_start_matches(['#', ' ']);
            line.starts_with(&format!("{option} ="))
                || line.contains(&format!(" {option} = "))
                || line.contains(&format!("{{ {option} ="))
        });
        assert!(mentioned, "config.example.toml does not show `{option}`");
    }
}

/// A config printed for debugging shows no secret: the admin token only
/// as there being one, a Redis URL's password masked.
#[test]
fn a_config_printed_for_debugging_shows_no_secret() {
    let config = Config::parse(
        "[server]\nadmin_token = \"tok-s3cret\"\n\
         [upstream]\nurl = \"http://127.0.0.1:9\"\n\
         [store]\nbackend = \"redis\"\nurl = \"redis://user:pa55word@127.0.0.1:6379/0\"\n\
         [[route]]\nname = \"a\"\npath = \"/a\"\n",
        "x.toml",
    )
    .unwrap();
    let printed = format!("{config:?}");
    assert!(printed.contains("admin_token: Some(\"<redacted>\")"), "{printed}");
    assert!(!printed.contains("tok-s3cret"), "{printed}");
    assert!(!printed.contains("pa55word"), "{printed}");
}

#[test]
fn routes_override_defaults_field_by_field() {
    let config = Config::parse(
        r#"
[upstream]
url = "http://127.0.0.1:1"
[store]
backend = "memory"
[defaults]
ttl = "2h"
on_in_flight = "wait"
[defaults.key]
max_length = 40
derive = ["body:/id"]
[defaults.fingerprint]
body = "json"
ignore = ["/ts"]
[[route]]
name = "a"
path = "/a"
[[route]]
name = "b"
path = "/b/{id}"
ttl = "5m"
mode = "shadow"
key = { required = false, derive = ["path:id", "header:X-Tenant"] }
fingerprint = { body = "none" }
"#,
        "t.toml",
    )
    .unwrap();
    let (a, b) = (&config.routes[0].policy, &config.routes[1].policy);
    assert_eq!(a.ttl, Duration::from_secs(7200));
    assert_eq!(a.on_in_flight, OnInFlight::Wait);
    assert_eq!(a.key.max_length, 40);
    assert_eq!(a.fingerprint.ignore, vec!["/ts".to_string()]);
    assert_eq!(b.ttl, Duration::from_secs(300));
    assert_eq!(b.mode, Mode::Shadow);
    assert_eq!(b.on_in_flight, OnInFlight::Wait, "inherited");
    assert!(!b.key.required);
    assert_eq!(b.key.max_length, 40, "inherited inside key");
    assert_eq!(
        b.key.derive,
        vec![
            DeriveField::Header("x-tenant".parse().unwrap()),
            DeriveField::Path("id".into())
        ],
        "sorted"
    );
    assert_eq!(b.fingerprint.body, BodyMode::None);
    assert_eq!(
        b.fingerprint.ignore,
        vec!["/ts".to_string()],
        "inherited inside fingerprint"
    );
    assert!(matches!(config.store.backend, StoreBackend::Memory { max_memory } if max_memory == 256 << 20));
}

#[test]
fn every_problem_is_reported_at_once_by_field() {
    let error = Config::parse(
        r#"
[server]
max_request_body = "12 parsecs"
[upstream]
url = "ftp://example"
[defaults]
ttl = "0s"
on_server_error = "sometimes"
[[route]]
name = "a"
path = "/a/{id}"
key = { derive = ["path:nope"] }
[[route]]
name = "a"
path = "no-slash"
lock_timeout = "soon"
methods = ["post"]
fingerprint = { ignore = ["ts"] }
"#,
        "broken.toml",
    )
    .unwrap_err()
    .to_string();
    for expected in [
        "broken.toml",
        "server.max_request_body",
        "upstream.url",
        "defaults.ttl",
        "defaults.on_server_error",
        "route[0].key.derive",
        "route[1].name",
        "route[1].path",
        "route[1].lock_timeout",
        "route[1].methods",
        "route[1].fingerprint.ignore",
    ] {
        assert!(error.contains(expected), "`{expected}` missing from:\n{error}");
    }
}

#[test]
fn syntax_errors_name_the_file_line_and_column() {
    let error = Config::parse("[upstream]\nurl = \"http://x\"\n[server]\nlisten = \n", "syntax.toml")
        .unwrap_err()
        .to_string();
    assert!(error.contains("syntax.toml"), "{error}");
    assert!(error.contains("line 4"), "{error}");
    let unknown = Config::parse("[upstream]\nurl = \"http://x\"\nretries = 3\n", "unknown.toml")
        .unwrap_err()
        .to_string();
    assert!(unknown.contains("retries"), "{unknown}");
    // The line is not quoted back: it may hold a secret.
    let broken = Config::parse(
        "[upstream]\nurl = \"http://x\"\n[server]\nadmin_token = \"s3cret\n",
        "broken.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(broken.contains("line 4"), "{broken}");
    assert!(!broken.contains("s3cret"), "{broken}");
}

#[test]
fn a_field_of_the_wrong_type_is_named_with_its_line() {
    let base = "[upstream]\nurl = \"http://x\"\n";
    for (text, field, line) in [
        (
            "[defaults]\nttl = 5\n",
            "defaults.ttl: invalid type: integer",
            "line 4, column 7",
        ),
        (
            "[defaults.key]\nrequired = \"yes\"\n",
            "defaults.key.required: invalid type: string",
            "line 4",
        ),
        (
            "[[route]]\nname = \"a\"\npath = \"/a\"\n[[route]]\nname = \"b\"\npath = \"/b\"\nrefresh_ttl_on_replay = \"yes\"\n",
            "route[1].refresh_ttl_on_replay: invalid type: string, expected a boolean",
            "line 9, column 25",
        ),
        (
            "[[route]]\nname = \"a\"\npath = \"/a\"\n[route.fingerprint]\nheaders = \"x-a\"\n",
            "route[0].fingerprint.headers: invalid type: string",
            "line 7",
        ),
        (
            "[[route]]\nname = \"a\"\npath = \"/a\"\nttls = \"1h\"\n",
            "route[0]: unknown field `ttls`",
            "line 6, column 1",
        ),
        (
            "[[route]]\nname = 7\n",
            "route[0].name: invalid type: integer",
            "line 4",
        ),
        (
            "[server]\nworkers = \"2\"\n",
            "server.workers: invalid type: string",
            "line 4",
        ),
    ] {
        let error = Config::parse(&format!("{base}{text}"), "x.toml")
            .unwrap_err()
            .to_string();
        assert!(error.contains(field), "{text}: {error}");
        assert!(error.contains(line), "{text}: {error}");
    }
}

#[test]
fn a_missing_upstream_url_is_named() {
    let error = Config::parse("[store]\nbackend = \"memory\"\n", "x.toml")
        .unwrap_err()
        .to_string();
    assert!(error.contains("upstream.url"), "{error}");
}

/// A route with no methods claims no request: its path passes every
/// request through, which a slip should not do silently; `check` says so.
#[test]
fn check_warns_of_a_route_without_methods() {
    let path = temp_file(
        "methods.toml",
        "[upstream]\nurl = \"http://127.0.0.1:1\"\n[[route]]\nname = \"a\"\npath = \"/a\"\nmethods = []\n",
    );
    let warning = the_one_warning_of_check(&path);
    assert!(warning.contains("route[0] a: methods is empty"), "{warning}");
}

/// A port the URL parser lets by, which would become the scheme's own
/// (`:80800` port 80), or no host at all, is named; a route's upstream
/// is read alike.
#[test]
fn an_upstream_url_needs_a_host_and_a_port_that_is_one() {
    for (url, message) in [
        ("http://127.0.0.1:80800", "port `80800`"),
        ("http://127.0.0.1:PW123", "port `PW123`"),
        ("http://127.0.0.1:0", "port `0`"),
        ("http://127.0.0.1:", "port ``"),
        ("http://[::1]:99999", "port `99999`"),
        ("http://:8080", "has no host"),
        ("http://127.0.0.1:8080#frag", "fragment"),
        ("http://127.0.0.1:8080/#", "fragment"),
    ] {
        for (text, field) in [
            (format!("[upstream]\nurl = \"{url}\"\n"), "upstream.url"),
            (
                format!(
                    "[upstream]\nurl = \"http://h:1\"\n[[route]]\nname = \"a\"\npath = \"/a\"\nupstream = \"{url}\"\n"
                ),
                "route[0].upstream",
            ),
        ] {
            let error = Config::parse(&text, "x.toml").unwrap_err().to_string();
            assert!(error.contains(field) && error.contains(message), "{url}: {error}");
        }
    }
    for url in ["http://127.0.0.1:8080", "https://[::1]:65535/", "http://h"] {
        let text = format!("[upstream]\nurl = \"{url}\"\n");
        Config::parse(&text, "x.toml").unwrap_or_else(|e| panic!("{url}: {e}"));
    }
}

#[test]
fn sizes_and_durations() {
    let config = Config::parse(
        "[upstream]\nurl = \"http://h:1\"\n[server]\nmax_request_body = \"64KiB\"\nshutdown_grace = \"1m 30s\"\n[store]\nbackend = \"memory\"\nmax_memory = 4194304\n",
        "x.toml",
    )
    .unwrap();
    assert_eq!(config.server.max_request_body, 65536);
    assert_eq!(config.server.shutdown_grace, Duration::from_secs(90));
    assert!(matches!(
        config.store.backend,
        StoreBackend::Memory { max_memory: 4194304 }
    ));
    // Too small to keep records, or not a size: named, whatever the backend.
    for (store, message) in [
        ("backend = \"memory\"\nmax_memory = 4096", "must be at least 1MiB"),
        ("backend = \"embedded\"\nmax_memory = \"1GB\"", "1GB"),
    ] {
        let text = format!("[upstream]\nurl = \"http://h:1\"\n[store]\n{store}\n");
        let error = Config::parse(&text, "x.toml").unwrap_err().to_string();
        assert!(error.contains("store.max_memory") && error.contains(message), "{error}");
    }
}

#[test]
fn leases_and_ttls_shorter_than_a_second_are_refused() {
    // A sub-millisecond lease is rounded to nothing by the stores: a claim
    // would be gone as it is written, and a second request let in.
    let error = Config::parse(
        "[upstream]\nurl = \"http://h:1\"\n[[route]]\nname = \"a\"\npath = \"/a\"\nlock_timeout = \"500us\"\nttl = \"999ms\"\n",
        "x.toml",
    )
    .unwrap_err()
    .to_string();
    for field in ["route[0].lock_timeout", "route[0].ttl"] {
        assert!(error.contains(field), "`{field}` missing from:\n{error}");
    }
    assert!(error.contains("at least 1s"), "{error}");
    let config = Config::parse(
        "[upstream]\nurl = \"http://h:1\"\n[[route]]\nname = \"a\"\npath = \"/a\"\nlock_timeout = \"1s\"\nttl = \"1s\"\n",
        "x.toml",
    )
    .unwrap();
    assert_eq!(config.routes[0].policy.lock_timeout, Duration::from_secs(1));
}

#[test]
fn check_output_masks_redis_passwords() {
    for store in [
        "backend = \"redis\"\nurl = \"redis://:s3cret@127.0.0.1:6379/0\"",
        "backend = \"redis\"\nurls = [\"redis://app:s3cret@127.0.0.1:7000\", \"redis://app:s3cret@127.0.0.1:7001\"]",
    ] {
        let text = format!("[upstream]\nurl = \"http://h:1\"\n[store]\n{store}\n");
        let config = Config::parse(&text, "x.toml").unwrap();
        let described = idemgate::config::describe(&config);
        assert!(!described.contains("s3cret"), "{described}");
        assert!(described.contains(":***@127.0.0.1"), "{described}");
    }
    // A Unix socket's URL carries its password in the query.
    let text = "[upstream]\nurl = \"http://h:1\"\n[store]\nbackend = \"redis\"\n\
        url = \"redis+unix:///run/redis.sock?db=2&pass=s3cret&user=app\"\n";
    let described = idemgate::config::describe(&Config::parse(text, "x.toml").unwrap());
    assert!(!described.contains("s3cret"), "{described}");
    assert!(
        described.contains("redis+unix:///run/redis.sock?db=2&pass=***&user=app"),
        "{described}"
    );
}

#[test]
fn check_output_reads_as_the_config_is_written() {
    let text = "[upstream]\nurl = \"http://h:1\"\n[store]\nbackend = \"memory\"\nmax_memory = \"64MiB\"\non_error = \"pass\"\n\
        [[route]]\nname = \"a\"\npath = \"/a\"\non_in_flight = \"wait\"\non_server_error = \"store\"\n\
        on_upstream_failure = \"unknown\"\nmode = \"shadow\"\nmax_response_body = 1500\nfingerprint = { body = \"json\" }\n\
        forward_key_header = \"X-Req-Id\"\nreplay_drop_headers = [\"x-backend\"]\nkey = { max_length = 64 }\n";
    let described = idemgate::config::describe(&Config::parse(text, "x.toml").unwrap());
    for says in [
        "store    memory (max_memory 64MiB), on_error pass  timeout 1s",
        "server   listen 127.0.0.1:8080  admin 127.0.0.1:9901 (records: from this machine only)  tls off",
        "max_request_body 1MiB  header_read_timeout 10s  shutdown_grace 30s",
        "upstream http://h:1/  connect_timeout 2s  timeout 30s  idle_timeout 4s  ca (webpki roots)",
        "in_flight wait (wait 10s)",
        "server_error store",
        "upstream_failure unknown",
        "mode shadow",
        "fingerprint body json",
        "max_response_body 1500",
        "max_length 64",
        "forwarded as x-req-id",
        "replay   drops [x-backend]",
    ] {
        assert!(described.contains(says), "{says:?} in {described}");
    }
    let text = "[server]\nadmin_token = \"t0ken-9f3a\"\nworkers = 3\nshutdown_grace = \"5s\"\n\
        [upstream]\nurl = \"http://h:1\"\ntimeout = \"3s\"\n[store]\npath = \"x.redb\"\n\
        [[route]]\nname = \"a\"\npath = \"/a\"\n";
    let described = idemgate::config::describe(&Config::parse(text, "x.toml").unwrap());
    assert!(!described.contains("t0ken-9f3a"), "{described}");
    for says in [
        "store    embedded (path x.redb), on_error reject",
        "admin 127.0.0.1:9901 (records: with the token)  tls off  workers 3",
        "shutdown_grace 5s",
        "connect_timeout 1s 500ms (half of timeout)  timeout 3s",
        "body raw",
        "max_response_body 1MiB",
    ] {
        assert!(described.contains(says), "{says:?} in {described}");
    }
}

#[test]
fn an_admin_listener_off_loopback_needs_a_token() {
    let base = "[upstream]\nurl = \"http://h:1\"\n[server]\n";
    let error = Config::parse(&format!("{base}admin_listen = \"0.0.0.0:9901\"\n"), "x.toml")
        .unwrap_err()
        .to_string();
    assert!(error.contains("server.admin_token"), "{error}");
    assert!(error.contains("loopback"), "{error}");
    Config::parse(
        &format!("{base}admin_listen = \"0.0.0.0:9901\"\nadmin_token = \"t0ken\"\n"),
        "x.toml",
    )
    .unwrap();
    Config::parse(&format!("{base}admin_listen = \"[::1]:9901\"\n"), "x.toml").unwrap();
}

#[test]
fn the_admin_listener_cannot_share_the_proxys_address() {
    let text =
        "[server]\nlisten = \"127.0.0.1:8080\"\nadmin_listen = \"127.0.0.1:8080\"\n[upstream]\nurl = \"http://h:1\"\n";
    let error = Config::parse(text, "x.toml").unwrap_err().to_string();
    assert!(
        error.contains("server.admin_listen") && error.contains("127.0.0.1:8080"),
        "{error}"
    );
    Config::parse(
        &text.replace("admin_listen = \"127.0.0.1:8080\"", "admin_listen = \"\""),
        "x.toml",
    )
    .unwrap();
}

#[test]
fn store_paths_and_urls_are_checked_before_anything_is_bound() {
    let base = "[upstream]\nurl = \"http://h:1\"\n[store]\n";
    for (store, field, says) in [
        ("backend = \"embedded\"\npath = \"\"", "store.path", "must name a file"),
        (
            "backend = \"embedded\"\npath = \"/no/such/dir/idemgate.redb\"",
            "store.path",
            "/no/such/dir does not exist",
        ),
        (
            "backend = \"redis\"\nurl = \"http://:pw@127.0.0.1:6379\"",
            "store.url",
            "is not a Redis URL",
        ),
        (
            "backend = \"redis\"\nurls = [\"redis://127.0.0.1:7000\", \"127.0.0.1 7001\"]",
            "store.urls",
            "is not a Redis URL",
        ),
        ("backend = \"redis\"\nurl = \"\"", "store.url", "is empty"),
        ("backend = \"redis\"\nkey_prefix = \"\"", "store.key_prefix", "is empty"),
        (
            "backend = \"redis\"\nkey_prefix = \"a{b}\"",
            "store.key_prefix",
            "may not hold '{'",
        ),
        (
            "backend = \"redis\"\nkey_prefix = \"a b\"",
            "store.key_prefix",
            "may not hold ' '",
        ),
        (
            "backend = \"redis\"\nkey_prefix = \"or*\"",
            "store.key_prefix",
            "may not hold '*'",
        ),
        (
            "backend = \"redis\"\nkey_prefix = \"a:b\"",
            "store.key_prefix",
            "may not hold ':'",
        ),
        (
            "backend = \"redis\"\nkey_prefix = \"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"",
            "store.key_prefix",
            "is 65 bytes long: at most 64",
        ),
        (
            "backend = \"redis\"\nwait_for_replicas = 65",
            "store.wait_for_replicas",
            "must be from 0 to 64",
        ),
        // Each a Redis URL, but not of one cluster: `serve` could not open it.
        (
            "backend = \"redis\"\nurls = [\"redis://:pw@127.0.0.1:7000\", \"redis://:other@127.0.0.1:7001\"]",
            "store.urls",
            "cannot name one Redis Cluster",
        ),
        (
            "backend = \"redis\"\nurls = [\"redis://127.0.0.1:7000/1\", \"redis://127.0.0.1:7001/2\"]",
            "store.urls",
            "cannot name one Redis Cluster (different databases)",
        ),
        (
            "backend = \"redis\"\nurls = [\"redis://127.0.0.1:7000\", \"redis+unix:///tmp/redis.sock\"]",
            "store.urls",
            "cannot name one Redis Cluster (a Unix socket",
        ),
    ] {
        let error = Config::parse(&format!("{base}{store}\n"), "x.toml")
            .unwrap_err()
            .to_string();
        assert!(error.contains(field) && error.contains(says), "{store}: {error}");
        assert!(!error.contains(":pw@"), "{error}");
    }
    Config::parse(
        &format!("{base}backend = \"embedded\"\npath = \"idemgate.redb\"\n"),
        "x.toml",
    )
    .unwrap();
    let copied = Config::parse(&format!("{base}backend = \"redis\"\nwait_for_replicas = 2\n"), "x.toml").unwrap();
    assert_eq!(copied.store.wait_for_replicas, 2);
    assert!(
        idemgate::config::store_summary(&copied).ends_with("key_prefix idemgate, wait_for_replicas 2)"),
        "{}",
        idemgate::config::store_summary(&copied)
    );
}

/// Settings a request could never meet, or that would fail every request,
/// are refused by field instead of accepted: a route host with a port,
/// scheme or wildcard (it would match nothing, and every request would
/// pass through unprotected), pointers to ignore in a body fingerprinted
/// raw (nothing left out), a duration past what a clock can add.
/// A config of one route, `/a`, with `extra` lines of its own.
fn route(extra: &str) -> Result<Config, String> {
    let toml = format!("[upstream]\nurl = \"http://h:1\"\n[[route]]\nname = \"a\"\npath = \"/a\"\n{extra}\n");
    Config::parse(&toml, "x.toml").map_err(|e| e.to_string())
}

#[test]
fn settings_that_could_never_work_are_refused_by_field() {
    for host in [
        "api.example.com:8443",
        "https://api.example.com",
        "*.example.com",
        "api.example.com/v1",
        "",
        "a b",
    ] {
        let error = route(&format!("host = \"{host}\"")).unwrap_err();
        assert!(error.contains("route[0].host"), "{host}: {error}");
    }
    for (host, kept) in [
        ("API.Example.com.", "api.example.com"),
        ("10.0.0.7", "10.0.0.7"),
        ("[::1]", "[::1]"),
        ("svc_1.internal", "svc_1.internal"),
    ] {
        let config = route(&format!("host = \"{host}\"")).unwrap();
        assert_eq!(config.routes[0].host.as_deref(), Some(kept));
    }

    // The key read from, or forwarded under, a header of the connection
    // or the framing, or forwarded in place of one idemgate sets: the
    // client would set the upstream's X-Forwarded-For, say.
    for (field, name) in [
        ("forward_key_header", "X-Forwarded-For"),
        ("forward_key_header", "x_forwarded_host"),
        ("forward_key_header", "Connection"),
        ("forward_key_header", "content-length"),
        ("forward_key_header", "host"),
        ("forward_key_header", "transfer-encoding"),
        ("forward_key_header", "Expect"),
        ("forward_key_header", "Forwarded"),
        // A credential the key would replace.
        ("forward_key_header", "Authorization"),
        ("forward_key_header", "proxy-authorization"),
        ("forward_key_header", "Cookie"),
        // What the backend reads the body by, which the key would replace.
        ("forward_key_header", "content-type"),
        ("forward_key_header", "Content-Encoding"),
        ("forward_key_header", "content-md5"),
        ("forward_key_header", "Content_Type"),
        ("key.header", "expect"),
        // Shared by every request of one type.
        ("key.header", "Content-Type"),
        ("key.header", "content-encoding"),
        ("key.header", "Content-Length"),
        ("key.header", "connection"),
        ("key.header", "upgrade"),
        ("key.header", "Host"),
    ] {
        let line = match field.strip_prefix("key.") {
            Some(inner) => format!("key = {{ {inner} = \"{name}\" }}"),
            None => format!("{field} = \"{name}\""),
        };
        let error = route(&line).unwrap_err();
        assert!(error.contains(&format!("route[0].{field}")), "{name}: {error}");
    }
    // A tunnel, which the listener refuses before any route.
    let error = route("methods = [\"POST\", \"CONNECT\"]").unwrap_err();
    assert!(
        error.contains("route[0].methods") && error.contains("CONNECT"),
        "{error}"
    );
    // A scope by a header of the connection.
    let error = route("scope = [\"authorization\", \"Connection\"]").unwrap_err();
    assert!(
        error.contains("route[0].scope") && error.contains("connection"),
        "{error}"
    );
    // A header the route's scope reads, which the key would replace.
    let error = route("scope = [\"x-tenant\"]\nforward_key_header = \"X-Tenant\"").unwrap_err();
    assert!(
        error.contains("route[0].forward_key_header") && error.contains("scope"),
        "{error}"
    );
    for ok in [
        "forward_key_header = \"X-Request-Key\"",
        "forward_key_header = \"\"",
        "key = { header = \"X-Forwarded-For\" }",
        "key = { header = \"Content-MD5\" }",
    ] {
        route(ok).unwrap();
    }
    // An empty derive list is no derive: how a route opts out of the
    // defaults' list.
    let inherited = "[upstream]\nurl = \"http://h:1\"\n[defaults.key]\nderive = [\"body:/id\"]\n\
        [[route]]\nname = \"a\"\npath = \"/a\"\nkey = { derive = [] }\n";
    let config = Config::parse(inherited, "x.toml").unwrap();
    assert!(config.routes[0].policy.key.derive.is_empty());

    let error = route("fingerprint = { ignore = [\"/ts\"] }").unwrap_err();
    assert!(
        error.contains("route[0].fingerprint.ignore") && error.contains("\"json\""),
        "{error}"
    );
    // From [defaults], judged on each route as it resolves them.
    let inherited = "[upstream]\nurl = \"http://h:1\"\n[defaults.fingerprint]\nignore = [\"/ts\"]\n\
        [[route]]\nname = \"a\"\npath = \"/a\"\nfingerprint = { body = \"json\" }\n\
        [[route]]\nname = \"b\"\npath = \"/b\"\n";
    let error = Config::parse(inherited, "x.toml").unwrap_err().to_string();
    assert!(
        error.contains("route[1].fingerprint.ignore") && !error.contains("route[0]"),
        "{error}"
    );
    for ok in [
        "fingerprint = { body = \"json\", ignore = [\"/ts\"] }",
        "fingerprint = { body = \"none\", ignore = [\"/ts\"] }",
    ] {
        route(ok).unwrap();
    }

    for (field, value) in [
        ("ttl", "101y"),
        ("lock_timeout", "300000000000y"),
        ("wait_timeout", "10000000000000000000s"),
    ] {
        let error = route(&format!("{field} = \"{value}\"")).unwrap_err();
        assert!(error.contains(&format!("route[0].{field}")), "{field}: {error}");
    }
    let error = Config::parse("[upstream]\nurl = \"http://h:1\"\ntimeout = \"1000y\"\n", "x.toml")
        .unwrap_err()
        .to_string();
    assert!(error.contains("upstream.timeout") && error.contains("100y"), "{error}");
    assert_eq!(
        route("ttl = \"100y\"").unwrap().routes[0].policy.ttl,
        Duration::from_secs(3_155_760_000)
    );

    // The store: a directory as its file.
    let store = |fields: &str| {
        Config::parse(
            &format!("[upstream]\nurl = \"http://h:1\"\n[store]\n{fields}\n"),
            "x.toml",
        )
        .map_err(|e| e.to_string())
    };
    let dir = std::env::temp_dir();
    let error = store(&format!("path = \"{}\"", dir.display())).unwrap_err();
    assert!(error.contains("store.path") && error.contains("directory"), "{error}");
}

/// A derived key or a fingerprint that reads a header of the connection
/// (which each hop may change) or a field the fingerprint leaves out as
/// volatile would tell a retry from its first try.
#[test]
fn keys_and_fingerprints_read_no_per_hop_header_and_no_volatile_field() {
    for (line, field, named) in [
        (
            "fingerprint = { headers = [\"content-type\", \"Connection\"] }",
            "fingerprint.headers",
            "Connection",
        ),
        ("key = { derive = [\"header:te\", \"body:/id\"] }", "key.derive", "te"),
        ("key = { derive = [\"header:Upgrade\"] }", "key.derive", "Upgrade"),
        // Framing: a retry sent chunked, or by a client that asks for a 100
        // only on large bodies.
        (
            "fingerprint = { headers = [\"content-length\"] }",
            "fingerprint.headers",
            "content-length",
        ),
        ("key = { derive = [\"header:expect\"] }", "key.derive", "expect"),
        // The whole body, and a part of it, holding an ignored field.
        (
            "key = { derive = [\"body:\"] }\nfingerprint = { body = \"json\", ignore = [\"/ts\"] }",
            "key.derive",
            "/ts",
        ),
        (
            "key = { derive = [\"body:/event\"] }\nfingerprint = { body = \"json\", ignore = [\"/event/sent_at\"] }",
            "key.derive",
            "/event/sent_at",
        ),
        (
            "key = { derive = [\"body:/id\", \"body:/ts\"] }\nfingerprint = { body = \"none\", ignore = [\"/ts\"] }",
            "key.derive",
            "/ts",
        ),
    ] {
        let error = route(line).unwrap_err();
        assert!(
            error.contains(&format!("route[0].{field}")) && error.contains(&format!("`{named}`")),
            "{line}: {error}"
        );
    }
    for ok in [
        "fingerprint = { headers = [\"content-type\", \"x-tenant\"] }",
        "key = { derive = [\"header:x-tenant\", \"body:/id\"] }",
        // The whole body where nothing is said to be volatile.
        "key = { derive = [\"body:\"] }",
        // A name that merely starts like an ignored one, and a field
        // inside an ignored one (stable, in a part that is not).
        "key = { derive = [\"body:/tsx\", \"body:/meta/id\"] }\nfingerprint = { body = \"json\", ignore = [\"/ts\", \"/meta\"] }",
    ] {
        route(ok).unwrap();
    }
    // From [defaults], judged on each route as it resolves them.
    let inherited = "[upstream]\nurl = \"http://h:1\"\n[defaults.fingerprint]\nbody = \"json\"\nignore = [\"/ts\"]\n\
        [[route]]\nname = \"a\"\npath = \"/a\"\nkey = { derive = [\"body:/id\"] }\n\
        [[route]]\nname = \"b\"\npath = \"/b\"\nkey = { derive = [\"body:\"] }\n";
    let error = Config::parse(inherited, "x.toml").unwrap_err().to_string();
    assert!(
        error.contains("route[1].key.derive") && !error.contains("route[0]"),
        "{error}"
    );
}

#[test]
fn ignored_pointers_are_kept_in_an_order_that_removes_what_they_name() {
    // Removing /items/0 first would shift the array, and /items/1 would
    // then remove the third element instead of the second.
    let config = Config::parse(
        "[upstream]\nurl = \"http://h:1\"\n[[route]]\nname = \"a\"\npath = \"/a\"\nfingerprint = { body = \"json\", ignore = [\"/items/0\", \"/items/1\", \"/ts\"] }\n",
        "x.toml",
    )
    .unwrap();
    assert_eq!(
        config.routes[0].policy.fingerprint.ignore,
        ["/ts", "/items/1", "/items/0"]
    );
    // Listed twice, a pointer is removed once: twice, it took the element
    // after the one it names too.
    let config = Config::parse(
        "[upstream]\nurl = \"http://h:1\"\n[[route]]\nname = \"a\"\npath = \"/a\"\nfingerprint = { body = \"json\", ignore = [\"/items/1\", \"/items/1\"] }\n",
        "x.toml",
    )
    .unwrap();
    assert_eq!(config.routes[0].policy.fingerprint.ignore, ["/items/1"]);
    for (fields, field) in [
        (
            "fingerprint = { body = \"json\", ignore = [\"/a~2b\"] }",
            "route[0].fingerprint.ignore",
        ),
        ("key = { derive = [\"body:/a~\"] }", "route[0].key.derive"),
    ] {
        let error = Config::parse(
            &format!("[upstream]\nurl = \"http://h:1\"\n[[route]]\nname = \"a\"\npath = \"/a\"\n{fields}\n"),
            "x.toml",
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains(field) && error.contains("`~0`"), "{error}");
    }
}

#[test]
fn check_prints_each_route_and_exits_zero() {
    let output = idemgate(&["check", "--config", "config.example.toml"]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8_lossy(&output.stdout);
    for name in ["create-order", "update-order", "incidents"] {
        assert!(stdout.contains(&format!("route {name}")), "{stdout}");
    }
}

/// A lease under three times the store's timeout is valid but unwise: a
/// renewal may take longer than what is left of it. `check` says so, by
/// route, and still passes.
#[test]
fn check_warns_of_a_lease_a_slow_store_could_outlast() {
    let path = temp_file(
        "lease.toml",
        "[upstream]\nurl = \"http://127.0.0.1:1\"\n[store]\ntimeout = \"1s\"\n\
         [[route]]\nname = \"ok\"\npath = \"/ok\"\nlock_timeout = \"3s\"\n\
         [[route]]\nname = \"short\"\npath = \"/short\"\nlock_timeout = \"2s\"\n",
    );
    let warning = the_one_warning_of_check(&path);
    assert!(
        warning.contains("route[1] short: lock_timeout 2s is under three times store.timeout (1s)"),
        "{warning}"
    );
}

/// The one warning `idemgate check` prints for the file at `path`, which
/// it passes.
fn the_one_warning_of_check(path: &std::path::Path) -> String {
    let output = idemgate(&["check", "--config", path.to_str().unwrap()]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let warnings: Vec<_> = stdout.lines().filter(|l| l.starts_with("warning: ")).collect();
    assert_eq!(warnings.len(), 1, "{stdout}");
    warnings[0].to_owned()
}

/// On Redis, a replay reads the whole record back within store.timeout:
/// an answer larger than that time moves could never be replayed, and
/// `check` says so of the route that may record one (not of the other,
/// nor on the memory store).
#[test]
fn check_warns_of_answers_too_large_to_read_back_from_redis_in_time() {
    let routes = "[[route]]\nname = \"big\"\npath = \"/big\"\nmax_response_body = \"64MiB\"\n\
                  [[route]]\nname = \"small\"\npath = \"/small\"\nmax_response_body = \"8MiB\"\n";
    let on_redis = temp_file(
        "large.toml",
        &format!(
            "[upstream]\nurl = \"http://127.0.0.1:1\"\n[store]\nbackend = \"redis\"\n\
             url = \"redis://127.0.0.1:1\"\n{routes}"
        ),
    );
    let warning = the_one_warning_of_check(&on_redis);
    assert!(
        warning.contains("route[0] big: max_response_body") && warning.contains("store.timeout (1s"),
        "{warning}"
    );
    let in_memory = temp_file(
        "large-memory.toml",
        &format!("[upstream]\nurl = \"http://127.0.0.1:1\"\n{routes}"),
    );
    let output = idemgate(&["check", "--config", in_memory.to_str().unwrap()]);
    assert!(output.status.success());
    assert!(!String::from_utf8_lossy(&output.stdout).contains("warning: "));
}

/// A route whose path holds `;` or `//` could never be reached: a request
/// for it reads elsewhere as some backends read it, and is refused. `check`
/// says so.
#[test]
fn check_warns_of_a_route_no_request_can_reach() {
    let path = temp_file(
        "unreachable.toml",
        "[upstream]\nurl = \"http://127.0.0.1:1\"\n\
         [[route]]\nname = \"matrix\"\npath = \"/v1/items;v=2\"\n\
         [[route]]\nname = \"ok\"\npath = \"/v1/orders\"\n",
    );
    let warning = the_one_warning_of_check(&path);
    assert!(warning.contains("route[0] matrix: path holds `;` or `//`"), "{warning}");
}

/// `/files/*` and `/orders/:id` are other routers' wildcards: here they
/// match only that very text, and `check` says how to write what was
/// meant. A `*` or `:` elsewhere in a segment is no such slip.
#[test]
fn check_warns_of_another_routers_wildcards() {
    let path = temp_file(
        "wildcards.toml",
        "[upstream]\nurl = \"http://127.0.0.1:1\"\n\
         [[route]]\nname = \"files\"\npath = \"/files/*\"\n\
         [[route]]\nname = \"order\"\npath = \"/orders/:id/items\"\n\
         [[route]]\nname = \"prefix\"\npath = \"/v2/report*\"\n\
         [[route]]\nname = \"plain\"\npath = \"/v1/a*b/urn:x\"\n",
    );
    let output = idemgate(&["check", "--config", path.to_str().unwrap()]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let warnings: Vec<_> = stdout.lines().filter(|l| l.starts_with("warning: ")).collect();
    assert_eq!(warnings.len(), 3, "{stdout}");
    for (warning, (route, segment)) in warnings.iter().zip([
        ("route[0] files", "*"),
        ("route[1] order", ":id"),
        ("route[2] prefix", "report*"),
    ]) {
        assert!(
            warning.contains(&format!(
                "{route}: path segment `{segment}` is matched as that very text"
            )),
            "{warning}"
        );
    }
}

/// Routes are matched in order: one that an earlier route takes every
/// request of is never reached, and `check` says so. Narrower routes
/// listed first, other methods and routes of another host are not.
#[test]
fn check_warns_of_a_route_an_earlier_one_shadows() {
    let path = temp_file(
        "shadow.toml",
        "[upstream]\nurl = \"http://127.0.0.1:1\"\n\
         [[route]]\nname = \"one\"\npath = \"/v1/orders/special\"\n\
         [[route]]\nname = \"tenant\"\npath = \"/v1/{*rest}\"\nhost = \"a.example\"\n\
         [[route]]\nname = \"one-segment\"\npath = \"/v1/{id}\"\n\
         [[route]]\nname = \"deep\"\npath = \"/v1/{*rest}\"\nhost = \"b.example\"\n\
         [[route]]\nname = \"all\"\npath = \"/v1/{*rest}\"\n\
         [[route]]\nname = \"put\"\npath = \"/v1/orders/{id}\"\nmethods = [\"PUT\"]\n\
         [[route]]\nname = \"orders\"\npath = \"/v1/orders/{id}\"\n",
    );
    let warning = the_one_warning_of_check(&path);
    assert!(
        warning.contains("route[6] orders: never reached: route[4] all, listed before it"),
        "{warning}"
    );
}

/// A port another process holds is named by the field that asked for it.
#[test]
fn a_port_in_use_is_named_by_its_field() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    for (field, server) in [
        ("server.listen", format!("listen = \"{addr}\"\nadmin_listen = \"\"")),
        (
            "server.admin_listen",
            format!("listen = \"127.0.0.1:0\"\nadmin_listen = \"{addr}\""),
        ),
    ] {
        let path = temp_file(
            "taken.toml",
            &format!("[server]\n{server}\n[upstream]\nurl = \"http://127.0.0.1:1\"\n[store]\nbackend = \"memory\"\n"),
        );
        let output = idemgate(&["--config", path.to_str().unwrap()]);
        assert_eq!(output.status.code(), Some(1), "{field}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(&format!("taken.toml: {field}: cannot listen on {addr}")),
            "{stderr}"
        );
    }
}

#[test]
fn a_bad_config_exits_non_zero_before_binding_any_port() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let path = temp_file(
        "bad.toml",
        &format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\n[upstream]\nurl = \"http://127.0.0.1:1\"\n[defaults]\nttl = \"never\"\n"
        ),
    );
    for args in [
        vec!["--config", path.to_str().unwrap()],
        vec!["serve", "--config", path.to_str().unwrap()],
        vec!["check", "--config", path.to_str().unwrap()],
    ] {
        let output = idemgate(&args);
        assert_eq!(output.status.code(), Some(1), "{args:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("bad.toml") && stderr.contains("defaults.ttl"),
            "{stderr}"
        );
    }
    // Nothing was bound: the port is still free.
    std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let missing = idemgate(&["check", "--config", "/nonexistent/idemgate.toml"]);
    assert_eq!(missing.status.code(), Some(1));
    let said = String::from_utf8_lossy(&missing.stderr);
    assert!(said.contains("/nonexistent/idemgate.toml"), "{said}");
    assert_eq!(said.matches("No such file").count(), 1, "the cause once: {said}");
    // A byte that is not UTF-8 (a Latin-1 comment): where it is.
    let latin1 = temp_file("latin1.toml", "[upstream]\nurl = \"http://127.0.0.1:1\"\n# caf\u{1}\n");
    let mut bytes = std::fs::read(latin1.to_str().unwrap()).unwrap();
    *bytes.iter_mut().find(|b| **b == 1).unwrap() = 0xe9;
    std::fs::write(latin1.to_str().unwrap(), bytes).unwrap();
    let output = idemgate(&["check", "--config", latin1.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1));
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(
        said.contains("latin1.toml: line 3, column 6: the file is not UTF-8"),
        "{said}"
    );
}

#[test]
fn check_reads_the_certificate_files_as_serve_does() {
    let path = temp_file(
        "tls.toml",
        "[server]\nlisten = \"127.0.0.1:0\"\ntls = { cert = \"/nonexistent/cert.pem\", key = \"/nonexistent/key.pem\" }\n\
         [upstream]\nurl = \"http://127.0.0.1:1\"\n",
    );
    for command in ["check", "serve"] {
        let output = idemgate(&[command, "--config", path.to_str().unwrap()]);
        assert_eq!(output.status.code(), Some(1), "{command}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("tls.toml") && stderr.contains("/nonexistent/cert.pem"),
            "{command}: {stderr}"
        );
    }
}

/// A store file that cannot be opened stops `serve` with the file and the
/// field named, before it binds its ports (here one already taken).
#[test]
fn a_store_that_cannot_open_is_named_before_any_port_is_bound() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    // A file that is not a store's.
    let file = temp_file("not-a-store.redb", &"not a redb file\n".repeat(100));
    let path = temp_file(
        "store.toml",
        &format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nadmin_listen = \"\"\n[upstream]\nurl = \"http://127.0.0.1:1\"\n\
             [store]\nbackend = \"embedded\"\npath = \"{}\"\n",
            file.display()
        ),
    );
    let output = idemgate(&["serve", "--config", path.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("store.toml: store.path") && stderr.contains(&file.display().to_string()),
        "{stderr}"
    );
    assert!(!stderr.contains("cannot listen"), "{stderr}");
}

#[test]
fn help_and_version() {
    let help = idemgate(&["--help"]);
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(text.contains("check") && text.contains("--config"), "{text}");
    let version = idemgate(&["--version"]);
    assert!(version.status.success());
    assert!(String::from_utf8_lossy(&version.stdout).contains(env!("CARGO_PKG_VERSION")));
}

/// An integer past 64 bits fails TOML's own parse, before any field is
/// read: its error still names the field, from its line.
#[test]
fn an_integer_too_large_for_toml_is_named_by_its_field() {
    let base = "[upstream]\nurl = \"http://h:1\"\n";
    for (toml, field) in [
        (
            "[store]\nbackend = \"redis\"\nwait_for_replicas = 99999999999999999999",
            "store.wait_for_replicas",
        ),
        ("[server]\nworkers = 99999999999999999999", "server.workers"),
        (
            "[[route]]\nname = \"a\"\npath = \"/a\"\n[[route]]\nname = \"b\"\npath = \"/b\"\n[route.key]\n\
             max_length = 99999999999999999999",
            "route[1].key.max_length",
        ),
    ] {
        let error = Config::parse(&format!("{base}{toml}\n"), "x.toml")
            .unwrap_err()
            .to_string();
        assert!(error.contains(&format!(": {field}: ")), "{toml}: {error}");
    }
}

#[test]
fn redis_fields_without_the_redis_backend_are_an_error() {
    let base = "[upstream]\nurl = \"http://h:1\"\n[store]\n";
    for (store, field) in [
        // Without `backend = "redis"`, each replica would run on a store of its own.
        ("url = \"redis://127.0.0.1:6379/0\"", "store.url"),
        ("urls = [\"redis://127.0.0.1:7000\"]", "store.urls"),
        ("backend = \"memory\"\nurl = \"redis://127.0.0.1:6379/0\"", "store.url"),
        ("key_prefix = \"orders\"", "store.key_prefix"),
        ("backend = \"memory\"\nwait_for_replicas = 1", "store.wait_for_replicas"),
    ] {
        let error = Config::parse(&format!("{base}{store}\n"), "x.toml")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains(field) && error.contains("set backend = \"redis\""),
            "{store}: {error}"
        );
    }
    // The other backends' fields may stay, as in SPEC's sample.
    Config::parse(
        &format!("{base}backend = \"embedded\"\nmax_memory = \"64MiB\"\n"),
        "x.toml",
    )
    .unwrap();
    Config::parse(&format!("{base}backend = \"memory\"\npath = \"x.redb\"\n"), "x.toml").unwrap();
}

#[test]
fn config_errors_never_repeat_a_secret() {
    for text in [
        "[upstream]\nurl = \"http://h:1\"\n[store]\nbackend = \"redis\"\nurls = \"redis://:hunter2@r:6379\"\n",
        "[upstream]\nurl = \"http://h:1\"\n[server]\nadmin_token = 8675309\n",
        "[upstream]\nurl = \"http://app:hunter2@127.0.0.1:3000\"\n",
        // A token in a path or query.
        "[upstream]\nurl = \"http://127.0.0.1:3000/hunter2?tok=hunter2\"\n",
        "[upstream]\nurl = \"http://127.0.0.1:3000?tok=hunter2\"\n",
        "[upstream]\nurl = \"http://127.0.0.1:80800/hunter2\"\n",
        "[upstream]\nurl = \"ftp://127.0.0.1:3000/hunter2\"\n",
        "[upstream]\nurl = \"http:///hunter2\"\n",
        "[upstream]\nurl = \"127.0.0.1:3000/hunter2\"\n",
        "[upstream]\nurl = \"http:/h/hunter2\"\n",
    ] {
        let error = Config::parse(text, "x.toml").unwrap_err().to_string();
        assert!(!error.contains("hunter2") && !error.contains("8675309"), "{error}");
        assert!(
            error.contains("invalid type") || error.contains("upstream.url"),
            "{error}"
        );
    }
    // The path left out of the message is said to be there.
    let error = Config::parse("[upstream]\nurl = \"http://127.0.0.1:3000/prefix\"\n", "x.toml")
        .unwrap_err()
        .to_string();
    assert!(error.contains("is followed by a path or query"), "{error}");
}

#[test]
fn a_route_name_with_a_control_character_is_refused() {
    let error = Config::parse(
        "[upstream]\nurl = \"http://h:1\"\n[[route]]\nname = \"a\\nb\"\npath = \"/a\"\n",
        "x.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("route[0].name") && error.contains("control"), "{error}");
}

#[test]
fn a_bad_size_says_what_a_size_is() {
    for value in ["-1", "1.5", "true"] {
        let text = format!("[upstream]\nurl = \"http://h:1\"\n[server]\nmax_request_body = {value}\n");
        let error = Config::parse(&text, "x.toml").unwrap_err().to_string();
        assert!(error.contains("expected a size"), "{value}: {error}");
        assert!(!error.contains("untagged"), "{error}");
    }
}
