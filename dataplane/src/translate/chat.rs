//! `/api/chat` → `/v1/chat/completions`: messages (images as image parts, tool calls with
//! their arguments as a JSON string, tool results, thinking as `reasoning_content`), tools,
//! and what `/api/generate` shares with it ([`sampling`]): `format` → `response_format`,
//! `think`, `options` → the engine's sampling fields, `stream`.

use std::sync::atomic::{AtomicBool, Ordering};

use base64::Engine as _;
use serde_json::{Map, Value, json};

use super::{lowercase_keys, refused};
use crate::error::ProxyError;

/// `options` with the same meaning on the engine, and the engine's name for each: OpenAI's
/// fields, and llama.cpp's extensions (vLLM and SGLang read `top_k` and `min_p` too).
const SAMPLING: &[(&str, &str)] = &[
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("typical_p", "typical_p"),
    ("seed", "seed"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("repeat_penalty", "repeat_penalty"),
    ("repeat_last_n", "repeat_last_n"),
    ("num_keep", "n_keep"),
];

/// `options` that set how a model is loaded: an engine loads its model once, at start, so
/// they cannot apply per request.
const LOAD_TIME: &[&str] = &[
    "num_ctx",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "num_thread",
    "use_mmap",
    "use_mlock",
    "numa",
    "low_vram",
    "f16_kv",
    "vocab_only",
    "logits_all",
    "num_gqa",
];

/// Whether the load-time options have been named in the log yet (once per process).
static LOAD_TIME_LOGGED: AtomicBool = AtomicBool::new(false);

/// The engine's request for a chat `request`, or `None` for a load call (no messages), which
/// needs no engine.
pub(super) fn request(
    request: &Map<String, Value>,
    model: &str,
    stream: bool,
) -> Result<Option<Map<String, Value>>, ProxyError> {
    let messages = match request.get("messages") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(messages)) if messages.is_empty() => return Ok(None),
        Some(Value::Array(messages)) => messages,
        Some(_) => return Err(refused("messages", "must be an array")),
    };
    let mut upstream = Map::new();
    upstream.insert("model".into(), json!(model));
    let messages = messages
        .iter()
        .enumerate()
        .map(|(index, message)| translate_message(index, message))
        .collect::<Result<Vec<_>, _>>()?;
    upstream.insert("messages".into(), Value::Array(messages));
    match request.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(tools)) if tools.is_empty() => {}
        // Ollama's tool definitions are OpenAI's.
        Some(Value::Array(tools)) => {
            upstream.insert("tools".into(), Value::Array(tools.clone()));
        }
        Some(_) => return Err(refused("tools", "must be an array")),
    }
    sampling(request, &mut upstream, stream)?;
    Ok(Some(upstream))
}

/// What chat and generate share: `format`, `think`, `options`, `stream`; `logprobs` is refused
/// (its answer is not translated back), `keep_alive`, `truncate` and `shift` are ignored (an
/// engine keeps its model loaded and never truncates).
pub(super) fn sampling(
    request: &Map<String, Value>,
    upstream: &mut Map<String, Value>,
    stream: bool,
) -> Result<(), ProxyError> {
    match request.get("format") {
        None | Some(Value::Null) => {}
        Some(Value::String(format)) if format.is_empty() => {}
        Some(Value::String(format)) if format == "json" => {
            upstream.insert("response_format".into(), json!({ "type": "json_object" }));
        }
        Some(Value::Object(schema)) => {
            upstream.insert(
                "response_format".into(),
                json!({
                    "type": "json_schema",
                    "json_schema": { "name": "schema", "schema": schema },
                }),
            );
        }
        Some(_) => return Err(refused("format", "must be \"json\" or a JSON schema")),
    }
    match request.get("think") {
        None | Some(Value::Null) => {}
        Some(Value::Bool(think)) => {
            upstream.insert(
                "chat_template_kwargs".into(),
                json!({ "enable_thinking": think }),
            );
        }
        Some(Value::String(effort)) if matches!(effort.as_str(), "low" | "medium" | "high") => {
            upstream.insert(
                "chat_template_kwargs".into(),
                json!({ "enable_thinking": true, "reasoning_effort": effort }),
            );
            upstream.insert("reasoning_effort".into(), json!(effort));
        }
        Some(_) => {
            return Err(refused(
                "think",
                "must be true, false, \"low\", \"medium\" or \"high\"",
            ));
        }
    }
    if request
        .get("logprobs")
        .is_some_and(|logprobs| *logprobs == Value::Bool(true))
    {
        return Err(refused("logprobs", "cannot be translated"));
    }
    match request.get("options") {
        None | Some(Value::Null) => {}
        Some(Value::Object(options)) => options_into(options, upstream)?,
        Some(_) => return Err(refused("options", "must be an object")),
    }
    upstream.insert("stream".into(), json!(stream));
    if stream {
        // The counts come in the stream's last chunk only when asked for.
        upstream.insert("stream_options".into(), json!({ "include_usage": true }));
    }
    Ok(())
}

