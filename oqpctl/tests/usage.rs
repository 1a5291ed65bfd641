//! `oqpctl usage`, and the usage columns of `clients` and `keys list`, end to end: the real
//! binary against a real control plane whose data plane served real traffic to the fake
//! Ollama (which reports the figures each request chose).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Output;
use std::time::{Duration, Instant};

use oqp_tests::client::HttpClient;
use oqp_tests::fake::{FakeOllama, USAGE_HEADER};
use oqp_tests::harness::Stack;
use serde_json::{Value, json};

const ADMIN: &str = "sk-admin-0123456789";
const CHAT: &str = "sk-chat-0123456789";
const BATCH: &str = "sk-batch-0123456789";

/// The host has 128 slots: the control plane takes from a data plane at most what its slots
/// could have done (a minute of each, just started), and the figures here are nearly two
/// hours of GPU time reported within a second.
fn config(url: &str, state: &str) -> String {
    format!(
        "ollama:\n  hosts:\n    - {{url: '{url}', name: gpu, max_concurrent: 128}}\n\
         embedding_cache: {{enabled: true, backend: memory}}\n\
         auth:\n  enabled: true\n  keys:\n\
         \x20   - {{key: {ADMIN}, client_id: admin, scope: management}}\n\
         \x20   - {{key: {CHAT}, client_id: chat}}\n\
         \x20   - {{key: {BATCH}, client_id: batch, budget: {{gpu_seconds: 2h, tokens: 2000000, window: 1d}}}}\n\
         control_plane:\n  state_dir: '{state}'\n"
    )
}

async fn oqpctl(stack: &Stack, args: &[&str]) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_oqpctl"))
        .arg("--control-plane")
        .arg(stack.control_url())
        .arg("--no-color")
        .args(args)
        .env("OQPCTL_KEY", ADMIN)
        .env_remove("OQP_CONTROL_PLANE")
        .output()
        .await
        .unwrap()
}

fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "oqpctl failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

