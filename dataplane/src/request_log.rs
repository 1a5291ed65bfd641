//! The request log (`logging.requests`, opt-in): one JSON line per request the queued path
//! answered or refused, in one file per UTC day beside the configured path
//! (`requests.jsonl` → `requests.2026-12-04.jsonl`), mode 0600, day files older than
//! `retention_days` deleted.
//!
//! Off the request path: a request hands its [`Entry`] to a bounded channel without waiting
//! ([`RequestLog::record`]); when the channel is full the entry is dropped and counted
//! (`oqp_request_log_dropped_total`), never waited for. One thread (started with the first
//! entry, so a data plane without the log has none) formats and appends each line with one
//! write to a file opened for appending. A write that fails (a full disk, a path that cannot
//! be written) loses that line, is counted (`oqp_request_log_failures_total`) and is logged at
//! most once a minute; requests are served as before.
//!
//! A key with `capture: {max_bytes}` also has its request and answer bodies in its lines,
//! cut at the limit ([`capture`]).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;
use tokio::sync::mpsc;

use crate::metrics::Metrics;

pub mod capture;

pub use capture::Capture;

/// Entries waiting to be written; past it, new ones are dropped.
pub const CAPACITY: usize = 4096;

/// Where failures are logged at most once.
const WARN_EVERY: Duration = Duration::from_secs(60);

pub use crate::policy::RequestLogSettings as Settings;

/// One request's line. Field names are the log's format (documented in the README).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Entry {
    /// When the request ended (RFC 3339, UTC, milliseconds).
    pub time: String,
    /// `X-Request-ID`.
    pub request_id: String,
    /// The client (an app's user as `<app>/<user>`).
    pub client: String,
    /// The app's end user, for a request of an app key that named one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// The path asked for.
    pub route: String,
    /// The model the request named.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The host that answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// The HTTP status answered.
    pub status: u16,
    /// The tier it ran in.
    pub tier: &'static str,
    /// Milliseconds from admission to its slot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_wait_ms: Option<u64>,
    /// Milliseconds from sending it upstream to the answer's head.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttfb_ms: Option<u64>,
    /// Milliseconds from admission to the answer's end (or the refusal).
    pub duration_ms: u64,
    /// Prompt tokens the answer reported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    /// Completion tokens the answer reported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_tokens: Option<u64>,
    /// Prompt tokens cached where it ran (the engine's figure, else affinity's estimate).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
    /// Conversation affinity's outcome, when it placed the request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity: Option<&'static str>,
    /// Why oqp refused or failed the request itself, as its error says.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The request's body and its answer, for a key that captures them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capture: Option<Capture>,
}

/// The request log of one data plane: a bounded channel to its writer thread.
#[derive(Debug, Default)]
pub struct RequestLog {
    sender: OnceLock<mpsc::Sender<(Arc<Settings>, Entry)>>,
}

impl RequestLog {
    /// Hands `entry` to the writer under `settings`, or drops it (counted) when the channel
    /// is full. Never waits.
    pub fn record(&self, settings: &Arc<Settings>, entry: Entry, metrics: &Arc<Metrics>) {
        let sender = self.sender.get_or_init(|| spawn_writer(metrics.clone()));
        if sender.try_send((settings.clone(), entry)).is_err() {
            metrics.request_log_dropped();
        }
    }
}

/// Starts the writer thread; it ends when the log is dropped.
fn spawn_writer(metrics: Arc<Metrics>) -> mpsc::Sender<(Arc<Settings>, Entry)> {
    let (sender, mut receiver) = mpsc::channel::<(Arc<Settings>, Entry)>(CAPACITY);
    let spawned = std::thread::Builder::new()
        .name("oqp-request-log".into())
        .spawn(move || {
            let mut writer = Writer::new(metrics);
            while let Some((settings, entry)) = receiver.blocking_recv() {
                writer.write(&settings, &entry, SystemTime::now());
            }
        });
    if let Err(error) = spawned {
        // The receiver is gone with the closure: every entry is then dropped and counted.
        tracing::error!(%error, "the request log's writer could not start");
    }
    sender
}

