//! Ollama Cloud balances: the control plane reads `GET /api/balance` per ACCOUNT (keys of one
//! account share its balance; accounts of one `team` share one, read once), every
//! `cloud.balance_interval`, and puts what it read in the snapshot
//! (`Host.cloud_accounts`), where the data planes steer by it.
//!
//! The cloud allows 10 reads a minute per account across keys and devices; `budget` keeps
//! every reader within that (and waits out a 429's `Retry-After`), so that neither more keys
//! nor more data planes mean more reads: data planes never read balances themselves.
//!
//! [`run`] is one supervisor that follows the config: one task per reading unit (a team, or an
//! account), restarted when a reload changes how it reads, stopped when it leaves the config.
//! Budgets outlive their tasks, so a reload does not reset them.

mod budget;
mod parse;
mod spend;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::{ACCEPT, AUTHORIZATION, USER_AGENT};
use http::{HeaderValue, Request, StatusCode};
use http_body_util::Full;
use oqp_proto::policy::v1 as wire;
use sha2::Digest;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, HostConfig, HostKind, Secret, WebhookEvent};
use crate::hub::Hub;
use crate::outbound::Outbound;
use crate::usage::UsageStore;
use crate::webhooks::Notice;

pub use budget::{MINUTE, READS_PER_MINUTE, ReadBudget};
pub use parse::{Balance, WindowLeft};
pub use spend::Spend;

/// Largest `/api/balance` or `/api/usage` body read.
const BODY_LIMIT: usize = 64 * 1024;
/// Longest wait for one read.
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The wait after a 429 that carried no `Retry-After`.
const DEFAULT_RETRY_AFTER: Duration = MINUTE;

/// What the control plane last read of one unit's balance, and when.
#[derive(Debug, Clone, PartialEq)]
pub struct Read {
    /// The balance.
    pub balance: Balance,
    /// When it was first read as it is.
    pub at: SystemTime,
}

/// One reading unit: a team, or an account of no team.
#[derive(Clone, PartialEq)]
struct Target {
    /// `team:<team>`, `account:<label>` or `key:<hash>`.
    unit: String,
    /// The cloud host's base URL.
    url: String,
    /// The keys that may read it, in config order (the first that is not refused is used).
    keys: Vec<Secret>,
    interval: Duration,
    /// Its accounts with their reserves (USD, percent), for the under-reserve webhook.
    accounts: Vec<(String, f64, f64)>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("unit", &self.unit)
            .field("keys", &self.keys.len())
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

/// How the snapshot names the account of a key: its label, or `key:` and the first 16 hex
/// digits of the key's SHA-256 when it has none (the data plane computes the same).
pub fn account_id(key: &crate::config::CloudKey) -> String {
    if key.account.is_empty() {
        let digest = sha2::Sha256::digest(key.key.expose().as_bytes());
        format!("key:{}", hex::encode(&digest[..8]))
    } else {
        key.account.clone()
    }
}

/// The unit whose balance an account shares: its team's, else its own.
fn unit_of(config: &Config, account: &str) -> String {
    match config.cloud.account(account).team {
        Some(team) => format!("team:{team}"),
        None if account.starts_with("key:") => account.to_owned(),
        None => format!("account:{account}"),
    }
}

/// The accounts of a cloud host as the snapshot carries them, without balances (the hub adds
/// them with [`attach`]): one entry per account, in key order.
pub fn accounts_of(config: &Config, host: &HostConfig) -> Vec<wire::CloudAccount> {
    if host.kind != HostKind::Cloud {
        return Vec::new();
    }
    let mut out: Vec<wire::CloudAccount> = Vec::new();
    for key in &host.api_keys {
        let account = account_id(key);
        if out.iter().any(|known| known.account == account) {
            continue;
        }
        let settings = config.cloud.account(&account);
        out.push(wire::CloudAccount {
            account,
            team: settings.team.unwrap_or_default(),
            reserve_usd: settings.reserve_usd,
            reserve_percent: settings.reserve_percent,
            ..wire::CloudAccount::default()
        });
    }
    out
}

/// Fills each cloud account of `snapshot` with what was read of its unit.
pub fn attach(snapshot: &mut wire::PolicySnapshot, config: &Config, reads: &HashMap<String, Read>) {
    for host in &mut snapshot.hosts {
        for account in &mut host.cloud_accounts {
            if let Some(read) = reads.get(&unit_of(config, &account.account)) {
                fill(account, read);
            }
        }
    }
}

fn fill(account: &mut wire::CloudAccount, read: &Read) {
    let ms = |time: Option<SystemTime>| time.map_or(0, oqp_proto::unix_ms);
    account.plan = read.balance.plan().to_owned();
    account.read_at_unix_ms = oqp_proto::unix_ms(read.at);
    match &read.balance {
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
                left.map(|left| wire::CloudWindow {
                    remaining_percent: left.remaining_percent,
                    resets_at_unix_ms: ms(left.resets_at),
                })
            };
            account.session = window(session);
            account.weekly = window(weekly);
        }
    }
}

