//! An Ollama Cloud account's balance, as both planes hold it: the control plane reads it
//! (`GET /api/balance`, credit or legacy window plan) and puts it in the snapshot's
//! `CloudAccount`; the data planes read it back from there and steer by it. The type, the
//! reserve rule and the conversion to and from the wire live here, once, so that both sides
//! agree on them.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::policy::v1::{CloudAccount, CloudWindow};
use crate::unix_ms;

/// What one read said of an account's balance.
#[derive(Debug, Clone, PartialEq)]
pub enum Balance {
    /// A monthly included allowance in USD, then purchased extra usage.
    Credits {
        /// What is left of the included allowance.
        included_usd: f64,
        /// The period's allowance, when stated.
        allowance_usd: Option<f64>,
        /// The purchased extra-usage balance (0 when not stated).
        extra_usd: f64,
        /// When the allowance resets, when stated.
        resets_at: Option<SystemTime>,
    },
    /// The legacy session (5-hour) and weekly windows.
    Windows {
        /// The session window, when reported.
        session: Option<WindowLeft>,
        /// The weekly window, when reported.
        weekly: Option<WindowLeft>,
    },
}

/// What is left of one window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowLeft {
    /// Remaining percent, 0 to 100.
    pub remaining_percent: f64,
    /// When it resets, when stated.
    pub resets_at: Option<SystemTime>,
}

impl Balance {
    /// The plan's name on the wire (`CloudAccount.plan`): "credits" or "windows".
    pub fn plan(&self) -> &'static str {
        match self {
            Balance::Credits { .. } => "credits",
            Balance::Windows { .. } => "windows",
        }
    }

    /// What is left above a reserve of `reserve_usd` or `reserve_percent`, whichever is
    /// larger: USD on a credit plan (included and extra, less the larger of `reserve_usd` and
    /// `reserve_percent` of the allowance), percent on a window plan (of the nearer-to-empty
    /// window, less `reserve_percent`); `None` for a window plan that reported no window.
    pub fn left_above(&self, reserve_usd: f64, reserve_percent: f64) -> Option<f64> {
        match self {
            Balance::Credits {
                included_usd,
                allowance_usd,
                extra_usd,
                ..
            } => {
                let floor = reserve_usd.max(allowance_usd.unwrap_or(0.0) * reserve_percent / 100.0);
                Some(included_usd + extra_usd - floor)
            }
            Balance::Windows { session, weekly } => [session, weekly]
                .into_iter()
                .flatten()
                .map(|window| window.remaining_percent - reserve_percent)
                .reduce(f64::min),
        }
    }

    /// Whether the balance is at or under the reserve: nothing is left above it
    /// ([`Balance::left_above`]). Nothing left is under a reserve of 0.
    pub fn under_reserve(&self, reserve_usd: f64, reserve_percent: f64) -> bool {
        self.left_above(reserve_usd, reserve_percent)
            .is_some_and(|left| left <= 0.0)
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

    /// Writes the balance into `account`'s plan and balance fields (not its read time).
    pub fn to_wire(&self, account: &mut CloudAccount) {
        let ms = |time: Option<SystemTime>| time.map_or(0, unix_ms);
        account.plan = self.plan().to_owned();
        match self {
            Balance::Credits {
                included_usd,
                allowance_usd,
                extra_usd,
                resets_at,
            } => {
                account.included_usd = *included_usd;
                account.allowance_usd = allowance_usd.unwrap_or(0.0);
                account.extra_usd = *extra_usd;
                account.resets_at_unix_ms = ms(*resets_at);
            }
            Balance::Windows { session, weekly } => {
                let window = |left: &Option<WindowLeft>| {
                    left.map(|left| CloudWindow {
                        remaining_percent: left.remaining_percent,
                        resets_at_unix_ms: ms(left.resets_at),
                    })
                };
                account.session = window(session);
                account.weekly = window(weekly);
            }
        }
    }

    /// The balance `account` carries; `None` for a plan oqp does not know or none read yet.
    /// A figure that is not a finite number counts as 0, a window's percent is kept within 0
    /// to 100, and an allowance of 0 is not stated.
    pub fn from_wire(account: &CloudAccount) -> Option<Balance> {
        let finite = |value: f64| if value.is_finite() { value } else { 0.0 };
        let window = |window: &Option<CloudWindow>| {
            window.as_ref().map(|window| WindowLeft {
                remaining_percent: finite(window.remaining_percent).clamp(0.0, 100.0),
                resets_at: time_of(window.resets_at_unix_ms),
            })
        };
        match account.plan.as_str() {
            "credits" => Some(Balance::Credits {
                included_usd: finite(account.included_usd),
                allowance_usd: (account.allowance_usd > 0.0).then(|| finite(account.allowance_usd)),
                extra_usd: finite(account.extra_usd),
                resets_at: time_of(account.resets_at_unix_ms),
            }),
            "windows" => Some(Balance::Windows {
                session: window(&account.session),
                weekly: window(&account.weekly),
            }),
            _ => None,
        }
    }
}

