//! End to end: what the data plane shows of itself. `/queue/status`,
//! `/queue/summary`, `/metrics` (checked by `promtool`), `/dashboard` (its
//! headers, its 404 when off, and a real render in headless Chromium), the
//! `read` scope, and the monitoring examples in `examples/`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use oqp_tests::client::{HttpClient, Reply, eventually};
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::{ConfigYaml, Host, Key, Stack};
use serde_json::{Value, json};

const GENERATE: &str = r#"{"model":"llama3","prompt":"hi","stream":false}"#;

/// Auth off, one host `primary` with `slots` slots; `extra` is appended.
fn config(url: &str, slots: u32, extra: &str) -> String {
    format!(
        r#"proxy:
  max_concurrent: 4
ollama:
  hosts:
    - url: "{url}"
      name: primary
      max_concurrent: {slots}
auth:
  enabled: false
  keys:
    - key: "sk-widget-0123456789"
      client_id: widget
      description: "Status widget"
      scope: read
    - key: "sk-chat-0123456789"
      client_id: chat
      max_priority: high
{extra}"#
    )
}

/// Auth on, a key of every scope, the dashboard on.
fn auth_config(url: &str) -> String {
    ConfigYaml::new()
        .host(Host::ollama("primary", url))
        .key(Key::new("sk-read-0123456789", "widget").set("scope", "read"))
        .key(Key::new("sk-chat-0123456789", "chat"))
        .key(Key::new("sk-admin-0123456789", "admin").set("scope", "management"))
        .under("dashboard", "  enabled: true\n")
        .yaml()
}

fn metrics_names() -> [(&'static str, &'static str, &'static [&'static str]); 28] {
    [
        ("oqp_queue_depth", "gauge", &["tier"]),
        ("oqp_queue_processed_total", "counter", &["tier"]),
        ("oqp_queue_rejected_total", "counter", &["tier"]),
        ("oqp_queue_expired_total", "counter", &["tier"]),
        ("oqp_queue_cancelled_total", "counter", &["tier"]),
        ("oqp_queue_promoted_total", "counter", &["tier"]),
        ("oqp_queue_flushed_total", "counter", &["tier"]),
        ("oqp_queued_bytes", "gauge", &[]),
        ("oqp_queue_wait_seconds", "histogram", &["tier"]),
        ("oqp_upstream_ttfb_seconds", "histogram", &["tier"]),
        ("oqp_concurrency_active", "gauge", &[]),
        ("oqp_host_healthy", "gauge", &["name"]),
        ("oqp_host_requests_total", "counter", &["name"]),
        ("oqp_host_failures_total", "counter", &["name"]),
        ("oqp_host_slots_in_use", "gauge", &["name"]),
        ("oqp_host_models_installed", "gauge", &["host"]),
        ("oqp_host_models_loaded", "gauge", &["host"]),
        ("oqp_client_inflight", "gauge", &["client_id"]),
        ("oqp_client_cap_waiting", "gauge", &["client_id"]),
        ("oqp_client_recent_share", "gauge", &["client_id"]),
        (
            "oqp_embedding_cache_hits_total",
            "counter",
            &["client", "model", "endpoint"],
        ),
        (
            "oqp_embedding_cache_misses_total",
            "counter",
            &["client", "model", "endpoint"],
        ),
        ("oqp_embedding_cache_errors_total", "counter", &["kind"]),
        ("oqp_routing_decisions_total", "counter", &["reason"]),
        ("oqp_failovers_total", "counter", &[]),
        ("oqp_snapshot_version", "gauge", &[]),
        ("oqp_snapshot_rejected_total", "counter", &[]),
        ("oqp_uptime_seconds", "gauge", &[]),
    ]
}

fn send_generate(
    http: &HttpClient,
    url: &str,
    client: &str,
    tier: &str,
) -> tokio::task::JoinHandle<Reply> {
    let http = http.clone();
    let url = format!("{url}/api/generate");
    let client = client.to_owned();
    let tier = tier.to_owned();
    tokio::spawn(async move {
        http.send(
            "POST".parse().unwrap(),
            &url,
            &[
                ("content-type", "application/json"),
                ("x-client-id", &client),
                ("x-queue-priority", &tier),
            ],
            GENERATE,
        )
        .await
    })
}

/// The names of every sample in a scrape (`_bucket`, `_sum`, `_count`
/// included).
fn sample_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .map(|line| line.split(['{', ' ']).next().unwrap_or_default().to_owned())
        .collect()
}

/// Runs `promtool check metrics` on `text`; `false` (after a notice) when
/// promtool is missing outside CI.
async fn promtool_accepts(text: &str) -> bool {
    let child = tokio::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "promtool is required in CI (scripts/setup.sh installs it)"
            );
            eprintln!("SKIPPED: promtool is not installed; run scripts/setup.sh");
            return false;
        }
        Err(error) => panic!("cannot run promtool: {error}"),
    };
    use tokio::io::AsyncWriteExt;
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(text.as_bytes()).await.unwrap();
    drop(stdin);
    let output = child.wait_with_output().await.unwrap();
    assert!(
        output.status.success(),
        "promtool check metrics failed:\n{}{}\n--- scrape ---\n{text}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    true
}

