//! Layer 2: warmth binding. A request for model M leases a key bound to M, so that consecutive
//! requests for M reach Ollama Cloud on the same key and M stays warm behind it.
//!
//! The choice, made under the pool's lock (so two requests can never reserve the same key):
//! 1. an idle usable key bound to M: lease it;
//! 2. a usable key bound to M that is busy: wait for it (requests for the same model share
//!    one key rather than fan out);
//! 3. an idle unbound key, on the account with the most left (balances read by the control
//!    plane, one plan kind), else on the account with the fewest bound keys: bind it to M;
//! 4. an idle key whose model has gone cold (`Cooldowns::warm_for` since its release): rebind;
//! 5. an idle key still warm for another model: no lease (plain rotation), rather than evict it;
//! 6. every usable key busy: wait;
//! 7. no usable key, or fewer than two keys: no lease.
//!
//! Keys of an account at or under its reserve (or predicted empty) take no part.
//!
//! Waiting ends when a key frees or the keys change (then the choice runs again), or at the
//! deadline, with no lease. An empty lease is never an error: the request proceeds on plain
//! rotation (layer 1).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{KeyId, KeyPool, PoolState};
use crate::policy::normalize_model;
use crate::router::strip_cloud_suffix;

/// A key reserved for one request (or none). Dropping it frees the key and keeps its binding.
/// Keep it for the whole response, in the response body.
pub struct Lease {
    held: Option<Held>,
}

struct Held {
    pool: Arc<KeyPool>,
    id: KeyId,
    token: u64,
}

/// What the choice says.
enum Step {
    Take(usize),
    Wait,
    Plain,
}

impl KeyPool {
    /// Leases the key bound to `model`, waiting up to `timeout` while it is busy. Never fails:
    /// an empty lease means "use plain rotation".
    pub async fn acquire(self: &Arc<Self>, model: &str, timeout: Duration) -> Lease {
        self.acquire_until(model, tokio::time::sleep(timeout)).await
    }

    /// [`acquire`](KeyPool::acquire) with the deadline as a future: waiting stops when
    /// `deadline` completes.
    pub async fn acquire_until(
        self: &Arc<Self>,
        model: &str,
        deadline: impl Future<Output = ()>,
    ) -> Lease {
        let model: Arc<str> = normalize_model(strip_cloud_suffix(model)).into();
        let mut deadline = std::pin::pin!(deadline);
        loop {
            // Registered before looking, so a release between the look and the wait is not lost.
            let mut changed = std::pin::pin!(self.changed.notified());
            changed.as_mut().enable();
            if let Some(lease) = self.try_acquire(&model, Instant::now()) {
                return lease;
            }
            tokio::select! {
                biased;
                () = &mut changed => {}
                () = &mut deadline => return Lease::none(),
            }
        }
    }

    /// One look without waiting: a lease (possibly empty), or `None` when the request should
    /// wait for a key to free.
    fn try_acquire(self: &Arc<Self>, model: &Arc<str>, now: Instant) -> Option<Lease> {
        let mut state = self.lock();
        match choose(&state, model, now, self.cooldowns.warm_for) {
            Step::Plain => Some(Lease::none()),
            Step::Wait => None,
            Step::Take(index) => {
                let token = state.next_token;
                state.next_token += 1;
                let slot = &mut state.keys[index];
                slot.bound = Some(model.clone());
                slot.lease = Some(token);
                Some(Lease {
                    held: Some(Held {
                        pool: self.clone(),
                        id: slot.id,
                        token,
                    }),
                })
            }
        }
    }

    fn release(&self, id: KeyId, token: u64) {
        let mut state = self.lock();
        if let Some(index) = state.position(id)
            && state.keys[index].lease == Some(token)
        {
            let slot = &mut state.keys[index];
            slot.lease = None;
            slot.idle_since = Some(Instant::now());
        }
        drop(state);
        self.changed.notify_waiters();
    }
}

fn choose(state: &PoolState, model: &Arc<str>, now: Instant, warm_for: Duration) -> Step {
    if state.keys.len() < 2 {
        // One key: binding could only make requests queue for it.
        return Step::Plain;
    }
    // A key whose account refused the model is never bound to it, nor one whose account is at
    // its reserve: warmth holds while the account has room.
    let usable: Vec<usize> = (0..state.keys.len())
        .filter(|&index| {
            let slot = &state.keys[index];
            state.usable(slot, now)
                && !state.refuses(&slot.account, model, now)
                && !state.under_reserve(&slot.account)
        })
        .collect();
    if usable.is_empty() {
        return Step::Plain;
    }
    let slot = |index: usize| &state.keys[index];
    let bound_to_model = |index: usize| slot(index).bound.as_ref() == Some(model);
    let idle = |index: usize| slot(index).lease.is_none();

    if let Some(&index) = usable.iter().find(|&&i| bound_to_model(i) && idle(i)) {
        return Step::Take(index);
    }
    if usable.iter().any(|&i| bound_to_model(i)) {
        return Step::Wait;
    }
    let bindings = |index: usize| {
        let account = &slot(index).account;
        state
            .keys
            .iter()
            .filter(|other| &other.account == account && other.bound.is_some())
            .count()
    };
    // An unbound key: on the account with the most left (when balances say so), else on the
    // one with the fewest bindings.
    let mut unbound: Vec<usize> = usable
        .iter()
        .copied()
        .filter(|&i| idle(i) && slot(i).bound.is_none())
        .collect();
    unbound.sort_by_key(|&i| bindings(i));
    if let Some(index) = state.fullest(unbound.into_iter()) {
        return Step::Take(index);
    }
    let cold = |index: usize| {
        slot(index)
            .idle_since
            .is_none_or(|since| now.saturating_duration_since(since) >= warm_for)
    };
    if let Some(&index) = usable
        .iter()
        .filter(|&&i| idle(i) && cold(i))
        .min_by_key(|&&i| slot(i).idle_since)
    {
        return Step::Take(index);
    }
    if usable.iter().any(|&i| idle(i)) {
        return Step::Plain;
    }
    Step::Wait
}

impl Lease {
    /// No key reserved: plain rotation.
    pub fn none() -> Self {
        Lease { held: None }
    }

    /// Whether a key is reserved.
    pub fn is_bound(&self) -> bool {
        self.held.is_some()
    }

    pub(super) fn key_id(&self) -> Option<KeyId> {
        self.held.as_ref().map(|held| held.id)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            held.pool.release(held.id, held.token);
        }
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("bound", &self.is_bound())
            .finish_non_exhaustive()
    }
}