/// The time of a `*_unix_ms` field; `None` for 0 (not stated) or before the epoch.
pub fn time_of(unix_ms: i64) -> Option<SystemTime> {
    u64::try_from(unix_ms)
        .ok()
        .filter(|ms| *ms > 0)
        .map(|ms| UNIX_EPOCH + Duration::from_millis(ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Option<SystemTime> {
        Some(UNIX_EPOCH + Duration::from_millis(ms))
    }

    #[test]
    fn a_balance_goes_through_the_wire_unchanged() {
        for balance in [
            Balance::Credits {
                included_usd: 12.5,
                allowance_usd: Some(20.0),
                extra_usd: 3.25,
                resets_at: at(1_798_675_200_000),
            },
            Balance::Credits {
                included_usd: 0.0,
                allowance_usd: None,
                extra_usd: 0.0,
                resets_at: None,
            },
            Balance::Windows {
                session: Some(WindowLeft {
                    remaining_percent: 73.5,
                    resets_at: at(1_796_407_200_500),
                }),
                weekly: None,
            },
        ] {
            let mut account = CloudAccount::default();
            balance.to_wire(&mut account);
            assert_eq!(Balance::from_wire(&account), Some(balance));
        }
        assert_eq!(Balance::from_wire(&CloudAccount::default()), None, "unread");
    }

    #[test]
    fn what_comes_off_the_wire_is_kept_in_range() {
        let account = CloudAccount {
            plan: "windows".to_owned(),
            session: Some(CloudWindow {
                remaining_percent: 140.0,
                resets_at_unix_ms: -5,
            }),
            weekly: Some(CloudWindow {
                remaining_percent: f64::NAN,
                resets_at_unix_ms: 0,
            }),
            ..CloudAccount::default()
        };
        let Some(Balance::Windows { session, weekly }) = Balance::from_wire(&account) else {
            panic!("not a window plan");
        };
        assert_eq!(
            (
                session.unwrap().remaining_percent,
                session.unwrap().resets_at
            ),
            (100.0, None)
        );
        assert_eq!(weekly.unwrap().remaining_percent, 0.0);
    }

    #[test]
    fn the_reserve_is_the_larger_of_dollars_and_percent_and_the_nearer_window() {
        let credits = Balance::Credits {
            included_usd: 3.0,
            allowance_usd: Some(20.0),
            extra_usd: 1.0,
            resets_at: None,
        };
        assert_eq!(credits.left_above(0.0, 0.0), Some(4.0));
        assert_eq!(credits.left_above(1.5, 0.0), Some(2.5));
        assert_eq!(credits.left_above(1.5, 25.0), Some(-1.0), "25% of $20");
        assert!(credits.under_reserve(1.5, 25.0));
        assert!(!credits.under_reserve(1.5, 0.0));
        let windows = Balance::Windows {
            session: Some(WindowLeft {
                remaining_percent: 60.0,
                resets_at: None,
            }),
            weekly: Some(WindowLeft {
                remaining_percent: 15.0,
                resets_at: None,
            }),
        };
        assert_eq!(windows.left_above(0.0, 10.0), Some(5.0));
        assert!(windows.under_reserve(0.0, 15.0));
        let none = Balance::Windows {
            session: None,
            weekly: None,
        };
        assert!(!none.under_reserve(0.0, 100.0), "no window is not empty");
    }
}
