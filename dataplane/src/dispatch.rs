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
use crate::policy::{Host, Policy, Strategy};
use crate::router::{Decisions, HostStat, Placement, Placing, RouteReason, Router};
use crate::scheduler::{
    Ask, ClientLimits, Expiry, Limits, Rejection, Scheduler, SwapRule, Ticket, TicketId, Tier,
    TierLimits,
};

use rate::DrainRate;

/// Now on tokio's clock: the real time, or a test's paused time, so that the timer's
/// deadlines and the scheduler's clock agree.
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// A waiting request: where its answer goes, and whether its client was identified (by key or
/// by an injection port) rather than claimed, so that revocation can refuse it.
#[derive(Debug)]
struct Waiter {
    sender: oneshot::Sender<Result<Grant, ProxyError>>,
    verified: bool,
}

/// Most events kept for the next report.
const MAX_EVENTS: usize = 256;

/// The dispatcher of one data plane.
#[derive(Debug)]
pub struct Dispatcher {
    inner: Mutex<Inner>,
    timer: Notify,
    /// The snapshot version last applied.
    applied: tokio::sync::watch::Sender<u64>,
    flushed: std::sync::atomic::AtomicU64,
    /// Sends an explicit unload (`keep_alive: 0`) for a switch; set once by the app.
    unloader: std::sync::OnceLock<UnloadHook>,
}

/// The [`Unloader`], opaque in `Debug`.
struct UnloadHook(Unloader);

impl std::fmt::Debug for UnloadHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UnloadHook")
    }
}

/// Sends `keep_alive: 0` for `model` to `host` and, when it has answered (or failed), calls
/// [`Dispatcher::unloaded`]. Called under the dispatcher's lock: it must only spawn, and
/// returns false when it could not (the switch then goes on without the unload).
pub type Unloader = Box<dyn Fn(Arc<Host>, String) -> bool + Send + Sync>;

#[derive(Debug)]
struct Inner {
    scheduler: Scheduler<Waiter>,
    /// Host choice and per-host slots.
    router: Router,
    strategy: Strategy,
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
    /// The host the VRAM view counts the request on, and whether its dispatch started the
    /// model's load there; released at the end (or when it moves).
    ran: Option<(Arc<str>, bool)>,
    placement: Option<Placement>,
    model: Option<Arc<str>>,
    started: Instant,
    cost: Option<Duration>,
    load: Option<Duration>,
    /// Its prompt's prefill time per token, when nothing of it was cached.
    prefill: Option<f64>,
    /// The prompt tokens its engine found cached, as the engine stated them.
    engine_cached: Option<u64>,
    /// Whether its client was identified, for a ticket that waits again.
    verified: bool,
    /// Its ticket went back to the queue: dropping it completes nothing.
    settled: bool,
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
    /// How long it was held back for its model by the swap rule, if it was.
    pub held: Option<Duration>,
}

/// An admitted request, not yet dispatched.
#[derive(Debug)]
pub struct Pending {
    dispatcher: Arc<Dispatcher>,
    id: TicketId,
    /// Until it is answered (or cancelled).
    answer: Option<Answer>,
    /// 1-based position in its tier at admission.
    pub position: u32,
    /// Whether it was dispatched during admission (no wait at all).
    pub immediate: bool,
}

/// How a [`Pending`] request gets its answer.
#[derive(Debug)]
enum Answer {
    /// Through its channel, from the dispatcher.
    Channel(oneshot::Receiver<Result<Grant, ProxyError>>),
    /// Dispatched during admission: taken from its channel then, which is done with (boxed,
    /// so that a waiting request's `Pending` is no larger than the channel alone).
    Ready(Box<Result<Grant, ProxyError>>),
}

/// What a request asks of the queue, and how it was identified.
#[derive(Debug)]
pub struct Request {
    /// Its client (or a shared id for anonymous callers), tier, bytes, model and
    /// conversation.
    pub ask: Ask,
    /// Whether `client` was identified by a key or an injection port (not claimed with auth
    /// off): such a request is refused while waiting once its client leaves the snapshot or
    /// its key expires.
    pub verified: bool,
}

