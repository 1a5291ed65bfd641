//! A small JSON scanner that finds byte spans without building values: the
//! members of an object and the elements of an array, so that a body can be
//! edited by splicing and everything else stays byte-identical.
//!
//! The scanner checks the structure it walks (quotes, colons, commas,
//! matching nesting depth) but not the contents of the values it skips:
//! callers that must not touch malformed input validate the whole body with
//! `serde_json` first. It never panics and never recurses, whatever the input.

use std::borrow::Cow;
use std::ops::Range;

/// One `"key": value` member of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The key, quotes included.
    pub key: Range<usize>,
    /// The value.
    pub value: Range<usize>,
}

/// The layout of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    /// The opening `{`.
    pub open: usize,
    /// The closing `}`.
    pub close: usize,
    /// The members, in document order (duplicates included).
    pub members: Vec<Member>,
}

impl Object {
    /// The member that Go's `encoding/json` (and therefore Ollama) would
    /// read for `field`: the last one whose key matches case-insensitively.
    pub fn get(&self, bytes: &[u8], field: &str) -> Option<&Member> {
        self.members
            .iter()
            .rev()
            .find(|member| key_matches(bytes, member, field))
    }

    /// Every member whose key Go would read as `field`.
    pub fn all<'a>(
        &'a self,
        bytes: &'a [u8],
        field: &'a str,
    ) -> impl Iterator<Item = &'a Member> + 'a {
        self.members
            .iter()
            .filter(move |member| key_matches(bytes, member, field))
    }
}

/// The layout of the object that is the whole of `bytes` (surrounding
/// whitespace allowed); `None` for anything else.
pub fn top_object(bytes: &[u8]) -> Option<Object> {
    let open = skip_ws(bytes, 0);
    let object = object_at(bytes, open)?;
    (skip_ws(bytes, object.close + 1) == bytes.len()).then_some(object)
}

/// The layout of the object starting at `open` (which must be a `{`).
pub fn object_at(bytes: &[u8], open: usize) -> Option<Object> {
    let mut members = Vec::new();
    let close = each_member(bytes, open, |member| members.push(member))?;
    Some(Object {
        open,
        close,
        members,
    })
}

/// Calls `visit` with each member of the object starting at `open` (which
/// must be a `{`), in document order, without collecting them; the index of
/// the closing `}`, or `None` (possibly after some members were visited)
/// when the object is not well formed.
pub fn each_member(bytes: &[u8], open: usize, mut visit: impl FnMut(Member)) -> Option<usize> {
    if bytes.get(open) != Some(&b'{') {
        return None;
    }
    let mut at = skip_ws(bytes, open + 1);
    if bytes.get(at) == Some(&b'}') {
        return Some(at);
    }
    loop {
        let key_end = string_end(bytes, at)?;
        let colon = skip_ws(bytes, key_end);
        if bytes.get(colon) != Some(&b':') {
            return None;
        }
        let value_start = skip_ws(bytes, colon + 1);
        let value_end = value_end(bytes, value_start)?;
        visit(Member {
            key: at..key_end,
            value: value_start..value_end,
        });
        at = skip_ws(bytes, value_end);
        match bytes.get(at) {
            Some(b',') => at = skip_ws(bytes, at + 1),
            Some(b'}') => return Some(at),
            _ => return None,
        }
    }
}

/// The element spans of the array occupying exactly `span`.
pub fn array_elements(bytes: &[u8], span: Range<usize>) -> Option<Vec<Range<usize>>> {
    let mut elements = Vec::new();
    each_element(bytes, span, |element| elements.push(element))?;
    Some(elements)
}

