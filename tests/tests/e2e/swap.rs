//! End to end: model-swap-aware scheduling, through the real planes, against the fake Ollama in
//! its VRAM mode (room for one model of two; loads take time; one slot). Two clients each loop
//! on their own model, first straight at the fake (Ollama alone), then through oqp with the
//! feature off and on. The figures are printed (`--nocapture`); the issue's targets are asserted.

use std::time::{Duration, Instant};

use oqp_tests::client::{HttpClient, Reply, eventually};
use oqp_tests::fake::{FakeHandle, FakeOllama};
use oqp_tests::harness::Stack;
use serde_json::json;

const GIB: u64 = 1 << 30;
/// Service time S of one request.
const SERVICE: Duration = Duration::from_millis(50);
/// Load time L of a model (L = 3 S).
const LOAD: Duration = Duration::from_millis(150);
const UNLOAD: Duration = Duration::from_millis(10);
/// `queue.model_swap.max_defer` (normal tier).
const MAX_DEFER: Duration = Duration::from_millis(1500);
/// How long each run lasts.
const RUN: Duration = Duration::from_secs(6);
/// Slack for three processes' worth of debug code on two cores, on top of the bound.
const SLACK: Duration = Duration::from_millis(150);

async fn fake() -> (FakeOllama, FakeHandle) {
    let fake = FakeOllama::builder()
        .model("alpha")
        .model("beta")
        .model("gamma")
        .slots(1)
        .vram(10 * GIB)
        .model_size("alpha", 8 * GIB)
        .model_size("beta", 8 * GIB)
        .model_size("gamma", 8 * GIB)
        .load_time(LOAD)
        .unload_time(UNLOAD)
        .latency(SERVICE)
        .spawn()
        .await;
    let handle = fake.handle();
    (fake, handle)
}

fn config(url: &str, enabled: bool) -> String {
    format!(
        r#"proxy:
  max_concurrent: 16
ollama:
  hosts:
    - url: "{url}"
      name: gpu
      max_concurrent: 1
      vram: 10GiB
queue:
  model_swap:
    enabled: {enabled}
    max_defer: {{high: 0.5, normal: {defer}, low: 10}}
    idle_grace: 0.3
auth:
  enabled: true
  keys:
    - key: "sk-xavier-0123456789"
      client_id: xavier
    - key: "sk-yvonne-0123456789"
      client_id: yvonne
"#,
        defer = MAX_DEFER.as_secs_f64(),
    )
}

/// One looping client: its model, its key (none: straight at the fake), requests in flight.
#[derive(Clone)]
struct Loop {
    model: &'static str,
    key: Option<&'static str>,
    inflight: usize,
}

#[derive(Debug, Default, Clone)]
struct Served {
    requests: usize,
    /// Summed `total_duration` the fake reported (the GPU time of the client's requests) over
    /// the run's whole turns: where the window ends would otherwise give one client up to half
    /// a turn more (`oqp_tests::bench::scenarios::swap::whole_turns`).
    gpu: Duration,
    worst_latency: Duration,
}

/// One non-streamed generate for `model` at `base`, with `key` (none: straight at the fake).
async fn generate(base: String, model: &'static str, key: Option<&'static str>) -> Reply {
    let auth = key.map(|key| format!("Bearer {key}"));
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|auth| vec![("authorization", auth)])
        .unwrap_or_default();
    HttpClient::new()
        .post_json(
            &format!("{base}/api/generate"),
            &headers,
            &json!({"model": model, "prompt": "hi", "stream": false}),
        )
        .await
}

/// The two clients through oqp, A keeping `inflight` requests in flight, B one.
fn through_oqp(inflight: usize) -> [Loop; 2] {
    [
        Loop {
            model: "alpha",
            key: Some("sk-xavier-0123456789"),
            inflight,
        },
        Loop {
            model: "beta",
            key: Some("sk-yvonne-0123456789"),
            inflight: 1,
        },
    ]
}

