//! End to end: usage accounting. The fake reports chosen figures per request
//! (`x-fake-usage`); the data plane's usage metrics, `/queue/status` and the control plane's
//! totals (`GetUsage`, kept in `state_dir`) must add up to exactly those, for streamed and
//! non-streamed chats and generates, embeds (cache hits counted apart, without GPU time)
//! and OpenAI calls.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, SystemTime};

use oqp_proto::admin::v1::{self as api, admin_service_client::AdminServiceClient};
use oqp_tests::client::{HttpClient, Reply, wait_until};
use oqp_tests::fake::{FakeOllama, USAGE_HEADER};
use oqp_tests::harness::{self, Stack};
use serde_json::{Value, json};

mod edges;
mod forged;
mod minute;
mod request_log;
mod timeouts;
mod transcriptions;
mod users;

pub const CHAT_KEY: &str = "sk-chat-0123456789";

/// Auth on, one host, the in-memory embedding cache; `extra` is appended under `auth.keys`'
/// level (more keys) or at the top.
pub fn config(url: &str, state_dir: &str, extra: &str) -> String {
    format!(
        r#"control_plane:
  state_dir: "{state_dir}"
proxy:
  max_concurrent: 4
ollama:
  hosts:
    - url: "{url}"
      name: primary
      max_concurrent: 4
embedding_cache:
  enabled: true
  backend: memory
auth:
  enabled: true
  keys:
    - key: "{CHAT_KEY}"
      client_id: chat
    - key: "sk-admin-0123456789"
      client_id: admin
      scope: management
{extra}"#
    )
}

pub fn fake() -> oqp_tests::fake::FakeBuilder {
    FakeOllama::builder()
        .model("llama3")
        .model("qwen")
        .embedding_model("nomic-embed-text")
        .slots(4)
}

/// POSTs `body` to `path` with the chat key and the figures the fake reports.
pub async fn post(base: &str, path: &str, reported: &str, body: Value) -> Reply {
    let auth = format!("Bearer {CHAT_KEY}");
    let mut headers = vec![("authorization", auth.as_str())];
    if !reported.is_empty() {
        headers.push((USAGE_HEADER, reported));
    }
    let reply = HttpClient::new()
        .post_json(&format!("{base}{path}"), &headers, &body)
        .await;
    assert_eq!(reply.status, 200, "{path}: {}", reply.text());
    reply
}

