//! The scheduler: which waiting request runs next on the shared GPU.
//!
//! A pure data structure — no tokio, no I/O, no clock: every method that depends on time takes
//! `now`. The data plane's dispatcher owns one [`Scheduler<T>`] (`T` is the ticket payload, the
//! oneshot sender that grants the request its slot) and calls it on every event: a request
//! arrives ([`enqueue`](Scheduler::enqueue)), its client goes away ([`cancel`](Scheduler::cancel)),
//! a slot frees or a ticket arrives ([`next`](Scheduler::next), until it returns `None`), a
//! request ends ([`complete`](Scheduler::complete)), the timer set to
//! [`next_deadline`](Scheduler::next_deadline) fires ([`expire`](Scheduler::expire)), a snapshot
//! changes ([`set_limits`](Scheduler::set_limits), [`set_client`](Scheduler::set_client),
//! [`set_paused`](Scheduler::set_paused)), an operator flushes ([`flush`](Scheduler::flush)).
//! After any call the dispatcher re-reads `next_deadline`, which may have moved earlier.
//!
//! # Order of service
//! 1. **Strict tiers.** `High`, then `Normal`, then `Low`: a tier is served only when no ticket
//!    of a tier above it can be placed. "Placed" is the work-conserving part: a higher-tier ticket
//!    whose model has no free host slot does not stop a lower tier from using *another* host.
//!    It only waits for capacity it can actually use; nothing is held for it.
//! 2. **Fair share inside a tier**, between clients, weighted (below).
//! 3. **FIFO inside a client for each model** (per tier, by admission order). A client whose
//!    head ticket cannot be placed (its model's runner has no free slot) has its next tickets
//!    for other models offered, in order (32 at most): a busy runner
//!    holds back nothing of the client's for an idle one.
//!
//! A client at its `max_concurrent` cap is simply not a candidate: it holds no slot and blocks
//! nobody (fix of the Python proxy, where a capped request sat on a global worker slot). A client
//! whose head ticket cannot be placed is skipped without losing its place or its tickets.
//!
//! # Fair share: start-time fair queuing on measured cost
//! Cost is GPU time: Ollama's `total_duration` when known, otherwise wall time on the slot.
//! Each (client, tier) is a *flow* with a virtual finish tag `F` (normalised seconds = seconds /
//! weight); each tier has a virtual clock `V`.
//! - **Pick:** among the tier's clients that are under their cap, the one with the smallest start
//!   tag `S = F` is offered first (ties: the older head ticket), then the next, until `place`
//!   accepts one. On dispatch `V := max(V, S)` and `F := S + estimate / weight`, where `estimate`
//!   is the client's running mean cost (else the mean over all clients, else 1 s).
//! - **Correct:** when the request completes, `F += (cost − estimate) / weight`. So over any
//!   interval a backlogged flow's `F` advances by exactly its charged GPU time / weight, and since
//!   the pick keeps all backlogged flows' `F` within a bounded band (at most a few costs / weight
//!   apart), their GPU times converge to the ratio of their weights, whatever their request rates
//!   or request sizes. Charging the estimate at dispatch keeps a client with many requests in
//!   flight from winning again and again before its costs are known.
//! - **Arrive:** a flow that gets a ticket after having none starts at `S = max(V, F)`: an idle
//!   client banks no credit, and a newcomer starts level with the busy clients, so it gets at most
//!   one request ahead of its share.
//! - **Forget:** debt (`F > V`) of a flow with nothing waiting and nothing in flight decays with
//!   `half_life` over its idle time, so old work is not held against a returning client for ever.
//!   Credit (`F < V`) is not banked by a client at its own cap (its `F` is raised to `V` while it
//!   is skipped, so lifting a cap causes no burst); credit built while a flow's model had no free
//!   host and others ran, or left by the correction of an over-estimate, is worth at most one
//!   request (the flow's estimate) and decays with the same half-life, so no client bursts ahead
//!   of the others once its host frees or its first costs become known.
//!   Decay never touches a continuously backlogged flow's debt, which is what keeps shares exact
//!   (ranking clients by decayed usage, the other classic design, biases shares towards equal,
//!   by an amount that grows with request cost / half-life).
//!
//! `client_stats` also reports each client's decayed GPU time over everyone's as `recent_share`.
//!
//! # Apps and their users: fair share in two levels
//! A ticket may name a [`Member`]: its client is one user (or the app itself) of an app key
//! that speaks for many people. The app is then one *group* in its tier: its flow, at the app's
//! weight, competes with the other clients exactly as a single client would, however many
//! users it has; inside the group each user is a flow of weight 1 on the group's own virtual
//! clock, so the same start-time fair queuing shares the app's GPU time between its users.
//! Candidates are ordered by (group start tag, member start tag). The app's `max_concurrent`
//! and `max_queued` bound the group as a whole; each user has the member limits of its ticket.
//!
//! # Admission
//! Checked in order: tier paused → `Paused`; tier depth ≥ `max_depth` → `QueueFull` (`max_depth`
//! 0: the tier never queues); client's waiting tickets ≥ `max_queued` → `ClientQueueFull`;
//! `queued_bytes + bytes > max_queued_bytes` while anything waits → `OverCapacity` (a request
//! arriving at empty queues is admitted whatever its size, or it could never run). Bytes are
//! released when a ticket stops waiting: dispatch, expiry, cancellation and flush alike.
//! The high watermark is reported once per crossing and re-armed whenever the depth falls back
//! below it, by any dequeue.
//!
//! # Deadlines and aging
//! A ticket expires when it has waited `max_wait` in its tier (at the deadline, not after it, and
//! without waiting for a worker to reach it). A ticket that has waited `promote_after` in its
//! tier moves one tier up, keeping its original enqueue time (so `Dispatch::waited`, the source
//! of `X-Queue-Wait-Time`, covers its whole wait) but restarting its `max_wait` and
//! `promote_after` clocks in the new tier: the new tier's limits are the promise it now gets,
//! and it never expires sooner for having been promoted. Promotion is not admission: it ignores
//! pause, byte and client limits, but waits while the tier above is at `max_depth`, so aging
//! cannot crowd out that tier's own admissions. `next` runs the expiry pass itself and never
//! dispatches an expired ticket; what it finds is handed out by the next `expire` call.
//!
//! # Model swaps
//! With [`next_on`](Scheduler::next_on), placement answers in three ways ([`Offer`]): *run* (a
//! slot is reserved), *wait* (no slot that could take it), or *cold*: the model could run only
//! if some host's VRAM switched to it, evicting a model there. A cold ticket is **held**: it
//! keeps its place and its flow's tags, and the pick goes on, in fair order, to the other
//! candidates of its tier and then the tiers below, so the resident model keeps working. The
//! ticket is remembered with the instant it was first held, and the rule (`verdict`) says when
//! to switch:
//! - when nothing has been in flight on the host for `idle_grace` (a client in a loop sends
//!   its next request a few milliseconds after the last answer, so its gaps do not count);
//! - or when the ticket has been held its tier's `max_defer`, and the host's current model has
//!   stayed at least that long since its own switch (a high-tier ticket at its bound does not
//!   wait for the stay): without the stay, a third model waiting as long would switch again
//!   right after the first batch.
//!
//! Then [`Placer::switch`] starts the switch and the ticket is offered again; until the
//! victims' requests have finished it stays held, and once they have, the new model's tickets
//! run together, up to the host's slots. Nothing is preempted. The victims get the requester's
//! `max_defer` to finish ([`Requester`]); a switch still draining then is given up, and the
//! host's next switch counts its bound from then ([`Cold::gave_up_at`]). The drain time is
//! charged to the requester's flow ([`charge_switch`](Scheduler::charge_switch)). Otherwise the instant the
//! answer changes (the bound, the end of the grace or of the stay) joins
//! [`next_deadline`](Scheduler::next_deadline). Tickets held for the same model in one call
//! share the fairest one's decision. Cancelling, dispatching or flushing a held ticket forgets
//! it, so a switch nothing waits for any more is not made ([`waiting_for`](Scheduler::waiting_for)
//! lets the caller drop one already begun).
//!
//! # Cost
//! `enqueue`, `cancel` and `complete` are O(log n) in waiting tickets; `next` is O(c) in the
//! clients waiting in the tiers it visits (O(c log c) when `place` refuses someone), plus
//! O(log n); `expire` is O(log n) per ticket it moves. Nothing scans all tickets but `flush`.
//!
//! Code map: this file holds the types, admission and the indexes; `dispatch` the fair pick and
//! its accounting; `swap` the hold rule; `deadline` expiry, aging and the timer; `fair` the virtual-time arithmetic;
//! `tier` and `client` the per-tier and per-client state.