/// Runs the loops against `base` for [`RUN`]; only requests answered within it count.
async fn run(base: &str, loops: &[Loop]) -> Vec<Served> {
    let http = HttpClient::new();
    let deadline = tokio::time::Instant::now() + RUN;
    let mut tasks = Vec::new();
    for (index, client) in loops.iter().enumerate() {
        for _ in 0..client.inflight {
            let http = http.clone();
            let url = format!("{base}/api/generate");
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                let mut served = Served::default();
                let mut answers = Vec::new();
                let auth = client.key.map(|key| format!("Bearer {key}"));
                let headers: Vec<(&str, &str)> = auth
                    .as_deref()
                    .map(|auth| vec![("authorization", auth)])
                    .unwrap_or_default();
                let body = json!({"model": client.model, "prompt": "hi", "stream": false});
                loop {
                    let sent = Instant::now();
                    let reply =
                        tokio::time::timeout_at(deadline, http.post_json(&url, &headers, &body))
                            .await;
                    let Ok(reply) = reply else {
                        break;
                    };
                    assert!(
                        reply.status.is_success(),
                        "{}: {}",
                        reply.status,
                        reply.text()
                    );
                    let answer = reply.json();
                    served.requests += 1;
                    let gpu = Duration::from_nanos(answer["total_duration"].as_u64().unwrap());
                    answers.push((Instant::now(), index, gpu));
                    served.worst_latency = served.worst_latency.max(sent.elapsed());
                }
                (index, served, answers)
            }));
        }
    }
    let mut served = vec![Served::default(); loops.len()];
    let mut answers = Vec::new();
    for task in tasks {
        let (index, part, mine) = task.await.unwrap();
        answers.extend(mine);
        let total = &mut served[index];
        total.requests += part.requests;
        total.worst_latency = total.worst_latency.max(part.worst_latency);
    }
    let (gpu, _turns) = oqp_tests::bench::scenarios::swap::whole_turns(answers);
    for (total, gpu) in served.iter_mut().zip(gpu) {
        total.gpu = gpu;
    }
    served
}

fn total(served: &[Served]) -> usize {
    served.iter().map(|s| s.requests).sum()
}

fn share(served: &[Served], index: usize) -> f64 {
    let all: f64 = served.iter().map(|s| s.gpu.as_secs_f64()).sum();
    if all == 0.0 {
        0.0
    } else {
        served[index].gpu.as_secs_f64() / all
    }
}

fn show(label: &str, served: &[Served]) {
    let per_second = total(served) as f64 / RUN.as_secs_f64();
    eprintln!(
        "{label:>26}: {per_second:5.2} requests/s; per client: {}",
        served
            .iter()
            .enumerate()
            .map(|(i, s)| format!(
                "{} done, GPU share {:.0} %, worst latency {} ms",
                s.requests,
                100.0 * share(served, i),
                s.worst_latency.as_millis()
            ))
            .collect::<Vec<_>>()
            .join("; ")
    );
}

