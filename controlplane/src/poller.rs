//! Host polling: what each upstream has installed (`/api/tags`) and loaded
//! (`/api/ps`), and whether it answers at all. An OpenAI-style engine
//! (`kind: openai`: llama-server, llama-swap, vLLM…) is polled by its own
//! routes instead (`engine`: `/health`, `/v1/models`, llama-server's `/props`
//! for its slots); `kind: auto` asks `/api/version` on each poll and polls the
//! host as whichever kind answered, logging what it found and any change.
//!
//! Every host of `ollama.hosts` is polled every `model_sync_interval`,
//! healthy or not, so that a model pulled on a live host and a host that came
//! back both reach the router without a restart. Results go to
//! [`Hub::set_inventory`], which republishes the snapshot only when something
//! changed. Health transitions are logged at WARN and sent as `host.unhealthy`
//! / `host.recovered` webhooks (`{name}` only: a URL may carry credentials);
//! a host's first poll establishes its state without an event.
//!
//! [`probe_all`] is the start-up probe (every host at once, before the first
//! snapshot goes out). [`run`] is one supervisor that follows the
//! config: one task per host, restarted when a reload changes what or how it
//! polls, stopped when the host leaves the config. A data plane that starts
//! failing to reach a host wakes that host's task early
//! ([`Hub::request_repoll`]), at most once a [`REPOLL_MIN_GAP`].

mod engine;
mod probe;
pub mod runners;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::compile::Inventory;
use crate::config::{Config, HostKind, Secret, WebhookEvent};
use crate::hub::Hub;
use crate::outbound::Outbound;
use crate::webhooks::Notice;

pub use engine::{Detected, Learned, parse_openai_models};
pub use probe::{Observation, parse_models};
pub use runners::Shown;

/// The shortest time between two polls of one host woken by re-poll requests.
pub const REPOLL_MIN_GAP: Duration = Duration::from_secs(1);

