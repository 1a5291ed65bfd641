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
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    runners: HashMap<String, Runner>,
    log: Vec<RunnerEntry>,
}

#[derive(Debug)]
struct Runner {
    slots: Arc<Semaphore>,
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
}

/// A runner slot; released on drop.
#[derive(Debug)]
pub(crate) struct RunnerSlot {
    runners: Arc<Runners>,
    model: String,
    _permit: OwnedSemaphorePermit,
}

impl Runners {
    pub(crate) fn new(num_parallel: usize, forced: Vec<String>) -> Self {
        Self {
            num_parallel: num_parallel.max(1),
            forced,
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
        if let Some(runner) = state.runners.get_mut(model) {
            runner.in_flight += 1;
            runner.peak = runner.peak.max(runner.in_flight);
            if queued {
                runner.waiting = runner.waiting.saturating_sub(1);
            }
        }
        state.log.push(RunnerEntry {
            model: model.to_owned(),
            client,
            waited: started.saturating_duration_since(arrived),
            started,
        });
        RunnerSlot {
            runners: Arc::clone(self),
            model: model.to_owned(),
            _permit: permit,
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
        }
    }
}
