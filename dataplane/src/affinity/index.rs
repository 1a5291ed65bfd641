//! The prefix index: which runner holds which conversation's prefix in its prompt cache, as
//! far as this data plane placed them. Pure, time passed in.
//!
//! Each runner (a host's model) keeps at most its slots plus an allowance for llama-server's
//! RAM prompt cache of conversations, least recently used first out: a new conversation
//! placed there takes the least recently used slot, as llama-server does, so the index
//! never predicts a hit that cannot happen. A runner's entries go when it is unloaded,
//! evicted or reloaded with other options, and a host's when it goes down.
//!
//! An entry is about [`ENTRY_BYTES`] bytes (the entry, its two prefix hashes and its session
//! in the maps); [`Index::new`] caps the total.

use std::sync::Arc;
use std::time::{Duration, Instant};

use foldhash::{HashMap, HashMapExt};

use super::chain::{Chain, Point};

/// The approximate bytes one conversation costs the index.
pub const ENTRY_BYTES: usize = 160;

/// A conversation held by a runner.
#[derive(Clone, Debug)]
struct Entry {
    runner: u32,
    /// The prompt it was last placed with.
    prompt: Point,
    /// The prompt and its answer, once the answer ended.
    answer: Option<Point>,
    session: Option<u64>,
    used: u64,
    /// Bumped on reuse, so that an answer recorded late cannot land on another conversation.
    generation: u32,
    live: bool,
    /// The engine slot that holds it, where oqp names slots (llama-server's `id_slot`);
    /// `None` when it is set aside in the engine's RAM prompt cache, or slots are not named.
    engine_slot: Option<u32>,
    /// Another request took its engine slot: the engine set its prompt aside in its RAM
    /// prompt cache.
    set_aside: bool,
    /// When its last answer ended, until its next turn is placed: its next turn is likely
    /// on the way.
    answered_at: Option<Instant>,
}

/// How long a slot is held for a conversation expected back on its runner (see
/// [`Index::returning`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hold {
    /// The shortest hold.
    pub floor: Duration,
    /// The longest hold.
    pub ceiling: Duration,
    /// Prefill seconds per token where the runner has learned none.
    pub fallback_rate: f64,
}

impl Hold {
    /// The hold for a conversation of `tokens` tokens on a runner that prefills at `rate`
    /// seconds a token: what re-reading it would take, within the floor and the ceiling.
    pub fn window(&self, tokens: u32, rate: f64) -> Duration {
        let reread = f64::from(tokens) * rate;
        let reread = if reread.is_finite() && reread > 0.0 {
            Duration::from_secs_f64(reread.min(self.ceiling.as_secs_f64()))
        } else {
            Duration::ZERO
        };
        reread.clamp(self.floor, self.ceiling.max(self.floor))
    }
}

/// One slot of a runner whose slots oqp names (a llama-server's `id_slot`).
#[derive(Clone, Copy, Debug, Default)]
struct EngineSlot {
    /// The conversation whose prompt it holds.
    holder: Option<u32>,
    /// When the request running on it started.
    busy: Option<Instant>,
    /// Whether it has held a prompt at all (a llama-server restores a conversation from its
    /// RAM prompt cache only into a slot that holds one).
    filled: bool,
    /// The tick of its last use.
    used: u64,
}

/// One runner: a model on a host.
#[derive(Debug)]
struct Runner {
    host: Arc<str>,
    model: String,
    /// The reload options of its last placement.
    options: u64,
    entries: Vec<u32>,
    /// When each request running on it started.
    running: Vec<Instant>,
    /// Mean slot time of a request here (seconds, EWMA).
    service: Option<f64>,
    /// Learned prefill time per token (seconds, EWMA), from answers that found nothing cached.
    prefill: Option<f64>,
    /// Its slots, where oqp names them; empty otherwise.
    engine_slots: Vec<EngineSlot>,
    /// A named slot did not hold what oqp expected: slots are tracked, not named.
    unnamed: bool,
}

