//! The native metadata and model-management endpoints (reference §A.3): version, status, tags,
//! ps, show, pull, push, create, copy, delete and blobs. None of them takes a slot, so they never
//! block behind inference.

use std::convert::Infallible;

use bytes::Bytes;
use futures_util::stream;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::gojson::{GoType, Shape};
use super::models::{Kind, digest, show as show_model, with_tag};
use super::native::{Handled, bad_request, parse, text};
use super::record::lock;
use super::state::Ctx;
use super::wire::{NDJSON, PLAIN_JSON, Reply, empty, full, gin_error, gin_json};

const SHOW: Shape = Shape {
    name: "api.ShowRequest",
    fields: &[
        ("model", GoType::Str),
        ("name", GoType::Str),
        ("verbose", GoType::Bool),
    ],
};

const PULL: Shape = Shape {
    name: "api.PullRequest",
    fields: &[
        ("model", GoType::Str),
        ("name", GoType::Str),
        ("insecure", GoType::Bool),
        ("stream", GoType::Bool),
    ],
};

const CREATE: Shape = Shape {
    name: "api.CreateRequest",
    fields: &[
        ("model", GoType::Str),
        ("from", GoType::Str),
        ("stream", GoType::Bool),
    ],
};

const COPY: Shape = Shape {
    name: "api.CopyRequest",
    fields: &[("source", GoType::Str), ("destination", GoType::Str)],
};

const DELETE: Shape = Shape {
    name: "api.DeleteRequest",
    fields: &[("model", GoType::Str), ("name", GoType::Str)],
};

/// `GET|HEAD /`.
pub(crate) fn root() -> Reply {
    full(
        StatusCode::OK,
        Some("text/plain; charset=utf-8"),
        "Ollama is running",
    )
}

/// `GET|HEAD /api/version`.
pub(crate) fn version(ctx: &Ctx) -> Reply {
    gin_json(StatusCode::OK, &json!({ "version": ctx.shared.version }))
}

/// `GET /api/status`.
pub(crate) fn status() -> Reply {
    gin_json(
        StatusCode::OK,
        &json!({ "cloud": { "disabled": false, "source": "default" } }),
    )
}

/// `GET|HEAD /api/tags`.
pub(crate) fn tags(ctx: &Ctx) -> Reply {
    gin_json(StatusCode::OK, &lock(&ctx.shared.models).tags())
}

/// `GET /api/ps`.
pub(crate) fn ps(ctx: &Ctx) -> Reply {
    if let Some(vram) = &ctx.shared.vram {
        let rows = vram.listed();
        return gin_json(StatusCode::OK, &lock(&ctx.shared.models).ps_of(&rows));
    }
    gin_json(StatusCode::OK, &lock(&ctx.shared.models).ps())
}

/// `POST /api/show`.
pub(crate) fn show(ctx: &Ctx, body: &[u8]) -> Handled {
    let (request, _) = parse(body, &SHOW, false)?;
    let name = either(text(&request, "model"), text(&request, "name"));
    if name.is_empty() {
        return Err(bad_request("model is required"));
    }
    let verbose = request.get("verbose") == Some(&Value::Bool(true));
    match lock(&ctx.shared.models).find(name) {
        Some(model) => Ok(gin_json(StatusCode::OK, &show_model(model, verbose))),
        None => Err(gin_error(
            StatusCode::NOT_FOUND,
            &format!("model '{}' not found", with_tag(name)),
        )),
    }
}

/// `POST /api/pull`: a progress stream ending in `success`; the model is installed.
pub(crate) fn pull(ctx: &Ctx, body: &[u8]) -> Handled {
    let (request, _) = parse(body, &PULL, false)?;
    let name = either(text(&request, "model"), text(&request, "name")).to_owned();
    if name.is_empty() {
        return Err(bad_request("invalid model name"));
    }
    {
        let mut models = lock(&ctx.shared.models);
        if models.find(&name).is_none() {
            let looks_like_embedding = name.contains("embed") || name.contains("minilm");
            models.install(
                &name,
                if looks_like_embedding {
                    Kind::Embedding
                } else {
                    Kind::Chat
                },
            );
        }
    }
    let layer = digest(&name);
    let status = format!("pulling {}", &layer[..12]);
    let layer = format!("sha256:{layer}");
    let total = 2_142_590_208_u64;
    let lines = vec![
        json!({ "status": "pulling manifest" }),
        json!({ "status": status, "digest": layer, "total": total }),
        json!({ "status": status, "digest": layer, "total": total, "completed": total / 2 }),
        json!({ "status": status, "digest": layer, "total": total, "completed": total }),
        json!({ "status": "verifying sha256 digest" }),
        json!({ "status": "writing manifest" }),
        json!({ "status": "success" }),
    ];
    Ok(progress(&request, lines))
}

