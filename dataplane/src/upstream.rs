//! The upstream side: one pooled HTTP client for every host (plain HTTP for
//! local Ollama, rustls with the webpki roots for Ollama Cloud), and the
//! response-body wrapper that streams Ollama's answer through untouched.
//!
//! The wrapper is where a response's resources live: the host slot (and any
//! other guard) is dropped when the body ends, fails, or the client goes
//! away, never before (a long stream holds its slot to the last line). When
//! the upstream dies mid-stream on an NDJSON or SSE response, the client gets
//! one in-band error frame, as Ollama itself does, instead of a silently
//! truncated 200. An upstream that goes silent mid-body for longer than the
//! stall timeout is treated the same way (the wait for the response headers,
//! model loading included, is the request timeout's, not this one's).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body as _, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use hyper_util::rt::TokioExecutor;
use tokio::time::Sleep;

use crate::body::{Body, BoxError};
use crate::error::{Attempt, Cause};
use crate::policy::HostKind;

mod fields;
mod reuse;

pub use fields::{Field, Fields};

/// How a connection attempt failed before any response arrived.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The host could not be reached.
    #[error("connection failed: {0}")]
    Connect(String),
    /// No response headers within the request timeout.
    #[error("timed out waiting for the response")]
    Timeout,
    /// The connection broke before the response headers.
    #[error("transport error: {0}")]
    Transport(String),
    /// A pooled connection that had served answers was closed before one byte
    /// of this one: the server closed it as idle and never read the request,
    /// which may be sent again (see `reuse`).
    #[error("reused connection closed before any answer: {0}")]
    Stale(String),
}

impl UpstreamError {
    /// The class of this failure that a client may be told (`connection refused`,
    /// `timeout`, …): the OS's and the library's wording stay in the log.
    pub fn cause(&self) -> Cause {
        match self {
            Self::Timeout => Cause::Timeout,
            Self::Transport(_) | Self::Stale(_) => Cause::ConnectionClosed,
            Self::Connect(text) => {
                let text = text.to_ascii_lowercase();
                if text.contains("refused") {
                    Cause::ConnectionRefused
                } else if text.contains("timed out") || text.contains("timeout") {
                    Cause::Timeout
                } else {
                    Cause::ConnectionFailed
                }
            }
        }
    }

    /// What the failed attempt may have run upstream ([`Attempt`]): nothing when it could not
    /// connect, or when its reused connection was found closed before one byte (the server
    /// never read it); maybe when the connection broke after it was written, or when no head
    /// came in time (then it may be running still).
    pub fn attempt(&self) -> Attempt {
        match self {
            Self::Connect(_) | Self::Stale(_) => Attempt::NotSent,
            Self::Transport(_) => Attempt::Broken,
            Self::Timeout => Attempt::Unanswered,
        }
    }
}

/// TCP keep-alive probes on upstream sockets start after this much silence,
/// so that a host that vanished (power cut, cable) does not leave a
/// connection, and the slot that waits on it, open for hours.
const TCP_KEEPALIVE: Duration = Duration::from_secs(30);

/// How long an idle pooled upstream connection is kept.
const POOL_IDLE: Duration = Duration::from_secs(90);

/// How long an idle pooled connection to a host of kind `openai` is kept: less
/// than the 5 s after which a llama-server (cpp-httplib) closes it.
const ENGINE_POOL_IDLE: Duration = Duration::from_secs(4);

/// Times a request is sent again after its reused connection was found closed.
const STALE_RETRIES: usize = 3;

/// How long an idle pooled connection to a host of `kind` is kept.
pub fn pool_idle(kind: HostKind) -> Duration {
    match kind {
        HostKind::Openai => ENGINE_POOL_IDLE,
        HostKind::Ollama | HostKind::Cloud => POOL_IDLE,
    }
}

type Connector = hyper_rustls::HttpsConnector<reuse::Counting>;

/// The upstream sent nothing for the stall timeout in the middle of a body.
#[derive(Debug, thiserror::Error)]
#[error("no data from the upstream for {0:?} in the middle of the response")]
pub struct Stalled(Duration);

/// The shared upstream client.
#[derive(Clone, Debug)]
pub struct Upstream {
    client: Client<Connector, Body>,
    /// The pool for hosts of kind `openai`, which close idle connections sooner.
    engine: Client<Connector, Body>,
}

impl Upstream {
    /// A client with pooled keep-alive connections and a connect timeout.
    pub fn new(connect_timeout: Duration) -> Self {
        Self::with_pool(connect_timeout, POOL_IDLE)
    }

    /// [`Upstream::new`], closing a pooled connection idle for `pool_idle` (shorter than the
    /// server's own idle timeout, so that a request is not written to a connection the server
    /// is closing).
    pub fn with_pool(connect_timeout: Duration, pool_idle: Duration) -> Self {
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http1()
            .wrap_connector(reuse::Counting(Self::http(connect_timeout)));
        Self::pooled(connector, pool_idle)
    }

    /// [`Upstream::new`], trusting the certificates of the PEM file `ca` beside the webpki
    /// roots for `https://` (peers behind a private CA, as the control-plane link with `--ca`).
    pub fn with_ca(
        connect_timeout: Duration,
        pool_idle: Duration,
        ca: &[u8],
    ) -> Result<Self, String> {
        use rustls_pki_types::CertificateDer;
        use rustls_pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        let mut added = 0;
        for cert in CertificateDer::pem_slice_iter(ca) {
            let cert = cert.map_err(|e| format!("not a PEM certificate: {e}"))?;
            roots
                .add(cert)
                .map_err(|e| format!("not a usable CA certificate: {e}"))?;
            added += 1;
        }
        if added == 0 {
            return Err("no certificate in the CA file".into());
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(reuse::Counting(Self::http(connect_timeout)));
        Ok(Self::pooled(connector, pool_idle))
    }

    fn http(connect_timeout: Duration) -> HttpConnector {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(connect_timeout));
        http.set_nodelay(true);
        http.set_keepalive(Some(TCP_KEEPALIVE));
        http
    }

