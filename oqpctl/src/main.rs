//! `oqpctl`: operate an oqp installation from the terminal, over the control
//! plane's admin gRPC API.
//!
//! Exit codes: 0 done, 1 refused by the control plane (permission, unknown
//! client, invalid request), 2 usage error or control plane unreachable;
//! `oqpctl health`: 0 healthy, 1 anything else (what container health checks expect).

mod audit;
mod client;
mod figures;
mod health;
mod nodes;
mod render;
mod requests;
mod usage;
mod watch;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use oqp_proto::admin::v1 as api;
use oqp_proto::policy::v1 as wire;
use render::{Output, Style, Width};

const EXAMPLES: &str = "\
Examples:
  oqpctl status
  oqpctl status --output json
  oqpctl config check /etc/oqp/config.yml
  oqpctl health http://127.0.0.1:11435/health
  oqpctl queue pause --tier low
  oqpctl queue drain --timeout 2m
  oqpctl hosts
  oqpctl clients --watch 5
  oqpctl keys list
  oqpctl keys add batch --max-priority low --scope inference --max-concurrent 1 --expires 30d
  oqpctl keys add nightly --max-priority low --scope inference --budget-gpu 2h --budget-tokens 2M --budget-window 1d
  oqpctl usage --since 7d --by client,model
  oqpctl keys rotate batch --grace 1h
  oqpctl keys revoke batch
  oqpctl audit --since 1h --action keys --follow
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
    /// Plain ASCII tables, no colour (also when output is not a terminal).
    #[arg(long, global = true, env = "NO_COLOR", value_parser = clap::builder::FalseyValueParser::new())]
    no_color: bool,
    /// Tables as wide as their content, with every column; by default they fit the terminal
    /// (`COLUMNS`, else its width, else 100 columns), wrapping inside cells.
    #[arg(long, global = true)]
    wide: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The control plane and every data plane: link, sync, owned hosts, queue.
    Status(WatchArg),
    /// Offline checks of a config file.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Queue control: pause, resume, flush, drain.
    #[command(subcommand)]
    Queue(QueueCommand),
    /// Upstream hosts: owner node, health, slots, models.
    Hosts(WatchArg),
    /// Clients: ceilings, waiting, in flight, share.
    Clients(WatchArg),
    /// Ollama Cloud accounts: plan, balance or windows, resets, reserve, refused models,
    /// cooldowns, keys (redacted).
    Cloud(WatchArg),
    /// Consumer keys.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// The data planes' own tokens: issue one per node, revoke, list.
    #[command(subcommand)]
    Nodes(nodes::NodesCommand),
    /// GPU time, tokens, requests and cache hits per client and/or model.
    Usage(usage::UsageArgs),
    /// The audit trail: who changed keys, queues and the config, and refused calls.
    Audit(audit::AuditArgs),
    /// Liveness probe: GET a proxy's /health (exit 0 on 200, else 1); `tcp://HOST:PORT` only
    /// checks that a port accepts connections. Needs no key and no control plane.
    Health {
        /// What to probe.
        #[arg(default_value = health::DEFAULT_URL)]
        url: String,
    },
    /// The request log (logging.requests), read from its files on this machine.
    Requests(requests::RequestsArgs),
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

#[derive(Debug, Clone, Copy, clap::Args)]
struct WatchArg {
    /// Redraw every SECONDS (default 2) until Ctrl-C.
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = watch::DEFAULT_SECONDS)]
    watch: Option<u64>,
}

/// A view that `--watch` can redraw.
#[derive(Debug, Clone, Copy)]
enum View {
    Status,
    Hosts,
    Clients,
    Cloud,
}

impl View {
    fn command(self) -> &'static str {
        match self {
            View::Status => "status",
            View::Hosts => "hosts",
            View::Clients => "clients",
            View::Cloud => "cloud",
        }
    }
}

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// Every key, from the config file and the key store (never a key's value).
    List,
    /// Creates a client with a new key in the store; prints the key once.
    Add(AddKey),
    /// Replaces a stored client's key; prints the new key once.
    Rotate {
        /// The client whose key is replaced.
        client_id: String,
        /// How long the old key keeps working (e.g. 10m, 24h); default: it
        /// stops at once.
        #[arg(long, value_parser = humantime::parse_duration)]
        grace: Option<std::time::Duration>,
    },
    /// Removes a stored client and its keys at once, on every data plane.
    Revoke {
        /// The client to remove.
        client_id: String,
    },
}

