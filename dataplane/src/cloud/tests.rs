use std::future::Future;
use std::pin::{Pin, pin};
use std::task::{Context, Poll, Waker};

use super::*;
use crate::policy::CloudKey;

const A1: &str = "sk-alpha-account-key-one-AAA1";
const A2: &str = "sk-alpha-account-key-two-AAA2";
const B1: &str = "sk-bravo-account-key-one-BBB1";
const HOUR: Duration = Duration::from_secs(3600);

fn host(keys: &[(&str, &str)], fallback: &[&str]) -> Host {
    let uri: http::Uri = "https://ollama.com".parse().unwrap();
    Host {
        runners: Default::default(),
        engine: Default::default(),
        name: "cloud".into(),
        url: "https://ollama.com".into(),
        scheme: uri.scheme().unwrap().clone(),
        authority: uri.authority().unwrap().clone(),
        weight: 1,
        max_concurrent: 10,
        kind: HostKind::Cloud,
        healthy: true,
        installed: Default::default(),
        loaded: Default::default(),
        installed_names: Vec::new(),
        loaded_names: Vec::new(),
        last_checked: None,
        cloud_keys: keys
            .iter()
            .map(|(key, account)| CloudKey {
                key: (*key).into(),
                account: (*account).into(),
            })
            .collect(),
        cloud_accounts: Vec::new(),
        fallback_models: fallback.iter().map(|m| (*m).to_owned()).collect(),
        owner: None,
        vram: Default::default(),
    }
}

/// Accounts A (a1, a2) and B (b1).
fn two_accounts() -> Arc<KeyPool> {
    Arc::new(KeyPool::new(&host(
        &[
            (A1, "alice@example.com"),
            (A2, "alice@example.com"),
            (B1, "bob@example.com"),
        ],
        &[],
    )))
}

fn name(attempt: &Attempt) -> &'static str {
    match attempt.key() {
        A1 => "a1",
        A2 => "a2",
        B1 => "b1",
        _ => "?",
    }
}

fn next(attempts: &mut Attempts<'_>, now: Instant) -> Option<(&'static str, Attempt)> {
    attempts
        .next_key(now)
        .map(|attempt| (name(&attempt), attempt))
}

/// The keys one call would try at `now`, failing each with `Server` (which cools nothing).
fn order(pool: &KeyPool, lease: &Lease, now: Instant) -> Vec<&'static str> {
    let mut attempts = pool.attempts(lease);
    let mut out = Vec::new();
    while let Some((name, attempt)) = next(&mut attempts, now) {
        out.push(name);
        attempts.fail(&attempt, Failure::Server, now);
    }
    out
}

fn first_key(pool: &KeyPool, lease: &Lease, now: Instant) -> &'static str {
    let mut attempts = pool.attempts(lease);
    next(&mut attempts, now).map_or("none", |(name, _)| name)
}

fn poll_once<F: Future>(future: Pin<&mut F>) -> Poll<F::Output> {
    future.poll(&mut Context::from_waker(Waker::noop()))
}

/// Acquires without waiting (the choice must not be "wait").
fn lease_now(pool: &Arc<KeyPool>, model: &str) -> Lease {
    let future = pin!(pool.acquire_until(model, std::future::pending()));
    match poll_once(future) {
        Poll::Ready(lease) => lease,
        Poll::Pending => panic!("acquire for {model} waited"),
    }
}

#[test]
fn a_session_limit_cools_the_whole_account() {
    let pool = two_accounts();
    let t0 = Instant::now();
    let mut attempts = pool.attempts(&Lease::none());
    let (first, attempt) = next(&mut attempts, t0).unwrap();
    assert_eq!(first, "a1");
    let body = br#"{"error":"you (alice) have reached your session usage limit, upgrade for higher limits (ref: 1)"}"#;
    let failure = Failure::classify(http::StatusCode::TOO_MANY_REQUESTS, body).unwrap();
    attempts.fail(&attempt, failure, t0);
    // a2 shares a1's account: skipped at once.
    let (second, attempt) = next(&mut attempts, t0).unwrap();
    assert_eq!(second, "b1");
    attempts.succeed(&attempt);
    drop(attempts);

    // During the cooldown account A is never tried, and the next calls start at b1.
    for later in [
        t0 + HOUR,
        t0 + 4 * HOUR,
        t0 + 5 * HOUR - Duration::from_secs(1),
    ] {
        assert_eq!(order(&pool, &Lease::none(), later), ["b1"]);
    }
    let status = pool.snapshot_at(t0, SystemTime::UNIX_EPOCH);
    assert_eq!(status[0].last_error, Some("quota"));
    assert_eq!(status[1].last_error, None);
    assert_eq!(
        status[1].cooldown_until,
        Some(SystemTime::UNIX_EPOCH + 5 * HOUR)
    );
    assert_eq!(status[2].cooldown_until, None);

    // It comes back after the window.
    assert_eq!(
        order(&pool, &Lease::none(), t0 + 5 * HOUR),
        ["a1", "a2", "b1"]
    );
}

