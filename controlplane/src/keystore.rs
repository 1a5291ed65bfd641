//! The key store: consumer keys minted at run time (`oqpctl keys add`,
//! `rotate`, `revoke`), kept beside the config file's keys.
//!
//! A key's value exists in clear exactly once, in the answer to the call that
//! minted it; the store keeps its SHA-256 digest and metadata in
//! `control_plane.state_dir/keys.json` (`record` is the format, `state_file`
//! the crash-safe write). Every change is written and fsynced *before* it is
//! acknowledged and published: a key that was handed out survives a crash,
//! and a revocation reaches the data planes only once it is durable.
//!
//! Changes are serialised by one writer lock, held across the write and the
//! publish, so snapshots carry changes in the order they were made. Readers
//! (authorisation, listing) take a short lock on the committed records and
//! never wait for the disk.
//!
//! Time moves the store too: an expiring key and a rotated key's grace period
//! end without any command. [`KeyStore::run_expiry`] sleeps until the next
//! such deadline and republishes, and the hub drops expired store clients from
//! every snapshot it builds; the data plane also refuses an expired key by its
//! `expires_unix_ms`, so the deadline holds even between snapshots.
//!
//! A rotation or revocation also queues the `key.rotated` / `key.revoked`
//! webhook through the hub's [`Webhooks`](crate::webhooks::Webhooks).

pub(crate) mod mint;
mod record;

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use oqp_proto::policy::v1 as wire;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::audit::{Audit, Outcome};
use crate::compile::{scope_to_wire, tier_to_wire, unix_ms};
use crate::config::{Budget, Config, Scope, Secret, Tier, WebhookEvent};
use crate::hub::Hub;
use crate::state_file as file;
use crate::webhooks::Notice;

pub use mint::PREFIX;
pub use record::{PreviousKey, Record};

/// The store's file name inside `control_plane.state_dir`.
pub const FILE_NAME: &str = "keys.json";

/// Longest accepted client id.
const MAX_CLIENT_ID: usize = 128;

/// The stored keys, their file, and the hub they are published to.
pub struct KeyStore {
    path: PathBuf,
    hub: Arc<Hub>,
    /// Serialises changes; held across the write and the publish.
    writer: Mutex<()>,
    /// What the file holds, swapped whole after each durable write.
    records: Mutex<Arc<Vec<Record>>>,
    /// Wakes the expiry task when a change may have moved a deadline.
    changed: Notify,
}

/// What `AddKey` asks for, in config terms.
#[derive(Debug, Clone)]
pub struct NewKey {
    /// The client; must not exist in the config file or the store.
    pub client_id: String,
    /// What it may do.
    pub scope: Scope,
    /// Its tier ceiling.
    pub max_priority: Tier,
    /// Its default tier; `None` = the ceiling, capped at normal.
    pub default_priority: Option<Tier>,
    /// Most requests in flight; 0 = unlimited, at most `proxy.max_concurrent`.
    pub max_concurrent: u32,
    /// Fair-share weight, > 0.
    pub weight: f64,
    /// Most requests waiting; 0 = unlimited.
    pub max_queued: u32,
    /// Free text.
    pub description: String,
    /// How long the key works; `None` = until revoked.
    pub lifetime: Option<Duration>,
    /// Its usage budget, if it has one.
    pub budget: Option<Budget>,
    /// The models it may use (globs); empty = every model.
    pub models: Vec<String>,
}

/// A freshly minted key: the one moment its value exists in clear.
#[derive(Debug)]
pub struct Issued {
    /// The stored metadata.
    pub record: Record,
    /// The key itself.
    pub key: Secret,
    /// The snapshot version that carries it.
    pub snapshot_version: u64,
    /// After a rotation: when the old key stops working (Unix ms).
    pub old_key_until_unix_ms: i64,
}

/// Why the store could not be loaded at start-up.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The file exists but cannot be read.
    #[error("cannot read the key store {}: {source}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file does not hold a valid store.
    #[error(
        "the key store {} is corrupt: {reason}. It was left untouched: restore it from a \
         backup, or move it aside to start with an empty store",
        path.display()
    )]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong, with its place in the file.
        reason: String,
    },
}

