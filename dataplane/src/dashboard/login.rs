//! Signing in to the dashboard: `POST /dashboard/login` exchanges a key (a form field or JSON
//! `{"key": …}`) for a session cookie, `POST /dashboard/logout` ends it, and [`identify`]
//! accepts that cookie on the read-only routes (status, summary, metrics, the dashboard and
//! its usage view) when no key is presented. A key in `Authorization` keeps working for
//! scripts; the cookie is never accepted anywhere else (no inference, no queue control).
//!
//! Cross-site requests: the cookie is `SameSite=Strict`, so a browser sends it only with
//! requests from the dashboard's own origin, and both POSTs refuse a foreign `Origin` or a
//! `Sec-Fetch-Site` other than `same-origin` (403), so another site can neither sign a visitor
//! in under its own key nor sign them out. The key is read from the body, looked up by digest
//! and dropped: it is never logged, never stored, and never sent back (the form answers with a
//! redirect, so reloading the page does not post it again).

use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::session::{self, SESSION_TTL, Sessions};
use crate::auth::{self, Identity, ListenerKind, Throttle};
use crate::body::{self, Body};
use crate::error::ProxyError;
use crate::policy::{Policy, Scope};

/// The login page, with `{{NONCE}}`, `{{MESSAGE}}` and `{{TTL_HOURS}}` to fill in.
pub const LOGIN_PAGE: &str = include_str!("../login.html");

/// Largest login body read.
const MAX_LOGIN_BODY: usize = 4096;

/// Where the form's answers send the browser: the dashboard, relative to
/// `…/dashboard/login` (so that it works under a reverse proxy's path prefix too).
const BACK_TO_DASHBOARD: &str = "../dashboard";

/// The caller of a read-only route: a presented key as always, else (auth on, main port) the
/// session in its cookie. A cookie that names no live session is a missing credential, not
/// a failed attempt: it is not counted against the address (ids cannot be guessed, and a
/// dashboard left open past its session must not lock its user out of signing in again).
pub fn identify<B>(
    sessions: &Sessions,
    throttle: &Throttle,
    refresh: &auth::KeyRefresh,
    policy: &Policy,
    kind: &ListenerKind,
    peer: IpAddr,
    request: &http::Request<B>,
) -> Result<Identity, ProxyError> {
    let headers = request.headers();
    if policy.auth.enabled
        && matches!(kind, ListenerKind::Main)
        && !auth::presents_key(headers)
        && let Some(id) = session::from_cookies(headers)
    {
        let now = SystemTime::now();
        return sessions
            .find(id, now)
            .and_then(|digest| policy.clients.get(&digest))
            .filter(|client| !client.is_expired(now))
            .map(|client| Identity::Client(client.clone()))
            .ok_or(ProxyError::MissingCredentials);
    }
    let certificate = request.extensions().get::<auth::PeerCertificate>();
    auth::identify(policy, kind, peer, headers, throttle, refresh, certificate)
}

/// The login page (401), saying `message` (fixed text, never anything the caller sent).
pub fn login_page(message: &str) -> Response<Body> {
    let nonce = super::nonce();
    let page = LOGIN_PAGE
        .replace("{{NONCE}}", &nonce)
        .replace("{{MESSAGE}}", message)
        .replace("{{TTL_HOURS}}", &(SESSION_TTL.as_secs() / 3600).to_string());
    let mut response = Response::new(body::full(page));
    *response.status_mut() = StatusCode::UNAUTHORIZED;
    let headers = response.headers_mut();
    super::page_headers(headers);
    headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    if let Ok(csp) = HeaderValue::from_str(&format!(
        "default-src 'none'; style-src 'nonce-{nonce}'; base-uri 'none'; \
         form-action 'self'; frame-ancestors 'none'"
    )) {
        headers.insert(header::CONTENT_SECURITY_POLICY, csp);
    }
    response
}

