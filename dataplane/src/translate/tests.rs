use std::time::Instant;

use http_body_util::BodyExt;
use serde_json::{Value, json};

use super::*;

fn planned(route: Route, body: Value) -> Translated {
    match plan(
        route,
        body.to_string().as_bytes(),
        "m",
        "m:latest",
        false,
        Instant::now(),
    ) {
        Ok(Plan::Send(translated)) => translated,
        Ok(Plan::Answer(_)) => panic!("answered without an engine"),
        Err(error) => panic!("refused: {error}"),
    }
}

fn sent(translated: &Translated) -> Value {
    serde_json::from_slice(&translated.body).unwrap()
}

fn refusal(route: Route, body: Value) -> (StatusCode, String) {
    match plan(
        route,
        body.to_string().as_bytes(),
        "m",
        "m",
        false,
        Instant::now(),
    ) {
        Err(error) => (error.status(), error.to_string()),
        Ok(other) => panic!("not refused: {other:?}"),
    }
}

async fn answered(response: Response<Body>) -> (StatusCode, String, Value) {
    let status = response.status();
    let content_type = response
        .headers()
        .get(header::CONTENT_TYPE)
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        content_type,
        serde_json::from_slice(&bytes).unwrap(),
    )
}

/// The engine's answer `chunks` (one frame each) with `content_type` and `status`,
/// translated for `shape`; the client's body back, whole.
async fn translated(
    shape: Shape,
    stream: bool,
    status: StatusCode,
    content_type: &str,
    chunks: &[&str],
) -> (http::HeaderMap, String) {
    let frames: Vec<Result<http_body::Frame<Bytes>, crate::body::BoxError>> = chunks
        .iter()
        .map(|chunk| Ok(http_body::Frame::data(Bytes::from(chunk.to_string()))))
        .collect();
    let inner = http_body_util::StreamBody::new(futures_util::stream::iter(frames)).boxed();
    let mut upstream = Response::new(inner);
    *upstream.status_mut() = status;
    upstream.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_str(content_type).unwrap(),
    );
    let reply = Reply {
        shape,
        model: "m".into(),
        stream,
        received: Instant::now(),
    };
    let (parts, body) = response(reply, upstream).into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (parts.headers, String::from_utf8(bytes.to_vec()).unwrap())
}

fn lines(text: &str) -> Vec<Value> {
    assert!(text.ends_with('\n'), "{text:?}");
    text.lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

#[test]
fn a_chat_becomes_a_chat_completion_with_every_field_ollama_names() {
    let translated = planned(
        Route::Chat,
        json!({
            "model": "m",
            "messages": [
                {"role": "System", "content": "be brief"},
                {"role": "user", "content": "look", "images": ["iVBORw0KGgoAAAANSUhEUg=="]},
                {"role": "assistant", "content": "", "thinking": "hmm",
                 "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}]},
                {"role": "tool", "content": "2", "tool_name": "add"},
            ],
            "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}],
            "format": {"type": "object"},
            "options": {"temperature": 0.5, "top_k": 3, "num_predict": 7, "stop": "x",
                        "seed": 1, "repeat_penalty": 1.1, "num_ctx": 4096},
            "think": "high",
            "keep_alive": "5m",
        }),
    );
    assert_eq!(translated.path.as_str(), "/v1/chat/completions");
    assert_eq!(translated.inference, Inference::OpenAiCompletion);
    assert!(translated.reply.stream);
    let body = sent(&translated);
    assert_eq!(body["model"], "m:latest");
    assert_eq!(
        body["messages"][0],
        json!({"role": "system", "content": "be brief"})
    );
    assert_eq!(
        body["messages"][1]["content"],
        json!([
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg=="}},
        ])
    );
    assert_eq!(body["messages"][2]["reasoning_content"], "hmm");
    assert_eq!(
        body["messages"][2]["tool_calls"],
        json!([{"id": "call_2_0", "type": "function",
                "function": {"name": "add", "arguments": "{\"a\":1}"}}])
    );
    assert_eq!(
        body["messages"][3],
        json!({"role": "tool", "content": "2", "name": "add"})
    );
    assert_eq!(body["tools"][0]["function"]["name"], "add");
    assert_eq!(
        body["response_format"],
        json!({"type": "json_schema", "json_schema": {"name": "schema", "schema": {"type": "object"}}})
    );
    assert_eq!(body["temperature"], 0.5);
    assert_eq!(body["top_k"], 3);
    assert_eq!(body["max_tokens"], 7);
    assert_eq!(body["stop"], json!(["x"]));
    assert_eq!(body["seed"], 1);
    assert_eq!(body["repeat_penalty"], 1.1);
    assert_eq!(body["reasoning_effort"], "high");
    assert_eq!(body["chat_template_kwargs"]["enable_thinking"], true);
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"], json!({"include_usage": true}));
    // Load-time options and keep_alive have no per-request equivalent.
    assert!(body.get("num_ctx").is_none() && body.get("keep_alive").is_none());
}

#[test]
fn format_json_and_no_stream_and_no_limit() {
    let translated = planned(
        Route::Chat,
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
               "format": "json", "stream": false, "options": {"num_predict": -1}, "think": false}),
    );
    let body = sent(&translated);
    assert_eq!(body["response_format"], json!({"type": "json_object"}));
    assert_eq!(body["stream"], false);
    assert!(body.get("stream_options").is_none());
    assert!(body.get("max_tokens").is_none());
    assert_eq!(
        body["chat_template_kwargs"],
        json!({"enable_thinking": false})
    );
    assert!(!translated.reply.stream);
}

