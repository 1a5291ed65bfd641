//! `oqp-bench`: what oqp costs and what it buys, measured against the same
//! fake Ollama reached three ways — direct, through a minimal pass-through
//! proxy (the floor: [`minimal`]), and through oqp in single-box mode — each
//! in its own process ([`procs`]), driven by a small tokio client
//! ([`load`]), interleaved over several rounds, summarised as one Markdown
//! table ([`report`]) with a verdict per target.
//!
//! The scenarios ([`scenarios`]): added latency (pinned and unpinned),
//! saturation of the metadata fast path and of the queued path, work
//! conservation, streaming, embedding-cache hits (memory and Redis), memory,
//! CPU per 1k req/s, scheduling under a batch flood, fairness, the
//! node hop's cost (a request forwarded by one data plane to the owner's),
//! and model-swap-aware scheduling (two models that do not fit together).
//!
//! [`run`] is the library entry: the binary calls it, and so does the smoke
//! test (`--quick`, tiny counts).

pub mod baseline;
pub mod minimal;
pub mod report;
pub mod scenarios;
pub mod stats;
pub mod tls;
pub mod upstream;

pub use crate::{load, procs};

use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime};

use anyhow::Context;
use clap::Parser;

use procs::{Binaries, OqpCommand};
use report::Report;

/// Added latency, client and fake on CPU 0, the proxy on CPU 1.
pub const SCENARIO_LATENCY_PINNED: &str = "added latency, pinned";
/// Added latency, no pinning.
pub const SCENARIO_LATENCY_UNPINNED: &str = "added latency, unpinned";
/// Saturation of `GET /api/tags`.
pub const SCENARIO_SATURATION_FAST: &str = "saturation, metadata fast path";
/// Saturation of non-streamed generates.
pub const SCENARIO_SATURATION_QUEUED: &str = "saturation, queued path";
/// Achieved ÷ P/D.
pub const SCENARIO_WORK_CONSERVATION: &str = "work conservation";
/// Time to first line, per-line delay.
pub const SCENARIO_STREAMING: &str = "streaming";
/// Cache hits, in-process backend.
pub const SCENARIO_CACHE_MEMORY: &str = "cache hit, memory";
/// Cache hits, Redis backend.
pub const SCENARIO_CACHE_REDIS: &str = "cache hit, redis";
/// Resident memory.
pub const SCENARIO_MEMORY: &str = "memory";
/// CPU per 1k req/s.
pub const SCENARIO_CPU: &str = "cpu";
/// Interactive wait under a batch flood.
pub const SCENARIO_SCHEDULING: &str = "scheduling";
/// Jain's index.
pub const SCENARIO_FAIRNESS: &str = "fairness";

/// Through an edge data plane and the owner's, vs the owner alone.
pub const SCENARIO_FORWARDED: &str = "forwarded";
/// Two models that do not fit together: Ollama alone, `queue.model_swap` off and on.
pub const SCENARIO_SWAP: &str = "model swap";
/// A three-model mix on per-model runners: Ollama alone, oqp with per-box and per-runner slots.
pub const SCENARIO_RUNNERS: &str = "runners";
/// Conversation affinity.
pub const SCENARIO_AFFINITY: &str = "affinity";

/// Conversation affinity on real engines (llama-server): round robin, off, on.
pub const SCENARIO_ENGINES: &str = "affinity, real engines";

/// Usage reports with many users (the control plane's ledger, in process).
pub const SCENARIO_USAGE: &str = "usage reports";
/// Ollama's API translated for an OpenAI-compatible engine.
pub const SCENARIO_TRANSLATE: &str = "translation";

