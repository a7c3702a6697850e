//! The `idemgate` command: parse arguments, load the configuration, start
//! telemetry and run.

// jemalloc: on the memory store, ~9% less user CPU per request than
// glibc's allocator here (its size-class caches suit the many short-lived
// allocations of a request), for ~3% more throughput. Its background
// thread gives freed pages back ([`return_freed_memory_in_background`]).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use std::sync::Arc;

use idemgate::config::Config;
use idemgate::server::{self, Reloader, Server};
use idemgate::store::StoreHandle;
use idemgate::telemetry::Metrics;

/// An idempotency gateway: a reverse proxy that makes POSTs safe to retry.
#[derive(Parser)]
#[command(version, about, args_conflicts_with_subcommands = true)]
struct Cli {
    /// The configuration file (TOML); same as `serve --config FILE`.
    #[arg(long, short, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy.
    Serve {
        #[arg(long, short, value_name = "FILE")]
        config: PathBuf,
    },
    /// Validate the configuration and print the effective routes.
    Check {
        #[arg(long, short, value_name = "FILE")]
        config: PathBuf,
    },
    /// Look up (or purge) one record through the running proxy's admin listener.
    Record {
        #[arg(long, short, value_name = "FILE")]
        config: PathBuf,
        /// The route's name.
        #[arg(long)]
        route: String,
        /// The idempotency key, as the client sent it (or the derived hex key).
        #[arg(long)]
        key: String,
        /// The value of each of the route's scope headers, in order.
        #[arg(long, conflicts_with = "scope_header")]
        scope: Vec<String>,
        /// A line of a scope header, by name (repeat it for each line and
        /// each header; a scope header not named was absent).
        #[arg(long, value_name = "NAME=VALUE")]
        scope_header: Vec<String>,
        /// Remove the record (a stuck claim, a poisoned answer).
        #[arg(long)]
        purge: bool,
    },
    /// Exit 0 if the running proxy's admin listener answers /healthz.
    Health {
        #[arg(long, short, value_name = "FILE")]
        config: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Check { config }) => check(&config),
        Some(Command::Serve { config }) => serve(&config),
        Some(Command::Record {
            config,
            route,
            key,
            scope,
            scope_header,
            purge,
        }) => record(&config, &route, &key, &scope, &scope_header, purge),
        Some(Command::Health { config }) => health(&config),
        None => match cli.config {
            Some(config) => serve(&config),
            None => Err(anyhow::anyhow!("missing --config FILE (see --help)")),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("idemgate: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn check(path: &Path) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    // What `serve` checks before it binds: the certificate, key and CA files.
    server::check(&config).with_context(|| path.display().to_string())?;
    let mut text = idemgate::config::describe(&config);
    for warning in idemgate::config::warnings(&config) {
        text.push_str(&format!("warning: {warning}\n"));
    }
    text.push_str(&format!("{}: ok\n", path.display()));
    // Not print!, which panics when the reader has gone (`check | head`).
    let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
    Ok(())
}

/// Calls the admin listener `config` names; prints the answer.
fn admin(path: &Path, method: http::Method, path_and_query: &str) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    let addr = config
        .server
        .admin_listen
        .context("server.admin_listen is disabled in this configuration")?;
    let token = config.server.admin_token.clone();
    // The longest a listener that works takes: a head read, a store call.
    // One that accepts and never answers (a wedged or stopped process, whose
    // kernel still completes the handshake) fails the call, not hangs it.
    let bound = config.server.header_read_timeout + config.store.timeout;
    http::Uri::try_from(format!("http://{addr}{path_and_query}"))
        .context("the key and scope values are too long for a request (no record has them)")?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let call = idemgate::server::admin::call(addr, method, path_and_query, token.as_deref());
    let (status, body) = runtime
        .block_on(async { tokio::time::timeout(bound, call).await })
        .map_err(|_| anyhow::anyhow!("no answer within {}", humantime::format_duration(bound)))
        .and_then(|answer| answer.map_err(|error| anyhow::anyhow!(error)))
        .with_context(|| format!("cannot reach the admin listener at {addr}"))?;
    // Not print!, which panics when the reader has gone.
    let _ = std::io::Write::write_all(&mut std::io::stdout(), body.as_bytes());
    anyhow::ensure!(status.is_success(), "{status}");
    Ok(())
}

fn record(
    path: &Path,
    route: &str,
    key: &str,
    scope: &[String],
    scope_headers: &[String],
    purge: bool,
) -> anyhow::Result<()> {
    let mut query = form_urlencoded::Serializer::new(String::new());
    query.append_pair("route", route).append_pair("key", key);
    for value in scope {
        query.append_pair("scope", value);
    }
    for line in scope_headers {
        let (name, value) = line
            .split_once('=')
            .with_context(|| format!("--scope-header {line}: give NAME=VALUE"))?;
        query.append_pair(&format!("scope.{name}"), value);
    }
    let method = if purge { http::Method::DELETE } else { http::Method::GET };
    admin(path, method, &format!("/records?{}", query.finish()))
}

fn health(path: &Path) -> anyhow::Result<()> {
    admin(path, http::Method::GET, "/healthz")
}

/// Raises the soft limit on open files to the hard one, as Go's runtime
/// does and nginx's `worker_rlimit_nofile` lets operators: each request
/// in flight holds a client and an upstream socket, and a soft limit of
/// 1024, a common default, would stop accepting at a few hundred clients.
/// The hard limit is the operator's (`ulimit -Hn`, systemd's
/// `LimitNOFILE`); a failure leaves the soft one as it was.
#[cfg(target_os = "linux")]
fn raise_open_files_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if let (Some(soft), Some(hard)) = (limit.current, limit.maximum)
        && soft < hard
    {
        let raised = rustix::process::Rlimit {
            current: Some(hard),
            maximum: Some(hard),
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => tracing::debug!(from = soft, to = hard, "open files limit raised"),
            Err(error) => tracing::warn!(%error, limit = soft, "cannot raise the open files limit"),
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn raise_open_files_limit() {}

/// jemalloc hands the pages of freed memory back to the system ten
/// seconds after they are freed, but only when an allocation in the same
/// arena comes to check: a proxy gone idle after a burst of large answers
/// (the buffers they passed through, and records since evicted) kept tens
/// of MiB beyond what its store holds, for good. Its background thread
/// does that work on a timer instead, busy or idle, and off the workers'
/// path: no cost per request could be measured.
fn return_freed_memory_in_background() {
    let enabled = tikv_jemalloc_ctl::max_background_threads::write(1)
        .and_then(|()| tikv_jemalloc_ctl::background_thread::write(true));
    if let Err(error) = enabled {
        tracing::warn!(%error, "the allocator's background thread could not start: freed memory goes back to the system only as requests come");
    }
}

/// Runs `server.workers` accept loops, each a single-threaded runtime on a
/// thread of its own with its own socket on the shared port (SO_REUSEPORT),
/// like nginx's workers: a request never crosses threads on its way through.
/// The store, the metrics and the store's background tasks are shared; the
/// main thread handles signals.
fn serve(path: &Path) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    idemgate::telemetry::init();
    server::check(&config).with_context(|| path.display().to_string())?;
    for warning in idemgate::config::warnings(&config) {
        tracing::warn!("{warning}");
    }
    raise_open_files_limit();
    return_freed_memory_in_background();
    let workers = config.server.workers;
    // Runs the store's background tasks (expiry sweeps, Redis subscriptions)
    // and the signal handling. Thread names fit the 15 bytes Linux keeps
    // (what `top -H`, `ps -L` and perf show): "idemgate-worker-0" would be cut
    // to "idemgate-worker", the same for every worker.
    let background = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("background")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let (hangups, signals, store) = {
        let _entered = background.enter();
        // SIGHUP is taken from here on: one that comes while the store
        // opens (replaying its log can take a while) or the workers start
        // is applied once they run, instead of ending the process, which
        // is what SIGHUP does by default.
        let hangups = hangups()?;
        // A write past RLIMIT_FSIZE then fails (EFBIG), as a full disk's
        // does, and the embedded store says so and stops taking claims,
        // instead of SIGXFSZ ending the process without a word (and every
        // restart under the same limit again).
        // (Once handled, always: the handle itself may go.)
        #[cfg(target_os = "linux")]
        let _ = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::from_raw(
            rustix::process::Signal::XFSZ.as_raw(),
        ))
        .context("cannot handle SIGXFSZ")?;
        // The store before the ports: one that cannot open (a file another
        // idemgate holds, a directory it may not write) is named in the
        // error before anything listens.
        let store = StoreHandle::open(&config.store).with_context(|| path.display().to_string())?;
        // SIGTERM and SIGINT from here on: one that comes while the workers
        // start begins the drain as soon as they run. Until now, with
        // nothing claimed, it simply ends the process, however long the
        // store took to open.
        (hangups, Signals::new(), store)
    };
    // Named by file and field, as a store that cannot open is.
    let field = |name: &str| format!("{}: {name}", path.display());
    let listeners = server::bind_listeners(config.server.listen, workers).with_context(|| field("server.listen"))?;
    let mut admin = match config.server.admin_listen {
        Some(addr) => Some(
            server::bind_listeners(addr, 1)
                .with_context(|| field("server.admin_listen"))?
                .remove(0),
        ),
        None => None,
    };
    // For the one line that says the proxy serves: the ports as bound
    // (`:0` is one the kernel chose).
    let listening = listeners[0].local_addr().context("the proxy listener has no address")?;
    let admin_listening = admin.as_ref().and_then(|admin| admin.local_addr().ok());
    let metrics = Arc::new(Metrics::default());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    // The admin listener, served by the first worker, closes only once the
    // other workers have drained too.
    let (others_drained, drained) = tokio::sync::watch::channel(false);
    let mut threads = Vec::with_capacity(workers);
    let mut reloaders = Vec::with_capacity(workers);
    for (index, listener) in listeners.into_iter().enumerate() {
        let (config, store, metrics, admin) = (config.clone(), store.clone(), metrics.clone(), admin.take());
        let mut stopped = stopped.clone();
        let mut drained = (index == 0).then(|| drained.clone());
        let (ready, started) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(format!("worker-{index}"))
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(runtime) => runtime,
                    Err(error) => return drop(ready.send(Err(anyhow::Error::new(error)))),
                };
                runtime.block_on(async move {
                    let server = match Server::from_listeners(config, store, metrics, listener, admin) {
                        Ok(server) => server,
                        Err(error) => return drop(ready.send(Err(error.into()))),
                    };
                    let _ = ready.send(Ok(server.reloader()));
                    let shutdown = async move {
                        let _ = stopped.wait_for(|stop| *stop).await;
                    };
                    let others_drained = async move {
                        if let Some(drained) = &mut drained {
                            let _ = drained.wait_for(|done| *done).await;
                        }
                    };
                    server.run_keeping_admin(shutdown, others_drained).await;
                });
            })
            .context("cannot start a worker thread")?;
        threads.push(thread);
        reloaders.push(started.recv().context("a worker thread died while starting")??);
    }
    tracing::info!(
        listen = %listening,
        admin = %admin_listening.map_or_else(|| "off".to_owned(), |addr| addr.to_string()),
        upstream = %config.upstream.url,
        store = %idemgate::config::store_summary(&config),
        routes = config.routes.len(),
        workers,
        "idemgate serving"
    );
    // The grace in force when the signal comes: a reload may change it.
    let current = reloaders[0].clone();
    background.block_on(async {
        reload_on_sighup(path.to_path_buf(), reloaders, hangups);
        shutdown_signal(signals).await;
        anyhow::Ok(())
    })?;
    tracing::info!(
        grace = %humantime::format_duration(current.shutdown_grace()),
        "draining connections and claimed exchanges"
    );
    let _ = stop.send(true);
    let mut threads = threads.into_iter();
    let first = threads.next();
    for thread in threads {
        let _ = thread.join();
    }
    let _ = others_drained.send(true);
    if let Some(first) = first {
        let _ = first.join();
    }
    // What claims dropped unsettled left to do: releases asked again, and
    // claims of requests a grace that ran out cut off, which their
    // workers' runtimes dropped.
    background.block_on(store.finish_kept_tasks());
    tracing::info!("stopped");
    Ok(())
}

