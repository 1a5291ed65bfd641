//! The shared backend: Valkey, Redis or Dragonfly over RESP.
//!
//! One `redis::aio::ConnectionManager` (a multiplexed connection that
//! reconnects by itself), `MGET` for the items of a request, pipelined
//! `SET key vector PX ttl` for the stores. Every command is bounded by a
//! response timeout.
//!
//! The first failure marks the backend unavailable: from then on operations
//! fail at once, without a network round trip, and one background task pings
//! the backend at a fixed interval until it answers, then marks it available
//! again. So an outage costs one slow request, not one per request, and hits
//! resume by themselves when the backend is back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::CacheError;
use crate::redact::redact_url;

/// A backend operation that failed (the caller treats it as a miss).
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The backend answered with an error, or the connection failed.
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
    /// No answer within the response timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// A recent failure, not yet cleared by the background ping.
    #[error("backend unavailable")]
    Unavailable,
}

/// The RESP store.
#[derive(Debug, Clone)]
pub struct Redis {
    manager: ConnectionManager,
    ttl_ms: u64,
    timeout: Duration,
    probe_interval: Duration,
    health: Arc<Health>,
    /// The URL with its password hidden, for logs.
    url: Arc<str>,
}

#[derive(Debug, Default)]
struct Health {
    unavailable: AtomicBool,
    probing: AtomicBool,
}

impl Redis {
    /// Connects and pings; an unreachable backend is an error.
    pub async fn connect(
        url: &str,
        ttl: Duration,
        connect_timeout: Duration,
        probe_interval: Duration,
    ) -> Result<Self, CacheError> {
        let shown: Arc<str> = redact_url(url).into();
        let client = redis::Client::open(url).map_err(|error| CacheError::InvalidUrl {
            url: shown.to_string(),
            reason: error.to_string(),
        })?;
        let shown_text = shown.to_string();
        let unreachable = move |reason: String| CacheError::Unreachable {
            url: shown_text.clone(),
            reason,
        };
        // A healthy server answers in well under a millisecond; a large MGET
        // over a LAN in a few. Never wait longer than it takes to connect.
        let timeout = connect_timeout.min(Duration::from_secs(1));
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(Some(timeout))
            // One attempt per reconnect: our own probe does the retrying.
            .set_number_of_retries(0);
        let manager = tokio::time::timeout(
            connect_timeout,
            ConnectionManager::new_with_config(client, config),
        )
        .await
        .map_err(|_| unreachable(format!("no connection within {connect_timeout:?}")))?
        .map_err(|error| unreachable(error.to_string()))?;
        let redis = Self {
            manager,
            ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1),
            timeout,
            probe_interval,
            health: Arc::default(),
            url: shown,
        };
        redis
            .ping()
            .await
            .map_err(|error| unreachable(error.to_string()))?;
        Ok(redis)
    }

    /// The URL, password hidden.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Whether operations are attempted (no failure since the last good ping).
    pub fn is_available(&self) -> bool {
        !self.health.unavailable.load(Ordering::Acquire)
    }

    /// The stored vector of each key, in order.
    pub async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        let mut command = redis::cmd("MGET");
        command.arg(keys);
        self.run(command.query_async::<Vec<Option<Bytes>>>(&mut self.manager.clone()))
            .await
    }

    /// Stores each `(key, vector)` with the TTL, in one pipeline.
    pub async fn set_many(&self, entries: &[(String, Bytes)]) -> Result<(), BackendError> {
        let mut pipeline = redis::pipe();
        for (key, vector) in entries {
            pipeline
                .cmd("SET")
                .arg(key)
                .arg(vector.as_ref())
                .arg("PX")
                .arg(self.ttl_ms)
                .ignore();
        }
        self.run(pipeline.query_async::<()>(&mut self.manager.clone()))
            .await
    }

    async fn ping(&self) -> Result<(), BackendError> {
        let mut connection = self.manager.clone();
        let command = redis::cmd("PING");
        let ping = command.query_async::<String>(&mut connection);
        tokio::time::timeout(self.timeout, ping)
            .await
            .map_err(|_| BackendError::Timeout(self.timeout))??;
        Ok(())
    }

    /// Runs one operation unless the backend is marked unavailable; a
    /// failure marks it so.
    async fn run<T>(
        &self,
        operation: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, BackendError> {
        if !self.is_available() {
            return Err(BackendError::Unavailable);
        }
        let result = match tokio::time::timeout(self.timeout, operation).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(BackendError::Redis(error)),
            Err(_) => Err(BackendError::Timeout(self.timeout)),
        };
        if result.is_err() {
            self.mark_unavailable();
        }
        result
    }

    /// Marks the backend unavailable and starts the background ping, once.
    fn mark_unavailable(&self) {
        self.health.unavailable.store(true, Ordering::Release);
        if self.health.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        let probe = Probe {
            manager: self.manager.clone(),
            timeout: self.timeout,
            interval: self.probe_interval,
            url: Arc::clone(&self.url),
            // Only a weak reference: the probe must not keep a dropped cache
            // alive, and stops when it is gone.
            health: Arc::downgrade(&self.health),
        };
        tokio::spawn(probe.run());
    }
}

/// The background ping of an unavailable backend.
struct Probe {
    manager: ConnectionManager,
    timeout: Duration,
    interval: Duration,
    url: Arc<str>,
    health: Weak<Health>,
}

impl Probe {
    async fn run(self) {
        loop {
            tokio::time::sleep(self.interval).await;
            let Some(health) = self.health.upgrade() else {
                return;
            };
            let mut connection = self.manager.clone();
            let command = redis::cmd("PING");
            let ping = command.query_async::<String>(&mut connection);
            if matches!(tokio::time::timeout(self.timeout, ping).await, Ok(Ok(_))) {
                // Probing off first: a failure from here on starts a new
                // probe rather than leaving the backend marked down for good.
                health.probing.store(false, Ordering::Release);
                health.unavailable.store(false, Ordering::Release);
                tracing::info!(backend = %self.url, "embedding cache backend is reachable again");
                return;
            }
        }
    }
}
