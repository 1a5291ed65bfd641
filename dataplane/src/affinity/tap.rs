//! The answer's text, read as it streams to the client: it is the next turn's prefix.
//!
//! [`Tapped`] wraps a response body, passes every frame on untouched, and hands the answer's
//! text to its hook when the body ends whole (a body cut short, failed, or ending in an
//! in-band `{"error":…}` line or event records nothing:
//! the runner's cache then holds less than the next turn will send). NDJSON lines and SSE
//! events are read one at a time; a whole JSON answer at its end. An answer over
//! [`MAX_ANSWER`] bytes, or a line over it, is not recorded.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use serde_json::Value;

use super::chain::Shape;
use crate::body::{Body, BoxError};

/// The longest answer (and line) recorded, in bytes.
pub const MAX_ANSWER: usize = 1 << 20;

/// Called with the answer's text when the body ended whole.
pub type OnAnswer = Box<dyn FnOnce(String) + Send + Sync>;

/// How the body is framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Ndjson,
    Sse,
    Whole,
}

/// A response body whose answer text is recorded. See the module documentation.
pub struct Tapped {
    inner: Body,
    shape: Shape,
    mode: Mode,
    /// The partial line (streams) or the whole body (JSON).
    pending: Vec<u8>,
    answer: String,
    broken: bool,
    on_answer: Option<OnAnswer>,
}

impl std::fmt::Debug for Tapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tapped")
            .field("shape", &self.shape)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl Tapped {
    /// Wraps `inner`, an answer of a route of `shape` with `content_type`.
    pub fn new(inner: Body, shape: Shape, content_type: Option<&str>, on_answer: OnAnswer) -> Self {
        let content_type = content_type.unwrap_or_default();
        let mode = if content_type.starts_with("application/x-ndjson") {
            Mode::Ndjson
        } else if content_type.starts_with("text/event-stream") {
            Mode::Sse
        } else {
            Mode::Whole
        };
        Self {
            inner,
            shape,
            mode,
            pending: Vec::new(),
            answer: String::new(),
            broken: false,
            on_answer: Some(on_answer),
        }
    }

    fn observe(&mut self, data: &[u8]) {
        if self.broken {
            return;
        }
        if self.mode == Mode::Whole {
            if self.pending.len() + data.len() > MAX_ANSWER {
                self.broken = true;
                self.pending = Vec::new();
            } else {
                self.pending.extend_from_slice(data);
            }
            return;
        }
        let mut rest = data;
        while let Some(end) = rest.iter().position(|byte| *byte == b'\n') {
            let (line, after) = rest.split_at(end);
            rest = &after[1..];
            if self.pending.is_empty() {
                self.line(line);
            } else {
                let mut whole = std::mem::take(&mut self.pending);
                whole.extend_from_slice(line);
                self.line(&whole);
            }
        }
        if self.pending.len() + rest.len() > MAX_ANSWER {
            self.broken = true;
            self.pending = Vec::new();
        } else {
            self.pending.extend_from_slice(rest);
        }
    }

    fn line(&mut self, line: &[u8]) {
        let line = match self.mode {
            Mode::Sse => match line.strip_prefix(b"data:") {
                Some(data) => data,
                None => return,
            },
            Mode::Ndjson | Mode::Whole => line,
        };
        let line = line.trim_ascii();
        if line.is_empty() || line == b"[DONE]" {
            return;
        }
        if let Ok(value) = serde_json::from_slice::<Value>(line) {
            if self.mode != Mode::Whole && value.get("error").is_some_and(|error| !error.is_null())
            {
                // An in-band error: the stream failed, and the runner holds what it held.
                self.broken = true;
                return;
            }
            extract(self.shape, &value, &mut self.answer);
            if self.answer.len() > MAX_ANSWER {
                self.broken = true;
            }
        }
    }

    fn finish(&mut self) {
        // A whole answer, or a stream's last line without its newline.
        if !self.broken && !self.pending.is_empty() {
            let rest = std::mem::take(&mut self.pending);
            self.line(&rest);
        }
        if let Some(on_answer) = self.on_answer.take()
            && !self.broken
        {
            on_answer(std::mem::take(&mut self.answer));
        }
    }
}

