//! The pool's accounts as `/queue/status` shows them: plan, balance or windows, resets, the
//! reserve, the models each account refused (402 or 403) and its cooldown. Never a key: an
//! account without a label is shown as its redacted key.

use std::time::{Instant, SystemTime};

use serde::Serialize;

use super::{Account, Balance, KeyPool, Refusal, WindowLeft};
use crate::redact::redact_key;

/// One account as status shows it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct AccountStatus {
    /// The account label, or the redacted key of a key without one.
    pub account: String,
    /// The team sharing its balance, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
    /// "credits", "windows", or `None` before the first balance read.
    pub plan: Option<&'static str>,
    /// Credits: what is left of the included allowance.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub included_usd: Option<f64>,
    /// Credits: the period's allowance.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allowance_usd: Option<f64>,
    /// Credits: purchased extra usage left.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub extra_usd: Option<f64>,
    /// Credits: when the allowance resets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resets_at: Option<String>,
    /// Windows: the session window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<WindowStatus>,
    /// Windows: the weekly window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weekly: Option<WindowStatus>,
    /// When the balance was read.
    pub read_at: Option<String>,
    /// USD kept for the owner.
    pub reserve_usd: f64,
    /// Percent kept for the owner.
    pub reserve_percent: f64,
    /// Whether the balance is at or under the reserve (nothing is sent to it then while
    /// another account can serve).
    pub under_reserve: bool,
    /// Models it refused, and why ("extra_usage": a 402; "subscription": a 403).
    pub refused_models: Vec<RefusedModel>,
    /// Until when its keys are out of rotation (a quota limit), if they are.
    pub cooldown_until: Option<String>,
}

/// One window of a legacy plan.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct WindowStatus {
    /// Remaining percent.
    pub remaining_percent: f64,
    /// When it resets.
    pub resets_at: Option<String>,
}

/// A model an account refused.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct RefusedModel {
    /// The model, normalised.
    pub model: String,
    /// "extra_usage" (402) or "subscription" (403).
    pub reason: &'static str,
}

impl Refusal {
    /// The name status shows.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Subscription => "subscription",
            Refusal::ExtraUsage => "extra_usage",
        }
    }
}

impl KeyPool {
    /// Every account of the pool as this node reports it to the control plane: the refused
    /// models and the cooldown, the account named as the snapshot names it.
    pub fn account_reports(&self) -> Vec<oqp_proto::policy::v1::CloudAccountReport> {
        let (now, wall) = (Instant::now(), SystemTime::now());
        let state = self.lock();
        let mut out: Vec<oqp_proto::policy::v1::CloudAccountReport> = Vec::new();
        for slot in &state.keys {
            let name = slot
                .account
                .strip_prefix("account:")
                .unwrap_or(&slot.account)
                .to_owned();
            if out.iter().any(|report| report.account == name) {
                continue;
            }
            let mut refused_models: Vec<String> = state
                .refused
                .iter()
                .filter(|((id, _), (until, _))| id == &slot.account && *until > now)
                .map(|((_, model), (_, reason))| format!("{model} ({})", reason.as_str()))
                .collect();
            refused_models.sort();
            let cooldown_until_unix_ms = state
                .cooling
                .get(&slot.account)
                .filter(|until| **until > now)
                .map_or(0, |until| {
                    crate::policy::unix_ms(wall + until.saturating_duration_since(now))
                });
            out.push(oqp_proto::policy::v1::CloudAccountReport {
                account: name,
                refused_models,
                cooldown_until_unix_ms,
            });
        }
        out
    }

    /// Every account of the pool (in key order) as status shows it.
    pub fn account_status(&self) -> Vec<AccountStatus> {
        self.account_status_at(Instant::now(), SystemTime::now())
    }

    /// [`account_status`](KeyPool::account_status) with the clocks passed in.
    pub fn account_status_at(&self, now: Instant, wall: SystemTime) -> Vec<AccountStatus> {
        let state = self.lock();
        let mut out: Vec<AccountStatus> = Vec::new();
        let mut seen: Vec<&std::sync::Arc<str>> = Vec::new();
        for slot in &state.keys {
            if seen.contains(&&slot.account) {
                continue;
            }
            seen.push(&slot.account);
            let label = if slot.label.is_empty() {
                redact_key(&slot.secret)
            } else {
                slot.label.to_string()
            };
            let account = state
                .accounts
                .get(&slot.account)
                .cloned()
                .unwrap_or_default();
            let mut refused_models: Vec<RefusedModel> = state
                .refused
                .iter()
                .filter(|((id, _), (until, _))| id == &slot.account && *until > now)
                .map(|((_, model), (_, reason))| RefusedModel {
                    model: model.to_string(),
                    reason: reason.as_str(),
                })
                .collect();
            refused_models.sort_by(|a, b| a.model.cmp(&b.model));
            let cooldown_until = state
                .cooling
                .get(&slot.account)
                .filter(|until| **until > now)
                .map(|until| iso8601(wall + until.saturating_duration_since(now)));
            out.push(status_of(label, &account, refused_models, cooldown_until));
        }
        out
    }
}

fn status_of(
    label: String,
    account: &Account,
    refused_models: Vec<RefusedModel>,
    cooldown_until: Option<String>,
) -> AccountStatus {
    let window = |window: &Option<WindowLeft>| {
        window.map(|window| WindowStatus {
            remaining_percent: window.remaining_percent,
            resets_at: window.resets_at.map(iso8601),
        })
    };
    let mut status = AccountStatus {
        account: label,
        team: (!account.team.is_empty()).then(|| account.team.to_string()),
        plan: account.balance.as_ref().map(Balance::plan),
        included_usd: None,
        allowance_usd: None,
        extra_usd: None,
        resets_at: None,
        session: None,
        weekly: None,
        read_at: account.read_at.map(iso8601),
        reserve_usd: account.reserve_usd,
        reserve_percent: account.reserve_percent,
        under_reserve: account.under_reserve(),
        refused_models,
        cooldown_until,
    };
    match &account.balance {
        Some(Balance::Credits {
            included_usd,
            allowance_usd,
            extra_usd,
            resets_at,
        }) => {
            status.included_usd = Some(*included_usd);
            status.allowance_usd = *allowance_usd;
            status.extra_usd = Some(*extra_usd);
            status.resets_at = resets_at.map(iso8601);
        }
        Some(Balance::Windows { session, weekly }) => {
            status.session = window(session);
            status.weekly = window(weekly);
        }
        None => {}
    }
    status
}

/// RFC 3339 to the second, as the rest of `/queue/status`.
fn iso8601(at: SystemTime) -> String {
    let text = humantime::format_rfc3339_seconds(at).to_string();
    match text.strip_suffix('Z') {
        Some(stem) => format!("{stem}+00:00"),
        None => text,
    }
}