    fn pooled(connector: Connector, idle: Duration) -> Self {
        let pool = |idle: Duration| {
            Client::builder(TokioExecutor::new())
                .pool_idle_timeout(idle)
                .pool_max_idle_per_host(64)
                .build(connector.clone())
        };
        Self {
            client: pool(idle),
            engine: pool(idle.min(pool_idle(HostKind::Openai))),
        }
    }

    /// Sends `request` and waits for the response headers, at most `timeout`.
    pub async fn send(
        &self,
        request: Request<Body>,
        timeout: Duration,
    ) -> Result<Response<Incoming>, UpstreamError> {
        Self::exchange(&self.client, request, timeout).await
    }

    /// [`send`](Self::send) to a host of `kind`, from the pool kept for that kind.
    pub async fn send_to(
        &self,
        kind: HostKind,
        request: Request<Body>,
        timeout: Duration,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let client = match kind {
            HostKind::Openai => &self.engine,
            HostKind::Ollama | HostKind::Cloud => &self.client,
        };
        Self::exchange(client, request, timeout).await
    }

    /// [`send_to`](Self::send_to) a request that `request` can build again: sent
    /// again (a few times at most) when a reused connection was found closed
    /// before any byte of the answer ([`UpstreamError::Stale`]: nothing ran).
    pub async fn send_replayable(
        &self,
        kind: HostKind,
        request: impl Fn() -> Option<Request<Body>>,
        timeout: Duration,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let mut retries = 0;
        loop {
            let Some(attempt) = request() else {
                return Err(UpstreamError::Connect("invalid upstream URL".into()));
            };
            match self.send_to(kind, attempt, timeout).await {
                Err(UpstreamError::Stale(reason)) if retries < STALE_RETRIES => {
                    retries += 1;
                    tracing::debug!(%reason, "upstream closed a pooled connection; sending again");
                }
                other => return other,
            }
        }
    }

    async fn exchange(
        client: &Client<Connector, Body>,
        mut request: Request<Body>,
        timeout: Duration,
    ) -> Result<Response<Incoming>, UpstreamError> {
        // What the client would write itself, formatted anew for each request: here mostly
        // the authority as it is. (A request oqp sends never has its own.)
        if let Some(host) = host_header(request.uri())
            && let http::header::Entry::Vacant(vacant) =
                request.headers_mut().entry(http::header::HOST)
        {
            vacant.insert(host);
        }
        match tokio::time::timeout(timeout, client.request(request)).await {
            Err(_) => Err(UpstreamError::Timeout),
            Ok(Ok(response)) => {
                reuse::mark_served(&response);
                Ok(response)
            }
            Ok(Err(error)) if error.is_connect() => Err(UpstreamError::Connect(root_cause(&error))),
            Ok(Err(error)) if reuse::was_reused(&error) && reuse::closed_before_answer(&error) => {
                Err(UpstreamError::Stale(root_cause(&error)))
            }
            Ok(Err(error)) => Err(UpstreamError::Transport(root_cause(&error))),
        }
    }
}

/// The `Host` header of a request to `uri`, as hyper_util's client writes it when a request
/// has none (the host, and the port unless it is the scheme's default), without its
/// `format!`: for an authority with no user info and no default port, the authority itself.
fn host_header(uri: &http::Uri) -> Option<http::HeaderValue> {
    let authority = uri.authority()?;
    let host = authority.host();
    let default_port = if matches!(uri.scheme_str(), Some("https" | "wss")) {
        443
    } else {
        80
    };
    let port = authority
        .port()
        .filter(|port| port.as_u16() != default_port);
    let whole = authority.as_str();
    let written = match &port {
        None => whole == host,
        Some(port) => {
            whole.len() == host.len() + 1 + port.as_str().len() && whole.starts_with(host)
        }
    };
    if written {
        return http::HeaderValue::from_str(whole).ok();
    }
    match port {
        Some(port) => http::HeaderValue::from_str(&format!("{host}:{port}")).ok(),
        None => http::HeaderValue::from_str(host).ok(),
    }
}

fn root_cause(error: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = error;
    while let Some(source) = cause.source() {
        cause = source;
    }
    cause.to_string()
}

/// How a streamed response is framed, which decides how a mid-stream failure
/// is reported in-band.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `application/x-ndjson`: one JSON object per line.
    Ndjson,
    /// `text/event-stream`: `data:` frames.
    Sse,
    /// Anything else: a failure aborts the response.
    Opaque,
}

impl Framing {
    /// The framing a `Content-Type` implies.
    pub fn of(content_type: Option<&http::HeaderValue>) -> Self {
        let content_type = content_type
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default();
        if content_type.starts_with("application/x-ndjson") {
            Framing::Ndjson
        } else if content_type.starts_with("text/event-stream") {
            Framing::Sse
        } else {
            Framing::Opaque
        }
    }
}

/// How a response body ended, reported once to its [`Completion`] hook.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// True when the upstream sent the whole body.
    pub complete: bool,
    /// True when the client went away first.
    pub cancelled: bool,
    /// Ollama's `total_duration` from the final object, when it had one.
    pub total_duration: Option<Duration>,
    /// Ollama's `load_duration` from the final object, when it had one: the time the request
    /// waited for its model to load (counted from its arrival at Ollama).
    pub load_duration: Option<Duration>,
    /// Ollama's `prompt_eval_duration` from the final object, when it had one: the time of
    /// the prompt's tokens that were not cached.
    pub prompt_eval_duration: Option<Duration>,
    /// The token counts of the final object, when it had them.
    pub tokens: Tokens,
    /// False only for a stream (NDJSON or SSE) that stated no prompt count: an OpenAI
    /// stream without `stream_options.include_usage`, or a stream cut short before its
    /// final object. The caller then charges an estimate of the prompt.
    pub prompt_stated: bool,
    /// The prompt's tokens the engine says came from its cache, when it says (see
    /// [`engine_cached`]); counted in `tokens.prompt` too.
    pub cached_tokens: Option<u64>,
    /// The engine's prefill time per token (seconds), from llama-server's `timings` (see
    /// [`engine_prefill`]), when the body ended whole and stated it.
    pub engine_prefill: Option<f64>,
    /// True when a whole stream ended with an error in place of its answer (see
    /// [`in_band_error`]): a failure though its status was 200.
    pub in_band_error: bool,
    /// Time from the response headers to the end of the body.
    pub elapsed: Duration,
}

