//! Added latency, one request at a time: a metadata GET, a non-streamed
//! generate, an embed and a streamed chat's first byte, each sent to direct / minimal / oqp in turn
//! (the order rotating every request), so that each oqp sample has a
//! minimal-proxy sample taken moments before or after it: the median of
//! those paired differences is the figure least disturbed by the machine's
//! other work. Run pinned (client and fake on CPU 0, the proxy under test on
//! CPU 1) and unpinned.

use super::{Target, Trio, USER_KEY, embed, generate, size, tags};
use crate::bench::load::{Conn, Req};
use crate::bench::procs::{self, FakeSpec};
use crate::bench::report::{self, Report, Row};
use crate::bench::stats::{Spread, median, micros, percentile};
use crate::bench::{Bench, SCENARIO_LATENCY_PINNED, SCENARIO_LATENCY_UNPINNED};

/// The added-latency target over the minimal proxy, pinned, in µs.
const TARGET_US: f64 = 50.0;

/// The streamed chat's row name: timed to its first body byte.
const CHAT_FIRST_BYTE: &str = "POST /api/chat, streamed: first byte";

/// A streamed `/api/chat` (timed to its first body byte).
fn chat_stream(key: &str) -> Req {
    Req::post(
        "/api/chat",
        Some(key),
        r#"{"model":"llama3","messages":[{"role":"user","content":"Why is the sky blue?"}],"stream":true}"#,
    )
}

/// Per-round figures of one endpoint.
#[derive(Debug, Default)]
struct Rounds {
    p50: [Vec<f64>; 3],
    p99: [Vec<f64>; 3],
    /// Median of paired differences: minimal − direct, oqp − minimal.
    minimal_added: Vec<f64>,
    oqp_added: Vec<f64>,
    failures: usize,
}

/// Runs both placements and adds their rows.
pub async fn run(bench: &Bench, report: &mut Report) -> anyhow::Result<()> {
    let trio = Trio::start(bench, FakeSpec::default(), 64).await?;
    let endpoints: [(&str, Req); 4] = [
        ("GET /api/tags", tags(USER_KEY)),
        ("POST /api/generate, not streamed", generate(USER_KEY)),
        ("POST /api/embed", embed(USER_KEY, "the quick brown fox")),
        (CHAT_FIRST_BYTE, chat_stream(USER_KEY)),
    ];
    let own = std::process::id();
    let original = procs::affinity(own).unwrap_or_else(|| "0-1".to_owned());
    let can_pin = bench.pin && bench.cpus >= 2 && procs::on_path("taskset");
    let mut pinned = false;
    if can_pin {
        // Client and fake share CPU 0; the proxy under test has CPU 1.
        pinned = procs::pin(own, "0")
            && procs::pin(trio.fake.pid(), "0")
            && procs::pin(trio.minimal.pid(), "1")
            && procs::pin(trio.oqp.pid(), "1");
    }
    let result = async {
        if pinned {
            for (name, request) in &endpoints {
                let rounds = measure(bench, &trio, request, *name == CHAT_FIRST_BYTE).await?;
                push_rows(report, SCENARIO_LATENCY_PINNED, name, &rounds, true);
            }
        } else {
            let why = if bench.pin {
                "taskset or a second CPU is missing"
            } else {
                "--no-pin"
            };
            report.not_run(SCENARIO_LATENCY_PINNED, why);
        }
        for pid in [own, trio.fake.pid(), trio.minimal.pid(), trio.oqp.pid()] {
            procs::pin(pid, &original);
        }
        for (name, request) in &endpoints {
            let rounds = measure(bench, &trio, request, *name == CHAT_FIRST_BYTE).await?;
            push_rows(report, SCENARIO_LATENCY_UNPINNED, name, &rounds, false);
        }
        anyhow::Ok(())
    }
    .await;
    procs::pin(own, &original);
    trio.stop().await;
    result
}

/// `first_byte`: each sample is the time to the answer's first body byte,
/// else to its end.
async fn measure(
    bench: &Bench,
    trio: &Trio,
    request: &Req,
    first_byte: bool,
) -> anyhow::Result<Rounds> {
    let per_round = size(bench, 1500, 40);
    let warm = size(bench, 200, 5);
    let mut rounds = Rounds::default();
    let mut conns = Vec::new();
    for target in Target::ALL {
        conns.push(Conn::open(trio.addr(target)).await?);
    }
    for conn in &mut conns {
        for _ in 0..warm {
            conn.send(request).await?;
        }
    }
    for round in 0..bench.rounds {
        let mut samples: [Vec<f64>; 3] = Default::default();
        for i in 0..per_round {
            for target in Target::rotated(i + round) {
                let conn = &mut conns[target.index()];
                let (took, answer) = if first_byte {
                    conn.first_byte(request).await?
                } else {
                    conn.timed(request).await?
                };
                if !answer.status.is_success() {
                    rounds.failures += 1;
                }
                samples[target.index()].push(micros(took));
            }
        }
        for target in Target::ALL {
            let i = target.index();
            rounds.p50[i].extend(percentile(&samples[i], 50.0));
            rounds.p99[i].extend(percentile(&samples[i], 99.0));
        }
        let paired = |a: &[f64], b: &[f64]| -> Option<f64> {
            let diffs: Vec<f64> = a.iter().zip(b).map(|(a, b)| a - b).collect();
            median(&diffs)
        };
        rounds
            .minimal_added
            .extend(paired(&samples[1], &samples[0]));
        rounds.oqp_added.extend(paired(&samples[2], &samples[1]));
    }
    Ok(rounds)
}

fn push_rows(report: &mut Report, scenario: &str, name: &str, rounds: &Rounds, pinned: bool) {
    let cell = |series: &[Vec<f64>; 3], target: Target| {
        report::micros(Spread::of(&series[target.index()]))
    };
    let failures = if rounds.failures > 0 {
        format!(" — {} non-2xx answers", rounds.failures)
    } else {
        String::new()
    };
    report.push(Row::new(scenario, format!("{name}: p50{failures}")).cells(
        cell(&rounds.p50, Target::Direct),
        cell(&rounds.p50, Target::Minimal),
        cell(&rounds.p50, Target::Oqp),
    ));
    report.push(Row::new(scenario, format!("{name}: p99")).cells(
        cell(&rounds.p99, Target::Direct),
        cell(&rounds.p99, Target::Minimal),
        cell(&rounds.p99, Target::Oqp),
    ));
    let added = Spread::of(&rounds.oqp_added);
    let mut row = Row::new(
        scenario,
        format!(
            "{name}: added latency, median of paired differences (minimal − direct; oqp − minimal)"
        ),
    )
    .minimal(report::signed_micros(Spread::of(&rounds.minimal_added)))
    .oqp(report::signed_micros(added));
    if pinned {
        row = row.target(
            &format!("oqp ≤ +{TARGET_US:.0} µs over minimal"),
            added.map(|added| added.median <= TARGET_US && rounds.failures == 0),
        );
    }
    report.push(row);
}
