//! The audit trail end to end: management actions made with the real
//! oqpctl binary against a real control plane land in
//! `state_dir/audit.jsonl` with their actor and outcome, and no key
//! material.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Output;

use oqp_controlplane::config::Env;
use oqp_controlplane::{ControlPlane, Options};

const ADMIN: &str = "sk-admin-0123456789";
const READER: &str = "sk-read-0123456789";

async fn control_plane(dir: &Path) -> ControlPlane {
    control_plane_with(dir, "").await
}

/// A control plane with `extra` appended to its `control_plane:` section.
async fn control_plane_with(dir: &Path, extra: &str) -> ControlPlane {
    start(dir, extra, false).await
}

/// A control plane, with its single-box data plane when `with_dataplane`.
async fn start(dir: &Path, extra: &str, with_dataplane: bool) -> ControlPlane {
    // The trail is written to a file once the state directory exists.
    if !dir.join("state").exists() {
        std::fs::create_dir(dir.join("state")).unwrap();
    }
    let config = dir.join("config.yml");
    std::fs::write(
        &config,
        format!(
            "ollama:\n  hosts:\n    - {{url: 'http://127.0.0.1:9', name: nowhere}}\n\
             auth:\n  enabled: true\n  keys:\n\
             \x20   - {{key: {ADMIN}, client_id: admin, scope: management}}\n\
             \x20   - {{key: {READER}, client_id: widget, scope: read}}\n\
             control_plane:\n  state_dir: '{}'\n{extra}",
            dir.join("state").display()
        ),
    )
    .unwrap();
    ControlPlane::start(Options {
        config_path: config,
        env: Env::empty(),
        listener: Some(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()),
        with_dataplane,
        dataplane_listener: if with_dataplane {
            Some(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap())
        } else {
            None
        },
        clock: None,
    })
    .await
    .unwrap()
}

async fn oqpctl(control: &ControlPlane, key: Option<&str>, args: &[&str]) -> Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_oqpctl"));
    command
        .arg("--control-plane")
        .arg(format!("http://{}", control.local_addr()))
        .arg("--no-color")
        .args(args)
        .env_remove("OQPCTL_KEY")
        .env_remove("OQP_CONTROL_PLANE");
    if let Some(key) = key {
        command.env("OQPCTL_KEY", key);
    }
    command.output().await.unwrap()
}

/// The trail's lines, parsed.
fn trail(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("state/audit.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

fn find<'a>(
    trail: &'a [serde_json::Value],
    action: &str,
    outcome: &str,
) -> Option<&'a serde_json::Value> {
    trail
        .iter()
        .find(|entry| entry["action"] == action && entry["outcome"] == outcome)
}

