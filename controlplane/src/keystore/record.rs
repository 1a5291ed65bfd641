//! One stored key, and the file format: a versioned JSON document holding
//! digests and metadata, never a key.
//!
//! ```json
//! {"format": 1, "keys": [{"client_id": "batch", "key_sha256": "…64 hex…",
//!   "scope": "inference", "max_priority": "low", "default_priority": "low",
//!   "max_concurrent": 2, "weight": 1.0, "max_queued": 0, "description": "",
//!   "created_unix_ms": 1760000000000, "expires_unix_ms": 0,
//!   "previous": [{"key_sha256": "…", "until_unix_ms": 1760000060000}]}]}
//! ```
//!
//! Decoding checks everything the rest of the control plane relies on
//! (words, digests, weights, unique ids and digests), so a store that loaded
//! is a store that compiles into a valid snapshot.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::config::{Budget, BudgetWindow, Scope, Tier};

/// The format this build writes and reads.
const FORMAT: u32 = 1;

/// One client whose key lives in the store.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// The client the key identifies.
    pub client_id: String,
    /// SHA-256 of the current key.
    pub key_sha256: [u8; 32],
    /// What it may do.
    pub scope: Scope,
    /// Its tier ceiling.
    pub max_priority: Tier,
    /// Its tier when a request names none; never above `max_priority`.
    pub default_priority: Tier,
    /// Most requests in flight; 0 = unlimited.
    pub max_concurrent: u32,
    /// Fair-share weight, > 0.
    pub weight: f64,
    /// Most requests waiting; 0 = unlimited.
    pub max_queued: u32,
    /// Free text.
    pub description: String,
    /// When the current key was minted (Unix ms).
    pub created_unix_ms: i64,
    /// When the current key stops working (Unix ms); 0 = never.
    pub expires_unix_ms: i64,
    /// Replaced keys still in their grace period, oldest first.
    pub previous: Vec<PreviousKey>,
    /// Its usage budget, if it has one.
    pub budget: Option<Budget>,
    /// The models it may use, as globs; empty = every model.
    pub models: Vec<String>,
}

/// A rotated-out key that keeps working until its grace period ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreviousKey {
    /// SHA-256 of the old key.
    pub key_sha256: [u8; 32],
    /// When it stops working (Unix ms).
    pub until_unix_ms: i64,
}

impl Record {
    /// Whether the current key works at `now` (Unix ms).
    pub fn is_live(&self, now: i64) -> bool {
        self.expires_unix_ms == 0 || self.expires_unix_ms > now
    }

    /// The old keys that still work at `now`.
    pub fn live_previous(&self, now: i64) -> impl Iterator<Item = &PreviousKey> {
        self.previous
            .iter()
            .filter(move |old| old.until_unix_ms > now)
    }
}

#[derive(Serialize, Deserialize)]
struct StoreFile {
    format: u32,
    keys: Vec<StoredRecord>,
}

#[derive(Serialize, Deserialize)]
struct StoredRecord {
    client_id: String,
    key_sha256: String,
    scope: String,
    max_priority: String,
    default_priority: String,
    max_concurrent: u32,
    weight: f64,
    max_queued: u32,
    #[serde(default)]
    description: String,
    created_unix_ms: i64,
    #[serde(default)]
    expires_unix_ms: i64,
    #[serde(default)]
    previous: Vec<StoredPrevious>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    budget: Option<StoredBudget>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    models: Vec<String>,
}

#[derive(Serialize, Deserialize)]
struct StoredBudget {
    #[serde(default)]
    gpu_ns: u64,
    #[serde(default)]
    tokens: u64,
    window: String,
}

#[derive(Serialize, Deserialize)]
struct StoredPrevious {
    key_sha256: String,
    until_unix_ms: i64,
}

