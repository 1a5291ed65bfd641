//! The engine's answer rewritten into Ollama's as it streams: each SSE event is read as its
//! line completes and written out at once as one NDJSON line (a content or thinking delta),
//! tool-call fragments are gathered by `index` and attached to the last line, which carries
//! `done: true`, `done_reason`, the counts and the durations (from llama-server's `timings`
//! where the engine gives them, else oqp's clock). A whole answer (`stream: false`, or an
//! embedding) is read whole, bounded, and written as one object; an error status becomes
//! `{"error": "…"}`. An engine's in-band error (`data: {"error":…}`), or a stream that ends
//! before its answer is complete, ends the NDJSON with one `{"error": "…"}` line and no
//! `done`, as Ollama ends a stream that fails.
//!
//! An engine that writes its first event on its own, before any token (the role-only chunk
//! OpenAI's API and the fake send at once, a tool call's first fragment), gets its opening line
//! written for it at once: `message` of the assistant with empty `content`, `done: false` (the
//! shape of every line before the last, which Ollama's clients read as a delta of nothing), so
//! that an Ollama client's first byte comes when the engine's does, not one token later. An
//! engine that sends the role with its first token in one write (llama-server) gets no such
//! line.

use std::collections::{BTreeMap, VecDeque};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use serde_json::{Map, Value, json};

use super::embed;
use super::{Reply, Shape, now};
use crate::body::{Body, BoxError};

/// Most bytes of a whole answer (or of one SSE line) held to translate it.
const MAX_HELD: usize = 64 << 20;

/// Most bytes of an error answer read for its message.
const MAX_ERROR: usize = 64 << 10;

/// What the engine sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Source {
    /// `text/event-stream`.
    Sse,
    /// One JSON object.
    Json,
    /// An error status: its body names the error.
    Error,
}

/// A tool call gathered from its fragments.
#[derive(Debug, Default)]
struct Call {
    id: String,
    name: String,
    arguments: String,
}

/// What has been read of the answer so far.
#[derive(Debug, Default)]
struct Answer {
    /// Content and thinking, for an answer written whole.
    content: String,
    thinking: String,
    calls: BTreeMap<u64, Call>,
    finish: Option<String>,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    /// llama-server's `timings`.
    timings: Option<Value>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

/// The translating body. See the module documentation.
pub(super) struct Translating {
    inner: Body,
    reply: Reply,
    source: Source,
    /// Lines are written as they come (a stream asked for and answered as one).
    ndjson: bool,
    /// A partial SSE line, or the whole body.
    held: Vec<u8>,
    answer: Answer,
    out: VecDeque<Bytes>,
    /// Nothing more is written (the last line, or an error, is out).
    finished: bool,
    /// SSE events read.
    events: u64,
    /// A line has been written.
    wrote: bool,
}

impl std::fmt::Debug for Translating {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Translating")
            .field("source", &self.source)
            .field("ndjson", &self.ndjson)
            .finish_non_exhaustive()
    }
}

impl Translating {
    pub(super) fn new(inner: Body, reply: Reply, source: Source) -> Self {
        let ndjson = reply.stream && source == Source::Sse;
        Self {
            inner,
            reply,
            source,
            ndjson,
            held: Vec::new(),
            answer: Answer::default(),
            out: VecDeque::new(),
            finished: false,
            events: 0,
            wrote: false,
        }
    }

    /// Reads a data frame of the engine's answer.
    fn read(&mut self, data: &[u8]) {
        match self.source {
            Source::Sse => {
                let events = self.events;
                self.held.extend_from_slice(data);
                while let Some(end) = self.held.iter().position(|byte| *byte == b'\n') {
                    let line: Vec<u8> = self.held.drain(..=end).collect();
                    self.sse_line(&line);
                    if self.finished {
                        return;
                    }
                }
                if self.held.len() > MAX_HELD {
                    self.fail("the engine sent a stream line too long to translate");
                } else if self.ndjson && !self.wrote && self.events > events {
                    // The engine has begun, with nothing to write yet: the opening line.
                    let line = self.chunk("", "");
                    self.push_line(&line);
                }
            }
            Source::Json => {
                self.held.extend_from_slice(data);
                if self.held.len() > MAX_HELD {
                    self.fail("the engine's answer is too large to translate");
                }
            }
            Source::Error => {
                let room = MAX_ERROR.saturating_sub(self.held.len());
                self.held.extend_from_slice(&data[..data.len().min(room)]);
            }
        }
    }