/// `POST /dashboard/login`.
pub async fn login(
    sessions: &Sessions,
    throttle: &Throttle,
    policy: &Policy,
    peer: IpAddr,
    request: Request<Incoming>,
) -> Result<Response<Body>, ProxyError> {
    check_same_origin(request.headers(), authority(&request))?;
    let json = is_json(request.headers())?;
    let secure = is_secure(policy, request.headers());
    if !policy.auth.enabled {
        // Nothing to sign in to: the dashboard is open.
        return Ok(answer(json, serde_json::json!({ "auth": "off" })));
    }
    let window = policy.auth.window;
    throttle.check(peer, policy.auth.max_failures, window)?;
    let bytes = read_body(request.into_body(), policy.proxy.body_read_timeout).await?;
    let key = if json {
        serde_json::from_slice::<serde_json::Value>(&bytes)
            .ok()
            .and_then(|value| value.get("key")?.as_str().map(str::to_owned))
    } else {
        form_field(&bytes, "key")
    };
    let key = key.map(|key| key.trim().to_owned()).unwrap_or_default();
    // A key's client (a client keyed by a token or a certificate has no key to sign in with).
    let found = policy
        .client_by_key(&key)
        .filter(|_| !key.is_empty())
        .and_then(|client| Some((client.clone(), client.key_digest?)));
    let (client, digest) = match found {
        Some(found) => found,
        _ => {
            throttle.fail(peer, window);
            tracing::info!(%peer, "dashboard sign-in refused: unknown key");
            return if json {
                Err(ProxyError::UnknownKey)
            } else {
                Ok(login_page("That key was not accepted."))
            };
        }
    };
    Identity::Client(client.clone()).require(Scope::Read)?;
    let opened = sessions.open(digest, SystemTime::now());
    tracing::info!(client = %client.id, "dashboard session opened");
    let mut response = answer(
        json,
        serde_json::json!({
            "client_id": &*client.id,
            "scope": client.scope.as_str(),
            "expires_at": humantime::format_rfc3339_seconds(opened.expires).to_string(),
        }),
    );
    set_cookie(
        &mut response,
        &session::set_cookie(&opened.id, SESSION_TTL, secure),
    );
    Ok(response)
}

/// `POST /dashboard/logout`: ends the cookie's session (if any) and removes the cookie.
pub fn logout(
    sessions: &Sessions,
    policy: &Policy,
    request: &Request<Incoming>,
) -> Result<Response<Body>, ProxyError> {
    check_same_origin(request.headers(), authority(request))?;
    let json = is_json(request.headers())?;
    if let Some(id) = session::from_cookies(request.headers())
        && sessions.close(id)
    {
        tracing::info!("dashboard session closed");
    }
    let mut response = answer(json, serde_json::json!({ "status": "signed out" }));
    set_cookie(
        &mut response,
        &session::clear_cookie(is_secure(policy, request.headers())),
    );
    Ok(response)
}

