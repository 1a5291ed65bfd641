#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::Value;

use super::*;

fn view(body: &str) -> BodyView {
    BodyView::read(body.as_bytes()).unwrap()
}

#[test]
fn anything_after_the_value_is_not_json() {
    for body in [
        r#"{"model":"m"} x"#,
        r#"{"model":"m"}{"model":"n"}"#,
        r#"{"model":"m"}]"#,
        r#"{"model":"m"} 1"#,
        r#"{"model":"m""#,
        "not json",
        r#"{"model":"m",}"#,
    ] {
        assert_eq!(BodyView::read(body.as_bytes()), Err(NotJson), "{body:?}");
    }
    assert_eq!(view(" \r\n\t{\"model\":\"m\"} \n").model(), Some("m"));
    assert_eq!(view(""), BodyView::default());
    assert_eq!(view("  \n"), BodyView::default());
    assert!(!view("[1,2]").is_object());
    assert_eq!(view("[1,2]").model(), None);
}

#[test]
fn fields_are_read_as_go_reads_them() {
    let body = r#"{"model":"a","MODEL":"b","Model":null,"mod\u0065l":"c","model":null}"#;
    // A null leaves a string as it was: the last string wins.
    assert_eq!(view(body).model(), Some("c"));
    assert_eq!(view(r#"{"model":5}"#).model(), None);
    assert_eq!(view(r#"{"name":"n"}"#).model_or_name(), Some("n"));
    assert_eq!(
        view(r#"{"model":"","name":"n"}"#).model_or_name(),
        Some("n")
    );
    assert_eq!(
        view(r#"{"model":"m","name":"n"}"#).model_or_name(),
        Some("m")
    );
    let body = r#"{"INPUT":["a","b"],"Stream":false}"#;
    assert_eq!(view(body).input_count(body.as_bytes()), 2);
    assert_eq!(view(body).stream(body.as_bytes()), Some(false));
    // `stream` is a pointer: a later null clears it.
    let body = r#"{"stream":false,"stream":null}"#;
    assert_eq!(view(body).stream(body.as_bytes()), None);
    let body = r#"{"input":"one","prompt":"x"}"#;
    assert_eq!(view(body).input_count(body.as_bytes()), 1);
    let body = r#"{"prompt":"legacy"}"#;
    assert_eq!(view(body).input_count(body.as_bytes()), 1);
    let body = r#"{"input":[]}"#;
    assert_eq!(view(body).input_count(body.as_bytes()), 0);
    let body = r#"{"input":["a"],"input":null,"prompt":null}"#;
    assert_eq!(view(body).input_count(body.as_bytes()), 0);
    let body = r#"{"keep_alive":1,"a":{"keep_alive":2},"\u212Aeep_alive":3}"#;
    assert_eq!(view(body).keep_alive().len(), 2);
}

#[test]
fn the_user_field_is_read_down_its_path() {
    let body = r#"{"metadata":{"user_id":"x","USER_ID":"alice"},"user":7}"#;
    let at = |path: &[&str]| {
        let path: Vec<String> = path.iter().map(|s| (*s).to_owned()).collect();
        view(body).string_at(body.as_bytes(), &path)
    };
    assert_eq!(at(&["metadata", "user_id"]), Ok(Some("alice".to_owned())));
    assert_eq!(at(&["Metadata", "user_id"]), Ok(Some("alice".to_owned())));
    assert_eq!(at(&["user"]), Err(NotString));
    assert_eq!(at(&["user", "id"]), Ok(None));
    assert_eq!(at(&["absent"]), Ok(None));
}

#[test]
fn where_a_member_is_appended() {
    assert_eq!(view("{}").append_at(), Some((1, false)));
    assert_eq!(view(r#" {"a":1 } "#).append_at(), Some((7, true)));
    assert_eq!(view("[]").append_at(), None);
}

// The reference: a Go-semantics decoder over `serde_json::Value`, written apart from the
// scanner. The top level keeps duplicate keys (a `Value` map would fold them); nested
// objects are `Value` maps, looked up case-folded with the last match winning.

/// The top-level members of an object body, duplicates kept, in order.
struct Members(Vec<(String, Value)>);

impl<'de> serde::Deserialize<'de> for Members {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct All;
        impl<'de> Visitor<'de> for All {
            type Value = Members;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry::<String, Value>()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(All)
    }
}

/// A key as Go's `bytes.EqualFold` compares it with an ASCII field name.
fn go_fold(key: &str) -> String {
    key.chars()
        .map(|c| match c {
            '\u{212A}' => 'k',
            '\u{017F}' => 's',
            c => c.to_ascii_lowercase(),
        })
        .collect()
}

/// What the reference reads.
#[derive(Debug, PartialEq)]
struct Read {
    object: bool,
    model: Option<String>,
    model_or_name: Option<String>,
    stream: Option<bool>,
    inputs: u64,
    keep_alives: usize,
    user: Result<Option<String>, NotString>,
}

/// The deciding value of `field` among `members`, with Go's rule for `null`.
fn decide<'a>(members: &'a [(String, Value)], field: &str, null_clears: bool) -> Option<&'a Value> {
    let mut decided = None;
    for (key, value) in members {
        if go_fold(key) != field {
            continue;
        }
        match value {
            Value::Null if null_clears => decided = None,
            Value::Null => {}
            value => decided = Some(value),
        }
    }
    decided
}

fn lookup<'a>(object: &'a serde_json::Map<String, Value>, field: &str) -> Option<&'a Value> {
    object
        .iter()
        .filter(|(key, _)| go_fold(key) == field)
        .map(|(_, value)| value)
        .last()
}

/// The reference reading of `body`, or `None` when it is not one JSON value.
fn reference(body: &[u8], user_path: &[&str]) -> Option<Read> {
    let value: Value = serde_json::from_slice(body).ok().or_else(|| {
        // Only emptiness is not a value yet not an error.
        body.iter()
            .all(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
            .then_some(Value::Null)
    })?;
    let empty = Read {
        object: false,
        model: None,
        model_or_name: None,
        stream: None,
        inputs: 0,
        keep_alives: 0,
        user: Ok(None),
    };
    if !value.is_object() {
        return Some(empty);
    }
    let Members(members) = serde_json::from_slice(body).ok()?;
    let string = |value: Option<&Value>| value.and_then(Value::as_str).map(str::to_owned);
    let model = string(decide(&members, "model", false));
    let name = string(decide(&members, "name", false));
    let model_or_name = match &model {
        Some(model) if !model.is_empty() => Some(model.clone()),
        _ => name.or(model.clone()),
    };
    let inputs = match decide(&members, "input", true) {
        Some(Value::Array(items)) => items.len() as u64,
        Some(_) => 1,
        None => u64::from(decide(&members, "prompt", false).is_some()),
    };
    let mut user = members
        .iter()
        .filter(|(key, _)| go_fold(key) == user_path[0].to_ascii_lowercase())
        .map(|(_, value)| value)
        .last();
    for step in &user_path[1..] {
        user = user
            .and_then(Value::as_object)
            .and_then(|object| lookup(object, &step.to_ascii_lowercase()));
    }
    let user = match user {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text.clone())),
        Some(_) => Err(NotString),
    };
    Some(Read {
        object: true,
        model,
        model_or_name,
        stream: decide(&members, "stream", true).and_then(Value::as_bool),
        inputs,
        keep_alives: members
            .iter()
            .filter(|(key, _)| go_fold(key) == "keep_alive")
            .count(),
        user,
    })
}

/// The view's reading of `body`, in the reference's terms.
fn scanned(body: &[u8], user_path: &[&str]) -> Option<Read> {
    let view = BodyView::read(body).ok()?;
    let path: Vec<String> = user_path.iter().map(|s| (*s).to_owned()).collect();
    Some(Read {
        object: view.is_object(),
        model: view.model().map(str::to_owned),
        model_or_name: view.model_or_name().map(str::to_owned),
        stream: view.stream(body),
        inputs: view.input_count(body),
        keep_alives: view.keep_alive().len(),
        user: view.string_at(body, &path),
    })
}

/// Compares the view with the reference on `body`. A body whose numbers are beyond
/// `f64` is JSON that `Value` cannot hold: then only the check is compared.
pub(crate) fn agrees(body: &[u8]) {
    let user_path = ["metadata", "user_id"];
    let expected = reference(body, &user_path);
    let seen = scanned(body, &user_path);
    if expected.is_none() && seen.is_some() {
        let value_fails = serde_json::from_slice::<IgnoredAny>(body).is_ok();
        assert!(value_fails, "the view read {seen:?} from {body:?}");
        return;
    }
    assert_eq!(seen, expected, "{:?}", String::from_utf8_lossy(body));
}

fn key() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        r#""model""#,
        r#""MODEL""#,
        r#""Model""#,
        r#""mod\u0065l""#,
        r#""name""#,
        r#""NAME""#,
        r#""stream""#,
        r#""Stream""#,
        r#""input""#,
        r#""INPUT""#,
        r#""prompt""#,
        r#""keep_alive""#,
        r#""Keep_Alive""#,
        r#""\u212Aeep_alive""#,
        r#""metadata""#,
        r#""Metadata""#,
        r#""messages""#,
        r#""other""#,
        r#""models""#,
    ])
    .prop_map(str::to_owned)
}

