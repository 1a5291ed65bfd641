//! The `model` field of a `multipart/form-data` body (`POST /v1/audio/transcriptions`), read
//! strictly: oqp checks the allowlist and the budget against the model, so it must be the one
//! Ollama's form reader (Go's `mime/multipart`) takes, or the request is refused.
//!
//! Go's reader takes the first `model` value, decodes a quoted-printable part, accepts bare
//! `\n` line endings, folded header lines, RFC 2231 parameters (`name*=`) and a preamble,
//! and falls back to the URL query when the form has no `model`. Rather than follow each of
//! these, a body that uses any of them, or names `model` twice, is refused: what is accepted
//! has one reading. The body was read whole, within `proxy.max_request_body_mb`.

use std::ops::Range;

/// Why a form's model could not be read; the text is the client's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FormError {
    /// Not `multipart/form-data` with one usable boundary.
    #[error("the body must be multipart/form-data with a boundary")]
    NotMultipart,
    /// A query string, which Go's reader also looks in for `model`.
    #[error("no query string is accepted on this route")]
    Query,
    /// A framing or header oqp does not read the way Ollama would (see the module).
    #[error("the multipart body is malformed or uses an encoding oqp does not read")]
    Malformed,
    /// No `model` field, or more than one.
    #[error("the form must have exactly one `model` field")]
    Model,
}

/// The value of the one `model` field of `body`, given the request's `Content-Type` and query.
pub fn model(
    content_type: Option<&http::HeaderValue>,
    query: Option<&str>,
    body: &[u8],
) -> Result<String, FormError> {
    if query.is_some_and(|query| !query.is_empty()) {
        return Err(FormError::Query);
    }
    let boundary = content_type
        .and_then(|value| value.to_str().ok())
        .and_then(boundary)
        .ok_or(FormError::NotMultipart)?;
    let mut model = None;
    for part in parts(body, boundary.as_bytes())? {
        let Part { headers, value } = part;
        let disposition = headers_of(&body[headers])?;
        let Some(disposition) = disposition else {
            continue;
        };
        if disposition.name.as_deref() != Some("model") {
            continue;
        }
        if disposition.filename || disposition.encoded || model.is_some() {
            return Err(FormError::Model);
        }
        let value = std::str::from_utf8(&body[value]).map_err(|_| FormError::Malformed)?;
        model = Some(value.to_owned());
    }
    model
        .filter(|model| !model.is_empty())
        .ok_or(FormError::Model)
}

/// The boundary of a `multipart/form-data` content type (1 to 70 characters).
fn boundary(content_type: &str) -> Option<String> {
    let mut pieces = content_type.split(';');
    let kind = pieces.next()?.trim();
    if !kind.eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    let mut found = None;
    for piece in pieces {
        let (key, value) = piece.split_once('=')?;
        if key.trim().eq_ignore_ascii_case("boundary") {
            if found.is_some() {
                return None;
            }
            let value = value.trim();
            let value = match value.strip_prefix('"') {
                Some(quoted) => quoted.strip_suffix('"')?,
                None => value,
            };
            found = Some(value.to_owned());
        }
    }
    found.filter(|b| (1..=70).contains(&b.len()) && !b.contains(['"', '\\', '\r', '\n']))
}

/// One part: the byte ranges of its header block and of its value.
struct Part {
    headers: Range<usize>,
    value: Range<usize>,
}

