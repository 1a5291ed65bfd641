//! Unit tests of the scheduler's swap rule ("Model swaps"), time passed in: a simulated host whose VRAM
//! holds one model at a time ([`HostVram`]), clients in a loop, and the scheduler between them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use super::{Fit, HostVram};
use crate::scheduler::{
    Ask, Limits, Offer, Placer, Requester, Scheduler, SwapRule, SwitchReason, Ticket, TicketId,
    Tier,
};

const GIB: u64 = 1 << 30;
const SERVICE: Duration = Duration::from_millis(100);
const LOAD: Duration = Duration::from_millis(300);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn rule(max_defer: Duration) -> SwapRule {
    SwapRule {
        enabled: true,
        max_defer: [max_defer / 4, max_defer, max_defer * 4],
        idle_grace: ms(300),
    }
}

/// One GPU with `slots` slots and room for one of the models `a`, `b`, `c` (8 GiB each in 10).
struct Gpu {
    vram: HostVram,
    slots: u32,
    busy: u32,
    /// Swap-aware placement (the rule's questions answered); off: every model runs at once and
    /// evicts what it must, as Ollama alone does.
    aware: bool,
    loading_until: Option<Instant>,
    switches: Vec<(Instant, String, SwitchReason)>,
}

impl Gpu {
    fn new(slots: u32, aware: bool) -> Self {
        Gpu {
            vram: HostVram::with_sizes(
                "gpu",
                Some(10 * GIB),
                &[("a", 8 * GIB), ("b", 8 * GIB), ("c", 8 * GIB), ("d", GIB)],
            ),
            slots,
            busy: 0,
            aware,
            loading_until: None,
            switches: Vec::new(),
        }
    }
}

/// What a dispatch reserved: whether it starts a load.
#[derive(Debug)]
struct Slot {
    loads: bool,
}

impl Placer<Slot> for Gpu {
    fn offer(&mut self, model: Option<&str>, now: Instant) -> Offer<Slot> {
        let model = model.expect("every test ticket names a model");
        let fit = self.vram.fit(model, now);
        if self.aware && matches!(fit, Fit::Switch | Fit::Blocked) {
            return Offer::Cold(self.vram.cold(now));
        }
        if self.busy >= self.slots {
            return Offer::Wait;
        }
        let loads = self.vram.dispatched(model, now, SystemTime::now());
        self.busy += 1;
        if loads {
            self.loading_until = Some(now + LOAD);
        }
        Offer::Run(Slot { loads })
    }

    fn switch(&mut self, _host: &str, model: &str, now: Instant, why: SwitchReason, by: Requester) {
        self.vram.begin_switch(model, false, Some(by), now);
        self.switches.push((now, model.to_owned(), why));
    }
}

/// A client sending one request after another, `inflight` at a time, `think` apart.
#[derive(Clone, Copy)]
struct Client {
    name: &'static str,
    model: &'static str,
    tier: Tier,
    inflight: u32,
    think: Duration,
}

fn client(name: &'static str, model: &'static str) -> Client {
    Client {
        name,
        model,
        tier: Tier::Normal,
        inflight: 1,
        think: ms(5),
    }
}

struct Running {
    end: Instant,
    id: TicketId,
    client: usize,
    model: &'static str,
    loads: bool,
    enqueued: Instant,
}

#[derive(Default, Debug, Clone)]
struct Served {
    requests: u32,
    /// Service time plus the loads its requests started.
    gpu: Duration,
    worst_latency: Duration,
}

struct Sim {
    scheduler: Scheduler<(usize, Instant)>,
    gpu: Gpu,
    start: Instant,
    now: Instant,
    clients: Vec<Client>,
    arrivals: Vec<(Instant, usize)>,
    running: Vec<Running>,
    served: Vec<Served>,
    /// While false, a client's completed request is not followed by another.
    looping: Vec<bool>,
}

impl Sim {
    fn new(gpu: Gpu, rule: SwapRule, clients: &[Client]) -> Self {
        let start = Instant::now();
        let mut scheduler = Scheduler::new(Limits::default());
        scheduler.set_swap(rule);
        let mut sim = Sim {
            scheduler,
            gpu,
            start,
            now: start,
            clients: clients.to_vec(),
            arrivals: Vec::new(),
            running: Vec::new(),
            served: vec![Served::default(); clients.len()],
            looping: vec![true; clients.len()],
        };
        for (index, client) in clients.iter().enumerate() {
            for _ in 0..client.inflight {
                sim.arrivals.push((start, index));
            }
        }
        sim
    }

