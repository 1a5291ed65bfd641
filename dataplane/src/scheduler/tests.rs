//! Unit tests of the scheduler's rules, one behaviour each. Fairness simulations live in `sim`,
//! properties in `props`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn ticket(client: &str, tier: Tier, bytes: u64, payload: u32) -> Ticket<u32> {
    Ticket {
        ask: Ask {
            client: Arc::from(client),
            member: None,
            tier,
            bytes,
            model: None,
            affinity: None,
        },
        payload,
    }
}

fn with_model(mut ticket: Ticket<u32>, model: &str) -> Ticket<u32> {
    ticket.ask.model = Some(Arc::from(model));
    ticket
}

fn anywhere(_: Option<&str>) -> Option<()> {
    Some(())
}

fn admit(scheduler: &mut Scheduler<u32>, now: Instant, ticket: Ticket<u32>) -> Admitted {
    match scheduler.enqueue(now, ticket) {
        Ok(admitted) => admitted,
        Err((rejection, _)) => panic!("rejected: {rejection}"),
    }
}

fn rejection(scheduler: &mut Scheduler<u32>, now: Instant, ticket: Ticket<u32>) -> Rejection {
    match scheduler.enqueue(now, ticket) {
        Ok(admitted) => panic!("admitted: {admitted:?}"),
        Err((rejection, _)) => rejection,
    }
}

/// Dispatches everything placeable at `now` and returns the payloads in order.
fn drain(scheduler: &mut Scheduler<u32>, now: Instant) -> Vec<u32> {
    std::iter::from_fn(|| scheduler.next(now, anywhere).map(|d| d.payload)).collect()
}

#[test]
fn tiers_are_served_in_strict_order() {
    let now = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    admit(&mut scheduler, now, ticket("a", Tier::Low, 0, 1));
    admit(&mut scheduler, now, ticket("a", Tier::Normal, 0, 2));
    admit(&mut scheduler, now, ticket("b", Tier::Low, 0, 3));
    admit(&mut scheduler, now, ticket("b", Tier::High, 0, 4));
    let order = drain(&mut scheduler, now);
    assert_eq!(&order[..2], &[4, 2]);
    assert_eq!(scheduler.tier_stats(Tier::Low).processed, 2);
}

#[test]
fn an_unplaceable_higher_tier_does_not_block_other_hosts() {
    let now = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    admit(
        &mut scheduler,
        now,
        with_model(ticket("a", Tier::High, 0, 1), "big"),
    );
    admit(
        &mut scheduler,
        now,
        with_model(ticket("b", Tier::Low, 0, 2), "small"),
    );
    let only_small = |model: Option<&str>| (model == Some("small")).then_some("host-2");
    let dispatch = scheduler
        .next(now, only_small)
        .expect("low tier uses the free host");
    assert_eq!((dispatch.payload, dispatch.placement), (2, "host-2"));
    assert!(scheduler.next(now, only_small).is_none());
    assert_eq!(
        scheduler.depth(Tier::High),
        1,
        "the high ticket keeps waiting"
    );
    assert_eq!(scheduler.next(now, anywhere).map(|d| d.payload), Some(1));
}

#[test]
fn fifo_inside_a_client() {
    let now = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    for payload in 0..20 {
        admit(
            &mut scheduler,
            now + secs(u64::from(payload)),
            ticket("a", Tier::Normal, 0, payload),
        );
    }
    assert_eq!(
        drain(&mut scheduler, now + secs(30)),
        (0..20).collect::<Vec<_>>()
    );
}

#[test]
fn placement_refusal_skips_a_clients_head_without_losing_its_tickets() {
    let now = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    admit(
        &mut scheduler,
        now,
        with_model(ticket("a", Tier::Normal, 10, 1), "x"),
    );
    admit(
        &mut scheduler,
        now,
        with_model(ticket("a", Tier::Normal, 10, 2), "y"),
    );
    admit(
        &mut scheduler,
        now,
        with_model(ticket("b", Tier::Normal, 10, 3), "y"),
    );
    let mut asked = Vec::new();
    let dispatch = scheduler.next(now, |model: Option<&str>| {
        asked.push(model.map(str::to_owned));
        (model == Some("y")).then_some(())
    });
    // a's head (model x) has no slot: a's next ticket, for another model that has one, runs
    // in its place (a busy runner holds back nothing of a's for an idle one); x keeps its
    // ticket and its place.
    assert_eq!(dispatch.map(|d| d.payload), Some(2));
    assert_eq!(asked, vec![Some("x".to_owned()), Some("y".to_owned())]);
    assert_eq!(scheduler.depth(Tier::Normal), 2);
    assert_eq!(scheduler.queued_bytes(), 20);
    assert_eq!(drain(&mut scheduler, now), vec![3, 1]);
}

