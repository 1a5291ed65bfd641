//! Header hygiene between client and upstream: hop-by-hop headers never
//! cross, oqp's own request headers never reach Ollama, and the upstream gets
//! its own `Host`.

use http::header::{self, HeaderMap, HeaderName};

/// `X-Queue-Priority`: the tier a client asks for.
pub const QUEUE_PRIORITY: HeaderName = HeaderName::from_static("x-queue-priority");
/// `X-Client-ID`: the client's identity (request) and the resolved one (upstream).
pub const CLIENT_ID: HeaderName = HeaderName::from_static("x-client-id");
/// `X-Queue-Wait-Time`: milliseconds from admission to dispatch.
pub const QUEUE_WAIT_TIME: HeaderName = HeaderName::from_static("x-queue-wait-time");
/// `X-Queue-Position`: position at admission, when the request had to wait.
pub const QUEUE_POSITION: HeaderName = HeaderName::from_static("x-queue-position");
/// `X-OQP-Affinity`: how the conversation's prompt cache placed the request (`hit`, `miss`,
/// `spill`, `new`).
pub const AFFINITY: HeaderName = HeaderName::from_static("x-oqp-affinity");
/// `X-Failover-Host`: the host that answered.
pub const FAILOVER_HOST: HeaderName = HeaderName::from_static("x-failover-host");
/// `X-Failover-Exhausted`: no host could answer.
pub const FAILOVER_EXHAUSTED: HeaderName = HeaderName::from_static("x-failover-exhausted");
/// `X-Cache`: HIT, PARTIAL or MISS on embedding endpoints.
pub const CACHE: HeaderName = HeaderName::from_static("x-cache");
/// `X-Model-Fallback`: the model that answered instead of the one asked for.
pub const MODEL_FALLBACK: HeaderName = HeaderName::from_static("x-model-fallback");
/// `X-Request-ID`.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// The identity a peer data plane asserts for a request it forwards (see `hop`).
pub const HOP: HeaderName = HeaderName::from_static("x-oqp-hop");
/// On an owner's answer to a hop: a refusal another GPU box may not give.
pub const HOP_REFUSED: HeaderName = HeaderName::from_static("x-oqp-hop-refused");
/// On an owner's answer to a hop: microseconds from its arrival to the answer's head.
pub const HOP_ELAPSED: HeaderName = HeaderName::from_static("x-oqp-hop-elapsed-us");
/// The client address chain a reverse proxy appends to (believed only from `auth.trusted_proxies`).
pub const FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// `x-api-key`: Anthropic's way of sending a key (`ANTHROPIC_API_KEY`), read like a bearer key.
pub const API_KEY: HeaderName = HeaderName::from_static("x-api-key");

/// A client's own headers that never reach an upstream: every way the SDKs send a key
/// (`Authorization` is removed beside them), the client's cookies, and the client address
/// chain (which only oqp reads, for the throttle and logs). Ollama ignores all of them; a
/// cloud upstream must see oqp's key alone. (Matched by name in `stays_before_upstream`.)
#[cfg(test)]
const CLIENT_ONLY: [HeaderName; 7] = [
    API_KEY,
    HeaderName::from_static("api-key"),
    HeaderName::from_static("x-goog-api-key"),
    header::COOKIE,
    FORWARDED_FOR,
    header::FORWARDED,
    HeaderName::from_static("x-real-ip"),
];

/// Headers that describe one connection and never cross a proxy (RFC 9110
/// §7.6.1), plus the non-standard ones clients still send. (Matched by name in
/// `is_hop_by_hop`.)
#[cfg(test)]
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

/// Whether `name` is hop-by-hop (RFC 9110 §7.6.1, and the non-standard ones clients still
/// send) or `Transfer-Encoding`, which is hyper's:
/// it owns framing.
fn is_hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "upgrade"
            | "transfer-encoding"
    )
}

/// oqp's own hop headers, which only a data plane sets.
fn is_internal(name: &str) -> bool {
    matches!(
        name,
        "x-oqp-hop" | "x-oqp-hop-refused" | "x-oqp-hop-elapsed-us"
    )
}

