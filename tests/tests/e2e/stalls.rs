//! Stalls: an upstream that goes silent mid-stream, a client that stops
//! reading (on HTTP/1, or on HTTP/2 by opening no stream window), a body
//! that stops half-way, bodies that together exceed the queue's byte
//! budget, and a host that fails while the others are busy.
//! Each ends cleanly and gives its host slot back, so the next request is
//! served.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::{TokioExecutor, TokioIo};
use oqp_tests::client::{HttpClient, eventually};
use oqp_tests::fake::{Failure, FakeOllama};
use oqp_tests::harness::{ConfigYaml, Host, Stack};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support;

/// Long enough to never decide a test by itself.
const PATIENCE: Duration = Duration::from_secs(20);

/// One host with one slot.
fn config(url: &str, proxy: &str, extra: &str) -> String {
    ConfigYaml::new()
        .max_concurrent(1)
        .under("proxy", proxy)
        .host(Host::ollama("primary", url).set("max_concurrent", 1))
        .raw(extra)
        .yaml()
}

fn generate(stream: bool) -> Value {
    json!({"model": "llama3", "prompt": "hi", "stream": stream})
}

/// The one host is free again and serves the next request.
async fn assert_slot_free(stack: &Stack, http: &HttpClient) {
    let reply = tokio::time::timeout(
        PATIENCE,
        http.post_json(
            &format!("{}/api/generate", stack.url()),
            &[],
            &generate(false),
        ),
    )
    .await
    .expect("the next request was never served: the slot is still held");
    assert_eq!(reply.status, 200, "{}", reply.text());
    let status = http
        .get(&format!("{}/queue/status", stack.url()), &[])
        .await
        .json();
    assert_eq!(status["hosts"][0]["slots_in_use"], 0, "{status}");
    assert_eq!(status["concurrency"]["active"], 0, "{status}");
}

#[tokio::test]
async fn an_upstream_silent_mid_stream_ends_it_in_band_and_frees_the_slot() {
    let fake = FakeOllama::builder()
        .model("llama3")
        .tokens(10)
        .spawn()
        .await;
    let stack = Stack::start(&config(&fake.url(), "  upstream_stall_timeout: 0.3\n", "")).await;
    fake.handle()
        .fail_next(Failure::StallMidStream { after_lines: 2 });
    let http = HttpClient::new();
    let (status, _, lines) = tokio::time::timeout(
        PATIENCE,
        http.post_lines(
            &format!("{}/api/generate", stack.url()),
            &[],
            &generate(true),
        ),
    )
    .await
    .expect("the stalled stream never ended");
    assert_eq!(status, 200);
    let lines: Vec<Value> = lines
        .iter()
        .map(|line| serde_json::from_str(&line.line).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(lines[..2].iter().all(|line| line.get("response").is_some()));
    let error = lines[2]["error"].as_str().expect("an in-band error line");
    assert!(error.contains("primary"), "{error}");
    // The upstream connection was dropped: Ollama stops generating.
    tokio::time::timeout(PATIENCE, fake.handle().wait_cancelled(1))
        .await
        .expect("the stalled upstream request was never abandoned");
    assert_slot_free(&stack, &http).await;
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_frees_the_slot() {
    let _exclusive = support::exclusive().await;
    // Far more than every socket buffer on the way can hold.
    let fake = FakeOllama::builder()
        .model("llama3")
        .tokens(400_000)
        .spawn()
        .await;
    let stack = Stack::start(&config(&fake.url(), "  client_stall_timeout: 0.3\n", "")).await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stalled = socket.connect(stack.proxy_addr()).await.unwrap();
    let body = generate(true).to_string();
    let request = format!(
        "POST /api/generate HTTP/1.1\r\nHost: oqp\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stalled.write_all(request.as_bytes()).await.unwrap();
    // Never read: the proxy's writes stop making progress.
    tokio::time::timeout(PATIENCE, fake.handle().wait_cancelled(1))
        .await
        .expect("the stream to a client that stopped reading was never abandoned");
    let http = HttpClient::new();
    fake.handle().set_tokens(3);
    assert_slot_free(&stack, &http).await;
    drop(stalled);
    stack.shutdown().await;
}

#[tokio::test]
async fn an_http2_client_that_opens_no_stream_window_frees_the_slot() {
    // A generation far longer than the test.
    let fake = FakeOllama::builder()
        .model("llama3")
        .tokens(100_000)
        .token_interval(Duration::from_millis(10))
        .spawn()
        .await;
    let stack = Stack::start(&config(&fake.url(), "  client_stall_timeout: 0.3\n", "")).await;
    let stream = TcpStream::connect(stack.proxy_addr()).await.unwrap();
    // A stream window of 0, never opened: the proxy may send the head but
    // no byte of the body, and its socket writes never block (the
    // connection's window and pings go on working).
    let (mut sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(0)
        .handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    let request = http::Request::post(format!("{}/api/generate", stack.url()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(generate(true).to_string())))
        .unwrap();
    let response = tokio::time::timeout(PATIENCE, sender.send_request(request))
        .await
        .expect("no response head")
        .unwrap();
    assert_eq!(response.status(), 200);
    // The body is never read.
    tokio::time::timeout(PATIENCE, fake.handle().wait_cancelled(1))
        .await
        .expect("the stream to a client that opened no window was never abandoned");
    let http = HttpClient::new();
    fake.handle().set_tokens(3);
    fake.handle().set_token_interval(Duration::ZERO);
    assert_slot_free(&stack, &http).await;
    drop(response);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_half_sent_body_gets_408() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), "  body_read_timeout: 0.3\n", "")).await;
    let half = b"POST /api/generate HTTP/1.1\r\nHost: oqp\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":";
    assert_eq!(
        support::raw_exchange(stack.proxy_addr(), half).await,
        Some(408)
    );
    let chunked = b"POST /api/generate HTTP/1.1\r\nHost: oqp\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\n";
    assert_eq!(
        support::raw_exchange(stack.proxy_addr(), chunked).await,
        Some(408)
    );
    assert!(
        fake.handle().requests_to("/api/generate").is_empty(),
        "nothing reached the host"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn a_body_being_read_counts_against_max_queued_mb() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), "", "queue:\n  max_queued_mb: 1\n")).await;
    // 700 KB announced and 650 KB of it sent; the proxy holds what it has
    // received while the rest does not come.
    let mut slow = announce(&stack, 700_000).await;
    let mut sent = b"{\"model\":\"llama3\",\"prompt\":\"".to_vec();
    sent.resize(650_000, b'x');
    slow.write_all(&sent).await.unwrap();
    let app = stack.control.dataplane().unwrap().app().clone();
    assert!(
        eventually(PATIENCE, || app.body_budget.used() >= 650_000).await,
        "the received bytes were never counted: {}",
        app.body_budget.used()
    );
    let http = HttpClient::new();
    let big = json!({"model": "llama3", "prompt": "x".repeat(500_000), "stream": false});
    let url = format!("{}/api/generate", stack.url());
    let refused = http.post_json(&url, &[], &big).await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert_eq!(refused.json()["error"], "queue over capacity (bytes)");
    // The half-read body gives its share back when its client goes.
    drop(slow);
    assert!(
        eventually(PATIENCE, || app.body_budget.used() == 0).await,
        "the abandoned body's bytes were never given back"
    );
    let served = http.post_json(&url, &[], &big).await;
    assert_eq!(served.status, 200, "{}", served.text());
    stack.shutdown().await;
}

