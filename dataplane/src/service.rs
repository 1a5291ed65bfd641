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

use bytes::Bytes;

use crate::affinity;
use crate::app::App;
use crate::auth::{self, ANONYMOUS, Identity, ListenerKind};
use crate::body::{self, Body};
use crate::embeddings;
use crate::endpoint::{self, Access, Endpoint, Inference};
use crate::error::{self, Cause, Failures, ProxyError};
use crate::form;
use crate::headers;
use crate::hop;
use crate::metrics;
use crate::policy::{Host, HostKind, Policy, Scope};
use crate::proxy::{self, Outbound, RequestBody};
use crate::queue_control;
use crate::queued;
use crate::request_id;
use crate::rewrite;
use crate::translate;
use crate::view::BodyView;
use crate::{dashboard, status};

/// The reading of a body that says nothing.
static EMPTY_VIEW: BodyView = BodyView::EMPTY;

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
    // the chosen host carries the same id as the answer and both logs.
    if let Ok(id) = HeaderValue::from_str(&request_id) {
        request.headers_mut().insert(headers::REQUEST_ID, id);
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
    let routed =
        Box::pin(route(&app, &policy, kind, peer, request, &mut hopped).instrument(span.clone()))
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
    if let Ok(id) = HeaderValue::from_str(&request_id) {
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

/// The identity and tier another node's data plane asserts for a request it forwarded here
/// (see [`hop`]). A claim that does not verify is refused and counted as a failed
/// authentication: whoever sends it gains nothing.
fn hopped_identity(
    app: &App,
    policy: &Policy,
    peer: IpAddr,
    claim: &HeaderValue,
    request: &Request<Incoming>,
) -> Result<(Identity, Hop), ProxyError> {
    let id = request
        .headers()
        .get(headers::REQUEST_ID)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default();
    let path = request
        .uri()
        .path_and_query()
        .map_or("/", http::uri::PathAndQuery::as_str);
    let signed = hop::Request {
        to: &policy.node,
        id,
        method: request.method(),
        path,
    };
    // A hop that verifies is a peer's, whatever else its address did: only failures meet
    // the throttle (which answers 429 once they are too many).
    let now = std::time::SystemTime::now();
    let keys = app
        .peers
        .verifying_keys(policy, hop::claimed_edge(claim).as_deref());
    let verified = hop::verify_any(&keys, app.peers.replays(), claim, signed, now).and_then(
        |(assertion, key)| {
            // Not from itself (a peer URL that leads back here), and never an unverified
            // caller where this node's own snapshot requires keys.
            if assertion.node == policy.node || (!assertion.verified && policy.auth.enabled) {
                Err(hop::HopError::BadSignature)
            } else {
                Ok((assertion, key))
            }
        },
    );
    let (assertion, key) = match verified {
        Ok(verified) => verified,
        Err(error) => {
            let window = policy.auth.window;
            app.throttle.check(peer, policy.auth.max_failures, window)?;
            app.throttle.fail(peer, window);
            tracing::warn!(%peer, %error, "node hop refused");
            return Err(ProxyError::HopUnverified);
        }
    };
    tracing::debug!(edge = %assertion.node, "forwarded by a peer data plane");
    let identity = if assertion.verified {
        // The owner's own snapshot decides the client's ceiling, weight and caps; a client
        // it does not know (not in its snapshot yet, or already gone) is a refusal of this
        // box: another may know it.
        match policy.app_of(&assertion.client) {
            // A user of an app key: the edge read it from the request, as it was configured.
            Some((app, _)) if !app.is_expired(now) => Identity::User {
                app: app.clone(),
                id: assertion.client.clone(),
            },
            Some(_) => return Err(ProxyError::ClientUnknownHere),
            None => {
                let client = policy
                    .clients_by_id
                    .get(&assertion.client)
                    .filter(|client| !client.is_expired(now))
                    .cloned()
                    .ok_or(ProxyError::ClientUnknownHere)?;
                Identity::Client(client)
            }
        }
    } else {
        Identity::Anonymous(Some(assertion.client.clone()))
    };
    let hop = Hop {
        tier: identity.tier(Some(assertion.tier)),
        body: assertion.body,
        claim: claim.clone(),
        key,
    };
    Ok((identity, hop))
}

/// What a verified hop settled for the request it carries.
#[derive(Debug)]
struct Hop {
    /// The tier, after the client's ceiling here.
    tier: crate::scheduler::Tier,
    /// How the edge bound the body: a buffered body must match the digest, a streamed one
    /// its trailer.
    body: hop::Body,
    /// The header, which a streamed body's trailer is bound to.
    claim: HeaderValue,
    /// The key the header verified with, which the trailer must verify with too.
    key: hop::HopKey,
}

impl Hop {
    /// The streamed `body`, passed on only if it is the one the edge signed
    /// ([`hop::streamed::check`]).
    fn check(
        &self,
        key: Option<&hop::HopKey>,
        body: Body,
    ) -> Result<(Body, hop::streamed::Verdict), ProxyError> {
        match (&self.body, key) {
            (hop::Body::Trailer(length), Some(key)) => Ok(hop::streamed::check(
                body,
                key.clone(),
                self.claim.clone(),
                *length,
            )),
            _ => Err(ProxyError::HopUnverified),
        }
    }
}

/// `sent`, unless the streamed body of a hop failed its check on the way (Ollama then
/// never received it whole).
fn unless_unbound(
    verdict: Option<&hop::streamed::Verdict>,
    sent: Result<Response<Body>, ProxyError>,
) -> Result<Response<Body>, ProxyError> {
    match verdict.and_then(hop::streamed::Verdict::refused) {
        Some(error) => {
            tracing::warn!(%error, "node hop refused: its streamed body");
            Err(ProxyError::HopUnverified)
        }
        None => sent,
    }
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
        "/metrics" => metrics::response(&app.metrics, &app.metric_sources()),
        "/dashboard/usage" => {
            dashboard::usage::response(&app.usage, policy, identity.usage_scope())
        }
        _ => dashboard::response(policy),
    })
}

