//! The preparing phase: a request's path classified, its body read (once, bounded, charged
//! to the body budget) or streamed, its caller and tier settled, and the request sent on to
//! the phase its route belongs to: metadata, inference, or anything else queued as it came.

use std::sync::Arc;

use http::{HeaderValue, Request, Response, header};
use hyper::body::Incoming;

use bytes::Bytes;

use crate::app::App;
use crate::auth::{self, ANONYMOUS, Identity};
use crate::body::{self, Body};
use crate::budget::Reservation;
use crate::embeddings;
use crate::endpoint::{self, Access, Endpoint, Inference};
use crate::error::ProxyError;
use crate::form;
use crate::headers;
use crate::hop;
use crate::hop::streamed::Verdict;
use crate::policy::Policy;
use crate::proxy::{self, Outbound, RequestBody};
use crate::queued;
use crate::rewrite;
use crate::scheduler::Tier;
use crate::translate;
use crate::view::BodyView;

use super::hop_owner::{Hop, unless_unbound};
use super::inference::{Native, conversation, translated};
use super::metadata::metadata;

/// The reading of a body that says nothing.
static EMPTY_VIEW: BodyView = BodyView::EMPTY;

/// Proxies a request. `hopped` is the tier another node's data plane settled for a request it
/// forwarded here: such a request was prepared there (keep_alive, translation, cache), and is
/// queued here, on this node's hosts only.
///
/// The phases: the path classified and the tier settled ([`begin`]), the body read or
/// streamed ([`read`]), the caller settled and the request made the one sent upstream
/// ([`settle`]); then the route's own phase (metadata, or [`queue`]). The phases that look
/// inside the request are plain functions over references: only what waits holds this
/// future's state.
pub(super) async fn forward(
    app: &Arc<App>,
    policy: &Arc<Policy>,
    identity: Identity,
    hopped: Option<Hop>,
    trust_users: bool,
    request: Request<Incoming>,
) -> Result<Response<Body>, ProxyError> {
    let (route, tier, parts, incoming) = begin(app, policy, &identity, hopped.as_ref(), request)?;
    // Held until this request has an answer's head (or is refused): the
    // body is in memory all that time.
    let mut reservation = app.body_budget.reserve(policy.queue.max_queued_bytes);
    let reading = Reading {
        app,
        policy,
        tier,
        client: identity.client_id(),
        hop: hopped.as_ref(),
    };
    let (parts, body, view, verdict) =
        read(reading, &route, parts, incoming, &mut reservation).await?;
    let (identity, session, outbound) = settle(
        app,
        policy,
        (identity, trust_users),
        tier,
        (parts, body),
        view.as_deref(),
    )?;
    if route.endpoint == Endpoint::Metadata {
        let model = metadata_model(app, policy, &identity, &route, view.as_deref())?;
        return Box::pin(metadata(app, policy, &identity, outbound, model.as_deref())).await;
    }
    let prepared = Prepared {
        app,
        policy,
        identity: &identity,
        hop: hopped.as_ref(),
        tier,
        view: view.as_deref(),
        session: session.as_deref(),
    };
    queue(prepared, &route, outbound, verdict).await
}

/// The queued phase: the request the queued path sends, built here once (its model and
/// conversation set where they are read), sent as its route needs. A streamed hop's body
/// that failed its check on the way fails the request (`verdict`).
async fn queue(
    prepared: Prepared<'_>,
    route: &Classified,
    outbound: Outbound,
    verdict: Option<Verdict>,
) -> Result<Response<Body>, ProxyError> {
    let Prepared { app, policy, .. } = prepared;
    let request = queued::Request {
        hopped: prepared.hop.is_some(),
        ..queued::Request::inference(prepared.identity.caller(), prepared.tier, None)
    };
    let queue = app.queue_parts();
    let Endpoint::Inference(inference) = route.endpoint else {
        let manages = other_allowed(prepared, route, &outbound)?;
        // Boxed, as the other sends a queued request does not wait in: the future of a
        // request that waits in the queue is sized for its largest path.
        let sent = Box::pin(other(queue, policy, request, outbound, manages)).await;
        return unless_unbound(verdict.as_ref(), sent);
    };
    // (A named value, not a temporary: a temporary matched on lives across the send.)
    let next = inference_next(prepared, inference, request, outbound)?;
    match next {
        Next::Queue(request, outbound) => {
            queued::send(queue, policy, request, outbound, || {}).await
        }
        cold => Box::pin(send_cold(prepared, inference, cold)).await,
    }
}