    /// One line of an SSE stream: a `data:` payload is an event; comments (`:` pings),
    /// `event:` names and blank lines carry nothing to translate.
    fn sse_line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(payload) = line.strip_prefix(b"data:") else {
            return;
        };
        let payload = payload.trim_ascii();
        self.events += 1;
        if payload == b"[DONE]" {
            self.complete();
            return;
        }
        match serde_json::from_slice::<Value>(payload) {
            Ok(event) => self.event(&event),
            Err(_) => self.fail("the engine sent a stream event that is not JSON"),
        }
    }

    /// One JSON event (a stream chunk, or the whole answer).
    fn event(&mut self, event: &Value) {
        if let Some(error) = event.get("error") {
            self.fail(&error_message(error));
            return;
        }
        if let Some(usage) = event.get("usage").filter(|usage| usage.is_object()) {
            self.answer.prompt_tokens = usage.get("prompt_tokens").and_then(Value::as_u64);
            self.answer.completion_tokens = usage.get("completion_tokens").and_then(Value::as_u64);
        }
        if let Some(timings) = event.get("timings").filter(|timings| timings.is_object()) {
            self.answer.timings = Some(timings.clone());
        }
        if self.reply.shape == Shape::Infill {
            self.infill_event(event);
            return;
        }
        let Some(choice) = event
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|choices| choices.first())
        else {
            return;
        };
        // A stream's delta, a whole answer's message; a completion's text.
        let message = choice.get("delta").or_else(|| choice.get("message"));
        let text = |name: &str| {
            message
                .and_then(|message| message.get(name))
                .and_then(Value::as_str)
                .unwrap_or_default()
        };
        let content = match self.reply.shape {
            Shape::Generate { completions: true } => choice
                .get("text")
                .and_then(Value::as_str)
                .unwrap_or_default(),
            _ => text("content"),
        };
        let thinking = match text("reasoning_content") {
            "" => text("reasoning"),
            thinking => thinking,
        };
        if let Some(calls) = message
            .and_then(|message| message.get("tool_calls"))
            .and_then(Value::as_array)
        {
            for (place, call) in calls.iter().enumerate() {
                self.call_fragment(place, call);
            }
        }
        if !content.is_empty() || !thinking.is_empty() {
            let at = Instant::now();
            self.answer.first_token.get_or_insert(at);
            self.answer.last_token = Some(at);
            if self.ndjson {
                let line = self.chunk(content, thinking);
                self.push_line(&line);
            } else {
                self.answer.content.push_str(content);
                self.answer.thinking.push_str(thinking);
            }
        }
        if let Some(finish) = choice.get("finish_reason").and_then(Value::as_str) {
            self.answer.finish = Some(finish.to_owned());
        }
    }

    /// An event of llama-server's own completion API (`/infill`): `content`, and on the last
    /// (`stop: true`) the counts and `stop_type` (`limit` when `n_predict` cut it).
    fn infill_event(&mut self, event: &Value) {
        let content = event
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !content.is_empty() {
            let at = Instant::now();
            self.answer.first_token.get_or_insert(at);
            self.answer.last_token = Some(at);
            if self.ndjson {
                let line = self.chunk(content, "");
                self.push_line(&line);
            } else {
                self.answer.content.push_str(content);
            }
        }
        if event.get("stop") == Some(&Value::Bool(true)) {
            self.answer.prompt_tokens = event.get("tokens_evaluated").and_then(Value::as_u64);
            self.answer.completion_tokens = event.get("tokens_predicted").and_then(Value::as_u64);
            let reason = match event.get("stop_type").and_then(Value::as_str) {
                Some("limit") => "length",
                _ => "stop",
            };
            self.answer.finish = Some(reason.to_owned());
        }
    }

    /// A tool call's fragment: the first names it, the rest add to its arguments.
    fn call_fragment(&mut self, place: usize, call: &Value) {
        let index = call
            .get("index")
            .and_then(Value::as_u64)
            .unwrap_or(place as u64);
        let entry = self.answer.calls.entry(index).or_default();
        if let Some(id) = call.get("id").and_then(Value::as_str) {
            entry.id = id.to_owned();
        }
        if let Some(function) = call.get("function") {
            if let Some(name) = function.get("name").and_then(Value::as_str) {
                entry.name.push_str(name);
            }
            match function.get("arguments") {
                Some(Value::String(fragment)) => entry.arguments.push_str(fragment),
                Some(arguments @ Value::Object(_)) => entry.arguments = arguments.to_string(),
                _ => {}
            }
        }
    }

    /// A streamed line with a delta.
    fn chunk(&self, content: &str, thinking: &str) -> Value {
        let mut line = Map::new();
        line.insert("model".into(), json!(self.reply.model));
        line.insert("created_at".into(), json!(now()));
        match self.reply.shape {
            Shape::Chat => {
                let mut message = json!({ "role": "assistant", "content": content });
                if !thinking.is_empty() {
                    message["thinking"] = json!(thinking);
                }
                line.insert("message".into(), message);
            }
            _ => {
                line.insert("response".into(), json!(content));
                if !thinking.is_empty() {
                    line.insert("thinking".into(), json!(thinking));
                }
            }
        }
        line.insert("done".into(), json!(false));
        Value::Object(line)
    }

    /// The stream's end (`[DONE]`, or the body's end after a finish): the last line.
    fn complete(&mut self) {
        if self.finished {
            return;
        }
        if self.answer.finish.is_none() {
            self.fail("the engine's stream ended before its answer was complete");
            return;
        }
        let last = self.last();
        self.push_line(&last);
        self.finished = true;
    }

    /// The last object: what a whole answer holds, `done: true`, the reason, counts and
    /// durations in nanoseconds.
    fn last(&mut self) -> Value {
        let mut last = Map::new();
        last.insert("model".into(), json!(self.reply.model));
        last.insert("created_at".into(), json!(now()));
        let calls: Vec<Value> = std::mem::take(&mut self.answer.calls)
            .into_values()
            .enumerate()
            .map(|(index, call)| ollama_call(index, call))
            .collect();
        let content = std::mem::take(&mut self.answer.content);
        let thinking = std::mem::take(&mut self.answer.thinking);
        match self.reply.shape {
            Shape::Chat => {
                let mut message = json!({ "role": "assistant", "content": content });
                if !thinking.is_empty() {
                    message["thinking"] = json!(thinking);
                }
                if !calls.is_empty() {
                    message["tool_calls"] = Value::Array(calls);
                }
                last.insert("message".into(), message);
            }
            _ => {
                last.insert("response".into(), json!(content));
                if !thinking.is_empty() {
                    last.insert("thinking".into(), json!(thinking));
                }
            }
        }
        last.insert("done".into(), json!(true));
        let reason = match self.answer.finish.as_deref() {
            Some("length") => "length",
            _ => "stop",
        };
        last.insert("done_reason".into(), json!(reason));
        for (name, value) in self.metrics() {
            last.insert(name.into(), json!(value));
        }
        Value::Object(last)
    }

    /// Ollama's metric fields: from the engine's `timings` and `usage`, else oqp's clock.
    fn metrics(&self) -> Vec<(&'static str, u64)> {
        let timing = |name: &str| {
            self.answer
                .timings
                .as_ref()
                .and_then(|timings| timings.get(name))
                .and_then(Value::as_f64)
        };
        let nanos = |duration: Duration| u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        let millis = |ms: f64| {
            if ms.is_finite() && ms >= 0.0 {
                nanos(Duration::from_secs_f64(ms / 1000.0))
            } else {
                0
            }
        };
        let now = Instant::now();
        let first = self.answer.first_token.unwrap_or(now);
        let last = self.answer.last_token.unwrap_or(now);
        let prompt_count = self.answer.prompt_tokens.or_else(|| {
            let evaluated = timing("prompt_n")?;
            Some((evaluated + timing("cache_n").unwrap_or(0.0)) as u64)
        });
        let eval_count = self
            .answer
            .completion_tokens
            .or_else(|| timing("predicted_n").map(|n| n as u64));
        let prompt_duration = timing("prompt_ms").map_or_else(
            || nanos(first.saturating_duration_since(self.reply.received)),
            millis,
        );
        let eval_duration = timing("predicted_ms")
            .map_or_else(|| nanos(last.saturating_duration_since(first)), millis);
        let mut metrics = vec![
            ("total_duration", nanos(self.reply.received.elapsed())),
            ("load_duration", 0),
        ];
        if let Some(count) = prompt_count {
            metrics.push(("prompt_eval_count", count));
        }
        metrics.push(("prompt_eval_duration", prompt_duration));
        if let Some(count) = eval_count {
            metrics.push(("eval_count", count));
        }
        metrics.push(("eval_duration", eval_duration));
        metrics
    }

    /// The body's end.
    fn end(&mut self) {
        if self.finished {
            return;
        }
        match self.source {
            // A stream without `[DONE]` is whole only if its finish was read.
            Source::Sse => {
                let rest = std::mem::take(&mut self.held);
                if !rest.is_empty() {
                    self.sse_line(&rest);
                }
                if self.ndjson {
                    self.complete();
                } else if self.answer.finish.is_some() {
                    let last = self.last();
                    self.push_whole(&last);
                } else {
                    self.fail("the engine's stream ended before its answer was complete");
                }
            }
            Source::Json => {
                let held = std::mem::take(&mut self.held);
                match serde_json::from_slice::<Value>(&held) {
                    Ok(answer) => self.whole(&answer),
                    Err(_) => self.fail("the engine's answer is not JSON"),
                }
            }
            Source::Error => {
                let held = std::mem::take(&mut self.held);
                let message = match serde_json::from_slice::<Value>(&held) {
                    Ok(value) => value
                        .get("error")
                        .map_or_else(|| value.to_string(), error_message),
                    Err(_) => String::from_utf8_lossy(&held).trim().to_owned(),
                };
                self.push_whole(&json!({ "error": message }));
            }
        }
        self.finished = true;
    }

    /// A whole JSON answer: a chat or completion object, or embeddings.
    fn whole(&mut self, answer: &Value) {
        if let Some(error) = answer.get("error") {
            self.push_whole(&json!({ "error": error_message(error) }));
            return;
        }
        let total = || u64::try_from(self.reply.received.elapsed().as_nanos()).unwrap_or(u64::MAX);
        match self.reply.shape {
            Shape::Embed { dimensions } => {
                let Some(vectors) = embed::vectors(answer) else {
                    self.push_whole(&json!({ "error": "the engine's answer has no embeddings" }));
                    return;
                };
                let embeddings: Vec<Vec<f64>> = vectors
                    .into_iter()
                    .map(|vector| embed::normalised(vector, dimensions))
                    .collect();
                let mut object = json!({
                    "model": self.reply.model,
                    "embeddings": embeddings,
                    "total_duration": total(),
                    "load_duration": 0,
                });
                if let Some(count) = answer
                    .get("usage")
                    .and_then(|usage| usage.get("prompt_tokens"))
                    .and_then(Value::as_u64)
                {
                    object["prompt_eval_count"] = json!(count);
                }
                self.push_whole(&object);
            }
            Shape::Embeddings => {
                match embed::vectors(answer).and_then(|vectors| vectors.into_iter().next()) {
                    Some(vector) => self.push_whole(&json!({ "embedding": vector })),
                    None => {
                        self.push_whole(
                            &json!({ "error": "the engine's answer has no embedding" }),
                        );
                    }
                }
            }
            Shape::Chat | Shape::Generate { .. } | Shape::Infill => {
                self.event(answer);
                if self.finished {
                    return;
                }
                let last = self.last();
                self.push_whole(&last);
            }
        }
    }

    /// An error: in a stream its own line, ending it (no `done` line follows); otherwise the
    /// whole answer.
    fn fail(&mut self, message: &str) {
        if self.finished {
            return;
        }
        let line = json!({ "error": message });
        if self.ndjson {
            self.push_line(&line);
        } else {
            self.push_whole(&line);
        }
        self.finished = true;
        self.held.clear();
    }

    fn push_line(&mut self, value: &Value) {
        self.wrote = true;
        let mut line = value.to_string().into_bytes();
        line.push(b'\n');
        self.out.push_back(Bytes::from(line));
    }

    fn push_whole(&mut self, value: &Value) {
        self.out.push_back(Bytes::from(value.to_string()));
    }
}

