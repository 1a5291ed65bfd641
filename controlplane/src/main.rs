//! `oqp-controlplane`: owns the config, serves the policy stream to data
//! planes and the admin API to oqpctl. `--with-dataplane` also runs a data
//! plane in the same process: the single-box quick start.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use oqp_controlplane::config::Env;
use oqp_controlplane::{ControlPlane, Options};

/// jemalloc rather than the system's allocator: with glibc's, whose chunk headers lie
/// between allocations, the pages of hyper's 8 KiB connection buffers are made resident
/// though mostly never written, so an open connection or a queued request costs more.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Admission-control proxy for Ollama: the control plane.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The config file (YAML).
    #[arg(long, env = "OQP_CONFIG", default_value = "config.yml")]
    config: PathBuf,
    /// Also run a data plane in this process (node `local`).
    #[arg(long)]
    with_dataplane: bool,
    /// Log format: text or json (default: the config's `logging.format`).
    #[arg(long, env = "OQP_LOG_FORMAT")]
    log_format: Option<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let env = Env::from_process();
    // The config names the log level and format; read it once up front so
    // that start-up itself is logged the way the operator asked. Errors are
    // reported by `start` below.
    let logging = oqp_controlplane::config::load_file(&args.config, &env)
        .ok()
        .map(|loaded| loaded.config.logging);
    let level = logging.as_ref().map_or("info", |l| l.level.as_str());
    let format = args.log_format.clone().unwrap_or_else(|| {
        logging
            .as_ref()
            .map_or("text", |l| l.format.as_str())
            .to_owned()
    });
    let set_level = init_tracing(level, &format);
    let options = Options {
        config_path: args.config,
        env,
        listener: None,
        with_dataplane: args.with_dataplane,
        dataplane_listener: None,
        clock: None,
    };
    let control_plane = match ControlPlane::start(options).await {
        Ok(control_plane) => control_plane,
        Err(error) => {
            eprintln!("oqp-controlplane: {error}");
            return ExitCode::from(u8::try_from(error.exit_code()).unwrap_or(1));
        }
    };
    run_until_signalled(&control_plane, set_level.as_ref()).await;
    tracing::info!("shutting down");
    control_plane.shutdown().await;
    ExitCode::SUCCESS
}

/// Reloads on SIGHUP (the log level too); returns on SIGTERM or Ctrl-C.
async fn run_until_signalled(control_plane: &ControlPlane, set_level: Option<&SetLevel>) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut hangup), Ok(mut terminate)) = (
        signal(SignalKind::hangup()),
        signal(SignalKind::terminate()),
    ) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    loop {
        tokio::select! {
            _ = hangup.recv() => {
                // Errors are logged by reload; the old snapshot stays. The
                // file is read and parsed here, so the worker steps aside
                // (multi-threaded runtime: `#[tokio::main]`).
                if tokio::task::block_in_place(|| control_plane.reload()).is_ok()
                    && let Some(set_level) = set_level
                {
                    set_level(control_plane.hub().config().logging.level.as_str());
                }
            }
            _ = terminate.recv() => return,
            _ = tokio::signal::ctrl_c() => return,
        }
    }
}

/// Sets the log filter to a level name.
type SetLevel = Box<dyn Fn(&str)>;

/// The filter for `logging.level` (a level name): oqp's crates at the level,
/// dependencies (hyper, h2, tonic) no more verbose than `warn`, as the data
/// plane's binary does it.
fn level_filter(level: &str) -> String {
    let dependencies = if level == "error" { "error" } else { "warn" };
    format!("{dependencies},oqp_dataplane={level},oqp_controlplane={level}")
}

/// Installs the log subscriber. `OQP_LOG` fixes the filter; without it the
/// filter is `level` and the returned function changes it on reload.
fn init_tracing(level: &str, format: &str) -> Option<SetLevel> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{EnvFilter, fmt, reload};

    let fixed = EnvFilter::try_from_env("OQP_LOG").ok();
    let following = fixed.is_none();
    let (filter, handle) =
        reload::Layer::new(fixed.unwrap_or_else(|| EnvFilter::new(level_filter(level))));
    let registry = tracing_subscriber::registry().with(filter);
    if format == "json" {
        registry.with(fmt::layer().json()).init();
    } else {
        let ansi = oqp_dataplane::stdout_log_colour();
        registry.with(fmt::layer().with_ansi(ansi)).init();
    }
    following.then(|| -> SetLevel {
        Box::new(move |level| {
            let _ = handle.reload(EnvFilter::new(level_filter(level)));
        })
    })
}
