//! Per-minute limits (`rate_limit`): requests and tokens per minute, on a key, on an app
//! key's users, or `auth.default_rate_limit` (resolved by the control plane into each
//! client's own).
//!
//! Each limited client has two token buckets on this data plane (like the caps, a limit is
//! per box): one of requests, one of tokens, each holding at most a minute's worth and
//! refilling evenly over the minute. A request is admitted when its request bucket holds one
//! request and its token bucket holds its estimate (the prompt's estimated tokens, at least
//! one, at most a whole minute's worth, so that a prompt larger than the limit is not refused
//! for ever); it then takes one request and its estimate. When its answer ends, the estimate
//! is corrected to what the answer says it used ([`Charge::settle`]): a bucket may go below
//! empty, and the next requests wait until it has refilled. A refusal is 429 with the whole
//! seconds until the bucket that is furthest from admitting it has refilled enough
//! (`Retry-After`), in the route's own error shape.
//!
//! An app key's limit counts the app as a whole (its own requests and all its users'); its
//! users' limit counts each user alone; a user's request takes from both.
//!
//! At most [`MAX_BUCKETS`] clients are tracked: when full, the clients whose buckets have
//! refilled (the same as new) are forgotten, else the fullest tenth. Time is tokio's, so that
//! tests run on paused time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use crate::auth::Caller;
use crate::error::ProxyError;
use crate::policy::{MinuteLimit, Policy};

/// Most clients tracked at once.
pub const MAX_BUCKETS: usize = 10_000;

/// The buckets of every limited client seen lately, and the refusals counted per client.
#[derive(Debug, Default)]
pub struct MinuteLimits {
    inner: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    buckets: HashMap<Arc<str>, Pair>,
    /// Refusals per configured client (an app's users under the app), since start.
    refused: HashMap<Arc<str>, u64>,
}

/// One client's two buckets, under the limit they were last used with. Each is kept as the
/// instant it is full again (a generic cell rate algorithm): what it holds at `now` is the
/// minute less the time still to refill, in units of a minute's share, so that the figures are
/// exact durations and a changed limit keeps how full the bucket is.
#[derive(Debug, Clone, Copy)]
struct Pair {
    limit: MinuteLimit,
    requests_full_at: Instant,
    tokens_full_at: Instant,
}

/// The buckets a request takes from: the client whose limit it is, and the limit.
pub type Limited = (Arc<str>, MinuteLimit);

/// What one admitted request took, corrected when its answer ends ([`Charge::settle`]).
#[derive(Debug, Clone)]
pub struct Charge {
    limits: Arc<MinuteLimits>,
    taken: Vec<Limited>,
    estimate: u64,
}

/// What one client's buckets hold now, for status pages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Level {
    /// The limit.
    pub limit: MinuteLimit,
    /// Requests the bucket holds (whole; 0 when empty or below).
    pub requests_left: u64,
    /// Tokens the bucket holds (whole; 0 when empty or below).
    pub tokens_left: u64,
}

const MINUTE: Duration = Duration::from_secs(60);

impl Pair {
    fn full(limit: MinuteLimit, now: Instant) -> Self {
        Self {
            limit,
            requests_full_at: now,
            tokens_full_at: now,
        }
    }

    /// How long until the buckets admit a request of `estimate` tokens at `now`, and which
    /// limit that is; zero when they admit it now.
    fn wait(&self, estimate: u64, now: Instant) -> (Duration, &'static str) {
        let mut longest = (Duration::ZERO, "");
        let requests = u64::from(self.limit.requests_per_minute);
        if requests > 0 {
            let wait = wait_for(self.requests_full_at, cost(1, requests), now);
            longest = (wait, "requests");
        }
        let tokens = self.limit.tokens_per_minute;
        if tokens > 0 {
            let need = estimate.clamp(1, tokens);
            let wait = wait_for(self.tokens_full_at, cost(need, tokens), now);
            if wait > longest.0 {
                longest = (wait, "tokens");
            }
        }
        longest
    }

    fn take(&mut self, estimate: u64, now: Instant) {
        let requests = u64::from(self.limit.requests_per_minute);
        if requests > 0 {
            self.requests_full_at = self.requests_full_at.max(now) + cost(1, requests);
        }
        let tokens = self.limit.tokens_per_minute;
        if tokens > 0 {
            self.tokens_full_at = self.tokens_full_at.max(now) + cost(estimate, tokens);
        }
    }

    /// Whether the buckets are full at `now` (forgetting them changes nothing).
    fn is_full(&self, now: Instant) -> bool {
        self.requests_full_at <= now && self.tokens_full_at <= now
    }

    /// The share of a minute the emptier bucket holds at `now`, 0..=1.
    fn fill(&self, now: Instant) -> f64 {
        let held = |full_at: Instant| {
            MINUTE
                .saturating_sub(full_at.saturating_duration_since(now))
                .as_secs_f64()
                / 60.0
        };
        held(self.requests_full_at).min(held(self.tokens_full_at))
    }
}

