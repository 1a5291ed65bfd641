//! The identity hop between data planes: what an edge asserts when it
//! forwards a request to the node that owns the chosen host, and how that
//! owner checks it.
//!
//! The edge has authenticated the consumer; the owner must queue the request
//! as that consumer, in the tier the edge settled (after its ceiling), and
//! must not believe anyone else who says so. So the edge sends one header,
//!
//! ```text
//! x-oqp-hop: v1;n=<edge node, hex>;c=<client id, hex>;v=<1|0>;t=<tier>;ts=<unix ms>;s=<hmac, hex>
//! ```
//!
//! where the HMAC-SHA256 is keyed by the node token (which every data plane
//! presents to the control plane, and which never crosses the policy stream)
//! over those fields, the request id, the method and the path. The owner
//! refuses a request whose header does not verify, or is more than
//! [`MAX_SKEW`] away from its own clock; a consumer who sends the header
//! gains nothing. The header never reaches Ollama.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use http::{HeaderValue, Method};
use sha2::Sha256;

use crate::scheduler::Tier;

/// The assertion an edge sends with a forwarded request.
pub use crate::headers::HOP as HEADER;
/// Set by an owner on every answer to a hop: microseconds from the request's
/// arrival to its answer's head, so that the edge can tell what the hop added.
pub use crate::headers::HOP_ELAPSED as ELAPSED;
/// Set by an owner on a refusal that another GPU box may not give (its queue
/// is full, its hosts failed, it is shutting down): the edge tries the next box.
pub use crate::headers::HOP_REFUSED as REFUSED;

/// Largest difference between the edge's timestamp and the owner's clock.
pub const MAX_SKEW: Duration = Duration::from_secs(60);

/// What the edge settled about a request's caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assertion {
    /// The edge node.
    pub node: Arc<str>,
    /// The client id.
    pub client: Arc<str>,
    /// Identified by a key or an injection port (not claimed with auth off).
    pub verified: bool,
    /// The tier, after the client's ceiling.
    pub tier: Tier,
}

/// The HMAC key: the node token's bytes. Prints as `HopKey(…)`.
#[derive(Clone)]
pub struct HopKey(Arc<[u8]>);

impl std::fmt::Debug for HopKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HopKey(…)")
    }
}

/// Why a hop was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HopError {
    /// Not of the form above.
    #[error("malformed")]
    Malformed,
    /// This node has no node token, so it can verify nothing.
    #[error("this node has no node token")]
    NoKey,
    /// The signature does not match.
    #[error("bad signature")]
    BadSignature,
    /// The timestamp is too far from this node's clock.
    #[error("timestamp outside the allowed skew")]
    Skew,
}

/// What the signature covers besides the assertion.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The request id (`X-Request-ID`, the same on both hops).
    pub id: &'a str,
    /// The method.
    pub method: &'a Method,
    /// The path and query.
    pub path: &'a str,
}

impl HopKey {
    /// The key for a node token.
    pub fn new(token: &str) -> Self {
        Self(Arc::from(token.as_bytes()))
    }

    /// The header asserting `assertion` for `request`, signed at `now`.
    pub fn sign(
        &self,
        assertion: &Assertion,
        request: Request<'_>,
        now: SystemTime,
    ) -> HeaderValue {
        let ts = unix_ms(now);
        let signature = self
            .mac(assertion, request, ts)
            .map(|mac| hex::encode(mac.finalize().into_bytes()))
            .unwrap_or_default();
        let text = format!(
            "v1;n={};c={};v={};t={};ts={ts};s={signature}",
            hex::encode(assertion.node.as_bytes()),
            hex::encode(assertion.client.as_bytes()),
            u8::from(assertion.verified),
            assertion.tier.as_str(),
        );
        let mut value = HeaderValue::from_str(&text).unwrap_or(HeaderValue::from_static("v1"));
        value.set_sensitive(true);
        value
    }

    /// The assertion in `header`, if it verifies for `request` at `now`.
    pub fn verify(
        &self,
        header: &HeaderValue,
        request: Request<'_>,
        now: SystemTime,
    ) -> Result<Assertion, HopError> {
        let fields = Fields::parse(header).ok_or(HopError::Malformed)?;
        let signature = hex::decode(fields.signature).map_err(|_| HopError::Malformed)?;
        self.mac(&fields.assertion, request, fields.ts)
            .ok_or(HopError::BadSignature)?
            .verify_slice(&signature)
            .map_err(|_| HopError::BadSignature)?;
        let skew = unix_ms(now).abs_diff(fields.ts);
        if u128::from(skew) > MAX_SKEW.as_millis() {
            return Err(HopError::Skew);
        }
        Ok(fields.assertion)
    }

