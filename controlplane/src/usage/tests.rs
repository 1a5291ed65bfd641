#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oqp_proto::policy::v1 as wire;

use super::*;

// 2026-12-02 06:12:42 UTC.
const NOW: u64 = 1_796_191_962;
const SECOND: u64 = 1_000_000_000;
/// Enough slots that no batch here is bounded.
const SLOTS: u64 = 4;

fn at(unix_s: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(unix_s)
}

fn batch(seq: u64, client: &str, seconds: u64) -> wire::UsageBatch {
    wire::UsageBatch {
        epoch: 1,
        seq,
        rows: vec![wire::UsageRow {
            client_id: client.to_owned(),
            model: "llama3".to_owned(),
            gpu_ns: seconds * SECOND,
            prompt_tokens: 3,
            completion_tokens: 4,
            requests: 1,
            ..wire::UsageRow::default()
        }],
    }
}

fn budgeted(gpu_seconds: u64) -> wire::Client {
    wire::Client {
        client_id: "batch".to_owned(),
        budget: Some(wire::Budget {
            gpu_ns: gpu_seconds * SECOND,
            tokens: 0,
            window_seconds: 86_400,
            window_anchor_unix_s: 0,
            window: "1d".to_owned(),
            used: None,
            usd: 0.0,
        }),
        ..wire::Client::default()
    }
}

#[test]
fn totals_survive_a_restart_and_resent_batches_count_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = UsageStore::load(dir.path(), at(NOW)).unwrap();
    assert_eq!(
        store.apply("box", Some(&batch(1, "batch", 5)), SLOTS, at(NOW)),
        1
    );
    assert_eq!(store.apply("box", None, SLOTS, at(NOW)), 0);
    drop(store);
    let store = UsageStore::load(dir.path(), at(NOW + 1)).unwrap();
    // The batch the node resends after the restart (its ack was lost) is acknowledged,
    // not counted again.
    assert_eq!(
        store.apply("box", Some(&batch(1, "batch", 5)), SLOTS, at(NOW + 1)),
        1
    );
    let used = store.used("batch", budgeted(10).budget.as_ref().unwrap(), at(NOW + 1));
    assert_eq!(used.gpu_ns, 5 * SECOND);
    assert_eq!(used.tokens, 7);
    assert_eq!(used.window_start_unix_s, 1_796_169_600);
    let today = store.today(at(NOW + 1));
    assert_eq!(today.len(), 1);
    assert_eq!(today[0].requests, 1);
}

#[test]
fn an_exceeded_budget_is_announced_once_per_window() {
    let dir = tempfile::tempdir().unwrap();
    let store = UsageStore::load(dir.path(), at(NOW)).unwrap();
    let clients = [budgeted(10)];
    store.apply("box", Some(&batch(1, "batch", 9)), SLOTS, at(NOW));
    assert!(store.exceeded(&clients, at(NOW)).is_empty());
    store.apply("box", Some(&batch(2, "batch", 2)), SLOTS, at(NOW));
    let notices = store.exceeded(&clients, at(NOW));
    assert_eq!(notices.len(), 1);
    let body = notices[0].to_json();
    assert_eq!(body["event"], "client.budget_exceeded");
    assert_eq!(body["client_id"], "batch");
    assert_eq!(
        body["budget"],
        serde_json::json!({"gpu_seconds": 10.0, "window": "1d"})
    );
    assert_eq!(body["used"], serde_json::json!({"gpu_seconds": 11.0}));
    assert_eq!(body["resets_at"], "2026-12-03T00:00:00Z");
    store.apply("box", Some(&batch(3, "batch", 2)), SLOTS, at(NOW));
    assert!(
        store.exceeded(&clients, at(NOW)).is_empty(),
        "once per window"
    );
    // The next day is a new window: nothing used there yet.
    assert!(store.exceeded(&clients, at(NOW + 86_400)).is_empty());
}