#[test]
fn a_refused_model_is_asked_about_once_per_call() {
    let now = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    for (i, client) in ["a", "b", "c"].into_iter().enumerate() {
        admit(
            &mut scheduler,
            now,
            with_model(ticket(client, Tier::High, 0, i as u32), "x"),
        );
        admit(
            &mut scheduler,
            now,
            with_model(ticket(client, Tier::Low, 0, 10 + i as u32), "x"),
        );
    }
    let mut calls = 0;
    let none = scheduler.next(now, |_: Option<&str>| -> Option<()> {
        calls += 1;
        None
    });
    assert!(none.is_none());
    assert_eq!(calls, 1);
}

#[test]
fn a_client_at_its_cap_is_skipped_and_holds_nothing() {
    let now = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    scheduler.set_client(
        "batch",
        ClientLimits {
            max_concurrent: 1,
            ..ClientLimits::default()
        },
    );
    admit(&mut scheduler, now, ticket("batch", Tier::High, 0, 1));
    admit(&mut scheduler, now, ticket("batch", Tier::High, 0, 2));
    admit(&mut scheduler, now, ticket("user", Tier::Low, 0, 3));
    let first = scheduler.next(now, anywhere).expect("batch runs once");
    assert_eq!(first.payload, 1);
    // batch's second ticket is higher priority but capped: user runs instead.
    assert_eq!(scheduler.next(now, anywhere).map(|d| d.payload), Some(3));
    assert!(scheduler.next(now, anywhere).is_none());
    assert!(scheduler.complete(first.id, secs(1), now + secs(1)));
    assert_eq!(
        scheduler.next(now + secs(1), anywhere).map(|d| d.payload),
        Some(2)
    );
}

#[test]
fn admission_checks_in_order() {
    let now = Instant::now();
    let mut limits = Limits::default();
    limits.tiers[Tier::Normal.index()].max_depth = 1;
    limits.max_queued_bytes = 100;
    let mut scheduler = Scheduler::new(limits);
    scheduler.set_client(
        "capped",
        ClientLimits {
            max_queued: 1,
            ..ClientLimits::default()
        },
    );

    scheduler.set_paused(Tier::Normal, true);
    assert_eq!(
        rejection(&mut scheduler, now, ticket("a", Tier::Normal, 0, 0)),
        Rejection::Paused
    );
    assert_eq!(
        scheduler.tier_stats(Tier::Normal).rejected,
        0,
        "pause is not a rejection"
    );
    scheduler.set_paused(Tier::Normal, false);

    // Empty queues: admitted whatever the size.
    admit(&mut scheduler, now, ticket("capped", Tier::Normal, 500, 1));
    assert_eq!(
        rejection(&mut scheduler, now, ticket("capped", Tier::Normal, 0, 2)),
        Rejection::QueueFull,
        "depth is checked before the client's queue"
    );
    assert_eq!(
        rejection(&mut scheduler, now, ticket("capped", Tier::Low, 0, 3)),
        Rejection::ClientQueueFull,
        "the client's queue is checked before bytes"
    );
    assert_eq!(
        rejection(&mut scheduler, now, ticket("a", Tier::Low, 1, 4)),
        Rejection::OverCapacity
    );
    assert_eq!(scheduler.tier_stats(Tier::Normal).rejected, 1);
    assert_eq!(scheduler.tier_stats(Tier::Low).rejected, 2);
    let capped = scheduler
        .client_stats()
        .find(|c| &*c.client == "capped")
        .expect("known");
    assert_eq!((capped.rejected, capped.waiting), (2, 1));
    // Once the queues are empty again, the big body is admitted again.
    assert_eq!(drain(&mut scheduler, now), vec![1]);
    admit(&mut scheduler, now, ticket("a", Tier::Low, 1000, 5));
}

#[test]
fn max_depth_zero_never_queues() {
    let now = Instant::now();
    let mut limits = Limits::default();
    limits.tiers[Tier::High.index()].max_depth = 0;
    let mut scheduler = Scheduler::new(limits);
    assert_eq!(
        rejection(&mut scheduler, now, ticket("a", Tier::High, 0, 0)),
        Rejection::QueueFull
    );
    assert_eq!(scheduler.total_depth(), 0);
    admit(&mut scheduler, now, ticket("a", Tier::Normal, 0, 1));
}

#[test]
fn positions_count_the_tier_only() {
    let now = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    assert_eq!(
        admit(&mut scheduler, now, ticket("a", Tier::Low, 0, 0)).position,
        1
    );
    assert_eq!(
        admit(&mut scheduler, now, ticket("b", Tier::Normal, 0, 1)).position,
        1
    );
    assert_eq!(
        admit(&mut scheduler, now, ticket("c", Tier::Low, 0, 2)).position,
        2
    );
}

