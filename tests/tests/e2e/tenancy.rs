//! End to end: identities, scopes, ceilings, the failed-auth throttle and
//! injection ports, through the real planes and the fake Ollama.

use std::time::Duration;

use oqp_controlplane::config::Env;
use oqp_tests::client::{HttpClient, eventually};
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::Stack;
use serde_json::json;

fn config(url: &str, extra: &str) -> String {
    format!(
        r#"proxy:
  max_concurrent: 2
ollama:
  hosts:
    - url: "{url}"
      name: primary
      max_concurrent: 1
auth:
  enabled: true
  rate_limit:
    max_failures: 3
    window_seconds: 60
  keys:
    - key: "sk-read-0123456789"
      client_id: widget
      scope: read
    - key: "sk-chat-0123456789"
      client_id: chat
      max_priority: high
    - key: "sk-normal-0123456789"
      client_id: editor
      max_priority: normal
    - key: "sk-batch-0123456789"
      client_id: batch
      max_priority: low
      max_concurrent: 1
    - key: "sk-admin-0123456789"
      client_id: admin
      scope: management
      max_priority: high
{extra}"#
    )
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

const GENERATE: &str = r#"{"model":"llama3","prompt":"hi","stream":false}"#;

#[tokio::test]
async fn the_scope_matrix_holds() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), "")).await;
    let http = HttpClient::new();
    let base = stack.url();
    let cases = [
        // (key, method, path, body, expected status, expected error)
        (
            "sk-read-0123456789",
            "GET",
            "/api/tags",
            "",
            403,
            Some("inference permission required"),
        ),
        (
            "sk-read-0123456789",
            "POST",
            "/api/generate",
            GENERATE,
            403,
            Some("inference permission required"),
        ),
        (
            "sk-read-0123456789",
            "POST",
            "/queue/pause?tier=low",
            "",
            403,
            Some("management permission required"),
        ),
        ("sk-chat-0123456789", "GET", "/api/tags", "", 200, None),
        (
            "sk-chat-0123456789",
            "POST",
            "/api/generate",
            GENERATE,
            200,
            None,
        ),
        (
            "sk-chat-0123456789",
            "POST",
            "/queue/pause?tier=low",
            "",
            403,
            Some("management permission required"),
        ),
        (
            "sk-admin-0123456789",
            "POST",
            "/api/generate",
            GENERATE,
            200,
            None,
        ),
        (
            "sk-admin-0123456789",
            "POST",
            "/queue/pause?tier=low",
            "",
            200,
            None,
        ),
        (
            "sk-admin-0123456789",
            "POST",
            "/queue/resume?tier=low",
            "",
            200,
            None,
        ),
        (
            "sk-admin-0123456789",
            "POST",
            "/queue/pause?tier=bogus",
            "",
            400,
            Some("invalid tier: 'bogus' (must be high, normal, or low)"),
        ),
    ];
    for (key, method, path, body, status, error) in cases {
        let reply = http
            .send(
                method.parse().unwrap(),
                &format!("{base}{path}"),
                &[
                    ("authorization", &bearer(key)),
                    ("content-type", "application/json"),
                ],
                body.to_owned(),
            )
            .await;
        assert_eq!(
            reply.status,
            status,
            "{key} {method} {path}: {}",
            reply.text()
        );
        if let Some(error) = error {
            assert_eq!(reply.json()["error"], error, "{key} {method} {path}");
            // The refusal names only the required scope, never the caller.
            assert!(!reply.text().contains("widget") && !reply.text().contains("chat\""));
        }
    }
    let paused = http
        .send(
            "POST".parse().unwrap(),
            &format!("{base}/queue/pause?tier=low"),
            &[("authorization", &bearer("sk-admin-0123456789"))],
            "",
        )
        .await;
    assert_eq!(paused.json(), json!({"status": "paused", "tier": "low"}));
    stack.shutdown().await;
}

