//! Which GPU box a request goes to when hosts have owners: this node (its
//! own dispatcher) or the node that owns a better host (forwarded).
//!
//! A pure function of what the edge knows: its own hosts' slots and queue
//! (live), and every other node's as reported through the control plane
//! (about a second old). It ranks hosts as the router does:
//!
//! 1. candidates are the usable hosts (healthy, and for another node's host,
//!    that node known and answering); none usable: every host;
//! 2. when any candidate has the model, only those that have it;
//! 3. boxes with a free slot (free slots beyond what already waits there)
//!    first, then the model loaded before installed, then the lighter load
//!    ((in use + waiting) / slots);
//! 4. ties by smooth weighted round-robin over the hosts' weights.
//!
//! The result is the order to try the boxes in: the edge moves to the next
//! one when a box refuses (queue full, its hosts failed) or cannot be
//! reached, before any byte of an answer.

use std::collections::HashMap;
use std::sync::Arc;

use crate::policy::{Host, Strategy};
use crate::router::model_rank;

/// A box to try.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// This node's own dispatcher.
    Local,
    /// Forward to this node.
    Peer(Arc<str>),
}

/// One host as the edge sees it.
#[derive(Debug, Clone)]
pub struct Seen<'a> {
    /// The host.
    pub host: &'a Host,
    /// Whose dispatcher sends to it.
    pub target: Target,
    /// Slots in use.
    pub in_use: u32,
    /// Healthy, and its owner reachable.
    pub usable: bool,
}

/// What the edge knows of every box.
#[derive(Debug, Clone, Default)]
pub struct View<'a> {
    /// Every host, this node's and its peers'.
    pub hosts: Vec<Seen<'a>>,
    /// Requests waiting per box.
    pub waiting: HashMap<Target, u32>,
}

impl std::hash::Hash for Target {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        match self {
            Target::Local => state.write_u8(0),
            Target::Peer(name) => name.hash(state),
        }
    }
}

/// The smooth weighted round-robin position of each box, kept across requests.
#[derive(Debug, Default)]
pub struct Rotation(HashMap<Target, i64>);

#[derive(Debug)]
struct Candidate {
    target: Target,
    free: bool,
    rank: u8,
    load: f64,
    weight: i64,
}

/// The boxes to try for `model`, best first.
pub fn order(
    view: &View<'_>,
    model: Option<&str>,
    strategy: Strategy,
    rotation: &mut Rotation,
) -> Vec<Target> {
    order_for(view, model, strategy, rotation, None)
}

