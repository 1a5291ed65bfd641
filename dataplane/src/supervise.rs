//! Applying a snapshot part by part, each under its own guard.
//!
//! The parts that keep state across snapshots (the dispatcher, the cloud
//! pools, the metrics, the embedding cache, the injection listeners, the
//! binary's log filter) are applied one after the other by long-lived tasks.
//! A part that panics would otherwise end its task, and every later snapshot
//! (a pause, a revocation) would silently stop reaching it. Here a panic is
//! caught, logged at error, remembered in the [`PolicyStore`] for the report
//! (so `oqpctl status` shows it), and the other parts and later snapshots
//! are applied as usual.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;

use crate::snapshot::PolicyStore;

/// Runs `apply` for `part` of snapshot `version`; true when it returned.
pub fn apply(store: &PolicyStore, part: &str, version: u64, apply: impl FnOnce()) -> bool {
    // The parts own their state behind their own locks; a panic inside one
    // leaves at worst that part stale, which the report says.
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(apply));
    settle(store, part, version, outcome)
}

/// [`apply`] for a part that awaits and may refuse the snapshot without
/// panicking (`Err(why)`, reported the same way).
pub async fn apply_async(
    store: &PolicyStore,
    part: &str,
    version: u64,
    apply: impl Future<Output = Result<(), String>>,
) -> bool {
    match AssertUnwindSafe(apply).catch_unwind().await {
        Ok(Err(reason)) => {
            let reason = format!("snapshot {version} not applied: {reason}");
            tracing::error!(part, version, %reason, "a part of the snapshot was not applied; the others were");
            store.part_failed(part, reason);
            false
        }
        Ok(Ok(())) => settle(store, part, version, Ok(())),
        Err(payload) => settle(store, part, version, Err(payload)),
    }
}

fn settle(
    store: &PolicyStore,
    part: &str,
    version: u64,
    outcome: Result<(), Box<dyn Any + Send>>,
) -> bool {
    match outcome {
        Ok(()) => {
            store.part_applied(part);
            true
        }
        Err(payload) => {
            let reason = format!("snapshot {version} panicked: {}", message(&*payload));
            tracing::error!(part, version, %reason, "a part of the snapshot was not applied; the others were");
            store.part_failed(part, reason);
            false
        }
    }
}

/// A panic's message, bounded (it travels in the report).
fn message(payload: &(dyn Any + Send)) -> String {
    const MAX: usize = 200;
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned());
    if text.len() <= MAX {
        return text;
    }
    let mut end = MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn store() -> PolicyStore {
        let snapshot = crate::policy::minimal_wire();
        PolicyStore::new(crate::policy::Policy::try_from(snapshot).unwrap())
    }

    #[tokio::test]
    async fn a_panicking_part_is_reported_and_cleared_when_it_applies_again() {
        let store = store();
        let mut ran = false;
        assert!(!apply(&store, "dispatcher", 7, || panic!("boom {}", 1)));
        assert!(apply(&store, "metrics", 7, || ran = true));
        assert!(ran, "the next part still runs");
        let huge = async { panic!("{}", "x".repeat(500)) };
        assert!(!apply_async(&store, "cache", 7, huge).await);
        let refused = async { Err("unreachable".to_owned()) };
        assert!(!apply_async(&store, "redis", 7, refused).await);
        let failures = store.failures();
        assert_eq!(failures.len(), 3, "{failures:?}");
        assert!(failures[0].starts_with("cache: snapshot 7 panicked: xxx"));
        assert!(failures[0].len() < 260, "bounded: {}", failures[0].len());
        assert_eq!(failures[1], "dispatcher: snapshot 7 panicked: boom 1");
        assert_eq!(failures[2], "redis: snapshot 7 not applied: unreachable");
        assert!(apply(&store, "dispatcher", 8, || {}));
        assert!(apply_async(&store, "cache", 8, async { Ok(()) }).await);
        assert!(apply_async(&store, "redis", 8, async { Ok(()) }).await);
        assert!(store.failures().is_empty());
    }
}
