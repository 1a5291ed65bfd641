//! The HTTP queue-control endpoints (`POST /queue/pause|resume|drain|flush`).
//!
//! They act through the control plane, so that every data plane agrees: the
//! pause or flush becomes part of the next snapshot, which every node
//! applies. The caller's own key is presented to the control plane, which
//! makes the authorisation decision again. When the control plane is
//! unreachable the endpoints answer 503 and change nothing.
//!
//! A browser lets any page send a "simple" cross-site POST (no preflight:
//! form types or `text/plain`, with the user's network position and, for
//! the dashboard's origin, nothing else needed when auth is off).
//! [`check_origin_and_body`] refuses what such a request looks like: a
//! foreign `Origin` (403), and a body that is not JSON (415).

use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use oqp_proto::admin::v1 as api;
use oqp_proto::policy::v1 as wire;

use crate::body::{Body, json_response};
use crate::control::AdminClient;
use crate::dispatch::Dispatcher;
use crate::error::ProxyError;
use crate::policy::Scope;
use crate::scheduler::Tier;

/// Longest wait for the control plane to answer a tier operation.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for this node to apply the snapshot that carries a flush.
const APPLY_TIMEOUT: Duration = Duration::from_secs(3);

/// Handles one queue-control request through the control plane's `admin`
/// API; the caller's scope was checked. A flush waits for this node's
/// `dispatcher` to apply the snapshot that carries it.
pub async fn handle(
    admin: &AdminClient,
    dispatcher: &Dispatcher,
    request: &Request<Incoming>,
) -> Result<Response<Body>, ProxyError> {
    let action = request
        .uri()
        .path()
        .trim_start_matches("/queue/")
        .to_owned();
    let tier = if action == "drain" {
        None
    } else {
        tier_param(request.uri().query())?
    };
    let tier_name = tier.map_or("all", Tier::as_str).to_owned();
    let wire_tier = tier.map_or(wire::Tier::Unspecified, crate::policy::tier_to_wire) as i32;
    let authorization = request.headers().get(http::header::AUTHORIZATION);
    let call = |message| with_key(message, authorization, Some(CALL_TIMEOUT));
    let mut admin = admin.clone();
    let body = match action.as_str() {
        "pause" | "resume" => {
            let request = call(api::TierRequest { tier: wire_tier });
            let response = if action == "pause" {
                admin.pause_tier(request).await
            } else {
                admin.resume_tier(request).await
            };
            let response = response.map_err(refusal)?.into_inner();
            serde_json::json!({ "status": response.status, "tier": tier_name })
        }
        "flush" => {
            let before = dispatcher.flushed_total();
            let response = admin
                .flush_tier(call(api::TierRequest { tier: wire_tier }))
                .await
                .map_err(refusal)?
                .into_inner();
            wait_for_version(dispatcher, response.snapshot_version).await;
            let dropped = dispatcher.flushed_total().saturating_sub(before);
            serde_json::json!({ "status": "flushed", "tier": tier_name, "dropped": dropped })
        }
        _ => {
            let mut stream = admin
                .drain(with_key(
                    api::DrainRequest { timeout_ms: 0 },
                    authorization,
                    None,
                ))
                .await
                .map_err(refusal)?
                .into_inner();
            let mut drained = false;
            while let Some(progress) = stream.message().await.map_err(refusal)? {
                drained = progress.drained;
            }
            if !drained {
                return Err(ProxyError::ControlPlaneUnavailable(
                    "the queues did not drain before the timeout".into(),
                ));
            }
            serde_json::json!({ "status": "drained" })
        }
    };
    Ok(json_response(body))
}

/// Refuses a call from a page of another origin (an `Origin` whose host and
/// port are not `authority`, the `Host` the request was sent to) and one
/// with a body that is not `application/json`: no `Content-Type` is fine
/// only without a body.
///
/// A page that rebinds its own DNS name to the proxy's address is of the
/// proxy's origin as far as the browser knows (`Origin` and `Host` both name
/// it), so a browser's call (one with an `Origin`) is accepted only when
/// that authority is one no DNS answer can change: an IP address or
/// `localhost`.
pub fn check_origin_and_body(
    headers: &http::HeaderMap,
    authority: Option<&str>,
) -> Result<(), ProxyError> {
    if let Some(origin) = headers.get(http::header::ORIGIN) {
        let own = origin
            .to_str()
            .ok()
            .and_then(|origin| origin.split_once("://"))
            .is_some_and(|(_, host)| {
                authority.is_some_and(|authority| {
                    host.eq_ignore_ascii_case(authority) && not_rebindable(authority)
                })
            });
        if !own {
            return Err(ProxyError::ForeignOrigin);
        }
    }
    match headers.get(http::header::CONTENT_TYPE) {
        Some(value) => {
            let media = value
                .to_str()
                .unwrap_or_default()
                .split(';')
                .next()
                .unwrap_or_default()
                .trim();
            if !media.eq_ignore_ascii_case("application/json") {
                return Err(ProxyError::UnsupportedMediaType);
            }
        }
        None => {
            let length = headers
                .get(http::header::CONTENT_LENGTH)
                .and_then(|value| value.to_str().ok());
            let bodiless = length.is_none_or(|length| length.trim() == "0")
                && !headers.contains_key(http::header::TRANSFER_ENCODING);
            if !bodiless {
                return Err(ProxyError::UnsupportedMediaType);
            }
        }
    }
    Ok(())
}

