//! The queued path: admit a request to its tier's queue, wait for a slot,
//! send it (failing over before the first byte, see [`forward`]) and answer
//! with the slot held by the response body.
//!
//! Everything the proxy queues comes through here: inference requests from
//! the request path ([`crate::service`]) and the cache misses of an embedding
//! request ([`crate::embeddings`]).
//!
//! When other nodes own hosts, the box comes first ([`crate::placement`]):
//! this node's queue, or the owner's, forwarded ([`relay`]) with the caller's
//! identity and tier, trying the next box when one refuses or cannot be
//! reached before any byte of an answer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{HeaderValue, Response, header};

use crate::affinity::Chain;
use crate::affinity::tap::Tapped;
use crate::auth::Caller;
use crate::body::Body;
use crate::cloud::CloudPools;
use crate::dispatch::{self, Dispatcher, Grant};
use crate::error::{Elsewhere, ProxyError};
use crate::forward;
use crate::headers;
use crate::hop::Assertion;
use crate::metrics::Metrics;
use crate::peers::Peers;
use crate::placement::Target;
use crate::policy::Policy;
use crate::proxy::{self, Active, Outbound, RequestBody};
use crate::relay;
use crate::request_log::capture::{self, Tap};
use crate::request_log::{Capture, Entry, RequestLog};
use crate::scheduler::{Ask, Tier};
use crate::snapshot::PolicyStore;
use crate::upstream::{Completion, Upstream};
use crate::usage::{Totals, Usage, minute};

/// What the queued path reads of the data plane.
#[derive(Debug, Clone, Copy)]
pub struct Parts<'a> {
    /// The current policy: a key revoked while its request waited is refused.
    pub store: &'a PolicyStore,
    /// Queues and upstream slots.
    pub dispatcher: &'a Arc<Dispatcher>,
    /// Queue wait, time to first byte and host answers.
    pub metrics: &'a Arc<Metrics>,
    /// Ollama Cloud key pools.
    pub cloud: &'a CloudPools,
    /// The upstream HTTP client.
    pub upstream: &'a Upstream,
    /// Requests in flight upstream.
    pub active: &'a Active,
    /// Usage accounting and budgets.
    pub usage: &'a Arc<Usage>,
    /// The other data planes, which may own the host a request goes to.
    pub peers: &'a Arc<Peers>,
    /// The request log (`logging.requests`), written when the policy turns it on.
    pub request_log: &'a Arc<RequestLog>,
}

impl<'a> Parts<'a> {
    /// The parts sending upstream reads.
    fn forward(self) -> forward::Parts<'a> {
        forward::Parts {
            dispatcher: self.dispatcher,
            metrics: self.metrics,
            cloud: self.cloud,
            upstream: self.upstream,
        }
    }
}

/// A request on the queued path, built once by its caller ([`crate::service`], or
/// [`crate::embeddings`] for a cache miss): who asks, for what, and how it is counted.
#[derive(Debug, Clone)]
pub struct Request {
    /// Who it is for.
    pub caller: Caller,
    /// Its tier, already capped.
    pub tier: Tier,
    /// Its model as the client named it, if it names one.
    pub model: Option<String>,
    /// Its conversation, for a chat-shaped request: its host is chosen by where its prompt
    /// is cached ([`crate::affinity`]), its answer recorded as the next turn's prefix.
    pub chain: Option<Arc<Chain>>,
    /// Whether it is accounted and budgeted: inference only (a model pull is neither GPU
    /// time nor refused for a budget).
    pub accounted: bool,
    /// Forwarded here by another node's data plane: served by this node's hosts only, its
    /// per-minute limits counted at its edge.
    pub hopped: bool,
}

impl Request {
    /// An inference request of `caller` for `model`: accounted, budgeted, and sent to any
    /// box.
    pub fn inference(caller: Caller, tier: Tier, model: Option<String>) -> Self {
        Self {
            caller,
            tier,
            model,
            chain: None,
            accounted: true,
            hopped: false,
        }
    }
}

/// One request on its way through the queued path: what each step reads.
#[derive(Clone, Copy)]
struct Sending<'a> {
    parts: Parts<'a>,
    policy: &'a Arc<Policy>,
    request: &'a Request,
    /// What the request took of its per-minute limits, settled when its answer ends.
    charge: Option<&'a minute::Charge>,
}