/// Whether `name` never reaches an upstream: hop-by-hop, the client's own `Host`, its
/// credentials and the other ways SDKs send a key, its cookies and its address chain, oqp's request headers and its hop headers.
fn stays_before_upstream(name: &str) -> bool {
    is_hop_by_hop(name)
        || is_internal(name)
        || matches!(
            name,
            "host"
                | "authorization"
                | "x-api-key"
                | "api-key"
                | "x-goog-api-key"
                | "cookie"
                | "x-forwarded-for"
                | "forwarded"
                | "x-real-ip"
                | "x-queue-priority"
                | "x-client-id"
        )
}

/// Removes every header `unwanted` names and every header a `Connection` header names: the
/// names there are looked at once (most are kept), not a removal tried for every name that
/// may be there; the names a `Connection` header lists are removed one by one, as many as
/// it lists, each a hashed removal.
fn remove_where(headers: &mut HeaderMap, unwanted: fn(&str) -> bool) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    let doomed: Vec<HeaderName> = headers
        .keys()
        .filter(|name| unwanted(name.as_str()))
        .cloned()
        .collect();
    for name in doomed.iter().chain(&named) {
        headers.remove(name);
    }
}

/// Removes hop-by-hop headers, including every header the `Connection`
/// header names. `Transfer-Encoding` is left to hyper, which owns framing.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    remove_where(headers, is_hop_by_hop);
}

/// Prepares an upstream answer's headers for the client: hop-by-hop headers removed, and
/// oqp's own hop headers, which only a data plane may set (an upstream's
/// `x-oqp-hop-refused` would make an edge send the request to another box again).
pub fn from_upstream(headers: &mut HeaderMap) {
    remove_where(headers, |name| is_hop_by_hop(name) || is_internal(name));
}

/// Prepares a client's request headers for the upstream: hop-by-hop and
/// oqp's own headers removed, the client's credentials dropped, the resolved
/// client id set.
pub fn for_upstream(headers: &mut HeaderMap, client_id: Option<&str>) {
    remove_where(headers, stays_before_upstream);
    if let Some(id) = client_id.and_then(|id| http::HeaderValue::from_str(id).ok()) {
        headers.insert(CLIENT_ID, id);
    }
}

/// The prefix of the headers Open WebUI forwards about its user and chat
/// (`ENABLE_FORWARD_USER_INFO_HEADERS`): names, e-mail addresses, roles, ids.
pub const OPEN_WEBUI_PREFIX: &str = "x-openwebui-";

/// Removes what apps say about their end users from a request on its way upstream: the
/// headers app keys are configured to name users and sessions in (`names`), and Open WebUI's
/// whole `X-OpenWebUI-*` family. oqp reads them; Ollama needs none of them.
pub fn strip_delegation(headers: &mut HeaderMap, names: &[http::HeaderName]) {
    for name in names {
        headers.remove(name);
    }
    let family: Vec<http::HeaderName> = headers
        .keys()
        .filter(|name| name.as_str().starts_with(OPEN_WEBUI_PREFIX))
        .cloned()
        .collect();
    for name in family {
        headers.remove(name);
    }
}

/// Longest end-user id an app may name.
pub const MAX_USER_BYTES: usize = 128;

