//! `GET /metrics`: the data plane in Prometheus text format.
//!
//! Two kinds of figures live here:
//!
//! - **Mirrors** of state other parts own (queue depths and counters, slots,
//!   clients, hosts, the snapshot), refreshed from one
//!   [`Dispatcher::stats`](crate::dispatch::Dispatcher::stats) read and one
//!   policy load at scrape time. The request path pays nothing for them.
//! - **Observations** only the request path sees (queue wait, upstream
//!   time to first byte, failovers, host answers and failures, embedding
//!   cache hits, routing decisions), recorded by the methods of [`Metrics`]
//!   as they happen: a read-locked lookup of the series, then an atomic add.
//!   A scrape never holds up a request longer than reading a series.
//!
//! Every family is on `/metrics` from the first scrape: series whose labels
//! are known at start (per tier, per host, the cache's `backend` errors)
//! start at zero, and a family with no series yet (its labels come from
//! requests: clients, models) is still declared with its `# HELP` and
//! `# TYPE` lines, so that dashboards and alerts find it.
//!
//! Label values are escaped by the `prometheus` encoder (a client id with
//! `"`, `\` or a newline cannot forge a series), and every label whose values
//! come from callers is bounded: configured clients plus at most
//! [`MAX_OTHER_LABELS`] others, the rest counted under [`OTHER`]. Models the
//! hosts list (installed or loaded) always get their own label, so names
//! made up by clients can fill the budget but never push a real model into
//! [`OTHER`].

use crate::affinity::Outcome;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{HeaderValue, Response, header};
use prometheus::core::Collector;
use prometheus::{
    CounterVec, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::body::{self, Body};
use crate::cache::Cache;
use crate::cloud::CloudPools;
use crate::dispatch::{Dispatcher, QueueReport};
use crate::policy::{Client, Host, Policy};
use crate::scheduler::{ClientStat, Tier, TierStat};
use crate::snapshot::PolicyStore;

/// Most label values seen per caller-supplied dimension (unconfigured
/// clients, models, error kinds, reasons, endpoints) before the rest are
/// counted under [`OTHER`].
pub const MAX_OTHER_LABELS: usize = 100;

/// The label value that stands for every value past the bound.
pub const OTHER: &str = "(other)";

/// The longest model name kept as a label (bytes); a longer one is counted under
/// [`OTHER`], so that a client cannot fill the metrics or the usage files with names.
pub const MAX_MODEL_LABEL_BYTES: usize = 256;

/// The content type of the text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Buckets of `oqp_queue_wait_seconds`: from "dispatched at once" to the
/// longest default `max_wait` (10 minutes).
const WAIT_BUCKETS: [f64; 16] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0, 600.0,
];

/// Buckets of `oqp_upstream_ttfb_seconds`: a warm model answers in tens of
/// milliseconds, a cold load takes tens of seconds.
const TTFB_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Buckets of `oqp_hop_added_seconds`: a hop on a LAN adds tens to hundreds of
/// microseconds; more is a congested or distant link.
const HOP_BUCKETS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// What a scrape mirrors: the state other parts own, read at scrape time.
#[derive(Debug)]
pub struct Sources<'a> {
    /// The current policy, and the count of snapshots refused.
    pub store: &'a PolicyStore,
    /// Queue, slot and client figures.
    pub dispatcher: &'a Dispatcher,
    /// The embedding cache, if one is running.
    pub cache: Option<Arc<Cache>>,
    /// The Ollama Cloud key pools.
    pub cloud: &'a CloudPools,
    /// When the data plane started.
    pub started: std::time::Instant,
}

/// A registered family, for declaring it before it has a series.
#[derive(Debug, Clone)]
struct Family {
    name: String,
    help: String,
    kind: &'static str,
}

/// The data plane's metrics, in a private registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Every family registered, in registration order.
    families: Vec<Family>,
    /// Serialises scrapes: mirrors are refreshed and encoded as one step.
    scrape: Mutex<()>,
    /// Client ids of the current snapshot: always their own label value.
    configured: ArcSwap<HashSet<Arc<str>>>,
    /// Models the hosts of the current snapshot list (normalised): always their own label.
    hosted_models: ArcSwap<HashSet<String>>,
    /// Normalised hosted model → the label it is counted under: the first spelling seen, so
    /// that other spellings of one model share it.
    hosted_labels: RwLock<std::collections::HashMap<String, Arc<str>>>,
    /// The usage series and ledger labels of each client and model that ended a request,
    /// resolved once until the next snapshot (see [`Metrics::usage`]).
    usage_series: RwLock<UsageCache>,
    clients: Budget,
    models: Budget,
    endpoints: Budget,
    kinds: Budget,
    reasons: Budget,

    queue_depth: IntGaugeVec,
    queue_processed: IntCounterVec,
    queue_rejected: IntCounterVec,
    queue_expired: IntCounterVec,
    queue_cancelled: IntCounterVec,
    queue_promoted: IntCounterVec,
    queue_flushed: IntCounterVec,
    queued_bytes: IntGauge,
    queue_wait: HistogramVec,
    concurrency_active: IntGauge,
    host_healthy: IntGaugeVec,
    host_requests: IntCounterVec,
    host_failures: IntCounterVec,
    host_errors: IntCounterVec,
    host_slots_in_use: IntGaugeVec,
    runner_slots: IntGaugeVec,
    runner_in_flight: IntGaugeVec,
    ollama_queued_estimate: IntGauge,
    host_models_installed: IntGaugeVec,
    host_info: IntGaugeVec,
    host_engine_slots: IntGaugeVec,
    host_models_loaded: IntGaugeVec,
    upstream_ttfb: HistogramVec,
    failovers: IntCounter,
    request_log_dropped: IntCounter,
    request_log_failures: IntCounter,
    forwarded: IntCounterVec,
    hop_added: prometheus::Histogram,
    client_inflight: IntGaugeVec,
    client_cap_waiting: IntGaugeVec,
    client_recent_share: GaugeVec,
    client_gpu_seconds: CounterVec,
    client_tokens: IntCounterVec,
    rate_limited: IntCounterVec,
    cache_hits: IntCounterVec,
    cache_misses: IntCounterVec,
    cache_errors: IntCounterVec,
    cache_partial: IntCounterVec,
    cache_bytes: IntGauge,
    cache_errors_seen: std::sync::atomic::AtomicU64,
    cloud_keys_cooling: IntGaugeVec,
    /// `oqp_cloud_balance_usd{account}` and `oqp_cloud_remaining_ratio{account,window}`.
    cloud_balance_usd: GaugeVec,
    cloud_remaining_ratio: GaugeVec,
    routing_decisions: IntCounterVec,
    /// `oqp_affinity_total{result}`, one handle per outcome in [`Outcome::ALL`]'s order.
    affinity: [prometheus::IntCounter; 4],
    model_switches: IntCounterVec,
    model_load_seconds: CounterVec,
    swap_deferral: prometheus::Histogram,
    snapshot_version: IntGauge,
    snapshot_rejected: IntCounter,
    uptime: IntGauge,
}

