//! The identity hop between data planes: what an edge asserts when it
//! forwards a request to the node that owns the chosen host, and how that
//! owner checks it.
//!
//! The edge has authenticated the consumer; the owner must queue the request
//! as that consumer, in the tier the edge settled (after its ceiling), and
//! must not believe anyone else who says so. So the edge sends one header,
//!
//! ```text
//! x-oqp-hop: v1;n=<edge node, hex>;c=<client id, hex>;v=<1|0>;t=<tier>;b=<body>[;g=<group, hex>];ts=<unix ms>;r=<nonce, hex>;s=<hmac, hex>
//! ```
//!
//! `g`, signed with the rest when present, is the `claims_to_policy` value the edge selected
//! from a token user's claims: the owner applies that group's ceiling, models and budget from
//! its own snapshot. An edge that sends none (no group, or an older edge) is read as before.
//!
//! where the HMAC-SHA256 is keyed by the hop key (derived from the node token
//! every data plane presents to the control plane, which never crosses the
//! policy stream) over those fields, the node it is addressed to, the request
//! id, the method and the path. `b` binds the body ([`Body`]): for a body the
//! edge read whole, its SHA-256 in hex, which the owner checks against the body
//! it reads; for a streamed body (uploads, model management), `~` and the
//! declared length if there was one (`~1024`), meaning the digest comes after
//! the body, in the chunked trailer [`BODY_TRAILER`]: an HMAC under the same
//! key over this header and the body's SHA-256 ([`HopKey::seal_body`]), which
//! only a holder of the key can compute and which fits no other hop. The owner
//! hashes the streamed body on its way to Ollama and holds back its last frame
//! until the trailer has verified ([`streamed`]): a body changed on the wire,
//! cut, lengthened, or sent without its trailer never reaches Ollama whole. A
//! header without a `b` of either form is refused.
//!
//! The owner refuses a request whose header does not verify, is more than
//! [`MAX_SKEW`] away from its own clock, or was seen before ([`Replays`]), or
//! was signed before this data plane started (the headers seen are remembered
//! in memory, so one accepted by the previous run cannot be replayed to a
//! restarted owner): a consumer who sends the header, or replays one captured
//! on the wire, gains nothing. Neither the header nor the trailer reaches
//! Ollama.

pub mod streamed;

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use http::{HeaderName, HeaderValue, Method};
use sha2::{Digest, Sha256};

use crate::scheduler::Tier;

/// The assertion an edge sends with a forwarded request.
pub use crate::headers::HOP as HEADER;
/// Set by an owner on every answer to a hop: microseconds from the request's
/// arrival to its answer's head, so that the edge can tell what the hop added.
pub use crate::headers::HOP_ELAPSED as ELAPSED;
/// Set by an owner on a refusal that another GPU box may not give (its queue
/// is full, its hosts failed, it is shutting down): the edge tries the next box.
pub use crate::headers::HOP_REFUSED as REFUSED;

/// The chunked trailer that binds a streamed body to its hop ([`HopKey::seal_body`]).
pub const BODY_TRAILER: HeaderName = HeaderName::from_static("x-oqp-hop-body");

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
    /// How the body is bound to the header.
    pub body: Body,
    /// The `claims_to_policy` value the edge selected from a token user's claims, if any.
    pub group: Option<Arc<str>>,
}

/// How a hop binds its body (the header's `b` field).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    /// A body read whole: its hex SHA-256 ([`body_digest`]).
    Digest(String),
    /// A streamed body, of the declared length if any: bound by the trailer
    /// [`BODY_TRAILER`] after its last byte.
    Trailer(Option<u64>),
}

impl Body {
    /// The `b` field.
    fn field(&self) -> Cow<'_, str> {
        match self {
            Self::Digest(digest) => Cow::Borrowed(digest),
            Self::Trailer(None) => Cow::Borrowed("~"),
            Self::Trailer(Some(length)) => Cow::Owned(format!("~{length}")),
        }
    }

    fn parse(field: &str) -> Option<Self> {
        if let Some(length) = field.strip_prefix('~') {
            if length.is_empty() {
                return Some(Self::Trailer(None));
            }
            // Digits only: `+1` or ` 1` would sign another text for the same length.
            if !length.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            return length
                .parse()
                .ok()
                .map(|length| Self::Trailer(Some(length)));
        }
        (field.len() == 64 && field.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| Self::Digest(field.to_owned()))
    }
}

