//! Start-up and shutdown of a data plane: dial the control plane, wait for
//! the first good snapshot, bind, serve, and report.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use oqp_proto::policy::v1::{self as wire, NodeReport};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::app::App;
use crate::auth::ListenerKind;
use crate::cache::Cache;
use crate::control::{self, ControlError, ControlLink, ControlOptions, Watcher};
use crate::policy::{LogLevel, Policy};
use crate::scheduler::Tier;
use crate::server;
use crate::snapshot::PolicyStore;
use crate::supervise;

/// How to start a data plane.
#[derive(Debug)]
pub struct Options {
    /// The control plane to follow.
    pub control: ControlOptions,
    /// A listener to serve on instead of binding the snapshot's address
    /// (tests bind port 0 themselves).
    pub listener: Option<TcpListener>,
    /// How often status is reported.
    pub report_interval: Duration,
    /// Called with the snapshot's log level at start and whenever a new
    /// snapshot changes it.
    pub log_level: Option<LogLevelHook>,
}

/// What a binary does with the config's `logging.level` (reload its log
/// filter); the library installs no subscriber itself.
pub struct LogLevelHook(Box<dyn Fn(LogLevel) + Send + Sync>);

impl LogLevelHook {
    /// A hook that calls `apply`.
    pub fn new(apply: impl Fn(LogLevel) + Send + Sync + 'static) -> Self {
        Self(Box::new(apply))
    }
}

impl std::fmt::Debug for LogLevelHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LogLevelHook")
    }
}

/// Whether a binary's text log may carry ANSI colour: only when it is written to a
/// terminal, and never when `NO_COLOR` is set to anything but an empty string
/// (<https://no-color.org>). Both binaries ask this before installing their subscriber,
/// so that a log redirected to a file or read by journald has no escape codes.
pub fn log_colour(is_terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    is_terminal && no_color.is_none_or(|value| value.is_empty())
}

/// [`log_colour`] for standard output, where the binaries write their log.
pub fn stdout_log_colour() -> bool {
    use std::io::IsTerminal;
    log_colour(
        std::io::stdout().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    )
}