#[test]
fn what_cannot_be_translated_is_a_400_naming_the_field() {
    let chat = |extra: Value| {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        refusal(Route::Chat, body)
    };
    for (extra, field) in [
        (json!({"format": 3}), "\"format\""),
        (json!({"think": "very"}), "\"think\""),
        (json!({"logprobs": true}), "\"logprobs\""),
        (
            json!({"options": {"temperature": "hot"}}),
            "\"options.temperature\"",
        ),
        (
            json!({"messages": [{"role": "user", "content": 1}]}),
            "\"messages[0].content\"",
        ),
        (json!({"stream": "yes"}), "\"stream\""),
    ] {
        let (status, message) = chat(extra.clone());
        assert_eq!(status, StatusCode::BAD_REQUEST, "{extra}");
        assert!(message.contains(field), "{extra}: {message}");
        assert!(message.contains("kind openai"), "{message}");
    }
    for (body, field) in [
        (
            json!({"model": "m", "prompt": "a", "suffix": "b"}),
            "\"suffix\"",
        ),
        (
            json!({"model": "m", "prompt": "a", "context": [1, 2]}),
            "\"context\"",
        ),
        (
            json!({"model": "m", "prompt": "a", "template": "{{ .Prompt }}"}),
            "\"template\"",
        ),
        (
            json!({"model": "m", "prompt": "a", "raw": true, "system": "s"}),
            "\"system\"",
        ),
    ] {
        let (status, message) = refusal(Route::Generate, body.clone());
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert!(message.contains(field), "{body}: {message}");
    }
    let (status, message) = refusal(Route::Embed, json!({"model": "m", "input": 3}));
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(message.contains("\"input\""), "{message}");
}

