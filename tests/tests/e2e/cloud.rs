//! End to end: Ollama Cloud as it bills since 2026-08-31, through the real planes in front of
//! the fake ollama.com. A 402 for a model that uses extra usage only refuses that model on that
//! account alone; balances are read per account within the cloud's read limit.

use oqp_tests::client::HttpClient;
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::Stack;
use serde_json::json;

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
    cloud.handle().set_cloud_extra("bob", 5.0);
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
