//! One poll of one host. An Ollama (or cloud) host: `GET /api/tags`
//! (installed models and their sizes on disk, which decides health) and
//! `GET /api/ps` (loaded and loading models and their VRAM, best effort) at
//! the same time, each within `routing.model_poll_timeout`. An `openai` host
//! is polled by [`super::engine`]; an `auto` host first asks `/api/version`
//! and is then polled as whichever it is.

use std::time::SystemTime;

use bytes::Bytes;
use http::header::{ACCEPT, AUTHORIZATION, USER_AGENT};
use http::{HeaderValue, Request};
use http_body_util::Full;
use serde_json::Value;

use super::Target;
use super::engine;
use super::runners;
use crate::config::HostKind;
pub use crate::inventory::Listed;
use crate::inventory::{Detected, Inventory, Learned, Shown};
use crate::outbound::Outbound;

/// The largest model list read; a real one is a few hundred bytes per model.
const BODY_LIMIT: usize = 8 * 1024 * 1024;

/// What one poll saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    /// Installed models, or why `/api/tags` failed (the host is then down).
    pub tags: Result<Vec<Listed>, String>,
    /// Loaded and loading models; `None` when `/api/ps` failed, which alone
    /// does not make a host unhealthy (Ollama Cloud has no `/api/ps`).
    pub ps: Option<Vec<Listed>>,
    /// What `/api/show` said of the installed models (kept from earlier polls while their
    /// digest stays); `None` when not asked this time (the last known is kept).
    pub shown: Option<Vec<Shown>>,
    /// What answered and what it said of itself (kind, slots, problems).
    pub learned: Learned,
}

impl Observation {
    /// The inventory to record. A failed `/api/tags` keeps the model lists
    /// last seen (routing may still need them while every host looks down);
    /// a failed `/api/ps` on a healthy host keeps the last loaded list, so a
    /// slow `/api/ps` does not flap the snapshot.
    pub fn to_inventory(&self, previous: Option<&Inventory>, now: SystemTime) -> Inventory {
        let previous_sizes = || previous.map(|p| p.sizes.clone()).unwrap_or_default();
        let previous_resident = || previous.map(|p| p.resident.clone()).unwrap_or_default();
        let (healthy, sizes, resident) = match &self.tags {
            Ok(installed) => (
                true,
                installed.clone(),
                self.ps.clone().unwrap_or_else(previous_resident),
            ),
            Err(_) => (false, previous_sizes(), previous_resident()),
        };
        let names = |list: &[Listed]| list.iter().map(|(name, _)| name.clone()).collect();
        // A host that does not answer keeps what was learned of it: its kind and slots
        // still describe it when it comes back.
        let learned = match (&self.tags, previous) {
            (Err(_), Some(previous)) => previous.learned.clone(),
            _ => self.learned.clone(),
        };
        let shown = self
            .shown
            .clone()
            .or_else(|| previous.map(|p| p.shown.clone()))
            .unwrap_or_default();
        Inventory {
            forced: shown
                .iter()
                .filter_map(|seen| {
                    let reason = seen.forced.clone()?;
                    Some((oqp_dataplane::policy::normalize_model(&seen.model), reason))
                })
                .collect(),
            shown,
            healthy,
            installed: names(&sizes),
            loaded: names(&resident),
            sizes,
            resident,
            last_checked: Some(now),
            learned,
            error: self.tags.as_ref().err().cloned(),
        }
    }
}

/// Polls `target` once; `previous` is what the last poll recorded (the models already shown).
pub async fn probe(
    client: &Outbound,
    target: &Target,
    previous: Option<&Inventory>,
) -> Observation {
    let openai = match target.kind {
        HostKind::Openai => true,
        HostKind::Auto => !engine::is_ollama(client, target).await,
        HostKind::Ollama | HostKind::Cloud => false,
    };
    if openai {
        let poll = engine::probe(client, target).await;
        let tags = match (poll.models, target.kind) {
            (Err(error), HostKind::Auto) => Err(format!(
                "answers neither as Ollama (/api/version) nor as an OpenAI engine: {error}"
            )),
            (models, _) => models,
        };
        return Observation {
            tags,
            ps: poll.loaded,
            // No /api/show here: nothing forced to one slot.
            shown: Some(Vec::new()),
            learned: poll.learned,
        };
    }
    let (tags, ps) = tokio::join!(
        models(client, target, "/api/tags"),
        models(client, target, "/api/ps")
    );
    if let Err(error) = &ps {
        tracing::debug!(host = %target.name, %error, "/api/ps failed; loaded models unknown");
    }
    let shown = match (&tags, target.kind) {
        (Ok((_, digests)), HostKind::Ollama | HostKind::Auto) => {
            let known = previous.map(|p| p.shown.as_slice()).unwrap_or_default();
            Some(runners::learn(client, target, digests, known).await)
        }
        _ => None,
    };
    let learned = Learned {
        detected: (tags.is_ok() && target.kind != HostKind::Cloud).then_some(Detected::Ollama),
        ..Learned::default()
    };
    Observation {
        tags: tags.map(|(listed, _)| listed),
        ps: ps.ok().map(|(listed, _)| listed),
        shown,
        learned,
    }
}