/// The mix of the issue: chats and generates streamed and not, embeds (one a cache hit),
/// OpenAI chats (non-streamed, streamed with and without `include_usage`) and an OpenAI
/// embed. Native figures are the fake's, chosen per request; OpenAI calls carry no
/// `total_duration`, so their GPU time is the slot's hold time (model `qwen`). Returns the
/// events of the stream without `include_usage`, which are its completion tokens, and its
/// body's size in tokens of four bytes, its prompt tokens.
pub async fn send_mix(base: &str) -> (u64, u64) {
    let chat = |stream: bool| json!({"model": "llama3", "messages": [{"role": "user", "content": "hi"}], "stream": stream});
    let generate = |stream: bool| json!({"model": "llama3", "prompt": "hi", "stream": stream});
    post(
        base,
        "/api/chat",
        "total_duration=1500000000,prompt_eval_count=11,eval_count=22",
        chat(false),
    )
    .await;
    let streamed = post(
        base,
        "/api/chat",
        "total_duration=2000000000,prompt_eval_count=5,eval_count=7",
        chat(true),
    )
    .await;
    assert!(streamed.text().lines().count() > 1, "streamed");
    post(
        base,
        "/api/generate",
        "total_duration=250000000,prompt_eval_count=3,eval_count=4",
        generate(false),
    )
    .await;
    post(
        base,
        "/api/generate",
        "total_duration=250000000,prompt_eval_count=1,eval_count=2",
        generate(true),
    )
    .await;

    let embed = json!({"model": "nomic-embed-text", "input": ["alpha", "beta"]});
    post(
        base,
        "/api/embed",
        "total_duration=125000000,prompt_eval_count=6",
        embed.clone(),
    )
    .await;
    let hit = post(
        base,
        "/api/embed",
        "total_duration=999000000000,prompt_eval_count=999",
        embed,
    )
    .await;
    assert_eq!(hit.header("x-cache").as_deref(), Some("HIT"));
    let openai_embed = json!({"model": "nomic-embed-text", "input": ["gamma", "delta", "epsilon"]});
    post(
        base,
        "/v1/embeddings",
        "total_duration=250000000,prompt_eval_count=4",
        openai_embed,
    )
    .await;

    let openai = |stream: bool, usage: bool| {
        let mut body = json!({"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "stream": stream});
        if usage {
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    };
    post(
        base,
        "/v1/chat/completions",
        "prompt_eval_count=8,eval_count=9",
        openai(false, false),
    )
    .await;
    let sse = post(
        base,
        "/v1/chat/completions",
        "prompt_eval_count=2,eval_count=3",
        openai(true, true),
    )
    .await;
    assert!(
        sse.text().contains("\"completion_tokens\":3"),
        "{}",
        sse.text()
    );
    // Without include_usage the stream carries no counts: its events stand for its
    // completion tokens (as a stream cut short), its body's size for its prompt tokens (a
    // token every four bytes, rounded up), and the slot's hold time is its GPU time.
    let uncounted = post(
        base,
        "/v1/chat/completions",
        "prompt_eval_count=50,eval_count=50",
        openai(true, false),
    )
    .await;
    let events = uncounted.text().matches("\n\n").count() as u64;
    assert!(events > 3, "{}", uncounted.text());
    let sent = serde_json::to_vec(&openai(true, false)).unwrap().len() as u64;
    (events, sent.div_ceil(4))
}

/// The value of the sample `series` (name and labels, as `/metrics` prints them).
pub fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.parse().ok())
}

pub async fn metrics(base: &str) -> String {
    HttpClient::new()
        .get(
            &format!("{base}/metrics"),
            &[("authorization", &format!("Bearer {CHAT_KEY}"))],
        )
        .await
        .text()
}

#[tokio::test]
async fn usage_metrics_add_up_to_what_the_fake_reported() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(&fake.url(), &dir.path().display().to_string(), "")).await;
    let base = stack.url();
    let (events, estimated) = send_mix(&base).await;
    let text = metrics(&base).await;
    let gpu = |model: &str| {
        sample(
            &text,
            &format!("oqp_client_gpu_seconds_total{{client=\"chat\",model=\"{model}\"}}"),
        )
    };
    let tokens = |model: &str, kind: &str| {
        sample(
            &text,
            &format!(
                "oqp_client_tokens_total{{client=\"chat\",kind=\"{kind}\",model=\"{model}\"}}"
            ),
        )
    };
    assert_eq!(gpu("llama3"), Some(4.0), "{text}");
    assert_eq!(tokens("llama3", "prompt"), Some(20.0));
    assert_eq!(tokens("llama3", "completion"), Some(35.0));
    // The cache hit added nothing: 0.125 s + 0.25 s, 6 + 4 prompt tokens.
    assert_eq!(gpu("nomic-embed-text"), Some(0.375));
    assert_eq!(tokens("nomic-embed-text", "prompt"), Some(10.0));
    assert_eq!(tokens("nomic-embed-text", "completion"), Some(0.0));
    // OpenAI: the non-streamed usage, the last chunk's, the events and the body's estimate of
    // the stream without usage; held-slot time as GPU time.
    assert_eq!(tokens("qwen", "prompt"), Some(10.0 + estimated as f64));
    assert_eq!(tokens("qwen", "completion"), Some(12.0 + events as f64));
    assert!(gpu("qwen").is_some_and(|seconds| seconds > 0.0 && seconds < 30.0));
    for family in ["oqp_client_gpu_seconds_total", "oqp_client_tokens_total"] {
        assert!(
            text.contains(&format!("# TYPE {family} counter")),
            "{family}"
        );
    }

    // /queue/status: the client's usage today.
    let status = HttpClient::new()
        .get(
            &format!("{base}/queue/status"),
            &[("authorization", &format!("Bearer {CHAT_KEY}"))],
        )
        .await
        .json();
    let today = &status["clients"]["chat"]["usage_today"];
    assert_eq!(today["prompt_tokens"], 40 + estimated, "{today}");
    assert_eq!(today["completion_tokens"], 47 + events);
    assert_eq!(today["cached_inputs"], 2);
    assert_eq!(today["requests"], 10);
    let seconds = today["gpu_seconds"].as_f64().unwrap();
    assert!((4.375..34.375).contains(&seconds), "{seconds}");
    stack.shutdown().await;
}

