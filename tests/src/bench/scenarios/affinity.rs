//! Affinity: an agent-like load on two boxes whose Ollama keeps each runner slot's prompt cache
//! (the fake's model of llama-server: 2 slots a box, 250 ms per 1,000 uncached tokens). Each
//! conversation starts with 4,000 tokens and adds 1,000 a turn; every turn streams, and its
//! time to first token is measured at the client. oqp with `routing.affinity` off (follow-ups
//! go round-robin) against on, with as many conversations as slots and with four times as
//! many. A follow-up counts as a hit when it re-read only its new turn (the fake's
//! `prompt_eval_duration` is the time of the uncached tokens: at most 1,100 of them).

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Value, json};

use super::{USER_KEY, size};
use crate::bench::load::{Conn, Req};
use crate::bench::procs::{self, FakeSpec};
use crate::bench::report::{Report, Row};
use crate::bench::stats::percentile;
use crate::bench::{Bench, SCENARIO_AFFINITY};

/// Slots of each box.
const SLOTS: usize = 2;

/// One run's follow-ups.
#[derive(Debug, Default)]
struct Run {
    /// Times to first token of the follow-ups, in milliseconds.
    ttft_ms: Vec<f64>,
    hits: usize,
    failed: usize,
}

impl Run {
    fn mean(&self) -> f64 {
        self.ttft_ms.iter().sum::<f64>() / self.ttft_ms.len().max(1) as f64
    }

    fn hit_rate(&self) -> f64 {
        self.hits as f64 / self.ttft_ms.len().max(1) as f64
    }

