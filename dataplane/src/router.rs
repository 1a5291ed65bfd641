//! Host choice: which upstream host a dispatched request goes to.
//!
//! A pure data structure, like the [`scheduler`](crate::scheduler): no I/O, no tokio, no clock.
//! The dispatcher owns one [`Router`] for the life of the process and feeds it every new
//! snapshot ([`update`](Router::update)); its state is keyed by host name, so slots in use,
//! round-robin position and local observations survive snapshot swaps.
//!
//! # Choice
//! 1. **Candidates** are the hosts believed healthy: the snapshot says `healthy` and no request
//!    has marked the host down since the last poll ([`mark_down`](Router::mark_down)). If no host
//!    is healthy, every host is a candidate: health is a cached observation and must not
//!    black-hole the proxy.
//! 2. **A free slot is required, on the host and on the model's runner.** A host with
//!    `max_concurrent` requests in flight is never chosen, nor one whose runner for the model
//!    (Ollama runs each loaded model with its own `num_parallel` slots, one for embedding models
//!    and the architectures it forces) has all its slots taken; the request waits in the proxy's
//!    queue (where tiers and fair share apply), not in Ollama's FIFO. [`place`](Router::place) then returns `None` and the scheduler tries another
//!    ticket or waits for a [`SlotGuard`] to drop.
//! 3. **Model preference** (`model_aware` with a model): among candidates with a free slot, a host
//!    where the model is loaded (`/api/ps`), else one where it is installed (`/api/tags`). A
//!    host without the model is a fallback used only when *no* candidate has it, busy or not:
//!    a local Ollama answers an uninstalled model with 404, so a request waits for a busy host
//!    that has the model rather than being sent where it would fail. Names compare as Ollama
//!    compares them ([`normalize_model`]); on cloud hosts the `:cloud`/`-cloud` suffix is ignored.
//!    `round_robin` ignores the model among Ollama hosts, but not for engines (`openai` hosts,
//!    which answer any name with their one model): when a candidate lists the model, an engine
//!    that does not is never chosen, and an Ollama host is not chosen for a model that only
//!    engines list.
//! 4. **Ties** go by smooth weighted round-robin (nginx's): deterministic and interleaved, so
//!    weights 2:1 give A, B, A, A, B, A… — exactly 2:1 over every three picks of a stable
//!    candidate set, never a burst. Each host keeps its own position and a pick only moves the
//!    hosts it chose among, so picks over other candidate sets (other models, failover) do not
//!    shift everyone's turn as the Python proxy's one shared counter did.
//!
//! # Local observations
//! A connection failure ([`mark_down`](Router::mark_down)) and a 404 "model not found"
//! ([`forget_model`](Router::forget_model)) take effect at once and last until a snapshot
//! carries a newer poll of that host (a later `last_checked`, a changed `healthy` or a new URL).
//!
//! # Capacity is RAII
//! A [`Placement`] holds a [`SlotGuard`]; the slot frees when the guard drops (keep it in the
//! response body). Dropping it calls the router's release hook, so the dispatcher can run the
//! scheduler again. The guard touches only an atomic counter, never the router's lock, so it can
//! drop anywhere, even while the dispatcher holds the lock.

mod affinity;
mod model;
mod slot;
mod union;
mod vram;

#[cfg(test)]
#[allow(clippy::expect_used, clippy::unwrap_used)]
mod tests;
#[cfg(test)]
#[allow(clippy::expect_used, clippy::unwrap_used)]
mod vram_tests;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};

use crate::policy::{Host, HostKind, ModelSwap, Policy, Strategy, normalize_model};
use crate::swap::HostVram;

pub use model::{is_model_not_found, strip_cloud_suffix};
pub use vram::Placing;

/// How well `host` matches `model`, as the router ranks it: 2 loaded, 1 installed, 0 neither.
pub fn model_rank(host: &Host, model: &str) -> u8 {
    let key = ModelKey::new(model);
    let name = key.listed_by(host.kind);
    if host.loaded.contains(name) {
        2
    } else if host.installed.contains(name) {
        1
    } else {
        0
    }
}
pub use affinity::MIN_CACHED_TOKENS;
pub use slot::{ReleaseHook, SlotGuard};
pub use union::{union_openai_models, union_ps, union_tags};