mod client;
mod deadline;
mod dispatch;
mod fair;
mod swap;
mod tier;

// Tests may panic on a broken expectation: that is their job.
#[cfg(test)]
#[allow(clippy::expect_used)]
mod props;
#[cfg(test)]
#[allow(clippy::expect_used)]
mod sim;
#[cfg(test)]
#[allow(clippy::expect_used)]
mod tests;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use foldhash::{HashMap, HashMapExt};

pub use client::{ClientLimits, ClientStat};
pub use swap::{Cold, Offer, Placer, Requester, SwapRule, SwitchReason};
pub use tier::{Tier, TierLimits, TierStat};

use client::{ClientState, GroupState};
use fair::CostMean;
use tier::TierState;

/// Limits of the whole scheduler, from the policy snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Per tier, indexed by [`Tier::index`].
    pub tiers: [TierLimits; 3],
    /// Request bytes allowed to wait, all tiers together.
    pub max_queued_bytes: u64,
    /// Half-life of the decay of idle debt, blocked credit and reported usage.
    pub half_life: Duration,
}

impl Limits {
    /// The limits of one tier.
    pub fn tier(&self, tier: Tier) -> &TierLimits {
        &self.tiers[tier.index()]
    }
}

impl Default for Limits {
    /// The Python proxy's defaults (depth 50/100/200, wait 120/300/600 s, watermark 80 %,
    /// 512 MiB), no aging, and a one-minute half-life.
    fn default() -> Self {
        let tier = |max_depth, max_wait_secs| TierLimits {
            max_depth,
            max_wait: Duration::from_secs(max_wait_secs),
            promote_after: None,
            high_watermark_pct: 80,
        };
        Limits {
            tiers: [tier(50, 120), tier(100, 300), tier(200, 600)],
            max_queued_bytes: 512 * 1024 * 1024,
            half_life: Duration::from_secs(60),
        }
    }
}