/// Whether a stream's kept tail ends with an in-band error: the last NDJSON line
/// `{"error":…}` (Ollama's runner failing mid-generation), or the last SSE event a
/// JSON object with an `error` member and no `data: [DONE]` after it (llama-server's
/// `data: {"error":{…}}`, Anthropic's `error` event). A whole JSON answer is never one.
pub fn in_band_error(framing: Framing, tail: &[u8]) -> bool {
    if framing == Framing::Opaque {
        return false;
    }
    let last = tail
        .split(|byte| *byte == b'\n')
        .map(<[u8]>::trim_ascii)
        .filter(|line| !line.is_empty())
        .filter_map(|line| match framing {
            Framing::Sse => line.strip_prefix(b"data:").map(<[u8]>::trim_ascii),
            Framing::Ndjson => Some(line),
            Framing::Opaque => None,
        })
        .next_back();
    last.and_then(|line| serde_json::from_slice::<serde_json::Value>(line).ok())
        .is_some_and(|value| value.get("error").is_some_and(|error| !error.is_null()))
}

/// The token counts of a response's final object: Ollama's `prompt_eval_count` and
/// `eval_count`, the OpenAI `usage` object's `prompt_tokens` and `completion_tokens`
/// (a non-streamed answer, or the last SSE chunk when the client asked for
/// `stream_options.include_usage`), or the agents' layers' `input_tokens` and
/// `output_tokens` (a Messages or Responses answer, the last `message_delta`, the
/// `usage` of `response.completed`). A Messages stream gives its `input_tokens` only in
/// its first event, `message_start`: the body's head supplies them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tokens {
    /// Tokens of the prompt.
    pub prompt: u64,
    /// Tokens generated.
    pub completion: u64,
}

impl Tokens {
    /// Whether the kept tail of a body states a prompt count at all.
    fn states_prompt(fields: &Fields<'_>) -> bool {
        PROMPT_FIELDS
            .into_iter()
            .any(|field| fields.number(field).is_some())
    }

    /// Whether the kept tail of a body states a completion count at all.
    fn states_completion(fields: &Fields<'_>) -> bool {
        COMPLETION_FIELDS
            .into_iter()
            .any(|field| fields.number(field).is_some())
    }

    /// The counts in the kept tail of a body (its `fields`); zero where it has none.
    pub fn of(fields: &Fields<'_>, head_prompt: Option<u64>) -> Self {
        let prompt = fields
            .number(Field::PromptEvalCount)
            .or_else(|| fields.number(Field::PromptTokens))
            // The agents' layers: a Messages answer counts apart the prompt tokens read
            // from or written to its cache; they are prompt tokens all the same.
            .or_else(|| {
                fields
                    .number(Field::InputTokens)
                    .map(|input| input.saturating_add(cache_extra(fields)))
            })
            .or_else(|| fields.number(Field::TokensEvaluated));
        Self {
            prompt: prompt.or(head_prompt).unwrap_or(0),
            completion: COMPLETION_FIELDS
                .into_iter()
                .find_map(|field| fields.number(field))
                .unwrap_or(0),
        }
    }
}

/// The prompt tokens a Messages `usage` counts apart from its `input_tokens`.
fn cache_extra(fields: &Fields<'_>) -> u64 {
    let read = fields.number(Field::CacheReadInputTokens).unwrap_or(0);
    let created = fields.number(Field::CacheCreationInputTokens).unwrap_or(0);
    read.saturating_add(created)
}

/// The prompt's tokens the engine took from its cache, as its answer states them: OpenAI's
/// `prompt_tokens_details.cached_tokens` and the Responses layer's
/// `input_tokens_details.cached_tokens`, Anthropic's `cache_read_input_tokens` (in the tail,
/// else `head_cached`, what a Messages stream's head stated), else llama.cpp's
/// `timings.cache_n`.
pub fn engine_cached(fields: &Fields<'_>, head_cached: Option<u64>) -> Option<u64> {
    fields
        .number(Field::CachedTokens)
        .or_else(|| fields.number(Field::CacheReadInputTokens))
        .or(head_cached)
        .or_else(|| fields.number(Field::CacheN))
}

/// The fields that count a completion's tokens: Ollama's, OpenAI's, the agents' layers',
/// llama-server's own completion API's (`/infill`).
const COMPLETION_FIELDS: [Field; 4] = [
    Field::EvalCount,
    Field::CompletionTokens,
    Field::OutputTokens,
    Field::TokensPredicted,
];

/// The fields that count a prompt's tokens: Ollama's, OpenAI's, the agents' layers',
/// llama-server's own completion API's (`/infill`).
const PROMPT_FIELDS: [Field; 4] = [
    Field::PromptEvalCount,
    Field::PromptTokens,
    Field::InputTokens,
    Field::TokensEvaluated,
];

/// The prompt's tokens as the head of a body (its `fields`) states them (a Messages
/// stream's `message_start`), if it does.
fn head_prompt(head: &Fields<'_>) -> Option<u64> {
    head.number(Field::InputTokens)
        .map(|input| input.saturating_add(cache_extra(head)))
}

/// Called once when a response body ends, fails or is dropped.
pub type Completion = Box<dyn FnOnce(Outcome) + Send + Sync>;

/// Bytes kept from the end of a body to find Ollama's final metrics.
const TAIL_BYTES: usize = 2048;

