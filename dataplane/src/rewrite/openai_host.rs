//! `/v1/embeddings` on a host of kind `openai`.
//!
//! The request path turns `/v1/embeddings` into Ollama's `/api/embed` before
//! a host is chosen, so that the queue and the per-item embedding cache see
//! one shape. A host that serves OpenAI's API (llama-server, vLLM …) has no
//! `/api/embed`: at that host the request goes back to `/v1/embeddings`, the
//! client's own body as it came (only `input` replaced when the cache asks
//! for some items, and `encoding_format` set to `float` so the vectors can be
//! cached and reassembled), and its answer is read back into the `/api/embed`
//! shape the rest of the path expects:
//!
//! ```text
//! client ─/v1/embeddings─► translate ─/api/embed─► cache ─► queue ─► host
//!   ollama host: /api/embed as it is
//!   openai host: [`embed_request`] ─/v1/embeddings─► engine ─► [`embed_response`]
//! ```
//!
//! The answer's vectors keep the engine's number text, so the cache stores
//! exactly what the engine printed; `usage.prompt_tokens` becomes
//! `prompt_eval_count`, which accounting reads.

use bytes::Bytes;
use serde_json::Value;

use super::{scan, splice};

/// The path an `openai` host answers embeddings on.
pub const EMBEDDINGS_PATH: &str = "/v1/embeddings";

/// The `/v1/embeddings` body for an `openai` host: the client's `origin`
/// body with its `input` replaced by the `input` of `embed` (the
/// `/api/embed` fetch, which may ask for fewer items than the client sent),
/// unless both say the same, and with `encoding_format` set to `"float"`
/// when the client asked for another. `None` when either body is not a JSON
/// object with an `input`.
pub fn embed_request(origin: &[u8], embed: &[u8]) -> Option<Bytes> {
    let origin_object = scan::top_object(origin)?;
    let embed_object = scan::top_object(embed)?;
    let wanted = embed_object.get(embed, "input")?.value.clone();
    let given = origin_object.get(origin, "input")?.value.clone();
    let parse = |bytes: &[u8]| serde_json::from_slice::<Value>(bytes).ok();
    let mut edits: Vec<(std::ops::Range<usize>, &[u8])> = Vec::new();
    let wanted_value = parse(&embed[wanted.clone()])?;
    if parse(&origin[given.clone()]).as_ref() != Some(&wanted_value) {
        edits.push((given, &embed[wanted]));
    }
    if let Some(format) = origin_object.get(origin, "encoding_format")
        && parse(&origin[format.value.clone()]) != Some(Value::String("float".to_owned()))
    {
        edits.push((format.value.clone(), b"\"float\""));
    }
    edits.sort_by_key(|(range, _)| range.start);
    Some(splice(origin, &edits))
}