/// Whether `user` is an end-user id: 1–128 bytes of printable ASCII, without `/` or spaces.
pub fn is_user_id(user: &str) -> bool {
    (1..=MAX_USER_BYTES).contains(&user.len())
        && user
            .bytes()
            .all(|byte| byte.is_ascii_graphic() && byte != b'/')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_apps_say_about_their_users_stays_here() {
        let mut headers = HeaderMap::new();
        headers.insert("x-openwebui-user-email", "a@example.org".parse().unwrap());
        headers.insert("x-openwebui-chat-id", "c1".parse().unwrap());
        headers.insert("x-app-user", "u1".parse().unwrap());
        headers.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        strip_delegation(&mut headers, &[http::HeaderName::from_static("x-app-user")]);
        assert_eq!(headers.len(), 1);
        assert!(headers.contains_key(header::CONTENT_TYPE));
    }

    #[test]
    fn strips_hop_by_hop_and_connection_named_headers() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONNECTION, "close, x-secret-hop".parse().unwrap());
        headers.insert("x-secret-hop", "1".parse().unwrap());
        headers.insert("keep-alive", "timeout=5".parse().unwrap());
        headers.insert(header::TE, "trailers".parse().unwrap());
        headers.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers.len(), 1);
        assert!(headers.contains_key(header::CONTENT_TYPE));
    }

    #[test]
    fn each_pass_removes_exactly_its_names() {
        let (hop_by_hop, client_only) = (HOP_BY_HOP, CLIENT_ONLY);
        let internal = [HOP, HOP_REFUSED, HOP_ELAPSED];
        let own = [
            header::HOST,
            header::AUTHORIZATION,
            QUEUE_PRIORITY,
            CLIENT_ID,
        ];
        let kept = [
            header::CONTENT_TYPE,
            header::CONTENT_LENGTH,
            header::ACCEPT,
            header::USER_AGENT,
            REQUEST_ID,
            HeaderName::from_static("x-custom"),
        ];
        let hop = hop_by_hop
            .iter()
            .chain([&header::TRANSFER_ENCODING])
            .cloned();
        for name in hop.clone() {
            assert!(is_hop_by_hop(name.as_str()), "{name}");
        }
        for name in internal.iter().chain(&own).chain(&client_only) {
            assert!(!is_hop_by_hop(name.as_str()), "{name}");
        }
        let everything: Vec<HeaderName> = hop
            .chain(internal.clone())
            .chain(own.clone())
            .chain(client_only.clone())
            .chain(kept.clone())
            .collect();
        let full = || {
            let mut headers = HeaderMap::new();
            for name in &everything {
                headers.append(name.clone(), "1".parse().unwrap());
                headers.append(name.clone(), "2".parse().unwrap());
            }
            headers
        };
        let mut request = full();
        for_upstream(&mut request, None);
        let mut left: Vec<&str> = request.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        let mut wanted: Vec<&str> = kept.iter().map(HeaderName::as_str).collect();
        wanted.sort_unstable();
        assert_eq!(left, wanted);
        assert_eq!(request.len(), 2 * kept.len());
        let mut answer = full();
        from_upstream(&mut answer);
        let mut left: Vec<&str> = answer.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        let mut wanted: Vec<&str> = kept
            .iter()
            .chain(&own)
            .chain(&client_only)
            .map(HeaderName::as_str)
            .collect();
        wanted.sort_unstable();
        assert_eq!(left, wanted);
    }

    #[test]
    fn a_header_named_by_connection_goes_wherever_it_comes() {
        let mut headers = HeaderMap::new();
        headers.insert("x-before", "1".parse().unwrap());
        headers.append(header::CONNECTION, "x-before".parse().unwrap());
        headers.append(header::CONNECTION, " X-After ,keep-alive".parse().unwrap());
        headers.insert("x-after", "1".parse().unwrap());
        headers.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        for_upstream(&mut headers, Some("c"));
        let mut left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["content-type", "x-client-id"]);
    }

    #[test]
    fn upstream_never_sees_credentials_or_priority() {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, "Bearer secret".parse().unwrap());
        headers.insert(API_KEY, "secret".parse().unwrap());
        headers.insert("api-key", "secret".parse().unwrap());
        headers.insert(header::COOKIE, "session=secret".parse().unwrap());
        headers.insert(FORWARDED_FOR, "10.0.0.1".parse().unwrap());
        headers.insert(QUEUE_PRIORITY, "high".parse().unwrap());
        headers.insert(CLIENT_ID, "spoofed".parse().unwrap());
        headers.insert(header::HOST, "proxy:11435".parse().unwrap());
        for_upstream(&mut headers, Some("batch"));
        assert!(headers.get(header::AUTHORIZATION).is_none());
        for name in CLIENT_ONLY {
            assert!(headers.get(&name).is_none(), "{name}");
        }
        assert!(headers.get(QUEUE_PRIORITY).is_none());
        assert!(headers.get(header::HOST).is_none());
        assert_eq!(headers.get(CLIENT_ID).unwrap(), "batch");
    }
}