#[test]
fn a_generate_is_a_chat_of_system_and_prompt_or_raw_a_completion() {
    let translated = planned(
        Route::Generate,
        json!({"model": "m", "prompt": "p", "system": "s", "images": ["/9j/4AAQSkZJRgABAQ=="],
               "options": {"num_predict": 3}, "stream": false}),
    );
    assert_eq!(translated.path.as_str(), "/v1/chat/completions");
    assert_eq!(
        translated.reply.shape,
        Shape::Generate { completions: false }
    );
    let body = sent(&translated);
    assert_eq!(
        body["messages"][0],
        json!({"role": "system", "content": "s"})
    );
    assert_eq!(body["messages"][1]["role"], "user");
    assert_eq!(
        body["messages"][1]["content"][0],
        json!({"type": "text", "text": "p"})
    );
    assert_eq!(
        body["messages"][1]["content"][1]["image_url"]["url"],
        "data:image/jpeg;base64,/9j/4AAQSkZJRgABAQ=="
    );
    assert_eq!(body["max_tokens"], 3);
    let raw = planned(
        Route::Generate,
        json!({"model": "m", "prompt": "p", "raw": true}),
    );
    assert_eq!(raw.path.as_str(), "/v1/completions");
    assert_eq!(raw.reply.shape, Shape::Generate { completions: true });
    assert_eq!(sent(&raw)["prompt"], "p");
}

#[test]
fn embeddings_become_v1_embeddings() {
    let embed = planned(
        Route::Embed,
        json!({"model": "m", "input": ["a", "b"], "dimensions": 2, "truncate": true}),
    );
    assert_eq!(embed.path.as_str(), "/v1/embeddings");
    assert_eq!(embed.inference, Inference::OpenAiEmbeddings);
    assert_eq!(
        embed.reply.shape,
        Shape::Embed {
            dimensions: Some(2)
        }
    );
    assert!(!embed.reply.stream);
    assert_eq!(sent(&embed)["input"], json!(["a", "b"]));
    // The embedding routes have no `stream`: whatever it says, it is not read.
    let legacy = planned(
        Route::Embeddings,
        json!({"model": "m", "prompt": "a", "stream": "yes"}),
    );
    assert!(!legacy.reply.stream);
    assert_eq!(legacy.reply.shape, Shape::Embeddings);
    assert_eq!(sent(&legacy)["input"], "a");
}

#[tokio::test]
async fn load_and_empty_calls_are_answered_without_an_engine() {
    let at_once = |route, body: Value| match plan(
        route,
        body.to_string().as_bytes(),
        "m",
        "m",
        false,
        Instant::now(),
    ) {
        Ok(Plan::Answer(response)) => response,
        other => panic!("sent: {other:?}"),
    };
    let (status, content_type, body) =
        answered(at_once(Route::Chat, json!({"model": "m", "messages": []}))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(content_type, "application/json; charset=utf-8");
    assert_eq!(body["done_reason"], "load");
    assert_eq!(body["message"], json!({"role": "assistant", "content": ""}));
    let (_, _, body) = answered(at_once(
        Route::Generate,
        json!({"model": "m", "prompt": "", "keep_alive": 0}),
    ))
    .await;
    assert_eq!(body["done_reason"], "unload");
    assert_eq!(body["response"], "");
    let (_, _, body) = answered(at_once(Route::Embed, json!({"model": "m", "input": []}))).await;
    assert_eq!(body, json!({"model": "m", "embeddings": []}));
    let (_, _, body) = answered(at_once(
        Route::Embeddings,
        json!({"model": "m", "prompt": ""}),
    ))
    .await;
    assert_eq!(body, json!({"embedding": []}));
}

const ROLE: &str = "data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":null}}],\"object\":\"chat.completion.chunk\"}\n\n";

