//! The dispatcher: the async shell around the pure [`Scheduler`].
//!
//! It owns every waiting request (a ticket holding a oneshot sender) and all
//! upstream capacity (per-host slots), so every ordering decision is made in
//! one place, under one `std::sync::Mutex` that is never held across an
//! `.await`. It is woken by:
//!
//! - an admission (a ticket may run at once),
//! - a slot freeing (a [`Lease`] dropped: the response body ended),
//! - a snapshot change (limits, pauses, flushes, hosts),
//! - a deadline (expiry or promotion), by its timer task,
//! - a client leaving (its pending guard cancels the ticket).
//!
//! A [`Grant`] owns its [`Lease`]: whatever happens to a grant (delivered,
//! dropped unclaimed because the client left at that instant, or held until
//! the response body ends), the slot and the client's in-flight count are
//! released exactly once.

mod rate;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use oqp_proto::policy::v1 as wire;
use tokio::sync::{Notify, oneshot};

use crate::error::ProxyError;
use crate::policy::{Host, Policy};
use crate::scheduler::{
    ClientLimits, Expiry, Limits, Rejection, Scheduler, Ticket, TicketId, Tier, TierLimits,
};

use rate::DrainRate;

/// What a waiting request is told.
type Waiter = oneshot::Sender<Result<Grant, ProxyError>>;

/// Most events kept for the next report.
const MAX_EVENTS: usize = 256;

/// The dispatcher of one data plane.
#[derive(Debug)]
pub struct Dispatcher {
    inner: Mutex<Inner>,
    timer: Notify,
    flushed: std::sync::atomic::AtomicU64,
}

#[derive(Debug)]
struct Inner {
    scheduler: Scheduler<Waiter>,
    /// Slots in use per host name.
    slots: HashMap<Arc<str>, u32>,
    hosts: Vec<Arc<Host>>,
    /// Configured depth per tier (0 = never queue; the scheduler gets 1).
    configured_depth: [u32; 3],
    max_concurrent: u32,
    overflow_status: http::StatusCode,
    flush_generation: [u64; 3],
    drain_rate: [DrainRate; 3],
    events: Vec<wire::Event>,
    was_busy: bool,
}

/// A request's claim on a host slot and its client's in-flight count,
/// released when dropped.
#[derive(Debug)]
pub struct Lease {
    dispatcher: Arc<Dispatcher>,
    id: TicketId,
    host: Arc<Host>,
    started: Instant,
    cost: Option<Duration>,
}

/// Permission to send a request to `host` now.
#[derive(Debug)]
pub struct Grant {
    /// The reserved slot.
    pub lease: Lease,
    /// Time from admission to dispatch.
    pub waited: Duration,
    /// The tier it was dispatched from.
    pub tier: Tier,
}

/// An admitted request, not yet dispatched.
#[derive(Debug)]
pub struct Pending {
    dispatcher: Arc<Dispatcher>,
    id: TicketId,
    receiver: Option<oneshot::Receiver<Result<Grant, ProxyError>>>,
    /// 1-based position in its tier at admission.
    pub position: u32,
    /// Whether it was dispatched during admission (no wait at all).
    pub immediate: bool,
}

/// What a request asks of the queue.
#[derive(Debug)]
pub struct Request {
    /// The client's id (or a shared id for anonymous callers).
    pub client: Arc<str>,
    /// Its tier, already capped.
    pub tier: Tier,
    /// Body bytes held while waiting.
    pub bytes: u64,
    /// Its model, for placement.
    pub model: Option<Arc<str>>,
}

