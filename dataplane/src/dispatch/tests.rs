//! The dispatcher's lifecycle on tokio's paused time: a request that leaves
//! while it waits, a grant to a client that has just left, a failover that
//! waits again, expiry and revocation. Each ends with the slots and the queue
//! as they should be, so that a leak shows as a request that cannot run.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use oqp_proto::policy::v1 as wire;
use tokio_util::sync::CancellationToken;

use super::{Dispatcher, Grant, Pending, Request};
use crate::error::ProxyError;
use crate::policy::Policy;
use crate::scheduler::{Ask, Tier};

const MAX_WAIT: Duration = Duration::from_secs(5);

/// A snapshot of `version` with one slot on each of `hosts` (all healthy, model `m`
/// installed) and the clients `clients`.
fn policy(version: u64, hosts: &[&str], clients: &[&str]) -> Policy {
    let tier = wire::TierSettings {
        max_depth: 16,
        max_wait_ms: MAX_WAIT.as_millis() as u64,
        ..Default::default()
    };
    Policy::try_from(wire::PolicySnapshot {
        version,
        listener: Some(wire::Listener {
            host: "127.0.0.1".into(),
            port: 0,
        }),
        proxy: Some(wire::ProxySettings {
            max_concurrent: 8,
            ..Default::default()
        }),
        queue: Some(wire::QueueSettings {
            high: Some(tier),
            normal: Some(tier),
            low: Some(tier),
            ..Default::default()
        }),
        clients: clients
            .iter()
            .enumerate()
            .map(|(i, id)| wire::Client {
                client_id: (*id).to_owned(),
                key_sha256: vec![i as u8 + 1; 32],
                ..Default::default()
            })
            .collect(),
        hosts: hosts
            .iter()
            .map(|name| wire::Host {
                name: (*name).into(),
                url: "http://127.0.0.1:1".into(),
                healthy: true,
                max_concurrent: 1,
                installed_models: vec!["m".into()],
                loaded_models: vec!["m".into()],
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    })
    .unwrap()
}

fn request(client: &str) -> Request {
    Request {
        ask: Ask {
            client: Arc::from(client),
            member: None,
            tier: Tier::Normal,
            bytes: 0,
            model: Some(Arc::from("m")),
            affinity: None,
        },
        verified: true,
    }
}

/// A request that runs at once.
async fn run(dispatcher: &Arc<Dispatcher>, client: &str) -> Grant {
    let pending = dispatcher.admit(request(client)).unwrap();
    assert!(pending.immediate, "{client} should have run at once");
    pending.granted().await.unwrap()
}

/// A request that has to wait.
fn wait(dispatcher: &Arc<Dispatcher>, client: &str) -> Pending {
    let pending = dispatcher.admit(request(client)).unwrap();
    assert!(!pending.immediate, "{client} should have waited");
    pending
}

fn host_of(grant: &Grant) -> &str {
    &grant.lease.host().unwrap().name
}

#[tokio::test(start_paused = true)]
async fn a_request_that_leaves_while_waiting_leaves_nothing_behind() {
    let dispatcher = Dispatcher::new(&policy(1, &["gpu"], &["a", "b", "c"]));
    let a = run(&dispatcher, "a").await;
    let b = wait(&dispatcher, "b");
    assert_eq!(dispatcher.total_depth(), 1);

    drop(b);
    assert_eq!(dispatcher.total_depth(), 0);
    assert_eq!(dispatcher.slots_in_use("gpu"), 1);

    drop(a);
    assert_eq!(dispatcher.slots_in_use("gpu"), 0);
    let c = run(&dispatcher, "c").await;
    assert_eq!(host_of(&c), "gpu");
}

#[tokio::test(start_paused = true)]
async fn a_grant_to_a_client_that_has_just_left_frees_its_slot() {
    let dispatcher = Dispatcher::new(&policy(1, &["gpu"], &["a", "b", "c"]));
    let a = run(&dispatcher, "a").await;
    let b = wait(&dispatcher, "b");

    // A's slot frees: B is granted, but its client is gone before it reads the grant.
    drop(a);
    assert_eq!(dispatcher.total_depth(), 0);
    assert_eq!(dispatcher.slots_in_use("gpu"), 1, "the slot is B's");
    drop(b);

    assert_eq!(
        dispatcher.slots_in_use("gpu"),
        0,
        "B's unclaimed grant held on"
    );
    let c = run(&dispatcher, "c").await;
    assert_eq!(host_of(&c), "gpu");
}

#[tokio::test(start_paused = true)]
async fn a_failed_over_request_waits_again_and_takes_the_next_free_slot() {
    let dispatcher = Dispatcher::new(&policy(1, &["gpu1", "gpu2"], &["a", "b", "c"]));
    let a = run(&dispatcher, "a").await;
    let b = run(&dispatcher, "b").await;
    let (failed, busy) = if host_of(&a) == "gpu1" {
        (a, b)
    } else {
        (b, a)
    };
    assert_eq!(host_of(&failed), "gpu1");

    // gpu1 failed this request before any byte; gpu2 is busy: it waits again.
    let tried = vec![Arc::<str>::from("gpu1")];
    let moving = tokio::spawn({
        let dispatcher = dispatcher.clone();
        async move {
            let mut lease = failed.lease;
            let moved = dispatcher
                .fail_over_wait(&mut lease, &tried, false, Duration::from_secs(60))
                .await;
            (moved, lease)
        }
    });
    while dispatcher.total_depth() == 0 {
        tokio::task::yield_now().await;
    }
    // It holds nothing while it waits: the failed host's slot is free for others.
    assert_eq!(dispatcher.slots_in_use("gpu1"), 0);
    let c = run(&dispatcher, "c").await;
    assert_eq!(host_of(&c), "gpu1");

    drop(busy);
    let (moved, lease) = moving.await.unwrap();
    assert!(moved);
    assert_eq!(lease.host().unwrap().name.as_ref(), "gpu2");
    assert_eq!(dispatcher.total_depth(), 0);
    drop(lease);
    drop(c);
    assert_eq!(dispatcher.slots_in_use("gpu1"), 0);
    assert_eq!(dispatcher.slots_in_use("gpu2"), 0);
}

#[tokio::test(start_paused = true)]
async fn a_request_waiting_past_its_tier_s_max_wait_expires() {
    let dispatcher = Dispatcher::new(&policy(1, &["gpu"], &["a", "b", "c"]));
    let shutdown = CancellationToken::new();
    let timer = tokio::spawn(dispatcher.clone().run_timer(shutdown.clone()));
    let a = run(&dispatcher, "a").await;
    let started = tokio::time::Instant::now();
    let b = wait(&dispatcher, "b");

    let answer = b.granted().await;
    assert!(matches!(answer, Err(ProxyError::Expired)), "{answer:?}");
    assert!(started.elapsed() >= MAX_WAIT);
    assert_eq!(dispatcher.total_depth(), 0);

    // The slot was never B's: it frees with A.
    drop(a);
    let c = run(&dispatcher, "c").await;
    assert_eq!(host_of(&c), "gpu");
    shutdown.cancel();
    timer.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_revoked_client_s_waiting_request_is_refused() {
    let dispatcher = Dispatcher::new(&policy(1, &["gpu"], &["a", "b", "c"]));
    let a = run(&dispatcher, "a").await;
    let b = wait(&dispatcher, "b");
    let c = wait(&dispatcher, "c");

    // The next snapshot no longer has B's key.
    dispatcher.apply(&policy(2, &["gpu"], &["a", "c"]));
    let answer = b.granted().await;
    assert!(matches!(answer, Err(ProxyError::KeyRevoked)), "{answer:?}");
    assert_eq!(dispatcher.total_depth(), 1, "C still waits");

    drop(a);
    let c = c.granted().await.unwrap();
    assert_eq!(host_of(&c), "gpu");
}
