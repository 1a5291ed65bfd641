//! End to end: keep_alive insertion, OpenAI `/v1/embeddings`, and the
//! per-item embedding cache (in-process and on a real `redis-server`).

use crate::support;

use std::time::Duration;

use base64::Engine;
use oqp_tests::client::HttpClient;
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::Stack;
use serde_json::{Value, json};

fn config(url: &str, extra: &str) -> String {
    format!(
        "proxy:\n  max_concurrent: 4\nollama:\n  hosts:\n    - url: \"{url}\"\n      name: primary\n      max_concurrent: 4\n{extra}"
    )
}

const MEMORY_CACHE: &str = "embedding_cache:\n  enabled: true\n  backend: memory\n";

async fn post(http: &HttpClient, url: &str, body: &str) -> oqp_tests::client::Reply {
    http.send(
        "POST".parse().unwrap(),
        url,
        &[("content-type", "application/json")],
        body.to_owned(),
    )
    .await
}

#[tokio::test]
async fn keep_alive_is_inserted_without_touching_other_bytes() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), "keep_alive:\n  default: \"10m\"\n")).await;
    let http = HttpClient::new();
    let body = r#"{"model":"llama3","prompt":"h\u00e9llo wörld","options":{"temperature":0.10,"seed":1e3},"stream":false}"#;
    assert_eq!(
        post(&http, &format!("{}/api/generate", stack.url()), body)
            .await
            .status,
        200
    );
    let seen = fake.handle().requests_to("/api/generate");
    let expected = format!("{},\"keep_alive\":\"10m\"}}", &body[..body.len() - 1]);
    assert_eq!(String::from_utf8_lossy(&seen[0].body), expected);

    // The client's own value wins (ollama-python sends floats).
    let own = r#"{"model":"llama3","prompt":"x","keep_alive":-1.0,"stream":false}"#;
    post(&http, &format!("{}/api/generate", stack.url()), own).await;
    assert_eq!(
        fake.handle().requests_to("/api/generate")[1].body,
        own.as_bytes()
    );

    // Bodies that are not JSON objects pass through untouched.
    let odd = "[1, 2]";
    post(&http, &format!("{}/api/chat", stack.url()), odd).await;
    assert_eq!(
        fake.handle().requests_to("/api/chat")[0].body,
        odd.as_bytes()
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn override_replaces_the_clients_keep_alive() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let extra = "keep_alive:\n  default: -1\n  override: true\n";
    let stack = Stack::start(&config(&fake.url(), extra)).await;
    let body = r#"{"model":"llama3","keep_alive":0,"prompt":"x","stream":false}"#;
    post(
        &HttpClient::new(),
        &format!("{}/api/generate", stack.url()),
        body,
    )
    .await;
    let seen = fake.handle().requests_to("/api/generate");
    assert_eq!(
        String::from_utf8_lossy(&seen[0].body),
        r#"{"model":"llama3","keep_alive":-1,"prompt":"x","stream":false}"#
    );
    stack.shutdown().await;
}