#[test]
fn queries_cover_whole_hours_of_the_period() {
    let dir = tempfile::tempdir().unwrap();
    let store = UsageStore::load(dir.path(), at(NOW)).unwrap();
    store.apply(
        "box",
        Some(&batch(1, "batch", 5)),
        SLOTS,
        at(NOW - 3 * 86_400),
    );
    store.apply("box", Some(&batch(2, "chat", 2)), SLOTS, at(NOW));
    store.apply("box", Some(&batch(3, "batch", 1)), SLOTS, at(NOW));
    let request = |since_seconds| api::GetUsageRequest {
        since_seconds,
        by_client: true,
        by_model: false,
    };
    let day = store.query(&request(0), at(NOW));
    let clients: Vec<(&str, u64)> = day
        .rows
        .iter()
        .map(|row| (row.client_id.as_str(), row.gpu_ns / SECOND))
        .collect();
    assert_eq!(clients, [("chat", 2), ("batch", 1)]);
    assert_eq!(day.total.unwrap().gpu_ns, 3 * SECOND);
    assert_eq!(day.since_unix_s, (NOW as i64 - 86_400) / 3600 * 3600);
    let week = store.query(&request(7 * 86_400), at(NOW));
    assert_eq!(week.rows[0].client_id, "batch");
    assert_eq!(week.rows[0].gpu_ns, 6 * SECOND);
}

#[test]
fn without_a_state_directory_totals_stay_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("not-there");
    let store = UsageStore::load(&missing, at(NOW)).unwrap();
    assert_eq!(
        store.apply("box", Some(&batch(1, "batch", 5)), SLOTS, at(NOW)),
        1
    );
    assert_eq!(store.today(at(NOW))[0].gpu_ns, 5 * SECOND);
    assert!(!missing.exists(), "no directory created");
}

#[test]
fn an_announcement_is_not_repeated_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let clients = [budgeted(10)];
    let store = UsageStore::load(dir.path(), at(NOW)).unwrap();
    store.apply("box", Some(&batch(1, "batch", 11)), SLOTS, at(NOW));
    assert_eq!(store.exceeded(&clients, at(NOW)).len(), 1);
    drop(store);
    let store = UsageStore::load(dir.path(), at(NOW + 5)).unwrap();
    assert!(store.exceeded(&clients, at(NOW + 5)).is_empty());
}

#[test]
fn a_batch_whose_day_file_cannot_be_written_is_not_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let store = UsageStore::load(dir.path(), at(NOW)).unwrap();
    // `usage` a plain file: no day file can be written under it (even as root).
    let usage_dir = file::dir(dir.path());
    std::fs::write(&usage_dir, b"in the way").unwrap();
    assert_eq!(
        store.apply("box", Some(&batch(1, "batch", 5)), SLOTS, at(NOW)),
        0
    );
    // Resent: still not written, not acknowledged, and counted once.
    assert_eq!(
        store.apply("box", Some(&batch(1, "batch", 5)), SLOTS, at(NOW)),
        0
    );
    assert_eq!(store.today(at(NOW))[0].gpu_ns, 5 * SECOND);
    // The directory back: the resent batch is written and acknowledged, still once.
    std::fs::remove_file(&usage_dir).unwrap();
    assert_eq!(
        store.apply("box", Some(&batch(1, "batch", 5)), SLOTS, at(NOW)),
        1
    );
    assert_eq!(store.today(at(NOW))[0].gpu_ns, 5 * SECOND);
    drop(store);
    let store = UsageStore::load(dir.path(), at(NOW + 1)).unwrap();
    assert_eq!(
        store.today(at(NOW + 1))[0].gpu_ns,
        5 * SECOND,
        "kept on disk"
    );
}

