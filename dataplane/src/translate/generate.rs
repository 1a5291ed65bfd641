//! `/api/generate` → the engine. Ollama renders a prompt with the model's template unless
//! `raw` is set; an engine renders chat messages with its own template, so a templated
//! generate becomes a chat of `[system?, user(prompt, images)]` on `/v1/chat/completions`,
//! and a `raw` one a plain completion of the prompt on `/v1/completions`. One with a `suffix`
//! is a fill-in-the-middle on llama-server's `/infill` (`input_prefix` = prompt,
//! `input_suffix` = suffix) when every host of the model is a llama-server, else a 400.
//! `context` (token ids of Ollama's runner) and `template` (a Go template the engine cannot
//! run) have no equivalent: a 400 naming the field.

use serde_json::{Map, Value, json};

use super::chat::{data_url, sampling};
use super::refused;
use crate::error::ProxyError;

/// The engine's route for a generate request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Target {
    /// `/v1/chat/completions`: the engine applies its template.
    Chat,
    /// `/v1/completions`: a `raw` prompt.
    Completions,
    /// llama-server's `/infill`: a prompt with a `suffix`.
    Infill,
}

/// The engine's request, and its route.
pub(super) type Planned = (Map<String, Value>, Target);

/// The engine's request for a generate `request`; `None` for a load call (an empty prompt,
/// no images). `infill`: the model's hosts serve `/infill`.
pub(super) fn request(
    request: &Map<String, Value>,
    model: &str,
    stream: bool,
    infill: bool,
) -> Result<Option<Planned>, ProxyError> {
    let text = |name: &str| -> Result<&str, ProxyError> {
        match request.get(name) {
            None | Some(Value::Null) => Ok(""),
            Some(Value::String(text)) => Ok(text),
            Some(_) => Err(refused(name, "must be a string")),
        }
    };
    let prompt = text("prompt")?;
    let system = text("system")?;
    let suffix = text("suffix")?;
    if !suffix.is_empty() && !infill {
        return Err(refused(
            "suffix",
            "cannot be translated: fill-in-the-middle needs llama-server's /infill, and not \
             every host of this model is a llama-server",
        ));
    }
    if !text("template")?.is_empty() {
        return Err(refused(
            "template",
            "cannot be translated: the engine renders prompts with its own template",
        ));
    }
    match request.get("context") {
        None | Some(Value::Null) => {}
        Some(Value::Array(context)) if context.is_empty() => {}
        Some(_) => {
            return Err(refused(
                "context",
                "cannot be translated: it has no equivalent on these hosts; send the \
                 conversation as /api/chat messages",
            ));
        }
    }
    let images: Vec<&str> = match request.get("images") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(images)) => images
            .iter()
            .map(|image| image.as_str())
            .collect::<Option<_>>()
            .ok_or_else(|| refused("images", "must be base64 strings"))?,
        Some(_) => return Err(refused("images", "must be an array")),
    };
    if prompt.is_empty() && images.is_empty() {
        return Ok(None);
    }
    let raw = request.get("raw") == Some(&Value::Bool(true));
    let mut upstream = Map::new();
    upstream.insert("model".into(), json!(model));
    if !suffix.is_empty() {
        for (field, given) in [
            ("system", !system.is_empty()),
            ("images", !images.is_empty()),
        ] {
            if given {
                return Err(refused(
                    field,
                    "cannot be used with suffix: /infill takes a prefix and a suffix only",
                ));
            }
        }
        if request
            .get("format")
            .is_some_and(|format| !format.is_null())
        {
            return Err(refused(
                "format",
                "cannot be used with suffix: /infill has no structured output",
            ));
        }
        upstream.insert("input_prefix".into(), json!(prompt));
        upstream.insert("input_suffix".into(), json!(suffix));
        sampling(request, &mut upstream, stream)?;
        // llama-server's own completion API: counts and timings come in its last event.
        upstream.remove("stream_options");
        return Ok(Some((upstream, Target::Infill)));
    }
    if raw {
        if !system.is_empty() {
            return Err(refused(
                "system",
                "cannot be used with raw (raw mode does not support template, system, or context)",
            ));
        }
        if !images.is_empty() {
            return Err(refused(
                "images",
                "cannot be translated with raw: a raw prompt is plain text",
            ));
        }
        upstream.insert("prompt".into(), json!(prompt));
    } else {
        let mut messages = Vec::new();
        if !system.is_empty() {
            messages.push(json!({ "role": "system", "content": system }));
        }
        let content = if images.is_empty() {
            json!(prompt)
        } else {
            let mut parts = vec![json!({ "type": "text", "text": prompt })];
            parts.extend(images.iter().map(
                |image| json!({ "type": "image_url", "image_url": { "url": data_url(image) } }),
            ));
            Value::Array(parts)
        };
        messages.push(json!({ "role": "user", "content": content }));
        upstream.insert("messages".into(), Value::Array(messages));
    }
    sampling(request, &mut upstream, stream)?;
    let target = if raw {
        Target::Completions
    } else {
        Target::Chat
    };
    Ok(Some((upstream, target)))
}
