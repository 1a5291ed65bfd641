//! The owner side of a node hop: the identity and tier another node's data plane asserts
//! for a request it forwarded here, verified, and the check of a streamed body it signed
//! ([`crate::hop`]; the edge side is [`crate::relay`]).

use std::net::IpAddr;

use http::{HeaderValue, Request, Response};
use hyper::body::Incoming;

use crate::app::App;
use crate::auth::Identity;
use crate::body::Body;
use crate::error::ProxyError;
use crate::headers;
use crate::hop;
use crate::policy::Policy;

/// The identity and tier another node's data plane asserts for a request it forwarded here
/// (see [`hop`]). A claim that does not verify is refused and counted as a failed
/// authentication: whoever sends it gains nothing.
pub(super) fn hopped_identity(
    app: &App,
    policy: &Policy,
    peer: IpAddr,
    claim: &HeaderValue,
    request: &Request<Incoming>,
) -> Result<(Identity, Hop), ProxyError> {
    let id = request
        .headers()
        .get(headers::REQUEST_ID)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default();
    let path = request
        .uri()
        .path_and_query()
        .map_or("/", http::uri::PathAndQuery::as_str);
    let signed = hop::Request {
        to: &policy.node,
        id,
        method: request.method(),
        path,
    };
    // A hop that verifies is a peer's, whatever else its address did: only failures meet
    // the throttle (which answers 429 once they are too many).
    let now = std::time::SystemTime::now();
    // Read once: the edge it names picks the keys, and its fields are checked with them.
    let read = hop::Claim::read(claim);
    let keys = app
        .peers
        .verifying_keys(policy, read.as_ref().map(hop::Claim::edge));
    let verified = hop::verify_claim(&keys, app.peers.replays(), read, signed, now).and_then(
        |(assertion, key)| {
            // Not from itself (a peer URL that leads back here), and never an unverified
            // caller where this node's own snapshot requires keys.
            if assertion.node == policy.node || (!assertion.verified && policy.auth.enabled) {
                Err(hop::HopError::BadSignature)
            } else {
                Ok((assertion, key))
            }
        },
    );
    let (assertion, key) = match verified {
        Ok(verified) => verified,
        Err(error) => {
            let window = policy.auth.window;
            app.throttle.check(peer, policy.auth.max_failures, window)?;
            app.throttle.fail(peer, window);
            tracing::warn!(%peer, %error, "node hop refused");
            return Err(ProxyError::HopUnverified);
        }
    };
    tracing::debug!(edge = %assertion.node, "forwarded by a peer data plane");
    let identity = asserted_identity(policy, &assertion, now)?;
    let hop = Hop {
        tier: identity.tier(Some(assertion.tier)),
        body: assertion.body,
        claim: claim.clone(),
        key,
    };
    Ok((identity, hop))
}

/// The identity a verified hop asserts, as this node's own snapshot knows it: the owner's
/// snapshot decides the client's ceiling, weight and caps, and a client it does not know
/// (not in its snapshot yet, or already gone) is a refusal of this box: another may know it.
fn asserted_identity(
    policy: &Policy,
    assertion: &hop::Assertion,
    now: std::time::SystemTime,
) -> Result<Identity, ProxyError> {
    if !assertion.verified {
        return Ok(Identity::Anonymous(Some(assertion.client.clone())));
    }
    match policy.app_of(&assertion.client) {
        // A user of an app key: the edge read it from the request, as it was configured.
        // Its ceiling and models were applied at the edge, which read its token (the tier
        // comes in the assertion); the group the edge selected from the token's claims is
        // looked up here, so that its ceiling, models and budget hold on this box too. A
        // group this snapshot does not have is refused as a client it does not know.
        Some((app, _)) if !app.is_expired(now) => {
            let policy = match &assertion.group {
                None => None,
                Some(group) => Some(
                    app.users
                        .as_ref()
                        .and_then(|users| users.claims_to_policy.as_ref())
                        .and_then(|claims| claims.group(group))
                        .ok_or(ProxyError::ClientUnknownHere)?,
                ),
            };
            Ok(Identity::User {
                app: app.clone(),
                id: assertion.client.clone(),
                policy,
            })
        }
        Some(_) => Err(ProxyError::ClientUnknownHere),
        None => {
            let client = policy
                .clients_by_id
                .get(&assertion.client)
                .filter(|client| !client.is_expired(now))
                .cloned()
                .ok_or(ProxyError::ClientUnknownHere)?;
            Ok(Identity::Client(client))
        }
    }
}

/// What a verified hop settled for the request it carries.
#[derive(Debug)]
pub(super) struct Hop {
    /// The tier, after the client's ceiling here.
    pub(super) tier: crate::scheduler::Tier,
    /// How the edge bound the body: a buffered body must match the digest, a streamed one
    /// its trailer.
    pub(super) body: hop::Body,
    /// The header, which a streamed body's trailer is bound to.
    pub(super) claim: HeaderValue,
    /// The key the header verified with, which the trailer must verify with too.
    pub(super) key: hop::HopKey,
}

impl Hop {
    /// The streamed `body`, passed on only if it is the one the edge signed
    /// ([`hop::streamed::check`]).
    pub(super) fn check(
        &self,
        key: Option<&hop::HopKey>,
        body: Body,
    ) -> Result<(Body, hop::streamed::Verdict), ProxyError> {
        match (&self.body, key) {
            (hop::Body::Trailer(length), Some(key)) => Ok(hop::streamed::check(
                body,
                key.clone(),
                self.claim.clone(),
                *length,
            )),
            _ => Err(ProxyError::HopUnverified),
        }
    }
}

/// `sent`, unless the streamed body of a hop failed its check on the way (Ollama then
/// never received it whole).
pub(super) fn unless_unbound(
    verdict: Option<&hop::streamed::Verdict>,
    sent: Result<Response<Body>, ProxyError>,
) -> Result<Response<Body>, ProxyError> {
    match verdict.and_then(hop::streamed::Verdict::refused) {
        Some(error) => {
            tracing::warn!(%error, "node hop refused: its streamed body");
            Err(ProxyError::HopUnverified)
        }
        None => sent,
    }
}
