//! The agents' layers (reference: agents-and-runners §1–2): the Anthropic Messages API
//! (`/v1/messages`) and the OpenAI Responses API (`/v1/responses`), as JSON or as SSE with
//! `stream: true`. Messages streams `message_start` (with `usage.input_tokens`),
//! `content_block_start`, one `content_block_delta` per token, `content_block_stop`,
//! `message_delta` (with `usage.output_tokens`) and `message_stop`; Responses streams
//! `response.created`, `response.in_progress`, one `response.output_text.delta` per token,
//! `response.output_text.done` and `response.completed` (with `response.usage`), every event
//! with its `type` and `sequence_number`. Errors use each API's own error object.

use bytes::Bytes;
use http::StatusCode;
use serde_json::{Map, Value, json};

use super::models::Kind;
use super::native::{Handled, text};
use super::record::lock;
use super::state::Ctx;
use super::stream::{Clock, Flavor, Reported, Script, admit, budget, serve, stream, tokens};
use super::wire::{EVENT_STREAM, Reply, full, openai_error, openai_json, token_count};

/// Which of the two layers a generation answers in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Messages,
    Responses,
}

/// `POST /v1/messages`.
pub(crate) async fn messages(ctx: &mut Ctx, body: &[u8]) -> Handled {
    let request = parse(body, Api::Messages)?;
    let mut words: Vec<String> = Vec::new();
    if let Some(system) = request.get("system").and_then(Value::as_str) {
        words.push(system.to_owned());
    }
    match request.get("messages").and_then(Value::as_array) {
        Some(messages) if !messages.is_empty() => {
            words.extend(
                messages
                    .iter()
                    .map(|message| content_text(message.get("content"))),
            );
        }
        _ => {
            return Err(error(
                Api::Messages,
                StatusCode::BAD_REQUEST,
                "messages is required",
            ));
        }
    }
    generate(ctx, &request, Api::Messages, token_count(&words.join(" "))).await
}

/// `POST /v1/responses`.
pub(crate) async fn responses(ctx: &mut Ctx, body: &[u8]) -> Handled {
    let request = parse(body, Api::Responses)?;
    let input = match request.get("input") {
        Some(Value::String(input)) => input.clone(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| content_text(item.get("content")))
            .collect::<Vec<_>>()
            .join(" "),
        _ => {
            return Err(error(
                Api::Responses,
                StatusCode::BAD_REQUEST,
                "input is required",
            ));
        }
    };
    let instructions = text(&request, "instructions");
    let prompt = format!("{instructions} {input}");
    generate(ctx, &request, Api::Responses, token_count(&prompt)).await
}

/// The text of a message's content: a string, or the `text` of its blocks.
fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .filter_map(|block| block.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

fn parse(body: &[u8], api: Api) -> Result<Map<String, Value>, Reply> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(error(api, StatusCode::BAD_REQUEST, "invalid request body")),
        Err(parse) => Err(error(api, StatusCode::BAD_REQUEST, &parse.to_string())),
    }
}

/// The layer's own error object: Anthropic's `{"type":"error","error":{…}}` or OpenAI's.
fn error(api: Api, status: StatusCode, message: &str) -> Reply {
    match api {
        Api::Responses => openai_error(status, message),
        Api::Messages => {
            let kind = match status.as_u16() {
                400 => "invalid_request_error",
                401 => "authentication_error",
                403 => "permission_error",
                404 => "not_found_error",
                429 => "rate_limit_error",
                _ => "api_error",
            };
            let body = json!({ "type": "error", "error": { "type": kind, "message": message } });
            full(status, Some("application/json"), body.to_string())
        }
    }
}

async fn generate(
    ctx: &mut Ctx,
    request: &Map<String, Value>,
    api: Api,
    prompt_tokens: usize,
) -> Handled {
    let model = text(request, "model").to_owned();
    if model.is_empty() {
        return Err(error(api, StatusCode::BAD_REQUEST, "model is required"));
    }
    let kind = lock(&ctx.shared.models)
        .find(&model)
        .map(|found| found.kind);
    match kind {
        None => {
            let message = format!("model '{model}' not found");
            return Err(error(api, StatusCode::NOT_FOUND, &message));
        }
        Some(Kind::Embedding) => {
            let message = format!("\"{model}\" does not support chat");
            return Err(error(api, StatusCode::BAD_REQUEST, &message));
        }
        Some(_) => {}
    }
    let streaming = request.get("stream") == Some(&Value::Bool(true));
    ctx.prompt = Some(super::prompt::agents(request, api == Api::Responses));
    let admitted = admit(ctx, Flavor::OpenAi, &model, None).await?;
    lock(&ctx.shared.models).touch(&model, None);
    let limit = match api {
        Api::Messages => request.get("max_tokens"),
        Api::Responses => request.get("max_output_tokens"),
    };
    let (count, cut) = budget(ctx.shared.timing().tokens, limit);
    let script = Events {
        api,
        id: format!("{}{}", api.id_prefix(), rand::random_range(0..99_999)),
        model,
        tokens: tokens(count),
        cut,
        prompt_tokens: ctx.reported.prompt(prompt_tokens),
        reported: ctx.reported,
    };
    if streaming {
        return Ok(stream(ctx, admitted, EVENT_STREAM, script).await);
    }
    serve(ctx, admitted).await?;
    Ok(openai_json(StatusCode::OK, &script.whole()))
}

impl Api {
    fn id_prefix(self) -> &'static str {
        match self {
            Self::Messages => "msg_",
            Self::Responses => "resp_",
        }
    }
}

