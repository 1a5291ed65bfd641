//! The RAII slot a [`Placement`](super::Placement) holds.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

/// Called each time a slot frees (typically `Notify::notify_one` on the dispatcher's wake-up).
/// It runs wherever the guard drops, so it must be cheap and must not lock the router.
pub type ReleaseHook = Arc<dyn Fn() + Send + Sync>;

/// One reserved upstream slot; dropping it frees the slot and calls the release hook.
pub struct SlotGuard {
    pub(super) in_use: Arc<AtomicU32>,
    /// The slot of the model's runner on that host, when it counts one.
    pub(super) runner: Option<Arc<AtomicU32>>,
    pub(super) on_release: Option<ReleaseHook>,
}

impl SlotGuard {
    /// Frees the slot now (the same as dropping the guard).
    pub fn release(self) {}
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        // Saturating: a counter can never go below zero, whatever the order of events.
        let _ = self
            .in_use
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        if let Some(runner) = &self.runner {
            let _ = runner.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
        if let Some(hook) = &self.on_release {
            hook();
        }
    }
}

impl fmt::Debug for SlotGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotGuard")
            .field("in_use", &self.in_use.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}