/// The file's bytes for `records` (pretty JSON with a trailing newline, so
/// that an operator can read and diff it).
pub(super) fn encode(records: &[Record]) -> Vec<u8> {
    let file = StoreFile {
        format: FORMAT,
        keys: records
            .iter()
            .map(|record| StoredRecord {
                client_id: record.client_id.clone(),
                key_sha256: hex::encode(record.key_sha256),
                scope: record.scope.as_str().to_owned(),
                max_priority: record.max_priority.as_str().to_owned(),
                default_priority: record.default_priority.as_str().to_owned(),
                max_concurrent: record.max_concurrent,
                weight: record.weight,
                max_queued: record.max_queued,
                description: record.description.clone(),
                created_unix_ms: record.created_unix_ms,
                expires_unix_ms: record.expires_unix_ms,
                previous: record
                    .previous
                    .iter()
                    .map(|old| StoredPrevious {
                        key_sha256: hex::encode(old.key_sha256),
                        until_unix_ms: old.until_unix_ms,
                    })
                    .collect(),
                budget: record.budget.map(|budget| StoredBudget {
                    gpu_ns: budget.gpu_ns,
                    tokens: budget.tokens,
                    window: budget.window.as_str().to_owned(),
                }),
                models: record.models.clone(),
            })
            .collect(),
    };
    // Serialising plain strings and numbers cannot fail; weights are finite.
    let mut bytes = serde_json::to_vec_pretty(&file).unwrap_or_default();
    bytes.push(b'\n');
    bytes
}

/// The records in a file's bytes, or why they are not a valid store.
pub(super) fn decode(bytes: &[u8]) -> Result<Vec<Record>, String> {
    let file: StoreFile = serde_json::from_slice(bytes).map_err(|error| error.to_string())?;
    if file.format != FORMAT {
        return Err(format!(
            "format {} is not understood by this version (it reads format {FORMAT})",
            file.format
        ));
    }
    let mut ids = HashSet::new();
    let mut digests = HashSet::new();
    let mut records = Vec::with_capacity(file.keys.len());
    for (index, stored) in file.keys.into_iter().enumerate() {
        let at = format!("keys[{index}] (client_id '{}')", stored.client_id);
        let record = decode_record(stored).map_err(|reason| format!("{at}: {reason}"))?;
        if !ids.insert(record.client_id.clone()) {
            return Err(format!("{at}: duplicate client_id"));
        }
        for digest in std::iter::once(&record.key_sha256)
            .chain(record.previous.iter().map(|old| &old.key_sha256))
        {
            if !digests.insert(*digest) {
                return Err(format!("{at}: a key digest appears twice"));
            }
        }
        records.push(record);
    }
    Ok(records)
}

fn decode_record(stored: StoredRecord) -> Result<Record, String> {
    if stored.client_id.trim().is_empty() {
        return Err("empty client_id".to_owned());
    }
    let scope = word::<Scope>(&stored.scope, "scope")?;
    let max_priority = word::<Tier>(&stored.max_priority, "max_priority")?;
    let default_priority = word::<Tier>(&stored.default_priority, "default_priority")?;
    if default_priority > max_priority {
        return Err("default_priority is above max_priority".to_owned());
    }
    if !(stored.weight.is_finite() && stored.weight > 0.0) {
        return Err(format!("weight must be > 0, got {}", stored.weight));
    }
    let previous = stored
        .previous
        .into_iter()
        .map(|old| {
            Ok(PreviousKey {
                key_sha256: digest(&old.key_sha256)?,
                until_unix_ms: old.until_unix_ms,
            })
        })
        .collect::<Result<_, String>>()?;
    let budget = match stored.budget {
        None => None,
        Some(budget) => {
            let window = BudgetWindow::parse(&budget.window)
                .ok_or_else(|| format!("budget.window: unknown value '{}'", budget.window))?;
            if budget.gpu_ns == 0 && budget.tokens == 0 {
                return Err("budget sets neither gpu_ns nor tokens".to_owned());
            }
            Some(Budget {
                gpu_ns: budget.gpu_ns,
                tokens: budget.tokens,
                usd_micros: 0,
                window,
            })
        }
    };
    for pattern in &stored.models {
        crate::config::check_model_pattern(pattern).map_err(|why| format!("models: {why}"))?;
    }
    Ok(Record {
        models: stored.models,
        client_id: stored.client_id,
        key_sha256: digest(&stored.key_sha256)?,
        scope,
        max_priority,
        default_priority,
        max_concurrent: stored.max_concurrent,
        weight: stored.weight,
        max_queued: stored.max_queued,
        description: stored.description,
        created_unix_ms: stored.created_unix_ms,
        expires_unix_ms: stored.expires_unix_ms.max(0),
        previous,
        budget,
    })
}