impl Runner {
    /// The request that started at `at` on engine slot `slot` left it.
    fn free_engine_slot(&mut self, at: Instant, slot: Option<u32>, tick: u64) {
        let index = slot.map(|slot| slot as usize).filter(|&slot| {
            self.engine_slots
                .get(slot)
                .is_some_and(|e| e.busy == Some(at))
        });
        if let Some(engine) = index.and_then(|slot| self.engine_slots.get_mut(slot)) {
            engine.busy = None;
            engine.used = tick;
        }
    }
}

/// Where a placed request's conversation was recorded, for its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    entry: u32,
    generation: u32,
}

/// The engine slot a request was given (see [`Index::engine_slot`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineChoice {
    /// The slot's id, as the engine numbers them.
    pub slot: u32,
    /// Whether to name it in the request (`id_slot`), or let the engine take it itself.
    pub named: bool,
}

/// A runner that holds part of a request's prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Warm {
    /// The host.
    pub host: Arc<str>,
    /// Estimated tokens of the request's prompt cached there.
    pub tokens: u32,
}

/// One runner's figures (for `oqpctl hosts`, status and tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunnerWarmth {
    /// The host.
    pub host: Arc<str>,
    /// The model, normalised.
    pub model: String,
    /// Conversations the index believes warm there.
    pub conversations: u32,
}

/// The prefix index. See the module documentation.
#[derive(Debug)]
pub struct Index {
    entries: Vec<Entry>,
    free: Vec<u32>,
    by_hash: HashMap<u64, u32>,
    by_session: HashMap<u64, u32>,
    runners: Vec<Runner>,
    /// When each request running on a host started, by host.
    hosts: HashMap<Arc<str>, Vec<Instant>>,
    tick: u64,
    cap: usize,
    live: usize,
}

/// Smoothing of the learned figures.
const ALPHA: f64 = 0.2;

impl Index {
    /// An index of at most `cap` conversations.
    pub fn new(cap: usize) -> Self {
        Self {
            entries: Vec::new(),
            free: Vec::new(),
            by_hash: HashMap::new(),
            by_session: HashMap::new(),
            runners: Vec::new(),
            hosts: HashMap::new(),
            tick: 0,
            cap: cap.max(1),
            live: 0,
        }
    }

    /// Changes the cap (existing entries beyond it go as runners make room).
    pub fn set_cap(&mut self, cap: usize) {
        self.cap = cap.max(1);
    }

    /// Conversations held.
    pub fn len(&self) -> usize {
        self.live
    }

    /// The heap its tables hold, in bytes (hash maps counted at their capacity, a control
    /// byte per bucket).
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        let map = |capacity: usize| capacity * (size_of::<(u64, u32)>() + 1);
        self.entries.capacity() * size_of::<Entry>()
            + self.free.capacity() * size_of::<u32>()
            + map(self.by_hash.capacity())
            + map(self.by_session.capacity())
            + self
                .runners
                .iter()
                .map(|runner| {
                    size_of::<Runner>()
                        + runner.model.capacity()
                        + runner.entries.capacity() * size_of::<u32>()
                        + runner.running.capacity() * size_of::<Instant>()
                })
                .sum::<usize>()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    fn runner_id(&self, host: &str, model: &str) -> Option<u32> {
        self.runners
            .iter()
            .position(|runner| &*runner.host == host && runner.model == model)
            .and_then(|index| u32::try_from(index).ok())
    }

    fn runner_mut(&mut self, host: &Arc<str>, model: &str) -> u32 {
        if let Some(id) = self.runner_id(host, model) {
            return id;
        }
        self.runners.push(Runner {
            host: host.clone(),
            model: model.to_owned(),
            options: 0,
            entries: Vec::new(),
            running: Vec::new(),
            service: None,
            prefill: None,
            engine_slots: Vec::new(),
            unnamed: false,
        });
        u32::try_from(self.runners.len() - 1).unwrap_or(u32::MAX)
    }

