//! `POST /v1/audio/transcriptions` (OpenAI-compatible, reference §A.4 "Also present"): a
//! `multipart/form-data` body whose `model` field names the model; in VRAM mode the model is
//! scheduled and loaded like any request's. The answer is OpenAI's `{"text": …}`. oqp queues
//! this route without reading its body, so the load is one its VRAM view did not make.

use http::StatusCode;
use serde_json::json;

use super::native::Handled;
use super::record::lock;
use super::state::Ctx;
use super::stream::{Flavor, refuse};
use super::wire::{openai_error, openai_json};

/// `POST /v1/audio/transcriptions`.
pub(crate) async fn transcriptions(ctx: &mut Ctx, body: &[u8]) -> Handled {
    let Some(model) = form_field(body, "model") else {
        return Err(openai_error(StatusCode::BAD_REQUEST, "model is required"));
    };
    if lock(&ctx.shared.models).find(&model).is_none() {
        return Err(openai_error(
            StatusCode::NOT_FOUND,
            &format!("model \"{model}\" not found, try pulling it first"),
        ));
    }
    lock(&ctx.shared.models).touch(&model, None);
    if let Some(vram) = &ctx.shared.vram {
        // Held while the answer is made, then kept for the default keep-alive.
        let _resident = vram
            .acquire(&model, None)
            .await
            .map_err(|refused| refuse(Flavor::OpenAi, &refused))?;
    }
    Ok(openai_json(StatusCode::OK, &json!({ "text": "hello" })))
}

/// The value of the form field `name` in a `multipart/form-data` body (any boundary).
fn form_field(body: &[u8], name: &str) -> Option<String> {
    let text = String::from_utf8_lossy(body);
    let marker = format!("name=\"{name}\"");
    let after = &text[text.find(&marker)? + marker.len()..];
    let value = &after[after.find("\r\n\r\n")? + 4..];
    let end = value.find("\r\n")?;
    Some(value[..end].to_owned()).filter(|value| !value.is_empty())
}
