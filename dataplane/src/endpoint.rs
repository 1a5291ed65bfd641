//! What a request path is, as far as admission is concerned: a metadata read
//! that skips the queue, inference that is queued, a model-management call
//! that may be refused, or anything else (queued, streamed through).
//!
//! A path is classified only in its canonical form ([`path::canonical`]):
//! Ollama's router matches the decoded path, so a path whose raw and decoded
//! forms differ is refused before it is classified, and the path forwarded is
//! the one classified. With model management off, only the routes of
//! [`access`]'s allowlist are proxied: a route Ollama adds later is refused
//! until it is classified here.

pub mod path;

use http::Method;

/// The class of a proxied path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/`, `/api/version`, `/api/tags`, `/api/ps`, `/api/show`, `/api/status`,
    /// `/v1/models`, `/v1/models/{model}`: never queued.
    Metadata,
    /// Generation and embeddings: queued, body read whole.
    Inference(Inference),
    /// `/api/pull|push|delete|create|copy`, blobs and the ollama.com
    /// account routes: refused unless allowed.
    ModelManagement,
    /// Any other path: queued, body streamed through.
    Other,
}

/// The inference endpoints, whose bodies oqp reads (keep_alive, cache, model).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inference {
    /// `/api/generate`.
    Generate,
    /// `/api/chat`.
    Chat,
    /// `/api/embed`.
    Embed,
    /// `/api/embeddings` (legacy).
    Embeddings,
    /// `/v1/chat/completions`, `/v1/completions`.
    OpenAiCompletion,
    /// `/v1/embeddings`, translated to `/api/embed`.
    OpenAiEmbeddings,
    /// `/v1/messages`: Anthropic's Messages API (Claude Code, the anthropic SDKs).
    AnthropicMessages,
    /// `/v1/responses`: OpenAI's Responses API (Codex-style tools).
    OpenAiResponses,
    /// `/v1/audio/transcriptions`: a `multipart/form-data` body whose `model` field names
    /// the model ([`crate::form`]).
    Transcription,
}

impl Inference {
    /// Whether keep_alive defaulting applies (native endpoints only).
    pub fn takes_keep_alive(self) -> bool {
        matches!(
            self,
            Self::Generate | Self::Chat | Self::Embed | Self::Embeddings | Self::OpenAiEmbeddings
        )
    }

    /// Whether a request of this route streams its answer when its body says nothing
    /// (`stream` absent or not a boolean): `None` for a route that does not generate text
    /// (embeddings answer whole and quickly). Ollama's native routes stream by default,
    /// the OpenAI and Anthropic shapes do not.
    pub fn streams_by_default(self) -> Option<bool> {
        match self {
            Self::Generate | Self::Chat => Some(true),
            Self::OpenAiCompletion
            | Self::AnthropicMessages
            | Self::OpenAiResponses
            | Self::Transcription => Some(false),
            Self::Embed | Self::Embeddings | Self::OpenAiEmbeddings => None,
        }
    }

    /// Whether Ollama reads the body as JSON (all but a transcription's form).
    pub fn reads_json(self) -> bool {
        self != Self::Transcription
    }

    /// Whether responses may come from the embedding cache.
    pub fn is_embedding(self) -> bool {
        matches!(
            self,
            Self::Embed | Self::Embeddings | Self::OpenAiEmbeddings
        )
    }
}

impl Endpoint {
    /// Classifies a request path (without query). Matching is exact, as
    /// Ollama's router is: `/api/tags/` is not `/api/tags`.
    pub fn of(path: &str) -> Self {
        match path {
            "/" | "/api/version" | "/api/tags" | "/api/ps" | "/api/show" | "/api/status"
            | "/v1/models" => Self::Metadata,
            _ if is_model_retrieve(path) => Self::Metadata,
            "/api/generate" => Self::Inference(Inference::Generate),
            "/api/chat" => Self::Inference(Inference::Chat),
            "/api/embed" => Self::Inference(Inference::Embed),
            "/api/embeddings" => Self::Inference(Inference::Embeddings),
            "/v1/chat/completions" | "/v1/completions" => {
                Self::Inference(Inference::OpenAiCompletion)
            }
            "/v1/embeddings" => Self::Inference(Inference::OpenAiEmbeddings),
            "/v1/messages" => Self::Inference(Inference::AnthropicMessages),
            "/v1/responses" => Self::Inference(Inference::OpenAiResponses),
            "/v1/audio/transcriptions" => Self::Inference(Inference::Transcription),
            "/api/pull" | "/api/push" | "/api/delete" | "/api/create" | "/api/copy" | "/api/me"
            | "/api/signout" => Self::ModelManagement,
            _ if path.starts_with("/api/blobs/") || path.starts_with("/api/user/keys/") => {
                Self::ModelManagement
            }
            _ => Self::Other,
        }
    }

    /// Whether the request body is read whole before admission (bounded by
    /// `max_request_body_mb`). Other bodies are streamed to the upstream.
    pub fn reads_body(self) -> bool {
        matches!(self, Self::Inference(_) | Self::Metadata)
    }
}

/// Whether `path` is a model blob's (`/api/blobs/{digest}`): model management, whose body
/// is as large as a model.
pub fn is_blob(path: &str) -> bool {
    path.starts_with("/api/blobs/")
}

/// Whether a request may be proxied while model management is off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// On the allowlist: inference, metadata and model reads.
    Proxied,
    /// A known model-management or account route.
    ModelManagement,
    /// Not on the allowlist (a route unknown to oqp, or a method the route
    /// does not serve).
    Unlisted,
}

