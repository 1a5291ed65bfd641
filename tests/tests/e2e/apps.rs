//! End to end: tenancy for apps. A key's model allowlist (`auth.keys[].models`) refuses every
//! other model on every route before anything else sees the request, and filters the
//! listings; an app key with `users` speaks for many people, each the sub-client
//! `<client_id>/<user>`, sharing the app's place in the queue fairly, each with its own cap and
//! budget, while the app as a whole keeps only its own share.

use oqp_tests::client::{HttpClient, Reply};
use oqp_tests::fake::{FakeOllama, USAGE_HEADER};
use oqp_tests::harness::Stack;
use serde_json::{Value, json};

use crate::support::{dispatcher, wait_depth};

const STUDENTS: &str = "sk-students-0123456789";
const OPEN: &str = "sk-open-0123456789";
const WEBUI: &str = "sk-webui-0123456789";
const LIBRECHAT: &str = "sk-librechat-0123456789";
const BLOCKER: &str = "sk-blocker-0123456789";
const BATCH: &str = "sk-batch-0123456789";
const USER_HEADER: &str = "X-OpenWebUI-User-Id";

fn config(url: &str, slots: u32, webui_users: &str) -> String {
    format!(
        r#"proxy:
  max_concurrent: 4
ollama:
  hosts:
    - url: "{url}"
      name: gpu
      max_concurrent: {slots}
queue:
  normal:
    max_depth: 200
embedding_cache:
  enabled: true
  backend: memory
auth:
  enabled: true
  keys:
    - key: "{STUDENTS}"
      client_id: students
      models: ["llama3.2*", "nomic-embed-text"]
    - key: "{OPEN}"
      client_id: open
    - key: "{WEBUI}"
      client_id: webui
      users:
        header: {USER_HEADER}
        session_header: X-OpenWebUI-Chat-Id
{webui_users}    - key: "{LIBRECHAT}"
      client_id: librechat
      users:
        body_field: user
    - key: "{BLOCKER}"
      client_id: blocker
    - key: "{BATCH}"
      client_id: batch
"#
    )
}

async fn post(base: &str, path: &str, key: &str, extra: &[(&str, &str)], body: &Value) -> Reply {
    let auth = format!("Bearer {key}");
    let mut headers = vec![("authorization", auth.as_str())];
    headers.extend_from_slice(extra);
    HttpClient::new()
        .post_json(&format!("{base}{path}"), &headers, body)
        .await
}

async fn get(base: &str, path: &str, key: &str) -> Reply {
    let auth = format!("Bearer {key}");
    HttpClient::new()
        .get(&format!("{base}{path}"), &[("authorization", &auth)])
        .await
}

fn chat(model: &str) -> Value {
    json!({"model": model, "stream": false, "messages": [{"role": "user", "content": "hi"}]})
}

/// Sends a chat as `user` of the webui key, in the background.
/// The GPU time each chat of [`spawn_chat`] reports (10 ms).
const FIXED_COST: &str = "total_duration=10000000";

fn spawn_chat(base: &str, key: &'static str, user: Option<&str>) -> tokio::task::JoinHandle<Reply> {
    let base = base.to_owned();
    let user = user.map(str::to_owned);
    tokio::spawn(async move {
        // Every chat reports the same GPU time, whatever the machine's load made its wall
        // time: fair share is by GPU time, and the shares are counted in requests.
        let mut extra = vec![(USAGE_HEADER, FIXED_COST)];
        if let Some(user) = &user {
            extra.push((USER_HEADER, user.as_str()));
        }
        post(&base, "/api/chat", key, &extra, &chat("llama3.2:3b")).await
    })
}

