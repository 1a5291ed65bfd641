//! The router as the swap rule's placer: which host a model runs on, waits for, or would
//! switch, with hosts whose VRAM holds one 8 GiB model of the three each has installed.

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use super::*;
use crate::policy::{HostKind, ModelSwap, Vram};
use crate::scheduler::{Offer, Requester, SwitchReason, Tier};

const GIB: u64 = 1 << 30;

/// A requester whose switches may drain for a minute.
fn by() -> Requester {
    Requester {
        client: Arc::from("yvonne"),
        group: None,
        tier: Tier::Normal,
        bound: std::time::Duration::from_secs(60),
    }
}

fn host(name: &str, slots: u32, installed: &[&str], resident: &[&str]) -> Arc<Host> {
    sized(name, slots, installed, resident, &[])
}

/// [`host`], with the models of `small` taking 1 GiB instead of 8.
fn sized(
    name: &str,
    slots: u32,
    installed: &[&str],
    resident: &[&str],
    small: &[&str],
) -> Arc<Host> {
    let bytes = |m: &&str| if small.contains(m) { GIB } else { 8 * GIB };
    let url = format!("http://{name}:11434");
    let uri: http::Uri = url.parse().unwrap();
    let models = |list: &[&str]| list.iter().map(|m| normalize_model(m)).collect();
    Arc::new(Host {
        runners: Default::default(),
        engine: Default::default(),
        name: name.into(),
        url,
        scheme: uri.scheme().unwrap().clone(),
        authority: uri.authority().unwrap().clone(),
        weight: 1,
        max_concurrent: slots,
        kind: HostKind::Ollama,
        healthy: true,
        installed: models(installed),
        loaded: models(resident),
        installed_names: Vec::new(),
        loaded_names: Vec::new(),
        last_checked: Some(SystemTime::now()),
        cloud_keys: Vec::new(),
        cloud_accounts: Vec::new(),
        fallback_models: Vec::new(),
        owner: None,
        vram: Vram {
            capacity: Some(10 * GIB),
            resident: resident
                .iter()
                .map(|m| (normalize_model(m), bytes(m)))
                .collect(),
            sizes: installed
                .iter()
                .map(|m| (normalize_model(m), bytes(m)))
                .collect(),
        },
    })
}

fn router(hosts: &[Arc<Host>]) -> Router {
    let mut router = Router::default();
    router.set_swap(ModelSwap {
        unload: false,
        ..ModelSwap::default()
    });
    router.update_hosts(hosts);
    router
}

fn run(offer: Offer<Placement>) -> Placement {
    match offer {
        Offer::Run(placement) => placement,
        other => panic!("not run: {other:?}"),
    }
}

fn cold_host(offer: &Offer<Placement>) -> Option<(String, bool)> {
    match offer {
        Offer::Cold(cold) => Some((cold.host.to_string(), cold.switching)),
        _ => None,
    }
}

#[test]
fn a_model_no_host_has_is_never_held_and_never_enters_the_view() {
    let now = Instant::now();
    let mut router = router(&[host("gpu", 2, &["a", "b"], &["a"])]);
    let placement = run(router.offer(Some("typo"), Strategy::ModelAware, now));
    assert_eq!(placement.reason, RouteReason::Fallback);
    assert!(!placement.loads);
    let stat = &router.swap_stats(now)[0];
    assert_eq!(stat.resident.len(), 1, "{stat:?}");
}

#[test]
fn a_resident_model_runs_and_one_that_does_not_fit_is_cold_on_the_host_that_has_it() {
    let now = Instant::now();
    let mut router = router(&[
        host("gpu", 2, &["a", "b"], &["a"]),
        host("other", 2, &["c"], &["c"]),
    ]);
    assert!(!run(router.offer(Some("a"), Strategy::ModelAware, now)).loads);
    let offer = router.offer(Some("b"), Strategy::ModelAware, now);
    assert_eq!(
        cold_host(&offer),
        Some(("gpu".to_owned(), false)),
        "never the host without b"
    );
}

#[test]
fn the_batch_waits_for_the_host_switching_to_its_model_and_no_second_host_switches() {
    let now = Instant::now();
    let mut router = router(&[
        host("one", 1, &["a", "b"], &["a"]),
        host("two", 1, &["b", "c"], &["c"]),
    ]);
    // a runs on one; b is cold (two is preferred: a free slot) and its switch begins there.
    let _a = run(router.offer(Some("a"), Strategy::ModelAware, now));
    let offer = router.offer(Some("b"), Strategy::ModelAware, now);
    let (host, _) = cold_host(&offer).unwrap();
    assert_eq!(host, "two");
    // c is busy on two meanwhile, so two's switch to b drains.
    let _c = run(router.offer(Some("c"), Strategy::ModelAware, now));
    router.switch("two", "b", now, SwitchReason::Bound, by());
    // one has a free slot? No: a runs there. Its b would need a switch too, but the batch
    // waits for two's switch.
    let offer = router.offer(Some("b"), Strategy::ModelAware, now);
    assert_eq!(cold_host(&offer), Some(("two".to_owned(), true)));
}

#[test]
fn a_busy_host_with_room_for_the_model_is_waited_for_rather_than_a_switch_elsewhere() {
    let now = Instant::now();
    let mut router = router(&[
        sized("one", 1, &["a", "d"], &["a"], &["d"]),
        host("two", 1, &["d", "c"], &["c"]),
    ]);
    let _a = run(router.offer(Some("a"), Strategy::ModelAware, now));
    // d fits beside a on one (busy), and would evict c on two (free): wait for one.
    assert!(matches!(
        router.offer(Some("d"), Strategy::ModelAware, now),
        Offer::Wait
    ));
}

#[test]
fn a_request_that_failed_over_is_counted_on_its_new_host_only() {
    let now = Instant::now();
    let mut router = router(&[
        host("one", 1, &["a", "b"], &["a"]),
        host("two", 1, &["a", "b"], &["a"]),
    ]);
    let first = run(router.offer(Some("a"), Strategy::ModelAware, now));
    let from = first.host.name.clone();
    drop(first);
    let next = router
        .failover_on(
            Some("a"),
            Strategy::ModelAware,
            std::slice::from_ref(&from),
            now,
        )
        .unwrap();
    router.released(&from, "a", now);
    // The host it left has nothing in flight: a switch there drains at once.
    router.switch(&from, "b", now, SwitchReason::Bound, by());
    assert!(matches!(
        router.offer(Some("b"), Strategy::ModelAware, now),
        Offer::Run(_)
    ));
    drop(next);
}

#[test]
fn a_host_being_switched_away_from_a_model_gets_no_failover_for_it() {
    let now = Instant::now();
    let mut router = router(&[
        host("one", 2, &["a", "b"], &["a"]),
        host("two", 2, &["a", "b"], &["a"]),
    ]);
    let _running = run(router.offer(Some("a"), Strategy::ModelAware, now));
    router.switch("two", "b", now, SwitchReason::Bound, by());
    router.switch("one", "b", now, SwitchReason::Bound, by());
    // Both hosts drain a for b: a request for a failing over finds no host for it.
    assert!(
        router
            .failover_on(Some("a"), Strategy::ModelAware, &[], now)
            .is_none()
    );
}
