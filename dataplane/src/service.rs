//! The request path: one function per phase, in order, each returning a
//! typed error that becomes HTTP in exactly one place ([`handle`]).
//!
//! ```text
//! handle → reserved routes (main port: /health, /queue/*, /metrics,
//!          /dashboard, its usage view, sign-in and sign-out)
//!        → identify (key digest or injected identity) → scope
//!        → canonical path (no escapes, empty or dot segments) → classify
//!          → with model management off, the route allowlist
//!        → read body (bounded) or stream it
//!        → metadata: straight to a host (fast path)
//!        → everything else: admit → wait for a slot → send (fail over
//!          before the first byte) → respond, the slot held by the body
//!          ([`queued`]; embeddings through their cache first)
//! ```
//!
//! The phases hand each piece only the parts of [`App`] it reads.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use http::{HeaderValue, Method, Request, Response, header};
use hyper::body::Incoming;
use tracing::Instrument;

use crate::app::App;
use crate::auth::{self, ListenerKind};
use crate::body::{self, Body};
use crate::error::{self, ProxyError};
use crate::headers;
use crate::hop;
use crate::metrics;
use crate::policy::{Policy, Scope};
use crate::queue_control;
use crate::request_id;
use crate::{dashboard, status};

mod hop_owner;
mod inference;
mod metadata;
mod prepare;

use hop_owner::hopped_identity;
use prepare::forward;

/// Answers one request. Never fails: every error becomes its HTTP response
/// here, and every response carries `X-Request-ID`.
pub async fn handle(
    app: Arc<App>,
    kind: &ListenerKind,
    peer: SocketAddr,
    mut request: Request<Incoming>,
) -> Response<Body> {
    let started = std::time::Instant::now();
    let request_id = request_id::from_headers(request.headers());
    let shape = error::Shape::of(request.uri().path());
    // Set on the request too, so that what goes upstream or to the owner of
    // the chosen host carries the same id as the answer and both logs (one value, shared).
    let id_value = HeaderValue::from_str(&request_id).ok();
    if let Some(id) = &id_value {
        request
            .headers_mut()
            .insert(headers::REQUEST_ID, id.clone());
    }

    // The one policy load of this request: the whole request sees one snapshot.
    let policy = app.store.load();
    // `forward` fills in the client and tier; never a key.
    let span = tracing::debug_span!(
        "request",
        id = %request_id,
        client = tracing::field::Empty,
        tier = tracing::field::Empty,
        peer = tracing::field::Empty,
        session = tracing::field::Empty,
    );
    // Boxed: hyper keeps room for this future in every connection, open or
    // idle, so what it holds inline is paid by every connection; the boxed
    // state is paid only while a request runs. The phases that run after a
    // grant (or instead of queueing) are boxed below for the same reason: a
    // waiting request holds only what waiting needs.
    let mut hopped = false;
    // The box instrumented, not the route's future before it is boxed: a future is moved
    // whole (its largest state) each time it is wrapped or boxed, and this one is kilobytes.
    let routed = Box::pin(route(&app, &policy, kind, peer, request, &mut hopped))
        .instrument(span.clone())
        .await;
    let mut refused = false;
    let mut response = match routed {
        Ok(response) => response,
        Err(error) => {
            refused = error.worth_another_box();
            error.into_response(&request_id, shape)
        }
    };
    if hopped {
        crate::relay::mark_answer(&mut response, started.elapsed(), refused);
    }
    if let Some(id) = id_value {
        response.headers_mut().insert(headers::REQUEST_ID, id);
    }
    span.in_scope(|| {
        let header = |name| response.headers().get(name).and_then(|v| v.to_str().ok());
        tracing::debug!(
            status = response.status().as_u16(),
            host = header(headers::FAILOVER_HOST),
            wait_ms = header(headers::QUEUE_WAIT_TIME).and_then(|ms| ms.parse::<u64>().ok()),
            "request done"
        );
    });
    response
}

