//! Usage reports with many users, in process (no proxy involved): the control plane's
//! `UsageStore` with 100,000 users of 10 apps (10,000 each, the most an app keeps apart in
//! an hour) in the current hour, each with a per-user token budget. Measured: applying the
//! report whose batch carries all 100,000 rows; then the cost of every later report of one
//! row (applying and appending it, and the ack's budgets and today's figures); and the
//! memory the hour takes per user (the process's resident set before and after). Then 30
//! past days of 2,000 users an hour (the same users each hour), written through the store
//! as the reports came: the usage files on disk, the start that loads them, and a later
//! report whose ack carries a per-user budget over all those days (past days keep each
//! user once a day).

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
    let per_hour: usize = size(bench, 2_000, 100);
    let days: i64 = size(bench, 30, 3);
    let past = tokio::task::spawn_blocking(move || past_days(per_hour, days)).await??;
    let what = format!("{days} past days of {per_hour} users an hour");
    report.push(
        Row::new(SCENARIO_USAGE, format!("{what}: MB of usage files"))
            .oqp(format!("{:.1}", past.file_bytes as f64 / 1e6)),
    );
    report.push(
        Row::new(SCENARIO_USAGE, format!("{what}: ms to load them at start"))
            .oqp(format!("{:.0}", past.load.as_secs_f64() * 1e3)),
    );
    report.push(
        Row::new(
            SCENARIO_USAGE,
            format!(
                "{what}: each later report (1 row, user budgets over all those days): ms to apply, save and ack"
            ),
        )
        .oqp(format!("{:.2}", past.later.as_secs_f64() * 1e3)),
    );
    Ok(())
}

struct Past {
    file_bytes: u64,
    load: Duration,
    later: Duration,
}

/// `days` past days of `per_hour` users an hour, reported hour by hour as a data plane
/// would, then loaded by a fresh start and reported to once more.
fn past_days(per_hour: usize, days: i64) -> anyhow::Result<Past> {
    let dir = tempfile::tempdir()?;
    let now = SystemTime::now();
    let today = oqp_controlplane::usage::unix_s(now).div_euclid(86_400);
    let first = (today - days) * 86_400;
    let at = |seconds: i64| std::time::UNIX_EPOCH + Duration::from_secs(seconds.unsigned_abs());
    let epoch = u64::try_from(first).unwrap_or(0) * 1000;
    let store =
        UsageStore::load(dir.path(), at(first)).map_err(|error| anyhow::anyhow!("{error}"))?;
    let rows: Vec<wire::UsageRow> = (0..per_hour)
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
    let mut seq = 0;
    for hour in 0..days * 24 {
        seq += 1;
        let batch = wire::UsageBatch {
            epoch,
            seq,
            rows: rows.clone(),
        };
        let kept = store.apply("bench", Some(&batch), 1 << 20, at(first + hour * 3600 + 60));
        anyhow::ensure!(kept == seq, "batch {seq} was not applied");
    }
    drop(store);
    let file_bytes = std::fs::read_dir(dir.path().join("usage"))?
        .flatten()
        .filter_map(|entry| entry.metadata().ok())
        .map(|meta| meta.len())
        .sum();
    let started = Instant::now();
    let store = UsageStore::load(dir.path(), now).map_err(|error| anyhow::anyhow!("{error}"))?;
    let load = started.elapsed();
    let clients: Vec<wire::Client> = (0..APPS)
        .map(|app| wire::Client {
            client_id: format!("app-{app}"),
            users: Some(wire::Users {
                budget: Some(wire::Budget {
                    tokens: 1_000_000,
                    // From the first past day on: a window one day longer, anchored there.
                    window_seconds: u64::try_from(days + 1).unwrap_or(1) * 86_400,
                    window: format!("{}d", days + 1),
                    window_anchor_unix_s: first,
                    ..wire::Budget::default()
                }),
                ..wire::Users::default()
            }),
            ..wire::Client::default()
        })
        .collect();
    let rounds = 5;
    let started = Instant::now();
    for _ in 0..rounds {
        seq += 1;
        let batch = wire::UsageBatch {
            epoch,
            seq,
            rows: rows[..1].to_vec(),
        };
        let at = SystemTime::now();
        store.apply("bench", Some(&batch), 1 << 20, at);
        let _ = store.exceeded(&clients, at);
        let budgets = store.budgets(&clients, at);
        anyhow::ensure!(!budgets.is_empty(), "no ack figures");
    }
    Ok(Past {
        file_bytes,
        load,
        later: started.elapsed() / rounds,
    })
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
