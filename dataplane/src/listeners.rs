//! Injection listeners: extra ports whose requests carry a configured
//! client's identity, opened and closed live as snapshots change.

use std::collections::HashMap;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::app::App;
use crate::policy::InjectionListener;
use crate::server::{self, ListenerKind};

/// Keeps the open injection listeners equal to the current snapshot's, until
/// `shutdown`.
pub async fn run(app: Arc<App>, shutdown: CancellationToken) {
    let mut open: HashMap<InjectionListener, CancellationToken> = HashMap::new();
    let mut changes = app.store.subscribe();
    loop {
        let wanted = app.store.load().injection_listeners.clone();
        open.retain(|listener, stop| {
            let keep = wanted.contains(listener);
            if !keep {
                tracing::info!(addr = %listener.addr, client = %listener.inject_as, "closing injection listener");
                stop.cancel();
            }
            keep
        });
        for listener in wanted {
            if open.contains_key(&listener) {
                continue;
            }
            match server::bind(listener.addr).await {
                Ok(socket) => {
                    tracing::info!(addr = %listener.addr, client = %listener.inject_as, "injection listener open");
                    let stop = shutdown.child_token();
                    let drain_app = app.clone();
                    tokio::spawn(server::serve(
                        socket,
                        app.clone(),
                        ListenerKind::Injection(listener.inject_as.clone()),
                        stop.clone(),
                        move || drain_app.store.load().proxy.drain_timeout,
                    ));
                    open.insert(listener, stop);
                }
                Err(error) => {
                    tracing::error!(%error, client = %listener.inject_as, "injection listener not opened")
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
        }
    }
}