impl Dispatcher {
    /// A dispatcher for `policy`.
    pub fn new(policy: &Policy) -> Arc<Self> {
        let dispatcher = Arc::new(Self {
            inner: Mutex::new(Inner {
                scheduler: Scheduler::new(Limits::default()),
                router: Router::default(),
                strategy: policy.routing.strategy,
                configured_depth: [0; 3],
                max_concurrent: 1,
                overflow_status: http::StatusCode::SERVICE_UNAVAILABLE,
                flush_generation: [0; 3],
                drain_rate: Default::default(),
                events: Vec::new(),
                was_busy: false,
            }),
            timer: Notify::new(),
            applied: tokio::sync::watch::Sender::new(0),
            flushed: std::sync::atomic::AtomicU64::new(0),
            unloader: std::sync::OnceLock::new(),
        });
        {
            // A freed slot needs no hook: its lease's drop runs the dispatch, and a request
            // failing over waits in the queue. The timer is not woken either: a freed slot
            // moves no deadline earlier, and waking it cost a thread wake-up per request.
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
    /// generation drops the tier's waiting requests, and the waiting requests
    /// of a client whose key was revoked or has expired are refused.
    pub fn apply(self: &Arc<Self>, policy: &Policy) {
        let mut flushed = Vec::new();
        let mut dropped = Vec::new();
        let revoked;
        {
            let mut inner = self.lock();
            let wall = std::time::SystemTime::now();
            revoked = inner
                .scheduler
                .revoke(|client, waiter| waiter.verified && !policy.admits(client, wall));
            inner
                .scheduler
                .unconfigure_others(|client| policy.admits(client, wall));
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
            inner.router.update(policy);
            let swap = queue.model_swap;
            inner.scheduler.set_swap(SwapRule {
                enabled: swap.enabled,
                max_defer: swap.max_defer,
                idle_grace: swap.idle_grace,
            });
            inner.strategy = policy.routing.strategy;
            inner.max_concurrent = policy.proxy.max_concurrent;
            inner.overflow_status = queue.overflow_status;
            dropped.extend(self.pump(&mut inner, now()));
        }
        self.flushed
            .fetch_add(flushed.len() as u64, std::sync::atomic::Ordering::Relaxed);
        for waiter in flushed {
            let _ = waiter.sender.send(Err(ProxyError::Flushed));
        }
        if !revoked.is_empty() {
            tracing::info!(
                requests = revoked.len(),
                "refused waiting requests of revoked or expired keys"
            );
        }
        for waiter in revoked {
            let _ = waiter.sender.send(Err(ProxyError::KeyRevoked));
        }
        drop(dropped);
        self.applied.send_if_modified(|applied| {
            let newer = *applied < policy.version;
            *applied = (*applied).max(policy.version);
            newer
        });
        self.timer.notify_one();
    }

    /// Waits until a snapshot of `version` or newer has been applied.
    pub async fn applied(&self, version: u64) {
        let mut applied = self.applied.subscribe();
        let _ = applied.wait_for(|applied| *applied >= version).await;
    }

    /// Admits a request, or refuses it with the error the client gets.
    pub fn admit(self: &Arc<Self>, request: Request) -> Result<Pending, ProxyError> {
        let (sender, receiver) = oneshot::channel();
        let now = now();
        let tier = request.ask.tier;
        let client = request.ask.client.clone();
        let mut dropped = Vec::new();
        let result = {
            let mut inner = self.lock();
            let ticket = Ticket {
                ask: request.ask,
                payload: Waiter {
                    sender,
                    verified: request.verified,
                },
            };
            match inner.scheduler.enqueue(now, ticket) {
                Ok(admitted) => {
                    dropped.extend(self.pump(&mut inner, now));
                    // "Drained" means the waiting queues emptied after some
                    // request really waited; a request dispatched at once
                    // never filled them.
                    if inner.scheduler.total_depth() > 0 {
                        inner.was_busy = true;
                    }
                    Ok(admitted)
                }
                Err((rejection, _)) => Err(inner.refusal(rejection, tier, &client)),
            }
        };
        drop(dropped);
        let admitted = result?;
        let mut receiver = receiver;
        let (answer, immediate) = match receiver.try_recv() {
            Ok(grant) => (Answer::Ready(Box::new(grant)), true),
            Err(_) => (Answer::Channel(receiver), false),
        };
        if admitted.watermark_crossed && !immediate {
            // Only a request that really waits counts towards the watermark:
            // one dispatched during admission never sat in the queue.
            let mut inner = self.lock();
            let depth = inner.scheduler.depth(tier);
            inner.event("queue.high_watermark", Some(tier), None, depth);
        }
        if !immediate && self.lock().configured_depth[tier.index()] == 0 {
            // A tier with max_depth 0 never queues: run now or refuse.
            let mut pending = Pending {
                dispatcher: self.clone(),
                id: admitted.id,
                answer: Some(answer),
                position: admitted.position,
                immediate,
            };
            pending.cancel();
            let mut inner = self.lock();
            return Err(inner.refusal(Rejection::QueueFull, tier, &client));
        }
        if !immediate {
            // Its deadlines may come before the timer's next wake-up. One
            // dispatched at once adds none: waking the timer for it would
            // cost a thread wake-up per request.
            self.timer.notify_one();
        }
        Ok(Pending {
            dispatcher: self.clone(),
            id: admitted.id,
            answer: Some(answer),
            position: admitted.position,
            immediate,
        })
    }

    /// Dispatches every ticket that can run now and answers expired ones.
    /// Returns grants whose clients left, to be dropped after the lock is
    /// released (dropping a grant takes the lock).
    fn pump(self: &Arc<Self>, inner: &mut Inner, now: Instant) -> Vec<Grant> {
        let mut orphans = Vec::new();
        // Switches nothing waits for are dropped before anyone is offered a host.
        self.swap_upkeep(inner, now);
        loop {
            let Inner {
                scheduler,
                router,
                strategy,
                ..
            } = &mut *inner;
            let strategy = *strategy;
            router.begin_pass();
            let mut placing = Placing { router, strategy };
            let Some(dispatch) = scheduler.next_on(now, &mut placing) else {
                // A switch dropped, or an unload that could not be sent, changes what can run.
                if self.swap_upkeep(inner, now) {
                    continue;
                }
                break;
            };
            let tier = dispatch.tier;
            inner.drain_rate[tier.index()].record(now);
            let ran = Some((
                dispatch.placement.host.name.clone(),
                dispatch.placement.loads,
            ));
            let grant = Grant {
                lease: Lease {
                    dispatcher: self.clone(),
                    id: dispatch.id,
                    ran,
                    placement: Some(dispatch.placement),
                    model: dispatch.model,
                    started: now,
                    cost: None,
                    load: None,
                    prefill: None,
                    engine_cached: None,
                    verified: dispatch.payload.verified,
                    settled: false,
                },
                waited: dispatch.waited,
                tier,
                held: dispatch.held,
            };
            if let Err(Ok(grant)) = dispatch.payload.sender.send(Ok(grant)) {
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
                    let _ = payload.sender.send(Err(ProxyError::Expired));
                }
                Expiry::Promoted {
                    client, from, to, ..
                } => tracing::debug!(%client, %from, %to, "request promoted"),
            }
        }
        if inner.was_busy && inner.scheduler.total_depth() == 0 {
            inner.was_busy = false;
            inner.event("queue.drained", None, None, 0);
        }
        orphans
    }

    /// Drops switches nothing waits for any more, and sends the explicit unloads now due.
    /// Returns whether that changed what may run (a switch dropped, or an unload that could
    /// not be sent taken as done), so that the caller dispatches again.
    fn swap_upkeep(self: &Arc<Self>, inner: &mut Inner, now: Instant) -> bool {
        // Twice a pump, two pumps a request: nothing to look at is the usual case.
        if !inner.router.swap_pending() {
            return false;
        }
        let mut changed = false;
        for (host, model) in inner.router.switches() {
            if !inner.router.swap_enabled() || !inner.scheduler.waiting_for(&model) {
                inner.router.abort_switch(&host, now);
                changed = true;
            }
        }
        for (by, drained) in inner.router.take_charges() {
            tracing::debug!(client = %by.client, drained_ms = drained.as_millis() as u64, "model switch drain charged to its requester");
            inner.scheduler.charge_switch(&by, drained, now);
        }
        for (host, model) in inner.router.take_unloads() {
            match self.unloader.get() {
                Some(UnloadHook(unload)) if unload(host.clone(), model.clone()) => {
                    tracing::debug!(host = %host.name, %model, "unloading the model switched away from");
                }
                _ => {
                    inner.router.unloaded(&host.name, &model);
                    changed = true;
                }
            }
        }
        changed
    }

    /// Sets how explicit unloads are sent (once; later calls are ignored).
    pub fn set_unloader(&self, unloader: Unloader) {
        let _ = self.unloader.set(UnloadHook(unloader));
    }

    /// An explicit unload of `model` on `host` has answered or failed: the switch goes on.
    pub fn unloaded(self: &Arc<Self>, host: &str, model: &str) {
        let dropped = {
            let mut inner = self.lock();
            inner.router.unloaded(host, model);
            let dropped = self.pump(&mut inner, now());
            if inner.scheduler.holding() {
                self.timer.notify_one();
            }
            dropped
        };
        drop(dropped);
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
                self.pump(&mut inner, now())
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
            let dropped = self.pump(&mut inner, now());
            if inner.scheduler.holding() {
                // The held tickets left may have an earlier bound than the one that left.
                self.timer.notify_one();
            }
            dropped
        };
        drop(dropped);
    }

