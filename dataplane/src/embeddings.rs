//! Embedding requests: OpenAI `/v1/embeddings` translation and the
//! per-item embedding cache, in front of the ordinary queued path.
//!
//! ```text
//! /v1/embeddings ──translate──► /api/embed body ─┐
//! /api/embed, /api/embeddings ───────────────────┤
//!                                                ▼
//!            cache: all items hit → answer (no queue, no slot, no upstream)
//!                   some miss     → queue + send only the misses, reassemble
//!                                                ▼
//!            /v1/embeddings: wrap back in OpenAI's shape (float or base64)
//! ```
//!
//! The queue headers (`X-Queue-Wait-Time`, `X-Queue-Position`,
//! `X-Failover-Host`) of the upstream fetch are kept on the final answer,
//! next to `X-Cache`.

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, StatusCode, header};
use http_body_util::BodyExt;

use crate::auth::Caller;
use crate::body::{self, Body};
use crate::cache::{self, Cache, Namespace, ResolveError};
use crate::endpoint::Inference;
use crate::error::ProxyError;
use crate::headers;
use crate::policy::Policy;
use crate::proxy::{Outbound, RequestBody};
use crate::queued;
use crate::rewrite::{self, EncodingFormat};
use crate::scheduler::Tier;
use crate::usage::Totals;
use crate::view::BodyView;

/// What an embedding request reads of the data plane.
#[derive(Debug)]
pub struct Parts<'a> {
    /// The queued path, for the items the cache does not have.
    pub queue: queued::Parts<'a>,
    /// The embedding cache, if one is running.
    pub cache: Option<Arc<Cache>>,
}

/// What an OpenAI request asked for, to shape the answer.
struct OpenAi {
    format: EncodingFormat,
    model: String,
}

/// Why a fetch for the cache produced no vectors.
enum Fetch {
    /// The proxy refused (queue full, expired, no host …).
    Refused(ProxyError),
    /// Ollama answered something other than 200: relayed as it is.
    Upstream(Response<Body>),
}

/// Answers an embedding request (body already read, keep_alive not yet
/// applied: the caller's rule, [`KeepAlive::for_caller`](crate::policy::KeepAlive::for_caller)).
pub async fn handle(
    parts: Parts<'_>,
    policy: &Arc<Policy>,
    client: Caller,
    tier: Tier,
    inference: Inference,
    mut outbound: Outbound,
    (body, view): (Bytes, BodyView),
) -> Result<Response<Body>, ProxyError> {
    // A client over its budget is refused here, before the cache: an answer the cache could
    // give whole is refused as one that would be queued (a budget bounds what a client may
    // ask for, not only what reaches a GPU).
    parts
        .queue
        .usage
        .check_caller(policy, &client, std::time::SystemTime::now())?;
    let (body, view, openai) = if inference == Inference::OpenAiEmbeddings {
        let model = view.model().unwrap_or_default().to_owned();
        match rewrite::openai_embed_request(&body) {
            Ok((translated, format)) => {
                outbound.path_and_query = http::uri::PathAndQuery::from_static("/api/embed");
                // An `openai` host is sent the client's own body (see `rewrite::openai_host`).
                outbound.openai_embeddings = Some(body.clone());
                // The translation is oqp's own JSON: read anew, it is always one value.
                let view = BodyView::read(&translated).unwrap_or_default();
                (translated, view, Some(OpenAi { format, model }))
            }
            Err(error) => return Ok(openai_error(error.status, error.body())),
        }
    } else {
        (body, view, None)
    };
    let keep_alive =
        (policy.keep_alive).for_caller(policy.queue.model_swap.enabled, client.sets_keep_alive);
    let inputs = view.input_count(&body);
    let model = view.model().map(str::to_owned);
    let body = rewrite::insert_keep_alive(&body, &view, &keep_alive).unwrap_or(body);
    let namespace = Namespace::of(inference);
    let Parts { queue, cache } = parts;
    let plan = match (&cache, namespace) {
        (Some(_), Some(namespace)) if policy.embedding_cache.enabled => {
            let limit = policy.embedding_cache.max_inputs;
            cache::plan_within(namespace, &body, limit)
                .map_err(|_| ProxyError::TooManyInputs { limit })?
        }
        _ => None,
    };
    let (Some(cache), Some(plan)) = (cache, plan) else {
        // Not cacheable: the ordinary queued path, then the OpenAI wrap.
        outbound.body = RequestBody::Buffered(body);
        let request = queued::Request::inference(client, tier, model);
        let response = send_uncached(queue, policy, request, outbound, inputs).await?;
        return match openai {
            Some(openai) => wrap_openai(response, &openai).await,
            None => Ok(response),
        };
    };

    let endpoint = outbound.path_and_query.path().to_owned();
    let model = plan.model().to_owned();
    // The last fetch's response headers (queue wait, host), for the answer.
    let fetched_headers: Arc<Mutex<Option<HeaderMap>>> = Arc::default();
    let fetch = |miss_body: Bytes, dispatch: cache::Dispatch| {
        let policy = policy.clone();
        let fetched_headers = fetched_headers.clone();
        let outbound = Outbound {
            method: outbound.method.clone(),
            path_and_query: outbound.path_and_query.clone(),
            headers: outbound.headers.clone(),
            body: RequestBody::Buffered(miss_body),
            unstreamed: false,
            openai_embeddings: outbound.openai_embeddings.clone(),
        };
        let request = queued::Request::inference(client.clone(), tier, Some(model.clone()));
        async move {
            let granted = move || dispatch.dispatched();
            let response = queued::send(queue, &policy, request, outbound, granted)
                .await
                .map_err(Fetch::Refused)?;
            let (parts, body) = response.into_parts();
            if parts.status != StatusCode::OK {
                return Err(Fetch::Upstream(Response::from_parts(parts, body)));
            }
            let bytes = body
                .collect()
                .await
                .map_err(|_| Fetch::Refused(ProxyError::hosts_failed()))?
                .to_bytes();
            if let Ok(mut slot) = fetched_headers.lock() {
                *slot = Some(parts.headers);
            }
            Ok(bytes)
        }
    };
    let resolved = match cache
        .resolve(&plan, &client.id, &endpoint, tier, fetch)
        .await
    {
        Ok(resolved) => resolved,
        Err(ResolveError::Upstream(Fetch::Refused(error))) => return Err(error),
        Err(ResolveError::Upstream(Fetch::Upstream(response))) => {
            return match openai {
                Some(openai) => wrap_openai(response, &openai).await,
                None => Ok(response),
            };
        }
        Err(ResolveError::Plan(error)) => {
            tracing::warn!(%error, "upstream embedding answer did not fit the request");
            return Err(ProxyError::hosts_failed());
        }
    };
    let outcome = resolved.outcome;
    let items = &resolved.items;
    // The fetch of the misses counted the request and its GPU time; a request the cache (or
    // another request's fetch) answered whole counts here, without GPU time.
    let totals = Totals {
        requests: u64::from(items.fetched == 0),
        embedding_inputs: items.fetched as u64,
        cached_inputs: (items.cached + items.coalesced) as u64,
        ..Totals::default()
    };
    queue
        .usage
        .record(&client.id, &model, totals, SystemTime::now());
    match outcome {
        cache::Outcome::Hit => queue.metrics.cache_hit(&client.id, &model, &endpoint),
        cache::Outcome::Partial => queue.metrics.cache_partial(&client.id, &model, &endpoint),
        cache::Outcome::Miss => queue.metrics.cache_miss(&client.id, &model, &endpoint),
    }
    let mut response = Response::new(body::full(resolved.body));
    let map = response.headers_mut();
    map.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json; charset=utf-8"),
    );
    if let Ok(Some(fetched)) = fetched_headers.lock().map(|mut slot| slot.take()) {
        for name in [
            headers::QUEUE_WAIT_TIME,
            headers::QUEUE_POSITION,
            headers::FAILOVER_HOST,
        ] {
            if let Some(value) = fetched.get(&name) {
                map.insert(name, value.clone());
            }
        }
    }
    map.insert(headers::CACHE, HeaderValue::from_static(outcome.as_str()));
    match openai {
        Some(openai) => wrap_openai(response, &openai).await,
        None => Ok(response),
    }
}

