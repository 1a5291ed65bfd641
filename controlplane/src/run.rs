//! Start-up and shutdown of a control plane: load the config, build the hub,
//! load the key store (and start its expiry timer), serve gRPC, and
//! optionally run a data plane in the same process (single-box mode).
//!
//! Around the hub run two background tasks: the host [`poller`] (after a
//! start-up probe of every host, so that the first snapshot already knows
//! what each host has) and the [`webhooks`] sender. An enabled webhook URL
//! passes the SSRF check before anything starts, and again on each reload
//! that changes it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use oqp_dataplane::DataPlane;
use oqp_dataplane::control::ControlOptions;
use oqp_proto::admin::v1::admin_service_server::AdminServiceServer;
use oqp_proto::policy::v1::policy_service_server::PolicyServiceServer;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Identity, Server, ServerTlsConfig};

use crate::audit::{self, Audit, Outcome, Rotation};
use crate::config::{self, ConfigError, Env, Loaded, Secret};
use crate::grpc::admin::{AdminApi, Reloader};
use crate::grpc::policy::PolicyApi;
use crate::hop_keys::HopKeys;
use crate::hub::{self, Clock, Hub};
use crate::incoming;
use crate::keystore::{KeyStore, StoreError};
use crate::node_credentials::NodeCredentials;
use crate::node_token;
use crate::outbound::Outbound;
use crate::poller;
use crate::usage::UsageStore;
use crate::webhooks::{self, SsrfError};

/// How to start a control plane.
#[derive(Debug)]
pub struct Options {
    /// The config file (re-read on reload).
    pub config_path: PathBuf,
    /// The environment overrides apply from.
    pub env: Env,
    /// A listener to serve gRPC on instead of `control_plane.listen` (tests).
    pub listener: Option<TcpListener>,
    /// Also run a data plane in this process, node `local`.
    pub with_dataplane: bool,
    /// For the in-process data plane: a listener instead of `proxy.host:port`.
    pub dataplane_listener: Option<TcpListener>,
    /// The clock snapshot versions start from; `None` = the system's (tests
    /// set one back).
    pub clock: Option<Clock>,
}

/// Why a control plane could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The config file is missing or invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A listener could not be bound, or TLS material read.
    #[error("{0}")]
    Io(String),
    /// The in-process data plane failed.
    #[error("in-process data plane: {0}")]
    DataPlane(#[from] oqp_dataplane::StartError),
    /// The key store exists but cannot be read or is corrupt.
    #[error(transparent)]
    KeyStore(#[from] StoreError),
    /// The webhook URL failed the SSRF check.
    #[error(transparent)]
    Webhook(#[from] SsrfError),
    /// No host answered the start-up probe and
    /// `routing.require_host_at_start` is true.
    #[error(
        "routing start-up probe: no Ollama host responded to /api/tags ({hosts}). Check that at \
         least one host in ollama.hosts is reachable, or set routing.require_host_at_start: false \
         to start anyway."
    )]
    NoHostAtStart {
        /// The names of the hosts probed, comma-separated.
        hosts: String,
    },
}

impl StartError {
    /// The process exit code: 2 for config errors, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            StartError::Config(error) => error.exit_code(),
            _ => 1,
        }
    }
}

/// A running control plane.
pub struct ControlPlane {
    hub: Arc<Hub>,
    audit: Arc<Audit>,
    keys: Arc<KeyStore>,
    addr: SocketAddr,
    node_token: Secret,
    reload: Reloader,
    shutdown: CancellationToken,
    tasks: JoinSet<()>,
    dataplane: Option<DataPlane>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("addr", &self.addr)
            .field("hub", &self.hub)
            .field("keys", &self.keys)
            .field("dataplane", &self.dataplane)
            .finish_non_exhaustive()
    }
}

