//! Go's `encoding/json` scanner, reduced to what the fake needs: find the end of the first JSON
//! value of a body, or report the error with Go's exact text (`invalid character 'x' looking for
//! beginning of value`, `unexpected EOF`, ...), as `json.Decoder` does.

/// The end of the first value, which starts at `at`, or Go's error text.
pub(super) fn first_value(body: &[u8], at: usize) -> Result<usize, String> {
    scan_top(body, at).map_err(|error| error.message())
}

/// A syntax error as Go's scanner reports it.
#[derive(Debug)]
enum Syntax {
    Eof,
    Bad(u8, &'static str),
    Literal {
        byte: u8,
        word: &'static str,
        expected: u8,
    },
}

impl Syntax {
    fn message(&self) -> String {
        match self {
            Syntax::Eof => "unexpected EOF".to_owned(),
            Syntax::Bad(byte, context) => {
                format!("invalid character {} {context}", quote_char(*byte))
            }
            Syntax::Literal {
                byte,
                word,
                expected,
            } => format!(
                "invalid character {} in literal {word} (expecting {})",
                quote_char(*byte),
                quote_char(*expected)
            ),
        }
    }
}

// Go's `quoteChar`: the byte as a rune, in single quotes, escaped like strconv.Quote.
fn quote_char(byte: u8) -> String {
    let inner = match byte {
        b'\'' => "\\'".to_owned(),
        b'"' => "\"".to_owned(),
        b'\\' => "\\\\".to_owned(),
        b'\n' => "\\n".to_owned(),
        b'\r' => "\\r".to_owned(),
        b'\t' => "\\t".to_owned(),
        0x07 => "\\a".to_owned(),
        0x08 => "\\b".to_owned(),
        0x0b => "\\v".to_owned(),
        0x0c => "\\f".to_owned(),
        0x00..=0x1f | 0x7f => format!("\\x{byte:02x}"),
        0x80..=0xa0 | 0xad => format!("\\u{byte:04x}"),
        _ => char::from(byte).to_string(),
    };
    format!("'{inner}'")
}

pub(super) fn skip_space(body: &[u8], mut at: usize) -> usize {
    while matches!(body.get(at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        at += 1;
    }
    at
}

// The first top-level value; a scalar must be followed by space or the end (Go's stateEndTop).
fn scan_top(body: &[u8], at: usize) -> Result<usize, Syntax> {
    let end = scan_value(body, at)?;
    if !matches!(body[at], b'{' | b'[') {
        let after = skip_space(body, end);
        if let Some(&byte) = body.get(after) {
            return Err(Syntax::Bad(byte, "after top-level value"));
        }
    }
    Ok(end)
}

fn scan_value(body: &[u8], at: usize) -> Result<usize, Syntax> {
    let at = skip_space(body, at);
    match body.get(at) {
        None => Err(Syntax::Eof),
        Some(b'{') => scan_object(body, at + 1),
        Some(b'[') => scan_array(body, at + 1),
        Some(b'"') => scan_string(body, at + 1),
        Some(b'-' | b'0'..=b'9') => scan_number(body, at),
        Some(b't') => scan_literal(body, at, "true"),
        Some(b'f') => scan_literal(body, at, "false"),
        Some(b'n') => scan_literal(body, at, "null"),
        Some(&byte) => Err(Syntax::Bad(byte, "looking for beginning of value")),
    }
}

fn scan_object(body: &[u8], at: usize) -> Result<usize, Syntax> {
    let mut at = skip_space(body, at);
    if body.get(at) == Some(&b'}') {
        return Ok(at + 1);
    }
    loop {
        at = skip_space(body, at);
        at = match body.get(at) {
            None => return Err(Syntax::Eof),
            Some(b'"') => scan_string(body, at + 1)?,
            Some(&byte) => {
                return Err(Syntax::Bad(
                    byte,
                    "looking for beginning of object key string",
                ));
            }
        };
        at = skip_space(body, at);
        at = match body.get(at) {
            None => return Err(Syntax::Eof),
            Some(b':') => at + 1,
            Some(&byte) => return Err(Syntax::Bad(byte, "after object key")),
        };
        at = skip_space(body, scan_value(body, at)?);
        match body.get(at) {
            None => return Err(Syntax::Eof),
            Some(b',') => at += 1,
            Some(b'}') => return Ok(at + 1),
            Some(&byte) => return Err(Syntax::Bad(byte, "after object key:value pair")),
        }
    }
}

fn scan_array(body: &[u8], at: usize) -> Result<usize, Syntax> {
    let mut at = skip_space(body, at);
    if body.get(at) == Some(&b']') {
        return Ok(at + 1);
    }
    loop {
        at = skip_space(body, scan_value(body, at)?);
        match body.get(at) {
            None => return Err(Syntax::Eof),
            Some(b',') => at += 1,
            Some(b']') => return Ok(at + 1),
            Some(&byte) => return Err(Syntax::Bad(byte, "after array element")),
        }
    }
}

fn scan_string(body: &[u8], mut at: usize) -> Result<usize, Syntax> {
    loop {
        match body.get(at) {
            None => return Err(Syntax::Eof),
            Some(b'"') => return Ok(at + 1),
            Some(b'\\') => match body.get(at + 1) {
                None => return Err(Syntax::Eof),
                Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => at += 2,
                Some(b'u') => {
                    for offset in 2..6 {
                        match body.get(at + offset) {
                            None => return Err(Syntax::Eof),
                            Some(byte) if byte.is_ascii_hexdigit() => {}
                            Some(&byte) => {
                                return Err(Syntax::Bad(
                                    byte,
                                    "in \\u hexadecimal character escape",
                                ));
                            }
                        }
                    }
                    at += 6;
                }
                Some(&byte) => return Err(Syntax::Bad(byte, "in string escape code")),
            },
            Some(&byte) if byte < 0x20 => return Err(Syntax::Bad(byte, "in string literal")),
            Some(_) => at += 1,
        }
    }
}

fn scan_number(body: &[u8], mut at: usize) -> Result<usize, Syntax> {
    let digits = |body: &[u8], mut at: usize| {
        while body.get(at).is_some_and(u8::is_ascii_digit) {
            at += 1;
        }
        at
    };
    let need_digit = |at: usize, context: &'static str| match body.get(at) {
        None => Err(Syntax::Eof),
        Some(byte) if byte.is_ascii_digit() => Ok(()),
        Some(&byte) => Err(Syntax::Bad(byte, context)),
    };
    if body[at] == b'-' {
        at += 1;
        need_digit(at, "in numeric literal")?;
    }
    at = if body[at] == b'0' {
        at + 1
    } else {
        digits(body, at)
    };
    if body.get(at) == Some(&b'.') {
        need_digit(at + 1, "after decimal point in numeric literal")?;
        at = digits(body, at + 1);
    }
    if matches!(body.get(at), Some(b'e' | b'E')) {
        at += 1;
        if matches!(body.get(at), Some(b'+' | b'-')) {
            at += 1;
        }
        need_digit(at, "in exponent of numeric literal")?;
        at = digits(body, at);
    }
    Ok(at)
}

fn scan_literal(body: &[u8], at: usize, word: &'static str) -> Result<usize, Syntax> {
    for (offset, expected) in word.bytes().enumerate().skip(1) {
        match body.get(at + offset) {
            None => return Err(Syntax::Eof),
            Some(&byte) if byte == expected => {}
            Some(&byte) => {
                return Err(Syntax::Literal {
                    byte,
                    word,
                    expected,
                });
            }
        }
    }
    Ok(at + word.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(body: &str) -> String {
        match first_value(body.as_bytes(), 0) {
            Err(message) => message,
            Ok(end) => panic!("expected an error for {body:?}, got end {end}"),
        }
    }

    #[test]
    fn syntax_errors_read_like_go() {
        assert_eq!(
            error("x"),
            "invalid character 'x' looking for beginning of value"
        );
        assert_eq!(error("{\"model\":"), "unexpected EOF");
        assert_eq!(
            error("{model:1}"),
            "invalid character 'm' looking for beginning of object key string"
        );
        assert_eq!(error("{\"a\" 1}"), "invalid character '1' after object key");
        assert_eq!(
            error("{\"a\":1 \"b\"}"),
            "invalid character '\"' after object key:value pair"
        );
        assert_eq!(
            error("{\"a\":[1 2]}"),
            "invalid character '2' after array element"
        );
        assert_eq!(
            error("{\"a\":tru}"),
            "invalid character '}' in literal true (expecting 'e')"
        );
        assert_eq!(
            error("{\"a\":nul}"),
            "invalid character '}' in literal null (expecting 'l')"
        );
        assert_eq!(
            error("{\"a\":fals}"),
            "invalid character '}' in literal false (expecting 'e')"
        );
        assert_eq!(
            error("{\"a\":1.}"),
            "invalid character '}' after decimal point in numeric literal"
        );
        assert_eq!(
            error("{\"a\":\"\\q\"}"),
            "invalid character 'q' in string escape code"
        );
        assert_eq!(
            error("{\"a\":'x'}"),
            "invalid character '\\'' looking for beginning of value"
        );
        assert_eq!(error("1 2"), "invalid character '2' after top-level value");
        assert_eq!(first_value(b" {\"a\":1} trailing", 1), Ok(8));
        assert_eq!(
            first_value(b"[1, 2.5e3, true, null, \"\\u00e9\"]", 0),
            Ok(32)
        );
    }
}