/// Whether `/queue/status` shows a request held back on the host within the run.
async fn held_seen(base: String) -> bool {
    let http = HttpClient::new();
    let auth = "Bearer sk-xavier-0123456789";
    let deadline = tokio::time::Instant::now() + RUN;
    while tokio::time::Instant::now() < deadline {
        let status = http
            .get(&format!("{base}/queue/status"), &[("authorization", auth)])
            .await
            .json();
        let held = status["hosts"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|host| host["vram"]["held"].as_u64().unwrap_or(0) > 0);
        if held {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// One request for each model, each followed by the poll that shows its footprint in VRAM (a
/// completed load asks the control plane for an early poll): the runs measure the steady
/// state, not the minute in which oqp learns the models' sizes.
async fn warm_up(stack: &Stack) {
    let dispatcher = stack.control.dataplane().unwrap().app().dispatcher.clone();
    for (model, key) in [
        ("alpha", "sk-xavier-0123456789"),
        ("beta", "sk-yvonne-0123456789"),
    ] {
        let reply = generate(stack.url(), model, Some(key)).await;
        assert!(reply.status.is_success(), "{}", reply.text());
        let seen = eventually(Duration::from_secs(10), || {
            dispatcher.swap_stats().iter().any(|stat| {
                stat.resident
                    .iter()
                    .any(|(name, bytes)| name.starts_with(model) && *bytes == 8 * GIB)
            })
        })
        .await;
        assert!(
            seen,
            "{model}'s footprint never reached the data plane: {:?}",
            dispatcher.swap_stats()
        );
    }
}

/// Straight at the fake, then through oqp with the feature off and on.
async fn three_runs(inflight: usize) -> [Vec<Served>; 3] {
    let (fake, handle) = fake().await;
    let direct = run(
        &fake.url(),
        &[
            Loop {
                model: "alpha",
                key: None,
                inflight,
            },
            Loop {
                model: "beta",
                key: None,
                inflight: 1,
            },
        ],
    )
    .await;
    // Whatever the direct run left waiting in the fake is gone before oqp's runs.
    assert!(
        eventually(Duration::from_secs(30), || handle.in_flight() == 0
            && handle.pending() == 0)
        .await
    );
    let mut runs = Vec::new();
    for enabled in [false, true] {
        let stack = Stack::start(&config(&fake.url(), enabled)).await;
        warm_up(&stack).await;
        // While the run goes, /queue/status shows the request held back for its model.
        let watch = tokio::spawn(held_seen(stack.url()));
        let served = run(&stack.url(), &through_oqp(inflight)).await;
        let held = watch.await.unwrap();
        if enabled {
            assert!(held, "/queue/status never showed a held request");
            let metrics = HttpClient::new()
                .get(
                    &format!("{}/metrics", stack.url()),
                    &[("authorization", "Bearer sk-xavier-0123456789")],
                )
                .await
                .text();
            let value = |name: &str| -> f64 {
                metrics
                    .lines()
                    .find(|line| line.starts_with(name))
                    .and_then(|line| line.rsplit(' ').next())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0.0)
            };
            assert!(
                value("oqp_model_switches_total{host=\"gpu\"}") >= 2.0,
                "{metrics}"
            );
            assert!(value("oqp_swap_deferral_seconds_count") >= 2.0, "{metrics}");
            assert!(
                value("oqp_model_load_seconds_total{host=\"gpu\"") > 0.0,
                "{metrics}"
            );
        } else {
            assert!(!held, "nothing is held with the feature off");
        }
        stack.shutdown().await;
        assert!(
            eventually(Duration::from_secs(30), || handle.in_flight() == 0
                && handle.pending() == 0)
            .await
        );
        runs.push(served);
    }
    let on = runs.pop().unwrap();
    let off = runs.pop().unwrap();
    eprintln!(
        "one model fits; L = {} ms, S = {} ms, max_defer {} ms; client A keeps {inflight} in flight, B 1",
        LOAD.as_millis(),
        SERVICE.as_millis(),
        MAX_DEFER.as_millis()
    );
    show("Ollama alone", &direct);
    show("oqp, model_swap off", &off);
    show("oqp, model_swap on", &on);
    let theory = (MAX_DEFER.as_secs_f64() / SERVICE.as_secs_f64())
        / (MAX_DEFER + SERVICE + UNLOAD + LOAD).as_secs_f64();
    eprintln!(
        "{:>26}: {theory:5.2} requests/s (max_defer / S requests per max_defer + S + unload + L)",
        "theory, on"
    );
    [direct, off, on]
}

fn bound() -> Duration {
    MAX_DEFER + UNLOAD + LOAD + 2 * SERVICE + SLACK
}

#[tokio::test]
async fn batching_by_the_resident_model_triples_throughput_within_the_latency_bound() {
    let _exclusive = crate::support::exclusive().await;
    let [direct, off, on] = three_runs(1).await;
    let ratio = total(&on) as f64 / total(&direct) as f64;
    eprintln!(
        "on / alone: ×{ratio:.2}; on / off: ×{:.2}",
        total(&on) as f64 / total(&off) as f64
    );
    assert!(ratio >= 3.0, "×{ratio:.2}");
    for (i, served) in on.iter().enumerate() {
        assert!(
            served.worst_latency <= bound(),
            "client {i}: {:?} > {:?}",
            served.worst_latency,
            bound()
        );
        let share = share(&on, i);
        assert!(
            (0.45..=0.55).contains(&share),
            "client {i}: GPU share {share:.3}"
        );
    }
}

#[tokio::test]
async fn a_client_with_four_requests_in_flight_does_not_starve_the_other_model() {
    let _exclusive = crate::support::exclusive().await;
    let [direct, _off, on] = three_runs(4).await;
    eprintln!(
        "client B's GPU share: alone {:.0} %, through oqp {:.0} %",
        100.0 * share(&direct, 1),
        100.0 * share(&on, 1)
    );
    assert!(on[1].requests > 0);
    assert!(
        on[1].worst_latency <= bound(),
        "{:?} > {:?}",
        on[1].worst_latency,
        bound()
    );
    for i in 0..2 {
        let share = share(&on, i);
        assert!(
            (0.45..=0.55).contains(&share),
            "client {i}: GPU share {share:.3}"
        );
    }
}

#[tokio::test]
async fn without_a_configured_vram_holding_starts_once_the_host_is_seen_evicting() {
    let _exclusive = crate::support::exclusive().await;
    let (fake, _handle) = fake().await;
    let yaml = config(&fake.url(), true).replace("      vram: 10GiB\n", "");
    let stack = Stack::start(&yaml).await;
    let dispatcher = stack.control.dataplane().unwrap().app().dispatcher.clone();
    assert!(!dispatcher.swap_stats()[0].capacity_learned);
    // Alternate the two models one request at a time: Ollama's own behaviour at first (every
    // request loads its model and evicts the other), until the polls that follow the loads
    // show the host evicting.
    let mut turns = 0;
    let learned = loop {
        let learned = dispatcher.swap_stats()[0].capacity_learned
            && dispatcher.swap_stats()[0].capacity == Some(8 * GIB);
        if learned || turns == 200 {
            break learned;
        }
        for (model, key) in [
            ("alpha", "sk-xavier-0123456789"),
            ("beta", "sk-yvonne-0123456789"),
        ] {
            let reply = generate(stack.url(), model, Some(key)).await;
            assert!(reply.status.is_success(), "{}", reply.text());
        }
        turns += 1;
    };
    assert!(
        learned,
        "the capacity was never learned: {:?}",
        dispatcher.swap_stats()
    );
    // Now a request for the other model is held while the resident one has work: the two
    // clients are served in batches, not one switch per request as before.
    let before = dispatcher.swap_stats()[0].switches;
    let served = run(&stack.url(), &through_oqp(1)).await;
    show("learned capacity, on", &served);
    let switches = dispatcher.swap_stats()[0].switches - before;
    assert!(switches >= 2, "{:?}", dispatcher.swap_stats());
    assert!(
        total(&served) as u64 >= 3 * switches,
        "{switches} switches for {served:?}"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn a_host_whose_models_change_around_oqp_falls_back_to_plain_fair_share() {
    let _exclusive = crate::support::exclusive().await;
    let (fake, _handle) = fake().await;
    let yaml = config(&fake.url(), true).replace(
        "      vram: 10GiB\n",
        "      vram: 10GiB\n      model_sync_interval: 1\n",
    );
    let stack = Stack::start(&yaml).await;
    let dispatcher = stack.control.dataplane().unwrap().app().dispatcher.clone();
    let http = HttpClient::new();
    let generate = |base: String, model: &'static str, key: Option<&'static str>| async move {
        let reply = generate(base, model, key).await;
        assert!(reply.status.is_success(), "{}", reply.text());
    };
    let resident = |model: &str| {
        dispatcher.swap_stats()[0]
            .resident
            .iter()
            .any(|(name, _)| name.starts_with(model))
    };
    generate(stack.url(), "alpha", Some("sk-xavier-0123456789")).await;
    assert!(eventually(Duration::from_secs(10), || resident("alpha")).await);
    // Two models loaded straight at Ollama, one after the other.
    generate(fake.url(), "gamma", None).await;
    assert!(eventually(Duration::from_secs(10), || resident("gamma")).await);
    assert!(
        !dispatcher.swap_stats()[0].bypassed,
        "one change is not enough"
    );
    generate(fake.url(), "beta", None).await;
    assert!(
        eventually(Duration::from_secs(10), || dispatcher.swap_stats()[0]
            .bypassed)
        .await,
        "{:?}",
        dispatcher.swap_stats()
    );
    let status = http
        .get(
            &format!("{}/queue/status", stack.url()),
            &[("authorization", "Bearer sk-xavier-0123456789")],
        )
        .await
        .json();
    assert_eq!(status["hosts"][0]["vram"]["bypassed"], true, "{status}");
    // Plain fair share from now on: nothing is held, nothing switches.
    let watch = tokio::spawn(held_seen(stack.url()));
    let served = run(&stack.url(), &through_oqp(1)).await;
    assert!(
        !watch.await.unwrap(),
        "a request was held on a bypassed host"
    );
    assert!(served.iter().all(|s| s.requests > 0), "{served:?}");
    assert_eq!(dispatcher.swap_stats()[0].switches, 0);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_switch_whose_requests_all_left_gives_the_old_model_back_at_once() {
    let _exclusive = crate::support::exclusive().await;
    let fake = FakeOllama::builder()
        .model("alpha")
        .model("beta")
        .slots(2)
        .vram(10 * GIB)
        .model_size("alpha", 8 * GIB)
        .model_size("beta", 8 * GIB)
        .load_time(LOAD)
        .latency(SERVICE)
        .spawn()
        .await;
    let handle = fake.handle();
    let yaml = config(&fake.url(), true).replace("max_concurrent: 1\n", "max_concurrent: 2\n");
    let stack = Stack::start(&yaml).await;
    warm_up(&stack).await;
    let dispatcher = stack.control.dataplane().unwrap().app().dispatcher.clone();
    let send = |model: &'static str, key: &'static str| {
        tokio::spawn(generate(stack.url(), model, Some(key)))
    };
    // alpha's request is in flight at Ollama and stays there; beta's is held, then its switch
    // begins and drains alpha.
    handle.clear_requests();
    handle.hold();
    let first = send("alpha", "sk-xavier-0123456789");
    handle.wait_in_flight(1).await;
    let beta = send("beta", "sk-yvonne-0123456789");
    let switching = eventually(Duration::from_secs(10), || {
        dispatcher.swap_stats()[0].switching_to.as_deref() == Some("beta:latest")
    })
    .await;
    assert!(switching, "{:?}", dispatcher.swap_stats());
    // A second alpha request waits: no new work for a model being switched away from.
    let second = send("alpha", "sk-xavier-0123456789");
    assert!(eventually(Duration::from_secs(30), || dispatcher.total_depth() == 2).await);
    // beta's client leaves: the switch is dropped and the second alpha request goes at once.
    beta.abort();
    // At once: not at the next snapshot or deadline that happens to run the dispatcher.
    tokio::time::timeout(Duration::from_secs(5), handle.wait_in_flight(2))
        .await
        .expect("the second alpha request never went");
    assert_eq!(dispatcher.swap_stats()[0].switching_to, None);
    handle.release_all();
    for task in [first, second] {
        assert!(task.await.unwrap().status.is_success());
    }
    let bodies: Vec<String> = handle
        .requests_to("/api/generate")
        .iter()
        .map(|r| String::from_utf8_lossy(&r.body).into_owned())
        .collect();
    // (The warm-up left beta resident: alpha's first request switched back, unloading it.)
    assert!(
        bodies
            .iter()
            .all(|body| !(body.contains("beta") && body.contains("prompt"))),
        "beta's request never reached Ollama: {bodies:?}"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn a_switch_waits_for_a_long_request_at_most_max_defer_and_its_requester_pays_the_wait() {
    let _exclusive = crate::support::exclusive().await;
    let fake = FakeOllama::builder()
        .model("alpha")
        .model("beta")
        .slots(2)
        .vram(10 * GIB)
        .model_size("alpha", 8 * GIB)
        .model_size("beta", 8 * GIB)
        .load_time(LOAD)
        .latency(SERVICE)
        .spawn()
        .await;
    let handle = fake.handle();
    let yaml = config(&fake.url(), true)
        .replace("max_concurrent: 1\n", "max_concurrent: 2\n")
        .replace(
            "      client_id: yvonne\n",
            "      client_id: yvonne\n    - key: \"sk-zoe-0123456789ab\"\n      client_id: zoe\n",
        );
    let stack = Stack::start(&yaml).await;
    warm_up(&stack).await;
    let dispatcher = stack.control.dataplane().unwrap().app().dispatcher.clone();
    let send = |model: &'static str, key: &'static str| {
        tokio::spawn(generate(stack.url(), model, Some(key)))
    };
    // xavier's long request for alpha is in flight and stays there.
    handle.hold();
    let long = send("alpha", "sk-xavier-0123456789");
    handle.wait_in_flight(1).await;
    // yvonne's beta is held, then its switch begins and stops new work for alpha.
    let beta = send("beta", "sk-yvonne-0123456789");
    let switching = eventually(Duration::from_secs(10), || {
        dispatcher.swap_stats()[0].switching_to.as_deref() == Some("beta:latest")
    })
    .await;
    assert!(switching, "{:?}", dispatcher.swap_stats());
    let began = Instant::now();
    // zoe's alpha waits for the switch, but not for xavier's request: at yvonne's max_defer
    // the switch is given up and alpha takes work again, the long request still running.
    let other = send("alpha", "sk-zoe-0123456789ab");
    tokio::time::timeout(Duration::from_secs(15), handle.wait_in_flight(2))
        .await
        .expect("zoe's request waited for the long request to end");
    let waited = began.elapsed();
    assert!(waited >= MAX_DEFER / 2, "{waited:?}");
    assert!(dispatcher.swap_stats()[0].given_up >= 1);
    // The wait is yvonne's to pay, no one else's.
    let status = HttpClient::new()
        .get(
            &format!("{}/queue/status", stack.url()),
            &[("authorization", "Bearer sk-xavier-0123456789")],
        )
        .await
        .json();
    let charged = |client: &str| status["clients"][client]["switch_charged_seconds"].as_f64();
    let yvonne = charged("yvonne").unwrap_or(0.0);
    assert!(yvonne >= MAX_DEFER.as_secs_f64(), "{status}");
    assert_eq!(charged("xavier"), Some(0.0), "{status}");
    assert_eq!(charged("zoe"), Some(0.0), "{status}");
    assert!(
        status["hosts"][0]["vram"]["switches_given_up"].as_u64() >= Some(1),
        "{status}"
    );
    // Once the long request ends, beta gets its turn.
    handle.release_all();
    for task in [long, other, beta] {
        let reply = task.await.unwrap();
        assert!(reply.status.is_success(), "{}", reply.text());
    }
    stack.shutdown().await;
}

/// One `POST /v1/audio/transcriptions` for `model` through oqp with `key`: a multipart form,
/// whose `model` field oqp reads (it once queued the route unread, which this test guarded).
async fn transcribe(base: &str, model: &str, key: &str) {
    let boundary = "oqp-test-boundary";
    let body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\
         Content-Type: audio/wav\r\n\r\nRIFF\r\n--{boundary}--\r\n"
    );
    let auth = format!("Bearer {key}");
    let content_type = format!("multipart/form-data; boundary={boundary}");
    let reply = HttpClient::new()
        .send(
            "POST".parse().unwrap(),
            &format!("{base}/v1/audio/transcriptions"),
            &[
                ("authorization", auth.as_str()),
                ("content-type", content_type.as_str()),
            ],
            body,
        )
        .await;
    assert!(reply.status.is_success(), "{}", reply.text());
}

#[tokio::test]
async fn models_a_tenant_loads_through_oqp_on_uncounted_routes_do_not_turn_holding_off() {
    let _exclusive = crate::support::exclusive().await;
    let fake = FakeOllama::builder()
        .model("alpha")
        .model("beta")
        .model("gamma")
        .loaded("alpha")
        .slots(1)
        .vram(10 * GIB)
        .model_size("alpha", 8 * GIB)
        .model_size("beta", 8 * GIB)
        .model_size("gamma", 8 * GIB)
        .load_time(LOAD)
        .unload_time(UNLOAD)
        .latency(SERVICE)
        .spawn()
        .await;
    let yaml = config(&fake.url(), true).replace(
        "      vram: 10GiB\n",
        "      vram: 10GiB\n      model_sync_interval: 1\n",
    );
    let stack = Stack::start(&yaml).await;
    let dispatcher = stack.control.dataplane().unwrap().app().dispatcher.clone();
    // Resident with its footprint, as a poll showed it.
    let resident = |model: &str| {
        dispatcher.swap_stats()[0]
            .resident
            .iter()
            .any(|(name, bytes)| name.starts_with(model) && *bytes == 8 * GIB)
    };
    assert!(eventually(Duration::from_secs(10), || resident("alpha")).await);
    // One tenant loads two models through oqp with multipart forms: neither load is taken for
    // one around oqp.
    for model in ["gamma", "beta"] {
        transcribe(&stack.url(), model, "sk-yvonne-0123456789").await;
        assert!(
            eventually(Duration::from_secs(10), || resident(model)).await,
            "{:?}",
            dispatcher.swap_stats()
        );
        assert!(
            !dispatcher.swap_stats()[0].bypassed,
            "{model} was loaded through oqp: {:?}",
            dispatcher.swap_stats()
        );
    }
    // Holding still works for the others: alpha does not fit beside beta, so xavier's request
    // is held and switched to, as a batch would be.
    let reply = generate(stack.url(), "alpha", Some("sk-xavier-0123456789")).await;
    assert!(reply.status.is_success(), "{}", reply.text());
    let stat = &dispatcher.swap_stats()[0];
    assert!(stat.switches >= 1 && !stat.bypassed, "{stat:?}");
    stack.shutdown().await;
}
