//! `GET /dashboard/usage`: the dashboard's usage view. GPU time and tokens per client, and per
//! end user of an app key, over the current UTC day (all data planes, as far as this node
//! knows), with each budget's use of its current window and each key's model allowlist.
//!
//! What a caller sees follows its key's scope: `management` (or anyone with auth off) sees
//! every client; a key below it sees its own row only, with its app's users (the same rule
//! as `usage_today` in `/queue/status`). Rows are bounded: every configured client, at most
//! [`MAX_OTHER_ROWS`] others (named with `X-Client-ID` while auth is off) and at most
//! [`MAX_USERS_PER_APP`] users per app, the busiest first.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use http::Response;
use serde::Serialize;

use crate::body::{self, Body};
use crate::policy::{Client, Policy, UsageBudget};
use crate::usage::{Totals, Usage};

/// Most clients listed that are not configured.
pub const MAX_OTHER_ROWS: usize = crate::status::MAX_OTHER_CLIENTS;

/// Most end users listed per app.
pub const MAX_USERS_PER_APP: usize = 100;

/// The usage view's document.
#[derive(Debug, Serialize)]
pub struct View {
    /// The UTC day counted, `YYYY-MM-DD`.
    day: String,
    /// Whether the caller sees every client (else its own only).
    everyone: bool,
    clients: Vec<Row>,
}

/// One client's day.
#[derive(Debug, Serialize)]
struct Row {
    client_id: String,
    description: Option<String>,
    #[serde(flatten)]
    used: Used,
    /// The key's model allowlist; `null`: every model.
    models: Option<Vec<String>>,
    budget: Option<Budget>,
    /// An app key's end users (`<client_id>/<user>`), the busiest first.
    users: Vec<UserRow>,
}

/// One end user's day.
#[derive(Debug, Serialize)]
struct UserRow {
    user: String,
    #[serde(flatten)]
    used: Used,
    budget: Option<Budget>,
}

#[derive(Debug, Default, Serialize)]
struct Used {
    gpu_seconds: f64,
    prompt_tokens: u64,
    completion_tokens: u64,
    tokens: u64,
    requests: u64,
    #[serde(skip)]
    gpu_ns: u64,
}

impl Used {
    fn of(totals: &Totals) -> Self {
        Self {
            gpu_seconds: seconds(totals.gpu_ns),
            prompt_tokens: totals.prompt_tokens,
            completion_tokens: totals.completion_tokens,
            tokens: totals.tokens(),
            requests: totals.requests,
            gpu_ns: totals.gpu_ns,
        }
    }
}

/// A budget and its current window's use: what the bars show.
#[derive(Debug, Serialize)]
struct Budget {
    window: String,
    /// `null`: no GPU-time limit.
    gpu_seconds_limit: Option<f64>,
    /// `null`: no token limit.
    tokens_limit: Option<u64>,
    gpu_seconds_used: f64,
    tokens_used: u64,
}

fn seconds(ns: u64) -> f64 {
    (ns as f64 / 1e6).round() / 1e3
}

fn budget(usage: &Usage, id: &str, budget: &UsageBudget, app: bool, now: SystemTime) -> Budget {
    let (gpu_ns, tokens) = usage.budget_used(id, budget, app, now);
    Budget {
        window: budget.window.clone(),
        gpu_seconds_limit: (budget.gpu_ns > 0).then(|| seconds(budget.gpu_ns)),
        tokens_limit: (budget.tokens > 0).then_some(budget.tokens),
        gpu_seconds_used: seconds(gpu_ns),
        tokens_used: tokens,
    }
}

/// The view for a caller who may see `own`'s usage only (`None`: everyone's).
pub fn view(usage: &Usage, policy: &Policy, own: Option<&str>, now: SystemTime) -> View {
    let visible = |id: &str| own.is_none_or(|own| id == own);
    let today = usage.today_all(now);
    let mut own_totals: BTreeMap<&str, &Totals> = BTreeMap::new();
    let mut users: BTreeMap<&str, Vec<(&str, &Totals)>> = BTreeMap::new();
    for (id, totals) in &today {
        match id.split_once('/') {
            Some((app, user)) => users.entry(app).or_default().push((user, totals)),
            None => {
                own_totals.insert(id, totals);
            }
        }
    }
    let zero = Totals::default();
    let mut rows = Vec::new();
    let configured: Vec<&Arc<Client>> = policy.clients_by_id.values().collect();
    for client in configured {
        if !visible(&client.id) {
            continue;
        }
        let totals = own_totals.remove(&*client.id).unwrap_or(&zero);
        let mut row = Row {
            client_id: client.id.to_string(),
            description: Some(client.description.clone()).filter(|d| !d.is_empty()),
            used: Used::of(totals),
            models: client.models.as_ref().map(|m| m.patterns().to_vec()),
            budget: client
                .budget
                .as_ref()
                .map(|b| budget(usage, &client.id, b, client.users.is_some(), now)),
            users: Vec::new(),
        };
        let user_budget = client.users.as_ref().and_then(|u| u.budget.as_ref());
        row.users = user_rows(users.remove(&*client.id).unwrap_or_default())
            .into_iter()
            .map(|(user, totals)| UserRow {
                budget: user_budget
                    .map(|b| budget(usage, &format!("{}/{user}", client.id), b, false, now)),
                user: user.to_owned(),
                used: Used::of(totals),
            })
            .collect();
        rows.push(row);
    }
    // Callers that are not configured: named with X-Client-ID while auth is off.
    let mut others: Vec<Row> = own_totals
        .into_iter()
        .filter(|(id, _)| visible(id))
        .map(|(id, totals)| Row {
            client_id: id.to_owned(),
            description: None,
            used: Used::of(totals),
            models: None,
            budget: None,
            users: Vec::new(),
        })
        .collect();
    others.sort_by_key(|row| std::cmp::Reverse(row.used.gpu_ns));
    others.truncate(MAX_OTHER_ROWS);
    rows.extend(others);
    rows.sort_by(|a, b| {
        b.used
            .gpu_ns
            .cmp(&a.used.gpu_ns)
            .then_with(|| b.used.tokens.cmp(&a.used.tokens))
            .then_with(|| a.client_id.cmp(&b.client_id))
    });
    let day = humantime::format_rfc3339_seconds(now).to_string();
    View {
        day: day.get(..10).unwrap_or_default().to_owned(),
        everyone: own.is_none(),
        clients: rows,
    }
}

/// The busiest users first, at most [`MAX_USERS_PER_APP`].
fn user_rows<'a>(mut users: Vec<(&'a str, &'a Totals)>) -> Vec<(&'a str, &'a Totals)> {
    users.sort_by(|a, b| b.1.gpu_ns.cmp(&a.1.gpu_ns).then_with(|| a.0.cmp(b.0)));
    users.truncate(MAX_USERS_PER_APP);
    users
}

/// The `/dashboard/usage` response.
pub fn response(usage: &Usage, policy: &Policy, own: Option<&str>) -> Response<Body> {
    let view = view(usage, policy, own, SystemTime::now());
    let value = serde_json::to_value(&view).unwrap_or_default();
    let mut response = body::json_response(value);
    response.headers_mut().insert(
        http::header::CACHE_CONTROL,
        http::HeaderValue::from_static("no-store"),
    );
    response
}
