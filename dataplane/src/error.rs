//! Every error the data plane answers by itself, and the one function that
//! turns them into HTTP: status, headers and the
//! `{"error": "…", "request_id": "…"}` body of the reference catalogue.

use http::{HeaderValue, Response, StatusCode, header};

use crate::body::{self, Body};
use crate::headers;
use crate::policy::Scope;
use crate::scheduler::Tier;

pub mod retry;

pub use retry::{Attempt, Elsewhere};

/// A refusal or failure produced by the proxy itself (never an upstream
/// answer, which is passed through as it is).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProxyError {
    /// No usable `Authorization: Bearer` header.
    #[error("missing or invalid authorization header")]
    MissingCredentials,
    /// A bearer key that matches no client.
    #[error("invalid api key")]
    UnknownKey,
    /// A user's signed token (`jwt:`) that failed a check; the reason names the check.
    #[error("invalid token: {0}")]
    InvalidToken(crate::jwt::TokenError),
    /// The request's key was revoked, or expired, while the request waited in the queue.
    #[error("invalid api key (revoked or expired while the request was queued)")]
    KeyRevoked,
    /// Too many failed attempts from this address.
    #[error("too many authentication failures")]
    TooManyAuthFailures {
        /// Seconds until the caller may try again.
        retry_after: u64,
    },
    /// Too many metadata reads from this client (`auth.metadata_rate_limit`).
    #[error("too many metadata requests")]
    TooManyMetadataReads {
        /// Seconds until the client may read again.
        retry_after: u64,
    },
    /// A known key without the required scope.
    #[error("{} permission required", .0.as_str())]
    ScopeRequired(Scope),
    /// A key with a model allowlist (`auth.keys[].models`) asked for another model.
    #[error("model '{0}' is not allowed for this key")]
    ModelNotAllowed(String),
    /// An app key's request named its end user with a value that is not one (1–128 bytes
    /// of printable ASCII, no `/`, no space); the text names where it was read.
    #[error("invalid user in {0}")]
    InvalidUser(String),
    /// The management query named no valid tier.
    #[error("invalid tier: '{0}' (must be high, normal, or low)")]
    InvalidTier(String),
    /// The request body is larger than `proxy.max_request_body_mb`.
    #[error("request body too large")]
    BodyTooLarge,
    /// A body Ollama reads that is not exactly one JSON value: malformed, or followed by
    /// anything but whitespace (see [`crate::view`]).
    #[error("request body must be one JSON value, with nothing after it but whitespace")]
    BodyNotJson,
    /// A `multipart/form-data` body (`/v1/audio/transcriptions`) whose `model` oqp cannot
    /// read the one way Ollama would (see [`crate::form`]).
    #[error("request form unreadable: {0}")]
    FormUnreadable(crate::form::FormError),
    /// A key with a model allowlist sent a request that names no model Ollama would read
    /// (no `model`, or one that is not a string).
    #[error("this key may use only some models: the request must name one in a string `model`")]
    ModelUnreadable,
    /// The client stopped sending its body.
    #[error("request body could not be read")]
    BodyUnreadable,
    /// Model management is disabled in the config.
    #[error(
        "model management endpoints are disabled; set allow_model_management: true in config to enable"
    )]
    ModelManagementDisabled,
    /// With model management off, a route outside the allowlist of
    /// inference and metadata routes.
    #[error(
        "this route is not proxied while model management is disabled (only inference and metadata routes are); set allow_model_management: true in config to enable"
    )]
    RouteNotProxied,
    /// A path with a `%` escape, an empty or a dot segment, which the
    /// upstream could route as another path.
    #[error("request path must not contain percent escapes, empty segments or dot segments")]
    PathNotCanonical,
    /// The tier refuses new requests.
    #[error("queue tier '{}' is paused", .0.as_str())]
    TierPaused(Tier),
    /// The tier is at its depth limit, or the client at its queued limit.
    #[error("queue full")]
    QueueFull {
        /// 503 or 429, as configured.
        status: StatusCode,
        /// Seconds, from the observed drain rate.
        retry_after: u64,
    },
    /// The queue's byte ceiling is reached.
    #[error("queue over capacity (bytes)")]
    OverCapacity {
        /// 503 or 429, as configured.
        status: StatusCode,
        /// Seconds, from the observed drain rate.
        retry_after: u64,
    },
    /// The request waited `max_wait` without being dispatched.
    #[error("request expired in queue")]
    Expired,
    /// An operator flushed the tier while the request waited.
    #[error("request flushed from queue")]
    Flushed,
    /// No upstream host could answer; the hosts tried and why each failed.
    #[error("all upstream hosts failed{0}")]
    AllHostsFailed(Failures),
    /// No upstream host answered, and at least one failed after the request was written to
    /// it (a timeout, a connection that broke): the same answer as [`Self::AllHostsFailed`],
    /// but the request may have run, so no other GPU box is asked.
    #[error("all upstream hosts failed{0}")]
    HostsFailedAfterWrite(Failures),
    /// The data plane is shutting down.
    #[error("proxy is shutting down")]
    ShuttingDown,
    /// A management action needs the control plane, which is unreachable.
    #[error("control plane unavailable: {0}")]
    ControlPlaneUnavailable(String),
    /// A queue-control call from a page of another origin.
    #[error("cross-origin request refused: the Origin is not this proxy")]
    ForeignOrigin,
    /// A queue-control call with a body that is not JSON.
    #[error("queue control takes no body or an application/json one")]
    UnsupportedMediaType,
    /// The path is not served (disabled dashboard).
    #[error("Not Found")]
    NotFound,
    /// The whole request body did not arrive within `proxy.body_read_timeout`.
    #[error("request body not received within the body read timeout")]
    BodyTimeout,
    /// A request asserting a node hop (`x-oqp-hop`) that does not verify.
    #[error("node hop not verified")]
    HopUnverified,
    /// A peer forwarded a request of a client this node's snapshot does not hold (yet, or
    /// any more): another box may know it.
    #[error("client not known to this node")]
    ClientUnknownHere,
    /// The owner node failed after the request reached it, before its answer's head (the
    /// request may have run, so it is not sent anywhere else).
    #[error("node '{0}' failed before answering")]
    PeerFailed(String),
    /// The client has spent a budget of its window (`auth.keys[].budget`).
    #[error("budget exceeded: {budget}")]
    BudgetExceeded {
        /// Which budget, as "gpu_seconds 7200 per 1d".
        budget: String,
        /// Seconds until the window resets.
        retry_after: u64,
    },
    /// Every account of a cloud host refused the model with a 402: it bills extra usage only,
    /// and every account's extra-usage balance is empty. Names the model, never a key or an
    /// account.
    #[error(
        "Ollama Cloud refused model '{model}' on every account: it uses extra usage only and \
         every account's extra usage balance is empty"
    )]
    CloudExtraUsageEmpty {
        /// The model asked for.
        model: String,
    },
    /// The client is over a per-minute limit (`rate_limit`).
    #[error("rate limit exceeded: {limit}")]
    RateLimited {
        /// Which limit, as "60 requests per minute".
        limit: String,
        /// Seconds until the bucket holds enough for the request.
        retry_after: u64,
    },
    /// An embed request with more inputs than `embedding_cache.max_inputs`.
    #[error("too many embedding inputs: at most {limit} per request (embedding_cache.max_inputs)")]
    TooManyInputs {
        /// The limit.
        limit: usize,
    },
    /// A request in Ollama's own API for a model that only OpenAI-compatible engines serve,
    /// which oqp cannot translate (a field with no equivalent, a model no host serves, a
    /// model-management route): Ollama's status and wording (see `crate::translate`).
    #[error("{message}")]
    NotTranslatable {
        /// 400 (a field), 404 (no host serves the model) or 501 (a route the engine lacks).
        status: StatusCode,
        /// What cannot be done, naming the field or the host kind.
        message: String,
    },
}

