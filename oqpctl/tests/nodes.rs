//! `oqpctl hosts` and `oqpctl status` with several GPU boxes, end to end:
//! the real binary against a real control plane whose config lists two
//! nodes, `local` (the in-process data plane) and `box2` (started, or not,
//! by the test), each owning one host.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Output;
use std::time::{Duration, Instant};

use oqp_controlplane::config::Env;
use oqp_controlplane::{ControlPlane, Options};
use serde_json::Value;

const READER: &str = "sk-read-0123456789";
const ADMIN: &str = "sk-admin-0123456789";
const NODE_TOKEN: &str = "sk-node-0123456789";

/// A control plane with its data plane `local` owning `here`, and `box2`
/// (listed, never started) owning `there`.
async fn two_boxes(dir: &tempfile::TempDir) -> ControlPlane {
    let dataplane = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let local_url = format!("http://{}", dataplane.local_addr().unwrap());
    let config = dir.path().join("config.yml");
    std::fs::write(
        &config,
        format!(
            "ollama:\n  hosts:\n\
             \x20   - {{url: 'http://127.0.0.1:9', name: here, node: local}}\n\
             \x20   - {{url: 'http://127.0.0.1:8', name: there, node: box2}}\n\
             auth:\n  enabled: true\n  keys:\n\
             \x20   - {{key: {READER}, client_id: widget, scope: read}}\n\
             \x20   - {{key: {ADMIN}, client_id: ops, scope: management}}\n\
             control_plane:\n  node_token: {NODE_TOKEN}\n  state_dir: '{}'\n\
             nodes:\n\
             \x20 local: {{host: 127.0.0.1, url: '{local_url}'}}\n\
             \x20 box2: {{host: 127.0.0.1, url: 'http://127.0.0.1:7'}}\n",
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    ControlPlane::start(Options {
        config_path: config,
        env: Env::empty(),
        listener: Some(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()),
        with_dataplane: true,
        dataplane_listener: Some(dataplane),
        clock: None,
    })
    .await
    .unwrap()
}

async fn oqpctl(control: &ControlPlane, args: &[&str]) -> Output {
    let output = oqpctl_as(control, READER, args).await;
    assert!(
        output.status.success(),
        "oqpctl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// `oqpctl ARGS` presenting `key`, whatever its exit status.
async fn oqpctl_as(control: &ControlPlane, key: &str, args: &[&str]) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_oqpctl"))
        .arg("--control-plane")
        .arg(format!("http://{}", control.local_addr()))
        .arg("--no-color")
        .args(args)
        .env("OQPCTL_KEY", key)
        .env_remove("OQP_CONTROL_PLANE")
        .output()
        .await
        .unwrap()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `oqpctl status --output json` once `node`'s row satisfies `ready`
/// (a node reports about once a second).
async fn status_when(control: &ControlPlane, node: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let output = oqpctl(control, &["status", "--output", "json"]).await;
        let status: Value = serde_json::from_slice(&output.stdout).unwrap();
        let row = status["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|row| row["node"] == node);
        if row.is_some_and(&ready) {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "{node} never got there: {status}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The status once the in-process data plane serves the current snapshot.
async fn status_once_local_reported(control: &ControlPlane) -> Value {
    status_when(control, "local", |row| {
        row["link"] == "connected" && row["in_sync"] == true
    })
    .await
}

/// A data plane named `box2` following `control`, on a port of its own.
async fn start_box2(control: &ControlPlane) -> oqp_dataplane::DataPlane {
    start_box2_with(control, NODE_TOKEN).await
}

/// [`start_box2`] presenting `token`.
async fn start_box2_with(control: &ControlPlane, token: &str) -> oqp_dataplane::DataPlane {
    oqp_dataplane::DataPlane::start(oqp_dataplane::Options {
        control: oqp_dataplane::control::ControlOptions {
            url: format!("http://{}", control.local_addr()),
            node: "box2".to_owned(),
            token: Some(token.to_owned()),
            ca_file: None,
        },
        listener: Some(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()),
        report_interval: Duration::from_millis(200),
        log_level: None,
    })
    .await
    .unwrap()
}

fn row(text: &str, name: &str) -> String {
    text.lines()
        .find(|line| line.starts_with(&format!("| {name} ")))
        .unwrap_or_else(|| panic!("no row for {name}:\n{text}"))
        .to_owned()
}

#[tokio::test]
async fn status_lists_a_listed_node_that_never_connected_then_follows_its_link() {
    let dir = tempfile::tempdir().unwrap();
    let control = two_boxes(&dir).await;

    let status = status_once_local_reported(&control).await;
    let nodes = status["nodes"].as_array().unwrap();
    let names: Vec<&str> = nodes.iter().filter_map(|n| n["node"].as_str()).collect();
    assert_eq!(names, ["box2", "local"], "{status}");
    let box2 = &nodes[0];
    assert_eq!(box2["link"], "never connected", "{status}");
    assert_eq!(box2["configured"], true);
    assert_eq!(box2["last_report_age_ms"], Value::Null);
    assert_eq!(box2["url"], "http://127.0.0.1:7");
    assert_eq!(nodes[1]["configured"], true);
    assert_eq!(nodes[1]["waiting"]["low"], 0);

    let warned = "node box2 has never connected to the control plane: only it sends to there";
    assert!(
        status["control_plane"]["warnings"]
            .as_array()
            .unwrap()
            .contains(&Value::from(warned)),
        "{status}"
    );

    let table = stdout(&oqpctl(&control, &["status"]).await);
    // Wrapped to the width like the rest of the view.
    let words = table.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(words.contains(&format!("warning: {warned}")), "{table}");
    assert!(row(&table, "box2").contains("never connected"), "{table}");
    let local = row(&table, "local");
    assert!(
        local.contains("connected") && local.contains("0/0/0"),
        "{table}"
    );

    // box2 starts: connected, reporting; it stops: disconnected, still listed.
    let box2 = start_box2(&control).await;
    let status = status_when(&control, "box2", |row| {
        row["link"] == "connected" && row["last_report_age_ms"].is_u64()
    })
    .await;
    assert_eq!(status["nodes"][0]["waiting"]["high"], 0, "{status}");
    let warnings = status["control_plane"]["warnings"].as_array().unwrap();
    assert!(
        !warnings
            .iter()
            .any(|w| w.as_str().unwrap().starts_with("node box2")),
        "{status}"
    );
    let table = stdout(&oqpctl(&control, &["status"]).await);
    let row2 = row(&table, "box2");
    assert!(
        row2.contains(" connected ") && row2.contains("0/0/0"),
        "{table}"
    );
    box2.shutdown().await;
    let status = status_when(&control, "box2", |row| row["link"] == "disconnected").await;
    assert_eq!(status["nodes"][0]["configured"], true);

    control.shutdown().await;
}

#[tokio::test]
async fn hosts_and_status_show_what_each_node_owns() {
    let dir = tempfile::tempdir().unwrap();
    let control = two_boxes(&dir).await;

    let table = stdout(&oqpctl(&control, &["hosts"]).await);
    assert!(row(&table, "here").contains(" local "), "{table}");
    assert!(row(&table, "there").contains(" box2 "), "{table}");
    let hosts: Value = serde_json::from_slice(
        &oqpctl(&control, &["hosts", "--output", "json"])
            .await
            .stdout,
    )
    .unwrap();
    let owners: Vec<&str> = hosts
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|host| host["owner"].as_str())
        .collect();
    assert_eq!(owners, ["local", "box2"], "{hosts}");

    let status = status_once_local_reported(&control).await;
    assert_eq!(status["nodes"][0]["owns"], serde_json::json!(["there"]));
    assert_eq!(status["nodes"][1]["owns"], serde_json::json!(["here"]));
    let table = stdout(&oqpctl(&control, &["status"]).await);
    let box2 = row(&table, "box2");
    assert!(
        box2.contains(" there ") && !box2.contains(" here"),
        "{table}"
    );

    control.shutdown().await;
}

#[tokio::test]
async fn a_node_added_with_oqpctl_joins_with_its_token_and_is_dropped_when_revoked() {
    let dir = tempfile::tempdir().unwrap();
    let control = two_boxes(&dir).await;

    // A read key may list, not issue.
    let refused = oqpctl_as(&control, READER, &["nodes", "add", "box2"]).await;
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("management"),
        "{refused:?}"
    );

    let added = oqpctl_as(&control, ADMIN, &["nodes", "add", "box2"]).await;
    assert!(added.status.success(), "{added:?}");
    let text = stdout(&added);
    let token = text
        .split_whitespace()
        .find(|word| word.starts_with("oqp_node_"))
        .unwrap_or_else(|| panic!("no token in {text}"))
        .to_owned();
    assert!(text.contains("--node box2"), "{text}");

    let box2 = start_box2_with(&control, &token).await;
    status_when(&control, "box2", |row| row["link"] == "connected").await;
    let listed = stdout(&oqpctl(&control, &["nodes", "list"]).await);
    let line = row(&listed, "box2");
    assert!(
        line.contains(" valid ") && line.contains(" yes "),
        "{listed}"
    );
    assert!(!listed.contains(&token), "{listed}");

    let revoked = oqpctl_as(&control, ADMIN, &["nodes", "revoke", "box2"]).await;
    assert!(revoked.status.success(), "{revoked:?}");
    assert!(
        stdout(&revoked).contains("its watch was ended"),
        "{revoked:?}"
    );
    status_when(&control, "box2", |row| row["link"] == "disconnected").await;
    let listed: Value = serde_json::from_slice(
        &oqpctl(&control, &["nodes", "list", "-o", "json"])
            .await
            .stdout,
    )
    .unwrap();
    assert_eq!(listed[0]["node"], "box2", "{listed}");
    assert!(listed[0]["revoked_unix_ms"].is_i64(), "{listed}");
    assert_eq!(listed[0]["connected"], false);
    let again = oqpctl_as(&control, ADMIN, &["nodes", "revoke", "box2"]).await;
    assert!(!again.status.success());
    box2.shutdown().await;
    control.shutdown().await;
}
