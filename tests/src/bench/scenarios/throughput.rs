//! Saturation throughput and work conservation.
//!
//! - Saturation: a fixed number of connections send back to back for a
//!   fixed time, to each target in turn (the order rotating every round),
//!   on the metadata fast path (`GET /api/tags`) and on the queued path
//!   (a non-streamed generate through oqp's dispatcher), against the fast
//!   upstream (`bench::upstream`: canned answers at once), which must do at
//!   least twice what the minimal proxy does for the rows to measure the
//!   proxies rather than the upstream; each run says whether it did.
//! - Work conservation: an upstream with P slots and D ms of service time
//!   can do at most P/D requests a second; a proxy that queues must keep it
//!   that busy. Achieved ÷ (P/D), with more clients than slots.

use std::time::Duration;

use super::{Target, Trio, USER_KEY, generate, seconds, size, tags};
use crate::bench::load::{self, Req};
use crate::bench::procs::FakeSpec;
use crate::bench::report::{self, Report, Row};
use crate::bench::stats::Spread;
use crate::bench::{
    Bench, SCENARIO_SATURATION_FAST, SCENARIO_SATURATION_QUEUED, SCENARIO_WORK_CONSERVATION,
};

/// The fast path's target, as a fraction of the minimal proxy.
const FAST_PATH_TARGET: f64 = 0.8;
/// The queued path's target, as a fraction of the minimal proxy.
const QUEUED_PATH_TARGET: f64 = 0.6;
/// How much faster than the minimal proxy the upstream must be.
const UPSTREAM_HEADROOM: f64 = 2.0;
/// The work-conservation target.
const CONSERVATION_TARGET: f64 = 0.98;

/// Per-target rates of each round.
#[derive(Debug, Default)]
struct Rates {
    rounds: [Vec<f64>; 3],
    failed: u64,
    connections: usize,
}

/// Saturation of both paths.
pub async fn run_saturation(bench: &Bench, report: &mut Report) -> anyhow::Result<()> {
    let trio = Trio::start_fast(bench, 64).await?;
    let result = async {
        let fast = saturate(bench, &trio, &tags(USER_KEY)).await?;
        rows(report, SCENARIO_SATURATION_FAST, &fast, FAST_PATH_TARGET);
        let queued = saturate(bench, &trio, &generate(USER_KEY)).await?;
        rows(
            report,
            SCENARIO_SATURATION_QUEUED,
            &queued,
            QUEUED_PATH_TARGET,
        );
        anyhow::Ok(())
    }
    .await;
    trio.stop().await;
    result
}

async fn saturate(bench: &Bench, trio: &Trio, request: &Req) -> anyhow::Result<Rates> {
    let connections = size(bench, 32, 4);
    let duration = seconds(bench, 2.0, 0.2);
    let mut rates = Rates {
        connections,
        ..Rates::default()
    };
    for target in Target::ALL {
        load::warm_up(trio.addr(target), request, size(bench, 200, 5)).await?;
    }
    for round in 0..bench.rounds.min(3) {
        for target in Target::rotated(round) {
            let rate = load::closed_loop(trio.addr(target), request, connections, duration).await?;
            rates.rounds[target.index()].push(rate.per_second());
            rates.failed += rate.failed;
        }
    }
    Ok(rates)
}

