//! Counters for metrics and status: request outcomes (overall and per
//! `(client, model, endpoint)`), items, backend errors and bytes; and the
//! rate-limited log of backend errors.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::{Backend, Cache, Items, Outcome};
use crate::policy::normalize_model;

/// Distinct `(client, model, endpoint)` label triples kept; later ones are
/// counted under `_other`.
const MAX_LABELS: usize = 10_000;

/// How often a backend error is logged, at most.
const LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Counters since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Requests answered without an upstream request of their own.
    pub hits: u64,
    /// Requests whose every item was fetched.
    pub misses: u64,
    /// Requests partly answered from the cache.
    pub partial: u64,
    /// Items found in the cache.
    pub items_cached: u64,
    /// Items received from another request's fetch.
    pub items_coalesced: u64,
    /// Items fetched from upstream.
    pub items_fetched: u64,
    /// Backend operations that failed (each served as a miss).
    pub errors: u64,
    /// Backend operations skipped while the backend was unavailable.
    pub bypassed: u64,
    /// Vector bytes written to the backend.
    pub bytes_stored: u64,
    /// Vectors not stored because they exceed `max_entry_bytes`.
    pub oversized: u64,
    /// Bytes held in memory (in-process backend only, approximate).
    pub memory_bytes: u64,
    /// Keys being fetched right now.
    pub in_flight: u64,
    /// Whether the backend is in use (false during a Redis outage).
    pub available: bool,
}

/// Request outcomes for one `(client, model, endpoint)`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LabelCounts {
    /// [`Outcome::Hit`] answers.
    pub hits: u64,
    /// [`Outcome::Miss`] answers.
    pub misses: u64,
    /// [`Outcome::Partial`] answers.
    pub partial: u64,
}

/// A metrics label triple: client id, normalised model, endpoint path.
pub type Labels = (String, String, String);

/// The atomic counters behind [`CacheStats`].
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) hits: AtomicU64,
    pub(super) misses: AtomicU64,
    pub(super) partial: AtomicU64,
    pub(super) items_cached: AtomicU64,
    pub(super) items_coalesced: AtomicU64,
    pub(super) items_fetched: AtomicU64,
    pub(super) errors: AtomicU64,
    pub(super) bypassed: AtomicU64,
    pub(super) bytes_stored: AtomicU64,
    pub(super) oversized: AtomicU64,
}

/// Logs backend errors at most once per [`LOG_INTERVAL`], with the number
/// of errors not logged since.
#[derive(Debug, Default)]
pub(super) struct ErrorLog {
    last: Mutex<Option<Instant>>,
    suppressed: AtomicU64,
}

impl Cache {
    /// Counts one answered request (done by [`Cache::resolve`]; callers of
    /// the lower-level API call it themselves).
    pub fn record(
        &self,
        client_id: &str,
        model: &str,
        endpoint: &str,
        outcome: Outcome,
        items: Items,
    ) {
        let counters = &self.inner.counters;
        let counter = match outcome {
            Outcome::Hit => &counters.hits,
            Outcome::Partial => &counters.partial,
            Outcome::Miss => &counters.misses,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        counters
            .items_cached
            .fetch_add(items.cached as u64, Ordering::Relaxed);
        counters
            .items_coalesced
            .fetch_add(items.coalesced as u64, Ordering::Relaxed);
        counters
            .items_fetched
            .fetch_add(items.fetched as u64, Ordering::Relaxed);

        let mut labels = self
            .inner
            .labels
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut triple = (
            client_id.to_owned(),
            normalize_model(model),
            endpoint.to_owned(),
        );
        if labels.len() >= MAX_LABELS && !labels.contains_key(&triple) {
            triple = (
                "_other".to_owned(),
                "_other".to_owned(),
                "_other".to_owned(),
            );
        }
        let counts = labels.entry(triple).or_default();
        match outcome {
            Outcome::Hit => counts.hits += 1,
            Outcome::Partial => counts.partial += 1,
            Outcome::Miss => counts.misses += 1,
        }
    }

    /// The counters since start.
    pub fn stats(&self) -> CacheStats {
        let c = &self.inner.counters;
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let (memory_bytes, available) = match &self.inner.backend {
            Backend::Memory(memory) => (memory.weighted_size(), true),
            Backend::Redis(redis) => (0, redis.is_available()),
        };
        CacheStats {
            hits: load(&c.hits),
            misses: load(&c.misses),
            partial: load(&c.partial),
            items_cached: load(&c.items_cached),
            items_coalesced: load(&c.items_coalesced),
            items_fetched: load(&c.items_fetched),
            errors: load(&c.errors),
            bypassed: load(&c.bypassed),
            bytes_stored: load(&c.bytes_stored),
            oversized: load(&c.oversized),
            memory_bytes,
            in_flight: self.inner.flights.len() as u64,
            available,
        }
    }

    /// Request outcomes per `(client, model, endpoint)`, for metrics.
    pub fn label_stats(&self) -> Vec<(Labels, LabelCounts)> {
        let labels = self
            .inner
            .labels
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        labels
            .iter()
            .map(|(labels, counts)| (labels.clone(), *counts))
            .collect()
    }
}

impl ErrorLog {
    pub(super) fn report(&self, backend: &str, operation: &str, error: &dyn std::fmt::Display) {
        let now = Instant::now();
        {
            let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
            if last.is_some_and(|at| now.duration_since(at) < LOG_INTERVAL) {
                self.suppressed.fetch_add(1, Ordering::Relaxed);
                return;
            }
            *last = Some(now);
        }
        let suppressed = self.suppressed.swap(0, Ordering::Relaxed);
        tracing::warn!(
            backend,
            operation,
            suppressed,
            "embedding cache {operation} failed, serving as a miss: {error}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_logged_at_most_once_per_interval() {
        let log = ErrorLog::default();
        log.report("memory", "lookup", &"first");
        log.report("memory", "lookup", &"second");
        log.report("memory", "store", &"third");
        assert_eq!(log.suppressed.load(Ordering::Relaxed), 2);
    }
}