/// Proxies a request. `hopped` is the tier another node's data plane settled for a request it
/// forwarded here: such a request was prepared there (keep_alive, translation, cache), and is
/// queued here, on this node's hosts only.
async fn forward(
    app: &Arc<App>,
    policy: &Arc<Policy>,
    identity: Identity,
    hopped: Option<Hop>,
    trust_users: bool,
    request: Request<Incoming>,
) -> Result<Response<Body>, ProxyError> {
    if app.is_shutting_down() {
        return Err(ProxyError::ShuttingDown);
    }
    // The path classified is the path forwarded: `path_and_query` below is
    // the same bytes, accepted only in the form the upstream routes.
    let path = endpoint::path::canonical(request.uri().path())
        .map_err(|_| ProxyError::PathNotCanonical)?;
    let endpoint = Endpoint::of(path);
    // The routes whose body Ollama reads for its model (`/api/show` also by its `name`).
    // (`eq` on the `str`: a borrow of the `&str` local would keep it in this future's state.)
    let shows = path.eq("/api/show");
    // A transcription's body is a form, read for its model alone (`form`), not as JSON.
    let form = matches!(endpoint, Endpoint::Inference(inference) if !inference.reads_json());
    // A copy names two models, both checked against an allowlist: its (small) body is read.
    let copies = path.eq("/api/copy");
    let ollama_reads_body = matches!(endpoint, Endpoint::Inference(_)) && !form || shows || copies;
    let reads_body = endpoint.reads_body() || copies;
    // A model-management call for a model only OpenAI-compatible engines serve is refused
    // (501): its body is read to see which model it names.
    let manages = translate::manages_models(path) && translate::any_engine(policy);
    let retrieved = path
        .strip_prefix("/v1/models/")
        .filter(|_| endpoint == Endpoint::Metadata)
        .map(str::to_owned);
    if !policy.proxy.allow_model_management {
        match endpoint::access(request.method(), path) {
            Access::Proxied => {}
            Access::ModelManagement => return Err(ProxyError::ModelManagementDisabled),
            Access::Unlisted => return Err(ProxyError::RouteNotProxied),
        }
    }
    let tier = match &hopped {
        Some(hop) => hop.tier,
        None => identity.tier(auth::requested_tier(request.headers())),
    };
    // The key's last use is the app's, whoever of its users called.
    if let Some(key) = identity.key() {
        app.touch(&key.id);
    }
    let key_id = identity.client_id().cloned();

    // A model blob (`ollama create` from a local file) is as large as the model: streamed
    // and paced like any streamed body, never capped by `max_request_body_mb`.
    let uncapped = endpoint::is_blob(path);
    let (mut parts, incoming) = request.into_parts();
    if let Some(hop) = &hopped {
        // A body read whole is bound by its digest, a streamed one by its trailer: the form
        // the route's body does not take is refused.
        if matches!(hop.body, hop::Body::Digest(_)) != reads_body {
            tracing::warn!("node hop refused: its body is not bound as its route needs");
            return Err(ProxyError::HopUnverified);
        }
        // A streamed hop comes chunked, with its length (if it had one) in the header
        // signed: the limit, admission and Ollama see it as the edge received it.
        if let hop::Body::Trailer(Some(length)) = hop.body {
            parts
                .headers
                .insert(header::CONTENT_LENGTH, HeaderValue::from(length));
        }
    }
    let limit = policy.proxy.max_request_body_bytes;
    // Held until this request has an answer's head (or is refused): the
    // body is in memory all that time.
    let mut reservation = app.body_budget.reserve(policy.queue.max_queued_bytes);
    // A streamed hop's check, which may fail it on its way to Ollama.
    let mut verdict = None;
    let over_budget = || {
        let client = key_id.clone().unwrap_or_else(|| Arc::from(ANONYMOUS));
        app.dispatcher.over_capacity(tier, &client)
    };
    // The one reading of a read body: everything below that looks inside it reads this.
    // Boxed: it lives in this future's state, which a waiting request holds.
    let (body, view) = if reads_body {
        let read = proxy::BodyRead {
            limit,
            timeout: policy.proxy.body_read_timeout,
            reservation: &mut reservation,
        };
        let bytes = proxy::read_body(incoming, &parts.headers, read, over_budget).await?;
        let over_budget = || {
            let client = key_id.clone().unwrap_or_else(|| Arc::from(ANONYMOUS));
            app.dispatcher.over_capacity(tier, &client)
        };
        let read = if form {
            BodyView::default()
        } else {
            read_view(&bytes, ollama_reads_body, &mut reservation, over_budget)?
        };
        (RequestBody::Buffered(bytes), Some(Box::new(read)))
    } else {
        let streamed = proxy::stream_body(
            incoming,
            &parts.headers,
            if uncapped { u64::MAX } else { limit },
            policy.proxy.body_read_timeout,
        )?;
        let streamed = match &hopped {
            Some(hop) => {
                let (checked, bound) = hop.check(Some(&hop.key), streamed)?;
                verdict = Some(bound);
                checked
            }
            None => streamed,
        };
        (RequestBody::Streamed(streamed), None)
    };
    let read = match (&body, &view) {
        (RequestBody::Buffered(bytes), Some(view)) => Some((&bytes[..], &**view)),
        _ => None,
    };
    // An app key's end user, from its header or its body field: from here on the caller
    // (only where the user named is believed: not on an injection port that does not say so).
    let identity = if trust_users {
        identity.delegated(&parts.headers, read, &app.key_refresh)?
    } else {
        identity
    };
    let client_id = identity.client_id().cloned();
    let span = tracing::Span::current();
    span.record("client", client_id.as_deref().unwrap_or(ANONYMOUS))
        .record("tier", tier.as_str());
    let session = session_of(&identity, policy, &parts.headers).map(str::to_owned);
    if let Some(session) = &session {
        span.record("session", session.as_str());
    }
    let mut upstream_headers = parts.headers;
    let request_id = upstream_headers.get(headers::REQUEST_ID).cloned();
    headers::for_upstream(&mut upstream_headers, client_id.as_deref());
    headers::strip_delegation(&mut upstream_headers, &policy.delegation_headers);
    // Even when the client's `Connection` named it: the id travels on (and a hop signs it).
    if let Some(id) = request_id {
        upstream_headers.insert(headers::REQUEST_ID, id);
    }
    if let RequestBody::Buffered(_) = body {
        // A read body may be rewritten on its way; hyper sets the length
        // of what is actually sent.
        upstream_headers.remove(header::CONTENT_LENGTH);
    }
    let path_and_query = parts
        .uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
    // The rest of the URI is a view into the connection's read buffer, which
    // a waiting request must not keep alive (see `Outbound::detached`).
    drop(parts.uri);
    let mut outbound = Outbound {
        method: parts.method,
        path_and_query,
        headers: upstream_headers,
        body,
        unstreamed: false,
        openai_embeddings: None,
    };

    if endpoint == Endpoint::Metadata {
        // The fast path: never queued, never capped, no slot; bounded per client, and an app
        // key's users together by the app's own bucket too (new user ids get no new reads).
        let caller = identity.caller();
        if let Some(key) = identity.key()
            && caller.member.is_some()
            && key.id != caller.id
        {
            app.metadata_limit
                .admit(policy.auth.metadata_rate, &key.id)?;
        }
        app.metadata_limit
            .admit(policy.auth.metadata_rate, &caller.id)?;
        // `/v1/models/{model}` names its model in the path; `/api/show` in its body, where
        // Ollama also reads the deprecated `name`; the others name none (a model read from
        // them only orders the hosts).
        let model = match (retrieved, &view) {
            (Some(model), _) => Some(model),
            (None, Some(view)) if shows => view.model_or_name().map(str::to_owned),
            (None, Some(view)) => view.model().map(str::to_owned),
            (None, None) => None,
        };
        match &model {
            Some(model) => identity.allow_model(model)?,
            None if shows && identity.has_allowlist() => return Err(ProxyError::ModelUnreadable),
            None => {}
        }
        return Box::pin(metadata(app, policy, &identity, outbound, model.as_deref())).await;
    }
    let client = identity.caller();
    let mut queue = app.queue_parts();
    if hopped.is_some() {
        queue.peers = None;
    }
    let Endpoint::Inference(inference) = endpoint else {
        if copies {
            copy_allowed(&identity, &outbound.body, view.as_deref())?;
            if let (Some(hop), RequestBody::Buffered(bytes)) = (&hopped, &outbound.body)
                && hop.body != hop::Body::Digest(hop::body_digest(bytes))
            {
                tracing::warn!("node hop refused: the body is not the one signed");
                return Err(ProxyError::HopUnverified);
            }
        }
        // Anything else is queued with its body streamed through, neither accounted nor
        // budgeted (a model pull holds a slot, not the GPU).
        queue.accounted = false;
        if manages && hopped.is_none() {
            outbound.body =
                checked_management(policy, outbound.body, &outbound.path_and_query).await?;
        }
        // Boxed, as the other sends a queued request does not wait in: the future of a
        // request that waits in the queue is sized for its largest path.
        let sent = Box::pin(queued::send(queue, policy, client, tier, None, outbound)).await;
        return unless_unbound(verdict.as_ref(), sent);
    };
    let RequestBody::Buffered(body) =
        std::mem::replace(&mut outbound.body, RequestBody::Buffered(Bytes::new()))
    else {
        return Box::pin(queued::send(queue, policy, client, tier, None, outbound)).await;
    };
    // Read with the body: an inference route always reads it. (One view local, borrowed: a
    // second would keep its own place in this future's state.)
    let read = view.as_deref().unwrap_or(&EMPTY_VIEW);
    let view = read;
    // A model the key may not use is refused before anything else sees the request: no
    // cache, no queue, no host. A key limited to some models names one Ollama reads.
    let model = if inference.reads_json() {
        view.model().map(str::to_owned)
    } else {
        let content_type = outbound.headers.get(header::CONTENT_TYPE);
        let query = outbound.path_and_query.query();
        Some(form::model(content_type, query, &body).map_err(ProxyError::FormUnreadable)?)
    };
    match &model {
        Some(model) => identity.allow_model(model)?,
        None if identity.has_allowlist() => return Err(ProxyError::ModelUnreadable),
        None => {}
    }
    // A generation whose answer comes whole has its head only when it is done.
    outbound.unstreamed = inference
        .streams_by_default()
        .is_some_and(|default| !view.stream(&body).unwrap_or(default));
    // Ollama's own API for a model only OpenAI-compatible engines serve: translated here, and
    // from here on the engine's route (a hop carries the request its edge translated).
    if hopped.is_none()
        && let (Some(model), Some(route)) = (&model, translate::Route::of(inference))
    {
        if translate::served_by_none(policy, model) {
            return Err(translate::not_found(route, model));
        }
        if translate::serves_only_openai(policy, model) {
            let native = Native {
                route,
                model: model.clone(),
                body,
                session,
            };
            return Box::pin(translated(queue, policy, client, tier, native, outbound)).await;
        }
    }
    // Its conversation, for a chat-shaped request (the keep_alive inserted below is not part
    // of it).
    let chain = conversation(
        policy,
        inference,
        &outbound,
        (&body, view),
        &client,
        model.as_deref(),
        session.as_deref(),
    );
    if let Some(hop) = &hopped {
        // The body is the one the edge signed, or the hop is refused.
        if hop.body != hop::Body::Digest(hop::body_digest(&body)) {
            tracing::warn!("node hop refused: the body is not the one signed");
            return Err(ProxyError::HopUnverified);
        }
        outbound.body = RequestBody::Buffered(body);
        return queued::send_conversation(queue, policy, client, tier, model, chain, outbound)
            .await;
    }
    // A native embed with the cache off is an ordinary inference request:
    // it skips the embedding handler's (large) future.
    let cached = policy.embedding_cache.enabled && app.embedding_cache.load().is_some();
    if inference.is_embedding() && (cached || inference == Inference::OpenAiEmbeddings) {
        return Box::pin(embeddings::handle(
            app.embedding_parts(),
            policy,
            client,
            tier,
            inference,
            outbound,
            (body, view.clone()),
        ))
        .await;
    }
    let inputs = view.input_count(&body);
    let body = if inference.takes_keep_alive() {
        // Who may keep its own keep_alive: `KeepAlive::for_caller`.
        let keep_alive =
            (policy.keep_alive).for_caller(policy.queue.model_swap.enabled, client.sets_keep_alive);
        rewrite::insert_keep_alive(&body, view, &keep_alive).unwrap_or(body)
    } else {
        body
    };
    if inference.is_embedding() {
        outbound.body = RequestBody::Buffered(body);
        return Box::pin(embeddings::send_uncached(
            queue, policy, client, tier, outbound, model, inputs,
        ))
        .await;
    }
    outbound.body = RequestBody::Buffered(body);
    queued::send_conversation(queue, policy, client, tier, model, chain, outbound).await
}