#[tokio::test]
async fn a_stream_becomes_ndjson_line_by_line_with_a_last_line_of_counts_and_durations() {
    let (headers, text) = translated(
        Shape::Chat,
        true,
        StatusCode::OK,
        "text/event-stream",
        &[
            ROLE,
            ": ping\n\n",
            // A line split across frames.
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"reasoning_content\":\"t\"}}]}\n\ndata: {\"choices\":[{\"index\":0,\"del",
            "ta\":{\"content\":\"He\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"llo\"}}]}\r\n\r\n",
            "data: {\"choices\":[{\"finish_reason\":\"length\",\"index\":0,\"delta\":{}}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"completion_tokens\":3,\"prompt_tokens\":31},\"timings\":{\"cache_n\":30,\"prompt_n\":1,\"prompt_ms\":3.5,\"predicted_n\":3,\"predicted_ms\":6.25}}\n\n",
            "data: [DONE]\n\n",
        ],
    )
    .await;
    assert_eq!(headers[header::CONTENT_TYPE], "application/x-ndjson");
    let read = lines(&text);
    assert_eq!(read.len(), 5, "{text}");
    // The role, on its own: the opening line, at once.
    assert_eq!(
        read[0]["message"],
        json!({"role": "assistant", "content": ""})
    );
    assert_eq!(read[0]["done"], false);
    assert_eq!(
        read[1]["message"],
        json!({"role": "assistant", "content": "", "thinking": "t"})
    );
    assert_eq!(
        read[2]["message"],
        json!({"role": "assistant", "content": "He"})
    );
    assert_eq!(read[2]["model"], "m");
    assert_eq!(read[2]["done"], false);
    assert!(read[2]["created_at"].as_str().unwrap().ends_with('Z'));
    let last = &read[4];
    assert_eq!(last["done"], true);
    assert_eq!(last["done_reason"], "length");
    assert_eq!(last["message"], json!({"role": "assistant", "content": ""}));
    assert_eq!(last["prompt_eval_count"], 31);
    assert_eq!(last["eval_count"], 3);
    assert_eq!(last["prompt_eval_duration"], 3_500_000);
    assert_eq!(last["eval_duration"], 6_250_000);
    assert!(last["total_duration"].as_u64().is_some());
}

/// What each frame of the engine's stream makes the client get as that frame arrives.
async fn per_frame(shape: Shape, frames: &[&str]) -> Vec<Vec<Value>> {
    let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
    let inner = http_body_util::StreamBody::new(
        tokio_stream::wrappers::UnboundedReceiverStream::new(receiver),
    )
    .boxed();
    let mut upstream = Response::new(inner);
    upstream.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    let reply = Reply {
        shape,
        model: "m".into(),
        stream: true,
        received: Instant::now(),
    };
    let mut body = response(reply, upstream).into_body();
    let mut seen = Vec::new();
    for frame in frames {
        let data: Result<http_body::Frame<Bytes>, crate::body::BoxError> =
            Ok(http_body::Frame::data(Bytes::from(frame.to_string())));
        sender.send(data).unwrap();
        // What the body yields before it would wait for the next frame.
        let mut text = String::new();
        while let Some(Some(frame)) = futures_util::FutureExt::now_or_never(body.frame()) {
            text.push_str(std::str::from_utf8(frame.unwrap().data_ref().unwrap()).unwrap());
        }
        seen.push(
            text.lines()
                .map(|line| serde_json::from_str(line).unwrap())
                .collect(),
        );
    }
    seen
}

#[tokio::test]
async fn an_engines_first_event_alone_is_an_opening_line_at_once() {
    const TOKEN: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"He\"}}]}\n\n";
    // The role on its own (OpenAI's API, the fake): its line before any token.
    let seen = per_frame(Shape::Chat, &[ROLE, TOKEN]).await;
    assert_eq!(
        seen[0],
        [json!({"model": "m", "created_at": seen[0][0]["created_at"],
                "message": {"role": "assistant", "content": ""}, "done": false})]
    );
    assert_eq!(seen[1].len(), 1);
    assert_eq!(seen[1][0]["message"]["content"], "He");
    // A generate's opening line is a generate's.
    let seen = per_frame(Shape::Generate { completions: false }, &[ROLE]).await;
    assert_eq!(seen[0][0]["response"], "");
    assert_eq!(seen[0][0]["done"], false);
    // The role with the first token in one write (llama-server): no empty line.
    let together = format!("{ROLE}{TOKEN}");
    let seen = per_frame(Shape::Chat, &[&together, TOKEN]).await;
    assert_eq!(seen[0].len(), 1, "{:?}", seen[0]);
    assert_eq!(seen[0][0]["message"]["content"], "He");
    // A comment carries no event: nothing until the first event.
    let seen = per_frame(Shape::Chat, &[": ping\n\n", TOKEN]).await;
    assert!(seen[0].is_empty(), "{:?}", seen[0]);
    assert_eq!(seen[1][0]["message"]["content"], "He");
    // Only once: a second event without content writes nothing.
    let seen = per_frame(Shape::Chat, &[ROLE, ROLE, TOKEN]).await;
    assert_eq!(seen.iter().map(Vec::len).collect::<Vec<_>>(), [1, 0, 1]);
}

