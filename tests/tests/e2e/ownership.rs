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

/// The stack on `yaml` (its in-process plane `local` as the edge) and node `b`'s data plane,
/// once the edge knows where `b` is.
async fn edge_and_b(yaml: &str) -> (Stack, oqp_dataplane::DataPlane) {
    let stack = Stack::start(yaml).await;
    let b = stack
        .start_dataplane("b", Some(TOKEN))
        .await
        .expect("node b starts");
    let edge = stack.control.dataplane().expect("local data plane");
    let (peers, policy) = (edge.app().peers.clone(), edge.app().store.load());
    assert!(
        eventually(Duration::from_secs(10), || peers
            .url(&policy, "b")
            .is_some())
        .await,
        "the edge learns where b is"
    );
    (stack, b)
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
    let (stack, b) = edge_and_b(&owned_by_b(&fake.url())).await;
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
    let (stack, b) = edge_and_b(&owned_by_b(&fake.url())).await;
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

/// A TLS terminator on `127.0.0.1:0` in front of `backend`, with a certificate for
/// 127.0.0.1 issued by a fresh CA; returns its port and the CA's PEM.
async fn tls_front(backend: std::net::SocketAddr) -> (u16, String) {
    use rustls_pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
        .unwrap()
        .signed_by(&leaf_key, &ca, &ca_key)
        .unwrap();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der()));
    let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![leaf.der().clone()], key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    let listener = oqp_tests::harness::loopback().await;
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                if let Ok(mut plain) = tokio::net::TcpStream::connect(backend).await {
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                }
            });
        }
    });
    (port, ca.pem())
}

#[tokio::test]
async fn a_peer_at_https_is_reached_with_the_ca_given_by_ca() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    // b's own listener is plain; its peers reach it through the terminator.
    let b_listener = oqp_tests::harness::loopback().await;
    let (port, ca_pem) = tls_front(b_listener.local_addr().unwrap()).await;
    let yaml = format!(
        "control_plane: {{node_token: {TOKEN}}}\n\
         nodes: {{local: {{port: 0}}, e: {{port: 0}}, b: {{url: \"https://127.0.0.1:{port}\"}}}}\n\
         ollama:\n  hosts:\n    - {{url: \"{}\", name: gpu, node: b}}\n",
        fake.url()
    );
    let stack = Stack::start(&yaml).await;
    let start = |node: &str, listener, ca_file| {
        oqp_dataplane::DataPlane::start(oqp_dataplane::Options {
            control: oqp_dataplane::control::ControlOptions {
                url: stack.control_url(),
                node: node.to_owned(),
                token: Some(TOKEN.to_owned()),
                ca_file,
            },
            listener: Some(listener),
            report_interval: Duration::from_millis(200),
            log_level: None,
        })
    };
    let b = start("b", b_listener, None).await.expect("b starts");
    let ca_path = stack.dir().join("ca.pem");
    std::fs::write(&ca_path, ca_pem).unwrap();
    let e = start("e", oqp_tests::harness::loopback().await, Some(ca_path))
        .await
        .expect("e starts");
    let http = HttpClient::new();
    let request = json!({"model": "llama3", "prompt": "hi", "stream": false});
    let through_e = http
        .post_json(
            &format!("http://{}/api/generate", e.local_addr()),
            &[],
            &request,
        )
        .await;
    assert_eq!(through_e.status, 200, "{}", through_e.text());
    assert_eq!(through_e.header("x-failover-host").as_deref(), Some("gpu"));
    // The single-box plane has no --ca: it cannot verify b's certificate, so b counts as
    // unreachable from there and nothing is sent in clear.
    let through_local = http
        .post_json(&format!("{}/api/generate", stack.url()), &[], &request)
        .await;
    assert_eq!(through_local.status, 503, "{}", through_local.text());
    assert_eq!(
        through_local.header("x-failover-exhausted").as_deref(),
        Some("true")
    );
    assert_eq!(fake.handle().requests_to("/api/generate").len(), 1);
    e.shutdown().await;
    b.shutdown().await;
    stack.shutdown().await;
}

