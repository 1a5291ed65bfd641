//! End to end: the snapshot's life when something goes wrong. A snapshot
//! with an out-of-range value is rejected and reported, never panics; a part
//! that fails to apply one is reported and does not stop the next (a pause
//! still takes effect); versions move forward across a control-plane restart
//! with its clock set back; an injection listener whose port is taken opens
//! once the port is free.
//!
//! Where a test must send what a real control plane would refuse to build,
//! it serves the data plane from a scripted `PolicyService` below: the same
//! wire contract, with snapshots published by the test.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::Stream;
use oqp_controlplane::compile::{self, Inventory, Runtime};
use oqp_controlplane::config::{self, Env};
use oqp_controlplane::hub::Clock;
use oqp_controlplane::{ControlPlane, Options};
use oqp_proto::admin::v1 as admin;
use oqp_proto::policy::v1::policy_service_server::{PolicyService, PolicyServiceServer};
use oqp_proto::policy::v1::{NodeHello, NodeReport, PolicySnapshot, ReportAck};
use oqp_tests::client::{HttpClient, Reply, eventually};
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::{self, ConfigYaml, Host, Key, Stack};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::CancellationToken;

const GENERATE: &str = r#"{"model":"llama3","prompt":"hi","stream":false}"#;

fn config(url: &str, extra: &str) -> String {
    ConfigYaml::new()
        .host(Host::ollama("primary", url))
        .key(Key::new("sk-batch-0123456789", "batch").set("max_priority", "low"))
        .key(
            Key::new("sk-admin-0123456789", "admin")
                .set("scope", "management")
                .set("max_priority", "high"),
        )
        .raw(extra)
        .yaml()
}

/// A low-tier generate through `base`.
async fn low_generate(base: &str) -> Reply {
    HttpClient::new()
        .send(
            "POST".parse().unwrap(),
            &format!("{base}/api/generate"),
            &[("authorization", "Bearer sk-batch-0123456789")],
            GENERATE,
        )
        .await
}

async fn pause_low(base: &str) -> Reply {
    HttpClient::new()
        .send(
            "POST".parse().unwrap(),
            &format!("{base}/queue/pause?tier=low"),
            &[("authorization", "Bearer sk-admin-0123456789")],
            "",
        )
        .await
}

fn assert_paused(reply: &Reply) {
    assert_eq!(
        reply.status,
        503,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(reply.json()["error"], "queue tier 'low' is paused");
}

/// Serves whatever snapshot the test publishes, unchecked, and keeps the
/// last report.
#[derive(Clone)]
struct ScriptedApi {
    snapshots: Arc<watch::Sender<PolicySnapshot>>,
    reports: Arc<watch::Sender<NodeReport>>,
}

type SnapshotStream = Pin<Box<dyn Stream<Item = Result<PolicySnapshot, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl PolicyService for ScriptedApi {
    type WatchPolicyStream = SnapshotStream;

    async fn watch_policy(
        &self,
        _: tonic::Request<NodeHello>,
    ) -> Result<tonic::Response<SnapshotStream>, tonic::Status> {
        let stream = WatchStream::new(self.snapshots.subscribe()).map(Ok);
        Ok(tonic::Response::new(Box::pin(stream)))
    }

    async fn report_status(
        &self,
        request: tonic::Request<NodeReport>,
    ) -> Result<tonic::Response<ReportAck>, tonic::Status> {
        self.reports.send_replace(request.into_inner());
        Ok(tonic::Response::new(ReportAck::default()))
    }
}

/// A scripted control plane on loopback.
struct Scripted {
    api: ScriptedApi,
    config: config::Config,
    addr: SocketAddr,
    stop: CancellationToken,
}

impl Scripted {
    /// Serves `yaml`'s snapshot at version 1000.
    async fn start(yaml: &str) -> Scripted {
        let config = config::load_str(yaml, &Env::empty()).unwrap().config;
        let first = compile::snapshot(&config, &Runtime::default(), &Default::default(), &[], 1000);
        let api = ScriptedApi {
            snapshots: Arc::new(watch::channel(first).0),
            reports: Arc::new(watch::channel(NodeReport::default()).0),
        };
        let listener = harness::loopback().await;
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let server = tonic::transport::Server::builder()
            .add_service(PolicyServiceServer::new(api.clone()))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                stop.clone().cancelled_owned(),
            );
        tokio::spawn(server);
        Scripted {
            api,
            config,
            addr,
            stop,
        }
    }

    /// The config's snapshot at `version` with `runtime`, edited by `edit`.
    fn publish(&self, version: u64, runtime: &Runtime, edit: impl FnOnce(&mut PolicySnapshot)) {
        let inventory: std::collections::HashMap<String, Inventory> = Default::default();
        let mut snapshot = compile::snapshot(&self.config, runtime, &inventory, &[], version);
        edit(&mut snapshot);
        self.api.snapshots.send_replace(snapshot);
    }

    /// Waits (10 s at most) for a report that satisfies `check`.
    async fn report_where(&self, check: impl Fn(&NodeReport) -> bool) -> NodeReport {
        let mut reports = self.api.reports.subscribe();
        let report = tokio::time::timeout(Duration::from_secs(10), reports.wait_for(|r| check(r)))
            .await
            .expect("no such report within 10 s")
            .unwrap();
        report.clone()
    }
}

