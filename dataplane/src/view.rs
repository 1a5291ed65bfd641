//! One reading of a request body, with Ollama's rules: what every part of the data plane
//! that looks inside a body (the model allowlist, routing, the app user field, accounting,
//! prompt-cache affinity, the keep_alive rewrite) reads from it.
//!
//! [`BodyView::read`] checks the body once and walks its top-level object once:
//! - a body that is not exactly one JSON value (surrounding whitespace allowed) is
//!   [`NotJson`]. Ollama's Go decoder reads the first value of a body and ignores what
//!   follows it, so `{"model":"m"} x` is a request for `m` there; a reading that saw no
//!   model in it would let it past the allowlist. Such a body is refused, never guessed at;
//! - field names match as Go's `encoding/json` matches them: case-insensitively, the
//!   occurrence read last deciding ([`scan::fold_eq`]); a `null` leaves a plain field (a
//!   string) as it was and clears a pointer, slice, map or interface field, as Go does.
//!
//! No tree of the body is built: the view holds byte spans into it and the few small
//! values it decodes (the model and name strings). Texts are decoded (borrowed when they
//! hold no escape) only where they are read. The check walks the body with
//! `serde_json`'s `IgnoredAny`, which allocates nothing. What a reading allocates is at
//! most about the body's size (a string with escapes is decoded one at a time), which the
//! request path charges to the body budget while it reads.
//!
//! A leaf: it depends on no other module of the crate.

pub mod scan;

use std::borrow::Cow;
use std::ops::Range;

use serde::Deserialize;
use serde::de::IgnoredAny;

/// A body that is not one JSON value: malformed, or followed by anything but whitespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the request body is not one JSON value")]
pub struct NotJson;

/// A field that is there but is not a string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("not a string")]
pub struct NotString;

/// What a request body says, as Ollama reads it. Holds spans into the body it was read
/// from: its methods take that same body.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BodyView {
    /// Where the top-level object opens, when the body is one.
    open: Option<usize>,
    /// The end of the last member's value, when the object has one.
    last_value_end: Option<usize>,
    /// The value spans of every member Ollama would read as `keep_alive`.
    keep_alive: Vec<Range<usize>>,
    /// The value spans of every member Ollama would read as `model`.
    models: Vec<Range<usize>>,
    /// `model`, when it is a string.
    model: Option<String>,
    /// The deprecated `name`, when it is a string.
    name: Option<String>,
    /// The deciding values of the other fields read (`None`: absent, or `null`).
    stream: Option<Range<usize>>,
    input: Option<Range<usize>>,
    prompt: Option<Range<usize>>,
    system: Option<Range<usize>>,
    instructions: Option<Range<usize>>,
    messages: Option<Range<usize>>,
    options: Option<Range<usize>>,
}

/// How Go decodes a `null` into a field.
#[derive(Clone, Copy)]
enum Null {
    /// A plain value (string, bool, number): left as it was.
    Keeps,
    /// A pointer, slice, map or interface: cleared.
    Clears,
}

/// The fields a view reads, with Go's treatment of `null` for each, as Ollama declares
/// them (`Model string`, `Stream *bool`, `Input any`, `Messages []Message`, …).
const FIELDS: [(&str, Null); 10] = [
    ("model", Null::Keeps),
    ("name", Null::Keeps),
    ("stream", Null::Clears),
    ("input", Null::Clears),
    ("prompt", Null::Keeps),
    ("system", Null::Keeps),
    ("instructions", Null::Keeps),
    ("messages", Null::Clears),
    ("options", Null::Clears),
    ("keep_alive", Null::Clears),
];

impl BodyView {
    /// The view of a body that says nothing (empty, or not an object).
    pub const EMPTY: BodyView = BodyView {
        open: None,
        last_value_end: None,
        keep_alive: Vec::new(),
        models: Vec::new(),
        model: None,
        name: None,
        stream: None,
        input: None,
        prompt: None,
        system: None,
        instructions: None,
        messages: None,
        options: None,
    };

    /// Reads `body`. An empty (or all-whitespace) body is an empty view; a body that is one
    /// JSON value but not an object is a view with nothing in it; anything else that is not
    /// one JSON value is [`NotJson`].
    pub fn read(body: &[u8]) -> Result<BodyView, NotJson> {
        let open = scan::skip_ws(body, 0);
        if open == body.len() {
            return Ok(BodyView::default());
        }
        let mut checked = serde_json::Deserializer::from_slice(body);
        IgnoredAny::deserialize(&mut checked).map_err(|_| NotJson)?;
        checked.end().map_err(|_| NotJson)?;
        if body.get(open) != Some(&b'{') {
            return Ok(BodyView::default());
        }
        let mut view = BodyView {
            open: Some(open),
            ..BodyView::default()
        };
        let mut decided: [Option<Range<usize>>; FIELDS.len()] = Default::default();
        let walked = scan::each_member(body, open, |member| {
            view.last_value_end = Some(member.value.end);
            let Some(key) = scan::key(body, &member) else {
                return;
            };
            let Some(field) = FIELDS
                .iter()
                .position(|(name, _)| scan::fold_eq(&key, name))
            else {
                return;
            };
            match FIELDS[field].0 {
                "keep_alive" => view.keep_alive.push(member.value.clone()),
                "model" => view.models.push(member.value.clone()),
                _ => {}
            }
            let null = body.get(member.value.clone()) == Some(b"null".as_slice());
            match (null, FIELDS[field].1) {
                (true, Null::Keeps) => {}
                (true, Null::Clears) => decided[field] = None,
                (false, _) => decided[field] = Some(member.value),
            }
        });
        // Validated above: the walk of a valid object always completes.
        walked.ok_or(NotJson)?;
        let [
            model,
            name,
            stream,
            input,
            prompt,
            system,
            instructions,
            messages,
            options,
            _,
        ] = decided;
        let string = |span: Option<Range<usize>>| {
            span.and_then(|span| scan::text(body, span).map(Cow::into_owned))
        };
        view.model = string(model);
        view.name = string(name);
        view.stream = stream;
        view.input = input;
        view.prompt = prompt;
        view.system = system;
        view.instructions = instructions;
        view.messages = messages;
        view.options = options;
        Ok(view)
    }

