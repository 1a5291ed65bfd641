//! `POST /api/embed` and the legacy `POST /api/embeddings` (reference §A.3.8, §A.3.9), and the
//! deterministic vectors behind them and `/v1/embeddings`: the same text always gives the same
//! vector, derived from a hash of the text; `/api/embed` vectors are L2-normalised f32 (truncated
//! to `dimensions` and normalised again), legacy ones are raw f64.

use http::StatusCode;
use serde_json::{Value, json};

use super::gojson::{self, GoType, Shape};
use super::native::{Handled, bad_request, find, parse, text};
use super::record::lock;
use super::state::Ctx;
use super::stream::{Flavor, admit, metrics, serve};
use super::wire::{GIN_JSON, full, gin_error, gin_json, hash64, splitmix, token_count};

const EMBED: Shape = Shape {
    name: "api.EmbedRequest",
    fields: &[
        ("model", GoType::Str),
        ("truncate", GoType::Bool),
        ("dimensions", GoType::Int),
        ("options", GoType::Object("map[string]interface {}")),
    ],
};

const EMBEDDINGS: Shape = Shape {
    name: "api.EmbeddingRequest",
    fields: &[
        ("model", GoType::Str),
        ("prompt", GoType::Str),
        ("options", GoType::Object("map[string]interface {}")),
    ],
};

/// `POST /api/embed`.
pub(crate) async fn embed(ctx: &mut Ctx, body: &[u8]) -> Handled {
    let (request, keep) = parse(body, &EMBED, true)?;
    let model = text(&request, "model").to_owned();
    let inputs = inputs(request.get("input")).ok_or_else(|| bad_request("invalid input type"))?;
    if model.is_empty() {
        return Err(gin_error(StatusCode::NOT_FOUND, "model '' not found"));
    }
    find(ctx, &model, || {
        format!("model \"{model}\" not found, try pulling it first")
    })?;
    if inputs.is_empty() {
        lock(&ctx.shared.models).touch(&model, keep);
        return Ok(gin_json(
            StatusCode::OK,
            &json!({ "model": model, "embeddings": [] }),
        ));
    }
    let admitted = admit(ctx, Flavor::Native { streaming: false }, &model, keep).await?;
    lock(&ctx.shared.models).touch(&model, keep);
    let clock = serve(ctx, admitted).await?;
    let dimensions = request
        .get("dimensions")
        .and_then(Value::as_u64)
        .map(|n| n as usize);
    let size = ctx.shared.embedding_dimension;
    // Written by hand: the vectors' numbers as Go prints a float32.
    let embeddings: Vec<String> = inputs
        .iter()
        .map(|input| {
            let numbers: Vec<String> = embedding(input, size, dimensions)
                .into_iter()
                .map(gojson::float32)
                .collect();
            format!("[{}]", numbers.join(","))
        })
        .collect();
    let prompt_tokens: usize = inputs.iter().map(|input| token_count(input)).sum();
    let prompt_tokens = ctx.reported.prompt(prompt_tokens);
    let all = metrics(&clock, &ctx.reported, prompt_tokens, 0);
    let body = format!(
        r#"{{"model":{},"embeddings":[{}],"total_duration":{},"load_duration":{},"prompt_eval_count":{prompt_tokens}}}"#,
        Value::from(model),
        embeddings.join(","),
        all["total_duration"],
        all["load_duration"],
    );
    Ok(full(StatusCode::OK, Some(GIN_JSON), body))
}

/// `POST /api/embeddings` (legacy).
pub(crate) async fn embeddings(ctx: &mut Ctx, body: &[u8]) -> Handled {
    let (request, keep) = parse(body, &EMBEDDINGS, true)?;
    let model = text(&request, "model").to_owned();
    if model.is_empty() {
        return Err(bad_request("model is required"));
    }
    find(ctx, &model, || {
        format!("model \"{model}\" not found, try pulling it first")
    })?;
    let prompt = text(&request, "prompt").to_owned();
    if prompt.is_empty() {
        lock(&ctx.shared.models).touch(&model, keep);
        return Ok(gin_json(StatusCode::OK, &json!({ "embedding": [] })));
    }
    let admitted = admit(ctx, Flavor::Native { streaming: false }, &model, keep).await?;
    lock(&ctx.shared.models).touch(&model, keep);
    serve(ctx, admitted).await?;
    let vector = raw_vector(&prompt, ctx.shared.embedding_dimension);
    Ok(gin_json(StatusCode::OK, &json!({ "embedding": vector })))
}

/// The `input` of an embed request as a list of texts; `None` for a wrong type. An empty string
/// counts as no input, as in Ollama.
pub(crate) fn inputs(input: Option<&Value>) -> Option<Vec<String>> {
    match input {
        None | Some(Value::Null) => Some(Vec::new()),
        Some(Value::String(text)) if text.is_empty() => Some(Vec::new()),
        Some(Value::String(text)) => Some(vec![text.clone()]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| item.as_str().map(str::to_owned))
            .collect(),
        Some(_) => None,
    }
}

/// The L2-normalised f32 embedding of `text`: `size` values, or the first `dimensions` of them
/// when that is smaller, normalised again.
pub(crate) fn embedding(text: &str, size: usize, dimensions: Option<usize>) -> Vec<f32> {
    let mut vector = raw_vector(text, size);
    if let Some(dimensions) = dimensions.filter(|d| *d > 0 && *d < vector.len()) {
        vector.truncate(dimensions);
    }
    let norm = vector.iter().map(|x| x * x).sum::<f64>().sqrt();
    vector
        .iter()
        .map(|x| if norm > 0.0 { (x / norm) as f32 } else { 0.0 })
        .collect()
}

/// The raw, unnormalised vector of `text`: `size` values in [-1, 1).
pub(crate) fn raw_vector(text: &str, size: usize) -> Vec<f64> {
    let mut state = hash64(text);
    (0..size)
        .map(|_| {
            state = splitmix(state);
            (state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect()
}

/// An f32 as JSON with its shortest f32 digits, as Go prints a float32 (`0.12345679`).
pub(crate) fn f32_value(x: f32) -> Value {
    Value::from(x.to_string().parse::<f64>().unwrap_or(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectors_are_deterministic_and_normalised() {
        let a = embedding("hello", 8, None);
        assert_eq!(a, embedding("hello", 8, None));
        assert_ne!(a, embedding("hello!", 8, None));
        let norm: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5);
        let short = embedding("hello", 8, Some(3));
        assert_eq!(short.len(), 3);
        assert!((short.iter().map(|x| x * x).sum::<f32>().sqrt() - 1.0).abs() < 1e-5);
        assert_eq!(embedding("hello", 8, Some(20)).len(), 8);
        assert_eq!(f32_value(0.1).to_string(), "0.1");
    }

    #[test]
    fn inputs_accept_strings_and_arrays() {
        assert_eq!(inputs(Some(&json!("a"))), Some(vec!["a".to_owned()]));
        assert_eq!(inputs(Some(&json!(""))), Some(vec![]));
        assert_eq!(
            inputs(Some(&json!(["a", "b"]))),
            Some(vec!["a".to_owned(), "b".to_owned()])
        );
        assert_eq!(inputs(Some(&json!([1]))), None);
        assert_eq!(inputs(Some(&json!(3))), None);
    }
}