#[tokio::test]
async fn keys_added_rotated_revoked_are_recorded_without_key_material() {
    let scratch = tempfile::tempdir().unwrap();
    let control = control_plane(scratch.path()).await;
    let added = oqpctl(
        &control,
        Some(ADMIN),
        &[
            "--output",
            "json",
            "keys",
            "add",
            "batch",
            "--max-priority",
            "low",
            "--scope",
            "inference",
        ],
    )
    .await;
    assert!(
        added.status.success(),
        "{}",
        String::from_utf8_lossy(&added.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&added.stdout).unwrap();
    let first = json["key"].as_str().unwrap().to_owned();
    let rotated = oqpctl(
        &control,
        Some(ADMIN),
        &["--output", "json", "keys", "rotate", "batch"],
    )
    .await;
    assert!(rotated.status.success());
    let json: serde_json::Value = serde_json::from_slice(&rotated.stdout).unwrap();
    let second = json["key"].as_str().unwrap().to_owned();
    let revoked = oqpctl(&control, Some(ADMIN), &["keys", "revoke", "batch"]).await;
    assert!(revoked.status.success());
    // Revoking it again is refused, and recorded as such.
    let again = oqpctl(&control, Some(ADMIN), &["keys", "revoke", "batch"]).await;
    assert!(!again.status.success());

    let entries = trail(scratch.path());
    for action in ["keys.add", "keys.rotate", "keys.revoke"] {
        let entry = find(&entries, action, "ok").unwrap_or_else(|| panic!("{action}: {entries:?}"));
        assert_eq!(entry["actor"], "admin");
        assert_eq!(entry["target"], "batch");
        assert!(
            entry["source"].as_str().unwrap().starts_with("127.0.0.1:"),
            "{entry}"
        );
        assert!(entry["time"].as_str().unwrap().ends_with('Z'));
    }
    let refused = find(&entries, "keys.revoke", "refused").unwrap();
    assert!(!refused["reason"].as_str().unwrap().is_empty());

    let text = std::fs::read_to_string(scratch.path().join("state/audit.jsonl")).unwrap();
    for secret in [first.as_str(), second.as_str(), ADMIN, READER] {
        assert!(!text.contains(secret), "key material in the trail");
    }

    // The same through `oqpctl audit`: JSON lines, then the table.
    let listed = oqpctl(
        &control,
        Some(ADMIN),
        &["audit", "--since", "1h", "--action", "keys", "--json"],
    )
    .await;
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    let listed = String::from_utf8(listed.stdout).unwrap();
    let lines: Vec<serde_json::Value> = listed
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let actions: Vec<(&str, &str)> = lines
        .iter()
        .map(|e| {
            (
                e["action"].as_str().unwrap(),
                e["outcome"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        actions,
        [
            ("keys.add", "ok"),
            ("keys.rotate", "ok"),
            ("keys.revoke", "ok"),
            ("keys.revoke", "refused")
        ]
    );
    assert!(lines.iter().all(|e| e["actor"] == "admin"));
    for secret in [first.as_str(), second.as_str(), ADMIN] {
        assert!(!listed.contains(secret));
    }
    let table = oqpctl(
        &control,
        Some(ADMIN),
        &["audit", "--action", "keys.revoke", "--limit", "1"],
    )
    .await;
    let table = String::from_utf8(table.stdout).unwrap();
    let rows: Vec<&str> = table.lines().collect();
    assert_eq!(rows.len(), 2, "{table}");
    assert!(rows[0].starts_with("TIME (UTC)"));
    assert!(
        rows[1].contains("admin") && rows[1].contains("keys.revoke") && rows[1].contains("refused"),
        "{table}"
    );
    assert!(rows.iter().all(|row| row.chars().count() <= 100));
    // The trail is for management keys only; asking is refused and recorded.
    let reader = oqpctl(&control, Some(READER), &["audit"]).await;
    assert_eq!(reader.status.code(), Some(1));
    let entries = trail(scratch.path());
    let asked = find(&entries, "audit.list", "refused").unwrap();
    assert_eq!(asked["actor"], "widget");

    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(scratch.path().join("state/audit.jsonl"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    control.shutdown().await;
}

#[tokio::test]
async fn refused_admin_calls_are_recorded() {
    let scratch = tempfile::tempdir().unwrap();
    let control = control_plane(scratch.path()).await;
    // A read key asks for a change; a wrong key asks for a read.
    let scope = oqpctl(&control, Some(READER), &["keys", "revoke", "admin"]).await;
    assert!(!scope.status.success());
    let wrong = oqpctl(&control, Some("sk-wrong-0123456789"), &["keys", "list"]).await;
    assert!(!wrong.status.success());

    let entries = trail(scratch.path());
    let scope = find(&entries, "keys.revoke", "refused").unwrap();
    assert_eq!(scope["actor"], "widget");
    assert_eq!(scope["reason"], "management permission required");
    let wrong = find(&entries, "keys.list", "refused").unwrap();
    assert_eq!(wrong["actor"], "unknown");
    assert_eq!(wrong["reason"], "invalid api key");
    let text = std::fs::read_to_string(scratch.path().join("state/audit.jsonl")).unwrap();
    assert!(!text.contains("sk-wrong-0123456789") && !text.contains(READER));
    control.shutdown().await;
}

#[tokio::test]
async fn reloads_are_recorded_with_their_result() {
    let scratch = tempfile::tempdir().unwrap();
    let control = control_plane(scratch.path()).await;
    // Through the admin call, then as on SIGHUP.
    let mut admin = oqp_proto::admin::v1::admin_service_client::AdminServiceClient::connect(
        format!("http://{}", control.local_addr()),
    )
    .await
    .unwrap();
    let mut request = tonic::Request::new(oqp_proto::admin::v1::ReloadRequest {});
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {ADMIN}").parse().unwrap());
    admin.reload(request).await.unwrap();
    control.reload().unwrap();
    std::fs::write(scratch.path().join("config.yml"), "ollama: [not a map\n").unwrap();
    control.reload().unwrap_err();

    let entries = trail(scratch.path());
    let reloads: Vec<_> = entries
        .iter()
        .filter(|entry| entry["action"] == "config.reload")
        .collect();
    assert_eq!(reloads.len(), 3, "{reloads:?}");
    assert_eq!(reloads[0]["actor"], "admin");
    assert_eq!(reloads[0]["outcome"], "ok");
    assert!(
        reloads[0]["target"]
            .as_str()
            .unwrap()
            .starts_with("version ")
    );
    assert_eq!(reloads[1]["actor"], "local");
    assert_eq!(reloads[1]["outcome"], "ok");
    assert_eq!(reloads[2]["actor"], "local");
    assert_eq!(reloads[2]["outcome"], "refused");
    assert!(!reloads[2]["reason"].as_str().unwrap().is_empty());
    control.shutdown().await;
}

#[tokio::test]
async fn the_trail_rotates_at_its_size_limit_and_keeps_the_retention() {
    let scratch = tempfile::tempdir().unwrap();
    let state = scratch.path().join("state");
    std::fs::create_dir(&state).unwrap();
    // A trail already at its 1 MiB limit, and one rotated file (the retention).
    let line = |target: &str| {
        format!(
            "{{\"time\":\"2026-01-01T00:00:00.000Z\",\"actor\":\"admin\",\
             \"action\":\"queue.pause\",\"target\":\"{target}\",\"outcome\":\"ok\"}}\n"
        )
    };
    let full = line("current").repeat(1024 * 1024 / line("current").len() + 1);
    std::fs::write(state.join("audit.jsonl"), &full).unwrap();
    std::fs::write(state.join("audit.jsonl.1"), line("oldest")).unwrap();
    let control =
        control_plane_with(scratch.path(), "  audit: {max_file_mb: 1, keep_files: 1}\n").await;
    let revoked = oqpctl(&control, Some(ADMIN), &["keys", "revoke", "nobody"]).await;
    assert!(!revoked.status.success());

    // The full file became `.1`, the old `.1` is gone (one kept), the new
    // entry starts a fresh file.
    assert_eq!(
        std::fs::read_to_string(state.join("audit.jsonl.1")).unwrap(),
        full
    );
    assert!(!state.join("audit.jsonl.2").exists());
    let entries = trail(scratch.path());
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0]["action"], "keys.revoke");
    assert_eq!(entries[0]["outcome"], "refused");
    control.shutdown().await;
}

/// A webhook receiver on 127.0.0.1:0: answers 204 and hands over each body.
async fn webhook_sink() -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<serde_json::Value>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buffer = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let read = stream.read(&mut chunk).await.unwrap_or(0);
                    if read == 0 {
                        return;
                    }
                    buffer.extend_from_slice(&chunk[..read]);
                    let text = String::from_utf8_lossy(&buffer).into_owned();
                    let Some(end) = text.find("\r\n\r\n") else {
                        continue;
                    };
                    let length: usize = text[..end]
                        .lines()
                        .find_map(|line| {
                            let (name, value) = line.split_once(':')?;
                            name.eq_ignore_ascii_case("content-length")
                                .then(|| value.trim().parse().ok())?
                        })
                        .unwrap_or(0);
                    if buffer.len() < end + 4 + length {
                        continue;
                    }
                    let body = &buffer[end + 4..end + 4 + length];
                    let _ = tx.send(serde_json::from_slice(body).unwrap());
                    let _ = stream
                        .write_all(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n")
                        .await;
                    return;
                }
            });
        }
    });
    (addr, rx)
}

