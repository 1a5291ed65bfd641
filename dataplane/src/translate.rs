//! Ollama's own API in front of OpenAI-compatible engines (hosts of `kind: openai`:
//! llama-server, llama-swap, vLLM…), in both directions, streaming included.
//!
//! A request on an Ollama-native inference route (`/api/chat`, `/api/generate`,
//! `/api/embed`, `/api/embeddings`) whose model only `openai` hosts serve is rewritten here
//! into the engine's API (`chat` for `/api/chat`, `generate` for `/api/generate`,
//! `embed` for both embedding routes), then queued, routed, budgeted and accounted exactly as
//! the same request sent to `/v1/*` would be; its answer is rewritten back into Ollama's shapes
//! by a body wrapper (`stream`): SSE in, NDJSON out, line by line. What has no
//! equivalent is refused with a 400 naming the field. A model no host serves, on a fleet of
//! engines only, is Ollama's 404.
//!
//! The metadata routes (`/api/tags`, `/api/ps`, `/api/show`, `/api/version`) are answered for
//! these hosts from what the control plane learned of them (`inventory`).
//!
//! Everything here is pure (no I/O): the request path calls [`plan`] once, where it would
//! otherwise send the native request, and wraps the answer with [`response`].

mod chat;
mod embed;
mod generate;
mod inventory;
mod stream;

use std::time::Instant;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use serde_json::{Map, Value, json};

use crate::body::{self, Body};
use crate::endpoint::Inference;
use crate::error::ProxyError;
use crate::policy::{HostKind, Policy, normalize_model};

pub use inventory::{listing_entries, show, version};

/// The version `/api/version` reports when no Ollama host answers it: a plain `x.y.z`, as
/// clients gate features on it.
pub const OLLAMA_VERSION: &str = "0.12.0";

/// An Ollama-native inference route that can be translated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `/api/chat` → `/v1/chat/completions`.
    Chat,
    /// `/api/generate` → `/v1/chat/completions` (or `/v1/completions` with `raw`, or
    /// llama-server's `/infill` with a `suffix`).
    Generate,
    /// `/api/embed` → `/v1/embeddings`.
    Embed,
    /// `/api/embeddings` (legacy, one prompt) → `/v1/embeddings`.
    Embeddings,
}

impl Route {
    /// The route of a native inference request, if it is one that is translated.
    pub fn of(inference: Inference) -> Option<Self> {
        match inference {
            Inference::Chat => Some(Self::Chat),
            Inference::Generate => Some(Self::Generate),
            Inference::Embed => Some(Self::Embed),
            Inference::Embeddings => Some(Self::Embeddings),
            _ => None,
        }
    }
}

/// What to do with a translated request.
#[derive(Debug)]
pub enum Plan {
    /// Answer at once, without an engine (a load or unload call, an empty embedding input).
    Answer(Response<Body>),
    /// Send this to the engine.
    Send(Translated),
}

/// A request rewritten for an OpenAI-compatible engine.
#[derive(Debug)]
pub struct Translated {
    /// The engine's route.
    pub path: http::uri::PathAndQuery,
    /// The engine's request body.
    pub body: Bytes,
    /// The class of the engine's route, for accounting and affinity.
    pub inference: Inference,
    /// How its answer becomes Ollama's.
    pub reply: Reply,
}

/// How an engine's answer becomes the answer Ollama would give.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Which answer shape.
    pub shape: Shape,
    /// The model as the client named it: echoed in every answer.
    pub model: String,
    /// Whether the client asked for a stream (Ollama's default).
    pub stream: bool,
    /// When oqp read the request: `total_duration` counts from here.
    pub received: Instant,
}

/// The Ollama answer shape a [`Reply`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// `/api/chat`: `message`.
    Chat,
    /// `/api/generate`: `response`; from `/v1/completions` when `completions`.
    Generate {
        /// The engine answers `choices[].text` (raw prompts), not chat messages.
        completions: bool,
    },
    /// `/api/generate` with a `suffix`: `response`, from llama-server's `/infill` (its own
    /// completion shape: `content`, `stop`, `tokens_evaluated`, `tokens_predicted`, `timings`).
    Infill,
    /// `/api/embed`: `embeddings`, L2-normalised, cut to `dimensions` when asked.
    Embed {
        /// `dimensions` asked for.
        dimensions: Option<usize>,
    },
    /// `/api/embeddings`: one `embedding`.
    Embeddings,
}

/// Whether `model` is served by hosts and by `openai` hosts only (this node's and the other
/// nodes'): then its native requests are translated. A model an Ollama host also serves is
/// left to Ollama's own API.
pub fn serves_only_openai(policy: &Policy, model: &str) -> bool {
    let name = normalize_model(model);
    let mut served = false;
    for host in policy.hosts.iter().chain(&policy.remote) {
        if host.installed.contains(&name) {
            if host.kind != HostKind::Openai {
                return false;
            }
            served = true;
        }
    }
    served
}