/// The writer's state: the day file open now and when a failure was last logged.
struct Writer {
    metrics: Arc<Metrics>,
    open: Option<(PathBuf, File)>,
    last_warning: Option<Instant>,
}

impl Writer {
    fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            metrics,
            open: None,
            last_warning: None,
        }
    }

    fn write(&mut self, settings: &Settings, entry: &Entry, now: SystemTime) {
        let mut line = match serde_json::to_vec(entry) {
            Ok(line) => line,
            Err(_) => return,
        };
        line.push(b'\n');
        let day = day_of(now);
        let path = day_file(&settings.file, &day);
        if self.open.as_ref().is_none_or(|(open, _)| *open != path) {
            self.open = None;
            remove_old(&settings.file, &day, settings.retention_days);
            match open_day_file(&path) {
                Ok(file) => self.open = Some((path.clone(), file)),
                Err(error) => return self.failed(&path, &error),
            }
        }
        if let Some((_, file)) = self.open.as_mut()
            && let Err(error) = file.write_all(&line)
        {
            // Opened again for the next line: the file may have been moved or repaired.
            self.open = None;
            self.failed(&path, &error);
        }
    }

    fn failed(&mut self, path: &Path, error: &std::io::Error) {
        self.metrics.request_log_failed();
        let now = Instant::now();
        if self
            .last_warning
            .is_none_or(|last| now.duration_since(last) >= WARN_EVERY)
        {
            self.last_warning = Some(now);
            tracing::warn!(
                path = %path.display(),
                %error,
                "the request log could not be written; lines are lost until it can \
                 (oqp_request_log_failures_total counts them; this is logged at most once \
                 a minute)"
            );
        }
    }
}

fn open_day_file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path)
}

/// `YYYY-MM-DD` (UTC) of `at`.
fn day_of(at: SystemTime) -> String {
    let text = humantime::format_rfc3339_seconds(at).to_string();
    text.get(..10).unwrap_or_default().to_owned()
}

/// The day file of `file` for `day`: the date before the extension.
pub fn day_file(file: &Path, day: &str) -> PathBuf {
    let stem = file
        .file_stem()
        .map(|stem| stem.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name = match file.extension() {
        Some(extension) => format!("{stem}.{day}.{}", extension.to_string_lossy()),
        None => format!("{stem}.{day}"),
    };
    file.with_file_name(name)
}

/// Deletes the day files of `file` more than `retention_days` before `today` (dates compare
/// as text: `YYYY-MM-DD`).
fn remove_old(file: &Path, today: &str, retention_days: u32) {
    let Some(oldest_kept) = days_before(today, retention_days.saturating_sub(1)) else {
        return;
    };
    let directory = match file.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let Ok(entries) = std::fs::read_dir(&directory) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(day) = date_in(file, &name)
            && day < oldest_kept.as_str()
        {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The date in `name` when it is a day file of `file`.
fn date_in<'a>(file: &Path, name: &'a str) -> Option<&'a str> {
    let stem = file.file_stem()?.to_str()?;
    let rest = name.strip_prefix(stem)?.strip_prefix('.')?;
    let day = rest.get(..10)?;
    let after = &rest[10..];
    let expected = file
        .extension()
        .map(|extension| format!(".{}", extension.to_string_lossy()))
        .unwrap_or_default();
    let is_date = day.bytes().enumerate().all(|(index, byte)| match index {
        4 | 7 => byte == b'-',
        _ => byte.is_ascii_digit(),
    });
    (is_date && after == expected).then_some(day)
}

/// The `YYYY-MM-DD` `days` before `day`.
fn days_before(day: &str, days: u32) -> Option<String> {
    let at = humantime::parse_rfc3339(&format!("{day}T00:00:00Z")).ok()?;
    let before = at.checked_sub(Duration::from_secs(u64::from(days) * 86_400))?;
    Some(day_of(before))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
