//! The router's side of conversation affinity ([`crate::affinity`]): among the hosts that can
//! run a request, the one with the smallest expected time to first token.
//!
//! For each host, `wait + prefill`: the wait for a slot of the model's runner there (0 with
//! one free, else the soonest expected end of what runs on it, plus the tickets already
//! waiting for it in this pass), and the prefill of the prompt tokens not cached there (at
//! the host's learned rate, from answers that found nothing cached, else
//! `routing.affinity.prefill_ms_per_1k`). A conversation stays on the host that holds it
//! while that is free or about as soon free, waits for it (`Offer::Later`) while waiting costs
//! less than re-reading it elsewhere, and spills to another host when it does not. A hard
//! bound keeps affinity from piling work on one host: none is chosen for it above
//! `(1 + ε) ×` its share of the load (consistent hashing with bounded loads, as KubeAI
//! applies it).
//!
//! A request without a cached prefix anywhere is placed as before (model rank, then smooth
//! weighted round-robin) and recorded where it went.

use std::sync::Arc;
use std::time::{Duration, Instant};

use foldhash::{HashMap, HashMapExt};

use super::{ModelKey, Placement, Rank, RouteReason, Router, Strategy};
use crate::affinity::{Chain, Hold, Index, Outcome, RunnerWarmth, Slot, Verdict};
use crate::policy::{Affinity, normal_model};

/// Expected slot time of a request on a runner nothing has been learned of, in seconds.
const DEFAULT_SERVICE: f64 = 1.0;

/// The fewest cached tokens that make a host a conversation's home: below, re-reading costs
/// milliseconds and spreading the work matters more (identical short prompts, sent again and
/// again, are spread as before).
pub const MIN_CACHED_TOKENS: u32 = 128;

/// How long after its answer (or after it was last seen waiting for its host) a
/// conversation's next turn is expected there at least, keeping a slot of that host from being
/// spilled onto by another host's conversation; longer for a conversation whose re-reading
/// would take longer (see [`Index::returning`]).
const RETURN_GRACE: Duration = Duration::from_secs(1);

/// The longest a slot is held for a conversation expected back.
const RETURN_MAX: Duration = Duration::from_secs(30);

/// The longest a ticket waiting for its conversation's host goes without being offered
/// again.
const RECHECK: Duration = Duration::from_millis(500);

/// The affinity state the router keeps.
#[derive(Debug)]
pub(super) struct State {
    pub(super) settings: Affinity,
    pub(super) index: Index,
    /// Tickets told to wait for a host in the current pass, by host.
    ahead: HashMap<Arc<str>, u32>,
    /// Hosts healthy at the last snapshot, and the models resident on each: a change means
    /// the runners' caches are gone.
    seen: HashMap<Arc<str>, (bool, Vec<String>)>,
}

impl Default for State {
    fn default() -> Self {
        let settings = Affinity::default();
        Self {
            index: Index::new(settings.max_conversations as usize),
            settings,
            ahead: HashMap::new(),
            seen: HashMap::new(),
        }
    }
}

/// What the choice came to.
pub(super) enum Choice {
    Run(Placement),
    Later(Instant),
    Wait,
}

impl Router {
    /// Applies `routing.affinity`. Turning it off forgets every conversation.
    pub fn set_affinity(&mut self, settings: &Affinity) {
        let state = &mut self.affinity;
        if !settings.enabled && state.settings.enabled {
            state.index = Index::new(settings.max_conversations as usize);
        }
        state.index.set_cap(settings.max_conversations as usize);
        state.settings = settings.clone();
    }

    /// The conversations the index holds per runner.
    pub fn warmth(&self) -> Vec<RunnerWarmth> {
        self.affinity.index.warmth()
    }

    /// Starts a new pass of the scheduler over the waiting tickets.
    pub fn begin_pass(&mut self) {
        self.affinity.ahead.clear();
    }

    /// Records the answer of a conversation placed at `slot`: the runner now holds `point`.
    pub fn answered(&mut self, slot: Slot, point: crate::affinity::Point, now: Instant) {
        self.affinity.index.answered(slot, point, now);
    }

    /// A request placed at `started` on `model` at `host` (on engine slot `engine_slot`)
    /// ended; `prefill` is its prompt's time per token when nothing of it was cached.
    pub fn ended(
        &mut self,
        host: &str,
        model: &str,
        started: Instant,
        prefill: Option<f64>,
        engine_slot: Option<u32>,
        now: Instant,
    ) {
        if self.affinity.settings.enabled {
            let local = normal_model(model);
            let held = now.saturating_duration_since(started);
            self.affinity
                .index
                .ended(host, &local, started, held, prefill, engine_slot);
        }
    }