/// Admits `request` to the queue, waits for its grant and sends `outbound`, calling
/// `on_granted` as soon as the request has its slot (before it is sent) or, forwarded, its
/// owner's answer. A request refused or failed here has its request log line written here (an
/// answered one's is written by its completion hook, see `granted`).
pub async fn send(
    parts: Parts<'_>,
    policy: &Arc<Policy>,
    request: Request,
    outbound: Outbound,
    on_granted: impl FnOnce(),
) -> Result<Response<Body>, ProxyError> {
    let Some(settings) = policy.request_log.clone() else {
        return admit(parts, policy, &request, outbound, on_granted).await;
    };
    let started = Instant::now();
    let mut entry = Entry {
        request_id: request_id_of(&outbound.headers),
        route: outbound.path_and_query.path().to_owned(),
        client: request.caller.id.to_string(),
        user: user_of(&request.caller.id),
        model: request.model.clone(),
        tier: request.tier.as_str(),
        ..Entry::default()
    };
    // The body to capture, should the request be refused here (cheap: a shared buffer).
    // Boxed: it is held across the wait of every request, most of which capture nothing.
    let captured = policy
        .capture_of(&request.caller.id)
        .map(|limit| Box::new((limit, buffered(&outbound.body))));
    let answer = admit(parts, policy, &request, outbound, on_granted).await;
    if let Err(error) = &answer {
        entry.time = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
        entry.status = error.status().as_u16();
        entry.duration_ms = millis(started.elapsed());
        entry.error = Some(error.to_string());
        entry.capture = captured.map(|captured| {
            let (limit, body) = *captured;
            Capture::of_request(body.as_ref(), limit)
        });
        parts.request_log.record(&settings, entry, parts.metrics);
    }
    answer
}

/// Checks the caller's budget and per-minute limits, then sends the request to the box
/// [`crate::placement`] chooses, or to this node's queue.
async fn admit(
    parts: Parts<'_>,
    policy: &Arc<Policy>,
    request: &Request,
    outbound: Outbound,
    on_granted: impl FnOnce(),
) -> Result<Response<Body>, ProxyError> {
    // A spent budget refuses before the request is queued anywhere.
    let mut charge = None;
    if request.accounted {
        let now = std::time::SystemTime::now();
        parts.usage.check_caller(policy, &request.caller, now)?;
        // Per-minute limits are the box's that took the request from its client: one
        // forwarded here was counted at its edge.
        if !request.hopped {
            let estimate = estimated_tokens(&outbound, request.chain.as_deref());
            charge = parts
                .usage
                .admit_minute(policy, &request.caller, estimate)?;
        }
    }
    let sending = Sending {
        parts,
        policy,
        request,
        charge: charge.as_ref(),
    };
    if request.hopped || policy.remote.is_empty() {
        local(sending, outbound, on_granted).await
    } else {
        Box::pin(placed(sending, outbound, on_granted)).await
    }
}

/// Tries the boxes in the order [`crate::placement`] gives, moving on when one refuses
/// (queue full, its hosts failed, shutting down) or cannot be reached.
async fn placed(
    sending: Sending<'_>,
    outbound: Outbound,
    on_granted: impl FnOnce(),
) -> Result<Response<Body>, ProxyError> {
    let Sending {
        parts,
        policy,
        request,
        ..
    } = sending;
    let order = parts.peers.order(
        policy,
        parts.dispatcher.load(),
        request.model.as_deref(),
        request.chain.as_ref().map(|chain| chain.root),
    );
    let assertion = Assertion {
        node: policy.node.clone(),
        client: request.caller.id.clone(),
        verified: request.caller.verified,
        tier: request.tier,
        // Set by the relay, from the body it sends.
        body: crate::hop::Body::Trailer(None),
        // The owner applies the group's ceiling, models and budget from its own snapshot.
        group: request
            .caller
            .claims
            .as_ref()
            .map(|claims| Arc::from(claims.value.as_str())),
    };
    let relay = relay::Parts {
        peers: parts.peers,
        metrics: parts.metrics,
    };
    // Called once, by whichever box takes the request.
    let on_granted = std::sync::Mutex::new(Some(on_granted));
    let granted = || {
        let taken = on_granted.lock().ok().and_then(|mut once| once.take());
        if let Some(granted) = taken {
            granted();
        }
    };
    let mut outbound = Some(outbound);
    let mut last: Option<Result<Response<Body>, ProxyError>> = None;
    for target in order {
        let Some(attempt) = outbound.take() else {
            break;
        };
        if last.is_some() {
            parts.metrics.failover();
        }
        let (this, replay) = forward::split_for_retry(attempt);
        outbound = replay;
        match target {
            Target::Local => match local(sending, this, granted).await {
                Err(error) if error.attempt().may_go(Elsewhere::Box) => last = Some(Err(error)),
                answer => return answer,
            },
            Target::Peer(node) => {
                match relay::send(relay, policy, &node, &assertion, this).await? {
                    relay::Relayed::Answer(response) => {
                        granted();
                        return Ok(response);
                    }
                    relay::Relayed::Refused(response) => last = Some(Ok(response)),
                    relay::Relayed::Unreachable => {
                        if last.is_none() {
                            last = Some(Err(ProxyError::hosts_failed()));
                        }
                    }
                }
            }
        }
    }
    last.unwrap_or(Err(ProxyError::hosts_failed()))
}

