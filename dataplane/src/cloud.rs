//! The Ollama Cloud key pool: which upstream key a request to a `kind: cloud` host presents.
//!
//! Three layers (spec `cloud-key-pools.md`), composed by the request path:
//!
//! 1. **Rotation inside one call** ([`attempts`](KeyPool::attempts)): keys in order, starting
//!    from the last key that worked (rotation state persists across calls), skipping keys whose
//!    ACCOUNT is cooling down or that are disabled. Each failure is reported with
//!    [`Attempts::fail`] and the next key is tried at once, never the same key twice in a call.
//!    Quota limits belong to the account, so a 429 cools every key of that account. See
//!    [`Failure`] for what each failure backs off.
//! 2. **Warmth binding** ([`acquire`](KeyPool::acquire)): each key is bound to at most one model,
//!    so Ollama Cloud keeps that model warm behind it. A request prefers an idle key bound to its
//!    model; concurrent requests for the same model queue for that key (up to `acquire_timeout`)
//!    rather than fanning out; a model with no key binds an unbound one, on the account with the
//!    fewest bindings. The returned [`Lease`] is best effort: an empty lease just means "plain
//!    rotation". Dropping it frees the key and keeps the binding.
//! 3. **Candidate switching** ([`candidates`]): when every key failed for a model, the request
//!    path retries with the host's `fallback_models` in order, and says so in `X-Model-Fallback`.
//!
//! State lives across snapshots: [`CloudPools`] keeps one [`KeyPool`] per cloud host, and each
//! pool keys its state by the key's SHA-256 digest, so cooldowns and bindings survive a snapshot
//! update. No key is ever logged or printed: `Debug` and [`KeyStatus`] show the account label or
//! `…` and the last four characters.
//!
//! Time is passed in (`now`) to everything but the waiting in [`acquire`](KeyPool::acquire), so
//! the logic is tested without sleeping.

mod attempts;

mod failure;
mod lease;
mod status;

#[cfg(test)]
#[allow(clippy::expect_used, clippy::unwrap_used)]
mod tests;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::{Duration, Instant, SystemTime};

use sha2::Digest;
use tokio::sync::Notify;

use crate::policy::{Host, HostKind, Policy, normalize_model};
use crate::redact::redact_key;
use crate::router::strip_cloud_suffix;

pub use crate::balance::{Account, Balance, WindowLeft};
pub use attempts::{Attempt, Attempts};
pub use failure::{Cooldowns, Failure, Window};
pub use lease::Lease;
pub use status::{AccountStatus, RefusedModel, WindowStatus};

/// One key pool per cloud host, kept across snapshots.
#[derive(Debug, Default)]
pub struct CloudPools {
    pools: RwLock<HashMap<Arc<str>, Arc<KeyPool>>>,
}

/// The key pool of one cloud host. Shared (`Arc`) by the requests using it.
pub struct KeyPool {
    host: Arc<str>,
    cooldowns: Cooldowns,
    state: Mutex<PoolState>,
    /// Woken when a key frees or the keys change, for requests waiting in `acquire`.
    changed: Notify,
}

/// One key as status displays show it. Holds no key material.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyStatus {
    /// The account label, or the redacted key when it has none.
    pub label: String,
    /// The redacted key (`…` and the last four characters).
    pub key: String,
    /// The model the key is bound to (normalised).
    pub bound_model: Option<Arc<str>>,
    /// Whether a request holds its lease.
    pub busy: bool,
    /// Until when it is out of rotation (its account cooling down, or the key disabled).
    pub cooldown_until: Option<SystemTime>,
    /// The last failure seen with it, cleared by a success.
    pub last_error: Option<&'static str>,
}

/// Why an account refused one model (and keeps serving every other).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Refusal {
    /// A 403: the model needs a subscription the account lacks.
    Subscription,
    /// A 402: the model bills extra usage only, and the account's extra balance is empty.
    ExtraUsage,
}

