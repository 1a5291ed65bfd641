//! `oqpctl cloud` through the real planes: the accounts of a cloud host in front of the fake
//! ollama.com, with balances of both plan kinds as the control plane read them, a reserve, the
//! model an account refused with a 402 and the cooldown of one at its limit, keys redacted,
//! within 100 columns.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use oqp_tests::client::HttpClient;
use oqp_tests::fake::{CloudPlan, CloudReply, FakeOllama};
use oqp_tests::harness::Stack;
use serde_json::{Value, json};

const ADMIN: &str = "sk-admin-0123456789";
const A1: &str = "a1-0000000000000001";
const B1: &str = "b1-0000000000000003";
const C1: &str = "c1-0000000000000004";

fn config(url: &str) -> String {
    format!(
        "ollama:\n  hosts:\n    - url: '{url}'\n      name: cloud\n      kind: cloud\n      api_keys:\n\
         \x20       - {{key: {A1}, account: alice@example.com}}\n\
         \x20       - {{key: {B1}, account: bob}}\n\
         \x20       - {{key: {C1}, account: carol}}\n\
         cloud:\n  balance_interval: 0.1\n  accounts:\n    alice@example.com: {{reserve_usd: 5, team: acme}}\n\
         auth:\n  enabled: true\n  keys:\n\
         \x20   - {{key: {ADMIN}, client_id: admin, scope: management}}\n"
    )
}

async fn oqpctl(stack: &Stack, args: &[&str]) -> String {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_oqpctl"))
        .arg("--control-plane")
        .arg(stack.control_url())
        .args(args)
        .env("OQPCTL_KEY", ADMIN)
        .env("COLUMNS", "100")
        .env_remove("NO_COLOR")
        .env_remove("OQP_CONTROL_PLANE")
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "oqpctl failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `oqpctl cloud --json`, asked until `check` holds (the reads and reports arrive on their
/// own schedules), at most 30 s.
async fn until(stack: &Stack, check: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let text = oqpctl(stack, &["--output", "json", "cloud"]).await;
        let accounts: Vec<Value> = serde_json::from_str(&text).unwrap();
        if check(&accounts) || std::time::Instant::now() >= deadline {
            return accounts;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn oqpctl_cloud_shows_each_account_its_balance_refusals_and_cooldown() {
    let cloud = FakeOllama::builder()
        .model("glm-5.2")
        .model("gpt-oss:120b")
        .cloud(&[A1, B1, C1])
        .spawn()
        .await;
    let handle = cloud.handle();
    handle.set_cloud_account("alice@example.com", &[A1]);
    handle.set_cloud_account("bob", &[B1]);
    handle.set_cloud_account("carol", &[C1]);
    handle.set_cloud_plan(
        "alice@example.com",
        CloudPlan::Credits {
            allowance_usd: 20.0,
            balance_usd: 12.5,
        },
    );
    handle.set_cloud_plan(
        "bob",
        CloudPlan::Windows {
            session_percent: 70.0,
            weekly_percent: 40.0,
        },
    );
    handle.cloud_extra_usage_only("glm-5.2");
    // Carol has extra usage, but is at her weekly limit.
    handle.set_cloud_extra("carol", 5.0);
    handle.set_cloud_default(C1, CloudReply::WeeklyLimit);
    let stack = Stack::start(&config(&cloud.url())).await;
    // Read balances first, so that the requests below go where the balances say.
    until(&stack, |accounts| {
        accounts.len() == 3 && accounts[0]["plan"] == "credits" && accounts[1]["plan"] == "windows"
    })
    .await;
    // glm-5.2 is refused (402) by alice and bob; carol is at her weekly limit: the client
    // hears of the limit (429), which ends.
    let http = HttpClient::new();
    let chat = |model: &str| json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": false});
    let refused = http
        .post_json(
            &format!("{}/api/chat", stack.url()),
            &[("authorization", &format!("Bearer {ADMIN}"))],
            &chat("glm-5.2"),
        )
        .await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    let accounts = until(&stack, |accounts| {
        accounts.len() == 3
            && !accounts[0]["refused_models"].as_array().unwrap().is_empty()
            && !accounts[1]["refused_models"].as_array().unwrap().is_empty()
            && accounts[2]["cooldown_until_unix_ms"].is_number()
    })
    .await;
    let alice = &accounts[0];
    assert_eq!(alice["account"], "alice@example.com");
    assert_eq!(alice["team"], "acme");
    assert_eq!(alice["included_usd"], 12.5);
    assert_eq!(alice["reserve_usd"], 5.0);
    assert_eq!(
        alice["refused_models"],
        json!(["glm-5.2:latest (extra_usage)"])
    );
    assert_eq!(alice["keys"], json!(["…0001"]));
    let bob = &accounts[1];
    assert_eq!(bob["session"]["remaining_percent"], 70.0, "{bob}");
    assert_eq!(
        bob["refused_models"],
        json!(["glm-5.2:latest (extra_usage)"])
    );
    assert!(
        accounts[2]["cooldown_until_unix_ms"].is_number(),
        "{accounts:?}"
    );

    let table = oqpctl(&stack, &["cloud"]).await;
    println!("$ oqpctl cloud\n{table}");
    assert!(
        table.lines().all(|line| line.chars().count() <= 100),
        "{table}"
    );
    let wide = oqpctl(&stack, &["--wide", "cloud"]).await;
    for cell in [
        "alice@example.com (acme)",
        "$12.50 of $20",
        "session 70%",
        "weekly 40%",
        "$5.00",
        "for ",
    ] {
        assert!(wide.contains(cell), "{cell} not in\n{wide}");
    }
    for secret in ["0000000000000001", "0000000000000003", "0000000000000004"] {
        assert!(
            !table.contains(secret) && !wide.contains(secret),
            "a key leaked"
        );
    }
    stack.shutdown().await;
}
