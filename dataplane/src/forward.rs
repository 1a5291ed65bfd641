//! Sending a dispatched request upstream: failover before the first byte,
//! "model not found" invalidation, and the Ollama Cloud key pool.
//!
//! Nothing has reached the client while this runs, so every retry here is
//! invisible to it:
//!
//! - connect error or a connection broken before the head → the host is
//!   marked down until its next poll, and the request moves to another host
//!   with a free slot;
//! - no head within the head timeout (`request_timeout`, or
//!   `non_streamed_timeout` for a generation answered whole) → the request
//!   may be running there still: it is not sent anywhere else (it would run
//!   twice), the host is not marked down (it is busy, not gone), and the
//!   client gets a 503;
//! - `503 server busy` → another host, without marking this one down;
//! - `404 model not found` → `(host, model)` leaves the routing table until
//!   the next poll, and the request moves to another host that has it;
//! - a cloud host → the pool's keys in order (account-aware rotation, warmth
//!   binding), then the host's fallback models. A `403` disables a key only
//!   when a model-free request with that key (`GET /api/usage`) is refused
//!   too; otherwise only that account is out of rotation for that model (a
//!   model that needs a subscription), and when every account refused it the
//!   client gets the cloud's `403` as it was; a timeout under one key is not
//!   tried under another. A `402` for a model that uses extra usage only
//!   refuses that model on that account alone; when every account refused it,
//!   the client gets one `402` of oqp's own naming the model
//!   ([`ProxyError::CloudExtraUsageEmpty`]), in its route's shape.
//!
//! Whether a failed attempt may go to another host or key is
//! [`crate::error::retry`]'s, as for every retry loop.
//!
//! The slot time of every attempt that reached a host and was not the answer
//! passed on is handed back to the caller to charge (`spent`).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, StatusCode, header};
use http_body_util::BodyExt;

use crate::body::{self, Body};
use crate::cloud::{self, CloudPools, Failure};
use crate::dispatch::{Dispatcher, Lease};
use crate::error::{Attempt, Elsewhere, Failures, ProxyError};
use crate::headers;
use crate::metrics::Metrics;
use crate::policy::{Host, HostKind, Policy};
use crate::proxy::{self, Answer, Outbound, RequestBody};
use crate::rewrite;
use crate::router::is_model_not_found;
use crate::upstream::{Upstream, UpstreamError};
use crate::view::BodyView;

/// Bytes of an error body read to classify it.
const PEEK_LIMIT: usize = 16 * 1024;

/// Time allowed to read an error body to classify it: an error answer is
/// small, and a host that sends its head but not its body must not hold the
/// request (and its slot) for the request timeout.
const PEEK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Longest wait for the model-free key check after a cloud `403`.
const KEY_CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// What sending upstream reads of the data plane.
#[derive(Debug, Clone, Copy)]
pub struct Parts<'a> {
    /// Slots and the routing table: failover, "model not found".
    pub dispatcher: &'a Dispatcher,
    /// Host failures and failovers.
    pub metrics: &'a Metrics,
    /// Ollama Cloud key pools.
    pub cloud: &'a CloudPools,
    /// The upstream HTTP client.
    pub upstream: &'a Upstream,
}

/// An upstream answer, plus what must live as long as its body and the
/// headers it adds.
pub struct Forwarded {
    /// The answer.
    pub answer: Answer,
    /// Guards held by the response body (cloud key leases).
    pub guards: Vec<Box<dyn Send + Sync>>,
    /// Extra response headers (`X-Model-Fallback`).
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

impl std::fmt::Debug for Forwarded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarded")
            .field("answer", &self.answer)
            .field("guards", &self.guards.len())
            .field("headers", &self.headers)
            .finish()
    }
}

