//! Reliability: parts die under load and nothing is lost; clients leave and
//! every counter returns to zero; bad input is refused clearly and never
//! disturbs anyone else. Each scenario prints its figures.
//!
//! CI runs these at a scale that fits; `OQP_SOAK=1` makes the load phases
//! longer and runs the 10-minute soak (RSS at start and end).

use crate::support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use oqp_controlplane::config::Env;
use oqp_controlplane::{ControlPlane, Options};
use oqp_tests::bench::load::Req;
use oqp_tests::client::{HttpClient, eventually};
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::{self, Stack};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use support::{Load, Redis, generate, scale};

fn one_host(url: &str, slots: u32, extra: &str) -> String {
    format!(
        "proxy:\n  max_concurrent: {slots}\nollama:\n  hosts:\n    - url: \"{url}\"\n      name: primary\n      max_concurrent: {slots}\n{extra}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_restart_under_load_fails_no_request() {
    let _exclusive = crate::support::exclusive().await;
    let fake = FakeOllama::builder()
        .model("llama3")
        .slots(4)
        .latency(Duration::from_millis(2))
        .record_limit(64)
        .spawn()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("config.yml");
    // The state directory keeps the control plane's node token across its restarts.
    std::fs::create_dir(dir.path().join("state")).unwrap();
    let yaml = format!(
        "{}control_plane:\n  state_dir: \"{}\"\n",
        one_host(&fake.url(), 4, ""),
        dir.path().join("state").display()
    );
    std::fs::write(&config_path, yaml).unwrap();
    let start = |listener: TcpListener| {
        ControlPlane::start(Options {
            config_path: config_path.clone(),
            env: Env::empty(),
            listener: Some(listener),
            with_dataplane: false,
            dataplane_listener: None,
            clock: None,
        })
    };
    let mut control = start(harness::loopback().await).await.unwrap();
    let control_addr = control.local_addr();
    let dataplane = harness::start_dataplane(
        &format!("http://{control_addr}"),
        "edge",
        Some(control.node_token()),
    )
    .await
    .unwrap();
    let link = dataplane.app().control.clone();
    let mut load = Load::start(dataplane.local_addr(), 8, None, |_, _| generate(None));
    let phase = scale(200, 5_000);
    let mut outages = Vec::new();
    for _ in 0..scale(1, 5) {
        load.wait_for_more(phase).await;
        control.shutdown().await;
        let down = Instant::now();
        assert!(
            eventually(Duration::from_secs(30), || !link.is_connected()).await,
            "the data plane noticed the control plane left"
        );
        // Served on the last good snapshot while the control plane is away.
        load.wait_for_more(phase).await;
        // The same address, as a restarted process would bind it.
        control = start(TcpListener::bind(control_addr).await.unwrap())
            .await
            .unwrap();
        assert!(
            eventually(Duration::from_secs(15), || link.is_connected()).await,
            "the data plane reconnected to the restarted control plane"
        );
        outages.push(down.elapsed().as_secs_f64());
    }
    load.wait_for_more(phase).await;
    let tally = load.stop().await;
    println!(
        "control plane restart: {} requests, {} failed; {} restarts, ≥ {phase} requests served during each outage; reconnected after {outages:.2?} s",
        tally.ok + tally.failures.len() as u64,
        tally.failures.len(),
        outages.len(),
    );
    tally.assert_no_failures("control plane restart");
    dataplane.shutdown().await;
    control.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_under_load_fails_no_request() {
    let _exclusive = crate::support::exclusive().await;
    let fake = FakeOllama::builder()
        .embedding_model("all-minilm")
        .slots(4)
        .record_limit(64)
        .spawn()
        .await;
    let redis = Redis::start(0).await;
    let cache = format!(
        "embedding_cache:\n  enabled: true\n  backend: \"redis://127.0.0.1:{}/0\"\n  connect_timeout: 1\n",
        redis.port
    );
    let stack = Stack::start(&one_host(&fake.url(), 4, &cache)).await;
    // Twenty texts, asked over and over: mostly hits once they are stored.
    let embed = |client: usize, n: u64| {
        let text = format!("text {}", (client as u64 * 7 + n) % 20);
        Req::post(
            "/api/embed",
            None,
            json!({"model": "all-minilm", "input": text}).to_string(),
        )
    };
    let mut load = Load::start(stack.proxy_addr(), 6, Some("x-cache"), embed);
    let phase = scale(300, 5_000);
    load.wait_for_more(phase).await;
    let port = redis.kill();
    load.wait_for_more(phase).await;
    let redis = Redis::start(port).await;
    load.wait_for_more(phase).await;
    let tally = load.stop().await;
    // Once the backend is pinged back, hits come back too.
    let http = HttpClient::new();
    let url = format!("{}/api/embed", stack.url());
    let body = json!({"model": "all-minilm", "input": "after the restart"});
    let mut hit_again = false;
    let deadline = Instant::now() + Duration::from_secs(15);
    while !hit_again && Instant::now() < deadline {
        let reply = http.post_json(&url, &[], &body).await;
        assert_eq!(reply.status, 200);
        hit_again = reply.header("x-cache").as_deref() == Some("HIT");
        if !hit_again {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    println!(
        "redis restart: {} requests, {} failed; X-Cache {:?}; hits again after the restart: {hit_again}",
        tally.ok + tally.failures.len() as u64,
        tally.failures.len(),
        tally.by_header
    );
    tally.assert_no_failures("redis restart");
    assert!(
        tally.by_header.get("HIT").copied().unwrap_or(0) > 0,
        "the cache served hits"
    );
    assert!(hit_again, "the cache works again once Redis is back");
    drop(redis);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_two_hosts_dying_under_load_loses_no_request() {
    let _exclusive = crate::support::exclusive().await;
    let fake = || {
        FakeOllama::builder()
            .model("llama3")
            .slots(2)
            .latency(Duration::from_millis(5))
            .record_limit(64)
            .spawn()
    };
    let (first, second) = (fake().await, fake().await);
    let yaml = format!(
        "proxy:\n  max_concurrent: 2\nollama:\n  hosts:\n    - url: \"{}\"\n      name: primary\n      max_concurrent: 2\n    - url: \"{}\"\n      name: secondary\n      max_concurrent: 2\n",
        first.url(),
        second.url()
    );
    let stack = Stack::start(&yaml).await;
    let mut load = Load::start(stack.proxy_addr(), 6, Some("x-failover-host"), |_, _| {
        generate(None)
    });
    let phase = scale(200, 5_000);
    load.wait_for_more(phase).await;
    // Dies with requests in its slots: their connections are cut.
    second.shutdown().await;
    let killed = Instant::now();
    load.wait_for_more(phase).await;
    let tally = load.stop().await;
    println!(
        "host failure: {} requests, {} failed; answered by {:?}; {phase} more after the kill took {:.2} s",
        tally.ok + tally.failures.len() as u64,
        tally.failures.len(),
        tally.by_header,
        killed.elapsed().as_secs_f64()
    );
    assert!(
        tally.by_header.get("secondary").copied().unwrap_or(0) > 0,
        "both hosts served before the kill"
    );
    tally.assert_no_failures("host failure");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_clients_leaving_mid_queue_and_mid_stream_leave_nothing_behind() {
    let _exclusive = crate::support::exclusive().await;
    let streams = 200;
    let queued = 800;
    let fake = FakeOllama::builder()
        .model("llama3")
        .slots(streams)
        .token_interval(Duration::from_millis(50))
        // Long enough to outlast the test (the fake renders every token up front).
        .tokens(10_000)
        .spawn()
        .await;
    let yaml = one_host(
        &fake.url(),
        streams as u32,
        "queue:\n  normal:\n    max_depth: 1000\n",
    );
    let stack = Stack::start(&yaml).await;
    let app = stack.control.dataplane().unwrap().app().clone();
    let handle = fake.handle();
    let http = HttpClient::new();
    let url = format!("{}/api/generate", stack.url());

    // Clients mid-stream: each reads its first line, then keeps reading.
    let (first_line, mut first_lines) = tokio::sync::mpsc::channel(streams);
    let streaming: Vec<_> = (0..streams)
        .map(|_| {
            let (http, url, first_line) = (http.clone(), url.clone(), first_line.clone());
            tokio::spawn(async move {
                let response = http
                    .start(
                        http::Method::POST,
                        &url,
                        &[("content-type", "application/json")],
                        r#"{"model":"llama3","prompt":"an endless story"}"#,
                    )
                    .await;
                let mut body = response.into_body();
                let _ = body.frame().await;
                let _ = first_line.send(()).await;
                while body.frame().await.is_some() {}
            })
        })
        .collect();
    for _ in 0..streams {
        tokio::time::timeout(Duration::from_secs(30), first_lines.recv())
            .await
            .expect("every stream started");
    }
    // Clients mid-queue: every slot is taken, so they wait in oqp.
    let waiting: Vec<_> = (0..queued)
        .map(|_| {
            let (http, url) = (http.clone(), url.clone());
            tokio::spawn(async move {
                http.send(
                    http::Method::POST,
                    &url,
                    &[("content-type", "application/json")],
                    r#"{"model":"llama3","prompt":"hi","stream":false}"#,
                )
                .await
            })
        })
        .collect();
    assert!(
        eventually(Duration::from_secs(30), || app.dispatcher.total_depth()
            == queued as u32)
        .await,
        "queue depth {} of {queued}",
        app.dispatcher.total_depth()
    );
    let left = Instant::now();
    for task in &waiting {
        task.abort();
    }
    assert!(
        eventually(Duration::from_secs(15), || app.dispatcher.total_depth()
            == 0)
        .await,
        "the queue emptied when its clients left ({} left)",
        app.dispatcher.total_depth()
    );
    let queue_emptied = left.elapsed();
    for task in &streaming {
        task.abort();
    }
    tokio::time::timeout(Duration::from_secs(15), handle.wait_cancelled(streams))
        .await
        .expect("the upstream saw every stream stop");
    let everything_zero = || {
        let report = app.dispatcher.report(0);
        app.active() == 0
            && report.queued_bytes == 0
            && report.tiers.iter().all(|tier| tier.depth == 0)
            && report
                .clients
                .iter()
                .all(|client| client.waiting == 0 && client.inflight == 0)
            && report.slots.values().all(|host| host.slots_in_use == 0)
    };
    assert!(
        eventually(Duration::from_secs(15), everything_zero).await,
        "gauges after everyone left: active {}, {:?}",
        app.active(),
        app.dispatcher.report(0)
    );
    let drained = left.elapsed();
    let report = app.dispatcher.report(0);
    let cancelled: u64 = report.tiers.iter().map(|tier| tier.cancelled).sum();
    let reached = handle.requests_to("/api/generate").len();
    println!(
        "{} clients left ({streams} mid-stream, {queued} mid-queue): queue empty after {:.0} ms, every gauge at 0 after {:.0} ms; {cancelled} tickets cancelled; upstream received {reached} generations and saw {} stop",
        streams + queued,
        queue_emptied.as_secs_f64() * 1e3,
        drained.as_secs_f64() * 1e3,
        handle.cancelled()
    );
    assert_eq!(
        reached, streams,
        "the clients that left while queued never reached Ollama"
    );
    assert_eq!(cancelled, queued as u64);
    assert_eq!(handle.in_flight(), 0);
    stack.shutdown().await;
}

/// A stack with auth off on one fake (llama3 and all-minilm), 1 MiB bodies.
async fn bad_input_stack() -> (FakeOllama, Stack) {
    let fake = FakeOllama::builder()
        .model("llama3")
        .embedding_model("all-minilm")
        .slots(2)
        .spawn()
        .await;
    // The other clients beside the bad input flood the metadata path: no per-client limit.
    let yaml = one_host(
        &fake.url(),
        2,
        "auth:\n  metadata_rate_limit:\n    per_second: 0\n",
    )
    .replace("proxy:\n", "proxy:\n  max_request_body_mb: 1\n");
    let stack = Stack::start(&yaml).await;
    (fake, stack)
}

#[tokio::test]
async fn oversized_bodies_get_413_declared_or_chunked() {
    let (fake, stack) = bad_input_stack().await;
    let addr = stack.proxy_addr();
    let prompt = "x".repeat(2 * 1024 * 1024);
    let body = format!(r#"{{"model":"llama3","prompt":"{prompt}"}}"#);
    let declared = format!(
        "POST /api/generate HTTP/1.1\r\nHost: oqp\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let declared_status = support::raw_exchange(addr, declared.as_bytes()).await;
    assert_eq!(declared_status, Some(413));
    let mut chunked = b"POST /api/generate HTTP/1.1\r\nHost: oqp\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for chunk in body.as_bytes().chunks(64 * 1024) {
        chunked.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        chunked.extend_from_slice(chunk);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let chunked_status = support::raw_exchange(addr, &chunked).await;
    assert!(
        matches!(chunked_status, Some(413) | None),
        "chunked: {chunked_status:?}"
    );
    assert!(fake.handle().requests_to("/api/generate").is_empty());
    let http = HttpClient::new();
    let reply = http
        .post_json(
            &format!("{}/api/generate", stack.url()),
            &[],
            &json!({"model": "llama3", "prompt": "hi", "stream": false}),
        )
        .await;
    assert_eq!(reply.status, 200);
    println!(
        "oversized bodies (2 MiB, limit 1 MiB): declared → {declared_status:?}, chunked → {chunked_status:?}; none reached the upstream"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn malformed_json_and_invalid_utf8_are_never_a_server_error() {
    let (fake, stack) = bad_input_stack().await;
    let http = HttpClient::new();
    let paths = [
        "/api/generate",
        "/api/chat",
        "/api/embed",
        "/api/embeddings",
        "/api/show",
        "/v1/chat/completions",
        "/v1/embeddings",
    ];
    let bodies: [&[u8]; 8] = [
        b"",
        b"{\"model\":",
        b"not json at all",
        b"[1,2,3]",
        b"{\"model\": 5, \"prompt\": []}",
        b"{\"model\":\"\xff\xfe llama\",\"prompt\":\"hi\",\"stream\":false}",
        b"{\"model\":\"llama3\",\"prompt\":\"\xc3\x28\",\"stream\":false}",
        b"{\"model\":\"all-minilm\",\"input\":[\"ok\", \"\xed\xa0\x80\"]}",
    ];
    let mut seen: HashMap<u16, usize> = HashMap::new();
    for path in paths {
        for body in bodies {
            let reply = http
                .send(
                    http::Method::POST,
                    &format!("{}{path}", stack.url()),
                    &[("content-type", "application/json")],
                    body.to_vec(),
                )
                .await;
            let status = reply.status.as_u16();
            *seen.entry(status).or_default() += 1;
            assert!(
                status < 500,
                "{path} with {:?} → {status} {}",
                String::from_utf8_lossy(body),
                reply.text()
            );
            if status >= 400 {
                assert!(
                    !reply.body.is_empty(),
                    "{path}: a refusal says why ({status})"
                );
            }
        }
    }
    // And the proxy is as healthy as before.
    let reply = http
        .post_json(
            &format!("{}/api/generate", stack.url()),
            &[],
            &json!({"model": "llama3", "prompt": "hi", "stream": false}),
        )
        .await;
    assert_eq!(reply.status, 200);
    let mut seen: Vec<_> = seen.into_iter().collect();
    seen.sort_unstable();
    println!(
        "malformed bodies: {} requests, statuses {seen:?}, upstream received {}",
        paths.len() * bodies.len(),
        fake.handle().requests().len()
    );
    stack.shutdown().await;
}

/// A request head may take 8 KiB (the connection's read buffer); a larger
/// one is refused with 431. Bodies are not bound by it.
#[tokio::test]
async fn request_heads_up_to_8_kib_are_served_and_larger_ones_get_431() {
    let (fake, stack) = bad_input_stack().await;
    let addr = stack.proxy_addr();
    let head = |filler: usize| {
        format!(
            "GET /api/tags HTTP/1.1\r\nHost: oqp\r\nX-Filler: {}\r\n\r\n",
            "f".repeat(filler)
        )
    };
    let fitting = head(7 * 1024);
    assert!(fitting.len() < 8 * 1024);
    assert_eq!(
        support::raw_exchange(addr, fitting.as_bytes()).await,
        Some(200)
    );
    let over = head(9 * 1024);
    assert_eq!(
        support::raw_exchange(addr, over.as_bytes()).await,
        Some(431)
    );

    let prompt = "p".repeat(512 * 1024);
    // With its own keep_alive, so that the body is forwarded as it is.
    let body =
        format!(r#"{{"model":"llama3","stream":false,"keep_alive":-1,"prompt":"{prompt}"}}"#);
    let reply = HttpClient::new()
        .send(
            http::Method::POST,
            &format!("{}/api/generate", stack.url()),
            &[("content-type", "application/json")],
            body.clone(),
        )
        .await;
    assert_eq!(reply.status, 200);
    let sent = fake.handle().requests_to("/api/generate");
    let received = &sent.last().unwrap().body;
    let differs = received
        .iter()
        .zip(body.as_bytes())
        .position(|(a, b)| a != b);
    assert!(
        received.len() == body.len() && differs.is_none(),
        "received {} bytes, sent {}, first difference at {differs:?}: {:?}",
        received.len(),
        body.len(),
        String::from_utf8_lossy(&received[..received.len().min(80)])
    );
    stack.shutdown().await;
}

/// A request that waits in the queue holds copies of what hyper parsed (see
/// `Outbound::detached`); what reaches the upstream is still byte for byte
/// what the client sent: path and query, every header, the body.
#[tokio::test]
async fn a_request_that_waited_reaches_the_upstream_unchanged() {
    let fake = FakeOllama::builder().model("llama3").slots(1).spawn().await;
    let stack = Stack::start(&one_host(&fake.url(), 1, "")).await;
    let http = HttpClient::new();
    let url = format!("{}/api/generate", stack.url());
    let handle = fake.handle();
    handle.hold();
    let first = {
        let (http, url) = (http.clone(), url.clone());
        tokio::spawn(async move {
            let first = json!({"model": "llama3", "prompt": "hold", "stream": false});
            http.post_json(&url, &[], &first).await
        })
    };
    handle.wait_in_flight(1).await;
    // Odd spacing, an escape and key order that a re-serialisation would lose.
    let body = "{ \"stream\":false,\n \"prompt\": \"caf\\u00e9 1.50\", \"keep_alive\": 3600.0, \"model\":\"llama3\" }";
    let waiting = {
        let http = http.clone();
        let url = format!("{url}?trace=1&x=%20y");
        tokio::spawn(async move {
            http.send(
                http::Method::POST,
                &url,
                &[
                    ("content-type", "application/json"),
                    ("x-custom", "kept as sent"),
                ],
                body,
            )
            .await
        })
    };
    let dispatcher = stack.control.dataplane().unwrap().app().dispatcher.clone();
    assert!(eventually(Duration::from_secs(30), || dispatcher.total_depth() == 1).await);
    handle.release_all();
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(waiting.await.unwrap().status, 200);
    let sent = handle.requests_to("/api/generate");
    let waited = sent.last().unwrap();
    assert_eq!(waited.body, body.as_bytes());
    assert_eq!(waited.query.as_deref(), Some("trace=1&x=%20y"));
    assert_eq!(waited.headers["x-custom"], "kept as sent");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_flood_is_refused_and_other_clients_are_served() {
    let _exclusive = crate::support::exclusive().await;
    let (_fake, stack) = bad_input_stack().await;
    let addr = stack.proxy_addr();
    let mut load = Load::start(addr, 2, None, |_, _| Req::get("/api/tags", None));
    let many: String = (0..500)
        .map(|i| format!("X-Flood-{i}: {}\r\n", "a".repeat(40)))
        .collect();
    let many = format!("GET /api/tags HTTP/1.1\r\nHost: oqp\r\n{many}\r\n");
    let huge = format!(
        "GET /api/tags HTTP/1.1\r\nHost: oqp\r\nX-Huge: {}\r\n\r\n",
        "b".repeat(1024 * 1024)
    );
    let mut outcomes: HashMap<String, usize> = HashMap::new();
    let floods: Vec<_> = (0..40)
        .map(|i| {
            let request = if i % 2 == 0 {
                many.clone()
            } else {
                huge.clone()
            };
            tokio::spawn(async move { support::raw_exchange(addr, request.as_bytes()).await })
        })
        .collect();
    for flood in floods {
        let status = flood.await.unwrap();
        assert!(
            matches!(status, Some(431) | None),
            "a header flood got {status:?}"
        );
        *outcomes
            .entry(status.map_or("closed".to_owned(), |s| s.to_string()))
            .or_default() += 1;
    }
    load.wait_for_more(50).await;
    let tally = load.stop().await;
    println!(
        "header flood: 40 connections (500 headers, or one 1 MiB header) → {outcomes:?}; meanwhile {} other requests served, {} failed",
        tally.ok,
        tally.failures.len()
    );
    tally.assert_no_failures("clients beside the flood");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_is_cut_off_while_others_are_served() {
    let _exclusive = crate::support::exclusive().await;
    let (_fake, stack) = bad_input_stack().await;
    let addr = stack.proxy_addr();
    let slow = TcpStream::connect(addr).await.unwrap();
    let connected = Instant::now();
    let (mut reader, mut writer) = slow.into_split();
    // One byte a second: the client's own pace, not a synchronisation.
    let trickle = tokio::spawn(async move {
        for byte in b"GET /api/tags HTTP/1.1\r\nHost: oqp\r\nX-Slow: yes\r\n".iter() {
            if writer.write_all(&[*byte]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    let load = Load::start(addr, 2, None, |_, _| Req::get("/api/tags", None));
    let mut buffer = [0u8; 1024];
    let mut answered = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            match reader.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answered.extend_from_slice(&buffer[..n]),
            }
        }
    })
    .await;
    let after = connected.elapsed();
    trickle.abort();
    let served = load.completed();
    let tally = load.stop().await;
    println!(
        "slow client: closed after {:.1} s ({} bytes of answer); {served} other requests served meanwhile, {} failed",
        after.as_secs_f64(),
        answered.len(),
        tally.failures.len()
    );
    assert!(closed.is_ok(), "the slow connection was never closed");
    assert!(
        after >= Duration::from_secs(9) && after <= Duration::from_secs(12),
        "closed after {after:?}, not at the 10 s header-read timeout"
    );
    assert!(
        !String::from_utf8_lossy(&answered).starts_with("HTTP/1.1 200"),
        "the slow request was not served"
    );
    assert!(served > 100, "others were served meanwhile ({served})");
    tally.assert_no_failures("clients beside the slow one");
    stack.shutdown().await;
}

#[tokio::test]
async fn a_ten_thousand_input_embed_batch_is_answered() {
    let (fake, stack) = bad_input_stack().await;
    let inputs: Vec<String> = (0..10_000)
        .map(|i| format!("document number {i}"))
        .collect();
    let started = Instant::now();
    let reply = HttpClient::new()
        .post_json(
            &format!("{}/api/embed", stack.url()),
            &[],
            &json!({"model": "all-minilm", "input": inputs}),
        )
        .await;
    let took = started.elapsed();
    assert_eq!(reply.status, 200, "{}", reply.text());
    let embeddings = reply.json()["embeddings"].as_array().unwrap().len();
    assert_eq!(embeddings, 10_000);
    println!(
        "embed batch: 10 000 inputs ({} KiB request, {} KiB answer) answered in {:.0} ms",
        json!({"model": "all-minilm", "input": inputs})
            .to_string()
            .len()
            / 1024,
        reply.body.len() / 1024,
        took.as_secs_f64() * 1e3
    );
    assert_eq!(fake.handle().requests_to("/api/embed").len(), 1);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_reports_rss_at_start_and_end() {
    let _exclusive = crate::support::exclusive().await;
    use oqp_tests::bench::procs::{self, Binaries, OqpCommand};
    use oqp_tests::bench::scenarios::{self, OqpConfig, USER_KEY};
    let duration = scale(Duration::from_secs(3), Duration::from_secs(600));
    let fake = FakeOllama::builder()
        .model("llama3")
        .embedding_model("all-minilm")
        .slots(4)
        .latency(Duration::from_millis(1))
        .token_interval(Duration::from_millis(2))
        .tokens(20)
        .record_limit(64)
        .spawn()
        .await;
    // oqp in its own process, so that its RSS is its own.
    let bench = env!("CARGO_BIN_EXE_oqp-bench");
    let binaries = Binaries {
        fake: env!("CARGO_BIN_EXE_fake-ollama").into(),
        bench: bench.into(),
        oqp: OqpCommand::Bench(bench.into()),
    };
    let oqp = procs::spawn_oqp(&binaries, &OqpConfig::new(&fake.url(), 4).render())
        .await
        .unwrap();
    let rss_start = oqp.rss_kib().unwrap();
    let mut load = Load::start(oqp.addr(), 8, None, |client, n| {
        match (client as u64 + n) % 4 {
            0 => scenarios::tags(USER_KEY),
            1 => scenarios::generate(USER_KEY),
            2 => scenarios::embed(USER_KEY, &format!("text {n}")),
            _ => Req::post(
                "/api/chat",
                Some(USER_KEY),
                r#"{"model":"llama3","messages":[{"role":"user","content":"hi"}]}"#,
            ),
        }
    });
    // The soak's length is the point of the test, not a synchronisation.
    tokio::time::sleep(duration).await;
    load.wait_for_more(1).await;
    let tally = load.stop().await;
    let rss_end = oqp.rss_kib().unwrap();
    println!(
        "soak: {:.0} s, {} requests, {} failed; oqp RSS {:.1} MiB at start, {:.1} MiB at the end",
        duration.as_secs_f64(),
        tally.ok + tally.failures.len() as u64,
        tally.failures.len(),
        rss_start as f64 / 1024.0,
        rss_end as f64 / 1024.0
    );
    tally.assert_no_failures("soak");
    oqp.stop().await;
}
