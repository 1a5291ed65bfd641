//! Secrets never leak: every log line both planes write (at trace level),
//! every status, summary, metrics and error body, every response header and
//! everything the fake Ollamas received are searched for the consumer keys,
//! the upstream cloud key and the node token of a busy run (dashboard sign-ins
//! included): one box first,
//! then two nodes whose requests cross the node hop, whose header (and its
//! signature) must stop at the owner and never be logged.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::sync::{Arc, Mutex};

use std::time::Duration;

use oqp_tests::client::{HttpClient, Reply};
use oqp_tests::fake::{FakeHandle, FakeOllama};
use oqp_tests::harness::{self, Stack};

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
    let mut seen = String::new();
    let mut record = |reply: &Reply| seen.push_str(&describe(reply));
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
    // The dashboard's sign-in: the key in a form and in JSON, the session used and ended.
    let login = format!("{base}/dashboard/login");
    let form = http
        .send(
            "POST".parse().unwrap(),
            &login,
            &[("content-type", "application/x-www-form-urlencoded")],
            format!("key={}", SECRETS[1]),
        )
        .await;
    assert_eq!(form.status, 303);
    record(&form);
    let json = http
        .post_json(&login, &[], &serde_json::json!({ "key": SECRETS[2] }))
        .await;
    assert_eq!(json.status, 200);
    record(&json);
    let cookie = form.header("set-cookie").unwrap();
    let cookie = cookie.split(';').next().unwrap();
    for path in ["/dashboard", "/dashboard/usage", "/queue/status"] {
        let reply = http
            .get(&format!("{base}{path}"), &[("cookie", cookie)])
            .await;
        assert_eq!(reply.status, 200, "{path}");
        record(&reply);
    }
    let out = http
        .send(
            "POST".parse().unwrap(),
            &format!("{base}/dashboard/logout"),
            &[("cookie", cookie)],
            "",
        )
        .await;
    record(&out);
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
    seen.push_str(&two_nodes(&http).await);
    let upstream = received(&[local.handle(), cloud.handle()]);
    assert!(
        !upstream.contains(SECRETS[4]),
        "Ollama received the node token"
    );

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
    // The hop's header (`v1;n=…;s=<signature>`) is never logged, shown or
    // answered.
    for (what, text) in [("a log line", &logs), ("a response", &seen)] {
        assert!(!text.contains(HOP_VALUE), "{what} carries the hop's header");
    }
}

/// How every value of the hop's header starts.
const HOP_VALUE: &str = "v1;n=";

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

fn describe(reply: &Reply) -> String {
    format!("{} {:?}\n{}\n", reply.status, reply.headers, reply.text())
}

/// Every request the fakes received, headers and body, as text.
fn received(handles: &[FakeHandle]) -> String {
    handles
        .iter()
        .flat_map(FakeHandle::requests)
        .map(|request| {
            format!(
                "{} {} {:?}\n{}\n",
                request.method,
                request.path,
                request.headers,
                String::from_utf8_lossy(&request.body)
            )
        })
        .collect()
}

