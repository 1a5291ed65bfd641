//! The inference phase: a request for a model, its conversation, and a native request
//! translated for the engines that serve its model ([`crate::translate`]).

use std::sync::Arc;

use http::{HeaderValue, Response, header};

use bytes::Bytes;

use crate::affinity;
use crate::auth;
use crate::body::Body;
use crate::endpoint::Inference;
use crate::error::ProxyError;
use crate::policy::Policy;
use crate::proxy::{Outbound, RequestBody};
use crate::queued;
use crate::translate;
use crate::view::BodyView;

/// A native request whose model only `openai` hosts serve.
pub(super) struct Native {
    pub(super) route: translate::Route,
    /// The model as the client named it.
    pub(super) model: String,
    pub(super) body: Bytes,
    pub(super) session: Option<String>,
    /// The embedding cache, when it is on: a translated embedding request goes through it.
    pub(super) cache: Option<Arc<crate::cache::Cache>>,
}

/// Sends a native request translated for the engines that serve its model
/// ([`translate`]), queued, budgeted and accounted as the engine's route, and answers in
/// Ollama's shapes.
pub(super) async fn translated(
    queue: queued::Parts<'_>,
    policy: &Arc<Policy>,
    mut request: queued::Request,
    native: Native,
    mut outbound: Outbound,
) -> Result<Response<Body>, ProxyError> {
    let received = std::time::Instant::now();
    let upstream_model = translate::upstream_name(policy, &native.model);
    let plan = translate::plan(
        native.route,
        &native.body,
        &native.model,
        &upstream_model,
        translate::serves_infill(policy, &native.model),
        received,
    )?;
    let translated = match plan {
        translate::Plan::Answer(answer) => return Ok(answer),
        translate::Plan::Send(translated) => translated,
    };
    outbound.path_and_query = translated.path;
    outbound.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let view = BodyView::read(&translated.body).map_err(|_| ProxyError::BodyNotJson)?;
    // An embedding request is now the engine's `/v1/embeddings` (vectors as floats): the
    // embedding cache answers it per item, as for a client that sent it so, and its answer
    // becomes Ollama's as any translated answer does.
    if translated.inference == Inference::OpenAiEmbeddings
        && let Some(cache) = native.cache
    {
        let parts = crate::embeddings::Parts {
            queue,
            cache: Some(cache),
        };
        let answer = Box::pin(crate::embeddings::handle(
            parts,
            policy,
            request.caller,
            request.tier,
            translated.inference,
            outbound,
            (translated.body, view),
        ))
        .await?;
        return Ok(translate::response(translated.reply, answer));
    }
    let chain = conversation(
        policy,
        translated.inference,
        &outbound,
        (&translated.body, &view),
        &request.caller,
        Some(&native.model),
        native.session.as_deref(),
    );
    drop(view);
    outbound.body = RequestBody::Buffered(translated.body);
    request.model = Some(native.model);
    request.chain = chain;
    let answer = queued::send(queue, policy, request, outbound, || {}).await?;
    Ok(translate::response(translated.reply, answer))
}

/// The conversation a chat-shaped request continues, for prompt-cache affinity: scoped to
/// its caller (key or app user) unless `routing.affinity.share_across_keys`.
pub(super) fn conversation(
    policy: &Policy,
    inference: Inference,
    outbound: &Outbound,
    (body, view): (&[u8], &BodyView),
    client: &auth::Caller,
    model: Option<&str>,
    session: Option<&str>,
) -> Option<Arc<affinity::Chain>> {
    let settings = &policy.routing.affinity;
    if !settings.enabled {
        return None;
    }
    let shape = match inference {
        Inference::Generate => affinity::Shape::OllamaGenerate,
        Inference::Chat => affinity::Shape::OllamaChat,
        Inference::OpenAiCompletion if outbound.path_and_query.path() == "/v1/completions" => {
            affinity::Shape::OpenAiCompletion
        }
        Inference::OpenAiCompletion => affinity::Shape::OpenAiChat,
        Inference::AnthropicMessages => affinity::Shape::Messages,
        Inference::OpenAiResponses => affinity::Shape::Responses,
        Inference::Embed
        | Inference::Embeddings
        | Inference::OpenAiEmbeddings
        | Inference::Transcription => return None,
    };
    let model = crate::policy::normalize_model(model?);
    let scope = if settings.share_across_keys {
        ""
    } else {
        &client.id
    };
    affinity::Chain::read(shape, body, view, scope, &model, session).map(Arc::new)
}
