//! How the fake ollama.com bills (since 2026-08-31): keys belong to accounts, an account is on a
//! credit plan (a monthly included allowance in USD, then purchased extra usage) or a legacy
//! window plan (session and weekly), and `GET /api/balance` reports it in that plan's shape.
//!
//! - A key's account is the one a test set (`set_account`), else the key alone.
//! - Each served inference request on a credit account costs its output tokens at the stated
//!   price (`price_per_output_token`), from the included balance first, then the extra one.
//! - A model can use extra usage only: on an account whose extra balance is empty it answers
//!   402 with the cloud's text (ollama/ollama#17639); every other model still serves.
//! - `GET /api/usage` reports what the account spent (`usage_usd`, the requests and the output
//!   tokens it billed), at the top of the body or, in the second shape
//!   ([`CloudUsageShape::Monthly`]), under `limits.monthly.usage`.
//! - Reads of `/api/balance` and `/api/usage` are limited like the real ones: at most
//!   [`READS_PER_MINUTE`] a rolling minute per account, across its keys and both endpoints;
//!   past that, 429 with `Retry-After`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant, SystemTime};

use http::{HeaderValue, StatusCode, header};
use serde_json::{Value, json};

use super::super::wire::{Reply, gin_error, gin_json, reference_id, rfc3339};

/// Reads of `/api/balance` and `/api/usage` one account may make in a rolling minute.
pub const READS_PER_MINUTE: usize = 10;

const MINUTE: Duration = Duration::from_secs(60);

/// The plan of a fake Ollama Cloud account.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CloudPlan {
    /// A current plan: a monthly included allowance in USD, `balance_usd` of it left.
    Credits {
        /// The month's allowance.
        allowance_usd: f64,
        /// What is left of it.
        balance_usd: f64,
    },
    /// A legacy plan: the 5-hour session and weekly windows, as remaining percentages.
    Windows {
        /// Remaining percent of the session window.
        session_percent: f64,
        /// Remaining percent of the weekly window.
        weekly_percent: f64,
    },
}

/// The shape in which the fake answers an account's `GET /api/usage`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CloudUsageShape {
    /// `usage_usd`, `request_count`, `input_tokens`, `cached_input_tokens` and
    /// `output_tokens` at the top, with one such object per model under `models`.
    #[default]
    Dollars,
    /// The same figures under `limits.monthly.usage`.
    Monthly,
}

/// Billing state: accounts, plans, prices, extra-usage-only models, and the read log.
#[derive(Debug, Default)]
pub(crate) struct Billing {
    account_of: HashMap<String, String>,
    accounts: HashMap<String, Account>,
    extra_only: HashSet<String>,
    price_per_output_token: f64,
    read_limit: Option<usize>,
    /// Replaces every `/api/balance` body (a shape oqp does not know).
    balance_body: Option<Value>,
}

#[derive(Debug)]
struct Account {
    plan: CloudPlan,
    extra_usd: f64,
    /// When the account was first seen: reset times are stated from it, the same at each read.
    since: SystemTime,
    /// Every `/api/balance` and `/api/usage` read: when, whether it was refused with a
    /// 429, and whether it was of `/api/usage`.
    reads: Vec<(Instant, bool, bool)>,
    /// What it spent, per model: requests, output tokens, USD.
    spent: HashMap<String, (u64, u64, f64)>,
    usage_shape: CloudUsageShape,
}

impl Default for Account {
    fn default() -> Self {
        Account {
            plan: CloudPlan::Credits {
                allowance_usd: 20.0,
                balance_usd: 20.0,
            },
            extra_usd: 0.0,
            since: SystemTime::now(),
            reads: Vec::new(),
            spent: HashMap::new(),
            usage_shape: CloudUsageShape::Dollars,
        }
    }
}

/// One `/api/balance` or `/api/usage` read an account made, as the fake saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BalanceRead {
    /// When it arrived.
    pub at: Instant,
    /// Whether it was refused with a 429 (over the read limit).
    pub limited: bool,
    /// Whether it was of `/api/usage` (else `/api/balance`).
    pub usage: bool,
}