/// Why a key operation was refused. The admin API maps each to a gRPC code.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// `AddKey` for a client the config file defines.
    #[error("client_id '{0}' is already defined in the config file (auth.keys); choose another")]
    DefinedInConfig(String),
    /// `AddKey` for a client the store already holds.
    #[error(
        "client_id '{0}' already has a stored key; rotate it (oqpctl keys rotate {0}) or revoke it first"
    )]
    AlreadyStored(String),
    /// Rotate or revoke of a client the config file defines.
    #[error(
        "client_id '{0}' is defined in the config file, which oqpctl cannot change: edit its \
         auth.keys entry in config.yml, then reload the control plane (SIGHUP)"
    )]
    ReadOnly(String),
    /// Rotate or revoke of a client that does not exist.
    #[error("no stored key for client_id '{0}'")]
    NotFound(String),
    /// Rotation of a key past its expiry.
    #[error(
        "the key of client_id '{0}' has expired; rotation does not extend access: revoke it and add a new key"
    )]
    Expired(String),
    /// A request field is out of range.
    #[error("{0}")]
    Invalid(String),
    /// The change could not be made durable; nothing changed.
    #[error("cannot write the key store {}: {source}; nothing was changed", path.display())]
    Unwritable {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The operating system's random generator failed.
    #[error("cannot generate a key: {0}")]
    Entropy(String),
}

impl std::fmt::Debug for KeyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyStore")
            .field("path", &self.path)
            .field("records", &self.records())
            .finish_non_exhaustive()
    }
}

impl KeyStore {
    /// Loads `state_dir/keys.json` (a missing file is an empty store; nothing
    /// is created until the first change) and publishes its keys to `hub`.
    pub fn load(state_dir: &Path, hub: Arc<Hub>) -> Result<Arc<Self>, StoreError> {
        let path = state_dir.join(FILE_NAME);
        let records = match file::read(&path) {
            Ok(Some(bytes)) => record::decode(&bytes).map_err(|reason| StoreError::Corrupt {
                path: path.clone(),
                reason,
            })?,
            Ok(None) => Vec::new(),
            Err(source) => return Err(StoreError::Unreadable { path, source }),
        };
        if let Some(mode) = file::shared_mode(&path) {
            tracing::warn!(
                path = %path.display(),
                "the key store is accessible by group or others (mode {mode:04o}); the next change rewrites it with mode 0600"
            );
        }
        file::remove_temporaries(&path);
        let store = Arc::new(Self {
            path,
            hub,
            writer: Mutex::new(()),
            records: Mutex::new(Arc::new(records)),
            changed: Notify::new(),
        });
        for warning in store.warnings(&store.hub.config()) {
            tracing::warn!("key store: {warning}");
        }
        store.republish(SystemTime::now());
        Ok(store)
    }

    /// The store's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The committed records.
    pub fn records(&self) -> Arc<Vec<Record>> {
        lock(&self.records).clone()
    }

    /// Mints a key for a new client, stores it durably and publishes it.
    pub fn add(&self, new: NewKey, now: SystemTime) -> Result<Issued, KeyError> {
        let config = self.hub.config();
        let now_ms = unix_ms(now);
        let client_id = new.client_id.trim().to_owned();
        check_client_id(&client_id)?;
        let default_priority = new
            .default_priority
            .unwrap_or(new.max_priority.min(Tier::Normal));
        check_limits(&new, default_priority, &config)?;
        let expires_unix_ms = match new.lifetime {
            None => 0,
            Some(lifetime) if lifetime.is_zero() => {
                return Err(KeyError::Invalid(
                    "expires must be a positive duration".into(),
                ));
            }
            Some(lifetime) => now
                .checked_add(lifetime)
                .map(unix_ms)
                .filter(|ms| *ms < i64::MAX)
                .ok_or_else(|| KeyError::Invalid("expires is too far in the future".into()))?,
        };

        let _writer = lock(&self.writer);
        let current = self.records();
        if config
            .auth
            .keys
            .iter()
            .any(|key| key.client_id == client_id)
        {
            return Err(KeyError::DefinedInConfig(client_id));
        }
        if current.iter().any(|record| record.client_id == client_id) {
            return Err(KeyError::AlreadyStored(client_id));
        }
        let key = mint::mint().map_err(|error| KeyError::Entropy(error.to_string()))?;
        let record = Record {
            client_id,
            key_sha256: key.sha256(),
            scope: new.scope,
            max_priority: new.max_priority,
            default_priority,
            max_concurrent: new.max_concurrent,
            weight: new.weight,
            max_queued: new.max_queued,
            description: new.description,
            created_unix_ms: now_ms,
            expires_unix_ms,
            previous: Vec::new(),
            budget: new.budget,
            models: new.models,
        };
        let mut next = pruned(&current, now_ms);
        next.push(record.clone());
        let snapshot_version = self.commit(next, now_ms)?;
        Ok(Issued {
            record,
            key,
            snapshot_version,
            old_key_until_unix_ms: 0,
        })
    }

