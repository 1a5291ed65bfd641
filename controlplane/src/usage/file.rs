//! The totals on disk: `state_dir/usage/YYYY-MM-DD.json`, one file per UTC day with its
//! hours, written atomically with mode 0600 (the key store's writing), continued by the
//! day's append log `YYYY-MM-DD.G.jsonl` ([`super::log`]), which each batch is appended
//! to; the day file is written whole only when the log is compacted into it. Beside them, `state_dir/usage/state.json` (the same writing) carries the
//! last batch applied from each data plane, so that a restarted control plane does not
//! apply a resent batch twice, and the budgets already announced as exceeded. It is a file
//! of its own so that no day file (one dated in the future by a clock that was wrong, say)
//! decides them; a directory written before it existed takes them from its newest day.
//!
//! Each day file also carries the batches applied as of its writing, in the same atomic
//! write as the totals they added to: a crash between the day file and the state file
//! cannot count a batch twice, since what was applied is the newest of the two (batch
//! numbers only grow), whatever a file's date. A day file (or the state file) that cannot
//! be read or parsed is set aside as `NAME.unreadable` with an error in the log, and the
//! start goes on without it (the state file's lists then come from the day files); only a
//! file of a format this version does not know stops the start.
//!
//! ```json
//! {"format": 1, "day": "2026-12-02",
//!  "hours": [{"hour": 6, "client": "batch", "model": "llama3", "gpu_ns": 7200000000000,
//!             "prompt_tokens": 120, "completion_tokens": 3400, "requests": 12,
//!             "embedding_inputs": 0, "cached_inputs": 0}]}
//! ```
//!
//! ```json
//! {"format": 1, "applied": {"gpu-box": [1796191962000, 1200]},
//!  "announced": [["batch", 1796169600]]}
//! ```

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};

use super::ledger::{Hour, KEEP_DAYS, Ledger, Totals};
use super::log::{Log, day_name};
use crate::state_file::{read, remove_temporaries, write_atomic};

const FORMAT: u32 = 1;

/// The name of the state file in the usage directory.
const STATE_FILE: &str = "state.json";

