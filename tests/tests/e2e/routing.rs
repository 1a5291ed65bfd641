//! End to end: several fake Ollamas behind one data plane. Model-aware
//! routing, smooth weighted round-robin, failover before the first byte,
//! "model not found" invalidation, the union of model lists, and an Ollama
//! Cloud key pool rotating across accounts.

use std::collections::HashMap;

use oqp_tests::client::HttpClient;
use oqp_tests::fake::{CloudReply, FakeOllama};
use oqp_tests::harness::Stack;
use serde_json::json;

fn host(url: &str, name: &str, weight: u32) -> String {
    format!(
        "    - url: \"{url}\"\n      name: {name}\n      weight: {weight}\n      max_concurrent: 4\n"
    )
}

fn config(hosts: &str, strategy: &str) -> String {
    format!(
        "proxy:\n  max_concurrent: 4\nollama:\n  hosts:\n{hosts}routing:\n  strategy: {strategy}\n"
    )
}

async fn generate(http: &HttpClient, base: &str, model: &str) -> oqp_tests::client::Reply {
    http.post_json(
        &format!("{base}/api/generate"),
        &[],
        &json!({"model": model, "prompt": "hi", "stream": false}),
    )
    .await
}

#[tokio::test]
async fn the_model_goes_where_it_is_loaded_then_installed_then_anywhere() {
    let installed = FakeOllama::builder().model("qwen3").spawn().await;
    let loaded = FakeOllama::builder()
        .model("qwen3")
        .loaded("qwen3")
        .spawn()
        .await;
    let bare = FakeOllama::builder().model("llama3").spawn().await;
    let hosts = [
        host(&installed.url(), "installed", 1),
        host(&loaded.url(), "loaded", 1),
        host(&bare.url(), "bare", 1),
    ]
    .concat();
    let stack = Stack::start(&config(&hosts, "model_aware")).await;
    let http = HttpClient::new();
    for _ in 0..4 {
        // Ollama's name rules: a missing tag is `latest`, case is ignored.
        let reply = generate(&http, &stack.url(), "QWEN3").await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-failover-host").as_deref(), Some("loaded"));
    }
    let reply = generate(&http, &stack.url(), "llama3:latest").await;
    assert_eq!(reply.header("x-failover-host").as_deref(), Some("bare"));
    // A model nobody has goes to some healthy host (which answers 404).
    let reply = generate(&http, &stack.url(), "unknown").await;
    assert_eq!(reply.status, 404);
    stack.shutdown().await;
}

#[tokio::test]
async fn weights_two_to_one_give_exactly_two_to_one_interleaved() {
    let heavy = FakeOllama::builder().model("llama3").spawn().await;
    let light = FakeOllama::builder().model("llama3").spawn().await;
    let hosts = [
        host(&heavy.url(), "heavy", 2),
        host(&light.url(), "light", 1),
    ]
    .concat();
    let stack = Stack::start(&config(&hosts, "round_robin")).await;
    let http = HttpClient::new();
    let mut order = Vec::new();
    for _ in 0..30 {
        let reply = generate(&http, &stack.url(), "llama3").await;
        order.push(reply.header("x-failover-host").unwrap());
    }
    let counts = order.iter().fold(HashMap::new(), |mut counts, name| {
        *counts.entry(name.clone()).or_insert(0) += 1;
        counts
    });
    assert_eq!(counts["heavy"], 20);
    assert_eq!(counts["light"], 10);
    for window in order.windows(3).step_by(3) {
        assert_eq!(
            window.iter().filter(|name| *name == "light").count(),
            1,
            "{order:?}"
        );
    }
    stack.shutdown().await;
}

