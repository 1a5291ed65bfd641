//! Dispatch: the fair pick of the next ticket (`next`), its charge, and the correction when it
//! completes (`complete`). The algorithm is described in the parent module's documentation.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::fair::DEFAULT_COST_SECS;
use super::swap::{Offer, Placer, Slots, Verdict};
use super::{Dispatch, Running, Scheduler, TicketId, Tier, Waiting};

/// Most tickets behind a client's unplaceable head that one pick looks at.
const MAX_BEHIND: usize = 32;

impl<T> Scheduler<T> {
    /// Picks the next ticket to run, or `None` when nothing waiting can be placed now.
    ///
    /// Tiers are visited in order; inside a tier, clients under their cap are offered in fair
    /// order, each with its head ticket only: `place(model)` returns `Some(placement)` when a host
    /// slot is free for that model, and the caller has then reserved it. A model refused once is
    /// not asked about again in the same call (placement is assumed to depend on the model only).
    /// Runs the expiry pass first, so it never dispatches an expired ticket. Call it until it
    /// returns `None` after every event that may free capacity or add work.
    pub fn next<P>(
        &mut self,
        now: Instant,
        place: impl FnMut(Option<&str>) -> Option<P>,
    ) -> Option<Dispatch<T, P>> {
        self.next_on(now, &mut Slots(place))
    }

    /// [`next`](Self::next) with VRAM-aware placement: a model that can run only by switching a
    /// host's VRAM is held back under the swap rule ("Model swaps" in the module documentation)
    /// while others run, and `placer` is told when to switch.
    pub fn next_on<P>(
        &mut self,
        now: Instant,
        placer: &mut impl Placer<P>,
    ) -> Option<Dispatch<T, P>> {
        self.observe(now);
        self.expire_pass(now);
        self.sweep(now);
        self.swap_wake = None;
        self.later_wake = None;
        let half_life = self.limits.half_life;
        let fallback = self.mean_cost.get().unwrap_or(DEFAULT_COST_SECS);
        let mut refused: Vec<Option<Arc<str>>> = Vec::new();
        // Models held in this call, with the host they are held for.
        let mut cold: Vec<(Arc<str>, Arc<str>)> = Vec::new();
        let mut candidates: Vec<Candidate> = Vec::new();
        for tier in Tier::ALL {
            let index = tier.index();
            let state = &self.tiers[index];
            candidates.clear();
            for name in &state.active {
                let Some(client) = self.clients.get_mut(name) else {
                    continue;
                };
                if !client.under_cap() {
                    // Held back by its own cap, not by others: it banks no credit.
                    client.flows[index].catch_up(state.vclock);
                    continue;
                }
                if let Some(&head) = client.queues[index].first() {
                    let one_request =
                        client.mean_cost.get().unwrap_or(fallback) / client.limits.weight;
                    let start =
                        client.flows[index].start_tag(state.vclock, now, half_life, one_request);
                    candidates.push(Candidate {
                        start,
                        member_start: 0.0,
                        head,
                    });
                }
            }
            for app in &state.groups {
                let Some(group) = self.groups.get_mut(app) else {
                    continue;
                };
                let limits = self
                    .clients
                    .get(app)
                    .map(|client| client.limits)
                    .unwrap_or_default();
                if limits.max_concurrent != 0 && group.inflight >= limits.max_concurrent {
                    group.flows[index].catch_up(state.vclock);
                    continue;
                }
                let one_request = group.mean_cost.get().unwrap_or(fallback) / limits.weight;
                let start = group.flows[index].start_tag(state.vclock, now, half_life, one_request);
                let vclock = group.vclock[index];
                for name in &group.active[index] {
                    let Some(member) = self.clients.get_mut(name) else {
                        continue;
                    };
                    if !member.under_cap() {
                        member.flows[index].catch_up(vclock);
                        continue;
                    }
                    if let Some(&head) = member.queues[index].first() {
                        let one_request = member.mean_cost.get().unwrap_or(fallback);
                        let member_start =
                            member.flows[index].start_tag(vclock, now, half_life, one_request);
                        candidates.push(Candidate {
                            start,
                            member_start,
                            head,
                        });
                    }
                }
            }
            // Fair order: smallest start tag (the app's, then its member's), then the older
            // head ticket. Usually the first candidate is placed, so find it in O(c) and sort
            // the rest only on a refusal.
            let fair = |a: &Candidate, b: &Candidate| {
                a.start
                    .total_cmp(&b.start)
                    .then(a.member_start.total_cmp(&b.member_start))
                    .then(a.head.cmp(&b.head))
            };
            if let Some(first) =
                (0..candidates.len()).min_by(|&i, &j| fair(&candidates[i], &candidates[j]))
            {
                candidates.swap(0, first);
            }
            for k in 0..candidates.len() {
                if k == 1 {
                    candidates[1..].sort_by(fair);
                }
                let Candidate {
                    start,
                    member_start,
                    head,
                } = candidates[k];
                let Some(entry) = self.waiting.get(&head) else {
                    continue;
                };
                let model = entry.model.clone();
                let affinity = entry.affinity.clone();
                // Put back after failing on its hosts: only another host, as it is now.
                let avoiding = !entry.avoid.is_empty();
                if avoiding {
                    if let Some(dispatch) =
                        self.run_avoiding(head, (start, member_start), placer, now)
                    {
                        return Some(dispatch);
                    }
                } else if let Some(model) = &model
                    && let Some((_, host)) = cold.iter().find(|(m, _)| m == model)
                {
                    // Held for the same switch as a fairer ticket.
                    let (model, host) = (model.clone(), host.clone());
                    self.hold(head, &model, &host, now);
                    continue;
                }
                if avoiding || refused.contains(&model) {
                    if let Some(dispatch) = self.behind(
                        head,
                        (start, member_start),
                        &mut refused,
                        &cold,
                        placer,
                        now,
                    ) {
                        return Some(dispatch);
                    }
                    continue;
                }
                let mut offer = placer.offer_for(model.as_deref(), affinity.as_deref(), now);
                if let (Offer::Cold(need), Some(name)) = (&offer, &model) {
                    let since = self.hold(head, name, &need.host, now);
                    match self.verdict(tier, since, need, now) {
                        Verdict::Switch(why) => {
                            let bound = self.swap.max_defer[tier.index()];
                            // Cannot fail: the entry was looked up just above.
                            if let Some(entry) = self.waiting.get(&head) {
                                let by = super::Requester {
                                    client: entry.client.clone(),
                                    group: entry.group.clone(),
                                    tier,
                                    bound,
                                };
                                placer.switch(&need.host, name, now, why, by);
                            }
                            offer = placer.offer(Some(name), now);
                        }
                        Verdict::Hold(wake) => {
                            self.wake_at(wake);
                            cold.push((name.clone(), need.host.clone()));
                            continue;
                        }
                    }
                }
                let placement = match offer {
                    Offer::Run(placement) => placement,
                    Offer::Cold(need) => {
                        // Still cold right after a switch began: its victims are draining.
                        if let Some(name) = &model {
                            self.hold(head, name, &need.host, now);
                            cold.push((name.clone(), need.host));
                        }
                        continue;
                    }
                    Offer::Later(at) => {
                        // Waits for its conversation's host; the next ticket may take the
                        // free slot.
                        self.later_at(at);
                        continue;
                    }
                    Offer::Wait => {
                        refused.push(model);
                        if let Some(dispatch) = self.behind(
                            head,
                            (start, member_start),
                            &mut refused,
                            &cold,
                            placer,
                            now,
                        ) {
                            return Some(dispatch);
                        }
                        continue;
                    }
                };
                let held = self.held.get(&head).map(|held| held.since);
                // Cannot fail: the entry was looked up just above.
                let Some(entry) = self.take(head, now) else {
                    continue;
                };
                let mut dispatch = self.start(head, entry, (start, member_start), placement, now);
                dispatch.held = held.map(|since| now.saturating_duration_since(since));
                return Some(dispatch);
            }
        }
        None
    }