impl ControlPlane {
    /// Loads the config, starts serving gRPC and, if asked, a data plane.
    pub async fn start(options: Options) -> Result<Self, StartError> {
        let Loaded { config, warnings } = config::load_file(&options.config_path, &options.env)?;
        for warning in &warnings {
            tracing::warn!("config: {warning}");
        }
        webhooks::ssrf::check(&config.webhooks).await?;
        let listener = match options.listener {
            Some(listener) => listener,
            None => TcpListener::bind(&config.control_plane.listen)
                .await
                .map_err(|e| {
                    StartError::Io(format!(
                        "cannot listen on {}: {e}",
                        config.control_plane.listen
                    ))
                })?,
        };
        let addr = listener
            .local_addr()
            .map_err(|e| StartError::Io(e.to_string()))?;
        if !addr.ip().is_loopback() && config.control_plane.tls.is_none() {
            tracing::warn!(%addr, "the control plane listens beyond loopback without TLS; snapshots (and upstream cloud keys) travel in clear");
        }
        let tls = match &config.control_plane.tls {
            Some(tls) => {
                let cert = std::fs::read(&tls.cert).map_err(|e| {
                    StartError::Io(format!("cannot read {}: {e}", tls.cert.display()))
                })?;
                let key = std::fs::read(&tls.key).map_err(|e| {
                    StartError::Io(format!("cannot read {}: {e}", tls.key.display()))
                })?;
                Some(ServerTlsConfig::new().identity(Identity::from_pem(cert, key)))
            }
            None => None,
        };
        let state_dir = config.control_plane.state_dir.clone();
        // Read even when a token is configured: a reload may unset it.
        let local_token = node_token::load_or_mint(&state_dir).map_err(StartError::Io)?;
        let node_token = config
            .control_plane
            .node_token
            .clone()
            .unwrap_or_else(|| local_token.clone());
        check_shared_cache(&config).await?;
        let saved_version = hub::version::read(&state_dir);
        let hub = Hub::starting(
            config,
            options.clock.unwrap_or_else(Clock::system),
            saved_version,
        );
        // A store that exists but does not load stops the start: serving
        // without it would silently lock out every client it holds.
        let keys = KeyStore::load(&state_dir, hub.clone())?;
        let hop_keys = Arc::new(
            HopKeys::load_or_mint(&state_dir)
                .map_err(|error| StartError::Io(format!("hop keys: {error}")))?,
        );
        let credentials = Arc::new(
            NodeCredentials::load(&state_dir)
                .map_err(|error| StartError::Io(format!("node credentials: {error}")))?,
        );
        let usage = UsageStore::load(&state_dir, std::time::SystemTime::now())
            .map_err(|error| StartError::Io(format!("usage totals: {error}")))?;
        let audit = Audit::open(&state_dir, rotation(&hub.config()));
        audit.observe({
            let webhooks = hub.webhooks().clone();
            Arc::new(move |entry| {
                webhooks.notify(webhooks::audit_notice(entry));
            })
        });
        let outbound = Outbound::new();
        probe_hosts(&hub, &outbound).await?;
        let reload: Reloader = {
            let hub = hub.clone();
            let keys = keys.clone();
            let audit = audit.clone();
            let path = options.config_path.clone();
            let env = options.env.clone();
            Arc::new(move || {
                let Loaded {
                    config,
                    mut warnings,
                } = config::load_file(&path, &env).map_err(|e| e.to_string())?;
                // The URL in force passed at start-up (or at an earlier
                // reload); only a changed one needs resolving again.
                if config.webhooks != hub.config().webhooks {
                    webhooks::ssrf::check_blocking(&config.webhooks)
                        .map_err(|e| format!("webhooks.url: {e}"))?;
                }
                warnings.extend(keys.warnings(&config));
                audit.set_rotation(rotation(&config));
                let version = hub.set_config(config);
                Ok((version, warnings))
            })
        };

        let shutdown = CancellationToken::new();
        let mut tasks = JoinSet::new();
        // The data plane's limits on its listeners hold here too ([`incoming`]); the ping
        // interval is fixed at start, from the connection timeouts then.
        let ping = incoming::ping_interval(&incoming::limits(&hub.config()));
        let mut server = Server::builder()
            .http2_keepalive_interval(Some(ping))
            .http2_keepalive_timeout(Some(ping));
        // Both ports' connections in one process need descriptors to spare.
        let max_connections = hub.config().proxy.max_connections;
        oqp_dataplane::connections::raise_open_file_limit(if options.with_dataplane {
            max_connections.saturating_mul(2)
        } else {
            max_connections
        });
        if let Some(tls) = tls {
            server = server
                .tls_config(tls)
                .map_err(|e| StartError::Io(format!("TLS: {e}")))?;
        }
        let router = server
            .add_service(PolicyServiceServer::new(
                PolicyApi::new(
                    hub.clone(),
                    usage.clone(),
                    local_token,
                    (credentials.clone(), hop_keys),
                    shutdown.clone(),
                )
                .with_audit(audit.clone()),
            ))
            .add_service(AdminServiceServer::new(
                AdminApi::new(
                    hub.clone(),
                    keys.clone(),
                    credentials,
                    usage.clone(),
                    reload.clone(),
                    shutdown.clone(),
                )
                .with_audit(audit.clone()),
            ));
        let stop = shutdown.clone();
        let incoming = incoming::accept(listener, hub.clone());
        tasks.spawn(async move {
            if let Err(error) = router
                .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
                .await
            {
                tracing::error!(%error, "gRPC server failed");
            }
        });
        tasks.spawn(keys.clone().run_expiry(audit.clone(), shutdown.clone()));
        if let Some(sender) = hub.webhooks().sender(outbound.clone(), shutdown.clone()) {
            tasks.spawn(sender);
        }
        tasks.spawn(crate::readers::balances::run(
            hub.clone(),
            usage.clone(),
            outbound.clone(),
            shutdown.clone(),
        ));
        tasks.spawn(crate::readers::jwks::run(
            hub.clone(),
            outbound.clone(),
            shutdown.clone(),
        ));
        tasks.spawn(poller::run(hub.clone(), outbound, shutdown.clone()));
        tasks.spawn(hub::version::persist(
            hub.clone(),
            state_dir.clone(),
            shutdown.clone(),
        ));
        tracing::info!(%addr, version = hub.current().version, "control plane serving");

        let dataplane = if options.with_dataplane {
            let scheme = if hub.config().control_plane.tls.is_some() {
                "https"
            } else {
                "http"
            };
            let local = if addr.ip().is_unspecified() {
                SocketAddr::new([127, 0, 0, 1].into(), addr.port())
            } else {
                addr
            };
            let control = ControlOptions {
                url: format!("{scheme}://{local}"),
                node: "local".to_owned(),
                token: Some(node_token.expose().to_owned()),
                ca_file: hub
                    .config()
                    .control_plane
                    .tls
                    .as_ref()
                    .map(|tls| tls.cert.clone()),
            };
            Some(
                DataPlane::start(oqp_dataplane::Options {
                    control,
                    listener: options.dataplane_listener,
                    report_interval: Duration::from_secs(1),
                    log_level: None,
                })
                .await?,
            )
        } else {
            None
        };

        Ok(Self {
            hub,
            audit,
            keys,
            addr,
            node_token,
            reload,
            shutdown,
            tasks,
            dataplane,
        })
    }

