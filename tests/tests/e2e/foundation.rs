//! End to end: the real control plane and data plane, talking gRPC on
//! loopback, in front of the fake Ollama. Transparency, streaming, header
//! hygiene, failures, and the snapshot's life.

use std::time::Duration;

use http::Method;
use oqp_controlplane::config::Env;
use oqp_tests::client::{HttpClient, eventually};
use oqp_tests::fake::{Failure, FakeOllama};
use oqp_tests::harness::{self, Stack, basic_config};
use serde_json::json;

async fn stack_with(fake: &FakeOllama) -> Stack {
    Stack::start(&basic_config(&fake.url())).await
}

#[tokio::test]
async fn metadata_endpoints_pass_through_byte_for_byte() {
    let fake = FakeOllama::builder()
        .model("llama3")
        .loaded("llama3")
        .spawn()
        .await;
    // Unknown routes and methods pass through only with model management on:
    // otherwise they are outside the allowlist (see `paths`).
    let managed =
        basic_config(&fake.url()).replace("proxy:\n", "proxy:\n  allow_model_management: true\n");
    for (stack, management) in [
        (stack_with(&fake).await, false),
        (Stack::start(&managed).await, true),
    ] {
        let http = HttpClient::new();
        for (method, path, body) in [
            (Method::GET, "/", ""),
            (Method::HEAD, "/", ""),
            (Method::GET, "/api/version", ""),
            (Method::GET, "/api/tags", ""),
            (Method::GET, "/api/ps", ""),
            (Method::POST, "/api/show", r#"{"model":"llama3"}"#),
            (Method::POST, "/api/show", r#"{"model":"nope"}"#),
            (Method::GET, "/v1/models", ""),
            (Method::GET, "/no/such/path", ""),
            (Method::DELETE, "/api/generate", ""),
        ] {
            let unlisted = path == "/no/such/path" || method == Method::DELETE;
            if unlisted && !management {
                let refused = http
                    .send(
                        method.clone(),
                        &format!("{}{path}", stack.url()),
                        &[],
                        body.to_owned(),
                    )
                    .await;
                assert_eq!(refused.status, 403, "{method} {path}");
                continue;
            }
            let direct = http
                .send(
                    method.clone(),
                    &format!("{}{path}", fake.url()),
                    &[],
                    body.to_owned(),
                )
                .await;
            let proxied = http
                .send(
                    method.clone(),
                    &format!("{}{path}", stack.url()),
                    &[],
                    body.to_owned(),
                )
                .await;
            assert_eq!(proxied.status, direct.status, "{method} {path}");
            assert_eq!(proxied.body, direct.body, "{method} {path}");
            assert_eq!(
                proxied.header("content-type"),
                direct.header("content-type"),
                "{method} {path}"
            );
            assert_eq!(
                proxied.header("x-failover-host").as_deref(),
                Some("primary")
            );
        }
        let root = http.get(&format!("{}/", stack.url()), &[]).await;
        assert_eq!(root.text(), "Ollama is running");
        stack.shutdown().await;
    }
}

#[tokio::test]
async fn inference_bodies_and_query_strings_arrive_unchanged() {
    let fake = FakeOllama::builder()
        .model("llama3")
        .embedding_model("all-minilm")
        .spawn()
        .await;
    let stack = stack_with(&fake).await;
    let http = HttpClient::new();
    // A body with its own keep_alive: nothing is added, every byte arrives.
    let body = r#"{"model":"all-minilm","input":["héllo","\u00e9"],"options":{"temperature":0.10},"keep_alive":"1m"}"#;
    let reply = http
        .send(
            Method::POST,
            &format!("{}/api/embed?trace=1&x=%20y", stack.url()),
            &[("content-type", "application/json")],
            body,
        )
        .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json()["embeddings"].as_array().map(Vec::len), Some(2));
    let seen = fake.handle().requests_to("/api/embed");
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].query.as_deref(), Some("trace=1&x=%20y"));
    assert_eq!(seen[0].body, body.as_bytes());

    let generated = http
        .post_json(
            &format!("{}/api/generate", stack.url()),
            &[],
            &json!({"model": "llama3", "prompt": "hi", "stream": false}),
        )
        .await;
    assert_eq!(generated.status, 200);
    assert_eq!(generated.json()["done"], true);
    assert!(generated.body.ends_with(b"\n") || generated.json().is_object());
    stack.shutdown().await;
}

