//! End to end: requests that outlive their head timeout. A host that took the whole request
//! and has not answered may be running it still: the request is not sent to another host
//! (it would run twice), the host is not taken for down, and the slot time it held is
//! charged, so that a budget holds for slow requests. A non-streamed generation's head comes
//! with its whole answer: it has a head timeout of its own (`ollama.non_streamed_timeout`).

use std::time::Duration;

use oqp_tests::client::{HttpClient, Reply, eventually};
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::Stack;
use serde_json::{Value, json};

use super::{CHAT_KEY, SECOND, config, fake, wait_for_requests};

/// Auth on, the hosts at `urls` (named `gpu0`, `gpu1`, …), the `ollama` keys `timeouts`, and
/// the chat key limited to `budget`.
fn hosts_config(urls: &[String], state_dir: &str, timeouts: &str, budget: &str) -> String {
    let mut hosts = String::new();
    for (index, url) in urls.iter().enumerate().skip(1) {
        hosts.push_str(&format!(
            "    - url: \"{url}\"\n      name: gpu{index}\n      max_concurrent: 4\n"
        ));
    }
    let yaml = config(&urls[0], state_dir, "")
        .replace("name: primary", "name: gpu0")
        .replace(
            "embedding_cache:\n",
            &format!("{hosts}{timeouts}embedding_cache:\n"),
        )
        .replace(
            "      client_id: chat\n",
            &format!("      client_id: chat\n{budget}"),
        );
    assert!(yaml.contains(timeouts) && yaml.contains(budget), "{yaml}");
    yaml
}

async fn generate(base: &str, stream: bool) -> Reply {
    let auth = format!("Bearer {CHAT_KEY}");
    HttpClient::new()
        .post_json(
            &format!("{base}/api/generate"),
            &[("authorization", auth.as_str())],
            &json!({"model": "llama3", "prompt": "hi", "stream": stream}),
        )
        .await
}

#[tokio::test]
async fn a_request_past_its_head_timeout_runs_once_is_charged_and_leaves_its_host_up() {
    // Two hosts that take every request and never answer it.
    let fakes: Vec<FakeOllama> = vec![fake().spawn().await, fake().spawn().await];
    for fake in &fakes {
        fake.handle().hold();
    }
    let urls: Vec<String> = fakes.iter().map(FakeOllama::url).collect();
    let dir = tempfile::tempdir().unwrap();
    let yaml = hosts_config(
        &urls,
        &dir.path().display().to_string(),
        "  request_timeout: 0.6\n",
        "      budget: {gpu_seconds: 1, window: 1d}\n",
    );
    let stack = Stack::start(&yaml).await;
    let base = stack.url();
    for attempt in 0..2 {
        let timed_out = generate(&base, false).await;
        assert_eq!(timed_out.status, 503, "{attempt}: {}", timed_out.text());
        assert_eq!(
            timed_out.header("x-failover-exhausted").as_deref(),
            Some("true")
        );
    }
    let received: usize = fakes
        .iter()
        .map(|fake| fake.handle().requests_to("/api/generate").len())
        .sum();
    assert_eq!(received, 2, "each request was sent to one host only");
    let dataplane = stack.control.dataplane().unwrap();
    let (_, hosts) = dataplane.app().dispatcher.load();
    assert_eq!(hosts.len(), 2);
    assert!(
        hosts.iter().all(|host| !host.marked_down),
        "a host that took the request is busy, not down: {hosts:?}"
    );
    // Each one held its slot for at least the head timeout: more than the second of budget.
    let refused = generate(&base, false).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    let usage = wait_for_requests(&stack.control_url(), 2).await;
    let total = usage.total.unwrap();
    assert!(total.gpu_ns >= 2 * 600 * SECOND / 1000, "{total:?}");
    for fake in &fakes {
        fake.handle().release_all();
    }
    stack.shutdown().await;
}

#[tokio::test]
async fn a_non_streamed_generation_waits_for_its_head_as_long_as_its_own_timeout() {
    let fake = fake().spawn().await;
    fake.handle().hold();
    let dir = tempfile::tempdir().unwrap();
    let yaml = hosts_config(
        &[fake.url()],
        &dir.path().display().to_string(),
        "  request_timeout: 0.5\n  non_streamed_timeout: 120\n",
        "",
    );
    let stack = Stack::start(&yaml).await;
    let base = stack.url();
    let whole = tokio::spawn({
        let base = base.clone();
        async move { generate(&base, false).await }
    });
    assert!(eventually(Duration::from_secs(10), || fake.handle().in_flight() == 1).await);
    // A streamed one sends its head with its first token: it is held to the request timeout.
    let streamed = generate(&base, true).await;
    assert_eq!(streamed.status, 503, "{}", streamed.text());
    assert!(
        !whole.is_finished(),
        "the non-streamed one waits on past the request timeout"
    );
    fake.handle().release_all();
    let whole = whole.await.unwrap();
    assert_eq!(whole.status, 200, "{}", whole.text());
    let answer: Value = whole.json();
    assert_eq!(answer["done"], true);
    stack.shutdown().await;
}