    /// The request of the conversation recorded at `slot` ended at `now`: its next turn is
    /// likely on its way (see [`Index::returning`]).
    pub fn expect_back(&mut self, slot: Slot, now: Instant) {
        self.affinity.index.expect_back(slot, now);
    }

    /// A request that named a slot of `model`'s runner at `host` found little of what oqp
    /// expected cached there: slots are no longer named there (see
    /// [`Index::stop_naming`]).
    pub fn named_slot_missed(&mut self, host: &str, model: &str) {
        let local = normal_model(model);
        if self.affinity.index.stop_naming(host, &local) {
            tracing::warn!(
                host,
                model,
                "a request sent to the slot holding its conversation found it not cached: \
                 the engine empties idle slots (llama-server -kvu or -np auto?); \
                 slots are no longer named on this host"
            );
        }
    }

    /// A request placed at `started` on `model` at `from` failed over to `to` (or went back
    /// to the queue).
    pub fn moved(
        &mut self,
        from: &str,
        to: Option<&Arc<str>>,
        model: &str,
        started: Instant,
        engine_slot: Option<u32>,
    ) {
        if self.affinity.settings.enabled {
            let local = normal_model(model);
            self.affinity
                .index
                .moved(from, to, &local, started, engine_slot);
        }
    }

    /// Forgets the runners a new snapshot shows gone: a model no longer resident where it
    /// was, or a host that went down.
    pub(super) fn forget_unloaded(&mut self) {
        if !self.affinity.settings.enabled {
            return;
        }
        let mut gone_hosts = Vec::new();
        let mut gone_runners = Vec::new();
        let mut seen = HashMap::new();
        for state in self.hosts.iter().filter(|state| state.active) {
            let name = state.host.name.clone();
            let mut loaded: Vec<String> = state.host.loaded.iter().cloned().collect();
            loaded.sort();
            let healthy = state.host.healthy;
            if let Some((was_healthy, was_loaded)) = self.affinity.seen.get(&name) {
                if *was_healthy && !healthy {
                    gone_hosts.push(name.clone());
                }
                for model in was_loaded {
                    if loaded.binary_search(model).is_err() {
                        gone_runners.push((name.clone(), model.clone()));
                    }
                }
            }
            seen.insert(name, (healthy, loaded));
        }
        for state in self.hosts.iter().filter(|state| !state.active) {
            gone_hosts.push(state.host.name.clone());
        }
        for name in self.affinity.seen.keys() {
            if !seen.contains_key(name) {
                gone_hosts.push(name.clone());
            }
        }
        self.affinity.seen = seen;
        for host in gone_hosts {
            self.affinity.index.forget_host(&host);
        }
        for (host, model) in gone_runners {
            self.affinity.index.forget_runner(&host, &model);
        }
    }

    /// Forgets what `model`'s runner at `host` held (oqp unloaded it, or a request marked the
    /// host down).
    pub(super) fn forget_runner(&mut self, host: &str, model: Option<&str>) {
        match model {
            Some(model) => self.affinity.index.forget_runner(host, model),
            None => self.affinity.index.forget_host(host),
        }
    }

