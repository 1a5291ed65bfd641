//! Properties of the scheduler under random sequences of operations: byte and depth accounting,
//! conservation of tickets (each admitted payload comes back exactly once), caps, and the order
//! of service (strict tiers, FIFO per client).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;

const CLIENTS: [&str; 4] = ["a", "b", "c", "d"];
const MODELS: [&str; 2] = ["m0", "m1"];

#[derive(Debug, Clone)]
enum Op {
    Enqueue {
        client: usize,
        tier: usize,
        bytes: u64,
        model: usize,
    },
    Cancel(usize),
    /// Dispatch with `0`: nothing placeable, `1`: only `m0`, `2`: everything.
    Next(u8),
    Complete(usize),
    Flush(Option<usize>),
    Advance(u64),
    Expire,
    Pause(usize, bool),
    Cap(usize, u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..4usize, 0..3usize, 0..1500u64, 0..2usize)
            .prop_map(|(client, tier, bytes, model)| Op::Enqueue { client, tier, bytes, model }),
        2 => any::<usize>().prop_map(Op::Cancel),
        4 => (0..3u8).prop_map(Op::Next),
        3 => any::<usize>().prop_map(Op::Complete),
        1 => proptest::option::of(0..3usize).prop_map(Op::Flush),
        2 => (0..3000u64).prop_map(Op::Advance),
        2 => Just(Op::Expire),
        1 => (0..3usize, any::<bool>()).prop_map(|(tier, paused)| Op::Pause(tier, paused)),
        1 => (0..4usize, 0..3u32).prop_map(|(client, cap)| Op::Cap(client, cap)),
    ]
}

fn limits(aging: bool) -> Limits {
    let tier = |max_wait_ms, promote_ms: Option<u64>| TierLimits {
        max_depth: 6,
        max_wait: Duration::from_millis(max_wait_ms),
        promote_after: promote_ms.filter(|_| aging).map(Duration::from_millis),
        high_watermark_pct: 50,
    };
    Limits {
        tiers: [
            tier(4000, None),
            tier(6000, Some(2500)),
            tier(8000, Some(3000)),
        ],
        max_queued_bytes: 5000,
        half_life: Duration::from_secs(2),
    }
}

/// The test's own account of what waits, runs and came back.
#[derive(Default)]
struct Model {
    /// Admitted and not yet handed back: payload → (id, bytes).
    waiting: BTreeMap<u32, (TicketId, u64)>,
    running: Vec<(TicketId, usize)>,
    returned: HashMap<u32, &'static str>,
    caps: [u32; 4],
}

impl Model {
    fn hand_back(&mut self, payload: u32, how: &'static str) {
        assert!(
            self.waiting.remove(&payload).is_some(),
            "{payload} came back ({how}) but was not waiting"
        );
        assert!(
            self.returned.insert(payload, how).is_none(),
            "{payload} came back twice"
        );
    }

    fn collect(&mut self, events: Vec<Expiry<u32>>) {
        for event in events {
            if let Expiry::Expired { payload, .. } = event {
                self.hand_back(payload, "expired");
            }
        }
    }
}

fn client_index(name: &str) -> usize {
    CLIENTS
        .iter()
        .position(|c| *c == name)
        .expect("known client")
}

fn check(scheduler: &Scheduler<u32>, model: &Model, limits: &Limits) {
    let bytes: u64 = model.waiting.values().map(|&(_, bytes)| bytes).sum();
    assert_eq!(scheduler.queued_bytes(), bytes);
    assert_eq!(scheduler.total_depth() as usize, model.waiting.len());
    for tier in Tier::ALL {
        assert!(scheduler.depth(tier) <= limits.tier(tier).max_depth);
    }
    for stat in scheduler.client_stats() {
        let client = client_index(&stat.client);
        let running = model.running.iter().filter(|r| r.1 == client).count();
        assert_eq!(stat.inflight as usize, running);
    }
    assert_eq!(scheduler.running(), model.running.len());
}

