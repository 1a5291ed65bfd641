use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oqp_proto::policy::v1 as wire;

use super::*;
use crate::policy::{Client, Policy, Scope, UsageBudget, Used};
use crate::scheduler::Tier;

// 2026-12-02 06:12:42 UTC.
const NOW: i64 = 1_796_191_962;
const DAY_START: i64 = 1_796_169_600;
const SECOND: u64 = 1_000_000_000;

fn at(unix_s: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(unix_s.unsigned_abs())
}

fn usage() -> Usage {
    let policy = Policy::try_from(crate::policy::minimal_wire()).unwrap();
    Usage::new(Arc::new(Metrics::new(&policy)))
}

fn gpu(seconds: u64) -> Totals {
    Totals {
        gpu_ns: seconds * SECOND,
        prompt_tokens: 10,
        completion_tokens: 20,
        requests: 1,
        ..Totals::default()
    }
}

fn client(budget: Option<UsageBudget>) -> Client {
    Client {
        id: Arc::from("batch"),
        key_digest: Some([0; 32]),
        scope: Scope::Inference,
        max_priority: Tier::Low,
        default_priority: Tier::Low,
        max_concurrent: 0,
        weight: 1.0,
        max_queued: 0,
        description: String::new(),
        expires: None,
        budget,
        models: None,
        users: None,
        tls_subject: None,
        rate_limit: None,
        capture: None,
    }
}

fn daily(gpu_seconds: u64, tokens: u64, used: Used) -> UsageBudget {
    UsageBudget {
        gpu_ns: gpu_seconds * SECOND,
        tokens,
        usd_micros: 0,
        window_seconds: 86_400,
        anchor_unix_s: 0,
        window: "1d".into(),
        used,
    }
}

fn ack(seq: u64, budgets: Vec<wire::BudgetUsed>) -> wire::ReportAck {
    wire::ReportAck {
        usage_seq: seq,
        budgets,
        ..wire::ReportAck::default()
    }
}

#[test]
fn a_batch_is_resent_unchanged_until_acknowledged() {
    let usage = usage();
    assert_eq!(usage.report(), None, "nothing recorded, nothing reported");
    usage.record("batch", "llama3", gpu(2), at(NOW));
    usage.record("batch", "llama3", gpu(3), at(NOW));
    let first = usage.report().unwrap();
    assert_eq!(first.seq, 1);
    assert_eq!(first.rows.len(), 1);
    assert_eq!(first.rows[0].gpu_ns, 5 * SECOND);
    assert_eq!(first.rows[0].requests, 2);
    // Recorded while the batch is out: not in it.
    usage.record("chat", "", gpu(1), at(NOW));
    assert_eq!(usage.report().unwrap(), first, "resent unchanged");
    // An ack naming another batch changes nothing.
    usage.acked(&ack(7, vec![]), at(NOW));
    assert_eq!(usage.report().unwrap(), first);
    usage.acked(&ack(1, vec![]), at(NOW));
    let second = usage.report().unwrap();
    assert_eq!(second.seq, 2);
    assert_eq!(second.epoch, first.epoch);
    assert_eq!(second.rows[0].client_id, "chat");
    assert_eq!(second.rows[0].model, "");
    usage.acked(&ack(2, vec![]), at(NOW));
    assert_eq!(usage.report(), None);
}

