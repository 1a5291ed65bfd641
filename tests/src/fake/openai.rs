//! The OpenAI-compatible layer (reference §A.8): `/v1/chat/completions` and `/v1/completions` as
//! JSON, or as SSE with `stream: true` (role chunk, content chunks, finish chunk, optional usage
//! chunk, `data: [DONE]`); `/v1/embeddings` as floats or base64 little-endian f32; `/v1/models`
//! (`data: null` when empty). Errors use the OpenAI error object.

use std::time::SystemTime;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use http::StatusCode;
use serde_json::{Map, Value, json};

use super::embed::{embedding, f32_value};
use super::gojson::{DecodeError, GoType, Shape, decode};
use super::models::{Kind, openai_entry, with_tag};
use super::native::{Handled, text};
use super::record::lock;
use super::state::Ctx;
use super::stream::{Clock, Flavor, Reported, Script, admit, budget, serve, stream, tokens};
use super::wire::{EVENT_STREAM, Reply, openai_error, openai_json, token_count, unix_seconds};

const CHAT: Shape = Shape {
    name: "openai.ChatCompletionRequest",
    fields: &[
        ("model", GoType::Str),
        ("messages", GoType::Slice("[]openai.Message")),
        ("stream", GoType::Bool),
        ("stream_options", GoType::Object("*openai.StreamOptions")),
        ("max_tokens", GoType::Int),
        ("temperature", GoType::Float),
        ("top_p", GoType::Float),
    ],
};

const COMPLETION: Shape = Shape {
    name: "openai.CompletionRequest",
    fields: &[
        ("model", GoType::Str),
        ("prompt", GoType::Str),
        ("stream", GoType::Bool),
        ("stream_options", GoType::Object("*openai.StreamOptions")),
        ("max_tokens", GoType::Int),
        ("temperature", GoType::Float),
        ("top_p", GoType::Float),
    ],
};

const EMBEDDING: Shape = Shape {
    name: "openai.EmbedRequest",
    fields: &[
        ("model", GoType::Str),
        ("encoding_format", GoType::Str),
        ("dimensions", GoType::Int),
    ],
};

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(ctx: &mut Ctx, body: &[u8]) -> Handled {
    let request = parse(body, &CHAT)?;
    let messages = request.get("messages").and_then(Value::as_array);
    if messages.is_none_or(Vec::is_empty) {
        return Err(bad_request("[] is too short - 'messages'"));
    }
    let words: Vec<&str> = messages
        .into_iter()
        .flatten()
        .filter_map(|message| message.get("content").and_then(Value::as_str))
        .collect();
    generate(ctx, &request, true, token_count(&words.join(" "))).await
}

/// `POST /v1/completions`.
pub(crate) async fn completions(ctx: &mut Ctx, body: &[u8]) -> Handled {
    let request = parse(body, &COMPLETION)?;
    let prompt_tokens = token_count(text(&request, "prompt"));
    generate(ctx, &request, false, prompt_tokens).await
}

/// `POST /v1/embeddings`.
pub(crate) async fn embeddings(ctx: &mut Ctx, body: &[u8]) -> Handled {
    let request = parse(body, &EMBEDDING)?;
    let inputs: Vec<String> = match request.get("input") {
        Some(Value::String(input)) => vec![input.clone()],
        Some(Value::Array(items)) if !items.is_empty() => items
            .iter()
            .map(|item| item.as_str().map(str::to_owned))
            .collect::<Option<_>>()
            .ok_or_else(|| bad_request("invalid input"))?,
        _ => return Err(bad_request("invalid input")),
    };
    let base64 = match text(&request, "encoding_format").to_lowercase().as_str() {
        "" | "float" => false,
        "base64" => true,
        other => {
            let message = format!(
                "invalid encoding_format {other:?}: supported values are \"float\" and \"base64\""
            );
            return Err(bad_request(&message));
        }
    };
    let model = text(&request, "model").to_owned();
    if model.is_empty() {
        return Err(openai_error(StatusCode::NOT_FOUND, "model '' not found"));
    }
    find(ctx, &model, || {
        format!("model \"{model}\" not found, try pulling it first")
    })?;
    let admitted = admit(ctx, Flavor::OpenAi, &model, None).await?;
    lock(&ctx.shared.models).touch(&model, None);
    serve(ctx, admitted).await?;
    let dimensions = request
        .get("dimensions")
        .and_then(Value::as_u64)
        .map(|n| n as usize);
    let size = ctx.shared.embedding_dimension;
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, input)| {
            let vector = embedding(input, size, dimensions);
            let encoded = if base64 {
                let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::from(STANDARD.encode(bytes))
            } else {
                Value::from(vector.into_iter().map(f32_value).collect::<Vec<_>>())
            };
            json!({ "object": "embedding", "embedding": encoded, "index": index })
        })
        .collect();
    let prompt_tokens: usize = inputs.iter().map(|input| token_count(input)).sum();
    let prompt_tokens = ctx.reported.prompt(prompt_tokens);
    let body = json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": { "prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens },
    });
    Ok(openai_json(StatusCode::OK, &body))
}