#[derive(Debug, clap::Args)]
struct AddKey {
    /// The new client's id (not yet in the config file or the store).
    client_id: String,
    /// Highest tier its requests may use.
    #[arg(long, value_parser = ["high", "normal", "low"])]
    max_priority: String,
    /// What the key may do.
    #[arg(long, value_parser = ["read", "inference", "management"])]
    scope: String,
    /// Most requests in flight at once on each GPU box (0 = unlimited).
    #[arg(long, default_value_t = 0)]
    max_concurrent: u32,
    /// Fair-share weight against other clients of the same tier.
    #[arg(long, default_value_t = 1.0)]
    weight: f64,
    /// Most requests waiting at once for each GPU box (0 = unlimited).
    #[arg(long, default_value_t = 0)]
    max_queued: u32,
    /// Tier for requests that name none (default: max priority, capped at normal).
    #[arg(long, value_parser = ["high", "normal", "low"])]
    default_priority: Option<String>,
    /// Free text shown in listings.
    #[arg(long, default_value = "")]
    description: String,
    /// Lifetime (e.g. 30d, 12h); default: until revoked.
    #[arg(long, value_parser = humantime::parse_duration)]
    expires: Option<std::time::Duration>,
    /// The models it may use, comma-separated globs (e.g. 'llama3.2*,qwen3:*'); default: every
    /// model.
    #[arg(long, value_delimiter = ',')]
    models: Vec<String>,
    #[command(flatten)]
    budget: usage::BudgetArgs,
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
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let style = Style {
        color: !cli.no_color && terminal,
        width: Width::choose(cli.wide, std::env::var("COLUMNS").ok().as_deref(), terminal),
    };
    let output = cli.output;
    match cli.command {
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "oqpctl", &mut std::io::stdout());
            return Ok(());
        }
        Command::Config(ConfigCommand::Check { path }) => return check_config(&path, output),
        Command::Health { url } => {
            let healthy = health::probe(&url).await.map_err(|error| Failure {
                code: 1,
                message: format!("{error:#}"),
            })?;
            println!("{healthy}");
            return Ok(());
        }
        Command::Requests(args) => return Ok(requests::run(&args, output, style)?),
        _ => {}
    }
    let key = client::load_key(cli.key_file.as_ref())?;
    let mut admin = client::connect(&cli.control_plane, key, cli.ca.as_ref()).await?;
    match cli.command {
        Command::Status(arg) => show(&mut admin, View::Status, arg, output, style).await?,
        Command::Hosts(arg) => show(&mut admin, View::Hosts, arg, output, style).await?,
        Command::Clients(arg) => show(&mut admin, View::Clients, arg, output, style).await?,
        Command::Cloud(arg) => show(&mut admin, View::Cloud, arg, output, style).await?,
        Command::Keys(command) => keys(&mut admin, command, output, style).await?,
        Command::Nodes(command) => nodes::run(&mut admin, command, output, style).await?,
        Command::Queue(command) => queue(&mut admin, command, output).await?,
        Command::Usage(args) => {
            let request = args.request();
            let mut response = admin.get_usage(request).await?.into_inner();
            if args.by_app() {
                usage::fold_apps(&mut response);
            }
            println!(
                "{}",
                usage::render(&response, &request, args.by_app(), output, style)
            );
        }
        Command::Audit(args) => audit::run(&mut admin, &args, output).await?,
        Command::Config(_)
        | Command::Completions { .. }
        | Command::Health { .. }
        | Command::Requests(_) => {}
    }
    Ok(())
}

