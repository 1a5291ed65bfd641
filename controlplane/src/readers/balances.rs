//! The task that reads Ollama Cloud balances and spend: one supervisor ([`run`]) that follows
//! the config, with one task per reading unit (a team, or an account), restarted when a reload
//! changes how it reads, stopped when it leaves the config. Budgets outlive their tasks, so a
//! reload does not reset them. What it reads goes into the hub; what a balance is, and how
//! the snapshot carries it, is [`crate::balances`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::{ACCEPT, AUTHORIZATION, USER_AGENT};
use http::{HeaderValue, Request, StatusCode};
use http_body_util::Full;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::balances::{MINUTE, ReadBudget, Spend, Target, parse_balance, targets};
use crate::config::{Secret, WebhookEvent};
use crate::hub::Hub;
use crate::outbound::Outbound;
use crate::usage::UsageStore;
use crate::webhooks::Notice;

/// Largest `/api/balance` or `/api/usage` body read.
const BODY_LIMIT: usize = 64 * 1024;
/// Longest wait for one read.
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The wait after a 429 that carried no `Retry-After`.
const DEFAULT_RETRY_AFTER: Duration = MINUTE;

/// The supervisor: one reader per unit of the config in force, following reloads, until
/// `shutdown`.
pub async fn run(
    hub: Arc<Hub>,
    usage: Arc<UsageStore>,
    client: Outbound,
    shutdown: CancellationToken,
) {
    let mut configs = hub.watch_config();
    let mut running: HashMap<String, (Target, CancellationToken)> = HashMap::new();
    let budgets: Arc<Mutex<HashMap<String, Arc<Mutex<ReadBudget>>>>> = Arc::default();
    let mut tasks = JoinSet::new();
    loop {
        let config = configs.borrow_and_update().clone();
        let targets = targets(&config);
        let accounts: Vec<String> = targets
            .iter()
            .flat_map(|target| target.accounts.iter().map(|account| account.0.clone()))
            .collect();
        usage.retain_cloud_prices(&accounts);
        running.retain(|unit, (current, stop)| {
            let keep = targets.iter().any(|target| target == current);
            if !keep {
                stop.cancel();
                if targets.iter().all(|target| &target.unit != unit) {
                    hub.forget_balance(unit);
                }
            }
            keep
        });
        for target in targets {
            if running.contains_key(&target.unit) {
                continue;
            }
            let budget = budgets
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(target.unit.clone())
                .or_default()
                .clone();
            let stop = shutdown.child_token();
            tasks.spawn(read_unit(
                hub.clone(),
                usage.clone(),
                client.clone(),
                target.clone(),
                budget,
                stop.clone(),
            ));
            running.insert(target.unit.clone(), (target, stop));
        }
        while tasks.try_join_next().is_some() {}
        tokio::select! {
            changed = configs.changed() => if changed.is_err() { break },
            () = shutdown.cancelled() => break,
        }
    }
    for (_, stop) in running.values() {
        stop.cancel();
    }
    while tasks.join_next().await.is_some() {}
}

/// What a unit's reader reads next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    Balance,
    Usage,
}

