//! End to end: the request log (`logging.requests`). Answered requests and refusals each
//! leave one JSON line in the day's file (0600) with what the request was and what it used;
//! the request is answered whatever the log does.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use oqp_tests::client::{HttpClient, eventually};
use oqp_tests::fake::USAGE_HEADER;
use oqp_tests::harness::Stack;
use serde_json::{Value, json};

use super::{config, fake};

const WEBUI: &str = "sk-webui-0123456789";
const LIMITED: &str = "sk-limited-0123456789";

fn lines(dir: &std::path::Path) -> Vec<Value> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut lines = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("requests.") && name.ends_with(".jsonl") {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            lines.extend(
                text.lines()
                    .filter_map(|line| serde_json::from_str(line).ok()),
            );
        }
    }
    lines
}

#[tokio::test]
async fn each_request_leaves_one_line_with_what_it_was_and_used() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    std::fs::create_dir(&logs).unwrap();
    let extra = format!(
        "    - key: \"{WEBUI}\"\n      client_id: webui\n      users: {{header: X-User}}\n\
         \x20   - key: \"{LIMITED}\"\n      client_id: limited\n      rate_limit: {{requests_per_minute: 1}}\n\
         logging:\n  requests: {{file: \"{}\", retention_days: 3}}\n",
        logs.join("requests.jsonl").display()
    );
    let stack = Stack::start(&config(
        &fake.url(),
        &dir.path().display().to_string(),
        &extra,
    ))
    .await;
    let base = stack.url();
    let chat = json!({"model": "llama3", "stream": false,
                      "messages": [{"role": "user", "content": "hi"}]});
    let answered = HttpClient::new()
        .post_json(
            &format!("{base}/api/chat"),
            &[
                ("authorization", &format!("Bearer {WEBUI}")),
                ("X-User", "ada"),
                (USAGE_HEADER, "prompt_eval_count=12,eval_count=34"),
            ],
            &chat,
        )
        .await;
    assert_eq!(answered.status, 200, "{}", answered.text());
    let limited = |key: &'static str| {
        let base = base.clone();
        async move {
            HttpClient::new()
                .post_json(
                    &format!("{base}/api/chat"),
                    &[("authorization", &format!("Bearer {key}"))],
                    &json!({"model": "llama3", "stream": false,
                        "messages": [{"role": "user", "content": "hi"}]}),
                )
                .await
        }
    };
    assert_eq!(limited(LIMITED).await.status, 200);
    let refused = limited(LIMITED).await;
    assert_eq!(refused.status, 429);

    assert!(
        eventually(Duration::from_secs(10), || lines(&logs).len() >= 3).await,
        "{:?}",
        lines(&logs)
    );
    let all = lines(&logs);
    assert_eq!(all.len(), 3, "{all:?}");
    let ada = all.iter().find(|line| line["user"] == "ada").unwrap();
    assert_eq!(ada["client"], "webui/ada");
    assert_eq!(ada["route"], "/api/chat");
    assert_eq!(ada["model"], "llama3");
    assert_eq!(ada["host"], "primary");
    assert_eq!(ada["status"], 200);
    assert_eq!(ada["tier"], "normal");
    assert_eq!(ada["prompt_tokens"], 12);
    assert_eq!(ada["completion_tokens"], 34);
    assert_eq!(
        ada["request_id"].as_str(),
        answered.header("x-request-id").as_deref()
    );
    for field in ["time", "queue_wait_ms", "ttfb_ms", "duration_ms"] {
        assert!(!ada[field].is_null(), "{field}: {ada}");
    }
    let refusal = all.iter().find(|line| line["status"] == 429).unwrap();
    assert_eq!(refusal["client"], "limited");
    assert_eq!(
        refusal["error"],
        "rate limit exceeded: 1 requests per minute"
    );
    assert!(refusal.get("host").is_none());
    assert_eq!(
        refusal["request_id"].as_str(),
        refused.header("x-request-id").as_deref()
    );
    for entry in std::fs::read_dir(&logs).unwrap().flatten() {
        let mode = entry.metadata().unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{:?}", entry.file_name());
    }
    stack.shutdown().await;
}

