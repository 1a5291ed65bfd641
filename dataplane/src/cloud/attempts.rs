//! Layer 1: the keys one call tries, in order, and what each failure does to the pool.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use super::{Failure, KeyId, KeyPool, Lease, PoolState, Refusal};
use crate::policy::normalize_model;
use crate::redact::redact_key;
use crate::router::strip_cloud_suffix;

/// The keys one call may still try. Borrowed from the pool for the call's duration; the pool's
/// lock is taken only inside each method, never across the caller's `.await`s.
pub struct Attempts<'a> {
    pool: &'a KeyPool,
    /// The lease's key, tried first.
    preferred: Option<KeyId>,
    /// The model asked for (normalised), when known: accounts that refused it are skipped.
    model: Option<Arc<str>>,
    /// Keys handed out in this call (never handed out twice).
    tried: Vec<KeyId>,
    /// Accounts skipped for the rest of this call (at their concurrency limit).
    skipped_accounts: Vec<Arc<str>>,
    /// Set by a host-level failure: no further key helps.
    stopped: bool,
    last_failure: Option<Failure>,
}

/// One key to try. Its `Debug` shows only the redacted key.
pub struct Attempt {
    id: KeyId,
    key: Arc<str>,
}

impl KeyPool {
    /// The keys to try for one call: the lease's key first (if any), then rotation from the key
    /// that last worked, idle keys before keys leased by other requests, skipping cooling
    /// accounts and disabled keys. Re-evaluated at each [`Attempts::next_key`], so a failure
    /// mid-call that cools an account skips its other keys at once.
    pub fn attempts(&self, lease: &Lease) -> Attempts<'_> {
        Attempts {
            pool: self,
            preferred: lease.key_id(),
            model: None,
            tried: Vec::new(),
            skipped_accounts: Vec::new(),
            stopped: false,
            last_failure: None,
        }
    }
}

