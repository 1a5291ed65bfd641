//! Telling a reused upstream connection from a fresh one when a request on it
//! fails.
//!
//! An HTTP/1 server closes a keep-alive connection it finds idle (a
//! llama-server after 5 s); a request written to it at that moment gets the
//! connection closed back with not one byte of an answer. On a connection that
//! had already served an answer, that is the server's idle close racing the
//! request: the server never read it, and sending it again on a new connection
//! is safe. On a fresh connection it is not (the server may have crashed while
//! running it), so the two must be told apart, which the pool does not say.
//!
//! [`Counting`] wraps the connector: every connection carries a [`Served`]
//! flag in its connection info, set when an answer's headers arrive on it
//! ([`mark_served`]); a failed request's error still carries that info
//! ([`was_reused`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use http::{Response, Uri};
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};

/// Whether a connection has carried an answer (shared by all its requests).
#[derive(Debug, Clone, Default)]
pub struct Served(Arc<AtomicBool>);

/// The connector of upstream connections that carry a [`Served`] flag.
#[derive(Debug, Clone)]
pub struct Counting(pub HttpConnector);

/// A connection of [`Counting`].
#[derive(Debug)]
pub struct Flagged<T> {
    inner: T,
    served: Served,
}

type Connecting<T> = Pin<Box<dyn Future<Output = Result<Flagged<T>, BoxError>> + Send>>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Stream = <HttpConnector as tower_service::Service<Uri>>::Response;

impl tower_service::Service<Uri> for Counting {
    type Response = Flagged<Stream>;
    type Error = BoxError;
    type Future = Connecting<Stream>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.0.call(uri);
        Box::pin(async move {
            let inner = connecting.await?;
            Ok(Flagged {
                inner,
                served: Served::default(),
            })
        })
    }
}

impl<T: Connection> Connection for Flagged<T> {
    fn connected(&self) -> Connected {
        self.inner.connected().extra(self.served.clone())
    }
}

impl<T: Read + Unpin> Read for Flagged<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for Flagged<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
}

/// Records that `response`'s connection has carried an answer.
pub fn mark_served<B>(response: &Response<B>) {
    if let Some(served) = response.extensions().get::<Served>() {
        served.0.store(true, Ordering::Relaxed);
    }
}

/// Whether the connection a request failed on had carried an answer before.
pub fn was_reused(error: &hyper_util::client::legacy::Error) -> bool {
    let Some(info) = error.connect_info() else {
        return false;
    };
    let mut extensions = http::Extensions::new();
    info.get_extras(&mut extensions);
    extensions
        .get::<Served>()
        .is_some_and(|served| served.0.load(Ordering::Relaxed))
}

/// Whether a request failed because its connection closed before one byte of
/// the answer came (hyper's "incomplete message").
pub fn closed_before_answer(error: &hyper_util::client::legacy::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(error);
    while let Some(current) = cause {
        if let Some(hyper) = current.downcast_ref::<hyper::Error>() {
            return hyper.is_incomplete_message();
        }
        cause = current.source();
    }
    false
}
