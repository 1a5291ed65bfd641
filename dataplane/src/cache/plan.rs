//! Splitting an embedding request into items, and putting the answer back
//! together from cached and freshly fetched vectors.
//!
//! A [`Plan`] is built once per request. Its items are the *distinct* input
//! texts in first-seen order (a list that repeats a text needs it once). The
//! request path looks the items up, asks upstream for the missing ones with
//! [`Plan::fetch`] (the client's own body, untouched, when every item is
//! missing; otherwise the same body with only `input` replaced), and builds
//! the client's answer with [`Plan::reassemble`] (or, across several fetches,
//! [`Plan::vectors`] and [`Plan::assemble`]).
//!
//! Vectors are carried as the raw JSON array text the upstream sent, so an
//! answer built from the cache has exactly the numbers (and digits) Ollama
//! printed.

use std::collections::HashMap;
use std::ops::Range;

use bytes::Bytes;
use serde::de::IgnoredAny;
use serde_json::Value;

use super::key::{self, Namespace, Params};
use crate::rewrite::{scan, splice};

pub use scan::is_vector;

/// How the client gave its input, which decides nothing about the answer's
/// shape for `/api/embed` (always a list) but does for the legacy endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// `/api/embed` with `input` a string.
    Text,
    /// `/api/embed` with `input` an array of strings.
    List,
    /// `/api/embeddings` with `prompt`.
    Prompt,
}

/// One embedding request, split into cacheable items.
#[derive(Debug, Clone)]
pub struct Plan {
    body: Bytes,
    model: String,
    params: Params,
    shape: Shape,
    /// The span of the `input` value Ollama reads.
    input: Range<usize>,
    /// Distinct items, first-seen order.
    items: Vec<String>,
    /// Per input position, the index of its item.
    order: Vec<usize>,
}

/// An upstream request for some of a plan's items.
#[derive(Debug, Clone)]
pub struct Fetch {
    /// The body to send (to the same endpoint).
    pub body: Bytes,
    /// Per vector position in the answer, the item it is for.
    slots: Vec<usize>,
    /// Whether `body` is the client's own body.
    whole: bool,
}

impl Fetch {
    /// Whether the client's body is sent unchanged (every item missing), in
    /// which case the upstream answer can be relayed as it is.
    pub fn is_whole(&self) -> bool {
        self.whole
    }

    /// The items this fetch asks for, in the order the answer lists them.
    pub fn items(&self) -> &[usize] {
        &self.slots
    }
}

/// The timing and count fields of an `/api/embed` answer, summed over the
/// fetches that built a response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timing {
    /// `total_duration`, nanoseconds.
    pub total_duration: u64,
    /// `load_duration`, nanoseconds.
    pub load_duration: u64,
    /// `prompt_eval_count`, tokens.
    pub prompt_eval_count: u64,
}

impl Timing {
    /// Adds another answer's timing (used across several fetches).
    pub fn merge(&mut self, other: Timing) {
        self.total_duration = self.total_duration.saturating_add(other.total_duration);
        self.load_duration = self.load_duration.saturating_add(other.load_duration);
        self.prompt_eval_count = self
            .prompt_eval_count
            .saturating_add(other.prompt_eval_count);
    }
}

/// What one upstream answer contributes: a vector per fetched item.
#[derive(Debug, Clone)]
pub struct Fetched {
    /// `(item, vector JSON text)`, one per distinct item fetched.
    pub vectors: Vec<(usize, Bytes)>,
    /// The answer's timing fields.
    pub timing: Timing,
}

/// A response built for the client.
#[derive(Debug, Clone)]
pub struct Assembled {
    /// The body, in Ollama's shape for the endpoint.
    pub body: Bytes,
    /// Vectors fetched from upstream, to store: `(item, vector)`.
    pub vectors: Vec<(usize, Bytes)>,
}

/// An upstream answer that does not fit the request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// Not an embedding response, or not one vector per requested item.
    #[error("upstream returned an unexpected embedding response")]
    UnexpectedResponse,
    /// Some item has neither a cached nor a fetched vector.
    #[error("embedding response is missing item {0}")]
    Incomplete(usize),
}

/// A request with more inputs than `embedding_cache.max_inputs` (a 413).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("too many embedding inputs: at most {limit} per request (embedding_cache.max_inputs)")]
pub struct TooManyInputs {
    /// The limit.
    pub limit: usize,
}

/// Splits an embedding request body. `None` when it is not cacheable: not a
/// JSON object, no `model`, an input Ollama refuses or answers without
/// vectors (`""`, `[]`, non-strings), or field types Ollama refuses. Such a
/// request is forwarded as it is.
pub fn plan(namespace: Namespace, body: &Bytes) -> Option<Plan> {
    plan_within(namespace, body, usize::MAX).ok().flatten()
}

