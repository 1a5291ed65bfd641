//! Ollama Cloud accounts as the snapshot carries them: what the control plane last read of each
//! account's balance (`GET /api/balance`, credit or legacy window plan: [`Balance`], shared with
//! the control plane through `oqp-proto`) and its reserve.
//! Data planes never read balances themselves: the cloud allows 10 reads a minute per account,
//! and the control plane's reader keeps within that for all of them.

use std::sync::Arc;
use std::time::SystemTime;

pub use oqp_proto::balance::{Balance, WindowLeft};

/// One account of a cloud host's pool.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Account {
    /// The account label of its keys, or `key:` and a hash for a key without one.
    pub account: Arc<str>,
    /// The team sharing its balance; empty = its own.
    pub team: Arc<str>,
    /// The last balance read; `None` before the first read (or for an unknown shape).
    pub balance: Option<Balance>,
    /// When that balance was read.
    pub read_at: Option<SystemTime>,
    /// USD kept for the owner's own use.
    pub reserve_usd: f64,
    /// Percent of the allowance (or of each window) kept for the owner's own use.
    pub reserve_percent: f64,
}

impl Account {
    /// The remaining USD above the reserve (credit plans: included and extra), or `None` for a
    /// window plan or an unread balance.
    pub fn spendable_usd(&self) -> Option<f64> {
        match &self.balance {
            Some(balance @ Balance::Credits { .. }) => {
                balance.left_above(self.reserve_usd, self.reserve_percent)
            }
            _ => None,
        }
    }

    /// What is left of the nearer-to-empty window above the reserve, in percent, or `None`
    /// for a credit plan or an unread balance.
    pub fn spendable_percent(&self) -> Option<f64> {
        match &self.balance {
            Some(balance @ Balance::Windows { .. }) => {
                balance.left_above(self.reserve_usd, self.reserve_percent)
            }
            _ => None,
        }
    }

    /// Whether the account is (predicted) at or under its reserve: nothing is sent to it while
    /// another account can serve. Unknown balances are never under.
    pub fn under_reserve(&self) -> bool {
        self.spendable_usd()
            .or(self.spendable_percent())
            .is_some_and(|left| left <= 0.0)
    }

    /// How much is left to spend, comparable across accounts of one plan kind: USD for
    /// credit plans, percent for window plans. `None` when unread.
    pub fn remaining(&self) -> Option<f64> {
        self.spendable_usd().or(self.spendable_percent())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn credits(included: f64, extra: f64) -> Account {
        Account {
            account: "alice".into(),
            balance: Some(Balance::Credits {
                included_usd: included,
                allowance_usd: Some(20.0),
                extra_usd: extra,
                resets_at: None,
            }),
            ..Account::default()
        }
    }

    #[test]
    fn the_reserve_is_the_larger_of_dollars_and_percent() {
        let mut account = credits(3.0, 1.0);
        assert_eq!(account.spendable_usd(), Some(4.0));
        account.reserve_usd = 1.5;
        assert_eq!(account.spendable_usd(), Some(2.5));
        account.reserve_percent = 25.0; // of $20: $5
        assert_eq!(account.spendable_usd(), Some(-1.0));
        assert!(account.under_reserve());
    }

    #[test]
    fn a_window_plan_counts_its_nearer_window() {
        let account = Account {
            balance: Some(Balance::Windows {
                session: Some(WindowLeft {
                    remaining_percent: 60.0,
                    resets_at: None,
                }),
                weekly: Some(WindowLeft {
                    remaining_percent: 15.0,
                    resets_at: None,
                }),
            }),
            reserve_percent: 10.0,
            ..Account::default()
        };
        assert_eq!(account.spendable_percent(), Some(5.0));
        assert_eq!(account.remaining(), Some(5.0));
        assert!(!account.under_reserve());
        assert!(!Account::default().under_reserve(), "unread is not empty");
    }

    #[test]
    fn only_the_extra_balance_lifts_an_extra_usage_refusal_on_credit_plans() {
        let before = credits(3.0, 0.0).balance.unwrap();
        let spent = credits(2.0, 0.0).balance.unwrap();
        let topped_up = credits(2.0, 10.0).balance.unwrap();
        assert!(!before.extra_changed(&spent));
        assert!(spent.extra_changed(&topped_up));
    }
}
