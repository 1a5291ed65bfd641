//! The processes under test: the fake Ollama (`fake-ollama`), the minimal
//! proxy (`oqp-bench minimal-proxy`), oqp in single-box mode
//! (`oqp-controlplane --with-dataplane`), lone data planes
//! (`oqp-bench dataplane`) and `redis-server`, each in its own
//! process so that it can be pinned to a CPU and its memory and CPU time read
//! from `/proc`. Every child is killed when its [`Proc`] drops.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};

use crate::load::{Conn, Req};

/// Where the programs are.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// `fake-ollama`.
    pub fake: PathBuf,
    /// `oqp-bench` itself (for `minimal-proxy` and, if asked, `single-box`).
    pub bench: PathBuf,
    /// How oqp is started.
    pub oqp: OqpCommand,
}

/// How oqp is started.
#[derive(Debug, Clone)]
pub enum OqpCommand {
    /// `oqp-controlplane --config FILE --with-dataplane`.
    ControlPlane(PathBuf),
    /// `oqp-bench single-box --config FILE`: the same library calls, for
    /// when the control plane's binary is not built (the smoke test).
    Bench(PathBuf),
}

/// The fake's settings.
#[derive(Debug, Clone, Copy)]
pub struct FakeSpec {
    /// Parallel slots.
    pub slots: usize,
    /// Service time of non-streamed inference and embeddings.
    pub latency: Duration,
    /// Delay between streamed lines.
    pub token_interval: Duration,
    /// Content chunks per generation.
    pub tokens: usize,
    /// The fake's VRAM mode (`--vram`), off when `None`.
    pub vram: Option<VramSpec>,
    /// Per-model runners with this many slots each (`--runners`), off when `None`; the chat
    /// model `qwen` is installed too.
    pub runners: Option<usize>,
    /// The runners' prompt cache, with this prefill time per 1,000 uncached tokens
    /// (`--prompt-cache-ms-per-1k`), off when `None`.
    pub prompt_cache_ms_per_1k: Option<f64>,
    /// An OpenAI stream's tokens end in `@<Unix nanoseconds>` of their sending
    /// (`--stamp-tokens`).
    pub stamp_tokens: bool,
}

/// The fake's VRAM mode: room for so many bytes of models, loads and unloads that take time.
/// `llama3` is then installed but not loaded, like every other model.
#[derive(Debug, Clone, Copy)]
pub struct VramSpec {
    /// Capacity in bytes (`--vram`).
    pub capacity: u64,
    /// Chat models to install, each with its size in bytes (`--model`, `--model-size`).
    pub models: &'static [(&'static str, u64)],
    /// How long a load takes (`--load-time-ms`).
    pub load_time: Duration,
    /// How long an unload takes (`--unload-time-ms`).
    pub unload_time: Duration,
}

/// A running child process.
#[derive(Debug)]
pub struct Proc {
    name: String,
    child: Child,
    pid: u32,
    addr: SocketAddr,
    control: Option<SocketAddr>,
    log: PathBuf,
    _stdout: Option<ChildStdout>,
    _dir: tempfile::TempDir,
}

impl Default for FakeSpec {
    fn default() -> Self {
        FakeSpec {
            slots: 64,
            latency: Duration::ZERO,
            token_interval: Duration::ZERO,
            tokens: 5,
            vram: None,
            runners: None,
            prompt_cache_ms_per_1k: None,
            stamp_tokens: false,
        }
    }
}

impl OqpCommand {
    /// How the report names it.
    pub fn describe(&self) -> String {
        match self {
            OqpCommand::ControlPlane(path) => {
                format!("`{} --with-dataplane`", short(path))
            }
            OqpCommand::Bench(path) => format!(
                "`{} single-box` (the control plane and data plane libraries, as `oqp-controlplane --with-dataplane` runs them)",
                short(path)
            ),
        }
    }
}

impl Proc {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The address it serves.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// oqp's control plane gRPC URL.
    pub fn control_url(&self) -> Option<String> {
        self.control.map(|addr| format!("http://{addr}"))
    }

    /// Resident memory now, in KiB.
    pub fn rss_kib(&self) -> Option<u64> {
        rss_kib(self.pid)
    }

    /// CPU time (user + system) used so far.
    pub fn cpu_time(&self) -> Option<Duration> {
        cpu_time(self.pid)
    }

    /// Kills it and waits for it to exit.
    pub async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    /// The end of its log, for error messages.
    pub fn log_tail(&self) -> String {
        tail(&self.log)
    }

