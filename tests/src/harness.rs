//! The test harness: boots the real control plane and data planes on
//! `127.0.0.1:0`, talking gRPC to each other, from a YAML config written to a
//! temporary directory (built with [`ConfigYaml`] from the shapes the tests share).

mod config;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use oqp_controlplane::config::Env;
use oqp_controlplane::{ControlPlane, Options};
use oqp_dataplane::DataPlane;
use oqp_dataplane::control::ControlOptions;
use tokio::net::TcpListener;

pub use config::{ConfigYaml, Host, Key};

/// A control plane with its in-process data plane (node `local`), serving a
/// config written to a temporary directory.
#[derive(Debug)]
pub struct Stack {
    /// The control plane.
    pub control: ControlPlane,
    /// Where the config file lives (see [`Stack::rewrite_and_reload`]).
    pub config_path: PathBuf,
    dir: tempfile::TempDir,
}

impl Stack {
    /// Starts a control plane and its in-process data plane on `yaml`.
    pub async fn start(yaml: &str) -> Stack {
        Self::start_with_env(yaml, Env::empty()).await
    }

    /// Starts with an explicit environment for overrides and key sources.
    pub async fn start_with_env(yaml: &str, env: Env) -> Stack {
        Self::try_start(yaml, env)
            .await
            .unwrap_or_else(|e| panic!("stack failed to start: {e}"))
    }

    /// Starts, returning the error instead of panicking.
    pub async fn try_start(yaml: &str, env: Env) -> Result<Stack, oqp_controlplane::StartError> {
        let dir = tempfile::tempdir().expect("temporary directory");
        let config_path = dir.path().join("config.yml");
        std::fs::write(&config_path, yaml).expect("write config");
        let control = ControlPlane::start(Options {
            config_path: config_path.clone(),
            env,
            listener: Some(loopback().await),
            with_dataplane: true,
            dataplane_listener: Some(loopback().await),
            clock: None,
        })
        .await?;
        Ok(Stack {
            control,
            config_path,
            dir,
        })
    }

    /// The data plane's base URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.proxy_addr())
    }

    /// The data plane's address.
    pub fn proxy_addr(&self) -> SocketAddr {
        self.control
            .dataplane()
            .expect("single-box stack has a data plane")
            .local_addr()
    }

    /// The control plane's gRPC URL.
    pub fn control_url(&self) -> String {
        format!("http://{}", self.control.local_addr())
    }

    /// The temporary directory (state, key files).
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Rewrites the config file and reloads it, as SIGHUP does.
    pub fn rewrite_and_reload(&self, yaml: &str) -> Result<u64, String> {
        std::fs::write(&self.config_path, yaml).expect("rewrite config");
        self.control.reload()
    }

    /// Starts one more data plane, `node`, following this control plane, presenting
    /// `token`, else the control plane's own ([`ControlPlane::node_token`]).
    pub async fn start_dataplane(
        &self,
        node: &str,
        token: Option<&str>,
    ) -> Result<DataPlane, oqp_dataplane::StartError> {
        let token = token.unwrap_or(self.control.node_token());
        start_dataplane(&self.control_url(), node, Some(token)).await
    }

    /// Waits until the in-process data plane serves `version` or newer.
    pub async fn wait_for_version(&self, version: u64) {
        let dataplane = self.control.dataplane().expect("data plane");
        wait_for_version(dataplane, version).await;
    }

    /// Stops everything.
    pub async fn shutdown(self) {
        self.control.shutdown().await;
    }
}

/// Starts a control plane alone (no data plane in its process) on the
/// config at `config_path`, serving gRPC on `listener`.
pub async fn start_control_plane(
    config_path: &std::path::Path,
    listener: TcpListener,
) -> Result<ControlPlane, oqp_controlplane::StartError> {
    ControlPlane::start(Options {
        config_path: config_path.to_path_buf(),
        env: Env::empty(),
        listener: Some(listener),
        with_dataplane: false,
        dataplane_listener: None,
        clock: None,
    })
    .await
}

/// Starts a data plane on `127.0.0.1:0` following `control_url`.
pub async fn start_dataplane(
    control_url: &str,
    node: &str,
    token: Option<&str>,
) -> Result<DataPlane, oqp_dataplane::StartError> {
    start_dataplane_with(control_url, node, token, None).await
}

/// [`start_dataplane`], with a hook for the configured log level.
pub async fn start_dataplane_with(
    control_url: &str,
    node: &str,
    token: Option<&str>,
    log_level: Option<oqp_dataplane::LogLevelHook>,
) -> Result<DataPlane, oqp_dataplane::StartError> {
    DataPlane::start(oqp_dataplane::Options {
        control: ControlOptions {
            url: control_url.to_owned(),
            node: node.to_owned(),
            token: token.map(str::to_owned),
            ca_file: None,
        },
        listener: Some(loopback().await),
        report_interval: Duration::from_millis(200),
        log_level,
    })
    .await
}

/// Waits (on change notifications, not sleeps) until `dataplane` serves
/// `version` or newer.
pub async fn wait_for_version(dataplane: &DataPlane, version: u64) {
    // The queues apply a snapshot just after the store does; waiting on the
    // dispatcher means every part of the node obeys it.
    tokio::time::timeout(
        Duration::from_secs(10),
        dataplane.app().dispatcher.applied(version),
    )
    .await
    .expect("data plane did not apply the snapshot within 10 s");
}

/// A listener on a free loopback port.
pub async fn loopback() -> TcpListener {
    TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0")
}

/// A minimal config for one Ollama host at `url`, auth off.
pub fn basic_config(url: &str) -> String {
    ConfigYaml::new()
        .max_concurrent(2)
        .host(Host::ollama("primary", url))
        .yaml()
}