#[test]
fn watermark_fires_once_per_crossing_and_rearms_on_dequeue() {
    let now = Instant::now();
    let mut limits = Limits::default();
    limits.tiers[Tier::Normal.index()].max_depth = 10;
    limits.tiers[Tier::Normal.index()].high_watermark_pct = 50;
    let mut scheduler = Scheduler::new(limits);
    let crossed: Vec<bool> = (0..7)
        .map(|i| admit(&mut scheduler, now, ticket("a", Tier::Normal, 0, i)).watermark_crossed)
        .collect();
    assert_eq!(crossed, [false, false, false, false, true, false, false]);
    // Draining below the threshold re-arms (the Python proxy only re-armed on enqueue).
    for _ in 0..3 {
        scheduler.next(now, anywhere);
    }
    assert_eq!(scheduler.depth(Tier::Normal), 4);
    assert!(admit(&mut scheduler, now, ticket("a", Tier::Normal, 0, 8)).watermark_crossed);
    assert!(!admit(&mut scheduler, now, ticket("a", Tier::Normal, 0, 9)).watermark_crossed);
}

#[test]
fn bytes_are_freed_by_dispatch_cancel_expiry_and_flush() {
    let now = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    let cancelled = admit(&mut scheduler, now, ticket("a", Tier::Normal, 100, 1)).id;
    admit(&mut scheduler, now, ticket("a", Tier::Normal, 20, 2));
    admit(&mut scheduler, now, ticket("b", Tier::Low, 3, 3));
    admit(&mut scheduler, now, ticket("c", Tier::High, 4000, 4));
    assert_eq!(scheduler.queued_bytes(), 4123);
    assert_eq!(scheduler.next(now, anywhere).map(|d| d.payload), Some(4));
    assert_eq!(scheduler.queued_bytes(), 123);
    assert_eq!(scheduler.cancel(cancelled), Some(1));
    assert_eq!(scheduler.cancel(cancelled), None);
    assert_eq!(scheduler.queued_bytes(), 23);
    assert_eq!(scheduler.tier_stats(Tier::Normal).cancelled, 1);
    let expired = scheduler.expire(now + secs(300));
    assert_eq!(expired.len(), 1);
    assert_eq!(scheduler.queued_bytes(), 3);
    assert_eq!(scheduler.flush(None), vec![3]);
    assert_eq!(scheduler.queued_bytes(), 0);
    assert_eq!(scheduler.tier_stats(Tier::Low).flushed, 1);
}

#[test]
fn flush_frees_bytes_so_the_ceiling_does_not_ratchet_shut() {
    let now = Instant::now();
    let limits = Limits {
        max_queued_bytes: 1000,
        ..Limits::default()
    };
    let mut scheduler = Scheduler::new(limits);
    for round in 0..5 {
        admit(&mut scheduler, now, ticket("a", Tier::Low, 600, round));
        admit(&mut scheduler, now, ticket("b", Tier::Normal, 400, round));
        assert_eq!(scheduler.flush(Some(Tier::Low)), vec![round]);
        assert_eq!(scheduler.flush(Some(Tier::Normal)), vec![round]);
        assert_eq!(scheduler.queued_bytes(), 0);
    }
}

