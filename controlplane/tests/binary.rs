//! The real `oqp-controlplane` binary.
//!
//! Crash safety of the key store: a burst of concurrent `AddKey` calls,
//! SIGKILL in the middle of it, a restart on the same state directory. Every
//! key whose `AddKey` was answered must be back, and must still authenticate;
//! the file must parse (the restart itself refuses a corrupt store); no
//! temporary may linger. Also: a corrupt store stops the start, SIGHUP
//! applies the config's log level, a piped text log has no colour codes, and a
//! missing config names the quick-start example.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use oqp_proto::admin::v1::{self as api, admin_service_client::AdminServiceClient};
use oqp_proto::policy::v1 as wire;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tonic::transport::Channel;

const ADMIN: &str = "sk-admin-0123456789";
/// Concurrent callers in the burst, so that the kill finds writes in flight.
const CALLERS: usize = 4;

struct Running {
    child: Child,
    addr: SocketAddr,
    /// Every JSON log line after "control plane serving".
    logs: mpsc::UnboundedReceiver<serde_json::Value>,
}

fn write_config(dir: &Path, state: &Path) -> PathBuf {
    let path = dir.join("config.yml");
    let yaml = format!(
        "ollama:\n  hosts:\n    - {{url: 'http://127.0.0.1:9', name: nowhere}}\n\
         auth:\n  enabled: true\n  keys:\n    - {{key: {ADMIN}, client_id: admin, scope: management}}\n\
         control_plane:\n  listen: 127.0.0.1:0\n  state_dir: '{}'\n",
        state.display()
    );
    std::fs::write(&path, yaml).unwrap();
    path
}

/// Starts the binary and waits for its "serving" log line, which names the
/// bound address. `OQP_LOG` is `info` unless `follow_config` leaves the
/// filter to the config's `logging.level`.
async fn start(config: &Path, follow_config: bool) -> Running {
    let mut command = Command::new(env!("CARGO_BIN_EXE_oqp-controlplane"));
    command.env_remove("OQP_LOG");
    if !follow_config {
        command.env("OQP_LOG", "info");
    }
    let mut child = command
        .arg("--config")
        .arg(config)
        .arg("--log-format")
        .arg("json")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            let Ok(entry) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue;
            };
            let fields = &entry["fields"];
            if fields["message"] == "control plane serving" {
                return fields["addr"].as_str().unwrap().parse().unwrap();
            }
        }
        panic!("the control plane exited before serving");
    })
    .await
    .expect("the control plane did not start within 30 s");
    // Keep draining its log so that it never blocks on a full pipe.
    let (sender, logs) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Ok(entry) = serde_json::from_str(&line) {
                let _ = sender.send(entry);
            }
        }
    });
    Running { child, addr, logs }
}

async fn admin(addr: SocketAddr) -> AdminServiceClient<Channel> {
    AdminServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

fn authed<T>(key: &str, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {key}").parse().unwrap());
    request
}

/// Adds keys from `CALLERS` tasks until the server goes away; sends each
/// answered (client_id, key) on `acked`.
fn spawn_burst(
    addr: SocketAddr,
    round: usize,
    acked: mpsc::UnboundedSender<(String, String)>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..CALLERS)
        .map(|caller| {
            let acked = acked.clone();
            tokio::spawn(async move {
                let mut client = admin(addr).await;
                for index in 0.. {
                    let client_id = format!("r{round}-c{caller}-{index}");
                    let request = api::AddKeyRequest {
                        client_id: client_id.clone(),
                        scope: wire::Scope::Inference as i32,
                        max_priority: wire::Tier::Low as i32,
                        ..api::AddKeyRequest::default()
                    };
                    match client.add_key(authed(ADMIN, request)).await {
                        Ok(response) => {
                            let _ = acked.send((client_id, response.into_inner().key));
                        }
                        Err(_) => return,
                    }
                }
            })
        })
        .collect()
}