/// A model-management request's streamed `body`, read (it is small and bounded like any
/// streamed body) to refuse it when it names a model only `openai` hosts serve, then streamed
/// on as it came.
async fn checked_management(
    policy: &Policy,
    body: RequestBody,
    path: &http::uri::PathAndQuery,
) -> Result<RequestBody, ProxyError> {
    use http_body_util::BodyExt;
    let streamed = match body {
        // A copy's body, already read for the allowlist.
        RequestBody::Buffered(bytes) => {
            translate::check_management(policy, path.path(), &bytes)?;
            return Ok(RequestBody::Buffered(bytes));
        }
        RequestBody::Streamed(streamed) => streamed,
    };
    let bytes = streamed
        .collect()
        .await
        .map_err(|_| ProxyError::BodyUnreadable)?
        .to_bytes();
    translate::check_management(policy, path.path(), &bytes)?;
    Ok(RequestBody::Streamed(body::full(bytes)))
}

/// A native request whose model only `openai` hosts serve.
struct Native {
    route: translate::Route,
    /// The model as the client named it.
    model: String,
    body: Bytes,
    session: Option<String>,
}

/// Sends a native request translated for the engines that serve its model
/// ([`translate`]), queued, budgeted and accounted as the engine's route, and answers in
/// Ollama's shapes.
async fn translated(
    queue: queued::Parts<'_>,
    policy: &Arc<Policy>,
    client: auth::Caller,
    tier: crate::scheduler::Tier,
    native: Native,
    mut outbound: Outbound,
) -> Result<Response<Body>, ProxyError> {
    let received = std::time::Instant::now();
    let upstream_model = translate::upstream_name(policy, &native.model);
    let plan = translate::plan(
        native.route,
        &native.body,
        &native.model,
        &upstream_model,
        received,
    )?;
    let translated = match plan {
        translate::Plan::Answer(answer) => return Ok(answer),
        translate::Plan::Send(translated) => translated,
    };
    outbound.path_and_query = translated.path;
    outbound.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let view = BodyView::read(&translated.body).map_err(|_| ProxyError::BodyNotJson)?;
    let chain = conversation(
        policy,
        translated.inference,
        &outbound,
        (&translated.body, &view),
        &client,
        Some(&native.model),
        native.session.as_deref(),
    );
    drop(view);
    outbound.body = RequestBody::Buffered(translated.body);
    let answer = queued::send_conversation(
        queue,
        policy,
        client,
        tier,
        Some(native.model),
        chain,
        outbound,
    )
    .await?;
    Ok(translate::response(translated.reply, answer))
}

