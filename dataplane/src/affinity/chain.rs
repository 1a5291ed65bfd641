//! A request's conversation as a chain of prefix hashes, read from its body: what the
//! prompt cache of the runner that serves it will hold afterwards, and what a later request
//! can find there.
//!
//! Chat-shaped routes (`/api/chat`, `/v1/chat/completions`, `/v1/messages`, `/v1/responses`)
//! hash per message: its role and its text (string content, text parts, tool results), so
//! that the answer streamed back, hashed the same way, is the next turn's prefix whatever
//! the client's JSON looks like. Prompt routes (`/api/generate`, `/v1/completions`) hash
//! fixed blocks of the prompt. Every hash is seeded with the tenant's scope, the model and
//! the options that force Ollama to reload a runner (`num_ctx`, `num_batch`, `num_gpu`, …),
//! so chains of different tenants, models or runner settings never meet.

use std::ops::Range;

use xxhash_rust::xxh3::{Xxh3, xxh3_64_with_seed};

use crate::view::{BodyView, scan};

/// The bytes of a prompt block (prompt routes): about 64 tokens.
pub const BLOCK: usize = 256;

/// Bytes a token stands for in the estimates (as Ollama's tokenizers average on English
/// text and code).
pub const BYTES_PER_TOKEN: u32 = 4;

/// Per-message overhead of a chat template, in tokens.
const MESSAGE_TOKENS: u32 = 4;

/// The runner options that make Ollama reload a model's runner when they change.
const RELOAD_OPTIONS: [&str; 8] = [
    "num_ctx",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "use_mmap",
    "use_mlock",
    "num_thread",
    "low_vram",
];

/// One prefix of a conversation: the hash of everything up to a message (or block)
/// boundary, and the tokens that prefix holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Point {
    /// The chained hash.
    pub hash: u64,
    /// Estimated tokens up to here.
    pub tokens: u32,
}

/// How a route's body is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// `/api/chat`: `messages`, answered in `message.content`.
    OllamaChat,
    /// `/api/generate`: `system` + `prompt`, answered in `response`.
    OllamaGenerate,
    /// `/v1/chat/completions`.
    OpenAiChat,
    /// `/v1/completions`.
    OpenAiCompletion,
    /// `/v1/messages` (Anthropic).
    Messages,
    /// `/v1/responses`.
    Responses,
}

impl Shape {
    /// Whether the route hashes prompt blocks rather than messages.
    pub fn is_prompt(self) -> bool {
        matches!(self, Shape::OllamaGenerate | Shape::OpenAiCompletion)
    }
}

/// A request's chain. See the module documentation.
#[derive(Clone, Debug)]
pub struct Chain {
    /// Every prefix boundary, in order (never empty).
    pub points: Vec<Point>,
    /// The whole prompt's estimated tokens.
    pub tokens: u32,
    /// The prompt carries an earlier answer: a follow-up turn.
    pub follow_up: bool,
    /// The conversation named by a trusted session header, hashed with the scope.
    pub session: Option<u64>,
    /// The runner options (a change reloads the runner).
    pub options: u64,
    /// The conversation's first turn (the prefix through its first user message): the same
    /// for every turn of it, where boxes are chosen by hashing.
    pub root: u64,
    /// The route.
    pub shape: Shape,
    /// Prompt routes: the prompt's bytes after its last full block, which the answer
    /// continues.
    tail: Vec<u8>,
}

fn role_tag(role: &str) -> u8 {
    match role {
        "system" | "developer" => b's',
        "user" => b'u',
        "assistant" | "model" => b'a',
        _ => b't',
    }
}

/// The hash of one message after `seed`.
fn turn_hash(seed: u64, role: u8, text: &str) -> u64 {
    let mut hasher = Xxh3::with_seed(seed);
    hasher.update(&[role]);
    hasher.update(text.as_bytes());
    hasher.digest()
}

fn turn_tokens(text: &str) -> u32 {
    u32::try_from(text.len())
        .unwrap_or(u32::MAX)
        .div_ceil(BYTES_PER_TOKEN)
        .saturating_add(MESSAGE_TOKENS)
}

