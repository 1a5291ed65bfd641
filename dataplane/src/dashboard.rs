//! `GET /dashboard`: one self-contained, read-only HTML page (inline CSS and
//! JS, no CDN, no build step) that polls `queue/summary` and `queue/status`.
//!
//! The page is [`PAGE`] with two values written in: the refresh interval and
//! a per-response CSP nonce. The policy allows the page's own `<style>` and
//! `<script>` blocks (by nonce) and same-origin fetches, and nothing else: no
//! `unsafe-inline`, so injected markup could not run even if the page's own
//! escaping failed (it renders with `textContent` only). The chart is SVG
//! built by the script with presentation attributes and classes, never
//! `style=` attributes, which `style-src` would refuse.
//!
//! The route is checked by [`crate::service`]: disabled → 404 before any
//! authentication, so a turned-off feature does not advertise itself.
//!
//! With auth on, a browser signs in once ([`login`]): without a key or a session
//! `/dashboard` answers 401 with the login form as its body, and the form's key
//! is exchanged for a session cookie ([`session`]) that the page's polls carry.
//! [`usage`] is the page's usage view (`/dashboard/usage`): GPU time and tokens
//! per client and app user today, with budget bars, as the key's scope allows.

use base64::Engine;
use http::{HeaderValue, Response, header};

use crate::body::{self, Body};
use crate::policy::Policy;

/// The page, with `{{NONCE}}` and `{{REFRESH_MS}}` to fill in.
pub const PAGE: &str = include_str!("dashboard.html");

pub mod login;
pub mod session;
pub mod usage;

/// The `/dashboard` response for `policy` (which has it enabled).
pub fn response(policy: &Policy) -> Response<Body> {
    let nonce = nonce();
    let refresh_ms = u64::try_from(policy.dashboard.refresh.as_millis()).unwrap_or(u64::MAX);
    let mut response = Response::new(body::full(render(&nonce, refresh_ms)));
    let headers = response.headers_mut();
    page_headers(headers);
    // The nonce is URL-safe base64: always a valid header value.
    if let Ok(csp) = HeaderValue::from_str(&content_security_policy(&nonce)) {
        headers.insert(header::CONTENT_SECURITY_POLICY, csp);
    }
    response
}

/// The headers every page of the dashboard carries, its CSP aside.
fn page_headers(headers: &mut http::HeaderMap) {
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
}

/// The page with its nonce and refresh interval.
pub fn render(nonce: &str, refresh_ms: u64) -> String {
    PAGE.replace("{{NONCE}}", nonce)
        .replace("{{REFRESH_MS}}", &refresh_ms.to_string())
}

/// The `Content-Security-Policy` of a response with `nonce`.
pub fn content_security_policy(nonce: &str) -> String {
    format!(
        "default-src 'none'; style-src 'nonce-{nonce}'; script-src 'nonce-{nonce}'; \
         connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
}

/// 16 random bytes, URL-safe base64: a new one for every response.
fn nonce() -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(rand::random::<[u8; 16]>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonces_are_fresh_and_header_safe() {
        let (a, b) = (nonce(), nonce());
        assert_ne!(a, b);
        assert_eq!(a.len(), 22, "16 bytes without padding");
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        );
    }

    #[test]
    fn the_page_has_exactly_two_nonced_blocks_and_no_other_code() {
        let page = render("N0NCE", 5000);
        assert_eq!(page.matches("nonce=\"N0NCE\"").count(), 2);
        assert_eq!(page.matches("<script").count(), 1);
        assert_eq!(page.matches("<style").count(), 1);
        assert!(page.contains("var REFRESH_MS = 5000;"));
        assert!(!page.contains("{{"), "every placeholder is filled");
        for forbidden in [
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "eval(",
            " style=\"",
            " onclick",
            " onload",
            "https://",
            "src=\"",
            "href=\"",
        ] {
            assert!(!page.contains(forbidden), "the page contains {forbidden}");
        }
        // The one absolute URL is the SVG namespace, which is never fetched.
        assert_eq!(page.matches("http://").count(), 1);
        assert!(page.contains("\"http://www.w3.org/2000/svg\""));
        // Polls are relative and carry same-origin credentials.
        assert!(page.contains("fetchJson(\"queue/summary\")"));
        assert!(page.contains("fetchJson(\"queue/status\")"));
        assert!(page.contains("fetchJson(\"dashboard/usage\")"));
        assert!(page.contains("fetch(\"dashboard/logout\""));
        assert!(page.contains("credentials: \"same-origin\""));
        assert!(page.contains("document.hidden"));
    }
}