/// The conversation a chat-shaped request continues, for prompt-cache affinity: scoped to
/// its caller (key or app user) unless `routing.affinity.share_across_keys`.
fn conversation(
    policy: &Policy,
    inference: Inference,
    outbound: &Outbound,
    (body, view): (&[u8], &BodyView),
    client: &auth::Caller,
    model: Option<&str>,
    session: Option<&str>,
) -> Option<Arc<affinity::Chain>> {
    let settings = &policy.routing.affinity;
    if !settings.enabled {
        return None;
    }
    let shape = match inference {
        Inference::Generate => affinity::Shape::OllamaGenerate,
        Inference::Chat => affinity::Shape::OllamaChat,
        Inference::OpenAiCompletion if outbound.path_and_query.path() == "/v1/completions" => {
            affinity::Shape::OpenAiCompletion
        }
        Inference::OpenAiCompletion => affinity::Shape::OpenAiChat,
        Inference::AnthropicMessages => affinity::Shape::Messages,
        Inference::OpenAiResponses => affinity::Shape::Responses,
        Inference::Embed
        | Inference::Embeddings
        | Inference::OpenAiEmbeddings
        | Inference::Transcription => return None,
    };
    let model = crate::policy::normalize_model(model?);
    let scope = if settings.share_across_keys {
        ""
    } else {
        &client.id
    };
    affinity::Chain::read(shape, body, view, scope, &model, session).map(Arc::new)
}