#[tokio::test]
async fn bodies_that_only_declare_a_large_length_do_not_refuse_others() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), "", "queue:\n  max_queued_mb: 1\n")).await;
    // Together they announce more than the budget, and send nothing.
    let idle = [
        announce(&stack, 700_000).await,
        announce(&stack, 700_000).await,
    ];
    let app = stack.control.dataplane().unwrap().app().clone();
    assert_eq!(app.body_budget.used(), 0, "a declared length was reserved");
    let http = HttpClient::new();
    let big = json!({"model": "llama3", "prompt": "x".repeat(500_000), "stream": false});
    let served = http
        .post_json(&format!("{}/api/generate", stack.url()), &[], &big)
        .await;
    assert_eq!(served.status, 200, "{}", served.text());
    drop(idle);
    stack.shutdown().await;
}

/// Opens a request announcing a body of `length` bytes and waits until the
/// proxy starts reading it (its 100 Continue).
async fn announce(stack: &Stack, length: usize) -> TcpStream {
    let mut socket = TcpStream::connect(stack.proxy_addr()).await.unwrap();
    let head = format!(
        "POST /api/generate HTTP/1.1\r\nHost: oqp\r\nContent-Type: application/json\r\nContent-Length: {length}\r\nExpect: 100-continue\r\n\r\n"
    );
    socket.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let mut buffer = [0u8; 256];
    while !answer.windows(12).any(|w| w == b"100 Continue") {
        let n = tokio::time::timeout(PATIENCE, socket.read(&mut buffer))
            .await
            .expect("no 100 Continue")
            .unwrap();
        assert!(n > 0, "closed before 100 Continue");
        answer.extend_from_slice(&buffer[..n]);
    }
    socket
}

/// Hosts `a` (models `both`, `onlya`) and `b` (`both`, `onlyb`), one slot
/// each, routed by model, behind one stack.
async fn two_hosts() -> (FakeOllama, FakeOllama, Stack) {
    let a = FakeOllama::builder()
        .model("both")
        .model("onlya")
        .spawn()
        .await;
    let b = FakeOllama::builder()
        .model("both")
        .model("onlyb")
        .spawn()
        .await;
    let yaml = format!(
        "proxy:\n  max_concurrent: 1\nollama:\n  hosts:\n    - url: \"{}\"\n      name: a\n      max_concurrent: 1\n    - url: \"{}\"\n      name: b\n      max_concurrent: 1\nrouting:\n  strategy: model_aware\n",
        a.url(),
        b.url()
    );
    let stack = Stack::start(&yaml).await;
    (a, b, stack)
}

