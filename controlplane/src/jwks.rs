//! The issuers' public keys for `jwt:` users (`auth.keys[].jwt`, `users.jwt`): fetched by the
//! control plane, never by a data plane, kept in the hub (`hub::Hub`), and shipped in every snapshot
//! (`Jwt.jwks_json`), public members only.
//!
//! One task (`crate::readers::jwks`, above the hub it writes into) reads each source (`jwks_url` or `jwks_file`) at start and when the
//! config changes, again every [`REFRESH_EVERY`] (so that a key the issuer retired leaves),
//! and when a data plane reports a token that named a key id the snapshot lacks (a rotation):
//! at most once per the source's `refresh_min_interval`. A failed fetch keeps the keys fetched
//! before (an issuer's blip locks no one out) and is retried after `refresh_min_interval`;
//! with no keys fetched yet, data planes refuse tokens and say why, as the log does. A
//! `jwks_url` is fetched under the webhook SSRF rules ([`crate::outbound::ssrf`]), with the
//! block's own `allowed_hosts` for an identity provider on the LAN.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use oqp_proto::policy::v1::PolicySnapshot;
use serde_json::Value;

use crate::config::{Config, JwksSource, JwtConfig, UserSource};
use crate::outbound::Outbound;

/// How often a source is read again when nothing asks for it sooner.
pub const REFRESH_EVERY: Duration = Duration::from_secs(3600);

/// Largest key set read (an identity provider's holds a few keys of a few hundred bytes).
pub const MAX_JWKS_BYTES: usize = 256 * 1024;

/// Deadline of one fetch.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// The members of a JWK that carry no secret; everything else (`d`, `p`, `q`, `dp`, `dq`,
/// `qi`, `k`, ...) is dropped before a key set leaves the control plane.
const PUBLIC_MEMBERS: [&str; 9] = ["kty", "use", "alg", "kid", "crv", "x", "y", "n", "e"];

/// What the last fetch of one source gave.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeySet {
    /// The public key set (a JWK Set, as JSON); empty when no fetch has succeeded.
    pub json: String,
    /// Why there is none, when there is none.
    pub error: String,
}

/// The clients whose users carry a token, with their `jwt` block, in config order.
pub fn sources(config: &Config) -> Vec<(&str, &JwtConfig)> {
    config
        .auth
        .keys
        .iter()
        .filter_map(|key| match key.users.as_ref().map(|users| &users.source) {
            Some(UserSource::Jwt(jwt)) => Some((key.client_id.as_str(), jwt)),
            _ => None,
        })
        .collect()
}

/// Puts the key set of each client's source into `snapshot`.
pub fn attach(snapshot: &mut PolicySnapshot, config: &Config, jwks: &HashMap<JwksSource, KeySet>) {
    for (client_id, jwt) in sources(config) {
        let Some(keys) = jwks.get(&jwt.jwks) else {
            continue;
        };
        let wire = snapshot
            .clients
            .iter_mut()
            .filter(|client| client.client_id == client_id && client.source == "config")
            .filter_map(|client| client.users.as_mut()?.jwt.as_mut());
        for wire in wire {
            wire.jwks_json.clone_from(&keys.json);
            wire.jwks_error.clone_from(&keys.error);
        }
    }
}

/// The public signing keys of a JWK Set, as a JWK Set: keys for encryption, symmetric keys
/// and keys of unknown types left out, and of the rest only the public members.
pub fn public_set(body: &[u8]) -> Result<String, String> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|error| format!("the key set is not JSON: {error}"))?;
    let keys = value
        .get("keys")
        .and_then(Value::as_array)
        .ok_or("the key set has no keys array")?;
    let mut kept = Vec::new();
    for key in keys {
        let Some(object) = key.as_object() else {
            continue;
        };
        if object
            .get("use")
            .and_then(Value::as_str)
            .is_some_and(|usage| usage != "sig")
        {
            continue;
        }
        if !matches!(
            object.get("kty").and_then(Value::as_str),
            Some("RSA" | "EC" | "OKP")
        ) {
            continue;
        }
        let public: serde_json::Map<String, Value> = object
            .iter()
            .filter(|(name, _)| PUBLIC_MEMBERS.contains(&name.as_str()))
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        let public = Value::Object(public);
        // A key the verifier could not read (an unknown curve or algorithm) is left out
        // here, so that it cannot spoil the set for the data planes.
        if serde_json::from_value::<jsonwebtoken::jwk::Jwk>(public.clone()).is_err() {
            continue;
        }
        kept.push(public);
    }
    if kept.is_empty() {
        return Err("the key set has no public signing key".to_owned());
    }
    Ok(serde_json::json!({ "keys": kept }).to_string())
}