/// `GET /v1/models`.
pub(crate) fn models(ctx: &Ctx) -> Reply {
    openai_json(StatusCode::OK, &lock(&ctx.shared.models).openai_list())
}

/// `GET /v1/models/{model}`.
pub(crate) fn model(ctx: &Ctx, id: &str) -> Reply {
    match lock(&ctx.shared.models).find(id) {
        Some(model) => openai_json(StatusCode::OK, &openai_entry(id, model)),
        None => openai_error(
            StatusCode::NOT_FOUND,
            &format!("model '{}' not found", with_tag(id)),
        ),
    }
}

fn parse(body: &[u8], shape: &Shape) -> Result<Map<String, Value>, Reply> {
    decode(body, shape).map_err(|error| match error {
        // The middleware does not special-case an empty body: Go's io.EOF text.
        DecodeError::Empty => bad_request("EOF"),
        DecodeError::Invalid(message) => bad_request(&message),
    })
}

fn bad_request(message: &str) -> Reply {
    openai_error(StatusCode::BAD_REQUEST, message)
}

fn find(ctx: &Ctx, name: &str, not_found: impl FnOnce() -> String) -> Result<Kind, Reply> {
    lock(&ctx.shared.models)
        .find(name)
        .map(|model| model.kind)
        .ok_or_else(|| openai_error(StatusCode::NOT_FOUND, &not_found()))
}

async fn generate(
    ctx: &mut Ctx,
    request: &Map<String, Value>,
    chat: bool,
    prompt_tokens: usize,
) -> Handled {
    let model = text(request, "model").to_owned();
    if model.is_empty() {
        return Err(bad_request("model is required"));
    }
    if find(ctx, &model, || format!("model '{model}' not found"))? == Kind::Embedding {
        let verb = if chat { "chat" } else { "generate" };
        return Err(bad_request(&format!("\"{model}\" does not support {verb}")));
    }
    let streaming = request.get("stream") == Some(&Value::Bool(true));
    let include_usage = request
        .get("stream_options")
        .and_then(|options| options.get("include_usage"))
        == Some(&Value::Bool(true));
    ctx.prompt = Some(super::prompt::openai(request, chat));
    let admitted = admit(ctx, Flavor::OpenAi, &model, None).await?;
    lock(&ctx.shared.models).touch(&model, None);
    let (count, cut) = budget(ctx.shared.timing().tokens, request.get("max_tokens"));
    let prefix = if chat { "chatcmpl" } else { "cmpl" };
    let script = Sse {
        chat,
        id: format!("{prefix}-{}", rand::random_range(0..999)),
        created: unix_seconds(SystemTime::now()),
        model,
        tokens: tokens(count),
        finish_reason: if cut { "length" } else { "stop" },
        prompt_tokens: ctx.reported.prompt(prompt_tokens),
        include_usage,
        reported: ctx.reported,
        stamp: ctx.shared.timing().stamp_tokens,
    };
    if streaming {
        return Ok(stream(ctx, admitted, EVENT_STREAM, script).await);
    }
    serve(ctx, admitted).await?;
    Ok(openai_json(StatusCode::OK, &script.whole()))
}