/// The rarer sends of an inference request, boxed: a translated request, an embedding
/// through the cache or with the cache off.
async fn send_cold(
    prepared: Prepared<'_>,
    inference: Inference,
    next: Next,
) -> Result<Response<Body>, ProxyError> {
    let Prepared { app, policy, .. } = prepared;
    let queue = app.queue_parts();
    match next {
        Next::Queue(request, outbound) => {
            queued::send(queue, policy, request, outbound, || {}).await
        }
        Next::Translate(request, native, outbound) => {
            translated(queue, policy, request, native, outbound).await
        }
        Next::Embed(request, outbound, body) => {
            let view = prepared.view.unwrap_or(&EMPTY_VIEW).clone();
            let (caller, tier) = (request.caller, request.tier);
            let parts = app.embedding_parts();
            let view = (body, view);
            embeddings::handle(parts, policy, caller, tier, inference, outbound, view).await
        }
        Next::EmbedUncached(request, outbound, inputs) => {
            embeddings::send_uncached(queue, policy, request, outbound, inputs).await
        }
    }
}

/// The phase before the body: refused while shutting down, the path classified, the tier
/// settled (a hop's as its edge settled it), the key's use noted, a hop's body binding
/// checked against its route.
fn begin(
    app: &App,
    policy: &Policy,
    identity: &Identity,
    hop: Option<&Hop>,
    request: Request<Incoming>,
) -> Result<(Classified, Tier, http::request::Parts, Incoming), ProxyError> {
    if app.is_shutting_down() {
        return Err(ProxyError::ShuttingDown);
    }
    let route = Classified::of(policy, request.method(), request.uri().path())?;
    let tier = match hop {
        Some(hop) => hop.tier,
        None => identity.tier(auth::requested_tier(request.headers())),
    };
    // The key's last use is the app's, whoever of its users called.
    if let Some(key) = identity.key() {
        app.touch(&key.id);
    }
    let (mut parts, incoming) = request.into_parts();
    if let Some(hop) = hop {
        hop_body_bound(hop, route.reads_body(), &mut parts.headers)?;
    }
    Ok((route, tier, parts, incoming))
}

/// What a request's path says of it, read before its body.
#[derive(Debug)]
struct Classified {
    endpoint: Endpoint,
    /// `/api/show`, whose model Ollama also reads from its deprecated `name`.
    shows: bool,
    /// A transcription: its body is a form, read for its model alone ([`form`]), not as JSON.
    form: bool,
    /// `/api/copy`, which names two models, both checked against an allowlist: its (small)
    /// body is read.
    copies: bool,
    /// A model-management call, refused (501) for a model only OpenAI-compatible engines
    /// serve: its body is read to see which model it names.
    manages: bool,
    /// The model `/v1/models/{model}` names in its path.
    retrieved: Option<String>,
    /// A model blob (`ollama create` from a local file), as large as the model: streamed
    /// and paced like any streamed body, never capped by `max_request_body_mb`.
    uncapped: bool,
}

