//! The usage totals: per UTC hour, client and model, the last [`KEEP_DAYS`] days. Pure: the
//! time is passed in. Days are groups of hours; budget windows and `--since` periods are
//! sums of whole hours.
//!
//! An app's users (`<app>/<user>`) are kept per hour today and yesterday only: an earlier
//! day's users are kept per day ([`Ledger::collapse_day`]), under the day's last hour, at
//! most [`MAX_USERS_PER_APP_DAY`] per app (the busiest), the rest summed under
//! `<app>/(other)`. The apps' own hourly totals, and every other client's rows, stay hourly.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use oqp_proto::policy::v1 as wire;
use serde::{Deserialize, Serialize};

/// Days of totals kept.
pub const KEEP_DAYS: i64 = 90;

/// Most client/model rows one hour holds; past it a new row's model is summed under
/// [`OTHER`], its client kept (a budget counts a client's usage whatever the model). The
/// data planes bound the clients (configured, or a bounded few named by callers with
/// auth off) and the models (hosted, else [`OTHER`]).
pub const MAX_ROWS_PER_HOUR: usize = 10_000;

/// The model of rows past [`MAX_ROWS_PER_HOUR`], and of a model name too long to keep.
pub const OTHER: &str = "(other)";

/// The longest model name kept (bytes, as the data planes' labels); longer ones are
/// [`OTHER`].
pub const MAX_MODEL_BYTES: usize = 256;

/// What requests used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Totals {
    /// GPU time, nanoseconds.
    #[serde(default)]
    pub gpu_ns: u64,
    /// Prompt tokens.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Completion tokens.
    #[serde(default)]
    pub completion_tokens: u64,
    /// Requests.
    #[serde(default)]
    pub requests: u64,
    /// Embedding inputs sent upstream.
    #[serde(default)]
    pub embedding_inputs: u64,
    /// Embedding inputs answered from the cache.
    #[serde(default)]
    pub cached_inputs: u64,
    /// Prompt tokens estimated cached where the requests ran; absent when none had an
    /// estimate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
}

impl Totals {
    /// Adds `other`.
    pub fn add(&mut self, other: &Totals) {
        self.gpu_ns = self.gpu_ns.saturating_add(other.gpu_ns);
        self.prompt_tokens = self.prompt_tokens.saturating_add(other.prompt_tokens);
        self.completion_tokens = self
            .completion_tokens
            .saturating_add(other.completion_tokens);
        self.requests = self.requests.saturating_add(other.requests);
        self.embedding_inputs = self.embedding_inputs.saturating_add(other.embedding_inputs);
        self.cached_inputs = self.cached_inputs.saturating_add(other.cached_inputs);
        self.cached_tokens =
            oqp_dataplane::usage::add_known(self.cached_tokens, other.cached_tokens);
    }

    /// Prompt + completion tokens.
    pub fn tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }

    /// From a data plane's row.
    pub fn from_row(row: &wire::UsageRow) -> Self {
        Self {
            gpu_ns: row.gpu_ns,
            prompt_tokens: row.prompt_tokens,
            completion_tokens: row.completion_tokens,
            requests: row.requests,
            embedding_inputs: row.embedding_inputs,
            cached_inputs: row.cached_inputs,
            cached_tokens: row.cached_tokens,
        }
    }
}

/// Most distinct users of one app one hour keeps; past it a new user's usage is summed
/// under `<app>/(other)` ([`OTHER`]) and the first such fold of the hour is logged. Its
/// app's totals, and so the app's budget, still count it; its own per-user budget is then
/// held only by the data planes' own figures.
pub const MAX_USERS_PER_APP_HOUR: usize = 10_000;

/// Most distinct users of one app a day before yesterday keeps ([`Ledger::collapse_day`]):
/// the busiest (GPU time, then tokens); the others are summed under `<app>/(other)`.
pub const MAX_USERS_PER_APP_DAY: usize = MAX_USERS_PER_APP_HOUR;

/// One hour's totals.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Hour {
    /// Per (client, model).
    pub rows: HashMap<(String, String), Totals>,
    /// Per client, all models.
    pub clients: HashMap<String, Totals>,
    /// Per app (a client id's part before `/`): itself and its users together, and which
    /// of its users this hour has, so that an app's figures are read without scanning
    /// every client.
    pub apps: HashMap<String, App>,
}

