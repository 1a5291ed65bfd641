//! The per-node rows of `GetStatus` and the owner of each `ListHosts` row:
//! which data planes exist (listed in `nodes`, or connected), whether each
//! is linked to the control plane, and which hosts each dispatches to.
//!
//! Ownership comes from the config file (`ollama.hosts[].node`): a host
//! that names a node is dispatched to by that node's data plane only; one
//! that names none by every data plane.

use std::collections::BTreeMap;
use std::time::Duration;

use oqp_proto::admin::v1 as api;

use crate::config::Config;
use crate::hub::Node;

/// One row per node the config lists or the control plane has seen, by
/// name, with how peers reach it (`urls`: node name → URL). A listed node
/// that never connected has only its name, its hosts, its URL if the config
/// gives one, and `seen: false`.
pub(super) fn statuses(
    config: &Config,
    seen: BTreeMap<String, Node>,
    urls: &BTreeMap<String, String>,
) -> Vec<api::NodeStatus> {
    let mut rows: BTreeMap<String, api::NodeStatus> = seen
        .into_iter()
        .map(|(name, node)| {
            let status = api::NodeStatus {
                node: name.clone(),
                listen_address: node.report.listen_address.clone(),
                applied_version: node.report.applied_version,
                last_report_age_ms: node.reported_at.map_or(u64::MAX, |at| millis(at.elapsed())),
                connected: node.watches > 0,
                report: Some(node.report),
                configured: false,
                seen: true,
                owned_hosts: Vec::new(),
                url: String::new(),
            };
            (name, status)
        })
        .collect();
    for name in config.nodes.keys() {
        rows.entry(name.clone())
            .or_insert_with(|| api::NodeStatus {
                node: name.clone(),
                last_report_age_ms: u64::MAX,
                ..api::NodeStatus::default()
            })
            .configured = true;
    }
    rows.into_values()
        .map(|mut row| {
            row.owned_hosts = owned_hosts(config, &row.node);
            row.url = urls.get(&row.node).cloned().unwrap_or_default();
            row
        })
        .collect()
}

/// A warning per owner that is not connected: the hosts only it sends to
/// are out of reach of every other data plane, and the control plane cannot
/// tell whether it still serves them on its last snapshot.
pub(super) fn warnings(config: &Config, rows: &[api::NodeStatus]) -> Vec<String> {
    rows.iter()
        .filter(|row| !row.connected)
        .filter_map(|row| {
            let hosts: Vec<&str> = config
                .ollama
                .hosts
                .iter()
                .filter(|host| host.node.as_deref() == Some(row.node.as_str()))
                .map(|host| host.name.as_str())
                .collect();
            if hosts.is_empty() {
                return None;
            }
            let link = if row.seen {
                "is not connected to the control plane"
            } else {
                "has never connected to the control plane"
            };
            Some(format!(
                "node {} {link}: only it sends to {}",
                row.node,
                hosts.join(", ")
            ))
        })
        .collect()
}

/// The hosts `node` dispatches to, in config order: those naming it as
/// owner and those naming none.
pub(super) fn owned_hosts(config: &Config, node: &str) -> Vec<String> {
    config
        .ollama
        .hosts
        .iter()
        .filter(|host| host.node.as_deref().is_none_or(|owner| owner == node))
        .map(|host| host.name.clone())
        .collect()
}

/// The owner of the host named `host`; `""` when it names none (or is not
/// in the config, e.g. between a reload and the next snapshot).
pub(super) fn owner_of(config: &Config, host: &str) -> String {
    config
        .ollama
        .hosts
        .iter()
        .find(|candidate| candidate.name == host)
        .and_then(|candidate| candidate.node.clone())
        .unwrap_or_default()
}