    /// Where gRPC is served.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The node token data planes present at start (`control_plane.node_token`, else the
    /// control plane's own, [`node_token`]), for a data plane started beside it.
    pub fn node_token(&self) -> &str {
        self.node_token.expose()
    }

    /// The shared state.
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    /// The key store.
    pub fn keys(&self) -> &Arc<KeyStore> {
        &self.keys
    }

    /// The in-process data plane, in single-box mode.
    pub fn dataplane(&self) -> Option<&DataPlane> {
        self.dataplane.as_ref()
    }

    /// The audit trail.
    pub fn audit(&self) -> &Arc<Audit> {
        &self.audit
    }

    /// Re-reads the config file (on SIGHUP; recorded as done by `local`).
    /// An invalid file changes nothing.
    pub fn reload(&self) -> Result<u64, String> {
        let reloaded = (self.reload)();
        let (target, outcome, reason) = match &reloaded {
            Ok((version, _)) => (format!("version {version}"), Outcome::Ok, String::new()),
            Err(error) => (String::new(), Outcome::Refused, error.clone()),
        };
        self.audit.record(
            audit::LOCAL,
            None,
            "config.reload",
            &target,
            outcome,
            &reason,
        );
        match reloaded {
            Ok((version, warnings)) => {
                for warning in warnings {
                    tracing::warn!("config: {warning}");
                }
                tracing::info!(version, "config reloaded");
                Ok(version)
            }
            Err(error) => {
                tracing::error!("config reload refused, keeping the current config:\n{error}");
                Err(error)
            }
        }
    }

    /// Stops the data plane (if any), then gRPC.
    pub async fn shutdown(mut self) {
        if let Some(dataplane) = self.dataplane.take() {
            dataplane.shutdown().await;
        }
        self.shutdown.cancel();
        while self.tasks.join_next().await.is_some() {}
    }
}

/// The audit trail's rotation, from `control_plane.audit`.
fn rotation(config: &config::Config) -> Rotation {
    Rotation {
        max_bytes: config
            .control_plane
            .audit
            .max_file_mb
            .saturating_mul(1024 * 1024),
        keep_files: config.control_plane.audit.keep_files,
    }
}

/// The start-up probe: every host at once, before the first snapshot is
/// served. When none answers, start anyway (loudly: `GetStatus` warns too)
/// unless `routing.require_host_at_start` asks to refuse.
async fn probe_hosts(hub: &Hub, client: &Outbound) -> Result<(), StartError> {
    let config = hub.config();
    if poller::probe_all(hub, client).await > 0 {
        return Ok(());
    }
    let hosts = config
        .ollama
        .hosts
        .iter()
        .map(|host| host.name.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    if config.routing.require_host_at_start {
        return Err(StartError::NoHostAtStart { hosts });
    }
    tracing::error!(
        %hosts,
        "NO OLLAMA HOST ANSWERED THE START-UP PROBE (/api/tags). Starting anyway: requests are \
         tried on every host until one answers a poll. Set routing.require_host_at_start: true \
         to refuse to start instead."
    );
    Ok(())
}

/// With a shared (Redis) embedding cache, the control plane checks the
/// backend at start too: a typo in the URL is reported once, here, rather
/// than by every data plane.
async fn check_shared_cache(config: &config::Config) -> Result<(), StartError> {
    let cache = &config.embedding_cache;
    let config::CacheBackend::Redis(url) = &cache.backend else {
        return Ok(());
    };
    if !cache.enabled {
        return Ok(());
    }
    let settings = oqp_dataplane::policy::CacheSettings {
        enabled: true,
        backend: oqp_dataplane::policy::CacheBackend::Redis(url.clone()),
        ttl: cache.ttl,
        max_entry_bytes: cache.max_entry_bytes,
        key_prefix: cache.key_prefix.clone(),
        connect_timeout: cache.connect_timeout,
        max_memory_bytes: cache.max_memory_mb.saturating_mul(1024 * 1024),
        per_client: cache.per_client,
        max_inputs: usize::try_from(cache.max_inputs).unwrap_or(usize::MAX),
    };
    oqp_dataplane::cache::connect(&settings)
        .await
        .map(drop)
        .map_err(|error| StartError::Io(error.to_string()))
}