/// A request asking to be scheduled.
#[derive(Debug)]
pub struct Ticket<T> {
    /// What it asks of the queue.
    pub ask: Ask,
    /// What the dispatcher hands back on dispatch, expiry, cancellation or flush.
    pub payload: T,
}

/// What a request asks of the queue: who, at which tier, for which model, holding how many
/// bytes while it waits.
#[derive(Debug, Clone)]
pub struct Ask {
    /// The client's identity (its `client_id`); fairness, caps and counters are per client.
    pub client: Arc<str>,
    /// The app the client belongs to, when it is a user of an app key (see "Apps and their
    /// users"); `None` for a client of its own.
    pub member: Option<Member>,
    /// The tier it asks for, already capped by the client's `max_priority`.
    pub tier: Tier,
    /// Size of the buffered request body, counted against `max_queued_bytes` while it waits.
    pub bytes: u64,
    /// The model, for placement: `place` is asked whether a host slot is free for it.
    pub model: Option<Arc<str>>,
    /// Its conversation, for placement by prompt-cache affinity (the host only: never who
    /// goes next).
    pub affinity: Option<Arc<crate::affinity::Chain>>,
}

/// The app a ticket's client is a member of, and the limits of one member.
#[derive(Clone, Debug, PartialEq)]
pub struct Member {
    /// The app's client id: its configured limits (weight, caps) are the group's.
    pub app: Arc<str>,
    /// Each user's own limits (`max_concurrent`, `max_queued`; the weight is ignored: users
    /// of one app share it equally). Not applied to the app's own client.
    pub limits: ClientLimits,
}