#[tokio::test]
async fn streams_arrive_line_by_line_not_buffered() {
    let fake = FakeOllama::builder()
        .model("llama3")
        .tokens(5)
        .token_interval(Duration::from_millis(150))
        .spawn()
        .await;
    let stack = stack_with(&fake).await;
    let (status, headers, lines) = HttpClient::new()
        .post_lines(
            &format!("{}/api/generate", stack.url()),
            &[],
            &json!({"model": "llama3", "prompt": "hi"}),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "application/x-ndjson");
    assert!(lines.len() >= 6, "{} lines", lines.len());
    assert!(
        lines.iter().all(|l| !l.line.trim().is_empty()),
        "no blank lines"
    );
    let last: serde_json::Value = serde_json::from_str(&lines.last().unwrap().line).unwrap();
    assert_eq!(last["done"], true);
    // The upstream spaces its lines 150 ms apart: a buffering proxy would
    // deliver them together.
    let spread = lines.last().unwrap().at - lines[0].at;
    assert!(
        spread >= Duration::from_millis(500),
        "lines arrived within {spread:?}"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn headers_are_cleaned_both_ways() {
    let fake = FakeOllama::builder()
        .model("llama3")
        .host_check(true)
        .spawn()
        .await;
    let stack = stack_with(&fake).await;
    let http = HttpClient::new();
    let reply = http
        .send(
            Method::POST,
            &format!("{}/api/generate", stack.url()),
            &[
                ("content-type", "application/json"),
                ("authorization", "Bearer client-secret"),
                ("x-queue-priority", "high"),
                ("x-client-id", "my-app"),
                ("x-request-id", "req-42"),
                ("connection", "keep-alive, x-hop"),
                ("x-hop", "1"),
                ("host", "proxy.example.com"),
            ],
            r#"{"model":"llama3","prompt":"hi","stream":false}"#,
        )
        .await;
    // The fake's host check passed: the upstream got its own Host.
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-request-id").as_deref(), Some("req-42"));
    assert!(
        reply
            .header("connection")
            .is_none_or(|v| v != "keep-alive, x-hop")
    );
    let seen = &fake.handle().requests_to("/api/generate")[0];
    assert!(seen.header("authorization").is_none());
    assert!(seen.header("x-queue-priority").is_none());
    assert!(seen.header("x-hop").is_none());
    assert_eq!(seen.header("x-client-id").as_deref(), Some("my-app"));
    assert_eq!(seen.header("host"), Some(fake.addr().to_string()));

    let generated = http.get(&format!("{}/api/version", stack.url()), &[]).await;
    let id = generated.header("x-request-id").unwrap();
    assert_eq!(id.len(), 16);
    assert!(id.chars().all(|c| c.is_ascii_hexdigit()));
    stack.shutdown().await;
}

#[tokio::test]
async fn upstream_death_mid_stream_ends_with_an_error_line() {
    let fake = FakeOllama::builder()
        .model("llama3")
        .tokens(6)
        .spawn()
        .await;
    let stack = stack_with(&fake).await;
    fake.handle()
        .fail_next(Failure::DieMidStream { after_lines: 2 });
    let (status, _, lines) = HttpClient::new()
        .post_lines(
            &format!("{}/api/chat", stack.url()),
            &[],
            &json!({"model": "llama3", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(lines.len(), 3, "two lines then the error: {lines:?}");
    assert!(lines.iter().all(|l| !l.line.trim().is_empty()));
    let last: serde_json::Value = serde_json::from_str(&lines[2].line).expect("error line is JSON");
    assert!(last["error"].as_str().unwrap().contains("primary"));
    stack.shutdown().await;
}

#[tokio::test]
async fn a_client_that_leaves_stops_the_generation() {
    let fake = FakeOllama::builder()
        .model("llama3")
        .tokens(50)
        .token_interval(Duration::from_millis(50))
        .spawn()
        .await;
    let stack = stack_with(&fake).await;
    let http = HttpClient::new();
    let response = http
        .start(
            Method::POST,
            &format!("{}/api/generate", stack.url()),
            &[("content-type", "application/json")],
            r#"{"model":"llama3","prompt":"a long story"}"#,
        )
        .await;
    let mut body = response.into_body();
    use http_body_util::BodyExt;
    let first = body.frame().await.expect("a first frame").expect("frame");
    assert!(first.data_ref().is_some());
    drop(body);
    let handle = fake.handle();
    assert!(
        eventually(Duration::from_secs(30), || handle.cancelled() == 1
            && handle.in_flight() == 0)
        .await,
        "the upstream generation was not stopped"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn an_unreachable_upstream_gets_503_exhausted() {
    let closed = harness::loopback().await;
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let stack = Stack::start(&basic_config(&url)).await;
    let reply = HttpClient::new()
        .post_json(
            &format!("{}/api/generate", stack.url()),
            &[("x-request-id", "r1")],
            &json!({"model": "llama3", "prompt": "hi"}),
        )
        .await;
    assert_eq!(reply.status, 503);
    assert_eq!(
        reply.header("x-failover-exhausted").as_deref(),
        Some("true")
    );
    assert_eq!(
        reply.json(),
        json!({"error": "all upstream hosts failed: primary (connection refused)", "request_id": "r1"})
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn health_answers_without_touching_the_upstream() {
    let fake = FakeOllama::builder().spawn().await;
    let stack = stack_with(&fake).await;
    let reply = HttpClient::new()
        .get(&format!("{}/health", stack.url()), &[])
        .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json(), json!({"status": "ok"}));
    // Only the control plane's inventory polls reach the fake.
    assert!(
        fake.handle()
            .requests()
            .iter()
            .all(|r| r.path == "/api/tags" || r.path == "/api/ps")
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn oversized_bodies_get_413_and_never_reach_the_upstream() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let yaml = basic_config(&fake.url()).replace("proxy:\n", "proxy:\n  max_request_body_mb: 1\n");
    let stack = Stack::start(&yaml).await;
    let big = format!(
        r#"{{"model":"llama3","prompt":"{}"}}"#,
        "x".repeat(1_100_000)
    );
    let reply = HttpClient::new()
        .send(
            Method::POST,
            &format!("{}/api/generate", stack.url()),
            &[],
            big,
        )
        .await;
    assert_eq!(reply.status, 413);
    assert_eq!(reply.json()["error"], "request body too large");
    assert!(fake.handle().requests_to("/api/generate").is_empty());
    stack.shutdown().await;
}

#[tokio::test]
async fn a_model_blob_larger_than_max_request_body_mb_is_streamed_through() {
    use sha2::Digest;
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let yaml = basic_config(&fake.url()).replace(
        "proxy:\n",
        "proxy:\n  max_request_body_mb: 1\n  allow_model_management: true\n",
    );
    let stack = Stack::start(&yaml).await;
    // A model file, as `ollama create` uploads it: larger than the body limit.
    let blob = vec![7u8; 2_500_000];
    let digest = format!("sha256:{:x}", sha2::Sha256::digest(&blob));
    let http = HttpClient::new();
    let reply = http
        .send(
            Method::POST,
            &format!("{}/api/blobs/{digest}", stack.url()),
            &[],
            blob.clone(),
        )
        .await;
    assert_eq!(reply.status, 201, "{}", reply.text());
    assert_eq!(
        fake.handle()
            .requests_to(&format!("/api/blobs/{digest}"))
            .len(),
        1
    );
    // Any other streamed body keeps the limit.
    let reply = http
        .send(
            Method::POST,
            &format!("{}/api/create", stack.url()),
            &[],
            blob,
        )
        .await;
    assert_eq!(reply.status, 413);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_reloaded_config_applies_live_and_a_bad_one_changes_nothing() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let yaml = basic_config(&fake.url());
    let stack = Stack::start(&yaml).await;
    let http = HttpClient::new();
    let url = format!("{}/api/pull", stack.url());
    let body = json!({"model": "llama3", "stream": false});
    let pull = async || http.post_json(&url, &[], &body).await.status;
    assert_eq!(pull().await, 403);

    let allowed = yaml.replace("proxy:\n", "proxy:\n  allow_model_management: true\n");
    let version = stack.rewrite_and_reload(&allowed).expect("valid reload");
    stack.wait_for_version(version).await;
    assert_eq!(pull().await, 200);

    let before = stack.control.hub().current().version;
    assert!(stack.rewrite_and_reload("proxy: [unclosed").is_err());
    assert!(
        stack
            .rewrite_and_reload("proxy:\n  port: 99999999\nollama:\n  hosts: []\n")
            .is_err()
    );
    assert_eq!(stack.control.hub().current().version, before);
    assert_eq!(pull().await, 200, "still serving the last good config");
    stack.shutdown().await;
}

/// A data plane follows `logging.level`: its hook sees the first snapshot's
/// level, each change on reload, and nothing when a reload leaves the level
/// as it was.
#[tokio::test]
async fn a_data_plane_follows_the_configured_log_level() {
    use oqp_dataplane::LogLevelHook;
    use oqp_dataplane::policy::LogLevel;

    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let yaml = |level: &str, slots: u32| {
        basic_config(&fake.url()).replace("max_concurrent: 2", &format!("max_concurrent: {slots}"))
            + &format!("logging:\n  level: {level}\n")
    };
    let stack = Stack::start(&yaml("warn", 2)).await;
    let (levels, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let hook = LogLevelHook::new(move |level| {
        let _ = levels.send(level);
    });
    let remote = harness::start_dataplane_with(
        &stack.control_url(),
        "remote",
        Some(stack.control.node_token()),
        Some(hook),
    )
    .await
    .expect("data plane starts");
    let mut next = async || {
        tokio::time::timeout(Duration::from_secs(10), seen.recv())
            .await
            .expect("a level within 10 s")
    };
    assert_eq!(next().await, Some(LogLevel::Warn));

    // Same level, another change: applied, and the hook stays quiet.
    let version = stack.rewrite_and_reload(&yaml("warn", 3)).unwrap();
    harness::wait_for_version(&remote, version).await;
    let version = stack.rewrite_and_reload(&yaml("DEBUG", 3)).unwrap();
    harness::wait_for_version(&remote, version).await;
    assert_eq!(next().await, Some(LogLevel::Debug), "nothing in between");

    remote.shutdown().await;
    stack.shutdown().await;
}

#[tokio::test]
async fn a_data_plane_keeps_serving_when_the_control_plane_dies() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = stack_with(&fake).await;
    let remote = stack
        .start_dataplane("remote", None)
        .await
        .expect("second data plane");
    let url = format!("http://{}/api/generate", remote.local_addr());
    let http = HttpClient::new();
    let request = json!({"model": "llama3", "prompt": "hi", "stream": false});
    assert_eq!(http.post_json(&url, &[], &request).await.status, 200);
    stack.shutdown().await;
    assert!(
        eventually(Duration::from_secs(30), || !remote
            .app()
            .control
            .is_connected())
        .await,
        "the data plane noticed the control plane is gone"
    );
    for _ in 0..5 {
        assert_eq!(http.post_json(&url, &[], &request).await.status, 200);
    }
    remote.shutdown().await;
}

#[tokio::test]
async fn a_wrong_node_token_is_refused() {
    let fake = FakeOllama::builder().spawn().await;
    let yaml = format!(
        "{}control_plane:\n  node_token: \"correct-horse\"\n",
        basic_config(&fake.url())
    );
    let stack = Stack::start(&yaml).await;
    let refused = stack.start_dataplane("intruder", Some("wrong")).await;
    let error = refused
        .expect_err("a wrong token must be refused")
        .to_string();
    assert!(error.contains("refused"), "{error}");
    assert!(!error.contains("correct-horse"));
    let accepted = stack.start_dataplane("friend", Some("correct-horse")).await;
    accepted
        .expect("the right token is accepted")
        .shutdown()
        .await;
    stack.shutdown().await;
}

#[tokio::test]
async fn every_example_config_loads() {
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut seen = 0;
    for entry in std::fs::read_dir(&examples).expect("examples/") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yml") && !path.ends_with("docker-compose.yml") {
            let loaded = oqp_controlplane::config::load_file(&path, &Env::empty())
                .unwrap_or_else(|e| panic!("{} does not load:\n{e}", path.display()));
            assert!(!loaded.config.ollama.hosts.is_empty());
            seen += 1;
        }
    }
    assert!(
        seen >= 2,
        "examples/config.example.yml and examples/quickstart.yml"
    );
}

#[tokio::test]
async fn shutdown_lets_in_flight_streams_finish_and_refuses_new_work() {
    let fake = FakeOllama::builder()
        .model("llama3")
        .tokens(6)
        .token_interval(Duration::from_millis(100))
        .spawn()
        .await;
    let stack = Stack::start(&basic_config(&fake.url())).await;
    let remote = stack.start_dataplane("remote", None).await.unwrap();
    let addr = remote.local_addr();
    let http = HttpClient::new();
    let streaming = {
        let http = http.clone();
        tokio::spawn(async move {
            http.post_lines(
                &format!("http://{addr}/api/generate"),
                &[],
                &json!({"model": "llama3", "prompt": "a story"}),
            )
            .await
        })
    };
    fake.handle().wait_in_flight(1).await;
    let shutdown = tokio::spawn(remote.shutdown());
    let (status, _, lines) = streaming.await.unwrap();
    assert_eq!(status, 200);
    let last: serde_json::Value = serde_json::from_str(&lines.last().unwrap().line).unwrap();
    assert_eq!(last["done"], true, "the stream ran to its end");
    shutdown.await.unwrap();
    assert!(
        std::net::TcpStream::connect(addr).is_err(),
        "the listener is closed"
    );
    stack.shutdown().await;
}