/// Every scenario, in table order; each has at least one row.
pub const SCENARIOS: [&str; 19] = [
    SCENARIO_LATENCY_PINNED,
    SCENARIO_LATENCY_UNPINNED,
    SCENARIO_SATURATION_FAST,
    SCENARIO_SATURATION_QUEUED,
    SCENARIO_WORK_CONSERVATION,
    SCENARIO_STREAMING,
    SCENARIO_CACHE_MEMORY,
    SCENARIO_CACHE_REDIS,
    SCENARIO_MEMORY,
    SCENARIO_CPU,
    SCENARIO_SCHEDULING,
    SCENARIO_FAIRNESS,
    SCENARIO_FORWARDED,
    SCENARIO_SWAP,
    SCENARIO_RUNNERS,
    SCENARIO_AFFINITY,
    SCENARIO_ENGINES,
    SCENARIO_USAGE,
    SCENARIO_TRANSLATE,
];

/// The command documented in the README.
pub const COMMAND: &str = "cargo run --release -p oqp-tests --bin oqp-bench";

/// Options of a benchmark run.
#[derive(Debug, Clone, Parser)]
#[command(name = "oqp-bench")]
pub struct Args {
    /// Seconds instead of minutes: tiny counts, one round (CI's smoke test).
    #[arg(long)]
    pub quick: bool,
    /// Rounds of each interleaved comparison (default 5, quick 1).
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Where to write the table (default: bench-results/latest.md in the
    /// workspace).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Also copy the table into docs/benchmarks.md.
    #[arg(long)]
    pub write_docs: bool,
    /// Run only the scenarios whose names contain one of these words
    /// (repeatable); the others get a "skipped" row.
    #[arg(long = "only", value_name = "WORD")]
    pub only: Vec<String>,
    /// Do not pin processes to CPUs.
    #[arg(long)]
    pub no_pin: bool,
    /// The baseline to warn against (default: docs/bench-baseline.tsv in
    /// the workspace).
    #[arg(long)]
    pub baseline: Option<PathBuf>,
    /// Record this run's µs figures in the baseline (the rows it ran).
    #[arg(long)]
    pub write_baseline: bool,
    /// The fake-ollama binary (default: beside this one).
    #[arg(long)]
    pub fake_bin: Option<PathBuf>,
    /// The oqp-bench binary, for the minimal proxy (default: this one).
    #[arg(long)]
    pub bench_bin: Option<PathBuf>,
    /// The oqp-controlplane binary (default: beside this one).
    #[arg(long)]
    pub oqp_bin: Option<PathBuf>,
    /// Run oqp as `oqp-bench single-box` instead of `oqp-controlplane
    /// --with-dataplane` (same libraries; for when the latter is not built).
    #[arg(long)]
    pub oqp_self: bool,
}

/// What the scenarios share.
#[derive(Debug, Clone)]
pub struct Bench {
    /// The programs.
    pub binaries: Binaries,
    /// Quick mode.
    pub quick: bool,
    /// Rounds per comparison.
    pub rounds: usize,
    /// Whether to pin.
    pub pin: bool,
    /// CPUs available.
    pub cpus: usize,
}

/// Runs the benchmark and writes the table; returns it.
pub async fn run(args: Args) -> anyhow::Result<String> {
    let binaries = binaries(&args)?;
    let bench = Bench {
        quick: args.quick,
        rounds: args.rounds.unwrap_or(if args.quick { 1 } else { 5 }).max(1),
        pin: !args.no_pin,
        cpus: std::thread::available_parallelism().map_or(1, usize::from),
        binaries,
    };
    let started = Instant::now();
    let mut report = Report::default();
    let selected = |scenario: &str| {
        args.only.is_empty()
            || args
                .only
                .iter()
                .any(|word| scenario.contains(word.as_str()))
    };
    macro_rules! scenario {
        ($names:expr, $run:expr) => {{
            let names: &[&str] = $names;
            if names.iter().any(|name| selected(name)) {
                eprint!("oqp-bench: {} … ", names.join(", "));
                let (before, began) = (report.rows.len(), Instant::now());
                if let Err(error) = $run(&bench, &mut report).await {
                    report.rows.truncate(before);
                    for name in names {
                        report.not_run(name, &format!("error: {error:#}"));
                    }
                }
                eprintln!("{:.1} s", began.elapsed().as_secs_f64());
            } else {
                for name in names {
                    report.not_run(name, "skipped (--only)");
                }
            }
        }};
    }
    scenario!(
        &[SCENARIO_LATENCY_PINNED, SCENARIO_LATENCY_UNPINNED],
        scenarios::latency::run
    );
    scenario!(
        &[SCENARIO_SATURATION_FAST, SCENARIO_SATURATION_QUEUED],
        scenarios::throughput::run_saturation
    );
    scenario!(
        &[SCENARIO_WORK_CONSERVATION],
        scenarios::throughput::run_conservation
    );
    scenario!(&[SCENARIO_STREAMING], scenarios::streaming::run);
    scenario!(
        &[SCENARIO_CACHE_MEMORY, SCENARIO_CACHE_REDIS],
        scenarios::cache::run
    );
    scenario!(&[SCENARIO_MEMORY], scenarios::memory::run);
    scenario!(&[SCENARIO_CPU], scenarios::cpu::run);
    scenario!(&[SCENARIO_SCHEDULING], scenarios::scheduling::run);
    scenario!(&[SCENARIO_FAIRNESS], scenarios::fairness::run);
    scenario!(&[SCENARIO_FORWARDED], scenarios::forwarded::run);
    scenario!(&[SCENARIO_SWAP], scenarios::swap::run);
    scenario!(&[SCENARIO_RUNNERS], scenarios::runners::run);
    scenario!(&[SCENARIO_AFFINITY], scenarios::affinity::run);
    scenario!(&[SCENARIO_ENGINES], scenarios::engines::run);
    scenario!(&[SCENARIO_USAGE], scenarios::usage::run);
    scenario!(&[SCENARIO_TRANSLATE], scenarios::translate::run);

    report.header = header(&args, &bench, started.elapsed());
    report.notes = notes(&report);
    let baseline_path = args
        .baseline
        .clone()
        .unwrap_or_else(|| workspace().join("docs/bench-baseline.tsv"));
    let recorded = baseline::read(&baseline_path);
    let figures = baseline::figures(&report);
    // The quick run's counts are too small to compare with anything.
    let warnings = if args.quick {
        Vec::new()
    } else {
        baseline::regressions(&recorded, &figures)
    };
    for warning in &warnings {
        eprintln!("oqp-bench: warning: slower than the baseline: {warning}");
    }
    if !warnings.is_empty() {
        report.notes.push(String::new());
        report.notes.push(format!(
            "**Warning**: slower than the baseline (`{}`) by more than {:.0} µs:",
            baseline_path
                .strip_prefix(workspace())
                .unwrap_or(&baseline_path)
                .display(),
            baseline::MARGIN_US
        ));
        report
            .notes
            .extend(warnings.iter().map(|warning| format!("- {warning}")));
    }
    if args.write_baseline {
        write(&baseline_path, &baseline::render(&recorded, &figures))?;
    }
    let text = report.to_markdown();
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| workspace().join("bench-results/latest.md"));
    write(&out, &text)?;
    if args.write_docs {
        write(&workspace().join("docs/benchmarks.md"), &text)?;
    }
    Ok(text)
}

