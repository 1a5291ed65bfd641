//! The control plane's state: the config in force, operator runtime state,
//! host inventories and data-plane reports, and the current snapshot that
//! every watch stream follows.
//!
//! One `std::sync::Mutex` guards the inputs and is never held across an
//! `.await`; every change republishes a whole snapshot through a
//! `tokio::sync::watch`, so a watcher that misses versions still ends on the
//! latest.
//!
//! The hub also carries what the background tasks share: the [`Webhooks`]
//! handle (kept in step with reloads), a watch of the config in force (the
//! poller restarts its per-host loops from it), and per-host re-poll signals
//! (a data plane that starts failing to reach a host asks for an early poll).
//!
//! Versions only move forward, also across a restart with the clock set
//! back: see [`version`].

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime};

use oqp_proto::policy::v1::{self as wire, NodeReport, PolicySnapshot};
use tokio::sync::{Notify, watch};

use crate::compile::{self, Inventory, Runtime};
use crate::config::Config;
use crate::webhooks::Webhooks;

pub mod version;

pub use version::Clock;

/// Shared control-plane state.
#[derive(Debug)]
pub struct Hub {
    state: Mutex<State>,
    snapshots: watch::Sender<Arc<PolicySnapshot>>,
    configs: watch::Sender<Arc<Config>>,
    webhooks: Webhooks,
    repolls: Mutex<HashMap<String, Arc<Notify>>>,
    /// Hosts a data plane reported unreachable since their last poll.
    doubted: Mutex<std::collections::HashSet<String>>,
    /// Clients whose issuer keys a data plane asked for since the JWKS task last looked.
    jwks_wanted: Mutex<std::collections::BTreeSet<String>>,
    /// Wakes the JWKS task when a data plane asks for keys.
    jwks_signal: Notify,
    started: Instant,
    clock: Clock,
}

#[derive(Debug)]
struct State {
    config: Arc<Config>,
    runtime: Runtime,
    inventory: HashMap<String, Inventory>,
    extra_clients: Vec<wire::Client>,
    /// The issuers' public keys as last fetched, by where they are read.
    jwks: HashMap<crate::config::JwksSource, crate::jwks::KeySet>,
    version: u64,
    nodes: BTreeMap<String, Node>,
    /// Ollama Cloud balances by reading unit (`crate::balances`).
    balances: HashMap<String, crate::balances::Read>,
}

/// What the control plane knows about one data plane.
#[derive(Debug, Clone)]
pub struct Node {
    /// Its last report.
    pub report: NodeReport,
    /// When that report arrived.
    pub reported_at: Option<Instant>,
    /// Open watch streams from it.
    pub watches: usize,
    /// The usage epoch each open watch presented, in the order they opened: the first
    /// holds the name, and only its batches are taken ([`Hub::holder`]).
    pub epochs: Vec<u64>,
}

impl Node {
    /// A node seen for the first time: no report yet, no stream open.
    fn new(name: &str) -> Self {
        Node {
            report: NodeReport {
                node: name.to_owned(),
                ..NodeReport::default()
            },
            reported_at: None,
            watches: 0,
            epochs: Vec::new(),
        }
    }
}

impl Hub {
    /// A hub serving `config`, with its first snapshot built.
    pub fn new(config: Config) -> Arc<Self> {
        Self::starting(config, Clock::system(), 0)
    }