/// [`plan`], refusing a request whose `input` list has more than
/// `max_inputs` elements. The elements are counted before anything is built
/// for them, so a refused request costs no memory per input.
pub fn plan_within(
    namespace: Namespace,
    body: &Bytes,
    max_inputs: usize,
) -> Result<Option<Plan>, TooManyInputs> {
    let Some(object) = scan::top_object(body) else {
        return Ok(None);
    };
    if namespace == Namespace::Embed
        && let Some(member) = object.get(body, "input")
        && count_elements(body, member.value.clone(), max_inputs).is_none()
    {
        return Err(TooManyInputs { limit: max_inputs });
    }
    Ok(build(namespace, body, &object))
}

/// The number of elements of the array at `span` (0 for a non-array), or
/// `None` as soon as there are more than `max`.
fn count_elements(bytes: &[u8], span: Range<usize>, max: usize) -> Option<usize> {
    let bytes = bytes.get(..span.end)?;
    if bytes.get(span.start) != Some(&b'[') {
        return Some(0);
    }
    let mut count = 0;
    let mut at = scan::skip_ws(bytes, span.start + 1);
    if bytes.get(at) == Some(&b']') {
        return Some(0);
    }
    loop {
        count += 1;
        if count > max {
            return None;
        }
        // A malformed array is not cacheable: planning refuses it later.
        let Some(end) = scan::value_end(bytes, at) else {
            return Some(count);
        };
        at = scan::skip_ws(bytes, end);
        match bytes.get(at) {
            Some(b',') => at = scan::skip_ws(bytes, at + 1),
            _ => return Some(count),
        }
    }
}

