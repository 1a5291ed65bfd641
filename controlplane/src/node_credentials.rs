//! Per-node credentials: a data plane's own token, valid for its name alone and
//! revocable (`oqpctl nodes add NAME` / `revoke NAME`).
//!
//! The shared `control_plane.node_token` admits a data plane under any name, so one
//! leaked copy is every node. A node issued its own token instead presents that, and
//! the control plane admits it under that one name: the token of `a` cannot watch,
//! report or be relayed as `b`, and once a name has its own token (or had one, now
//! revoked) the shared token no longer admits that name either. The name's hosts (and
//! their cloud keys, in its snapshot) are thus the data plane that holds the name's
//! token.
//!
//! Only digests are kept, in `state_dir/nodes.json` (mode 0600, the key store's atomic
//! writing): for each name, the SHA-256 of the two keys a data plane derives from its
//! token ([`oqp_dataplane::node_keys`]), the gRPC credential it presents on every
//! `PolicyService` call and the admin credential. The token itself is shown once, by
//! [`NodeCredentials::add`], and never stored, logged or printed by `Debug`.
//!
//! A revoked name keeps a tombstone, so that neither its old token nor the shared one
//! admits it until it is issued a new token. Every admission comes with a signal that
//! fires when the name's credential next changes (revoked, or issued while a data plane
//! watches under the shared token): the watch ends at once and the data plane must
//! present what admits the name now.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use oqp_dataplane::node_keys;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::config::Secret;
use crate::keystore::mint::{PREFIX, mint};
use crate::state_file::{read, remove_temporaries, shared_mode, write_atomic};

/// The file in the state directory.
pub const FILE: &str = "nodes.json";

/// What every node token starts with (a consumer key is `oqp_…`).
pub const TOKEN_PREFIX: &str = "oqp_node_";

/// The longest node name.
const MAX_NAME: usize = 64;

/// The per-node credentials. See the module documentation.
pub struct NodeCredentials {
    path: PathBuf,
    state: Mutex<State>,
}

impl std::fmt::Debug for NodeCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCredentials")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Who a presented credential is, for a call under a node name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The name's own token: admitted.
    Own,
    /// The name has no token of its own: the shared token decides.
    Unclaimed,
    /// The name has its own token and this is not it: refused.
    Wrong,
    /// The name's token was revoked: refused until it is issued a new one.
    Revoked,
}

/// Why a change was refused.
#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    /// Not a usable node name.
    #[error(
        "invalid node name {0:?}: 1 to 64 letters, digits, '.', '_' or '-' (as the data plane's --node)"
    )]
    InvalidName(String),
    /// `local` is the control plane's own data plane (`--with-dataplane`), which presents
    /// the shared token.
    #[error(
        "'local' is the control plane's own data plane, which presents the control plane's token; \
         give this data plane another --node"
    )]
    Reserved,
    /// The name has a valid token already.
    #[error("node '{0}' already has its own token; revoke it first to issue another")]
    Exists(String),
    /// The name has no token to revoke.
    #[error("node '{0}' has no token of its own")]
    NotFound(String),
    /// The file could not be written; nothing changed.
    #[error("cannot write {path}: {reason}")]
    Write {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// No randomness.
    #[error("cannot generate a node token: {0}")]
    Random(String),
}

/// One name's credential, as the listing shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// The node's name.
    pub node: String,
    /// When its token was issued (Unix ms).
    pub created_unix_ms: u64,
    /// When it was revoked (Unix ms), if it was.
    pub revoked_unix_ms: Option<u64>,
}

#[derive(Default)]
struct State {
    file: File,
    /// Fired when the name's credential changes (issued or revoked), by name: handed
    /// out with each admission, replaced after it fires.
    changes: HashMap<String, CancellationToken>,
}