impl Classified {
    /// The request's `path` classified. The path classified is the path forwarded: the
    /// `path_and_query` sent upstream is the same bytes, accepted only in the form the
    /// upstream routes. With model management off, only the routes on the allowlist pass.
    fn of(policy: &Policy, method: &http::Method, path: &str) -> Result<Self, ProxyError> {
        let path = endpoint::path::canonical(path).map_err(|_| ProxyError::PathNotCanonical)?;
        let endpoint = Endpoint::of(path);
        if !policy.proxy.allow_model_management {
            match endpoint::access(method, path) {
                Access::Proxied => {}
                Access::ModelManagement => return Err(ProxyError::ModelManagementDisabled),
                Access::Unlisted => return Err(ProxyError::RouteNotProxied),
            }
        }
        Ok(Self {
            endpoint,
            shows: path == "/api/show",
            form: matches!(endpoint, Endpoint::Inference(inference) if !inference.reads_json()),
            copies: path == "/api/copy",
            manages: translate::manages_models(path) && translate::any_engine(policy),
            retrieved: path
                .strip_prefix("/v1/models/")
                .filter(|_| endpoint == Endpoint::Metadata)
                .map(str::to_owned),
            uncapped: endpoint::is_blob(path),
        })
    }

    /// Whether the body is read whole.
    fn reads_body(&self) -> bool {
        self.endpoint.reads_body() || self.copies
    }

    /// Whether Ollama reads the body for its model: then oqp reads exactly what Ollama
    /// reads, or refuses ([`read_view`]).
    fn ollama_reads_body(&self) -> bool {
        matches!(self.endpoint, Endpoint::Inference(_)) && !self.form || self.shows || self.copies
    }
}

/// A hop's body bound as its route needs: a body read whole by its digest, a streamed one by
/// its trailer (the form the route's body does not take is refused). A streamed hop comes
/// chunked, with its length (if it had one) in the header signed: the limit, admission and
/// Ollama see it as the edge received it.
fn hop_body_bound(
    hop: &Hop,
    reads_body: bool,
    headers: &mut http::HeaderMap,
) -> Result<(), ProxyError> {
    if matches!(hop.body, hop::Body::Digest(_)) != reads_body {
        tracing::warn!("node hop refused: its body is not bound as its route needs");
        return Err(ProxyError::HopUnverified);
    }
    if let hop::Body::Trailer(Some(length)) = hop.body {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    }
    Ok(())
}

/// A hop's body read whole is the one its edge signed, or the hop is refused.
fn hop_body_signed(hop: Option<&Hop>, body: &[u8]) -> Result<(), ProxyError> {
    match hop {
        Some(hop) if hop.body != hop::Body::Digest(hop::body_digest(body)) => {
            tracing::warn!("node hop refused: the body is not the one signed");
            Err(ProxyError::HopUnverified)
        }
        _ => Ok(()),
    }
}

/// What reading a request's body reads of it and of the data plane.
#[derive(Clone, Copy)]
struct Reading<'a> {
    app: &'a App,
    policy: &'a Policy,
    tier: Tier,
    /// The key's client, whose share of the queue a body over the byte budget is refused as.
    client: Option<&'a Arc<str>>,
    hop: Option<&'a Hop>,
}

/// A request's head and body, the one reading of a body read whole, and a streamed hop
/// body's check.
type Read = (
    http::request::Parts,
    RequestBody,
    Option<Box<BodyView>>,
    Option<Verdict>,
);

/// The body of a request, read whole (once, bounded, charged to the body budget by
/// `reservation`) with its one reading ([`read_view`]: everything after this that looks
/// inside the body reads it), or streamed; a streamed hop's body with the check that may
/// fail it on its way to Ollama. The reading is boxed: it lives in the future of a request
/// that waits.
async fn read(
    reading: Reading<'_>,
    route: &Classified,
    parts: http::request::Parts,
    incoming: Incoming,
    reservation: &mut Reservation<'_>,
) -> Result<Read, ProxyError> {
    let Reading {
        app,
        policy,
        tier,
        client,
        hop,
    } = reading;
    let limit = policy.proxy.max_request_body_bytes;
    let timeout = policy.proxy.body_read_timeout;
    if !route.reads_body() {
        let limit = if route.uncapped { u64::MAX } else { limit };
        let streamed = proxy::stream_body(incoming, &parts.headers, limit, timeout)?;
        return Ok(match hop {
            Some(hop) => {
                let (checked, verdict) = hop.check(Some(&hop.key), streamed)?;
                (parts, RequestBody::Streamed(checked), None, Some(verdict))
            }
            None => (parts, RequestBody::Streamed(streamed), None, None),
        });
    }
    let over_budget = || {
        let client = client.cloned().unwrap_or_else(|| Arc::from(ANONYMOUS));
        app.dispatcher.over_capacity(tier, &client)
    };
    let read = proxy::BodyRead {
        limit,
        timeout,
        reservation: &mut *reservation,
    };
    let bytes = proxy::read_body(incoming, &parts.headers, read, over_budget).await?;
    let view = if route.form {
        BodyView::default()
    } else {
        read_view(&bytes, route.ollama_reads_body(), reservation, over_budget)?
    };
    Ok((
        parts,
        RequestBody::Buffered(bytes),
        Some(Box::new(view)),
        None,
    ))
}