/// Why a data plane could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The control plane is misconfigured or refused this node.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// The listen address could not be bound.
    #[error(transparent)]
    Bind(#[from] std::io::Error),
    /// The embedding cache's backend is unreachable at start.
    #[error(transparent)]
    Cache(#[from] crate::cache::CacheError),
    /// The main listener's TLS certificate or key cannot be used.
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
}

/// A running data plane.
#[derive(Debug)]
pub struct DataPlane {
    app: Arc<App>,
    addr: SocketAddr,
    shutdown: CancellationToken,
    tasks: JoinSet<()>,
    /// Stops the report loop, after serving has drained (so the usage of the requests
    /// that finished while draining is reported too).
    stop_reports: CancellationToken,
    /// The report loop (a set of one, so that dropping the data plane aborts it).
    reports: JoinSet<()>,
    /// Stops the watch, after the last reports: the control plane takes usage under this
    /// node's name only while its watch holds the name.
    stop_watch: CancellationToken,
    /// The watch (a set of one, as `reports`).
    watch: JoinSet<()>,
}

impl DataPlane {
    /// Dials the control plane, waits for the first snapshot that compiles,
    /// binds the main listener and starts serving.
    pub async fn start(options: Options) -> Result<Self, StartError> {
        let link = Arc::new(ControlLink::default());
        let (client, admin) = control::clients(&options.control)?;
        // The usage epoch, presented by the watch and carried by every usage batch.
        let started = std::time::SystemTime::now();
        let mut watcher = Watcher::new(
            client.clone(),
            &options.control.node,
            link.clone(),
            crate::usage::epoch_of(started),
        );
        let policy = loop {
            let snapshot = watcher.next(true).await?;
            let version = snapshot.version;
            match Policy::try_from(snapshot) {
                Ok(policy) => break policy,
                Err(error) => {
                    tracing::error!(version, %error, "first snapshot rejected; waiting for another")
                }
            }
        };
        tracing::info!(
            version = policy.version,
            "received the first policy snapshot"
        );
        crate::connections::raise_open_file_limit(policy.proxy.connections.max_connections);
        let listener = match options.listener {
            Some(listener) => listener,
            None => server::bind(policy.listen).await?,
        };
        let addr = listener.local_addr()?;
        let idle_timeout = policy.proxy.connections.idle_timeout;
        let store = Arc::new(PolicyStore::new(policy));
        let ca = match &options.control.ca_file {
            Some(path) => Some(std::fs::read(path).map_err(|e| {
                ControlError::Config(format!("cannot read CA file {}: {e}", path.display()))
            })?),
            None => None,
        };
        let peers = crate::peers::Peers::new(
            options.control.token.as_deref(),
            ca.as_deref(),
            idle_timeout,
        )
        .map_err(|e| ControlError::Config(format!("CA file: {e}")))?;
        let app = Arc::new(App::new(
            &options.control.node,
            peers,
            store.clone(),
            link,
            admin,
            started,
        ));
        let settings = &store.load().embedding_cache;
        if settings.enabled {
            // An unreachable shared cache at start is an error, not a silent
            // degradation; after start, backend errors are misses.
            let cache = crate::cache::connect(settings).await?;
            app.embedding_cache.store(Some(Arc::new(cache)));
        }
        // An unreadable or mismatched pair is a start-up error: the port never serves
        // plain HTTP in its place.
        let tls = match &store.load().proxy.tls {
            Some(files) => Some(app.tls.open(files)?),
            None => None,
        };
        let _ = app.listen_addr.set(addr);

        let shutdown = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let stop_watch = CancellationToken::new();
        let mut watch = JoinSet::new();
        watch.spawn(watcher.run(store.clone(), stop_watch.clone()));
        let reporter_app = app.clone();
        let peers = app.peers.clone();
        let usage = app.usage.clone();
        let settled_usage = app.usage.clone();
        let link = app.control.clone();
        let stop_reports = CancellationToken::new();
        let mut reports = JoinSet::new();
        reports.spawn(control::report_loop(
            client,
            store.clone(),
            options.report_interval,
            move || report(&reporter_app),
            move |ack| {
                usage.acked(&ack, std::time::SystemTime::now());
                link.acked(&ack);
                peers.update(ack.nodes);
            },
            move || settled_usage.settled(),
            stop_reports.clone(),
        ));
        tasks.spawn(app.dispatcher.clone().run_timer(shutdown.clone()));
        tasks.spawn(follow_policy(
            app.clone(),
            options.log_level,
            shutdown.clone(),
        ));
        let cache_app = app.clone();
        let cache_shutdown = shutdown.clone();
        tasks.spawn(async move {
            follow_cache(&cache_app.store, &cache_app.embedding_cache, cache_shutdown).await;
        });
        tasks.spawn(crate::listeners::run(app.clone(), shutdown.clone()));
        tasks.spawn(app.tls.clone().run(shutdown.clone()));
        let drain_app = app.clone();
        tasks.spawn(server::serve(
            listener,
            app.clone(),
            ListenerKind::Main,
            tls,
            shutdown.clone(),
            move || drain_app.store.load().proxy.drain_timeout,
        ));
        tracing::info!(%addr, node = %app.node, "data plane serving");
        Ok(Self {
            app,
            addr,
            shutdown,
            tasks,
            stop_reports,
            reports,
            stop_watch,
            watch,
        })
    }

    /// Where the main listener is bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The shared state, for inspection in tests.
    pub fn app(&self) -> &Arc<App> {
        &self.app
    }

    /// Stops accepting, lets in-flight requests finish (bounded by the drain
    /// timeout), stops the background tasks, then reports until all the usage recorded is
    /// acknowledged (bounded by [`control::FINAL_REPORT_TIMEOUT`]).
    pub async fn shutdown(mut self) {
        self.app.begin_shutdown();
        self.shutdown.cancel();
        while self.tasks.join_next().await.is_some() {}
        // A batch refused before gets one more try, now: the stop does not wait out its
        // backoff, and a batch refused again ends the last reports at once.
        self.app.usage.retry_now();
        self.stop_reports.cancel();
        while self.reports.join_next().await.is_some() {}
        self.stop_watch.cancel();
        while self.watch.join_next().await.is_some() {}
    }
}

/// Applies every new snapshot to the parts that keep state across
/// snapshots (the dispatcher, the cloud pools, the metrics' client labels,
/// the log level), each under its own guard ([`supervise`]), until
/// `shutdown`. The cache follows in [`follow_cache`].
async fn follow_policy(
    app: Arc<App>,
    log_level: Option<LogLevelHook>,
    shutdown: CancellationToken,
) {
    let mut changes = app.store.subscribe();
    let mut level = None;
    let mut follow_level = |policy: &Policy| {
        if let (Some(LogLevelHook(apply)), Some(wanted)) = (&log_level, policy.log_level)
            && level != Some(wanted)
        {
            // Remembered only once applied: a hook that failed is tried
            // again (and reported again) with the next snapshot.
            apply(wanted);
            level = Some(wanted);
        }
    };
    let store = &app.store;
    // The snapshot stored now is applied first, whole: one that arrived after the app was
    // built from an earlier one, and before the subscription above, brings no change to wait
    // for (a cloud balance read once would never reach the pools).
    let mut policy = store.load();
    loop {
        let version = policy.version;
        supervise::apply(store, "log level", version, || follow_level(&policy));
        supervise::apply(store, "dispatcher", version, || {
            app.dispatcher.apply(&policy);
        });
        supervise::apply(store, "cloud pools", version, || {
            app.cloud.update(&policy);
        });
        supervise::apply(store, "metrics", version, || app.metrics.apply(&policy));
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
        }
        // Each part under its own guard: one that fails does not keep the
        // others (nor the next snapshot, say a pause) from being applied.
        policy = store.load();
    }
}