/// `GET {url}{path}` → the sorted `models[]` list, and each model's digest.
async fn models(
    client: &Outbound,
    target: &Target,
    path: &str,
) -> Result<(Vec<Listed>, Vec<(String, String)>), String> {
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
    if reply.status == http::StatusCode::NOT_FOUND && path == "/api/tags" {
        return Err(format!(
            "{path}: answered {}: not an Ollama server? An OpenAI-compatible engine \
             (llama-server, llama-swap, vLLM…) needs kind: openai (or auto)",
            reply.status
        ));
    }
    if !reply.status.is_success() {
        return Err(format!("{path}: answered {}", reply.status));
    }
    let listed = parse_models(&reply.body).map_err(|e| format!("{path}: {e}"))?;
    Ok((listed, parse_digests(&reply.body)))
}

/// Each listed model's `digest` (empty when it has none), in list order.
fn parse_digests(body: &[u8]) -> Vec<(String, String)> {
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        return Vec::new();
    };
    value
        .get("models")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|entry| {
            let name = entry
                .get("name")
                .or_else(|| entry.get("model"))
                .and_then(Value::as_str)?;
            let digest = entry
                .get("digest")
                .and_then(Value::as_str)
                .unwrap_or_default();
            Some((name.to_owned(), digest.to_owned()))
        })
        .collect()
}

/// `{"models": [{"name": …, "size": …, "size_vram": …}, …]}` → names with
/// their bytes, sorted by name, deduplicated. Bytes are `size_vram` when it is
/// there and not zero (`/api/ps`), else `size`, else 0. Sorting keeps the
/// snapshot stable: Ollama orders `/api/ps` by expiry.
pub fn parse_models(body: &[u8]) -> Result<Vec<Listed>, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("not a JSON model list: {e}"))?;
    let Some(entries) = value.get("models").and_then(Value::as_array) else {
        return Err("not a JSON model list: no \"models\" array".to_owned());
    };
    let mut models: Vec<Listed> = entries
        .iter()
        .filter_map(|entry| {
            let name = entry
                .get("name")
                .or_else(|| entry.get("model"))
                .and_then(Value::as_str)?;
            let bytes = |key: &str| entry.get(key).and_then(Value::as_u64).filter(|&b| b > 0);
            let size = bytes("size_vram").or_else(|| bytes("size")).unwrap_or(0);
            Some((name.to_owned(), size))
        })
        .collect();
    models.sort();
    models.dedup_by(|later, first| later.0 == first.0);
    Ok(models)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn listed(models: &[(&str, u64)]) -> Vec<Listed> {
        models
            .iter()
            .map(|(name, bytes)| ((*name).to_owned(), *bytes))
            .collect()
    }

    #[test]
    fn model_lists_parse_sorted_with_their_bytes() {
        let body = br#"{"models":[{"name":"qwen3:8b","model":"qwen3:8b","size":1},{"name":"llama3:latest"},{"model":"only-model"},{"size":3},{"name":"llama3:latest","size":7}]}"#;
        assert_eq!(
            parse_models(body).unwrap(),
            listed(&[("llama3:latest", 0), ("only-model", 0), ("qwen3:8b", 1)])
        );
        // /api/ps: VRAM first; a model on the CPU (size_vram 0) counts its size.
        let ps = br#"{"models":[{"name":"a:1","size":9,"size_vram":6},{"name":"b:1","size":5,"size_vram":0},{"name":"c:1","size":-2}]}"#;
        assert_eq!(
            parse_models(ps).unwrap(),
            listed(&[("a:1", 6), ("b:1", 5), ("c:1", 0)])
        );
        assert_eq!(
            parse_models(br#"{"models":[]}"#).unwrap(),
            Vec::<Listed>::new()
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
            sizes: listed(&[("a", 10), ("b", 20)]),
            resident: listed(&[("a", 12)]),
            last_checked: None,
            forced: Vec::new(),
            shown: Vec::new(),
            learned: Learned::default(),
            error: None,
        }
    }

    #[test]
    fn a_failed_tags_poll_keeps_the_lists_and_marks_down() {
        let now = SystemTime::now();
        let observation = Observation {
            tags: Err("connection refused".into()),
            ps: None,
            shown: None,
            learned: Learned::default(),
        };
        let inventory = observation.to_inventory(Some(&previous()), now);
        assert!(!inventory.healthy);
        assert_eq!(inventory.error.as_deref(), Some("connection refused"));
        assert_eq!(inventory.installed, ["a", "b"]);
        assert_eq!(inventory.loaded, ["a"]);
        assert_eq!(inventory.sizes, listed(&[("a", 10), ("b", 20)]));
        assert_eq!(inventory.resident, listed(&[("a", 12)]));
        assert_eq!(inventory.last_checked, Some(now));
        assert_eq!(observation.to_inventory(None, now).installed.len(), 0);
    }

    #[test]
    fn a_failed_ps_alone_keeps_the_host_healthy() {
        let now = SystemTime::now();
        let observation = Observation {
            tags: Ok(listed(&[("a", 10), ("c", 30)])),
            ps: None,
            shown: None,
            learned: Learned::default(),
        };
        let inventory = observation.to_inventory(Some(&previous()), now);
        assert!(inventory.healthy);
        assert_eq!(inventory.installed, ["a", "c"]);
        assert_eq!(inventory.sizes, listed(&[("a", 10), ("c", 30)]));
        assert_eq!(inventory.loaded, ["a"]);
        assert_eq!(inventory.resident, listed(&[("a", 12)]));
        let fresh = Observation {
            tags: Ok(listed(&[("a", 10)])),
            ps: Some(vec![]),
            shown: None,
            learned: Learned::default(),
        };
        let inventory = fresh.to_inventory(Some(&previous()), now);
        assert!(inventory.loaded.is_empty() && inventory.resident.is_empty());
    }
}