/// Whether the host of `authority` (`host[:port]`) is an IP literal or
/// `localhost`, which a DNS rebinding cannot point elsewhere.
fn not_rebindable(authority: &str) -> bool {
    let host = match authority.strip_prefix('[') {
        Some(bracketed) => {
            return bracketed
                .split_once(']')
                .is_some_and(|(ip, _)| ip.parse::<std::net::Ipv6Addr>().is_ok());
        }
        None => authority
            .rsplit_once(':')
            .map_or(authority, |(host, _)| host),
    };
    host.parse::<std::net::Ipv4Addr>().is_ok() || host.eq_ignore_ascii_case("localhost")
}

/// An admin call carrying the caller's `Authorization`.
fn with_key<T>(
    message: T,
    authorization: Option<&http::HeaderValue>,
    timeout: Option<Duration>,
) -> tonic::Request<T> {
    let mut call = tonic::Request::new(message);
    if let Some(timeout) = timeout {
        call.set_timeout(timeout);
    }
    if let Some(value) = authorization.and_then(|v| v.to_str().ok())
        && let Ok(value) = value.parse()
    {
        call.metadata_mut().insert("authorization", value);
    }
    call
}

/// `?tier=` as a tier; absent means all tiers.
fn tier_param(query: Option<&str>) -> Result<Option<Tier>, ProxyError> {
    let Some(value) = query
        .unwrap_or_default()
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(name, _)| *name == "tier")
        .map(|(_, value)| value)
    else {
        return Ok(None);
    };
    Tier::ALL
        .into_iter()
        .find(|tier| value.eq_ignore_ascii_case(tier.as_str()))
        .map(Some)
        .ok_or_else(|| ProxyError::InvalidTier(value.to_owned()))
}

fn refusal(status: tonic::Status) -> ProxyError {
    match status.code() {
        tonic::Code::PermissionDenied => ProxyError::ScopeRequired(Scope::Management),
        tonic::Code::Unauthenticated => ProxyError::UnknownKey,
        _ => ProxyError::ControlPlaneUnavailable(status.message().to_owned()),
    }
}

/// Waits until this node's queues obey `version`, at most [`APPLY_TIMEOUT`].
async fn wait_for_version(dispatcher: &Dispatcher, version: u64) {
    let _ = tokio::time::timeout(APPLY_TIMEOUT, dispatcher.applied(version)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(pairs: &[(&'static str, &'static str)]) -> Result<(), ProxyError> {
        let mut headers = http::HeaderMap::new();
        for (name, value) in pairs {
            headers.insert(*name, http::HeaderValue::from_static(value));
        }
        check_origin_and_body(&headers, Some("192.168.1.5:11434"))
    }

    #[test]
    fn cross_site_shapes_are_refused() {
        assert_eq!(check(&[]), Ok(()));
        assert_eq!(check(&[("content-length", "0")]), Ok(()));
        assert_eq!(check(&[("origin", "http://192.168.1.5:11434")]), Ok(()));
        assert_eq!(check(&[("origin", "https://192.168.1.5:11434")]), Ok(()));
        assert_eq!(
            check(&[("content-type", "application/json; charset=utf-8")]),
            Ok(())
        );
        for origin in [
            "http://evil.example",
            "null",
            "http://192.168.1.5:8080",
            "192.168.1.5:11434",
        ] {
            let mut headers = http::HeaderMap::new();
            headers.insert("origin", origin.parse().unwrap());
            assert_eq!(
                check_origin_and_body(&headers, Some("192.168.1.5:11434")),
                Err(ProxyError::ForeignOrigin),
                "{origin}"
            );
        }
        let mut headers = http::HeaderMap::new();
        headers.insert("origin", "http://192.168.1.5:11434".parse().unwrap());
        assert_eq!(
            check_origin_and_body(&headers, None),
            Err(ProxyError::ForeignOrigin)
        );
        // DNS rebinding: a page at a name that now resolves to the proxy is
        // same-origin to the browser, Origin and Host alike.
        for (origin, authority, allowed) in [
            ("http://evil.example:11434", "evil.example:11434", false),
            ("http://proxy.lan:11434", "proxy.lan:11434", false),
            ("http://localhost:11434", "localhost:11434", true),
            ("http://127.0.0.1:11434", "127.0.0.1:11434", true),
            ("http://[::1]:11434", "[::1]:11434", true),
            ("http://[fd00::5]", "[fd00::5]", true),
        ] {
            let mut headers = http::HeaderMap::new();
            headers.insert("origin", origin.parse().unwrap());
            let result = check_origin_and_body(&headers, Some(authority));
            assert_eq!(
                result.is_ok(),
                allowed,
                "{origin} to {authority}: {result:?}"
            );
        }
        // Without an Origin (curl, oqpctl, scripts) the Host is not judged.
        assert_eq!(
            check_origin_and_body(&http::HeaderMap::new(), Some("proxy.lan:11434")),
            Ok(())
        );
        for content_type in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/jsonp",
        ] {
            let mut headers = http::HeaderMap::new();
            headers.insert("content-type", content_type.parse().unwrap());
            assert_eq!(
                check_origin_and_body(&headers, Some("192.168.1.5:11434")),
                Err(ProxyError::UnsupportedMediaType),
                "{content_type}"
            );
        }
        assert_eq!(
            check(&[("content-length", "5")]),
            Err(ProxyError::UnsupportedMediaType)
        );
        assert_eq!(
            check(&[("transfer-encoding", "chunked")]),
            Err(ProxyError::UnsupportedMediaType)
        );
    }

    #[test]
    fn tier_parameter() {
        assert_eq!(tier_param(None).unwrap(), None);
        assert_eq!(tier_param(Some("tier=LOW")).unwrap(), Some(Tier::Low));
        assert_eq!(tier_param(Some("x=1&tier=high")).unwrap(), Some(Tier::High));
        assert_eq!(
            tier_param(Some("tier=bogus")).unwrap_err(),
            ProxyError::InvalidTier("bogus".into())
        );
    }
}