fn word<T: std::str::FromStr<Err = ()>>(text: &str, field: &str) -> Result<T, String> {
    text.parse()
        .map_err(|()| format!("{field}: unknown value '{text}'"))
}

fn digest(text: &str) -> Result<[u8; 32], String> {
    let bytes = hex::decode(text).map_err(|_| "key_sha256 is not hexadecimal".to_owned())?;
    bytes
        .try_into()
        .map_err(|_| "key_sha256 is not 32 bytes".to_owned())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn sample(client_id: &str, digest_byte: u8) -> Record {
        Record {
            client_id: client_id.to_owned(),
            key_sha256: [digest_byte; 32],
            scope: Scope::Inference,
            max_priority: Tier::Normal,
            default_priority: Tier::Low,
            max_concurrent: 2,
            weight: 1.5,
            max_queued: 7,
            description: "nightly \"batch\"".to_owned(),
            created_unix_ms: 1_760_000_000_000,
            expires_unix_ms: 0,
            previous: vec![PreviousKey {
                key_sha256: [digest_byte.wrapping_add(100); 32],
                until_unix_ms: 1_760_000_060_000,
            }],
            budget: Some(Budget {
                gpu_ns: 7_200_000_000_000,
                tokens: 0,
                usd_micros: 0,
                window: BudgetWindow::Day,
            }),
            models: vec!["llama3.2*".to_owned(), "qwen3:*".to_owned()],
        }
    }

    #[test]
    fn records_round_trip() {
        let records = vec![sample("a", 1), sample("b", 2)];
        let bytes = encode(&records);
        assert!(bytes.ends_with(b"\n"));
        assert_eq!(decode(&bytes).unwrap(), records);
        assert_eq!(decode(&encode(&[])).unwrap(), []);
    }

    #[test]
    fn corruption_is_named() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "EOF"),
            (b"{\"format\":1,\"keys\":[", "EOF"),
            (b"{\"format\":2,\"keys\":[]}", "format 2"),
            (b"{\"keys\": []}", "missing field `format`"),
        ];
        for (bytes, expected) in cases {
            let error = decode(bytes).unwrap_err();
            assert!(error.contains(expected), "{error}");
        }
        let mut text = String::from_utf8(encode(&[sample("a", 1)])).unwrap();
        text = text.replace("\"inference\"", "\"root\"");
        assert!(
            decode(text.as_bytes())
                .unwrap_err()
                .contains("scope: unknown value 'root'")
        );
        let twice = encode(&[sample("a", 1), sample("a", 2)]);
        assert!(decode(&twice).unwrap_err().contains("duplicate client_id"));
        let shared = encode(&[sample("a", 1), sample("b", 1)]);
        assert!(
            decode(&shared)
                .unwrap_err()
                .contains("digest appears twice")
        );
        let mut short = sample("a", 1);
        short.weight = 0.0;
        assert!(decode(&encode(&[short])).unwrap_err().contains("weight"));
        let text = String::from_utf8(encode(&[sample("a", 1)])).unwrap();
        let bad_window = text.replace("\"1d\"", "\"2d\"");
        assert!(
            decode(bad_window.as_bytes())
                .unwrap_err()
                .contains("budget.window: unknown value '2d'")
        );
        let empty = text.replace("7200000000000", "0");
        assert!(
            decode(empty.as_bytes())
                .unwrap_err()
                .contains("budget sets neither")
        );
        // A store written before budgets existed loads, without budgets.
        let mut old = sample("a", 1);
        old.budget = None;
        let bytes = encode(&[old.clone()]);
        assert!(!String::from_utf8_lossy(&bytes).contains("budget"));
        assert_eq!(decode(&bytes).unwrap(), [old]);
    }

    #[test]
    fn liveness_follows_expiry_and_grace() {
        let mut record = sample("a", 1);
        assert!(record.is_live(i64::MAX));
        record.expires_unix_ms = 1000;
        assert!(record.is_live(999));
        assert!(!record.is_live(1000));
        let until = record.previous[0].until_unix_ms;
        assert_eq!(record.live_previous(until - 1).count(), 1);
        assert_eq!(record.live_previous(until).count(), 0);
    }
}
