//! `oqpctl status`: the control plane, then one row per node: its link to
//! the control plane, how its peers reach it, the hosts it dispatches to,
//! its queue and what it forwarded to each peer, as its last report gave
//! them.

use std::time::Duration;

use oqp_proto::admin::v1 as api;
use serde_json::{Value, json};

use super::{Grid, Output, Style, age, list, millis_age, pretty, table, yes_no};

/// `oqpctl status`.
pub fn status(response: &api::GetStatusResponse, output: Output, style: Style) -> String {
    match output {
        Output::Json => {
            let nodes: Vec<Value> = response
                .nodes
                .iter()
                .map(|node| node_json(node, response.snapshot_version))
                .collect();
            pretty(&json!({
                "control_plane": {
                    "version": response.software_version,
                    "uptime_seconds": response.uptime_seconds,
                    "snapshot_version": response.snapshot_version,
                    "hosts_healthy": response.hosts_healthy,
                    "hosts_total": response.hosts_total,
                    "paused_tiers": response.paused_tiers,
                    "warnings": response.warnings,
                },
                "nodes": nodes,
            }))
        }
        Output::Table => {
            let mut out = format!(
                "control plane {}, up {}, snapshot {}\nhosts: {}/{} healthy",
                response.software_version,
                age(Some(Duration::from_secs(response.uptime_seconds))),
                response.snapshot_version,
                response.hosts_healthy,
                response.hosts_total,
            );
            if !response.paused_tiers.is_empty() {
                out.push_str(&format!(
                    "\npaused tiers: {}",
                    response.paused_tiers.join(", ")
                ));
            }
            for warning in &response.warnings {
                out.push('\n');
                out.push_str(&super::wrap(&format!("warning: {warning}"), style));
            }
            if response.nodes.is_empty() {
                out.push_str("\nno data plane has connected yet");
                return out;
            }
            format!("{out}\n{}", nodes_table(response, style))
        }
    }
}

/// The nodes, one row each; a terminal gets every column but the URL and the snapshot
/// version (`in sync` says whether it is the current one), which `--wide` adds.
fn nodes_table(response: &api::GetStatusResponse, style: Style) -> Grid {
    const WIDE_ONLY: [usize; 2] = [3, 4];
    let narrow = |row: Vec<String>| -> Vec<String> {
        if style.wide() {
            return row;
        }
        row.into_iter()
            .enumerate()
            .filter(|(index, _)| !WIDE_ONLY.contains(index))
            .map(|(_, cell)| cell)
            .collect()
    };
    let header = narrow(
        [
            "node",
            "link",
            "last report",
            "url",
            "snapshot",
            "in sync",
            "owns",
            "waiting high / normal / low",
            "in flight",
            "forwarded",
        ]
        .map(str::to_owned)
        .to_vec(),
    );
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    let mut nodes = table(style, &header);
    for node in &response.nodes {
        let Some(report) = node.report.as_ref().filter(|_| seen(node)) else {
            nodes.add_row(narrow(vec![
                node.node.clone(),
                link(node).to_owned(),
                "-".to_owned(),
                or_dash(&node.url),
                "-".to_owned(),
                "-".to_owned(),
                list(&node.owned_hosts),
                "-".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
            ]));
            continue;
        };
        let [high, normal, low] = waiting(report);
        nodes.add_row(narrow(vec![
            node.node.clone(),
            link(node).to_owned(),
            age(millis_age(node.last_report_age_ms)),
            if node.url.is_empty() {
                or_dash(&node.listen_address)
            } else {
                node.url.clone()
            },
            node.applied_version.to_string(),
            yes_no(node.applied_version == response.snapshot_version).to_owned(),
            list(&node.owned_hosts),
            format!("{high}/{normal}/{low}"),
            report.active.to_string(),
            forwarded(report),
        ]));
    }
    nodes
}

/// Requests forwarded to each peer, e.g. `box2 12, box3 1`.
fn forwarded(report: &oqp_proto::policy::v1::NodeReport) -> String {
    let peers: Vec<String> = report
        .forwarded
        .iter()
        .filter(|peer| peer.forwarded > 0)
        .map(|peer| format!("{} {}", peer.node, peer.forwarded))
        .collect();
    list(&peers)
}

fn or_dash(text: &str) -> String {
    if text.is_empty() {
        "-".to_owned()
    } else {
        text.to_owned()
    }
}