impl Chain {
    /// The chain of `body` (read as `view`) on a route of `shape`, for the tenant `scope`
    /// (empty when conversations are shared across keys) and `model` (normalised). `None`
    /// when the body holds nothing of the route's shape to cache.
    ///
    /// The texts are hashed as they are read, each borrowed from the body (or decoded
    /// alone when it has escapes): no copy of the conversation is built.
    pub fn read(
        shape: Shape,
        body: &[u8],
        view: &BodyView,
        scope: &str,
        model: &str,
        session: Option<&str>,
    ) -> Option<Chain> {
        let fields = view.conversation();
        let options = options_hash(model, body, fields.options);
        let seed = xxh3_64_with_seed(scope.as_bytes(), options);
        let session = session.map(|name| xxh3_64_with_seed(name.as_bytes(), seed ^ 0x5e55));
        if shape.is_prompt() {
            let mut blocks = Blocks::new(seed, 0);
            for span in [fields.system, fields.prompt].into_iter().flatten() {
                content(body, span, &mut |text| blocks.push(text.as_bytes()));
            }
            if blocks.total == 0 {
                return None;
            }
            let tokens = u32::try_from(blocks.total)
                .unwrap_or(u32::MAX)
                .div_ceil(BYTES_PER_TOKEN);
            let (points, tail) = blocks.finish();
            // Shorter than a block: too little to be worth a host.
            let root = points.first()?.hash;
            return Some(Chain {
                points,
                tokens,
                follow_up: false,
                session,
                options,
                root,
                shape,
                tail,
            });
        }
        let mut turns = Turns::new(seed);
        if let Some(system) = fields.system {
            turns.add(b's', |sink| content(body, system, sink));
        }
        if let Some(instructions) = fields.instructions {
            turns.add(b's', |sink| string(body, instructions, sink));
        }
        if shape == Shape::Responses {
            if let Some(input) = fields.input {
                responses_input(body, input, &mut turns);
            }
        } else if let Some(messages) = fields.messages {
            let _ = scan::each_element(body, messages, |message| {
                let [role, text] = members(body, message.start, ["role", "content"]);
                turns.add(role_of(body, role), |sink| {
                    if let Some(text) = text {
                        content(body, text, sink);
                    }
                });
            });
        }
        turns.finish(shape, session, options)
    }

    /// [`Chain::read`] of a body not yet read.
    #[cfg(test)]
    pub(crate) fn of(
        shape: Shape,
        body: &[u8],
        scope: &str,
        model: &str,
        session: Option<&str>,
    ) -> Option<Chain> {
        let view = BodyView::read(body).ok()?;
        Chain::read(shape, body, &view, scope, model, session)
    }

    /// The last point: the whole prompt.
    pub fn last(&self) -> Point {
        // `of` never builds an empty chain.
        self.points
            .last()
            .copied()
            .unwrap_or(Point { hash: 0, tokens: 0 })
    }

    /// The prefix the runner holds after answering `answer`: the prompt and the answer as
    /// the next turn will send it back (chat routes), or the prompt's blocks continued by
    /// the answer (prompt routes). `None` when the answer adds no whole block.
    pub fn answered(&self, answer: &str) -> Option<Point> {
        let last = self.last();
        if self.shape.is_prompt() {
            let mut rest = self.tail.clone();
            rest.extend_from_slice(answer.as_bytes());
            let seed = self.points.last().map_or(0, |point| point.hash);
            let (points, _) = blocks(seed, last.tokens, &rest);
            return points.last().copied();
        }
        Some(Point {
            hash: turn_hash(last.hash, b'a', answer),
            tokens: last.tokens.saturating_add(turn_tokens(answer)),
        })
    }
}