/// Why one upstream host gave no answer, as a class a person can act on: never the
/// address, the OS error or the library's wording.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// Nothing listens at the host's address (the engine is not running, or listens
    /// elsewhere).
    ConnectionRefused,
    /// No connection, or no answer's head, within the configured time.
    Timeout,
    /// The connection could not be made for another reason (name resolution, route, TLS).
    ConnectionFailed,
    /// The connection broke before the answer's head.
    ConnectionClosed,
    /// The host answered with an error status.
    Http(StatusCode),
    /// The host answered, but not with what the route expects (a body that is not JSON).
    InvalidAnswer,
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ConnectionRefused => f.write_str("connection refused"),
            Self::Timeout => f.write_str("timeout"),
            Self::ConnectionFailed => f.write_str("connection failed"),
            Self::ConnectionClosed => f.write_str("connection closed"),
            Self::Http(status) => write!(f, "HTTP {}", status.as_u16()),
            Self::InvalidAnswer => f.write_str("invalid answer"),
        }
    }
}

/// The hosts a request was sent to and why each failed, in the order tried. Shown after
/// the message as `: gpu-a (connection refused), gpu-b (timeout)`; nothing when empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Failures(Vec<(std::sync::Arc<str>, Cause)>);

/// Most hosts a 503 names; the rest are counted.
const MAX_NAMED_FAILURES: usize = 8;