/// The parts of `body`: it starts with the first delimiter (no preamble), every line break
/// in the framing is `\r\n`, and each `\r\n--boundary` is a delimiter.
fn parts(body: &[u8], boundary: &[u8]) -> Result<Vec<Part>, FormError> {
    let dash: Vec<u8> = [b"--".as_slice(), boundary].concat();
    let delimiter: Vec<u8> = [b"\r\n".as_slice(), &dash].concat();
    if !body.starts_with(&dash) {
        return Err(FormError::Malformed);
    }
    let mut at = dash.len();
    let mut parts = Vec::new();
    loop {
        // After a delimiter: `--` ends the body (an epilogue is ignored), else optional
        // padding and a line break.
        if body[at..].starts_with(b"--") {
            return Ok(parts);
        }
        while matches!(body.get(at), Some(b' ' | b'\t')) {
            at += 1;
        }
        if !body[at..].starts_with(b"\r\n") {
            return Err(FormError::Malformed);
        }
        at += 2;
        let headers_end = if body[at..].starts_with(b"\r\n") {
            at
        } else {
            at + find(&body[at..], b"\r\n\r\n").ok_or(FormError::Malformed)? + 2
        };
        let value_start = headers_end + 2;
        let value_end =
            value_start + find(&body[value_start..], &delimiter).ok_or(FormError::Malformed)?;
        parts.push(Part {
            headers: at..headers_end,
            value: value_start..value_end,
        });
        at = value_end + delimiter.len();
    }
}

/// What a part's `Content-Disposition` says of its field.
struct Disposition {
    /// `name`, for a `form-data` disposition.
    name: Option<String>,
    /// A `filename` parameter: a file, not a value.
    filename: bool,
    /// A `Content-Transfer-Encoding` header: Go decodes quoted-printable.
    encoded: bool,
}

/// Reads a part's header block (`Name: value` lines, each ending `\r\n`).
fn headers_of(block: &[u8]) -> Result<Option<Disposition>, FormError> {
    let block = std::str::from_utf8(block).map_err(|_| FormError::Malformed)?;
    let mut disposition: Option<Disposition> = None;
    let mut encoded = false;
    for line in block.split_terminator("\r\n") {
        if line.starts_with([' ', '\t']) {
            // A folded line continues the header above it.
            return Err(FormError::Malformed);
        }
        let (name, value) = line.split_once(':').ok_or(FormError::Malformed)?;
        let name = name.trim();
        if name.eq_ignore_ascii_case("content-transfer-encoding") {
            encoded = true;
        } else if name.eq_ignore_ascii_case("content-disposition") {
            if disposition.is_some() {
                return Err(FormError::Malformed);
            }
            disposition = Some(parse_disposition(value)?);
        }
    }
    Ok(disposition.map(|disposition| Disposition {
        encoded,
        ..disposition
    }))
}

/// `form-data; name="model"`: parameter names in any case, values a token or a quoted
/// string (backslash escapes read as Go does); a parameter given twice or in RFC 2231 form is
/// refused.
fn parse_disposition(value: &str) -> Result<Disposition, FormError> {
    let (kind, mut rest) = value.split_once(';').unwrap_or((value, ""));
    let form_data = kind.trim().eq_ignore_ascii_case("form-data");
    let mut seen: Vec<String> = Vec::new();
    let mut name = None;
    let mut filename = false;
    loop {
        rest = rest.trim_start_matches([' ', '\t', ';']);
        if rest.is_empty() {
            break;
        }
        let (key, after) = rest.split_once('=').ok_or(FormError::Malformed)?;
        let key = key.trim().to_ascii_lowercase();
        if key.is_empty() || key.ends_with('*') || seen.contains(&key) {
            return Err(FormError::Malformed);
        }
        let after = after.trim_start();
        let (parsed, left) = match after.strip_prefix('"') {
            Some(quoted) => quoted_string(quoted)?,
            None => {
                let end = after.find([';', ' ', '\t']).unwrap_or(after.len());
                (after[..end].to_owned(), &after[end..])
            }
        };
        match key.as_str() {
            "name" => name = Some(parsed),
            "filename" => filename = true,
            _ => {}
        }
        seen.push(key);
        rest = left;
    }
    Ok(Disposition {
        name: name.filter(|_| form_data),
        filename,
        encoded: false,
    })
}

