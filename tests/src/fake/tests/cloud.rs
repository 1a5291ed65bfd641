//! The ollama.com mode: Bearer keys, scripted rate limits and overloads, usage.

use http::{Method, StatusCode};

use super::{Answer, call, call_with};
use crate::fake::{CloudReply, FakeOllama};

const CHAT: &str =
    r#"{"model":"gpt-oss:120b","stream":false,"messages":[{"role":"user","content":"hi"}]}"#;

async fn chat(addr: std::net::SocketAddr, key: Option<&str>) -> Answer {
    let bearer = key.map(|key| format!("Bearer {key}"));
    let headers: Vec<(&str, &str)> = bearer
        .iter()
        .map(|value| ("authorization", value.as_str()))
        .collect();
    call_with(addr, Method::POST, "/api/chat", CHAT, &headers).await
}

#[tokio::test]
async fn keys_are_required() {
    let fake = FakeOllama::builder()
        .model("gpt-oss:120b")
        .cloud(&["k1", "k2"])
        .spawn()
        .await;
    let addr = fake.addr();
    for key in [None, Some("wrong")] {
        let refused = chat(addr, key).await;
        assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
        assert_eq!(refused.text(), r#"{"error":"unauthorized"}"#);
    }
    assert_eq!(
        call(addr, Method::GET, "/api/tags", "").await.status,
        StatusCode::OK
    );
    assert_eq!(chat(addr, Some("k1")).await.status, StatusCode::OK);
    assert_eq!(chat(addr, Some("k2")).await.status, StatusCode::OK);
    let handle = fake.handle();
    assert_eq!(handle.requests_with_key("k1").len(), 1);
    assert_eq!(handle.requests_with_key("wrong").len(), 1);
    assert_eq!(handle.peak_concurrency_of_key("k2"), 1);
}

#[tokio::test]
async fn scripted_replies_are_consumed_per_key() {
    let fake = FakeOllama::builder()
        .model("gpt-oss:120b")
        .cloud(&["k1", "k2"])
        .spawn()
        .await;
    let (addr, handle) = (fake.addr(), fake.handle());
    handle.script_cloud("k1", CloudReply::SessionLimit);
    handle.script_cloud("k1", CloudReply::WeeklyLimit);
    handle.script_cloud("k1", CloudReply::HourlyLimit);
    handle.script_cloud("k2", CloudReply::Overloaded);
    handle.script_cloud("k2", CloudReply::SlotTimeout);
    handle.script_cloud("k2", CloudReply::Unauthorized);

    for window in ["session", "weekly", "hourly"] {
        let limited = chat(addr, Some("k1")).await;
        assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);
        let message = limited.error();
        assert!(
            message.starts_with(&format!(
                "you (user) have reached your {window} usage limit, upgrade"
            )),
            "{message}"
        );
        assert!(
            message.ends_with(')') && message.contains("(ref: "),
            "{message}"
        );
        assert!(limited.headers.get("retry-after").is_none());
    }
    assert_eq!(chat(addr, Some("k1")).await.status, StatusCode::OK);

    let overloaded = chat(addr, Some("k2")).await;
    assert_eq!(overloaded.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        overloaded
            .error()
            .starts_with("Server overloaded, please retry shortly (ref: ")
    );
    let slot = chat(addr, Some("k2")).await;
    assert_eq!(
        slot.error(),
        "timed out waiting for a concurrent request slot"
    );
    assert_eq!(
        chat(addr, Some("k2")).await.status,
        StatusCode::UNAUTHORIZED
    );

    handle.set_cloud_default("k2", CloudReply::WeeklyLimit);
    assert_eq!(
        chat(addr, Some("k2")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        chat(addr, Some("k2")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    handle.set_cloud_default("k2", CloudReply::Ok);
    assert_eq!(chat(addr, Some("k2")).await.status, StatusCode::OK);
}

#[tokio::test]
async fn usage_reports_fractions_per_key() {
    let fake = FakeOllama::builder().cloud(&["k1"]).spawn().await;
    fake.handle().set_cloud_usage("k1", 0.25, 0.5);
    let usage = call_with(
        fake.addr(),
        Method::GET,
        "/api/usage",
        "",
        &[("authorization", "Bearer k1")],
    )
    .await
    .json();
    assert_eq!(usage["limits"]["session"]["usage"], 0.25);
    assert_eq!(usage["limits"]["weekly"]["usage"], 0.5);
    let refused = call(fake.addr(), Method::GET, "/api/usage", "").await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    let local = FakeOllama::builder().spawn().await;
    assert_eq!(
        call(local.addr(), Method::GET, "/api/usage", "")
            .await
            .status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn a_subscription_model_is_refused_per_key_and_a_suspended_key_everywhere() {
    let fake = FakeOllama::builder()
        .model("gpt-oss:120b")
        .cloud(&["k1", "k2", "k3"])
        .spawn()
        .await;
    let (addr, handle) = (fake.addr(), fake.handle());
    handle.require_cloud_subscription("gpt-oss:120b", &["k2"]);
    handle.suspend_cloud_key("k3");
    let usage = |key: &'static str| {
        let bearer = format!("Bearer {key}");
        async move {
            call_with(
                addr,
                Method::GET,
                "/api/usage",
                "",
                &[("authorization", &bearer)],
            )
            .await
            .status
        }
    };
    // k1 lacks the subscription: 403 for the model only; its key still works elsewhere.
    let refused = chat(addr, Some("k1")).await;
    assert_eq!(refused.status, StatusCode::FORBIDDEN);
    assert!(
        refused.text().contains("requires a subscription"),
        "{}",
        refused.text()
    );
    assert_eq!(usage("k1").await, StatusCode::OK);
    assert_eq!(chat(addr, Some("k2")).await.status, StatusCode::OK);
    // A suspended key is refused on every authenticated route, the model-free ones included.
    assert_eq!(chat(addr, Some("k3")).await.status, StatusCode::FORBIDDEN);
    assert_eq!(usage("k3").await, StatusCode::FORBIDDEN);
}