/// Where a request stood at admission, for its answer's queue headers.
#[derive(Clone, Copy)]
struct Admission {
    /// 1-based position in its tier.
    position: u32,
    /// Dispatched during admission (no wait at all).
    immediate: bool,
}

/// Admits a request to this node's queue, waits for its grant and sends it.
async fn local(
    sending: Sending<'_>,
    outbound: Outbound,
    on_granted: impl FnOnce(),
) -> Result<Response<Body>, ProxyError> {
    let Sending { parts, request, .. } = sending;
    let client = &request.caller;
    let bytes = match &outbound.body {
        RequestBody::Buffered(bytes) => bytes.len() as u64,
        RequestBody::Streamed(_) => declared_length(&outbound.headers),
    };
    let pending = parts.dispatcher.admit(dispatch::Request {
        ask: Ask {
            client: client.id.clone(),
            member: client.member.clone(),
            tier: request.tier,
            bytes,
            model: request.model.as_deref().map(Arc::from),
            affinity: request.chain.clone(),
        },
        verified: client.verified,
    })?;
    let admission = Admission {
        position: pending.position,
        immediate: pending.immediate,
    };
    let outbound = if admission.immediate {
        outbound
    } else {
        outbound.detached()
    };
    let grant = pending.granted().await?;
    // The key may have been revoked or have expired while the request waited
    // (between snapshots, an expiry is only seen here): never send it then.
    let now = std::time::SystemTime::now();
    let current = parts.store.load();
    if client.verified && !current.admits(&client.id, now) {
        drop(grant);
        return Err(ProxyError::KeyRevoked);
    }
    // The budget may have been spent while the request waited (by the requests ahead of
    // it): refused as at admission, the slot going to the next request.
    if request.accounted
        && let Err(refusal) = parts.usage.check_caller(&current, client, now)
    {
        drop(grant);
        return Err(refusal);
    }
    drop(current);
    on_granted();
    Box::pin(granted(sending, grant, outbound, admission)).await
}

/// A sent request whose client may leave before the answer's head: dropped armed (the
/// request's future dropped while it waits upstream), it charges the slot time held, so
/// that leaving early is not free while Ollama has computed for it.
struct Abandoned(Option<(Arc<Usage>, Arc<str>, String, Instant)>);