fn rows(report: &mut Report, scenario: &str, rates: &Rates, target: f64) {
    let cell = |target: Target| report::rate(Spread::of(&rates.rounds[target.index()]));
    let failed = if rates.failed > 0 {
        format!(" — {} failed", rates.failed)
    } else {
        String::new()
    };
    report.push(
        Row::new(
            scenario,
            format!("requests/s, {} connections{failed}", rates.connections),
        )
        .cells(
            cell(Target::Direct),
            cell(Target::Minimal),
            cell(Target::Oqp),
        ),
    );
    let ratio = |a: Target, b: Target| {
        let per_round: Vec<f64> = rates.rounds[a.index()]
            .iter()
            .zip(&rates.rounds[b.index()])
            .map(|(a, b)| a / b)
            .collect();
        Spread::of(&per_round)
    };
    let headroom = ratio(Target::Direct, Target::Minimal);
    report.push(
        Row::new(
            scenario,
            "the upstream direct ÷ the minimal proxy (per round)",
        )
        .cells(report::ratio(headroom), String::new(), String::new())
        .target(
            &format!("upstream ≥ {UPSTREAM_HEADROOM}× minimal: the rows measure the proxies"),
            headroom.map(|r| r.median >= UPSTREAM_HEADROOM),
        ),
    );
    let of_minimal = ratio(Target::Oqp, Target::Minimal);
    report.push(
        Row::new(scenario, "ratio to the minimal proxy (per round)")
            .oqp(report::ratio(of_minimal))
            .target(
                &format!("oqp ≥ {target}× minimal"),
                of_minimal.map(|r| r.median >= target && rates.failed == 0),
            ),
    );
    report.push(
        Row::new(scenario, "ratio to direct (per round)")
            .minimal(report::ratio(ratio(Target::Minimal, Target::Direct)))
            .oqp(report::ratio(ratio(Target::Oqp, Target::Direct))),
    );
}

/// Work conservation: P slots, D ms, more clients than slots.
pub async fn run_conservation(bench: &Bench, report: &mut Report) -> anyhow::Result<()> {
    let slots = size(bench, 4, 2);
    // Long enough that the fake's timer granularity (≤ 1 ms per request)
    // stays well under the 2 % the target allows.
    let service = Duration::from_millis(size(bench, 100, 20));
    let spec = FakeSpec {
        slots,
        latency: service,
        ..FakeSpec::default()
    };
    let trio = Trio::start(bench, spec, slots as u32).await?;
    let request = generate(USER_KEY);
    let capacity = slots as f64 / service.as_secs_f64();
    let duration = seconds(bench, 3.0, 0.5);
    let clients = slots * 4;
    let mut rates = Rates::default();
    let result = async {
        for round in 0..bench.rounds.min(3) {
            for target in Target::rotated(round) {
                let rate =
                    load::closed_loop(trio.addr(target), &request, clients, duration).await?;
                rates.rounds[target.index()].push(rate.per_second() / capacity);
                rates.failed += rate.failed;
            }
        }
        anyhow::Ok(())
    }
    .await;
    trio.stop().await;
    result?;
    let cell = |target: Target| report::ratio(Spread::of(&rates.rounds[target.index()]));
    let oqp = Spread::of(&rates.rounds[Target::Oqp.index()]);
    report.push(
        Row::new(
            SCENARIO_WORK_CONSERVATION,
            format!(
                "achieved ÷ P/D (P = {slots} slots, D = {} ms, {clients} clients){}",
                service.as_millis(),
                if rates.failed > 0 {
                    format!(" — {} failed", rates.failed)
                } else {
                    String::new()
                }
            ),
        )
        .cells(
            cell(Target::Direct),
            cell(Target::Minimal),
            cell(Target::Oqp),
        )
        .target(
            &format!("oqp ≥ {CONSERVATION_TARGET}"),
            oqp.map(|r| r.median >= CONSERVATION_TARGET && rates.failed == 0),
        ),
    );
    // The fake's own overshoot (timer granularity) lowers every column
    // alike; against direct it cancels, leaving the proxy's share.
    let of_direct = |target: Target| {
        let per_round: Vec<f64> = rates.rounds[target.index()]
            .iter()
            .zip(&rates.rounds[Target::Direct.index()])
            .map(|(proxied, direct)| proxied / direct)
            .collect();
        report::ratio(Spread::of(&per_round))
    };
    report.push(
        Row::new(
            SCENARIO_WORK_CONSERVATION,
            "achieved ÷ direct's achieved, per round (the fake's own overhead cancels)",
        )
        .minimal(of_direct(Target::Minimal))
        .oqp(of_direct(Target::Oqp)),
    );
    Ok(())
}
