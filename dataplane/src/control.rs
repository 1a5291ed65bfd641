//! The link to the control plane: a supervised watch of the policy stream
//! and a periodic status report.
//!
//! The watch is the only writer of the [`PolicyStore`]. It reconnects with
//! jittered exponential backoff whenever the stream breaks; meanwhile the
//! data plane serves on its last good snapshot. Nothing on the request path
//! waits on this module.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oqp_proto::policy::v1::{
    NodeHello, NodeReport, PolicySnapshot, ReportAck, policy_service_client::PolicyServiceClient,
};
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request, Status};

use crate::snapshot::{Offer, PolicyStore};

/// Where and how to reach the control plane.
#[derive(Clone)]
pub struct ControlOptions {
    /// `http://host:port` or `https://host:port`.
    pub url: String,
    /// This node's name.
    pub node: String,
    /// The node token presented in metadata.
    pub token: Option<String>,
    /// A CA certificate (PEM) to trust for an https URL.
    pub ca_file: Option<PathBuf>,
}

impl std::fmt::Debug for ControlOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlOptions")
            .field("url", &self.url)
            .field("node", &self.node)
            .field("token", &self.token.as_ref().map(|_| "…"))
            .field("ca_file", &self.ca_file)
            .finish()
    }
}

/// Why the data plane could not start talking to the control plane.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The URL or TLS settings are unusable.
    #[error("control plane address: {0}")]
    Config(String),
    /// The control plane refused this node for good (bad token).
    #[error("control plane refused this node: {0}")]
    Refused(String),
}

/// The observable state of the link, for status and reports.
#[derive(Debug, Default)]
pub struct ControlLink {
    connected: AtomicBool,
    last_error: Mutex<Option<String>>,
    stale: AtomicU64,
    /// When the control plane last polled each host, from its report acks.
    polled: Mutex<HashMap<String, SystemTime>>,
}

impl ControlLink {
    /// Whether a watch stream is open now.
    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    /// The last error seen on the link, if the link is down.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().ok().and_then(|e| e.clone())
    }

    /// The version of the last snapshot the current stream offered below the
    /// one this node holds; 0 when the stream is not stale.
    pub fn stale_version(&self) -> u64 {
        self.stale.load(Ordering::Relaxed)
    }

    /// When the control plane last polled `host`, as its last report ack said.
    pub fn polled(&self, host: &str) -> Option<SystemTime> {
        self.polled.lock().ok()?.get(host).copied()
    }

    /// Takes in what a report ack says of polling.
    pub fn acked(&self, ack: &ReportAck) {
        let polled = ack
            .polled
            .iter()
            .filter_map(|host| {
                let ms = u64::try_from(host.last_checked_unix_ms).ok()?;
                Some((host.name.clone(), UNIX_EPOCH + Duration::from_millis(ms)))
            })
            .collect();
        if let Ok(mut slot) = self.polled.lock() {
            *slot = polled;
        }
    }

    fn up(&self) {
        self.connected.store(true, Ordering::Relaxed);
        if let Ok(mut error) = self.last_error.lock() {
            *error = None;
        }
    }

    fn down(&self, error: String) {
        if self.connected.swap(false, Ordering::Relaxed) {
            tracing::warn!(%error, "lost the control plane; serving on the last good snapshot");
        }
        if let Ok(mut last) = self.last_error.lock() {
            *last = Some(error);
        }
    }
}

type Client = PolicyServiceClient<InterceptedService<Channel, TokenInterceptor>>;

/// The control plane's admin API, on the same lazily connected channel. The
/// HTTP queue-control endpoints call it with the caller's own key, so the
/// control plane makes the authorisation decision; the node token goes too,
/// which is what a control plane with auth off accepts from a data plane on
/// another box.
pub type AdminClient = oqp_proto::admin::v1::admin_service_client::AdminServiceClient<
    InterceptedService<Channel, TokenInterceptor>,
>;

/// Adds the key derived from the node token for the service to every call.
#[derive(Clone)]
pub struct TokenInterceptor(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl std::fmt::Debug for TokenInterceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenInterceptor(…)")
    }
}

impl tonic::service::Interceptor for TokenInterceptor {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(token) = &self.0 {
            request
                .metadata_mut()
                .insert(oqp_proto::NODE_TOKEN_METADATA, token.clone());
        }
        Ok(request)
    }
}