use model::ModelKey;

/// Under `round_robin` in a fleet with engines (`openai` hosts), who lists the requested model.
/// `round_robin` ignores models among Ollama hosts (they are meant to be alike), but an engine
/// answers any model name with the one model it serves: so a request goes to an engine only
/// when the engine lists its model, and to an Ollama host only when the model is not one that
/// engines alone list (it would be Ollama's 404).
#[derive(Clone, Copy, Debug, Default)]
struct EngineSplit {
    /// An `openai` candidate lists the model.
    engine_lists_it: bool,
    /// A candidate of another kind lists it.
    other_lists_it: bool,
}

impl EngineSplit {
    /// Whether `state` (its `rank` set for this model) may take the request.
    fn takes(self, state: &HostState) -> bool {
        if state.host.kind == HostKind::Openai {
            state.rank > Rank::Missing
        } else {
            self.other_lists_it || !self.engine_lists_it
        }
    }
}

/// Why a host was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RouteReason {
    /// The model is loaded on the host.
    Loaded,
    /// The model is installed on the host.
    Installed,
    /// No candidate host has the model; any host was taken.
    Fallback,
    /// No model to match (`round_robin` strategy or no `model` in the body).
    RoundRobin,
}

/// A host chosen for a request, with its slot reserved until `slot` drops.
#[derive(Debug)]
pub struct Placement {
    /// The chosen host, from the snapshot the router last saw.
    pub host: Arc<Host>,
    /// Why it was chosen.
    pub reason: RouteReason,
    /// The reserved slot.
    pub slot: SlotGuard,
    /// The dispatch starts loading the model on the host (it was not resident).
    pub loads: bool,
    /// How its conversation's prompt cache decided the host, when it has one.
    pub affinity: Option<crate::affinity::Verdict>,
    /// The engine slot it takes, on a host whose slots oqp names (a llama-server's
    /// `id_slot`).
    pub engine_slot: Option<crate::affinity::EngineChoice>,
}

/// Routing decisions taken so far, by reason (for `oqp_routing_decisions_total{reason}`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Decisions {
    /// [`RouteReason::Loaded`].
    pub loaded: u64,
    /// [`RouteReason::Installed`].
    pub installed: u64,
    /// [`RouteReason::Fallback`].
    pub fallback: u64,
    /// [`RouteReason::RoundRobin`].
    pub round_robin: u64,
}

/// One model runner of a host (for status, reports and metrics).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunnerStat {
    /// The model, normalised.
    pub model: String,
    /// Its slots.
    pub slots: u32,
    /// Requests in flight on it.
    pub in_flight: u32,
    /// Why Ollama runs it with one slot, if it forces that.
    pub forced: Option<Arc<str>>,
    /// Conversations the prefix index believes warm in its prompt cache.
    pub warm: u32,
}

/// One host as the router sees it (for status and metrics).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostStat {
    /// The host's name.
    pub name: Arc<str>,
    /// Slots reserved now.
    pub slots_in_use: u32,
    /// The host's slot limit.
    pub max_concurrent: u32,
    /// Whether a request marked it down since the last poll.
    pub marked_down: bool,
    /// Models removed locally after a 404 since the last poll.
    pub forgotten_models: usize,
    /// Its runners: those resident at the last poll and those used from here, by model.
    pub runners: Vec<RunnerStat>,
}

/// Host choice state that lives across snapshots. See the module documentation.
#[derive(Default)]
pub struct Router {
    /// Hosts of the current snapshot in its order, then retired hosts that still have slots in
    /// use (kept so that a host removed and re-added keeps counting its running requests).
    hosts: Vec<HostState>,
    decisions: Decisions,
    on_release: Option<ReleaseHook>,
    /// `queue.model_swap`: whether placement looks at VRAM (see [`crate::swap`]).
    swap: ModelSwap,
    /// Switches under way: host → the model as the scheduler named it.
    switching: HashMap<Arc<str>, Arc<str>>,
    /// Conversation affinity: settings, the prefix index, the outcomes.
    affinity: affinity::State,
}

