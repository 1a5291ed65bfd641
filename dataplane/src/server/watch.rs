//! What one client connection is doing, and the deadlines that follow from
//! it: a first request within `first_request_timeout` of the accept
//! (protocol detection and the first head included, HTTP/1 and HTTP/2
//! alike), then never longer than `idle_timeout` with no request in flight
//! (HTTP/1 between keep-alive requests, HTTP/2 with no open stream).
//!
//! A request is in flight from its complete head until hyper drops its
//! response body, so a long stream keeps its connection open. Writes that
//! make no progress for `client_stall_timeout` (a client that stopped
//! reading) fail the connection, which drops the response body and with it
//! the host slot. On HTTP/2, where a client stalls a stream by opening no
//! window while the socket flows, a response body that hyper has not polled
//! for `client_stall_timeout` while it had more to send is given up instead
//! (that stream only).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::task::AbortHandle;
use tokio::time::{Instant, Sleep};

use crate::policy::ConnectionLimits;

/// The requests of one connection.
#[derive(Debug)]
pub struct Activity {
    opened: Instant,
    in_flight: AtomicU32,
    seen: AtomicBool,
    /// When the last request ended, in nanoseconds after `opened`.
    idle_since: AtomicU64,
}

/// One request in flight on its connection; dropping it ends the request.
#[derive(Debug)]
pub struct InFlight(Arc<Activity>);

impl Activity {
    /// A connection accepted now.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            opened: Instant::now(),
            in_flight: AtomicU32::new(0),
            seen: AtomicBool::new(false),
            idle_since: AtomicU64::new(0),
        })
    }

    /// When the connection is to be closed unless a request arrives; `None`
    /// while a request is in flight.
    pub fn deadline(&self, limits: &ConnectionLimits) -> Option<Instant> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        if !self.seen.load(Ordering::Acquire) {
            return Some(self.opened + limits.first_request_timeout);
        }
        let idle_since = Duration::from_nanos(self.idle_since.load(Ordering::Acquire));
        Some(self.opened + idle_since + limits.idle_timeout)
    }
}

impl InFlight {
    /// A request whose head has arrived on `activity`'s connection.
    pub fn start(activity: &Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::AcqRel);
        activity.seen.store(true, Ordering::Release);
        Self(activity.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let activity = &self.0;
        let since = u64::try_from(activity.opened.elapsed().as_nanos()).unwrap_or(u64::MAX);
        activity.idle_since.store(since, Ordering::Release);
        activity.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request in flight until hyper drops it.
///
/// On HTTP/2 it is watched too: hyper polls a body only when the stream has
/// window for what it was last handed, so a client that opens no window
/// leaves the body unpolled while the socket never blocks (and
/// [`StallGuarded`] never arms). Once hyper has owed the body a poll for the
/// stall timeout (since the head, or since the last frame it took), the body
/// is given up: the inner body (and with it the upstream and the host slot)
/// and the request's place in flight are dropped, and a later poll fails,
/// which resets the stream. The stream itself stays open until the client
/// opens its window or the connection closes (at `idle_timeout` with no
/// other request in flight).
#[derive(Debug)]
pub struct Tracked<B> {
    exchange: Arc<Mutex<Exchange<B>>>,
    watchdog: Option<AbortHandle>,
}

/// The part of a [`Tracked`] body its watchdog may give up.
#[derive(Debug)]
struct Exchange<B> {
    /// `None` once given up.
    body: Option<B>,
    in_flight: Option<InFlight>,
    /// Since when hyper owes the body a poll; `None` while the body waits
    /// for its upstream (the upstream stall timeout's business) or is done.
    owed_since: Option<Instant>,
}

/// The client took nothing on its HTTP/2 stream for the stall timeout.
#[derive(Debug, thiserror::Error)]
#[error("the client accepted no response bytes on this stream within the stall timeout")]
pub struct ClientStalled;

impl<B: Send + 'static> Tracked<B> {
    /// `inner`, holding `in_flight`; given up once hyper polls it for none
    /// of `stall` while it has more to send (`None`: never, as on HTTP/1,
    /// whose socket writes [`StallGuarded`] watches).
    pub fn new(inner: B, in_flight: InFlight, stall: Option<Duration>) -> Self
    where
        B: http_body::Body,
    {
        let owed_since = (!inner.is_end_stream()).then(Instant::now);
        let exchange = Arc::new(Mutex::new(Exchange {
            body: Some(inner),
            in_flight: Some(in_flight),
            owed_since,
        }));
        let watchdog = stall.map(|stall| {
            tokio::spawn(watch_stream(Arc::downgrade(&exchange), stall)).abort_handle()
        });
        Self { exchange, watchdog }
    }
}

impl<B> Drop for Tracked<B> {
    fn drop(&mut self) {
        if let Some(watchdog) = &self.watchdog {
            watchdog.abort();
        }
    }
}

fn lock<B>(exchange: &Mutex<Exchange<B>>) -> MutexGuard<'_, Exchange<B>> {
    exchange.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Gives the exchange up once hyper has owed it a poll for `stall`. Holds
/// it weakly, so that the body drops with its [`Tracked`] (which also
/// aborts this task).
async fn watch_stream<B>(exchange: Weak<Mutex<Exchange<B>>>, stall: Duration) {
    loop {
        let deadline = {
            let Some(exchange) = exchange.upgrade() else {
                return;
            };
            let mut guard = lock(&exchange);
            let now = Instant::now();
            match guard.owed_since {
                Some(since) if since + stall <= now => {
                    let body = guard.body.take();
                    let in_flight = guard.in_flight.take();
                    guard.owed_since = None;
                    drop(guard);
                    tracing::debug!(
                        "giving up an HTTP/2 response whose client took nothing for the stall timeout"
                    );
                    // The body first: its slot is released before the
                    // connection counts the request as ended.
                    drop(body);
                    drop(in_flight);
                    return;
                }
                Some(since) => since + stall,
                None => now + stall,
            }
        };
        tokio::time::sleep_until(deadline).await;
    }
}

impl<B> http_body::Body for Tracked<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: From<ClientStalled>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut guard = lock(&self.exchange);
        let exchange = &mut *guard;
        let Some(body) = exchange.body.as_mut() else {
            return Poll::Ready(Some(Err(ClientStalled.into())));
        };
        let polled = Pin::new(&mut *body).poll_frame(cx);
        let more = matches!(polled, Poll::Ready(Some(Ok(_)))) && !body.is_end_stream();
        exchange.owed_since = more.then(Instant::now);
        polled
    }

    fn is_end_stream(&self) -> bool {
        lock(&self.exchange)
            .body
            .as_ref()
            .is_some_and(http_body::Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        lock(&self.exchange)
            .body
            .as_ref()
            .map_or_else(SizeHint::default, http_body::Body::size_hint)
    }
}

