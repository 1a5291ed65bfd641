//! Usage accounting and budgets on the data plane.
//!
//! Every upstream response ends in [`Usage::record`] (the queued path's completion hook,
//! with the request's client and model): GPU time (Ollama's `total_duration`, else the
//! time the request held its slot), prompt and completion tokens (a stream cut short:
//! its chunks as completion tokens), one request; inference only. A request whose client
//! left before the answer's head is charged the slot time it held (`queued`), as is every
//! attempt that reached a host and was not the answer (a head timeout, a broken
//! connection). The embedding path adds the inputs it sent upstream and those the cache
//! answered. Recording feeds the two usage
//! metrics and a ledger of increments not yet reported, under the metrics' bounded labels
//! (a model no host lists is `(other)` in the ledger).
//!
//! The report loop takes the ledger as a numbered batch ([`Usage::report`]) and resends
//! that same batch until an ack names it ([`Usage::acked`]); the control plane applies each
//! batch once, so nothing is counted twice or lost while the control plane is away. A
//! graceful stop reports after serving has drained, until everything is acknowledged
//! (bounded); only what is still unacknowledged then, or when a data plane dies, is lost.
//!
//! Budgets: the control plane's figure of what a client used in its window (in the
//! snapshot, refreshed by every ack; the newest wins), plus what this node recorded that is
//! not acknowledged yet, against the client's limits ([`Usage::check`]), before a request
//! is queued and again when it is granted its slot.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oqp_proto::policy::v1 as wire;

use crate::auth::Caller;
use crate::error::ProxyError;
use crate::metrics::Metrics;
use crate::policy::{Client, Policy, UsageBudget, Used};

pub mod minute;
pub mod window;

/// What requests used: the figures accounting sums.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// GPU time, nanoseconds.
    pub gpu_ns: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// Requests answered (upstream, or whole from the embedding cache).
    pub requests: u64,
    /// Embedding inputs sent upstream.
    pub embedding_inputs: u64,
    /// Embedding inputs answered from the cache.
    pub cached_inputs: u64,
    /// Prompt tokens cached where the requests ran: the engine's figure where its answer
    /// states one, else conversation affinity's estimate; `None` when no request had
    /// either (never a 0 that means "unknown").
    pub cached_tokens: Option<u64>,
}

/// The sum of two figures that may be unknown: unknown only when both are.
pub fn add_known(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0).saturating_add(b.unwrap_or(0))),
    }
}

impl Totals {
    /// Prompt and completion tokens: what a token budget counts.
    pub fn tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }

    /// Adds `other` to these.
    pub fn add(&mut self, other: &Totals) {
        self.gpu_ns = self.gpu_ns.saturating_add(other.gpu_ns);
        self.prompt_tokens = self.prompt_tokens.saturating_add(other.prompt_tokens);
        self.completion_tokens = self
            .completion_tokens
            .saturating_add(other.completion_tokens);
        self.requests = self.requests.saturating_add(other.requests);
        self.embedding_inputs = self.embedding_inputs.saturating_add(other.embedding_inputs);
        self.cached_inputs = self.cached_inputs.saturating_add(other.cached_inputs);
        self.cached_tokens = add_known(self.cached_tokens, other.cached_tokens);
    }

    /// The wire row of `client` and `model`.
    pub fn to_row(&self, client: &str, model: &str) -> wire::UsageRow {
        wire::UsageRow {
            client_id: client.to_owned(),
            model: model.to_owned(),
            gpu_ns: self.gpu_ns,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            requests: self.requests,
            embedding_inputs: self.embedding_inputs,
            cached_inputs: self.cached_inputs,
            cached_tokens: self.cached_tokens,
        }
    }

    /// From a wire row.
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

/// The usage ledger of one data plane.
#[derive(Debug)]
pub struct Usage {
    metrics: Arc<Metrics>,
    minute: Arc<minute::MinuteLimits>,
    epoch: u64,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Recorded since the last batch was taken.
    pending: Ledger,
    /// The batch sent and not acknowledged yet, with its number.
    sent: Option<(u64, Ledger)>,
    last_seq: u64,
    /// The control plane refused the batch sent, for good as far as it knows: it is
    /// sent again only after a backoff.
    refused: Option<Refused>,
    /// Reports that carried a batch.
    batches_sent: u64,
    /// The control plane's figures of budgeted clients, from the last ack.
    used: HashMap<Arc<str>, Used>,
    /// Each client's usage today over all data planes, from the last ack, and the UTC day
    /// (Unix days) it is for.
    today: (i64, HashMap<Arc<str>, Totals>),
}

