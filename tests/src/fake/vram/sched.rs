//! The pure state machine behind the VRAM mode, with time passed in, modelled on Ollama's
//! `server/sched.go`: resident models with their in-flight counts and keep-alive, ONE FIFO of
//! cold requests whose head blocks the rest, eviction by keep-alive (shortest first) then name,
//! a victim unloaded only once its in-flight requests finish (new requests still attach to it),
//! and timed loads and unloads. `Vram` (the parent module) wraps it in a mutex and a driver task.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use super::super::models::canonical;
use super::config::Config;

/// How long a model stays loaded once idle; a zero duration unloads it at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Keep {
    /// This long.
    For(Duration),
    /// Never expires (a negative `keep_alive`); sorts after every duration.
    Forever,
}

/// What became of a request that asked for a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Attach {
    /// The model is resident and ready: run now.
    Ready,
    /// The model is being loaded: the request holds its place and waits for the load.
    Loading,
    /// The model is cold: the request waits in the pending queue under this ticket.
    Queued(u64),
    /// The model is cold and the pending queue is full: Ollama's busy 503.
    Busy,
}

/// Where a model is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Being loaded since `started`, ready at `ready_at`.
    Loading { started: Instant, ready_at: Instant },
    /// Loaded.
    Ready,
    /// Chosen as a victim: unloaded once its in-flight requests finish; new ones still attach.
    Evicting,
    /// Being unloaded, gone at `done_at`; its VRAM is still taken.
    Unloading { done_at: Instant },
}

/// One model in VRAM.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    /// The name as first requested.
    pub name: String,
    pub size: u64,
    pub phase: Phase,
    pub in_flight: usize,
    pub keep: Keep,
    /// When an idle model expires; `None` while in use or kept forever.
    pub expires: Option<Instant>,
}

/// What tests read: the resident set, the queue and the counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Snapshot {
    /// Canonical names of loaded models (ready or marked for eviction), sorted.
    pub resident: Vec<String>,
    /// Canonical names of models being loaded.
    pub loading: Vec<String>,
    /// Cold requests waiting in the pending queue.
    pub pending: usize,
    /// Loads started, by canonical name.
    pub loads: BTreeMap<String, usize>,
    /// Unloads finished, by canonical name.
    pub unloads: BTreeMap<String, usize>,
    /// Time spent in finished loads.
    pub load_time: Duration,
}

/// The scheduler state.
#[derive(Debug)]
pub(crate) struct Sched {
    config: Config,
    // Keyed by canonical name, so iteration is in name order.
    entries: BTreeMap<String, Entry>,
    pending: VecDeque<Ticket>,
    granted: HashMap<u64, Result<(), String>>,
    next_ticket: u64,
    loads: BTreeMap<String, usize>,
    unloads: BTreeMap<String, usize>,
    load_time: Duration,
}

#[derive(Debug)]
struct Ticket {
    id: u64,
    model: String,
    name: String,
    keep: Keep,
}

impl Sched {
    /// An empty VRAM.
    pub fn new(config: Config) -> Self {
        Self {
            config,
            entries: BTreeMap::new(),
            pending: VecDeque::new(),
            granted: HashMap::new(),
            next_ticket: 0,
            loads: BTreeMap::new(),
            unloads: BTreeMap::new(),
            load_time: Duration::ZERO,
        }
    }

    /// Makes `name` resident at start-up, kept forever, without counting a load; ignored when it
    /// does not fit.
    pub fn preload(&mut self, name: &str) {
        let model = canonical(name);
        let size = self.config.size(&model);
        if self.entries.contains_key(&model) || self.used() + size > self.config.capacity {
            return;
        }
        let entry = Entry {
            name: name.to_owned(),
            size,
            phase: Phase::Ready,
            in_flight: 0,
            keep: Keep::Forever,
            expires: None,
        };
        self.entries.insert(model, entry);
    }

