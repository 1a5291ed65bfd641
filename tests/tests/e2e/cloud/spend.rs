//! Ollama Cloud spend in dollars, through the real planes: the control plane reads each
//! account's `/api/usage` (both shapes) within the read budget it shares with the balance,
//! and attributes each account's `usage_usd` to the clients it served, in proportion to their
//! tokens on it; the admin usage carries it beside GPU time.

use std::time::{Duration, Instant};

use oqp_tests::client::HttpClient;
use oqp_tests::fake::{CloudPlan, CloudUsageShape, READS_PER_MINUTE};
use oqp_tests::harness::Stack;
use serde_json::json;

use super::{B1, EXTRA, INCLUDED, asked, chat, cloud, fast_config};
use crate::usage::{ADMIN_KEY, usage_of};

const BATCH: &str = "sk-batch-0123456789";

/// Two clients (agent, batch) and an admin key; balances and usage read every 3 s: two reads
/// each time, so the first ten reads come within the first 15 s.
fn config(url: &str) -> String {
    fast_config(url, "cloud:\n  balance_interval: 3\n").replace(
        "      client_id: agent\n",
        &format!(
            "      client_id: agent\n    - key: \"{BATCH}\"\n      client_id: batch\n    \
             - key: \"{ADMIN_KEY}\"\n      client_id: admin\n      scope: management\n"
        ),
    )
}

#[tokio::test]
async fn each_accounts_spend_is_attributed_to_its_clients_by_their_tokens() {
    let cloud = cloud().await;
    let handle = cloud.handle();
    // Every answer bills its 5 output tokens at $0.5: $2.50 a request.
    handle.set_cloud_price(0.5);
    handle.set_cloud_plan(
        "alice",
        CloudPlan::Credits {
            allowance_usd: 50.0,
            balance_usd: 50.0,
        },
    );
    // Alice answers /api/usage in the second shape, bob in the first.
    handle.set_cloud_usage_shape("alice", CloudUsageShape::Monthly);
    handle.set_cloud_extra("bob", 20.0);
    let stack = Stack::start(&config(&cloud.url())).await;
    let http = HttpClient::new();
    let base = stack.url();

    // The agent's three chats go to alice (the fullest); batch's one, for a model that uses
    // extra usage only, is refused by alice (no extra usage) and served by bob.
    for _ in 0..3 {
        assert_eq!(chat(&http, &base, INCLUDED).await.status, 200);
    }
    let batch = http
        .post_json(
            &format!("{base}/api/chat"),
            &[("authorization", &format!("Bearer {BATCH}"))],
            &json!({"model": EXTRA, "messages": [{"role": "user", "content": "hi"}], "stream": false}),
        )
        .await;
    assert_eq!(batch.status, 200, "{}", batch.text());
    assert_eq!(asked(&cloud, EXTRA).last().map(String::as_str), Some(B1));
    assert!(asked(&cloud, INCLUDED).iter().all(|key| key != B1));
    assert!((handle.cloud_spent("alice") - 7.5).abs() < 1e-9);
    assert!((handle.cloud_spent("bob") - 2.5).abs() < 1e-9);

    // Once a usage read follows the reports, each client carries its account's spend.
    let deadline = Instant::now() + Duration::from_secs(90);
    let usage = loop {
        let usage = usage_of(&stack.control_url(), 0, true, false).await;
        let spend = |client: &str| {
            usage
                .rows
                .iter()
                .find(|row| row.client_id == client)
                .and_then(|row| row.cloud_usd)
        };
        let settled = spend("agent").is_some_and(|usd| (usd - 7.5).abs() < 1e-6)
            && spend("batch").is_some_and(|usd| (usd - 2.5).abs() < 1e-6);
        if settled || Instant::now() >= deadline {
            break usage;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let row = |client: &str| {
        usage
            .rows
            .iter()
            .find(|row| row.client_id == client)
            .unwrap_or_else(|| panic!("no {client} in {usage:?}"))
    };
    assert_eq!(row("agent").cloud_usd, Some(7.5), "{usage:?}");
    assert_eq!(row("batch").cloud_usd, Some(2.5), "{usage:?}");
    // Beside GPU time and tokens, which are the ordinary figures.
    assert_eq!(row("agent").requests, 3);
    assert!(row("agent").gpu_ns > 0);
    let total = usage.total.clone().unwrap_or_default();
    assert_eq!(total.cloud_usd, Some(10.0), "{usage:?}");
    // Grouped by model, rows carry no spend (accounts are not per model); the total does.
    let by_model = usage_of(&stack.control_url(), 0, false, true).await;
    assert!(by_model.rows.iter().all(|row| row.cloud_usd.is_none()));
    assert_eq!(by_model.total.unwrap_or_default().cloud_usd, Some(10.0));

    // Both endpoints share the account's read budget: never more than ten a minute.
    for name in ["alice", "bob"] {
        let reads = handle.cloud_balance_reads(name);
        assert!(reads.iter().any(|read| read.usage), "{name}: {reads:?}");
        assert!(reads.iter().any(|read| !read.usage), "{name}: {reads:?}");
        assert!(reads.iter().all(|read| !read.limited), "{name}: {reads:?}");
        for (index, first) in reads.iter().enumerate() {
            let in_minute = reads[index..]
                .iter()
                .take_while(|read| read.at.duration_since(first.at) < Duration::from_secs(60))
                .count();
            assert!(in_minute <= READS_PER_MINUTE, "{name}: {reads:?}");
        }
    }
    stack.shutdown().await;
}

#[tokio::test]
async fn a_usd_budget_is_charged_from_the_attributed_spend() {
    let cloud = cloud().await;
    let handle = cloud.handle();
    handle.set_cloud_price(0.5);
    let config = config(&cloud.url()).replace(
        "      client_id: batch\n",
        "      client_id: batch\n      budget: {usd: 2, window: 30d}\n",
    );
    let stack = Stack::start(&config).await;
    let http = HttpClient::new();
    let base = stack.url();
    let bearer = format!("Bearer {BATCH}");
    let url = format!("{base}/api/chat");
    let body = json!({"model": INCLUDED, "messages": [{"role": "user", "content": "hi"}], "stream": false});
    let headers = [("authorization", bearer.as_str())];
    let ask = || http.post_json(&url, &headers, &body);
    // Under its budget (nothing attributed yet), batch is served: $2.50 of cloud spend.
    let first = ask().await;
    assert_eq!(first.status, 200, "{}", first.text());
    // Once the control plane attributes that spend, the budget is spent: 429 like any other.
    let deadline = Instant::now() + Duration::from_secs(90);
    let refused = loop {
        let reply = ask().await;
        if reply.status != 200 || Instant::now() >= deadline {
            break reply;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(refused.status, 429, "{}", refused.text());
    let body = refused.json();
    let message = body["error"].as_str().unwrap_or_default();
    assert!(message.contains("usd 2 per 30d"), "{body}");
    assert!(
        refused.header("retry-after").is_some(),
        "{}",
        refused.text()
    );
    // The agent, without a budget, is still served.
    assert_eq!(chat(&http, &base, INCLUDED).await.status, 200);
    stack.shutdown().await;
}