#[derive(Debug, Default, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    nodes: BTreeMap<String, Entry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    /// SHA-256 (hex) of the gRPC credential derived from the token; empty once revoked.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    grpc_sha256: String,
    /// SHA-256 (hex) of the admin credential derived from the token; empty once revoked.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    admin_sha256: String,
    created_unix_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    revoked_unix_ms: Option<u64>,
}

impl Entry {
    fn valid(&self) -> bool {
        self.revoked_unix_ms.is_none()
    }
}

impl NodeCredentials {
    /// The credentials kept in `state_dir` (none yet if the file does not exist). A file
    /// that exists and cannot be read is an error: serving without it would admit revoked
    /// names with the shared token and lock out every node that has its own.
    pub fn load(state_dir: &Path) -> Result<Self, String> {
        let path = state_dir.join(FILE);
        let file: File = match read(&path) {
            Ok(Some(bytes)) => serde_json::from_slice(&bytes).map_err(|error| {
                format!("{} is not a node credential file: {error}", path.display())
            })?,
            Ok(None) => File::default(),
            Err(error) => return Err(format!("cannot read {}: {error}", path.display())),
        };
        if let Some(mode) = shared_mode(&path) {
            tracing::warn!(
                path = %path.display(),
                "the node credentials are accessible by group or others (mode {mode:04o}); the next change rewrites them with mode 0600"
            );
        }
        remove_temporaries(&path);
        Ok(Self {
            path,
            state: Mutex::new(State {
                file,
                changes: HashMap::new(),
            }),
        })
    }

    /// Issues `node` its own token; returns it (the only time it is seen) and the
    /// listing row. A revoked name is issued a new one.
    pub fn add(&self, node: &str, now_unix_ms: u64) -> Result<(Secret, Listed), CredentialError> {
        check_name(node)?;
        let minted = mint().map_err(|error| CredentialError::Random(error.to_string()))?;
        let random = minted
            .expose()
            .strip_prefix(PREFIX)
            .unwrap_or(minted.expose());
        let token = Secret::new(format!("{TOKEN_PREFIX}{random}"));
        let entry = Entry {
            grpc_sha256: digest(&node_keys::grpc_credential(token.expose())),
            admin_sha256: digest(&node_keys::admin_credential(token.expose())),
            created_unix_ms: now_unix_ms,
            revoked_unix_ms: None,
        };
        let mut state = self.lock();
        if state.file.nodes.get(node).is_some_and(Entry::valid) {
            return Err(CredentialError::Exists(node.to_owned()));
        }
        let mut file = state.file.clone();
        file.nodes.insert(node.to_owned(), entry);
        self.save(&file)?;
        state.file = file;
        state.changed(node);
        Ok((
            token,
            Listed {
                node: node.to_owned(),
                created_unix_ms: now_unix_ms,
                revoked_unix_ms: None,
            },
        ))
    }

    /// Withdraws `node`'s token: from now on its calls are refused, and the signal of
    /// its admissions fires.
    pub fn revoke(&self, node: &str, now_unix_ms: u64) -> Result<(), CredentialError> {
        let mut state = self.lock();
        let mut file = state.file.clone();
        match file.nodes.get_mut(node) {
            Some(entry) if entry.valid() => {
                entry.grpc_sha256.clear();
                entry.admin_sha256.clear();
                entry.revoked_unix_ms = Some(now_unix_ms);
            }
            _ => return Err(CredentialError::NotFound(node.to_owned())),
        }
        self.save(&file)?;
        state.file = file;
        state.changed(node);
        Ok(())
    }

    /// Every name with a token of its own or a revoked one, by name.
    pub fn list(&self) -> Vec<Listed> {
        self.lock()
            .file
            .nodes
            .iter()
            .map(|(node, entry)| Listed {
                node: node.clone(),
                created_unix_ms: entry.created_unix_ms,
                revoked_unix_ms: entry.revoked_unix_ms,
            })
            .collect()
    }

