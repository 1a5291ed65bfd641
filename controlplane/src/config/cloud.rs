//! The `cloud` section: how often the control plane reads Ollama Cloud balances, and each
//! account's settings (its team, its reserve).
//!
//! ```yaml
//! cloud:
//!   balance_interval: 60      # seconds between two /api/balance reads of one account
//!   accounts:
//!     alice:                  # an account label of a cloud host's api_keys
//!       team: acme            # accounts of one team share one balance (read once)
//!       reserve_usd: 5        # keep $5 of the balance for the owner's own use
//!       reserve_percent: 10   # or 10 % of the allowance (or of a window)
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::error::Problems;
use super::field::duration_within;
use super::scalar::{Float, Seconds, Text};
use super::types::HostConfig;

/// The default `cloud.balance_interval`.
pub const DEFAULT_BALANCE_INTERVAL: Duration = Duration::from_secs(60);

/// `cloud`: balance reads and per-account settings.
#[derive(Debug, Clone, PartialEq)]
pub struct CloudConfig {
    /// Time between two `/api/balance` reads of one account (the cloud's limit of 10 reads a
    /// minute per account is kept whatever this says).
    pub balance_interval: Duration,
    /// Settings per account label.
    pub accounts: BTreeMap<String, CloudAccountConfig>,
}

/// `cloud.accounts.<label>`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CloudAccountConfig {
    /// Accounts with the same team share one balance.
    pub team: Option<String>,
    /// USD of the balance kept for the owner's own use; 0 = none.
    pub reserve_usd: f64,
    /// Percent of the allowance (credit plans) or of a window (legacy plans) kept; 0 = none.
    pub reserve_percent: f64,
}

impl Default for CloudConfig {
    fn default() -> Self {
        CloudConfig {
            balance_interval: DEFAULT_BALANCE_INTERVAL,
            accounts: BTreeMap::new(),
        }
    }
}

impl CloudConfig {
    /// The settings of `account` (defaults when it has none).
    pub fn account(&self, account: &str) -> CloudAccountConfig {
        self.accounts.get(account).cloned().unwrap_or_default()
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawCloud {
    pub balance_interval: Option<Seconds>,
    pub accounts: Option<BTreeMap<String, RawCloudAccount>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawCloudAccount {
    pub team: Option<Text>,
    pub reserve_usd: Option<Float>,
    pub reserve_percent: Option<Float>,
}

/// Resolves `cloud`; `hosts` (when they resolved) say which account labels exist, so that a
/// misspelt one is a warning.
pub(crate) fn cloud(
    raw: RawCloud,
    hosts: Option<&[HostConfig]>,
    problems: &mut Problems,
) -> Option<CloudConfig> {
    let before = problems.error_count();
    let balance_interval = duration_within(
        raw.balance_interval,
        DEFAULT_BALANCE_INTERVAL,
        Duration::from_millis(100),
        Duration::from_secs(24 * 3600),
        "cloud.balance_interval",
        problems,
    );
    let mut accounts = BTreeMap::new();
    for (label, account) in raw.accounts.unwrap_or_default() {
        let path = format!("cloud.accounts.{label}");
        if let Some(hosts) = hosts
            && !hosts
                .iter()
                .flat_map(|host| &host.api_keys)
                .any(|key| key.account == label)
        {
            problems.warn(format!(
                "{path} names no account of a cloud host's api_keys; it has no effect"
            ));
        }
        let mut amount = |value: Option<Float>, key: &str, max: f64| match value {
            None => 0.0,
            Some(Float(value)) if value.is_finite() && (0.0..=max).contains(&value) => value,
            Some(Float(value)) => {
                problems.error(format!("{path}.{key} must be from 0 to {max}, got {value}"));
                0.0
            }
        };
        let reserve_usd = amount(account.reserve_usd, "reserve_usd", 1e9);
        let reserve_percent = amount(account.reserve_percent, "reserve_percent", 100.0);
        let team = account
            .team
            .map(|Text(team)| team.trim().to_owned())
            .filter(|team| !team.is_empty());
        accounts.insert(
            label,
            CloudAccountConfig {
                team,
                reserve_usd,
                reserve_percent,
            },
        );
    }
    (problems.error_count() == before).then_some(CloudConfig {
        balance_interval,
        accounts,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::config::{ConfigError, Env, Loaded, load_str};

    const CLOUD_HOST: &str = "ollama:\n  hosts:\n    - url: https://ollama.com\n      name: cloud\n      kind: cloud\n      api_keys:\n        - key: k1\n          account: alice\n        - key: k2\n          account: bob\n";

    fn load(rest: &str) -> Result<Loaded, ConfigError> {
        load_str(
            &format!("{CLOUD_HOST}{rest}"),
            &Env::from_pairs(Vec::<(String, String)>::new()),
        )
    }

    #[test]
    fn defaults_to_a_minute_and_no_accounts() {
        let loaded = load("").unwrap();
        assert_eq!(loaded.config.cloud, CloudConfig::default());
        assert_eq!(
            loaded.config.cloud.balance_interval,
            Duration::from_secs(60)
        );
        assert_eq!(
            loaded.config.cloud.account("alice"),
            CloudAccountConfig::default()
        );
    }

    #[test]
    fn reads_the_interval_teams_and_reserves() {
        let loaded = load(
            "cloud:\n  balance_interval: 30\n  accounts:\n    alice:\n      team: acme\n      \
             reserve_usd: 5\n    bob:\n      team: acme\n      reserve_percent: 12.5\n",
        )
        .unwrap();
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        let cloud = &loaded.config.cloud;
        assert_eq!(cloud.balance_interval, Duration::from_secs(30));
        assert_eq!(
            cloud.account("alice"),
            CloudAccountConfig {
                team: Some("acme".into()),
                reserve_usd: 5.0,
                reserve_percent: 0.0,
            }
        );
        assert_eq!(cloud.account("bob").reserve_percent, 12.5);
    }

    #[test]
    fn refuses_bad_values_and_warns_of_unknown_accounts() {
        let problems = load(
            "cloud:\n  balance_interval: 0.01\n  accounts:\n    alice:\n      reserve_usd: -1\n      \
             reserve_percent: 150\n",
        )
        .unwrap_err()
        .problems();
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(
            problems
                .iter()
                .any(|p| p.contains("cloud.balance_interval"))
        );
        assert!(
            problems
                .iter()
                .any(|p| p.contains("cloud.accounts.alice.reserve_usd"))
        );
        assert!(
            problems
                .iter()
                .any(|p| p.contains("cloud.accounts.alice.reserve_percent"))
        );
        let loaded = load("cloud:\n  accounts:\n    carol:\n      reserve_usd: 1\n").unwrap();
        assert!(
            loaded
                .warnings
                .iter()
                .any(|w| w.contains("cloud.accounts.carol names no account")),
            "{:?}",
            loaded.warnings
        );
    }
}
