//! The audit trail: one JSON line per management action (a key added,
//! rotated, revoked or expired, a tier paused or flushed, a reload, a data
//! plane joining or leaving, a refused admin call), with who did it, from
//! where, to what, and how it ended. Never a secret: the target is a
//! `client_id`, a tier or a node name.
//!
//! The trail lives in `control_plane.state_dir/audit.jsonl` (0600). Each
//! line is one `write` on a file opened with `O_APPEND`, so a line is never
//! interleaved with another; the write is done before the admin call
//! answers, so a graceful stop loses nothing. Past `max_bytes` the file is
//! rotated (`audit.jsonl.1` is the newest old file, `audit.jsonl.<keep>` the
//! oldest kept). While the state directory does not exist (the key store
//! creates it on its first write) the trail is kept in memory only, the last
//! [`MEMORY_ENTRIES`] entries.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

/// The trail's file name in the state directory.
pub const FILE_NAME: &str = "audit.jsonl";

/// How many entries the in-memory trail keeps.
pub const MEMORY_ENTRIES: usize = 1000;

/// The longest reason kept (a refused reload's full list of problems stays
/// in the log).
pub const MAX_REASON: usize = 200;

/// The actor of an action no admin caller asked for (a signal, start-up,
/// an expiry).
pub const LOCAL: &str = "local";

/// One recorded action, as written (one JSON object a line).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// When, RFC 3339 UTC with milliseconds.
    pub time: String,
    /// The admin caller's `client_id`, or [`LOCAL`].
    pub actor: String,
    /// The caller's address, when known.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub source: String,
    /// What was done, dotted (`keys.revoke`, `queue.pause`, `config.reload`).
    pub action: String,
    /// What it was done to (a `client_id`, a tier, a node), if anything.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub target: String,
    /// How it ended.
    pub outcome: Outcome,
    /// Why it was refused or failed (empty when it went through).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

/// How an action ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// Done.
    Ok,
    /// Not allowed (credential, scope, precondition).
    Refused,
    /// Allowed but it did not work.
    Failed,
}

impl Outcome {
    /// The name written in the trail.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Refused => "refused",
            Outcome::Failed => "failed",
        }
    }
}

/// Size-based rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rotation {
    /// The size past which the file is rotated.
    pub max_bytes: u64,
    /// How many rotated files are kept.
    pub keep_files: u32,
}

impl Default for Rotation {
    fn default() -> Self {
        Self {
            max_bytes: 10 * 1024 * 1024,
            keep_files: 5,
        }
    }
}

/// What a reader asks for.
#[derive(Debug, Clone, Default)]
pub struct Query {
    /// Only entries at or after this time.
    pub since: Option<SystemTime>,
    /// Only this action (`keys.revoke`), or those under a prefix (`keys`).
    pub action: Option<String>,
    /// At most this many, the newest (0: no limit).
    pub limit: usize,
}

impl Query {
    fn matches(&self, entry: &Entry) -> bool {
        let action_ok = self.action.as_deref().is_none_or(|wanted| {
            entry.action == wanted
                || entry
                    .action
                    .strip_prefix(wanted)
                    .is_some_and(|rest| rest.starts_with('.'))
        });
        let since_ok = self.since.is_none_or(|since| {
            humantime::parse_rfc3339(&entry.time).is_ok_and(|time| time >= since)
        });
        action_ok && since_ok
    }
}

/// Receives each entry once it is recorded (the webhook sender).
pub type Observer = Arc<dyn Fn(&Entry) + Send + Sync>;

/// The audit trail.
pub struct Audit {
    sink: Mutex<Sink>,
    observer: Mutex<Option<Observer>>,
}

impl std::fmt::Debug for Audit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Audit").finish_non_exhaustive()
    }
}

/// Where entries go: the file when its directory exists (the key store
/// may create it after start-up), else the ring.
struct Sink {
    path: Option<PathBuf>,
    file: Option<File>,
    size: u64,
    rotation: Rotation,
    ring: VecDeque<Entry>,
}

impl Audit {
    /// The trail in `state_dir`, or in memory when that directory does not
    /// exist.
    pub fn open(state_dir: &Path, rotation: Rotation) -> Arc<Self> {
        Self::with_path(Some(state_dir.join(FILE_NAME)), rotation)
    }

    /// A trail kept in memory only.
    pub fn in_memory() -> Arc<Self> {
        Self::with_path(None, Rotation::default())
    }

    fn with_path(path: Option<PathBuf>, rotation: Rotation) -> Arc<Self> {
        Arc::new(Self {
            sink: Mutex::new(Sink {
                path,
                file: None,
                size: 0,
                rotation,
                ring: VecDeque::new(),
            }),
            observer: Mutex::new(None),
        })
    }

