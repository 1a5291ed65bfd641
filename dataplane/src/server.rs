//! Listeners: accept connections, serve HTTP/1.1 and HTTP/2 on each, and shut
//! down gracefully (stop accepting, let in-flight requests finish within the
//! drain timeout).
//!
//! Every listener (main and injection) counts its connections against the
//! same caps ([`crate::connections`]) and closes connections that send no request in
//! time, sit idle, or stop reading ([`watch`]). On a TLS listener ([`crate::tls`]) the
//! cap's slot is taken before the handshake and the first-request deadline runs from the
//! accept, so a half handshake is an idle socket like any other; an address the
//! failed-authentication throttle refuses is closed before its handshake.

pub mod watch;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::app::App;
use crate::auth::ListenerKind;
use crate::inline::Inline;
use crate::policy::ConnectionLimits;
use crate::service;

use watch::{Activity, InFlight, StallGuarded, Tracked};

/// The largest read buffer of an HTTP/1 connection, and so the largest
/// request head. Hyper starts a connection's buffer at 8 KiB and, with any
/// larger maximum, doubles it to 16 KiB as soon as a read leaves it part
/// full (almost always): at this size it never grows, which halves what an
/// open connection costs (a queued request or an idle keep-alive). Bodies
/// are read 8 KiB at a time; request heads over 8 KiB are refused with 431.
const READ_BUFFER_BYTES: usize = 8 * 1024;

/// How often an HTTP/2 connection is pinged when the client sends nothing,
/// and how long the answer may take before the connection is closed: a
/// client that vanished does not keep its streams (and their slots).
const H2_PING_INTERVAL: Duration = Duration::from_secs(20);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// How long to back off after a failed `accept` (out of file descriptors
/// and the like), so that the loop neither spins nor stops.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Serves `listener` (over TLS with `tls`) until `shutdown` is cancelled, then waits for open
/// connections to finish, at most `drain` long.
pub async fn serve(
    listener: TcpListener,
    app: Arc<App>,
    kind: ListenerKind,
    tls: Option<TlsAcceptor>,
    shutdown: CancellationToken,
    drain: impl Fn() -> Duration,
) {
    // Every connection task holds a receiver; the drain waits for all of
    // them to be dropped.
    let (open, _) = tokio::sync::watch::channel(());
    let mut builders: Option<(ConnectionLimits, Arc<auto::Builder<TokioExecutor>>)> = None;
    loop {
        let (stream, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        let policy = app.store.load();
        let limits = policy.proxy.connections;
        // An address the failed-authentication throttle refuses gets no handshake: its
        // requests would be refused anyway, and a handshake is the costly part of a TLS
        // connection.
        if tls.is_some()
            && policy.auth.enabled
            && app
                .throttle
                .check(peer.ip(), policy.auth.max_failures, policy.auth.window)
                .is_err()
        {
            tracing::debug!(%peer, "TLS connection refused: the address is throttled");
            drop(stream);
            continue;
        }
        drop(policy);
        let slot = match app.connections.admit(peer.ip(), &limits) {
            Ok(slot) => slot,
            Err(refusal) => {
                // Closed at once, before a byte is read: a connection over a
                // cap costs nothing but the accept.
                tracing::debug!(%peer, ?refusal, "connection refused: over the connection cap");
                drop(stream);
                continue;
            }
        };
        let builder = match &builders {
            Some((built_for, builder)) if *built_for == limits => builder.clone(),
            _ => {
                let builder = Arc::new(builder(&limits));
                builders = Some((limits, builder.clone()));
                builder
            }
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let kind = kind.clone();
        let shutdown = shutdown.clone();
        let open = open.subscribe();
        let tls = tls.clone();
        // hyper wakes a connection's task from inside its own poll (the request body's and
        // the dispatcher's channels): taken inline (`crate::inline`).
        let connection = Connection {
            peer,
            certificate: None,
            kind,
        };
        // A plain connection's task is not as large as a TLS one's (the TLS session's
        // state lives in the stream): each is spawned as its own future, so that a
        // plain connection, the common case, does not carry the other's size.
        match tls {
            None => {
                let io = StallGuarded::new(stream, limits.client_stall_timeout);
                tokio::spawn(Inline::new(async move {
                    serve_connection(io, connection, app, &builder, limits, shutdown).await;
                    drop((slot, open));
                }));
            }
            Some(acceptor) => {
                tokio::spawn(Inline::new(async move {
                    serve_tls(
                        stream, acceptor, connection, app, &builder, limits, shutdown,
                    )
                    .await;
                    drop((slot, open));
                }));
            }
        }
    }
    drop(listener);
    if tokio::time::timeout(drain(), open.closed()).await.is_err() {
        tracing::warn!("drain timeout passed; closing remaining connections");
    }
}

/// The HTTP/1 and HTTP/2 settings of connections accepted under `limits`.
fn builder(limits: &ConnectionLimits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // A backstop only: the connection's own deadlines come first.
        .header_read_timeout(limits.first_request_timeout.max(limits.idle_timeout))
        .max_buf_size(READ_BUFFER_BYTES);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(H2_PING_INTERVAL)
        .keep_alive_timeout(H2_PING_TIMEOUT);
    builder
}

/// Who is at the other end of a connection, and the listener it came to.
struct Connection {
    peer: SocketAddr,
    /// The Common Name of its verified client certificate, if it presented one.
    certificate: Option<Arc<str>>,
    kind: ListenerKind,
}

/// Completes the TLS handshake of `stream`, within the first request's deadline (or
/// until shutdown), then serves the connection.
async fn serve_tls(
    stream: tokio::net::TcpStream,
    acceptor: TlsAcceptor,
    connection: Connection,
    app: Arc<App>,
    builder: &auto::Builder<TokioExecutor>,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
) {
    let peer = connection.peer;
    let handshake = tokio::time::timeout(
        limits.first_request_timeout,
        crate::tls::accept(&acceptor, stream, peer),
    );
    let stream = tokio::select! {
        () = shutdown.cancelled() => None,
        done = handshake => done.ok().flatten(),
    };
    let Some(stream) = stream else {
        tracing::debug!(%peer, "closing a TLS connection with no handshake in time");
        return;
    };
    let connection = Connection {
        certificate: crate::tls::peer_common_name(&stream),
        ..connection
    };
    let io = StallGuarded::new(stream, limits.client_stall_timeout);
    serve_connection(io, connection, app, builder, limits, shutdown).await;
}

/// Serves one connection until it ends, its deadline passes with no
/// request in flight, or shutdown (then gracefully).
async fn serve_connection<S>(
    io: StallGuarded<S>,
    connection: Connection,
    app: Arc<App>,
    builder: &auto::Builder<TokioExecutor>,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Connection {
        peer,
        certificate,
        kind,
    } = connection;
    let activity = Activity::new();
    let tracker = activity.clone();
    let service = service_fn(move |mut request: http::Request<hyper::body::Incoming>| {
        if let Some(name) = &certificate {
            request
                .extensions_mut()
                .insert(crate::auth::PeerCertificate(name.clone()));
        }
        let app = app.clone();
        let kind = kind.clone();
        let in_flight = InFlight::start(&tracker);
        // An HTTP/2 stream can stall while its socket flows: its body is
        // watched instead (see `Tracked`).
        let stall =
            (request.version() == http::Version::HTTP_2).then_some(limits.client_stall_timeout);
        async move {
            let response = service::handle(app, &kind, peer, request).await;
            Ok::<_, Infallible>(response.map(|body| Tracked::new(body, in_flight, stall)))
        }
    });
    let io = TokioIo::new(io);
    let connection = builder.serve_connection_with_upgrades(io, service);
    tokio::pin!(connection);
    // Nothing tells this loop when a request starts or ends: it looks at the connection's
    // deadline when its timer fires, and never sleeps longer than `idle_timeout`, the
    // soonest a request that has not yet ended could make the connection due. So a
    // connection is closed when its deadline passes, and a busy one is looked at once per
    // `idle_timeout`.
    let timer = tokio::time::sleep(limits.first_request_timeout.min(limits.idle_timeout));
    tokio::pin!(timer);
    let mut draining = false;
    loop {
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%peer, %error, "connection ended with an error");
                }
                return;
            }
            () = shutdown.cancelled(), if !draining => {
                draining = true;
                connection.as_mut().graceful_shutdown();
            }
            () = &mut timer => {
                let now = tokio::time::Instant::now();
                let soonest = now + limits.idle_timeout;
                match activity.deadline(&limits) {
                    Some(deadline) if deadline <= now => {
                        tracing::debug!(%peer, "closing a connection with no request in time");
                        return;
                    }
                    Some(deadline) => timer.as_mut().reset(deadline.min(soonest)),
                    None => timer.as_mut().reset(soonest),
                }
            }
        }
    }
}

