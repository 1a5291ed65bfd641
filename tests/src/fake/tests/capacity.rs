//! Slots that block like `OLLAMA_NUM_PARALLEL`, the pending-queue limit, the hold gate and the
//! concurrency peaks, all driven by events (no sleeps).

use std::time::Duration;

use http::{Method, StatusCode};
use serde_json::json;

use super::{call, call_with, post};
use crate::fake::FakeOllama;

const PLAIN: &str = r#"{"model":"llama3.2","prompt":"hi","stream":false}"#;

#[tokio::test]
async fn slots_block_and_peak_concurrency_never_exceeds_them() {
    let fake = FakeOllama::builder()
        .model("llama3.2")
        .slots(2)
        .spawn()
        .await;
    let (addr, handle) = (fake.addr(), fake.handle());
    handle.hold();
    let mut requests = Vec::new();
    for client in ["a", "a", "b", "b"] {
        requests.push(tokio::spawn(async move {
            call_with(
                addr,
                Method::POST,
                "/api/generate",
                PLAIN,
                &[("x-client-id", client)],
            )
            .await
            .status
        }));
        if requests.len() == 2 {
            handle.wait_in_flight(2).await;
        }
    }
    handle.wait_queued(2).await;
    assert_eq!((handle.in_flight(), handle.queued()), (2, 2));
    assert_eq!(handle.peak_concurrency_of("a"), 2);

    // Metadata never waits for a slot.
    assert_eq!(
        call(addr, Method::GET, "/api/tags", "").await.status,
        StatusCode::OK
    );

    handle.release_all();
    for request in requests {
        assert_eq!(request.await.ok(), Some(StatusCode::OK));
    }
    assert_eq!(handle.peak_concurrency(), 2);
    assert!((1..=2).contains(&handle.peak_concurrency_of("b")));
    assert_eq!(handle.peak_concurrency_of("nobody"), 0);
    assert_eq!(
        (handle.in_flight(), handle.queued(), handle.cancelled()),
        (0, 0, 0)
    );
    assert!(
        handle
            .requests_to("/api/generate")
            .iter()
            .all(|r| r.finished_at.is_some())
    );
}

#[tokio::test]
async fn queue_limit_yields_the_busy_503() {
    let fake = FakeOllama::builder()
        .model("llama3.2")
        .slots(1)
        .max_queue(1)
        .spawn()
        .await;
    let (addr, handle) = (fake.addr(), fake.handle());
    handle.hold();
    let first = tokio::spawn(async move {
        call(addr, Method::POST, "/api/generate", PLAIN)
            .await
            .status
    });
    handle.wait_in_flight(1).await;
    let second = tokio::spawn(async move {
        call(addr, Method::POST, "/api/generate", PLAIN)
            .await
            .status
    });
    handle.wait_queued(1).await;

    let busy = call(addr, Method::POST, "/api/generate", PLAIN).await;
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        busy.error(),
        "server busy, please try again.  maximum pending requests exceeded"
    );
    let body = json!({ "model": "llama3.2", "messages": [{ "role": "user", "content": "hi" }] });
    let openai = post(addr, "/v1/chat/completions", body).await;
    assert_eq!(openai.json()["error"]["type"], "api_error");

    handle.release_all();
    assert_eq!(first.await.ok(), Some(StatusCode::OK));
    assert_eq!(second.await.ok(), Some(StatusCode::OK));
}

#[tokio::test]
async fn latency_is_spent_inside_the_slot() {
    let fake = FakeOllama::builder()
        .model("llama3.2")
        .latency(Duration::from_millis(20))
        .spawn()
        .await;
    let answer = call(fake.addr(), Method::POST, "/api/generate", PLAIN)
        .await
        .json();
    assert!(
        answer["total_duration"]
            .as_u64()
            .is_some_and(|ns| ns >= 20_000_000)
    );
    fake.handle().set_latency(Duration::from_millis(60));
    let answer = call(fake.addr(), Method::POST, "/api/generate", PLAIN)
        .await
        .json();
    assert!(
        answer["total_duration"]
            .as_u64()
            .is_some_and(|ns| ns >= 60_000_000)
    );
}
