//! Webhooks: the one place oqp turns events into outgoing HTTP POSTs.
//!
//! Events come from the control plane itself (host health from the
//! [poller](crate::poller), key changes from the key store) and from data
//! planes (queue events carried by `NodeReport.events`, converted in
//! [`crate::grpc::policy`]). Every producer calls [`Webhooks::notify`] (or
//! [`Webhooks::send`]), which filters by `webhooks.events`, serializes the
//! body and queues it on a bounded channel without ever waiting: when the
//! channel is full the event is dropped and counted. One background task
//! ([`Webhooks::sender`]) delivers: `POST url`, JSON, 5 s, no retries.
//!
//! | event | extra fields |
//! | --- | --- |
//! | `queue.full` | `tier`, `client_id`, `node` |
//! | `queue.high_watermark` | `tier`, `queue_depth`, `node` |
//! | `queue.drained` | `node` |
//! | `queue.over_capacity` | `tier`, `client_id`, `node` |
//! | `host.unhealthy`, `host.recovered` | `name` |
//! | `key.revoked`, `key.rotated` | `client_id` |
//! | `audit` (not sent unless listed) | `actor`, `source`, `action`, `target`, `outcome`, `reason`: the audit entry ([`crate::audit`]) |
//!
//! [`ssrf`] holds the start-up check of the URL.

mod delivery;
mod payload;
pub use crate::outbound::ssrf;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use serde_json::{Map, Value};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::{WebhookEvent, WebhooksConfig};
use crate::outbound::Outbound;

pub use delivery::{TIMEOUT, redacted};
pub use payload::{Notice, timestamp};
pub use ssrf::SsrfError;

use delivery::Delivery;

/// Deliveries that may wait for the sender before new events are dropped.
pub const QUEUE_CAPACITY: usize = 256;

/// The handle every producer holds (cheap to clone). It lives in the
/// [`Hub`](crate::hub::Hub), which keeps its settings in step with reloads.
#[derive(Clone)]
pub struct Webhooks {
    inner: Arc<Inner>,
}

struct Inner {
    config: Mutex<WebhooksConfig>,
    queue: mpsc::Sender<Delivery>,
    /// The receiving end until the sender task takes it.
    pending: Mutex<Option<mpsc::Receiver<Delivery>>>,
    counters: Arc<Counters>,
}

/// Delivery counters, shared with the sender task.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    queued: AtomicU64,
    dropped: AtomicU64,
    delivered: AtomicU64,
    failed: AtomicU64,
}

/// What happened to the events so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WebhookStats {
    /// Events accepted by the filter and queued.
    pub queued: u64,
    /// Events dropped because the queue was full.
    pub dropped: u64,
    /// POSTs answered with a 2xx.
    pub delivered: u64,
    /// POSTs that failed (transport, timeout or a non-2xx answer).
    pub failed: u64,
}

impl std::fmt::Debug for Webhooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Webhooks")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Webhooks {
    /// A handle configured with `config`. Events queue (up to
    /// [`QUEUE_CAPACITY`]) until [`Webhooks::sender`] runs.
    pub fn new(config: &WebhooksConfig) -> Self {
        let (queue, receiver) = mpsc::channel(QUEUE_CAPACITY);
        Self {
            inner: Arc::new(Inner {
                config: Mutex::new(config.clone()),
                queue,
                pending: Mutex::new(Some(receiver)),
                counters: Arc::new(Counters::default()),
            }),
        }
    }

    /// Applies new settings (reload). Events already queued keep the URL they
    /// were queued with.
    pub fn configure(&self, config: &WebhooksConfig) {
        *lock(&self.inner.config) = config.clone();
    }

    /// Queues `event` with `fields` (see the module table for what each event
    /// carries; a `tier` field is kept unless `null`), timestamped now.
    pub fn send(&self, event: WebhookEvent, fields: Map<String, Value>) {
        self.notify(Notice::new(event).fields(fields));
    }

    /// Queues `notice` if webhooks are enabled and subscribed to its event.
    /// Never waits: returns whether it was queued.
    pub fn notify(&self, notice: Notice) -> bool {
        let (url, public_only) = {
            let config = lock(&self.inner.config);
            if !config.wants(notice.event()) {
                return false;
            }
            (
                config.url.clone(),
                !ssrf::is_allowed(&config.url, &config.allowed_hosts),
            )
        };
        let body = Bytes::from(notice.to_json().to_string());
        let delivery = Delivery {
            event: notice.event(),
            url,
            body,
            public_only,
        };
        match self.inner.queue.try_send(delivery) {
            Ok(()) => {
                self.inner.counters.queued.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(_) => {
                let dropped = self.inner.counters.dropped.fetch_add(1, Ordering::Relaxed) + 1;
                tracing::warn!(
                    event = notice.event().as_str(),
                    dropped,
                    "webhook queue full: event dropped"
                );
                false
            }
        }
    }

    /// The sender task, to spawn (once: later calls return `None`). It ends
    /// when `shutdown` is cancelled.
    pub fn sender(
        &self,
        client: Outbound,
        shutdown: CancellationToken,
    ) -> Option<impl Future<Output = ()> + Send + 'static> {
        let receiver = lock(&self.inner.pending).take()?;
        Some(delivery::run(
            receiver,
            self.inner.counters.clone(),
            client,
            shutdown,
        ))
    }

    /// The counters.
    pub fn stats(&self) -> WebhookStats {
        let counters = &self.inner.counters;
        WebhookStats {
            queued: counters.queued.load(Ordering::Relaxed),
            dropped: counters.dropped.load(Ordering::Relaxed),
            delivered: counters.delivered.load(Ordering::Relaxed),
            failed: counters.failed.load(Ordering::Relaxed),
        }
    }
}

/// The `audit` event of an audit entry: its fields, the time as the
/// event's timestamp.
pub fn audit_notice(entry: &crate::audit::Entry) -> Notice {
    let at = humantime::parse_rfc3339(&entry.time).unwrap_or_else(|_| std::time::SystemTime::now());
    Notice::new(WebhookEvent::Audit)
        .at(at)
        .field("actor", entry.actor.as_str())
        .field("source", entry.source.as_str())
        .field("action", entry.action.as_str())
        .field("target", entry.target.as_str())
        .field("outcome", entry.outcome.as_str())
        .field("reason", entry.reason.as_str())
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded values are replaced whole; a poisoned one is still usable.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