/// A batch the control plane refused, and when it is sent again.
#[derive(Debug, Clone)]
struct Refused {
    reason: String,
    delay: Duration,
    resend_at: std::time::Instant,
}

/// The first wait before a refused batch is sent again; it doubles at each refusal up to
/// [`REFUSED_MAX_DELAY`].
pub const REFUSED_FIRST_DELAY: Duration = Duration::from_secs(1);

/// The longest wait before a refused batch is sent again.
pub const REFUSED_MAX_DELAY: Duration = Duration::from_secs(60);

/// Increments per client and model (labels bounded like the metrics' labels).
#[derive(Debug, Default)]
struct Ledger {
    rows: HashMap<(Arc<str>, Arc<str>), Totals>,
    clients: HashMap<Arc<str>, Totals>,
    /// Tokens each Ollama Cloud account served each client: (client, account) → tokens.
    cloud: HashMap<(Arc<str>, Arc<str>), u64>,
    /// When the last increment was recorded (Unix seconds): a ledger counts toward a
    /// window only when it was added to inside it.
    last_unix_s: i64,
}

impl Ledger {
    fn add(&mut self, client: &Arc<str>, model: &Arc<str>, totals: &Totals, now: i64) {
        self.rows
            .entry((client.clone(), model.clone()))
            .or_default()
            .add(totals);
        self.clients.entry(client.clone()).or_default().add(totals);
        self.last_unix_s = self.last_unix_s.max(now);
    }

    fn client(&self, client: &str, since: i64) -> Totals {
        if self.last_unix_s < since {
            return Totals::default();
        }
        self.clients.get(client).copied().unwrap_or_default()
    }

    /// What an app used: its own requests and its users' (`<app>/<user>`).
    fn app(&self, app: &str, since: i64) -> Totals {
        let mut totals = Totals::default();
        if self.last_unix_s < since {
            return totals;
        }
        for (client, used) in &self.clients {
            if of_app(client, app) {
                totals.add(used);
            }
        }
        totals
    }
}

