//! The fake's faithful VRAM mode (off unless `FakeBuilder::vram` is set): models take room in a
//! VRAM of fixed capacity, cold requests wait in one FIFO pending queue, victims are evicted by
//! keep-alive then name once their in-flight requests finish, and loads and unloads take time,
//! as in Ollama's `server/sched.go`. `sched` holds the rules with time passed in; this module
//! wraps them in a mutex, a driver task for the timers, and a watch of the state that requests
//! and tests wait on.
//!
//! A request takes its model (`Vram::acquire`) before it takes a slot, as an Ollama request gets
//! its runner before the runner's semaphore; the `Resident` guard it gets back lives as long as
//! the slot.

mod config;
mod sched;

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::gojson::KeepAlive;
use super::record::lock;

pub(crate) use config::Config;
pub(crate) use sched::Snapshot;
use sched::{Attach, Keep, Sched};

/// How long a model stays loaded when the request says nothing (`OLLAMA_KEEP_ALIVE`).
const DEFAULT_KEEP_ALIVE: Duration = Duration::from_secs(300);
/// What `/api/ps` shows as the expiry of a model kept forever: far in the future.
const FOREVER: Duration = Duration::from_secs(200 * 365 * 24 * 3600);

/// The VRAM of one fake.
#[derive(Debug)]
pub(crate) struct Vram {
    sched: Mutex<Sched>,
    events: watch::Sender<Snapshot>,
    // Wakes the driver to recompute its next deadline.
    wake: Arc<Notify>,
}

/// A request's hold on its model; the last one dropped starts the model's keep-alive.
#[derive(Debug)]
pub(crate) struct Resident {
    vram: Arc<Vram>,
    model: String,
}

/// Why a request cannot have its model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The model can never fit: Ollama's message.
    TooLarge(String),
    /// The pending queue is full: Ollama's busy 503.
    Busy,
}

/// One `/api/ps` row: name, size and expiry.
#[derive(Debug, Clone)]
pub(crate) struct Listed {
    pub name: String,
    pub size: u64,
    pub expires_at: SystemTime,
}

// Leaves the pending queue (or gives the model back) when a queued request goes away.
struct Queued<'a> {
    vram: &'a Arc<Vram>,
    id: u64,
    model: &'a str,
    armed: bool,
}

impl Vram {
    /// An empty VRAM with the `preloaded` models resident; starts the driver task.
    pub fn spawn(config: Config, preloaded: &[String]) -> Arc<Self> {
        let mut sched = Sched::new(config);
        for name in preloaded {
            sched.preload(name);
        }
        let vram = Arc::new(Self {
            events: watch::Sender::new(sched.snapshot()),
            sched: Mutex::new(sched),
            wake: Arc::new(Notify::new()),
        });
        tokio::spawn(drive(Arc::downgrade(&vram), Arc::clone(&vram.wake)));
        vram
    }

    /// Waits until the request holds `name` in VRAM, loaded: at once when it is resident, else
    /// behind the pending queue, the victims' in-flight requests, the unload and the load.
    pub async fn acquire(
        self: &Arc<Self>,
        name: &str,
        keep_alive: Option<KeepAlive>,
    ) -> Result<Resident, Refused> {
        let keep = keep_of(keep_alive);
        let mut events = self.events.subscribe();
        let attached = self.change(|sched, now| sched.attach(name, keep, now));
        if attached == Attach::Busy {
            return Err(Refused::Busy);
        }
        if let Attach::Queued(id) = attached {
            let mut queued = Queued {
                vram: self,
                id,
                model: name,
                armed: true,
            };
            loop {
                let grant = lock(&self.sched).take_grant(id);
                match grant {
                    Some(Ok(())) => break,
                    Some(Err(message)) => {
                        queued.armed = false;
                        return Err(Refused::TooLarge(message));
                    }
                    None => {}
                }
                // The sender lives as long as `self`.
                let _ = events.changed().await;
            }
            queued.armed = false;
        }
        let resident = Resident {
            vram: Arc::clone(self),
            model: name.to_owned(),
        };
        while lock(&self.sched).is_loading(name) {
            let _ = events.changed().await;
        }
        Ok(resident)
    }

    /// `keep_alive: 0` with an empty prompt: unloads the model once its requests finish.
    pub fn unload(&self, name: &str) {
        self.change(|sched, now| sched.expire(name, now));
    }

    /// The rows of `/api/ps`: loaded and loading models, the one with the most time left first.
    pub fn listed(&self) -> Vec<Listed> {
        let (now, wall) = (Instant::now(), SystemTime::now());
        let mut rows: Vec<Listed> = lock(&self.sched)
            .listed()
            .into_iter()
            .map(|(name, size, expires, keep)| {
                let left = match (expires, keep) {
                    (Some(at), _) => at.saturating_duration_since(now),
                    (None, Keep::Forever) => FOREVER,
                    // In use: Ollama shows the keep-alive counted from now.
                    (None, Keep::For(duration)) => duration,
                };
                Listed {
                    name,
                    size,
                    expires_at: wall + left,
                }
            })
            .collect();
        rows.sort_by_key(|row| std::cmp::Reverse(row.expires_at));
        rows
    }

    /// The current resident set, queue and counters.
    pub fn snapshot(&self) -> Snapshot {
        self.events.borrow().clone()
    }

    /// Resolves once `done` holds of the snapshot.
    pub async fn wait_for(&self, done: impl FnMut(&Snapshot) -> bool) {
        let _ = self.events.subscribe().wait_for(done).await;
    }

    // Applies a change, publishes the new state and wakes the driver for its new deadline.
    fn change<T>(&self, apply: impl FnOnce(&mut Sched, Instant) -> T) -> T {
        let outcome = {
            let mut sched = lock(&self.sched);
            let outcome = apply(&mut sched, Instant::now());
            self.events.send_replace(sched.snapshot());
            outcome
        };
        self.wake.notify_one();
        outcome
    }
}

impl Drop for Vram {
    fn drop(&mut self) {
        self.wake.notify_one();
    }
}

impl Drop for Resident {
    fn drop(&mut self) {
        let model = &self.model;
        self.vram.change(|sched, now| sched.release(model, now));
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.armed {
            let (id, model) = (self.id, self.model);
            self.vram.change(|sched, now| sched.cancel(id, model, now));
        }
    }
}

// Runs the timers: pumps the scheduler, publishes, sleeps until the next deadline or a change.
// It holds the VRAM only while pumping, and ends once the fake is gone. A change made between
// the pump and the wait leaves a permit in `wake`, so it is not missed.
async fn drive(vram: Weak<Vram>, wake: Arc<Notify>) {
    loop {
        let deadline = {
            let Some(vram) = vram.upgrade() else {
                return;
            };
            let mut sched = lock(&vram.sched);
            let deadline = sched.pump(Instant::now());
            vram.events.send_replace(sched.snapshot());
            deadline
        };
        match deadline {
            Some(at) => {
                tokio::select! {
                    () = wake.notified() => {}
                    () = tokio::time::sleep_until(at) => {}
                }
            }
            None => wake.notified().await,
        }
    }
}

fn keep_of(keep_alive: Option<KeepAlive>) -> Keep {
    match keep_alive {
        None => Keep::For(DEFAULT_KEEP_ALIVE),
        Some(KeepAlive::Unload) => Keep::For(Duration::ZERO),
        Some(KeepAlive::For(duration)) => Keep::For(duration),
        Some(KeepAlive::Forever) => Keep::Forever,
    }
}