/// The one reading of a read `body` ([`BodyView`]). On an inference route and `/api/show`,
/// whose bodies Ollama reads, a body that is not exactly one JSON value is refused: Ollama
/// reads the first value of a body and ignores the rest, and oqp must read what Ollama
/// reads or nothing. Other routes' bodies are only a hint (a model that orders hosts).
///
/// What the reading allocates (at most about the body's size) is charged to the body
/// budget while it runs.
fn read_view(
    body: &[u8],
    ollama_reads: bool,
    reservation: &mut crate::budget::Reservation<'_>,
    over_budget: impl FnOnce() -> ProxyError,
) -> Result<BodyView, ProxyError> {
    let held = reservation.bytes();
    let transient = u64::try_from(body.len()).unwrap_or(u64::MAX);
    if reservation.grow_to(held.saturating_add(transient)).is_err() {
        return Err(over_budget());
    }
    let read = BodyView::read(body);
    reservation.shrink_to(held);
    match read {
        Ok(view) => Ok(view),
        Err(_) if ollama_reads => Err(ProxyError::BodyNotJson),
        Err(_) => Ok(BodyView::default()),
    }
}

/// `/api/copy` by a key with a model allowlist: its `source` and its `destination` (read as
/// Ollama reads them) must both be allowed, so that a forbidden model cannot be copied under
/// an allowed name, nor an allowed one under a name the key could not use.
fn copy_allowed(
    identity: &Identity,
    body: &RequestBody,
    view: Option<&BodyView>,
) -> Result<(), ProxyError> {
    if !identity.has_allowlist() {
        return Ok(());
    }
    let (RequestBody::Buffered(body), Some(view)) = (body, view) else {
        return Err(ProxyError::ModelUnreadable);
    };
    for field in ["source", "destination"] {
        match view.string_at(body, &[field.to_owned()]) {
            Ok(Some(model)) => identity.allow_model(&model)?,
            _ => return Err(ProxyError::ModelUnreadable),
        }
    }
    Ok(())
}

