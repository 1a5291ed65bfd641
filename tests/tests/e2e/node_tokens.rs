//! End to end: a data plane's own token (`AddNode`, `RevokeNode`, `ListNodes`), through
//! the real control plane, its in-process data plane (`local`, on the shared node token),
//! more data planes and the fake Ollama. A node issued a token joins with it and serves;
//! the token admits its own name alone; once a name has its own token the shared one no
//! longer admits it; a revoked node is refused and its watch ended at once while the
//! others serve on; the store survives a restart; no token shows in status, listings, the
//! audit trail or the file.

use std::path::Path;
use std::time::Duration;

use oqp_controlplane::node_credentials::FILE;
use oqp_proto::admin::v1::{self as api, admin_service_client::AdminServiceClient};
use oqp_proto::policy::v1::policy_service_client::PolicyServiceClient;
use oqp_proto::policy::v1::{NodeHello, NodeReport, PolicySnapshot};
use oqp_tests::client::{HttpClient, wait_until};
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::{self, ConfigYaml, Host, Key, Stack};
use tonic::transport::Channel;

const ADMIN: &str = "sk-admin-0123456789";
const CHAT: &str = "sk-chat-0123456789";
const SHARED: &str = "sk-node-shared-0123456789";

fn config(url: &str, state_dir: &Path) -> String {
    ConfigYaml::new()
        .host(Host::ollama("primary", url))
        .key(
            Key::new(ADMIN, "admin")
                .set("scope", "management")
                .set("max_priority", "high"),
        )
        .key(
            Key::new(CHAT, "chat")
                .set("scope", "inference")
                .set("max_priority", "normal"),
        )
        .under("control_plane", &format!("  node_token: \"{SHARED}\"\n"))
        .state_dir(state_dir)
        .yaml()
}

async fn admin(stack: &Stack) -> AdminServiceClient<Channel> {
    AdminServiceClient::connect(stack.control_url())
        .await
        .unwrap()
}

fn authed<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {ADMIN}").parse().unwrap());
    request
}

async fn add_node(stack: &Stack, node: &str) -> String {
    admin(stack)
        .await
        .add_node(authed(api::AddNodeRequest {
            node: node.to_owned(),
        }))
        .await
        .unwrap()
        .into_inner()
        .token
}

fn presenting<T>(token: &str, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert(
        oqp_proto::NODE_TOKEN_METADATA,
        oqp_dataplane::node_keys::grpc_credential(token)
            .parse()
            .unwrap(),
    );
    request
}

/// A watch under `node` presenting `token`: the stream after its first snapshot.
async fn watch(
    stack: &Stack,
    token: &str,
    node: &str,
) -> Result<tonic::Streaming<PolicySnapshot>, tonic::Status> {
    let mut client = PolicyServiceClient::connect(stack.control_url())
        .await
        .unwrap();
    let hello = NodeHello {
        node: node.to_owned(),
        ..NodeHello::default()
    };
    let mut stream = client
        .watch_policy(presenting(token, hello))
        .await?
        .into_inner();
    stream.message().await?.expect("a first snapshot");
    Ok(stream)
}

/// An empty report under `node` presenting `token`.
async fn report(stack: &Stack, token: &str, node: &str) -> Result<(), tonic::Status> {
    let mut client = PolicyServiceClient::connect(stack.control_url())
        .await
        .unwrap();
    let report = NodeReport {
        node: node.to_owned(),
        ..NodeReport::default()
    };
    client
        .report_status(presenting(token, report))
        .await
        .map(drop)
}

async fn generate(base: &str) -> u16 {
    let authorization = format!("Bearer {CHAT}");
    HttpClient::new()
        .send(
            http::Method::POST,
            &format!("{base}/api/generate"),
            &[
                ("authorization", authorization.as_str()),
                ("content-type", "application/json"),
            ],
            r#"{"model":"llama3","prompt":"hi","stream":false}"#,
        )
        .await
        .status
        .as_u16()
}