fn low_paused() -> Runtime {
    Runtime {
        paused: [false, false, true],
        ..Runtime::default()
    }
}

#[tokio::test]
async fn a_snapshot_with_a_huge_ttl_is_rejected_and_a_later_pause_still_applies() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let control = Scripted::start(&config(&fake.url(), "")).await;
    let dataplane = harness::start_dataplane(&format!("http://{}", control.addr), "edge", None)
        .await
        .unwrap();
    let base = format!("http://{}", dataplane.local_addr());

    // What `embedding_cache.ttl: 40000000000` once compiled to, sent as is.
    control.publish(1001, &Runtime::default(), |snapshot| {
        let cache = snapshot.embedding_cache.as_mut().unwrap();
        cache.enabled = true;
        cache.ttl_seconds = 40_000_000_000;
    });
    let report = control.report_where(|r| r.rejected_version == 1001).await;
    assert!(
        report
            .rejected_reason
            .contains("embedding_cache.ttl_seconds"),
        "{}",
        report.rejected_reason
    );
    assert_eq!(report.applied_version, 1000, "the working snapshot stays");
    assert_eq!(low_generate(&base).await.status, 200);

    control.publish(1002, &low_paused(), |_| {});
    harness::wait_for_version(&dataplane, 1002).await;
    assert_paused(&low_generate(&base).await);
    dataplane.shutdown().await;
    control.stop.cancel();
}

#[tokio::test]
async fn a_part_that_panics_is_reported_and_the_next_snapshot_still_applies() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), "")).await;
    // The binary's log hook stands for any part that fails: it panics on
    // `debug`, and the dispatcher, metrics and cache must not care.
    let hook = oqp_dataplane::LogLevelHook::new(|level| {
        assert_ne!(level, oqp_dataplane::policy::LogLevel::Debug, "hook failed");
    });
    let dataplane = harness::start_dataplane_with(
        &stack.control_url(),
        "edge",
        Some(stack.control.node_token()),
        Some(hook),
    )
    .await
    .unwrap();
    let base = format!("http://{}", dataplane.local_addr());

    let version = stack
        .rewrite_and_reload(&config(&fake.url(), "logging:\n  level: debug\n"))
        .unwrap();
    harness::wait_for_version(&dataplane, version).await;
    let hub = stack.control.hub().clone();
    let reported = eventually(Duration::from_secs(10), || {
        hub.nodes().get("edge").is_some_and(|node| {
            node.report
                .apply_errors
                .iter()
                .any(|e| e.starts_with("log level: snapshot") && e.contains("hook failed"))
        })
    })
    .await;
    assert!(
        reported,
        "{:?}",
        hub.nodes().get("edge").map(|n| &n.report.apply_errors)
    );

    // Visible in the admin status (`oqpctl status`).
    let mut admin = admin::admin_service_client::AdminServiceClient::connect(stack.control_url())
        .await
        .unwrap();
    let mut request = tonic::Request::new(admin::GetStatusRequest::default());
    request.metadata_mut().insert(
        "authorization",
        "Bearer sk-admin-0123456789".parse().unwrap(),
    );
    let status = admin.get_status(request).await.unwrap().into_inner();
    assert!(
        status
            .warnings
            .iter()
            .any(|w| w.contains("edge") && w.contains("log level")),
        "{:?}",
        status.warnings
    );

    // The pause after it reaches every part of the node.
    assert_eq!(pause_low(&base).await.status, 200);
    harness::wait_for_version(&dataplane, hub.current().version).await;
    assert_paused(&low_generate(&base).await);
    // The hook still fails, and is still reported, with the next snapshot.
    let version = hub.current().version;
    let still = eventually(Duration::from_secs(10), || {
        hub.nodes().get("edge").is_some_and(|node| {
            node.report.applied_version == version
                && node
                    .report
                    .apply_errors
                    .iter()
                    .any(|e| e.starts_with(&format!("log level: snapshot {version}")))
        })
    })
    .await;
    assert!(
        still,
        "{:?}",
        hub.nodes().get("edge").map(|n| &n.report.apply_errors)
    );
    dataplane.shutdown().await;
    stack.shutdown().await;
}