fn binaries(args: &Args) -> anyhow::Result<Binaries> {
    let bench = match &args.bench_bin {
        Some(path) => path.clone(),
        None => std::env::current_exe().context("cannot find this program")?,
    };
    let dir = bench.parent().map(Path::to_path_buf).unwrap_or_default();
    let fake = args
        .fake_bin
        .clone()
        .unwrap_or_else(|| dir.join("fake-ollama"));
    anyhow::ensure!(
        fake.is_file(),
        "{} is missing: build it with `cargo build --release -p oqp-tests --bin fake-ollama`",
        fake.display()
    );
    let oqp = if args.oqp_self {
        OqpCommand::Bench(bench.clone())
    } else {
        let path = args
            .oqp_bin
            .clone()
            .unwrap_or_else(|| dir.join("oqp-controlplane"));
        anyhow::ensure!(
            path.is_file(),
            "{} is missing: build it with `cargo build --release -p oqp-controlplane`, or pass --oqp-self",
            path.display()
        );
        OqpCommand::ControlPlane(path)
    };
    Ok(Binaries { fake, bench, oqp })
}

fn header(args: &Args, bench: &Bench, took: std::time::Duration) -> Vec<String> {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|line| line.strip_prefix("model name"))
                .map(|name| name.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|release| release.trim().to_owned())
        .unwrap_or_default();
    let mut command = COMMAND.to_owned();
    let mut flags = Vec::new();
    if args.quick {
        flags.push("--quick".to_owned());
    }
    if let Some(rounds) = args.rounds {
        flags.push(format!("--rounds {rounds}"));
    }
    if args.write_docs {
        flags.push("--write-docs".to_owned());
    }
    if args.no_pin {
        flags.push("--no-pin".to_owned());
    }
    for word in &args.only {
        flags.push(format!("--only {word}"));
    }
    if !flags.is_empty() {
        command = format!("{command} -- {}", flags.join(" "));
    }
    let mode = if bench.quick {
        "quick (smoke-test sizes: the figures mean nothing)"
    } else {
        "full"
    };
    vec![
        "# oqp benchmark".to_owned(),
        String::new(),
        format!("Produced by `{command}` on {}, in {:.0} s ({mode} run; up to {} rounds per comparison).", stats::format_utc(SystemTime::now()), took.as_secs_f64(), bench.rounds),
        String::new(),
        format!("- Machine: {cpu}, {} CPUs, Linux {kernel}. Loopback only.", bench.cpus),
        format!(
            "- Processes: the fake Ollama `{}`; the minimal proxy `oqp-bench minimal-proxy` (plain hyper, `tests/src/bench/minimal.rs`); oqp {}; the load generator in the `oqp-bench` process (tokio, kept-alive HTTP/1.1 connections).",
            bench.binaries.fake.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            bench.binaries.oqp.describe()
        ),
        "- Placement: *pinned* rows run the load generator and the fake on CPU 0 and the proxy under test on CPU 1 (`taskset`); every other row is unpinned (all processes share every CPU).".to_owned(),
        "- Cells: median over rounds, with the range of the rounds in parentheses; targets are sent to direct / minimal / oqp in turn (A, B, C, A, B, C …, the order rotating).".to_owned(),
    ]
}