/// Most client and model pairs whose usage series [`Metrics::usage`] keeps resolved: past
/// it, another pair is resolved at each request, as if nothing were kept.
const MAX_USAGE_SERIES: usize = 1024;

/// One client's usage of one model, as [`Metrics::usage`] resolves it: the labels its
/// ledger row is kept under and the series it counts in.
#[derive(Debug)]
struct UsageSeries {
    row_client: Arc<str>,
    row_model: Arc<str>,
    gpu_seconds: Option<prometheus::Counter>,
    prompt_tokens: Option<IntCounter>,
    completion_tokens: Option<IntCounter>,
}

/// Resolved usage series, by client then model (both as requests name them). Emptied by
/// [`Metrics::apply`], which holds it locked while it changes what the labels depend on
/// (the configured clients, the hosted models), so that nothing resolved before a
/// snapshot is kept past it; the label budgets only ever grow, so what they gave stands.
#[derive(Debug, Default)]
struct UsageCache {
    by_client:
        std::collections::HashMap<Box<str>, std::collections::HashMap<Box<str>, UsageSeries>>,
    len: usize,
}

impl UsageCache {
    fn get(&self, client: &str, model: &str) -> Option<&UsageSeries> {
        self.by_client.get(client)?.get(model)
    }
}

/// A bounded set of label values for one dimension.
#[derive(Debug, Default)]
struct Budget {
    seen: RwLock<HashSet<Box<str>>>,
}

impl Budget {
    /// `value` if it is already known or there is room for it, else [`OTHER`].
    fn admit<'a>(&self, value: &'a str) -> &'a str {
        if self.seen.read().is_ok_and(|seen| seen.contains(value)) {
            return value;
        }
        let Ok(mut seen) = self.seen.write() else {
            return OTHER;
        };
        if seen.contains(value) {
            value
        } else if seen.len() < MAX_OTHER_LABELS {
            seen.insert(value.into());
            value
        } else {
            OTHER
        }
    }
}

impl Metrics {
    /// Every metric, registered, with the clients of `policy` known.
    // The names, help texts and labels are constants (a unit test builds
    // them); a registration error is a programming error found at start-up.
    #[allow(clippy::expect_used)]
    pub fn new(policy: &Policy) -> Self {
        let registry = Registry::new();
        let families = std::cell::RefCell::new(Vec::new());
        let add = |collector: Box<dyn Collector>, kind: &'static str| {
            families
                .borrow_mut()
                .extend(collector.desc().into_iter().map(|desc| Family {
                    name: desc.fq_name.clone(),
                    help: desc.help.clone(),
                    kind,
                }));
            registry
                .register(collector)
                .expect("metric names are unique and valid");
        };
        let int_gauge = |name: &str, help: &str| {
            let gauge = IntGauge::new(name, help).expect("valid metric");
            add(Box::new(gauge.clone()), "gauge");
            gauge
        };
        let int_gauges = |name: &str, help: &str, labels: &[&str]| {
            let vec = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
            add(Box::new(vec.clone()), "gauge");
            vec
        };
        let counter = |name: &str, help: &str| {
            let counter = IntCounter::new(name, help).expect("valid metric");
            add(Box::new(counter.clone()), "counter");
            counter
        };
        let counters = |name: &str, help: &str, labels: &[&str]| {
            let vec = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            add(Box::new(vec.clone()), "counter");
            vec
        };
        let histograms = |name: &str, help: &str, buckets: &[f64]| {
            let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
            let vec = HistogramVec::new(opts, &["tier"]).expect("valid metric");
            add(Box::new(vec.clone()), "histogram");
            vec
        };
        let histogram = |name: &str, help: &str, buckets: &[f64]| {
            let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
            let histogram = prometheus::Histogram::with_opts(opts).expect("valid metric");
            add(Box::new(histogram.clone()), "histogram");
            histogram
        };
        let model_load_seconds = CounterVec::new(
            Opts::new(
                "oqp_model_load_seconds_total",
                "Seconds spent loading models into VRAM (load_duration of the request that started each load)",
            ),
            &["host", "model"],
        )
        .expect("valid metric");
        add(Box::new(model_load_seconds.clone()), "counter");
        let float_gauges = |name: &str, help: &str, labels: &[&str]| {
            let vec = GaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
            add(Box::new(vec.clone()), "gauge");
            vec
        };
        let cloud_balance_usd = float_gauges(
            "oqp_cloud_balance_usd",
            "Ollama Cloud credit-plan balance in USD (included plus extra usage) as last read, by account",
            &["account"],
        );
        let cloud_remaining_ratio = float_gauges(
            "oqp_cloud_remaining_ratio",
            "Share of an Ollama Cloud account's allowance left as last read, 0 to 1, by window (monthly, session, weekly)",
            &["account", "window"],
        );
        let recent_share = GaugeVec::new(
            Opts::new(
                "oqp_client_recent_share",
                "Client's share of recent GPU time (decayed), 0 to 1",
            ),
            &["client_id"],
        )
        .expect("valid metric");
        add(Box::new(recent_share.clone()), "gauge");

