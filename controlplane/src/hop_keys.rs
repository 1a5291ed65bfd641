//! The keys of the identity hop between data planes, per pair of nodes.
//!
//! On the shared node token every data plane derives one hop key from the token
//! ([`oqp_dataplane::node_keys::hop_key`]): any holder can sign a hop as anyone, to
//! anyone. A node with its own token ([`crate::node_credentials`]) shares no secret with its
//! peers, so the control plane keys its hops instead: from a root only it holds
//! (`state_dir/hop_root`, 0600, minted once and written before the first pair key leaves,
//! so that a restart keys every pair as before), for each ordered pair of nodes in the roster
//! a key ([`oqp_dataplane::node_keys::hop_pair_key`]) that it sends to both sides of the
//! pair in their snapshots (`hop_peers`): the edge signs with it, the owner verifies with
//! it. A node thus holds only keys that involve itself: a leaked token (and the snapshot it
//! fetches) lets its holder assert clients to peers as that node alone, until revoked;
//! revoking a node removes it from the roster, so every peer stops accepting its hops as
//! soon as it applies the next snapshot (published at once), and a name issued a new
//! token has new keys with everyone.
//!
//! The roster: the nodes the config lists (`nodes`), the owners its hosts name, and the
//! names with a token of their own, less those revoked. Only pairs with at least one side
//! on its own token get keys: two nodes on the shared token go on keying their hops with
//! the token's key. A node outside it (an unlisted edge
//! on the shared token) gets no pair keys and hops as before, on the token's key, which a
//! peer on the shared token still accepts; a node with its own token accepts only pair
//! keys, so an edge that hops to it must be in the roster.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use oqp_dataplane::node_keys::hop_pair_key;
use oqp_proto::policy::v1 as wire;

use crate::config::{Config, Secret};
use crate::node_credentials::NodeCredentials;
use crate::node_token;
use crate::state_file::write_atomic;

/// The file in the state directory.
pub const FILE: &str = "hop_root";

/// The control plane's hop root. Prints as `HopKeys(…)`.
pub struct HopKeys {
    root: Secret,
    /// The root's file while the root is not in it yet (no state directory at start).
    unsaved: Mutex<Option<PathBuf>>,
}

impl std::fmt::Debug for HopKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HopKeys(…)")
    }
}

impl HopKeys {
    /// The root kept in `state_dir`, or a new one: saved there when the directory exists,
    /// else when the first pair keys are handed out (a node was issued its own token, which
    /// created the directory), before they leave.
    pub fn load_or_mint(state_dir: &Path) -> Result<Self, String> {
        let file = state_dir.join(FILE);
        let root = node_token::load_or_mint_at(&file, state_dir)?;
        let unsaved = (!file.exists()).then_some(file);
        Ok(Self {
            root,
            unsaved: Mutex::new(unsaved),
        })
    }

    /// Writes the root to its file if it is not there yet. A failure is logged and tried
    /// again at the next snapshot: the keys hold for this run, and change at a restart.
    fn keep(&self) {
        let mut unsaved = self.unsaved.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(file) = unsaved.as_ref() else {
            return;
        };
        match write_atomic(file, format!("{}\n", self.root.expose()).as_bytes()) {
            Ok(()) => *unsaved = None,
            Err(error) => tracing::error!(
                path = %file.display(),
                %error,
                "cannot write the hop root; a restart will key the hops between nodes anew"
            ),
        }
    }

    /// Sets `snapshot.hop_peers` for `node`: a pair of keys with every other node of the
    /// roster, or none if `node` is not in it.
    pub fn fill(
        &self,
        snapshot: &mut wire::PolicySnapshot,
        config: &Config,
        credentials: &NodeCredentials,
        node: &str,
    ) {
        let roster = roster(config, credentials);
        let Some(&issued) = roster.get(node) else {
            snapshot.hop_peers.clear();
            return;
        };
        let root = self.root.expose().as_bytes();
        // Only pairs with a side on its own token: two nodes on the shared token key their
        // hops with the token's key, as they always did (unchanged across restarts).
        snapshot.hop_peers = roster
            .iter()
            .filter(|(peer, _)| peer.as_str() != node)
            .filter(|(_, peer_issued)| issued > 0 || **peer_issued > 0)
            .map(|(peer, &peer_issued)| wire::HopPeer {
                node: peer.clone(),
                sign: hop_pair_key(root, (node, issued), (peer, peer_issued)).to_vec(),
                verify: hop_pair_key(root, (peer, peer_issued), (node, issued)).to_vec(),
            })
            .collect();
        if !snapshot.hop_peers.is_empty() {
            self.keep();
        }
    }
}