    /// A request ended. `cost` is its GPU time as Ollama reported it (`total_duration`, which
    /// includes `load`), or its wall time on the slot. With the swap rule on, only the request
    /// whose dispatch started its model's load is charged the load: the others of its batch
    /// waited for the same load, and it is charged once, to the client that caused it.
    fn complete(self: &Arc<Self>, ended: Ended<'_>) {
        let Ended {
            id,
            cost,
            ran,
            model,
            load,
            started,
            prefill,
            engine_slot,
            named_missed,
            placement,
        } = ended;
        let dropped = {
            let mut inner = self.lock();
            let now = now();
            // Its conversation's next turn is likely on its way: counted as coming back to its
            // host before anything sees the slot free.
            if let Some(slot) = placement
                .as_ref()
                .and_then(|placement| placement.affinity)
                .and_then(|verdict| verdict.slot)
            {
                inner.router.expect_back(slot, now);
            }
            // The slot frees first, so that the dispatch below can use it (its release hook
            // only wakes the dispatcher).
            drop(placement);
            let mut cost = cost;
            let loader = ran.as_ref().is_some_and(|(_, loads)| *loads);
            // `ran` is where the view counted it (its last host, if it failed over).
            if inner.router.swap_enabled() && !loader {
                cost = cost.saturating_sub(load.unwrap_or_default());
            }
            if let (Some((host, _)), Some(model)) = (ran, model) {
                // Normalised once here: the router's calls below then borrow it as it is.
                let model = crate::policy::normal_model(model);
                let model = &*model;
                inner.router.completed(&host, model, load, now);
                inner
                    .router
                    .ended(&host, model, started, prefill, engine_slot, now);
                if named_missed {
                    inner.router.named_slot_missed(&host, model);
                }
            }
            inner.scheduler.complete(id, cost, now);
            let dropped = self.pump(&mut inner, now);
            if inner.scheduler.holding() || inner.scheduler.waits_for_host() {
                // A held request may now switch after the idle grace, or one waiting for its
                // conversation's host be due elsewhere: deadlines the timer does not know yet.
                self.timer.notify_one();
            }
            dropped
        };
        drop(dropped);
    }

