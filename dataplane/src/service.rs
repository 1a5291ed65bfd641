//! The request path: one function per phase, in order, each returning a
//! typed error that is turned into HTTP in exactly one place ([`handle`]).
//!
//! ```text
//! handle → reserved routes (/health, /queue/*, /metrics, /dashboard)
//!        → identify → classify → read body → forward → respond
//! ```

use std::net::SocketAddr;
use std::sync::Arc;

use http::{HeaderValue, Method, Request, Response, header};
use hyper::body::Incoming;

use crate::app::App;
use crate::body::{self, Body};
use crate::endpoint::Endpoint;
use crate::error::ProxyError;
use crate::headers;
use crate::policy::{Host, Policy};
use crate::proxy::{self, Outbound, RequestBody};
use crate::request_id;
use crate::server::ListenerKind;

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
    let mut response = match route(&app, &policy, kind, peer, request, &request_id).await {
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
    _peer: SocketAddr,
    request: Request<Incoming>,
    request_id: &str,
) -> Result<Response<Body>, ProxyError> {
    // Reserved routes exist on the main port only; on an injection port
    // every path is proxied, as the reference does.
    if let ListenerKind::Main = kind
        && let (&Method::GET, "/health") = (request.method(), request.uri().path())
    {
        return Ok(json_response(serde_json::json!({ "status": "ok" })));
    }
    forward(app, policy, request, request_id).await
}

async fn forward(
    app: &Arc<App>,
    policy: &Arc<Policy>,
    request: Request<Incoming>,
    _request_id: &str,
) -> Result<Response<Body>, ProxyError> {
    if app.is_shutting_down() {
        return Err(ProxyError::ShuttingDown);
    }
    let endpoint = Endpoint::of(request.uri().path());
    if endpoint == Endpoint::ModelManagement && !policy.proxy.allow_model_management {
        return Err(ProxyError::ModelManagementDisabled);
    }
    let client_id = request
        .headers()
        .get(headers::CLIENT_ID)
        .and_then(|value| value.to_str().ok())
        .filter(|id| !id.is_empty())
        .map(str::to_owned);

    let (parts, incoming) = request.into_parts();
    let limit = policy.proxy.max_request_body_bytes;
    let body = if endpoint.reads_body() {
        RequestBody::Buffered(proxy::read_body(incoming, &parts.headers, limit).await?)
    } else {
        RequestBody::Streamed(proxy::stream_body(incoming, &parts.headers, limit)?)
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
    let hosts = candidates(policy);
    let active = app.track_active();
    let answer = proxy::send(
        &app.upstream,
        policy.proxy.request_timeout,
        &hosts,
        outbound,
        |_, _| {},
    )
    .await?;
    Ok(proxy::respond(answer, Some(Box::new(active)), None))
}

/// The hosts to try, in order.
fn candidates(policy: &Policy) -> Vec<Arc<Host>> {
    policy.hosts.iter().take(1).cloned().collect()
}

fn json_response(value: serde_json::Value) -> Response<Body> {
    let mut response = Response::new(body::json(&value));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}