/// Sends `outbound` to `lease`'s host, moving the lease to other hosts as
/// the failures above require. `spent` gathers the slot time of the attempts
/// that reached a host without an answer passed on (a head timeout, a broken
/// connection, a refusal another host replaced): the caller charges it, as the
/// host may have computed for them.
pub async fn send(
    parts: Parts<'_>,
    policy: Arc<Policy>,
    lease: &mut Lease,
    model: Option<&str>,
    outbound: Outbound,
    spent: &mut std::time::Duration,
) -> Result<Forwarded, ProxyError> {
    let policy: &Policy = &policy;
    let head_timeout = outbound.head_timeout(&policy.proxy);
    let mut tried: Vec<Arc<str>> = Vec::new();
    // Each attempt sends what it needs of this one request (a copy of its headers; a
    // streamed body, which goes once, taken): no copy of the whole request for a retry.
    let mut outbound = outbound;
    let replayable = matches!(outbound.body, RequestBody::Buffered(_));
    let mut last_refusal: Option<Answer> = None;
    let mut failures = Failures::none();
    // Whether an attempt failed after its request was written (it may have run).
    let mut written = false;
    loop {
        let Some(host) = lease.host().cloned() else {
            return Err(ProxyError::AllHostsFailed(failures));
        };
        tried.push(host.name.clone());
        let started = Instant::now();
        let result = match host.kind {
            HostKind::Cloud => {
                send_cloud(parts, policy, &host, model, &mut outbound, head_timeout).await
            }
            HostKind::Ollama | HostKind::Openai => {
                let mut named = name_slot(&host, lease.named_slot(), &outbound);
                let this_attempt = named.as_mut().unwrap_or(&mut outbound);
                send_local(parts, &host, this_attempt, head_timeout).await
            }
        };
        let (attempt, down) = match result {
            Ok(Sent::Done(forwarded)) => return Ok(forwarded),
            Ok(Sent::Refused(error)) => return Err(error),
            Ok(Sent::Busy(answer)) => {
                last_refusal = Some(answer);
                (Attempt::Refused, false)
            }
            Ok(Sent::ModelMissing(answer)) => {
                if let Some(model) = model {
                    parts.dispatcher.forget_model(&host.name, model);
                }
                last_refusal = Some(answer);
                (Attempt::Refused, false)
            }
            Err(error) => {
                parts.metrics.host_failure(&host.name);
                tracing::warn!(host = %host.name, %error, "upstream attempt failed");
                failures.push(host.name.clone(), error.cause());
                // Unreachable, or the connection broken: down until its next poll. One that
                // has not answered in time is busy, not gone; a pooled connection it had
                // closed says nothing of it.
                let down = matches!(
                    error,
                    UpstreamError::Connect(_) | UpstreamError::Transport(_)
                );
                (error.attempt(), down)
            }
        };
        written |= attempt.may_have_run();
        // Every attempt that reached the host held its slot there.
        if attempt != Attempt::NotSent {
            *spent += started.elapsed();
        }
        // One that took the whole request and has not answered in time may be running it
        // still: never sent elsewhere (it would run twice). A streamed body goes once.
        let can_retry = replayable && attempt.may_go(Elsewhere::Host);
        if !can_retry
            || !parts
                .dispatcher
                .fail_over_wait(lease, &tried, down, policy.proxy.request_timeout)
                .await
        {
            break;
        }
        parts.metrics.failover();
    }
    // Nothing better came: a refusal Ollama gave is passed on as it was.
    match last_refusal {
        Some(answer) => Ok(Forwarded {
            answer,
            guards: Vec::new(),
            headers: Vec::new(),
        }),
        None if written => Err(ProxyError::HostsFailedAfterWrite(failures)),
        None => Err(ProxyError::AllHostsFailed(failures)),
    }
}

/// The request with the engine slot the router chose for it named (`id_slot`), on a host of
/// kind `openai` (a llama-server: the router names slots only there), when its body is one
/// JSON object in memory: a copy for this host alone. `None` to send it as it is.
fn name_slot(host: &Host, slot: Option<u32>, outbound: &Outbound) -> Option<Outbound> {
    if host.kind != HostKind::Openai || outbound.openai_embeddings.is_some() {
        return None;
    }
    let (Some(slot), RequestBody::Buffered(body)) = (slot, &outbound.body) else {
        return None;
    };
    let named = rewrite::set_slot(body, slot)?;
    let mut headers = outbound.headers.clone();
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(named.len()));
    Some(Outbound {
        method: outbound.method.clone(),
        path_and_query: outbound.path_and_query.clone(),
        headers,
        body: RequestBody::Buffered(named),
        unstreamed: outbound.unstreamed,
        openai_embeddings: None,
    })
}