/// What and how one host is polled; a change restarts its task.
#[derive(Clone, PartialEq)]
pub struct Target {
    name: String,
    url: String,
    kind: HostKind,
    /// Cloud hosts: the first pool key, sent as `Authorization: Bearer`.
    bearer: Option<Secret>,
    interval: Duration,
    timeout: Duration,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL may carry user info; the name identifies the host.
        f.debug_struct("Target")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .field("interval", &self.interval)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Target {
    /// Every host of `config`, in config order.
    pub fn all(config: &Config) -> Vec<Target> {
        config
            .ollama
            .hosts
            .iter()
            .map(|host| Target {
                name: host.name.clone(),
                url: host.url.clone(),
                kind: host.kind,
                bearer: match host.kind {
                    HostKind::Cloud => host.api_keys.first().map(|key| key.key.clone()),
                    HostKind::Ollama | HostKind::Openai | HostKind::Auto => None,
                },
                interval: host.model_sync_interval,
                timeout: config.routing.model_poll_timeout,
            })
            .collect()
    }

    /// The host's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether `other` polls the same server the same way (only the schedule
    /// may differ), so that what was learned about this one still holds.
    fn same_upstream(&self, other: &Target) -> bool {
        self.url == other.url && self.kind == other.kind && self.bearer == other.bearer
    }
}

/// Polls every host of the config in force once, all at once, and records
/// the results; returns how many answered. The first state is established
/// without webhooks; hosts that do not answer are logged at WARN.
pub async fn probe_all(hub: &Hub, client: &Outbound) -> usize {
    let targets = Target::all(&hub.config());
    let observations = futures_util::future::join_all(targets.iter().map(|target| async move {
        let previous = hub.inventory_of(&target.name);
        (
            target,
            probe::probe(client, target, previous.as_ref()).await,
        )
    }))
    .await;
    let mut healthy = 0;
    for (target, observation) in observations {
        match &observation.tags {
            Ok(models) => {
                healthy += 1;
                tracing::info!(host = %target.name, models = models.len(), "host answered the start-up probe");
            }
            Err(error) => {
                tracing::warn!(host = %target.name, %error, "host did not answer the start-up probe");
            }
        }
        let inventory =
            observation.to_inventory(hub.inventory_of(&target.name).as_ref(), SystemTime::now());
        hub.set_inventory(&target.name, inventory);
    }
    healthy
}

/// The supervisor: keeps one task per configured host, following reloads,
/// until `shutdown` (which stops every host task too).
pub async fn run(hub: Arc<Hub>, client: Outbound, shutdown: CancellationToken) {
    let mut configs = hub.watch_config();
    let mut running: HashMap<String, (Target, CancellationToken)> = HashMap::new();
    let mut tasks = JoinSet::new();
    loop {
        let config = configs.borrow_and_update().clone();
        let targets = Target::all(&config);
        running.retain(|name, (current, stop)| {
            let next = targets.iter().find(|target| &target.name == name);
            if next == Some(current) {
                return true;
            }
            stop.cancel();
            if next.is_none_or(|next| !next.same_upstream(current)) {
                // Another server (or none) now answers to this name: what
                // was learned about the old one must not route requests.
                hub.forget_inventory(name);
            }
            false
        });
        for target in targets {
            if running.contains_key(&target.name) {
                continue;
            }
            let stop = shutdown.child_token();
            let signal = hub.repoll_signal(&target.name);
            tasks.spawn(poll_host(
                hub.clone(),
                client.clone(),
                target.clone(),
                signal,
                stop.clone(),
            ));
            running.insert(target.name.clone(), (target, stop));
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

/// Polls one host until `stop`: one interval after its last poll (the
/// start-up probe's, or an earlier task's), at once if it was never polled,
/// or early when asked to.
async fn poll_host(
    hub: Arc<Hub>,
    client: Outbound,
    target: Target,
    signal: Arc<Notify>,
    stop: CancellationToken,
) {
    let seen = hub.inventory_of(&target.name);
    let mut known = seen.as_ref().map(|inventory| inventory.healthy);
    let mut due = seen
        .and_then(|inventory| inventory.last_checked)
        .map_or_else(Instant::now, |at| {
            let since = SystemTime::now().duration_since(at).unwrap_or_default();
            Instant::now() + target.interval.saturating_sub(since)
        });
    let mut last_poll: Option<Instant> = None;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep_until(due) => {}
            () = signal.notified() => {
                if let Some(last) = last_poll {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep_until(last + REPOLL_MIN_GAP) => {}
                    }
                }
                tracing::debug!(host = %target.name, "early poll requested");
            }
        }
        let started = Instant::now();
        last_poll = Some(started);
        due = started + target.interval;
        let previous = hub.inventory_of(&target.name);
        let observation = tokio::select! {
            () = stop.cancelled() => return,
            observation = probe::probe(&client, &target, previous.as_ref()) => observation,
        };
        if stop.is_cancelled() {
            return;
        }
        record(&hub, &target, &mut known, &observation);
    }
}

/// Records a poll: inventory first (routing benefits at once), then the
/// transition, if any, in the log and as a webhook.
fn record(hub: &Hub, target: &Target, known: &mut Option<bool>, observation: &Observation) {
    let name = target.name.as_str();
    let previous = hub.inventory_of(name);
    log_engine_changes(target, previous.as_ref(), observation);
    let inventory = observation.to_inventory(previous.as_ref(), SystemTime::now());
    let healthy = inventory.healthy;
    if let Some(version) = hub.set_inventory(name, inventory) {
        tracing::debug!(host = name, version, "host inventory changed");
    }
    match (*known, &observation.tags) {
        (Some(true), Err(error)) => {
            tracing::warn!(host = name, %error, "host unhealthy");
            hub.webhooks()
                .notify(Notice::new(WebhookEvent::HostUnhealthy).field("name", name));
        }
        (Some(false), Ok(models)) => {
            tracing::warn!(host = name, models = models.len(), "host recovered");
            hub.webhooks()
                .notify(Notice::new(WebhookEvent::HostRecovered).field("name", name));
        }
        (None, Err(error)) => {
            tracing::warn!(host = name, %error, "host did not answer its first poll");
        }
        _ => {}
    }
    *known = Some(healthy);
}

/// Logs what a poll learned of a host's engine that differs from the last
/// poll: the kind an `auto` host was found to be (INFO), a host that answers
/// as another kind than before (WARN: it was restarted as something else),
/// and a new problem with what the engine says of itself (WARN).
fn log_engine_changes(target: &Target, previous: Option<&Inventory>, observation: &Observation) {
    if observation.tags.is_err() {
        return;
    }
    let name = target.name.as_str();
    let before = previous.map(|p| &p.learned);
    let now = &observation.learned;
    match (before.and_then(|b| b.detected), now.detected) {
        (Some(old), Some(new)) if old != new => {
            tracing::warn!(
                host = name,
                was = old.as_str(),
                now = new.as_str(),
                configured = %target.kind,
                "host answers as another kind of server than before"
            );
        }
        (None, Some(new)) if target.kind == HostKind::Auto => {
            tracing::info!(host = name, kind = new.as_str(), "detected the host's kind");
        }
        _ => {}
    }
    if let Some(problem) = &now.problem
        && before.and_then(|b| b.problem.as_ref()) != Some(problem)
    {
        tracing::warn!(host = name, %problem, "the engine's report about itself is not used");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