struct HostState {
    host: Arc<Host>,
    /// In the current snapshot (retired hosts are never chosen).
    active: bool,
    /// Smooth weighted round-robin position.
    current: i64,
    in_use: Arc<AtomicU32>,
    /// Requests in flight per model runner (normalised name), for the models the host lists.
    runners: HashMap<String, Arc<AtomicU32>>,
    /// Marked down by a request since the last poll.
    down: bool,
    /// Normalised models removed after a 404 since the last poll.
    forgotten: HashSet<String>,
    /// Scratch: the rank for the model of the decision in progress.
    rank: Rank,
    /// Scratch: the host cannot take the model of the decision in progress now (its VRAM would
    /// have to switch, or a switch is under way): treated as busy.
    unfit: bool,
    /// What its VRAM holds, as far as this data plane knows.
    vram: HostVram,
}

/// How well a host matches the requested model; ordered worst to best.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Rank {
    Missing,
    Installed,
    Loaded,
}

impl RouteReason {
    /// Every reason, in a stable order.
    pub const ALL: [RouteReason; 4] = [
        RouteReason::Loaded,
        RouteReason::Installed,
        RouteReason::Fallback,
        RouteReason::RoundRobin,
    ];

    /// The fine-grained name: `loaded`, `installed`, `fallback`, `round_robin`.
    pub fn as_str(self) -> &'static str {
        match self {
            RouteReason::Loaded => "loaded",
            RouteReason::Installed => "installed",
            RouteReason::Fallback => "fallback",
            RouteReason::RoundRobin => "round_robin",
        }
    }

    /// The `reason` label of `oqp_routing_decisions_total`: `model_match` (loaded or
    /// installed), `fallback` or `round_robin`.
    pub fn metric_label(self) -> &'static str {
        match self {
            RouteReason::Loaded | RouteReason::Installed => "model_match",
            RouteReason::Fallback => "fallback",
            RouteReason::RoundRobin => "round_robin",
        }
    }
}

impl Decisions {
    /// The count for one reason.
    pub fn get(&self, reason: RouteReason) -> u64 {
        match reason {
            RouteReason::Loaded => self.loaded,
            RouteReason::Installed => self.installed,
            RouteReason::Fallback => self.fallback,
            RouteReason::RoundRobin => self.round_robin,
        }
    }

    fn count(&mut self, reason: RouteReason) {
        let counter = match reason {
            RouteReason::Loaded => &mut self.loaded,
            RouteReason::Installed => &mut self.installed,
            RouteReason::Fallback => &mut self.fallback,
            RouteReason::RoundRobin => &mut self.round_robin,
        };
        *counter += 1;
    }
}

impl Router {
    /// A router for the hosts of `policy`.
    pub fn new(policy: &Policy) -> Self {
        let mut router = Router::default();
        router.update(policy);
        router
    }

    /// Sets the hook called whenever a slot frees (applies to slots reserved from now on).
    pub fn set_release_hook(&mut self, hook: ReleaseHook) {
        self.on_release = Some(hook);
    }

    /// Takes in a new snapshot's hosts. See [`update_hosts`](Router::update_hosts).
    pub fn update(&mut self, policy: &Policy) {
        self.set_swap(policy.queue.model_swap);
        self.set_affinity(&policy.routing.affinity);
        self.update_hosts(&policy.hosts);
    }

    /// Takes in a new host table: state is kept by host name; local down marks and model
    /// removals are dropped for each host whose poll result is newer than the one they were
    /// made against; a removed host is kept (never chosen) until its running requests end.
    pub fn update_hosts(&mut self, hosts: &[Arc<Host>]) {
        let now = Instant::now();
        let wall = std::time::SystemTime::now();
        let mut old: HashMap<Arc<str>, HostState> = self
            .hosts
            .drain(..)
            .map(|state| (state.host.name.clone(), state))
            .collect();
        for host in hosts {
            let state = match old.remove(&host.name) {
                Some(mut state) => {
                    let newer_poll = host.last_checked > state.host.last_checked
                        || host.healthy != state.host.healthy
                        || host.url != state.host.url;
                    if newer_poll {
                        state.down = false;
                        state.forgotten.clear();
                    }
                    state.vram.apply(host, now, wall);
                    state.runners.retain(|model, in_use| {
                        in_use.load(Ordering::Acquire) > 0
                            || host.installed.contains(model)
                            || host.loaded.contains(model)
                    });
                    state.host = host.clone();
                    state.active = true;
                    state
                }
                None => HostState::new(host.clone(), now),
            };
            self.hosts.push(state);
        }
        let mut retired: Vec<HostState> = old
            .into_values()
            .filter(|state| state.in_use.load(Ordering::Acquire) > 0)
            .collect();
        retired.sort_by(|a, b| a.host.name.cmp(&b.host.name));
        for mut state in retired {
            state.active = false;
            self.hosts.push(state);
        }
        self.forget_unloaded();
    }

