//! Go-flavoured request decoding. Ollama reads bodies with Go's `encoding/json` through gin, so
//! clients see Go's error texts: `missing request body`, `invalid character 'x' looking for
//! beginning of value`, `unexpected EOF`, `json: cannot unmarshal ...`, and for `keep_alive` the
//! `time.ParseDuration` messages (reference §A.1, §A.5). This module reproduces those texts.
//!
//! Like Go's `json.Decoder`, only the first value is read: bytes after a closing `}` are ignored.

use std::time::Duration;

use serde_json::{Map, Value};

use syntax::{first_value, skip_space};

mod syntax;

/// The Go type of a request field, for `cannot unmarshal` messages.
#[derive(Debug, Clone, Copy)]
pub(crate) enum GoType {
    Str,
    Bool,
    Int,
    Float,
    /// A slice; the name is Go's (`[]api.Message`).
    Slice(&'static str),
    /// A map or struct; the name is Go's.
    Object(&'static str),
}

/// A Go request struct: its qualified name (`api.GenerateRequest`) and the fields whose types
/// are checked.
#[derive(Debug)]
pub(crate) struct Shape {
    pub name: &'static str,
    pub fields: &'static [(&'static str, GoType)],
}

/// Why a body could not be decoded.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum DecodeError {
    /// Empty or blank body: Go's `io.EOF`, which handlers turn into `missing request body`.
    Empty,
    /// Anything else, with Go's message.
    Invalid(String),
}

/// What `keep_alive` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeepAlive {
    /// Zero: unload after this request.
    Unload,
    /// Negative: keep loaded forever.
    Forever,
    /// Keep loaded this long.
    For(Duration),
}

/// Decodes a request body as Go would into the struct `shape`.
pub(crate) fn decode(body: &[u8], shape: &Shape) -> Result<Map<String, Value>, DecodeError> {
    let start = skip_space(body, 0);
    if start == body.len() {
        return Err(DecodeError::Empty);
    }
    let end = first_value(body, start).map_err(DecodeError::Invalid)?;
    let value: Value = serde_json::from_slice(&body[start..end])
        .map_err(|error| DecodeError::Invalid(error.to_string()))?;
    let Value::Object(map) = value else {
        return Err(DecodeError::Invalid(format!(
            "json: cannot unmarshal {} into Go value of type {}",
            json_kind(&value),
            shape.name
        )));
    };
    for (field, go_type) in shape.fields {
        if let Some(value) = map.get(*field) {
            check_type(value, *go_type).map_err(|found| {
                DecodeError::Invalid(type_message(&found, shape.name, field, *go_type))
            })?;
        }
    }
    Ok(map)
}

/// Parses a `keep_alive` value as Ollama's `api.Duration` does; `None` when absent or null.
pub(crate) fn keep_alive(value: Option<&Value>) -> Result<Option<KeepAlive>, String> {
    let nanos = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Number(number)) => number.as_f64().map_or(0.0, |seconds| seconds * 1e9) as i128,
        Some(Value::String(text)) => parse_duration(text)?,
        Some(Value::Bool(_)) => return Err("Unsupported type: 'bool'".to_owned()),
        Some(Value::Array(_)) => return Err("Unsupported type: '[]interface {}'".to_owned()),
        Some(Value::Object(_)) => {
            return Err("Unsupported type: 'map[string]interface {}'".to_owned());
        }
    };
    Ok(Some(match nanos {
        0 => KeepAlive::Unload,
        n if n < 0 => KeepAlive::Forever,
        n => KeepAlive::For(Duration::from_nanos(u64::try_from(n).unwrap_or(u64::MAX))),
    }))
}

/// Go's `time.ParseDuration`, returning nanoseconds, with Go's error texts.
pub(crate) fn parse_duration(text: &str) -> Result<i128, String> {
    let invalid = || format!("time: invalid duration {}", go_quote(text));
    let (negative, mut rest) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    if rest == "0" {
        return Ok(0);
    }
    if rest.is_empty() {
        return Err(invalid());
    }
    let mut total: f64 = 0.0;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number = &rest[..digits];
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return Err(invalid());
        }
        let value: f64 = number.parse().map_err(|_| invalid())?;
        rest = &rest[digits..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let unit = &rest[..unit_end];
        let scale = match unit {
            "" => return Err(format!("time: missing unit in duration {}", go_quote(text))),
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            other => {
                return Err(format!(
                    "time: unknown unit {} in duration {}",
                    go_quote(other),
                    go_quote(text)
                ));
            }
        };
        total += value * scale;
        rest = &rest[unit_end..];
    }
    let nanos = total as i128;
    Ok(if negative { -nanos } else { nanos })
}

