//! Verified end users from a signed token (a JWT): `auth.keys[].jwt`, where each user's
//! token is the credential, and `auth.keys[].users.jwt`, where an app authenticates with its
//! key and names each user with a token.
//!
//! The control plane fetches each issuer's public keys (its JWKS) and ships them in the
//! snapshot; a [`Verifier`] compiled from that checks a token's signature by its `kid`, its
//! `exp` and `nbf` (with [`LEEWAY_SECONDS`]), `iss` and `aud`, and reads the user from one
//! claim. The cryptography is the `jsonwebtoken` crate's (ring underneath); what is decided
//! here is what gets accepted: asymmetric algorithms only (never `none` or HS*, so that a
//! public key can never serve as an HMAC secret), an algorithm that fits the key it names,
//! `exp` required, and tokens of at most [`MAX_TOKEN_BYTES`].

use std::collections::HashMap;

use http::HeaderMap;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};

/// Longest token read; a longer one is refused before it is decoded.
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// Clock skew allowed on `exp` and `nbf`, seconds.
pub const LEEWAY_SECONDS: u64 = 30;

/// The algorithms a verifier may accept: the asymmetric ones `jsonwebtoken` verifies.
pub const ALGORITHMS: [&str; 9] = [
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "EdDSA",
];

/// Why a token was not accepted. The messages name the check, never the token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Longer than [`MAX_TOKEN_BYTES`].
    #[error("token longer than {MAX_TOKEN_BYTES} bytes")]
    TooLarge,
    /// Not three base64url parts with a JSON header naming a known algorithm.
    #[error("malformed token, or an algorithm that is never accepted (none, HS*)")]
    Malformed,
    /// An algorithm outside the configured list, or one that does not fit the key.
    #[error("token algorithm {0} not accepted")]
    Algorithm(String),
    /// The control plane has no keys for this issuer yet; the text says why.
    #[error("no signing keys for this issuer yet: {0}")]
    NoKeys(String),
    /// The token names a key the issuer's key set does not have (yet).
    #[error("token signed with an unknown key id")]
    UnknownKeyId,
    /// The signature does not verify.
    #[error("token signature does not verify")]
    Signature,
    /// `exp` has passed.
    #[error("token expired")]
    Expired,
    /// `nbf` is still ahead.
    #[error("token not valid yet")]
    NotYetValid,
    /// A claim the checks need is absent (`exp`, `iss`, `aud`).
    #[error("token has no {0} claim")]
    MissingClaim(String),
    /// `iss` is not the configured issuer.
    #[error("token issuer not accepted")]
    Issuer,
    /// `aud` names none of the configured audiences.
    #[error("token audience not accepted")]
    Audience,
    /// The user claim is absent, or is not a user id.
    #[error("token claim {0} is not a user id")]
    User(String),
}

impl TokenError {
    /// Whether fetching the issuer's keys again could make the token verify: it named a key
    /// the snapshot lacks, or there were no keys at all.
    pub fn wants_keys(&self) -> bool {
        matches!(self, Self::UnknownKeyId | Self::NoKeys(_))
    }

    /// Whether the refusal counts against the caller's address in the failed-attempt
    /// throttle. A token refused for its time, or for keys this snapshot lacks, is a real
    /// user's, not a guess: one app forwards every user's token from one address (Open
    /// WebUI), and a stale token or a key rotation must not lock all of its users out.
    pub fn counts_as_failure(&self) -> bool {
        !matches!(
            self,
            Self::Expired | Self::NotYetValid | Self::UnknownKeyId | Self::NoKeys(_)
        )
    }
}

/// A `jwt:` block compiled for the request path.
pub struct Verifier {
    issuer: String,
    audiences: Vec<String>,
    user_claim: String,
    /// Where the token comes; `authorization` means `Authorization: Bearer`.
    header: http::HeaderName,
    algorithms: Vec<Algorithm>,
    /// By `kid`.
    keys: HashMap<String, Key>,
    /// The set's only key, for tokens that name no `kid`.
    only: Option<Key>,
    /// Why there are no keys, when there are none.
    unavailable: Option<String>,
    /// The claim whose values choose the user's settings (`claims_to_policy.claim`), if any.
    choosing_claim: Option<String>,
}

