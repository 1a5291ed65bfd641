//! The in-process backend: a `moka` cache weighed in bytes, least recently
//! used first out.
//!
//! Each entry carries its own expiry, checked on read, so that a TTL is
//! exact and testable (tests move the store's clock forward); moka's own
//! time-to-live, set to the same value, only frees the memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use moka::future::Cache;
use moka::policy::EvictionPolicy;

/// Bytes counted per entry on top of the key's and the vector's own bytes:
/// what an entry really costs besides them, measured with a counting
/// allocator (`dataplane/tests/cache_memory.rs`: about 525 bytes with
/// malloc's chunk overhead): moka's entry, its `Arc`s and deque nodes, its
/// hash-table and frequency-sketch share, the key's `String` and the
/// vector's `Bytes` headers, the expiry.
const OVERHEAD: usize = 576;

/// The in-process store.
#[derive(Debug, Clone)]
pub struct Memory {
    entries: Cache<String, Entry>,
    ttl: Duration,
    /// Milliseconds added to the monotonic clock (only tests move it).
    offset_ms: Arc<AtomicU64>,
}

#[derive(Debug, Clone)]
struct Entry {
    vector: Bytes,
    expires: Instant,
}

impl Memory {
    /// A store of at most `capacity` bytes whose entries live `ttl`.
    pub fn new(capacity: u64, ttl: Duration) -> Self {
        let entries = Cache::builder()
            .max_capacity(capacity)
            .weigher(|key: &String, entry: &Entry| {
                u32::try_from(key.len() + entry.vector.len() + OVERHEAD).unwrap_or(u32::MAX)
            })
            .eviction_policy(EvictionPolicy::lru())
            .time_to_live(ttl)
            .build();
        Self {
            entries,
            ttl,
            offset_ms: Arc::default(),
        }
    }

    fn now(&self) -> Instant {
        let now = Instant::now();
        now.checked_add(Duration::from_millis(
            self.offset_ms.load(Ordering::Relaxed),
        ))
        .unwrap_or(now)
    }

    /// Moves this store's clock forward.
    #[cfg(test)]
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.offset_ms.fetch_add(by, Ordering::Relaxed);
    }

    /// The live entry of each key, in order.
    pub async fn get_many(&self, keys: &[String]) -> Vec<Option<Bytes>> {
        let now = self.now();
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let entry = match self.entries.get(key).await {
                Some(entry) if entry.expires > now => Some(entry.vector),
                Some(_) => {
                    self.entries.invalidate(key).await;
                    None
                }
                None => None,
            };
            out.push(entry);
        }
        out
    }

    /// Stores each `(key, vector)`.
    pub async fn set_many(&self, entries: &[(String, Bytes)]) {
        // The snapshot bounds the ttl; an unrepresentable deadline is "never".
        let Some(expires) = self.now().checked_add(self.ttl) else {
            return;
        };
        for (key, vector) in entries {
            let entry = Entry {
                vector: vector.clone(),
                expires,
            };
            self.entries.insert(key.clone(), entry).await;
        }
    }

    /// Runs moka's pending maintenance (evictions over capacity, expiry).
    pub async fn settle(&self) {
        self.entries.run_pending_tasks().await;
    }

    /// Approximate bytes held (moka settles its counts lazily).
    pub fn weighted_size(&self) -> u64 {
        self.entries.weighted_size()
    }
}