impl Billing {
    /// The account `key` belongs to.
    pub fn account_of(&self, key: &str) -> String {
        self.account_of
            .get(key)
            .cloned()
            .unwrap_or_else(|| key.to_owned())
    }

    /// Puts `keys` in `account`.
    pub fn set_account(&mut self, account: &str, keys: &[&str]) {
        for key in keys {
            self.account_of
                .insert((*key).to_owned(), account.to_owned());
        }
    }

    /// Sets an account's plan (and so what `/api/balance` reports).
    pub fn set_plan(&mut self, account: &str, plan: CloudPlan) {
        self.accounts.entry(account.to_owned()).or_default().plan = plan;
    }

    /// Sets an account's purchased extra-usage balance.
    pub fn set_extra(&mut self, account: &str, usd: f64) {
        self.accounts
            .entry(account.to_owned())
            .or_default()
            .extra_usd = usd;
    }

    /// Makes `model` bill extra usage only.
    pub fn extra_usage_only(&mut self, model: &str) {
        self.extra_only.insert(model.to_owned());
    }

    /// The price of one output token in USD (0 by default: nothing falls).
    pub fn set_price(&mut self, usd_per_output_token: f64) {
        self.price_per_output_token = usd_per_output_token;
    }

    /// Lowers (or raises) the `/api/balance` read limit per account and minute.
    pub fn set_read_limit(&mut self, reads: usize) {
        self.read_limit = Some(reads);
    }

    /// Answers every `/api/balance` with this body instead of the plan's shape.
    pub fn set_balance_body(&mut self, body: Value) {
        self.balance_body = Some(body);
    }

    /// The 402 for `model` on `key`'s account, if the model uses extra usage only and the
    /// account has none.
    pub fn refuse_model(&self, key: &str, model: &str) -> Option<Reply> {
        if !self.extra_only.contains(model) {
            return None;
        }
        let account = self.accounts.get(&self.account_of(key));
        if account.is_some_and(|account| account.extra_usd > 0.0) {
            return None;
        }
        Some(gin_error(
            StatusCode::PAYMENT_REQUIRED,
            &format!(
                "this model uses extra usage only (not included plan usage) and your extra \
                 usage balance is empty, add extra usage or turn on auto reload: \
                 https://ollama.com/settings (ref: {})",
                reference_id()
            ),
        ))
    }

    /// Charges `output_tokens` of `model` to `key`'s account at the stated price: an
    /// extra-usage-only model from the extra balance, any other from the included balance
    /// first, then the extra one.
    pub fn charge(&mut self, key: &str, model: &str, output_tokens: usize) {
        #[allow(clippy::cast_precision_loss)]
        let mut cost = output_tokens as f64 * self.price_per_output_token;
        let extra_only = self.extra_only.contains(model);
        let account = self.accounts.entry(self.account_of(key)).or_default();
        let spent = account.spent.entry(model.to_owned()).or_default();
        spent.0 += 1;
        spent.1 += u64::try_from(output_tokens).unwrap_or(u64::MAX);
        spent.2 += cost;
        if let CloudPlan::Credits { balance_usd, .. } = &mut account.plan
            && !extra_only
        {
            let taken = cost.min(*balance_usd);
            *balance_usd -= taken;
            cost -= taken;
        }
        account.extra_usd = (account.extra_usd - cost).max(0.0);
    }

    /// `GET /api/balance` for `key`: the plan's shape, or a 429 with `Retry-After` past the
    /// account's read limit.
    pub fn balance(&mut self, key: &str) -> Reply {
        if let Err(reply) = self.read(key, false) {
            return reply;
        }
        if let Some(body) = &self.balance_body {
            return gin_json(StatusCode::OK, body);
        }
        let account = self.accounts.entry(self.account_of(key)).or_default();
        let wall = account.since;
        let body = match account.plan {
            CloudPlan::Credits {
                allowance_usd,
                balance_usd,
            } => json!({
                "included": { "balance_usd": balance_usd, "allowance_usd": allowance_usd },
                "period": {
                    "type": "monthly",
                    "resets_at": rfc3339(wall + Duration::from_secs(20 * 24 * 3600)),
                },
                "extra": { "balance_usd": account.extra_usd },
            }),
            CloudPlan::Windows {
                session_percent,
                weekly_percent,
            } => json!({
                "session": {
                    "remaining_percent": session_percent,
                    "resets_at": rfc3339(wall + Duration::from_secs(3 * 3600)),
                },
                "weekly": {
                    "remaining_percent": weekly_percent,
                    "resets_at": rfc3339(wall + Duration::from_secs(4 * 24 * 3600)),
                },
            }),
        };
        gin_json(StatusCode::OK, &body)
    }