#[tokio::test]
async fn a_peers_hops_are_served_while_its_address_is_throttled_and_keep_the_callers_tier() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let yaml = owned_by_b(&fake.url())
        + "auth:\n  enabled: true\n  rate_limit: {max_failures: 2, window_seconds: 60}\n  keys:\n    \
           - {key: sk-batch-0123456789, client_id: batch, max_priority: low}\n";
    let (stack, b) = edge_and_b(&yaml).await;
    let http = HttpClient::new();
    let request = json!({"model": "llama3", "prompt": "hi", "stream": false});
    // Everything here comes from 127.0.0.1: wrong keys straight at b throttle that address.
    let at_b = format!("http://{}/api/generate", b.local_addr());
    let wrong = [("authorization", "Bearer sk-wrong-0123456789")];
    for _ in 0..3 {
        http.post_json(&at_b, &wrong, &request).await;
    }
    assert_eq!(http.post_json(&at_b, &wrong, &request).await.status, 429);
    let key = [
        ("authorization", "Bearer sk-batch-0123456789"),
        ("x-queue-priority", "high"),
    ];
    let reply = http
        .post_json(&format!("{}/api/generate", stack.url()), &key, &request)
        .await;
    assert_eq!(
        reply.status,
        200,
        "a verified hop is not throttled: {}",
        reply.text()
    );
    // (Its status page is throttled for this address too: read the owner's queues directly.)
    let stats = b.app().dispatcher.stats();
    let processed: Vec<u64> = stats.tiers.iter().map(|tier| tier.processed).collect();
    assert_eq!(processed, [0, 0, 1], "queued at the client's ceiling, low");
    assert_eq!(fake.handle().requests_to("/api/generate").len(), 1);
    b.shutdown().await;
    stack.shutdown().await;
}

#[tokio::test]
async fn a_second_data_plane_with_an_owners_name_is_refused() {
    use oqp_proto::policy::v1::NodeHello;
    use oqp_proto::policy::v1::policy_service_client::PolicyServiceClient;
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let (stack, b) = edge_and_b(&owned_by_b(&fake.url())).await;
    let mut policy = PolicyServiceClient::connect(stack.control_url())
        .await
        .unwrap();
    let mut hello = tonic::Request::new(NodeHello {
        node: "b".to_owned(),
        ..NodeHello::default()
    });
    hello.metadata_mut().insert(
        "x-oqp-node-token",
        oqp_dataplane::node_keys::grpc_credential(TOKEN)
            .parse()
            .unwrap(),
    );
    let refused = policy
        .watch_policy(hello)
        .await
        .expect_err("a second b is refused");
    assert_eq!(refused.code(), tonic::Code::AlreadyExists);
    assert!(
        refused.message().contains("already connected as node 'b'"),
        "{}",
        refused.message()
    );
    b.shutdown().await;
    stack.shutdown().await;
}

#[tokio::test]
async fn a_captured_hop_cannot_be_replayed_or_carry_another_body() {
    use oqp_dataplane::hop::{self, Assertion, HopKey};
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let (stack, b) = edge_and_b(&owned_by_b(&fake.url())).await;
    let body = br#"{"model":"llama3","prompt":"hi","stream":false}"#;
    let sign = |body: &[u8]| {
        let assertion = Assertion {
            node: "local".into(),
            client: "someone".into(),
            verified: false,
            tier: oqp_dataplane::scheduler::Tier::High,
            body: hop::Body::Digest(hop::body_digest(body)),
            group: None,
        };
        let request = hop::Request {
            to: "b",
            id: "rid-1",
            method: &http::Method::POST,
            path: "/api/generate",
        };
        let header =
            HopKey::new(TOKEN)
                .unwrap()
                .sign(&assertion, request, std::time::SystemTime::now());
        header.to_str().unwrap().to_owned()
    };
    let http = HttpClient::new();
    let url = format!("http://{}/api/generate", b.local_addr());
    let send = |header: String, body: &'static [u8]| {
        let (http, url) = (&http, &url);
        async move {
            let request = serde_json::from_slice::<serde_json::Value>(body).unwrap();
            http.post_json(
                url,
                &[("x-oqp-hop", &header), ("x-request-id", "rid-1")],
                &request,
            )
            .await
        }
    };
    let header = sign(body);
    let first = send(header.clone(), body).await;
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(
        send(header, body).await.status,
        401,
        "the same header again is a replay"
    );
    let other = br#"{"model":"llama3","prompt":"something much longer","stream":false}"#;
    let swapped = send(sign(body), other).await;
    assert_eq!(
        swapped.status, 401,
        "a signed hop carries only its own body"
    );
    assert_eq!(fake.handle().requests_to("/api/generate").len(), 1);
    b.shutdown().await;
    stack.shutdown().await;
}

