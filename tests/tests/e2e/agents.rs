//! End to end: the agents' APIs. `/v1/messages` (Anthropic) and `/v1/responses` (OpenAI
//! Responses) are inference: the model comes from the body, so they are routed to the host
//! that has it (with the 404 retry), queued, accounted from the answers' own `usage`
//! (streamed and not) and budgeted; `x-api-key` identifies a key as Bearer does, and no
//! tenant credential reaches Ollama.

use oqp_tests::client::{HttpClient, Reply};
use oqp_tests::fake::{Failure, FakeOllama, USAGE_HEADER};
use oqp_tests::harness::Stack;
use serde_json::{Value, json};

use crate::usage::sample;

const AGENT_KEY: &str = "sk-agent-0123456789";
const SPENT_KEY: &str = "sk-spent-0123456789";

fn config(hosts: &str, state_dir: &str) -> String {
    format!(
        r#"control_plane:
  state_dir: "{state_dir}"
proxy:
  max_concurrent: 4
ollama:
  hosts:
{hosts}routing:
  strategy: model_aware
auth:
  enabled: true
  keys:
    - key: "{AGENT_KEY}"
      client_id: agent
    - key: "{SPENT_KEY}"
      client_id: spent
      budget: {{tokens: 1, window: 1d}}
    - key: "sk-admin-0123456789"
      client_id: admin
      scope: management
"#
    )
}

fn host(url: &str, name: &str) -> String {
    format!("    - url: \"{url}\"\n      name: {name}\n      max_concurrent: 4\n")
}

fn messages(model: &str, stream: bool) -> Value {
    json!({"model": model, "max_tokens": 64, "stream": stream,
           "messages": [{"role": "user", "content": "hello there"}]})
}

fn responses(model: &str, stream: bool) -> Value {
    json!({"model": model, "input": "hello there", "stream": stream})
}

async fn post(base: &str, path: &str, headers: &[(&str, &str)], body: &Value) -> Reply {
    HttpClient::new()
        .post_json(&format!("{base}{path}"), headers, body)
        .await
}

/// The SSE events of a stream, by name, in order.
fn events(reply: &Reply) -> Vec<(String, Value)> {
    reply
        .text()
        .split("\n\n")
        .filter_map(|event| {
            let name = event
                .lines()
                .find_map(|line| line.strip_prefix("event: "))?;
            let data = event.lines().find_map(|line| line.strip_prefix("data: "))?;
            Some((name.to_owned(), serde_json::from_str(data).ok()?))
        })
        .collect()
}