/// Prints `view` once, or with `--watch` redraws it until Ctrl-C. A failed
/// refresh is shown in place of the view and the watch goes on.
async fn show(
    admin: &mut client::Admin,
    view: View,
    arg: WatchArg,
    output: Output,
    style: Style,
) -> Result<(), Failure> {
    let Some(seconds) = arg.watch else {
        println!("{}", fetch(admin, view, output, style).await?);
        return Ok(());
    };
    let every = watch::interval(seconds);
    let mut ticks = tokio::time::interval(every);
    let stop = tokio::signal::ctrl_c();
    tokio::pin!(stop);
    loop {
        let body = tokio::select! {
            _ = &mut stop => return Ok(()),
            _ = ticks.tick() => tokio::select! {
                _ = &mut stop => return Ok(()),
                body = fetch(admin, view, output, style) => body,
            },
        };
        let body = body.unwrap_or_else(|failure| format!("oqpctl: {}", failure.message));
        let frame = watch::frame(
            view.command(),
            every,
            std::time::SystemTime::now(),
            &body,
            style.color,
        );
        print!("{frame}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
    }
}

async fn fetch(
    admin: &mut client::Admin,
    view: View,
    output: Output,
    style: Style,
) -> Result<String, Failure> {
    Ok(match view {
        View::Status => {
            let response = admin.get_status(api::GetStatusRequest {}).await?;
            render::status(&response.into_inner(), output, style)
        }
        View::Hosts => {
            let response = admin.list_hosts(api::ListHostsRequest {}).await?;
            render::hosts(&response.into_inner(), output, style)
        }
        View::Clients => {
            let response = admin.list_clients(api::ListClientsRequest {}).await?;
            render::clients(&response.into_inner(), output, style)
        }
        View::Cloud => {
            let response = admin.list_hosts(api::ListHostsRequest {}).await?;
            render::cloud(&response.into_inner(), output, style)
        }
    })
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

async fn keys(
    admin: &mut client::Admin,
    command: KeysCommand,
    output: Output,
    style: Style,
) -> Result<(), Failure> {
    match command {
        KeysCommand::List => {
            let response = admin.list_keys(api::ListKeysRequest {}).await?.into_inner();
            println!("{}", render::keys(&response, output, style));
        }
        KeysCommand::Add(add) => {
            let request = add_request(add).map_err(|message| Failure { code: 2, message })?;
            let response = admin.add_key(request).await?.into_inner();
            println!("{}", render::key_added(&response, output));
        }
        KeysCommand::Rotate { client_id, grace } => {
            let request = api::RotateKeyRequest {
                client_id,
                grace_seconds: grace.map_or(0, whole_seconds),
            };
            let response = admin.rotate_key(request).await?.into_inner();
            println!("{}", render::key_rotated(&response, output));
        }
        KeysCommand::Revoke { client_id } => {
            let request = api::RevokeKeyRequest {
                client_id: client_id.clone(),
            };
            let response = admin.revoke_key(request).await?.into_inner();
            println!("{}", render::key_revoked(&client_id, &response, output));
        }
    }
    Ok(())
}

/// Seconds, rounded up: `--expires 500ms` must not mean "never", nor
/// `--grace 500ms` "not at all".
fn whole_seconds(duration: std::time::Duration) -> u64 {
    duration.as_secs() + u64::from(duration.subsec_nanos() > 0)
}

fn tier(name: &str) -> wire::Tier {
    match name {
        "high" => wire::Tier::High,
        "low" => wire::Tier::Low,
        _ => wire::Tier::Normal,
    }
}

fn add_request(add: AddKey) -> Result<api::AddKeyRequest, String> {
    let budget = add.budget.budget()?;
    Ok(api::AddKeyRequest {
        models: add
            .models
            .iter()
            .map(|model| model.trim().to_owned())
            .filter(|model| !model.is_empty())
            .collect(),
        client_id: add.client_id,
        scope: match add.scope.as_str() {
            "read" => wire::Scope::Read,
            "management" => wire::Scope::Management,
            _ => wire::Scope::Inference,
        } as i32,
        max_priority: tier(&add.max_priority) as i32,
        max_concurrent: add.max_concurrent,
        weight: add.weight,
        description: add.description,
        expires_in_seconds: add.expires.map_or(0, whole_seconds),
        default_priority: add
            .default_priority
            .as_deref()
            .map_or(wire::Tier::Unspecified, tier) as i32,
        max_queued: add.max_queued,
        budget,
    })
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

    #[test]
    fn watch_takes_an_optional_interval() {
        let watch_of = |args: &[&str]| match parse(args).unwrap().command {
            Command::Status(arg)
            | Command::Hosts(arg)
            | Command::Clients(arg)
            | Command::Cloud(arg) => arg.watch,
            other => panic!("not a view: {other:?}"),
        };
        assert_eq!(watch_of(&["status"]), None);
        assert_eq!(watch_of(&["status", "--watch"]), Some(2));
        assert_eq!(watch_of(&["hosts", "--watch", "5"]), Some(5));
        assert_eq!(watch_of(&["clients", "--watch", "--no-color"]), Some(2));
        assert!(parse(&["status", "--watch", "soon"]).is_err());
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("oqpctl").chain(args.iter().copied()))
    }

    #[test]
    fn keys_add_maps_every_flag() {
        let cli = parse(&[
            "keys",
            "add",
            "batch",
            "--max-priority",
            "low",
            "--scope",
            "read",
            "--max-concurrent",
            "1",
            "--weight",
            "0.5",
            "--max-queued",
            "9",
            "--default-priority",
            "low",
            "--description",
            "nightly",
            "--expires",
            "1day 500ms",
        ])
        .unwrap();
        let Command::Keys(KeysCommand::Add(add)) = cli.command else {
            panic!("not keys add: {:?}", cli.command);
        };
        let request = add_request(add).unwrap();
        assert_eq!(request.client_id, "batch");
        assert_eq!(request.scope, wire::Scope::Read as i32);
        assert_eq!(request.max_priority, wire::Tier::Low as i32);
        assert_eq!(request.default_priority, wire::Tier::Low as i32);
        assert_eq!(request.max_concurrent, 1);
        assert_eq!(request.weight, 0.5);
        assert_eq!(request.max_queued, 9);
        assert_eq!(request.description, "nightly");
        assert_eq!(request.expires_in_seconds, 86_401);
        assert_eq!(request.budget, None);
    }

    #[test]
    fn keys_add_takes_a_budget_and_usage_its_period() {
        let cli = parse(&[
            "keys",
            "add",
            "nightly",
            "--max-priority",
            "low",
            "--scope",
            "inference",
            "--budget-gpu",
            "2h",
            "--budget-tokens",
            "2M",
            "--budget-window",
            "1d",
        ])
        .unwrap();
        let Command::Keys(KeysCommand::Add(add)) = cli.command else {
            panic!("not keys add");
        };
        let budget = add_request(add).unwrap().budget.unwrap();
        assert_eq!(budget.gpu_ns, 7_200_000_000_000);
        assert_eq!(budget.tokens, 2_000_000);
        assert_eq!(budget.window, "1d");
        assert!(
            parse(&[
                "keys",
                "add",
                "x",
                "--max-priority",
                "low",
                "--scope",
                "read",
                "--budget-window",
                "2d"
            ])
            .is_err()
        );
        let Command::Usage(args) = parse(&["usage", "--since", "7d", "--by", "client,model"])
            .unwrap()
            .command
        else {
            panic!("not usage");
        };
        let request = args.request();
        assert_eq!(request.since_seconds, 7 * 86_400);
        assert!(request.by_client && request.by_model);
        let Command::Usage(args) = parse(&["usage"]).unwrap().command else {
            panic!("not usage");
        };
        assert_eq!(args.request().since_seconds, 86_400);
        assert!(args.request().by_client && !args.request().by_model);
        assert!(parse(&["usage", "--by", "host"]).is_err());
    }

    #[test]
    fn keys_add_defaults_and_required_flags() {
        let cli = parse(&[
            "keys",
            "add",
            "chat",
            "--max-priority",
            "high",
            "--scope",
            "inference",
        ])
        .unwrap();
        let Command::Keys(KeysCommand::Add(add)) = cli.command else {
            panic!("not keys add");
        };
        let request = add_request(add).unwrap();
        assert_eq!(request.default_priority, wire::Tier::Unspecified as i32);
        assert_eq!(request.weight, 1.0);
        assert_eq!(request.expires_in_seconds, 0);
        assert!(parse(&["keys", "add", "chat", "--scope", "read"]).is_err());
        assert!(parse(&["keys", "add", "chat", "--max-priority", "high"]).is_err());
        assert!(
            parse(&[
                "keys",
                "add",
                "chat",
                "--max-priority",
                "urgent",
                "--scope",
                "read"
            ])
            .is_err()
        );
    }

    #[test]
    fn keys_rotate_takes_a_grace_period() {
        let cli = parse(&["keys", "rotate", "batch", "--grace", "90s"]).unwrap();
        let Command::Keys(KeysCommand::Rotate { client_id, grace }) = cli.command else {
            panic!("not keys rotate");
        };
        assert_eq!(client_id, "batch");
        assert_eq!(grace, Some(std::time::Duration::from_secs(90)));
        assert!(parse(&["keys", "revoke"]).is_err());
    }

    #[test]
    fn refusals_exit_1_and_unreachable_exits_2() {
        for code in [
            tonic::Code::PermissionDenied,
            tonic::Code::Unauthenticated,
            tonic::Code::AlreadyExists,
            tonic::Code::FailedPrecondition,
            tonic::Code::NotFound,
            tonic::Code::InvalidArgument,
        ] {
            let failure = Failure::from(tonic::Status::new(code, "why"));
            assert_eq!((failure.code, failure.message.as_str()), (1, "why"));
        }
        let failure = Failure::from(tonic::Status::unavailable("down"));
        assert_eq!(failure.code, 2);
    }
}