    /// Whether it has exited.
    pub fn has_exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Starts `fake-ollama` with the models the scenarios use (`llama3`, loaded
/// unless in VRAM mode; `all-minilm`, embedding-only; those of `spec.vram`).
pub async fn spawn_fake(binaries: &Binaries, spec: FakeSpec) -> anyhow::Result<Proc> {
    let mut command = Command::new(&binaries.fake);
    command.args([
        "--model",
        "llama3",
        "--embedding-model",
        "all-minilm",
        "--record-limit",
        "16",
    ]);
    match spec.vram {
        // A model loaded at start would stay resident for ever, taking room.
        None => {
            command.args(["--loaded", "llama3"]);
        }
        Some(vram) => {
            command
                .arg("--vram")
                .arg(vram.capacity.to_string())
                .arg("--load-time-ms")
                .arg(vram.load_time.as_millis().to_string())
                .arg("--unload-time-ms")
                .arg(vram.unload_time.as_millis().to_string());
            for (name, bytes) in vram.models {
                command
                    .arg("--model")
                    .arg(name)
                    .arg("--model-size")
                    .arg(format!("{name}={bytes}"));
            }
        }
    }
    command
        .arg("--slots")
        .arg(spec.slots.to_string())
        .arg("--latency-ms")
        .arg(spec.latency.as_millis().to_string())
        .arg("--token-interval-ms")
        .arg(spec.token_interval.as_millis().to_string())
        .arg("--tokens")
        .arg(spec.tokens.to_string());
    if spec.stamp_tokens {
        command.arg("--stamp-tokens");
    }
    if let Some(num_parallel) = spec.runners {
        command
            .arg("--runners")
            .arg(num_parallel.to_string())
            .args([
                "--model",
                "qwen",
                "--loaded",
                "qwen",
                "--loaded",
                "all-minilm",
            ]);
    }
    if let Some(ms) = spec.prompt_cache_ms_per_1k {
        command.arg("--prompt-cache-ms-per-1k").arg(ms.to_string());
    }
    spawn_announcing("fake-ollama", command).await
}

/// Starts the minimal proxy in front of `upstream`.
pub async fn spawn_minimal(binaries: &Binaries, upstream: &str) -> anyhow::Result<Proc> {
    let mut command = Command::new(&binaries.bench);
    command.args(["minimal-proxy", "--upstream", upstream]);
    spawn_announcing("minimal-proxy", command).await
}

/// Starts the fast upstream (`oqp-bench fast-upstream`): an Ollama that answers at once.
pub async fn spawn_fast_upstream(binaries: &Binaries) -> anyhow::Result<Proc> {
    let mut command = Command::new(&binaries.bench);
    command.arg("fast-upstream");
    spawn_announcing("fast-upstream", command).await
}

/// Starts a data plane (`oqp-bench dataplane`) as node `node`, following
/// the control plane at `control_url`, presenting the token in
/// `token_file`. It binds `127.0.0.1:0` itself; this returns once it
/// serves (it announces its address only then).
pub async fn spawn_dataplane(
    bench: &Path,
    control_url: &str,
    node: &str,
    token_file: Option<&Path>,
) -> anyhow::Result<Proc> {
    let mut command = Command::new(bench);
    command.args(["dataplane", "--control-plane", control_url, "--node", node]);
    if let Some(path) = token_file {
        command.arg("--node-token-file").arg(path);
    }
    if std::env::var_os("OQP_LOG").is_none() {
        command.env("OQP_LOG", "warn");
    }
    spawn_announcing(&format!("data plane {node}"), command).await
}

/// Starts oqp in single-box mode on `config`, a YAML text with three
/// placeholders: `{PROXY_PORT}`, `{CONTROL}` (the control plane's listen
/// address) and `{STATE}` (a state directory). Waits for `/health`.
pub async fn spawn_oqp(binaries: &Binaries, config: &str) -> anyhow::Result<Proc> {
    let dir = tempfile::tempdir()?;
    let proxy_port = free_port()?;
    let control = format!("127.0.0.1:{}", free_port()?);
    let yaml = config
        .replace("{PROXY_PORT}", &proxy_port.to_string())
        .replace("{CONTROL}", &control)
        .replace("{STATE}", &dir.path().join("state").display().to_string());
    let config_path = dir.path().join("config.yml");
    std::fs::write(&config_path, yaml)?;
    let mut command = match &binaries.oqp {
        OqpCommand::ControlPlane(path) => {
            let mut command = Command::new(path);
            command.arg("--with-dataplane");
            command
        }
        OqpCommand::Bench(path) => {
            let mut command = Command::new(path);
            command.arg("single-box");
            command
        }
    };
    command.arg("--config").arg(&config_path);
    command.env("OQP_LOG", "warn");
    let mut proc = match &binaries.oqp {
        // Binds its own ports and announces them: no port is picked here and lost to a race.
        OqpCommand::Bench(_) => spawn_announcing_in(dir, "oqp", command).await?,
        OqpCommand::ControlPlane(_) => {
            let addr = SocketAddr::from(([127, 0, 0, 1], proxy_port));
            let mut proc = spawn_in(dir, "oqp", command, addr)?;
            proc.control = control.parse().ok();
            proc
        }
    };
    wait_for_health(&mut proc).await?;
    Ok(proc)
}

/// Starts `redis-server` on a free loopback port, without persistence.
pub async fn spawn_redis() -> anyhow::Result<Proc> {
    let dir = tempfile::tempdir()?;
    let port = free_port()?;
    let mut command = Command::new("redis-server");
    command
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .arg("--port")
        .arg(port.to_string())
        .arg("--dir")
        .arg(dir.path());
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut proc = spawn_in(dir, "redis-server", command, addr)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        if proc.has_exited() || Instant::now() > deadline {
            bail!("redis-server did not start: {}", proc.log_tail());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(proc)
}

/// Spawns a program that prints its address on the first line of stdout.
async fn spawn_announcing(name: &str, command: Command) -> anyhow::Result<Proc> {
    spawn_announcing_in(tempfile::tempdir()?, name, command).await
}

/// Starts `command`, which prints its address (and, after a space, its control address, if
/// it has one) on its first stdout line; `dir` holds its log and lives as long as it.
async fn spawn_announcing_in(
    dir: tempfile::TempDir,
    name: &str,
    mut command: Command,
) -> anyhow::Result<Proc> {
    let log = dir.path().join("stderr.log");
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log)?)
        .kill_on_drop(true);
    let mut child = command
        .spawn()
        .with_context(|| format!("cannot start {name}"))?;
    let pid = child.id().context("child has no pid")?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut reader = BufReader::new(stdout);
    let mut first = String::new();
    let read = tokio::time::timeout(Duration::from_secs(15), reader.read_line(&mut first)).await;
    let (addr, control): (SocketAddr, Option<SocketAddr>) = match read {
        Ok(Ok(n)) if n > 0 => {
            let mut words = first.split_whitespace();
            let parse = |word: Option<&str>| -> anyhow::Result<Option<SocketAddr>> {
                word.map(|word| word.parse())
                    .transpose()
                    .with_context(|| format!("{name} announced {first:?}"))
            };
            let addr =
                parse(words.next())?.with_context(|| format!("{name} announced {first:?}"))?;
            (addr, parse(words.next())?)
        }
        _ => bail!("{name} did not announce its address: {}", tail(&log)),
    };
    Ok(Proc {
        name: name.to_owned(),
        child,
        pid,
        addr,
        control,
        log,
        _stdout: Some(reader.into_inner()),
        _dir: dir,
    })
}

fn spawn_in(
    dir: tempfile::TempDir,
    name: &str,
    mut command: Command,
    addr: SocketAddr,
) -> anyhow::Result<Proc> {
    let log = dir.path().join("stderr.log");
    command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .kill_on_drop(true);
    let child = command
        .spawn()
        .with_context(|| format!("cannot start {name}"))?;
    let pid = child.id().context("child has no pid")?;
    Ok(Proc {
        name: name.to_owned(),
        child,
        pid,
        addr,
        control: None,
        log,
        _stdout: None,
        _dir: dir,
    })
}

async fn wait_for_health(proc: &mut Proc) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let health = Req::get("/health", None);
    loop {
        if let Ok(mut conn) = Conn::open(proc.addr()).await
            && let Ok(answer) = conn.send(&health).await
            && answer.status.is_success()
        {
            return Ok(());
        }
        if proc.has_exited() || Instant::now() > deadline {
            bail!("{} did not become healthy: {}", proc.name, proc.log_tail());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A free loopback port (bound, then released: the caller binds it next).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Restricts every thread of `pid` to `cpus` (a `taskset` list such as `0`
/// or `0-1`). False when `taskset` is missing or refused.
pub fn pin(pid: u32, cpus: &str) -> bool {
    std::process::Command::new("taskset")
        .args(["-a", "-p", "-c", cpus, &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// The CPUs `pid` may run on, as `/proc` lists them (`0-1`).
pub fn affinity(pid: u32) -> Option<String> {
    status_field(pid, "Cpus_allowed_list:")
}

/// Resident memory of `pid` in KiB (`VmRSS`).
pub fn rss_kib(pid: u32) -> Option<u64> {
    status_field(pid, "VmRSS:")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// User + system CPU time of `pid` (`/proc/<pid>/stat` fields 14 and 15).
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: split after it.
    let after = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // `after` starts at field 3 (state), so field n is at index n - 3.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(Duration::from_secs_f64(
        (utime + stime) as f64 / clock_ticks() as f64,
    ))
}

/// Clock ticks per second (`getconf CLK_TCK`, 100 on Linux).
fn clock_ticks() -> u64 {
    static TICKS: OnceLock<u64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|out| String::from_utf8_lossy(&out.stdout).trim().parse().ok())
            .filter(|ticks| *ticks > 0)
            .unwrap_or(100)
    })
}

/// Whether a program is on the `PATH`.
pub fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

fn status_field(pid: u32, field: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .map(|value| value.trim().to_owned())
}

fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let start = text.len().saturating_sub(2000);
    let start = (start..text.len())
        .find(|i| text.is_char_boundary(*i))
        .unwrap_or(text.len());
    text[start..].to_owned()
}

fn short(path: &Path) -> String {
    // Relative to the workspace when it is inside it, for a readable report.
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent();
    match workspace.and_then(|root| path.strip_prefix(root).ok()) {
        Some(relative) => relative.display().to_string(),
        None => path.display().to_string(),
    }
}
