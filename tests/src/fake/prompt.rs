//! The prompt a request's runner reads, as the fake's prompt cache compares it (reference
//! §5): the chat template rendered as `role\ntext\n` per message (string content, the text of
//! content blocks, tool results), the system prompt first; a prompt route's system and prompt
//! as they are. The answer is appended the way the next turn sends it back, so that a
//! follow-up's prompt begins with what its slot holds.

use serde_json::{Map, Value};

/// A request's prompt as its runner reads it.
#[derive(Debug, Clone)]
pub(crate) struct Prompt {
    pub text: String,
    /// A chat template (the answer is appended as an assistant message) rather than a raw
    /// prompt (the answer continues it).
    pub chat: bool,
}

impl Prompt {
    /// What the slot holds after answering `answer`.
    pub(crate) fn with_answer(&self, answer: &str) -> String {
        if self.chat {
            format!("{}assistant\n{answer}\n", self.text)
        } else {
            format!("{}{answer}", self.text)
        }
    }
}

/// The text of a content value: a string, or the text of its blocks (tool results
/// included).
pub(crate) fn text_of(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|part| {
                let mut out = part
                    .get("text")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                out.push_str(&text_of(part.get("content")));
                out
            })
            .collect(),
        _ => String::new(),
    }
}

fn role(role: Option<&Value>) -> &str {
    match role.and_then(Value::as_str) {
        Some("system" | "developer") => "system",
        Some("assistant" | "model") => "assistant",
        Some("user") => "user",
        _ => "tool",
    }
}

fn render(out: &mut String, role: &str, text: &str) {
    out.push_str(role);
    out.push('\n');
    out.push_str(text);
    out.push('\n');
}

/// A chat request's rendered messages, after `system`.
fn chat(system: Option<String>, messages: Option<&Value>) -> Prompt {
    let mut text = String::new();
    if let Some(system) = system.filter(|system| !system.is_empty()) {
        render(&mut text, "system", &system);
    }
    for message in messages.and_then(Value::as_array).into_iter().flatten() {
        render(
            &mut text,
            role(message.get("role")),
            &text_of(message.get("content")),
        );
    }
    Prompt { text, chat: true }
}

/// `/api/chat` (`chat`) or `/api/generate`.
pub(crate) fn native(request: &Map<String, Value>, is_chat: bool) -> Prompt {
    if is_chat {
        return chat(None, request.get("messages"));
    }
    let mut text = text_of(request.get("system"));
    text.push_str(&text_of(request.get("prompt")));
    Prompt { text, chat: false }
}

/// `/v1/chat/completions` (`is_chat`) or `/v1/completions`.
pub(crate) fn openai(request: &Map<String, Value>, is_chat: bool) -> Prompt {
    if is_chat {
        return chat(None, request.get("messages"));
    }
    Prompt {
        text: text_of(request.get("prompt")),
        chat: false,
    }
}

/// `/v1/messages`, or `/v1/responses` (`responses`).
pub(crate) fn agents(request: &Map<String, Value>, responses: bool) -> Prompt {
    if !responses {
        return chat(
            Some(text_of(request.get("system"))),
            request.get("messages"),
        );
    }
    let mut text = String::new();
    if let Some(instructions) = request.get("instructions").and_then(Value::as_str) {
        render(&mut text, "system", instructions);
    }
    match request.get("input") {
        Some(Value::String(input)) => render(&mut text, "user", input),
        Some(Value::Array(items)) => {
            for item in items {
                match item.get("type").and_then(Value::as_str) {
                    None | Some("message") => render(
                        &mut text,
                        role(item.get("role")),
                        &text_of(item.get("content")),
                    ),
                    Some("function_call_output") => {
                        render(&mut text, "tool", &text_of(item.get("output")));
                    }
                    Some(_) => {}
                }
            }
        }
        _ => {}
    }
    Prompt { text, chat: true }
}
