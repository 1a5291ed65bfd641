//! `oqpctl health`, the containers' health check: the real binary against a real single-box
//! control plane, with auth on and no key given.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Output;

use oqp_controlplane::config::Env;
use oqp_controlplane::{ControlPlane, Options};

async fn health(url: &str) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_oqpctl"))
        .args(["health", url])
        .env_remove("OQPCTL_KEY")
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
async fn health_passes_on_the_proxys_health_and_fails_on_anything_else() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yml");
    std::fs::write(
        &config,
        "ollama:\n  hosts:\n    - {url: 'http://127.0.0.1:9', name: nowhere}\n\
         auth:\n  enabled: true\n  keys:\n\
         \x20   - {key: sk-admin-0123456789, client_id: admin, scope: management}\n",
    )
    .unwrap();
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_addr = proxy.local_addr().unwrap();
    let control = ControlPlane::start(Options {
        config_path: config,
        env: Env::empty(),
        listener: Some(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()),
        with_dataplane: true,
        dataplane_listener: Some(proxy),
        clock: None,
    })
    .await
    .unwrap();

    // The proxy's /health: open with auth on, so the probe needs no key.
    let healthy = health(&format!("http://{proxy_addr}/health")).await;
    assert!(healthy.status.success(), "{}", text(&healthy));
    assert!(text(&healthy).contains("200 OK"), "{}", text(&healthy));

    // Another path answers 401 without a key: unhealthy, exit 1, the status named.
    let refused = health(&format!("http://{proxy_addr}/queue/summary")).await;
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused));
    assert!(text(&refused).contains("HTTP 401"), "{}", text(&refused));

    // The control plane alone: its gRPC port accepts connections.
    let grpc = health(&format!("tcp://{}", control.local_addr())).await;
    assert!(grpc.status.success(), "{}", text(&grpc));
    // gRPC is not HTTP/1: asked for a page, it is no healthy proxy.
    let wrong = health(&format!("http://{}/health", control.local_addr())).await;
    assert_eq!(wrong.status.code(), Some(1), "{}", text(&wrong));

    control.shutdown().await;

    // Nothing listening: exit 1, saying where it looked.
    let gone = health(&format!("http://{proxy_addr}/health")).await;
    assert_eq!(gone.status.code(), Some(1), "{}", text(&gone));
    assert!(
        text(&gone).contains(&proxy_addr.to_string()),
        "{}",
        text(&gone)
    );
    let unknown = health("https://127.0.0.1:1/health").await;
    assert_eq!(unknown.status.code(), Some(1), "{}", text(&unknown));
}