#[test]
fn expiry_happens_exactly_at_the_deadline() {
    let t0 = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    admit(&mut scheduler, t0, ticket("a", Tier::Low, 7, 1));
    admit(&mut scheduler, t0 + secs(1), ticket("b", Tier::High, 7, 2));
    assert_eq!(scheduler.next_deadline(), Some(t0 + secs(121)));
    assert!(
        scheduler
            .expire(t0 + secs(121) - Duration::from_nanos(1))
            .is_empty()
    );
    let expired = scheduler.expire(t0 + secs(121));
    match expired.as_slice() {
        [
            Expiry::Expired {
                tier: Tier::High,
                payload: 2,
                waited,
                client,
                ..
            },
        ] => {
            assert_eq!(*waited, secs(120));
            assert_eq!(&**client, "b");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(scheduler.next_deadline(), Some(t0 + secs(600)));
    assert_eq!(scheduler.expire(t0 + secs(600)).len(), 1);
    assert_eq!(scheduler.next_deadline(), None);
    assert_eq!(scheduler.tier_stats(Tier::Low).expired, 1);
    assert_eq!(scheduler.queued_bytes(), 0);
}

#[test]
fn next_never_dispatches_an_expired_ticket() {
    let t0 = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    admit(&mut scheduler, t0, ticket("a", Tier::High, 0, 1));
    let late = t0 + secs(120);
    assert!(scheduler.next(late, anywhere).is_none());
    assert_eq!(
        scheduler.next_deadline(),
        Some(late),
        "expiries are waiting to be handed out"
    );
    assert!(matches!(
        scheduler.expire(late).as_slice(),
        [Expiry::Expired { payload: 1, .. }]
    ));
    assert_eq!(scheduler.next_deadline(), None);
}

#[test]
fn aging_promotes_one_tier_up_and_restarts_the_wait_clock() {
    let t0 = Instant::now();
    let mut limits = Limits::default();
    limits.tiers[Tier::Low.index()].promote_after = Some(secs(30));
    limits.tiers[Tier::Normal.index()].promote_after = Some(secs(60));
    let mut scheduler = Scheduler::new(limits);
    admit(&mut scheduler, t0, ticket("batch", Tier::Low, 5, 1));
    assert_eq!(scheduler.next_deadline(), Some(t0 + secs(30)));
    assert!(scheduler.expire(t0 + secs(29)).is_empty());
    let events = scheduler.expire(t0 + secs(30));
    assert!(matches!(
        events.as_slice(),
        [Expiry::Promoted {
            from: Tier::Low,
            to: Tier::Normal,
            ..
        }]
    ));
    assert_eq!(
        (scheduler.depth(Tier::Low), scheduler.depth(Tier::Normal)),
        (0, 1)
    );
    assert_eq!(scheduler.tier_stats(Tier::Low).promoted, 1);
    assert_eq!(scheduler.queued_bytes(), 5);
    // In Normal: promotion after 60 s more, before Normal's 300 s deadline.
    assert_eq!(scheduler.next_deadline(), Some(t0 + secs(90)));
    scheduler.expire(t0 + secs(90));
    assert_eq!(scheduler.depth(Tier::High), 1);
    // In High: 120 s from the promotion, not from admission.
    assert_eq!(scheduler.next_deadline(), Some(t0 + secs(210)));
    let dispatch = scheduler.next(t0 + secs(100), anywhere).expect("runs");
    assert_eq!(dispatch.tier, Tier::High);
    assert_eq!(
        dispatch.waited,
        secs(100),
        "waited counts from the original admission"
    );
}

#[test]
fn a_promoted_ticket_overtakes_newer_low_work_and_joins_fifo_of_its_client() {
    let t0 = Instant::now();
    let mut limits = Limits::default();
    limits.tiers[Tier::Low.index()].promote_after = Some(secs(10));
    let mut scheduler = Scheduler::new(limits);
    admit(&mut scheduler, t0, ticket("a", Tier::Low, 0, 1));
    admit(
        &mut scheduler,
        t0 + secs(5),
        ticket("a", Tier::Normal, 0, 2),
    );
    admit(&mut scheduler, t0 + secs(6), ticket("b", Tier::Low, 0, 3));
    scheduler.expire(t0 + secs(10));
    // Ticket 1 is now in Normal, ahead of a's newer Normal ticket (admission order).
    assert_eq!(drain(&mut scheduler, t0 + secs(11)), vec![1, 2, 3]);
}

#[test]
fn promotion_waits_while_the_tier_above_is_full() {
    let t0 = Instant::now();
    let mut limits = Limits::default();
    limits.tiers[Tier::Low.index()].promote_after = Some(secs(10));
    limits.tiers[Tier::Normal.index()].max_depth = 1;
    let mut scheduler = Scheduler::new(limits);
    admit(&mut scheduler, t0, ticket("a", Tier::Normal, 0, 1));
    admit(&mut scheduler, t0, ticket("b", Tier::Low, 0, 2));
    assert!(scheduler.expire(t0 + secs(10)).is_empty());
    // Blocked: the next deadline is Normal's expiry, not the past promotion instant.
    assert_eq!(scheduler.next_deadline(), Some(t0 + secs(300)));
    assert_eq!(
        scheduler.next(t0 + secs(11), anywhere).map(|d| d.payload),
        Some(1)
    );
    // Room again: the promotion is due now.
    assert_eq!(scheduler.next_deadline(), Some(t0 + secs(10)));
    assert_eq!(scheduler.expire(t0 + secs(11)).len(), 1);
    assert_eq!(scheduler.depth(Tier::Normal), 1);
}

#[test]
fn set_limits_never_drops_tickets() {
    let t0 = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    for i in 0..5 {
        admit(&mut scheduler, t0, ticket("a", Tier::Normal, 1, i));
    }
    let mut limits = Limits::default();
    limits.tiers[Tier::Normal.index()].max_depth = 2;
    limits.tiers[Tier::Normal.index()].max_wait = secs(10);
    scheduler.set_limits(limits);
    assert_eq!(scheduler.depth(Tier::Normal), 5);
    assert_eq!(
        rejection(&mut scheduler, t0, ticket("a", Tier::Normal, 1, 9)),
        Rejection::QueueFull
    );
    assert_eq!(scheduler.next_deadline(), Some(t0 + secs(10)));
}

#[test]
fn complete_charges_usage_and_releases_the_cap() {
    let t0 = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    admit(&mut scheduler, t0, ticket("a", Tier::Normal, 0, 1));
    admit(&mut scheduler, t0, ticket("b", Tier::Normal, 0, 2));
    let a = scheduler.next(t0, anywhere).expect("a");
    let b = scheduler.next(t0, anywhere).expect("b");
    assert_eq!(scheduler.running(), 2);
    assert!(scheduler.complete(a.id, secs(3), t0 + secs(3)));
    assert!(scheduler.complete(b.id, secs(1), t0 + secs(3)));
    assert!(
        !scheduler.complete(b.id, secs(1), t0 + secs(3)),
        "completing twice is ignored"
    );
    let stats: Vec<ClientStat> = {
        let mut stats: Vec<ClientStat> = scheduler.client_stats().collect();
        stats.sort_by(|x, y| x.client.cmp(&y.client));
        stats
    };
    assert!((stats[0].recent_share - 0.75).abs() < 1e-9);
    assert!((stats[1].recent_share - 0.25).abs() < 1e-9);
    assert_eq!((stats[0].inflight, stats[0].processed), (0, 1));
}

#[test]
fn idle_debt_decays_with_the_half_life() {
    let t0 = Instant::now();
    let limits = Limits {
        half_life: secs(60),
        ..Limits::default()
    };
    let mut scheduler = Scheduler::new(limits);
    // a and b share one slot; a runs one huge request (estimated at 1 s, took 100 s).
    admit(&mut scheduler, t0, ticket("a", Tier::Normal, 0, 0));
    admit(&mut scheduler, t0, ticket("b", Tier::Normal, 0, 0));
    let first = scheduler.next(t0, anywhere).expect("a first");
    assert_eq!(&*first.client, "a");
    scheduler.complete(first.id, secs(100), t0 + secs(100));
    let second = scheduler.next(t0 + secs(100), anywhere).expect("b");
    scheduler.complete(second.id, secs(1), t0 + secs(101));
    // Soon after: a's debt holds, b runs many requests before a gets a turn.
    let order = |scheduler: &mut Scheduler<u32>, at: Instant| {
        for _ in 0..10 {
            admit(scheduler, at, ticket("a", Tier::Normal, 0, 0));
            admit(scheduler, at, ticket("b", Tier::Normal, 0, 0));
        }
        let mut first_ten = Vec::new();
        let mut at = at;
        while let Some(dispatch) = scheduler.next(at, anywhere) {
            if first_ten.len() < 10 {
                first_ten.push(dispatch.client.clone());
            }
            at += secs(1);
            scheduler.complete(dispatch.id, secs(1), at);
        }
        first_ten.iter().filter(|c| &***c == "a").count()
    };
    assert_eq!(
        order(&mut scheduler, t0 + secs(102)),
        0,
        "recent debt is paid"
    );
    // Run the same again, then leave both idle for ten half-lives.
    let first = {
        admit(
            &mut scheduler,
            t0 + secs(200),
            ticket("a", Tier::Normal, 0, 0),
        );
        scheduler.next(t0 + secs(200), anywhere).expect("a alone")
    };
    scheduler.complete(first.id, secs(100), t0 + secs(300));
    let share = order(&mut scheduler, t0 + secs(300 + 600));
    assert!(
        share >= 4,
        "old debt forgotten: a got {share} of the first 10"
    );
}

#[test]
fn unconfigured_idle_clients_are_forgotten() {
    let t0 = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    scheduler.set_client("known", ClientLimits::default());
    for i in 0..100 {
        admit(
            &mut scheduler,
            t0,
            ticket(&format!("drive-by-{i}"), Tier::Normal, 0, i),
        );
    }
    while let Some(dispatch) = scheduler.next(t0, anywhere) {
        scheduler.complete(dispatch.id, secs(1), t0 + secs(1));
    }
    scheduler.expire(t0 + secs(1));
    assert_eq!(scheduler.client_stats().count(), 101);
    scheduler.expire(t0 + secs(1000));
    let left: Vec<_> = scheduler.client_stats().map(|c| c.client).collect();
    assert_eq!(left, vec![Arc::<str>::from("known")]);
}

#[test]
fn scales_to_tens_of_thousands_of_tickets() {
    let t0 = Instant::now();
    let mut limits = Limits::default();
    for tier in &mut limits.tiers {
        tier.max_depth = 100_000;
    }
    limits.max_queued_bytes = u64::MAX;
    let mut scheduler = Scheduler::new(limits);
    let started = Instant::now();
    let mut ids = Vec::new();
    for i in 0..30_000u32 {
        let tier = Tier::ALL[(i % 3) as usize];
        ids.push(
            admit(
                &mut scheduler,
                t0,
                ticket(&format!("c{}", i % 200), tier, 10, i),
            )
            .id,
        );
    }
    for id in ids.iter().step_by(3) {
        assert!(scheduler.cancel(*id).is_some());
    }
    let mut dispatched = 0;
    while let Some(dispatch) = scheduler.next(t0, anywhere) {
        scheduler.complete(dispatch.id, Duration::from_millis(10), t0);
        dispatched += 1;
    }
    assert_eq!(dispatched, 20_000);
    assert_eq!(scheduler.queued_bytes(), 0);
    println!(
        "30k enqueues, 10k cancels, 20k dispatches over 200 clients: {:?}",
        started.elapsed()
    );
}

/// The first requests of a fresh scheduler are charged the no-history default (1 s). When they
/// really take 25 ms, the correction leaves their client far below a virtual clock that its own
/// second request had moved: without a cap on credit it then ran alone for dozens of requests
/// while three others waited. With the cap, no client gets more than one request ahead.
#[test]
fn an_over_estimated_start_gives_no_burst() {
    let t0 = Instant::now();
    let cost = Duration::from_millis(25);
    let mut scheduler = Scheduler::new(Limits::default());
    let mut payload = 0;
    let mut enqueue = |scheduler: &mut Scheduler<u32>, client: &str, now: Instant| {
        payload += 1;
        admit(scheduler, now, ticket(client, Tier::Normal, 0, payload));
    };
    // Two slots; `a` arrives first and takes both.
    for _ in 0..8 {
        enqueue(&mut scheduler, "a", t0);
    }
    let first = scheduler.next(t0, anywhere).unwrap();
    let second = scheduler.next(t0, anywhere).unwrap();
    assert_eq!((&*first.client, &*second.client), ("a", "a"));
    for client in ["b", "c", "d"] {
        for _ in 0..8 {
            enqueue(&mut scheduler, client, t0);
        }
    }
    // From now on every request takes 25 ms and its client sends another.
    let mut now = t0 + cost;
    let mut running = vec![first, second];
    let mut served: HashMap<Arc<str>, u32> = HashMap::new();
    for _ in 0..40 {
        let done = running.remove(0);
        assert!(scheduler.complete(done.id, cost, now));
        enqueue(&mut scheduler, &done.client.clone(), now);
        let next = scheduler.next(now, anywhere).unwrap();
        *served.entry(next.client.clone()).or_default() += 1;
        running.push(next);
        now += cost / 2;
    }
    let most = served.values().max().copied().unwrap_or(0);
    let least = ["a", "b", "c", "d"]
        .iter()
        .map(|client| served.get(*client).copied().unwrap_or(0))
        .min()
        .unwrap_or(0);
    assert!(
        most - least <= 2,
        "40 dispatches after the start: {served:?}"
    );
}

#[test]
fn revoke_removes_only_the_named_clients_waiting_tickets_and_frees_their_bytes() {
    let now = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    admit(&mut scheduler, now, ticket("gone", Tier::Normal, 100, 1));
    admit(&mut scheduler, now, ticket("kept", Tier::Normal, 10, 2));
    admit(&mut scheduler, now, ticket("gone", Tier::Low, 100, 3));
    let mut revoked = scheduler.revoke(|client, _| client == "gone");
    revoked.sort_unstable();
    assert_eq!(revoked, vec![1, 3]);
    assert_eq!(scheduler.total_depth(), 1);
    assert_eq!(scheduler.queued_bytes(), 10);
    assert_eq!(drain(&mut scheduler, now), vec![2]);
}

#[test]
fn a_client_left_out_of_the_snapshot_loses_its_caps() {
    let now = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    let capped = ClientLimits {
        max_concurrent: 1,
        ..ClientLimits::default()
    };
    scheduler.set_client("a", capped);
    admit(&mut scheduler, now, ticket("a", Tier::Normal, 0, 1));
    admit(&mut scheduler, now, ticket("a", Tier::Normal, 0, 2));
    assert_eq!(drain(&mut scheduler, now), vec![1], "capped at one");
    scheduler.unconfigure_others(|client| client != "a");
    assert_eq!(drain(&mut scheduler, now), vec![2], "the cap went with it");
}

#[test]
fn the_client_map_is_bounded_by_forgetting_idle_unconfigured_clients() {
    let now = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    scheduler.set_client("configured", ClientLimits::default());
    for i in 0..(MAX_CLIENTS as u32 + 100) {
        admit(
            &mut scheduler,
            now,
            ticket(&format!("caller-{i}"), Tier::Normal, 0, i),
        );
        let dispatch = scheduler.next(now, anywhere).unwrap();
        scheduler.complete(dispatch.id, secs(1), now);
    }
    let clients: Vec<ClientStat> = scheduler.client_stats().collect();
    assert!(clients.len() <= MAX_CLIENTS, "{}", clients.len());
    assert!(clients.iter().any(|c| &*c.client == "configured"));
    assert!(
        clients.iter().any(|c| &*c.client == "caller-10099"),
        "the newest stays"
    );
}

fn member(client: &str, app: &str, max_concurrent: u32, payload: u32) -> Ticket<u32> {
    let mut ticket = ticket(client, Tier::Normal, 0, payload);
    ticket.ask.member = Some(Member {
        app: Arc::from(app),
        limits: ClientLimits {
            max_concurrent,
            ..ClientLimits::default()
        },
    });
    ticket
}

/// Runs one request at a time, each costing `cost`, and returns the clients in the order
/// they were served.
fn serve_one_at_a_time(
    scheduler: &mut Scheduler<u32>,
    start: Instant,
    cost: Duration,
) -> Vec<Arc<str>> {
    let mut now = start;
    let mut order = Vec::new();
    while let Some(dispatch) = scheduler.next(now, anywhere) {
        order.push(dispatch.client.clone());
        now += cost;
        assert!(scheduler.complete(dispatch.id, cost, now));
    }
    order
}

#[test]
fn an_apps_heavy_user_does_not_keep_its_light_user_waiting() {
    let now = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    for payload in 0..5 {
        admit(
            &mut scheduler,
            now,
            member("webui/heavy", "webui", 0, payload),
        );
    }
    admit(&mut scheduler, now, member("webui/light", "webui", 0, 9));
    let order = serve_one_at_a_time(&mut scheduler, now, secs(1));
    assert_eq!(&*order[0], "webui/heavy");
    assert_eq!(&*order[1], "webui/light", "{order:?}");
}

#[test]
fn an_app_keeps_its_weight_however_many_users_it_has() {
    let now = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    scheduler.set_client("webui", ClientLimits::default());
    scheduler.set_client("batch", ClientLimits::default());
    let mut payload = 0;
    for round in 0..4 {
        for user in 0..10 {
            admit(
                &mut scheduler,
                now,
                member(&format!("webui/u{user}"), "webui", 0, payload),
            );
            payload += 1;
        }
        for _ in 0..10 {
            admit(
                &mut scheduler,
                now,
                ticket("batch", Tier::Normal, 0, payload),
            );
            payload += 1;
        }
        let _ = round;
    }
    let order = serve_one_at_a_time(&mut scheduler, now, secs(1));
    // While both are backlogged (the first 80 dispatches), they alternate.
    let app = order[..80]
        .iter()
        .filter(|client| client.starts_with("webui/"))
        .count();
    assert!((38..=42).contains(&app), "the app got {app} of 80");
    // Inside the app, its ten users share equally.
    let mut per_user: HashMap<&str, usize> = HashMap::new();
    for client in order[..80]
        .iter()
        .filter(|client| client.starts_with("webui/"))
    {
        *per_user.entry(client).or_default() += 1;
    }
    assert_eq!(per_user.len(), 10);
    assert!(
        per_user.values().all(|&n| (3..=5).contains(&n)),
        "{per_user:?}"
    );
}

#[test]
fn a_users_cap_holds_while_other_users_run_and_the_apps_cap_bounds_them_all() {
    let now = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    scheduler.set_client(
        "webui",
        ClientLimits {
            max_concurrent: 3,
            ..ClientLimits::default()
        },
    );
    for payload in 0..3 {
        admit(&mut scheduler, now, member("webui/a", "webui", 1, payload));
    }
    for payload in 10..13 {
        admit(&mut scheduler, now, member("webui/b", "webui", 1, payload));
    }
    for payload in 20..23 {
        admit(&mut scheduler, now, member("webui/c", "webui", 0, payload));
    }
    for payload in 30..33 {
        admit(&mut scheduler, now, member("webui/d", "webui", 0, payload));
    }
    let running: Vec<u32> = drain(&mut scheduler, now);
    // a and b one each (their caps), and one more of c or d: the app's cap of 3.
    assert_eq!(running.len(), 3, "{running:?}");
    assert_eq!(running.iter().filter(|&&p| p < 10).count(), 1);
    assert_eq!(
        running.iter().filter(|&&p| (10..20).contains(&p)).count(),
        1
    );
    // Another client is not held back by the app's cap.
    admit(&mut scheduler, now, ticket("other", Tier::Normal, 0, 99));
    assert_eq!(drain(&mut scheduler, now), vec![99]);
}

#[test]
fn an_apps_max_queued_counts_all_its_users_and_a_users_its_own() {
    let now = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    scheduler.set_client(
        "webui",
        ClientLimits {
            max_queued: 3,
            ..ClientLimits::default()
        },
    );
    let mut queued_one = member("webui/a", "webui", 0, 1);
    if let Some(member) = &mut queued_one.ask.member {
        member.limits.max_queued = 1;
    }
    admit(&mut scheduler, now, queued_one);
    let mut second = member("webui/a", "webui", 0, 2);
    if let Some(member) = &mut second.ask.member {
        member.limits.max_queued = 1;
    }
    assert_eq!(
        rejection(&mut scheduler, now, second),
        Rejection::ClientQueueFull
    );
    admit(&mut scheduler, now, member("webui/b", "webui", 0, 3));
    admit(&mut scheduler, now, member("webui", "webui", 0, 4));
    assert_eq!(
        rejection(&mut scheduler, now, member("webui/c", "webui", 0, 5)),
        Rejection::ClientQueueFull
    );
    // Cancelling frees the app's place.
    admit(&mut scheduler, now, ticket("other", Tier::Normal, 0, 6));
    assert_eq!(drain(&mut scheduler, now).len(), 4);
    admit(&mut scheduler, now, member("webui/c", "webui", 0, 7));
}

#[test]
fn a_clients_ticket_for_an_idle_runner_is_not_held_back_by_its_busy_one() {
    let now = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    for (payload, model) in [
        (1, "busy"),
        (2, "busy"),
        (3, "idle"),
        (4, "busy"),
        (5, "idle"),
    ] {
        admit(
            &mut scheduler,
            now,
            with_model(ticket("batch", Tier::Low, 0, payload), model),
        );
    }
    let only_idle = |model: Option<&str>| (model == Some("idle")).then_some(());
    let order: Vec<u32> =
        std::iter::from_fn(|| scheduler.next(now, only_idle).map(|d| d.payload)).collect();
    assert_eq!(
        order,
        [3, 5],
        "the idle runner's tickets run, in their order"
    );
    // The busy runner's keep their order once it frees.
    assert_eq!(drain(&mut scheduler, now), [1, 2, 4]);
}

#[test]
fn a_requeued_ticket_waits_again_at_its_place_holding_nothing() {
    let start = Instant::now();
    let mut scheduler = Scheduler::new(Limits::default());
    scheduler.set_client(
        "a",
        ClientLimits {
            max_concurrent: 1,
            ..ClientLimits::default()
        },
    );
    admit(&mut scheduler, start, ticket("a", Tier::Normal, 10, 1));
    admit(&mut scheduler, start, ticket("a", Tier::Normal, 10, 2));
    let first = scheduler.next(start, anywhere).unwrap();
    assert_eq!(first.payload, 1);
    // Its host failed and none is free: it goes back, its cap's place free for nobody else of
    // its own (it is first again), and its bytes count as waiting again.
    let later = start + secs(5);
    assert!(
        scheduler
            .requeue(first.id, 11, vec![Arc::from("gpu1")], later)
            .is_ok()
    );
    assert_eq!(scheduler.total_depth(), 2);
    assert_eq!(scheduler.queued_bytes(), 20);
    assert_eq!(scheduler.running(), 0);
    let again = scheduler.next(later, anywhere).unwrap();
    assert_eq!(
        again.payload, 11,
        "the same ticket, first in its client's order"
    );
    assert_eq!(again.id, first.id);
    assert_eq!(again.waited, secs(5), "its wait counts from its admission");
    assert!(
        scheduler
            .requeue(TicketId(99), 0, Vec::new(), later)
            .is_err()
    );
}

#[test]
fn after_a_switch_given_up_a_held_ticket_waits_a_full_max_defer_again() {
    let mut scheduler: Scheduler<()> = Scheduler::new(Limits::default());
    scheduler.set_swap(SwapRule {
        enabled: true,
        ..SwapRule::default()
    });
    let t0 = Instant::now();
    let bound = scheduler.swap().max_defer[Tier::Normal.index()];
    let gave_up = t0 + 2 * bound;
    let cold = Cold {
        host: Arc::from("gpu"),
        idle_since: None,
        settled_at: None,
        switching: false,
        drain_until: None,
        gave_up_at: Some(gave_up),
    };
    // Held since t0, long past its bound: without the give-up it would switch at once.
    assert!(matches!(
        scheduler.verdict(Tier::Normal, t0, &cold, gave_up),
        swap::Verdict::Hold(Some(at)) if at == gave_up + bound
    ));
    assert!(matches!(
        scheduler.verdict(Tier::Normal, t0, &cold, gave_up + bound),
        swap::Verdict::Switch(SwitchReason::Bound)
    ));
    // While a switch drains, the scheduler looks again at its bound.
    let draining = Cold {
        switching: true,
        drain_until: Some(gave_up + bound),
        ..cold
    };
    assert!(matches!(
        scheduler.verdict(Tier::Normal, t0, &draining, gave_up),
        swap::Verdict::Hold(Some(at)) if at == gave_up + bound
    ));
}

#[test]
fn a_switch_drain_charged_to_its_requester_puts_it_behind_the_others() {
    let mut scheduler: Scheduler<()> = Scheduler::new(Limits::default());
    let now = Instant::now();
    for client in ["xavier", "yvonne"] {
        scheduler.set_client(client, ClientLimits::default());
    }
    let by = Requester {
        client: Arc::from("yvonne"),
        group: None,
        tier: Tier::Normal,
        bound: Duration::from_secs(5),
    };
    scheduler.charge_switch(&by, Duration::from_secs(3), now);
    let charged: HashMap<Arc<str>, Duration> = scheduler
        .client_stats()
        .map(|stat| (stat.client, stat.switch_charged))
        .collect();
    assert_eq!(charged[&Arc::from("yvonne")], Duration::from_secs(3));
    assert_eq!(charged[&Arc::from("xavier")], Duration::ZERO);
    let finish = |scheduler: &Scheduler<()>, name: &str| {
        scheduler.clients[name].flows[Tier::Normal.index()].finish()
    };
    assert!((finish(&scheduler, "yvonne") - finish(&scheduler, "xavier") - 3.0).abs() < 1e-9);
}
