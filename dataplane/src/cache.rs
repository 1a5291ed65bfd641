//! The embedding cache: per-item vectors for `/api/embed`, `/v1/embeddings`
//! (after translation) and the legacy `/api/embeddings`.
//!
//! A request is split into items ([`mod@plan`]); each item has its own key
//! ([`key`], format documented there), so a list that shares texts with an
//! earlier one only asks upstream for the new texts. Vectors are stored as
//! little-endian floats when they print back to the exact JSON text upstream
//! sent, as that text otherwise ([`vector`]), so cached answers carry
//! Ollama's exact numbers, byte for byte.
//!
//! One [`Cache`] fronts either backend: in-process (`moka`, bounded in bytes)
//! or a shared Valkey/Redis/Dragonfly. A backend error never fails a request:
//! it is counted, logged at most once a minute, and the lookup is a miss (the
//! Redis backend then skips itself until a background ping succeeds).
//! Concurrent misses of one key share one upstream fetch ([`flight`]).
//!
//! The request path normally calls [`Cache::resolve`], which does all of it:
//!
//! ```text
//! let plan = cache::plan(namespace, &body)?;        // None: not cacheable, forward as is
//! let resolved = cache.resolve(&plan, client_id, "/api/embed", tier, |body, dispatch| async {
//!     /* queue, dispatch.dispatched() once it has a slot, send `body`
//!        upstream; Ok(200 body) or Err(the response to relay) */
//! }).await;
//! // Ok: answer resolved.body (application/json; charset=utf-8) with
//! //     X-Cache: resolved.outcome.as_str()
//! // Err(Upstream(e)): relay e; Err(Plan(_)): 502
//! ```
//!
//! `fetch` may be called more than once (when a request it waited on failed,
//! it retries what it still lacks) and is not called at all on a full hit.
//! The lower-level pieces ([`Cache::lookup`], [`Cache::join`],
//! [`Cache::store`], [`Plan::fetch`], [`Plan::reassemble`]) are public for
//! other arrangements.

pub mod flight;
pub mod key;
pub mod plan;
pub mod vector;

mod memory;
mod redis;
mod resolve;
mod stats;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use crate::policy::{CacheBackend, CacheSettings};
use crate::scheduler::Tier;

pub use flight::{Dispatch, Flights, Follow, Join, Lead};
pub use key::{Namespace, Params};
pub use plan::{
    Assembled, Fetch, Fetched, Plan, PlanError, Timing, TooManyInputs, is_vector, plan, plan_within,
};
pub use resolve::{Items, Outcome, ResolveError, Resolved};
pub use stats::{CacheStats, LabelCounts, Labels};

use self::redis::{BackendError, Redis};
use memory::Memory;
use stats::{Counters, ErrorLog};

/// How often an unavailable Redis is pinged.
const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// Why the cache could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    /// The backend URL does not parse.
    #[error("embedding cache backend {url} is not a valid Redis URL: {reason}")]
    InvalidUrl {
        /// The URL, password hidden.
        url: String,
        /// The parser's complaint.
        reason: String,
    },
    /// The backend did not answer at start-up.
    #[error(
        "embedding cache backend {url} is unreachable: {reason}; fix embedding_cache.backend or set embedding_cache.enabled: false"
    )]
    Unreachable {
        /// The URL, password hidden.
        url: String,
        /// What failed.
        reason: String,
    },
}

/// The embedding cache. Cheap to clone; clones share everything.
#[derive(Debug, Clone)]
pub struct Cache {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    settings: CacheSettings,
    backend: Backend,
    flights: Flights,
    counters: Counters,
    labels: Mutex<HashMap<Labels, LabelCounts>>,
    log: ErrorLog,
}

#[derive(Debug)]
enum Backend {
    Memory(Memory),
    Redis(Redis),
}

/// Knobs that only tests change.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tuning {
    pub(crate) probe_interval: Duration,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            probe_interval: PROBE_INTERVAL,
        }
    }
}

/// Opens the cache described by `settings` (whether it is `enabled` is the
/// caller's decision). A Redis backend must answer a `PING` within
/// `connect_timeout`; otherwise start-up fails with an error naming the URL
/// (password hidden).
pub async fn connect(settings: &CacheSettings) -> Result<Cache, CacheError> {
    connect_with(settings, Tuning::default()).await
}

pub(crate) async fn connect_with(
    settings: &CacheSettings,
    tuning: Tuning,
) -> Result<Cache, CacheError> {
    let backend = match &settings.backend {
        CacheBackend::Memory => {
            Backend::Memory(Memory::new(settings.max_memory_bytes, settings.ttl))
        }
        CacheBackend::Redis(url) => Backend::Redis(
            Redis::connect(
                url,
                settings.ttl,
                settings.connect_timeout,
                tuning.probe_interval,
            )
            .await?,
        ),
    };
    Ok(Cache {
        inner: Arc::new(Inner {
            settings: settings.clone(),
            backend,
            flights: Flights::new(),
            counters: Counters::default(),
            labels: Mutex::default(),
            log: ErrorLog::default(),
        }),
    })
}

