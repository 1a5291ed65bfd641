//! `oqpctl queue …` and `oqpctl status` end to end: the real binary against a
//! real control plane with one data plane reporting to it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Output;
use std::time::Duration;

use oqp_controlplane::config::Env;
use oqp_controlplane::{ControlPlane, Options};

const ADMIN: &str = "sk-admin-0123456789";
const READER: &str = "sk-read-0123456789";

async fn start(dir: &std::path::Path) -> ControlPlane {
    let config = dir.join("config.yml");
    std::fs::write(
        &config,
        format!(
            "ollama:\n  hosts:\n    - {{url: 'http://127.0.0.1:9', name: nowhere}}\n\
             auth:\n  enabled: true\n  keys:\n\
             \x20   - {{key: {ADMIN}, client_id: admin, scope: management}}\n\
             \x20   - {{key: {READER}, client_id: widget, scope: read}}\n"
        ),
    )
    .unwrap();
    ControlPlane::start(Options {
        config_path: config,
        env: Env::empty(),
        listener: Some(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()),
        with_dataplane: true,
        dataplane_listener: Some(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()),
        clock: None,
    })
    .await
    .unwrap()
}

async fn oqpctl(control: &ControlPlane, key: &str, args: &[&str]) -> Output {
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

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[tokio::test]
async fn pause_resume_flush_and_drain_from_the_terminal() {
    let dir = std::env::temp_dir().join(format!("oqpctl-queue-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let control = start(&dir).await;

    let paused = oqpctl(&control, ADMIN, &["queue", "pause", "--tier", "low"]).await;
    assert!(paused.status.success(), "{}", text(&paused));
    assert!(text(&paused).contains("low paused"), "{}", text(&paused));
    let version = control.hub().current().version;
    tokio::time::timeout(
        Duration::from_secs(10),
        control
            .dataplane()
            .unwrap()
            .app()
            .dispatcher
            .applied(version),
    )
    .await
    .unwrap();

    // The node's report reaches the control plane about once a second.
    let mut status = String::new();
    for _ in 0..50 {
        let output = oqpctl(&control, READER, &["status", "--output", "json"]).await;
        assert!(output.status.success(), "{}", text(&output));
        status = String::from_utf8_lossy(&output.stdout).into_owned();
        let json: serde_json::Value = serde_json::from_str(&status).unwrap();
        if json["nodes"][0]["in_sync"] == true {
            assert_eq!(
                json["control_plane"]["paused_tiers"],
                serde_json::json!(["low"])
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(status.contains("\"node\": \"local\""), "{status}");

    // A read key may look but not change.
    let refused = oqpctl(&control, READER, &["queue", "resume"]).await;
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused));
    assert!(text(&refused).contains("management permission required"));

    let resumed = oqpctl(&control, ADMIN, &["queue", "resume", "--output", "json"]).await;
    let json: serde_json::Value = serde_json::from_slice(&resumed.stdout).unwrap();
    assert_eq!(
        (json["status"].as_str(), json["tier"].as_str()),
        (Some("resumed"), Some("all"))
    );

    let flushed = oqpctl(&control, ADMIN, &["queue", "flush", "--tier", "normal"]).await;
    assert!(flushed.status.success(), "{}", text(&flushed));

    let drained = oqpctl(&control, ADMIN, &["queue", "drain", "--timeout", "20s"]).await;
    assert!(drained.status.success(), "{}", text(&drained));
    assert!(text(&drained).contains("drained"), "{}", text(&drained));

    control.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn an_unreachable_control_plane_is_exit_code_2() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_oqpctl"))
        .args(["--control-plane", "http://127.0.0.1:9", "status"])
        .env_remove("OQPCTL_KEY")
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("cannot reach the control plane"));
}
