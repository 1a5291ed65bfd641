//! Forwarding a request to the data plane that owns the chosen host, and
//! relaying its answer to the client, streamed frame by frame.
//!
//! The request leaves as the edge prepared it (body read and rewritten,
//! consumer credentials dropped, `X-Request-ID` set) with the signed
//! identity ([`crate::hop`]); a streamed body leaves chunked, ending with the
//! trailer that binds it to the hop ([`crate::hop::streamed`]). What comes
//! back decides what the edge does:
//!
//! - a connection refused (nothing was delivered): the peer is marked down
//!   and the next box is tried; so is the next box, without the mark, after a
//!   pooled connection the peer had closed before reading the request
//!   ([`crate::error::retry`] decides for both);
//! - an answer marked `x-oqp-hop-refused` (its queue is full, its hosts
//!   failed, it is shutting down): the next box is tried, and this answer is
//!   passed on if none is left;
//! - any other answer is the client's, streamed through; a failure after
//!   the request was written is never retried elsewhere (it may have run),
//!   and a stream cut mid-way ends with the in-band `{"error": …}` line.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use http::{HeaderValue, Response, header};
use http_body_util::BodyExt;

use crate::body::{self, Body};
use crate::error::{Elsewhere, ProxyError};
use crate::headers;
use crate::hop::{self, Assertion};
use crate::metrics::Metrics;
use crate::peers::Peers;
use crate::policy::Policy;
use crate::proxy::{Outbound, RequestBody};
use crate::upstream::{Framing, ResponseBody, UpstreamError};

/// Slack on top of the longest queue wait and the upstream timeout before
/// an owner that has sent no answer's head is given up on.
const HEAD_SLACK: Duration = Duration::from_secs(10);

/// What the owner did with a forwarded request.
#[derive(Debug)]
pub enum Relayed {
    /// Its answer, for the client.
    Answer(Response<Body>),
    /// A refusal another box may not give: try the next, or pass this on.
    Refused(Response<Body>),
    /// It could not be reached; nothing was delivered.
    Unreachable,
}

/// What relaying reads of the data plane.
#[derive(Debug, Clone, Copy)]
pub struct Parts<'a> {
    /// The peers, their addresses and the hop client.
    pub peers: &'a Arc<Peers>,
    /// Forwarded counts and the hop's added time.
    pub metrics: &'a Metrics,
}

/// Sends `outbound` to `node` on behalf of `caller`.
pub async fn send(
    parts: Parts<'_>,
    policy: &Arc<Policy>,
    node: &Arc<str>,
    caller: &Assertion,
    outbound: Outbound,
) -> Result<Relayed, ProxyError> {
    let Some(base) = parts.peers.url(policy, node) else {
        return Ok(Relayed::Unreachable);
    };
    let Some(key) = parts.peers.signing_key(policy, node) else {
        tracing::warn!(%node, "cannot forward: this data plane has no node token to sign with");
        return Ok(Relayed::Unreachable);
    };
    let head_timeout = outbound.head_timeout(&policy.proxy);
    let Outbound {
        method,
        path_and_query,
        mut headers,
        body,
        ..
    } = outbound;
    let request_id = headers
        .get(headers::REQUEST_ID)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let signed = hop::Request {
        to: node,
        id: &request_id,
        method: &method,
        path: path_and_query.as_str(),
    };
    let binding = match &body {
        RequestBody::Buffered(bytes) => hop::Body::Digest(hop::body_digest(bytes)),
        RequestBody::Streamed(_) => {
            // Sent chunked, so that the trailer binding it can follow; the owner restores
            // the length, which the header signs.
            let length = headers
                .remove(header::CONTENT_LENGTH)
                .and_then(|value| value.to_str().ok()?.parse().ok());
            headers.insert(
                header::TRANSFER_ENCODING,
                HeaderValue::from_static("chunked"),
            );
            headers.insert(header::TRAILER, HeaderValue::from(hop::BODY_TRAILER));
            hop::Body::Trailer(length)
        }
    };
    let caller = Assertion {
        body: binding,
        ..caller.clone()
    };
    let claim = key.sign(&caller, signed, SystemTime::now());
    headers.insert(hop::HEADER, claim.clone());
    let uri = http::Uri::builder()
        .scheme(base.scheme)
        .authority(base.authority)
        .path_and_query(path_and_query)
        .build()
        .map_err(|_| ProxyError::PeerFailed(node.to_string()))?;
    let mut request = http::Request::new(match body {
        RequestBody::Buffered(bytes) if bytes.is_empty() => body::empty(),
        RequestBody::Buffered(bytes) => body::full(bytes),
        RequestBody::Streamed(body) => hop::streamed::seal(body, key.clone(), claim),
    });
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.headers_mut() = headers;
    // The owner may wait the longest queue wait, then fail over inside its box (each host up
    // to the request's head timeout, and as long again for a free one).
    let hosts = policy
        .remote
        .iter()
        .filter(|host| host.owner.as_ref() == Some(node))
        .count()
        .max(1);
    let upstream = head_timeout * u32::try_from(2 * hosts).unwrap_or(u32::MAX);
    let head_timeout = policy.queue.longest_wait() + upstream + HEAD_SLACK;
    let outstanding = parts.peers.forwarding(node);
    let sent = Instant::now();
    let response = match parts.peers.client().send(request, head_timeout).await {
        Ok(response) => response,
        Err(error) => return failed(parts, policy, node, &error),
    };
    parts.peers.forwarded(node);
    parts.metrics.forwarded(node);
    let (mut head, incoming) = response.into_parts();
    if let Some(owner_us) = head
        .headers
        .remove(hop::ELAPSED)
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok())
    {
        let owner = Duration::from_micros(owner_us);
        parts
            .metrics
            .observe_hop_added(sent.elapsed().saturating_sub(owner));
    }
    let refused = head.headers.remove(hop::REFUSED).is_some();
    headers::strip_hop_by_hop(&mut head.headers);
    let framing = Framing::of(head.headers.get(header::CONTENT_TYPE));
    let label: Arc<str> = Arc::from(format!("{node} (data plane)"));
    let body = ResponseBody::new(
        incoming
            .map_err(|error| -> crate::body::BoxError { Box::new(error) })
            .boxed(),
        framing,
        label,
        Some(Box::new(outstanding)),
        None,
        policy.proxy.upstream_stall_timeout,
    );
    let response = Response::from_parts(head, body.boxed());
    Ok(if refused {
        Relayed::Refused(response)
    } else {
        Relayed::Answer(response)
    })
}

