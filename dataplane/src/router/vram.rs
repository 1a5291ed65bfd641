//! The router's side of model-swap-aware scheduling: placement that knows what each host's VRAM
//! holds ([`crate::swap::HostVram`]), answering the scheduler's [`Offer`]s and carrying out the
//! switches it decides.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use super::affinity::Choice;
use super::{ModelKey, Placement, Router, Strategy};
use crate::policy::{Host, ModelSwap, normal_model};
use crate::scheduler::{Offer, Placer, Requester};
use crate::swap::{Fit, SwapStat, SwitchReason};

impl Router {
    /// Applies `queue.model_swap`. Turning it off drops the switches under way.
    pub fn set_swap(&mut self, swap: ModelSwap) {
        if !swap.enabled {
            self.switching.clear();
            let now = Instant::now();
            for state in &mut self.hosts {
                state.vram.abort_switch(now);
            }
        }
        self.swap = swap;
    }

    /// Whether placement looks at VRAM.
    pub fn swap_enabled(&self) -> bool {
        self.swap.enabled
    }

    /// [`place`](Router::place) that knows VRAM. Among the candidate hosts that have the model
    /// (installed or resident): `Run` on one with a free slot where the model is resident or
    /// fits (the router's usual order among them); else, when a switch to this model is under
    /// way, `Cold` for that host (its batch waits there: no second host switches for it); else
    /// `Wait` if a busy host has the model resident or room for it (better than a switch);
    /// else `Cold` for a host that would have to switch (one with a free slot first: a switch
    /// on a busy host waits for its victims' requests anyway), or that is switching to
    /// another model; else `Wait`. A model no candidate has is placed as [`crate::router::Router::place`] does and
    /// never held (it would only evict others to answer 404). A `Run` is recorded as
    /// dispatched in the host's VRAM view.
    pub fn offer(
        &mut self,
        model: Option<&str>,
        strategy: Strategy,
        now: Instant,
    ) -> Offer<Placement> {
        self.offer_for(model, None, strategy, now)
    }

    /// [`offer`](Router::offer) for a request whose conversation is `chain`: among the hosts
    /// that can take it, the one its prompt cache favours (`Later` while waiting for a busy
    /// one pays; see `router::affinity`).
    pub fn offer_for(
        &mut self,
        model: Option<&str>,
        chain: Option<&crate::affinity::Chain>,
        strategy: Strategy,
        now: Instant,
    ) -> Offer<Placement> {
        let Some(name) = model else {
            return self.plain(None, None, strategy, now);
        };
        // Normalised once for the whole decision.
        let key = ModelKey::new(name);
        let any_healthy = self
            .hosts
            .iter()
            .any(|state| state.active && state.healthy());
        let candidate =
            |state: &super::HostState| state.active && (!any_healthy || state.healthy());
        let anyone_has_it = self
            .hosts
            .iter()
            .any(|state| candidate(state) && state.rank(&key, true) > super::Rank::Missing);
        if !self.swap.enabled || !anyone_has_it {
            return self.plain(Some(&key), chain, strategy, now);
        }
        let mut cold: Option<(bool, usize)> = None;
        let mut blocked: Option<usize> = None;
        let mut switching_here: Option<usize> = None;
        let mut worth_waiting = false;
        for (index, state) in self.hosts.iter_mut().enumerate() {
            let fit = if state.active {
                state.vram.fit(&key.local, now)
            } else {
                Fit::Blocked
            };
            state.unfit = matches!(fit, Fit::Switch | Fit::Blocked);
            if !candidate(state) || state.rank(&key, true) == super::Rank::Missing {
                continue;
            }
            let free = state.has_free_slot_for(Some(&key.local));
            if state.vram.switching_to() == Some(&*key.local) {
                switching_here = Some(index);
            }
            match fit {
                Fit::Resident | Fit::Room if !free => worth_waiting = true,
                Fit::Switch if cold.is_none_or(|(had_free, _)| free && !had_free) => {
                    cold = Some((free, index));
                }
                Fit::Blocked if blocked.is_none() => blocked = Some(index),
                _ => {}
            }
        }
        let chosen = self.choose_affine(Some(&key), chain, strategy, true, now);
        for state in &mut self.hosts {
            state.unfit = false;
        }
        match chosen {
            Choice::Run(mut placement) => {
                self.record(&mut placement, &key, now);
                return Offer::Run(placement);
            }
            Choice::Later(at) => return Offer::Later(at),
            Choice::Wait => {}
        }
        if let Some(index) = switching_here {
            return Offer::Cold(self.hosts[index].vram.cold(now));
        }
        if worth_waiting {
            return Offer::Wait;
        }
        match cold.map(|(_, index)| index).or(blocked) {
            Some(index) => Offer::Cold(self.hosts[index].vram.cold(now)),
            None => Offer::Wait,
        }
    }