#[test]
fn a_batch_from_an_earlier_epoch_of_a_node_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = UsageStore::load(dir.path(), at(NOW)).unwrap();
    let from = |epoch: u64, seq: u64| wire::UsageBatch {
        epoch,
        ..batch(seq, "batch", 5)
    };
    assert_eq!(store.apply("box", Some(&from(2_000, 1)), SLOTS, at(NOW)), 1);
    // The earlier run's batch arrives late: not applied, not acknowledged.
    assert_eq!(store.apply("box", Some(&from(1_000, 4)), SLOTS, at(NOW)), 0);
    assert_eq!(store.today(at(NOW))[0].gpu_ns, 5 * SECOND);
    // Still refused after a restart (the epoch is kept with the totals).
    drop(store);
    let store = UsageStore::load(dir.path(), at(NOW + 1)).unwrap();
    assert_eq!(
        store.apply("box", Some(&from(1_000, 5)), SLOTS, at(NOW + 1)),
        0
    );
    assert_eq!(
        store.apply("box", Some(&from(3_000, 1)), SLOTS, at(NOW + 1)),
        1
    );
    assert_eq!(store.today(at(NOW + 1))[0].gpu_ns, 10 * SECOND);
}

fn app(app_budget_seconds: u64, user_budget_seconds: u64) -> wire::Client {
    let budget = |seconds: u64| wire::Budget {
        gpu_ns: seconds * SECOND,
        window_seconds: 86_400,
        window: "1d".to_owned(),
        ..wire::Budget::default()
    };
    wire::Client {
        client_id: "webui".to_owned(),
        budget: Some(budget(app_budget_seconds)),
        users: Some(wire::Users {
            header: "X-OpenWebUI-User-Id".to_owned(),
            budget: Some(budget(user_budget_seconds)),
            ..wire::Users::default()
        }),
        ..wire::Client::default()
    }
}

#[test]
fn an_apps_budget_counts_its_users_and_each_user_has_a_figure_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let store = UsageStore::load(dir.path(), at(NOW)).unwrap();
    store.apply("box", Some(&batch(1, "webui/alice", 6)), SLOTS, at(NOW));
    store.apply("box", Some(&batch(2, "webui/bob", 3)), SLOTS, at(NOW));
    store.apply("box", Some(&batch(3, "webui", 1)), SLOTS, at(NOW));
    // Another client whose name starts alike is not the app's.
    store.apply("box", Some(&batch(4, "webuix", 50)), SLOTS, at(NOW));
    let clients = [app(20, 5)];
    let budgets = store.budgets(&clients, at(NOW));
    let of = |id: &str| {
        budgets
            .iter()
            .find(|used| used.client_id == id)
            .map(|used| used.gpu_ns / SECOND)
    };
    assert_eq!(of("webui"), Some(10));
    assert_eq!(of("webui/alice"), Some(6));
    assert_eq!(of("webui/bob"), Some(3));
    assert_eq!(of("webuix"), None);
    // Alice is over her own budget and announced once, under her sub-client id; the app
    // is not over its own.
    let notices = store.exceeded(&clients, at(NOW));
    assert_eq!(notices.len(), 1);
    assert!(format!("{notices:?}").contains("webui/alice"));
    assert!(store.exceeded(&clients, at(NOW)).is_empty());
}

