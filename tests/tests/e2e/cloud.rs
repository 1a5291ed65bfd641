//! End to end: Ollama Cloud as it bills since 2026-08-31, through the real planes in front of
//! the fake ollama.com. A 402 for a model that uses extra usage only refuses that model on that
//! account alone; balances are read per account within the cloud's read limit.

mod dashboard;
mod spend;

use std::time::Duration;

use oqp_tests::client::{HttpClient, eventually, wait_until};
use oqp_tests::fake::{CloudPlan, CloudReply, FakeOllama, READS_PER_MINUTE};
use oqp_tests::harness::Stack;
use serde_json::{Value, json};

const A1: &str = "a1-0000000000000001";
const A2: &str = "a2-0000000000000002";
const B1: &str = "b1-0000000000000003";
const CONSUMER: &str = "Bearer sk-consumer-0123456789";
/// A model that uses extra usage only.
const EXTRA: &str = "glm-5.2";
/// A model every plan includes.
const INCLUDED: &str = "gpt-oss:120b";

/// Accounts alice (a1, a2) and bob (b1), `extra` appended to the host's entry.
fn config(url: &str, extra: &str) -> String {
    format!(
        r#"ollama:
  hosts:
    - url: "{url}"
      name: cloud
      kind: cloud
      max_concurrent: 4
      api_keys:
        - key: "{A1}"
          account: alice
        - key: "{A2}"
          account: alice
        - key: "{B1}"
          account: bob
{extra}auth:
  enabled: true
  keys:
    - key: "sk-consumer-0123456789"
      client_id: agent
"#
    )
}

/// The fake ollama.com with alice's and bob's keys, and both models.
async fn cloud() -> FakeOllama {
    let cloud = FakeOllama::builder()
        .model(EXTRA)
        .model(INCLUDED)
        .cloud(&[A1, A2, B1])
        .spawn()
        .await;
    let handle = cloud.handle();
    handle.set_cloud_account("alice", &[A1, A2]);
    handle.set_cloud_account("bob", &[B1]);
    handle.cloud_extra_usage_only(EXTRA);
    cloud
}

async fn chat(http: &HttpClient, base: &str, model: &str) -> oqp_tests::client::Reply {
    http.post_json(
        &format!("{base}/api/chat"),
        &[("authorization", CONSUMER)],
        &json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": false}),
    )
    .await
}

/// The keys the fake was asked with, in order, for chats naming `model`.
fn asked(cloud: &FakeOllama, model: &str) -> Vec<String> {
    cloud
        .handle()
        .requests_to("/api/chat")
        .iter()
        .filter(|r| r.json()["model"] == model)
        .map(|r| r.bearer().unwrap())
        .collect()
}

