//! One poll of an OpenAI-style engine (`kind: openai`): llama.cpp's
//! llama-server, llama-swap, vLLM, SGLang, LM Studio… and the detection of a
//! host's kind (`kind: auto`).
//!
//! At the same time, each within `routing.model_poll_timeout`:
//! - `GET /health`: 200 is ready; 503 is loading (llama-server answers 503
//!   "Loading model" on every route until its model is in memory), which
//!   makes the host down; any other answer leaves health to `/v1/models`.
//! - `GET /v1/models`: the inventory, from `data[].id` and `data[].aliases`.
//!   An error body, a body without a `data` array (another API's shape) or
//!   an empty list is a failure with its reason: such a host is down, never
//!   routed to blind.
//! - `GET /props` (llama-server only): `total_slots` and the per-slot
//!   `n_ctx`, so a host's slots are learned, not configured; checked against
//!   `GET /slots` when that is enabled. A count out of range, or one that
//!   `/slots` contradicts, is not used (the configured slots stay) and is
//!   reported as the engine's `problem`.
//! - `GET /running` (llama-swap): the models it has started, else every
//!   listed model counts as loaded (a llama-server holds its one model).

use bytes::Bytes;
use http::header::{ACCEPT, USER_AGENT};
use http::{Request, StatusCode};
use http_body_util::Full;
use serde_json::Value;

use super::Target;
use crate::inventory::Listed;
pub use crate::inventory::{Detected, Learned};
use crate::outbound::{Outbound, Reply};

/// The largest body read from an engine's discovery routes.
const BODY_LIMIT: usize = 8 * 1024 * 1024;

/// The most slots a `/props` may report before it is disbelieved.
pub const MAX_SLOTS: u64 = 4096;

/// One poll of an OpenAI-style engine: its models (or why it is down), the
/// models it has loaded, and what it said about itself.
pub struct EnginePoll {
    /// Models it serves, or why it is down.
    pub models: Result<Vec<Listed>, String>,
    /// Models it holds loaded.
    pub loaded: Option<Vec<Listed>>,
    /// Kind, slots, context, problems.
    pub learned: Learned,
}

/// Polls an OpenAI-style engine once.
pub async fn probe(client: &Outbound, target: &Target) -> EnginePoll {
    let (health, models, props, slots, running) = tokio::join!(
        get(client, target, "/health"),
        get(client, target, "/v1/models"),
        get(client, target, "/props"),
        get(client, target, "/slots"),
        get(client, target, "/running"),
    );
    let mut learned = Learned::default();
    let props = props.ok().filter(|reply| reply.status == StatusCode::OK);
    let slot_list = slots
        .ok()
        .filter(|reply| reply.status == StatusCode::OK)
        .and_then(|reply| slot_count(&reply.body));
    if let Some(props) = props.as_ref().and_then(|reply| parse_props(&reply.body)) {
        learned.detected = Some(Detected::LlamaServer);
        learned.slot_context = props.slot_context;
        match believed_slots(props.total_slots, slot_list) {
            Ok(slots) => learned.slots = Some(slots),
            Err(problem) => learned.problem = Some(problem),
        }
    }
    let health = match health {
        Ok(reply) if reply.status == StatusCode::SERVICE_UNAVAILABLE => Err(format!(
            "/health: answered 503 ({})",
            error_message(&reply.body)
        )),
        _ => Ok(()),
    };
    let models = match models {
        Ok(reply) if reply.status.is_success() => {
            parse_openai_models(&reply.body).map_err(|e| format!("/v1/models: {e}"))
        }
        Ok(reply) => Err(format!(
            "/v1/models: answered {} ({})",
            reply.status,
            error_message(&reply.body)
        )),
        Err(error) => Err(error),
    };
    let models = health.and(models);
    if models.is_ok() && learned.detected.is_none() {
        learned.detected = Some(Detected::Openai);
    }
    let loaded = match (&models, running) {
        (Ok(_), Ok(reply)) if reply.status == StatusCode::OK => parse_running(&reply.body),
        (Ok(models), _) => Some(models.clone()),
        (Err(_), _) => None,
    };
    EnginePoll {
        models,
        loaded,
        learned,
    }
}

