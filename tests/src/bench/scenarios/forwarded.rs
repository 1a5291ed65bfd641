//! Forwarded: what the node hop costs. One control plane (in this process:
//! it is not on the request path) and two data planes, each its own process
//! (`oqp-bench dataplane`), in front of one fake whose only host node `b`
//! owns. A request entering at `a` is forwarded to `b`, which queues and
//! dispatches it; the same request sent to `b` itself is the baseline.
//!
//! - Added latency: non-streamed generates one at a time, straight to the
//!   owner, through the minimal proxy in front of the owner (the floor of
//!   any extra hop) and through the edge in turn (the order rotating), so
//!   that each forwarded sample has an owner-only sample taken moments
//!   before or after it; the median of those paired differences is the
//!   hop's cost.
//! - Per-line delay of a stream over the hop, from the fake's `created_at`
//!   stamps as in the streaming scenario.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::{ADMIN_KEY, USER_KEY, generate, seconds, size};
use crate::bench::load::{Conn, Req};
use crate::bench::procs::{self, FakeSpec, Proc};
use crate::bench::report::{self, Report, Row};
use crate::bench::stats::{Spread, max, median, micros, percentile};
use crate::bench::{Bench, SCENARIO_FORWARDED};
use crate::cluster::Cluster;

/// The hop's added latency target, p50, in µs.
const TARGET_US: f64 = 100.0;
/// The hop's added latency at most this many times a minimal proxy's in the
/// same place (the floor of one more pass through a proxy).
const TARGET_RATIO: f64 = 1.8;
/// Every line over the hop less than this late, in ms.
const TARGET_MS: f64 = 5.0;
/// The node token of the scenario's cluster.
const NODE_TOKEN: &str = "bench-node-token-0123456789";

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// Straight to the fake.
    Direct,
    /// To the owner's data plane.
    Owner,
    /// To the minimal proxy in front of the owner.
    Minimal,
    /// To the edge, which forwards it to the owner.
    Edge,
}

impl Path {
    const ALL: [Path; 4] = [Path::Direct, Path::Owner, Path::Minimal, Path::Edge];