#[tokio::test]
async fn tool_call_fragments_are_gathered_on_the_last_line() {
    let (_, text) = translated(
        Shape::Chat,
        true,
        StatusCode::OK,
        "text/event-stream",
        &[
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"add\",\"arguments\":\"{\\\"a\\\"\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\":1}\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"finish_reason\":\"tool_calls\",\"index\":0,\"delta\":{}}]}\n\n",
            "data: [DONE]\n\n",
        ],
    )
    .await;
    let read = lines(&text);
    // The first fragment, on its own, opens the stream with a line of nothing.
    assert_eq!(read.len(), 2, "{text}");
    assert_eq!(
        read[0]["message"],
        json!({"role": "assistant", "content": ""})
    );
    let read = &read[1..];
    assert_eq!(read[0]["done_reason"], "stop");
    assert_eq!(
        read[0]["message"]["tool_calls"],
        json!([{"id": "call_1", "function": {"index": 0, "name": "add", "arguments": {"a": 1}}}])
    );
    // Without timings or usage, the durations are oqp's clock and no count is made up.
    assert!(read[0].get("eval_count").is_none());
    assert!(read[0]["eval_duration"].as_u64().is_some());
}

#[tokio::test]
async fn a_cut_or_failed_stream_ends_with_an_error_line_and_no_done() {
    // Cut: no finish, no [DONE].
    let (_, text) = translated(
        Shape::Generate { completions: false },
        true,
        StatusCode::OK,
        "text/event-stream",
        &[&format!(
            "{ROLE}data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"a\"}}}}]}}\n\n"
        )],
    )
    .await;
    let read = lines(&text);
    assert_eq!(read.len(), 2, "{text}");
    assert_eq!(read[0]["response"], "a");
    assert!(read[1]["error"].as_str().unwrap().contains("ended before"));
    // The engine's in-band error (or oqp's, when the upstream broke).
    let (_, text) = translated(
        Shape::Chat,
        true,
        StatusCode::OK,
        "text/event-stream",
        &[
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n",
            "data: {\"error\":{\"code\":500,\"message\":\"Context size has been exceeded.\",\"type\":\"server_error\"}}\n\n",
        ],
    )
    .await;
    let read = lines(&text);
    assert_eq!(read.len(), 2, "{text}");
    assert_eq!(read[1], json!({"error": "Context size has been exceeded."}));
}

#[tokio::test]
async fn a_whole_answer_is_one_object() {
    let (headers, text) = translated(
        Shape::Chat,
        false,
        StatusCode::OK,
        "application/json; charset=utf-8",
        &[
            "{\"choices\":[{\"finish_reason\":\"stop\",\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"hi\",\"reasoning_content\":\"t\",\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]}}],",
            "\"usage\":{\"completion_tokens\":8,\"prompt_tokens\":52}}",
        ],
    )
    .await;
    assert_eq!(
        headers[header::CONTENT_TYPE],
        "application/json; charset=utf-8"
    );
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["done"], true);
    assert_eq!(body["done_reason"], "stop");
    assert_eq!(
        body["message"],
        json!({"role": "assistant", "content": "hi", "thinking": "t",
               "tool_calls": [{"id": "c", "function": {"index": 0, "name": "f", "arguments": {}}}]})
    );
    assert_eq!(body["prompt_eval_count"], 52);
    assert_eq!(body["eval_count"], 8);
    // A completion's text is a generate's response.
    let (_, text) = translated(
        Shape::Generate { completions: true },
        false,
        StatusCode::OK,
        "application/json",
        &["{\"choices\":[{\"finish_reason\":\"length\",\"index\":0,\"text\":\"abc\"}]}"],
    )
    .await;
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["response"], "abc");
    assert_eq!(body["done_reason"], "length");
}