/// A key's identity across snapshots: the SHA-256 of the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct KeyId([u8; 32]);

struct PoolState {
    /// In pool order (configuration first, then the environment).
    keys: Vec<KeySlot>,
    /// Account id → cooling down until.
    cooling: HashMap<Arc<str>, Instant>,
    /// Where rotation starts: the key that last worked.
    cursor: Option<KeyId>,
    host_backoff_until: Option<Instant>,
    /// Lease tokens, so that a lease only ever frees its own reservation.
    next_token: u64,
    /// (account id, normalised model) → refused until, and why: a model-specific 403 (a model
    /// that needs a subscription) or a 402 (an extra-usage-only model and an empty extra
    /// balance). Bounded by [`MAX_REFUSALS`]: models are named by clients.
    refused: HashMap<(Arc<str>, Arc<str>), (Instant, Refusal)>,
    /// Account id → the account and its balance, from the snapshot.
    accounts: HashMap<Arc<str>, Account>,
}

/// Most (account, model) refusals remembered per pool; beyond it the one ending first goes.
const MAX_REFUSALS: usize = 1024;

struct KeySlot {
    id: KeyId,
    secret: Arc<str>,
    /// Cooldowns are shared by every key with the same account id.
    account: Arc<str>,
    label: Arc<str>,
    bound: Option<Arc<str>>,
    lease: Option<u64>,
    idle_since: Option<Instant>,
    disabled_until: Option<Instant>,
    last_error: Option<&'static str>,
}

impl CloudPools {
    /// Creates, keeps or drops pools to match the snapshot's cloud hosts.
    pub fn update(&self, policy: &Policy) {
        let mut pools = self.pools.write().unwrap_or_else(PoisonError::into_inner);
        let mut next = HashMap::new();
        for host in policy.hosts.iter().filter(|h| h.kind == HostKind::Cloud) {
            let pool = match pools.remove(&host.name) {
                Some(pool) => {
                    pool.update(host);
                    pool
                }
                None => Arc::new(KeyPool::new(host)),
            };
            next.insert(host.name.clone(), pool);
        }
        *pools = next;
    }

    /// The pool of a cloud host.
    pub fn get(&self, host: &str) -> Option<Arc<KeyPool>> {
        let pools = self.pools.read().unwrap_or_else(PoisonError::into_inner);
        pools.get(host).cloned()
    }
}

impl KeyPool {
    /// A pool with the host's keys and the default cooldowns.
    pub fn new(host: &Host) -> Self {
        Self::with_cooldowns(host, Cooldowns::default())
    }

    /// A pool with the host's keys and these cooldowns.
    pub fn with_cooldowns(host: &Host, cooldowns: Cooldowns) -> Self {
        let pool = KeyPool {
            host: host.name.clone(),
            cooldowns,
            state: Mutex::new(PoolState {
                keys: Vec::new(),
                cooling: HashMap::new(),
                cursor: None,
                host_backoff_until: None,
                next_token: 0,
                refused: HashMap::new(),
                accounts: HashMap::new(),
            }),
            changed: Notify::new(),
        };
        pool.update(host);
        pool
    }

