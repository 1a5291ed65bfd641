//! End to end: per-user budgets of an app key with more users than an ack lists. The
//! acks carry the users nearest their budgets (by the fraction used of their nearest
//! limit) and every user over one, and a data plane keeps the last figure it was sent for
//! a user between acks, so a user with a small token budget is held to it however many
//! other users spend more GPU time.

use std::time::Duration;

use oqp_tests::client::{HttpClient, eventually};
use oqp_tests::fake::USAGE_HEADER;
use oqp_tests::harness::Stack;
use serde_json::json;

use super::{config, fake, wait_for_requests};

const WEBUI: &str = "sk-webui-0123456789";
const USER_HEADER: &str = "X-User";

async fn chat(base: &str, user: &str, reported: &str) -> http::StatusCode {
    HttpClient::new()
        .post_json(
            &format!("{base}/api/chat"),
            &[
                ("authorization", &format!("Bearer {WEBUI}")),
                (USER_HEADER, user),
                (USAGE_HEADER, reported),
            ],
            &json!({"model": "llama3", "stream": false,
                    "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await
        .status
}

#[tokio::test]
async fn with_1100_other_users_active_a_user_cannot_spend_past_a_50_token_budget() {
    let fake = fake().slots(8).spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let extra = format!(
        "    - key: \"{WEBUI}\"\n      client_id: webui\n      users:\n        header: \
         {USER_HEADER}\n        budget: {{tokens: 50, window: 1d}}\n"
    );
    let yaml = config(&fake.url(), &dir.path().display().to_string(), &extra)
        .replace("max_concurrent: 4", "max_concurrent: 8");
    let stack = Stack::start(&yaml).await;
    let base = stack.url();
    // 1,100 other users, each a second of GPU time and 2 tokens.
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..8 {
        let base = base.clone();
        tasks.spawn(async move {
            for user in (worker..1_100).step_by(8) {
                let busy = format!("busy-{user}");
                let status = chat(
                    &base,
                    &busy,
                    "total_duration=1000000000,prompt_eval_count=1,eval_count=1",
                )
                .await;
                assert_eq!(status, 200);
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    let control_url = stack.control_url();
    wait_for_requests(&control_url, 1_100).await;
    let usage = stack.control.dataplane().unwrap().app().usage.clone();
    // One user with a 50-token budget: 41 tokens and a millisecond of GPU time a request,
    // ten tries, each after the control plane has counted the last and acknowledged it.
    let mut spent = 0;
    let mut answered = 1_100;
    for _ in 0..10 {
        let status = chat(
            &base,
            "thrifty",
            "total_duration=1000000,prompt_eval_count=1,eval_count=40",
        )
        .await;
        if status != 200 {
            assert_eq!(status, 429);
            continue;
        }
        spent += 41;
        answered += 1;
        wait_for_requests(&control_url, answered).await;
        assert!(
            eventually(Duration::from_secs(10), || usage.settled()).await,
            "acknowledged"
        );
    }
    // The second request starts at 41 of 50 tokens; none after it (410 before).
    assert_eq!(spent, 82, "tokens spent against a budget of 50");
    stack.shutdown().await;
}
