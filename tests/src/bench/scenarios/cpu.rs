//! CPU cost at a fixed rate: requests are sent at a steady rate (open loop),
//! and the proxy process's user + system time (`/proc/<pid>/stat`) over the
//! run is divided by its length and scaled to 1,000 requests a second. The
//! result is the share of one core that 1k req/s costs.

use std::time::Duration;

use super::{Target, Trio, USER_KEY, generate, seconds, size, tags};
use crate::bench::load::{self, Req};
use crate::bench::procs::{FakeSpec, Proc};
use crate::bench::report::{Report, Row};
use crate::bench::stats::Spread;
use crate::bench::{Bench, SCENARIO_CPU};

/// Runs both paths and adds the rows.
pub async fn run(bench: &Bench, report: &mut Report) -> anyhow::Result<()> {
    let trio = Trio::start(bench, FakeSpec::default(), 64).await?;
    let result = async {
        for (name, request) in [
            ("GET /api/tags", tags(USER_KEY)),
            ("non-streamed generate", generate(USER_KEY)),
        ] {
            let (per_second, minimal, oqp, failed) = measure(bench, &trio, &request).await?;
            let failed = if failed > 0 {
                format!(" — {failed} failed")
            } else {
                String::new()
            };
            report.push(
                Row::new(
                    SCENARIO_CPU,
                    format!("{name} at {per_second} req/s: % of one core per 1k req/s{failed}"),
                )
                .minimal(percent(Spread::of(&minimal)))
                .oqp(percent(Spread::of(&oqp))),
            );
        }
        anyhow::Ok(())
    }
    .await;
    trio.stop().await;
    result
}

async fn measure(
    bench: &Bench,
    trio: &Trio,
    request: &Req,
) -> anyhow::Result<(u32, Vec<f64>, Vec<f64>, u64)> {
    let per_second = size(bench, 1000, 200);
    let duration = seconds(bench, 4.0, 0.5);
    let rounds = bench.rounds.min(2);
    let (mut minimal, mut oqp, mut failed) = (Vec::new(), Vec::new(), 0);
    for round in 0..rounds {
        let order = if round % 2 == 0 {
            [Target::Minimal, Target::Oqp]
        } else {
            [Target::Oqp, Target::Minimal]
        };
        for target in order {
            let proc = match target {
                Target::Oqp => &trio.oqp,
                _ => &trio.minimal,
            };
            let (share, rate_failed) =
                cpu_share(proc, trio, target, request, per_second, duration).await?;
            failed += rate_failed;
            let per_1k = share / (f64::from(per_second) / 1000.0);
            match target {
                Target::Oqp => oqp.push(per_1k),
                _ => minimal.push(per_1k),
            }
        }
    }
    Ok((per_second, minimal, oqp, failed))
}

/// The share of one core `proc` used while `target` was driven at
/// `per_second` for `duration`.
async fn cpu_share(
    proc: &Proc,
    trio: &Trio,
    target: Target,
    request: &Req,
    per_second: u32,
    duration: Duration,
) -> anyhow::Result<(f64, u64)> {
    let before = proc.cpu_time().unwrap_or_default();
    let rate = load::open_loop(trio.addr(target), request, per_second, duration).await?;
    let used = proc.cpu_time().unwrap_or_default().saturating_sub(before);
    Ok((used.as_secs_f64() / rate.elapsed.as_secs_f64(), rate.failed))
}

fn percent(spread: Option<Spread>) -> String {
    spread.map_or_else(crate::bench::report::na, |s| {
        if s.min == s.max {
            format!("{:.1} %", s.median * 100.0)
        } else {
            format!(
                "{:.1} % ({:.1}–{:.1})",
                s.median * 100.0,
                s.min * 100.0,
                s.max * 100.0
            )
        }
    })
}
