//! The gRPC adapters: `oqp.policy.v1.PolicyService` for data planes and
//! `oqp.admin.v1.AdminService` for oqpctl. They only convert and check
//! credentials; state lives in [`crate::hub`].

pub mod admin;
pub mod policy;

use sha2::{Digest, Sha256};

/// Compares two secrets without leaking, through timing, where they differ:
/// both sides are hashed first, so the comparison runs over digests.
pub fn secrets_match(presented: &str, expected: &str) -> bool {
    let a = Sha256::digest(presented.as_bytes());
    let b = Sha256::digest(expected.as_bytes());
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_by_value() {
        assert!(secrets_match("token", "token"));
        assert!(!secrets_match("token", "token2"));
        assert!(!secrets_match("", "token"));
    }
}