    /// The choice for a request of `model` with the conversation `chain` (see the module
    /// documentation); [`choose`](Router::choose) for any other.
    pub(super) fn choose_affine(
        &mut self,
        model: Option<&ModelKey<'_>>,
        chain: Option<&Chain>,
        strategy: Strategy,
        vram: bool,
        now: Instant,
    ) -> Choice {
        let (Some(key), true) = (model, self.affinity.settings.enabled) else {
            return self.plain_choice(model, strategy, vram);
        };
        let Some(chain) = chain else {
            let mut choice = self.plain_choice(model, strategy, vram);
            if let Choice::Run(placement) = &mut choice {
                let host = placement.host.clone();
                self.affinity.index.started(&host.name, &key.local, now);
                placement.engine_slot = self.name_engine_slot(&host, key, None, now);
            }
            return choice;
        };
        let warm = self.affinity.index.lookup(chain);
        let any_healthy = self
            .hosts
            .iter()
            .any(|state| state.active && state.healthy());
        // Round-robin takes every host as able to run every model.
        let model_aware = strategy == Strategy::ModelAware;
        let candidate = |state: &super::HostState| {
            state.active
                && (!any_healthy || state.healthy())
                && (!model_aware || state.rank(key, vram) > Rank::Missing)
        };
        let cached_on = |host: &str| {
            warm.iter()
                .find(|w| &*w.host == host)
                .map_or(0, |w| w.tokens)
        };
        // Home: the candidate holding the most of the prompt.
        let home = self
            .hosts
            .iter()
            .enumerate()
            .filter(|(_, state)| candidate(state))
            .map(|(index, state)| (index, cached_on(&state.host.name)))
            .filter(|(_, tokens)| *tokens >= MIN_CACHED_TOKENS)
            .max_by_key(|(_, tokens)| *tokens);
        let Some((home, home_tokens)) = home else {
            let outcome = if chain.follow_up {
                Outcome::Miss
            } else {
                Outcome::New
            };
            let choice = self.plain_choice(model, strategy, vram);
            return self.placed(choice, chain, key, outcome, now);
        };
        let fallback_rate = self.affinity.settings.prefill_per_token;
        let epsilon = self.affinity.settings.epsilon;
        let rate = |router: &Router, host: &str| {
            router
                .affinity
                .index
                .prefill_rate(host, &key.local)
                .unwrap_or(fallback_rate)
        };
        let prefill = |router: &Router, host: &str, cached: u32| {
            f64::from(chain.tokens.saturating_sub(cached)) * rate(router, host)
        };

        // The load bound over the hosts that could take the request.
        let (mut load, mut capacity) = (0u64, 0u64);
        for state in self.hosts.iter().filter(|state| candidate(state)) {
            let ahead = self
                .affinity
                .ahead
                .get(&state.host.name)
                .copied()
                .unwrap_or(0);
            load += u64::from(state.in_use()) + u64::from(ahead);
            capacity += u64::from(state.host.max_concurrent.max(1));
        }
        let home_state = &self.hosts[home];
        let home_name = home_state.host.name.clone();
        let ahead = self.affinity.ahead.get(&home_name).copied().unwrap_or(0);
        let home_load = u64::from(home_state.in_use()) + u64::from(ahead);
        let share =
            (load + 1) as f64 * (1.0 + epsilon) * f64::from(home_state.host.max_concurrent.max(1))
                / capacity.max(1) as f64;
        let over_bound = (home_load + 1) as f64 > share.ceil();
        let home_free = home_state.has_free_slot_for(Some(&key.local)) && !home_state.unfit;
        let host_slots = home_state.host.max_concurrent.max(1);
        let slots = match home_state.host.runners.slots(&key.local).0 {
            0 => host_slots,
            slots => slots,
        };

        // The best other host with a free slot, by its expected time to first token. A slot
        // that a conversation of that host's was just answered on is not free to spill onto:
        // that conversation's next turn is likely on its way, and re-reading a whole history
        // there would delay both.
        let ahead_of = |host: &str| self.affinity.ahead.get(host).copied().unwrap_or(0);
        let alternative = self
            .hosts
            .iter()
            .enumerate()
            .filter(|(index, state)| {
                *index != home
                    && candidate(state)
                    && state.has_free_slot_for(Some(&key.local))
                    && !state.unfit
                    && state
                        .host
                        .max_concurrent
                        .saturating_sub(state.in_use())
                        .saturating_sub(ahead_of(&state.host.name))
                        > self.affinity.index.returning(
                            &state.host.name,
                            &key.local,
                            now,
                            Hold {
                                floor: RETURN_GRACE,
                                ceiling: RETURN_MAX,
                                fallback_rate,
                            },
                        )
            })
            .map(|(_, state)| prefill(self, &state.host.name, cached_on(&state.host.name)))
            .fold(None, |best: Option<f64>, secs| {
                Some(best.map_or(secs, |best| best.min(secs)))
            });

        if home_free && (!over_bound || alternative.is_none()) {
            let placement = self.reserve_runner(home, RouteReason::Loaded, Some(&key.local));
            return self.placed(Choice::Run(placement), chain, key, Outcome::Hit, now);
        }
        let Some(elsewhere) = alternative else {
            self.affinity
                .index
                .waiting(&home_name, &key.local, chain, now);
            return Choice::Wait;
        };
        let wait = self.affinity.index.wait(
            &home_name,
            &key.local,
            slots,
            host_slots,
            now,
            DEFAULT_SERVICE,
        ) + f64::from(ahead) * DEFAULT_SERVICE / f64::from(slots);
        let at_home = wait + prefill(self, &home_name, home_tokens);
        if over_bound || elsewhere < at_home {
            tracing::debug!(
                home = %home_name,
                wait,
                at_home,
                elsewhere,
                over_bound,
                home_load,
                share,
                "affinity spills"
            );
            let tried = [home_name];
            let choice = match self.choose(model, strategy, &tried, vram) {
                Some(placement) => Choice::Run(placement),
                None => Choice::Wait,
            };
            return self.placed(choice, chain, key, Outcome::Spill, now);
        }
        self.affinity
            .index
            .waiting(&home_name, &key.local, chain, now);
        *self.affinity.ahead.entry(home_name).or_insert(0) += 1;
        let recheck =
            Duration::from_secs_f64((elsewhere - at_home).clamp(0.01, RECHECK.as_secs_f64()));
        Choice::Later(now + recheck)
    }