#[tokio::test]
async fn a_request_that_failed_after_reaching_a_host_is_not_sent_to_another_box() {
    use oqp_tests::fake::Failure;
    let here = FakeOllama::builder().model("llama3").spawn().await;
    let there = FakeOllama::builder()
        .model("llama3")
        .loaded("llama3")
        .spawn()
        .await;
    let yaml = format!(
        "control_plane: {{node_token: {TOKEN}}}\nnodes: {{local: {{port: 0}}, b: {{port: 0}}}}\n\
         routing: {{strategy: model_aware}}\n\
         ollama:\n  hosts:\n    - {{url: \"{}\", name: gpu1, node: local}}\n    - {{url: \"{}\", name: gpu2, node: b}}\n",
        here.url(),
        there.url()
    );
    let stack = Stack::start(&yaml).await;
    let b = stack
        .start_dataplane("b", Some(TOKEN))
        .await
        .expect("node b starts");
    let edge = stack.control.dataplane().expect("local data plane");
    let app = edge.app().clone();
    assert!(
        eventually(Duration::from_secs(10), || {
            let policy = app.store.load();
            app.peers.url(&policy, "b").is_some()
                && policy
                    .remote
                    .iter()
                    .any(|host| host.loaded.contains("llama3:latest"))
        })
        .await,
        "the edge knows b and that llama3 is loaded there"
    );
    let http = HttpClient::new();
    let request = json!({"model": "llama3", "prompt": "hi", "stream": false});
    let url = format!("{}/api/generate", stack.url());
    let served = http.post_json(&url, &[], &request).await;
    assert_eq!(
        served.header("x-failover-host").as_deref(),
        Some("gpu2"),
        "loaded wins"
    );
    there.handle().fail_next(Failure::Reset);
    let failed = http.post_json(&url, &[], &request).await;
    assert_eq!(failed.status, 503, "{}", failed.text());
    assert_eq!(
        failed.header("x-failover-exhausted").as_deref(),
        Some("true")
    );
    assert!(
        here.handle().requests_to("/api/generate").is_empty(),
        "gpu2 had the request: it is not run again on box 1"
    );
    b.shutdown().await;
    stack.shutdown().await;
}

#[tokio::test]
async fn an_upstream_answer_cannot_pass_for_the_owner_refusing() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    // Whatever answers as the host marks its answers as an owner's refusal would be.
    fake.handle().answer_header("x-oqp-hop-refused", "1");
    fake.handle().answer_header("x-oqp-hop-elapsed-us", "1");
    let (stack, b) = edge_and_b(&owned_by_b(&fake.url())).await;
    let request = json!({"model": "llama3", "prompt": "hi", "stream": false});
    let http = HttpClient::new();
    for entry in [stack.url(), format!("http://{}", b.local_addr())] {
        let reply = http
            .post_json(&format!("{entry}/api/generate"), &[], &request)
            .await;
        assert_eq!(reply.status, 200, "{entry}: {}", reply.text());
        assert!(reply.header("x-oqp-hop-refused").is_none());
        assert!(reply.header("x-oqp-hop-elapsed-us").is_none());
    }
    assert_eq!(
        fake.handle().requests_to("/api/generate").len(),
        2,
        "each request ran once"
    );
    b.shutdown().await;
    stack.shutdown().await;
}

