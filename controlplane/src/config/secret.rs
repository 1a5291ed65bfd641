//! A credential that never prints itself.
//!
//! API keys, cloud pool keys and the node token are all [`Secret`]s once the loader has resolved
//! them. The value is reachable only through [`Secret::expose`], so a `{:?}` of the whole
//! [`Config`](super::Config), a panic message or a log line cannot carry it by accident. There is
//! deliberately no `Serialize`: a secret leaves the process only through code that asks for it.

use std::fmt;

use sha2::{Digest, Sha256};

/// A resolved credential. `Debug` and `Display` print `Secret(…)`, never the value.
#[derive(Clone, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a credential. The loader never builds an empty one; callers that mint keys should not
    /// either.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The plaintext, for the few places that must send or compare it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// SHA-256 of the plaintext: the form in which keys travel to the data plane.
    pub fn sha256(&self) -> [u8; 32] {
        Sha256::digest(self.0.as_bytes()).into()
    }
}

impl PartialEq for Secret {
    // Compare digests, so that the time taken does not depend on how long a prefix matches.
    fn eq(&self, other: &Self) -> bool {
        self.sha256() == other.sha256()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(…)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(…)")
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn formatting_never_shows_the_value() {
        let secret = Secret::new("sk-very-secret");
        assert_eq!(format!("{secret:?}"), "Secret(…)");
        assert_eq!(format!("{secret}"), "Secret(…)");
        assert_eq!(format!("{:#?}", Some(&secret)), "Some(\n    Secret(…),\n)");
        assert_eq!(secret.expose(), "sk-very-secret");
    }

    #[test]
    fn digest_and_equality() {
        let secret = Secret::new("abc");
        assert_eq!(
            hex::encode(secret.sha256()),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(secret, Secret::new("abc"));
        assert_ne!(secret, Secret::new("abd"));
    }
}