/// A verified token's user, and the values of its choosing claim.
#[derive(Debug, Clone)]
pub struct Verified {
    /// The user claim's value.
    pub user: String,
    /// The string values of the choosing claim (a string, or the strings of an array);
    /// empty without one.
    pub values: Vec<String>,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut kids: Vec<&String> = self.keys.keys().collect();
        kids.sort();
        f.debug_struct("Verifier")
            .field("issuer", &self.issuer)
            .field("audiences", &self.audiences)
            .field("user_claim", &self.user_claim)
            .field("header", &self.header)
            .field("algorithms", &self.algorithms)
            .field("kids", &kids)
            .field("unavailable", &self.unavailable)
            .finish()
    }
}

/// One public key of the issuer.
#[derive(Clone)]
struct Key {
    decoding: DecodingKey,
    /// What kind of key it is, which decides the algorithms it can verify.
    kind: KeyKind,
    /// The `alg` the key set pins it to, if any.
    pinned: Option<Algorithm>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyKind {
    Rsa,
    P256,
    P384,
    Ed25519,
}

impl KeyKind {
    fn fits(self, algorithm: Algorithm) -> bool {
        use Algorithm::*;
        match self {
            KeyKind::Rsa => matches!(algorithm, RS256 | RS384 | RS512 | PS256 | PS384 | PS512),
            KeyKind::P256 => algorithm == ES256,
            KeyKind::P384 => algorithm == ES384,
            KeyKind::Ed25519 => algorithm == EdDSA,
        }
    }
}

/// The parts of a `jwt:` block, as the snapshot carries them.
#[derive(Debug, Clone, Default)]
pub struct Settings<'a> {
    pub issuer: &'a str,
    pub audiences: &'a [String],
    pub user_claim: &'a str,
    pub header: &'a str,
    pub algorithms: &'a [String],
    pub jwks_json: &'a str,
    pub jwks_error: &'a str,
}