impl Dispatcher {
    /// A dispatcher for `policy`.
    pub fn new(policy: &Policy) -> Arc<Self> {
        let dispatcher = Arc::new(Self {
            inner: Mutex::new(Inner {
                scheduler: Scheduler::new(Limits::default()),
                slots: HashMap::new(),
                hosts: Vec::new(),
                configured_depth: [0; 3],
                max_concurrent: 1,
                overflow_status: http::StatusCode::SERVICE_UNAVAILABLE,
                flush_generation: [0; 3],
                drain_rate: Default::default(),
                events: Vec::new(),
                was_busy: false,
            }),
            timer: Notify::new(),
            flushed: std::sync::atomic::AtomicU64::new(0),
        });
        {
            let mut inner = dispatcher.lock();
            inner.flush_generation = policy.queue.tiers.each_ref().map(|t| t.flush_generation);
        }
        dispatcher.apply(policy);
        dispatcher
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Applies a new snapshot: limits, clients, pauses, hosts; a higher flush
    /// generation drops the tier's waiting requests.
    pub fn apply(self: &Arc<Self>, policy: &Policy) {
        let mut flushed = Vec::new();
        let mut dropped = Vec::new();
        {
            let mut inner = self.lock();
            let queue = &policy.queue;
            let tiers = queue.tiers.each_ref().map(|t| TierLimits {
                max_depth: t.max_depth.max(1),
                max_wait: t.max_wait,
                promote_after: t.promote_after,
                high_watermark_pct: t.high_watermark_pct,
            });
            inner.configured_depth = queue.tiers.each_ref().map(|t| t.max_depth);
            inner.scheduler.set_limits(Limits {
                tiers,
                max_queued_bytes: queue.max_queued_bytes,
                half_life: queue.fair_share_half_life,
            });
            for tier in Tier::ALL {
                let settings = queue.tier(tier);
                inner.scheduler.set_paused(tier, settings.paused);
                if settings.flush_generation > inner.flush_generation[tier.index()] {
                    inner.flush_generation[tier.index()] = settings.flush_generation;
                    flushed.extend(inner.scheduler.flush(Some(tier)));
                }
            }
            for client in policy.clients_by_id.values() {
                inner.scheduler.set_client(
                    &client.id,
                    ClientLimits {
                        max_concurrent: client.max_concurrent,
                        max_queued: client.max_queued,
                        weight: client.weight,
                    },
                );
            }
            inner.hosts = policy.hosts.clone();
            inner.max_concurrent = policy.proxy.max_concurrent;
            inner.overflow_status = queue.overflow_status;
            dropped.extend(self.pump(&mut inner, Instant::now()));
        }
        self.flushed
            .fetch_add(flushed.len() as u64, std::sync::atomic::Ordering::Relaxed);
        for waiter in flushed {
            let _ = waiter.send(Err(ProxyError::Flushed));
        }
        drop(dropped);
        self.timer.notify_one();
    }

    /// Admits a request, or refuses it with the error the client gets.
    pub fn admit(self: &Arc<Self>, request: Request) -> Result<Pending, ProxyError> {
        let (sender, receiver) = oneshot::channel();
        let now = Instant::now();
        let tier = request.tier;
        let client = request.client.clone();
        let mut dropped = Vec::new();
        let result = {
            let mut inner = self.lock();
            let ticket = Ticket {
                client: request.client,
                tier,
                bytes: request.bytes,
                model: request.model,
                payload: sender,
            };
            match inner.scheduler.enqueue(now, ticket) {
                Ok(admitted) => {
                    if admitted.watermark_crossed {
                        let depth = inner.scheduler.depth(tier);
                        inner.event("queue.high_watermark", Some(tier), None, depth);
                    }
                    inner.was_busy = true;
                    dropped.extend(self.pump(&mut inner, now));
                    Ok(admitted)
                }
                Err((rejection, _)) => Err(inner.refusal(rejection, tier, &client)),
            }
        };
        drop(dropped);
        let admitted = result?;
        let mut receiver = receiver;
        let immediate = match receiver.try_recv() {
            Ok(grant) => {
                // Dispatched during admission: hand the grant over through a
                // fresh, already-filled channel.
                let (sender, fresh) = oneshot::channel();
                let _ = sender.send(grant);
                receiver = fresh;
                true
            }
            Err(_) => false,
        };
        if !immediate && self.lock().configured_depth[tier.index()] == 0 {
            // A tier with max_depth 0 never queues: run now or refuse.
            let mut pending = Pending {
                dispatcher: self.clone(),
                id: admitted.id,
                receiver: Some(receiver),
                position: admitted.position,
                immediate,
            };
            pending.cancel();
            let mut inner = self.lock();
            return Err(inner.refusal(Rejection::QueueFull, tier, &client));
        }
        self.timer.notify_one();
        Ok(Pending {
            dispatcher: self.clone(),
            id: admitted.id,
            receiver: Some(receiver),
            position: admitted.position,
            immediate,
        })
    }

    /// Dispatches every ticket that can run now and answers expired ones.
    /// Returns grants whose clients left, to be dropped after the lock is
    /// released (dropping a grant takes the lock).
    fn pump(self: &Arc<Self>, inner: &mut Inner, now: Instant) -> Vec<Grant> {
        let mut orphans = Vec::new();
        loop {
            let Inner {
                scheduler,
                slots,
                hosts,
                ..
            } = &mut *inner;
            let Some(dispatch) = scheduler.next(now, |model| place(hosts, slots, model)) else {
                break;
            };
            let tier = dispatch.tier;
            inner.drain_rate[tier.index()].record(now);
            let grant = Grant {
                lease: Lease {
                    dispatcher: self.clone(),
                    id: dispatch.id,
                    host: dispatch.placement,
                    started: now,
                    cost: None,
                },
                waited: dispatch.waited,
                tier,
            };
            if let Err(Ok(grant)) = dispatch.payload.send(Ok(grant)) {
                // The client left between admission and now.
                orphans.push(grant);
            }
        }
        for expiry in inner.scheduler.expire(now) {
            match expiry {
                Expiry::Expired {
                    payload, client, ..
                } => {
                    tracing::debug!(%client, "request expired in queue");
                    let _ = payload.send(Err(ProxyError::Expired));
                }
                Expiry::Promoted {
                    client, from, to, ..
                } => tracing::debug!(%client, %from, %to, "request promoted"),
            }
        }
        if inner.was_busy && inner.scheduler.total_depth() == 0 && inner.scheduler.running() == 0 {
            inner.was_busy = false;
            inner.event("queue.drained", None, None, 0);
        }
        orphans
    }

    /// Runs expiry at every deadline until `shutdown`.
    pub async fn run_timer(self: Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        loop {
            let deadline = self.lock().scheduler.next_deadline();
            let sleep = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = self.timer.notified() => continue,
                () = sleep => {}
            }
            let dropped = {
                let mut inner = self.lock();
                self.pump(&mut inner, Instant::now())
            };
            drop(dropped);
        }
    }