impl Abandoned {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for Abandoned {
    fn drop(&mut self) {
        if let Some((usage, client, model, sent)) = self.0.take() {
            usage.record(
                &client,
                &model,
                Totals {
                    gpu_ns: u64::try_from(sent.elapsed().as_nanos()).unwrap_or(u64::MAX),
                    requests: 1,
                    ..Totals::default()
                },
                std::time::SystemTime::now(),
            );
        }
    }
}

/// Sends a dispatched request, failing over to another free host before the
/// first byte, and returns the response with the slot held by its body.
async fn granted(
    sending: Sending<'_>,
    grant: Grant,
    outbound: Outbound,
    admission: Admission,
) -> Result<Response<Body>, ProxyError> {
    let Sending {
        parts,
        policy,
        request,
        charge,
    } = sending;
    let Grant {
        mut lease,
        waited,
        tier,
        held,
    } = grant;
    let verdict = observe_grant(parts.metrics, &lease, tier, waited, held);
    let wait_header = queue_headers(waited, admission.position, admission.immediate);
    let client = &request.caller.id;
    // The request log's line, finished by the completion hook.
    let logged = policy.request_log.clone().map(|settings| {
        let entry = Entry {
            request_id: request_id_of(&outbound.headers),
            route: outbound.path_and_query.path().to_owned(),
            client: client.to_string(),
            user: user_of(client),
            tier: tier.as_str(),
            queue_wait_ms: Some(millis(waited)),
            affinity: verdict.map(|verdict| verdict.outcome.as_str()),
            ..Entry::default()
        };
        (settings, entry, parts.request_log.clone())
    });
    // A key that captures bodies: its request's now, its answer's by a tap on the stream.
    // Boxed: it is held across the send of every request, most of which capture nothing.
    let capture = logged.as_ref().and_then(|_| {
        let limit = policy.capture_of(client)?;
        Some(Box::new((
            limit,
            Capture::of_request(buffered(&outbound.body).as_ref(), limit),
        )))
    });
    let sent = Instant::now();
    let active = parts.active.track();
    let model = lease.model().map(|m| m.to_string());
    let prompt_estimate = prompt_estimate(&outbound.body);
    let mut spent = Duration::ZERO;
    let forwarded =
        forward_charged(sending, &mut lease, model.as_deref(), outbound, &mut spent).await?;
    let forward::Forwarded {
        mut answer,
        guards,
        headers: extra_headers,
    } = forwarded;
    // Inside the body the completion hook watches: the copy is whole when the hook runs.
    let capture = capture.map(|boxed| {
        let (limit, capture) = *boxed;
        let (head, body) = std::mem::take(&mut answer.response).into_parts();
        let (tap, tapped) = Tap::new(body, limit);
        answer.response = Response::from_parts(head, http_body_util::BodyExt::boxed(tap));
        (capture, tapped)
    });
    parts.metrics.host_request(&answer.host.name);
    let status = answer.response.status();
    if status.is_client_error() || status.is_server_error() {
        parts.metrics.host_error(&answer.host.name, "status");
    }
    let ttfb = sent.elapsed();
    parts.metrics.observe_ttfb(tier, ttfb);
    let served = answer
        .response
        .extensions()
        .get::<crate::cloud::Served>()
        .map(|served| served.0.clone());
    let logged = logged.map(|(settings, mut entry, log)| {
        entry.host = Some(answer.host.name.to_string());
        entry.status = status.as_u16();
        entry.ttfb_ms = Some(millis(ttfb));
        (settings, entry, log)
    });
    let completion = completion(Answered {
        metrics: parts.metrics.clone(),
        usage: request.accounted.then(|| parts.usage.clone()),
        client: client.clone(),
        charge: charge.cloned(),
        logged,
        capture,
        model,
        host: answer.host.name.clone(),
        served,
        answered: status.is_success(),
        waited,
        sent,
        spent,
        prompt_estimate,
        verdict,
        lease,
    });
    let guard: Box<dyn Send + Sync> = Box::new((active, guards));
    let mut response = proxy::respond(
        answer,
        Some(guard),
        Some(completion),
        policy.proxy.upstream_stall_timeout,
    );
    for (name, value) in wait_header.into_iter().chain(extra_headers) {
        response.headers_mut().insert(name, value);
    }
    if let Some(verdict) = verdict {
        response.headers_mut().insert(
            headers::AFFINITY,
            HeaderValue::from_static(verdict.outcome.as_str()),
        );
        if let (Some(slot), Some(chain)) = (verdict.slot, request.chain.clone())
            && response.status().is_success()
        {
            response = tap_answer(response, parts.dispatcher.clone(), chain, slot);
        }
    }
    Ok(response)
}

/// The grant's metrics (queue wait, swap deferral, routing decision, affinity), and the
/// affinity verdict of its placement.
fn observe_grant(
    metrics: &Metrics,
    lease: &dispatch::Lease,
    tier: Tier,
    waited: Duration,
    held: Option<Duration>,
) -> Option<crate::affinity::Verdict> {
    metrics.observe_wait(tier, waited);
    if let Some(held) = held {
        metrics.observe_swap_deferral(held);
    }
    if let Some(reason) = lease.reason() {
        metrics.routing_decision(reason.metric_label());
    }
    let verdict = lease.affinity();
    if let Some(verdict) = &verdict {
        metrics.affinity(verdict.outcome);
        tracing::debug!(
            affinity = verdict.outcome.as_str(),
            cached_tokens = verdict.cached_tokens,
            "conversation placed"
        );
    }
    verdict
}

/// Sends a dispatched request upstream ([`forward::send`]). Its slot time is charged if
/// its client leaves before the answer's head, and that of attempts that reached a host
/// unanswered if it fails (a head timeout, a broken connection: the host may have computed
/// for them); `spent` holds the latter for the completion hook of an answer.
async fn forward_charged(
    sending: Sending<'_>,
    lease: &mut dispatch::Lease,
    model: Option<&str>,
    outbound: Outbound,
    spent: &mut Duration,
) -> Result<forward::Forwarded, ProxyError> {
    let Sending {
        parts,
        policy,
        request,
        ..
    } = sending;
    let client = &request.caller.id;
    let abandoned = Abandoned(request.accounted.then(|| {
        (
            parts.usage.clone(),
            client.clone(),
            model.unwrap_or_default().to_owned(),
            Instant::now(),
        )
    }));
    let forwarded = forward::send(
        parts.forward(),
        policy.clone(),
        lease,
        model,
        outbound,
        spent,
    )
    .await;
    // Answered (the body's completion hook charges it from here) or failed: not abandoned.
    abandoned.disarm();
    if forwarded.is_err() && request.accounted && !spent.is_zero() {
        parts.usage.record(
            client,
            model.unwrap_or_default(),
            Totals {
                gpu_ns: u64::try_from(spent.as_nanos()).unwrap_or(u64::MAX),
                requests: 1,
                ..Totals::default()
            },
            std::time::SystemTime::now(),
        );
    }
    forwarded
}

/// What the completion hook of an answered request reads.
struct Answered {
    metrics: Arc<Metrics>,
    /// Set for an accounted request.
    usage: Option<Arc<Usage>>,
    client: Arc<str>,
    charge: Option<minute::Charge>,
    /// The request log's line, when the log is on.
    logged: Option<(Arc<crate::request_log::Settings>, Entry, Arc<RequestLog>)>,
    /// A capturing key's request body, and the tap copying its answer's first bytes.
    capture: Option<(Capture, capture::Tapped)>,
    model: Option<String>,
    host: Arc<str>,
    /// The Ollama Cloud account that answered, on a cloud host.
    served: Option<Arc<str>>,
    /// The answer's head was a success.
    answered: bool,
    waited: Duration,
    sent: Instant,
    /// The slot time of attempts before the one that answered.
    spent: Duration,
    prompt_estimate: u64,
    verdict: Option<crate::affinity::Verdict>,
    lease: dispatch::Lease,
}

/// The completion hook of an answered request: settles its per-minute charge, writes its
/// request log line, records its usage, and tells the dispatcher what the slot cost.
fn completion(answered: Answered) -> Completion {
    Box::new(move |outcome| {
        let Answered {
            metrics,
            usage,
            client,
            charge,
            logged,
            capture,
            model,
            host,
            served,
            answered,
            waited,
            sent,
            spent,
            prompt_estimate,
            verdict,
            lease,
        } = answered;
        if let Some(charge) = charge {
            let used = outcome
                .tokens
                .prompt
                .saturating_add(outcome.tokens.completion);
            charge.settle(used, tokio::time::Instant::now());
        }
        let cached_tokens = outcome
            .cached_tokens
            .or(verdict.map(|verdict| u64::from(verdict.cached_tokens)));
        if let Some((settings, mut entry, log)) = logged {
            entry.time = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
            entry.model = model.clone();
            entry.duration_ms = millis(waited + sent.elapsed());
            entry.prompt_tokens = Some(outcome.tokens.prompt);
            entry.completion_tokens = Some(outcome.tokens.completion);
            entry.cached_tokens = cached_tokens;
            entry.capture = capture.map(|(capture, tapped)| capture.with_answer(&tapped));
            log.record(&settings, entry, &metrics);
        }
        // GPU time: Ollama's figure (and the attempts before the one that answered), else
        // the time the request held its slots.
        let gpu = outcome
            .total_duration
            .map_or_else(|| sent.elapsed(), |total| total.saturating_add(spent));
        if outcome.in_band_error {
            // A 200 whose stream ended in an error (a llama-server's context overflow, an
            // Ollama runner's crash): a failure of the host, relayed to the client as it came.
            metrics.host_error(&host, "in_band");
            tracing::info!(host = %host, "the answer's stream ended with an in-band error");
        }
        if let Some(usage) = usage {
            usage.record_on(
                &client,
                model.as_deref().unwrap_or_default(),
                served.as_deref(),
                Totals {
                    gpu_ns: u64::try_from(gpu.as_nanos()).unwrap_or(u64::MAX),
                    // A stream that stated no prompt count is charged an estimate, so that
                    // leaving out `include_usage` (or cutting the stream) does not dodge a
                    // token budget.
                    prompt_tokens: if outcome.prompt_stated || !answered {
                        outcome.tokens.prompt
                    } else {
                        prompt_estimate
                    },
                    completion_tokens: outcome.tokens.completion,
                    requests: 1,
                    // The engine's own figure, where it states one, wins over the estimate.
                    cached_tokens,
                    ..Totals::default()
                },
                std::time::SystemTime::now(),
            );
        }
        release(lease, &metrics, &outcome, verdict);
    })
}

/// Hands the slot back with what the answer taught: the model's load time, the host's
/// prefill rate, the request's cost.
fn release(
    mut lease: dispatch::Lease,
    metrics: &Metrics,
    outcome: &crate::upstream::Outcome,
    verdict: Option<crate::affinity::Verdict>,
) {
    if lease.loads()
        && let (Some(host), Some(model), Some(load)) =
            (lease.host(), lease.model(), outcome.load_duration)
    {
        metrics.model_load(&host.name, model, load);
    }
    if let Some(rate) = outcome.engine_prefill.filter(|_| !outcome.in_band_error) {
        // A llama-server's own figure, cached tokens left out: the host's rate.
        lease.set_prefill(Some(rate));
    } else if verdict.is_some_and(|verdict| verdict.cached_tokens == 0)
        && !outcome.in_band_error
        && let Some(duration) = outcome.prompt_eval_duration
        && outcome.tokens.prompt > 0
    {
        // Nothing of the prompt was cached: its prefill time is the host's rate.
        lease.set_prefill(Some(duration.as_secs_f64() / outcome.tokens.prompt as f64));
    }
    lease.set_cost(outcome.total_duration, outcome.load_duration);
    lease.set_engine_cached(outcome.cached_tokens);
    drop(lease);
}

/// Records the answer's text, when the body ends whole, as what the runner now holds.
fn tap_answer(
    response: Response<Body>,
    dispatcher: Arc<Dispatcher>,
    chain: Arc<Chain>,
    slot: crate::affinity::Slot,
) -> Response<Body> {
    use http_body_util::BodyExt;
    let (parts, body) = response.into_parts();
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok());
    let tapped = Tapped::new(
        body,
        chain.shape,
        content_type,
        Box::new(move |answer| {
            if let Some(point) = chain.answered(&answer) {
                dispatcher.answered(slot, point);
            }
        }),
    );
    Response::from_parts(parts, tapped.boxed())
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

/// The request's `X-Request-ID`, as the log shows it.
fn request_id_of(headers: &http::HeaderMap) -> String {
    headers
        .get(headers::REQUEST_ID)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// The end user of an app's sub-client `<app>/<user>` (a `client_id` holds no `/`).
fn user_of(client: &str) -> Option<String> {
    client.split_once('/').map(|(_, user)| user.to_owned())
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// The tokens a request is charged at admission against a per-minute token limit: its
/// prompt's estimate where its conversation was read, else its body's size at the same
/// bytes per token (the answer corrects it).
fn estimated_tokens(outbound: &Outbound, chain: Option<&Chain>) -> u64 {
    chain.map_or_else(
        || prompt_estimate(&outbound.body),
        |chain| u64::from(chain.tokens),
    )
}

/// The prompt tokens a request body stands for when its answer does not say: a token for
/// every [`BYTES_PER_TOKEN`](crate::affinity::chain::BYTES_PER_TOKEN) bytes of the body sent,
/// rounded up (the whole body, its JSON included: Ollama's tokenizers average about that
/// on English text).
/// The body of a request read whole (a shared buffer, not a copy).
fn buffered(body: &RequestBody) -> Option<bytes::Bytes> {
    match body {
        RequestBody::Buffered(bytes) => Some(bytes.clone()),
        RequestBody::Streamed(_) => None,
    }
}

fn prompt_estimate(body: &RequestBody) -> u64 {
    match body {
        RequestBody::Buffered(bytes) => {
            (bytes.len() as u64).div_ceil(u64::from(crate::affinity::chain::BYTES_PER_TOKEN))
        }
        RequestBody::Streamed(_) => 0,
    }
}

fn declared_length(headers: &http::HeaderMap) -> u64 {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse().ok())
        .unwrap_or(0)
}