/// Whether the host is an Ollama server: `GET /api/version` answers 200 with
/// a `version` (llama-server and the others answer 404).
pub async fn is_ollama(client: &Outbound, target: &Target) -> bool {
    get(client, target, "/api/version")
        .await
        .ok()
        .filter(|reply| reply.status == StatusCode::OK)
        .and_then(|reply| serde_json::from_slice::<Value>(&reply.body).ok())
        .is_some_and(|value| value.get("version").is_some_and(Value::is_string))
}

/// `GET {url}{path}`; a transport failure is an error with the path in it.
async fn get(client: &Outbound, target: &Target, path: &str) -> Result<Reply, String> {
    let request = Request::get(format!("{}{path}", target.url))
        .header(ACCEPT, "application/json")
        .header(USER_AGENT, concat!("oqp/", env!("CARGO_PKG_VERSION")))
        .body(Full::new(Bytes::new()))
        .map_err(|e| format!("{path}: invalid request: {e}"))?;
    client
        .send(request, target.timeout, BODY_LIMIT)
        .await
        .map_err(|e| format!("{path}: {e}"))
}

/// `{"data": [{"id": …, "aliases": […]}, …]}` → every id and alias, sorted,
/// deduplicated (bytes unknown: 0). Another shape, an error body or an empty
/// list is an error that says which.
pub fn parse_openai_models(body: &[u8]) -> Result<Vec<Listed>, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("not a JSON model list: {e}"))?;
    if value.get("error").is_some() {
        return Err(format!("answered an error: {}", error_message(body)));
    }
    // Ollama's own /v1/models says `"data": null` when it has no model.
    let empty = Vec::new();
    let data = match value.get("data") {
        Some(Value::Null) => Some(&empty),
        data => data.and_then(Value::as_array),
    };
    let Some(entries) = data else {
        return Err(if value.get("models").is_some() {
            "not an OpenAI model list: it has Ollama's \"models\" but no \"data\" array".to_owned()
        } else {
            "not an OpenAI model list: no \"data\" array".to_owned()
        });
    };
    let mut models: Vec<Listed> = entries
        .iter()
        .flat_map(|entry| {
            let id = entry.get("id").and_then(Value::as_str);
            let aliases = entry
                .get("aliases")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str);
            id.into_iter().chain(aliases)
        })
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(|name| (name.to_owned(), 0))
        .collect();
    models.sort();
    models.dedup();
    if models.is_empty() {
        return Err("lists no models".to_owned());
    }
    Ok(models)
}

/// The slot count to use from `/props`'s `total_slots` and the length of
/// `/slots` (when enabled), or why neither is believed.
fn believed_slots(total: Option<u64>, listed: Option<u64>) -> Result<u32, String> {
    match (total, listed) {
        (Some(total), _) if total == 0 || total > MAX_SLOTS => Err(format!(
            "/props reports {total} slots (outside 1..={MAX_SLOTS}); the configured slots are used"
        )),
        (Some(total), Some(listed)) if total != listed => Err(format!(
            "/props reports {total} slots but /slots lists {listed}; the configured slots are used"
        )),
        (Some(total), _) => u32::try_from(total).map_err(|_| format!("{total} slots")),
        (None, _) => Err("/props has no total_slots; the configured slots are used".to_owned()),
    }
}

/// What `/props` says about slots.
struct Props {
    total_slots: Option<u64>,
    slot_context: Option<u32>,
}

/// llama-server's `/props`; `None` when the body is not one.
fn parse_props(body: &[u8]) -> Option<Props> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let object = value.as_object()?;
    if !object.contains_key("total_slots") && !object.contains_key("default_generation_settings") {
        return None;
    }
    Some(Props {
        total_slots: value.get("total_slots").and_then(Value::as_u64),
        slot_context: value
            .pointer("/default_generation_settings/n_ctx")
            .and_then(Value::as_u64)
            .and_then(|n| u32::try_from(n).ok()),
    })
}

/// How many slots llama-server's `/slots` lists.
fn slot_count(body: &[u8]) -> Option<u64> {
    let value: Value = serde_json::from_slice(body).ok()?;
    value.as_array().map(|slots| slots.len() as u64)
}

/// llama-swap's `{"running": [{"model": …, "state": …}]}` → the models it
/// has started (sorted); `None` when the body is not that.
fn parse_running(body: &[u8]) -> Option<Vec<Listed>> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let mut running: Vec<Listed> = value
        .get("running")?
        .as_array()?
        .iter()
        .filter_map(|entry| entry.get("model").and_then(Value::as_str))
        .map(|name| (name.to_owned(), 0))
        .collect();
    running.sort();
    running.dedup();
    Some(running)
}