    /// Chooses a host for a request for `model` and reserves a slot on it; `None` when no
    /// candidate host has a free slot (or there is no host). `round_robin` ignores the model.
    pub fn place(&mut self, model: Option<&str>, strategy: Strategy) -> Option<Placement> {
        let key = model.map(ModelKey::new);
        self.choose(key.as_ref(), strategy, &[], false)
    }

    /// Chooses another host for the same request after a connect error, timeout or busy 503
    /// before the first byte: the same preference order, excluding the hosts in `tried`.
    /// Reserves a slot; `None` when no untried candidate has a free slot.
    pub fn failover(
        &mut self,
        model: Option<&str>,
        strategy: Strategy,
        tried: &[Arc<str>],
    ) -> Option<Placement> {
        let key = model.map(ModelKey::new);
        self.choose(key.as_ref(), strategy, tried, false)
    }

    /// Marks a host down after a connection failure, until a newer poll of it arrives.
    pub fn mark_down(&mut self, host: &str) {
        if let Some(state) = self.state_mut(host) {
            state.down = true;
        }
        // Whatever its runners held may be gone with it.
        self.forget_runner(host, None);
    }

    /// Removes `(host, model)` from the routing table after a 404 "model not found", until a
    /// newer poll of the host arrives. Only a model the host lists is remembered (any other
    /// already ranks as missing), so the set is bounded by the host's own inventory, whatever
    /// names clients send.
    pub fn forget_model(&mut self, host: &str, model: &str) {
        if let Some(state) = self.state_mut(host) {
            let mut names = vec![normalize_model(model)];
            if state.host.kind == HostKind::Cloud {
                names.push(normalize_model(strip_cloud_suffix(model)));
            }
            for name in names {
                if state.host.installed.contains(&name) || state.host.loaded.contains(&name) {
                    state.forgotten.insert(name);
                }
            }
        }
    }

    /// Slots reserved on a host now (0 for an unknown host).
    pub fn slots_in_use(&self, host: &str) -> u32 {
        self.hosts
            .iter()
            .find(|state| &*state.host.name == host)
            .map_or(0, |state| state.in_use.load(Ordering::Acquire))
    }

    /// Decisions taken so far, by reason.
    pub fn decisions(&self) -> Decisions {
        self.decisions
    }

    /// Every host of the current snapshot, in its order.
    pub fn stats(&self) -> Vec<HostStat> {
        let warmth = self.warmth();
        self.hosts
            .iter()
            .filter(|state| state.active)
            .map(|state| {
                let mut runners = state.runner_stats();
                for runner in &mut runners {
                    runner.warm = warmth
                        .iter()
                        .find(|warm| warm.host == state.host.name && warm.model == runner.model)
                        .map_or(0, |warm| warm.conversations);
                }
                HostStat {
                    name: state.host.name.clone(),
                    slots_in_use: state.in_use.load(Ordering::Acquire),
                    max_concurrent: state.host.max_concurrent,
                    marked_down: state.down,
                    forgotten_models: state.forgotten.len(),
                    runners,
                }
            })
            .collect()
    }

    fn state_mut(&mut self, host: &str) -> Option<&mut HostState> {
        self.hosts
            .iter_mut()
            .find(|state| state.active && &*state.host.name == host)
    }

