//! End to end: a request body is read once, as Ollama reads it. A body with anything but
//! whitespace after its JSON value is refused on every inference route (Ollama would read
//! the first value and ignore the rest, so oqp would have checked another request than the
//! one run); a key with a model allowlist must name a model Ollama reads; field names match
//! as Go's decoder matches them (any case, the last occurrence winning), for the allowlist,
//! `/api/show`'s deprecated `name` and the embedding inputs counted.

use oqp_tests::client::{HttpClient, Reply};
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::{ConfigYaml, Host, Key, Stack};
use serde_json::Value;

use crate::usage::{fake, usage_of};

const LIMITED: &str = "sk-limited-0123456789";
const OPEN: &str = "sk-open-0123456789";

fn config(url: &str, state_dir: &str) -> String {
    ConfigYaml::new()
        .state_dir(std::path::Path::new(state_dir))
        .host(Host::ollama("gpu", url).set("max_concurrent", 4))
        .under("keep_alive", "  default: \"30m\"\n")
        .key(Key::new(LIMITED, "limited").set("models", r#"["llama3*", "nomic-embed-text"]"#))
        .key(Key::new(OPEN, "open"))
        .key(Key::new("sk-admin-0123456789", "admin").set("scope", "management"))
        .yaml()
}

/// The requests the fake received from oqp on behalf of a client (they carry the client's
/// id; the control plane's poller reads models too).
fn seen(handle: &oqp_tests::fake::FakeHandle) -> usize {
    handle
        .requests()
        .iter()
        .filter(|request| request.headers.contains_key("x-client-id"))
        .count()
}

async fn post_raw(base: &str, path: &str, key: &str, body: &str) -> Reply {
    let auth = format!("Bearer {key}");
    HttpClient::new()
        .send(
            http::Method::POST,
            &format!("{base}{path}"),
            &[
                ("authorization", auth.as_str()),
                ("content-type", "application/json"),
            ],
            body.as_bytes().to_vec(),
        )
        .await
}

/// The refusal's message, in the route's error shape.
fn message(path: &str, body: &Value) -> String {
    let text = match path {
        "/v1/messages" => {
            assert_eq!(body["type"], "error", "{body}");
            assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
            &body["error"]["message"]
        }
        "/v1/responses" => {
            assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
            &body["error"]["message"]
        }
        _ => &body["error"],
    };
    assert!(body["request_id"].is_string(), "{body}");
    text.as_str().unwrap_or_default().to_owned()
}

const INFERENCE: [(&str, &str); 9] = [
    (
        "/api/generate",
        r#"{"model":"qwen","prompt":"hi","stream":false,"keep_alive":0}"#,
    ),
    (
        "/api/chat",
        r#"{"model":"qwen","messages":[{"role":"user","content":"hi"}],"stream":false,"keep_alive":0}"#,
    ),
    (
        "/api/embed",
        r#"{"model":"nomic-embed-text","input":"hi","keep_alive":0}"#,
    ),
    (
        "/api/embeddings",
        r#"{"model":"nomic-embed-text","prompt":"hi","keep_alive":0}"#,
    ),
    (
        "/v1/chat/completions",
        r#"{"model":"qwen","messages":[{"role":"user","content":"hi"}]}"#,
    ),
    ("/v1/completions", r#"{"model":"qwen","prompt":"hi"}"#),
    (
        "/v1/embeddings",
        r#"{"model":"nomic-embed-text","input":"hi"}"#,
    ),
    (
        "/v1/messages",
        r#"{"model":"qwen","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#,
    ),
    ("/v1/responses", r#"{"model":"qwen","input":"hi"}"#),
];

#[tokio::test]
async fn a_byte_after_the_json_is_refused_on_every_inference_route_before_ollama_sees_it() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(&fake.url(), &dir.path().display().to_string())).await;
    let base = stack.url();
    let handle = fake.handle();
    for (path, body) in INFERENCE {
        for key in [LIMITED, OPEN] {
            for tail in [" x", "}", r#"{"model":"llama3"}"#, "\n\0"] {
                let reply = post_raw(&base, path, key, &format!("{body}{tail}")).await;
                assert_eq!(reply.status, 400, "{path} {tail:?}: {}", reply.text());
                let text = message(path, &reply.json());
                assert!(text.contains("one JSON value"), "{path}: {text}");
            }
        }
    }
    assert_eq!(seen(&handle), 0, "the fake never saw one");
    // Whitespace after the value is still one value.
    for (path, body) in INFERENCE {
        let reply = post_raw(&base, path, OPEN, &format!(" {body} \r\n\t")).await;
        assert_eq!(reply.status, 200, "{path}: {}", reply.text());
    }
    assert_eq!(seen(&handle), INFERENCE.len());
    stack.shutdown().await;
}

#[tokio::test]
async fn a_key_with_a_models_list_is_checked_against_the_model_ollama_reads() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(&fake.url(), &dir.path().display().to_string())).await;
    let base = stack.url();
    let handle = fake.handle();

    // No model Ollama would read: refused, never let through.
    for body in [
        r#"{"prompt":"hi","stream":false}"#,
        r#"{"model":5,"prompt":"hi","stream":false}"#,
        r#"{"model":null,"prompt":"hi","stream":false}"#,
        r#"{"model":["qwen"],"prompt":"hi","stream":false}"#,
        "",
        "[]",
    ] {
        let reply = post_raw(&base, "/api/generate", LIMITED, body).await;
        assert_eq!(reply.status, 400, "{body:?}: {}", reply.text());
        assert!(
            message("/api/generate", &reply.json()).contains("must name one"),
            "{body:?}"
        );
    }
    // Any case, the last occurrence deciding, as Go's decoder reads them.
    for body in [
        r#"{"MODEL":"qwen","prompt":"hi","stream":false}"#,
        r#"{"Model":"qwen","prompt":"hi","stream":false}"#,
        r#"{"model":"llama3","model":"qwen","prompt":"hi","stream":false}"#,
        r#"{"model":"llama3","MODEL":"qwen","prompt":"hi","stream":false}"#,
        r#"{"model":"llama3","mod\u0065l":"qwen","prompt":"hi","stream":false}"#,
        r#"{"model":"qwen","model":null,"prompt":"hi","stream":false}"#,
    ] {
        let reply = post_raw(&base, "/api/generate", LIMITED, body).await;
        assert_eq!(reply.status, 403, "{body}: {}", reply.text());
        assert_eq!(
            reply.json()["error"],
            "model 'qwen' is not allowed for this key",
            "{body}"
        );
    }
    // `/api/show` reads the deprecated `name` where `model` is absent or empty.
    for body in [
        r#"{"name":"qwen"}"#,
        r#"{"model":"","name":"qwen"}"#,
        r#"{"NAME":"qwen"}"#,
    ] {
        let reply = post_raw(&base, "/api/show", LIMITED, body).await;
        assert_eq!(reply.status, 403, "{body}: {}", reply.text());
    }
    let reply = post_raw(&base, "/api/show", LIMITED, "{}").await;
    assert_eq!(reply.status, 400, "{}", reply.text());
    let reply = post_raw(&base, "/api/show", LIMITED, r#"{"name":"qwen"} x"#).await;
    assert_eq!(reply.status, 400, "{}", reply.text());
    assert_eq!(seen(&handle), 0, "no refused request reached Ollama");

    // The last occurrence allowed: served, as Ollama would serve it.
    let body = r#"{"model":"qwen","MODEL":"llama3","prompt":"hi","stream":false}"#;
    assert_eq!(
        post_raw(&base, "/api/generate", LIMITED, body).await.status,
        200
    );
    let reply = post_raw(&base, "/api/show", LIMITED, r#"{"name":"llama3"}"#).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    // A key without a list is not asked for a model: Ollama answers for itself.
    assert_ne!(
        post_raw(&base, "/api/generate", OPEN, r#"{"prompt":"hi"}"#)
            .await
            .status,
        400
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn with_model_management_on_a_copy_needs_both_its_models_allowed() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = config(&fake.url(), &dir.path().display().to_string()).replace(
        "ollama:\n",
        "proxy:\n  allow_model_management: true\nollama:\n",
    );
    let stack = Stack::start(&yaml).await;
    let base = stack.url();
    let copies = || fake.handle().requests_to("/api/copy").len();
    // A forbidden model under an allowed name, an allowed one under a forbidden name, the
    // last occurrence deciding as in any body Ollama reads.
    for body in [
        r#"{"source":"qwen","destination":"llama3-mine"}"#,
        r#"{"source":"llama3","destination":"qwen-mine"}"#,
        r#"{"source":"llama3","SOURCE":"qwen","destination":"llama3-mine"}"#,
    ] {
        let reply = post_raw(&base, "/api/copy", LIMITED, body).await;
        assert_eq!(reply.status, 403, "{body}: {}", reply.text());
    }
    for body in [
        r#"{"destination":"llama3-mine"}"#,
        r#"{"source":"llama3"} x"#,
    ] {
        let reply = post_raw(&base, "/api/copy", LIMITED, body).await;
        assert_eq!(reply.status, 400, "{body}: {}", reply.text());
    }
    assert_eq!(copies(), 0, "no refused copy reached Ollama");
    let body = r#"{"source":"llama3","destination":"llama3-mine"}"#;
    let reply = post_raw(&base, "/api/copy", LIMITED, body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    // A key without a list copies as before.
    let body = r#"{"source":"qwen","destination":"qwen-mine"}"#;
    let reply = post_raw(&base, "/api/copy", OPEN, body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(copies(), 2);
    stack.shutdown().await;
}

#[tokio::test]
async fn inputs_named_in_any_case_are_counted_as_ollama_embeds_them() {
    let fake = FakeOllama::builder()
        .embedding_model("nomic-embed-text")
        .spawn()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(&fake.url(), &dir.path().display().to_string())).await;
    let base = stack.url();
    let body = r#"{"model":"nomic-embed-text","INPUT":["a","b","c"]}"#;
    let reply = post_raw(&base, "/api/embed", OPEN, body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let control_url = stack.control_url();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let usage = usage_of(&control_url, 0, true, true).await;
        let inputs = usage.total.clone().unwrap_or_default().embedding_inputs;
        if inputs > 0 || std::time::Instant::now() >= deadline {
            assert_eq!(inputs, 3, "{usage:?}");
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    stack.shutdown().await;
}