        let metrics = Self {
            queue_depth: int_gauges(
                "oqp_queue_depth",
                "Current number of requests waiting in queue",
                &["tier"],
            ),
            queue_processed: counters(
                "oqp_queue_processed_total",
                "Total requests dispatched from queue",
                &["tier"],
            ),
            queue_rejected: counters(
                "oqp_queue_rejected_total",
                "Requests rejected due to full queue",
                &["tier"],
            ),
            queue_expired: counters(
                "oqp_queue_expired_total",
                "Requests dropped due to max_wait timeout",
                &["tier"],
            ),
            queue_cancelled: counters(
                "oqp_queue_cancelled_total",
                "Requests removed from the queue because their client went away",
                &["tier"],
            ),
            queue_promoted: counters(
                "oqp_queue_promoted_total",
                "Requests promoted out of this tier into the one above (aging)",
                &["tier"],
            ),
            queue_flushed: counters(
                "oqp_queue_flushed_total",
                "Requests dropped from the queue by a flush",
                &["tier"],
            ),
            queued_bytes: int_gauge("oqp_queued_bytes", "Request body bytes waiting in queue"),
            queue_wait: histograms(
                "oqp_queue_wait_seconds",
                "Time from admission to dispatch of dispatched requests",
                &WAIT_BUCKETS,
            ),
            concurrency_active: int_gauge(
                "oqp_concurrency_active",
                "Current active upstream requests (host slots in use)",
            ),
            host_healthy: int_gauges(
                "oqp_host_healthy",
                "Whether the host answered its last poll and no request found it down since (1) or not (0)",
                &["name"],
            ),
            host_requests: counters(
                "oqp_host_requests_total",
                "Requests the host answered (any HTTP status)",
                &["name"],
            ),
            host_failures: counters(
                "oqp_host_failures_total",
                "Requests the host failed before answering (connect error or timeout)",
                &["name"],
            ),
            host_errors: counters(
                "oqp_host_errors_total",
                "Requests the host answered with an error: an error status (where=status) or an error inside a 200 stream (where=in_band: Ollama's and llama-server's mid-stream errors)",
                &["name", "where"],
            ),
            host_slots_in_use: int_gauges(
                "oqp_host_slots_in_use",
                "Upstream slots of the host in use",
                &["name"],
            ),
            runner_slots: int_gauges(
                "oqp_runner_slots",
                "Slots of a model runner on the host (num_parallel, or 1 where Ollama forces it): resident runners and those with requests in flight",
                &["host", "model"],
            ),
            runner_in_flight: int_gauges(
                "oqp_runner_in_flight",
                "Requests in flight on a model runner of the host",
                &["host", "model"],
            ),
            ollama_queued_estimate: int_gauge(
                "oqp_ollama_queued_estimate",
                "Requests oqp knows are waiting inside Ollama (sent beyond a runner's or a host's slots); 0 when every runner is sent only what it runs",
            ),
            host_models_installed: int_gauges(
                "oqp_host_models_installed",
                "Models installed on the host (/api/tags)",
                &["host"],
            ),
            host_info: int_gauges(
                "oqp_host_info",
                "Always 1: how the host is sent to (kind: ollama, cloud, openai) and what answered its last poll (engine: ollama, llama-server, openai, or empty)",
                &["name", "kind", "engine"],
            ),
            host_engine_slots: int_gauges(
                "oqp_host_engine_slots",
                "Slots the host's engine reported (llama-server's /props total_slots); absent when not learned",
                &["name"],
            ),
            host_models_loaded: int_gauges(
                "oqp_host_models_loaded",
                "Models loaded in memory on the host (/api/ps)",
                &["host"],
            ),
            upstream_ttfb: histograms(
                "oqp_upstream_ttfb_seconds",
                "Time from dispatch to the upstream's response headers",
                &TTFB_BUCKETS,
            ),
            failovers: counter(
                "oqp_failovers_total",
                "Requests retried on another host after a host failed before the first byte",
            ),
            request_log_dropped: counter(
                "oqp_request_log_dropped_total",
                "Request log lines dropped because the writer was behind (logging.requests)",
            ),
            request_log_failures: counter(
                "oqp_request_log_failures_total",
                "Request log lines that could not be written (a full disk, a path that cannot \
                 be written)",
            ),
            forwarded: counters(
                "oqp_forwarded_total",
                "Requests forwarded to the data plane that owns the chosen host",
                &["node"],
            ),
            hop_added: histogram(
                "oqp_hop_added_seconds",
                "Time a forwarded request's answer head took beyond the owner's own time (the hop's cost)",
                &HOP_BUCKETS,
            ),
            client_inflight: int_gauges(
                "oqp_client_inflight",
                "Client's requests in flight upstream",
                &["client_id"],
            ),
            client_cap_waiting: int_gauges(
                "oqp_client_cap_waiting",
                "Client's requests waiting in queue",
                &["client_id"],
            ),
            client_recent_share: recent_share,
            client_gpu_seconds: {
                let vec = CounterVec::new(
                    Opts::new(
                        "oqp_client_gpu_seconds_total",
                        "GPU time of a client's requests (Ollama's total_duration; the slot's \
                         hold time when it gave none), by model",
                    ),
                    &["client", "model"],
                )
                .expect("valid metric");
                add(Box::new(vec.clone()), "counter");
                vec
            },
            client_tokens: counters(
                "oqp_client_tokens_total",
                "Tokens of a client's requests, by model and kind (prompt, completion)",
                &["client", "model", "kind"],
            ),
            rate_limited: counters(
                "oqp_rate_limited_total",
                "Requests refused for a per-minute limit (rate_limit), by client (an app's \
                 users under the app)",
                &["client"],
            ),
            cache_hits: counters(
                "oqp_embedding_cache_hits_total",
                "Embedding requests answered from the cache",
                &["client", "model", "endpoint"],
            ),
            cache_misses: counters(
                "oqp_embedding_cache_misses_total",
                "Embedding requests not found in the cache",
                &["client", "model", "endpoint"],
            ),
            cache_errors: counters(
                "oqp_embedding_cache_errors_total",
                "Embedding cache backend errors",
                &["kind"],
            ),
            cache_partial: counters(
                "oqp_embedding_cache_partial_total",
                "Embedding requests partly answered from the cache (only the misses went upstream)",
                &["client", "model", "endpoint"],
            ),
            cache_bytes: int_gauge(
                "oqp_embedding_cache_bytes",
                "Bytes of vectors the embedding cache has stored since start",
            ),
            cache_errors_seen: std::sync::atomic::AtomicU64::new(0),
            cloud_keys_cooling: int_gauges(
                "oqp_cloud_keys_cooling",
                "Ollama Cloud pool keys out of rotation (account cooling down or key disabled)",
                &["host"],
            ),
            cloud_balance_usd,
            cloud_remaining_ratio,
            routing_decisions: counters(
                "oqp_routing_decisions_total",
                "Host choices, by reason",
                &["reason"],
            ),
            affinity: {
                let family = counters(
                    "oqp_affinity_total",
                    "Placements of conversations by prompt-cache affinity: hit (placed where its prompt is cached), miss (a follow-up cached nowhere), spill (sent elsewhere: its host was too busy), new (a first turn)",
                    &["result"],
                );
                Outcome::ALL.map(|outcome| family.with_label_values(&[outcome.as_str()]))
            },
            model_switches: counters(
                "oqp_model_switches_total",
                "Switches of a host's VRAM from one model to another decided by the swap rule",
                &["host"],
            ),
            model_load_seconds,
            swap_deferral: histogram(
                "oqp_swap_deferral_seconds",
                "Time a request was held back for its model by the swap rule, at its dispatch",
                &WAIT_BUCKETS,
            ),
            snapshot_version: int_gauge(
                "oqp_snapshot_version",
                "Version of the policy snapshot in force",
            ),
            snapshot_rejected: counter(
                "oqp_snapshot_rejected_total",
                "Policy snapshots rejected because they did not compile",
            ),
            uptime: int_gauge("oqp_uptime_seconds", "Seconds since the data plane started"),
            families: families.take(),
            registry,
            scrape: Mutex::new(()),
            configured: ArcSwap::from_pointee(HashSet::new()),
            hosted_models: ArcSwap::from_pointee(HashSet::new()),
            hosted_labels: RwLock::default(),
            usage_series: RwLock::default(),
            clients: Budget::default(),
            models: Budget::default(),
            endpoints: Budget::default(),
            kinds: Budget::default(),
            reasons: Budget::default(),
        };
        // Known values start at zero, so that rate() sees the first one.
        for reason in ["model_match", "round_robin", "fallback"] {
            let _ = metrics
                .routing_decisions
                .get_metric_with_label_values(&[reason]);
        }
        for tier in Tier::ALL {
            let _ = metrics
                .queue_wait
                .get_metric_with_label_values(&[tier.as_str()]);
            let _ = metrics
                .upstream_ttfb
                .get_metric_with_label_values(&[tier.as_str()]);
        }
        let _ = metrics
            .cache_errors
            .get_metric_with_label_values(&["backend"]);
        metrics.apply(policy);
        metrics
    }

    /// Follows a new snapshot: its clients keep their own label values.
    pub fn apply(&self, policy: &Policy) {
        // Held to the end: a usage series resolved meanwhile would follow the old snapshot.
        let mut usage_series = self
            .usage_series
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.configured
            .store(Arc::new(policy.clients_by_id.keys().cloned().collect()));
        let hosted = policy
            .hosts
            .iter()
            .flat_map(|host| host.installed.iter().chain(&host.loaded))
            .cloned()
            .collect::<HashSet<String>>();
        if let Ok(mut labels) = self.hosted_labels.write() {
            labels.retain(|model, _| hosted.contains(model));
        }
        self.hosted_models.store(Arc::new(hosted));
        *usage_series = UsageCache::default();
    }

    /// A dispatched request waited `waited` in `tier`.
    pub fn observe_wait(&self, tier: Tier, waited: Duration) {
        if let Ok(histogram) = self
            .queue_wait
            .get_metric_with_label_values(&[tier.as_str()])
        {
            histogram.observe(waited.as_secs_f64());
        }
    }

    /// A dispatched request of `tier` got its response headers `ttfb` after
    /// dispatch.
    pub fn observe_ttfb(&self, tier: Tier, ttfb: Duration) {
        if let Ok(histogram) = self
            .upstream_ttfb
            .get_metric_with_label_values(&[tier.as_str()])
        {
            histogram.observe(ttfb.as_secs_f64());
        }
    }

    /// A request moved to another host after a failure before the first byte.
    pub fn failover(&self) {
        self.failovers.inc();
    }

    /// A request log line was dropped: the writer was behind.
    pub fn request_log_dropped(&self) {
        self.request_log_dropped.inc();
    }

    /// A request log line could not be written.
    pub fn request_log_failed(&self) {
        self.request_log_failures.inc();
    }

    /// Request log lines dropped and lines that failed to be written, since start.
    pub fn request_log_counts(&self) -> (u64, u64) {
        (
            self.request_log_dropped.get(),
            self.request_log_failures.get(),
        )
    }

    /// A request of `client` was refused for a per-minute limit.
    pub fn rate_limited(&self, client: &str) {
        let client = self.client_label(client);
        if let Ok(counter) = self.rate_limited.get_metric_with_label_values(&[client]) {
            counter.inc();
        }
    }

    /// A request was forwarded to `node` (a node the config lists: the label is bounded).
    pub fn forwarded(&self, node: &str) {
        if let Ok(counter) = self.forwarded.get_metric_with_label_values(&[node]) {
            counter.inc();
        }
    }

    /// A forwarded request's answer head came `added` later than the owner's own time.
    pub fn observe_hop_added(&self, added: Duration) {
        self.hop_added.observe(added.as_secs_f64());
    }

    /// Host `name` answered a request (any status).
    pub fn host_request(&self, name: &str) {
        if let Ok(counter) = self.host_requests.get_metric_with_label_values(&[name]) {
            counter.inc();
        }
    }

    /// Host `name` failed a request before answering.
    pub fn host_failure(&self, name: &str) {
        if let Ok(counter) = self.host_failures.get_metric_with_label_values(&[name]) {
            counter.inc();
        }
    }

    /// Host `name` answered a request with an error: an error status (`status`) or an
    /// error inside a 200 stream (`in_band`).
    pub fn host_error(&self, name: &str, place: &str) {
        if let Ok(counter) = self
            .host_errors
            .get_metric_with_label_values(&[name, place])
        {
            counter.inc();
        }
    }

    /// Requests host `name` answered with an error (either kind) since start.
    pub fn host_errors(&self, name: &str) -> u64 {
        ["status", "in_band"]
            .into_iter()
            .filter_map(|place| {
                self.host_errors
                    .get_metric_with_label_values(&[name, place])
                    .ok()
            })
            .map(|counter| counter.get())
            .sum()
    }

    /// Requests host `name` answered and failed since start.
    pub fn host_counts(&self, name: &str) -> (u64, u64) {
        let read = |vec: &IntCounterVec| {
            vec.get_metric_with_label_values(&[name])
                .map_or(0, |counter| counter.get())
        };
        (read(&self.host_requests), read(&self.host_failures))
    }

    /// The embedding cache answered a request of `client` for `model` on
    /// `endpoint` (the request path, e.g. `/api/embed`). Called by the cache.
    pub fn cache_hit(&self, client: &str, model: &str, endpoint: &str) {
        self.cache_count(&self.cache_hits, client, model, endpoint);
    }

    /// The embedding cache held part of the answer.
    pub fn cache_partial(&self, client: &str, model: &str, endpoint: &str) {
        self.cache_count(&self.cache_partial, client, model, endpoint);
    }

    /// The embedding cache did not hold the answer. Called by the cache.
    pub fn cache_miss(&self, client: &str, model: &str, endpoint: &str) {
        self.cache_count(&self.cache_misses, client, model, endpoint);
    }

    /// The embedding cache backend failed with an error of `kind` (e.g.
    /// `connect`, `timeout`). Called by the cache.
    pub fn cache_error(&self, kind: &str) {
        let kind = self.kinds.admit(kind);
        if let Ok(counter) = self.cache_errors.get_metric_with_label_values(&[kind]) {
            counter.inc();
        }
    }

    /// The router chose a host for `reason` (`model_match`, `round_robin`,
    /// `fallback`, …). Called by the router.
    pub fn routing_decision(&self, reason: &str) {
        let reason = self.reasons.admit(reason);
        if let Ok(counter) = self
            .routing_decisions
            .get_metric_with_label_values(&[reason])
        {
            counter.inc();
        }
    }

    /// A conversation was placed with `outcome`.
    pub fn affinity(&self, outcome: Outcome) {
        let index = Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or(0);
        self.affinity[index].inc();
    }

    /// A request held back by the swap rule was dispatched after `held`.
    pub fn observe_swap_deferral(&self, held: Duration) {
        self.swap_deferral.observe(held.as_secs_f64());
    }

    /// A request that started loading `model` on `host` reported `load` (`load_duration`).
    /// Hosts are configured and models bounded as elsewhere.
    pub fn model_load(&self, host: &str, model: &str, load: Duration) {
        let model = self.model_label(model);
        if let Ok(counter) = self
            .model_load_seconds
            .get_metric_with_label_values(&[host, &model])
        {
            counter.inc_by(load.as_secs_f64());
        }
    }

    /// A request of `client` for `model` ended upstream, having used `gpu` of GPU time and
    /// these tokens. Called by the usage ledger ([`crate::usage`]), which keeps its rows
    /// under the labels returned here: the client's, and the model's when a host lists it,
    /// else [`OTHER`] (the usage files keep 90 days of rows: a name a client made up must
    /// not take a row in them).
    pub fn usage(
        &self,
        client: &str,
        model: &str,
        gpu: Duration,
        prompt: u64,
        completion: u64,
    ) -> (Arc<str>, Arc<str>) {
        let count = |series: &UsageSeries| {
            if let Some(counter) = &series.gpu_seconds {
                counter.inc_by(gpu.as_secs_f64());
            }
            if let Some(counter) = &series.prompt_tokens {
                counter.inc_by(prompt);
            }
            if let Some(counter) = &series.completion_tokens {
                counter.inc_by(completion);
            }
            (series.row_client.clone(), series.row_model.clone())
        };
        let full = match self.usage_series.read() {
            Ok(cache) => match cache.get(client, model) {
                Some(series) => return count(series),
                None => cache.len >= MAX_USAGE_SERIES,
            },
            Err(_) => true,
        };
        if full {
            return count(&self.usage_series_of(client, model));
        }
        // Resolved under the write lock, so that `apply` cannot change the labels between
        // the resolving and the keeping.
        let Ok(mut cache) = self.usage_series.write() else {
            return count(&self.usage_series_of(client, model));
        };
        if let Some(series) = cache.get(client, model) {
            return count(series);
        }
        let series = self.usage_series_of(client, model);
        let counted = count(&series);
        if cache.len < MAX_USAGE_SERIES {
            cache.len += 1;
            cache
                .by_client
                .entry(client.into())
                .or_default()
                .insert(model.into(), series);
        }
        counted
    }

    /// The labels and series of `client`'s usage of `model`: the client's label, and the
    /// model's when a host lists it, else [`OTHER`] in the ledger (its own metric label
    /// while the budget has room).
    fn usage_series_of(&self, client: &str, model: &str) -> UsageSeries {
        let row_client = self.ledger_client(client);
        let client = self.client_label(client);
        let (model, hosted) = if model.is_empty() {
            (Cow::Borrowed(""), true)
        } else {
            match self.hosted_label(model) {
                Some(label) => (label, true),
                None => (Cow::Borrowed(self.unlisted_label(model)), false),
            }
        };
        let tokens = |kind: &str| {
            self.client_tokens
                .get_metric_with_label_values(&[client, &model, kind])
                .ok()
        };
        UsageSeries {
            row_client: row_client.into(),
            row_model: if hosted { model.as_ref() } else { OTHER }.into(),
            gpu_seconds: self
                .client_gpu_seconds
                .get_metric_with_label_values(&[client, &model])
                .ok(),
            prompt_tokens: tokens("prompt"),
            completion_tokens: tokens("completion"),
        }
    }

    /// The client a usage row is kept under: a user of a configured app keeps its own id
    /// (its budget and `oqpctl usage` are per user); anyone else its metric label.
    fn ledger_client<'a>(&self, client: &'a str) -> &'a str {
        match client.split_once('/') {
            Some((app, _)) if self.configured.load().contains(app) => client,
            _ => self.client_label(client),
        }
    }

    /// Dispatched requests of `tier` observed so far, and their summed wait
    /// in seconds (the dashboard's wait chart divides the differences).
    pub fn wait_totals(&self, tier: Tier) -> (u64, f64) {
        self.queue_wait
            .get_metric_with_label_values(&[tier.as_str()])
            .map_or((0, 0.0), |h| (h.get_sample_count(), h.get_sample_sum()))
    }

    fn cache_count(&self, vec: &IntCounterVec, client: &str, model: &str, endpoint: &str) {
        let client = self.client_label(client);
        let model = self.model_label(model);
        let endpoint = self.endpoints.admit(endpoint);
        if let Ok(counter) = vec.get_metric_with_label_values(&[client, &model, endpoint]) {
            counter.inc();
        }
    }

    /// A model the hosts list keeps its own label (one per model, whatever the spelling, so
    /// they stay bounded by the inventory); any other name takes a place in the budget.
    fn model_label<'a>(&self, model: &'a str) -> Cow<'a, str> {
        self.hosted_label(model)
            .unwrap_or_else(|| Cow::Borrowed(self.unlisted_label(model)))
    }

    /// A model no host lists: its own label while the budget has room and the name is
    /// not over [`MAX_MODEL_LABEL_BYTES`], else [`OTHER`].
    fn unlisted_label<'a>(&self, model: &'a str) -> &'a str {
        if model.len() > MAX_MODEL_LABEL_BYTES {
            OTHER
        } else {
            self.models.admit(model)
        }
    }

    /// The label of a model a host lists (one per model, whatever the spelling); `None`
    /// for any other name, or one over [`MAX_MODEL_LABEL_BYTES`].
    fn hosted_label<'a>(&self, model: &'a str) -> Option<Cow<'a, str>> {
        if model.len() > MAX_MODEL_LABEL_BYTES {
            return None;
        }
        let hosted = self.hosted_models.load();
        let mut key = crate::policy::normalize_model(model);
        if !hosted.contains(&key) {
            key = crate::policy::normalize_model(crate::router::strip_cloud_suffix(model));
            if !hosted.contains(&key) {
                return None;
            }
        }
        if let Some(label) = self
            .hosted_labels
            .read()
            .ok()
            .and_then(|labels| labels.get(&key).cloned())
        {
            return Some(Cow::Owned(label.to_string()));
        }
        Some(match self.hosted_labels.write() {
            Ok(mut labels) => Cow::Owned(
                labels
                    .entry(key)
                    .or_insert_with(|| model.into())
                    .to_string(),
            ),
            Err(_) => Cow::Borrowed(model),
        })
    }

    /// A configured client's own label; an unconfigured one's while the budget has room,
    /// else [`OTHER`], except that a user of a configured app (`<client_id>/<user>`) past
    /// the budget is counted under its app: a thousand users of one key add at most the
    /// budget's series, and their usage still shows under the app.
    fn client_label<'a>(&self, client: &'a str) -> &'a str {
        let configured = self.configured.load();
        if configured.contains(client) {
            return client;
        }
        let label = self.clients.admit(client);
        match client.split_once('/') {
            Some((app, _)) if label == OTHER && configured.contains(app) => app,
            _ => label,
        }
    }

    /// Refreshes the mirrors from `sources` and encodes every metric.
    pub fn scrape(&self, sources: &Sources<'_>) -> String {
        let _serial = self.scrape.lock().unwrap_or_else(|p| p.into_inner());
        let policy = sources.store.load();
        let stats = sources.dispatcher.stats();

        for (tier, stat) in Tier::ALL.iter().zip(stats.tiers.iter()) {
            self.mirror_tier(*tier, stat);
        }
        self.queued_bytes
            .set(i64::try_from(stats.queued_bytes).unwrap_or(i64::MAX));
        let active: u32 = stats.slots.values().map(|stat| stat.slots_in_use).sum();
        self.concurrency_active.set(i64::from(active));
        if let Some(cache) = &sources.cache {
            let cache = cache.stats();
            self.cache_bytes
                .set(i64::try_from(cache.bytes_stored).unwrap_or(i64::MAX));
            // The cache counts its own backend errors; mirror the growth.
            let before = self
                .cache_errors_seen
                .swap(cache.errors, std::sync::atomic::Ordering::Relaxed);
            if cache.errors > before
                && let Ok(counter) = self.cache_errors.get_metric_with_label_values(&["backend"])
            {
                counter.inc_by(cache.errors - before);
            }
        }
        self.cloud_keys_cooling.reset();
        for host in &policy.hosts {
            if let Some(pool) = sources.cloud.get(&host.name) {
                let cooling = pool
                    .snapshot()
                    .iter()
                    .filter(|key| key.cooldown_until.is_some())
                    .count();
                set(&self.cloud_keys_cooling, &host.name, count(cooling));
            }
        }
        self.cloud_balance_usd.reset();
        self.cloud_remaining_ratio.reset();
        for host in &policy.hosts {
            let Some(pool) = sources.cloud.get(&host.name) else {
                continue;
            };
            for account in pool.account_status() {
                let label = account.account.as_str();
                if let (Some(included), Some(extra)) = (account.included_usd, account.extra_usd) {
                    self.cloud_balance_usd
                        .with_label_values(&[label])
                        .set(included + extra);
                }
                if let (Some(included), Some(allowance)) =
                    (account.included_usd, account.allowance_usd)
                    && allowance > 0.0
                {
                    self.cloud_remaining_ratio
                        .with_label_values(&[label, "monthly"])
                        .set((included / allowance).clamp(0.0, 1.0));
                }
                for (window, left) in [("session", &account.session), ("weekly", &account.weekly)] {
                    if let Some(left) = left {
                        self.cloud_remaining_ratio
                            .with_label_values(&[label, window])
                            .set(left.remaining_percent / 100.0);
                    }
                }
            }
        }

        for vec in [
            &self.host_healthy,
            &self.host_slots_in_use,
            &self.host_models_installed,
            &self.host_models_loaded,
            &self.host_info,
            &self.host_engine_slots,
            &self.runner_slots,
            &self.runner_in_flight,
        ] {
            vec.reset();
        }
        let mut inside_ollama: u64 = 0;
        for stat in stats.slots.values() {
            inside_ollama += u64::from(stat.slots_in_use.saturating_sub(stat.max_concurrent));
            // Labels bounded by the host's own inventory: the resident runners and those
            // with requests in flight.
            for runner in &stat.runners {
                let labels = [&*stat.name, runner.model.as_str()];
                if let Ok(gauge) = self.runner_slots.get_metric_with_label_values(&labels) {
                    gauge.set(i64::from(runner.slots.min(i32::MAX as u32)));
                }
                if let Ok(gauge) = self.runner_in_flight.get_metric_with_label_values(&labels) {
                    gauge.set(i64::from(runner.in_flight));
                }
                inside_ollama += u64::from(runner.in_flight.saturating_sub(runner.slots));
            }
        }
        self.ollama_queued_estimate
            .set(i64::try_from(inside_ollama).unwrap_or(i64::MAX));
        for host in &policy.hosts {
            let name: &str = &host.name;
            let healthy = is_healthy(host, &stats);
            set(&self.host_healthy, name, i64::from(healthy));
            let slots = stats
                .slots
                .get(&host.name)
                .map_or(0, |stat| stat.slots_in_use);
            set(&self.host_slots_in_use, name, i64::from(slots));
            set(
                &self.host_models_installed,
                name,
                count(host.installed.len()),
            );
            set(&self.host_models_loaded, name, count(host.loaded.len()));
            let engine = host.engine.detected.as_deref().unwrap_or_default();
            if let Ok(gauge) =
                (self.host_info).get_metric_with_label_values(&[name, host.kind.as_str(), engine])
            {
                gauge.set(1);
            }
            if let Some(slots) = host.engine.learned_slots {
                set(&self.host_engine_slots, name, i64::from(slots));
            }
            // Every host has its request and failure series, zero at first.
            let _ = self.host_counts(name);
        }

        for stat in sources.dispatcher.swap_stats() {
            if let Ok(counter) = self
                .model_switches
                .get_metric_with_label_values(&[&stat.host])
            {
                catch_up(&counter, stat.switches);
            }
        }

        self.client_inflight.reset();
        self.client_cap_waiting.reset();
        self.client_recent_share.reset();
        for (_, stat) in bounded_clients(&policy, stats.clients) {
            let id: &str = &stat.client;
            set(&self.client_inflight, id, i64::from(stat.inflight));
            set(&self.client_cap_waiting, id, i64::from(stat.waiting));
            if let Ok(gauge) = self.client_recent_share.get_metric_with_label_values(&[id]) {
                gauge.set(stat.recent_share);
            }
        }

        self.snapshot_version
            .set(i64::try_from(policy.version).unwrap_or(i64::MAX));
        catch_up(&self.snapshot_rejected, sources.store.rejected_total());
        self.uptime
            .set(i64::try_from(sources.started.elapsed().as_secs()).unwrap_or(i64::MAX));

        let gathered = self.registry.gather();
        let mut text = String::new();
        if let Err(error) = TextEncoder::new().encode_utf8(&gathered, &mut text) {
            tracing::warn!(%error, "metrics could not be encoded");
        }
        // The registry leaves out families without series: declare them.
        for family in &self.families {
            if !gathered.iter().any(|mf| mf.name() == family.name) {
                let help = family.help.replace('\\', "\\\\").replace('\n', "\\n");
                text.push_str(&format!(
                    "# HELP {} {help}\n# TYPE {} {}\n",
                    family.name, family.name, family.kind
                ));
            }
        }
        text
    }

    /// The name of every registered family (each is on `/metrics` from the
    /// first scrape).
    pub fn families(&self) -> impl Iterator<Item = &str> {
        self.families.iter().map(|family| family.name.as_str())
    }

    fn mirror_tier(&self, tier: Tier, stat: &TierStat) {
        let label = [tier.as_str()];
        if let Ok(gauge) = self.queue_depth.get_metric_with_label_values(&label) {
            gauge.set(i64::from(stat.depth));
        }
        for (vec, value) in [
            (&self.queue_processed, stat.processed),
            (&self.queue_rejected, stat.rejected),
            (&self.queue_expired, stat.expired),
            (&self.queue_cancelled, stat.cancelled),
            (&self.queue_promoted, stat.promoted),
            (&self.queue_flushed, stat.flushed),
        ] {
            if let Ok(counter) = vec.get_metric_with_label_values(&label) {
                catch_up(&counter, value);
            }
        }
    }
}

