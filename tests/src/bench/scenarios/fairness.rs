//! Fairness: four clients of the same tier offer 8, 8, 16 and 32 concurrent
//! requests to a 2-slot upstream. Direct to the fake (FIFO) each gets a share
//! in proportion to what it offers; through oqp each should get a quarter.
//! Jain's index of the completions, and the largest share over the smallest.

use std::time::{Duration, Instant};

use super::{OqpConfig, Target, fair_key, generate, seconds, size};
use crate::bench::load::Conn;
use crate::bench::procs::{self, FakeSpec};
use crate::bench::report::{Report, Row};
use crate::bench::stats::jain;
use crate::bench::{Bench, SCENARIO_FAIRNESS};

/// What each client offers (concurrent requests).
const OFFERED: [usize; 4] = [8, 8, 16, 32];
/// The target index.
const TARGET: f64 = 0.99;

/// Runs through oqp and direct, and adds the rows.
pub async fn run(bench: &Bench, report: &mut Report) -> anyhow::Result<()> {
    let service = Duration::from_millis(size(bench, 10, 5));
    let spec = FakeSpec {
        slots: 2,
        latency: service,
        ..FakeSpec::default()
    };
    let duration = seconds(bench, 6.0, 1.0);
    let fake = procs::spawn_fake(&bench.binaries, spec).await?;
    let oqp =
        match procs::spawn_oqp(&bench.binaries, &OqpConfig::new(&fake.url(), 2).render()).await {
            Ok(oqp) => oqp,
            Err(error) => {
                fake.stop().await;
                return Err(error);
            }
        };
    let result = async {
        let mut shares = [Vec::new(), Vec::new()];
        let mut failed = 0;
        for (i, target) in [Target::Oqp, Target::Direct].into_iter().enumerate() {
            let addr = match target {
                Target::Oqp => oqp.addr(),
                _ => fake.addr(),
            };
            let (done, target_failed) = offer(addr, duration).await?;
            shares[i] = done;
            failed += target_failed;
        }
        anyhow::Ok((shares, failed))
    }
    .await;
    oqp.stop().await;
    fake.stop().await;
    let ([through, direct], failed) = result?;

    let index = |shares: &[f64]| format!("{:.4}", jain(shares));
    let spread = |shares: &[f64]| {
        let max = shares.iter().copied().fold(0.0, f64::max);
        let min = shares.iter().copied().fold(f64::MAX, f64::min);
        format!(
            "{:.2} ({})",
            max / min.max(1.0),
            shares
                .iter()
                .map(|s| format!("{s:.0}"))
                .collect::<Vec<_>>()
                .join("/")
        )
    };
    let failed = if failed > 0 {
        format!(" — {failed} failed")
    } else {
        String::new()
    };
    let oqp_index = jain(&through);
    report.push(
        Row::new(
            SCENARIO_FAIRNESS,
            format!(
                "Jain's index, 4 same-tier clients offering 8/8/16/32 (2 slots, {} ms, {:.0} s){failed}",
                service.as_millis(),
                duration.as_secs_f64()
            ),
        )
        .direct(index(&direct))
        .oqp(index(&through))
        .target(&format!("oqp ≥ {TARGET}"), Some(oqp_index >= TARGET && failed.is_empty())),
    );
    report.push(
        Row::new(SCENARIO_FAIRNESS, "max/min share (completions per client)")
            .direct(spread(&direct))
            .oqp(spread(&through)),
    );
    Ok(())
}

/// Each client keeps its offered number of requests in flight until
/// `duration` passes; completions per client, and failures.
async fn offer(addr: std::net::SocketAddr, duration: Duration) -> anyhow::Result<(Vec<f64>, u64)> {
    let mut conns = Vec::new();
    for (client, offered) in OFFERED.iter().enumerate() {
        for _ in 0..*offered {
            conns.push((client, Conn::open(addr).await?));
        }
    }
    let deadline = Instant::now() + duration;
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|(client, mut conn)| {
            let request = generate(&fair_key(client));
            tokio::spawn(async move {
                let (mut done, mut failed) = (0u64, 0u64);
                while Instant::now() < deadline {
                    match conn.send(&request).await {
                        // Count only answers that finished inside the window.
                        Ok(answer) if answer.status.is_success() => {
                            if Instant::now() <= deadline {
                                done += 1;
                            }
                        }
                        _ => failed += 1,
                    }
                }
                (client, done, failed)
            })
        })
        .collect();
    let mut shares = vec![0.0; OFFERED.len()];
    let mut failed = 0;
    for task in tasks {
        let (client, done, task_failed) = task.await?;
        shares[client] += done as f64;
        failed += task_failed;
    }
    Ok((shares, failed))
}