fn notes(report: &Report) -> Vec<String> {
    let (met, not_met, unknown) = report.verdicts();
    vec![
        format!("Targets: {met} met, {not_met} not met, {unknown} without a figure."),
        String::new(),
        "How each figure is taken:".to_owned(),
        String::new(),
        "- *Added latency*: one request at a time on one kept-alive connection per target; p50 and p99 per round; the added latency is the median, over requests, of the difference between consecutive samples of two targets (taken moments apart), which cancels most of the machine's noise.".to_owned(),
        "- *Saturation*: closed loop, a fixed number of connections sending back to back; the fake answers at once (no service time), so the proxy's own cost is the limit. The queued path goes through oqp's admission and dispatcher (upstream slots never run out).".to_owned(),
        "- *Work conservation*: an upstream with P slots and D ms per request can serve at most P/D requests a second; more clients than slots keep every slot wanted. The fake's service time overshoots D a little (timer granularity), which lowers every column alike; the second row divides it out.".to_owned(),
        "- *Streaming*: the fake stamps each NDJSON line's `created_at` with the time it sends it (RFC 3339, ns); delay = client receive time − that stamp, on the same clock.".to_owned(),
        "- *Cache*: the fake answers embeddings without service time, so a hit is compared with the bare cost of an upstream round trip. Rows say n/a when oqp's answers carry no `X-Cache` header.".to_owned(),
        "- *Memory*: `VmRSS` of `/proc/<pid>/status`. The queued figure fills the queue behind an upstream whose one slot never frees; the depth is confirmed through the control plane's admin API before reading. The for-scale row is the same number of connections that never finish their headers: what the connections themselves cost.".to_owned(),
        "- *CPU*: open loop at a fixed rate; the process's user + system time (`/proc/<pid>/stat`) over the run ÷ its length, scaled to 1k req/s.".to_owned(),
        "- *Scheduling*: wait = response time − the request's own service time; direct to the fake the chats queue in Ollama's FIFO.".to_owned(),
        "- *Fairness*: completions per client in the window; direct, a FIFO shares in proportion to what each client offers.".to_owned(),
        "- *Forwarded*: one control plane (in the benchmark's process; it is not on the request path) and two data planes, each its own `oqp-bench dataplane` process, unpinned; the fake's only host is owned by node b. A request entering at a is forwarded to b over the node hop. The columns are what stands in front of owner b, as each row says: nothing (b alone), the minimal proxy (the floor of any extra hop), or edge a. Added latency as above, each sample paired with the b-alone request taken moments apart; line delays as in *Streaming*. The figure counts only if edge a reports (`/queue/status`) that it forwarded every request it was sent.".to_owned(),
        "- *Model swap*: the fake in its VRAM mode (10 GiB, two 8 GiB models, one slot; a cold request waits in one FIFO, the victim is unloaded once its requests finish, `load_duration` counts from arrival), a fresh fake for each run, one run per setup (not rounds). Client A loops on `alpha`, client B on `beta`, one request in flight each (A: 4 in the share row); direct there is no key, through oqp they are two normal-tier clients. Each oqp run (in the quick run only those with the feature on) first sends one request per model and waits until `/queue/status` shows its 8 GiB resident, so that it measures the steady state. An answer counts when it arrives inside the window; latency is from send to the whole answer; GPU time is the answers' `total_duration` (counted, as Ollama does, from the request's arrival: its load and its wait in Ollama's own queue included); a share is taken over the run's whole turns (a turn: answers for one model in a row; the one the deadline cuts is left out, and an even number is kept, so that neither client gains from where the window ends). Theory: with the feature on each switch serves `max_defer / S` requests and costs an unload and a load; the bound: a request held `max_defer`, then the unload and the load, its own service and the one that was running.".to_owned(),
        "- *Affinity, real engines*: two llama.cpp `llama-server`s (`tiny.gguf`, random weights, one thread each, 2 slots, 8,192 tokens a slot), fresh for each run, behind oqp (in the benchmark's process) as `kind: openai` hosts; one run per setup. *In lock step* all conversations start at once and send each turn on the answer to the last; *paced*, each agent waits a random 0–3 s (0–0.3 s in the quick run; seeded per conversation, the same for every setup) before each turn. In lock step an even number of conversations on two hosts makes plain round robin send each conversation to the same host every turn, which agents at their own pace do not get. The time of a follow-up is split by its means: oqp's queue wait (`X-Queue-Wait-Time`), the engine's prompt time (`timings.prompt_ms`: the restore from its RAM prompt cache and the prefill of what is not cached), generation (`timings.predicted_ms`), and the rest (the wait inside the engine, transport). Round robin = `routing.strategy: round_robin` without affinity; off = model-aware routing without affinity; on = affinity. A follow-up counts as cached when the engine's `timings.cache_n` is ≥ 90 % of the previous turn's `prompt_tokens`; *labelled hit* is oqp's `X-OQP-Affinity: hit`. Without llama-server installed the row says so.".to_owned(),
        "- *Usage reports*: in the benchmark's process, no proxy: the control plane's usage store in a temporary state directory, 100,000 users of 10 app keys (10,000 each, the most an app keeps apart in an hour) in the current hour, each with a per-user token budget. The first row applies and saves the batch carrying all of them; the second is the mean of 50 later one-row reports, each applied and appended, with the ack's budgets, today's figures and the budget announcements computed as the policy service does; the third is the process's resident set after the first report minus before, per user. Then 30 past days of the same 2,000 users an hour (10 apps), reported hour by hour at those days' times through the same store (so past days are kept per day as they pass): the usage files' size, a fresh store's load of them, and the mean of 5 later one-row reports with the ack's budgets and announcements for a per-user budget whose window (31 days) covers them all.".to_owned(),
    ]
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// The workspace root.
pub fn workspace() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}