/// The `/metrics` response. With `visible` (a key with a model allowlist), only the series
/// whose `model` label is a model it may use, and those with no `model` label
/// ([`scope_models`]).
pub fn response(
    metrics: &Metrics,
    sources: &Sources<'_>,
    visible: Option<&dyn Fn(&str) -> bool>,
) -> Response<Body> {
    let mut text = metrics.scrape(sources);
    if let Some(visible) = visible {
        text = scope_models(&text, visible);
    }
    let mut response = Response::new(body::full(text));
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
    response
}

/// `text` (the exposition format) without the samples whose `model` label `visible`
/// refuses (`(other)` included: it sums models the caller may not use). Comments and
/// samples without a `model` label are kept.
pub fn scope_models(text: &str, visible: &dyn Fn(&str) -> bool) -> String {
    let mut scoped = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        let hidden =
            !line.starts_with('#') && model_label(line).is_some_and(|model| !visible(&model));
        if !hidden {
            scoped.push_str(line);
        }
    }
    scoped
}

/// The value of a sample line's `model` label, unescaped; `None` without one.
fn model_label(line: &str) -> Option<String> {
    let open = line.find('{')?;
    let mut rest = &line[open + 1..];
    loop {
        let rest_trimmed = rest.trim_start_matches([',', ' ']);
        let (name, after) = rest_trimmed.split_once("=\"")?;
        // The value up to its closing quote, escapes read (`\\`, `\"`, `\n`).
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            let (at, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break at,
                c => value.push(c),
            }
        };
        if name == "model" {
            return Some(value);
        }
        rest = &after[end + 1..];
        if rest.starts_with('}') {
            return None;
        }
    }
}