    /// A request for `name` arrives: it attaches to the model if it is resident (even when marked
    /// for eviction), else it joins the pending queue.
    pub fn attach(&mut self, name: &str, keep: Keep, now: Instant) -> Attach {
        let model = canonical(name);
        if let Some(entry) = self.entries.get_mut(&model) {
            let attached = match entry.phase {
                Phase::Ready | Phase::Evicting => Some(Attach::Ready),
                Phase::Loading { .. } => Some(Attach::Loading),
                Phase::Unloading { .. } => None,
            };
            if let Some(attached) = attached {
                use_entry(entry, keep);
                return attached;
            }
        }
        if self
            .config
            .max_pending
            .is_some_and(|max| self.pending.len() >= max)
        {
            return Attach::Busy;
        }
        let id = self.next_ticket;
        self.next_ticket += 1;
        self.pending.push_back(Ticket {
            id,
            model,
            name: name.to_owned(),
            keep,
        });
        self.pump(now);
        Attach::Queued(id)
    }

    /// The outcome of a queued ticket once the queue reached it: `Ok` when the request now holds
    /// its model (loading or ready), `Err` with Ollama's message when it can never fit.
    pub fn take_grant(&mut self, id: u64) -> Option<Result<(), String>> {
        self.granted.remove(&id)
    }

    /// A queued request went away: it leaves the queue, or releases the model it was granted.
    pub fn cancel(&mut self, id: u64, name: &str, now: Instant) {
        self.pending.retain(|ticket| ticket.id != id);
        if let Some(Ok(())) = self.granted.remove(&id) {
            self.release(name, now);
        }
        self.pump(now);
    }

    /// Whether `name` is still being loaded.
    pub fn is_loading(&self, name: &str) -> bool {
        self.entries
            .get(&canonical(name))
            .is_some_and(|entry| matches!(entry.phase, Phase::Loading { .. }))
    }

    /// A request on `name` finished: the last one out starts its keep-alive, or its unload when
    /// it is a victim or was asked to go at once.
    pub fn release(&mut self, name: &str, now: Instant) {
        if let Some(entry) = self.entries.get_mut(&canonical(name)) {
            entry.in_flight = entry.in_flight.saturating_sub(1);
        }
        self.pump(now);
    }

    /// `keep_alive: 0` with nothing to run: the model is unloaded once idle.
    pub fn expire(&mut self, name: &str, now: Instant) {
        if let Some(entry) = self.entries.get_mut(&canonical(name)) {
            entry.keep = Keep::For(Duration::ZERO);
            if entry.in_flight == 0 && entry.phase == Phase::Ready {
                entry.expires = Some(now);
            }
        }
        self.pump(now);
    }

    /// Moves every timer and the pending queue as far as `now` allows; returns the next instant
    /// at which something will happen on its own.
    pub fn pump(&mut self, now: Instant) -> Option<Instant> {
        while self.step(now) {}
        self.entries
            .values()
            .filter_map(|entry| match entry.phase {
                Phase::Loading { ready_at, .. } => Some(ready_at),
                Phase::Unloading { done_at } => Some(done_at),
                Phase::Ready if entry.in_flight == 0 => entry.expires,
                Phase::Ready | Phase::Evicting => None,
            })
            .min()
    }

    /// Resident models with the time each expires (`None`: forever or in use), for `/api/ps`;
    /// unloading models are not listed, loading ones are.
    pub fn listed(&self) -> Vec<(String, u64, Option<Instant>, Keep)> {
        self.entries
            .values()
            .filter(|entry| !matches!(entry.phase, Phase::Unloading { .. }))
            .map(|entry| (entry.name.clone(), entry.size, entry.expires, entry.keep))
            .collect()
    }

    /// What tests read.
    pub fn snapshot(&self) -> Snapshot {
        let names = |loading: bool| {
            self.entries
                .iter()
                .filter(|(_, entry)| match entry.phase {
                    Phase::Ready | Phase::Evicting => !loading,
                    Phase::Loading { .. } => loading,
                    Phase::Unloading { .. } => false,
                })
                .map(|(model, _)| model.clone())
                .collect()
        };
        Snapshot {
            resident: names(false),
            loading: names(true),
            pending: self.pending.len(),
            loads: self.loads.clone(),
            unloads: self.unloads.clone(),
            load_time: self.load_time,
        }
    }

    fn used(&self) -> u64 {
        self.entries.values().map(|entry| entry.size).sum()
    }

    // One move; true when something changed.
    fn step(&mut self, now: Instant) -> bool {
        self.finish_timers(now) || self.start_unloads(now) || self.serve_head(now)
    }