    /// Takes in a new snapshot of the host's keys: state is kept by key digest; a removed key's
    /// lease, if any, is simply forgotten.
    pub fn update(&self, host: &Host) {
        let mut state = self.lock();
        let mut old: HashMap<KeyId, KeySlot> =
            state.keys.drain(..).map(|slot| (slot.id, slot)).collect();
        let mut keys = Vec::with_capacity(host.cloud_keys.len());
        for cloud_key in &host.cloud_keys {
            let id = KeyId(sha2::Sha256::digest(cloud_key.key.as_bytes()).into());
            if keys.iter().any(|slot: &KeySlot| slot.id == id) {
                continue;
            }
            let account: Arc<str> = if cloud_key.account.is_empty() {
                format!("key:{}", hex::encode(&id.0[..8])).into()
            } else {
                format!("account:{}", cloud_key.account).into()
            };
            let slot = match old.remove(&id) {
                Some(mut slot) => {
                    slot.account = account;
                    slot.label = cloud_key.account.clone();
                    slot
                }
                None => KeySlot {
                    id,
                    secret: cloud_key.key.clone(),
                    account,
                    label: cloud_key.account.clone(),
                    bound: None,
                    lease: None,
                    idle_since: None,
                    disabled_until: None,
                    last_error: None,
                },
            };
            keys.push(slot);
        }
        state.keys = keys;
        // A balance seen to change lifts that account's extra-usage refusals (402).
        let mut accounts = HashMap::new();
        for account in &host.cloud_accounts {
            let id = pool_account(&account.account);
            if let (Some(old), Some(new)) = (
                state.accounts.get(&id).and_then(|old| old.balance.as_ref()),
                account.balance.as_ref(),
            ) && old.extra_changed(new)
            {
                state.lift_extra_usage(&id);
            }
            accounts.insert(id, account.clone());
        }
        state.accounts = accounts;
        drop(state);
        self.changed.notify_waiters();
    }

    /// The host's name.
    pub fn host(&self) -> &Arc<str> {
        &self.host
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.lock().keys.len()
    }

    /// Whether the pool has no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Until when the whole host backs off after "Server overloaded", if it still does at `now`.
    pub fn host_backoff_until(&self, now: Instant) -> Option<Instant> {
        self.lock().host_backoff_until.filter(|until| *until > now)
    }

    /// When no key can be tried at `now` (every account cooling, every key disabled, or the host
    /// backing off): how long until one can. `None` when a key can be tried now, or never will
    /// (an empty pool). For `Retry-After` on the 429/503 the request path answers then.
    pub fn retry_after(&self, now: Instant) -> Option<Duration> {
        let state = self.lock();
        let host = state.host_backoff_until.filter(|until| *until > now);
        let mut any_usable = false;
        let mut earliest: Option<Instant> = None;
        for slot in &state.keys {
            match state.unavailable_until(slot, now) {
                None => any_usable = true,
                Some(until) => earliest = Some(earliest.map_or(until, |e| e.min(until))),
            }
        }
        let keys = if any_usable { None } else { earliest };
        [host, keys]
            .into_iter()
            .flatten()
            .max()
            .map(|until| until.saturating_duration_since(now))
    }

    /// Whether every key's account has refused `model` (a model-specific 403 or 402) and still
    /// does at `now`, and why: the request path answers without asking Ollama Cloud again.
    /// When the accounts refused for different reasons, an empty extra balance wins (money
    /// would fix it for that account).
    pub fn refused_everywhere(&self, model: &str, now: Instant) -> Option<Refusal> {
        let model = normalize_model(strip_cloud_suffix(model));
        let state = self.lock();
        let mut reasons = state
            .keys
            .iter()
            .map(|slot| state.refusal(&slot.account, &model, now))
            .collect::<Option<Vec<Refusal>>>()?;
        reasons.sort_by_key(|reason| *reason != Refusal::ExtraUsage);
        reasons.first().copied()
    }

    /// An account's balance was seen to change: its extra-usage refusals (402) end now, so the
    /// next request for such a model asks it again. `account` names it as the snapshot does:
    /// its label, or [`account_id_of_key`] for a key without one.
    pub fn balance_changed(&self, account: &str) {
        self.lock().lift_extra_usage(&pool_account(account));
    }

    /// The accounts of the pool with their balances, in key order.
    pub fn accounts(&self) -> Vec<Account> {
        let state = self.lock();
        let mut seen: Vec<&Arc<str>> = Vec::new();
        let mut out = Vec::new();
        for slot in &state.keys {
            if seen.contains(&&slot.account) {
                continue;
            }
            seen.push(&slot.account);
            if let Some(account) = state.accounts.get(&slot.account) {
                out.push(account.clone());
            }
        }
        out
    }