#[tokio::test]
async fn a_hop_header_accepted_before_the_owner_restarted_is_refused_after() {
    use oqp_dataplane::hop::{self, Assertion, HopKey};
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let (stack, b) = edge_and_b(&owned_by_b(&fake.url())).await;
    // A hop header as an edge signs it, captured on the wire.
    let body = br#"{"model":"llama3","prompt":"hi","stream":false}"#;
    let digest = hop::body_digest(body);
    let header = HopKey::new(TOKEN).unwrap().sign(
        &Assertion {
            node: "local".into(),
            client: "anonymous".into(),
            verified: false,
            tier: oqp_dataplane::scheduler::Tier::Normal,
            body: hop::Body::Digest(digest.clone()),
            group: None,
        },
        hop::Request {
            to: "b",
            id: "captured-1",
            method: &http::Method::POST,
            path: "/api/generate",
        },
        std::time::SystemTime::now(),
    );
    let header = header.to_str().unwrap().to_owned();
    let send = |addr: std::net::SocketAddr| {
        let header = header.clone();
        async move {
            HttpClient::new()
                .send(
                    http::Method::POST,
                    &format!("http://{addr}/api/generate"),
                    &[("x-oqp-hop", &header), ("x-request-id", "captured-1")],
                    &body[..],
                )
                .await
        }
    };
    assert_eq!(send(b.local_addr()).await.status, 200, "the original");
    assert_eq!(send(b.local_addr()).await.status, 401, "a replay");
    // The owner restarts, remembering nothing it accepted: the header is still within the
    // allowed skew, and is refused all the same.
    b.shutdown().await;
    let b = stack.start_dataplane("b", Some(TOKEN)).await.unwrap();
    assert_eq!(
        send(b.local_addr()).await.status,
        401,
        "a replay after a restart"
    );
    assert_eq!(fake.handle().requests_to("/api/generate").len(), 1);
    b.shutdown().await;
    stack.shutdown().await;
}

#[tokio::test]
async fn each_key_derived_from_the_node_token_opens_only_its_own_door() {
    use oqp_dataplane::hop::{self, Assertion, HopKey};
    use oqp_dataplane::node_keys;
    use oqp_proto::policy::v1::NodeHello;
    use oqp_proto::policy::v1::policy_service_client::PolicyServiceClient;
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let (stack, b) = edge_and_b(&owned_by_b(&fake.url())).await;
    let body = br#"{"model":"llama3","prompt":"hi","stream":false}"#;
    let http = HttpClient::new();
    let url = format!("http://{}/api/generate", b.local_addr());
    // A hop to b signed with the key `token` derives, as an edge signs it.
    let hop_with = |token: String, id: &'static str| {
        let (http, url) = (&http, &url);
        async move {
            let assertion = Assertion {
                node: "local".into(),
                client: "someone".into(),
                verified: false,
                tier: oqp_dataplane::scheduler::Tier::High,
                body: hop::Body::Digest(hop::body_digest(body)),
                group: None,
            };
            let request = hop::Request {
                to: "b",
                id,
                method: &http::Method::POST,
                path: "/api/generate",
            };
            let header = HopKey::new(&token).unwrap().sign(
                &assertion,
                request,
                std::time::SystemTime::now(),
            );
            let request = serde_json::from_slice::<serde_json::Value>(body).unwrap();
            let header = header.to_str().unwrap().to_owned();
            http.post_json(
                url,
                &[("x-oqp-hop", &header), ("x-request-id", id)],
                &request,
            )
            .await
            .status
        }
    };
    // What a data plane presents on the policy link (readable by whoever sees that link)
    // and on the admin API cannot sign a hop.
    let grpc = node_keys::grpc_credential(TOKEN);
    let admin = node_keys::admin_credential(TOKEN);
    assert_eq!(hop_with(grpc.clone(), "rid-grpc").await, 401);
    assert_eq!(hop_with(admin.clone(), "rid-admin").await, 401);
    assert!(fake.handle().requests_to("/api/generate").is_empty());
    assert_eq!(hop_with(TOKEN.to_owned(), "rid-token").await, 200);
    // Only the policy link's own key opens the policy service: not the token itself, not
    // the hop key, not the admin credential.
    let watch = |presented: String| {
        let control = stack.control_url();
        async move {
            let mut policy = PolicyServiceClient::connect(control).await.unwrap();
            let mut hello = tonic::Request::new(NodeHello {
                node: "watcher".to_owned(),
                ..NodeHello::default()
            });
            hello
                .metadata_mut()
                .insert(oqp_proto::NODE_TOKEN_METADATA, presented.parse().unwrap());
            policy
                .watch_policy(hello)
                .await
                .map(|_| ())
                .map_err(|e| e.code())
        }
    };
    let hop_key: String = node_keys::hop_key(TOKEN)
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect();
    for presented in [TOKEN.to_owned(), hop_key, admin] {
        assert_eq!(
            watch(presented.clone()).await,
            Err(tonic::Code::Unauthenticated),
            "{presented}"
        );
    }
    assert_eq!(watch(grpc).await, Ok(()));
    b.shutdown().await;
    stack.shutdown().await;
}