/// The hash of the model and the reload options a request sets (`options`, whose keys
/// Ollama matches exactly, the last one winning).
fn options_hash(model: &str, body: &[u8], options: Option<Range<usize>>) -> u64 {
    let mut hasher = Xxh3::with_seed(0x0a11);
    hasher.update(model.as_bytes());
    let object = options.filter(|span| body.get(span.start) == Some(&b'{'));
    if let Some(object) = object {
        let mut values: [Option<Range<usize>>; RELOAD_OPTIONS.len()] = Default::default();
        let _ = scan::each_member(body, object.start, |member| {
            let key = scan::key(body, &member);
            if let Some(at) = RELOAD_OPTIONS
                .iter()
                .position(|name| key.as_deref() == Some(name))
            {
                values[at] = Some(member.value);
            }
        });
        for (name, value) in RELOAD_OPTIONS.iter().zip(values) {
            // A small value, decoded so that its spelling does not matter.
            let value = value
                .and_then(|span| serde_json::from_slice::<serde_json::Value>(body.get(span)?).ok());
            if let Some(value) = value {
                hasher.update(name.as_bytes());
                hasher.update(b"=");
                hasher.update(value.to_string().as_bytes());
                hasher.update(b";");
            }
        }
    }
    hasher.digest()
}

/// Points at every full block of `text`, chained from `seed`, counting tokens from
/// `tokens`; and the bytes after the last full block.
fn blocks(seed: u64, tokens: u32, text: &[u8]) -> (Vec<Point>, Vec<u8>) {
    let mut points = Vec::with_capacity(text.len() / BLOCK);
    let mut hash = seed;
    let mut tokens = tokens;
    let mut chunks = text.chunks_exact(BLOCK);
    for block in chunks.by_ref() {
        hash = xxh3_64_with_seed(block, hash);
        tokens = tokens.saturating_add(BLOCK as u32 / BYTES_PER_TOKEN);
        points.push(Point { hash, tokens });
    }
    (points, chunks.remainder().to_vec())
}

/// The prompt's text, cut into blocks as it comes: each full block hashed at once, the
/// bytes after the last one kept.
struct Blocks {
    hash: u64,
    tokens: u32,
    pending: Vec<u8>,
    points: Vec<Point>,
    /// Bytes pushed.
    total: usize,
}

impl Blocks {
    fn new(seed: u64, tokens: u32) -> Self {
        Blocks {
            hash: seed,
            tokens,
            pending: Vec::new(),
            points: Vec::new(),
            total: 0,
        }
    }

    fn push(&mut self, mut text: &[u8]) {
        self.total = self.total.saturating_add(text.len());
        if !self.pending.is_empty() {
            let take = (BLOCK - self.pending.len()).min(text.len());
            self.pending.extend_from_slice(&text[..take]);
            text = &text[take..];
            if self.pending.len() == BLOCK {
                let block = std::mem::take(&mut self.pending);
                self.block(&block);
            }
        }
        let mut chunks = text.chunks_exact(BLOCK);
        for block in chunks.by_ref() {
            self.block(block);
        }
        self.pending.extend_from_slice(chunks.remainder());
    }

    fn block(&mut self, block: &[u8]) {
        self.hash = xxh3_64_with_seed(block, self.hash);
        self.tokens = self.tokens.saturating_add(BLOCK as u32 / BYTES_PER_TOKEN);
        self.points.push(Point {
            hash: self.hash,
            tokens: self.tokens,
        });
    }

    fn finish(self) -> (Vec<Point>, Vec<u8>) {
        (self.points, self.pending)
    }
}

/// A chat-shaped conversation, hashed message by message as it is read.
struct Turns {
    hash: u64,
    tokens: u32,
    points: Vec<Point>,
    root: Option<u64>,
    follow_up: bool,
}

impl Turns {
    fn new(seed: u64) -> Self {
        Turns {
            hash: seed,
            tokens: 0,
            points: Vec::new(),
            root: None,
            follow_up: false,
        }
    }

    /// One message of `role`, whose text `write` hands over piece by piece.
    fn add(&mut self, role: u8, write: impl FnOnce(&mut dyn FnMut(&str))) {
        let mut hasher = Xxh3::with_seed(self.hash);
        hasher.update(&[role]);
        let mut length = 0usize;
        write(&mut |text: &str| {
            hasher.update(text.as_bytes());
            length = length.saturating_add(text.len());
        });
        self.hash = hasher.digest();
        let tokens = u32::try_from(length)
            .unwrap_or(u32::MAX)
            .div_ceil(BYTES_PER_TOKEN)
            .saturating_add(MESSAGE_TOKENS);
        self.tokens = self.tokens.saturating_add(tokens);
        self.follow_up |= role == b'a';
        self.points.push(Point {
            hash: self.hash,
            tokens: self.tokens,
        });
        if self.root.is_none() && role == b'u' {
            self.root = Some(self.hash);
        }
    }

