//! The fake's HTTP/1.1 server: an accept loop and one task per connection, all kept in a
//! `JoinSet` so that shutting down aborts every open connection at once (a dying host). Each
//! connection has a kill switch a handler can pull to drop it mid-request, with a plain close or
//! a TCP reset (scripted failures).

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

use super::record::lock;
use super::routes;
use super::state::{ConnCtl, Shared};

/// A running server: its accept task and its connection tasks.
#[derive(Debug)]
pub(crate) struct Server {
    accept: JoinHandle<()>,
    connections: Arc<Mutex<JoinSet<()>>>,
}

/// Binds a listener with `SO_REUSEADDR`, so that a fake can restart on the port of a dead one.
pub(crate) fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

impl Server {
    /// Starts accepting on `listener`.
    pub fn spawn(listener: TcpListener, shared: Arc<Shared>) -> Self {
        let connections = Arc::new(Mutex::new(JoinSet::new()));
        let accept = tokio::spawn(accept_loop(listener, shared, Arc::clone(&connections)));
        Self {
            accept,
            connections,
        }
    }

    /// Stops accepting and aborts every connection, without waiting.
    pub fn abort(&self) {
        self.accept.abort();
        lock(&self.connections).abort_all();
    }

    /// Stops accepting and aborts every connection, and waits until the listener and every
    /// socket are closed.
    pub async fn shutdown(&mut self) {
        self.accept.abort();
        let _ = (&mut self.accept).await;
        let mut connections = std::mem::take(&mut *lock(&self.connections));
        connections.abort_all();
        while connections.join_next().await.is_some() {}
    }
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    connections: Arc<Mutex<JoinSet<()>>>,
) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            // Out of file descriptors and the like: let other tasks run, then try again.
            Err(_) => {
                tokio::task::yield_now().await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        shared
            .connections
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut connections = lock(&connections);
        while connections.try_join_next().is_some() {}
        connections.spawn(serve(stream, Arc::clone(&shared)));
    }
}

async fn serve(stream: TcpStream, shared: Arc<Shared>) {
    let ctl = Arc::new(ConnCtl::default());
    let io = TokioIo::new(ConnStream {
        inner: stream,
        ctl: Arc::clone(&ctl),
    });
    let service_ctl = Arc::clone(&ctl);
    let service = service_fn(move |request| {
        routes::handle(request, Arc::clone(&shared), Arc::clone(&service_ctl))
    });
    let connection = http1::Builder::new().serve_connection(io, service);
    // Dropping the connection future closes the socket and drops every in-flight response body,
    // which releases the slots they hold.
    tokio::select! {
        biased;
        () = ctl.killed() => {}
        _ = connection => {}
    }
}

/// The accepted socket; sends a TCP reset instead of a close when its connection asked for one.
struct ConnStream {
    inner: TcpStream,
    ctl: Arc<ConnCtl>,
}

impl Drop for ConnStream {
    fn drop(&mut self) {
        if self.ctl.wants_reset() {
            let _ = self.inner.set_zero_linger();
        }
    }
}

impl AsyncRead for ConnStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for ConnStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
