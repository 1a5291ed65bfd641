//! Ollama Cloud accounts as the snapshot carries them: what the control plane last read of each
//! account's balance (`GET /api/balance`, credit or legacy window plan) and its reserve.
//! Data planes never read balances themselves: the cloud allows 10 reads a minute per account,
//! and the control plane's reader keeps within that for all of them.

use std::sync::Arc;
use std::time::SystemTime;

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

/// What one read said.
#[derive(Debug, Clone, PartialEq)]
pub enum Balance {
    /// A monthly included allowance in USD, then purchased extra usage.
    Credits {
        /// What is left of the included allowance.
        included_usd: f64,
        /// The period's allowance, when stated.
        allowance_usd: Option<f64>,
        /// Purchased extra usage left.
        extra_usd: f64,
        /// When the allowance resets.
        resets_at: Option<SystemTime>,
    },
    /// The legacy session and weekly windows.
    Windows {
        /// The session window.
        session: Option<WindowLeft>,
        /// The weekly window.
        weekly: Option<WindowLeft>,
    },
}

/// What is left of one window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowLeft {
    /// Remaining percent, 0 to 100.
    pub remaining_percent: f64,
    /// When it resets.
    pub resets_at: Option<SystemTime>,
}

impl Balance {
    /// The plan's name: "credits" or "windows".
    pub fn plan(&self) -> &'static str {
        match self {
            Balance::Credits { .. } => "credits",
            Balance::Windows { .. } => "windows",
        }
    }

    /// Whether the part of the balance an extra-usage-only model draws on differs between
    /// `self` and `other`: the extra balance of a credit plan; what is left of either window
    /// of a window plan (its extra usage is not reported separately); any change of plan.
    pub fn extra_changed(&self, other: &Balance) -> bool {
        match (self, other) {
            (Balance::Credits { extra_usd: a, .. }, Balance::Credits { extra_usd: b, .. }) => {
                a != b
            }
            // What is left, not when it resets (a reset time may be restated at each read).
            (
                Balance::Windows {
                    session: s1,
                    weekly: w1,
                },
                Balance::Windows {
                    session: s2,
                    weekly: w2,
                },
            ) => {
                let left = |w: &Option<WindowLeft>| w.map(|w| w.remaining_percent);
                left(s1) != left(s2) || left(w1) != left(w2)
            }
            _ => true,
        }
    }
}

impl Account {
    /// The remaining USD above the reserve (credit plans: included and extra), or `None` for a
    /// window plan or an unread balance.
    pub fn spendable_usd(&self) -> Option<f64> {
        match &self.balance {
            Some(Balance::Credits {
                included_usd,
                allowance_usd,
                extra_usd,
                ..
            }) => {
                let percent_floor = allowance_usd.unwrap_or(0.0) * self.reserve_percent / 100.0;
                let floor = self.reserve_usd.max(percent_floor);
                Some(included_usd + extra_usd - floor)
            }
            _ => None,
        }
    }

    /// What is left of the nearer-to-empty window above the reserve, in percent, or `None`
    /// for a credit plan or an unread balance.
    pub fn spendable_percent(&self) -> Option<f64> {
        match &self.balance {
            Some(Balance::Windows { session, weekly }) => [session, weekly]
                .into_iter()
                .flatten()
                .map(|window| window.remaining_percent - self.reserve_percent)
                .reduce(f64::min),
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