impl Cache {
    /// The settings the cache was opened with. A snapshot that changes the
    /// backend needs a new `Cache`; prefix, TTL, sizes and `per_client` are
    /// read from here.
    pub fn settings(&self) -> &CacheSettings {
        &self.inner.settings
    }

    /// `memory`, or the Redis URL with its password hidden.
    pub fn backend_name(&self) -> &str {
        match &self.inner.backend {
            Backend::Memory(_) => "memory",
            Backend::Redis(redis) => redis.url(),
        }
    }

    /// The stored key of each of `plan`'s items for `client_id` (which only
    /// enters the key with `per_client`).
    pub fn keys(&self, plan: &Plan, client_id: &str) -> Vec<String> {
        let settings = &self.inner.settings;
        plan.keys(
            &settings.key_prefix,
            settings.per_client.then_some(client_id),
        )
    }

    /// The cached vector (JSON text) of each key, in order. Never fails: a
    /// backend error or an invalid stored value is a miss.
    pub async fn lookup(&self, keys: &[String]) -> Vec<Option<Bytes>> {
        if keys.is_empty() {
            return Vec::new();
        }
        match &self.inner.backend {
            Backend::Memory(memory) => memory
                .get_many(keys)
                .await
                .into_iter()
                .map(|value| value.and_then(|stored| self.decode(&stored)))
                .collect(),
            Backend::Redis(redis) => match redis.get_many(keys).await {
                Ok(values) if values.len() == keys.len() => values
                    .into_iter()
                    .map(|value| value.and_then(|stored| self.decode(&stored)))
                    .collect(),
                Ok(_) => {
                    self.failed("lookup", "MGET answered the wrong number of values");
                    vec![None; keys.len()]
                }
                Err(error) => {
                    self.backend_error("lookup", &error);
                    vec![None; keys.len()]
                }
            },
        }
    }

    /// Stores `(key, vector JSON text)` pairs in their compact form
    /// ([`vector::encode`]), skipping those whose stored form is over
    /// `max_entry_bytes` (0 = no limit). Never fails: a backend error is
    /// counted and logged.
    pub async fn store(&self, entries: Vec<(String, Bytes)>) {
        let limit = self.inner.settings.max_entry_bytes;
        let counters = &self.inner.counters;
        let (entries, oversized): (Vec<_>, Vec<_>) = entries
            .into_iter()
            .map(|(key, vector)| (key, vector::encode(&vector)))
            .partition(|(_, stored)| limit == 0 || stored.len() as u64 <= limit);
        counters
            .oversized
            .fetch_add(oversized.len() as u64, Ordering::Relaxed);
        if entries.is_empty() {
            return;
        }
        let bytes: u64 = entries.iter().map(|(_, vector)| vector.len() as u64).sum();
        let stored = match &self.inner.backend {
            Backend::Memory(memory) => {
                memory.set_many(&entries).await;
                true
            }
            Backend::Redis(redis) => match redis.set_many(&entries).await {
                Ok(()) => true,
                Err(error) => {
                    self.backend_error("store", &error);
                    false
                }
            },
        };
        if stored {
            counters.bytes_stored.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// Lets the in-process store finish its pending evictions, so that what
    /// it holds is within `max_memory_mb` (it settles lazily otherwise).
    /// A no-op for Redis.
    pub async fn settle(&self) {
        if let Backend::Memory(memory) = &self.inner.backend {
            memory.settle().await;
        }
    }

    /// Joins the flight of each key for a request of `tier` (see
    /// [`flight`]): lead the ones nobody is fetching, follow the others
    /// unless their leader is queued in a less urgent tier.
    pub fn join(&self, keys: &[String], tier: Tier) -> Vec<Join> {
        keys.iter()
            .map(|key| self.inner.flights.join(key, tier))
            .collect()
    }

    #[cfg(test)]
    pub(crate) fn flights(&self) -> &Flights {
        &self.inner.flights
    }

    /// Moves the in-process store's clock forward.
    #[cfg(test)]
    pub(crate) fn advance_clock(&self, by: Duration) {
        if let Backend::Memory(memory) = &self.inner.backend {
            memory.advance(by);
        }
    }

    /// The JSON text of a stored value; a corrupt one counts as an error and
    /// a miss.
    fn decode(&self, stored: &Bytes) -> Option<Bytes> {
        let text = vector::decode(stored);
        if text.is_none() {
            self.failed("lookup", "a stored value is not a vector");
        }
        text
    }

    fn backend_error(&self, operation: &str, error: &BackendError) {
        match error {
            BackendError::Unavailable => {
                self.inner.counters.bypassed.fetch_add(1, Ordering::Relaxed);
            }
            error => self.failed(operation, error),
        }
    }

    fn failed(&self, operation: &str, error: impl std::fmt::Display) {
        self.inner.counters.errors.fetch_add(1, Ordering::Relaxed);
        self.inner
            .log
            .report(self.backend_name(), operation, &error);
    }
}

#[cfg(test)]
mod tests;
