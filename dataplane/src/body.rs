//! Response bodies: one boxed type for everything the data plane answers,
//! and small constructors for the bodies (and JSON responses) it writes
//! itself.

use bytes::Bytes;
use http::{HeaderValue, Response, header};
use http_body_util::{BodyExt, Empty, Full, combinators::BoxBody};

/// The error type carried by streamed bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Every body the data plane sends, to clients or upstream.
pub type Body = BoxBody<Bytes, BoxError>;

/// A body holding `bytes`.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// An empty body.
pub fn empty() -> Body {
    Empty::new().map_err(|never| match never {}).boxed()
}

/// A JSON body from a value. Serialising a `serde_json::Value` cannot fail.
pub fn json(value: &serde_json::Value) -> Body {
    full(value.to_string())
}

/// A JSON response with status 200.
pub fn json_response(value: serde_json::Value) -> Response<Body> {
    let mut response = Response::new(json(&value));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}
