//! The VRAM mode over real sockets: residency, the cold FIFO, eviction after in-flight requests,
//! `keep_alive`, `/api/ps` and `load_duration`. Times are tens of milliseconds and only ever
//! bound from below, so that scheduling jitter cannot fail a test; ordering is observed through
//! the handle's events, never through sleeps.

use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use http::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use super::{Answer, call, open, post};
use crate::fake::FakeOllama;

const GIB: u64 = 1 << 30;

/// 10 GiB of VRAM; `a` and `b` take 6 GiB each (they do not fit together), `c` 4 GiB.
fn builder() -> crate::fake::FakeBuilder {
    FakeOllama::builder()
        .model("a")
        .model("b")
        .model("c")
        .slots(4)
        .vram(10 * GIB)
        .model_size("a", 6 * GIB)
        .model_size("b", 6 * GIB)
        .model_size("c", 4 * GIB)
}

fn generate(addr: SocketAddr, model: &str) -> JoinHandle<Answer> {
    let body = json!({ "model": model, "prompt": "hi", "stream": false });
    tokio::spawn(async move { post(addr, "/api/generate", body).await })
}

fn nanos(answer: &Answer, field: &str) -> Duration {
    let value = answer.json()[field].as_u64();
    Duration::from_nanos(value.unwrap_or_else(|| panic!("no {field} in {}", answer.text())))
}

async fn ok(request: JoinHandle<Answer>) -> Answer {
    let answer = request
        .await
        .unwrap_or_else(|e| panic!("request task: {e}"));
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    answer
}

#[tokio::test]
async fn a_request_for_a_resident_model_does_not_wait_for_a_load() {
    let fake = builder()
        .loaded("a")
        .load_time(Duration::from_secs(30))
        .spawn()
        .await;
    let handle = fake.handle();
    let answer = ok(generate(fake.addr(), "a")).await;
    assert!(nanos(&answer, "load_duration") < Duration::from_secs(10));
    assert_eq!(
        (handle.loads("a"), handle.resident()),
        (0, vec!["a:latest".to_owned()])
    );
}

#[tokio::test]
async fn alternating_models_that_do_not_fit_together_pay_a_load_each_time() {
    let load = Duration::from_millis(20);
    let fake = builder().load_time(load).spawn().await;
    let handle = fake.handle();
    for model in ["a", "b", "a", "b"] {
        let answer = ok(generate(fake.addr(), model)).await;
        assert!(nanos(&answer, "load_duration") >= load);
        assert_eq!(handle.resident(), [format!("{model}:latest")]);
    }
    assert_eq!((handle.loads("a"), handle.loads("b")), (2, 2));
    assert_eq!((handle.unloads("a"), handle.unloads("b")), (2, 1));
    assert!(handle.load_time() >= load * 4);
}

#[tokio::test]
async fn a_cold_request_waits_behind_the_head_of_the_queue_even_when_it_would_fit() {
    let fake = builder().loaded("a").spawn().await;
    let (addr, handle) = (fake.addr(), fake.handle());
    handle.hold();
    let busy = generate(addr, "a");
    handle.wait_in_flight(1).await;
    // b needs a's room and a is busy; c would fit beside a but queues behind b.
    let b = generate(addr, "b");
    handle.wait_pending(1).await;
    let c = generate(addr, "c");
    handle.wait_pending(2).await;
    assert_eq!(handle.resident(), ["a:latest"]);
    assert_eq!((handle.loads("b"), handle.loads("c")), (0, 0));

    handle.release_all();
    for request in [busy, b, c] {
        ok(request).await;
    }
    assert_eq!(
        (handle.loads("b"), handle.loads("c"), handle.unloads("a")),
        (1, 1, 1)
    );
    assert_eq!(handle.resident(), ["b:latest", "c:latest"]);
    assert_eq!(handle.pending(), 0);
}

