//! Ollama's request slots (reference §A.6): `OLLAMA_NUM_PARALLEL` permits that inference requests
//! wait for without limit and without error, an optional pending-queue limit that yields the
//! busy 503, and the counters tests assert on (in flight, queued, peak concurrency globally, per
//! `x-client-id` and per cloud key). The hold gate lets a test freeze admitted requests inside
//! their slot and release them one by one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};

use super::record::lock;

/// The slots and their counters.
#[derive(Debug)]
pub(crate) struct Slots {
    semaphore: Arc<Semaphore>,
    max_queue: Option<usize>,
    queued: watch::Sender<usize>,
    counts: Mutex<Counts>,
    in_flight: watch::Sender<usize>,
    hold: Mutex<Hold>,
    hold_changed: Notify,
}

/// The queue is over `max_queue`: Ollama's 503 "server busy".
#[derive(Debug)]
pub(crate) struct Busy;

/// A held slot; released on drop.
#[derive(Debug)]
pub(crate) struct SlotGuard {
    slots: Arc<Slots>,
    client: Option<String>,
    key: Option<String>,
    _permit: OwnedSemaphorePermit,
}

#[derive(Debug, Default)]
struct Counts {
    in_flight: usize,
    peak: usize,
    per_client: HashMap<String, Peak>,
    per_key: HashMap<String, Peak>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Peak {
    now: usize,
    peak: usize,
}

#[derive(Debug, Default)]
struct Hold {
    holding: bool,
    tickets: usize,
}

// Counts one queued request for as long as it waits (it may be cancelled while waiting).
struct Waiting<'a>(&'a Slots);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.queued.send_modify(|queued| *queued -= 1);
    }
}

impl Slots {
    /// `slots` permits; beyond `max_queue` waiters, requests are refused.
    pub fn new(slots: usize, max_queue: Option<usize>) -> Self {
        Self {
            semaphore: Arc::new(Semaphore::new(slots.max(1))),
            max_queue,
            queued: watch::Sender::new(0),
            counts: Mutex::default(),
            in_flight: watch::Sender::new(0),
            hold: Mutex::default(),
            hold_changed: Notify::new(),
        }
    }

    /// Waits for a slot (FIFO), or fails at once when the queue is full.
    pub async fn acquire(
        self: &Arc<Self>,
        client: Option<String>,
        key: Option<String>,
    ) -> Result<SlotGuard, Busy> {
        let permit = match Arc::clone(&self.semaphore).try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                let mut full = false;
                self.queued.send_modify(|queued| {
                    full = self.max_queue.is_some_and(|max| *queued >= max);
                    if !full {
                        *queued += 1;
                    }
                });
                if full {
                    return Err(Busy);
                }
                let waiting = Waiting(self);
                let permit = Arc::clone(&self.semaphore)
                    .acquire_owned()
                    .await
                    .map_err(|_| Busy)?;
                drop(waiting);
                permit
            }
        };
        let mut guard = lock(&self.counts);
        let counts = &mut *guard;
        counts.in_flight += 1;
        counts.peak = counts.peak.max(counts.in_flight);
        for (map, name) in [
            (&mut counts.per_client, &client),
            (&mut counts.per_key, &key),
        ] {
            if let Some(name) = name {
                let entry = map.entry(name.clone()).or_default();
                entry.now += 1;
                entry.peak = entry.peak.max(entry.now);
            }
        }
        self.in_flight.send_replace(counts.in_flight);
        Ok(SlotGuard {
            slots: Arc::clone(self),
            client,
            key,
            _permit: permit,
        })
    }

    /// Waits at the hold gate: returns at once unless the fake is holding, in which case it waits
    /// for a release ticket or for `release_all`.
    pub async fn pass_hold(&self) {
        loop {
            let changed = self.hold_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut hold = lock(&self.hold);
                if !hold.holding {
                    return;
                }
                if hold.tickets > 0 {
                    hold.tickets -= 1;
                    return;
                }
            }
            changed.await;
        }
    }

    /// From now on, admitted requests wait at the gate.
    pub fn hold(&self) {
        *lock(&self.hold) = Hold {
            holding: true,
            tickets: 0,
        };
    }

    /// Lets `n` held requests (present or future) through.
    pub fn release(&self, n: usize) {
        lock(&self.hold).tickets += n;
        self.hold_changed.notify_waiters();
    }

    /// Stops holding and lets everybody through.
    pub fn release_all(&self) {
        *lock(&self.hold) = Hold::default();
        self.hold_changed.notify_waiters();
    }

    /// Requests holding a slot now.
    pub fn in_flight(&self) -> usize {
        *self.in_flight.borrow()
    }

    /// Requests waiting for a slot now.
    pub fn queued(&self) -> usize {
        *self.queued.borrow()
    }

    /// The most requests that held a slot at once.
    pub fn peak(&self) -> usize {
        lock(&self.counts).peak
    }

    /// The same, for one `x-client-id`.
    pub fn peak_of_client(&self, client: &str) -> usize {
        lock(&self.counts)
            .per_client
            .get(client)
            .map_or(0, |peak| peak.peak)
    }

    /// The same, for one cloud key.
    pub fn peak_of_key(&self, key: &str) -> usize {
        lock(&self.counts)
            .per_key
            .get(key)
            .map_or(0, |peak| peak.peak)
    }

    /// Resolves once `done(in_flight)` holds.
    pub async fn wait_in_flight(&self, done: impl FnMut(&usize) -> bool) {
        // The sender lives as long as `self`.
        let _ = self.in_flight.subscribe().wait_for(done).await;
    }

    /// Resolves once `done(queued)` holds.
    pub async fn wait_queued(&self, done: impl FnMut(&usize) -> bool) {
        let _ = self.queued.subscribe().wait_for(done).await;
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let mut guard = lock(&self.slots.counts);
        let counts = &mut *guard;
        counts.in_flight -= 1;
        for (map, name) in [
            (&mut counts.per_client, &self.client),
            (&mut counts.per_key, &self.key),
        ] {
            if let Some(entry) = name.as_ref().and_then(|name| map.get_mut(name)) {
                entry.now -= 1;
            }
        }
        self.slots.in_flight.send_replace(counts.in_flight);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn queue_limit_and_peaks() {
        let slots = Arc::new(Slots::new(1, Some(1)));
        let first = slots.acquire(Some("a".into()), None).await.ok();
        assert!(first.is_some());
        let waiter = {
            let slots = Arc::clone(&slots);
            tokio::spawn(async move {
                slots
                    .acquire(Some("a".into()), Some("k".into()))
                    .await
                    .is_ok()
            })
        };
        slots.wait_queued(|queued| *queued == 1).await;
        assert!(
            slots.acquire(None, None).await.is_err(),
            "second waiter is over max_queue"
        );
        drop(first);
        assert!(waiter.await.unwrap_or(false));
        assert_eq!(
            (
                slots.peak(),
                slots.peak_of_client("a"),
                slots.peak_of_key("k")
            ),
            (1, 1, 1)
        );
        assert_eq!((slots.in_flight(), slots.queued()), (0, 0));
    }

    #[tokio::test]
    async fn hold_gate_counts_tickets() {
        let slots = Arc::new(Slots::new(4, None));
        slots.hold();
        slots.release(1);
        slots.pass_hold().await;
        let held = {
            let slots = Arc::clone(&slots);
            tokio::spawn(async move { slots.pass_hold().await })
        };
        tokio::task::yield_now().await;
        assert!(!held.is_finished());
        slots.release_all();
        assert!(held.await.is_ok());
    }
}
