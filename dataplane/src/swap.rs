//! Model-swap-aware scheduling, the host's side: what one host's VRAM holds, whether a model can
//! run there without evicting another, and the switch from one model to another.
//!
//! A pure data structure like the [`router`](crate::router) that owns one [`HostVram`] per host:
//! no I/O, no tokio; every method that depends on time takes `now`. The rule that decides *when*
//! to switch is the scheduler's ([`crate::scheduler`], "Model swaps"); this module answers the
//! questions it asks and carries a switch out.
//!
//! # What is resident
//! The view starts from the control plane's last `/api/ps` poll (`Host::vram`) and is corrected
//! by this data plane's own dispatches between polls: a model dispatched to is resident from that
//! instant (it is loading), and the models a switch made room for are gone. A poll replaces the
//! view unless it may predate the data plane's own last change (within [`POLL_MARGIN`] of it) or a
//! switch is under way. A model the poll shows that oqp did not load is a change oqp did not
//! cause; [`BYPASS_CHANGES`] of them within [`BYPASS_WINDOW`] mean clients reach the host around
//! oqp, and swap-aware holding is then off for that host for [`BYPASS_WINDOW`] (plain fair share
//! cannot be made worse by a view that is wrong). A request oqp sent without recording its model
//! (a route whose body it does not read, or a model the host's tags do not list yet) may load
//! one too: each such dispatch ([`uncounted`](HostVram::uncounted)) excuses one unexplained model
//! in a poll taken within [`UNCOUNTED_GRACE`] of it, so a tenant's own requests through oqp never
//! count as traffic around it; only loads oqp did not send at all do.
//!
//! # Whether it fits
//! A model's footprint is its `size_vram` once seen resident, else its `/api/tags` size. The
//! capacity is `ollama.hosts[].vram` when configured. Otherwise nothing is held until the host
//! has been seen evicting (two polls in a row where a model appeared and another went): a box
//! that holds everything its users ask for gains nothing from holding. From then on the
//! capacity is the largest total seen resident together (a lower bound, so a pair never seen
//! together is taken not to fit: the cost of being wrong is one held batch, and a later poll
//! showing both teaches the larger figure). A model of unknown footprint fits only in an empty
//! VRAM.
//!
//! # A switch
//! [`begin_switch`](HostVram::begin_switch) picks the victims (least recently used first, until
//! the new model fits) and stops new work for them at once; their in-flight requests finish
//! (nothing is preempted). The wait is bounded: a switch whose victims still have requests in
//! flight after the requester's `max_defer` (its tier's) is given up, so one long request cannot
//! stop every other tenant of the old model; the victims take work again, and the next switch on
//! the host waits a full `max_defer` from then ([`Cold::gave_up_at`]). The time a switch stopped
//! the victims' work (until they drained, or until it was given up or dropped) is charged to the
//! requester, the client whose held request caused it ([`take_charges`](HostVram::take_charges)).
//! Once they have drained, the victims are optionally unloaded explicitly
//! ([`take_unloads`](HostVram::take_unloads), `keep_alive: 0`, so that Ollama evicts the model
//! chosen here and not its own pick), and the new model's requests may go, as many as there are
//! slots, so that they share one load. No request for a victim is sent while the switch is under
//! way, so no `keep_alive` can keep a model being switched away from. The first dispatch of the
//! new model completes the switch and starts its stay ([`Cold::settled_at`]).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::policy::{Host, HostKind};
pub use crate::scheduler::SwitchReason;
use crate::scheduler::{Cold, Requester};

/// A poll within this much of the data plane's own last residency change may predate it.
pub const POLL_MARGIN: Duration = Duration::from_secs(2);
/// Residency changes oqp did not cause, within [`BYPASS_WINDOW`], that turn holding off.
pub const BYPASS_CHANGES: usize = 2;
/// The window for [`BYPASS_CHANGES`], and how long holding then stays off.
pub const BYPASS_WINDOW: Duration = Duration::from_secs(600);
/// How long after a dispatch oqp did not record a poll may show the model it loaded.
pub const UNCOUNTED_GRACE: Duration = Duration::from_secs(60);
/// The most uncounted dispatches remembered per host (each excuses one unexplained model).
const UNCOUNTED_KEPT: usize = 64;
/// The load cost assumed for a model never seen loading.
pub const DEFAULT_LOAD_COST: Duration = Duration::from_secs(3);
/// The largest VRAM-to-disk ratio used to estimate an unseen model's footprint.
const MAX_FOOTPRINT_RATIO: f64 = 8.0;
/// A `load_duration` below this is a resident model's warm start, not a load.
pub const LOAD_SEEN: Duration = Duration::from_millis(100);

