//! `oqpctl`: operate an oqp installation from the terminal, over the control
//! plane's admin gRPC API.
//!
//! Exit codes: 0 done, 1 refused by the control plane (permission, unknown
//! client, invalid request), 2 usage error or control plane unreachable.

mod client;
mod render;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use oqp_proto::admin::v1 as api;
use oqp_proto::policy::v1 as wire;
use render::{Output, Style};

const EXAMPLES: &str = "\
Examples:
  oqpctl status
  oqpctl status --output json
  oqpctl config check /etc/oqp/config.yml
  oqpctl queue pause --tier low
  oqpctl queue drain --timeout 2m
  oqpctl hosts
  oqpctl clients
  oqpctl keys list
  OQPCTL_KEY=sk-admin oqpctl --control-plane https://cp.lan:50051 --ca ca.pem status";

/// Operate oqp, the admission-control proxy for Ollama.
#[derive(Debug, Parser)]
#[command(name = "oqpctl", version, about, after_help = EXAMPLES)]
struct Cli {
    /// The control plane's gRPC URL.
    #[arg(
        long,
        global = true,
        env = "OQP_CONTROL_PLANE",
        default_value = "http://127.0.0.1:50051"
    )]
    control_plane: String,
    /// A file holding your oqp key (default: env OQPCTL_KEY).
    #[arg(long, global = true)]
    key_file: Option<PathBuf>,
    /// A CA certificate (PEM) for an https control plane.
    #[arg(long, global = true)]
    ca: Option<PathBuf>,
    /// Output format.
    #[arg(long, short, global = true, value_enum, default_value = "table")]
    output: Output,
    /// Plain ASCII tables, no colour.
    #[arg(long, global = true, env = "NO_COLOR", value_parser = clap::builder::FalseyValueParser::new())]
    no_color: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The control plane and every data plane: versions, sync, activity.
    Status,
    /// Offline checks of a config file.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Queue control: pause, resume, flush, drain.
    #[command(subcommand)]
    Queue(QueueCommand),
    /// Upstream hosts: health, slots, models.
    Hosts,
    /// Clients: ceilings, waiting, in flight, share.
    Clients,
    /// Consumer keys.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Prints a shell completion script.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Validates a config file with the control plane's own loader.
    Check {
        /// The file.
        path: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum QueueCommand {
    /// Stops a tier (default: all) from accepting new requests.
    Pause(TierArg),
    /// Lets a paused tier (default: all) accept requests again.
    Resume(TierArg),
    /// Drops every waiting request of a tier (default: all).
    Flush(TierArg),
    /// Waits until every data plane's queues are empty, showing progress.
    Drain {
        /// Give up after this long (e.g. 90s, 5m).
        #[arg(long, value_parser = humantime::parse_duration, default_value = "5m")]
        timeout: std::time::Duration,
    },
}

#[derive(Debug, clap::Args)]
struct TierArg {
    /// high, normal or low; omitted = all tiers.
    #[arg(long, value_parser = ["high", "normal", "low"])]
    tier: Option<String>,
}

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// Every key (never a key's value).
    List,
}

/// A failure with its exit code.
struct Failure {
    code: u8,
    message: String,
}

impl From<tonic::Status> for Failure {
    fn from(status: tonic::Status) -> Self {
        let code = match status.code() {
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown => 2,
            _ => 1,
        };
        Failure {
            code,
            message: status.message().to_owned(),
        }
    }
}

impl From<anyhow::Error> for Failure {
    fn from(error: anyhow::Error) -> Self {
        Failure {
            code: 2,
            message: format!("{error:#}"),
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("oqpctl: {}", failure.message);
            ExitCode::from(failure.code)
        }
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let style = Style {
        color: !cli.no_color,
    };
    let output = cli.output;
    match cli.command {
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "oqpctl", &mut std::io::stdout());
            return Ok(());
        }
        Command::Config(ConfigCommand::Check { path }) => return check_config(&path, output),
        _ => {}
    }
    let key = client::load_key(cli.key_file.as_ref())?;
    let mut admin = client::connect(&cli.control_plane, key, cli.ca.as_ref()).await?;
    match cli.command {
        Command::Status => {
            let response = admin
                .get_status(api::GetStatusRequest {})
                .await?
                .into_inner();
            println!("{}", render::status(&response, output, style));
        }
        Command::Hosts => {
            let response = admin
                .list_hosts(api::ListHostsRequest {})
                .await?
                .into_inner();
            println!("{}", render::hosts(&response, output, style));
        }
        Command::Clients => {
            let response = admin
                .list_clients(api::ListClientsRequest {})
                .await?
                .into_inner();
            println!("{}", render::clients(&response, output, style));
        }
        Command::Keys(KeysCommand::List) => {
            let response = admin.list_keys(api::ListKeysRequest {}).await?.into_inner();
            println!("{}", render::keys(&response, output, style));
        }
        Command::Queue(command) => queue(&mut admin, command, output).await?,
        Command::Config(_) | Command::Completions { .. } => {}
    }
    Ok(())
}

async fn queue(
    admin: &mut client::Admin,
    command: QueueCommand,
    output: Output,
) -> Result<(), Failure> {
    let tier = |arg: &TierArg| api::TierRequest {
        tier: match arg.tier.as_deref() {
            Some("high") => wire::Tier::High,
            Some("normal") => wire::Tier::Normal,
            Some("low") => wire::Tier::Low,
            _ => wire::Tier::Unspecified,
        } as i32,
    };
    let response = match &command {
        QueueCommand::Pause(arg) => admin.pause_tier(tier(arg)).await?,
        QueueCommand::Resume(arg) => admin.resume_tier(tier(arg)).await?,
        QueueCommand::Flush(arg) => admin.flush_tier(tier(arg)).await?,
        QueueCommand::Drain { timeout } => {
            let request = api::DrainRequest {
                timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            };
            let mut stream = admin.drain(request).await?.into_inner();
            let mut last = None;
            while let Some(progress) = stream.message().await? {
                println!("{}", render::drain_progress(&progress, output));
                last = Some(progress);
            }
            return match last {
                Some(progress) if progress.drained => Ok(()),
                _ => Err(Failure {
                    code: 1,
                    message: "the queues did not drain before the timeout".to_owned(),
                }),
            };
        }
    };
    println!("{}", render::tier_change(&response.into_inner(), output));
    Ok(())
}

fn check_config(path: &std::path::Path, output: Output) -> Result<(), Failure> {
    let env = oqp_controlplane::config::Env::from_process();
    match oqp_controlplane::config::load_file(path, &env) {
        Ok(loaded) => {
            match output {
                Output::Json => println!(
                    "{}",
                    serde_json::json!({"valid": true, "warnings": loaded.warnings})
                ),
                Output::Table => {
                    for warning in &loaded.warnings {
                        eprintln!("warning: {warning}");
                    }
                    println!("{}: valid", path.display());
                }
            }
            Ok(())
        }
        Err(error) => {
            if output == Output::Json {
                println!(
                    "{}",
                    serde_json::json!({"valid": false, "errors": error.problems(), "warnings": error.warnings()})
                );
            } else {
                for warning in error.warnings() {
                    eprintln!("warning: {warning}");
                }
            }
            Err(Failure {
                code: 2,
                message: format!("{} is invalid:\n{error}", path.display()),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cli_is_well_formed() {
        Cli::command().debug_assert();
    }
}