/// The conversation a request names: in its app key's `users.session_header`, else in
/// `routing.affinity.session_header`; at most [`auth::MAX_USER_BYTES`] of printable ASCII,
/// else none.
fn session_of<'a>(
    identity: &Identity,
    policy: &Policy,
    headers: &'a http::HeaderMap,
) -> Option<&'a str> {
    let app = identity
        .key()
        .and_then(|key| key.users.as_ref())
        .and_then(|users| users.session_header.as_ref());
    let value = |name: &http::HeaderName| {
        let value = headers.get(name)?.to_str().ok()?;
        (!value.is_empty()
            && value.len() <= auth::MAX_USER_BYTES
            && value.bytes().all(|byte| byte.is_ascii_graphic()))
        .then_some(value)
    };
    app.and_then(value).or_else(|| {
        policy
            .routing
            .affinity
            .session_header
            .as_ref()
            .and_then(value)
    })
}

/// A metadata read: `/api/tags` and `/api/ps` answer the union over the
/// healthy hosts (every model a client can use, once); `/api/show` goes to
/// a host that has the model; the rest to any healthy host, failing over.
async fn metadata(
    app: &Arc<App>,
    policy: &Arc<Policy>,
    identity: &Identity,
    outbound: Outbound,
    model: Option<&str>,
) -> Result<Response<Body>, ProxyError> {
    let mut hosts = metadata_hosts(policy, model);
    let path = outbound.path_and_query.path().to_owned();
    let listing = outbound.method == Method::GET
        && matches!(path.as_str(), "/api/tags" | "/api/ps" | "/v1/models");
    // OpenAI-compatible engines do not speak Ollama's metadata routes: oqp answers for them
    // from what it knows ([`translate`]), and asks an Ollama host first for the rest.
    let engines = hosts.iter().any(|host| host.kind == HostKind::Openai);
    if engines && !listing {
        let only_engines = hosts.iter().all(|host| host.kind == HostKind::Openai);
        let native = matches!(outbound.method, Method::GET | Method::HEAD | Method::POST);
        match path.as_str() {
            "/api/show" => {
                if let Some(shown) = model.and_then(|model| translate::show(policy, model)) {
                    return Ok(translate_metadata(shown));
                }
            }
            "/api/version" if only_engines && native => {
                return Ok(translate_metadata(translate::version()));
            }
            "/" if only_engines && native => {
                let mut response = Response::new(body::full("Ollama is running"));
                response.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; charset=utf-8"),
                );
                return Ok(response);
            }
            _ => {}
        }
        // Stable: Ollama hosts first, in their order.
        hosts.sort_by_key(|host| host.kind == HostKind::Openai);
    }
    // A key limited to some models sees only those: its listings are read whole and
    // filtered, even from one host.
    let filtered = listing && identity.has_allowlist();
    if filtered || (listing && path != "/v1/models" && (hosts.len() > 1 || engines)) {
        let mut response = union_response(app, policy, &hosts, outbound, &path).await?;
        if filtered {
            response = filter_listing(response, &path, identity).await?;
        }
        return Ok(response);
    }
    let active = app.track_active();
    let answer = proxy::send(
        &app.upstream,
        policy.proxy.request_timeout,
        &hosts,
        outbound,
        |host, _| app.metrics.host_failure(&host.name),
    )
    .await?;
    app.metrics.host_request(&answer.host.name);
    for _ in &answer.failed {
        app.metrics.failover();
    }
    Ok(proxy::respond(
        answer,
        Some(Box::new(active)),
        None,
        policy.proxy.upstream_stall_timeout,
    ))
}

