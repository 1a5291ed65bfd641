//! The totals on disk: `state_dir/usage/YYYY-MM-DD.json`, one file per UTC day with its
//! hours, written atomically with mode 0600 (the key store's writing) whenever a batch
//! changes it. Each file also carries the last batch applied from each data plane as of
//! its writing, so that a restarted control plane does not apply a resent batch twice, and
//! the budgets already announced as exceeded: the newest file's lists are the ones in
//! force.
//!
//! ```json
//! {"format": 1, "day": "2026-12-02",
//!  "hours": [{"hour": 6, "client": "batch", "model": "llama3", "gpu_ns": 7200000000000,
//!             "prompt_tokens": 120, "completion_tokens": 3400, "requests": 12,
//!             "embedding_inputs": 0, "cached_inputs": 0}],
//!  "applied": {"gpu-box": [4821937, 1200]}, "announced": [["batch", 1796169600]]}
//! ```

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::ledger::{Hour, KEEP_DAYS, Ledger, Totals};
use crate::keystore::file::{read, remove_temporaries, write_atomic};

const FORMAT: u32 = 1;

#[derive(Serialize, Deserialize)]
struct DayFile {
    format: u32,
    day: String,
    hours: Vec<StoredRow>,
    #[serde(default)]
    applied: BTreeMap<String, [u64; 2]>,
    /// Budgets announced as exceeded: (client, window start).
    #[serde(default)]
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

/// `YYYY-MM-DD` of Unix day `day`.
pub fn day_name(day: i64) -> String {
    let at = UNIX_EPOCH + Duration::from_secs(day.max(0).unsigned_abs() * 86_400);
    humantime::format_rfc3339_seconds(at).to_string()[..10].to_owned()
}

fn day_of(name: &str) -> Option<i64> {
    let at = humantime::parse_rfc3339(&format!("{name}T00:00:00Z")).ok()?;
    let seconds = at.duration_since(UNIX_EPOCH).ok()?.as_secs();
    i64::try_from(seconds / 86_400).ok()
}

/// Writes day `day` of `ledger` (its hours and the batches applied so far).
pub fn write_day(dir: &Path, ledger: &Ledger, day: i64) -> io::Result<()> {
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
        applied: ledger
            .applied
            .iter()
            .map(|(node, (epoch, seq))| (node.clone(), [*epoch, *seq]))
            .collect(),
        announced: ledger.announced.iter().cloned().collect(),
    };
    let mut bytes = serde_json::to_vec(&file).map_err(io::Error::other)?;
    bytes.push(b'\n');
    write_atomic(&dir.join(format!("{}.json", day_name(day))), &bytes)
}

/// Removes the files of `days`.
pub fn remove_days(dir: &Path, days: &[i64]) {
    for day in days {
        let _ = std::fs::remove_file(dir.join(format!("{}.json", day_name(*day))));
    }
}

/// The ledger the files in `dir` hold, the days older than [`KEEP_DAYS`] at `now` (Unix
/// seconds) left out and removed. A file that does not parse stops the start: the error
/// names it.
pub fn load(dir: &Path, now: i64) -> Result<Ledger, String> {
    let mut ledger = Ledger::default();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(ledger),
        Err(error) => return Err(format!("{}: {error}", dir.display())),
    };
    let first_day = now.div_euclid(86_400) - KEEP_DAYS + 1;
    let mut newest: Option<i64> = None;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(day) = name.strip_suffix(".json").and_then(day_of) else {
            continue;
        };
        let path = entry.path();
        remove_temporaries(&path);
        if day < first_day {
            let _ = std::fs::remove_file(&path);
            continue;
        }
        let bytes = read(&path)
            .map_err(|error| format!("{}: {error}", path.display()))?
            .unwrap_or_default();
        let file: DayFile = serde_json::from_slice(&bytes)
            .map_err(|error| format!("{}: {error}", path.display()))?;
        if file.format != FORMAT {
            return Err(format!(
                "{}: format {} is not understood by this version (it reads format {FORMAT})",
                path.display(),
                file.format
            ));
        }
        for row in &file.hours {
            ledger
                .hours
                .entry(day * 24 + i64::from(row.hour.min(23)))
                .or_insert_with(Hour::default)
                .add(&row.client, &row.model, &row.totals);
        }
        if newest.is_none_or(|newest| day > newest) {
            newest = Some(day);
            ledger.applied = file
                .applied
                .into_iter()
                .map(|(node, [epoch, seq])| (node, (epoch, seq)))
                .collect();
            ledger.announced = file.announced.into_iter().collect();
        }
    }
    Ok(ledger)
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
        // 90 days later the file is gone.
        let later = NOW + 90 * 86_400;
        assert_eq!(load(&dir, later).unwrap(), Ledger::default());
        assert!(!path.exists());
    }

    #[test]
    fn a_damaged_file_is_named() {
        let state = tempfile::tempdir().unwrap();
        let dir = dir(state.path());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("2026-12-02.json"), b"{not json").unwrap();
        let error = load(&dir, NOW).unwrap_err();
        assert!(error.contains("2026-12-02.json"), "{error}");
    }
}