fn go_quote(text: &str) -> String {
    format!("{text:?}")
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

// Returns what Go would name the offending value (`number`, `number 1.5`, `string`, ...).
fn check_type(value: &Value, go_type: GoType) -> Result<(), String> {
    let fits = match (go_type, value) {
        (_, Value::Null) => true,
        (GoType::Str, Value::String(_))
        | (GoType::Bool, Value::Bool(_))
        | (GoType::Float, Value::Number(_))
        | (GoType::Slice(_), Value::Array(_))
        | (GoType::Object(_), Value::Object(_)) => true,
        (GoType::Int, Value::Number(number)) => {
            if number.is_i64() || number.is_u64() {
                true
            } else {
                return Err(format!("number {number}"));
            }
        }
        _ => false,
    };
    if fits {
        Ok(())
    } else {
        Err(json_kind(value).to_owned())
    }
}

fn type_message(found: &str, shape: &str, field: &str, go_type: GoType) -> String {
    let go_name = match go_type {
        GoType::Str => "string",
        GoType::Bool => "bool",
        GoType::Int => "int",
        GoType::Float => "float64",
        GoType::Slice(name) | GoType::Object(name) => name,
    };
    let short = shape.rsplit('.').next().unwrap_or(shape);
    format!("json: cannot unmarshal {found} into Go struct field {short}.{field} of type {go_name}")
}

/// A `float32` as Go's `encoding/json` prints it: the shortest digits that read back as the
/// same `float32`, in plain decimal for magnitudes in [1e-6, 1e21) and as `d.ddde±x` outside
/// (`1e-7`, `3.4028235e+38`), as Ollama writes embedding vectors.
pub(crate) fn float32(x: f32) -> String {
    if x == 0.0 {
        return if x.is_sign_negative() { "-0" } else { "0" }.to_owned();
    }
    // `{:e}` has the shortest round-trip digits: `-1.2345679e-2`.
    let scientific = format!("{:e}", x.abs());
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if x < 0.0 { "-" } else { "" };
    let abs = x.abs();
    if !(1e-6..1e21).contains(&abs) {
        let (first, rest) = digits.split_at(1);
        let fraction = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exponent_sign = if exponent < 0 { '-' } else { '+' };
        return format!("{sign}{first}{fraction}e{exponent_sign}{}", exponent.abs());
    }
    // Plain decimal: the point sits after `exponent + 1` digits.
    let point = exponent + 1;
    let body = if point <= 0 {
        format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
    } else if point as usize >= digits.len() {
        format!("{digits}{}", "0".repeat(point as usize - digits.len()))
    } else {
        let (whole, fraction) = digits.split_at(point as usize);
        format!("{whole}.{fraction}")
    };
    format!("{sign}{body}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: Shape = Shape {
        name: "api.GenerateRequest",
        fields: &[
            ("model", GoType::Str),
            ("stream", GoType::Bool),
            ("dimensions", GoType::Int),
        ],
    };

    fn error(body: &str) -> String {
        match decode(body.as_bytes(), &SHAPE) {
            Err(DecodeError::Invalid(message)) => message,
            other => panic!("expected an error for {body:?}, got {other:?}"),
        }
    }

    #[test]
    fn float32_prints_as_go_does() {
        for (x, go) in [
            (0.1f32, "0.1"),
            (1.0, "1"),
            (-2.5, "-2.5"),
            (123_456_789.0, "123456790"),
            (0.000001, "0.000001"),
            (1e-7, "1e-7"),
            (-1.5e-10, "-1.5e-10"),
            (1e21, "1e+21"),
            (1e20, "100000000000000000000"),
            (0.000_012_345, "0.000012345"),
            (-0.0, "-0"),
        ] {
            assert_eq!(float32(x), go, "{x:e}");
        }
    }

    #[test]
    fn decoding_reads_the_first_value_only() {
        assert_eq!(decode(b"  \n", &SHAPE), Err(DecodeError::Empty));
        assert_eq!(error("{\"model\":"), "unexpected EOF");
        assert!(decode(b"{\"model\":\"m\"} trailing", &SHAPE).is_ok());
    }

    #[test]
    fn type_errors_name_the_go_field() {
        assert_eq!(
            error("[]"),
            "json: cannot unmarshal array into Go value of type api.GenerateRequest"
        );
        assert_eq!(
            error("{\"model\":1}"),
            "json: cannot unmarshal number into Go struct field GenerateRequest.model of type string"
        );
        assert_eq!(
            error("{\"stream\":\"yes\"}"),
            "json: cannot unmarshal string into Go struct field GenerateRequest.stream of type bool"
        );
        assert_eq!(
            error("{\"dimensions\":1.5}"),
            "json: cannot unmarshal number 1.5 into Go struct field GenerateRequest.dimensions of type int"
        );
    }

    #[test]
    fn keep_alive_follows_api_duration() {
        let parse =
            |text: &str| keep_alive(Some(&serde_json::from_str(text).unwrap_or(Value::Null)));
        assert_eq!(parse("0"), Ok(Some(KeepAlive::Unload)));
        assert_eq!(parse("0.0"), Ok(Some(KeepAlive::Unload)));
        assert_eq!(parse("-1.0"), Ok(Some(KeepAlive::Forever)));
        assert_eq!(parse("\"0\""), Ok(Some(KeepAlive::Unload)));
        assert_eq!(parse("\"-1m\""), Ok(Some(KeepAlive::Forever)));
        assert_eq!(
            parse("3600.0"),
            Ok(Some(KeepAlive::For(Duration::from_secs(3600))))
        );
        assert_eq!(
            parse("\"1h30m\""),
            Ok(Some(KeepAlive::For(Duration::from_secs(5400))))
        );
        assert_eq!(
            parse("\"500ms\""),
            Ok(Some(KeepAlive::For(Duration::from_millis(500))))
        );
        assert_eq!(
            parse("\"300\""),
            Err("time: missing unit in duration \"300\"".to_owned())
        );
        assert_eq!(
            parse("\"5x\""),
            Err("time: unknown unit \"x\" in duration \"5x\"".to_owned())
        );
        assert_eq!(parse("\"\""), Err("time: invalid duration \"\"".to_owned()));
        assert_eq!(parse("true"), Err("Unsupported type: 'bool'".to_owned()));
        assert_eq!(parse("null"), Ok(None));
    }
}
