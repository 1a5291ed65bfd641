//! Usage totals and budgets on the control plane.
//!
//! Each data plane's report carries a batch of usage increments; [`UsageStore::apply`]
//! adds each batch once (by node, epoch and sequence number) to the hour it arrives in and
//! writes that UTC day's file in `state_dir/usage/` ([`mod@file`]), before the report is
//! acknowledged, so that totals survive a restart of either plane. The store answers
//! `oqpctl usage` ([`UsageStore::query`]), today's figures for `oqpctl clients` and the
//! data planes' `/queue/status`, and what each client with a budget has used in its current
//! window: in each snapshot as the policy stream sends it ([`UsageStore::fill`]) and in each
//! report's ack ([`UsageStore::budgets`]). Reports come only from authenticated data
//! planes ([`crate::node_token`]), under a name only from the data plane whose watch holds
//! it, and each batch is bounded by what the slots of the node's allowance could have done
//! ([`bound`]: every name nobody configured shares one); an epoch ahead of this clock is
//! refused ([`ledger`]). A client that reaches a budget raises
//! `client.budget_exceeded` once per window ([`UsageStore::exceeded`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use oqp_proto::admin::v1 as api;
use oqp_proto::policy::v1 as wire;

use crate::config::WebhookEvent;
use crate::webhooks::Notice;

pub mod bound;
pub mod cloud;
pub mod file;
pub mod ledger;
pub mod log;

pub use ledger::{Applied, By, Holder, Ledger, Totals};

/// Most users of one app key whose budget figures an ack carries (the nearest their budget
/// first, by the fraction used of their nearest limit), besides every user at or over it;
/// each data plane keeps the last figure it was sent for the others.
pub const MAX_USER_BUDGETS: usize = 1_000;

/// Most clients the acks' `today` list carries (the busiest first).
pub const MAX_TODAY_CLIENTS: usize = 1_000;

/// The control plane's usage totals.
#[derive(Debug)]
pub struct UsageStore {
    state_dir: PathBuf,
    dir: PathBuf,
    inner: Mutex<Inner>,
    /// Whether the missing state directory was reported.
    warned: AtomicBool,
}

#[derive(Debug, Default)]
struct Inner {
    ledger: Ledger,
    /// What each node may still report (in memory: a restart starts each node afresh).
    bounds: bound::Bounds,
    /// A batch applied in memory whose day file could not be written: no batch is
    /// acknowledged until a write succeeds (the data plane resends meanwhile).
    unsaved: bool,
    /// When each node's last refusal was logged at warn.
    refusals: Refusals,
    /// The day's append log.
    log: log::Log,
    /// The first day (Unix days) whose users are still kept per hour: the days before it
    /// keep them per day ([`Ledger::collapse_day`]).
    hourly_from: i64,
    /// Tokens cloud accounts served each client, and the accounts' observed prices.
    cloud: cloud::CloudTokens,
}

/// A data plane that sends a batch, as the policy service knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reporter {
    /// The name it reports under.
    pub node: String,
    /// The allowance it draws on ([`bound::allowance`]): its own, or the one every name
    /// nobody configured shares.
    pub allowance: String,
    /// The slots of that allowance.
    pub slots: u64,
    /// Whose batches are taken under `node` ([`crate::hub::Hub::holder`]).
    pub holder: Holder,
}

/// What became of a batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Receipt {
    /// The batch's number when it is kept (the ack's `usage_seq`); 0 otherwise.
    pub seq: u64,
    /// Why it was refused for good, when it was.
    pub refused: Option<String>,
}

/// Refusals are logged at warn once a minute per node (a refused data plane backs off,
/// an older one may not), else at debug.
#[derive(Debug, Default)]
struct Refusals {
    last: std::collections::HashMap<String, i64>,
}

impl Refusals {
    /// Most nodes remembered; past it the list starts again (only authenticated reporters
    /// reach it).
    const MAX: usize = 1_024;

