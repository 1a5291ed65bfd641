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

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::IgnoredAny;
use xxhash_rust::xxh3::{Xxh3, xxh3_64_with_seed};

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

/// What a route's body says, as far as the chain needs it.
#[derive(Deserialize, Default)]
#[serde(default)]
struct Body<'a> {
    #[serde(borrow)]
    messages: Vec<Message<'a>>,
    system: Option<Content<'a>>,
    #[serde(borrow)]
    instructions: Option<Cow<'a, str>>,
    input: Option<Input<'a>>,
    prompt: Option<Content<'a>>,
    options: Option<serde_json::Map<String, serde_json::Value>>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(rename = "type", borrow)]
    kind: Option<Cow<'a, str>>,
    content: Option<Content<'a>>,
    output: Option<Content<'a>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Parts(Vec<Part<'a>>),
    Other(IgnoredAny),
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Part<'a> {
    #[serde(borrow)]
    text: Option<Cow<'a, str>>,
    content: Option<Content<'a>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Input<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Items(Vec<Message<'a>>),
    Other(IgnoredAny),
}

impl Content<'_> {
    fn append(&self, out: &mut String) {
        match self {
            Content::Text(text) => out.push_str(text),
            Content::Parts(parts) => {
                for part in parts {
                    if let Some(text) = &part.text {
                        out.push_str(text);
                    }
                    if let Some(content) = &part.content {
                        content.append(out);
                    }
                }
            }
            Content::Other(_) => {}
        }
    }

    fn text(&self) -> String {
        let mut out = String::new();
        self.append(&mut out);
        out
    }
}

/// One canonical message: a role tag and its text.
struct Turn {
    role: u8,
    text: String,
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
    /// The chain of `body` on a route of `shape`, for the tenant `scope` (empty when
    /// conversations are shared across keys) and `model` (normalised). `None` when the body
    /// is not JSON of the route's shape or holds nothing to cache.
    pub fn of(
        shape: Shape,
        body: &[u8],
        scope: &str,
        model: &str,
        session: Option<&str>,
    ) -> Option<Chain> {
        let parsed: Body<'_> = serde_json::from_slice(body).ok()?;
        let options = options_hash(model, parsed.options.as_ref());
        let seed = xxh3_64_with_seed(scope.as_bytes(), options);
        let session = session.map(|name| xxh3_64_with_seed(name.as_bytes(), seed ^ 0x5e55));
        if shape.is_prompt() {
            let mut text = String::new();
            if let Some(system) = &parsed.system {
                system.append(&mut text);
            }
            if let Some(prompt) = &parsed.prompt {
                prompt.append(&mut text);
            }
            if text.is_empty() {
                return None;
            }
            let (points, tail) = blocks(seed, 0, text.as_bytes());
            let tokens = u32::try_from(text.len())
                .unwrap_or(u32::MAX)
                .div_ceil(BYTES_PER_TOKEN);
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
        let turns = turns(shape, &parsed);
        if turns.is_empty() {
            return None;
        }
        let mut points = Vec::with_capacity(turns.len());
        let mut hash = seed;
        let mut tokens = 0u32;
        let mut root = None;
        let mut follow_up = false;
        for turn in &turns {
            hash = turn_hash(hash, turn.role, &turn.text);
            tokens = tokens.saturating_add(turn_tokens(&turn.text));
            follow_up |= turn.role == b'a';
            points.push(Point { hash, tokens });
            if root.is_none() && turn.role == b'u' {
                root = Some(hash);
            }
        }
        Some(Chain {
            root: root.unwrap_or(hash),
            points,
            tokens,
            follow_up,
            session,
            options,
            shape,
            tail: Vec::new(),
        })
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

/// The hash of the model and the reload options a request sets.
fn options_hash(model: &str, options: Option<&serde_json::Map<String, serde_json::Value>>) -> u64 {
    let mut hasher = Xxh3::with_seed(0x0a11);
    hasher.update(model.as_bytes());
    if let Some(options) = options {
        for name in RELOAD_OPTIONS {
            if let Some(value) = options.get(name) {
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

/// The canonical messages of a chat-shaped body.
fn turns(shape: Shape, body: &Body<'_>) -> Vec<Turn> {
    let mut turns = Vec::with_capacity(body.messages.len() + 1);
    if let Some(system) = &body.system {
        turns.push(Turn {
            role: b's',
            text: system.text(),
        });
    }
    if let Some(instructions) = &body.instructions {
        turns.push(Turn {
            role: b's',
            text: instructions.clone().into_owned(),
        });
    }
    if shape == Shape::Responses {
        match &body.input {
            Some(Input::Text(text)) => turns.push(Turn {
                role: b'u',
                text: text.clone().into_owned(),
            }),
            Some(Input::Items(items)) => {
                for item in items {
                    match item.kind.as_deref() {
                        None | Some("message") => turns.push(Turn {
                            role: role_tag(&item.role),
                            text: item.content.as_ref().map(Content::text).unwrap_or_default(),
                        }),
                        Some("function_call_output") => turns.push(Turn {
                            role: b't',
                            text: item.output.as_ref().map(Content::text).unwrap_or_default(),
                        }),
                        // Tool calls and reasoning come back from the answer as items the
                        // stream does not spell out as text: not part of the prefix.
                        Some(_) => {}
                    }
                }
            }
            Some(Input::Other(_)) | None => {}
        }
        return turns;
    }
    for message in &body.messages {
        turns.push(Turn {
            role: role_tag(&message.role),
            text: message
                .content
                .as_ref()
                .map(Content::text)
                .unwrap_or_default(),
        });
    }
    turns
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
