//! The gRPC port's connections, under the same limits as the data plane's listeners.
//!
//! Connections are counted in all and per address (`proxy.max_connections`,
//! `max_connections_per_ip`, with the data plane's [`Connections`]); one over a cap is
//! closed as soon as it is accepted, and accepting never stops (a failed `accept`, out of
//! file descriptors, backs off briefly). A connection's first bytes must arrive within
//! `proxy.first_request_timeout`, and then something within every `proxy.idle_timeout`:
//! the server sends HTTP/2 pings well within it (a live peer's acknowledgements count), so
//! a data plane holding its policy stream or an oqpctl waiting on a drain is never cut,
//! while a socket that says nothing, or a peer that stops answering pings, is closed. A
//! peer that completed the HTTP/2 handshake and then went silent is closed within
//! `first_request_timeout`, as on the data plane's listeners (where a connection that opens
//! no stream is closed at that deadline): bytes, not streams, are seen here, so the pings'
//! interval and the time to answer one are each at most half of it. The limits are read
//! from the config in force at each accept.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::Stream;
use oqp_dataplane::connections::{Connections, Slot};
use oqp_dataplane::policy::ConnectionLimits;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::config::Config;
use crate::hub::Hub;

/// How long to back off after a failed `accept`, so that the loop neither spins nor stops.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// The HTTP/2 ping interval (and time to answer one) under `limits`: a third of
/// `idle_timeout`, so that a live peer always has answered one within the idle deadline
/// (`idle_deadline`), and at most half of `first_request_timeout`, so that a peer that
/// answers none is closed within it (a ping sent after one interval of silence, the
/// connection closed when it goes one more unanswered); between 100 ms and 20 s.
pub fn ping_interval(limits: &ConnectionLimits) -> Duration {
    (limits.idle_timeout / 3)
        .min(limits.first_request_timeout / 2)
        .clamp(Duration::from_millis(100), Duration::from_secs(20))
}

/// How long a connection may send nothing: `idle_timeout`, and never under three ping
/// intervals.
fn idle_deadline(limits: &ConnectionLimits) -> Duration {
    limits.idle_timeout.max(3 * ping_interval(limits))
}

/// The connection limits of `config`, as the data plane applies them.
pub fn limits(config: &Config) -> ConnectionLimits {
    let proxy = &config.proxy;
    ConnectionLimits {
        max_connections: proxy.max_connections,
        max_per_ip: proxy.max_connections_per_ip,
        first_request_timeout: proxy.first_request_timeout,
        idle_timeout: proxy.idle_timeout,
        client_stall_timeout: proxy.client_stall_timeout,
    }
}

/// The connections accepted on `listener` and admitted under the limits of `hub`'s config.
pub fn accept(
    listener: TcpListener,
    hub: Arc<Hub>,
) -> impl Stream<Item = io::Result<Limited>> + Send + 'static {
    let connections = Arc::new(Connections::default());
    futures_util::stream::unfold(
        (listener, hub, connections),
        |(listener, hub, connections)| async move {
            let limited = loop {
                let (stream, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::warn!(%error, "gRPC accept failed");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                        continue;
                    }
                };
                let limits = limits(&hub.config());
                match connections.admit(peer.ip(), &limits) {
                    Ok(slot) => break Limited::new(stream, peer, slot, &limits),
                    Err(refusal) => {
                        tracing::debug!(%peer, ?refusal, "gRPC connection refused: over the connection cap");
                        drop(stream);
                    }
                }
            };
            Some((Ok(limited), (listener, hub, connections)))
        },
    )
}

/// An admitted connection: counted until dropped, closed when nothing arrives in time.
#[derive(Debug)]
pub struct Limited {
    stream: TcpStream,
    info: TcpConnectInfo,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    _slot: Slot,
}

impl Limited {
    fn new(stream: TcpStream, peer: SocketAddr, slot: Slot, limits: &ConnectionLimits) -> Self {
        // Snapshots are small writes that must leave at once: without TCP_NODELAY,
        // Nagle's algorithm and delayed ACKs hold a revocation back by tens of ms.
        let _ = stream.set_nodelay(true);
        let info = TcpConnectInfo {
            local_addr: stream.local_addr().ok(),
            remote_addr: Some(peer),
        };
        Self {
            stream,
            info,
            idle: idle_deadline(limits),
            deadline: Box::pin(tokio::time::sleep(limits.first_request_timeout)),
            _slot: slot,
        }
    }
}

impl Connected for Limited {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

impl AsyncRead for Limited {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.deadline.as_mut().reset(Instant::now() + this.idle);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "nothing received within the connection's deadline",
                ))),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl AsyncWrite for Limited {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(first_request_timeout: f64, idle_timeout: f64) -> ConnectionLimits {
        ConnectionLimits {
            max_connections: 1,
            max_per_ip: 1,
            first_request_timeout: Duration::from_secs_f64(first_request_timeout),
            idle_timeout: Duration::from_secs_f64(idle_timeout),
            client_stall_timeout: Duration::from_secs(60),
        }
    }

    #[test]
    fn a_peer_answering_no_ping_is_closed_within_the_first_request_deadline() {
        // The defaults: pinged after 5 s of silence, closed 5 s later, at 10 s as a data
        // plane connection that opens no stream (40 s before: 20 s and 20 s).
        let defaults = limits(10.0, 60.0);
        assert_eq!(ping_interval(&defaults), Duration::from_secs(5));
        assert_eq!(idle_deadline(&defaults), Duration::from_secs(60));
        for (first, idle) in [
            (10.0, 60.0),
            (30.0, 60.0),
            (0.3, 0.6),
            (10.0, 0.3),
            (900.0, 3600.0),
        ] {
            let limits = limits(first, idle);
            let ping = ping_interval(&limits);
            assert!(ping >= Duration::from_millis(100) && ping <= Duration::from_secs(20));
            assert!(
                2 * ping <= limits.first_request_timeout.max(Duration::from_millis(200)),
                "{first} s / {idle} s: pinged every {ping:?}"
            );
            assert!(3 * ping <= idle_deadline(&limits));
        }
    }
}