/// `options` into the engine's sampling fields; `num_predict` → `max_tokens` (a negative one,
/// "no limit", is left out); the load-time options are named once in the log, and ignored.
fn options_into(
    options: &Map<String, Value>,
    upstream: &mut Map<String, Value>,
) -> Result<(), ProxyError> {
    let options = lowercase_keys(options.clone());
    for (ollama, engine) in SAMPLING {
        match options.get(*ollama) {
            None | Some(Value::Null) => {}
            Some(value @ Value::Number(_)) => {
                upstream.insert((*engine).into(), value.clone());
            }
            Some(_) => return Err(refused(&format!("options.{ollama}"), "must be a number")),
        }
    }
    match options.get("num_predict") {
        None | Some(Value::Null) => {}
        Some(Value::Number(number)) => {
            if let Some(limit) = number.as_i64().filter(|limit| *limit >= 0) {
                upstream.insert("max_tokens".into(), json!(limit));
            }
        }
        Some(_) => return Err(refused("options.num_predict", "must be a number")),
    }
    match options.get("stop") {
        None | Some(Value::Null) => {}
        Some(Value::String(stop)) => {
            upstream.insert("stop".into(), json!([stop]));
        }
        Some(Value::Array(stops)) if stops.iter().all(Value::is_string) => {
            upstream.insert("stop".into(), Value::Array(stops.clone()));
        }
        Some(_) => {
            return Err(refused(
                "options.stop",
                "must be a string or an array of strings",
            ));
        }
    }
    let load_time: Vec<&str> = LOAD_TIME
        .iter()
        .copied()
        .filter(|name| options.contains_key(*name))
        .collect();
    if !load_time.is_empty() && !LOAD_TIME_LOGGED.swap(true, Ordering::Relaxed) {
        tracing::info!(
            options = ?load_time,
            "options that set how a model is loaded do not apply to a host of kind openai \
             (its engine loads the model at start); ignored (logged once)"
        );
    }
    Ok(())
}

/// One Ollama message as OpenAI's.
fn translate_message(index: usize, message: &Value) -> Result<Value, ProxyError> {
    let field = |name: &str| format!("messages[{index}].{name}");
    let Some(message) = message.as_object() else {
        return Err(refused(&format!("messages[{index}]"), "must be an object"));
    };
    let message = lowercase_keys(message.clone());
    let role = match message.get("role") {
        Some(Value::String(role)) => role.to_ascii_lowercase(),
        _ => return Err(refused(&field("role"), "must be a string")),
    };
    let content = match message.get("content") {
        None | Some(Value::Null) => "",
        Some(Value::String(content)) => content.as_str(),
        Some(_) => return Err(refused(&field("content"), "must be a string")),
    };
    let mut out = Map::new();
    out.insert("role".into(), json!(role));
    match message.get("images") {
        Some(Value::Array(images)) if !images.is_empty() => {
            let mut parts = vec![json!({ "type": "text", "text": content })];
            for image in images {
                let Some(image) = image.as_str() else {
                    return Err(refused(&field("images"), "must be base64 strings"));
                };
                parts.push(json!({ "type": "image_url", "image_url": { "url": data_url(image) } }));
            }
            out.insert("content".into(), Value::Array(parts));
        }
        None | Some(Value::Null | Value::Array(_)) => {
            out.insert("content".into(), json!(content));
        }
        Some(_) => return Err(refused(&field("images"), "must be an array")),
    }
    match message.get("thinking") {
        Some(Value::String(thinking)) if !thinking.is_empty() => {
            out.insert("reasoning_content".into(), json!(thinking));
        }
        _ => {}
    }
    match message.get("tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) if calls.is_empty() => {}
        Some(Value::Array(calls)) => {
            let calls = calls
                .iter()
                .enumerate()
                .map(|(number, call)| tool_call(call, index, number))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    refused(
                        &field("tool_calls"),
                        "must be calls of a function with a name and object arguments",
                    )
                })?;
            out.insert("tool_calls".into(), Value::Array(calls));
        }
        Some(_) => return Err(refused(&field("tool_calls"), "must be an array")),
    }
    if let Some(Value::String(name)) = message.get("tool_name") {
        out.insert("name".into(), json!(name));
    }
    if let Some(Value::String(id)) = message.get("tool_call_id") {
        out.insert("tool_call_id".into(), json!(id));
    }
    Ok(Value::Object(out))
}

/// An Ollama tool call (`function.arguments` an object) as OpenAI's (a JSON string), with an
/// id made up from its place when it has none.
fn tool_call(call: &Value, message: usize, number: usize) -> Option<Value> {
    let function = call.get("function")?;
    let name = function.get("name")?.as_str()?;
    let arguments = match function.get("arguments") {
        None | Some(Value::Null) => "{}".to_owned(),
        Some(arguments @ Value::Object(_)) => arguments.to_string(),
        Some(_) => return None,
    };
    let id = call
        .get("id")
        .and_then(Value::as_str)
        .map_or_else(|| format!("call_{message}_{number}"), str::to_owned);
    Some(json!({
        "id": id,
        "type": "function",
        "function": { "name": name, "arguments": arguments },
    }))
}

/// A base64 image as a data URL, its type read from its first bytes (JPEG when unknown, as
/// Ollama assumes).
pub(super) fn data_url(image: &str) -> String {
    if image.starts_with("data:") {
        return image.to_owned();
    }
    let head = image.get(..16).unwrap_or(image);
    let mut bytes = [0_u8; 12];
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(head)
        .ok()
        .map(|decoded| {
            let n = decoded.len().min(bytes.len());
            bytes[..n].copy_from_slice(&decoded[..n]);
            n
        })
        .unwrap_or(0);
    let bytes = &bytes[..decoded];
    let mime = if bytes.starts_with(b"\x89PNG") {
        "image/png"
    } else if bytes.starts_with(b"GIF8") {
        "image/gif"
    } else if bytes.starts_with(b"RIFF") && bytes.get(8..12) == Some(b"WEBP") {
        "image/webp"
    } else {
        "image/jpeg"
    };
    format!("data:{mime};base64,{image}")
}