/// Sends an embedding request for `model` upstream through the queue, without the cache,
/// and counts its `inputs` as embedding inputs sent upstream when it is answered.
pub async fn send_uncached(
    queue: queued::Parts<'_>,
    policy: &Arc<Policy>,
    request: queued::Request,
    outbound: Outbound,
    inputs: u64,
) -> Result<Response<Body>, ProxyError> {
    let usage = queue.usage.clone();
    let client_id = request.caller.id.clone();
    let model_name = request.model.clone().unwrap_or_default();
    let response = queued::send(queue, policy, request, outbound, || {}).await?;
    if response.status().is_success() {
        let totals = Totals {
            embedding_inputs: inputs,
            ..Totals::default()
        };
        usage.record(&client_id, &model_name, totals, SystemTime::now());
    }
    Ok(response)
}

/// Wraps an Ollama `/api/embed` answer in OpenAI's shape, keeping oqp's
/// headers; errors become OpenAI error objects.
async fn wrap_openai(
    response: Response<Body>,
    openai: &OpenAi,
) -> Result<Response<Body>, ProxyError> {
    let (mut parts, body) = response.into_parts();
    let bytes = body
        .collect()
        .await
        .map_err(|_| ProxyError::hosts_failed())?
        .to_bytes();
    let bytes = if parts.status == StatusCode::OK {
        match rewrite::openai_embed_response(&bytes, openai.format, &openai.model) {
            Ok(wrapped) => wrapped,
            Err(error) => {
                parts.status = error.status;
                error.body()
            }
        }
    } else {
        rewrite::openai_error_from_ollama(parts.status, &bytes)
    };
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.remove(header::TRANSFER_ENCODING);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(Response::from_parts(parts, body::full(bytes)))
}

fn openai_error(status: StatusCode, body: Bytes) -> Response<Body> {
    let mut response = Response::new(body::full(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use crate::view::BodyView;

    /// Inputs as the request path counts them: from the body's one reading.
    fn input_count(body: &[u8]) -> u64 {
        BodyView::read(body).unwrap_or_default().input_count(body)
    }

    #[test]
    fn inputs_are_counted_in_every_shape() {
        assert_eq!(input_count(br#"{"model":"m","input":["a","b","c"]}"#), 3);
        assert_eq!(input_count(br#"{"model":"m","input":"one"}"#), 1);
        assert_eq!(input_count(br#"{"model":"m","prompt":"legacy"}"#), 1);
        assert_eq!(input_count(br#"{"model":"m","input":[]}"#), 0);
        assert_eq!(input_count(br#"{"model":"m"}"#), 0);
        assert_eq!(input_count(b"not json"), 0);
        // Named as Ollama reads it.
        assert_eq!(input_count(br#"{"model":"m","INPUT":["a","b"]}"#), 2);
    }
}