/// Whether every host (this node's and the other nodes') that serves `model` is a
/// llama-server, which has `/infill`: then a generate with a `suffix` is translated.
pub fn serves_infill(policy: &Policy, model: &str) -> bool {
    let name = normalize_model(model);
    let mut hosts = policy
        .hosts
        .iter()
        .chain(&policy.remote)
        .filter(|host| host.installed.contains(&name))
        .peekable();
    hosts.peek().is_some()
        && hosts.all(|host| host.engine.detected.as_deref() == Some("llama-server"))
}

/// Whether every host is an `openai` one and none serves `model`: then no host would answer
/// Ollama's "not found", and oqp does.
pub fn served_by_none(policy: &Policy, model: &str) -> bool {
    let name = normalize_model(model);
    let mut hosts = policy.hosts.iter().chain(&policy.remote).peekable();
    hosts.peek().is_some()
        && hosts.all(|host| host.kind == HostKind::Openai && !host.installed.contains(&name))
}

/// Ollama's 404 for a model no host serves, in the route's wording.
pub fn not_found(route: Route, model: &str) -> ProxyError {
    let message = match route {
        Route::Embed | Route::Embeddings => {
            format!("model \"{model}\" not found, try pulling it first")
        }
        Route::Chat | Route::Generate => format!("model '{model}' not found"),
    };
    ProxyError::NotTranslatable {
        status: StatusCode::NOT_FOUND,
        message,
    }
}

/// The 501 for a model-management route (`/api/pull`, `create`, `delete`, `copy`, `push`)
/// naming a model only `openai` hosts serve.
pub fn management_refused(path: &str, model: &str) -> ProxyError {
    ProxyError::NotTranslatable {
        status: StatusCode::NOT_IMPLEMENTED,
        message: format!(
            "{path} is not available for model \"{model}\": it is served by hosts of kind openai \
             (an OpenAI-compatible engine such as llama-server), which manage their models \
             themselves"
        ),
    }
}

/// Whether `path` is a model-management route that names a model in its body (`/api/pull`,
/// `push`, `create`, `delete`, `copy`).
pub fn manages_models(path: &str) -> bool {
    matches!(
        path,
        "/api/pull" | "/api/push" | "/api/create" | "/api/delete" | "/api/copy"
    )
}

/// Whether any host (this node's or another's) is an `openai` one.
pub fn any_engine(policy: &Policy) -> bool {
    policy
        .hosts
        .iter()
        .chain(&policy.remote)
        .any(|host| host.kind == HostKind::Openai)
}

/// Refuses a model-management request on `path` whose `body` names a model only `openai`
/// hosts serve ([`management_refused`]); anything else passes (Ollama hosts answer it).
pub fn check_management(policy: &Policy, path: &str, body: &[u8]) -> Result<(), ProxyError> {
    let Ok(Value::Object(request)) = serde_json::from_slice::<Value>(body) else {
        return Ok(());
    };
    let request = lowercase_keys(request);
    let field = if path == "/api/copy" {
        "source"
    } else if request.contains_key("model") {
        "model"
    } else {
        "name"
    };
    match request.get(field).and_then(Value::as_str) {
        Some(model) if serves_only_openai(policy, model) => Err(management_refused(path, model)),
        _ => Ok(()),
    }
}

/// Translates a native request `body` on `route` for `model` (the client's name), whose hosts
/// are all `openai` ones. `upstream_model` is the name the hosts list it under; `infill`:
/// they all serve `/infill` ([`serves_infill`]).
pub fn plan(
    route: Route,
    body: &[u8],
    model: &str,
    upstream_model: &str,
    infill: bool,
    received: Instant,
) -> Result<Plan, ProxyError> {
    let request: Map<String, Value> = match serde_json::from_slice(body) {
        Ok(Value::Object(map)) => lowercase_keys(map),
        _ => return Err(ProxyError::BodyNotJson),
    };
    // Only chat and generate stream (the embedding routes have no `stream`).
    let embeds = matches!(route, Route::Embed | Route::Embeddings);
    let stream = match request.get("stream") {
        _ if embeds => false,
        None | Some(Value::Null) => true,
        Some(Value::Bool(stream)) => *stream,
        Some(_) => return Err(refused("stream", "must be a boolean")),
    };
    let reply = |shape| Reply {
        shape,
        model: model.to_owned(),
        stream,
        received,
    };
    let (path, upstream, reply) = match route {
        Route::Chat => {
            let Some(upstream) = chat::request(&request, upstream_model, stream)? else {
                return Ok(Plan::Answer(loaded(&request, model, "message")));
            };
            ("/v1/chat/completions", upstream, reply(Shape::Chat))
        }
        Route::Generate => {
            let Some((upstream, target)) =
                generate::request(&request, upstream_model, stream, infill)?
            else {
                return Ok(Plan::Answer(loaded(&request, model, "response")));
            };
            let (path, shape) = match target {
                generate::Target::Chat => (
                    "/v1/chat/completions",
                    Shape::Generate { completions: false },
                ),
                generate::Target::Completions => {
                    ("/v1/completions", Shape::Generate { completions: true })
                }
                generate::Target::Infill => ("/infill", Shape::Infill),
            };
            (path, upstream, reply(shape))
        }
        Route::Embed | Route::Embeddings => {
            let legacy = route == Route::Embeddings;
            let (upstream, dimensions) = match embed::request(&request, upstream_model, legacy)? {
                embed::Planned::Send(upstream, dimensions) => (upstream, dimensions),
                embed::Planned::Empty => {
                    let answer = if legacy {
                        json!({ "embedding": [] })
                    } else {
                        json!({ "model": model, "embeddings": [] })
                    };
                    return Ok(Plan::Answer(json_answer(StatusCode::OK, &answer)));
                }
            };
            let shape = if legacy {
                Shape::Embeddings
            } else {
                Shape::Embed { dimensions }
            };
            ("/v1/embeddings", upstream, reply(shape))
        }
    };
    let inference = match route {
        Route::Embed | Route::Embeddings => Inference::OpenAiEmbeddings,
        Route::Chat | Route::Generate => Inference::OpenAiCompletion,
    };
    Ok(Plan::Send(Translated {
        path: http::uri::PathAndQuery::from_static(path),
        body: Bytes::from(Value::Object(upstream).to_string()),
        inference,
        reply,
    }))
}

