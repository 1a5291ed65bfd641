//! The inference path every generating endpoint shares: admission (cloud script, scripted
//! failure, the model in VRAM when that mode is on, slot, hold gate), the service time of a non-streamed answer, and the line engine of a
//! streamed one. The engine renders each line when it is sent, so `created_at` is the real send
//! time; it holds the slot and the request's tracker inside the response body, so a client that
//! goes away releases the slot at once (the body is dropped with the connection).

use std::convert::Infallible;
use std::future::pending;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::stream::unfold;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use serde_json::{Map, Value, json};

use super::gojson::KeepAlive;
use super::handle::Failure;
use super::record::lock;
use super::slots::{Busy, SlotGuard};
use super::state::{ConnCtl, Ctx, Shared, Tracker};
use super::vram::{Refused, Resident};
use super::wire::{GIN_JSON, PLAIN_JSON, Reply, full, gin_error, nanos, openai_error, status};

/// Ollama's queue-full text; note the two spaces.
pub(crate) const BUSY: &str = "server busy, please try again.  maximum pending requests exceeded";

/// How an endpoint shapes errors raised during admission.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Flavor {
    /// A native endpoint; `streaming` when the client asked for a stream.
    Native { streaming: bool },
    /// An OpenAI-compatible endpoint.
    OpenAi,
}

/// A request that got its slot.
#[derive(Debug)]
pub(crate) struct Admitted {
    slot: SlotGuard,
    // Held as long as the slot: the model's runner slot, when runners are on.
    runner: Option<super::runners::RunnerSlot>,
    // Released with the slot: a request holds its model as long as it runs.
    resident: Option<Resident>,
    cut: Option<Cut>,
    flavor: Flavor,
    clock: Clock,
}

/// How a scripted failure cuts a response short.
#[derive(Debug)]
enum Cut {
    /// Drop the connection after this many lines.
    Die(usize),
    /// Send an in-band error after this many lines, then end the stream.
    Error(usize, String),
    /// Go silent after this many lines, the connection left open.
    Stall(usize),
}

/// The times behind Ollama's metrics.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    /// The request arrived.
    pub started: Instant,
    /// It got its slot.
    pub admitted: Instant,
    /// Its first line was sent (streamed), or a tenth into its service time (not streamed).
    pub first: Instant,
    /// Now: the moment the line being rendered is sent.
    pub now: Instant,
    /// What the prompt cache made of the request, when it is on: `prompt_eval_count` counts
    /// every prompt token and `prompt_eval_duration` only the uncached ones' reading (Ollama
    /// 0.30 and later).
    pub cache: Option<super::runners::CacheUse>,
}

/// The lines of one streamed response.
pub(crate) trait Script: Send + 'static {
    /// How many lines the stream has.
    fn lines(&self) -> usize;
    /// Whether line `line` (never the first) waits one token interval before it is sent.
    fn paced(&self, line: usize) -> bool;
    /// Renders line `line` at the moment it is sent.
    fn render(&mut self, line: usize, clock: &Clock) -> Bytes;
    /// The in-band error line that ends a failed stream; `None` to end it without one.
    fn error_line(&self, message: &str) -> Option<Bytes>;
}

