//! The proxied request: read (or stream) the body, pick hosts, send, fail
//! over before the first byte, and stream the answer back.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use crate::body::{self, Body, BoxError};
use crate::budget::{OverBudget, Reservation};
use crate::error::{Elsewhere, Failures, ProxyError};
use crate::headers;
use crate::policy::Host;
use crate::upstream::{Completion, Framing, ResponseBody, Upstream, UpstreamError};

/// A request body on its way upstream.
#[derive(Debug)]
pub enum RequestBody {
    /// Read whole (inference and metadata paths): can be replayed on another
    /// host after a failure.
    Buffered(Bytes),
    /// Streamed through (uploads, unknown paths): one attempt only.
    Streamed(Body),
}

/// How a whole request body is read.
#[derive(Debug)]
pub struct BodyRead<'a, 'b> {
    /// Most bytes accepted (413 above).
    pub limit: u64,
    /// Time for the whole body to arrive (408 after).
    pub timeout: Duration,
    /// The body's share of the byte budget, grown as bytes arrive.
    pub reservation: &'a mut Reservation<'b>,
}

/// Reads a request body whole, refusing more than `read.limit` bytes with
/// 413 as soon as the declared or received length passes it, a body that
/// takes longer than `read.timeout` with 408, and one that does not fit the
/// byte budget with `over_budget()`.
pub async fn read_body(
    body: Incoming,
    headers: &http::HeaderMap,
    read: BodyRead<'_, '_>,
    over_budget: impl FnOnce() -> ProxyError,
) -> Result<Bytes, ProxyError> {
    let declared = declared_length(headers);
    if declared.is_some_and(|length| length > read.limit) {
        return Err(ProxyError::BodyTooLarge);
    }
    // The budget grows only by bytes received (in `Metered`): a declared
    // length costs nothing until its bytes arrive, so requests that only
    // announce large bodies cannot fill the budget for free.
    let limit = usize::try_from(read.limit).unwrap_or(usize::MAX);
    let metered = Metered {
        inner: Limited::new(body, limit),
        reservation: read.reservation,
        received: 0,
    };
    let collected = match tokio::time::timeout(read.timeout, metered.collect()).await {
        Err(_) => return Err(ProxyError::BodyTimeout),
        Ok(collected) => collected,
    };
    match collected {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => {
            Err(ProxyError::BodyTooLarge)
        }
        Err(error) if error.is::<OverBudget>() => Err(over_budget()),
        Err(_) => Err(ProxyError::BodyUnreadable),
    }
}

/// A body being read, counted against the byte budget frame by frame.
struct Metered<'a, 'b, B> {
    inner: B,
    reservation: &'a mut Reservation<'b>,
    received: u64,
}