/// One host's model-swap state, for status pages, reports and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SwapStat {
    /// The host's name.
    pub host: Arc<str>,
    /// Models believed resident now (normalised names), with their bytes.
    pub resident: Vec<(String, u64)>,
    /// VRAM capacity in bytes: configured, else learned; `None` while unknown.
    pub capacity: Option<u64>,
    /// Whether `capacity` was learned rather than configured.
    pub capacity_learned: bool,
    /// Requests held back now for a model that is not resident.
    pub held: u32,
    /// How long the longest-held of them has been held.
    pub oldest_held: Option<Duration>,
    /// The model being switched to, while a switch waits for the old model's requests.
    pub switching_to: Option<String>,
    /// Switches since start.
    pub switches: u64,
    /// Off for this host: residency changed in ways oqp did not cause (clients bypass it).
    pub bypassed: bool,
    /// Loads seen complete since start (a response's `load_duration` showed one).
    pub loads: u64,
    /// Switches given up since start: the old model's requests outlasted the requester's
    /// `max_defer`.
    pub given_up: u64,
}

/// Whether a model can run on a host now, as far as its VRAM goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fit {
    /// Resident: run it.
    Resident,
    /// Not resident, but it fits beside what is (or the switch to it is ready): run it; the
    /// dispatch starts a load.
    Room,
    /// Not resident and it does not fit: running it would evict another model.
    Switch,
    /// A switch is under way on this host that this model must wait for.
    Blocked,
}

#[derive(Debug, Clone)]
struct Model {
    name: String,
    bytes: u64,
    inflight: u32,
    last_used: Option<Instant>,
    /// The wall-clock time of its last dispatch here: a poll older than that (within
    /// [`POLL_MARGIN`]) may not show it yet.
    touched: Option<SystemTime>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    /// The victims' in-flight requests are finishing.
    Draining,
    /// Explicit unloads sent; these have not answered yet.
    Unloading(Vec<String>),
    /// The new model's requests may go.
    Ready,
}

#[derive(Debug, Clone)]
struct Switch {
    to: String,
    victims: Vec<String>,
    phase: Phase,
    /// Unload the victims explicitly once drained.
    unload: bool,
    /// When the victims' new work stopped.
    began: Instant,
    /// Who asked for it, and how long the drain may last; `None`: unbounded, charged to no one.
    by: Option<Requester>,
}

/// One host's VRAM as this data plane sees it. See the module documentation.
#[derive(Debug, Default)]
pub struct HostVram {
    name: Arc<str>,
    cloud: bool,
    configured: Option<u64>,
    learned: u64,
    resident: Vec<Model>,
    /// Footprints seen resident (`size_vram`).
    sizes: HashMap<String, u64>,
    /// Sizes on disk (`/api/tags`), for models not seen resident yet.
    disk: HashMap<String, u64>,
    load_cost: HashMap<String, Duration>,
    switch: Option<Switch>,
    settled_at: Option<Instant>,
    /// When the last request on the host ended with nothing else in flight.
    idle_since: Option<Instant>,
    last_poll: Option<SystemTime>,
    /// The wall-clock time of this data plane's last eviction (a switch, or a load that could
    /// not fit): a poll taken within [`POLL_MARGIN`] of it may still show the victim, and
    /// teaches no capacity.
    changed_at: Option<SystemTime>,
    /// Models this data plane's view evicted, and when (wall clock).
    gone: HashMap<String, SystemTime>,
    /// The models of the last poll applied.
    last_polled: Vec<String>,
    /// Whether the host has been seen evicting (or its capacity is configured): until then
    /// every model is taken to fit and nothing is held.
    evicts: bool,
    /// Models this data plane loaded or evicted here lately, and when: a poll showing one of
    /// them is no sign of clients going around oqp.
    recent: HashMap<String, Instant>,
    foreign: VecDeque<Instant>,
    /// The wall-clock times of dispatches here whose model this view did not record, oldest
    /// first: each excuses one unexplained model in a poll within [`UNCOUNTED_GRACE`].
    uncounted: VecDeque<SystemTime>,
    bypassed_until: Option<Instant>,
    switches: u64,
    loads: u64,
    unloads: Vec<String>,
    /// When a switch was last given up here (its drain outlasted the bound).
    gave_up_at: Option<Instant>,
    given_up: u64,
    /// Drain time to charge to requesters ([`take_charges`](Self::take_charges)).
    charges: Vec<(Requester, Duration)>,
}