    fn mac(&self, assertion: &Assertion, request: Request<'_>, ts: u64) -> Option<Hmac<Sha256>> {
        // HMAC takes keys of any length (it hashes long ones): this never fails.
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).ok()?;
        // Each field with its length first, so that no two field lists sign alike.
        let ts = ts.to_string();
        let verified = if assertion.verified { "1" } else { "0" };
        for field in [
            "oqp-hop-v1",
            &assertion.node,
            &assertion.client,
            verified,
            assertion.tier.as_str(),
            &ts,
            request.id,
            request.method.as_str(),
            request.path,
        ] {
            mac.update(&(field.len() as u64).to_be_bytes());
            mac.update(field.as_bytes());
        }
        Some(mac)
    }
}

/// Verifies `header` with `key`, if this node has one.
pub fn verify(
    key: Option<&HopKey>,
    header: &HeaderValue,
    request: Request<'_>,
    now: SystemTime,
) -> Result<Assertion, HopError> {
    key.ok_or(HopError::NoKey)?.verify(header, request, now)
}

struct Fields<'a> {
    assertion: Assertion,
    ts: u64,
    signature: &'a str,
}

impl<'a> Fields<'a> {
    fn parse(header: &'a HeaderValue) -> Option<Self> {
        let text = header.to_str().ok()?;
        let mut parts = text.split(';');
        if parts.next()? != "v1" {
            return None;
        }
        let mut field = |name: &str| {
            let (key, value) = parts.next()?.split_once('=')?;
            (key == name).then_some(value)
        };
        let node = decode_text(field("n")?)?;
        let client = decode_text(field("c")?)?;
        let verified = match field("v")? {
            "1" => true,
            "0" => false,
            _ => return None,
        };
        let tier_name = field("t")?;
        let tier = Tier::ALL
            .into_iter()
            .find(|tier| tier.as_str() == tier_name)?;
        let ts = field("ts")?.parse().ok()?;
        let signature = field("s")?;
        if parts.next().is_some() {
            return None;
        }
        Some(Self {
            assertion: Assertion {
                node: Arc::from(node),
                client: Arc::from(client),
                verified,
                tier,
            },
            ts,
            signature,
        })
    }
}

fn decode_text(hex_text: &str) -> Option<String> {
    String::from_utf8(hex::decode(hex_text).ok()?).ok()
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn assertion() -> Assertion {
        Assertion {
            node: Arc::from("box1"),
            client: Arc::from("chat;ui=1"),
            verified: true,
            tier: Tier::High,
        }
    }

    fn request<'a>(id: &'a str, path: &'a str) -> Request<'a> {
        Request {
            id,
            method: &Method::POST,
            path,
        }
    }

    #[test]
    fn a_signed_assertion_verifies_and_round_trips() {
        let key = HopKey::new("token");
        let now = SystemTime::now();
        let header = key.sign(&assertion(), request("r1", "/api/chat"), now);
        assert!(header.is_sensitive());
        let back = key
            .verify(
                &header,
                request("r1", "/api/chat"),
                now + Duration::from_secs(5),
            )
            .unwrap();
        assert_eq!(back, assertion());
    }

    #[test]
    fn anything_changed_fails() {
        let key = HopKey::new("token");
        let now = SystemTime::now();
        let header = key.sign(&assertion(), request("r1", "/api/chat"), now);
        let check = |key: &HopKey, header: &HeaderValue, id, path, at| {
            key.verify(header, request(id, path), at)
        };
        assert_eq!(
            check(&HopKey::new("other"), &header, "r1", "/api/chat", now),
            Err(HopError::BadSignature)
        );
        assert_eq!(
            check(&key, &header, "r2", "/api/chat", now),
            Err(HopError::BadSignature),
            "another request id"
        );
        assert_eq!(
            check(&key, &header, "r1", "/api/generate", now),
            Err(HopError::BadSignature),
            "another path"
        );
        let promoted =
            HeaderValue::from_str(&header.to_str().unwrap().replace(";t=high;", ";t=low;"))
                .unwrap();
        let mut low = assertion();
        low.tier = Tier::Low;
        let relabelled = key.sign(&low, request("r1", "/api/chat"), now);
        assert_ne!(relabelled, promoted, "the tier is signed");
        assert_eq!(
            check(&key, &promoted, "r1", "/api/chat", now),
            Err(HopError::BadSignature)
        );
        assert_eq!(
            check(
                &key,
                &header,
                "r1",
                "/api/chat",
                now + MAX_SKEW + Duration::from_secs(1)
            ),
            Err(HopError::Skew)
        );
        for forged in [
            "",
            "v1",
            "v2;n=00",
            "v1;n=zz;c=00;v=1;t=high;ts=1;s=00",
            "admin",
        ] {
            assert_eq!(
                check(
                    &key,
                    &HeaderValue::from_static(forged),
                    "r1",
                    "/api/chat",
                    now
                ),
                Err(HopError::Malformed),
                "{forged}"
            );
        }
        assert_eq!(
            verify(None, &header, request("r1", "/api/chat"), now),
            Err(HopError::NoKey)
        );
    }

    #[test]
    fn the_key_never_prints() {
        assert_eq!(format!("{:?}", HopKey::new("secret-token")), "HopKey(…)");
    }
}
