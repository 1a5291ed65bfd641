//! A streamed body bound to its hop (see [`super`]): the edge [`seal`]s it as
//! it sends it, ending it with the trailer [`BODY_TRAILER`]; the owner
//! [`check`]s it as it passes it on to Ollama, holding back the last frame it
//! has until the trailer has verified, so that a body that does not verify
//! never reaches Ollama whole.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use http_body::Frame;
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};

use super::{BODY_TRAILER, HopError, HopKey};
use crate::body::{Body, BoxError};

/// `body`, hashed as it passes and ended with the trailer that binds it to the hop
/// whose header is `header` (always, an empty body too). The request must be sent
/// chunked with `Trailer: x-oqp-hop-body`, or hyper drops the trailer. Trailers the
/// client sent are not passed on.
pub fn seal(body: Body, key: HopKey, header: HeaderValue) -> Body {
    Sealed {
        inner: body,
        hasher: Sha256::new(),
        key,
        header,
        done: false,
    }
    .boxed()
}

/// `body` as the owner passes it on: it fails instead of yielding its last data frame
/// unless the trailer [`BODY_TRAILER`] verifies for the hop whose header is `header` and
/// the bytes received, and as soon as more than `length` (the signed length) have come.
/// The [`Verdict`] tells why, when it failed so.
pub fn check(body: Body, key: HopKey, header: HeaderValue, length: Option<u64>) -> (Body, Verdict) {
    let verdict = Verdict::default();
    let checked = Checked {
        inner: body,
        hasher: Sha256::new(),
        key,
        header,
        length,
        received: 0,
        held: None,
        done: false,
        verdict: verdict.clone(),
    };
    (checked.boxed(), verdict)
}

/// Why a [`check`]ed body failed, once it has.
#[derive(Debug, Clone, Default)]
pub struct Verdict(Arc<OnceLock<HopError>>);

impl Verdict {
    /// The reason the body was refused, if it was.
    pub fn refused(&self) -> Option<&HopError> {
        self.0.get()
    }
}

struct Sealed {
    inner: Body,
    hasher: Sha256,
    key: HopKey,
    header: HeaderValue,
    done: bool,
}

impl std::fmt::Debug for Sealed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealed")
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl http_body::Body for Sealed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        this.hasher.update(data);
                        return Poll::Ready(Some(Ok(frame)));
                    }
                }
                Some(Err(error)) => return Poll::Ready(Some(Err(error))),
                None => {
                    this.done = true;
                    let digest: [u8; 32] = std::mem::take(&mut this.hasher).finalize().into();
                    let mut trailers = HeaderMap::new();
                    trailers.insert(BODY_TRAILER, this.key.seal_body(&this.header, &digest));
                    return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                }
            }
        }
    }

    // Not before the trailer is out: hyper stops polling a body that says it has ended.
    fn is_end_stream(&self) -> bool {
        self.done
    }
}

struct Checked {
    inner: Body,
    hasher: Sha256,
    key: HopKey,
    header: HeaderValue,
    length: Option<u64>,
    received: u64,
    /// The last data frame received, passed on only after the next one (or the trailer).
    held: Option<Bytes>,
    done: bool,
    verdict: Verdict,
}

impl std::fmt::Debug for Checked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checked")
            .field("length", &self.length)
            .field("received", &self.received)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl Checked {
    fn refuse(&mut self, error: HopError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.held = None;
        self.done = true;
        let _ = self.verdict.0.set(error.clone());
        Poll::Ready(Some(Err(Box::new(error))))
    }

    fn verify(&mut self, trailers: &HeaderMap) -> Result<(), HopError> {
        let seal = trailers.get(BODY_TRAILER).ok_or(HopError::NoTrailer)?;
        if self.length.is_some_and(|length| length != self.received) {
            return Err(HopError::BodyMismatch);
        }
        let digest: [u8; 32] = std::mem::take(&mut self.hasher).finalize().into();
        self.key.check_body(&self.header, &digest, seal)
    }
}