async fn route(
    app: &Arc<App>,
    policy: &Arc<Policy>,
    kind: &ListenerKind,
    peer: SocketAddr,
    request: Request<Incoming>,
    hopped: &mut bool,
) -> Result<Response<Body>, ProxyError> {
    // The address the throttle counts and the logs show: behind a trusted
    // reverse proxy, the client it names in X-Forwarded-For.
    let peer = auth::client_addr(peer.ip(), request.headers(), &policy.auth.trusted_proxies);
    tracing::Span::current().record("peer", tracing::field::display(peer));
    // Reserved routes exist on the main port only; on an injection port
    // every path is proxied, as the reference does. Other methods on these
    // paths fall through to the proxy, as the reference does too.
    if let ListenerKind::Main = kind {
        match (request.method(), request.uri().path()) {
            (&Method::GET, "/health") => {
                return Ok(body::json_response(serde_json::json!({ "status": "ok" })));
            }
            (&Method::POST, "/queue/pause" | "/queue/resume" | "/queue/drain" | "/queue/flush") => {
                // HTTP/2 names the host in the URI, HTTP/1 in `Host`.
                let authority = request
                    .uri()
                    .authority()
                    .map(http::uri::Authority::as_str)
                    .or_else(|| {
                        request
                            .headers()
                            .get(header::HOST)
                            .and_then(|host| host.to_str().ok())
                    });
                queue_control::check_origin_and_body(request.headers(), authority)?;
                let identity = auth::identify(
                    policy,
                    kind,
                    peer,
                    request.headers(),
                    &app.throttle,
                    &app.key_refresh,
                    request.extensions().get::<auth::PeerCertificate>(),
                )?;
                identity.require(Scope::Management)?;
                return queue_control::handle(&app.admin, &app.dispatcher, &request).await;
            }
            (&Method::POST, "/dashboard/login" | "/dashboard/logout") => {
                // Like the page: a disabled dashboard does not advertise itself.
                if !policy.dashboard.enabled {
                    return Err(ProxyError::NotFound);
                }
                return if request.uri().path() == "/dashboard/login" {
                    dashboard::login::login(&app.sessions, &app.throttle, policy, peer, request)
                        .await
                } else {
                    dashboard::login::logout(&app.sessions, policy, &request)
                };
            }
            (
                &Method::GET,
                "/queue/status" | "/queue/summary" | "/metrics" | "/dashboard" | "/dashboard/usage",
            ) => {
                return observe(app, policy, kind, peer, &request);
            }
            _ => {}
        }
    }
    if let Some(claim) = request.headers().get(hop::HEADER) {
        let (identity, hop) = hopped_identity(app, policy, peer, claim, &request)?;
        // Verified: the answer tells the edge what it took and whether to try another box.
        *hopped = true;
        identity.require(Scope::Inference)?;
        // The edge named the end user (or none) in what it signed: not read again here.
        return forward(app, policy, identity, Some(hop), false, request).await;
    }
    let identity = auth::identify(
        policy,
        kind,
        peer,
        request.headers(),
        &app.throttle,
        &app.key_refresh,
        request.extensions().get::<auth::PeerCertificate>(),
    )?;
    identity.require(Scope::Inference)?;
    forward(app, policy, identity, None, kind.trusts_users(), request).await
}

/// The read-only surfaces (scope `read`): status, summary, metrics and the
/// dashboard.
fn observe(
    app: &Arc<App>,
    policy: &Arc<Policy>,
    kind: &ListenerKind,
    peer: IpAddr,
    request: &Request<Incoming>,
) -> Result<Response<Body>, ProxyError> {
    let path = request.uri().path();
    // A disabled dashboard answers like an unknown route, before any
    // authentication: a feature turned off does not advertise itself.
    if path.starts_with("/dashboard") && !policy.dashboard.enabled {
        return Err(ProxyError::NotFound);
    }
    // A key, or (auth on) the dashboard's session cookie: these routes only read.
    let identity = match dashboard::login::identify(
        &app.sessions,
        &app.throttle,
        &app.key_refresh,
        policy,
        kind,
        peer,
        request,
    ) {
        Ok(identity) => identity,
        // A browser without a session: the 401 is the login form.
        Err(ProxyError::MissingCredentials | ProxyError::UnknownKey) if path == "/dashboard" => {
            return Ok(dashboard::login::login_page(""));
        }
        Err(error) => return Err(error),
    };
    identity.require(Scope::Read)?;
    Ok(match path {
        "/queue/status" => status::status_response(
            app.status_sources(),
            policy,
            identity.usage_scope(),
            &|model| identity.may_use(model),
        ),
        "/queue/summary" => status::summary_response(app.status_sources(), policy),
        "/metrics" => {
            let visible = |model: &str| identity.may_use(model);
            let visible: &dyn Fn(&str) -> bool = &visible;
            let scoped = identity.has_allowlist().then_some(visible);
            metrics::response(&app.metrics, &app.metric_sources(), scoped)
        }
        "/dashboard/usage" => {
            dashboard::usage::response(&app.usage, policy, identity.usage_scope())
        }
        _ => dashboard::response(policy),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of `route`'s future (a test build's; a release build's differs): 6,184 bytes
    /// before one request value and one send, 5,368 after, 5,504 with the slot naming, body
    /// capture, pair hop keys and translated embeddings that came next (capture boxed), 5,112
    /// with `prepare::forward` in phases over references (the head and body no longer borrowed
    /// across the wait).
    const ROUTE_FUTURE_BYTES: usize = 5112;

    /// The size of the future `call` returns, without making one.
    fn future_size<A, F: std::future::Future>(_call: impl FnOnce(A) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// Hyper keeps the route's future (boxed in [`handle`]) for every request in flight, a
    /// queued one included: what it holds is paid by every waiting request.
    #[test]
    fn the_route_future_does_not_grow() {
        type Args = (
            &'static Arc<App>,
            &'static Arc<Policy>,
            &'static ListenerKind,
            SocketAddr,
            Request<Incoming>,
            &'static mut bool,
        );
        let size = future_size(|(app, policy, kind, peer, request, hopped): Args| {
            route(app, policy, kind, peer, request, hopped)
        });
        eprintln!("route future: {size} bytes");
        assert!(
            size <= ROUTE_FUTURE_BYTES,
            "the route future is {size} bytes"
        );
    }
}
