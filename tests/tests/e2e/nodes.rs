//! End to end: several data planes, each a separate process
//! ([`Cluster`]), following one control plane, in front of fake Ollamas.
//! Each host has one owner (`ollama.hosts[].node`); a data plane forwards
//! what it does not own to the owner's data plane over the node hop, so a
//! box's slots, tiers and fair share hold across every entry.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use http::Method;
use http_body_util::BodyExt;
use oqp_tests::bench::stats::jain;
use oqp_tests::client::{HttpClient, Reply};
use oqp_tests::cluster::{Cluster, ClusterBuilder};
use oqp_tests::fake::{Failure, FakeHandle, FakeOllama};
use serde_json::Value;

use crate::support::Load;

/// The node token: keys the hop's proof as well as the control-plane link.
const TOKEN: &str = "node-token-0123456789";
const ADMIN: &str = "sk-admin-0123456789";
const CHAT: &str = "sk-chat-0123456789";
const BATCH: &str = "sk-batch-0123456789";
const USER: &str = "sk-user-0123456789";
const GENERATE: &str = r#"{"model":"llama3","prompt":"hi","stream":false}"#;

/// One upstream host of a test config.
struct Host<'a> {
    url: &'a str,
    name: &'a str,
    slots: u32,
    /// Its owner; `None` for today's "every data plane owns every host".
    node: Option<&'a str>,
}

