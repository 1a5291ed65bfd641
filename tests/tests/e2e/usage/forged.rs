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
