//! The scheduler's rules with time passed in: no timers, no tasks, every instant explicit.

use super::*;

const GIB: u64 = 1 << 30;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// 10 GiB; a and b 6 GiB each (they do not fit together), c 4 GiB; loads 100 ms, unloads 10 ms.
fn sched() -> Sched {
    let sizes = [
        ("a:latest", 6),
        ("b:latest", 6),
        ("c:latest", 4),
        ("big:latest", 11),
    ];
    Sched::new(Config {
        capacity: 10 * GIB,
        default_size: GIB,
        sizes: sizes
            .into_iter()
            .map(|(name, gib)| (name.to_owned(), gib * GIB))
            .collect(),
        load: ms(100),
        loads: HashMap::new(),
        unload: ms(10),
        unloads: HashMap::new(),
        max_pending: None,
        max_loaded: None,
    })
}

const KEEP: Keep = Keep::For(Duration::from_secs(300));

fn queued(attach: Attach) -> u64 {
    match attach {
        Attach::Queued(id) => id,
        other => panic!("expected a queued request, got {other:?}"),
    }
}

#[test]
fn a_cold_request_loads_then_resident_requests_attach_at_once() {
    let mut sched = sched();
    let t0 = Instant::now();
    let id = queued(sched.attach("a", KEEP, t0));
    assert_eq!(sched.take_grant(id), Some(Ok(())));
    assert!(sched.is_loading("a"));
    assert_eq!(sched.attach("a", KEEP, t0), Attach::Loading);
    assert_eq!(sched.pump(t0), Some(t0 + ms(100)));
    sched.pump(t0 + ms(100));
    assert!(!sched.is_loading("a"));
    assert_eq!(sched.attach("A:latest", KEEP, t0 + ms(100)), Attach::Ready);
    let snapshot = sched.snapshot();
    assert_eq!(snapshot.resident, ["a:latest"]);
    assert_eq!(snapshot.loads.get("a:latest"), Some(&1));
    assert_eq!(snapshot.load_time, ms(100));
}

#[test]
fn alternating_models_that_do_not_fit_together_pay_a_load_each_time() {
    let mut sched = sched();
    let mut now = Instant::now();
    for (round, model) in ["a", "b", "a", "b"].into_iter().enumerate() {
        let id = queued(sched.attach(model, KEEP, now));
        // The other model is idle: it is chosen, unloaded (10 ms), then this one loads.
        if round > 0 {
            assert_eq!(sched.take_grant(id), None);
            now += ms(10);
            sched.pump(now);
        }
        assert_eq!(sched.take_grant(id), Some(Ok(())));
        now += ms(100);
        sched.pump(now);
        sched.release(model, now);
    }
    let snapshot = sched.snapshot();
    assert_eq!(snapshot.loads.get("a:latest"), Some(&2));
    assert_eq!(snapshot.loads.get("b:latest"), Some(&2));
    assert_eq!(snapshot.unloads.get("a:latest"), Some(&2));
    assert_eq!(snapshot.unloads.get("b:latest"), Some(&1));
    assert_eq!(snapshot.load_time, ms(400));
}

#[test]
fn the_cold_queue_is_fifo_and_its_head_blocks_a_request_that_would_fit() {
    let mut sched = sched();
    let t0 = Instant::now();
    sched.preload("a");
    assert_eq!(sched.attach("a", KEEP, t0), Attach::Ready);
    // b needs a's room, a is busy; c would fit beside a but waits behind b.
    let b = queued(sched.attach("b", KEEP, t0));
    let c = queued(sched.attach("c", KEEP, t0));
    assert_eq!((sched.take_grant(b), sched.take_grant(c)), (None, None));
    assert_eq!(sched.snapshot().pending, 2);
    // New requests for the victim still run on it.
    assert_eq!(sched.attach("a", KEEP, t0), Attach::Ready);
    sched.release("a", t0 + ms(50));
    assert_eq!(
        sched.snapshot().resident,
        ["a:latest"],
        "one request still runs"
    );
    sched.release("a", t0 + ms(60));
    sched.pump(t0 + ms(70));
    assert_eq!(sched.take_grant(b), Some(Ok(())));
    assert_eq!(sched.take_grant(c), Some(Ok(())), "c fits beside b");
    assert_eq!(sched.snapshot().loading, ["b:latest", "c:latest"]);
    assert_eq!(sched.snapshot().unloads.get("a:latest"), Some(&1));
}