impl Failures {
    /// No host tried (or nothing known of why).
    pub fn none() -> Self {
        Self::default()
    }

    /// `host` failed with `cause` (a host tried twice is named once, with its last cause).
    pub fn push(&mut self, host: std::sync::Arc<str>, cause: Cause) {
        self.0.retain(|(name, _)| *name != host);
        self.0.push((host, cause));
    }

    /// Whether no failure was recorded.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Display for Failures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (index, (host, cause)) in self.0.iter().take(MAX_NAMED_FAILURES).enumerate() {
            let separator = if index == 0 { ": " } else { ", " };
            write!(f, "{separator}{host} ({cause})")?;
        }
        if self.0.len() > MAX_NAMED_FAILURES {
            write!(f, " and {} more", self.0.len() - MAX_NAMED_FAILURES)?;
        }
        Ok(())
    }
}

impl ProxyError {
    /// No host could answer, for want of any known cause.
    pub fn hosts_failed() -> Self {
        Self::AllHostsFailed(Failures::none())
    }

    /// The HTTP status of this error.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::MissingCredentials
            | Self::UnknownKey
            | Self::InvalidToken(_)
            | Self::KeyRevoked
            | Self::HopUnverified => StatusCode::UNAUTHORIZED,
            Self::PeerFailed(_) => StatusCode::BAD_GATEWAY,
            Self::TooManyAuthFailures { .. }
            | Self::TooManyMetadataReads { .. }
            | Self::BudgetExceeded { .. }
            | Self::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::ScopeRequired(_)
            | Self::ModelNotAllowed(_)
            | Self::ModelManagementDisabled
            | Self::RouteNotProxied
            | Self::ForeignOrigin => StatusCode::FORBIDDEN,
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::CloudExtraUsageEmpty { .. } => StatusCode::PAYMENT_REQUIRED,
            Self::InvalidTier(_)
            | Self::InvalidUser(_)
            | Self::BodyUnreadable
            | Self::BodyNotJson
            | Self::FormUnreadable(_)
            | Self::ModelUnreadable
            | Self::PathNotCanonical => StatusCode::BAD_REQUEST,
            Self::BodyTooLarge | Self::TooManyInputs { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::QueueFull { status, .. }
            | Self::OverCapacity { status, .. }
            | Self::NotTranslatable { status, .. } => *status,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::TierPaused(_)
            | Self::Expired
            | Self::Flushed
            | Self::AllHostsFailed(_)
            | Self::HostsFailedAfterWrite(_)
            | Self::ShuttingDown
            | Self::ClientUnknownHere
            | Self::ControlPlaneUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The `Retry-After` value, where the catalogue gives one.
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            Self::TooManyAuthFailures { retry_after }
            | Self::TooManyMetadataReads { retry_after }
            | Self::QueueFull { retry_after, .. }
            | Self::OverCapacity { retry_after, .. }
            | Self::BudgetExceeded { retry_after, .. }
            | Self::RateLimited { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    /// Whether another GPU box may still take the request: the refusals of one box (its
    /// queue, its byte ceiling, the client's cap on it, its hosts, its shutdown), not of
    /// the request.
    pub fn worth_another_box(&self) -> bool {
        self.attempt().may_go(Elsewhere::Box)
    }

    /// What a box that answered with this error did with the request ([`Attempt`]): the
    /// refusals of the box, before any work (its hosts all failed before it ran: none of
    /// them took it), or a failure after a host may have run it, or the request's own.
    pub fn attempt(&self) -> Attempt {
        match self {
            Self::QueueFull { .. }
            | Self::OverCapacity { .. }
            | Self::AllHostsFailed(_)
            | Self::ShuttingDown
            | Self::ClientUnknownHere => Attempt::Refused,
            // A host broke the connection or went silent after it was written.
            Self::HostsFailedAfterWrite(_) => Attempt::Broken,
            _ => Attempt::Final,
        }
    }

    /// The response for this error, carrying `request_id` in the body and in
    /// `X-Request-ID`, in the error shape of the route asked for (`shape`), so that an
    /// SDK shows the reason and backs off as it would with the real API.
    pub fn into_response(self, request_id: &str, shape: Shape) -> Response<Body> {
        let body = match (&self, shape) {
            // The reference answers a disabled dashboard like an unknown route.
            (Self::NotFound, _) => serde_json::json!({ "detail": "Not Found" }),
            (other, Shape::Native) => {
                serde_json::json!({ "error": other.to_string(), "request_id": request_id })
            }
            (other, Shape::Anthropic) => serde_json::json!({
                "type": "error",
                "error": { "type": anthropic_type(other.status()), "message": other.to_string() },
                "request_id": request_id,
            }),
            (other, Shape::OpenAi) => serde_json::json!({
                "error": {
                    "message": other.to_string(),
                    "type": openai_type(other.status()),
                    "param": null,
                    "code": other.code(),
                },
                "request_id": request_id,
            }),
        };
        let mut response = Response::new(body::json(&body));
        *response.status_mut() = self.status();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Ok(id) = HeaderValue::from_str(request_id) {
            headers.insert(headers::REQUEST_ID, id);
        }
        if matches!(
            self,
            Self::MissingCredentials | Self::UnknownKey | Self::KeyRevoked
        ) {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Self::InvalidToken(_) = self {
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer error=\"invalid_token\""),
            );
        }
        if let Some(seconds) = self.retry_after() {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if matches!(
            self,
            Self::AllHostsFailed(_) | Self::HostsFailedAfterWrite(_)
        ) {
            headers.insert(
                headers::FAILOVER_EXHAUSTED,
                HeaderValue::from_static("true"),
            );
        }
        response
    }
}

/// The error body's shape: oqp's own (Ollama's `{"error": "…"}`), or the one of the API
/// layer the route belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// `{"error": "…", "request_id": …}`: the native API and oqp's own routes.
    Native,
    /// `{"type":"error","error":{"type":…,"message":…}}`: `/v1/messages`.
    Anthropic,
    /// `{"error":{"message":…,"type":…,"param":null,"code":…}}`: `/v1/responses`.
    OpenAi,
}

impl Shape {
    /// The shape of the route a request path names (as received: a path that is not
    /// canonical is refused in oqp's own shape anyway).
    pub fn of(path: &str) -> Self {
        match path {
            "/v1/messages" => Self::Anthropic,
            // The other OpenAI-compatible routes keep oqp's own shape, which their
            // clients already read (`/v1/embeddings` documents it).
            "/v1/responses" => Self::OpenAi,
            _ => Self::Native,
        }
    }
}

/// Anthropic's error type for a status, as its SDKs map them to exceptions.
fn anthropic_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// OpenAI's error type for a status.
fn openai_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    }
}

