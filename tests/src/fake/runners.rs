//! Ollama's model runners (reference §4): since 0.30 each loaded model runs as its own runner
//! with `OLLAMA_NUM_PARALLEL` slots, one for embedding models and for the architectures
//! Ollama forces, whatever the setting. A request beyond its runner's free slots waits inside
//! the runner, FIFO, where no tier applies: the fake logs when each request arrived and when
//! its slot started, so a test can see what waited inside "Ollama".

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::record::lock;

/// The runners of one fake, when the mode is on.
#[derive(Debug)]
pub(crate) struct Runners {
    /// Slots of a runner that is not forced to one.
    num_parallel: usize,
    /// Models run with one slot whatever `num_parallel` (lowercase names with a tag).
    forced: Vec<String>,
    /// The prompt cache, when on: prefill time per 1,000 uncached tokens.
    prefill_per_1k: Option<Duration>,
    state: Mutex<State>,
}

/// A slot's prompt cache (reference §5): what it last read and wrote.
#[derive(Debug, Default, Clone)]
struct SlotCache {
    text: String,
    busy: bool,
    used: u64,
}

/// What the prompt cache made of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheUse {
    /// The prompt's tokens (4 bytes a token).
    pub prompt_tokens: usize,
    /// Those found in the slot's cache.
    pub cached_tokens: usize,
    /// The time to read the rest.
    pub prefill: Duration,
}

/// llama-server's `--slot-prompt-similarity`.
const SIMILARITY: f64 = 0.10;

/// The longest common prefix of two strings, in bytes.
fn common_prefix(a: &str, b: &str) -> usize {
    a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count()
}

#[derive(Debug, Default)]
struct State {
    runners: HashMap<String, Runner>,
    log: Vec<RunnerEntry>,
}

#[derive(Debug)]
struct Runner {
    slots: Arc<Semaphore>,
    cache: Vec<SlotCache>,
    tick: u64,
    in_flight: usize,
    peak: usize,
    /// Requests waiting for a slot now, and the most that ever did.
    waiting: usize,
    peak_waiting: usize,
}

/// One request's time at its runner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerEntry {
    /// The model, lowercase with its tag.
    pub model: String,
    /// Its `X-Client-ID`.
    pub client: Option<String>,
    /// From its arrival at the runner to the start of its slot: the time it waited inside
    /// Ollama.
    pub waited: Duration,
    /// When its slot started.
    pub started: Instant,
    /// What the prompt cache made of it, when the cache is on.
    pub cache: Option<CacheUse>,
}

/// A runner slot; released on drop.
#[derive(Debug)]
pub(crate) struct RunnerSlot {
    runners: Arc<Runners>,
    model: String,
    /// The cache slot it holds, when the prompt cache is on.
    cache_slot: Option<usize>,
    /// What the prompt cache made of it.
    pub(crate) cache: Option<CacheUse>,
    _permit: OwnedSemaphorePermit,
}

impl Runners {
    pub(crate) fn new(
        num_parallel: usize,
        forced: Vec<String>,
        prefill_per_1k: Option<Duration>,
    ) -> Self {
        Self {
            num_parallel: num_parallel.max(1),
            forced,
            prefill_per_1k,
            state: Mutex::default(),
        }
    }

    /// The slots `model`'s runner has: one when `embedding` or forced, else `num_parallel`.
    pub(crate) fn slots_of(&self, model: &str, embedding: bool) -> usize {
        if embedding || self.forced.iter().any(|forced| forced == model) {
            1
        } else {
            self.num_parallel
        }
    }

