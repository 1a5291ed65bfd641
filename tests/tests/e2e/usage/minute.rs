//! End to end: per-minute limits (`rate_limit`) through the real planes. A key's request
//! limit refuses the request past it with 429 and a `Retry-After` no longer than the refill,
//! in each route's own error shape, before anything reaches a host; an app's users are
//! limited one by one; a token limit is charged the answer's own count, so that a long
//! answer holds the next request back; the refusals show in `/queue/status`, the metrics and
//! the control plane's client list (`oqpctl clients`).

use std::time::Duration;

use oqp_proto::admin::v1::{self as api, admin_service_client::AdminServiceClient};
use oqp_tests::client::{HttpClient, Reply};
use oqp_tests::fake::USAGE_HEADER;
use oqp_tests::harness::Stack;
use serde_json::{Value, json};

use super::{ADMIN_KEY, config, fake, metrics, sample};

const LIMITED: &str = "sk-limited-0123456789";
const WORDY: &str = "sk-wordy-0123456789";
const WEBUI: &str = "sk-webui-0123456789";

fn extra() -> String {
    format!(
        "    - key: \"{LIMITED}\"\n      client_id: limited\n      rate_limit: {{requests_per_minute: 2}}\n\
         \x20   - key: \"{WORDY}\"\n      client_id: wordy\n      rate_limit: {{tokens_per_minute: 1000}}\n\
         \x20   - key: \"{WEBUI}\"\n      client_id: webui\n      users:\n        header: X-User\n        \
         rate_limit: {{requests_per_minute: 1}}\n"
    )
}

async fn send(base: &str, key: &str, path: &str, headers: &[(&str, &str)], body: &Value) -> Reply {
    let auth = format!("Bearer {key}");
    let mut all = vec![("authorization", auth.as_str())];
    all.extend_from_slice(headers);
    HttpClient::new()
        .post_json(&format!("{base}{path}"), &all, body)
        .await
}

fn chat() -> Value {
    json!({"model": "llama3", "stream": false, "messages": [{"role": "user", "content": "hi"}]})
}

fn retry_after(reply: &Reply) -> u64 {
    reply
        .header("retry-after")
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no Retry-After: {:?}", reply.text()))
}

async fn status(base: &str) -> Value {
    HttpClient::new()
        .get(
            &format!("{base}/queue/status"),
            &[("authorization", &format!("Bearer {ADMIN_KEY}"))],
        )
        .await
        .json()
}

async fn clients(control_url: &str) -> Vec<api::ClientInfo> {
    let mut admin = AdminServiceClient::connect(control_url.to_owned())
        .await
        .unwrap();
    let mut request = tonic::Request::new(api::ListClientsRequest {});
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {ADMIN_KEY}").parse().unwrap(),
    );
    admin
        .list_clients(request)
        .await
        .unwrap()
        .into_inner()
        .clients
}

