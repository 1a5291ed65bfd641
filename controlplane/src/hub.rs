//! The control plane's state: the config in force, operator runtime state,
//! host inventories and data-plane reports, and the current snapshot that
//! every watch stream follows.
//!
//! One `std::sync::Mutex` guards the inputs and is never held across an
//! `.await`; every change republishes a whole snapshot through a
//! `tokio::sync::watch`, so a watcher that misses versions still ends on the
//! latest.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime};

use oqp_proto::policy::v1::{self as wire, NodeReport, PolicySnapshot};
use tokio::sync::watch;

use crate::compile::{self, Inventory, Runtime};
use crate::config::Config;

/// Shared control-plane state.
#[derive(Debug)]
pub struct Hub {
    state: Mutex<State>,
    snapshots: watch::Sender<Arc<PolicySnapshot>>,
    started: Instant,
}

#[derive(Debug)]
struct State {
    config: Arc<Config>,
    runtime: Runtime,
    inventory: HashMap<String, Inventory>,
    extra_clients: Vec<wire::Client>,
    version: u64,
    nodes: BTreeMap<String, Node>,
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
}

impl Hub {
    /// A hub serving `config`, with its first snapshot built.
    pub fn new(config: Config) -> Arc<Self> {
        let config = Arc::new(config);
        let version = next_version(0);
        let first = compile::snapshot(&config, &Runtime::default(), &HashMap::new(), &[], version);
        let (snapshots, _) = watch::channel(Arc::new(first));
        Arc::new(Self {
            state: Mutex::new(State {
                config,
                runtime: Runtime::default(),
                inventory: HashMap::new(),
                extra_clients: Vec::new(),
                version,
                nodes: BTreeMap::new(),
            }),
            snapshots,
            started: Instant::now(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state half-written
        // in a way that matters more than stopping; keep serving.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
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

    /// Replaces the config (reload) and publishes.
    pub fn set_config(&self, config: Config) -> u64 {
        self.update(|state| state.config = Arc::new(config))
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
        });
        if unchanged {
            if let Some(old) = state.inventory.get_mut(host) {
                old.last_checked = inventory.last_checked;
            }
            return None;
        }
        state.inventory.insert(host.to_owned(), inventory);
        Some(self.publish(&mut state))
    }

    /// Every host's inventory.
    pub fn inventory(&self) -> HashMap<String, Inventory> {
        self.lock().inventory.clone()
    }

    /// Replaces the clients that come from the key store and publishes.
    pub fn set_extra_clients(&self, clients: Vec<wire::Client>) -> u64 {
        self.update(|state| state.extra_clients = clients)
    }

    fn update(&self, change: impl FnOnce(&mut State)) -> u64 {
        let mut state = self.lock();
        change(&mut state);
        self.publish(&mut state)
    }

    fn publish(&self, state: &mut State) -> u64 {
        state.version = next_version(state.version);
        let snapshot = compile::snapshot(
            &state.config,
            &state.runtime,
            &state.inventory,
            &state.extra_clients,
            state.version,
        );
        self.snapshots.send_replace(Arc::new(snapshot));
        state.version
    }

    /// Records a data plane's report.
    pub fn record_report(&self, report: NodeReport) {
        let mut state = self.lock();
        let node = state
            .nodes
            .entry(report.node.clone())
            .or_insert_with(|| Node {
                report: NodeReport::default(),
                reported_at: None,
                watches: 0,
            });
        node.report = report;
        node.reported_at = Some(Instant::now());
    }

    /// Counts a watch stream opened (`+1`) or closed (`-1`) by `node`.
    pub fn watch_changed(&self, node: &str, opened: bool) {
        let mut state = self.lock();
        let entry = state.nodes.entry(node.to_owned()).or_insert_with(|| Node {
            report: NodeReport {
                node: node.to_owned(),
                ..NodeReport::default()
            },
            reported_at: None,
            watches: 0,
        });
        if opened {
            entry.watches += 1;
        } else {
            entry.watches = entry.watches.saturating_sub(1);
        }
    }

    /// Every data plane seen so far.
    pub fn nodes(&self) -> BTreeMap<String, Node> {
        self.lock().nodes.clone()
    }
}

/// Versions only move forward, also across restarts of the control plane:
/// a data plane that kept serving version N while the control plane was down
/// must accept the restarted control plane's snapshots, so versions start at
/// the wall clock in milliseconds.
fn next_version(previous: u64) -> u64 {
    let now = u64::try_from(compile::unix_ms(SystemTime::now())).unwrap_or(0);
    now.max(previous + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_always_increase() {
        let first = next_version(0);
        assert!(first > 1_600_000_000_000);
        assert!(next_version(first) > first);
        assert_eq!(next_version(u64::MAX - 1), u64::MAX);
    }
}
