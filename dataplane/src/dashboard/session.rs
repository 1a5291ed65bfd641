//! Dashboard sessions: a key entered once on the login form, exchanged for a random session id
//! that the browser holds in an `HttpOnly`, `SameSite=Strict` cookie.
//!
//! The store lives in the data plane's memory only and holds nothing secret: per session the
//! SHA-256 digest of its id (the id itself is only in the browser), the digest of the key that
//! opened it (the data plane holds key digests anyway) and its expiry. A session is as good as
//! its key: every use looks the key up in the current snapshot, so a revoked, rotated-out or
//! expired key ends its sessions at once. The count is bounded ([`MAX_SESSIONS`]): past it the
//! session closest to its end is dropped. A restart ends every session (log in again).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use base64::Engine;
use sha2::Digest;

/// The cookie's name.
pub const COOKIE: &str = "oqp_session";

/// How long a session lasts from login.
pub const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);

/// Most sessions held at once.
pub const MAX_SESSIONS: usize = 1024;

/// The sessions of one data plane.
#[derive(Default)]
pub struct Sessions {
    inner: Mutex<HashMap<[u8; 32], Session>>,
}

/// One session: whose key opened it, and until when.
#[derive(Debug, Clone, Copy)]
struct Session {
    key_digest: [u8; 32],
    expires: SystemTime,
}

/// A session just opened: the id for the cookie (shown once, never stored) and its end.
#[derive(Debug)]
pub struct Opened {
    /// 32 random bytes, URL-safe base64 without padding.
    pub id: String,
    /// When it ends.
    pub expires: SystemTime,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("open", &self.lock().len())
            .finish()
    }
}

impl Sessions {
    /// Opens a session for the key whose digest is `key_digest`.
    pub fn open(&self, key_digest: [u8; 32], now: SystemTime) -> Opened {
        let id =
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(rand::random::<[u8; 32]>());
        let expires = now + SESSION_TTL;
        let mut sessions = self.lock();
        sessions.retain(|_, session| session.expires > now);
        if sessions.len() >= MAX_SESSIONS {
            let soonest = sessions
                .iter()
                .min_by_key(|(_, session)| session.expires)
                .map(|(digest, _)| *digest);
            if let Some(digest) = soonest {
                sessions.remove(&digest);
            }
        }
        sessions.insert(
            digest(&id),
            Session {
                key_digest,
                expires,
            },
        );
        Opened { id, expires }
    }

    /// The key digest of the live session `id`; an expired one is dropped.
    pub fn find(&self, id: &str, now: SystemTime) -> Option<[u8; 32]> {
        let digest = digest(id);
        let mut sessions = self.lock();
        let session = *sessions.get(&digest)?;
        if session.expires <= now {
            sessions.remove(&digest);
            return None;
        }
        Some(session.key_digest)
    }

    /// Ends session `id`; whether it was open.
    pub fn close(&self, id: &str) -> bool {
        self.lock().remove(&digest(id)).is_some()
    }

    /// Sessions held (expired ones included until they are next looked at).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Moves every session's end `by` earlier: what the passing of that much time does, for
    /// tests of expiry that cannot wait hours.
    pub fn age(&self, by: Duration) {
        for session in self.lock().values_mut() {
            session.expires = session
                .expires
                .checked_sub(by)
                .unwrap_or(SystemTime::UNIX_EPOCH);
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<[u8; 32], Session>> {
        // Plain data, no invariant a panic could break half-way.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn digest(id: &str) -> [u8; 32] {
    sha2::Sha256::digest(id.as_bytes()).into()
}

/// The session id in a request's `Cookie` headers, if it carries one.
pub fn from_cookies(headers: &http::HeaderMap) -> Option<&str> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.trim())
        .filter(|value| !value.is_empty())
}

/// The `Set-Cookie` value of a session `id` lasting `ttl`; `secure` on a TLS listener (or
/// behind one).
pub fn set_cookie(id: &str, ttl: Duration, secure: bool) -> String {
    let secure = if secure { "; Secure" } else { "" };
    format!(
        "{COOKIE}={id}; Path=/; Max-Age={}; HttpOnly; SameSite=Strict{secure}",
        ttl.as_secs()
    )
}

/// The `Set-Cookie` value that removes the cookie.
pub fn clear_cookie(secure: bool) -> String {
    set_cookie("", Duration::ZERO, secure)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: [u8; 32] = [7; 32];

    #[test]
    fn a_session_is_found_until_it_ends_or_is_closed() {
        let sessions = Sessions::default();
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let opened = sessions.open(KEY, now);
        assert_eq!(opened.id.len(), 43, "32 bytes, base64 without padding");
        assert_eq!(opened.expires, now + SESSION_TTL);
        assert_eq!(sessions.find(&opened.id, now), Some(KEY));
        assert_eq!(sessions.find("other", now), None);
        // Expired: gone, and dropped from the store.
        assert_eq!(sessions.find(&opened.id, opened.expires), None);
        assert!(sessions.is_empty());

        let opened = sessions.open(KEY, now);
        assert!(sessions.close(&opened.id));
        assert!(!sessions.close(&opened.id));
        assert_eq!(sessions.find(&opened.id, now), None);

        let opened = sessions.open(KEY, now);
        sessions.age(SESSION_TTL);
        assert_eq!(sessions.find(&opened.id, now), None);
    }

    #[test]
    fn the_store_is_bounded_and_drops_the_soonest_to_end() {
        let sessions = Sessions::default();
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let first = sessions.open(KEY, start);
        let mut last = None;
        for i in 1..=MAX_SESSIONS {
            last = Some(sessions.open(KEY, start + Duration::from_secs(i as u64)));
        }
        assert_eq!(sessions.len(), MAX_SESSIONS);
        let now = start + Duration::from_secs(MAX_SESSIONS as u64);
        assert_eq!(sessions.find(&first.id, now), None, "the oldest went");
        assert_eq!(sessions.find(&last.unwrap().id, now), Some(KEY));
    }

    #[test]
    fn nothing_secret_is_held_or_shown() {
        let sessions = Sessions::default();
        let opened = sessions.open(KEY, SystemTime::now());
        let shown = format!("{sessions:?}");
        assert_eq!(shown, "Sessions { open: 1 }");
        assert!(
            !sessions
                .lock()
                .keys()
                .any(|digest| digest.as_slice() == opened.id.as_bytes()),
            "only the id's digest is kept"
        );
    }

    #[test]
    fn cookies_are_read_and_written_with_their_flags() {
        let mut headers = http::HeaderMap::new();
        headers.append(
            http::header::COOKIE,
            "a=1; oqp_session=abc ; b=2".parse().unwrap(),
        );
        assert_eq!(from_cookies(&headers), Some("abc"));
        headers.clear();
        headers.append(http::header::COOKIE, "x=1".parse().unwrap());
        headers.append(http::header::COOKIE, "oqp_session=def".parse().unwrap());
        assert_eq!(from_cookies(&headers), Some("def"));
        headers.clear();
        headers.append(http::header::COOKIE, "oqp_session=".parse().unwrap());
        assert_eq!(from_cookies(&headers), None);

        assert_eq!(
            set_cookie("abc", Duration::from_secs(60), false),
            "oqp_session=abc; Path=/; Max-Age=60; HttpOnly; SameSite=Strict"
        );
        assert!(set_cookie("abc", Duration::from_secs(60), true).ends_with("; Secure"));
        assert_eq!(
            clear_cookie(false),
            "oqp_session=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict"
        );
    }
}
