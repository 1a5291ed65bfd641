//! A deterministic discrete-event simulation of the dispatcher around a [`Scheduler`]: slots,
//! clients that keep a backlog (closed loop) or arrive at a rate (open loop), costs drawn from a
//! seeded generator. Used by the fairness tests; prints the measured figures.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Ask, ClientLimits, Limits, Scheduler, Ticket, TicketId, Tier};

/// SplitMix64: small, seeded, good enough for test workloads.
#[derive(Debug, Clone)]
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub(super) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[low, high)`.
    pub(super) fn uniform(&mut self, low: f64, high: f64) -> f64 {
        let unit = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        low + (high - low) * unit
    }
}

/// How long a client's requests take on the GPU.
#[derive(Debug, Clone, Copy)]
pub(super) enum Cost {
    Fixed(f64),
    Uniform(f64, f64),
}

/// How a client offers load.
#[derive(Debug, Clone, Copy)]
pub(super) enum Load {
    /// Keeps this many tickets waiting at all times.
    Backlog(u32),
    /// Submits one ticket every this many seconds (rejections are dropped).
    Every(f64),
}

#[derive(Debug, Clone)]
pub(super) struct SimClient {
    pub(super) name: Arc<str>,
    pub(super) limits: ClientLimits,
    pub(super) cost: Cost,
    pub(super) load: Load,
}

impl SimClient {
    pub(super) fn new(name: &str, weight: f64, cost: Cost, load: Load) -> Self {
        SimClient {
            name: Arc::from(name),
            limits: ClientLimits {
                weight,
                ..ClientLimits::default()
            },
            cost,
            load,
        }
    }
}

#[derive(Debug)]
pub(super) struct Sim {
    pub(super) scheduler: Scheduler<u64>,
    pub(super) t0: Instant,
    pub(super) now: Instant,
    slots: usize,
    clients: Vec<SimClient>,
    next_arrival: Vec<Option<Instant>>,
    running: Vec<(Instant, TicketId, usize, Duration)>,
    rng: Rng,
    /// GPU seconds charged per client (index into `clients`).
    pub(super) charged: Vec<f64>,
    /// Dispatch order, by client index.
    pub(super) order: Vec<usize>,
    /// Peak in-flight per client.
    pub(super) peak_inflight: Vec<u32>,
    by_name: HashMap<Arc<str>, usize>,
}

impl Sim {
    pub(super) fn new(limits: Limits, slots: usize, clients: Vec<SimClient>, seed: u64) -> Self {
        let mut scheduler = Scheduler::new(limits);
        let t0 = Instant::now();
        let mut by_name = HashMap::new();
        for (index, client) in clients.iter().enumerate() {
            scheduler.set_client(&client.name, client.limits);
            by_name.insert(client.name.clone(), index);
        }
        let count = clients.len();
        let mut sim = Sim {
            scheduler,
            t0,
            now: t0,
            slots,
            next_arrival: vec![None; count],
            clients: Vec::new(),
            running: Vec::new(),
            rng: Rng::new(seed),
            charged: vec![0.0; count],
            order: Vec::new(),
            peak_inflight: vec![0; count],
            by_name,
        };
        for (index, client) in clients.iter().enumerate() {
            sim.add_client(index, client.clone());
        }
        sim.clients = clients;
        sim
    }

    fn add_client(&mut self, index: usize, client: SimClient) {
        match client.load {
            Load::Backlog(depth) => {
                for _ in 0..depth {
                    self.submit(&client);
                }
            }
            Load::Every(_) => self.next_arrival[index] = Some(self.now),
        }
    }

    /// A client joins mid-run.
    pub(super) fn join(&mut self, client: SimClient) -> usize {
        let index = self.clients.len();
        self.scheduler.set_client(&client.name, client.limits);
        self.by_name.insert(client.name.clone(), index);
        self.charged.push(0.0);
        self.peak_inflight.push(0);
        self.next_arrival.push(None);
        self.clients.push(client.clone());
        self.add_client(index, client);
        index
    }

    fn submit(&mut self, client: &SimClient) {
        let ticket = Ticket {
            ask: Ask {
                client: client.name.clone(),
                member: None,
                tier: Tier::Normal,
                bytes: 100,
                model: None,
                affinity: None,
            },
            payload: 0,
        };
        let _ = self.scheduler.enqueue(self.now, ticket);
    }

    fn draw(&mut self, cost: Cost) -> Duration {
        let secs = match cost {
            Cost::Fixed(secs) => secs,
            Cost::Uniform(low, high) => self.rng.uniform(low, high),
        };
        Duration::from_secs_f64(secs)
    }

    /// Runs until `dispatches` more tickets have been dispatched.
    pub(super) fn run(&mut self, dispatches: usize) {
        let target = self.order.len() + dispatches;
        while self.order.len() < target {
            while self.running.len() < self.slots {
                let Some(dispatch) = self.scheduler.next(self.now, |_| Some(())) else {
                    break;
                };
                let index = self.by_name[&dispatch.client];
                let client = self.clients[index].clone();
                let cost = self.draw(client.cost);
                self.running
                    .push((self.now + cost, dispatch.id, index, cost));
                self.order.push(index);
                let inflight = self.running.iter().filter(|r| r.2 == index).count() as u32;
                self.peak_inflight[index] = self.peak_inflight[index].max(inflight);
                if let Load::Backlog(_) = client.load {
                    self.submit(&client);
                }
            }
            // Advance to the next event: a completion or an arrival.
            let completion = self.running.iter().map(|r| r.0).min();
            let arrival = self.next_arrival.iter().flatten().copied().min();
            let Some(at) = [completion, arrival].into_iter().flatten().min() else {
                return;
            };
            self.now = self.now.max(at);
            let mut finished = Vec::new();
            self.running.retain(|r| {
                if r.0 <= at {
                    finished.push(*r);
                    false
                } else {
                    true
                }
            });
            finished.sort_by_key(|r| (r.0, r.1));
            for (_, id, index, cost) in finished {
                self.charged[index] += cost.as_secs_f64();
                assert!(self.scheduler.complete(id, cost, self.now));
            }
            for index in 0..self.clients.len() {
                if let (Some(due), Load::Every(period)) =
                    (self.next_arrival[index], self.clients[index].load)
                    && due <= self.now
                {
                    let client = self.clients[index].clone();
                    self.submit(&client);
                    self.next_arrival[index] = Some(due + Duration::from_secs_f64(period));
                }
            }
        }
    }

    /// Runs until `horizon` of simulated time has passed since the start.
    pub(super) fn run_for(&mut self, horizon: Duration) {
        while self.now.duration_since(self.t0) < horizon {
            let before = self.order.len();
            self.run(1);
            if self.order.len() == before {
                return;
            }
        }
    }

    /// Each client's share of the charged GPU time.
    pub(super) fn shares(&self) -> Vec<f64> {
        let total: f64 = self.charged.iter().sum();
        self.charged.iter().map(|c| c / total).collect()
    }
}

/// Jain's fairness index of `values`: 1 when all equal, 1/n when one takes everything.
pub(super) fn jain(values: &[f64]) -> f64 {
    let sum: f64 = values.iter().sum();
    let squares: f64 = values.iter().map(|v| v * v).sum();
    sum * sum / (values.len() as f64 * squares)
}

/// The largest relative error of `shares` against `weights` normalised.
pub(super) fn share_error(shares: &[f64], weights: &[f64]) -> f64 {
    let total: f64 = weights.iter().sum();
    shares
        .iter()
        .zip(weights)
        .map(|(share, weight)| (share / (weight / total) - 1.0).abs())
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn limits() -> Limits {
        let mut limits = Limits::default();
        for tier in &mut limits.tiers {
            tier.max_depth = 100_000;
            tier.max_wait = Duration::from_secs(1_000_000);
        }
        limits.max_queued_bytes = u64::MAX;
        limits
    }

    fn weighted_run(slots: usize, costs: [Cost; 4], seed: u64) -> f64 {
        let weights = [1.0, 1.0, 2.0, 4.0];
        let clients = (0..4)
            .map(|i| SimClient::new(&format!("c{i}"), weights[i], costs[i], Load::Backlog(4)))
            .collect();
        let mut sim = Sim::new(limits(), slots, clients, seed);
        sim.run(20_000);
        let shares = sim.shares();
        let error = share_error(&shares, &weights);
        println!(
            "weights 1/1/2/4, {slots} slot(s), costs {costs:?}: shares {:.4?}, max relative error {:.2} %",
            shares,
            error * 100.0
        );
        error
    }

    #[test]
    fn weighted_shares_converge_to_weights() {
        let fixed = [Cost::Fixed(1.0); 4];
        let varied = [
            Cost::Fixed(1.0),
            Cost::Uniform(0.2, 3.0),
            Cost::Fixed(0.5),
            Cost::Uniform(0.5, 1.5),
        ];
        // Heavy spread: estimates (running means) are often off by 10x or more.
        let wild = [
            Cost::Uniform(0.05, 20.0),
            Cost::Fixed(0.1),
            Cost::Uniform(0.1, 5.0),
            Cost::Fixed(3.0),
        ];
        let mut worst: f64 = 0.0;
        for slots in [1, 2, 3] {
            worst = worst.max(weighted_run(slots, fixed, 1));
            worst = worst.max(weighted_run(slots, varied, 2));
            worst = worst.max(weighted_run(slots, wild, 3));
        }
        println!("worst share error: {:.2} %", worst * 100.0);
        assert!(worst < 0.05, "share error {worst}");
    }

    #[test]
    fn equal_weights_with_unequal_backlogs_are_fair() {
        let backlogs = [8, 8, 16, 32];
        for slots in [1, 2] {
            let clients = backlogs
                .iter()
                .enumerate()
                .map(|(i, &depth)| {
                    SimClient::new(
                        &format!("c{i}"),
                        1.0,
                        Cost::Uniform(0.2, 2.0),
                        Load::Backlog(depth),
                    )
                })
                .collect();
            let mut sim = Sim::new(limits(), slots, clients, 7);
            sim.run(20_000);
            let index = jain(&sim.shares());
            println!(
                "closed loop, backlogs 8/8/16/32, {slots} slot(s): shares {:.4?}, Jain {index:.5}",
                sim.shares()
            );
            assert!(index >= 0.99, "Jain {index}");
        }
    }

    #[test]
    fn equal_weights_with_unequal_arrival_rates_are_fair() {
        // Offered load 8:8:16:32, three times the capacity of two slots at a mean cost of 1 s.
        let periods = [4.0 / 3.0, 4.0 / 3.0, 2.0 / 3.0, 1.0 / 3.0];
        let clients = periods
            .iter()
            .enumerate()
            .map(|(i, &period)| {
                let mut client = SimClient::new(
                    &format!("c{i}"),
                    1.0,
                    Cost::Uniform(0.5, 1.5),
                    Load::Every(period),
                );
                client.limits.max_queued = 64;
                client
            })
            .collect();
        let mut sim = Sim::new(limits(), 2, clients, 11);
        sim.run(20_000);
        let index = jain(&sim.shares());
        println!(
            "open loop, rates 8/8/16/32 at 3x capacity, 2 slots: shares {:.4?}, Jain {index:.5}",
            sim.shares()
        );
        assert!(index >= 0.99, "Jain {index}");
    }

    #[test]
    fn a_newcomer_gets_at_most_one_request_of_advantage() {
        for slots in [1, 2] {
            let clients = (0..3)
                .map(|i| SimClient::new(&format!("c{i}"), 1.0, Cost::Fixed(1.0), Load::Backlog(10)))
                .collect();
            let mut sim = Sim::new(limits(), slots, clients, 3);
            sim.run(3_000);
            let newcomer = sim.join(SimClient::new(
                "new",
                1.0,
                Cost::Fixed(1.0),
                Load::Backlog(50),
            ));
            let start = sim.order.len();
            sim.run(40);
            let window = &sim.order[start..start + 40];
            let got = window.iter().filter(|&&i| i == newcomer).count();
            let first = window.iter().position(|&i| i == newcomer);
            println!(
                "newcomer, {slots} slot(s): {got} of the next 40 dispatches (fair: 10), first at {first:?}"
            );
            assert!(got <= 11, "newcomer got {got} of 40");
            assert!(got >= 9, "newcomer starved: {got} of 40");
            assert!(first.is_some_and(|first| first < 4));
        }
    }

    #[test]
    fn a_capped_client_never_exceeds_its_cap_and_never_blocks_others() {
        let mut capped = SimClient::new("capped", 1.0, Cost::Fixed(1.0), Load::Backlog(20));
        capped.limits.max_concurrent = 1;
        let other = SimClient::new("other", 1.0, Cost::Fixed(1.0), Load::Backlog(20));
        let mut sim = Sim::new(limits(), 4, vec![capped, other], 5);
        sim.run(4_000);
        let shares = sim.shares();
        println!(
            "cap 1 of 4 slots: peak in flight {:?}, shares {shares:.3?}",
            sim.peak_inflight
        );
        assert_eq!(sim.peak_inflight[0], 1);
        // The cap leaves three slots to the other client: no slot stays idle.
        assert!((shares[1] - 0.75).abs() < 0.01, "shares {shares:?}");
        let elapsed = sim.now.duration_since(sim.t0).as_secs_f64();
        assert!(
            elapsed <= 4_000.0 / 4.0 + 2.0,
            "slots stood idle: {elapsed} s"
        );
    }

    #[test]
    fn lifting_a_cap_causes_no_burst() {
        let mut capped = SimClient::new("capped", 1.0, Cost::Fixed(1.0), Load::Backlog(20));
        capped.limits.max_concurrent = 1;
        let other = SimClient::new("other", 1.0, Cost::Fixed(1.0), Load::Backlog(20));
        let mut sim = Sim::new(limits(), 4, vec![capped, other], 5);
        sim.run(4_000);
        sim.scheduler.set_client("capped", ClientLimits::default());
        let start = sim.order.len();
        sim.run(40);
        let got = sim.order[start..start + 40]
            .iter()
            .filter(|&&i| i == 0)
            .count();
        println!(
            "cap lifted after 1000 s at 1 of 4 slots: {got} of the next 40 dispatches (fair: 20)"
        );
        assert!(got <= 23, "burst of {got} of 40");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

        /// Any weights, any per-client cost distributions, 1–3 slots: after a long enough run
        /// (simulated time, so that even the most expensive client gets many turns) each
        /// backlogged client's share of GPU time is its weight's share within 5 %.
        #[test]
        fn shares_follow_any_weights(
            clients in proptest::collection::vec((1u32..=4, 0.2f64..3.0, 0.0f64..3.0), 2..=4),
            slots in 1usize..=3,
            seed in any::<u64>(),
        ) {
            let weights: Vec<f64> = clients.iter().map(|c| f64::from(c.0)).collect();
            let sims = clients
                .iter()
                .enumerate()
                .map(|(i, &(weight, low, spread))| {
                    SimClient::new(
                        &format!("c{i}"),
                        f64::from(weight),
                        Cost::Uniform(low, low + spread),
                        Load::Backlog(3),
                    )
                })
                .collect();
            let mut sim = Sim::new(limits(), slots, sims, seed);
            sim.run_for(Duration::from_secs(8_000));
            let error = share_error(&sim.shares(), &weights);
            prop_assert!(error < 0.05, "weights {weights:?}: shares {:?}, error {error}", sim.shares());
        }
    }
}
