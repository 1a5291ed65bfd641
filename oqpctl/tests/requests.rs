//! `oqpctl requests` reads the request log's day files where they are, with no control plane:
//! the real binary against files written as a data plane writes them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, SystemTime};

fn oqpctl(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_oqpctl"))
        .args(args)
        .env_remove("OQP_REQUEST_LOG")
        .output()
        .unwrap()
}

#[test]
fn the_requests_of_a_client_and_its_users_in_the_period() {
    let dir = tempfile::tempdir().unwrap();
    let now = SystemTime::now();
    let time =
        |ago: u64| humantime::format_rfc3339_millis(now - Duration::from_secs(ago)).to_string();
    let today = &time(0)[..10];
    let lines = [
        format!(
            r#"{{"time":"{}","client":"webui/ada","user":"ada","route":"/api/chat","status":200,"host":"gpu-a"}}"#,
            time(60)
        ),
        format!(
            r#"{{"time":"{}","client":"batch","route":"/api/chat","status":200}}"#,
            time(30)
        ),
        format!(
            r#"{{"time":"{}","client":"webui","route":"/api/chat","status":429,"error":"rate limit exceeded: 1 requests per minute"}}"#,
            time(20)
        ),
    ];
    std::fs::write(
        dir.path().join(format!("requests.{today}.jsonl")),
        lines.join("\n") + "\n",
    )
    .unwrap();
    let file = dir.path().join("requests.jsonl");
    let file = file.to_str().unwrap();
    let output = oqpctl(&[
        "requests", "--file", file, "--client", "webui", "--since", "10m", "-o", "json",
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).unwrap();
    let clients: Vec<String> = text
        .lines()
        .map(|line| {
            serde_json::from_str::<serde_json::Value>(line).unwrap()["client"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(clients, ["webui/ada", "webui"]);
    // The period: 25 s back leaves the first two out.
    let output = oqpctl(&["requests", "--file", file, "--since", "25s", "--no-color"]);
    let table = String::from_utf8(output.stdout).unwrap();
    assert!(
        table.contains("rate limit exceeded") && !table.contains("gpu-a"),
        "{table}"
    );
    // No log there: a clear error.
    let missing = oqpctl(&["requests", "--file", "/nonexistent/requests.jsonl"]);
    assert!(!missing.status.success());
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("no request log"),
        "{}",
        String::from_utf8_lossy(&missing.stderr)
    );
}
