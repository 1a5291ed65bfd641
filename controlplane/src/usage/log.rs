//! The day's append log: `state_dir/usage/YYYY-MM-DD.G.jsonl`, one JSON line per batch
//! applied (its hour, its data plane's name, epoch and number, and its rows), appended
//! and synced before the batch is acknowledged, so that a report costs the size of its
//! batch, not of the day. The day file (`YYYY-MM-DD.json`, [`super::file`]) is the log
//! compacted: it is written whole, atomically, with generation `G + 1` when the log
//! passes [`COMPACT_BYTES`], when a new day starts, or after a write failed; the logs of
//! a generation below the day file's are already in it and are removed (a crash before
//! their removal leaves them to the next start, which ignores them).
//!
//! A line is written in one `write` of the whole line; a line a crash cut short (the last
//! one) does not parse and is skipped with a warning: its batch was not acknowledged, so
//! its data plane sends it again.
//!
//! ```json
//! {"hour": 6, "node": "gpu-box", "epoch": 1796191962000, "seq": 1201,
//!  "rows": [{"client": "webui/alice", "model": "llama3", "gpu_ns": 2000000000,
//!            "prompt_tokens": 10, "completion_tokens": 40, "requests": 1,
//!            "embedding_inputs": 0, "cached_inputs": 0}]}
//! ```

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use oqp_proto::policy::v1 as wire;
use serde::{Deserialize, Serialize};

use super::ledger::Totals;

/// A log past this many bytes is compacted into its day file at the next batch.
pub const COMPACT_BYTES: u64 = 8 << 20;

/// The log batches are appended to now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Log {
    /// Its UTC day (Unix days).
    pub day: i64,
    /// Its generation: the day file's, which holds every log below it.
    pub generation: u64,
    /// Its size so far.
    pub bytes: u64,
}

/// One batch, as logged.
#[derive(Debug, Serialize, Deserialize)]
pub struct Line {
    /// The hour of the day it was applied in.
    pub hour: u8,
    /// The data plane's name.
    pub node: String,
    /// Its epoch.
    pub epoch: u64,
    /// Its number.
    pub seq: u64,
    /// Its rows, as applied (bounded).
    pub rows: Vec<Row>,
}

/// One row of a logged batch.
#[derive(Debug, Serialize, Deserialize)]
pub struct Row {
    /// The client.
    pub client: String,
    /// The model.
    pub model: String,
    /// What it used.
    #[serde(flatten)]
    pub totals: Totals,
}

impl Line {
    /// The line of `batch` from `node`, applied at `now` (Unix seconds).
    pub fn of(node: &str, batch: &wire::UsageBatch, now: i64) -> Self {
        Self {
            hour: u8::try_from(now.rem_euclid(86_400) / 3600).unwrap_or(0),
            node: node.to_owned(),
            epoch: batch.epoch,
            seq: batch.seq,
            rows: batch
                .rows
                .iter()
                .map(|row| Row {
                    client: row.client_id.clone(),
                    model: row.model.clone(),
                    totals: Totals::from_row(row),
                })
                .collect(),
        }
    }
}

/// The log of `day` at `generation` in `dir`.
pub fn path(dir: &Path, day: i64, generation: u64) -> PathBuf {
    dir.join(format!("{}.{generation}.jsonl", day_name(day)))
}

/// The day and generation of a log file's name.
pub fn parse_name(name: &str) -> Option<(&str, u64)> {
    let stem = name.strip_suffix(".jsonl")?;
    let (day, generation) = stem.rsplit_once('.')?;
    Some((day, generation.parse().ok()?))
}

/// Appends `line` to `log` in `dir` (created with mode 0600) and syncs it; the log's new
/// size.
pub fn append(dir: &Path, log: &Log, line: &Line) -> io::Result<u64> {
    let mut bytes = serde_json::to_vec(line).map_err(io::Error::other)?;
    bytes.push(b'\n');
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    let mut file = OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path(dir, log.day, log.generation))?;
    file.write_all(&bytes)?;
    file.sync_data()?;
    if log.bytes == 0 {
        // A new file: its directory entry must be durable too.
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(log.bytes + bytes.len() as u64)
}

/// The lines of the log at `path` that parse, in order; a line that does not (one a
/// crash cut short) is skipped with a warning.
pub fn read(path: &Path) -> io::Result<Vec<Line>> {
    let bytes = std::fs::read(path)?;
    let mut lines = Vec::new();
    for (number, text) in bytes.split(|byte| *byte == b'\n').enumerate() {
        if text.is_empty() {
            continue;
        }
        match serde_json::from_slice::<Line>(text) {
            Ok(line) => lines.push(line),
            Err(error) => tracing::warn!(
                file = %path.display(),
                line = number + 1,
                %error,
                "a usage log line could not be read (cut short by a crash?); skipped: its \
                 batch was not acknowledged, so its data plane sends it again"
            ),
        }
    }
    Ok(lines)
}

/// `YYYY-MM-DD` of Unix day `day`.
pub fn day_name(day: i64) -> String {
    let at = UNIX_EPOCH + Duration::from_secs(day.max(0).unsigned_abs() * 86_400);
    humantime::format_rfc3339_seconds(at).to_string()[..10].to_owned()
}
