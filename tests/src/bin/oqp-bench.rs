//! `oqp-bench`: the benchmark (see `oqp_tests::bench`), and the helper
//! processes it starts from its own binary: the minimal proxy
//! (`oqp-bench minimal-proxy`), when asked oqp in single-box mode from the
//! same libraries as `oqp-controlplane --with-dataplane`
//! (`oqp-bench single-box`), and a data plane on a port of its own choosing
//! (`oqp-bench dataplane`, for the forwarded scenario and the multi-node
//! tests' [`Cluster`](oqp_tests::cluster::Cluster)).
//!
//! Run under `cargo run`, it first builds the programs it measures
//! (`oqp-controlplane`, `fake-ollama`) in its own profile, so that a stale
//! binary is never measured.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use oqp_controlplane::config::Env;
use oqp_controlplane::{ControlPlane, Options};
use oqp_dataplane::control::ControlOptions;
use oqp_dataplane::{DataPlane, Options as DataPlaneOptions};
use oqp_tests::bench::minimal::MinimalProxy;
use oqp_tests::bench::upstream::FastUpstream;
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
    /// The fast upstream: an Ollama answering at once with canned bodies
    /// (`bench::upstream`); prints its address on the first line.
    FastUpstream {
        /// Where to listen.
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
    },
    /// oqp in single-box mode (control plane + in-process data plane), both on
    /// `127.0.0.1:0`; prints the data plane's and the control plane's addresses on the first
    /// line once it serves (the config's listen addresses are not used).
    SingleBox {
        /// The config file.
        #[arg(long)]
        config: PathBuf,
    },
    /// TLS on the proxy port against plain: the handshake per new connection and the p50
    /// added per kept-alive request (`bench::tls`), as a Markdown table.
    Tls {
        /// New connections timed on each port.
        #[arg(long, default_value_t = 500)]
        connections: usize,
        /// Kept-alive requests timed on each port.
        #[arg(long, default_value_t = 5000)]
        requests: usize,
    },
    /// One data plane following a control plane, on `127.0.0.1:0`; prints
    /// its address on the first line once it serves.
    Dataplane {
        /// The control plane's gRPC URL.
        #[arg(long)]
        control_plane: String,
        /// This node's name.
        #[arg(long)]
        node: String,
        /// A file holding the node token.
        #[arg(long)]
        node_token_file: Option<PathBuf>,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::MinimalProxy { upstream, listen }) => minimal_proxy(&upstream, listen).await,
        Some(Command::FastUpstream { listen }) => fast_upstream(listen).await,
        Some(Command::SingleBox { config }) => single_box(config).await,
        Some(Command::Tls {
            connections,
            requests,
        }) => oqp_tests::bench::tls::measure(connections, requests)
            .await
            .map(|figures| print!("{}", figures.rows())),
        Some(Command::Dataplane {
            control_plane,
            node,
            node_token_file,
        }) => dataplane(control_plane, node, node_token_file).await,
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
    // The scenarios that run oqp in this process log as `OQP_LOG` says, to stderr.
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("OQP_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    }
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

async fn fast_upstream(listen: SocketAddr) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let upstream = FastUpstream::spawn(listener)?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", upstream.addr())?;
    stdout.flush()?;
    drop(stdout);
    until_signalled().await?;
    drop(upstream);
    Ok(())
}

async fn single_box(config: PathBuf) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("OQP_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Stdout carries the address line only: logs go to stderr.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let loopback = || async {
        tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("cannot listen on 127.0.0.1:0")
    };
    let control_plane = ControlPlane::start(Options {
        config_path: config,
        env: Env::from_process(),
        listener: Some(loopback().await?),
        with_dataplane: true,
        dataplane_listener: Some(loopback().await?),
        clock: None,
    })
    .await?;
    let data = control_plane
        .dataplane()
        .context("single-box mode has a data plane")?
        .local_addr();
    {
        use std::io::Write;
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "{data} {}", control_plane.local_addr())?;
        stdout.flush()?;
    }
    until_signalled().await?;
    control_plane.shutdown().await;
    Ok(())
}

async fn dataplane(
    control_plane: String,
    node: String,
    node_token_file: Option<PathBuf>,
) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("OQP_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Stdout carries the address line only: logs go to stderr (the harness keeps them).
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let token = match &node_token_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("cannot read node token file {}", path.display()))?
                .trim_end()
                .to_owned(),
        ),
        None => None,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("cannot listen on 127.0.0.1:0")?;
    let data_plane = DataPlane::start(DataPlaneOptions {
        control: ControlOptions {
            url: control_plane,
            node,
            token,
            ca_file: None,
        },
        listener: Some(listener),
        // Peers learn this node's load (and a restarted node's new port)
        // from its reports: often, so that tests wait little.
        report_interval: Duration::from_millis(200),
        log_level: None,
    })
    .await?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", data_plane.local_addr())?;
    stdout.flush()?;
    drop(stdout);
    until_signalled().await?;
    data_plane.shutdown().await;
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
