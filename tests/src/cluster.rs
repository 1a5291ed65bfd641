//! A multi-node installation on loopback: one control plane in this process
//! (`with_dataplane: false`, gRPC on `127.0.0.1:0`, its config in a
//! temporary directory) and data planes as separate processes
//! (`oqp-bench dataplane`), one per node name, each on a port it chose
//! itself. A test can SIGKILL a data plane, start it again under the same
//! name (on a new port, which the control plane learns from its report),
//! and stop and restart the control plane on its address.
//!
//! Nothing here sleeps to synchronise: [`Cluster::wait_status`] and
//! [`Cluster::wait_queue_status`] poll the admin API's `GetStatus` and a
//! data plane's `/queue/status` until a condition holds, under a deadline.
//! Every data plane dies with the [`Cluster`] (`kill_on_drop`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use oqp_controlplane::ControlPlane;
use oqp_proto::admin::v1::admin_service_client::AdminServiceClient;
use oqp_proto::admin::v1::{GetStatusRequest, GetStatusResponse};
use tokio::net::TcpListener;
use tonic::metadata::MetadataValue;
use tonic::transport::Endpoint;

use crate::harness;
use crate::load::{Conn, Req};
use crate::procs::{self, Proc};

/// How long a wait helper waits before it fails.
pub const WAIT: Duration = Duration::from_secs(20);

/// A control plane and its data-plane processes, by node name.
#[derive(Debug)]
pub struct Cluster {
    control: Option<ControlPlane>,
    control_addr: SocketAddr,
    config_path: PathBuf,
    bench: PathBuf,
    token_file: Option<PathBuf>,
    admin_key: Option<String>,
    nodes: BTreeMap<String, Proc>,
    dir: tempfile::TempDir,
}

/// What a [`Cluster`] is started with.
#[derive(Debug, Clone)]
pub struct ClusterBuilder {
    bench: PathBuf,
    yaml: String,
    nodes: Vec<String>,
    node_token: Option<String>,
    admin_key: Option<String>,
}

impl ClusterBuilder {
    /// One more data plane, started as node `name` (in the order given).
    pub fn node(mut self, name: &str) -> Self {
        self.nodes.push(name.to_owned());
        self
    }

    /// The node token the data planes present (through `--node-token-file`);
    /// the config must name the same one.
    pub fn node_token(mut self, token: &str) -> Self {
        self.node_token = Some(token.to_owned());
        self
    }

    /// The key the wait helpers present to the admin API and to
    /// `/queue/status` (needed when auth is on).
    pub fn admin_key(mut self, key: &str) -> Self {
        self.admin_key = Some(key.to_owned());
        self
    }

    /// Starts the control plane, then every data plane, and waits until
    /// each has reported its address and applied the current snapshot.
    pub async fn try_start(self) -> anyhow::Result<Cluster> {
        let dir = tempfile::tempdir()?;
        let config_path = dir.path().join("config.yml");
        std::fs::write(&config_path, &self.yaml)?;
        let token_file = match &self.node_token {
            Some(token) => {
                let path = dir.path().join("node-token");
                std::fs::write(&path, token)?;
                Some(path)
            }
            None => None,
        };
        let listener = harness::loopback().await;
        let control_addr = listener.local_addr()?;
        let control = harness::start_control_plane(&config_path, listener).await?;
        // Without a configured token the data planes present the control plane's own.
        let token_file = match token_file {
            Some(path) => Some(path),
            None => {
                let path = dir.path().join("node-token");
                std::fs::write(&path, control.node_token())?;
                Some(path)
            }
        };
        let mut cluster = Cluster {
            control: Some(control),
            control_addr,
            config_path,
            bench: self.bench,
            token_file,
            admin_key: self.admin_key,
            nodes: BTreeMap::new(),
            dir,
        };
        for node in &self.nodes {
            cluster.try_spawn(node).await?;
        }
        cluster.try_wait_ready().await?;
        Ok(cluster)
    }

    /// [`ClusterBuilder::try_start`], panicking on failure (tests).
    pub async fn start(self) -> Cluster {
        match self.try_start().await {
            Ok(cluster) => cluster,
            Err(error) => panic!("the cluster did not start: {error:#}"),
        }
    }
}

