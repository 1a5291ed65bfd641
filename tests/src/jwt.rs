//! JWT users for tests: signing keys made in the test (rcgen, ES256 and EdDSA) or, for RS256,
//! the fixture `tests/fixtures/jwt/rs256.key.der` (ring cannot generate RSA keys; made by
//! `scripts/make-jwt-fixture.sh`), tokens signed with them, and a loopback JWKS server whose
//! key set and health the test changes.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// One signing key of a test issuer.
pub struct SigningKey {
    /// Its `kid`.
    pub kid: String,
    algorithm: jsonwebtoken::Algorithm,
    encoding: jsonwebtoken::EncodingKey,
    /// Its public JWK.
    pub jwk: Value,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKey")
            .field("kid", &self.kid)
            .finish_non_exhaustive()
    }
}

impl SigningKey {
    /// A fresh P-256 key (ES256).
    #[allow(clippy::expect_used)]
    pub fn es256(kid: &str) -> Self {
        let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("P-256 key");
        // The raw public key is the uncompressed point: 0x04, x, y.
        let point = pair.public_key_raw();
        let jwk = json!({
            "kty": "EC", "crv": "P-256", "use": "sig", "kid": kid, "alg": "ES256",
            "x": URL_SAFE_NO_PAD.encode(&point[1..33]),
            "y": URL_SAFE_NO_PAD.encode(&point[33..65]),
        });
        Self {
            kid: kid.to_owned(),
            algorithm: jsonwebtoken::Algorithm::ES256,
            encoding: jsonwebtoken::EncodingKey::from_ec_der(&pair.serialize_der()),
            jwk,
        }
    }

    /// A fresh Ed25519 key (EdDSA).
    #[allow(clippy::expect_used)]
    pub fn ed25519(kid: &str) -> Self {
        let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).expect("Ed25519 key");
        let jwk = json!({
            "kty": "OKP", "crv": "Ed25519", "use": "sig", "kid": kid,
            "x": URL_SAFE_NO_PAD.encode(pair.public_key_raw()),
        });
        Self {
            kid: kid.to_owned(),
            algorithm: jsonwebtoken::Algorithm::EdDSA,
            encoding: jsonwebtoken::EncodingKey::from_ed_der(&pair.serialize_der()),
            jwk,
        }
    }

    /// The fixture's 2048-bit RSA key (RS256), under `kid`.
    #[allow(clippy::expect_used)]
    pub fn rs256(kid: &str) -> Self {
        let der = include_bytes!("../fixtures/jwt/rs256.key.der");
        let mut jwk: Value = serde_json::from_str(include_str!("../fixtures/jwt/rs256.jwk.json"))
            .expect("the fixture's JWK");
        jwk["kid"] = json!(kid);
        jwk["use"] = json!("sig");
        jwk["alg"] = json!("RS256");
        Self {
            kid: kid.to_owned(),
            algorithm: jsonwebtoken::Algorithm::RS256,
            encoding: jsonwebtoken::EncodingKey::from_rsa_der(der),
            jwk,
        }
    }

    /// `claims` signed with this key, its `kid` in the header.
    #[allow(clippy::expect_used)]
    pub fn sign(&self, claims: &Value) -> String {
        let mut header = jsonwebtoken::Header::new(self.algorithm);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, claims, &self.encoding).expect("sign")
    }
}

/// A JWK Set of `keys`' public halves.
pub fn key_set(keys: &[&SigningKey]) -> String {
    json!({ "keys": keys.iter().map(|key| key.jwk.clone()).collect::<Vec<_>>() }).to_string()
}

/// Seconds since the Unix epoch, now.
pub fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs() as i64)
}

/// An unsigned token (`alg: none`) with `claims`.
pub fn unsigned(claims: &Value) -> String {
    let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"none","typ":"JWT"}"#);
    let body = URL_SAFE_NO_PAD.encode(claims.to_string());
    format!("{header}.{body}.")
}

/// `claims` signed with HMAC-SHA256 under `secret` (what an HS* confusion attack sends).
#[allow(clippy::expect_used)]
pub fn hs256(claims: &Value, kid: &str, secret: &[u8]) -> String {
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256);
    header.kid = Some(kid.to_owned());
    jsonwebtoken::encode(
        &header,
        claims,
        &jsonwebtoken::EncodingKey::from_secret(secret),
    )
    .expect("sign")
}

/// A loopback JWKS endpoint: answers every GET with the current key set, or with 503 while
/// it is down, and counts what it was asked.
#[derive(Debug)]
pub struct JwksServer {
    addr: SocketAddr,
    state: Arc<Mutex<(u16, String)>>,
    hits: Arc<AtomicUsize>,
    stop: CancellationToken,
}

impl JwksServer {
    /// Serves `body` (with 200) on `127.0.0.1:0`.
    #[allow(clippy::expect_used)]
    pub async fn start(body: &str) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        let state = Arc::new(Mutex::new((200, body.to_owned())));
        let hits = Arc::new(AtomicUsize::new(0));
        let stop = CancellationToken::new();
        let server = Self {
            addr,
            state: state.clone(),
            hits: hits.clone(),
            stop: stop.clone(),
        };
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = stop.cancelled() => return,
                    accepted = listener.accept() => accepted,
                };
                let Ok((stream, _)) = accepted else { continue };
                let state = state.clone();
                let hits = hits.clone();
                let service = service_fn(move |_request| {
                    hits.fetch_add(1, Ordering::SeqCst);
                    let (status, body) = state
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .clone();
                    let mut response = hyper::Response::new(Full::new(Bytes::from(body)));
                    *response.status_mut() =
                        http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::OK);
                    async move { Ok::<_, Infallible>(response) }
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        server
    }

    /// The key set's URL.
    pub fn url(&self) -> String {
        format!("http://{}/jwks.json", self.addr)
    }

    /// Serves `body` from now on.
    pub fn serve(&self, body: &str) {
        *self.lock() = (200, body.to_owned());
    }

    /// Answers 503 from now on.
    pub fn fail(&self) {
        self.lock().0 = 503;
    }

    /// How many requests it answered.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (u16, String)> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for JwksServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
