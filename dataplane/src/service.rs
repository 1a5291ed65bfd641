//! The request path: one function per phase, in order, each returning a
//! typed error that becomes HTTP in exactly one place ([`handle`]).
//!
//! ```text
//! handle → reserved routes (main port: /health, /queue/*)
//!        → identify (key digest or injected identity) → scope
//!        → classify → model management refused unless allowed
//!        → read body (bounded) or stream it
//!        → metadata: straight to a host (fast path)
//!        → everything else: admit → wait for a slot → send (fail over
//!          before the first byte) → respond, the slot held by the body
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderValue, Method, Request, Response, header};
use hyper::body::Incoming;

use crate::app::App;
use crate::auth::{self, Identity};
use crate::body::{self, Body};
use crate::dispatch::{self, Grant};
use crate::endpoint::Endpoint;
use crate::error::ProxyError;
use crate::headers;
use crate::policy::{Host, Policy, Scope};
use crate::proxy::{self, Outbound, RequestBody};
use crate::queue_control;
use crate::request_id;
use crate::server::ListenerKind;

/// The client id of anonymous callers (auth off, no `X-Client-ID`).
const ANONYMOUS: &str = "anonymous";

/// Answers one request. Never fails: every error becomes its HTTP response
/// here, and every response carries `X-Request-ID`.
pub async fn handle(
    app: Arc<App>,
    kind: &ListenerKind,
    peer: SocketAddr,
    request: Request<Incoming>,
) -> Response<Body> {
    let request_id = request_id::from_headers(request.headers());
    // The one policy load of this request: the whole request sees one snapshot.
    let policy = app.store.load();
    let mut response = match route(&app, &policy, kind, peer, request).await {
        Ok(response) => response,
        Err(error) => error.into_response(&request_id),
    };
    if let Ok(id) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert(headers::REQUEST_ID, id);
    }
    response
}

async fn route(
    app: &Arc<App>,
    policy: &Arc<Policy>,
    kind: &ListenerKind,
    peer: SocketAddr,
    request: Request<Incoming>,
) -> Result<Response<Body>, ProxyError> {
    // Reserved routes exist on the main port only; on an injection port
    // every path is proxied, as the reference does. Other methods on these
    // paths fall through to the proxy, as the reference does too.
    if let ListenerKind::Main = kind {
        match (request.method(), request.uri().path()) {
            (&Method::GET, "/health") => {
                return Ok(json_response(serde_json::json!({ "status": "ok" })));
            }
            (&Method::POST, "/queue/pause" | "/queue/resume" | "/queue/drain" | "/queue/flush") => {
                let identity =
                    auth::identify(policy, kind, peer.ip(), request.headers(), &app.throttle)?;
                identity.require(Scope::Management)?;
                return queue_control::handle(app, &request).await;
            }
            _ => {}
        }
    }
    let identity = auth::identify(policy, kind, peer.ip(), request.headers(), &app.throttle)?;
    identity.require(Scope::Inference)?;
    forward(app, policy, identity, request).await
}

async fn forward(
    app: &Arc<App>,
    policy: &Arc<Policy>,
    identity: Identity,
    request: Request<Incoming>,
) -> Result<Response<Body>, ProxyError> {
    if app.is_shutting_down() {
        return Err(ProxyError::ShuttingDown);
    }
    let endpoint = Endpoint::of(request.uri().path());
    if endpoint == Endpoint::ModelManagement && !policy.proxy.allow_model_management {
        return Err(ProxyError::ModelManagementDisabled);
    }
    let tier = identity.tier(auth::requested_tier(request.headers()));
    let client_id = identity.client_id().cloned();
    if let Some(client) = &client_id {
        app.touch(client);
    }

    let (parts, incoming) = request.into_parts();
    let limit = policy.proxy.max_request_body_bytes;
    let body = if endpoint.reads_body() {
        RequestBody::Buffered(proxy::read_body(incoming, &parts.headers, limit).await?)
    } else {
        RequestBody::Streamed(proxy::stream_body(incoming, &parts.headers, limit)?)
    };
    let (bytes, model) = match &body {
        RequestBody::Buffered(bytes) => (bytes.len() as u64, model_of(bytes)),
        RequestBody::Streamed(_) => (declared_length(&parts.headers), None),
    };
    let mut upstream_headers = parts.headers;
    headers::for_upstream(&mut upstream_headers, client_id.as_deref());
    let outbound = Outbound {
        method: parts.method,
        path_and_query: parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
        headers: upstream_headers,
        body,
    };

    if endpoint == Endpoint::Metadata {
        // The fast path: never queued, never capped, no slot.
        let hosts = metadata_hosts(policy);
        let active = app.track_active();
        let answer = proxy::send(
            &app.upstream,
            policy.proxy.request_timeout,
            &hosts,
            outbound,
            |_, _| {},
        )
        .await?;
        return Ok(proxy::respond(answer, Some(Box::new(active)), None));
    }

    let pending = app.dispatcher.admit(dispatch::Request {
        client: client_id.unwrap_or_else(|| Arc::from(ANONYMOUS)),
        tier,
        bytes,
        model: model.map(Arc::from),
    })?;
    let position = pending.position;
    let immediate = pending.immediate;
    let grant = pending.granted().await?;
    send_granted(app, policy, grant, outbound, position, immediate).await
}