#[cfg(unix)]
type Hangups = tokio::signal::unix::Signal;
#[cfg(not(unix))]
type Hangups = ();

/// SIGHUPs from now on, for [`reload_on_sighup`].
fn hangups() -> anyhow::Result<Hangups> {
    #[cfg(unix)]
    return tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).context("cannot handle SIGHUP");
    #[cfg(not(unix))]
    Ok(())
}

/// `text` on one line, its lines joined by a space: a log line that a
/// collector reading one entry a line (`docker logs`, a file tailer) keeps
/// whole, where a configuration error lists its problems a line each.
fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// SIGHUP re-reads the file and applies it to every worker; an invalid one
/// is logged, on one line, and the running configuration kept.
fn reload_on_sighup(path: PathBuf, reloaders: Vec<Reloader>, hangups: Hangups) {
    #[cfg(unix)]
    {
        let mut hangups = hangups;
        tokio::spawn(async move {
            while hangups.recv().await.is_some() {
                let config = match Config::load(&path) {
                    Ok(config) => config,
                    Err(error) => {
                        let error = one_line(&error.to_string());
                        tracing::error!("reload refused, the running configuration stays: {error}");
                        continue;
                    }
                };
                if let Err(error) = server::check(&config) {
                    // With its causes (a CA file that cannot be read, and
                    // why), and the file, as at start.
                    let error = one_line(&idemgate::telemetry::error_chain(&error));
                    tracing::error!(
                        "reload refused, the running configuration stays: {}: {error}",
                        path.display()
                    );
                    continue;
                }
                // Every worker takes the same configuration, or none does,
                // and one line says what was applied.
                match server::reload_all(&reloaders, config) {
                    Ok(Some(reloaded)) => reloaded.log(),
                    Ok(None) => {}
                    Err(error) => {
                        let error = one_line(&idemgate::telemetry::error_chain(&error));
                        tracing::error!(
                            "reload refused, the running configuration stays: {}: {error}",
                            path.display()
                        );
                    }
                }
            }
        });
    }
    #[cfg(not(unix))]
    let _ = (path, reloaders, hangups);
}

/// Resolves on SIGTERM or Ctrl-C. A second one, during the drain, ends the
/// process at once (exit status 1): exchanges still running keep their
/// claims until their leases end, as after a crash.
async fn shutdown_signal(mut signals: Signals) {
    signals.recv().await;
    tokio::spawn(async move {
        signals.recv().await;
        tracing::warn!("a second signal: exiting without waiting for the drain");
        std::process::exit(1);
    });
}

/// SIGTERM and Ctrl-C, taken for as long as this lives: one that comes
/// between two waits is not lost.
struct Signals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> Signals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Signals {
                term: signal(SignalKind::terminate()).expect("SIGTERM handler"),
                interrupt: signal(SignalKind::interrupt()).expect("SIGINT handler"),
            }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.interrupt.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}