impl Usage {
    /// An empty ledger feeding `metrics`, whose epoch is now (Unix ms).
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self::with_epoch(metrics, SystemTime::now())
    }

    /// An empty ledger whose epoch is `started` (Unix ms): epochs grow from one run of a
    /// data plane to the next, and the control plane refuses a batch from an epoch below
    /// the last it applied for the node.
    pub fn with_epoch(metrics: Arc<Metrics>, started: SystemTime) -> Self {
        Self {
            metrics,
            minute: Arc::default(),
            epoch: epoch_of(started),
            inner: Mutex::default(),
        }
    }

    /// The per-minute limits' buckets on this data plane.
    pub fn minute(&self) -> &Arc<minute::MinuteLimits> {
        &self.minute
    }

    /// Admits a request of `caller` estimated at `estimate` tokens against its per-minute
    /// limits (see [`minute`]), or refuses it (429); refusals are counted in the metrics
    /// under the configured client.
    pub fn admit_minute(
        &self,
        policy: &Policy,
        caller: &Caller,
        estimate: u64,
    ) -> Result<Option<minute::Charge>, ProxyError> {
        let limits = minute::limits_of(policy, caller);
        if limits.is_empty() {
            return Ok(None);
        }
        let counted_as = caller
            .member
            .as_ref()
            .map_or(&caller.id, |member| &member.app);
        let admitted = self
            .minute
            .admit(limits, counted_as, estimate, tokio::time::Instant::now());
        if admitted.is_err() {
            self.metrics.rate_limited(counted_as);
        }
        admitted
    }

    /// The epoch of this ledger's batches (Unix ms of its start), which the watch presents
    /// too, so that the control plane takes batches under this node's name only from it.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records what one response of `client` for `model` used (`model` empty when the
    /// request named none).
    pub fn record(&self, client: &str, model: &str, totals: Totals, now: SystemTime) {
        self.record_on(client, model, None, totals, now);
    }

    /// [`Usage::record`] of a response an Ollama Cloud `account` (as the snapshot names it)
    /// served, when one did: its tokens count toward that account's spend too.
    pub fn record_on(
        &self,
        client: &str,
        model: &str,
        account: Option<&str>,
        totals: Totals,
        now: SystemTime,
    ) {
        let (client, model) = self.metrics.usage(
            client,
            model,
            Duration::from_nanos(totals.gpu_ns),
            totals.prompt_tokens,
            totals.completion_tokens,
        );
        let mut inner = self.lock();
        inner.pending.add(&client, &model, &totals, unix_s(now));
        if let Some(account) = account.filter(|_| totals.tokens() > 0) {
            let tokens = inner
                .pending
                .cloud
                .entry((client, Arc::from(account)))
                .or_default();
            *tokens = tokens.saturating_add(totals.tokens());
        }
    }

    /// The cloud tokens of the batch [`Usage::report`] last gave, to send with it (one
    /// row per client and account).
    pub fn report_cloud(&self) -> Vec<wire::CloudTokens> {
        let inner = self.lock();
        let Some((_, ledger)) = inner.sent.as_ref() else {
            return Vec::new();
        };
        let mut rows: Vec<wire::CloudTokens> = ledger
            .cloud
            .iter()
            .map(|((client, account), tokens)| wire::CloudTokens {
                client_id: client.to_string(),
                account: account.to_string(),
                tokens: *tokens,
            })
            .collect();
        rows.sort_by(|a, b| (&a.client_id, &a.account).cmp(&(&b.client_id, &b.account)));
        rows
    }

    /// The batch for the next report: the one sent and not acknowledged, else everything
    /// recorded since, under a new number; `None` when there is nothing to report, or
    /// while a batch the control plane refused waits out its backoff.
    pub fn report(&self) -> Option<wire::UsageBatch> {
        self.report_at(std::time::Instant::now())
    }

    fn report_at(&self, now: std::time::Instant) -> Option<wire::UsageBatch> {
        let mut inner = self.lock();
        if inner
            .refused
            .as_ref()
            .is_some_and(|refused| now < refused.resend_at)
        {
            return None;
        }
        inner.batches_sent += 1;
        if inner.sent.is_none()
            && !(inner.pending.rows.is_empty() && inner.pending.cloud.is_empty())
        {
            inner.last_seq += 1;
            let seq = inner.last_seq;
            let taken = std::mem::take(&mut inner.pending);
            inner.sent = Some((seq, taken));
        }
        let (seq, ledger) = inner.sent.as_ref()?;
        let mut rows: Vec<wire::UsageRow> = ledger
            .rows
            .iter()
            .map(|((client, model), totals)| totals.to_row(client, model))
            .collect();
        rows.sort_by(|a, b| (&a.client_id, &a.model).cmp(&(&b.client_id, &b.model)));
        Some(wire::UsageBatch {
            epoch: self.epoch,
            seq: *seq,
            rows,
        })
    }

    /// How many reports carried a batch so far.
    pub fn batches_sent(&self) -> u64 {
        self.lock().batches_sent
    }

    /// Why the control plane refused the batch sent, while it is refused.
    pub fn refused(&self) -> Option<String> {
        self.lock()
            .refused
            .as_ref()
            .map(|refused| refused.reason.clone())
    }

    /// Lets a refused batch be sent again at once (a stopping data plane's last try).
    pub fn retry_now(&self) {
        if let Some(refused) = self.lock().refused.as_mut() {
            refused.resend_at = std::time::Instant::now();
        }
    }

    /// Whether everything recorded has been acknowledged.
    pub fn settled(&self) -> bool {
        let inner = self.lock();
        inner.sent.is_none() && inner.pending.rows.is_empty()
    }

    /// Takes in a report's ack: drops the batch it names, keeps the control plane's
    /// figures of budgets and of today.
    pub fn acked(&self, ack: &wire::ReportAck, now: SystemTime) {
        self.acked_at(ack, now, std::time::Instant::now());
    }

    fn acked_at(&self, ack: &wire::ReportAck, now: SystemTime, instant: std::time::Instant) {
        let mut inner = self.lock();
        if ack.usage_seq != 0
            && inner
                .sent
                .as_ref()
                .is_some_and(|(seq, _)| *seq == ack.usage_seq)
        {
            inner.sent = None;
            inner.refused = None;
        }
        if !ack.usage_refused.is_empty() && inner.sent.is_some() {
            let delay = inner
                .refused
                .as_ref()
                .map_or(REFUSED_FIRST_DELAY, |refused| {
                    (refused.delay * 2).min(REFUSED_MAX_DELAY)
                });
            if inner.refused.is_none() {
                tracing::warn!(
                    reason = %ack.usage_refused,
                    "the control plane refused this node's usage batch; it is sent again \
                     with a growing backoff (up to {} s)",
                    REFUSED_MAX_DELAY.as_secs()
                );
            }
            inner.refused = Some(Refused {
                reason: ack.usage_refused.clone(),
                delay,
                resend_at: instant + delay,
            });
        }
        // Merged, not replaced: a user the ack leaves out (others nearer their budgets
        // filled its list) keeps the last figure this node was sent; the newest of two
        // copies wins.
        for used in &ack.budgets {
            let figure = Used::from_wire(used);
            match inner.used.get_mut(used.client_id.as_str()) {
                Some(kept) if kept.as_of_unix_ms > figure.as_of_unix_ms => {}
                Some(kept) => *kept = figure,
                None => {
                    inner
                        .used
                        .insert(Arc::from(used.client_id.as_str()), figure);
                }
            }
        }
        forget_old_figures(&mut inner.used, now);
        inner.today = (
            unix_s(now).div_euclid(86_400),
            ack.today
                .iter()
                .map(|row| (Arc::from(row.client_id.as_str()), Totals::from_row(row)))
                .collect(),
        );
    }

    /// Refuses a request of `client` whose budget is spent at `now` (429, `Retry-After` =
    /// seconds until its window resets).
    pub fn check(&self, client: &Client, now: SystemTime) -> Result<(), ProxyError> {
        self.check_budget(&client.id, client.budget.as_ref(), Whose::Own, now)
    }

    /// Refuses a request of `caller` whose budget is spent at `now`: a client's own; for an
    /// app key's, the app's as a whole (itself and all its users) and then the user's.
    pub fn check_caller(
        &self,
        policy: &Policy,
        caller: &Caller,
        now: SystemTime,
    ) -> Result<(), ProxyError> {
        let Some(member) = &caller.member else {
            return match policy.clients_by_id.get(&caller.id) {
                Some(client) => self.check(client, now),
                None => Ok(()),
            };
        };
        let Some(app) = policy.clients_by_id.get(&member.app) else {
            return Ok(());
        };
        self.check_budget(&app.id, app.budget.as_ref(), Whose::App, now)?;
        // A token user's claims may choose its budget (over the users' window).
        let claimed = caller
            .claims
            .as_ref()
            .and_then(|claims| claims.budget.as_ref());
        match claimed.or(app.users.as_ref().and_then(|users| users.budget.as_ref())) {
            Some(budget) if caller.id != app.id => {
                self.check_budget(&caller.id, Some(budget), Whose::Own, now)
            }
            _ => Ok(()),
        }
    }

    fn check_budget(
        &self,
        client: &str,
        budget: Option<&UsageBudget>,
        whose: Whose,
        now: SystemTime,
    ) -> Result<(), ProxyError> {
        let Some(budget) = budget else {
            return Ok(());
        };
        let now = unix_s(now);
        let start = window::start(now, budget.window_seconds, budget.anchor_unix_s);
        let inner = self.lock();
        let (gpu_ns, tokens, usd_micros) =
            used_in(budget, inner.used.get(client), &inner, client, whose, start);
        drop(inner);
        let over = if budget.gpu_ns > 0 && gpu_ns >= budget.gpu_ns {
            Some(format!("gpu_seconds {}", seconds(budget.gpu_ns)))
        } else if budget.tokens > 0 && tokens >= budget.tokens {
            Some(format!("tokens {}", budget.tokens))
        } else if budget.usd_micros > 0 && usd_micros >= budget.usd_micros {
            #[allow(clippy::cast_precision_loss)]
            let usd = budget.usd_micros as f64 / 1e6;
            Some(format!("usd {usd}"))
        } else {
            None
        };
        match over {
            None => Ok(()),
            Some(what) => {
                let end = window::end(now, budget.window_seconds, budget.anchor_unix_s);
                Err(ProxyError::BudgetExceeded {
                    budget: format!("{what} per {}", budget.window),
                    retry_after: u64::try_from(end - now).unwrap_or(1).max(1),
                })
            }
        }
    }

    /// What `client` used today (UTC) over all data planes, as far as this node knows.
    pub fn today(&self, client: &str, now: SystemTime) -> Totals {
        let now = unix_s(now);
        let day = now.div_euclid(86_400);
        let inner = self.lock();
        let mut totals = if inner.today.0 == day {
            inner.today.1.get(client).copied().unwrap_or_default()
        } else {
            Totals::default()
        };
        let since = day * 86_400;
        totals.add(&inner.pending.client(client, since));
        if let Some((_, sent)) = &inner.sent {
            totals.add(&sent.client(client, since));
        }
        totals
    }
}