    /// Moves a request that failed on its host before any byte reached its
    /// client to another host with a free slot (same preference order,
    /// excluding `tried`). `down` marks the failed host unreachable until its
    /// next poll; a busy host (503) is not marked. False when no other host
    /// can take it now.
    pub fn fail_over(&self, lease: &mut Lease, tried: &[Arc<str>], down: bool) -> bool {
        let old = {
            let mut inner = self.lock();
            let strategy = inner.strategy;
            if down && let Some(placement) = &lease.placement {
                inner.router.mark_down(&placement.host.name);
            }
            let now = now();
            match inner
                .router
                .failover_on(lease.model.as_deref(), strategy, tried, now)
            {
                Some(next) => {
                    if let (Some((old, _)), Some(model)) = (lease.ran.take(), &lease.model) {
                        inner.router.released(&old, model, now);
                        let engine_slot = lease.engine_slot();
                        inner.router.moved(
                            &old,
                            Some(&next.host.name),
                            model,
                            lease.started,
                            engine_slot,
                        );
                    }
                    lease.ran = Some((next.host.name.clone(), next.loads));
                    lease.placement.replace(next)
                }
                None => return false,
            }
        };
        // The old slot frees outside the lock, then goes to whoever waits.
        drop(old);
        lease.dispatcher.dispatch_freed();
        true
    }

