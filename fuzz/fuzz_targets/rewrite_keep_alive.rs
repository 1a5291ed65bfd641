//! The keep_alive splice (`oqp_dataplane::rewrite::insert_keep_alive`) on
//! arbitrary bodies, read by `BodyView`, with the `/v1/embeddings` translation
//! on the same bytes. Properties: nothing panics; a rewritten body is JSON; its
//! keep_alive is the default wherever Ollama would read one; every other
//! top-level member is unchanged.
//!
//! Input: the first byte picks the default literal and the override flag;
//! the rest is the body.

#![no_main]

use libfuzzer_sys::fuzz_target;
use oqp_dataplane::policy::KeepAlive;
use oqp_dataplane::rewrite::{insert_keep_alive, openai_embed_request};
use oqp_dataplane::view::BodyView;
use serde::de::IgnoredAny;
use serde_json::{Map, Value};

const DEFAULTS: [&str; 6] = ["\"5m\"", "-1", "0", "\"0\"", "300", "\"1h30m\""];

fn is_keep_alive(key: &str) -> bool {
    key.to_lowercase() == "keep_alive"
}

fn without_keep_alive(object: &Map<String, Value>) -> Map<String, Value> {
    object
        .iter()
        .filter(|(key, _)| !is_keep_alive(key))
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let _ = openai_embed_request(body);
    let Ok(view) = BodyView::read(body) else {
        return;
    };
    let default = DEFAULTS[usize::from(selector & 0x7f) % DEFAULTS.len()];
    let keep_alive = KeepAlive {
        default_json: Some(default.into()),
        override_client: selector & 0x80 != 0,
        max: std::time::Duration::from_secs(1800),
        bounded: selector & 0x40 != 0,
    };
    let Some(out) = insert_keep_alive(body, &view, &keep_alive) else {
        return;
    };
    // Ollama's Go decoder reads invalid UTF-8 in strings as U+FFFD, and so
    // may the rewriter: compare the bodies as Go would see them.
    let (before, after) = (String::from_utf8_lossy(body), String::from_utf8_lossy(&out));
    serde_json::from_str::<IgnoredAny>(&after).expect("a rewritten body is JSON");
    let (before, after) = (
        serde_json::from_str::<Value>(&before),
        serde_json::from_str::<Value>(&after),
    );
    let (Ok(before), Ok(after)) = (before, after) else {
        // A number beyond f64 (1e400) somewhere: valid JSON, not a `Value`.
        return;
    };
    let (Value::Object(before), Value::Object(after)) = (before, after) else {
        panic!("only objects are rewritten, into objects");
    };
    let expected: Value = serde_json::from_str(default).expect("defaults are JSON");
    for (key, value) in &after {
        if key.eq_ignore_ascii_case("keep_alive") {
            // A bounded caller's longer duration is cut to `max` instead.
            let cut = keep_alive.bounded && value == &Value::from(1800);
            assert!(value == &expected || cut, "{key} after the rewrite");
        }
    }
    assert!(
        after.keys().any(|key| is_keep_alive(key)),
        "a rewritten body has a keep_alive"
    );
    assert_eq!(
        without_keep_alive(&before),
        without_keep_alive(&after),
        "other members unchanged"
    );
});
