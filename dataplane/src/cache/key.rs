//! Cache keys: one per input item, over everything that changes its vector.
//!
//! # Format (version 2)
//!
//! A stored key is `<key_prefix>v2:<ns>:<hex>` where
//!
//! - `ns` is `embed` for `/api/embed` and `/v1/embeddings` (translated to
//!   `/api/embed` first), `embeddings` for the legacy `/api/embeddings`,
//!   whose vectors differ (f64, not normalised);
//! - `hex` is the lower-case hex of all 32 bytes of
//!   `SHA-256("oqp-embed-cache" ‖ F(ns) ‖ F(model) ‖ F(scope) ‖ F(truncate) ‖
//!   F(dimensions) ‖ F(options) ‖ F(other) ‖ F(input))`, where `F(x)` is the length of
//!   the UTF-8 bytes of `x` as a big-endian u64 followed by those bytes (so no
//!   two field lists share an encoding), and
//!   - `model` = the request's `model` normalised as Ollama matches models
//!     (trimmed, lower-cased, `:latest` added when untagged);
//!   - `scope` = `shared`, or `client:<client id>` when `per_client` is set;
//!   - `truncate` = `true` or `false` (absent or `null` = `true`, Ollama's
//!     default); empty for `embeddings`;
//!   - `dimensions` = the canonical number (see below), empty when absent,
//!     `null` or 0 (Ollama's "no truncation"); empty for `embeddings`;
//!   - `options` = the canonical JSON of `options` (absent or `null` = `{}`);
//!   - `other` = the canonical JSON of an object holding every other
//!     top-level field (`{}` when there are none): fields this version does
//!     not know might change vectors, so requests that differ in them never
//!     share entries; only `model`, `input`/`prompt`, `keep_alive` and
//!     `stream`, which cannot change a vector, are left out;
//!   - `input` = the one input item (an element of `input`, or `prompt`),
//!     decoded from JSON: the exact text the model embeds.
//!
//! Canonical JSON: no whitespace; object keys sorted by their UTF-8 bytes
//! (a repeated key keeps its last value, as Go does); strings as `serde_json`
//! writes them; every number as the f64 Ollama's Go decoder turns it into,
//! printed shortest-round-trip (so `1`, `1.0` and `10e-1` are all `1.0`, and
//! `-0` is `0.0`). Field names are matched as Ollama's Go decoder matches
//! them (case-insensitively, last one wins).
//!
//! The reference proxy keyed whole requests (model + input only, 32 hex
//! digits, shared across tenants): requests differing in `options`,
//! `truncate` or `dimensions` shared an entry, and one request's list could
//! not reuse another's items. Its `v1:` keys are not reused.

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::endpoint::Inference;
use crate::rewrite::scan;

/// The key format version, part of every stored key.
pub const VERSION: &str = "v2";

/// The two embedding response shapes, which never share entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Namespace {
    /// `/api/embed` (and `/v1/embeddings`): `{"embeddings": [[f32…]…]}`.
    Embed,
    /// `/api/embeddings`: `{"embedding": [f64…]}`.
    Embeddings,
}

impl Namespace {
    /// The namespace of an inference endpoint, if it is cached at all.
    pub fn of(inference: Inference) -> Option<Self> {
        match inference {
            Inference::Embed | Inference::OpenAiEmbeddings => Some(Self::Embed),
            Inference::Embeddings => Some(Self::Embeddings),
            _ => None,
        }
    }

    /// The name used in keys.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Embed => "embed",
            Self::Embeddings => "embeddings",
        }
    }
}

/// Whether a top-level field goes into the key's `other` part: every field
/// but the ones named in the key format and the two that cannot change a
/// vector (`keep_alive`, `stream`). Names match as Go matches them.
pub fn is_other(namespace: Namespace, field: &str) -> bool {
    let named: &[&str] = match namespace {
        Namespace::Embed => &[
            "model",
            "input",
            "truncate",
            "dimensions",
            "options",
            "keep_alive",
            "stream",
        ],
        Namespace::Embeddings => &["model", "prompt", "options", "keep_alive", "stream"],
    };
    !named.iter().any(|name| scan::fold_eq(field, name))
}