impl Attempts<'_> {
    /// The same attempts for a request for `model`: accounts that refused it (a model-specific
    /// 403 or 402) are skipped, and a [`Failure::ModelRefused`] or
    /// [`Failure::ExtraUsageEmpty`] is remembered for it.
    #[must_use]
    pub fn for_model(mut self, model: &str) -> Self {
        if !model.is_empty() {
            self.model = Some(normalize_model(strip_cloud_suffix(model)).into());
        }
        self
    }

    /// The next key to try at `now`, or `None` when no key is left for this call (every key
    /// tried, cooling or disabled, or the host backing off).
    pub fn next_key(&mut self, now: Instant) -> Option<Attempt> {
        if self.stopped {
            return None;
        }
        let state = self.pool.lock();
        if state.host_backoff_until.is_some_and(|until| until > now) {
            self.stopped = true;
            return None;
        }
        let index = self.pick(&state, now)?;
        let slot = state.keys.get(index)?;
        self.tried.push(slot.id);
        Some(Attempt {
            id: slot.id,
            key: slot.secret.clone(),
        })
    }

    /// Reports that `attempt` failed: applies the failure's cooldown to the account, key or
    /// host (see [`Failure`]) and moves rotation past the key. The next [`next_key`] then gives
    /// another key at once, or none after a host-level failure.
    ///
    /// [`next_key`]: Attempts::next_key
    pub fn fail(&mut self, attempt: &Attempt, failure: Failure, now: Instant) {
        self.last_failure = Some(failure);
        let cooldowns = &self.pool.cooldowns;
        let mut state = self.pool.lock();
        let Some(index) = state.position(attempt.id) else {
            return;
        };
        let account = state.keys[index].account.clone();
        state.keys[index].last_error = Some(failure.as_str());
        match failure {
            Failure::Quota(window) => {
                let until = now + cooldowns.quota(window);
                let entry = state.cooling.entry(account).or_insert(until);
                *entry = (*entry).max(until);
            }
            Failure::Auth => state.keys[index].disabled_until = Some(now + cooldowns.auth),
            // Unconfirmed, a 403 never disables a key: at most the model is refused. A 402 for
            // an extra-usage-only model refuses the model on this account, nothing more.
            Failure::ModelRefused | Failure::Forbidden | Failure::ExtraUsageEmpty => {
                if let Some(model) = self.model.clone() {
                    let refusal = if failure == Failure::ExtraUsageEmpty {
                        (now + cooldowns.extra_usage, Refusal::ExtraUsage)
                    } else {
                        (now + cooldowns.model_refused, Refusal::Subscription)
                    };
                    state.refuse(account.clone(), model.clone(), refusal, now);
                    // Other accounts' keys then bind to it; this one is free for other models.
                    for slot in &mut state.keys {
                        if slot.account == account && slot.bound.as_ref() == Some(&model) {
                            slot.bound = None;
                        }
                    }
                }
                self.skipped_accounts.push(account);
            }
            Failure::SlotTimeout | Failure::Timeout => self.skipped_accounts.push(account),
            Failure::Overloaded => {
                state.host_backoff_until = Some(now + cooldowns.overloaded);
                self.stopped = true;
            }
            Failure::Connect => self.stopped = true,
            Failure::Server => {}
        }
        // Rotation restarts after the failed key, unless it already starts elsewhere.
        if state.cursor.is_none_or(|cursor| cursor == attempt.id) {
            let next = (index + 1) % state.keys.len();
            state.cursor = Some(state.keys[next].id);
        }
        state.cooling.retain(|_, until| *until > now);
    }

    /// Reports that `attempt` got an answer: the next call starts from this key.
    ///
    /// Returns the account that served, as the snapshot names it (its label, or `key:` and
    /// the key's digest), for usage accounting.
    pub fn succeed(&mut self, attempt: &Attempt) -> Option<Arc<str>> {
        let mut state = self.pool.lock();
        let index = state.position(attempt.id)?;
        state.keys[index].last_error = None;
        state.cursor = Some(attempt.id);
        let account = &state.keys[index].account;
        Some(
            account
                .strip_prefix("account:")
                .map_or_else(|| account.clone(), Arc::from),
        )
    }

    /// The last failure reported in this call (to choose the final status: 429 after quota
    /// errors, 503 otherwise).
    pub fn last_failure(&self) -> Option<Failure> {
        self.last_failure
    }

    /// How many keys this call was given.
    pub fn tried(&self) -> usize {
        self.tried.len()
    }

    fn pick(&self, state: &PoolState, now: Instant) -> Option<usize> {
        let allowed = |index: usize| {
            let slot = &state.keys[index];
            !self.tried.contains(&slot.id)
                && !self.skipped_accounts.contains(&slot.account)
                && state.usable(slot, now)
                && !state.under_reserve(&slot.account)
                && self
                    .model
                    .as_ref()
                    .is_none_or(|model| !state.refuses(&slot.account, model, now))
        };
        if let Some(index) = self.preferred.and_then(|id| state.position(id))
            && allowed(index)
        {
            return Some(index);
        }
        let count = state.keys.len();
        let start = state.cursor.and_then(|id| state.position(id)).unwrap_or(0);
        let rotation = (0..count).map(|offset| (start + offset) % count);
        // Idle keys first, so a request that could not get a lease does not pile onto a key
        // another request holds; then the leased ones.
        // Among those, the account with the most left (when balances say so).
        state
            .fullest(
                rotation
                    .clone()
                    .filter(|&index| state.keys[index].lease.is_none() && allowed(index)),
            )
            .or_else(|| state.fullest(rotation.clone().filter(|&index| allowed(index))))
    }
}

impl Attempt {
    /// The key to present (`Authorization: Bearer …`; mark the header value sensitive).
    pub fn key(&self) -> &str {
        &self.key
    }
}

impl fmt::Debug for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Attempt")
            .field("key", &redact_key(&self.key))
            .finish()
    }
}

impl fmt::Debug for Attempts<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Attempts")
            .field("host", self.pool.host())
            .field("tried", &self.tried.len())
            .field("stopped", &self.stopped)
            .field("last_failure", &self.last_failure)
            .finish_non_exhaustive()
    }
}