/// Binds a listener, naming the address in the error.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|error| {
        std::io::Error::new(error.kind(), format!("cannot listen on {addr}: {error}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of a plain connection's future (a test build's): every open connection,
    /// an idle keep-alive or one whose request waits in the queue, holds one. It was
    /// 7,424 bytes while one future served both kinds (a TLS session's state is most of it).
    const PLAIN_CONNECTION_BYTES: usize = 2208;

    /// The size of the future `call` returns, without making one.
    fn future_size<A, F: std::future::Future>(_call: impl FnOnce(A) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    #[test]
    fn a_plain_connection_does_not_carry_a_tls_connections_size() {
        type Plain = (
            StallGuarded<tokio::net::TcpStream>,
            Connection,
            Arc<App>,
            &'static auto::Builder<TokioExecutor>,
            ConnectionLimits,
            CancellationToken,
        );
        type Tls = (
            tokio::net::TcpStream,
            TlsAcceptor,
            Connection,
            Arc<App>,
            &'static auto::Builder<TokioExecutor>,
            ConnectionLimits,
            CancellationToken,
        );
        let plain = future_size(|(io, connection, app, builder, limits, shutdown): Plain| {
            serve_connection(io, connection, app, builder, limits, shutdown)
        });
        let tls = future_size(
            |(stream, acceptor, connection, app, builder, limits, shutdown): Tls| {
                serve_tls(stream, acceptor, connection, app, builder, limits, shutdown)
            },
        );
        eprintln!("connection futures: plain {plain} bytes, TLS {tls} bytes");
        assert!(plain < tls, "plain {plain}, TLS {tls}");
        assert!(plain <= PLAIN_CONNECTION_BYTES, "plain {plain}");
    }
}