#[tokio::test]
async fn a_victim_is_unloaded_only_after_its_requests_finish_and_still_takes_new_ones() {
    let fake = builder().loaded("a").spawn().await;
    let (addr, handle) = (fake.addr(), fake.handle());
    handle.hold();
    let first = generate(addr, "a");
    handle.wait_in_flight(1).await;
    let b = generate(addr, "b");
    handle.wait_pending(1).await;
    // a is marked for eviction, yet a new request for it runs on it at once.
    let second = generate(addr, "a");
    handle.wait_in_flight(2).await;

    handle.release(1);
    let (done, other) = match futures_util::future::select(first, second).await {
        futures_util::future::Either::Left((done, other))
        | futures_util::future::Either::Right((done, other)) => (done, other),
    };
    assert_eq!(done.map(|answer| answer.status).ok(), Some(StatusCode::OK));
    assert_eq!(handle.resident(), ["a:latest"], "a request still runs on a");
    assert_eq!((handle.unloads("a"), handle.pending()), (0, 1));

    handle.release_all();
    ok(other).await;
    ok(b).await;
    assert_eq!((handle.unloads("a"), handle.loads("b")), (1, 1));
}

#[tokio::test]
async fn keep_alive_zero_unloads_after_the_request_and_the_unload_idiom_works() {
    let fake = builder().spawn().await;
    let (addr, handle) = (fake.addr(), fake.handle());
    let once = json!({ "model": "a", "prompt": "hi", "stream": false, "keep_alive": 0 });
    assert_eq!(
        post(addr, "/api/generate", once).await.status,
        StatusCode::OK
    );
    handle.wait_unloads("a", 1).await;
    assert!(handle.resident().is_empty());

    // The load idiom loads the model and keeps it; the unload idiom sends it away.
    let load = post(addr, "/api/generate", json!({ "model": "a" })).await;
    assert_eq!(load.json()["done_reason"], "load");
    assert_eq!(
        (handle.loads("a"), handle.resident()),
        (2, vec!["a:latest".to_owned()])
    );
    let unload = post(
        addr,
        "/api/chat",
        json!({ "model": "a", "messages": [], "keep_alive": 0 }),
    )
    .await;
    assert_eq!(unload.json()["done_reason"], "unload");
    handle.wait_unloads("a", 2).await;
    assert!(handle.resident().is_empty());

    // An idle model expires after its keep-alive.
    let brief = json!({ "model": "c", "prompt": "hi", "stream": false, "keep_alive": "30ms" });
    assert_eq!(
        post(addr, "/api/generate", brief).await.status,
        StatusCode::OK
    );
    handle.wait_unloads("c", 1).await;
    assert!(handle.resident().is_empty());
}

#[tokio::test]
async fn ps_lists_sizes_expiry_and_loading_models() {
    let fake = builder()
        .model_load_time("c", Duration::from_secs(60))
        .spawn()
        .await;
    let (addr, handle) = (fake.addr(), fake.handle());
    let pinned = json!({ "model": "a", "prompt": "hi", "stream": false, "keep_alive": -1 });
    assert_eq!(
        post(addr, "/api/generate", pinned).await.status,
        StatusCode::OK
    );
    let loading = generate(addr, "c");
    handle.wait_loads("c", 1).await;

    let ps = call(addr, Method::GET, "/api/ps", "").await.json();
    let rows = ps["models"].as_array().cloned().unwrap_or_default();
    let names: Vec<&str> = rows.iter().filter_map(|row| row["name"].as_str()).collect();
    assert_eq!(
        names,
        ["a:latest", "c:latest"],
        "the pinned model first: {ps}"
    );
    assert_eq!(rows[0]["size"], 6 * GIB);
    assert_eq!(rows[0]["size_vram"], 6 * GIB);
    assert_eq!(rows[1]["size_vram"], 4 * GIB);
    let expires = |row: &Value| {
        let text = row["expires_at"].as_str().unwrap_or_default().to_owned();
        humantime::parse_rfc3339(&text).unwrap_or_else(|e| panic!("{text}: {e}"))
    };
    let in_a_year = SystemTime::now() + Duration::from_secs(365 * 24 * 3600);
    assert!(expires(&rows[0]) > in_a_year, "kept forever");
    // A model in use shows its keep-alive (the default five minutes) counted from now.
    let left = expires(&rows[1])
        .duration_since(SystemTime::now())
        .unwrap_or_default();
    assert!(left > Duration::from_secs(240) && left <= Duration::from_secs(300));
    loading.abort();
}

