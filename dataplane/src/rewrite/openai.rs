//! The OpenAI-compatible `/v1/embeddings` endpoint, translated to Ollama's
//! `/api/embed` and back, the way Ollama's own `/v1` middleware does it
//! (reference §A.8), so that auth, the queue and the embedding cache see a
//! native request.
//!
//! Fixes over the reference proxy (§7.3): usage is mapped from Ollama's
//! `prompt_eval_count` instead of always 0, `encoding_format: "base64"` (the
//! openai-python default) is honoured, `model` is echoed as requested, and
//! errors come back in OpenAI's error shape rather than Ollama's.
//!
//! Bodies produced here end with a newline, as Ollama's OpenAI layer writes
//! them, and are meant to be sent as `application/json`.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use http::StatusCode;
use serde_json::{Map, Value, json};

use super::scan;

/// How `/v1/embeddings` returns vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EncodingFormat {
    /// A JSON array of numbers (the default).
    #[default]
    Float,
    /// A base64 string of the little-endian f32 values.
    Base64,
}

/// A `/v1/embeddings` request or response that cannot be translated; answer
/// it with [`OpenAiError::body`] and [`OpenAiError::status`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct OpenAiError {
    /// The HTTP status to answer with.
    pub status: StatusCode,
    /// The human-readable message.
    pub message: String,
}

impl OpenAiError {
    fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    fn bad_upstream(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_GATEWAY,
            message: message.into(),
        }
    }

    /// The error in OpenAI's shape (see [`openai_error`]).
    pub fn body(&self) -> Bytes {
        openai_error(self.status, &self.message)
    }
}

/// Translates a `/v1/embeddings` body into an `/api/embed` body.
///
/// `model` is required; `input` is a string (`""` becomes `[""]`, as in
/// Ollama) or a non-empty array of strings (token arrays are refused);
/// `encoding_format` is `float` or `base64`, any case, default float;
/// `dimensions` is passed through. Other OpenAI fields (`user`, …) are
/// dropped, as Ollama's middleware drops them.
pub fn openai_embed_request(body: &[u8]) -> Result<(Bytes, EncodingFormat), OpenAiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|error| OpenAiError::bad_request(format!("invalid request body: {error}")))?;
    let Value::Object(fields) = value else {
        return Err(OpenAiError::bad_request(
            "request body must be a JSON object",
        ));
    };
    let field = |name: &str| last_field(&fields, name);

    let model = match field("model") {
        Some(Value::String(model)) if !model.is_empty() => model.clone(),
        Some(Value::String(_)) | None | Some(Value::Null) => {
            return Err(OpenAiError::bad_request(
                "you must provide a model parameter",
            ));
        }
        Some(_) => return Err(OpenAiError::bad_request("model must be a string")),
    };
    let input = match field("input") {
        Some(Value::String(text)) if text.is_empty() => json!([""]),
        Some(Value::String(text)) => Value::String(text.clone()),
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(OpenAiError::bad_request("invalid input"));
        }
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => {
            Value::Array(items.clone())
        }
        Some(Value::Array(_)) => {
            return Err(OpenAiError::bad_request(
                "invalid input: token arrays are not supported; send a string or an array of strings",
            ));
        }
        _ => return Err(OpenAiError::bad_request("invalid input")),
    };
    let format = match field("encoding_format") {
        None | Some(Value::Null) => EncodingFormat::Float,
        Some(Value::String(text)) if text.is_empty() || text.eq_ignore_ascii_case("float") => {
            EncodingFormat::Float
        }
        Some(Value::String(text)) if text.eq_ignore_ascii_case("base64") => EncodingFormat::Base64,
        Some(other) => {
            let shown = other
                .as_str()
                .map_or_else(|| other.to_string(), str::to_owned);
            return Err(OpenAiError::bad_request(format!(
                "Invalid value for 'encoding_format' = {shown}. Supported values: ['float', 'base64']."
            )));
        }
    };

    let mut embed = Map::new();
    embed.insert("model".to_owned(), Value::String(model));
    embed.insert("input".to_owned(), input);
    match field("dimensions") {
        None | Some(Value::Null) => {}
        Some(Value::Number(n)) if n.is_u64() => {
            embed.insert("dimensions".to_owned(), Value::Number(n.clone()));
        }
        Some(_) => {
            return Err(OpenAiError::bad_request(
                "dimensions must be a non-negative integer",
            ));
        }
    }
    let bytes = serde_json::to_vec(&Value::Object(embed))
        .map_err(|error| OpenAiError::bad_request(error.to_string()))?;
    Ok((Bytes::from(bytes), format))
}