#[tokio::test]
async fn every_acknowledged_key_survives_sigkill_mid_burst() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let config = write_config(dir.path(), &state);
    let mut acknowledged: Vec<(String, String)> = Vec::new();

    for (round, kill_after) in [(0, 5), (1, 23), (2, 41)] {
        let mut running = start(&config, false).await;
        let (sender, mut receiver) = mpsc::unbounded_channel();
        let burst = spawn_burst(running.addr, round, sender);
        // Kill once this round has had `kill_after` answers, with the other
        // callers' writes in flight.
        let mut this_round = 0;
        while this_round < kill_after {
            acknowledged.push(receiver.recv().await.expect("the burst stopped early"));
            this_round += 1;
        }
        running.child.kill().await.unwrap();
        for caller in burst {
            caller.await.unwrap();
        }
        // Answers that raced the kill count too: the client got them.
        while let Ok(ack) = receiver.try_recv() {
            acknowledged.push(ack);
            this_round += 1;
        }
        println!("round {round}: {this_round} keys acknowledged before SIGKILL");
    }

    // The file parses, and no temporary is left after a restart.
    let file = state.join("keys.json");
    let running = start(&config, false).await;
    let text = std::fs::read_to_string(&file).unwrap();
    let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(parsed["format"], 1);
    // `version` is the last snapshot version, kept beside the keys; the
    // running control plane may be writing it (through its own temporary)
    // at this very moment, so only the key store's files are judged here.
    let mut names: Vec<String> = std::fs::read_dir(&state)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .filter(|name| !name.starts_with(".version.tmp-"))
        // The hop's root secret, written once at start (`hop_keys`).
        .filter(|name| name != "hop_root")
        .collect();
    names.sort();
    // `node_token` is the control plane's own node token (none is configured here);
    // `audit.jsonl` the audit trail of the keys added.
    assert_eq!(names, ["audit.jsonl", "keys.json", "node_token", "version"]);
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );

    let mut client = admin(running.addr).await;
    let listed = client
        .list_keys(authed(ADMIN, api::ListKeysRequest {}))
        .await
        .unwrap()
        .into_inner();
    let stored: BTreeSet<String> = listed
        .keys
        .into_iter()
        .filter(|key| key.source == "store")
        .map(|key| key.client_id)
        .collect();
    let missing: Vec<&String> = acknowledged
        .iter()
        .map(|(client_id, _)| client_id)
        .filter(|client_id| !stored.contains(*client_id))
        .collect();
    assert!(missing.is_empty(), "acknowledged but lost: {missing:?}");
    println!(
        "{} keys acknowledged, {} stored after three SIGKILLs",
        acknowledged.len(),
        stored.len()
    );
    // Every acknowledged key still authenticates (its digest was stored whole).
    for (client_id, key) in &acknowledged {
        client
            .list_keys(authed(key, api::ListKeysRequest {}))
            .await
            .unwrap_or_else(|status| panic!("{client_id}'s key is refused: {status:?}"));
        assert!(!text.contains(&key[4..]), "the file holds a key value");
    }
}

#[tokio::test]
async fn a_corrupt_store_stops_the_start_with_exit_1_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let file = state.join("keys.json");
    std::fs::write(&file, b"{\"format\": 1, \"keys\": [{\"client_id\": ").unwrap();
    let config = write_config(dir.path(), &state);
    let output = Command::new(env!("CARGO_BIN_EXE_oqp-controlplane"))
        .arg("--config")
        .arg(&config)
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("the key store {} is corrupt", file.display())),
        "{stderr}"
    );
    // Left as it was, for the operator to inspect.
    assert_eq!(
        std::fs::read(&file).unwrap(),
        b"{\"format\": 1, \"keys\": [{\"client_id\": "
    );
}

