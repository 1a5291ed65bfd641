//! Memory: the resident set (`VmRSS` of `/proc/<pid>/status`) of the oqp
//! process idle, after a long run of requests, and with thousands of
//! requests waiting in its queue (1 KiB bodies, behind an upstream whose one
//! slot never frees). The minimal proxy's figures are beside it for scale.

use std::time::{Duration, Instant};

use anyhow::bail;
use oqp_proto::admin::v1::GetStatusRequest;
use oqp_proto::admin::v1::admin_service_client::AdminServiceClient;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tonic::metadata::MetadataValue;
use tonic::transport::Endpoint;

use super::{ADMIN_KEY, OqpConfig, USER_KEY, generate, size};
use crate::bench::load;
use crate::bench::procs::{self, FakeSpec, Proc};
use crate::bench::report::{self, Report, Row};
use crate::bench::{Bench, SCENARIO_MEMORY};

/// Idle target, KiB.
const IDLE_TARGET_KIB: u64 = 20 * 1024;
/// Target with 10k queued, KiB.
const QUEUED_TARGET_KIB: u64 = 200 * 1024;

/// Runs both parts and adds the rows.
pub async fn run(bench: &Bench, report: &mut Report) -> anyhow::Result<()> {
    let requests = size(bench, 100_000, 2_000);
    let queued = size(bench, 10_000, 200);

    let fake = procs::spawn_fake(&bench.binaries, FakeSpec::default()).await?;
    let minimal = procs::spawn_minimal(&bench.binaries, &fake.url()).await?;
    let oqp = procs::spawn_oqp(&bench.binaries, &OqpConfig::new(&fake.url(), 64).render()).await?;
    // Let start-up settle (the first report, the first host poll).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle = (minimal.rss_kib(), oqp.rss_kib());
    let request = generate(USER_KEY);
    let through = async {
        let mut failed = 0;
        for proc in [&minimal, &oqp] {
            failed += load::closed_loop_count(proc.addr(), &request, 32, requests)
                .await?
                .failed;
        }
        anyhow::Ok(failed)
    }
    .await;
    let after = (minimal.rss_kib(), oqp.rss_kib());
    oqp.stop().await;
    minimal.stop().await;
    fake.stop().await;
    let failed = through?;

    let (queued_idle, queued_rss) = queue_up(bench, queued, Waiting::Queued).await?;
    let (_, connected_rss) = queue_up(bench, queued, Waiting::MidHeaders).await?;

    report.push(
        Row::new(SCENARIO_MEMORY, "RSS idle, after start-up")
            .minimal(report::mib(idle.0))
            .oqp(report::mib(idle.1))
            .target("oqp < 20 MiB", idle.1.map(|kib| kib < IDLE_TARGET_KIB)),
    );
    let failed = if failed > 0 {
        format!(" — {failed} failed")
    } else {
        String::new()
    };
    report.push(
        Row::new(
            SCENARIO_MEMORY,
            format!("RSS after {requests} non-streamed generates{failed}"),
        )
        .minimal(report::mib(after.0))
        .oqp(report::mib(after.1)),
    );
    report.push(
        Row::new(
            SCENARIO_MEMORY,
            format!(
                "RSS with {queued} requests queued (1 KiB bodies; {} idle before)",
                report::mib(queued_idle)
            ),
        )
        .oqp(report::mib(queued_rss))
        .target(
            "oqp < 200 MiB at 10 000 queued",
            queued_rss.map(|kib| kib < QUEUED_TARGET_KIB),
        ),
    );
    report.push(
        Row::new(
            SCENARIO_MEMORY,
            format!(
                "for scale: RSS with {queued} connections that sent the start of their headers (no request yet)"
            ),
        )
        .oqp(report::mib(connected_rss)),
    );
    Ok(())
}

/// What each waiting client has sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    /// A whole request, queued in oqp.
    Queued,
    /// The start of its headers: a connection mid-read, no request yet.
    MidHeaders,
}

/// Opens `count` connections to an oqp whose one upstream slot never frees,
/// each sending `waiting`; the RSS before, and once they all wait.
async fn queue_up(
    bench: &Bench,
    count: usize,
    waiting: Waiting,
) -> anyhow::Result<(Option<u64>, Option<u64>)> {
    let spec = FakeSpec {
        slots: 1,
        latency: Duration::from_secs(3600),
        ..FakeSpec::default()
    };
    let fake = procs::spawn_fake(&bench.binaries, spec).await?;
    let oqp = procs::spawn_oqp(&bench.binaries, &OqpConfig::new(&fake.url(), 1).render()).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle = oqp.rss_kib();
    let result = async {
        let clients = open_waiting_clients(&oqp, count, waiting).await?;
        match waiting {
            Waiting::Queued => wait_for_depth(&oqp, count as u32 - 1).await?,
            // Nothing to confirm through the admin API: let the reads land.
            Waiting::MidHeaders => tokio::time::sleep(Duration::from_secs(2)).await,
        }
        let rss = oqp.rss_kib();
        drop(clients);
        anyhow::Ok(rss)
    }
    .await;
    oqp.stop().await;
    fake.stop().await;
    Ok((idle, result?))
}

/// `count` connections, each with one generate of a 1 KiB body written (or
/// only the start of its headers) and its answer never read.
async fn open_waiting_clients(
    oqp: &Proc,
    count: usize,
    waiting: Waiting,
) -> anyhow::Result<Vec<TcpStream>> {
    let head = r#"{"model":"llama3","stream":false,"prompt":""#;
    let pad = 1024usize.saturating_sub(head.len() + 2);
    let body = format!("{head}{}\"}}", "x".repeat(pad));
    let request = format!(
        "POST /api/generate HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {USER_KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        oqp.addr(),
        body.len()
    );
    let sent = match waiting {
        Waiting::Queued => request.as_bytes(),
        Waiting::MidHeaders => &request.as_bytes()[..40],
    };
    let mut clients = Vec::with_capacity(count);
    for _ in 0..count {
        let mut stream = TcpStream::connect(oqp.addr()).await?;
        stream.write_all(sent).await?;
        clients.push(stream);
    }
    Ok(clients)
}

/// Waits until the data plane reports at least `depth` waiting requests to
/// the control plane (reports come every second).
async fn wait_for_depth(oqp: &Proc, depth: u32) -> anyhow::Result<()> {
    let Some(url) = oqp.control_url() else {
        bail!("no control plane address");
    };
    let channel = Endpoint::from_shared(url)?.connect().await?;
    let key: MetadataValue<_> = format!("Bearer {ADMIN_KEY}").parse()?;
    let mut admin =
        AdminServiceClient::with_interceptor(channel, move |mut request: tonic::Request<()>| {
            request.metadata_mut().insert("authorization", key.clone());
            Ok(request)
        });
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut seen = 0;
    while Instant::now() < deadline {
        let status = admin.get_status(GetStatusRequest {}).await?.into_inner();
        seen = status
            .nodes
            .iter()
            .filter_map(|node| node.report.as_ref())
            .flat_map(|report| report.tiers.iter())
            .map(|tier| tier.depth)
            .sum::<u32>();
        if seen >= depth {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    bail!("the queue reached {seen} of {depth} requests")
}