/// A config with auth on, the test keys, `hosts`, and, when `nodes` is
/// true, `nodes: {a, b}`; the node token always.
fn config(hosts: &[Host<'_>], nodes: bool, extra: &str) -> String {
    let hosts: String = hosts
        .iter()
        .map(|host| {
            let node = host
                .node
                .map(|node| format!("      node: {node}\n"))
                .unwrap_or_default();
            format!(
                "    - url: \"{}\"\n      name: {}\n      max_concurrent: {}\n{node}",
                host.url, host.name, host.slots
            )
        })
        .collect();
    let fair: String = (0..3)
        .map(|i| format!("    - key: \"{}\"\n      client_id: fair{i}\n", fair_key(i)))
        .collect();
    let nodes = if nodes {
        "nodes:\n  a: {port: 0}\n  b: {port: 0}\n"
    } else {
        ""
    };
    format!(
        r#"proxy:
  host: "127.0.0.1"
  max_concurrent: 4
ollama:
  hosts:
{hosts}{nodes}control_plane:
  node_token: "{TOKEN}"
auth:
  enabled: true
  keys:
    - key: "{ADMIN}"
      client_id: admin
      scope: management
      max_priority: high
    - key: "{CHAT}"
      client_id: chat
      max_priority: high
      default_priority: high
    - key: "{BATCH}"
      client_id: batch
      max_priority: low
      default_priority: low
    - key: "{USER}"
      client_id: user
{fair}{extra}"#
    )
}

fn fair_key(i: usize) -> String {
    format!("sk-fair-{i}-0123456789")
}

/// A cluster of nodes `a` and `b` on `yaml`.
fn cluster(yaml: &str) -> ClusterBuilder {
    Cluster::builder(env!("CARGO_BIN_EXE_oqp-bench"), yaml)
        .node("a")
        .node("b")
        .node_token(TOKEN)
        .admin_key(ADMIN)
}

/// POSTs `body` to `url` + `path` with `key` and extra headers.
async fn post(
    http: &HttpClient,
    url: &str,
    path: &str,
    key: &str,
    extra: &[(&str, &str)],
    body: &str,
) -> Reply {
    let auth = format!("Bearer {key}");
    let mut headers = vec![
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
    ];
    headers.extend_from_slice(extra);
    http.send(
        Method::POST,
        &format!("{url}{path}"),
        &headers,
        body.to_owned(),
    )
    .await
}

fn spawn_generate(http: &HttpClient, url: &str, key: &str) -> tokio::task::JoinHandle<Reply> {
    let (http, url, key) = (http.clone(), url.to_owned(), key.to_owned());
    tokio::spawn(async move { post(&http, &url, "/api/generate", &key, &[], GENERATE).await })
}

/// Requests waiting in node `node`'s queue, all tiers.
fn depth(status: &Value) -> u64 {
    ["high", "normal", "low"]
        .iter()
        .map(|tier| status["queue"][tier]["depth"].as_u64().unwrap_or(0))
        .sum()
}

/// Requests the fake has received on `path`.
fn served(handle: &FakeHandle, path: &str) -> usize {
    handle.requests_to(path).len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_runs_data_planes_as_processes_that_follow_one_control_plane() {
    let _exclusive = crate::support::exclusive().await;
    // Today's mode (no `nodes`, no owners): every data plane owns every host.
    let fake = FakeOllama::builder().model("llama3").slots(4).spawn().await;
    let yaml = config(
        &[Host {
            url: &fake.url(),
            name: "box1",
            slots: 4,
            node: None,
        }],
        false,
        "",
    );
    let mut cluster = cluster(&yaml).start().await;
    let http = HttpClient::new();
    for node in ["a", "b"] {
        let reply = post(
            &http,
            &cluster.url(node),
            "/api/generate",
            USER,
            &[],
            GENERATE,
        )
        .await;
        assert_eq!(reply.status, 200, "{node}: {}", reply.text());
    }
    assert_eq!(served(&fake.handle(), "/api/generate"), 2);
    assert_ne!(cluster.pid("a"), cluster.pid("b"), "separate processes");

    // SIGKILL, then the same node again: a new process on a new port, which
    // the control plane learns from its report.
    let old = cluster.addr("b");
    cluster.kill("b").await;
    assert!(
        tokio::net::TcpStream::connect(old).await.is_err(),
        "a killed data plane no longer listens"
    );
    let new = cluster.restart("b").await;
    let status = cluster.status().await.unwrap();
    let b = status.nodes.iter().find(|n| n.node == "b").unwrap();
    assert_eq!(b.listen_address, new.to_string());
    let reply = post(
        &http,
        &cluster.url("b"),
        "/api/generate",
        USER,
        &[],
        GENERATE,
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());

    // Without the control plane both serve on their last snapshot; started
    // again on its address, both follow it again.
    cluster.stop_control_plane().await;
    for node in ["a", "b"] {
        cluster
            .wait_queue_status(node, "the link to be down", |status| {
                status["snapshot"]["control_plane_connected"] == false
            })
            .await;
        let reply = post(
            &http,
            &cluster.url(node),
            "/api/generate",
            USER,
            &[],
            GENERATE,
        )
        .await;
        assert_eq!(reply.status, 200, "{node}: {}", reply.text());
    }
    cluster.start_control_plane().await;
    assert_eq!(served(&fake.handle(), "/api/generate"), 5);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_data_planes_never_send_one_box_more_than_its_slots() {
    let _exclusive = crate::support::exclusive().await;
    // The fake has slots to spare: only oqp can keep it at two.
    let fake = FakeOllama::builder()
        .model("llama3")
        .slots(12)
        .spawn()
        .await;
    let yaml = config(
        &[Host {
            url: &fake.url(),
            name: "box1",
            slots: 2,
            node: Some("a"),
        }],
        true,
        "",
    );
    let cluster = cluster(&yaml).start().await;
    cluster.wait_peer("b", "a").await;
    let http = HttpClient::new();
    let handle = fake.handle();
    handle.hold();
    let tasks: Vec<_> = (0..12)
        .map(|i| {
            spawn_generate(
                &http,
                &cluster.url(if i % 2 == 0 { "a" } else { "b" }),
                USER,
            )
        })
        .collect();
    tokio::time::timeout(oqp_tests::cluster::WAIT, handle.wait_in_flight(2))
        .await
        .expect("two requests in flight at the box");
    // Every other request waits in the owner's queue, wherever it entered.
    cluster
        .wait_queue_status("a", "ten requests queued at the owner", |status| {
            depth(status) == 10
        })
        .await;
    assert_eq!(handle.in_flight(), 2);
    handle.release_all();
    for task in tasks {
        let reply = task.await.unwrap();
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    assert_eq!(served(&handle, "/api/generate"), 12, "each request once");
    assert!(
        handle.peak_concurrency() <= 2,
        "peak {}",
        handle.peak_concurrency()
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_box_never_gets_more_than_its_slots_while_nodes_and_the_control_plane_come_and_go() {
    let _exclusive = crate::support::exclusive().await;
    let fake = FakeOllama::builder()
        .model("llama3")
        .slots(8)
        .latency(Duration::from_millis(10))
        .spawn()
        .await;
    let yaml = config(
        &[Host {
            url: &fake.url(),
            name: "box1",
            slots: 2,
            node: Some("a"),
        }],
        true,
        "",
    );
    let mut cluster = cluster(&yaml).start().await;
    cluster.wait_peer("b", "a").await;
    let request = |_, _| crate::support::generate(Some(USER));
    let mut owner = Load::start(cluster.addr("a"), 3, None, request);
    let mut edge = Load::start(cluster.addr("b"), 3, None, request);
    owner.wait_for_more(20).await;
    edge.wait_for_more(20).await;

    // The control plane goes away and comes back.
    cluster.stop_control_plane().await;
    owner.wait_for_more(20).await;
    edge.wait_for_more(20).await;
    cluster.start_control_plane().await;
    owner.wait_for_more(20).await;
    edge.wait_for_more(20).await;

    // The edge dies and starts again (on a new port).
    edge.stop()
        .await
        .assert_no_failures("through b, before it was killed");
    cluster.kill("b").await;
    owner.wait_for_more(20).await;
    cluster.restart("b").await;
    cluster.wait_peer("b", "a").await;
    let mut edge = Load::start(cluster.addr("b"), 3, None, request);
    edge.wait_for_more(20).await;
    owner.wait_for_more(20).await;

    edge.stop().await.assert_no_failures("through b, restarted");
    owner.stop().await.assert_no_failures("through a");
    let peak = fake.handle().peak_concurrency();
    println!("peak in flight at the box through all of it: {peak}");
    assert!(peak <= 2, "the box got {peak} requests at once");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_tier_clients_share_a_box_equally_whichever_data_plane_they_enter() {
    let _exclusive = crate::support::exclusive().await;
    let fake = FakeOllama::builder()
        .model("llama3")
        .slots(2)
        // Long enough that the GPU, not this debug build's CPU, is the
        // bottleneck (see the single-node fairness test).
        .latency(Duration::from_millis(25))
        .spawn()
        .await;
    let extra = "queue:\n  normal:\n    max_depth: 200\n";
    let yaml = config(
        &[Host {
            url: &fake.url(),
            name: "box1",
            slots: 2,
            node: Some("b"),
        }],
        true,
        extra,
    );
    let cluster = cluster(&yaml).start().await;
    cluster.wait_peer("a", "b").await;
    let http = HttpClient::new();
    // fair0 and fair1 enter through a (both forwarded), fair2 through b.
    let entries = [cluster.url("a"), cluster.url("a"), cluster.url("b")];
    let started = Instant::now();
    let deadline = started + Duration::from_secs(3);
    let mut tasks = Vec::new();
    for (client, url) in entries.iter().enumerate() {
        // A deep backlog per client: a forwarding edge that stalls for a moment
        // must not let the owner run out of its clients' requests.
        for _ in 0..12 {
            let (http, url, key) = (http.clone(), url.clone(), fair_key(client));
            tasks.push(tokio::spawn(async move {
                // The same GPU time for each (fair share is by GPU time; the shares are
                // counted in requests), whatever the machine's load made its wall time.
                let cost = [(oqp_tests::fake::USAGE_HEADER, "total_duration=25000000")];
                while Instant::now() < deadline {
                    let reply = post(&http, &url, "/api/generate", &key, &cost, GENERATE).await;
                    assert_eq!(reply.status, 200, "{}", reply.text());
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    // What the box served, counted where it was served: dispatched within
    // the window, once every client's backlog had formed.
    let window = started + Duration::from_millis(300)..deadline;
    let mut counts: HashMap<String, u32> = HashMap::new();
    for request in fake.handle().requests_to("/api/generate") {
        if window.contains(&request.received_at) {
            let client = request.header("x-client-id").unwrap_or_default();
            *counts.entry(client).or_default() += 1;
        }
    }
    let shares: Vec<f64> = (0..3)
        .map(|i| f64::from(counts.get(&format!("fair{i}")).copied().unwrap_or(0)))
        .collect();
    let index = jain(&shares);
    println!("fairness across two entries: served {shares:?}, Jain {index:.4}");
    assert_eq!(counts.len(), 3, "only the three clients: {counts:?}");
    assert!(index >= 0.97, "Jain's index {index:.4}: {shares:?}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interactive_chats_through_one_data_plane_never_wait_behind_a_flood_through_the_other() {
    let _exclusive = crate::support::exclusive().await;
    let service = Duration::from_millis(40);
    let fake = FakeOllama::builder()
        .model("llama3")
        .embedding_model("all-minilm")
        .slots(1)
        .latency(service)
        .spawn()
        .await;
    let extra = "queue:\n  low:\n    max_depth: 500\n";
    let yaml = config(
        &[Host {
            url: &fake.url(),
            name: "box1",
            slots: 1,
            node: Some("a"),
        }],
        true,
        extra,
    );
    let cluster = cluster(&yaml).start().await;
    cluster.wait_peer("b", "a").await;
    let http = HttpClient::new();
    let flood: Vec<_> = (0..60)
        .map(|i| {
            let (http, url) = (http.clone(), cluster.url("a"));
            tokio::spawn(async move {
                let body = format!(r#"{{"model":"all-minilm","input":"doc {i}"}}"#);
                post(&http, &url, "/api/embed", BATCH, &[], &body)
                    .await
                    .status
            })
        })
        .collect();
    cluster
        .wait_queue_status("a", "the flood queued", |status| depth(status) >= 30)
        .await;
    let mut waits = Vec::new();
    for _ in 0..8 {
        let reply = post(
            &http,
            &cluster.url("b"),
            "/api/generate",
            CHAT,
            &[],
            GENERATE,
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        let wait: u64 = reply
            .header("x-queue-wait-time")
            .expect("the owner's X-Queue-Wait-Time")
            .parse()
            .unwrap();
        waits.push(wait);
    }
    for task in flood {
        assert_eq!(task.await.unwrap(), 200);
    }
    let worst = waits.iter().copied().max().unwrap();
    println!(
        "high-tier chats through b behind a low flood through a: waits {waits:?} ms (service {} ms)",
        service.as_millis()
    );
    // At most the one embed holding the slot is ahead of a chat. Behind the flood a chat would
    // wait for 30 or more embeds (1,200 ms or more); the bound of 10 embeds leaves room for
    // three debug processes on a loaded 2-core machine (the benchmark measures the release
    // build: within 5 ms of one embed).
    assert!(
        worst < 10 * service.as_millis() as u64,
        "worst wait {worst} ms"
    );
    assert_eq!(fake.handle().peak_concurrency(), 1);
    cluster.shutdown().await;
}

/// Two boxes, each owned by its data plane; `qwen` on box 2 only.
async fn two_boxes() -> (FakeOllama, FakeOllama, Cluster) {
    // llama3 loaded on both: neither box is preferred for it.
    let box1 = FakeOllama::builder()
        .loaded("llama3")
        .slots(2)
        .spawn()
        .await;
    let box2 = FakeOllama::builder()
        .loaded("llama3")
        .model("qwen")
        .slots(2)
        .token_interval(Duration::from_millis(5))
        .spawn()
        .await;
    let yaml = config(
        &[
            Host {
                url: &box1.url(),
                name: "box1",
                slots: 2,
                node: Some("a"),
            },
            Host {
                url: &box2.url(),
                name: "box2",
                slots: 2,
                node: Some("b"),
            },
        ],
        true,
        "routing:\n  strategy: model_aware\n",
    );
    let cluster = cluster(&yaml).start().await;
    cluster.wait_peer("a", "b").await;
    cluster.wait_peer("b", "a").await;
    (box1, box2, cluster)
}

const QWEN_STREAM: &str = r#"{"model":"qwen","prompt":"hi","stream":true}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_on_the_other_box_is_served_there_streamed_line_by_line() {
    let _exclusive = crate::support::exclusive().await;
    let (box1, box2, cluster) = two_boxes().await;
    let http = HttpClient::new();
    let (status, _, lines) = http
        .post_lines(
            &format!("{}/api/generate", cluster.url("a")),
            &[("authorization", &format!("Bearer {USER}"))],
            &serde_json::from_str(QWEN_STREAM).unwrap(),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(lines.len(), 6, "five tokens and the done line");
    let last: Value = serde_json::from_str(&lines[5].line).unwrap();
    assert_eq!(last["done"], true);
    assert_eq!(served(&box2.handle(), "/api/generate"), 1);
    assert_eq!(served(&box1.handle(), "/api/generate"), 0);

    // Unbuffered: with the upstream silent after two lines, the client
    // already has them, while the stream is still open.
    box2.handle()
        .fail_next(Failure::StallMidStream { after_lines: 2 });
    let auth = format!("Bearer {USER}");
    let response = http
        .start(
            Method::POST,
            &format!("{}/api/generate", cluster.url("a")),
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            QWEN_STREAM,
        )
        .await;
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let mut received = Vec::new();
    let two_lines = async {
        while received.iter().filter(|b| **b == b'\n').count() < 2 {
            let frame = body.frame().await.expect("the stream is open").unwrap();
            if let Some(data) = frame.data_ref() {
                received.extend_from_slice(data);
            }
        }
    };
    tokio::time::timeout(oqp_tests::cluster::WAIT, two_lines)
        .await
        .expect("the first two lines arrive while the upstream holds the rest");
    let first: Value =
        serde_json::from_slice(received.split(|b| *b == b'\n').next().unwrap()).unwrap();
    assert_eq!(first["done"], false);
    drop(body);
    // The client's departure reaches the box through both data planes.
    tokio::time::timeout(oqp_tests::cluster::WAIT, box2.handle().wait_cancelled(1))
        .await
        .expect("the stalled upstream request is cancelled");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_stream_cut_by_the_owners_death_ends_with_an_error_line_and_is_not_sent_again()
{
    let _exclusive = crate::support::exclusive().await;
    let (box1, box2, mut cluster) = two_boxes().await;
    let http = HttpClient::new();
    box2.handle()
        .fail_next(Failure::StallMidStream { after_lines: 2 });
    let auth = format!("Bearer {USER}");
    let response = http
        .start(
            Method::POST,
            &format!("{}/api/generate", cluster.url("a")),
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            QWEN_STREAM,
        )
        .await;
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let mut received = Vec::new();
    let mut read_lines = async |n: usize, received: &mut Vec<u8>| {
        while received.iter().filter(|b| **b == b'\n').count() < n {
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        received.extend_from_slice(data);
                    }
                }
                _ => return false,
            }
        }
        true
    };
    let two = tokio::time::timeout(oqp_tests::cluster::WAIT, read_lines(2, &mut received))
        .await
        .expect("the first two lines arrive");
    assert!(two);
    // The owner dies mid-stream.
    cluster.kill("b").await;
    let rest = tokio::time::timeout(
        oqp_tests::cluster::WAIT,
        read_lines(usize::MAX, &mut received),
    )
    .await
    .expect("the stream ends once its owner is gone");
    assert!(!rest, "the stream ends");
    let text = String::from_utf8_lossy(&received).into_owned();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "two lines, then the error line: {text}");
    let last: Value = serde_json::from_str(lines[2]).unwrap();
    assert!(last["error"].is_string(), "{text}");
    assert_eq!(served(&box2.handle(), "/api/generate"), 1);
    assert_eq!(
        served(&box1.handle(), "/api/generate"),
        0,
        "never sent anywhere again"
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_owner_is_skipped_without_a_failed_request_and_used_again_when_back() {
    let _exclusive = crate::support::exclusive().await;
    let (box1, box2, mut cluster) = two_boxes().await;
    let http = HttpClient::new();
    // Both boxes serve llama3 while both owners run.
    let deadline = Instant::now() + oqp_tests::cluster::WAIT;
    let both = || {
        served(&box1.handle(), "/api/generate") > 0 && served(&box2.handle(), "/api/generate") > 0
    };
    while !both() && Instant::now() < deadline {
        let reply = post(
            &http,
            &cluster.url("a"),
            "/api/generate",
            USER,
            &[],
            GENERATE,
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    assert!(both(), "both boxes take llama3 requests entering at a");

    cluster.kill("b").await;
    let before = (
        served(&box1.handle(), "/api/generate"),
        served(&box2.handle(), "/api/generate"),
    );
    for i in 0..20 {
        let reply = post(
            &http,
            &cluster.url("a"),
            "/api/generate",
            USER,
            &[],
            GENERATE,
        )
        .await;
        assert_eq!(
            reply.status,
            200,
            "request {i} after the kill: {}",
            reply.text()
        );
    }
    assert_eq!(
        served(&box1.handle(), "/api/generate"),
        before.0 + 20,
        "box 1 took them all"
    );
    assert_eq!(
        served(&box2.handle(), "/api/generate"),
        before.1,
        "nothing reached box 2"
    );
    // What only box 2 has is unavailable meanwhile: as with a single box
    // whose host is down, the healthy host without the model answers (404).
    let qwen = post(
        &http,
        &cluster.url("a"),
        "/api/generate",
        USER,
        &[],
        r#"{"model":"qwen","prompt":"hi","stream":false}"#,
    )
    .await;
    assert!(
        !qwen.status.is_success(),
        "{}: {}",
        qwen.status,
        qwen.text()
    );

    // Back on a new port: used again, with no command.
    cluster.restart("b").await;
    cluster.wait_peer("a", "b").await;
    let qwen = post(
        &http,
        &cluster.url("a"),
        "/api/generate",
        USER,
        &[],
        r#"{"model":"qwen","prompt":"hi","stream":false}"#,
    )
    .await;
    assert_eq!(qwen.status, 200, "{}", qwen.text());
    // Loads are a report old: one taken while box 2 was busy makes it look
    // busier for a moment, so this sends until box 2 is used, under a
    // deadline, rather than a fixed number.
    let before = served(&box2.handle(), "/api/generate");
    let mut back = false;
    let deadline = Instant::now() + oqp_tests::cluster::WAIT;
    while !back && Instant::now() < deadline {
        let reply = post(
            &http,
            &cluster.url("a"),
            "/api/generate",
            USER,
            &[],
            GENERATE,
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        back = served(&box2.handle(), "/api/generate") > before;
    }
    assert!(back, "box 2 takes llama3 requests again");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_hop_gains_no_identity_or_tier_and_never_reaches_ollama() {
    let _exclusive = crate::support::exclusive().await;
    let fake = FakeOllama::builder().model("llama3").slots(2).spawn().await;
    let yaml = config(
        &[Host {
            url: &fake.url(),
            name: "box1",
            slots: 2,
            node: Some("a"),
        }],
        true,
        "",
    );
    let cluster = cluster(&yaml).start().await;
    cluster.wait_peer("b", "a").await;
    let http = HttpClient::new();
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    // One in the hop's own format (node b, client admin, high tier, now)
    // with a signature made without the node token, and one malformed.
    let well_formed = format!(
        "v1;n=62;c=61646d696e;v=1;t=high;ts={ts};s={}",
        "00".repeat(32)
    );
    let malformed = "v1;node=b;client=admin;tier=high".to_owned();
    for (node, forged) in [
        ("a", &well_formed),
        ("b", &well_formed),
        ("a", &malformed),
        ("b", &malformed),
    ] {
        // Without a key, and with the low-tier batch key.
        let plain = http
            .send(
                Method::POST,
                &format!("{}/api/generate", cluster.url(node)),
                &[("x-oqp-hop", forged), ("content-type", "application/json")],
                GENERATE,
            )
            .await;
        let keyed = post(
            &http,
            &cluster.url(node),
            "/api/generate",
            BATCH,
            &[("x-oqp-hop", forged), ("x-queue-priority", "high")],
            GENERATE,
        )
        .await;
        for reply in [plain, keyed] {
            assert_eq!(reply.status, 401, "{node}: {}", reply.text());
            assert_eq!(reply.json()["error"], "node hop not verified", "{node}");
        }
    }
    assert_eq!(
        served(&fake.handle(), "/api/generate"),
        0,
        "no forged request reached Ollama"
    );

    // A real hop: the owner serves the client it proves, with its own tier,
    // and the hop's header stops at the owner.
    let reply = post(
        &http,
        &cluster.url("b"),
        "/api/generate",
        BATCH,
        &[("x-queue-priority", "high")],
        GENERATE,
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let upstream = fake.handle().requests_to("/api/generate");
    assert_eq!(upstream.len(), 1);
    assert_eq!(upstream[0].header("x-client-id").as_deref(), Some("batch"));
    for request in fake.handle().requests() {
        assert!(
            request.header("x-oqp-hop").is_none(),
            "the hop header reached Ollama: {request:?}"
        );
        assert!(request.header("authorization").is_none());
    }
    let status = cluster.queue_status("a").await.unwrap();
    assert_eq!(status["clients"]["batch"]["processed"], 1, "{status:#}");
    assert_eq!(
        status["queue"]["low"]["processed"], 1,
        "queued at its ceiling, not the tier it asked for: {status:#}"
    );
    assert!(
        status["clients"]
            .get("admin")
            .is_none_or(|admin| admin["processed"] == 0)
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_control_plane_both_data_planes_keep_serving_and_forwarding() {
    let _exclusive = crate::support::exclusive().await;
    let fake = FakeOllama::builder().model("llama3").slots(2).spawn().await;
    let yaml = config(
        &[Host {
            url: &fake.url(),
            name: "box1",
            slots: 2,
            node: Some("a"),
        }],
        true,
        "",
    );
    let mut cluster = cluster(&yaml).start().await;
    cluster.wait_peer("b", "a").await;
    cluster.stop_control_plane().await;
    let http = HttpClient::new();
    for node in ["a", "b"] {
        cluster
            .wait_queue_status(node, "the link to be down", |status| {
                status["snapshot"]["control_plane_connected"] == false
            })
            .await;
    }
    for i in 0..6 {
        let node = if i % 2 == 0 { "a" } else { "b" };
        let reply = post(
            &http,
            &cluster.url(node),
            "/api/generate",
            USER,
            &[],
            GENERATE,
        )
        .await;
        assert_eq!(reply.status, 200, "{node}: {}", reply.text());
    }
    assert_eq!(served(&fake.handle(), "/api/generate"), 6);
    let status = cluster.queue_status("b").await.unwrap();
    let forwarded: u64 = status["node"]["peers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|peer| peer["node"] == "a")
        .filter_map(|peer| peer["forwarded"].as_u64())
        .sum();
    assert!(forwarded >= 3, "b forwarded its requests to a: {status:#}");
    cluster.start_control_plane().await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_id_is_the_same_on_both_hops() {
    let _exclusive = crate::support::exclusive().await;
    let fake = FakeOllama::builder().model("llama3").slots(2).spawn().await;
    let yaml = config(
        &[Host {
            url: &fake.url(),
            name: "box1",
            slots: 2,
            node: Some("a"),
        }],
        true,
        "",
    );
    let cluster = cluster(&yaml).start().await;
    cluster.wait_peer("b", "a").await;
    let http = HttpClient::new();
    // One the edge makes up, and one the client brings.
    let made = post(
        &http,
        &cluster.url("b"),
        "/api/generate",
        USER,
        &[],
        GENERATE,
    )
    .await;
    assert_eq!(made.status, 200, "{}", made.text());
    let brought = post(
        &http,
        &cluster.url("b"),
        "/api/generate",
        USER,
        &[("x-request-id", "client-chosen-id-42")],
        GENERATE,
    )
    .await;
    assert_eq!(brought.status, 200, "{}", brought.text());
    assert_eq!(
        brought.header("x-request-id").as_deref(),
        Some("client-chosen-id-42")
    );
    let upstream = fake.handle().requests_to("/api/generate");
    for (reply, request) in [made, brought].iter().zip(&upstream) {
        let id = reply
            .header("x-request-id")
            .expect("every answer has an id");
        // The owner's own headers came back through the edge.
        assert!(reply.header("x-queue-wait-time").is_some());
        assert_eq!(reply.header("x-failover-host").as_deref(), Some("box1"));
        assert_eq!(
            request.header("x-request-id").as_deref(),
            Some(id.as_str()),
            "the owner sent upstream the edge's id"
        );
    }
    cluster.shutdown().await;
}

#[tokio::test]
async fn every_host_names_a_listed_owner_when_there_are_several_nodes() {
    let yaml = config(
        &[
            Host {
                url: "http://127.0.0.1:9",
                name: "box1",
                slots: 1,
                node: Some("a"),
            },
            Host {
                url: "http://127.0.0.1:9",
                name: "box2",
                slots: 1,
                node: None,
            },
            Host {
                url: "http://127.0.0.1:9",
                name: "box3",
                slots: 1,
                node: Some("c"),
            },
        ],
        true,
        "routing:\n  require_host_at_start: false\n",
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yml");
    std::fs::write(&path, yaml).unwrap();
    let error =
        oqp_tests::harness::start_control_plane(&path, oqp_tests::harness::loopback().await)
            .await
            .expect_err("a config error");
    let text = error.to_string();
    assert!(text.contains("ollama.hosts[1].node"), "{text}");
    assert!(text.contains("ollama.hosts[2].node"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apps_user_keeps_its_identity_across_the_hop() {
    let _exclusive = crate::support::exclusive().await;
    let box1 = FakeOllama::builder().loaded("llama3").spawn().await;
    let box2 = FakeOllama::builder().model("qwen").spawn().await;
    let extra = "    - key: \"sk-webui-0123456789\"\n      client_id: webui\n      \
                 users: {header: X-OpenWebUI-User-Id, max_concurrent: 1}\n\
                 routing:\n  strategy: model_aware\n";
    let yaml = config(
        &[
            Host {
                url: &box1.url(),
                name: "box1",
                slots: 2,
                node: Some("a"),
            },
            Host {
                url: &box2.url(),
                name: "box2",
                slots: 2,
                node: Some("b"),
            },
        ],
        true,
        extra,
    );
    let cluster = cluster(&yaml).start().await;
    cluster.wait_peer("a", "b").await;
    let http = HttpClient::new();
    let qwen = r#"{"model":"qwen","prompt":"hi","stream":false}"#;
    let reply = post(
        &http,
        &cluster.url("a"),
        "/api/generate",
        "sk-webui-0123456789",
        &[("x-openwebui-user-id", "alice")],
        qwen,
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let seen = box2.handle().requests_to("/api/generate");
    assert_eq!(
        seen.len(),
        1,
        "served by the owner of the box with the model"
    );
    assert_eq!(
        seen[0].header("x-client-id").as_deref(),
        Some("webui/alice")
    );
    assert!(seen[0].header("x-openwebui-user-id").is_none());
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_data_planes_keep_each_runner_within_its_slots() {
    let _exclusive = crate::support::exclusive().await;
    // The box runs each model with one slot; it would take more at once if sent.
    let fake = FakeOllama::builder()
        .model("llama3")
        .model("qwen")
        .runners(1)
        .slots(12)
        .spawn()
        .await;
    let yaml = config(
        &[Host {
            url: &fake.url(),
            name: "box1",
            slots: 4,
            node: Some("a"),
        }],
        true,
        "",
    )
    .replace(
        "      max_concurrent: 4\n      node: a\n",
        "      max_concurrent: 4\n      num_parallel: 1\n      node: a\n",
    );
    assert!(yaml.contains("num_parallel: 1"));
    let cluster = cluster(&yaml).start().await;
    cluster.wait_peer("b", "a").await;
    let http = HttpClient::new();
    let handle = fake.handle();
    handle.hold();
    let body = |model: &str| format!(r#"{{"model":"{model}","prompt":"hi","stream":false}}"#);
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let (http, url) = (
                http.clone(),
                cluster.url(if i % 2 == 0 { "a" } else { "b" }),
            );
            let body = body(if i < 4 { "llama3" } else { "qwen" });
            tokio::spawn(async move { post(&http, &url, "/api/generate", USER, &[], &body).await })
        })
        .collect();
    // One per runner at the box; the rest wait in the owner's queue, wherever they entered.
    tokio::time::timeout(oqp_tests::cluster::WAIT, handle.wait_in_flight(2))
        .await
        .expect("one request per runner at the box");
    cluster
        .wait_queue_status("a", "six requests queued at the owner", |status| {
            depth(status) == 6
        })
        .await;
    handle.release_all();
    for task in tasks {
        let reply = task.await.unwrap();
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    assert_eq!(handle.runner_peak("llama3"), 1);
    assert_eq!(handle.runner_peak("qwen"), 1);
    assert_eq!(handle.runner_peak_waiting("llama3"), 0);
    assert_eq!(handle.runner_peak_waiting("qwen"), 0);
    cluster.shutdown().await;
}
