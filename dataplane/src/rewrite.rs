//! Request and response body rewriting: pure functions over bytes, no I/O.
//!
//! - [`insert_keep_alive`] applies the keep_alive policy by splicing one
//!   member into (or one value out of) a JSON object, so that every other
//!   byte of the client's body reaches Ollama unchanged: numbers keep their
//!   spelling (`1.0`, `1e-7`), escapes stay escapes, key order and whitespace
//!   are kept. (The reference re-serialised the whole body, turning raw UTF-8
//!   into `\uXXXX` and renormalising floats; we do not.)
//! - [`model_of`] reads the top-level `model` for routing.
//! - [`openai`] translates `/v1/embeddings` to `/api/embed` and back.
//!
//! Field names are matched the way Ollama's Go `encoding/json` matches them:
//! case-insensitively, the last occurrence winning (see [`scan::Object::get`]).
//! A body with `"Keep_Alive": 0` therefore already has a keep_alive.

pub mod openai;
pub mod scan;

use bytes::{BufMut, Bytes, BytesMut};
use serde::de::IgnoredAny;

use crate::policy::KeepAlive;

pub use openai::{
    EncodingFormat, OpenAiError, openai_embed_request, openai_embed_response, openai_error,
    openai_error_from_ollama,
};

/// The field this module inserts.
const KEEP_ALIVE: &str = "keep_alive";

/// Applies the keep_alive policy to a request body.
///
/// Returns the rewritten body, or `None` when the original bytes must be
/// forwarded as they are: no default configured, the client's own value kept
/// ([`KeepAlive::replacement`] decides), or a body that is not a valid JSON
/// object (empty, malformed, an array, a scalar).
///
/// A missing field is inserted as the last member (`,"keep_alive":<default>`
/// right after the last value, or `"keep_alive":<default>` inside `{}`); a
/// replaced value replaces the value span of every member Ollama would read
/// as keep_alive. Nothing else changes: the result is the original
/// with one range replaced.
pub fn insert_keep_alive(body: &[u8], keep_alive: &KeepAlive) -> Option<Bytes> {
    let default = keep_alive.default_json.as_deref()?;
    // Never splice an invalid literal into a client's body.
    serde_json::from_str::<IgnoredAny>(default).ok()?;
    serde_json::from_slice::<IgnoredAny>(body).ok()?;
    let object = scan::top_object(body)?;

    let existing: Vec<_> = object
        .all(body, KEEP_ALIVE)
        .map(|member| member.value.clone())
        .collect();
    if existing.is_empty() {
        let (at, insert) = match object.members.last() {
            Some(last) => (last.value.end, format!(",\"{KEEP_ALIVE}\":{default}")),
            None => (object.open + 1, format!("\"{KEEP_ALIVE}\":{default}")),
        };
        return Some(splice(body, &[(at..at, insert.as_bytes())]));
    }
    // Ollama reads the last member of the name; the policy decides from that value.
    let effective = existing.last().and_then(|span| body.get(span.clone()))?;
    let replacement = keep_alive.replacement(effective)?;
    let edits: Vec<_> = existing
        .into_iter()
        .map(|span| (span, replacement.as_bytes()))
        .collect();
    Some(splice(body, &edits))
}

/// The top-level `model` string of a JSON object body, as Ollama would read
/// it; `None` if there is none or the body is not an object.
///
/// Cheap: one structural pass, no value is built but the model string. The
/// nested values it skips are not validated (Ollama rejects such a body
/// anyway, whatever it is routed to).
pub fn model_of(body: &[u8]) -> Option<String> {
    let object = scan::top_object(body)?;
    let member = object.get(body, "model")?;
    serde_json::from_slice::<String>(body.get(member.value.clone())?).ok()
}

/// `body` with each range replaced by its bytes. Ranges must be sorted and
/// disjoint.
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