    /// The choice (see the module documentation) for a request for `key`. With `vram`,
    /// "loaded" means resident in this data plane's VRAM view, and hosts marked `unfit` count
    /// as busy.
    fn choose(
        &mut self,
        key: Option<&ModelKey<'_>>,
        strategy: Strategy,
        tried: &[Arc<str>],
        vram: bool,
    ) -> Option<Placement> {
        let any_healthy = self
            .hosts
            .iter()
            .any(|state| state.active && state.healthy());
        let candidate = |state: &HostState| {
            state.active
                && (!any_healthy || state.healthy())
                && !tried.iter().any(|name| *name == state.host.name)
        };
        // The runner counts whatever the strategy: round-robin hosts run models too.
        let runner = key.map(|key| &*key.local);
        let engines = key
            .filter(|_| strategy == Strategy::RoundRobin)
            .and_then(|key| self.engine_split(key, vram, &candidate));
        let model = match strategy {
            Strategy::ModelAware => key,
            Strategy::RoundRobin => None,
        };

        // Which rank to pick among: the best one with a free slot, and hosts without the model
        // only when no candidate has it at all.
        let (wanted, reason) = match model {
            None => (None, RouteReason::RoundRobin),
            Some(key) => {
                let mut best_free: Option<Rank> = None;
                let mut anyone_has_it = false;
                for state in self.hosts.iter_mut().filter(|state| candidate(state)) {
                    let rank = state.rank(key, vram);
                    state.rank = rank;
                    anyone_has_it |= rank > Rank::Missing;
                    if state.has_free_slot_for(runner) && !state.unfit {
                        best_free = best_free.max(Some(rank));
                    }
                }
                match best_free {
                    Some(Rank::Loaded) => (Some(Rank::Loaded), RouteReason::Loaded),
                    Some(Rank::Installed) => (Some(Rank::Installed), RouteReason::Installed),
                    Some(Rank::Missing) if !anyone_has_it => {
                        (Some(Rank::Missing), RouteReason::Fallback)
                    }
                    _ => return None,
                }
            }
        };

        // Smooth weighted round-robin over the chosen set: every member advances by its
        // weight, the largest wins (the first in configuration order on ties) and pays the total.
        let mut total: i64 = 0;
        let mut best: Option<(usize, i64)> = None;
        for (index, state) in self.hosts.iter_mut().enumerate() {
            if !candidate(state) || !state.has_free_slot_for(runner) || state.unfit {
                continue;
            }
            // `rank` was set by the pass above for every candidate.
            if wanted.is_some_and(|wanted| state.rank != wanted) {
                continue;
            }
            if engines.is_some_and(|split| !split.takes(state)) {
                continue;
            }
            let weight = i64::from(state.host.weight.max(1));
            state.current += weight;
            total += weight;
            if best.is_none_or(|(_, current)| state.current > current) {
                best = Some((index, state.current));
            }
        }
        let (index, _) = best?;
        self.hosts.get_mut(index)?.current -= total;
        Some(self.reserve_runner(index, reason, runner))
    }

    /// Under `round_robin`, which kinds of candidate host may take a request naming `model`
    /// ([`EngineSplit`]); `None` when the fleet has no `openai` candidate or no candidate lists
    /// the model (every host stays a candidate, as before). Sets each candidate's `rank`.
    fn engine_split(
        &mut self,
        model: &ModelKey,
        vram: bool,
        candidate: &impl Fn(&HostState) -> bool,
    ) -> Option<EngineSplit> {
        let mut split = EngineSplit::default();
        let mut any_engine = false;
        for state in self.hosts.iter_mut().filter(|state| candidate(state)) {
            let rank = state.rank(model, vram);
            state.rank = rank;
            let engine = state.host.kind == HostKind::Openai;
            any_engine |= engine;
            if rank > Rank::Missing {
                if engine {
                    split.engine_lists_it = true;
                } else {
                    split.other_lists_it = true;
                }
            }
        }
        (any_engine && (split.engine_lists_it || split.other_lists_it)).then_some(split)
    }