#[test]
fn weekly_and_hourly_windows_and_retry_after() {
    let pool = two_accounts();
    let t0 = Instant::now();
    let mut attempts = pool.attempts(&Lease::none());
    let (_, a1) = next(&mut attempts, t0).unwrap();
    attempts.fail(&a1, Failure::Quota(Window::Weekly), t0);
    let (_, b1) = next(&mut attempts, t0).unwrap();
    attempts.fail(&b1, Failure::Quota(Window::Hourly), t0);
    assert!(next(&mut attempts, t0).is_none());
    assert_eq!(
        attempts.last_failure(),
        Some(Failure::Quota(Window::Hourly))
    );
    // Nothing usable: the earliest return is b1's, in an hour.
    assert_eq!(pool.retry_after(t0), Some(HOUR));
    assert_eq!(order(&pool, &Lease::none(), t0 + HOUR), ["b1"]);
    assert_eq!(pool.retry_after(t0 + HOUR), None);
    assert_eq!(
        order(&pool, &Lease::none(), t0 + 7 * 24 * HOUR),
        ["a2", "b1", "a1"]
    );
}

#[test]
fn a_slot_timeout_tries_another_account_without_cooling() {
    let pool = two_accounts();
    let t0 = Instant::now();
    let mut attempts = pool.attempts(&Lease::none());
    let (_, a1) = next(&mut attempts, t0).unwrap();
    let body = br#"{"error":"timed out waiting for a concurrent request slot"}"#;
    let failure = Failure::classify(http::StatusCode::SERVICE_UNAVAILABLE, body).unwrap();
    assert_eq!(failure, Failure::SlotTimeout);
    attempts.fail(&a1, failure, t0);
    // Not a2 (same account, at its concurrency limit): b1.
    assert_eq!(next(&mut attempts, t0).unwrap().0, "b1");
    drop(attempts);
    // No cooldown: the next call may use account A again.
    assert_eq!(order(&pool, &Lease::none(), t0), ["a2", "b1", "a1"]);
    assert_eq!(pool.retry_after(t0), None);
    assert!(
        pool.snapshot_at(t0, SystemTime::UNIX_EPOCH)
            .iter()
            .all(|status| status.cooldown_until.is_none())
    );
}

#[test]
fn overload_backs_off_the_whole_host() {
    let pool = two_accounts();
    let t0 = Instant::now();
    let mut attempts = pool.attempts(&Lease::none());
    let (_, a1) = next(&mut attempts, t0).unwrap();
    attempts.fail(&a1, Failure::Overloaded, t0);
    assert!(next(&mut attempts, t0).is_none());
    let until = pool.host_backoff_until(t0).unwrap();
    assert_eq!(until - t0, Cooldowns::default().overloaded);
    assert_eq!(pool.retry_after(t0), Some(until - t0));
    assert!(order(&pool, &Lease::none(), until - Duration::from_millis(1)).is_empty());
    assert_eq!(order(&pool, &Lease::none(), until).len(), 3);
    assert_eq!(pool.host_backoff_until(until), None);
}

#[test]
fn a_connect_error_stops_the_call_without_blame() {
    let pool = two_accounts();
    let t0 = Instant::now();
    let mut attempts = pool.attempts(&Lease::none());
    let (_, a1) = next(&mut attempts, t0).unwrap();
    attempts.fail(&a1, Failure::Connect, t0);
    assert!(next(&mut attempts, t0).is_none());
    assert_eq!(pool.host_backoff_until(t0), None);
    assert_eq!(order(&pool, &Lease::none(), t0).len(), 3);
}