impl Cluster {
    /// A cluster on `yaml`, whose data planes run as `bench dataplane`
    /// (tests pass `env!("CARGO_BIN_EXE_oqp-bench")`).
    pub fn builder(bench: impl Into<PathBuf>, yaml: &str) -> ClusterBuilder {
        ClusterBuilder {
            bench: bench.into(),
            yaml: yaml.to_owned(),
            nodes: Vec::new(),
            node_token: None,
            admin_key: None,
        }
    }

    /// Node `node`'s base URL, `http://127.0.0.1:PORT`.
    pub fn url(&self, node: &str) -> String {
        format!("http://{}", self.addr(node))
    }

    /// Where node `node`'s data plane listens.
    pub fn addr(&self, node: &str) -> SocketAddr {
        self.proc(node).addr()
    }

    /// Node `node`'s process id.
    pub fn pid(&self, node: &str) -> u32 {
        self.proc(node).pid()
    }

    /// The control plane's gRPC URL (the same across restarts).
    pub fn control_url(&self) -> String {
        format!("http://{}", self.control_addr)
    }

    /// The control plane, while it runs.
    pub fn control(&self) -> Option<&ControlPlane> {
        self.control.as_ref()
    }

    /// The config file (rewrite it, then reload through
    /// [`Cluster::control`]).
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// The temporary directory the cluster's files live in.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The running nodes' names.
    pub fn nodes(&self) -> Vec<String> {
        self.nodes.keys().cloned().collect()
    }

    /// The end of node `node`'s log, for failure messages.
    pub fn log_tail(&self, node: &str) -> String {
        self.nodes.get(node).map(Proc::log_tail).unwrap_or_default()
    }

    /// Kills node `node`'s data plane with SIGKILL (no drain, no goodbye)
    /// and waits for it to exit.
    pub async fn kill(&mut self, node: &str) {
        let proc = self
            .nodes
            .remove(node)
            .unwrap_or_else(|| panic!("no running node {node}"));
        proc.stop().await;
    }

    /// Starts node `node` again (a new process, the same name; killed first
    /// if it still runs); returns once the control plane has its report
    /// from the new address and it serves the current snapshot. Needs the
    /// control plane running.
    pub async fn restart(&mut self, node: &str) -> SocketAddr {
        if let Some(proc) = self.nodes.remove(node) {
            proc.stop().await;
        }
        self.try_spawn(node)
            .await
            .unwrap_or_else(|e| panic!("node {node} did not start again: {e:#}"));
        self.wait_ready().await;
        self.addr(node)
    }

    /// Stops the control plane; the data planes keep running on their last
    /// snapshot.
    pub async fn stop_control_plane(&mut self) {
        if let Some(control) = self.control.take() {
            control.shutdown().await;
        }
    }

    /// Starts the control plane again on its address, from the config
    /// file, and waits until every data plane is back on it.
    pub async fn start_control_plane(&mut self) {
        assert!(self.control.is_none(), "the control plane is running");
        let deadline = Deadline::new();
        let listener = loop {
            match TcpListener::bind(self.control_addr).await {
                Ok(listener) => break listener,
                Err(error) if deadline.passed() => {
                    panic!(
                        "cannot bind the control plane's {} again: {error}",
                        self.control_addr
                    )
                }
                Err(_) => deadline.pause().await,
            }
        };
        let control = harness::start_control_plane(&self.config_path, listener)
            .await
            .unwrap_or_else(|e| panic!("the control plane did not start again: {e}"));
        self.control = Some(control);
        self.wait_ready().await;
    }

