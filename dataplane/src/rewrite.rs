//! Request and response body rewriting: pure functions over bytes, no I/O.
//!
//! - [`insert_keep_alive`] applies the keep_alive policy by splicing one
//!   member into (or one value out of) a JSON object, so that every other
//!   byte of the client's body reaches Ollama unchanged: numbers keep their
//!   spelling (`1.0`, `1e-7`), escapes stay escapes, key order and whitespace
//!   are kept. (The reference re-serialised the whole body, turning raw UTF-8
//!   into `\uXXXX` and renormalising floats; we do not.)
//! - [`openai`] translates `/v1/embeddings` to `/api/embed` and back;
//!   [`openai_host`] sends such a request to a host of kind `openai` as
//!   `/v1/embeddings` again and reads its answer as `/api/embed`'s.
//!
//! What a body says is read once, by [`crate::view::BodyView`], with Ollama's
//! key rules: a body with `"Keep_Alive": 0` already has a keep_alive.

pub mod openai;
pub mod openai_host;

pub use crate::view::scan;

use bytes::{BufMut, Bytes, BytesMut};
use serde::de::IgnoredAny;

use crate::policy::KeepAlive;
use crate::view::BodyView;

pub use openai::{
    EncodingFormat, OpenAiError, openai_embed_request, openai_embed_response, openai_error,
    openai_error_from_ollama,
};

/// The name of the field this module inserts, as it is written before its value.
const MEMBER: &[u8] = b"\"keep_alive\":";

/// Applies the keep_alive policy to a request body, read as `view`.
///
/// Returns the rewritten body, or `None` when the original bytes must be
/// forwarded as they are: no default configured, the client's own value kept
/// ([`KeepAlive::replacement`] decides), or a body that is not a JSON object
/// (empty, an array, a scalar).
///
/// A missing field is inserted as the last member (`,"keep_alive":<default>`
/// right after the last value, or `"keep_alive":<default>` inside `{}`); a
/// replaced value replaces the value span of every member Ollama would read
/// as keep_alive. Nothing else changes: the result is the original
/// with one range replaced.
pub fn insert_keep_alive(body: &[u8], view: &BodyView, keep_alive: &KeepAlive) -> Option<Bytes> {
    let default = keep_alive.default_json.as_deref()?;
    // Never splice an invalid literal into a client's body.
    serde_json::from_str::<IgnoredAny>(default).ok()?;
    let (at, comma) = view.append_at()?;
    let existing = view.keep_alive();
    if existing.is_empty() {
        // Spliced in three pieces at one point: no string formatted for every request.
        let comma: &[u8] = if comma { b"," } else { b"" };
        let member = [comma, MEMBER, default.as_bytes()].map(|bytes| (at..at, bytes));
        return Some(splice(body, &member));
    }
    // Ollama reads the last member of the name; the policy decides from that value.
    let effective = existing.last().and_then(|span| body.get(span.clone()))?;
    let replacement = keep_alive.replacement(effective)?;
    let edits: Vec<_> = existing
        .iter()
        .map(|span| (span.clone(), replacement.as_bytes()))
        .collect();
    Some(splice(body, &edits))
}

/// The body read as `view` with its model set to `model`: the value of every member Ollama
/// would read as `model` replaced (or one inserted as the last member), every other byte
/// kept. `None` when the body is not a JSON object.
pub fn replace_model(body: &[u8], view: &BodyView, model: &str) -> Option<Bytes> {
    let (at, comma) = view.append_at()?;
    let value = serde_json::Value::String(model.to_owned()).to_string();
    let existing = view.model_members();
    if existing.is_empty() {
        let comma = if comma { "," } else { "" };
        let insert = format!("{comma}\"model\":{value}");
        return Some(splice(body, &[(at..at, insert.as_bytes())]));
    }
    let edits: Vec<_> = existing
        .iter()
        .map(|span| (span.clone(), value.as_bytes()))
        .collect();
    Some(splice(body, &edits))
}

/// The field a llama-server reads as the slot to run a request on.
pub const ID_SLOT: &str = "id_slot";

/// The body with its `id_slot` set to `slot`: the value of every top-level member of that
/// exact name (as llama-server reads it) replaced, or one inserted as the last member, every
/// other byte kept. `None` when the body is not one JSON object.
pub fn set_slot(body: &[u8], slot: u32) -> Option<Bytes> {
    let object = scan::top_object(body)?;
    let value = slot.to_string();
    let existing: Vec<_> = object
        .members
        .iter()
        .filter(|member| scan::key(body, member).is_some_and(|key| key == ID_SLOT))
        .map(|member| member.value.clone())
        .collect();
    if existing.is_empty() {
        let (at, comma) = match object.members.last() {
            Some(last) => (last.value.end, ","),
            None => (object.open + 1, ""),
        };
        let insert = format!("{comma}\"{ID_SLOT}\":{value}");
        return Some(splice(body, &[(at..at, insert.as_bytes())]));
    }
    let edits: Vec<_> = existing
        .iter()
        .map(|span| (span.clone(), value.as_bytes()))
        .collect();
    Some(splice(body, &edits))
}

/// `body` with each range replaced by its bytes. Ranges must be sorted and
/// disjoint; empty ranges at one point insert their bytes in order.
pub(crate) fn splice(body: &[u8], edits: &[(std::ops::Range<usize>, &[u8])]) -> Bytes {
    let extra: usize = edits.iter().map(|(_, bytes)| bytes.len()).sum();
    let mut out = BytesMut::with_capacity(body.len() + extra);
    let mut at = 0;
    for (range, bytes) in edits {
        out.put_slice(&body[at..range.start]);
        out.put_slice(bytes);
        at = range.end;
    }
    out.put_slice(&body[at..]);
    out.freeze()
}

#[cfg(test)]
mod tests;
