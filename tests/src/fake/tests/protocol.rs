//! Routes, content types and response shapes of the native API.

use http::{Method, StatusCode};
use serde_json::json;

use super::{call, call_with, post};
use crate::fake::FakeOllama;

#[tokio::test]
async fn metadata_routes_have_ollama_shapes() {
    let fake = FakeOllama::builder()
        .model("llama3.2")
        .embedding_model("all-minilm")
        .loaded("llama3.2")
        .version("0.9.9")
        .spawn()
        .await;
    let addr = fake.addr();

    let root = call(addr, Method::GET, "/", "").await;
    assert_eq!(
        (root.status, root.text().as_str()),
        (StatusCode::OK, "Ollama is running")
    );
    assert_eq!(root.content_type(), Some("text/plain; charset=utf-8"));
    let head = call(addr, Method::HEAD, "/", "").await;
    assert_eq!((head.status, head.body.len()), (StatusCode::OK, 0));
    assert_eq!(head.headers["content-length"], "17");

    let version = call(addr, Method::GET, "/api/version", "").await;
    assert_eq!(version.json(), json!({ "version": "0.9.9" }));
    assert_eq!(
        version.content_type(),
        Some("application/json; charset=utf-8")
    );
    assert_eq!(
        call(addr, Method::HEAD, "/api/version", "").await.status,
        StatusCode::OK
    );

    let tags = call(addr, Method::GET, "/api/tags", "").await.json();
    let first = &tags["models"][0];
    assert_eq!(first["name"], "llama3.2:latest");
    assert_eq!(first["model"], "llama3.2:latest");
    assert_eq!(first["digest"].as_str().map(str::len), Some(64));
    assert_eq!(first["details"]["format"], "gguf");
    assert!(
        first["modified_at"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z'))
    );
    assert_eq!(tags["models"][1]["details"]["family"], "bert");

    let ps = call(addr, Method::GET, "/api/ps", "").await.json();
    assert_eq!(ps["models"].as_array().map(Vec::len), Some(1));
    assert_eq!(ps["models"][0]["name"], "llama3.2:latest");
    assert!(ps["models"][0]["expires_at"].is_string());
    assert!(ps["models"][0]["size_vram"].is_u64() && ps["models"][0]["context_length"].is_u64());

    let show = post(addr, "/api/show", json!({ "model": "LLAMA3.2" }))
        .await
        .json();
    assert!(show["model_info"].is_object());
    assert_eq!(show["capabilities"], json!(["completion", "tools"]));
    let show = post(addr, "/api/show", json!({ "name": "all-minilm" }))
        .await
        .json();
    assert_eq!(show["capabilities"], json!(["embedding"]));

    let empty = FakeOllama::builder().spawn().await;
    assert_eq!(
        call(empty.addr(), Method::GET, "/api/tags", "")
            .await
            .json(),
        json!({ "models": [] })
    );
    assert_eq!(
        call(empty.addr(), Method::GET, "/api/ps", "").await.json(),
        json!({ "models": [] })
    );
}

#[tokio::test]
async fn unknown_routes_and_methods_get_gin_texts() {
    let fake = FakeOllama::builder().spawn().await;
    let missing = call(fake.addr(), Method::GET, "/api/nope", "").await;
    assert_eq!(
        (missing.status, missing.text().as_str()),
        (StatusCode::NOT_FOUND, "404 page not found")
    );
    assert_eq!(missing.content_type(), Some("text/plain"));
    let wrong = call(fake.addr(), Method::GET, "/api/generate", "").await;
    assert_eq!(
        (wrong.status, wrong.text().as_str()),
        (StatusCode::METHOD_NOT_ALLOWED, "405 method not allowed")
    );
    assert_eq!(
        call(fake.addr(), Method::HEAD, "/api/ps", "").await.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
    assert_eq!(
        call(fake.addr(), Method::POST, "/api/delete", "{}")
            .await
            .status,
        StatusCode::METHOD_NOT_ALLOWED
    );
}

#[tokio::test]
async fn load_and_unload_idioms_answer_one_object() {
    let fake = FakeOllama::builder().model("llama3.2").spawn().await;
    let addr = fake.addr();
    let load = post(addr, "/api/generate", json!({ "model": "llama3.2" })).await;
    assert_eq!(load.content_type(), Some("application/json; charset=utf-8"));
    let load = load.json();
    assert_eq!(
        (load["done"].clone(), load["done_reason"].clone()),
        (json!(true), json!("load"))
    );
    assert_eq!(load["response"], "");
    assert_eq!(
        call(addr, Method::GET, "/api/ps", "").await.json()["models"][0]["model"],
        "llama3.2:latest"
    );

    let unload = post(
        addr,
        "/api/chat",
        json!({ "model": "llama3.2", "messages": [], "keep_alive": 0.0 }),
    )
    .await
    .json();
    assert_eq!(unload["done_reason"], "unload");
    assert_eq!(
        unload["message"],
        json!({ "role": "assistant", "content": "" })
    );
    assert_eq!(
        call(addr, Method::GET, "/api/ps", "").await.json(),
        json!({ "models": [] })
    );
    assert!(
        fake.handle().requests_to("/api/generate")[0]
            .finished_at
            .is_some()
    );
    assert_eq!(
        fake.handle().peak_concurrency(),
        0,
        "load and unload take no slot"
    );
}

#[tokio::test]
async fn model_management_endpoints() {
    let fake = FakeOllama::builder().model("llama3.2").spawn().await;
    let addr = fake.addr();
    let mut pull = super::open(
        addr,
        Method::POST,
        "/api/pull",
        r#"{"model":"all-minilm"}"#,
        &[],
    )
    .await
    .unwrap_or_else(|e| panic!("pull: {e}"));
    assert_eq!(pull.headers["content-type"], "application/x-ndjson");
    let lines = pull.rest().await.unwrap_or_default();
    assert_eq!(
        lines.first().map(String::as_str),
        Some(r#"{"status":"pulling manifest"}"#)
    );
    assert_eq!(
        lines.last().map(String::as_str),
        Some(r#"{"status":"success"}"#)
    );
    let quiet = post(addr, "/api/pull", json!({ "model": "x", "stream": false })).await;
    assert_eq!(
        (quiet.content_type(), quiet.json()),
        (Some("application/json"), json!({ "status": "success" }))
    );

    let copy = post(
        addr,
        "/api/copy",
        json!({ "source": "llama3.2", "destination": "mine" }),
    )
    .await;
    assert_eq!((copy.status, copy.body.len()), (StatusCode::OK, 0));
    let delete = call(addr, Method::DELETE, "/api/delete", r#"{"model":"mine"}"#).await;
    assert_eq!((delete.status, delete.body.len()), (StatusCode::OK, 0));
    let names: Vec<String> = call(addr, Method::GET, "/api/tags", "").await.json()["models"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["name"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(names, ["llama3.2:latest", "all-minilm:latest", "x:latest"]);

    fake.handle().remove_model("x");
    fake.handle().add_model("late");
    assert_eq!(
        post(addr, "/api/show", json!({ "model": "x" }))
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        post(addr, "/api/show", json!({ "model": "late" }))
            .await
            .status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn host_check_refuses_foreign_hosts() {
    let fake = FakeOllama::builder().host_check(true).spawn().await;
    let foreign = call_with(
        fake.addr(),
        Method::GET,
        "/api/version",
        "",
        &[("host", "proxy.example.com")],
    )
    .await;
    assert_eq!(
        (foreign.status, foreign.body.len()),
        (StatusCode::FORBIDDEN, 0)
    );
    assert!(foreign.content_type().is_none());
    let local = call_with(
        fake.addr(),
        Method::GET,
        "/api/version",
        "",
        &[("host", "localhost:11434")],
    )
    .await;
    assert_eq!(local.status, StatusCode::OK);
    assert_eq!(
        fake.handle().requests()[0].header("host").as_deref(),
        Some("proxy.example.com")
    );
}

#[tokio::test]
async fn final_objects_report_the_figures_a_request_sets() {
    use crate::fake::USAGE_HEADER;
    let fake = FakeOllama::builder()
        .model("llama3")
        .embedding_model("nomic-embed-text")
        .spawn()
        .await;
    let addr = fake.addr();
    let reported = [(
        USAGE_HEADER,
        "total_duration=7000000000, prompt_eval_count=11, eval_count=22",
    )];
    let chat = serde_json::json!({"model": "llama3", "messages": [{"role": "user", "content": "hi"}], "stream": false});
    let answer = super::call_with(
        addr,
        Method::POST,
        "/api/chat",
        &chat.to_string(),
        &reported,
    )
    .await
    .json();
    assert_eq!(answer["total_duration"], 7_000_000_000_u64);
    assert_eq!(answer["prompt_eval_count"], 11);
    assert_eq!(answer["eval_count"], 22);
    // Streamed: the last line carries them.
    let mut streamed = chat.clone();
    streamed["stream"] = serde_json::json!(true);
    let text = super::call_with(
        addr,
        Method::POST,
        "/api/chat",
        &streamed.to_string(),
        &reported,
    )
    .await
    .text();
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(last["eval_count"], 22);
    // OpenAI: in the usage object; never a total_duration.
    let openai = super::call_with(
        addr,
        Method::POST,
        "/v1/chat/completions",
        &serde_json::json!({"model": "llama3", "messages": [{"role": "user", "content": "hi"}]})
            .to_string(),
        &reported,
    )
    .await
    .json();
    assert_eq!(openai["usage"]["prompt_tokens"], 11);
    assert_eq!(openai["usage"]["completion_tokens"], 22);
    assert!(openai.get("total_duration").is_none());
    let embed = serde_json::json!({"model": "nomic-embed-text", "input": ["a"]});
    let answer = super::call_with(
        addr,
        Method::POST,
        "/api/embed",
        &embed.to_string(),
        &reported,
    )
    .await
    .json();
    assert_eq!(answer["total_duration"], 7_000_000_000_u64);
    assert_eq!(answer["prompt_eval_count"], 11);
    // Without the header: the measured figures.
    let answer = super::post(addr, "/api/chat", chat).await.json();
    assert!(answer["total_duration"].as_u64().unwrap() < 7_000_000_000);
}