/// Sends a dispatched request, failing over to another free host before the
/// first byte, and returns the response with the slot held by its body.
async fn send_granted(
    app: &Arc<App>,
    policy: &Arc<Policy>,
    grant: Grant,
    outbound: Outbound,
    position: u32,
    immediate: bool,
) -> Result<Response<Body>, ProxyError> {
    let Grant {
        mut lease, waited, ..
    } = grant;
    let wait_header = queue_headers(waited, position, immediate);
    let active = app.track_active();
    let timeout = policy.proxy.request_timeout;
    let mut tried: Vec<Arc<str>> = Vec::new();
    let mut outbound = Some(outbound);
    let answer = loop {
        let host = lease.host().clone();
        let Some(attempt) = outbound.take() else {
            break Err(ProxyError::AllHostsFailed);
        };
        let (this_attempt, replay) = split_for_retry(attempt);
        match proxy::send(
            &app.upstream,
            timeout,
            std::slice::from_ref(&host),
            this_attempt,
            |_, _| {},
        )
        .await
        {
            Ok(answer) => break Ok(answer),
            Err(error) => {
                tried.push(host.name.clone());
                outbound = replay;
                if outbound.is_none() || !app.dispatcher.fail_over(&mut lease, &tried) {
                    break Err(error);
                }
            }
        }
    };
    let answer = answer?;
    let completion: crate::upstream::Completion = Box::new(move |outcome| {
        let mut lease = lease;
        lease.set_cost(outcome.total_duration);
        drop(lease);
    });
    let guard: Box<dyn Send + Sync> = Box::new(active);
    let mut response = proxy::respond(answer, Some(guard), Some(completion));
    for (name, value) in wait_header {
        response.headers_mut().insert(name, value);
    }
    Ok(response)
}

/// Splits a request into the attempt to send now and a copy for a retry on
/// another host; streamed bodies cannot be replayed.
fn split_for_retry(outbound: Outbound) -> (Outbound, Option<Outbound>) {
    match &outbound.body {
        RequestBody::Buffered(bytes) => {
            let replay = Outbound {
                method: outbound.method.clone(),
                path_and_query: outbound.path_and_query.clone(),
                headers: outbound.headers.clone(),
                body: RequestBody::Buffered(bytes.clone()),
            };
            (outbound, Some(replay))
        }
        RequestBody::Streamed(_) => (outbound, None),
    }
}

/// `X-Queue-Wait-Time` (ms from admission to dispatch) and, when the request
/// had to wait, `X-Queue-Position` (its position at admission).
fn queue_headers(
    waited: Duration,
    position: u32,
    immediate: bool,
) -> Vec<(http::HeaderName, HeaderValue)> {
    let mut headers = vec![(
        headers::QUEUE_WAIT_TIME,
        HeaderValue::from(u64::try_from(waited.as_millis()).unwrap_or(u64::MAX)),
    )];
    if !immediate {
        headers.push((headers::QUEUE_POSITION, HeaderValue::from(position)));
    }
    headers
}

/// Hosts for a metadata request: the healthy ones, or all when none is
/// marked healthy.
fn metadata_hosts(policy: &Policy) -> Vec<Arc<Host>> {
    let healthy: Vec<Arc<Host>> = policy.hosts.iter().filter(|h| h.healthy).cloned().collect();
    if healthy.is_empty() {
        policy.hosts.clone()
    } else {
        healthy
    }
}

/// The top-level `model` of a JSON body, if any.
fn model_of(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Model {
        model: Option<String>,
    }
    serde_json::from_slice::<Model>(body).ok()?.model
}

fn declared_length(headers: &http::HeaderMap) -> u64 {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse().ok())
        .unwrap_or(0)
}

/// A JSON response with status 200.
pub fn json_response(value: serde_json::Value) -> Response<Body> {
    let mut response = Response::new(body::json(&value));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}