/// Reads one unit's balance, then its usage (`/api/usage?range=30d`), every interval,
/// within its budget (both count), until `stop`.
async fn read_unit(
    hub: Arc<Hub>,
    usage: Arc<UsageStore>,
    client: Outbound,
    target: Target,
    budget: Arc<Mutex<ReadBudget>>,
    stop: CancellationToken,
) {
    let unit = target.unit.as_str();
    let mut due = Instant::now();
    let mut key = 0usize;
    let mut unknown_logged = false;
    let mut unknown_spend_logged = false;
    let mut turn = Turn::Balance;
    let names: Vec<String> = target
        .accounts
        .iter()
        .map(|account| account.0.clone())
        .collect();
    // Accounts seen at or under their reserve, so that the webhook fires on the way down only.
    let mut under: Vec<String> = Vec::new();
    loop {
        let at = lock(&budget).next_at(due);
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep_until(at) => {}
        }
        // Another task of the same unit (before a reload stopped it) may have read meanwhile.
        let now = Instant::now();
        if lock(&budget).next_at(now) > now {
            due = now;
            continue;
        }
        lock(&budget).record(now);
        let Some(secret) = target.keys.get(key % target.keys.len().max(1)) else {
            return;
        };
        let path = match turn {
            Turn::Balance => "/api/balance".to_owned(),
            Turn::Usage => format!(
                "/api/usage?range=30d&scope={}&group_by=model",
                if unit.starts_with("team:") {
                    "team"
                } else {
                    "self"
                }
            ),
        };
        let reply = tokio::select! {
            () = stop.cancelled() => return,
            reply = read(&client, &target.url, &path, secret) => reply,
        };
        // The usage read follows the balance's at once (the budget permitting); the next
        // pair comes an interval later. A 429 keeps the turn: it is read again after it.
        let limited = matches!(&reply, Ok(reply) if reply.status == StatusCode::TOO_MANY_REQUESTS);
        let this = turn;
        if !limited {
            (turn, due) = match turn {
                Turn::Balance => (Turn::Usage, now),
                Turn::Usage => (Turn::Balance, now + target.interval),
            };
        }
        // What both reads answer alike: the read limit, and a key that may not read.
        let what = match this {
            Turn::Balance => "balance",
            Turn::Usage => "usage",
        };
        match &reply {
            Ok(reply) if limited => {
                let after = reply
                    .retry_after
                    .map_or(DEFAULT_RETRY_AFTER, Duration::from_secs);
                tracing::info!(
                    unit,
                    retry_after = after.as_secs(),
                    what,
                    "Ollama Cloud limits balance and usage reads; backing off"
                );
                lock(&budget).back_off(now, after);
                continue;
            }
            Ok(reply)
                if matches!(
                    reply.status,
                    StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
                ) =>
            {
                // Another key of the account may still read it.
                key += 1;
                tracing::info!(unit, status = %reply.status, what, "a key may not read the account; trying the next");
                continue;
            }
            _ => {}
        }
        if this == Turn::Usage {
            match reply {
                Ok(reply) if reply.status.is_success() => match Spend::parse(&reply.body) {
                    Some(spend) => {
                        usage.observe_cloud(&names, spend.usd, spend.tokens, SystemTime::now());
                    }
                    None if !unknown_spend_logged => {
                        unknown_spend_logged = true;
                        tracing::warn!(
                            unit,
                            "Ollama Cloud answered /api/usage in a shape oqp does not know; ignored"
                        );
                    }
                    None => {}
                },
                Ok(reply) => tracing::debug!(unit, status = %reply.status, "usage read failed"),
                Err(error) => tracing::debug!(unit, %error, "usage read failed"),
            }
            continue;
        }
        match reply {
            Ok(reply) if reply.status.is_success() => match parse_balance(&reply.body) {
                Some(balance) => {
                    for (account, reserve_usd, reserve_percent) in &target.accounts {
                        let is_under = balance.under_reserve(*reserve_usd, *reserve_percent);
                        let was_under = under.contains(account);
                        if is_under && !was_under {
                            under.push(account.clone());
                            tracing::info!(unit, account = %account, "a cloud account is at or under its reserve");
                            hub.webhooks().notify(
                                Notice::new(WebhookEvent::CloudUnderReserve)
                                    .field("account", account.as_str())
                                    .field("plan", balance.plan())
                                    .field("reserve_usd", *reserve_usd)
                                    .field("reserve_percent", *reserve_percent),
                            );
                        } else if !is_under && was_under {
                            under.retain(|known| known != account);
                        }
                    }
                    hub.set_balance(unit, balance, SystemTime::now());
                }
                None if !unknown_logged => {
                    unknown_logged = true;
                    tracing::warn!(
                        unit,
                        "Ollama Cloud answered /api/balance in a shape oqp does not know; ignored"
                    );
                }
                None => {}
            },
            Ok(reply) => {
                tracing::debug!(unit, status = %reply.status, "balance read failed");
            }
            Err(error) => tracing::debug!(unit, %error, "balance read failed"),
        }
    }
}

async fn read(
    client: &Outbound,
    url: &str,
    path: &str,
    key: &Secret,
) -> Result<crate::outbound::Reply, String> {
    let mut request = Request::get(format!("{url}{path}"))
        .header(ACCEPT, "application/json")
        .header(USER_AGENT, concat!("oqp/", env!("CARGO_PKG_VERSION")))
        .body(Full::new(Bytes::new()))
        .map_err(|_| "invalid cloud URL".to_owned())?;
    let mut value = HeaderValue::from_str(&format!("Bearer {}", key.expose()))
        .map_err(|_| "the cloud key is not a valid header value".to_owned())?;
    value.set_sensitive(true);
    request.headers_mut().insert(AUTHORIZATION, value);
    client
        .send(request, READ_TIMEOUT, BODY_LIMIT)
        .await
        .map_err(|error| error.to_string())
}

fn lock(budget: &Mutex<ReadBudget>) -> std::sync::MutexGuard<'_, ReadBudget> {
    budget.lock().unwrap_or_else(PoisonError::into_inner)
}