/// Where a source is, as a log line may say it (a URL without user info or query).
pub fn describe(source: &JwksSource) -> String {
    match source {
        JwksSource::Url(url) => crate::webhooks::redacted(url),
        JwksSource::File(path) => path.display().to_string(),
    }
}

/// Reads `jwt`'s key set once.
pub async fn fetch(
    jwt: &JwtConfig,
    outbound: &Outbound,
    public_only: &Outbound,
) -> Result<String, String> {
    match &jwt.jwks {
        JwksSource::File(path) => {
            let body = tokio::fs::read(path)
                .await
                .map_err(|error| format!("jwks_file cannot be read: {error}"))?;
            if body.len() > MAX_JWKS_BYTES {
                return Err(format!("jwks_file is larger than {MAX_JWKS_BYTES} bytes"));
            }
            public_set(&body)
        }
        JwksSource::Url(url) => {
            let exempt = crate::outbound::ssrf::check_url(url, &jwt.allowed_hosts)
                .await
                .map_err(|error| {
                    let error = error.to_string().replacen("Webhook URL", "jwks_url", 1);
                    format!(
                        "refused by the SSRF check: {error} (list the host in jwt.allowed_hosts \
                         to allow it)"
                    )
                })?;
            let client = if exempt { outbound } else { public_only };
            let request = Request::get(url.as_str())
                .header(http::header::ACCEPT, "application/json")
                .header(
                    http::header::USER_AGENT,
                    concat!("oqp/", env!("CARGO_PKG_VERSION")),
                )
                .body(Full::new(Bytes::new()))
                .map_err(|error| format!("jwks_url is not a request target: {error}"))?;
            let reply = client
                .send(request, FETCH_TIMEOUT, MAX_JWKS_BYTES)
                .await
                .map_err(|error| error.to_string())?;
            if !reply.status.is_success() {
                return Err(format!("the issuer answered {}", reply.status));
            }
            public_set(&reply.body)
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn only_public_members_of_signing_keys_leave_the_control_plane() {
        let set = serde_json::json!({ "keys": [
            // An RSA key given whole, private parts included.
            { "kty": "RSA", "kid": "r1", "use": "sig", "alg": "RS256", "n": "sXch", "e": "AQAB",
              "d": "secret-d", "p": "secret-p", "q": "secret-q", "dp": "x", "dq": "y", "qi": "z" },
            // A shared secret, an encryption key, an unknown curve: left out.
            { "kty": "oct", "kid": "h1", "k": "c2VjcmV0" },
            { "kty": "EC", "kid": "e2", "use": "enc", "crv": "P-256", "x": "AA", "y": "AA" },
            { "kty": "EC", "kid": "e3", "crv": "secp256k1", "x": "AA", "y": "AA" },
            { "kty": "OKP", "kid": "o1", "crv": "Ed25519", "x": "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo", "d": "secret" },
        ]});
        let public = public_set(set.to_string().as_bytes()).unwrap();
        assert!(!public.contains("secret"), "{public}");
        let kept: Value = serde_json::from_str(&public).unwrap();
        let kids: Vec<&str> = kept["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|key| key["kid"].as_str().unwrap())
            .collect();
        assert_eq!(kids, ["r1", "o1"]);
        assert_eq!(
            public_set(br#"{"keys": [{"kty": "oct", "k": "c2VjcmV0"}]}"#),
            Err("the key set has no public signing key".to_owned())
        );
        assert!(public_set(b"<html>").unwrap_err().contains("not JSON"));
    }
}