#[tokio::test]
async fn status_and_summary_count_traffic_overflow_and_expiry() {
    let fake = FakeOllama::builder().model("llama3").slots(1).spawn().await;
    let extra = "queue:\n  normal: {max_depth: 1}\n  low: {max_wait: 0.3}\n";
    let stack = Stack::start(&config(&fake.url(), 1, extra)).await;
    let dispatcher = stack.control.dataplane().unwrap().app().dispatcher.clone();
    let http = HttpClient::new();
    let base = stack.url();

    // One request holds the only slot, one waits, one overflows, one
    // (low, max_wait 0.3 s) expires while waiting.
    let handle = fake.handle();
    handle.hold();
    let first = send_generate(&http, &base, "chat", "normal");
    handle.wait_in_flight(1).await;
    let second = send_generate(&http, &base, "editor", "normal");
    assert!(eventually(Duration::from_secs(30), || dispatcher.total_depth() == 1).await);
    let overflow = send_generate(&http, &base, "editor", "normal")
        .await
        .unwrap();
    assert_eq!(overflow.status, 503);
    assert_eq!(overflow.json()["error"], "queue full");
    let expired = send_generate(&http, &base, "batch", "low").await.unwrap();
    assert_eq!(expired.status, 503);
    assert_eq!(expired.json()["error"], "request expired in queue");

    let during = http.get(&format!("{base}/queue/summary"), &[]).await.json();
    assert_eq!(during["queued"], 1);
    assert_eq!(during["active"], 1);
    handle.release_all();
    for task in [first, second] {
        assert_eq!(task.await.unwrap().status, 200);
    }

    let summary = http.get(&format!("{base}/queue/summary"), &[]).await;
    assert_eq!(summary.status, 200);
    assert_eq!(summary.header("content-type").unwrap(), "application/json");
    let summary = summary.json();
    let keys: Vec<&str> = summary
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        [
            "status",
            "queued",
            "active",
            "max_concurrent",
            "hosts_healthy",
            "hosts_total",
            "processed",
            "rejected",
            "expired",
            "uptime_seconds"
        ],
        "exactly the ten flat keys"
    );
    assert!(
        summary
            .as_object()
            .unwrap()
            .values()
            .all(|v| !v.is_object() && !v.is_array())
    );
    assert_eq!(summary["status"], "ok");
    assert_eq!(summary["queued"], 0);
    assert_eq!(summary["max_concurrent"], 1, "the sum of the hosts' slots");
    assert_eq!(summary["hosts_total"], 1);
    assert_eq!(summary["hosts_healthy"], 1);
    assert_eq!(summary["processed"], 2);
    assert_eq!(summary["rejected"], 1);
    assert_eq!(summary["expired"], 1);
    assert!(summary["uptime_seconds"].is_u64());

    let status = http.get(&format!("{base}/queue/status"), &[]).await.json();
    let keys: Vec<&str> = status
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        [
            "status",
            "uptime_seconds",
            "queue",
            "concurrency",
            "hosts",
            "clients",
            "security",
            "snapshot",
            "node"
        ]
    );
    let normal = &status["queue"]["normal"];
    for key in [
        "depth",
        "max_depth",
        "processed",
        "rejected",
        "expired",
        "cancelled",
        "promoted",
        "flushed",
        "paused",
        "wait",
    ] {
        assert!(normal.get(key).is_some(), "queue.normal.{key}");
    }
    assert_eq!(normal["max_depth"], 1);
    assert_eq!(normal["processed"], 2);
    assert_eq!(normal["rejected"], 1);
    assert_eq!(normal["wait"]["count"], 2);
    assert_eq!(status["queue"]["low"]["expired"], 1);
    assert_eq!(status["queue"]["low"]["processed"], 0);
    assert_eq!(status["queue"]["high"]["max_depth"], 50);
    assert_eq!(status["concurrency"], json!({"active": 0, "max": 1}));

    let host = &status["hosts"][0];
    assert_eq!(host["name"], "primary");
    assert_eq!(host["url"], fake.url());
    assert_eq!(host["healthy"], true);
    assert_eq!(host["requests_handled"], 2);
    assert_eq!(host["failures"], 0);
    assert_eq!(host["slots_in_use"], 0);
    assert_eq!(host["max_concurrent"], 1);
    assert!(
        host["models"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m.as_str().unwrap().starts_with("llama3"))
    );
    assert!(host["loaded_models"].is_array());
    assert!(host["last_checked"].as_str().unwrap().ends_with("+00:00"));

    let clients = status["clients"].as_object().unwrap();
    // Configured clients are listed even before they call.
    assert_eq!(
        clients["widget"],
        json!({
            "description": "Status widget", "processed": 0, "rejected": 0, "waiting": 0,
            "inflight": 0, "max_concurrent": 0, "weight": 1.0, "recent_share": 0.0,
            "switch_charged_seconds": 0.0,
            "max_priority": "normal", "scope": "read",
            "usage_today": {
                "gpu_seconds": 0.0, "prompt_tokens": 0, "completion_tokens": 0,
                "requests": 0, "cached_inputs": 0
            }
        })
    );
    assert_eq!(clients["chat"]["processed"], 1);
    assert_eq!(clients["chat"]["max_priority"], "high");
    assert_eq!(clients["editor"]["processed"], 1);
    assert_eq!(clients["editor"]["rejected"], 1);
    assert_eq!(
        clients["editor"]["scope"],
        Value::Null,
        "not a configured key"
    );
    assert_eq!(
        status["security"],
        json!({"auth_enabled": false, "model_management_allowed": false, "active_keys": 2})
    );
    assert_eq!(status["snapshot"]["control_plane_connected"], true);
    assert_eq!(status["snapshot"]["last_error"], Value::Null);
    assert!(status["snapshot"]["version"].as_u64().unwrap() > 0);
    stack.shutdown().await;
}

