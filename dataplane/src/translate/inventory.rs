//! Ollama's metadata answers for the models of `openai` hosts, from what the control plane
//! learned of them (their `/v1/models` names, which of them are loaded, sizes where polled,
//! each slot's context): `/api/tags` and `/api/ps` entries to merge into the fleet's union,
//! `/api/show`, and `/api/version` when no Ollama host is there to answer it.
//!
//! An engine tells no digest: each model gets a stable made-up one, the SHA-256 of
//! `oqp:openai:<host>:<model>` in hex (the same name on the same host always has the same
//! digest, and the entry is never mistaken for one of Ollama's blobs).

use serde_json::{Value, json};
use sha2::Digest;

use super::serves_only_openai;
use crate::policy::{Host, HostKind, Policy, normalize_model};

/// The entries of the `openai` hosts among `hosts` for a listing `path` (`/api/tags`: every
/// model they serve; `/api/ps`: those loaded).
pub fn listing_entries(hosts: &[std::sync::Arc<Host>], path: &str) -> Value {
    let loaded = path == "/api/ps";
    let mut models = Vec::new();
    for host in hosts.iter().filter(|host| host.kind == HostKind::Openai) {
        let names = if loaded {
            &host.loaded_names
        } else {
            &host.installed_names
        };
        for name in names {
            let mut entry = entry(host, name);
            if loaded {
                // An engine keeps its model for as long as it runs: Ollama's "forever".
                entry["expires_at"] = json!("2318-01-01T00:00:00Z");
                entry["size_vram"] = entry["size"].clone();
                if let Some(context) = host.engine.slot_context {
                    entry["context_length"] = json!(context);
                }
            }
            models.push(entry);
        }
    }
    json!({ "models": models })
}

/// `/api/show` for `model` when only `openai` hosts serve it: the details oqp knows, the
/// rest empty; `None` when an Ollama host serves it (it answers itself).
pub fn show(policy: &Policy, model: &str) -> Option<Value> {
    if !serves_only_openai(policy, model) {
        return None;
    }
    let name = normalize_model(model);
    let host = policy
        .hosts
        .iter()
        .chain(&policy.remote)
        .find(|host| host.installed.contains(&name))?;
    let listed = host
        .installed_names
        .iter()
        .find(|listed| normalize_model(listed) == name)
        .map_or(model, String::as_str);
    let entry = entry(host, listed);
    let mut model_info = json!({ "general.architecture": "" });
    if let Some(context) = host.engine.slot_context {
        model_info["general.context_length"] = json!(context);
    }
    Some(json!({
        "modelfile": "",
        "parameters": "",
        "template": "",
        "details": entry["details"],
        "model_info": model_info,
        "capabilities": ["completion"],
        "modified_at": entry["modified_at"],
    }))
}

/// `/api/version` when no Ollama host answers it.
pub fn version() -> Value {
    json!({ "version": super::OLLAMA_VERSION })
}

/// One `/api/tags` entry for `name` on `host`.
fn entry(host: &Host, name: &str) -> Value {
    let size = host
        .vram
        .sizes
        .get(&normalize_model(name))
        .copied()
        .unwrap_or(0);
    let modified = host.last_checked.unwrap_or(std::time::UNIX_EPOCH);
    json!({
        "name": name,
        "model": name,
        "modified_at": humantime::format_rfc3339_seconds(modified).to_string(),
        "size": size,
        "digest": digest(&host.name, name),
        "details": {
            "parent_model": "",
            "format": "",
            "family": "",
            "families": [],
            "parameter_size": "",
            "quantization_level": "",
        },
    })
}

/// The made-up digest of `model` on `host` (see the module documentation).
pub(super) fn digest(host: &str, model: &str) -> String {
    hex::encode(sha2::Sha256::digest(format!(
        "oqp:openai:{host}:{}",
        normalize_model(model)
    )))
}