#[test]
fn acks_rank_users_by_the_fraction_of_their_budget_used_and_keep_everyone_over() {
    let dir = tempfile::tempdir().unwrap();
    let store = UsageStore::load(dir.path(), at(NOW)).unwrap();
    let app = wire::Client {
        client_id: "webui".to_owned(),
        users: Some(wire::Users {
            budget: Some(wire::Budget {
                gpu_ns: 0,
                tokens: 50,
                window_seconds: 86_400,
                window_anchor_unix_s: 0,
                window: "1d".to_owned(),
                used: None,
                usd: 0.0,
            }),
            ..wire::Users::default()
        }),
        ..wire::Client::default()
    };
    // 1,100 users each with a lot of GPU time and 2 tokens; one with little GPU time and
    // 41 tokens (82% of its budget), and MAX_USER_BUDGETS + 5 users over it.
    let mut rows: Vec<wire::UsageRow> = (0..1_100)
        .map(|user| wire::UsageRow {
            client_id: format!("webui/busy-{user}"),
            model: "llama3".to_owned(),
            gpu_ns: 100 * SECOND,
            prompt_tokens: 1,
            completion_tokens: 1,
            requests: 1,
            ..wire::UsageRow::default()
        })
        .collect();
    rows.push(wire::UsageRow {
        client_id: "webui/thrifty".to_owned(),
        model: "llama3".to_owned(),
        gpu_ns: 1,
        completion_tokens: 41,
        requests: 1,
        ..wire::UsageRow::default()
    });
    let over = MAX_USER_BUDGETS + 5;
    rows.extend((0..over).map(|user| wire::UsageRow {
        client_id: format!("webui/over-{user}"),
        model: "llama3".to_owned(),
        completion_tokens: 50,
        requests: 1,
        ..wire::UsageRow::default()
    }));
    let batch = wire::UsageBatch {
        epoch: 1,
        seq: 1,
        rows,
    };
    assert_eq!(store.apply("box", Some(&batch), 1 << 20, at(NOW)), 1);
    let budgets = store.budgets(std::slice::from_ref(&app), at(NOW));
    assert_eq!(budgets.len(), over, "every user over, even past the bound");
    assert!(budgets.iter().all(|used| used.tokens >= 50));
    // Under the bound, the nearest first: the thrifty user before any busy one (which a
    // ranking by GPU time left out).
    let dir = tempfile::tempdir().unwrap();
    let store = UsageStore::load(dir.path(), at(NOW)).unwrap();
    let mut batch = batch;
    batch
        .rows
        .retain(|row| !row.client_id.starts_with("webui/over-"));
    assert_eq!(store.apply("box", Some(&batch), 1 << 20, at(NOW)), 1);
    let budgets = store.budgets(&[app], at(NOW));
    assert_eq!(budgets.len(), MAX_USER_BUDGETS);
    assert_eq!(budgets[0].client_id, "webui/thrifty");
    assert_eq!(budgets[0].tokens, 41);
}

#[test]
fn batches_are_appended_to_the_days_log_not_rewritten_and_survive_a_cut_line() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let usage = dir.path().join("usage");
    let store = UsageStore::load(dir.path(), at(NOW)).unwrap();
    for seq in 1..=3 {
        assert_eq!(
            store.apply("box", Some(&batch(seq, "batch", 1)), SLOTS, at(NOW)),
            seq
        );
    }
    let log = usage.join("2026-12-02.0.jsonl");
    assert!(!usage.join("2026-12-02.json").exists(), "no day rewritten");
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(text.lines().count(), 3, "one line a batch");
    let mode = std::fs::metadata(&log).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // A crash cut the next line short: its batch (never acknowledged) is not counted.
    let mut file = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
    std::io::Write::write_all(&mut file, br#"{"hour": 6, "node": "box", "ep"#).unwrap();
    drop(store);
    let store = UsageStore::load(dir.path(), at(NOW)).unwrap();
    let budget = budgeted(100).budget.unwrap();
    assert_eq!(store.used("batch", &budget, at(NOW)).gpu_ns, 3 * SECOND);
    assert_eq!(
        store.apply("box", Some(&batch(3, "batch", 1)), SLOTS, at(NOW)),
        3,
        "a resend after the restart is acknowledged, not counted again"
    );
    assert_eq!(store.used("batch", &budget, at(NOW)).gpu_ns, 3 * SECOND);
    // A new day: its file is written whole once (generation 1), then its log continues.
    let tomorrow = NOW + 86_400;
    store.apply("box", Some(&batch(4, "batch", 1)), SLOTS, at(tomorrow));
    assert!(usage.join("2026-12-03.json").exists());
    store.apply("box", Some(&batch(5, "batch", 1)), SLOTS, at(tomorrow));
    assert!(usage.join("2026-12-03.1.jsonl").exists());
    drop(store);
    let store = UsageStore::load(dir.path(), at(tomorrow)).unwrap();
    let query = api::GetUsageRequest {
        since_seconds: 2 * 86_400,
        by_client: true,
        by_model: false,
    };
    let total = store.query(&query, at(tomorrow)).total.unwrap();
    assert_eq!(total.gpu_ns, 5 * SECOND);
    assert_eq!(total.requests, 5);
}

