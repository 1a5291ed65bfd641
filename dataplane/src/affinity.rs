//! Conversation affinity: the next turn of a conversation goes where its prompt is cached,
//! while that costs less than re-reading it elsewhere.
//!
//! Ollama (llama-server) keeps each runner slot's KV cache and reuses the longest common
//! prefix of the next prompt placed there; a follow-up sent to another box re-reads its whole
//! history. Three pieces:
//! - [`chain`]: a request's conversation as prefix hashes, read from its body, scoped to the
//!   tenant (key or app user) unless `routing.affinity.share_across_keys`;
//! - [`index`]: which runner holds which prefix, bounded by each runner's slots (plus the
//!   allowance for llama-server's RAM cache) and forgotten on unload or eviction;
//! - the router's choice (`router::affinity`): among the hosts that can run the request, the
//!   smallest expected time to first token, `wait + prefill of what is not cached there`,
//!   under a hard load bound; [`tap`] records the answer when the stream ends, since the
//!   answer is the next turn's prefix.
//!
//! Affinity picks the host only: tiers and fair share decide who goes next, as before.

pub mod chain;
pub mod index;
pub mod tap;

#[cfg(test)]
#[allow(clippy::expect_used, clippy::unwrap_used)]
mod tests;

pub use chain::{Chain, Point, Shape};
pub use index::{EngineChoice, Hold, Index, RunnerWarmth, Slot, Warm};

/// How a request's host was chosen, as `X-OQP-Affinity` and `oqp_affinity_total{result}`
/// name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Placed where its prefix is cached.
    Hit,
    /// A follow-up whose prefix no runner holds (evicted, unloaded, a restart, never seen).
    Miss,
    /// Its prefix is cached on a host that is too busy: placed elsewhere, where re-reading
    /// it costs less than waiting, or the load bound required it.
    Spill,
    /// A conversation's first turn.
    New,
}

impl Outcome {
    /// Every outcome, in a stable order.
    pub const ALL: [Outcome; 4] = [Outcome::Hit, Outcome::Miss, Outcome::Spill, Outcome::New];

    /// The header value and metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Hit => "hit",
            Outcome::Miss => "miss",
            Outcome::Spill => "spill",
            Outcome::New => "new",
        }
    }
}

/// What the router decided for one request's conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// How the host was chosen.
    pub outcome: Outcome,
    /// Estimated prompt tokens cached where it was placed.
    pub cached_tokens: u32,
    /// Where the conversation was recorded, for its answer.
    pub slot: Option<Slot>,
}
