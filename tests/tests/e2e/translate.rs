//! End to end: Ollama's own API in front of real llama.cpp `llama-server` engines (hosts of
//! `kind: openai`), through the real planes. Requests in Ollama's shapes go in, the engines
//! get OpenAI's, and the client reads Ollama's answers back: NDJSON streams, whole objects,
//! listings, errors. The models' weights are random: every assertion looks at statuses,
//! shapes, counts and hosts, never at the text. Without the binary the tests are skipped,
//! except in CI.

use std::time::Duration;

use http::Method;
use http_body_util::BodyExt;
use oqp_tests::client::{HttpClient, wait_until};
use oqp_tests::engine::{self, Engine, Model};
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::{ConfigYaml, Host, Key, Stack};
use serde_json::{Value, json};

/// How long a test waits for a poll to show (polls run every second).
const PATIENCE: Duration = Duration::from_secs(30);

const KEY: &str = "sk-translate-0123456789";
const EMBED_ONLY_KEY: &str = "sk-embed-only-0123456789";
const SPENT_KEY: &str = "sk-spent-0123456789";

/// A config of `hosts` (`(name, url, kind)`), polled every second, with keys: one for
/// everything, one limited to the embedding model, one with a token budget of 1.
fn config(hosts: &[(&str, &str, &str)], state_dir: &std::path::Path) -> String {
    hosts
        .iter()
        .fold(
            ConfigYaml::new().state_dir(state_dir).max_concurrent(4),
            |yaml, (name, url, kind)| yaml.host(Host::openai(name, url).set("kind", kind)),
        )
        .strategy("model_aware")
        .under("routing", "  model_poll_timeout: 2\n")
        .key(Key::new(KEY, "user"))
        .key(Key::new(EMBED_ONLY_KEY, "embedder").set("models", r#"["oqp-embed*"]"#))
        .key(Key::new(SPENT_KEY, "spent").set("budget", "{tokens: 1, window: 1d}"))
        .yaml()
}

/// Waits until the data plane lists every model of `models` on some healthy host.
async fn wait_models(stack: &Stack, models: &[&str]) {
    let http = HttpClient::new();
    // Another process's poll has no event to wait on from here.
    let seen = wait_until(PATIENCE, || async {
        let status = http
            .get(
                &format!("{}/queue/status", stack.url()),
                &[("authorization", &format!("Bearer {KEY}"))],
            )
            .await
            .json();
        let listed: Vec<String> = status["hosts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|host| host["healthy"] == true)
            .flat_map(|host| host["models"].as_array().cloned().unwrap_or_default())
            .filter_map(|model| model.as_str().map(str::to_owned))
            .collect();
        if models
            .iter()
            .all(|model| listed.iter().any(|listed| listed == model))
        {
            Ok(())
        } else {
            Err(status)
        }
    })
    .await;
    if let Err(status) = seen {
        panic!("models {models:?} never listed; last status: {status}");
    }
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

/// Posts `body` to `path` with `key`; the reply whole.
async fn post(stack: &Stack, key: &str, path: &str, body: &Value) -> oqp_tests::client::Reply {
    HttpClient::new()
        .post_json(
            &format!("{}{path}", stack.url()),
            &[("authorization", &bearer(key))],
            body,
        )
        .await
}

/// Posts `body` and reads an NDJSON answer: status, content type, one value per line.
async fn post_stream(stack: &Stack, path: &str, body: &Value) -> (u16, String, Vec<Value>) {
    let (status, headers, lines) = HttpClient::new()
        .post_lines(
            &format!("{}{path}", stack.url()),
            &[("authorization", &bearer(KEY))],
            body,
        )
        .await;
    let content_type = headers
        .get("content-type")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let values = lines
        .iter()
        .map(|line| {
            serde_json::from_str(&line.line)
                .unwrap_or_else(|_| panic!("not a JSON line: {:?}", line.line))
        })
        .collect();
    (status.as_u16(), content_type, values)
}

/// The last object of an Ollama answer: `done`, a reason, counts and durations.
fn assert_last(last: &Value, max_tokens: u64) {
    assert_eq!(last["done"], true, "{last}");
    assert!(
        matches!(last["done_reason"].as_str(), Some("stop" | "length")),
        "{last}"
    );
    assert!(last["prompt_eval_count"].as_u64().unwrap() > 0, "{last}");
    assert!(last["eval_count"].as_u64().unwrap() <= max_tokens, "{last}");
    for duration in ["total_duration", "prompt_eval_duration", "eval_duration"] {
        assert!(last[duration].as_u64().is_some(), "{duration}: {last}");
    }
    assert!(last["total_duration"].as_u64().unwrap() > 0, "{last}");
    assert!(
        last["created_at"].as_str().unwrap().ends_with('Z'),
        "{last}"
    );
}

fn assert_norm_one(vector: &Value) {
    let norm: f64 = vector
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap().powi(2))
        .sum::<f64>()
        .sqrt();
    assert!((norm - 1.0).abs() < 1e-6, "norm {norm}");
}

#[tokio::test]
async fn ollamas_api_is_served_from_llama_servers() {
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
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(
        &[
            ("chat", &chat_engine.url(), "openai"),
            ("embed", &embed_engine.url(), "openai"),
        ],
        dir.path(),
    ))
    .await;
    wait_models(&stack, &["oqp-tiny:latest", "oqp-embed:latest"]).await;

    // /api/chat, streamed (Ollama's default): NDJSON, one object a line, the last `done`.
    let chat = json!({
        "model": "oqp-tiny",
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Say something."}],
        "options": {"num_predict": 6, "temperature": 0.7, "top_k": 20, "seed": 3, "num_ctx": 8192},
        "keep_alive": "10m",
    });
    let (status, content_type, lines) = post_stream(&stack, "/api/chat", &chat).await;
    assert_eq!(status, 200, "{lines:?}");
    assert_eq!(content_type, "application/x-ndjson");
    let (last, chunks) = lines.split_last().unwrap();
    for chunk in chunks {
        assert_eq!(chunk["model"], "oqp-tiny", "{chunk}");
        assert_eq!(chunk["done"], false, "{chunk}");
        assert_eq!(chunk["message"]["role"], "assistant", "{chunk}");
        assert!(chunk["message"]["content"].is_string(), "{chunk}");
    }
    assert_eq!(last["model"], "oqp-tiny");
    assert_eq!(last["message"]["role"], "assistant");
    assert_last(last, 6);

    // Not streamed: one object with the whole message.
    let mut whole = chat.clone();
    whole["stream"] = json!(false);
    let reply = post(&stack, KEY, "/api/chat", &whole).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-failover-host").as_deref(), Some("chat"));
    assert!(
        reply
            .header("content-type")
            .unwrap()
            .starts_with("application/json")
    );
    let answer = reply.json();
    assert_eq!(answer["model"], "oqp-tiny");
    assert!(answer["message"]["content"].is_string(), "{answer}");
    assert_last(&answer, 6);

    // A tool-call round trip: the assistant's call (arguments an object) and the tool's
    // result go in, an answer in Ollama's shape comes back. (With a JSON schema `format`:
    // `a_json_schema_format_is_enforced_by_the_engines_grammar`.)
    let tools = json!({
        "model": "oqp-tiny:latest",
        "stream": false,
        "messages": [
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
            {"role": "tool", "content": "5", "tool_name": "add"},
        ],
        "tools": [{"type": "function", "function": {
            "name": "add", "description": "Adds two numbers",
            "parameters": {"type": "object", "properties": {
                "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}],
        "options": {"num_predict": 8},
    });
    let reply = post(&stack, KEY, "/api/chat", &tools).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let answer = reply.json();
    assert_eq!(answer["message"]["role"], "assistant", "{answer}");
    assert!(answer["message"]["content"].is_string(), "{answer}");
    if let Some(calls) = answer["message"].get("tool_calls") {
        for call in calls.as_array().unwrap() {
            assert!(call["function"]["arguments"].is_object(), "{answer}");
        }
    }
    assert_last(&answer, 8);

    // /api/generate: templated (a chat of the prompt), streamed and not; raw (a completion).
    let generate = json!({"model": "oqp-tiny", "prompt": "Once upon a time", "system": "Tell a story.",
                          "options": {"num_predict": 5}});
    let (status, content_type, lines) = post_stream(&stack, "/api/generate", &generate).await;
    assert_eq!(
        (status, content_type.as_str()),
        (200, "application/x-ndjson")
    );
    let (last, chunks) = lines.split_last().unwrap();
    for chunk in chunks {
        assert!(chunk["response"].is_string(), "{chunk}");
        assert_eq!(chunk["done"], false, "{chunk}");
    }
    assert_eq!(last["response"], "");
    assert_last(last, 5);
    for raw in [false, true] {
        let mut whole = generate.clone();
        whole["stream"] = json!(false);
        if raw {
            whole["raw"] = json!(true);
            whole.as_object_mut().unwrap().remove("system");
        }
        let reply = post(&stack, KEY, "/api/generate", &whole).await;
        assert_eq!(reply.status, 200, "raw {raw}: {}", reply.text());
        let answer = reply.json();
        assert!(answer["response"].is_string(), "{answer}");
        assert_last(&answer, 5);
    }

    // What has no equivalent is a 400 naming the field; no engine sees it.
    // (A `suffix` is a fill-in-the-middle on these hosts: see the test below.)
    for (field, body) in [(
        "context",
        json!({"model": "oqp-tiny", "prompt": "more", "context": [1, 2, 3]}),
    )] {
        let reply = post(&stack, KEY, "/api/generate", &body).await;
        assert_eq!(reply.status, 400, "{field}: {}", reply.text());
        let message = reply.json()["error"].as_str().unwrap().to_owned();
        assert!(message.contains(&format!("\"{field}\"")), "{message}");
    }
    // A model no host serves: Ollama's 404, in each route's wording.
    let reply = post(
        &stack,
        KEY,
        "/api/chat",
        &json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(reply.status, 404, "{}", reply.text());
    assert_eq!(reply.json()["error"], "model 'nope' not found");
    let reply = post(
        &stack,
        KEY,
        "/api/embed",
        &json!({"model": "nope", "input": "hi"}),
    )
    .await;
    assert_eq!(reply.status, 404, "{}", reply.text());
    assert_eq!(
        reply.json()["error"],
        "model \"nope\" not found, try pulling it first"
    );

    // /api/embed and /api/embeddings: vectors in order, normalised, cut to `dimensions`.
    let reply = post(
        &stack,
        KEY,
        "/api/embed",
        &json!({"model": "oqp-embed", "input": ["one", "two", "three"]}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-failover-host").as_deref(), Some("embed"));
    let answer = reply.json();
    assert_eq!(answer["model"], "oqp-embed");
    let embeddings = answer["embeddings"].as_array().unwrap();
    assert_eq!(embeddings.len(), 3);
    for vector in embeddings {
        assert_eq!(vector.as_array().unwrap().len(), 128);
        assert_norm_one(vector);
    }
    assert!(
        answer["prompt_eval_count"].as_u64().unwrap() > 0,
        "{answer}"
    );
    let reply = post(
        &stack,
        KEY,
        "/api/embed",
        &json!({"model": "oqp-embed", "input": "one", "dimensions": 8}),
    )
    .await;
    let answer = reply.json();
    assert_eq!(answer["embeddings"][0].as_array().unwrap().len(), 8);
    assert_norm_one(&answer["embeddings"][0]);
    let reply = post(
        &stack,
        KEY,
        "/api/embeddings",
        &json!({"model": "oqp-embed", "prompt": "one"}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.json()["embedding"].as_array().unwrap().len(),
        128,
        "{}",
        reply.text()
    );

    // Listings in Ollama's shapes, from what oqp knows of the engines; a key limited to
    // some models sees only those.
    let http = HttpClient::new();
    let get = |path: &str, key: &str| {
        let http = http.clone();
        let url = format!("{}{path}", stack.url());
        let auth = bearer(key);
        async move { http.get(&url, &[("authorization", &auth)]).await }
    };
    let tags = get("/api/tags", KEY).await;
    assert_eq!(tags.status, 200, "{}", tags.text());
    let tags = tags.json();
    let names: Vec<&str> = tags["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|model| model["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"oqp-tiny:latest") && names.contains(&"oqp-embed:latest"),
        "{tags}"
    );
    for model in tags["models"].as_array().unwrap() {
        assert_eq!(model["name"], model["model"], "{model}");
        let digest = model["digest"].as_str().unwrap();
        assert_eq!(digest.len(), 64, "{model}");
        assert!(model["details"].is_object(), "{model}");
        assert!(model["modified_at"].is_string(), "{model}");
    }
    let again = get("/api/tags", KEY).await.json();
    assert_eq!(again["models"], tags["models"], "digests are stable");
    let limited = get("/api/tags", EMBED_ONLY_KEY).await.json();
    let limited: Vec<&Value> = limited["models"].as_array().unwrap().iter().collect();
    assert_eq!(limited.len(), 1, "{limited:?}");
    assert_eq!(limited[0]["name"], "oqp-embed:latest");
    let ps = get("/api/ps", KEY).await;
    assert_eq!(ps.status, 200, "{}", ps.text());
    let ps = ps.json();
    let tiny = ps["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|model| model["name"] == "oqp-tiny:latest")
        .unwrap_or_else(|| panic!("{ps}"));
    assert_eq!(tiny["context_length"], 1024, "{tiny}");
    assert!(tiny["expires_at"].is_string(), "{tiny}");
    let shown = post(&stack, KEY, "/api/show", &json!({"model": "oqp-tiny"})).await;
    assert_eq!(shown.status, 200, "{}", shown.text());
    let shown = shown.json();
    assert!(shown["details"].is_object(), "{shown}");
    assert!(shown["model_info"].is_object(), "{shown}");
    assert!(shown["capabilities"].is_array(), "{shown}");
    let refused = post(
        &stack,
        EMBED_ONLY_KEY,
        "/api/show",
        &json!({"model": "oqp-tiny"}),
    )
    .await;
    assert_eq!(refused.status, 403, "{}", refused.text());
    let version = get("/api/version", KEY).await;
    assert_eq!(version.status, 200, "{}", version.text());
    let version = version.json()["version"].as_str().unwrap().to_owned();
    assert_eq!(version.split('.').count(), 3, "{version}");

    // A budget spent on /api/chat is spent on /v1/chat/completions too: the same queue, the
    // same accounting.
    let first = post(&stack, SPENT_KEY, "/api/chat", &whole_chat()).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let refused = post(
        &stack,
        SPENT_KEY,
        "/v1/chat/completions",
        &json!({"model": "oqp-tiny", "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    let refused = post(&stack, SPENT_KEY, "/api/chat", &whole_chat()).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(refused.json()["error"], "budget exceeded: tokens 1 per 1d");

    stack.shutdown().await;
    chat_engine.stop().await;
    embed_engine.stop().await;
}

/// The longest answer the grammar of [`VERDICT`] allows, in tokens, and more: llama-server's
/// grammar lets at most 23 characters of white space stand at each of its few `space` places
/// (`| " " | "\n"{1,2} [ \t]{0,20}`), around a fence (`` ```json ``) at most and the object,
/// about 215 characters in all, each token at least one; then only the end of generation.
/// So the answer always ends (`done_reason: stop`), whatever the random weights pick.
const VERDICT_TOKENS: u64 = 256;

/// A JSON schema any answer to which is short: one property, an enum.
fn verdict() -> Value {
    json!({"type": "object",
           "properties": {"verdict": {"type": "string", "enum": ["sunny", "rainy"]}},
           "required": ["verdict"]})
}

/// `content` is JSON of [`verdict`]'s shape: an object of one property, one of the enum's
/// values (llama-server's grammar adds no property the schema does not name).
fn assert_verdict(content: &str) {
    let text = content.trim();
    // The grammar also allows the object fenced as a Markdown JSON block.
    let text = text
        .strip_prefix("```json")
        .and_then(|rest| rest.strip_suffix("```"))
        .unwrap_or(text);
    let parsed: Value = serde_json::from_str(text)
        .unwrap_or_else(|error| panic!("not JSON ({error}): {content:?}"));
    let object = parsed
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {parsed}"));
    assert_eq!(object.len(), 1, "{parsed}");
    assert!(
        matches!(object["verdict"].as_str(), Some("sunny" | "rainy")),
        "{parsed}"
    );
}

/// A JSON schema `format` reaches the engine as its `response_format`, and llama-server
/// enforces it with a grammar: the answer, streamed and not, after a tool-call round trip,
/// parses as JSON of the schema's shape (never its meaning: the weights are random).
#[tokio::test]
async fn a_json_schema_format_is_enforced_by_the_engines_grammar() {
    if !engine::grammars() {
        return;
    }
    let chat_engine = Engine::builder(Model::Chat)
        .alias("oqp-tiny:latest")
        .parallel(1)
        .context(1024)
        .start()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(
        &[("chat", &chat_engine.url(), "openai")],
        dir.path(),
    ))
    .await;
    wait_models(&stack, &["oqp-tiny:latest"]).await;

    let shaped = json!({
        "model": "oqp-tiny",
        "stream": false,
        "messages": [
            {"role": "user", "content": "Is it sunny in Paris?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "{\"sky\": \"clear\"}", "tool_name": "get_weather"},
        ],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}],
        "format": verdict(),
        "options": {"num_predict": VERDICT_TOKENS, "temperature": 0},
    });
    let reply = post(&stack, KEY, "/api/chat", &shaped).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let answer = reply.json();
    assert_last(&answer, VERDICT_TOKENS);
    assert_eq!(answer["done_reason"], "stop", "{answer}");
    assert_verdict(answer["message"]["content"].as_str().unwrap());

    // Streamed, with a sampling temperature: the lines' content joined is the object.
    let mut streamed = shaped.clone();
    streamed["stream"] = json!(true);
    streamed["options"] = json!({"num_predict": VERDICT_TOKENS, "temperature": 1.0, "seed": 7});
    let (status, _, lines) = post_stream(&stack, "/api/chat", &streamed).await;
    assert_eq!(status, 200, "{lines:?}");
    let (last, chunks) = lines.split_last().unwrap();
    assert_last(last, VERDICT_TOKENS);
    assert_eq!(last["done_reason"], "stop", "{last}");
    let content: String = chunks
        .iter()
        .map(|chunk| chunk["message"]["content"].as_str().unwrap())
        .collect();
    assert_verdict(&content);

    stack.shutdown().await;
    chat_engine.stop().await;
}

/// A generate with a `suffix`, for a model only llama-servers serve, is a fill-in-the-middle
/// on the engine's `/infill`: Ollama's generate answer, streamed and not, with the engine's
/// counts, budgeted as any other request.
#[tokio::test]
async fn a_generate_with_a_suffix_is_a_fill_in_the_middle_on_llama_servers_infill() {
    if !engine::fill_in_the_middle() {
        return;
    }
    let chat_engine = Engine::builder(Model::Chat)
        .alias("oqp-tiny:latest")
        .parallel(1)
        .context(1024)
        .start()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(
        &[("chat", &chat_engine.url(), "openai")],
        dir.path(),
    ))
    .await;
    wait_models(&stack, &["oqp-tiny:latest"]).await;
    // The host must be known as a llama-server (its `/props`) before `/infill` is offered.
    let http = HttpClient::new();
    // Another process's poll has no event to wait on from here.
    let detected = wait_until(PATIENCE, || async {
        let status = http
            .get(
                &format!("{}/queue/status", stack.url()),
                &[("authorization", &bearer(KEY))],
            )
            .await
            .json();
        if status["hosts"][0]["engine"] == "llama-server" {
            Ok(())
        } else {
            Err(status)
        }
    })
    .await;
    if let Err(status) = detected {
        panic!("never detected: {status}");
    }

    let infill = json!({"model": "oqp-tiny", "prompt": "def add(a, b):\n    return ",
                        "suffix": "\n\nprint(add(1, 2))\n", "options": {"num_predict": 4}});
    let (status, content_type, lines) = post_stream(&stack, "/api/generate", &infill).await;
    assert_eq!(
        (status, content_type.as_str()),
        (200, "application/x-ndjson"),
        "{lines:?}"
    );
    let (last, chunks) = lines.split_last().unwrap();
    for chunk in chunks {
        assert_eq!(chunk["model"], "oqp-tiny", "{chunk}");
        assert!(chunk["response"].is_string(), "{chunk}");
        assert_eq!(chunk["done"], false, "{chunk}");
    }
    assert_eq!(last["response"], "", "{last}");
    assert_last(last, 4);
    // Prefix, suffix and the three fill-in-the-middle tokens are all in the prompt.
    assert!(last["prompt_eval_count"].as_u64().unwrap() > 10, "{last}");

    let mut whole = infill.clone();
    whole["stream"] = json!(false);
    let reply = post(&stack, KEY, "/api/generate", &whole).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let answer = reply.json();
    assert_eq!(answer["model"], "oqp-tiny", "{answer}");
    assert!(answer["response"].is_string(), "{answer}");
    assert_last(&answer, 4);
    assert!(answer["eval_count"].as_u64().unwrap() > 0, "{answer}");

    // What /infill cannot take is a 400 naming the field.
    let mut with_system = whole.clone();
    with_system["system"] = json!("Complete the code.");
    let reply = post(&stack, KEY, "/api/generate", &with_system).await;
    assert_eq!(reply.status, 400, "{}", reply.text());
    assert!(
        reply.json()["error"]
            .as_str()
            .unwrap()
            .contains("\"system\""),
        "{}",
        reply.text()
    );

    // Budgeted and accounted as the other routes: the engine's counts spend the budget.
    let first = post(&stack, SPENT_KEY, "/api/generate", &whole).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let refused = post(&stack, SPENT_KEY, "/api/generate", &whole).await;
    assert_eq!(refused.status, 429, "{}", refused.text());

    stack.shutdown().await;
    chat_engine.stop().await;
}

fn whole_chat() -> Value {
    json!({"model": "oqp-tiny", "stream": false, "options": {"num_predict": 2},
           "messages": [{"role": "user", "content": "hi"}]})
}

#[tokio::test]
async fn one_endpoint_serves_an_ollama_model_and_an_engines_model() {
    if !engine::installed() {
        return;
    }
    let fake = FakeOllama::builder()
        .model("llama3")
        .loaded("llama3")
        .spawn()
        .await;
    let chat_engine = Engine::builder(Model::Chat)
        .alias("oqp-tiny:latest")
        .parallel(1)
        .context(1024)
        .start()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(
        &[
            ("box", &fake.url(), "ollama"),
            ("engine", &chat_engine.url(), "openai"),
        ],
        dir.path(),
    ))
    .await;
    wait_models(&stack, &["llama3:latest", "oqp-tiny:latest"]).await;

    for (model, host) in [("llama3", "box"), ("oqp-tiny", "engine"), ("llama3", "box")] {
        let reply = post(
            &stack,
            KEY,
            "/api/chat",
            &json!({"model": model, "stream": false, "options": {"num_predict": 3},
                    "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
        assert_eq!(reply.status, 200, "{model}: {}", reply.text());
        assert_eq!(reply.header("x-failover-host").as_deref(), Some(host));
        let answer = reply.json();
        assert_eq!(answer["model"], model);
        assert_eq!(answer["done"], true);
        assert_eq!(answer["message"]["role"], "assistant");
    }
    // The Ollama host got Ollama's own request; the engine nothing it cannot read.
    assert_eq!(fake.handle().requests_to("/api/chat").len(), 2);

    let tags = HttpClient::new()
        .get(
            &format!("{}/api/tags", stack.url()),
            &[("authorization", &bearer(KEY))],
        )
        .await;
    assert_eq!(tags.status, 200, "{}", tags.text());
    let tags = tags.json();
    let names: Vec<&str> = tags["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|model| model["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"llama3:latest"), "{tags}");
    assert!(names.contains(&"oqp-tiny:latest"), "{tags}");
    // /api/version comes from the Ollama host.
    let version = HttpClient::new()
        .get(
            &format!("{}/api/version", stack.url()),
            &[("authorization", &bearer(KEY))],
        )
        .await;
    assert_eq!(version.status, 200, "{}", version.text());
    assert_eq!(version.header("x-failover-host").as_deref(), Some("box"));

    stack.shutdown().await;
    chat_engine.stop().await;
}

#[tokio::test]
async fn a_stream_cut_by_the_engine_ends_with_an_error_line_and_no_done() {
    if !engine::installed() {
        return;
    }
    let chat_engine = Engine::builder(Model::Chat)
        .alias("oqp-tiny:latest")
        .parallel(1)
        .context(4096)
        .start()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(
        &[("engine", &chat_engine.url(), "openai")],
        dir.path(),
    ))
    .await;
    wait_models(&stack, &["oqp-tiny:latest"]).await;

    let body = json!({"model": "oqp-tiny", "options": {"num_predict": 3000},
                      "messages": [{"role": "user", "content": "Tell a long story."}]});
    let response = HttpClient::new()
        .start(
            Method::POST,
            &format!("{}/api/chat", stack.url()),
            &[
                ("authorization", &bearer(KEY)),
                ("content-type", "application/json"),
            ],
            body.to_string(),
        )
        .await;
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let mut text = Vec::new();
    let mut engine = Some(chat_engine);
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { break };
        if let Some(data) = frame.data_ref() {
            text.extend_from_slice(data);
        }
        // The first line is out: the engine goes away mid-answer.
        if text.contains(&b'\n')
            && let Some(engine) = engine.take()
        {
            engine.stop().await;
        }
    }
    let text = String::from_utf8(text).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert!(lines.len() >= 2, "{text}");
    let (last, before) = lines.split_last().unwrap();
    assert!(last["error"].is_string(), "{text}");
    assert!(last.get("done").is_none(), "{text}");
    assert!(before.iter().all(|line| line["done"] == false), "{text}");
    stack.shutdown().await;
}

/// What an engine receives for Ollama's requests, read at the fake (serving OpenAI's API as a
/// host of `kind: openai`): the OpenAI request the translation table gives.
#[tokio::test]
async fn the_engine_receives_openais_request_for_ollamas() {
    let fake = FakeOllama::builder().model("qwen3").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = config(&[("engine", &fake.url(), "openai")], dir.path()).replace(
        "proxy:\n  max_concurrent: 4\n",
        "proxy:\n  max_concurrent: 4\n  allow_model_management: true\n",
    );
    let stack = Stack::start(&yaml).await;
    wait_models(&stack, &["qwen3:latest"]).await;

    // Model management for a model only engines serve: 501, naming the host kind; nothing
    // reaches the engine. Another model's call goes on to a host as before.
    for (path, body) in [
        ("/api/pull", json!({"model": "qwen3"})),
        ("/api/delete", json!({"name": "qwen3:latest"})),
        (
            "/api/copy",
            json!({"source": "qwen3", "destination": "mine"}),
        ),
    ] {
        let method = if path == "/api/delete" {
            Method::DELETE
        } else {
            Method::POST
        };
        let reply = HttpClient::new()
            .send(
                method,
                &format!("{}{path}", stack.url()),
                &[("authorization", &bearer(KEY))],
                body.to_string(),
            )
            .await;
        assert_eq!(reply.status, 501, "{path}: {}", reply.text());
        let message = reply.json()["error"].as_str().unwrap().to_owned();
        assert!(
            message.contains("kind openai") && message.contains(path),
            "{message}"
        );
    }
    for path in ["/api/pull", "/api/delete", "/api/copy"] {
        assert!(fake.handle().requests_to(path).is_empty(), "{path}");
    }
    let other = post(
        &stack,
        KEY,
        "/api/pull",
        &json!({"model": "llama3", "stream": false}),
    )
    .await;
    assert_ne!(other.status, 501, "{}", other.text());
    assert_eq!(fake.handle().requests_to("/api/pull").len(), 1);

    let png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";
    let chat = json!({
        "model": "qwen3",
        "stream": false,
        "messages": [
            {"role": "user", "content": "What is in the picture, plus 2 + 3?", "images": [png]},
            {"role": "assistant", "content": "", "thinking": "I should add.",
             "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
            {"role": "tool", "content": "5", "tool_name": "add"},
        ],
        "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
        "format": {"type": "object", "properties": {"sum": {"type": "integer"}}},
        "options": {"num_predict": 4, "temperature": 0.2, "stop": ["\n\n"], "num_ctx": 2048},
        "think": true,
        "keep_alive": -1,
    });
    let reply = post(&stack, KEY, "/api/chat", &chat).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let answer = reply.json();
    assert_eq!(answer["model"], "qwen3");
    assert_eq!(answer["done"], true);
    assert_eq!(answer["message"]["role"], "assistant");
    assert!(answer["prompt_eval_count"].as_u64().is_some(), "{answer}");
    assert!(answer["eval_count"].as_u64().is_some(), "{answer}");
    let received = fake.handle().requests_to("/v1/chat/completions");
    assert_eq!(received.len(), 1);
    assert!(fake.handle().requests_to("/api/chat").is_empty());
    let sent: Value = serde_json::from_slice(&received[0].body).unwrap();
    assert_eq!(sent["model"], "qwen3:latest");
    assert_eq!(sent["stream"], false);
    assert_eq!(sent["max_tokens"], 4);
    assert_eq!(sent["temperature"], 0.2);
    assert_eq!(sent["stop"], json!(["\n\n"]));
    assert!(
        sent.get("num_ctx").is_none() && sent.get("keep_alive").is_none(),
        "{sent}"
    );
    assert_eq!(
        sent["chat_template_kwargs"],
        json!({"enable_thinking": true})
    );
    assert_eq!(sent["response_format"]["type"], "json_schema");
    assert_eq!(
        sent["response_format"]["json_schema"]["schema"],
        chat["format"]
    );
    assert_eq!(sent["tools"], chat["tools"]);
    let messages = sent["messages"].as_array().unwrap();
    assert_eq!(
        messages[0]["content"][1]["image_url"]["url"],
        format!("data:image/png;base64,{png}")
    );
    assert_eq!(messages[1]["reasoning_content"], "I should add.");
    let call = &messages[1]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "add");
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"a": 2, "b": 3}));
    assert_eq!(
        messages[2],
        json!({"role": "tool", "content": "5", "name": "add"})
    );

    // Streamed: the engine is asked for its usage, and its SSE comes back as NDJSON.
    let mut streamed = chat.clone();
    streamed.as_object_mut().unwrap().remove("stream");
    let (status, content_type, lines) = post_stream(&stack, "/api/chat", &streamed).await;
    assert_eq!(
        (status, content_type.as_str()),
        (200, "application/x-ndjson")
    );
    assert!(lines.len() >= 2, "{lines:?}");
    let (last, chunks) = lines.split_last().unwrap();
    assert!(
        chunks.iter().all(|chunk| chunk["done"] == false),
        "{lines:?}"
    );
    assert_eq!(last["done"], true);
    assert!(last["eval_count"].as_u64().is_some(), "{last}");
    let sent: Value =
        serde_json::from_slice(&fake.handle().requests_to("/v1/chat/completions")[1].body).unwrap();
    assert_eq!(sent["stream"], true);
    assert_eq!(sent["stream_options"], json!({"include_usage": true}));

    // A raw generate is a plain completion of the prompt.
    let reply = post(
        &stack,
        KEY,
        "/api/generate",
        &json!({"model": "qwen3", "prompt": "abc", "raw": true, "stream": false}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert!(reply.json()["response"].is_string());
    let sent: Value =
        serde_json::from_slice(&fake.handle().requests_to("/v1/completions")[0].body).unwrap();
    assert_eq!(sent["prompt"], "abc");
    stack.shutdown().await;
}

#[tokio::test]
async fn a_translated_stream_arrives_line_by_line_not_buffered() {
    let fake = FakeOllama::builder()
        .model("qwen3")
        .tokens(5)
        .token_interval(Duration::from_millis(100))
        .spawn()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(&[("engine", &fake.url(), "openai")], dir.path())).await;
    wait_models(&stack, &["qwen3:latest"]).await;
    let body = json!({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]});
    let response = HttpClient::new()
        .start(
            Method::POST,
            &format!("{}/api/chat", stack.url()),
            &[
                ("authorization", &bearer(KEY)),
                ("content-type", "application/json"),
            ],
            body.to_string(),
        )
        .await;
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let mut text = Vec::new();
    let mut first_line_while_running = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.unwrap();
        if let Some(data) = frame.data_ref() {
            text.extend_from_slice(data);
        }
        if first_line_while_running.is_none() && text.contains(&b'\n') {
            // The engine is still answering when the first translated line is here.
            let received = fake.handle().requests_to("/v1/chat/completions");
            first_line_while_running = Some(received[0].finished_at.is_none());
        }
    }
    assert_eq!(first_line_while_running, Some(true));
    let text = String::from_utf8(text).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    // The fake writes its role-only event on its own: the opening line of nothing, then one
    // line a token, then the last.
    assert_eq!(lines.len(), 7, "{text}");
    assert_eq!(
        lines[0]["message"],
        json!({"role": "assistant", "content": ""}),
        "{text}"
    );
    assert_eq!(lines[0]["done"], false, "{text}");
    assert_eq!(lines[6]["done"], true, "{text}");
    stack.shutdown().await;
}

/// The value of the series `series` (name and labels, as printed) in oqp's `/metrics`.
async fn metric(stack: &Stack, series: &str) -> f64 {
    let text = HttpClient::new()
        .get(
            &format!("{}/metrics", stack.url()),
            &[("authorization", &bearer(KEY))],
        )
        .await
        .text();
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn translated_embeddings_go_through_the_embedding_cache_per_item() {
    if !engine::installed() {
        return;
    }
    let embed_engine = Engine::builder(Model::Embed)
        .alias("oqp-embed:latest")
        .parallel(1)
        .start()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let mut yaml = config(&[("embed", &embed_engine.url(), "openai")], dir.path());
    yaml.push_str("embedding_cache:\n  enabled: true\n");
    let stack = Stack::start(&yaml).await;
    wait_models(&stack, &["oqp-embed:latest"]).await;
    let engine_requests = r#"oqp_host_requests_total{name="embed"}"#;

    let texts = ["The sky is blue.", "Grass is green."];
    let first = post(
        &stack,
        KEY,
        "/api/embed",
        &json!({"model": "oqp-embed", "input": texts}),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.header("x-cache").as_deref(), Some("MISS"));
    let first = first.json();
    assert_eq!(first["model"], "oqp-embed");
    let vectors = first["embeddings"].as_array().unwrap().clone();
    assert_eq!(vectors.len(), 2, "{first}");
    vectors.iter().for_each(assert_norm_one);
    let sent = metric(&stack, engine_requests).await;
    assert_eq!(sent, 1.0, "the misses went to the engine as one request");

    // The same call again: every item from the cache, nothing reaches the engine, and the
    // answer is the one Ollama's shape gave the first time.
    let again = post(
        &stack,
        KEY,
        "/api/embed",
        &json!({"model": "oqp-embed", "input": texts}),
    )
    .await;
    assert_eq!(again.status, 200, "{}", again.text());
    assert_eq!(again.header("x-cache").as_deref(), Some("HIT"));
    assert_eq!(again.json()["embeddings"], Value::Array(vectors.clone()));
    assert_eq!(metric(&stack, engine_requests).await, sent);

    // One known item and one new: only the new one is sent; the known one keeps its vector.
    let partial = post(
        &stack,
        KEY,
        "/api/embed",
        &json!({"model": "oqp-embed", "input": [texts[1], "Snow is white."]}),
    )
    .await;
    assert_eq!(partial.status, 200, "{}", partial.text());
    assert_eq!(partial.header("x-cache").as_deref(), Some("PARTIAL"));
    let partial = partial.json();
    assert_eq!(partial["embeddings"][0], vectors[1]);
    assert_norm_one(&partial["embeddings"][1]);
    assert_eq!(metric(&stack, engine_requests).await, sent + 1.0);

    // The legacy route shares the entries: its one vector comes from the cache, as the
    // engine gave it (not normalised by Ollama's legacy route either), and `dimensions` cuts
    // a cached vector and normalises it again.
    let legacy = post(
        &stack,
        KEY,
        "/api/embeddings",
        &json!({"model": "oqp-embed", "prompt": texts[0]}),
    )
    .await;
    assert_eq!(legacy.status, 200, "{}", legacy.text());
    assert_eq!(legacy.header("x-cache").as_deref(), Some("HIT"));
    let legacy = legacy.json();
    assert_eq!(
        legacy["embedding"].as_array().unwrap().len(),
        vectors[0].as_array().unwrap().len()
    );
    let cut = post(
        &stack,
        KEY,
        "/api/embed",
        &json!({"model": "oqp-embed", "input": texts[0], "dimensions": 8}),
    )
    .await;
    assert_eq!(cut.status, 200, "{}", cut.text());
    assert_eq!(cut.header("x-cache").as_deref(), Some("HIT"));
    let cut = cut.json();
    assert_eq!(cut["embeddings"][0].as_array().unwrap().len(), 8, "{cut}");
    assert_norm_one(&cut["embeddings"][0]);
    assert_eq!(metric(&stack, engine_requests).await, sent + 1.0);

    // A translation error is still Ollama's 400, before the cache.
    let wrong = post(
        &stack,
        KEY,
        "/api/embed",
        &json!({"model": "oqp-embed", "input": [1, 2]}),
    )
    .await;
    assert_eq!(wrong.status, 400, "{}", wrong.text());
    assert!(
        wrong.json()["error"]
            .as_str()
            .unwrap()
            .contains("\"input\"")
    );

    stack.shutdown().await;
    embed_engine.stop().await;
}