    fn due(&mut self, node: &str, now: i64) -> bool {
        if self.last.get(node).is_some_and(|at| now - *at < 60) {
            return false;
        }
        if self.last.len() >= Self::MAX {
            self.last.clear();
        }
        self.last.insert(node.to_owned(), now);
        true
    }
}

impl UsageStore {
    /// The totals kept in `state_dir` (none yet if it has no `usage/`), at `now`.
    pub fn load(state_dir: &Path, now: SystemTime) -> Result<Arc<Self>, String> {
        let dir = file::dir(state_dir);
        let (ledger, log) = file::load_with_log(&dir, unix_s(now))?;
        let cloud = cloud::CloudTokens::load(state_dir)?;
        Ok(Arc::new(Self {
            state_dir: state_dir.to_path_buf(),
            dir,
            inner: Mutex::new(Inner {
                ledger,
                bounds: bound::Bounds::default(),
                unsaved: false,
                refusals: Refusals::default(),
                log,
                hourly_from: unix_s(now).div_euclid(86_400) - 1,
                cloud,
            }),
            warned: AtomicBool::new(false),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Applies `node`'s batch at `at` as [`UsageStore::apply_from`] does, from a data plane
    /// with its own allowance, holding its name with no epoch presented; the batch's
    /// number when it is kept, else 0.
    pub fn apply(
        &self,
        node: &str,
        batch: Option<&wire::UsageBatch>,
        slots: u64,
        at: SystemTime,
    ) -> u64 {
        let reporter = Reporter {
            node: node.to_owned(),
            allowance: node.to_owned(),
            slots,
            holder: Holder::Any,
        };
        self.apply_from(&reporter, batch, at).seq
    }

    /// Applies `reporter`'s batch at `at`, bounded by what the slots of its allowance could
    /// have done ([`bound`]), and writes the day it changed, when the state directory
    /// exists (as for `state_dir/version`; blocking file I/O: call it off the async
    /// workers). The receipt names the batch when it is applied (now or before) and kept,
    /// for the ack; 0 when there was none, when it was refused (with why: not the name's
    /// holder, an earlier epoch, one ahead of this clock) or when the day file could not
    /// be written (the batch is kept in memory, counted once, and acknowledged when it is
    /// resent after a write succeeds).
    pub fn apply_from(
        &self,
        reporter: &Reporter,
        batch: Option<&wire::UsageBatch>,
        at: SystemTime,
    ) -> Receipt {
        self.apply_report(reporter, batch, &[], at)
    }

    /// [`UsageStore::apply_from`] with the tokens cloud accounts served in the batch (the
    /// report's `usage_cloud`), added with it, once ([`cloud`]).
    pub fn apply_report(
        &self,
        reporter: &Reporter,
        batch: Option<&wire::UsageBatch>,
        cloud_rows: &[wire::CloudTokens],
        at: SystemTime,
    ) -> Receipt {
        let Some(batch) = batch.filter(|batch| batch.seq != 0) else {
            return Receipt::default();
        };
        let node = reporter.node.as_str();
        let now = unix_s(at);
        let mut inner = self.lock();
        let applied = inner.ledger.check(node, batch, now, reporter.holder);
        let refused = match applied {
            Applied::Stale => Some(
                "a usage batch from an earlier run of this data plane (or a second data plane \
                 under its name) was refused",
            ),
            Applied::Ahead => Some(
                "a usage batch whose data plane claims to start after this clock's now was \
                 refused (it is taken once this clock has passed that start; check the clocks \
                 of both boxes)",
            ),
            Applied::NotHolder => Some(
                "a usage batch was refused: it is not from the data plane holding this node's \
                 name (another one watches under it, or none does)",
            ),
            Applied::Now | Applied::Already => None,
        };
        if let Some(reason) = refused {
            if inner.refusals.due(node, now) {
                tracing::warn!(node, epoch = batch.epoch, "{reason}");
            } else {
                tracing::debug!(node, epoch = batch.epoch, "{reason}");
            }
            return Receipt {
                seq: 0,
                refused: Some(reason.to_owned()),
            };
        }
        let mut line = None;
        if applied == Applied::Now {
            let mut bounded = batch.clone();
            let slots = reporter.slots;
            if let Some(cut) =
                inner
                    .bounds
                    .bound(&reporter.allowance, slots, &mut bounded, unix_ms(at))
            {
                tracing::warn!(
                    node,
                    allowance = %reporter.allowance,
                    slots,
                    claimed_slot_seconds = cut.claimed as f64 / 1e9,
                    allowed_slot_seconds = cut.allowed as f64 / 1e9,
                    "a usage batch claimed more than the slots it may use could have done; its \
                     GPU time and tokens were cut to fit"
                );
            }
            for app in inner.ledger.add(node, &bounded, now) {
                tracing::warn!(
                    app,
                    cap = ledger::MAX_USERS_PER_APP_HOUR,
                    "an app has more distinct users this hour than are kept apart; the \
                     others' usage is summed under '{app}/{}' until the hour ends (the app's \
                     budget counts it, their own per-user budgets only on each data plane)",
                    ledger::OTHER
                );
            }
            line = Some(log::Line::of(node, &bounded, now));
            // No client's cloud tokens beyond the tokens its bounded rows kept.
            let mut left: HashMap<&str, u64> = HashMap::new();
            for row in &bounded.rows {
                let tokens = left.entry(row.client_id.as_str()).or_default();
                *tokens = tokens
                    .saturating_add(row.prompt_tokens)
                    .saturating_add(row.completion_tokens);
            }
            let kept: Vec<wire::CloudTokens> = cloud_rows
                .iter()
                .map(|row| {
                    let left = left.entry(row.client_id.as_str()).or_default();
                    let tokens = row.tokens.min(*left);
                    *left -= tokens;
                    wire::CloudTokens {
                        tokens,
                        ..row.clone()
                    }
                })
                .collect();
            inner.cloud.add(&kept, now);
        }
        if applied == Applied::Now || inner.unsaved {
            let dropped = inner.ledger.prune(now);
            let collapsed = self.collapse(&mut inner, now);
            let saved = self.save(&mut inner, now, &dropped, line.as_ref());
            self.save_collapsed(&inner, &collapsed);
            inner.unsaved = !saved;
            // After the day file: a crash between the two loses this batch's cloud tokens
            // (its spend is under-attributed), never counts them twice.
            if saved
                && self.dir_exists()
                && let Err(error) = inner.cloud.save(&self.state_dir)
            {
                tracing::warn!(%error, "cloud tokens not saved; they are kept in memory");
            }
        }
        if inner.unsaved {
            return Receipt::default();
        }
        Receipt {
            seq: batch.seq,
            refused: None,
        }
    }

    /// Keeps the users of each day before yesterday at `now` per day (once per day:
    /// [`Ledger::collapse_day`]); the days changed.
    fn collapse(&self, inner: &mut Inner, now: i64) -> Vec<i64> {
        let yesterday = now.div_euclid(86_400) - 1;
        let days = inner.ledger.days_between(inner.hourly_from, yesterday);
        inner.hourly_from = inner.hourly_from.max(yesterday);
        let mut changed = Vec::new();
        for day in days {
            let (moved, folded) = inner.ledger.collapse_day(day);
            for app in folded {
                tracing::warn!(
                    app,
                    day = %log::day_name(day),
                    cap = ledger::MAX_USERS_PER_APP_DAY,
                    "an app had more distinct users that day than a past day keeps apart; the \
                     least busy are summed under '{app}/{}'",
                    ledger::OTHER
                );
            }
            if moved {
                changed.push(day);
            }
        }
        changed
    }

    /// Writes the files of the past `days` whose users are now kept per day; one that
    /// cannot be written keeps its hourly rows on disk (the same figures; a restart keeps
    /// them per day again).
    fn save_collapsed(&self, inner: &Inner, days: &[i64]) {
        if days.is_empty() || !self.dir_exists() {
            return;
        }
        for day in days {
            if let Err(error) = file::write_collapsed(&self.dir, &inner.ledger, *day) {
                tracing::warn!(
                    dir = %self.dir.display(),
                    day = %log::day_name(*day),
                    %error,
                    "a past day's usage file could not be rewritten with its users kept per day"
                );
            }
        }
    }

    /// Saves the batch `line` applied at `now` (and removes the days `dropped`), when the
    /// state directory exists: appended to the day's log, or, with the day's log past
    /// [`log::COMPACT_BYTES`], on a new day, after a failed write or with no line (a batch
    /// kept in memory only), the day file written whole and a new log begun; `false` when
    /// the write failed.
    fn save(&self, inner: &mut Inner, now: i64, dropped: &[i64], line: Option<&log::Line>) -> bool {
        if !self.dir_exists() {
            return true;
        }
        file::remove_days(&self.dir, dropped);
        let today = now.div_euclid(86_400);
        let append = line.filter(|_| {
            !inner.unsaved && inner.log.day == today && inner.log.bytes < log::COMPACT_BYTES
        });
        let written = match append {
            Some(line) => log::append(&self.dir, &inner.log, line).map(|bytes| {
                inner.log.bytes = bytes;
            }),
            None => {
                let generation = if inner.log.day == today {
                    inner.log.generation + 1
                } else {
                    1
                };
                file::write_day_at(&self.dir, &inner.ledger, today, generation).map(|()| {
                    file::remove_logs_below(&self.dir, today, generation);
                    inner.log = log::Log {
                        day: today,
                        generation,
                        bytes: 0,
                    };
                })
            }
        };
        match written {
            Ok(()) => true,
            Err(error) => {
                // The totals stay in memory and the next report writes the day again.
                tracing::warn!(
                    dir = %self.dir.display(),
                    %error,
                    "usage totals not saved; the batch is not acknowledged"
                );
                false
            }
        }
    }

    /// Whether the state directory exists (warned once when it does not).
    fn dir_exists(&self) -> bool {
        if self.state_dir.is_dir() {
            return true;
        }
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                state_dir = %self.state_dir.display(),
                "the state directory does not exist: usage totals are kept in memory \
                 only (create it to keep them across restarts)"
            );
        }
        false
    }

    /// Sets the observed price of the cloud `accounts` of one reading unit from its
    /// `/api/usage` read at `now`: `usd` over the last 30 days, and the cloud's own token
    /// count when it stated one ([`cloud`]).
    pub fn observe_cloud(
        &self,
        accounts: &[String],
        usd: f64,
        cloud_tokens: Option<u64>,
        now: SystemTime,
    ) {
        self.lock()
            .cloud
            .observe(accounts, usd, cloud_tokens, unix_s(now));
    }

    /// Forgets the observed prices of cloud accounts not in `keep`.
    pub fn retain_cloud_prices(&self, keep: &[String]) {
        self.lock().cloud.retain_prices(keep);
    }

    /// What `client` has used of `budget` in its window at `now`.
    pub fn used(&self, client: &str, budget: &wire::Budget, now: SystemTime) -> wire::BudgetUsed {
        let start = budget.window_start(unix_s(now));
        let inner = self.lock();
        let totals = inner.ledger.client_since(client, start);
        wire::BudgetUsed {
            usd: inner.cloud.client_spend_since(client, true, start),
            ..used(client, start, &totals, now)
        }
    }

    /// What each client of `clients` that has a budget used in its window at `now`, and
    /// each user of an app key whose users have one.
    pub fn budgets(&self, clients: &[wire::Client], now: SystemTime) -> Vec<wire::BudgetUsed> {
        let seconds = unix_s(now);
        let inner = self.lock();
        let mut budgets: Vec<wire::BudgetUsed> = clients
            .iter()
            .filter_map(|client| {
                let budget = client.budget.as_ref()?;
                let start = budget.window_start(seconds);
                let totals = inner.ledger.client_since(&client.client_id, start);
                Some(wire::BudgetUsed {
                    usd: inner
                        .cloud
                        .client_spend_since(&client.client_id, true, start),
                    ..used(&client.client_id, start, &totals, now)
                })
            })
            .collect();
        for client in clients {
            let Some(budget) = client
                .users
                .as_ref()
                .and_then(|users| users.budget.as_ref())
            else {
                continue;
            };
            let start = budget.window_start(seconds);
            // The users nearest their budget first (the fraction used of whichever of its
            // limits is nearest), so that a bound on the list keeps them; every user at or
            // over it is sent, whatever the bound (up to the users an app keeps apart).
            let mut ranked: Vec<(f64, &str, Totals)> = inner
                .ledger
                .users_since(&client.client_id, start)
                .into_iter()
                .map(|(user, totals)| (fraction_used(budget, &totals), user, totals))
                .collect();
            let over = ranked.iter().filter(|(used, ..)| *used >= 1.0).count();
            let kept = over.clamp(MAX_USER_BUDGETS, ledger::MAX_USERS_PER_APP_HOUR);
            let nearest_first = |a: &(f64, &str, Totals), b: &(f64, &str, Totals)| {
                b.0.total_cmp(&a.0).then_with(|| a.1.cmp(b.1))
            };
            if ranked.len() > kept {
                ranked.select_nth_unstable_by(kept, nearest_first);
                ranked.truncate(kept);
            }
            ranked.sort_by(nearest_first);
            budgets.extend(ranked.iter().map(|(_, user, totals)| wire::BudgetUsed {
                usd: inner.cloud.client_spend_since(user, false, start),
                ..used(user, start, totals, now)
            }));
        }
        budgets
    }

    /// Puts what each budgeted client has used into `snapshot`, as of `now`.
    pub fn fill(&self, snapshot: &mut wire::PolicySnapshot, now: SystemTime) {
        let seconds = unix_s(now);
        let inner = self.lock();
        for client in &mut snapshot.clients {
            let id = client.client_id.clone();
            if let Some(budget) = client.budget.as_mut() {
                let start = budget.window_start(seconds);
                let totals = inner.ledger.client_since(&id, start);
                budget.used = Some(wire::BudgetUsed {
                    usd: inner.cloud.client_spend_since(&id, true, start),
                    ..used(&id, start, &totals, now)
                });
            }
        }
    }

    /// Each client's usage today (UTC), the busiest [`MAX_TODAY_CLIENTS`] first.
    pub fn today(&self, now: SystemTime) -> Vec<wire::UsageRow> {
        let start = unix_s(now).div_euclid(86_400) * 86_400;
        let inner = self.lock();
        let mut clients: Vec<(&str, Totals)> =
            inner.ledger.clients_since(start).into_iter().collect();
        let busiest_first = |a: &(&str, Totals), b: &(&str, Totals)| {
            b.1.gpu_ns.cmp(&a.1.gpu_ns).then_with(|| a.0.cmp(b.0))
        };
        if clients.len() > MAX_TODAY_CLIENTS {
            clients.select_nth_unstable_by(MAX_TODAY_CLIENTS, busiest_first);
            clients.truncate(MAX_TODAY_CLIENTS);
        }
        clients.sort_by(busiest_first);
        clients
            .into_iter()
            .map(|(client, totals)| row(client, "", &totals))
            .collect()
    }

    /// The totals of the last `since_seconds` (whole hours, 0 = 24 h) at `now`, grouped.
    pub fn query(&self, request: &api::GetUsageRequest, now: SystemTime) -> api::GetUsageResponse {
        self.query_for(request, None, now)
    }

    /// [`UsageStore::query`] over the rows of client `only` (and its users,
    /// `<client_id>/<user>`) when given.
    pub fn query_for(
        &self,
        request: &api::GetUsageRequest,
        only: Option<&str>,
        now: SystemTime,
    ) -> api::GetUsageResponse {
        let since = if request.since_seconds == 0 {
            86_400
        } else {
            request.since_seconds
        };
        let seconds = unix_s(now);
        let start =
            (seconds - i64::try_from(since).unwrap_or(i64::MAX / 2)).div_euclid(3600) * 3600;
        let by = By {
            client: request.by_client,
            model: request.by_model,
        };
        let inner = self.lock();
        let rows = inner.ledger.query_for(start, by, only);
        let mut total = Totals::default();
        for group in &rows {
            total.add(&group.totals);
        }
        let spend: HashMap<String, f64> = inner
            .cloud
            .spend_since(start)
            .into_iter()
            .filter(|(client, _)| {
                only.is_none_or(|only| {
                    client == only
                        || client
                            .strip_prefix(only)
                            .is_some_and(|rest| rest.starts_with('/'))
                })
            })
            .collect();
        drop(inner);
        let cloud_of = |client: &str| {
            (by.client && !by.model)
                .then(|| spend.get(client).copied())
                .flatten()
        };
        let total_cloud = (!spend.is_empty()).then(|| spend.values().sum::<f64>());
        api::GetUsageResponse {
            rows: rows
                .iter()
                .map(|group| api::UsageTotals {
                    cloud_usd: cloud_of(&group.client),
                    ..totals(&group.client, &group.model, &group.totals)
                })
                .collect(),
            total: Some(api::UsageTotals {
                cloud_usd: total_cloud,
                ..totals("", "", &total)
            }),
            since_unix_s: start,
        }
    }

    /// The `client.budget_exceeded` notices due at `now`: each client of `clients` at or
    /// over a budget, once per window (kept in the day file, so also across restarts;
    /// blocking file I/O when there is one).
    pub fn exceeded(&self, clients: &[wire::Client], now: SystemTime) -> Vec<Notice> {
        let seconds = unix_s(now);
        let mut inner = self.lock();
        // Every budget in force: the clients' own (an app's counting its users), and each
        // user's of an app key whose users have one.
        let mut budgeted: Vec<(String, &wire::Budget, i64, Totals)> = Vec::new();
        for client in clients {
            if let Some(budget) = client.budget.as_ref() {
                let start = budget.window_start(seconds);
                let used = inner.ledger.client_since(&client.client_id, start);
                budgeted.push((client.client_id.clone(), budget, start, used));
            }
            if let Some(budget) = client
                .users
                .as_ref()
                .and_then(|users| users.budget.as_ref())
            {
                // Only the users at or over it can be due (and an announced one stays over
                // for the rest of its window, so its announcement is kept below).
                let start = budget.window_start(seconds);
                for (user, used) in inner.ledger.users_since(&client.client_id, start) {
                    if fraction_used(budget, &used) >= 1.0 {
                        budgeted.push((user.to_owned(), budget, start, used));
                    }
                }
            }
        }
        // Users announced per (app, window): at most MAX_USERS_PER_APP_HOUR each, so that
        // the list kept (and saved) is bounded like the ledger's users.
        let mut per_app: HashMap<(String, i64), usize> = HashMap::new();
        for (client, start) in &inner.ledger.announced {
            if let Some((app, _)) = client.split_once('/') {
                *per_app.entry((app.to_owned(), *start)).or_default() += 1;
            }
        }
        let mut notices = Vec::new();
        for (client_id, budget, start, used) in &budgeted {
            if inner
                .ledger
                .announced
                .contains(&(client_id.clone(), *start))
            {
                continue;
            }
            let app_window = client_id
                .split_once('/')
                .map(|(app, _)| (app.to_owned(), *start));
            if app_window.as_ref().is_some_and(|key| {
                per_app.get(key).copied().unwrap_or(0) >= ledger::MAX_USERS_PER_APP_HOUR
            }) {
                continue;
            }
            let over = if budget.gpu_ns > 0 && used.gpu_ns >= budget.gpu_ns {
                Some((
                    "gpu_seconds",
                    budget.gpu_ns as f64 / 1e9,
                    used.gpu_ns as f64 / 1e9,
                ))
            } else if budget.tokens > 0 && used.tokens() >= budget.tokens {
                Some(("tokens", budget.tokens as f64, used.tokens() as f64))
            } else {
                None
            };
            let Some((kind, limit, spent)) = over else {
                continue;
            };
            if let Some(key) = app_window {
                *per_app.entry(key).or_default() += 1;
            }
            inner.ledger.announced.insert((client_id.clone(), *start));
            let resets = start.saturating_add(i64::try_from(budget.window_seconds).unwrap_or(0));
            let reset_at = UNIX_EPOCH + std::time::Duration::from_secs(resets.unsigned_abs());
            notices.push(
                Notice::new(WebhookEvent::ClientBudgetExceeded)
                    .at(now)
                    .field("client_id", client_id.as_str())
                    .field(
                        "budget",
                        serde_json::json!({ kind: limit, "window": budget.window }),
                    )
                    .field("used", serde_json::json!({ kind: spent }))
                    .field(
                        "resets_at",
                        humantime::format_rfc3339_seconds(reset_at).to_string(),
                    ),
            );
        }
        // Windows that ended are forgotten.
        let before = inner.ledger.announced.len();
        inner.ledger.announced.retain(|(client, start)| {
            budgeted
                .iter()
                .any(|(known, _, known_start, _)| known == client && known_start == start)
        });
        if (!notices.is_empty() || inner.ledger.announced.len() != before)
            && self.dir_exists()
            && let Err(error) = file::write_state(&self.dir, &inner.ledger)
        {
            tracing::warn!(dir = %self.dir.display(), %error, "budgets announced not saved");
        }
        notices
    }
}

/// How much of `budget` `totals` used: the largest fraction over its limits (GPU time,
/// tokens); 1.0 and above is at or over the budget.
pub fn fraction_used(budget: &wire::Budget, totals: &Totals) -> f64 {
    let of = |used: u64, limit: u64| {
        if limit == 0 {
            0.0
        } else {
            used as f64 / limit as f64
        }
    };
    of(totals.gpu_ns, budget.gpu_ns).max(of(totals.tokens(), budget.tokens))
}

fn used(client: &str, start: i64, totals: &Totals, now: SystemTime) -> wire::BudgetUsed {
    wire::BudgetUsed {
        client_id: client.to_owned(),
        window_start_unix_s: start,
        gpu_ns: totals.gpu_ns,
        tokens: totals.tokens(),
        usd: 0.0,
        as_of_unix_ms: now.duration_since(UNIX_EPOCH).map_or(0, |since| {
            i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
        }),
    }
}

fn row(client: &str, model: &str, totals: &Totals) -> wire::UsageRow {
    wire::UsageRow {
        client_id: client.to_owned(),
        model: model.to_owned(),
        gpu_ns: totals.gpu_ns,
        prompt_tokens: totals.prompt_tokens,
        completion_tokens: totals.completion_tokens,
        requests: totals.requests,
        embedding_inputs: totals.embedding_inputs,
        cached_inputs: totals.cached_inputs,
        cached_tokens: totals.cached_tokens,
    }
}

fn totals(client: &str, model: &str, totals: &Totals) -> api::UsageTotals {
    api::UsageTotals {
        client_id: client.to_owned(),
        model: model.to_owned(),
        gpu_ns: totals.gpu_ns,
        prompt_tokens: totals.prompt_tokens,
        completion_tokens: totals.completion_tokens,
        requests: totals.requests,
        embedding_inputs: totals.embedding_inputs,
        cached_inputs: totals.cached_inputs,
        cached_tokens: totals.cached_tokens,
        cloud_usd: None,
    }
}

/// Unix milliseconds of `at`.
fn unix_ms(at: SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |since| {
        i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
    })
}

/// Unix seconds of `at`.
pub fn unix_s(at: SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |since| {
        i64::try_from(since.as_secs()).unwrap_or(i64::MAX)
    })
}

#[cfg(test)]
mod tests;