#[tokio::test]
async fn missing_and_unknown_keys_get_the_two_401s() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), "")).await;
    let http = HttpClient::new();
    let url = format!("{}/api/generate", stack.url());
    // The scheme is case-insensitive.
    let reply = http
        .send(
            "POST".parse().unwrap(),
            &url,
            &[("authorization", "bearer sk-chat-0123456789")],
            GENERATE,
        )
        .await;
    assert_eq!(reply.status, 200);
    for (headers, error) in [
        (vec![], "missing or invalid authorization header"),
        (
            vec![("authorization", "Basic abc")],
            "missing or invalid authorization header",
        ),
        (
            vec![("authorization", "Bearer not-a-key")],
            "invalid api key",
        ),
    ] {
        let mut all = headers.clone();
        all.push(("x-request-id", "rid"));
        let reply = http
            .send("POST".parse().unwrap(), &url, &all, GENERATE)
            .await;
        assert_eq!(reply.status, 401);
        assert_eq!(reply.header("www-authenticate").as_deref(), Some("Bearer"));
        assert_eq!(reply.json(), json!({"error": error, "request_id": "rid"}));
    }
    assert!(
        fake.handle().requests_to("/api/generate").len() == 1,
        "refused requests never reach Ollama"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn repeated_failures_are_throttled_per_address() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), "")).await;
    let http = HttpClient::new();
    let url = format!("{}/api/tags", stack.url());
    for _ in 0..3 {
        let reply = http.get(&url, &[("authorization", "Bearer wrong")]).await;
        assert_eq!(reply.status, 401);
    }
    let throttled = http.get(&url, &[("authorization", "Bearer wrong")]).await;
    assert_eq!(throttled.status, 429);
    assert_eq!(
        throttled.json()["error"],
        "too many authentication failures"
    );
    let retry_after: u64 = throttled.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry_after));
    // Even a valid key is refused from this address until the window passes.
    let valid = http
        .get(&url, &[("authorization", &bearer("sk-chat-0123456789"))])
        .await;
    assert_eq!(valid.status, 429);
    // The liveness probe is never throttled.
    assert_eq!(
        http.get(&format!("{}/health", stack.url()), &[])
            .await
            .status,
        200
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn a_success_does_not_clear_failures_and_retry_after_is_enough() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), "")).await;
    let http = HttpClient::new();
    let url = format!("{}/api/tags", stack.url());
    let good = bearer("sk-chat-0123456789");
    let first_failure = std::time::Instant::now();
    for _ in 0..2 {
        let reply = http.get(&url, &[("authorization", "Bearer wrong")]).await;
        assert_eq!(reply.status, 401);
    }
    // Holding one good key does not buy more guesses.
    assert_eq!(
        http.get(&url, &[("authorization", &good)]).await.status,
        200
    );
    let third = http.get(&url, &[("authorization", "Bearer wrong")]).await;
    assert_eq!(third.status, 401);
    let throttled = http.get(&url, &[("authorization", "Bearer wrong")]).await;
    assert_eq!(throttled.status, 429, "{}", throttled.text());
    // Waiting Retry-After seconds is enough: the first failure leaves the
    // 60 s window by then (rounded up, not down).
    let retry_after: f64 = throttled.header("retry-after").unwrap().parse().unwrap();
    let elapsed = first_failure.elapsed().as_secs_f64();
    assert!(retry_after <= 60.0, "{retry_after}");
    assert!(
        retry_after + elapsed >= 60.0,
        "Retry-After {retry_after} s, {elapsed} s after the first failure"
    );
    stack.shutdown().await;
}

/// `n` failed attempts claiming to come from `forwarded_for`; the status of one more.
async fn fail_from(http: &HttpClient, url: &str, forwarded_for: &str, n: usize) -> u16 {
    let headers = [
        ("authorization", "Bearer wrong"),
        ("x-forwarded-for", forwarded_for),
    ];
    for _ in 0..n {
        assert_eq!(http.get(url, &headers).await.status, 401);
    }
    http.get(url, &headers).await.status.as_u16()
}

#[tokio::test]
async fn behind_a_trusted_proxy_each_forwarded_address_has_its_own_bucket() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let extra = "  trusted_proxies: [\"127.0.0.1/32\", \"::1\"]\n";
    let stack = Stack::start(&config(&fake.url(), extra)).await;
    let http = HttpClient::new();
    let url = format!("{}/api/tags", stack.url());
    assert_eq!(fail_from(&http, &url, "198.51.100.1", 3).await, 429);
    // Another client behind the same proxy is not refused for the first one's failures,
    // whatever it puts in front of the chain.
    assert_eq!(fail_from(&http, &url, "198.51.100.2", 0).await, 401);
    assert_eq!(
        fail_from(&http, &url, "198.51.100.1, 198.51.100.3", 0).await,
        401
    );
    stack.shutdown().await;

    // Without trusted_proxies the header is ignored: everyone shares the peer's bucket.
    let stack = Stack::start(&config(&fake.url(), "")).await;
    let url = format!("{}/api/tags", stack.url());
    assert_eq!(fail_from(&http, &url, "198.51.100.1", 3).await, 429);
    assert_eq!(fail_from(&http, &url, "198.51.100.2", 0).await, 429);
    stack.shutdown().await;
}