/// The names a listing shows.
fn names(body: &Value, list: &str, field: &str) -> Vec<String> {
    let mut names: Vec<String> = body[list]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry[field].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn a_models_list_refuses_other_models_on_every_route_and_filters_the_listings() {
    let fake = FakeOllama::builder()
        .model("llama3.2:3b")
        .model("qwen3:32b")
        .embedding_model("nomic-embed-text")
        .embedding_model("mxbai-embed-large")
        .loaded("llama3.2:3b")
        .loaded("qwen3:32b")
        .spawn()
        .await;
    let stack = Stack::start(&config(&fake.url(), 4, "")).await;
    let base = stack.url();
    let handle = fake.handle();

    // Another key puts an embedding of a model the students may not use in the cache.
    let embed = json!({"model": "mxbai-embed-large", "input": "hello"});
    assert_eq!(
        post(&base, "/api/embed", OPEN, &[], &embed).await.status,
        200
    );
    let seen = handle.requests().len();

    let refusals: [(&str, Value); 10] = [
        ("/api/chat", chat("qwen3:32b")),
        (
            "/api/generate",
            json!({"model": "qwen3:32b", "prompt": "hi", "stream": false}),
        ),
        ("/api/embed", embed.clone()),
        (
            "/v1/embeddings",
            json!({"model": "mxbai-embed-large", "input": "hello"}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "qwen3:32b", "messages": []}),
        ),
        (
            "/v1/messages",
            json!({"model": "qwen3:32b", "max_tokens": 8, "messages": []}),
        ),
        (
            "/v1/responses",
            json!({"model": "qwen3:32b", "input": "hi"}),
        ),
        ("/api/show", json!({"model": "qwen3:32b"})),
        (
            "/api/embeddings",
            json!({"model": "mxbai-embed-large", "prompt": "hello"}),
        ),
        (
            "/v1/completions",
            json!({"model": "qwen3:32b", "prompt": "hi"}),
        ),
    ];
    for (path, body) in &refusals {
        let reply = post(&base, path, STUDENTS, &[], body).await;
        assert_eq!(reply.status, 403, "{path}: {}", reply.text());
        let model = body["model"].as_str().unwrap();
        let message = format!("model '{model}' is not allowed for this key");
        let body = reply.json();
        match *path {
            "/v1/messages" => {
                assert_eq!(body["error"]["type"], "permission_error");
                assert_eq!(body["error"]["message"], message);
            }
            "/v1/responses" => {
                assert_eq!(body["error"]["code"], "model_not_allowed");
                assert_eq!(body["error"]["message"], message);
            }
            _ => assert_eq!(body["error"], message, "{path}"),
        }
        assert!(body["request_id"].is_string(), "{path}");
    }
    let reply = get(&base, "/v1/models/qwen3:32b", STUDENTS).await;
    assert_eq!(reply.status, 403);
    assert_eq!(
        handle.requests().len(),
        seen,
        "a refused model reaches nothing, not even through the embedding cache"
    );

    // Its own models work, in any spelling Ollama accepts.
    for model in ["llama3.2:3b", "LLAMA3.2:3B"] {
        assert_eq!(
            post(&base, "/api/chat", STUDENTS, &[], &chat(model))
                .await
                .status,
            200
        );
    }
    let embed = json!({"model": "nomic-embed-text", "input": "hello"});
    assert_eq!(
        post(&base, "/api/embed", STUDENTS, &[], &embed)
            .await
            .status,
        200
    );
    assert_eq!(
        get(&base, "/v1/models/llama3.2:3b", STUDENTS).await.status,
        200
    );

    // Listings show only what the key may use; a key without a list sees everything.
    let tags = get(&base, "/api/tags", STUDENTS).await;
    assert_eq!(tags.status, 200);
    assert_eq!(
        names(&tags.json(), "models", "name"),
        ["llama3.2:3b", "nomic-embed-text:latest"]
    );
    // Resident: both chat models, and both embedding models since they were used.
    let ps = get(&base, "/api/ps", STUDENTS).await;
    assert_eq!(
        names(&ps.json(), "models", "name"),
        ["llama3.2:3b", "nomic-embed-text:latest"]
    );
    assert_eq!(
        names(&get(&base, "/api/ps", OPEN).await.json(), "models", "name").len(),
        4
    );
    let models = get(&base, "/v1/models", STUDENTS).await;
    assert_eq!(
        names(&models.json(), "data", "id"),
        ["llama3.2:3b", "nomic-embed-text:latest"]
    );
    let all = get(&base, "/api/tags", OPEN).await;
    assert_eq!(names(&all.json(), "models", "name").len(), 4);
    let all = get(&base, "/v1/models", OPEN).await;
    assert_eq!(names(&all.json(), "data", "id").len(), 4);
    stack.shutdown().await;
}

