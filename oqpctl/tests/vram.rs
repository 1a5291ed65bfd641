//! `oqpctl hosts` shows each host's VRAM end to end: the real binary against a
//! real control plane (with its in-process data plane) that polls the fake
//! Ollama in VRAM mode.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use oqp_controlplane::config::Env;
use oqp_controlplane::{ControlPlane, Options};
use oqp_tests::client::HttpClient;
use oqp_tests::fake::FakeOllama;
use serde_json::Value;

const GIB: u64 = 1 << 30;

async fn oqpctl(control: &ControlPlane, args: &[&str]) -> String {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_oqpctl"))
        .arg("--control-plane")
        .arg(format!("http://{}", control.local_addr()))
        .arg("--no-color")
        .args(args)
        .env_remove("OQPCTL_KEY")
        .env_remove("OQP_CONTROL_PLANE")
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "oqpctl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A control plane with its in-process data plane on `config`, both on `127.0.0.1:0`.
async fn single_box(config: std::path::PathBuf) -> ControlPlane {
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

#[tokio::test]
async fn hosts_show_the_configured_vram_and_the_resident_model() {
    let fake = FakeOllama::builder()
        .model("llama3:8b")
        .model("qwen3:8b")
        .loaded("llama3:8b")
        .vram(24 * GIB)
        .model_size("llama3:8b", 5 * GIB)
        .spawn()
        .await;
    let learned = FakeOllama::builder().model("phi3:mini").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yml");
    std::fs::write(
        &config,
        format!(
            "ollama:\n  hosts:\n\
             \x20   - {{url: '{}', name: gpu, vram: 24GiB}}\n\
             \x20   - {{url: '{}', name: spare}}\n\
             control_plane:\n  state_dir: '{}'\n",
            fake.url(),
            learned.url(),
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    let control = single_box(config).await;

    // The start-up probe ran before the control plane served anything.
    let text = oqpctl(&control, &["hosts", "--wide"]).await;
    let header = text.lines().find(|line| line.contains(" host ")).unwrap();
    for column in [" resident ", " vram ", " held "] {
        assert!(header.contains(column), "{text}");
    }
    let row = |name: &str| {
        text.lines()
            .find(|line| line.starts_with(&format!("| {name} ")))
            .unwrap_or_else(|| panic!("no row for {name}:\n{text}"))
            .to_owned()
    };
    assert!(row("gpu").contains(" llama3:8b 5 GiB "), "{text}");
    assert!(row("gpu").contains(" 24 GiB "), "{text}");
    assert!(row("gpu").contains(" 0 "), "{text}");
    assert!(row("spare").contains(" ? "), "{text}");

    let json: Value =
        serde_json::from_str(&oqpctl(&control, &["hosts", "--output", "json"]).await).unwrap();
    let gpu = &json[0];
    assert_eq!(gpu["name"], "gpu");
    assert_eq!(gpu["vram_bytes"], 24 * GIB);
    assert_eq!(gpu["vram_learned"], false);
    assert_eq!(
        gpu["resident"],
        serde_json::json!([{"model": "llama3:8b", "bytes": 5 * GIB}])
    );
    assert_eq!(gpu["held"], 0);
    assert_eq!(json[1]["vram_bytes"], Value::Null);
    tokio::time::timeout(Duration::from_secs(10), control.shutdown())
        .await
        .expect("control plane stopped");
}

#[tokio::test]
async fn hosts_show_a_request_held_back_for_a_model_switch() {
    let fake = FakeOllama::builder()
        .model("alpha")
        .model("beta")
        .loaded("alpha")
        .slots(2)
        .vram(10 * GIB)
        .model_size("alpha", 8 * GIB)
        .model_size("beta", 8 * GIB)
        .spawn()
        .await;
    let handle = fake.handle();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yml");
    std::fs::write(
        &config,
        format!(
            "ollama:\n  hosts:\n\
             \x20   - {{url: '{}', name: gpu, vram: 10GiB, max_concurrent: 2}}\n\
             queue:\n  model_swap:\n    max_defer: 60\n    idle_grace: 10\n\
             control_plane:\n  state_dir: '{}'\n",
            fake.url(),
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    let control = single_box(config).await;
    let proxy = format!("http://{}", control.dataplane().unwrap().local_addr());
    let send = |model: &'static str| {
        let url = format!("{proxy}/api/generate");
        tokio::spawn(async move {
            oqp_tests::client::HttpClient::new()
                .post_json(
                    &url,
                    &[],
                    &serde_json::json!({"model": model, "prompt": "hi", "stream": false}),
                )
                .await
        })
    };
    // alpha is resident and busy at Ollama; beta's request is held back for it.
    handle.hold();
    let alpha = send("alpha");
    handle.wait_in_flight(1).await;
    let beta = send("beta");
    // The data plane reports every second; ask until its report shows the held request.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let mut json = Value::Null;
    while tokio::time::Instant::now() < deadline {
        json =
            serde_json::from_str(&oqpctl(&control, &["hosts", "--output", "json"]).await).unwrap();
        if json[0]["held"].as_u64().unwrap_or(0) >= 1 {
            break;
        }
    }
    assert_eq!(json[0]["held"], 1, "{json}");
    let text = oqpctl(&control, &["hosts", "--wide"]).await;
    let row = text
        .lines()
        .find(|line| line.starts_with("| gpu "))
        .unwrap();
    assert!(row.contains(" 1 ("), "{text}");
    beta.abort();
    handle.release_all();
    assert!(alpha.await.unwrap().status.is_success());
    tokio::time::timeout(Duration::from_secs(10), control.shutdown())
        .await
        .expect("control plane stopped");
}

#[tokio::test]
async fn hosts_show_each_runners_slots_and_the_ones_ollama_forces_to_one() {
    let fake = FakeOllama::builder()
        .model("llama3.2:3b")
        .loaded("llama3.2:3b")
        .embedding_model("all-minilm")
        .loaded("all-minilm")
        .runners(4)
        .slots(8)
        .spawn()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yml");
    std::fs::write(
        &config,
        format!(
            "ollama:\n  hosts:\n\
             \x20   - {{url: '{}', name: gpu, max_concurrent: 8, num_parallel: 4}}\n\
             control_plane:\n  state_dir: '{}'\n",
            fake.url(),
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    let control = single_box(config).await;
    // The data plane reports its runners about once a second.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = oqpctl(&control, &["hosts", "--wide"]).await;
        if text.contains("forced") || std::time::Instant::now() >= deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!("oqpctl hosts\n{text}");
    assert!(text.contains(" runners "), "{text}");
    assert!(text.contains("llama3.2:3b 0/4"), "{text}");
    assert!(text.contains("all-minilm 0/1 forced"), "{text}");
    let json: Value =
        serde_json::from_str(&oqpctl(&control, &["hosts", "--output", "json"]).await).unwrap();
    let runners = json[0]["runners"].as_array().unwrap();
    assert!(
        runners.iter().any(|r| r["model"] == "all-minilm:latest"
            && r["slots"] == 1
            && r["forced"] == "embedding"),
        "{json}"
    );
    // Two conversations answered: the runner holds both warm, as far as the index knows.
    let proxy = format!("http://{}", control.dataplane().unwrap().local_addr());
    let http = HttpClient::new();
    for conversation in ["one", "two"] {
        let body = serde_json::json!({
            "model": "llama3.2:3b",
            "stream": false,
            "messages": [{"role": "user", "content": format!("conversation {conversation}")}],
        });
        let reply = http
            .post_json(&format!("{proxy}/api/chat"), &[], &body)
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(reply.header("x-oqp-affinity").as_deref(), Some("new"));
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = oqpctl(&control, &["hosts", "--wide"]).await;
        if text.contains("warm") || std::time::Instant::now() >= deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(text.contains("llama3.2:3b 0/4 · 2 warm"), "{text}");
    tokio::time::timeout(Duration::from_secs(10), control.shutdown())
        .await
        .expect("control plane stopped");
}

/// A key with a model allowlist (`auth.keys[].models`) sees only its models in `oqpctl hosts`:
/// installed, loaded and resident, as `/queue/status` shows it; a key without one sees all.
#[tokio::test]
async fn hosts_show_a_key_with_a_models_list_only_its_models() {
    const ADMIN: &str = "sk-admin-0123456789";
    const LIMITED: &str = "sk-limited-0123456789";
    let fake = FakeOllama::builder()
        .model("llama3:8b")
        .model("qwen3:8b")
        .loaded("llama3:8b")
        .loaded("qwen3:8b")
        .vram(24 * GIB)
        .model_size("llama3:8b", 5 * GIB)
        .model_size("qwen3:8b", 5 * GIB)
        .spawn()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yml");
    std::fs::write(
        &config,
        format!(
            "ollama:\n  hosts:\n\
             \x20   - {{url: '{}', name: gpu, vram: 24GiB}}\n\
             auth:\n  enabled: true\n  keys:\n\
             \x20   - {{key: {ADMIN}, client_id: admin, scope: management}}\n\
             \x20   - {{key: {LIMITED}, client_id: widget, scope: read, models: ['llama3*']}}\n\
             control_plane:\n  state_dir: '{}'\n",
            fake.url(),
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    let control = single_box(config).await;
    let hosts = |key: &'static str| {
        let address = format!("http://{}", control.local_addr());
        async move {
            let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_oqpctl"))
                .args(["--control-plane", &address, "--no-color"])
                .args(["hosts", "--output", "json"])
                .env_remove("OQP_CONTROL_PLANE")
                .env("OQPCTL_KEY", key)
                .output()
                .await
                .unwrap();
            assert!(
                output.status.success(),
                "{}",
                String::from_utf8_lossy(&output.stderr)
            );
            let json: Value = serde_json::from_slice(&output.stdout).unwrap();
            json[0].clone()
        }
    };
    let names = |host: &Value, list: &str| -> Vec<String> {
        host[list]
            .as_array()
            .unwrap_or_else(|| panic!("{list}: {host}"))
            .iter()
            .map(|entry| {
                entry
                    .as_str()
                    .or_else(|| entry["model"].as_str())
                    .unwrap()
                    .to_owned()
            })
            .collect()
    };
    // The start-up probe ran before the control plane served anything.
    let everything = hosts(ADMIN).await;
    for list in ["installed_models", "loaded_models", "resident"] {
        assert_eq!(names(&everything, list).len(), 2, "{list}: {everything}");
    }
    let limited = hosts(LIMITED).await;
    for list in ["installed_models", "loaded_models", "resident"] {
        assert_eq!(names(&limited, list), ["llama3:8b"], "{list}: {limited}");
    }
    tokio::time::timeout(Duration::from_secs(10), control.shutdown())
        .await
        .expect("control plane stopped");
}
