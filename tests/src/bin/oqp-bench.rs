//! `oqp-bench`: the benchmark (see `oqp_tests::bench`), and the two helper
//! processes it starts from its own binary: the minimal proxy
//! (`oqp-bench minimal-proxy`) and, when asked, oqp in single-box mode from
//! the same libraries as `oqp-controlplane --with-dataplane`
//! (`oqp-bench single-box`).
//!
//! Run under `cargo run`, it first builds the programs it measures
//! (`oqp-controlplane`, `fake-ollama`) in its own profile, so that a stale
//! binary is never measured.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use oqp_controlplane::config::Env;
use oqp_controlplane::{ControlPlane, Options};
use oqp_tests::bench::minimal::MinimalProxy;
use oqp_tests::bench::{self, Args};

/// Benchmarks oqp against a fake Ollama, direct and through a minimal proxy.
#[derive(Debug, Parser)]
#[command(name = "oqp-bench", version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    args: Args,
    /// Do not build oqp-controlplane and fake-ollama first.
    #[arg(long)]
    no_build: bool,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The minimal pass-through proxy; prints its address on the first line.
    MinimalProxy {
        /// The upstream, `http://host:port`.
        #[arg(long)]
        upstream: String,
        /// Where to listen.
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
    },
    /// oqp in single-box mode (control plane + in-process data plane).
    SingleBox {
        /// The config file.
        #[arg(long)]
        config: PathBuf,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::MinimalProxy { upstream, listen }) => minimal_proxy(&upstream, listen).await,
        Some(Command::SingleBox { config }) => single_box(config).await,
        None => benchmark(cli.args, cli.no_build).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("oqp-bench: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn benchmark(args: Args, no_build: bool) -> anyhow::Result<()> {
    if !no_build && args.fake_bin.is_none() && args.oqp_bin.is_none() {
        build_programs()?;
    }
    let table = bench::run(args).await?;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(table.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

/// Under `cargo run`, builds the measured programs in this binary's profile.
fn build_programs() -> anyhow::Result<()> {
    let Some(cargo) = std::env::var_os("CARGO") else {
        return Ok(());
    };
    let exe = std::env::current_exe()?;
    let release = exe
        .parent()
        .and_then(|dir| dir.file_name())
        .is_some_and(|name| name == "release");
    let mut command = std::process::Command::new(cargo);
    command.current_dir(bench::workspace()).args([
        "build",
        "-p",
        "oqp-controlplane",
        "--bin",
        "oqp-controlplane",
        "-p",
        "oqp-tests",
        "--bin",
        "fake-ollama",
    ]);
    if release {
        command.arg("--release");
    }
    let status = command.status().context("cannot run cargo build")?;
    anyhow::ensure!(status.success(), "cargo build failed");
    Ok(())
}

async fn minimal_proxy(upstream: &str, listen: SocketAddr) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let proxy = MinimalProxy::spawn(listener, upstream)?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", proxy.addr())?;
    stdout.flush()?;
    drop(stdout);
    until_signalled().await?;
    drop(proxy);
    Ok(())
}

async fn single_box(config: PathBuf) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("OQP_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let control_plane = ControlPlane::start(Options {
        config_path: config,
        env: Env::from_process(),
        listener: None,
        with_dataplane: true,
        dataplane_listener: None,
        clock: None,
    })
    .await?;
    until_signalled().await?;
    control_plane.shutdown().await;
    Ok(())
}

async fn until_signalled() -> anyhow::Result<()> {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        result = tokio::signal::ctrl_c() => result?,
        _ = terminate.recv() => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        super::Cli::command().debug_assert();
    }
}
