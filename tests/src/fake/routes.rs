//! Request dispatch: record the request, apply the Host check (reference §A.1, §B.7 item 11) and
//! the cloud key check (§A.9), then route by path and method as gin does, with gin's plain-text
//! 404 and 405 (§A.3 table).

use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::{HOST, ORIGIN};
use http::request::Parts;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::record::{RecordedRequest, bearer};
use super::state::{ConnCtl, Ctx, Shared, Tracker};
use super::wire::{Reply, empty, method_not_allowed, route_not_found};
use super::{admin, agents, audio, embed, native, openai};

/// The routes the fake serves.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Endpoint {
    Root,
    /// The fake's own: each request's wait inside its model's runner (runner mode).
    RunnerWaits,
    Version,
    Status,
    Tags,
    Ps,
    Show,
    Generate,
    Chat,
    Embed,
    Embeddings,
    Pull,
    Push,
    Create,
    Copy,
    Delete,
    Blob(String),
    Usage,
    Balance,
    ChatCompletions,
    Completions,
    Messages,
    Responses,
    OpenAiEmbeddings,
    Models,
    Model(String),
    Transcriptions,
}

/// Serves one request on a connection (the hyper service).
pub(crate) async fn handle(
    request: Request<Incoming>,
    shared: Arc<Shared>,
    conn: Arc<ConnCtl>,
) -> Result<Reply, Infallible> {
    let started = Instant::now();
    let (parts, body) = request.into_parts();
    // A body cut short means the client went away; hyper drops this future soon after.
    let body = body
        .collect()
        .await
        .map(|collected| collected.to_bytes())
        .unwrap_or_default();
    let id = shared.recorder.push(RecordedRequest {
        method: parts.method.clone(),
        path: parts.uri.path().to_owned(),
        query: parts.uri.query().map(str::to_owned),
        headers: parts.headers.clone(),
        body: body.clone(),
        received_at: started,
        finished_at: None,
    });
    let mut ctx = Ctx {
        shared: Arc::clone(&shared),
        conn,
        tracker: Some(Tracker::new(shared, id)),
        started,
        client_id: header(&parts.headers, "x-client-id"),
        key: bearer(&parts.headers),
        reported: header(&parts.headers, super::stream::USAGE_HEADER)
            .map(|value| super::stream::Reported::parse(&value))
            .unwrap_or_default(),
        prompt: None,
    };
    let mut reply = route(&mut ctx, &parts, &body).await;
    for (name, value) in super::record::lock(&ctx.shared.answer_headers).iter() {
        reply.headers_mut().insert(name.clone(), value.clone());
    }
    if let Some(tracker) = ctx.tracker.take() {
        tracker.complete();
    }
    Ok(reply)
}