/// Runs admission for a request on `model` with its `keep_alive`. `Err` carries the reply to
/// send instead (or never resolves when the scripted failure drops the connection).
pub(crate) async fn admit(
    ctx: &mut Ctx,
    flavor: Flavor,
    model: &str,
    keep_alive: Option<KeepAlive>,
) -> Result<Admitted, Reply> {
    ctx.mark_inference();
    let shared = Arc::clone(&ctx.shared);
    if let (Some(cloud), Some(key)) = (&shared.cloud, &ctx.key)
        && let Some(reply) = cloud.next_reply(key).to_reply()
    {
        return Err(reply);
    }
    if let (Some(cloud), Some(key)) = (&shared.cloud, &ctx.key) {
        // Billed when admitted: the answer's output tokens at the account's price.
        super::record::lock(&cloud.billing).charge(key, model, shared.timing().tokens);
    }
    let mut cut = None;
    match shared.next_failure() {
        None => {}
        Some(Failure::Refuse) => return Err(abort(ctx, false).await),
        Some(Failure::Reset) => return Err(abort(ctx, true).await),
        Some(Failure::Status(code, body)) => {
            let content_type = match flavor {
                Flavor::Native { streaming: false } => GIN_JSON,
                Flavor::Native { streaming: true } | Flavor::OpenAi => PLAIN_JSON,
            };
            return Err(full(status(code), Some(content_type), body));
        }
        Some(Failure::DieMidStream { after_lines }) => cut = Some(Cut::Die(after_lines)),
        Some(Failure::StallMidStream { after_lines }) => cut = Some(Cut::Stall(after_lines)),
        Some(Failure::ErrorMidStream {
            after_lines,
            message,
        }) => {
            cut = Some(Cut::Error(after_lines, message));
        }
    }
    let resident = match &shared.vram {
        Some(vram) => Some(
            vram.acquire(model, keep_alive)
                .await
                .map_err(|refused| refuse(flavor, &refused))?,
        ),
        None => None,
    };
    let runner = match &shared.runners {
        Some(runners) => {
            let canonical = super::models::canonical(model);
            let embedding = lock(&shared.models)
                .find(model)
                .is_some_and(|found| found.kind == super::models::Kind::Embedding);
            let answer = tokens(shared.timing().tokens).concat();
            let prompt = ctx.prompt.take();
            Some(
                runners
                    .acquire(
                        &canonical,
                        embedding,
                        ctx.client_id.clone(),
                        prompt.as_ref().map(|prompt| (prompt, answer.as_str())),
                    )
                    .await,
            )
        }
        None => None,
    };
    let slot = match shared
        .slots
        .acquire(ctx.client_id.clone(), ctx.key.clone())
        .await
    {
        Ok(slot) => slot,
        Err(Busy) => {
            return Err(match flavor {
                Flavor::Native { .. } => gin_error(StatusCode::SERVICE_UNAVAILABLE, BUSY),
                Flavor::OpenAi => openai_error(StatusCode::SERVICE_UNAVAILABLE, BUSY),
            });
        }
    };
    shared.slots.pass_hold().await;
    let admitted = Instant::now();
    let cache = runner.as_ref().and_then(|runner| runner.cache);
    if let Some(cache) = cache
        && !cache.prefill.is_zero()
    {
        // Reading the uncached part of the prompt, inside the slot.
        tokio::time::sleep(cache.prefill).await;
    }
    let clock = Clock {
        started: ctx.started,
        admitted,
        first: admitted,
        now: admitted,
        cache,
    };
    Ok(Admitted {
        slot,
        runner,
        resident,
        cut,
        flavor,
        clock,
    })
}

/// Spends a non-streamed request's service time inside its slot and returns the clock for its
/// metrics. A scripted `DieMidStream` drops the connection instead; an `ErrorMidStream` becomes
/// a 500 with its message.
pub(crate) async fn serve(ctx: &mut Ctx, admitted: Admitted) -> Result<Clock, Reply> {
    let latency = ctx.shared.timing().latency;
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    match admitted.cut {
        None => {}
        Some(Cut::Die(_)) => return Err(abort(ctx, false).await),
        Some(Cut::Stall(_)) => return Err(pending::<Reply>().await),
        Some(Cut::Error(_, message)) => {
            return Err(match admitted.flavor {
                Flavor::Native { .. } => gin_error(StatusCode::INTERNAL_SERVER_ERROR, &message),
                Flavor::OpenAi => openai_error(StatusCode::INTERNAL_SERVER_ERROR, &message),
            });
        }
    }
    let now = Instant::now();
    let mut clock = admitted.clock;
    clock.first = clock.admitted + (now - clock.admitted) / 10;
    clock.now = now;
    Ok(clock)
}

