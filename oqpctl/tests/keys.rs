//! `oqpctl keys …` end to end: the real binary against a real control plane
//! on loopback. Output, exit codes and refusal messages as a person sees
//! them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Output;

use oqp_controlplane::config::Env;
use oqp_controlplane::{ControlPlane, Options};

const ADMIN: &str = "sk-admin-0123456789";
const READER: &str = "sk-read-0123456789";

async fn control_plane(dir: &Path) -> ControlPlane {
    let config = dir.join("config.yml");
    std::fs::write(
        &config,
        format!(
            "ollama:\n  hosts:\n    - {{url: 'http://127.0.0.1:9', name: nowhere}}\n\
             auth:\n  enabled: true\n  keys:\n\
             \x20   - {{key: {ADMIN}, client_id: admin, scope: management}}\n\
             \x20   - {{key: {READER}, client_id: widget, scope: read}}\n\
             control_plane:\n  state_dir: '{}'\n",
            dir.join("state").display()
        ),
    )
    .unwrap();
    ControlPlane::start(Options {
        config_path: config,
        env: Env::empty(),
        listener: Some(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()),
        with_dataplane: false,
        dataplane_listener: None,
        clock: None,
    })
    .await
    .unwrap()
}

/// Runs oqpctl with `key` in `OQPCTL_KEY` (none if `None`).
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

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Asserts exit code 1 and that stderr says `reason`.
fn refused(output: &Output, reason: &str) {
    assert_eq!(output.status.code(), Some(1), "{}", stderr(output));
    assert!(
        stderr(output).contains(reason),
        "expected '{reason}' in: {}",
        stderr(output)
    );
}

#[tokio::test]
async fn keys_add_list_rotate_revoke_through_the_binary() {
    let scratch = tempfile::tempdir().unwrap();
    let control = control_plane(scratch.path()).await;

    // Add, with the key file option; JSON for scripts.
    let key_file = scratch.path().join("admin.key");
    std::fs::write(&key_file, format!("{ADMIN}\n")).unwrap();
    let key_file = key_file.display().to_string();
    let added = oqpctl(
        &control,
        None,
        &[
            "--key-file",
            &key_file,
            "--output",
            "json",
            "keys",
            "add",
            "batch",
            "--max-priority",
            "low",
            "--scope",
            "inference",
            "--max-concurrent",
            "1",
            "--expires",
            "30d",
        ],
    )
    .await;
    assert!(added.status.success(), "{}", stderr(&added));
    let json: serde_json::Value = serde_json::from_slice(&added.stdout).unwrap();
    let key = json["key"].as_str().unwrap().to_owned();
    assert!(key.starts_with("oqp_"));
    assert_eq!(json["client_id"], "batch");
    assert_eq!(json["source"], "store");
    assert!(json["expires_unix_ms"].as_i64().unwrap() > 0);

    // A read key lists only its own key.
    let own = oqpctl(&control, Some(READER), &["keys", "list"]).await;
    let own = stdout(&own);
    assert!(own.contains("widget") && !own.contains("batch"), "{own}");
    // List with a management key: rows from both sources (a `--wide` column), never a value.
    let listed = oqpctl(&control, Some(ADMIN), &["keys", "list", "--wide"]).await;
    assert!(listed.status.success(), "{}", stderr(&listed));
    let table = stdout(&listed);
    assert!(
        table.contains("batch") && table.contains("store"),
        "{table}"
    );
    assert!(
        table.contains("widget") && table.contains("config"),
        "{table}"
    );
    assert!(table.contains("in 29d 23h"), "{table}");
    assert!(!table.contains(&key[4..]));
    // The new key itself authenticates (inference scope may read).
    let own = oqpctl(&control, Some(&key), &["keys", "list"]).await;
    assert!(own.status.success(), "{}", stderr(&own));

    // Refusals: exit 1 with the reason.
    refused(
        &oqpctl(&control, Some(ADMIN), &["keys", "rotate", "widget"]).await,
        "edit its auth.keys entry in config.yml",
    );
    refused(
        &oqpctl(&control, Some(ADMIN), &["keys", "revoke", "admin"]).await,
        "defined in the config file",
    );
    refused(
        &oqpctl(
            &control,
            Some(ADMIN),
            &[
                "keys",
                "add",
                "batch",
                "--max-priority",
                "low",
                "--scope",
                "read",
            ],
        )
        .await,
        "already has a stored key",
    );
    refused(
        &oqpctl(
            &control,
            Some(READER),
            &[
                "keys",
                "add",
                "other",
                "--max-priority",
                "low",
                "--scope",
                "read",
            ],
        )
        .await,
        "management permission required",
    );
    refused(
        &oqpctl(&control, None, &["keys", "list"]).await,
        "--key-file PATH or env OQPCTL_KEY",
    );
    refused(
        &oqpctl(&control, Some("oqp_nope"), &["keys", "list"]).await,
        "invalid api key",
    );

    // Rotate with grace: a new key, printed once, the old one still working.
    let rotated = oqpctl(
        &control,
        Some(ADMIN),
        &["keys", "rotate", "batch", "--grace", "1h"],
    )
    .await;
    assert!(rotated.status.success(), "{}", stderr(&rotated));
    let text = stdout(&rotated);
    assert!(text.contains("The old key works until"), "{text}");
    let new_key = text
        .lines()
        .map(str::trim)
        .find(|line| line.starts_with("oqp_"))
        .unwrap()
        .to_owned();
    assert_ne!(new_key, key);
    for key in [&key, &new_key] {
        let output = oqpctl(&control, Some(key), &["keys", "list"]).await;
        assert!(output.status.success(), "{}", stderr(&output));
    }

    // Revoke: both keys refused at once.
    let revoked = oqpctl(&control, Some(ADMIN), &["keys", "revoke", "batch"]).await;
    assert!(revoked.status.success(), "{}", stderr(&revoked));
    assert!(stdout(&revoked).contains("Revoked client 'batch'"));
    for key in [&key, &new_key] {
        refused(
            &oqpctl(&control, Some(key), &["keys", "list"]).await,
            "invalid api key",
        );
    }
    refused(
        &oqpctl(&control, Some(ADMIN), &["keys", "revoke", "batch"]).await,
        "no stored key for client_id 'batch'",
    );
    control.shutdown().await;
}