/// A JSON caller's answer (200, `value`), or the form's: back to the dashboard (303).
fn answer(json: bool, value: serde_json::Value) -> Response<Body> {
    if json {
        return body::json_response(value);
    }
    let mut response = Response::new(body::empty());
    *response.status_mut() = StatusCode::SEE_OTHER;
    response.headers_mut().insert(
        header::LOCATION,
        HeaderValue::from_static(BACK_TO_DASHBOARD),
    );
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

fn set_cookie(response: &mut Response<Body>, value: &str) {
    // Base64url and fixed attributes: always a valid header value.
    if let Ok(value) = HeaderValue::from_str(value) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
}

/// The host the request was sent to: HTTP/2 names it in the URI, HTTP/1 in `Host`.
fn authority<B>(request: &Request<B>) -> Option<&str> {
    request
        .uri()
        .authority()
        .map(http::uri::Authority::as_str)
        .or_else(|| {
            request
                .headers()
                .get(header::HOST)
                .and_then(|host| host.to_str().ok())
        })
}

/// Refuses what a cross-site request looks like. A browser's `Sec-Fetch-Site` (which no
/// page can set) decides when present: `same-origin`, or `none` (typed by the user), else
/// 403. Without it (older browsers) the `Origin` must name the host the request was sent to.
/// `Origin` is not enough alone: the dashboard's pages say `Referrer-Policy: no-referrer`,
/// under which a browser sends `Origin: null` with its own same-origin POSTs. A request with
/// neither header is not from a browser page (a script), which has no ambient cookie to abuse.
pub fn check_same_origin(headers: &HeaderMap, authority: Option<&str>) -> Result<(), ProxyError> {
    if let Some(site) = headers.get("sec-fetch-site") {
        let site = site.to_str().unwrap_or_default();
        return if site.eq_ignore_ascii_case("same-origin") || site.eq_ignore_ascii_case("none") {
            Ok(())
        } else {
            Err(ProxyError::ForeignOrigin)
        };
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let own = origin
            .to_str()
            .ok()
            .and_then(|origin| origin.split_once("://"))
            .is_some_and(|(_, host)| {
                authority.is_some_and(|authority| host.eq_ignore_ascii_case(authority))
            });
        if !own {
            return Err(ProxyError::ForeignOrigin);
        }
    }
    Ok(())
}

/// Whether the body is JSON (else it must be a form); any other type is refused (415).
fn is_json(headers: &HeaderMap) -> Result<bool, ProxyError> {
    let media = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .map(str::trim)
        .unwrap_or_default();
    if media.eq_ignore_ascii_case("application/json") {
        Ok(true)
    } else if media.eq_ignore_ascii_case("application/x-www-form-urlencoded") || media.is_empty() {
        Ok(false)
    } else {
        Err(ProxyError::UnsupportedMediaType)
    }
}

/// Whether the cookie must be `Secure`: TLS on the main listener, or https in front of it (a
/// TLS reverse proxy's `X-Forwarded-Proto`, or the browser's `Origin` when it sends one).
/// Believing either from anyone is safe: `Secure` only narrows where the cookie goes.
fn is_secure(policy: &Policy, headers: &HeaderMap) -> bool {
    let says_https = |name: &str, value: &str| {
        headers
            .get(name)
            .and_then(|header| header.to_str().ok())
            .is_some_and(|header| header.trim().to_ascii_lowercase().starts_with(value))
    };
    policy.proxy.tls.is_some()
        || says_https("x-forwarded-proto", "https")
        || says_https("origin", "https://")
}

async fn read_body(body: Incoming, timeout: Duration) -> Result<bytes::Bytes, ProxyError> {
    let limited = http_body_util::Limited::new(body, MAX_LOGIN_BODY);
    match tokio::time::timeout(timeout, limited.collect()).await {
        Err(_) => Err(ProxyError::BodyTimeout),
        Ok(Err(error)) if error.is::<http_body_util::LengthLimitError>() => {
            Err(ProxyError::BodyTooLarge)
        }
        Ok(Err(_)) => Err(ProxyError::BodyUnreadable),
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
    }
}

/// The value of field `name` in a form body (`application/x-www-form-urlencoded`).
fn form_field(body: &[u8], name: &str) -> Option<String> {
    body.split(|byte| *byte == b'&').find_map(|pair| {
        let (field, value) = match pair.iter().position(|byte| *byte == b'=') {
            Some(at) => (&pair[..at], &pair[at + 1..]),
            None => (pair, &[][..]),
        };
        (decode(field)? == name).then(|| decode(value)).flatten()
    })
}

/// Form decoding: `+` is a space, `%XX` a byte; the result must be UTF-8.
fn decode(text: &[u8]) -> Option<String> {
    let mut out = Vec::with_capacity(text.len());
    let mut bytes = text.iter();
    while let Some(&byte) = bytes.next() {
        match byte {
            b'+' => out.push(b' '),
            b'%' => {
                let high = (*bytes.next()? as char).to_digit(16)?;
                let low = (*bytes.next()? as char).to_digit(16)?;
                out.push(u8::try_from(high * 16 + low).ok()?);
            }
            other => out.push(other),
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn form_fields_are_decoded() {
        assert_eq!(form_field(b"key=sk-abc", "key").as_deref(), Some("sk-abc"));
        assert_eq!(
            form_field(b"a=1&key=sk%2Fa+b%3D&c", "key").as_deref(),
            Some("sk/a b=")
        );
        assert_eq!(form_field(b"keys=1", "key"), None);
        assert_eq!(form_field(b"key=%zz", "key"), None);
        assert_eq!(form_field(b"key", "key").as_deref(), Some(""));
    }

    #[test]
    fn only_the_pages_own_origin_may_post() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut map = HeaderMap::new();
            for (name, value) in pairs {
                map.insert(*name, HeaderValue::from_static(value));
            }
            map
        };
        let here = Some("127.0.0.1:11435");
        assert!(check_same_origin(&headers(&[]), here).is_ok(), "a script");
        assert!(
            check_same_origin(
                &headers(&[
                    ("origin", "http://127.0.0.1:11435"),
                    ("sec-fetch-site", "same-origin")
                ]),
                here
            )
            .is_ok()
        );
        assert!(check_same_origin(&headers(&[("origin", "http://127.0.0.1:11435")]), here).is_ok());
        // Under no-referrer a browser's own POST says `Origin: null`: its Sec-Fetch-Site decides.
        assert!(
            check_same_origin(
                &headers(&[("origin", "null"), ("sec-fetch-site", "same-origin")]),
                here
            )
            .is_ok()
        );
        for refused in [
            headers(&[("origin", "http://evil.example")]),
            headers(&[("origin", "null")]),
            headers(&[("sec-fetch-site", "cross-site")]),
            headers(&[("sec-fetch-site", "same-site")]),
            headers(&[
                ("origin", "http://127.0.0.1:11435"),
                ("sec-fetch-site", "cross-site"),
            ]),
            headers(&[("origin", "http://127.0.0.1:11436")]),
        ] {
            assert!(
                matches!(
                    check_same_origin(&refused, here),
                    Err(ProxyError::ForeignOrigin)
                ),
                "{refused:?}"
            );
        }
    }

    #[test]
    fn the_login_page_has_a_form_and_no_script() {
        let page = login_page("That key was not accepted.");
        assert_eq!(page.status(), StatusCode::UNAUTHORIZED);
        let csp = page.headers()[header::CONTENT_SECURITY_POLICY]
            .to_str()
            .unwrap()
            .to_owned();
        assert!(csp.contains("form-action 'self'") && !csp.contains("script-src"));
        assert!(!LOGIN_PAGE.contains("<script"));
        assert!(LOGIN_PAGE.contains("type=\"password\""));
        assert!(LOGIN_PAGE.contains("autocomplete=\"off\""));
        assert!(LOGIN_PAGE.contains("action=\"dashboard/login\""));
    }
}