#[tokio::test]
async fn a_stale_stream_is_flagged_in_the_report() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let control = Scripted::start(&config(&fake.url(), "")).await;
    let dataplane = harness::start_dataplane(&format!("http://{}", control.addr), "edge", None)
        .await
        .unwrap();
    control.publish(900, &low_paused(), |_| {});
    let report = control.report_where(|r| r.stale_version == 900).await;
    assert_eq!(report.applied_version, 1000);
    let status = HttpClient::new()
        .get(
            &format!("http://{}/queue/status", dataplane.local_addr()),
            &[("authorization", "Bearer sk-batch-0123456789")],
        )
        .await
        .json();
    assert_eq!(status["snapshot"]["stale_version"], 900, "{status}");
    control.publish(1001, &Runtime::default(), |_| {});
    control
        .report_where(|r| r.applied_version == 1001 && r.stale_version == 0)
        .await;
    dataplane.shutdown().await;
    control.stop.cancel();
}

#[tokio::test]
async fn a_control_plane_restarted_with_its_clock_set_back_is_still_obeyed() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("config.yml");
    // No state directory: the data plane's version is all the new control
    // plane can learn from (and a configured node token is what both runs accept).
    let yaml = format!(
        "{}control_plane:\n  node_token: sk-node-0123456789\n",
        config(&fake.url(), "")
    );
    std::fs::write(&config_path, yaml).unwrap();
    let start = |listener: TcpListener, clock: Option<Clock>| {
        ControlPlane::start(Options {
            config_path: config_path.clone(),
            env: Env::empty(),
            listener: Some(listener),
            with_dataplane: false,
            dataplane_listener: None,
            clock,
        })
    };
    let control = start(harness::loopback().await, None).await.unwrap();
    let addr = control.local_addr();
    let dataplane = harness::start_dataplane(
        &format!("http://{addr}"),
        "edge",
        Some(control.node_token()),
    )
    .await
    .unwrap();
    let held = dataplane.app().store.load().version;
    let base = format!("http://{}", dataplane.local_addr());
    control.shutdown().await;

    let a_day_ago = SystemTime::now() - Duration::from_secs(86_400);
    let control = start(
        TcpListener::bind(addr).await.unwrap(),
        Some(Clock::new(move || a_day_ago)),
    )
    .await
    .unwrap();
    let link = dataplane.app().control.clone();
    assert!(
        eventually(Duration::from_secs(15), || link.is_connected()).await,
        "the data plane reconnected"
    );
    assert_eq!(pause_low(&base).await.status, 200);
    harness::wait_for_version(&dataplane, control.hub().current().version).await;
    assert_paused(&low_generate(&base).await);
    assert!(dataplane.app().store.load().version > held);
    assert_eq!(link.stale_version(), 0);
    dataplane.shutdown().await;
    control.shutdown().await;
}

