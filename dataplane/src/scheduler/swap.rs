//! Model swaps: holding back a request whose model would evict another, and deciding when the
//! switch pays. The rule is described in the parent module's documentation ("Model swaps").

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Scheduler, TicketId, Tier};

/// Why a switch happens (for its log line).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwitchReason {
    /// The held request waited its tier's `max_defer`.
    Bound,
    /// The resident models had no work for `idle_grace`.
    Idle,
}

impl SwitchReason {
    /// `bound` or `idle`.
    pub fn as_str(self) -> &'static str {
        match self {
            SwitchReason::Bound => "max_defer reached",
            SwitchReason::Idle => "resident models idle",
        }
    }
}

/// The swap rule's settings (`queue.model_swap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwapRule {
    /// Off: placement never answers [`Offer::Cold`] and nothing is held.
    pub enabled: bool,
    /// Per tier: the longest a request is held back, and the shortest stay of a model switched
    /// to before a request of this tier may switch again.
    pub max_defer: [Duration; 3],
    /// A switch may happen early once the resident models have had no work this long.
    pub idle_grace: Duration,
}

impl Default for SwapRule {
    fn default() -> Self {
        Self {
            enabled: false,
            max_defer: [
                Duration::from_secs(1),
                Duration::from_secs(5),
                Duration::from_secs(30),
            ],
            idle_grace: Duration::from_millis(300),
        }
    }
}

/// What placement answers for a ticket's model.
#[derive(Debug)]
pub enum Offer<P> {
    /// A host slot is reserved for it: run it.
    Run(P),
    /// No slot can take it now: every fitting host is busy, or a switch it must wait for is
    /// under way.
    Wait,
    /// A slot is free only on a host whose VRAM would have to switch to this model.
    Cold(Cold),
    /// A slot is free, but the ticket is better served by waiting for a busy host where
    /// its conversation's prompt is cached: ask again at this instant (or when a slot
    /// frees). Other tickets, of the same model too, may take the free slot meanwhile.
    Later(Instant),
}

/// A host that could run a model only by switching its VRAM to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cold {
    /// The host's name.
    pub host: Arc<str>,
    /// Since when nothing has been in flight on the host (`None`: something is).
    pub idle_since: Option<Instant>,
    /// When the host last switched models: the start of the current model's stay.
    pub settled_at: Option<Instant>,
    /// A switch is under way there (or holding is off for it): hold, start no other.
    pub switching: bool,
    /// When the switch under way is given up if the old model's requests have not finished.
    pub drain_until: Option<Instant>,
    /// When a switch was last given up there: a held ticket's `max_defer` restarts then, so
    /// that the host is not stopped again at once for the same long request.
    pub gave_up_at: Option<Instant>,
}

/// The client whose held request caused a switch: the switch's drain lasts at most `bound`
/// (its tier's `max_defer`), and the time it stops the old model's work is charged to it
/// ([`Scheduler::charge_switch`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requester {
    /// The client.
    pub client: Arc<str>,
    /// The app it is a user of, if any (its group is charged too).
    pub group: Option<Arc<str>>,
    /// The tier of its request.
    pub tier: Tier,
    /// How long the switch may wait for the old model's requests.
    pub bound: Duration,
}

/// Placement as the swap rule uses it.
pub trait Placer<P> {
    /// Whether a ticket for `model` can run now, and where.
    fn offer(&mut self, model: Option<&str>, now: Instant) -> Offer<P>;
    /// [`offer`](Placer::offer) for a ticket whose conversation is `affinity`.
    fn offer_for(
        &mut self,
        model: Option<&str>,
        affinity: Option<&crate::affinity::Chain>,
        now: Instant,
    ) -> Offer<P> {
        let _ = affinity;
        self.offer(model, now)
    }
    /// Starts switching `host` to `model` for `by` (the switch is under way until the model's
    /// first dispatch there, or until it is given up at `by.bound`).
    fn switch(&mut self, host: &str, model: &str, now: Instant, why: SwitchReason, by: Requester);
    /// Whether a ticket for `model` that must not go to the hosts `avoid` (those it failed on)
    /// can run now on another host, without a switch; a placer that knows no hosts ignores
    /// `avoid`.
    fn offer_avoiding(
        &mut self,
        model: Option<&str>,
        avoid: &[Arc<str>],
        now: Instant,
    ) -> Offer<P> {
        let _ = avoid;
        match self.offer(model, now) {
            Offer::Run(placement) => Offer::Run(placement),
            Offer::Wait | Offer::Cold(_) | Offer::Later(_) => Offer::Wait,
        }
    }
}

/// Placement without VRAM: a free slot or nothing (`Some` reserves it).
pub(super) struct Slots<F>(pub(super) F);

impl<P, F: FnMut(Option<&str>) -> Option<P>> Placer<P> for Slots<F> {
    fn offer(&mut self, model: Option<&str>, _now: Instant) -> Offer<P> {
        match (self.0)(model) {
            Some(placement) => Offer::Run(placement),
            None => Offer::Wait,
        }
    }

    fn switch(&mut self, _: &str, _: &str, _: Instant, _: SwitchReason, _: Requester) {}
}

/// A held ticket.
#[derive(Clone, Debug)]
pub(super) struct Held {
    /// When it was first held: the start of its `max_defer`.
    pub(super) since: Instant,
    /// The host it is held for.
    pub(super) host: Arc<str>,
    /// Its model.
    pub(super) model: Arc<str>,
}