/// The allowlist of routes proxied while `proxy.allow_model_management` is
/// false, by method and canonical path: the routes of Ollama's native API
/// and of its OpenAI- and Anthropic-compatible layer that read models or run
/// them. `HEAD` goes wherever `GET` does and `OPTIONS` (a CORS preflight)
/// wherever either method does.
pub fn access(method: &Method, path: &str) -> Access {
    if Endpoint::of(path) == Endpoint::ModelManagement {
        return Access::ModelManagement;
    }
    let read = matches!(
        path,
        "/" | "/api/version" | "/api/tags" | "/api/ps" | "/api/status" | "/v1/models"
    ) || is_model_retrieve(path);
    let run = matches!(
        path,
        "/api/show"
            | "/api/generate"
            | "/api/chat"
            | "/api/embed"
            | "/api/embeddings"
            | "/v1/chat/completions"
            | "/v1/completions"
            | "/v1/embeddings"
            | "/v1/responses"
            | "/v1/messages"
            | "/v1/audio/transcriptions"
    );
    let allowed = match *method {
        Method::GET | Method::HEAD => read,
        Method::POST => run,
        Method::OPTIONS => read || run,
        _ => false,
    };
    if allowed {
        Access::Proxied
    } else {
        Access::Unlisted
    }
}

/// `/v1/models/{model}`: one non-empty segment (Ollama's route), which a
/// model name with a namespace (`library/llama3`) cannot be unencoded.
fn is_model_retrieve(path: &str) -> bool {
    path.strip_prefix("/v1/models/")
        .is_some_and(|model| !model.is_empty() && !model.contains('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification_is_exact() {
        assert_eq!(Endpoint::of("/api/tags"), Endpoint::Metadata);
        assert_eq!(Endpoint::of("/api/tags/"), Endpoint::Other);
        assert_eq!(Endpoint::of("/"), Endpoint::Metadata);
        assert_eq!(
            Endpoint::of("/api/embed"),
            Endpoint::Inference(Inference::Embed)
        );
        assert_eq!(Endpoint::of("/api/pull"), Endpoint::ModelManagement);
        assert_eq!(
            Endpoint::of("/api/blobs/sha256:00"),
            Endpoint::ModelManagement
        );
        assert_eq!(Endpoint::of("/api/user/keys/k"), Endpoint::ModelManagement);
        assert_eq!(Endpoint::of("/api/blob"), Endpoint::Other);
        assert_eq!(Endpoint::of("/v1/models"), Endpoint::Metadata);
        assert_eq!(Endpoint::of("/v1/models/llama3:8b"), Endpoint::Metadata);
        assert_eq!(Endpoint::of("/v1/models/a/b"), Endpoint::Other);
        assert_eq!(
            Endpoint::of("/v1/messages"),
            Endpoint::Inference(Inference::AnthropicMessages)
        );
        assert_eq!(
            Endpoint::of("/v1/responses"),
            Endpoint::Inference(Inference::OpenAiResponses)
        );
    }

    #[test]
    fn the_allowlist_names_reads_and_runs_only() {
        for (method, path) in [
            (Method::GET, "/"),
            (Method::HEAD, "/"),
            (Method::HEAD, "/api/version"),
            (Method::GET, "/api/tags"),
            (Method::GET, "/api/ps"),
            (Method::GET, "/api/status"),
            (Method::POST, "/api/show"),
            (Method::POST, "/api/generate"),
            (Method::POST, "/api/chat"),
            (Method::POST, "/api/embed"),
            (Method::POST, "/api/embeddings"),
            (Method::POST, "/v1/chat/completions"),
            (Method::POST, "/v1/completions"),
            (Method::POST, "/v1/embeddings"),
            (Method::POST, "/v1/responses"),
            (Method::POST, "/v1/messages"),
            (Method::GET, "/v1/models"),
            (Method::GET, "/v1/models/llama3:latest"),
            (Method::OPTIONS, "/api/chat"),
        ] {
            assert_eq!(access(&method, path), Access::Proxied, "{method} {path}");
        }
        for (method, path) in [
            (Method::POST, "/api/pull"),
            (Method::POST, "/api/push"),
            (Method::POST, "/api/create"),
            (Method::POST, "/api/copy"),
            (Method::DELETE, "/api/delete"),
            (Method::POST, "/api/blobs/sha256:00"),
            (Method::HEAD, "/api/blobs/sha256:00"),
            (Method::POST, "/api/me"),
            (Method::POST, "/api/signout"),
            (Method::DELETE, "/api/user/keys/abc"),
        ] {
            assert_eq!(
                access(&method, path),
                Access::ModelManagement,
                "{method} {path}"
            );
        }
        for (method, path) in [
            (Method::DELETE, "/v1/models/llama3"),
            (Method::GET, "/v1/models/"),
            (Method::GET, "/v1/models/library/llama3"),
            (Method::DELETE, "/api/generate"),
            (Method::GET, "/api/generate"),
            (Method::PUT, "/api/chat"),
            (Method::POST, "/api/tags"),
            (Method::GET, "/api/tags/"),
            (Method::POST, "/api/experimental/web_search"),
            (Method::POST, "/api/future-route"),
            (Method::GET, "/no/such/path"),
            (Method::GET, "/API/TAGS"),
        ] {
            assert_eq!(access(&method, path), Access::Unlisted, "{method} {path}");
        }
    }
}