#[tokio::test]
async fn a_cloud_hosts_keys_reach_only_the_data_plane_that_owns_it() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let cloud = FakeOllama::builder()
        .cloud(&["ck-first"])
        .model("gpt-oss:20b")
        .spawn()
        .await;
    let yaml = format!(
        "control_plane: {{node_token: {TOKEN}}}\nnodes: {{local: {{port: 0}}, b: {{port: 0}}}}\n\
         ollama:\n  hosts:\n    - {{url: \"{}\", name: gpu, node: local}}\n    \
         - {{url: \"{}\", name: cloud, kind: cloud, node: b, api_keys: [{{key: ck-first}}]}}\n",
        fake.url(),
        cloud.url()
    );
    let (stack, b) = edge_and_b(&yaml).await;
    let keys = |hosts: &[std::sync::Arc<oqp_dataplane::policy::Host>]| {
        hosts
            .iter()
            .find(|host| &*host.name == "cloud")
            .map(|host| host.cloud_keys.len())
    };
    // The owner has the key and sends to the host; the other data plane only forwards to
    // the owner and never holds it.
    let owner = b.app().store.load();
    assert_eq!(keys(&owner.hosts), Some(1));
    let edge = stack.control.dataplane().unwrap().app().store.load();
    assert_eq!(keys(&edge.hosts), None);
    assert_eq!(keys(&edge.remote), Some(0));
    b.shutdown().await;
    stack.shutdown().await;
}

/// [`owned_by_b`] with model management on (uploads, pulls, deletes).
fn managed_by_b(fake: &str) -> String {
    owned_by_b(fake).replace(
        "proxy: {max_concurrent: 2}",
        "proxy: {max_concurrent: 2, allow_model_management: true}",
    )
}

#[tokio::test]
async fn a_blob_upload_through_an_edge_reaches_the_owners_ollama_whole() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let (stack, b) = edge_and_b(&managed_by_b(&fake.url())).await;
    // Large enough to cross the hop in many frames.
    let blob: Vec<u8> = (0..300_000u32).map(|n| (n % 251) as u8).collect();
    let digest = {
        use sha2::Digest;
        format!("sha256:{:x}", sha2::Sha256::digest(&blob))
    };
    let path = format!("/api/blobs/{digest}");
    let reply = HttpClient::new()
        .send(
            http::Method::POST,
            &format!("{}{path}", stack.url()),
            &[],
            blob.clone(),
        )
        .await;
    assert_eq!(reply.status, 201, "{}", reply.text());
    assert_eq!(reply.header("x-failover-host").as_deref(), Some("gpu"));
    let recorded = fake.handle().requests_to(&path);
    assert_eq!(recorded.len(), 1);
    let upload = &recorded[0];
    assert!(upload.body == blob, "the blob arrives whole");
    assert_eq!(
        upload.header("content-length"),
        Some(blob.len().to_string()),
        "with the length the client declared"
    );
    for name in ["transfer-encoding", "trailer", "te"] {
        assert!(
            upload.header(name).is_none(),
            "{name}: {:?}",
            upload.headers
        );
    }
    assert!(
        !upload
            .headers
            .keys()
            .any(|name| name.as_str().starts_with("x-oqp")),
        "{:?}",
        upload.headers
    );
    let status = HttpClient::new()
        .get(&format!("{}/queue/status", stack.url()), &[])
        .await
        .json();
    assert_eq!(
        status["node"]["peers"][0]["forwarded"], 1,
        "it went through b"
    );
    // `ollama create` asks first whether the blob is there: a HEAD, with no body, crosses
    // the hop too.
    let exists = HttpClient::new()
        .send(
            http::Method::HEAD,
            &format!("{}{path}", stack.url()),
            &[],
            bytes::Bytes::new(),
        )
        .await;
    assert_eq!(exists.status, 200);
    assert_eq!(fake.handle().requests_to(&path).len(), 2);
    b.shutdown().await;
    stack.shutdown().await;
}

/// A hop header for `DELETE /api/delete` to b, as an edge signs it for a streamed body of
/// `length` bytes.
fn streamed_hop(id: &str, length: usize) -> http::HeaderValue {
    use oqp_dataplane::hop::{self, Assertion, HopKey};
    HopKey::new(TOKEN).unwrap().sign(
        &Assertion {
            node: "local".into(),
            client: "someone".into(),
            verified: false,
            tier: oqp_dataplane::scheduler::Tier::Normal,
            body: hop::Body::Trailer(Some(length as u64)),
            group: None,
        },
        hop::Request {
            to: "b",
            id,
            method: &http::Method::DELETE,
            path: "/api/delete",
        },
        std::time::SystemTime::now(),
    )
}