/// With auth off nothing asks for a key, so none is minted: the refusal says
/// why, and nothing reaches the key store. Other changes still work from
/// loopback.
#[tokio::test]
async fn with_auth_off_keys_are_not_minted() {
    let scratch = tempfile::tempdir().unwrap();
    let config = scratch.path().join("config.yml");
    std::fs::write(
        &config,
        format!(
            "ollama:\n  hosts:\n    - {{url: 'http://127.0.0.1:9', name: nowhere}}\n\
             control_plane:\n  state_dir: '{}'\n",
            scratch.path().join("state").display()
        ),
    )
    .unwrap();
    let control = ControlPlane::start(Options {
        config_path: config,
        env: Env::empty(),
        listener: Some(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()),
        with_dataplane: false,
        dataplane_listener: None,
        clock: None,
    })
    .await
    .unwrap();
    refused(
        &oqpctl(
            &control,
            None,
            &[
                "keys",
                "add",
                "batch",
                "--max-priority",
                "low",
                "--scope",
                "inference",
            ],
        )
        .await,
        "auth is disabled (auth.enabled: false): no key is minted",
    );
    refused(
        &oqpctl(&control, None, &["keys", "rotate", "batch"]).await,
        "auth is disabled (auth.enabled: false): no key is minted",
    );
    assert!(control.keys().records().is_empty());
    let paused = oqpctl(&control, None, &["queue", "pause", "--tier", "low"]).await;
    assert!(paused.status.success(), "{}", stderr(&paused));
    control.shutdown().await;
}

/// `oqpctl config check` warns about a cloud host at `http://` (its keys and
/// prompts would travel in plaintext) and still calls the file valid.
#[tokio::test]
async fn config_check_warns_about_a_cloud_host_at_plain_http() {
    let scratch = tempfile::tempdir().unwrap();
    let config = scratch.path().join("config.yml");
    std::fs::write(
        &config,
        "ollama:\n  hosts:\n    - {url: 'http://ollama.com', name: cloud, api_keys: [{key: sk-cloud-0123456789}]}\n",
    )
    .unwrap();
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_oqpctl"))
        .arg("config")
        .arg("check")
        .arg(&config)
        .env_remove("OLLAMA_API_KEY")
        .env_remove("OLLAMA_API_KEYS")
        .output()
        .await
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let warnings = stderr(&output);
    assert!(
        warnings.contains(
            "warning: ollama.hosts[0] ('cloud') is a cloud host at http://: its API keys and every prompt travel in plaintext"
        ),
        "{warnings}"
    );
    assert!(!warnings.contains("sk-cloud-0123456789"), "{warnings}");
}
