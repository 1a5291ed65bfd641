//! The node credential when `control_plane.node_token` is not set.
//!
//! Every `PolicyService` call is authenticated, also on a single box: a report carries
//! usage, which budgets are decided from, and events, which become webhooks. Without a
//! configured token the control plane uses one of its own: 256 random bits, kept in
//! `state_dir/node_token` (mode 0600, the key store's atomic writing) so that it survives
//! restarts and a data plane run as its own process on the same box can present it with
//! `--node-token-file`; with no state directory it lives in memory only, known to the
//! in-process data plane alone (`--with-dataplane`). A configured token always wins.

use std::path::{Path, PathBuf};

use crate::config::Secret;
use crate::keystore::mint::mint;
use crate::state_file::{read, write_atomic};

/// The file in the state directory.
pub const FILE: &str = "node_token";

/// Where the generated token is kept under `state_dir`.
pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(FILE)
}

/// The token kept in `state_dir`, or a new one (saved there when the directory exists).
/// An existing file that cannot be read, or is empty, is an error: serving with another
/// token would lock out the data planes that read it.
pub fn load_or_mint(state_dir: &Path) -> Result<Secret, String> {
    load_or_mint_at(&path(state_dir), state_dir)
}

/// [`load_or_mint`] for the secret in `file` (also the hop root, [`crate::hop_keys`]).
pub fn load_or_mint_at(file: &Path, state_dir: &Path) -> Result<Secret, String> {
    match read(file) {
        Ok(Some(bytes)) => {
            let token =
                String::from_utf8(bytes).map_err(|_| format!("{} is not UTF-8", file.display()))?;
            let token = token.trim();
            if token.is_empty() {
                return Err(format!("{} is empty", file.display()));
            }
            return Ok(Secret::new(token));
        }
        Ok(None) => {}
        Err(error) => return Err(format!("cannot read {}: {error}", file.display())),
    }
    let token = mint().map_err(|error| format!("cannot generate {}: {error}", file.display()))?;
    if state_dir.is_dir() {
        write_atomic(file, format!("{}\n", token.expose()).as_bytes())
            .map_err(|error| format!("cannot write {}: {error}", file.display()))?;
    }
    Ok(token)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn a_token_is_minted_once_and_kept_private() {
        let dir = tempfile::tempdir().unwrap();
        let first = load_or_mint(dir.path()).unwrap();
        assert!(first.expose().len() > 40);
        let mode = std::fs::metadata(path(dir.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(
            load_or_mint(dir.path()).unwrap(),
            first,
            "kept across starts"
        );
        std::fs::write(path(dir.path()), "\n").unwrap();
        assert!(load_or_mint(dir.path()).unwrap_err().contains("empty"));
    }

    #[test]
    fn without_a_state_directory_each_start_has_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("absent");
        let a = load_or_mint(&missing).unwrap();
        let b = load_or_mint(&missing).unwrap();
        assert_ne!(a, b);
        assert!(!missing.exists());
    }
}
