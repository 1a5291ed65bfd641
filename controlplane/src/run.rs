//! Start-up and shutdown of a control plane: load the config, build the hub,
//! serve gRPC, and optionally run a data plane in the same process
//! (single-box mode).

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
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Identity, Server, ServerTlsConfig};

use crate::config::{self, ConfigError, Env, Loaded};
use crate::grpc::admin::{AdminApi, Reloader};
use crate::grpc::policy::PolicyApi;
use crate::hub::Hub;

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
    addr: SocketAddr,
    reload: Reloader,
    shutdown: CancellationToken,
    tasks: JoinSet<()>,
    dataplane: Option<DataPlane>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("addr", &self.addr)
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
        let node_token = config
            .control_plane
            .node_token
            .as_ref()
            .map(|t| t.expose().to_owned());

        let hub = Hub::new(config);
        let reload: Reloader = {
            let hub = hub.clone();
            let path = options.config_path.clone();
            let env = options.env.clone();
            Arc::new(move || {
                let Loaded { config, warnings } =
                    config::load_file(&path, &env).map_err(|e| e.to_string())?;
                let version = hub.set_config(config);
                Ok((version, warnings))
            })
        };

        let shutdown = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let mut server = Server::builder();
        if let Some(tls) = tls {
            server = server
                .tls_config(tls)
                .map_err(|e| StartError::Io(format!("TLS: {e}")))?;
        }
        let router = server
            .add_service(PolicyServiceServer::new(PolicyApi::new(
                hub.clone(),
                shutdown.clone(),
            )))
            .add_service(AdminServiceServer::new(AdminApi::new(
                hub.clone(),
                reload.clone(),
                shutdown.clone(),
            )));
        let stop = shutdown.clone();
        tasks.spawn(async move {
            let incoming = TcpListenerStream::new(listener);
            if let Err(error) = router
                .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
                .await
            {
                tracing::error!(%error, "gRPC server failed");
            }
        });
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
                token: node_token,
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
                })
                .await?,
            )
        } else {
            None
        };

        Ok(Self {
            hub,
            addr,
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

    /// The shared state.
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    /// The in-process data plane, in single-box mode.
    pub fn dataplane(&self) -> Option<&DataPlane> {
        self.dataplane.as_ref()
    }

    /// Re-reads the config file. An invalid file changes nothing.
    pub fn reload(&self) -> Result<u64, String> {
        match (self.reload)() {
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
