//! End to end: capacity as Ollama has it, slots per model runner. Against a fake that runs
//! each model as its own runner (`num_parallel` slots, one for embedding models and forced
//! architectures; a request beyond them waits inside the fake, which logs it), oqp sends each
//! runner only what it can run, so work waits in oqp's queue in tier and fair-share order,
//! never in Ollama's FIFO; an idle runner is used while another's queue waits; and a request
//! failing over waits holding nothing.

use oqp_tests::client::{HttpClient, Reply};
use oqp_tests::fake::{Failure, FakeOllama};
use oqp_tests::harness::{ConfigYaml, Host, Key, Stack};
use serde_json::{Value, json};

use crate::support::{dispatcher, wait_depth};

const CHAT: &str = "sk-chat-0123456789";
const BATCH: &str = "sk-batch-0123456789";
const OTHER: &str = "sk-other-0123456789";

fn config(hosts: &[Host]) -> String {
    hosts
        .iter()
        .fold(ConfigYaml::new().max_concurrent(8), |yaml, host| {
            yaml.host(host.clone())
        })
        .strategy("model_aware")
        .under("queue", "  model_swap:\n    enabled: false\n")
        .under("embedding_cache", "  enabled: false\n")
        .key(
            Key::new(CHAT, "chat")
                .set("max_priority", "high")
                .set("default_priority", "high"),
        )
        .key(
            Key::new(BATCH, "batch")
                .set("max_priority", "low")
                .set("default_priority", "low")
                .set("max_concurrent", 1),
        )
        .key(Key::new(OTHER, "other").set("default_priority", "low"))
        .yaml()
}

fn host(url: &str, name: &str, max_concurrent: u32, num_parallel: u32) -> Host {
    Host::ollama(name, url)
        .set("max_concurrent", max_concurrent)
        .set("num_parallel", num_parallel)
}

fn spawn(
    base: &str,
    key: &'static str,
    path: &'static str,
    body: Value,
) -> tokio::task::JoinHandle<Reply> {
    let url = format!("{base}{path}");
    tokio::spawn(async move {
        HttpClient::new()
            .post_json(&url, &[("authorization", &format!("Bearer {key}"))], &body)
            .await
    })
}

fn chat(model: &str) -> Value {
    json!({"model": model, "stream": false, "messages": [{"role": "user", "content": "hi"}]})
}

