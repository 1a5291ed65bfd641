//! One poll of one host: `GET /api/tags` (installed models, which decides
//! health) and `GET /api/ps` (loaded models, best effort) at the same time,
//! each within `routing.model_poll_timeout`.

use std::time::SystemTime;

use bytes::Bytes;
use http::header::{ACCEPT, AUTHORIZATION, USER_AGENT};
use http::{HeaderValue, Request};
use http_body_util::Full;
use serde_json::Value;

use super::Target;
use crate::compile::Inventory;
use crate::outbound::Outbound;

/// The largest model list read; a real one is a few hundred bytes per model.
const BODY_LIMIT: usize = 8 * 1024 * 1024;

/// What one poll saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    /// Installed models, or why `/api/tags` failed (the host is then down).
    pub tags: Result<Vec<String>, String>,
    /// Loaded models; `None` when `/api/ps` failed, which alone does not make
    /// a host unhealthy (Ollama Cloud has no `/api/ps`).
    pub ps: Option<Vec<String>>,
}

impl Observation {
    /// The inventory to record. A failed `/api/tags` keeps the model lists
    /// last seen (routing may still need them while every host looks down);
    /// a failed `/api/ps` on a healthy host keeps the last loaded list, so a
    /// slow `/api/ps` does not flap the snapshot.
    pub fn to_inventory(&self, previous: Option<&Inventory>, now: SystemTime) -> Inventory {
        let previous_installed = || previous.map(|p| p.installed.clone()).unwrap_or_default();
        let previous_loaded = || previous.map(|p| p.loaded.clone()).unwrap_or_default();
        match &self.tags {
            Ok(installed) => Inventory {
                healthy: true,
                installed: installed.clone(),
                loaded: self.ps.clone().unwrap_or_else(previous_loaded),
                last_checked: Some(now),
            },
            Err(_) => Inventory {
                healthy: false,
                installed: previous_installed(),
                loaded: previous_loaded(),
                last_checked: Some(now),
            },
        }
    }
}

/// Polls `target` once.
pub async fn probe(client: &Outbound, target: &Target) -> Observation {
    let (tags, ps) = tokio::join!(
        models(client, target, "/api/tags"),
        models(client, target, "/api/ps")
    );
    if let Err(error) = &ps {
        tracing::debug!(host = %target.name, %error, "/api/ps failed; loaded models unknown");
    }
    Observation { tags, ps: ps.ok() }
}

/// `GET {url}{path}` → the sorted `models[].name` list.
async fn models(client: &Outbound, target: &Target, path: &str) -> Result<Vec<String>, String> {
    let mut request = Request::get(format!("{}{path}", target.url))
        .header(ACCEPT, "application/json")
        // Lets an upstream (and a test's fake) tell polls from proxied traffic.
        .header(USER_AGENT, concat!("oqp/", env!("CARGO_PKG_VERSION")))
        .body(Full::new(Bytes::new()))
        .map_err(|e| format!("{path}: invalid request: {e}"))?;
    if let Some(key) = &target.bearer {
        let mut value = HeaderValue::from_str(&format!("Bearer {}", key.expose()))
            .map_err(|_| format!("{path}: the cloud key is not a valid header value"))?;
        value.set_sensitive(true);
        request.headers_mut().insert(AUTHORIZATION, value);
    }
    let reply = client
        .send(request, target.timeout, BODY_LIMIT)
        .await
        .map_err(|e| format!("{path}: {e}"))?;
    if !reply.status.is_success() {
        return Err(format!("{path}: answered {}", reply.status));
    }
    parse_models(&reply.body).map_err(|e| format!("{path}: {e}"))
}

/// `{"models": [{"name": …}, …]}` → sorted, deduplicated names. Sorting
/// keeps the snapshot stable: Ollama orders `/api/ps` by expiry.
pub fn parse_models(body: &[u8]) -> Result<Vec<String>, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("not a JSON model list: {e}"))?;
    let Some(entries) = value.get("models").and_then(Value::as_array) else {
        return Err("not a JSON model list: no \"models\" array".to_owned());
    };
    let mut names: Vec<String> = entries
        .iter()
        .filter_map(|entry| {
            entry
                .get("name")
                .or_else(|| entry.get("model"))
                .and_then(Value::as_str)
        })
        .map(str::to_owned)
        .collect();
    names.sort();
    names.dedup();
    Ok(names)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn model_lists_parse_sorted() {
        let body = br#"{"models":[{"name":"qwen3:8b","model":"qwen3:8b","size":1},{"name":"llama3:latest"},{"model":"only-model"},{"size":3},{"name":"llama3:latest"}]}"#;
        assert_eq!(
            parse_models(body).unwrap(),
            ["llama3:latest", "only-model", "qwen3:8b"]
        );
        assert_eq!(
            parse_models(br#"{"models":[]}"#).unwrap(),
            Vec::<String>::new()
        );
    }

    #[test]
    fn other_bodies_are_failures() {
        assert!(parse_models(b"Ollama is running").is_err());
        assert!(parse_models(br#"{"error":"unauthorized"}"#).is_err());
        assert!(parse_models(br#"{"models":{}}"#).is_err());
        assert!(parse_models(b"").is_err());
    }

    fn previous() -> Inventory {
        Inventory {
            healthy: true,
            installed: vec!["a".into(), "b".into()],
            loaded: vec!["a".into()],
            last_checked: None,
        }
    }

    #[test]
    fn a_failed_tags_poll_keeps_the_lists_and_marks_down() {
        let now = SystemTime::now();
        let observation = Observation {
            tags: Err("connection refused".into()),
            ps: None,
        };
        let inventory = observation.to_inventory(Some(&previous()), now);
        assert!(!inventory.healthy);
        assert_eq!(inventory.installed, ["a", "b"]);
        assert_eq!(inventory.loaded, ["a"]);
        assert_eq!(inventory.last_checked, Some(now));
        assert_eq!(observation.to_inventory(None, now).installed.len(), 0);
    }

    #[test]
    fn a_failed_ps_alone_keeps_the_host_healthy() {
        let now = SystemTime::now();
        let observation = Observation {
            tags: Ok(vec!["a".into(), "c".into()]),
            ps: None,
        };
        let inventory = observation.to_inventory(Some(&previous()), now);
        assert!(inventory.healthy);
        assert_eq!(inventory.installed, ["a", "c"]);
        assert_eq!(inventory.loaded, ["a"]);
        let fresh = Observation {
            tags: Ok(vec!["a".into()]),
            ps: Some(vec![]),
        };
        assert!(fresh.to_inventory(Some(&previous()), now).loaded.is_empty());
    }
}
