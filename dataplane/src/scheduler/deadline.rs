//! Deadlines: expiry at `max_wait`, aging promotion after `promote_after`, the instant the
//! dispatcher's timer should fire, and forgetting idle unconfigured clients.

use std::time::{Duration, Instant};

use super::{Expiry, Scheduler, Tier};

fn due(entered: Instant, after: Duration, now: Instant) -> bool {
    entered.checked_add(after).is_some_and(|at| at <= now)
}

impl<T> Scheduler<T> {
    /// Expires every ticket whose deadline has passed at `now` and promotes every ticket due for
    /// promotion (see "Deadlines and aging"), plus anything `next` found since the last call.
    /// Call it at [`next_deadline`](Self::next_deadline).
    pub fn expire(&mut self, now: Instant) -> Vec<Expiry<T>> {
        self.observe(now);
        self.expire_pass(now);
        self.sweep(now);
        std::mem::take(&mut self.pending)
    }

    /// The earliest instant at which `expire` has work: a deadline or a promotion. In the past if
    /// `next` left expiries to hand out or a blocked promotion became possible.
    pub fn next_deadline(&self) -> Option<Instant> {
        if !self.pending.is_empty() {
            return self.clock;
        }
        let mut earliest: Option<Instant> = self.swap_wake.filter(|_| !self.held.is_empty());
        if let Some(at) = self.later_wake {
            earliest = Some(earliest.map_or(at, |e| e.min(at)));
        }
        for tier in Tier::ALL {
            let state = &self.tiers[tier.index()];
            let Some((entered, _)) = state.oldest() else {
                continue;
            };
            let limits = self.limits.tier(tier);
            let promotion = limits
                .promote_after
                .filter(|_| tier.up().is_some() && !state.promotion_blocked);
            let instants = [Some(limits.max_wait), promotion]
                .into_iter()
                .flatten()
                .filter_map(|after| entered.checked_add(after));
            for at in instants {
                earliest = Some(earliest.map_or(at, |e| e.min(at)));
            }
        }
        earliest
    }

    /// Expires and promotes what is due at `now`, in time order per ticket, into `pending`.
    /// Tiers are visited from `High` down, so a ticket promoted in this pass is not looked at
    /// again until the next one, and expiries above make room for promotions from below.
    pub(super) fn expire_pass(&mut self, now: Instant) {
        for tier in Tier::ALL {
            let limits = self.limits.tiers[tier.index()];
            let promote_first = limits
                .promote_after
                .is_some_and(|after| after < limits.max_wait);
            if promote_first {
                self.promote_due(tier, now);
                self.expire_due(tier, now);
            } else {
                self.expire_due(tier, now);
                self.promote_due(tier, now);
            }
        }
    }

    fn expire_due(&mut self, tier: Tier, now: Instant) {
        let index = tier.index();
        let max_wait = self.limits.tiers[index].max_wait;
        while let Some((entered, id)) = self.tiers[index].oldest() {
            if !due(entered, max_wait, now) {
                break;
            }
            let Some(entry) = self.take(id, now) else {
                self.tiers[index].by_entry.remove(&(entered, id));
                continue;
            };
            self.tiers[index].stat.expired += 1;
            self.pending.push(Expiry::Expired {
                id,
                tier,
                client: entry.client,
                waited: now.saturating_duration_since(entry.enqueued),
                payload: entry.payload,
            });
        }
    }

    fn promote_due(&mut self, tier: Tier, now: Instant) {
        let index = tier.index();
        let (Some(after), Some(up)) = (self.limits.tiers[index].promote_after, tier.up()) else {
            return;
        };
        let room = self.limits.tier(up).max_depth as usize;
        self.tiers[index].promotion_blocked = false;
        while let Some((entered, id)) = self.tiers[index].oldest() {
            if !due(entered, after, now) {
                break;
            }
            if self.tiers[up.index()].depth() >= room {
                self.tiers[index].promotion_blocked = true;
                break;
            }
            // A held ticket stays held, from when it was first held.
            let held = self.held.get(&id).cloned();
            let Some(mut entry) = self.take(id, now) else {
                self.tiers[index].by_entry.remove(&(entered, id));
                continue;
            };
            self.tiers[index].stat.promoted += 1;
            let client = entry.client.clone();
            entry.tier = up;
            entry.entered = now;
            self.insert(id, entry, now);
            if let Some(held) = held {
                self.held.insert(id, held);
            }
            self.pending.push(Expiry::Promoted {
                id,
                client,
                from: tier,
                to: up,
            });
        }
    }

    /// Forgets unconfigured clients idle for four half-lives (their debt has decayed to 1/16),
    /// at most once per half-life, so identities seen once do not accumulate.
    pub(super) fn sweep(&mut self, now: Instant) {
        let half_life = self.limits.half_life;
        let interval = half_life.max(Duration::from_secs(1));
        if self
            .last_sweep
            .is_some_and(|last| now.saturating_duration_since(last) < interval)
        {
            return;
        }
        self.last_sweep = Some(now);
        let forget_after = half_life.saturating_mul(4);
        self.clients
            .retain(|_, client| !client.forgettable(now, forget_after));
        self.groups
            .retain(|_, group| !group.forgettable(now, forget_after));
    }
}
