//! End to end: the key store and the key RPCs, through the real control
//! plane, two data planes and the fake Ollama. Add, rotate with grace,
//! revoke at every data plane, expiry, restarts, read-only config keys,
//! scopes on the admin API, and that no key value leaks.

use std::path::Path;
use std::time::{Duration, Instant};

use oqp_controlplane::keystore::{FILE_NAME, PREFIX};
use oqp_dataplane::DataPlane;
use oqp_proto::admin::v1::{self as api, admin_service_client::AdminServiceClient};
use oqp_proto::policy::v1 as wire;
use oqp_tests::client::HttpClient;
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::{self, ConfigYaml, Host, Key, Stack};
use sha2::{Digest, Sha256};
use tonic::transport::Channel;

const ADMIN: &str = "sk-admin-0123456789";
const READER: &str = "sk-read-0123456789";

fn config(url: &str, state_dir: &Path) -> String {
    ConfigYaml::new()
        .max_concurrent(4)
        .host(Host::ollama("primary", url))
        .under(
            "auth",
            "  rate_limit:\n    max_failures: 1000\n    window_seconds: 60\n",
        )
        .key(
            Key::new(ADMIN, "admin")
                .set("scope", "management")
                .set("max_priority", "high"),
        )
        .key(Key::new(READER, "widget").set("scope", "read"))
        .state_dir(state_dir)
        .yaml()
}

struct Setup {
    fake: FakeOllama,
    stack: Stack,
    state: tempfile::TempDir,
}

async fn setup() -> Setup {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let state = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(&fake.url(), state.path())).await;
    Setup { fake, stack, state }
}

async fn admin(stack: &Stack) -> AdminServiceClient<Channel> {
    AdminServiceClient::connect(stack.control_url())
        .await
        .unwrap()
}

/// A request carrying `key` as the caller's credential.
fn authed<T>(key: &str, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {key}").parse().unwrap());
    request
}

fn add_request(client_id: &str) -> api::AddKeyRequest {
    api::AddKeyRequest {
        client_id: client_id.to_owned(),
        scope: wire::Scope::Inference as i32,
        max_priority: wire::Tier::Low as i32,
        max_concurrent: 1,
        weight: 1.0,
        description: "nightly batch".to_owned(),
        ..api::AddKeyRequest::default()
    }
}

async fn add(stack: &Stack, request: api::AddKeyRequest) -> api::AddKeyResponse {
    let response = admin(stack)
        .await
        .add_key(authed(ADMIN, request))
        .await
        .unwrap()
        .into_inner();
    stack.wait_for_version(response.snapshot_version).await;
    response
}

/// Rotates `client_id`'s key with `grace_seconds` for the old one; waits
/// until the data plane serves the result.
async fn rotate(stack: &Stack, client_id: &str, grace_seconds: u64) -> api::RotateKeyResponse {
    let request = api::RotateKeyRequest {
        client_id: client_id.to_owned(),
        grace_seconds,
    };
    let response = admin(stack)
        .await
        .rotate_key(authed(ADMIN, request))
        .await
        .unwrap()
        .into_inner();
    stack.wait_for_version(response.snapshot_version).await;
    response
}

const GENERATE: &str = r#"{"model":"llama3","prompt":"hi","stream":false}"#;