/// The HMAC key: derived from the node token for the hop alone
/// ([`node_keys::hop_key`](crate::node_keys::hop_key)), kept keyed (each signature
/// starts from a copy, not from the key). Prints as `HopKey(…)`.
#[derive(Clone)]
pub struct HopKey(Arc<Hmac<Sha256>>);

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
    /// This very header was accepted before.
    #[error("replayed")]
    Replayed,
    /// Signed before this data plane started: a previous run may have accepted it.
    #[error("signed before this node started")]
    BeforeStart,
    /// A streamed body ended without its trailer.
    #[error("the streamed body has no trailer")]
    NoTrailer,
    /// The body is not the one signed: another digest, or another length.
    #[error("the body is not the one signed")]
    BodyMismatch,
}

/// What the signature covers besides the assertion.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The node the request is addressed to.
    pub to: &'a str,
    /// The request id (`X-Request-ID`, the same on both hops).
    pub id: &'a str,
    /// The method.
    pub method: &'a Method,
    /// The path and query.
    pub path: &'a str,
}

/// The body part of a [`Request`]: the hex SHA-256 of a buffered body.
pub fn body_digest(body: &[u8]) -> String {
    let mut text = Vec::with_capacity(64);
    push_hex(&mut text, &Sha256::digest(body));
    String::from_utf8(text).unwrap_or_default()
}

/// Appends the lower-case hex of `bytes` to `out` (as `hex::encode`, without its
/// character-by-character `String`).
fn push_hex(out: &mut Vec<u8>, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    out.reserve(bytes.len() * 2);
    for &byte in bytes {
        out.push(DIGITS[usize::from(byte >> 4)]);
        out.push(DIGITS[usize::from(byte & 0x0f)]);
    }
}

impl HopKey {
    /// The key for a node token; `None` for an empty one (an unset variable, an empty
    /// file), which would let anyone sign.
    pub fn new(token: &str) -> Option<Self> {
        if token.trim().is_empty() {
            return None;
        }
        // HMAC takes keys of any length (it hashes long ones): this never fails.
        let keyed = Hmac::<Sha256>::new_from_slice(&crate::node_keys::hop_key(token)).ok()?;
        Some(Self(Arc::new(keyed)))
    }

    /// The header asserting `assertion` for `request`, signed at `now`.
    pub fn sign(
        &self,
        assertion: &Assertion,
        request: Request<'_>,
        now: SystemTime,
    ) -> HeaderValue {
        let ts = unix_ms(now);
        let mut nonce = Vec::with_capacity(24);
        push_hex(&mut nonce, &rand::random::<[u8; 12]>());
        let nonce = std::str::from_utf8(&nonce).unwrap_or_default();
        let signature = self
            .mac(assertion, request, ts, nonce)
            .finalize()
            .into_bytes();
        // The header's text, written in one buffer (it is made for every hop).
        let (node, client) = (assertion.node.as_bytes(), assertion.client.as_bytes());
        let group = assertion.group.as_deref().map_or(&[][..], str::as_bytes);
        let mut text = Vec::with_capacity(200 + 2 * (node.len() + client.len() + group.len()));
        text.extend_from_slice(b"v1;n=");
        push_hex(&mut text, node);
        text.extend_from_slice(b";c=");
        push_hex(&mut text, client);
        text.extend_from_slice(if assertion.verified {
            b";v=1;t="
        } else {
            b";v=0;t="
        });
        text.extend_from_slice(assertion.tier.as_str().as_bytes());
        text.extend_from_slice(b";b=");
        text.extend_from_slice(assertion.body.field().as_bytes());
        if assertion.group.is_some() {
            text.extend_from_slice(b";g=");
            push_hex(&mut text, group);
        }
        text.extend_from_slice(b";ts=");
        text.extend_from_slice(Decimal::of(ts).as_str().as_bytes());
        text.extend_from_slice(b";r=");
        text.extend_from_slice(nonce.as_bytes());
        text.extend_from_slice(b";s=");
        push_hex(&mut text, &signature);
        let mut value = HeaderValue::from_maybe_shared(bytes::Bytes::from(text))
            .unwrap_or(HeaderValue::from_static("v1"));
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
        self.verified(header, request, now)
            .map(|(assertion, _)| assertion)
    }

