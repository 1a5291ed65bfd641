//! The ollama.com mode: Bearer keys, scripted rate limits and overloads, usage.

use http::{Method, StatusCode};

use super::{Answer, call, call_with};
use crate::fake::{CloudPlan, CloudReply, CloudUsageShape, FakeOllama};

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
async fn usage_reports_the_accounts_spend_in_both_shapes_within_the_read_limit() {
    let fake = FakeOllama::builder()
        .model("gpt-oss:120b")
        .cloud(&["k1", "k2"])
        .spawn()
        .await;
    let (addr, handle) = (fake.addr(), fake.handle());
    handle.set_cloud_account("acme", &["k1", "k2"]);
    handle.set_cloud_price(0.5);
    assert_eq!(chat(addr, Some("k1")).await.status, StatusCode::OK);
    assert_eq!(chat(addr, Some("k2")).await.status, StatusCode::OK);
    let usage = |key: &'static str| async move {
        let bearer = format!("Bearer {key}");
        call_with(
            addr,
            Method::GET,
            "/api/usage?range=30d&scope=self&group_by=model",
            "",
            &[("authorization", &bearer)],
        )
        .await
    };
    // Both keys' requests, on the one account: 2 requests of 5 output tokens at $0.5.
    let dollars = usage("k1").await.json();
    assert_eq!(dollars["usage_usd"], 5.0, "{dollars}");
    assert_eq!(dollars["request_count"], 2, "{dollars}");
    assert_eq!(dollars["output_tokens"], 10, "{dollars}");
    assert_eq!(dollars["models"][0]["model"], "gpt-oss:120b", "{dollars}");
    assert_eq!(handle.cloud_spent("acme"), 5.0);
    handle.set_cloud_usage_shape("acme", CloudUsageShape::Monthly);
    let monthly = usage("k2").await.json();
    assert_eq!(
        monthly["limits"]["monthly"]["usage"]["usage_usd"], 5.0,
        "{monthly}"
    );
    // Balance and usage reads share the account's limit.
    handle.set_cloud_read_limit(3);
    let balance = call_with(
        addr,
        Method::GET,
        "/api/balance",
        "",
        &[("authorization", "Bearer k1")],
    )
    .await;
    assert_eq!(balance.status, StatusCode::OK);
    let limited = usage("k2").await;
    assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(limited.headers.contains_key(http::header::RETRY_AFTER));
    let reads = handle.cloud_balance_reads("acme");
    assert_eq!(
        reads
            .iter()
            .map(|read| (read.usage, read.limited))
            .collect::<Vec<_>>(),
        [(true, false), (true, false), (false, false), (true, true)]
    );
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

async fn balance(addr: std::net::SocketAddr, key: &str) -> Answer {
    let bearer = format!("Bearer {key}");
    call_with(
        addr,
        Method::GET,
        "/api/balance",
        "",
        &[("authorization", &bearer)],
    )
    .await
}

#[tokio::test]
async fn an_extra_usage_only_model_is_refused_with_402_on_an_account_without_extra_usage() {
    let fake = FakeOllama::builder()
        .model("gpt-oss:120b")
        .cloud(&["k1", "k2", "k3"])
        .spawn()
        .await;
    let (addr, handle) = (fake.addr(), fake.handle());
    handle.set_cloud_account("alice", &["k1", "k2"]);
    handle.set_cloud_account("bob", &["k3"]);
    handle.cloud_extra_usage_only("gpt-oss:120b");
    handle.set_cloud_extra("bob", 5.0);
    for key in ["k1", "k2"] {
        let refused = chat(addr, Some(key)).await;
        assert_eq!(refused.status, StatusCode::PAYMENT_REQUIRED);
        assert!(
            refused
                .error()
                .starts_with("this model uses extra usage only (not included plan usage)"),
            "{}",
            refused.text()
        );
    }
    assert_eq!(chat(addr, Some("k3")).await.status, StatusCode::OK);
    // Model-free routes and /api/show still work for alice.
    assert_eq!(balance(addr, "k1").await.status, StatusCode::OK);
}

#[tokio::test]
async fn balances_come_in_both_plan_shapes_and_fall_with_output_tokens() {
    let fake = FakeOllama::builder()
        .model("gpt-oss:120b")
        .tokens(10)
        .cloud(&["k1", "k2", "k3"])
        .spawn()
        .await;
    let (addr, handle) = (fake.addr(), fake.handle());
    handle.set_cloud_account("alice", &["k1", "k2"]);
    handle.set_cloud_account("carol", &["k3"]);
    handle.set_cloud_plan(
        "alice",
        CloudPlan::Credits {
            allowance_usd: 20.0,
            balance_usd: 1.0,
        },
    );
    handle.set_cloud_extra("alice", 2.0);
    handle.set_cloud_plan(
        "carol",
        CloudPlan::Windows {
            session_percent: 70.0,
            weekly_percent: 40.0,
        },
    );
    handle.set_cloud_price(0.25);
    let credits = balance(addr, "k2").await.json();
    assert_eq!(credits["included"]["balance_usd"], 1.0);
    assert_eq!(credits["included"]["allowance_usd"], 20.0);
    assert_eq!(credits["period"]["type"], "monthly");
    assert!(credits["period"]["resets_at"].is_string());
    // 10 output tokens at $0.25: the included dollar, then 1.5 of the extra 2.
    assert_eq!(chat(addr, Some("k1")).await.status, StatusCode::OK);
    let after = balance(addr, "k1").await.json();
    assert_eq!(after["included"]["balance_usd"], 0.0);
    assert_eq!(after["extra"]["balance_usd"], 0.5);
    let windows = balance(addr, "k3").await.json();
    assert_eq!(windows["session"]["remaining_percent"], 70.0);
    assert_eq!(windows["weekly"]["remaining_percent"], 40.0);
    assert!(windows["weekly"]["resets_at"].is_string());
}

#[tokio::test]
async fn balance_reads_past_the_limit_get_429_with_retry_after_per_account() {
    let fake = FakeOllama::builder()
        .cloud(&["k1", "k2", "k3"])
        .spawn()
        .await;
    let (addr, handle) = (fake.addr(), fake.handle());
    handle.set_cloud_account("alice", &["k1", "k2"]);
    for read in 0..crate::fake::READS_PER_MINUTE {
        let key = if read % 2 == 0 { "k1" } else { "k2" };
        assert_eq!(
            balance(addr, key).await.status,
            StatusCode::OK,
            "read {read}"
        );
    }
    // The eleventh read of alice's, whichever key: 429 with Retry-After.
    let limited = balance(addr, "k2").await;
    assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);
    let after: u64 = limited.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&after), "{after}");
    // Another account has its own budget.
    assert_eq!(balance(addr, "k3").await.status, StatusCode::OK);
    let reads = handle.cloud_balance_reads("alice");
    assert_eq!(reads.len(), 11);
    assert_eq!(reads.iter().filter(|read| read.limited).count(), 1);
}
