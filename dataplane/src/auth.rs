//! Who is calling, and what they may do.
//!
//! The main port authenticates `Authorization: Bearer <key>` by the SHA-256
//! digest of the key (the data plane holds no key in clear); an injection
//! port names its client by configuration. Everything the proxy decides for
//! a request (tier ceiling, scope, cap, identity in stats and upstream)
//! follows from the [`Identity`] found here, never from what the client
//! claims. Failed attempts are throttled per client address ([`Throttle`]);
//! behind a trusted reverse proxy that address comes from `X-Forwarded-For`
//! ([`client_addr`]). A user's signed token (a JWT) is a credential too, for the clients
//! configured with `jwt:` ([`jwt`]): verified against its issuer's public keys, it names the
//! sub-client `<client_id>/<user>`.

pub use crate::jwt;
mod throttle;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use http::HeaderMap;

use crate::error::ProxyError;
use crate::headers;
use crate::policy::{Cidr, Client, Policy, Scope, UserSource, canonical};
use crate::scheduler::{ClientLimits, Member, Tier};
use crate::view::BodyView;

/// The caller of one request.
#[derive(Debug, Clone)]
pub enum Identity {
    /// A known client: by key on the main port, by configuration on an
    /// injection port.
    Client(Arc<Client>),
    /// One end user of an app key (`auth.keys[].users`): the sub-client
    /// `<client_id>/<user>`, with the key's scope and ceiling.
    User {
        /// The app's key.
        app: Arc<Client>,
        /// `<client_id>/<user>`.
        id: Arc<str>,
        /// The ceiling and models its token's claims chose (`jwt.claims_to_policy`), in
        /// place of the key's.
        policy: Option<Arc<crate::policy::ClaimPolicy>>,
    },
    /// Auth is off: whoever the `X-Client-ID` header says, unverified.
    Anonymous(Option<Arc<str>>),
}

impl Identity {
    /// The caller as the queue knows it: its id, and whether it was identified (a key or an
    /// injection port) rather than claimed in `X-Client-ID` with auth off.
    pub fn caller(&self) -> Caller {
        let sets_keep_alive = self.sets_keep_alive();
        match self {
            Identity::Client(client) => Caller {
                id: client.id.clone(),
                verified: true,
                sets_keep_alive,
                // An app's own requests share the app's group with its users.
                member: client.users.as_ref().map(|_| Member {
                    app: client.id.clone(),
                    limits: ClientLimits::default(),
                }),
                claims: None,
            },
            Identity::User { app, id, policy } => Caller {
                id: id.clone(),
                verified: true,
                sets_keep_alive,
                member: app.users.as_ref().map(|users| Member {
                    app: app.id.clone(),
                    limits: ClientLimits {
                        max_concurrent: users.max_concurrent,
                        max_queued: users.max_queued,
                        weight: 1.0,
                    },
                }),
                claims: policy.clone(),
            },
            Identity::Anonymous(id) => Caller {
                id: id.clone().unwrap_or_else(|| Arc::from(ANONYMOUS)),
                verified: false,
                sets_keep_alive,
                member: None,
                claims: None,
            },
        }
    }

    /// The client id used for stats, caps and the upstream `X-Client-ID`.
    pub fn client_id(&self) -> Option<&Arc<str>> {
        match self {
            Identity::Client(client) => Some(&client.id),
            Identity::User { id, .. } => Some(id),
            Identity::Anonymous(id) => id.as_ref(),
        }
    }

    /// The key's client (the app's, for one of its users); `None` with auth off.
    pub fn key(&self) -> Option<&Arc<Client>> {
        match self {
            Identity::Client(client) | Identity::User { app: client, .. } => Some(client),
            Identity::Anonymous(_) => None,
        }
    }

    /// Checks that the caller may do what needs `scope`. Anonymous callers
    /// (auth off) may do everything.
    pub fn require(&self, scope: Scope) -> Result<(), ProxyError> {
        match self.key() {
            Some(client) if client.scope < scope => Err(ProxyError::ScopeRequired(scope)),
            _ => Ok(()),
        }
    }

