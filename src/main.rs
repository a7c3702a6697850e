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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Check { config }) => check(&config),
        Some(Command::Serve { config }) => serve(&config),
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