async fn connected(stack: &Stack, node: &str) -> bool {
    admin(stack)
        .await
        .get_status(authed(api::GetStatusRequest {}))
        .await
        .unwrap()
        .into_inner()
        .nodes
        .iter()
        .any(|row| row.node == node && row.connected)
}

/// Waits (polling the admin API, at most 20 s) until `node`'s link is `up`.
async fn wait_connected(stack: &Stack, node: &str, up: bool) {
    let seen = wait_until(Duration::from_secs(20), || async {
        if connected(stack, node).await == up {
            Ok(())
        } else {
            Err(())
        }
    })
    .await;
    assert!(seen.is_ok(), "node {node} never became connected={up}");
}

#[tokio::test]
async fn a_node_joins_with_its_own_token_for_its_name_alone_and_is_cut_off_when_revoked() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let state = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(&fake.url(), state.path())).await;

    let token = add_node(&stack, "box-a").await;
    assert!(token.starts_with("oqp_node_"), "{token}");
    // The data plane joins with it and serves.
    let box_a = harness::start_dataplane(&stack.control_url(), "box-a", Some(&token))
        .await
        .unwrap();
    harness::wait_for_version(&box_a, stack.control.hub().current().version).await;
    wait_connected(&stack, "box-a", true).await;
    let box_a_url = format!("http://{}", box_a.local_addr());
    assert_eq!(generate(&box_a_url).await, 200);

    // Its token under another name: refused, to watch and to report.
    let refused = watch(&stack, &token, "box-b").await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    let refused = report(&stack, &token, "box-b").await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    // The shared token no longer admits the name that has its own; it admits the others.
    let refused = watch(&stack, SHARED, "box-a").await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    assert!(refused.message().contains("has its own"), "{refused:?}");
    report(&stack, SHARED, "box-b").await.unwrap();
    assert_eq!(
        generate(&stack.url()).await,
        200,
        "local, on the shared token"
    );

    // Revoked: the open watch ends at once, calls are refused, the others serve on.
    let mut held = watch(&stack, &token, "box-a").await.unwrap();
    let revoked = admin(&stack)
        .await
        .revoke_node(authed(api::RevokeNodeRequest {
            node: "box-a".to_owned(),
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(revoked.was_connected);
    let ended = tokio::time::timeout(Duration::from_secs(1), async {
        loop {
            match held.message().await {
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return,
            }
        }
    })
    .await;
    assert!(
        ended.is_ok(),
        "the revoked node's watch was still open after 1 s"
    );
    wait_connected(&stack, "box-a", false).await;
    let refused = watch(&stack, &token, "box-a").await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    let refused = report(&stack, &token, "box-a").await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    let refused = watch(&stack, SHARED, "box-a").await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::PermissionDenied,
        "nor the shared token"
    );
    assert_eq!(generate(&stack.url()).await, 200);

    let listed = admin(&stack)
        .await
        .list_nodes(authed(api::ListNodesRequest {}))
        .await
        .unwrap()
        .into_inner()
        .nodes;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].node, "box-a");
    assert!(listed[0].revoked_unix_ms > 0 && !listed[0].connected);

    // No token anywhere it could be read back.
    let status = admin(&stack)
        .await
        .get_status(authed(api::GetStatusRequest {}))
        .await
        .unwrap()
        .into_inner();
    let audit = admin(&stack)
        .await
        .list_audit(authed(api::ListAuditRequest::default()))
        .await
        .unwrap()
        .into_inner();
    let file = std::fs::read_to_string(state.path().join(FILE)).unwrap();
    let queue_status = HttpClient::new()
        .get(
            &format!("{}/queue/status", stack.url()),
            &[("authorization", &format!("Bearer {ADMIN}"))],
        )
        .await
        .text();
    let credential = oqp_dataplane::node_keys::grpc_credential(&token);
    let secret = &token["oqp_node_".len()..];
    for (what, text) in [
        ("status", format!("{status:?}")),
        ("audit", format!("{audit:?}")),
        ("nodes.json", file),
        ("/queue/status", queue_status),
        ("listing", format!("{listed:?}")),
    ] {
        assert!(!text.contains(secret), "{what} shows the token");
        assert!(!text.contains(&credential), "{what} shows its credential");
    }
    assert!(format!("{audit:?}").contains("nodes.revoke"));
    drop(box_a);
    stack.shutdown().await;
}

