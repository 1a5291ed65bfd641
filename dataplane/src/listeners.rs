//! Injection listeners: extra ports whose requests carry a configured
//! client's identity, opened and closed live as snapshots change.
//!
//! A listener that cannot be bound (its port is taken) is retried with
//! jittered exponential backoff for as long as the snapshot asks for it, and
//! reported meanwhile (`apply_errors` in the node's report).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::app::App;
use crate::auth::ListenerKind;
use crate::control::Backoff;
use crate::policy::InjectionListener;
use crate::server;
use crate::supervise;

/// Keeps the open injection listeners equal to the current snapshot's, until
/// `shutdown`.
pub async fn run(app: Arc<App>, shutdown: CancellationToken) {
    let mut listeners = Listeners::default();
    let mut backoff = Backoff::default();
    let mut changes = app.store.subscribe();
    loop {
        let version = app.store.load().version;
        let reconcile = listeners.reconcile(&app, &shutdown);
        let all_open =
            supervise::apply_async(&app.store, "injection listeners", version, reconcile).await
                && listeners.failing.is_empty();
        if all_open {
            backoff.reset();
        }
        let retry = async {
            if all_open {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(backoff.next_delay()).await;
        };
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
            () = retry => {}
        }
    }
}

#[derive(Default)]
struct Listeners {
    open: HashMap<InjectionListener, CancellationToken>,
    failing: HashSet<InjectionListener>,
}

impl Listeners {
    /// Opens and closes listeners; each that fails to bind is reported on
    /// its own, so the whole step always succeeds.
    async fn reconcile(
        &mut self,
        app: &Arc<App>,
        shutdown: &CancellationToken,
    ) -> Result<(), String> {
        let wanted = app.store.load().injection_listeners.clone();
        self.open.retain(|listener, stop| {
            let keep = wanted.contains(listener);
            if !keep {
                tracing::info!(addr = %listener.addr, client = %listener.inject_as, "closing injection listener");
                stop.cancel();
            }
            keep
        });
        self.failing.retain(|listener| {
            let keep = wanted.contains(listener);
            if !keep {
                app.store.part_applied(&part(listener));
            }
            keep
        });
        for listener in wanted {
            if self.open.contains_key(&listener) {
                continue;
            }
            let opened = match &listener.tls {
                Some(files) => app.tls.open(files).map(Some).map_err(|e| e.to_string()),
                None => Ok(None),
            };
            let opened = match opened {
                Ok(tls) => server::bind(listener.addr)
                    .await
                    .map(|socket| (socket, tls))
                    .map_err(|e| format!("cannot bind: {e}")),
                Err(error) => Err(error),
            };
            match opened {
                Ok((socket, tls)) => {
                    tracing::info!(addr = %listener.addr, client = %listener.inject_as, "injection listener open");
                    let stop = shutdown.child_token();
                    let drain_app = app.clone();
                    tokio::spawn(server::serve(
                        socket,
                        app.clone(),
                        ListenerKind::Injection {
                            client: listener.inject_as.clone(),
                            trust_users: listener.trust_users,
                        },
                        tls,
                        stop.clone(),
                        move || drain_app.store.load().proxy.drain_timeout,
                    ));
                    app.store.part_applied(&part(&listener));
                    self.failing.remove(&listener);
                    self.open.insert(listener, stop);
                }
                Err(error) => {
                    if self.failing.insert(listener.clone()) {
                        tracing::error!(%error, addr = %listener.addr, client = %listener.inject_as, "injection listener not opened; retrying");
                    } else {
                        tracing::debug!(%error, addr = %listener.addr, "injection listener still not opened");
                    }
                    app.store
                        .part_failed(&part(&listener), format!("{error}; retrying"));
                }
            }
        }
        Ok(())
    }
}

fn part(listener: &InjectionListener) -> String {
    format!(
        "injection listener {} ({})",
        listener.addr, listener.inject_as
    )
}
