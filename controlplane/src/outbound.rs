//! The control plane's own outbound HTTP client, shared by the host poller
//! and the webhook sender: pooled keep-alive connections, rustls with the
//! webpki roots for `https`, and one deadline over the whole exchange
//! (connect, headers and body), because a poll or a delivery that hangs must
//! not hold its task past its timeout.
//!
//! [`Outbound::public_only`] is the webhook sender's client for targets not in
//! `webhooks.allowed_hosts`: it resolves the host name at each connection and connects only
//! to the addresses that pass the SSRF check ([`ssrf::is_blocked`]), so a
//! name that resolved to a public address at start-up and to a private one later (DNS
//! rebinding) reaches nothing.

pub mod ssrf;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::connect::dns::Name;
use hyper_util::rt::TokioExecutor;

/// A cloneable client; clones share one connection pool.
#[derive(Clone, Debug)]
pub struct Outbound {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector<Resolver>>, Full<Bytes>>,
}

/// Resolves host names for [`Outbound`]; with `public_only`, drops every address the SSRF
/// check blocks, and fails when none is left.
#[derive(Clone, Copy, Debug)]
pub struct Resolver {
    public_only: bool,
}

impl tower_service::Service<Name> for Resolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let public_only = self.public_only;
        Box::pin(async move {
            // The connector sets the port.
            let resolved: Vec<SocketAddr> =
                tokio::net::lookup_host((name.as_str(), 0)).await?.collect();
            if !public_only {
                return Ok(resolved.into_iter());
            }
            let public: Vec<SocketAddr> = resolved
                .into_iter()
                .filter(|addr| !ssrf::is_blocked(addr.ip()))
                .collect();
            if public.is_empty() {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "{} resolves only to private/loopback addresses now (SSRF check)",
                        name.as_str()
                    ),
                ));
            }
            Ok(public.into_iter())
        })
    }
}

/// A complete response.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The status code.
    pub status: StatusCode,
    /// The whole body (at most the limit given to [`Outbound::send`]).
    pub body: Bytes,
    /// `Retry-After` in seconds, when the answer carried one as a number.
    pub retry_after: Option<u64>,
}

/// Why an exchange failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutboundError {
    /// The deadline passed before the body ended.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// No connection could be made.
    #[error("connection failed: {0}")]
    Connect(String),
    /// The connection broke, or the peer spoke something other than HTTP.
    #[error("transport error: {0}")]
    Transport(String),
    /// The body is larger than the limit.
    #[error("response body larger than {0} bytes")]
    TooLarge(usize),
}

impl Outbound {
    /// A client with a small keep-alive pool: polls come every few seconds at
    /// most, so a couple of idle connections per host are plenty.
    pub fn new() -> Self {
        Self::resolving(Resolver { public_only: false })
    }

    /// A client that connects only to addresses the SSRF check allows, resolved at each
    /// connection (see the module documentation).
    pub fn public_only() -> Self {
        Self::resolving(Resolver { public_only: true })
    }

    fn resolving(resolver: Resolver) -> Self {
        let mut http = HttpConnector::new_with_resolver(resolver);
        http.enforce_http(false);
        http.set_nodelay(true);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        // Idle connections go before an engine's own idle close (a llama-server's 5 s), so a
        // poll is never written to a connection the host is closing; a poll every few
        // seconds costs one connect at most.
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(4))
            .pool_max_idle_per_host(2)
            .build(connector);
        Self { client }
    }

    /// Sends `request` and reads the whole response, within `timeout`; a body
    /// longer than `limit` bytes is an error.
    pub async fn send(
        &self,
        request: Request<Full<Bytes>>,
        timeout: Duration,
        limit: usize,
    ) -> Result<Reply, OutboundError> {
        let exchange = async {
            let response = self.client.request(request).await.map_err(|error| {
                if error.is_connect() {
                    OutboundError::Connect(root_cause(&error))
                } else {
                    OutboundError::Transport(root_cause(&error))
                }
            })?;
            let status = response.status();
            let retry_after = response
                .headers()
                .get(http::header::RETRY_AFTER)
                .and_then(|value| value.to_str().ok())
                .and_then(|value| value.trim().parse().ok());
            let body = Limited::new(response.into_body(), limit)
                .collect()
                .await
                .map_err(|error| {
                    if error.is::<http_body_util::LengthLimitError>() {
                        OutboundError::TooLarge(limit)
                    } else {
                        OutboundError::Transport(error.to_string())
                    }
                })?
                .to_bytes();
            Ok(Reply {
                status,
                body,
                retry_after,
            })
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .unwrap_or(Err(OutboundError::Timeout(timeout)))
    }
}

impl Default for Outbound {
    fn default() -> Self {
        Self::new()
    }
}

/// The innermost cause: hyper's outer messages ("client error (Connect)")
/// say little, the OS error says what happened.
fn root_cause(error: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = error;
    while let Some(source) = cause.source() {
        cause = source;
    }
    cause.to_string()
}