    /// Changes the rotation limits (a reload); the next write applies them.
    pub fn set_rotation(&self, rotation: Rotation) {
        self.lock().rotation = rotation;
    }

    /// Calls `observer` with every entry recorded from now on.
    pub fn observe(&self, observer: Observer) {
        *self.observer.lock().unwrap_or_else(PoisonError::into_inner) = Some(observer);
    }

    /// Records an action now. A trail that cannot be written logs why and
    /// keeps the entry in the log instead; the action itself is not undone.
    pub fn record(
        &self,
        actor: &str,
        source: Option<std::net::SocketAddr>,
        action: &str,
        target: &str,
        outcome: Outcome,
        reason: &str,
    ) {
        let entry = Entry {
            time: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
            actor: actor.to_owned(),
            source: source.map(|addr| addr.to_string()).unwrap_or_default(),
            action: action.to_owned(),
            target: target.to_owned(),
            outcome,
            reason: short(reason),
        };
        tracing::info!(
            actor = %entry.actor,
            source = %entry.source,
            target = %entry.target,
            outcome = entry.outcome.as_str(),
            reason = %entry.reason,
            "audit: {}",
            entry.action
        );
        if let Err(error) = self.lock().append(&entry) {
            tracing::error!("audit trail not written: {error}");
        }
        let observer = self
            .observer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(observer) = observer {
            observer(&entry);
        }
    }

