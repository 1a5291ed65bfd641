//! Snapshot versions, which only move forward: across restarts of the
//! control plane, and across its clock going back.
//!
//! A version starts at the wall clock in milliseconds and each publish takes
//! the larger of the clock and the previous version + 1, so a restarted
//! control plane is normally ahead of what its data planes hold. Two things
//! keep that true when the clock went back while it was down: the last
//! version is kept in `state_dir/version` (when the state directory exists)
//! and read at start, and a data plane presents the version it holds when it
//! opens a watch (and in every report), which the hub moves above before the
//! stream's first snapshot.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use tokio_util::sync::CancellationToken;

use super::Hub;
use crate::state_file as file;

/// The clock versions start from: the wall clock, or a test's.
#[derive(Clone)]
pub struct Clock(Arc<dyn Fn() -> SystemTime + Send + Sync>);

impl Clock {
    /// The system's wall clock.
    pub fn system() -> Self {
        Self(Arc::new(SystemTime::now))
    }

    /// A clock that reads `now()`.
    pub fn new(now: impl Fn() -> SystemTime + Send + Sync + 'static) -> Self {
        Self(Arc::new(now))
    }

    fn unix_ms(&self) -> u64 {
        u64::try_from(oqp_proto::unix_ms((self.0)())).unwrap_or(0)
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Clock")
    }
}

/// The highest version adopted from a data plane or the version file: far
/// above any wall clock in milliseconds (2^53 ms is 285,000 years), far below
/// `u64::MAX`, so a corrupt or hostile value cannot pin versions at the top
/// where they could no longer move.
pub const MAX_ADOPTED: u64 = 1 << 53;

/// The version after `previous`.
pub(super) fn next(clock: &Clock, previous: u64) -> u64 {
    clock.unix_ms().max(previous.saturating_add(1))
}

/// Where the last version is kept.
pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join("version")
}

/// The version kept in `state_dir`, or 0 (none, unreadable, or out of range:
/// each said in the log).
pub fn read(state_dir: &Path) -> u64 {
    let path = path(state_dir);
    file::remove_temporaries(&path);
    match file::read(&path) {
        Ok(None) => 0,
        Ok(Some(bytes)) => match std::str::from_utf8(&bytes)
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
        {
            Some(version) if version <= MAX_ADOPTED => version,
            _ => {
                tracing::warn!(path = %path.display(), "the saved snapshot version is not a valid version; ignored");
                0
            }
        },
        Err(error) => {
            tracing::warn!(path = %path.display(), %error, "cannot read the saved snapshot version");
            0
        }
    }
}

/// Writes every new version to `state_dir/version` (atomically, mode 0600),
/// until `shutdown`. Nothing is written while the state directory does not
/// exist: it is the operator's (or the key store's) to create.
pub async fn persist(hub: Arc<Hub>, state_dir: PathBuf, shutdown: CancellationToken) {
    let mut snapshots = hub.subscribe();
    let mut written = 0;
    let mut warned = false;
    loop {
        let version = snapshots.borrow_and_update().version;
        if version != written && state_dir.is_dir() {
            let dir = state_dir.clone();
            let write = tokio::task::spawn_blocking(move || {
                file::write_atomic(&path(&dir), version.to_string().as_bytes())
            });
            match write.await {
                Ok(Ok(())) => written = version,
                Ok(Err(error)) if !warned => {
                    warned = true;
                    tracing::warn!(%error, dir = %state_dir.display(), "cannot save the snapshot version");
                }
                _ => {}
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = snapshots.changed() => if changed.is_err() { return },
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;

    #[test]
    fn versions_always_increase() {
        let clock = Clock::system();
        let first = next(&clock, 0);
        assert!(first > 1_600_000_000_000);
        assert!(next(&clock, first) > first);
        assert_eq!(next(&clock, u64::MAX - 1), u64::MAX);
        assert_eq!(next(&clock, u64::MAX), u64::MAX, "saturates, never wraps");
        let stopped = Clock::new(|| UNIX_EPOCH + Duration::from_millis(5));
        assert_eq!(next(&stopped, 0), 5);
        assert_eq!(next(&stopped, 9), 10);
    }

    #[tokio::test]
    async fn the_version_file_is_written_0600_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(dir.path()), 0);
        std::fs::write(path(dir.path()), "not a number").unwrap();
        assert_eq!(read(dir.path()), 0);
        std::fs::write(path(dir.path()), u64::MAX.to_string()).unwrap();
        assert_eq!(read(dir.path()), 0, "out of range is ignored");

        let hub = super::super::tests::hub("");
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(persist(
            hub.clone(),
            dir.path().to_owned(),
            shutdown.clone(),
        ));
        let version = hub.update_runtime(|_| {});
        // Read the file as it is: `read` also removes the temporaries of an unfinished write,
        // which would pull the one in progress from under the writer.
        let on_disk = || {
            std::fs::read_to_string(path(dir.path()))
                .ok()
                .and_then(|text| text.parse::<u64>().ok())
        };
        let saved = eventually(|| on_disk() == Some(version)).await;
        assert!(saved, "the version was saved");
        let mode = std::fs::metadata(path(dir.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        shutdown.cancel();
        task.await.unwrap();
    }

    /// Polls `done` every 10 ms for at most 10 s.
    async fn eventually(done: impl Fn() -> bool) -> bool {
        for _ in 0..1000 {
            if done() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }
}