    /// The names with a valid token of their own, with its issue time (Unix ms), and the
    /// names revoked.
    pub fn issued(&self) -> (BTreeMap<String, u64>, Vec<String>) {
        let state = self.lock();
        let mut valid = BTreeMap::new();
        let mut revoked = Vec::new();
        for (node, entry) in &state.file.nodes {
            if entry.valid() {
                valid.insert(node.clone(), entry.created_unix_ms);
            } else {
                revoked.push(node.clone());
            }
        }
        (valid, revoked)
    }

    /// Whether `presented` (the gRPC credential on a `PolicyService` call) is `node`'s own
    /// token, or what else.
    pub fn check(&self, node: &str, presented: &str) -> Verdict {
        self.lock().verdict(node, presented)
    }

    /// [`check`](Self::check), with a signal that fires when `node`'s credential next
    /// changes (taken under the same lock, so that no change falls between the two).
    pub fn admit(&self, node: &str, presented: &str) -> (Verdict, CancellationToken) {
        let mut state = self.lock();
        let verdict = state.verdict(node, presented);
        let changed = state.changes.entry(node.to_owned()).or_default().clone();
        (verdict, changed)
    }

    /// The node whose admin credential `presented` is, if any.
    pub fn admin_holder(&self, presented: &str) -> Option<String> {
        let presented = digest(presented);
        let state = self.lock();
        // Every entry is compared, so that the time taken does not say which matched.
        let mut holder = None;
        for (node, entry) in &state.file.nodes {
            if entry.valid() && digests_equal(&presented, &entry.admin_sha256) {
                holder = Some(node.clone());
            }
        }
        holder
    }