/// Every node that gets pair keys, with the issue time of its own token (0 for none).
fn roster(config: &Config, credentials: &NodeCredentials) -> BTreeMap<String, u64> {
    let (issued, revoked) = credentials.issued();
    let mut roster: BTreeMap<String, u64> = config
        .nodes
        .keys()
        .cloned()
        .chain(
            config
                .ollama
                .hosts
                .iter()
                .filter_map(|host| host.node.clone()),
        )
        .map(|name| (name, 0))
        .collect();
    roster.extend(issued);
    for name in revoked {
        roster.remove(&name);
    }
    roster
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::config::{Env, load_str};

    fn config() -> Config {
        let yaml = "ollama:\n  hosts:\n\
                    \x20   - {url: 'http://10.0.0.1:11434', name: gpu1, node: box1}\n\
                    \x20   - {url: 'http://10.0.0.2:11434', name: gpu2, node: box2}\n\
                    control_plane:\n  node_token: sk-node-0123456789\n\
                    nodes:\n\
                    \x20 box1: {host: 10.0.0.1, url: 'http://10.0.0.1:11435'}\n\
                    \x20 box2: {host: 10.0.0.2, url: 'http://10.0.0.2:11435'}\n";
        load_str(yaml, &Env::empty()).unwrap().config
    }

    fn peers(snapshot: &wire::PolicySnapshot) -> Vec<&str> {
        snapshot
            .hop_peers
            .iter()
            .map(|peer| peer.node.as_str())
            .collect()
    }

    #[test]
    fn each_side_of_a_pair_holds_the_same_key_and_only_its_own_pairs() {
        let dir = tempfile::tempdir().unwrap();
        let keys = HopKeys::load_or_mint(dir.path()).unwrap();
        let credentials = NodeCredentials::load(dir.path()).unwrap();
        credentials.add("edge", 1_000).unwrap();
        let config = config();
        let snapshot = |node: &str| {
            let mut snapshot = wire::PolicySnapshot::default();
            keys.fill(&mut snapshot, &config, &credentials, node);
            snapshot
        };
        let (box1, box2, edge) = (snapshot("box1"), snapshot("box2"), snapshot("edge"));
        assert_eq!(peers(&box1), ["edge"], "box2 is on the shared token too");
        assert_eq!(peers(&edge), ["box1", "box2"]);
        let edge_to_box1 = &edge.hop_peers[0];
        let box1_from_edge = &box1.hop_peers[0];
        assert_eq!(edge_to_box1.sign, box1_from_edge.verify);
        assert_eq!(edge_to_box1.verify, box1_from_edge.sign);
        assert_ne!(edge_to_box1.sign, edge_to_box1.verify);
        assert_ne!(box2.hop_peers[0].verify, box1_from_edge.verify);
        assert!(snapshot("laptop").hop_peers.is_empty(), "not in the roster");

        // Revoked: out of every peer's snapshot; issued again: new keys.
        credentials.revoke("edge", 2_000).unwrap();
        assert!(snapshot("box1").hop_peers.is_empty());
        assert!(snapshot("edge").hop_peers.is_empty());
        credentials.add("edge", 3_000).unwrap();
        let renewed = snapshot("box1");
        assert_eq!(peers(&renewed), ["edge"]);
        assert_ne!(renewed.hop_peers[0].verify, box1_from_edge.verify);

        // The root survives a restart.
        let again = HopKeys::load_or_mint(dir.path()).unwrap();
        let mut snapshot = wire::PolicySnapshot::default();
        again.fill(&mut snapshot, &config, &credentials, "box1");
        assert_eq!(snapshot.hop_peers, renewed.hop_peers);
        assert_eq!(format!("{again:?}"), "HopKeys(…)");
    }

    #[test]
    fn a_root_minted_without_a_state_directory_is_kept_with_the_first_node_token() {
        use std::os::unix::fs::PermissionsExt;

        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("state");
        let keys = HopKeys::load_or_mint(&dir).unwrap();
        let credentials = NodeCredentials::load(&dir).unwrap();
        let config = config();
        let mut before = wire::PolicySnapshot::default();
        keys.fill(&mut before, &config, &credentials, "box1");
        assert!(before.hop_peers.is_empty());
        assert!(!dir.exists(), "no pair key yet, nothing written");

        // `nodes add` creates the directory; the root is written before a key leaves.
        credentials.add("edge", 1_000).unwrap();
        credentials.add("edge2", 2_000).unwrap();
        let mut issued = wire::PolicySnapshot::default();
        keys.fill(&mut issued, &config, &credentials, "edge");
        assert_eq!(peers(&issued), ["box1", "box2", "edge2"]);
        let mode = std::fs::metadata(dir.join(FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);

        // A restart keys the pair as before: hops signed with the old keys still verify.
        let restarted = HopKeys::load_or_mint(&dir).unwrap();
        let credentials = NodeCredentials::load(&dir).unwrap();
        for node in ["edge", "edge2", "box1"] {
            let (mut old, mut new) = Default::default();
            keys.fill(&mut old, &config, &credentials, node);
            restarted.fill(&mut new, &config, &credentials, node);
            assert_eq!(new.hop_peers, old.hop_peers, "{node}");
        }
    }
}