    /// Records the answer of a conversation placed at `slot`: its runner now holds `point`,
    /// the next turn's prefix.
    pub fn answered(&self, slot: crate::affinity::Slot, point: crate::affinity::Point) {
        self.lock().router.answered(slot, point, now());
    }

    /// Gives a slot freed outside the usual paths (a lease moving to
    /// another host) to the requests already waiting.
    fn dispatch_freed(self: &Arc<Self>) {
        let dropped = {
            let mut inner = self.lock();
            self.pump(&mut inner, now())
        };
        drop(dropped);
    }

    /// Like [`fail_over`](Self::fail_over), but when the other hosts are only busy, the
    /// request goes back to the queue instead of giving up: it holds no slot of any kind while
    /// it waits (not the failed host's, not its client's in-flight count), and waits as the
    /// ticket it was, at its own tier and place, its wait so far counting toward its
    /// deadline; the next grant (at most `timeout` away) becomes the lease. False when no
    /// other host can ever take it, or none did in time (the lease then holds no slot).
    pub async fn fail_over_wait(
        &self,
        lease: &mut Lease,
        tried: &[Arc<str>],
        down: bool,
        timeout: Duration,
    ) -> bool {
        if self.fail_over(lease, tried, down) {
            return true;
        }
        let this = lease.dispatcher.clone();
        // The failed host's slot is free for others at once.
        let engine_slot = lease.engine_slot();
        if lease.placement.take().is_some() {
            if let (Some((old, _)), Some(model)) = (lease.ran.take(), &lease.model) {
                let mut inner = self.lock();
                inner.router.released(&old, model, now());
                inner
                    .router
                    .moved(&old, None, model, lease.started, engine_slot);
            }
            this.dispatch_freed();
        }
        let candidate_left = self
            .lock()
            .router
            .stats()
            .iter()
            .any(|stat| !tried.contains(&stat.name) && !stat.marked_down);
        if !candidate_left {
            return false;
        }
        let (sender, receiver) = oneshot::channel();
        let id = lease.id;
        let requeued = {
            let mut inner = self.lock();
            let now = now();
            let waiter = Waiter {
                sender,
                verified: lease.verified,
            };
            let requeued = inner
                .scheduler
                .requeue(id, waiter, tried.to_vec(), now)
                .is_ok();
            let dropped = if requeued {
                this.pump(&mut inner, now)
            } else {
                Vec::new()
            };
            (requeued, dropped)
        };
        let (requeued, dropped) = requeued;
        drop(dropped);
        if !requeued {
            return false;
        }
        // The ticket is the lease's no more: this lease must not complete it.
        lease.settled = true;
        self.timer.notify_one();
        let pending = Pending {
            dispatcher: this,
            id,
            answer: Some(Answer::Channel(receiver)),
            position: 0,
            immediate: false,
        };
        // Expired, flushed, revoked, or no grant in time: the request gives up (the timeout
        // drops `pending`, which takes it out of the queue if it still waits).
        let Ok(Ok(grant)) = tokio::time::timeout(timeout, pending.granted()).await else {
            return false;
        };
        *lease = grant.lease;
        true
    }

    /// The refusal of a request whose body does not fit the byte budget of
    /// buffered bodies: the queue's own over-capacity answer and event.
    pub fn over_capacity(&self, tier: Tier, client: &Arc<str>) -> ProxyError {
        self.lock().refusal(Rejection::OverCapacity, tier, client)
    }

    /// Removes `(host, model)` from routing after Ollama answered "model not
    /// found", until the host's next poll.
    pub fn forget_model(&self, host: &str, model: &str) {
        self.lock().router.forget_model(host, model);
    }