/// `POST /api/push`: a progress stream ending in `success`.
pub(crate) fn push(_ctx: &Ctx, body: &[u8]) -> Handled {
    let (request, _) = parse(body, &PULL, false)?;
    let name = either(text(&request, "model"), text(&request, "name")).to_owned();
    if name.is_empty() {
        return Err(bad_request("invalid model name"));
    }
    let layer = format!("sha256:{}", digest(&name));
    let lines = vec![
        json!({ "status": "retrieving manifest" }),
        json!({ "status": "starting upload", "digest": layer, "total": 1024 }),
        json!({ "status": "pushing manifest" }),
        json!({ "status": "success" }),
    ];
    Ok(progress(&request, lines))
}

/// `POST /api/create`: a status stream ending in `success`; the model is installed.
pub(crate) fn create(ctx: &Ctx, body: &[u8]) -> Handled {
    let (request, _) = parse(body, &CREATE, false)?;
    let name = text(&request, "model").to_owned();
    if name.is_empty() {
        return Err(bad_request("model is required"));
    }
    {
        let mut models = lock(&ctx.shared.models);
        let kind = models
            .find(text(&request, "from"))
            .map_or(Kind::Chat, |from| from.kind);
        models.install(&name, kind);
    }
    let layer = format!("using existing layer sha256:{}", digest(&name));
    let lines = vec![
        json!({ "status": "gathering model components" }),
        json!({ "status": layer }),
        json!({ "status": "writing manifest" }),
        json!({ "status": "success" }),
    ];
    Ok(progress(&request, lines))
}

/// `POST /api/copy`: 200 with an empty body.
pub(crate) fn copy(ctx: &Ctx, body: &[u8]) -> Handled {
    let (request, _) = parse(body, &COPY, false)?;
    let (source, destination) = (text(&request, "source"), text(&request, "destination"));
    if source.is_empty() {
        return Err(bad_request(&format!("source {source:?} is invalid")));
    }
    if destination.is_empty() {
        return Err(bad_request(&format!(
            "destination {destination:?} is invalid"
        )));
    }
    let mut models = lock(&ctx.shared.models);
    let kind = models.find(source).map(|model| model.kind).ok_or_else(|| {
        gin_error(
            StatusCode::NOT_FOUND,
            &format!("model {source:?} not found"),
        )
    })?;
    models.install(destination, kind);
    Ok(empty(StatusCode::OK))
}

/// `DELETE /api/delete`: 200 with an empty body.
pub(crate) fn delete(ctx: &Ctx, body: &[u8]) -> Handled {
    let (request, _) = parse(body, &DELETE, false)?;
    let name = either(text(&request, "model"), text(&request, "name"));
    if name.is_empty() {
        return Err(bad_request("model is required"));
    }
    if lock(&ctx.shared.models).remove(name) {
        Ok(empty(StatusCode::OK))
    } else {
        Err(gin_error(
            StatusCode::NOT_FOUND,
            &format!("model '{name}' not found"),
        ))
    }
}

/// `HEAD /api/blobs/{digest}`: 200 when the blob exists, else 404 (no body on a HEAD).
pub(crate) fn blob_exists(ctx: &Ctx, digest: &str) -> Reply {
    if lock(&ctx.shared.blobs).contains(digest) {
        empty(StatusCode::OK)
    } else {
        gin_error(StatusCode::NOT_FOUND, "blob not found")
    }
}

/// `POST /api/blobs/{digest}`: 201 when created, 200 when it already exists, 400 on a mismatch.
pub(crate) fn blob_upload(ctx: &Ctx, digest: &str, body: &[u8]) -> Reply {
    let actual = format!("sha256:{:x}", Sha256::digest(body));
    if actual != digest {
        return gin_error(
            StatusCode::BAD_REQUEST,
            &format!("digest mismatch, expected {digest:?}, got {actual:?}"),
        );
    }
    if lock(&ctx.shared.blobs).insert(actual) {
        empty(StatusCode::CREATED)
    } else {
        empty(StatusCode::OK)
    }
}

fn either<'a>(first: &'a str, second: &'a str) -> &'a str {
    if first.is_empty() { second } else { first }
}

// A native progress stream, or its last object with `stream: false`.
fn progress(request: &serde_json::Map<String, Value>, lines: Vec<Value>) -> Reply {
    if request.get("stream") == Some(&Value::Bool(false)) {
        let last = lines.last().cloned().unwrap_or(Value::Null);
        return full(StatusCode::OK, Some(PLAIN_JSON), last.to_string());
    }
    let frames = lines
        .into_iter()
        .map(|line| Ok::<_, Infallible>(Frame::data(Bytes::from(format!("{line}\n")))));
    let mut response = Response::new(StreamBody::new(stream::iter(frames)).boxed_unsync());
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(NDJSON));
    response
}