    /// Whose usage the caller may see: `None` for everyone's (a `management` key, or auth
    /// off), else its key's client id (its app's users included).
    pub fn usage_scope(&self) -> Option<&str> {
        match self.key() {
            Some(client) if client.scope < Scope::Management => Some(&client.id),
            _ => None,
        }
    }

    /// Whether the caller may keep its own `keep_alive` while oqp decides residency
    /// ([`KeepAlive::for_caller`](crate::policy::KeepAlive::for_caller)): a `management` key,
    /// or anyone with auth off.
    pub fn sets_keep_alive(&self) -> bool {
        self.require(Scope::Management).is_ok()
    }

    /// Checks that the caller's key may use `model` (`auth.keys[].models`).
    pub fn allow_model(&self, model: &str) -> Result<(), ProxyError> {
        match self.models() {
            Some(models) if !models.allows(model) => {
                Err(ProxyError::ModelNotAllowed(model.to_owned()))
            }
            _ => Ok(()),
        }
    }

    /// Whether the caller's key may use `model`; with no allowlist, every model.
    pub fn may_use(&self, model: &str) -> bool {
        self.allow_model(model).is_ok()
    }

    /// Whether the caller's key limits its models (listings are then filtered).
    pub fn has_allowlist(&self) -> bool {
        self.models().is_some()
    }

    /// The caller's model allowlist: its claims' (a token user's), else its key's.
    fn models(&self) -> Option<&crate::policy::ModelAllowlist> {
        if let Some(models) = self
            .claim_policy()
            .and_then(|policy| policy.models.as_ref())
        {
            return Some(models);
        }
        self.key().and_then(|client| client.models.as_ref())
    }

    /// What a token user's claims chose, if anything.
    fn claim_policy(&self) -> Option<&crate::policy::ClaimPolicy> {
        match self {
            Identity::User { policy, .. } => policy.as_deref(),
            _ => None,
        }
    }

    /// The tier for a request that asked for `requested` (`X-Queue-Priority`):
    /// capped by the client's ceiling, silently.
    pub fn tier(&self, requested: Option<Tier>) -> Tier {
        let ceiling = self.claim_policy().and_then(|policy| policy.max_priority);
        match (self.key(), ceiling) {
            // `Tier` orders High < Normal < Low: the ceiling is the larger.
            (Some(client), Some(ceiling)) => {
                requested.unwrap_or(client.default_priority).max(ceiling)
            }
            (Some(client), None) => client.tier_for(requested),
            (None, _) => requested.unwrap_or(Tier::Normal),
        }
    }

    /// The end user an app key's request names (`auth.keys[].users`): its header, or its
    /// body field when the body is read (`body`, with its reading), matched as Ollama
    /// matches field names. The app itself when it names none; a value that is not a user id
    /// is refused. Other identities are returned as they are.
    /// A user's token that fails is refused; one that names a key the snapshot lacks asks
    /// for the issuer's keys again (`refresh`).
    pub fn delegated(
        self,
        headers: &HeaderMap,
        body: Option<(&[u8], &BodyView)>,
        refresh: &KeyRefresh,
    ) -> Result<Self, ProxyError> {
        let Identity::Client(client) = &self else {
            return Ok(self);
        };
        let Some(users) = &client.users else {
            return Ok(self);
        };
        let invalid = || ProxyError::InvalidUser(users.named.clone());
        let mut policy = None;
        let user: Option<String> = match &users.source {
            UserSource::Header(name) => match headers.get(name) {
                None => None,
                Some(value) => Some(value.to_str().map_err(|_| invalid())?.to_owned()),
            },
            UserSource::BodyField(path) => match body {
                None => None,
                Some((body, view)) => view.string_at(body, path).map_err(|_| invalid())?,
            },
            UserSource::Jwt(verifier) => match verifier.token(headers) {
                None => None,
                Some(token) => {
                    let verified = verifier.verify_user(token).map_err(|error| {
                        if error.wants_keys() {
                            refresh.want(&client.id);
                        }
                        ProxyError::InvalidToken(error)
                    })?;
                    policy = users
                        .claims_to_policy
                        .as_ref()
                        .and_then(|claims| claims.select(&verified.values));
                    Some(verified.user)
                }
            },
        };
        let Some(user) = user else {
            return Ok(self);
        };
        if !is_user_id(&user) {
            return Err(invalid());
        }
        let id: Arc<str> = Arc::from(format!("{}/{user}", client.id));
        let app = client.clone();
        Ok(Identity::User { app, id, policy })
    }
}