    /// Reserves a slot on host `index` (and on the model's runner there) for a request
    /// placed for `reason`, with `model` the model (normalised).
    fn reserve_runner(
        &mut self,
        index: usize,
        reason: RouteReason,
        model: Option<&str>,
    ) -> Placement {
        let on_release = self.on_release.clone();
        let state = &mut self.hosts[index];
        state.in_use.fetch_add(1, Ordering::AcqRel);
        let runner = model.and_then(|model| state.take_runner_slot(model));
        self.decisions.count(reason);
        Placement {
            host: state.host.clone(),
            reason,
            slot: SlotGuard {
                in_use: state.in_use.clone(),
                runner,
                on_release,
            },
            loads: false,
            affinity: None,
            engine_slot: None,
        }
    }
}

impl fmt::Debug for Router {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Router")
            .field("hosts", &self.stats())
            .field("decisions", &self.decisions)
            .finish_non_exhaustive()
    }
}

impl HostState {
    fn new(host: Arc<Host>, now: Instant) -> Self {
        HostState {
            vram: HostVram::new(&host, now),
            unfit: false,
            host,
            active: true,
            current: 0,
            in_use: Arc::new(AtomicU32::new(0)),
            runners: HashMap::new(),
            down: false,
            forgotten: HashSet::new(),
            rank: Rank::Missing,
        }
    }

    fn healthy(&self) -> bool {
        self.host.healthy && !self.down
    }

    fn has_free_slot(&self) -> bool {
        self.in_use() < self.host.max_concurrent
    }

    /// Slots reserved on the host now.
    fn in_use(&self) -> u32 {
        self.in_use.load(Ordering::Acquire)
    }

    /// A free slot on the host and, for a request for `runner` (a normalised model name),
    /// on that model's runner there. A cloud host has no runners of ours to count.
    fn has_free_slot_for(&self, runner: Option<&str>) -> bool {
        self.has_free_slot()
            && runner.is_none_or(|model| {
                self.host.kind == HostKind::Cloud
                    || self
                        .runners
                        .get(model)
                        .map_or(0, |in_use| in_use.load(Ordering::Acquire))
                        < self.host.runners.slots(model).0
            })
    }

    /// Counts one request on `model`'s runner, for a model the host lists (one it lacks is
    /// answered 404 and starts no runner); the counter the slot guard releases.
    fn take_runner_slot(&mut self, model: &str) -> Option<Arc<AtomicU32>> {
        if self.host.kind == HostKind::Cloud
            || !(self.host.installed.contains(model) || self.host.loaded.contains(model))
        {
            return None;
        }
        // Looked up before an entry is made: the key is copied only for a new runner.
        let in_use = match self.runners.get(model) {
            Some(in_use) => in_use.clone(),
            None => {
                let in_use = Arc::new(AtomicU32::new(0));
                self.runners.insert(model.to_owned(), in_use.clone());
                in_use
            }
        };
        in_use.fetch_add(1, Ordering::AcqRel);
        Some(in_use)
    }

    /// The runners worth showing: resident at the last poll, or used from here since (a
    /// model the host lists: the set stays bounded by its inventory).
    fn runner_stats(&self) -> Vec<RunnerStat> {
        if self.host.kind == HostKind::Cloud {
            return Vec::new();
        }
        let mut models: Vec<&String> = self.host.loaded.iter().collect();
        for model in self.runners.keys() {
            if !self.host.loaded.contains(model) {
                models.push(model);
            }
        }
        models.sort();
        models
            .into_iter()
            .map(|model| {
                let (slots, forced) = self.host.runners.slots(model);
                RunnerStat {
                    model: model.clone(),
                    slots,
                    in_flight: self
                        .runners
                        .get(model)
                        .map_or(0, |in_use| in_use.load(Ordering::Acquire)),
                    forced: forced.cloned(),
                    warm: 0,
                }
            })
            .collect()
    }

    fn rank(&self, model: &ModelKey, vram: bool) -> Rank {
        let name = model.listed_by(self.host.kind);
        if !self.forgotten.is_empty() && self.forgotten.contains(name) {
            Rank::Missing
        } else if if vram {
            self.vram.holds(name)
        } else {
            self.host.loaded.contains(name)
        } {
            Rank::Loaded
        } else if self.host.installed.contains(name) {
            Rank::Installed
        } else {
            Rank::Missing
        }
    }
}
