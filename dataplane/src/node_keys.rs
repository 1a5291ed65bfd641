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
}
