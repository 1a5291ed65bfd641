//! End to end: usage reports a data plane did not send. The control plane takes reports only
//! with a node token — its own when none is configured, which the in-process data plane
//! presents — bounds what an authenticated reporter claims by what its slots could have
//! done, and refuses an epoch far ahead of its clock, so that the real data plane's reports
//! still count after one. And a tenant's own key reads only its own usage, keys and client, on
//! the admin API and in the data plane's `/queue/status`.

use std::time::{SystemTime, UNIX_EPOCH};

use oqp_proto::policy::v1::{
    NodeReport, UsageBatch, UsageRow, policy_service_client::PolicyServiceClient,
};
use oqp_tests::harness::Stack;
use serde_json::json;

use super::{SECOND, config, fake, post, usage_of, wait_for_requests};

/// A watch under `node` presenting usage epoch `epoch`, with `token`: the stream, kept open
/// as long as it is held.
async fn hold(
    control_url: &str,
    token: &str,
    node: &str,
    epoch: u64,
) -> tonic::Streaming<oqp_proto::policy::v1::PolicySnapshot> {
    let mut client = PolicyServiceClient::connect(control_url.to_owned())
        .await
        .unwrap();
    let mut request = tonic::Request::new(oqp_proto::policy::v1::NodeHello {
        node: node.to_owned(),
        usage_epoch: epoch,
        ..Default::default()
    });
    request.metadata_mut().insert(
        oqp_proto::NODE_TOKEN_METADATA,
        oqp_dataplane::node_keys::grpc_credential(token)
            .parse()
            .unwrap(),
    );
    let mut stream = client.watch_policy(request).await.unwrap().into_inner();
    stream.message().await.unwrap().expect("a first snapshot");
    stream
}

/// A report from `node` claiming `gpu_s` GPU-seconds for client `chat`, presenting `token`.
async fn forge(
    control_url: &str,
    token: Option<&str>,
    node: &str,
    epoch: u64,
    gpu_s: u64,
) -> Result<u64, tonic::Status> {
    let mut client = PolicyServiceClient::connect(control_url.to_owned())
        .await
        .unwrap();
    let mut request = tonic::Request::new(NodeReport {
        node: node.to_owned(),
        usage: Some(UsageBatch {
            epoch,
            seq: 1,
            rows: vec![UsageRow {
                client_id: "chat".to_owned(),
                model: "llama3".to_owned(),
                gpu_ns: gpu_s * SECOND,
                requests: 1,
                ..UsageRow::default()
            }],
        }),
        ..NodeReport::default()
    });
    if let Some(token) = token {
        request.metadata_mut().insert(
            oqp_proto::NODE_TOKEN_METADATA,
            oqp_dataplane::node_keys::grpc_credential(token)
                .parse()
                .unwrap(),
        );
    }
    client
        .report_status(request)
        .await
        .map(|ack| ack.into_inner().usage_seq)
}