/// A client socket whose writes fail once they make no progress for the
/// stall timeout.
#[derive(Debug)]
pub struct StallGuarded<T> {
    io: T,
    timeout: Duration,
    /// Armed while a write is blocked.
    blocked: Option<Pin<Box<Sleep>>>,
}

impl<T> StallGuarded<T> {
    /// `io`, whose blocked writes fail after `timeout`.
    pub fn new(io: T, timeout: Duration) -> Self {
        Self {
            io,
            timeout,
            blocked: None,
        }
    }

    fn track<R>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if poll.is_ready() {
            self.blocked = None;
            return poll;
        }
        let timeout = self.timeout;
        let blocked = self
            .blocked
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        ready!(blocked.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the client accepted no response bytes within the stall timeout",
        )))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StallGuarded<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallGuarded<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.io).poll_write(cx, buf);
        this.track(cx, poll)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.track(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.io).poll_flush(cx);
        // A finished flush says nothing about a write still blocked (a
        // socket's flush is always ready): only a blocked flush is tracked.
        if poll.is_pending() {
            this.track(cx, poll)
        } else {
            poll
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use http_body::Body as _;
    use tokio::sync::mpsc;

    use super::*;
    use crate::body::BoxError;

    /// A body fed by a channel, whose sender sees it dropped.
    struct Fed(mpsc::Receiver<Bytes>);

    impl http_body::Body for Fed {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            self.0
                .poll_recv(cx)
                .map(|bytes| bytes.map(|bytes| Ok(Frame::data(bytes))))
        }
    }

    fn poll_once(body: &mut Tracked<Fed>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        Pin::new(body).poll_frame(&mut cx)
    }

    fn watched(activity: &Arc<Activity>) -> (mpsc::Sender<Bytes>, Tracked<Fed>) {
        let (sender, receiver) = mpsc::channel(1);
        let body = Tracked::new(
            Fed(receiver),
            InFlight::start(activity),
            Some(Duration::from_millis(50)),
        );
        (sender, body)
    }

    #[tokio::test]
    async fn an_http2_body_is_given_up_only_while_hyper_owes_it_a_poll() {
        const PATIENCE: Duration = Duration::from_secs(10);
        let activity = Activity::new();
        // Waiting for its upstream: not the client's stall.
        let (upstream, mut waiting) = watched(&activity);
        assert!(poll_once(&mut waiting).is_pending());
        // Handed a frame, then never polled again.
        let (owed_upstream, mut owed) = watched(&activity);
        owed_upstream.send(Bytes::from_static(b"x")).await.unwrap();
        assert!(matches!(poll_once(&mut owed), Poll::Ready(Some(Ok(_)))));
        tokio::time::timeout(PATIENCE, owed_upstream.closed())
            .await
            .expect("a body owed a poll was never given up");
        // Never polled at all (a stream window of 0 from the start).
        let (never_upstream, _never) = watched(&activity);
        tokio::time::timeout(PATIENCE, never_upstream.closed())
            .await
            .expect("a body never polled was never given up");
        // By now `waiting` has waited more than twice the stall timeout.
        assert!(
            !upstream.is_closed(),
            "a body waiting upstream was given up"
        );
        assert!(matches!(poll_once(&mut owed), Poll::Ready(Some(Err(_)))));
        upstream.send(Bytes::from_static(b"y")).await.unwrap();
        assert!(matches!(poll_once(&mut waiting), Poll::Ready(Some(Ok(_)))));
        // The bodies given up no longer count as in flight.
        assert_eq!(activity.deadline(&limits()), None);
        drop(waiting);
        assert!(activity.deadline(&limits()).is_some());
    }

    fn limits() -> ConnectionLimits {
        ConnectionLimits {
            max_connections: 10,
            max_per_ip: 10,
            first_request_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            client_stall_timeout: Duration::from_secs(1),
        }
    }

    #[tokio::test]
    async fn first_request_then_idle_deadlines() {
        let activity = Activity::new();
        let opened = activity.opened;
        assert_eq!(
            activity.deadline(&limits()),
            Some(opened + Duration::from_secs(5))
        );
        let request = InFlight::start(&activity);
        assert_eq!(activity.deadline(&limits()), None, "none while in flight");
        drop(request);
        let ended = Instant::now();
        let deadline = activity.deadline(&limits()).unwrap();
        assert!(deadline <= ended + Duration::from_secs(60));
        assert!(
            deadline > ended + Duration::from_secs(59),
            "idle from the end"
        );
    }
}
