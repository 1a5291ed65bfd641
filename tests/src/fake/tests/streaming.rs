//! NDJSON streams, joined answers, client disconnects and shutdown.

use std::time::Duration;

use http::{Method, StatusCode};
use serde_json::{Value, json};

use super::{open, post};
use crate::fake::FakeOllama;

#[tokio::test]
async fn generate_streams_one_line_at_a_time() {
    let fake = FakeOllama::builder()
        .model("llama3.2")
        .tokens(4)
        .token_interval(Duration::from_millis(15))
        .spawn()
        .await;
    let body = r#"{"model":"llama3.2","prompt":"why is the sky blue"}"#;
    let mut stream = open(fake.addr(), Method::POST, "/api/generate", body, &[])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stream.status, StatusCode::OK);
    assert_eq!(stream.headers["content-type"], "application/x-ndjson");
    assert_eq!(stream.headers["transfer-encoding"], "chunked");
    let mut lines: Vec<Value> = Vec::new();
    for _ in 0..5 {
        lines.push(stream.json_line().await);
    }
    assert!(stream.line().await.is_none(), "nothing after the done line");

    let text: String = lines
        .iter()
        .filter_map(|line| line["response"].as_str())
        .collect();
    assert_eq!(text, "The quick brown fox");
    for line in &lines[..4] {
        assert_eq!(line["done"], false);
        assert_eq!(line["model"], "llama3.2");
        assert!(
            line.get("total_duration").is_none(),
            "no metrics on content chunks"
        );
    }
    // RFC 3339 with nanoseconds sorts as text; lines are sent 15 ms apart.
    let stamps: Vec<&str> = lines
        .iter()
        .filter_map(|line| line["created_at"].as_str())
        .collect();
    assert!(
        stamps.windows(2).all(|pair| pair[0] < pair[1]),
        "{stamps:?}"
    );
    assert!(stamps.iter().all(|stamp| stamp.ends_with('Z')));

    let done = &lines[4];
    assert_eq!(
        (done["done"].clone(), done["done_reason"].clone()),
        (json!(true), json!("stop"))
    );
    assert_eq!(done["response"], "");
    assert_eq!(done["eval_count"], 4);
    assert_eq!(done["prompt_eval_count"], 5);
    assert_eq!(done["context"].as_array().map(Vec::len), Some(9));
    let total = done["total_duration"].as_u64().unwrap_or(0);
    assert!(total >= 60_000_000, "total_duration is wall time: {total}");
    for field in ["load_duration", "prompt_eval_duration", "eval_duration"] {
        assert!(done[field].as_u64().is_some_and(|ns| ns > 0), "{field}");
    }
    let key_order: Vec<&String> = done
        .as_object()
        .map(|o| o.keys().collect())
        .unwrap_or_default();
    assert_eq!(
        key_order[..6],
        [
            "model",
            "created_at",
            "response",
            "done",
            "done_reason",
            "context"
        ]
    );
}

#[tokio::test]
async fn stream_false_joins_the_answer() {
    let fake = FakeOllama::builder()
        .model("llama3.2")
        .tokens(3)
        .spawn()
        .await;
    let addr = fake.addr();
    let generate = post(
        addr,
        "/api/generate",
        json!({ "model": "llama3.2", "prompt": "hi", "stream": false }),
    )
    .await;
    assert_eq!(
        generate.content_type(),
        Some("application/json; charset=utf-8")
    );
    let generate = generate.json();
    assert_eq!(generate["response"], "The quick brown");
    assert_eq!(
        (generate["done"].clone(), generate["eval_count"].clone()),
        (json!(true), json!(3))
    );

    let chat = json!({ "model": "llama3.2", "stream": false, "messages": [{ "role": "user", "content": "hi" }] });
    let chat = post(addr, "/api/chat", chat).await.json();
    assert_eq!(
        chat["message"],
        json!({ "role": "assistant", "content": "The quick brown" })
    );
    assert!(chat.get("context").is_none());

    let limited = json!({ "model": "llama3.2", "prompt": "hi", "stream": false, "options": { "num_predict": 2 } });
    let limited = post(addr, "/api/generate", limited).await.json();
    assert_eq!(
        (limited["response"].clone(), limited["done_reason"].clone()),
        (json!("The quick"), json!("length"))
    );
}

#[tokio::test]
async fn chat_stream_carries_message_on_every_line() {
    let fake = FakeOllama::builder()
        .model("llama3.2")
        .tokens(2)
        .spawn()
        .await;
    let body = r#"{"model":"llama3.2","messages":[{"role":"user","content":"hi"}]}"#;
    let mut stream = open(fake.addr(), Method::POST, "/api/chat", body, &[])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let lines = stream.rest().await.unwrap_or_default();
    assert_eq!(lines.len(), 3);
    for line in &lines {
        let line: Value = serde_json::from_str(line).unwrap_or_default();
        assert_eq!(line["message"]["role"], "assistant");
        assert!(line["message"]["content"].is_string());
    }
}

#[tokio::test]
async fn a_client_that_leaves_releases_its_slot_at_once() {
    let fake = FakeOllama::builder()
        .model("llama3.2")
        .tokens(3)
        .token_interval(Duration::from_secs(30))
        .spawn()
        .await;
    let handle = fake.handle();
    let mut stream = open(
        fake.addr(),
        Method::POST,
        "/api/generate",
        r#"{"model":"llama3.2","prompt":"hi"}"#,
        &[],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stream.json_line().await["response"], "The");
    assert_eq!(handle.in_flight(), 1);
    drop(stream);
    handle.wait_cancelled(1).await;
    handle.wait_idle().await;
    assert_eq!((handle.cancelled(), handle.in_flight()), (1, 0));
    assert!(handle.requests()[0].finished_at.is_some());

    // A held request whose client leaves while it waits is counted too.
    handle.hold();
    let waiting = open(
        fake.addr(),
        Method::POST,
        "/api/generate",
        r#"{"model":"llama3.2","prompt":"hi"}"#,
        &[],
    );
    let waiting = tokio::spawn(waiting);
    handle.wait_in_flight(1).await;
    waiting.abort();
    handle.wait_cancelled(2).await;
    handle.wait_idle().await;
}

#[tokio::test]
async fn shutdown_aborts_connections_and_frees_the_port() {
    let fake = FakeOllama::builder().model("llama3.2").spawn().await;
    let (addr, handle) = (fake.addr(), fake.handle());
    handle.hold();
    let body = r#"{"model":"llama3.2","prompt":"hi"}"#;
    let stuck = tokio::spawn(async move {
        open(addr, Method::POST, "/api/generate", body, &[])
            .await
            .is_err()
    });
    handle.wait_in_flight(1).await;
    fake.shutdown().await;
    assert!(
        stuck.await.unwrap_or(false),
        "the held request fails with the host"
    );
    assert_eq!(handle.cancelled(), 0, "a dying host is not a client cancel");
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "nobody listens any more"
    );

    let again = FakeOllama::builder()
        .model("llama3.2")
        .bind(addr)
        .spawn()
        .await;
    assert_eq!(again.addr(), addr);
    let answer = post(
        addr,
        "/api/generate",
        json!({ "model": "llama3.2", "prompt": "hi", "stream": false }),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
}