pub use crate::headers::MAX_USER_BYTES;
use crate::headers::is_user_id;

/// Longest claimed `X-Client-ID` (auth off) kept; longer ones are cut here, so
/// that every list and label holding client ids stays small.
pub const MAX_CLIENT_ID_BYTES: usize = 128;

/// `text` cut to at most `max` bytes, on a character boundary.
fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The client id of anonymous callers (auth off, no `X-Client-ID`).
pub const ANONYMOUS: &str = "anonymous";

/// Who a queued request is for.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The client id (for fairness, caps, stats and the cache).
    pub id: Arc<str>,
    /// Identified by a key or an injection port: refused while waiting once the client leaves
    /// the snapshot or its key expires.
    pub verified: bool,
    /// May keep its own `keep_alive` while oqp decides residency
    /// ([`Identity::sets_keep_alive`]).
    pub sets_keep_alive: bool,
    /// The app it belongs to, when its key speaks for many people (the app itself or one of
    /// its users): the queue shares the app's place between them.
    pub member: Option<Member>,
    /// What its token's claims chose (`jwt.claims_to_policy`): its budget replaces
    /// `users.budget`.
    pub claims: Option<Arc<crate::policy::ClaimPolicy>>,
}

/// The tier a request asks for, if its `X-Queue-Priority` names one.
pub fn requested_tier(headers: &HeaderMap) -> Option<Tier> {
    let value = headers.get(headers::QUEUE_PRIORITY)?.to_str().ok()?.trim();
    Tier::ALL
        .into_iter()
        .find(|tier| value.eq_ignore_ascii_case(tier.as_str()))
}

/// The Common Name of the verified client certificate of the connection a request came on
/// (`proxy.tls.client_ca_file`), as a request extension.
#[derive(Debug, Clone)]
pub struct PeerCertificate(pub Arc<str>);

/// What a listener is for.
#[derive(Debug, Clone)]
pub enum ListenerKind {
    /// The main port: authentication by bearer key, every route.
    Main,
    /// An injection port: every request carries this client's identity.
    Injection {
        /// The client injected.
        client: Arc<str>,
        /// Whether an app key's end users named in requests are believed.
        trust_users: bool,
    },
}

impl ListenerKind {
    /// Whether the end user an app key's request names is believed: on the main port the
    /// key's holder names them; on an injection port only if the port says so.
    pub fn trusts_users(&self) -> bool {
        match self {
            Self::Main => true,
            Self::Injection { trust_users, .. } => *trust_users,
        }
    }
}

/// Clients whose issuer's keys a token asked for (it named an unknown key id, or there were
/// none): the node's next report carries them, and the control plane fetches those keys again.
#[derive(Debug, Default)]
pub struct KeyRefresh(Mutex<BTreeSet<Arc<str>>>);

impl KeyRefresh {
    /// Asks for `client`'s issuer keys. Only ids of the snapshot come here, so the set stays
    /// as small as the config.
    pub fn want(&self, client: &Arc<str>) {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(client.clone());
    }

    /// The clients asked for since the last call.
    pub fn take(&self) -> Vec<String> {
        let mut wanted = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        std::mem::take(&mut *wanted)
            .into_iter()
            .map(|id| id.to_string())
            .collect()
    }
}