/// Lazily connected clients for the policy service and the admin API.
pub fn clients(options: &ControlOptions) -> Result<(Client, AdminClient), ControlError> {
    let mut endpoint = Endpoint::from_shared(options.url.clone())
        .map_err(|e| ControlError::Config(format!("'{}': {e}", options.url)))?
        .connect_timeout(Duration::from_secs(3))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true);
    if options.url.starts_with("https://") {
        let mut tls = ClientTlsConfig::new().with_webpki_roots();
        if let Some(path) = &options.ca_file {
            let pem = std::fs::read(path).map_err(|e| {
                ControlError::Config(format!("cannot read CA file {}: {e}", path.display()))
            })?;
            tls = tls.ca_certificate(Certificate::from_pem(pem));
        }
        endpoint = endpoint
            .tls_config(tls)
            .map_err(|e| ControlError::Config(e.to_string()))?;
    }
    // Each service gets its own key derived from the token (`node_keys`), never the token.
    let derived = |derive: fn(&str) -> String| match &options.token {
        Some(token) => derive(token).parse().map(Some).map_err(|_| {
            ControlError::Config("a key derived from the node token is not valid metadata".into())
        }),
        None => Ok(None),
    };
    let (grpc, admin) = (
        derived(crate::node_keys::grpc_credential)?,
        derived(crate::node_keys::admin_credential)?,
    );
    let channel = endpoint.connect_lazy();
    Ok((
        PolicyServiceClient::with_interceptor(channel.clone(), TokenInterceptor(grpc)),
        oqp_proto::admin::v1::admin_service_client::AdminServiceClient::with_interceptor(
            channel,
            TokenInterceptor(admin),
        ),
    ))
}

/// Whether a failed call is worth retrying.
fn is_fatal(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unauthenticated | Code::PermissionDenied | Code::Unimplemented
    )
}

/// Follows the policy stream across reconnects.
pub struct Watcher {
    client: Client,
    node: String,
    link: Arc<ControlLink>,
    stream: Option<tonic::Streaming<PolicySnapshot>>,
    backoff: Backoff,
    // The version this node holds, presented when a stream opens.
    held: u64,
    // Whether this stream's staleness was logged already.
    warned_stale: bool,
    // The epoch of this data plane's usage batches, presented when a stream opens.
    usage_epoch: u64,
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl Watcher {
    /// A watcher for `node` on `client`, whose usage batches carry `usage_epoch`.
    pub fn new(client: Client, node: &str, link: Arc<ControlLink>, usage_epoch: u64) -> Self {
        Self {
            client,
            node: node.to_owned(),
            link,
            stream: None,
            backoff: Backoff::default(),
            held: 0,
            warned_stale: false,
            usage_epoch,
        }
    }

    /// The next snapshot, reconnecting as often as needed. Returns an error
    /// only when the control plane refuses this node (`refuse_fatal`).
    pub async fn next(&mut self, refuse_fatal: bool) -> Result<PolicySnapshot, ControlError> {
        loop {
            if self.stream.is_none() {
                let hello = NodeHello {
                    node: self.node.clone(),
                    software_version: env!("CARGO_PKG_VERSION").to_owned(),
                    applied_version: self.held,
                    usage_epoch: self.usage_epoch,
                };
                match self.client.watch_policy(hello).await {
                    Ok(response) => {
                        self.stream = Some(response.into_inner());
                        self.warned_stale = false;
                    }
                    Err(status) => {
                        if is_fatal(&status) && refuse_fatal {
                            return Err(ControlError::Refused(status.message().to_owned()));
                        }
                        if status.code() == tonic::Code::AlreadyExists {
                            // Another data plane holds this node's name: wait until it leaves.
                            tracing::warn!(message = %status.message(), "control plane refused this node for now");
                        }
                        self.link.down(describe(&status));
                        tokio::time::sleep(self.backoff.next_delay()).await;
                        continue;
                    }
                }
            }
            let Some(stream) = self.stream.as_mut() else {
                continue;
            };
            match stream.message().await {
                Ok(Some(snapshot)) => {
                    self.link.up();
                    self.backoff.reset();
                    return Ok(snapshot);
                }
                Ok(None) => self.link.down("the control plane closed the stream".into()),
                Err(status) => self.link.down(describe(&status)),
            }
            self.stream = None;
            tokio::time::sleep(self.backoff.next_delay()).await;
        }
    }

    /// Feeds every later snapshot into `store` until `shutdown`.
    pub async fn run(mut self, store: Arc<PolicyStore>, shutdown: CancellationToken) {
        loop {
            self.held = store.load().version;
            let snapshot = tokio::select! {
                () = shutdown.cancelled() => return,
                next = self.next(false) => match next {
                    Ok(snapshot) => snapshot,
                    Err(_) => continue,
                },
            };
            let version = snapshot.version;
            match store.offer(snapshot) {
                Offer::Applied => {
                    self.link.stale.store(0, Ordering::Relaxed);
                    tracing::info!(version, "applied policy snapshot");
                }
                Offer::Stale => self.stale(version, store.load().version),
                Offer::Rejected(error) => {
                    tracing::error!(version, %error, "rejected policy snapshot; keeping the current one");
                }
            }
        }
    }
}

impl Watcher {
    /// A snapshot not above the one held: the same version again is normal
    /// (a reconnect); a lower one means the control plane is behind this
    /// node (an old control plane whose clock went back), and everything it
    /// sends is ignored until it catches up, which must not go unnoticed.
    fn stale(&mut self, offered: u64, held: u64) {
        if offered == held {
            self.link.stale.store(0, Ordering::Relaxed);
            tracing::debug!(version = offered, "ignored a snapshot already applied");
            return;
        }
        self.link.stale.store(offered, Ordering::Relaxed);
        if !self.warned_stale {
            self.warned_stale = true;
            tracing::error!(offered, held, "{STALE_SNAPSHOTS}");
        } else {
            tracing::debug!(offered, held, "ignored a stale snapshot");
        }
    }
}

fn describe(status: &Status) -> String {
    format!("{:?}: {}", status.code(), status.message())
}

/// How long a stopping data plane keeps reporting until its usage is acknowledged.
pub const FINAL_REPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// Sends `report()` to the control plane every `interval` and whenever the
/// policy changes, until `shutdown`, handing each acknowledgement (with the
/// other nodes' loads) to `on_ack`. Failures only mark the link down. On
/// `shutdown` it goes on reporting until `settled()` (every usage batch
/// acknowledged, or refused for good), for at most [`FINAL_REPORT_TIMEOUT`],
/// with a backoff between tries, or until the control plane is found
/// unreachable or refuses the batch.
pub async fn report_loop(
    mut client: Client,
    store: Arc<PolicyStore>,
    interval: Duration,
    report: impl Fn() -> NodeReport,
    on_ack: impl Fn(oqp_proto::policy::v1::ReportAck),
    settled: impl Fn() -> bool,
    shutdown: CancellationToken,
) {
    let mut changed = store.subscribe();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            _ = ticker.tick() => {}
            _ = changed.changed() => {}
        }
        let call = client.report_status(report());
        match tokio::time::timeout(interval.max(Duration::from_secs(2)), call).await {
            Ok(Ok(ack)) => on_ack(ack.into_inner()),
            Ok(Err(status)) => tracing::debug!(error = %describe(&status), "report failed"),
            Err(_) => tracing::debug!("report timed out"),
        }
    }
    // The last reports: the batch sent and not acknowledged, then what was recorded since
    // (the requests that finished while serving drained), so that a graceful stop loses
    // no usage while the control plane answers.
    let deadline = tokio::time::Instant::now() + FINAL_REPORT_TIMEOUT;
    let mut backoff = Backoff::default();
    while !settled() {
        let call = client.report_status(report());
        match tokio::time::timeout_at(deadline, call).await {
            Ok(Ok(ack)) => {
                let ack = ack.into_inner();
                let refused = !ack.usage_refused.is_empty();
                on_ack(ack);
                if refused {
                    // Refused for good: sending it again until the bound would only
                    // delay the stop.
                    break;
                }
            }
            Ok(Err(status)) if status.code() == Code::Unavailable => {
                // Unreachable: waiting out the bound would only delay the stop.
                tracing::debug!(error = %describe(&status), "last report: no control plane");
                break;
            }
            Ok(Err(status)) => {
                tracing::debug!(error = %describe(&status), "last report failed");
            }
            Err(_) => break,
        }
        if settled() {
            break;
        }
        // Not taken yet (the control plane could not write it, say): again after a
        // backoff, never in a loop as fast as the link.
        let retry = tokio::time::Instant::now() + backoff.next_delay();
        if retry >= deadline {
            break;
        }
        tokio::time::sleep_until(retry).await;
    }
    if !settled() {
        tracing::warn!("stopping with usage the control plane has not acknowledged; it is lost");
    }
}