#[tokio::test]
async fn one_slot_per_runner_a_high_chat_sent_after_four_low_ones_runs_second() {
    // The box takes eight at once, but llama3's runner runs one.
    let fake = FakeOllama::builder()
        .model("llama3")
        .runners(1)
        .slots(8)
        .spawn()
        .await;
    let stack = Stack::start(&config(&[host(&fake.url(), "gpu", 8, 1)])).await;
    let base = stack.url();
    let handle = fake.handle();
    let queue = dispatcher(&stack);
    handle.hold();
    // Four low-tier chats from a client without a cap of its own.
    let low: Vec<_> = (0..4)
        .map(|_| spawn(&base, OTHER, "/api/chat", chat("llama3")))
        .collect();
    handle.wait_in_flight(1).await;
    wait_depth(&queue, 3).await;
    assert_eq!(
        handle.requests_to("/api/chat").len(),
        1,
        "one at a time to the runner"
    );
    let high = spawn(&base, CHAT, "/api/chat", chat("llama3"));
    wait_depth(&queue, 4).await;
    handle.release_all();
    assert_eq!(high.await.unwrap().status, 200);
    for task in low {
        assert_eq!(task.await.unwrap().status, 200);
    }
    let order: Vec<String> = handle
        .runner_log()
        .iter()
        .filter_map(|entry| entry.client.clone())
        .collect();
    assert_eq!(order, ["other", "chat", "other", "other", "other"]);
    assert_eq!(handle.runner_peak("llama3"), 1);
    assert_eq!(
        handle.runner_peak_waiting("llama3"),
        0,
        "nothing waited inside Ollama"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn an_idle_runner_starts_at_once_while_another_models_queue_waits() {
    let fake = FakeOllama::builder()
        .model("llama3")
        .model("qwen3")
        .runners(1)
        .slots(8)
        .spawn()
        .await;
    let stack = Stack::start(&config(&[host(&fake.url(), "gpu", 8, 1)])).await;
    let base = stack.url();
    let handle = fake.handle();
    let queue = dispatcher(&stack);
    handle.hold();
    let busy: Vec<_> = (0..3)
        .map(|_| spawn(&base, OTHER, "/api/chat", chat("llama3")))
        .collect();
    handle.wait_in_flight(1).await;
    wait_depth(&queue, 2).await;
    // The same client's chat for another model: its runner is idle, so it runs now, ahead of
    // the two waiting for llama3's.
    let idle = spawn(&base, OTHER, "/api/chat", chat("qwen3"));
    handle.wait_in_flight(2).await;
    assert_eq!(handle.runner_in_flight("qwen3"), 1);
    assert_eq!(queue.total_depth(), 2);
    handle.release_all();
    assert_eq!(idle.await.unwrap().status, 200);
    for task in busy {
        assert_eq!(task.await.unwrap().status, 200);
    }
    assert_eq!(handle.runner_peak("llama3"), 1);
    assert_eq!(handle.runner_peak_waiting("llama3"), 0);
    stack.shutdown().await;
}

#[tokio::test]
async fn an_embedding_runner_has_one_slot_whatever_the_setting_learned_from_show() {
    let fake = FakeOllama::builder()
        .model("llama3")
        .embedding_model("all-minilm")
        .model("qwen3-vl")
        .architecture("qwen3-vl", "qwen3vl")
        .runners(4)
        .slots(16)
        .spawn()
        .await;
    let stack = Stack::start(&config(&[host(&fake.url(), "gpu", 8, 4)])).await;
    let base = stack.url();
    let handle = fake.handle();
    let queue = dispatcher(&stack);
    // The control plane asked /api/show and put what it learned in the snapshot.
    let policy = stack.control.dataplane().unwrap().app().store.load();
    let runners = &policy.hosts[0].runners;
    assert_eq!(runners.slots("all-minilm:latest").0, 1);
    assert_eq!(
        runners.slots("all-minilm:latest").1.map(|r| &**r),
        Some("embedding")
    );
    assert_eq!(
        runners.slots("qwen3-vl:latest").1.map(|r| &**r),
        Some("architecture qwen3vl")
    );
    assert_eq!(runners.slots("llama3:latest"), (4, None));
    handle.hold();
    let embed = |n: usize| json!({"model": "all-minilm", "input": format!("text {n}")});
    let low: Vec<_> = (0..5)
        .map(|n| spawn(&base, OTHER, "/api/embed", embed(n)))
        .collect();
    handle.wait_in_flight(1).await;
    wait_depth(&queue, 4).await;
    let high = spawn(&base, CHAT, "/api/embed", embed(99));
    wait_depth(&queue, 5).await;
    // Chats for llama3 still get its four slots meanwhile.
    let chats: Vec<_> = (0..4)
        .map(|_| spawn(&base, CHAT, "/api/chat", chat("llama3")))
        .collect();
    handle.wait_in_flight(5).await;
    handle.release_all();
    assert_eq!(high.await.unwrap().status, 200);
    for task in low.into_iter().chain(chats) {
        assert_eq!(task.await.unwrap().status, 200);
    }
    let embeds: Vec<String> = handle
        .runner_log()
        .iter()
        .filter(|entry| entry.model == "all-minilm:latest")
        .filter_map(|entry| entry.client.clone())
        .collect();
    assert_eq!(
        embeds,
        ["other", "chat", "other", "other", "other", "other"]
    );
    assert_eq!(handle.runner_peak("all-minilm"), 1);
    assert_eq!(handle.runner_peak_waiting("all-minilm"), 0);
    assert_eq!(handle.runner_peak("llama3"), 4);

    // The runners are visible: in the report the control plane shows `oqpctl hosts`.
    let metrics = HttpClient::new()
        .get(
            &format!("{base}/metrics"),
            &[("authorization", &format!("Bearer {CHAT}"))],
        )
        .await
        .text();
    assert!(
        metrics.contains(r#"oqp_runner_slots{host="gpu",model="all-minilm:latest"} 1"#),
        "{metrics}"
    );
    assert!(metrics.contains(r#"oqp_runner_slots{host="gpu",model="llama3:latest"} 4"#));
    assert!(metrics.contains("oqp_ollama_queued_estimate 0"));
    stack.shutdown().await;
}

#[tokio::test]
async fn a_request_failing_over_waits_holding_nothing() {
    // a and b have llama3; b is busy with another model's request; c alone has qwen3.
    let a = FakeOllama::builder().model("llama3").spawn().await;
    let b = FakeOllama::builder()
        .model("llama3")
        .model("mistral")
        .spawn()
        .await;
    let c = FakeOllama::builder().model("qwen3").spawn().await;
    let hosts = [
        host(&a.url(), "a", 1, 1),
        host(&b.url(), "b", 1, 1),
        host(&c.url(), "c", 1, 1),
    ];
    let stack = Stack::start(&config(&hosts)).await;
    let base = stack.url();
    let queue = dispatcher(&stack);
    b.handle().hold();
    let blocker = spawn(&base, CHAT, "/api/chat", chat("mistral"));
    b.handle().wait_in_flight(1).await;
    // a says it is busy: the batch client's llama3 chat must go to b, whose slot is taken. It
    // goes back to the queue and holds nothing: not a's slot, not its client's cap of one.
    a.handle().fail_next(Failure::Status(
        503,
        r#"{"error":"server busy, please try again.  maximum pending requests exceeded"}"#.into(),
    ));
    let failing = spawn(&base, BATCH, "/api/chat", chat("llama3"));
    wait_depth(&queue, 1).await;
    // The same client's request for the idle box is served at once.
    let reply = HttpClient::new()
        .post_json(
            &format!("{base}/api/chat"),
            &[("authorization", &format!("Bearer {BATCH}"))],
            &chat("qwen3"),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-failover-host").as_deref(), Some("c"));
    assert_eq!(
        queue.total_depth(),
        1,
        "the failing-over request still waits"
    );
    b.handle().release_all();
    assert_eq!(blocker.await.unwrap().status, 200);
    let failed_over = failing.await.unwrap();
    assert_eq!(failed_over.status, 200, "{}", failed_over.text());
    assert_eq!(failed_over.header("x-failover-host").as_deref(), Some("b"));
    stack.shutdown().await;
}