#[tokio::test]
async fn load_duration_counts_from_arrival_through_the_unload_and_the_load() {
    let (load, unload) = (Duration::from_millis(40), Duration::from_millis(30));
    let fake = builder().load_time(load).unload_time(unload).spawn().await;
    let addr = fake.addr();
    let answer = ok(generate(addr, "a")).await;
    let loaded = nanos(&answer, "load_duration");
    assert!(loaded >= load);
    assert!(nanos(&answer, "total_duration") >= loaded);

    // Streamed, and b must first wait for a to unload.
    let body = json!({ "model": "b", "prompt": "hi" }).to_string();
    let mut stream = open(addr, Method::POST, "/api/generate", &body, &[])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let lines = stream.rest().await.unwrap_or_else(|e| panic!("{e}"));
    let last: Value = lines
        .last()
        .and_then(|line| serde_json::from_str(line).ok())
        .unwrap_or_default();
    let waited = Duration::from_nanos(last["load_duration"].as_u64().unwrap_or(0));
    assert!(waited >= load + unload, "{last}");
    assert_eq!(fake.handle().unloads("a"), 1);
}

#[tokio::test]
async fn a_model_larger_than_vram_fails_as_ollama_does() {
    let fake = builder()
        .model("huge")
        .model_size("huge", 12 * GIB)
        .spawn()
        .await;
    let answer = post(
        fake.addr(),
        "/api/generate",
        json!({ "model": "huge", "prompt": "hi" }),
    )
    .await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(answer.content_type(), Some("application/json"));
    assert_eq!(
        answer.error(),
        "model requires more system memory (12.0 GiB) than is available (10.0 GiB)"
    );
    assert_eq!(fake.handle().pending(), 0);
}

#[tokio::test]
async fn the_busy_503_comes_from_the_pending_queue_not_from_resident_requests() {
    let fake = builder().loaded("a").slots(1).max_queue(1).spawn().await;
    let (addr, handle) = (fake.addr(), fake.handle());
    handle.hold();
    let running = generate(addr, "a");
    handle.wait_in_flight(1).await;
    // Two more requests for the resident model wait for the slot without limit.
    let waiting = [generate(addr, "a"), generate(addr, "a")];
    handle.wait_queued(2).await;
    let b = generate(addr, "b");
    handle.wait_pending(1).await;
    let refused = post(
        addr,
        "/api/generate",
        json!({ "model": "c", "prompt": "hi" }),
    )
    .await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.error(), crate::fake::stream::BUSY);

    handle.release_all();
    ok(running).await;
    for request in waiting {
        ok(request).await;
    }
    ok(b).await;
}

#[tokio::test]
async fn a_client_that_leaves_the_pending_queue_frees_its_place() {
    let fake = builder().loaded("a").spawn().await;
    let (addr, handle) = (fake.addr(), fake.handle());
    handle.hold();
    let running = generate(addr, "a");
    handle.wait_in_flight(1).await;
    let gone = generate(addr, "b");
    handle.wait_pending(1).await;
    gone.abort();
    handle.wait_cancelled(1).await;
    assert_eq!(handle.pending(), 0);
    handle.release_all();
    ok(running).await;
    // a was chosen as b's victim before b left: as in Ollama, it goes anyway.
    handle.wait_unloads("a", 1).await;
    assert_eq!(handle.loads("b"), 0);
}