    /// Replaces a stored client's key; the old one works for `grace` more
    /// (never past the key's own expiry, which rotation does not extend).
    pub fn rotate(
        &self,
        client_id: &str,
        grace: Duration,
        now: SystemTime,
    ) -> Result<Issued, KeyError> {
        let config = self.hub.config();
        let now_ms = unix_ms(now);
        let _writer = lock(&self.writer);
        let current = self.records();
        let index = self.find(&config, &current, client_id)?;
        let old = &current[index];
        if !old.is_live(now_ms) {
            return Err(KeyError::Expired(client_id.to_owned()));
        }
        let key = mint::mint().map_err(|error| KeyError::Entropy(error.to_string()))?;
        let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
        let mut until = now_ms.saturating_add(grace_ms);
        if old.expires_unix_ms != 0 {
            until = until.min(old.expires_unix_ms);
        }
        let mut next = pruned(&current, now_ms);
        let record = &mut next[index];
        if until > now_ms {
            record.previous.push(PreviousKey {
                key_sha256: record.key_sha256,
                until_unix_ms: until,
            });
        }
        record.key_sha256 = key.sha256();
        record.created_unix_ms = now_ms;
        let record = record.clone();
        let snapshot_version = self.commit(next, now_ms)?;
        self.announce(WebhookEvent::KeyRotated, client_id, now);
        Ok(Issued {
            record,
            key,
            snapshot_version,
            old_key_until_unix_ms: until.max(now_ms),
        })
    }

    /// Removes a stored client and every key it had, at once.
    pub fn revoke(&self, client_id: &str, now: SystemTime) -> Result<u64, KeyError> {
        let config = self.hub.config();
        let now_ms = unix_ms(now);
        let _writer = lock(&self.writer);
        let current = self.records();
        let index = self.find(&config, &current, client_id)?;
        let mut next = pruned(&current, now_ms);
        next.remove(index);
        let snapshot_version = self.commit(next, now_ms)?;
        self.announce(WebhookEvent::KeyRevoked, client_id, now);
        Ok(snapshot_version)
    }

    /// The scope of the stored key (current or in grace) with this digest,
    /// if it works at `now` (Unix ms).
    pub fn scope_of(&self, digest: &[u8; 32], now: i64) -> Option<Scope> {
        self.holder_of(digest, now).map(|(scope, _)| scope)
    }

    /// The scope and client of the stored key (current or in grace) with this digest, if it
    /// works at `now` (Unix ms).
    pub fn holder_of(&self, digest: &[u8; 32], now: i64) -> Option<(Scope, String)> {
        self.holder_with_models(digest, now)
            .map(|(scope, client, _)| (scope, client))
    }

    /// [`KeyStore::holder_of`], with the models the key may use (empty = every model).
    pub fn holder_with_models(
        &self,
        digest: &[u8; 32],
        now: i64,
    ) -> Option<(Scope, String, Vec<String>)> {
        self.records()
            .iter()
            .filter(|record| record.is_live(now))
            .find(|record| {
                std::iter::once(&record.key_sha256)
                    .chain(record.live_previous(now).map(|old| &old.key_sha256))
                    .any(|candidate| digests_match(candidate, digest))
            })
            .map(|record| {
                (
                    record.scope,
                    record.client_id.clone(),
                    record.models.clone(),
                )
            })
    }

    /// Things an operator should know about the store under `config`:
    /// clients defined in both places, caps above `proxy.max_concurrent`.
    pub fn warnings(&self, config: &Config) -> Vec<String> {
        let mut warnings = Vec::new();
        for record in self.records().iter() {
            if config
                .auth
                .keys
                .iter()
                .any(|key| key.client_id == record.client_id)
            {
                warnings.push(format!(
                    "client_id '{}' is defined in the config file and has a stored key; the \
                     config entry's limits apply to it, and its stored key still authenticates \
                     until revoked (oqpctl keys revoke {0})",
                    record.client_id
                ));
            }
            if record.max_concurrent > config.proxy.max_concurrent {
                warnings.push(format!(
                    "stored client_id '{}' has max_concurrent {} above proxy.max_concurrent {}",
                    record.client_id, record.max_concurrent, config.proxy.max_concurrent
                ));
            }
        }
        warnings
    }