impl ProxyError {
    /// A stable machine-readable code for the OpenAI shape, where one helps a client.
    fn code(&self) -> Option<&'static str> {
        match self {
            Self::BudgetExceeded { .. } => Some("budget_exceeded"),
            Self::RateLimited { .. } => Some("rate_limit_exceeded"),
            Self::MissingCredentials | Self::UnknownKey | Self::KeyRevoked => {
                Some("invalid_api_key")
            }
            Self::InvalidToken(_) => Some("invalid_token"),
            Self::QueueFull { .. } | Self::OverCapacity { .. } => Some("queue_full"),
            Self::ModelNotAllowed(_) => Some("model_not_allowed"),
            Self::CloudExtraUsageEmpty { .. } => Some("extra_usage_empty"),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[test]
    fn only_a_boxs_own_refusal_sends_a_request_to_another_box() {
        let full = StatusCode::SERVICE_UNAVAILABLE;
        let table = [
            (
                ProxyError::QueueFull {
                    status: full,
                    retry_after: 1,
                },
                Attempt::Refused,
            ),
            (
                ProxyError::OverCapacity {
                    status: full,
                    retry_after: 1,
                },
                Attempt::Refused,
            ),
            (ProxyError::hosts_failed(), Attempt::Refused),
            (ProxyError::ShuttingDown, Attempt::Refused),
            (ProxyError::ClientUnknownHere, Attempt::Refused),
            (
                ProxyError::HostsFailedAfterWrite(Failures::none()),
                Attempt::Broken,
            ),
            (ProxyError::BodyNotJson, Attempt::Final),
            (ProxyError::ModelUnreadable, Attempt::Final),
            (ProxyError::Expired, Attempt::Final),
        ];
        for (error, attempt) in table {
            assert_eq!(error.attempt(), attempt, "{error}");
            assert_eq!(
                error.worth_another_box(),
                attempt == Attempt::Refused,
                "{error}"
            );
        }
    }

    async fn body_of(error: ProxyError) -> (StatusCode, http::HeaderMap, serde_json::Value) {
        shaped(error, Shape::Native).await
    }

    async fn shaped(
        error: ProxyError,
        shape: Shape,
    ) -> (StatusCode, http::HeaderMap, serde_json::Value) {
        let response = error.into_response("rid-1", shape);
        let (parts, body) = response.into_parts();
        let bytes = body.collect().await.unwrap().to_bytes();
        (
            parts.status,
            parts.headers,
            serde_json::from_slice(&bytes).unwrap(),
        )
    }

    #[test]
    fn each_api_layer_has_its_shape() {
        assert_eq!(Shape::of("/v1/messages"), Shape::Anthropic);
        assert_eq!(Shape::of("/v1/responses"), Shape::OpenAi);
        assert_eq!(Shape::of("/v1/chat/completions"), Shape::Native);
        assert_eq!(Shape::of("/api/chat"), Shape::Native);
        assert_eq!(Shape::of("/queue/status"), Shape::Native);
    }

    #[tokio::test]
    async fn the_agents_layers_get_refusals_in_their_own_shape() {
        let spent = || ProxyError::QueueFull {
            status: StatusCode::SERVICE_UNAVAILABLE,
            retry_after: 3,
        };
        let (status, headers, body) = shaped(spent(), Shape::Anthropic).await;
        assert_eq!(status, 503);
        assert_eq!(headers["retry-after"], "3");
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "overloaded_error");
        assert_eq!(body["error"]["message"], "queue full");
        assert_eq!(body["request_id"], "rid-1");
        let (_, _, body) = shaped(spent(), Shape::OpenAi).await;
        assert_eq!(body["error"]["message"], "queue full");
        assert_eq!(body["error"]["type"], "server_error");
        assert_eq!(body["error"]["code"], "queue_full");
        let (status, _, body) = shaped(ProxyError::UnknownKey, Shape::Anthropic).await;
        assert_eq!(status, 401);
        assert_eq!(body["error"]["type"], "authentication_error");
    }