/// Identifies the caller of a request on `listener`. A request whose key matches no client
/// may still carry a user's token where a `jwt:` client reads one; a token that fails is
/// refused with the reason, and one that names an unknown key id asks for the issuer's keys
/// again (`refresh`).
pub fn identify(
    policy: &Policy,
    listener: &ListenerKind,
    peer: IpAddr,
    headers: &HeaderMap,
    throttle: &Throttle,
    refresh: &KeyRefresh,
    certificate: Option<&PeerCertificate>,
) -> Result<Identity, ProxyError> {
    if let ListenerKind::Injection {
        client: client_id, ..
    } = listener
    {
        // The snapshot that opened the port named the client; a newer one
        // may have removed it, or its key expired since: then the port refuses.
        return policy
            .clients_by_id
            .get(client_id)
            .filter(|client| !client.is_expired(SystemTime::now()))
            .cloned()
            .map(Identity::Client)
            .ok_or(ProxyError::UnknownKey);
    }
    if !policy.auth.enabled {
        let claimed = headers
            .get(headers::CLIENT_ID)
            .and_then(|value| value.to_str().ok())
            .filter(|id| !id.is_empty())
            .map(|id| Arc::from(truncate(id, MAX_CLIENT_ID_BYTES)));
        return Ok(Identity::Anonymous(claimed));
    }
    let window = policy.auth.window;
    throttle.check(peer, policy.auth.max_failures, window)?;
    // A success does not clear the address's failures: whoever holds one key
    // must not be able to guess others without limit.
    let refusal = match presented_key(headers) {
        Presented::Key(key) => match policy.client_by_key(key) {
            Some(client) => return Ok(Identity::Client(client.clone())),
            None => ProxyError::UnknownKey,
        },
        Presented::Missing => {
            // No key: a verified client certificate may name the client (`tls_subject`).
            if let Some(client) = certificate
                .and_then(|PeerCertificate(name)| policy.clients_by_subject.get(name))
                .filter(|client| !client.is_expired(SystemTime::now()))
            {
                return Ok(Identity::Client(client.clone()));
            }
            ProxyError::MissingCredentials
        }
        Presented::Conflicting => {
            throttle.fail(peer, window);
            return Err(ProxyError::UnknownKey);
        }
    };
    let identity = match token_identity(policy, headers, refresh) {
        Some(identity) => identity,
        None => Err(refusal),
    };
    match &identity {
        Err(ProxyError::InvalidToken(error)) if !error.counts_as_failure() => {}
        Err(_) => throttle.fail(peer, window),
        Ok(_) => {}
    }
    identity
}

/// The user of a token-keyed client (`auth.keys[].jwt`) whose token the request carries, or
/// why the token is refused; `None` when no such client finds a token in the request. Of
/// several clients that read the same header, the first whose checks pass wins; when none
/// does, the refusal names the check that failed (a wrong issuer only if every one did).
fn token_identity(
    policy: &Policy,
    headers: &HeaderMap,
    refresh: &KeyRefresh,
) -> Option<Result<Identity, ProxyError>> {
    let now = SystemTime::now();
    let mut refused: Option<jwt::TokenError> = None;
    for client in &policy.token_clients {
        let Some(UserSource::Jwt(verifier)) = client.users.as_ref().map(|users| &users.source)
        else {
            continue;
        };
        let Some(token) = verifier.token(headers) else {
            continue;
        };
        // An entry past its `expires` takes no token (its users get the plain refusal).
        if client.is_expired(now) {
            continue;
        }
        match verifier.verify_user(token) {
            Ok(verified) => {
                let id: Arc<str> = Arc::from(format!("{}/{}", client.id, verified.user));
                let app = client.clone();
                let policy = client
                    .users
                    .as_ref()
                    .and_then(|users| users.claims_to_policy.as_ref())
                    .and_then(|claims| claims.select(&verified.values));
                return Some(Ok(Identity::User { app, id, policy }));
            }
            Err(error) => {
                if error.wants_keys() {
                    refresh.want(&client.id);
                }
                if refused
                    .as_ref()
                    .is_none_or(|kept| *kept == jwt::TokenError::Issuer)
                {
                    refused = Some(error);
                }
            }
        }
    }
    refused.map(|error| Err(ProxyError::InvalidToken(error)))
}

