//! The fake's ollama.com mode (reference §A.9, §B.7 item 12): a Bearer key is required, and each
//! key can be scripted to answer its next inference requests with the cloud's rate-limit (429,
//! no Retry-After), overload or slot-timeout errors. `GET /api/usage` reports per-key session and
//! weekly fractions where a test set them, else the account's spend in dollars ([`billing`]). A model can need a subscription: a key without one gets a 403 for that model
//! only, while every other model and `GET /api/usage` still work with it; a suspended key gets
//! a 403 for everything, `/api/usage` included. Accounts, plans, balances and the 402 of an
//! extra-usage-only model are in [`billing`].

mod billing;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use http::StatusCode;
use serde_json::json;

pub use billing::{BalanceRead, CloudPlan, CloudUsageShape, READS_PER_MINUTE};

use super::record::lock;
use super::wire::{Reply, gin_error, gin_json, reference_id, rfc3339};

/// How ollama.com answers one request presenting a given key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloudReply {
    /// 429, "you (user) have reached your session usage limit, ..." with a `(ref: …)`.
    SessionLimit,
    /// 429, the same with "weekly".
    WeeklyLimit,
    /// 429, the same with "hourly".
    HourlyLimit,
    /// 503 "Server overloaded, please retry shortly (ref: …)".
    Overloaded,
    /// 503 "timed out waiting for a concurrent request slot" (the real status is unreported).
    SlotTimeout,
    /// 401 "unauthorized", as for a revoked key.
    Unauthorized,
    /// Served normally.
    Ok,
}

/// Cloud-mode state: the valid keys, the scripts and the usage fractions.
#[derive(Debug)]
pub(crate) struct Cloud {
    keys: HashSet<String>,
    scripts: Mutex<HashMap<String, VecDeque<CloudReply>>>,
    defaults: Mutex<HashMap<String, CloudReply>>,
    usage: Mutex<HashMap<String, (f64, f64)>>,
    /// Model → the keys subscribed to it; models not listed need no subscription.
    subscriptions: Mutex<HashMap<String, HashSet<String>>>,
    /// Keys refused with a 403 on every authenticated route.
    suspended: Mutex<HashSet<String>>,
    /// Accounts, plans, balances and the read limit.
    pub(crate) billing: Mutex<billing::Billing>,
}

impl CloudReply {
    /// The error response for this reply; `None` for `Ok`.
    pub(crate) fn to_reply(&self) -> Option<Reply> {
        let limit = |window: &str| {
            format!(
                "you (user) have reached your {window} usage limit, upgrade for higher limits: \
                 https://ollama.com/upgrade or add extra usage: https://ollama.com/settings (ref: {})",
                reference_id()
            )
        };
        let (status, message) = match self {
            CloudReply::SessionLimit => (StatusCode::TOO_MANY_REQUESTS, limit("session")),
            CloudReply::WeeklyLimit => (StatusCode::TOO_MANY_REQUESTS, limit("weekly")),
            CloudReply::HourlyLimit => (StatusCode::TOO_MANY_REQUESTS, limit("hourly")),
            CloudReply::Overloaded => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "Server overloaded, please retry shortly (ref: {})",
                    reference_id()
                ),
            ),
            CloudReply::SlotTimeout => (
                StatusCode::SERVICE_UNAVAILABLE,
                "timed out waiting for a concurrent request slot".to_owned(),
            ),
            CloudReply::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized".to_owned()),
            CloudReply::Ok => return None,
        };
        Some(gin_error(status, &message))
    }
}

impl Cloud {
    /// A cloud that accepts these keys.
    pub fn new(keys: impl IntoIterator<Item = String>) -> Self {
        Self {
            keys: keys.into_iter().collect(),
            scripts: Mutex::default(),
            defaults: Mutex::default(),
            usage: Mutex::default(),
            subscriptions: Mutex::default(),
            suspended: Mutex::default(),
            billing: Mutex::default(),
        }
    }