#[tokio::test]
async fn embeddings_come_back_in_order_normalised_and_cut() {
    let answer = "{\"model\":\"x\",\"object\":\"list\",\"usage\":{\"prompt_tokens\":3,\"total_tokens\":3},\"data\":[{\"embedding\":[0.0,5.0,1.0],\"index\":1,\"object\":\"embedding\"},{\"embedding\":[3.0,4.0,9.0],\"index\":0,\"object\":\"embedding\"}]}";
    let (_, text) = translated(
        Shape::Embed {
            dimensions: Some(2),
        },
        false,
        StatusCode::OK,
        "application/json",
        &[answer],
    )
    .await;
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["model"], "m");
    assert_eq!(body["embeddings"], json!([[0.6, 0.8], [0.0, 1.0]]));
    assert_eq!(body["prompt_eval_count"], 3);
    let (_, text) = translated(
        Shape::Embeddings,
        false,
        StatusCode::OK,
        "application/json",
        &[answer],
    )
    .await;
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body, json!({"embedding": [3.0, 4.0, 9.0]}));
}

#[tokio::test]
async fn an_error_status_keeps_its_status_with_ollamas_error_shape() {
    let (headers, text) = translated(
        Shape::Chat,
        true,
        StatusCode::BAD_REQUEST,
        "application/json; charset=utf-8",
        &["{\"error\":{\"code\":400,\"message\":\"request (6028 tokens) exceeds the available context size (4096 tokens), try increasing it\",\"type\":\"exceed_context_size_error\"}}"],
    )
    .await;
    assert_eq!(
        headers[header::CONTENT_TYPE],
        "application/json; charset=utf-8"
    );
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        body,
        json!({"error": "request (6028 tokens) exceeds the available context size (4096 tokens), try increasing it"})
    );
}

#[test]
fn made_up_digests_are_stable_hex() {
    let digest = inventory::digest("gpu1", "Tiny");
    assert_eq!(digest, inventory::digest("gpu1", "tiny:latest"));
    assert_ne!(digest, inventory::digest("gpu2", "tiny"));
    assert_eq!(digest.len(), 64);
    assert!(digest.bytes().all(|byte| byte.is_ascii_hexdigit()));
}

#[test]
fn not_found_uses_ollamas_wording_per_route() {
    assert_eq!(
        not_found(Route::Embed, "x").to_string(),
        "model \"x\" not found, try pulling it first"
    );
    assert_eq!(
        not_found(Route::Chat, "x").to_string(),
        "model 'x' not found"
    );
    assert_eq!(not_found(Route::Chat, "x").status(), StatusCode::NOT_FOUND);
}

