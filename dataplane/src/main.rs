//! `oqp-dataplane`: runs one data plane beside a GPU box, following a
//! control plane.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use oqp_dataplane::control::ControlOptions;
use oqp_dataplane::{DataPlane, LogLevelHook, Options};

/// jemalloc rather than the system's allocator: with glibc's, whose chunk headers lie
/// between allocations, the pages of hyper's 8 KiB connection buffers are made resident
/// though mostly never written, so an open connection or a queued request costs more.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Admission-control proxy for Ollama: the data plane.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The control plane's gRPC URL.
    #[arg(
        long,
        env = "OQP_CONTROL_PLANE",
        default_value = "http://127.0.0.1:50051"
    )]
    control_plane: String,
    /// This node's name (selects `nodes.NAME` overrides in the config).
    #[arg(long, env = "OQP_NODE", default_value = "default")]
    node: String,
    /// A file holding the node token.
    #[arg(long)]
    node_token_file: Option<PathBuf>,
    /// A CA certificate (PEM) for an https control plane.
    #[arg(long)]
    ca: Option<PathBuf>,
    /// Log format: text or json.
    #[arg(long, env = "OQP_LOG_FORMAT", default_value = "text")]
    log_format: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let log_level = init_tracing(&args.log_format);
    let token = match &args.node_token_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("cannot read node token file {}", path.display()))?
                .trim_end()
                .to_owned(),
        ),
        None => std::env::var("OQP_NODE_TOKEN").ok(),
    };
    let options = Options {
        control: ControlOptions {
            url: args.control_plane,
            node: args.node,
            token,
            ca_file: args.ca,
        },
        listener: None,
        report_interval: Duration::from_secs(1),
        log_level,
    };
    let data_plane = DataPlane::start(options).await?;
    shutdown_signal().await;
    tracing::info!("shutting down");
    data_plane.shutdown().await;
    Ok(())
}

/// Installs the log subscriber. `OQP_LOG` fixes the filter; without it the
/// level starts at `info` and follows the config's `logging.level`, which
/// the returned hook applies as each snapshot arrives.
fn init_tracing(format: &str) -> Option<LogLevelHook> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{EnvFilter, fmt, reload};

    let fixed = EnvFilter::try_from_env("OQP_LOG").ok();
    let following = fixed.is_none();
    let (filter, handle) = reload::Layer::new(
        fixed.unwrap_or_else(|| EnvFilter::new(oqp_dataplane::policy::LogLevel::Info.filter())),
    );
    let registry = tracing_subscriber::registry().with(filter);
    if format == "json" {
        registry.with(fmt::layer().json()).init();
    } else {
        let ansi = oqp_dataplane::stdout_log_colour();
        registry.with(fmt::layer().with_ansi(ansi)).init();
    }
    following.then(|| {
        LogLevelHook::new(move |level| {
            if handle.reload(EnvFilter::new(level.filter())).is_ok() {
                tracing::info!(level = level.as_str(), "log level set by the config");
            }
        })
    })
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
