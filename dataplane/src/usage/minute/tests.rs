//! The buckets on time passed in: no clock is read, so every figure is exact.

use super::*;

fn limit(requests_per_minute: u32, tokens_per_minute: u64) -> MinuteLimit {
    MinuteLimit {
        requests_per_minute,
        tokens_per_minute,
    }
}

fn secs(seconds: u64) -> Duration {
    Duration::from_secs(seconds)
}

fn retry_after(result: Result<Option<Charge>, ProxyError>) -> Option<u64> {
    result.err().and_then(|error| error.retry_after())
}

#[test]
fn a_minute_of_requests_then_the_rate_with_a_true_retry_after() {
    let limits = Arc::new(MinuteLimits::default());
    let client: Arc<str> = Arc::from("batch");
    let only = || vec![(client.clone(), limit(2, 0))];
    let t0 = Instant::now();
    assert!(limits.admit(only(), &client, 0, t0).unwrap().is_some());
    limits.admit(only(), &client, 0, t0).unwrap();
    // Empty: one request comes back every 30 s.
    let refused = limits.admit(only(), &client, 0, t0).unwrap_err();
    assert_eq!(refused.retry_after(), Some(30));
    assert_eq!(refused.status(), http::StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        refused.to_string(),
        "rate limit exceeded: 2 requests per minute"
    );
    assert_eq!(
        retry_after(limits.admit(only(), &client, 0, t0 + secs(10))),
        Some(20)
    );
    // Exactly when Retry-After said.
    limits.admit(only(), &client, 0, t0 + secs(30)).unwrap();
    assert!(limits.admit(only(), &client, 0, t0 + secs(30)).is_err());
    assert_eq!(limits.refused("batch"), 3);
    // Another client has its own buckets; no limit, no bucket at all.
    let other: Arc<str> = Arc::from("other");
    limits
        .admit(vec![(other.clone(), limit(2, 0))], &other, 0, t0)
        .unwrap();
    assert!(limits.admit(Vec::new(), &other, 0, t0).unwrap().is_none());
}

#[test]
fn tokens_are_charged_from_the_estimate_and_corrected_from_the_answer() {
    let limits = Arc::new(MinuteLimits::default());
    let client: Arc<str> = Arc::from("chat");
    let only = || vec![(client.clone(), limit(0, 600))];
    let t0 = Instant::now();
    let charge = limits.admit(only(), &client, 400, t0).unwrap().unwrap();
    // 200 left, 400 wanted: 200 tokens at 10 a second.
    let refused = limits.admit(only(), &client, 400, t0).unwrap_err();
    assert_eq!(refused.retry_after(), Some(20));
    assert_eq!(
        refused.to_string(),
        "rate limit exceeded: 600 tokens per minute"
    );
    // The answer used 100 tokens in all: 300 come back.
    charge.settle(100, t0);
    let level = limits.level("chat", t0).unwrap();
    assert_eq!(level.tokens_left, 500);
    limits.admit(only(), &client, 400, t0).unwrap().unwrap();
    // An answer longer than its estimate takes the bucket below empty: the next request
    // waits until it is back to its own estimate.
    let charge = limits
        .admit(only(), &client, 100, t0 + secs(30))
        .unwrap()
        .unwrap();
    // 400 held at 30 s, 100 taken: 300; the answer used 1000: −600.
    charge.settle(1000, t0 + secs(30));
    assert_eq!(limits.level("chat", t0 + secs(30)).unwrap().tokens_left, 0);
    // From −600 to 10 tokens: 610 tokens at 10 a second.
    assert_eq!(
        retry_after(limits.admit(only(), &client, 10, t0 + secs(30))),
        Some(61)
    );
    limits.admit(only(), &client, 10, t0 + secs(91)).unwrap();
}

#[test]
fn a_prompt_larger_than_a_minute_waits_for_a_full_bucket_not_for_ever() {
    let limits = Arc::new(MinuteLimits::default());
    let client: Arc<str> = Arc::from("long");
    let only = || vec![(client.clone(), limit(0, 100))];
    let t0 = Instant::now();
    limits.admit(only(), &client, 250, t0).unwrap().unwrap();
    // −150: a full bucket again after 250 tokens at 100 a minute (150 s).
    assert_eq!(
        retry_after(limits.admit(only(), &client, 250, t0)),
        Some(150)
    );
    limits.admit(only(), &client, 250, t0 + secs(150)).unwrap();
}