    /// Placement as [`place`](Router::place) does it, the VRAM view still kept (for status,
    /// reports, and holding once the rule is on).
    fn plain(
        &mut self,
        model: Option<&ModelKey<'_>>,
        chain: Option<&crate::affinity::Chain>,
        strategy: Strategy,
        now: Instant,
    ) -> Offer<Placement> {
        match self.choose_affine(model, chain, strategy, false, now) {
            Choice::Run(mut placement) => {
                match model {
                    Some(key) => self.record(&mut placement, key, now),
                    None => self.uncounted(&placement.host.name),
                }
                Offer::Run(placement)
            }
            Choice::Later(at) => Offer::Later(at),
            Choice::Wait => Offer::Wait,
        }
    }

    /// Records a request for `key` sent to the placement's host in that host's VRAM view, if
    /// the host has the model (a model it lacks is answered 404 and never becomes resident, or
    /// was installed since the last poll: marked [`uncounted`](Self::uncounted)); sets `loads`.
    /// The first dispatch of a switch's model completes the switch.
    fn record(&mut self, placement: &mut Placement, key: &ModelKey, now: Instant) {
        let Some(state) = self.state_of(&placement.host.name) else {
            return;
        };
        if state.rank(key, true) == super::Rank::Missing {
            state.vram.uncounted(SystemTime::now());
            return;
        }
        placement.loads = state.vram.dispatched(&key.local, now, SystemTime::now());
        if placement.loads {
            self.switching.remove(&placement.host.name);
        }
    }

    /// [`failover`](Router::failover) that knows VRAM: with the rule on, a host where the model
    /// would have to evict another, or is being switched away from, is not taken. Records the
    /// new host in its view (the caller releases the old one with
    /// [`released`](Router::released)).
    pub fn failover_on(
        &mut self,
        model: Option<&str>,
        strategy: Strategy,
        tried: &[Arc<str>],
        now: Instant,
    ) -> Option<Placement> {
        let key = model.map(ModelKey::new);
        let vram = self.swap.enabled && key.is_some();
        if let Some(key) = key.as_ref().filter(|_| vram) {
            for state in &mut self.hosts {
                let fit = state.vram.fit(&key.local, now);
                state.unfit = state.active && matches!(fit, Fit::Switch | Fit::Blocked);
            }
        }
        let chosen = self.choose(key.as_ref(), strategy, tried, vram);
        for state in &mut self.hosts {
            state.unfit = false;
        }
        let mut placement = chosen?;
        match &key {
            Some(key) => self.record(&mut placement, key, now),
            None => self.uncounted(&placement.host.name),
        }
        Some(placement)
    }

    /// A request whose model is not read (a route oqp does not look into) was sent to `host`:
    /// whatever it loads there is oqp's doing (see [`crate::swap`]).
    fn uncounted(&mut self, host: &str) {
        if let Some(state) = self.state_of(host) {
            state.vram.uncounted(SystemTime::now());
        }
    }

    /// A request for `model` recorded on `host` will not run there after all (it failed over
    /// before reaching it, or was given up): its in-flight count goes back.
    pub fn released(&mut self, host: &str, model: &str, now: Instant) {
        if let Some(state) = self.state_of_any(host) {
            state.vram.completed(&normal_model(model), None, now);
        }
    }

    /// Starts switching `host` to `model` for `by`: new work for the models that must make
    /// room stops now; the model's requests go once theirs have finished, or the switch is
    /// given up at `by.bound`. Logged with its reason.
    pub fn switch(
        &mut self,
        host: &str,
        model: &str,
        now: Instant,
        why: SwitchReason,
        by: Requester,
    ) {
        let unload = self.swap.unload;
        let Some(state) = self.state_of(host) else {
            return;
        };
        let key = ModelKey::new(model);
        let victims = state.vram.begin_switch(&key.local, unload, Some(by), now);
        let name = state.host.name.clone();
        tracing::debug!(
            host = %name,
            model = %key.local,
            evicting = %victims.join(","),
            reason = why.as_str(),
            "model switch"
        );
        self.switching.insert(name, Arc::from(model));
    }

