//! End to end: host polling and webhooks. The real control plane (with its
//! in-process data plane) polls fake Ollamas every second; a tiny HTTP sink
//! on loopback stands in for the webhook receiver. Waits are on snapshot
//! changes (`hub.subscribe()`) and on webhook arrivals, never on sleeps.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use oqp_controlplane::StartError;
use oqp_controlplane::config::{Env, WebhookEvent};
use oqp_controlplane::webhooks::SsrfError;
use oqp_proto::admin::v1::GetStatusRequest;
use oqp_proto::admin::v1::admin_service_client::AdminServiceClient;
use oqp_proto::policy::v1::policy_service_client::PolicyServiceClient;
use oqp_proto::policy::v1::{self as wire, Event, NodeReport, PolicySnapshot};
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::Stack;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// How long a test waits for something that should take about a second.
const PATIENCE: Duration = Duration::from_secs(15);

/// A webhook receiver on 127.0.0.1:0 that answers 204 and hands over every
/// POSTed JSON body.
pub(crate) struct Sink {
    url: String,
    received: mpsc::UnboundedReceiver<Value>,
}

impl Sink {
    pub(crate) async fn start() -> Sink {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind sink");
        let addr = listener.local_addr().expect("sink address");
        let (tx, received) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let tx = tx.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request: Request<Incoming>| {
                        let tx = tx.clone();
                        async move {
                            assert_eq!(request.method(), http::Method::POST);
                            assert_eq!(request.headers()["content-type"], "application/json");
                            let body = request.into_body().collect().await;
                            if let Ok(body) = body
                                && let Ok(json) = serde_json::from_slice(&body.to_bytes())
                            {
                                let _ = tx.send(json);
                            }
                            Ok::<_, Infallible>(
                                Response::builder()
                                    .status(204)
                                    .body(Full::new(Bytes::new()))
                                    .expect("response"),
                            )
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Sink {
            url: format!("http://{addr}/hook"),
            received,
        }
    }

    /// The next webhook body.
    pub(crate) async fn next(&mut self) -> Value {
        tokio::time::timeout(PATIENCE, self.received.recv())
            .await
            .expect("no webhook arrived in time")
            .expect("sink stopped")
    }

    /// `webhooks:` for this sink, subscribed to `events` (default list if empty).
    pub(crate) fn config(&self, events: &[&str]) -> String {
        let events = if events.is_empty() {
            String::new()
        } else {
            format!("  events: [{}]\n", events.join(", "))
        };
        format!(
            "webhooks:\n  enabled: true\n  url: \"{}\"\n  allowed_hosts: [\"127.0.0.1\"]\n{events}",
            self.url
        )
    }
}

/// Two hosts, `primary` and `secondary`, polled every second.
fn two_hosts(primary: &str, secondary: &str, extra: &str) -> String {
    format!(
        "ollama:\n  hosts:\n    \
         - {{url: \"{primary}\", name: primary, model_sync_interval: 1}}\n    \
         - {{url: \"{secondary}\", name: secondary, model_sync_interval: 1}}\n\
         routing:\n  strategy: model_aware\n  model_poll_timeout: 2\n{extra}"
    )
}

/// An address nothing listens on.
async fn dead_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    listener.local_addr().expect("address")
}

fn host<'a>(snapshot: &'a PolicySnapshot, name: &str) -> &'a wire::Host {
    snapshot
        .hosts
        .iter()
        .find(|host| host.name == name)
        .unwrap_or_else(|| panic!("no host {name} in the snapshot"))
}

/// Waits on snapshot changes until `check` holds; returns that snapshot.
async fn wait_snapshot(
    stack: &Stack,
    what: &str,
    check: impl Fn(&PolicySnapshot) -> bool,
) -> Arc<PolicySnapshot> {
    let mut snapshots = stack.control.hub().subscribe();
    let wait = async {
        loop {
            let current = snapshots.borrow_and_update().clone();
            if check(&current) {
                return current;
            }
            snapshots.changed().await.expect("hub dropped");
        }
    };
    tokio::time::timeout(PATIENCE, wait)
        .await
        .unwrap_or_else(|_| panic!("the snapshot never showed {what}"))
}

