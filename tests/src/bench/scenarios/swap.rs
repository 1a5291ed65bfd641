//! Model swap: one upstream slot, VRAM room for one model of two (8 GiB each in 10 GiB), a load
//! L = 3 S. Two clients of the same tier each loop on their own model: straight at the fake
//! (Ollama alone) every request evicts the other model and pays an unload and a load; through oqp
//! with `queue.model_swap` off fair share alternates the clients, and so the models, just the same;
//! with it on oqp serves the resident model while it has work and switches as a batch, each held
//! request waiting at most `max_defer`. Requests/s against the theory, the largest latency
//! against its bound, and, with client A keeping 4 requests in flight, client B's share of GPU
//! time (Ollama alone starves it).
//!
//! Every run has a fresh fake (nothing left loaded or waiting from the run before); each oqp run
//! first sends one request per model and waits until `/queue/status` shows the model's footprint
//! resident (a completed load asks the control plane for an early poll), so that it measures the
//! steady state, not how oqp learns the models' sizes.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::{ADMIN_KEY, ModelSwap, OqpConfig, fair_key, size};
use crate::bench::load::{Conn, Req};
use crate::bench::procs::{self, FakeSpec, Proc, VramSpec};
use crate::bench::report::{Report, Row, na};
use crate::bench::{Bench, SCENARIO_SWAP};

const GIB: u64 = 1 << 30;
/// The two models and their footprints: one fits, two do not.
const MODELS: &[(&str, u64)] = &[("alpha", 8 * GIB), ("beta", 8 * GIB)];
/// The host's VRAM.
const VRAM: u64 = 10 * GIB;
/// The throughput target: oqp with the feature on over Ollama alone.
const TARGET_RATIO: f64 = 3.0;
/// The GPU share target for client B, with A keeping 4 requests in flight.
const TARGET_SHARE: (f64, f64) = (0.45, 0.55);
/// Client A's requests in flight in the second setting.
const GREEDY: usize = 4;

/// The timings of a run (the quick run scales them all down).
#[derive(Debug, Clone, Copy)]
struct Timing {
    /// Service time S.
    service: Duration,
    /// Load time L.
    load: Duration,
    unload: Duration,
    /// `queue.model_swap.max_defer`, normal tier.
    max_defer: Duration,
    idle_grace: Duration,
    /// How long each run lasts.
    window: Duration,
}

/// Where the clients send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setup {
    /// Straight at the fake.
    Alone,
    /// Through oqp, `queue.model_swap.enabled` as given.
    Oqp { swap: bool },
}

/// What one client got in a run.
#[derive(Debug, Clone, Copy, Default)]
struct Served {
    /// Answers inside the window.
    requests: u64,
    /// Summed `total_duration` of those answers: the client's GPU time.
    gpu: Duration,
    worst_latency: Duration,
    failed: u64,
}

/// One run: both clients.
#[derive(Debug, Clone, Copy, Default)]
struct Run {
    clients: [Served; 2],
    window: Duration,
    /// Each client's GPU time over the run's whole turns (see [`whole_turns`]).
    turns_gpu: [Duration; 2],
    /// How many whole turns those are; `None`: the model never changed, every answer counts.
    turns: Option<usize>,
}

impl Timing {
    fn of(bench: &Bench) -> Timing {
        let ms = |full, quick| Duration::from_millis(size(bench, full, quick));
        let timing = Timing {
            // Quick: a load stays above what oqp takes for a warm start (100 ms), so that the
            // warm-up still sees it and learns the footprint.
            service: ms(50, 40),
            load: ms(150, 120),
            unload: ms(10, 5),
            max_defer: ms(1500, 300),
            idle_grace: ms(300, 60),
            window: ms(0, 300),
        };
        if bench.quick {
            return timing;
        }
        // Full: two turns of each model, so that neither client gains from where the window
        // ends (the first turn goes to A: at the start nothing resident has work).
        Timing {
            window: 4 * timing.turn(),
            ..timing
        }
    }

    /// One model's turn with the feature on: `max_defer` of its requests, then the one running
    /// at the switch, the unload and the load.
    fn turn(&self) -> Duration {
        self.max_defer + self.service + self.unload + self.load
    }

    /// Requests/s of Ollama alone, in theory: every request pays an unload and a load.
    fn alone(&self) -> f64 {
        1.0 / (self.service + self.unload + self.load).as_secs_f64()
    }

    /// Requests/s with the feature on, in theory: `max_defer / S` requests per turn.
    fn theory(&self) -> f64 {
        (self.max_defer.as_secs_f64() / self.service.as_secs_f64()) / self.turn().as_secs_f64()
    }