fn millis(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Env, load_str};
    use oqp_proto::policy::v1::NodeReport;

    fn load(yaml: &str) -> Config {
        load_str(yaml, &Env::empty()).unwrap().config
    }

    /// Two listed boxes owning one host each.
    fn two_boxes() -> Config {
        let yaml = "ollama:\n  hosts:\n\
                    \x20   - {url: 'http://10.0.0.1:11434', name: gpu1, node: box1}\n\
                    \x20   - {url: 'http://10.0.0.2:11434', name: gpu2, node: box2}\n\
                    control_plane:\n  node_token: sk-node-0123456789\n\
                    nodes:\n\
                    \x20 box1: {host: 10.0.0.1, url: 'http://10.0.0.1:11435'}\n\
                    \x20 box2: {host: 10.0.0.2, url: 'http://10.0.0.2:11435'}\n";
        load(yaml)
    }

    /// One listed box owning one host, and a host with no owner.
    fn one_box_and_a_shared_host() -> Config {
        let yaml = "ollama:\n  hosts:\n\
                    \x20   - {url: 'http://10.0.0.1:11434', name: gpu1, node: box1}\n\
                    \x20   - {url: 'http://10.0.0.3:11434', name: shared}\n\
                    control_plane:\n  node_token: sk-node-0123456789\n\
                    nodes:\n  box1: {host: 10.0.0.1, url: 'http://10.0.0.1:11435'}\n";
        load(yaml)
    }

    fn connected(name: &str) -> Node {
        Node {
            report: NodeReport {
                node: name.into(),
                listen_address: "10.0.0.1:11435".into(),
                applied_version: 3,
                ..NodeReport::default()
            },
            reported_at: Some(std::time::Instant::now()),
            watches: 1,
            epochs: vec![1],
        }
    }

    #[test]
    fn a_listed_node_that_never_connected_has_a_row_with_its_hosts() {
        let config = two_boxes();
        let urls = BTreeMap::from([("box2".into(), "http://10.0.0.2:11435".into())]);
        let rows = statuses(
            &config,
            BTreeMap::from([("box1".into(), connected("box1"))]),
            &urls,
        );
        let names: Vec<&str> = rows.iter().map(|row| row.node.as_str()).collect();
        assert_eq!(names, ["box1", "box2"]);
        let (box1, box2) = (&rows[0], &rows[1]);
        assert!(box1.seen && box1.connected && box1.configured);
        assert_eq!(box1.applied_version, 3);
        assert_eq!(box1.owned_hosts, ["gpu1"]);
        assert!(!box2.seen && !box2.connected && box2.configured);
        assert_eq!(box2.last_report_age_ms, u64::MAX);
        assert!(box2.report.is_none());
        assert_eq!(box2.owned_hosts, ["gpu2"]);
        assert_eq!(box2.url, "http://10.0.0.2:11435");
        assert_eq!(box1.url, "");
    }

    #[test]
    fn an_owner_that_is_not_connected_is_a_warning() {
        let config = two_boxes();
        let mut gone = connected("box1");
        gone.watches = 0;
        let rows = statuses(
            &config,
            BTreeMap::from([("box1".into(), gone)]),
            &BTreeMap::new(),
        );
        assert_eq!(
            warnings(&config, &rows),
            [
                "node box1 is not connected to the control plane: only it sends to gpu1",
                "node box2 has never connected to the control plane: only it sends to gpu2",
            ]
        );
        let rows = statuses(
            &config,
            BTreeMap::from([
                ("box1".into(), connected("box1")),
                ("box2".into(), connected("box2")),
            ]),
            &BTreeMap::new(),
        );
        assert!(warnings(&config, &rows).is_empty());
        // A node that owns nothing of its own (an edge, or every data plane
        // of a single box) is nobody's only way to a host.
        let config = one_box_and_a_shared_host();
        let mut laptop = connected("laptop");
        laptop.watches = 0;
        let rows = statuses(
            &config,
            BTreeMap::from([
                ("box1".into(), connected("box1")),
                ("laptop".into(), laptop),
            ]),
            &BTreeMap::new(),
        );
        assert!(warnings(&config, &rows).is_empty());
    }

    #[test]
    fn an_unlisted_node_that_connected_is_shown_and_owns_the_unowned_hosts() {
        let config = one_box_and_a_shared_host();
        let mut gone = connected("laptop");
        gone.watches = 0;
        let rows = statuses(
            &config,
            BTreeMap::from([("laptop".into(), gone)]),
            &BTreeMap::new(),
        );
        let names: Vec<&str> = rows.iter().map(|row| row.node.as_str()).collect();
        assert_eq!(names, ["box1", "laptop"]);
        assert_eq!(rows[0].owned_hosts, ["gpu1", "shared"]);
        let laptop = &rows[1];
        assert!(laptop.seen && !laptop.connected && !laptop.configured);
        assert_eq!(laptop.owned_hosts, ["shared"]);
    }

    #[test]
    fn without_owners_every_node_dispatches_to_every_host() {
        let yaml = "ollama:\n  hosts:\n    - {url: 'http://127.0.0.1:9', name: a}\n\
                    \x20   - {url: 'http://127.0.0.1:8', name: b}\n";
        let config = load(yaml);
        let rows = statuses(
            &config,
            BTreeMap::from([("local".into(), connected("local"))]),
            &BTreeMap::new(),
        );
        assert_eq!(rows[0].owned_hosts, ["a", "b"]);
        assert_eq!(owner_of(&config, "a"), "");
        let config = one_box_and_a_shared_host();
        assert_eq!(owner_of(&config, "gpu1"), "box1");
        assert_eq!(owner_of(&config, "shared"), "");
        assert_eq!(owner_of(&config, "gone"), "");
    }
}
