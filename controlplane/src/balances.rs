//! Ollama Cloud balances: what the control plane reads of them and how the snapshot carries
//! them. Balances are read per ACCOUNT (keys of one account share its balance; accounts of one
//! `team` share one, read once), every `cloud.balance_interval`, and the hub puts what was
//! read in the snapshot (`Host.cloud_accounts`, [`attach`]), where the data planes steer by it.
//!
//! The cloud allows 10 reads a minute per account across keys and devices; [`ReadBudget`]
//! keeps every reader within that (and waits out a 429's `Retry-After`), so that neither more
//! keys nor more data planes mean more reads: data planes never read balances themselves.
//!
//! This module owns the reading units, the parsing of the two replies and the snapshot's
//! account entries; not the task that reads (`crate::readers::balances`, above the hub it
//! writes into).

mod budget;
mod parse;
mod spend;

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use oqp_proto::policy::v1 as wire;
use sha2::Digest;

use crate::config::{Config, HostConfig, HostKind, Secret};

pub use budget::{MINUTE, READS_PER_MINUTE, ReadBudget};
pub use oqp_proto::balance::Balance;
pub use parse::parse as parse_balance;
pub use spend::Spend;

/// What the control plane last read of one unit's balance, and when.
#[derive(Debug, Clone, PartialEq)]
pub struct Read {
    /// The balance.
    pub balance: Balance,
    /// When it was first read as it is.
    pub at: SystemTime,
}

/// One reading unit: a team, or an account of no team.
#[derive(Clone, PartialEq)]
pub struct Target {
    /// `team:<team>`, `account:<label>` or `key:<hash>`.
    pub unit: String,
    /// The cloud host's base URL.
    pub url: String,
    /// The keys that may read it, in config order (the first that is not refused is used).
    pub keys: Vec<Secret>,
    /// How often it is read.
    pub interval: Duration,
    /// Its accounts with their reserves (USD, percent), for the under-reserve webhook.
    pub accounts: Vec<(String, f64, f64)>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("unit", &self.unit)
            .field("keys", &self.keys.len())
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

/// How the snapshot names the account of a key: its label, or `key:` and the first 16 hex
/// digits of the key's SHA-256 when it has none (the data plane computes the same).
pub fn account_id(key: &crate::config::CloudKey) -> String {
    if key.account.is_empty() {
        let digest = sha2::Sha256::digest(key.key.expose().as_bytes());
        format!("key:{}", hex::encode(&digest[..8]))
    } else {
        key.account.clone()
    }
}

/// The unit whose balance an account shares: its team's, else its own.
fn unit_of(config: &Config, account: &str) -> String {
    match config.cloud.account(account).team {
        Some(team) => format!("team:{team}"),
        None if account.starts_with("key:") => account.to_owned(),
        None => format!("account:{account}"),
    }
}

/// The accounts of a cloud host as the snapshot carries them, without balances (the hub adds
/// them with [`attach`]): one entry per account, in key order.
pub fn accounts_of(config: &Config, host: &HostConfig) -> Vec<wire::CloudAccount> {
    if host.kind != HostKind::Cloud {
        return Vec::new();
    }
    let mut out: Vec<wire::CloudAccount> = Vec::new();
    for key in &host.api_keys {
        let account = account_id(key);
        if out.iter().any(|known| known.account == account) {
            continue;
        }
        let settings = config.cloud.account(&account);
        out.push(wire::CloudAccount {
            account,
            team: settings.team.unwrap_or_default(),
            reserve_usd: settings.reserve_usd,
            reserve_percent: settings.reserve_percent,
            ..wire::CloudAccount::default()
        });
    }
    out
}

/// Fills each cloud account of `snapshot` with what was read of its unit.
pub fn attach(snapshot: &mut wire::PolicySnapshot, config: &Config, reads: &HashMap<String, Read>) {
    for host in &mut snapshot.hosts {
        for account in &mut host.cloud_accounts {
            if let Some(read) = reads.get(&unit_of(config, &account.account)) {
                fill(account, read);
            }
        }
    }
}

fn fill(account: &mut wire::CloudAccount, read: &Read) {
    read.balance.to_wire(account);
    account.read_at_unix_ms = oqp_proto::unix_ms(read.at);
}

/// Every reading unit of `config`, in config order.
pub fn targets(config: &Config) -> Vec<Target> {
    let mut out: Vec<Target> = Vec::new();
    for host in config
        .ollama
        .hosts
        .iter()
        .filter(|host| host.kind == HostKind::Cloud)
    {
        for key in &host.api_keys {
            let account = account_id(key);
            let unit = unit_of(config, &account);
            let settings = config.cloud.account(&account);
            let reserve = (account, settings.reserve_usd, settings.reserve_percent);
            match out.iter_mut().find(|target| target.unit == unit) {
                Some(target) => {
                    if !target.keys.contains(&key.key) {
                        target.keys.push(key.key.clone());
                    }
                    if !target.accounts.iter().any(|known| known.0 == reserve.0) {
                        target.accounts.push(reserve);
                    }
                }
                None => out.push(Target {
                    unit,
                    url: host.url.clone(),
                    keys: vec![key.key.clone()],
                    interval: config.cloud.balance_interval,
                    accounts: vec![reserve],
                }),
            }
        }
    }
    out
}

/// The (host, account, model) refusals with a 402 in `after` that `before` (the same node's
/// previous report) did not have.
pub fn new_refusals(
    before: &wire::NodeReport,
    after: &wire::NodeReport,
) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for host in &after.hosts {
        let previous = before.hosts.iter().find(|old| old.name == host.name);
        for account in &host.cloud_accounts {
            let known: &[String] = previous
                .and_then(|old| {
                    old.cloud_accounts
                        .iter()
                        .find(|a| a.account == account.account)
                })
                .map_or(&[], |old| old.refused_models.as_slice());
            for refused in &account.refused_models {
                if let Some(model) = refused.strip_suffix(" (extra_usage)")
                    && !known.contains(refused)
                {
                    out.push((host.name.clone(), account.account.clone(), model.to_owned()));
                }
            }
        }
    }
    out
}