/// The time `amount` units take to refill at `per_minute` a minute (nanoseconds, rounded
/// up).
fn cost(amount: u64, per_minute: u64) -> Duration {
    let nanos = u128::from(amount) * MINUTE.as_nanos();
    let nanos = nanos.div_ceil(u128::from(per_minute.max(1)));
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

/// How long until a bucket full at `full_at` holds `need` (as its refill time) at `now`.
fn wait_for(full_at: Instant, need: Duration, now: Instant) -> Duration {
    let to_refill = full_at.saturating_duration_since(now);
    to_refill.saturating_sub(MINUTE.saturating_sub(need))
}

/// Whole units a bucket full at `full_at` holds at `now`, at `per_minute`.
fn units_left(full_at: Instant, per_minute: u64, now: Instant) -> u64 {
    let held = MINUTE.saturating_sub(full_at.saturating_duration_since(now));
    let units = held.as_nanos() * u128::from(per_minute) / MINUTE.as_nanos();
    u64::try_from(units).unwrap_or(u64::MAX)
}

/// The limits a request of `caller` counts against under `policy`: its key's own; for an
/// app's user, the app's (counting the app as a whole) and the users' (counting this user).
pub fn limits_of(policy: &Policy, caller: &Caller) -> Vec<Limited> {
    let mut limits = Vec::new();
    let app_id = caller
        .member
        .as_ref()
        .map_or(&caller.id, |member| &member.app);
    let Some(client) = policy.clients_by_id.get(app_id) else {
        return limits;
    };
    if let Some(limit) = client.rate_limit {
        limits.push((client.id.clone(), limit));
    }
    if caller.id != client.id
        && let Some(limit) = client.users.as_ref().and_then(|users| users.rate_limit)
    {
        limits.push((caller.id.clone(), limit));
    }
    limits
}

impl MinuteLimits {
    /// Admits a request of `estimate` tokens against `limits` at `now`, taking from each
    /// bucket, or refuses it (429, `Retry-After`) without taking anything. Refusals are
    /// counted under `counted_as` (the configured client: an app for its users).
    pub fn admit(
        self: &Arc<Self>,
        limits: Vec<Limited>,
        counted_as: &Arc<str>,
        estimate: u64,
        now: Instant,
    ) -> Result<Option<Charge>, ProxyError> {
        if limits.is_empty() {
            return Ok(None);
        }
        let mut state = self.lock();
        let mut longest = (Duration::ZERO, "", MinuteLimit::default());
        for (client, limit) in &limits {
            if !state.buckets.contains_key(client) && state.buckets.len() >= MAX_BUCKETS {
                evict(&mut state.buckets, now);
            }
            let pair = state
                .buckets
                .entry(client.clone())
                .or_insert_with(|| Pair::full(*limit, now));
            pair.limit = *limit;
            let (wait, what) = pair.wait(estimate, now);
            if wait > longest.0 {
                longest = (wait, what, *limit);
            }
        }
        if longest.0 > Duration::ZERO {
            *state.refused.entry(counted_as.clone()).or_default() += 1;
            let (wait, what, limit) = longest;
            let per = if what == "requests" {
                u64::from(limit.requests_per_minute)
            } else {
                limit.tokens_per_minute
            };
            return Err(ProxyError::RateLimited {
                limit: format!("{per} {what} per minute"),
                retry_after: (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1),
            });
        }
        for (client, _) in &limits {
            if let Some(pair) = state.buckets.get_mut(client) {
                pair.take(estimate, now);
            }
        }
        drop(state);
        Ok(Some(Charge {
            limits: self.clone(),
            taken: limits,
            estimate,
        }))
    }

    /// What `client`'s buckets hold at `now`, if it has any.
    pub fn level(&self, client: &str, now: Instant) -> Option<Level> {
        let pair = *self.lock().buckets.get(client)?;
        Some(Level {
            limit: pair.limit,
            requests_left: units_left(
                pair.requests_full_at,
                u64::from(pair.limit.requests_per_minute),
                now,
            ),
            tokens_left: units_left(pair.tokens_full_at, pair.limit.tokens_per_minute, now),
        })
    }

    /// Requests of `client` (a configured client; an app counts its users') refused since
    /// start.
    pub fn refused(&self, client: &str) -> u64 {
        self.lock().refused.get(client).copied().unwrap_or(0)
    }

    /// Clients tracked now.
    pub fn tracked(&self) -> usize {
        self.lock().buckets.len()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The maps stay consistent whatever panicked while they were held.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Charge {
    /// Corrects the estimate taken at admission to `used` tokens (prompt + completion, as the
    /// answer says), at `now`.
    pub fn settle(self, used: u64, now: Instant) {
        let mut state = self.limits.lock();
        for (client, limit) in &self.taken {
            if limit.tokens_per_minute == 0 {
                continue;
            }
            if let Some(pair) = state.buckets.get_mut(client) {
                // Against the limit the estimate was taken at (a reload may have changed it
                // since; the correction is then approximate, never unbounded).
                let start = pair.tokens_full_at.max(now);
                pair.tokens_full_at = if used >= self.estimate {
                    start + cost(used - self.estimate, limit.tokens_per_minute)
                } else {
                    let back = cost(self.estimate - used, limit.tokens_per_minute);
                    pair.tokens_full_at
                        .checked_sub(back)
                        .unwrap_or(now)
                        .max(now.min(pair.tokens_full_at))
                };
            }
        }
    }
}

// Drops the buckets full again by now (a new one is the same); if none is, the fullest tenth.
// A bucket below full is never forgotten while a full one is tracked: forgetting refills it.
fn evict(buckets: &mut HashMap<Arc<str>, Pair>, now: Instant) {
    buckets.retain(|_, pair| !pair.is_full(now));
    if buckets.len() < MAX_BUCKETS {
        return;
    }
    let mut fills: Vec<(f64, Arc<str>)> = buckets
        .iter()
        .map(|(client, pair)| (pair.fill(now), client.clone()))
        .collect();
    let tenth = (MAX_BUCKETS / 10).max(1).min(fills.len());
    fills.select_nth_unstable_by(tenth - 1, |a, b| b.0.total_cmp(&a.0));
    for (_, client) in &fills[..tenth] {
        buckets.remove(client);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
