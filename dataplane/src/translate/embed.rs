//! `/api/embed` and `/api/embeddings` → `/v1/embeddings`, and the answer back: vectors in
//! input order, L2-normalised for `/api/embed` and cut to `dimensions` (then normalised
//! again), as Ollama does; the legacy route's one vector as the engine gave it.

use serde_json::{Map, Value, json};

use super::refused;
use crate::error::ProxyError;

/// What an embedding request becomes.
#[derive(Debug)]
pub(super) enum Planned {
    /// The engine's request, and the `dimensions` asked for.
    Send(Map<String, Value>, Option<usize>),
    /// An empty input: Ollama answers an empty list without running anything.
    Empty,
}

/// The engine's request for an embedding `request` (`legacy`: `/api/embeddings`, whose input
/// is one `prompt`).
pub(super) fn request(
    request: &Map<String, Value>,
    model: &str,
    legacy: bool,
) -> Result<Planned, ProxyError> {
    let input = if legacy {
        match request.get("prompt") {
            None | Some(Value::Null) => return Ok(Planned::Empty),
            Some(Value::String(prompt)) if prompt.is_empty() => return Ok(Planned::Empty),
            Some(prompt @ Value::String(_)) => prompt.clone(),
            Some(_) => return Err(refused("prompt", "must be a string")),
        }
    } else {
        match request.get("input") {
            None | Some(Value::Null) => return Ok(Planned::Empty),
            Some(Value::String(input)) if input.is_empty() => return Ok(Planned::Empty),
            Some(Value::Array(inputs)) if inputs.is_empty() => return Ok(Planned::Empty),
            Some(input @ Value::String(_)) => input.clone(),
            Some(Value::Array(inputs)) if inputs.iter().all(Value::is_string) => {
                Value::Array(inputs.clone())
            }
            Some(_) => return Err(refused("input", "must be a string or an array of strings")),
        }
    };
    let dimensions = match request.get("dimensions") {
        None | Some(Value::Null) => None,
        Some(Value::Number(number)) => number
            .as_u64()
            .filter(|dimensions| *dimensions > 0)
            .and_then(|dimensions| usize::try_from(dimensions).ok()),
        Some(_) => return Err(refused("dimensions", "must be a positive number")),
    };
    let mut upstream = Map::new();
    upstream.insert("model".into(), json!(model));
    upstream.insert("input".into(), input);
    upstream.insert("encoding_format".into(), json!("float"));
    Ok(Planned::Send(upstream, dimensions))
}

/// The vectors of an OpenAI embeddings answer, in input order; `None` when it is not one.
pub(super) fn vectors(answer: &Value) -> Option<Vec<Vec<f64>>> {
    let data = answer.get("data")?.as_array()?;
    let mut indexed: Vec<(u64, Vec<f64>)> = data
        .iter()
        .enumerate()
        .map(|(place, item)| {
            let index = item
                .get("index")
                .and_then(Value::as_u64)
                .unwrap_or(place as u64);
            let vector = item
                .get("embedding")?
                .as_array()?
                .iter()
                .map(Value::as_f64)
                .collect::<Option<Vec<f64>>>()?;
            Some((index, vector))
        })
        .collect::<Option<_>>()?;
    indexed.sort_by_key(|(index, _)| *index);
    Some(indexed.into_iter().map(|(_, vector)| vector).collect())
}

/// `vector` cut to `dimensions` (when asked and shorter) and L2-normalised.
pub(super) fn normalised(mut vector: Vec<f64>, dimensions: Option<usize>) -> Vec<f64> {
    if let Some(dimensions) = dimensions {
        vector.truncate(dimensions);
    }
    let norm = vector.iter().map(|x| x * x).sum::<f64>().sqrt();
    if norm > 0.0 {
        for x in &mut vector {
            *x /= norm;
        }
    }
    vector
}