impl HostVram {
    /// The view of a host first seen in a snapshot.
    pub fn new(host: &Host, now: Instant) -> Self {
        let mut vram = HostVram {
            name: host.name.clone(),
            cloud: host.kind == HostKind::Cloud,
            // Nothing in flight yet: idle since now.
            idle_since: Some(now),
            ..HostVram::default()
        };
        vram.apply(host, now, SystemTime::now());
        vram
    }

    /// A local host's view with a known capacity and model footprints and nothing resident
    /// (simulations and tests).
    pub fn with_sizes(name: &str, capacity: Option<u64>, sizes: &[(&str, u64)]) -> Self {
        HostVram {
            name: Arc::from(name),
            configured: capacity,
            sizes: sizes
                .iter()
                .map(|(model, bytes)| ((*model).to_owned(), *bytes))
                .collect(),
            ..HostVram::default()
        }
    }

    /// Takes in a snapshot's view of the host: capacity, sizes, and the poll's resident models
    /// (see "What is resident").
    pub fn apply(&mut self, host: &Host, now: Instant, wall: SystemTime) {
        self.cloud = host.kind == HostKind::Cloud;
        self.configured = host.vram.capacity;
        self.disk.clone_from(&host.vram.sizes);
        for (name, bytes) in &host.vram.resident {
            if *bytes > 0 {
                self.sizes.insert(name.clone(), *bytes);
            }
        }
        for model in &mut self.resident {
            if let Some(bytes) = self.sizes.get(&model.name) {
                model.bytes = *bytes;
            }
        }
        let Some(checked) = host.last_checked else {
            return;
        };
        if self.last_poll.is_some_and(|last| checked <= last) {
            return;
        }
        let first = self.last_poll.is_none();
        self.last_poll = Some(checked);
        // The poll's resident models with their bytes; models listed only by name (an older
        // control plane) take their known size, or 0 (unknown).
        let mut polled: Vec<(String, u64)> = host.vram.resident.clone();
        for name in &host.loaded {
            if !polled.iter().any(|(m, _)| m == name) {
                polled.push((name.clone(), self.footprint(name).unwrap_or(0)));
            }
        }
        // Two polls in a row where one model appeared and another went: the host evicts, so
        // its capacity matters (keep-alive expiry at the very time of a load is rare).
        let appeared = polled.iter().any(|(m, _)| !self.last_polled.contains(m));
        let vanished = self
            .last_polled
            .iter()
            .any(|m| !polled.iter().any(|(p, _)| p == m));
        if !first && appeared && vanished && !self.evicts {
            self.evicts = true;
            tracing::debug!(host = %self.name, "the host evicts models: model-swap holding is on");
        }
        self.last_polled = polled.iter().map(|(m, _)| m.clone()).collect();
        if self.switch.is_some() {
            return;
        }
        let settled = self.changed_at.is_none_or(|at| checked >= at + POLL_MARGIN);
        if settled {
            let together: u64 = polled.iter().map(|(_, bytes)| bytes).sum();
            self.learned = self.learned.max(together);
        }
        self.recent
            .retain(|_, at| now.saturating_duration_since(*at) <= BYPASS_WINDOW);
        let fresh = |at: &SystemTime| checked < *at + POLL_MARGIN;
        let mut foreign = 0usize;
        let mut next: Vec<Model> = Vec::with_capacity(polled.len());
        for (name, bytes) in &polled {
            match self.resident.iter().find(|m| &m.name == name) {
                Some(model) => next.push(Model {
                    bytes: *bytes,
                    ..model.clone()
                }),
                // Evicted here just before the poll: it may still show.
                None if self.gone.get(name).is_some_and(fresh) => {}
                None => {
                    if !first && !self.recent.contains_key(name) {
                        foreign += 1;
                    }
                    next.push(Model {
                        name: name.clone(),
                        bytes: *bytes,
                        inflight: 0,
                        last_used: None,
                        touched: None,
                    });
                }
            }
        }
        // A model with requests in flight here, or sent here just before the poll, is resident
        // whatever the poll says.
        for model in &self.resident {
            let keep = model.inflight > 0 || model.touched.as_ref().is_some_and(fresh);
            if keep && !next.iter().any(|m| m.name == model.name) {
                next.push(model.clone());
            }
        }
        self.resident = next;
        if foreign > self.excuse(foreign, checked) {
            self.foreign_change(now, wall);
        }
        self.trim(wall);
    }

