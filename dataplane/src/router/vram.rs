//! The router's side of model-swap-aware scheduling: placement that knows what each host's VRAM
//! holds ([`crate::swap::HostVram`]), answering the scheduler's [`Offer`]s and carrying out the
//! switches it decides.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use super::{ModelKey, Placement, Router, Strategy};
use crate::policy::{Host, ModelSwap};
use crate::scheduler::{Offer, Placer};
use crate::swap::{Fit, SwapStat, SwitchReason};

impl Router {
    /// Applies `queue.model_swap`. Turning it off drops the switches under way.
    pub fn set_swap(&mut self, swap: ModelSwap) {
        if !swap.enabled {
            self.switching.clear();
            for state in &mut self.hosts {
                state.vram.abort_switch();
            }
        }
        self.swap = swap;
    }

    /// Whether placement looks at VRAM.
    pub fn swap_enabled(&self) -> bool {
        self.swap.enabled
    }

    /// [`place`](Router::place) that knows VRAM: `Run` on a host with a free slot where the
    /// model is resident or fits (the router's usual order among them); else `Wait` if a busy
    /// host has it resident; else `Cold` for a host that would have to switch (one with a free
    /// slot first: a switch on a busy host waits for its victims' requests anyway), or that is
    /// switching to another model; else `Wait`. A `Run` is recorded as dispatched.
    pub fn offer(
        &mut self,
        model: Option<&str>,
        strategy: Strategy,
        now: Instant,
    ) -> Offer<Placement> {
        let Some(name) = model.filter(|_| self.swap.enabled) else {
            // Off: plain placement, the VRAM view still kept (for status and reports).
            return match self.choose(model, strategy, &[], false) {
                Some(mut placement) => {
                    if let Some(name) = model
                        && let Some(state) = self.state_of(&placement.host.name)
                    {
                        let key = ModelKey::new(name);
                        placement.loads = state.vram.dispatched(&key.local, now, SystemTime::now());
                    }
                    Offer::Run(placement)
                }
                None => Offer::Wait,
            };
        };
        let key = ModelKey::new(name);
        // Hosts that would have to switch (a free slot first), hosts switching to something
        // else, and whether a busy host already has the model resident (worth waiting for).
        let mut cold: Option<(bool, usize)> = None;
        let mut blocked: Option<usize> = None;
        let mut resident_busy = false;
        for (index, state) in self.hosts.iter_mut().enumerate() {
            let fit = if state.active {
                state.vram.fit(&key.local, now)
            } else {
                Fit::Blocked
            };
            state.unfit = matches!(fit, Fit::Switch | Fit::Blocked);
            if !state.active || !state.healthy() {
                continue;
            }
            let free = state.has_free_slot();
            match fit {
                Fit::Switch if cold.is_none_or(|(had_free, _)| free && !had_free) => {
                    cold = Some((free, index));
                }
                Fit::Blocked if blocked.is_none() => blocked = Some(index),
                Fit::Resident if !free => resident_busy = true,
                _ => {}
            }
        }
        let chosen = self.choose(model, strategy, &[], true);
        for state in &mut self.hosts {
            state.unfit = false;
        }
        if let Some(mut placement) = chosen {
            let wall = SystemTime::now();
            if let Some(state) = self.state_of(&placement.host.name) {
                placement.loads = state.vram.dispatched(&key.local, now, wall);
            }
            if placement.loads {
                self.switching.remove(&placement.host.name);
            }
            return Offer::Run(placement);
        }
        if resident_busy {
            return Offer::Wait;
        }
        match cold.map(|(_, index)| index).or(blocked) {
            Some(index) => Offer::Cold(self.hosts[index].vram.cold(now)),
            None => Offer::Wait,
        }
    }

    /// Starts switching `host` to `model`: new work for the models that must make room stops
    /// now; the model's requests go once theirs have finished. Logged with its reason.
    pub fn switch(&mut self, host: &str, model: &str, now: Instant, why: SwitchReason) {
        let unload = self.swap.unload;
        let Some(state) = self.state_of(host) else {
            return;
        };
        let key = ModelKey::new(model);
        let victims = state.vram.begin_switch(&key.local, unload);
        let name = state.host.name.clone();
        tracing::debug!(
            host = %name,
            model = %key.local,
            evicting = %victims.join(","),
            reason = why.as_str(),
            "model switch"
        );
        let _ = now;
        self.switching.insert(name, Arc::from(model));
    }

    /// A request for `model` on `host` ended with this `load_duration`.
    pub fn completed(&mut self, host: &str, model: &str, load: Option<Duration>, now: Instant) {
        if let Some(state) = self.state_of_any(host) {
            state.vram.completed(&ModelKey::new(model).local, load, now);
        }
    }

    /// A request for `model` moved from `from` to `to` before reaching `from` (failover).
    pub fn moved(&mut self, from: &str, to: &str, model: &str, now: Instant) {
        let key = ModelKey::new(model);
        if let Some(state) = self.state_of_any(from) {
            state.vram.completed(&key.local, None, now);
        }
        if let Some(state) = self.state_of(to) {
            state.vram.dispatched(&key.local, now, SystemTime::now());
        }
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
    }

    /// Switches under way: (host, model as the scheduler named it).
    pub fn switches(&self) -> Vec<(Arc<str>, Arc<str>)> {
        self.switching
            .iter()
            .map(|(host, model)| (host.clone(), model.clone()))
            .collect()
    }

    /// Drops the switch under way on `host` (nothing waits for its model any more).
    pub fn abort_switch(&mut self, host: &str) {
        self.switching.remove(host);
        if let Some(state) = self.state_of_any(host)
            && let Some(model) = state.vram.abort_switch()
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

    fn switch(&mut self, host: &str, model: &str, now: Instant, why: SwitchReason) {
        self.router.switch(host, model, now, why);
    }
}
