//! Connection caps: how many client connections are open, in all and per
//! client address, shared by the main listener and every injection listener.
//!
//! A connection over a cap is closed as soon as it is accepted: the accept
//! loop never stops accepting, so a flood of idle sockets from one address
//! cannot make `accept` fail for everyone else.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::policy::ConnectionLimits;

/// The open connections of one data plane.
#[derive(Debug, Default)]
pub struct Connections {
    inner: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    total: u32,
    /// Open connections by address; an address with none has no entry, so
    /// the map never holds more entries than the global cap.
    per_ip: HashMap<IpAddr, u32>,
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `proxy.max_connections` are open.
    Total,
    /// `proxy.max_connections_per_ip` are open from this address.
    PerIp,
}

/// One counted connection; dropping it uncounts it.
#[derive(Debug)]
pub struct Slot {
    connections: Arc<Connections>,
    key: IpAddr,
}

impl Connections {
    /// Counts a new connection from `peer`, or refuses it when a cap is
    /// reached.
    pub fn admit(
        self: &Arc<Self>,
        peer: IpAddr,
        limits: &ConnectionLimits,
    ) -> Result<Slot, Refusal> {
        let key = bucket(peer);
        let mut counts = self.lock();
        if counts.total >= limits.max_connections {
            return Err(Refusal::Total);
        }
        let from_peer = counts.per_ip.entry(key).or_insert(0);
        if *from_peer >= limits.max_per_ip {
            return Err(Refusal::PerIp);
        }
        *from_peer += 1;
        counts.total += 1;
        Ok(Slot {
            connections: self.clone(),
            key,
        })
    }

    /// Connections open now.
    pub fn open(&self) -> u32 {
        self.lock().total
    }

    fn lock(&self) -> MutexGuard<'_, Counts> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut counts = self.connections.lock();
        counts.total = counts.total.saturating_sub(1);
        if let Some(from_peer) = counts.per_ip.get_mut(&self.key) {
            *from_peer = from_peer.saturating_sub(1);
            if *from_peer == 0 {
                counts.per_ip.remove(&self.key);
            }
        }
    }
}

/// The address a per-address cap counts: an IPv4 address (also when mapped
/// into IPv6), or the /64 of an IPv6 address, which one machine can fill
/// with addresses of its own.
fn bucket(peer: IpAddr) -> IpAddr {
    match peer {
        IpAddr::V4(_) => peer,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let segments = v6.segments();
                IpAddr::V6(Ipv6Addr::new(
                    segments[0],
                    segments[1],
                    segments[2],
                    segments[3],
                    0,
                    0,
                    0,
                    0,
                ))
            }
        },
    }
}

/// File descriptors the process needs besides client connections (upstream
/// pools, the control-plane link, Redis, the cache): with fewer to spare,
/// `accept` could fail before the connection cap is reached.
const SPARE_DESCRIPTORS: u64 = 512;

/// Raises the process's soft open-file limit to its hard limit, once (as
/// Go's runtime, and so Ollama, does at start): the usual soft limit of 1024
/// would make `accept` fail long before `proxy.max_connections`. Warns when
/// `max_connections` still does not fit.
pub fn raise_open_file_limit(max_connections: u32) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    static RAISED: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    // `None` is "unlimited".
    let soft = *RAISED.get_or_init(|| {
        let mut limit = getrlimit(Resource::Nofile);
        let below_hard = match (limit.current, limit.maximum) {
            (Some(current), Some(maximum)) => current < maximum,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if below_hard {
            limit.current = limit.maximum;
            if let Err(error) = setrlimit(Resource::Nofile, limit) {
                tracing::debug!(%error, "cannot raise the open-file limit");
            }
        }
        getrlimit(Resource::Nofile).current
    });
    if let Some(soft) = soft
        && soft < u64::from(max_connections) + SPARE_DESCRIPTORS
    {
        tracing::warn!(
            open_file_limit = soft,
            max_connections,
            "the open-file limit is too low for proxy.max_connections; \
             raise it (ulimit -n, LimitNOFILE) or lower max_connections"
        );
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn limits(total: u32, per_ip: u32) -> ConnectionLimits {
        ConnectionLimits {
            max_connections: total,
            max_per_ip: per_ip,
            first_request_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
            client_stall_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn caps_per_address_and_in_all_and_frees_on_drop() {
        let connections = Arc::new(Connections::default());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let limits = limits(3, 2);
        let first = connections.admit(a, &limits).unwrap();
        let _second = connections.admit(a, &limits).unwrap();
        assert_eq!(connections.admit(a, &limits).unwrap_err(), Refusal::PerIp);
        let _third = connections.admit(b, &limits).unwrap();
        assert_eq!(connections.admit(b, &limits).unwrap_err(), Refusal::Total);
        drop(first);
        assert_eq!(connections.open(), 2);
        assert!(connections.admit(a, &limits).is_ok());
    }

    #[test]
    fn ipv6_counts_by_slash_64_and_mapped_ipv4_as_ipv4() {
        let connections = Arc::new(Connections::default());
        let limits = limits(10, 1);
        let _one = connections
            .admit("2001:db8:1:2::1".parse().unwrap(), &limits)
            .unwrap();
        assert_eq!(
            connections
                .admit("2001:db8:1:2:ffff::9".parse().unwrap(), &limits)
                .unwrap_err(),
            Refusal::PerIp
        );
        assert!(
            connections
                .admit("2001:db8:1:3::1".parse().unwrap(), &limits)
                .is_ok()
        );
        let _v4 = connections
            .admit("192.0.2.7".parse().unwrap(), &limits)
            .unwrap();
        assert_eq!(
            connections
                .admit("::ffff:192.0.2.7".parse().unwrap(), &limits)
                .unwrap_err(),
            Refusal::PerIp
        );
    }
}