    /// The next moment (Unix ms) after `now` at which a stored key stops
    /// working.
    pub fn next_deadline(&self, now: i64) -> Option<i64> {
        self.records()
            .iter()
            .flat_map(|record| {
                std::iter::once(record.expires_unix_ms)
                    .chain(record.previous.iter().map(|old| old.until_unix_ms))
            })
            .filter(|deadline| *deadline > now)
            .min()
    }

    /// The deadlines in `(after, upto]`: `(client_id, "keys.expire")` for a
    /// key that expired, `(client_id, "keys.grace_end")` for an old key
    /// whose grace ended, as the audit trail names them.
    pub fn passed_deadlines(&self, after: i64, upto: i64) -> Vec<(String, &'static str)> {
        let within = |deadline: i64| deadline > after && deadline <= upto;
        let mut passed = Vec::new();
        for record in self.records().iter() {
            if within(record.expires_unix_ms) {
                passed.push((record.client_id.clone(), "keys.expire"));
            }
            if record.previous.iter().any(|old| within(old.until_unix_ms)) {
                passed.push((record.client_id.clone(), "keys.grace_end"));
            }
        }
        passed
    }

    /// Publishes the keys that work at `now`; returns the snapshot version.
    pub fn republish(&self, now: SystemTime) -> u64 {
        let _writer = lock(&self.writer);
        self.hub
            .set_extra_clients(clients(&self.records(), unix_ms(now)))
    }