    fn finish(self, shape: Shape, session: Option<u64>, options: u64) -> Option<Chain> {
        if self.points.is_empty() {
            return None;
        }
        Some(Chain {
            root: self.root.unwrap_or(self.hash),
            points: self.points,
            tokens: self.tokens,
            follow_up: self.follow_up,
            session,
            options,
            shape,
            tail: Vec::new(),
        })
    }
}

/// `/v1/responses`' `input`: one user message, or items (messages and tool results).
fn responses_input(body: &[u8], input: Range<usize>, turns: &mut Turns) {
    if body.get(input.start) == Some(&b'"') {
        turns.add(b'u', |sink| string(body, input, sink));
        return;
    }
    let _ = scan::each_element(body, input, |item| {
        let [kind, role, text, output] =
            members(body, item.start, ["type", "role", "content", "output"]);
        let kind = kind.and_then(|span| scan::text(body, span));
        match kind.as_deref() {
            None | Some("message") => turns.add(role_of(body, role), |sink| {
                if let Some(text) = text {
                    content(body, text, sink);
                }
            }),
            Some("function_call_output") => turns.add(b't', |sink| {
                if let Some(output) = output {
                    content(body, output, sink);
                }
            }),
            // Tool calls and reasoning come back from the answer as items the stream does
            // not spell out as text: not part of the prefix.
            Some(_) => {}
        }
    });
}

/// The role tag of a message's `role` value.
fn role_of(body: &[u8], role: Option<Range<usize>>) -> u8 {
    let role = role.and_then(|span| scan::text(body, span));
    role_tag(role.as_deref().unwrap_or_default())
}

/// The values Go reads as `names` in the object at `open` (none when it is not one).
fn members<const N: usize>(
    body: &[u8],
    open: usize,
    names: [&str; N],
) -> [Option<Range<usize>>; N] {
    let mut found: [Option<Range<usize>>; N] = std::array::from_fn(|_| None);
    let _ = scan::each_member(body, open, |member| {
        if let Some(at) = names
            .iter()
            .position(|name| scan::key_matches(body, &member, name))
        {
            found[at] = Some(member.value);
        }
    });
    found
}

/// A string value's text, to `sink`.
fn string(body: &[u8], span: Range<usize>, sink: &mut dyn FnMut(&str)) {
    if let Some(text) = scan::text(body, span) {
        sink(&text);
    }
}