fn node_json(node: &api::NodeStatus, snapshot_version: u64) -> Value {
    let report = node.report.clone().unwrap_or_default();
    let [high, normal, low] = waiting(&report);
    json!({
        "node": node.node,
        "link": link(node),
        "configured": node.configured,
        "owns": node.owned_hosts,
        "address": node.listen_address,
        "url": (!node.url.is_empty()).then_some(&node.url),
        "applied_version": node.applied_version,
        "in_sync": seen(node) && node.applied_version == snapshot_version,
        "last_report_age_ms": (node.last_report_age_ms != u64::MAX).then_some(node.last_report_age_ms),
        "connected": node.connected,
        "active": report.active,
        "queued": high + normal + low,
        "waiting": {"high": high, "normal": normal, "low": low},
        "forwarded": report
            .forwarded
            .iter()
            .map(|peer| (peer.node.clone(), json!(peer.forwarded)))
            .collect::<serde_json::Map<_, _>>(),
        "uptime_seconds": report.uptime_seconds,
        "rejected_version": (report.rejected_version != 0).then_some(report.rejected_version),
        "rejected_reason": (!report.rejected_reason.is_empty()).then_some(report.rejected_reason),
        "apply_errors": report.apply_errors,
        "stale_version": (report.stale_version != 0).then_some(report.stale_version),
    })
}

/// Whether the node ever connected. A control plane older than `seen`
/// sends a report for every node it lists, and lists only those it saw.
fn seen(node: &api::NodeStatus) -> bool {
    node.seen || node.report.is_some()
}

/// The node's link to the control plane.
fn link(node: &api::NodeStatus) -> &'static str {
    if !seen(node) {
        "never connected"
    } else if node.connected {
        "connected"
    } else {
        "disconnected"
    }
}

/// Waiting requests per tier (high, normal, low) in the node's last report.
fn waiting(report: &oqp_proto::policy::v1::NodeReport) -> [u32; 3] {
    let mut depths = [0; 3];
    for (slot, tier) in depths.iter_mut().zip(&report.tiers) {
        *slot = tier.depth;
    }
    depths
}

#[cfg(test)]
mod tests {
    use super::*;
    use oqp_proto::policy::v1 as wire;

    const PLAIN: Style = Style::PLAIN;

