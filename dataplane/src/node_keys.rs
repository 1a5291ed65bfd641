//! The keys derived from the node token. The token is the root secret every data plane and the
//! control plane hold; what each use sees is a key derived from it for that use alone,
//! HMAC-SHA256(token, label), so that one that leaks (the gRPC credential read off a link, the
//! admin credential from a log of calls) gives neither the token nor the others:
//!
//! | use | label | where it goes |
//! | --- | --- | --- |
//! | [`grpc_credential`] | `oqp grpc v1` | data plane → control plane, every `PolicyService` call |
//! | [`admin_credential`] | `oqp admin v1` | data plane → control plane's admin API (auth off) |
//! | [`hop_key`] | `oqp hop v1` | never sent: the HMAC key of the hop header ([`crate::hop`]) |
//!
//! The two credentials travel as lowercase hex (64 characters, valid gRPC metadata).
//!
//! A node issued its own token (`oqpctl nodes add`) derives the same three from it, but
//! shares its hop key with nobody: its hops are keyed instead by [`hop_pair_key`]s that the
//! control plane derives for each ordered pair of nodes and sends in each side's snapshot.

use hmac::{Hmac, Mac};
use sha2::Sha256;

const GRPC: &[u8] = b"oqp grpc v1";
const ADMIN: &[u8] = b"oqp admin v1";
const HOP: &[u8] = b"oqp hop v1";

/// What a data plane presents on every `PolicyService` call, and what the control plane
/// expects there.
pub fn grpc_credential(token: &str) -> String {
    hex::encode(derive(token, GRPC))
}

/// What a data plane presents to the admin API (the auth-off credential for changes).
pub fn admin_credential(token: &str) -> String {
    hex::encode(derive(token, ADMIN))
}

/// The HMAC key of the hop header.
pub fn hop_key(token: &str) -> [u8; 32] {
    derive(token, HOP)
}

/// The hop key of one ordered pair of nodes, `from` signing to `to`: what the control plane
/// sends each side of the pair ([`HopPeer`](oqp_proto::policy::v1::HopPeer)), keyed by a
/// secret only it holds. Each name comes with the issue time of its own token (0 for a name
/// on the shared token), so that a name issued a new token has new keys with everyone.
///
/// HMAC-SHA256(root, `oqp hop pair v1` ‖ each field as an 8-byte big-endian length and its
/// bytes: from, from's issue time, to, to's issue time).
pub fn hop_pair_key(root: &[u8], from: (&str, u64), to: (&str, u64)) -> [u8; 32] {
    let mut mac = match Hmac::<Sha256>::new_from_slice(root) {
        Ok(mac) => mac,
        Err(_) => return [0; 32],
    };
    mac.update(b"oqp hop pair v1");
    let (from_issued, to_issued) = (from.1.to_be_bytes(), to.1.to_be_bytes());
    for field in [
        from.0.as_bytes(),
        &from_issued[..],
        to.0.as_bytes(),
        &to_issued[..],
    ] {
        mac.update(&(field.len() as u64).to_be_bytes());
        mac.update(field);
    }
    mac.finalize().into_bytes().into()
}

fn derive(token: &str, label: &[u8]) -> [u8; 32] {
    // HMAC takes a key of any length: this never fails.
    let mut mac = match Hmac::<Sha256>::new_from_slice(token.as_bytes()) {
        Ok(mac) => mac,
        Err(_) => return [0; 32],
    };
    mac.update(label);
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_use_has_its_own_key_and_none_is_the_token() {
        let token = "sk-node-0123456789";
        let grpc = grpc_credential(token);
        let admin = admin_credential(token);
        let hop = hex::encode(hop_key(token));
        assert_eq!(grpc.len(), 64);
        assert!(grpc != admin && admin != hop && hop != grpc);
        assert!(
            ![&grpc, &admin, &hop]
                .iter()
                .any(|key| key.as_str() == token)
        );
        // Stable: both ends must derive the same.
        assert_eq!(grpc, grpc_credential(token));
        assert_ne!(grpc, grpc_credential("sk-node-0123456780"));
        // HMAC-SHA256 (RFC 4231 test case 2), so that other implementations can derive it.
        let mut mac = Hmac::<Sha256>::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        assert_eq!(
            hex::encode(mac.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn a_pair_key_is_its_ordered_pair_s_alone() {
        let root = b"control-plane-hop-root";
        let ab = hop_pair_key(root, ("a", 1), ("b", 0));
        assert_eq!(ab, hop_pair_key(root, ("a", 1), ("b", 0)));
        assert_ne!(
            ab,
            hop_pair_key(root, ("b", 0), ("a", 1)),
            "each direction its own"
        );
        assert_ne!(
            ab,
            hop_pair_key(root, ("a", 2), ("b", 0)),
            "a new token, new keys"
        );
        assert_ne!(ab, hop_pair_key(root, ("a", 1), ("c", 0)));
        assert_ne!(ab, hop_pair_key(b"another root", ("a", 1), ("b", 0)));
        // Lengths first: moving a byte between names gives another key.
        assert_ne!(
            hop_pair_key(root, ("ab", 0), ("c", 0)),
            hop_pair_key(root, ("a", 0), ("bc", 0))
        );
    }
}