    /// Checks the Bearer key a request presented; `Err` is the 401 to send (or the 403 of a
    /// suspended key).
    pub fn authenticate(&self, key: Option<&str>) -> Result<(), Reply> {
        match key {
            Some(key) if lock(&self.suspended).contains(key) => Err(gin_error(
                StatusCode::FORBIDDEN,
                &format!("this account is suspended (ref: {})", reference_id()),
            )),
            Some(key) if self.keys.contains(key) => Ok(()),
            _ => Err(gin_error(StatusCode::UNAUTHORIZED, "unauthorized")),
        }
    }

    /// Checks that `key` may use `model`; `Err` is the model-specific 403 to send.
    pub fn authorize_model(&self, key: Option<&str>, model: &str) -> Result<(), Reply> {
        let subscriptions = lock(&self.subscriptions);
        match subscriptions.get(model) {
            Some(subscribed) if !key.is_some_and(|key| subscribed.contains(key)) => Err(gin_error(
                StatusCode::FORBIDDEN,
                &format!(
                    "this model requires a subscription, upgrade for access: \
                         https://ollama.com/upgrade (ref: {})",
                    reference_id()
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Checks that `key` may run `model` now; `Err` is the 402 of an extra-usage-only model
    /// on an account without extra usage.
    pub fn bill_model(&self, key: Option<&str>, model: &str) -> Result<(), Reply> {
        match key.and_then(|key| lock(&self.billing).refuse_model(key, model)) {
            Some(reply) => Err(reply),
            None => Ok(()),
        }
    }

    /// Makes `model` need a subscription that only `subscribed` keys have.
    pub fn require_subscription(&self, model: &str, subscribed: &[&str]) {
        lock(&self.subscriptions).insert(
            model.to_owned(),
            subscribed.iter().map(|key| (*key).to_owned()).collect(),
        );
    }

    /// Refuses `key` with a 403 on every authenticated route.
    pub fn suspend(&self, key: &str) {
        lock(&self.suspended).insert(key.to_owned());
    }

    /// Queues a one-shot reply for the next inference request presenting `key`.
    pub fn script(&self, key: &str, reply: CloudReply) {
        lock(&self.scripts)
            .entry(key.to_owned())
            .or_default()
            .push_back(reply);
    }

    /// Sets the reply given to `key` whenever no one-shot reply is queued.
    pub fn set_default(&self, key: &str, reply: CloudReply) {
        lock(&self.defaults).insert(key.to_owned(), reply);
    }

    /// Sets the usage fractions `GET /api/usage` reports for `key`.
    pub fn set_usage(&self, key: &str, session: f64, weekly: f64) {
        lock(&self.usage).insert(key.to_owned(), (session, weekly));
    }

    /// The reply due to the next inference request presenting `key`.
    pub fn next_reply(&self, key: &str) -> CloudReply {
        let scripted = lock(&self.scripts)
            .get_mut(key)
            .and_then(VecDeque::pop_front);
        scripted
            .or_else(|| lock(&self.defaults).get(key).cloned())
            .unwrap_or(CloudReply::Ok)
    }

    /// `GET /api/usage` for `key`: the session and weekly fractions set for it (the
    /// best-effort legacy shape, §A.9), else what its account spent ([`billing`]).
    pub fn usage(&self, key: &str) -> Reply {
        let Some((session, weekly)) = lock(&self.usage).get(key).copied() else {
            return lock(&self.billing).usage(key);
        };
        let now = SystemTime::now();
        let body = json!({
            "limits": {
                "session": { "usage": session, "resets_at": rfc3339(now + Duration::from_secs(5 * 3600)) },
                "weekly": { "usage": weekly, "resets_at": rfc3339(now + Duration::from_secs(7 * 24 * 3600)) },
            },
            "activity": {},
        });
        gin_json(StatusCode::OK, &body)
    }
}