    /// A client that starts now.
    fn add(&mut self, client: Client, looping: bool) -> usize {
        self.clients.push(client);
        self.served.push(Served::default());
        self.looping.push(looping);
        let index = self.clients.len() - 1;
        for _ in 0..client.inflight {
            self.arrivals.push((self.now, index));
        }
        index
    }

    fn enqueue(&mut self, index: usize) -> TicketId {
        let client = self.clients[index];
        let ticket = Ticket {
            ask: Ask {
                client: Arc::from(client.name),
                member: None,
                tier: client.tier,
                bytes: 0,
                model: Some(Arc::from(client.model)),
                affinity: None,
            },
            payload: (index, self.now),
        };
        match self.scheduler.enqueue(self.now, ticket) {
            Ok(admitted) => admitted.id,
            Err((rejection, _)) => panic!("rejected: {rejection}"),
        }
    }

    fn pump(&mut self) {
        while let Some(dispatch) = self.scheduler.next_on(self.now, &mut self.gpu) {
            let (client, enqueued) = dispatch.payload;
            let begins = self
                .gpu
                .loading_until
                .filter(|until| *until > self.now)
                .unwrap_or(self.now);
            self.running.push(Running {
                end: begins + SERVICE,
                id: dispatch.id,
                client,
                model: self.clients[client].model,
                loads: dispatch.placement.loads,
                enqueued,
            });
        }
    }

    /// Runs events until `at` (relative to the start).
    fn run_until(&mut self, at: Duration) {
        let until = self.start + at;
        loop {
            let arrivals: Vec<usize> = self
                .arrivals
                .iter()
                .filter(|(t, _)| *t <= self.now)
                .map(|(_, i)| *i)
                .collect();
            self.arrivals.retain(|(t, _)| *t > self.now);
            for index in arrivals {
                self.enqueue(index);
            }
            self.pump();
            let next = [
                self.running.iter().map(|r| r.end).min(),
                self.arrivals.iter().map(|(t, _)| *t).min(),
                self.scheduler.next_deadline(),
            ]
            .into_iter()
            .flatten()
            .min();
            let Some(next) = next.filter(|next| *next <= until) else {
                self.now = until;
                return;
            };
            self.now = next.max(self.now);
            let (done, left): (Vec<Running>, Vec<Running>) =
                self.running.drain(..).partition(|r| r.end <= self.now);
            self.running = left;
            for run in done {
                self.gpu.busy -= 1;
                self.gpu
                    .vram
                    .completed(run.model, run.loads.then_some(LOAD), self.now);
                // The request that started a load is charged it; its batch is not.
                let cost = SERVICE + if run.loads { LOAD } else { Duration::ZERO };
                self.scheduler.complete(run.id, cost, self.now);
                let served = &mut self.served[run.client];
                served.requests += 1;
                served.gpu += SERVICE + if run.loads { LOAD } else { Duration::ZERO };
                served.worst_latency = served
                    .worst_latency
                    .max(self.now.saturating_duration_since(run.enqueued));
                if self.looping[run.client] {
                    let think = self.clients[run.client].think;
                    self.arrivals.push((self.now + think, run.client));
                }
            }
        }
    }

    fn total(&self) -> u32 {
        self.served.iter().map(|s| s.requests).sum()
    }
}

#[test]
fn a_request_for_a_model_that_does_not_fit_is_held_while_the_resident_model_has_work() {
    let mut sim = Sim::new(
        Gpu::new(1, true),
        rule(ms(2000)),
        &[client("x", "a"), client("y", "b")],
    );
    sim.run_until(ms(1500));
    // Model a came first; b is held: x is served back to back, y not at all yet.
    assert_eq!(sim.served[1].requests, 0);
    assert!(sim.served[0].requests >= 10, "{:?}", sim.served);
    let held = sim.scheduler.held();
    assert_eq!(held.get("gpu").map(|h| h.0), Some(1), "{held:?}");
    assert!(sim.gpu.switches.is_empty());
}