#[tokio::test]
async fn an_apps_heavy_user_does_not_keep_its_light_user_waiting() {
    let fake = FakeOllama::builder()
        .model("llama3.2:3b")
        .slots(1)
        .spawn()
        .await;
    let stack = Stack::start(&config(&fake.url(), 1, "")).await;
    let base = stack.url();
    let handle = fake.handle();
    let queue = dispatcher(&stack);
    handle.hold();
    let blocker = spawn_chat(&base, BLOCKER, None);
    handle.wait_in_flight(1).await;
    let heavy: Vec<_> = (0..5)
        .map(|_| spawn_chat(&base, WEBUI, Some("heavy")))
        .collect();
    wait_depth(&queue, 5).await;
    let light = spawn_chat(&base, WEBUI, Some("light"));
    wait_depth(&queue, 6).await;
    handle.release_all();
    assert_eq!(blocker.await.unwrap().status, 200);
    assert_eq!(light.await.unwrap().status, 200);
    for task in heavy {
        assert_eq!(task.await.unwrap().status, 200);
    }
    let order: Vec<String> = handle
        .requests_to("/api/chat")
        .iter()
        .filter_map(|request| request.header("x-client-id"))
        .collect();
    assert_eq!(
        order,
        [
            "blocker",
            "webui/heavy",
            "webui/light",
            "webui/heavy",
            "webui/heavy",
            "webui/heavy",
            "webui/heavy"
        ]
    );
    // What Open WebUI says about its users stays in oqp.
    assert!(
        handle
            .requests()
            .iter()
            .all(|request| request.header("x-openwebui-user-id").is_none())
    );
    stack.shutdown().await;
}

/// Jain's fairness index of `shares`.
fn jain(shares: &[f64]) -> f64 {
    let sum: f64 = shares.iter().sum();
    let squares: f64 = shares.iter().map(|s| s * s).sum();
    sum * sum / (shares.len() as f64 * squares)
}

#[tokio::test]
async fn an_app_with_ten_users_gets_only_its_own_share_against_another_key() {
    let fake = FakeOllama::builder()
        .model("llama3.2:3b")
        .slots(1)
        .spawn()
        .await;
    let stack = Stack::start(&config(&fake.url(), 1, "")).await;
    let base = stack.url();
    let handle = fake.handle();
    let queue = dispatcher(&stack);
    handle.hold();
    let blocker = spawn_chat(&base, BLOCKER, None);
    handle.wait_in_flight(1).await;
    let mut tasks = Vec::new();
    for round in 0..3 {
        for user in 0..10 {
            tasks.push(spawn_chat(&base, WEBUI, Some(&format!("u{user}"))));
            tasks.push(spawn_chat(&base, BATCH, None));
        }
        wait_depth(&queue, 20 * (round + 1)).await;
    }
    handle.release_all();
    assert_eq!(blocker.await.unwrap().status, 200);
    for task in tasks {
        assert_eq!(task.await.unwrap().status, 200);
    }
    let order: Vec<String> = handle
        .requests_to("/api/chat")
        .iter()
        .skip(1)
        .filter_map(|request| request.header("x-client-id"))
        .collect();
    // While both are backlogged (the first 30 of 60), the app and the other key alternate.
    let app = order[..30]
        .iter()
        .filter(|c| c.starts_with("webui/"))
        .count() as f64;
    let index = jain(&[app, 30.0 - app]);
    println!("apps: the app with 10 users got {app} of the first 30, Jain over keys {index:.4}");
    assert!(index >= 0.97, "Jain {index} ({app} of 30 to the app)");
    stack.shutdown().await;
}

