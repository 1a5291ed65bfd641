use std::sync::Arc;

use proptest::prelude::*;
use serde_json::{Map, Value};

use super::*;

/// The rewrite as the request path makes it: the body read once, then spliced.
fn insert_keep_alive(body: &[u8], keep_alive: &KeepAlive) -> Option<Bytes> {
    let view = BodyView::read(body).ok()?;
    super::insert_keep_alive(body, &view, keep_alive)
}

/// The model the view reads.
fn model_of(body: &[u8]) -> Option<String> {
    BodyView::read(body).ok()?.model().map(str::to_owned)
}

fn policy(default: Option<&str>, override_client: bool) -> KeepAlive {
    KeepAlive {
        default_json: default.map(Arc::from),
        override_client,
        max: crate::policy::DEFAULT_KEEP_ALIVE_MAX,
        bounded: false,
    }
}

fn insert(body: &str) -> Option<String> {
    insert_keep_alive(body.as_bytes(), &policy(Some(r#""5m""#), false))
        .map(|bytes| String::from_utf8(bytes.to_vec()).unwrap())
}

fn replace(body: &str) -> Option<String> {
    insert_keep_alive(body.as_bytes(), &policy(Some("-1"), true))
        .map(|bytes| String::from_utf8(bytes.to_vec()).unwrap())
}

#[test]
fn inserts_without_touching_other_bytes() {
    let cases = [
        (
            r#"{"model":"m","prompt":"hi","stream":false}"#,
            r#"{"model":"m","prompt":"hi","stream":false,"keep_alive":"5m"}"#,
        ),
        (
            r#"{"x":1.0,"y":1e-7,"z":-0.0,"big":12345678901234567890123}"#,
            r#"{"x":1.0,"y":1e-7,"z":-0.0,"big":12345678901234567890123,"keep_alive":"5m"}"#,
        ),
        (
            r#"{"p":"caf\u00e9 \ud83d\ude00","q":"café 😀","r":"\"}\\"}"#,
            r#"{"p":"caf\u00e9 \ud83d\ude00","q":"café 😀","r":"\"}\\","keep_alive":"5m"}"#,
        ),
        (
            r#"{"z":1,"a":2,"m":3}"#,
            r#"{"z":1,"a":2,"m":3,"keep_alive":"5m"}"#,
        ),
        (
            r#"{"options":{"keep_alive":1},"messages":[{"keep_alive":2}]}"#,
            r#"{"options":{"keep_alive":1},"messages":[{"keep_alive":2}],"keep_alive":"5m"}"#,
        ),
        (
            "{\n  \"model\": \"m\",\n  \"input\": [\"a\", \"b\"]\n}\n",
            "{\n  \"model\": \"m\",\n  \"input\": [\"a\", \"b\"],\"keep_alive\":\"5m\"\n}\n",
        ),
        ("{}", r#"{"keep_alive":"5m"}"#),
        (" { \n } ", " {\"keep_alive\":\"5m\" \n } "),
        (
            "\t{\"a\" : null }\r\n",
            "\t{\"a\" : null,\"keep_alive\":\"5m\" }\r\n",
        ),
    ];
    for (body, expected) in cases {
        assert_eq!(insert(body).as_deref(), Some(expected), "{body}");
    }
}

#[test]
fn keeps_client_values_of_any_type() {
    for value in [
        r#""10m""#, "0", "0.0", "-1.0", "3600.0", "null", "-1", r#""-1m""#, "true",
    ] {
        let body = format!(r#"{{"model":"m","keep_alive":{value}}}"#);
        assert_eq!(insert(&body), None, "{body}");
    }
    // Go matches field names case-insensitively: this is a keep_alive.
    assert_eq!(insert(r#"{"model":"m","Keep_Alive":0}"#), None);
    assert_eq!(insert(r#"{"model":"m","keep\u005falive":0}"#), None);
}

#[test]
fn override_replaces_only_the_value_span() {
    assert_eq!(
        replace(r#"{"model":"m", "keep_alive" :  "10m" , "x":1.0}"#).as_deref(),
        Some(r#"{"model":"m", "keep_alive" :  -1 , "x":1.0}"#)
    );
    assert_eq!(
        replace(r#"{"keep_alive":{"a":[1,2]},"x":"é"}"#).as_deref(),
        Some(r#"{"keep_alive":-1,"x":"é"}"#)
    );
    assert_eq!(
        replace(r#"{"KEEP_ALIVE":0,"keep_alive":3600.0}"#).as_deref(),
        Some(r#"{"KEEP_ALIVE":-1,"keep_alive":-1}"#)
    );
    assert_eq!(
        replace(r#"{"a":1}"#).as_deref(),
        Some(r#"{"a":1,"keep_alive":-1}"#)
    );
}

#[test]
fn passes_through_what_it_must_not_touch() {
    for body in [
        "",
        " ",
        "[1,2]",
        "\"s\"",
        "3",
        "null",
        "{",
        r#"{"a":}"#,
        r#"{"a":1,}"#,
        "{} {}",
        "not json",
        r#"{"a":"\x"}"#,
    ] {
        assert_eq!(insert(body), None, "{body:?}");
        assert_eq!(replace(body), None, "{body:?}");
    }
    let none = policy(None, true);
    assert_eq!(insert_keep_alive(b"{}", &none), None);
    let broken = policy(Some("5m"), false);
    assert_eq!(insert_keep_alive(b"{}", &broken), None);
}

#[test]
fn reads_the_model_like_ollama() {
    assert_eq!(
        model_of(br#"{"model":"llama3","x":{"model":"no"}}"#).as_deref(),
        Some("llama3")
    );
    assert_eq!(
        model_of(br#"{"model":"a","Model":"b"}"#).as_deref(),
        Some("b")
    );
    assert_eq!(
        model_of(br#"{"model":"caf\u00e9"}"#).as_deref(),
        Some("café")
    );
    assert_eq!(model_of(br#"{"model":1}"#), None);
    assert_eq!(model_of(br#"{"prompt":"x"}"#), None);
    assert_eq!(model_of(b"[]"), None);
    assert_eq!(model_of(b""), None);
}

/// Arbitrary JSON values, nested a few levels.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        "\\PC{0,12}".prop_map(Value::String),
        "[\"\\\\/\\n\\t\\u{0}-\\u{1f}é😀]{0,6}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec(("[a-z_A-Z]{0,10}", inner), 0..5)
                .prop_map(|members| Value::Object(members.into_iter().collect())),
        ]
    })
}

/// Objects whose keys never read as keep_alive.
fn json_object() -> impl Strategy<Value = Map<String, Value>> {
    prop::collection::vec(("[a-z_A-Z]{0,10}", json_value()), 0..6).prop_map(|members| {
        members
            .into_iter()
            .filter(|(key, _)| !scan::fold_eq(key, "keep_alive"))
            .collect()
    })
}

/// Several spellings of the same object: compact, pretty, ASCII-escaped,
/// padded with odd whitespace.
fn spellings(object: &Map<String, Value>) -> Vec<Vec<u8>> {
    let value = Value::Object(object.clone());
    let compact = serde_json::to_vec(&value).unwrap();
    let pretty = serde_json::to_vec_pretty(&value).unwrap();
    let escaped: String = String::from_utf8(compact.clone())
        .unwrap()
        .chars()
        .map(|c| {
            if c.is_ascii() {
                c.to_string()
            } else {
                let mut units = [0u16; 2];
                c.encode_utf16(&mut units)
                    .iter()
                    .map(|u| format!("\\u{u:04x}"))
                    .collect()
            }
        })
        .collect();
    let mut padded = b"\r\n ".to_vec();
    padded.extend(pretty.iter().map(|b| if *b == b'\n' { b'\t' } else { *b }));
    padded.extend_from_slice(b" \n");
    vec![compact, pretty, escaped.into_bytes(), padded]
}

proptest! {
    #[test]
    fn insertion_adds_exactly_one_member(object in json_object(), default in prop_oneof![
        Just("\"5m\""), Just("-1"), Just("3600.5"), Just("null"), Just("\"24h\"")
    ]) {
        let keep_alive = policy(Some(default), false);
        for body in spellings(&object) {
            let out = insert_keep_alive(&body, &keep_alive).expect("an object is rewritten");
            // The output is the input with one run of bytes inserted.
            let prefix = body.iter().zip(out.iter()).take_while(|(a, b)| a == b).count();
            let inserted = out.len() - body.len();
            prop_assert_eq!(&out[prefix + inserted..], &body[prefix..]);
            // It parses to the original object plus keep_alive, last.
            let parsed: Map<String, Value> = serde_json::from_slice(&out).unwrap();
            let mut expected = object.clone();
            expected.insert("keep_alive".to_owned(), serde_json::from_str(default).unwrap());
            prop_assert_eq!(parsed.keys().next_back().map(String::as_str), Some("keep_alive"));
            prop_assert_eq!(Value::Object(parsed), Value::Object(expected));
            // Applied again, it keeps the value it inserted.
            prop_assert!(insert_keep_alive(&out, &keep_alive).is_none());
        }
    }

    #[test]
    fn override_changes_only_the_value(object in json_object(), old in json_value()) {
        // keep_alive first, so that its key is the first "keep_alive" text.
        let mut with = Map::new();
        with.insert("keep_alive".to_owned(), old.clone());
        with.extend(object);
        let default = "\"1h\"";
        let keep_alive = policy(Some(default), true);
        for body in spellings(&with) {
            let out = insert_keep_alive(&body, &keep_alive).expect("rewritten");
            let mut expected = with.clone();
            expected.insert("keep_alive".to_owned(), Value::from("1h"));
            let parsed: Value = serde_json::from_slice(&out).unwrap();
            prop_assert_eq!(parsed, Value::Object(expected));
            // out = body[..start] + default + body[end..], body[start..end] = old.
            let key = body.windows(12).position(|w| w == b"\"keep_alive\"").unwrap() + 12;
            let start = scan::skip_ws(&body, scan::skip_ws(&body, key) + 1);
            let end = start + body.len() + default.len() - out.len();
            prop_assert_eq!(&out[..start], &body[..start]);
            prop_assert_eq!(&out[start..start + default.len()], default.as_bytes());
            prop_assert_eq!(&out[start + default.len()..], &body[end..]);
            let replaced: Value = serde_json::from_slice(&body[start..end]).unwrap();
            prop_assert_eq!(replaced, old.clone());
        }
    }

    #[test]
    fn model_of_agrees_with_serde(object in json_object(), model in "\\PC{0,12}") {
        let mut with = object.clone();
        with.retain(|key, _| !scan::fold_eq(key, "model"));
        with.insert("model".to_owned(), Value::from(model.clone()));
        for body in spellings(&with) {
            prop_assert_eq!(model_of(&body), Some(model.clone()));
        }
    }
}

#[test]
fn names_the_slot_keeping_every_other_byte() {
    let set =
        |body: &str| set_slot(body.as_bytes(), 3).map(|b| String::from_utf8(b.to_vec()).unwrap());
    assert_eq!(
        set(r#"{"model":"m", "x":1.0e0}"#).as_deref(),
        Some(r#"{"model":"m", "x":1.0e0,"id_slot":3}"#)
    );
    assert_eq!(set(" {} ").as_deref(), Some(r#" {"id_slot":3} "#));
    // The client's own id_slot is replaced (every member of that exact name); another
    // spelling is not llama-server's field.
    assert_eq!(
        set(r#"{"id_slot":0,"ID_SLOT":1,"id_slot":-1}"#).as_deref(),
        Some(r#"{"id_slot":3,"ID_SLOT":1,"id_slot":3}"#)
    );
    assert_eq!(set("[1]"), None);
    assert_eq!(set(""), None);
}