/// What one host did with the request.
enum Sent {
    /// An answer to pass on.
    Done(Forwarded),
    /// `503 server busy`: worth another host.
    Busy(Answer),
    /// `404 model not found`: worth another host that has it.
    ModelMissing(Answer),
    /// A refusal oqp answers itself, in the route's shape (every cloud account refused the
    /// model with a 402).
    Refused(ProxyError),
}

/// Sends `outbound` to `host`: a copy of a request whose body is in memory, or the request
/// itself with a streamed body (taken: it goes once).
async fn send_local(
    parts: Parts<'_>,
    host: &Arc<Host>,
    outbound: &mut Outbound,
    head_timeout: std::time::Duration,
) -> Result<Sent, UpstreamError> {
    if host.kind == HostKind::Openai
        && let Some(origin) = &outbound.openai_embeddings
        && outbound.path_and_query.path() == "/api/embed"
    {
        let origin = origin.clone();
        return send_openai_embeddings(parts, host, origin, outbound, head_timeout).await;
    }
    let response = if let RequestBody::Buffered(bytes) = &outbound.body {
        // A body in memory can be sent again when a pooled connection turns out closed.
        let request = || {
            let body = body_of(RequestBody::Buffered(bytes.clone()));
            let (method, path) = (&outbound.method, &outbound.path_and_query);
            proxy::request_for(host, method, path, outbound.headers.clone(), body).ok()
        };
        parts
            .upstream
            .send_replayable(host.kind, request, head_timeout)
            .await?
    } else {
        let streamed = std::mem::replace(&mut outbound.body, RequestBody::Buffered(Bytes::new()));
        let request = proxy::request_for(
            host,
            &outbound.method,
            &outbound.path_and_query,
            std::mem::take(&mut outbound.headers),
            body_of(streamed),
        )
        .map_err(|_| UpstreamError::Connect("invalid upstream URL".into()))?;
        parts
            .upstream
            .send_to(host.kind, request, head_timeout)
            .await?
    };
    let mut answer = Answer::new(host.clone(), response);
    let status = answer.response.status();
    if status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::NOT_FOUND {
        let bytes = peek(&mut answer.response, PEEK_TIMEOUT).await;
        if status == StatusCode::SERVICE_UNAVAILABLE && is_busy(&bytes) {
            return Ok(Sent::Busy(answer));
        }
        if is_model_not_found(status, &bytes) {
            return Ok(Sent::ModelMissing(answer));
        }
    }
    Ok(Sent::Done(Forwarded {
        answer,
        guards: Vec::new(),
        headers: Vec::new(),
    }))
}

/// An `/api/embed` request translated from `/v1/embeddings`, on a host of kind `openai`:
/// sent as `/v1/embeddings` in the client's own shape, its answer read back into
/// `/api/embed`'s (see [`rewrite::openai_host`]). An answer that is not a list of
/// vectors is a 502 with the reason; an error is passed on as the engine sent it.
async fn send_openai_embeddings(
    parts: Parts<'_>,
    host: &Arc<Host>,
    origin: Bytes,
    outbound: &Outbound,
    timeout: std::time::Duration,
) -> Result<Sent, UpstreamError> {
    let RequestBody::Buffered(embed) = &outbound.body else {
        return Err(UpstreamError::Connect("embedding body not buffered".into()));
    };
    let Some(body) = rewrite::openai_host::embed_request(&origin, embed) else {
        return Ok(Sent::Done(Forwarded {
            answer: refusal(
                host,
                StatusCode::BAD_REQUEST,
                "the embedding request cannot be sent to an OpenAI-compatible host",
                None,
            ),
            guards: Vec::new(),
            headers: Vec::new(),
        }));
    };
    let model = BodyView::read(embed)
        .ok()
        .and_then(|view| view.model().map(str::to_owned))
        .unwrap_or_default();
    let path = http::uri::PathAndQuery::from_static(rewrite::openai_host::EMBEDDINGS_PATH);
    let request = || {
        let body = body::full(body.clone());
        proxy::request_for(
            host,
            &outbound.method,
            &path,
            outbound.headers.clone(),
            body,
        )
        .ok()
    };
    let response = parts
        .upstream
        .send_replayable(host.kind, request, timeout)
        .await?;
    let mut answer = Answer::new(host.clone(), response);
    let status = answer.response.status();
    if status != StatusCode::OK {
        let bytes = peek(&mut answer.response, PEEK_TIMEOUT).await;
        if is_model_not_found(status, &bytes) {
            return Ok(Sent::ModelMissing(answer));
        }
        return Ok(Sent::Done(Forwarded {
            answer,
            guards: Vec::new(),
            headers: Vec::new(),
        }));
    }
    let (mut head, incoming) = answer.response.into_parts();
    let read = tokio::time::timeout(timeout, incoming.collect()).await;
    let Ok(Ok(collected)) = read else {
        return Err(UpstreamError::Timeout);
    };
    let translated = rewrite::openai_host::embed_response(&collected.to_bytes(), &model);
    let body = match translated {
        Some(translated) => translated,
        None => {
            tracing::warn!(host = %host.name, "an OpenAI-compatible host answered embeddings with no list of vectors");
            head.status = StatusCode::BAD_GATEWAY;
            Bytes::from_static(
                b"{\"error\":\"upstream returned an unexpected embeddings response\"}",
            )
        }
    };
    head.headers.remove(header::CONTENT_LENGTH);
    head.headers.remove(header::TRANSFER_ENCODING);
    head.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json; charset=utf-8"),
    );
    answer.response = Response::from_parts(head, body::full(body));
    Ok(Sent::Done(Forwarded {
        answer,
        guards: Vec::new(),
        headers: Vec::new(),
    }))
}