    /// [`HopKey::verify`], with the header's timestamp (Unix ms) and signature.
    fn verified(
        &self,
        header: &HeaderValue,
        request: Request<'_>,
        now: SystemTime,
    ) -> Result<(Assertion, Signed), HopError> {
        let fields = Fields::parse(header).ok_or(HopError::Malformed)?;
        let signed = self.check(&fields, request, now)?;
        Ok((fields.assertion, signed))
    }

    /// Whether `fields`' signature is this key's for `request`, and their timestamp within
    /// [`MAX_SKEW`] of `now`.
    fn check(
        &self,
        fields: &Fields<'_>,
        request: Request<'_>,
        now: SystemTime,
    ) -> Result<Signed, HopError> {
        let signature = hex::decode(fields.signature).map_err(|_| HopError::Malformed)?;
        self.mac(&fields.assertion, request, fields.ts, fields.nonce)
            .verify_slice(&signature)
            .map_err(|_| HopError::BadSignature)?;
        let skew = unix_ms(now).abs_diff(fields.ts);
        if u128::from(skew) > MAX_SKEW.as_millis() {
            return Err(HopError::Skew);
        }
        // It verified: it is a SHA-256 output.
        let signature = signature.try_into().map_err(|_| HopError::BadSignature)?;
        Ok(Signed {
            ts: fields.ts,
            signature,
        })
    }

    fn mac(
        &self,
        assertion: &Assertion,
        request: Request<'_>,
        ts: u64,
        nonce: &str,
    ) -> Hmac<Sha256> {
        let mut mac = Hmac::clone(&self.0);
        // Each field with its length first, so that no two field lists sign alike.
        let ts = Decimal::of(ts);
        let verified = if assertion.verified { "1" } else { "0" };
        let body = assertion.body.field();
        for field in [
            "oqp-hop-v1",
            &assertion.node,
            &assertion.client,
            verified,
            assertion.tier.as_str(),
            ts.as_str(),
            nonce,
            request.to,
            request.id,
            request.method.as_str(),
            request.path,
            &body,
        ] {
            mac.update(&(field.len() as u64).to_be_bytes());
            mac.update(field.as_bytes());
        }
        // Only when present, so that a hop without a group signs as it always did.
        if let Some(group) = &assertion.group {
            for field in ["g", group] {
                mac.update(&(field.len() as u64).to_be_bytes());
                mac.update(field.as_bytes());
            }
        }
        mac
    }
}

impl HopKey {
    /// The trailer value binding a streamed body of SHA-256 `digest` to the hop whose
    /// header is `header`: no other hop's header (each has its own nonce) gives the same.
    pub fn seal_body(&self, header: &HeaderValue, digest: &[u8; 32]) -> HeaderValue {
        let mut seal = Vec::with_capacity(64);
        push_hex(
            &mut seal,
            &self.body_mac(header, digest).finalize().into_bytes(),
        );
        HeaderValue::from_maybe_shared(bytes::Bytes::from(seal))
            .unwrap_or(HeaderValue::from_static("-"))
    }

    /// Whether `seal` is [`HopKey::seal_body`] of `header` and `digest`.
    pub fn check_body(
        &self,
        header: &HeaderValue,
        digest: &[u8; 32],
        seal: &HeaderValue,
    ) -> Result<(), HopError> {
        let seal = hex::decode(seal.as_bytes()).map_err(|_| HopError::BodyMismatch)?;
        self.body_mac(header, digest)
            .verify_slice(&seal)
            .map_err(|_| HopError::BodyMismatch)
    }

    fn body_mac(&self, header: &HeaderValue, digest: &[u8; 32]) -> Hmac<Sha256> {
        let mut mac = Hmac::clone(&self.0);
        for field in [&b"oqp-hop-body-v1"[..], header.as_bytes(), digest] {
            mac.update(&(field.len() as u64).to_be_bytes());
            mac.update(field);
        }
        mac
    }
}

/// This node's hop keys with one peer, from the control plane (`HopPeer`): the pair keys of
/// the data planes issued their own token ([`node_keys::hop_pair_key`](crate::node_keys::hop_pair_key)).
#[derive(Debug, Clone)]
pub struct PairKeys {
    /// Signs hops to the peer.
    pub sign: HopKey,
    /// Verifies hops from the peer.
    pub verify: HopKey,
}