/// Starts a streamed response: waits the first-token delay (headers leave with the first line,
/// as with Go), then hands the slot and the tracker to the body.
pub(crate) async fn stream(
    ctx: &mut Ctx,
    admitted: Admitted,
    content_type: &'static str,
    script: impl Script,
) -> Reply {
    let delay = ctx.shared.timing().first_token_delay;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let run = Run {
        script,
        next: 0,
        runner: admitted.runner,
        slot: Some(admitted.slot),
        resident: admitted.resident,
        tracker: ctx.tracker.take(),
        cut: admitted.cut,
        conn: Arc::clone(&ctx.conn),
        shared: Arc::clone(&ctx.shared),
        clock: admitted.clock,
    };
    let mut response = Response::new(StreamBody::new(unfold(run, step)).boxed_unsync());
    *response.status_mut() = StatusCode::OK;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// Ollama's reply when the VRAM mode refuses a request: the busy 503 when the pending queue is
/// full, a 500 with the memory message when the model can never fit; before any byte.
pub(crate) fn refuse(flavor: Flavor, refused: &Refused) -> Reply {
    let (status, message) = match refused {
        Refused::Busy => (StatusCode::SERVICE_UNAVAILABLE, BUSY),
        Refused::TooLarge(message) => (StatusCode::INTERNAL_SERVER_ERROR, message.as_str()),
    };
    match (flavor, refused) {
        (Flavor::Native { streaming: true }, Refused::TooLarge(_)) => full(
            status,
            Some(PLAIN_JSON),
            json!({ "error": message }).to_string(),
        ),
        (Flavor::Native { .. }, _) => gin_error(status, message),
        (Flavor::OpenAi, _) => openai_error(status, message),
    }
}

/// The request header that sets what a request's final object reports, per request:
/// `total_duration=<ns>, prompt_eval_count=<n>, eval_count=<n>` (any of them). The OpenAI
/// routes report the counts as `usage.prompt_tokens` and `usage.completion_tokens`; they
/// never carry `total_duration`, as Ollama's do not.
pub const USAGE_HEADER: &str = "x-fake-usage";

/// What a request's final object reports instead of the measured figures (`USAGE_HEADER`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Reported {
    total_duration: Option<u64>,
    prompt: Option<usize>,
    completion: Option<usize>,
}

impl Reported {
    /// The figures a header value sets; unknown or malformed parts are ignored.
    pub(crate) fn parse(value: &str) -> Self {
        let mut reported = Self::default();
        for part in value.split(',') {
            let Some((name, number)) = part.split_once('=') else {
                continue;
            };
            let number = number.trim();
            match name.trim() {
                "total_duration" => reported.total_duration = number.parse().ok(),
                "prompt_eval_count" => reported.prompt = number.parse().ok(),
                "eval_count" => reported.completion = number.parse().ok(),
                _ => {}
            }
        }
        reported
    }

    /// The prompt tokens to report, given the counted ones.
    pub(crate) fn prompt(&self, counted: usize) -> usize {
        self.prompt.unwrap_or(counted)
    }

    /// The completion tokens to report, given the generated ones.
    pub(crate) fn completion(&self, generated: usize) -> usize {
        self.completion.unwrap_or(generated)
    }
}