/// The trailer an edge ends `body` with, on the hop of `header`.
fn seal(header: &http::HeaderValue, body: &[u8]) -> String {
    use sha2::Digest;
    let digest: [u8; 32] = sha2::Sha256::digest(body).into();
    let key = oqp_dataplane::hop::HopKey::new(TOKEN).unwrap();
    key.seal_body(header, &digest).to_str().unwrap().to_owned()
}

/// Sends `DELETE /api/delete` to `addr` as a hop, written by hand as it would cross the
/// wire: `header`, the body in `chunks`, then `trailer` (none: the body ends without one).
/// The answer's status.
async fn raw_hop(
    addr: std::net::SocketAddr,
    id: &str,
    header: &str,
    chunks: &[&[u8]],
    trailer: Option<&str>,
) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut wire = format!(
        "DELETE /api/delete HTTP/1.1\r\nhost: b\r\nx-oqp-hop: {header}\r\nx-request-id: {id}\r\n\
         content-type: application/json\r\ntransfer-encoding: chunked\r\n\
         trailer: x-oqp-hop-body\r\nconnection: close\r\n\r\n"
    )
    .into_bytes();
    for chunk in chunks {
        wire.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        wire.extend_from_slice(chunk);
        wire.extend_from_slice(b"\r\n");
    }
    wire.extend_from_slice(b"0\r\n");
    if let Some(trailer) = trailer {
        wire.extend_from_slice(format!("x-oqp-hop-body: {trailer}\r\n").as_bytes());
    }
    wire.extend_from_slice(b"\r\n");
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket.write_all(&wire).await.unwrap();
    let mut answer = Vec::new();
    let _ = socket.read_to_end(&mut answer).await;
    let answer = String::from_utf8_lossy(&answer);
    answer
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no answer: {answer:?}"))
}

#[tokio::test]
async fn a_streamed_hop_with_another_body_never_reaches_ollama_whole() {
    let fake = FakeOllama::builder()
        .model("llama2")
        .model("llama3")
        .spawn()
        .await;
    let (stack, b) = edge_and_b(&managed_by_b(&fake.url())).await;
    let addr = b.local_addr();
    // The edge signed a delete of llama2; someone on the wire makes it delete llama3.
    let signed: &[u8] = br#"{"model":"llama2"}"#;
    let (first, last): (&[u8], &[u8]) = signed.split_at(9);
    let changed: &[u8] = br#"ma3"}"#;
    let header = streamed_hop("rid-changed", signed.len());
    let trailer = seal(&header, signed);
    let header_text = header.to_str().unwrap();
    let refused = [
        (
            "a changed byte",
            raw_hop(
                addr,
                "rid-changed",
                header_text,
                &[first, changed],
                Some(&trailer),
            )
            .await,
        ),
        ("no trailer", {
            let header = streamed_hop("rid-bare", signed.len());
            raw_hop(
                addr,
                "rid-bare",
                header.to_str().unwrap(),
                &[first, last],
                None,
            )
            .await
        }),
        ("more bytes than signed", {
            let header = streamed_hop("rid-longer", signed.len());
            let trailer = seal(&header, signed);
            let header = header.to_str().unwrap();
            raw_hop(
                addr,
                "rid-longer",
                header,
                &[first, last, b" "],
                Some(&trailer),
            )
            .await
        }),
        ("another hop's trailer", {
            let header = streamed_hop("rid-other", signed.len());
            raw_hop(
                addr,
                "rid-other",
                header.to_str().unwrap(),
                &[first, last],
                Some(&trailer),
            )
            .await
        }),
        ("the old unbound form", {
            let header = streamed_hop("rid-unbound", signed.len());
            let header = header
                .to_str()
                .unwrap()
                .replace(&format!(";b=~{};", signed.len()), ";b=-;");
            raw_hop(addr, "rid-unbound", &header, &[first, changed], None).await
        }),
    ];
    for (case, status) in refused {
        assert_eq!(status, 401, "{case}");
    }
    // Ollama never got a whole body: nothing was deleted.
    for request in fake.handle().requests_to("/api/delete") {
        assert!(
            request.body.len() < signed.len(),
            "a body reached Ollama whole: {:?}",
            request.body
        );
    }
    let tags = HttpClient::new()
        .get(&format!("{}/api/tags", fake.url()), &[])
        .await
        .json();
    assert_eq!(tags["models"].as_array().map(Vec::len), Some(2), "{tags}");

    // The hop as the edge sent it is served.
    let header = streamed_hop("rid-honest", signed.len());
    let trailer = seal(&header, signed);
    let status = raw_hop(
        addr,
        "rid-honest",
        header.to_str().unwrap(),
        &[first, last],
        Some(&trailer),
    )
    .await;
    assert_eq!(status, 200);
    let deleted = fake.handle().requests_to("/api/delete");
    let deleted = deleted.last().unwrap();
    assert_eq!(deleted.json(), json!({"model": "llama2"}));
    assert_eq!(deleted.header("content-length").as_deref(), Some("18"));
    let tags = HttpClient::new()
        .get(&format!("{}/api/tags", fake.url()), &[])
        .await
        .json();
    assert_eq!(tags["models"][0]["name"], "llama3:latest", "{tags}");
    b.shutdown().await;
    stack.shutdown().await;
}