/// One app's hour.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct App {
    /// The app and its users together.
    pub total: Totals,
    /// Its users this hour (sub-client ids, `<app>/<user>`), at most
    /// [`MAX_USERS_PER_APP_HOUR`] and `<app>/(other)`.
    pub users: HashSet<String>,
}

/// What [`Hour::add`] did with a client's usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Added {
    /// Kept under its own client id.
    Kept,
    /// A user past [`MAX_USERS_PER_APP_HOUR`], folded into `<app>/(other)`; `first` when it
    /// is the hour's first fold for this app.
    Folded {
        /// The first fold of this app in this hour.
        first: bool,
    },
}

impl Hour {
    /// Adds `totals` for `client` and `model`.
    pub fn add(&mut self, client: &str, model: &str, totals: &Totals) -> Added {
        let model = if model.len() > MAX_MODEL_BYTES {
            OTHER
        } else {
            model
        };
        let app_id = client.split_once('/').map_or(client, |(app, _)| app);
        let app = self.apps.entry(app_id.to_owned()).or_default();
        app.total.add(totals);
        let mut added = Added::Kept;
        let folded;
        let client = if client.len() == app_id.len() || app.users.contains(client) {
            client
        } else if app.users.len() < MAX_USERS_PER_APP_HOUR {
            app.users.insert(client.to_owned());
            client
        } else {
            folded = format!("{app_id}/{OTHER}");
            added = Added::Folded {
                first: app.users.insert(folded.clone()),
            };
            folded.as_str()
        };
        let key = (client.to_owned(), model.to_owned());
        let key = if self.rows.contains_key(&key) || self.rows.len() < MAX_ROWS_PER_HOUR {
            key
        } else {
            (client.to_owned(), OTHER.to_owned())
        };
        self.clients.entry(key.0.clone()).or_default().add(totals);
        self.rows.entry(key).or_default().add(totals);
        added
    }
}

/// How `query` groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct By {
    /// One group per client.
    pub client: bool,
    /// One group per model.
    pub model: bool,
}

/// One group of a query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// The client; empty when not grouped by client.
    pub client: String,
    /// The model; empty when not grouped by model.
    pub model: String,
    /// The sums.
    pub totals: Totals,
}

/// Every hour's totals, and the last batch applied from each data plane.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ledger {
    /// Hour number (Unix seconds / 3600) → totals.
    pub hours: BTreeMap<i64, Hour>,
    /// Node → (epoch, seq) of the last batch applied.
    pub applied: BTreeMap<String, (u64, u64)>,
    /// (client, window start) of the budgets announced as exceeded.
    pub announced: BTreeSet<(String, i64)>,
}

/// What [`Ledger::apply`] did with a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Added to the totals now.
    Now,
    /// Added before (a resend), or no batch (seq 0): nothing to add.
    Already,
    /// From an epoch below the last one applied for its node, under a name whose holder
    /// presented no epoch (an older data plane): an earlier run of that data plane, or
    /// another one under its name. Refused, never added.
    Stale,
    /// From an epoch ahead of the control plane's clock: a data plane cannot have started
    /// in the future. Refused, never added, not kept (a data plane whose clock is ahead has
    /// its batches taken once this clock has passed its start).
    Ahead,
    /// Not from the data plane holding the node's name: no watch is open under it, or
    /// the one holding it presented another epoch. Refused, never added, not kept.
    NotHolder,
}

/// Which batches under a node's name are taken: the holder's, the data plane whose watch
/// under that name opened first and is still open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// No watch is open under the name: no batch is taken.
    Nobody,
    /// The holder presented this usage epoch: only its batches are taken.
    Epoch(u64),
    /// The holder presented no epoch (an older data plane): any, as before epochs were
    /// presented (an epoch below the last applied is [`Applied::Stale`]).
    Any,
}

/// Whether `epoch` (Unix ms) is ahead of `now` (Unix seconds): a start after this second.
pub fn epoch_ahead(epoch: u64, now: i64) -> bool {
    i64::try_from(epoch / 1000).map_or(true, |seconds| seconds > now)
}