/// An OpenAI generation, whole or as SSE frames. Chat frames: role, one per token, finish,
/// [usage], `[DONE]`. Completion frames: one per token, finish, [usage], `[DONE]`.
struct Sse {
    chat: bool,
    id: String,
    created: u64,
    model: String,
    tokens: Vec<String>,
    finish_reason: &'static str,
    prompt_tokens: usize,
    include_usage: bool,
    reported: Reported,
    /// Tokens end in `@<Unix nanoseconds>` of the moment the frame is made.
    stamp: bool,
}

impl Sse {
    fn usage(&self) -> Value {
        let completion = self.reported.completion(self.tokens.len());
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        })
    }

    fn envelope(&self, object: &str, choices: Value) -> Map<String, Value> {
        let mut envelope = Map::new();
        envelope.insert("id".into(), json!(self.id));
        envelope.insert("object".into(), json!(object));
        envelope.insert("created".into(), json!(self.created));
        envelope.insert("model".into(), json!(self.model));
        envelope.insert("system_fingerprint".into(), json!("fp_ollama"));
        envelope.insert("choices".into(), choices);
        envelope
    }

    fn whole(&self) -> Value {
        let content = self.tokens.concat();
        let (object, choice) = if self.chat {
            let message = json!({ "role": "assistant", "content": content });
            (
                "chat.completion",
                json!({ "index": 0, "message": message, "finish_reason": self.finish_reason }),
            )
        } else {
            (
                "text_completion",
                json!({ "text": content, "index": 0, "finish_reason": self.finish_reason }),
            )
        };
        let mut whole = self.envelope(object, json!([choice]));
        whole.insert("usage".into(), self.usage());
        Value::Object(whole)
    }

    // The frames before the usage frame.
    fn body_frames(&self) -> usize {
        self.tokens.len() + if self.chat { 2 } else { 1 }
    }

    fn frame(&self, line: usize) -> Value {
        let first_token = usize::from(self.chat);
        if line == self.body_frames() {
            let mut usage = self.envelope(self.chunk_object(), json!([]));
            usage.insert("usage".into(), self.usage());
            return Value::Object(usage);
        }
        let finish = line + 1 == self.body_frames();
        let token = if finish {
            ""
        } else {
            self.tokens
                .get(line.wrapping_sub(first_token))
                .map_or("", String::as_str)
        };
        let stamped;
        let token = if self.stamp && !token.is_empty() {
            let nanos = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |since| since.as_nanos());
            stamped = format!("{token}@{nanos}");
            stamped.as_str()
        } else {
            token
        };
        let finish_reason = if finish {
            json!(self.finish_reason)
        } else {
            Value::Null
        };
        let choice = if !self.chat {
            json!({ "text": token, "index": 0, "finish_reason": finish_reason })
        } else if line == 0 {
            json!({ "index": 0, "delta": { "role": "assistant", "content": "" }, "finish_reason": null })
        } else if finish {
            json!({ "index": 0, "delta": {}, "finish_reason": finish_reason })
        } else {
            json!({ "index": 0, "delta": { "content": token }, "finish_reason": null })
        };
        let mut chunk = self.envelope(self.chunk_object(), json!([choice]));
        if !self.chat && self.include_usage {
            chunk.insert(
                "usage".into(),
                json!({ "prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0 }),
            );
        }
        Value::Object(chunk)
    }

    fn chunk_object(&self) -> &'static str {
        if self.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        }
    }
}

impl Script for Sse {
    fn lines(&self) -> usize {
        self.body_frames() + usize::from(self.include_usage) + 1
    }

    fn paced(&self, line: usize) -> bool {
        let first_token = usize::from(self.chat);
        line > first_token && line < self.body_frames()
    }

    // Ollama's /v1 layer swallows a mid-stream error: the stream ends without `[DONE]`.
    fn error_line(&self, _message: &str) -> Option<Bytes> {
        None
    }

    fn render(&mut self, line: usize, _clock: &Clock) -> Bytes {
        if line + 1 == self.lines() {
            return Bytes::from_static(b"data: [DONE]\n\n");
        }
        Bytes::from(format!("data: {}\n\n", self.frame(line)))
    }
}