    /// Republishes at every deadline (expiry, end of grace) until `shutdown`:
    /// one timer on the next deadline, re-armed whenever the store changes.
    /// Each deadline passed is recorded in `audit` (actor `local`).
    pub async fn run_expiry(self: Arc<Self>, audit: Arc<Audit>, shutdown: CancellationToken) {
        // Deadlines are looked up after the last republish by this task, not
        // after "now": a deadline that passed while a change woke the loop is
        // still due (the timer then fires at once), so none is skipped.
        let mut handled = unix_ms(SystemTime::now());
        loop {
            let wait = self.next_deadline(handled).map(|deadline| {
                let deadline = SystemTime::UNIX_EPOCH
                    + Duration::from_millis(u64::try_from(deadline).unwrap_or(0));
                deadline
                    .duration_since(SystemTime::now())
                    .unwrap_or_default()
            });
            let timer = async {
                match wait {
                    Some(wait) => tokio::time::sleep(wait).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => return,
                // A change re-arms the timer; `notify_one` keeps a permit, so
                // a change made while this loop was busy is not missed.
                () = self.changed.notified() => {}
                () = timer => {
                    let now = SystemTime::now();
                    for (client_id, action) in self.passed_deadlines(handled, unix_ms(now)) {
                        audit.record(crate::audit::LOCAL, None, action, &client_id, Outcome::Ok, "");
                    }
                    handled = unix_ms(now);
                    let store = self.clone();
                    let republished =
                        tokio::task::spawn_blocking(move || store.republish(now)).await;
                    if let Ok(version) = republished {
                        tracing::info!(version, "a key deadline passed; snapshot republished");
                    }
                }
            }
        }
    }

    /// Writes `next`, then makes it the published state. The caller holds
    /// the writer lock.
    fn commit(&self, next: Vec<Record>, now: i64) -> Result<u64, KeyError> {
        file::write_atomic(&self.path, &record::encode(&next)).map_err(|source| {
            KeyError::Unwritable {
                path: self.path.clone(),
                source,
            }
        })?;
        let next = Arc::new(next);
        *lock(&self.records) = next.clone();
        let version = self.hub.set_extra_clients(clients(&next, now));
        self.changed.notify_one();
        Ok(version)
    }

    /// Queues the `key.rotated` / `key.revoked` webhook (never waits).
    fn announce(&self, event: WebhookEvent, client_id: &str, at: SystemTime) {
        self.hub
            .webhooks()
            .notify(Notice::new(event).at(at).field("client_id", client_id));
    }

    /// The index of a stored client that rotate and revoke may change.
    fn find(
        &self,
        config: &Config,
        records: &[Record],
        client_id: &str,
    ) -> Result<usize, KeyError> {
        if config
            .auth
            .keys
            .iter()
            .any(|key| key.client_id == client_id)
        {
            return Err(KeyError::ReadOnly(client_id.to_owned()));
        }
        records
            .iter()
            .position(|record| record.client_id == client_id)
            .ok_or_else(|| KeyError::NotFound(client_id.to_owned()))
    }
}

/// The snapshot clients of `records` at `now` (Unix ms): per client, the
/// current key first (the data plane's by-id index keeps the first), then the
/// old keys still in grace, each with the moment it stops working.
pub fn clients(records: &[Record], now: i64) -> Vec<wire::Client> {
    let mut clients = Vec::with_capacity(records.len());
    for record in records.iter().filter(|record| record.is_live(now)) {
        let client = |digest: &[u8; 32], expires_unix_ms: i64| wire::Client {
            client_id: record.client_id.clone(),
            key_sha256: digest.to_vec(),
            scope: scope_to_wire(record.scope) as i32,
            max_priority: tier_to_wire(record.max_priority) as i32,
            default_priority: tier_to_wire(record.default_priority) as i32,
            max_concurrent: record.max_concurrent,
            weight: record.weight,
            max_queued: record.max_queued,
            description: record.description.clone(),
            expires_unix_ms,
            source: "store".to_owned(),
            budget: record.budget.as_ref().map(crate::compile::budget_to_wire),
            models: record.models.clone(),
            users: None,
            tls_subject: String::new(),
            // A stored key has no limits of its own: `auth.default_rate_limit`'s, if any.
            rate_limit: None,
            // Bodies are captured only for keys of the config file, where the choice is read.
            capture_max_bytes: 0,
        };
        clients.push(client(&record.key_sha256, record.expires_unix_ms));
        for old in record.live_previous(now) {
            clients.push(client(&old.key_sha256, old.until_unix_ms));
        }
    }
    clients
}

/// Constant-time comparison of two digests.
pub fn digests_match(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `records` without the old keys whose grace ended by `now`.
fn pruned(records: &[Record], now: i64) -> Vec<Record> {
    records
        .iter()
        .map(|record| {
            let mut record = record.clone();
            record.previous.retain(|old| old.until_unix_ms > now);
            record
        })
        .collect()
}

fn check_client_id(client_id: &str) -> Result<(), KeyError> {
    if client_id.is_empty() {
        return Err(KeyError::Invalid("client_id must not be empty".into()));
    }
    if client_id.len() > MAX_CLIENT_ID {
        return Err(KeyError::Invalid(format!(
            "client_id must be at most {MAX_CLIENT_ID} characters"
        )));
    }
    // It travels upstream in `X-Client-ID` and shows in metrics labels.
    if !client_id.bytes().all(|byte| byte.is_ascii_graphic()) {
        return Err(KeyError::Invalid(format!(
            "client_id '{}' may hold only visible ASCII characters (no spaces)",
            client_id.escape_default()
        )));
    }
    Ok(())
}

fn check_limits(new: &NewKey, default_priority: Tier, config: &Config) -> Result<(), KeyError> {
    let proxy_max = config.proxy.max_concurrent;
    if new.max_concurrent > proxy_max {
        return Err(KeyError::Invalid(format!(
            "max_concurrent ({}) exceeds proxy.max_concurrent ({proxy_max}); set it to at most \
             {proxy_max} or raise proxy.max_concurrent",
            new.max_concurrent
        )));
    }
    if !(new.weight.is_finite() && new.weight > 0.0) {
        return Err(KeyError::Invalid(format!(
            "weight must be a number > 0, got {}",
            new.weight
        )));
    }
    if default_priority > new.max_priority {
        return Err(KeyError::Invalid(format!(
            "default_priority {default_priority} is above max_priority {}",
            new.max_priority
        )));
    }
    if new.client_id.contains('/') {
        return Err(KeyError::Invalid(
            "client_id must not contain '/' (it separates an app key's users)".into(),
        ));
    }
    for pattern in &new.models {
        crate::config::check_model_pattern(pattern)
            .map_err(|why| KeyError::Invalid(format!("models: {why}")))?;
    }
    Ok(())
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded values are replaced whole, never left half-written.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