/// Most `X-Forwarded-For` entries read, from the right: a longer chain is
/// cut there (its left part is what the client itself wrote anyway).
const MAX_FORWARDED_HOPS: usize = 32;

/// The client's address, for the throttle and logs: the connection's peer,
/// unless that is a trusted proxy, in which case the right-most address of
/// `X-Forwarded-For` that is not a trusted proxy (each proxy appends the
/// address it saw, so everything left of the first untrusted hop may be
/// forged). Never used for identity, which comes from the key alone.
pub fn client_addr(peer: IpAddr, headers: &HeaderMap, trusted: &[Cidr]) -> IpAddr {
    let peer = canonical(peer);
    let is_trusted = |address: IpAddr| trusted.iter().any(|cidr| cidr.contains(address));
    if trusted.is_empty() || !is_trusted(peer) {
        return peer;
    }
    let mut hops: Vec<&str> = Vec::new();
    for value in headers.get_all(headers::FORWARDED_FOR).iter().rev() {
        let Ok(value) = value.to_str() else {
            // An unreadable header: stop at the proxy that passed it on.
            return peer;
        };
        hops.extend(value.rsplit(','));
        if hops.len() >= MAX_FORWARDED_HOPS {
            break;
        }
    }
    let mut client = peer;
    for hop in hops.into_iter().take(MAX_FORWARDED_HOPS) {
        let Some(address) = parse_hop(hop.trim()) else {
            // Garbage in the chain: the last good hop is as far as we trust.
            return client;
        };
        client = canonical(address);
        if !is_trusted(client) {
            return client;
        }
    }
    client
}

/// One `X-Forwarded-For` entry: an address, possibly `[v6]:port` or `v4:port`.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    if let Ok(address) = hop.parse() {
        return Some(address);
    }
    hop.parse::<std::net::SocketAddr>()
        .ok()
        .map(|socket| socket.ip())
}

/// The key of an `Authorization: Bearer <key>` header; the scheme is
/// case-insensitive (RFC 9110 §11.1).
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, key) = value.split_once(' ')?;
    let key = key.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !key.is_empty()).then_some(key)
}

/// Whether a request presents a key at all (`Authorization: Bearer` or `x-api-key`).
pub fn presents_key(headers: &HeaderMap) -> bool {
    presented_key(headers) != Presented::Missing
}

/// What a request presents as its key.
#[derive(Debug, PartialEq, Eq)]
enum Presented<'a> {
    Key(&'a str),
    Missing,
    /// `Authorization: Bearer` and `x-api-key` both present, and different.
    Conflicting,
}

/// The key a request presents: `Authorization: Bearer <key>`, or Anthropic's
/// `x-api-key: <key>` (what `ANTHROPIC_API_KEY` sets). Both may be sent only
/// when they are the same key.
fn presented_key(headers: &HeaderMap) -> Presented<'_> {
    let api_key = headers
        .get(headers::API_KEY)
        .and_then(|value| value.to_str().ok())
        .map(str::trim)
        .filter(|key| !key.is_empty());
    match (bearer(headers), api_key) {
        (Some(bearer), Some(api_key)) if bearer != api_key => Presented::Conflicting,
        (Some(key), _) | (None, Some(key)) => Presented::Key(key),
        (None, None) => Presented::Missing,
    }
}

pub use throttle::Throttle;

#[cfg(test)]
mod tests {
    use super::*;