impl Ledger {
    /// Applies a data plane's batch at `now` (Unix seconds) unless it was applied already
    /// (the same epoch and a seq not above the last) or comes from an epoch below the
    /// node's last (epochs are the data planes' start times, in ms: they only grow), as
    /// from a holder that presented no epoch ([`Holder::Any`]).
    pub fn apply(&mut self, node: &str, batch: &wire::UsageBatch, now: i64) -> Applied {
        let check = self.check(node, batch, now, Holder::Any);
        if check == Applied::Now {
            self.add(node, batch, now);
        }
        check
    }

    /// What [`Ledger::apply`] would do with `batch` from `holder`'s name `node` at `now`,
    /// changing nothing. A batch of the holder's own epoch is that data plane's whatever
    /// the last epoch applied under the name (a data plane that took the name over, or
    /// a clock set back). A node's last epoch that is itself ahead (kept before such
    /// epochs were refused) counts as none, so that the node's real batches are taken
    /// again.
    pub fn check(&self, node: &str, batch: &wire::UsageBatch, now: i64, holder: Holder) -> Applied {
        if batch.seq == 0 {
            return Applied::Already;
        }
        if epoch_ahead(batch.epoch, now) {
            return Applied::Ahead;
        }
        match holder {
            Holder::Nobody => return Applied::NotHolder,
            Holder::Epoch(epoch) if epoch != batch.epoch => return Applied::NotHolder,
            Holder::Epoch(_) | Holder::Any => {}
        }
        if let Some((epoch, seq)) = self
            .applied
            .get(node)
            .filter(|(epoch, _)| !epoch_ahead(*epoch, now))
        {
            if *epoch == batch.epoch && *seq >= batch.seq {
                return Applied::Already;
            }
            if batch.epoch < *epoch && holder == Holder::Any {
                return Applied::Stale;
            }
        }
        Applied::Now
    }

    /// Adds `batch` to the hour of `now` and records it as `node`'s last, unchecked (see
    /// [`Ledger::check`]).
    /// Returns the apps whose users were first folded into `<app>/(other)` this hour.
    pub fn add(&mut self, node: &str, batch: &wire::UsageBatch, now: i64) -> Vec<String> {
        let hour = self.hours.entry(now.div_euclid(3600)).or_default();
        let mut folded = Vec::new();
        for row in &batch.rows {
            let added = hour.add(&row.client_id, &row.model, &Totals::from_row(row));
            if added == (Added::Folded { first: true }) {
                let app = row.client_id.split_once('/').map_or("", |(app, _)| app);
                folded.push(app.to_owned());
            }
        }
        self.applied
            .insert(node.to_owned(), (batch.epoch, batch.seq));
        folded
    }

    /// Forgets hours before the first day kept at `now`; the days (Unix days) dropped.
    pub fn prune(&mut self, now: i64) -> Vec<i64> {
        let first_hour = (now.div_euclid(86_400) - KEEP_DAYS + 1) * 24;
        let kept = self.hours.split_off(&first_hour);
        let dropped = std::mem::replace(&mut self.hours, kept);
        let mut days: Vec<i64> = dropped.keys().map(|hour| hour.div_euclid(24)).collect();
        days.dedup();
        days
    }

    /// The days (Unix days) from `from` up to (not including) `before` that have hours.
    pub fn days_between(&self, from: i64, before: i64) -> Vec<i64> {
        if from >= before {
            return Vec::new();
        }
        let mut days: Vec<i64> = self
            .hours
            .range(from.saturating_mul(24)..before.saturating_mul(24))
            .map(|(hour, _)| hour.div_euclid(24))
            .collect();
        days.dedup();
        days
    }

