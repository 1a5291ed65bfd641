//! Model-swap-aware scheduling: what each host's VRAM holds, and when to switch it to another
//! model. (Being built: the rule itself lands next.)

use std::sync::Arc;
use std::time::Duration;

/// One host's model-swap state, for status pages, reports and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SwapStat {
    /// The host's name.
    pub host: Arc<str>,
    /// Models believed resident now (normalised names), with their bytes.
    pub resident: Vec<(String, u64)>,
    /// VRAM capacity in bytes: configured, else learned; `None` while unknown.
    pub capacity: Option<u64>,
    /// Whether `capacity` was learned rather than configured.
    pub capacity_learned: bool,
    /// Requests held back now for a model that is not resident.
    pub held: u32,
    /// How long the longest-held of them has been held.
    pub oldest_held: Option<Duration>,
    /// The model being switched to, while a switch waits for the old model's requests.
    pub switching_to: Option<String>,
    /// Switches since start.
    pub switches: u64,
    /// Off for this host: residency changed in ways oqp did not cause (clients bypass it).
    pub bypassed: bool,
}