    /// The runners holding part of `chain`'s prefix, with the tokens each holds: the longest
    /// point of the chain found on each, or the conversation the session names.
    pub fn lookup(&self, chain: &Chain) -> Vec<Warm> {
        let mut found: Vec<Warm> = Vec::new();
        let mut note = |runner: &Runner, tokens: u32| match found
            .iter_mut()
            .find(|warm| warm.host == runner.host)
        {
            Some(warm) => warm.tokens = warm.tokens.max(tokens),
            None => found.push(Warm {
                host: runner.host.clone(),
                tokens,
            }),
        };
        if let Some(session) = chain.session
            && let Some(&id) = self.by_session.get(&session)
            && let Some(entry) = self.entries.get(id as usize)
            && let Some(runner) = self.runners.get(entry.runner as usize)
        {
            let held = entry.answer.unwrap_or(entry.prompt).tokens;
            note(runner, held.min(chain.tokens));
        }
        for point in chain.points.iter().rev() {
            let Some(&id) = self.by_hash.get(&point.hash) else {
                continue;
            };
            let Some(entry) = self.entries.get(id as usize) else {
                continue;
            };
            if let Some(runner) = self.runners.get(entry.runner as usize) {
                note(runner, point.tokens);
            }
        }
        found
    }

    /// Records `chain` placed on `model`'s runner at `host`: the conversation it continues
    /// there takes the new prompt, else a new entry takes the runner's least recently used
    /// one's place when the runner holds `capacity` already. A change of reload options
    /// empties the runner first (Ollama reloads it).
    pub fn place(
        &mut self,
        host: &Arc<str>,
        model: &str,
        capacity: u32,
        chain: &Chain,
    ) -> Option<Slot> {
        self.tick += 1;
        let tick = self.tick;
        let runner = self.runner_mut(host, model);
        let state = &mut self.runners[runner as usize];
        if state.options != chain.options {
            if !state.entries.is_empty() {
                let gone = std::mem::take(&mut state.entries);
                for id in gone {
                    self.remove(id);
                }
            }
            self.runners[runner as usize].options = chain.options;
        }
        // The conversation this request continues on this runner, if any.
        let continued = self.continued_on(chain, runner);
        let id = match continued {
            Some(id) => {
                self.unindex(id);
                id
            }
            None => {
                let capacity = usize::try_from(capacity.max(1)).unwrap_or(usize::MAX);
                while self.runners[runner as usize].entries.len() >= capacity
                    || (self.live >= self.cap && !self.runners[runner as usize].entries.is_empty())
                {
                    let oldest = self.runners[runner as usize]
                        .entries
                        .iter()
                        .copied()
                        .min_by_key(|&id| self.entries.get(id as usize).map_or(0, |e| e.used));
                    match oldest {
                        Some(id) => self.remove(id),
                        None => break,
                    }
                }
                if self.live >= self.cap {
                    return None;
                }
                let id = match self.free.pop() {
                    Some(id) => id,
                    None => {
                        self.entries.push(Entry {
                            runner,
                            prompt: chain.last(),
                            answer: None,
                            session: None,
                            used: 0,
                            generation: 0,
                            live: false,
                            engine_slot: None,
                            set_aside: false,
                            answered_at: None,
                        });
                        u32::try_from(self.entries.len() - 1).ok()?
                    }
                };
                self.runners[runner as usize].entries.push(id);
                self.live += 1;
                id
            }
        };
        let entry = &mut self.entries[id as usize];
        entry.runner = runner;
        entry.prompt = chain.last();
        entry.answer = None;
        entry.answered_at = None;
        entry.session = chain.session;
        entry.used = tick;
        entry.generation = entry.generation.wrapping_add(1);
        entry.live = true;
        let slot = Slot {
            entry: id,
            generation: entry.generation,
        };
        self.by_hash.insert(chain.last().hash, id);
        if let Some(session) = chain.session {
            self.by_session.insert(session, id);
        }
        Some(slot)
    }