/// Streams an upstream body to the client, frame by frame, holding `guard`
/// until the upstream body ends (not until the client has read it: the slot
/// is the upstream's, and the next request may use it while the last bytes
/// are still being written to this client).
pub struct ResponseBody {
    inner: Body,
    framing: Framing,
    host: std::sync::Arc<str>,
    done: bool,
    last_byte: Option<u8>,
    tail: Vec<u8>,
    /// NDJSON lines or SSE events seen whole: a stream cut short counts them as its
    /// completion tokens (about one a chunk), having no final object.
    chunks: u64,
    /// Bytes seen so far, while the tail still holds the whole body.
    seen: usize,
    /// The prompt's tokens as the body's head states them (see [`Tokens::of`]).
    head_prompt: Option<u64>,
    /// The prompt's tokens read from the engine's cache, as the body's head states them.
    head_cached: Option<u64>,
    started: Instant,
    completion: Option<Completion>,
    guard: Option<Box<dyn Send + Sync>>,
    stall: Duration,
    /// Runs while the body waits for its next frame from the upstream.
    stall_timer: Option<Pin<Box<Sleep>>>,
    waiting: bool,
}

impl std::fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody")
            .field("framing", &self.framing)
            .field("host", &self.host)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl ResponseBody {
    /// Wraps `inner`. When `framing` allows it and the upstream did not fix
    /// the length, a mid-stream failure becomes one in-band error frame; so
    /// does an upstream that sends nothing for `stall` between two frames.
    pub fn new(
        inner: Body,
        framing: Framing,
        host: std::sync::Arc<str>,
        guard: Option<Box<dyn Send + Sync>>,
        completion: Option<Completion>,
        stall: Duration,
    ) -> Self {
        let framing = if inner.size_hint().exact().is_some() {
            Framing::Opaque
        } else {
            framing
        };
        Self {
            inner,
            framing,
            host,
            done: false,
            last_byte: None,
            tail: Vec::new(),
            chunks: 0,
            seen: 0,
            head_prompt: None,
            head_cached: None,
            started: Instant::now(),
            completion,
            guard,
            stall,
            stall_timer: None,
            waiting: false,
        }
    }

    /// Polls the stall timer while the upstream has no frame ready: ready
    /// once the upstream has been silent for the stall timeout. The wait
    /// starts at the first poll that finds no frame (a client slow to read
    /// is not the upstream's silence) and ends with the next frame.
    fn poll_stalled(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let deadline = tokio::time::Instant::now() + self.stall;
        let timer = self
            .stall_timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !self.waiting {
            self.waiting = true;
            timer.as_mut().reset(deadline);
        }
        timer.as_mut().poll(cx)
    }

    fn observe(&mut self, data: &Bytes) {
        self.chunks = self
            .chunks
            .saturating_add(chunk_ends(self.framing, self.last_byte, data));
        if let Some(last) = data.last() {
            self.last_byte = Some(*last);
        }
        if data.len() >= TAIL_BYTES {
            self.tail.clear();
            self.tail
                .extend_from_slice(&data[data.len() - TAIL_BYTES..]);
        } else {
            let overflow = (self.tail.len() + data.len()).saturating_sub(TAIL_BYTES);
            self.tail.drain(..overflow);
            self.tail.extend_from_slice(data);
        }
        // Only while the tail is the body's head too, and only for event streams (a
        // whole answer states its counts at its end).
        if self.framing == Framing::Sse && self.head_prompt.is_none() && self.seen < TAIL_BYTES {
            self.seen = self.seen.saturating_add(data.len());
            let head = Fields::of(&self.tail);
            self.head_prompt = head_prompt(&head);
            if self.head_prompt.is_some() {
                self.head_cached = head.number(Field::CacheReadInputTokens);
            }
        }
    }

    fn finish(&mut self, complete: bool, cancelled: bool) {
        if let Some(completion) = self.completion.take() {
            completion(self.outcome(complete, cancelled));
        }
        // After the completion hook, so that the cost is charged before the
        // freed slot lets the scheduler pick again.
        self.guard = None;
    }

    /// What the completion hook is told: read from the kept tail, in one pass, when the
    /// body ended whole.
    fn outcome(&self, complete: bool, cancelled: bool) -> Outcome {
        let prompt_stated = self.framing == Framing::Opaque || self.head_prompt.is_some();
        if !complete {
            // Cut short (the upstream died, the client went away): no final object, so
            // the chunks seen stand for the tokens generated, and a token budget is not
            // dodged by disconnecting.
            return Outcome {
                complete,
                cancelled,
                total_duration: None,
                load_duration: None,
                prompt_eval_duration: None,
                tokens: Tokens {
                    prompt: self.head_prompt.unwrap_or(0),
                    completion: self.chunks,
                },
                prompt_stated,
                cached_tokens: None,
                engine_prefill: None,
                in_band_error: false,
                elapsed: self.started.elapsed(),
            };
        }
        let fields = Fields::of(&self.tail);
        let nanos = |field| fields.number(field).map(Duration::from_nanos);
        let mut tokens = Tokens::of(&fields, self.head_prompt);
        // A stream that states no completion count (an OpenAI stream without
        // `stream_options.include_usage`) counts its chunks, as one cut short does, so
        // that leaving the option out does not dodge a token budget.
        if self.framing != Framing::Opaque && !Tokens::states_completion(&fields) {
            tokens.completion = self.chunks;
        }
        Outcome {
            complete,
            cancelled,
            total_duration: nanos(Field::TotalDuration),
            load_duration: nanos(Field::LoadDuration),
            prompt_eval_duration: nanos(Field::PromptEvalDuration),
            tokens,
            prompt_stated: prompt_stated || Tokens::states_prompt(&fields),
            cached_tokens: engine_cached(&fields, self.head_cached),
            in_band_error: in_band_error(self.framing, &self.tail),
            engine_prefill: engine_prefill(&fields),
            elapsed: self.started.elapsed(),
        }
    }

    fn error_frame(&self, error: &BoxError) -> Option<Bytes> {
        tracing::warn!(host = %self.host, %error, "upstream failed mid-stream");
        let message = format!(
            "upstream host '{}' failed before the response was complete",
            self.host
        );
        // A partial line is closed first, so that the error stands on its own
        // line; a blank line is never written.
        let newline = if self.last_byte.is_some_and(|b| b != b'\n') {
            "\n"
        } else {
            ""
        };
        match self.framing {
            Framing::Ndjson => {
                let line = serde_json::json!({ "error": message });
                Some(Bytes::from(format!("{newline}{line}\n")))
            }
            Framing::Sse => {
                let frame = serde_json::json!({
                    "error": { "message": message, "type": "api_error", "param": null, "code": null }
                });
                Some(Bytes::from(format!("{newline}data: {frame}\n\n")))
            }
            Framing::Opaque => None,
        }
    }
}