#[test]
fn a_past_days_users_are_kept_per_day_in_memory_and_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let day = NOW / 86_400 - 3;
    let start = day * 86_400;
    let store = UsageStore::load(dir.path(), at(start + 3600)).unwrap();
    let users = |seq: u64, rows: &[(&str, u64)]| wire::UsageBatch {
        epoch: 1,
        seq,
        rows: rows
            .iter()
            .map(|(client, seconds)| wire::UsageRow {
                client_id: (*client).to_owned(),
                model: "llama3".to_owned(),
                gpu_ns: seconds * SECOND,
                requests: 1,
                ..wire::UsageRow::default()
            })
            .collect(),
    };
    let batches = [
        (
            start + 3600,
            users(1, &[("webui/alice", 1), ("webui/bob", 2), ("webui", 1)]),
        ),
        (start + 7200, users(2, &[("webui/alice", 4)])),
        // The next day: the day before is still kept per hour (yesterday).
        (start + 86_400 + 60, users(3, &[("webui/carol", 1)])),
    ];
    for (when, batch) in &batches {
        assert_eq!(store.apply("box", Some(batch), SLOTS, at(*when)), batch.seq);
    }
    let name = log::day_name(i64::try_from(day).unwrap());
    let path = dir.path().join("usage").join(format!("{name}.json"));
    let hour_of = |client: &str| -> Vec<u64> {
        let file: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        file["hours"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|row| row["client"] == client)
            .map(|row| row["hour"].as_u64().unwrap())
            .collect()
    };
    let logs = || {
        std::fs::read_dir(dir.path().join("usage"))
            .unwrap()
            .flatten()
            .filter(|entry| {
                let name_of = entry.file_name().to_string_lossy().into_owned();
                name_of.starts_with(&name) && name_of.ends_with(".jsonl")
            })
            .count()
    };
    let alice = |store: &UsageStore| {
        store
            .lock()
            .ledger
            .users_since("webui", i64::try_from(start).unwrap())
            .get("webui/alice")
            .map(|totals| totals.gpu_ns)
    };
    assert_eq!(alice(&store), Some(5 * SECOND));
    {
        let inner = store.lock();
        let hours = inner.ledger.hours.range(day_hours(day)).count();
        assert_eq!(hours, 2, "per hour while it is today or yesterday");
    }
    // Two days later: that day's users are kept per day, under its last hour, in memory
    // and in its file, which holds its logs (removed); the app's own hours stay.
    let later = start + 2 * 86_400 + 60;
    assert_eq!(
        store.apply(
            "box",
            Some(&users(4, &[("webui/dave", 1)])),
            SLOTS,
            at(later)
        ),
        4
    );
    assert_eq!(alice(&store), Some(5 * SECOND));
    assert_eq!(hour_of("webui/alice"), [23]);
    assert_eq!(hour_of("webui/bob"), [23]);
    assert_eq!(hour_of("webui"), [1]);
    assert_eq!(logs(), 0);
    {
        let inner = store.lock();
        let hour = &inner.ledger.hours[&(i64::try_from(day).unwrap() * 24 + 1)];
        assert!(hour.clients.keys().all(|client| !client.contains('/')));
        assert_eq!(hour.apps["webui"].total.gpu_ns, 4 * SECOND);
    }
    let query = api::GetUsageRequest {
        since_seconds: 7 * 86_400,
        by_client: true,
        ..api::GetUsageRequest::default()
    };
    let before = store.query(&query, at(later));
    // A restart loads the same figures (nothing counted twice from the removed logs).
    drop(store);
    let store = UsageStore::load(dir.path(), at(later + 1)).unwrap();
    assert_eq!(store.query(&query, at(later)), before);
    assert_eq!(alice(&store), Some(5 * SECOND));
}