/// Ollama Cloud: the pool's keys in rotation, then the fallback models.
async fn send_cloud(
    parts: Parts<'_>,
    policy: &Policy,
    host: &Arc<Host>,
    model: Option<&str>,
    outbound: &mut Outbound,
    head_timeout: std::time::Duration,
) -> Result<Sent, UpstreamError> {
    let Some(pool) = parts.cloud.get(&host.name) else {
        return send_local(parts, host, outbound, head_timeout).await;
    };
    if pool.host_backoff_until(Instant::now()).is_some() {
        return Err(UpstreamError::Connect(
            "Ollama Cloud asked to back off".into(),
        ));
    }
    if pool.exhausted() {
        // Every account is at its reserve (or empty) as last read: keep the owners' floor.
        return Ok(Sent::Done(Forwarded {
            answer: refusal(
                host,
                StatusCode::TOO_MANY_REQUESTS,
                "every Ollama Cloud account of this host is at its reserve",
                None,
            ),
            guards: Vec::new(),
            headers: Vec::new(),
        }));
    }
    let RequestBody::Buffered(body) = &outbound.body else {
        // A streamed body cannot be retried on another key: one attempt.
        let key = pool
            .attempts(&cloud::Lease::none())
            .next_key(Instant::now());
        if let Some(key) = &key {
            set_bearer(&mut outbound.headers, key.key());
        }
        return send_local(parts, host, outbound, head_timeout).await;
    };
    let requested = model.unwrap_or_default();
    let candidates = if requested.is_empty() {
        vec![String::new()]
    } else {
        cloud::candidates(host, requested)
    };
    let mut last: Option<(Answer, Failure)> = None;
    let mut missing: Option<Answer> = None;
    // A model every account had already refused: no key was asked again.
    let mut refused_everywhere: Option<(String, cloud::Refusal)> = None;
    // Whether an account ran out of quota, or refused a model with a 402, in this call.
    let mut quota_seen = false;
    let mut extra_usage_seen = false;
    for candidate in candidates {
        let lease = pool
            .acquire(&candidate, policy.routing.acquire_timeout)
            .await;
        let body = if candidate.is_empty() {
            body.clone()
        } else {
            with_model(body, cloud::upstream_model(&candidate))
        };
        let mut attempts = pool.attempts(&lease).for_model(&candidate);
        let mut give_up_host = false;
        while let Some(attempt) = attempts.next_key(Instant::now()) {
            let mut headers = outbound.headers.clone();
            set_bearer(&mut headers, attempt.key());
            let request = proxy::request_for(
                host,
                &outbound.method,
                &outbound.path_and_query,
                headers,
                body::full(body.clone()),
            )
            .map_err(|_| UpstreamError::Connect("invalid upstream URL".into()))?;
            let response = match parts.upstream.send(request, head_timeout).await {
                Ok(response) => response,
                Err(error) => {
                    let tried = error.attempt();
                    let failure = match tried {
                        Attempt::Unanswered => Failure::Timeout,
                        _ => Failure::Connect,
                    };
                    attempts.fail(&attempt, failure, Instant::now());
                    // No other key after a failure of the host (`Attempt::may_go`): one that
                    // may be running under this key is never sent again under another, and
                    // a host not reached is for the host's failover.
                    if !tried.may_go(Elsewhere::Key) {
                        return Err(error);
                    }
                    continue;
                }
            };
            let mut answer = Answer::new(host.clone(), response);
            if !answer.response.status().is_success() {
                let bytes = peek(&mut answer.response, PEEK_TIMEOUT).await;
                if !candidate.is_empty() && is_model_not_found(answer.response.status(), &bytes) {
                    // The model is gone whatever the key: try the next candidate.
                    attempts.succeed(&attempt);
                    missing = Some(answer);
                    break;
                }
                let failure = match Failure::classify(answer.response.status(), &bytes) {
                    Some(Failure::Forbidden) => {
                        Some(if key_refused(parts, policy, host, attempt.key()).await {
                            Failure::Auth
                        } else {
                            Failure::ModelRefused
                        })
                    }
                    other => other,
                };
                // A 403 for a request naming no model, with a good key: nothing to
                // rotate for, so it is relayed as it is.
                let failure =
                    failure.filter(|f| !(*f == Failure::ModelRefused && candidate.is_empty()));
                if let Some(failure) = failure {
                    tracing::info!(host = %host.name, failure = failure.as_str(), "cloud key failed; rotating");
                    attempts.fail(&attempt, failure, Instant::now());
                    quota_seen |= matches!(failure, Failure::Quota(_));
                    extra_usage_seen |= failure == Failure::ExtraUsageEmpty;
                    give_up_host = matches!(failure, Failure::Connect | Failure::Overloaded);
                    last = Some((answer, failure));
                    if give_up_host {
                        break;
                    }
                    continue;
                }
            }
            if let Some(account) = attempts.succeed(&attempt) {
                answer
                    .response
                    .extensions_mut()
                    .insert(cloud::Served(account));
            }
            let mut extra = Vec::new();
            if candidate != requested
                && let Ok(value) = HeaderValue::from_str(&candidate)
            {
                extra.push((headers::MODEL_FALLBACK, value));
            }
            return Ok(Sent::Done(Forwarded {
                answer,
                guards: vec![Box::new(lease)],
                headers: extra,
            }));
        }
        if attempts.tried() == 0
            && !candidate.is_empty()
            && let Some(refusal) = pool.refused_everywhere(&candidate, Instant::now())
        {
            extra_usage_seen |= refusal == cloud::Refusal::ExtraUsage;
            refused_everywhere = Some((candidate, refusal));
        }
        if give_up_host {
            break;
        }
    }
    if let (None, Some(answer)) = (&last, missing) {
        return Ok(Sent::ModelMissing(answer));
    }
    // Only 402s (asked now or remembered): the model, on no account. A quota error elsewhere
    // in the call says more (that account serves again after its cooldown).
    if extra_usage_seen
        && !quota_seen
        && last
            .as_ref()
            .is_none_or(|(_, failure)| *failure == Failure::ExtraUsageEmpty)
    {
        return Ok(Sent::Refused(ProxyError::CloudExtraUsageEmpty {
            model: requested.to_owned(),
        }));
    }
    if let (None, Some((model, _))) = (&last, refused_everywhere) {
        let message = format!(
            "Ollama Cloud refused model '{model}' for every account of this host (it may need a subscription)"
        );
        return Ok(Sent::Done(Forwarded {
            answer: refusal(host, StatusCode::FORBIDDEN, &message, None),
            guards: Vec::new(),
            headers: Vec::new(),
        }));
    }
    match last {
        // Every key failed: the client sees a clean refusal, never a key's
        // 429 body (which names an account).
        Some((_, Failure::Overloaded)) | None => Ok(Sent::Busy(refusal(
            host,
            StatusCode::SERVICE_UNAVAILABLE,
            "all Ollama Cloud keys are busy or rate limited",
            pool.retry_after(Instant::now()),
        ))),
        Some((_, Failure::Quota(_))) => Ok(Sent::Done(Forwarded {
            answer: refusal(
                host,
                StatusCode::TOO_MANY_REQUESTS,
                "every Ollama Cloud account of this host has reached its usage limit",
                pool.retry_after(Instant::now()),
            ),
            guards: Vec::new(),
            headers: Vec::new(),
        })),
        Some((answer, _)) => Ok(Sent::Done(Forwarded {
            answer,
            guards: Vec::new(),
            headers: Vec::new(),
        })),
    }
}