async fn route(ctx: &mut Ctx, parts: &Parts, body: &Bytes) -> Reply {
    if ctx.shared.host_check && !host_allowed(&parts.headers) {
        return empty(StatusCode::FORBIDDEN);
    }
    if parts.method == Method::OPTIONS && parts.headers.contains_key(ORIGIN) {
        return empty(StatusCode::NO_CONTENT);
    }
    let Some(endpoint) = endpoint(parts.uri.path(), ctx.shared.cloud.is_some()) else {
        return route_not_found();
    };
    if !allows(&endpoint, &parts.method) {
        return method_not_allowed();
    }
    if let Some(cloud) = &ctx.shared.cloud
        && !matches!(
            endpoint,
            Endpoint::Root | Endpoint::Version | Endpoint::Tags
        )
        && let Err(reply) = cloud.authenticate(ctx.key.as_deref())
    {
        return reply;
    }
    if let Some(cloud) = &ctx.shared.cloud
        && names_a_model(&endpoint)
        && let Some(model) = serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .and_then(|value| value.get("model")?.as_str().map(str::to_owned))
        && let Err(reply) = cloud
            .authorize_model(ctx.key.as_deref(), &model)
            .and_then(|()| match endpoint {
                Endpoint::Show => Ok(()),
                _ => cloud.bill_model(ctx.key.as_deref(), &model),
            })
    {
        return reply;
    }
    let outcome = match endpoint {
        Endpoint::Root => Ok(admin::root()),
        Endpoint::RunnerWaits => Ok(runner_waits(ctx)),
        Endpoint::Version => Ok(admin::version(ctx)),
        Endpoint::Status => Ok(admin::status()),
        Endpoint::Tags => Ok(admin::tags(ctx)),
        Endpoint::Ps => Ok(admin::ps(ctx)),
        Endpoint::Show => admin::show(ctx, body),
        Endpoint::Generate => native::generate(ctx, body).await,
        Endpoint::Chat => native::chat(ctx, body).await,
        Endpoint::Embed => embed::embed(ctx, body).await,
        Endpoint::Embeddings => embed::embeddings(ctx, body).await,
        Endpoint::Pull => admin::pull(ctx, body),
        Endpoint::Push => admin::push(ctx, body),
        Endpoint::Create => admin::create(ctx, body),
        Endpoint::Copy => admin::copy(ctx, body),
        Endpoint::Delete => admin::delete(ctx, body),
        Endpoint::Blob(digest) if parts.method == Method::HEAD => {
            Ok(admin::blob_exists(ctx, &digest))
        }
        Endpoint::Blob(digest) => Ok(admin::blob_upload(ctx, &digest, body)),
        Endpoint::Usage => match (&ctx.shared.cloud, &ctx.key) {
            (Some(cloud), Some(key)) => Ok(cloud.usage(key)),
            _ => Ok(route_not_found()),
        },
        Endpoint::Balance => match (&ctx.shared.cloud, &ctx.key) {
            (Some(cloud), Some(key)) => Ok(super::record::lock(&cloud.billing).balance(key)),
            _ => Ok(route_not_found()),
        },
        Endpoint::ChatCompletions => openai::chat_completions(ctx, body).await,
        Endpoint::Completions => openai::completions(ctx, body).await,
        Endpoint::Messages => agents::messages(ctx, body).await,
        Endpoint::Responses => agents::responses(ctx, body).await,
        Endpoint::OpenAiEmbeddings => openai::embeddings(ctx, body).await,
        Endpoint::Models => Ok(openai::models(ctx)),
        Endpoint::Model(id) => Ok(openai::model(ctx, &id)),
        Endpoint::Transcriptions => audio::transcriptions(ctx, body).await,
    };
    outcome.unwrap_or_else(|reply| reply)
}

/// `GET /_fake/runner-waits`: `{"waits_us": [...]}`, every request's wait inside its runner
/// in the order their slots started (empty unless runners are on): for a benchmark that runs
/// the fake as a process.
fn runner_waits(ctx: &Ctx) -> Reply {
    let waits: Vec<u128> = ctx
        .shared
        .runners
        .as_ref()
        .map(|runners| {
            runners
                .log()
                .iter()
                .map(|entry| entry.waited.as_micros())
                .collect()
        })
        .unwrap_or_default();
    super::wire::gin_json(StatusCode::OK, &serde_json::json!({ "waits_us": waits }))
}

/// Endpoints whose body names the model they use.
fn names_a_model(endpoint: &Endpoint) -> bool {
    matches!(
        endpoint,
        Endpoint::Show
            | Endpoint::Generate
            | Endpoint::Chat
            | Endpoint::Embed
            | Endpoint::Embeddings
            | Endpoint::ChatCompletions
            | Endpoint::Completions
            | Endpoint::Messages
            | Endpoint::Responses
            | Endpoint::OpenAiEmbeddings
    )
}