/// Ollama's metric fields, integer nanoseconds.
pub(crate) fn metrics(
    clock: &Clock,
    reported: &Reported,
    prompt_tokens: usize,
    eval_count: usize,
) -> Map<String, Value> {
    let prompt_tokens = reported.prompt(
        clock
            .cache
            .map_or(prompt_tokens, |cache| cache.prompt_tokens),
    );
    let eval_count = reported.completion(eval_count);
    let prompt_eval_duration = match clock.cache {
        Some(cache) => nanos(cache.prefill),
        None => nanos(clock.first.saturating_duration_since(clock.admitted)),
    };
    let total = reported
        .total_duration
        .unwrap_or_else(|| nanos(clock.now - clock.started));
    let object = json!({
        "total_duration": total,
        "load_duration": nanos(clock.admitted - clock.started),
        "prompt_eval_count": prompt_tokens,
        "prompt_eval_duration": prompt_eval_duration,
        "eval_count": eval_count,
        "eval_duration": nanos(clock.now.saturating_duration_since(clock.first)),
    });
    match object {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

/// The text of a generation: `tokens` chunks of a fixed sentence, cycled.
pub(crate) fn tokens(count: usize) -> Vec<String> {
    const WORDS: [&str; 10] = [
        "The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".",
    ];
    (0..count)
        .map(|i| WORDS[i % WORDS.len()].to_owned())
        .collect()
}

/// How many chunks to generate: the configured count, cut by the request's own limit
/// (`num_predict`, `max_tokens`); the bool says whether the limit cut it (`done_reason: length`).
pub(crate) fn budget(configured: usize, limit: Option<&Value>) -> (usize, bool) {
    match limit
        .and_then(Value::as_u64)
        .and_then(|limit| usize::try_from(limit).ok())
    {
        Some(limit) if limit > 0 && limit < configured => (limit, true),
        _ => (configured, false),
    }
}

// Drops the connection on purpose and never resolves; the connection task drops this future.
async fn abort(ctx: &mut Ctx, reset: bool) -> Reply {
    ctx.abort_connection(reset);
    pending::<Reply>().await
}

// Field order matters: the slot and the model are released before the tracker counts a cancel.
struct Run<S> {
    script: S,
    next: usize,
    runner: Option<super::runners::RunnerSlot>,
    slot: Option<SlotGuard>,
    resident: Option<Resident>,
    tracker: Option<Tracker>,
    cut: Option<Cut>,
    conn: Arc<ConnCtl>,
    shared: Arc<Shared>,
    clock: Clock,
}

impl<S> Run<S> {
    // The response is complete: release the slot, then mark the request answered.
    fn finish(&mut self) {
        self.runner = None;
        self.slot = None;
        self.resident = None;
        if let Some(tracker) = self.tracker.take() {
            tracker.complete();
        }
    }
}

async fn step<S: Script>(mut run: Run<S>) -> Option<(Result<Frame<Bytes>, Infallible>, Run<S>)> {
    let lines = run.script.lines();
    match &run.cut {
        Some(Cut::Die(after)) if run.next >= (*after).min(lines) => {
            // Returning pending lets hyper flush the lines already written before the
            // connection task drops the connection.
            if let Some(tracker) = run.tracker.as_mut() {
                tracker.disarm();
            }
            run.conn.abort(false);
            pending::<()>().await;
        }
        // Silent for good; the slot stays held until the client goes away.
        Some(Cut::Stall(after)) if run.next >= (*after).min(lines) => {
            pending::<()>().await;
        }
        // The error replaces the final line at the latest.
        Some(Cut::Error(after, message)) if run.next >= (*after).min(lines.saturating_sub(1)) => {
            let line = run.script.error_line(message);
            run.cut = None;
            run.next = lines;
            run.finish();
            return line.map(|line| (Ok(Frame::data(line)), run));
        }
        _ => {}
    }
    if run.next >= lines {
        return None;
    }
    if run.next > 0 && run.script.paced(run.next) {
        let interval: Duration = run.shared.timing().token_interval;
        if !interval.is_zero() {
            tokio::time::sleep(interval).await;
        }
    }
    let now = Instant::now();
    if run.next == 0 {
        run.clock.first = now;
    }
    run.clock.now = now;
    let line = run.script.render(run.next, &run.clock);
    run.next += 1;
    if run.next == lines && run.cut.is_none() {
        run.finish();
    }
    Some((Ok(Frame::data(line)), run))
}
