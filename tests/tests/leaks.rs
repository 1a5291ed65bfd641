//! Secrets never leak: every log line both planes write (at trace level),
//! every status, summary, metrics and error body, and every response header
//! are searched for the consumer keys, the upstream cloud key and the node
//! token of a busy run.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::sync::{Arc, Mutex};

use oqp_tests::client::HttpClient;
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::Stack;

/// Every log line, kept in memory.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

const SECRETS: [&str; 5] = [
    "sk-chat-secret-0123456789",
    "sk-read-secret-0123456789",
    "sk-admin-secret-0123456789",
    "cloud-upstream-secret-0123456789",
    "node-token-secret-0123456789",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_appears_in_logs_bodies_or_headers() {
    let logs = Captured::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .with_env_filter("oqp_dataplane=trace,oqp_controlplane=trace,info")
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .init();

    let local = FakeOllama::builder()
        .model("llama3")
        .embedding_model("all-minilm")
        .spawn()
        .await;
    let cloud = FakeOllama::builder()
        .model("gpt-oss:120b")
        .cloud(&[SECRETS[3]])
        .spawn()
        .await;
    let yaml = format!(
        r#"ollama:
  hosts:
    - url: "{local}"
      name: local
    - url: "{cloud}"
      name: cloud
      kind: cloud
      api_keys:
        - key: "{cloud_key}"
routing:
  strategy: model_aware
embedding_cache:
  enabled: true
dashboard:
  enabled: true
auth:
  enabled: true
  rate_limit:
    max_failures: 2
  keys:
    - key: "{chat}"
      client_id: chat
    - key: "{read}"
      client_id: widget
      scope: read
    - key: "{admin}"
      client_id: admin
      scope: management
control_plane:
  node_token: "{token}"
"#,
        local = local.url(),
        cloud = cloud.url(),
        cloud_key = SECRETS[3],
        chat = SECRETS[0],
        read = SECRETS[1],
        admin = SECRETS[2],
        token = SECRETS[4],
    );
    let stack = Stack::start(&yaml).await;
    let remote = stack
        .start_dataplane("remote", Some(SECRETS[4]))
        .await
        .unwrap();
    let refused = stack.start_dataplane("intruder", Some("wrong-token")).await;
    assert!(refused.is_err());
    let http = HttpClient::new();
    let base = stack.url();
    let bearer = |key: &str| format!("Bearer {key}");
    let mut seen = String::new();
    let mut record = |reply: &oqp_tests::client::Reply| {
        seen.push_str(&format!(
            "{} {:?}\n{}\n",
            reply.status,
            reply.headers,
            reply.text()
        ));
    };
    for (key, method, path, body) in [
        (
            SECRETS[0],
            "POST",
            "/api/generate",
            r#"{"model":"llama3","prompt":"hi","stream":false}"#,
        ),
        (
            SECRETS[0],
            "POST",
            "/api/chat",
            r#"{"model":"gpt-oss:120b","messages":[],"stream":false}"#,
        ),
        (
            SECRETS[0],
            "POST",
            "/api/embed",
            r#"{"model":"all-minilm","input":["a","b"]}"#,
        ),
        (
            SECRETS[0],
            "POST",
            "/v1/embeddings",
            r#"{"model":"all-minilm","input":"a"}"#,
        ),
        (SECRETS[0], "GET", "/api/tags", ""),
        (SECRETS[1], "GET", "/queue/status", ""),
        (SECRETS[1], "GET", "/queue/summary", ""),
        (SECRETS[1], "GET", "/metrics", ""),
        (SECRETS[1], "GET", "/dashboard", ""),
        (SECRETS[1], "POST", "/api/generate", "{}"),
        (SECRETS[0], "POST", "/queue/pause?tier=low", ""),
        (SECRETS[2], "POST", "/queue/pause?tier=low", ""),
        (SECRETS[2], "POST", "/queue/resume?tier=low", ""),
    ] {
        let auth = bearer(key);
        let reply = http
            .send(
                method.parse().unwrap(),
                &format!("{base}{path}"),
                &[("authorization", &auth)],
                body.to_owned(),
            )
            .await;
        record(&reply);
    }
    // Near misses: a prefix of a real key, then the throttle.
    for _ in 0..3 {
        let reply = http
            .get(
                &format!("{base}/api/tags"),
                &[("authorization", "Bearer sk-chat-secret-012345678")],
            )
            .await;
        record(&reply);
    }
    let reply = http
        .get(
            &format!("http://{}/queue/status", remote.local_addr()),
            &[("authorization", &bearer(SECRETS[1]))],
        )
        .await;
    record(&reply);
    // Debug output of both planes' state.
    seen.push_str(&format!("{:?}\n{:?}\n", stack.control, remote));
    seen.push_str(&format!("{:?}\n", stack.control.hub().config()));
    remote.shutdown().await;
    stack.shutdown().await;

    let logs = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    assert!(logs.lines().count() > 20, "the run was logged:\n{logs}");
    for secret in SECRETS {
        assert!(
            !logs.contains(secret),
            "a log line carries {secret}:\n{logs}"
        );
        if let Some(at) = seen.find(secret) {
            let start = seen.floor_char_boundary(at.saturating_sub(400));
            panic!(
                "a response or Debug output carries {secret}: …{}",
                &seen[start..at + secret.len()]
            );
        }
    }
    // The throttled prefix was refused with 429 at the end, as expected.
    assert!(seen.contains("429"));
}
