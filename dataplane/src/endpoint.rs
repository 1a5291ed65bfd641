//! What a request path is, as far as admission is concerned: a metadata read
//! that skips the queue, inference that is queued, a model-management call
//! that may be refused, or anything else (queued, streamed through).

/// The class of a proxied path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/`, `/api/version`, `/api/tags`, `/api/ps`, `/api/show`: never queued.
    Metadata,
    /// Generation and embeddings: queued, body read whole.
    Inference(Inference),
    /// `/api/pull|push|delete|create|copy`: refused unless allowed.
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
}

impl Inference {
    /// Whether keep_alive defaulting applies (native endpoints only).
    pub fn takes_keep_alive(self) -> bool {
        matches!(
            self,
            Self::Generate | Self::Chat | Self::Embed | Self::Embeddings | Self::OpenAiEmbeddings
        )
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
            "/" | "/api/version" | "/api/tags" | "/api/ps" | "/api/show" => Self::Metadata,
            "/api/generate" => Self::Inference(Inference::Generate),
            "/api/chat" => Self::Inference(Inference::Chat),
            "/api/embed" => Self::Inference(Inference::Embed),
            "/api/embeddings" => Self::Inference(Inference::Embeddings),
            "/v1/chat/completions" | "/v1/completions" => {
                Self::Inference(Inference::OpenAiCompletion)
            }
            "/v1/embeddings" => Self::Inference(Inference::OpenAiEmbeddings),
            "/api/pull" | "/api/push" | "/api/delete" | "/api/create" | "/api/copy" => {
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
        assert_eq!(Endpoint::of("/api/blobs/sha256:00"), Endpoint::Other);
    }
}