#[test]
fn a_spent_gpu_budget_refuses_until_its_window_resets() {
    let usage = usage();
    let used = Used {
        window_start_unix_s: DAY_START,
        gpu_ns: 9 * SECOND,
        tokens: 0,
        usd_micros: 0,
        as_of_unix_ms: NOW * 1000,
    };
    let client = client(Some(daily(10, 0, used)));
    assert_eq!(usage.check(&client, at(NOW)), Ok(()), "9 of 10 s used");
    // This node's unacknowledged usage counts on top of the snapshot's figure.
    usage.record("batch", "llama3", gpu(1), at(NOW));
    let refused = usage.check(&client, at(NOW)).unwrap_err();
    assert_eq!(
        refused.to_string(),
        "budget exceeded: gpu_seconds 10 per 1d"
    );
    assert_eq!(refused.status(), http::StatusCode::TOO_MANY_REQUESTS);
    let reset = DAY_START + 86_400;
    assert_eq!(
        refused.retry_after(),
        Some(u64::try_from(reset - NOW).unwrap())
    );
    // The batch reported and acknowledged: the ack's figure (which has it) replaces it.
    usage.report().unwrap();
    let acked = wire::BudgetUsed {
        client_id: "batch".into(),
        window_start_unix_s: DAY_START,
        gpu_ns: 10 * SECOND,
        tokens: 30,
        usd: 0.0,
        as_of_unix_ms: NOW * 1000 + 1,
    };
    usage.acked(&ack(1, vec![acked]), at(NOW));
    assert!(usage.check(&client, at(NOW)).is_err());
    // One second before midnight: still refused, for one second.
    let refused = usage.check(&client, at(reset - 1)).unwrap_err();
    assert_eq!(refused.retry_after(), Some(1));
    // The next UTC day is a new window: admitted again, without waiting for the control
    // plane (its figures are for the old window).
    assert_eq!(usage.check(&client, at(reset)), Ok(()));
}

#[test]
fn a_token_budget_counts_prompt_and_completion_tokens() {
    let usage = usage();
    let client = client(Some(daily(0, 50, Used::default())));
    usage.record("batch", "llama3", gpu(0), at(NOW));
    assert_eq!(usage.check(&client, at(NOW)), Ok(()), "30 of 50 tokens");
    usage.record("batch", "llama3", gpu(0), at(NOW));
    assert_eq!(
        usage.check(&client, at(NOW)).unwrap_err().to_string(),
        "budget exceeded: tokens 50 per 1d"
    );
    // Other clients' usage does not count.
    let other = Client {
        id: Arc::from("other"),
        ..client.clone()
    };
    assert_eq!(usage.check(&other, at(NOW)), Ok(()));
}

#[test]
fn the_newest_figure_for_the_current_window_wins() {
    let usage = usage();
    let stale = Used {
        window_start_unix_s: DAY_START - 86_400,
        gpu_ns: 100 * SECOND,
        tokens: 0,
        usd_micros: 0,
        as_of_unix_ms: NOW * 1000 + 5,
    };
    let client = client(Some(daily(10, 0, stale)));
    assert_eq!(
        usage.check(&client, at(NOW)),
        Ok(()),
        "yesterday's figure does not count today"
    );
    let today = |gpu_ns, as_of_unix_ms| wire::BudgetUsed {
        client_id: "batch".into(),
        window_start_unix_s: DAY_START,
        gpu_ns,
        tokens: 0,
        usd: 0.0,
        as_of_unix_ms,
    };
    usage.acked(&ack(0, vec![today(11 * SECOND, NOW * 1000)]), at(NOW));
    assert!(usage.check(&client, at(NOW)).is_err());
    // A snapshot newer than the ack wins over it.
    let newer = Used::from_wire(&today(SECOND, NOW * 1000 + 10));
    let client = Client {
        budget: Some(daily(10, 0, newer)),
        ..client
    };
    assert_eq!(usage.check(&client, at(NOW)), Ok(()));
}

#[test]
fn today_adds_unacknowledged_usage_to_the_acked_figure() {
    let usage = usage();
    let row = gpu(4).to_row("batch", "");
    usage.acked(
        &wire::ReportAck {
            today: vec![row],
            ..wire::ReportAck::default()
        },
        at(NOW),
    );
    usage.record("batch", "llama3", gpu(1), at(NOW));
    let today = usage.today("batch", at(NOW));
    assert_eq!(today.gpu_ns, 5 * SECOND);
    assert_eq!(today.requests, 2);
    // Tomorrow, neither counts.
    assert_eq!(
        usage.today("batch", at(DAY_START + 86_400)),
        Totals::default()
    );
}