    fn forwarded(values: &[&str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(headers::FORWARDED_FOR, value.parse().unwrap());
        }
        headers
    }

    #[test]
    fn forwarded_for_is_believed_only_from_trusted_proxies() {
        let trusted: Vec<Cidr> = vec!["10.0.0.0/8".parse().unwrap(), "::1".parse().unwrap()];
        let proxy: IpAddr = [10, 0, 0, 2].into();
        let stranger: IpAddr = [203, 0, 113, 9].into();
        let chain = forwarded(&["198.51.100.7, 10.0.0.5"]);
        // From a trusted proxy: the right-most untrusted hop.
        assert_eq!(
            client_addr(proxy, &chain, &trusted),
            IpAddr::from([198, 51, 100, 7])
        );
        // A client that forges the left part still gets its real address.
        let forged = forwarded(&["1.2.3.4, 198.51.100.7"]);
        assert_eq!(
            client_addr(proxy, &forged, &trusted),
            IpAddr::from([198, 51, 100, 7])
        );
        // Several headers read as one list, in order.
        let split = forwarded(&["1.2.3.4", "198.51.100.8"]);
        assert_eq!(
            client_addr(proxy, &split, &trusted),
            IpAddr::from([198, 51, 100, 8])
        );
        // Not from a trusted proxy, or no list configured: the header is ignored.
        assert_eq!(client_addr(stranger, &chain, &trusted), stranger);
        assert_eq!(client_addr(proxy, &chain, &[]), proxy);
        // Garbage stops at the last good hop; an all-trusted chain gives its left end.
        assert_eq!(client_addr(proxy, &forwarded(&["junk"]), &trusted), proxy);
        assert_eq!(
            client_addr(proxy, &forwarded(&["10.0.0.9"]), &trusted),
            IpAddr::from([10, 0, 0, 9])
        );
        assert_eq!(
            client_addr(
                "::1".parse().unwrap(),
                &forwarded(&["[2001:db8::1]:443"]),
                &trusted
            ),
            "2001:db8::1".parse::<IpAddr>().unwrap()
        );
    }

    #[test]
    fn x_api_key_identifies_like_bearer_and_must_agree_with_it() {
        let mut headers = HeaderMap::new();
        assert_eq!(presented_key(&headers), Presented::Missing);
        headers.insert(headers::API_KEY, "abc".parse().unwrap());
        assert_eq!(presented_key(&headers), Presented::Key("abc"));
        headers.insert(http::header::AUTHORIZATION, "Bearer abc".parse().unwrap());
        assert_eq!(presented_key(&headers), Presented::Key("abc"));
        headers.insert(http::header::AUTHORIZATION, "Bearer other".parse().unwrap());
        assert_eq!(presented_key(&headers), Presented::Conflicting);
        headers.remove(headers::API_KEY);
        assert_eq!(presented_key(&headers), Presented::Key("other"));
    }

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::AUTHORIZATION, "bearer abc".parse().unwrap());
        assert_eq!(bearer(&headers), Some("abc"));
        headers.insert(http::header::AUTHORIZATION, "BEARER  abc ".parse().unwrap());
        assert_eq!(bearer(&headers), Some("abc"));
        headers.insert(http::header::AUTHORIZATION, "Basic abc".parse().unwrap());
        assert_eq!(bearer(&headers), None);
        headers.insert(http::header::AUTHORIZATION, "Bearer ".parse().unwrap());
        assert_eq!(bearer(&headers), None);
    }

    #[test]
    fn priority_header_is_case_insensitive_and_invalid_means_none() {
        let mut headers = HeaderMap::new();
        assert_eq!(requested_tier(&headers), None);
        headers.insert(headers::QUEUE_PRIORITY, "HIGH".parse().unwrap());
        assert_eq!(requested_tier(&headers), Some(Tier::High));
        headers.insert(headers::QUEUE_PRIORITY, "urgent".parse().unwrap());
        assert_eq!(requested_tier(&headers), None);
    }
}