/// The clients status and metrics show: every configured client (with its
/// figures, zero if it never called), then at most [`MAX_OTHER_LABELS`]
/// unconfigured ones, busiest first. A client id never repeats.
pub(crate) fn bounded_clients(
    policy: &Policy,
    stats: Vec<ClientStat>,
) -> Vec<(Option<Arc<Client>>, ClientStat)> {
    let mut configured: BTreeMap<&str, (Arc<Client>, Option<ClientStat>)> = policy
        .clients_by_id
        .iter()
        .map(|(id, client)| (&**id, (client.clone(), None)))
        .collect();
    let mut others = Vec::new();
    for stat in stats {
        match configured.get_mut(&*stat.client) {
            Some((_, slot)) => *slot = Some(stat),
            None => others.push(stat),
        }
    }
    others.sort_by(|a, b| {
        (b.waiting + b.inflight)
            .cmp(&(a.waiting + a.inflight))
            .then(b.processed.cmp(&a.processed))
            .then(a.client.cmp(&b.client))
    });
    others.truncate(MAX_OTHER_LABELS);
    let mut clients: Vec<(Option<Arc<Client>>, ClientStat)> = configured
        .into_values()
        .map(|(client, stat)| {
            let stat = stat.unwrap_or_else(|| ClientStat {
                client: client.id.clone(),
                weight: client.weight,
                waiting: 0,
                inflight: 0,
                processed: 0,
                rejected: 0,
                recent_share: 0.0,
                switch_charged: std::time::Duration::ZERO,
            });
            (Some(client), stat)
        })
        .collect();
    clients.extend(others.into_iter().map(|stat| (None, stat)));
    clients
}