    /// Drops idle models, least recently used first, while the view holds more than the
    /// capacity: models sent here in turn before the host was known to evict, or shown by a
    /// poll beside the one that replaced them, cannot all be there.
    fn trim(&mut self, wall: SystemTime) {
        let Some(capacity) = self.capacity().filter(|_| self.holds_back()) else {
            return;
        };
        while self.resident.iter().map(|m| m.bytes).sum::<u64>() > capacity && self.evict_idle(wall)
        {
        }
    }

    /// Drops the least recently used model with nothing in flight from the view, as Ollama
    /// evicts one; false when every resident model is busy.
    fn evict_idle(&mut self, wall: SystemTime) -> bool {
        let victim = self
            .resident
            .iter()
            .enumerate()
            .filter(|(_, m)| m.inflight == 0)
            .min_by_key(|(_, m)| m.last_used)
            .map(|(i, _)| i);
        let Some(i) = victim else {
            return false;
        };
        let gone = self.resident.remove(i);
        self.recent.insert(gone.name.clone(), Instant::now());
        self.gone.insert(gone.name, wall);
        self.changed_at = Some(wall);
        true
    }

    /// A request was sent here at `wall` whose model this view did not record: the model it
    /// loads, if any, is oqp's doing, not a client's around it.
    pub fn uncounted(&mut self, wall: SystemTime) {
        if self.cloud {
            return;
        }
        if self.uncounted.len() >= UNCOUNTED_KEPT {
            self.uncounted.pop_front();
        }
        self.uncounted.push_back(wall);
    }

    /// Uses up to `count` uncounted dispatches that a poll taken at `checked` may show (sent
    /// at most [`UNCOUNTED_GRACE`] before it, or within [`POLL_MARGIN`] after: the clocks of
    /// two boxes differ a little); forgets those too old for any later poll. Returns how many
    /// unexplained models they excuse.
    fn excuse(&mut self, count: usize, checked: SystemTime) -> usize {
        self.uncounted
            .retain(|at| checked.duration_since(*at).unwrap_or_default() <= UNCOUNTED_GRACE);
        let mut excused = 0;
        while excused < count {
            let usable = self
                .uncounted
                .iter()
                .position(|at| *at <= checked + POLL_MARGIN);
            let Some(index) = usable else {
                break;
            };
            self.uncounted.remove(index);
            excused += 1;
        }
        excused
    }

    fn foreign_change(&mut self, now: Instant, _wall: SystemTime) {
        while self
            .foreign
            .front()
            .is_some_and(|at| now.saturating_duration_since(*at) > BYPASS_WINDOW)
        {
            self.foreign.pop_front();
        }
        self.foreign.push_back(now);
        if self.foreign.len() >= BYPASS_CHANGES && !self.bypassed(now) {
            self.bypassed_until = now.checked_add(BYPASS_WINDOW);
            if let Some(mut switch) = self.switch.take() {
                Self::charge(&mut self.charges, &mut switch, now);
            }
            tracing::warn!(
                host = %self.name,
                "models were loaded on this host that oqp did not send: clients reach it \
                 around oqp; model-swap holding is off for this host for 10 minutes"
            );
        }
    }

