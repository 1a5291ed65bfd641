//! What the slots could have done: an upper bound on the GPU time and tokens one data
//! plane may report. Pure: the time is passed in.
//!
//! Each node has an allowance of slot time that fills at its slots (the `max_concurrent`
//! of the hosts it may send to: its own and the unowned) per second of the control
//! plane's clock, up to [`BURST_S`] seconds of every slot (one request's whole
//! `total_duration` is reported when it ends). A node first seen starts with its slots
//! times its run time so far (from its epoch), at least [`FLOOR_S`] and at most
//! [`BURST_S`] seconds. A batch costs its GPU time, or its tokens at
//! [`TOKENS_PER_SLOT_SECOND`], whichever is more; a batch costing more than the allowance
//! has its GPU time and tokens scaled down to fit (it is still applied and acknowledged,
//! so the data plane does not resend it for ever). An allowance is a configured node's
//! own, or the one every name nobody configured shares ([`allowance`]). Request and embedding-input counts are
//! not scaled: no budget counts them.

use std::collections::HashMap;

use oqp_proto::policy::v1 as wire;

/// Seconds of every slot a node may report at once.
pub const BURST_S: u64 = 3_600;

/// Seconds of every slot a node first seen may report, however recently it started
/// (clock skew, and a batch covering requests from before the control plane knew it).
pub const FLOOR_S: u64 = 60;

/// Tokens one slot may process in a second, generously (prompt evaluation and
/// embeddings on a fast GPU).
pub const TOKENS_PER_SLOT_SECOND: u64 = 100_000;

/// Most nodes remembered; past it the least recently seen is forgotten (it starts again
/// as first seen). Only authenticated reporters reach this.
const MAX_NODES: usize = 1_024;

const NS_PER_S: u128 = 1_000_000_000;

/// Each node's allowance.
#[derive(Debug, Default)]
pub struct Bounds {
    nodes: HashMap<String, Allowance>,
}

#[derive(Debug, Clone, Copy)]
struct Allowance {
    /// Slot-nanoseconds left.
    left: u128,
    /// When it was last filled, Unix ms.
    at_ms: i64,
}

/// A batch that was cut to fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cut {
    /// What the batch cost (slot-ns).
    pub claimed: u128,
    /// What it was allowed.
    pub allowed: u128,
}

impl Bounds {
    /// Bounds `batch` from `node` (with `slots` slots, epoch `batch.epoch`) at `now_ms`,
    /// scaling its GPU time and tokens down if it costs more than the node's allowance;
    /// `Some` when it was cut. Call it only for a batch about to be applied.
    pub fn bound(
        &mut self,
        node: &str,
        slots: u64,
        batch: &mut wire::UsageBatch,
        now_ms: i64,
    ) -> Option<Cut> {
        let slots = u128::from(slots);
        let cap = slots * u128::from(BURST_S) * NS_PER_S;
        if !self.nodes.contains_key(node) && self.nodes.len() >= MAX_NODES {
            let oldest = self
                .nodes
                .iter()
                .min_by_key(|(_, allowance)| allowance.at_ms)
                .map(|(name, _)| name.clone());
            if let Some(oldest) = oldest {
                self.nodes.remove(&oldest);
            }
        }
        let allowance = self.nodes.entry(node.to_owned()).or_insert_with(|| {
            let epoch_ms = i64::try_from(batch.epoch).unwrap_or(i64::MAX);
            let run_s = u64::try_from(now_ms.saturating_sub(epoch_ms) / 1000).unwrap_or(0);
            Allowance {
                left: slots * u128::from(run_s.clamp(FLOOR_S, BURST_S)) * NS_PER_S,
                at_ms: now_ms,
            }
        });
        let elapsed_ns =
            u128::try_from(now_ms.saturating_sub(allowance.at_ms)).unwrap_or(0) * 1_000_000;
        allowance.left = allowance
            .left
            .saturating_add(slots.saturating_mul(elapsed_ns))
            .min(cap);
        allowance.at_ms = allowance.at_ms.max(now_ms);
        let claimed = cost(batch);
        if claimed <= allowance.left {
            allowance.left -= claimed;
            return None;
        }
        let allowed = allowance.left;
        allowance.left = 0;
        for row in &mut batch.rows {
            row.gpu_ns = scale(row.gpu_ns, allowed, claimed);
            row.prompt_tokens = scale(row.prompt_tokens, allowed, claimed);
            row.completion_tokens = scale(row.completion_tokens, allowed, claimed);
        }
        Some(Cut { claimed, allowed })
    }
}

/// The slot-ns a batch costs: its GPU time or its tokens' time, whichever is more.
fn cost(batch: &wire::UsageBatch) -> u128 {
    let (mut gpu, mut tokens) = (0u128, 0u128);
    for row in &batch.rows {
        gpu += u128::from(row.gpu_ns);
        tokens += u128::from(row.prompt_tokens) + u128::from(row.completion_tokens);
    }
    gpu.max(tokens * NS_PER_S / u128::from(TOKENS_PER_SLOT_SECOND))
}