    fn cancel(self: &Arc<Self>, id: TicketId) {
        let dropped = {
            let mut inner = self.lock();
            let cancelled = inner.scheduler.cancel(id).is_some();
            if cancelled {
                tracing::debug!(ticket = %id, "client left while queued");
            }
            self.pump(&mut inner, Instant::now())
        };
        drop(dropped);
    }

    fn complete(self: &Arc<Self>, lease: &Lease) {
        let dropped = {
            let mut inner = self.lock();
            let cost = lease.cost.unwrap_or_else(|| lease.started.elapsed());
            inner.scheduler.complete(lease.id, cost, Instant::now());
            if let Some(used) = inner.slots.get_mut(&lease.host.name) {
                *used = used.saturating_sub(1);
            }
            self.pump(&mut inner, Instant::now())
        };
        drop(dropped);
    }

    /// Takes a free slot on another host for a request that failed on
    /// `lease`'s host before any byte reached its client. The old slot is
    /// released.
    pub fn fail_over(&self, lease: &mut Lease, tried: &[Arc<str>]) -> bool {
        let mut inner = self.lock();
        let Inner { slots, hosts, .. } = &mut *inner;
        let next = hosts
            .iter()
            .filter(|host| !tried.contains(&host.name))
            .find(|host| slots.get(&host.name).copied().unwrap_or(0) < host.max_concurrent)
            .cloned();
        let Some(next) = next else {
            return false;
        };
        if let Some(used) = slots.get_mut(&lease.host.name) {
            *used = used.saturating_sub(1);
        }
        *slots.entry(next.name.clone()).or_insert(0) += 1;
        lease.host = next;
        true
    }

    /// Seconds a refused client should wait, from the tier's drain rate.
    pub fn retry_after(&self, tier: Tier) -> u64 {
        let inner = self.lock();
        inner.retry_after(tier)
    }

    /// Gauges for the status report.
    pub fn report(&self, drain_generation: u64) -> QueueReport {
        let mut inner = self.lock();
        let scheduler = &inner.scheduler;
        let tiers = Tier::ALL.map(|tier| scheduler.tier_stats(tier));
        let clients = scheduler.client_stats().collect();
        let idle = scheduler.total_depth() == 0;
        let queued_bytes = scheduler.queued_bytes();
        let slots = inner.slots.clone();
        QueueReport {
            tiers,
            clients,
            queued_bytes,
            slots,
            drained_generation: if idle { drain_generation } else { 0 },
            events: std::mem::take(&mut inner.events),
        }
    }