    /// A request for `model` on `host` ended with this `load_duration`.
    pub fn completed(&mut self, host: &str, model: &str, load: Option<Duration>, now: Instant) {
        if let Some(state) = self.state_of_any(host) {
            state.vram.completed(&normal_model(model), load, now);
        }
    }

    /// Whether a switch is under way, or drain time to charge or an unload waits to be taken:
    /// when not, [`switches`](Self::switches), [`take_charges`](Self::take_charges) and
    /// [`take_unloads`](Self::take_unloads) would all return nothing.
    pub fn swap_pending(&self) -> bool {
        !self.switching.is_empty() || self.hosts.iter().any(|state| state.vram.has_pending())
    }

    /// Explicit unloads due now: (host, model) pairs, each to be answered with
    /// [`unloaded`](Router::unloaded).
    pub fn take_unloads(&mut self) -> Vec<(Arc<Host>, String)> {
        let mut due = Vec::new();
        for state in &mut self.hosts {
            for model in state.vram.take_unloads() {
                due.push((state.host.clone(), model));
            }
        }
        due
    }

    /// An explicit unload of `model` on `host` answered (or failed).
    pub fn unloaded(&mut self, host: &str, model: &str) {
        if let Some(state) = self.state_of_any(host) {
            state.vram.unloaded(model);
        }
        // Its runner's prompt cache went with it.
        self.forget_runner(host, Some(&normal_model(model)));
    }

    /// Switches under way: (host, model as the scheduler named it). A switch given up is
    /// forgotten here.
    pub fn switches(&mut self) -> Vec<(Arc<str>, Arc<str>)> {
        let hosts = &self.hosts;
        self.switching.retain(|host, _| {
            hosts
                .iter()
                .any(|state| *state.host.name == **host && state.vram.switching_to().is_some())
        });
        self.switching
            .iter()
            .map(|(host, model)| (host.clone(), model.clone()))
            .collect()
    }

    /// The drain time to charge to the requesters of switches (see [`crate::swap`]).
    pub fn take_charges(&mut self) -> Vec<(Requester, Duration)> {
        self.hosts
            .iter_mut()
            .flat_map(|state| state.vram.take_charges())
            .collect()
    }

    /// Drops the switch under way on `host` (nothing waits for its model any more).
    pub fn abort_switch(&mut self, host: &str, now: Instant) {
        self.switching.remove(host);
        if let Some(state) = self.state_of_any(host)
            && let Some(model) = state.vram.abort_switch(now)
        {
            tracing::debug!(host, %model, "model switch dropped: nothing waits for it");
        }
    }

    /// Each current host's VRAM view (held requests are the scheduler's: left at zero).
    pub fn swap_stats(&self, now: Instant) -> Vec<SwapStat> {
        self.hosts
            .iter()
            .filter(|state| state.active)
            .map(|state| state.vram.stat(now))
            .collect()
    }

    fn state_of(&mut self, host: &str) -> Option<&mut super::HostState> {
        self.hosts
            .iter_mut()
            .find(|state| state.active && &*state.host.name == host)
    }

    fn state_of_any(&mut self, host: &str) -> Option<&mut super::HostState> {
        self.hosts
            .iter_mut()
            .find(|state| &*state.host.name == host)
    }
}

/// The router as the scheduler's [`Placer`], for one strategy.
#[derive(Debug)]
pub struct Placing<'a> {
    /// The router.
    pub router: &'a mut Router,
    /// The routing strategy in force.
    pub strategy: Strategy,
}

impl Placer<Placement> for Placing<'_> {
    fn offer(&mut self, model: Option<&str>, now: Instant) -> Offer<Placement> {
        self.router.offer(model, self.strategy, now)
    }

    fn offer_for(
        &mut self,
        model: Option<&str>,
        affinity: Option<&crate::affinity::Chain>,
        now: Instant,
    ) -> Offer<Placement> {
        self.router.offer_for(model, affinity, self.strategy, now)
    }

    fn switch(&mut self, host: &str, model: &str, now: Instant, why: SwitchReason, by: Requester) {
        self.router.switch(host, model, now, why, by);
    }

    fn offer_avoiding(
        &mut self,
        model: Option<&str>,
        avoid: &[Arc<str>],
        now: Instant,
    ) -> Offer<Placement> {
        match self.router.failover_on(model, self.strategy, avoid, now) {
            Some(placement) => Offer::Run(placement),
            None => Offer::Wait,
        }
    }
}