/// An engine's `/v1/embeddings` answer (status 200) read into Ollama's
/// `/api/embed` shape: `{"model":…,"embeddings":[…in index order…],
/// "prompt_eval_count":n}` with `n` the answer's `usage.prompt_tokens`
/// (left out when absent). `None` when it is not such an answer (a vector
/// that is not an array of numbers, an index missing or repeated).
pub fn embed_response(answer: &[u8], model: &str) -> Option<Bytes> {
    let object = scan::top_object(answer)?;
    let data = object.get(answer, "data")?.value.clone();
    let elements = scan::array_elements(answer, data)?;
    let mut vectors: Vec<Option<&[u8]>> = vec![None; elements.len()];
    for element in elements {
        let item = scan::top_object(&answer[element.clone()])?;
        let bytes = &answer[element];
        let index: usize = serde_json::from_slice(&bytes[item.get(bytes, "index")?.value.clone()])
            .ok()
            .filter(|index: &usize| *index < vectors.len())?;
        let vector = &bytes[item.get(bytes, "embedding")?.value.clone()];
        if !super::scan::is_vector(vector) || vectors[index].replace(vector).is_some() {
            return None;
        }
    }
    let tokens = object.get(answer, "usage").and_then(|usage| {
        let usage = &answer[usage.value.clone()];
        let fields = scan::top_object(usage)?;
        serde_json::from_slice::<u64>(&usage[fields.get(usage, "prompt_tokens")?.value.clone()])
            .ok()
    });
    let mut out = Vec::with_capacity(answer.len() + model.len() + 64);
    out.extend_from_slice(br#"{"model":"#);
    out.extend_from_slice(Value::String(model.to_owned()).to_string().as_bytes());
    out.extend_from_slice(br#","embeddings":["#);
    for (position, vector) in vectors.into_iter().enumerate() {
        if position > 0 {
            out.push(b',');
        }
        out.extend_from_slice(vector?);
    }
    out.push(b']');
    if let Some(tokens) = tokens {
        out.extend_from_slice(format!(r#","prompt_eval_count":{tokens}"#).as_bytes());
    }
    out.push(b'}');
    Some(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(bytes: Option<Bytes>) -> String {
        String::from_utf8(bytes.expect("translated").to_vec()).unwrap()
    }

    #[test]
    fn the_clients_body_goes_as_it_came_when_the_fetch_asks_for_everything() {
        let origin = br#"{"model":"e5", "input":["h\u00e9", "b"],"user":"u","embd_normalize":-1}"#;
        let embed = r#"{"model":"e5","input":["hé","b"],"keep_alive":"5m"}"#.as_bytes();
        assert_eq!(
            text(embed_request(origin, embed)).as_bytes(),
            origin.as_slice()
        );
    }

    #[test]
    fn a_partial_fetch_replaces_only_the_input_and_base64_becomes_float() {
        let origin = br#"{"encoding_format":"base64","model":"e5","input":["a","b","c"]}"#;
        let embed = br#"{"model":"e5","input":["b"]}"#;
        assert_eq!(
            text(embed_request(origin, embed)),
            r#"{"encoding_format":"float","model":"e5","input":["b"]}"#
        );
        // A string input translated to a one-element list is the same request.
        let origin = br#"{"model":"e5","input":"one","encoding_format":"float"}"#;
        assert_eq!(
            text(embed_request(origin, br#"{"model":"e5","input":"one"}"#)).as_bytes(),
            origin.as_slice()
        );
        assert!(embed_request(b"[1]", br#"{"input":"x"}"#).is_none());
        assert!(embed_request(br#"{"model":"e5"}"#, br#"{"input":"x"}"#).is_none());
    }

    #[test]
    fn an_engine_answer_becomes_ollamas_in_index_order_with_its_token_count() {
        let answer =
            br#"{"model":"alias","object":"list","usage":{"prompt_tokens":5,"total_tokens":5},
            "data":[{"embedding":[3,4e-7],"index":1,"object":"embedding"},
                    {"embedding":[0.5,-1.0],"index":0,"object":"embedding"}]}"#;
        assert_eq!(
            text(embed_response(answer, "e5:latest")),
            r#"{"model":"e5:latest","embeddings":[[0.5,-1.0],[3,4e-7]],"prompt_eval_count":5}"#
        );
        let no_usage = br#"{"data":[{"embedding":[1],"index":0}]}"#;
        assert_eq!(
            text(embed_response(no_usage, "m")),
            r#"{"model":"m","embeddings":[[1]]}"#
        );
    }

    #[test]
    fn an_answer_that_is_not_a_list_of_vectors_is_refused() {
        for answer in [
            br#"{"data":[{"embedding":"AAAA","index":0}]}"#.as_slice(),
            br#"{"data":[{"embedding":[1],"index":1}]}"#,
            br#"{"data":[{"embedding":[1],"index":0},{"embedding":[2],"index":0}]}"#,
            br#"{"data":[{"embedding":[1]}]}"#,
            br#"{"error":{"message":"no"}}"#,
            b"not json",
        ] {
            assert!(
                embed_response(answer, "m").is_none(),
                "{}",
                String::from_utf8_lossy(answer)
            );
        }
    }
}
