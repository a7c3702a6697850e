//! The `idemgate` command: parse arguments, load the configuration, start
//! telemetry and run.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use idemgate::config::Config;
use idemgate::server::Server;

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
        #[arg(long)]
        scope: Vec<String>,
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
            purge,
        }) => record(&config, &route, &key, &scope, purge),
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
    print!("{}", idemgate::config::describe(&config));
    println!("{}: ok", path.display());
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
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (status, body) = runtime
        .block_on(idemgate::server::admin::call(
            addr,
            method,
            path_and_query,
            token.as_deref(),
        ))
        .with_context(|| format!("cannot reach the admin listener at {addr}"))?;
    print!("{body}");
    anyhow::ensure!(status.is_success(), "{status}");
    Ok(())
}

fn record(path: &Path, route: &str, key: &str, scope: &[String], purge: bool) -> anyhow::Result<()> {
    let mut query = form_urlencoded::Serializer::new(String::new());
    query.append_pair("route", route).append_pair("key", key);
    for value in scope {
        query.append_pair("scope", value);
    }
    let method = if purge { http::Method::DELETE } else { http::Method::GET };
    admin(path, method, &format!("/records?{}", query.finish()))
}

fn health(path: &Path) -> anyhow::Result<()> {
    admin(path, http::Method::GET, "/healthz")
}

fn serve(path: &Path) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    idemgate::telemetry::init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let server = Server::bind(config).await?;
        reload_on_sighup(path.to_path_buf(), server.reloader())?;
        server.run(shutdown_signal()).await;
        Ok(())
    })
}

/// SIGHUP re-reads the file; an invalid one is logged and the running
/// configuration kept.
fn reload_on_sighup(path: PathBuf, reloader: idemgate::server::Reloader) -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hangups = signal(SignalKind::hangup()).context("cannot handle SIGHUP")?;
        tokio::spawn(async move {
            while hangups.recv().await.is_some() {
                match Config::load(&path) {
                    Ok(config) => {
                        if let Err(error) = reloader.apply(config) {
                            tracing::error!("reload refused, the running configuration stays: {error}");
                        }
                    }
                    Err(error) => tracing::error!("reload refused, the running configuration stays: {error}"),
                }
            }
        });
    }
    #[cfg(not(unix))]
    let _ = (path, reloader);
    Ok(())
}

/// Resolves on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