/// The caller from here on, the conversation it names (`session_of`) and the request as it
/// goes upstream ([`outbound_of`]): an app key's end user, from its header or its body field
/// (only where the user named is believed, `trusted`: not on an injection port that does not
/// say so). The request's span names them and the tier.
fn settle(
    app: &App,
    policy: &Policy,
    (identity, trusted): (Identity, bool),
    tier: Tier,
    (parts, body): (http::request::Parts, RequestBody),
    view: Option<&BodyView>,
) -> Result<(Identity, Option<String>, Outbound), ProxyError> {
    let read = match (&body, view) {
        (RequestBody::Buffered(bytes), Some(view)) => Some((&bytes[..], view)),
        _ => None,
    };
    let identity = if trusted {
        identity.delegated(&parts.headers, read, &app.key_refresh)?
    } else {
        identity
    };
    let span = tracing::Span::current();
    let client = identity.client_id().map(|id| &**id);
    span.record("client", client.unwrap_or(ANONYMOUS))
        .record("tier", tier.as_str());
    let session = session_of(&identity, policy, &parts.headers).map(str::to_owned);
    if let Some(session) = &session {
        span.record("session", session.as_str());
    }
    let outbound = outbound_of(parts, body, policy, client);
    Ok((identity, session, outbound))
}

/// The request as it goes upstream: its headers cleaned for the upstream (the caller's
/// credentials and the delegation headers out, `X-Request-ID` kept), its path and query.
fn outbound_of(
    parts: http::request::Parts,
    body: RequestBody,
    policy: &Policy,
    client: Option<&str>,
) -> Outbound {
    let mut upstream_headers = parts.headers;
    let request_id = upstream_headers.get(headers::REQUEST_ID).cloned();
    headers::for_upstream(&mut upstream_headers, client);
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
    // The rest of the URI is a view into the connection's read buffer, which a waiting
    // request must not keep alive (see `Outbound::detached`): only this is kept.
    let path_and_query = parts
        .uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
    Outbound {
        method: parts.method,
        path_and_query,
        headers: upstream_headers,
        body,
        unstreamed: false,
        openai_embeddings: None,
    }
}

/// The fast path's admission and model: never queued, never capped, no slot; bounded per
/// client, and an app key's users together by the app's own bucket too (new user ids get
/// no new reads). `/v1/models/{model}` names its model in the path; `/api/show` in its
/// body, where Ollama also reads the deprecated `name`; the others name none (a model read
/// from them only orders the hosts).
fn metadata_model(
    app: &App,
    policy: &Policy,
    identity: &Identity,
    route: &Classified,
    view: Option<&BodyView>,
) -> Result<Option<String>, ProxyError> {
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
    let model = match (&route.retrieved, view) {
        (Some(model), _) => Some(model.clone()),
        (None, Some(view)) if route.shows => view.model_or_name().map(str::to_owned),
        (None, Some(view)) => view.model().map(str::to_owned),
        (None, None) => None,
    };
    match &model {
        Some(model) => identity.allow_model(model)?,
        None if route.shows && identity.has_allowlist() => return Err(ProxyError::ModelUnreadable),
        None => {}
    }
    Ok(model)
}