impl Verifier {
    /// Compiles `settings`, or says what is wrong with them. A key of the set that is not
    /// usable (symmetric, an unknown curve) is left out; a set that does not parse leaves the
    /// verifier without keys (every token refused, with the reason).
    pub fn try_new(settings: &Settings<'_>) -> Result<Self, String> {
        if settings.issuer.is_empty() {
            return Err("jwt.issuer is empty".to_owned());
        }
        if settings.audiences.is_empty() {
            return Err("jwt.audiences is empty".to_owned());
        }
        let header = if settings.header.is_empty() {
            http::header::AUTHORIZATION
        } else {
            http::HeaderName::from_bytes(settings.header.as_bytes())
                .map_err(|_| format!("jwt.header '{}' is not a header name", settings.header))?
        };
        let mut algorithms = Vec::new();
        for name in settings.algorithms {
            if !ALGORITHMS.contains(&name.as_str()) {
                return Err(format!("jwt.algorithms: '{name}' is not accepted"));
            }
            let algorithm: Algorithm = name
                .parse()
                .map_err(|_| format!("jwt.algorithms: '{name}' is not an algorithm"))?;
            algorithms.push(algorithm);
        }
        if algorithms.is_empty() {
            return Err("jwt.algorithms is empty".to_owned());
        }
        let user_claim = if settings.user_claim.is_empty() {
            "sub".to_owned()
        } else {
            settings.user_claim.to_owned()
        };
        let (keys, unavailable) = if settings.jwks_json.is_empty() {
            let why = if settings.jwks_error.is_empty() {
                "the control plane has not fetched them"
            } else {
                settings.jwks_error
            };
            (Vec::new(), Some(why.to_owned()))
        } else {
            match serde_json::from_str::<JwkSet>(settings.jwks_json) {
                Ok(set) => (set.keys, None),
                Err(error) => (
                    Vec::new(),
                    Some(format!("the key set does not parse: {error}")),
                ),
            }
        };
        let count = keys.len();
        let mut by_kid = HashMap::new();
        let mut only = None;
        for jwk in keys {
            let kind = match &jwk.algorithm {
                AlgorithmParameters::RSA(_) => KeyKind::Rsa,
                AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
                    EllipticCurve::P256 => KeyKind::P256,
                    EllipticCurve::P384 => KeyKind::P384,
                    _ => continue,
                },
                AlgorithmParameters::OctetKeyPair(okp) if okp.curve == EllipticCurve::Ed25519 => {
                    KeyKind::Ed25519
                }
                _ => continue,
            };
            let Ok(decoding) = DecodingKey::from_jwk(&jwk) else {
                continue;
            };
            let pinned = jwk
                .common
                .key_algorithm
                .and_then(|alg| alg.to_string().parse::<Algorithm>().ok());
            let key = Key {
                decoding,
                kind,
                pinned,
            };
            if count == 1 {
                only = Some(key.clone());
            }
            if let Some(kid) = jwk.common.key_id {
                by_kid.insert(kid, key);
            }
        }
        let unavailable = match unavailable {
            None if by_kid.is_empty() && only.is_none() => {
                Some("the issuer's key set has no usable public key".to_owned())
            }
            other => other,
        };
        Ok(Self {
            issuer: settings.issuer.to_owned(),
            audiences: settings.audiences.to_vec(),
            user_claim,
            header,
            algorithms,
            keys: by_kid,
            only,
            unavailable,
            choosing_claim: None,
        })
    }

    /// Reading `claim`'s values too (`claims_to_policy.claim`).
    pub fn with_choosing_claim(mut self, claim: Option<String>) -> Self {
        self.choosing_claim = claim;
        self
    }

    /// The `iss` its tokens must carry.
    pub fn issuer(&self) -> &str {
        &self.issuer
    }

    /// How many of the issuer's public keys it holds.
    pub fn key_count(&self) -> usize {
        self.keys.len().max(usize::from(self.only.is_some()))
    }

    /// Why it refuses every token (the control plane could not fetch the issuer's keys, or
    /// they do not parse), if it does.
    pub fn unavailable(&self) -> Option<&str> {
        self.unavailable.as_deref()
    }

    /// The header the token comes in.
    pub fn header(&self) -> &http::HeaderName {
        &self.header
    }

    /// The token a request carries where this verifier reads it: `Authorization: Bearer
    /// <token>`, or the named header's value (a `Bearer ` prefix there is dropped too).
    pub fn token<'a>(&self, headers: &'a HeaderMap) -> Option<&'a str> {
        let value = headers.get(&self.header)?.to_str().ok()?.trim();
        let token = match value.split_once(' ') {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("bearer") => rest.trim(),
            _ if self.header == http::header::AUTHORIZATION => return None,
            _ => value,
        };
        (!token.is_empty()).then_some(token)
    }

    /// The user `token` names, if it verifies.
    pub fn verify(&self, token: &str) -> Result<String, TokenError> {
        self.verify_user(token).map(|verified| verified.user)
    }

    /// The user `token` names and the settings its claims select, if it verifies.
    pub fn verify_user(&self, token: &str) -> Result<Verified, TokenError> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(TokenError::TooLarge);
        }
        let header = jsonwebtoken::decode_header(token).map_err(|_| TokenError::Malformed)?;
        let algorithm = header.alg;
        if !self.algorithms.contains(&algorithm) {
            return Err(TokenError::Algorithm(format!("{algorithm:?}")));
        }
        if let Some(why) = &self.unavailable {
            return Err(TokenError::NoKeys(why.clone()));
        }
        let key = match &header.kid {
            Some(kid) => self.keys.get(kid),
            None => self.only.as_ref(),
        }
        .ok_or(TokenError::UnknownKeyId)?;
        if !key.kind.fits(algorithm) || key.pinned.is_some_and(|pinned| pinned != algorithm) {
            return Err(TokenError::Algorithm(format!("{algorithm:?}")));
        }
        let mut validation = Validation::new(algorithm);
        validation.leeway = LEEWAY_SECONDS;
        validation.validate_exp = true;
        validation.validate_nbf = true;
        validation.set_required_spec_claims(&["exp", "iss", "aud"]);
        validation.set_issuer(&[&self.issuer]);
        validation.set_audience(&self.audiences);
        let claims = jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(
            token,
            &key.decoding,
            &validation,
        )
        .map_err(|error| token_error(error.kind()))?
        .claims;
        let user = match claims.get(&self.user_claim) {
            Some(serde_json::Value::String(user)) => user.clone(),
            Some(serde_json::Value::Number(number)) => number.to_string(),
            _ => return Err(TokenError::User(self.user_claim.clone())),
        };
        if !crate::headers::is_user_id(&user) {
            return Err(TokenError::User(self.user_claim.clone()));
        }
        let values = match self
            .choosing_claim
            .as_ref()
            .and_then(|claim| claims.get(claim))
        {
            Some(serde_json::Value::String(value)) => vec![value.clone()],
            Some(serde_json::Value::Array(values)) => values
                .iter()
                .filter_map(|value| value.as_str().map(str::to_owned))
                .collect(),
            _ => Vec::new(),
        };
        Ok(Verified { user, values })
    }
}

