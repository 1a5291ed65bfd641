//! The per-client limit on metadata reads (`GET /api/tags`, `/api/ps`, `/api/version`,
//! `POST /api/show`, `/v1/models`…): these skip the queue, so without a bound one client could
//! keep a host busy answering them. Each client has a token bucket of `burst` reads that fills at
//! `per_second` ([`MetadataRate`]); a read with the bucket empty is refused 429 with
//! `Retry-After` (whole seconds until a read is back, rounded up).
//!
//! A client is its id: a key's client, an app's user as `<client>/<user>`, or with auth off the
//! id it claims in `X-Client-ID`. At most [`MAX_CLIENTS`] buckets are kept: when full, the buckets
//! that have filled again (the same as new) are dropped, else the fullest tenth.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::ProxyError;
use crate::policy::MetadataRate;

/// Most clients tracked at once.
pub const MAX_CLIENTS: usize = 10_000;

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// The buckets of every client seen lately.
#[derive(Debug, Default)]
pub struct MetadataLimit {
    buckets: Mutex<HashMap<Arc<str>, Bucket>>,
}

impl MetadataLimit {
    /// Takes one read from `client`'s bucket, or refuses with how long until one is back.
    pub fn admit(&self, rate: MetadataRate, client: &Arc<str>) -> Result<(), ProxyError> {
        self.admit_at(rate, client, Instant::now())
    }

    /// [`admit`](Self::admit) at `now`.
    pub fn admit_at(
        &self,
        rate: MetadataRate,
        client: &Arc<str>,
        now: Instant,
    ) -> Result<(), ProxyError> {
        if rate.per_second == 0 {
            return Ok(());
        }
        let (per_second, burst) = (f64::from(rate.per_second), f64::from(rate.burst.max(1)));
        let mut buckets = self.lock();
        if !buckets.contains_key(client) && buckets.len() >= MAX_CLIENTS {
            evict(&mut buckets, per_second, burst, now);
        }
        let bucket = buckets.entry(client.clone()).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * per_second).min(burst);
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            return Ok(());
        }
        let wait = Duration::from_secs_f64((1.0 - bucket.tokens) / per_second);
        Err(ProxyError::TooManyMetadataReads {
            retry_after: wait.as_secs() + u64::from(wait.subsec_nanos() > 0),
        })
    }

    /// Clients tracked now.
    pub fn tracked(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Arc<str>, Bucket>> {
        // The map stays consistent whatever panicked while it was held.
        self.buckets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

// Drops the buckets full again by now (a new one is the same); if none is, the fullest tenth:
// forgetting a bucket refills it, and those gain the least from it. One sweep per tenth, so that
// a flood of new clients does not scan the table on every read.
fn evict(buckets: &mut HashMap<Arc<str>, Bucket>, per_second: f64, burst: f64, now: Instant) {
    let level = |bucket: &Bucket| {
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        (bucket.tokens + elapsed * per_second).min(burst)
    };
    buckets.retain(|_, bucket| level(bucket) < burst);
    if buckets.len() < MAX_CLIENTS {
        return;
    }
    let mut levels: Vec<(f64, Arc<str>)> = buckets
        .iter()
        .map(|(client, bucket)| (level(bucket), client.clone()))
        .collect();
    let tenth = (MAX_CLIENTS / 10).max(1).min(levels.len());
    levels.select_nth_unstable_by(tenth - 1, |a, b| b.0.total_cmp(&a.0));
    for (_, client) in &levels[..tenth] {
        buckets.remove(client);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const RATE: MetadataRate = MetadataRate {
        per_second: 2,
        burst: 3,
    };

    fn retry_after(result: Result<(), ProxyError>) -> Option<u64> {
        result.err().and_then(|error| error.retry_after())
    }

    #[test]
    fn a_burst_then_the_rate_and_retry_after_rounds_up() {
        let limit = MetadataLimit::default();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let t0 = Instant::now();
        for _ in 0..3 {
            limit.admit_at(RATE, &a, t0).unwrap();
        }
        assert_eq!(retry_after(limit.admit_at(RATE, &a, t0)), Some(1));
        // Another client has its own bucket.
        limit.admit_at(RATE, &b, t0).unwrap();
        // Half a second adds one read at 2 a second.
        limit
            .admit_at(RATE, &a, t0 + Duration::from_millis(500))
            .unwrap();
        assert!(
            limit
                .admit_at(RATE, &a, t0 + Duration::from_millis(500))
                .is_err()
        );
        // Off: everything passes.
        let off = MetadataRate {
            per_second: 0,
            burst: 1,
        };
        for _ in 0..10 {
            limit.admit_at(off, &a, t0).unwrap();
        }
    }

    #[test]
    fn a_full_table_forgets_the_refilled_buckets_first_and_never_grows_past_its_bound() {
        let limit = MetadataLimit::default();
        let t0 = Instant::now();
        let busy: Arc<str> = Arc::from("busy");
        for _ in 0..3 {
            limit.admit_at(RATE, &busy, t0).unwrap();
        }
        for i in 0..MAX_CLIENTS + 10 {
            let client: Arc<str> = Arc::from(format!("c{i}"));
            limit
                .admit_at(RATE, &client, t0 + Duration::from_millis(1))
                .unwrap();
        }
        assert!(limit.tracked() <= MAX_CLIENTS);
        // The busy client's empty bucket was kept: still refused.
        assert!(
            limit
                .admit_at(RATE, &busy, t0 + Duration::from_millis(2))
                .is_err()
        );
    }
}
