//! The data plane's shared state: everything a request may need, behind one
//! `Arc`. Nothing here blocks on the control plane.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Instant, SystemTime};

use crate::auth::Throttle;
use crate::cache::Cache;
use crate::cloud::CloudPools;
use crate::control::{AdminClient, ControlLink};
use crate::dispatch::Dispatcher;
use crate::metrics::Metrics;
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
    /// The control plane's admin API, for the HTTP queue-control endpoints.
    pub admin: AdminClient,
    /// Prometheus metrics (`/metrics`).
    pub metrics: Metrics,
    /// Buffered request bodies, counted against `queue.max_queued_mb`.
    pub body_budget: crate::budget::BodyBudget,
    /// Open client connections, counted against the caps by every listener.
    pub connections: Arc<crate::server::limits::Connections>,
    shutting_down: AtomicBool,
    active: AtomicU32,
    last_used: Mutex<HashMap<Arc<str>, SystemTime>>,
}

impl App {
    /// Shared state for a node serving `store`.
    pub fn new(
        node: &str,
        store: Arc<PolicyStore>,
        control: Arc<ControlLink>,
        admin: AdminClient,
    ) -> Self {
        let policy = store.load();
        let timeout = policy.proxy.request_timeout;
        Self {
            dispatcher: Dispatcher::new(&policy),
            embedding_cache: arc_swap::ArcSwapOption::empty(),
            cloud: {
                let pools = CloudPools::default();
                pools.update(&policy);
                pools
            },
            metrics: Metrics::new(&policy),
            connections: Arc::default(),
            body_budget: crate::budget::BodyBudget::default(),
            throttle: Throttle::default(),
            admin,
            node: Arc::from(node),
            store,
            upstream: Upstream::new(timeout.min(std::time::Duration::from_secs(10))),
            started: Instant::now(),
            control,
            listen_addr: OnceLock::new(),
            shutting_down: AtomicBool::new(false),
            active: AtomicU32::new(0),
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
            // Anonymous callers (auth off) name themselves; bound the map.
            if last_used.len() >= 10_000 && !last_used.contains_key(client) {
                last_used.clear();
            }
            last_used.insert(client.clone(), SystemTime::now());
        }
    }

    /// When `client` last made a request.
    pub fn last_used(&self, client: &str) -> Option<SystemTime> {
        self.last_used.lock().ok()?.get(client).copied()
    }

    /// Requests in flight upstream.
    pub fn active(&self) -> u32 {
        self.active.load(Ordering::Relaxed)
    }

    /// Counts one request in flight until the guard drops.
    pub fn track_active(self: &Arc<Self>) -> ActiveGuard {
        self.active.fetch_add(1, Ordering::Relaxed);
        ActiveGuard(self.clone())
    }
}

/// One request in flight upstream; released when dropped.
#[derive(Debug)]
pub struct ActiveGuard(Arc<App>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}