pub const ADMIN_KEY: &str = "sk-admin-0123456789";

/// The control plane's usage totals of the last `since` seconds, grouped.
pub async fn usage_of(
    control_url: &str,
    since_seconds: u64,
    by_client: bool,
    by_model: bool,
) -> api::GetUsageResponse {
    let mut admin = AdminServiceClient::connect(control_url.to_owned())
        .await
        .unwrap();
    let mut request = tonic::Request::new(api::GetUsageRequest {
        since_seconds,
        by_client,
        by_model,
    });
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {ADMIN_KEY}").parse().unwrap(),
    );
    admin.get_usage(request).await.unwrap().into_inner()
}

/// Waits (bounded) until the control plane's total counts `requests` requests.
pub async fn wait_for_requests(control_url: &str, requests: u64) -> api::GetUsageResponse {
    let usage = wait_until(Duration::from_secs(10), || async {
        let usage = usage_of(control_url, 0, true, true).await;
        let total = usage.total.clone().unwrap_or_default();
        if total.requests >= requests {
            Ok(usage)
        } else {
            Err(usage)
        }
    })
    .await
    .unwrap_or_else(|usage| usage);
    let total = usage.total.clone().unwrap_or_default();
    assert_eq!(total.requests, requests, "{usage:?}");
    usage
}

fn row<'a>(usage: &'a api::GetUsageResponse, client: &str, model: &str) -> &'a api::UsageTotals {
    usage
        .rows
        .iter()
        .find(|row| row.client_id == client && row.model == model)
        .unwrap_or_else(|| panic!("no row {client}/{model} in {usage:?}"))
}

const SECOND: u64 = 1_000_000_000;

