//! The data plane's shared state: everything a request may need, behind one
//! `Arc`. Nothing here blocks on the control plane.
//!
//! The pieces below it never see `App`: each takes the parts it reads, as
//! references or as a small struct of them built here
//! ([`App::queue_parts`], [`App::embedding_parts`], [`App::status_sources`],
//! [`App::metric_sources`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Instant, SystemTime};

use crate::auth::Throttle;
use crate::cache::Cache;
use crate::cloud::CloudPools;
use crate::control::{AdminClient, ControlLink};
use crate::dispatch::Dispatcher;
use crate::metrics::Metrics;
use crate::proxy::{Active, ActiveGuard};
use crate::snapshot::PolicyStore;
use crate::upstream::Upstream;

/// Shared by every request and background task of one data plane.
#[derive(Debug)]
pub struct App {
    /// This node's name.
    pub node: Arc<str>,
    /// The current policy.
    pub store: Arc<PolicyStore>,
    /// The upstream HTTP client.
    pub upstream: Upstream,
    /// When the data plane started.
    pub started: Instant,
    /// The state of the link to the control plane.
    pub control: Arc<ControlLink>,
    /// Where the main listener is bound, once it is.
    pub listen_addr: OnceLock<SocketAddr>,
    /// Queues and upstream slots.
    pub dispatcher: Arc<Dispatcher>,
    /// Ollama Cloud key pools, per cloud host.
    pub cloud: CloudPools,
    /// The embedding cache, when enabled (replaced when its settings change).
    pub embedding_cache: arc_swap::ArcSwapOption<Cache>,
    /// Failed-authentication throttle.
    pub throttle: Throttle,
    /// Clients whose issuer keys a user's token asked for, until the next report.
    pub key_refresh: crate::auth::KeyRefresh,
    /// Metadata reads per client.
    pub metadata_limit: crate::metadata_limit::MetadataLimit,
    /// The request log's channel (`logging.requests`).
    pub request_log: Arc<crate::request_log::RequestLog>,
    /// The control plane's admin API, for the HTTP queue-control endpoints.
    pub admin: AdminClient,
    /// Prometheus metrics (`/metrics`).
    pub metrics: Arc<Metrics>,
    /// Usage accounting and budgets.
    pub usage: Arc<crate::usage::Usage>,
    /// Buffered request bodies, counted against `queue.max_queued_mb`.
    pub body_budget: crate::budget::BodyBudget,
    /// Open client connections, counted against the caps by every listener.
    pub connections: Arc<crate::connections::Connections>,
    /// The other data planes: where they are, their load, what was forwarded to them.
    pub peers: Arc<crate::peers::Peers>,
    /// The TLS listeners' certificates, for reloads.
    pub tls: Arc<crate::tls::TlsCerts>,
    /// Dashboard sessions (a key exchanged once for a cookie): memory only.
    pub sessions: crate::dashboard::session::Sessions,
    shutting_down: AtomicBool,
    active: Active,
    last_used: Mutex<HashMap<Arc<str>, SystemTime>>,
}

/// Most clients whose last request time is remembered.
const MAX_LAST_USED: usize = 10_000;

impl App {
    /// Shared state for a node serving `store`.
    pub fn new(
        node: &str,
        peers: crate::peers::Peers,
        store: Arc<PolicyStore>,
        control: Arc<ControlLink>,
        admin: AdminClient,
        started: std::time::SystemTime,
    ) -> Self {
        let policy = store.load();
        let timeout = policy.proxy.request_timeout;
        let upstream = Upstream::new(timeout.min(std::time::Duration::from_secs(10)));
        let dispatcher = Dispatcher::new(&policy);
        dispatcher.set_unloader(crate::forward::unloader(
            upstream.clone(),
            Arc::downgrade(&dispatcher),
        ));
        let metrics = Arc::new(Metrics::new(&policy));
        Self {
            usage: Arc::new(crate::usage::Usage::with_epoch(metrics.clone(), started)),
            dispatcher,
            embedding_cache: arc_swap::ArcSwapOption::empty(),
            cloud: {
                let pools = CloudPools::default();
                pools.update(&policy);
                pools
            },
            metrics,
            connections: Arc::default(),
            peers: Arc::new(peers),
            tls: Arc::default(),
            sessions: Default::default(),
            body_budget: crate::budget::BodyBudget::default(),
            throttle: Throttle::default(),
            key_refresh: crate::auth::KeyRefresh::default(),
            metadata_limit: Default::default(),
            request_log: Default::default(),
            admin,
            node: Arc::from(node),
            store,
            upstream,
            started: Instant::now(),
            control,
            listen_addr: OnceLock::new(),
            shutting_down: AtomicBool::new(false),
            active: Active::default(),
            last_used: Mutex::new(HashMap::new()),
        }
    }