impl HopKey {
    /// A key the control plane sent (32 bytes); `None` for another length.
    pub fn from_bytes(key: &[u8]) -> Option<Self> {
        if key.len() != 32 {
            return None;
        }
        let keyed = Hmac::<Sha256>::new_from_slice(key).ok()?;
        Some(Self(Arc::new(keyed)))
    }
}

/// The edge a hop header names, before it is verified: which key to verify it with.
pub fn claimed_edge(header: &HeaderValue) -> Option<Arc<str>> {
    Claim::read(header).map(|claim| claim.0.assertion.node)
}

/// A hop header read once, not yet verified: the edge it names ([`Claim::edge`], which says
/// which keys to verify it with) and what its signature covers ([`verify_claim`]).
pub struct Claim<'a>(Fields<'a>);

impl std::fmt::Debug for Claim<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim")
            .field("edge", &self.edge())
            .finish_non_exhaustive()
    }
}

impl<'a> Claim<'a> {
    /// `header`'s fields; `None` when it is not of the form above.
    pub fn read(header: &'a HeaderValue) -> Option<Self> {
        Fields::parse(header).map(Self)
    }

    /// The edge node it names.
    pub fn edge(&self) -> &str {
        &self.0.assertion.node
    }
}

/// [`verify_any`] of a header already read: `claim` is `None` for one that was not of the
/// form above (refused as malformed, once there is a key to check it with).
pub fn verify_claim(
    keys: &[HopKey],
    replays: &Replays,
    claim: Option<Claim<'_>>,
    request: Request<'_>,
    now: SystemTime,
) -> Result<(Assertion, HopKey), HopError> {
    if keys.is_empty() {
        return Err(HopError::NoKey);
    }
    let Claim(fields) = claim.ok_or(HopError::Malformed)?;
    for key in keys {
        match key.check(&fields, request, now) {
            Ok(signed) => {
                replays.accept(&signed, Instant::now())?;
                return Ok((fields.assertion, key.clone()));
            }
            Err(HopError::BadSignature) => {}
            Err(error) => return Err(error),
        }
    }
    Err(HopError::BadSignature)
}

/// [`verify`] with the first of `keys` that the signature matches; returns that key too,
/// which a streamed body's trailer must match as well.
pub fn verify_any(
    keys: &[HopKey],
    replays: &Replays,
    header: &HeaderValue,
    request: Request<'_>,
    now: SystemTime,
) -> Result<(Assertion, HopKey), HopError> {
    verify_claim(keys, replays, Claim::read(header), request, now)
}

/// Verifies `header` with `key`, if this node has one, and refuses one `replays` has seen.
pub fn verify(
    key: Option<&HopKey>,
    replays: &Replays,
    header: &HeaderValue,
    request: Request<'_>,
    now: SystemTime,
) -> Result<Assertion, HopError> {
    let (assertion, signed) = key.ok_or(HopError::NoKey)?.verified(header, request, now)?;
    replays.accept(&signed, Instant::now())?;
    Ok(assertion)
}

/// What a header that verified was signed with: its timestamp and its signature.
struct Signed {
    ts: u64,
    signature: [u8; 32],
}

/// The hop headers accepted in the last [`MAX_SKEW`] × 2 (older ones fail the clock check),
/// by signature: a header captured on the wire cannot be sent again, however its text is
/// written (the signature covers every field but itself, so two headers that verify with
/// one signature assert the same thing for the same request). Bounded: when full, the
/// oldest entries go first. Headers signed before it was created (this run's start) are
/// refused, since they may have been accepted by a previous run, which this one does not
/// remember.
#[derive(Debug)]
pub struct Replays {
    seen: Mutex<HashMap<[u8; 32], Instant>>,
    /// When this run started remembering, Unix ms.
    since_ms: u64,
}

impl Default for Replays {
    fn default() -> Self {
        Self::since(SystemTime::now())
    }
}

/// Most hop headers remembered; at a thousand hops a second that is the whole window.
const MAX_REMEMBERED: usize = 200_000;

impl Replays {
    /// Remembering from `start` (this run's start) on.
    pub fn since(start: SystemTime) -> Self {
        Self {
            seen: Mutex::default(),
            since_ms: unix_ms(start),
        }
    }