    /// A hub whose versions come from `clock` and start above `floor` (the
    /// version saved by the previous run).
    pub fn starting(config: Config, clock: Clock, floor: u64) -> Arc<Self> {
        let config = Arc::new(config);
        let version = version::next(&clock, floor.min(version::MAX_ADOPTED));
        let first = compile::snapshot(&config, &Runtime::default(), &HashMap::new(), &[], version);
        let (snapshots, _) = watch::channel(Arc::new(first));
        let (configs, _) = watch::channel(config.clone());
        let webhooks = Webhooks::new(&config.webhooks);
        Arc::new(Self {
            state: Mutex::new(State {
                config,
                runtime: Runtime::default(),
                inventory: HashMap::new(),
                extra_clients: Vec::new(),
                jwks: HashMap::new(),
                version,
                nodes: BTreeMap::new(),
                balances: HashMap::new(),
            }),
            snapshots,
            configs,
            webhooks,
            repolls: Mutex::new(HashMap::new()),
            doubted: Mutex::new(std::collections::HashSet::new()),
            jwks_wanted: Mutex::new(std::collections::BTreeSet::new()),
            jwks_signal: Notify::new(),
            started: Instant::now(),
            clock,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// The config in force.
    pub fn config(&self) -> Arc<Config> {
        self.lock().config.clone()
    }

    /// When the control plane started.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// The current snapshot.
    pub fn current(&self) -> Arc<PolicySnapshot> {
        self.snapshots.borrow().clone()
    }

    /// A receiver that yields the current snapshot, then every new one.
    pub fn subscribe(&self) -> watch::Receiver<Arc<PolicySnapshot>> {
        self.snapshots.subscribe()
    }

    /// A receiver of the config in force: the current one, then each reload.
    pub fn watch_config(&self) -> watch::Receiver<Arc<Config>> {
        self.configs.subscribe()
    }

    /// The webhook sender every producer of events uses.
    pub fn webhooks(&self) -> &Webhooks {
        &self.webhooks
    }

    /// Replaces the config (reload) and publishes.
    pub fn set_config(&self, config: Config) -> u64 {
        let config = Arc::new(config);
        self.webhooks.configure(&config.webhooks);
        let version = self.update(|state| state.config = config.clone());
        self.configs.send_replace(config);
        version
    }

    /// Changes operator state and publishes.
    pub fn update_runtime(&self, change: impl FnOnce(&mut Runtime)) -> u64 {
        self.update(|state| change(&mut state.runtime))
    }

    /// The operator state.
    pub fn runtime(&self) -> Runtime {
        self.lock().runtime.clone()
    }

    /// Replaces one host's inventory and publishes if it changed.
    pub fn set_inventory(&self, host: &str, inventory: Inventory) -> Option<u64> {
        let mut state = self.lock();
        let unchanged = state.inventory.get(host).is_some_and(|old| {
            old.healthy == inventory.healthy
                && old.installed == inventory.installed
                && old.loaded == inventory.loaded
                && old.sizes == inventory.sizes
                && old.resident == inventory.resident
        });
        // A data plane that marked the host down keeps its mark until a
        // snapshot carries a newer poll of it: publish the poll that answers
        // its report even when nothing else changed.
        let answers_report = lock(&self.doubted).remove(host);
        if unchanged && !answers_report {
            if let Some(old) = state.inventory.get_mut(host) {
                old.last_checked = inventory.last_checked;
            }
            return None;
        }
        state.inventory.insert(host.to_owned(), inventory);
        Some(self.publish(&mut state))
    }

    /// Forgets a host's inventory (the host left the config, or now points
    /// elsewhere) and publishes if there was one.
    pub fn forget_inventory(&self, host: &str) -> Option<u64> {
        let mut state = self.lock();
        state.inventory.remove(host)?;
        Some(self.publish(&mut state))
    }

    /// Every host's inventory.
    pub fn inventory(&self) -> HashMap<String, Inventory> {
        self.lock().inventory.clone()
    }

    /// One host's inventory, if it was polled.
    pub fn inventory_of(&self, host: &str) -> Option<Inventory> {
        self.lock().inventory.get(host).cloned()
    }

    /// The signal that wakes `host`'s poller early (created on first use).
    pub fn repoll_signal(&self, host: &str) -> Arc<Notify> {
        lock(&self.repolls)
            .entry(host.to_owned())
            .or_default()
            .clone()
    }

    /// Asks `host`'s poller to poll now rather than at its next interval.
    /// Requests coalesce: many before the poll cause one.
    pub fn request_repoll(&self, host: &str) {
        lock(&self.doubted).insert(host.to_owned());
        if let Some(signal) = lock(&self.repolls).get(host) {
            signal.notify_one();
        }
    }

    /// Records a cloud balance read of `unit` (a team or an account) and publishes when the
    /// balance changed. `None` when nothing changed.
    pub fn set_balance(
        &self,
        unit: &str,
        balance: crate::balances::Balance,
        at: SystemTime,
    ) -> Option<u64> {
        let mut state = self.lock();
        if state
            .balances
            .get(unit)
            .is_some_and(|read| read.balance == balance)
        {
            return None;
        }
        state
            .balances
            .insert(unit.to_owned(), crate::balances::Read { balance, at });
        Some(self.publish(&mut state))
    }

    /// Forgets a unit's balance (it left the config).
    pub fn forget_balance(&self, unit: &str) -> Option<u64> {
        let mut state = self.lock();
        state.balances.remove(unit)?;
        Some(self.publish(&mut state))
    }

    /// Every unit's last balance read.
    pub fn balances(&self) -> HashMap<String, crate::balances::Read> {
        self.lock().balances.clone()
    }

    /// Replaces the clients that come from the key store and publishes.
    /// Clients whose `expires_unix_ms` has passed are left out of every
    /// snapshot built from then on.
    pub fn set_extra_clients(&self, clients: Vec<wire::Client>) -> u64 {
        self.update(|state| state.extra_clients = clients)
    }

    /// Records what a fetch of `source`'s keys gave and publishes if that changed what the
    /// data planes hold.
    pub fn set_jwks(
        &self,
        source: &crate::config::JwksSource,
        keys: crate::jwks::KeySet,
    ) -> Option<u64> {
        let mut state = self.lock();
        if state.jwks.get(source) == Some(&keys) {
            return None;
        }
        state.jwks.insert(source.clone(), keys);
        Some(self.publish(&mut state))
    }

    /// The key set last fetched from `source`, if any fetch ended.
    pub fn jwks(&self, source: &crate::config::JwksSource) -> Option<crate::jwks::KeySet> {
        self.lock().jwks.get(source).cloned()
    }

    /// Takes the clients whose issuer keys data planes asked for.
    pub fn take_jwks_wanted(&self) -> std::collections::BTreeSet<String> {
        std::mem::take(&mut *lock(&self.jwks_wanted))
    }

    /// Resolves when a data plane asks for issuer keys.
    pub async fn jwks_asked(&self) {
        self.jwks_signal.notified().await;
    }

    fn update(&self, change: impl FnOnce(&mut State)) -> u64 {
        let mut state = self.lock();
        change(&mut state);
        self.publish(&mut state)
    }

    /// Moves versions above `held`, the version a data plane holds, and
    /// publishes, when `held` is not below the current one: this control
    /// plane's clock went back (or its state was lost) since it published
    /// `held`, and the node would ignore everything it sends. The same
    /// version is normal (a reconnect). `None` when nothing changed.
    pub fn adopt_version(&self, node: &str, held: u64) -> Option<u64> {
        let mut state = self.lock();
        if held <= state.version {
            return None;
        }
        if held > version::MAX_ADOPTED {
            tracing::warn!(%node, held, "a data plane reports an implausible snapshot version; ignored");
            return None;
        }
        tracing::warn!(
            %node,
            held,
            ours = state.version,
            "a data plane holds a newer snapshot version than this control plane (its clock went \
             back, or its state was lost); versions continue above it"
        );
        state.version = held;
        Some(self.publish(&mut state))
    }

    fn publish(&self, state: &mut State) -> u64 {
        state.version = version::next(&self.clock, state.version);
        // A stored key past its expiry (or an old key past its grace) leaves
        // with whichever snapshot comes first after the deadline, whatever
        // triggered it; the key store's timer makes sure one does.
        let now = compile::unix_ms(SystemTime::now());
        let live: Vec<wire::Client> = state
            .extra_clients
            .iter()
            .filter(|client| client.expires_unix_ms == 0 || client.expires_unix_ms > now)
            .cloned()
            .collect();
        let mut snapshot = compile::snapshot(
            &state.config,
            &state.runtime,
            &state.inventory,
            &live,
            state.version,
        );
        crate::balances::attach(&mut snapshot, &state.config, &state.balances);
        crate::jwks::attach(&mut snapshot, &state.config, &state.jwks);
        self.snapshots.send_replace(Arc::new(snapshot));
        state.version
    }

    /// Records a data plane's report. A host the node just started failing
    /// to reach while polling still believes it healthy gets an early poll,
    /// so that every node learns of the failure within a poll's time rather
    /// than an interval's.
    pub fn record_report(&self, report: NodeReport) {
        if !report.jwks_refresh.is_empty() {
            lock(&self.jwks_wanted).extend(report.jwks_refresh.iter().take(1024).cloned());
            self.jwks_signal.notify_one();
        }
        // A node that watched before it could present its version (an older
        // data plane) still moves versions forward, from its first report.
        self.adopt_version(&report.node, report.applied_version);
        let mut state = self.lock();
        let node = state
            .nodes
            .entry(report.node.clone())
            .or_insert_with(|| Node::new(&report.node));
        let newly_unreachable: Vec<String> = report
            .hosts
            .iter()
            .filter(|host| !host.reachable)
            .filter(|host| {
                node.report
                    .hosts
                    .iter()
                    .find(|before| before.name == host.name)
                    .is_none_or(|before| before.reachable)
            })
            .map(|host| host.name.clone())
            .collect();
        // A load completed on a host since the node's last report: poll it now, so that the
        // snapshot learns the model's footprint (size_vram) and what it evicted.
        let loaded: Vec<String> = report
            .hosts
            .iter()
            .filter(|host| {
                let loads = host.swap.as_ref().map_or(0, |swap| swap.loads);
                let before = node
                    .report
                    .hosts
                    .iter()
                    .find(|before| before.name == host.name)
                    .and_then(|before| before.swap.as_ref())
                    .map_or(0, |swap| swap.loads);
                loads > before
            })
            .map(|host| host.name.clone())
            .collect();
        // An account newly refusing a model with a 402 on this node: a webhook.
        let refused = crate::balances::new_refusals(&node.report, &report);
        node.report = report;
        node.reported_at = Some(Instant::now());
        let suspect: Vec<String> = newly_unreachable
            .into_iter()
            .filter(|host| state.inventory.get(host).is_none_or(|seen| seen.healthy))
            .collect();
        drop(state);
        for (host, account, model) in refused {
            self.webhooks().notify(
                crate::webhooks::Notice::new(crate::config::WebhookEvent::CloudRefused)
                    .field("host", host)
                    .field("account", account)
                    .field("model", model),
            );
        }
        for host in suspect.into_iter().chain(loaded) {
            self.request_repoll(&host);
        }
    }

    /// Opens a watch for `node`, presenting usage epoch `epoch` (0: an older data plane
    /// that presents none), unless one is open already and `node` owns hosts: two data
    /// planes started with the same `--node` would both send to its hosts. `false` =
    /// refused.
    pub fn open_watch(&self, node: &str, epoch: u64) -> bool {
        let mut state = self.lock();
        let owns = state
            .config
            .ollama
            .hosts
            .iter()
            .any(|host| host.node.as_deref() == Some(node));
        let entry = state
            .nodes
            .entry(node.to_owned())
            .or_insert_with(|| Node::new(node));
        if owns && entry.watches > 0 {
            return false;
        }
        entry.watches += 1;
        entry.epochs.push(epoch);
        true
    }

    /// Counts a watch stream of `node` that presented `epoch` closed.
    pub fn close_watch(&self, node: &str, epoch: u64) {
        let mut state = self.lock();
        if let Some(entry) = state.nodes.get_mut(node) {
            entry.watches = entry.watches.saturating_sub(1);
            if let Some(at) = entry.epochs.iter().position(|open| *open == epoch) {
                entry.epochs.remove(at);
            }
        }
    }

    /// Whose usage batches are taken under `node`'s name: those of the epoch its holding
    /// watch (the first open) presented; any epoch for a holder that presented none (an
    /// older data plane); none while no watch is open.
    pub fn holder(&self, node: &str) -> crate::usage::Holder {
        use crate::usage::Holder;
        match self
            .lock()
            .nodes
            .get(node)
            .and_then(|entry| entry.epochs.first())
        {
            None => Holder::Nobody,
            Some(0) => Holder::Any,
            Some(epoch) => Holder::Epoch(*epoch),
        }
    }

    /// Every data plane seen so far.
    pub fn nodes(&self) -> BTreeMap<String, Node> {
        self.lock().nodes.clone()
    }

    /// Every node but `asking`, listed in the config or seen, with the load it last reported
    /// and how to reach it: what `asking` ranks other nodes' hosts by.
    pub fn loads_for(&self, asking: &str) -> Vec<wire::NodeLoad> {
        let state = self.lock();
        let names: std::collections::BTreeSet<&String> = state
            .config
            .nodes
            .keys()
            .chain(state.nodes.keys())
            .collect();
        names
            .into_iter()
            .filter(|name| name.as_str() != asking)
            .map(|name| {
                let seen = state.nodes.get(name);
                let report = seen.map(|node| &node.report);
                let url = state
                    .config
                    .nodes
                    .get(name)
                    .and_then(|node| node.url.clone())
                    .or_else(|| report.and_then(|r| reported_url(&r.listen_address)))
                    .or_else(|| compile::configured_url(&state.config, name))
                    .unwrap_or_default();
                wire::NodeLoad {
                    node: name.clone(),
                    url,
                    connected: seen.is_some_and(|node| node.watches > 0),
                    report_age_ms: seen.and_then(|node| node.reported_at).map_or(0, |at| {
                        u64::try_from(at.elapsed().as_millis())
                            .unwrap_or(u64::MAX)
                            .max(1)
                    }),
                    waiting: report.map_or(0, |r| r.tiers.iter().map(|t| t.depth).sum()),
                    hosts: report
                        .map(|r| {
                            r.hosts
                                .iter()
                                .map(|host| wire::HostLoad {
                                    name: host.name.clone(),
                                    slots_in_use: host.slots_in_use,
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                }
            })
            .collect()
    }
}

/// `http://ADDR` for a reported listen address, unless it is a wildcard (not reachable as such).
fn reported_url(listen_address: &str) -> Option<String> {
    let addr: std::net::SocketAddr = listen_address.parse().ok()?;
    (!addr.ip().is_unspecified()).then(|| format!("http://{addr}"))
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave the state half-written
    // in a way that matters more than stopping; keep serving.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::time::Duration;

    use oqp_proto::policy::v1::HostReport;

    use super::*;
    use crate::config::{self, Env};

    pub(super) fn hub(extra: &str) -> Arc<Hub> {
        let yaml =
            format!("ollama:\n  hosts:\n    - {{url: \"http://gpu:11434\", name: gpu}}\n{extra}");
        Hub::new(config::load_str(&yaml, &Env::empty()).unwrap().config)
    }

    #[test]
    fn a_data_plane_ahead_of_a_clock_set_back_moves_versions_above_it() {
        let config = hub("").config().as_ref().clone();
        let an_hour_ago = SystemTime::now() - Duration::from_secs(3_600);
        let hub = Hub::starting(config.clone(), Clock::new(move || an_hour_ago), 0);
        let ours = hub.current().version;
        let held = ours + 3_600_000;
        assert_eq!(
            hub.adopt_version("n1", ours),
            None,
            "the same version is a reconnect"
        );
        assert_eq!(hub.adopt_version("n1", ours - 1), None);
        let bumped = hub.adopt_version("n1", held).unwrap();
        assert!(bumped > held);
        assert_eq!(hub.current().version, bumped, "published at once");
        assert!(hub.update_runtime(|_| {}) > bumped, "and onward from there");
        assert_eq!(hub.adopt_version("n1", u64::MAX), None, "implausible");

        // A report does the same (a node that could not present its version).
        let hub = Hub::starting(config.clone(), Clock::new(move || an_hour_ago), 0);
        hub.record_report(NodeReport {
            node: "n1".into(),
            applied_version: held,
            ..NodeReport::default()
        });
        assert!(hub.current().version > held);

        // The saved version counts as well.
        let hub = Hub::starting(config, Clock::new(move || an_hour_ago), held);
        assert_eq!(hub.current().version, held + 1);
    }

    fn healthy(installed: &[&str]) -> Inventory {
        Inventory {
            healthy: true,
            installed: installed.iter().map(|m| (*m).to_owned()).collect(),
            loaded: Vec::new(),
            sizes: installed.iter().map(|m| ((*m).to_owned(), 1)).collect(),
            resident: Vec::new(),
            last_checked: Some(SystemTime::now()),
            forced: Vec::new(),
            shown: Vec::new(),
            learned: Default::default(),
            error: None,
        }
    }

    #[test]
    fn inventories_publish_only_on_change() {
        let hub = hub("");
        assert!(hub.set_inventory("gpu", healthy(&["a"])).is_some());
        assert!(hub.set_inventory("gpu", healthy(&["a"])).is_none());
        assert_eq!(hub.current().hosts[0].installed_models, ["a"]);
        assert!(hub.set_inventory("gpu", healthy(&["a", "b"])).is_some());
        assert!(hub.forget_inventory("gpu").is_some());
        assert!(hub.forget_inventory("gpu").is_none());
        assert!(hub.current().hosts[0].installed_models.is_empty());
    }

    #[tokio::test]
    async fn reloads_reach_the_config_watch_and_the_webhooks() {
        let hub = hub("");
        let mut configs = hub.watch_config();
        assert!(!configs.borrow_and_update().webhooks.enabled);
        let reloaded = config::load_str(
            "ollama:\n  hosts:\n    - {url: \"http://gpu:11434\", name: gpu}\n\
             webhooks:\n  enabled: true\n  url: \"https://hooks.example.com/h\"\n",
            &Env::empty(),
        )
        .unwrap()
        .config;
        hub.set_config(reloaded);
        configs.changed().await.unwrap();
        assert!(configs.borrow().webhooks.enabled);
        let notice = crate::webhooks::Notice::new(crate::config::WebhookEvent::HostUnhealthy);
        assert!(hub.webhooks().notify(notice));
    }

    fn report(reachable: bool) -> NodeReport {
        NodeReport {
            node: "n1".to_owned(),
            hosts: vec![HostReport {
                name: "gpu".to_owned(),
                reachable,
                ..HostReport::default()
            }],
            ..NodeReport::default()
        }
    }

    #[tokio::test]
    async fn a_host_turning_unreachable_in_a_report_asks_for_one_early_poll() {
        let hub = hub("");
        let signal = hub.repoll_signal("gpu");
        hub.set_inventory("gpu", healthy(&[]));
        hub.record_report(report(true));
        hub.record_report(report(false));
        // Still unreachable in the next report: no second request.
        hub.record_report(report(false));
        tokio::time::timeout(Duration::from_secs(1), signal.notified())
            .await
            .expect("an early poll was requested");
        let again = tokio::time::timeout(Duration::ZERO, signal.notified()).await;
        assert!(again.is_err(), "requests must coalesce");

        // A host the poller already knows is down is left to its interval.
        hub.set_inventory(
            "gpu",
            Inventory {
                healthy: false,
                ..healthy(&[])
            },
        );
        hub.record_report(report(true));
        hub.record_report(report(false));
        let asked = tokio::time::timeout(Duration::ZERO, signal.notified()).await;
        assert!(asked.is_err());
    }

    fn loads_report(loads: u64) -> NodeReport {
        let mut report = report(true);
        report.hosts[0].swap = Some(wire::HostSwapReport {
            loads,
            ..wire::HostSwapReport::default()
        });
        report
    }

    #[tokio::test]
    async fn a_load_completed_on_a_host_asks_for_an_early_poll_of_it() {
        let hub = hub("");
        let signal = hub.repoll_signal("gpu");
        hub.set_inventory("gpu", healthy(&[]));
        hub.record_report(loads_report(0));
        hub.record_report(loads_report(0));
        let asked = tokio::time::timeout(Duration::ZERO, signal.notified()).await;
        assert!(asked.is_err(), "no load, no early poll");
        hub.record_report(loads_report(1));
        tokio::time::timeout(Duration::from_secs(1), signal.notified())
            .await
            .expect("an early poll was requested");
    }
}