#[tokio::test]
async fn a_hop_naming_a_token_users_group_gets_the_owners_policy_for_it_and_one_it_lacks_is_refused()
 {
    use oqp_dataplane::hop::{self, Assertion, HopKey};
    use oqp_tests::jwt::{JwksServer, SigningKey, key_set};
    let fake = FakeOllama::builder()
        .model("llama3")
        .model("qwen3:8b")
        .spawn()
        .await;
    let jwks = JwksServer::start(&key_set(&[&SigningKey::es256("es-1")])).await;
    let yaml = format!(
        "{}auth:\n  enabled: true\n  keys:\n    - client_id: people\n      models: [\"llama3*\"]\n      \
         jwt:\n        issuer: https://login.example.com\n        audiences: [oqp]\n        \
         jwks_url: \"{}\"\n        allowed_hosts: [\"127.0.0.1\"]\n        claims_to_policy:\n          \
         claim: groups\n          policies:\n            - {{value: big, models: [\"qwen3*\"]}}\n",
        owned_by_b(&fake.url()),
        jwks.url()
    );
    let (stack, b) = edge_and_b(&yaml).await;
    let body = br#"{"model":"qwen3:8b","prompt":"hi","stream":false}"#;
    let http = HttpClient::new();
    let url = format!("http://{}/api/generate", b.local_addr());
    let send = |group: &str, id: &str| {
        let assertion = Assertion {
            node: "local".into(),
            client: "people/ada".into(),
            verified: true,
            tier: oqp_dataplane::scheduler::Tier::Normal,
            body: hop::Body::Digest(hop::body_digest(body)),
            group: Some(group.into()),
        };
        let request = hop::Request {
            to: "b",
            id,
            method: &http::Method::POST,
            path: "/api/generate",
        };
        let header =
            HopKey::new(TOKEN)
                .unwrap()
                .sign(&assertion, request, std::time::SystemTime::now());
        let (http, url, id) = (&http, &url, id.to_owned());
        async move {
            let request = serde_json::from_slice::<serde_json::Value>(body).unwrap();
            http.post_json(
                url,
                &[
                    ("x-oqp-hop", header.to_str().unwrap()),
                    ("x-request-id", &id),
                ],
                &request,
            )
            .await
        }
    };
    // The group's model, which the key alone does not allow, is served for the group.
    let served = send("big", "rid-1").await;
    assert_eq!(served.status, 200, "{}", served.text());
    let upstream = fake.handle().requests_to("/api/generate");
    assert_eq!(upstream.len(), 1);
    assert_eq!(
        upstream[0].header("x-client-id").as_deref(),
        Some("people/ada")
    );
    // A group this owner's snapshot lacks (its config is not the edge's yet): refused here,
    // as a client it does not know, never served under the key's own policy.
    let refused = send("gone", "rid-2").await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert_eq!(
        refused.json()["error"],
        "client not known to this node",
        "{}",
        refused.text()
    );
    assert_eq!(fake.handle().requests_to("/api/generate").len(), 1);
    b.shutdown().await;
    stack.shutdown().await;
}
