//! End to end: the edges of usage accounting and budgets — a graceful stop, embeddings
//! with the cache off, budgets re-checked when a queued request is granted, model
//! management, failed writes and cut-short streams.

use std::time::Duration;

use oqp_tests::client::eventually;
use oqp_tests::harness;
use serde_json::json;

use super::{SECOND, config, fake, post, usage_of};

/// A control plane alone on `yaml` (written under `dir`), and its URL.
async fn control_plane(
    dir: &std::path::Path,
    yaml: &str,
) -> (oqp_controlplane::ControlPlane, String) {
    let config_path = dir.join("config.yml");
    std::fs::write(&config_path, yaml).unwrap();
    let control = harness::start_control_plane(&config_path, harness::loopback().await)
        .await
        .unwrap();
    let url = format!("http://{}", control.local_addr());
    (control, url)
}

#[tokio::test]
async fn a_request_streaming_through_a_graceful_stop_is_in_the_totals() {
    // 20 chunks 50 ms apart: the stream runs on for about a second after the stop begins.
    let fake = fake()
        .tokens(20)
        .token_interval(Duration::from_millis(50))
        .spawn()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let (control, control_url) = control_plane(
        dir.path(),
        &config(&fake.url(), &state.display().to_string(), ""),
    )
    .await;
    let edge = harness::start_dataplane(&control_url, "edge", Some(control.node_token()))
        .await
        .unwrap();
    let base = format!("http://{}", edge.local_addr());
    let streaming = tokio::spawn(async move {
        post(
            &base,
            "/api/chat",
            "total_duration=3000000000,prompt_eval_count=2,eval_count=20",
            json!({"model": "llama3", "messages": [{"role": "user", "content": "hi"}], "stream": true}),
        )
        .await
    });
    assert!(eventually(Duration::from_secs(10), || fake.handle().in_flight() == 1).await);
    edge.shutdown().await;
    let reply = streaming.await.unwrap();
    assert!(reply.text().contains("\"done\":true"), "{}", reply.text());
    // Reported before the stop returned: no waiting here.
    let usage = usage_of(&control_url, 0, true, true).await;
    let total = usage.total.clone().unwrap_or_default();
    assert_eq!(total.requests, 1, "{usage:?}");
    assert_eq!(total.gpu_ns, 3 * SECOND);
    assert_eq!((total.prompt_tokens, total.completion_tokens), (2, 20));
    control.shutdown().await;
}

#[tokio::test]
async fn native_embeddings_with_the_cache_off_count_their_inputs() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = config(&fake.url(), &dir.path().display().to_string(), "").replace(
        "embedding_cache:\n  enabled: true\n  backend: memory\n",
        "embedding_cache:\n  enabled: false\n",
    );
    assert!(yaml.contains("enabled: false"));
    let stack = harness::Stack::start(&yaml).await;
    let base = stack.url();
    let reported = "total_duration=1000000,prompt_eval_count=1";
    let embed = json!({"model": "nomic-embed-text", "input": ["alpha", "beta", "gamma"]});
    post(&base, "/api/embed", reported, embed.clone()).await;
    let again = post(&base, "/api/embed", reported, embed).await;
    assert_eq!(again.header("x-cache"), None, "the cache is off");
    let legacy = json!({"model": "nomic-embed-text", "prompt": "delta"});
    post(&base, "/api/embeddings", reported, legacy).await;
    let usage = super::wait_for_requests(&stack.control_url(), 3).await;
    let row = usage
        .rows
        .iter()
        .find(|row| row.client_id == "chat" && row.model == "nomic-embed-text")
        .unwrap_or_else(|| panic!("{usage:?}"));
    assert_eq!(row.embedding_inputs, 7, "3 + 3 + 1 inputs sent upstream");
    assert_eq!(row.cached_inputs, 0);
    stack.shutdown().await;
}

const BATCH_KEY: &str = "sk-batch-0123456789";