#[tokio::test]
async fn identity_comes_from_the_key_not_from_headers() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), "")).await;
    let reply = HttpClient::new()
        .send(
            "POST".parse().unwrap(),
            &format!("{}/api/generate", stack.url()),
            &[
                ("authorization", &bearer("sk-batch-0123456789")),
                ("x-client-id", "chat"),
                ("x-queue-priority", "high"),
            ],
            GENERATE,
        )
        .await;
    assert_eq!(reply.status, 200);
    let seen = &fake.handle().requests_to("/api/generate")[0];
    assert_eq!(seen.header("x-client-id").as_deref(), Some("batch"));
    assert!(
        seen.header("authorization").is_none(),
        "the client's key never reaches Ollama"
    );
    assert!(seen.header("x-queue-priority").is_none());
    stack.shutdown().await;
}

#[tokio::test]
async fn a_low_key_asking_for_high_is_served_after_normal_work() {
    let fake = FakeOllama::builder().model("llama3").slots(1).spawn().await;
    let stack = Stack::start(&config(&fake.url(), "")).await;
    let handle = fake.handle();
    handle.hold();
    let http = HttpClient::new();
    let url = format!("{}/api/generate", stack.url());
    let send = |key: &'static str, priority: &'static str| {
        let http = http.clone();
        let url = url.clone();
        tokio::spawn(async move {
            http.send(
                "POST".parse().unwrap(),
                &url,
                &[
                    ("authorization", &bearer(key)),
                    ("x-queue-priority", priority),
                ],
                GENERATE,
            )
            .await
        })
    };
    // Occupy the one slot, then queue the batch key's "high" request, then a
    // normal one.
    let first = send("sk-chat-0123456789", "high");
    handle.wait_in_flight(1).await;
    let dispatcher = stack.control.dataplane().unwrap().app().dispatcher.clone();
    let batch = send("sk-batch-0123456789", "high");
    assert!(eventually(Duration::from_secs(30), || dispatcher.total_depth() == 1).await);
    let normal = send("sk-normal-0123456789", "normal");
    assert!(eventually(Duration::from_secs(30), || dispatcher.total_depth() == 2).await);
    handle.release_all();
    for task in [first, batch, normal] {
        assert_eq!(task.await.unwrap().status, 200);
    }
    let order: Vec<String> = handle
        .requests_to("/api/generate")
        .iter()
        .filter_map(|r| r.header("x-client-id"))
        .collect();
    assert_eq!(
        order,
        ["chat", "editor", "batch"],
        "the ceiling capped batch to low"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn injection_ports_carry_the_named_identity() {
    let fake = FakeOllama::builder().model("llama3").slots(4).spawn().await;
    let port_batch = free_port().await;
    let port_widget = free_port().await;
    let extra = format!(
        "client_injection:\n  listeners:\n    - listen_port: {port_batch}\n      inject_as: batch\n    - listen_port: {port_widget}\n      inject_as: widget\n"
    );
    let stack = Stack::start(&config(&fake.url(), &extra)).await;
    let http = HttpClient::new();
    let injected = format!("http://127.0.0.1:{port_batch}");
    assert!(
        eventually(Duration::from_secs(30), || std::net::TcpStream::connect((
            "127.0.0.1",
            port_batch
        ))
        .is_ok())
        .await,
        "the injection port opened"
    );
    // No header needed; a sent Authorization is stripped, not relayed.
    let reply = http
        .send(
            "POST".parse().unwrap(),
            &format!("{injected}/api/generate"),
            &[
                ("authorization", "Bearer something-else"),
                ("x-client-id", "chat"),
            ],
            GENERATE,
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let seen = fake.handle().requests_to("/api/generate");
    assert_eq!(seen[0].header("x-client-id").as_deref(), Some("batch"));
    assert!(seen[0].header("authorization").is_none());
    // The cap of the named key applies: batch has max_concurrent 1.
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let http = http.clone();
        let url = format!("{injected}/api/generate");
        tasks.push(tokio::spawn(async move {
            http.send("POST".parse().unwrap(), &url, &[], GENERATE)
                .await
                .status
        }));
    }
    for task in tasks {
        assert_eq!(task.await.unwrap(), 200);
    }
    assert_eq!(fake.handle().peak_concurrency_of("batch"), 1);
    // The scope of the named key applies too: a read key cannot proxy.
    assert!(
        eventually(Duration::from_secs(30), || std::net::TcpStream::connect((
            "127.0.0.1",
            port_widget
        ))
        .is_ok())
        .await
    );
    let refused = http
        .send(
            "POST".parse().unwrap(),
            &format!("http://127.0.0.1:{port_widget}/api/generate"),
            &[],
            GENERATE,
        )
        .await;
    assert_eq!(refused.status, 403);
    assert_eq!(refused.json()["error"], "inference permission required");
    // Injection ports are loopback by default: nothing listens elsewhere.
    stack.shutdown().await;
}

#[tokio::test]
async fn an_injection_port_bound_to_an_expired_key_refuses() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let port = free_port().await;
    let extra = format!(
        "    - key: \"sk-gone-0123456789\"\n      client_id: gone\n      expires: 2020-01-01T00:00:00Z\n\
         client_injection:\n  listeners:\n    - listen_port: {port}\n      inject_as: gone\n"
    );
    let stack = Stack::start(&config(&fake.url(), &extra)).await;
    assert!(
        eventually(Duration::from_secs(30), || std::net::TcpStream::connect((
            "127.0.0.1",
            port
        ))
        .is_ok())
        .await,
        "the injection port opened"
    );
    let reply = HttpClient::new()
        .send(
            "POST".parse().unwrap(),
            &format!("http://127.0.0.1:{port}/api/generate"),
            &[("content-type", "application/json")],
            GENERATE,
        )
        .await;
    assert_eq!(reply.status, 401, "{}", reply.text());
    assert_eq!(reply.json()["error"], "invalid api key");
    assert!(fake.handle().requests_to("/api/generate").is_empty());
    stack.shutdown().await;
}

#[tokio::test]
async fn a_public_injection_bind_needs_explicit_consent() {
    let fake = FakeOllama::builder().spawn().await;
    let port = free_port().await;
    let extra = format!(
        "client_injection:\n  listeners:\n    - listen_port: {port}\n      inject_as: batch\n      bind: 0.0.0.0\n"
    );
    let error = Stack::try_start(&config(&fake.url(), &extra), Env::empty())
        .await
        .expect_err("non-loopback injection without allow_public_injection");
    let message = error.to_string();
    assert!(message.contains("allow_public_injection"), "{message}");
    assert!(
        !message.contains("sk-batch"),
        "errors never carry key values"
    );
}

async fn free_port() -> u16 {
    let listener = oqp_tests::harness::loopback().await;
    listener.local_addr().unwrap().port()
}

#[tokio::test]
async fn metadata_reads_are_limited_per_client_with_retry_after() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let yaml = config(&fake.url(), "").replace(
        "  rate_limit:\n",
        "  metadata_rate_limit: {per_second: 1, burst: 3}\n  rate_limit:\n",
    );
    let stack = Stack::start(&yaml).await;
    let http = HttpClient::new();
    let show = |key: &'static str| {
        let (http, url) = (&http, format!("{}/api/show", stack.url()));
        async move {
            let auth = bearer(key);
            http.post_json(
                &url,
                &[("authorization", &auth)],
                &json!({"model": "llama3"}),
            )
            .await
        }
    };
    // One client reads until refused: its burst of 3, plus at most what refilled meanwhile.
    let started = std::time::Instant::now();
    let mut served = 0;
    let refused = loop {
        let reply = show("sk-chat-0123456789").await;
        if reply.status != 200 {
            break reply;
        }
        served += 1;
        assert!(served < 20, "never limited");
    };
    let refilled = started.elapsed().as_secs_f64().ceil() as usize;
    assert!((3..=3 + refilled).contains(&served), "{served}");
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(refused.header("retry-after").as_deref(), Some("1"));
    assert_eq!(refused.json()["error"], "too many metadata requests");
    // The refused read never reached the host; another client has its own bucket.
    let chats = fake
        .handle()
        .requests_to("/api/show")
        .iter()
        .filter(|request| request.header("x-client-id").as_deref() == Some("chat"))
        .count();
    assert_eq!(chats, served);
    let tags = http
        .get(
            &format!("{}/api/tags", stack.url()),
            &[("authorization", &bearer("sk-normal-0123456789"))],
        )
        .await;
    assert_eq!(tags.status, 200, "{}", tags.text());
    assert_eq!(show("sk-normal-0123456789").await.status, 200);
    stack.shutdown().await;
}
