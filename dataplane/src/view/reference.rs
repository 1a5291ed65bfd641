//! The reference reading of a request body: a Go-semantics decoder over `serde_json::Value`,
//! written apart from the scanner, which [`agrees`] compares with [`BodyView`]. The top
//! level keeps duplicate keys (a `Value` map would fold them); nested objects are `Value`
//! maps, looked up case-folded with the last match winning. Shared by the property tests
//! (`view::tests`) and the fuzz target `body_view`, which includes this file.

#![allow(clippy::unwrap_used)]

use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::Value;

use super::{BodyView, NotString};

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
    models: usize,
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
        .rev()
        .find(|(key, _)| go_fold(key) == field)
        .map(|(_, value)| value)
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
        models: 0,
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
        .rev()
        .find(|(key, _)| go_fold(key) == user_path[0].to_ascii_lowercase())
        .map(|(_, value)| value);
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
        models: members
            .iter()
            .filter(|(key, _)| go_fold(key) == "model")
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
        models: view.model_members().len(),
        user: view.string_at(body, &path),
    })
}

/// Compares the view with the reference on `body`. A body whose numbers are beyond
/// `f64` is JSON that `Value` cannot hold: then only the check is compared.
pub fn agrees(body: &[u8]) {
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