    /// Requests dropped by flushes since start.
    pub fn flushed_total(&self) -> u64 {
        self.flushed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Slots in use on `host`.
    pub fn slots_in_use(&self, host: &str) -> u32 {
        self.lock().slots.get(host).copied().unwrap_or(0)
    }

    /// Requests waiting in every tier.
    pub fn total_depth(&self) -> u32 {
        self.lock().scheduler.total_depth()
    }
}

/// Queue gauges of one moment.
#[derive(Debug)]
pub struct QueueReport {
    /// Per tier, in order high, normal, low.
    pub tiers: [crate::scheduler::TierStat; 3],
    /// Per client.
    pub clients: Vec<crate::scheduler::ClientStat>,
    /// Body bytes waiting.
    pub queued_bytes: u64,
    /// Slots in use per host.
    pub slots: HashMap<Arc<str>, u32>,
    /// The drain generation this node has emptied its queues for (0 = busy).
    pub drained_generation: u64,
    /// Events since the last report.
    pub events: Vec<wire::Event>,
}

impl Inner {
    fn refusal(&mut self, rejection: Rejection, tier: Tier, client: &Arc<str>) -> ProxyError {
        match rejection {
            Rejection::Paused => ProxyError::TierPaused(tier),
            Rejection::QueueFull | Rejection::ClientQueueFull => {
                let depth = self.scheduler.depth(tier);
                self.event("queue.full", Some(tier), Some(client), depth);
                ProxyError::QueueFull {
                    status: self.overflow_status,
                    retry_after: self.retry_after(tier),
                }
            }
            Rejection::OverCapacity => {
                self.event("queue.over_capacity", Some(tier), Some(client), 0);
                ProxyError::OverCapacity {
                    status: self.overflow_status,
                    retry_after: self.retry_after(tier),
                }
            }
        }
    }

    fn retry_after(&self, tier: Tier) -> u64 {
        let depth = self.scheduler.depth(tier);
        self.drain_rate[tier.index()].retry_after(depth, self.max_concurrent)
    }

    fn event(&mut self, name: &str, tier: Option<Tier>, client: Option<&Arc<str>>, depth: u32) {
        if self.events.len() >= MAX_EVENTS {
            return;
        }
        self.events.push(wire::Event {
            name: name.to_owned(),
            tier: tier.map_or(wire::Tier::Unspecified, crate::policy::tier_to_wire) as i32,
            client_id: client.map(ToString::to_string).unwrap_or_default(),
            queue_depth: depth,
            unix_ms: crate::policy::unix_ms(std::time::SystemTime::now()),
            host: String::new(),
        });
    }
}

/// The first healthy host with a free slot (all hosts when none is marked
/// healthy: health is a cached observation and must not black-hole the
/// proxy). Reserves the slot.
fn place(
    hosts: &[Arc<Host>],
    slots: &mut HashMap<Arc<str>, u32>,
    _model: Option<&str>,
) -> Option<Arc<Host>> {
    let any_healthy = hosts.iter().any(|host| host.healthy);
    let host = hosts
        .iter()
        .filter(|host| host.healthy || !any_healthy)
        .find(|host| slots.get(&host.name).copied().unwrap_or(0) < host.max_concurrent)?
        .clone();
    *slots.entry(host.name.clone()).or_insert(0) += 1;
    Some(host)
}

impl Pending {
    /// Waits for the dispatcher's answer. Dropping the future (the client
    /// left) removes the ticket at once.
    pub async fn granted(mut self) -> Result<Grant, ProxyError> {
        let Some(receiver) = self.receiver.as_mut() else {
            return Err(ProxyError::ShuttingDown);
        };
        let result = receiver.await.unwrap_or(Err(ProxyError::ShuttingDown));
        self.receiver = None;
        result
    }

    fn cancel(&mut self) {
        if let Some(mut receiver) = self.receiver.take() {
            receiver.close();
            // A grant that arrived meanwhile is dropped here, releasing its
            // lease; otherwise the ticket is still waiting: remove it.
            if receiver.try_recv().is_err() {
                self.dispatcher.cancel(self.id);
            }
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.cancel();
    }
}

impl Lease {
    /// The host the request goes to.
    pub fn host(&self) -> &Arc<Host> {
        &self.host
    }

    /// Records the request's GPU cost (Ollama's `total_duration`, when the
    /// response had one) for fair share; wall time on the slot otherwise.
    pub fn set_cost(&mut self, cost: Option<Duration>) {
        self.cost = cost;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let dispatcher = self.dispatcher.clone();
        dispatcher.complete(self);
    }
}