/// Wraps a successful `/api/embed` response into a `/v1/embeddings` one:
/// `{"object":"list","data":[{"object":"embedding","embedding":…,"index":i}…],
/// "model":<as requested>,"usage":{"prompt_tokens":n,"total_tokens":n}}`
/// with `n` = Ollama's `prompt_eval_count` (0 when absent, e.g. for an
/// answer served whole from the cache).
///
/// Float vectors keep Ollama's number text exactly; base64 vectors are the
/// little-endian bytes of each value parsed as f32. A body that is not an
/// embed response is a 502.
pub fn openai_embed_response(
    ollama_body: &[u8],
    format: EncodingFormat,
    requested_model: &str,
) -> Result<Bytes, OpenAiError> {
    let unexpected = || OpenAiError::bad_upstream("upstream returned an unexpected embed response");
    let object = scan::top_object(ollama_body).ok_or_else(unexpected)?;
    let embeddings = object
        .get(ollama_body, "embeddings")
        .ok_or_else(unexpected)?;
    let vectors =
        scan::array_elements(ollama_body, embeddings.value.clone()).ok_or_else(unexpected)?;
    let tokens = match object.get(ollama_body, "prompt_eval_count") {
        Some(member) => serde_json::from_slice::<u64>(&ollama_body[member.value.clone()])
            .map_err(|_| unexpected())?,
        None => 0,
    };

    let model = serde_json::to_string(requested_model).map_err(|_| unexpected())?;
    let mut out = Vec::with_capacity(ollama_body.len() + 64 * vectors.len() + 128);
    out.extend_from_slice(br#"{"object":"list","data":["#);
    for (index, span) in vectors.iter().enumerate() {
        if index > 0 {
            out.push(b',');
        }
        out.extend_from_slice(br#"{"object":"embedding","embedding":"#);
        match format {
            EncodingFormat::Float => {
                let raw = &ollama_body[span.clone()];
                // Validate: a vector is an array of numbers.
                serde_json::from_slice::<Vec<f64>>(raw).map_err(|_| unexpected())?;
                out.extend_from_slice(raw);
            }
            EncodingFormat::Base64 => {
                let floats = f32_values(ollama_body, span.clone()).ok_or_else(unexpected)?;
                out.push(b'"');
                out.extend_from_slice(STANDARD.encode(floats).as_bytes());
                out.push(b'"');
            }
        }
        out.extend_from_slice(format!(r#","index":{index}}}"#).as_bytes());
    }
    out.extend_from_slice(
        format!(
            r#"],"model":{model},"usage":{{"prompt_tokens":{tokens},"total_tokens":{tokens}}}}}"#
        )
        .as_bytes(),
    );
    out.push(b'\n');
    Ok(Bytes::from(out))
}

/// An OpenAI error body:
/// `{"error":{"message":…,"type":…,"param":null,"code":null}}` and a
/// newline, the type following the status as Ollama maps it (400
/// `invalid_request_error`, 404 `not_found_error`, anything else `api_error`).
pub fn openai_error(status: StatusCode, message: &str) -> Bytes {
    let kind = match status.as_u16() {
        400 => "invalid_request_error",
        404 => "not_found_error",
        _ => "api_error",
    };
    let body = json!({
        "error": { "message": message, "type": kind, "param": null, "code": null }
    });
    Bytes::from(format!("{body}\n"))
}

/// Converts an Ollama (or oqp) error body `{"error":"…"}` into the OpenAI
/// shape. A body already in that shape (`{"error":{"message":…}}`, from an
/// engine of kind `openai`) is kept as it is. A body without a string
/// `error` contributes its text, or the status's reason when it is empty.
pub fn openai_error_from_ollama(status: StatusCode, body: &[u8]) -> Bytes {
    let message = match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(fields)) => match last_field(&fields, "error") {
            Some(Value::String(message)) => Some(message.clone()),
            Some(Value::Object(error)) if error.get("message").is_some_and(Value::is_string) => {
                return Bytes::copy_from_slice(body);
            }
            _ => None,
        },
        _ => None,
    };
    let message = message.unwrap_or_else(|| {
        let text = String::from_utf8_lossy(body).trim().to_owned();
        if text.is_empty() {
            status.canonical_reason().unwrap_or("error").to_owned()
        } else {
            text
        }
    });
    openai_error(status, &message)
}

/// The value Go would read for `name`: the last key equal under case folding.
/// (`serde_json`'s map keeps one value per exact key, in first-seen order.)
fn last_field<'a>(fields: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    fields
        .iter()
        .rev()
        .find(|(key, _)| scan::fold_eq(key, name))
        .map(|(_, value)| value)
}

/// The little-endian f32 bytes of the number array at `span`, each number
/// parsed from its text straight to the nearest f32 (no f64 detour).
fn f32_values(bytes: &[u8], span: std::ops::Range<usize>) -> Option<Vec<u8>> {
    let elements = scan::array_elements(bytes, span)?;
    let mut out = Vec::with_capacity(elements.len() * 4);
    for element in elements {
        let text = std::str::from_utf8(&bytes[element]).ok()?;
        // JSON numbers only: Rust's parser also takes "inf" and "NaN".
        if !text.starts_with(|c: char| c == '-' || c.is_ascii_digit()) {
            return None;
        }
        let value: f32 = text.parse().ok()?;
        out.extend_from_slice(&value.to_le_bytes());
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(bytes: &[u8]) -> Value {
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn translates_requests() {
        let (body, format) = openai_embed_request(
            br#"{"input":["a","b"],"model":"nomic","encoding_format":"BASE64","dimensions":64,"user":"u"}"#,
        )
        .unwrap();
        assert_eq!(format, EncodingFormat::Base64);
        assert_eq!(
            &body[..],
            br#"{"model":"nomic","input":["a","b"],"dimensions":64}"#
        );
        let (body, format) = openai_embed_request(br#"{"model":"m","input":""}"#).unwrap();
        assert_eq!(format, EncodingFormat::Float);
        assert_eq!(json(&body), serde_json::json!({"model":"m","input":[""]}));
        let (body, _) = openai_embed_request(
            r#"{"model":"m","input":"héllo","encoding_format":"Float"}"#.as_bytes(),
        )
        .unwrap();
        assert_eq!(json(&body)["input"], "héllo");
    }

    #[test]
    fn refuses_bad_requests_in_openai_shape() {
        for body in [
            &br#"{"input":"a"}"#[..],
            br#"{"model":"m","input":[]}"#,
            br#"{"model":"m","input":[1,2,3]}"#,
            br#"{"model":"m","input":[[1,2]]}"#,
            br#"{"model":"m"}"#,
            br#"{"model":"m","input":"a","encoding_format":"int8"}"#,
            br#"{"model":"m","input":"a","dimensions":-3}"#,
            b"not json",
            b"[1]",
        ] {
            let error = openai_embed_request(body).unwrap_err();
            assert_eq!(error.status, StatusCode::BAD_REQUEST, "{error}");
            let shape = json(&error.body());
            assert_eq!(shape["error"]["type"], "invalid_request_error");
            assert_eq!(shape["error"]["param"], Value::Null);
        }
        let error = openai_embed_request(br#"{"model":"m","input":"a","encoding_format":"int8"}"#)
            .unwrap_err();
        assert_eq!(
            error.message,
            "Invalid value for 'encoding_format' = int8. Supported values: ['float', 'base64']."
        );
    }

    const OLLAMA: &[u8] = br#"{"model":"nomic","embeddings":[[0.1,-2.5e-7,1.0],[0.33333334,0,-1]],"total_duration":5,"load_duration":1,"prompt_eval_count":7}"#;

    #[test]
    fn wraps_float_responses_keeping_number_text() {
        let body = openai_embed_response(OLLAMA, EncodingFormat::Float, "Nomic").unwrap();
        assert!(body.ends_with(b"}\n"));
        assert_eq!(
            std::str::from_utf8(&body).unwrap().trim_end(),
            r#"{"object":"list","data":[{"object":"embedding","embedding":[0.1,-2.5e-7,1.0],"index":0},{"object":"embedding","embedding":[0.33333334,0,-1],"index":1}],"model":"Nomic","usage":{"prompt_tokens":7,"total_tokens":7}}"#
        );
    }

    #[test]
    fn base64_round_trips_to_the_f32_vector() {
        let body = openai_embed_response(OLLAMA, EncodingFormat::Base64, "nomic").unwrap();
        let value = json(&body);
        let expected: [[f32; 3]; 2] = [[0.1, -2.5e-7, 1.0], [0.333_333_34, 0.0, -1.0]];
        for (index, vector) in expected.iter().enumerate() {
            let item = &value["data"][index];
            assert_eq!(item["index"], index);
            let bytes = STANDARD
                .decode(item["embedding"].as_str().unwrap())
                .unwrap();
            let decoded: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(&decoded[..], &vector[..]);
        }
        assert_eq!(value["usage"]["total_tokens"], 7);
    }

    #[test]
    fn usage_defaults_to_zero_and_empty_lists_are_lists() {
        let body = openai_embed_response(
            br#"{"model":"m","embeddings":[]}"#,
            EncodingFormat::Float,
            "m",
        )
        .unwrap();
        let value = json(&body);
        assert_eq!(value["data"], serde_json::json!([]));
        assert_eq!(value["usage"]["prompt_tokens"], 0);
        for bad in [&b"{}"[..], br#"{"embeddings":[["x"]]}"#, b"null"] {
            let error = openai_embed_response(bad, EncodingFormat::Float, "m").unwrap_err();
            assert_eq!(error.status, StatusCode::BAD_GATEWAY);
        }
        assert!(
            openai_embed_response(br#"{"embeddings":[["x"]]}"#, EncodingFormat::Base64, "m")
                .is_err()
        );
    }

    #[test]
    fn errors_follow_openai_types() {
        let not_found = openai_error_from_ollama(
            StatusCode::NOT_FOUND,
            br#"{"error":"model \"x\" not found, try pulling it first"}"#,
        );
        assert_eq!(
            json(&not_found),
            serde_json::json!({"error":{"message":"model \"x\" not found, try pulling it first","type":"not_found_error","param":null,"code":null}})
        );
        let busy = json(&openai_error_from_ollama(
            StatusCode::SERVICE_UNAVAILABLE,
            br#"{"error":"queue full","request_id":"r1"}"#,
        ));
        assert_eq!(busy["error"]["type"], "api_error");
        assert_eq!(busy["error"]["message"], "queue full");
        let plain = json(&openai_error_from_ollama(StatusCode::BAD_GATEWAY, b""));
        assert_eq!(plain["error"]["message"], "Bad Gateway");
        let text = json(&openai_error_from_ollama(
            StatusCode::BAD_REQUEST,
            b"oops\n",
        ));
        assert_eq!(text["error"]["message"], "oops");
        assert_eq!(text["error"]["type"], "invalid_request_error");
        // An engine's own OpenAI error is passed on as it came.
        let engine = br#"{"error":{"code":400,"message":"\"input\" must not be empty","type":"invalid_request_error"}}"#;
        assert_eq!(
            openai_error_from_ollama(StatusCode::BAD_REQUEST, engine),
            engine.as_slice()
        );
    }
}