    fn save(&self, file: &File) -> Result<(), CredentialError> {
        let write = |reason: String| CredentialError::Write {
            path: self.path.display().to_string(),
            reason,
        };
        let mut bytes =
            serde_json::to_vec_pretty(file).map_err(|error| write(error.to_string()))?;
        bytes.push(b'\n');
        write_atomic(&self.path, &bytes).map_err(|error| write(error.to_string()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding it leaves the state as it was before the change.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl State {
    fn verdict(&self, node: &str, presented: &str) -> Verdict {
        match self.file.nodes.get(node) {
            None => Verdict::Unclaimed,
            Some(entry) if !entry.valid() => Verdict::Revoked,
            Some(entry) if digests_equal(&digest(presented), &entry.grpc_sha256) => Verdict::Own,
            Some(_) => Verdict::Wrong,
        }
    }

    /// Ends every admission under `node` made before this change.
    fn changed(&mut self, node: &str) {
        if let Some(signal) = self.changes.remove(node) {
            signal.cancel();
        }
    }
}

fn check_name(node: &str) -> Result<(), CredentialError> {
    if node == "local" {
        return Err(CredentialError::Reserved);
    }
    let valid = !node.is_empty()
        && node.len() <= MAX_NAME
        && node
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if valid {
        Ok(())
    } else {
        Err(CredentialError::InvalidName(node.to_owned()))
    }
}

fn digest(credential: &str) -> String {
    hex::encode(Sha256::digest(credential.as_bytes()))
}

/// Compares two hex digests in time independent of where they differ.
fn digests_equal(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn grpc(token: &Secret) -> String {
        node_keys::grpc_credential(token.expose())
    }

    #[test]
    fn a_token_admits_its_own_name_alone() {
        let dir = tempfile::tempdir().unwrap();
        let store = NodeCredentials::load(dir.path()).unwrap();
        let (a, row) = store.add("box-a", 1_000).unwrap();
        let (b, _) = store.add("box-b", 1_000).unwrap();
        assert!(a.expose().starts_with(TOKEN_PREFIX));
        assert_eq!(row.node, "box-a");
        assert_eq!(store.check("box-a", &grpc(&a)), Verdict::Own);
        assert_eq!(store.check("box-b", &grpc(&a)), Verdict::Wrong);
        assert_eq!(store.check("box-b", &grpc(&b)), Verdict::Own);
        // The token itself is not the credential.
        assert_eq!(store.check("box-a", a.expose()), Verdict::Wrong);
        assert_eq!(store.check("edge", &grpc(&a)), Verdict::Unclaimed);
        let admin = node_keys::admin_credential(b.expose());
        assert_eq!(store.admin_holder(&admin).as_deref(), Some("box-b"));
        assert_eq!(store.admin_holder(&grpc(&b)), None);
        assert!(matches!(
            store.add("box-a", 2_000),
            Err(CredentialError::Exists(_))
        ));
    }

    #[test]
    fn revoking_refuses_the_name_and_fires_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = NodeCredentials::load(dir.path()).unwrap();
        // A shared-token watch under the name ends when the name is issued its own.
        let (verdict, shared) = store.admit("box-a", "shared");
        assert_eq!(verdict, Verdict::Unclaimed);
        let (a, _) = store.add("box-a", 1_000).unwrap();
        assert!(shared.is_cancelled());
        let (verdict, revoked) = store.admit("box-a", &grpc(&a));
        assert_eq!(verdict, Verdict::Own);
        assert!(!revoked.is_cancelled());
        store.revoke("box-a", 5_000).unwrap();
        assert!(revoked.is_cancelled());
        assert_eq!(store.check("box-a", &grpc(&a)), Verdict::Revoked);
        assert_eq!(
            store.admin_holder(&node_keys::admin_credential(a.expose())),
            None
        );
        assert!(matches!(
            store.revoke("box-a", 6_000),
            Err(CredentialError::NotFound(_))
        ));
        assert_eq!(
            store.list(),
            [Listed {
                node: "box-a".into(),
                created_unix_ms: 1_000,
                revoked_unix_ms: Some(5_000)
            }]
        );
        // A new token for the name; the old one stays refused.
        let (again, _) = store.add("box-a", 7_000).unwrap();
        assert_eq!(store.check("box-a", &grpc(&a)), Verdict::Wrong);
        assert_eq!(store.check("box-a", &grpc(&again)), Verdict::Own);
    }

    #[test]
    fn the_file_holds_digests_only_private_and_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let store = NodeCredentials::load(dir.path()).unwrap();
        let (a, _) = store.add("box-a", 1_000).unwrap();
        store.add("box-b", 1_000).unwrap();
        store.revoke("box-b", 2_000).unwrap();
        let path = dir.path().join(FILE);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains(a.expose()), "{text}");
        assert!(!text.contains(&grpc(&a)), "{text}");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(!format!("{store:?}").contains(&digest(&grpc(&a))));
        let again = NodeCredentials::load(dir.path()).unwrap();
        assert_eq!(again.check("box-a", &grpc(&a)), Verdict::Own);
        assert_eq!(again.check("box-b", ""), Verdict::Revoked);
        std::fs::write(&path, "{not json").unwrap();
        assert!(NodeCredentials::load(dir.path()).is_err());
    }

    #[test]
    fn names_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let store = NodeCredentials::load(dir.path()).unwrap();
        for bad in ["", "a b", "a/b", &"x".repeat(65)] {
            assert!(
                matches!(store.add(bad, 1), Err(CredentialError::InvalidName(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            store.add("local", 1),
            Err(CredentialError::Reserved)
        ));
        assert!(store.list().is_empty());
        assert!(!dir.path().join(FILE).exists());
    }

    #[test]
    fn a_failed_write_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        // The state directory is a file: nothing can be written under it.
        let blocked = dir.path().join("state");
        std::fs::write(&blocked, "").unwrap();
        let store = NodeCredentials::load(&dir.path().join("absent")).unwrap();
        let store = NodeCredentials {
            path: blocked.join(FILE),
            ..store
        };
        assert!(matches!(
            store.add("box-a", 1),
            Err(CredentialError::Write { .. })
        ));
        assert!(store.list().is_empty());
        assert_eq!(store.check("box-a", ""), Verdict::Unclaimed);
    }
}
