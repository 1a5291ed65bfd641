//! Model names as hosts list them, and Ollama's "model not found".

use std::borrow::Cow;

use crate::policy::{HostKind, normal_model};

/// A requested model in the forms hosts list it: borrowed from the request's name when that
/// is already normal. Made once per placement and once per completion, and handed down.
pub(super) struct ModelKey<'a> {
    /// As a local Ollama lists it.
    pub(super) local: Cow<'a, str>,
    /// As Ollama Cloud lists it, when that differs (a `:cloud`/`-cloud` suffix removed).
    pub(super) cloud: Option<Cow<'a, str>>,
}

impl<'a> ModelKey<'a> {
    pub(super) fn new(model: &'a str) -> Self {
        let stripped = strip_cloud_suffix(model);
        ModelKey {
            local: normal_model(model),
            cloud: (stripped.len() != model.trim().len()).then(|| normal_model(stripped)),
        }
    }

    /// The name as a host of `kind` lists it.
    pub(super) fn listed_by(&self, kind: HostKind) -> &str {
        match (kind, &self.cloud) {
            (HostKind::Cloud, Some(cloud)) => cloud,
            _ => &self.local,
        }
    }
}

/// A model name as Ollama Cloud knows it: without the `:cloud` or `-cloud` suffix a local
/// Ollama uses for cloud models (`gpt-oss:120b-cloud` → `gpt-oss:120b`), as the local server's
/// passthrough does before calling ollama.com.
pub fn strip_cloud_suffix(model: &str) -> &str {
    let trimmed = model.trim();
    for suffix in [":cloud", "-cloud"] {
        if let Some(split) = trimmed.len().checked_sub(suffix.len())
            && trimmed.is_char_boundary(split)
            && split > 0
            && trimmed[split..].eq_ignore_ascii_case(suffix)
        {
            return &trimmed[..split];
        }
    }
    trimmed
}

/// Whether an upstream answer is Ollama's "model not found" (404 with an error naming it, in
/// the native or the OpenAI shape): the cue for [`crate::router::Router::forget_model`].
pub fn is_model_not_found(status: http::StatusCode, body: &[u8]) -> bool {
    if status != http::StatusCode::NOT_FOUND {
        return false;
    }
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return false;
    };
    let error = value.get("error");
    let message = error
        .and_then(|error| error.as_str())
        .or_else(|| error.and_then(|error| error.get("message")?.as_str()));
    message.is_some_and(|message| message.to_ascii_lowercase().contains("not found"))
}
