//! Affinity on real engines: two llama.cpp `llama-server`s of two slots each
//! ([`crate::engine`], the random-weight `tiny.gguf` on CPU), oqp in front with both as
//! `kind: openai` hosts. Agent-like conversations (a long first turn of random words, a
//! shorter one each turn after, answers of a few tokens kept in the history). Three setups:
//! plain round robin (no model-aware routing, no affinity), model-aware routing with
//! affinity off, and affinity on; fresh engines for each run, so that no run finds another's
//! cache.
//!
//! Two paces. *Lock step*: all conversations start at once, each turn right after the last
//! one's answer. With an even number of conversations in lock step on two hosts, plain round
//! robin sends conversation `i`'s turn `t` to host `(n·t + i) mod 2`, the same host every
//! turn: it is sticky by accident, which agents arriving at their own pace are not. *Paced*:
//! each agent starts and thinks between turns for a random time (`THINK_MS`, drawn from a
//! seed per conversation, the same for every setup), so that arrivals interleave as they
//! would. Both are reported.
//!
//! A follow-up's time is from sending it to its whole (non-streamed, 4-token) answer. It
//! counts as cached when the engine's own `timings.cache_n` is at least 90 % of the
//! previous turn's `usage.prompt_tokens`; `labelled` counts the follow-ups oqp answered
//! with `X-OQP-Affinity: hit`. Each follow-up's time is split by what states it: oqp's queue
//! wait (`X-Queue-Wait-Time`), the engine's prompt time (`timings.prompt_ms`: the restore
//! from its RAM prompt cache and the prefill of what is not cached) and generation
//! (`timings.predicted_ms`); the rest is the wait inside the engine for its slot and the
//! transport.

use std::time::{Duration, Instant};

use serde_json::json;

use super::{USER_KEY, size};
use crate::bench::report::{Report, Row};
use crate::bench::stats::percentile;
use crate::bench::{Bench, SCENARIO_ENGINES};
use crate::client::HttpClient;
use crate::engine::{self, Engine, Model};

/// Slots of each engine.
const SLOTS: u32 = 2;

/// How long oqp may take to learn both engines' slots.
const LEARN: Duration = Duration::from_secs(30);

/// A paced agent's think time before each turn, drawn uniformly below this (milliseconds;
/// a tenth of it in the quick run).
const THINK_MS: u64 = 3000;

/// How the conversations' turns arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pace {
    /// All at once, each turn right after the last one's answer.
    LockStep,
    /// Each agent at its own pace: a seeded random think time before every turn.
    Paced,
}

/// One setup of oqp in front of the engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setup {
    RoundRobin,
    Off,
    On,
}

/// One run's follow-ups.
#[derive(Debug, Default)]
struct Run {
    /// Each follow-up's time to its whole answer, in milliseconds.
    times_ms: Vec<f64>,
    cached: usize,
    labelled: usize,
    /// Follow-ups oqp labelled `spill`.
    spilled: usize,
    /// Each follow-up's prompt time as the engine states it (`timings.prompt_ms`: its
    /// prefill, a restore from the RAM prompt cache included, its wait for a slot not).
    prompt_ms: Vec<f64>,
    /// Each follow-up's wait in oqp's queue (`X-Queue-Wait-Time`).
    queue_ms: Vec<f64>,
    /// Each follow-up's generation time (`timings.predicted_ms`).
    predicted_ms: Vec<f64>,
    /// Each follow-up's prompt tokens the engine evaluated (`timings.prompt_n`).
    prompt_n: Vec<f64>,
    failed: usize,
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

impl Run {
    fn mean(&self) -> f64 {
        mean(&self.times_ms)
    }

    fn rate(&self, count: usize) -> f64 {
        count as f64 / self.times_ms.len().max(1) as f64
    }