    /// The client's head `head` cannot be placed now (no free slot for its model): its next
    /// tickets in its tier for other models, in order, are offered instead, so that a client's
    /// queue for a busy runner never holds back its request for an idle one. Only a ticket
    /// that can run now is taken (one that would need a model switch waits for its turn as a
    /// head); at most [`MAX_BEHIND`] tickets are looked at. Within one model, FIFO holds.
    fn behind<P>(
        &mut self,
        head: TicketId,
        tags: (f64, f64),
        refused: &mut Vec<Option<Arc<str>>>,
        cold: &[(Arc<str>, Arc<str>)],
        placer: &mut impl Placer<P>,
        now: Instant,
    ) -> Option<Dispatch<T, P>> {
        // The head's tier is the queue it heads (a promotion moves it).
        let head_entry = self.waiting.get(&head)?;
        let index = head_entry.tier.index();
        let client = head_entry.client.clone();
        let queue = &self.clients.get(&client)?.queues[index];
        let behind: Vec<TicketId> = queue
            .range((std::ops::Bound::Excluded(head), std::ops::Bound::Unbounded))
            .take(MAX_BEHIND)
            .copied()
            .collect();
        let mut skipped: Vec<Option<Arc<str>>> = Vec::new();
        for ticket in behind {
            let Some(entry) = self.waiting.get(&ticket) else {
                continue;
            };
            let model = entry.model.clone();
            let held_model = model
                .as_ref()
                .is_some_and(|model| cold.iter().any(|(m, _)| m == model));
            if held_model
                || self.held.contains_key(&ticket)
                || refused.contains(&model)
                || skipped.contains(&model)
            {
                continue;
            }
            if !entry.avoid.is_empty() {
                if let Some(dispatch) = self.run_avoiding(ticket, tags, placer, now) {
                    return Some(dispatch);
                }
                continue;
            }
            let affinity = entry.affinity.clone();
            match placer.offer_for(model.as_deref(), affinity.as_deref(), now) {
                Offer::Run(placement) => {
                    let entry = self.take(ticket, now)?;
                    return Some(self.start(ticket, entry, tags, placement, now));
                }
                Offer::Wait => refused.push(model),
                Offer::Cold(_) => skipped.push(model),
                Offer::Later(at) => self.later_at(at),
            }
        }
        None
    }