/// Calls `visit` with each element span of the array occupying exactly
/// `span`, without collecting them; `None` (possibly after some elements
/// were visited) when it is not a well-formed array.
pub fn each_element(
    bytes: &[u8],
    span: Range<usize>,
    mut visit: impl FnMut(Range<usize>),
) -> Option<()> {
    let bytes = bytes.get(..span.end)?;
    if bytes.get(span.start) != Some(&b'[') {
        return None;
    }
    let mut at = skip_ws(bytes, span.start + 1);
    if bytes.get(at) == Some(&b']') {
        return (at + 1 == span.end).then_some(());
    }
    loop {
        let end = value_end(bytes, at)?;
        visit(at..end);
        at = skip_ws(bytes, end);
        match bytes.get(at) {
            Some(b',') => at = skip_ws(bytes, at + 1),
            Some(b']') => return (at + 1 == span.end).then_some(()),
            _ => return None,
        }
    }
}

/// The decoded text of the string value at `span` (quotes included),
/// borrowed when it has no escapes; `None` if it is not a valid string.
pub fn text(bytes: &[u8], span: Range<usize>) -> Option<Cow<'_, str>> {
    let raw = bytes.get(span)?;
    if raw.len() < 2 || raw[0] != b'"' || raw[raw.len() - 1] != b'"' {
        return None;
    }
    let inner = &raw[1..raw.len() - 1];
    if inner.contains(&b'\\') {
        serde_json::from_slice::<String>(raw).ok().map(Cow::Owned)
    } else {
        std::str::from_utf8(inner).ok().map(Cow::Borrowed)
    }
}

/// The decoded text of the key of `member`; `None` if it is not valid.
pub fn key<'a>(bytes: &'a [u8], member: &Member) -> Option<Cow<'a, str>> {
    text(bytes, member.key.clone())
}

/// Whether `member`'s key names `field` the way Go's `encoding/json`
/// matches struct fields: exactly, or equal under simple case folding.
/// `field` must be lower-case ASCII.
pub fn key_matches(bytes: &[u8], member: &Member, field: &str) -> bool {
    key(bytes, member).is_some_and(|key| fold_eq(&key, field))
}

/// Case-insensitive comparison as Go's `bytes.EqualFold` does it against an
/// ASCII lower-case name: besides ASCII letters, the Kelvin sign folds to
/// `k` and the long s to `s`.
pub fn fold_eq(key: &str, lower_ascii: &str) -> bool {
    let mut expected = lower_ascii.chars();
    for c in key.chars() {
        let folded = match c {
            '\u{212A}' => 'k',
            '\u{017F}' => 's',
            c => c.to_ascii_lowercase(),
        };
        if expected.next() != Some(folded) {
            return false;
        }
    }
    expected.next().is_none()
}