impl<B> http_body::Body for Metered<'_, '_, B>
where
    B: http_body::Body<Data = Bytes, Error = BoxError> + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        if let Some(Ok(frame)) = &frame
            && let Some(data) = frame.data_ref()
        {
            this.received = this.received.saturating_add(data.len() as u64);
            if this.reservation.grow_to(this.received).is_err() {
                return Poll::Ready(Some(Err(Box::new(OverBudget))));
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Streams a request body through, failing it mid-way once it passes
/// `limit`, or once the client sends nothing for `gap` while the upstream
/// waits for more: the upstream request then fails and its slot frees,
/// instead of a trickling client holding it until the request timeout.
pub fn stream_body(
    body: Incoming,
    headers: &http::HeaderMap,
    limit: u64,
    gap: Duration,
) -> Result<Body, ProxyError> {
    if declared_length(headers).is_some_and(|length| length > limit) {
        return Err(ProxyError::BodyTooLarge);
    }
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    Ok(Paced {
        inner: Limited::new(body, limit),
        gap,
        timer: None,
        armed: false,
    }
    .boxed())
}

/// The client sent no body data for this long while it was awaited.
#[derive(Debug, thiserror::Error)]
#[error("no request body data from the client for {0:?}")]
pub struct BodyStalled(Duration);

/// A streamed body that fails when the client pauses longer than `gap`.
/// The clock runs only while the body is awaited (not while the request
/// waits in the queue, or while the upstream is slow to take a frame).
struct Paced<B> {
    inner: B,
    gap: Duration,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    armed: bool,
}

impl<B> http_body::Body for Paced<B>
where
    B: http_body::Body<Data = Bytes, Error = BoxError> + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            this.armed = false;
            return Poll::Ready(frame);
        }
        let deadline = tokio::time::Instant::now() + this.gap;
        let timer = match &mut this.timer {
            Some(timer) => {
                if !this.armed {
                    timer.as_mut().reset(deadline);
                }
                timer
            }
            None => this
                .timer
                .insert(Box::pin(tokio::time::sleep_until(deadline))),
        };
        this.armed = true;
        ready!(timer.as_mut().poll(cx));
        Poll::Ready(Some(Err(Box::new(BodyStalled(this.gap)))))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

fn declared_length(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// Everything needed to send one request upstream, possibly several times.
#[derive(Debug)]
pub struct Outbound {
    /// The method.
    pub method: http::Method,
    /// Path and query, as the client sent them.
    pub path_and_query: http::uri::PathAndQuery,
    /// Request headers, already cleaned for the upstream.
    pub headers: http::HeaderMap,
    /// The body.
    pub body: RequestBody,
    /// Whether the answer's head comes only with the whole answer (a non-streamed
    /// generation): its head timeout is `non_streamed_timeout`, not `request_timeout`.
    pub unstreamed: bool,
    /// The client's own `/v1/embeddings` body when this is its `/api/embed`
    /// translation: a host of kind `openai` is sent that instead
    /// ([`crate::rewrite::openai_host`]).
    pub openai_embeddings: Option<Bytes>,
}

impl Outbound {
    /// How long a host may take to send this request's answer head.
    pub fn head_timeout(&self, proxy: &crate::policy::ProxySettings) -> std::time::Duration {
        if self.unstreamed {
            proxy.non_streamed_timeout
        } else {
            proxy.request_timeout
        }
    }

    /// The same request in memory of its own. What hyper parsed (header
    /// values, the path, a body read in one piece) are views into the
    /// connection's read buffer; a request that waits in the queue would keep
    /// that buffer alive and make hyper allocate another for the connection.
    /// A waiting request copies what it holds (its body and a few hundred
    /// bytes of headers) instead.
    pub fn detached(self) -> Self {
        let headers = self
            .headers
            .iter()
            .map(|(name, value)| {
                // A value hyper accepted is always valid; keeping the view is
                // the fallback, never dropping the header.
                let mut copy = http::HeaderValue::from_bytes(value.as_bytes())
                    .unwrap_or_else(|_| value.clone());
                copy.set_sensitive(value.is_sensitive());
                (name.clone(), copy)
            })
            .collect();
        let path_and_query = http::uri::PathAndQuery::from_maybe_shared(Bytes::copy_from_slice(
            self.path_and_query.as_str().as_bytes(),
        ))
        .unwrap_or(self.path_and_query);
        let body = match self.body {
            RequestBody::Buffered(bytes) => RequestBody::Buffered(Bytes::copy_from_slice(&bytes)),
            streamed @ RequestBody::Streamed(_) => streamed,
        };
        Self {
            method: self.method,
            path_and_query,
            headers,
            body,
            unstreamed: self.unstreamed,
            openai_embeddings: self.openai_embeddings,
        }
    }
}

/// A response from a host, before it is wrapped for the client.
#[derive(Debug)]
pub struct Answer {
    /// The host that answered.
    pub host: Arc<Host>,
    /// Its response.
    pub response: Response<Body>,
    /// Hosts that failed before this one answered.
    pub failed: Vec<Arc<str>>,
}

impl Answer {
    /// An answer from `host` with `response`.
    pub fn new(host: Arc<Host>, response: Response<Incoming>) -> Self {
        Self {
            host,
            response: response.map(|body| {
                body.map_err(|error| -> BoxError { Box::new(error) })
                    .boxed()
            }),
            failed: Vec::new(),
        }
    }
}

/// Sends `outbound` to the first host of `hosts` that answers. A host that
/// cannot be reached (or does not answer in time) is reported to `on_failure`
/// and the next one is tried, as long as the body can be replayed; no byte
/// has reached the client yet, so failing over is invisible to it.
pub async fn send(
    upstream: &Upstream,
    timeout: std::time::Duration,
    hosts: &[Arc<Host>],
    outbound: Outbound,
    mut on_failure: impl FnMut(&Host, &UpstreamError),
) -> Result<Answer, ProxyError> {
    let Outbound {
        method,
        path_and_query,
        mut headers,
        body,
        ..
    } = outbound;
    let (buffered, mut streamed) = match body {
        RequestBody::Buffered(bytes) => {
            // The length is recomputed from the (possibly rewritten) body.
            headers.remove(header::CONTENT_LENGTH);
            (Some(bytes), None)
        }
        RequestBody::Streamed(body) => (None, Some(body)),
    };
    let mut failed = Vec::new();
    let mut failures = Failures::none();
    for (index, host) in hosts.iter().enumerate() {
        let body = match (&buffered, streamed.take()) {
            (Some(bytes), _) if bytes.is_empty() => body::empty(),
            (Some(bytes), _) => body::full(bytes.clone()),
            (None, Some(body)) => body,
            // A streamed body was consumed by the failed attempt.
            (None, None) => break,
        };
        // The last host's request takes the headers: none is built after it.
        let headers = if index + 1 == hosts.len() {
            std::mem::take(&mut headers)
        } else {
            headers.clone()
        };
        let request = request_for(host, &method, &path_and_query, headers, body)?;
        match upstream.send_to(host.kind, request, timeout).await {
            Ok(response) => {
                let mut answer = Answer::new(host.clone(), response);
                answer.failed = failed;
                return Ok(answer);
            }
            Err(error) => {
                tracing::warn!(host = %host.name, %error, "upstream attempt failed");
                on_failure(host, &error);
                failed.push(host.name.clone());
                failures.push(host.name.clone(), error.cause());
                // A read goes on to the next host whatever this attempt did.
                if !error.attempt().may_go(Elsewhere::Read) {
                    break;
                }
            }
        }
    }
    Err(ProxyError::AllHostsFailed(failures))
}

/// Wraps a host's response for the client: hop-by-hop headers removed,
/// `X-Failover-Host` added, the body streamed with `guard` held to its end.
pub fn respond(
    answer: Answer,
    guard: Option<Box<dyn Send + Sync>>,
    completion: Option<Completion>,
    stall: std::time::Duration,
) -> Response<Body> {
    let (mut parts, incoming) = answer.response.into_parts();
    headers::from_upstream(&mut parts.headers);
    if let Ok(name) = HeaderValue::from_str(&answer.host.name) {
        parts.headers.insert(headers::FAILOVER_HOST, name);
    }
    let framing = Framing::of(parts.headers.get(header::CONTENT_TYPE));
    let body = ResponseBody::new(
        incoming,
        framing,
        answer.host.name.clone(),
        guard,
        completion,
        stall,
    );
    Response::from_parts(parts, body.boxed())
}

/// Builds the request for one host, with `headers` (a copy for each attempt that may not be
/// the last, made by the caller).
pub fn request_for(
    host: &Host,
    method: &http::Method,
    path_and_query: &http::uri::PathAndQuery,
    headers: http::HeaderMap,
    body: Body,
) -> Result<Request<Body>, ProxyError> {
    let uri = http::Uri::builder()
        .scheme(host.scheme.clone())
        .authority(host.authority.clone())
        .path_and_query(path_and_query.clone())
        .build()
        .map_err(|_| ProxyError::hosts_failed())?;
    let mut request = Request::new(body);
    *request.method_mut() = method.clone();
    *request.uri_mut() = uri;
    *request.headers_mut() = headers;
    Ok(request)
}
/// Requests in flight upstream, each counted while its guard lives.
#[derive(Debug, Default)]
pub struct Active(Arc<AtomicU32>);

impl Active {
    /// Requests in flight now.
    pub fn count(&self) -> u32 {
        self.0.load(Ordering::Relaxed)
    }

    /// Counts one request in flight until the guard drops.
    pub fn track(&self) -> ActiveGuard {
        self.0.fetch_add(1, Ordering::Relaxed);
        ActiveGuard(self.0.clone())
    }
}

/// One request in flight upstream; released when dropped.
#[derive(Debug)]
pub struct ActiveGuard(Arc<AtomicU32>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
