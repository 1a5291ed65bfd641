//! The fleet's model lists: `/api/tags` and `/api/ps` answered with the union over hosts.

use std::collections::HashSet;

use serde_json::{Value, json};

use crate::policy::normalize_model;

/// Merges several hosts' `/api/tags` bodies into one: every model once, by `name` as Ollama
/// compares names, the first host's entry winning, in the order first seen. Bodies that are not
/// `{"models": [...]}` and entries without a name are skipped.
pub fn union_tags(bodies: &[Value]) -> Value {
    union_models(bodies)
}

/// Merges several hosts' `/api/ps` bodies the same way as [`union_tags`].
pub fn union_ps(bodies: &[Value]) -> Value {
    union_models(bodies)
}

/// Merges several hosts' OpenAI `/v1/models` bodies (`{"object":"list","data":[{"id":…}]}`)
/// the same way, by `id`.
pub fn union_openai_models(bodies: &[Value]) -> Value {
    let mut seen: HashSet<String> = HashSet::new();
    let mut data: Vec<Value> = Vec::new();
    for entries in bodies
        .iter()
        .filter_map(|body| body.get("data").and_then(Value::as_array))
    {
        for entry in entries {
            if let Some(id) = entry.get("id").and_then(Value::as_str)
                && seen.insert(normalize_model(id))
            {
                data.push(entry.clone());
            }
        }
    }
    json!({ "object": "list", "data": data })
}

fn union_models(bodies: &[Value]) -> Value {
    let mut seen: HashSet<String> = HashSet::new();
    let mut models: Vec<Value> = Vec::new();
    for body in bodies {
        let Some(entries) = body.get("models").and_then(Value::as_array) else {
            continue;
        };
        for entry in entries {
            let name = entry
                .get("name")
                .and_then(Value::as_str)
                .or_else(|| entry.get("model").and_then(Value::as_str));
            if let Some(name) = name
                && seen.insert(normalize_model(name))
            {
                models.push(entry.clone());
            }
        }
    }
    json!({ "models": models })
}
