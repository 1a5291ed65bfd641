//! The wire contract of oqp: the policy stream between the control plane and
//! its data planes (`oqp.policy.v1`), and the administration API used by
//! `oqpctl` (`oqp.admin.v1`). Generated from `proto/oqp/**.proto`; beside the
//! generated code only what both ends must compute alike (where a budget
//! window starts, a cloud account's [`balance`] and its reserve) and redacting
//! `Debug` impls live here.

#![allow(missing_docs, missing_debug_implementations, clippy::all)]

/// The policy stream: snapshots down, reports up.
pub mod policy {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("oqp.policy.v1");
    }
}

/// The administration API.
pub mod admin {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("oqp.admin.v1");
    }
}

pub mod balance;

/// The start (Unix seconds) of the budget window of `length` seconds anchored at `anchor`
/// that holds `now`: `anchor` plus whole multiples of `length` (`Budget.window_seconds` and
/// `Budget.window_anchor_unix_s`). The control plane sums usage and the data planes refuse
/// over budget by the same windows.
pub fn window_start(now: i64, length: u64, anchor: i64) -> i64 {
    let length = i64::try_from(length.max(1)).unwrap_or(i64::MAX);
    anchor + (now - anchor).div_euclid(length) * length
}

impl policy::v1::Budget {
    /// The start of this budget's window holding `now` (Unix seconds).
    pub fn window_start(&self, now: i64) -> i64 {
        window_start(now, self.window_seconds, self.window_anchor_unix_s)
    }
}

/// gRPC metadata entry that carries a data plane's node token.
pub const NODE_TOKEN_METADATA: &str = "x-oqp-node-token";

impl std::fmt::Debug for policy::v1::CloudKey {
    /// Never prints the key: an upstream cloud key is a secret even in a
    /// debug dump of a snapshot.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CloudKey")
            .field("key", &"…")
            .field("account", &self.account)
            .finish()
    }
}

impl std::fmt::Debug for admin::v1::AddNodeResponse {
    /// Never prints the token: it is shown once, to the operator who issued it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AddNodeResponse")
            .field("credential", &self.credential)
            .field("token", &"…")
            .finish()
    }
}

impl std::fmt::Debug for policy::v1::HopPeer {
    /// Never prints the keys: either lets its holder assert any client to a peer.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HopPeer")
            .field("node", &self.node)
            .field("sign", &"…")
            .field("verify", &"…")
            .finish()
    }
}

impl std::fmt::Debug for policy::v1::EmbeddingCacheSettings {
    /// Never prints the password of a `redis://user:password@host` backend.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddingCacheSettings")
            .field("enabled", &self.enabled)
            .field("backend", &without_userinfo(&self.backend))
            .field("ttl_seconds", &self.ttl_seconds)
            .field("max_entry_bytes", &self.max_entry_bytes)
            .field("key_prefix", &self.key_prefix)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("max_memory_bytes", &self.max_memory_bytes)
            .field("per_client", &self.per_client)
            .finish()
    }
}

/// A URL with its `user:password@` (and any query, which Redis URLs may use
/// for a password too) replaced by `…`.
fn without_userinfo(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let rest = match rest.split_once('?') {
        Some((rest, _)) => format!("{rest}?…"),
        None => rest.to_owned(),
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://…@{host}{}", &rest[authority_end..]),
        None => format!("{scheme}://{rest}"),
    }
}

/// Milliseconds since the Unix epoch: every `*_unix_ms` field on the wire (0 before it).
pub fn unix_ms(time: std::time::SystemTime) -> i64 {
    time.duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_debug_shows_no_redis_password() {
        let snapshot = policy::v1::PolicySnapshot {
            embedding_cache: Some(policy::v1::EmbeddingCacheSettings {
                backend: "redis://user:hunter2@valkey:6379/0?password=hunter3".to_owned(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let printed = format!("{snapshot:?}");
        assert!(!printed.contains("hunter"), "{printed}");
        assert!(printed.contains("redis://…@valkey:6379/0?…"), "{printed}");
        assert_eq!(without_userinfo("memory"), "memory");
        assert_eq!(
            without_userinfo("redis://valkey:6379/0"),
            "redis://valkey:6379/0"
        );
        assert_eq!(without_userinfo("rediss://:pw@h"), "rediss://…@h");
    }

    #[test]
    fn an_issued_node_token_and_hop_keys_are_not_in_debug() {
        let issued = admin::v1::AddNodeResponse {
            credential: Some(admin::v1::NodeCredential {
                node: "box-a".to_owned(),
                ..Default::default()
            }),
            token: "oqp_node_secret".to_owned(),
        };
        let printed = format!("{issued:?}");
        assert!(!printed.contains("secret"), "{printed}");
        assert!(printed.contains("box-a"), "{printed}");
        let peer = policy::v1::HopPeer {
            node: "box-b".to_owned(),
            sign: b"sign-key-bytes".to_vec(),
            verify: b"verify-key-bytes".to_vec(),
        };
        let printed = format!("{peer:?}");
        assert!(
            printed.contains("box-b") && !printed.contains("115"),
            "{printed}"
        );
    }
}