    fn rotated(by: usize) -> [Path; 4] {
        let mut order = Self::ALL;
        order.rotate_left(by % 4);
        order
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The fake, the cluster in front of it and the minimal proxy in front of
/// the owner.
struct Setup {
    fake: Proc,
    cluster: Cluster,
    minimal: Proc,
}

impl Setup {
    fn addr(&self, path: Path) -> SocketAddr {
        match path {
            Path::Direct => self.fake.addr(),
            Path::Owner => self.cluster.addr("b"),
            Path::Minimal => self.minimal.addr(),
            Path::Edge => self.cluster.addr("a"),
        }
    }
}

/// Per-round latency figures and the line delays.
#[derive(Debug, Default)]
struct Samples {
    p50: [Vec<f64>; 4],
    p99: [Vec<f64>; 4],
    /// Per round: median of (edge − owner) over paired requests.
    added: Vec<f64>,
    /// Per round: median of (minimal − owner).
    minimal_added: Vec<f64>,
    failures: usize,
    /// Requests sent to the edge, and how many of them it says it
    /// forwarded to the owner (`/queue/status`).
    sent_to_edge: u64,
    forwarded: Option<u64>,
    /// Delay of every streamed line, ms.
    delay: [Vec<f64>; 4],
    /// CPU time per request, µs, per round: `[owner b for a request sent to it, the minimal
    /// proxy, edge a, owner b for a hop from a]`.
    cpu: [Vec<f64>; 4],
    incomplete: usize,
}

/// Runs both measurements and adds the rows.
pub async fn run(bench: &Bench, report: &mut Report) -> anyhow::Result<()> {
    let gap = seconds(bench, 0.05, 0.01);
    let tokens = size(bench, 10, 3);
    let spec = FakeSpec {
        token_interval: gap,
        tokens,
        ..FakeSpec::default()
    };
    let fake = procs::spawn_fake(&bench.binaries, spec).await?;
    let cluster = Cluster::builder(&bench.binaries.bench, &config(&fake.url()))
        .node("a")
        .node("b")
        .node_token(NODE_TOKEN)
        .admin_key(ADMIN_KEY)
        .try_start()
        .await;
    let cluster = match cluster {
        Ok(cluster) => cluster,
        Err(error) => {
            fake.stop().await;
            return Err(error);
        }
    };
    let minimal = match procs::spawn_minimal(&bench.binaries, &cluster.url("b")).await {
        Ok(minimal) => minimal,
        Err(error) => {
            cluster.shutdown().await;
            fake.stop().await;
            return Err(error);
        }
    };
    let setup = Setup {
        fake,
        cluster,
        minimal,
    };
    let result = async {
        let mut samples = Samples::default();
        latency(bench, &setup, &mut samples).await?;
        cpu(bench, &setup, &mut samples).await?;
        streams(bench, &setup, tokens, &mut samples).await?;
        anyhow::Ok(samples)
    }
    .await;
    setup.minimal.stop().await;
    setup.cluster.shutdown().await;
    setup.fake.stop().await;
    let samples = result?;
    push_rows(report, &samples, gap, tokens);
    Ok(())
}

/// One host owned by `b`; nodes on port 0, reached where they report they
/// are bound.
fn config(upstream: &str) -> String {
    format!(
        r#"proxy:
  host: "127.0.0.1"
  max_concurrent: 64
ollama:
  hosts:
    - url: "{upstream}"
      name: fake
      max_concurrent: 64
      node: b
nodes:
  a: {{port: 0}}
  b: {{port: 0}}
queue:
  normal:
    max_depth: 20000
auth:
  enabled: true
  rate_limit:
    max_failures: 1000000
  keys:
    - key: "{USER_KEY}"
      client_id: user
    - key: "{ADMIN_KEY}"
      client_id: admin
      scope: management
logging:
  level: warn
control_plane:
  node_token: "{NODE_TOKEN}"
"#
    )
}

async fn latency(bench: &Bench, setup: &Setup, samples: &mut Samples) -> anyhow::Result<()> {
    let per_round = size(bench, 500, 30);
    let warm = size(bench, 100, 5);
    let request = generate(USER_KEY);
    let mut conns = Vec::new();
    for path in Path::ALL {
        conns.push(Conn::open(setup.addr(path)).await?);
    }
    // The edge learns the owner's address from its first report's answer:
    // until then it has nowhere to forward to.
    first_success(&mut conns[Path::Edge.index()], &request).await?;
    let before = forwarded(setup).await;
    for conn in &mut conns {
        for _ in 0..warm {
            conn.send(&request).await?;
        }
    }
    for round in 0..bench.rounds.min(3) {
        let mut taken: [Vec<f64>; 4] = Default::default();
        for i in 0..per_round {
            for path in Path::rotated(i + round) {
                let (took, answer) = conns[path.index()].timed(&request).await?;
                if path == Path::Edge {
                    samples.sent_to_edge += 1;
                }
                if !answer.status.is_success() {
                    samples.failures += 1;
                }
                taken[path.index()].push(micros(took));
            }
        }
        for path in Path::ALL {
            let i = path.index();
            samples.p50[i].extend(percentile(&taken[i], 50.0));
            samples.p99[i].extend(percentile(&taken[i], 99.0));
        }
        let paired = |path: Path| {
            let diffs: Vec<f64> = taken[path.index()]
                .iter()
                .zip(&taken[Path::Owner.index()])
                .map(|(other, owner)| other - owner)
                .collect();
            median(&diffs)
        };
        samples.added.extend(paired(Path::Edge));
        samples.minimal_added.extend(paired(Path::Minimal));
    }
    samples.sent_to_edge += warm as u64;
    samples.forwarded = match (before, forwarded(setup).await) {
        (Some(before), Some(after)) => Some(after.saturating_sub(before)),
        _ => None,
    };
    Ok(())
}

/// CPU time per request of each process a request passes that is not the fake's or the
/// client's: the same requests sent in turn, each path alone for a while, straight to owner
/// b, through the minimal proxy and through edge a, with the user + system time of b, of the
/// minimal proxy and of a read around each (`/proc/<pid>/stat`: 10 ms ticks, so the run is
/// long enough for a tick to be a few per cent of it).
async fn cpu(bench: &Bench, setup: &Setup, samples: &mut Samples) -> anyhow::Result<()> {
    let per_path = size(bench, 3000, 30);
    let request = generate(USER_KEY);
    let owner = setup.cluster.pid("b");
    let (edge, minimal) = (setup.cluster.pid("a"), setup.minimal.pid());
    let mut conns = Vec::new();
    for path in [Path::Owner, Path::Minimal, Path::Edge] {
        conns.push((path, Conn::open(setup.addr(path)).await?));
    }
    let times = || [owner, minimal, edge].map(procs::cpu_time);
    for _ in 0..bench.rounds.min(3) {
        for (path, conn) in &mut conns {
            let before = times();
            for _ in 0..per_path {
                conn.send(&request).await?;
            }
            let after = times();
            let per_request = |i: usize| match (before[i], after[i]) {
                (Some(before), Some(after)) => {
                    Some(micros(after.saturating_sub(before)) / per_path as f64)
                }
                _ => None,
            };
            let figures = match path {
                Path::Owner => [(0, per_request(0))].to_vec(),
                Path::Minimal => [(1, per_request(1))].to_vec(),
                _ => [(2, per_request(2)), (3, per_request(0))].to_vec(),
            };
            for (i, figure) in figures {
                samples.cpu[i].extend(figure);
            }
        }
    }
    Ok(())
}

/// How many requests edge `a` says it forwarded to `b`.
async fn forwarded(setup: &Setup) -> Option<u64> {
    let status = setup.cluster.queue_status("a").await.ok()?;
    status["node"]["peers"]
        .as_array()?
        .iter()
        .find(|peer| peer["node"] == "b")?
        .get("forwarded")?
        .as_u64()
}

/// Sends `request` until it succeeds, for at most 20 s.
async fn first_success(conn: &mut Conn, request: &Req) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let answer = conn.send(request).await?;
        if answer.status.is_success() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(anyhow::anyhow!(
                "the edge never forwarded: {} {}",
                answer.status,
                String::from_utf8_lossy(&answer.body)
            ))
            .context("forwarded scenario");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn streams(
    bench: &Bench,
    setup: &Setup,
    tokens: usize,
    samples: &mut Samples,
) -> anyhow::Result<()> {
    let per_path = size(bench, 4, 1);
    let request = Req::post(
        "/api/generate",
        Some(USER_KEY),
        r#"{"model":"llama3","prompt":"Tell me a story.","stream":true}"#,
    );
    for round in 0..bench.rounds.min(3) {
        let mut tasks = Vec::new();
        for path in Path::rotated(round) {
            for _ in 0..per_path {
                let addr = setup.addr(path);
                let request = request.clone();
                tasks.push(tokio::spawn(async move {
                    let mut conn = Conn::open(addr).await?;
                    let (_, lines) = conn.lines(&request).await?;
                    anyhow::Ok((path, lines))
                }));
            }
        }
        for task in tasks {
            let (path, lines) = task.await??;
            if lines.len() != tokens + 1 {
                samples.incomplete += 1;
            }
            samples.delay[path.index()]
                .extend(lines.iter().filter_map(super::streaming::line_delay_ms));
        }
    }
    Ok(())
}

fn push_rows(report: &mut Report, samples: &Samples, gap: Duration, tokens: usize) {
    let failures = if samples.failures > 0 {
        format!(" — {} non-2xx answers", samples.failures)
    } else {
        String::new()
    };
    let cell =
        |series: &[Vec<f64>; 4], path: Path| report::micros(Spread::of(&series[path.index()]));
    report.push(
        Row::new(
            SCENARIO_FORWARDED,
            "for scale: generate, not streamed, p50 — straight to the fake (direct) and to owner b alone (oqp)",
        )
        .direct(cell(&samples.p50, Path::Direct))
        .oqp(cell(&samples.p50, Path::Owner)),
    );
    for (name, series) in [("p50", &samples.p50), ("p99", &samples.p99)] {
        report.push(
            Row::new(
                SCENARIO_FORWARDED,
                format!(
                    "generate, not streamed, in front of owner b: {name} (direct: b alone; minimal: the minimal proxy → b; oqp: edge a → b){failures}"
                ),
            )
            .cells(
                cell(series, Path::Owner),
                cell(series, Path::Minimal),
                cell(series, Path::Edge),
            ),
        );
    }
    let added = Spread::of(&samples.added);
    // A figure for a hop that did not happen would be no figure at all.
    let all_forwarded = samples.forwarded == Some(samples.sent_to_edge);
    let forwarded = samples
        .forwarded
        .map_or_else(|| "unknown".to_owned(), |n| n.to_string());
    report.push(
        Row::new(
            SCENARIO_FORWARDED,
            format!(
                "added in front of owner b, median of paired differences (minimal → b − b; edge a → b − b); edge a forwarded {forwarded} of {}",
                samples.sent_to_edge
            ),
        )
        .minimal(report::signed_micros(Spread::of(&samples.minimal_added)))
        .oqp(report::signed_micros(added))
        .target(
            &format!("hop ≤ +{TARGET_US:.0} µs p50"),
            added.map(|added| {
                added.median <= TARGET_US && samples.failures == 0 && all_forwarded
            }),
        ),
    );
    let ratios: Vec<f64> = samples
        .added
        .iter()
        .zip(&samples.minimal_added)
        .filter(|(_, minimal)| **minimal > 0.0)
        .map(|(hop, minimal)| hop / minimal)
        .collect();
    let ratio = Spread::of(&ratios);
    report.push(
        Row::new(
            SCENARIO_FORWARDED,
            "the hop's added latency ÷ the minimal proxy's in front of owner b (per round)",
        )
        .oqp(report::ratio(ratio))
        .target(
            &format!("hop ≤ {TARGET_RATIO}× a minimal proxy"),
            ratio.map(|ratio| ratio.median <= TARGET_RATIO && all_forwarded),
        ),
    );
    let cpu = |i: usize| report::micros(Spread::of(&samples.cpu[i]));
    report.push(
        Row::new(
            SCENARIO_FORWARDED,
            "CPU time per request in front of owner b (minimal: the minimal proxy; oqp: edge a)",
        )
        .minimal(cpu(1))
        .oqp(cpu(2)),
    );
    report.push(
        Row::new(
            SCENARIO_FORWARDED,
            "CPU time per request at owner b (direct: a request sent to b; oqp: a hop from a)",
        )
        .direct(cpu(0))
        .oqp(cpu(3)),
    );
    let incomplete = if samples.incomplete > 0 {
        format!(" — {} incomplete streams", samples.incomplete)
    } else {
        String::new()
    };
    let delay = |path: Path, p: f64| {
        report::millis(percentile(&samples.delay[path.index()], p).map(Spread::single))
    };
    for (name, p) in [("p50", 50.0), ("p99", 99.0)] {
        report.push(
            Row::new(
                SCENARIO_FORWARDED,
                format!(
                    "stream ({tokens} tokens {} ms apart), per-line delay, {name} (direct: the fake; minimal: the minimal proxy → b; oqp: edge a → b){incomplete}",
                    gap.as_millis()
                ),
            )
            .cells(
                delay(Path::Direct, p),
                delay(Path::Minimal, p),
                delay(Path::Edge, p),
            ),
        );
    }
    let worst = |path: Path| report::millis(max(&samples.delay[path.index()]).map(Spread::single));
    let edge_worst = max(&samples.delay[Path::Edge.index()]);
    report.push(
        Row::new(
            SCENARIO_FORWARDED,
            format!(
                "stream over the hop: per-line delay, worst of {} lines (owner b alone: {})",
                samples.delay[Path::Edge.index()].len(),
                worst(Path::Owner),
            ),
        )
        .cells(worst(Path::Direct), worst(Path::Minimal), worst(Path::Edge))
        .target(
            &format!("every line < {TARGET_MS:.0} ms late"),
            edge_worst.map(|worst| worst < TARGET_MS && samples.incomplete == 0),
        ),
    );
}