    /// The largest latency with the feature on: `max_defer + unload + L + 2 S`.
    fn bound(&self) -> Duration {
        self.max_defer + self.unload + self.load + 2 * self.service
    }
}

impl Run {
    fn requests(&self) -> u64 {
        self.clients.iter().map(|c| c.requests).sum()
    }

    fn per_second(&self) -> f64 {
        self.requests() as f64 / self.window.as_secs_f64()
    }

    fn worst_latency(&self) -> Duration {
        self.clients
            .iter()
            .map(|c| c.worst_latency)
            .max()
            .unwrap_or_default()
    }

    fn failed(&self) -> u64 {
        self.clients.iter().map(|c| c.failed).sum()
    }

    /// Client `i`'s share of the GPU time; `None` when nothing was served.
    fn share(&self, i: usize) -> Option<f64> {
        let all: f64 = self.turns_gpu.iter().map(Duration::as_secs_f64).sum();
        (all > 0.0).then(|| self.turns_gpu[i].as_secs_f64() / all)
    }
}

/// Runs the three setups, one request in flight per client and then A keeping `GREEDY`, and
/// adds the rows.
pub async fn run(bench: &Bench, report: &mut Report) -> anyhow::Result<()> {
    let timing = Timing::of(bench);
    let setups = [
        Setup::Alone,
        Setup::Oqp { swap: false },
        Setup::Oqp { swap: true },
    ];
    let mut single = [Run::default(); 3];
    for (i, setup) in setups.into_iter().enumerate() {
        single[i] = measure(bench, timing, setup, 1, timing.window).await?;
    }
    // Off, fair share alternates the clients whatever A offers: only alone and on are compared.
    let mut greedy = [Run::default(); 2];
    for (i, setup) in [setups[0], setups[2]].into_iter().enumerate() {
        greedy[i] = measure(bench, timing, setup, GREEDY, timing.window).await?;
    }
    let [alone, off, on] = single;
    let failed = single.iter().chain(&greedy).map(Run::failed).sum::<u64>();
    let failed = if failed > 0 {
        format!(" — {failed} failed")
    } else {
        String::new()
    };
    let ms = |d: Duration| d.as_millis();
    let per_second = |run: &Run| format!("{:.2}/s", run.per_second());

    report.push(
        Row::new(
            SCENARIO_SWAP,
            format!(
                "requests/s, two same-tier clients each looping on its own model (1 slot, room for one model of two; S = {} ms, L = {} ms, unload {} ms; {:.2} s each): Ollama alone (direct; theory 1 / (S + unload + L) = {:.2}/s), oqp with `queue.model_swap` off (oqp){failed}",
                ms(timing.service),
                ms(timing.load),
                ms(timing.unload),
                timing.window.as_secs_f64(),
                timing.alone()
            ),
        )
        .direct(per_second(&alone))
        .oqp(per_second(&off)),
    );
    report.push(
        Row::new(
            SCENARIO_SWAP,
            format!(
                "requests/s, oqp with `queue.model_swap` on (`max_defer` {} ms); theory (max_defer/S) / (max_defer + S + unload + L) = {:.2}/s",
                ms(timing.max_defer),
                timing.theory()
            ),
        )
        .direct(per_second(&alone))
        .oqp(per_second(&on)),
    );
    let ratio = |a: &Run, b: &Run| (b.requests() > 0).then(|| a.per_second() / b.per_second());
    let on_alone = ratio(&on, &alone);
    report.push(
        Row::new(
            SCENARIO_SWAP,
            format!(
                "on ÷ alone (on ÷ off: {})",
                ratio(&on, &off).map_or_else(na, |r| format!("×{r:.2}"))
            ),
        )
        .oqp(on_alone.map_or_else(na, |r| format!("×{r:.2}")))
        .target(
            &format!("oqp on ≥ {TARGET_RATIO}× alone"),
            on_alone.map(|r| r >= TARGET_RATIO && failed.is_empty()),
        ),
    );
    let bound = timing.bound();
    report.push(
        Row::new(
            SCENARIO_SWAP,
            format!(
                "largest latency, either client (oqp: on; off: {} ms)",
                ms(off.worst_latency())
            ),
        )
        .direct(format!("{} ms", ms(alone.worst_latency())))
        .oqp(format!("{} ms", ms(on.worst_latency())))
        .target(
            &format!("oqp on ≤ max_defer + unload + L + 2S = {} ms", ms(bound)),
            Some(on.requests() > 0 && on.worst_latency() <= bound),
        ),
    );
    let [greedy_alone, greedy_on] = greedy;
    let percent = |share: Option<f64>| share.map_or_else(na, |s| format!("{:.1} %", 100.0 * s));
    let b_share = greedy_on.share(1);
    report.push(
        Row::new(
            SCENARIO_SWAP,
            format!(
                "client B's share of GPU time (Σ `total_duration`), A keeping {GREEDY} requests in flight, B 1 (oqp: on; over {}); answers A / B: alone {} / {}, on {} / {} (B's largest latency on: {} ms)",
                greedy_on.turns.map_or_else(
                    || "every answer: no whole turn".to_owned(),
                    |turns| format!("its first {turns} whole turns")
                ),
                greedy_alone.clients[0].requests,
                greedy_alone.clients[1].requests,
                greedy_on.clients[0].requests,
                greedy_on.clients[1].requests,
                ms(greedy_on.clients[1].worst_latency)
            ),
        )
        .direct(percent(greedy_alone.share(1)))
        .oqp(percent(b_share))
        .target(
            &format!(
                "oqp on {:.0}–{:.0} %",
                100.0 * TARGET_SHARE.0,
                100.0 * TARGET_SHARE.1
            ),
            b_share.map(|s| (TARGET_SHARE.0..=TARGET_SHARE.1).contains(&s)),
        ),
    );
    Ok(())
}