    /// Whether the body is a JSON object.
    pub fn is_object(&self) -> bool {
        self.open.is_some()
    }

    /// The `model` Ollama reads (`None`: absent, `null`, or not a string, which Ollama
    /// refuses).
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    /// The model of a route that also takes the deprecated `name` (`/api/show`, `/api/pull`,
    /// `/api/delete`, …): `model`, or `name` when `model` is absent or empty, as Ollama
    /// reads them.
    pub fn model_or_name(&self) -> Option<&str> {
        match self.model() {
            Some(model) if !model.is_empty() => Some(model),
            _ => self.name.as_deref().or(self.model()),
        }
    }

    /// `stream`, when it is a boolean (Ollama's default, streaming, otherwise).
    pub fn stream(&self, body: &[u8]) -> Option<bool> {
        serde_json::from_slice(body.get(self.stream.clone()?)?).ok()
    }

    /// How many inputs an embedding body carries: `/api/embed`'s `input` (an array's items,
    /// or one), else `/api/embeddings`' one `prompt`. Counted without decoding them.
    pub fn input_count(&self, body: &[u8]) -> u64 {
        if let Some(input) = self.input.clone() {
            if body.get(input.start) == Some(&b'[') {
                let mut count = 0u64;
                let _ = scan::each_element(body, input, |_| count += 1);
                return count;
            }
            return 1;
        }
        u64::from(self.prompt.is_some())
    }

    /// The value spans of every member Ollama would read as `keep_alive`, in order.
    pub fn keep_alive(&self) -> &[Range<usize>] {
        &self.keep_alive
    }

    /// The value spans of every member Ollama would read as `model`, in order.
    pub fn model_members(&self) -> &[Range<usize>] {
        &self.models
    }

    /// Where a new last member goes, and whether it needs a leading comma: after the last
    /// value, or right after the `{` of an empty object. `None` when the body is not an
    /// object.
    pub fn append_at(&self) -> Option<(usize, bool)> {
        match (self.open, self.last_value_end) {
            (_, Some(end)) => Some((end, true)),
            (Some(open), None) => Some((open + 1, false)),
            (None, None) => None,
        }
    }

    /// The conversation fields, for prompt-cache affinity: their value spans.
    pub fn conversation(&self) -> Conversation {
        Conversation {
            messages: self.messages.clone(),
            system: self.system.clone(),
            instructions: self.instructions.clone(),
            input: self.input.clone(),
            prompt: self.prompt.clone(),
            options: self.options.clone(),
        }
    }

    /// The string at `path` (keys from the top level down, matched as Ollama matches
    /// field names): `Ok(None)` when the body is not an object or the field is absent (or
    /// `null`, or a step on the way is not an object), `Err` when it is there but not a
    /// string. The app user field (`auth.keys[].users.body_field`).
    pub fn string_at(&self, body: &[u8], path: &[String]) -> Result<Option<String>, NotString> {
        let (Some(open), Some((first, rest))) = (self.open, path.split_first()) else {
            return Ok(None);
        };
        let mut value = last_member(body, open, &first.to_ascii_lowercase());
        for key in rest {
            value = match value {
                Some(span) if body.get(span.start) == Some(&b'{') => {
                    last_member(body, span.start, &key.to_ascii_lowercase())
                }
                _ => None,
            };
        }
        match value {
            None => Ok(None),
            Some(span) if body.get(span.clone()) == Some(b"null".as_slice()) => Ok(None),
            Some(span) => scan::text(body, span)
                .map(|text| Some(text.into_owned()))
                .ok_or(NotString),
        }
    }
}

/// The value spans of the fields a conversation is read from (see [`BodyView`]).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Conversation {
    /// `messages` (chat routes).
    pub messages: Option<Range<usize>>,
    /// `system` (a string, or Anthropic's text parts).
    pub system: Option<Range<usize>>,
    /// `instructions` (`/v1/responses`).
    pub instructions: Option<Range<usize>>,
    /// `input` (`/v1/responses`: a string or items).
    pub input: Option<Range<usize>>,
    /// `prompt` (prompt routes).
    pub prompt: Option<Range<usize>>,
    /// `options` (the runner options).
    pub options: Option<Range<usize>>,
}

/// The value of the member of the object opened at `open` that Go reads as `field` (the
/// last one matching, `null` included); `field` is lower-case.
pub fn last_member(body: &[u8], open: usize, field: &str) -> Option<Range<usize>> {
    let mut found = None;
    scan::each_member(body, open, |member| {
        if scan::key_matches(body, &member, field) {
            found = Some(member.value);
        }
    })?;
    found
}

#[cfg(test)]
mod reference;
#[cfg(test)]
mod tests;
