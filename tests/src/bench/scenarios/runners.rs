//! Runners: a three-model mix (two chat models and an embedding model, each offered by its own
//! clients at once) on one box whose Ollama runs each model as its own runner with two slots
//! (one for the embedding model, as Ollama forces it). Direct to the fake everything waits in
//! the runners' FIFOs; through oqp counting slots per box (`max_concurrent` only, today's
//! behaviour) part of it still does; through oqp counting slots per runner (`num_parallel`)
//! nothing should. The time each request waited inside "Ollama" comes from the fake's own log
//! (`/_fake/runner-waits`); throughput is successful answers over the makespan.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::{OqpConfig, USER_KEY, embed, size};
use crate::bench::load::{Conn, Req};
use crate::bench::procs::{self, FakeSpec};
use crate::bench::report::{Report, Row};
use crate::bench::stats::percentile;
use crate::bench::{Bench, SCENARIO_RUNNERS};

/// Slots of each chat model's runner on the box.
const NUM_PARALLEL: usize = 2;
/// The box's slots over all its runners, in oqp.
const BOX_SLOTS: u32 = 6;
/// Concurrent clients per model.
const CLIENTS: usize = 6;

/// One run's figures.
#[derive(Debug, Default)]
struct Mix {
    /// Waits inside the fake's runners, in milliseconds.
    inside_ms: Vec<f64>,
    per_second: f64,
    failed: usize,
}

/// Runs the mix direct, through oqp with per-box slots and with per-runner slots.
pub async fn run(bench: &Bench, report: &mut Report) -> anyhow::Result<()> {
    let service = Duration::from_millis(size(bench, 20, 5));
    let each = size(bench, 20, 4);
    let spec = FakeSpec {
        slots: 64,
        latency: service,
        runners: Some(NUM_PARALLEL),
        ..FakeSpec::default()
    };
    let fake = procs::spawn_fake(&bench.binaries, spec).await?;
    let result = async {
        let direct = mix(fake.addr(), fake.addr(), each).await?;
        let mut runs = Vec::new();
        for num_parallel in [None, Some(NUM_PARALLEL as u32)] {
            let config = OqpConfig {
                num_parallel,
                ..OqpConfig::new(&fake.url(), BOX_SLOTS)
            };
            let oqp = procs::spawn_oqp(&bench.binaries, &config.render()).await?;
            let run = mix(oqp.addr(), fake.addr(), each).await;
            oqp.stop().await;
            runs.push(run?);
        }
        anyhow::Ok((direct, runs))
    }
    .await;
    fake.stop().await;
    let (direct, runs) = result?;
    let [per_box, per_runner] =
        <[Mix; 2]>::try_from(runs).map_err(|_| anyhow::anyhow!("two oqp runs expected"))?;

    let waits = |mix: &Mix| {
        let total: f64 = mix.inside_ms.iter().sum();
        match percentile(&mix.inside_ms, 99.0) {
            Some(p99) => format!("p99 {p99:.1} ms, total {total:.0} ms"),
            None => crate::bench::report::na(),
        }
    };
    let failed = direct.failed + per_box.failed + per_runner.failed;
    let failed = if failed > 0 {
        format!(" — {failed} failed")
    } else {
        String::new()
    };
    let p99 = percentile(&per_runner.inside_ms, 99.0);
    report.push(
        Row::new(
            SCENARIO_RUNNERS,
            format!(
                "time waited inside Ollama: 3-model mix, {CLIENTS} clients per model, runners {NUM_PARALLEL}/{NUM_PARALLEL}/1, box {BOX_SLOTS} (D = {} ms){failed}",
                service.as_millis()
            ),
        )
        .direct(waits(&direct))
        .oqp(format!(
            "per runner: {} (per box: {})",
            waits(&per_runner),
            waits(&per_box)
        ))
        .target(
            "per runner: p99 ≤ 1 ms (the fake's jitter)",
            p99.map(|p99| p99 <= 1.0 && per_runner.failed == 0),
        ),
    );
    // Each model gets as many requests; the embedding model's one slot finishes last.
    let ideal = 3.0 / service.as_secs_f64();
    report.push(
        Row::new(
            SCENARIO_RUNNERS,
            format!(
                "throughput of the mix (ideal {ideal:.0}/s: the embedding runner's one slot busy throughout)"
            ),
        )
        .direct(format!("{:.0}/s", direct.per_second))
        .oqp(format!(
            "per runner: {:.0}/s (per box: {:.0}/s)",
            per_runner.per_second, per_box.per_second
        ))
        .target(
            "per runner ≥ 0.95 × per box",
            Some(per_runner.per_second >= 0.95 * per_box.per_second),
        ),
    );
    Ok(())
}

/// Offers the mix to `addr`, `each` requests per client, and reads what waited inside the
/// fake at `fake`.
async fn mix(addr: SocketAddr, fake: SocketAddr, each: usize) -> anyhow::Result<Mix> {
    let before = runner_waits(fake).await?.len();
    let chat = |model: &str| {
        Req::post(
            "/api/chat",
            Some(USER_KEY),
            format!(
                r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"stream":false}}"#
            ),
        )
    };
    let started = Instant::now();
    let mut tasks = Vec::new();
    for client in 0..3 * CLIENTS {
        let model = client % 3;
        let requests: Vec<Req> = (0..each)
            .map(|i| match model {
                0 => chat("llama3"),
                1 => chat("qwen"),
                _ => embed(USER_KEY, &format!("client {client} text {i}")),
            })
            .collect();
        tasks.push(tokio::spawn(async move {
            let mut conn = Conn::open(addr).await?;
            let mut failed = 0;
            for request in &requests {
                if !conn.send(request).await?.status.is_success() {
                    failed += 1;
                }
            }
            anyhow::Ok(failed)
        }));
    }
    let mut failed = 0;
    for task in tasks {
        failed += task.await??;
    }
    let elapsed = started.elapsed();
    let ok = 3 * CLIENTS * each - failed;
    let waits = runner_waits(fake).await?;
    Ok(Mix {
        inside_ms: waits
            .get(before..)
            .unwrap_or_default()
            .iter()
            .map(|us| us / 1e3)
            .collect(),
        per_second: ok as f64 / elapsed.as_secs_f64().max(1e-9),
        failed,
    })
}

/// The fake's log of waits inside its runners, in microseconds.
async fn runner_waits(fake: SocketAddr) -> anyhow::Result<Vec<f64>> {
    let mut conn = Conn::open(fake).await?;
    let answer = conn.send(&Req::get("/_fake/runner-waits", None)).await?;
    let value: serde_json::Value = serde_json::from_slice(&answer.body)?;
    Ok(value["waits_us"]
        .as_array()
        .map(|waits| waits.iter().filter_map(serde_json::Value::as_f64).collect())
        .unwrap_or_default())
}