    fn describe(&self, name: &str) -> String {
        match (
            percentile(&self.times_ms, 50.0),
            percentile(&self.times_ms, 99.0),
        ) {
            (Some(p50), Some(p99)) => format!(
                "{name}: p50 {p50:.0} / mean {:.0} / p99 {p99:.0} ms (mean: oqp queue {:.0}, engine prompt {:.0} for {:.0} tokens, generation {:.0}, engine wait and transport {:.0}), cached {:.0} %, labelled hit {:.0} %, spill {:.0} %{}",
                self.mean(),
                mean(&self.queue_ms),
                mean(&self.prompt_ms),
                mean(&self.prompt_n),
                mean(&self.predicted_ms),
                self.mean()
                    - mean(&self.queue_ms)
                    - mean(&self.prompt_ms)
                    - mean(&self.predicted_ms),
                100.0 * self.rate(self.cached),
                100.0 * self.rate(self.labelled),
                100.0 * self.rate(self.spilled),
                if self.failed > 0 {
                    format!(", {} failed", self.failed)
                } else {
                    String::new()
                }
            ),
            _ => crate::bench::report::na(),
        }
    }
}

/// Runs the three setups at two sizes; rows saying why when no engine is installed.
pub async fn run(bench: &Bench, report: &mut Report) -> anyhow::Result<()> {
    if !engine::installed() {
        report.not_run(
            SCENARIO_ENGINES,
            "llama-server is not installed (scripts/setup.sh)",
        );
        return Ok(());
    }
    let turns = size(bench, 5, 2);
    let (start, more) = size(bench, (330, 66), (40, 10));
    let think = size(bench, THINK_MS, THINK_MS / 10);
    for pace in [Pace::LockStep, Pace::Paced] {
        for conversations in size(bench, [4, 8], [2, 4]) {
            let mut runs = Vec::new();
            for setup in [Setup::RoundRobin, Setup::Off, Setup::On] {
                let shape = Load {
                    conversations,
                    turns,
                    start,
                    more,
                    pace,
                    think,
                };
                runs.push(once(shape, setup).await?);
            }
            let [round_robin, off, on] =
                <[Run; 3]>::try_from(runs).map_err(|_| anyhow::anyhow!("three runs expected"))?;
            let ratio = on.mean() / round_robin.mean().max(1e-9);
            let (text, met) = if conversations <= 2 * SLOTS as usize {
                (
                    "on: cached ≥ 95 %, mean ≤ 0.75× round robin",
                    on.rate(on.cached) >= 0.95 && ratio <= 0.75 && on.failed == 0,
                )
            } else {
                (
                    "on: cached ≥ 85 %, mean ≤ 0.5× round robin",
                    on.rate(on.cached) >= 0.85 && ratio <= 0.5 && on.failed == 0,
                )
            };
            let paced = match pace {
                Pace::LockStep => "in lock step".to_owned(),
                Pace::Paced => format!(
                    "paced (think 0–{:.1} s before each turn)",
                    think as f64 / 1e3
                ),
            };
            let row = Row::new(
                SCENARIO_ENGINES,
                format!(
                    "follow-up time to answer: {conversations} conversations × {turns} turns {paced} on 2 llama-servers × {SLOTS} slots ({start} random words ≈ {} tokens, +{more} a turn, 4-token answers)",
                    start * 6
                ),
            )
            .cells(
                round_robin.describe("round robin"),
                off.describe("off"),
                format!("{} (mean ×{ratio:.2} of round robin)", on.describe("on")),
            );
            report.push(row.target(text, Some(met)));
        }
    }
    Ok(())
}

/// The load of one run.
#[derive(Debug, Clone, Copy)]
struct Load {
    conversations: usize,
    turns: usize,
    /// Words of the first turn.
    start: usize,
    /// Words of each turn after.
    more: usize,
    pace: Pace,
    /// The longest think time, in milliseconds.
    think: u64,
}

/// One run: two fresh engines, oqp in process in front (the harness's stack), the
/// conversations at once.
async fn once(shape: Load, setup: Setup) -> anyhow::Result<Run> {
    let mut engines = Vec::new();
    for _ in 0..2 {
        let engine = Engine::builder(Model::Chat)
            .alias("oqp-tiny:latest")
            .parallel(SLOTS)
            .context(SLOTS * 8192)
            .try_start()
            .await?;
        engines.push(engine);
    }
    let stack = crate::harness::Stack::start(&config(&engines, setup)).await;
    let result = async {
        learn(&stack.url()).await?;
        load(&stack.url(), shape, setup).await
    }
    .await;
    stack.shutdown().await;
    for engine in engines {
        engine.stop().await;
    }
    result
}

fn config(engines: &[Engine], setup: Setup) -> String {
    let hosts: String = engines
        .iter()
        .enumerate()
        .map(|(index, engine)| {
            format!(
                "    - {{url: \"{}\", name: e{index}, kind: openai, max_concurrent: {SLOTS}, model_sync_interval: 1}}\n",
                engine.url()
            )
        })
        .collect();
    let (strategy, affinity) = match setup {
        Setup::RoundRobin => ("round_robin", false),
        Setup::Off => ("model_aware", false),
        Setup::On => ("model_aware", true),
    };
    format!(
        "proxy:\n  max_concurrent: {}\nollama:\n  hosts:\n{hosts}routing:\n  strategy: {strategy}\n  model_poll_timeout: 2\n  affinity:\n    enabled: {affinity}\nqueue:\n  normal:\n    max_depth: 1000\n    max_wait: 900\nauth:\n  enabled: true\n  keys:\n    - key: \"{USER_KEY}\"\n      client_id: user\n",
        2 * SLOTS
    )
}

/// Waits until oqp shows both engines healthy with their slots learned.
async fn learn(base: &str) -> anyhow::Result<()> {
    let http = HttpClient::new();
    let auth = format!("Bearer {USER_KEY}");
    let deadline = Instant::now() + LEARN;
    loop {
        let status = http
            .get(&format!("{base}/queue/status"), &[("authorization", &auth)])
            .await
            .json();
        let learned = status["hosts"].as_array().is_some_and(|hosts| {
            hosts.len() == 2
                && hosts
                    .iter()
                    .all(|host| host["healthy"] == true && host["engine_slots"] == SLOTS)
        });
        if learned {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "oqp did not learn the engines' slots: {status}"
        );
        // Another process's poll has no event to wait on from here.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A paced agent's think times: uniform below `max` milliseconds, from a seed of its own
/// (xorshift64*, the same sequence for every setup).
fn think_times(conversation: usize, max: u64) -> impl Iterator<Item = Duration> {
    let mut state = (conversation as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03) | 1;
    std::iter::repeat_with(move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let value = state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11;
        Duration::from_millis(value % max.max(1))
    })
}

/// Runs the conversations: each turn after the last one's answer, at once or paced.
async fn load(base: &str, shape: Load, setup: Setup) -> anyhow::Result<Run> {
    let Load {
        conversations,
        turns,
        start,
        more,
        pace,
        think,
    } = shape;
    let url = format!("{base}/v1/chat/completions");
    // Each turn's figures on stderr, to see where a follow-up's time goes.
    let trace = std::env::var_os("OQP_BENCH_TRACE").is_some();
    let tasks: Vec<_> = (0..conversations)
        .map(|conversation| {
            let url = url.clone();
            tokio::spawn(async move {
                let http = HttpClient::new();
                let auth = format!("Bearer {USER_KEY}");
                let mut messages = Vec::new();
                let mut run = Run::default();
                let mut previous_prompt = 0;
                let mut thinking = think_times(conversation, think);
                for turn in 0..turns {
                    if pace == Pace::Paced
                        && let Some(pause) = thinking.next()
                    {
                        // The agent's own pace, not a synchronisation.
                        tokio::time::sleep(pause).await;
                    }
                    let words = if turn == 0 { start } else { more };
                    let seed = (conversation * 1000 + turn) as u64;
                    let text = engine::random_words(seed, words);
                    messages.push(json!({"role": "user", "content": text}));
                    let body =
                        json!({"model": "oqp-tiny:latest", "messages": messages, "max_tokens": 4});
                    let sent = Instant::now();
                    let reply = http
                        .post_json(&url, &[("authorization", &auth)], &body)
                        .await;
                    let took = sent.elapsed();
                    if reply.status != 200 {
                        run.failed += 1;
                        break;
                    }
                    let answer = reply.json();
                    messages.push(answer["choices"][0]["message"].clone());
                    let prompt = answer["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
                    let cache_n = answer["timings"]["cache_n"].as_u64().unwrap_or(0);
                    if trace {
                        eprintln!(
                            "oqp-bench engines {setup:?} {pace:?} conversation {conversation} turn {turn}: {:.0} ms, queue {} ms, {}, prompt {} ms for {} tokens ({} cached), generation {} ms",
                            took.as_secs_f64() * 1e3,
                            reply.header("x-queue-wait-time").unwrap_or_default(),
                            reply.header("x-oqp-affinity").unwrap_or_default(),
                            answer["timings"]["prompt_ms"],
                            answer["timings"]["prompt_n"],
                            cache_n,
                            answer["timings"]["predicted_ms"],
                        );
                    }
                    if turn > 0 {
                        run.times_ms.push(took.as_secs_f64() * 1e3);
                        let timings = &answer["timings"];
                        run.prompt_ms
                            .push(timings["prompt_ms"].as_f64().unwrap_or(0.0));
                        run.predicted_ms
                            .push(timings["predicted_ms"].as_f64().unwrap_or(0.0));
                        run.prompt_n
                            .push(timings["prompt_n"].as_f64().unwrap_or(0.0));
                        run.queue_ms.push(
                            reply
                                .header("x-queue-wait-time")
                                .and_then(|ms| ms.parse::<f64>().ok())
                                .unwrap_or(0.0),
                        );
                        if cache_n * 10 >= previous_prompt * 9 {
                            run.cached += 1;
                        }
                        match reply.header("x-oqp-affinity").as_deref() {
                            Some("hit") => run.labelled += 1,
                            Some("spill") => run.spilled += 1,
                            _ => {}
                        }
                    }
                    previous_prompt = prompt;
                }
                run
            })
        })
        .collect();
    let mut all = Run::default();
    for task in tasks {
        let run = task.await?;
        all.times_ms.extend(run.times_ms);
        all.cached += run.cached;
        all.labelled += run.labelled;
        all.spilled += run.spilled;
        all.prompt_ms.extend(run.prompt_ms);
        all.queue_ms.extend(run.queue_ms);
        all.predicted_ms.extend(run.predicted_ms);
        all.prompt_n.extend(run.prompt_n);
        all.failed += run.failed;
    }
    Ok(all)
}