/// An OpenAI tool call as Ollama's: arguments parsed into an object.
fn ollama_call(index: usize, call: Call) -> Value {
    let arguments = match serde_json::from_str::<Value>(&call.arguments) {
        Ok(arguments @ Value::Object(_)) => arguments,
        _ if call.arguments.trim().is_empty() => json!({}),
        _ => {
            tracing::warn!(
                tool = %call.name,
                "a tool call's arguments from the engine are not a JSON object; sent as {{}}"
            );
            json!({})
        }
    };
    let mut out =
        json!({ "function": { "index": index, "name": call.name, "arguments": arguments } });
    if !call.id.is_empty() {
        out["id"] = json!(call.id);
    }
    out
}

/// The message of an engine's `error` (OpenAI's `{"message": …}`, or a plain string).
fn error_message(error: &Value) -> String {
    match error {
        Value::String(message) => message.clone(),
        other => other
            .get("message")
            .and_then(Value::as_str)
            .map_or_else(|| other.to_string(), str::to_owned),
    }
}

impl HttpBody for Translating {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            if let Some(bytes) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(bytes))));
            }
            if this.finished {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        this.read(data);
                    }
                }
                Poll::Ready(Some(Err(error))) => {
                    tracing::debug!(%error, "the engine's answer broke while it was translated");
                    this.fail("the engine's answer broke before it was complete");
                }
                Poll::Ready(None) => this.end(),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.finished && self.out.is_empty()
    }
}
