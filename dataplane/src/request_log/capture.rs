//! Body capture (`auth.keys[].capture: {max_bytes}`): the first `max_bytes` of a request's
//! body and of its answer, written into the request's log line as text.
//!
//! Only bodies are captured, never a header: the key, a user's token and every other
//! credential travel in headers and stay out of the log. The request's body is the one sent
//! to the host (already read whole); the answer is copied as it streams back by a bounded
//! [`Tap`] that sits inside the response body the completion hook watches, so the copy is
//! complete when the hook reads it, and the stream is never held back or buffered beyond
//! the limit.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use serde::Serialize;

use crate::body::{Body, BoxError};

/// The most a capture keeps of either side, whatever a snapshot says.
pub const MAX_BYTES: usize = 1024 * 1024;

/// The captured bodies of one request, as its log line shows them.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Capture {
    /// The request's body as sent to the host, cut at the limit; absent for a body that
    /// was streamed through rather than read whole.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// Whether the request's body went on past the limit.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub prompt_truncated: bool,
    /// The answer's body as the host streamed it, cut at the limit; absent for a request
    /// that was not answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// Whether the answer went on past the limit.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub answer_truncated: bool,
}

impl Capture {
    /// The capture of a request whose body is `body` (`None` when streamed), kept to `limit`
    /// bytes.
    pub fn of_request(body: Option<&Bytes>, limit: usize) -> Self {
        let mut capture = Self::default();
        if let Some(body) = body {
            let (prompt, truncated) = text(body, limit);
            capture.prompt = Some(prompt);
            capture.prompt_truncated = truncated;
        }
        capture
    }

    /// Adds what `tapped` copied of the answer.
    pub fn with_answer(mut self, tapped: &Tapped) -> Self {
        let copied = tapped.0.lock().map(|copied| copied.clone()).ok();
        if let Some(copied) = copied {
            let (answer, _) = text(&copied.bytes, copied.limit);
            self.answer = Some(answer);
            self.answer_truncated = copied.truncated;
        }
        self
    }
}

/// The first `limit` bytes of `bytes` as text, and whether anything was cut. A character
/// cut in two at the limit is left out; bytes that are not UTF-8 become U+FFFD.
pub fn text(bytes: &[u8], limit: usize) -> (String, bool) {
    let limit = limit.min(MAX_BYTES);
    let truncated = bytes.len() > limit;
    let mut kept = &bytes[..bytes.len().min(limit)];
    if truncated && let Err(error) = std::str::from_utf8(kept) {
        // An incomplete sequence at the very end is the cut, not bad input.
        if error.error_len().is_none() {
            kept = &kept[..error.valid_up_to()];
        }
    }
    (String::from_utf8_lossy(kept).into_owned(), truncated)
}

/// What a [`Tap`] has copied of an answer so far, shared with the hook that logs it.
#[derive(Debug, Clone, Default)]
pub struct Tapped(Arc<Mutex<Copied>>);

#[derive(Debug, Clone, Default)]
struct Copied {
    bytes: Vec<u8>,
    limit: usize,
    truncated: bool,
}

/// A response body that passes every frame through as it comes and copies the data of the
/// first `limit` bytes aside.
pub struct Tap {
    inner: Body,
    copied: Tapped,
}

impl std::fmt::Debug for Tap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tap").finish_non_exhaustive()
    }
}

impl Tap {
    /// Wraps `inner`, copying up to `limit` bytes (at most [`MAX_BYTES`]) into the returned
    /// [`Tapped`].
    pub fn new(inner: Body, limit: usize) -> (Self, Tapped) {
        let copied = Tapped(Arc::new(Mutex::new(Copied {
            bytes: Vec::new(),
            limit: limit.min(MAX_BYTES),
            truncated: false,
        })));
        (
            Self {
                inner,
                copied: copied.clone(),
            },
            copied,
        )
    }

    fn copy(&self, data: &[u8]) {
        // Never contended while frames flow: the hook reads it only after the last one.
        let Ok(mut copied) = self.copied.0.lock() else {
            return;
        };
        let room = copied.limit.saturating_sub(copied.bytes.len());
        if data.len() > room {
            copied.truncated = true;
        }
        copied
            .bytes
            .extend_from_slice(&data[..data.len().min(room)]);
    }
}

impl http_body::Body for Tap {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            this.copy(data);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use http_body_util::{BodyExt, StreamBody};

    use super::*;

    #[test]
    fn text_is_cut_at_the_limit_and_never_inside_a_character() {
        assert_eq!(text(b"hello", 10), ("hello".to_owned(), false));
        assert_eq!(text(b"hello", 5), ("hello".to_owned(), false));
        assert_eq!(text(b"hello", 3), ("hel".to_owned(), true));
        // "é" is two bytes: cut after its first, it is left out.
        assert_eq!(text("aé".as_bytes(), 2), ("a".to_owned(), true));
        // Bytes that are not UTF-8 are replaced, not dropped.
        assert_eq!(text(b"a\xffb", 10), ("a\u{fffd}b".to_owned(), false));
    }

    #[test]
    fn a_request_streamed_through_has_no_prompt() {
        let capture = Capture::of_request(None, 10);
        assert_eq!(capture.prompt, None);
        let line = serde_json::to_value(&capture).unwrap();
        assert_eq!(line, serde_json::json!({}));
    }

    #[tokio::test]
    async fn the_tap_passes_every_frame_and_copies_only_up_to_the_limit() {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = ["abc", "defg", "hij"]
            .into_iter()
            .map(|chunk| Ok(Frame::data(Bytes::from(chunk))))
            .collect();
        let inner = StreamBody::new(futures_util::stream::iter(frames)).boxed();
        let (tap, tapped) = Tap::new(inner, 5);
        let passed = tap.collect().await.unwrap().to_bytes();
        assert_eq!(&passed[..], b"abcdefghij");
        let capture = Capture::of_request(Some(&Bytes::from_static(b"{}")), 5).with_answer(&tapped);
        assert_eq!(capture.prompt.as_deref(), Some("{}"));
        assert!(!capture.prompt_truncated);
        assert_eq!(capture.answer.as_deref(), Some("abcde"));
        assert!(capture.answer_truncated);
    }

    #[tokio::test]
    async fn the_tap_keeps_the_length_of_a_whole_body() {
        let (tap, tapped) = Tap::new(crate::body::full("0123456789"), 4);
        assert_eq!(http_body::Body::size_hint(&tap).exact(), Some(10));
        let passed = tap.collect().await.unwrap().to_bytes();
        assert_eq!(passed.len(), 10);
        let capture = Capture::default().with_answer(&tapped);
        assert_eq!(capture.answer.as_deref(), Some("0123"));
        assert!(capture.answer_truncated);
    }
}
