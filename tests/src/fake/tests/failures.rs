//! Scripted failures: statuses before the first byte, refused and reset connections, streams that
//! die mid-way. They are consumed in order, by inference requests only.

use std::error::Error as _;

use http::{Method, StatusCode};
use serde_json::json;

use super::{open, post};
use crate::fake::{Failure, FakeOllama};

const GENERATE: &str = r#"{"model":"llama3.2","prompt":"hi"}"#;

#[tokio::test]
async fn status_failures_answer_the_scripted_body() {
    let fake = FakeOllama::builder().model("llama3.2").spawn().await;
    let handle = fake.handle();
    handle.fail_next(Failure::Status(
        500,
        r#"{"error":"an error was encountered while running the model"}"#.into(),
    ));
    handle.fail_next(Failure::Status(503, r#"{"error":"busy"}"#.into()));

    // Metadata and load calls do not consume a failure.
    post(fake.addr(), "/api/show", json!({ "model": "llama3.2" })).await;
    post(fake.addr(), "/api/generate", json!({ "model": "llama3.2" })).await;

    let streamed = post(
        fake.addr(),
        "/api/generate",
        json!({ "model": "llama3.2", "prompt": "hi" }),
    )
    .await;
    assert_eq!(streamed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        streamed.error(),
        "an error was encountered while running the model"
    );
    assert_eq!(
        streamed.content_type(),
        Some("application/json"),
        "error after a stream was requested"
    );

    let plain = post(
        fake.addr(),
        "/api/generate",
        json!({ "model": "llama3.2", "prompt": "hi", "stream": false }),
    )
    .await;
    assert_eq!(
        (plain.status, plain.error()),
        (StatusCode::SERVICE_UNAVAILABLE, "busy".to_owned())
    );
    assert_eq!(
        plain.content_type(),
        Some("application/json; charset=utf-8")
    );

    let fine = post(
        fake.addr(),
        "/api/generate",
        json!({ "model": "llama3.2", "prompt": "hi", "stream": false }),
    )
    .await;
    assert_eq!(fine.status, StatusCode::OK);
}

#[tokio::test]
async fn refused_and_reset_connections_get_no_answer() {
    let fake = FakeOllama::builder().model("llama3.2").spawn().await;
    let handle = fake.handle();
    handle.fail_next(Failure::Refuse);
    handle.fail_next(Failure::Reset);
    let refused = open(fake.addr(), Method::POST, "/api/generate", GENERATE, &[]).await;
    assert!(
        refused.is_err_and(|e| e.is_incomplete_message()),
        "closed before any answer"
    );
    let reset = open(fake.addr(), Method::POST, "/api/generate", GENERATE, &[]).await;
    let reset = reset.err().and_then(|e| {
        e.source()
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .map(std::io::Error::kind)
    });
    assert_eq!(reset, Some(std::io::ErrorKind::ConnectionReset));
    assert_eq!(
        handle.requests_to("/api/generate").len(),
        2,
        "both were received and recorded"
    );
    assert_eq!((handle.cancelled(), handle.peak_concurrency()), (0, 0));
    assert!(
        open(fake.addr(), Method::POST, "/api/generate", GENERATE, &[])
            .await
            .is_ok()
    );
}

#[tokio::test]
async fn die_mid_stream_cuts_after_n_lines() {
    let fake = FakeOllama::builder()
        .model("llama3.2")
        .tokens(6)
        .spawn()
        .await;
    let handle = fake.handle();
    handle.fail_next(Failure::DieMidStream { after_lines: 2 });
    let mut stream = open(fake.addr(), Method::POST, "/api/generate", GENERATE, &[])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stream.status, StatusCode::OK);
    assert_eq!(stream.json_line().await["response"], "The");
    assert_eq!(stream.json_line().await["response"], " quick");
    assert!(
        stream.line().await.is_some_and(|line| line.is_err()),
        "the body breaks: no error line, no end"
    );
    handle.wait_idle().await;
    assert_eq!(handle.cancelled(), 0);

    // A non-streamed request is dropped without an answer; SSE frames count as lines.
    handle.fail_next(Failure::DieMidStream { after_lines: 1 });
    let plain = open(
        fake.addr(),
        Method::POST,
        "/api/generate",
        r#"{"model":"llama3.2","prompt":"x","stream":false}"#,
        &[],
    )
    .await;
    assert!(plain.is_err());
    handle.fail_next(Failure::DieMidStream { after_lines: 1 });
    let body = r#"{"model":"llama3.2","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let mut sse = open(fake.addr(), Method::POST, "/v1/chat/completions", body, &[])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        sse.line()
            .await
            .is_some_and(|line| line.is_ok_and(|l| l.starts_with("data: ")))
    );
    assert!(sse.rest().await.is_err());
}

#[tokio::test]
async fn error_mid_stream_sends_an_error_line_and_ends() {
    let fake = FakeOllama::builder()
        .model("llama3.2")
        .tokens(4)
        .spawn()
        .await;
    let handle = fake.handle();
    let boom = || Failure::ErrorMidStream {
        after_lines: 2,
        message: "boom".into(),
    };
    handle.fail_next(boom());
    let mut stream = open(fake.addr(), Method::POST, "/api/generate", GENERATE, &[])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let lines = stream
        .rest()
        .await
        .unwrap_or_else(|e| panic!("the stream ends cleanly: {e}"));
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[2], r#"{"error":"boom"}"#);
    assert_eq!(stream.status, StatusCode::OK);

    handle.fail_next(boom());
    let plain = post(
        fake.addr(),
        "/api/generate",
        json!({ "model": "llama3.2", "prompt": "x", "stream": false }),
    )
    .await;
    assert_eq!(
        (plain.status, plain.error()),
        (StatusCode::INTERNAL_SERVER_ERROR, "boom".to_owned())
    );

    handle.fail_next(boom());
    let body = r#"{"model":"llama3.2","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let mut sse = open(fake.addr(), Method::POST, "/v1/chat/completions", body, &[])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let lines = sse.rest().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        lines
            .iter()
            .filter(|line| line.starts_with("data: "))
            .count(),
        2
    );
    assert!(!lines.iter().any(|line| line == "data: [DONE]"));
    handle.wait_idle().await;
    assert_eq!(handle.cancelled(), 0);
}