    /// Whether holding is off for this host now (clients bypass oqp).
    pub fn bypassed(&self, now: Instant) -> bool {
        self.bypassed_until.is_some_and(|until| now < until)
    }

    /// Whether `model` can run here now. Advances a draining switch whose victims are done.
    pub fn fit(&mut self, model: &str, now: Instant) -> Fit {
        if self.cloud || self.bypassed(now) {
            return Fit::Room;
        }
        let resident = self.is_resident(model);
        self.bound_drain(now);
        if let Some(switch) = &mut self.switch {
            if switch.phase == Phase::Draining {
                let drained = self
                    .resident
                    .iter()
                    .filter(|m| switch.victims.contains(&m.name))
                    .all(|m| m.inflight == 0);
                if drained {
                    Self::charge(&mut self.charges, switch, now);
                }
                if drained && switch.unload && !switch.victims.is_empty() {
                    switch.phase = Phase::Unloading(switch.victims.clone());
                    self.unloads.extend(switch.victims.iter().cloned());
                } else if drained {
                    switch.phase = Phase::Ready;
                }
            }
            if switch.to == model {
                return if switch.phase == Phase::Ready {
                    Fit::Room
                } else {
                    Fit::Blocked
                };
            }
            if switch.victims.iter().any(|v| v == model) {
                return Fit::Blocked;
            }
            return if resident {
                Fit::Resident
            } else {
                Fit::Blocked
            };
        }
        if resident {
            Fit::Resident
        } else if self.fits(model) {
            Fit::Room
        } else {
            Fit::Switch
        }
    }

    /// Gives up a switch still draining at its requester's bound: the victims take work again.
    fn bound_drain(&mut self, now: Instant) {
        let Some(switch) = &self.switch else {
            return;
        };
        let due = switch
            .by
            .as_ref()
            .and_then(|by| switch.began.checked_add(by.bound))
            .is_some_and(|at| now >= at);
        if switch.phase != Phase::Draining || !due {
            return;
        }
        let still = self
            .resident
            .iter()
            .filter(|m| switch.victims.contains(&m.name))
            .any(|m| m.inflight > 0);
        if !still {
            // Drained just now: `fit` goes on with the switch.
            return;
        }
        if let Some(mut switch) = self.switch.take() {
            Self::charge(&mut self.charges, &mut switch, now);
            self.gave_up_at = Some(now);
            self.given_up += 1;
            tracing::info!(
                host = %self.name,
                model = %switch.to,
                waited_ms = now.saturating_duration_since(switch.began).as_millis() as u64,
                "model switch given up: the old model's requests outlasted max_defer; it takes \
                 work again"
            );
        }
    }

    /// Records the drain so far against the switch's requester, once.
    fn charge(charges: &mut Vec<(Requester, Duration)>, switch: &mut Switch, now: Instant) {
        if let Some(by) = switch.by.take() {
            let drained = now.saturating_duration_since(switch.began);
            if !drained.is_zero() {
                charges.push((by, drained));
            }
        }
    }

    /// The drain time to charge: (requester, how long the switch it caused stopped the old
    /// model's new work), each once.
    pub fn take_charges(&mut self) -> Vec<(Requester, Duration)> {
        std::mem::take(&mut self.charges)
    }

    /// Like [`fit`](Self::fit), turning the need for a switch into the scheduler's question.
    pub fn cold(&self, now: Instant) -> Cold {
        let drain_until = self.switch.as_ref().and_then(|switch| {
            let by = switch
                .by
                .as_ref()
                .filter(|_| switch.phase == Phase::Draining)?;
            switch.began.checked_add(by.bound)
        });
        Cold {
            host: self.name.clone(),
            idle_since: self.idle_since,
            settled_at: self.settled_at,
            switching: self.switch.is_some() || self.bypassed(now),
            drain_until,
            gave_up_at: self.gave_up_at,
        }
    }

    /// Whether `model` (normalised) is resident in this view.
    pub fn holds(&self, model: &str) -> bool {
        self.is_resident(model)
    }

    fn is_resident(&self, model: &str) -> bool {
        self.resident.iter().any(|m| m.name == model)
    }