    /// Records the answer of the request placed at `slot`, ended at `at`: the runner now
    /// holds `point`.
    pub fn answered(&mut self, slot: Slot, point: Point, at: Instant) {
        let Some(entry) = self.entries.get_mut(slot.entry as usize) else {
            return;
        };
        if !entry.live || entry.generation != slot.generation {
            return;
        }
        entry.answered_at = Some(at);
        if let Some(old) = entry.answer.replace(point)
            && self.by_hash.get(&old.hash) == Some(&slot.entry)
        {
            self.by_hash.remove(&old.hash);
        }
        self.by_hash.insert(point.hash, slot.entry);
    }

    /// A request started on `model`'s runner at `host` (every request, for the wait
    /// estimate).
    pub fn started(&mut self, host: &Arc<str>, model: &str, at: Instant) {
        let runner = self.runner_mut(host, model);
        self.runners[runner as usize].running.push(at);
        self.hosts.entry(host.clone()).or_default().push(at);
    }

    /// A request that started at `at` on `model`'s runner at `host` ended after `held` on
    /// its slot (engine slot `engine_slot`, where oqp named one); `prefill` is its prompt's
    /// time per token when nothing of it was cached.
    pub fn ended(
        &mut self,
        host: &str,
        model: &str,
        at: Instant,
        held: Duration,
        prefill: Option<f64>,
        engine_slot: Option<u32>,
    ) {
        if let Some(running) = self.hosts.get_mut(host)
            && let Some(index) = running.iter().position(|start| *start == at)
        {
            running.swap_remove(index);
        }
        let Some(runner) = self.runner_id(host, model) else {
            return;
        };
        self.tick += 1;
        let tick = self.tick;
        let state = &mut self.runners[runner as usize];
        if let Some(index) = state.running.iter().position(|start| *start == at) {
            state.running.swap_remove(index);
        }
        state.free_engine_slot(at, engine_slot, tick);
        let secs = held.as_secs_f64();
        state.service = Some(
            state
                .service
                .map_or(secs, |mean| mean + ALPHA * (secs - mean)),
        );
        if let Some(rate) = prefill.filter(|rate| rate.is_finite() && *rate >= 0.0) {
            state.prefill = Some(
                state
                    .prefill
                    .map_or(rate, |mean| mean + ALPHA * (rate - mean)),
            );
        }
    }

    /// A request that started at `at` on `model` at `from` failed over to `to` before its
    /// first byte (or went back to the queue).
    pub fn moved(
        &mut self,
        from: &str,
        to: Option<&Arc<str>>,
        model: &str,
        at: Instant,
        engine_slot: Option<u32>,
    ) {
        if let Some(running) = self.hosts.get_mut(from)
            && let Some(index) = running.iter().position(|start| *start == at)
        {
            running.swap_remove(index);
        }
        if let Some(id) = self.runner_id(from, model) {
            let tick = self.tick;
            let state = &mut self.runners[id as usize];
            if let Some(index) = state.running.iter().position(|start| *start == at) {
                state.running.swap_remove(index);
            }
            state.free_engine_slot(at, engine_slot, tick);
        }
        if let Some(to) = to {
            self.started(to, model, at);
        }
    }

    /// Learned prefill seconds per token on `model` at `host`.
    pub fn prefill_rate(&self, host: &str, model: &str) -> Option<f64> {
        self.runner_id(host, model)
            .and_then(|id| self.runners[id as usize].prefill)
    }