#[tokio::test]
async fn a_402_on_one_account_is_served_by_the_next_within_the_same_call() {
    let cloud = cloud().await;
    // Alice has the most left (read or not, she comes first), but no extra usage.
    cloud.handle().set_cloud_extra("bob", 5.0);
    cloud.handle().set_cloud_plan("alice", credits(30.0));
    let stack = Stack::start(&config(&cloud.url(), "")).await;
    let http = HttpClient::new();

    let served = chat(&http, &stack.url(), EXTRA).await;
    assert_eq!(served.status, 200, "{}", served.text());
    // Alice refused once (her two keys share her balance); bob served in the same call.
    let first = asked(&cloud, EXTRA);
    assert_eq!(first.len(), 2, "{first:?}");
    assert_ne!(first[0], B1);
    assert_eq!(first[1], B1);
    // Asked again, alice is skipped for that model: straight to bob.
    let again = chat(&http, &stack.url(), EXTRA).await;
    assert_eq!(again.status, 200, "{}", again.text());
    assert_eq!(asked(&cloud, EXTRA)[2..], [B1.to_owned()]);
    // Alice's keys keep serving every other model, and no key cools down.
    for _ in 0..3 {
        let other = chat(&http, &stack.url(), INCLUDED).await;
        assert_eq!(other.status, 200, "{}", other.text());
    }
    let status = http
        .get(
            &format!("{}/queue/status", stack.url()),
            &[("authorization", CONSUMER)],
        )
        .await;
    let pool = status.json()["hosts"][0]["cloud_pool"].clone();
    assert!(
        pool.as_array()
            .unwrap()
            .iter()
            .all(|key| key["cooldown_until"].is_null()),
        "{pool}"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn when_every_account_refuses_with_402_the_client_gets_one_clean_402() {
    let cloud = cloud().await;
    let stack = Stack::start(&config(&cloud.url(), "")).await;
    let http = HttpClient::new();

    let refused = chat(&http, &stack.url(), EXTRA).await;
    assert_eq!(refused.status, 402, "{}", refused.text());
    let body = refused.json();
    let message = body["error"].as_str().unwrap();
    assert!(message.contains(&format!("'{EXTRA}'")), "{message}");
    assert!(message.contains("extra usage"), "{message}");
    assert!(body["request_id"].is_string(), "{body}");
    let text = refused.text();
    for secret in [A1, A2, B1, "0000000000", "(ref: ", "alice", "bob"] {
        assert!(!text.contains(secret), "{secret} in {text}");
    }
    // One try per account, then none: the refusal is remembered.
    assert_eq!(asked(&cloud, EXTRA).len(), 2);
    let again = chat(&http, &stack.url(), EXTRA).await;
    assert_eq!(again.status, 402, "{}", again.text());
    assert_eq!(asked(&cloud, EXTRA).len(), 2);

    // The Anthropic layer gets it in its own shape.
    let messages = http
        .post_json(
            &format!("{}/v1/messages", stack.url()),
            &[("authorization", CONSUMER)],
            &json!({"model": EXTRA, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(messages.status, 402, "{}", messages.text());
    let body = messages.json();
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], "billing_error", "{body}");
    assert!(
        body["error"]["message"].as_str().unwrap().contains(EXTRA),
        "{body}"
    );
    stack.shutdown().await;
}

/// Balances read every 100 ms (the read limit still holds), the cloud host polled each second.
const FAST_BALANCES: &str = "      model_sync_interval: 1\n";
const CLOUD_SECTION: &str = "cloud:\n  balance_interval: 0.1\n";

fn fast_config(url: &str, cloud_section: &str) -> String {
    config(url, FAST_BALANCES).replace("auth:\n", &format!("{cloud_section}auth:\n"))
}

/// `/queue/status`'s cloud accounts.
async fn accounts(http: &HttpClient, base: &str) -> Vec<Value> {
    let status = http
        .get(
            &format!("{base}/queue/status"),
            &[("authorization", CONSUMER)],
        )
        .await;
    status.json()["hosts"][0]["cloud_accounts"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Waits (up to 30 s) until `/queue/status` shows accounts that satisfy `check`.
async fn until_accounts(
    http: &HttpClient,
    base: &str,
    check: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    // Past a minute: at the shortest intervals the reads of a minute's budget are spent in
    // its first second, so a read lost under load comes back only with the next minute.
    let seen = wait_until(Duration::from_secs(90), || async {
        let seen = accounts(http, base).await;
        if check(&seen) { Ok(seen) } else { Err(seen) }
    })
    .await;
    seen.unwrap_or_else(|seen| seen)
}

fn account<'a>(accounts: &'a [Value], name: &str) -> &'a Value {
    accounts
        .iter()
        .find(|account| account["account"] == name)
        .unwrap_or_else(|| panic!("no {name} in {accounts:?}"))
}

/// Waits until the cloud host has been polled `more` more times: time has passed, by the
/// control plane's own clock, without a sleep deciding anything.
async fn polls_pass(cloud: &FakeOllama, more: usize) {
    let handle = cloud.handle();
    let start = handle.requests_to("/api/tags").len();
    assert!(
        eventually(Duration::from_secs(30), || {
            handle.requests_to("/api/tags").len() >= start + more
        })
        .await,
        "the cloud host is polled"
    );
}

#[tokio::test]
async fn balances_of_both_plan_kinds_reach_the_status_per_account() {
    let cloud = cloud().await;
    let handle = cloud.handle();
    handle.set_cloud_plan(
        "alice",
        CloudPlan::Credits {
            allowance_usd: 20.0,
            balance_usd: 12.5,
        },
    );
    handle.set_cloud_extra("alice", 3.0);
    handle.set_cloud_plan(
        "bob",
        CloudPlan::Windows {
            session_percent: 70.0,
            weekly_percent: 40.0,
        },
    );
    let stack = Stack::start(&fast_config(&cloud.url(), CLOUD_SECTION)).await;
    let http = HttpClient::new();
    let seen = until_accounts(&http, &stack.url(), |accounts| {
        accounts.len() == 2 && accounts.iter().all(|account| !account["plan"].is_null())
    })
    .await;
    let alice = account(&seen, "alice");
    assert_eq!(alice["plan"], "credits", "{alice}");
    assert_eq!(alice["included_usd"], 12.5);
    assert_eq!(alice["allowance_usd"], 20.0);
    assert_eq!(alice["extra_usd"], 3.0);
    assert!(alice["resets_at"].is_string(), "{alice}");
    assert!(alice["read_at"].is_string(), "{alice}");
    let bob = account(&seen, "bob");
    assert_eq!(bob["plan"], "windows", "{bob}");
    assert_eq!(bob["session"]["remaining_percent"], 70.0);
    assert_eq!(bob["weekly"]["remaining_percent"], 40.0);
    assert!(bob["weekly"]["resets_at"].is_string(), "{bob}");
    let text = serde_json::to_string(&seen).unwrap();
    assert!(!text.contains("0000000000"), "no key in status: {text}");
    // And in the metrics.
    let metrics = http
        .get(
            &format!("{}/metrics", stack.url()),
            &[("authorization", CONSUMER)],
        )
        .await
        .text();
    for line in [
        r#"oqp_cloud_balance_usd{account="alice"} 15.5"#,
        r#"oqp_cloud_remaining_ratio{account="alice",window="monthly"} 0.625"#,
        r#"oqp_cloud_remaining_ratio{account="bob",window="session"} 0.7"#,
        r#"oqp_cloud_remaining_ratio{account="bob",window="weekly"} 0.4"#,
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "{line} not in:\n{metrics}"
        );
    }

    // The balance falls with output tokens (the fake's 5 at $0.5): the next read shows it.
    // Bob is out of his session window, so alice serves.
    handle.set_cloud_price(0.5);
    handle.set_cloud_default(B1, CloudReply::SessionLimit);
    let served = chat(&http, &stack.url(), INCLUDED).await;
    assert_eq!(served.status, 200, "{}", served.text());
    assert_ne!(asked(&cloud, INCLUDED).last().map(String::as_str), Some(B1));
    let seen = until_accounts(&http, &stack.url(), |accounts| {
        accounts
            .iter()
            .any(|account| account["account"] == "alice" && account["included_usd"] == 10.0)
    })
    .await;
    assert_eq!(account(&seen, "alice")["included_usd"], 10.0, "{seen:?}");
    stack.shutdown().await;
}

#[tokio::test]
async fn balances_are_read_at_most_ten_a_minute_per_account_however_many_keys_and_data_planes() {
    let cloud = cloud().await;
    let handle = cloud.handle();
    let stack = Stack::start(&fast_config(&cloud.url(), CLOUD_SECTION)).await;
    let _second = stack.start_dataplane("second", None).await.unwrap();
    // Asked every 100 ms, each account is read ten times, then waits out the minute.
    assert!(
        eventually(Duration::from_secs(30), || {
            handle.cloud_balance_reads("alice").len() >= READS_PER_MINUTE
                && handle.cloud_balance_reads("bob").len() >= READS_PER_MINUTE
        })
        .await
    );
    // Two more polls of the host: long enough for twenty more reads at that interval.
    polls_pass(&cloud, 2).await;
    for name in ["alice", "bob"] {
        let reads = handle.cloud_balance_reads(name);
        assert_eq!(reads.len(), READS_PER_MINUTE, "{name}: {reads:?}");
        assert!(reads.iter().all(|read| !read.limited), "{name}: {reads:?}");
    }
    stack.shutdown().await;
}

#[tokio::test]
async fn a_429_on_balance_reads_holds_them_for_its_retry_after() {
    let cloud = cloud().await;
    let handle = cloud.handle();
    handle.set_cloud_read_limit(2);
    let stack = Stack::start(&fast_config(&cloud.url(), CLOUD_SECTION)).await;
    assert!(
        eventually(Duration::from_secs(30), || {
            handle
                .cloud_balance_reads("alice")
                .iter()
                .any(|read| read.limited)
        })
        .await
    );
    // The 429 said to wait most of a minute: no read in the next polls.
    polls_pass(&cloud, 2).await;
    let reads = handle.cloud_balance_reads("alice");
    assert_eq!(reads.len(), 3, "{reads:?}");
    assert!(reads[2].limited, "{reads:?}");
    stack.shutdown().await;
}

#[tokio::test]
async fn an_extra_usage_refusal_ends_when_the_accounts_balance_changes() {
    let cloud = cloud().await;
    let handle = cloud.handle();
    // Read every 2 s: within the read limit, so a change is seen within one interval.
    let stack = Stack::start(&fast_config(
        &cloud.url(),
        "cloud:\n  balance_interval: 2\n",
    ))
    .await;
    let http = HttpClient::new();
    // Both balances read (no extra usage anywhere), then both accounts refuse the model.
    until_accounts(&http, &stack.url(), |accounts| {
        accounts.len() == 2 && accounts.iter().all(|account| account["extra_usd"] == 0.0)
    })
    .await;
    assert_eq!(chat(&http, &stack.url(), EXTRA).await.status, 402);
    let seen = accounts(&http, &stack.url()).await;
    for name in ["alice", "bob"] {
        assert_eq!(
            account(&seen, name)["refused_models"],
            json!([{"model": "glm-5.2:latest", "reason": "extra_usage"}]),
            "{seen:?}"
        );
    }
    // Bob buys extra usage: once the read shows it, bob is asked again, and serves.
    handle.set_cloud_extra("bob", 5.0);
    let seen = until_accounts(&http, &stack.url(), |accounts| {
        accounts.iter().any(|account| {
            account["account"] == "bob"
                && account["extra_usd"] == 5.0
                && account["refused_models"] == json!([])
        })
    })
    .await;
    assert_eq!(
        account(&seen, "bob")["refused_models"],
        json!([]),
        "{seen:?}"
    );
    let served = chat(&http, &stack.url(), EXTRA).await;
    assert_eq!(served.status, 200, "{}", served.text());
    assert_eq!(asked(&cloud, EXTRA).last().map(String::as_str), Some(B1));
    stack.shutdown().await;
}

fn credits(balance_usd: f64) -> CloudPlan {
    CloudPlan::Credits {
        allowance_usd: 50.0,
        balance_usd,
    }
}

/// Waits until `/queue/status` shows `name`'s included balance at `usd`.
async fn until_included(http: &HttpClient, base: &str, name: &str, usd: f64) {
    let seen = until_accounts(http, base, |accounts| {
        accounts
            .iter()
            .any(|account| account["account"] == name && account["included_usd"] == usd)
    })
    .await;
    assert_eq!(account(&seen, name)["included_usd"], usd, "{seen:?}");
}

#[tokio::test]
async fn the_fuller_account_is_preferred_while_warmth_holds() {
    let cloud = cloud().await;
    let handle = cloud.handle();
    handle.set_cloud_plan("alice", credits(0.4));
    handle.set_cloud_plan("bob", credits(40.0));
    let stack = Stack::start(&fast_config(&cloud.url(), CLOUD_SECTION)).await;
    let http = HttpClient::new();
    let base = stack.url();
    until_included(&http, &base, "alice", 0.4).await;
    until_included(&http, &base, "bob", 40.0).await;
    // Bob has the most left: the model binds to his key and stays there.
    for _ in 0..3 {
        assert_eq!(chat(&http, &base, INCLUDED).await.status, 200);
    }
    assert_eq!(asked(&cloud, INCLUDED), [B1, B1, B1].map(String::from));
    // Bob now has less than alice, but still room: the warm key keeps the model.
    handle.set_cloud_plan("bob", credits(0.2));
    until_included(&http, &base, "bob", 0.2).await;
    assert_eq!(chat(&http, &base, INCLUDED).await.status, 200);
    assert_eq!(asked(&cloud, INCLUDED).last().map(String::as_str), Some(B1));
    // Bob is empty: nothing more is sent to him; alice serves.
    handle.set_cloud_plan("bob", credits(0.0));
    until_included(&http, &base, "bob", 0.0).await;
    for _ in 0..2 {
        assert_eq!(chat(&http, &base, INCLUDED).await.status, 200);
    }
    let last: Vec<String> = asked(&cloud, INCLUDED)[4..].to_vec();
    assert!(last.iter().all(|key| key != B1), "{last:?}");
    stack.shutdown().await;
}

#[tokio::test]
async fn the_reserve_is_respected() {
    let cloud = cloud().await;
    let handle = cloud.handle();
    handle.set_cloud_plan("alice", credits(10.0));
    handle.set_cloud_plan("bob", credits(40.0));
    let section = "cloud:\n  balance_interval: 0.1\n  accounts:\n    bob:\n      reserve_usd: 45\n    \
                   alice:\n      reserve_percent: 10\n";
    let stack = Stack::start(&fast_config(&cloud.url(), section)).await;
    let http = HttpClient::new();
    let base = stack.url();
    until_included(&http, &base, "alice", 10.0).await;
    until_included(&http, &base, "bob", 40.0).await;
    let seen = accounts(&http, &base).await;
    assert_eq!(account(&seen, "bob")["under_reserve"], true, "{seen:?}");
    assert_eq!(account(&seen, "alice")["under_reserve"], false, "{seen:?}");
    // Bob keeps $45: with $40 left he gets nothing, though he has the most.
    for _ in 0..3 {
        assert_eq!(chat(&http, &base, INCLUDED).await.status, 200);
    }
    assert!(
        asked(&cloud, INCLUDED).iter().all(|key| key != B1),
        "{:?}",
        asked(&cloud, INCLUDED)
    );
    // Alice keeps 10 % of her $50: at $5 nobody may be asked, and the client is told so.
    handle.set_cloud_plan("alice", credits(5.0));
    until_included(&http, &base, "alice", 5.0).await;
    let refused = chat(&http, &base, INCLUDED).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert!(refused.text().contains("reserve"), "{}", refused.text());
    assert_eq!(asked(&cloud, INCLUDED).len(), 3);
    stack.shutdown().await;
}

#[tokio::test]
async fn webhooks_tell_of_an_account_under_its_reserve_and_of_a_402() {
    let cloud = cloud().await;
    let handle = cloud.handle();
    handle.set_cloud_plan("alice", credits(10.0));
    handle.set_cloud_plan("bob", credits(4.0));
    let mut sink = crate::hosts::Sink::start().await;
    let section = format!(
        "{}cloud:\n  balance_interval: 0.1\n  accounts:\n    bob:\n      reserve_usd: 5\n",
        sink.config(&["cloud.under_reserve", "cloud.refused"])
    );
    let stack = Stack::start(&fast_config(&cloud.url(), &section)).await;
    let under = sink.next().await;
    assert_eq!(under["event"], "cloud.under_reserve", "{under}");
    assert_eq!(under["account"], "bob", "{under}");
    assert_eq!(under["reserve_usd"], 5.0, "{under}");
    // Alice is asked for the extra-usage-only model and refuses it (bob is at his reserve).
    let http = HttpClient::new();
    assert_eq!(chat(&http, &stack.url(), EXTRA).await.status, 402);
    let refused = sink.next().await;
    assert_eq!(refused["event"], "cloud.refused", "{refused}");
    assert_eq!(refused["account"], "alice", "{refused}");
    assert_eq!(refused["model"], "glm-5.2:latest", "{refused}");
    assert_eq!(refused["host"], "cloud", "{refused}");
    let text = refused.to_string() + &under.to_string();
    assert!(!text.contains("0000000000"), "no key in a webhook: {text}");
    stack.shutdown().await;
}

#[tokio::test]
async fn accounts_of_one_team_share_one_balance_read_once() {
    let cloud = cloud().await;
    let handle = cloud.handle();
    handle.set_cloud_plan("alice", credits(33.0));
    handle.set_cloud_plan("bob", credits(1.0));
    let section = "cloud:\n  balance_interval: 0.1\n  accounts:\n    alice:\n      team: acme\n    \
                   bob:\n      team: acme\n";
    let stack = Stack::start(&fast_config(&cloud.url(), section)).await;
    let http = HttpClient::new();
    // The team's balance is read with its first key (alice's), and shown for both.
    let seen = until_accounts(&http, &stack.url(), |accounts| {
        accounts.len() == 2
            && accounts
                .iter()
                .all(|account| account["included_usd"] == 33.0)
    })
    .await;
    for name in ["alice", "bob"] {
        assert_eq!(account(&seen, name)["included_usd"], 33.0, "{seen:?}");
        assert_eq!(account(&seen, name)["team"], "acme", "{seen:?}");
    }
    assert!(!handle.cloud_balance_reads("alice").is_empty());
    assert!(handle.cloud_balance_reads("bob").is_empty());
    stack.shutdown().await;
}