/// Whether Ollama Cloud refuses `key` itself, not just one model: a request
/// that names no model (`GET /api/usage`) with the same key is answered 401
/// or 403. Anything else (success, 404, an error, no answer in time) keeps
/// the key in service: a key is disabled only on evidence.
async fn key_refused(parts: Parts<'_>, policy: &Policy, host: &Arc<Host>, key: &str) -> bool {
    let mut headers = http::HeaderMap::new();
    set_bearer(&mut headers, key);
    let Ok(request) = proxy::request_for(
        host,
        &http::Method::GET,
        &http::uri::PathAndQuery::from_static("/api/usage"),
        headers,
        body::empty(),
    ) else {
        return false;
    };
    let timeout = policy.proxy.request_timeout.min(KEY_CHECK_TIMEOUT);
    match parts.upstream.send(request, timeout).await {
        Ok(response) => matches!(
            response.status(),
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
        ),
        Err(_) => false,
    }
}

/// A refusal in Ollama's error shape, as if `host` had answered it.
fn refusal(
    host: &Arc<Host>,
    status: StatusCode,
    message: &str,
    retry_after: Option<std::time::Duration>,
) -> Answer {
    let mut response = Response::new(body::json(&serde_json::json!({ "error": message })));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json; charset=utf-8"),
    );
    if let Some(after) = retry_after {
        response.headers_mut().insert(
            header::RETRY_AFTER,
            HeaderValue::from(after.as_secs().max(1)),
        );
    }
    Answer {
        host: host.clone(),
        response,
        failed: Vec::new(),
    }
}