    /// The admin API's `GetStatus`.
    pub async fn status(&self) -> anyhow::Result<GetStatusResponse> {
        let channel = Endpoint::from_shared(self.control_url())?
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(5))
            .connect()
            .await?;
        let key = match &self.admin_key {
            Some(key) => Some(format!("Bearer {key}").parse::<MetadataValue<_>>()?),
            None => None,
        };
        let mut admin =
            AdminServiceClient::with_interceptor(channel, move |mut request: tonic::Request<()>| {
                if let Some(key) = &key {
                    request.metadata_mut().insert("authorization", key.clone());
                }
                Ok(request)
            });
        Ok(admin.get_status(GetStatusRequest {}).await?.into_inner())
    }

    /// Polls `GetStatus` until `condition` holds (at most [`WAIT`]);
    /// returns that status. Panics, naming `what`, at the deadline.
    pub async fn wait_status(
        &self,
        what: &str,
        mut condition: impl FnMut(&GetStatusResponse) -> bool,
    ) -> GetStatusResponse {
        let deadline = Deadline::new();
        loop {
            let status = self.status().await;
            if let Ok(status) = &status
                && condition(status)
            {
                return status.clone();
            }
            if deadline.passed() {
                panic!("waited {WAIT:?} for {what}; last status: {status:#?}");
            }
            deadline.pause().await;
        }
    }

    /// Node `node`'s `/queue/status`, or why it could not be read.
    pub async fn queue_status(&self, node: &str) -> anyhow::Result<serde_json::Value> {
        // Bounded: a data plane that accepts and never answers is an error, not a hang.
        let read = async {
            let mut conn = Conn::open(self.addr(node)).await?;
            conn.send(&Req::get("/queue/status", self.admin_key.as_deref()))
                .await
        };
        let answer = tokio::time::timeout(Duration::from_secs(5), read)
            .await
            .map_err(|_| anyhow::anyhow!("no answer from {node} within 5 s"))??;
        anyhow::ensure!(answer.status.is_success(), "status {}", answer.status);
        Ok(serde_json::from_slice(&answer.body)?)
    }

    /// Polls node `node`'s `/queue/status` until `condition` holds (at most
    /// [`WAIT`]); returns that document. Works without the control plane.
    pub async fn wait_queue_status(
        &self,
        node: &str,
        what: &str,
        mut condition: impl FnMut(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = Deadline::new();
        loop {
            let status = self.queue_status(node).await;
            if let Ok(status) = &status
                && condition(status)
            {
                return status.clone();
            }
            if deadline.passed() {
                panic!(
                    "waited {WAIT:?} for {node}: {what}; last status: {status:#?}\n{node}'s log: {}",
                    self.log_tail(node)
                );
            }
            deadline.pause().await;
        }
    }

    /// Waits until node `edge` knows node `peer`'s current address and can
    /// reach it (the answer to the edge's next report says where the peer
    /// is): from then on it forwards to `peer`.
    pub async fn wait_peer(&self, edge: &str, peer: &str) {
        let url = self.url(peer);
        self.wait_queue_status(edge, &format!("peer {peer} reachable at {url}"), |status| {
            status["node"]["peers"].as_array().is_some_and(|peers| {
                peers.iter().any(|p| {
                    p["node"] == peer && p["url"] == url.as_str() && p["reachable"] == true
                })
            })
        })
        .await;
    }

    /// Waits until every running node holds a watch on the control plane,
    /// has reported from its current address and applied the current
    /// snapshot.
    pub async fn wait_ready(&self) {
        if let Err(error) = self.try_wait_ready().await {
            panic!("{error:#}");
        }
    }

    async fn try_wait_ready(&self) -> anyhow::Result<()> {
        let deadline = Deadline::new();
        loop {
            let status = self.status().await;
            let ready = status.as_ref().is_ok_and(|status| {
                self.nodes.iter().all(|(name, proc)| {
                    status.nodes.iter().any(|node| {
                        node.node == *name
                            && node.connected
                            && node.listen_address == proc.addr().to_string()
                            && node.applied_version == status.snapshot_version
                    })
                })
            });
            if ready {
                return Ok(());
            }
            if deadline.passed() {
                bail!(
                    "waited {WAIT:?} for every data plane to follow the control plane; last status: {status:#?}"
                );
            }
            deadline.pause().await;
        }
    }

    /// Stops every data plane, then the control plane.
    pub async fn shutdown(mut self) {
        for (_, proc) in std::mem::take(&mut self.nodes) {
            proc.stop().await;
        }
        self.stop_control_plane().await;
    }

    async fn try_spawn(&mut self, node: &str) -> anyhow::Result<()> {
        if self.nodes.contains_key(node) {
            bail!("node {node} is already running");
        }
        let proc = procs::spawn_dataplane(
            &self.bench,
            &self.control_url(),
            node,
            self.token_file.as_deref(),
        )
        .await
        .with_context(|| format!("node {node}"))?;
        self.nodes.insert(node.to_owned(), proc);
        Ok(())
    }

    fn proc(&self, node: &str) -> &Proc {
        self.nodes
            .get(node)
            .unwrap_or_else(|| panic!("no running node {node}"))
    }
}

/// The deadline of one wait: [`WAIT`] from its start, re-checked every
/// 20 ms.
#[derive(Debug, Clone, Copy)]
struct Deadline(Instant);

impl Deadline {
    fn new() -> Self {
        Self(Instant::now() + WAIT)
    }

    fn passed(self) -> bool {
        Instant::now() >= self.0
    }

    async fn pause(self) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
