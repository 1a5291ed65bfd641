//! Every `oqpctl` table fits a 100-column terminal: the real binary, `COLUMNS=100`, against
//! a real control plane whose data plane served traffic, with long names, caps, budgets,
//! model lists and a key in its rotation grace (the rows that made the tables widest).
//! Also: a rotated key's client is listed once, and with auth off the clients that name
//! themselves are listed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Output;

use oqp_tests::client::HttpClient;
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::Stack;
use serde_json::{Value, json};

const ADMIN: &str = "sk-admin-0123456789";
const CHAT: &str = "sk-chat-0123456789";
const WIDTH: usize = 100;

fn config(url: &str, state: &str) -> String {
    format!(
        "ollama:\n  hosts:\n    - {{url: '{url}', name: gpu-workstation-under-the-desk, max_concurrent: 4, vram: 24GiB}}\n\
         \x20   - {{url: 'http://127.0.0.1:9', name: second-box-in-the-rack-that-is-off}}\n\
         auth:\n  enabled: true\n  keys:\n\
         \x20   - {{key: {ADMIN}, client_id: admin, scope: management}}\n\
         \x20   - {{key: {CHAT}, client_id: chat-frontend-production, max_concurrent: 2, max_queued: 10, \
         max_priority: high, weight: 2, models: [llama3, qwen2.5-coder:32b-instruct-q4_K_M], \
         budget: {{gpu_seconds: 2h, tokens: 2000000, window: 1d}}, description: 'The chat front end'}}\n\
         control_plane:\n  state_dir: '{state}'\n"
    )
}

/// Runs oqpctl as a person at a 100-column terminal would (a pipe here, so no colour).
async fn oqpctl(stack: &Stack, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_oqpctl"));
    command
        .arg("--control-plane")
        .arg(stack.control_url())
        .args(args)
        .env("OQPCTL_KEY", ADMIN)
        .env("COLUMNS", WIDTH.to_string())
        .env_remove("NO_COLOR")
        .env_remove("OQP_CONTROL_PLANE");
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().await.unwrap()
}

fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "oqpctl failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The widest line, in characters (the tables draw with ASCII or box characters, each one
/// column wide).
fn widest(text: &str) -> usize {
    text.lines()
        .map(|line| line.chars().count())
        .max()
        .unwrap_or(0)
}

fn assert_fits(command: &str, text: &str) {
    println!("$ oqpctl {command}\n{text}");
    assert!(
        widest(text) <= WIDTH,
        "`oqpctl {command}` is {} columns wide at COLUMNS={WIDTH}:\n{text}",
        widest(text)
    );
    assert!(
        !text.contains('\u{1b}'),
        "colour codes into a pipe:\n{text}"
    );
}

async fn busy_stack(dir: &std::path::Path) -> (FakeOllama, Stack) {
    let fake = FakeOllama::builder()
        .model("llama3")
        .model("qwen2.5-coder:32b-instruct-q4_K_M")
        .loaded("llama3")
        .slots(4)
        .spawn()
        .await;
    let state = dir.join("state");
    std::fs::create_dir(&state).unwrap();
    let stack = Stack::start(&config(&fake.url(), &state.display().to_string())).await;
    let auth = format!("Bearer {CHAT}");
    for _ in 0..3 {
        let reply = HttpClient::new()
            .post_json(
                &format!("{}/api/generate", stack.url()),
                &[("authorization", &auth)],
                &json!({"model": "llama3", "prompt": "hi", "stream": false}),
            )
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    (fake, stack)
}

#[tokio::test]
async fn every_table_fits_100_columns() {
    let dir = tempfile::tempdir().unwrap();
    let (_fake, stack) = busy_stack(dir.path()).await;
    let added = oqpctl(
        &stack,
        &[],
        &[
            "keys",
            "add",
            "nightly-batch-embedding-pipeline",
            "--max-priority",
            "low",
            "--scope",
            "inference",
        ],
    )
    .await;
    stdout(&added);
    let rotated = oqpctl(
        &stack,
        &[],
        &[
            "keys",
            "rotate",
            "nightly-batch-embedding-pipeline",
            "--grace",
            "1h",
        ],
    )
    .await;
    stdout(&rotated);
    for command in [
        &["status"][..],
        &["hosts"],
        &["clients"],
        &["keys", "list"],
        &["usage"],
        &["usage", "--by", "model"],
    ] {
        let text = stdout(&oqpctl(&stack, &[], command).await);
        assert_fits(&command.join(" "), &text);
    }
    // `--wide` shows everything, however wide.
    let wide = stdout(&oqpctl(&stack, &[], &["keys", "list", "--wide"]).await);
    assert!(widest(&wide) > WIDTH, "{wide}");
    assert!(wide.contains("created"), "{wide}");
    stack.shutdown().await;
}

#[tokio::test]
async fn a_rotated_key_is_one_client() {
    let dir = tempfile::tempdir().unwrap();
    let (_fake, stack) = busy_stack(dir.path()).await;
    let client = "nightly-batch";
    stdout(
        &oqpctl(
            &stack,
            &[],
            &[
                "keys",
                "add",
                client,
                "--max-priority",
                "normal",
                "--scope",
                "inference",
            ],
        )
        .await,
    );
    stdout(&oqpctl(&stack, &[], &["keys", "rotate", client, "--grace", "1h"]).await);
    let json: Value = serde_json::from_str(&stdout(
        &oqpctl(&stack, &[], &["clients", "-o", "json"]).await,
    ))
    .unwrap();
    let rows = json
        .as_array()
        .unwrap()
        .iter()
        .filter(|row| row["client_id"] == client)
        .count();
    assert_eq!(rows, 1, "{json}");
    let table = stdout(&oqpctl(&stack, &[], &["clients"]).await);
    let rows = table
        .lines()
        .filter(|line| line.split(['|', '│']).any(|cell| cell.trim() == client))
        .count();
    assert_eq!(rows, 1, "{table}");
    stack.shutdown().await;
}

#[tokio::test]
async fn with_auth_off_clients_lists_the_callers_that_name_themselves() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "ollama:\n  hosts:\n    - {{url: '{}', name: gpu}}\nauth:\n  enabled: false\n\
         control_plane:\n  state_dir: '{}'\n",
        fake.url(),
        dir.path().join("state").display()
    );
    let stack = Stack::start(&yaml).await;
    let reply = HttpClient::new()
        .post_json(
            &format!("{}/api/generate", stack.url()),
            &[("x-client-id", "alice-notebook")],
            &json!({"model": "llama3", "prompt": "hi", "stream": false}),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    // The data plane reports every second: wait for the report that carries the caller.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let listed = loop {
        let json: Value = serde_json::from_str(&stdout(
            &oqpctl(&stack, &[], &["clients", "-o", "json"]).await,
        ))
        .unwrap();
        let row = json
            .as_array()
            .unwrap()
            .iter()
            .find(|row| row["client_id"] == "alice-notebook")
            .cloned();
        if let Some(row) = row.filter(|row| row["processed"] == 1) {
            break row;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the caller never listed: {json}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(listed["processed"], 1);
    let table = stdout(&oqpctl(&stack, &[], &["clients"]).await);
    assert!(table.contains("alice-notebook"), "{table}");
    assert_fits("clients", &table);
    stack.shutdown().await;
}