#[tokio::test]
async fn an_injection_listener_whose_port_is_taken_opens_once_it_is_free() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = squatter.local_addr().unwrap().port();
    let extra = format!(
        "client_injection:\n  listeners:\n    - {{listen_port: {port}, inject_as: batch, bind: 127.0.0.1}}\n"
    );
    let stack = Stack::start(&config(&fake.url(), &extra)).await;
    let store = stack.control.dataplane().unwrap().app().store.clone();
    let failing = eventually(Duration::from_secs(10), || {
        store
            .failures()
            .iter()
            .any(|f| f.contains(&format!("127.0.0.1:{port}")) && f.contains("cannot bind"))
    })
    .await;
    assert!(failing, "{:?}", store.failures());

    drop(squatter);
    // No new snapshot: the retry alone must open it. Each probe is bounded.
    let url = format!("http://127.0.0.1:{port}/api/tags");
    let http = HttpClient::new();
    let mut opened = false;
    for _ in 0..200 {
        let probe = tokio::time::timeout(Duration::from_millis(500), http.get(&url, &[]));
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
            && let Ok(reply) = probe.await
        {
            assert_eq!(reply.status, 200);
            opened = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(opened, "the injection listener never opened");
    assert!(store.failures().is_empty(), "{:?}", store.failures());
    stack.shutdown().await;
}

#[tokio::test]
async fn a_restart_with_the_clock_set_back_and_no_data_plane_still_moves_forward() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let config_path = dir.path().join("config.yml");
    let yaml = format!(
        "{}control_plane:\n  state_dir: \"{}\"\n",
        config(&fake.url(), ""),
        state.display()
    );
    std::fs::write(&config_path, yaml).unwrap();
    let start = |clock: Option<Clock>| {
        let config_path = config_path.clone();
        async move {
            ControlPlane::start(Options {
                config_path,
                env: Env::empty(),
                listener: Some(harness::loopback().await),
                with_dataplane: false,
                dataplane_listener: None,
                clock,
            })
            .await
            .unwrap()
        }
    };
    let control = start(None).await;
    let version = control.hub().update_runtime(|_| {});
    let saved = state.join("version");
    let written = eventually(Duration::from_secs(10), || {
        std::fs::read_to_string(&saved).is_ok_and(|text| text.trim() == version.to_string())
    })
    .await;
    assert!(written, "the version was saved");
    control.shutdown().await;

    let a_day_ago = SystemTime::now() - Duration::from_secs(86_400);
    let control = start(Some(Clock::new(move || a_day_ago))).await;
    assert!(control.hub().current().version > version);
    control.shutdown().await;
}

#[tokio::test]
async fn a_cache_backend_that_cannot_be_reached_on_reload_is_reported() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), "")).await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let cache = format!(
        "embedding_cache:\n  enabled: true\n  backend: \"redis://:hunter2@127.0.0.1:{port}/0\"\n  connect_timeout: 0.2\n"
    );
    let version = stack
        .rewrite_and_reload(&config(&fake.url(), &cache))
        .unwrap();
    stack.wait_for_version(version).await;
    let store = stack.control.dataplane().unwrap().app().store.clone();
    let reported = eventually(Duration::from_secs(10), || {
        store
            .failures()
            .iter()
            .any(|f| f.starts_with("embedding cache: snapshot") && f.contains("unreachable"))
    })
    .await;
    assert!(reported, "{:?}", store.failures());
    assert!(store.failures().iter().all(|f| !f.contains("hunter2")));
    stack.shutdown().await;
}

/// A cache backend that takes its whole `connect_timeout` to fail (here: a
/// socket that accepts and never answers) does not hold back the snapshots
/// after it: a pause published meanwhile is applied at once.
#[tokio::test]
async fn a_cache_backend_that_hangs_on_connect_does_not_delay_a_later_pause() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), "")).await;
    // The kernel completes the handshake; nobody ever reads or answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let cache = format!(
        "embedding_cache:\n  enabled: true\n  backend: \"redis://127.0.0.1:{port}/0\"\n  connect_timeout: 1h\n"
    );
    let version = stack
        .rewrite_and_reload(&config(&fake.url(), &cache))
        .unwrap();
    stack.wait_for_version(version).await;
    let paused = pause_low(&stack.url()).await;
    assert_eq!(paused.status, 200, "{}", paused.text());
    assert_paused(&low_generate(&stack.url()).await);
    drop(silent);
    stack.shutdown().await;
}