/// Identifies an admitted ticket until it completes. Ids grow with admission order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TicketId(u64);

impl TicketId {
    /// The raw number, for logs.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for TicketId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Why a ticket was not admitted. The payload is handed back with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Rejection {
    /// The tier is paused by an operator. Not counted as a rejection.
    #[error("queue tier is paused")]
    Paused,
    /// The tier holds `max_depth` tickets.
    #[error("queue full")]
    QueueFull,
    /// The waiting request bodies would exceed `max_queued_bytes`.
    #[error("queue over capacity (bytes)")]
    OverCapacity,
    /// The client already has `max_queued` tickets waiting.
    #[error("client queue full")]
    ClientQueueFull,
}

/// An admitted ticket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admitted {
    pub id: TicketId,
    /// 1-based position in its tier at admission (tickets waiting in the tier, itself included).
    pub position: u32,
    /// This admission took the tier to its high watermark (reported once per crossing).
    pub watermark_crossed: bool,
}

/// A ticket chosen to run, with the placement `place` reserved for it.
#[derive(Debug)]
pub struct Dispatch<T, P> {
    pub id: TicketId,
    pub client: Arc<str>,
    /// The tier it was dispatched from (higher than requested if it was promoted).
    pub tier: Tier,
    pub model: Option<Arc<str>>,
    /// Time since the original admission, promotions included.
    pub waited: Duration,
    pub payload: T,
    /// What `place` returned for it: the host slot the caller reserved.
    pub placement: P,
    /// How long it was held back for its model (see "Model swaps"); `None` if never.
    pub held: Option<Duration>,
}

/// What an expiry pass did to one ticket.
#[derive(Debug)]
pub enum Expiry<T> {
    /// The ticket waited `max_wait` in `tier`; answer its client (the payload is handed back).
    Expired {
        id: TicketId,
        tier: Tier,
        client: Arc<str>,
        /// Time since the original admission.
        waited: Duration,
        payload: T,
    },
    /// The ticket aged out of `from` into `to` and keeps waiting (for metrics and logs).
    Promoted {
        id: TicketId,
        client: Arc<str>,
        from: Tier,
        to: Tier,
    },
}

/// Most clients the scheduler keeps state for; beyond it idle unconfigured ones are forgotten.
pub const MAX_CLIENTS: usize = 10_000;

/// The scheduler. See the module documentation.
pub struct Scheduler<T> {
    limits: Limits,
    tiers: [TierState; 3],
    clients: HashMap<Arc<str>, ClientState>,
    waiting: HashMap<TicketId, Waiting<T>>,
    running: HashMap<TicketId, Running>,
    /// Expiries and promotions found by `next`, handed out by the next `expire`.
    pending: Vec<Expiry<T>>,
    next_id: u64,
    queued_bytes: u64,
    /// Running mean cost over all clients: the estimate for a client with no history.
    mean_cost: CostMean,
    /// The latest instant passed in; the reference for calls that take none.
    clock: Option<Instant>,
    last_sweep: Option<Instant>,
    /// The swap rule, the tickets it holds back, and when it must look again.
    swap: SwapRule,
    held: HashMap<TicketId, swap::Held>,
    swap_wake: Option<Instant>,
    /// When a ticket waiting for its conversation's busy host is to be offered again.
    later_wake: Option<Instant>,
    /// Waiting tickets per model.
    by_model: HashMap<Arc<str>, u32>,
    /// Apps whose users are scheduled in two levels, by the app's client id.
    groups: HashMap<Arc<str>, GroupState>,
}

/// A waiting ticket.
#[derive(Debug)]
struct Waiting<T> {
    client: Arc<str>,
    /// The app it is a member of.
    group: Option<Arc<str>>,
    /// Hosts it must not be placed on: those it failed on before it was put back
    /// ([`Scheduler::requeue`]); empty for a fresh ticket.
    avoid: Vec<Arc<str>>,
    tier: Tier,
    bytes: u64,
    model: Option<Arc<str>>,
    affinity: Option<Arc<crate::affinity::Chain>>,
    /// Admission instant, kept across promotions.
    enqueued: Instant,
    /// When it entered its current tier: the start of its `max_wait` and `promote_after` clocks.
    entered: Instant,
    payload: T,
}