/// Jittered exponential backoff: 100 ms doubling to 10 s, each delay drawn
/// uniformly from its upper half so that restarted data planes spread out.
#[derive(Debug, Default)]
pub struct Backoff {
    attempt: u32,
}

impl Backoff {
    const BASE: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(10);

    /// The next delay.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = Self::BASE
            .saturating_mul(1 << self.attempt.min(16))
            .min(Self::MAX);
        self.attempt = self.attempt.saturating_add(1);
        let half = ceiling / 2;
        half + half.mul_f64(rand::random::<f64>())
    }

    /// Back to the shortest delay, after a success.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// Logged once when the control plane keeps offering older snapshots.
const STALE_SNAPSHOTS: &str = "the control plane sends snapshot versions below the one this node \
     holds, so they are all ignored (did its clock go back?); restart this data plane or upgrade \
     the control plane";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stale_snapshot_message_reads_as_one_sentence() {
        assert!(!STALE_SNAPSHOTS.contains("  "), "{STALE_SNAPSHOTS}");
        assert!(STALE_SNAPSHOTS.contains("node holds, so they are all ignored"));
    }

    #[test]
    fn backoff_grows_jittered_and_caps() {
        let mut backoff = Backoff::default();
        let first = backoff.next_delay();
        assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
        for _ in 0..20 {
            assert!(backoff.next_delay() <= Backoff::MAX);
        }
        let late = backoff.next_delay();
        assert!(late >= Backoff::MAX / 2);
        backoff.reset();
        assert!(backoff.next_delay() <= Duration::from_millis(100));
    }
}