/// What the rule decided for a cold ticket.
pub(super) enum Verdict {
    /// Switch now.
    Switch(SwitchReason),
    /// Hold; look again at this instant (or at the next event).
    Hold(Option<Instant>),
}

impl<T> Scheduler<T> {
    /// Sets the swap rule. Turning it off releases every held ticket to plain fair share.
    pub fn set_swap(&mut self, rule: SwapRule) {
        self.swap = rule;
        if !rule.enabled {
            self.held.clear();
        }
    }

    /// The swap rule in force.
    pub fn swap(&self) -> &SwapRule {
        &self.swap
    }

    /// Requests held back now, per host: how many, and the longest held.
    pub fn held(&self) -> std::collections::HashMap<Arc<str>, (u32, Duration)> {
        let mut by_host: std::collections::HashMap<Arc<str>, (u32, Duration)> =
            std::collections::HashMap::new();
        let now = self.clock;
        for held in self.held.values() {
            let age = now.map_or(Duration::ZERO, |now| {
                now.saturating_duration_since(held.since)
            });
            let entry = by_host.entry(held.host.clone()).or_default();
            entry.0 += 1;
            entry.1 = entry.1.max(age);
        }
        by_host
    }

    /// Whether any ticket is held back now.
    pub fn holding(&self) -> bool {
        !self.held.is_empty()
    }

    /// Whether any ticket for `model` is waiting (a switch to it is still wanted).
    pub fn waiting_for(&self, model: &str) -> bool {
        self.by_model.get(model).is_some_and(|n| *n > 0)
    }

    /// Holds `id` (a ticket for `model`) for `host`, from `now` the first time. Returns since
    /// when `model` has been held: the earliest of its held tickets, so that a ticket that is
    /// not the fairest still has its switch at its own bound.
    pub(super) fn hold(
        &mut self,
        id: TicketId,
        model: &Arc<str>,
        host: &Arc<str>,
        now: Instant,
    ) -> Instant {
        let held = self.held.entry(id).or_insert_with(|| Held {
            since: now,
            host: host.clone(),
            model: model.clone(),
        });
        held.host = host.clone();
        self.held
            .values()
            .filter(|held| held.model == *model)
            .map(|held| held.since)
            .min()
            .unwrap_or(now)
    }

    /// The drain time of a switch `by` caused, charged to its fair share as slot time (and to
    /// its recent usage): the others' work it stopped. A client no longer known is not charged.
    pub fn charge_switch(&mut self, by: &Requester, drained: Duration, now: Instant) {
        self.observe(now);
        let secs = drained.as_secs_f64();
        let half_life = self.limits.half_life;
        let index = by.tier.index();
        let app_weight = by.group.as_ref().map(|app| {
            self.clients
                .get(app)
                .map_or(1.0, |client| client.limits.weight)
        });
        let Some(client) = self.clients.get_mut(&by.client) else {
            return;
        };
        // Inside an app its users share equally; the app's weight is the group's.
        let weight = if app_weight.is_some() {
            1.0
        } else {
            client.limits.weight
        };
        client.usage.add(now, half_life, secs);
        client.flows[index].add(secs / weight);
        client.switch_charged += drained;
        if let (Some(app), Some(app_weight)) = (&by.group, app_weight)
            && let Some(group) = self.groups.get_mut(app)
        {
            group.flows[index].add(secs / app_weight);
        }
    }

    /// The rule for a ticket of `tier`, first held at `since`, whose model needs `cold`.
    pub(super) fn verdict(&self, tier: Tier, since: Instant, cold: &Cold, now: Instant) -> Verdict {
        let bound = self.swap.max_defer[tier.index()];
        // After a switch given up, the bound counts from then.
        let since = cold.gave_up_at.map_or(since, |at| since.max(at));
        let due_at = since.checked_add(bound);
        let due = due_at.is_none_or(|at| now >= at);
        let idle_at = cold
            .idle_since
            .and_then(|idle| idle.checked_add(self.swap.idle_grace));
        let idle = idle_at.is_some_and(|at| now >= at);
        let stay_end = cold.settled_at.and_then(|at| at.checked_add(bound));
        let stayed = stay_end.is_none_or(|at| now >= at);
        if cold.switching {
            return Verdict::Hold(cold.drain_until);
        }
        if idle {
            return Verdict::Switch(SwitchReason::Idle);
        }
        if due && (stayed || tier == Tier::High) {
            return Verdict::Switch(SwitchReason::Bound);
        }
        let wake = [
            (!due).then_some(due_at).flatten(),
            idle_at,
            (due && !stayed).then_some(stay_end).flatten(),
        ]
        .into_iter()
        .flatten()
        .min();
        Verdict::Hold(wake)
    }

    /// Whether a ticket waits for its conversation's busy host (the timer must know when to
    /// offer it again).
    pub fn waits_for_host(&self) -> bool {
        self.later_wake.is_some()
    }

    /// A ticket waits for its conversation's host until `at` at the latest.
    pub(super) fn later_at(&mut self, at: Instant) {
        self.later_wake = Some(self.later_wake.map_or(at, |w| w.min(at)));
    }

    pub(super) fn wake_at(&mut self, at: Option<Instant>) {
        if let Some(at) = at {
            self.swap_wake = Some(self.swap_wake.map_or(at, |w| w.min(at)));
        }
    }
}