    /// Seconds until a slot of `model`'s runner at `host` is expected to free, given `slots`:
    /// 0 with one free; else the soonest of the running requests' expected remainder. A
    /// request expected to take `mean` that has run `e` is expected to need `mean - e` more,
    /// and no less than the `e` it has already run once past half of it (a long request is
    /// likely longer still), so that a runner full of long work is soon seen as such.
    pub fn wait(
        &self,
        host: &str,
        model: &str,
        slots: u32,
        host_slots: u32,
        now: Instant,
        mean: f64,
    ) -> f64 {
        let runner = self
            .runner_id(host, model)
            .map(|id| &self.runners[id as usize]);
        let on_runner = runner.map_or(&[][..], |runner| &runner.running[..]);
        let on_host = self.hosts.get(host).map_or(&[][..], |running| &running[..]);
        // The runner's slots are full, else the host's are (other models run there).
        let (running, mean) = if on_runner.len() >= slots as usize {
            (
                on_runner,
                runner.and_then(|runner| runner.service).unwrap_or(mean),
            )
        } else if on_host.len() >= host_slots as usize {
            (on_host, mean)
        } else {
            return 0.0;
        };
        running
            .iter()
            .map(|start| {
                let ran = now.saturating_duration_since(*start).as_secs_f64();
                (mean - ran).max(ran)
            })
            .fold(f64::INFINITY, f64::min)
    }

    /// The engine slot for a request starting at `at` on `model`'s runner at `host`, an
    /// engine of `slots` slots that lets oqp name them (a llama-server's `id_slot`), with its
    /// conversation recorded at `slot` (none: a request that continues no conversation).
    ///
    /// The slot that holds the conversation when it is idle, so that the conversation
    /// returns to its own prompt. Else an idle slot: an empty one for a new conversation or
    /// a request of none, else the one whose conversation was used least recently (the
    /// engine sets that one aside in its RAM prompt cache). `None` (the engine chooses)
    /// when every slot is busy. Not to be named when the conversation was set aside in the
    /// RAM cache and the slot chosen has never held a prompt: a llama-server restores a
    /// set-aside prompt into a slot it chose itself, or into a named slot that holds another
    /// prompt, but not into a named empty one. The slot is recorded as taken either way, as
    /// the engine takes its least recently used idle slot, and an empty one never used is
    /// that.
    pub fn engine_slot(
        &mut self,
        host: &Arc<str>,
        model: &str,
        slots: u32,
        slot: Option<Slot>,
        at: Instant,
    ) -> Option<EngineChoice> {
        let slots = usize::try_from(slots).ok().filter(|slots| *slots > 0)?;
        self.tick += 1;
        let tick = self.tick;
        let runner = self.runner_mut(host, model);
        if self.runners[runner as usize].engine_slots.len() != slots {
            // First use, or the engine was restarted with another slot count: nothing is
            // known to be in any slot.
            let entries = self.runners[runner as usize].entries.clone();
            for id in entries {
                if let Some(entry) = self.entries.get_mut(id as usize) {
                    entry.engine_slot = None;
                    entry.set_aside = false;
                }
            }
            self.runners[runner as usize].engine_slots = vec![EngineSlot::default(); slots];
        }
        let entry = slot.and_then(|slot| {
            self.entries
                .get(slot.entry as usize)
                .filter(|entry| entry.live && entry.generation == slot.generation)
                .map(|entry| (slot.entry, entry.engine_slot))
        });
        let state = &self.runners[runner as usize];
        let own = entry.and_then(|(_, held)| held).filter(|&held| {
            state
                .engine_slots
                .get(held as usize)
                .is_some_and(|engine| engine.busy.is_none())
        });
        // A conversation whose slot another request took waits in the RAM cache.
        let set_aside = entry.is_some_and(|(id, held)| {
            held.is_none() && self.entries.get(id as usize).is_some_and(|e| e.set_aside)
        });
        let holder_used = |engine: &EngineSlot| {
            engine
                .holder
                .and_then(|id| self.entries.get(id as usize))
                .map_or(0, |entry| entry.used)
        };
        let chosen = own.or_else(|| {
            state
                .engine_slots
                .iter()
                .enumerate()
                .filter(|(_, engine)| engine.busy.is_none())
                .min_by_key(|(_, engine)| {
                    // A set-aside conversation needs a slot that holds a prompt.
                    let unfit = set_aside && !engine.filled;
                    (
                        unfit,
                        engine.holder.is_some(),
                        holder_used(engine),
                        engine.used,
                    )
                })
                .and_then(|(index, _)| u32::try_from(index).ok())
        })?;
        let named = !state.unnamed && (!set_aside || state.engine_slots[chosen as usize].filled);
        // Whoever the slot held is set aside; the conversation's old slot holds it no more.
        let previous = self.runners[runner as usize].engine_slots[chosen as usize].holder;
        if let Some(previous) = previous
            && Some(previous) != entry.map(|(id, _)| id)
            && let Some(other) = self.entries.get_mut(previous as usize)
        {
            other.engine_slot = None;
            other.set_aside = true;
        }
        if let Some((id, Some(old))) = entry
            && old != chosen
            && let Some(engine) = self.runners[runner as usize]
                .engine_slots
                .get_mut(old as usize)
            && engine.holder == Some(id)
        {
            engine.holder = None;
        }
        let holder = entry.map(|(id, _)| id);
        if let Some(id) = holder
            && let Some(entry) = self.entries.get_mut(id as usize)
        {
            entry.engine_slot = Some(chosen);
            entry.set_aside = false;
        }
        let engine = &mut self.runners[runner as usize].engine_slots[chosen as usize];
        *engine = EngineSlot {
            holder,
            busy: Some(at),
            filled: true,
            used: tick,
        };
        Some(EngineChoice {
            slot: chosen,
            named,
        })
    }

