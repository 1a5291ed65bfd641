//! End to end with engines: host kinds (`openai`, `auto`), discovery and
//! health per kind, through the real planes. Against llama.cpp's
//! `llama-server` (built by `scripts/setup.sh`, started by
//! `oqp_tests::engine` on loopback) serving a random-weight model, and
//! against the fake Ollama where a real engine is not needed. Without the
//! binary the real-engine tests are skipped, except in CI. No assertion
//! looks at the model's text: only at statuses, shapes, counts and what the
//! engine reports about itself.

use std::time::Duration;

use oqp_tests::client::{HttpClient, wait_until};
use oqp_tests::engine::{self, Engine, Model};
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::{ConfigYaml, Host, Stack};
use serde_json::{Value, json};

/// How long a test waits for a poll to show (polls run every second).
const PATIENCE: Duration = Duration::from_secs(20);

/// A config of `hosts` (`(name, url, kind)`), polled every second, model-aware routing.
fn config(hosts: &[(&str, &str, &str)]) -> String {
    hosts
        .iter()
        .fold(
            ConfigYaml::new().max_concurrent(4),
            |yaml, (name, url, kind)| yaml.host(Host::openai(name, url).set("kind", kind)),
        )
        .strategy("model_aware")
        .under("routing", "  model_poll_timeout: 2\n")
        .yaml()
}

/// Polls the data plane's `/queue/status` until host `name` satisfies
/// `check`; returns that host's entry.
async fn wait_host(stack: &Stack, name: &str, check: impl Fn(&Value) -> bool) -> Value {
    let http = HttpClient::new();
    // Another process's poll has no event to wait on from here.
    let seen = wait_until(PATIENCE, || async {
        let status = http
            .get(&format!("{}/queue/status", stack.url()), &[])
            .await
            .json();
        let host = status["hosts"]
            .as_array()
            .and_then(|hosts| hosts.iter().find(|host| host["name"] == name))
            .cloned()
            .unwrap_or(Value::Null);
        if check(&host) { Ok(host) } else { Err(host) }
    })
    .await;
    seen.unwrap_or_else(|host| panic!("host {name} never matched; last seen: {host}"))
}

/// A chat completion through oqp for `model`; returns (status, the host that served it).
async fn chat(http: &HttpClient, base: &str, model: &str) -> (u16, Option<String>) {
    let reply = http
        .post_json(
            &format!("{base}/v1/chat/completions"),
            &[],
            &json!({
                "model": model,
                "messages": [{"role": "user", "content": "Say something."}],
                "max_tokens": 2,
            }),
        )
        .await;
    (reply.status.as_u16(), reply.header("x-failover-host"))
}