/// Whether `host` answered its last poll and no request found it down since.
pub(crate) fn is_healthy(host: &Host, stats: &QueueReport) -> bool {
    host.healthy
        && !stats
            .slots
            .get(&host.name)
            .is_some_and(|stat| stat.marked_down)
}

/// Advances a mirrored counter to `value` (the source only grows; scrapes
/// are serialised, so the difference is added once).
fn catch_up(counter: &IntCounter, value: u64) {
    let current = counter.get();
    if value > current {
        counter.inc_by(value - current);
    }
}

fn set(vec: &IntGaugeVec, label: &str, value: i64) {
    if let Ok(gauge) = vec.get_metric_with_label_values(&[label]) {
        gauge.set(value);
    }
}

fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_bound_label_values() {
        let budget = Budget::default();
        for i in 0..MAX_OTHER_LABELS {
            let value = format!("client-{i}");
            assert_eq!(budget.admit(&value), value);
        }
        assert_eq!(budget.admit("one-too-many"), OTHER);
        assert_eq!(budget.admit("client-7"), "client-7", "known values stay");
    }

    #[test]
    fn models_the_hosts_list_keep_their_label_when_the_budget_is_full() {
        let mut snapshot = crate::policy::minimal_wire();
        snapshot.hosts[0].installed_models = vec!["nomic-embed-text:latest".into()];
        snapshot.hosts[0].loaded_models = vec!["llama3".into()];
        let policy = Policy::try_from(snapshot).unwrap();
        let metrics = Metrics::new(&policy);
        for i in 0..MAX_OTHER_LABELS {
            let junk = format!("made-up-{i}");
            assert_eq!(metrics.model_label(&junk), junk.as_str());
        }
        assert_eq!(metrics.model_label("made-up-again"), OTHER);
        assert_eq!(metrics.model_label("nomic-embed-text"), "nomic-embed-text");
        // Another spelling of the same model shares its label.
        assert_eq!(
            metrics.model_label("Nomic-Embed-Text:latest"),
            "nomic-embed-text"
        );
        assert_eq!(metrics.model_label("llama3:latest"), "llama3:latest");
    }

    #[test]
    fn usage_rows_keep_listed_models_only_and_labels_are_short() {
        let mut snapshot = crate::policy::minimal_wire();
        snapshot.hosts[0].installed_models = vec!["llama3:latest".into()];
        let policy = Policy::try_from(snapshot).unwrap();
        let metrics = Metrics::new(&policy);
        let row = |model: &str| {
            metrics
                .usage("chat", model, Duration::ZERO, 1, 1)
                .1
                .to_string()
        };
        assert_eq!(row("llama3"), "llama3");
        assert_eq!(row(""), "", "no model named");
        // A name no host lists: (other) in the rows, its own metric label while there is
        // room.
        assert_eq!(row("made-up"), OTHER);
        assert_eq!(metrics.model_label("made-up"), "made-up");
        // Too long a name is (other) everywhere, listed or not.
        let long = "m".repeat(MAX_MODEL_LABEL_BYTES + 1);
        assert_eq!(row(&long), OTHER);
        assert_eq!(metrics.model_label(&long), OTHER);
        let just = "m".repeat(MAX_MODEL_LABEL_BYTES);
        assert_eq!(metrics.model_label(&just), just.as_str());
    }

    #[test]
    fn usage_series_are_kept_until_the_next_snapshot() {
        let snapshot = crate::policy::minimal_wire();
        let metrics = Metrics::new(&Policy::try_from(snapshot.clone()).unwrap());
        let prompt = |model: &str| {
            metrics
                .client_tokens
                .get_metric_with_label_values(&["chat", model, "prompt"])
                .unwrap()
                .get()
        };
        let row = |model: &str| {
            let (client, model) = metrics.usage("chat", model, Duration::ZERO, 2, 1);
            (client.to_string(), model.to_string())
        };
        // No host lists it: (other) in the ledger, counted under its own label.
        assert_eq!(row("llama3"), ("chat".into(), OTHER.into()));
        assert_eq!(row("llama3"), ("chat".into(), OTHER.into()));
        assert_eq!(prompt("llama3"), 4);
        // A snapshot in which a host lists it: its own row from then on.
        let mut listed = snapshot;
        listed.hosts[0].installed_models = vec!["llama3:latest".into()];
        metrics.apply(&Policy::try_from(listed).unwrap());
        assert_eq!(row("llama3"), ("chat".into(), "llama3".into()));
        assert_eq!(prompt("llama3"), 6, "the same series");
    }

    #[test]
    fn mirrored_counters_only_move_forward() {
        let counter = IntCounter::new("c_total", "c").unwrap();
        catch_up(&counter, 5);
        catch_up(&counter, 3);
        catch_up(&counter, 8);
        assert_eq!(counter.get(), 8);
    }

    #[test]
    fn a_scoped_scrape_keeps_only_the_visible_models_series() {
        let text = "# HELP oqp_runner_slots Slots\n\
                    # TYPE oqp_runner_slots gauge\n\
                    oqp_runner_slots{host=\"gpu\",model=\"llama3:8b\"} 1\n\
                    oqp_runner_slots{host=\"gpu\",model=\"qwen:latest\"} 4\n\
                    oqp_client_tokens_total{client=\"a\\\"b\",model=\"qwen\",kind=\"prompt\"} 3\n\
                    oqp_client_tokens_total{client=\"x\",model=\"(other)\",kind=\"prompt\"} 3\n\
                    oqp_client_tokens_total{client=\"model=\\\"llama3\\\"\",model=\"q\\\\x\",kind=\"p\"} 1\n\
                    oqp_concurrency_active 2\n\
                    oqp_host_healthy{name=\"gpu\"} 1\n";
        let scoped = scope_models(text, &|model| model.starts_with("llama3"));
        assert_eq!(
            scoped,
            "# HELP oqp_runner_slots Slots\n\
             # TYPE oqp_runner_slots gauge\n\
             oqp_runner_slots{host=\"gpu\",model=\"llama3:8b\"} 1\n\
             oqp_concurrency_active 2\n\
             oqp_host_healthy{name=\"gpu\"} 1\n"
        );
        assert_eq!(
            model_label("m{client=\"model=\\\"llama3\\\"\",model=\"q\\\\x\"} 1"),
            Some("q\\x".to_owned()),
            "a label value that looks like the model label is not it"
        );
    }
}