async fn generate_as(base: &str, key: &str, reported: &str) -> oqp_tests::client::Reply {
    let auth = format!("Bearer {key}");
    oqp_tests::client::HttpClient::new()
        .post_json(
            &format!("{base}/api/generate"),
            &[
                ("authorization", auth.as_str()),
                (oqp_tests::fake::USAGE_HEADER, reported),
            ],
            &json!({"model": "llama3", "prompt": "hi", "stream": false}),
        )
        .await
}

/// One slot, and `batch` with a budget of 10 GPU seconds a day.
fn one_slot_budgeted(url: &str, state_dir: &str, proxy_extra: &str) -> String {
    config(
        url,
        state_dir,
        &format!(
            "    - key: \"{BATCH_KEY}\"\n      client_id: batch\n      budget: {{gpu_seconds: 10, window: 1d}}\n"
        ),
    )
    .replace(
        "proxy:\n  max_concurrent: 4\n",
        &format!("proxy:\n  max_concurrent: 1\n{proxy_extra}"),
    )
    .replace("      max_concurrent: 4\n", "      max_concurrent: 1\n")
}

#[tokio::test]
async fn requests_granted_after_the_budget_is_spent_are_refused() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = one_slot_budgeted(&fake.url(), &dir.path().display().to_string(), "");
    assert!(yaml.contains("max_concurrent: 1\n"), "{yaml}");
    let stack = harness::Stack::start(&yaml).await;
    let base = stack.url();
    let dataplane = stack.control.dataplane().unwrap();
    fake.handle().hold();
    // The slow one: 20 s of GPU time, twice the budget, reported when it ends.
    let slow = tokio::spawn({
        let base = base.clone();
        async move { generate_as(&base, BATCH_KEY, "total_duration=20000000000").await }
    });
    assert!(eventually(Duration::from_secs(10), || fake.handle().in_flight() == 1).await);
    // Three more, admitted (nothing used yet) and queued behind it.
    let queued: Vec<_> = (0..3)
        .map(|_| {
            let base = base.clone();
            tokio::spawn(
                async move { generate_as(&base, BATCH_KEY, "total_duration=1000000000").await },
            )
        })
        .collect();
    assert!(
        eventually(Duration::from_secs(10), || dataplane
            .app()
            .dispatcher
            .total_depth()
            == 3)
        .await
    );
    fake.handle().release_all();
    assert_eq!(slow.await.unwrap().status, 200);
    for waiting in queued {
        let refused = waiting.await.unwrap();
        assert_eq!(refused.status, 429, "{}", refused.text());
        assert_eq!(
            refused.json()["error"],
            "budget exceeded: gpu_seconds 10 per 1d"
        );
        let retry_after: u64 = refused.header("retry-after").unwrap().parse().unwrap();
        assert!((1..=86_400).contains(&retry_after), "{retry_after}");
    }
    assert_eq!(
        fake.handle().requests_to("/api/generate").len(),
        1,
        "none of the queued ones was sent upstream"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn model_management_is_neither_accounted_nor_refused_for_a_budget() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = one_slot_budgeted(
        &fake.url(),
        &dir.path().display().to_string(),
        "  allow_model_management: true\n",
    );
    let stack = harness::Stack::start(&yaml).await;
    let base = stack.url();
    let pull = |key: &'static str| {
        let base = base.clone();
        async move {
            oqp_tests::client::HttpClient::new()
                .post_json(
                    &format!("{base}/api/pull"),
                    &[("authorization", format!("Bearer {key}").as_str())],
                    &json!({"model": "mistral", "stream": false}),
                )
                .await
        }
    };
    // The budget spent.
    assert_eq!(
        generate_as(&base, BATCH_KEY, "total_duration=20000000000")
            .await
            .status,
        200
    );
    assert_eq!(
        generate_as(&base, BATCH_KEY, "total_duration=1")
            .await
            .status,
        429
    );
    // A pull still goes through, for the budgeted client and another one.
    let pulled = pull(BATCH_KEY).await;
    assert_eq!(pulled.status, 200, "{}", pulled.text());
    assert_eq!(pull(super::CHAT_KEY).await.status, 200);
    // And counts nothing: only the generates are in the totals (the last one reported
    // after the pulls).
    assert_eq!(
        generate_as(&base, super::CHAT_KEY, "total_duration=1000000000")
            .await
            .status,
        200
    );
    let usage = super::wait_for_requests(&stack.control_url(), 2).await;
    assert_eq!(usage.total.unwrap().gpu_ns, 21 * SECOND, "{:?}", usage.rows);
    assert!(
        usage.rows.iter().all(|row| row.model == "llama3"),
        "{:?}",
        usage.rows
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn a_stream_cut_short_counts_the_chunks_it_sent() {
    let fake = fake().tokens(10).spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let stack =
        harness::Stack::start(&config(&fake.url(), &dir.path().display().to_string(), "")).await;
    fake.handle()
        .fail_next(oqp_tests::fake::Failure::DieMidStream { after_lines: 3 });
    let body =
        json!({"model": "llama3", "messages": [{"role": "user", "content": "hi"}], "stream": true});
    let sent = serde_json::to_vec(&body).unwrap().len() as u64;
    let cut = post(
        &stack.url(),
        "/api/chat",
        "total_duration=5000000000,prompt_eval_count=4,eval_count=10",
        body,
    )
    .await;
    assert!(cut.text().contains("\"error\""), "{}", cut.text());
    let usage = super::wait_for_requests(&stack.control_url(), 1).await;
    let total = usage.total.unwrap();
    // No final object: the three chunks stand for the completion tokens, and the body sent
    // (the client's, with the keep_alive oqp adds) for the prompt, a token every four bytes.
    assert_eq!(total.completion_tokens, 3);
    assert!(
        total.prompt_tokens >= sent.div_ceil(4) && total.prompt_tokens < sent,
        "{total:?} for {sent} bytes"
    );
    assert!(total.gpu_ns > 0, "the time the slot was held");
    stack.shutdown().await;
}

#[tokio::test]
async fn an_openai_stream_without_usage_is_charged_its_prompt_against_a_token_budget() {
    const TOKENS_KEY: &str = "sk-tokens-0123456789";
    let fake = fake().tokens(3).spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = config(
        &fake.url(),
        &dir.path().display().to_string(),
        &format!(
            "    - key: \"{TOKENS_KEY}\"\n      client_id: writer\n      budget: {{tokens: 100, window: 1d}}\n"
        ),
    );
    let stack = harness::Stack::start(&yaml).await;
    // A long prompt (600 bytes of content) and three tokens of answer, streamed without
    // `stream_options.include_usage`: the stream states no counts.
    let body = json!({
        "model": "qwen",
        "messages": [{"role": "user", "content": "word ".repeat(120)}],
        "stream": true,
    });
    let sent = serde_json::to_vec(&body).unwrap().len() as u64;
    let url = format!("{}/v1/chat/completions", stack.url());
    let auth = format!("Bearer {TOKENS_KEY}");
    let http = oqp_tests::client::HttpClient::new();
    let headers = [("authorization", auth.as_str())];
    let send = || http.post_json(&url, &headers, &body);
    let first = send().await;
    assert_eq!(first.status, 200, "{}", first.text());
    assert!(!first.text().contains("\"usage\""), "{}", first.text());
    // Its prompt is charged as the body's size in tokens of four bytes: past the budget.
    let refused = send().await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    let usage = super::wait_for_requests(&stack.control_url(), 1).await;
    let total = usage.total.unwrap();
    assert_eq!(total.prompt_tokens, sent.div_ceil(4), "{total:?}");
    stack.shutdown().await;
}

#[tokio::test]
async fn a_request_abandoned_before_its_answer_is_charged_the_slot_time_it_held() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let stack =
        harness::Stack::start(&config(&fake.url(), &dir.path().display().to_string(), "")).await;
    let base = stack.url();
    // Ollama computes (the fake holds the request in its slot) and the client leaves
    // before any byte of the answer.
    fake.handle().hold();
    let leaving = tokio::spawn(async move {
        post(
            &base,
            "/api/generate",
            "total_duration=5000000000,prompt_eval_count=1,eval_count=1",
            json!({"model": "llama3", "prompt": "hi", "stream": false}),
        )
        .await
    });
    tokio::time::timeout(Duration::from_secs(10), fake.handle().wait_in_flight(1))
        .await
        .unwrap();
    leaving.abort();
    tokio::time::timeout(Duration::from_secs(10), fake.handle().wait_cancelled(1))
        .await
        .expect("oqp never gave the request up");
    fake.handle().release_all();
    let usage = super::wait_for_requests(&stack.control_url(), 1).await;
    let total = usage.total.unwrap_or_default();
    assert!(
        total.gpu_ns > 0 && total.gpu_ns < 5 * SECOND,
        "the slot time held, not a figure the answer never gave: {total:?}"
    );
    assert_eq!((total.prompt_tokens, total.completion_tokens), (0, 0));
    stack.shutdown().await;
}