#[tokio::test]
async fn forged_usage_reports_are_refused_bounded_or_kept_from_blocking_the_real_ones() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    // No node token configured: the single-box default.
    let stack = Stack::start(&config(&fake.url(), &dir.path().display().to_string(), "")).await;
    let control_url = stack.control_url();
    let now_ms = u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap();

    // Anyone who reaches the port, with no token or a guessed one: refused, nothing counted.
    for token in [None, Some("guess")] {
        let refused = forge(&control_url, token, "local", now_ms, 10_000)
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{token:?}");
    }
    let usage = usage_of(&control_url, 0, true, true).await;
    assert_eq!(
        usage.total.unwrap_or_default().gpu_ns,
        0,
        "{:?}",
        usage.rows
    );
    let token = stack.control.node_token().to_owned();
    assert!(
        std::fs::read_to_string(dir.path().join("node_token"))
            .unwrap()
            .contains(&token),
        "kept in the state directory for a data plane run beside it"
    );

    // A reporter holding the token claims 10,000 GPU-s for a box of 4 slots that started a
    // second ago: cut to what 4 slots could have done (at most a minute each, first seen).
    let _watch = hold(&control_url, &token, "forger", now_ms - 1_000).await;
    assert_eq!(
        forge(&control_url, Some(&token), "forger", now_ms - 1_000, 10_000)
            .await
            .unwrap(),
        1,
        "applied (cut) and acknowledged, so it is not resent for ever"
    );
    let claimed = usage_of(&control_url, 0, true, true).await;
    let gpu = claimed.total.unwrap_or_default().gpu_ns;
    assert!(gpu > 0 && gpu <= 4 * 60 * SECOND, "{gpu} ns");

    // An epoch of 2^63 under the real data plane's name: refused, not kept, so the real
    // data plane's next report still counts.
    assert_eq!(
        forge(&control_url, Some(&token), "local", 1 << 63, 10_000)
            .await
            .unwrap(),
        0
    );
    post(
        &stack.url(),
        "/api/generate",
        "total_duration=2000000000,prompt_eval_count=1,eval_count=1",
        json!({"model": "llama3", "prompt": "hi", "stream": false}),
    )
    .await;
    let usage = wait_for_requests(&control_url, 2).await;
    assert_eq!(
        usage.total.unwrap_or_default().gpu_ns,
        gpu + 2 * SECOND,
        "the real request, counted"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn a_tenants_key_sees_only_its_own_usage_keys_and_client() {
    use oqp_proto::admin::v1::{
        self as api, ListClientsRequest, ListKeysRequest, admin_service_client::AdminServiceClient,
    };
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let batch = "sk-batch-0123456789";
    let extra = format!("    - key: \"{batch}\"\n      client_id: batch\n");
    let stack = Stack::start(&config(
        &fake.url(),
        &dir.path().display().to_string(),
        &extra,
    ))
    .await;
    let generate = json!({"model": "llama3", "prompt": "hi", "stream": false});
    let one_second = "total_duration=1000000000,prompt_eval_count=1,eval_count=1";
    post(&stack.url(), "/api/generate", one_second, generate.clone()).await;
    let reply = oqp_tests::client::HttpClient::new()
        .post_json(
            &format!("{}/api/generate", stack.url()),
            &[
                ("authorization", &format!("Bearer {batch}")),
                (oqp_tests::fake::USAGE_HEADER, one_second),
            ],
            &generate,
        )
        .await;
    assert_eq!(reply.status, 200);
    // The management key sees both.
    let all = wait_for_requests(&stack.control_url(), 2).await;
    assert!(all.rows.iter().any(|row| row.client_id == "batch"));
    let as_key = |key: &str| {
        let url = stack.control_url();
        let key = key.to_owned();
        async move {
            let mut admin = AdminServiceClient::connect(url).await.unwrap();
            let usage = admin
                .get_usage(authorized(
                    &key,
                    api::GetUsageRequest {
                        since_seconds: 0,
                        by_client: false,
                        by_model: true,
                    },
                ))
                .await
                .unwrap()
                .into_inner();
            let keys = admin
                .list_keys(authorized(&key, ListKeysRequest::default()))
                .await
                .unwrap()
                .into_inner();
            let clients = admin
                .list_clients(authorized(&key, ListClientsRequest::default()))
                .await
                .unwrap()
                .into_inner();
            (
                usage,
                keys.keys
                    .into_iter()
                    .map(|key| key.client_id)
                    .collect::<Vec<_>>(),
                clients
                    .clients
                    .into_iter()
                    .map(|client| client.client_id)
                    .collect::<Vec<_>>(),
            )
        }
    };
    // A tenant's inference key: its own figures only, even grouped by model alone.
    let (usage, keys, clients) = as_key(super::CHAT_KEY).await;
    assert_eq!(
        usage.total.unwrap_or_default().requests,
        1,
        "{:?}",
        usage.rows
    );
    assert_eq!(keys, ["chat"]);
    assert_eq!(clients, ["chat"]);
    let (usage, keys, _) = as_key(super::ADMIN_KEY).await;
    assert_eq!(usage.total.unwrap_or_default().requests, 2);
    assert!(keys.len() >= 3, "{keys:?}");
    // The data plane's /queue/status: the tenant's key sees its own usage today, not the
    // other tenant's (whose row, and queue figures, stay for the dashboard); the
    // management key sees both.
    let status = |key: &str| {
        let url = format!("{}/queue/status", stack.url());
        let auth = format!("Bearer {key}");
        async move {
            oqp_tests::client::HttpClient::new()
                .get(&url, &[("authorization", &auth)])
                .await
                .json()
        }
    };
    let seen = status(super::CHAT_KEY).await;
    assert_eq!(
        seen["clients"]["chat"]["usage_today"]["requests"], 1,
        "{seen}"
    );
    assert_eq!(seen["clients"]["batch"]["processed"], 1, "{seen}");
    assert!(
        seen["clients"]["batch"].get("usage_today").is_none(),
        "{seen}"
    );
    let seen = status(super::ADMIN_KEY).await;
    assert_eq!(
        seen["clients"]["batch"]["usage_today"]["requests"], 1,
        "{seen}"
    );
    assert_eq!(
        seen["clients"]["chat"]["usage_today"]["requests"], 1,
        "{seen}"
    );
    stack.shutdown().await;
}

/// `message` with `key` as its bearer.
fn authorized<T>(key: &str, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {key}").parse().unwrap());
    request
}

fn now_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

#[tokio::test]
async fn names_nobody_configured_share_one_allowance_and_only_a_names_holder_reports() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(&fake.url(), &dir.path().display().to_string(), "")).await;
    let control_url = stack.control_url();
    let token = stack.control.node_token().to_owned();
    let an_hour_ago = now_ms() - 3_600_000;

    // A name no watch holds: refused, nothing counted.
    assert_eq!(
        forge(&control_url, Some(&token), "ghost-9", an_hour_ago, 10_000)
            .await
            .unwrap(),
        0
    );
    // Three names nobody configured, each held by a watch, each claiming 10,000 GPU-s of a
    // box that has run an hour: they share one allowance, an hour of the 4 unowned slots
    // (14,400 s), where each name had one of its own before (30,000 s charged).
    let mut watches = Vec::new();
    for ghost in ["ghost-0", "ghost-1", "ghost-2"] {
        watches.push(hold(&control_url, &token, ghost, an_hour_ago).await);
        assert_eq!(
            forge(&control_url, Some(&token), ghost, an_hour_ago, 10_000)
                .await
                .unwrap(),
            1,
            "{ghost}: applied (cut) and acknowledged"
        );
    }
    let gpu = usage_of(&control_url, 0, true, true)
        .await
        .total
        .unwrap_or_default()
        .gpu_ns;
    // The allowance fills at 4 slot-seconds a second while the test runs: a minute of
    // slack covers a slow machine.
    assert!(gpu <= (4 * 3_600 + 4 * 60) * SECOND, "{} s", gpu / SECOND);

    // Under the name of the in-process data plane, which holds `local`: an empty batch 4
    // minutes ahead (which froze its accounting until a restart), and one of another epoch
    // now, are both refused, with why.
    for epoch in [now_ms() + 240_000, now_ms()] {
        let mut client = PolicyServiceClient::connect(control_url.clone())
            .await
            .unwrap();
        let mut request = tonic::Request::new(NodeReport {
            node: "local".to_owned(),
            usage: Some(UsageBatch {
                epoch,
                seq: 1,
                rows: Vec::new(),
            }),
            ..NodeReport::default()
        });
        request.metadata_mut().insert(
            oqp_proto::NODE_TOKEN_METADATA,
            oqp_dataplane::node_keys::grpc_credential(&token)
                .parse()
                .unwrap(),
        );
        let ack = client.report_status(request).await.unwrap().into_inner();
        assert_eq!(ack.usage_seq, 0);
        assert!(!ack.usage_refused.is_empty(), "{ack:?}");
    }
    let before = usage_of(&control_url, 0, true, true)
        .await
        .total
        .unwrap_or_default();
    post(
        &stack.url(),
        "/api/generate",
        "total_duration=2000000000,prompt_eval_count=1,eval_count=1",
        json!({"model": "llama3", "prompt": "hi", "stream": false}),
    )
    .await;
    let usage = wait_for_requests(&control_url, before.requests + 1).await;
    assert_eq!(
        usage.total.unwrap_or_default().gpu_ns,
        before.gpu_ns + 2 * SECOND,
        "the real data plane's request, counted"
    );
    drop(watches);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_data_plane_whose_batch_is_refused_backs_off_and_stops_at_once() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(&fake.url(), &dir.path().display().to_string(), "")).await;
    // Two data planes started with the same --node (owning no host, so both may watch):
    // the first holds the name, the second's batches are refused.
    let first = stack.start_dataplane("edge", None).await.unwrap();
    let second = stack.start_dataplane("edge", None).await.unwrap();
    let usage = second.app().usage.clone();
    post(
        &format!("http://{}", second.local_addr()),
        "/api/generate",
        "total_duration=1000000000,prompt_eval_count=1,eval_count=1",
        json!({"model": "llama3", "prompt": "hi", "stream": false}),
    )
    .await;
    assert!(
        oqp_tests::client::eventually(std::time::Duration::from_secs(10), || usage
            .refused()
            .is_some())
        .await,
        "the second data plane's batch was refused"
    );
    // Stopping: no more sends of a batch refused for good (it was sent again as fast as
    // the link allowed, for 5 s, before).
    let sent = usage.batches_sent();
    second.shutdown().await;
    assert!(
        usage.batches_sent() <= sent + 1,
        "{} more",
        usage.batches_sent() - sent
    );
    // The holder's usage counts.
    post(
        &format!("http://{}", first.local_addr()),
        "/api/generate",
        "total_duration=1000000000,prompt_eval_count=1,eval_count=1",
        json!({"model": "llama3", "prompt": "hi", "stream": false}),
    )
    .await;
    wait_for_requests(&stack.control_url(), 1).await;
    first.shutdown().await;
    stack.shutdown().await;
}
