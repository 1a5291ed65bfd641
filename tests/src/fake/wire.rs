//! Response building blocks shared by the fake's handlers: the body type, the content types real
//! Ollama uses (reference §A.1), error bodies in the gin and OpenAI shapes, timestamps in Go's
//! RFC 3339 format, and the small deterministic hash behind digests and embeddings.

use std::convert::Infallible;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

/// The body of every response the fake sends.
pub(crate) type Body = UnsyncBoxBody<Bytes, Infallible>;

/// A finished response.
pub(crate) type Reply = Response<Body>;

/// gin's `c.JSON`: handler replies and handler errors.
pub(crate) const GIN_JSON: &str = "application/json; charset=utf-8";
/// OpenAI-layer JSON, and errors raised after a native stream was requested.
pub(crate) const PLAIN_JSON: &str = "application/json";
/// Native streams.
pub(crate) const NDJSON: &str = "application/x-ndjson";
/// OpenAI streams.
pub(crate) const EVENT_STREAM: &str = "text/event-stream";

/// A response with a complete body and an optional Content-Type.
pub(crate) fn full(
    status: StatusCode,
    content_type: Option<&'static str>,
    body: impl Into<Bytes>,
) -> Reply {
    let mut response = Response::new(Full::new(body.into()).boxed_unsync());
    *response.status_mut() = status;
    if let Some(content_type) = content_type {
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    }
    response
}

/// A response with no body and no Content-Type (Go's `c.Status`).
pub(crate) fn empty(status: StatusCode) -> Reply {
    full(status, None, Bytes::new())
}

/// A gin JSON reply: compact, `application/json; charset=utf-8`.
pub(crate) fn gin_json(status: StatusCode, value: &Value) -> Reply {
    full(status, Some(GIN_JSON), value.to_string())
}

/// A gin error reply `{"error": message}`.
pub(crate) fn gin_error(status: StatusCode, message: &str) -> Reply {
    gin_json(status, &json!({ "error": message }))
}

/// An OpenAI-layer JSON reply: `application/json`, body ending in a newline.
pub(crate) fn openai_json(status: StatusCode, value: &Value) -> Reply {
    full(status, Some(PLAIN_JSON), format!("{value}\n"))
}

/// An OpenAI error object; the type follows the status (400, 404, anything else).
pub(crate) fn openai_error(status: StatusCode, message: &str) -> Reply {
    let kind = match status.as_u16() {
        400 => "invalid_request_error",
        404 => "not_found_error",
        _ => "api_error",
    };
    let body = json!({
        "error": { "message": message, "type": kind, "param": null, "code": null }
    });
    openai_json(status, &body)
}

/// gin's reply to an unknown route.
pub(crate) fn route_not_found() -> Reply {
    full(
        StatusCode::NOT_FOUND,
        Some("text/plain"),
        "404 page not found",
    )
}

/// gin's reply to a known path called with the wrong method.
pub(crate) fn method_not_allowed() -> Reply {
    full(
        StatusCode::METHOD_NOT_ALLOWED,
        Some("text/plain"),
        "405 method not allowed",
    )
}

/// Maps a status code number to a `StatusCode`, falling back to 500 for nonsense.
pub(crate) fn status(code: u16) -> StatusCode {
    StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

/// Go's `time.RFC3339Nano` in UTC: up to nine fractional digits, trailing zeros trimmed, `Z`.
pub(crate) fn rfc3339(time: SystemTime) -> String {
    // humantime prints all nine digits; Go trims trailing zeros.
    let full = humantime::format_rfc3339_nanos(time).to_string();
    let Some(body) = full.strip_suffix('Z') else {
        return full;
    };
    let trimmed = body.trim_end_matches('0').trim_end_matches('.');
    format!("{trimmed}Z")
}

/// Seconds since the Unix epoch (OpenAI's `created`).
pub(crate) fn unix_seconds(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// A duration in integer nanoseconds, at least 1: metric fields are `omitempty` in Ollama, so a
/// zero would make them vanish from the final object.
pub(crate) fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// A stable 64-bit hash of a string (FNV-1a, then one splitmix round to spread the bits).
pub(crate) fn hash64(text: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    splitmix(hash)
}

/// One step of splitmix64: a cheap, well-mixed pseudo-random sequence from a seed.
pub(crate) fn splitmix(state: u64) -> u64 {
    let mut z = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A uuid-looking reference id, as ollama.com puts in its errors.
pub(crate) fn reference_id() -> String {
    let a: u128 = rand::random();
    let hex = format!("{a:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// Rough token count of a text: its whitespace-separated words, at least one.
pub(crate) fn token_count(text: &str) -> usize {
    text.split_whitespace().count().max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_trims_trailing_zeros() {
        let t = UNIX_EPOCH + Duration::new(1_761_498_924, 97_767_000);
        assert_eq!(rfc3339(t), "2025-10-26T17:15:24.097767Z");
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let leap = UNIX_EPOCH + Duration::new(951_782_400, 1);
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00.000000001Z");
    }

    #[test]
    fn openai_error_types_follow_status() {
        let reply = openai_error(StatusCode::BAD_GATEWAY, "x");
        assert_eq!(reply.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(reply.headers()[CONTENT_TYPE], PLAIN_JSON);
    }
}