/// A quoted string's value (after its opening quote) and what follows its closing quote.
fn quoted_string(text: &str) -> Result<(String, &str), FormError> {
    let mut value = String::new();
    let mut chars = text.char_indices();
    while let Some((index, c)) = chars.next() {
        match c {
            '"' => return Ok((value, &text[index + 1..])),
            '\\' => value.push(chars.next().ok_or(FormError::Malformed)?.1),
            c => value.push(c),
        }
    }
    Err(FormError::Malformed)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TYPE: &str = "multipart/form-data; boundary=xyz";

    fn read(body: &str) -> Result<String, FormError> {
        model(
            Some(&http::HeaderValue::from_static(TYPE)),
            None,
            body.as_bytes(),
        )
    }

    fn form(parts: &[(&str, &str)]) -> String {
        let mut body = String::new();
        for (headers, value) in parts {
            body.push_str(&format!("--xyz\r\n{headers}\r\n\r\n{value}\r\n"));
        }
        body + "--xyz--\r\n"
    }

    const MODEL: &str = "Content-Disposition: form-data; name=\"model\"";
    const FILE: &str = "Content-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav";

    #[test]
    fn reads_the_one_model_field_before_or_after_the_file() {
        assert_eq!(
            read(&form(&[(MODEL, "whisper"), (FILE, "RIFF\r\n--xy")])).unwrap(),
            "whisper"
        );
        assert_eq!(
            read(&form(&[(FILE, "RIFF"), (MODEL, "whisper")])).unwrap(),
            "whisper"
        );
        let quoted = "content-disposition: Form-Data; NAME=\"mod\\el\"";
        assert_eq!(read(&form(&[(quoted, "w")])).unwrap(), "w");
        let token = "Content-Disposition: form-data; name=model";
        assert_eq!(read(&form(&[(token, "w")])).unwrap(), "w");
        let quoted_boundary = model(
            Some(&http::HeaderValue::from_static(
                "multipart/form-data; boundary=\"xyz\"",
            )),
            None,
            form(&[(MODEL, "w")]).as_bytes(),
        );
        assert_eq!(quoted_boundary.unwrap(), "w");
    }

    #[test]
    fn refuses_every_form_with_another_reading() {
        let twice = form(&[(MODEL, "allowed"), (MODEL, "forbidden")]);
        let refused = [
            // Two models, none, an empty one, a model sent as a file.
            twice,
            form(&[(FILE, "RIFF")]),
            form(&[(MODEL, "")]),
            form(&[(&format!("{MODEL}; filename=\"m\""), "w")]),
            // Encodings Go decodes: quoted-printable, RFC 2231, folded headers.
            form(&[(
                &format!("{MODEL}\r\nContent-Transfer-Encoding: quoted-printable"),
                "wh=69sper",
            )]),
            form(&[("Content-Disposition: form-data; name*=utf-8''model", "w")]),
            form(&[("Content-Disposition: form-data;\r\n name=\"model\"", "w")]),
            form(&[(&format!("{MODEL}; name=\"other\""), "w")]),
            // Framing: a preamble, bare line feeds, a delimiter inside a value, no end.
            format!("preamble\r\n{}", form(&[(MODEL, "w")])),
            form(&[(MODEL, "w")]).replace("\r\n", "\n"),
            form(&[(MODEL, "w\r\n--xyzabc")]),
            "--xyz\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nw".to_owned(),
        ];
        for body in refused {
            assert!(read(&body).is_err(), "{body:?}");
        }
        let body = form(&[(MODEL, "w")]);
        assert_eq!(
            model(None, None, body.as_bytes()),
            Err(FormError::NotMultipart)
        );
        let json = http::HeaderValue::from_static("application/json");
        assert_eq!(
            model(Some(&json), None, body.as_bytes()),
            Err(FormError::NotMultipart)
        );
        let typed = http::HeaderValue::from_static(TYPE);
        assert_eq!(
            model(Some(&typed), Some("model=x"), body.as_bytes()),
            Err(FormError::Query)
        );
    }
}
