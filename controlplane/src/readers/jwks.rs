//! The task that keeps the hub's issuer key sets fresh ([`run`]): each source is read at
//! start and when the config changes, again every [`REFRESH_EVERY`], and when a data plane
//! asks for keys it lacks, at most once per the source's `refresh_min_interval` (see
//! [`crate::jwks`], which owns what a key set is and how one is read).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::{JwksSource, JwtConfig};
use crate::hub::Hub;
use crate::jwks::{KeySet, REFRESH_EVERY, describe, fetch, sources};
use crate::outbound::Outbound;

/// Keeps the hub's key sets fresh until `shutdown` (see the module documentation).
pub async fn run(hub: Arc<Hub>, outbound: Outbound, shutdown: CancellationToken) {
    let public_only = Outbound::public_only();
    let mut configs = hub.watch_config();
    // When each source was last read, and the sources a data plane asked for since.
    let mut last: HashMap<JwksSource, Instant> = HashMap::new();
    let mut wanted: HashSet<JwksSource> = HashSet::new();
    loop {
        let config = hub.config();
        let configured = sources(&config);
        let mut by_source: BTreeMap<&JwksSource, &JwtConfig> = BTreeMap::new();
        for (_, jwt) in &configured {
            by_source.entry(&jwt.jwks).or_insert(jwt);
        }
        last.retain(|source, _| by_source.contains_key(source));
        for client_id in hub.take_jwks_wanted() {
            if let Some((_, jwt)) = configured.iter().find(|(id, _)| *id == client_id) {
                wanted.insert(jwt.jwks.clone());
            }
        }
        let mut wake = Instant::now() + REFRESH_EVERY;
        for (source, jwt) in by_source {
            let now = Instant::now();
            let keys = hub.jwks(source);
            let soon =
                wanted.contains(source) || keys.as_ref().is_none_or(|keys| keys.json.is_empty());
            let due = match last.get(source) {
                None => now,
                Some(at) if soon => *at + jwt.refresh_min_interval,
                Some(at) => *at + REFRESH_EVERY,
            };
            if due > now {
                wake = wake.min(due);
                continue;
            }
            let fetched = fetch(jwt, &outbound, &public_only).await;
            last.insert(source.clone(), Instant::now());
            wanted.remove(source);
            let previous = keys.unwrap_or_default();
            let next = match fetched {
                Ok(json) => {
                    if json != previous.json {
                        tracing::info!(source = %describe(source), "issuer keys fetched");
                    }
                    KeySet {
                        json,
                        error: String::new(),
                    }
                }
                Err(error) if previous.json.is_empty() => {
                    tracing::warn!(
                        source = %describe(source),
                        %error,
                        "no issuer keys: tokens of this issuer are refused until a fetch succeeds"
                    );
                    wake = wake.min(Instant::now() + jwt.refresh_min_interval);
                    KeySet {
                        json: String::new(),
                        error: format!("fetching the key set failed: {error}"),
                    }
                }
                Err(error) => {
                    tracing::warn!(
                        source = %describe(source),
                        %error,
                        "issuer keys not refreshed; the keys fetched before stay in force"
                    );
                    previous
                }
            };
            hub.set_jwks(source, next);
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep_until(wake) => {}
            () = hub.jwks_asked() => {}
            changed = configs.changed() => {
                if changed.is_err() {
                    return;
                }
            }
        }
    }
}