/// Every reading unit of `config`, in config order.
fn targets(config: &Config) -> Vec<Target> {
    let mut out: Vec<Target> = Vec::new();
    for host in config
        .ollama
        .hosts
        .iter()
        .filter(|host| host.kind == HostKind::Cloud)
    {
        for key in &host.api_keys {
            let account = account_id(key);
            let unit = unit_of(config, &account);
            let settings = config.cloud.account(&account);
            let reserve = (account, settings.reserve_usd, settings.reserve_percent);
            match out.iter_mut().find(|target| target.unit == unit) {
                Some(target) => {
                    if !target.keys.contains(&key.key) {
                        target.keys.push(key.key.clone());
                    }
                    if !target.accounts.iter().any(|known| known.0 == reserve.0) {
                        target.accounts.push(reserve);
                    }
                }
                None => out.push(Target {
                    unit,
                    url: host.url.clone(),
                    keys: vec![key.key.clone()],
                    interval: config.cloud.balance_interval,
                    accounts: vec![reserve],
                }),
            }
        }
    }
    out
}

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
            Ok(reply) if reply.status.is_success() => match Balance::parse(&reply.body) {
                Some(balance) => {
                    for (account, reserve_usd, reserve_percent) in &target.accounts {
                        let is_under = under_reserve(&balance, *reserve_usd, *reserve_percent);
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

/// Whether `balance` is at or under a reserve of `reserve_usd` or `reserve_percent` (of the
/// allowance on a credit plan, of each window on a window plan); nothing left is under a
/// reserve of 0. The data planes apply the same rule (`oqp_dataplane::cloud::Account`).
pub fn under_reserve(balance: &Balance, reserve_usd: f64, reserve_percent: f64) -> bool {
    match balance {
        Balance::Credits {
            included_usd,
            allowance_usd,
            extra_usd,
            ..
        } => {
            let floor = reserve_usd.max(allowance_usd.unwrap_or(0.0) * reserve_percent / 100.0);
            included_usd + extra_usd - floor <= 0.0
        }
        Balance::Windows { session, weekly } => [session, weekly]
            .into_iter()
            .flatten()
            .any(|window| window.remaining_percent - reserve_percent <= 0.0),
    }
}

/// The (host, account, model) refusals with a 402 in `after` that `before` (the same node's
/// previous report) did not have.
pub fn new_refusals(
    before: &wire::NodeReport,
    after: &wire::NodeReport,
) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for host in &after.hosts {
        let previous = before.hosts.iter().find(|old| old.name == host.name);
        for account in &host.cloud_accounts {
            let known: &[String] = previous
                .and_then(|old| {
                    old.cloud_accounts
                        .iter()
                        .find(|a| a.account == account.account)
                })
                .map_or(&[], |old| old.refused_models.as_slice());
            for refused in &account.refused_models {
                if let Some(model) = refused.strip_suffix(" (extra_usage)")
                    && !known.contains(refused)
                {
                    out.push((host.name.clone(), account.account.clone(), model.to_owned()));
                }
            }
        }
    }
    out
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
