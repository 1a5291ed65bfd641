//! End to end: `POST /v1/audio/transcriptions` is inference like the other routes. Its
//! `multipart/form-data` body is read (within `max_request_body_mb`) for its one `model`
//! field, which the key's allowlist and budget are checked against before anything is
//! queued, and the slot time it takes is charged; a form with another reading is refused.

use oqp_tests::client::{HttpClient, Reply};
use oqp_tests::fake::USAGE_HEADER;
use oqp_tests::harness::Stack;
use serde_json::json;

use super::{CHAT_KEY, config, fake, row, wait_for_requests};

const LIMITED_KEY: &str = "sk-limited-0123456789";
const SPENT_KEY: &str = "sk-spent-01234567890";
const BOUNDARY: &str = "oqp-test-boundary";

/// A form with the fields `fields` (name, value) and a small audio file.
fn form(fields: &[(&str, &str)]) -> String {
    let mut body = String::new();
    for (name, value) in fields {
        body.push_str(&format!(
            "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
        ));
    }
    body.push_str(&format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\
         Content-Type: audio/wav\r\n\r\nRIFF\r\n--{BOUNDARY}--\r\n"
    ));
    body
}

async fn transcribe(base: &str, query: &str, key: &str, body: String) -> Reply {
    let auth = format!("Bearer {key}");
    let content_type = format!("multipart/form-data; boundary={BOUNDARY}");
    HttpClient::new()
        .send(
            "POST".parse().unwrap(),
            &format!("{base}/v1/audio/transcriptions{query}"),
            &[
                ("authorization", auth.as_str()),
                ("content-type", content_type.as_str()),
            ],
            body,
        )
        .await
}

#[tokio::test]
async fn a_transcription_is_checked_against_the_model_in_its_form_and_charged() {
    let fake = fake().model("whisper").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let keys = format!(
        "    - key: \"{LIMITED_KEY}\"\n      client_id: limited\n      models: [\"whisper*\"]\n    \
         - key: \"{SPENT_KEY}\"\n      client_id: spent\n      budget: {{gpu_seconds: 10, window: 1d}}\n"
    );
    // Appended under `auth.keys`, after the chat and admin keys.
    let yaml = config(&fake.url(), &dir.path().display().to_string(), &keys);
    let stack = Stack::start(&yaml).await;
    let base = stack.url();
    let received = || fake.handle().requests_to("/v1/audio/transcriptions").len();

    // The allowlist is checked against the form's model.
    let allowed = transcribe(&base, "", LIMITED_KEY, form(&[("model", "whisper")])).await;
    assert_eq!(allowed.status, 200, "{}", allowed.text());
    assert_eq!(allowed.json()["text"], "hello");
    let forbidden = transcribe(&base, "", LIMITED_KEY, form(&[("model", "llama3")])).await;
    assert_eq!(forbidden.status, 403, "{}", forbidden.text());
    let error = forbidden.json()["error"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(error.contains("llama3"), "{error}");
    // A form Ollama could read another model from is refused, whoever sends it.
    for (query, body) in [
        ("", form(&[("model", "whisper"), ("model", "llama3")])),
        ("?model=llama3", form(&[("language", "en")])),
        ("", form(&[("language", "en")])),
        ("", form(&[("model", "whisper")]).replace("\r\n", "\n")),
    ] {
        for key in [LIMITED_KEY, CHAT_KEY] {
            let refused = transcribe(&base, query, key, body.clone()).await;
            assert_eq!(refused.status, 400, "{query} {body:?}: {}", refused.text());
        }
    }
    assert_eq!(received(), 1, "only the allowed one reached Ollama");

    // A spent budget refuses a transcription before it is queued.
    let spent = HttpClient::new()
        .post_json(
            &format!("{base}/api/generate"),
            &[
                ("authorization", &format!("Bearer {SPENT_KEY}")),
                (USAGE_HEADER, "total_duration=20000000000"),
            ],
            &json!({"model": "llama3", "prompt": "hi", "stream": false}),
        )
        .await;
    assert_eq!(spent.status, 200, "{}", spent.text());
    let refused = transcribe(&base, "", SPENT_KEY, form(&[("model", "whisper")])).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(received(), 1);

    // The one that ran is in the usage: a request and its slot time, under its model.
    let usage = wait_for_requests(&stack.control_url(), 2).await;
    let transcribed = row(&usage, "limited", "whisper");
    assert_eq!(transcribed.requests, 1, "{usage:?}");
    assert!(transcribed.gpu_ns > 0, "{usage:?}");
    stack.shutdown().await;
}