#[tokio::test]
async fn totals_reach_the_control_plane_and_survive_restarts_of_either_plane() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let config_path = dir.path().join("config.yml");
    std::fs::write(
        &config_path,
        config(&fake.url(), &state.display().to_string(), ""),
    )
    .unwrap();
    let mut control = harness::start_control_plane(&config_path, harness::loopback().await)
        .await
        .unwrap();
    let control_addr = control.local_addr();
    let control_url = format!("http://{control_addr}");
    let mut edge = harness::start_dataplane(&control_url, "edge", Some(control.node_token()))
        .await
        .unwrap();
    let base = format!("http://{}", edge.local_addr());
    let (events, estimated) = send_mix(&base).await;
    let usage = wait_for_requests(&control_url, 10).await;
    let llama = row(&usage, "chat", "llama3");
    assert_eq!(llama.gpu_ns, 4 * SECOND);
    assert_eq!((llama.prompt_tokens, llama.completion_tokens), (20, 35));
    assert_eq!(llama.requests, 4);
    let embed = row(&usage, "chat", "nomic-embed-text");
    assert_eq!(embed.gpu_ns, 375_000_000);
    assert_eq!(embed.prompt_tokens, 10);
    assert_eq!(embed.embedding_inputs, 5, "2 + 3 inputs sent upstream");
    assert_eq!(embed.cached_inputs, 2, "the hit");
    assert_eq!(embed.requests, 3);
    let qwen = row(&usage, "chat", "qwen");
    assert_eq!(
        (qwen.prompt_tokens, qwen.completion_tokens),
        (10 + estimated, 12 + events)
    );
    assert!(qwen.gpu_ns > 0);
    // Today's batches, appended to the day's log (the day file is written whole only when
    // the log is compacted into it).
    let day_file = state.join("usage").join(format!(
        "{}.0.jsonl",
        humantime::format_rfc3339_seconds(SystemTime::now())
            .to_string()
            .get(..10)
            .unwrap()
    ));
    let mode = std::fs::metadata(&day_file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{}", day_file.display());

    let generate = json!({"model": "llama3", "prompt": "hi", "stream": false});
    let one_second = "total_duration=1000000000,prompt_eval_count=1,eval_count=1";
    // The control plane away: the data plane serves on and keeps what it recorded.
    control.shutdown().await;
    post(&base, "/api/generate", one_second, generate.clone()).await;
    control = harness::start_control_plane(
        &config_path,
        tokio::net::TcpListener::bind(control_addr).await.unwrap(),
    )
    .await
    .unwrap();
    let usage = wait_for_requests(&control_url, 11).await;
    assert_eq!(
        row(&usage, "chat", "llama3").gpu_ns,
        5 * SECOND,
        "loaded and added to"
    );

    // A data plane restart: a new ledger (a new epoch), the totals kept.
    edge.shutdown().await;
    edge = harness::start_dataplane(&control_url, "edge", Some(control.node_token()))
        .await
        .unwrap();
    let base = format!("http://{}", edge.local_addr());
    post(&base, "/api/generate", one_second, generate).await;
    let usage = wait_for_requests(&control_url, 12).await;
    let llama = row(&usage, "chat", "llama3");
    assert_eq!(llama.gpu_ns, 6 * SECOND);
    assert_eq!(llama.requests, 6);
    // Grouped by client only: one row, the sum.
    let by_client = usage_of(&control_url, 0, true, false).await;
    assert_eq!(by_client.rows.len(), 1);
    assert_eq!(by_client.rows[0].model, "");
    assert_eq!(by_client.rows[0].requests, 12);
    edge.shutdown().await;
    control.shutdown().await;
}

const BATCH_KEY: &str = "sk-batch-0123456789";

/// Seconds from `at` to the next midnight UTC.
fn to_midnight(at: SystemTime) -> u64 {
    let now = at.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    86_400 - now % 86_400
}

async fn send_as(base: &str, key: &str, reported: &str) -> Reply {
    let auth = format!("Bearer {key}");
    HttpClient::new()
        .post_json(
            &format!("{base}/api/generate"),
            &[("authorization", &auth), (USAGE_HEADER, reported)],
            &json!({"model": "llama3", "prompt": "hi", "stream": false}),
        )
        .await
}