    /// Routing decisions by reason, and per-host counters.
    pub fn routing(&self) -> (Decisions, Vec<HostStat>) {
        let inner = self.lock();
        (inner.router.decisions(), inner.router.stats())
    }

    /// Seconds a refused client should wait, from the tier's drain rate.
    pub fn retry_after(&self, tier: Tier) -> u64 {
        let inner = self.lock();
        inner.retry_after(tier)
    }

    /// Gauges for the status report.
    pub fn report(&self, drain_generation: u64) -> QueueReport {
        let mut inner = self.lock();
        let mut report = inner.gauges();
        if inner.scheduler.total_depth() == 0 {
            report.drained_generation = drain_generation;
        }
        report.events = std::mem::take(&mut inner.events);
        report
    }

    /// The same gauges for status pages and metrics: no drain generation,
    /// and the pending events are left for the next report.
    pub fn stats(&self) -> QueueReport {
        self.lock().gauges()
    }

    /// Requests dropped by flushes since start.
    pub fn flushed_total(&self) -> u64 {
        self.flushed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Slots in use on `host`.
    pub fn slots_in_use(&self, host: &str) -> u32 {
        self.lock().router.slots_in_use(host)
    }

    /// What an edge ranks this node's hosts by: requests waiting in every tier, and each
    /// host's slots, in one read.
    pub fn load(&self) -> (u32, Vec<HostStat>) {
        let inner = self.lock();
        (inner.scheduler.total_depth(), inner.router.stats())
    }

    /// Each own host's model-swap state (resident models, capacity, held requests).
    pub fn swap_stats(&self) -> Vec<crate::swap::SwapStat> {
        let inner = self.lock();
        let held = inner.scheduler.held();
        let mut stats = inner.router.swap_stats(now());
        for stat in &mut stats {
            if let Some((count, oldest)) = held.get(&stat.host) {
                stat.held = *count;
                stat.oldest_held = Some(*oldest);
            }
        }
        stats
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
    /// Per-host slots and counters.
    pub slots: HashMap<Arc<str>, HostStat>,
    /// The drain generation this node has emptied its queues for (0 = busy).
    pub drained_generation: u64,
    /// Events since the last report.
    pub events: Vec<wire::Event>,
}

impl Inner {
    fn gauges(&self) -> QueueReport {
        let scheduler = &self.scheduler;
        QueueReport {
            tiers: Tier::ALL.map(|tier| scheduler.tier_stats(tier)),
            clients: scheduler.client_stats().collect(),
            queued_bytes: scheduler.queued_bytes(),
            slots: self
                .router
                .stats()
                .into_iter()
                .map(|stat| (stat.name.clone(), stat))
                .collect(),
            drained_generation: 0,
            events: Vec::new(),
        }
    }

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

impl Pending {
    /// Waits for the dispatcher's answer. Dropping the future (the client
    /// left) removes the ticket at once.
    pub async fn granted(mut self) -> Result<Grant, ProxyError> {
        match self.answer.take() {
            Some(Answer::Ready(grant)) => return *grant,
            // Kept in place while it waits: dropping this future cancels the ticket.
            Some(channel) => self.answer = Some(channel),
            None => return Err(ProxyError::ShuttingDown),
        }
        let Some(Answer::Channel(receiver)) = self.answer.as_mut() else {
            return Err(ProxyError::ShuttingDown);
        };
        let result = receiver.await.unwrap_or(Err(ProxyError::ShuttingDown));
        self.answer = None;
        result
    }

    fn cancel(&mut self) {
        match self.answer.take() {
            Some(Answer::Channel(mut receiver)) => {
                receiver.close();
                // A grant that arrived meanwhile is dropped here, releasing its
                // lease; otherwise the ticket is still waiting: remove it.
                if receiver.try_recv().is_err() {
                    self.dispatcher.cancel(self.id);
                }
            }
            // A grant taken at admission is dropped here, releasing its lease.
            Some(Answer::Ready(_)) | None => {}
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
    pub fn host(&self) -> Option<&Arc<Host>> {
        self.placement.as_ref().map(|placement| &placement.host)
    }

    /// The request's model, if it named one.
    pub fn model(&self) -> Option<&Arc<str>> {
        self.model.as_ref()
    }

    /// Why that host was chosen.
    pub fn reason(&self) -> Option<RouteReason> {
        self.placement.as_ref().map(|placement| placement.reason)
    }

    /// Records the request's GPU cost (Ollama's `total_duration`, when the
    /// response had one) for fair share, wall time on the slot otherwise, and
    /// its `load_duration`.
    pub fn set_cost(&mut self, cost: Option<Duration>, load: Option<Duration>) {
        self.cost = cost;
        self.load = load;
    }

    /// How its conversation's prompt cache chose the host, if it has one.
    pub fn affinity(&self) -> Option<crate::affinity::Verdict> {
        self.placement
            .as_ref()
            .and_then(|placement| placement.affinity)
    }

    /// The engine slot it took on its host, where oqp names slots (a llama-server's
    /// `id_slot`).
    pub fn engine_slot(&self) -> Option<u32> {
        self.placement
            .as_ref()
            .and_then(|placement| placement.engine_slot)
            .map(|choice| choice.slot)
    }

    /// The engine slot to name in the request sent to its host, if any.
    pub fn named_slot(&self) -> Option<u32> {
        self.placement
            .as_ref()
            .and_then(|placement| placement.engine_slot)
            .filter(|choice| choice.named)
            .map(|choice| choice.slot)
    }

    /// Records the prompt tokens its engine found cached, as the engine stated them.
    pub fn set_engine_cached(&mut self, cached: Option<u64>) {
        self.engine_cached = cached;
    }

    /// Whether it named a slot for a conversation oqp expected cached there and the engine
    /// found almost none of it cached: the engine does not keep prompts in named slots as
    /// oqp takes it to (a llama-server with `-kvu` empties idle slots into its RAM cache,
    /// and restores nothing into a named empty slot).
    fn named_missed(&self) -> bool {
        let Some(placement) = &self.placement else {
            return false;
        };
        let named = placement.engine_slot.is_some_and(|choice| choice.named);
        let expected = placement
            .affinity
            .map_or(0, |verdict| u64::from(verdict.cached_tokens));
        named
            && expected >= u64::from(crate::router::MIN_CACHED_TOKENS)
            && self
                .engine_cached
                .is_some_and(|cached| cached.saturating_mul(4) < expected)
    }

    /// Records its prompt's prefill time per token (Ollama's `prompt_eval_duration` over
    /// `prompt_eval_count`) when nothing of it was cached: the host's rate is learned from it.
    pub fn set_prefill(&mut self, per_token: Option<f64>) {
        self.prefill = per_token;
    }

    /// Whether its dispatch started loading its model on its host.
    pub fn loads(&self) -> bool {
        self.ran.as_ref().is_some_and(|(_, loads)| *loads)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let engine_slot = self.engine_slot();
        let named_missed = self.named_missed();
        let placement = self.placement.take();
        if self.settled {
            return;
        }
        let ran = self.ran.take();
        let cost = self.cost.unwrap_or_else(|| self.started.elapsed());
        let dispatcher = self.dispatcher.clone();
        let model = self.model.clone();
        dispatcher.complete(Ended {
            id: self.id,
            cost,
            ran,
            model: model.as_deref(),
            load: self.load,
            started: self.started,
            prefill: self.prefill,
            engine_slot,
            named_missed,
            placement,
        });
    }
}

/// What a lease reports of its request when it ends ([`Dispatcher::complete`]).
struct Ended<'a> {
    id: TicketId,
    /// The request's GPU time as Ollama reported it, else its wall time on the slot.
    cost: Duration,
    /// The host it ran on last, and whether its dispatch started its model's load.
    ran: Option<(Arc<str>, bool)>,
    model: Option<&'a str>,
    /// The model's load time, as Ollama reported it.
    load: Option<Duration>,
    started: Instant,
    /// Its prompt's prefill time per token, when nothing of it was cached.
    prefill: Option<f64>,
    /// The engine slot it ran in, on a llama-server whose slots oqp names.
    engine_slot: Option<u32>,
    /// Whether the named slot held far less than expected.
    named_missed: bool,
    placement: Option<Placement>,
}

#[cfg(test)]
mod tests;