/// A message's text, to `sink`: a string, or the text of its parts (`text`, and the
/// `content` of tool results, read the same way). The depth is bounded by the body's
/// check (serde_json's nesting limit).
fn content(body: &[u8], span: Range<usize>, sink: &mut dyn FnMut(&str)) {
    match body.get(span.start) {
        Some(b'"') => string(body, span, sink),
        Some(b'[') => {
            let _ = scan::each_element(body, span, |part| {
                if body.get(part.start) != Some(&b'{') {
                    return;
                }
                let [text, inner] = members(body, part.start, ["text", "content"]);
                if let Some(text) = text {
                    string(body, text, sink);
                }
                if let Some(inner) = inner {
                    content(body, inner, sink);
                }
            });
        }
        _ => {}
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Chain {
        Chain::of(
            Shape::OllamaChat,
            body.as_bytes(),
            "alice",
            "m:latest",
            None,
        )
        .unwrap()
    }

    #[test]
    fn a_follow_up_extends_the_prompt_and_its_answer() {
        let first = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]}"#,
        );
        let answer = first.answered("hello there").unwrap();
        let next = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"},
            {"role":"assistant","content":"hello there"},{"role":"user","content":"more"}]}"#,
        );
        assert!(!first.follow_up);
        assert!(next.follow_up);
        assert_eq!(next.points[1], first.last());
        assert_eq!(next.points[2], answer);
        assert_eq!(next.root, first.root);
    }

    #[test]
    fn the_same_text_in_another_shape_hashes_the_same() {
        let parts = chat(
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#,
        );
        let text = chat(r#"{"messages":[{"role":"user","content":"ab"}],"model":"m"}"#);
        assert_eq!(parts.last(), text.last());
    }

    #[test]
    fn scopes_models_and_reload_options_never_meet() {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        let a = chat(body);
        let b = Chain::of(Shape::OllamaChat, body.as_bytes(), "bob", "m:latest", None).unwrap();
        let shared = Chain::of(Shape::OllamaChat, body.as_bytes(), "", "m:latest", None).unwrap();
        let other = Chain::of(
            Shape::OllamaChat,
            body.as_bytes(),
            "alice",
            "n:latest",
            None,
        );
        let ctx = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"options":{"num_ctx":8192}}"#,
        );
        let temperature = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"options":{"temperature":0.1}}"#,
        );
        assert_ne!(a.last(), b.last());
        assert_ne!(a.last(), shared.last());
        assert_ne!(a.last(), other.unwrap().last());
        assert_ne!(a.last(), ctx.last());
        assert_ne!(a.options, ctx.options);
        assert_eq!(a.last(), temperature.last());
    }

    #[test]
    fn prompts_chain_by_block_and_the_answer_continues_them() {
        let prompt = "x".repeat(BLOCK * 2 + 10);
        let body = serde_json::json!({ "model": "m", "prompt": prompt }).to_string();
        let first = Chain::of(Shape::OllamaGenerate, body.as_bytes(), "s", "m", None).unwrap();
        assert_eq!(first.points.len(), 2);
        let short = serde_json::json!({ "model": "m", "prompt": "hi" }).to_string();
        assert!(Chain::of(Shape::OllamaGenerate, short.as_bytes(), "s", "m", None).is_none());
        let answer = first.answered(&"y".repeat(BLOCK)).unwrap();
        let next_prompt = format!("{prompt}{}more", "y".repeat(BLOCK));
        let body = serde_json::json!({ "model": "m", "prompt": next_prompt }).to_string();
        let next = Chain::of(Shape::OllamaGenerate, body.as_bytes(), "s", "m", None).unwrap();
        assert_eq!(next.points[2], answer);
    }

    #[test]
    fn the_agents_shapes_read_their_turns() {
        let messages = Chain::of(
            Shape::Messages,
            br#"{"model":"m","system":[{"type":"text","text":"sys"}],"messages":[{"role":"user","content":"q"},
            {"role":"assistant","content":[{"type":"text","text":"a"},{"type":"tool_use","id":"t","name":"f","input":{}}]},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"out"}]}]}"#,
            "s",
            "m",
            None,
        )
        .unwrap();
        assert_eq!(messages.points.len(), 4);
        assert!(messages.follow_up);
        let responses = Chain::of(
            Shape::Responses,
            br#"{"model":"m","instructions":"sys","input":[{"role":"user","content":[{"type":"input_text","text":"q"}]},
            {"type":"message","role":"assistant","content":[{"type":"output_text","text":"a"}]},
            {"type":"function_call","name":"f","arguments":"{}","call_id":"c"},
            {"type":"function_call_output","call_id":"c","output":"out"}]}"#,
            "s",
            "m",
            None,
        )
        .unwrap();
        assert_eq!(responses.points.len(), 4);
        assert_eq!(responses.points[2], messages.points[2]);
        let text = Chain::of(
            Shape::Responses,
            br#"{"model":"m","input":"q"}"#,
            "s",
            "m",
            None,
        );
        assert_eq!(text.unwrap().points.len(), 1);
    }

    #[test]
    fn a_body_of_another_shape_has_no_chain() {
        assert!(Chain::of(Shape::OllamaChat, b"not json", "s", "m", None).is_none());
        assert!(Chain::of(Shape::OllamaChat, br#"{"model":"m"}"#, "s", "m", None).is_none());
        assert!(Chain::of(Shape::OllamaGenerate, br#"{"model":"m"}"#, "s", "m", None).is_none());
        assert!(Chain::of(Shape::OllamaChat, br#"{"messages":3}"#, "s", "m", None).is_none());
    }
}
