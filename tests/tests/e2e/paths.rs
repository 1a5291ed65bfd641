//! End to end: the path a request names is the path it is judged by. Paths
//! that the upstream would decode or normalise into another route are
//! refused before anything reaches Ollama, and with model management off
//! only the allowlisted inference and metadata routes are proxied.

use http::Method;
use oqp_tests::client::HttpClient;
use oqp_tests::fake::{FakeHandle, FakeOllama};
use oqp_tests::harness::{Stack, basic_config};

use crate::support::raw_exchange;

/// What the fake received, less the host poller's reads.
fn proxied(fake: &FakeHandle) -> Vec<String> {
    fake.requests()
        .into_iter()
        .filter(|request| {
            !(request.method == Method::GET
                && matches!(
                    request.path.as_str(),
                    "/api/tags" | "/api/ps" | "/api/version"
                ))
        })
        // The control plane's own calls (its polls and `/api/show` of each model) say who
        // they are.
        .filter(|request| {
            !request
                .header("user-agent")
                .is_some_and(|agent| agent.starts_with("oqp/"))
        })
        .map(|request| format!("{} {}", request.method, request.path))
        .collect()
}

fn raw(method: &str, path: &str, body: &str) -> Vec<u8> {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Encoded, doubled and dotted spellings of model-management routes.
const DISGUISED: [(&str, &str); 9] = [
    ("POST", "/api/%70ull"),
    ("DELETE", "/api%2Fdelete"),
    ("DELETE", "/api%2fdelete"),
    ("POST", "/api/%63reate"),
    ("POST", "/api//pull"),
    ("POST", "//api/pull"),
    ("POST", "/api/./push"),
    ("POST", "/api/tags/../copy"),
    ("POST", "/api/blobs%2Fsha256:ab"),
];

#[tokio::test]
async fn encoded_and_dotted_paths_are_refused_before_ollama() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    for management in [false, true] {
        let mut yaml = basic_config(&fake.url());
        if management {
            yaml = yaml.replace("proxy:\n", "proxy:\n  allow_model_management: true\n");
        }
        let stack = Stack::start(&yaml).await;
        for (method, path) in DISGUISED {
            let request = raw(method, path, r#"{"model":"llama3","stream":false}"#);
            let status = raw_exchange(stack.proxy_addr(), &request).await;
            assert_eq!(
                status,
                Some(400),
                "{method} {path} (management {management})"
            );
        }
        // Also under an inference route: nothing routes a path oqp did not classify.
        let status = raw_exchange(stack.proxy_addr(), &raw("POST", "/api/%67enerate", "{}")).await;
        assert_eq!(status, Some(400));
        let reply = HttpClient::new()
            .send(
                Method::POST,
                &format!("{}/api/%70ull", stack.url()),
                &[],
                "{}",
            )
            .await;
        assert_eq!(reply.status, 400);
        assert_eq!(
            reply.json()["error"],
            "request path must not contain percent escapes, empty segments or dot segments"
        );
        assert!(reply.json()["request_id"].is_string());
        assert_eq!(proxied(&fake.handle()), Vec::<String>::new());
        stack.shutdown().await;
    }
}

#[tokio::test]
async fn with_management_off_only_the_allowlist_is_proxied() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&basic_config(&fake.url())).await;
    let http = HttpClient::new();
    let management = "model management endpoints are disabled; set allow_model_management: true in config to enable";
    let unlisted = "this route is not proxied while model management is disabled (only inference and metadata routes are); set allow_model_management: true in config to enable";
    for (method, path, message) in [
        (Method::POST, "/api/blobs/sha256:ab", management),
        (Method::HEAD, "/api/blobs/sha256:ab", management),
        (Method::POST, "/api/signout", management),
        (Method::POST, "/api/me", management),
        (Method::DELETE, "/api/user/keys/abc", management),
        (Method::POST, "/api/pull", management),
        (Method::POST, "/api/some-future-route", unlisted),
        (Method::POST, "/api/experimental/web_fetch", unlisted),
        (Method::DELETE, "/v1/models/llama3", unlisted),
        (Method::GET, "/no/such/path", unlisted),
    ] {
        let reply = http
            .send(method.clone(), &format!("{}{path}", stack.url()), &[], "{}")
            .await;
        assert_eq!(reply.status, 403, "{method} {path}");
        if method != Method::HEAD {
            assert_eq!(reply.json()["error"], message, "{method} {path}");
        }
    }
    assert_eq!(proxied(&fake.handle()), Vec::<String>::new());

    // The routes real clients use still go through.
    for (method, path, body) in [
        (
            Method::POST,
            "/api/generate",
            r#"{"model":"llama3","prompt":"hi","stream":false}"#,
        ),
        (Method::GET, "/v1/models", ""),
        (Method::GET, "/v1/models/llama3", ""),
        (Method::GET, "/api/status", ""),
        (Method::HEAD, "/", ""),
    ] {
        let reply = http
            .send(
                method.clone(),
                &format!("{}{path}", stack.url()),
                &[],
                body.to_owned(),
            )
            .await;
        assert_ne!(reply.status, 403, "{method} {path}");
        assert_ne!(reply.status, 400, "{method} {path}");
    }
    stack.shutdown().await;
}

#[tokio::test]
async fn with_management_on_blob_uploads_reach_ollama() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let yaml =
        basic_config(&fake.url()).replace("proxy:\n", "proxy:\n  allow_model_management: true\n");
    let stack = Stack::start(&yaml).await;
    let digest = "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824";
    let reply = HttpClient::new()
        .send(
            Method::POST,
            &format!("{}/api/blobs/{digest}", stack.url()),
            &[],
            "hello",
        )
        .await;
    assert_eq!(reply.status, 201);
    assert_eq!(
        proxied(&fake.handle()),
        vec![format!("POST /api/blobs/{digest}")]
    );
    stack.shutdown().await;
}
