//! `POST /api/generate` and `POST /api/chat` (reference §A.3.6, §A.3.7): Go-like validation in
//! Ollama's order, the load and unload idioms (empty prompt or `messages: []`, with
//! `keep_alive: 0` to unload), NDJSON streams by default and one joined object with
//! `stream: false`. Also the body-parsing helpers the other native endpoints share.

use bytes::Bytes;
use http::StatusCode;
use serde_json::{Map, Value, json};

use super::gojson::{DecodeError, GoType, KeepAlive, Shape, decode, keep_alive};
use super::models::Kind;
use super::record::lock;
use super::state::Ctx;
use super::stream::{
    Clock, Flavor, Reported, Script, admit, budget, metrics, refuse, serve, stream, tokens,
};
use super::wire::{NDJSON, Reply, gin_error, gin_json, rfc3339, token_count};

/// A handler's outcome; both sides are sent as they are.
pub(crate) type Handled = Result<Reply, Reply>;

const OPTIONS: GoType = GoType::Object("map[string]interface {}");

const GENERATE: Shape = Shape {
    name: "api.GenerateRequest",
    fields: &[
        ("model", GoType::Str),
        ("prompt", GoType::Str),
        ("suffix", GoType::Str),
        ("system", GoType::Str),
        ("template", GoType::Str),
        ("stream", GoType::Bool),
        ("raw", GoType::Bool),
        ("images", GoType::Slice("[]api.ImageData")),
        ("context", GoType::Slice("[]int")),
        ("options", OPTIONS),
        ("logprobs", GoType::Bool),
        ("top_logprobs", GoType::Int),
    ],
};

const CHAT: Shape = Shape {
    name: "api.ChatRequest",
    fields: &[
        ("model", GoType::Str),
        ("messages", GoType::Slice("[]api.Message")),
        ("tools", GoType::Slice("api.Tools")),
        ("stream", GoType::Bool),
        ("options", OPTIONS),
        ("logprobs", GoType::Bool),
        ("top_logprobs", GoType::Int),
    ],
};

/// `POST /api/generate`.
pub(crate) async fn generate(ctx: &mut Ctx, body: &[u8]) -> Handled {
    let (request, keep) = parse(body, &GENERATE, true)?;
    let model = text(&request, "model").to_owned();
    let has = |field: &str| {
        request
            .get(field)
            .is_some_and(|value| !value.is_null() && value != "")
    };
    if request.get("raw") == Some(&Value::Bool(true))
        && (has("template") || has("system") || has("context"))
    {
        return Err(bad_request(
            "raw mode does not support template, system, or context",
        ));
    }
    check_top_logprobs(&request)?;
    let kind = find(ctx, &model, || format!("model '{model}' not found"))?;
    let prompt = text(&request, "prompt");
    let no_images = request
        .get("images")
        .and_then(Value::as_array)
        .is_none_or(Vec::is_empty);
    let script = Native::new(
        false,
        &model,
        prompt_tokens(&request, false),
        ctx,
        request.get("options"),
    );
    if prompt.is_empty() && no_images && keep == Some(KeepAlive::Unload) {
        unload(ctx, &model);
        return Ok(gin_json(StatusCode::OK, &script.idiom("unload")));
    }
    if kind == Kind::Embedding {
        return Err(bad_request(&format!(
            "\"{model}\" does not support generate"
        )));
    }
    if prompt.is_empty() && no_images {
        load(ctx, &model, keep).await?;
        return Ok(gin_json(StatusCode::OK, &script.idiom("load")));
    }
    respond(ctx, &request, keep, script).await
}

/// `POST /api/chat`.
pub(crate) async fn chat(ctx: &mut Ctx, body: &[u8]) -> Handled {
    let (request, keep) = parse(body, &CHAT, true)?;
    let model = text(&request, "model").to_owned();
    if model.is_empty() {
        return Err(bad_request("model is required"));
    }
    check_top_logprobs(&request)?;
    let kind = find(ctx, &model, || format!("model '{model}' not found"))?;
    let no_messages = request
        .get("messages")
        .and_then(Value::as_array)
        .is_none_or(Vec::is_empty);
    let script = Native::new(
        true,
        &model,
        prompt_tokens(&request, true),
        ctx,
        request.get("options"),
    );
    if no_messages && keep == Some(KeepAlive::Unload) {
        unload(ctx, &model);
        return Ok(gin_json(StatusCode::OK, &script.idiom("unload")));
    }
    if kind == Kind::Embedding {
        return Err(bad_request(&format!("\"{model}\" does not support chat")));
    }
    if no_messages {
        load(ctx, &model, keep).await?;
        return Ok(gin_json(StatusCode::OK, &script.idiom("load")));
    }
    respond(ctx, &request, keep, script).await
}

/// Decodes a native request body; errors are gin 400s with Go's texts.
pub(crate) fn parse(
    body: &[u8],
    shape: &Shape,
    with_keep_alive: bool,
) -> Result<(Map<String, Value>, Option<KeepAlive>), Reply> {
    let request = decode(body, shape).map_err(|error| match error {
        DecodeError::Empty => bad_request("missing request body"),
        DecodeError::Invalid(message) => bad_request(&message),
    })?;
    let keep = if with_keep_alive {
        keep_alive(request.get("keep_alive")).map_err(|message| bad_request(&message))?
    } else {
        None
    };
    Ok((request, keep))
}

/// A string field, or "" when absent or not a string.
pub(crate) fn text<'a>(request: &'a Map<String, Value>, field: &str) -> &'a str {
    request.get(field).and_then(Value::as_str).unwrap_or("")
}

/// A gin 400.
pub(crate) fn bad_request(message: &str) -> Reply {
    gin_error(StatusCode::BAD_REQUEST, message)
}