fn scale(value: u64, allowed: u128, claimed: u128) -> u64 {
    u64::try_from(u128::from(value) * allowed / claimed.max(1)).unwrap_or(u64::MAX)
}

/// The allowance of every node name nobody configured.
pub const UNCONFIGURED: &str = "(unconfigured)";

/// The name of the allowance `node`'s reports draw on: its own when it is configured
/// (listed under `nodes`, or owning a host) or is `local` (the control plane's own data
/// plane); else [`UNCONFIGURED`], one allowance shared by every other name, so that a
/// reporter inventing names gets no new allowance with each (their slots are the unowned
/// hosts', which every such node shares anyway).
pub fn allowance(config: &crate::config::Config, node: &str) -> String {
    let configured = node == "local"
        || config.nodes.contains_key(node)
        || config
            .ollama
            .hosts
            .iter()
            .any(|host| host.node.as_deref() == Some(node));
    if configured {
        node.to_owned()
    } else {
        UNCONFIGURED.to_owned()
    }
}

/// The slots `node` may send to in `hosts`: the `max_concurrent` of its own and of the
/// unowned.
pub fn slots(hosts: &[crate::config::HostConfig], node: &str) -> u64 {
    hosts
        .iter()
        .filter(|host| host.node.as_deref().is_none_or(|owner| owner == node))
        .map(|host| u64::from(host.max_concurrent))
        .sum()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000_000_000;
    const NOW_MS: i64 = 1_796_191_962_000;

    fn batch(epoch_ms: i64, gpu_s: u64, tokens: u64) -> wire::UsageBatch {
        wire::UsageBatch {
            epoch: u64::try_from(epoch_ms).unwrap(),
            seq: 1,
            rows: vec![wire::UsageRow {
                client_id: "chat".into(),
                model: "m".into(),
                gpu_ns: gpu_s * SECOND,
                completion_tokens: tokens,
                requests: 3,
                ..wire::UsageRow::default()
            }],
        }
    }

    #[test]
    fn a_node_reports_at_most_what_its_slots_could_have_done() {
        let mut bounds = Bounds::default();
        // Started 10 s ago with 2 slots: the floor, 2 × 60 s.
        let mut first = batch(NOW_MS - 10_000, 100, 0);
        assert_eq!(bounds.bound("a", 2, &mut first, NOW_MS), None);
        let mut forged = batch(NOW_MS - 10_000, 10_000, 0);
        let cut = bounds.bound("a", 2, &mut forged, NOW_MS).unwrap();
        assert_eq!(cut.allowed, u128::from(20 * SECOND), "what was left");
        assert_eq!(forged.rows[0].gpu_ns, 20 * SECOND);
        assert_eq!(forged.rows[0].requests, 3, "counts are not scaled");
        // 5 s later: 2 slots × 5 s more, no more.
        let mut later = batch(NOW_MS - 10_000, 60, 0);
        bounds.bound("a", 2, &mut later, NOW_MS + 5_000).unwrap();
        assert_eq!(later.rows[0].gpu_ns, 10 * SECOND);
    }

    #[test]
    fn the_allowance_holds_at_most_an_hour_of_every_slot() {
        let mut bounds = Bounds::default();
        // Running for a day: an hour of each slot.
        let mut first = batch(NOW_MS - 86_400_000, 3 * 3_600, 0);
        assert_eq!(bounds.bound("a", 3, &mut first, NOW_MS), None);
        let mut next = batch(NOW_MS - 86_400_000, 1, 0);
        assert!(
            bounds.bound("a", 3, &mut next, NOW_MS).is_some(),
            "nothing left"
        );
        // A day idle fills it to the hour again, not to a day.
        let mut idle = batch(NOW_MS - 86_400_000, 4 * 3_600, 0);
        let cut = bounds
            .bound("a", 3, &mut idle, NOW_MS + 86_400_000)
            .unwrap();
        assert_eq!(idle.rows[0].gpu_ns, 3 * 3_600 * SECOND);
        assert_eq!(cut.allowed, u128::from(3 * 3_600 * SECOND));
    }

    #[test]
    fn tokens_are_bounded_by_the_same_slot_time() {
        let mut bounds = Bounds::default();
        // 1 slot, floor 60 s: 6,000,000 tokens at most.
        let mut forged = batch(NOW_MS, 0, 1_000_000_000);
        bounds.bound("a", 1, &mut forged, NOW_MS).unwrap();
        assert_eq!(forged.rows[0].completion_tokens, 6_000_000);
        // No slots: nothing.
        let mut none = batch(NOW_MS, 5, 5);
        bounds.bound("b", 0, &mut none, NOW_MS).unwrap();
        assert_eq!(
            (none.rows[0].gpu_ns, none.rows[0].completion_tokens),
            (0, 0)
        );
    }
}