/// The status of a generate call through `base` with `key`.
async fn generate(base: &str, key: &str) -> u16 {
    let authorization = format!("Bearer {key}");
    let reply = HttpClient::new()
        .send(
            http::Method::POST,
            &format!("{base}/api/generate"),
            &[
                ("authorization", authorization.as_str()),
                ("content-type", "application/json"),
            ],
            GENERATE,
        )
        .await;
    if reply.status == 401 {
        assert_eq!(reply.json()["error"], "invalid api key");
    }
    reply.status.as_u16()
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// How long after `started` the data plane applied `version`, checking that
/// it no longer carries `key`.
async fn applied(plane: &DataPlane, version: u64, key: &str, started: Instant) -> Duration {
    harness::wait_for_version(plane, version).await;
    let elapsed = started.elapsed();
    assert!(!carries(plane, key), "the data plane still carries the key");
    elapsed
}

/// Whether the data plane's current snapshot carries this key at all.
fn carries(dataplane: &DataPlane, key: &str) -> bool {
    dataplane
        .app()
        .store
        .load()
        .clients
        .contains_key(&digest(key))
}

fn local(stack: &Stack) -> &DataPlane {
    stack.control.dataplane().unwrap()
}

#[tokio::test]
async fn an_added_key_authenticates_at_the_data_plane_and_is_listed_without_its_value() {
    let Setup { fake, stack, state } = setup().await;
    let unknown = format!("{PREFIX}not-a-key-at-all-0123456789");
    assert_eq!(generate(&stack.url(), &unknown).await, 401);

    let added = add(&stack, add_request("batch")).await;
    assert!(added.key.starts_with(PREFIX), "{}", added.key);
    assert_eq!(added.key.len(), PREFIX.len() + 43);
    let info = added.info.clone().unwrap();
    assert_eq!(
        (info.client_id.as_str(), info.source.as_str()),
        ("batch", "store")
    );
    assert!(info.created_unix_ms > 0);

    assert_eq!(generate(&stack.url(), &added.key).await, 200);
    let seen = fake.handle().requests_to("/api/generate");
    assert_eq!(
        seen.last().unwrap().header("x-client-id").as_deref(),
        Some("batch")
    );
    assert_eq!(generate(&stack.url(), &unknown).await, 401);

    // A management key lists every tenant's keys; a read key only its own.
    let own = admin(&stack)
        .await
        .list_keys(authed(READER, api::ListKeysRequest {}))
        .await
        .unwrap()
        .into_inner();
    let own: Vec<_> = own.keys.iter().map(|key| key.client_id.as_str()).collect();
    assert_eq!(own, ["widget"]);
    let listed = admin(&stack)
        .await
        .list_keys(authed(ADMIN, api::ListKeysRequest {}))
        .await
        .unwrap()
        .into_inner();
    let rows: Vec<_> = listed
        .keys
        .iter()
        .map(|key| (key.client_id.as_str(), key.source.as_str()))
        .collect();
    assert_eq!(
        rows,
        [
            ("admin", "config"),
            ("widget", "config"),
            ("batch", "store")
        ]
    );
    let batch = &listed.keys[2];
    assert_eq!(batch.created_unix_ms, info.created_unix_ms);
    assert_eq!(batch.max_priority, wire::Tier::Low as i32);
    assert_eq!(batch.max_concurrent, 1);
    assert_eq!(batch.description, "nightly batch");
    assert!(!format!("{listed:?}").contains(&added.key[PREFIX.len()..]));

    let path = state.path().join(FILE_NAME);
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&path).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_rotated_key_keeps_working_for_its_grace_period_then_disappears_by_itself() {
    let Setup {
        stack,
        fake: _fake,
        state: _state,
    } = setup().await;
    let old = add(&stack, add_request("batch")).await.key;
    let rotated = rotate(&stack, "batch", 2).await;
    assert_ne!(rotated.key, old);
    let grace_end = rotated.old_key_expires_unix_ms;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    assert!(
        (1_000..=2_000).contains(&(grace_end - now)),
        "{}",
        grace_end - now
    );

    // During grace both keys work, and both name the same client.
    assert_eq!(generate(&stack.url(), &old).await, 200);
    assert_eq!(generate(&stack.url(), &rotated.key).await, 200);
    let policy = local(&stack).app().store.load();
    assert_eq!(&*policy.clients[&digest(&old)].id, "batch");
    assert_eq!(
        policy.clients_by_id["batch"].key_digest,
        Some(digest(&rotated.key)),
        "the current key comes first"
    );

    // No command: the control plane republishes at the end of grace. Versions
    // are wall-clock milliseconds, so that snapshot's version is at least the
    // deadline.
    stack.wait_for_version(grace_end as u64).await;
    assert!(!carries(local(&stack), &old));
    assert_eq!(generate(&stack.url(), &old).await, 401);
    assert_eq!(generate(&stack.url(), &rotated.key).await, 200);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_revoked_key_is_refused_at_two_data_planes_within_one_second() {
    let Setup {
        stack,
        fake: _fake,
        state: _state,
    } = setup().await;
    let second = stack.start_dataplane("second", None).await.unwrap();
    let second_url = format!("http://{}", second.local_addr());
    let key = add(&stack, add_request("batch")).await.key;
    harness::wait_for_version(&second, stack.control.hub().current().version).await;
    assert_eq!(generate(&stack.url(), &key).await, 200);
    assert_eq!(generate(&second_url, &key).await, 200);

    let mut client = admin(&stack).await;
    let started = Instant::now();
    let revoked = client
        .revoke_key(authed(
            ADMIN,
            api::RevokeKeyRequest {
                client_id: "batch".to_owned(),
            },
        ))
        .await
        .unwrap()
        .into_inner();
    let answered = started.elapsed();
    println!(
        "revoke answered (store written and fsynced, snapshot published) after {} ms",
        answered.as_millis()
    );
    let version = revoked.snapshot_version;
    let (first, other) = tokio::join!(
        applied(local(&stack), version, &key, started),
        applied(&second, version, &key, started)
    );
    for (dataplane, elapsed) in [("local", first), ("second", other)] {
        println!(
            "revoke propagation to data plane '{dataplane}': {} ms",
            elapsed.as_millis()
        );
        assert!(elapsed < Duration::from_secs(1), "{dataplane}: {elapsed:?}");
    }
    assert_eq!(generate(&stack.url(), &key).await, 401);
    assert_eq!(generate(&second_url, &key).await, 401);
    second.shutdown().await;
    stack.shutdown().await;
}

/// A generate call through `base` with `key`, answered in full.
async fn generate_reply(base: String, key: String) -> oqp_tests::client::Reply {
    HttpClient::new()
        .send(
            http::Method::POST,
            &format!("{base}/api/generate"),
            &[
                ("authorization", format!("Bearer {key}").as_str()),
                ("content-type", "application/json"),
            ],
            GENERATE,
        )
        .await
}

#[tokio::test]
async fn a_revoked_keys_waiting_requests_are_refused_and_never_reach_ollama() {
    let Setup {
        stack,
        fake,
        state: _state,
    } = setup().await;
    // `batch` may run one request at a time: the others wait in oqp's queue.
    let key = add(&stack, add_request("batch")).await.key;
    let handle = fake.handle();
    handle.hold();
    let running = tokio::spawn(generate_reply(stack.url(), key.clone()));
    handle.wait_in_flight(1).await;
    let waiting: Vec<_> = (0..2)
        .map(|_| tokio::spawn(generate_reply(stack.url(), key.clone())))
        .collect();
    let dispatcher = local(&stack).app().dispatcher.clone();
    assert!(
        oqp_tests::client::eventually(Duration::from_secs(30), || dispatcher.total_depth() == 2)
            .await
    );

    let revoked = admin(&stack)
        .await
        .revoke_key(authed(
            ADMIN,
            api::RevokeKeyRequest {
                client_id: "batch".to_owned(),
            },
        ))
        .await
        .unwrap()
        .into_inner();
    stack.wait_for_version(revoked.snapshot_version).await;
    for task in waiting {
        // Bounded, so that a request still waiting fails the test instead of hanging it.
        let reply = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("a waiting request of the revoked key was answered")
            .unwrap();
        assert_eq!(reply.status, 401, "{}", reply.text());
        assert_eq!(
            reply.json()["error"],
            "invalid api key (revoked or expired while the request was queued)"
        );
        assert_eq!(reply.header("www-authenticate").as_deref(), Some("Bearer"));
    }
    assert_eq!(dispatcher.total_depth(), 0);
    // What already ran finishes; the refused requests never reached Ollama.
    handle.release_all();
    assert_eq!(running.await.unwrap().status, 200);
    assert_eq!(handle.requests_to("/api/generate").len(), 1);
    stack.shutdown().await;
}

#[tokio::test]
async fn an_expiring_key_vanishes_at_its_expiry() {
    let Setup {
        stack,
        fake: _fake,
        state: _state,
    } = setup().await;
    let added = add(
        &stack,
        api::AddKeyRequest {
            expires_in_seconds: 2,
            ..add_request("temp")
        },
    )
    .await;
    let expires = added.info.unwrap().expires_unix_ms;
    assert!(expires > 0);
    assert_eq!(generate(&stack.url(), &added.key).await, 200);

    stack.wait_for_version(expires as u64).await;
    assert!(!carries(local(&stack), &added.key));
    assert_eq!(generate(&stack.url(), &added.key).await, 401);
    // Still listed, as expired, until revoked.
    let listed = admin(&stack)
        .await
        .list_keys(authed(ADMIN, api::ListKeysRequest {}))
        .await
        .unwrap()
        .into_inner();
    let temp = listed.keys.iter().find(|k| k.client_id == "temp").unwrap();
    assert_eq!(temp.expires_unix_ms, expires);
    stack.shutdown().await;
}

#[tokio::test]
async fn the_store_survives_a_control_plane_restart() {
    let Setup { fake, stack, state } = setup().await;
    let added = add(&stack, add_request("batch")).await;
    let rotated = rotate(&stack, "batch", 3600).await;
    stack.shutdown().await;

    let stack = Stack::start(&config(&fake.url(), state.path())).await;
    let listed = admin(&stack)
        .await
        .list_keys(authed(ADMIN, api::ListKeysRequest {}))
        .await
        .unwrap()
        .into_inner();
    let batch = listed.keys.iter().find(|k| k.client_id == "batch").unwrap();
    assert_eq!(batch.source, "store");
    assert_eq!(
        batch.created_unix_ms,
        rotated.info.as_ref().unwrap().created_unix_ms
    );
    // The new key and the old one (still in grace) both work after the restart.
    stack
        .wait_for_version(stack.control.hub().current().version)
        .await;
    assert_eq!(generate(&stack.url(), &rotated.key).await, 200);
    assert_eq!(generate(&stack.url(), &added.key).await, 200);
    stack.shutdown().await;
}

#[tokio::test]
async fn config_keys_are_read_only_to_the_admin_api() {
    let Setup {
        stack,
        state,
        fake: _fake,
    } = setup().await;
    let mut client = admin(&stack).await;
    let rotate = client
        .rotate_key(authed(
            ADMIN,
            api::RotateKeyRequest {
                client_id: "widget".to_owned(),
                grace_seconds: 0,
            },
        ))
        .await
        .unwrap_err();
    assert_eq!(rotate.code(), tonic::Code::FailedPrecondition);
    assert!(
        rotate
            .message()
            .contains("edit its auth.keys entry in config.yml"),
        "{}",
        rotate.message()
    );
    let revoke = client
        .revoke_key(authed(
            ADMIN,
            api::RevokeKeyRequest {
                client_id: "admin".to_owned(),
            },
        ))
        .await
        .unwrap_err();
    assert_eq!(revoke.code(), tonic::Code::FailedPrecondition);
    let added = client
        .add_key(authed(ADMIN, add_request("widget")))
        .await
        .unwrap_err();
    assert_eq!(added.code(), tonic::Code::AlreadyExists);
    assert!(
        added.message().contains("config file"),
        "{}",
        added.message()
    );
    let missing = client
        .revoke_key(authed(
            ADMIN,
            api::RevokeKeyRequest {
                client_id: "nobody".to_owned(),
            },
        ))
        .await
        .unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound);
    let invalid = client
        .add_key(authed(
            ADMIN,
            api::AddKeyRequest {
                max_concurrent: 5,
                ..add_request("greedy")
            },
        ))
        .await
        .unwrap_err();
    assert_eq!(invalid.code(), tonic::Code::InvalidArgument);
    assert!(invalid.message().contains("proxy.max_concurrent (4)"));
    // The config keys still work, and nothing was written.
    assert_eq!(generate(&stack.url(), ADMIN).await, 200);
    assert!(!state.path().join(FILE_NAME).exists());
    stack.shutdown().await;
}

#[tokio::test]
async fn the_admin_api_checks_scopes_for_config_and_stored_keys() {
    let Setup {
        stack,
        fake: _fake,
        state: _state,
    } = setup().await;
    let mut client = admin(&stack).await;

    let anonymous = client.list_keys(api::ListKeysRequest {}).await.unwrap_err();
    assert_eq!(anonymous.code(), tonic::Code::Unauthenticated);
    assert!(
        anonymous.message().contains("OQPCTL_KEY"),
        "{}",
        anonymous.message()
    );
    let wrong = client
        .list_keys(authed("oqp_wrong", api::ListKeysRequest {}))
        .await
        .unwrap_err();
    assert_eq!(
        (wrong.code(), wrong.message()),
        (tonic::Code::Unauthenticated, "invalid api key")
    );

    // A read key lists and sees status but changes nothing.
    client
        .list_keys(authed(READER, api::ListKeysRequest {}))
        .await
        .unwrap();
    client
        .get_status(authed(READER, api::GetStatusRequest {}))
        .await
        .unwrap();
    let denied = client
        .add_key(authed(READER, add_request("sneaky")))
        .await
        .unwrap_err();
    assert_eq!(
        (denied.code(), denied.message()),
        (
            tonic::Code::PermissionDenied,
            "management permission required"
        )
    );

    // Stored keys count too, with their own scopes.
    let stored_reader = add(
        &stack,
        api::AddKeyRequest {
            scope: wire::Scope::Read as i32,
            ..add_request("dashboard")
        },
    )
    .await
    .key;
    let stored_inference = add(&stack, add_request("batch")).await.key;
    let stored_admin = add(
        &stack,
        api::AddKeyRequest {
            scope: wire::Scope::Management as i32,
            ..add_request("ops")
        },
    )
    .await
    .key;
    for key in [&stored_reader, &stored_inference] {
        client
            .list_keys(authed(key, api::ListKeysRequest {}))
            .await
            .unwrap();
        let denied = client
            .revoke_key(authed(
                key,
                api::RevokeKeyRequest {
                    client_id: "ops".to_owned(),
                },
            ))
            .await
            .unwrap_err();
        assert_eq!(denied.code(), tonic::Code::PermissionDenied);
    }
    client
        .add_key(authed(&stored_admin, add_request("made-by-ops")))
        .await
        .unwrap();
    client
        .pause_tier(authed(&stored_admin, api::TierRequest { tier: 0 }))
        .await
        .unwrap();
    // Revoked: refused at once, at the admin API too.
    client
        .revoke_key(authed(
            ADMIN,
            api::RevokeKeyRequest {
                client_id: "ops".to_owned(),
            },
        ))
        .await
        .unwrap();
    let gone = client
        .list_keys(authed(&stored_admin, api::ListKeysRequest {}))
        .await
        .unwrap_err();
    assert_eq!(gone.code(), tonic::Code::Unauthenticated);
    stack.shutdown().await;
}

#[tokio::test]
async fn key_values_never_leak_into_debug_listings_status_or_the_store_file() {
    let Setup {
        stack,
        state,
        fake: _fake,
    } = setup().await;
    let second = stack.start_dataplane("second", None).await.unwrap();
    let added = add(&stack, add_request("batch")).await;
    let rotated = rotate(&stack, "batch", 600).await;
    harness::wait_for_version(&second, rotated.snapshot_version).await;
    assert_eq!(generate(&stack.url(), &rotated.key).await, 200);

    let mut client = admin(&stack).await;
    let listed = client
        .list_keys(authed(ADMIN, api::ListKeysRequest {}))
        .await
        .unwrap()
        .into_inner();
    let status = client
        .get_status(authed(ADMIN, api::GetStatusRequest {}))
        .await
        .unwrap()
        .into_inner();
    let clients = client
        .list_clients(authed(ADMIN, api::ListClientsRequest {}))
        .await
        .unwrap()
        .into_inner();
    let places = [
        ("control plane Debug", format!("{:?}", stack.control)),
        ("key store Debug", format!("{:?}", stack.control.keys())),
        ("hub Debug", format!("{:?}", stack.control.hub())),
        ("snapshot", format!("{:?}", stack.control.hub().current())),
        ("data plane Debug", format!("{second:?}")),
        ("ListKeys", format!("{listed:?}")),
        ("GetStatus", format!("{status:?}")),
        ("ListClients", format!("{clients:?}")),
        (
            "store file",
            std::fs::read_to_string(state.path().join(FILE_NAME)).unwrap(),
        ),
    ];
    let file = &places.last().unwrap().1;
    assert!(file.contains(&hex(&digest(&rotated.key))), "{file}");
    assert!(file.contains(&hex(&digest(&added.key))), "{file}");
    for key in [&added.key, &rotated.key] {
        let secret = &key[PREFIX.len()..];
        for (place, text) in &places {
            assert!(!text.contains(secret), "{place} carries a key value");
        }
    }
    second.shutdown().await;
    stack.shutdown().await;
}

/// With auth off: no key is minted over gRPC, a change from loopback still
/// works (the non-loopback refusal is a function of the peer address, unit
/// tested in `grpc::admin`), and `POST /queue/*` refuses what a cross-site
/// page can send without a preflight.
#[tokio::test]
async fn with_auth_off_keys_are_not_minted_and_queue_control_refuses_cross_site_calls() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let state = tempfile::tempdir().unwrap();
    let yaml = format!(
        "{}control_plane:\n  state_dir: \"{}\"\n",
        harness::basic_config(&fake.url()),
        state.path().display()
    );
    let stack = Stack::start(&yaml).await;
    let mut client = admin(&stack).await;
    for refused in [
        client.add_key(add_request("batch")).await.unwrap_err(),
        client
            .rotate_key(api::RotateKeyRequest {
                client_id: "batch".into(),
                grace_seconds: 0,
            })
            .await
            .unwrap_err(),
    ] {
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
        assert!(
            refused.message().contains("auth is disabled"),
            "{}",
            refused.message()
        );
    }
    assert!(stack.control.keys().records().is_empty());

    let http = HttpClient::new();
    let url = format!("{}/queue/pause?tier=low", stack.url());
    let own = format!("http://{}", stack.proxy_addr());
    for (headers, body, status) in [
        (vec![("origin", "http://evil.example")], "", 403),
        (vec![("origin", "null")], "", 403),
        // DNS rebinding: a page whose name now resolves to the proxy.
        (
            vec![
                ("host", "rebound.example:11435"),
                ("origin", "http://rebound.example:11435"),
            ],
            "",
            403,
        ),
        (vec![("content-type", "text/plain")], "{}", 415),
        (
            vec![("content-type", "application/x-www-form-urlencoded")],
            "a=b",
            415,
        ),
        (
            vec![("content-type", "multipart/form-data; boundary=x")],
            "",
            415,
        ),
        (
            vec![("origin", own.as_str()), ("content-type", "text/plain")],
            "{}",
            415,
        ),
    ] {
        let reply = http
            .send(http::Method::POST, &url, &headers, body.to_owned())
            .await;
        assert_eq!(reply.status, status, "{headers:?}");
        assert!(reply.json()["request_id"].is_string());
    }
    assert_eq!(stack.control.hub().runtime().paused, [false; 3]);

    let same_origin = http
        .send(http::Method::POST, &url, &[("origin", own.as_str())], "")
        .await;
    assert_eq!(same_origin.status, 200, "{}", same_origin.text());
    assert_eq!(stack.control.hub().runtime().paused, [false, false, true]);
    let resumed = client
        .resume_tier(api::TierRequest {
            tier: wire::Tier::Low as i32,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resumed.status, "resumed");
    stack.shutdown().await;
}