#[test]
fn victims_go_by_keep_alive_then_name_idle_first() {
    let mut sched = Sched::new(Config {
        capacity: 3 * GIB,
        ..sched().config
    });
    let t0 = Instant::now();
    for (model, keep) in [
        ("x", KEEP),
        ("y", Keep::For(Duration::from_secs(60))),
        ("z", Keep::For(Duration::from_secs(60))),
    ] {
        let id = queued(sched.attach(model, keep, t0));
        assert_eq!(sched.take_grant(id), Some(Ok(())));
    }
    sched.pump(t0 + ms(100));
    // z is busy, so y (shortest keep-alive, first by name among idle) goes first.
    assert_eq!(sched.attach("z", KEEP, t0 + ms(100)), Attach::Ready);
    for model in ["x", "y", "z"] {
        sched.release(model, t0 + ms(100));
    }
    let d = queued(sched.attach("d", KEEP, t0 + ms(100)));
    sched.pump(t0 + ms(110));
    assert_eq!(sched.take_grant(d), Some(Ok(())));
    assert_eq!(
        sched.snapshot().unloads.keys().collect::<Vec<_>>(),
        ["y:latest"]
    );
}

#[test]
fn keep_alive_zero_unloads_after_the_request_and_idle_models_expire() {
    let mut sched = sched();
    let t0 = Instant::now();
    sched.preload("c");
    assert_eq!(
        sched.attach("c", Keep::For(Duration::ZERO), t0),
        Attach::Ready
    );
    sched.release("c", t0);
    assert_eq!(sched.snapshot().resident, Vec::<String>::new());
    sched.pump(t0 + ms(10));
    assert_eq!(sched.snapshot().unloads.get("c:latest"), Some(&1));

    let id = queued(sched.attach("a", Keep::For(ms(500)), t0));
    assert_eq!(sched.take_grant(id), Some(Ok(())));
    sched.pump(t0 + ms(100));
    sched.release("a", t0 + ms(200));
    assert_eq!(sched.pump(t0 + ms(200)), Some(t0 + ms(700)));
    sched.pump(t0 + ms(700));
    sched.pump(t0 + ms(710));
    assert_eq!(sched.snapshot().unloads.get("a:latest"), Some(&1));
}

#[test]
fn an_unload_request_waits_for_in_flight_requests_and_forever_never_expires() {
    let mut sched = sched();
    let t0 = Instant::now();
    let id = queued(sched.attach("a", Keep::Forever, t0));
    assert_eq!(sched.take_grant(id), Some(Ok(())));
    sched.pump(t0 + ms(100));
    sched.release("a", t0 + ms(100));
    assert_eq!(sched.pump(t0 + ms(100)), None, "kept forever");
    assert_eq!(
        sched.attach("a", Keep::Forever, t0 + ms(100)),
        Attach::Ready
    );
    sched.expire("a", t0 + ms(100));
    assert_eq!(sched.snapshot().resident, ["a:latest"], "still in use");
    sched.release("a", t0 + ms(200));
    sched.pump(t0 + ms(210));
    assert_eq!(sched.snapshot().unloads.get("a:latest"), Some(&1));
}

#[test]
fn a_model_larger_than_vram_fails_and_a_cancel_leaves_the_queue() {
    let mut sched = sched();
    let t0 = Instant::now();
    let id = queued(sched.attach("big", KEEP, t0));
    assert_eq!(
        sched.take_grant(id),
        Some(Err(
            "model requires more system memory (11.0 GiB) than is available (10.0 GiB)".into()
        ))
    );
    sched.preload("a");
    assert_eq!(sched.attach("a", KEEP, t0), Attach::Ready);
    let b = queued(sched.attach("b", KEEP, t0));
    sched.cancel(b, "b", t0);
    assert_eq!(sched.snapshot().pending, 0);
    sched.release("a", t0);
    sched.pump(t0 + ms(20));
    // As in Ollama, a victim once chosen is not reprieved when the request that needed its room
    // goes away.
    assert_eq!(sched.snapshot().unloads.get("a:latest"), Some(&1));
    assert_eq!(human_bytes(512), "512 B");
}

#[test]
fn max_loaded_models_caps_the_resident_count_whatever_the_room() {
    let mut sched = Sched::new(Config {
        max_loaded: Some(1),
        ..sched().config
    });
    let t0 = Instant::now();
    sched.preload("c");
    let id = queued(sched.attach("x", KEEP, t0));
    sched.pump(t0 + ms(10));
    assert_eq!(
        sched.take_grant(id),
        Some(Ok(())),
        "c was idle and made way"
    );
    assert_eq!(sched.snapshot().unloads.get("c:latest"), Some(&1));
}

#[test]
fn a_full_pending_queue_refuses_cold_requests_but_never_resident_ones() {
    let mut sched = Sched::new(Config {
        max_pending: Some(1),
        ..sched().config
    });
    let t0 = Instant::now();
    sched.preload("a");
    assert_eq!(sched.attach("a", KEEP, t0), Attach::Ready);
    queued(sched.attach("b", KEEP, t0));
    assert_eq!(sched.attach("c", KEEP, t0), Attach::Busy);
    assert_eq!(sched.attach("a", KEEP, t0), Attach::Ready);
    assert_eq!(sched.snapshot().pending, 1);
}
