//! The wire contract of oqp: the policy stream between the control plane and
//! its data planes (`oqp.policy.v1`), and the administration API used by
//! `oqpctl` (`oqp.admin.v1`). Generated from `proto/oqp/**.proto`; nothing
//! else lives here.

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