    /// A model's footprint in VRAM: as seen resident, else its size on disk scaled by the
    /// largest VRAM-to-disk ratio seen on this host (weights plus context take more room than
    /// the file: a model estimated at its file size would be taken to fit beside one it evicts).
    fn footprint(&self, model: &str) -> Option<u64> {
        if let Some(bytes) = self.sizes.get(model) {
            return Some(*bytes);
        }
        let disk = *self.disk.get(model)?;
        let ratio = self
            .sizes
            .iter()
            .filter_map(|(name, vram)| {
                let disk = *self.disk.get(name)?;
                (disk > 0).then(|| *vram as f64 / disk as f64)
            })
            .fold(1.0_f64, f64::max)
            .min(MAX_FOOTPRINT_RATIO);
        Some((disk as f64 * ratio) as u64)
    }

    /// The capacity in force: configured, else learned (`None` while nothing is known).
    pub fn capacity(&self) -> Option<u64> {
        self.configured
            .or((self.learned > 0).then_some(self.learned))
    }

    /// Whether `model` fits beside models of these bytes (0: unknown, taken as too large to
    /// share).
    fn fits_beside(&self, model: &str, others: impl Iterator<Item = u64>) -> bool {
        let used = others.fold(0u64, |used, bytes| {
            used.saturating_add(if bytes == 0 { u64::MAX / 4 } else { bytes })
        });
        match (self.capacity(), self.footprint(model)) {
            (Some(capacity), Some(size)) => used.saturating_add(size) <= capacity,
            _ => used == 0,
        }
    }

    /// Whether holding applies here: the capacity is configured, or the host was seen
    /// evicting. Until then every model is taken to fit (Ollama's own behaviour).
    pub fn holds_back(&self) -> bool {
        self.configured.is_some() || self.evicts
    }

    fn fits(&self, model: &str) -> bool {
        !self.holds_back()
            || self.resident.is_empty()
            || self.fits_beside(model, self.resident.iter().map(|m| m.bytes))
    }

    /// Starts switching to `model` at `now`: picks the victims (least recently used first, until
    /// the model fits) and stops new work for them; with `unload`, the victims are to be
    /// unloaded explicitly once drained ([`take_unloads`](Self::take_unloads)). With `by`, the
    /// drain lasts at most `by.bound` and its time is charged to `by`. Returns the victims.
    pub fn begin_switch(
        &mut self,
        model: &str,
        unload: bool,
        by: Option<Requester>,
        now: Instant,
    ) -> Vec<String> {
        if self.switch.is_some() || self.is_resident(model) {
            return Vec::new();
        }
        let mut order: Vec<&Model> = self.resident.iter().collect();
        order.sort_by_key(|m| m.last_used);
        let mut evicted = 0;
        while evicted < order.len()
            && !self.fits_beside(model, order[evicted..].iter().map(|m| m.bytes))
        {
            evicted += 1;
        }
        let victims: Vec<String> = order[..evicted].iter().map(|m| m.name.clone()).collect();
        self.switch = Some(Switch {
            to: model.to_owned(),
            victims: victims.clone(),
            phase: Phase::Draining,
            unload,
            began: now,
            by,
        });
        victims
    }

    /// The victims to unload explicitly now: those of a switch whose in-flight requests have
    /// finished, once. Each must be answered with [`unloaded`](Self::unloaded).
    pub fn take_unloads(&mut self) -> Vec<String> {
        std::mem::take(&mut self.unloads)
    }

    /// Whether drain time to charge or an unload waits to be taken.
    pub fn has_pending(&self) -> bool {
        !self.charges.is_empty() || !self.unloads.is_empty()
    }

    /// An explicit unload of `model` answered (or failed: Ollama evicts it on the load anyway).
    pub fn unloaded(&mut self, model: &str) {
        if let Some(switch) = &mut self.switch
            && let Phase::Unloading(pending) = &mut switch.phase
        {
            pending.retain(|m| m != model);
            if pending.is_empty() {
                switch.phase = Phase::Ready;
            }
        }
    }