impl http_body::Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        let polled = match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(polled) => polled,
            Poll::Pending => {
                ready!(this.poll_stalled(cx));
                Some(Err(Box::new(Stalled(this.stall)) as BoxError))
            }
        };
        this.waiting = false;
        match polled {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    this.observe(data);
                }
                if this.inner.is_end_stream() {
                    // The last frame of a body of known length: release now
                    // rather than on the next poll.
                    this.done = true;
                    this.finish(true, false);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(error)) => {
                this.done = true;
                let frame = this.error_frame(&error);
                this.finish(false, false);
                match frame {
                    Some(bytes) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
                    None => Poll::Ready(Some(Err(error))),
                }
            }
            None => {
                this.done = true;
                this.finish(true, false);
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        if self.framing == Framing::Opaque {
            self.inner.size_hint()
        } else {
            SizeHint::default()
        }
    }
}

impl Drop for ResponseBody {
    fn drop(&mut self) {
        // Still running when dropped: the client went away. Dropping `inner`
        // closes the upstream connection, which makes Ollama stop generating.
        self.finish(false, true);
    }
}

/// How many NDJSON lines (a newline after a non-empty line) or SSE events (a blank line
/// after a line) end in `data`, given the byte before it; none for opaque bodies.
fn chunk_ends(framing: Framing, before: Option<u8>, data: &[u8]) -> u64 {
    let ends_record = |previous: Option<u8>| match framing {
        Framing::Ndjson => previous.is_some_and(|byte| byte != b'\n'),
        Framing::Sse => previous == Some(b'\n'),
        Framing::Opaque => false,
    };
    if framing == Framing::Opaque {
        return 0;
    }
    let mut previous = before;
    let mut ends = 0;
    for &byte in data {
        if byte == b'\n' && ends_record(previous) {
            ends += 1;
            // A third newline does not end another event.
            previous = if framing == Framing::Sse {
                None
            } else {
                Some(byte)
            };
        } else {
            previous = Some(byte);
        }
    }
    ends
}

/// The fewest prompt tokens an engine must have evaluated for its prefill time to teach a
/// rate: a few tokens' time is mostly the request's fixed cost.
const MIN_PREFILL_TOKENS: u64 = 64;

/// The prefill time per token, in seconds, that a llama-server answer's `timings` state:
/// `prompt_ms / prompt_n`, where `prompt_n` counts only the tokens it evaluated (not those
/// it found cached), so an answer with a cache hit teaches the rate too. `None` without
/// `timings`, or for fewer than `MIN_PREFILL_TOKENS` evaluated tokens.
pub fn engine_prefill(fields: &Fields<'_>) -> Option<f64> {
    let evaluated = fields.number(Field::PromptN)?;
    if evaluated < MIN_PREFILL_TOKENS {
        return None;
    }
    let millis = fields.decimal(Field::PromptMs)?;
    (millis.is_finite() && millis > 0.0).then(|| millis / 1000.0 / evaluated as f64)
}