fn run(ops: Vec<Op>, aging: bool) {
    let t0 = Instant::now();
    let mut now = t0;
    let limits = limits(aging);
    let mut scheduler: Scheduler<u32> = Scheduler::new(limits);
    let mut model = Model::default();
    let mut next_payload = 0u32;
    for op in ops {
        match op {
            Op::Enqueue {
                client,
                tier,
                bytes,
                model: m,
            } => {
                let payload = next_payload;
                next_payload += 1;
                let ticket = Ticket {
                    ask: Ask {
                        client: Arc::from(CLIENTS[client]),
                        member: None,
                        tier: Tier::ALL[tier],
                        bytes,
                        model: Some(Arc::from(MODELS[m])),
                        affinity: None,
                    },
                    payload,
                };
                match scheduler.enqueue(now, ticket) {
                    Ok(admitted) => {
                        model.waiting.insert(payload, (admitted.id, bytes));
                    }
                    Err((_, back)) => assert_eq!(back, payload),
                }
            }
            Op::Cancel(pick) => {
                if !model.waiting.is_empty() {
                    let (&payload, &(id, _)) = model
                        .waiting
                        .iter()
                        .nth(pick % model.waiting.len())
                        .expect("in range");
                    if let Some(back) = scheduler.cancel(id) {
                        assert_eq!(back, payload);
                        model.hand_back(payload, "cancelled");
                    }
                }
            }
            Op::Next(allow) => {
                let place = |m: Option<&str>| match allow {
                    0 => None,
                    1 => (m == Some("m0")).then_some(()),
                    _ => Some(()),
                };
                while let Some(dispatch) = scheduler.next(now, place) {
                    let client = client_index(&dispatch.client);
                    let cap = model.caps[client];
                    let running = model.running.iter().filter(|r| r.1 == client).count() as u32;
                    assert!(cap == 0 || running < cap, "dispatched over the cap");
                    model.hand_back(dispatch.payload, "dispatched");
                    model.running.push((dispatch.id, client));
                }
                // The dispatcher's contract: a past deadline means "call expire now".
                if scheduler.next_deadline().is_some_and(|at| at <= now) {
                    let events = scheduler.expire(now);
                    model.collect(events);
                }
            }
            Op::Complete(pick) => {
                if !model.running.is_empty() {
                    let (id, _) = model.running.remove(pick % model.running.len());
                    assert!(scheduler.complete(id, Duration::from_millis(pick as u64 % 2000), now));
                }
            }
            Op::Flush(tier) => {
                for payload in scheduler.flush(tier.map(|t| Tier::ALL[t])) {
                    model.hand_back(payload, "flushed");
                }
            }
            Op::Advance(ms) => now += Duration::from_millis(ms),
            Op::Expire => {
                let events = scheduler.expire(now);
                model.collect(events);
                assert!(scheduler.next_deadline().is_none_or(|at| at > now));
            }
            Op::Pause(tier, paused) => scheduler.set_paused(Tier::ALL[tier], paused),
            Op::Cap(client, cap) => {
                model.caps[client] = cap;
                scheduler.set_client(
                    CLIENTS[client],
                    ClientLimits {
                        max_concurrent: cap,
                        max_queued: 4,
                        weight: 1.0,
                    },
                );
            }
        }
        check(&scheduler, &model, &limits);
    }
    // Whatever happened, flushing leaves nothing behind and every ticket came back once.
    let events = scheduler.expire(now);
    model.collect(events);
    for payload in scheduler.flush(None) {
        model.hand_back(payload, "flushed");
    }
    assert_eq!(scheduler.queued_bytes(), 0);
    assert_eq!(scheduler.total_depth(), 0);
    assert!(model.waiting.is_empty());
    for (id, _) in std::mem::take(&mut model.running) {
        assert!(scheduler.complete(id, Duration::from_millis(5), now));
    }
    assert_eq!(scheduler.running(), 0);
    assert!(
        scheduler
            .client_stats()
            .all(|c| c.inflight == 0 && c.waiting == 0)
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn accounting_survives_any_mix_of_operations(ops in proptest::collection::vec(op(), 1..200)) {
        run(ops, false);
    }

    #[test]
    fn accounting_survives_any_mix_with_aging(ops in proptest::collection::vec(op(), 1..200)) {
        run(ops, true);
    }

    /// With everything placeable and no caps, each dispatch is the oldest waiting ticket of its
    /// client in the most urgent non-empty tier.
    #[test]
    fn strict_tiers_and_fifo_per_client(
        arrivals in proptest::collection::vec((0..4usize, 0..3usize, 0..3usize), 1..300),
    ) {
        let now = Instant::now();
        let mut limits = Limits::default();
        for tier in &mut limits.tiers {
            tier.max_depth = 1000;
        }
        let mut scheduler: Scheduler<(usize, usize, u32)> = Scheduler::new(limits);
        let mut queues: BTreeMap<(usize, usize), Vec<u32>> = BTreeMap::new();
        for (seq, (client, tier, dispatch_after)) in arrivals.into_iter().enumerate() {
            let seq = seq as u32;
            let ticket = Ticket {
                ask: Ask {
                    client: Arc::from(CLIENTS[client]),
                    member: None,
                    tier: Tier::ALL[tier],
                    bytes: 1,
                    model: None,
                    affinity: None,
                },
                payload: (client, tier, seq),
            };
            prop_assert!(scheduler.enqueue(now, ticket).is_ok());
            queues.entry((tier, client)).or_default().push(seq);
            for _ in 0..dispatch_after {
                let Some(dispatch) = scheduler.next(now, |_| Some(())) else { break };
                let (client, tier, seq) = dispatch.payload;
                let most_urgent = queues.iter().find(|(_, q)| !q.is_empty()).map(|(&(t, _), _)| t);
                prop_assert_eq!(Some(tier), most_urgent);
                let queue = queues.get_mut(&(tier, client)).expect("queued");
                prop_assert_eq!(queue.remove(0), seq);
            }
        }
    }
}