    /// Waits (FIFO) for a slot of `model`'s runner, logging the wait.
    pub(crate) async fn acquire(
        self: &Arc<Self>,
        model: &str,
        embedding: bool,
        client: Option<String>,
        prompt: Option<(&super::prompt::Prompt, &str)>,
    ) -> RunnerSlot {
        let arrived = Instant::now();
        let (semaphore, queued) = {
            let mut state = lock(&self.state);
            let slots = self.slots_of(model, embedding);
            let runner = state
                .runners
                .entry(model.to_owned())
                .or_insert_with(|| Runner {
                    slots: Arc::new(Semaphore::new(slots)),
                    cache: vec![SlotCache::default(); slots],
                    tick: 0,
                    in_flight: 0,
                    peak: 0,
                    waiting: 0,
                    peak_waiting: 0,
                });
            let queued = runner.slots.available_permits() == 0;
            if queued {
                runner.waiting += 1;
                runner.peak_waiting = runner.peak_waiting.max(runner.waiting);
            }
            (Arc::clone(&runner.slots), queued)
        };
        // The semaphore is never closed.
        let permit = semaphore
            .acquire_owned()
            .await
            .unwrap_or_else(|_| unreachable!("runner semaphores are never closed"));
        let started = Instant::now();
        let mut state = lock(&self.state);
        let mut cache_slot = None;
        let mut cache = None;
        if let Some(runner) = state.runners.get_mut(model) {
            runner.in_flight += 1;
            runner.peak = runner.peak.max(runner.in_flight);
            if queued {
                runner.waiting = runner.waiting.saturating_sub(1);
            }
            if let (Some(per_1k), Some((prompt, answer))) = (self.prefill_per_1k, prompt) {
                let (slot, used) = Self::take_slot(runner, prompt, answer, per_1k);
                cache_slot = Some(slot);
                cache = Some(used);
            }
        }
        state.log.push(RunnerEntry {
            model: model.to_owned(),
            client,
            waited: started.saturating_duration_since(arrived),
            started,
            cache,
        });
        RunnerSlot {
            runners: Arc::clone(self),
            model: model.to_owned(),
            cache_slot,
            cache,
            _permit: permit,
        }
    }

    /// llama-server's slot choice (reference §5): among idle slots, the one whose longest
    /// common prefix with the prompt, over the prompt's length, is highest and above
    /// [`SIMILARITY`]; else the least recently used. The slot then holds the prompt and its
    /// answer.
    fn take_slot(
        runner: &mut Runner,
        prompt: &super::prompt::Prompt,
        answer: &str,
        per_1k: Duration,
    ) -> (usize, CacheUse) {
        let length = prompt.text.len().max(1);
        let idle = || {
            runner
                .cache
                .iter()
                .enumerate()
                .filter(|(_, slot)| !slot.busy)
        };
        let similar = idle()
            .map(|(index, slot)| (index, common_prefix(&slot.text, &prompt.text)))
            .filter(|(_, common)| *common as f64 / length as f64 > SIMILARITY)
            .max_by_key(|(_, common)| *common);
        let (index, common) = match similar {
            Some(found) => found,
            None => idle()
                .min_by_key(|(_, slot)| slot.used)
                .map_or((0, 0), |(index, _)| (index, 0)),
        };
        runner.tick += 1;
        let slot = &mut runner.cache[index];
        slot.busy = true;
        slot.used = runner.tick;
        slot.text = prompt.with_answer(answer);
        let prompt_tokens = prompt.text.len().div_ceil(4);
        let cached_tokens = common / 4;
        let uncached = prompt_tokens.saturating_sub(cached_tokens);
        let prefill = per_1k.mul_f64(uncached as f64 / 1000.0);
        (
            index,
            CacheUse {
                prompt_tokens,
                cached_tokens,
                prefill,
            },
        )
    }

    /// `model`'s runner was unloaded: its slots' caches are gone (reference §5).
    pub(crate) fn unload(&self, model: &str) {
        if let Some(runner) = lock(&self.state).runners.get_mut(model) {
            for slot in &mut runner.cache {
                slot.text.clear();
            }
        }
    }

    /// Every request's time at its runner, in the order their slots started.
    pub(crate) fn log(&self) -> Vec<RunnerEntry> {
        lock(&self.state).log.clone()
    }

    /// The most requests `model`'s runner ran at once.
    pub(crate) fn peak(&self, model: &str) -> usize {
        lock(&self.state)
            .runners
            .get(model)
            .map_or(0, |runner| runner.peak)
    }

    /// The most requests that ever waited inside `model`'s runner at once (0: nothing ever
    /// waited in Ollama's queue for it).
    pub(crate) fn peak_waiting(&self, model: &str) -> usize {
        lock(&self.state)
            .runners
            .get(model)
            .map_or(0, |runner| runner.peak_waiting)
    }

    /// Requests running on `model`'s runner now.
    pub(crate) fn in_flight(&self, model: &str) -> usize {
        lock(&self.state)
            .runners
            .get(model)
            .map_or(0, |runner| runner.in_flight)
    }
}

impl Drop for RunnerSlot {
    fn drop(&mut self) {
        if let Some(runner) = lock(&self.runners.state).runners.get_mut(&self.model) {
            runner.in_flight = runner.in_flight.saturating_sub(1);
            if let Some(slot) = self
                .cache_slot
                .and_then(|index| runner.cache.get_mut(index))
            {
                slot.busy = false;
            }
        }
    }
}
