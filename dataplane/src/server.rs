//! Listeners: accept connections, serve HTTP/1.1 and HTTP/2 on each, and shut
//! down gracefully (stop accepting, let in-flight requests finish within the
//! drain timeout).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::app::App;
use crate::service;

/// How long a client may take to send its request headers. A slow client
/// (one byte a second) is disconnected; others are served meanwhile.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest read buffer of an HTTP/1 connection, and so the largest
/// request head. Hyper starts a connection's buffer at 8 KiB and, with any
/// larger maximum, doubles it to 16 KiB as soon as a read leaves it part
/// full (almost always): at this size it never grows, which halves what an
/// open connection costs (a queued request or an idle keep-alive). Bodies
/// are read 8 KiB at a time; request heads over 8 KiB are refused with 431.
const READ_BUFFER_BYTES: usize = 8 * 1024;

/// What a listener is for.
#[derive(Debug, Clone)]
pub enum ListenerKind {
    /// The main port: authentication by bearer key, every route.
    Main,
    /// An injection port: every request carries this client's identity.
    Injection(Arc<str>),
}

/// Serves `listener` until `shutdown` is cancelled, then waits for open
/// connections to finish, at most `drain` long.
pub async fn serve(
    listener: TcpListener,
    app: Arc<App>,
    kind: ListenerKind,
    shutdown: CancellationToken,
    drain: impl Fn() -> Duration,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(READ_BUFFER_BYTES);
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    let graceful = GracefulShutdown::new();
    loop {
        let (stream, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: back off briefly
                    // rather than spin.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let watcher = graceful.watcher();
        let builder = builder.clone();
        let app = app.clone();
        let kind = kind.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let app = app.clone();
                let kind = kind.clone();
                async move { Ok::<_, Infallible>(service::handle(app, &kind, peer, request).await) }
            });
            let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            if let Err(error) = watcher.watch(connection.into_owned()).await {
                tracing::debug!(%peer, error = %error, "connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(drain(), graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("drain timeout passed; closing remaining connections");
    }
}

/// Binds a listener, naming the address in the error.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|error| {
        std::io::Error::new(error.kind(), format!("cannot listen on {addr}: {error}"))
    })
}