/// SIGHUP applies `logging.level`: after a reload to `warn`, the next valid
/// reload's info line is filtered out, while the error of a refused one
/// still shows.
#[tokio::test]
async fn sighup_applies_the_configured_log_level() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let config = write_config(dir.path(), &state);
    let base = std::fs::read_to_string(&config).unwrap();
    let with = |level: &str, extra: &str| format!("{base}logging:\n  level: {level}\n{extra}");
    std::fs::write(&config, with("info", "")).unwrap();
    let mut running = start(&config, true).await;
    let pid = running.child.id().unwrap().to_string();
    let hangup = async || {
        let status = Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .await
            .unwrap();
        assert!(status.success());
    };
    let mut admin = admin(running.addr).await;
    let mut version = async || {
        admin
            .get_status(authed(ADMIN, api::GetStatusRequest {}))
            .await
            .unwrap()
            .into_inner()
            .snapshot_version
    };
    let messages = |logs: &mut mpsc::UnboundedReceiver<serde_json::Value>| {
        std::iter::from_fn(|| logs.try_recv().ok())
            .map(|entry| entry["fields"]["message"].as_str().unwrap_or("").to_owned())
            .collect::<Vec<_>>()
    };

    // To warn: this reload's own line is still written at info.
    let before = version().await;
    std::fs::write(&config, with("warn", "")).unwrap();
    hangup().await;
    let reloaded = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let entry = running.logs.recv().await.expect("the log goes on");
            if entry["fields"]["message"] == "config reloaded" {
                return entry;
            }
        }
    })
    .await
    .expect("reloaded within 10 s");
    assert_eq!(reloaded["level"], "INFO");
    assert!(version().await > before);

    // At warn: a valid reload applies without an info line...
    let before = version().await;
    std::fs::write(&config, with("warn", "proxy:\n  max_concurrent: 3\n")).unwrap();
    hangup().await;
    tokio::time::timeout(Duration::from_secs(10), async {
        while version().await <= before {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("applied within 10 s");
    // ...and a refused one still logs its error.
    std::fs::write(&config, "proxy: [unclosed").unwrap();
    hangup().await;
    let mut seen = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let entry = running.logs.recv().await.expect("the log goes on");
            let message = entry["fields"]["message"].as_str().unwrap_or("").to_owned();
            let refused = message.starts_with("config reload refused");
            seen.push(message);
            if refused {
                return;
            }
        }
    })
    .await
    .expect("the refusal is logged within 10 s");
    seen.extend(messages(&mut running.logs));
    assert!(
        !seen.iter().any(|message| message == "config reloaded"),
        "an info line passed the warn filter: {seen:?}"
    );
    running.child.kill().await.unwrap();
}

/// A text log written to a pipe (a file, journald) carries no ANSI escapes, even with
/// `NO_COLOR` unset.
#[tokio::test]
async fn a_text_log_into_a_pipe_has_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let config = write_config(dir.path(), &state);
    let mut child = Command::new(env!("CARGO_BIN_EXE_oqp-controlplane"))
        .env("OQP_LOG", "info")
        .env_remove("NO_COLOR")
        .arg("--config")
        .arg(&config)
        .arg("--log-format")
        .arg("text")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let seen = tokio::time::timeout(Duration::from_secs(30), async {
        let mut seen = Vec::new();
        while let Some(line) = lines.next_line().await.unwrap() {
            let serving = line.contains("control plane serving");
            seen.push(line);
            if serving {
                return seen;
            }
        }
        panic!("the control plane exited before serving: {seen:?}");
    })
    .await
    .expect("the control plane did not start within 30 s");
    assert!(
        seen.iter().all(|line| !line.contains('\u{1b}')),
        "escape codes in a piped log: {seen:?}"
    );
    assert!(seen.iter().any(|line| line.contains("INFO")), "{seen:?}");
    child.kill().await.unwrap();
}

/// Without a config file, the hint names the short quick-start example.
#[tokio::test]
async fn a_missing_config_points_at_the_quickstart() {
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_oqp-controlplane"))
        .arg("--config")
        .arg(dir.path().join("absent.yml"))
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("hint: copy examples/quickstart.yml to "),
        "{stderr}"
    );
}