    /// Whether a header that verified as `signed` may be accepted: signed since this run
    /// started, and not seen before (it is remembered from now on).
    fn accept(&self, signed: &Signed, now: Instant) -> Result<(), HopError> {
        if signed.ts < self.since_ms {
            return Err(HopError::BeforeStart);
        }
        self.first_time(signed.signature, now)
    }

    fn first_time(&self, signature: [u8; 32], now: Instant) -> Result<(), HopError> {
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if seen.len() >= MAX_REMEMBERED {
            let window = MAX_SKEW * 2;
            seen.retain(|_, at| now.saturating_duration_since(*at) < window);
            if seen.len() >= MAX_REMEMBERED {
                let mut ages: Vec<Instant> = seen.values().copied().collect();
                ages.sort_unstable();
                let cut = ages[ages.len() / 2];
                seen.retain(|_, at| *at > cut);
            }
        }
        match seen.insert(signature, now) {
            Some(_) => Err(HopError::Replayed),
            None => Ok(()),
        }
    }
}

struct Fields<'a> {
    assertion: Assertion,
    ts: u64,
    nonce: &'a str,
    signature: &'a str,
}

impl<'a> Fields<'a> {
    fn parse(header: &'a HeaderValue) -> Option<Self> {
        let text = header.to_str().ok()?;
        let mut parts = text.split(';');
        if parts.next()? != "v1" {
            return None;
        }
        fn next<'a>(parts: &mut std::str::Split<'a, char>) -> Option<(&'a str, &'a str)> {
            parts.next()?.split_once('=')
        }
        let field = |parts: &mut std::str::Split<'a, char>, name: &str| {
            let (key, value) = next(parts)?;
            (key == name).then_some(value)
        };
        let node = decode_text(field(&mut parts, "n")?)?;
        let client = decode_text(field(&mut parts, "c")?)?;
        let verified = match field(&mut parts, "v")? {
            "1" => true,
            "0" => false,
            _ => return None,
        };
        let tier_name = field(&mut parts, "t")?;
        let tier = Tier::ALL
            .into_iter()
            .find(|tier| tier.as_str() == tier_name)?;
        let body = Body::parse(field(&mut parts, "b")?)?;
        // `g` is optional: the field after `b` is either it or `ts`.
        let (group, ts) = match next(&mut parts)? {
            ("g", group) => {
                let group: Arc<str> = Arc::from(decode_text(group).filter(|g| !g.is_empty())?);
                (Some(group), field(&mut parts, "ts")?)
            }
            ("ts", ts) => (None, ts),
            _ => return None,
        };
        let ts = ts.parse().ok()?;
        let nonce = field(&mut parts, "r")?;
        let signature = field(&mut parts, "s")?;
        if parts.next().is_some() {
            return None;
        }
        Some(Self {
            assertion: Assertion {
                node: Arc::from(node),
                client: Arc::from(client),
                verified,
                tier,
                body,
                group,
            },
            ts,
            nonce,
            signature,
        })
    }
}

fn decode_text(hex_text: &str) -> Option<String> {
    String::from_utf8(hex::decode(hex_text).ok()?).ok()
}

/// A `u64` in decimal, on the stack (`to_string` without its allocation).
struct Decimal {
    digits: [u8; 20],
    start: usize,
}

