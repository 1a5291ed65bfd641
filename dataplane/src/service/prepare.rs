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
use crate::embeddings;
use crate::endpoint::{self, Access, Endpoint, Inference};
use crate::error::ProxyError;
use crate::form;
use crate::headers;
use crate::hop;
use crate::policy::Policy;
use crate::proxy::{self, Outbound, RequestBody};
use crate::queued;
use crate::rewrite;
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
pub(super) async fn forward(
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
    // The request the queued path sends, built here once: its model and conversation are
    // set below, where they are read.
    let mut request = queued::Request {
        hopped: hopped.is_some(),
        ..queued::Request::inference(identity.caller(), tier, None)
    };
    let queue = app.queue_parts();
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
        request.accounted = false;
        if manages && hopped.is_none() {
            outbound.body =
                checked_management(policy, outbound.body, &outbound.path_and_query).await?;
        }
        // Boxed, as the other sends a queued request does not wait in: the future of a
        // request that waits in the queue is sized for its largest path.
        let sent = Box::pin(queued::send(queue, policy, request, outbound, || {})).await;
        return unless_unbound(verdict.as_ref(), sent);
    };
    let RequestBody::Buffered(body) =
        std::mem::replace(&mut outbound.body, RequestBody::Buffered(Bytes::new()))
    else {
        return Box::pin(queued::send(queue, policy, request, outbound, || {})).await;
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
                cache: app.cache().filter(|_| policy.embedding_cache.enabled),
            };
            return Box::pin(translated(queue, policy, request, native, outbound)).await;
        }
    }
    // Its conversation, for a chat-shaped request (the keep_alive inserted below is not part
    // of it).
    let chain = conversation(
        policy,
        inference,
        &outbound,
        (&body, view),
        &request.caller,
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
        request.model = model;
        request.chain = chain;
        return queued::send(queue, policy, request, outbound, || {}).await;
    }
    // A native embed with the cache off is an ordinary inference request:
    // it skips the embedding handler's (large) future.
    let cached = policy.embedding_cache.enabled && app.embedding_cache.load().is_some();
    if inference.is_embedding() && (cached || inference == Inference::OpenAiEmbeddings) {
        return Box::pin(embeddings::handle(
            app.embedding_parts(),
            policy,
            request.caller,
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
        let keep_alive = (policy.keep_alive).for_caller(
            policy.queue.model_swap.enabled,
            request.caller.sets_keep_alive,
        );
        rewrite::insert_keep_alive(&body, view, &keep_alive).unwrap_or(body)
    } else {
        body
    };
    if inference.is_embedding() {
        outbound.body = RequestBody::Buffered(body);
        request.model = model;
        return Box::pin(embeddings::send_uncached(
            queue, policy, request, outbound, inputs,
        ))
        .await;
    }
    outbound.body = RequestBody::Buffered(body);
    request.model = model;
    request.chain = chain;
    queued::send(queue, policy, request, outbound, || {}).await
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