    /// Keeps the users of `day` (Unix days) per day: every user row of its hours moves to
    /// its last hour (23:00), summed, and each app keeps at most [`MAX_USERS_PER_APP_DAY`]
    /// users apart (the busiest by GPU time, then tokens; the others are summed under
    /// `<app>/(other)`). The apps' hourly totals and the other clients' rows are left as
    /// they are, so an app's budget stays exact by the hour; a user's figures of that day
    /// then count whole in a window that starts within it. Whether anything moved or was
    /// folded (a day already kept per day is left unchanged); the apps folded.
    pub fn collapse_day(&mut self, day: i64) -> (bool, Vec<String>) {
        let last = day * 24 + 23;
        // (app → user → model → totals), taken out of the day's hours.
        let mut users: HashMap<String, HashMap<String, HashMap<String, Totals>>> = HashMap::new();
        let mut moved = false;
        for (hour_number, hour) in self.hours.range_mut(day * 24..=last) {
            let keys: Vec<(String, String)> = hour
                .rows
                .keys()
                .filter(|(client, _)| client.contains('/'))
                .cloned()
                .collect();
            if keys.is_empty() {
                continue;
            }
            moved |= *hour_number != last;
            for key in keys {
                let Some(totals) = hour.rows.remove(&key) else {
                    continue;
                };
                let (client, model) = key;
                let app = client.split_once('/').map_or("", |(app, _)| app).to_owned();
                users
                    .entry(app)
                    .or_default()
                    .entry(client)
                    .or_default()
                    .entry(model)
                    .or_default()
                    .add(&totals);
            }
            hour.clients.retain(|client, _| !client.contains('/'));
            for app in hour.apps.values_mut() {
                app.users.clear();
            }
        }
        if users.is_empty() {
            return (false, Vec::new());
        }
        let mut folded_apps = Vec::new();
        let hour = self.hours.entry(last).or_default();
        for (app_id, mut of_app) in users {
            let other = format!("{app_id}/{OTHER}");
            let mut folded = of_app.remove(&other).unwrap_or_default();
            if of_app.len() > MAX_USERS_PER_APP_DAY {
                let mut ranked: Vec<(String, Totals)> = of_app
                    .iter()
                    .map(|(user, models)| {
                        let mut sum = Totals::default();
                        models.values().for_each(|totals| sum.add(totals));
                        (user.clone(), sum)
                    })
                    .collect();
                let busiest_first = |a: &(String, Totals), b: &(String, Totals)| {
                    b.1.gpu_ns
                        .cmp(&a.1.gpu_ns)
                        .then_with(|| b.1.tokens().cmp(&a.1.tokens()))
                        .then_with(|| a.0.cmp(&b.0))
                };
                ranked.select_nth_unstable_by(MAX_USERS_PER_APP_DAY, busiest_first);
                for (user, _) in ranked.drain(MAX_USERS_PER_APP_DAY..) {
                    if let Some(models) = of_app.remove(&user) {
                        for (model, totals) in models {
                            folded.entry(model).or_default().add(&totals);
                        }
                    }
                }
                folded_apps.push(app_id.clone());
                moved = true;
            }
            if !folded.is_empty() {
                of_app.insert(other, folded);
            }
            let app = hour.apps.entry(app_id).or_default();
            for (user, models) in of_app {
                for (model, totals) in models {
                    hour.clients.entry(user.clone()).or_default().add(&totals);
                    hour.rows
                        .entry((user.clone(), model))
                        .or_default()
                        .add(&totals);
                }
                app.users.insert(user);
            }
        }
        (moved, folded_apps)
    }

    /// What `client` used from `start` (Unix seconds, a whole hour) on: with its users
    /// (`<client>/<user>`) when it is an app key, since an app's budget bounds them all.
    pub fn client_since(&self, client: &str, start: i64) -> Totals {
        let mut totals = Totals::default();
        for hour in self
            .hours
            .range(start.div_euclid(3600)..)
            .map(|(_, hour)| hour)
        {
            let used = if client.contains('/') {
                hour.clients.get(client)
            } else {
                hour.apps.get(client).map(|app| &app.total)
            };
            if let Some(used) = used {
                totals.add(used);
            }
        }
        totals
    }

    /// What each user of the app `client` used from `start` on, by sub-client id.
    pub fn users_since(&self, client: &str, start: i64) -> HashMap<&str, Totals> {
        let mut users: HashMap<&str, Totals> = HashMap::new();
        for hour in self
            .hours
            .range(start.div_euclid(3600)..)
            .map(|(_, hour)| hour)
        {
            let Some(app) = hour.apps.get(client) else {
                continue;
            };
            for id in &app.users {
                if let Some(used) = hour.clients.get(id) {
                    users.entry(id.as_str()).or_default().add(used);
                }
            }
        }
        users
    }

    /// Every client's totals from `start` on.
    pub fn clients_since(&self, start: i64) -> HashMap<&str, Totals> {
        let mut clients: HashMap<&str, Totals> = HashMap::new();
        for hour in self
            .hours
            .range(start.div_euclid(3600)..)
            .map(|(_, hour)| hour)
        {
            for (client, used) in &hour.clients {
                clients.entry(client.as_str()).or_default().add(used);
            }
        }
        clients
    }