    /// Whether shutdown has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }

    /// Marks the start of shutdown: new proxied requests are refused.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
    }

    /// The embedding cache, if one is running.
    pub fn cache(&self) -> Option<Arc<Cache>> {
        self.embedding_cache.load_full()
    }

    /// Notes that `client` made a request now.
    pub fn touch(&self, client: &Arc<str>) {
        if let Ok(mut last_used) = self.last_used.lock() {
            note_use(&mut last_used, client, SystemTime::now());
        }
    }

    /// When `client` last made a request.
    pub fn last_used(&self, client: &str) -> Option<SystemTime> {
        self.last_used.lock().ok()?.get(client).copied()
    }

    /// Requests in flight upstream.
    pub fn active(&self) -> u32 {
        self.active.count()
    }

    /// Counts one request in flight until the guard drops.
    pub fn track_active(&self) -> ActiveGuard {
        self.active.track()
    }

    /// What a `/metrics` scrape mirrors.
    pub fn metric_sources(&self) -> crate::metrics::Sources<'_> {
        crate::metrics::Sources {
            store: &self.store,
            dispatcher: &self.dispatcher,
            cache: self.cache(),
            cloud: &self.cloud,
            started: self.started,
        }
    }

    /// What `/queue/status` and `/queue/summary` read.
    pub fn status_sources(&self) -> crate::status::Sources<'_> {
        crate::status::Sources {
            dispatcher: &self.dispatcher,
            metrics: &self.metrics,
            usage: &self.usage,
            cloud: &self.cloud,
            control: &self.control,
            store: &self.store,
            started: self.started,
            peers: &self.peers,
        }
    }

    /// What an embedding request reads.
    pub fn embedding_parts(&self) -> crate::embeddings::Parts<'_> {
        crate::embeddings::Parts {
            queue: self.queue_parts(),
            cache: self.cache(),
        }
    }

    /// What the queued path reads.
    pub fn queue_parts(&self) -> crate::queued::Parts<'_> {
        crate::queued::Parts {
            store: &self.store,
            dispatcher: &self.dispatcher,
            metrics: &self.metrics,
            cloud: &self.cloud,
            upstream: &self.upstream,
            active: &self.active,
            usage: &self.usage,
            peers: &self.peers,
            request_log: &self.request_log,
        }
    }
}

/// Records that `client` made a request at `now`. Anonymous callers (auth off) name themselves,
/// so the map is bounded: at [`MAX_LAST_USED`] the least recently seen tenth is forgotten, never
/// everyone at once.
fn note_use(last_used: &mut HashMap<Arc<str>, SystemTime>, client: &Arc<str>, now: SystemTime) {
    if last_used.len() >= MAX_LAST_USED && !last_used.contains_key(client) {
        let mut by_age: Vec<(SystemTime, Arc<str>)> = last_used
            .iter()
            .map(|(client, at)| (*at, client.clone()))
            .collect();
        by_age.sort_unstable();
        for (_, old) in by_age.into_iter().take(MAX_LAST_USED / 10) {
            last_used.remove(&old);
        }
    }
    last_used.insert(client.clone(), now);
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn last_used_is_bounded_and_forgets_the_oldest_first() {
        let mut map = HashMap::new();
        let t0 = SystemTime::UNIX_EPOCH;
        let busy: Arc<str> = Arc::from("busy");
        for i in 0..(MAX_LAST_USED as u64 + 500) {
            let at = t0 + Duration::from_secs(i);
            note_use(&mut map, &Arc::from(format!("caller-{i}")), at);
            note_use(&mut map, &busy, at);
        }
        assert!(map.len() <= MAX_LAST_USED);
        assert!(map.contains_key("busy"), "a client still calling is kept");
        assert!(!map.contains_key("caller-0"), "the oldest went first");
        assert!(map.contains_key(format!("caller-{}", MAX_LAST_USED + 499).as_str()));
    }
}