#[tokio::test]
async fn a_log_that_cannot_be_written_loses_lines_not_requests() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    // The log's directory is a file: nothing can be created in it.
    let blocker = dir.path().join("not-a-directory");
    std::fs::write(&blocker, "").unwrap();
    let extra = format!(
        "logging:\n  requests: {{file: \"{}\"}}\n",
        blocker.join("requests.jsonl").display()
    );
    let stack = Stack::start(&config(
        &fake.url(),
        &dir.path().display().to_string(),
        &extra,
    ))
    .await;
    let base = stack.url();
    for _ in 0..3 {
        super::post(
            &base,
            "/api/chat",
            "",
            json!({"model": "llama3", "stream": false,
            "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    }
    let app = stack.control.dataplane().unwrap().app();
    assert!(
        eventually(Duration::from_secs(10), || app
            .metrics
            .request_log_counts()
            .1
            == 3)
        .await,
        "{:?}",
        app.metrics.request_log_counts()
    );
    let text = super::metrics(&base).await;
    assert_eq!(
        super::sample(&text, "oqp_request_log_failures_total"),
        Some(3.0),
        "{text}"
    );
    stack.shutdown().await;
}

const NOTES: &str = "sk-notes-0123456789";
const WHOLE: &str = "sk-whole-0123456789";

#[tokio::test]
async fn a_capturing_key_has_its_bodies_in_its_lines_cut_at_the_limit_and_no_secret() {
    let fake = fake().spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    std::fs::create_dir(&logs).unwrap();
    let extra = format!(
        "    - key: \"{NOTES}\"\n      client_id: notes\n      users: {{header: X-User}}\n\
         \x20     capture: {{max_bytes: 64}}\n\
         \x20   - key: \"{WHOLE}\"\n      client_id: whole\n      capture: {{max_bytes: 65536}}\n\
         \x20     rate_limit: {{requests_per_minute: 1}}\n\
         logging:\n  requests: {{file: \"{}\"}}\n",
        logs.join("requests.jsonl").display()
    );
    let stack = Stack::start(&config(
        &fake.url(),
        &dir.path().display().to_string(),
        &extra,
    ))
    .await;
    let base = stack.url();
    let chat = |stream: bool| {
        json!({"model": "llama3", "stream": stream,
               "messages": [{"role": "user", "content": "a prompt long enough to pass the limit"}]})
    };
    let post = |key: &'static str, body: Value| {
        let base = base.clone();
        async move {
            HttpClient::new()
                .post_json(
                    &format!("{base}/api/chat"),
                    &[
                        ("authorization", &format!("Bearer {key}")),
                        ("X-User", "ada"),
                    ],
                    &body,
                )
                .await
        }
    };
    // A user of an app key that captures: its streamed answer is tapped, not held.
    let streamed = post(NOTES, chat(true)).await;
    assert_eq!(streamed.status, 200, "{}", streamed.text());
    assert!(streamed.body.len() > 64, "{}", streamed.text());
    // Captured whole (under the limit).
    let whole = post(WHOLE, chat(false)).await;
    assert_eq!(whole.status, 200, "{}", whole.text());
    // Refused by its per-minute limit: the request's body, no answer.
    let refused = post(WHOLE, chat(false)).await;
    assert_eq!(refused.status, 429);
    // A key without capture.
    super::post(&base, "/api/chat", "", chat(false)).await;

    assert!(
        eventually(Duration::from_secs(10), || lines(&logs).len() >= 4).await,
        "{:?}",
        lines(&logs)
    );
    let all = lines(&logs);
    assert_eq!(all.len(), 4, "{all:?}");
    let sent = fake.handle().requests_to("/api/chat");
    // What the host received for a request, found by its request id.
    let sent_for = |request_id: Option<String>| {
        let id = request_id.unwrap();
        let request = sent.iter().find(|request| {
            request
                .headers
                .get("x-request-id")
                .is_some_and(|value| value.as_bytes() == id.as_bytes())
        });
        String::from_utf8_lossy(&request.unwrap().body).into_owned()
    };
    let line_of = |request_id: Option<String>| {
        let id = request_id.unwrap();
        all.iter()
            .find(|line| line["request_id"] == id.as_str())
            .unwrap()
            .clone()
    };

    let ada = line_of(streamed.header("x-request-id"));
    assert_eq!(ada["client"], "notes/ada");
    let capture = &ada["capture"];
    let prompt = capture["prompt"].as_str().unwrap();
    assert_eq!(prompt.len(), 64, "{ada}");
    assert!(
        sent_for(streamed.header("x-request-id")).starts_with(prompt),
        "{ada}"
    );
    assert_eq!(capture["prompt_truncated"], true);
    let answer = capture["answer"].as_str().unwrap();
    assert_eq!(answer.len(), 64, "{ada}");
    assert!(streamed.text().starts_with(answer), "{ada}");
    assert_eq!(capture["answer_truncated"], true);

    let whole_line = line_of(whole.header("x-request-id"));
    let capture = &whole_line["capture"];
    assert_eq!(
        capture["prompt"].as_str().unwrap(),
        sent_for(whole.header("x-request-id"))
    );
    assert_eq!(capture["answer"].as_str().unwrap(), whole.text());
    assert!(capture.get("prompt_truncated").is_none(), "{whole_line}");
    assert!(capture.get("answer_truncated").is_none(), "{whole_line}");

    let refused_line = line_of(refused.header("x-request-id"));
    assert_eq!(refused_line["status"], 429);
    let capture = &refused_line["capture"];
    assert!(capture["prompt"].as_str().unwrap().contains("\"model\""));
    assert!(capture.get("answer").is_none(), "{refused_line}");

    let plain = all.iter().find(|line| line["client"] == "chat").unwrap();
    assert!(plain.get("capture").is_none(), "{plain}");

    // Only bodies: no key, no header.
    for entry in std::fs::read_dir(&logs).unwrap().flatten() {
        let text = std::fs::read_to_string(entry.path()).unwrap();
        for secret in [
            NOTES,
            WHOLE,
            super::CHAT_KEY,
            "Bearer",
            "X-User",
            "authorization",
        ] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
    }
    stack.shutdown().await;
}