#[test]
fn auth_failures_disable_the_key_not_its_account() {
    let pool = two_accounts();
    let t0 = Instant::now();
    let mut attempts = pool.attempts(&Lease::none());
    let (_, a1) = next(&mut attempts, t0).unwrap();
    attempts.fail(&a1, Failure::Auth, t0);
    assert_eq!(next(&mut attempts, t0).unwrap().0, "a2");
    let status = pool.snapshot_at(t0, SystemTime::UNIX_EPOCH);
    assert_eq!(status[0].last_error, Some("auth"));
    assert_eq!(
        status[0].cooldown_until,
        Some(SystemTime::UNIX_EPOCH + HOUR)
    );
    assert_eq!(status[1].cooldown_until, None);
    assert_eq!(order(&pool, &Lease::none(), t0 + HOUR / 2), ["a2", "b1"]);
}

#[test]
fn rotation_state_persists_across_calls() {
    let pool = Arc::new(KeyPool::new(&host(&[(A1, ""), (A2, ""), (B1, "")], &[])));
    let t0 = Instant::now();
    let mut attempts = pool.attempts(&Lease::none());
    let (_, a1) = next(&mut attempts, t0).unwrap();
    // Unlabelled keys are each their own account: only a1 cools.
    attempts.fail(&a1, Failure::Quota(Window::Unknown), t0);
    let (second, a2) = next(&mut attempts, t0).unwrap();
    assert_eq!(second, "a2");
    attempts.succeed(&a2);
    drop(attempts);
    // The next calls start from the last healthy key, even once a1 is back.
    assert_eq!(first_key(&pool, &Lease::none(), t0), "a2");
    assert_eq!(first_key(&pool, &Lease::none(), t0 + HOUR), "a2");
    assert_eq!(order(&pool, &Lease::none(), t0 + HOUR), ["a2", "b1", "a1"]);
}

#[test]
fn a_call_never_gets_the_same_key_twice() {
    let pool = two_accounts();
    let t0 = Instant::now();
    let mut attempts = pool.attempts(&Lease::none());
    let mut seen = Vec::new();
    while let Some((name, attempt)) = next(&mut attempts, t0) {
        seen.push(name);
        attempts.fail(&attempt, Failure::Timeout, t0);
    }
    // A timeout skips the account for this call: a1, then b1.
    assert_eq!(seen, ["a1", "b1"]);
    assert_eq!(attempts.tried(), 2);
}

#[test]
fn models_bind_to_keys_on_different_accounts_and_stay() {
    let pool = two_accounts();
    let t0 = Instant::now();
    for _ in 0..5 {
        let x = lease_now(&pool, "gpt-oss:120b");
        let y = lease_now(&pool, "qwen3-coder:480b-cloud");
        assert_eq!(first_key(&pool, &x, t0), "a1");
        // Y goes to the account with no binding, not to a2 beside X.
        assert_eq!(first_key(&pool, &y, t0), "b1");
    }
    // Alone, too: the binding outlives the lease.
    let y = lease_now(&pool, "qwen3-coder:480b");
    assert_eq!(first_key(&pool, &y, t0), "b1");
    drop(y);
    let status = pool.snapshot();
    let bound: Vec<Option<&str>> = status.iter().map(|s| s.bound_model.as_deref()).collect();
    assert_eq!(
        bound,
        [Some("gpt-oss:120b"), None, Some("qwen3-coder:480b")]
    );
    assert!(status.iter().all(|s| !s.busy));
    assert_eq!(status[0].label, "alice@example.com");
}

#[test]
fn the_lease_key_goes_first_then_rotation() {
    let pool = two_accounts();
    let t0 = Instant::now();
    let _x = lease_now(&pool, "x");
    let y = lease_now(&pool, "y");
    assert_eq!(order(&pool, &y, t0), ["b1", "a2", "a1"]);
    // Plain rotation puts idle keys before leased ones.
    let pool = two_accounts();
    let _x = lease_now(&pool, "x");
    assert_eq!(order(&pool, &Lease::none(), t0), ["a2", "b1", "a1"]);
}