/// A metadata answer oqp writes for OpenAI-compatible engines, in Ollama's content type.
fn translate_metadata(value: serde_json::Value) -> Response<Body> {
    let mut response = Response::new(body::json(&value));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json; charset=utf-8"),
    );
    response
}

/// Asks every host at once and merges their model lists.
async fn union_response(
    app: &Arc<App>,
    policy: &Arc<Policy>,
    hosts: &[Arc<Host>],
    outbound: Outbound,
    path: &str,
) -> Result<Response<Body>, ProxyError> {
    use http_body_util::BodyExt;
    // The engines' entries come from what oqp knows of them ([`translate`]); `/v1/models`
    // they answer themselves.
    let ollama_listing = matches!(path, "/api/tags" | "/api/ps");
    let engines: Vec<Arc<Host>> = hosts
        .iter()
        .filter(|host| ollama_listing && host.kind == HostKind::Openai)
        .cloned()
        .collect();
    let asks = hosts
        .iter()
        .filter(|host| !(ollama_listing && host.kind == HostKind::Openai))
        .map(|host| {
            let request = proxy::request_for(
                host,
                &outbound.method,
                &outbound.path_and_query,
                &outbound.headers,
                body::empty(),
            );
            async move {
                // A host that does not answer with a list is left out and named in the 503
                // if no host does.
                let failed = |cause: Cause| Err((host.name.clone(), cause));
                let Ok(request) = request else {
                    return failed(Cause::ConnectionFailed);
                };
                let response = match app
                    .upstream
                    .send(request, policy.proxy.request_timeout)
                    .await
                {
                    Ok(response) => response,
                    Err(error) => return failed(error.cause()),
                };
                if !response.status().is_success() {
                    return failed(Cause::Http(response.status()));
                }
                // Bounded like any upstream body: a host that sends its head
                // and then nothing must not hold the union.
                let bytes = match tokio::time::timeout(
                    policy.proxy.upstream_stall_timeout,
                    response.into_body().collect(),
                )
                .await
                {
                    Ok(Ok(collected)) => collected.to_bytes(),
                    Ok(Err(_)) => return failed(Cause::ConnectionClosed),
                    Err(_) => return failed(Cause::Timeout),
                };
                match serde_json::from_slice::<serde_json::Value>(&bytes) {
                    Ok(value) => Ok((host.name.clone(), value)),
                    Err(_) => failed(Cause::InvalidAnswer),
                }
            }
        });
    let mut answers: Vec<(Arc<str>, serde_json::Value)> = Vec::new();
    let mut failures = Failures::none();
    for outcome in futures_util::future::join_all(asks).await {
        match outcome {
            Ok(answer) => answers.push(answer),
            Err((host, cause)) => failures.push(host, cause),
        }
    }
    for host in &engines {
        let listed = translate::listing_entries(std::slice::from_ref(host), path);
        answers.push((host.name.clone(), listed));
    }
    if answers.is_empty() {
        return Err(ProxyError::AllHostsFailed(failures));
    }
    let bodies: Vec<serde_json::Value> = answers.iter().map(|(_, body)| body.clone()).collect();
    let merged = match path {
        "/api/ps" => crate::router::union_ps(&bodies),
        "/v1/models" => crate::router::union_openai_models(&bodies),
        _ => crate::router::union_tags(&bodies),
    };
    let mut response = Response::new(body::json(&merged));
    let names: Vec<&str> = answers.iter().map(|(name, _)| &**name).collect();
    let map = response.headers_mut();
    map.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json; charset=utf-8"),
    );
    if let Ok(value) = HeaderValue::from_str(&names.join(", ")) {
        map.insert(headers::FAILOVER_HOST, value);
    }
    Ok(response)
}