    /// Every (account, model) pair refused at `now`: the account's label (or the redacted key
    /// of a key without one), the model and the reason, for status displays.
    pub fn refusals(&self, now: Instant) -> Vec<(String, Arc<str>, Refusal)> {
        let state = self.lock();
        let mut out: Vec<(String, Arc<str>, Refusal)> = state
            .refused
            .iter()
            .filter(|(_, (until, _))| *until > now)
            .filter_map(|((account, model), (_, reason))| {
                let slot = state.keys.iter().find(|slot| &slot.account == account)?;
                let label = if slot.label.is_empty() {
                    redact_key(&slot.secret)
                } else {
                    slot.label.to_string()
                };
                Some((label, model.clone(), *reason))
            })
            .collect();
        out.sort();
        out
    }

    /// Whether every account of the pool is at or under its reserve (or empty) as last read:
    /// the request path then answers 429 without asking Ollama Cloud.
    pub fn exhausted(&self) -> bool {
        self.lock().all_under_reserve()
    }

    /// Every key's status, for `/queue/status` and oqpctl.
    pub fn snapshot(&self) -> Vec<KeyStatus> {
        self.snapshot_at(Instant::now(), SystemTime::now())
    }

    /// [`snapshot`](KeyPool::snapshot) with the clocks passed in.
    pub fn snapshot_at(&self, now: Instant, wall: SystemTime) -> Vec<KeyStatus> {
        let state = self.lock();
        state
            .keys
            .iter()
            .map(|slot| {
                let key = redact_key(&slot.secret);
                KeyStatus {
                    label: if slot.label.is_empty() {
                        key.clone()
                    } else {
                        slot.label.to_string()
                    },
                    key,
                    bound_model: slot.bound.clone(),
                    busy: slot.lease.is_some(),
                    cooldown_until: state
                        .unavailable_until(slot, now)
                        .map(|until| wall + until.saturating_duration_since(now)),
                    last_error: slot.last_error,
                }
            })
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // The state stays consistent at every step, so a panic elsewhere does not poison it.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl fmt::Debug for KeyPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyPool")
            .field("host", &self.host)
            .field("keys", &self.snapshot())
            .finish_non_exhaustive()
    }
}

impl PoolState {
    /// Until when a key is out of rotation (account cooling or key disabled); `None` if usable.
    fn unavailable_until(&self, slot: &KeySlot, now: Instant) -> Option<Instant> {
        let account = self.cooling.get(&slot.account).copied();
        [account, slot.disabled_until]
            .into_iter()
            .flatten()
            .filter(|until| *until > now)
            .max()
    }

    fn usable(&self, slot: &KeySlot, now: Instant) -> bool {
        self.unavailable_until(slot, now).is_none()
    }

    /// Whether `account`'s balance, as last read, is at or under its reserve (an account with
    /// nothing left is under a reserve of 0): nothing is sent to it.
    fn under_reserve(&self, account: &Arc<str>) -> bool {
        self.accounts
            .get(account)
            .is_some_and(Account::under_reserve)
    }

    /// How much `account` has left above its reserve, with its plan kind, when read.
    fn remaining(&self, account: &Arc<str>) -> Option<(&'static str, f64)> {
        let account = self.accounts.get(account)?;
        Some((account.balance.as_ref()?.plan(), account.remaining()?))
    }