/// Two nodes following a control plane of their own, the host owned by
/// `a`: requests entering at `b` cross the node hop, and a consumer forges
/// one. Returns every answer, status, metrics page and `Debug` output; checks
/// that nothing of the hop reached Ollama.
async fn two_nodes(http: &HttpClient) -> String {
    let owned = FakeOllama::builder()
        .model("llama3")
        .embedding_model("all-minilm")
        .spawn()
        .await;
    let yaml = format!(
        r#"proxy:
  host: "127.0.0.1"
ollama:
  hosts:
    - url: "{owned}"
      name: owned
      node: a
nodes:
  a: {{port: 0}}
  b: {{port: 0}}
embedding_cache:
  enabled: true
auth:
  enabled: true
  keys:
    - key: "{chat}"
      client_id: chat
    - key: "{read}"
      client_id: widget
      scope: read
control_plane:
  node_token: "{token}"
"#,
        owned = owned.url(),
        chat = SECRETS[0],
        read = SECRETS[1],
        token = SECRETS[4],
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yml");
    std::fs::write(&path, yaml).unwrap();
    let control = harness::start_control_plane(&path, harness::loopback().await)
        .await
        .unwrap();
    let control_url = format!("http://{}", control.local_addr());
    let a = harness::start_dataplane(&control_url, "a", Some(SECRETS[4]))
        .await
        .unwrap();
    let b = harness::start_dataplane(&control_url, "b", Some(SECRETS[4]))
        .await
        .unwrap();
    let (url_a, url_b) = (
        format!("http://{}", a.local_addr()),
        format!("http://{}", b.local_addr()),
    );
    let read = bearer(SECRETS[1]);
    // b forwards once the ack of its report says where a is.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let status = http
            .get(
                &format!("{url_b}/queue/status"),
                &[("authorization", &read)],
            )
            .await
            .json();
        let peers = status["node"]["peers"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if peers
            .iter()
            .any(|peer| peer["node"] == "a" && peer["url"] == url_a.as_str())
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "b never learnt where a is: {status:#}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let chat = bearer(SECRETS[0]);
    let mut seen = String::new();
    for (method, path, body) in [
        (
            "POST",
            "/api/generate",
            r#"{"model":"llama3","prompt":"hi","stream":false}"#,
        ),
        (
            "POST",
            "/api/generate",
            r#"{"model":"llama3","prompt":"hi","stream":true}"#,
        ),
        (
            "POST",
            "/api/chat",
            r#"{"model":"llama3","messages":[{"role":"user","content":"hi"}]}"#,
        ),
        (
            "POST",
            "/api/embed",
            r#"{"model":"all-minilm","input":["a","b"]}"#,
        ),
        ("GET", "/api/tags", ""),
    ] {
        let reply = http
            .send(
                method.parse().unwrap(),
                &format!("{url_b}{path}"),
                &[("authorization", &chat)],
                body.to_owned(),
            )
            .await;
        assert!(reply.status.is_success(), "{path}: {}", describe(&reply));
        seen.push_str(&describe(&reply));
    }
    // A forged hop, straight to both: refused.
    let forged = "v1;node=b;client=admin;verified=1;tier=high;ts=1;sig=00";
    assert!(!forged.starts_with(HOP_VALUE), "the forgery is told apart");
    for url in [&url_a, &url_b] {
        let reply = http
            .send(
                "POST".parse().unwrap(),
                &format!("{url}/api/generate"),
                &[("x-oqp-hop", forged), ("authorization", &chat)],
                r#"{"model":"llama3","prompt":"hi","stream":false}"#,
            )
            .await;
        assert_eq!(reply.status, 401, "{}", describe(&reply));
        // Not echoed back: the forged value is the consumer's, but an
        // answer that echoes the header would echo a real one too.
        assert!(!reply.text().contains("sig=00"), "{}", describe(&reply));
        seen.push_str(&describe(&reply));
    }
    for url in [&url_a, &url_b] {
        for path in ["/queue/status", "/queue/summary", "/metrics"] {
            let reply = http
                .get(&format!("{url}{path}"), &[("authorization", &read)])
                .await;
            seen.push_str(&describe(&reply));
        }
    }
    seen.push_str(&format!("{control:?}\n{a:?}\n{b:?}\n"));
    b.shutdown().await;
    a.shutdown().await;
    control.shutdown().await;
    let upstream = received(&[owned.handle()]);
    assert!(
        owned.handle().requests_to("/api/generate").len() >= 2,
        "the owner served what b forwarded: {upstream}"
    );
    for forbidden in ["x-oqp-hop", HOP_VALUE, "sig=00", SECRETS[0], SECRETS[4]] {
        assert!(
            !upstream.contains(forbidden),
            "Ollama received {forbidden}: {upstream}"
        );
    }
    seen
}