/// The hours of `day` (Unix days), for a range of the ledger.
fn day_hours(day: u64) -> std::ops::RangeInclusive<i64> {
    let day = i64::try_from(day).unwrap();
    day * 24..=day * 24 + 23
}

#[test]
fn a_directory_with_past_days_per_hour_is_kept_per_day_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let day = NOW / 86_400 - 5;
    let start = day * 86_400;
    // Written as before days were kept per day: a control plane stopped that day.
    let store = UsageStore::load(dir.path(), at(start)).unwrap();
    for (seq, hour) in [(1, 3), (2, 4)] {
        let batch = batch(seq, "webui/alice", 1);
        assert_eq!(
            store.apply("box", Some(&batch), SLOTS, at(start + hour * 3600)),
            seq
        );
    }
    drop(store);
    let store = UsageStore::load(dir.path(), at(NOW)).unwrap();
    let inner = store.lock();
    let user_hours: Vec<i64> = inner
        .ledger
        .hours
        .range(day_hours(day))
        .filter(|(_, hour)| hour.clients.contains_key("webui/alice"))
        .map(|(hour, _)| *hour)
        .collect();
    assert_eq!(user_hours, [i64::try_from(day).unwrap() * 24 + 23]);
    assert_eq!(
        inner.ledger.client_since("webui/alice", 0).gpu_ns,
        2 * SECOND
    );
    drop(inner);
    let name = log::day_name(i64::try_from(day).unwrap());
    let logs = std::fs::read_dir(dir.path().join("usage"))
        .unwrap()
        .flatten()
        .filter(|entry| {
            let file = entry.file_name().to_string_lossy().into_owned();
            file.starts_with(&name) && file.ends_with(".jsonl")
        })
        .count();
    assert_eq!(logs, 0, "the rewritten day file holds its logs");
}

#[test]
fn acks_and_announcements_carry_at_most_the_users_an_app_keeps_apart() {
    let dir = tempfile::tempdir().unwrap();
    let store = UsageStore::load(dir.path(), at(NOW)).unwrap();
    let app = wire::Client {
        client_id: "webui".to_owned(),
        users: Some(wire::Users {
            budget: Some(wire::Budget {
                tokens: 50,
                window_seconds: 86_400,
                window: "1d".to_owned(),
                ..wire::Budget::default()
            }),
            ..wire::Users::default()
        }),
        ..wire::Client::default()
    };
    // Every user over its budget, in two hours of the same daily window: more users over
    // it than an hour keeps apart, each kept (each hour under the cap).
    let cap = ledger::MAX_USERS_PER_APP_HOUR;
    let over = |users: std::ops::Range<usize>, seq: u64| wire::UsageBatch {
        epoch: 1,
        seq,
        rows: users
            .map(|user| wire::UsageRow {
                client_id: format!("webui/user-{user}"),
                model: "llama3".to_owned(),
                completion_tokens: 60,
                requests: 1,
                ..wire::UsageRow::default()
            })
            .collect(),
    };
    let first_hour = NOW - NOW % 3600;
    assert_eq!(
        store.apply(
            "box",
            Some(&over(0..cap, 1)),
            1 << 20,
            at(first_hour - 3600)
        ),
        1
    );
    assert_eq!(
        store.apply("box", Some(&over(cap..cap + 5, 2)), 1 << 20, at(NOW)),
        2
    );
    let budgets = store.budgets(std::slice::from_ref(&app), at(NOW));
    assert_eq!(
        budgets.len(),
        cap,
        "an ack's users over their budget are bounded"
    );
    let notices = store.exceeded(std::slice::from_ref(&app), at(NOW));
    assert_eq!(
        notices.len(),
        cap,
        "announcements per app and window are bounded"
    );
    assert_eq!(store.lock().ledger.announced.len(), cap);
    assert!(store.exceeded(&[app], at(NOW)).is_empty());
}
