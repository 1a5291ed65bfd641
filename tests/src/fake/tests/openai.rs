//! The OpenAI-compatible layer: JSON and SSE completions, embeddings, models, error objects.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use http::{Method, StatusCode};
use serde_json::{Value, json};

use super::{call, open, post};
use crate::fake::FakeOllama;

fn frames(lines: &[String]) -> Vec<Value> {
    lines
        .iter()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).unwrap_or_default())
        .collect()
}

#[tokio::test]
async fn chat_completions_json_and_sse() {
    let fake = FakeOllama::builder()
        .model("llama3.2")
        .tokens(3)
        .spawn()
        .await;
    let addr = fake.addr();
    let request =
        json!({ "model": "llama3.2", "messages": [{ "role": "user", "content": "hi there" }] });
    let whole = post(addr, "/v1/chat/completions", request.clone()).await;
    assert_eq!(whole.content_type(), Some("application/json"));
    assert!(whole.body.ends_with(b"}\n"));
    let whole = whole.json();
    assert!(
        whole["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("chatcmpl-"))
    );
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["system_fingerprint"], "fp_ollama");
    assert_eq!(whole["choices"][0]["message"]["content"], "The quick brown");
    assert_eq!(whole["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        whole["usage"],
        json!({ "prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5 })
    );

    let mut streamed = request;
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({ "include_usage": true });
    let mut sse = open(
        addr,
        Method::POST,
        "/v1/chat/completions",
        &streamed.to_string(),
        &[],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(sse.headers["content-type"], "text/event-stream");
    let lines = sse.rest().await.unwrap_or_default();
    assert_eq!(
        lines.iter().rev().nth(1).map(String::as_str),
        Some("data: [DONE]")
    );
    assert!(
        lines.iter().skip(1).step_by(2).all(String::is_empty),
        "frames end in a blank line"
    );
    let frames = frames(&lines);
    assert_eq!(frames.len(), 6, "role, 3 tokens, finish, usage");
    assert_eq!(frames[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = frames[1..4]
        .iter()
        .filter_map(|f| f["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "The quick brown");
    assert_eq!(frames[4]["choices"][0]["delta"], json!({}));
    assert_eq!(frames[4]["choices"][0]["finish_reason"], "stop");
    assert_eq!(frames[5]["choices"], json!([]));
    assert_eq!(frames[5]["usage"]["completion_tokens"], 3);
    assert!(
        frames
            .iter()
            .all(|f| f["created"] == frames[0]["created"] && f["id"] == frames[0]["id"])
    );
}

#[tokio::test]
async fn completions_stream_text_chunks() {
    let fake = FakeOllama::builder()
        .model("llama3.2")
        .tokens(2)
        .spawn()
        .await;
    let body = r#"{"model":"llama3.2","prompt":"say","stream":true,"max_tokens":1}"#;
    let mut sse = open(fake.addr(), Method::POST, "/v1/completions", body, &[])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let frames = frames(&sse.rest().await.unwrap_or_default());
    assert_eq!(frames.len(), 2);
    assert!(
        frames[0]["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("cmpl-"))
    );
    assert_eq!(
        (
            frames[0]["choices"][0]["text"].clone(),
            frames[0]["choices"][0]["finish_reason"].clone()
        ),
        (json!("The"), Value::Null)
    );
    assert_eq!(frames[1]["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn stamped_tokens_end_in_the_moment_they_were_written() {
    let fake = FakeOllama::builder()
        .model("llama3.2")
        .tokens(3)
        .stamp_tokens(true)
        .spawn()
        .await;
    let unix_nanos = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    };
    let before = unix_nanos();
    let body = r#"{"model":"llama3.2","messages":[{"role":"user","content":"hi"}],"stream":true}"#;
    let mut sse = open(fake.addr(), Method::POST, "/v1/chat/completions", body, &[])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let frames = frames(&sse.rest().await.unwrap_or_default());
    let after = unix_nanos();
    let tokens: Vec<&str> = frames
        .iter()
        .filter_map(|frame| frame["choices"][0]["delta"]["content"].as_str())
        .filter(|content| !content.is_empty())
        .collect();
    assert_eq!(tokens.len(), 3, "{frames:?}");
    let mut last = before;
    for token in tokens {
        let (text, stamp) = token.rsplit_once('@').unwrap_or_else(|| panic!("{token}"));
        assert!(!text.is_empty(), "{token}");
        let stamp: u128 = stamp.parse().unwrap_or_else(|_| panic!("{token}"));
        assert!(
            (last..=after).contains(&stamp),
            "{token}: not in {last}..={after}"
        );
        last = stamp;
    }
}

#[tokio::test]
async fn embeddings_as_floats_and_base64() {
    let fake = FakeOllama::builder()
        .embedding_model("all-minilm")
        .spawn()
        .await;
    let addr = fake.addr();
    let floats = post(
        addr,
        "/v1/embeddings",
        json!({ "model": "all-minilm", "input": ["a", "b"] }),
    )
    .await
    .json();
    assert_eq!(
        floats["usage"],
        json!({ "prompt_tokens": 2, "total_tokens": 2 })
    );
    let base64 = json!({ "model": "all-minilm", "input": ["a", "b"], "encoding_format": "BASE64" });
    let base64 = post(addr, "/v1/embeddings", base64).await.json();
    for index in 0..2 {
        let expected: Vec<f32> = floats["data"][index]["embedding"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x.as_f64().map(|x| x as f32))
            .collect();
        assert_eq!(expected.len(), 8);
        let bytes = STANDARD
            .decode(
                base64["data"][index]["embedding"]
                    .as_str()
                    .unwrap_or_default(),
            )
            .unwrap_or_default();
        let decoded: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(decoded, expected);
        assert_eq!(base64["data"][index]["index"], index);
    }
    // The native endpoint gives the same vector for the same text.
    let native = post(
        addr,
        "/api/embed",
        json!({ "model": "all-minilm", "input": "a" }),
    )
    .await
    .json();
    assert_eq!(native["embeddings"][0], floats["data"][0]["embedding"]);
    assert!(native["total_duration"].is_u64() && native["prompt_eval_count"] == 1);
    let legacy = post(
        addr,
        "/api/embeddings",
        json!({ "model": "all-minilm", "prompt": "a" }),
    )
    .await
    .json();
    let norm: f64 = legacy["embedding"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_f64)
        .map(|x| x * x)
        .sum();
    assert!(
        (norm - 1.0).abs() > 1e-3,
        "legacy vectors are not normalised"
    );
    let empty = post(
        addr,
        "/api/embed",
        json!({ "model": "all-minilm", "input": [] }),
    )
    .await
    .json();
    assert_eq!(empty, json!({ "model": "all-minilm", "embeddings": [] }));
    let short = post(
        addr,
        "/api/embed",
        json!({ "model": "all-minilm", "input": "a", "dimensions": 3 }),
    )
    .await
    .json();
    assert_eq!(short["embeddings"][0].as_array().map(Vec::len), Some(3));
}

#[tokio::test]
async fn models_and_error_objects() {
    let fake = FakeOllama::builder()
        .model("llama3.2")
        .embedding_model("all-minilm")
        .spawn()
        .await;
    let addr = fake.addr();
    let list = call(addr, Method::GET, "/v1/models", "").await.json();
    assert_eq!(list["data"][0]["id"], "llama3.2:latest");
    assert_eq!(list["data"][0]["owned_by"], "library");
    assert_eq!(
        call(addr, Method::GET, "/v1/models/llama3.2", "")
            .await
            .json()["id"],
        "llama3.2"
    );
    let missing = call(addr, Method::GET, "/v1/models/nope", "").await;
    assert_eq!(
        missing.json()["error"]["message"],
        "model 'nope:latest' not found"
    );
    let empty = FakeOllama::builder().spawn().await;
    assert_eq!(
        call(empty.addr(), Method::GET, "/v1/models", "")
            .await
            .json()["data"],
        Value::Null
    );

    let cases = [
        (
            "/v1/chat/completions",
            json!({ "model": "nope", "messages": [{ "role": "user", "content": "x" }] }),
            404,
            "not_found_error",
            "model 'nope' not found",
        ),
        (
            "/v1/chat/completions",
            json!({ "model": "llama3.2", "messages": [] }),
            400,
            "invalid_request_error",
            "[] is too short - 'messages'",
        ),
        (
            "/v1/embeddings",
            json!({ "model": "nope", "input": "x" }),
            404,
            "not_found_error",
            "model \"nope\" not found, try pulling it first",
        ),
        (
            "/v1/embeddings",
            json!({ "model": "all-minilm", "input": [] }),
            400,
            "invalid_request_error",
            "invalid input",
        ),
    ];
    for (path, body, status, kind, message) in cases {
        let answer = post(addr, path, body).await;
        assert_eq!(
            answer.status,
            StatusCode::from_u16(status).unwrap_or_default(),
            "{path}"
        );
        assert_eq!(answer.content_type(), Some("application/json"));
        assert_eq!(
            answer.json(),
            json!({ "error": { "message": message, "type": kind, "param": null, "code": null } })
        );
    }
}