    /// Dispatches `ticket`, which was put back after failing on its hosts, if a host it has
    /// not failed on can take it now without a switch.
    fn run_avoiding<P>(
        &mut self,
        ticket: TicketId,
        tags: (f64, f64),
        placer: &mut impl Placer<P>,
        now: Instant,
    ) -> Option<Dispatch<T, P>> {
        let entry = self.waiting.get(&ticket)?;
        let (model, avoid) = (entry.model.clone(), entry.avoid.clone());
        let Offer::Run(placement) = placer.offer_avoiding(model.as_deref(), &avoid, now) else {
            return None;
        };
        let entry = self.take(ticket, now)?;
        Some(self.start(ticket, entry, tags, placement, now))
    }

    /// A dispatched request finished: releases its client's in-flight count and charges `cost`
    /// (GPU time: Ollama's `total_duration` when known, else wall time on the slot). Returns
    /// `false` for an unknown or already completed id.
    pub fn complete(&mut self, id: TicketId, cost: Duration, now: Instant) -> bool {
        self.observe(now);
        let Some(run) = self.running.remove(&id) else {
            return false;
        };
        let cost_secs = cost.as_secs_f64();
        self.mean_cost.record(cost_secs);
        let half_life = self.limits.half_life;
        let index = run.tier.index();
        let client = self.client_mut(&run.client, now);
        client.inflight = client.inflight.saturating_sub(1);
        client.usage.add(now, half_life, cost_secs);
        client.mean_cost.record(cost_secs);
        client.last_active = Some(now);
        let flow = &mut client.flows[index];
        flow.complete((cost_secs - run.estimate) / run.weight);
        if flow.inflight == 0 && client.queues[index].is_empty() {
            flow.idle(now);
        }
        if let Some((app, weight)) = &run.group
            && let Some(group) = self.groups.get_mut(app)
        {
            group.inflight = group.inflight.saturating_sub(1);
            group.mean_cost.record(cost_secs);
            group.last_active = Some(now);
            let flow = &mut group.flows[index];
            flow.complete((cost_secs - run.estimate) / weight);
            if flow.inflight == 0 && group.active[index].is_empty() {
                flow.idle(now);
            }
        }
        true
    }

    /// Charges and records a ticket taken for dispatch: `start` is its start tag, with its
    /// member's start tag inside its app when it has one.
    fn start<P>(
        &mut self,
        id: TicketId,
        entry: Waiting<T>,
        (start, member_start): (f64, f64),
        placement: P,
        now: Instant,
    ) -> Dispatch<T, P> {
        let index = entry.tier.index();
        let fallback = self.mean_cost.get().unwrap_or(DEFAULT_COST_SECS);
        let app_weight = entry.group.as_ref().map(|app| {
            self.clients
                .get(app)
                .map_or(1.0, |client| client.limits.weight)
        });
        let client = self.client_mut(&entry.client, now);
        let estimate = client.mean_cost.get().unwrap_or(fallback);
        // Inside an app its users share equally; the app's weight is the group's.
        let weight = match app_weight {
            Some(_) => 1.0,
            None => client.limits.weight,
        };
        let own_start = if app_weight.is_some() {
            member_start
        } else {
            start
        };
        client.flows[index].charge(own_start, estimate / weight, now);
        client.inflight += 1;
        client.processed += 1;
        client.last_active = Some(now);
        let group = match (&entry.group, app_weight) {
            (Some(app), Some(app_weight)) => {
                let group = self.groups.entry(app.clone()).or_default();
                group.flows[index].charge(start, estimate / app_weight, now);
                group.vclock[index] = group.vclock[index].max(member_start);
                group.inflight += 1;
                group.last_active = Some(now);
                Some((app.clone(), app_weight))
            }
            _ => None,
        };
        let tier = &mut self.tiers[index];
        tier.vclock = tier.vclock.max(start);
        tier.stat.processed += 1;
        self.running.insert(
            id,
            Running {
                client: entry.client.clone(),
                tier: entry.tier,
                estimate,
                weight,
                group,
                was: super::Was {
                    bytes: entry.bytes,
                    model: entry.model.clone(),
                    enqueued: entry.enqueued,
                    entered: entry.entered,
                },
            },
        );
        Dispatch {
            id,
            client: entry.client,
            tier: entry.tier,
            model: entry.model,
            waited: now.saturating_duration_since(entry.enqueued),
            payload: entry.payload,
            placement,
            held: None,
        }
    }
}

/// A head ticket offered in one tier, with the start tags that order it.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    /// Its client's start tag, or its app's when the client is a member of one.
    start: f64,
    /// Its start tag inside its app (0 for a client of its own).
    member_start: f64,
    head: TicketId,
}