/// Checks a request on neither the metadata nor an inference route: a copy's models against
/// the allowlist (and a hop's copy body against its signature). Whether it is a
/// model-management call to read for an engine's model ([`checked_management`]).
fn other_allowed(
    prepared: Prepared<'_>,
    route: &Classified,
    outbound: &Outbound,
) -> Result<bool, ProxyError> {
    if route.copies {
        copy_allowed(prepared.identity, &outbound.body, prepared.view)?;
        if let RequestBody::Buffered(bytes) = &outbound.body {
            hop_body_signed(prepared.hop, bytes)?;
        }
    }
    Ok(route.manages && prepared.hop.is_none())
}

/// Anything else: queued with its body streamed through, neither accounted nor budgeted (a
/// model pull holds a slot, not the GPU); a model-management call read first when it may
/// name an engine's model (`manages`).
async fn other(
    queue: queued::Parts<'_>,
    policy: &Arc<Policy>,
    request: queued::Request,
    mut outbound: Outbound,
    manages: bool,
) -> Result<Response<Body>, ProxyError> {
    let request = queued::Request {
        accounted: false,
        ..request
    };
    if manages {
        outbound.body = checked_management(policy, outbound.body, &outbound.path_and_query).await?;
    }
    queued::send(queue, policy, request, outbound, || {}).await
}

/// A prepared request, borrowed: what the phases after the body read read of it.
#[derive(Clone, Copy)]
struct Prepared<'a> {
    app: &'a Arc<App>,
    policy: &'a Arc<Policy>,
    identity: &'a Identity,
    hop: Option<&'a Hop>,
    tier: Tier,
    /// The one reading of a body read whole.
    view: Option<&'a BodyView>,
    /// The conversation the request names in a header.
    session: Option<&'a str>,
}

/// Where an inference request goes from here.
enum Next {
    /// Queued (its model and, for a chat-shaped request, its conversation set).
    Queue(queued::Request, Outbound),
    /// Translated for the engines that serve its model.
    Translate(queued::Request, Native, Outbound),
    /// Through the embedding cache, with its body.
    Embed(queued::Request, Outbound, Bytes),
    /// An embedding with the cache off: an ordinary inference request (it skips the
    /// embedding handler's large future), with the inputs it counts.
    EmbedUncached(queued::Request, Outbound, u64),
}

/// The inference phase, up to its send: the model (a model the key may not use is refused
/// before anything else sees the request: no cache, no queue, no host; a key limited to
/// some models names one Ollama reads), whether the answer streams, a translation, the
/// conversation, a hop's signed body, the embedding cache, the keep_alive.
fn inference_next(
    read: Prepared<'_>,
    inference: Inference,
    mut request: queued::Request,
    mut outbound: Outbound,
) -> Result<Next, ProxyError> {
    // Read with the body: an inference route always reads it.
    let (policy, view) = (read.policy, read.view.unwrap_or(&EMPTY_VIEW));
    let body = match std::mem::replace(&mut outbound.body, RequestBody::Buffered(Bytes::new())) {
        RequestBody::Buffered(body) => body,
        streamed => {
            outbound.body = streamed;
            return Ok(Next::Queue(request, outbound));
        }
    };
    let model = inference_model(read.identity, inference, &outbound, &body, view)?;
    // A generation whose answer comes whole has its head only when it is done.
    outbound.unstreamed = inference
        .streams_by_default()
        .is_some_and(|default| !view.stream(&body).unwrap_or(default));
    if let Some(native) = translation(&read, inference, model.as_deref(), &body)? {
        return Ok(Next::Translate(request, native, outbound));
    }
    // Its conversation, for a chat-shaped request (the keep_alive inserted below is not
    // part of it).
    let (caller, session) = (&request.caller, read.session);
    let chain = conversation(
        policy,
        inference,
        &outbound,
        (&body, view),
        caller,
        model.as_deref(),
        session,
    );
    if read.hop.is_some() {
        hop_body_signed(read.hop, &body)?;
        outbound.body = RequestBody::Buffered(body);
        (request.model, request.chain) = (model, chain);
        return Ok(Next::Queue(request, outbound));
    }
    let cached = policy.embedding_cache.enabled && read.app.embedding_cache.load().is_some();
    if inference.is_embedding() && (cached || inference == Inference::OpenAiEmbeddings) {
        return Ok(Next::Embed(request, outbound, body));
    }
    let inputs = view.input_count(&body);
    outbound.body = RequestBody::Buffered(keep_alive(policy, inference, &request, body, view));
    request.model = model;
    if inference.is_embedding() {
        return Ok(Next::EmbedUncached(request, outbound, inputs));
    }
    request.chain = chain;
    Ok(Next::Queue(request, outbound))
}

