//! Scheduling: a batch flood of low-tier embeds (one upstream slot, D ms
//! each) with high-tier chats arriving during it. Direct to the fake the
//! chats wait their turn in Ollama's FIFO; through oqp they should wait for
//! at most the one embed holding the slot. An interactive request's wait is
//! its response time minus its own service time (D). The makespan (first
//! request sent to last answer) shows whether priority cost throughput.

use std::time::{Duration, Instant};

use super::{BATCH_KEY, CHAT_KEY, OqpConfig, embed, size};
use crate::bench::load::{Conn, Req};
use crate::bench::procs::{self, FakeSpec};
use crate::bench::report::{Report, Row};
use crate::bench::stats::percentile;
use crate::bench::{Bench, SCENARIO_SCHEDULING};

/// How long a flood ran and what the chats waited.
#[derive(Debug, Default)]
struct Flood {
    waits_ms: Vec<f64>,
    makespan: Duration,
    failed: usize,
}

/// Runs the flood through oqp, then direct, and adds the rows.
pub async fn run(bench: &Bench, report: &mut Report) -> anyhow::Result<()> {
    let service = Duration::from_millis(size(bench, 20, 5));
    let embeds = size(bench, 500, 40);
    let chats = size(bench, 20, 4);
    let spec = FakeSpec {
        slots: 1,
        latency: service,
        ..FakeSpec::default()
    };
    let fake = procs::spawn_fake(&bench.binaries, spec).await?;
    let oqp =
        match procs::spawn_oqp(&bench.binaries, &OqpConfig::new(&fake.url(), 1).render()).await {
            Ok(oqp) => oqp,
            Err(error) => {
                fake.stop().await;
                return Err(error);
            }
        };
    let result = async {
        let through = flood(oqp.addr(), embeds, chats, service).await?;
        let direct = flood(fake.addr(), embeds, chats, service).await?;
        anyhow::Ok((through, direct))
    }
    .await;
    oqp.stop().await;
    fake.stop().await;
    let (through, direct) = result?;

    let cell = |flood: &Flood| match (
        percentile(&flood.waits_ms, 50.0),
        percentile(&flood.waits_ms, 99.0),
    ) {
        (Some(p50), Some(p99)) => format!("{p50:.1} / {p99:.1} ms"),
        _ => crate::bench::report::na(),
    };
    let failed = through.failed + direct.failed;
    let failed = if failed > 0 {
        format!(" — {failed} failed")
    } else {
        String::new()
    };
    let limit = service.as_secs_f64() * 1e3 + 5.0;
    let p99 = percentile(&through.waits_ms, 99.0);
    report.push(
        Row::new(
            SCENARIO_SCHEDULING,
            format!(
                "interactive queue wait p50 / p99: {chats} high-tier chats during {embeds} low-tier embeds (1 slot, D = {} ms){failed}",
                service.as_millis()
            ),
        )
        .direct(cell(&direct))
        .oqp(cell(&through))
        .target(
            &format!("oqp p99 ≤ D + 5 ms = {limit:.0} ms"),
            p99.map(|p99| p99 <= limit && through.failed == 0),
        ),
    );
    let ideal = (embeds + chats) as f64 * service.as_secs_f64();
    report.push(
        Row::new(
            SCENARIO_SCHEDULING,
            format!("makespan (ideal {ideal:.2} s = every request × D)"),
        )
        .direct(format!("{:.2} s", direct.makespan.as_secs_f64()))
        .oqp(format!("{:.2} s", through.makespan.as_secs_f64())),
    );
    Ok(())
}

async fn flood(
    addr: std::net::SocketAddr,
    embeds: usize,
    chats: usize,
    service: Duration,
) -> anyhow::Result<Flood> {
    let chat = Req::post(
        "/api/chat",
        Some(CHAT_KEY),
        r#"{"model":"llama3","messages":[{"role":"user","content":"hi"}],"stream":false}"#,
    )
    .header(
        http::HeaderName::from_static("x-queue-priority"),
        http::HeaderValue::from_static("high"),
    );
    let mut chat_conns = Vec::new();
    for _ in 0..chats {
        chat_conns.push(Conn::open(addr).await?);
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..embeds {
        let request = embed(BATCH_KEY, &format!("document {i}"));
        tasks.push(tokio::spawn(async move {
            let mut conn = Conn::open(addr).await?;
            let answer = conn.send(&request).await?;
            anyhow::Ok((answer.status.is_success(), None::<f64>, Instant::now()))
        }));
    }
    // Chats arrive while the backlog lasts: spread over 80 % of it.
    let backlog = service.mul_f64(embeds as f64 * 0.8);
    let spacing = backlog.div_f64(chats.max(1) as f64);
    for (k, mut conn) in chat_conns.into_iter().enumerate() {
        let at = started + Duration::from_millis(20) + spacing.mul_f64(k as f64);
        let request = chat.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(at.into()).await;
            let (took, answer) = conn.timed(&request).await?;
            let wait = (took.as_secs_f64() - service.as_secs_f64()) * 1e3;
            anyhow::Ok((answer.status.is_success(), Some(wait), Instant::now()))
        }));
    }
    let mut flood = Flood::default();
    let mut last = started;
    for task in tasks {
        let (ok, wait, finished) = task.await??;
        if !ok {
            flood.failed += 1;
        }
        flood.waits_ms.extend(wait);
        last = last.max(finished);
    }
    flood.makespan = last - started;
    Ok(flood)
}