    /// Of `candidates` (key indexes, in the order the caller prefers), the one whose account
    /// has the most left, when every candidate's balance is read and of one plan kind (dollars
    /// and percents do not compare); else the first. Ties keep the caller's order.
    fn fullest(&self, candidates: impl Iterator<Item = usize>) -> Option<usize> {
        let candidates: Vec<usize> = candidates.collect();
        let first = *candidates.first()?;
        let scores: Option<Vec<(&'static str, f64)>> = candidates
            .iter()
            .map(|&index| self.remaining(&self.keys[index].account))
            .collect();
        let Some(scores) = scores else {
            return Some(first);
        };
        if scores.iter().any(|(kind, _)| *kind != scores[0].0) {
            return Some(first);
        }
        let mut best = 0;
        for (position, (_, left)) in scores.iter().enumerate() {
            if *left > scores[best].1 {
                best = position;
            }
        }
        candidates.get(best).copied()
    }

    /// Whether every key's account is under its reserve (so none may be sent to).
    pub(crate) fn all_under_reserve(&self) -> bool {
        !self.keys.is_empty()
            && self
                .keys
                .iter()
                .all(|slot| self.under_reserve(&slot.account))
    }

    /// Whether `account` refused `model` (normalised) and the refusal still holds at `now`.
    fn refuses(&self, account: &Arc<str>, model: &str, now: Instant) -> bool {
        self.refusal(account, model, now).is_some()
    }

    /// Why `account` refuses `model` (normalised) at `now`, if it does.
    fn refusal(&self, account: &Arc<str>, model: &str, now: Instant) -> Option<Refusal> {
        self.refused
            .get(&(account.clone(), Arc::from(model)))
            .filter(|(until, _)| *until > now)
            .map(|(_, reason)| *reason)
    }

    /// Remembers that `account` refused `model` until `until`, within [`MAX_REFUSALS`].
    fn refuse(
        &mut self,
        account: Arc<str>,
        model: Arc<str>,
        refusal: (Instant, Refusal),
        now: Instant,
    ) {
        self.refused.retain(|_, (until, _)| *until > now);
        if self.refused.len() >= MAX_REFUSALS
            && let Some(first) = self
                .refused
                .iter()
                .min_by_key(|(_, (until, _))| *until)
                .map(|(pair, _)| pair.clone())
        {
            self.refused.remove(&first);
        }
        self.refused.insert((account, model), refusal);
    }

    /// Ends `account`'s extra-usage refusals.
    fn lift_extra_usage(&mut self, account: &Arc<str>) {
        self.refused.retain(|(refused_account, _), (_, reason)| {
            *reason != Refusal::ExtraUsage || refused_account != account
        });
    }

    fn position(&self, id: KeyId) -> Option<usize> {
        self.keys.iter().position(|slot| slot.id == id)
    }
}

/// How the snapshot names the account of a key that has no account label: `key:` and the
/// first 16 hex digits of the key's SHA-256 (the control plane computes the same).
pub fn account_id_of_key(key: &str) -> String {
    pool_account(&format!(
        "key:{}",
        hex::encode(&sha2::Sha256::digest(key.as_bytes())[..8])
    ))
    .to_string()
}

/// The pool's account id for the snapshot's name of an account: `key:<hash>` as it is, a
/// label as `account:<label>`.
fn pool_account(account: &str) -> Arc<str> {
    if account.starts_with("key:") {
        account.into()
    } else {
        format!("account:{account}").into()
    }
}

/// The Ollama Cloud account that answered, as the snapshot names it: an extension of the
/// answer's response (never sent to the client), so that accounting charges its tokens to
/// that account as well.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served(pub Arc<str>);

/// The models to try, in order, for a request for `model` on a cloud host: the model itself,
/// then the host's `fallback_models` (each once; names compare as Ollama compares them).
pub fn candidates(host: &Host, model: &str) -> Vec<String> {
    let mut seen = vec![normalize_model(strip_cloud_suffix(model))];
    let mut out = vec![model.to_owned()];
    for fallback in &host.fallback_models {
        let normalized = normalize_model(strip_cloud_suffix(fallback));
        if !seen.contains(&normalized) {
            seen.push(normalized);
            out.push(fallback.clone());
        }
    }
    out
}

/// The model name to send to ollama.com: without a local `:cloud`/`-cloud` suffix.
pub fn upstream_model(model: &str) -> &str {
    strip_cloud_suffix(model)
}
