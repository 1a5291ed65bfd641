//! The other data planes, as this one sees them: where each is reached,
//! the load it last reported (relayed by the control plane in every report
//! acknowledgement), whether it answers, and what this node forwarded to it.
//!
//! A peer that refuses a connection is marked down at once and skipped; a
//! background probe (`GET /health`, backing off from 200 ms to 5 s) clears
//! the mark when it answers again, so no request waits on a dead peer and
//! none is needed to bring it back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use arc_swap::ArcSwap;
use oqp_proto::policy::v1 as wire;
use tokio_util::sync::CancellationToken;

use crate::body;
use crate::hop::{HopKey, Replays};
use crate::placement::{Rotation, Seen, Target, View};
use crate::policy::{Base, Policy};
use crate::router::HostStat;
use crate::upstream::Upstream;

/// Connect timeout toward a peer: they share a LAN, and a peer that does not
/// accept within it is treated as down (the request moves to the next box).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest a pooled hop connection stays idle.
const POOL_IDLE_MAX: Duration = Duration::from_secs(30);
const PROBE_FIRST: Duration = Duration::from_millis(200);
const PROBE_MAX: Duration = Duration::from_secs(5);

/// Every other data plane. See the module documentation.
#[derive(Debug)]
pub struct Peers {
    key: Option<HopKey>,
    replays: Replays,
    client: Upstream,
    /// Ends the background probes with the data plane.
    shutdown: CancellationToken,
    loads: ArcSwap<HashMap<Arc<str>, Load>>,
    state: Mutex<HashMap<Arc<str>, PeerState>>,
    rotation: Mutex<Rotation>,
}

/// One peer's load as it last reported it.
#[derive(Debug, Clone, Default)]
pub struct Load {
    /// Where it is reached, by the control plane's account (configured or reported).
    pub url: Option<Base>,
    /// Whether its policy stream is open.
    pub connected: bool,
    /// How old its last report was when the control plane relayed it.
    pub report_age: Option<Duration>,
    /// Requests waiting in its queues.
    pub waiting: u32,
    /// Slots in use per host.
    pub in_use: HashMap<String, u32>,
}

#[derive(Debug, Default)]
struct PeerState {
    forwarded: u64,
    /// Forwarded and not yet answered in full (live, unlike the reported load).
    outstanding: Arc<AtomicU32>,
    down: bool,
}

/// One peer, for `/queue/status`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PeerStatus {
    /// Its name.
    pub node: String,
    /// Where it is reached, if known.
    pub url: Option<String>,
    /// Whether it answers (no connection refused since its last good probe).
    pub reachable: bool,
    /// Whether its policy stream to the control plane is open, as last relayed.
    pub connected: bool,
    /// Requests forwarded to it since start.
    pub forwarded: u64,
    /// Forwarded requests not answered in full yet.
    pub outstanding: u32,
}