#[tokio::test]
async fn a_spent_budget_refuses_before_queueing_and_is_announced_once() {
    let mut sink = crate::hosts::Sink::start().await;
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let extra = format!(
        "    - key: \"{BATCH_KEY}\"\n      client_id: batch\n      budget: {{gpu_seconds: 10, window: 1d}}\n{}",
        sink.config(&["client.budget_exceeded"])
    );
    let stack = Stack::start(&config(
        &fake.url(),
        &dir.path().display().to_string(),
        &extra,
    ))
    .await;
    let base = stack.url();
    let six_seconds = "total_duration=6000000000,prompt_eval_count=1,eval_count=1";

    // Two requests admitted while 0 of 10 s were used: both finish (12 s in all).
    fake.handle().hold();
    let first = tokio::spawn({
        let base = base.clone();
        async move { send_as(&base, BATCH_KEY, six_seconds).await }
    });
    let second = tokio::spawn({
        let base = base.clone();
        async move { send_as(&base, BATCH_KEY, six_seconds).await }
    });
    assert!(
        oqp_tests::client::eventually(Duration::from_secs(10), || fake.handle().in_flight() == 2)
            .await
    );
    fake.handle().release_all();
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(second.await.unwrap().status, 200);

    // Spent: refused at once, before the queue, with the window's reset as Retry-After.
    let before = SystemTime::now();
    let refused = send_as(&base, BATCH_KEY, six_seconds).await;
    let after = SystemTime::now();
    assert_eq!(refused.status, 429, "{}", refused.text());
    let body = refused.json();
    assert_eq!(body["error"], "budget exceeded: gpu_seconds 10 per 1d");
    assert_eq!(
        body["request_id"],
        refused.header("x-request-id").unwrap().as_str()
    );
    let retry_after: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    assert!(
        (to_midnight(after)..=to_midnight(before)).contains(&retry_after),
        "Retry-After {retry_after}"
    );
    assert_eq!(
        fake.handle().requests_to("/api/generate").len(),
        2,
        "never sent upstream"
    );
    // Other clients are not concerned.
    assert_eq!(send_as(&base, CHAT_KEY, "").await.status, 200);

    let notice = sink.next().await;
    assert_eq!(notice["event"], "client.budget_exceeded");
    assert_eq!(notice["client_id"], "batch");
    assert_eq!(
        notice["budget"],
        json!({"gpu_seconds": 10.0, "window": "1d"})
    );
    assert_eq!(notice["used"], json!({"gpu_seconds": 12.0}));
    let midnight =
        humantime::format_rfc3339_seconds(after + Duration::from_secs(to_midnight(after)))
            .to_string();
    assert_eq!(notice["resets_at"], midnight.as_str());
    // Once per window: more refusals and reports, no second notice.
    assert_eq!(send_as(&base, BATCH_KEY, six_seconds).await.status, 429);
    assert_eq!(send_as(&base, CHAT_KEY, "").await.status, 200);
    wait_for_requests(&stack.control_url(), 4).await;
    assert_eq!(stack.control.hub().webhooks().stats().queued, 1);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_stored_key_takes_a_token_budget() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(&fake.url(), &dir.path().display().to_string(), "")).await;
    let mut admin = AdminServiceClient::connect(stack.control_url())
        .await
        .unwrap();
    let mut request = tonic::Request::new(api::AddKeyRequest {
        client_id: "nightly".to_owned(),
        max_priority: oqp_proto::policy::v1::Tier::Low as i32,
        budget: Some(api::KeyBudget {
            tokens: 5,
            window: "1h".to_owned(),
            ..api::KeyBudget::default()
        }),
        ..api::AddKeyRequest::default()
    });
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {ADMIN_KEY}").parse().unwrap(),
    );
    let added = admin.add_key(request).await.unwrap().into_inner();
    stack.wait_for_version(added.snapshot_version).await;
    let reported = "total_duration=1000000,prompt_eval_count=3,eval_count=3";
    assert_eq!(
        send_as(&stack.url(), &added.key, reported).await.status,
        200
    );
    let refused = send_as(&stack.url(), &added.key, reported).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.json()["error"], "budget exceeded: tokens 5 per 1h");
    let retry_after: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=3600).contains(&retry_after), "{retry_after}");
    // The budget is kept with the key, and listed with what is left.
    let mut request = tonic::Request::new(api::ListKeysRequest {});
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {ADMIN_KEY}").parse().unwrap(),
    );
    wait_for_requests(&stack.control_url(), 1).await;
    let keys = admin.list_keys(request).await.unwrap().into_inner();
    let nightly = keys
        .keys
        .iter()
        .find(|key| key.client_id == "nightly")
        .unwrap();
    let budget = nightly.budget.as_ref().unwrap();
    assert_eq!(
        (budget.tokens, budget.used_tokens, budget.window.as_str()),
        (5, 6, "1h")
    );
    stack.shutdown().await;
}

