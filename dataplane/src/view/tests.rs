#![allow(clippy::unwrap_used)]

use proptest::prelude::*;

use super::reference::agrees;
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