    /// The entries that match `query`, oldest first (rotated files too).
    pub fn read(&self, query: &Query) -> Vec<Entry> {
        // The files are read without the lock, so that writers never wait
        // for a reader (a rotation meanwhile may show an entry twice or
        // miss one; the files themselves are untouched).
        let (mut entries, path, keep_files) = {
            let sink = self.lock();
            let entries: Vec<Entry> = sink
                .ring
                .iter()
                .filter(|e| query.matches(e))
                .cloned()
                .collect();
            (entries, sink.path.clone(), sink.rotation.keep_files)
        };
        if let Some(path) = &path {
            let mut files: Vec<PathBuf> = (1..=keep_files)
                .rev()
                .map(|index| rotated(path, index))
                .collect();
            files.push(path.clone());
            entries.extend(
                files
                    .iter()
                    .filter_map(|file| std::fs::read_to_string(file).ok())
                    .flat_map(|text| {
                        text.lines()
                            .filter_map(|line| serde_json::from_str::<Entry>(line).ok())
                            .collect::<Vec<_>>()
                    })
                    .filter(|entry| query.matches(entry)),
            );
        }
        if query.limit > 0 && entries.len() > query.limit {
            entries.drain(..entries.len() - query.limit);
        }
        entries
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Sink> {
        self.sink.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Sink {
    fn append(&mut self, entry: &Entry) -> Result<(), String> {
        let Some(path) = self
            .path
            .clone()
            .filter(|path| path.parent().is_some_and(Path::is_dir))
        else {
            if self.ring.len() >= MEMORY_ENTRIES {
                self.ring.pop_front();
            }
            self.ring.push_back(entry.clone());
            return Ok(());
        };
        let mut line = serde_json::to_vec(entry).map_err(|e| e.to_string())?;
        line.push(b'\n');
        let line_len = line.len() as u64;
        if self.file.is_none() {
            let opened = open_append(&path)?;
            self.size = opened.metadata().map(|m| m.len()).unwrap_or(0);
            self.file = Some(opened);
        }
        if self.size > 0 && self.size.saturating_add(line_len) > self.rotation.max_bytes {
            self.file = None;
            rotate(&path, self.rotation.keep_files)?;
            self.file = Some(open_append(&path)?);
            self.size = 0;
        }
        let Some(open) = self.file.as_mut() else {
            return Err("audit file not open".to_owned());
        };
        // One write of the whole line: O_APPEND makes it land at the end, in
        // one piece.
        let written = open
            .write(&line)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        self.size += written as u64;
        if written != line.len() {
            return Err(format!("{}: short write", path.display()));
        }
        Ok(())
    }
}

/// A reason as the trail keeps it: its first line, at most
/// [`MAX_REASON`] characters.
fn short(reason: &str) -> String {
    let first = reason.lines().next().unwrap_or_default().trim();
    if first.chars().count() <= MAX_REASON {
        return first.to_owned();
    }
    let mut cut: String = first.chars().take(MAX_REASON - 1).collect();
    cut.push('…');
    cut
}

fn rotated(path: &Path, index: u32) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{index}"));
    PathBuf::from(name)
}

/// `audit.jsonl` becomes `.1`, `.1` becomes `.2` ... and the one past
/// `keep` is removed.
fn rotate(path: &Path, keep: u32) -> Result<(), String> {
    let error = |e: std::io::Error| format!("rotating {}: {e}", path.display());
    if keep == 0 {
        return std::fs::remove_file(path).map_err(error);
    }
    match std::fs::remove_file(rotated(path, keep)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(error(e)),
    }
    for index in (1..keep).rev() {
        match std::fs::rename(rotated(path, index), rotated(path, index + 1)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(error(e)),
        }
    }
    std::fs::rename(path, rotated(path, 1)).map_err(error)
}

fn open_append(path: &Path) -> Result<File, String> {
    let mut options = OpenOptions::new();
    options.append(true).create(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    options
        .open(path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(audit: &Audit, action: &str, target: &str) {
        audit.record("admin", None, action, target, Outcome::Ok, "");
    }

    #[test]
    fn lines_are_json_in_a_private_file() {
        let dir = tempfile::tempdir().unwrap();
        let audit = Audit::open(dir.path(), Rotation::default());
        audit.record(
            "ops",
            Some("127.0.0.1:5000".parse().unwrap()),
            "keys.revoke",
            "nightly",
            Outcome::Refused,
            "not found",
        );
        let path = dir.path().join(FILE_NAME);
        let text = std::fs::read_to_string(&path).unwrap();
        let value: serde_json::Value = serde_json::from_str(text.trim_end()).unwrap();
        assert_eq!(value["actor"], "ops");
        assert_eq!(value["source"], "127.0.0.1:5000");
        assert_eq!(value["action"], "keys.revoke");
        assert_eq!(value["target"], "nightly");
        assert_eq!(value["outcome"], "refused");
        assert_eq!(value["reason"], "not found");
        assert!(value["time"].as_str().unwrap().ends_with('Z'));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

    #[test]
    fn reasons_are_kept_short() {
        let audit = Audit::in_memory();
        let long = format!("first line {}\nsecond line", "x".repeat(500));
        audit.record("local", None, "config.reload", "", Outcome::Refused, &long);
        let reason = audit.read(&Query::default()).remove(0).reason;
        assert_eq!(reason.chars().count(), MAX_REASON);
        assert!(reason.starts_with("first line") && reason.ends_with('…'));
    }

    #[test]
    fn rotation_keeps_the_retention() {
        let dir = tempfile::tempdir().unwrap();
        let rotation = Rotation {
            max_bytes: 300,
            keep_files: 2,
        };
        let audit = Audit::open(dir.path(), rotation);
        for index in 0..40 {
            record(&audit, "queue.pause", &format!("tier-{index}"));
        }
        let path = dir.path().join(FILE_NAME);
        for file in [path.clone(), rotated(&path, 1), rotated(&path, 2)] {
            let size = std::fs::metadata(&file).unwrap().len();
            assert!(size > 0 && size <= 300, "{}: {size}", file.display());
        }
        assert!(!rotated(&path, 3).exists());
        // The newest entries survive, in order, across the files.
        let read = audit.read(&Query::default());
        assert!(read.len() < 40);
        assert_eq!(read.last().unwrap().target, "tier-39");
        let targets: Vec<usize> = read
            .iter()
            .map(|e| e.target["tier-".len()..].parse().unwrap())
            .collect();
        assert!(targets.windows(2).all(|pair| pair[1] == pair[0] + 1));
    }

    #[test]
    fn queries_filter_by_action_time_and_limit() {
        let audit = Audit::in_memory();
        record(&audit, "keys.add", "a");
        record(&audit, "keys.revoke", "a");
        record(&audit, "keysmith", "b");
        record(&audit, "queue.flush", "low");
        let actions = |query: Query| -> Vec<String> {
            audit.read(&query).into_iter().map(|e| e.action).collect()
        };
        assert_eq!(
            actions(Query {
                action: Some("keys".into()),
                ..Query::default()
            }),
            ["keys.add", "keys.revoke"]
        );
        assert_eq!(
            actions(Query {
                limit: 1,
                ..Query::default()
            }),
            ["queue.flush"]
        );
        let later = SystemTime::now() + std::time::Duration::from_secs(60);
        assert!(
            actions(Query {
                since: Some(later),
                ..Query::default()
            })
            .is_empty()
        );
    }

    #[test]
    fn without_a_state_dir_the_trail_is_a_bounded_ring() {
        let dir = tempfile::tempdir().unwrap();
        let audit = Audit::open(&dir.path().join("missing"), Rotation::default());
        for index in 0..MEMORY_ENTRIES + 5 {
            record(&audit, "queue.pause", &index.to_string());
        }
        let read = audit.read(&Query::default());
        assert_eq!(read.len(), MEMORY_ENTRIES);
        assert_eq!(read[0].target, "5");
        assert!(!dir.path().join("missing").exists());
    }
}
