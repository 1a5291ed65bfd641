//! Who is calling, and what they may do.
//!
//! The main port authenticates `Authorization: Bearer <key>` by the SHA-256
//! digest of the key (the data plane holds no key in clear); an injection
//! port names its client by configuration. Everything the proxy decides for
//! a request (tier ceiling, scope, cap, identity in stats and upstream)
//! follows from the [`Identity`] found here, never from what the client
//! claims. Failed attempts are throttled per client IP.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use http::HeaderMap;

use crate::error::ProxyError;
use crate::headers;
use crate::policy::{Client, Policy, Scope};
use crate::scheduler::Tier;
use crate::server::ListenerKind;

/// The caller of one request.
#[derive(Debug, Clone)]
pub enum Identity {
    /// A known client: by key on the main port, by configuration on an
    /// injection port.
    Client(Arc<Client>),
    /// Auth is off: whoever the `X-Client-ID` header says, unverified.
    Anonymous(Option<Arc<str>>),
}

impl Identity {
    /// The caller as the queue knows it: its id, and whether it was identified (a key or an
    /// injection port) rather than claimed in `X-Client-ID` with auth off.
    pub fn caller(&self) -> Caller {
        match self {
            Identity::Client(client) => Caller {
                id: client.id.clone(),
                verified: true,
            },
            Identity::Anonymous(id) => Caller {
                id: id.clone().unwrap_or_else(|| Arc::from(ANONYMOUS)),
                verified: false,
            },
        }
    }

    /// The client id used for stats, caps and the upstream `X-Client-ID`.
    pub fn client_id(&self) -> Option<&Arc<str>> {
        match self {
            Identity::Client(client) => Some(&client.id),
            Identity::Anonymous(id) => id.as_ref(),
        }
    }

    /// Checks that the caller may do what needs `scope`. Anonymous callers
    /// (auth off) may do everything.
    pub fn require(&self, scope: Scope) -> Result<(), ProxyError> {
        match self {
            Identity::Client(client) if client.scope < scope => {
                Err(ProxyError::ScopeRequired(scope))
            }
            _ => Ok(()),
        }
    }

    /// The tier for a request that asked for `requested` (`X-Queue-Priority`):
    /// capped by the client's ceiling, silently.
    pub fn tier(&self, requested: Option<Tier>) -> Tier {
        match self {
            Identity::Client(client) => client.tier_for(requested),
            Identity::Anonymous(_) => requested.unwrap_or(Tier::Normal),
        }
    }
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
}

/// The tier a request asks for, if its `X-Queue-Priority` names one.
pub fn requested_tier(headers: &HeaderMap) -> Option<Tier> {
    let value = headers.get(headers::QUEUE_PRIORITY)?.to_str().ok()?.trim();
    Tier::ALL
        .into_iter()
        .find(|tier| value.eq_ignore_ascii_case(tier.as_str()))
}

/// Identifies the caller of a request on `listener`.
pub fn identify(
    policy: &Policy,
    listener: &ListenerKind,
    peer: IpAddr,
    headers: &HeaderMap,
    throttle: &Throttle,
) -> Result<Identity, ProxyError> {
    if let ListenerKind::Injection(client_id) = listener {
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
            .map(Arc::from);
        return Ok(Identity::Anonymous(claimed));
    }
    let window = policy.auth.window;
    throttle.check(peer, policy.auth.max_failures, window)?;
    let key = bearer(headers).ok_or_else(|| {
        throttle.fail(peer, window);
        ProxyError::MissingCredentials
    })?;
    match policy.client_by_key(key) {
        Some(client) => {
            throttle.succeed(peer);
            Ok(Identity::Client(client.clone()))
        }
        None => {
            throttle.fail(peer, window);
            Err(ProxyError::UnknownKey)
        }
    }
}

/// The key of an `Authorization: Bearer <key>` header; the scheme is
/// case-insensitive (RFC 9110 §11.1).
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, key) = value.split_once(' ')?;
    let key = key.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !key.is_empty()).then_some(key)
}

/// Failed-authentication throttle, per client IP, with bounded memory.
#[derive(Debug, Default)]
pub struct Throttle {
    failures: Mutex<HashMap<IpAddr, VecDeque<Instant>>>,
}

/// Most addresses remembered; beyond it, addresses with only stale failures
/// are forgotten first, then the map is cleared (a flood of fresh addresses
/// must not exhaust memory).
const MAX_TRACKED: usize = 10_000;

impl Throttle {
    /// Refuses an address with `max_failures` failures inside `window`.
    pub fn check(
        &self,
        peer: IpAddr,
        max_failures: u32,
        window: Duration,
    ) -> Result<(), ProxyError> {
        let Ok(mut failures) = self.failures.lock() else {
            return Ok(());
        };
        let Some(recent) = failures.get_mut(&peer) else {
            return Ok(());
        };
        let now = Instant::now();
        while recent
            .front()
            .is_some_and(|at| now.duration_since(*at) >= window)
        {
            recent.pop_front();
        }
        if recent.len() >= max_failures as usize {
            let oldest = recent.front().copied().unwrap_or(now);
            let wait = window.saturating_sub(now.duration_since(oldest));
            return Err(ProxyError::TooManyAuthFailures {
                retry_after: wait.as_secs().max(1),
            });
        }
        if recent.is_empty() {
            failures.remove(&peer);
        }
        Ok(())
    }

    /// Records a failure.
    pub fn fail(&self, peer: IpAddr, window: Duration) {
        let Ok(mut failures) = self.failures.lock() else {
            return;
        };
        if failures.len() >= MAX_TRACKED && !failures.contains_key(&peer) {
            let now = Instant::now();
            failures.retain(|_, recent| {
                recent
                    .back()
                    .is_some_and(|at| now.duration_since(*at) < window)
            });
            if failures.len() >= MAX_TRACKED {
                failures.clear();
            }
        }
        let recent = failures.entry(peer).or_default();
        recent.push_back(Instant::now());
        // Only the last `max_failures` matter; keep the deque short.
        while recent.len() > 1024 {
            recent.pop_front();
        }
    }

    /// A success clears the address's history.
    pub fn succeed(&self, peer: IpAddr) {
        if let Ok(mut failures) = self.failures.lock() {
            failures.remove(&peer);
        }
    }

    /// Addresses currently remembered.
    pub fn tracked(&self) -> usize {
        self.failures.lock().map_or(0, |f| f.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn throttle_refuses_after_max_failures_and_forgets_on_success() {
        let throttle = Throttle::default();
        let peer: IpAddr = [10, 0, 0, 1].into();
        let window = Duration::from_secs(60);
        for _ in 0..3 {
            assert!(throttle.check(peer, 3, window).is_ok());
            throttle.fail(peer, window);
        }
        let refused = throttle.check(peer, 3, window).unwrap_err();
        assert!(
            matches!(refused, ProxyError::TooManyAuthFailures { retry_after } if retry_after <= 60)
        );
        throttle.succeed(peer);
        assert!(throttle.check(peer, 3, window).is_ok());
    }

    #[test]
    fn throttle_memory_is_bounded() {
        let throttle = Throttle::default();
        let window = Duration::from_secs(60);
        for i in 0..(MAX_TRACKED as u32 + 50) {
            throttle.fail(IpAddr::from(i.to_be_bytes()), window);
        }
        assert!(throttle.tracked() <= MAX_TRACKED);
    }
}