#[test]
fn the_switch_comes_at_the_bound_and_the_held_request_then_runs() {
    let bound = ms(2000);
    let mut sim = Sim::new(
        Gpu::new(1, true),
        rule(bound),
        &[client("x", "a"), client("y", "b")],
    );
    sim.run_until(ms(3000));
    let (at, model, why) = sim.gpu.switches[0].clone();
    assert_eq!((model.as_str(), why), ("b", SwitchReason::Bound));
    // Held from its arrival (just after x's first dispatch) until the bound.
    let after = at.saturating_duration_since(sim.start);
    assert!(after >= bound && after < bound + SERVICE, "{after:?}");
    assert!(sim.served[1].requests >= 1);
    // Its latency: the bound, x's request in flight, the load, its own service.
    assert!(sim.served[1].worst_latency <= bound + SERVICE + LOAD + SERVICE + ms(10));
}

#[test]
fn the_requests_waiting_for_the_new_model_go_together_and_share_one_load() {
    let mut y = client("y", "b");
    y.inflight = 3;
    let mut sim = Sim::new(Gpu::new(2, true), rule(ms(1000)), &[client("x", "a"), y]);
    sim.run_until(ms(1000));
    assert!(sim.running.iter().all(|r| r.model == "a"));
    // The bound passes: a drains, then b's requests go two at a time (two slots).
    sim.run_until(ms(1150));
    let b: Vec<&Running> = sim.running.iter().filter(|r| r.model == "b").collect();
    assert_eq!(b.len(), 2, "both slots take b at once");
    assert_eq!(
        b.iter().filter(|r| r.loads).count(),
        1,
        "one load for the batch"
    );
}

#[test]
fn a_loop_client_pausing_shorter_than_the_grace_does_not_make_a_switch_before_the_bound() {
    let mut x = client("x", "a");
    x.think = ms(50); // well under the 300 ms grace
    let mut sim = Sim::new(Gpu::new(1, true), rule(ms(4000)), &[x, client("y", "b")]);
    sim.run_until(ms(3900));
    assert!(sim.gpu.switches.is_empty(), "{:?}", sim.gpu.switches);
}

#[test]
fn idle_resident_models_let_the_held_request_switch_after_the_grace() {
    let mut sim = Sim::new(
        Gpu::new(1, true),
        rule(ms(10_000)),
        &[client("x", "a"), client("y", "b")],
    );
    sim.run_until(ms(500));
    sim.looping[0] = false; // x stops
    sim.run_until(ms(1500));
    let (at, model, why) = sim.gpu.switches[0].clone();
    assert_eq!((model.as_str(), why), ("b", SwitchReason::Idle));
    assert!(at.saturating_duration_since(sim.start) < ms(1200));
}

#[test]
fn a_model_switched_to_stays_for_the_bound_except_for_a_high_tier_request_at_its_own() {
    let bound = ms(2000);
    // Three models: b and c both wait from the start; after the switch to b, c (already past
    // its bound) still waits for b's stay.
    let mut sim = Sim::new(
        Gpu::new(1, true),
        rule(bound),
        &[client("x", "a"), client("y", "b"), client("z", "c")],
    );
    sim.run_until(ms(6000));
    let times: Vec<Duration> = sim
        .gpu
        .switches
        .iter()
        .map(|(at, _, _)| at.saturating_duration_since(sim.start))
        .collect();
    assert!(times.len() >= 2, "{times:?}");
    assert!(times[1] - times[0] >= bound, "{times:?}");

    // A high-tier request switches at its own (shorter) bound, inside the stay.
    let mut urgent = client("u", "c");
    urgent.tier = Tier::High;
    let mut sim = Sim::new(
        Gpu::new(1, true),
        rule(bound),
        &[client("x", "a"), client("y", "b")],
    );
    sim.run_until(ms(2600)); // switched to b at about 2 s
    sim.add(urgent, false);
    sim.run_until(ms(4000));
    let switched = sim.gpu.switches.iter().find(|(_, m, _)| m == "c");
    let (at, _, _) = switched.expect("the high-tier request switched");
    let held = at.saturating_duration_since(sim.start + ms(2600));
    assert!(held >= bound / 4 && held < bound / 4 + ms(200), "{held:?}");
}