    #[tokio::test]
    async fn bodies_match_the_catalogue() {
        let (status, headers, body) = body_of(ProxyError::MissingCredentials).await;
        assert_eq!(status, 401);
        assert_eq!(headers["www-authenticate"], "Bearer");
        assert_eq!(
            body,
            serde_json::json!({"error": "missing or invalid authorization header", "request_id": "rid-1"})
        );
        let (_, _, body) = body_of(ProxyError::ScopeRequired(Scope::Management)).await;
        assert_eq!(body["error"], "management permission required");
        let (status, headers, body) = body_of(ProxyError::hosts_failed()).await;
        assert_eq!(status, 503);
        assert_eq!(headers["x-failover-exhausted"], "true");
        assert_eq!(body["error"], "all upstream hosts failed");
        let (status, headers, body) = body_of(ProxyError::QueueFull {
            status: StatusCode::TOO_MANY_REQUESTS,
            retry_after: 7,
        })
        .await;
        assert_eq!(
            (status.as_u16(), body["error"].as_str()),
            (429, Some("queue full"))
        );
        assert_eq!(headers["retry-after"], "7");
        let (_, _, body) = body_of(ProxyError::TierPaused(Tier::Low)).await;
        assert_eq!(body["error"], "queue tier 'low' is paused");
        let (_, _, body) = body_of(ProxyError::InvalidTier("bogus".into())).await;
        assert_eq!(
            body["error"],
            "invalid tier: 'bogus' (must be high, normal, or low)"
        );
    }

    #[test]
    fn a_503_names_each_host_tried_and_why() {
        let mut failures = Failures::none();
        failures.push("gpu-a".into(), Cause::ConnectionRefused);
        failures.push("gpu-b".into(), Cause::Timeout);
        failures.push("gpu-a".into(), Cause::Http(StatusCode::BAD_GATEWAY));
        assert_eq!(
            ProxyError::AllHostsFailed(failures).to_string(),
            "all upstream hosts failed: gpu-b (timeout), gpu-a (HTTP 502)"
        );
        let mut many = Failures::none();
        for index in 0..10 {
            many.push(format!("h{index}").into(), Cause::ConnectionClosed);
        }
        let text = ProxyError::HostsFailedAfterWrite(many).to_string();
        assert!(
            text.ends_with("h7 (connection closed) and 2 more"),
            "{text}"
        );
    }
}