async fn post(stack: &Stack, key: &str, path: &str, reported: &str, body: Value) {
    let auth = format!("Bearer {key}");
    let reply = HttpClient::new()
        .post_json(
            &format!("{}{path}", stack.url()),
            &[("authorization", &auth), (USAGE_HEADER, reported)],
            &body,
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

#[tokio::test]
async fn usage_shows_gpu_time_tokens_requests_and_cache_hits() {
    let fake = FakeOllama::builder()
        .model("llama3")
        .model("qwen")
        .embedding_model("nomic-embed-text")
        .slots(4)
        .spawn()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let stack = Stack::start(&config(&fake.url(), &state.display().to_string())).await;
    let chat = |stream: bool, model: &str| json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream});
    // batch: two long generations (45 min and 1 h 2 min 3 s of GPU time, as the fake reports).
    post(
        &stack,
        BATCH,
        "/api/chat",
        "total_duration=2700000000000,prompt_eval_count=1200,eval_count=48000",
        chat(false, "llama3"),
    )
    .await;
    post(
        &stack,
        BATCH,
        "/api/chat",
        "total_duration=3723000000000,prompt_eval_count=800,eval_count=52000",
        chat(true, "qwen"),
    )
    .await;
    // chat: short ones, and an embed answered the second time from the cache.
    post(
        &stack,
        CHAT,
        "/api/chat",
        "total_duration=61500000000,prompt_eval_count=35,eval_count=410",
        chat(true, "llama3"),
    )
    .await;
    post(
        &stack,
        CHAT,
        "/api/generate",
        "total_duration=4000000000,prompt_eval_count=12,eval_count=90",
        json!({"model": "llama3", "prompt": "hi", "stream": false}),
    )
    .await;
    let embed = json!({"model": "nomic-embed-text", "input": ["alpha", "beta", "gamma"]});
    post(
        &stack,
        CHAT,
        "/api/embed",
        "total_duration=300000000,prompt_eval_count=9",
        embed.clone(),
    )
    .await;
    post(&stack, CHAT, "/api/embed", "", embed).await;

    // Wait (bounded) until the data plane's report has reached the control plane.
    let deadline = Instant::now() + Duration::from_secs(10);
    let json = loop {
        let text = stdout(&oqpctl(&stack, &["usage", "--output", "json"]).await);
        let value: Value = serde_json::from_str(&text).unwrap();
        if value["total"]["requests"] == 6 || Instant::now() >= deadline {
            break value;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(json["total"]["requests"], 6, "{json}");
    assert_eq!(json["rows"][0]["client_id"], "batch", "most GPU time first");
    assert_eq!(json["rows"][0]["gpu_seconds"], 6423.0);
    assert_eq!(json["rows"][0]["completion_tokens"], 100_000);
    assert_eq!(json["rows"][1]["client_id"], "chat");
    assert_eq!(json["rows"][1]["gpu_seconds"], 65.8);
    assert_eq!(json["rows"][1]["cached_inputs"], 3);
    assert_eq!(json["rows"][1]["embedding_inputs"], 3);
    assert!(json["rows"][0].get("model").is_none());

    let table = stdout(&oqpctl(&stack, &["usage"]).await);
    println!("$ oqpctl usage\n{table}");
    assert!(table.contains("| batch  | 1:47:03  |"), "{table}");
    assert!(table.contains("| chat   | 0:01:05  |"), "{table}");
    assert!(table.contains("| total  | 1:48:08  |"), "{table}");

    let by_both =
        stdout(&oqpctl(&stack, &["usage", "--since", "7d", "--by", "client,model"]).await);
    println!("$ oqpctl usage --since 7d --by client,model\n{by_both}");
    let lines: Vec<&str> = by_both
        .lines()
        .filter(|line| line.starts_with("| "))
        .collect();
    assert!(lines[1].starts_with("| batch  | qwen "), "{by_both}");
    assert!(lines[2].starts_with("| batch  | llama3 "), "{by_both}");
    assert!(by_both.contains("nomic-embed-text"), "{by_both}");
    let by_model = stdout(&oqpctl(&stack, &["usage", "--by", "model", "-o", "json"]).await);
    let by_model: Value = serde_json::from_str(&by_model).unwrap();
    assert_eq!(by_model["rows"][0]["model"], "qwen");
    assert_eq!(by_model["rows"][1]["model"], "llama3");
    assert_eq!(by_model["rows"][1]["gpu_seconds"], 2765.5);

    // clients: GPU time today.
    let clients = stdout(&oqpctl(&stack, &["clients", "-o", "json"]).await);
    let clients: Value = serde_json::from_str(&clients).unwrap();
    let batch = clients
        .as_array()
        .unwrap()
        .iter()
        .find(|client| client["client_id"] == "batch")
        .unwrap();
    assert_eq!(batch["gpu_seconds_today"], 6423.0);
    let table = stdout(&oqpctl(&stack, &["clients"]).await);
    assert!(table.contains("GPU today"), "{table}");
    assert!(table.contains("1:47:03"), "{table}");

    // keys list: the budget and what is left of it (unwrapped, with --wide).
    let keys = stdout(&oqpctl(&stack, &["keys", "list", "--wide"]).await);
    println!("$ oqpctl keys list\n{keys}");
    assert!(keys.contains("2:00:00 GPU, 2000000 tokens / 1d"), "{keys}");
    assert!(keys.contains("0:12:57 GPU, 1898000 tokens"), "{keys}");
    let keys = stdout(&oqpctl(&stack, &["keys", "list", "-o", "json"]).await);
    let keys: Value = serde_json::from_str(&keys).unwrap();
    let batch = keys
        .as_array()
        .unwrap()
        .iter()
        .find(|key| key["client_id"] == "batch")
        .unwrap();
    assert_eq!(batch["budget"]["left_gpu_seconds"], 777.0);
    assert_eq!(batch["budget"]["used_tokens"], 102_000);

    // The README's examples of this section run as written.
    let commands = readme_commands();
    assert!(commands.len() >= 6, "{commands:?}");
    for command in &commands {
        let args: Vec<&str> = command.split_whitespace().skip(1).collect();
        let output = stdout(&oqpctl(&stack, &args).await);
        assert!(!output.is_empty(), "{command}");
    }
    let keys = stdout(&oqpctl(&stack, &["keys", "list", "--wide"]).await);
    assert!(keys.contains("| nightly "), "{keys}");
    assert!(keys.contains("2:00:00 GPU, 2000000 tokens / 1d"), "{keys}");
    stack.shutdown().await;
}

/// The README section "Usage and budgets", from its marker to the next section.
fn readme_section() -> String {
    let readme = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"),
    )
    .unwrap();
    let marker = "<!-- usage examples: oqpctl/tests/usage.rs";
    let after = &readme[readme.find(marker).expect("the README marks the examples")..];
    after[..after.find("\n## ").unwrap()].to_owned()
}

/// Every `oqpctl` command line of the section's sh blocks, continuations joined and
/// comments dropped.
fn readme_commands() -> Vec<String> {
    let section = readme_section();
    let mut commands = Vec::new();
    let mut in_sh = false;
    let mut pending = String::new();
    for line in section.lines() {
        if line.starts_with("```") {
            in_sh = line == "```sh";
            continue;
        }
        if !in_sh {
            continue;
        }
        let code = line.split(" #").next().unwrap_or_default().trim_end();
        if let Some(continued) = code.strip_suffix('\\') {
            pending.push_str(continued);
            continue;
        }
        pending.push_str(code);
        if pending.starts_with("oqpctl ") {
            commands.push(std::mem::take(&mut pending));
        }
        pending.clear();
    }
    commands
}

#[test]
fn the_readme_budget_config_loads() {
    let section = readme_section();
    let start = section.find("```yaml\n").unwrap() + 8;
    let yaml = &section[start..start + section[start..].find("```").unwrap()];
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("oqp-nightly");
    std::fs::write(&key, "sk-nightly-0123456789\n").unwrap();
    let yaml = format!(
        "ollama:\n  hosts:\n    - {{url: 'http://127.0.0.1:9', name: gpu}}\n{}",
        yaml.replace("/run/secrets/oqp-nightly", &key.display().to_string())
    );
    let config = oqp_controlplane::config::load_str(&yaml, &oqp_controlplane::config::Env::empty())
        .unwrap()
        .config;
    let budget = config.auth.keys[0].budget.unwrap();
    assert_eq!(budget.gpu_ns, 7_200_000_000_000);
    assert_eq!(budget.tokens, 2_000_000);
    assert_eq!(budget.window.as_str(), "1d");
}

const WEBUI: &str = "sk-webui-0123456789";

#[tokio::test]
async fn an_apps_users_are_rows_of_their_own_and_fold_into_the_app() {
    let fake = FakeOllama::builder().model("llama3").slots(4).spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let yaml = config(&fake.url(), &state.display().to_string()).replace(
        "  keys:\n",
        &format!(
            "  keys:\n    - {{key: {WEBUI}, client_id: webui, users: {{header: X-OpenWebUI-User-Id}}}}\n"
        ),
    );
    let stack = Stack::start(&yaml).await;
    let chat = json!({"model": "llama3", "messages": [{"role": "user", "content": "hi"}], "stream": false});
    for (user, gpu) in [
        (Some("alice"), 30),
        (Some("bob"), 20),
        (Some("alice"), 10),
        (None, 5),
    ] {
        let auth = format!("Bearer {WEBUI}");
        let reported = format!("total_duration={gpu}000000000,prompt_eval_count=10,eval_count=5");
        let mut headers = vec![
            ("authorization", auth.as_str()),
            (USAGE_HEADER, reported.as_str()),
        ];
        if let Some(user) = user {
            headers.push(("x-openwebui-user-id", user));
        }
        let reply = HttpClient::new()
            .post_json(&format!("{}/api/chat", stack.url()), &headers, &chat)
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let json = loop {
        let text = stdout(&oqpctl(&stack, &["usage", "--output", "json"]).await);
        let value: Value = serde_json::from_str(&text).unwrap();
        if value["total"]["requests"] == 4 || Instant::now() >= deadline {
            break value;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let rows: Vec<(String, f64)> = json["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            (
                row["client_id"].as_str().unwrap().to_owned(),
                row["gpu_seconds"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("webui/alice".to_owned(), 40.0),
            ("webui/bob".to_owned(), 20.0),
            ("webui".to_owned(), 5.0)
        ]
    );
    let table = stdout(&oqpctl(&stack, &["usage", "--by", "client"]).await);
    println!("oqpctl usage --by client\n{table}");
    assert!(table.contains("webui/alice") && table.contains("webui/bob"));
    let folded = stdout(&oqpctl(&stack, &["usage", "--by", "app", "--output", "json"]).await);
    let folded: Value = serde_json::from_str(&folded).unwrap();
    assert_eq!(folded["rows"].as_array().unwrap().len(), 1, "{folded}");
    assert_eq!(folded["rows"][0]["client_id"], "webui");
    assert_eq!(folded["rows"][0]["gpu_seconds"], 65.0);
    assert_eq!(folded["rows"][0]["requests"], 4);
    let table = stdout(&oqpctl(&stack, &["usage", "--by", "app"]).await);
    println!("oqpctl usage --by app\n{table}");
    assert!(
        table.contains("| app ") && !table.contains("webui/"),
        "{table}"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn a_stored_key_takes_a_models_list_that_the_data_plane_enforces() {
    let fake = FakeOllama::builder()
        .model("llama3.2:3b")
        .model("qwen3:32b")
        .spawn()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let stack = Stack::start(&config(&fake.url(), &state.display().to_string())).await;
    let added = stdout(
        &oqpctl(
            &stack,
            &[
                "keys",
                "add",
                "students",
                "--max-priority",
                "normal",
                "--scope",
                "inference",
                "--models",
                "llama3.2*, qwen2:*",
                "--output",
                "json",
            ],
        )
        .await,
    );
    let added: Value = serde_json::from_str(&added).unwrap();
    assert_eq!(added["models"], json!(["llama3.2*", "qwen2:*"]));
    let key = added["key"].as_str().unwrap().to_owned();
    let version = added["snapshot_version"].as_u64().unwrap();
    stack.wait_for_version(version).await;
    let list = stdout(&oqpctl(&stack, &["keys", "list", "--wide"]).await);
    assert!(list.contains("llama3.2*, qwen2:*"), "{list}");
    assert!(
        list.contains("all"),
        "a key without a list may use every model: {list}"
    );
    let auth = format!("Bearer {key}");
    let ask = |model: &str| {
        let auth = auth.clone();
        let url = format!("{}/api/chat", stack.url());
        let body = json!({"model": model, "messages": [], "stream": false});
        async move {
            HttpClient::new()
                .post_json(&url, &[("authorization", &auth)], &body)
                .await
        }
    };
    assert_eq!(ask("llama3.2:3b").await.status, 200);
    let refused = ask("qwen3:32b").await;
    assert_eq!(refused.status, 403);
    assert_eq!(
        refused.json()["error"],
        "model 'qwen3:32b' is not allowed for this key"
    );
    let bad = oqpctl(
        &stack,
        &[
            "keys",
            "add",
            "nope",
            "--max-priority",
            "normal",
            "--scope",
            "inference",
            "--models",
            "a b",
        ],
    )
    .await;
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a model name pattern"));
    stack.shutdown().await;
}