fn endpoint(path: &str, cloud: bool) -> Option<Endpoint> {
    let endpoint = match path {
        "/" => Endpoint::Root,
        "/_fake/runner-waits" => Endpoint::RunnerWaits,
        "/api/version" => Endpoint::Version,
        "/api/status" => Endpoint::Status,
        "/api/tags" => Endpoint::Tags,
        "/api/ps" => Endpoint::Ps,
        "/api/show" => Endpoint::Show,
        "/api/generate" => Endpoint::Generate,
        "/api/chat" => Endpoint::Chat,
        "/api/embed" => Endpoint::Embed,
        "/api/embeddings" => Endpoint::Embeddings,
        "/api/pull" => Endpoint::Pull,
        "/api/push" => Endpoint::Push,
        "/api/create" => Endpoint::Create,
        "/api/copy" => Endpoint::Copy,
        "/api/delete" => Endpoint::Delete,
        "/api/usage" if cloud => Endpoint::Usage,
        "/api/balance" if cloud => Endpoint::Balance,
        "/v1/chat/completions" => Endpoint::ChatCompletions,
        "/v1/completions" => Endpoint::Completions,
        "/v1/messages" => Endpoint::Messages,
        "/v1/responses" => Endpoint::Responses,
        "/v1/embeddings" => Endpoint::OpenAiEmbeddings,
        "/v1/models" => Endpoint::Models,
        "/v1/audio/transcriptions" => Endpoint::Transcriptions,
        _ => {
            if let Some(digest) = path
                .strip_prefix("/api/blobs/")
                .filter(|d| !d.is_empty() && !d.contains('/'))
            {
                Endpoint::Blob(digest.to_owned())
            } else if let Some(id) = path.strip_prefix("/v1/models/").filter(|id| !id.is_empty()) {
                Endpoint::Model(id.to_owned())
            } else {
                return None;
            }
        }
    };
    Some(endpoint)
}

fn allows(endpoint: &Endpoint, method: &Method) -> bool {
    match endpoint {
        Endpoint::Root | Endpoint::Version | Endpoint::Tags => {
            method == Method::GET || method == Method::HEAD
        }
        Endpoint::Status
        | Endpoint::Ps
        | Endpoint::Usage
        | Endpoint::Balance
        | Endpoint::Models
        | Endpoint::RunnerWaits
        | Endpoint::Model(_) => method == Method::GET,
        Endpoint::Blob(_) => method == Method::HEAD || method == Method::POST,
        Endpoint::Delete => method == Method::DELETE,
        _ => method == Method::POST,
    }
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned)
}

/// Ollama's `allowedHostsMiddleware` on a loopback listener: no Host, localhost, `*.localhost`,
/// `*.local`, `*.internal`, and loopback, private, link-local or unspecified IP literals pass.
fn host_allowed(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(HOST) else {
        return true;
    };
    let Ok(host) = host.to_str() else {
        return false;
    };
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or(rest)
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => host,
        }
    };
    let name = name.to_ascii_lowercase();
    if name.is_empty()
        || name == "localhost"
        || [".localhost", ".local", ".internal"]
            .iter()
            .any(|suffix| name.ends_with(suffix))
    {
        return true;
    }
    match name.parse::<IpAddr>() {
        Ok(IpAddr::V4(ip)) => {
            ip.is_loopback() || ip.is_private() || ip.is_link_local() || ip.is_unspecified()
        }
        Ok(IpAddr::V6(ip)) => {
            let first = ip.segments()[0];
            ip.is_loopback()
                || ip.is_unspecified()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(host: &str) -> bool {
        let mut headers = HeaderMap::new();
        headers.insert(
            HOST,
            host.parse()
                .unwrap_or_else(|_| http::HeaderValue::from_static("x")),
        );
        host_allowed(&headers)
    }

    #[test]
    fn host_check_matches_ollama() {
        for host in [
            "127.0.0.1:11434",
            "localhost",
            "LOCALHOST:1",
            "a.localhost",
            "box.local",
            "x.internal",
            "10.1.2.3",
            "[::1]:80",
            "0.0.0.0",
        ] {
            assert!(allowed(host), "{host} should pass");
        }
        for host in [
            "example.com",
            "8.8.8.8:11434",
            "ollama.com",
            "[2001:db8::1]:1",
        ] {
            assert!(!allowed(host), "{host} should be refused");
        }
        assert!(host_allowed(&HeaderMap::new()));
    }

    #[test]
    fn routes_and_methods() {
        assert_eq!(
            endpoint("/api/blobs/sha256:ab", false),
            Some(Endpoint::Blob("sha256:ab".into()))
        );
        assert_eq!(
            endpoint("/v1/models/llama3:8b", false),
            Some(Endpoint::Model("llama3:8b".into()))
        );
        assert_eq!(endpoint("/api/usage", false), None);
        assert_eq!(endpoint("/api/usage", true), Some(Endpoint::Usage));
        assert!(allows(&Endpoint::Tags, &Method::HEAD));
        assert!(!allows(&Endpoint::Ps, &Method::HEAD));
        assert!(!allows(&Endpoint::Generate, &Method::GET));
    }
}
