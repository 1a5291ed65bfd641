//! What each installed model's runner can run at once, learned from `POST /api/show` once per
//! model digest: Ollama runs every loaded model as its own runner with `OLLAMA_NUM_PARALLEL`
//! slots, but forces one slot for models without the `completion` capability (embedding
//! models) and for some architectures, whatever the setting.

use bytes::Bytes;
use http::Request;
use http::header::{ACCEPT, CONTENT_TYPE, USER_AGENT};
use http_body_util::Full;
use serde_json::Value;

use super::Target;
pub use crate::inventory::Shown;
use crate::outbound::Outbound;

/// The architectures Ollama runs with one slot whatever `OLLAMA_NUM_PARALLEL` says.
///
/// From Ollama's `server/sched.go` (the scheduler's `numParallel = 1` rules): `mllama` since
/// 0.4 (ollama/ollama@09f15872, `checkMllamaModelFamily`), and the list its llama-server runner
/// (0.30 and later) forces: `qwen3vl`, `qwen35`, `qwen3next`, `lfm2`, `nemotron_h`. A box that
/// runs another such model can say so with `ollama.hosts[].models."<glob>".num_parallel: 1`.
pub const FORCED_ARCHITECTURES: &[&str] = &[
    "mllama",
    "qwen3vl",
    "qwen35",
    "qwen3next",
    "lfm2",
    "nemotron_h",
];

/// Most `/api/show` calls one poll makes (the rest wait for the next poll).
pub const MAX_SHOWS_PER_POLL: usize = 32;

/// The largest `/api/show` answer read (its `tensors` are not asked for).
const BODY_LIMIT: usize = 4 * 1024 * 1024;

/// Why Ollama runs a model with these `capabilities` and this architecture with one slot, if
/// it does: the same test as `sched.go`'s (no `completion` capability, or a listed
/// architecture).
pub fn forced(capabilities: &[&str], architecture: &str) -> Option<String> {
    if !capabilities.contains(&"completion") {
        return Some(if capabilities.contains(&"embedding") {
            "embedding".to_owned()
        } else {
            "no completion".to_owned()
        });
    }
    FORCED_ARCHITECTURES
        .contains(&architecture)
        .then(|| format!("architecture {architecture}"))
}

/// The reason from an `/api/show` body; `Err` when the body is not one.
pub fn parse_show(body: &[u8]) -> Result<Option<String>, String> {
    let value: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let capabilities: Vec<&str> = value
        .get("capabilities")
        .and_then(Value::as_array)
        .ok_or("no capabilities")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let architecture = value
        .pointer("/model_info/general.architecture")
        .and_then(Value::as_str)
        .unwrap_or_default();
    Ok(forced(&capabilities, architecture))
}

/// The models of `installed` (name, digest) not yet shown at their digest in `known`, asked
/// (at most [`MAX_SHOWS_PER_POLL`]); returns everything known for the models still installed.
/// A model whose `/api/show` fails is asked again at the next poll.
pub async fn learn(
    client: &Outbound,
    target: &Target,
    installed: &[(String, String)],
    known: &[Shown],
) -> Vec<Shown> {
    let mut shown = Vec::with_capacity(installed.len());
    let mut asked = 0;
    for (model, digest) in installed {
        if let Some(seen) = known
            .iter()
            .find(|seen| &seen.model == model && &seen.digest == digest)
        {
            shown.push(seen.clone());
            continue;
        }
        if asked >= MAX_SHOWS_PER_POLL {
            continue;
        }
        asked += 1;
        match show(client, target, model).await {
            Ok(forced) => shown.push(Shown {
                model: model.clone(),
                digest: digest.clone(),
                forced,
            }),
            Err(error) => {
                tracing::debug!(host = %target.name, %model, %error, "/api/show failed; asked again next poll");
            }
        }
    }
    shown
}

async fn show(client: &Outbound, target: &Target, model: &str) -> Result<Option<String>, String> {
    let body =
        serde_json::to_vec(&serde_json::json!({ "model": model })).map_err(|e| e.to_string())?;
    let request = Request::post(format!("{}/api/show", target.url))
        .header(ACCEPT, "application/json")
        .header(CONTENT_TYPE, "application/json")
        .header(USER_AGENT, concat!("oqp/", env!("CARGO_PKG_VERSION")))
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| format!("invalid request: {e}"))?;
    let reply = client
        .send(request, target.timeout, BODY_LIMIT)
        .await
        .map_err(|e| e.to_string())?;
    if !reply.status.is_success() {
        return Err(format!("answered {}", reply.status));
    }
    parse_show(&reply.body)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn one_slot_for_models_without_completion_and_for_the_listed_architectures() {
        assert_eq!(forced(&["embedding"], "bert").as_deref(), Some("embedding"));
        assert_eq!(
            forced(&["vision"], "clip").as_deref(),
            Some("no completion")
        );
        assert_eq!(forced(&["completion", "tools"], "llama"), None);
        assert_eq!(
            forced(&["completion", "vision"], "qwen3vl").as_deref(),
            Some("architecture qwen3vl")
        );
        let body =
            br#"{"capabilities":["completion"],"model_info":{"general.architecture":"lfm2"}}"#;
        assert_eq!(
            parse_show(body).unwrap().as_deref(),
            Some("architecture lfm2")
        );
        assert_eq!(
            parse_show(br#"{"capabilities":["embedding"],"model_info":{}}"#)
                .unwrap()
                .as_deref(),
            Some("embedding")
        );
        assert!(parse_show(br#"{"error":"model not found"}"#).is_err());
    }
}