#[tokio::test]
async fn both_routes_go_to_the_host_with_the_model_and_are_accounted_from_their_usage() {
    let other = FakeOllama::builder().model("llama3").spawn().await;
    let agentic = FakeOllama::builder().model("qwen3-coder").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let hosts = [host(&other.url(), "other"), host(&agentic.url(), "agentic")].concat();
    let stack = Stack::start(&config(&hosts, &dir.path().display().to_string())).await;
    let base = stack.url();
    let bearer = format!("Bearer {AGENT_KEY}");
    let reported = (USAGE_HEADER, "prompt_eval_count=100,eval_count=10");

    // Anthropic's own header, not streamed.
    let reply = post(
        &base,
        "/v1/messages",
        &[("x-api-key", AGENT_KEY), reported],
        &messages("qwen3-coder", false),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-failover-host").as_deref(), Some("agentic"));
    assert!(reply.header("x-queue-wait-time").is_some());
    let body = reply.json();
    assert_eq!(body["type"], "message");
    assert_eq!(body["usage"]["input_tokens"], 100);

    // Bearer and x-api-key together, the same key; streamed.
    let reply = post(
        &base,
        "/v1/messages",
        &[
            ("authorization", &bearer),
            ("x-api-key", AGENT_KEY),
            reported,
        ],
        &messages("qwen3-coder", true),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let names: Vec<String> = events(&reply).into_iter().map(|(name, _)| name).collect();
    assert_eq!(names.first().map(String::as_str), Some("message_start"));
    assert_eq!(names.last().map(String::as_str), Some("message_stop"));
    assert!(names.iter().any(|name| name == "message_delta"));

    // The Responses API, not streamed and streamed.
    for stream in [false, true] {
        let reply = post(
            &base,
            "/v1/responses",
            &[("authorization", &bearer), reported],
            &responses("qwen3-coder", stream),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(reply.header("x-failover-host").as_deref(), Some("agentic"));
        if stream {
            let events = events(&reply);
            let (name, completed) = events.last().unwrap();
            assert_eq!(name, "response.completed");
            assert_eq!(completed["response"]["usage"]["output_tokens"], 10);
        } else {
            assert_eq!(reply.json()["usage"]["input_tokens"], 100);
        }
    }

    // Four answers of 100 prompt and 10 completion tokens each, all to `agent`.
    let text = HttpClient::new()
        .get(&format!("{base}/metrics"), &[("authorization", &bearer)])
        .await
        .text();
    for (kind, expected) in [("prompt", 400.0), ("completion", 40.0)] {
        let series = format!(
            "oqp_client_tokens_total{{client=\"agent\",kind=\"{kind}\",model=\"qwen3-coder\"}}"
        );
        assert_eq!(sample(&text, &series), Some(expected), "{series}\n{text}");
    }
    let gpu = "oqp_client_gpu_seconds_total{client=\"agent\",model=\"qwen3-coder\"}";
    assert!(
        sample(&text, gpu).is_some_and(|seconds| seconds > 0.0),
        "{text}"
    );

    // No tenant credential reached an upstream.
    let recorded = [
        agentic.handle().requests_to("/v1/messages"),
        agentic.handle().requests_to("/v1/responses"),
    ]
    .concat();
    assert_eq!(recorded.len(), 4);
    assert!(other.handle().requests_to("/v1/messages").is_empty());
    assert!(other.handle().requests_to("/v1/responses").is_empty());
    for request in &recorded {
        for name in ["authorization", "x-api-key", "cookie", "x-forwarded-for"] {
            assert!(request.headers.get(name).is_none(), "{name} reached Ollama");
        }
        assert_eq!(request.headers["x-client-id"], "agent");
    }
    stack.shutdown().await;
}

#[tokio::test]
async fn a_stale_inventory_is_retried_on_the_host_that_has_the_model() {
    let stale = FakeOllama::builder().model("qwen3-coder").spawn().await;
    let holder = FakeOllama::builder().model("qwen3-coder").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let hosts = [host(&stale.url(), "stale"), host(&holder.url(), "holder")].concat();
    let stack = Stack::start(&config(&hosts, &dir.path().display().to_string())).await;
    // The model leaves one host after the control plane's poll: that host answers 404.
    stale.handle().remove_model("qwen3-coder");
    for (path, body) in [
        ("/v1/messages", messages("qwen3-coder", false)),
        ("/v1/responses", responses("qwen3-coder", false)),
        ("/v1/messages", messages("qwen3-coder", true)),
    ] {
        for _ in 0..2 {
            let reply = post(&stack.url(), path, &[("x-api-key", AGENT_KEY)], &body).await;
            assert_eq!(reply.status, 200, "{path}: {}", reply.text());
            assert_eq!(reply.header("x-failover-host").as_deref(), Some("holder"));
        }
    }
    stack.shutdown().await;
}

#[tokio::test]
async fn a_host_that_fails_before_the_first_byte_is_failed_over() {
    for (path, body) in [
        ("/v1/messages", messages("qwen3-coder", true)),
        ("/v1/responses", responses("qwen3-coder", false)),
    ] {
        // The model is loaded on `first`, so it is tried first; installed on `second`.
        let first = FakeOllama::builder()
            .model("qwen3-coder")
            .loaded("qwen3-coder")
            .spawn()
            .await;
        let second = FakeOllama::builder().model("qwen3-coder").spawn().await;
        let dir = tempfile::tempdir().unwrap();
        let hosts = [host(&first.url(), "first"), host(&second.url(), "second")].concat();
        let stack = Stack::start(&config(&hosts, &dir.path().display().to_string())).await;
        first.handle().fail_next(Failure::Refuse);
        let reply = post(&stack.url(), path, &[("x-api-key", AGENT_KEY)], &body).await;
        assert_eq!(reply.status, 200, "{path}: {}", reply.text());
        assert_eq!(
            reply.header("x-failover-host").as_deref(),
            Some("second"),
            "{path}"
        );
        assert_eq!(second.handle().requests_to(path).len(), 1, "{path}");
        stack.shutdown().await;
    }
}

#[tokio::test]
async fn a_wrong_or_conflicting_key_reaches_nothing_and_a_spent_budget_is_refused() {
    let fake = FakeOllama::builder().model("qwen3-coder").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(
        &host(&fake.url(), "box"),
        &dir.path().display().to_string(),
    ))
    .await;
    let base = stack.url();
    let bearer = format!("Bearer {AGENT_KEY}");
    for (path, body) in [
        ("/v1/messages", messages("qwen3-coder", false)),
        ("/v1/responses", responses("qwen3-coder", true)),
    ] {
        let wrong = post(&base, path, &[("x-api-key", "sk-wrong-0123456789")], &body).await;
        assert_eq!(wrong.status, 401, "{path}");
        let error = wrong.json();
        if path == "/v1/messages" {
            assert_eq!(error["type"], "error");
            assert_eq!(error["error"]["type"], "authentication_error");
        } else {
            assert_eq!(error["error"]["type"], "authentication_error");
            assert_eq!(error["error"]["code"], "invalid_api_key");
        }
        let conflicting = post(
            &base,
            path,
            &[("authorization", &bearer), ("x-api-key", SPENT_KEY)],
            &body,
        )
        .await;
        assert_eq!(conflicting.status, 401, "{path}");
    }
    let inference = || {
        fake.handle().requests_to("/v1/messages").len()
            + fake.handle().requests_to("/v1/responses").len()
    };
    assert_eq!(inference(), 0);

    // A token budget of 1: the first answer spends it, then both routes refuse.
    let first = post(
        &base,
        "/v1/messages",
        &[("x-api-key", SPENT_KEY)],
        &messages("qwen3-coder", false),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.text());
    for (path, body) in [
        ("/v1/messages", messages("qwen3-coder", true)),
        ("/v1/responses", responses("qwen3-coder", false)),
    ] {
        let refused = post(&base, path, &[("x-api-key", SPENT_KEY)], &body).await;
        assert_eq!(refused.status, 429, "{path}: {}", refused.text());
        assert!(refused.header("retry-after").is_some());
        let error = refused.json();
        assert_eq!(error["error"]["type"], "rate_limit_error", "{path}");
        assert_eq!(
            error["error"]["message"],
            "budget exceeded: tokens 1 per 1d"
        );
        assert_eq!(
            error["request_id"],
            refused.header("x-request-id").unwrap().as_str()
        );
    }
    assert_eq!(inference(), 1);
    stack.shutdown().await;
}

#[tokio::test]
async fn both_streams_arrive_event_by_event_not_buffered() {
    let fake = FakeOllama::builder()
        .model("qwen3-coder")
        .tokens(5)
        .token_interval(std::time::Duration::from_millis(150))
        .spawn()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(
        &host(&fake.url(), "box"),
        &dir.path().display().to_string(),
    ))
    .await;
    let http = HttpClient::new();
    for (path, body) in [
        ("/v1/messages", messages("qwen3-coder", true)),
        ("/v1/responses", responses("qwen3-coder", true)),
    ] {
        // The same stream through oqp and straight from the fake: each event's arrival,
        // counted from the stream's first event, is compared between the two.
        let offsets = |lines: Vec<oqp_tests::client::TimedLine>| {
            let data: Vec<_> = lines
                .into_iter()
                .filter(|line| line.line.starts_with("data: "))
                .collect();
            let first = data[0].at;
            data.into_iter()
                .map(|line| line.at - first)
                .collect::<Vec<_>>()
        };
        let (status, headers, proxied) = http
            .post_lines(
                &format!("{}{path}", stack.url()),
                &[("x-api-key", AGENT_KEY)],
                &body,
            )
            .await;
        assert_eq!(status, 200, "{path}");
        assert_eq!(headers["content-type"], "text/event-stream");
        let (_, _, direct) = http
            .post_lines(&format!("{}{path}", fake.url()), &[], &body)
            .await;
        let (proxied, direct) = (offsets(proxied), offsets(direct));
        assert_eq!(proxied.len(), direct.len(), "{path}");
        // The fake spaces its deltas 150 ms apart: a buffering proxy would deliver the
        // events together.
        let spread = *proxied.last().unwrap();
        assert!(
            spread >= std::time::Duration::from_millis(500),
            "{path}: events arrived within {spread:?}"
        );
        let lags: Vec<f64> = proxied
            .iter()
            .zip(&direct)
            .map(|(through, straight)| (through.as_secs_f64() - straight.as_secs_f64()) * 1e3)
            .collect();
        let worst = lags.iter().fold(0.0_f64, |worst, lag| worst.max(lag.abs()));
        eprintln!(
            "{path}: {} events, per-event lag against direct (ms): {lags:.2?}, worst {worst:.2}",
            lags.len()
        );
    }
    stack.shutdown().await;
}

#[tokio::test]
async fn wrong_x_api_keys_count_for_the_failed_auth_throttle() {
    let fake = FakeOllama::builder().model("qwen3-coder").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let config = config(&host(&fake.url(), "box"), &dir.path().display().to_string()).replace(
        "auth:\n  enabled: true\n",
        "auth:\n  enabled: true\n  rate_limit:\n    max_failures: 2\n    window_seconds: 60\n",
    );
    let stack = Stack::start(&config).await;
    let body = messages("qwen3-coder", false);
    let wrong = [("x-api-key", "sk-guess-0123456789")];
    for _ in 0..2 {
        assert_eq!(
            post(&stack.url(), "/v1/messages", &wrong, &body)
                .await
                .status,
            401
        );
    }
    // Throttled now, even with the right key from the same address.
    let throttled = post(
        &stack.url(),
        "/v1/messages",
        &[("x-api-key", AGENT_KEY)],
        &body,
    )
    .await;
    assert_eq!(throttled.status, 429, "{}", throttled.text());
    assert!(throttled.header("retry-after").is_some());
    assert_eq!(throttled.json()["error"]["type"], "rate_limit_error");
    assert!(fake.handle().requests_to("/v1/messages").is_empty());
    stack.shutdown().await;
}