#[test]
fn same_model_requests_queue_for_their_key_then_fall_back() {
    let pool = two_accounts();
    let held = lease_now(&pool, "m");
    let (give_up, deadline) = tokio::sync::oneshot::channel::<()>();
    let mut waiting = pin!(pool.acquire_until("m", async {
        let _ = deadline.await;
    }));
    assert!(poll_once(waiting.as_mut()).is_pending());
    // Another model is not held up by the queue.
    assert!(lease_now(&pool, "other").is_bound());
    assert!(poll_once(waiting.as_mut()).is_pending());
    give_up.send(()).unwrap();
    match poll_once(waiting.as_mut()) {
        Poll::Ready(lease) => assert!(!lease.is_bound()),
        Poll::Pending => panic!("still waiting after the deadline"),
    }

    // A waiter gets the key as soon as it frees.
    let mut queued = pin!(pool.acquire_until("m", std::future::pending()));
    assert!(poll_once(queued.as_mut()).is_pending());
    drop(held);
    match poll_once(queued.as_mut()) {
        Poll::Ready(lease) => assert_eq!(first_key(&pool, &lease, Instant::now()), "a1"),
        Poll::Pending => panic!("not woken by the release"),
    }
}

#[test]
fn a_warm_key_is_not_stolen_a_cold_one_is() {
    let keys = [(A1, ""), (B1, "")];
    let pool = Arc::new(KeyPool::new(&host(&keys, &[])));
    drop(lease_now(&pool, "x"));
    drop(lease_now(&pool, "y"));
    // Both keys idle but warm for x and y: z uses plain rotation now, without waiting.
    assert!(!lease_now(&pool, "z").is_bound());
    let cold = Cooldowns {
        warm_for: Duration::ZERO,
        ..Cooldowns::default()
    };
    let pool = Arc::new(KeyPool::with_cooldowns(&host(&keys, &[]), cold));
    drop(lease_now(&pool, "x"));
    drop(lease_now(&pool, "y"));
    let z = lease_now(&pool, "z");
    assert_eq!(first_key(&pool, &z, Instant::now()), "a1");
}

#[test]
fn every_key_busy_waits_and_cooling_keys_are_not_leased() {
    let pool = Arc::new(KeyPool::new(&host(&[(A1, ""), (B1, "")], &[])));
    let _x = lease_now(&pool, "x");
    let _y = lease_now(&pool, "y");
    let mut waiting = pin!(pool.acquire_until("z", std::future::pending()));
    assert!(poll_once(waiting.as_mut()).is_pending());

    let pool = two_accounts();
    let t0 = Instant::now();
    let mut attempts = pool.attempts(&Lease::none());
    let (_, a1) = next(&mut attempts, t0).unwrap();
    attempts.fail(&a1, Failure::Quota(Window::Weekly), t0);
    drop(attempts);
    let lease = lease_now(&pool, "m");
    assert_eq!(first_key(&pool, &lease, t0), "b1");
    // A single key is never leased: binding could only queue requests on it.
    let single = Arc::new(KeyPool::new(&host(&[(A1, "")], &[])));
    assert!(!lease_now(&single, "m").is_bound());
}

#[tokio::test]
async fn acquire_gives_up_at_its_timeout() {
    let pool = Arc::new(KeyPool::new(&host(&[(A1, ""), (B1, "")], &[])));
    let _x = pool.acquire("x", Duration::from_secs(5)).await;
    let _y = pool.acquire("y", Duration::from_secs(5)).await;
    let lease = pool.acquire("z", Duration::ZERO).await;
    assert!(!lease.is_bound());
}

#[test]
fn state_survives_a_snapshot_update() {
    let pool = two_accounts();
    let t0 = Instant::now();
    drop(lease_now(&pool, "m"));
    let mut attempts = pool.attempts(&Lease::none());
    let (_, a1) = next(&mut attempts, t0).unwrap();
    attempts.fail(&a1, Failure::Quota(Window::Session), t0);
    drop(attempts);
    // Reordered, one key gone, one new.
    const C1: &str = "sk-charlie-account-key-CCC1";
    pool.update(&host(
        &[(B1, "bob@example.com"), (A1, "alice@example.com"), (C1, "")],
        &[],
    ));
    let status = pool.snapshot_at(t0, SystemTime::UNIX_EPOCH);
    assert_eq!(status.len(), 3);
    assert_eq!(status[1].bound_model.as_deref(), Some("m:latest"));
    assert!(status[1].cooldown_until.is_some());
    assert_eq!(status[2].label, "…CCC1");
}