/// Follows the snapshot's cache settings, in a task of its own: connecting
/// to a new backend can take `connect_timeout`, and the next snapshot (a
/// pause, a revocation) must not wait for it.
async fn follow_cache(
    store: &PolicyStore,
    cache: &ArcSwapOption<Cache>,
    shutdown: CancellationToken,
) {
    let mut changes = store.subscribe();
    // As in `follow_policy`: the snapshot stored now is applied first. One stored after the
    // cache was connected at start, and before the subscription above, brings no change to
    // wait for (its cache settings would wait for the next snapshot).
    let mut policy = store.load();
    loop {
        supervise::apply_async(
            store,
            "embedding cache",
            policy.version,
            reconnect_cache(cache, &policy),
        )
        .await;
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
        }
        policy = store.load();
    }
}

/// Replaces the embedding cache when its settings changed. A backend that
/// cannot be reached keeps the old cache (or none) and says why.
async fn reconnect_cache(cache: &ArcSwapOption<Cache>, policy: &Policy) -> Result<(), String> {
    let settings = &policy.embedding_cache;
    let same = cache
        .load()
        .as_ref()
        .is_some_and(|current| current.settings() == settings);
    if !settings.enabled {
        cache.store(None);
    } else if !same {
        // The error names the URL with its password hidden.
        let connected = crate::cache::connect(settings)
            .await
            .map_err(|error| error.to_string())?;
        cache.store(Some(Arc::new(connected)));
    }
    Ok(())
}