/// The kind of the installed model `name`, or a 404 with `not_found`'s text.
pub(crate) fn find(
    ctx: &Ctx,
    name: &str,
    not_found: impl FnOnce() -> String,
) -> Result<Kind, Reply> {
    lock(&ctx.shared.models)
        .find(name)
        .map(|model| model.kind)
        .ok_or_else(|| gin_error(StatusCode::NOT_FOUND, &not_found()))
}

// The load idiom: in VRAM mode the model is scheduled like any request (queue, eviction, load
// time) and released at once; no slot is taken.
async fn load(ctx: &Ctx, model: &str, keep: Option<KeepAlive>) -> Result<(), Reply> {
    lock(&ctx.shared.models).touch(model, keep);
    if let Some(vram) = &ctx.shared.vram {
        let flavor = Flavor::Native { streaming: false };
        vram.acquire(model, keep)
            .await
            .map_err(|refused| refuse(flavor, &refused))?;
    }
    Ok(())
}

// The unload idiom answers at once; in VRAM mode the model goes once its requests finish.
fn unload(ctx: &Ctx, model: &str) {
    lock(&ctx.shared.models).touch(model, Some(KeepAlive::Unload));
    if let Some(vram) = &ctx.shared.vram {
        vram.unload(model);
    }
    if let Some(runners) = &ctx.shared.runners {
        runners.unload(&super::models::canonical(model));
    }
}

fn check_top_logprobs(request: &Map<String, Value>) -> Result<(), Reply> {
    match request.get("top_logprobs").and_then(Value::as_i64) {
        Some(n) if !(0..=20).contains(&n) => {
            Err(bad_request("top_logprobs must be between 0 and 20"))
        }
        _ => Ok(()),
    }
}

fn prompt_tokens(request: &Map<String, Value>, chat: bool) -> usize {
    if !chat {
        return token_count(&format!(
            "{} {}",
            text(request, "system"),
            text(request, "prompt")
        ));
    }
    let messages = request.get("messages").and_then(Value::as_array);
    let words: String = messages
        .into_iter()
        .flatten()
        .filter_map(|message| message.get("content").and_then(Value::as_str))
        .collect::<Vec<_>>()
        .join(" ");
    token_count(&words)
}

async fn respond(
    ctx: &mut Ctx,
    request: &Map<String, Value>,
    keep: Option<KeepAlive>,
    script: Native,
) -> Handled {
    let streaming = request
        .get("stream")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    ctx.prompt = Some(super::prompt::native(request, script.chat));
    let admitted = admit(ctx, Flavor::Native { streaming }, &script.model, keep).await?;
    lock(&ctx.shared.models).touch(&script.model, keep);
    if streaming {
        return Ok(stream(ctx, admitted, NDJSON, script).await);
    }
    let clock = serve(ctx, admitted).await?;
    let joined = script.tokens.concat();
    Ok(gin_json(StatusCode::OK, &script.last(&joined, &clock)))
}

/// The lines of a native generation: one per content chunk, then the `done` object.
struct Native {
    chat: bool,
    model: String,
    tokens: Vec<String>,
    prompt_tokens: usize,
    done_reason: &'static str,
    reported: Reported,
}

impl Native {
    fn new(
        chat: bool,
        model: &str,
        prompt_tokens: usize,
        ctx: &Ctx,
        options: Option<&Value>,
    ) -> Self {
        let limit = options.and_then(|options| options.get("num_predict"));
        let (count, cut) = budget(ctx.shared.timing().tokens, limit);
        Self {
            chat,
            model: model.to_owned(),
            tokens: tokens(count),
            prompt_tokens,
            done_reason: if cut { "length" } else { "stop" },
            reported: ctx.reported,
        }
    }

    // model, created_at and the text field, in Go's field order.
    fn head(&self, content: &str) -> Map<String, Value> {
        let mut object = Map::new();
        object.insert("model".into(), json!(self.model));
        object.insert(
            "created_at".into(),
            json!(rfc3339(std::time::SystemTime::now())),
        );
        if self.chat {
            object.insert(
                "message".into(),
                json!({ "role": "assistant", "content": content }),
            );
        } else {
            object.insert("response".into(), json!(content));
        }
        object
    }

    /// The reply to a load or unload call.
    fn idiom(&self, reason: &str) -> Value {
        let mut object = self.head("");
        object.insert("done".into(), json!(true));
        object.insert("done_reason".into(), json!(reason));
        Value::Object(object)
    }

    /// The final object, carrying `content` (empty when streamed) and the metrics.
    fn last(&self, content: &str, clock: &Clock) -> Value {
        let mut object = self.head(content);
        object.insert("done".into(), json!(true));
        object.insert("done_reason".into(), json!(self.done_reason));
        if !self.chat {
            let context: Vec<u64> = (0..(self.prompt_tokens + self.tokens.len()) as u64)
                .map(|i| 128_000 + i)
                .collect();
            object.insert("context".into(), json!(context));
        }
        object.extend(metrics(
            clock,
            &self.reported,
            self.prompt_tokens,
            self.tokens.len(),
        ));
        Value::Object(object)
    }
}

impl Script for Native {
    fn lines(&self) -> usize {
        self.tokens.len() + 1
    }

    fn paced(&self, _line: usize) -> bool {
        true
    }

    fn error_line(&self, message: &str) -> Option<Bytes> {
        Some(Bytes::from(format!("{}\n", json!({ "error": message }))))
    }

    fn render(&mut self, line: usize, clock: &Clock) -> Bytes {
        let value = match self.tokens.get(line) {
            Some(token) => {
                let mut object = self.head(token);
                object.insert("done".into(), json!(false));
                Value::Object(object)
            }
            None => self.last("", clock),
        };
        Bytes::from(format!("{value}\n"))
    }
}