fn leaf() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "null",
        "true",
        "false",
        "0",
        "-1.5e3",
        r#""m""#,
        r#""forbidden""#,
        r#""""#,
        r#""a\"b\\c\u00e9""#,
        r#""\ud83d\ude00""#,
        r#"["a","b"]"#,
        "[]",
        r#"{"user_id":"alice"}"#,
        r#"{"USER_ID":"bob","user_id":null}"#,
        r#"{"user_id":5}"#,
        r#"[{"role":"user","content":"hi"}]"#,
    ])
    .prop_map(str::to_owned)
}

fn whitespace() -> impl Strategy<Value = String> {
    prop::sample::select(vec!["", " ", "\n", "\t ", "\r\n"]).prop_map(str::to_owned)
}

fn body() -> impl Strategy<Value = Vec<u8>> {
    let member = (whitespace(), key(), whitespace(), leaf());
    let members = prop::collection::vec(member, 0..8);
    let tail = prop::sample::select(vec!["", " ", "\n", " x", "{}", "]", ",", "\"", " null"]);
    (whitespace(), members, tail).prop_map(|(lead, members, tail)| {
        let inner: Vec<String> = members
            .into_iter()
            .map(|(a, key, b, value)| format!("{a}{key}{b}:{value}"))
            .collect();
        format!("{lead}{{{}}}{tail}", inner.join(",")).into_bytes()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn the_view_reads_object_bodies_as_go_does(body in body()) {
        agrees(&body);
    }

    #[test]
    fn the_view_reads_any_bytes_as_go_does(body in prop::collection::vec(any::<u8>(), 0..64)) {
        agrees(&body);
    }

    #[test]
    fn the_view_reads_mutated_bodies_as_go_does(
        body in body(),
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let mut body = body;
        let index = at.index(body.len());
        body[index] = byte;
        agrees(&body);
    }
}