/// [`order`] for a conversation: `home` is its root hash and this node's name. Among the
/// free boxes of the best rank, the one the root hashes highest with (rendezvous hashing) goes
/// first, so that every turn of a conversation, entering at any data plane, goes to the same
/// box, whose owner's prefix index then picks the host; a box that is not free is skipped
/// (the turn spills to the usual order).
pub fn order_for(
    view: &View<'_>,
    model: Option<&str>,
    strategy: Strategy,
    rotation: &mut Rotation,
    home: Option<(u64, &str)>,
) -> Vec<Target> {
    let any_usable = view.hosts.iter().any(|seen| seen.usable);
    let candidates: Vec<(&Seen<'_>, u8)> = view
        .hosts
        .iter()
        .filter(|seen| !any_usable || seen.usable)
        .map(|seen| {
            let rank = match (strategy, model) {
                (Strategy::ModelAware, Some(model)) => model_rank(seen.host, model),
                _ => 0,
            };
            (seen, rank)
        })
        .collect();
    let anyone_has_it = candidates.iter().any(|(_, rank)| *rank > 0);
    let mut boxes: Vec<Candidate> = Vec::new();
    let mut slots: HashMap<Target, (u32, u32)> = HashMap::new();
    for (seen, rank) in candidates {
        if anyone_has_it && rank == 0 {
            continue;
        }
        let (in_use, max) = slots.entry(seen.target.clone()).or_default();
        *in_use += seen.in_use;
        *max += seen.host.max_concurrent;
        match boxes.iter_mut().find(|b| b.target == seen.target) {
            Some(b) => {
                b.rank = b.rank.max(rank);
                b.weight += i64::from(seen.host.weight.max(1));
            }
            None => boxes.push(Candidate {
                target: seen.target.clone(),
                free: false,
                rank,
                load: 0.0,
                weight: i64::from(seen.host.weight.max(1)),
            }),
        }
    }
    for b in &mut boxes {
        let (in_use, max) = slots.get(&b.target).copied().unwrap_or_default();
        let waiting = view.waiting.get(&b.target).copied().unwrap_or(0);
        b.free = in_use.saturating_add(waiting) < max;
        b.load = f64::from(in_use.saturating_add(waiting)) / f64::from(max.max(1));
    }
    boxes.sort_by(|a, b| {
        b.free
            .cmp(&a.free)
            .then(b.rank.cmp(&a.rank))
            .then(a.load.total_cmp(&b.load))
    });
    if let Some((root, local)) = home {
        let best_rank = boxes.iter().map(|b| b.rank).max().unwrap_or(0);
        let score = |target: &Target| {
            let name = match target {
                Target::Local => local,
                Target::Peer(node) => node,
            };
            xxhash_rust::xxh3::xxh3_64_with_seed(name.as_bytes(), root)
        };
        if let Some(index) = (0..boxes.len())
            .filter(|&i| boxes[i].free && boxes[i].rank == best_rank)
            .max_by_key(|&i| score(&boxes[i].target))
        {
            let chosen = boxes.remove(index);
            boxes.insert(0, chosen);
            return boxes.into_iter().map(|b| b.target).collect();
        }
    }
    // The boxes tied with the best share its turn by weight.
    let tied = boxes
        .iter()
        .take_while(|b| {
            let first = &boxes[0];
            b.free == first.free && b.rank == first.rank && b.load == first.load
        })
        .count();
    if tied > 1 {
        let total: i64 = boxes[..tied].iter().map(|b| b.weight).sum();
        let mut best = 0;
        let mut best_current = i64::MIN;
        for (index, b) in boxes[..tied].iter().enumerate() {
            let current = rotation.0.entry(b.target.clone()).or_insert(0);
            *current += b.weight;
            if *current > best_current {
                best = index;
                best_current = *current;
            }
        }
        if let Some(current) = rotation.0.get_mut(&boxes[best].target) {
            *current -= total;
        }
        boxes[..tied].rotate_left(best);
    }
    boxes.into_iter().map(|b| b.target).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::policy::{HostKind, normalize_model};

    fn host(name: &str, slots: u32, installed: &[&str], loaded: &[&str]) -> Host {
        Host {
            runners: Default::default(),
            name: Arc::from(name),
            url: format!("http://{name}:11434"),
            scheme: http::uri::Scheme::HTTP,
            authority: format!("{name}:11434").parse().unwrap(),
            weight: 1,
            max_concurrent: slots,
            kind: HostKind::Ollama,
            healthy: true,
            installed: installed.iter().map(|m| normalize_model(m)).collect(),
            loaded: loaded.iter().map(|m| normalize_model(m)).collect(),
            installed_names: Vec::new(),
            loaded_names: Vec::new(),
            last_checked: None,
            cloud_keys: Vec::new(),
            cloud_accounts: Vec::new(),
            fallback_models: Vec::new(),
            owner: None,
            vram: Default::default(),
            engine: Default::default(),
        }
    }

    fn peer(name: &str) -> Target {
        Target::Peer(Arc::from(name))
    }

    fn seen(host: &Host, target: Target, in_use: u32) -> Seen<'_> {
        Seen {
            host,
            target,
            in_use,
            usable: true,
        }
    }

    #[test]
    fn a_model_only_another_box_has_goes_there_even_when_it_is_busy() {
        let here = host("gpu1", 2, &["llama3"], &[]);
        let there = host("gpu2", 1, &["qwen"], &["qwen"]);
        let view = View {
            hosts: vec![seen(&here, Target::Local, 0), seen(&there, peer("b"), 1)],
            waiting: HashMap::from([(peer("b"), 5)]),
        };
        let order = order(
            &view,
            Some("qwen"),
            Strategy::ModelAware,
            &mut Rotation::default(),
        );
        assert_eq!(order, [peer("b")]);
    }

    #[test]
    fn free_boxes_first_then_loaded_then_lighter() {
        let a = host("gpu1", 2, &["m"], &["m"]);
        let b = host("gpu2", 2, &["m"], &[]);
        let c = host("gpu3", 4, &["m"], &[]);
        let view = View {
            hosts: vec![
                seen(&a, Target::Local, 2),
                seen(&b, peer("b"), 1),
                seen(&c, peer("c"), 1),
            ],
            waiting: HashMap::new(),
        };
        let order = order(
            &view,
            Some("m"),
            Strategy::ModelAware,
            &mut Rotation::default(),
        );
        assert_eq!(
            order,
            [peer("c"), peer("b"), Target::Local],
            "free, then lighter"
        );
        let view = View {
            waiting: HashMap::from([(peer("c"), 4), (peer("b"), 1)]),
            ..view
        };
        let order = super::order(
            &view,
            Some("m"),
            Strategy::ModelAware,
            &mut Rotation::default(),
        );
        assert_eq!(
            order,
            [Target::Local, peer("b"), peer("c")],
            "nobody free: loaded first, then the lighter load"
        );
    }

    #[test]
    fn equal_boxes_take_turns() {
        let a = host("gpu1", 1, &["m"], &["m"]);
        let b = host("gpu2", 1, &["m"], &["m"]);
        let view = View {
            hosts: vec![seen(&a, Target::Local, 0), seen(&b, peer("b"), 0)],
            waiting: HashMap::new(),
        };
        let mut rotation = Rotation::default();
        let firsts: Vec<Target> = (0..4)
            .map(|_| order(&view, Some("m"), Strategy::ModelAware, &mut rotation)[0].clone())
            .collect();
        assert_eq!(firsts, [Target::Local, peer("b"), Target::Local, peer("b")]);
    }

    #[test]
    fn unusable_hosts_are_skipped_unless_nothing_is_usable() {
        let a = host("gpu1", 1, &["m"], &["m"]);
        let b = host("gpu2", 1, &["m"], &[]);
        let mut down = seen(&a, peer("a"), 0);
        down.usable = false;
        let view = View {
            hosts: vec![down.clone(), seen(&b, Target::Local, 0)],
            waiting: HashMap::new(),
        };
        let order_now = order(
            &view,
            Some("m"),
            Strategy::ModelAware,
            &mut Rotation::default(),
        );
        assert_eq!(order_now, [Target::Local]);
        let view = View {
            hosts: vec![down],
            waiting: HashMap::new(),
        };
        let order_now = order(
            &view,
            Some("m"),
            Strategy::ModelAware,
            &mut Rotation::default(),
        );
        assert_eq!(order_now, [peer("a")], "health is a cached observation");
    }
}