    fn describe(&self) -> String {
        match (
            percentile(&self.ttft_ms, 50.0),
            percentile(&self.ttft_ms, 99.0),
        ) {
            (Some(p50), Some(p99)) => format!(
                "p50 {p50:.0} / mean {:.0} / p99 {p99:.0} ms, hits {:.0} %{}",
                self.mean(),
                100.0 * self.hit_rate(),
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

/// Runs the load with affinity off and on, at two sizes.
pub async fn run(bench: &Bench, report: &mut Report) -> anyhow::Result<()> {
    let per_1k = size(bench, 250.0, 25.0);
    let turns = size(bench, 6, 3);
    for conversations in [2 * SLOTS, 8 * SLOTS] {
        let mut runs = Vec::new();
        for affinity in [false, true] {
            runs.push(once(bench, conversations, turns, per_1k, affinity).await?);
        }
        let [off, on] =
            <[Run; 2]>::try_from(runs).map_err(|_| anyhow::anyhow!("two runs expected"))?;
        let ratio = off.mean() / on.mean().max(1e-9);
        let (text, met) = if conversations == 2 * SLOTS {
            (
                "mean ≥ 4× better than round-robin, hits ≥ 90 %",
                ratio >= 4.0 && on.hit_rate() >= 0.9 && on.failed == 0,
            )
        } else {
            // Four conversations a slot: every cache turns over before its conversation comes
            // back in fair order, so there is nothing to find; affinity must cost nothing.
            (
                "oversubscribed: no worse than round-robin (mean ≥ 0.95×)",
                ratio >= 0.95 && on.failed == 0,
            )
        };
        let row = Row::new(
            SCENARIO_AFFINITY,
            format!(
                "follow-up time to first token: {conversations} conversations × {turns} turns on 2 boxes × {SLOTS} slots (4,000 tokens, +1,000 a turn, prefill {per_1k:.0} ms / 1k uncached); off = round-robin"
            ),
        )
        .direct(format!("off: {}", off.describe()))
        .oqp(format!("on: {} (mean ×{ratio:.1} better)", on.describe()));
        report.push(row.target(text, Some(met)));
    }
    Ok(())
}

/// One run: two fresh boxes, oqp in front, `conversations` at once.
async fn once(
    bench: &Bench,
    conversations: usize,
    turns: usize,
    per_1k: f64,
    affinity: bool,
) -> anyhow::Result<Run> {
    let spec = FakeSpec {
        slots: SLOTS,
        runners: Some(SLOTS),
        tokens: 16,
        prompt_cache_ms_per_1k: Some(per_1k),
        ..FakeSpec::default()
    };
    let one = procs::spawn_fake(&bench.binaries, spec).await?;
    let two = procs::spawn_fake(&bench.binaries, spec).await?;
    let result = async {
        let oqp =
            procs::spawn_oqp(&bench.binaries, &config(&one.url(), &two.url(), affinity)).await?;
        let run = load(oqp.addr(), conversations, turns, per_1k).await;
        oqp.stop().await;
        run
    }
    .await;
    one.stop().await;
    two.stop().await;
    result
}

fn config(one: &str, two: &str, affinity: bool) -> String {
    format!(
        r#"proxy:
  host: "127.0.0.1"
  port: {{PROXY_PORT}}
  max_concurrent: {slots2}
  max_request_body_mb: 64
ollama:
  hosts:
    - url: "{one}"
      name: one
      max_concurrent: {SLOTS}
      num_parallel: {SLOTS}
    - url: "{two}"
      name: two
      max_concurrent: {SLOTS}
      num_parallel: {SLOTS}
routing:
  strategy: model_aware
  affinity:
    enabled: {affinity}
queue:
  model_swap:
    enabled: false
  normal:
    max_depth: 20000
    max_wait: 900
embedding_cache:
  enabled: false
auth:
  enabled: true
  keys:
    - key: "{USER_KEY}"
      client_id: user
logging:
  level: warn
control_plane:
  listen: "{{CONTROL}}"
  state_dir: "{{STATE}}"
"#,
        slots2 = 2 * SLOTS,
    )
}

/// Text of `bytes` bytes (4 a token) that no other conversation or turn shares.
pub fn filler(conversation: usize, turn: usize, bytes: usize) -> String {
    let mut text = format!("conversation {conversation} turn {turn}: ");
    while text.len() < bytes {
        text.push_str("the history of an agent's work, file by file. ");
    }
    text.truncate(bytes);
    text
}

/// Runs the conversations at once, each turn after the last one's answer.
async fn load(
    addr: SocketAddr,
    conversations: usize,
    turns: usize,
    per_1k: f64,
) -> anyhow::Result<Run> {
    let tasks: Vec<_> = (0..conversations)
        .map(|c| {
            tokio::spawn(async move {
                let mut conn = Conn::open(addr).await?;
                let mut messages =
                    vec![json!({"role": "system", "content": "You are a coding agent."})];
                let mut run = Run::default();
                for t in 0..turns {
                    let bytes = if t == 0 { 16_000 } else { 4_000 };
                    messages.push(json!({"role": "user", "content": filler(c, t, bytes)}));
                    let body = json!({"model": "llama3", "stream": true, "messages": messages});
                    let request = Req::post("/api/chat", Some(USER_KEY), body.to_string());
                    let (sent, lines) = conn.lines(&request).await?;
                    let Some(first) = lines.first() else {
                        run.failed += 1;
                        break;
                    };
                    let ttft = first.at.saturating_duration_since(sent);
                    let mut answer = String::new();
                    let mut last = Value::Null;
                    for line in &lines {
                        let value: Value = serde_json::from_str(&line.text).unwrap_or_default();
                        if let Some(text) = value["message"]["content"].as_str() {
                            answer.push_str(text);
                        }
                        last = value;
                    }
                    if last.get("done") != Some(&Value::Bool(true)) {
                        run.failed += 1;
                        break;
                    }
                    messages.push(json!({"role": "assistant", "content": answer}));
                    if t == 0 {
                        continue;
                    }
                    let duration =
                        Duration::from_nanos(last["prompt_eval_duration"].as_u64().unwrap_or(0));
                    let uncached = duration.as_secs_f64() * 1_000_000.0 / per_1k.max(1e-9);
                    // A hit re-reads only the new turn (1,000 tokens and the template's).
                    if uncached <= 1_100.0 {
                        run.hits += 1;
                    }
                    run.ttft_ms.push(ttft.as_secs_f64() * 1e3);
                }
                anyhow::Ok(run)
            })
        })
        .collect();
    let mut all = Run::default();
    for task in tasks {
        let run = task.await??;
        all.ttft_ms.extend(run.ttft_ms);
        all.hits += run.hits;
        all.failed += run.failed;
    }
    Ok(all)
}