/// One generation in either layer, whole or as its SSE events.
struct Events {
    api: Api,
    id: String,
    model: String,
    tokens: Vec<String>,
    cut: bool,
    prompt_tokens: usize,
    reported: Reported,
}

impl Events {
    fn output_tokens(&self) -> usize {
        self.reported.completion(self.tokens.len())
    }

    fn message(&self, content: Value, output_tokens: usize, stop: Value) -> Value {
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": stop, "stop_sequence": null,
            "usage": { "input_tokens": self.prompt_tokens, "output_tokens": output_tokens },
        })
    }

    fn stop_reason(&self) -> &'static str {
        if self.cut { "max_tokens" } else { "end_turn" }
    }

    fn response(&self, status: &str, output: Value, usage: Value) -> Value {
        json!({
            "id": self.id, "object": "response", "created_at": 0, "status": status,
            "model": self.model, "output": output, "usage": usage,
        })
    }

    fn output(&self) -> Value {
        json!([{
            "id": format!("msg_{}", self.id), "type": "message", "status": "completed",
            "role": "assistant",
            "content": [{ "type": "output_text", "text": self.tokens.concat(), "annotations": [] }],
        }])
    }

    fn usage(&self) -> Value {
        let output = self.output_tokens();
        json!({
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": { "cached_tokens": 0 },
            "output_tokens": output,
            "output_tokens_details": { "reasoning_tokens": 0 },
            "total_tokens": self.prompt_tokens + output,
        })
    }

    fn whole(&self) -> Value {
        match self.api {
            Api::Messages => {
                let content = json!([{ "type": "text", "text": self.tokens.concat() }]);
                self.message(content, self.output_tokens(), json!(self.stop_reason()))
            }
            Api::Responses => self.response("completed", self.output(), self.usage()),
        }
    }

    // Events before the per-token deltas.
    fn opening(&self) -> usize {
        2
    }

    fn event(&self, line: usize) -> (&'static str, Value) {
        let tokens = self.tokens.len();
        let delta = |token: &str| match self.api {
            Api::Messages => json!({
                "type": "content_block_delta", "index": 0,
                "delta": { "type": "text_delta", "text": token },
            }),
            Api::Responses => json!({
                "type": "response.output_text.delta", "item_id": format!("msg_{}", self.id),
                "output_index": 0, "content_index": 0, "delta": token,
            }),
        };
        if line >= self.opening() && line < self.opening() + tokens {
            let token = self.tokens[line - self.opening()].as_str();
            let name = match self.api {
                Api::Messages => "content_block_delta",
                Api::Responses => "response.output_text.delta",
            };
            return (name, delta(token));
        }
        let after = line.saturating_sub(self.opening() + tokens);
        match (self.api, line, after) {
            (Api::Messages, 0, _) => (
                "message_start",
                json!({ "type": "message_start", "message": self.message(json!([]), 0, Value::Null) }),
            ),
            (Api::Messages, 1, _) => (
                "content_block_start",
                json!({ "type": "content_block_start", "index": 0,
                        "content_block": { "type": "text", "text": "" } }),
            ),
            (Api::Messages, _, 0) => (
                "content_block_stop",
                json!({ "type": "content_block_stop", "index": 0 }),
            ),
            (Api::Messages, _, 1) => (
                "message_delta",
                json!({ "type": "message_delta",
                        "delta": { "stop_reason": self.stop_reason(), "stop_sequence": null },
                        "usage": { "output_tokens": self.output_tokens() } }),
            ),
            (Api::Messages, _, _) => ("message_stop", json!({ "type": "message_stop" })),
            (Api::Responses, 0, _) => (
                "response.created",
                json!({ "type": "response.created",
                        "response": self.response("in_progress", json!([]), Value::Null) }),
            ),
            (Api::Responses, 1, _) => (
                "response.in_progress",
                json!({ "type": "response.in_progress",
                        "response": self.response("in_progress", json!([]), Value::Null) }),
            ),
            (Api::Responses, _, 0) => (
                "response.output_text.done",
                json!({ "type": "response.output_text.done", "item_id": format!("msg_{}", self.id),
                        "output_index": 0, "content_index": 0, "text": self.tokens.concat() }),
            ),
            (Api::Responses, _, _) => (
                "response.completed",
                json!({ "type": "response.completed",
                        "response": self.response("completed", self.output(), self.usage()) }),
            ),
        }
    }
}

impl Script for Events {
    fn lines(&self) -> usize {
        let closing = match self.api {
            Api::Messages => 3,
            Api::Responses => 2,
        };
        self.opening() + self.tokens.len() + closing
    }

    fn paced(&self, line: usize) -> bool {
        line > self.opening() && line < self.opening() + self.tokens.len()
    }

    // Ollama's compatibility layers end a failed stream with the layer's error event.
    fn error_line(&self, message: &str) -> Option<Bytes> {
        let line = match self.api {
            Api::Messages => {
                let error = json!({ "type": "error",
                                    "error": { "type": "api_error", "message": message } });
                format!("event: error\ndata: {error}\n\n")
            }
            Api::Responses => {
                let error = json!({ "type": "error", "code": null, "message": message });
                format!("event: error\ndata: {error}\n\n")
            }
        };
        Some(Bytes::from(line))
    }

    fn render(&mut self, line: usize, _clock: &Clock) -> Bytes {
        let (name, mut data) = self.event(line);
        if self.api == Api::Responses
            && let Value::Object(map) = &mut data
        {
            map.insert("sequence_number".into(), json!(line));
        }
        Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
    }
}