fn set_bearer(headers: &mut http::HeaderMap, key: &str) {
    if let Ok(mut value) = HeaderValue::from_str(&format!("Bearer {key}")) {
        value.set_sensitive(true);
        headers.insert(header::AUTHORIZATION, value);
    }
}

/// Reads an (error) answer's body, at most [`PEEK_LIMIT`] bytes and
/// `timeout` long, and puts what it read back so that the answer can still
/// be passed on (unchanged unless it was cut short).
async fn peek(response: &mut Response<Body>, timeout: std::time::Duration) -> Bytes {
    let mut body = std::mem::replace(response.body_mut(), body::empty());
    let mut bytes = bytes::BytesMut::new();
    let read = async {
        while bytes.len() < PEEK_LIMIT {
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        bytes.extend_from_slice(data);
                    }
                }
                Some(Err(_)) | None => break,
            }
        }
    };
    if tokio::time::timeout(timeout, read).await.is_err() {
        tracing::warn!("an upstream error body did not arrive in time; passing on what came");
    }
    let bytes = bytes.freeze();
    response.headers_mut().remove(header::CONTENT_LENGTH);
    *response.body_mut() = body::full(bytes.clone());
    bytes
}

/// Ollama's own overload answer: "server busy, please try again. …".
fn is_busy(body: &[u8]) -> bool {
    String::from_utf8_lossy(body)
        .to_ascii_lowercase()
        .contains("server busy")
}

/// The same JSON body with its model replaced wherever Ollama would read one; any other
/// body as it is.
fn with_model(body: &Bytes, model: &str) -> Bytes {
    BodyView::read(body)
        .ok()
        .and_then(|view| rewrite::replace_model(body, &view, model))
        .unwrap_or_else(|| body.clone())
}

fn body_of(body: RequestBody) -> Body {
    match body {
        RequestBody::Buffered(bytes) if bytes.is_empty() => body::empty(),
        RequestBody::Buffered(bytes) => body::full(bytes),
        RequestBody::Streamed(body) => body,
    }
}