/// One run on a fresh fake: client A (`alpha`) keeps `inflight` requests in flight, client B
/// (`beta`) one, for `window`.
async fn measure(
    bench: &Bench,
    timing: Timing,
    setup: Setup,
    inflight: usize,
    window: Duration,
) -> anyhow::Result<Run> {
    let spec = FakeSpec {
        slots: 1,
        latency: timing.service,
        vram: Some(VramSpec {
            capacity: VRAM,
            models: MODELS,
            load_time: timing.load,
            unload_time: timing.unload,
        }),
        ..FakeSpec::default()
    };
    let fake = procs::spawn_fake(&bench.binaries, spec).await?;
    let oqp = match setup {
        Setup::Alone => None,
        Setup::Oqp { swap } => {
            let config = OqpConfig {
                vram: Some("10GiB".to_owned()),
                model_swap: Some(ModelSwap {
                    enabled: swap,
                    max_defer: timing.max_defer,
                    idle_grace: timing.idle_grace,
                }),
                ..OqpConfig::new(&fake.url(), 1)
            };
            match procs::spawn_oqp(&bench.binaries, &config.render()).await {
                Ok(oqp) => Some(oqp),
                Err(error) => {
                    fake.stop().await;
                    return Err(error);
                }
            }
        }
    };
    let result = async {
        let addr = match &oqp {
            Some(oqp) => {
                // With the feature off oqp holds nothing back, so the sizes it would learn do
                // not matter: the quick run saves the wait (two polls).
                if !bench.quick || setup == (Setup::Oqp { swap: true }) {
                    warm_up(oqp).await?;
                }
                oqp.addr()
            }
            None => fake.addr(),
        };
        let keyed = oqp.is_some();
        loops(addr, keyed, [inflight, 1], window).await
    }
    .await;
    if let Some(oqp) = oqp {
        oqp.stop().await;
    }
    fake.stop().await;
    result
}

/// A non-streamed generate for `model`, with client `client`'s key through oqp.
fn request(model: &str, client: usize, keyed: bool) -> Req {
    let key = keyed.then(|| fair_key(client));
    Req::post(
        "/api/generate",
        key.as_deref(),
        serde_json::json!({"model": model, "prompt": "hi", "stream": false}).to_string(),
    )
}