/// Waits until `fake` received `n` more requests (polls: two per round).
async fn more_requests(fake: &FakeOllama, n: usize) {
    let handle = fake.handle();
    let target = handle.requests().len() + n;
    tokio::time::timeout(PATIENCE, handle.wait_for_requests(target))
        .await
        .expect("the host was not polled again");
}

fn keys(value: &Value) -> Vec<&str> {
    value
        .as_object()
        .expect("a JSON object")
        .keys()
        .map(String::as_str)
        .collect()
}

#[tokio::test]
async fn pulled_and_loaded_models_reach_the_snapshot_without_a_restart() {
    let primary = FakeOllama::builder().model("a").loaded("a").spawn().await;
    let secondary = FakeOllama::builder().model("b").spawn().await;
    let stack = Stack::start(&two_hosts(&primary.url(), &secondary.url(), "")).await;

    // The start-up probe ran before the first snapshot was served.
    let first = stack.control.hub().current();
    assert_eq!(host(&first, "primary").installed_models, ["a:latest"]);
    assert_eq!(host(&first, "primary").loaded_models, ["a:latest"]);
    assert_eq!(host(&first, "secondary").installed_models, ["b:latest"]);
    assert!(host(&first, "secondary").loaded_models.is_empty());
    assert!(
        first
            .hosts
            .iter()
            .all(|h| h.healthy && h.last_checked_unix_ms > 0)
    );

    let pulled_at = Instant::now();
    secondary.handle().add_model("c");
    let snapshot = wait_snapshot(&stack, "c installed on secondary", |s| {
        host(s, "secondary").installed_models == ["b:latest", "c:latest"]
    })
    .await;
    let pull_latency = pulled_at.elapsed();
    stack.wait_for_version(snapshot.version).await;
    let applied_latency = pulled_at.elapsed();
    assert!(host(&snapshot, "secondary").loaded_models.is_empty());

    let loaded_at = Instant::now();
    secondary.handle().load_model("c");
    wait_snapshot(&stack, "c loaded on secondary", |s| {
        host(s, "secondary").loaded_models == ["c:latest"]
    })
    .await;
    let load_latency = loaded_at.elapsed();
    eprintln!(
        "poll → snapshot: pulled model visible after {pull_latency:?} (data plane applied it \
         after {applied_latency:?}), loaded model after {load_latency:?}; interval 1 s"
    );
    // One interval plus the poll itself, with room for a slow machine.
    assert!(pull_latency < Duration::from_secs(5), "{pull_latency:?}");

    // Polls of unchanged hosts publish nothing: the version stays put
    // across a full interval of both hosts.
    let version = stack.control.hub().current().version;
    let polls = primary.handle().requests_to("/api/tags").len();
    more_requests(&primary, 2).await;
    assert!(primary.handle().requests_to("/api/tags").len() > polls);
    assert_eq!(stack.control.hub().current().version, version);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_dead_host_goes_unhealthy_and_recovers_with_webhooks() {
    let mut sink = Sink::start().await;
    let primary = FakeOllama::builder().model("a").spawn().await;
    let secondary = FakeOllama::builder().model("b").loaded("b").spawn().await;
    let stack = Stack::start(&two_hosts(
        &primary.url(),
        &secondary.url(),
        &sink.config(&[]),
    ))
    .await;
    assert!(
        stack
            .control
            .hub()
            .current()
            .hosts
            .iter()
            .all(|h| h.healthy)
    );

    let addr = secondary.addr();
    let killed_at = Instant::now();
    secondary.shutdown().await;
    let snapshot = wait_snapshot(&stack, "secondary unhealthy", |s| {
        !host(s, "secondary").healthy
    })
    .await;
    let detected = killed_at.elapsed();
    assert!(host(&snapshot, "primary").healthy);
    // What was learned about the host survives its outage.
    assert_eq!(host(&snapshot, "secondary").installed_models, ["b:latest"]);

    let event = sink.next().await;
    assert_eq!(event["event"], "host.unhealthy");
    assert_eq!(event["name"], "secondary");
    assert_eq!(keys(&event), ["event", "timestamp", "name"]);
    let timestamp = event["timestamp"].as_str().expect("timestamp");
    assert!(
        timestamp.len() == 27 && timestamp.ends_with('Z') && timestamp.as_bytes()[19] == b'.',
        "{timestamp}"
    );

    let restarted = FakeOllama::builder()
        .model("b")
        .model("d")
        .bind(addr)
        .spawn()
        .await;
    wait_snapshot(&stack, "secondary recovered", |s| {
        let secondary = host(s, "secondary");
        secondary.healthy && secondary.installed_models == ["b:latest", "d:latest"]
    })
    .await;
    let event = sink.next().await;
    assert_eq!(event["event"], "host.recovered");
    assert_eq!(event["name"], "secondary");
    assert_eq!(keys(&event), ["event", "timestamp", "name"]);
    eprintln!("host death seen by the snapshot after {detected:?} (interval 1 s)");

    let stats = stack.control.hub().webhooks().stats();
    assert_eq!((stats.queued, stats.dropped), (2, 0));
    stack.shutdown().await;
    restarted.shutdown().await;
}

#[tokio::test]
async fn with_every_host_dead_at_start_it_starts_and_says_so() {
    let (a, b) = (dead_addr().await, dead_addr().await);
    let stack = Stack::start(&two_hosts(
        &format!("http://{a}"),
        &format!("http://{b}"),
        "",
    ))
    .await;
    let snapshot = stack.control.hub().current();
    assert!(
        snapshot
            .hosts
            .iter()
            .all(|h| !h.healthy && h.last_checked_unix_ms > 0)
    );

    let mut admin = AdminServiceClient::connect(stack.control_url())
        .await
        .expect("admin connection");
    let status = admin
        .get_status(GetStatusRequest::default())
        .await
        .expect("GetStatus")
        .into_inner();
    assert_eq!((status.hosts_total, status.hosts_healthy), (2, 0));
    assert!(
        status
            .warnings
            .iter()
            .any(|w| w.contains("no upstream host answered")),
        "{:?}",
        status.warnings
    );

    // A host that comes up later is found by the next poll.
    let fake = FakeOllama::builder().model("late").bind(a).spawn().await;
    wait_snapshot(&stack, "primary up", |s| host(s, "primary").healthy).await;
    let status = admin
        .get_status(GetStatusRequest::default())
        .await
        .expect("GetStatus")
        .into_inner();
    assert_eq!(status.hosts_healthy, 1);
    assert!(
        status
            .warnings
            .iter()
            .all(|w| !w.contains("no upstream host"))
    );
    stack.shutdown().await;
    fake.shutdown().await;
}

#[tokio::test]
async fn require_host_at_start_refuses_to_start_without_a_host() {
    let (a, b) = (dead_addr().await, dead_addr().await);
    let yaml = two_hosts(&format!("http://{a}"), &format!("http://{b}"), "")
        + "  require_host_at_start: true\n";
    let error = Stack::try_start(&yaml, Env::empty())
        .await
        .expect_err("must not start");
    assert!(
        matches!(&error, StartError::NoHostAtStart { hosts } if hosts == "primary, secondary"),
        "{error}"
    );
    assert_eq!(error.exit_code(), 1);
    assert!(
        error
            .to_string()
            .contains("no Ollama host responded to /api/tags"),
        "{error}"
    );

    // One live host is enough.
    let fake = FakeOllama::builder().model("a").spawn().await;
    let yaml =
        two_hosts(&fake.url(), &format!("http://{b}"), "") + "  require_host_at_start: true\n";
    let stack = Stack::try_start(&yaml, Env::empty())
        .await
        .expect("one host answered");
    stack.shutdown().await;
    fake.shutdown().await;
}

#[tokio::test]
async fn private_webhook_urls_are_refused_at_start_and_on_reload() {
    let fake = FakeOllama::builder().model("a").spawn().await;
    let base = two_hosts(&fake.url(), &fake.url(), "");
    let private = "webhooks:\n  enabled: true\n  url: \"http://10.0.0.1/hook\"\n";
    let error = Stack::try_start(&format!("{base}{private}"), Env::empty())
        .await
        .expect_err("SSRF check");
    assert!(
        matches!(&error, StartError::Webhook(SsrfError::Private { .. })),
        "{error:?}"
    );
    assert_eq!(error.exit_code(), 1);
    assert_eq!(
        error.to_string(),
        "Webhook URL resolves to a private/loopback address (10.0.0.1 -> 10.0.0.1). This is an \
         SSRF risk. Use a public URL."
    );

    // A name that resolves to loopback is refused like the literal.
    let named = "webhooks:\n  enabled: true\n  url: \"http://localhost:9/hook\"\n";
    let error = Stack::try_start(&format!("{base}{named}"), Env::empty())
        .await
        .expect_err("SSRF check");
    assert!(
        matches!(&error, StartError::Webhook(SsrfError::Private { .. })),
        "{error:?}"
    );

    // On reload the same check refuses the new file and keeps the old one.
    let stack = Stack::start(&base).await;
    let version = stack.control.hub().current().version;
    let refused = stack
        .rewrite_and_reload(&format!(
            "{base}webhooks:\n  enabled: true\n  url: \"http://192.168.1.20:8080/x\"\n"
        ))
        .expect_err("reload must be refused");
    assert!(refused.contains("SSRF risk"), "{refused}");
    assert_eq!(stack.control.hub().current().version, version);
    assert!(!stack.control.hub().config().webhooks.enabled);
    stack.shutdown().await;
    fake.shutdown().await;
}

#[tokio::test]
async fn report_events_and_key_events_become_webhooks() {
    let mut sink = Sink::start().await;
    let fake = FakeOllama::builder().model("a").spawn().await;
    let yaml = two_hosts(
        &fake.url(),
        &fake.url(),
        &sink.config(&["queue.full", "queue.drained", "key.rotated"]),
    );
    let stack = Stack::start(&yaml).await;

    let mut policy = PolicyServiceClient::connect(stack.control_url())
        .await
        .expect("policy connection");
    let event = |name: &str| Event {
        name: name.to_owned(),
        tier: wire::Tier::High as i32,
        client_id: "alice".to_owned(),
        queue_depth: 7,
        unix_ms: 0,
        host: String::new(),
    };
    // A data plane's report, with the node token every report needs.
    let mut report = tonic::Request::new(NodeReport {
        node: "gpu-1".to_owned(),
        events: vec![
            event("queue.full"),
            event("queue.over_capacity"),
            event("queue.drained"),
        ],
        ..NodeReport::default()
    });
    report.metadata_mut().insert(
        oqp_proto::NODE_TOKEN_METADATA,
        oqp_dataplane::node_keys::grpc_credential(stack.control.node_token())
            .parse()
            .unwrap(),
    );
    policy.report_status(report).await.expect("report");
    // Filtering is synchronous: the unsubscribed event was never queued.
    assert_eq!(stack.control.hub().webhooks().stats().queued, 2);

    let mut bodies = [sink.next().await, sink.next().await];
    bodies.sort_by_key(|body| body["event"].as_str().map(str::to_owned));
    let [drained, full] = &bodies[..] else {
        unreachable!()
    };
    assert_eq!(full["event"], "queue.full");
    assert_eq!(
        keys(full),
        ["event", "timestamp", "tier", "client_id", "node"]
    );
    assert_eq!(full["client_id"], "alice");
    assert_eq!(full["tier"], "high");
    assert_eq!(full["node"], "gpu-1");
    assert_eq!(drained["event"], "queue.drained");
    assert_eq!(keys(drained), ["event", "timestamp", "node"]);

    // The handle other parts of the control plane (the key store) use.
    let mut fields = serde_json::Map::new();
    fields.insert("client_id".to_owned(), "bob".into());
    stack
        .control
        .hub()
        .webhooks()
        .send(WebhookEvent::KeyRotated, fields);
    let rotated = sink.next().await;
    assert_eq!(rotated["event"], "key.rotated");
    assert_eq!(keys(&rotated), ["event", "timestamp", "client_id"]);
    stack.shutdown().await;
    fake.shutdown().await;
}

#[tokio::test]
async fn a_reload_polls_the_new_host_list() {
    let primary = FakeOllama::builder().model("a").spawn().await;
    let secondary = FakeOllama::builder().model("b").loaded("b").spawn().await;
    let one_host = format!(
        "ollama:\n  hosts:\n    - {{url: \"{}\", name: primary, model_sync_interval: 1}}\n",
        primary.url()
    );
    let stack = Stack::start(&one_host).await;
    assert_eq!(stack.control.hub().current().hosts.len(), 1);

    let version = stack
        .rewrite_and_reload(&two_hosts(&primary.url(), &secondary.url(), ""))
        .expect("reload");
    // The new host is polled at once, not after an interval.
    let snapshot = wait_snapshot(&stack, "secondary polled", |s| {
        s.hosts.len() == 2 && host(s, "secondary").last_checked_unix_ms > 0
    })
    .await;
    assert!(snapshot.version > version);
    assert_eq!(host(&snapshot, "secondary").installed_models, ["b:latest"]);
    assert_eq!(host(&snapshot, "secondary").loaded_models, ["b:latest"]);

    // A host whose URL changes forgets what the old server had.
    let moved = two_hosts(&secondary.url(), &secondary.url(), "");
    stack.rewrite_and_reload(&moved).expect("reload");
    wait_snapshot(&stack, "primary now on the second server", |s| {
        host(s, "primary").installed_models == ["b:latest"]
    })
    .await;

    // A removed host is no longer polled.
    let only_secondary = format!(
        "ollama:\n  hosts:\n    - {{url: \"{}\", name: secondary, model_sync_interval: 1}}\n",
        secondary.url()
    );
    stack.rewrite_and_reload(&only_secondary).expect("reload");
    let stale = primary.handle().requests_to("/api/tags").len();
    more_requests(&secondary, 4).await;
    assert_eq!(primary.handle().requests_to("/api/tags").len(), stale);
    stack.shutdown().await;
    primary.shutdown().await;
    secondary.shutdown().await;
}

#[tokio::test]
async fn cloud_hosts_are_polled_with_the_first_pool_key() {
    let cloud = FakeOllama::builder()
        .cloud(&["ck-first", "ck-second"])
        .model("gpt-oss:20b")
        .loaded("gpt-oss:20b")
        .spawn()
        .await;
    let yaml = format!(
        "ollama:\n  hosts:\n    - {{url: \"{}\", name: cloud, kind: cloud, \
         model_sync_interval: 1, api_keys: [{{key: ck-first}}, {{key: ck-second}}]}}\n",
        cloud.url()
    );
    let stack = Stack::start(&yaml).await;
    let snapshot = stack.control.hub().current();
    let host = host(&snapshot, "cloud");
    assert!(host.healthy);
    assert_eq!(host.installed_models, ["gpt-oss:20b"]);
    // The fake's /api/ps answers 401 without a valid key.
    assert_eq!(host.loaded_models, ["gpt-oss:20b"]);
    let polls = cloud.handle().requests_to("/api/ps");
    assert!(!polls.is_empty());
    assert!(
        polls
            .iter()
            .all(|r| r.bearer().as_deref() == Some("ck-first"))
    );
    // Polls say who they are, so that they can be told from proxied traffic.
    assert!(cloud.handle().requests().iter().all(|r| {
        r.header("user-agent")
            .is_some_and(|agent| agent.starts_with("oqp/"))
    }));
    stack.shutdown().await;
    cloud.shutdown().await;
}

#[tokio::test]
async fn queue_events_from_the_data_plane_arrive_once_with_the_client_id() {
    let mut sink = Sink::start().await;
    let fake = FakeOllama::builder().model("llama3").slots(1).spawn().await;
    let yaml = format!(
        "ollama:\n  hosts:\n    - {{url: \"{}\", name: primary, max_concurrent: 1}}\n\
         queue:\n  normal:\n    max_depth: 1\n    high_watermark_pct: 100\n\
         auth:\n  enabled: true\n  keys:\n    - {{key: \"sk-batch-0123456789\", client_id: batch}}\n{}",
        fake.url(),
        sink.config(&["queue.full", "queue.high_watermark", "queue.drained"])
    );
    let stack = Stack::start(&yaml).await;
    let handle = fake.handle();
    handle.hold();
    let http = oqp_tests::client::HttpClient::new();
    let url = format!("{}/api/generate", stack.url());
    let send = || {
        let http = http.clone();
        let url = url.clone();
        tokio::spawn(async move {
            http.send(
                "POST".parse().unwrap(),
                &url,
                &[("authorization", "Bearer sk-batch-0123456789")],
                r#"{"model":"llama3","prompt":"hi","stream":false}"#,
            )
            .await
            .status
        })
    };
    let running = send();
    handle.wait_in_flight(1).await;
    let queued = send();
    let dispatcher = stack.control.dataplane().unwrap().app().dispatcher.clone();
    assert!(oqp_tests::client::eventually(PATIENCE, || dispatcher.total_depth() == 1).await);
    assert_eq!(send().await.unwrap(), 503, "the tier is full");
    handle.release_all();
    assert_eq!(running.await.unwrap(), 200);
    assert_eq!(queued.await.unwrap(), 200);

    let mut seen = Vec::new();
    while seen.len() < 3 {
        seen.push(sink.next().await);
    }
    let by_event = |name: &str| {
        seen.iter()
            .filter(|e| e["event"] == name)
            .collect::<Vec<_>>()
    };
    let watermark = by_event("queue.high_watermark");
    assert_eq!(watermark.len(), 1, "{seen:?}");
    assert_eq!(watermark[0]["tier"], "normal");
    let full = by_event("queue.full");
    assert_eq!(full.len(), 1, "{seen:?}");
    assert_eq!(
        full[0]["client_id"], "batch",
        "the client, not a request id"
    );
    assert_eq!(full[0]["node"], "local");
    assert_eq!(by_event("queue.drained").len(), 1, "{seen:?}");
    // Idle afterwards: more traffic with no backlog sends no more drained
    // events (the Python proxy sent one after every request).
    for _ in 0..3 {
        assert_eq!(send().await.unwrap(), 200);
    }
    let extra = tokio::time::timeout(Duration::from_millis(2500), sink.received.recv()).await;
    assert!(extra.is_err(), "unexpected webhook: {extra:?}");
    stack.shutdown().await;
}

#[tokio::test]
async fn resident_models_reach_the_snapshot_with_their_sizes() {
    const GIB: u64 = 1 << 30;
    let fake = FakeOllama::builder()
        .model("llama3:8b")
        .model("qwen3:8b")
        .loaded("llama3:8b")
        .vram(24 * GIB)
        .model_size("llama3:8b", 5 * GIB)
        .model_size("qwen3:8b", 6 * GIB)
        .spawn()
        .await;
    let stack = Stack::start(&format!(
        "ollama:\n  hosts:\n    \
         - {{url: \"{}\", name: gpu, model_sync_interval: 1, vram: 24GiB}}\n\
         routing:\n  model_poll_timeout: 2\n",
        fake.url()
    ))
    .await;
    let size = |name: &str, bytes: u64| wire::ModelSize {
        name: name.to_owned(),
        bytes,
    };

    // The start-up probe: the preloaded model with its VRAM, every installed
    // model with its size on disk, the configured capacity.
    let first = stack.control.hub().current();
    let gpu = host(&first, "gpu");
    assert_eq!(gpu.vram_bytes, 24 * GIB);
    assert_eq!(gpu.resident, [size("llama3:8b", 5 * GIB)]);
    let installed: Vec<&str> = gpu.sizes.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(installed, ["llama3:8b", "qwen3:8b"]);
    assert!(gpu.sizes.iter().all(|m| m.bytes > 0), "{:?}", gpu.sizes);

    // The data plane holds them under normalised names.
    stack.wait_for_version(first.version).await;
    let policy = stack
        .control
        .dataplane()
        .expect("data plane")
        .app()
        .store
        .load();
    let vram = &policy.hosts[0].vram;
    assert_eq!(vram.capacity, Some(24 * GIB));
    assert_eq!(vram.resident, [("llama3:8b".to_owned(), 5 * GIB)]);
    assert!(vram.sizes.contains_key("qwen3:8b"), "{vram:?}");

    // A model loaded by a request shows up at a later poll, beside the first.
    let http = oqp_tests::client::HttpClient::new();
    let reply = http
        .post_json(
            &format!("{}/api/generate", stack.url()),
            &[],
            &serde_json::json!({"model": "qwen3:8b", "prompt": "hi", "stream": false}),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let snapshot = wait_snapshot(&stack, "qwen3:8b resident", |s| {
        host(s, "gpu").resident.len() == 2
    })
    .await;
    assert_eq!(
        host(&snapshot, "gpu").resident,
        [size("llama3:8b", 5 * GIB), size("qwen3:8b", 6 * GIB)]
    );
    assert_eq!(
        host(&snapshot, "gpu").loaded_models,
        ["llama3:8b", "qwen3:8b"]
    );
    stack.shutdown().await;
}