impl http_body::Body for Checked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            if this.done {
                return Poll::Ready(this.held.take().map(|data| Ok(Frame::data(data))));
            }
            let frame = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => frame,
                Some(Err(error)) => return Poll::Ready(Some(Err(error))),
                None => return this.refuse(HopError::NoTrailer),
            };
            match frame.into_data() {
                Ok(data) => {
                    this.received = this.received.saturating_add(data.len() as u64);
                    if this.length.is_some_and(|length| this.received > length) {
                        return this.refuse(HopError::BodyMismatch);
                    }
                    this.hasher.update(&data);
                    if data.is_empty() {
                        continue;
                    }
                    if let Some(previous) = this.held.replace(data) {
                        return Poll::Ready(Some(Ok(Frame::data(previous))));
                    }
                }
                Err(frame) => {
                    let Ok(trailers) = frame.into_trailers() else {
                        continue;
                    };
                    match this.verify(&trailers) {
                        Ok(()) => this.done = true,
                        Err(error) => return this.refuse(error),
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.held.is_none()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::SystemTime;

    use http::Method;
    use http_body_util::StreamBody;

    use super::*;
    use crate::hop::{Assertion, Body as Binding, Request};
    use crate::scheduler::Tier;

    fn key() -> HopKey {
        HopKey::new("token").unwrap()
    }

    fn header(length: Option<u64>) -> HeaderValue {
        let assertion = Assertion {
            node: Arc::from("edge"),
            client: Arc::from("client"),
            verified: true,
            tier: Tier::Normal,
            body: Binding::Trailer(length),
            group: None,
        };
        let request = Request {
            to: "owner",
            id: "r1",
            method: &Method::POST,
            path: "/api/blobs/sha256:00",
        };
        key().sign(&assertion, request, SystemTime::now())
    }

    /// A body of these frames, as hyper would deliver them.
    fn frames(frames: Vec<Frame<Bytes>>) -> Body {
        let stream = futures_util::stream::iter(frames.into_iter().map(Ok::<_, BoxError>));
        StreamBody::new(stream).boxed()
    }

    fn chunks(parts: &[&'static str]) -> Vec<Frame<Bytes>> {
        parts
            .iter()
            .map(|part| Frame::data(Bytes::from_static(part.as_bytes())))
            .collect()
    }

    /// The frames `body` yields, in order: data as text, a trailer as `[trailer]`, a
    /// failure as `[error: …]` (the last).
    async fn drain(mut body: Body) -> Vec<String> {
        let mut seen = Vec::new();
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => match frame.into_data() {
                    Ok(data) => seen.push(String::from_utf8(data.to_vec()).unwrap()),
                    Err(_) => seen.push("[trailer]".to_owned()),
                },
                Err(error) => {
                    seen.push(format!("[error: {error}]"));
                    break;
                }
            }
        }
        seen
    }

    /// What `seal` sends for `parts`: the data frames, then the trailer.
    async fn sealed(header: &HeaderValue, parts: &[&'static str]) -> Vec<Frame<Bytes>> {
        let mut body = seal(frames(chunks(parts)), key(), header.clone());
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            out.push(frame.unwrap());
        }
        out
    }

    #[tokio::test]
    async fn a_sealed_body_passes_whole_and_its_last_frame_waits_for_the_trailer() {
        let header = header(Some(10));
        let sent = sealed(&header, &["hello", "world"]).await;
        assert_eq!(sent.len(), 3);
        assert!(sent[2].trailers_ref().unwrap().contains_key(BODY_TRAILER));
        let (body, verdict) = check(frames(sent), key(), header, Some(10));
        assert_eq!(drain(body).await, ["hello", "world"]);
        assert!(verdict.refused().is_none());

        // Without a declared length, the digest alone binds it.
        let header = self::header(None);
        let sent = sealed(&header, &["hello", "world", "!"]).await;
        let (body, verdict) = check(frames(sent), key(), header, None);
        assert_eq!(drain(body).await, ["hello", "world", "!"]);
        assert!(verdict.refused().is_none());

        // Even an empty body carries its trailer, and checks.
        let header = self::header(Some(0));
        let sent = sealed(&header, &[]).await;
        assert_eq!(sent.len(), 1);
        let (body, verdict) = check(frames(sent), key(), header, Some(0));
        assert!(drain(body).await.is_empty());
        assert!(verdict.refused().is_none());
    }

    #[tokio::test]
    async fn a_body_that_does_not_verify_never_yields_its_last_frame() {
        let header = header(Some(10));
        let sent = sealed(&header, &["hello", "world"]).await;
        let trailer = sent[2].trailers_ref().unwrap().clone();
        let refused = |parts: Vec<Frame<Bytes>>, length, error: HopError| {
            let header = header.clone();
            async move {
                let (body, verdict) = check(frames(parts), key(), header, length);
                let seen = drain(body).await;
                assert_eq!(verdict.refused(), Some(&error), "{seen:?}");
                seen
            }
        };
        let with_trailer = |parts: &[&'static str], trailer: HeaderMap| {
            let mut parts = chunks(parts);
            parts.push(Frame::trailers(trailer));
            parts
        };
        // A changed byte: "world" never passes.
        let seen = refused(
            with_trailer(&["hello", "worle"], trailer.clone()),
            Some(10),
            HopError::BodyMismatch,
        )
        .await;
        assert_eq!(seen, ["hello", "[error: the body is not the one signed]"]);
        // No trailer at all, or one without the field.
        let seen = refused(chunks(&["hello", "world"]), Some(10), HopError::NoTrailer).await;
        assert_eq!(seen, ["hello", "[error: the streamed body has no trailer]"]);
        refused(
            with_trailer(&["hello", "world"], HeaderMap::new()),
            Some(10),
            HopError::NoTrailer,
        )
        .await;
        // Cut short, or lengthened past the signed length (refused before the extra
        // bytes pass).
        refused(
            with_trailer(&["hello"], trailer.clone()),
            Some(10),
            HopError::BodyMismatch,
        )
        .await;
        let seen = refused(
            with_trailer(&["hello", "world", "!"], trailer.clone()),
            Some(10),
            HopError::BodyMismatch,
        )
        .await;
        assert_eq!(
            seen.last().unwrap(),
            "[error: the body is not the one signed]"
        );
        assert!(!seen.contains(&"!".to_owned()));
        // Another hop's trailer, for the very same bytes.
        let other = self::header(Some(10));
        let theirs = sealed(&other, &["hello", "world"]).await[2]
            .trailers_ref()
            .unwrap()
            .clone();
        refused(
            with_trailer(&["hello", "world"], theirs),
            Some(10),
            HopError::BodyMismatch,
        )
        .await;
    }

    #[tokio::test]
    async fn hyper_carries_the_trailer_of_a_chunked_request_over_a_socket() {
        use hyper_util::rt::TokioIo;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let header = header(Some(10));
        let owner_header = header.clone();
        let server = tokio::spawn(async move {
            let (socket, _) = listener.accept().await.unwrap();
            let (sender, receiver) = tokio::sync::oneshot::channel();
            let sender = std::sync::Mutex::new(Some(sender));
            let service =
                hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    let header = owner_header.clone();
                    let sender = sender.lock().unwrap().take();
                    async move {
                        let (parts, incoming) = request.into_parts();
                        let body = incoming
                            .map_err(|error| -> BoxError { Box::new(error) })
                            .boxed();
                        let (body, verdict) = check(body, key(), header, Some(10));
                        let seen = drain(body).await;
                        if let Some(sender) = sender {
                            let _ = sender.send((parts.headers, seen, verdict.refused().cloned()));
                        }
                        Ok::<_, std::convert::Infallible>(http::Response::new(crate::body::empty()))
                    }
                });
            hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(socket), service)
                .await
                .unwrap();
            receiver.await.unwrap()
        });
        let socket = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(socket))
            .await
            .unwrap();
        tokio::spawn(connection);
        let body = seal(frames(chunks(&["hello", "world"])), key(), header);
        let request = http::Request::post("/api/blobs/sha256:00")
            .header(http::header::TRANSFER_ENCODING, "chunked")
            .header(http::header::TRAILER, BODY_TRAILER.as_str())
            .body(body)
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        assert_eq!(response.status(), 200);
        drop(sender);
        let (headers, seen, refused) = server.await.unwrap();
        assert_eq!(
            headers.get(http::header::TRANSFER_ENCODING).unwrap(),
            "chunked"
        );
        assert_eq!(seen, ["hello", "world"]);
        assert_eq!(refused, None);
    }
}