#[test]
fn an_app_counts_as_a_whole_and_each_user_alone() {
    let limits = Arc::new(MinuteLimits::default());
    let app: Arc<str> = Arc::from("webui");
    let user = |name: &str| -> Arc<str> { Arc::from(format!("webui/{name}")) };
    let of = |who: &Arc<str>| {
        let mut taken = vec![(app.clone(), limit(3, 0))];
        if *who != app {
            taken.push((who.clone(), limit(1, 0)));
        }
        taken
    };
    let t0 = Instant::now();
    let (ada, bob, cy) = (user("ada"), user("bob"), user("cy"));
    limits.admit(of(&ada), &app, 0, t0).unwrap();
    // Ada's own minute is used up; 60 s until she has a request again.
    assert_eq!(retry_after(limits.admit(of(&ada), &app, 0, t0)), Some(60));
    limits.admit(of(&bob), &app, 0, t0).unwrap();
    limits.admit(of(&app), &app, 0, t0).unwrap();
    // The app's three are taken (a refusal takes nothing: Ada's refused request did not).
    assert_eq!(retry_after(limits.admit(of(&cy), &app, 0, t0)), Some(20));
    assert_eq!(limits.refused("webui"), 2);
    assert_eq!(limits.level("webui/cy", t0).unwrap().requests_left, 1);
}

#[test]
fn a_lowered_limit_lowers_what_the_buckets_hold() {
    let limits = Arc::new(MinuteLimits::default());
    let client: Arc<str> = Arc::from("batch");
    let t0 = Instant::now();
    limits
        .admit(vec![(client.clone(), limit(60, 0))], &client, 0, t0)
        .unwrap();
    assert_eq!(limits.level("batch", t0).unwrap().requests_left, 59);
    limits
        .admit(vec![(client.clone(), limit(2, 0))], &client, 0, t0)
        .unwrap();
    // 29 s of a 30 s request left: less than one whole request, and the next one is a
    // second away.
    let level = limits.level("batch", t0).unwrap();
    assert_eq!((level.requests_left, level.limit), (0, limit(2, 0)));
    assert_eq!(
        retry_after(limits.admit(vec![(client.clone(), limit(2, 0))], &client, 0, t0)),
        Some(1)
    );
}

#[test]
fn limits_of_a_caller_follow_its_key_and_its_app() {
    use crate::scheduler::Member;
    let mut wire = crate::policy::minimal_wire();
    wire.clients = vec![
        oqp_proto::policy::v1::Client {
            client_id: "webui".into(),
            key_sha256: vec![1; 32],
            rate_limit: Some(oqp_proto::policy::v1::RateLimit {
                requests_per_minute: 30,
                tokens_per_minute: 0,
            }),
            users: Some(oqp_proto::policy::v1::Users {
                header: "x-user".into(),
                rate_limit: Some(oqp_proto::policy::v1::RateLimit {
                    requests_per_minute: 0,
                    tokens_per_minute: 5000,
                }),
                ..Default::default()
            }),
            ..Default::default()
        },
        oqp_proto::policy::v1::Client {
            client_id: "free".into(),
            key_sha256: vec![2; 32],
            // All zero: no limit.
            rate_limit: Some(oqp_proto::policy::v1::RateLimit::default()),
            ..Default::default()
        },
    ];
    let policy = Policy::try_from(wire).unwrap();
    let caller = |id: &str, app: Option<&str>| Caller {
        id: Arc::from(id),
        verified: true,
        sets_keep_alive: false,
        member: app.map(|app| Member {
            app: Arc::from(app),
            limits: Default::default(),
        }),
        claims: None,
    };
    let user = limits_of(&policy, &caller("webui/ada", Some("webui")));
    assert_eq!(
        user,
        vec![
            (Arc::from("webui"), limit(30, 0)),
            (Arc::from("webui/ada"), limit(0, 5000)),
        ]
    );
    assert_eq!(
        limits_of(&policy, &caller("webui", Some("webui"))),
        vec![(Arc::from("webui"), limit(30, 0))]
    );
    assert!(limits_of(&policy, &caller("free", None)).is_empty());
    assert!(limits_of(&policy, &caller("nobody", None)).is_empty());
}

#[test]
fn a_full_table_forgets_refilled_buckets_first_and_never_grows_past_its_bound() {
    let limits = Arc::new(MinuteLimits::default());
    let t0 = Instant::now();
    let busy: Arc<str> = Arc::from("busy");
    limits
        .admit(vec![(busy.clone(), limit(1, 0))], &busy, 0, t0)
        .unwrap();
    for i in 0..MAX_BUCKETS + 10 {
        let client: Arc<str> = Arc::from(format!("c{i}"));
        limits
            .admit(vec![(client.clone(), limit(1000, 0))], &client, 0, t0)
            .unwrap();
    }
    assert!(limits.tracked() <= MAX_BUCKETS);
    // The busy client's empty bucket was kept: still refused.
    assert!(
        limits
            .admit(vec![(busy.clone(), limit(1, 0))], &busy, 0, t0)
            .is_err()
    );
}