/// The message of an error body in OpenAI's (`{"error": {"message"}}`),
/// Ollama's (`{"error": "…"}`) or any other shape, cut short.
fn error_message(body: &[u8]) -> String {
    const LIMIT: usize = 200;
    let text = match serde_json::from_slice::<Value>(body) {
        Ok(value) => match value.get("error") {
            Some(Value::String(message)) => message.clone(),
            Some(error) => error
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| error.to_string(), str::to_owned),
            None => value.to_string(),
        },
        Err(_) => String::from_utf8_lossy(body).into_owned(),
    };
    let text = text.trim();
    match text.char_indices().nth(LIMIT) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn openai_model_lists_give_ids_and_aliases() {
        let body = br#"{"models":[{"name":"x","size":""}],"object":"list","data":[{"id":"oqp-tiny:latest","aliases":["tiny","oqp-tiny:latest"],"object":"model"},{"id":"b"}]}"#;
        let names: Vec<String> = parse_openai_models(body)
            .unwrap()
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        assert_eq!(names, ["b", "oqp-tiny:latest", "tiny"]);
    }

    #[test]
    fn other_shapes_and_empty_lists_are_failures_that_say_why() {
        let empty = parse_openai_models(br#"{"object":"list","data":[]}"#).unwrap_err();
        assert!(empty.contains("lists no models"), "{empty}");
        let null = parse_openai_models(br#"{"object":"list","data":null}"#).unwrap_err();
        assert!(null.contains("lists no models"), "{null}");
        let ollama = parse_openai_models(br#"{"models":[{"name":"llama3"}]}"#).unwrap_err();
        assert!(ollama.contains("Ollama"), "{ollama}");
        let error = parse_openai_models(br#"{"error":{"message":"Loading model","code":503}}"#)
            .unwrap_err();
        assert!(error.contains("Loading model"), "{error}");
        let ollama_error = parse_openai_models(br#"{"error":"unauthorized"}"#).unwrap_err();
        assert!(ollama_error.contains("unauthorized"), "{ollama_error}");
        assert!(parse_openai_models(b"File Not Found").is_err());
    }

    #[test]
    fn props_give_slots_and_context() {
        let props = parse_props(
            br#"{"default_generation_settings":{"n_ctx":4096},"total_slots":2,"model_alias":"a"}"#,
        )
        .unwrap();
        assert_eq!(props.total_slots, Some(2));
        assert_eq!(props.slot_context, Some(4096));
        assert!(parse_props(br#"{"detail":"Not Found"}"#).is_none());
        assert!(parse_props(b"[]").is_none());
    }

    #[test]
    fn a_slot_count_is_believed_only_in_range_and_when_slots_agrees() {
        assert_eq!(believed_slots(Some(2), Some(2)), Ok(2));
        assert_eq!(believed_slots(Some(4), None), Ok(4));
        let contradicted = believed_slots(Some(8), Some(2)).unwrap_err();
        assert!(contradicted.contains("/slots lists 2"), "{contradicted}");
        let zero = believed_slots(Some(0), None).unwrap_err();
        assert!(zero.contains("0 slots"), "{zero}");
        assert!(believed_slots(Some(MAX_SLOTS + 1), None).is_err());
        assert!(believed_slots(None, Some(2)).is_err());
    }

    #[test]
    fn running_lists_and_slot_lists_parse() {
        assert_eq!(
            parse_running(br#"{"running":[{"model":"b","state":"ready"},{"model":"a"}]}"#),
            Some(vec![("a".to_owned(), 0), ("b".to_owned(), 0)])
        );
        assert_eq!(parse_running(br#"{"detail":"Not Found"}"#), None);
        assert_eq!(slot_count(br#"[{"id":0},{"id":1}]"#), Some(2));
        assert_eq!(slot_count(br#"{"error":"no"}"#), None);
    }

    #[test]
    fn error_messages_are_read_from_either_shape_and_cut_short() {
        assert_eq!(
            error_message(br#"{"error":{"message":"Loading model","type":"unavailable_error"}}"#),
            "Loading model"
        );
        assert_eq!(
            error_message(br#"{"error":"model not found"}"#),
            "model not found"
        );
        assert_eq!(error_message(b"File Not Found"), "File Not Found");
        let long = "x".repeat(500);
        assert_eq!(error_message(long.as_bytes()).chars().count(), 201);
    }
}