#[tokio::test]
async fn a_failing_host_frees_its_slot_while_its_request_waits_for_another() {
    let (a, b, stack) = two_hosts().await;
    let url = format!("{}/api/generate", stack.url());
    let ask = |model: &str| {
        let url = url.clone();
        let body = json!({"model": model, "prompt": "hi", "stream": false});
        tokio::spawn(async move { HttpClient::new().post_json(&url, &[], &body).await })
    };
    // b's one slot is taken and held.
    b.handle().hold();
    let on_b = ask("onlyb");
    b.handle().wait_in_flight(1).await;
    // The next request goes to a, which is busy: it must wait for b.
    a.handle().fail_next(Failure::Status(
        503,
        r#"{"error":"server busy, please try again.  maximum pending requests exceeded"}"#.into(),
    ));
    let failed_over = ask("both");
    // (The control plane's polls reach the fake too: count generates only.)
    assert!(
        eventually(PATIENCE, || a.handle().requests_to("/api/generate").len()
            == 1)
        .await,
        "the request never reached a"
    );
    // Meanwhile a's slot serves someone else.
    let reply = tokio::time::timeout(PATIENCE, ask("onlya"))
        .await
        .expect("a's slot stayed with the request that left it")
        .unwrap();
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-failover-host").as_deref(), Some("a"));
    assert!(!failed_over.is_finished(), "still waiting for b");
    b.handle().release_all();
    let first = on_b.await.unwrap();
    assert_eq!(first.status, 200);
    let moved = failed_over.await.unwrap();
    assert_eq!(moved.status, 200, "{}", moved.text());
    assert_eq!(moved.header("x-failover-host").as_deref(), Some("b"));
    stack.shutdown().await;
}

#[tokio::test]
async fn a_slot_freed_by_a_failover_goes_to_a_request_already_queued() {
    let (a, b, stack) = two_hosts().await;
    let dispatcher = stack.control.dataplane().unwrap().app().dispatcher.clone();
    let url = format!("{}/api/generate", stack.url());
    let ask = |model: &str| {
        let url = url.clone();
        let body = json!({"model": model, "prompt": "hi", "stream": false});
        tokio::spawn(async move { HttpClient::new().post_json(&url, &[], &body).await })
    };
    // Both hosts are taken and held.
    a.handle().hold();
    b.handle().hold();
    let on_a = ask("onlya");
    a.handle().wait_in_flight(1).await;
    let on_b = ask("onlyb");
    b.handle().wait_in_flight(1).await;
    // Two requests queue: one that a will refuse, then one only a can serve.
    a.handle().fail_next(Failure::Status(
        503,
        r#"{"error":"server busy, please try again.  maximum pending requests exceeded"}"#.into(),
    ));
    let failing = ask("both");
    assert!(eventually(PATIENCE, || dispatcher.total_depth() == 1).await);
    let queued = ask("onlya");
    assert!(eventually(PATIENCE, || dispatcher.total_depth() == 2).await);
    // a's slot frees: the first goes there, is refused and waits for b,
    // leaving a's slot to the request queued behind it.
    a.handle().release(2);
    let reply = tokio::time::timeout(PATIENCE, queued)
        .await
        .expect("a's freed slot was never given to the queued request")
        .unwrap();
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-failover-host").as_deref(), Some("a"));
    assert!(!failing.is_finished(), "still waiting for b");
    b.handle().release_all();
    assert_eq!(on_a.await.unwrap().status, 200);
    assert_eq!(on_b.await.unwrap().status, 200);
    let moved = failing.await.unwrap();
    assert_eq!(moved.status, 200, "{}", moved.text());
    assert_eq!(moved.header("x-failover-host").as_deref(), Some("b"));
    stack.shutdown().await;
}

#[tokio::test]
async fn a_streamed_body_that_stops_half_way_frees_the_slot() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let proxy = "  body_read_timeout: 0.3\n  allow_model_management: true\n";
    let stack = Stack::start(&config(&fake.url(), proxy, "")).await;
    // A streamed path (not read whole by the proxy): a slot is granted, then
    // the body stops after a few bytes.
    let mut trickle = TcpStream::connect(stack.proxy_addr()).await.unwrap();
    trickle
        .write_all(
            b"POST /api/create HTTP/1.1\r\nHost: oqp\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":",
        )
        .await
        .unwrap();
    let dispatcher = stack.control.dataplane().unwrap().app().dispatcher.clone();
    assert!(
        eventually(PATIENCE, || dispatcher.routing().1[0].slots_in_use == 1).await,
        "the streamed request never took the slot"
    );
    // The stalled body fails its upstream request and the client is answered.
    let mut answer = Vec::new();
    let mut buffer = [0u8; 1024];
    loop {
        let n = tokio::time::timeout(PATIENCE, trickle.read(&mut buffer))
            .await
            .expect("the stalled upload was never ended")
            .unwrap_or(0);
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&buffer[..n]);
        if answer.windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    let head = String::from_utf8_lossy(&answer);
    // (Answered as an upstream failure: the upstream request is what failed.)
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    let http = HttpClient::new();
    assert_slot_free(&stack, &http).await;
    drop(trickle);
    stack.shutdown().await;
}