#[test]
fn a_generate_with_a_suffix_is_an_infill_where_the_hosts_have_it() {
    let body = json!({"model": "m", "prompt": "def f(", "suffix": "\n    return x\n",
                      "options": {"num_predict": 4, "temperature": 0.2}});
    let translated = match plan(
        Route::Generate,
        body.to_string().as_bytes(),
        "m",
        "m:latest",
        true,
        Instant::now(),
    ) {
        Ok(Plan::Send(translated)) => translated,
        other => panic!("not sent: {other:?}"),
    };
    assert_eq!(translated.path.as_str(), "/infill");
    assert_eq!(translated.reply.shape, Shape::Infill);
    assert!(translated.reply.stream);
    let sent = sent(&translated);
    assert_eq!(sent["input_prefix"], "def f(");
    assert_eq!(sent["input_suffix"], "\n    return x\n");
    assert_eq!(sent["max_tokens"], 4);
    assert_eq!(sent["temperature"], 0.2);
    assert_eq!(sent["stream"], true);
    assert!(sent.get("stream_options").is_none(), "{sent}");
    assert!(sent.get("messages").is_none(), "{sent}");
    // Hosts without /infill: the 400 naming the field.
    let (status, message) = refusal(Route::Generate, body.clone());
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(message.contains("\"suffix\""), "{message}");
    // What /infill cannot take, even where it exists.
    for (extra, field) in [
        (json!({"system": "s"}), "\"system\""),
        (json!({"images": ["aGk="]}), "\"images\""),
        (json!({"format": "json"}), "\"format\""),
    ] {
        let mut refused_body = body.clone();
        refused_body
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        match plan(
            Route::Generate,
            refused_body.to_string().as_bytes(),
            "m",
            "m",
            true,
            Instant::now(),
        ) {
            Err(error) => {
                assert_eq!(error.status(), StatusCode::BAD_REQUEST);
                assert!(error.to_string().contains(field), "{error}");
            }
            Ok(other) => panic!("not refused: {other:?}"),
        }
    }
}

#[tokio::test]
async fn an_infill_stream_becomes_generate_lines_with_the_engines_counts() {
    let events = [
        "data: {\"index\":0,\"content\":\"a\",\"stop\":false,\"tokens_predicted\":1,\"tokens_evaluated\":8}\n\n",
        "data: {\"index\":0,\"content\":\"b\",\"stop\":false,\"tokens_predicted\":2,\"tokens_evaluated\":8}\n\n",
        "data: {\"index\":0,\"content\":\"\",\"stop\":true,\"tokens_predicted\":2,\"tokens_evaluated\":8,\"stop_type\":\"limit\",\"timings\":{\"cache_n\":6,\"prompt_n\":2,\"prompt_ms\":7.5,\"predicted_n\":2,\"predicted_ms\":4.0}}\n\n",
    ];
    let (headers, text) = translated(
        Shape::Infill,
        true,
        StatusCode::OK,
        "text/event-stream",
        &events,
    )
    .await;
    assert_eq!(headers[header::CONTENT_TYPE], "application/x-ndjson");
    let read = lines(&text);
    assert_eq!(read.len(), 3, "{text}");
    assert_eq!(read[0]["response"], "a");
    assert_eq!(read[1]["response"], "b");
    assert_eq!(read[0]["done"], false);
    let last = &read[2];
    assert_eq!(last["done"], true, "{last}");
    assert_eq!(last["done_reason"], "length", "{last}");
    assert_eq!(last["response"], "", "{last}");
    assert_eq!(last["prompt_eval_count"], 8, "{last}");
    assert_eq!(last["eval_count"], 2, "{last}");
    assert_eq!(last["prompt_eval_duration"], 7_500_000, "{last}");
    assert_eq!(last["eval_duration"], 4_000_000, "{last}");

    // Not streamed: one object; an end by a stop word is "stop".
    let whole = r#"{"index":0,"content":"ab","stop":true,"tokens_predicted":2,"tokens_evaluated":8,"stop_type":"word"}"#;
    let (_, text) = translated(
        Shape::Infill,
        false,
        StatusCode::OK,
        "application/json; charset=utf-8",
        &[whole],
    )
    .await;
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["response"], "ab", "{answer}");
    assert_eq!(answer["done"], true, "{answer}");
    assert_eq!(answer["done_reason"], "stop", "{answer}");
    assert_eq!(answer["prompt_eval_count"], 8, "{answer}");
    assert_eq!(answer["eval_count"], 2, "{answer}");

    // A stream cut before its last event ends with an error line and no done.
    let (_, text) = translated(
        Shape::Infill,
        true,
        StatusCode::OK,
        "text/event-stream",
        &events[..2],
    )
    .await;
    let read = lines(&text);
    assert!(read.last().unwrap()["error"].is_string(), "{text}");
    assert!(read.iter().all(|line| line["done"] != true), "{text}");
}