    /// Drops a switch whose model no longer has anything waiting. Victims already told to
    /// unload are gone from the view (their next request is a load, and is charged as one);
    /// those still draining stay resident. A drain not charged yet is charged now (a requester
    /// that leaves still pays for the wait it caused).
    pub fn abort_switch(&mut self, now: Instant) -> Option<String> {
        let mut switch = self.switch.take()?;
        if switch.phase == Phase::Draining {
            Self::charge(&mut self.charges, &mut switch, now);
        }
        self.unloads.clear();
        if switch.phase != Phase::Draining && switch.unload {
            let wall = SystemTime::now();
            self.resident.retain(|m| !switch.victims.contains(&m.name));
            for victim in switch.victims {
                self.gone.insert(victim, wall);
            }
            self.changed_at = Some(wall);
        }
        Some(switch.to)
    }

    /// The model a switch is under way to.
    pub fn switching_to(&self) -> Option<&str> {
        self.switch.as_ref().map(|s| s.to.as_str())
    }

    /// A request for `model` was sent here. Returns whether it starts a load (the model was
    /// not resident), in which case the switch to it, if any, is complete.
    pub fn dispatched(&mut self, model: &str, now: Instant, wall: SystemTime) -> bool {
        self.idle_since = None;
        if let Some(m) = self.resident.iter_mut().find(|m| m.name == model) {
            m.inflight += 1;
            m.last_used = Some(now);
            m.touched = Some(wall);
            return false;
        }
        if self.cloud {
            return false;
        }
        match self.switch.take() {
            Some(switch) if switch.to == model => {
                self.resident.retain(|m| !switch.victims.contains(&m.name));
                self.settled_at = Some(now);
                self.switches += 1;
                for victim in &switch.victims {
                    self.recent.insert(victim.clone(), now);
                    self.gone.insert(victim.clone(), wall);
                    self.changed_at = Some(wall);
                }
            }
            other => {
                self.switch = other;
                // Sent without a switch (holding is off, or a failover): Ollama evicts what it
                // must; assume the least recently used idle models go.
                while !self.fits(model) && self.evict_idle(wall) {}
            }
        }
        self.recent.insert(model.to_owned(), now);
        let bytes = self.footprint(model).unwrap_or(0);
        self.resident.push(Model {
            name: model.to_owned(),
            bytes,
            inflight: 1,
            last_used: Some(now),
            touched: Some(wall),
        });
        self.gone.remove(model);
        true
    }

    /// A request for `model` sent here ended with this `load_duration`: one of at least
    /// [`LOAD_SEEN`] counts as a load (whoever started it) and teaches the model's load cost.
    pub fn completed(&mut self, model: &str, load: Option<Duration>, now: Instant) {
        if let Some(m) = self.resident.iter_mut().find(|m| m.name == model) {
            m.inflight = m.inflight.saturating_sub(1);
            m.last_used = Some(now);
        }
        if let Some(load) = load.filter(|load| *load >= LOAD_SEEN) {
            self.loads += 1;
            let cost = self.load_cost.entry(model.to_owned()).or_insert(load);
            *cost = cost.mul_f64(0.7) + load.mul_f64(0.3);
        }
        if self.resident.iter().all(|m| m.inflight == 0) {
            self.idle_since = Some(now);
        }
    }

    /// What loading `model` costs: learned from `load_duration`, else [`DEFAULT_LOAD_COST`].
    pub fn load_cost(&self, model: &str) -> Duration {
        self.load_cost
            .get(model)
            .copied()
            .unwrap_or(DEFAULT_LOAD_COST)
    }

    /// The state for status pages (held requests are the scheduler's, filled in by the caller).
    pub fn stat(&self, now: Instant) -> SwapStat {
        SwapStat {
            host: self.name.clone(),
            resident: self
                .resident
                .iter()
                .map(|m| (m.name.clone(), m.bytes))
                .collect(),
            capacity: self.capacity(),
            capacity_learned: self.configured.is_none() && self.learned > 0,
            held: 0,
            oldest_held: None,
            switching_to: self.switch.as_ref().map(|s| s.to.clone()),
            switches: self.switches,
            bypassed: self.bypassed(now),
            loads: self.loads,
            given_up: self.given_up,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod rule_tests;
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