fn build(namespace: Namespace, body: &Bytes, object: &scan::Object) -> Option<Plan> {
    serde_json::from_slice::<IgnoredAny>(body).ok()?;
    let value_of = |field: &str| -> Option<Option<Value>> {
        match object.get(body, field) {
            None => Some(None),
            Some(member) => serde_json::from_slice(&body[member.value.clone()])
                .ok()
                .map(Some),
        }
    };
    let model = match value_of("model")? {
        Some(Value::String(model)) if !model.is_empty() => model,
        _ => return None,
    };
    let mut other = serde_json::Map::new();
    for member in &object.members {
        let name = scan::key(body, member)?;
        if key::is_other(namespace, &name) {
            let value = serde_json::from_slice(&body[member.value.clone()]).ok()?;
            other.insert(name.into_owned(), value);
        }
    }
    let (truncate, dimensions, options) = (
        value_of("truncate")?,
        value_of("dimensions")?,
        value_of("options")?,
    );
    let fields = key::Fields {
        model: &model,
        truncate: truncate.as_ref(),
        dimensions: dimensions.as_ref(),
        options: options.as_ref(),
        other: &other,
    };
    let params = Params::new(namespace, fields)?;
    let field = match namespace {
        Namespace::Embed => "input",
        Namespace::Embeddings => "prompt",
    };
    let input = object.get(body, field)?.value.clone();
    let (shape, texts) = match (
        namespace,
        serde_json::from_slice::<Value>(&body[input.clone()]).ok()?,
    ) {
        (Namespace::Embed, Value::String(text)) => (Shape::Text, vec![text]),
        (Namespace::Embed, Value::Array(values)) => {
            let texts = values
                .into_iter()
                .map(|value| match value {
                    Value::String(text) => Some(text),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()?;
            (Shape::List, texts)
        }
        (Namespace::Embeddings, Value::String(text)) => (Shape::Prompt, vec![text]),
        _ => return None,
    };
    // An empty input is answered without vectors; an empty string is "no
    // input" everywhere except inside a list.
    if texts.is_empty() || (shape != Shape::List && texts[0].is_empty()) {
        return None;
    }

    let mut index: HashMap<&str, usize> = HashMap::new();
    let mut items: Vec<String> = Vec::new();
    let mut order = Vec::with_capacity(texts.len());
    for text in &texts {
        let next = items.len();
        let at = *index.entry(text.as_str()).or_insert(next);
        if at == next {
            items.push(text.clone());
        }
        order.push(at);
    }
    Some(Plan {
        body: body.clone(),
        model,
        params,
        shape,
        input,
        items,
        order,
    })
}

impl Plan {
    /// The endpoint namespace.
    pub fn namespace(&self) -> Namespace {
        self.params.namespace()
    }

    /// The model as the client wrote it.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The number of distinct items.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether there are no items (never true for a built plan).
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The text of item `index`.
    pub fn item(&self, index: usize) -> &str {
        &self.items[index]
    }

    /// The stored key of every item, in item order (see [`super::key`]).
    pub fn keys(&self, prefix: &str, client: Option<&str>) -> Vec<String> {
        self.items
            .iter()
            .map(|item| self.params.key(prefix, client, item))
            .collect()
    }

    /// The upstream request for `items` (item indices, any order, no
    /// repeats). Every item missing: the client's body, unchanged. Otherwise
    /// the same body with the `input` value replaced by the array of those
    /// texts and every other byte kept.
    pub fn fetch(&self, items: &[usize]) -> Fetch {
        if items.len() >= self.items.len() || self.shape == Shape::Prompt {
            return Fetch {
                body: self.body.clone(),
                slots: self.order.clone(),
                whole: true,
            };
        }
        let texts: Vec<&str> = items.iter().map(|&i| self.items[i].as_str()).collect();
        // Serialising a list of strings cannot fail.
        let input = serde_json::to_vec(&texts).unwrap_or_default();
        Fetch {
            body: splice(&self.body, &[(self.input.clone(), &input)]),
            slots: items.to_vec(),
            whole: false,
        }
    }

    /// The vectors in an upstream (status 200) answer to `fetch`.
    pub fn vectors(&self, fetch: &Fetch, answer: &[u8]) -> Result<Fetched, PlanError> {
        let object = scan::top_object(answer).ok_or(PlanError::UnexpectedResponse)?;
        let field = match self.shape {
            Shape::Prompt => "embedding",
            Shape::Text | Shape::List => "embeddings",
        };
        let member = object
            .get(answer, field)
            .ok_or(PlanError::UnexpectedResponse)?;
        let spans = match self.shape {
            Shape::Prompt => vec![member.value.clone()],
            Shape::Text | Shape::List => scan::array_elements(answer, member.value.clone())
                .ok_or(PlanError::UnexpectedResponse)?,
        };
        if spans.len() != fetch.slots.len() {
            return Err(PlanError::UnexpectedResponse);
        }
        let mut vectors: Vec<(usize, Bytes)> = Vec::new();
        let mut seen = vec![false; self.items.len()];
        for (&item, span) in fetch.slots.iter().zip(spans) {
            let raw = &answer[span];
            if !is_vector(raw) {
                return Err(PlanError::UnexpectedResponse);
            }
            if !std::mem::replace(&mut seen[item], true) {
                vectors.push((item, Bytes::copy_from_slice(raw)));
            }
        }
        let number = |name: &str| {
            object
                .get(answer, name)
                .and_then(|m| serde_json::from_slice::<u64>(&answer[m.value.clone()]).ok())
                .unwrap_or(0)
        };
        Ok(Fetched {
            vectors,
            timing: Timing {
                total_duration: number("total_duration"),
                load_duration: number("load_duration"),
                prompt_eval_count: number("prompt_eval_count"),
            },
        })
    }

    /// Ollama's answer built from a vector per item (`vectors[item]`):
    /// `{"model":<as requested>,"embeddings":[…in input order…]}` plus the
    /// non-zero timing fields (Go omits zeros), or `{"embedding":[…]}` for
    /// the legacy endpoint. A string input is answered with a one-element
    /// `embeddings`, as Ollama does.
    pub fn assemble(&self, vectors: &[Option<Bytes>], timing: Timing) -> Result<Bytes, PlanError> {
        let vector = |item: usize| -> Result<&Bytes, PlanError> {
            vectors
                .get(item)
                .and_then(Option::as_ref)
                .ok_or(PlanError::Incomplete(item))
        };
        let mut out = Vec::new();
        if self.shape == Shape::Prompt {
            out.extend_from_slice(br#"{"embedding":"#);
            out.extend_from_slice(vector(0)?);
            out.push(b'}');
            return Ok(Bytes::from(out));
        }
        let size: usize = self
            .order
            .iter()
            .filter_map(|&item| vectors.get(item)?.as_ref())
            .map(|vector| vector.len() + 1)
            .sum();
        out.reserve(size + self.model.len() + 128);
        out.extend_from_slice(br#"{"model":"#);
        out.extend_from_slice(Value::String(self.model.clone()).to_string().as_bytes());
        out.extend_from_slice(br#","embeddings":["#);
        for (position, &item) in self.order.iter().enumerate() {
            if position > 0 {
                out.push(b',');
            }
            out.extend_from_slice(vector(item)?);
        }
        out.push(b']');
        for (name, value) in [
            ("total_duration", timing.total_duration),
            ("load_duration", timing.load_duration),
            ("prompt_eval_count", timing.prompt_eval_count),
        ] {
            if value != 0 {
                out.extend_from_slice(format!(r#","{name}":{value}"#).as_bytes());
            }
        }
        out.push(b'}');
        Ok(Bytes::from(out))
    }

    /// The client's answer from cached vectors (`found[item]`) and at most
    /// one upstream answer: the upstream body itself when the fetch was the
    /// client's whole request, a built body otherwise (or on a full hit).
    /// Also returns the fetched vectors, to store.
    pub fn reassemble(
        &self,
        found: &[Option<Bytes>],
        fetched: Option<(&Fetch, &[u8])>,
    ) -> Result<Assembled, PlanError> {
        let Some((fetch, answer)) = fetched else {
            return Ok(Assembled {
                body: self.assemble(found, Timing::default())?,
                vectors: Vec::new(),
            });
        };
        let got = match self.vectors(fetch, answer) {
            Ok(got) => got,
            // The client asked exactly this: relay it, cache nothing.
            Err(_) if fetch.whole => {
                return Ok(Assembled {
                    body: Bytes::copy_from_slice(answer),
                    vectors: Vec::new(),
                });
            }
            Err(error) => return Err(error),
        };
        if fetch.whole {
            return Ok(Assembled {
                body: Bytes::copy_from_slice(answer),
                vectors: got.vectors,
            });
        }
        let mut all = found.to_vec();
        all.resize(self.items.len(), None);
        for (item, vector) in &got.vectors {
            all[*item] = Some(vector.clone());
        }
        Ok(Assembled {
            body: self.assemble(&all, got.timing)?,
            vectors: got.vectors,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn embed(body: &str) -> Plan {
        plan(Namespace::Embed, &Bytes::from(body.to_owned())).unwrap()
    }

    fn v(text: &str) -> Option<Bytes> {
        Some(Bytes::from(text.to_owned()))
    }

    #[test]
    fn splits_inputs_into_distinct_items() {
        let plan = embed(r#"{"model":"m","input":["a","b","a","c"],"keep_alive":"5m"}"#);
        assert_eq!(plan.len(), 3);
        assert_eq!((plan.item(0), plan.item(1), plan.item(2)), ("a", "b", "c"));
        let keys = plan.keys("p:", None);
        assert_eq!(keys.len(), 3);
        assert_ne!(keys[0], keys[1]);
        let single = embed(r#"{"model":"m","input":"a"}"#);
        assert_eq!(single.keys("p:", None)[0], keys[0]);
    }

    #[test]
    fn refuses_what_it_cannot_cache() {
        for body in [
            r#"{"model":"m","input":""}"#,
            r#"{"model":"m","input":[]}"#,
            r#"{"model":"m","input":[1]}"#,
            r#"{"model":"m","input":{"a":1}}"#,
            r#"{"model":"m"}"#,
            r#"{"input":"a"}"#,
            r#"{"model":"","input":"a"}"#,
            r#"{"model":"m","input":"a","truncate":"no"}"#,
            r#"{"model":"m","input":"a","options":[]}"#,
            r#"{"model":"m","input":"a""#,
            "[]",
        ] {
            assert!(
                plan(Namespace::Embed, &Bytes::from(body)).is_none(),
                "{body}"
            );
        }
        assert!(
            plan(
                Namespace::Embeddings,
                &Bytes::from(r#"{"model":"m","prompt":""}"#)
            )
            .is_none()
        );
        assert!(
            plan(
                Namespace::Embeddings,
                &Bytes::from(r#"{"model":"m","input":"x"}"#)
            )
            .is_none()
        );
        // Inside a list an empty string is an item like any other.
        assert_eq!(embed(r#"{"model":"m","input":[""]}"#).len(), 1);
    }

    #[test]
    fn miss_only_body_keeps_every_other_byte() {
        let body = r#"{ "model" : "m", "input": ["a", "b", "c"], "options": {"x": 1.0}, "keep_alive": -1 }"#;
        let plan = embed(body);
        let fetch = plan.fetch(&[2, 0]);
        assert!(!fetch.is_whole());
        assert_eq!(
            std::str::from_utf8(&fetch.body).unwrap(),
            r#"{ "model" : "m", "input": ["c","a"], "options": {"x": 1.0}, "keep_alive": -1 }"#
        );
        let all = plan.fetch(&[0, 1, 2]);
        assert!(all.is_whole());
        assert_eq!(&all.body[..], body.as_bytes());
    }

    #[test]
    fn reassembles_partial_hits_in_input_order() {
        let plan = embed(r#"{"model":"Nomic","input":["a","b","a","c"]}"#);
        let found = vec![v("[1.0,2]"), None, None];
        let fetch = plan.fetch(&[1, 2]);
        let answer = br#"{"model":"Nomic","embeddings":[[0.5,-1e-7],[3]],"total_duration":9,"load_duration":2,"prompt_eval_count":4}"#;
        let assembled = plan.reassemble(&found, Some((&fetch, answer))).unwrap();
        assert_eq!(
            std::str::from_utf8(&assembled.body).unwrap(),
            r#"{"model":"Nomic","embeddings":[[1.0,2],[0.5,-1e-7],[1.0,2],[3]],"total_duration":9,"load_duration":2,"prompt_eval_count":4}"#
        );
        assert_eq!(
            assembled.vectors,
            vec![(1, Bytes::from("[0.5,-1e-7]")), (2, Bytes::from("[3]"))]
        );
    }

    #[test]
    fn a_full_hit_looks_like_ollama_without_timing() {
        let plan = embed(r#"{"model":"m","input":"a"}"#);
        let assembled = plan.reassemble(&[v("[0.25]")], None).unwrap();
        assert_eq!(
            &assembled.body[..],
            br#"{"model":"m","embeddings":[[0.25]]}"#
        );
        let legacy = plan_legacy(r#"{"model":"m","prompt":"a"}"#);
        let assembled = legacy.reassemble(&[v("[0.1,0.2]")], None).unwrap();
        assert_eq!(&assembled.body[..], br#"{"embedding":[0.1,0.2]}"#);
        assert_eq!(
            plan.reassemble(&[None], None).unwrap_err(),
            PlanError::Incomplete(0)
        );
    }

    fn plan_legacy(body: &str) -> Plan {
        plan(Namespace::Embeddings, &Bytes::from(body.to_owned())).unwrap()
    }

    #[test]
    fn a_full_miss_relays_the_upstream_answer() {
        let plan = embed(r#"{"model":"m","input":["a","a"]}"#);
        let fetch = plan.fetch(&[0]);
        assert!(fetch.is_whole());
        let answer = br#"{"model":"m","embeddings":[[1],[1]],"total_duration":5}"#;
        let assembled = plan.reassemble(&[None], Some((&fetch, answer))).unwrap();
        assert_eq!(&assembled.body[..], answer);
        assert_eq!(assembled.vectors, vec![(0, Bytes::from("[1]"))]);
        // An answer that is not what we expect is still relayed, not cached.
        let odd = br#"{"model":"m","embeddings":"what"}"#;
        let assembled = plan.reassemble(&[None], Some((&fetch, odd))).unwrap();
        assert_eq!(&assembled.body[..], odd);
        assert!(assembled.vectors.is_empty());
        let legacy = plan_legacy(r#"{"model":"m","prompt":"a"}"#);
        let fetch = legacy.fetch(&[0]);
        let assembled = legacy
            .reassemble(&[None], Some((&fetch, br#"{"embedding":[0.5]}"#)))
            .unwrap();
        assert_eq!(assembled.vectors, vec![(0, Bytes::from("[0.5]"))]);
    }

    #[test]
    fn a_partial_answer_that_does_not_fit_is_an_error() {
        let plan = embed(r#"{"model":"m","input":["a","b"]}"#);
        let fetch = plan.fetch(&[1]);
        for answer in [
            &br#"{"embeddings":[[1],[2]]}"#[..],
            br#"{"embeddings":[["x"]]}"#,
            br#"{"embeddings":[[1,]]}"#,
            br#"{}"#,
            b"oops",
        ] {
            assert_eq!(
                plan.reassemble(&[v("[0]"), None], Some((&fetch, answer)))
                    .unwrap_err(),
                PlanError::UnexpectedResponse
            );
        }
    }

    #[test]
    fn numbers_follow_the_json_grammar() {
        for good in ["0", "-0", "1.5", "-1e-7", "2E+10", "123", "0.000001"] {
            assert!(scan::is_number(good.as_bytes()), "{good}");
        }
        for bad in [
            "", "-", "01", "1.", ".5", "1e", "NaN", "inf", "+1", "1 ", "0x1",
        ] {
            assert!(!scan::is_number(bad.as_bytes()), "{bad}");
        }
        assert!(is_vector(b"[ 1 , -2.5e3 ]"));
        assert!(is_vector(b"[]"));
        assert!(!is_vector(b"[1,null]"));
        assert!(!is_vector(b"{}"));
    }
}