#[tokio::test]
async fn a_request_past_a_minute_limit_is_refused_in_its_routes_shape_and_shown() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(
        &fake.url(),
        &dir.path().display().to_string(),
        &extra(),
    ))
    .await;
    let base = stack.url();

    for _ in 0..2 {
        let reply = send(&base, LIMITED, "/api/chat", &[], &chat()).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let refused = send(&base, LIMITED, "/api/chat", &[], &chat()).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    // Two a minute: the next one is at most 30 s away.
    assert!(
        (1..=30).contains(&retry_after(&refused)),
        "{:?}",
        refused.header("retry-after")
    );
    assert_eq!(
        refused.json()["error"],
        "rate limit exceeded: 2 requests per minute"
    );
    let messages = json!({"model": "llama3", "max_tokens": 16,
                          "messages": [{"role": "user", "content": "hi"}]});
    let anthropic = send(&base, LIMITED, "/v1/messages", &[], &messages).await;
    assert_eq!(anthropic.status, 429);
    assert!((1..=30).contains(&retry_after(&anthropic)));
    assert_eq!(anthropic.json()["error"]["type"], "rate_limit_error");
    let responses = json!({"model": "llama3", "input": "hi"});
    let openai = send(&base, LIMITED, "/v1/responses", &[], &responses).await;
    assert_eq!(openai.status, 429);
    assert_eq!(openai.json()["error"]["code"], "rate_limit_exceeded");
    assert_eq!(openai.json()["error"]["type"], "rate_limit_error");
    // Nothing refused reached the host.
    assert_eq!(fake.handle().requests_to("/api/chat").len(), 2);
    assert!(fake.handle().requests_to("/v1/messages").is_empty());
    assert!(fake.handle().requests_to("/v1/responses").is_empty());

    // An app's users, one a minute each.
    let user = |name: &'static str| [("X-User", name)];
    assert_eq!(
        send(&base, WEBUI, "/api/chat", &user("ada"), &chat())
            .await
            .status,
        200
    );
    let again = send(&base, WEBUI, "/api/chat", &user("ada"), &chat()).await;
    assert_eq!(again.status, 429);
    assert!((1..=60).contains(&retry_after(&again)));
    assert_eq!(
        send(&base, WEBUI, "/api/chat", &user("bob"), &chat())
            .await
            .status,
        200
    );

    // /queue/status: the limit, what is left of it, the refusals.
    let status = status(&base).await;
    let limit = &status["clients"]["limited"]["rate_limit"];
    assert_eq!(limit["requests_per_minute"], 2, "{limit}");
    assert_eq!(limit["requests_left"], 0);
    assert_eq!(status["clients"]["limited"]["rate_limited"], 3);
    assert_eq!(status["clients"]["webui"]["rate_limited"], 1);
    assert!(status["clients"]["chat"].get("rate_limit").is_none());
    assert!(status["clients"]["chat"].get("rate_limited").is_none());
    // Metrics, under the configured client (an app's users under the app).
    let text = metrics(&base).await;
    assert_eq!(
        sample(&text, "oqp_rate_limited_total{client=\"limited\"}"),
        Some(3.0)
    );
    assert_eq!(
        sample(&text, "oqp_rate_limited_total{client=\"webui\"}"),
        Some(1.0)
    );
    // The control plane's client list (`oqpctl clients`): the limit, and the refusals once a
    // report has carried them.
    let control_url = stack.control_url();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let limited = loop {
        let listed = clients(&control_url).await;
        let limited = listed
            .into_iter()
            .find(|client| client.client_id == "limited")
            .unwrap();
        if limited.rate_limited == 3 || tokio::time::Instant::now() >= deadline {
            break limited;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(limited.rate_limited, 3);
    assert_eq!(limited.rate_limit.unwrap().requests_per_minute, 2);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_token_limit_is_charged_what_the_answer_used() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::start(&config(
        &fake.url(),
        &dir.path().display().to_string(),
        &extra(),
    ))
    .await;
    let base = stack.url();
    // A prompt of a few tokens, estimated so and admitted; the answer says 10,000 tokens.
    let reported = [(USAGE_HEADER, "prompt_eval_count=4000,eval_count=6000")];
    let first = send(&base, WORDY, "/api/chat", &reported, &chat()).await;
    assert_eq!(first.status, 200, "{}", first.text());
    // Once the answer is counted, the bucket is 9,000 tokens below empty.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let status = status(&base).await;
        let left = &status["clients"]["wordy"]["rate_limit"]["tokens_left"];
        let text = metrics(&base).await;
        let counted = sample(
            &text,
            "oqp_client_tokens_total{client=\"wordy\",kind=\"completion\",model=\"llama3\"}",
        );
        if (left == 0 && counted == Some(6000.0)) || tokio::time::Instant::now() >= deadline {
            assert_eq!(left, 0, "{status}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refused = send(&base, WORDY, "/api/chat", &[], &chat()).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(
        refused.json()["error"],
        "rate limit exceeded: 1000 tokens per minute"
    );
    // 9,000 tokens and more at 1,000 a minute: about nine minutes, which only the answer's
    // own count explains (an estimate is never more than a minute's worth).
    let wait = retry_after(&refused);
    assert!((500..=542).contains(&wait), "{wait}");
    assert_eq!(fake.handle().requests_to("/api/chat").len(), 1);
    stack.shutdown().await;
}