/// The engine's `response` rewritten into Ollama's answer for `reply`: a stream becomes NDJSON
/// line by line, a whole answer one object, an error status `{"error": "…"}` with that status.
pub fn response(reply: Reply, response: Response<Body>) -> Response<Body> {
    use http_body_util::BodyExt;
    let (mut parts, inner) = response.into_parts();
    let source = if !parts.status.is_success() {
        stream::Source::Error
    } else if parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("text/event-stream"))
    {
        stream::Source::Sse
    } else {
        stream::Source::Json
    };
    let ndjson = reply.stream && source == stream::Source::Sse;
    let content_type = if ndjson {
        "application/x-ndjson"
    } else {
        "application/json; charset=utf-8"
    };
    parts.headers.remove(header::CONTENT_LENGTH);
    parts
        .headers
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    let body = stream::Translating::new(inner, reply, source);
    Response::from_parts(parts, body.boxed())
}

/// The name `model` is listed under by an `openai` host (hosts route by it: llama-swap and
/// vLLM refuse a name they do not list), else `model` as it is.
pub fn upstream_name(policy: &Policy, model: &str) -> String {
    let name = normalize_model(model);
    policy
        .hosts
        .iter()
        .chain(&policy.remote)
        .filter(|host| host.kind == HostKind::Openai)
        .flat_map(|host| &host.installed_names)
        .find(|listed| normalize_model(listed) == name)
        .cloned()
        .unwrap_or_else(|| model.to_owned())
}

/// A 400 naming the field that cannot be translated.
fn refused(field: &str, why: &str) -> ProxyError {
    ProxyError::NotTranslatable {
        status: StatusCode::BAD_REQUEST,
        message: format!(
            "field \"{field}\" {why} (the model is served by an OpenAI-compatible engine, host kind openai)"
        ),
    }
}

/// Ollama reads field names regardless of case (Go's `encoding/json`), the last occurrence
/// deciding; so does this translation, at the top level and in `options`.
fn lowercase_keys(map: Map<String, Value>) -> Map<String, Value> {
    map.into_iter()
        .map(|(key, value)| (key.to_ascii_lowercase(), value))
        .collect()
}

/// The answer to a load (or, with `keep_alive: 0`, unload) call, which no engine needs: an
/// empty `field` (`message` or `response`), `done: true`.
fn loaded(request: &Map<String, Value>, model: &str, field: &str) -> Response<Body> {
    let unload = match request.get("keep_alive") {
        Some(Value::Number(number)) => number.as_f64() == Some(0.0),
        Some(Value::String(text)) => matches!(text.trim(), "0" | "0s" | "0m" | "0h"),
        _ => false,
    };
    let empty = if field == "message" {
        json!({ "role": "assistant", "content": "" })
    } else {
        json!("")
    };
    let answer = json!({
        "model": model,
        "created_at": now(),
        field: empty,
        "done": true,
        "done_reason": if unload { "unload" } else { "load" },
    });
    json_answer(StatusCode::OK, &answer)
}

/// A JSON answer in Ollama's content type.
fn json_answer(status: StatusCode, value: &Value) -> Response<Body> {
    let mut response = Response::new(body::json(value));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json; charset=utf-8"),
    );
    response
}

/// Now as Ollama writes `created_at`: RFC 3339 in UTC with nanoseconds.
fn now() -> String {
    humantime::format_rfc3339_nanos(std::time::SystemTime::now()).to_string()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
