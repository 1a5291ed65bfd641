//! Ollama Cloud spend in dollars, attributed to oqp clients.
//!
//! The data planes report, with each usage batch, the tokens (prompt + completion) each cloud
//! account served each client; [`CloudTokens`] keeps them per UTC hour for
//! [`KEEP_SECONDS`] (in `state_dir/cloud-usage.json`, written atomically, 0600, after the
//! batch's day file). The control plane reads each account's `/api/usage` (`usage_usd` and,
//! when stated, its tokens over the last 30 days; [`crate::balances`]) and sets the account's
//! **observed price**: `usage_usd / max(the cloud's tokens, oqp's tokens on the account)`
//! over those 30 days. A client's cloud spend over any period is the sum, over the accounts
//! that served it, of its tokens on the account in the period times that price. Over the 30
//! days this splits `usage_usd` between the clients in proportion to their tokens on the
//! account; what the owner spent outside oqp (the cloud's tokens beyond oqp's) stays
//! unattributed.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::Path;

use oqp_proto::policy::v1 as wire;
use serde::{Deserialize, Serialize};

use crate::state_file::{read, write_atomic};

/// How long tokens are kept: the 30 days a price is observed over, and a day more.
pub const KEEP_SECONDS: i64 = 31 * 86_400;

/// The span of `/api/usage?range=30d`, over which a price is observed.
pub const PRICE_RANGE_SECONDS: i64 = 30 * 86_400;

/// The file, in the state directory.
pub const FILE: &str = "cloud-usage.json";

/// Tokens per hour, client and account, and each account's observed price.
#[derive(Debug, Default)]
pub struct CloudTokens {
    /// (hour start, client, account) → tokens.
    hours: BTreeMap<(i64, String, String), u64>,
    /// Account → USD per token.
    prices: HashMap<String, f64>,
    /// Whether `hours` changed since the last save.
    dirty: bool,
}

#[derive(Debug, Serialize, Deserialize)]
struct Saved {
    hours: Vec<SavedHour>,
}

#[derive(Debug, Serialize, Deserialize)]
struct SavedHour {
    hour: i64,
    client: String,
    account: String,
    tokens: u64,
}

impl CloudTokens {
    /// What `state_dir` keeps (nothing when it has no file).
    pub fn load(state_dir: &Path) -> Result<Self, String> {
        let path = state_dir.join(FILE);
        let Some(bytes) = read(&path).map_err(|error| format!("{}: {error}", path.display()))?
        else {
            return Ok(Self::default());
        };
        let saved: Saved = serde_json::from_slice(&bytes)
            .map_err(|error| format!("{}: {error}", path.display()))?;
        let hours = saved
            .hours
            .into_iter()
            .map(|row| ((row.hour, row.client, row.account), row.tokens))
            .collect();
        Ok(Self {
            hours,
            ..Self::default()
        })
    }

    /// Adds a batch's rows at `now` (Unix seconds) and forgets hours past [`KEEP_SECONDS`].
    pub fn add(&mut self, rows: &[wire::CloudTokens], now: i64) {
        let hour = now.div_euclid(3600) * 3600;
        for row in rows.iter().filter(|row| row.tokens > 0) {
            let tokens = self
                .hours
                .entry((hour, row.client_id.clone(), row.account.clone()))
                .or_default();
            *tokens = tokens.saturating_add(row.tokens);
            self.dirty = true;
        }
        let oldest = now - KEEP_SECONDS;
        let before = self.hours.len();
        self.hours.retain(|(hour, ..), _| *hour >= oldest);
        self.dirty |= self.hours.len() != before;
    }

    /// Writes the file when something changed; `Ok` without writing otherwise.
    pub fn save(&mut self, state_dir: &Path) -> io::Result<()> {
        if !self.dirty {
            return Ok(());
        }
        let saved = Saved {
            hours: self
                .hours
                .iter()
                .map(|((hour, client, account), tokens)| SavedHour {
                    hour: *hour,
                    client: client.clone(),
                    account: account.clone(),
                    tokens: *tokens,
                })
                .collect(),
        };
        let bytes = serde_json::to_vec(&saved).map_err(io::Error::other)?;
        write_atomic(&state_dir.join(FILE), &bytes)?;
        self.dirty = false;
        Ok(())
    }

    /// Tokens oqp sent to any of `accounts` since `since` (Unix seconds).
    pub fn account_tokens_since(&self, accounts: &[String], since: i64) -> u64 {
        self.hours
            .range((since, String::new(), String::new())..)
            .filter(|((_, _, account), _)| accounts.contains(account))
            .fold(0u64, |sum, (_, tokens)| sum.saturating_add(*tokens))
    }

    /// Sets the observed price of `accounts` (one reading unit) from its `/api/usage` read:
    /// `usd` over the last 30 days, and the cloud's own token count when it stated one.
    pub fn observe(&mut self, accounts: &[String], usd: f64, cloud_tokens: Option<u64>, now: i64) {
        let ours = self.account_tokens_since(accounts, now - PRICE_RANGE_SECONDS);
        let tokens = cloud_tokens.unwrap_or(0).max(ours);
        #[allow(clippy::cast_precision_loss)]
        let price = if tokens == 0 || !usd.is_finite() || usd <= 0.0 {
            0.0
        } else {
            usd / tokens as f64
        };
        for account in accounts {
            self.prices.insert(account.clone(), price);
        }
    }