#[test]
fn a_higher_tier_request_held_for_its_model_lets_lower_tiers_use_the_resident_one() {
    let mut urgent = client("u", "b");
    urgent.tier = Tier::High;
    let mut batch = client("x", "a");
    batch.tier = Tier::Low;
    let mut sim = Sim::new(Gpu::new(1, true), rule(ms(2000)), &[batch]);
    sim.run_until(ms(100));
    sim.add(urgent, true);
    sim.run_until(ms(580));
    // The high-tier ticket is held (its bound is 500 ms): the low tier keeps the GPU busy.
    assert_eq!(sim.served[1].requests, 0);
    assert!(sim.served[0].requests >= 2, "{:?}", sim.served);
    sim.run_until(ms(1500));
    assert!(sim.served[1].requests >= 1);
    assert!(sim.served[1].worst_latency <= ms(500) + SERVICE + LOAD + SERVICE + ms(10));
}

#[test]
fn gpu_time_stays_fair_with_the_load_charged_to_the_client_that_caused_it() {
    let mut x = client("x", "a");
    x.inflight = 4;
    let mut sim = Sim::new(Gpu::new(1, true), rule(ms(1000)), &[x, client("y", "b")]);
    sim.run_until(ms(60_000));
    let (gx, gy) = (
        sim.served[0].gpu.as_secs_f64(),
        sim.served[1].gpu.as_secs_f64(),
    );
    let share = gx / (gx + gy);
    assert!((share - 0.5).abs() < 0.05, "x {gx:.1} s, y {gy:.1} s");
    assert!(sim.served[1].requests > 100, "{:?}", sim.served);
}

#[test]
fn three_cold_models_in_turn_are_all_served_within_their_bound() {
    let bound = ms(1000);
    let mut sim = Sim::new(
        Gpu::new(1, true),
        rule(bound),
        &[client("x", "a"), client("y", "b"), client("z", "c")],
    );
    sim.run_until(ms(30_000));
    for served in &sim.served {
        assert!(served.requests > 30, "{:?}", sim.served);
        // Held at most the bound plus the stay of the model before, with their drains and
        // loads.
        assert!(
            served.worst_latency <= 2 * bound + 2 * (SERVICE + LOAD) + SERVICE + ms(20),
            "{:?}",
            sim.served
        );
    }
}

#[test]
fn a_cancelled_held_request_makes_no_switch() {
    let mut sim = Sim::new(Gpu::new(1, true), rule(ms(1000)), &[client("x", "a")]);
    sim.run_until(ms(200));
    let y = sim.add(client("y", "b"), false);
    sim.arrivals.clear();
    let id = sim.enqueue(y);
    sim.pump();
    assert_eq!(sim.scheduler.held().get("gpu").map(|h| h.0), Some(1));
    assert!(sim.scheduler.cancel(id).is_some());
    assert!(sim.scheduler.held().is_empty());
    sim.run_until(ms(3000));
    assert!(sim.gpu.switches.is_empty());
    assert_eq!(sim.served[1].requests, 0);
}

#[test]
fn a_model_that_fits_beside_the_resident_one_is_not_held() {
    let mut sim = Sim::new(
        Gpu::new(2, true),
        rule(ms(5000)),
        &[client("x", "a"), client("y", "d")],
    );
    sim.run_until(ms(1000));
    assert!(sim.served[1].requests >= 5, "{:?}", sim.served);
    assert!(sim.gpu.switches.is_empty());
}

#[test]
fn batching_by_model_triples_what_the_gpu_completes_when_loads_are_three_services() {
    let clients = [client("x", "a"), client("y", "b")];
    let mut plain = Sim::new(
        Gpu::new(1, false),
        SwapRule {
            enabled: false,
            ..SwapRule::default()
        },
        &clients,
    );
    plain.run_until(ms(60_000));
    let mut aware = Sim::new(Gpu::new(1, true), rule(ms(3000)), &clients);
    aware.run_until(ms(60_000));
    let ratio = f64::from(aware.total()) / f64::from(plain.total());
    assert!(
        ratio >= 3.0,
        "plain {} requests, aware {} (×{ratio:.2})",
        plain.total(),
        aware.total()
    );
}

#[test]
fn held_requests_are_reported_per_host_with_their_age() {
    let mut sim = Sim::new(
        Gpu::new(1, true),
        rule(ms(5000)),
        &[client("x", "a"), client("y", "b"), client("z", "b")],
    );
    sim.run_until(ms(1000));
    let held: HashMap<Arc<str>, (u32, Duration)> = sim.scheduler.held();
    let (count, oldest) = held.get("gpu").copied().expect("held on gpu");
    assert_eq!(count, 2);
    assert!(oldest >= ms(800), "{oldest:?}");
    assert!(sim.scheduler.waiting_for("b"));
}
