//! Usage reports with many users, in process (no proxy involved): the control plane's
//! `UsageStore` with 100,000 users of 10 apps (10,000 each, the most an app keeps apart in
//! an hour) in the current hour, each with a per-user token budget. Measured: applying the
//! report whose batch carries all 100,000 rows; then the cost of every later report of one
//! row (applying and appending it, and the ack's budgets and today's figures); and the
//! memory the hour takes per user (the process's resident set before and after).

use std::time::{Duration, Instant, SystemTime};

use oqp_controlplane::usage::UsageStore;
use oqp_proto::policy::v1 as wire;

use super::size;
use crate::bench::report::{Report, Row};
use crate::bench::{Bench, SCENARIO_USAGE};

const APPS: usize = 10;

/// Runs it and adds the rows.
pub async fn run(bench: &Bench, report: &mut Report) -> anyhow::Result<()> {
    let users: usize = size(bench, 100_000, 10_000);
    let rounds: u64 = size(bench, 50, 5);
    let measured = tokio::task::spawn_blocking(move || measure(users, rounds)).await??;
    report.push(
        Row::new(
            SCENARIO_USAGE,
            format!("a report carrying {users} users' rows: ms to apply and save"),
        )
        .oqp(format!("{:.0}", measured.first.as_secs_f64() * 1e3)),
    );
    report.push(
        Row::new(
            SCENARIO_USAGE,
            format!(
                "each later report (1 row) with {users} users this hour: ms to apply, save and \
                 ack"
            ),
        )
        .oqp(format!("{:.2}", measured.later.as_secs_f64() * 1e3)),
    );
    report.push(
        Row::new(
            SCENARIO_USAGE,
            format!("memory of an hour with {users} users: bytes per user"),
        )
        .oqp(
            measured
                .bytes_per_user
                .map_or_else(crate::bench::report::na, |bytes| format!("{bytes:.0}")),
        ),
    );
    Ok(())
}

struct Measured {
    first: Duration,
    later: Duration,
    bytes_per_user: Option<f64>,
}

fn measure(users: usize, rounds: u64) -> anyhow::Result<Measured> {
    let dir = tempfile::tempdir()?;
    let now = SystemTime::now();
    let store = UsageStore::load(dir.path(), now).map_err(|error| anyhow::anyhow!("{error}"))?;
    let clients: Vec<wire::Client> = (0..APPS)
        .map(|app| wire::Client {
            client_id: format!("app-{app}"),
            users: Some(wire::Users {
                budget: Some(wire::Budget {
                    tokens: 1_000_000,
                    window_seconds: 86_400,
                    window: "1d".to_owned(),
                    ..wire::Budget::default()
                }),
                ..wire::Users::default()
            }),
            ..wire::Client::default()
        })
        .collect();
    let epoch = oqp_dataplane::usage::epoch_of(now) - 60_000;
    let rows = (0..users)
        .map(|user| wire::UsageRow {
            client_id: format!("app-{}/user-{user:06}", user % APPS),
            model: "llama3".to_owned(),
            gpu_ns: 1_000_000,
            prompt_tokens: 10,
            completion_tokens: 20,
            requests: 1,
            ..wire::UsageRow::default()
        })
        .collect();
    let before = resident_bytes();
    let started = Instant::now();
    let seq = store.apply(
        "bench",
        Some(&wire::UsageBatch {
            epoch,
            seq: 1,
            rows,
        }),
        1 << 20,
        SystemTime::now(),
    );
    let first = started.elapsed();
    anyhow::ensure!(seq == 1, "the batch was not applied");
    let bytes_per_user = resident_bytes()
        .zip(before)
        .map(|(after, before)| after.saturating_sub(before) as f64 / users as f64);
    let started = Instant::now();
    for seq in 2..rounds + 2 {
        let row = wire::UsageRow {
            client_id: format!("app-{}/user-{:06}", seq as usize % APPS, seq),
            model: "llama3".to_owned(),
            gpu_ns: 1_000_000,
            completion_tokens: 1,
            requests: 1,
            ..wire::UsageRow::default()
        };
        let at = SystemTime::now();
        store.apply(
            "bench",
            Some(&wire::UsageBatch {
                epoch,
                seq,
                rows: vec![row],
            }),
            1 << 20,
            at,
        );
        let _ = store.exceeded(&clients, at);
        let budgets = store.budgets(&clients, at);
        let today = store.today(at);
        anyhow::ensure!(!budgets.is_empty() && !today.is_empty(), "no ack figures");
    }
    let later = started.elapsed() / u32::try_from(rounds).unwrap_or(1);
    Ok(Measured {
        first,
        later,
        bytes_per_user,
    })
}

/// This process's resident set, from `/proc/self/statm` (Linux).
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}