#[test]
fn no_key_in_debug_or_status() {
    let pool = two_accounts();
    let t0 = Instant::now();
    let lease = lease_now(&pool, "m");
    let mut attempts = pool.attempts(&lease);
    let (_, attempt) = next(&mut attempts, t0).unwrap();
    attempts.fail(&attempt, Failure::Auth, t0);
    let printed = format!(
        "{pool:?} {attempts:?} {attempt:?} {lease:?} {:?} {:?}",
        pool.snapshot(),
        host(&[(A1, "")], &[])
    );
    for key in [A1, A2, B1] {
        assert!(!printed.contains(key), "{printed}");
        assert!(!printed.contains(&key[..20]), "{printed}");
    }
    assert!(printed.contains("…AAA1"));
}

#[test]
fn candidates_are_the_model_then_its_fallbacks() {
    let host = host(
        &[],
        &["gpt-oss:20b", "GPT-OSS:120b-cloud", "qwen3", "gpt-oss:20b"],
    );
    assert_eq!(
        candidates(&host, "gpt-oss:120b"),
        ["gpt-oss:120b", "gpt-oss:20b", "qwen3"]
    );
    assert_eq!(upstream_model("gpt-oss:120b-cloud"), "gpt-oss:120b");
}

#[test]
fn a_model_refusal_skips_the_account_for_that_model_only() {
    let pool = two_accounts();
    let t0 = Instant::now();
    let mut attempts = pool.attempts(&Lease::none()).for_model("kimi-k2:1t-cloud");
    let (first, a1) = next(&mut attempts, t0).unwrap();
    assert_eq!(first, "a1");
    attempts.fail(&a1, Failure::ModelRefused, t0);
    // alice's other key shares her subscription: bob's is next.
    assert_eq!(next(&mut attempts, t0).unwrap().0, "b1");
    assert_eq!(pool.refused_everywhere("kimi-k2:1t", t0), None);
    // No key is disabled: other models still rotate over all three.
    let status = pool.snapshot_at(t0, SystemTime::UNIX_EPOCH);
    assert!(status.iter().all(|key| key.cooldown_until.is_none()));
    let mut others = order(&pool, &Lease::none(), t0);
    others.sort_unstable();
    assert_eq!(others, ["a1", "a2", "b1"]);
    // The model itself skips alice until the refusal ends.
    let mut again = pool.attempts(&Lease::none()).for_model("kimi-k2:1t");
    assert_eq!(next(&mut again, t0).unwrap().0, "b1");
    let later = t0 + Cooldowns::default().model_refused;
    let mut after = pool.attempts(&Lease::none()).for_model("kimi-k2:1t");
    assert_ne!(next(&mut after, later).unwrap().0, "b1");
}

#[test]
fn model_refusals_are_bounded() {
    let pool = Arc::new(KeyPool::new(&host(&[(A1, ""), (B1, "")], &[])));
    let t0 = Instant::now();
    for i in 0..(MAX_REFUSALS + 10) {
        let mut attempts = pool.attempts(&Lease::none()).for_model(&format!("m{i}"));
        let (_, attempt) = next(&mut attempts, t0).unwrap();
        attempts.fail(&attempt, Failure::ModelRefused, t0);
    }
    assert!(pool.lock().refused.len() <= MAX_REFUSALS);
}