/// A dispatched ticket, until `complete`.
#[derive(Debug)]
struct Running {
    client: Arc<str>,
    tier: Tier,
    /// Seconds charged at dispatch, and the weight it was divided by.
    estimate: f64,
    weight: f64,
    /// The app it ran for, with the app's weight at dispatch.
    group: Option<(Arc<str>, f64)>,
    /// What it waited as, to wait again as the same ticket ([`Scheduler::requeue`]).
    was: Was,
}

/// A dispatched ticket's place in the queue, kept until it completes.
#[derive(Debug, Clone)]
struct Was {
    bytes: u64,
    model: Option<Arc<str>>,
    enqueued: Instant,
    entered: Instant,
}

impl<T> fmt::Debug for Scheduler<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scheduler")
            .field("limits", &self.limits)
            .field("waiting", &self.waiting.len())
            .field("running", &self.running.len())
            .field("clients", &self.clients.len())
            .field("queued_bytes", &self.queued_bytes)
            .finish_non_exhaustive()
    }
}

impl<T> Scheduler<T> {
    /// An empty scheduler. Clients are added with `set_client` or on their first ticket.
    pub fn new(limits: Limits) -> Self {
        Scheduler {
            limits,
            tiers: [TierState::new(), TierState::new(), TierState::new()],
            clients: HashMap::new(),
            waiting: HashMap::new(),
            running: HashMap::new(),
            pending: Vec::new(),
            next_id: 0,
            queued_bytes: 0,
            mean_cost: CostMean::default(),
            clock: None,
            last_sweep: None,
            swap: SwapRule::default(),
            held: HashMap::new(),
            swap_wake: None,
            later_wake: None,
            by_model: HashMap::new(),
            groups: HashMap::new(),
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Applies new limits (a snapshot changed). Never drops a ticket: a tier now deeper than its
    /// `max_depth` only refuses admissions until it drains; a shorter `max_wait` applies to
    /// tickets already waiting (re-read `next_deadline`).
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
        for tier in Tier::ALL {
            let state = &mut self.tiers[tier.index()];
            state.rearm(limits.tier(tier));
            state.promotion_blocked = false;
        }
    }

    /// Sets a client's limits; the client is remembered while idle. Unknown clients get
    /// [`ClientLimits::default`].
    pub fn set_client(&mut self, client: &str, limits: ClientLimits) {
        let limits = limits.sanitised();
        match self.clients.get_mut(client) {
            Some(state) => {
                state.limits = limits;
                state.configured = true;
            }
            None => {
                self.clients.insert(
                    Arc::from(client),
                    ClientState::new(limits, true, self.clock),
                );
            }
        }
    }

    /// The client left the policy: back to default limits, forgotten once idle for a while.
    /// Its waiting and running tickets are untouched.
    pub fn remove_client(&mut self, client: &str) {
        if let Some(state) = self.clients.get_mut(client) {
            state.limits = ClientLimits::default();
            state.configured = false;
        }
    }

    /// Pauses or resumes admission to a tier. Waiting tickets still run.
    pub fn set_paused(&mut self, tier: Tier, paused: bool) {
        self.tiers[tier.index()].paused = paused;
    }

    /// Admits a ticket or refuses it (handing the payload back). See "Admission".
    pub fn enqueue(&mut self, now: Instant, ticket: Ticket<T>) -> Result<Admitted, (Rejection, T)> {
        self.observe(now);
        let Ticket { ask, payload } = ticket;
        let index = ask.tier.index();
        let limits = self.limits.tiers[index];
        if self.tiers[index].paused {
            return Err((Rejection::Paused, payload));
        }
        let depth = self.tiers[index].depth();
        if !self.clients.contains_key(&ask.client) && self.clients.len() >= MAX_CLIENTS {
            self.forget_idle_clients();
        }
        let client = self.client_mut(&ask.client, now);
        if let Some(member) = &ask.member
            && !client.configured
        {
            client.limits = member.limits.sanitised();
        }
        let client_queue_full = client.queue_full() || self.group_full(ask.member.as_ref());
        let rejection = if depth >= limits.max_depth as usize {
            Some(Rejection::QueueFull)
        } else if client_queue_full {
            Some(Rejection::ClientQueueFull)
        } else if self.total_depth() > 0
            && self.queued_bytes.saturating_add(ask.bytes) > self.limits.max_queued_bytes
        {
            Some(Rejection::OverCapacity)
        } else {
            None
        };
        if let Some(rejection) = rejection {
            self.tiers[index].stat.rejected += 1;
            self.client_mut(&ask.client, now).rejected += 1;
            return Err((rejection, payload));
        }

        let id = TicketId(self.next_id);
        self.next_id += 1;
        self.insert(
            id,
            Waiting {
                client: ask.client,
                group: ask.member.map(|member| member.app),
                avoid: Vec::new(),
                tier: ask.tier,
                bytes: ask.bytes,
                model: ask.model,
                affinity: ask.affinity,
                enqueued: now,
                entered: now,
                payload,
            },
            now,
        );
        let tier = &mut self.tiers[index];
        let depth = tier.depth();
        let watermark_crossed = tier.watermark_armed && limits.at_watermark(depth);
        if watermark_crossed {
            tier.watermark_armed = false;
        }
        Ok(Admitted {
            id,
            position: u32::try_from(depth).unwrap_or(u32::MAX),
            watermark_crossed,
        })
    }

    /// Puts a dispatched ticket back in the queue, waiting again as what it was: the same id
    /// (so the same place among its client's tickets), tier, admission and tier-entry instants
    /// (so its wait so far counts toward its deadline), bytes and model, with `payload` for its
    /// next dispatch. What it was charged at dispatch is refunded, and it holds nothing while
    /// it waits: its client's in-flight count is released. For a request whose host failed
    /// before it ran and that has nowhere to go now. The payload comes back for an id that is
    /// not running.
    pub fn requeue(
        &mut self,
        id: TicketId,
        payload: T,
        avoid: Vec<Arc<str>>,
        now: Instant,
    ) -> Result<(), T> {
        self.observe(now);
        let Some(run) = self.running.remove(&id) else {
            return Err(payload);
        };
        let index = run.tier.index();
        let client = self.client_mut(&run.client, now);
        client.inflight = client.inflight.saturating_sub(1);
        client.processed = client.processed.saturating_sub(1);
        client.flows[index].complete(-run.estimate / run.weight);
        if let Some((app, weight)) = &run.group
            && let Some(group) = self.groups.get_mut(app)
        {
            group.inflight = group.inflight.saturating_sub(1);
            group.flows[index].complete(-run.estimate / weight);
        }
        let stat = &mut self.tiers[index].stat;
        stat.processed = stat.processed.saturating_sub(1);
        let group = run.group.map(|(app, _)| app);
        self.insert(
            id,
            Waiting {
                client: run.client,
                group,
                avoid,
                tier: run.tier,
                bytes: run.was.bytes,
                model: run.was.model,
                // Failing over, it goes wherever a slot is free.
                affinity: None,
                enqueued: run.was.enqueued,
                entered: run.was.entered,
                payload,
            },
            now,
        );
        Ok(())
    }

    /// Removes a waiting ticket whose client went away; frees its bytes. `None` if it is not
    /// waiting (already dispatched, expired or flushed).
    pub fn cancel(&mut self, id: TicketId) -> Option<T> {
        let now = self.clock?;
        let entry = self.take(id, now)?;
        self.tiers[entry.tier.index()].stat.cancelled += 1;
        Some(entry.payload)
    }

    /// Removes every waiting ticket of `tier` (all tiers if `None`), oldest first per tier, and
    /// frees their bytes. Running requests are untouched.
    pub fn flush(&mut self, tier: Option<Tier>) -> Vec<T> {
        let Some(now) = self.clock else {
            return Vec::new();
        };
        let tiers = match tier {
            Some(tier) => vec![tier],
            None => Tier::ALL.to_vec(),
        };
        let mut flushed = Vec::new();
        for tier in tiers {
            let index = tier.index();
            let ids: Vec<TicketId> = self.tiers[index]
                .by_entry
                .iter()
                .map(|&(_, id)| id)
                .collect();
            for id in ids {
                if let Some(entry) = self.take(id, now) {
                    self.tiers[index].stat.flushed += 1;
                    flushed.push(entry.payload);
                }
            }
        }
        flushed
    }

    /// Removes every waiting ticket for which `revoked(client, payload)` holds (its client's key
    /// was revoked or expired) and frees its bytes; counted as cancelled. Running requests are
    /// untouched.
    pub fn revoke(&mut self, revoked: impl Fn(&str, &T) -> bool) -> Vec<T> {
        let Some(now) = self.clock else {
            return Vec::new();
        };
        let ids: Vec<TicketId> = self
            .waiting
            .iter()
            .filter(|(_, entry)| revoked(&entry.client, &entry.payload))
            .map(|(&id, _)| id)
            .collect();
        let mut removed = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(entry) = self.take(id, now) {
                self.tiers[entry.tier.index()].stat.cancelled += 1;
                removed.push(entry.payload);
            }
        }
        removed
    }