    /// Forgets the prices of accounts that are not in `keep` (they left the config).
    pub fn retain_prices(&mut self, keep: &[String]) {
        self.prices.retain(|account, _| keep.contains(account));
    }

    /// The observed price of `account`, once its usage was read.
    pub fn price(&self, account: &str) -> Option<f64> {
        self.prices.get(account).copied()
    }

    /// Each client's cloud spend since `since`, in USD: its tokens on each account whose
    /// price is known, times that price. Clients with no such tokens are left out.
    pub fn spend_since(&self, since: i64) -> HashMap<String, f64> {
        let mut out: HashMap<String, f64> = HashMap::new();
        for ((_, client, account), tokens) in
            self.hours.range((since, String::new(), String::new())..)
        {
            if let Some(price) = self.price(account) {
                #[allow(clippy::cast_precision_loss)]
                let usd = *tokens as f64 * price;
                *out.entry(client.clone()).or_default() += usd;
            }
        }
        out
    }

    /// [`CloudTokens::spend_since`] of one client (and, for an app, its users', as
    /// `<client>/<user>`, when `with_users`).
    pub fn client_spend_since(&self, client: &str, with_users: bool, since: i64) -> f64 {
        self.spend_since(since)
            .into_iter()
            .filter(|(id, _)| {
                id == client
                    || (with_users
                        && id
                            .strip_prefix(client)
                            .is_some_and(|rest| rest.starts_with('/')))
            })
            .map(|(_, usd)| usd)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(client: &str, account: &str, tokens: u64) -> wire::CloudTokens {
        wire::CloudTokens {
            client_id: client.into(),
            account: account.into(),
            tokens,
        }
    }

    const NOW: i64 = 1_800_000_000;

    #[test]
    fn an_accounts_spend_is_split_in_proportion_to_tokens() {
        let mut store = CloudTokens::default();
        store.add(
            &[
                row("a", "alice", 300),
                row("b", "alice", 100),
                row("b", "bob", 50),
            ],
            NOW,
        );
        // Alice spent $8 on the 400 tokens oqp sent her (the cloud counted as many).
        store.observe(&["alice".into()], 8.0, Some(400), NOW);
        let spend = store.spend_since(NOW - 3600);
        assert!((spend["a"] - 6.0).abs() < 1e-9, "{spend:?}");
        assert!((spend["b"] - 2.0).abs() < 1e-9, "{spend:?}");
        // Bob's usage is not read yet: nothing is attributed for him.
        store.observe(&["bob".into()], 1.0, None, NOW);
        let spend = store.spend_since(NOW - 3600);
        assert!((spend["b"] - 3.0).abs() < 1e-9, "{spend:?}");
    }

    #[test]
    fn what_the_owner_spent_outside_oqp_stays_unattributed() {
        let mut store = CloudTokens::default();
        store.add(&[row("a", "alice", 100)], NOW);
        // The cloud counted 1,000 tokens: 900 of them were not oqp's.
        store.observe(&["alice".into()], 10.0, Some(1_000), NOW);
        let spend = store.spend_since(NOW - 3600);
        assert!((spend["a"] - 1.0).abs() < 1e-9, "{spend:?}");
    }

    #[test]
    fn old_hours_leave_and_periods_count_their_own_hours() {
        let mut store = CloudTokens::default();
        store.add(&[row("a", "alice", 100)], NOW - KEEP_SECONDS - 3600);
        store.add(&[row("a", "alice", 100)], NOW - 2 * 86_400);
        store.add(&[row("a", "alice", 100)], NOW);
        assert_eq!(store.hours.len(), 2);
        store.observe(&["alice".into()], 2.0, None, NOW);
        assert!((store.spend_since(NOW - 86_400)["a"] - 1.0).abs() < 1e-9);
        assert!((store.spend_since(NOW - 7 * 86_400)["a"] - 2.0).abs() < 1e-9);
    }

    #[test]
    fn an_apps_users_count_toward_the_app() {
        let mut store = CloudTokens::default();
        store.add(
            &[
                row("app", "alice", 10),
                row("app/ann", "alice", 30),
                row("apple", "alice", 60),
            ],
            NOW,
        );
        store.observe(&["alice".into()], 1.0, Some(100), NOW);
        assert!((store.client_spend_since("app", true, 0) - 0.4).abs() < 1e-9);
        assert!((store.client_spend_since("app", false, 0) - 0.1).abs() < 1e-9);
    }

    #[test]
    fn saved_and_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = CloudTokens::default();
        store.add(&[row("a", "alice", 100)], NOW);
        store.save(dir.path()).unwrap();
        let loaded = CloudTokens::load(dir.path()).unwrap();
        assert_eq!(loaded.hours, store.hours);
        let mode = std::fs::metadata(dir.path().join(FILE)).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o600
        );
    }
}