/// One host's model-swap state as the report carries it.
fn swap_report(stat: &crate::swap::SwapStat) -> wire::HostSwapReport {
    wire::HostSwapReport {
        resident: stat
            .resident
            .iter()
            .map(|(name, bytes)| wire::ModelSize {
                name: name.clone(),
                bytes: *bytes,
            })
            .collect(),
        capacity_bytes: stat.capacity.unwrap_or(0),
        capacity_learned: stat.capacity_learned,
        held: stat.held,
        oldest_held_ms: stat.oldest_held.map_or(0, |held| {
            u64::try_from(held.as_millis()).unwrap_or(u64::MAX)
        }),
        switching_to: stat.switching_to.clone().unwrap_or_default(),
        switches: stat.switches,
        bypassed: stat.bypassed,
        loads: stat.loads,
    }
}

/// This node's report for the control plane.
fn report(app: &App) -> NodeReport {
    let policy = app.store.load();
    let rejected = app.store.rejected().filter(|r| r.version > policy.version);
    let queue = app.dispatcher.report(policy.queue.drain_generation);
    let tiers = Tier::ALL
        .iter()
        .zip(queue.tiers.iter())
        .map(|(tier, stat)| wire::TierReport {
            tier: crate::policy::tier_to_wire(*tier) as i32,
            depth: stat.depth,
            processed: stat.processed,
            rejected: stat.rejected,
            expired: stat.expired,
        })
        .collect();
    // Bounded like status pages (configured clients + the busiest others):
    // with auth off, callers name themselves, and an unbounded list once
    // pushed a report past the gRPC message limit.
    let clients = crate::metrics::bounded_clients(&policy, queue.clients)
        .into_iter()
        .map(|(_, client)| wire::ClientReport {
            client_id: client.client.to_string(),
            waiting: client.waiting,
            inflight: client.inflight,
            processed: client.processed,
            rejected: client.rejected,
            recent_share: client.recent_share,
            last_used_unix_ms: app
                .last_used(&client.client)
                .map_or(0, crate::policy::unix_ms),
            rate_limited: app.usage.minute().refused(&client.client),
        })
        .collect();
    let mut swaps: std::collections::HashMap<Arc<str>, crate::swap::SwapStat> = app
        .dispatcher
        .swap_stats()
        .into_iter()
        .map(|stat| (Arc::clone(&stat.host), stat))
        .collect();
    let hosts = policy
        .hosts
        .iter()
        .map(|host| {
            let (requests, failures) = app.metrics.host_counts(&host.name);
            let stat = queue.slots.get(&host.name);
            wire::HostReport {
                runners: stat
                    .map(|s| {
                        s.runners
                            .iter()
                            .map(|runner| wire::RunnerReport {
                                model: runner.model.clone(),
                                slots: runner.slots,
                                in_flight: runner.in_flight,
                                forced: runner.forced.as_deref().unwrap_or_default().to_owned(),
                                warm: runner.warm,
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
                swap: swaps.remove(&host.name).map(|stat| swap_report(&stat)),
                name: host.name.to_string(),
                slots_in_use: stat.map_or(0, |s| s.slots_in_use),
                requests,
                failures,
                reachable: host.healthy && !stat.is_some_and(|s| s.marked_down),
                cloud_keys: app
                    .cloud
                    .get(&host.name)
                    .map(|pool| {
                        pool.snapshot()
                            .into_iter()
                            .map(|key| wire::CloudKeyReport {
                                // The account and the redacted key: several
                                // keys of one account stay apart.
                                label: if key.label == key.key {
                                    key.key
                                } else {
                                    format!("{} {}", key.label, key.key)
                                },
                                bound_model: key
                                    .bound_model
                                    .map(|m| m.to_string())
                                    .unwrap_or_default(),
                                busy: key.busy,
                                cooldown_until_unix_ms: key
                                    .cooldown_until
                                    .map_or(0, crate::policy::unix_ms),
                                last_error: key
                                    .last_error
                                    .map(|e| e.to_string())
                                    .unwrap_or_default(),
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
                cloud_accounts: app
                    .cloud
                    .get(&host.name)
                    .map(|pool| pool.account_reports())
                    .unwrap_or_default(),
            }
        })
        .collect();
    NodeReport {
        tiers,
        clients,
        hosts,
        events: queue.events,
        drained_generation: queue.drained_generation,
        queued_bytes: queue.queued_bytes,
        node: app.node.to_string(),
        applied_version: policy.version,
        rejected_version: rejected.as_ref().map_or(0, |r| r.version),
        rejected_reason: rejected.map(|r| r.reason).unwrap_or_default(),
        listen_address: app
            .listen_addr
            .get()
            .map(ToString::to_string)
            .unwrap_or_default(),
        uptime_seconds: app.started.elapsed().as_secs(),
        software_version: env!("CARGO_PKG_VERSION").to_owned(),
        active: app.active(),
        apply_errors: app.store.failures(),
        stale_version: app.control.stale_version(),
        forwarded: app.peers.report(),
        usage: app.usage.report(),
        usage_cloud: app.usage.report_cloud(),
        jwks_refresh: app.key_refresh.take(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// A snapshot that turns the cache on, stored after the cache was set up from the first
    /// snapshot and before the cache task subscribes, is applied when the task starts: it
    /// brings no change to wait for.
    #[tokio::test]
    async fn the_cache_follows_a_snapshot_stored_before_it_subscribed() {
        let first = Policy::try_from(crate::policy::minimal_wire()).unwrap();
        assert!(!first.embedding_cache.enabled);
        let store = PolicyStore::new(first);
        let cache = ArcSwapOption::<Cache>::empty();
        let mut on = crate::policy::minimal_wire();
        on.version = 2;
        on.embedding_cache = Some(wire::EmbeddingCacheSettings {
            enabled: true,
            backend: "memory".to_owned(),
            ..Default::default()
        });
        store.store(Policy::try_from(on).unwrap());
        // Stopped before it starts: all it does is what it does on starting.
        let shutdown = CancellationToken::new();
        shutdown.cancel();
        follow_cache(&store, &cache, shutdown).await;
        let connected = cache
            .load_full()
            .expect("the cache the stored snapshot turned on");
        assert_eq!(connected.settings(), &store.load().embedding_cache);
        assert!(store.failures().is_empty(), "{:?}", store.failures());
    }

    #[test]
    fn log_colour_only_on_a_terminal_without_no_color() {
        use std::ffi::OsStr;
        assert!(log_colour(true, None));
        assert!(!log_colour(false, None), "a file or a pipe gets no escapes");
        assert!(!log_colour(true, Some(OsStr::new("1"))));
        assert!(
            log_colour(true, Some(OsStr::new(""))),
            "an empty NO_COLOR is unset"
        );
    }

    #[test]
    fn a_hosts_swap_state_reaches_the_report_whole() {
        let stat = crate::swap::SwapStat {
            host: Arc::from("gpu"),
            resident: vec![("llama3:8b".to_owned(), 5 << 30)],
            capacity: Some(16 << 30),
            capacity_learned: true,
            held: 2,
            oldest_held: Some(Duration::from_millis(3_100)),
            switching_to: Some("qwen3:8b".to_owned()),
            switches: 7,
            bypassed: true,
            loads: 3,
            given_up: 1,
        };
        assert_eq!(
            swap_report(&stat),
            wire::HostSwapReport {
                resident: vec![wire::ModelSize {
                    name: "llama3:8b".to_owned(),
                    bytes: 5 << 30,
                }],
                capacity_bytes: 16 << 30,
                capacity_learned: true,
                held: 2,
                oldest_held_ms: 3_100,
                switching_to: "qwen3:8b".to_owned(),
                switches: 7,
                bypassed: true,
                loads: 3,
            }
        );
        // Unknown capacity, nothing held: zeros, as proto3 leaves them.
        let idle = crate::swap::SwapStat::default();
        assert_eq!(swap_report(&idle), wire::HostSwapReport::default());
    }
}