/// A hop that failed before the owner's answer head: the next box when nothing reached the
/// owner ([`unreached`]); else a failure of the request (written, so never sent elsewhere),
/// and a peer that broke the connection or went silent is not chosen again until it
/// answers a probe.
fn failed(
    parts: Parts<'_>,
    policy: &Arc<Policy>,
    node: &Arc<str>,
    error: &UpstreamError,
) -> Result<Relayed, ProxyError> {
    if let Some(down) = unreached(error) {
        tracing::warn!(%node, %error, "peer data plane unreachable; trying the next box");
        if down {
            parts.peers.mark_down(policy, node);
        }
        return Ok(Relayed::Unreachable);
    }
    tracing::warn!(%node, %error, "peer data plane failed before answering");
    parts.peers.forwarded(node);
    parts.metrics.forwarded(node);
    parts.peers.mark_down(policy, node);
    Err(ProxyError::PeerFailed(node.to_string()))
}

/// For a hop that failed before the owner's answer head: `Some` when nothing reached the owner
/// and the next box may take it ([`Attempt::may_go`](crate::error::Attempt::may_go)), with
/// whether the peer is marked down (it could not be reached; a pooled connection it had
/// closed as idle says nothing of it: the owner never read the request). `None` when the
/// owner may have run it.
fn unreached(error: &UpstreamError) -> Option<bool> {
    error
        .attempt()
        .may_go(Elsewhere::Box)
        .then_some(matches!(error, UpstreamError::Connect(_)))
}

/// Marks an owner's answer to a hop: how long it took here (the edge
/// subtracts it to see what the hop added) and, for a refusal another box
/// may not give, [`hop::REFUSED`].
pub fn mark_answer(response: &mut Response<Body>, took: Duration, refused: bool) {
    let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
    response
        .headers_mut()
        .insert(hop::ELAPSED, HeaderValue::from(micros));
    if refused {
        response
            .headers_mut()
            .insert(hop::REFUSED, HeaderValue::from_static("1"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_hop_that_reached_no_owner_goes_to_the_next_box() {
        let table = [
            (UpstreamError::Connect("refused".into()), Some(true)),
            // The owner had closed the pooled connection: nothing ran, and it is not down.
            (UpstreamError::Stale("closed".into()), Some(false)),
            (UpstreamError::Transport("reset".into()), None),
            (UpstreamError::Timeout, None),
        ];
        for (error, next_box) in table {
            assert_eq!(unreached(&error), next_box, "{error}");
        }
    }
}