fn token_error(kind: &jsonwebtoken::errors::ErrorKind) -> TokenError {
    use jsonwebtoken::errors::ErrorKind;
    match kind {
        ErrorKind::ExpiredSignature => TokenError::Expired,
        ErrorKind::ImmatureSignature => TokenError::NotYetValid,
        ErrorKind::InvalidIssuer => TokenError::Issuer,
        ErrorKind::InvalidAudience => TokenError::Audience,
        ErrorKind::MissingRequiredClaim(claim) => TokenError::MissingClaim(claim.clone()),
        ErrorKind::InvalidSignature => TokenError::Signature,
        ErrorKind::InvalidAlgorithm | ErrorKind::InvalidAlgorithmName => {
            TokenError::Algorithm("of the token".to_owned())
        }
        _ => TokenError::Malformed,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use base64::Engine;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use serde_json::json;

    use super::*;

    const ISSUER: &str = "https://idp.example";

    /// A P-256 key: its encoding half and its public JWK under `kid`.
    fn p256(kid: &str) -> (jsonwebtoken::EncodingKey, serde_json::Value) {
        let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let point = pair.public_key_raw();
        let jwk = json!({
            "kty": "EC", "crv": "P-256", "kid": kid,
            "x": URL_SAFE_NO_PAD.encode(&point[1..33]),
            "y": URL_SAFE_NO_PAD.encode(&point[33..65]),
        });
        (
            jsonwebtoken::EncodingKey::from_ec_der(&pair.serialize_der()),
            jwk,
        )
    }

    fn verifier(keys: &[&serde_json::Value], algorithms: &[&str]) -> Result<Verifier, String> {
        let set = json!({ "keys": keys }).to_string();
        let algorithms: Vec<String> = algorithms.iter().map(|a| (*a).to_owned()).collect();
        Verifier::try_new(&Settings {
            issuer: ISSUER,
            audiences: &["oqp".to_owned()],
            user_claim: "",
            header: "",
            algorithms: &algorithms,
            jwks_json: &set,
            jwks_error: "",
        })
    }

    fn sign(
        key: &jsonwebtoken::EncodingKey,
        kid: Option<&str>,
        claims: &serde_json::Value,
    ) -> String {
        let mut header = jsonwebtoken::Header::new(Algorithm::ES256);
        header.kid = kid.map(str::to_owned);
        jsonwebtoken::encode(&header, claims, key).unwrap()
    }

    fn claims(sub: &str) -> serde_json::Value {
        let now = jsonwebtoken::get_current_timestamp();
        json!({ "iss": ISSUER, "aud": "oqp", "sub": sub, "exp": now + 300 })
    }

    #[test]
    fn a_token_names_its_subject_and_its_key_by_kid() {
        let (key, jwk) = p256("k1");
        let (other, other_jwk) = p256("k2");
        let verifier = verifier(&[&jwk, &other_jwk], &["ES256"]).unwrap();
        assert_eq!(
            verifier.verify(&sign(&key, Some("k1"), &claims("alice"))),
            Ok("alice".into())
        );
        assert_eq!(
            verifier.verify(&sign(&other, Some("k2"), &claims("bob"))),
            Ok("bob".into())
        );
        // Signed by one key, naming the other.
        assert_eq!(
            verifier.verify(&sign(&key, Some("k2"), &claims("eve"))),
            Err(TokenError::Signature)
        );
        assert_eq!(
            verifier.verify(&sign(&key, Some("k3"), &claims("eve"))),
            Err(TokenError::UnknownKeyId)
        );
        // No kid: only a set of one key says which key that is.
        assert_eq!(
            verifier.verify(&sign(&key, None, &claims("eve"))),
            Err(TokenError::UnknownKeyId)
        );
        let single = self::verifier(&[&jwk], &["ES256"]).unwrap();
        assert_eq!(
            single.verify(&sign(&key, None, &claims("alice"))),
            Ok("alice".into())
        );
    }

    #[test]
    fn none_hs_and_algorithms_that_do_not_fit_the_key_are_refused() {
        let (key, jwk) = p256("k1");
        assert!(verifier(&[&jwk], &["HS256"]).is_err());
        assert!(verifier(&[&jwk], &["none"]).is_err());
        let verifier = verifier(&[&jwk], &["ES256", "EdDSA"]).unwrap();
        let body = URL_SAFE_NO_PAD.encode(claims("eve").to_string());
        let none = format!(
            "{}.{body}.",
            URL_SAFE_NO_PAD.encode(r#"{"alg":"none","kid":"k1"}"#)
        );
        assert_eq!(verifier.verify(&none), Err(TokenError::Malformed));
        // HMAC with the public key's bytes as the secret: not an accepted algorithm.
        let mut header = jsonwebtoken::Header::new(Algorithm::HS256);
        header.kid = Some("k1".into());
        let secret = jsonwebtoken::EncodingKey::from_secret(jwk["x"].as_str().unwrap().as_bytes());
        let hs = jsonwebtoken::encode(&header, &claims("eve"), &secret).unwrap();
        assert!(matches!(
            verifier.verify(&hs),
            Err(TokenError::Algorithm(_))
        ));
        // An accepted algorithm the named key cannot verify.
        let mut header = jsonwebtoken::Header::new(Algorithm::ES256);
        header.kid = Some("k1".into());
        let token = jsonwebtoken::encode(&header, &claims("alice"), &key).unwrap();
        let (_, rest) = token.split_once('.').unwrap();
        let eddsa = format!(
            "{}.{rest}",
            URL_SAFE_NO_PAD.encode(r#"{"alg":"EdDSA","kid":"k1"}"#)
        );
        assert!(matches!(
            verifier.verify(&eddsa),
            Err(TokenError::Algorithm(_))
        ));
    }

    #[test]
    fn exp_is_required_and_oversized_tokens_are_not_decoded() {
        let (key, jwk) = p256("k1");
        let verifier = verifier(&[&jwk], &["ES256"]).unwrap();
        let mut no_exp = claims("eve");
        no_exp.as_object_mut().unwrap().remove("exp");
        assert_eq!(
            verifier.verify(&sign(&key, Some("k1"), &no_exp)),
            Err(TokenError::MissingClaim("exp".into()))
        );
        // Within the leeway an expired token still passes; beyond it, not.
        let now = jsonwebtoken::get_current_timestamp();
        let mut late = claims("alice");
        late["exp"] = json!(now - LEEWAY_SECONDS / 2);
        assert!(verifier.verify(&sign(&key, Some("k1"), &late)).is_ok());
        late["exp"] = json!(now - LEEWAY_SECONDS * 2);
        assert_eq!(
            verifier.verify(&sign(&key, Some("k1"), &late)),
            Err(TokenError::Expired)
        );
        let mut big = claims("alice");
        big["pad"] = json!("x".repeat(MAX_TOKEN_BYTES));
        assert_eq!(
            verifier.verify(&sign(&key, Some("k1"), &big)),
            Err(TokenError::TooLarge)
        );
    }

    #[test]
    fn without_keys_every_token_is_refused_with_the_reason() {
        let (key, _) = p256("k1");
        let verifier = Verifier::try_new(&Settings {
            issuer: ISSUER,
            audiences: &["oqp".to_owned()],
            algorithms: &["ES256".to_owned()],
            jwks_error: "fetching the key set failed: connection refused",
            ..Settings::default()
        })
        .unwrap();
        let refused = verifier
            .verify(&sign(&key, Some("k1"), &claims("alice")))
            .unwrap_err();
        assert!(refused.wants_keys() && !refused.counts_as_failure());
        assert!(
            refused.to_string().contains("connection refused"),
            "{refused}"
        );
    }
}