#[tokio::test]
async fn metrics_expose_every_family_and_pass_promtool() {
    let fake = FakeOllama::builder().model("llama3").slots(2).spawn().await;
    // A configured client id that tries to end its label and forge a series.
    let extra = "    - key: \"sk-evil-0123456789\"\n      client_id: \"evil\\\"} 1\\nforged_total 7\\n\\\\\"\n";
    let stack = Stack::start(&config(&fake.url(), 2, extra)).await;
    let app = stack.control.dataplane().unwrap().app().clone();
    let http = HttpClient::new();
    let base = stack.url();
    for client in ["chat", "quote\"back\\slash", "chat"] {
        let reply = send_generate(&http, &base, client, "high").await.unwrap();
        assert_eq!(reply.status, 200);
    }
    // What the embedding cache reports on the request path.
    app.metrics
        .cache_hit("chat", "nomic-embed-text", "/api/embed");
    app.metrics
        .cache_miss("chat", "nomic-embed-text", "/api/embed");
    app.metrics.cache_error("timeout");

    let reply = http.get(&format!("{base}/metrics"), &[]).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("content-type").unwrap(),
        "text/plain; version=0.0.4; charset=utf-8"
    );
    let text = reply.text();
    for (name, kind, labels) in metrics_names() {
        assert!(
            text.contains(&format!("# TYPE {name} {kind}\n")),
            "{name} ({kind}) missing:\n{text}"
        );
        assert!(text.contains(&format!("# HELP {name} ")), "{name} has help");
        let sample = text
            .lines()
            .find(|line| line.starts_with(name) && !line.starts_with('#'))
            .unwrap_or_else(|| panic!("no sample of {name}"));
        for label in labels.iter() {
            assert!(
                sample.contains(&format!("{label}=\"")),
                "{sample} has {label}"
            );
        }
    }
    for line in [
        "oqp_queue_processed_total{tier=\"high\"} 3",
        "oqp_queue_depth{tier=\"low\"} 0",
        "oqp_queue_wait_seconds_count{tier=\"high\"} 3",
        "oqp_upstream_ttfb_seconds_count{tier=\"high\"} 3",
        "oqp_host_requests_total{name=\"primary\"} 3",
        "oqp_host_healthy{name=\"primary\"} 1",
        "oqp_host_slots_in_use{name=\"primary\"} 0",
        "oqp_routing_decisions_total{reason=\"model_match\"} 0",
        "oqp_client_inflight{client_id=\"chat\"} 0",
        "oqp_client_inflight{client_id=\"widget\"} 0",
        "oqp_embedding_cache_hits_total{client=\"chat\",endpoint=\"/api/embed\",model=\"nomic-embed-text\"} 1",
        "oqp_embedding_cache_errors_total{kind=\"timeout\"} 1",
        "oqp_failovers_total 0",
        "oqp_snapshot_rejected_total 0",
    ] {
        assert!(text.lines().any(|l| l == line), "missing `{line}`:\n{text}");
    }
    // Label values are escaped: `"` → `\"`, `\` → `\\`, newline → `\n`.
    assert!(text.contains(r#"oqp_client_inflight{client_id="quote\"back\\slash"} 0"#));
    assert!(text.contains(r#"oqp_client_inflight{client_id="evil\"} 1\nforged_total 7\n\\"} 0"#));
    assert!(
        !text.lines().any(|line| line.starts_with("forged_total")),
        "no forged series"
    );
    promtool_accepts(&text).await;
    stack.shutdown().await;
}

#[tokio::test]
async fn every_family_is_on_metrics_from_the_first_scrape() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let cache = "embedding_cache:\n  enabled: true\n  backend: memory\n";
    let stack = Stack::start(&config(&fake.url(), 2, cache)).await;
    let app = stack.control.dataplane().unwrap().app().clone();
    let text = HttpClient::new()
        .get(&format!("{}/metrics", stack.url()), &[])
        .await
        .text();
    // Before any request: every family the code registers, and the known list.
    let registered: Vec<String> = app.metrics.families().map(str::to_owned).collect();
    assert!(registered.len() >= metrics_names().len());
    for name in registered
        .iter()
        .map(String::as_str)
        .chain(metrics_names().iter().map(|(name, _, _)| *name))
    {
        assert!(
            text.contains(&format!("# TYPE {name} ")),
            "{name} missing at start:\n{text}"
        );
        assert!(text.contains(&format!("# HELP {name} ")), "{name} has help");
    }
    // Series whose labels are known at start are there, at zero.
    for line in [
        "oqp_embedding_cache_errors_total{kind=\"backend\"} 0",
        "oqp_queue_wait_seconds_count{tier=\"high\"} 0",
        "oqp_upstream_ttfb_seconds_count{tier=\"low\"} 0",
        "oqp_host_failures_total{name=\"primary\"} 0",
        "oqp_queue_rejected_total{tier=\"normal\"} 0",
    ] {
        assert!(text.lines().any(|l| l == line), "missing `{line}`:\n{text}");
    }
    promtool_accepts(&text).await;
    stack.shutdown().await;
}

#[tokio::test]
async fn a_failover_shows_in_metrics_and_status() {
    let first = FakeOllama::builder().model("llama3").spawn().await;
    let second = FakeOllama::builder().model("llama3").spawn().await;
    // Polls every 30 s (the default): only requests can find `first` down.
    let yaml = format!(
        "ollama:\n  hosts:\n    - {{url: \"{}\", name: first}}\n    - {{url: \"{}\", name: second}}\n",
        first.url(),
        second.url()
    );
    let stack = Stack::start(&yaml).await;
    first.shutdown().await;
    let http = HttpClient::new();
    let base = stack.url();
    for _ in 0..4 {
        let reply = send_generate(&http, &base, "chat", "normal").await.unwrap();
        assert_eq!(reply.status, 200, "failed over to the live host");
        assert_eq!(reply.header("x-failover-host").unwrap(), "second");
    }
    let text = http.get(&format!("{base}/metrics"), &[]).await.text();
    let value = |series: &str| -> f64 {
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
    };
    assert!(value("oqp_failovers_total ") >= 1.0);
    assert!(value("oqp_host_failures_total{name=\"first\"}") >= 1.0);
    assert_eq!(value("oqp_host_requests_total{name=\"second\"}"), 4.0);
    assert_eq!(value("oqp_host_requests_total{name=\"first\"}"), 0.0);
    assert_eq!(value("oqp_host_healthy{name=\"first\"}"), 0.0);

    let status = http.get(&format!("{base}/queue/status"), &[]).await.json();
    assert_eq!(status["hosts"][0]["name"], "first");
    assert_eq!(status["hosts"][0]["healthy"], false);
    assert!(status["hosts"][0]["failures"].as_u64().unwrap() >= 1);
    assert_eq!(status["hosts"][1]["requests_handled"], 4);
    let summary = http.get(&format!("{base}/queue/summary"), &[]).await.json();
    assert_eq!(
        (
            summary["hosts_healthy"].as_u64(),
            summary["hosts_total"].as_u64()
        ),
        (Some(1), Some(2))
    );
    stack.shutdown().await;
}

/// An address nothing listens on.
async fn dead_url() -> String {
    let listener = oqp_tests::harness::loopback().await;
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    url
}

/// Reads `/queue/status` until `check` holds for it (a poll a second moves it); the last
/// document read when the time runs out.
async fn status_until(http: &HttpClient, base: &str, check: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let status = http.get(&format!("{base}/queue/status"), &[]).await.json();
        if check(&status) || std::time::Instant::now() >= deadline {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn status_says_degraded_and_polling_shows_in_last_checked() {
    let live = FakeOllama::builder().model("llama3").spawn().await;
    let gone = dead_url().await;
    let yaml = format!(
        "ollama:\n  hosts:\n    - {{url: \"{}\", name: live, model_sync_interval: 1}}\n    \
         - {{url: \"{gone}\", name: gone, model_sync_interval: 1}}\n",
        live.url()
    );
    let stack = Stack::start(&yaml).await;
    let http = HttpClient::new();
    let base = stack.url();
    let summary = http.get(&format!("{base}/queue/summary"), &[]).await.json();
    assert_eq!(summary["status"], "degraded", "{summary}");
    assert_eq!(summary["hosts_healthy"], 1);
    let status = http.get(&format!("{base}/queue/status"), &[]).await.json();
    assert_eq!(status["status"], "degraded");

    // The live host's inventory does not change, yet each poll shows.
    let first = status["hosts"][0]["last_checked"].clone();
    assert!(first.is_string(), "{status}");
    let later = status_until(&http, &base, |status| {
        status["hosts"][0]["last_checked"] != first
    })
    .await;
    assert!(
        later["hosts"][0]["last_checked"].as_str() > first.as_str(),
        "last_checked stayed at {first} through polls"
    );
    assert_eq!(
        later["snapshot"]["version"], status["snapshot"]["version"],
        "no snapshot was published for polls that changed nothing"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn with_every_host_down_the_503_names_each_host_and_why() {
    let gone = dead_url().await;
    let other = dead_url().await;
    let yaml = format!(
        "ollama:\n  hosts:\n    - {{url: \"{gone}\", name: gone}}\n    \
         - {{url: \"{other}\", name: other}}\n"
    );
    let stack = Stack::start(&yaml).await;
    let http = HttpClient::new();
    let base = stack.url();
    let summary = http.get(&format!("{base}/queue/summary"), &[]).await.json();
    assert_eq!(summary["status"], "down", "{summary}");
    assert_eq!(summary["hosts_healthy"], 0);
    let status = http.get(&format!("{base}/queue/status"), &[]).await.json();
    assert_eq!(status["status"], "down");

    let reply = send_generate(&http, &base, "chat", "normal").await.unwrap();
    assert_eq!(reply.status, 503);
    assert_eq!(
        reply.header("x-failover-exhausted").as_deref(),
        Some("true")
    );
    let error = reply.json()["error"].as_str().unwrap().to_owned();
    assert!(
        error.starts_with("all upstream hosts failed: "),
        "the reference's message comes first: {error}"
    );
    for host in ["gone (connection refused)", "other (connection refused)"] {
        assert!(error.contains(host), "{host} not in {error}");
    }
    assert!(
        !error.contains("127.0.0.1") && !error.contains("os error"),
        "no address or OS wording: {error}"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn anonymous_client_ids_are_bounded() {
    let fake = FakeOllama::builder().model("llama3").slots(4).spawn().await;
    let stack = Stack::start(&config(&fake.url(), 4, "")).await;
    let http = HttpClient::new();
    let base = stack.url();
    for i in 0..110 {
        let reply = send_generate(&http, &base, &format!("caller-{i:03}"), "normal")
            .await
            .unwrap();
        assert_eq!(reply.status, 200);
    }
    let status = http.get(&format!("{base}/queue/status"), &[]).await.json();
    let clients = status["clients"].as_object().unwrap();
    assert_eq!(
        clients.len(),
        2 + 100,
        "configured clients + at most 100 others"
    );
    assert!(clients.contains_key("widget") && clients.contains_key("chat"));
    let text = http.get(&format!("{base}/metrics"), &[]).await.text();
    let series = text
        .lines()
        .filter(|line| line.starts_with("oqp_client_inflight{"))
        .count();
    assert_eq!(series, 2 + 100);
    promtool_accepts(&text).await;
    stack.shutdown().await;
}

#[tokio::test]
async fn the_dashboard_has_a_fresh_nonce_and_strict_headers() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let extra = "dashboard:\n  enabled: true\n  refresh_seconds: 7\n";
    let stack = Stack::start(&config(&fake.url(), 1, extra)).await;
    let http = HttpClient::new();
    let url = format!("{}/dashboard", stack.url());
    let mut nonces = Vec::new();
    for _ in 0..2 {
        let reply = http.get(&url, &[]).await;
        assert_eq!(reply.status, 200);
        assert_eq!(
            reply.header("content-type").unwrap(),
            "text/html; charset=utf-8"
        );
        assert_eq!(reply.header("x-content-type-options").unwrap(), "nosniff");
        assert_eq!(reply.header("referrer-policy").unwrap(), "no-referrer");
        assert_eq!(reply.header("x-frame-options").unwrap(), "DENY");
        let csp = reply.header("content-security-policy").unwrap();
        let nonce = csp
            .strip_prefix("default-src 'none'; style-src 'nonce-")
            .and_then(|rest| rest.split_once('\''))
            .map(|(nonce, _)| nonce.to_owned())
            .unwrap_or_else(|| panic!("unexpected CSP: {csp}"));
        assert_eq!(
            csp,
            format!(
                "default-src 'none'; style-src 'nonce-{nonce}'; script-src 'nonce-{nonce}'; \
                 connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
            )
        );
        assert_eq!(nonce.len(), 22, "16 bytes, URL-safe base64");
        let page = reply.text();
        assert_eq!(page.matches(&format!("nonce=\"{nonce}\"")).count(), 2);
        assert!(page.contains("var REFRESH_MS = 7000;"));
        assert!(!page.contains("innerHTML"));
        nonces.push(nonce);
    }
    assert_ne!(nonces[0], nonces[1], "a new nonce per response");
    stack.shutdown().await;
}

#[tokio::test]
async fn a_disabled_dashboard_is_404_before_auth() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let yaml = auth_config(&fake.url()).replace(
        "dashboard:\n  enabled: true\n",
        "dashboard:\n  enabled: false\n",
    );
    let stack = Stack::start(&yaml).await;
    let http = HttpClient::new();
    let url = format!("{}/dashboard", stack.url());
    for headers in [
        vec![],
        vec![("authorization", "Bearer sk-wrong-0123456789")],
        vec![("authorization", "Bearer sk-read-0123456789")],
    ] {
        let reply = http.get(&url, &headers).await;
        assert_eq!(reply.status, 404, "{headers:?}");
        assert_eq!(reply.json(), json!({"detail": "Not Found"}));
        assert!(reply.header("www-authenticate").is_none());
    }
    // No 401 was counted against this address: a valid key still works.
    let status = http
        .get(
            &format!("{}/queue/summary", stack.url()),
            &[("authorization", "Bearer sk-read-0123456789")],
        )
        .await;
    assert_eq!(status.status, 200);
    stack.shutdown().await;
}

#[tokio::test]
async fn reading_needs_the_read_scope_when_auth_is_on() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&auth_config(&fake.url())).await;
    let http = HttpClient::new();
    for path in ["/queue/status", "/queue/summary", "/metrics", "/dashboard"] {
        let url = format!("{}{path}", stack.url());
        let missing = http.get(&url, &[]).await;
        assert_eq!(missing.status, 401, "{path} without a key");
        assert_eq!(missing.header("www-authenticate").unwrap(), "Bearer");
        if path == "/dashboard" {
            // A browser gets the login form (tests/tests/e2e/dashboard.rs).
            assert!(missing.text().contains("id=\"login-form\""));
        } else {
            assert_eq!(
                missing.json()["error"],
                "missing or invalid authorization header"
            );
        }
        for key in [
            "sk-read-0123456789",
            "sk-chat-0123456789",
            "sk-admin-0123456789",
        ] {
            let reply = http
                .get(&url, &[("authorization", &format!("Bearer {key}"))])
                .await;
            assert_eq!(reply.status, 200, "{path} with {key}");
        }
    }
    let status = http
        .get(
            &format!("{}/queue/status", stack.url()),
            &[("authorization", "Bearer sk-read-0123456789")],
        )
        .await
        .json();
    assert_eq!(status["security"]["auth_enabled"], true);
    assert_eq!(status["security"]["active_keys"], 3);
    let body = status.to_string();
    assert!(!body.contains("sk-"), "no key in status");
    stack.shutdown().await;
}

/// `name` on `PATH`, if it is there.
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// Headless Chromium, or `None` (after a notice) when it is not installed
/// outside CI.
fn chromium() -> Option<PathBuf> {
    if let Some(path) = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find_map(on_path)
    {
        return Some(path);
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "chromium is required in CI (scripts/setup.sh installs it)"
    );
    eprintln!("SKIPPED: chromium is not installed; run scripts/setup.sh");
    None
}

async fn run_chromium(
    browser: &Path,
    profile: &Path,
    mode: &[String],
    url: &str,
) -> (String, String) {
    let mut command = tokio::process::Command::new(browser);
    command
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=5000",
            "--window-size=1280,900",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(mode)
        .arg(url)
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(90), command.output())
        .await
        .expect("chromium finished within 90 s")
        .expect("chromium runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "chromium failed:\n{stderr}");
    (stdout, stderr)
}

/// The text of the element with `id` in a dumped DOM.
fn element_text<'a>(dom: &'a str, id: &str) -> &'a str {
    let marker = format!("id=\"{id}\"");
    let start = dom
        .find(&marker)
        .unwrap_or_else(|| panic!("no #{id} in the DOM"));
    let after = &dom[start..];
    let open_end = after.find('>').unwrap() + 1;
    let close = after[open_end..].find('<').unwrap();
    &after[open_end..open_end + close]
}

fn assert_clean_console(stderr: &str) {
    for bad in [
        "Content Security Policy",
        "Content-Security-Policy",
        "Refused to",
        "Uncaught",
    ] {
        assert!(
            !stderr.contains(bad),
            "chromium reported `{bad}`:\n{stderr}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_renders_in_headless_chromium() {
    let _exclusive = crate::support::exclusive().await;
    let Some(browser) = chromium() else {
        return;
    };
    let fake = FakeOllama::builder()
        .model("llama3")
        .model("qwen3:8b")
        .loaded("llama3")
        .slots(2)
        .spawn()
        .await;
    let extra = "dashboard:\n  enabled: true\n  refresh_seconds: 1\n";
    let stack = Stack::start(&config(&fake.url(), 2, extra)).await;
    let dispatcher = stack.control.dataplane().unwrap().app().dispatcher.clone();
    let http = HttpClient::new();
    let base = stack.url();
    for (client, tier) in [
        ("chat", "high"),
        ("open-webui", "normal"),
        ("open-webui", "normal"),
        ("embedder", "low"),
        ("chat", "high"),
    ] {
        let reply = send_generate(&http, &base, client, tier).await.unwrap();
        assert_eq!(reply.status, 200);
    }
    // A live moment: both slots busy, one request waiting.
    let handle = fake.handle();
    handle.hold();
    let held: Vec<_> = [("chat", "high"), ("embedder", "low"), ("embedder", "low")]
        .into_iter()
        .map(|(client, tier)| send_generate(&http, &base, client, tier))
        .collect();
    handle.wait_in_flight(2).await;
    assert!(eventually(Duration::from_secs(30), || dispatcher.total_depth() == 1).await);
    let summary = http.get(&format!("{base}/queue/summary"), &[]).await.json();

    let profile = tempfile::tempdir().unwrap();
    let url = format!("{base}/dashboard");
    let (dom, stderr) = run_chromium(&browser, profile.path(), &["--dump-dom".into()], &url).await;
    assert_clean_console(&stderr);
    let tiles = [
        ("tile-queued", summary["queued"].to_string()),
        (
            "tile-active",
            format!("{} / {}", summary["active"], summary["max_concurrent"]),
        ),
        (
            "tile-hosts",
            format!("{} / {}", summary["hosts_healthy"], summary["hosts_total"]),
        ),
        ("tile-processed", summary["processed"].to_string()),
        ("tile-rejected", summary["rejected"].to_string()),
        ("tile-expired", summary["expired"].to_string()),
    ];
    for (id, expected) in &tiles {
        assert_eq!(element_text(&dom, id), expected, "#{id}");
    }
    assert_eq!(element_text(&dom, "tile-active"), "2 / 2");
    assert_eq!(element_text(&dom, "tile-queued"), "1");
    assert_ne!(element_text(&dom, "tile-uptime"), "–");
    assert!(dom.contains(">open-webui<"), "the clients table is filled");
    assert!(
        dom.contains(">GPU time today<") && dom.contains(">0:00:00<"),
        "the clients' GPU time today"
    );
    assert!(dom.contains(">primary<"), "the hosts table is filled");
    assert!(dom.contains("<polyline"), "the chart is drawn");

    let shot = profile.path().join("dashboard.png");
    let (_, stderr) = run_chromium(
        &browser,
        profile.path(),
        &[format!("--screenshot={}", shot.display())],
        &url,
    )
    .await;
    assert_clean_console(&stderr);
    let png = std::fs::read(&shot).expect("the screenshot was written");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"));
    assert!(
        png.len() > 20_000,
        "a blank page is smaller: {} bytes",
        png.len()
    );
    if std::env::var("OQP_UPDATE_SCREENSHOT").as_deref() == Ok("1") {
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/dashboard.png");
        std::fs::copy(&shot, &docs).unwrap();
        eprintln!("updated {}", docs.display());
    }

    handle.release_all();
    for task in held {
        assert_eq!(task.await.unwrap().status, 200);
    }
    stack.shutdown().await;
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn read(path: &str) -> String {
    std::fs::read_to_string(examples().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn yaml(path: &str) -> serde_yaml::Value {
    serde_yaml::from_str(&read(path)).unwrap_or_else(|e| panic!("{path} is not YAML: {e}"))
}

/// Every `expr` in a Grafana dashboard, panels nested in rows included.
fn grafana_exprs(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("expr", Value::String(expr)) => out.push(expr.clone()),
                    _ => grafana_exprs(value, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|item| grafana_exprs(item, out)),
        _ => {}
    }
}

#[tokio::test]
async fn the_monitoring_examples_parse_and_match_the_metrics() {
    // docker compose: Valkey, the control plane with its data plane, loopback ports.
    let compose = yaml("docker-compose.yml");
    let services = compose["services"].as_mapping().unwrap();
    assert!(services.len() >= 2);
    let mut images = String::new();
    for (name, service) in services {
        images.push_str(service["image"].as_str().unwrap_or_default());
        for port in service["ports"].as_sequence().into_iter().flatten() {
            let port = port.as_str().unwrap();
            assert!(
                port.starts_with("127.0.0.1:"),
                "{name:?} publishes {port} beyond loopback"
            );
        }
    }
    assert!(images.contains("valkey"));
    // Its oqp config loads, with the Docker secrets it names.
    let secrets = tempfile::tempdir().unwrap();
    for name in [
        "oqp_admin_key",
        "oqp_chat_key",
        "oqp_metrics_key",
        "oqp_node_token",
    ] {
        std::fs::write(secrets.path().join(name), format!("{name}-0123456789\n")).unwrap();
    }
    let docker_config = secrets.path().join("config.yml");
    let text = read("docker/config.yml")
        .replace("/run/secrets/", &format!("{}/", secrets.path().display()));
    std::fs::write(&docker_config, text).unwrap();
    let loaded = oqp_controlplane::config::load_file(
        &docker_config,
        &oqp_controlplane::config::Env::empty(),
    )
    .unwrap_or_else(|e| panic!("examples/docker/config.yml does not load:\n{e}"));
    assert!(loaded.config.auth.enabled);
    // The Dockerfile and the compose files' services: tests/tests/containers.rs.

    // systemd: hardened units.
    for unit in ["oqp-controlplane.service", "oqp-dataplane.service"] {
        let text = read(&format!("systemd/{unit}"));
        for directive in [
            "NoNewPrivileges=yes",
            "ProtectSystem=strict",
            "DynamicUser=yes",
            "PrivateTmp=yes",
            "ExecStart=",
        ] {
            assert!(
                text.lines().any(|l| l.trim().starts_with(directive)),
                "{unit}: {directive}"
            );
        }
    }
    assert!(read("systemd/oqp-controlplane.service").contains("StateDirectory=oqp"));
    if let Some(analyze) = on_path("systemd-analyze") {
        let dir = tempfile::tempdir().unwrap();
        for unit in ["oqp-controlplane.service", "oqp-dataplane.service"] {
            // verify wants an executable ExecStart.
            let text = read(&format!("systemd/{unit}"))
                .replace("/usr/local/bin/oqp-controlplane", "/bin/true")
                .replace("/usr/local/bin/oqp-dataplane", "/bin/true");
            let path = dir.path().join(unit);
            std::fs::write(&path, text).unwrap();
            let output = std::process::Command::new(&analyze)
                .arg("verify")
                .arg(&path)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(
                output.status.success() && !stderr.contains(unit),
                "systemd-analyze verify {unit}:\n{stderr}"
            );
        }
    }

    // Prometheus: a read-scoped key from a file, not in the config.
    let prometheus = yaml("prometheus/prometheus.yml");
    let job = &prometheus["scrape_configs"][0];
    assert_eq!(job["metrics_path"], "/metrics");
    assert!(job["authorization"]["credentials_file"].is_string());
    assert!(job["authorization"]["credentials"].is_null());
    if let Some(promtool) = on_path("promtool") {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("oqp-metrics.key");
        std::fs::write(&key, "sk-metrics-0123456789\n").unwrap();
        let config = dir.path().join("prometheus.yml");
        let text = read("prometheus/prometheus.yml").replace(
            "/etc/prometheus/oqp-metrics.key",
            &key.display().to_string(),
        );
        std::fs::write(&config, text).unwrap();
        let output = std::process::Command::new(promtool)
            .args(["check", "config"])
            .arg(&config)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "promtool check config:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    // Homepage: the summary's scalars only.
    let homepage = yaml("homepage-services.yaml");
    let summary_keys = [
        "status",
        "queued",
        "active",
        "max_concurrent",
        "hosts_healthy",
        "hosts_total",
        "processed",
        "rejected",
        "expired",
        "uptime_seconds",
    ];
    let text = read("homepage-services.yaml");
    assert!(
        text.contains("{{HOMEPAGE_FILE_"),
        "the key comes from a file"
    );
    let mut widgets = 0;
    for group in homepage.as_sequence().unwrap() {
        for services in group.as_mapping().unwrap().values() {
            for service in services.as_sequence().unwrap() {
                for (_, entry) in service.as_mapping().unwrap() {
                    let widget = &entry["widget"];
                    assert_eq!(widget["type"], "customapi");
                    let url = widget["url"].as_str().unwrap();
                    if url.ends_with("/queue/summary") {
                        for mapping in widget["mappings"].as_sequence().unwrap() {
                            let field = mapping["field"].as_str().unwrap();
                            assert!(summary_keys.contains(&field), "{field}");
                        }
                    }
                    widgets += 1;
                }
            }
        }
    }
    assert!(widgets >= 1);

    // Grafana: valid JSON whose queries use only metrics /metrics exposes.
    let dashboard: Value = serde_json::from_str(&read("grafana-dashboard.json")).unwrap();
    assert!(dashboard["title"].is_string());
    assert!(dashboard["panels"].as_array().unwrap().len() >= 6);
    let mut exprs = Vec::new();
    grafana_exprs(&dashboard, &mut exprs);
    assert!(exprs.len() >= 6);

    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), 1, "")).await;
    let app = stack.control.dataplane().unwrap().app().clone();
    let http = HttpClient::new();
    let reply = send_generate(&http, &stack.url(), "chat", "normal")
        .await
        .unwrap();
    assert_eq!(reply.status, 200);
    app.metrics
        .cache_hit("chat", "nomic-embed-text", "/api/embed");
    app.metrics
        .cache_miss("chat", "nomic-embed-text", "/api/embed");
    app.metrics.cache_error("timeout");
    let exposed = sample_names(
        &http
            .get(&format!("{}/metrics", stack.url()), &[])
            .await
            .text(),
    );
    for expr in &exprs {
        let mut rest = expr.as_str();
        while let Some(at) = rest.find("oqp_") {
            let name: String = rest[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            assert!(
                exposed.contains(&name),
                "{expr} uses {name}, which /metrics does not expose"
            );
            rest = &rest[at + name.len()..];
        }
    }
    stack.shutdown().await;
}

/// A Redis URL's password crosses the snapshot (the data planes connect to
/// Redis themselves) but never shows in `Debug` output of either plane, in
/// status or in the logs' error texts.
#[tokio::test]
async fn a_redis_password_crosses_the_snapshot_but_shows_nowhere() {
    use oqp_dataplane::policy::CacheBackend;
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let yaml = oqp_tests::harness::basic_config(&fake.url())
        + "embedding_cache:\n  enabled: false\n  backend: \"redis://:hunter2-secret@127.0.0.1:1/0\"\n";
    let stack = Stack::start(&yaml).await;
    let dataplane = stack.control.dataplane().expect("single-box stack");
    let policy = dataplane.app().store.load();
    assert!(
        matches!(&policy.embedding_cache.backend, CacheBackend::Redis(url) if url.contains("hunter2-secret")),
        "the data plane has the URL it needs"
    );
    let status = HttpClient::new()
        .get(&format!("{}/queue/status", stack.url()), &[])
        .await;
    let printed = format!(
        "{:?}\n{:?}\n{:?}\n{:?}\n{}",
        stack.control.hub().current(),
        policy,
        stack.control.hub().config(),
        stack.control,
        status.text(),
    );
    assert!(printed.contains("127.0.0.1:1/0"), "{printed}");
    assert!(!printed.contains("hunter2-secret"), "{printed}");
    stack.shutdown().await;
}

#[tokio::test]
async fn eight_hundred_long_self_chosen_client_ids_keep_reports_and_status_working() {
    use oqp_proto::admin::v1::{GetStatusRequest, admin_service_client::AdminServiceClient};
    let _exclusive = crate::support::exclusive().await;
    let fake = FakeOllama::builder().model("llama3").slots(8).spawn().await;
    let stack = Stack::start(&oqp_tests::harness::basic_config(&fake.url())).await;
    let http = HttpClient::new();
    const CALLERS: usize = 800;
    // 800 × 6 kB of names: far past gRPC's 4 MB message limit if reported whole.
    let id = |i: usize| format!("{i:04}-{}", "x".repeat(6000));
    let url = format!("{}/api/generate", stack.url());
    for chunk in (0..CALLERS).collect::<Vec<_>>().chunks(16) {
        let calls = chunk.iter().map(|&i| {
            let (http, url, id) = (&http, &url, id(i));
            async move {
                http.post_json(
                    url,
                    &[("x-client-id", id.as_str())],
                    &json!({"model": "llama3", "prompt": "hi", "stream": false}),
                )
                .await
                .status
            }
        });
        for status in futures_util::future::join_all(calls).await {
            assert_eq!(status, 200);
        }
    }

    // A report that counts all 800 reaches the control plane, and Status answers with it.
    let mut admin = AdminServiceClient::connect(stack.control_url())
        .await
        .expect("admin connection");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let report = loop {
        let status = admin
            .get_status(GetStatusRequest::default())
            .await
            .expect("GetStatus answers")
            .into_inner();
        let report = status.nodes.into_iter().find_map(|node| node.report);
        if let Some(report) = report
            && report.tiers.iter().map(|t| t.processed).sum::<u64>() >= CALLERS as u64
        {
            break report;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no report counting every request reached the control plane"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        report.clients.len() <= oqp_dataplane::status::MAX_OTHER_CLIENTS,
        "{} clients reported",
        report.clients.len()
    );
    assert!(
        report
            .clients
            .iter()
            .all(|c| c.client_id.len() <= oqp_dataplane::auth::MAX_CLIENT_ID_BYTES),
        "client ids are cut"
    );
    // The data plane's own status page stays small too.
    let page = http
        .get(&format!("{}/queue/status", stack.url()), &[])
        .await;
    assert_eq!(page.status, 200);
    assert!(
        page.text().len() < 256 * 1024,
        "{} bytes",
        page.text().len()
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn status_shows_each_hosts_vram_with_its_configured_capacity() {
    const GIB: u64 = 1 << 30;
    let fake = FakeOllama::builder()
        .model("llama3:8b")
        .loaded("llama3:8b")
        .vram(24 * GIB)
        .model_size("llama3:8b", 5 * GIB)
        .spawn()
        .await;
    let stack = Stack::start(&format!(
        "ollama:\n  hosts:\n    - {{url: \"{}\", name: gpu, vram: 24GiB}}\n",
        fake.url()
    ))
    .await;
    let status = HttpClient::new()
        .get(&format!("{}/queue/status", stack.url()), &[])
        .await
        .json();
    let vram = &status["hosts"][0]["vram"];
    assert_eq!(vram["capacity_bytes"], 24 * GIB, "{status}");
    assert_eq!(vram["capacity_learned"], false);
    assert_eq!(
        vram["resident"],
        json!([{"model": "llama3:8b", "bytes": 5 * GIB}])
    );
    assert_eq!(vram["held"], 0);
    assert_eq!(vram["oldest_held_ms"], Value::Null);
    assert_eq!(vram["switching_to"], Value::Null);
    assert_eq!(vram["switches"], 0);
    assert_eq!(vram["bypassed"], false);
    stack.shutdown().await;
}