/// The request fields that change vectors, canonicalised once per request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    namespace: Namespace,
    model: String,
    truncate: String,
    dimensions: String,
    options: String,
    other: String,
}

/// The raw fields of a request that its vectors depend on.
#[derive(Debug, Clone, Copy)]
pub struct Fields<'a> {
    /// `model`, as sent.
    pub model: &'a str,
    /// `truncate` (`/api/embed` only).
    pub truncate: Option<&'a Value>,
    /// `dimensions` (`/api/embed` only).
    pub dimensions: Option<&'a Value>,
    /// `options`.
    pub options: Option<&'a Value>,
    /// Every other top-level field but `keep_alive` and `stream`.
    pub other: &'a Map<String, Value>,
}

impl Params {
    /// Canonicalises the vector-affecting fields of a request. `None` when a
    /// field has a type Ollama would refuse (then nothing is cached).
    pub fn new(namespace: Namespace, fields: Fields<'_>) -> Option<Self> {
        let Fields {
            model,
            truncate,
            dimensions,
            options,
            other,
        } = fields;
        let (truncate, dimensions) = match namespace {
            Namespace::Embeddings => (String::new(), String::new()),
            Namespace::Embed => {
                let truncate = match truncate {
                    None | Some(Value::Null) | Some(Value::Bool(true)) => "true",
                    Some(Value::Bool(false)) => "false",
                    Some(_) => return None,
                };
                let dimensions = match dimensions {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::Number(n)) if n.as_f64() == Some(0.0) => String::new(),
                    Some(value @ Value::Number(_)) => canonical(value),
                    Some(_) => return None,
                };
                (truncate.to_owned(), dimensions)
            }
        };
        let options = match options {
            None | Some(Value::Null) => "{}".to_owned(),
            Some(value @ Value::Object(_)) => canonical(value),
            Some(_) => return None,
        };
        let mut other_text = String::new();
        write_object(other, &mut other_text);
        Some(Self {
            namespace,
            model: crate::policy::normalize_model(model),
            truncate,
            dimensions,
            options,
            other: other_text,
        })
    }

    /// The namespace.
    pub fn namespace(&self) -> Namespace {
        self.namespace
    }

    /// The stored key of one input item.
    pub fn key(&self, prefix: &str, client: Option<&str>, item: &str) -> String {
        let scope = match client {
            Some(id) => format!("client:{id}"),
            None => "shared".to_owned(),
        };
        let mut hasher = Sha256::new();
        hasher.update(b"oqp-embed-cache");
        for field in [
            self.namespace.as_str(),
            &self.model,
            &scope,
            &self.truncate,
            &self.dimensions,
            &self.options,
            &self.other,
            item,
        ] {
            hasher.update((field.len() as u64).to_be_bytes());
            hasher.update(field.as_bytes());
        }
        format!(
            "{prefix}{VERSION}:{}:{}",
            self.namespace.as_str(),
            hex::encode(hasher.finalize())
        )
    }
}

/// The canonical JSON text of a value (see the module docs).
pub fn canonical(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            // Go decodes every JSON number in a map[string]any as a float64.
            let float = n.as_f64().unwrap_or(0.0);
            let float = if float == 0.0 { 0.0 } else { float };
            match serde_json::Number::from_f64(float) {
                Some(number) => out.push_str(&number.to_string()),
                None => out.push_str("null"),
            }
        }
        Value::String(text) => out.push_str(&Value::String(text.clone()).to_string()),
        Value::Array(items) => {
            out.push('[');
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        Value::Object(members) => write_object(members, out),
    }
}