/// The body with the keep_alive its caller gets, on a route that takes one (who may keep its
/// own: `KeepAlive::for_caller`).
fn keep_alive(
    policy: &Policy,
    inference: Inference,
    request: &queued::Request,
    body: Bytes,
    view: &BodyView,
) -> Bytes {
    if !inference.takes_keep_alive() {
        return body;
    }
    let swaps = policy.queue.model_swap.enabled;
    let keep_alive = (policy.keep_alive).for_caller(swaps, request.caller.sets_keep_alive);
    rewrite::insert_keep_alive(&body, view, &keep_alive).unwrap_or(body)
}

/// The model an inference request names (in its JSON body, or a transcription's form),
/// checked against the key's allowlist.
fn inference_model(
    identity: &Identity,
    inference: Inference,
    outbound: &Outbound,
    body: &Bytes,
    view: &BodyView,
) -> Result<Option<String>, ProxyError> {
    let model = if inference.reads_json() {
        view.model().map(str::to_owned)
    } else {
        let content_type = outbound.headers.get(header::CONTENT_TYPE);
        let query = outbound.path_and_query.query();
        Some(form::model(content_type, query, body).map_err(ProxyError::FormUnreadable)?)
    };
    match &model {
        Some(model) => identity.allow_model(model)?,
        None if identity.has_allowlist() => return Err(ProxyError::ModelUnreadable),
        None => {}
    }
    Ok(model)
}

/// Ollama's own API for a model only OpenAI-compatible engines serve: translated, and from
/// there on the engine's route (a hop carries the request its edge translated). A model no
/// host serves is Ollama's 404.
fn translation(
    read: &Prepared<'_>,
    inference: Inference,
    model: Option<&str>,
    body: &Bytes,
) -> Result<Option<Native>, ProxyError> {
    let policy = read.policy;
    let (None, Some(model), Some(route)) = (read.hop, model, translate::Route::of(inference))
    else {
        return Ok(None);
    };
    if translate::served_by_none(policy, model) {
        return Err(translate::not_found(route, model));
    }
    if !translate::serves_only_openai(policy, model) {
        return Ok(None);
    }
    Ok(Some(Native {
        route,
        model: model.to_owned(),
        body: body.clone(),
        session: read.session.map(str::to_owned),
        cache: read.app.cache().filter(|_| policy.embedding_cache.enabled),
    }))
}

/// A model-management request's streamed `body`, read (it is small and bounded like any
/// streamed body) to refuse it when it names a model only `openai` hosts serve, then streamed
/// on as it came.
pub(super) async fn checked_management(
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

/// The one reading of a read `body` ([`BodyView`]). On an inference route and `/api/show`,
/// whose bodies Ollama reads, a body that is not exactly one JSON value is refused: Ollama
/// reads the first value of a body and ignores the rest, and oqp must read what Ollama
/// reads or nothing. Other routes' bodies are only a hint (a model that orders hosts).
///
/// What the reading allocates (at most about the body's size) is charged to the body
/// budget while it runs.
pub(super) fn read_view(
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
pub(super) fn copy_allowed(
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
pub(super) fn session_of<'a>(
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