#[test]
fn an_empty_extra_balance_refuses_the_model_on_that_account_until_its_balance_changes() {
    let pool = two_accounts();
    let t0 = Instant::now();
    let mut attempts = pool.attempts(&Lease::none()).for_model("glm-5.2:cloud");
    let (first, a1) = next(&mut attempts, t0).unwrap();
    assert_eq!(first, "a1");
    attempts.fail(&a1, Failure::ExtraUsageEmpty, t0);
    // The next account is tried at once; alice's other key shares her balance.
    let (second, b1) = next(&mut attempts, t0).unwrap();
    assert_eq!(second, "b1");
    assert_eq!(pool.refused_everywhere("glm-5.2", t0), None);
    attempts.fail(&b1, Failure::ExtraUsageEmpty, t0);
    assert!(next(&mut attempts, t0).is_none());
    assert_eq!(
        pool.refused_everywhere("glm-5.2", t0),
        Some(Refusal::ExtraUsage)
    );
    // No key cools down: every key keeps serving other models.
    let status = pool.snapshot_at(t0, SystemTime::UNIX_EPOCH);
    assert!(status.iter().all(|key| key.cooldown_until.is_none()));
    assert_eq!(order(&pool, &Lease::none(), t0).len(), 3);
    assert_eq!(
        pool.refusals(t0),
        [
            (
                "alice@example.com".to_owned(),
                Arc::from("glm-5.2:latest"),
                Refusal::ExtraUsage
            ),
            (
                "bob@example.com".to_owned(),
                Arc::from("glm-5.2:latest"),
                Refusal::ExtraUsage
            ),
        ]
    );
    // Bob's balance changed: he is asked again; alice still is not.
    pool.balance_changed("bob@example.com");
    let mut again = pool.attempts(&Lease::none()).for_model("glm-5.2");
    assert_eq!(next(&mut again, t0).unwrap().0, "b1");
    assert!(next(&mut again, t0).is_none());
    // An hour on, alice is asked again too.
    let later = t0 + Cooldowns::default().extra_usage;
    assert_eq!(Cooldowns::default().extra_usage, HOUR);
    let mut after = pool.attempts(&Lease::none()).for_model("glm-5.2");
    let mut asked = vec![next(&mut after, later).unwrap().0];
    asked.extend(next(&mut after, later).map(|(name, _)| name));
    assert!(asked.contains(&"a1") || asked.contains(&"a2"), "{asked:?}");
}

#[test]
fn a_key_without_an_account_is_named_by_its_hash_when_its_balance_changes() {
    let pool = Arc::new(KeyPool::new(&host(&[(A1, ""), (B1, "")], &[])));
    let t0 = Instant::now();
    let mut attempts = pool.attempts(&Lease::none()).for_model("glm-5.2");
    let (_, first) = next(&mut attempts, t0).unwrap();
    attempts.fail(&first, Failure::ExtraUsageEmpty, t0);
    let (_, second) = next(&mut attempts, t0).unwrap();
    attempts.fail(&second, Failure::ExtraUsageEmpty, t0);
    assert_eq!(
        pool.refused_everywhere("glm-5.2", t0),
        Some(Refusal::ExtraUsage)
    );
    pool.balance_changed(&account_id_of_key(A1));
    let mut again = pool.attempts(&Lease::none()).for_model("glm-5.2");
    assert_eq!(next(&mut again, t0).unwrap().0, "a1");
    assert!(next(&mut again, t0).is_none());
    // A subscription refusal is not lifted by a balance.
    let mut attempts = pool.attempts(&Lease::none()).for_model("kimi-k2:1t");
    let (_, only) = next(&mut attempts, t0).unwrap();
    attempts.fail(&only, Failure::ModelRefused, t0);
    let (_, other) = next(&mut attempts, t0).unwrap();
    attempts.fail(&other, Failure::ModelRefused, t0);
    pool.balance_changed(&account_id_of_key(A1));
    pool.balance_changed(&account_id_of_key(B1));
    assert_eq!(
        pool.refused_everywhere("kimi-k2:1t", t0),
        Some(Refusal::Subscription)
    );
}

#[test]
fn a_changed_extra_balance_in_the_snapshot_lifts_the_accounts_402_refusals() {
    let with_extra = |extra_usd: f64| {
        let mut host = host(&[(A1, "alice"), (B1, "bob")], &[]);
        host.cloud_accounts = ["alice", "bob"]
            .iter()
            .map(|name| Account {
                account: Arc::from(*name),
                balance: Some(Balance::Credits {
                    included_usd: 20.0,
                    allowance_usd: Some(20.0),
                    extra_usd: if *name == "bob" { extra_usd } else { 0.0 },
                    resets_at: None,
                }),
                ..Account::default()
            })
            .collect();
        host
    };
    let pool = Arc::new(KeyPool::new(&with_extra(0.0)));
    let t0 = Instant::now();
    let mut attempts = pool.attempts(&Lease::none()).for_model("glm-5.2");
    while let Some(attempt) = attempts.next_key(t0) {
        attempts.fail(&attempt, Failure::ExtraUsageEmpty, t0);
    }
    assert_eq!(pool.refusals(t0).len(), 2);
    // The same balances again: nothing lifted.
    pool.update(&with_extra(0.0));
    assert_eq!(pool.refusals(t0).len(), 2);
    pool.update(&with_extra(5.0));
    let left: Vec<String> = pool.refusals(t0).into_iter().map(|(a, _, _)| a).collect();
    assert_eq!(left, ["alice"]);
}
