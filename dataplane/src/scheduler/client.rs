//! Per-client state: limits, the client's waiting tickets in each tier (FIFO), its fair-queuing
//! flows, in-flight count, decayed usage and counters.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use foldhash::HashSet;

use super::TicketId;
use super::fair::{CostMean, Decayed, Flow};

/// Limits of one client, from the policy snapshot.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClientLimits {
    /// Requests of this client in flight at once; `0` = unlimited. A client at its cap is skipped
    /// by the dispatcher and holds nothing while it waits.
    pub max_concurrent: u32,
    /// Tickets of this client waiting at once, all tiers together; `0` = unlimited.
    pub max_queued: u32,
    /// Share of the GPU relative to the other clients of a tier. Must be finite and `> 0`; any
    /// other value is treated as `1.0`.
    pub weight: f64,
}

impl Default for ClientLimits {
    /// What an unknown client gets: no cap, no queue limit, weight 1.
    fn default() -> Self {
        ClientLimits {
            max_concurrent: 0,
            max_queued: 0,
            weight: 1.0,
        }
    }
}

impl ClientLimits {
    /// The limits with a usable weight.
    pub(super) fn sanitised(mut self) -> Self {
        if !(self.weight.is_finite() && self.weight > 0.0) {
            self.weight = 1.0;
        }
        self
    }
}

/// One client's figures, as reported by [`Scheduler::client_stats`](super::Scheduler::client_stats).
#[derive(Clone, Debug, PartialEq)]
pub struct ClientStat {
    pub client: Arc<str>,
    pub weight: f64,
    /// Tickets waiting, all tiers.
    pub waiting: u32,
    /// Requests dispatched and not yet completed.
    pub inflight: u32,
    /// Tickets dispatched.
    pub processed: u64,
    /// Admissions refused with `QueueFull`, `OverCapacity` or `ClientQueueFull`.
    pub rejected: u64,
    /// The client's decayed GPU time divided by everyone's: its recent share of the GPU, `0..=1`.
    pub recent_share: f64,
    /// Drain time of the model switches its requests caused, charged to it.
    pub switch_charged: Duration,
}

#[derive(Debug)]
pub(super) struct ClientState {
    pub(super) limits: ClientLimits,
    /// Set with `set_client` (kept while idle) rather than seen on a ticket (forgotten when idle).
    pub(super) configured: bool,
    /// Waiting tickets per tier, FIFO: ticket ids grow with admission order.
    pub(super) queues: [BTreeSet<TicketId>; 3],
    pub(super) flows: [Flow; 3],
    pub(super) waiting: u32,
    pub(super) inflight: u32,
    pub(super) processed: u64,
    pub(super) rejected: u64,
    /// Decayed GPU seconds, for `recent_share`.
    pub(super) usage: Decayed,
    /// Running mean of this client's costs: the estimate charged at dispatch.
    pub(super) mean_cost: CostMean,
    /// Last time a ticket of the client was admitted, dispatched or completed.
    pub(super) last_active: Option<Instant>,
    /// Drain time of the model switches it caused ([`ClientStat::switch_charged`]).
    pub(super) switch_charged: Duration,
}

impl ClientState {
    pub(super) fn new(limits: ClientLimits, configured: bool, now: Option<Instant>) -> Self {
        ClientState {
            limits: limits.sanitised(),
            configured,
            queues: Default::default(),
            flows: Default::default(),
            waiting: 0,
            inflight: 0,
            processed: 0,
            rejected: 0,
            usage: Decayed::default(),
            mean_cost: CostMean::default(),
            last_active: now,
            switch_charged: Duration::ZERO,
        }
    }

    /// Whether the client may have one more request in flight.
    pub(super) fn under_cap(&self) -> bool {
        self.limits.max_concurrent == 0 || self.inflight < self.limits.max_concurrent
    }

    /// Whether one more waiting ticket would exceed `max_queued`.
    pub(super) fn queue_full(&self) -> bool {
        self.limits.max_queued != 0 && self.waiting >= self.limits.max_queued
    }

    /// An unconfigured client with nothing waiting or running for `forget_after` can be dropped:
    /// its debt has decayed to nothing that matters and it would restart level with the others.
    pub(super) fn forgettable(&self, now: Instant, forget_after: Duration) -> bool {
        !self.configured
            && self.waiting == 0
            && self.inflight == 0
            && self
                .last_active
                .is_none_or(|last| now.saturating_duration_since(last) >= forget_after)
    }
}

/// The scheduler's state for one app whose users are members (see "Apps and their users"): the
/// app's flow in each tier against the other clients, and the virtual clock its members' flows
/// run on.
#[derive(Debug, Default)]
pub(super) struct GroupState {
    /// The app's flow per tier, at the app's weight.
    pub(super) flows: [Flow; 3],
    /// The virtual clock of the members' flows, per tier.
    pub(super) vclock: [f64; 3],
    /// Members with a ticket waiting, per tier.
    pub(super) active: [HashSet<Arc<str>>; 3],
    /// Requests of all members in flight.
    pub(super) inflight: u32,
    /// Tickets of all members waiting.
    pub(super) waiting: u32,
    /// Running mean of the members' costs.
    pub(super) mean_cost: CostMean,
    pub(super) last_active: Option<Instant>,
}

impl GroupState {
    /// Nothing waiting or running for `forget_after`: the app's state can be dropped.
    pub(super) fn forgettable(&self, now: Instant, forget_after: Duration) -> bool {
        self.waiting == 0
            && self.inflight == 0
            && self
                .last_active
                .is_none_or(|last| now.saturating_duration_since(last) >= forget_after)
    }
}
