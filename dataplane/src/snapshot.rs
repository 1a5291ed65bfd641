//! The one place the current policy lives: an `ArcSwap<Policy>`.
//!
//! A request calls [`PolicyStore::load`] once and keeps that `Arc` for its
//! whole life, so a snapshot swap never changes the rules under a request in
//! flight. Writers only ever move forward: a snapshot whose version is not
//! newer than the current one is ignored, and one that fails to compile is
//! rejected while the current one stays (the xDS ACK/NACK rule).
//!
//! The store also remembers, for the report, which parts of the current
//! snapshot could not be applied (see [`crate::supervise`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use oqp_proto::policy::v1::PolicySnapshot;

use crate::policy::{Policy, PolicyError};

/// Holds the current policy and the last rejection.
#[derive(Debug)]
pub struct PolicyStore {
    current: ArcSwap<Policy>,
    // Read by the reporter only; never touched on the request path.
    rejected: Mutex<Option<Rejected>>,
    rejected_total: AtomicU64,
    // Part name → why it is not applied; read by the reporter only.
    failures: Mutex<BTreeMap<String, String>>,
    changed: tokio::sync::watch::Sender<u64>,
}

/// A snapshot version that failed to compile, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// The refused version.
    pub version: u64,
    /// Why.
    pub reason: String,
}

/// What [`PolicyStore::offer`] did with a snapshot.
#[derive(Debug, PartialEq, Eq)]
pub enum Offer {
    /// It is now the current policy.
    Applied,
    /// It was not newer than the current one.
    Stale,
    /// It failed to compile; the current one stays.
    Rejected(PolicyError),
}

impl PolicyStore {
    /// A store holding `initial`.
    pub fn new(initial: Policy) -> Self {
        let (changed, _) = tokio::sync::watch::channel(initial.version);
        Self {
            current: ArcSwap::from_pointee(initial),
            rejected: Mutex::new(None),
            rejected_total: AtomicU64::new(0),
            failures: Mutex::new(BTreeMap::new()),
            changed,
        }
    }

    /// The current policy. Call once per request and keep the `Arc`.
    pub fn load(&self) -> Arc<Policy> {
        self.current.load_full()
    }

    /// Offers a wire snapshot: compiles it and swaps it in if it is newer.
    pub fn offer(&self, snapshot: PolicySnapshot) -> Offer {
        let version = snapshot.version;
        if version <= self.current.load().version {
            return Offer::Stale;
        }
        match Policy::try_from(snapshot) {
            Ok(policy) => {
                self.store(policy);
                Offer::Applied
            }
            Err(error) => {
                self.rejected_total.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut rejected) = self.rejected.lock() {
                    *rejected = Some(Rejected {
                        version,
                        reason: error.to_string(),
                    });
                }
                Offer::Rejected(error)
            }
        }
    }

    /// Stores an already compiled policy if it is newer than the current one.
    pub fn store(&self, policy: Policy) {
        let version = policy.version;
        let policy = Arc::new(policy);
        // rcu keeps the version check and the swap atomic against a
        // concurrent writer.
        self.current.rcu(|current| {
            if current.version < version {
                policy.clone()
            } else {
                current.clone()
            }
        });
        self.changed.send_if_modified(|seen| {
            let newer = *seen < version;
            if newer {
                *seen = version;
            }
            newer
        });
    }

    /// The last rejected version, if any.
    pub fn rejected(&self) -> Option<Rejected> {
        self.rejected.lock().ok().and_then(|r| r.clone())
    }

    /// Snapshots rejected since start.
    pub fn rejected_total(&self) -> u64 {
        self.rejected_total.load(Ordering::Relaxed)
    }

    /// Records that `part` could not apply the current snapshot, and why.
    pub fn part_failed(&self, part: &str, reason: String) {
        if let Ok(mut failures) = self.failures.lock() {
            failures.insert(part.to_owned(), reason);
        }
    }

    /// Records that `part` applied the current snapshot (or is gone).
    pub fn part_applied(&self, part: &str) {
        if let Ok(mut failures) = self.failures.lock() {
            failures.remove(part);
        }
    }

    /// The parts not applied now, as "part: why" lines.
    pub fn failures(&self) -> Vec<String> {
        self.failures.lock().map_or_else(
            |_| Vec::new(),
            |failures| {
                failures
                    .iter()
                    .map(|(part, reason)| format!("{part}: {reason}"))
                    .collect()
            },
        )
    }

    /// A receiver that sees every applied version.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }
}