#[tokio::test]
async fn node_tokens_and_revocations_survive_a_control_plane_restart() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let state = tempfile::tempdir().unwrap();
    let yaml = config(&fake.url(), state.path());
    let stack = Stack::start(&yaml).await;
    let kept = add_node(&stack, "box-a").await;
    let gone = add_node(&stack, "box-b").await;
    admin(&stack)
        .await
        .revoke_node(authed(api::RevokeNodeRequest {
            node: "box-b".to_owned(),
        }))
        .await
        .unwrap();
    // Issuing a token again for a name that has one is refused, and changes nothing.
    let again = admin(&stack)
        .await
        .add_node(authed(api::AddNodeRequest {
            node: "box-a".to_owned(),
        }))
        .await
        .unwrap_err();
    assert_eq!(again.code(), tonic::Code::AlreadyExists);
    stack.shutdown().await;

    let stack = Stack::start(&yaml).await;
    watch(&stack, &kept, "box-a").await.unwrap();
    let refused = watch(&stack, &gone, "box-b").await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    // A name revoked can be issued a new token; the old one stays refused.
    let renewed = add_node(&stack, "box-b").await;
    watch(&stack, &renewed, "box-b").await.unwrap();
    let refused = watch(&stack, &gone, "box-b").await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_shared_token_watch_ends_when_its_name_is_issued_its_own() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let state = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(&fake.url(), state.path())).await;
    let mut held = watch(&stack, SHARED, "box-c").await.unwrap();
    let token = add_node(&stack, "box-c").await;
    let ended = tokio::time::timeout(Duration::from_secs(1), async {
        while let Ok(Some(_)) = held.message().await {}
    })
    .await;
    assert!(
        ended.is_ok(),
        "the shared-token watch outlived the new token"
    );
    watch(&stack, &token, "box-c").await.unwrap();
    stack.shutdown().await;
}

/// Host `gpu` owned by `b`; `local` (the in-process plane, shared token) and `e` listed.
fn owned_by_b(fake: &str, state_dir: &Path) -> String {
    format!(
        "control_plane: {{node_token: {SHARED}, state_dir: '{}'}}\n\
         nodes: {{local: {{port: 0}}, b: {{port: 0}}, e: {{port: 0}}}}\n\
         ollama:\n  hosts:\n    - {{url: \"{fake}\", name: gpu, node: b}}\n",
        state_dir.display()
    )
}

/// Waits (at most 10 s) until `edge` knows where `peer` is.
async fn wait_peer(edge: &oqp_dataplane::DataPlane, peer: &str) {
    let peers = edge.app().peers.clone();
    let known = oqp_tests::client::eventually(Duration::from_secs(10), || {
        peers.url(&edge.app().store.load(), peer).is_some()
    })
    .await;
    assert!(known, "the edge never learnt where {peer} is");
}