#[test]
fn seconds_read_as_integers_when_whole() {
    assert_eq!(seconds(7200 * SECOND), "7200");
    assert_eq!(seconds(1_500_000_000), "1.5");
    assert_eq!(seconds(1), "0");
}

#[test]
fn the_epoch_is_the_start_time_in_ms_and_grows_from_run_to_run() {
    let policy = Policy::try_from(crate::policy::minimal_wire()).unwrap();
    let metrics = Arc::new(Metrics::new(&policy));
    let started = at(NOW) + Duration::from_millis(250);
    let run = |at: SystemTime| {
        let usage = Usage::with_epoch(metrics.clone(), at);
        usage.record("chat", "", gpu(1), at);
        usage.report().unwrap().epoch
    };
    let first = run(started);
    assert_eq!(first, NOW.unsigned_abs() * 1000 + 250);
    assert!(run(started + Duration::from_millis(1)) > first);
}

#[test]
fn a_refused_batch_is_sent_again_only_after_a_growing_backoff() {
    let usage = usage();
    let start = std::time::Instant::now();
    let after = |delay: Duration| start + delay;
    usage.record("batch", "llama3", gpu(1), at(NOW));
    let batch = usage.report_at(start).unwrap();
    let refused = wire::ReportAck {
        usage_refused: "not the holder".into(),
        ..wire::ReportAck::default()
    };
    usage.acked_at(&refused, at(NOW), start);
    assert_eq!(usage.refused().as_deref(), Some("not the holder"));
    assert_eq!(usage.report_at(start), None, "backing off");
    let one = REFUSED_FIRST_DELAY;
    assert_eq!(
        usage.report_at(after(one)),
        Some(batch.clone()),
        "the same batch, again"
    );
    usage.acked_at(&refused, at(NOW), after(one));
    assert_eq!(usage.report_at(after(2 * one)), None, "the backoff doubled");
    assert!(usage.report_at(after(3 * one)).is_some());
    for _ in 0..10 {
        usage.acked_at(&refused, at(NOW), after(3 * one));
    }
    assert!(
        usage
            .report_at(after(3 * one + REFUSED_MAX_DELAY))
            .is_some(),
        "at most a minute"
    );
    // Taken at last: the backoff ends with it.
    usage.acked(&ack(batch.seq, Vec::new()), at(NOW));
    assert_eq!(usage.refused(), None);
    assert!(usage.settled());
    assert_eq!(usage.batches_sent(), 4);
}

#[test]
fn a_figure_left_out_of_the_next_ack_is_kept() {
    let usage = usage();
    let client = client(Some(daily(0, 50, Used::default())));
    let figure = |tokens, as_of_unix_ms| wire::BudgetUsed {
        client_id: "batch".into(),
        window_start_unix_s: DAY_START,
        gpu_ns: 0,
        tokens,
        usd: 0.0,
        as_of_unix_ms,
    };
    usage.acked(&ack(0, vec![figure(60, NOW * 1000)]), at(NOW));
    assert!(usage.check(&client, at(NOW)).is_err());
    // The next ack lists others nearer their budgets, not this client: it stays refused.
    usage.acked(&ack(0, Vec::new()), at(NOW + 1));
    assert!(usage.check(&client, at(NOW + 1)).is_err());
    // An older copy does not replace a newer one.
    usage.acked(&ack(0, vec![figure(10, NOW * 1000 - 1)]), at(NOW + 1));
    assert!(usage.check(&client, at(NOW + 1)).is_err());
    // Figures of windows over 30 days old are forgotten.
    usage.acked(&ack(0, Vec::new()), at(DAY_START + 31 * 86_400));
    assert!(usage.lock().used.is_empty());
}