#[tokio::test]
async fn an_audit_webhook_carries_each_entry_when_subscribed() {
    let scratch = tempfile::tempdir().unwrap();
    let (sink, mut bodies) = webhook_sink().await;
    let control = control_plane_with(
        scratch.path(),
        &format!(
            "webhooks:\n  enabled: true\n  url: \"http://{sink}/hook\"\n  \
             allowed_hosts: [\"127.0.0.1\"]\n  events: [audit]\n"
        ),
    )
    .await;
    let refused = oqpctl(&control, Some(READER), &["keys", "revoke", "batch"]).await;
    assert!(!refused.status.success());
    let body = tokio::time::timeout(std::time::Duration::from_secs(10), bodies.recv())
        .await
        .expect("no webhook arrived")
        .unwrap();
    assert_eq!(body["event"], "audit");
    assert_eq!(body["action"], "keys.revoke");
    assert_eq!(body["actor"], "widget");
    assert_eq!(body["outcome"], "refused");
    assert_eq!(body["reason"], "management permission required");
    assert!(!body.to_string().contains(READER));
    control.shutdown().await;
}

#[tokio::test]
async fn an_expired_key_is_recorded_by_local() {
    let scratch = tempfile::tempdir().unwrap();
    let control = control_plane(scratch.path()).await;
    let added = oqpctl(
        &control,
        Some(ADMIN),
        &[
            "keys",
            "add",
            "brief",
            "--max-priority",
            "low",
            "--scope",
            "inference",
            "--expires",
            "1s",
        ],
    )
    .await;
    assert!(added.status.success());
    // Waits on the condition (the expiry task's entry), polling the file.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    let expired = loop {
        let entries = trail(scratch.path());
        if let Some(entry) = find(&entries, "keys.expire", "ok") {
            break entry.clone();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no keys.expire: {entries:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(expired["actor"], "local");
    assert_eq!(expired["target"], "brief");
    control.shutdown().await;
}

/// Waits (polling the file, up to 20 s) until an entry matches.
async fn wait_for(dir: &Path, action: &str) -> serde_json::Value {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let entries = trail(dir);
        if let Some(entry) = entries.iter().find(|entry| entry["action"] == action) {
            return entry.clone();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {action}: {entries:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn queue_changes_and_data_planes_joining_and_leaving_are_recorded() {
    let scratch = tempfile::tempdir().unwrap();
    let control = start(scratch.path(), "", true).await;
    let joined = wait_for(scratch.path(), "dataplane.join").await;
    assert_eq!(joined["target"], "local");
    assert_eq!(joined["actor"], "node");
    assert_eq!(joined["outcome"], "ok");
    for args in [
        ["queue", "pause", "--tier", "low"],
        ["queue", "resume", "--tier", "low"],
        ["queue", "flush", "--tier", "high"],
    ] {
        let done = oqpctl(&control, Some(ADMIN), &args).await;
        assert!(
            done.status.success(),
            "{}",
            String::from_utf8_lossy(&done.stderr)
        );
    }
    let entries = trail(scratch.path());
    for (action, target) in [
        ("queue.pause", "low"),
        ("queue.resume", "low"),
        ("queue.flush", "high"),
    ] {
        let entry = find(&entries, action, "ok").unwrap_or_else(|| panic!("{action}"));
        assert_eq!(entry["target"], target);
        assert_eq!(entry["actor"], "admin");
    }
    control.shutdown().await;
    let left = wait_for(scratch.path(), "dataplane.leave").await;
    assert_eq!(left["target"], "local");
}