/// A listing (`/api/tags`, `/api/ps`, `/v1/models`) with only the models `identity` may use.
async fn filter_listing(
    response: Response<Body>,
    path: &str,
    identity: &Identity,
) -> Result<Response<Body>, ProxyError> {
    use http_body_util::BodyExt;
    let (mut parts, body) = response.into_parts();
    let bytes = body
        .collect()
        .await
        .map_err(|_| ProxyError::hosts_failed())?
        .to_bytes();
    let mut value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|_| ProxyError::hosts_failed())?;
    let (list, field) = if path == "/v1/models" {
        ("data", "id")
    } else {
        ("models", "name")
    };
    if let Some(entries) = value
        .get_mut(list)
        .and_then(serde_json::Value::as_array_mut)
    {
        entries.retain(|entry| {
            entry
                .get(field)
                .or_else(|| entry.get("model"))
                .and_then(serde_json::Value::as_str)
                .is_some_and(|name| identity.may_use(name))
        });
    }
    parts.headers.remove(header::CONTENT_LENGTH);
    Ok(Response::from_parts(parts, body::json(&value)))
}

/// Hosts for a metadata request: the healthy ones (all when none is marked
/// healthy), those that have `model` installed first. Hosts other nodes own
/// are read too: a read takes no slot, and `/api/tags` lists every model a
/// client can use through any box.
fn metadata_hosts(policy: &Policy, model: Option<&str>) -> Vec<Arc<Host>> {
    let every = || policy.hosts.iter().chain(&policy.remote);
    let mut hosts: Vec<Arc<Host>> = every().filter(|h| h.healthy).cloned().collect();
    if hosts.is_empty() {
        hosts = every().cloned().collect();
    }
    if let Some(model) = model {
        let model = crate::policy::normalize_model(model);
        // Stable: hosts with the model keep their order, ahead of the rest.
        hosts.sort_by_key(|host| !host.installed.contains(&model));
    }
    hosts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::BodyBudget;

    #[test]
    fn a_reading_is_charged_to_the_body_budget_while_it_runs() {
        let body = br#"{"model":"m","prompt":"0123456789012345678901234567890123"}"#;
        let held = body.len() as u64;
        let budget = BodyBudget::default();
        let mut other = budget.reserve(2 * held + 9);
        other.grow_to(10).unwrap();
        let mut reservation = budget.reserve(2 * held + 9);
        reservation.grow_to(held).unwrap();
        // The body and its reading do not fit beside another body: refused.
        let refused = read_view(body, true, &mut reservation, || ProxyError::BodyTooLarge);
        assert!(matches!(refused, Err(ProxyError::BodyTooLarge)));
        assert_eq!((reservation.bytes(), budget.used()), (held, held + 10));
        drop(other);
        let view = read_view(body, true, &mut reservation, || ProxyError::BodyTooLarge).unwrap();
        assert_eq!(view.model(), Some("m"));
        // Given back once read.
        assert_eq!((reservation.bytes(), budget.used()), (held, held));
    }

    #[test]
    fn a_body_ollama_reads_is_one_json_value_or_refused() {
        let budget = BodyBudget::default();
        let mut reservation = budget.reserve(1 << 20);
        let mut read = |body: &[u8], ollama_reads| {
            read_view(body, ollama_reads, &mut reservation, || {
                ProxyError::BodyTooLarge
            })
        };
        assert!(matches!(
            read(br#"{"model":"m"} x"#, true),
            Err(ProxyError::BodyNotJson)
        ));
        // Elsewhere a body is only a hint: read as naming nothing.
        assert_eq!(
            read(br#"{"model":"m"} x"#, false).unwrap(),
            BodyView::default()
        );
        assert_eq!(
            read(b" {\"model\":\"m\"}\n", true).unwrap().model(),
            Some("m")
        );
    }
}
