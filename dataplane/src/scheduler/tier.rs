//! Priority tiers: the tier type, its limits, and the per-tier bookkeeping of the scheduler
//! (deadline order, virtual clock, watermark, counters).

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use foldhash::{HashSet, HashSetExt};

use super::TicketId;

/// A priority tier. Tiers are served in strict order: `High` before `Normal` before `Low`.
///
/// The derived `Ord` follows declaration order, so `High < Normal < Low`: "smaller is more urgent".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// Interactive work.
    High,
    /// The default tier.
    Normal,
    /// Batch work; served only when nothing above it can run.
    Low,
}

impl Tier {
    /// Every tier, most urgent first (the service order).
    pub const ALL: [Tier; 3] = [Tier::High, Tier::Normal, Tier::Low];

    /// The lowercase name used in configuration, headers, metrics labels and the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::High => "high",
            Tier::Normal => "normal",
            Tier::Low => "low",
        }
    }

    /// Position in [`Tier::ALL`]: 0 for `High`, 2 for `Low`.
    pub fn index(self) -> usize {
        match self {
            Tier::High => 0,
            Tier::Normal => 1,
            Tier::Low => 2,
        }
    }

    /// The tier a waiting ticket is promoted into when it ages, if any.
    pub fn up(self) -> Option<Tier> {
        match self {
            Tier::High => None,
            Tier::Normal => Some(Tier::High),
            Tier::Low => Some(Tier::Normal),
        }
    }

    /// The tier whose tickets are promoted into this one, if any.
    pub fn down(self) -> Option<Tier> {
        match self {
            Tier::High => Some(Tier::Normal),
            Tier::Normal => Some(Tier::Low),
            Tier::Low => None,
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Limits of one tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierLimits {
    /// Tickets allowed to wait in the tier; admission beyond it is `QueueFull`. `0` means the tier
    /// never queues (every request is rejected), which is not an error.
    pub max_depth: u32,
    /// How long a ticket may wait in this tier before it is answered as expired. Measured from the
    /// moment the ticket entered the tier (admission, or promotion into it). `Duration::ZERO`
    /// expires tickets at the first expiry pass, so configuration should reject it.
    pub max_wait: Duration,
    /// A ticket that has waited this long in this tier moves one tier up (`Low` → `Normal` →
    /// `High`). `None` disables aging out of this tier; ignored for `High`.
    pub promote_after: Option<Duration>,
    /// Depth, in percent of `max_depth`, at which an admission reports `watermark_crossed`. `0`
    /// disables the watermark.
    pub high_watermark_pct: u32,
}

impl TierLimits {
    /// Whether `depth` waiting tickets is at or above the high watermark.
    pub(super) fn at_watermark(&self, depth: usize) -> bool {
        self.max_depth > 0
            && self.high_watermark_pct > 0
            && (depth as u64) * 100
                >= u64::from(self.high_watermark_pct) * u64::from(self.max_depth)
    }
}

/// Counters and depth of one tier, as reported by [`Scheduler::tier_stats`](super::Scheduler::tier_stats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierStat {
    /// Tickets waiting in the tier now.
    pub depth: u32,
    /// Whether admission to the tier is paused.
    pub paused: bool,
    /// Tickets dispatched from this tier.
    pub processed: u64,
    /// Admissions refused with `QueueFull`, `OverCapacity` or `ClientQueueFull` (not `Paused`).
    pub rejected: u64,
    /// Tickets answered as expired while waiting in this tier.
    pub expired: u64,
    /// Tickets removed because their client went away while waiting in this tier.
    pub cancelled: u64,
    /// Tickets promoted *out of* this tier into the one above.
    pub promoted: u64,
    /// Tickets removed by a flush of this tier.
    pub flushed: u64,
}

/// The scheduler's state for one tier.
#[derive(Debug)]
pub(super) struct TierState {
    pub(super) paused: bool,
    /// Waiting tickets ordered by the instant they entered this tier. All tickets of a tier share
    /// `max_wait` and `promote_after`, so this is also deadline order and promotion order.
    pub(super) by_entry: BTreeSet<(Instant, TicketId)>,
    /// Clients of their own (not members of an app) with at least one ticket waiting in this
    /// tier.
    pub(super) active: HashSet<Arc<str>>,
    /// Apps with at least one member's ticket waiting in this tier.
    pub(super) groups: HashSet<Arc<str>>,
    /// The tier's virtual clock: the largest start tag dispatched so far (see `fair`).
    pub(super) vclock: f64,
    /// Armed: the next admission at or above the watermark reports a crossing.
    pub(super) watermark_armed: bool,
    /// Promotion out of this tier is due but the tier above is full. Cleared whenever the tier
    /// above loses a ticket, so `next_deadline` does not report a past instant forever.
    pub(super) promotion_blocked: bool,
    pub(super) stat: TierStat,
}

impl TierState {
    pub(super) fn new() -> Self {
        TierState {
            paused: false,
            by_entry: BTreeSet::new(),
            active: HashSet::new(),
            groups: HashSet::new(),
            vclock: 0.0,
            watermark_armed: true,
            promotion_blocked: false,
            stat: TierStat::default(),
        }
    }

    pub(super) fn depth(&self) -> usize {
        self.by_entry.len()
    }

    /// Re-arms the watermark once the depth is below it (after a dequeue or a limits change).
    pub(super) fn rearm(&mut self, limits: &TierLimits) {
        if !limits.at_watermark(self.depth()) {
            self.watermark_armed = true;
        }
    }

    /// The instant the oldest waiting ticket entered this tier.
    pub(super) fn oldest(&self) -> Option<(Instant, TicketId)> {
        self.by_entry.first().copied()
    }

    pub(super) fn stat(&self) -> TierStat {
        TierStat {
            depth: u32::try_from(self.depth()).unwrap_or(u32::MAX),
            paused: self.paused,
            ..self.stat
        }
    }
}
