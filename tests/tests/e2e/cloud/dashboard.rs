//! The dashboard shows the cloud accounts as `oqpctl cloud` does: plan kind, balance or
//! windows, reserve, the models refused with a 402. Signed in in headless Chromium.

use std::time::Duration;

use oqp_tests::browser::{self, Browser};
use oqp_tests::client::HttpClient;
use oqp_tests::fake::CloudPlan;
use oqp_tests::harness::Stack;
use serde_json::json;

use super::{EXTRA, account, chat, cloud, fast_config, until_accounts};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_the_cloud_accounts() {
    let _exclusive = crate::support::exclusive().await;
    let Some(binary) = browser::find() else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "chromium is required in CI (scripts/setup.sh installs it)"
        );
        eprintln!("SKIPPED: chromium is not installed; run scripts/setup.sh");
        return;
    };
    let cloud = cloud().await;
    let handle = cloud.handle();
    handle.set_cloud_plan(
        "alice",
        CloudPlan::Credits {
            allowance_usd: 20.0,
            balance_usd: 12.5,
        },
    );
    handle.set_cloud_plan(
        "bob",
        CloudPlan::Windows {
            session_percent: 70.0,
            weekly_percent: 40.0,
        },
    );
    // Read every 3 s: the balance and usage reads of the first 15 s keep within the read
    // budget, so one missed read is followed by another soon.
    let section = "cloud:\n  balance_interval: 3\n  accounts:\n    alice:\n      reserve_usd: 2\n";
    let stack = Stack::start(&fast_config(&cloud.url(), section)).await;
    let http = HttpClient::new();
    let base = stack.url();
    // Both read, then the extra-usage-only model is refused by both (no extra usage).
    until_accounts(&http, &base, |accounts| {
        accounts.len() == 2 && accounts.iter().all(|account| !account["plan"].is_null())
    })
    .await;
    assert_eq!(chat(&http, &base, EXTRA).await.status, 402);
    let seen = until_accounts(&http, &base, |_| true).await;
    assert_eq!(
        account(&seen, "alice")["refused_models"],
        json!([{"model": "glm-5.2:latest", "reason": "extra_usage"}])
    );

    let browser = Browser::launch(&binary).await.unwrap();
    let mut page = browser.page().await.unwrap();
    page.call("Page.enable", json!({})).await.unwrap();
    page.navigate(&format!("{base}/dashboard")).await.unwrap();
    let limit = Duration::from_secs(20);
    page.wait_for("document.getElementById('login-form') !== null", limit)
        .await
        .unwrap();
    page.evaluate(
        "document.getElementById('key').value = 'sk-consumer-0123456789';\
         document.getElementById('login-form').requestSubmit(); true",
    )
    .await
    .unwrap();
    let filled = "document.getElementById('cloud') !== null && \
                  document.getElementById('cloud').rows.length === 2";
    page.wait_for(filled, limit).await.unwrap();
    assert_eq!(
        page.evaluate("document.getElementById('cloud-panel').hidden")
            .await
            .unwrap(),
        false
    );
    let rows = page
        .evaluate(
            "Array.from(document.getElementById('cloud').rows).map(function (r) {\
               return Array.from(r.cells).map(function (c) { return c.textContent; }); })",
        )
        .await
        .unwrap();
    let row = |name: &str| {
        rows.as_array()
            .unwrap()
            .iter()
            .find(|row| row[1] == name)
            .unwrap_or_else(|| panic!("no {name} in {rows}"))
            .clone()
    };
    let alice = row("alice");
    assert_eq!(alice[0], "cloud", "{alice}");
    assert_eq!(alice[2], "credits", "{alice}");
    assert_eq!(alice[3], "$12.50 of $20", "{alice}");
    assert_eq!(alice[5], "$2.00", "{alice}");
    assert_eq!(alice[6], "glm-5.2:latest (extra_usage)", "{alice}");
    let bob = row("bob");
    assert_eq!(bob[2], "windows", "{bob}");
    assert_eq!(bob[3], "session 70% weekly 40%", "{bob}");
    assert_eq!(bob[5], "–", "{bob}");
    assert_eq!(bob[6], "glm-5.2:latest (extra_usage)", "{bob}");
    // No key reaches the page.
    let leaked = "document.documentElement.outerHTML.indexOf('0000000000') >= 0";
    assert_eq!(page.evaluate(leaked).await.unwrap(), false);
    stack.shutdown().await;
}
