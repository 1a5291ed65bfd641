//! Minting consumer keys: 256 bits from the operating system's generator,
//! spelled `oqp_` + 43 characters of unpadded base64url, so that a leaked key
//! is recognisable (secret scanners, log greps) and safe in a header, a URL
//! or a shell argument.

use rand::TryRngCore;
use rand::rngs::OsRng;

use crate::config::Secret;

/// What every minted key starts with.
pub const PREFIX: &str = "oqp_";

/// A new random key. Fails only if the operating system's generator does.
pub fn mint() -> Result<Secret, rand::rand_core::OsError> {
    let mut bytes = [0u8; 32];
    OsRng.try_fill_bytes(&mut bytes)?;
    Ok(Secret::new(format!("{PREFIX}{}", base64url(&bytes))))
}

/// Unpadded base64url (RFC 4648 §5).
fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        // A chunk of k bytes carries 8k bits: k + 1 characters.
        for index in 0..=chunk.len() {
            let sextet = (n >> (18 - 6 * index)) & 0x3f;
            out.push(char::from(ALPHABET[sextet as usize]));
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn base64url_matches_rfc_4648_vectors() {
        // RFC 4648 §10, unpadded.
        for (input, expected) in [
            ("", ""),
            ("f", "Zg"),
            ("fo", "Zm8"),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg"),
            ("fooba", "Zm9vYmE"),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64url(input.as_bytes()), expected);
        }
        // The url-safe alphabet, not `+` and `/`.
        assert_eq!(base64url(&[0xfb, 0xff]), "-_8");
    }

    #[test]
    fn keys_are_prefixed_256_bit_and_distinct() {
        let a = mint().unwrap();
        let b = mint().unwrap();
        assert!(a.expose().starts_with(PREFIX));
        assert_eq!(a.expose().len(), PREFIX.len() + 43);
        assert!(
            a.expose()[PREFIX.len()..]
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        );
        assert_ne!(a, b);
    }
}