/// How often the cluster's data planes report (`oqp-bench dataplane`).
const REPORT_INTERVAL: Duration = Duration::from_millis(200);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_data_planes_together_overshoot_a_budget_by_at_most_the_stated_bound() {
    let _exclusive = crate::support::exclusive().await;
    const TOKEN: &str = "node-token-0123456789";
    const BUDGET_SECONDS: u64 = 60;
    // Each request reports 1 s of GPU time and takes at least 50 ms: one client per data
    // plane sends at most 20 GPU-seconds a second through it.
    let latency = Duration::from_millis(50);
    let fake = fake().latency(latency).spawn().await;
    let state = tempfile::tempdir().unwrap();
    let yaml = format!(
        r#"proxy:
  host: "127.0.0.1"
  max_concurrent: 4
ollama:
  hosts:
    - url: "{url}"
      name: box1
      max_concurrent: 4
control_plane:
  node_token: "{TOKEN}"
  state_dir: "{state}"
auth:
  enabled: true
  keys:
    - key: "{ADMIN_KEY}"
      client_id: admin
      scope: management
    - key: "{BATCH_KEY}"
      client_id: batch
      budget: {{gpu_seconds: {BUDGET_SECONDS}, window: 1d}}
"#,
        url = fake.url(),
        state = state.path().display(),
    );
    let cluster = oqp_tests::cluster::Cluster::builder(env!("CARGO_BIN_EXE_oqp-bench"), &yaml)
        .node("a")
        .node("b")
        .node_token(TOKEN)
        .admin_key(ADMIN_KEY)
        .start()
        .await;
    // One client on each data plane, back to back, until its data plane refuses.
    let one_second = "total_duration=1000000000,prompt_eval_count=1,eval_count=1";
    let senders: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|node| {
            let base = cluster.url(node);
            tokio::spawn(async move {
                let mut admitted = 0u64;
                loop {
                    let reply = send_as(&base, BATCH_KEY, one_second).await;
                    match reply.status.as_u16() {
                        200 => admitted += 1,
                        429 => {
                            assert_eq!(
                                reply.json()["error"],
                                format!("budget exceeded: gpu_seconds {BUDGET_SECONDS} per 1d")
                            );
                            return admitted;
                        }
                        other => panic!("{other}: {}", reply.text()),
                    }
                }
            })
        })
        .collect();
    let mut admitted = Vec::new();
    for sender in senders {
        admitted.push(sender.await.unwrap());
    }
    let total: u64 = admitted.iter().sum();
    let usage = wait_for_requests(&cluster.control_url(), total).await;
    let used = usage.total.unwrap().gpu_ns / SECOND;
    assert_eq!(used, total, "1 s each");
    // The stated bound: the requests in flight when the budget ran out (one per data
    // plane here) plus what the other data plane ran in about two report intervals
    // (taken as six, for the scheduling jitter of debug processes on two loaded cores). Without
    // a shared budget each data plane would spend it whole: an overshoot of the budget itself,
    // well above this bound.
    let rate = 1.0 / latency.as_secs_f64();
    let bound = 2 + (rate * 6.0 * REPORT_INTERVAL.as_secs_f64()).ceil() as u64;
    assert!(bound < BUDGET_SECONDS / 2);
    println!(
        "budget {BUDGET_SECONDS} GPU-s over two data planes: admitted {admitted:?}, used {used} s, overshoot {} s (bound {bound} s)",
        used.saturating_sub(BUDGET_SECONDS)
    );
    assert!(
        used >= BUDGET_SECONDS,
        "the budget is there to be used: {used}"
    );
    assert!(
        used <= BUDGET_SECONDS + bound,
        "overshoot {} s above the bound {bound} s ({admitted:?})",
        used - BUDGET_SECONDS
    );
    assert!(
        admitted.iter().all(|n| *n > 0),
        "both data planes served: {admitted:?}"
    );
    cluster.shutdown().await;
}