    /// The engine slot a request placed on `host` at `now` takes, when `host` is a
    /// llama-server, whose slots oqp names so that a conversation returns to the slot that
    /// holds it (see [`Index::engine_slot`]); `slot` is where its conversation was recorded.
    fn name_engine_slot(
        &mut self,
        host: &crate::policy::Host,
        key: &ModelKey,
        slot: Option<Slot>,
        now: Instant,
    ) -> Option<crate::affinity::EngineChoice> {
        let slots = names_slots(host)?;
        self.affinity
            .index
            .engine_slot(&host.name, &key.local, slots, slot, now)
    }

    fn plain_choice(
        &mut self,
        model: Option<&ModelKey<'_>>,
        strategy: Strategy,
        vram: bool,
    ) -> Choice {
        match self.choose(model, strategy, &[], vram) {
            Some(placement) => Choice::Run(placement),
            None => Choice::Wait,
        }
    }

    /// Records a placement of `chain` in the index and counts its outcome.
    fn placed(
        &mut self,
        choice: Choice,
        chain: &Chain,
        key: &ModelKey,
        outcome: Outcome,
        now: Instant,
    ) -> Choice {
        let Choice::Run(mut placement) = choice else {
            return choice;
        };
        let host = placement.host.clone();
        let warm = self.affinity.index.lookup(chain);
        let cached_tokens = warm
            .iter()
            .find(|w| w.host == host.name)
            .map_or(0, |w| w.tokens);
        let slots = match host.runners.slots(&key.local).0 {
            0 => host.max_concurrent.max(1),
            slots => slots,
        };
        let configured = self.affinity.settings.ram_cache_per_runner;
        let capacity = slots.saturating_add(ram_allowance(&host, slots, chain.tokens, configured));
        let slot = self
            .affinity
            .index
            .place(&host.name, &key.local, capacity, chain);
        self.affinity.index.started(&host.name, &key.local, now);
        placement.engine_slot = self.name_engine_slot(&host, key, slot, now);
        placement.affinity = Some(Verdict {
            outcome,
            cached_tokens,
            slot,
        });
        Choice::Run(placement)
    }
}

/// The slots of `host` when oqp names them: a llama-server (found by its `/props`) that
/// stated its slot count.
fn names_slots(host: &crate::policy::Host) -> Option<u32> {
    (host.engine.detected.as_deref() == Some("llama-server"))
        .then_some(host.engine.learned_slots)
        .flatten()
        .filter(|slots| *slots > 0)
}

/// Conversations a runner keeps beyond its slots: `routing.affinity.ram_cache_per_runner`,
/// and on a llama-server at least what its RAM prompt cache holds of conversations of
/// `tokens` tokens. A llama-server sets aside the prompt of a slot it reuses in that cache
/// (`--cache-ram`, on by default) and restores it when the conversation comes back, to any
/// of its slots; the cache's token budget starts at the server's whole context (its slots
/// times each slot's), so at least that many tokens of set-aside conversations stay.
fn ram_allowance(host: &crate::policy::Host, slots: u32, tokens: u32, configured: u32) -> u32 {
    let llama_server = host.engine.detected.as_deref() == Some("llama-server");
    match (llama_server, host.engine.slot_context) {
        (true, Some(context)) => {
            let total = u64::from(slots) * u64::from(context);
            let held = total / u64::from(tokens.max(1));
            configured.max(u32::try_from(held).unwrap_or(u32::MAX))
        }
        _ => configured,
    }
}