/// One POST with a bearer key, answered 200.
async fn post_as(http: &HttpClient, url: &str, key: &str, body: &str) {
    let auth = format!("Bearer {key}");
    let reply = http
        .send(
            "POST".parse().unwrap(),
            url,
            &[
                ("content-type", "application/json"),
                ("authorization", auth.as_str()),
            ],
            body.to_owned(),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

#[tokio::test]
async fn while_holding_is_on_only_a_management_key_keeps_its_own_keep_alive() {
    let fake = FakeOllama::builder()
        .model("llama3")
        .embedding_model("all-minilm")
        .spawn()
        .await;
    let keys = "keep_alive:\n  default: \"10m\"\nauth:\n  enabled: true\n  keys:\n    \
                - key: \"sk-tenant-0123456789\"\n      client_id: tenant\n    \
                - key: \"sk-admin-01234567890\"\n      client_id: admin\n      \
                scope: management\n";
    let http = HttpClient::new();
    let generate = r#"{"model":"llama3","prompt":"x","stream":false,"keep_alive":0}"#;
    let replaced = r#"{"model":"llama3","prompt":"x","stream":false,"keep_alive":"10m"}"#;
    let embed = r#"{"model":"all-minilm","input":"x","keep_alive":0}"#;
    let embed_replaced = r#"{"model":"all-minilm","input":"x","keep_alive":"10m"}"#;
    let last = |path: &str| {
        let seen = fake.handle().requests_to(path);
        String::from_utf8_lossy(&seen.last().unwrap().body).into_owned()
    };

    // Holding on (the default): a tenant's `keep_alive: 0` would unload a model every tenant
    // shares; it gets the default, on the queued path and through the embedding cache.
    let extra = format!("{keys}{MEMORY_CACHE}");
    let stack = Stack::start(&config(&fake.url(), &extra)).await;
    let url = |path: &str| format!("{}{path}", stack.url());
    post_as(
        &http,
        &url("/api/generate"),
        "sk-tenant-0123456789",
        generate,
    )
    .await;
    assert_eq!(last("/api/generate"), replaced);
    post_as(&http, &url("/api/embed"), "sk-tenant-0123456789", embed).await;
    assert_eq!(last("/api/embed"), embed_replaced);
    // The operator's management key keeps its own.
    post_as(
        &http,
        &url("/api/generate"),
        "sk-admin-01234567890",
        generate,
    )
    .await;
    assert_eq!(last("/api/generate"), generate);
    stack.shutdown().await;

    // Holding off: every client's own value passes, as `keep_alive.override: false` says.
    let extra = format!("{keys}queue:\n  model_swap:\n    enabled: false\n");
    let stack = Stack::start(&config(&fake.url(), &extra)).await;
    let url = format!("{}/api/generate", stack.url());
    post_as(&http, &url, "sk-tenant-0123456789", generate).await;
    assert_eq!(last("/api/generate"), generate);
    stack.shutdown().await;
}

/// Posts `body` to `path` as the tenant and returns the body Ollama received.
async fn sent_as_tenant(
    http: &HttpClient,
    stack: &Stack,
    fake: &FakeOllama,
    path: &str,
    body: String,
) -> String {
    let url = format!("{}{path}", stack.url());
    post_as(http, &url, "sk-tenant-0123456789", &body).await;
    let seen = fake.handle().requests_to(path);
    String::from_utf8_lossy(&seen.last().unwrap().body).into_owned()
}

#[tokio::test]
async fn while_holding_is_on_a_tenants_positive_keep_alive_passes_up_to_max() {
    let fake = FakeOllama::builder()
        .model("llama3")
        .embedding_model("all-minilm")
        .spawn()
        .await;
    let extra = format!(
        "keep_alive:\n  default: \"10m\"\n  max: \"15m\"\nauth:\n  enabled: true\n  keys:\n    \
         - key: \"sk-tenant-0123456789\"\n      client_id: tenant\n{MEMORY_CACHE}"
    );
    let stack = Stack::start(&config(&fake.url(), &extra)).await;
    let http = HttpClient::new();
    let generate = |keep_alive: &str| {
        format!(r#"{{"model":"llama3","prompt":"x","stream":false,"keep_alive":{keep_alive}}}"#)
    };
    let sent = |path: &'static str, body: String| sent_as_tenant(&http, &stack, &fake, path, body);

    // Inside the window (one second to `keep_alive.max`): as the client wrote it, string or
    // number (ollama-python sends floats).
    for asked in [r#""12m""#, "600.0", r#""15m""#, r#""1s""#] {
        assert_eq!(
            sent("/api/generate", generate(asked)).await,
            generate(asked)
        );
    }
    // Longer: cut to `max`, in seconds.
    for asked in [r#""2h""#, "3600"] {
        assert_eq!(
            sent("/api/generate", generate(asked)).await,
            generate("900")
        );
    }
    // An unload, a pin, or no duration: the default, as before.
    for asked in ["0", "0.0", r#""500ms""#, "-1", r#""-1m""#, "null"] {
        assert_eq!(
            sent("/api/generate", generate(asked)).await,
            generate(r#""10m""#),
            "{asked}"
        );
    }
    // The same rule through the embedding cache's path.
    // (Each with its own input: a cache hit would not reach Ollama.)
    let embed = |keep_alive: &str| {
        format!(
            r#"{{"model":"all-minilm","input":"x {}","keep_alive":{keep_alive}}}"#,
            keep_alive.trim_matches('"')
        )
    };
    assert_eq!(
        sent("/api/embed", embed(r#""12m""#)).await,
        embed(r#""12m""#)
    );
    let cut = embed(r#""1h""#).replace(r#","keep_alive":"1h""#, r#","keep_alive":900"#);
    assert_eq!(sent("/api/embed", embed(r#""1h""#)).await, cut);
    // Ollama reads the last of several members: the rule is applied to that one.
    let twice =
        r#"{"model":"llama3","prompt":"x","stream":false,"keep_alive":"12m","Keep_Alive":0}"#;
    assert_eq!(
        sent("/api/generate", twice.to_owned()).await,
        r#"{"model":"llama3","prompt":"x","stream":false,"keep_alive":"10m","Keep_Alive":"10m"}"#
    );
    stack.shutdown().await;
}

fn decode_base64(embedding: &Value) -> Vec<f32> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(embedding.as_str().unwrap())
        .unwrap();
    bytes
        .chunks_exact(4)
        .map(|chunk| f32::from_le_bytes(chunk.try_into().unwrap()))
        .collect()
}

#[tokio::test]
async fn openai_embeddings_round_trip_as_floats_and_base64() {
    let fake = FakeOllama::builder()
        .embedding_model("all-minilm")
        .spawn()
        .await;
    let stack = Stack::start(&config(&fake.url(), "")).await;
    let http = HttpClient::new();
    let url = format!("{}/v1/embeddings", stack.url());
    let floats = http
        .post_json(
            &url,
            &[],
            &json!({"model": "all-minilm", "input": ["alpha", "beta"]}),
        )
        .await;
    assert_eq!(floats.status, 200, "{}", floats.text());
    let floats = floats.json();
    assert_eq!(floats["object"], "list");
    assert_eq!(floats["model"], "all-minilm");
    assert_eq!(floats["data"][1]["index"], 1);
    assert!(floats["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    let encoded = http
        .post_json(
            &url,
            &[],
            &json!({"model": "all-minilm", "input": ["alpha", "beta"], "encoding_format": "base64"}),
        )
        .await;
    assert!(encoded.header("x-queue-wait-time").is_some());
    assert_eq!(
        encoded.header("x-failover-host").as_deref(),
        Some("primary")
    );
    let encoded = encoded.json();
    for index in 0..2 {
        let expected: Vec<f32> = floats["data"][index]["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(
            decode_base64(&encoded["data"][index]["embedding"]),
            expected
        );
    }
    // Ollama saw its own /api/embed.
    assert_eq!(fake.handle().requests_to("/api/embed").len(), 2);
    // Errors come back in OpenAI's shape.
    let missing = http
        .post_json(&url, &[], &json!({"model": "nope", "input": "x"}))
        .await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json()["error"]["type"], "not_found_error");
    stack.shutdown().await;
}

#[tokio::test]
async fn repeated_items_never_reach_the_gpu_twice() {
    let fake = FakeOllama::builder()
        .embedding_model("all-minilm")
        .spawn()
        .await;
    let stack = Stack::start(&config(&fake.url(), MEMORY_CACHE)).await;
    let http = HttpClient::new();
    let url = format!("{}/api/embed", stack.url());
    let first = post(&http, &url, r#"{"model":"all-minilm","input":["a","b"]}"#).await;
    assert_eq!(first.header("x-cache").as_deref(), Some("MISS"));
    let again = post(
        &http,
        &url,
        r#"{"model": "all-minilm", "input": ["a", "b"]}"#,
    )
    .await;
    assert_eq!(again.header("x-cache").as_deref(), Some("HIT"));
    assert_eq!(again.json()["embeddings"], first.json()["embeddings"]);
    assert_eq!(fake.handle().requests_to("/api/embed").len(), 1);

    // Partly new: only the new item goes upstream; the order is kept.
    let partial = post(
        &http,
        &url,
        r#"{"model":"all-minilm","input":["c","a","b"]}"#,
    )
    .await;
    assert_eq!(partial.header("x-cache").as_deref(), Some("PARTIAL"));
    let sent = fake.handle().requests_to("/api/embed")[1].json();
    assert_eq!(sent["input"], json!(["c"]));
    let vectors = partial.json()["embeddings"].clone();
    assert_eq!(vectors[1], first.json()["embeddings"][0]);
    assert_eq!(vectors[2], first.json()["embeddings"][1]);

    // Fields that change the vectors are part of the key.
    let smaller = post(
        &http,
        &url,
        r#"{"model":"all-minilm","input":["a"],"dimensions":4}"#,
    )
    .await;
    assert_eq!(smaller.header("x-cache").as_deref(), Some("MISS"));
    assert_eq!(smaller.json()["embeddings"][0].as_array().unwrap().len(), 4);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_identical_misses_make_one_upstream_request() {
    let _exclusive = crate::support::exclusive().await;
    let fake = FakeOllama::builder()
        .embedding_model("all-minilm")
        .slots(4)
        .latency(Duration::from_millis(200))
        .spawn()
        .await;
    let stack = Stack::start(&config(&fake.url(), MEMORY_CACHE)).await;
    let http = HttpClient::new();
    let url = format!("{}/api/embed", stack.url());
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let http = http.clone();
            let url = url.clone();
            tokio::spawn(async move {
                post(
                    &http,
                    &url,
                    r#"{"model":"all-minilm","input":"the same text"}"#,
                )
                .await
            })
        })
        .collect();
    let mut bodies = Vec::new();
    for task in tasks {
        let reply = task.await.unwrap();
        assert_eq!(reply.status, 200);
        bodies.push(reply.json()["embeddings"].clone());
    }
    assert!(bodies.windows(2).all(|pair| pair[0] == pair[1]));
    assert_eq!(fake.handle().requests_to("/api/embed").len(), 1);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cache_survives_redis_dying_and_resumes_when_it_returns() {
    let _exclusive = crate::support::exclusive().await;
    let redis = support::Redis::start(0).await;
    let fake = FakeOllama::builder()
        .embedding_model("all-minilm")
        .spawn()
        .await;
    let extra = format!(
        "embedding_cache:\n  enabled: true\n  backend: \"redis://127.0.0.1:{}/0\"\n  connect_timeout: 1\n",
        redis.port
    );
    let stack = Stack::start(&config(&fake.url(), &extra)).await;
    let http = HttpClient::new();
    let url = format!("{}/api/embed", stack.url());
    let body = r#"{"model":"all-minilm","input":["shared text"]}"#;
    assert_eq!(
        post(&http, &url, body).await.header("x-cache").as_deref(),
        Some("MISS")
    );
    assert_eq!(
        post(&http, &url, body).await.header("x-cache").as_deref(),
        Some("HIT")
    );

    let port = redis.kill();
    for _ in 0..5 {
        let reply = post(&http, &url, body).await;
        assert_eq!(reply.status, 200, "a dead cache fails no request");
        assert_eq!(reply.header("x-cache").as_deref(), Some("MISS"));
    }
    let _redis = support::Redis::start(port).await;
    // The cache notices on its own (a background ping, no event to wait
    // on): poll, bounded; the first store after that fills it again, then
    // hits resume without a restart.
    let mut hit = false;
    for _ in 0..200 {
        let reply = post(&http, &url, body).await;
        assert_eq!(reply.status, 200);
        if reply.header("x-cache").as_deref() == Some("HIT") {
            hit = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(hit, "hits resumed after redis came back");
    stack.shutdown().await;
}

#[tokio::test]
async fn an_unreachable_redis_at_start_is_a_clear_error() {
    let fake = FakeOllama::builder().spawn().await;
    let port = oqp_tests::bench::procs::free_port().unwrap();
    let extra = format!(
        "embedding_cache:\n  enabled: true\n  backend: \"redis://:hunter2@127.0.0.1:{port}/0\"\n  connect_timeout: 1\n"
    );
    let error = Stack::try_start(
        &config(&fake.url(), &extra),
        oqp_controlplane::config::Env::empty(),
    )
    .await
    .expect_err("the data plane refuses to start without its cache");
    let message = error.to_string();
    assert!(message.contains(&port.to_string()), "{message}");
    assert!(
        !message.contains("hunter2"),
        "the password is never shown: {message}"
    );
}

#[tokio::test]
async fn more_inputs_than_max_inputs_is_a_413_naming_the_limit() {
    let fake = FakeOllama::builder()
        .embedding_model("all-minilm")
        .spawn()
        .await;
    let extra = format!("{MEMORY_CACHE}  max_inputs: 3\n");
    let stack = Stack::start(&config(&fake.url(), &extra)).await;
    let http = HttpClient::new();
    let four = r#"{"model":"all-minilm","input":["a","b","c","d"]}"#;
    for path in ["/api/embed", "/v1/embeddings"] {
        let reply = post(&http, &format!("{}{path}", stack.url()), four).await;
        assert_eq!(reply.status, 413, "{path}");
        let error = reply.json()["error"].as_str().unwrap().to_owned();
        assert!(error.contains("at most 3"), "{path}: {error}");
        assert!(
            error.contains("embedding_cache.max_inputs"),
            "{path}: {error}"
        );
    }
    assert!(fake.handle().requests_to("/api/embed").is_empty());
    // At the limit, the request is served (and cached) as before.
    let three = r#"{"model":"all-minilm","input":["a","b","a","c"]}"#;
    let reply = post(&http, &format!("{}/api/embed", stack.url()), three).await;
    assert_eq!(reply.status, 413, "four inputs, even with a repeat");
    let three = r#"{"model":"all-minilm","input":["a","b","c"]}"#;
    let reply = post(&http, &format!("{}/api/embed", stack.url()), three).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json()["embeddings"].as_array().unwrap().len(), 3);
    stack.shutdown().await;
}

/// One `POST` with a key and a tier, in the background.
fn spawn_post(
    http: &HttpClient,
    url: String,
    key: &str,
    tier: &str,
    body: &'static str,
) -> tokio::task::JoinHandle<oqp_tests::client::Reply> {
    let http = http.clone();
    let auth = format!("Bearer {key}");
    let tier = tier.to_owned();
    tokio::spawn(async move {
        http.send(
            "POST".parse().unwrap(),
            &url,
            &[
                ("authorization", &auth),
                ("x-queue-priority", &tier),
                ("content-type", "application/json"),
            ],
            body.to_owned(),
        )
        .await
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_high_tier_embed_does_not_wait_behind_a_low_tier_fetch_of_the_same_text() {
    let _exclusive = crate::support::exclusive().await;
    let fake = FakeOllama::builder()
        .model("llama3")
        .embedding_model("all-minilm")
        .slots(1)
        .spawn()
        .await;
    let auth = "auth:\n  enabled: true\n  keys:\n    - key: \"sk-chat-0123456789\"\n      client_id: chat\n      max_priority: high\n    - key: \"sk-batch-0123456789\"\n      client_id: batch\n      max_priority: low\n";
    let extra = format!("{MEMORY_CACHE}{auth}");
    let yaml = config(&fake.url(), &extra).replace("max_concurrent: 4\n{", "max_concurrent: 1\n{");
    let yaml = yaml.replacen("      max_concurrent: 4", "      max_concurrent: 1", 1);
    let stack = Stack::start(&yaml).await;
    let dispatcher = stack.control.dataplane().unwrap().app().dispatcher.clone();
    let depth = |n: u32| {
        let dispatcher = dispatcher.clone();
        async move {
            assert!(
                oqp_tests::client::eventually(Duration::from_secs(30), || {
                    dispatcher.total_depth() == n
                })
                .await,
                "queue depth never reached {n} (is {})",
                dispatcher.total_depth()
            );
        }
    };
    let http = HttpClient::new();
    let handle = fake.handle();
    handle.hold();
    // The low tier holds the only slot, and a low embed of X waits behind it.
    let flood = spawn_post(
        &http,
        format!("{}/api/generate", stack.url()),
        "sk-batch-0123456789",
        "low",
        r#"{"model":"llama3","prompt":"hi","stream":false}"#,
    );
    handle.wait_in_flight(1).await;
    const X: &str = r#"{"model":"all-minilm","input":"the text X"}"#;
    let url = format!("{}/api/embed", stack.url());
    let low = spawn_post(&http, url.clone(), "sk-batch-0123456789", "low", X);
    depth(1).await;
    // The high embed of X queues in its own tier rather than waiting on the
    // low request's flight.
    let high = spawn_post(&http, url, "sk-chat-0123456789", "high", X);
    depth(2).await;
    handle.release(1);
    assert_eq!(flood.await.unwrap().status, 200);
    // The freed slot goes to the high embed: the fake sees it first.
    assert!(
        oqp_tests::client::eventually(Duration::from_secs(30), || {
            !handle.requests_to("/api/embed").is_empty()
        })
        .await
    );
    let embeds = handle.requests_to("/api/embed");
    assert_eq!(embeds.len(), 1);
    assert_eq!(
        embeds[0]
            .headers
            .get("x-client-id")
            .map(|v| v.to_str().unwrap()),
        Some("chat")
    );
    handle.release(1);
    let high = high.await.unwrap();
    assert_eq!(high.status, 200);
    assert_eq!(high.header("x-cache").as_deref(), Some("MISS"));
    // The low embed still runs (or finds the vector stored by then).
    handle.release_all();
    let low = low.await.unwrap();
    assert_eq!(low.status, 200);
    assert_eq!(low.json()["embeddings"], high.json()["embeddings"]);
    stack.shutdown().await;
}

/// The raw text of the `embeddings` value of an `/api/embed` answer.
fn raw_embeddings(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let start = text.find(r#""embeddings":"#).expect("embeddings") + r#""embeddings":"#.len();
    let end = text[start..].find("]]").expect("end of embeddings") + start + 2;
    text[start..end].to_owned()
}

#[tokio::test]
async fn a_4096_dimension_embedding_is_cached_by_default_and_comes_back_byte_identical() {
    let fake = FakeOllama::builder()
        .embedding_model("qwen3-embedding")
        .embedding_dimension(4096)
        .spawn()
        .await;
    let stack = Stack::start(&config(&fake.url(), MEMORY_CACHE)).await;
    let http = HttpClient::new();
    let url = format!("{}/api/embed", stack.url());
    let first = post(
        &http,
        &url,
        r#"{"model":"qwen3-embedding","input":["a","b"]}"#,
    )
    .await;
    assert_eq!(first.header("x-cache").as_deref(), Some("MISS"));
    let uncached = raw_embeddings(&first.body);
    assert!(uncached.len() > 2 * 32_768, "{} bytes", uncached.len());
    let again = post(
        &http,
        &url,
        r#"{"model":"qwen3-embedding","input":["a","b"]}"#,
    )
    .await;
    assert_eq!(again.header("x-cache").as_deref(), Some("HIT"));
    assert_eq!(raw_embeddings(&again.body), uncached);
    // One of them, with a new text: the cached numbers are Ollama's, byte for byte.
    let partial = post(
        &http,
        &url,
        r#"{"model":"qwen3-embedding","input":["b","c"]}"#,
    )
    .await;
    assert_eq!(partial.header("x-cache").as_deref(), Some("PARTIAL"));
    let b = &uncached[uncached.find("],[").unwrap() + 2..uncached.len() - 1];
    assert!(raw_embeddings(&partial.body).starts_with(&format!("[{b},")));
    assert_eq!(fake.handle().requests_to("/api/embed").len(), 2);
    stack.shutdown().await;
}