    /// The totals from `start` on, grouped `by`, most GPU time first (ties: client, model).
    pub fn query(&self, start: i64, by: By) -> Vec<Row> {
        self.query_for(start, by, None)
    }

    /// [`Ledger::query`] over the rows of client `only` and its users (`<only>/<user>`) when
    /// given.
    pub fn query_for(&self, start: i64, by: By, only: Option<&str>) -> Vec<Row> {
        let shown = |client: &str| {
            only.is_none_or(|own| {
                client == own
                    || client
                        .strip_prefix(own)
                        .is_some_and(|rest| rest.starts_with('/'))
            })
        };
        let mut groups: HashMap<(String, String), Totals> = HashMap::new();
        for hour in self
            .hours
            .range(start.div_euclid(3600)..)
            .map(|(_, hour)| hour)
        {
            for ((client, model), used) in hour.rows.iter().filter(|((client, _), _)| shown(client))
            {
                let key = (
                    if by.client {
                        client.clone()
                    } else {
                        String::new()
                    },
                    if by.model {
                        model.clone()
                    } else {
                        String::new()
                    },
                );
                groups.entry(key).or_default().add(used);
            }
        }
        let mut rows: Vec<Row> = groups
            .into_iter()
            .map(|((client, model), totals)| Row {
                client,
                model,
                totals,
            })
            .collect();
        rows.sort_by(|a, b| {
            b.totals
                .gpu_ns
                .cmp(&a.totals.gpu_ns)
                .then_with(|| a.client.cmp(&b.client))
                .then_with(|| a.model.cmp(&b.model))
        });
        rows
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    // 2026-12-02 06:12:42 UTC.
    const NOW: i64 = 1_796_191_962;
    const SECOND: u64 = 1_000_000_000;

    fn batch(epoch: u64, seq: u64, rows: &[(&str, &str, u64)]) -> wire::UsageBatch {
        wire::UsageBatch {
            epoch,
            seq,
            rows: rows
                .iter()
                .map(|(client, model, seconds)| wire::UsageRow {
                    client_id: (*client).to_owned(),
                    model: (*model).to_owned(),
                    gpu_ns: seconds * SECOND,
                    prompt_tokens: 1,
                    completion_tokens: 2,
                    requests: 1,
                    ..wire::UsageRow::default()
                })
                .collect(),
        }
    }

    #[test]
    fn each_batch_is_applied_once_per_epoch() {
        let mut ledger = Ledger::default();
        let now = Applied::Now;
        assert_eq!(
            ledger.apply("a", &batch(7, 1, &[("chat", "llama3", 2)]), NOW),
            now
        );
        assert_eq!(
            ledger.apply("a", &batch(7, 1, &[("chat", "llama3", 2)]), NOW),
            Applied::Already,
            "a resend"
        );
        assert_eq!(
            ledger.apply("b", &batch(7, 1, &[("chat", "llama3", 3)]), NOW),
            now,
            "another node"
        );
        assert_eq!(
            ledger.apply("a", &batch(7, 2, &[("chat", "llama3", 1)]), NOW),
            now
        );
        // A restarted data plane (a later epoch) counts from 1 again.
        assert_eq!(
            ledger.apply("a", &batch(9, 1, &[("batch", "qwen", 4)]), NOW),
            now
        );
        assert_eq!(
            ledger.apply("a", &batch(9, 0, &[]), NOW),
            Applied::Already,
            "seq 0 is no batch"
        );
        // The earlier run's batches, late (its resend after the restart): refused, whatever
        // their seq, and not counted.
        for seq in [2, 3, 100] {
            assert_eq!(
                ledger.apply("a", &batch(7, seq, &[("chat", "llama3", 50)]), NOW),
                Applied::Stale
            );
        }
        assert_eq!(
            ledger.applied["a"],
            (9, 1),
            "the last applied is the later epoch's"
        );
        let chat = ledger.client_since("chat", NOW - NOW % 86_400);
        assert_eq!(chat.gpu_ns, 6 * SECOND);
        assert_eq!(chat.requests, 3);
        assert_eq!(chat.tokens(), 9);
    }

    #[test]
    fn an_epoch_ahead_is_refused_and_one_kept_before_is_forgotten() {
        let mut ledger = Ledger::default();
        let now_ms = u64::try_from(NOW).unwrap() * 1000;
        assert_eq!(
            ledger.apply("a", &batch(1 << 63, 1, &[("chat", "m", 9)]), NOW),
            Applied::Ahead
        );
        assert!(ledger.applied.is_empty(), "not kept");
        // Four minutes ahead (within what a clock skew could be): refused too, so that it
        // cannot make the node's real batches look stale.
        assert_eq!(
            ledger.apply("a", &batch(now_ms + 240_000, 1, &[]), NOW),
            Applied::Ahead
        );
        assert!(ledger.applied.is_empty(), "not kept");
        assert_eq!(
            ledger.apply("a", &batch(now_ms + 999, 1, &[("chat", "m", 1)]), NOW),
            Applied::Now,
            "within this second"
        );
        // A far-ahead epoch a state file holds from before: the node's batches count again.
        ledger.applied.insert("b".to_owned(), (1 << 63, 5));
        assert_eq!(
            ledger.apply("b", &batch(now_ms - 1000, 1, &[("chat", "m", 1)]), NOW),
            Applied::Now
        );
        assert_eq!(ledger.applied["b"], (now_ms - 1000, 1));
    }

    #[test]
    fn only_the_holders_epoch_is_taken_under_a_name() {
        let mut ledger = Ledger::default();
        let one = |epoch, seq| batch(epoch, seq, &[("chat", "m", 1)]);
        assert_eq!(
            ledger.check("a", &one(7, 1), NOW, Holder::Nobody),
            Applied::NotHolder,
            "no watch open under the name"
        );
        assert_eq!(
            ledger.check("a", &one(7, 1), NOW, Holder::Epoch(8)),
            Applied::NotHolder,
            "another data plane holds it"
        );
        // Another run took the name for a while (epoch 9, applied); the holder of epoch 7
        // is taken again once it holds the name, not refused as stale.
        ledger.add("a", &one(9, 4), NOW);
        assert_eq!(
            ledger.check("a", &one(7, 1), NOW, Holder::Epoch(7)),
            Applied::Now
        );
        assert_eq!(
            ledger.check("a", &one(7, 1), NOW, Holder::Any),
            Applied::Stale,
            "an older data plane's name keeps the rule of growing epochs"
        );
    }

    #[test]
    fn queries_group_and_sort_by_gpu_time() {
        let mut ledger = Ledger::default();
        ledger.apply(
            "a",
            &batch(1, 1, &[("chat", "llama3", 2), ("batch", "llama3", 5)]),
            NOW - 7200,
        );
        ledger.apply("a", &batch(1, 2, &[("chat", "qwen", 4)]), NOW);
        let by_client = ledger.query(
            0,
            By {
                client: true,
                model: false,
            },
        );
        let order: Vec<(&str, u64)> = by_client
            .iter()
            .map(|row| (row.client.as_str(), row.totals.gpu_ns / SECOND))
            .collect();
        assert_eq!(order, [("chat", 6), ("batch", 5)]);
        let by_model = ledger.query(
            0,
            By {
                client: false,
                model: true,
            },
        );
        assert_eq!(by_model[0].model, "llama3");
        assert_eq!(by_model[0].totals.gpu_ns, 7 * SECOND);
        assert_eq!(by_model[0].client, "");
        // Only the last hour.
        let recent = ledger.query(
            NOW - NOW % 3600,
            By {
                client: true,
                model: true,
            },
        );
        assert_eq!(recent.len(), 1);
        assert_eq!(
            (recent[0].client.as_str(), recent[0].model.as_str()),
            ("chat", "qwen")
        );
    }

    #[test]
    fn ninety_days_are_kept() {
        let mut ledger = Ledger::default();
        let day = 86_400;
        ledger.apply("a", &batch(1, 1, &[("chat", "m", 1)]), NOW - 90 * day);
        ledger.apply("a", &batch(1, 2, &[("chat", "m", 1)]), NOW - 89 * day);
        ledger.apply("a", &batch(1, 3, &[("chat", "m", 1)]), NOW);
        let dropped = ledger.prune(NOW);
        assert_eq!(dropped, [(NOW - 90 * day).div_euclid(day)]);
        assert_eq!(ledger.client_since("chat", 0).gpu_ns, 2 * SECOND);
    }

    #[test]
    fn an_hour_holds_a_bounded_number_of_rows() {
        let mut hour = Hour::default();
        let used = Totals {
            gpu_ns: 1,
            ..Totals::default()
        };
        for i in 0..MAX_ROWS_PER_HOUR {
            hour.add("chat", &format!("model-{i}"), &used);
        }
        assert_eq!(hour.rows.len(), MAX_ROWS_PER_HOUR);
        // Past the cap the model is summed under (other), the client kept: a budgeted
        // client's usage still counts as its own.
        for i in 0..5 {
            hour.add("batch", &format!("more-{i}"), &used);
        }
        assert_eq!(hour.rows.len(), MAX_ROWS_PER_HOUR + 1);
        let other = &hour.rows[&("batch".to_owned(), OTHER.to_owned())];
        assert_eq!(other.gpu_ns, 5);
        assert_eq!(hour.clients["batch"].gpu_ns, 5);
        assert_eq!(hour.clients["chat"].gpu_ns, MAX_ROWS_PER_HOUR as u64);
        hour.add("chat", "model-7", &used);
        assert_eq!(
            hour.rows[&("chat".to_owned(), "model-7".to_owned())].gpu_ns,
            2
        );
    }

    #[test]
    fn an_apps_distinct_users_per_hour_are_bounded_and_the_rest_folded() {
        let mut ledger = Ledger::default();
        let rows: Vec<wire::UsageRow> = (0..MAX_USERS_PER_APP_HOUR + 5)
            .map(|user| wire::UsageRow {
                client_id: format!("webui/user-{user}"),
                model: "m".to_owned(),
                gpu_ns: SECOND,
                requests: 1,
                ..wire::UsageRow::default()
            })
            .chain(std::iter::once(wire::UsageRow {
                client_id: "webui".to_owned(),
                model: "m".to_owned(),
                gpu_ns: SECOND,
                ..wire::UsageRow::default()
            }))
            .collect();
        let batch = wire::UsageBatch {
            epoch: 1,
            seq: 1,
            rows,
        };
        assert_eq!(
            ledger.add("a", &batch, NOW),
            ["webui"],
            "the first fold, once"
        );
        let hour = &ledger.hours[&NOW.div_euclid(3600)];
        assert_eq!(hour.apps["webui"].users.len(), MAX_USERS_PER_APP_HOUR + 1);
        let other = format!("webui/{OTHER}");
        assert_eq!(hour.clients[&other].gpu_ns, 5 * SECOND);
        // The app's total counts everyone; its users are read from its index.
        let users = ledger.users_since("webui", 0);
        assert_eq!(users.len(), MAX_USERS_PER_APP_HOUR + 1);
        assert_eq!(users["webui/user-7"].gpu_ns, SECOND);
        assert_eq!(
            ledger.client_since("webui", 0).gpu_ns,
            (MAX_USERS_PER_APP_HOUR as u64 + 6) * SECOND
        );
        assert_eq!(ledger.client_since("webui/user-7", 0).gpu_ns, SECOND);
        // A user already kept this hour stays itself; the next hour starts afresh.
        let again = |client: &str| wire::UsageBatch {
            epoch: 1,
            seq: 2,
            rows: vec![wire::UsageRow {
                client_id: client.to_owned(),
                model: "m".to_owned(),
                gpu_ns: SECOND,
                ..wire::UsageRow::default()
            }],
        };
        assert!(ledger.add("a", &again("webui/user-7"), NOW).is_empty());
        assert!(ledger.add("a", &again("webui/late"), NOW + 3600).is_empty());
        assert_eq!(ledger.users_since("webui", 0)["webui/late"].gpu_ns, SECOND);
    }

    #[test]
    fn a_past_days_users_are_kept_per_day_and_bounded() {
        let mut ledger = Ledger::default();
        let day = NOW.div_euclid(86_400) - 3;
        let at = |hour: i64| day * 86_400 + hour * 3600 + 60;
        let users = |range: std::ops::Range<usize>, seconds: u64| -> Vec<wire::UsageRow> {
            range
                .map(|user| wire::UsageRow {
                    client_id: format!("webui/user-{user:05}"),
                    model: "m".to_owned(),
                    gpu_ns: seconds * SECOND,
                    requests: 1,
                    ..wire::UsageRow::default()
                })
                .collect()
        };
        // Hour 1: users 0..6000 (1 s each), the app itself and another client; hour 2:
        // users 3000..10005 (2 s each): 10,005 distinct users that day, each hour under the
        // hourly cap.
        let mut first = users(0..6_000, 1);
        first.push(wire::UsageRow {
            client_id: "webui".to_owned(),
            model: "m".to_owned(),
            gpu_ns: SECOND,
            ..wire::UsageRow::default()
        });
        first.push(wire::UsageRow {
            client_id: "chat".to_owned(),
            model: "m".to_owned(),
            gpu_ns: SECOND,
            ..wire::UsageRow::default()
        });
        let second = users(3_000..MAX_USERS_PER_APP_DAY + 5, 2);
        ledger.add(
            "a",
            &wire::UsageBatch {
                epoch: 1,
                seq: 1,
                rows: first,
            },
            at(1),
        );
        ledger.add(
            "a",
            &wire::UsageBatch {
                epoch: 1,
                seq: 2,
                rows: second,
            },
            at(2),
        );
        let all = By {
            client: false,
            model: false,
        };
        let total = ledger.query(0, all)[0].totals;
        let app_hours: Vec<Totals> = [1, 2]
            .iter()
            .map(|hour| ledger.hours[&(day * 24 + hour)].apps["webui"].total)
            .collect();

        let (moved, folded) = ledger.collapse_day(day);
        assert!(moved);
        assert_eq!(folded, ["webui"], "more users than a past day keeps apart");
        // The hours keep no user rows; the apps' hourly totals and the other clients' rows
        // stay as they were.
        for (index, hour) in [1, 2].iter().enumerate() {
            let hour = &ledger.hours[&(day * 24 + hour)];
            assert!(hour.rows.keys().all(|(client, _)| !client.contains('/')));
            assert!(hour.clients.keys().all(|client| !client.contains('/')));
            assert!(hour.apps["webui"].users.is_empty());
            assert_eq!(hour.apps["webui"].total, app_hours[index]);
        }
        assert_eq!(ledger.hours[&(day * 24 + 1)].clients["chat"].gpu_ns, SECOND);
        // The day's users under its last hour, each once, at most the cap and (other).
        let last = &ledger.hours[&(day * 24 + 23)];
        assert_eq!(last.apps["webui"].users.len(), MAX_USERS_PER_APP_DAY + 1);
        assert_eq!(last.rows.len(), MAX_USERS_PER_APP_DAY + 1);
        let users = ledger.users_since("webui", day * 86_400);
        assert_eq!(
            users["webui/user-03000"].gpu_ns,
            3 * SECOND,
            "summed over hours"
        );
        assert_eq!(users["webui/user-10004"].gpu_ns, 2 * SECOND);
        // The least busy (1 s, the last ids) are summed under (other).
        assert_eq!(users[format!("webui/{OTHER}").as_str()].gpu_ns, 5 * SECOND);
        assert!(!users.contains_key("webui/user-02999"));
        assert_eq!(users["webui/user-02994"].gpu_ns, SECOND);
        // Nothing is lost, and a window from within the day counts a user's whole day.
        assert_eq!(ledger.query(0, all)[0].totals, total);
        assert_eq!(
            ledger.client_since("webui", 0).gpu_ns,
            (6_001 + 2 * 7_005) * SECOND
        );
        assert_eq!(
            ledger.client_since("webui/user-03000", at(2) - 60).gpu_ns,
            3 * SECOND
        );
        // A day kept per day already is left as it is.
        let before = ledger.clone();
        assert_eq!(ledger.collapse_day(day), (false, Vec::new()));
        assert_eq!(ledger, before);
        assert_eq!(ledger.days_between(day - 5, day), Vec::<i64>::new());
        assert_eq!(ledger.days_between(day - 5, day + 1), [day]);
    }

    #[test]
    fn too_long_a_model_name_is_kept_as_other() {
        let mut hour = Hour::default();
        hour.add("chat", &"m".repeat(MAX_MODEL_BYTES + 1), &Totals::default());
        hour.add("chat", &"m".repeat(MAX_MODEL_BYTES), &Totals::default());
        assert!(
            hour.rows
                .contains_key(&("chat".to_owned(), OTHER.to_owned()))
        );
        assert_eq!(hour.rows.len(), 2);
    }
}