impl Usage {
    /// Every client (and app user) that used anything today (UTC), over all data planes as far
    /// as this node knows, with what it used: the dashboard's usage view.
    pub fn today_all(&self, now: SystemTime) -> Vec<(Arc<str>, Totals)> {
        let now = unix_s(now);
        let day = now.div_euclid(86_400);
        let since = day * 86_400;
        let inner = self.lock();
        let mut all: HashMap<Arc<str>, Totals> = HashMap::new();
        if inner.today.0 == day {
            for (client, totals) in &inner.today.1 {
                all.entry(client.clone()).or_default().add(totals);
            }
        }
        let ledgers = std::iter::once(&inner.pending).chain(inner.sent.as_ref().map(|(_, l)| l));
        for ledger in ledgers {
            if ledger.last_unix_s < since {
                continue;
            }
            for (client, totals) in &ledger.clients {
                all.entry(client.clone()).or_default().add(totals);
            }
        }
        drop(inner);
        let mut all: Vec<_> = all.into_iter().collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// GPU time (ns) and tokens `client` used of `budget` in its current window, as the
    /// refusal would count them; `app`: an app key's budget, which counts its users too.
    pub fn budget_used(
        &self,
        client: &str,
        budget: &UsageBudget,
        app: bool,
        now: SystemTime,
    ) -> (u64, u64) {
        let now = unix_s(now);
        let start = window::start(now, budget.window_seconds, budget.anchor_unix_s);
        let whose = if app { Whose::App } else { Whose::Own };
        let inner = self.lock();
        let (gpu_ns, tokens, _) =
            used_in(budget, inner.used.get(client), &inner, client, whose, start);
        (gpu_ns, tokens)
    }
}

/// Most figures kept from acks; past it, those of the oldest windows are forgotten first.
pub const MAX_FIGURES: usize = 100_000;

/// Forgets figures of windows that ended (none lasts over 30 days) and, past
/// [`MAX_FIGURES`], those of the oldest windows.
fn forget_old_figures(used: &mut HashMap<Arc<str>, Used>, now: SystemTime) {
    const LONGEST_WINDOW_S: i64 = 30 * 86_400;
    let now = unix_s(now);
    used.retain(|_, figure| figure.window_start_unix_s > now - LONGEST_WINDOW_S);
    if used.len() > MAX_FIGURES {
        let mut starts: Vec<i64> = used
            .values()
            .map(|figure| figure.window_start_unix_s)
            .collect();
        let cut = starts.len() - MAX_FIGURES;
        let (_, oldest_kept, _) = starts.select_nth_unstable(cut);
        let oldest_kept = *oldest_kept;
        used.retain(|_, figure| figure.window_start_unix_s >= oldest_kept);
    }
}

/// GPU time and tokens `client` used in the window starting at `start`: the newest of the
/// snapshot's and the last ack's figures for that window, plus this node's unacknowledged
/// increments recorded in it.
fn used_in(
    budget: &UsageBudget,
    acked: Option<&Used>,
    inner: &Inner,
    client: &str,
    whose: Whose,
    start: i64,
) -> (u64, u64, u64) {
    let base = [Some(&budget.used), acked]
        .into_iter()
        .flatten()
        .filter(|used| used.window_start_unix_s == start)
        .max_by_key(|used| used.as_of_unix_ms)
        .copied()
        .unwrap_or_default();
    let of = |ledger: &Ledger| match whose {
        Whose::Own => ledger.client(client, start),
        Whose::App => ledger.app(client, start),
    };
    let mut local = of(&inner.pending);
    if let Some((_, sent)) = &inner.sent {
        local.add(&of(sent));
    }
    // Cloud spend only as the control plane attributed it: the price is its to observe.
    (
        base.gpu_ns.saturating_add(local.gpu_ns),
        base.tokens.saturating_add(local.tokens()),
        base.usd_micros,
    )
}

/// Whose usage a budget counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Whose {
    /// The client's own.
    Own,
    /// An app's: its own and its users' (`<app>/<user>`).
    App,
}

/// Whether usage recorded under `client` counts toward `app`'s: the app itself or one of its
/// users.
pub fn of_app(client: &str, app: &str) -> bool {
    client
        .strip_prefix(app)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// Whole seconds as an integer, else with up to three decimals.
pub fn seconds(ns: u64) -> String {
    if ns.is_multiple_of(1_000_000_000) {
        (ns / 1_000_000_000).to_string()
    } else {
        let text = format!("{:.3}", Duration::from_nanos(ns).as_secs_f64());
        text.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

/// The epoch of a data plane started at `started`: Unix ms, at least 1.
pub fn epoch_of(started: SystemTime) -> u64 {
    started
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
        .max(1)
}

fn unix_s(at: SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |since| {
        i64::try_from(since.as_secs()).unwrap_or(i64::MAX)
    })
}

#[cfg(test)]
mod tests;