/// Splits a request into the attempt to send now and a copy for a retry on
/// another host; streamed bodies cannot be replayed.
pub fn split_for_retry(outbound: Outbound) -> (Outbound, Option<Outbound>) {
    match &outbound.body {
        RequestBody::Buffered(bytes) => {
            let replay = Outbound {
                method: outbound.method.clone(),
                path_and_query: outbound.path_and_query.clone(),
                headers: outbound.headers.clone(),
                body: RequestBody::Buffered(bytes.clone()),
                unstreamed: outbound.unstreamed,
                openai_embeddings: outbound.openai_embeddings.clone(),
            };
            (outbound, Some(replay))
        }
        RequestBody::Streamed(_) => (outbound, None),
    }
}

/// The dispatcher's [`Unloader`](crate::dispatch::Unloader): Ollama's unload idiom (an empty
/// generate with `keep_alive: 0`) for the model a switch moves away from, so that the model
/// evicted is the one the swap rule chose. It answers at once and the model goes when its last
/// request ends; the switch goes on when it has answered, or failed (Ollama then evicts on the
/// load by its own choice).
pub fn unloader(
    upstream: Upstream,
    dispatcher: std::sync::Weak<Dispatcher>,
) -> crate::dispatch::Unloader {
    Box::new(move |host: Arc<Host>, model: String| {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        let upstream = upstream.clone();
        let dispatcher = dispatcher.clone();
        runtime.spawn(async move {
            let body = serde_json::json!({ "model": model, "keep_alive": 0 }).to_string();
            let request = http::Request::post(format!("{}/api/generate", host.url))
                .header(header::CONTENT_TYPE, "application/json")
                .body(body::full(body));
            match request {
                Ok(request) => match upstream.send(request, UNLOAD_TIMEOUT).await {
                    Ok(response) => {
                        let status = response.status();
                        let _ = response.into_body().collect().await;
                        if !status.is_success() {
                            tracing::debug!(host = %host.name, %model, %status, "unload refused");
                        }
                    }
                    Err(error) => {
                        tracing::debug!(host = %host.name, %model, %error, "unload failed");
                    }
                },
                Err(error) => tracing::debug!(%error, "unload request not built"),
            }
            if let Some(dispatcher) = dispatcher.upgrade() {
                dispatcher.unloaded(&host.name, &model);
            }
        });
        true
    })
}

/// The longest an explicit unload is waited for.
const UNLOAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn peek_gives_up_on_an_error_body_that_stalls() {
        use futures_util::StreamExt;
        let first = futures_util::stream::iter([Ok::<_, crate::body::BoxError>(
            http_body::Frame::data(Bytes::from_static(br#"{"error":"#)),
        )]);
        let stalled = first.chain(futures_util::stream::pending());
        let mut response = Response::new(BodyExt::boxed(http_body_util::StreamBody::new(stalled)));
        let bytes = peek(&mut response, std::time::Duration::from_millis(50)).await;
        assert_eq!(&bytes[..], br#"{"error":"#);
        let passed_on = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(passed_on, bytes, "what was read is passed on");
    }

    #[test]
    fn recognises_ollamas_busy_answer() {
        assert!(is_busy(
            br#"{"error":"server busy, please try again.  maximum pending requests exceeded"}"#
        ));
        assert!(!is_busy(br#"{"error":"model 'x' not found"}"#));
    }

    #[test]
    fn replaces_only_the_model() {
        let body = Bytes::from_static(br#"{"model":"a","prompt":"hi","n":1.5}"#);
        let replaced: serde_json::Value = serde_json::from_slice(&with_model(&body, "b")).unwrap();
        assert_eq!(
            replaced,
            serde_json::json!({"model": "b", "prompt": "hi", "n": 1.5})
        );
        assert_eq!(
            with_model(&Bytes::from_static(b"[1]"), "b"),
            Bytes::from_static(b"[1]")
        );
        // Every member Ollama would read as the model, in place; one added where none was.
        assert_eq!(
            with_model(&Bytes::from_static(br#"{"model":"a","MODEL":"c"}"#), "b"),
            Bytes::from_static(br#"{"model":"b","MODEL":"b"}"#)
        );
        assert_eq!(
            with_model(&Bytes::from_static(br#"{"prompt":"hi"}"#), "b"),
            Bytes::from_static(br#"{"prompt":"hi","model":"b"}"#)
        );
    }
}