#[tokio::test]
async fn a_dead_host_loses_no_request_and_all_dead_is_503() {
    let first = FakeOllama::builder().model("llama3").spawn().await;
    let second = FakeOllama::builder().model("llama3").spawn().await;
    let hosts = [
        host(&first.url(), "first", 1),
        host(&second.url(), "second", 1),
    ]
    .concat();
    let stack = Stack::start(&config(&hosts, "round_robin")).await;
    let http = HttpClient::new();
    for _ in 0..4 {
        assert_eq!(generate(&http, &stack.url(), "llama3").await.status, 200);
    }
    first.shutdown().await;
    let mut served_by = Vec::new();
    for _ in 0..10 {
        let reply = generate(&http, &stack.url(), "llama3").await;
        assert_eq!(reply.status, 200, "no request is lost: {}", reply.text());
        served_by.push(reply.header("x-failover-host").unwrap());
    }
    assert!(
        served_by.iter().all(|name| name == "second"),
        "{served_by:?}"
    );
    second.shutdown().await;
    let reply = generate(&http, &stack.url(), "llama3").await;
    assert_eq!(reply.status, 503);
    assert_eq!(
        reply.header("x-failover-exhausted").as_deref(),
        Some("true")
    );
    let error = reply.json()["error"].as_str().unwrap().to_owned();
    assert!(
        error.starts_with("all upstream hosts failed: ") && error.contains("second ("),
        "{error}"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn model_not_found_moves_to_a_host_that_has_it() {
    let stale = FakeOllama::builder().model("qwen3").spawn().await;
    let fresh = FakeOllama::builder().model("qwen3").spawn().await;
    let hosts = [
        host(&stale.url(), "stale", 10),
        host(&fresh.url(), "fresh", 1),
    ]
    .concat();
    let stack = Stack::start(&config(&hosts, "model_aware")).await;
    // Deleted after the poll: the routing table still believes "stale" has it.
    stale.handle().remove_model("qwen3");
    let http = HttpClient::new();
    let reply = generate(&http, &stack.url(), "qwen3").await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-failover-host").as_deref(), Some("fresh"));
    // The pair left the routing table at once: no second 404 round trip.
    let reply = generate(&http, &stack.url(), "qwen3").await;
    assert_eq!(reply.header("x-failover-host").as_deref(), Some("fresh"));
    assert_eq!(stale.handle().requests_to("/api/generate").len(), 1);
    stack.shutdown().await;
}

#[tokio::test]
async fn tags_and_ps_answer_every_model_once() {
    let first = FakeOllama::builder()
        .model("llama3")
        .loaded("llama3")
        .model("qwen3")
        .spawn()
        .await;
    let second = FakeOllama::builder()
        .model("qwen3")
        .model("mistral")
        .loaded("mistral")
        .spawn()
        .await;
    let hosts = [
        host(&first.url(), "first", 1),
        host(&second.url(), "second", 1),
    ]
    .concat();
    let stack = Stack::start(&config(&hosts, "model_aware")).await;
    let http = HttpClient::new();
    let tags = http.get(&format!("{}/api/tags", stack.url()), &[]).await;
    assert_eq!(tags.status, 200);
    let mut names: Vec<String> = tags.json()["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["llama3:latest", "mistral:latest", "qwen3:latest"]);
    let ps = http.get(&format!("{}/api/ps", stack.url()), &[]).await;
    assert_eq!(ps.json()["models"].as_array().unwrap().len(), 2);
    let show = http
        .post_json(
            &format!("{}/api/show", stack.url()),
            &[],
            &json!({"model": "mistral"}),
        )
        .await;
    assert_eq!(show.status, 200);
    assert_eq!(show.header("x-failover-host").as_deref(), Some("second"));
    stack.shutdown().await;
}

fn cloud_config(url: &str, fallback: &str) -> String {
    format!(
        r#"ollama:
  hosts:
    - url: "{url}"
      name: cloud
      kind: cloud
      max_concurrent: 4
      api_keys:
        - key: "a1-0000000000000001"
          account: alice
        - key: "a2-0000000000000002"
          account: alice
        - key: "b1-0000000000000003"
          account: bob
{fallback}auth:
  enabled: true
  keys:
    - key: "sk-consumer-0123456789"
      client_id: agent
"#
    )
}

#[tokio::test]
async fn a_rate_limited_account_is_skipped_and_nobody_sees_a_429() {
    let cloud = FakeOllama::builder()
        .model("gpt-oss:120b")
        .cloud(&[
            "a1-0000000000000001",
            "a2-0000000000000002",
            "b1-0000000000000003",
        ])
        .spawn()
        .await;
    let handle = cloud.handle();
    handle.set_cloud_default("a1-0000000000000001", CloudReply::SessionLimit);
    handle.set_cloud_default("a2-0000000000000002", CloudReply::SessionLimit);
    let stack = Stack::start(&cloud_config(&cloud.url(), "")).await;
    let http = HttpClient::new();
    for _ in 0..6 {
        let reply = http
            .post_json(
                &format!("{}/api/chat", stack.url()),
                &[("authorization", "Bearer sk-consumer-0123456789")],
                &json!({"model": "gpt-oss:120b", "messages": [{"role": "user", "content": "hi"}], "stream": false}),
            )
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let chats = handle.requests_to("/api/chat");
    let by_key = chats.iter().fold(HashMap::new(), |mut counts, r| {
        *counts.entry(r.bearer().unwrap_or_default()).or_insert(0) += 1;
        counts
    });
    // alice's session limit cools the whole account: a1 once, a2 never.
    assert_eq!(by_key.get("a1-0000000000000001"), Some(&1), "{by_key:?}");
    assert_eq!(by_key.get("a2-0000000000000002"), None, "{by_key:?}");
    assert_eq!(by_key.get("b1-0000000000000003"), Some(&6));
    assert!(
        chats
            .iter()
            .all(|r| r.bearer().as_deref() != Some("sk-consumer-0123456789")),
        "the consumer's key never reaches Ollama Cloud"
    );
    // The pool is visible, redacted: alice cools down, bob does not.
    let status = http
        .get(
            &format!("{}/queue/status", stack.url()),
            &[("authorization", "Bearer sk-consumer-0123456789")],
        )
        .await;
    assert!(
        !status.text().contains("0000000000000001"),
        "no key in status"
    );
    let pool = status.json()["hosts"][0]["cloud_pool"].clone();
    let cooling: Vec<&str> = pool
        .as_array()
        .unwrap()
        .iter()
        .filter(|key| !key["cooldown_until"].is_null())
        .map(|key| key["label"].as_str().unwrap())
        .collect();
    assert_eq!(cooling, ["alice", "alice"], "{pool}");
    stack.shutdown().await;
}

#[tokio::test]
async fn each_model_stays_warm_on_its_own_account() {
    let cloud = FakeOllama::builder()
        .model("gpt-oss:120b")
        .model("qwen3-coder:480b")
        .cloud(&[
            "a1-0000000000000001",
            "a2-0000000000000002",
            "b1-0000000000000003",
        ])
        .spawn()
        .await;
    let stack = Stack::start(&cloud_config(&cloud.url(), "")).await;
    let http = HttpClient::new();
    for round in 0..4 {
        for model in ["gpt-oss:120b", "qwen3-coder:480b"] {
            let reply = http
                .post_json(
                    &format!("{}/api/generate", stack.url()),
                    &[("authorization", "Bearer sk-consumer-0123456789")],
                    &json!({"model": model, "prompt": format!("round {round}"), "stream": false}),
                )
                .await;
            assert_eq!(reply.status, 200, "{}", reply.text());
        }
    }
    let mut keys_by_model: HashMap<String, std::collections::HashSet<String>> = HashMap::new();
    for request in cloud.handle().requests_to("/api/generate") {
        let model = request.json()["model"].as_str().unwrap().to_owned();
        keys_by_model
            .entry(model)
            .or_default()
            .insert(request.bearer().unwrap());
    }
    assert_eq!(keys_by_model.len(), 2);
    let gpt = &keys_by_model["gpt-oss:120b"];
    let qwen = &keys_by_model["qwen3-coder:480b"];
    assert_eq!(gpt.len(), 1, "one key keeps gpt-oss warm: {gpt:?}");
    assert_eq!(qwen.len(), 1, "one key keeps qwen3-coder warm: {qwen:?}");
    assert_ne!(gpt, qwen, "the two models do not share a key");
    stack.shutdown().await;
}

#[tokio::test]
async fn a_missing_cloud_model_falls_back_to_the_next_candidate() {
    let cloud = FakeOllama::builder()
        .model("qwen3-coder:480b")
        .cloud(&[
            "a1-0000000000000001",
            "a2-0000000000000002",
            "b1-0000000000000003",
        ])
        .spawn()
        .await;
    let fallback = "      fallback_models: [\"qwen3-coder:480b\"]\n";
    let stack = Stack::start(&cloud_config(&cloud.url(), fallback)).await;
    let reply = HttpClient::new()
        .post_json(
            &format!("{}/api/generate", stack.url()),
            &[("authorization", "Bearer sk-consumer-0123456789")],
            &json!({"model": "retired-model", "prompt": "hi", "stream": false}),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.header("x-model-fallback").as_deref(),
        Some("qwen3-coder:480b")
    );
    stack.shutdown().await;
}

async fn cloud_chat(http: &HttpClient, base: &str, model: &str) -> oqp_tests::client::Reply {
    http.post_json(
        &format!("{base}/api/chat"),
        &[("authorization", "Bearer sk-consumer-0123456789")],
        &json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": false}),
    )
    .await
}

/// The cloud pool as `/queue/status` shows it: (label, cooling, last error) per key.
async fn cloud_pool(http: &HttpClient, base: &str) -> Vec<(String, bool, Option<String>)> {
    let status = http
        .get(
            &format!("{base}/queue/status"),
            &[("authorization", "Bearer sk-consumer-0123456789")],
        )
        .await;
    status.json()["hosts"][0]["cloud_pool"]
        .as_array()
        .unwrap()
        .iter()
        .map(|key| {
            (
                key["label"].as_str().unwrap().to_owned(),
                !key["cooldown_until"].is_null(),
                key["last_error"].as_str().map(str::to_owned),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_model_needing_a_subscription_is_refused_as_is_and_every_key_keeps_serving_others() {
    let cloud = FakeOllama::builder()
        .model("gpt-oss:120b")
        .model("qwen3-coder:480b")
        .model("deepseek-v3.1:671b")
        .model("kimi-k2:1t")
        .cloud(&[
            "a1-0000000000000001",
            "a2-0000000000000002",
            "b1-0000000000000003",
        ])
        .spawn()
        .await;
    let handle = cloud.handle();
    handle.require_cloud_subscription("kimi-k2:1t", &[]);
    let stack = Stack::start(&cloud_config(&cloud.url(), "")).await;
    let http = HttpClient::new();

    let refused = cloud_chat(&http, &stack.url(), "kimi-k2:1t").await;
    assert_eq!(refused.status, 403, "{}", refused.text());
    let message = refused.json()["error"].as_str().unwrap().to_owned();
    assert!(message.contains("requires a subscription"), "{message}");
    assert!(message.contains("(ref: "), "the cloud's answer, as it was");
    // One try per account: alice's two keys share her subscription.
    let tried: Vec<String> = handle
        .requests_to("/api/chat")
        .iter()
        .map(|r| r.bearer().unwrap())
        .collect();
    assert_eq!(tried.len(), 2, "{tried:?}");
    assert!(
        tried.contains(&"b1-0000000000000003".to_owned()),
        "{tried:?}"
    );
    // Asked again, oqp answers from what it learnt, without asking the cloud.
    let again = cloud_chat(&http, &stack.url(), "kimi-k2:1t").await;
    assert_eq!(again.status, 403, "{}", again.text());
    assert_eq!(handle.requests_to("/api/chat").len(), 2);

    // No key is out of rotation, and every key still serves other models.
    let pool = cloud_pool(&http, &stack.url()).await;
    assert!(pool.iter().all(|(_, cooling, _)| !cooling), "{pool:?}");
    handle.clear_requests();
    for model in ["gpt-oss:120b", "qwen3-coder:480b", "deepseek-v3.1:671b"] {
        let reply = cloud_chat(&http, &stack.url(), model).await;
        assert_eq!(reply.status, 200, "{model}: {}", reply.text());
    }
    // Three models, each warm on its own key: every key served one.
    let served: std::collections::BTreeSet<String> = handle
        .requests_to("/api/chat")
        .iter()
        .map(|r| r.bearer().unwrap())
        .collect();
    assert_eq!(
        served,
        [
            "a1-0000000000000001",
            "a2-0000000000000002",
            "b1-0000000000000003"
        ]
        .map(String::from)
        .into(),
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn a_key_refused_everywhere_is_still_cooled() {
    // a1 is unknown to the cloud (401); b1 is suspended (403 even without a model).
    let cloud = FakeOllama::builder()
        .model("gpt-oss:120b")
        .model("qwen3-coder:480b")
        .cloud(&["a2-0000000000000002", "b1-0000000000000003"])
        .spawn()
        .await;
    let handle = cloud.handle();
    handle.suspend_cloud_key("b1-0000000000000003");
    let stack = Stack::start(&cloud_config(&cloud.url(), "")).await;
    let http = HttpClient::new();
    for model in ["gpt-oss:120b", "qwen3-coder:480b", "gpt-oss:120b"] {
        let reply = cloud_chat(&http, &stack.url(), model).await;
        assert_eq!(reply.status, 200, "{model}: {}", reply.text());
    }
    let pool = cloud_pool(&http, &stack.url()).await;
    let cooled: Vec<(&str, Option<&str>)> = pool
        .iter()
        .filter(|(_, cooling, _)| *cooling)
        .map(|(label, _, error)| (label.as_str(), error.as_deref()))
        .collect();
    assert_eq!(cooled.len(), 2, "{pool:?}");
    assert!(
        cooled.iter().all(|(_, error)| *error == Some("auth")),
        "{pool:?}"
    );
    // Only the good key is left: the next request goes straight to it.
    handle.clear_requests();
    assert_eq!(
        cloud_chat(&http, &stack.url(), "qwen3-coder:480b")
            .await
            .status,
        200
    );
    let asked: Vec<String> = handle
        .requests_to("/api/chat")
        .iter()
        .map(|r| r.bearer().unwrap())
        .collect();
    assert_eq!(asked, ["a2-0000000000000002"]);
    stack.shutdown().await;
}