#[tokio::test]
async fn a_damaged_usage_file_is_set_aside_and_the_control_plane_starts() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let usage = dir.path().join("usage");
    std::fs::create_dir(&usage).unwrap();
    let yesterday = std::time::SystemTime::now() - Duration::from_secs(86_400);
    let name = format!(
        "{}.json",
        &humantime::format_rfc3339_seconds(yesterday).to_string()[..10]
    );
    std::fs::write(usage.join(&name), b"{\"format\": 1, \"day\": trunc").unwrap();
    let stack =
        harness::Stack::start(&config(&fake.url(), &dir.path().display().to_string(), "")).await;
    assert!(
        usage.join(format!("{name}.unreadable")).exists(),
        "kept aside"
    );
    post(
        &stack.url(),
        "/api/generate",
        "total_duration=1000000000,prompt_eval_count=1,eval_count=1",
        json!({"model": "llama3", "prompt": "hi", "stream": false}),
    )
    .await;
    let totals = super::wait_for_requests(&stack.control_url(), 1).await;
    assert_eq!(totals.total.unwrap_or_default().gpu_ns, SECOND);
    stack.shutdown().await;
}

#[tokio::test]
async fn an_embedding_the_cache_holds_is_refused_once_the_budget_is_spent() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = one_slot_budgeted(&fake.url(), &dir.path().display().to_string(), "");
    assert!(yaml.contains("backend: memory"), "{yaml}");
    let stack = harness::Stack::start(&yaml).await;
    let embed = async |reported: &str| {
        oqp_tests::client::HttpClient::new()
            .post_json(
                &format!("{}/api/embed", stack.url()),
                &[
                    ("authorization", &format!("Bearer {BATCH_KEY}")),
                    (oqp_tests::fake::USAGE_HEADER, reported),
                ],
                &json!({"model": "nomic-embed-text", "input": "hello"}),
            )
            .await
    };
    // A miss, computed and cached: 20 s of GPU time against a budget of 10.
    let first = embed("total_duration=20000000000").await;
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.header("x-cache").as_deref(), Some("MISS"));
    // The same input again: the cache has it whole, and the spent budget still refuses it.
    let again = embed("total_duration=1").await;
    assert_eq!(again.status, 429, "{}", again.text());
    assert_eq!(
        again.json()["error"],
        "budget exceeded: gpu_seconds 10 per 1d"
    );
    assert_eq!(fake.handle().requests_to("/api/embed").len(), 1);
    stack.shutdown().await;
}