impl Decimal {
    fn of(mut n: u64) -> Self {
        let mut digits = [0; 20];
        let mut start = digits.len();
        loop {
            start -= 1;
            digits[start] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                return Self { digits, start };
            }
        }
    }

    fn as_str(&self) -> &str {
        std::str::from_utf8(&self.digits[self.start..]).unwrap_or_default()
    }
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
            body: Body::Digest(body_digest(b"{}")),
            group: None,
        }
    }

    fn request<'a>(id: &'a str, path: &'a str, _body: &'a str) -> Request<'a> {
        Request {
            to: "box2",
            id,
            method: &Method::POST,
            path,
        }
    }

    fn key() -> HopKey {
        HopKey::new("token").unwrap()
    }

    #[test]
    fn a_header_signed_before_this_run_started_is_refused() {
        // An owner that restarted remembers nothing of what its previous run accepted: a
        // header signed before its start, even within the skew, is refused.
        let key = key();
        let signed = SystemTime::now();
        let header = key.sign(&assertion(), request("r1", "/api/chat", ""), signed);
        let restarted = Replays::since(signed + Duration::from_millis(1));
        let now = signed + Duration::from_secs(2);
        let at = request("r1", "/api/chat", "");
        assert_eq!(
            verify(Some(&key), &restarted, &header, at, now),
            Err(HopError::BeforeStart)
        );
        // One signed after the start verifies, once.
        let fresh = key.sign(&assertion(), at, now);
        assert!(verify(Some(&key), &restarted, &fresh, at, now).is_ok());
        assert_eq!(
            verify(Some(&key), &restarted, &fresh, at, now),
            Err(HopError::Replayed)
        );
    }

    #[test]
    fn a_signed_assertion_verifies_once_and_round_trips() {
        let (key, replays) = (key(), Replays::default());
        let now = SystemTime::now();
        let body = body_digest(b"{}");
        let header = key.sign(&assertion(), request("r1", "/api/chat", &body), now);
        assert!(header.is_sensitive());
        let later = now + Duration::from_secs(5);
        let back = verify(
            Some(&key),
            &replays,
            &header,
            request("r1", "/api/chat", &body),
            later,
        );
        assert_eq!(back.unwrap(), assertion());
        assert_eq!(
            verify(
                Some(&key),
                &replays,
                &header,
                request("r1", "/api/chat", &body),
                later
            ),
            Err(HopError::Replayed),
            "a captured header cannot be sent again"
        );
        let again = key.sign(&assertion(), request("r1", "/api/chat", &body), now);
        assert_ne!(again, header, "each hop has its own nonce");
        assert!(
            verify(
                Some(&key),
                &replays,
                &again,
                request("r1", "/api/chat", &body),
                later
            )
            .is_ok()
        );
    }

    #[test]
    fn anything_changed_fails() {
        let key = key();
        let now = SystemTime::now();
        let body = body_digest(b"{}");
        let header = key.sign(&assertion(), request("r1", "/api/chat", &body), now);
        let check = |key: &HopKey, header: &HeaderValue, request: Request<'_>, at| {
            key.verify(header, request, at)
        };
        let bad = Err(HopError::BadSignature);
        assert_eq!(
            check(
                &HopKey::new("other").unwrap(),
                &header,
                request("r1", "/api/chat", &body),
                now
            ),
            bad
        );
        assert_eq!(
            check(&key, &header, request("r2", "/api/chat", &body), now),
            bad,
            "request id"
        );
        assert_eq!(
            check(&key, &header, request("r1", "/api/generate", &body), now),
            bad,
            "path"
        );
        let other_body = body_digest(b"{\"model\":\"big\"}");
        let swapped =
            HeaderValue::from_str(&header.to_str().unwrap().replace(&body, &other_body)).unwrap();
        assert_eq!(
            check(&key, &swapped, request("r1", "/api/chat", &body), now),
            bad,
            "body"
        );
        let mut elsewhere = request("r1", "/api/chat", &body);
        elsewhere.to = "box3";
        assert_eq!(check(&key, &header, elsewhere, now), bad, "destination");
        let promoted =
            HeaderValue::from_str(&header.to_str().unwrap().replace(";t=high;", ";t=low;"))
                .unwrap();
        assert_eq!(
            check(&key, &promoted, request("r1", "/api/chat", &body), now),
            bad,
            "tier"
        );
        assert_eq!(
            check(
                &key,
                &header,
                request("r1", "/api/chat", &body),
                now + MAX_SKEW + Duration::from_secs(1)
            ),
            Err(HopError::Skew)
        );
        for forged in [
            "",
            "v1",
            "v2;n=00",
            "v1;n=zz;c=00;v=1;t=high;b=-;ts=1;r=00;s=00",
            "v1;n=00;c=00;v=1;t=high;b=xyz;ts=1;r=00;s=00",
            // No unbound form: a streamed body is bound by its trailer.
            "v1;n=00;c=00;v=1;t=high;b=-;ts=1;r=00;s=00",
            "v1;n=00;c=00;v=1;t=high;b=~+1;ts=1;r=00;s=00",
            "v1;n=00;c=00;v=1;t=high;b=~1x;ts=1;r=00;s=00",
            "admin",
        ] {
            assert_eq!(
                check(
                    &key,
                    &HeaderValue::from_static(forged),
                    request("r1", "/api/chat", &body),
                    now
                ),
                Err(HopError::Malformed),
                "{forged}"
            );
        }
        assert_eq!(
            verify(
                None,
                &Replays::default(),
                &header,
                request("r1", "/api/chat", &body),
                now
            ),
            Err(HopError::NoKey)
        );
    }

    #[test]
    fn a_group_is_signed_with_the_hop_and_a_hop_without_one_reads_as_before() {
        let key = key();
        let now = SystemTime::now();
        let at = request("r1", "/api/chat", "");
        let grouped = Assertion {
            group: Some(Arc::from("admins")),
            ..assertion()
        };
        let header = key.sign(&grouped, at, now);
        let text = header.to_str().unwrap().to_owned();
        let field = format!(";g={};", hex::encode("admins"));
        assert!(text.contains(&field), "{text}");
        assert_eq!(key.verify(&header, at, now).unwrap(), grouped);
        // Another group, or none, is not what was signed.
        for changed in [
            text.replace(&field, &format!(";g={};", hex::encode("interns"))),
            text.replace(&field, ";"),
        ] {
            let changed = HeaderValue::from_str(&changed).unwrap();
            assert_eq!(key.verify(&changed, at, now), Err(HopError::BadSignature));
        }
        // Nor can a group be added to a hop signed without one.
        let plain = key.sign(&assertion(), at, now);
        let plain_text = plain.to_str().unwrap();
        assert!(!plain_text.contains(";g="));
        let added =
            HeaderValue::from_str(&plain_text.replace(";ts=", &format!("{field}ts="))).unwrap();
        assert_eq!(key.verify(&added, at, now), Err(HopError::BadSignature));
        // An empty or undecodable group, or one out of place, is malformed.
        for bad in [
            text.replace(&field, ";g=;"),
            text.replace(&field, ";g=zz;"),
            text.replace(&field, ";")
                .replace(";r=", &format!("{field}r=")),
        ] {
            let bad = HeaderValue::from_str(&bad).unwrap();
            assert_eq!(
                key.verify(&bad, at, now),
                Err(HopError::Malformed),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn the_header_is_written_as_the_hex_and_decimal_crates_write_it() {
        for bytes in [
            &b""[..],
            b"\x00\x0f\xf0\xff",
            "box1 é".as_bytes(),
            &[0xab; 32],
        ] {
            let mut out = b"x".to_vec();
            push_hex(&mut out, bytes);
            assert_eq!(out, format!("x{}", hex::encode(bytes)).into_bytes());
        }
        assert_eq!(body_digest(b"{}"), hex::encode(Sha256::digest(b"{}")));
        for n in [0, 7, 10, 1_733_000_000_123, u64::MAX] {
            assert_eq!(Decimal::of(n).as_str(), n.to_string());
        }
        let header = key().sign(&assertion(), request("r1", "/api/chat", ""), UNIX_EPOCH);
        let text = header.to_str().unwrap();
        let prefix = format!(
            "v1;n={};c={};v=1;t=high;b={};ts=0;r=",
            hex::encode("box1"),
            hex::encode("chat;ui=1"),
            body_digest(b"{}")
        );
        assert!(text.starts_with(&prefix), "{text}");
        let (nonce, signature) = text[prefix.len()..].split_once(";s=").unwrap();
        assert_eq!((nonce.len(), signature.len()), (24, 64), "{text}");
    }

    #[test]
    fn a_replayed_header_is_refused_however_its_hex_is_written() {
        let (key, replays) = (key(), Replays::default());
        let now = SystemTime::now();
        let at = request("r1", "/api/chat", "");
        let header = key.sign(&assertion(), at, now);
        assert!(verify(Some(&key), &replays, &header, at, now).is_ok());
        let text = header.to_str().unwrap();
        let (head, signature) = text.split_once(";s=").unwrap();
        let node = hex::encode("box1");
        for respelled in [
            format!("{head};s={}", signature.to_uppercase()),
            text.replace(
                &format!("n={node};"),
                &format!("n={};", node.to_uppercase()),
            ),
        ] {
            assert_ne!(respelled, text);
            let respelled = HeaderValue::from_str(&respelled).unwrap();
            assert_eq!(
                key.verify(&respelled, at, now),
                Ok(assertion()),
                "{respelled:?}"
            );
            assert_eq!(
                verify(Some(&key), &replays, &respelled, at, now),
                Err(HopError::Replayed),
                "{respelled:?}"
            );
            assert_eq!(
                verify_any(std::slice::from_ref(&key), &replays, &respelled, at, now).unwrap_err(),
                HopError::Replayed
            );
        }
    }

    #[test]
    fn an_empty_token_is_no_key_and_the_key_never_prints() {
        assert!(HopKey::new("").is_none() && HopKey::new("  \n").is_none());
        assert_eq!(format!("{:?}", key()), "HopKey(…)");
    }

    #[test]
    fn a_streamed_body_is_signed_with_its_length_and_sealed_by_its_trailer() {
        let key = key();
        let now = SystemTime::now();
        let at = request("r1", "/api/blobs/sha256:00", "");
        for length in [None, Some(0), Some(5)] {
            let streamed = Assertion {
                body: Body::Trailer(length),
                ..assertion()
            };
            let header = key.sign(&streamed, at, now);
            assert_eq!(key.verify(&header, at, now).unwrap(), streamed);
        }
        let header = key.sign(
            &Assertion {
                body: Body::Trailer(Some(5)),
                ..assertion()
            },
            at,
            now,
        );
        assert!(header.to_str().unwrap().contains(";b=~5;"));
        let lengthened =
            HeaderValue::from_str(&header.to_str().unwrap().replace(";b=~5;", ";b=~6;")).unwrap();
        assert_eq!(
            key.verify(&lengthened, at, now),
            Err(HopError::BadSignature),
            "the length is signed"
        );
        let unbound =
            HeaderValue::from_str(&header.to_str().unwrap().replace(";b=~5;", ";b=~;")).unwrap();
        assert_eq!(key.verify(&unbound, at, now), Err(HopError::BadSignature));

        let digest: [u8; 32] = Sha256::digest(b"hello").into();
        let seal = key.seal_body(&header, &digest);
        assert_eq!(key.check_body(&header, &digest, &seal), Ok(()));
        let changed: [u8; 32] = Sha256::digest(b"hellp").into();
        assert_eq!(
            key.check_body(&header, &changed, &seal),
            Err(HopError::BodyMismatch),
            "a changed byte"
        );
        assert_eq!(
            key.check_body(&header, &changed, &key.seal_body(&header, &[0; 32])),
            Err(HopError::BodyMismatch),
            "another digest"
        );
        let other = key.sign(
            &Assertion {
                body: Body::Trailer(Some(5)),
                ..assertion()
            },
            at,
            now,
        );
        assert_eq!(
            key.check_body(&header, &digest, &key.seal_body(&other, &digest)),
            Err(HopError::BodyMismatch),
            "another hop's trailer, for the same body"
        );
        assert_eq!(
            HopKey::new("other")
                .unwrap()
                .check_body(&header, &digest, &seal),
            Err(HopError::BodyMismatch),
            "another key"
        );
        for garbage in ["", "zz", "00"] {
            assert_eq!(
                key.check_body(&header, &digest, &HeaderValue::from_static(garbage)),
                Err(HopError::BodyMismatch)
            );
        }
    }

    #[test]
    fn a_hop_verifies_with_the_pair_key_it_was_signed_with_alone() {
        let pair = HopKey::from_bytes(&[7; 32]).unwrap();
        let other = HopKey::from_bytes(&[8; 32]).unwrap();
        assert!(HopKey::from_bytes(&[7; 31]).is_none());
        let replays = Replays::since(UNIX_EPOCH);
        let now = SystemTime::now();
        let at = request("r1", "/api/generate", "{}");
        let header = pair.sign(&assertion(), at, now);
        assert_eq!(claimed_edge(&header).as_deref(), Some("box1"));
        assert_eq!(
            verify_any(std::slice::from_ref(&other), &replays, &header, at, now).unwrap_err(),
            HopError::BadSignature
        );
        assert_eq!(
            verify_any(&[], &replays, &header, at, now).unwrap_err(),
            HopError::NoKey
        );
        let (verified, key) =
            verify_any(&[other.clone(), pair.clone()], &replays, &header, at, now).unwrap();
        assert_eq!(verified, assertion());
        // The key that verified, not the first tried: the trailer is checked with it.
        let digest = [1; 32];
        let seal = pair.seal_body(&header, &digest);
        assert!(key.check_body(&header, &digest, &seal).is_ok());
        assert_eq!(
            verify_any(&[pair], &replays, &header, at, now).unwrap_err(),
            HopError::Replayed
        );
    }
}