#[derive(Serialize, Deserialize)]
struct DayFile {
    format: u32,
    day: String,
    hours: Vec<StoredRow>,
    /// The batches applied as of this file's writing (the state file has them too; the
    /// newest of both is taken). Earlier versions wrote none, or wrote them here only.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    applied: BTreeMap<String, [u64; 2]>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    announced: Vec<(String, i64)>,
    /// The generation of the day's append log that continues it ([`super::log`]): the
    /// logs below it are in this file already.
    #[serde(default, skip_serializing_if = "is_zero")]
    generation: u64,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

#[derive(Serialize, Deserialize)]
struct StateFile {
    format: u32,
    /// Node → [epoch, seq] of the last batch applied.
    applied: BTreeMap<String, [u64; 2]>,
    /// Budgets announced as exceeded: (client, window start).
    announced: Vec<(String, i64)>,
}

#[derive(Serialize, Deserialize)]
struct StoredRow {
    hour: u8,
    client: String,
    model: String,
    #[serde(flatten)]
    totals: Totals,
}

/// The directory of the day files.
pub fn dir(state_dir: &Path) -> PathBuf {
    state_dir.join("usage")
}

fn day_of(name: &str) -> Option<i64> {
    let at = humantime::parse_rfc3339(&format!("{name}T00:00:00Z")).ok()?;
    let seconds = at.duration_since(UNIX_EPOCH).ok()?.as_secs();
    i64::try_from(seconds / 86_400).ok()
}

/// Writes day `day` of `ledger` (its hours), then the state file (the batches applied
/// so far and the budgets announced).
pub fn write_day(dir: &Path, ledger: &Ledger, day: i64) -> io::Result<()> {
    write_day_at(dir, ledger, day, 0)
}

/// [`write_day`], continued by the day's log of `generation`.
pub fn write_day_at(dir: &Path, ledger: &Ledger, day: i64, generation: u64) -> io::Result<()> {
    let mut hours = Vec::new();
    for (hour, totals) in ledger.hours.range(day * 24..(day + 1) * 24) {
        let mut rows: Vec<_> = totals.rows.iter().collect();
        rows.sort_by(|a, b| a.0.cmp(b.0));
        for ((client, model), totals) in rows {
            hours.push(StoredRow {
                hour: u8::try_from(hour - day * 24).unwrap_or(0),
                client: client.clone(),
                model: model.clone(),
                totals: *totals,
            });
        }
    }
    let file = DayFile {
        format: FORMAT,
        day: day_name(day),
        hours,
        applied: applied_lists(ledger),
        announced: Vec::new(),
        generation,
    };
    let mut bytes = serde_json::to_vec(&file).map_err(io::Error::other)?;
    bytes.push(b'\n');
    write_atomic(&dir.join(format!("{}.json", day_name(day))), &bytes)?;
    write_state(dir, ledger)
}

fn applied_lists(ledger: &Ledger) -> BTreeMap<String, [u64; 2]> {
    ledger
        .applied
        .iter()
        .map(|(node, (epoch, seq))| (node.clone(), [*epoch, *seq]))
        .collect()
}

/// Sets an unreadable file aside (`NAME.unreadable`), so that the start goes on and the
/// file is kept for the operator, never overwritten.
fn set_aside(path: &Path, error: &str) {
    let mut aside = path.as_os_str().to_owned();
    aside.push(".unreadable");
    match std::fs::rename(path, &aside) {
        Ok(()) => tracing::error!(
            file = %path.display(),
            kept_as = %Path::new(&aside).display(),
            %error,
            "a usage file could not be read; it was set aside and its figures are not loaded"
        ),
        Err(rename) => tracing::error!(
            file = %path.display(),
            %error,
            %rename,
            "a usage file could not be read, nor set aside; its figures are not loaded"
        ),
    }
}

/// Reads and parses `path`, `None` (set aside) when it cannot be; `Err` only for a format
/// this version does not understand.
fn read_json<T: serde::de::DeserializeOwned>(
    path: &Path,
    format: impl Fn(&T) -> u32,
) -> Result<Option<T>, String> {
    let parsed = match read(path) {
        Ok(None) => return Ok(None),
        Ok(Some(bytes)) => serde_json::from_slice::<T>(&bytes).map_err(|error| error.to_string()),
        Err(error) => Err(error.to_string()),
    };
    match parsed {
        Ok(file) if format(&file) == FORMAT => Ok(Some(file)),
        Ok(file) => Err(format!(
            "{}: format {} is not understood by this version (it reads format {FORMAT})",
            path.display(),
            format(&file)
        )),
        Err(error) => {
            set_aside(path, &error);
            Ok(None)
        }
    }
}

/// Writes the state file: the batches applied so far and the budgets announced.
pub fn write_state(dir: &Path, ledger: &Ledger) -> io::Result<()> {
    let state = StateFile {
        format: FORMAT,
        applied: applied_lists(ledger),
        announced: ledger.announced.iter().cloned().collect(),
    };
    let mut bytes = serde_json::to_vec(&state).map_err(io::Error::other)?;
    bytes.push(b'\n');
    write_atomic(&dir.join(STATE_FILE), &bytes)
}

/// Removes the files of `days`: their day files and logs.
pub fn remove_days(dir: &Path, days: &[i64]) {
    if days.is_empty() {
        return;
    }
    let prefixes: Vec<String> = days
        .iter()
        .map(|day| format!("{}.", day_name(*day)))
        .collect();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if prefixes
            .iter()
            .any(|prefix| name.starts_with(prefix.as_str()))
        {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The ledger the files in `dir` hold, the days older than [`KEEP_DAYS`] at `now` (Unix
/// seconds) left out and removed. A file that cannot be read or parsed is set aside; one of
/// a format this version does not understand stops the start (the error names it).
pub fn load(dir: &Path, now: i64) -> Result<Ledger, String> {
    load_with_log(dir, now).map(|(ledger, _)| ledger)
}

/// [`load`], and the log today's batches are appended to ([`super::log`]).
pub fn load_with_log(dir: &Path, now: i64) -> Result<(Ledger, Log), String> {
    let mut ledger = Ledger::default();
    let today = now.div_euclid(86_400);
    let mut log = Log {
        day: today,
        ..Log::default()
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok((ledger, log)),
        Err(error) => return Err(format!("{}: {error}", dir.display())),
    };
    let first_day = today - KEEP_DAYS + 1;
    // Without a state file (a directory written by an earlier version), the announcements
    // of the newest day that has them.
    let mut announced: Option<(i64, Vec<(String, i64)>)> = None;
    // The newest batch each day file says was applied.
    let mut applied: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    // Each day file's generation, and the logs found.
    let mut generations: BTreeMap<i64, u64> = BTreeMap::new();
    let mut logs: Vec<(i64, u64, PathBuf)> = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some((day, generation)) = super::log::parse_name(&name)
            && let Some(day) = day_of(day)
        {
            logs.push((day, generation, entry.path()));
            continue;
        }
        let Some(day) = name.strip_suffix(".json").and_then(day_of) else {
            continue;
        };
        let path = entry.path();
        remove_temporaries(&path);
        if day < first_day {
            let _ = std::fs::remove_file(&path);
            continue;
        }
        let Some(file) = read_json::<DayFile>(&path, |file| file.format)? else {
            continue;
        };
        generations.insert(day, file.generation);
        for (node, [epoch, seq]) in &file.applied {
            let newest = applied.entry(node.clone()).or_default();
            *newest = (*newest).max((*epoch, *seq));
        }
        for row in &file.hours {
            ledger
                .hours
                .entry(day * 24 + i64::from(row.hour.min(23)))
                .or_insert_with(Hour::default)
                .add(&row.client, &row.model, &row.totals);
        }
        if !file.announced.is_empty() && announced.as_ref().is_none_or(|(newest, _)| day > *newest)
        {
            announced = Some((day, file.announced));
        }
    }
    // The logs, in order: those the day file holds already are removed, the others replayed.
    logs.sort();
    for (day, generation, path) in logs {
        let compacted = generations.get(&day).copied().unwrap_or(0);
        if day < first_day || generation < compacted {
            let _ = std::fs::remove_file(&path);
            continue;
        }
        let lines =
            super::log::read(&path).map_err(|error| format!("{}: {error}", path.display()))?;
        for line in lines {
            let hour = ledger
                .hours
                .entry(day * 24 + i64::from(line.hour.min(23)))
                .or_insert_with(Hour::default);
            for row in &line.rows {
                hour.add(&row.client, &row.model, &row.totals);
            }
            let newest = applied.entry(line.node).or_default();
            *newest = (*newest).max((line.epoch, line.seq));
        }
        if day == today {
            log.generation = generation;
            log.bytes = std::fs::metadata(&path).map_or(0, |meta| meta.len());
        }
    }
    if log.bytes == 0 {
        log.generation = generations.get(&today).copied().unwrap_or(0);
    }
    let state_path = dir.join(STATE_FILE);
    remove_temporaries(&state_path);
    match read_json::<StateFile>(&state_path, |state| state.format)? {
        Some(state) => {
            for (node, [epoch, seq]) in state.applied {
                let newest = applied.entry(node).or_default();
                *newest = (*newest).max((epoch, seq));
            }
            ledger.announced = state.announced.into_iter().collect();
        }
        None => {
            if let Some((_, lists)) = announced {
                ledger.announced = lists.into_iter().collect();
            }
        }
    }
    ledger.applied = applied;
    collapse_past_days(dir, &mut ledger, today);
    Ok((ledger, log))
}

/// Writes `day`, whose users `ledger` keeps per day now ([`Ledger::collapse_day`]), whole,
/// with a generation above its logs', and removes them (the file holds them).
pub fn write_collapsed(dir: &Path, ledger: &Ledger, day: i64) -> io::Result<()> {
    let name = day_name(day);
    let logs: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)?
        .flatten()
        .filter_map(|entry| {
            let file = entry.file_name().to_string_lossy().into_owned();
            let (of, generation) = super::log::parse_name(&file)?;
            (of == name).then(|| (generation, entry.path()))
        })
        .collect();
    let generation = logs
        .iter()
        .map(|(generation, _)| generation.saturating_add(1))
        .max()
        .unwrap_or(1);
    write_day_at(dir, ledger, day, generation)?;
    for (_, path) in logs {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// Keeps the users of every day before yesterday at `today` per day in `ledger`, and
/// rewrites the files of those that changed (a directory written before days were kept
/// per day, or a control plane stopped across midnight); a file that cannot be written is
/// logged and left as it was (its figures are the same).
fn collapse_past_days(dir: &Path, ledger: &mut Ledger, today: i64) {
    for day in ledger.days_between(today - KEEP_DAYS, today - 1) {
        let (moved, _) = ledger.collapse_day(day);
        if moved && let Err(error) = write_collapsed(dir, ledger, day) {
            tracing::warn!(
                dir = %dir.display(),
                day = %day_name(day),
                %error,
                "a past day's usage file could not be rewritten with its users kept per day"
            );
        }
    }
}

/// Removes the logs of `day` below `generation` (compacted into its day file).
pub fn remove_logs_below(dir: &Path, day: i64, generation: u64) {
    for below in 0..generation {
        let _ = std::fs::remove_file(super::log::path(dir, day, below));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use oqp_proto::policy::v1 as wire;

    use super::*;

    // 2026-12-02 06:12:42 UTC.
    const NOW: i64 = 1_796_191_962;

    #[test]
    fn days_are_named_by_their_utc_date() {
        assert_eq!(day_name(NOW / 86_400), "2026-12-02");
        assert_eq!(day_of("2026-12-02"), Some(NOW / 86_400));
        assert_eq!(day_of("yesterday"), None);
    }

    #[test]
    fn a_written_day_loads_back_with_the_batches_applied() {
        let state = tempfile::tempdir().unwrap();
        let dir = dir(state.path());
        let mut ledger = Ledger::default();
        let batch = wire::UsageBatch {
            epoch: 5,
            seq: 3,
            rows: vec![wire::UsageRow {
                client_id: "chat".into(),
                model: "llama3".into(),
                gpu_ns: 42,
                requests: 1,
                ..wire::UsageRow::default()
            }],
        };
        ledger.apply("box", &batch, NOW);
        ledger.announced.insert(("chat".into(), 1_796_169_600));
        write_day(&dir, &ledger, NOW / 86_400).unwrap();
        let path = dir.join("2026-12-02.json");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let loaded = load(&dir, NOW).unwrap();
        assert_eq!(loaded, ledger);
        // 90 days later the day file is gone; what was applied and announced is kept.
        let later = NOW + 90 * 86_400;
        let loaded = load(&dir, later).unwrap();
        assert!(loaded.hours.is_empty());
        assert_eq!(loaded.applied, ledger.applied);
        assert!(!path.exists());
    }

    #[test]
    fn a_day_file_from_the_future_does_not_decide_what_was_applied() {
        let state = tempfile::tempdir().unwrap();
        let dir = dir(state.path());
        let mut ledger = Ledger::default();
        let batch = |epoch, seq| wire::UsageBatch {
            epoch,
            seq,
            rows: vec![wire::UsageRow {
                client_id: "chat".into(),
                model: "llama3".into(),
                requests: 1,
                ..wire::UsageRow::default()
            }],
        };
        // Written a week ahead by a clock that was wrong, when node box was at (5, 3).
        let ahead = NOW + 7 * 86_400;
        ledger.apply("box", &batch(5, 3), ahead);
        write_day(&dir, &ledger, ahead / 86_400).unwrap();
        // The clock right again: box moves on to (5, 9), written today.
        ledger.apply("box", &batch(5, 9), NOW);
        ledger.announced.insert(("chat".into(), 1_796_169_600));
        write_day(&dir, &ledger, NOW / 86_400).unwrap();
        let loaded = load(&dir, NOW).unwrap();
        assert_eq!(
            loaded.applied["box"],
            (5, 9),
            "the state file's, not the newest day's"
        );
        assert_eq!(loaded.announced.len(), 1);
        let path = dir.join(STATE_FILE);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // Without the state file: the newest batch any day file records (today's, not the
        // one dated latest), and the announcements of the newest day that lists them (a
        // directory from before the state file).
        std::fs::remove_file(&path).unwrap();
        let legacy = serde_json::json!({"format": 1, "day": "2026-12-03", "hours": [],
            "applied": {"box": [5, 4]}, "announced": [["chat", 1_796_169_600]]});
        std::fs::write(dir.join("2026-12-03.json"), legacy.to_string()).unwrap();
        let loaded = load(&dir, NOW).unwrap();
        assert_eq!(loaded.applied["box"], (5, 9));
        assert_eq!(loaded.announced.len(), 1);
    }

    #[test]
    fn a_damaged_file_is_set_aside_and_the_others_load() {
        let state = tempfile::tempdir().unwrap();
        let dir = dir(state.path());
        let mut ledger = Ledger::default();
        ledger.apply("box", &one(5, 3), NOW - 86_400);
        write_day(&dir, &ledger, NOW / 86_400 - 1).unwrap();
        std::fs::write(dir.join("2026-12-02.json"), b"{not json").unwrap();
        let loaded = load(&dir, NOW).unwrap();
        assert_eq!(loaded.client_since("chat", 0).requests, 1, "yesterday's");
        assert_eq!(loaded.applied["box"], (5, 3));
        assert!(
            dir.join("2026-12-02.json.unreadable").exists(),
            "kept aside"
        );
        assert!(!dir.join("2026-12-02.json").exists());
        // A damaged state file too: the lists come from the day files.
        std::fs::write(dir.join(STATE_FILE), b"\0\0").unwrap();
        let loaded = load(&dir, NOW).unwrap();
        assert_eq!(loaded.applied["box"], (5, 3));
        // A format this version does not know stops the start, named.
        std::fs::write(
            dir.join("2026-11-30.json"),
            br#"{"format": 9, "day": "2026-11-30", "hours": []}"#,
        )
        .unwrap();
        let error = load(&dir, NOW).unwrap_err();
        assert!(error.contains("2026-11-30.json"), "{error}");
    }

    #[test]
    fn a_crash_between_the_day_file_and_the_state_file_counts_no_batch_twice() {
        let state = tempfile::tempdir().unwrap();
        let dir = dir(state.path());
        let mut ledger = Ledger::default();
        ledger.apply("box", &one(5, 2), NOW);
        write_day(&dir, &ledger, NOW / 86_400).unwrap();
        let before = ledger.clone();
        // Batch 3 is added and its day file written; the state file is not (a crash).
        ledger.apply("box", &one(5, 3), NOW);
        write_day(&dir, &ledger, NOW / 86_400).unwrap();
        write_state(&dir, &before).unwrap();
        let mut loaded = load(&dir, NOW).unwrap();
        assert_eq!(loaded.applied["box"], (5, 3));
        // The resend of batch 3 after the restart adds nothing.
        assert_eq!(
            loaded.apply("box", &one(5, 3), NOW),
            crate::usage::Applied::Already
        );
        assert_eq!(loaded.client_since("chat", 0).requests, 2);
    }

    fn one(epoch: u64, seq: u64) -> wire::UsageBatch {
        wire::UsageBatch {
            epoch,
            seq,
            rows: vec![wire::UsageRow {
                client_id: "chat".into(),
                model: "llama3".into(),
                requests: 1,
                ..wire::UsageRow::default()
            }],
        }
    }
}
