//! Host ownership with the data planes in this process (the suites in
//! `nodes` run them as separate processes): one box owned by node `b`, the
//! single-box plane `local` as an edge that forwards to it.

use std::time::Duration;

use oqp_tests::client::{HttpClient, eventually};
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::Stack;
use serde_json::json;

const TOKEN: &str = "node-token-for-tests";

fn owned_by_b(fake: &str) -> String {
    format!(
        "control_plane: {{node_token: {TOKEN}}}\nnodes: {{local: {{port: 0}}, b: {{port: 0}}}}\n\
         proxy: {{max_concurrent: 2}}\nollama:\n  hosts:\n    - {{url: \"{fake}\", name: gpu, node: b}}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_forwards_to_the_owner_and_the_box_never_gets_more_than_its_slots() {
    let _exclusive = crate::support::exclusive().await;
    let fake = FakeOllama::builder()
        .model("llama3")
        .slots(8)
        .latency(Duration::from_millis(30))
        .spawn()
        .await;
    let stack = Stack::start(&owned_by_b(&fake.url())).await;
    let b = stack
        .start_dataplane("b", Some(TOKEN))
        .await
        .expect("node b starts");
    let edge = stack.control.dataplane().expect("local data plane");
    let peers = edge.app().peers.clone();
    let policy = edge.app().store.load();
    assert!(
        eventually(Duration::from_secs(10), || peers
            .url(&policy, "b")
            .is_some())
        .await,
        "the edge learns where b is"
    );
    let http = HttpClient::new();
    let request = json!({"model": "llama3", "prompt": "hi", "stream": false});
    let entries = [stack.url(), format!("http://{}", b.local_addr())];
    let sends = (0..12).map(|n| {
        let url = format!("{}/api/generate", entries[n % 2]);
        let http = &http;
        let request = &request;
        async move {
            http.post_json(&url, &[("x-request-id", &format!("req-{n}"))], request)
                .await
        }
    });
    let replies = futures_util::future::join_all(sends).await;
    for (n, reply) in replies.iter().enumerate() {
        assert_eq!(reply.status, 200, "request {n}: {}", reply.text());
        assert_eq!(reply.header("x-failover-host").as_deref(), Some("gpu"));
        assert_eq!(reply.header("x-request-id"), Some(format!("req-{n}")));
        assert!(reply.header("x-queue-wait-time").is_some());
        assert!(
            reply.header("x-oqp-hop").is_none() && reply.header("x-oqp-hop-elapsed-us").is_none()
        );
    }
    assert!(
        fake.handle().peak_concurrency() <= 2,
        "peak {}",
        fake.handle().peak_concurrency()
    );
    let recorded = fake.handle().requests_to("/api/generate");
    assert_eq!(recorded.len(), 12, "each request reached the box once");
    for request in &recorded {
        assert!(
            !request
                .headers
                .keys()
                .any(|name| name.as_str().starts_with("x-oqp")),
            "hop headers never reach Ollama: {:?}",
            request.headers
        );
    }
    let status = http
        .get(&format!("{}/queue/status", stack.url()), &[])
        .await
        .json();
    assert_eq!(status["node"]["name"], "local");
    assert_eq!(status["node"]["owns"], json!([]));
    assert_eq!(status["node"]["peers"][0]["node"], "b");
    assert_eq!(status["node"]["peers"][0]["forwarded"], 6);
    b.shutdown().await;
    stack.shutdown().await;
}

#[tokio::test]
async fn a_forged_hop_gains_nothing() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&owned_by_b(&fake.url())).await;
    let b = stack
        .start_dataplane("b", Some(TOKEN))
        .await
        .expect("node b starts");
    let http = HttpClient::new();
    let url = format!("http://{}/api/generate", b.local_addr());
    let request = json!({"model": "llama3", "prompt": "hi", "stream": false});
    for forged in ["v1;n=6c6f63616c;c=61646d696e;v=1;t=high;ts=1;s=00", "admin"] {
        let reply = http
            .post_json(&url, &[("x-oqp-hop", forged)], &request)
            .await;
        assert_eq!(reply.status, 401, "{}", reply.text());
        assert_eq!(reply.json()["error"], "node hop not verified");
    }
    assert!(fake.handle().requests_to("/api/generate").is_empty());
    b.shutdown().await;
    stack.shutdown().await;
}