fn write_object(members: &Map<String, Value>, out: &mut String) {
    let mut sorted: Vec<(&String, &Value)> = members.iter().collect();
    sorted.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    out.push('{');
    for (index, (key, value)) in sorted.into_iter().enumerate() {
        if index > 0 {
            out.push(',');
        }
        out.push_str(&Value::String(key.clone()).to_string());
        out.push(':');
        write_canonical(value, out);
    }
    out.push('}');
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// The params of a request body given as a JSON value.
    fn params_of(namespace: Namespace, body: Value) -> Option<Params> {
        let Value::Object(body) = body else {
            panic!("an object");
        };
        let other: Map<String, Value> = body
            .iter()
            .filter(|(key, _)| is_other(namespace, key))
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect();
        let fields = Fields {
            model: body["model"].as_str().unwrap(),
            truncate: body.get("truncate"),
            dimensions: body.get("dimensions"),
            options: body.get("options"),
            other: &other,
        };
        Params::new(namespace, fields)
    }

    fn params(body: Value) -> Params {
        params_of(Namespace::Embed, body).unwrap()
    }

    #[test]
    fn canonical_json_sorts_keys_and_normalises_numbers() {
        let a: Value =
            serde_json::from_str(r#"{"b":[1,2.50,-0],"a":{"y":1e2,"x":"é\n"}}"#).unwrap();
        let b: Value =
            serde_json::from_str(r#"{ "a" : {"x":"\u00e9\n", "y":100.0}, "b":[1.0,2.5,0] }"#)
                .unwrap();
        assert_eq!(canonical(&a), canonical(&b));
        assert_eq!(
            canonical(&a),
            r#"{"a":{"x":"é\n","y":100.0},"b":[1.0,2.5,0.0]}"#
        );
    }

    #[test]
    fn keys_have_the_documented_shape() {
        let key = params(json!({"model":"nomic-embed-text"})).key("oqp:embed:", None, "hello");
        let (prefix, hex) = key.rsplit_once(':').unwrap();
        assert_eq!(prefix, "oqp:embed:v2:embed");
        assert_eq!(hex.len(), 64);
        // Pinned, computed independently from the documented format (a
        // change here invalidates every deployed cache: bump VERSION).
        assert_eq!(
            key,
            "oqp:embed:v2:embed:8e19becab73c3430630fd7464f72c2faa069985865b08d176ed8386b1ad553bc"
        );
        let same = json!({
            "model": "Nomic-Embed-Text:latest", "truncate": true, "dimensions": 0,
            "options": {}, "keep_alive": "5m", "stream": false
        });
        assert_eq!(params(same).key("oqp:embed:", None, "hello"), key);
        let legacy = params_of(
            Namespace::Embeddings,
            json!({"model":"nomic-embed-text","options":{"num_ctx":2048},"truncate":false}),
        )
        .unwrap();
        assert_eq!(
            legacy.key("oqp:embed:", Some("alice"), "hello"),
            "oqp:embed:v2:embeddings:021b55e2afae581c0d45db6b49af5baf6e104ddb069b406e8f1685bea8431dd9"
        );
    }

    #[test]
    fn vector_affecting_fields_separate_keys() {
        let base = params(json!({"model":"m"})).key("", None, "x");
        for other in [
            json!({"model":"m2"}),
            json!({"model":"m","truncate":false}),
            json!({"model":"m","dimensions":256}),
            json!({"model":"m","options":{"num_ctx":512}}),
            json!({"model":"m","some_future_field":1}),
        ] {
            assert_ne!(params(other).key("", None, "x"), base);
        }
        assert_ne!(params(json!({"model":"m"})).key("", None, "y"), base);
        assert_ne!(params(json!({"model":"m"})).key("", Some("a"), "x"), base);
        assert_ne!(
            params(json!({"model":"m"})).key("", Some("a"), "x"),
            params(json!({"model":"m"})).key("", Some("b"), "x")
        );
        let legacy = params_of(Namespace::Embeddings, json!({"model":"m"})).unwrap();
        assert_ne!(legacy.key("", None, "x"), base);
        assert!(legacy.key("", None, "x").starts_with("v2:embeddings:"));
    }

    #[test]
    fn refuses_types_ollama_refuses() {
        for body in [
            json!({"model":"m","truncate":"yes"}),
            json!({"model":"m","dimensions":"5"}),
            json!({"model":"m","options":[1]}),
        ] {
            assert!(params_of(Namespace::Embed, body).is_none());
        }
    }
}