    /// Conversations of `model`'s runner at `host` answered (or seen [waiting](Index::waiting)
    /// for it) recently whose next turn has not been placed yet: a slot freed there is likely
    /// wanted again soon by one of them, whose history is cached there.
    ///
    /// How recently is each one's own [`Hold`]: at least its floor, and as long as re-reading
    /// the conversation's history elsewhere would take it (its tokens at the runner's learned
    /// prefill rate, else `hold.fallback_rate`), up to its ceiling. Holding a slot for a
    /// conversation that may not come back costs at most what losing the slot would cost it
    /// (the ski-rental bound); a fixed second let a conversation that thought for two seconds
    /// find its slot spilled onto and re-read its whole history in turn.
    pub fn returning(&self, host: &str, model: &str, now: Instant, hold: Hold) -> u32 {
        let Some(runner) = self.runner_id(host, model) else {
            return 0;
        };
        let state = &self.runners[runner as usize];
        let rate = state.prefill.unwrap_or(hold.fallback_rate);
        let count = state
            .entries
            .iter()
            .filter_map(|&id| self.entries.get(id as usize))
            .filter(|entry| {
                entry.answered_at.is_some_and(|at| {
                    let tokens = entry.answer.unwrap_or(entry.prompt).tokens;
                    now.saturating_duration_since(at) < hold.window(tokens, rate)
                })
            })
            .count();
        u32::try_from(count).unwrap_or(u32::MAX)
    }

    /// The live conversation on `runner` that `chain` continues (its session first, then its
    /// longest prefix), if any.
    fn continued_on(&self, chain: &Chain, runner: u32) -> Option<u32> {
        chain
            .session
            .and_then(|session| self.by_session.get(&session).copied())
            .into_iter()
            .chain(
                chain
                    .points
                    .iter()
                    .rev()
                    .filter_map(|point| self.by_hash.get(&point.hash).copied()),
            )
            .find(|&id| {
                self.entries
                    .get(id as usize)
                    .is_some_and(|entry| entry.live && entry.runner == runner)
            })
    }

    /// `chain`'s conversation waits at `now` for `model`'s runner at `host`, which holds it:
    /// it counts as [`returning`](Index::returning) there while it waits.
    pub fn waiting(&mut self, host: &str, model: &str, chain: &Chain, now: Instant) {
        let Some(runner) = self.runner_id(host, model) else {
            return;
        };
        let held = self.continued_on(chain, runner);
        if let Some(entry) = held.and_then(|id| self.entries.get_mut(id as usize)) {
            entry.answered_at = Some(now);
        }
    }