/// The index after the value that starts at `at`.
pub fn value_end(bytes: &[u8], at: usize) -> Option<usize> {
    match *bytes.get(at)? {
        b'"' => string_end(bytes, at),
        b'{' | b'[' => container_end(bytes, at),
        b',' | b'}' | b']' | b':' => None,
        _ => {
            let len = bytes[at..]
                .iter()
                .position(|b| matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                .unwrap_or(bytes.len() - at);
            Some(at + len)
        }
    }
}

/// The index after the string whose opening quote is at `at`.
fn string_end(bytes: &[u8], at: usize) -> Option<usize> {
    if bytes.get(at) != Some(&b'"') {
        return None;
    }
    let mut i = at + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => return Some(i + 1),
            // UTF-8 continuation bytes are >= 0x80, so a byte-wise walk
            // never mistakes part of a character for a quote or backslash.
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
    None
}

/// The index after the object or array opened at `at`, counting depth
/// without recursion.
fn container_end(bytes: &[u8], at: usize) -> Option<usize> {
    let mut stack: Vec<u8> = Vec::new();
    let mut i = at;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                i = string_end(bytes, i)?;
                continue;
            }
            b'{' => stack.push(b'}'),
            b'[' => stack.push(b']'),
            close @ (b'}' | b']') => {
                if stack.pop() != Some(close) {
                    return None;
                }
                if stack.is_empty() {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// The first index at or after `at` that is not JSON whitespace.
pub fn skip_ws(bytes: &[u8], mut at: usize) -> usize {
    while matches!(bytes.get(at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        at += 1;
    }
    at
}

/// Whether `raw` is a JSON array of numbers (what a vector must be before it
/// is cached or relayed from the cache).
pub fn is_vector(raw: &[u8]) -> bool {
    array_elements(raw, 0..raw.len())
        .is_some_and(|elements| elements.into_iter().all(|span| is_number(&raw[span])))
}

/// Whether `text` is exactly one JSON number.
pub fn is_number(text: &[u8]) -> bool {
    let mut i = 0;
    let digits = |i: &mut usize| {
        let start = *i;
        while text.get(*i).is_some_and(u8::is_ascii_digit) {
            *i += 1;
        }
        *i > start
    };
    if text.get(i) == Some(&b'-') {
        i += 1;
    }
    match text.get(i) {
        Some(b'0') => i += 1,
        Some(b'1'..=b'9') => {
            digits(&mut i);
        }
        _ => return false,
    }
    if text.get(i) == Some(&b'.') {
        i += 1;
        if !digits(&mut i) {
            return false;
        }
    }
    if matches!(text.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(text.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        if !digits(&mut i) {
            return false;
        }
    }
    i == text.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts<'a>(body: &'a str, object: &Object) -> Vec<(&'a str, &'a str)> {
        object
            .members
            .iter()
            .map(|m| (&body[m.key.clone()], &body[m.value.clone()]))
            .collect()
    }

    #[test]
    fn finds_top_level_members_only() {
        let body = r#" { "a" : {"keep_alive":1, "b":[1,{"c":"}"}]}, "s":"x\"}\\" ,"n":-1.5e3 }
"#;
        let object = top_object(body.as_bytes()).unwrap();
        assert_eq!(
            texts(body, &object),
            vec![
                (r#""a""#, r#"{"keep_alive":1, "b":[1,{"c":"}"}]}"#),
                (r#""s""#, r#""x\"}\\""#),
                (r#""n""#, "-1.5e3"),
            ]
        );
        assert!(object.get(body.as_bytes(), "keep_alive").is_none());
    }

    #[test]
    fn rejects_non_objects_and_garbage() {
        for body in [
            "",
            "[1,2]",
            "1",
            "{",
            "{\"a\"}",
            "{\"a\":1,}",
            "{} x",
            "{\"a\":[}",
        ] {
            assert!(top_object(body.as_bytes()).is_none(), "{body:?}");
        }
        assert_eq!(top_object(b"{}").unwrap().members.len(), 0);
        assert_eq!(top_object(b" \n{ \t}\r\n").unwrap().close, 5);
    }

    #[test]
    fn keys_match_like_go() {
        let body = r#"{"Model":"a","mod\u0065l":"b","KEEP_ALIVE":1,"\u212Aeep_alive":2}"#;
        let object = top_object(body.as_bytes()).unwrap();
        let model = object.get(body.as_bytes(), "model").unwrap();
        assert_eq!(&body[model.value.clone()], r#""b""#);
        assert_eq!(object.all(body.as_bytes(), "keep_alive").count(), 2);
        assert!(fold_eq("ſtream", "stream"));
        assert!(!fold_eq("models", "model"));
    }

    #[test]
    fn splits_arrays() {
        let body = r#"[ [1,2] , "a,]" ,3,{"x":[]} ]"#;
        let elements = array_elements(body.as_bytes(), 0..body.len()).unwrap();
        let parts: Vec<&str> = elements.iter().map(|r| &body[r.clone()]).collect();
        assert_eq!(parts, vec!["[1,2]", r#""a,]""#, "3", r#"{"x":[]}"#]);
        assert_eq!(array_elements(b"[ ]", 0..3).unwrap().len(), 0);
        assert!(array_elements(b"[1,]", 0..4).is_none());
    }
}