    /// One read of `key`'s account (`usage`: of `/api/usage`), or the 429 past its read limit.
    fn read(&mut self, key: &str, usage: bool) -> Result<&mut Account, Reply> {
        let limit = self.read_limit.unwrap_or(READS_PER_MINUTE);
        let now = Instant::now();
        let account = self.accounts.entry(self.account_of(key)).or_default();
        let recent: VecDeque<Instant> = account
            .reads
            .iter()
            .filter(|(at, limited, _)| !limited && now.saturating_duration_since(*at) < MINUTE)
            .map(|(at, ..)| *at)
            .collect();
        if recent.len() >= limit {
            account.reads.push((now, true, usage));
            let oldest = recent.front().copied().unwrap_or(now);
            let wait = MINUTE.saturating_sub(now.saturating_duration_since(oldest));
            let mut reply = gin_error(
                StatusCode::TOO_MANY_REQUESTS,
                "too many requests, please slow down",
            );
            reply.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(wait.as_secs().max(1)),
            );
            return Err(reply);
        }
        account.reads.push((now, false, usage));
        Ok(account)
    }

    /// Sets the shape of `account`'s `/api/usage`.
    pub fn set_usage_shape(&mut self, account: &str, shape: CloudUsageShape) {
        self.accounts
            .entry(account.to_owned())
            .or_default()
            .usage_shape = shape;
    }

    /// What `account` spent so far, in USD.
    pub fn spent(&self, account: &str) -> f64 {
        self.accounts.get(account).map_or(0.0, |account| {
            account.spent.values().map(|spent| spent.2).sum()
        })
    }

    /// `GET /api/usage` for `key`: what its account spent (all of it falls in any range), in
    /// the account's shape, or a 429 past the read limit (shared with `/api/balance`).
    pub fn usage(&mut self, key: &str) -> Reply {
        let account = match self.read(key, true) {
            Ok(account) => account,
            Err(reply) => return reply,
        };
        let figures = |requests: u64, output: u64, usd: f64| {
            json!({
                "request_count": requests,
                "usage_usd": usd,
                "input_tokens": 0,
                "cached_input_tokens": 0,
                "output_tokens": output,
            })
        };
        let mut models: Vec<(&String, &(u64, u64, f64))> = account.spent.iter().collect();
        models.sort_by(|a, b| a.0.cmp(b.0));
        let (requests, output, usd) = models.iter().fold((0, 0, 0.0), |sum, (_, spent)| {
            (sum.0 + spent.0, sum.1 + spent.1, sum.2 + spent.2)
        });
        let body = match account.usage_shape {
            CloudUsageShape::Dollars => {
                let mut body = figures(requests, output, usd);
                body["range"] = json!("30d");
                body["scope"] = json!("self");
                body["models"] = models
                    .iter()
                    .map(|(model, spent)| {
                        let mut one = figures(spent.0, spent.1, spent.2);
                        one["model"] = json!(model);
                        one
                    })
                    .collect();
                body
            }
            CloudUsageShape::Monthly => json!({
                "limits": { "monthly": { "usage": figures(requests, output, usd) } },
            }),
        };
        gin_json(StatusCode::OK, &body)
    }

    /// Every `/api/balance` and `/api/usage` read `account` made, in order.
    pub fn balance_reads(&self, account: &str) -> Vec<BalanceRead> {
        self.accounts
            .get(account)
            .map(|account| {
                account
                    .reads
                    .iter()
                    .map(|(at, limited, usage)| BalanceRead {
                        at: *at,
                        limited: *limited,
                        usage: *usage,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}