    /// The request of the conversation recorded at `slot` ended at `at`: it counts as
    /// [`returning`](Index::returning) from then.
    pub fn expect_back(&mut self, slot: Slot, at: Instant) {
        if let Some(entry) = self
            .entries
            .get_mut(slot.entry as usize)
            .filter(|entry| entry.live && entry.generation == slot.generation)
        {
            entry.answered_at = Some(at);
        }
    }

    /// Stops naming the slots of `model`'s runner at `host` (its engine does not keep a
    /// prompt in a named slot as oqp takes it to); true the first time.
    pub fn stop_naming(&mut self, host: &str, model: &str) -> bool {
        let Some(runner) = self.runner_id(host, model) else {
            return false;
        };
        let state = &mut self.runners[runner as usize];
        !std::mem::replace(&mut state.unnamed, true)
    }

    /// The engine slot that holds the conversation recorded at `slot`, if oqp named one.
    pub fn held_in(&self, slot: Slot) -> Option<u32> {
        self.entries
            .get(slot.entry as usize)
            .filter(|entry| entry.live && entry.generation == slot.generation)
            .and_then(|entry| entry.engine_slot)
    }

    /// Forgets what `model`'s runner at `host` holds (unloaded, evicted).
    pub fn forget_runner(&mut self, host: &str, model: &str) {
        if let Some(id) = self.runner_id(host, model) {
            let gone = std::mem::take(&mut self.runners[id as usize].entries);
            for entry in gone {
                self.remove(entry);
            }
            // A runner loaded again starts with empty slots.
            self.runners[id as usize].engine_slots.clear();
        }
    }

    /// Forgets everything `host`'s runners hold (down, restarted, removed).
    pub fn forget_host(&mut self, host: &str) {
        // What runs there is still counted: it ends, and `ended` removes it.
        let models: Vec<String> = self
            .runners
            .iter()
            .filter(|runner| &*runner.host == host)
            .map(|runner| runner.model.clone())
            .collect();
        for model in models {
            self.forget_runner(host, &model);
        }
    }

    /// Every runner with warm conversations.
    pub fn warmth(&self) -> Vec<RunnerWarmth> {
        self.runners
            .iter()
            .filter(|runner| !runner.entries.is_empty())
            .map(|runner| RunnerWarmth {
                host: runner.host.clone(),
                model: runner.model.clone(),
                conversations: u32::try_from(runner.entries.len()).unwrap_or(u32::MAX),
            })
            .collect()
    }

    fn unindex(&mut self, id: u32) {
        let Some(entry) = self.entries.get(id as usize) else {
            return;
        };
        let (prompt, answer, session) = (entry.prompt, entry.answer, entry.session);
        for point in std::iter::once(prompt).chain(answer) {
            if self.by_hash.get(&point.hash) == Some(&id) {
                self.by_hash.remove(&point.hash);
            }
        }
        if let Some(session) = session
            && self.by_session.get(&session) == Some(&id)
        {
            self.by_session.remove(&session);
        }
    }

    /// Removes entry `id` from the maps and the free list takes it (its runner's list is
    /// the caller's).
    fn remove(&mut self, id: u32) {
        self.unindex(id);
        let Some(entry) = self.entries.get_mut(id as usize) else {
            return;
        };
        if !entry.live {
            return;
        }
        entry.live = false;
        entry.generation = entry.generation.wrapping_add(1);
        let held = entry.engine_slot.take();
        entry.set_aside = false;
        let runner = entry.runner as usize;
        if let Some(state) = self.runners.get_mut(runner) {
            state.entries.retain(|other| *other != id);
            if let Some(slot) = held.and_then(|slot| state.engine_slots.get_mut(slot as usize))
                && slot.holder == Some(id)
            {
                slot.holder = None;
            }
        }
        self.live -= 1;
        self.free.push(id);
    }
}