/// One request per model, each followed by the wait until `/queue/status` shows the model
/// resident with its footprint.
async fn warm_up(oqp: &Proc) -> anyhow::Result<()> {
    let mut conn = Conn::open(oqp.addr()).await?;
    let status = Req::get("/queue/status", Some(ADMIN_KEY));
    for (client, (model, bytes)) in MODELS.iter().enumerate() {
        let answer = conn.send(&request(model, client, true)).await?;
        anyhow::ensure!(
            answer.status.is_success(),
            "warm-up request for {model}: {}",
            answer.status
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let answer = conn.send(&status).await?;
            let doc: serde_json::Value = serde_json::from_slice(&answer.body).unwrap_or_default();
            if resident(&doc, model, *bytes) {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{model}'s footprint never showed in /queue/status: {}",
                doc["hosts"]
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(())
}

/// Whether the first host's `vram.resident` lists `model` (any tag) with `bytes`.
fn resident(status: &serde_json::Value, model: &str, bytes: u64) -> bool {
    status["hosts"][0]["vram"]["resident"]
        .as_array()
        .is_some_and(|models| {
            models.iter().any(|entry| {
                entry["model"]
                    .as_str()
                    .is_some_and(|name| name.split(':').next() == Some(model))
                    && entry["bytes"].as_u64() == Some(bytes)
            })
        })
}

/// Client `i` keeps `inflight[i]` requests for model `i` in flight until `window` has passed;
/// an answer counts when it arrives inside the window.
async fn loops(
    addr: SocketAddr,
    keyed: bool,
    inflight: [usize; 2],
    window: Duration,
) -> anyhow::Result<Run> {
    let mut conns = Vec::new();
    for (client, n) in inflight.iter().enumerate() {
        for _ in 0..*n {
            conns.push((client, Conn::open(addr).await?));
        }
    }
    let started = Instant::now();
    let deadline = started + window;
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|(client, mut conn)| {
            let request = request(MODELS[client].0, client, keyed);
            tokio::spawn(async move {
                let mut served = Served::default();
                let mut answers = Vec::new();
                loop {
                    let sent = Instant::now();
                    let sending = conn.send(&request);
                    // An answer still owed at the deadline is dropped: the fake is not reused.
                    let Ok(answer) = tokio::time::timeout_at(deadline.into(), sending).await else {
                        break;
                    };
                    match answer {
                        Ok(answer) if answer.status.is_success() => {
                            let doc: serde_json::Value =
                                serde_json::from_slice(&answer.body).unwrap_or_default();
                            let gpu = Duration::from_nanos(
                                doc["total_duration"].as_u64().unwrap_or_default(),
                            );
                            served.requests += 1;
                            served.gpu += gpu;
                            served.worst_latency = served.worst_latency.max(sent.elapsed());
                            answers.push((Instant::now(), client, gpu));
                        }
                        _ => served.failed += 1,
                    }
                }
                (client, served, answers)
            })
        })
        .collect();
    let mut run = Run {
        window,
        ..Run::default()
    };
    let mut answers = Vec::new();
    for task in tasks {
        let (client, served, mine) = task.await?;
        answers.extend(mine);
        let total = &mut run.clients[client];
        total.requests += served.requests;
        total.gpu += served.gpu;
        total.worst_latency = total.worst_latency.max(served.worst_latency);
        total.failed += served.failed;
    }
    (run.turns_gpu, run.turns) = whole_turns(answers);
    Ok(run)
}

/// Each client's GPU time over the whole turns among `answers` (when, whose, GPU time): a turn
/// is a run of answers for one model, the last one is cut by the deadline, and an even number
/// of them is kept so that each client has as many; every answer when the model never changed
/// whole. The window starts on a turn (A's: at the start nothing resident has work), but where
/// it ends would otherwise give one client up to half a turn more.
pub fn whole_turns(mut answers: Vec<(Instant, usize, Duration)>) -> ([Duration; 2], Option<usize>) {
    answers.sort_by_key(|(at, _, _)| *at);
    let changes: Vec<usize> = (1..answers.len())
        .filter(|&i| answers[i].1 != answers[i - 1].1)
        .collect();
    let whole = changes.len() - changes.len() % 2;
    let (end, turns) = match whole {
        0 => (answers.len(), None),
        _ => (changes[whole - 1], Some(whole)),
    };
    let mut gpu = [Duration::ZERO; 2];
    for (_, client, time) in &answers[..end] {
        gpu[*client] += *time;
    }
    (gpu, turns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_share_counts_an_even_number_of_whole_turns() {
        let start = Instant::now();
        let answers = |clients: &[usize]| -> Vec<(Instant, usize, Duration)> {
            clients
                .iter()
                .enumerate()
                .map(|(i, client)| {
                    let at = start + Duration::from_millis(i as u64);
                    (at, *client, Duration::from_millis(10))
                })
                .collect()
        };
        let ms = Duration::from_millis;
        // A A | B B B | A | B (cut): three turns are whole; the first two (one each) count.
        assert_eq!(
            whole_turns(answers(&[0, 0, 1, 1, 1, 0, 1])),
            ([ms(20), ms(30)], Some(2))
        );
        // A A | B B | A (cut): two whole turns.
        assert_eq!(
            whole_turns(answers(&[0, 0, 1, 1, 0])),
            ([ms(20), ms(20)], Some(2))
        );
        // One change only, or none: every answer counts.
        assert_eq!(whole_turns(answers(&[0, 0, 1])), ([ms(20), ms(10)], None));
        assert_eq!(whole_turns(answers(&[0, 0])), ([ms(20), ms(0)], None));
        assert_eq!(whole_turns(Vec::new()), ([ms(0), ms(0)], None));
    }
}