    fn sample_status() -> api::GetStatusResponse {
        api::GetStatusResponse {
            software_version: "0.1.0".into(),
            uptime_seconds: 3725,
            snapshot_version: 42,
            nodes: vec![api::NodeStatus {
                node: "gpu1".into(),
                listen_address: "127.0.0.1:11435".into(),
                applied_version: 42,
                last_report_age_ms: 800,
                connected: true,
                report: Some(wire::NodeReport {
                    active: 2,
                    tiers: vec![wire::TierReport {
                        depth: 3,
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
                configured: false,
                seen: true,
                owned_hosts: vec!["local".into()],
                url: String::new(),
            }],
            hosts_total: 2,
            hosts_healthy: 1,
            warnings: vec![],
            paused_tiers: vec!["low".into()],
        }
    }

    /// Two boxes: `box1` connected with a queue, `box2` listed but never
    /// connected, and `laptop`, seen once and gone.
    fn two_boxes() -> api::GetStatusResponse {
        let tiers = [1, 4, 9]
            .into_iter()
            .map(|depth| wire::TierReport {
                depth,
                ..Default::default()
            })
            .collect();
        let box1 = api::NodeStatus {
            node: "box1".into(),
            listen_address: "192.168.1.11:11434".into(),
            applied_version: 42,
            last_report_age_ms: 700,
            connected: true,
            report: Some(wire::NodeReport {
                active: 5,
                tiers,
                forwarded: vec![
                    wire::PeerForwarded {
                        node: "box2".into(),
                        forwarded: 12,
                    },
                    wire::PeerForwarded {
                        node: "box3".into(),
                        forwarded: 0,
                    },
                ],
                ..Default::default()
            }),
            configured: true,
            seen: true,
            owned_hosts: vec!["gpu1".into()],
            url: "http://192.168.1.11:11434".into(),
        };
        let box2 = api::NodeStatus {
            node: "box2".into(),
            last_report_age_ms: u64::MAX,
            configured: true,
            owned_hosts: vec!["gpu2".into(), "gpu3".into()],
            url: "http://192.168.1.12:11434".into(),
            ..Default::default()
        };
        let laptop = api::NodeStatus {
            node: "laptop".into(),
            applied_version: 40,
            last_report_age_ms: 125_000,
            report: Some(wire::NodeReport::default()),
            seen: true,
            ..Default::default()
        };
        api::GetStatusResponse {
            snapshot_version: 42,
            nodes: vec![box1, box2, laptop],
            ..sample_status()
        }
    }

    fn row(text: &str, node: &str) -> String {
        text.lines()
            .find(|line| line.starts_with(&format!("| {node} ")))
            .unwrap_or_else(|| panic!("no row for {node}:\n{text}"))
            .to_owned()
    }

    #[test]
    fn status_table_shows_every_node() {
        let text = status(&sample_status(), Output::Table, PLAIN);
        assert!(text.contains("snapshot 42"));
        assert!(text.contains("hosts: 1/2 healthy"));
        assert!(text.contains("paused tiers: low"));
        assert!(text.contains("gpu1"));
        assert!(text.contains("127.0.0.1:11435"));
        assert!(text.contains("1h 2m"));
    }

    #[test]
    fn a_terminal_gets_the_nodes_without_url_and_version_words_whole() {
        let style = Style {
            color: false,
            width: super::super::Width::Fit(80),
        };
        let text = status(&two_boxes(), Output::Table, style);
        assert!(
            text.lines().all(|line| line.chars().count() <= 80),
            "{text}"
        );
        assert!(
            !text.contains("192.168.1.11"),
            "the URL is for --wide: {text}"
        );
        for word in ["connected", "disconnected", "forwarded"] {
            assert!(
                text.split(['|', ' ']).any(|cell| cell == word),
                "{word} split: {text}"
            );
        }
    }

    #[test]
    fn status_table_shows_each_nodes_link_hosts_and_queue() {
        let text = status(&two_boxes(), Output::Table, PLAIN);
        assert!(text.contains("waiting high / normal / low"), "{text}");
        let box1 = row(&text, "box1");
        for cell in [
            "connected",
            "0s",
            "http://192.168.1.11:11434",
            "gpu1",
            "1/4/9",
            " 5 ",
            "yes",
            "box2 12",
        ] {
            assert!(box1.contains(cell), "{cell} in {box1}");
        }
        let box2 = row(&text, "box2");
        assert!(box2.contains("never connected"), "{box2}");
        assert!(box2.contains("gpu2, gpu3"), "{box2}");
        assert!(!box2.contains("0/0/0"), "{box2}");
        assert!(box2.contains("http://192.168.1.12:11434"), "{box2}");
        assert!(!box1.contains("box3"), "{box1}");
        let laptop = row(&text, "laptop");
        assert!(
            laptop.contains("disconnected") && laptop.contains("2m 5s"),
            "{laptop}"
        );
        assert!(laptop.contains(" no "), "{laptop}");
    }

    #[test]
    fn status_json_is_machine_readable() {
        let value: Value =
            serde_json::from_str(&status(&sample_status(), Output::Json, PLAIN)).unwrap();
        assert_eq!(value["control_plane"]["snapshot_version"], 42);
        assert_eq!(value["nodes"][0]["in_sync"], true);
        assert_eq!(value["nodes"][0]["queued"], 3);
        assert_eq!(value["nodes"][0]["active"], 2);
        assert_eq!(value["nodes"][0]["apply_errors"], json!([]));
        assert_eq!(value["nodes"][0]["stale_version"], Value::Null);

        let mut failing = sample_status();
        let report = failing.nodes[0].report.as_mut().unwrap();
        report.apply_errors = vec!["metrics: snapshot 42 panicked: boom".into()];
        report.stale_version = 7;
        let value: Value = serde_json::from_str(&status(&failing, Output::Json, PLAIN)).unwrap();
        assert_eq!(
            value["nodes"][0]["apply_errors"],
            json!(["metrics: snapshot 42 panicked: boom"])
        );
        assert_eq!(value["nodes"][0]["stale_version"], 7);
    }

    #[test]
    fn status_json_gives_each_nodes_link_hosts_and_queue() {
        let value: Value =
            serde_json::from_str(&status(&two_boxes(), Output::Json, PLAIN)).unwrap();
        let box1 = &value["nodes"][0];
        assert_eq!(box1["link"], "connected");
        assert_eq!(box1["configured"], true);
        assert_eq!(box1["owns"], json!(["gpu1"]));
        assert_eq!(box1["waiting"], json!({"high": 1, "normal": 4, "low": 9}));
        assert_eq!(box1["queued"], 14);
        assert_eq!(box1["active"], 5);
        assert_eq!(box1["url"], "http://192.168.1.11:11434");
        assert_eq!(box1["forwarded"], json!({"box2": 12, "box3": 0}));
        let box2 = &value["nodes"][1];
        assert_eq!(box2["link"], "never connected");
        assert_eq!(box2["owns"], json!(["gpu2", "gpu3"]));
        assert_eq!(box2["last_report_age_ms"], Value::Null);
        assert_eq!(box2["in_sync"], false);
        assert_eq!(box2["forwarded"], json!({}));
        assert_eq!(value["nodes"][2]["link"], "disconnected");
        assert_eq!(value["nodes"][2]["configured"], false);
    }

    #[test]
    fn a_node_from_an_older_control_plane_counts_as_seen() {
        let mut response = sample_status();
        response.nodes[0].seen = false;
        response.nodes[0].connected = false;
        let text = status(&response, Output::Table, PLAIN);
        assert!(row(&text, "gpu1").contains("disconnected"), "{text}");
    }
}