#[tokio::test]
async fn an_openai_host_is_polled_by_its_v1_models() {
    let fake = FakeOllama::builder()
        .model("qwen3")
        .model("llama3")
        .spawn()
        .await;
    let stack = Stack::start(&config(&[("engine", &fake.url(), "openai")])).await;
    let host = wait_host(&stack, "engine", |host| host["healthy"] == true).await;
    assert_eq!(host["kind"], "openai", "{host}");
    assert_eq!(host["engine"], "openai", "{host}");
    assert_eq!(
        host["models"],
        json!(["llama3:latest", "qwen3:latest"]),
        "{host}"
    );
    assert!(host.get("configured_kind").is_none(), "{host}");
    // The fake has no /props: no slots learned, none claimed.
    assert!(host.get("engine_slots").is_none(), "{host}");
    let metrics = HttpClient::new()
        .get(&format!("{}/metrics", stack.url()), &[])
        .await
        .text();
    assert!(
        metrics.contains(r#"oqp_host_info{engine="openai",kind="openai",name="engine"} 1"#),
        "{metrics}"
    );
    assert!(!metrics.contains("oqp_host_engine_slots{"), "{metrics}");
    stack.shutdown().await;
}

#[tokio::test]
async fn an_openai_host_that_lists_no_model_is_down() {
    let fake = FakeOllama::builder().spawn().await;
    let stack = Stack::start(&config(&[("empty", &fake.url(), "openai")])).await;
    let host = wait_host(&stack, "empty", |host| host["healthy"] == false).await;
    assert_eq!(host["models"], json!([]), "{host}");
    assert_eq!(host["poll_error"], "/v1/models: lists no models", "{host}");
    stack.shutdown().await;
}

#[tokio::test]
async fn auto_detects_an_ollama_host() {
    let fake = FakeOllama::builder().model("qwen3").spawn().await;
    let stack = Stack::start(&config(&[("box", &fake.url(), "auto")])).await;
    let host = wait_host(&stack, "box", |host| host["engine"] == "ollama").await;
    assert_eq!(host["kind"], "ollama", "{host}");
    assert_eq!(host["configured_kind"], "auto", "{host}");
    assert_eq!(host["healthy"], true, "{host}");
    assert_eq!(host["models"], json!(["qwen3:latest"]), "{host}");
    stack.shutdown().await;
}

#[tokio::test]
async fn llama_servers_are_healthy_with_their_models_and_slots_and_get_their_models() {
    if !engine::installed() {
        return;
    }
    let chat_engine = Engine::builder(Model::Chat)
        .alias("oqp-tiny:latest")
        .parallel(2)
        .context(2048)
        .start()
        .await;
    let embed_engine = Engine::builder(Model::Embed)
        .alias("oqp-embed:latest")
        .parallel(1)
        .context(512)
        .start()
        .await;
    let stack = Stack::start(&config(&[
        ("chat", &chat_engine.url(), "openai"),
        ("embed", &embed_engine.url(), "auto"),
        // The chat engine again, configured as Ollama: it has no /api/tags.
        ("wrong", &chat_engine.url(), "ollama"),
    ]))
    .await;

    let chat_host = wait_host(&stack, "chat", |host| host["engine_slots"] == 2).await;
    assert_eq!(chat_host["healthy"], true, "{chat_host}");
    assert_eq!(chat_host["kind"], "openai", "{chat_host}");
    assert_eq!(chat_host["engine"], "llama-server", "{chat_host}");
    assert_eq!(
        chat_host["models"],
        json!(["oqp-tiny:latest"]),
        "{chat_host}"
    );
    assert_eq!(chat_host["slot_context"], 1024, "{chat_host}");
    // A llama-server holds its one model loaded.
    assert_eq!(
        chat_host["loaded_models"],
        json!(["oqp-tiny:latest"]),
        "{chat_host}"
    );

    let embed_host = wait_host(&stack, "embed", |host| host["engine_slots"] == 1).await;
    assert_eq!(embed_host["healthy"], true, "{embed_host}");
    assert_eq!(embed_host["kind"], "openai", "{embed_host}");
    assert_eq!(embed_host["configured_kind"], "auto", "{embed_host}");
    assert_eq!(embed_host["engine"], "llama-server", "{embed_host}");
    assert_eq!(
        embed_host["models"],
        json!(["oqp-embed:latest"]),
        "{embed_host}"
    );

    let metrics = HttpClient::new()
        .get(&format!("{}/metrics", stack.url()), &[])
        .await
        .text();
    assert!(
        metrics.contains(r#"oqp_host_engine_slots{name="chat"} 2"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"oqp_host_info{engine="llama-server",kind="openai",name="embed"} 1"#),
        "{metrics}"
    );

    // A kind that does not match the server is a host that is down, not a
    // host routed to blind.
    let wrong = wait_host(&stack, "wrong", |host| host["healthy"] == false).await;
    assert_eq!(wrong["models"], json!([]), "{wrong}");
    let error = wrong["poll_error"].as_str().unwrap_or_default();
    assert!(error.contains("kind: openai"), "{wrong}");
    assert!(chat_host.get("poll_error").is_none(), "{chat_host}");

    // Model-aware routing by the discovered models: each request goes to the
    // engine that lists its model, every time.
    let http = HttpClient::new();
    for _ in 0..3 {
        let (status, host) = chat(&http, &stack.url(), "oqp-tiny:latest").await;
        assert_eq!((status, host.as_deref()), (200, Some("chat")));
        let (status, host) = chat(&http, &stack.url(), "oqp-embed").await;
        assert_eq!((status, host.as_deref()), (200, Some("embed")));
    }
    stack.shutdown().await;
    chat_engine.stop().await;
    embed_engine.stop().await;
}

#[tokio::test]
async fn the_harness_runs_a_real_llama_server() {
    if !engine::installed() {
        return;
    }
    let engine = Engine::builder(Model::Chat)
        .alias("oqp-tiny:latest")
        .parallel(2)
        .context(4096)
        .start()
        .await;
    let client = HttpClient::new();
    let base = engine.url();

    let health = client.get(&format!("{base}/health"), &[]).await;
    assert_eq!(health.status, 200, "{}", health.text());
    assert_eq!(health.json()["status"], "ok");

    let props = client.get(&format!("{base}/props"), &[]).await;
    assert_eq!(props.status, 200, "{}", props.text());
    let props = props.json();
    assert_eq!(props["total_slots"], 2);
    // `n_ctx` is per slot: the total context shared by two slots.
    assert_eq!(props["default_generation_settings"]["n_ctx"], 2048);
    assert_eq!(props["model_alias"], "oqp-tiny:latest");

    let models = client.get(&format!("{base}/v1/models"), &[]).await;
    assert_eq!(models.status, 200, "{}", models.text());
    let models = models.json();
    let data = models["data"].as_array().expect("a data array");
    assert_eq!(data.len(), 1, "{models}");
    assert_eq!(data[0]["id"], "oqp-tiny:latest");

    let chat = client
        .post_json(
            &format!("{base}/v1/chat/completions"),
            &[],
            &json!({
                "model": "oqp-tiny:latest",
                "messages": [{"role": "user", "content": "Say something."}],
                "max_tokens": 4,
            }),
        )
        .await;
    assert_eq!(chat.status, 200, "{}", chat.text());
    let chat = chat.json();
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
    let usage = &chat["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 0, "{chat}");
    assert!(usage["completion_tokens"].as_u64().unwrap() <= 4, "{chat}");
    assert!(chat["timings"]["prompt_n"].as_u64().is_some(), "{chat}");

    let slots = client.get(&format!("{base}/slots"), &[]).await;
    assert_eq!(slots.status, 200, "{}", slots.text());
    assert_eq!(slots.json().as_array().map(Vec::len), Some(2));
}

#[tokio::test]
async fn the_embedding_engine_answers_embeddings() {
    if !engine::installed() {
        return;
    }
    let engine = Engine::builder(Model::Embed)
        .alias("oqp-embed:latest")
        .parallel(1)
        .context(512)
        .start()
        .await;
    let client = HttpClient::new();
    let reply = client
        .post_json(
            &format!("{}/v1/embeddings", engine.url()),
            &[],
            &json!({"model": "oqp-embed:latest", "input": ["one", "two"]}),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let reply = reply.json();
    let data = reply["data"].as_array().expect("a data array");
    assert_eq!(data.len(), 2);
    assert_eq!(data[0]["embedding"].as_array().map(Vec::len), Some(128));
}

/// The value of the first sample of `/metrics` whose line contains every part of `parts`.
fn sample(metrics: &str, parts: &[&str]) -> Option<f64> {
    metrics
        .lines()
        .filter(|line| !line.starts_with('#'))
        .find(|line| parts.iter().all(|part| line.contains(part)))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
}

#[tokio::test]
async fn embeddings_reach_an_openai_host_as_openai_and_are_cached_per_item() {
    if !engine::installed() {
        return;
    }
    let embed_engine = Engine::builder(Model::Embed)
        .alias("oqp-embed:latest")
        .parallel(1)
        .context(512)
        .start()
        .await;
    let yaml = config(&[("embed", &embed_engine.url(), "openai")])
        + "embedding_cache:\n  enabled: true\n  backend: memory\n";
    let stack = Stack::start(&yaml).await;
    wait_host(&stack, "embed", |host| host["healthy"] == true).await;
    let http = HttpClient::new();
    let url = format!("{}/v1/embeddings", stack.url());
    let embed = |input: Value, format: &'static str| {
        let http = &http;
        let url = &url;
        async move {
            let body =
                json!({"model": "oqp-embed:latest", "input": input, "encoding_format": format});
            let reply = http.post_json(url, &[], &body).await;
            assert_eq!(reply.status, 200, "{}", reply.text());
            let cache = reply.header("x-cache").unwrap_or_default();
            (cache, reply.json())
        }
    };

    let (cache, first) = embed(json!(["one", "two"]), "float").await;
    assert_eq!(cache, "MISS");
    assert_eq!(first["object"], "list", "{first}");
    assert_eq!(first["model"], "oqp-embed:latest", "{first}");
    let data = first["data"].as_array().expect("a data array");
    assert_eq!(data.len(), 2, "{first}");
    for (index, item) in data.iter().enumerate() {
        assert_eq!(item["index"], index, "{first}");
        assert_eq!(item["embedding"].as_array().map(Vec::len), Some(128));
    }
    let tokens = first["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    assert!(tokens > 0, "{first}");

    // The same request again: answered from the cache, the same vectors.
    let (cache, second) = embed(json!(["one", "two"]), "float").await;
    assert_eq!(cache, "HIT");
    assert_eq!(second["data"], first["data"]);

    // One cached item and one new, in base64: only the new one goes to the engine.
    let (cache, third) = embed(json!(["two", "three"]), "base64").await;
    assert_eq!(cache, "PARTIAL");
    let data = third["data"].as_array().expect("a data array");
    assert_eq!(data.len(), 2, "{third}");
    assert!(
        data.iter().all(|item| item["embedding"].is_string()),
        "{third}"
    );

    let metrics = HttpClient::new()
        .get(&format!("{}/metrics", stack.url()), &[])
        .await
        .text();
    let counted = sample(
        &metrics,
        &[
            "oqp_client_tokens_total{",
            r#"kind="prompt""#,
            r#"model="oqp-embed:latest""#,
        ],
    );
    assert!(
        counted.is_some_and(|counted| counted >= tokens as f64),
        "{metrics}"
    );

    // The engine's own error comes back as it sent it: a 501 without `--embedding`.
    let chat_engine = Engine::builder(Model::Chat)
        .alias("oqp-tiny:latest")
        .parallel(1)
        .context(512)
        .start()
        .await;
    stack.shutdown().await;
    let stack = Stack::start(&config(&[("chat", &chat_engine.url(), "openai")])).await;
    wait_host(&stack, "chat", |host| host["healthy"] == true).await;
    let reply = http
        .post_json(
            &format!("{}/v1/embeddings", stack.url()),
            &[],
            &json!({"model": "oqp-tiny:latest", "input": "one"}),
        )
        .await;
    assert_eq!(reply.status, 501, "{}", reply.text());
    let error = reply.json();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("embeddings"),
        "{error}"
    );
    stack.shutdown().await;
    embed_engine.stop().await;
    chat_engine.stop().await;
}

#[tokio::test]
async fn an_engines_errors_reach_the_client_unchanged_and_count_as_the_hosts_errors() {
    if !engine::installed() {
        return;
    }
    // Two slots sharing one pool of 1,024 tokens (`-kvu`): a prompt over it is refused
    // with a 400; two streams that together outgrow it both fail inside their 200.
    let chat_engine = Engine::builder(Model::Chat)
        .alias("oqp-tiny:latest")
        .parallel(2)
        .context(1024)
        .arg("-kvu")
        .start()
        .await;
    let stack = Stack::start(&config(&[("chat", &chat_engine.url(), "openai")])).await;
    wait_host(&stack, "chat", |host| host["engine_slots"] == 2).await;
    let http = HttpClient::new();
    let url = format!("{}/v1/chat/completions", stack.url());

    let long = json!({
        "model": "oqp-tiny:latest",
        "messages": [{"role": "user", "content": engine::random_words(1, 400)}],
        "max_tokens": 2,
    });
    let refused = http.post_json(&url, &[], &long).await;
    assert_eq!(refused.status, 400, "{}", refused.text());
    let error = refused.json();
    assert_eq!(
        error["error"]["type"], "exceed_context_size_error",
        "{error}"
    );
    assert_eq!(error["error"]["n_ctx"], 1024, "{error}");

    let stream = |seed: u64| {
        json!({
            "model": "oqp-tiny:latest",
            "messages": [{"role": "user", "content": engine::random_words(seed, 120)}],
            "max_tokens": 700,
            "stream": true,
        })
    };
    let (first, second) = (stream(2), stream(3));
    let (first, second) = tokio::join!(
        http.post_json(&url, &[], &first),
        http.post_json(&url, &[], &second)
    );
    for reply in [&first, &second] {
        assert_eq!(reply.status, 200, "{}", reply.text());
        let text = reply.text();
        let last = text.trim_end().lines().last().unwrap_or_default();
        assert!(last.starts_with(r#"data: {"error":"#), "{text}");
        assert!(!text.contains("[DONE]"), "{text}");
    }

    let metrics = http
        .get(&format!("{}/metrics", stack.url()), &[])
        .await
        .text();
    let errors = |place: &str| {
        sample(
            &metrics,
            &[&format!(
                r#"oqp_host_errors_total{{name="chat",where="{place}"}}"#
            )],
        )
    };
    assert_eq!(errors("status"), Some(1.0), "{metrics}");
    assert_eq!(errors("in_band"), Some(2.0), "{metrics}");
    let host = wait_host(&stack, "chat", |host| host["answered_errors"] == 3).await;
    assert_eq!(host["healthy"], true, "{host}");
    stack.shutdown().await;
    chat_engine.stop().await;
}

/// One turn of a conversation as a real engine saw it.
#[derive(Debug, Clone)]
struct Turn {
    affinity: String,
    host: String,
    prompt_tokens: u64,
    cache_n: u64,
}

/// Runs a conversation of `turns` turns through oqp at `url`: `start` words of random text,
/// then `more` words a turn, each answer (a few tokens, never looked at) kept in the history.
async fn converse(url: &str, seed: u64, turns: usize, start: usize, more: usize) -> Vec<Turn> {
    let http = HttpClient::new();
    let mut messages = Vec::new();
    let mut seen = Vec::new();
    for turn in 0..turns {
        let words = if turn == 0 { start } else { more };
        let text = engine::random_words(seed * 100 + turn as u64, words);
        messages.push(json!({"role": "user", "content": text}));
        let body = json!({"model": "oqp-tiny:latest", "messages": messages, "max_tokens": 4});
        let reply = http.post_json(url, &[], &body).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        let answer = reply.json();
        messages.push(answer["choices"][0]["message"].clone());
        seen.push(Turn {
            affinity: reply.header("x-oqp-affinity").unwrap_or_default(),
            host: reply.header("x-failover-host").unwrap_or_default(),
            prompt_tokens: answer["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
            cache_n: answer["timings"]["cache_n"].as_u64().unwrap_or(0),
        });
    }
    seen
}

#[tokio::test]
async fn follow_ups_on_real_llama_servers_are_hits_that_find_their_history_cached() {
    if !engine::installed() {
        return;
    }
    let mut engines = Vec::new();
    for _ in 0..2 {
        let engine = Engine::builder(Model::Chat)
            .alias("oqp-tiny:latest")
            .parallel(2)
            .context(16384);
        engines.push(engine.start().await);
    }
    let yaml = engines
        .iter()
        .enumerate()
        .fold(
            ConfigYaml::new().max_concurrent(8),
            |yaml, (index, engine)| {
                let host = Host::openai(&format!("e{index}"), &engine.url());
                yaml.host(host.set("max_concurrent", 2))
            },
        )
        .strategy("model_aware")
        .under("routing", "  model_poll_timeout: 2\n")
        .yaml();
    let stack = Stack::start(&yaml).await;
    for index in 0..2 {
        wait_host(&stack, &format!("e{index}"), |host| {
            host["engine_slots"] == 2
        })
        .await;
    }
    let url = format!("{}/v1/chat/completions", stack.url());
    let conversations =
        futures_util::future::join_all((1..=4).map(|seed| converse(&url, seed, 5, 150, 60))).await;
    let mut report = String::new();
    for (index, turns) in conversations.iter().enumerate() {
        report.push_str(&format!("conversation {index}: {turns:?}\n"));
    }
    for turns in &conversations {
        assert_eq!(turns[0].affinity, "new", "{report}");
        for pair in turns.windows(2) {
            let (before, turn) = (&pair[0], &pair[1]);
            assert_eq!(turn.affinity, "hit", "{report}");
            assert_eq!(turn.host, before.host, "{report}");
            assert!(turn.cache_n * 10 >= before.prompt_tokens * 9, "{report}");
        }
    }

    // Eight more conversations: more than the engines' slots, so conversations are set aside
    // in each llama-server's RAM prompt cache and restored when they come back. Whatever
    // the placement, the label says what the engine found: a follow-up is a `hit` exactly
    // when its history was cached where it went.
    let conversations =
        futures_util::future::join_all((5..=12).map(|seed| converse(&url, seed, 4, 150, 60))).await;
    let mut report = String::new();
    for (index, turns) in conversations.iter().enumerate() {
        report.push_str(&format!("conversation {index}: {turns:?}\n"));
    }
    let mut hits = 0;
    for turns in &conversations {
        for pair in turns.windows(2) {
            let (before, turn) = (&pair[0], &pair[1]);
            let cached = turn.cache_n * 10 >= before.prompt_tokens * 9;
            assert_eq!(turn.affinity == "hit", cached, "{report}");
            hits += usize::from(cached);
        }
    }
    assert!(hits > 0, "{report}");
    stack.shutdown().await;
    for engine in engines {
        engine.stop().await;
    }
}

/// One engine of two slots, three conversations taking turns one at a time: each new turn
/// finds both slots holding the other two, so oqp names the slot of the one used least
/// recently and the engine restores the returning conversation from its RAM prompt cache
/// into it. Every follow-up is a `hit` that finds its history cached, and after each turn
/// one of the engine's slots holds that turn's whole prompt (`/slots`).
#[tokio::test]
async fn three_conversations_on_two_named_slots_come_back_cached_one_at_a_time() {
    if !engine::installed() {
        return;
    }
    let engine = Engine::builder(Model::Chat)
        .alias("oqp-tiny:latest")
        .parallel(2)
        .context(8192)
        .start()
        .await;
    let yaml = ConfigYaml::new()
        .max_concurrent(4)
        .host(Host::openai("e0", &engine.url()).set("max_concurrent", 2))
        .strategy("model_aware")
        .under("routing", "  model_poll_timeout: 2\n")
        .yaml();
    let stack = Stack::start(&yaml).await;
    wait_host(&stack, "e0", |host| host["engine_slots"] == 2).await;
    let http = HttpClient::new();
    let url = format!("{}/v1/chat/completions", stack.url());
    let mut histories = vec![Vec::new(); 3];
    let mut previous = [0u64; 3];
    let mut report = String::new();
    for turn in 0..3 {
        for (conversation, messages) in histories.iter_mut().enumerate() {
            let words = if turn == 0 { 120 } else { 40 };
            let seed = 9000 + (conversation * 10 + turn) as u64;
            messages.push(json!({"role": "user", "content": engine::random_words(seed, words)}));
            let body = json!({"model": "oqp-tiny:latest", "messages": messages, "max_tokens": 3});
            let reply = http.post_json(&url, &[], &body).await;
            assert_eq!(reply.status, 200, "{}", reply.text());
            let answer = reply.json();
            messages.push(answer["choices"][0]["message"].clone());
            let prompt = answer["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
            let cache_n = answer["timings"]["cache_n"].as_u64().unwrap_or(0);
            let label = reply.header("x-oqp-affinity").unwrap_or_default();
            report.push_str(&format!(
                "turn {turn} conversation {conversation}: {label}, prompt {prompt}, cache_n {cache_n}\n"
            ));
            if turn > 0 {
                assert_eq!(label, "hit", "{report}");
                assert!(cache_n * 10 >= previous[conversation] * 9, "{report}");
            }
            previous[conversation] = prompt;
            let slots = http
                .get(&format!("{}/slots", engine.url()), &[])
                .await
                .json();
            let holds = slots.as_array().is_some_and(|slots| {
                slots
                    .iter()
                    .any(|slot| slot["n_prompt_tokens"].as_u64().unwrap_or(0) >= prompt)
            });
            assert!(holds, "{report}{slots}");
        }
    }
    stack.shutdown().await;
    engine.stop().await;
}

#[tokio::test]
async fn an_auto_host_restarted_as_a_llama_server_is_found_and_routed_as_one() {
    if !engine::installed() {
        return;
    }
    let fake = FakeOllama::builder().model("qwen3").spawn().await;
    let port = fake.addr().port();
    let stack = Stack::start(&config(&[("box", &fake.url(), "auto")])).await;
    let host = wait_host(&stack, "box", |host| host["engine"] == "ollama").await;
    assert_eq!(host["kind"], "ollama", "{host}");

    // The box restarts as a llama-server on the same address.
    fake.shutdown().await;
    let chat_engine = Engine::builder(Model::Chat)
        .alias("oqp-tiny:latest")
        .parallel(2)
        .context(2048)
        .port(port)
        .start()
        .await;
    let host = wait_host(&stack, "box", |host| {
        host["engine"] == "llama-server" && host["healthy"] == true
    })
    .await;
    assert_eq!(host["kind"], "openai", "{host}");
    assert_eq!(host["configured_kind"], "auto", "{host}");
    assert_eq!(host["models"], json!(["oqp-tiny:latest"]), "{host}");
    let host = wait_host(&stack, "box", |host| host["engine_slots"] == 2).await;
    assert!(host.get("poll_error").is_none(), "{host}");

    // Routed as what it is now.
    let http = HttpClient::new();
    let (status, served) = chat(&http, &stack.url(), "oqp-tiny:latest").await;
    assert_eq!((status, served.as_deref()), (200, Some("box")));
    stack.shutdown().await;
    chat_engine.stop().await;
}