    fn finish_timers(&mut self, now: Instant) -> bool {
        let mut changed = false;
        let mut gone = Vec::new();
        for (model, entry) in &mut self.entries {
            match entry.phase {
                Phase::Loading { started, ready_at } if ready_at <= now => {
                    entry.phase = Phase::Ready;
                    self.load_time += ready_at - started;
                    if entry.in_flight == 0 {
                        entry.expires = expiry(entry.keep, now);
                    }
                    changed = true;
                }
                Phase::Unloading { done_at } if done_at <= now => gone.push(model.clone()),
                _ => {}
            }
        }
        for model in gone {
            self.entries.remove(&model);
            *self.unloads.entry(model).or_default() += 1;
            changed = true;
        }
        changed
    }

    // Idle victims, idle models asked to go at once, and expired idle models start unloading.
    fn start_unloads(&mut self, now: Instant) -> bool {
        let mut changed = false;
        for (model, entry) in &mut self.entries {
            if entry.in_flight > 0 {
                continue;
            }
            let due = match entry.phase {
                Phase::Evicting => true,
                Phase::Ready => {
                    if entry.expires.is_none() && entry.keep != Keep::Forever {
                        // The last request just left: start the keep-alive.
                        entry.expires = expiry(entry.keep, now);
                    }
                    entry.expires.is_some_and(|at| at <= now)
                }
                Phase::Loading { .. } | Phase::Unloading { .. } => false,
            };
            if due {
                let done_at = now + self.config.unload_time(model);
                entry.phase = Phase::Unloading { done_at };
                entry.expires = None;
                changed = true;
            }
        }
        changed
    }

    // The head of the pending queue: attach, load, fail, or choose a victim and wait.
    fn serve_head(&mut self, now: Instant) -> bool {
        let Some(head) = self.pending.front() else {
            return false;
        };
        let (model, keep) = (head.model.clone(), head.keep);
        if let Some(entry) = self.entries.get_mut(&model) {
            if matches!(entry.phase, Phase::Unloading { .. }) {
                return false;
            }
            use_entry(entry, keep);
            return self.grant(Ok(()));
        }
        let size = self.config.size(&model);
        if size > self.config.capacity {
            let message = format!(
                "model requires more system memory ({}) than is available ({})",
                human_bytes(size),
                human_bytes(self.config.capacity)
            );
            return self.grant(Err(message));
        }
        let room = self
            .config
            .max_loaded
            .is_none_or(|max| self.entries.len() < max);
        if room && self.used() + size <= self.config.capacity {
            let name = head.name.clone();
            let entry = Entry {
                name,
                size,
                phase: Phase::Loading {
                    started: now,
                    ready_at: now + self.config.load_time(&model),
                },
                in_flight: 1,
                keep,
                expires: None,
            };
            self.entries.insert(model.clone(), entry);
            *self.loads.entry(model).or_default() += 1;
            return self.grant(Ok(()));
        }
        self.choose_victim()
    }

    // Nothing is chosen while a victim drains or unloads: the space it frees may be enough.
    fn choose_victim(&mut self) -> bool {
        let busy = self
            .entries
            .values()
            .any(|entry| matches!(entry.phase, Phase::Evicting | Phase::Unloading { .. }));
        if busy {
            return false;
        }
        let victim = self
            .entries
            .iter()
            .filter(|(_, entry)| entry.phase == Phase::Ready)
            .min_by_key(|(model, entry)| (entry.in_flight > 0, entry.keep, (*model).clone()))
            .map(|(model, _)| model.clone());
        match victim.and_then(|model| self.entries.get_mut(&model)) {
            Some(entry) => {
                entry.phase = Phase::Evicting;
                entry.expires = None;
                true
            }
            None => false,
        }
    }

    fn grant(&mut self, outcome: Result<(), String>) -> bool {
        if let Some(ticket) = self.pending.pop_front() {
            self.granted.insert(ticket.id, outcome);
        }
        true
    }
}

// A request takes the model: it counts as in flight and its keep-alive replaces the model's.
fn use_entry(entry: &mut Entry, keep: Keep) {
    entry.in_flight += 1;
    entry.keep = keep;
    entry.expires = None;
}

fn expiry(keep: Keep, now: Instant) -> Option<Instant> {
    match keep {
        Keep::For(duration) => Some(now + duration),
        Keep::Forever => None,
    }
}

/// Go's `format.HumanBytes2`: binary units with one decimal (`5.5 GiB`).
pub(crate) fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests;