/// Counts one forwarded request until it drops (with the response body).
#[derive(Debug)]
pub struct Outstanding(Arc<AtomicU32>);

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Peers {
    /// Peers of a node whose node token is `token` (which keys the hop), trusting the CA
    /// certificates in the PEM text `ca` (`--ca`) for peers at `https://`. Peers close an
    /// idle connection after `idle_timeout` (`proxy.idle_timeout`, the same for every node):
    /// pooled hop connections are dropped well before that.
    pub fn new(
        token: Option<&str>,
        ca: Option<&[u8]>,
        idle_timeout: Duration,
    ) -> Result<Self, String> {
        let pool_idle = (idle_timeout / 2).min(POOL_IDLE_MAX);
        let client = match ca {
            Some(pem) => Upstream::with_ca(CONNECT_TIMEOUT, pool_idle, pem)?,
            None => Upstream::with_pool(CONNECT_TIMEOUT, pool_idle),
        };
        Ok(Self {
            key: token.and_then(HopKey::new),
            replays: Replays::default(),
            shutdown: CancellationToken::new(),
            client,
            loads: ArcSwap::default(),
            state: Mutex::default(),
            rotation: Mutex::default(),
        })
    }

    /// The key derived from the node token: what hops are keyed by when the control plane
    /// sends no pair keys.
    pub fn key(&self) -> Option<&HopKey> {
        self.key.as_ref()
    }

    /// The key a hop to `to` is signed with: this node's pair key with it, else the node
    /// token's.
    pub fn signing_key(&self, policy: &Policy, to: &str) -> Option<HopKey> {
        policy
            .hop_peers
            .get(to)
            .map(|pair| pair.sign.clone())
            .or_else(|| self.key.clone())
    }

    /// The keys a hop from `edge` may verify with: this node's pair key with it, then the
    /// node token's (which an edge outside the control plane's roster signs with, on the
    /// shared token; a node's own token keys nothing anyone else holds).
    pub fn verifying_keys(&self, policy: &Policy, edge: Option<&str>) -> Vec<HopKey> {
        edge.and_then(|edge| policy.hop_peers.get(edge))
            .map(|pair| pair.verify.clone())
            .into_iter()
            .chain(self.key.clone())
            .collect()
    }

    /// The hop headers accepted lately, which are not accepted again.
    pub fn replays(&self) -> &Replays {
        &self.replays
    }

    /// Stops the background probes (the data plane is shutting down).
    pub fn shut_down(&self) {
        self.shutdown.cancel();
    }

    /// The pooled client hops travel on.
    pub fn client(&self) -> &Upstream {
        &self.client
    }

    /// Takes the loads a report acknowledgement relayed. A node whose address the control
    /// plane does not know (it restarted, and the node has not reported to it yet) keeps the
    /// address last heard: a peer is not lost because the control plane forgot it.
    pub fn update(&self, nodes: Vec<wire::NodeLoad>) {
        let before = self.loads.load();
        let loads = nodes
            .into_iter()
            .map(|load| {
                let name: Arc<str> = Arc::from(load.node);
                let url = Base::parse(&load.url)
                    .ok()
                    .or_else(|| before.get(&name).and_then(|known| known.url.clone()));
                let load = Load {
                    url,
                    connected: load.connected,
                    report_age: (load.report_age_ms > 0)
                        .then(|| Duration::from_millis(load.report_age_ms)),
                    waiting: load.waiting,
                    in_use: load
                        .hosts
                        .into_iter()
                        .map(|host| (host.name, host.slots_in_use))
                        .collect(),
                };
                (name, load)
            })
            .collect();
        self.loads.store(Arc::new(loads));
    }

    /// Where `node` is reached: as the control plane last relayed it, else as configured.
    pub fn url(&self, policy: &Policy, node: &str) -> Option<Base> {
        base_of(&self.loads.load(), policy, node)
    }

    /// The boxes to try for `model`, best first: this node's hosts as its dispatcher holds
    /// them (`local`: waiting, per-host slots), the others' as reported.
    pub fn order(
        &self,
        policy: &Policy,
        local: (u32, Vec<HostStat>),
        model: Option<&str>,
        root: Option<u64>,
    ) -> Vec<Target> {
        let loads = self.loads.load();
        let (local_waiting, local_hosts) = local;
        let state = self.lock();
        let mut view = View::default();
        view.waiting.insert(Target::Local, local_waiting);
        for host in &policy.hosts {
            let stat = local_hosts.iter().find(|stat| stat.name == host.name);
            view.hosts.push(Seen {
                host,
                target: Target::Local,
                in_use: stat.map_or(0, |stat| stat.slots_in_use),
                usable: host.healthy && !stat.is_some_and(|stat| stat.marked_down),
            });
        }
        for host in &policy.remote {
            let Some(owner) = &host.owner else { continue };
            let load = loads.get(owner);
            let peer = state.get(owner);
            let reachable =
                !peer.is_some_and(|peer| peer.down) && base_of(&loads, policy, owner).is_some();
            let target = Target::Peer(owner.clone());
            // What this edge has there now beyond what the last report counted (sent since,
            // or all of it while the control plane is away) waits there too, as far as
            // ranking goes.
            let reported = load.map_or(0, |load| {
                load.waiting + load.in_use.values().copied().sum::<u32>()
            });
            let ours = peer.map_or(0, |peer| peer.outstanding.load(Ordering::Acquire));
            let waiting = load.map_or(0, |load| load.waiting) + ours.saturating_sub(reported);
            view.waiting.insert(target.clone(), waiting);
            view.hosts.push(Seen {
                host,
                target,
                in_use: load
                    .and_then(|load| load.in_use.get(&*host.name).copied())
                    .unwrap_or(0),
                usable: host.healthy && reachable,
            });
        }
        drop(state);
        let mut rotation = self
            .rotation
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let home = root
            .filter(|_| policy.routing.affinity.enabled)
            .map(|root| (root, &*policy.node));
        crate::placement::order_for(&view, model, policy.routing.strategy, &mut rotation, home)
    }

    /// Counts a request on its way to `node` as outstanding until the guard drops.
    pub fn forwarding(&self, node: &Arc<str>) -> Outstanding {
        let mut state = self.lock();
        let peer = state.entry(node.clone()).or_default();
        peer.outstanding.fetch_add(1, Ordering::AcqRel);
        Outstanding(peer.outstanding.clone())
    }

    /// Counts a request `node` received (its connection was made).
    pub fn forwarded(&self, node: &Arc<str>) {
        self.lock().entry(node.clone()).or_default().forwarded += 1;
    }

    /// Marks `node` unreachable and probes it in the background until it answers (or nothing
    /// says where it is any more, or the data plane shuts down).
    pub fn mark_down(self: &Arc<Self>, policy: &Arc<Policy>, node: &Arc<str>) {
        {
            let mut state = self.lock();
            let peer = state.entry(node.clone()).or_default();
            if peer.down {
                return;
            }
            peer.down = true;
        }
        tracing::warn!(%node, "peer data plane unreachable; its hosts are skipped until it answers");
        let peers = self.clone();
        let policy = policy.clone();
        let node = node.clone();
        tokio::spawn(async move {
            let mut delay = PROBE_FIRST;
            loop {
                tokio::select! {
                    () = peers.shutdown.cancelled() => return,
                    () = tokio::time::sleep(delay) => {}
                }
                if peers.url(&policy, &node).is_none() {
                    // Nothing says where it is any more: nothing to probe.
                    if let Some(peer) = peers.lock().get_mut(&node) {
                        peer.down = false;
                    }
                    return;
                }
                if peers.answers(&policy, &node).await {
                    if let Some(peer) = peers.lock().get_mut(&node) {
                        peer.down = false;
                    }
                    tracing::info!(%node, "peer data plane answers again");
                    return;
                }
                delay = (delay * 2).min(PROBE_MAX);
            }
        });
    }

    async fn answers(&self, policy: &Policy, node: &str) -> bool {
        let Some(base) = self.url(policy, node) else {
            return false;
        };
        let Ok(uri) = http::Uri::builder()
            .scheme(base.scheme)
            .authority(base.authority)
            .path_and_query("/health")
            .build()
        else {
            return false;
        };
        let mut request = http::Request::new(body::empty());
        *request.uri_mut() = uri;
        matches!(
            self.client.send(request, CONNECT_TIMEOUT).await,
            Ok(response) if response.status().is_success()
        )
    }

    /// Requests forwarded to each peer since start, for the report.
    pub fn report(&self) -> Vec<wire::PeerForwarded> {
        let mut forwarded: Vec<wire::PeerForwarded> = self
            .lock()
            .iter()
            .map(|(node, peer)| wire::PeerForwarded {
                node: node.to_string(),
                forwarded: peer.forwarded,
            })
            .collect();
        forwarded.sort_by(|a, b| a.node.cmp(&b.node));
        forwarded
    }

    /// Every node the policy lists, and every peer forwarded to, for `/queue/status`.
    pub fn status(&self, policy: &Policy) -> Vec<PeerStatus> {
        let loads = self.loads.load();
        let state = self.lock();
        let mut names: Vec<Arc<str>> = policy
            .nodes
            .iter()
            .map(|info| info.name.clone())
            .chain(state.keys().cloned())
            .filter(|name| *name != policy.node)
            .collect();
        names.sort();
        names.dedup();
        names
            .into_iter()
            .map(|node| {
                let peer = state.get(&node);
                let load = loads.get(&node);
                PeerStatus {
                    url: base_of(&loads, policy, &node)
                        .map(|base| format!("{}://{}", base.scheme, base.authority)),
                    reachable: !peer.is_some_and(|peer| peer.down),
                    connected: load.is_some_and(|load| load.connected),
                    forwarded: peer.map_or(0, |peer| peer.forwarded),
                    outstanding: peer.map_or(0, |peer| peer.outstanding.load(Ordering::Acquire)),
                    node: node.to_string(),
                }
            })
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Arc<str>, PeerState>> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Where `node` is reached: as the control plane last relayed it, else as configured.
fn base_of(loads: &HashMap<Arc<str>, Load>, policy: &Policy, node: &str) -> Option<Base> {
    loads
        .get(node)
        .and_then(|load| load.url.clone())
        .or_else(|| {
            policy
                .nodes
                .iter()
                .find(|info| &*info.name == node)
                .and_then(|info| info.base.clone())
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Node `a`'s policy: its own box and node b's, two slots each, idle.
    fn policy_of_a() -> Policy {
        let mut snapshot = crate::policy::minimal_wire();
        snapshot.node = "a".into();
        snapshot.hosts = ["a", "b"]
            .iter()
            .enumerate()
            .map(|(i, node)| wire::Host {
                name: format!("gpu-{node}"),
                url: format!("http://127.0.0.1:{}", i + 1),
                max_concurrent: 2,
                healthy: true,
                node: (*node).into(),
                ..Default::default()
            })
            .collect();
        snapshot.nodes = ["a", "b"]
            .iter()
            .enumerate()
            .map(|(i, node)| wire::NodeInfo {
                name: (*node).into(),
                url: format!("http://127.0.0.1:{}", i + 11),
            })
            .collect();
        Policy::try_from(snapshot).unwrap()
    }

    fn first(peers: &Peers, policy: &Policy) -> Target {
        peers.order(policy, (0, Vec::new()), None, None)[0].clone()
    }

    #[test]
    fn a_forwarded_request_weighs_on_the_owners_box_only_until_it_is_answered() {
        let policy = policy_of_a();
        let peers = Peers::new(Some("token"), None, Duration::from_secs(60)).unwrap();
        let b: Arc<str> = Arc::from("b");
        let in_flight = peers.forwarding(&b);
        // Not in b's report yet, and still running: b's box is the busier.
        assert_eq!(first(&peers, &policy), Target::Local);
        assert_eq!(first(&peers, &policy), Target::Local);
        drop(in_flight);
        // Answered before any report: both boxes idle again, taking turns.
        let turns = [first(&peers, &policy), first(&peers, &policy)];
        assert!(turns.contains(&Target::Local), "{turns:?}");
        assert!(turns.contains(&Target::Peer(b)), "{turns:?}");
    }

    #[test]
    fn a_peer_address_outlives_a_control_plane_that_forgot_it() {
        let policy = policy_of_a();
        let peers = Peers::new(Some("token"), None, Duration::from_secs(60)).unwrap();
        let load = |url: &str| wire::NodeLoad {
            node: "b".into(),
            url: url.into(),
            ..Default::default()
        };
        peers.update(vec![load("http://127.0.0.1:4321")]);
        // A restarted control plane that b has not reported to yet knows no address for it.
        peers.update(vec![load("")]);
        let base = peers.url(&policy, "b").unwrap();
        assert_eq!(base.authority.as_str(), "127.0.0.1:4321");
        peers.update(vec![load("http://127.0.0.1:5555")]);
        assert_eq!(
            peers.url(&policy, "b").unwrap().authority.as_str(),
            "127.0.0.1:5555"
        );
    }
}
