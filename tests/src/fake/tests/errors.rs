//! Error bodies and statuses, per the §A.4 table and the decoding rules of §A.1 and §A.5.

use http::{Method, StatusCode};
use serde_json::json;

use super::{call, post};
use crate::fake::FakeOllama;

#[tokio::test]
async fn model_not_found_texts_per_endpoint() {
    let fake = FakeOllama::builder()
        .model("llama3.2")
        .embedding_model("all-minilm")
        .spawn()
        .await;
    let addr = fake.addr();
    let cases = [
        (
            "/api/generate",
            json!({ "model": "nope", "prompt": "hi" }),
            404,
            "model 'nope' not found",
        ),
        (
            "/api/generate",
            json!({ "prompt": "hi" }),
            404,
            "model '' not found",
        ),
        (
            "/api/chat",
            json!({ "model": "nope", "messages": [{ "role": "user", "content": "hi" }] }),
            404,
            "model 'nope' not found",
        ),
        (
            "/api/chat",
            json!({ "messages": [] }),
            400,
            "model is required",
        ),
        (
            "/api/embed",
            json!({ "model": "nope", "input": "hi" }),
            404,
            "model \"nope\" not found, try pulling it first",
        ),
        (
            "/api/embed",
            json!({ "input": "hi" }),
            404,
            "model '' not found",
        ),
        (
            "/api/embeddings",
            json!({ "model": "nope", "prompt": "hi" }),
            404,
            "model \"nope\" not found, try pulling it first",
        ),
        (
            "/api/embeddings",
            json!({ "prompt": "hi" }),
            400,
            "model is required",
        ),
        (
            "/api/show",
            json!({ "model": "nope" }),
            404,
            "model 'nope:latest' not found",
        ),
        ("/api/show", json!({}), 400, "model is required"),
        (
            "/api/copy",
            json!({ "source": "nope", "destination": "x" }),
            404,
            "model \"nope\" not found",
        ),
        (
            "/api/copy",
            json!({ "destination": "x" }),
            400,
            "source \"\" is invalid",
        ),
        (
            "/api/generate",
            json!({ "model": "all-minilm", "prompt": "hi" }),
            400,
            "\"all-minilm\" does not support generate",
        ),
        (
            "/api/chat",
            json!({ "model": "all-minilm", "messages": [{ "role": "user", "content": "hi" }] }),
            400,
            "\"all-minilm\" does not support chat",
        ),
        (
            "/api/generate",
            json!({ "model": "llama3.2", "prompt": "hi", "keep_alive": "300" }),
            400,
            "time: missing unit in duration \"300\"",
        ),
        (
            "/api/generate",
            json!({ "model": "llama3.2", "prompt": "hi", "raw": true, "system": "s" }),
            400,
            "raw mode does not support template, system, or context",
        ),
        (
            "/api/embed",
            json!({ "model": "all-minilm", "input": 3 }),
            400,
            "invalid input type",
        ),
    ];
    for (path, body, status, message) in cases {
        let answer = post(addr, path, body.clone()).await;
        assert_eq!(answer.status.as_u16(), status, "{path} {body}");
        assert_eq!(answer.error(), message, "{path} {body}");
        assert_eq!(
            answer.content_type(),
            Some("application/json; charset=utf-8"),
            "{path}"
        );
    }
    let delete = call(addr, Method::DELETE, "/api/delete", r#"{"model":"nope"}"#).await;
    assert_eq!(
        (delete.status, delete.error()),
        (StatusCode::NOT_FOUND, "model 'nope' not found".to_owned())
    );
    assert_eq!(
        fake.handle().peak_concurrency(),
        0,
        "rejected requests take no slot"
    );
}

#[tokio::test]
async fn bodies_are_decoded_like_go() {
    let fake = FakeOllama::builder().model("llama3.2").spawn().await;
    let addr = fake.addr();
    let cases = [
        ("", "missing request body"),
        ("{", "unexpected EOF"),
        (
            "nope",
            "invalid character 'o' in literal null (expecting 'u')",
        ),
        (
            "hello",
            "invalid character 'h' looking for beginning of value",
        ),
        (
            r#"{"model":1}"#,
            "json: cannot unmarshal number into Go struct field GenerateRequest.model of type string",
        ),
        (
            r#"{"model":"llama3.2","keep_alive":true}"#,
            "Unsupported type: 'bool'",
        ),
    ];
    for (body, message) in cases {
        let answer = call(addr, Method::POST, "/api/generate", body).await;
        assert_eq!(
            (answer.status, answer.error()),
            (StatusCode::BAD_REQUEST, message.to_owned()),
            "{body:?}"
        );
    }
    // Floats and unit strings are fine.
    for keep_alive in [json!(0.5), json!(-1.0), json!("5m"), json!("0")] {
        let body = json!({ "model": "llama3.2", "prompt": "hi", "stream": false, "keep_alive": keep_alive });
        assert_eq!(
            post(addr, "/api/generate", body).await.status,
            StatusCode::OK,
            "{keep_alive}"
        );
    }
}

#[tokio::test]
async fn model_names_match_without_latest_and_case() {
    let fake = FakeOllama::builder().model("Llama3.2:latest").spawn().await;
    let answer = post(
        fake.addr(),
        "/api/generate",
        json!({ "model": "LLAMA3.2", "prompt": "hi", "stream": false }),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(
        answer.json()["model"],
        "LLAMA3.2",
        "the model string is echoed as sent"
    );
}