#[tokio::test]
async fn a_users_cap_and_budget_hold_per_user_while_other_users_run() {
    let fake = FakeOllama::builder()
        .model("llama3.2:3b")
        .slots(4)
        .spawn()
        .await;
    let users = "        max_concurrent: 1\n        budget: {tokens: 100, window: 1d}\n";
    let stack = Stack::start(&config(&fake.url(), 4, users)).await;
    let base = stack.url();
    let handle = fake.handle();
    let queue = dispatcher(&stack);
    handle.hold();
    let alice: Vec<_> = (0..2)
        .map(|_| spawn_chat(&base, WEBUI, Some("alice")))
        .collect();
    handle.wait_in_flight(1).await;
    wait_depth(&queue, 1).await;
    // Alice's second waits for her own cap; Bob runs beside her.
    let bob = spawn_chat(&base, WEBUI, Some("bob"));
    handle.wait_in_flight(2).await;
    assert_eq!(queue.total_depth(), 1);
    handle.release_all();
    for task in alice {
        assert_eq!(task.await.unwrap().status, 200);
    }
    assert_eq!(bob.await.unwrap().status, 200);
    assert_eq!(handle.peak_concurrency_of("webui/alice"), 1);

    // Alice spends her budget; Bob and the app itself still run.
    let spend = (USAGE_HEADER, "prompt_eval_count=90,eval_count=20");
    let reply = post(
        &base,
        "/api/chat",
        WEBUI,
        &[(USER_HEADER, "alice"), spend],
        &chat("llama3.2:3b"),
    )
    .await;
    assert_eq!(reply.status, 200);
    let refused = post(
        &base,
        "/api/chat",
        WEBUI,
        &[(USER_HEADER, "alice")],
        &chat("llama3.2:3b"),
    )
    .await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(
        refused.json()["error"],
        "budget exceeded: tokens 100 per 1d"
    );
    assert!(refused.header("retry-after").is_some());
    let bob = post(
        &base,
        "/api/chat",
        WEBUI,
        &[(USER_HEADER, "bob")],
        &chat("llama3.2:3b"),
    )
    .await;
    assert_eq!(bob.status, 200);
    let app = post(&base, "/api/chat", WEBUI, &[], &chat("llama3.2:3b")).await;
    assert_eq!(app.status, 200);
    assert_eq!(
        handle
            .requests_to("/api/chat")
            .iter()
            .filter(|request| request.header("x-client-id").as_deref() == Some("webui/alice"))
            .count(),
        3,
        "the refused request reached nothing"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn user_values_are_checked_and_only_delegating_keys_read_them() {
    let fake = FakeOllama::builder().model("llama3.2:3b").spawn().await;
    let stack = Stack::start(&config(&fake.url(), 4, "")).await;
    let base = stack.url();
    let handle = fake.handle();
    let long = "x".repeat(129);
    for bad in ["a/b", "has space", long.as_str(), ""] {
        let reply = HttpClient::new()
            .post_json(
                &format!("{base}/api/chat"),
                &[
                    ("authorization", &format!("Bearer {WEBUI}")),
                    (USER_HEADER, bad),
                ],
                &chat("llama3.2:3b"),
            )
            .await;
        assert_eq!(reply.status, 400, "{bad:?}: {}", reply.text());
        assert_eq!(
            reply.json()["error"],
            format!("invalid user in {USER_HEADER}")
        );
    }
    assert!(
        handle.requests_to("/api/chat").is_empty(),
        "a bad user reaches nothing"
    );

    // E-mail addresses and UUIDs are users; no user is the app itself.
    let fine = post(
        &base,
        "/api/chat",
        WEBUI,
        &[(USER_HEADER, "ada@example.org")],
        &chat("llama3.2:3b"),
    )
    .await;
    assert_eq!(fine.status, 200);
    assert_eq!(
        post(&base, "/api/chat", WEBUI, &[], &chat("llama3.2:3b"))
            .await
            .status,
        200
    );
    // A key without users: the header is ignored and goes no further.
    let open = post(
        &base,
        "/api/chat",
        OPEN,
        &[(USER_HEADER, "mallory")],
        &chat("llama3.2:3b"),
    )
    .await;
    assert_eq!(open.status, 200);
    // The body field of a key that reads users there (OpenAI's `user`).
    let body = json!({"model": "llama3.2:3b", "user": "u-42", "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(
        post(&base, "/v1/chat/completions", LIBRECHAT, &[], &body)
            .await
            .status,
        200
    );
    let bad = json!({"model": "llama3.2:3b", "user": 42, "messages": []});
    let reply = post(&base, "/v1/chat/completions", LIBRECHAT, &[], &bad).await;
    assert_eq!(reply.status, 400);
    assert_eq!(reply.json()["error"], "invalid user in body field user");

    let clients: Vec<String> = handle
        .requests()
        .iter()
        .filter_map(|request| request.header("x-client-id"))
        .collect();
    assert_eq!(
        clients,
        ["webui/ada@example.org", "webui", "open", "librechat/u-42"]
    );
    assert!(
        handle
            .requests()
            .iter()
            .all(|request| request.header("x-openwebui-user-id").is_none())
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn a_thousand_users_do_not_explode_the_metrics() {
    let fake = FakeOllama::builder()
        .model("llama3.2:3b")
        .slots(8)
        .spawn()
        .await;
    let stack = Stack::start(&config(&fake.url(), 8, "")).await;
    let base = stack.url();
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..8 {
        let base = base.clone();
        tasks.spawn(async move {
            for user in (worker..1000).step_by(8) {
                let user = format!("user-{user}");
                let reply = post(
                    &base,
                    "/api/chat",
                    WEBUI,
                    &[(USER_HEADER, &user)],
                    &chat("llama3.2:3b"),
                )
                .await;
                assert_eq!(reply.status, 200);
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    let metrics = HttpClient::new()
        .get(
            &format!("{base}/metrics"),
            &[("authorization", &format!("Bearer {OPEN}"))],
        )
        .await
        .text();
    let clients: std::collections::HashSet<&str> = metrics
        .lines()
        .filter(|line| line.starts_with("oqp_client_gpu_seconds_total{"))
        .filter_map(|line| line.split("client=\"").nth(1)?.split('"').next())
        .collect();
    let users = clients
        .iter()
        .filter(|client| client.starts_with("webui/"))
        .count();
    println!(
        "apps: 1000 users gave {} client label values ({users} per-user)",
        clients.len()
    );
    assert!(
        users <= oqp_dataplane::metrics::MAX_OTHER_LABELS,
        "{users} per-user series"
    );
    assert!(
        clients.contains("webui"),
        "the rest is counted under the app: {clients:?}"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn an_app_rotating_user_ids_is_held_to_its_own_metadata_bucket() {
    let fake = FakeOllama::builder().model("llama3.2").spawn().await;
    let yaml = config(&fake.url(), 2, "").replace(
        "auth:\n  enabled: true\n",
        "auth:\n  enabled: true\n  metadata_rate_limit: {per_second: 1, burst: 3}\n",
    );
    let stack = Stack::start(&yaml).await;
    let base = stack.url();
    let show = json!({"model": "llama3.2"});
    // A new user id every read: each user's bucket is full, the app's is not.
    let started = std::time::Instant::now();
    let mut served = 0;
    let refused = loop {
        let user = format!("user-{served}");
        let reply = post(&base, "/api/show", WEBUI, &[(USER_HEADER, &user)], &show).await;
        if reply.status != 200 {
            break reply;
        }
        served += 1;
        assert!(served < 20, "never limited");
    };
    let refilled = started.elapsed().as_secs_f64().ceil() as usize;
    assert!((3..=3 + refilled).contains(&served), "{served}");
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(refused.json()["error"], "too many metadata requests");
    // Another app has its own bucket.
    let other = post(&base, "/api/show", LIBRECHAT, &[], &show).await;
    assert_eq!(other.status, 200, "{}", other.text());
    stack.shutdown().await;
}

#[tokio::test]
async fn an_injection_port_believes_an_apps_users_only_when_it_says_trust_users() {
    let fake = FakeOllama::builder().model("llama3.2:3b").spawn().await;
    let free_port = async || {
        oqp_tests::harness::loopback()
            .await
            .local_addr()
            .unwrap()
            .port()
    };
    let (untrusting, trusting) = (free_port().await, free_port().await);
    let yaml = format!(
        "{}client_injection:\n  listeners:\n    - listen_port: {untrusting}\n      inject_as: webui\n    \
         - listen_port: {trusting}\n      inject_as: webui\n      trust_users: true\n",
        config(&fake.url(), 2, "")
    );
    let stack = Stack::start(&yaml).await;
    for port in [untrusting, trusting] {
        assert!(
            oqp_tests::client::eventually(std::time::Duration::from_secs(30), || {
                std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            })
            .await,
            "port {port} opened"
        );
    }
    let send = async |port: u16| {
        HttpClient::new()
            .post_json(
                &format!("http://127.0.0.1:{port}/api/chat"),
                &[(USER_HEADER, "mallory")],
                &chat("llama3.2:3b"),
            )
            .await
    };
    // Anyone who reaches a port without a credential could name any user: the request is
    // the app's own there.
    let reply = send(untrusting).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let reply = send(trusting).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let seen: Vec<Option<String>> = fake
        .handle()
        .requests_to("/api/chat")
        .iter()
        .map(|request| request.header("x-client-id"))
        .collect();
    assert_eq!(
        seen,
        [Some("webui".to_owned()), Some("webui/mallory".to_owned())]
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn a_key_with_a_models_list_sees_only_its_models_in_the_queue_status() {
    let fake = FakeOllama::builder()
        .model("llama3.2:3b")
        .model("qwen")
        .loaded("qwen")
        .loaded("llama3.2:3b")
        .spawn()
        .await;
    let stack = Stack::start(&config(&fake.url(), 2, "")).await;
    let base = stack.url();
    let models = |status: &Value, list: &str| -> Vec<String> {
        status["hosts"][0][list]
            .as_array()
            .unwrap_or_else(|| panic!("{status}"))
            .iter()
            .filter_map(|model| model.as_str().map(str::to_owned))
            .collect()
    };
    // The host's models as the control plane polled them, seen by a key without a list
    // (waited for, bounded: the first poll may not have reached the data plane yet).
    let mut everything = Value::Null;
    for _ in 0..100 {
        everything = get(&base, "/queue/status", OPEN).await.json();
        if models(&everything, "loaded_models").len() == 2 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        models(&everything, "models")
            .iter()
            .any(|m| m.starts_with("qwen")),
        "{everything}"
    );
    assert_eq!(
        models(&everything, "loaded_models").len(),
        2,
        "{everything}"
    );
    // The limited key: only what it may use.
    let limited = get(&base, "/queue/status", STUDENTS).await;
    assert_eq!(limited.status, 200, "{}", limited.text());
    let limited = limited.json();
    for list in ["models", "loaded_models"] {
        let seen = models(&limited, list);
        assert!(!seen.is_empty(), "{list}: {limited}");
        assert!(
            seen.iter().all(|model| model.starts_with("llama3.2")),
            "{list}: {limited}"
        );
    }
    stack.shutdown().await;
}

#[tokio::test]
async fn a_key_with_a_models_list_sees_only_its_models_in_the_metrics() {
    const WATCHER: &str = "sk-watcher-0123456789";
    const OPERATOR: &str = "sk-operator-0123456789";
    let fake = FakeOllama::builder()
        .model("llama3.2:3b")
        .model("qwen")
        .spawn()
        .await;
    // Two more keys, both of scope read: one limited to the students' models.
    let readers = format!(
        "    - key: \"{WATCHER}\"\n      client_id: watcher\n      scope: read\n      \
         models: [\"llama3.2*\"]\n    - key: \"{OPERATOR}\"\n      client_id: operator\n      \
         scope: read\n"
    );
    let stack = Stack::start(&config(&fake.url(), 2, &readers)).await;
    let base = stack.url();
    for (key, model) in [(STUDENTS, "llama3.2:3b"), (OPEN, "qwen")] {
        let reply = post(&base, "/api/chat", key, &[], &chat(model)).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let series = |text: &str, model: &str| {
        text.lines()
            .filter(|line| !line.starts_with('#') && line.contains(&format!("model=\"{model}")))
            .count()
    };
    // Every model's series, for a key without a list (waited for, bounded: the counters are
    // written as each answer ends).
    let mut everything = String::new();
    for _ in 0..100 {
        let reply = get(&base, "/metrics", OPERATOR).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        everything = reply.text();
        if series(&everything, "qwen") > 0 && series(&everything, "llama3.2") > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(series(&everything, "qwen") > 0, "{everything}");
    // The limited key: its model's series and those with no model label, no other model's.
    let limited = get(&base, "/metrics", WATCHER).await;
    assert_eq!(limited.status, 200, "{}", limited.text());
    let limited = limited.text();
    assert!(series(&limited, "llama3.2") > 0, "{limited}");
    assert_eq!(series(&limited, "qwen"), 0, "{limited}");
    assert!(
        limited.contains("oqp_concurrency_active "),
        "series without a model label stay: {limited}"
    );
    assert!(
        limited.contains("# TYPE oqp_client_gpu_seconds_total counter"),
        "{limited}"
    );
    stack.shutdown().await;
}