#[tokio::test]
async fn hops_between_nodes_with_their_own_tokens_work_until_the_edge_is_revoked() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let state = tempfile::tempdir().unwrap();
    let stack = Stack::start(&owned_by_b(&fake.url(), state.path())).await;
    let (b_token, e_token) = (add_node(&stack, "b").await, add_node(&stack, "e").await);
    let b = stack.start_dataplane("b", Some(&b_token)).await.unwrap();
    let e = stack.start_dataplane("e", Some(&e_token)).await.unwrap();
    let version = stack.control.hub().current().version;
    for plane in [&b, &e] {
        harness::wait_for_version(plane, version).await;
    }
    wait_peer(&e, "b").await;
    wait_peer(stack.control.dataplane().unwrap(), "b").await;
    // No two of them share a hop key, yet each edge's hop verifies at the owner.
    let e_url = format!("http://{}", e.local_addr());
    assert_eq!(generate(&e_url).await, 200, "e (own token) → b (own token)");
    assert_eq!(
        generate(&stack.url()).await,
        200,
        "local (shared) → b (own token)"
    );
    assert_eq!(fake.handle().requests_to("/api/generate").len(), 2);

    // Revoked, e still holds its old snapshot and keys; b, on its next snapshot, no longer
    // accepts them, while local's hops go on.
    admin(&stack)
        .await
        .revoke_node(authed(api::RevokeNodeRequest {
            node: "e".to_owned(),
        }))
        .await
        .unwrap();
    harness::wait_for_version(&b, stack.control.hub().current().version).await;
    assert!(
        !e.app().store.load().hop_peers.is_empty(),
        "e kept its keys"
    );
    assert_ne!(generate(&e_url).await, 200, "a revoked edge's hop");
    assert_eq!(generate(&stack.url()).await, 200);
    assert_eq!(
        fake.handle().requests_to("/api/generate").len(),
        3,
        "the revoked edge's request never reached the box"
    );
    e.shutdown().await;
    b.shutdown().await;
    stack.shutdown().await;
}

/// The pair keys `node`'s first snapshot carries, from the control plane at `url`.
async fn pair_keys(url: &str, token: &str, node: &str) -> Vec<oqp_proto::policy::v1::HopPeer> {
    let mut client = PolicyServiceClient::connect(url.to_owned()).await.unwrap();
    let hello = NodeHello {
        node: node.to_owned(),
        ..NodeHello::default()
    };
    let mut stream = client
        .watch_policy(presenting(token, hello))
        .await
        .unwrap()
        .into_inner();
    stream
        .message()
        .await
        .unwrap()
        .expect("a first snapshot")
        .hop_peers
}

#[tokio::test]
async fn a_hop_root_minted_without_a_state_directory_survives_a_restart() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    // No state directory: the first `nodes add` creates it.
    let state = dir.path().join("state");
    let config_path = dir.path().join("config.yml");
    std::fs::write(&config_path, owned_by_b(&fake.url(), &state)).unwrap();
    let listener = harness::loopback().await;
    let url = format!("http://{}", listener.local_addr().unwrap());
    let control = harness::start_control_plane(&config_path, listener)
        .await
        .unwrap();
    assert!(!state.exists());
    let mut tokens = Vec::new();
    for node in ["b", "e"] {
        let mut admin = AdminServiceClient::connect(url.clone()).await.unwrap();
        let added = admin
            .add_node(authed(api::AddNodeRequest {
                node: node.to_owned(),
            }))
            .await
            .unwrap();
        tokens.push(added.into_inner().token);
    }
    let (b_token, e_token) = (&tokens[0], &tokens[1]);
    let before = pair_keys(&url, e_token, "e").await;
    assert!(before.iter().any(|peer| peer.node == "b"), "{before:?}");
    control.shutdown().await;

    // Restarted, the control plane hands out the same pair keys: a data plane still on
    // its last snapshot and one on the new control plane's verify each other's hops.
    let listener = harness::loopback().await;
    let url = format!("http://{}", listener.local_addr().unwrap());
    let control = harness::start_control_plane(&config_path, listener)
        .await
        .unwrap();
    assert_eq!(pair_keys(&url, e_token, "e").await, before);
    let b = harness::start_dataplane(&url, "b", Some(b_token))
        .await
        .unwrap();
    let e = harness::start_dataplane(&url, "e", Some(e_token))
        .await
        .unwrap();
    wait_peer(&e, "b").await;
    let e_url = format!("http://{}", e.local_addr());
    assert_eq!(generate(&e_url).await, 200, "e (own token) → b (own token)");
    e.shutdown().await;
    b.shutdown().await;
    control.shutdown().await;
}