    /// Clients with configured limits that `keep` does not name go back to the defaults (their
    /// key was revoked or expired, or they left the config): caps follow the snapshot.
    pub fn unconfigure_others(&mut self, keep: impl Fn(&str) -> bool) {
        for (client, state) in &mut self.clients {
            if state.configured && !keep(client) {
                state.limits = ClientLimits::default();
                state.configured = false;
            }
        }
    }

    /// Tickets waiting in `tier`.
    pub fn depth(&self, tier: Tier) -> u32 {
        u32::try_from(self.tiers[tier.index()].depth()).unwrap_or(u32::MAX)
    }

    /// Tickets waiting, all tiers.
    pub fn total_depth(&self) -> u32 {
        Tier::ALL.iter().map(|&tier| self.depth(tier)).sum()
    }

    /// Request bytes waiting, all tiers.
    pub fn queued_bytes(&self) -> u64 {
        self.queued_bytes
    }

    /// Requests dispatched and not yet completed.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Every known client's figures, in no particular order.
    pub fn client_stats(&self) -> impl Iterator<Item = ClientStat> + '_ {
        let half_life = self.limits.half_life;
        let now = self.clock;
        let usage = move |client: &ClientState| {
            now.map_or(0.0, |now| client.usage.value_at(now, half_life))
        };
        let total: f64 = self.clients.values().map(usage).sum();
        self.clients.iter().map(move |(name, client)| ClientStat {
            client: name.clone(),
            weight: client.limits.weight,
            waiting: client.waiting,
            inflight: client.inflight,
            processed: client.processed,
            rejected: client.rejected,
            recent_share: if total > 0.0 {
                usage(client) / total
            } else {
                0.0
            },
            switch_charged: client.switch_charged,
        })
    }

    /// One tier's depth and counters.
    pub fn tier_stats(&self, tier: Tier) -> TierStat {
        self.tiers[tier.index()].stat()
    }

    /// At [`MAX_CLIENTS`]: forgets the least recently active tenth of the unconfigured clients
    /// with nothing waiting or running (self-named callers with auth off), so the map stays
    /// bounded between sweeps. A returning client starts level with the others.
    fn forget_idle_clients(&mut self) {
        let mut idle: Vec<(Option<Instant>, Arc<str>)> = self
            .clients
            .iter()
            .filter(|(_, client)| !client.configured && client.waiting == 0 && client.inflight == 0)
            .map(|(name, client)| (client.last_active, name.clone()))
            .collect();
        idle.sort_unstable();
        for (_, name) in idle.into_iter().take(MAX_CLIENTS / 10) {
            self.clients.remove(&name);
        }
    }

    /// Whether the app of `member` already has its `max_queued` tickets waiting, all its users
    /// together.
    fn group_full(&self, member: Option<&Member>) -> bool {
        let Some(member) = member else {
            return false;
        };
        let max_queued = self
            .clients
            .get(&member.app)
            .map_or(0, |app| app.limits.max_queued);
        max_queued != 0
            && self
                .groups
                .get(&member.app)
                .is_some_and(|group| group.waiting >= max_queued)
    }

    fn observe(&mut self, now: Instant) {
        self.clock = Some(self.clock.map_or(now, |clock| clock.max(now)));
    }

    fn client_mut(&mut self, name: &Arc<str>, now: Instant) -> &mut ClientState {
        self.clients
            .entry(name.clone())
            .or_insert_with(|| ClientState::new(ClientLimits::default(), false, Some(now)))
    }

    /// Adds a ticket to its tier and its client's queue.
    fn insert(&mut self, id: TicketId, entry: Waiting<T>, now: Instant) {
        let index = entry.tier.index();
        let half_life = self.limits.half_life;
        self.queued_bytes = self.queued_bytes.saturating_add(entry.bytes);
        let client = self
            .clients
            .entry(entry.client.clone())
            .or_insert_with(|| ClientState::new(ClientLimits::default(), false, Some(now)));
        let tier = &mut self.tiers[index];
        tier.by_entry.insert((entry.entered, id));
        if let Some(app) = &entry.group {
            let group = self.groups.entry(app.clone()).or_default();
            if client.queues[index].is_empty() {
                client.flows[index].activate(group.vclock[index], now, half_life);
                if group.active[index].is_empty() {
                    group.flows[index].activate(tier.vclock, now, half_life);
                    tier.groups.insert(app.clone());
                }
                group.active[index].insert(entry.client.clone());
            }
            group.waiting += 1;
            group.last_active = Some(now);
        } else if client.queues[index].is_empty() {
            client.flows[index].activate(tier.vclock, now, half_life);
            tier.active.insert(entry.client.clone());
        }
        client.queues[index].insert(id);
        client.waiting += 1;
        client.last_active = Some(now);
        if let Some(model) = &entry.model {
            *self.by_model.entry(model.clone()).or_default() += 1;
        }
        self.waiting.insert(id, entry);
    }

    /// Removes a waiting ticket from every index and frees its bytes.
    fn take(&mut self, id: TicketId, now: Instant) -> Option<Waiting<T>> {
        let entry = self.waiting.remove(&id)?;
        self.held.remove(&id);
        if let Some(model) = &entry.model
            && let Some(count) = self.by_model.get_mut(model)
        {
            *count -= 1;
            if *count == 0 {
                self.by_model.remove(model);
            }
        }
        let index = entry.tier.index();
        self.queued_bytes = self.queued_bytes.saturating_sub(entry.bytes);
        let tier = &mut self.tiers[index];
        tier.by_entry.remove(&(entry.entered, id));
        tier.rearm(&self.limits.tiers[index]);
        if let Some(below) = entry.tier.down() {
            self.tiers[below.index()].promotion_blocked = false;
        }
        let mut group = entry
            .group
            .as_ref()
            .and_then(|app| self.groups.get_mut(app).map(|group| (app, group)));
        if let Some((_, group)) = &mut group {
            group.waiting = group.waiting.saturating_sub(1);
        }
        if let Some(client) = self.clients.get_mut(&entry.client) {
            client.queues[index].remove(&id);
            client.waiting = client.waiting.saturating_sub(1);
            if client.queues[index].is_empty() {
                self.tiers[index].active.remove(&entry.client);
                if client.flows[index].inflight == 0 {
                    client.flows[index].idle(now);
                }
                if let Some((app, group)) = group {
                    group.active[index].remove(&entry.client);
                    if group.active[index].is_empty() {
                        self.tiers[index].groups.remove(app);
                        if group.flows[index].inflight == 0 {
                            group.flows[index].idle(now);
                        }
                    }
                }
            }
        }
        Some(entry)
    }
}