/// Ollama's `total_duration` (nanoseconds) in the final object, if the tail
/// of the body has one.
pub fn total_duration(tail: &[u8]) -> Option<Duration> {
    Fields::of(tail)
        .number(Field::TotalDuration)
        .map(Duration::from_nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_header_is_the_one_the_client_would_write() {
        let cases = [
            ("http://127.0.0.1:11434/api/tags", "127.0.0.1:11434"),
            ("http://gpu/api/tags", "gpu"),
            ("http://gpu:80/api/tags", "gpu"),
            ("https://ollama.com:443/api/chat", "ollama.com"),
            ("https://ollama.com:80/api/chat", "ollama.com:80"),
            ("http://gpu:443/", "gpu:443"),
            ("http://user:secret@gpu:8080/", "gpu:8080"),
            ("http://user@gpu/", "gpu"),
            ("http://[::1]:11434/", "[::1]:11434"),
        ];
        for (uri, host) in cases {
            let uri: http::Uri = uri.parse().unwrap();
            assert_eq!(host_header(&uri).unwrap(), host, "{uri}");
        }
        assert_eq!(host_header(&"/api/tags".parse().unwrap()), None);
    }

    #[test]
    fn a_failure_says_what_the_attempt_may_have_run() {
        // Nothing ran: the connection failed, or a reused one was closed before one byte
        // (the server never read the request). Maybe: broken after it was written, or no
        // head in time (running still, perhaps).
        let table = [
            (UpstreamError::Connect("refused".into()), Attempt::NotSent),
            (UpstreamError::Stale("closed".into()), Attempt::NotSent),
            (UpstreamError::Transport("reset".into()), Attempt::Broken),
            (UpstreamError::Timeout, Attempt::Unanswered),
        ];
        for (error, attempt) in table {
            assert_eq!(error.attempt(), attempt, "{error}");
        }
    }

    #[test]
    fn a_number_is_read_after_the_last_occurrence_of_its_field() {
        let number = |tail: &[u8], field| Fields::of(tail).number(field);
        let tail = br#"{"eval_count":1}{"x":"\"eval_count\":","eval_count": 42,"prompt_n":7}"#;
        assert_eq!(number(tail, Field::EvalCount), Some(42));
        assert_eq!(number(tail, Field::PromptN), Some(7));
        assert_eq!(number(tail, Field::PromptEvalCount), None);
        // No digits, too many for a u64, a field cut at the end.
        assert_eq!(number(br#"{"cache_n":"1"}"#, Field::CacheN), None);
        assert_eq!(
            number(br#"{"cache_n":18446744073709551616}"#, Field::CacheN),
            None
        );
        assert_eq!(
            number(br#"{"cache_n":18446744073709551615}"#, Field::CacheN),
            Some(u64::MAX)
        );
        assert_eq!(number(br#"{"cache_n""#, Field::CacheN), None);
    }

    #[test]
    fn the_prefill_rate_is_read_from_llama_servers_timings() {
        let tail = br#"{"usage":{"prompt_tokens":1296,"prompt_tokens_details":{"cached_tokens":908}},"timings":{"cache_n":908,"prompt_n":388,"prompt_ms":1241.6,"prompt_per_token_ms":3.2}}"#;
        let rate = engine_prefill(&Fields::of(tail)).expect("a rate");
        assert!((rate - 0.0032).abs() < 1e-9, "{rate}");
        // Too few evaluated tokens to say anything; no timings at all.
        assert_eq!(
            engine_prefill(&Fields::of(
                br#"{"timings":{"prompt_n":1,"prompt_ms":3.9}}"#
            )),
            None
        );
        assert_eq!(
            engine_prefill(&Fields::of(br#"{"done":true,"prompt_eval_count":300}"#)),
            None
        );
        assert_eq!(
            engine_prefill(&Fields::of(
                br#"{"timings":{"prompt_n":100,"prompt_ms":0}}"#
            )),
            None
        );
    }

    #[test]
    fn in_band_errors_are_told_from_answers() {
        // llama-server: an error event in a 200, no [DONE].
        let llama = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"error\":{\"code\":500,\"message\":\"Context size has been exceeded.\",\"type\":\"server_error\"}}\n\n";
        assert!(in_band_error(Framing::Sse, llama));
        // Anthropic's error event.
        let messages = b"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\"}}\n\n";
        assert!(in_band_error(Framing::Sse, messages));
        // Ollama's runner failing mid-generation.
        let ollama = b"{\"response\":\"a\",\"done\":false}\n{\"error\":\"an error was encountered while running the model\"}\n";
        assert!(in_band_error(Framing::Ndjson, ollama));

        let done = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\n\ndata: [DONE]\n\n";
        assert!(!in_band_error(Framing::Sse, done));
        let null = b"data: {\"type\":\"response.completed\",\"error\":null}\n\n";
        assert!(!in_band_error(Framing::Sse, null));
        let whole = b"{\"done\":true,\"eval_count\":3}\n";
        assert!(!in_band_error(Framing::Ndjson, whole));
        // A whole JSON answer is never in-band, whatever it says.
        assert!(!in_band_error(Framing::Opaque, br#"{"error":"x"}"#));
        assert!(!in_band_error(Framing::Sse, b""));
    }

    #[test]
    fn openai_hosts_idle_out_before_a_llama_server_does() {
        // llama-server (cpp-httplib) closes a keep-alive connection idle for 5 s.
        assert!(pool_idle(HostKind::Openai) < Duration::from_secs(5));
        assert_eq!(pool_idle(HostKind::Ollama), POOL_IDLE);
        assert_eq!(pool_idle(HostKind::Cloud), POOL_IDLE);
    }

    /// A keep-alive HTTP/1 server on loopback that answers `200 ok`, except that it closes
    /// the connection without a byte when `closes(connection, request)` (both counted
    /// from 0) says so; returns its address and the number of connections it accepted.
    async fn closing_server(
        closes: fn(usize, usize) -> bool,
    ) -> (std::net::SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let connection = count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    let mut request = 0;
                    let mut buffer = [0u8; 1024];
                    while let Ok(read) = socket.read(&mut buffer).await {
                        if read == 0 {
                            return;
                        }
                        seen.extend_from_slice(&buffer[..read]);
                        while let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                            seen.drain(..end + 4);
                            if closes(connection, request) {
                                return;
                            }
                            request += 1;
                            let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                            if socket.write_all(answer).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        (address, accepted)
    }

    fn get(address: std::net::SocketAddr) -> Option<Request<Body>> {
        Request::get(format!("http://{address}/health"))
            .body(crate::body::empty())
            .ok()
    }

    #[tokio::test]
    async fn a_request_on_a_reused_connection_closed_before_an_answer_is_sent_again() {
        use http_body_util::BodyExt;
        use std::sync::atomic::Ordering;
        // The first connection answers once, then closes as the next request comes (an
        // engine's idle close racing it); the connections after it answer.
        let (address, accepted) =
            closing_server(|connection, request| connection == 0 && request == 1).await;
        let upstream = Upstream::new(Duration::from_secs(5));
        let timeout = Duration::from_secs(10);
        let first = upstream
            .send_to(HostKind::Openai, get(address).unwrap(), timeout)
            .await;
        let body = first
            .expect("answered")
            .into_body()
            .collect()
            .await
            .unwrap();
        assert_eq!(body.to_bytes().as_ref(), b"ok");
        let again = upstream
            .send_replayable(HostKind::Openai, || get(address), timeout)
            .await
            .expect("sent again on a new connection");
        assert_eq!(again.status(), http::StatusCode::OK);
        assert_eq!(accepted.load(Ordering::SeqCst), 2);

        // Without a way to build it again the same failure is reported, classed as stale.
        let _ = again.into_body().collect().await;
        let (address, _) = closing_server(|_, request| request == 1).await;
        let first = upstream
            .send_to(HostKind::Openai, get(address).unwrap(), timeout)
            .await;
        let _ = first.expect("answered").into_body().collect().await;
        let stale = upstream
            .send_to(HostKind::Openai, get(address).unwrap(), timeout)
            .await;
        assert!(matches!(stale, Err(UpstreamError::Stale(_))), "{stale:?}");
    }

    #[tokio::test]
    async fn a_fresh_connection_closed_before_an_answer_is_not_sent_again() {
        use std::sync::atomic::Ordering;
        // The server may have run it: a failure, not a retry.
        let (address, accepted) = closing_server(|_, _| true).await;
        let upstream = Upstream::new(Duration::from_secs(5));
        let failed = upstream
            .send_replayable(HostKind::Openai, || get(address), Duration::from_secs(10))
            .await;
        assert!(
            matches!(failed, Err(UpstreamError::Transport(_))),
            "{failed:?}"
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn failures_are_told_by_class() {
        let refused = UpstreamError::Connect("Connection refused (os error 111)".into());
        assert_eq!(refused.cause(), Cause::ConnectionRefused);
        let slow = UpstreamError::Connect("connection timed out".into());
        assert_eq!(slow.cause(), Cause::Timeout);
        assert_eq!(UpstreamError::Timeout.cause(), Cause::Timeout);
        let dns = UpstreamError::Connect("failed to lookup address information".into());
        assert_eq!(dns.cause(), Cause::ConnectionFailed);
        let broken = UpstreamError::Transport("connection reset".into());
        assert_eq!(broken.cause(), Cause::ConnectionClosed);
    }

    #[test]
    fn finds_total_duration_in_the_last_object() {
        let tail = br#"{"done":false}
{"done":true,"total_duration":174560334,"load_duration":1}
"#;
        assert_eq!(
            total_duration(tail),
            Some(Duration::from_nanos(174_560_334))
        );
        assert_eq!(total_duration(b"{\"done\":true}"), None);
    }

    #[test]
    fn reads_token_counts_of_native_and_openai_final_objects() {
        let native = br#"{"done":false}
{"done":true,"total_duration":5,"prompt_eval_count":12,"eval_count":30}
"#;
        assert_eq!(
            Tokens::of(&Fields::of(native), None),
            Tokens {
                prompt: 12,
                completion: 30
            }
        );
        let sse = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":9,\"total_tokens\":16}}\n\ndata: [DONE]\n\n";
        assert_eq!(
            Tokens::of(&Fields::of(sse), None),
            Tokens {
                prompt: 7,
                completion: 9
            }
        );
        let embed = br#"{"embeddings":[[0.1]],"total_duration":3,"prompt_eval_count":4}"#;
        assert_eq!(
            Tokens::of(&Fields::of(embed), None),
            Tokens {
                prompt: 4,
                completion: 0
            }
        );
        assert_eq!(
            Tokens::of(&Fields::of(b"{\"done\":true}"), None),
            Tokens::default()
        );
    }

    #[test]
    fn reads_token_counts_of_the_agents_layers() {
        let message =
            br#"{"type":"message","content":[],"usage":{"input_tokens":11,"output_tokens":5}}"#;
        assert_eq!(
            Tokens::of(&Fields::of(message), None),
            Tokens {
                prompt: 11,
                completion: 5
            }
        );
        // A Messages stream: input_tokens in message_start (the head), output_tokens in
        // the last message_delta.
        let start = b"event: message_start\ndata: {\"message\":{\"usage\":{\"input_tokens\":21,\"output_tokens\":0}}}\n\n";
        let end = b"event: message_delta\ndata: {\"usage\":{\"output_tokens\":8}}\n\nevent: message_stop\ndata: {}\n\n";
        assert_eq!(head_prompt(&Fields::of(start)), Some(21));
        assert_eq!(
            Tokens::of(&Fields::of(end), head_prompt(&Fields::of(start))),
            Tokens {
                prompt: 21,
                completion: 8
            }
        );
        let completed = br#"data: {"type":"response.completed","response":{"usage":{"input_tokens":3,"input_tokens_details":{"cached_tokens":0},"output_tokens":4,"total_tokens":7}}}"#;
        assert_eq!(
            Tokens::of(&Fields::of(completed), None),
            Tokens {
                prompt: 3,
                completion: 4
            }
        );
        assert_eq!(engine_cached(&Fields::of(completed), None), Some(0));
    }

    #[test]
    fn llama_servers_own_completion_counts_are_read() {
        // `/infill` (and `/completion`): the last event counts the whole prompt and the answer.
        let tail = b"data: {\"content\":\"a\",\"stop\":false,\"tokens_predicted\":1,\"tokens_evaluated\":13}\n\ndata: {\"content\":\"\",\"stop\":true,\"tokens_predicted\":4,\"tokens_evaluated\":13,\"timings\":{\"cache_n\":6,\"prompt_n\":7}}\n\n";
        assert_eq!(
            Tokens::of(&Fields::of(tail), None),
            Tokens {
                prompt: 13,
                completion: 4
            }
        );
    }

    #[test]
    fn cached_prompt_tokens_count_as_prompt_tokens_and_are_measured() {
        // llama-server's Messages answer: input_tokens excludes what its cache held.
        let message = br#"{"type":"message","usage":{"cache_read_input_tokens":47,"input_tokens":1,"output_tokens":8}}"#;
        assert_eq!(
            Tokens::of(&Fields::of(message), None),
            Tokens {
                prompt: 48,
                completion: 8
            }
        );
        assert_eq!(engine_cached(&Fields::of(message), None), Some(47));
        let created = br#"{"usage":{"input_tokens":2,"cache_creation_input_tokens":30,"cache_read_input_tokens":10,"output_tokens":1}}"#;
        assert_eq!(Tokens::of(&Fields::of(created), None).prompt, 42);
        // A Messages stream states them in message_start only.
        let start = b"event: message_start\ndata: {\"message\":{\"usage\":{\"cache_read_input_tokens\":20,\"input_tokens\":5,\"output_tokens\":0}}}\n\n";
        let end = b"event: message_delta\ndata: {\"usage\":{\"output_tokens\":3}}\n\n";
        assert_eq!(head_prompt(&Fields::of(start)), Some(25));
        assert_eq!(engine_cached(&Fields::of(end), Some(20)), Some(20));
        // OpenAI's usage (prompt_tokens includes the cached ones) and llama.cpp's timings.
        let chat = br#"{"usage":{"completion_tokens":8,"prompt_tokens":52,"total_tokens":60,"prompt_tokens_details":{"cached_tokens":51}},"timings":{"cache_n":51,"prompt_n":1}}"#;
        assert_eq!(Tokens::of(&Fields::of(chat), None).prompt, 52);
        assert_eq!(engine_cached(&Fields::of(chat), None), Some(51));
        assert_eq!(
            engine_cached(
                &Fields::of(br#"{"timings":{"cache_n":9,"prompt_n":3}}"#),
                None
            ),
            Some(9)
        );
        // Ollama says nothing of a cache.
        assert_eq!(
            engine_cached(
                &Fields::of(br#"{"done":true,"prompt_eval_count":12}"#),
                None
            ),
            None
        );
    }

    #[test]
    fn counts_that_add_up_past_a_u64_stop_at_its_largest() {
        // An upstream's figures are its own: no sum of them may overflow (a panic in a
        // debug build).
        let most = u64::MAX;
        let answer = format!(
            r#"{{"usage":{{"input_tokens":{most},"cache_read_input_tokens":{most},"cache_creation_input_tokens":{most},"output_tokens":1}}}}"#
        );
        assert_eq!(
            Tokens::of(&Fields::of(answer.as_bytes()), None).prompt,
            most
        );
        let start = format!("event: message_start\ndata: {answer}\n\n");
        assert_eq!(head_prompt(&Fields::of(start.as_bytes())), Some(most));
    }

    /// The tokens a body of `framing` reports when it is dropped after `frames`.
    fn tokens_when_cut_after(framing: Framing, frames: &[&'static str]) -> Tokens {
        let seen = Arc::new(std::sync::Mutex::new(None));
        let completion: Completion = Box::new({
            let seen = seen.clone();
            move |outcome| *seen.lock().unwrap() = Some(outcome)
        });
        let chunks: Vec<Result<Frame<Bytes>, BoxError>> = frames
            .iter()
            .map(|text| Ok(Frame::data(Bytes::from_static(text.as_bytes()))))
            .chain(std::iter::once(Err::<Frame<Bytes>, BoxError>(
                "connection reset".into(),
            )))
            .collect();
        let inner = http_body_util::BodyExt::boxed(http_body_util::StreamBody::new(
            futures_util::stream::iter(chunks),
        ));
        let mut body = ResponseBody::new(
            inner,
            framing,
            Arc::from("box"),
            None,
            Some(completion),
            Duration::from_secs(60),
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        runtime.block_on(async {
            // An opaque body passes the error on; the others end with an error line.
            while let Some(Ok(_)) = http_body_util::BodyExt::frame(&mut body).await {}
        });
        let outcome = seen.lock().unwrap().take().unwrap();
        assert!(!outcome.complete);
        outcome.tokens
    }

    /// The tokens a whole body of one frame (of unknown length) is counted.
    fn tokens_when_complete(framing: Framing, text: &'static str) -> Tokens {
        let seen = Arc::new(std::sync::Mutex::new(None));
        let completion: Completion = Box::new({
            let seen = seen.clone();
            move |outcome| *seen.lock().unwrap() = Some(outcome)
        });
        let frames = [Ok::<_, BoxError>(Frame::data(Bytes::from_static(
            text.as_bytes(),
        )))];
        let inner = http_body_util::BodyExt::boxed(http_body_util::StreamBody::new(
            futures_util::stream::iter(frames),
        ));
        let mut body = ResponseBody::new(
            inner,
            framing,
            Arc::from("box"),
            None,
            Some(completion),
            Duration::from_secs(60),
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        runtime.block_on(async {
            while let Some(Ok(_)) = http_body_util::BodyExt::frame(&mut body).await {}
        });
        let outcome = seen.lock().unwrap().take().unwrap();
        assert!(outcome.complete);
        outcome.tokens
    }

    #[test]
    fn a_stream_cut_short_counts_its_chunks_as_completion_tokens() {
        // Four whole lines (one split over two frames), a fifth cut off.
        let ndjson = tokens_when_cut_after(
            Framing::Ndjson,
            &[
                "{\"response\":\"a\"}\n{\"response\":\"b\"}\n",
                "{\"resp",
                "onse\":\"c\"}\n{\"response\":\"d\"}\n{\"res",
            ],
        );
        assert_eq!(
            ndjson,
            Tokens {
                prompt: 0,
                completion: 4
            }
        );
        // Three whole events (one ending across frames), a fourth cut off.
        let sse = tokens_when_cut_after(
            Framing::Sse,
            &[
                "data: {\"choices\":[]}\n\ndata: {\"choices\":[]}\n",
                "\ndata: {\"choices\":[]}\n\n",
                "data: {\"cho",
            ],
        );
        assert_eq!(
            sse,
            Tokens {
                prompt: 0,
                completion: 3
            }
        );
        // An opaque body has no chunks to count.
        let opaque = tokens_when_cut_after(Framing::Opaque, &["{\"a\":1}\n{\"b\":2}\n"]);
        assert_eq!(opaque, Tokens::default());
    }

    #[test]
    fn a_whole_stream_stating_no_completion_count_counts_its_chunks() {
        // An OpenAI stream without include_usage: three events, no usage.
        let events = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\
                      data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n\
                      data: [DONE]\n\n";
        assert_eq!(tokens_when_complete(Framing::Sse, events).completion, 3);
        // With a count, the count.
        let counted = "data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":9}}\n\n";
        assert_eq!(
            tokens_when_complete(Framing::Sse, counted),
            Tokens {
                prompt: 4,
                completion: 9
            }
        );
        // A whole JSON answer without one (an embed) counts none.
        let embed = "{\"embeddings\":[[0.1]],\"prompt_eval_count\":3}";
        assert_eq!(tokens_when_complete(Framing::Opaque, embed).completion, 0);
    }

    #[test]
    fn framing_follows_content_type() {
        let ndjson = http::HeaderValue::from_static("application/x-ndjson");
        let sse = http::HeaderValue::from_static("text/event-stream; charset=utf-8");
        let json = http::HeaderValue::from_static("application/json; charset=utf-8");
        assert_eq!(Framing::of(Some(&ndjson)), Framing::Ndjson);
        assert_eq!(Framing::of(Some(&sse)), Framing::Sse);
        assert_eq!(Framing::of(Some(&json)), Framing::Opaque);
        assert_eq!(Framing::of(None), Framing::Opaque);
    }
}
