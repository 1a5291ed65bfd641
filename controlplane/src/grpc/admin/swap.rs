//! One host's VRAM as `ListHosts` shows it: what is resident, the capacity, and the requests held
//! back for a model switch, merged from the snapshot (the control plane's poll and config) and
//! the data planes' reports.

use std::collections::BTreeMap;

use oqp_proto::admin::v1 as api;
use oqp_proto::policy::v1 as wire;

use crate::hub::Node;

/// Fills the VRAM fields of `info` for `host`, whose owner is `owner` (`""` = every node).
///
/// Resident models come from the reporting data plane, which corrects them from its own
/// responses between polls, else from the control plane's last poll. The capacity is the
/// configured one, else the learned one reported. Held requests and switches add up over the
/// nodes that dispatch to the host (the owner alone when it has one).
pub(super) fn fill(
    info: &mut api::HostInfo,
    host: &wire::Host,
    owner: &str,
    nodes: &BTreeMap<String, Node>,
) {
    let mut reports: Vec<(&Node, &wire::HostSwapReport)> = nodes
        .iter()
        .filter(|(name, _)| owner.is_empty() || name.as_str() == owner)
        .flat_map(|(_, node)| {
            node.report
                .hosts
                .iter()
                .filter(|report| report.name == host.name)
                .filter_map(move |report| Some((node, report.swap.as_ref()?)))
        })
        .collect();
    // The freshest report first: it speaks for what is resident now.
    reports.sort_by_key(|(node, _)| std::cmp::Reverse(node.reported_at));
    let latest = reports.first().map(|(_, swap)| *swap);

    info.resident = match latest {
        Some(swap) => swap.resident.clone(),
        None => host.resident.clone(),
    };
    (info.vram_bytes, info.vram_learned) = match (host.vram_bytes, latest) {
        (0, Some(swap)) if swap.capacity_bytes > 0 => (swap.capacity_bytes, swap.capacity_learned),
        (configured, _) => (configured, false),
    };
    info.held = reports.iter().map(|(_, swap)| swap.held).sum();
    info.oldest_held_ms = reports
        .iter()
        .map(|(_, swap)| swap.oldest_held_ms)
        .max()
        .unwrap_or(0);
    info.switching_to = latest
        .map(|swap| swap.switching_to.clone())
        .unwrap_or_default();
    info.swap_bypassed = reports.iter().any(|(_, swap)| swap.bypassed);
    info.switches = reports.iter().map(|(_, swap)| swap.switches).sum();
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::time::Duration;

    use std::time::Instant;

    use super::*;

    fn size(name: &str, bytes: u64) -> wire::ModelSize {
        wire::ModelSize {
            name: name.to_owned(),
            bytes,
        }
    }

    fn node(name: &str, age: Duration, swap: Option<wire::HostSwapReport>) -> (String, Node) {
        let report = wire::NodeReport {
            node: name.to_owned(),
            hosts: vec![wire::HostReport {
                name: "gpu".to_owned(),
                swap,
                ..wire::HostReport::default()
            }],
            ..wire::NodeReport::default()
        };
        let node = Node {
            report,
            reported_at: Instant::now().checked_sub(age),
            watches: 1,
            epochs: vec![1],
        };
        (name.to_owned(), node)
    }

    fn polled(vram_bytes: u64) -> wire::Host {
        wire::Host {
            name: "gpu".to_owned(),
            vram_bytes,
            resident: vec![size("polled:1b", 1_000)],
            ..wire::Host::default()
        }
    }

    #[test]
    fn without_reports_the_poll_and_the_config_speak() {
        let mut info = api::HostInfo::default();
        fill(&mut info, &polled(24 << 30), "", &BTreeMap::new());
        assert_eq!(info.resident, [size("polled:1b", 1_000)]);
        assert_eq!((info.vram_bytes, info.vram_learned), (24 << 30, false));
        assert_eq!((info.held, info.oldest_held_ms), (0, 0));
        // A report without swap state (an older data plane) changes nothing.
        let nodes = BTreeMap::from([node("n1", Duration::ZERO, None)]);
        let mut info = api::HostInfo::default();
        fill(&mut info, &polled(0), "n1", &nodes);
        assert_eq!(info.resident, [size("polled:1b", 1_000)]);
        assert_eq!((info.vram_bytes, info.vram_learned), (0, false));
    }

    #[test]
    fn the_owner_report_wins_and_a_configured_capacity_stays() {
        let owner = wire::HostSwapReport {
            resident: vec![size("llama3:8b", 5_000)],
            capacity_bytes: 16 << 30,
            capacity_learned: true,
            held: 2,
            oldest_held_ms: 3_100,
            switching_to: "qwen3:8b".to_owned(),
            switches: 4,
            bypassed: false,
            loads: 0,
        };
        let other = wire::HostSwapReport {
            held: 7,
            bypassed: true,
            ..wire::HostSwapReport::default()
        };
        let nodes = BTreeMap::from([
            node("n1", Duration::from_millis(500), Some(owner)),
            node("n2", Duration::ZERO, Some(other)),
        ]);
        let mut info = api::HostInfo::default();
        fill(&mut info, &polled(0), "n1", &nodes);
        assert_eq!(info.resident, [size("llama3:8b", 5_000)]);
        assert_eq!((info.vram_bytes, info.vram_learned), (16 << 30, true));
        assert_eq!((info.held, info.oldest_held_ms), (2, 3_100));
        assert_eq!(info.switching_to, "qwen3:8b");
        assert!(!info.swap_bypassed);
        assert_eq!(info.switches, 4);

        let mut info = api::HostInfo::default();
        fill(&mut info, &polled(24 << 30), "n1", &nodes);
        assert_eq!((info.vram_bytes, info.vram_learned), (24 << 30, false));

        // No owner: every node dispatches; the freshest report says what is resident.
        let mut info = api::HostInfo::default();
        fill(&mut info, &polled(0), "", &nodes);
        assert!(info.resident.is_empty());
        assert_eq!((info.held, info.switches), (9, 4));
        assert!(info.swap_bypassed);
    }
}