/// Appends the answer text `value` carries (one line or event, or a whole answer).
fn extract(shape: Shape, value: &Value, out: &mut String) {
    let push = |out: &mut String, text: Option<&Value>| {
        if let Some(text) = text.and_then(Value::as_str) {
            out.push_str(text);
        }
    };
    match shape {
        Shape::OllamaChat => push(out, value.pointer("/message/content")),
        Shape::OllamaGenerate => push(out, value.get("response")),
        Shape::OpenAiChat => {
            for choice in value
                .get("choices")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                push(out, choice.pointer("/delta/content"));
                push(out, choice.pointer("/message/content"));
            }
        }
        Shape::OpenAiCompletion => {
            for choice in value
                .get("choices")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                push(out, choice.get("text"));
            }
        }
        Shape::Messages => match value.get("type").and_then(Value::as_str) {
            Some("content_block_delta")
                if value.pointer("/delta/type").and_then(Value::as_str) == Some("text_delta") =>
            {
                push(out, value.pointer("/delta/text"));
            }
            Some("message") => {
                for block in value
                    .get("content")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    if block.get("type").and_then(Value::as_str) == Some("text") {
                        push(out, block.get("text"));
                    }
                }
            }
            _ => {}
        },
        Shape::Responses => {
            if value.get("type").and_then(Value::as_str) == Some("response.output_text.delta") {
                push(out, value.get("delta"));
            } else if value.get("object").and_then(Value::as_str) == Some("response") {
                for item in value
                    .get("output")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    if item.get("type").and_then(Value::as_str) != Some("message") {
                        continue;
                    }
                    for part in item
                        .get("content")
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                    {
                        if part.get("type").and_then(Value::as_str) == Some("output_text") {
                            push(out, part.get("text"));
                        }
                    }
                }
            }
        }
    }
}

impl HttpBody for Tapped {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let polled = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        match &polled {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    this.observe(data);
                }
                if this.inner.is_end_stream() {
                    this.finish();
                }
            }
            Some(Err(_)) => this.on_answer = None,
            None => this.finish(),
        }
        Poll::Ready(polled)
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
    use super::*;
    use http_body_util::BodyExt;
    use std::sync::{Arc, Mutex};

    async fn answer_of(
        shape: Shape,
        content_type: &str,
        frames: &[&'static str],
    ) -> Option<String> {
        let got = Arc::new(Mutex::new(None));
        let sink = got.clone();
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = frames
            .iter()
            .map(|frame| Ok(Frame::data(Bytes::from_static(frame.as_bytes()))))
            .collect();
        let stream = futures_util::stream::iter(frames);
        let body = http_body_util::StreamBody::new(stream).boxed();
        let tapped = Tapped::new(
            body,
            shape,
            Some(content_type),
            Box::new(move |text| *sink.lock().unwrap() = Some(text)),
        );
        let _ = tapped.collect().await;
        got.lock().unwrap().take()
    }

    #[tokio::test]
    async fn a_stream_ending_in_an_in_band_error_records_nothing() {
        let sse = answer_of(
            Shape::OpenAiChat,
            "text/event-stream",
            &[
                "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n",
                "data: {\"error\":{\"code\":500,\"message\":\"Context size has been exceeded.\"}}\n\n",
            ],
        );
        assert_eq!(sse.await, None);
        let ndjson = answer_of(
            Shape::OllamaChat,
            "application/x-ndjson",
            &["{\"message\":{\"content\":\"Hel\"}}\n{\"error\":\"runner failed\"}\n"],
        );
        assert_eq!(ndjson.await, None);
        // `"error": null` is no error.
        let fine = answer_of(
            Shape::OpenAiChat,
            "text/event-stream",
            &["data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"error\":null}\n\n"],
        );
        assert_eq!(fine.await.as_deref(), Some("Hi"));
    }

    #[tokio::test]
    async fn each_routes_answer_is_read_from_its_stream() {
        let ndjson = answer_of(
            Shape::OllamaChat,
            "application/x-ndjson",
            &[
                "{\"message\":{\"role\":\"assistant\",\"content\":\"Hel\"}}\n{\"mess",
                "age\":{\"content\":\"lo\"}}\n",
                "{\"message\":{\"content\":\"\"},\"done\":true}\n",
            ],
        );
        assert_eq!(ndjson.await.as_deref(), Some("Hello"));
        let sse = answer_of(
            Shape::Messages,
            "text/event-stream",
            &[
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"A\"}}\n\n",
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{}\"}}\n\n",
                "data: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"B\"}}\n\n",
            ],
        );
        assert_eq!(sse.await.as_deref(), Some("AB"));
        let openai = answer_of(
            Shape::OpenAiChat,
            "text/event-stream",
            &["data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: [DONE]\n\n"],
        );
        assert_eq!(openai.await.as_deref(), Some("x"));
        let responses = answer_of(
            Shape::Responses,
            "text/event-stream",
            &[
                "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"r\"}\n\n",
            ],
        );
        assert_eq!(responses.await.as_deref(), Some("r"));
    }

    #[tokio::test]
    async fn a_whole_answer_is_read_at_its_end() {
        let whole = answer_of(
            Shape::Responses,
            "application/json",
            &[
                r#"{"object":"response","output":[{"type":"reasoning"},{"type":"message","content":[{"type":"output_text","text":"whole"}]}]}"#,
            ],
        );
        assert_eq!(whole.await.as_deref(), Some("whole"));
        let chat = answer_of(
            Shape::OllamaChat,
            "application/json; charset=utf-8",
            &[r#"{"message":{"role":"assistant","content":"one"},"done":true}"#],
        );
        assert_eq!(chat.await.as_deref(), Some("one"));
    }
}
