//! The fast upstream: an Ollama that answers at once with canned bodies.
//! Plain hyper, HTTP/1.1, no state, no records, no locks: every answer is a
//! constant. The saturation rows run against it so that they measure the
//! proxies, not the upstream: it must do at least twice what the minimal
//! proxy does in front of it, and each run says whether it did.
//!
//! It answers what oqp's poller and the saturation scenarios ask for:
//! `/api/version`, `/api/tags` and `/api/ps` (one model, `llama3`, loaded),
//! `/api/show` (a completion model of the llama architecture), a
//! non-streamed `/api/generate` and `/api/chat`, and `/api/embed`. Anything
//! else is Ollama's 404.

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

const VERSION: &str = r#"{"version":"0.30.0"}"#;
const TAGS: &str = r#"{"models":[{"name":"llama3:latest","model":"llama3:latest","modified_at":"2026-01-01T00:00:00Z","size":4661224676,"digest":"365c0bd3c000a25d28ddbf732fe1c6add414de7275464c4e4d1c3b5fcb5d8ad1","details":{"format":"gguf","family":"llama","parameter_size":"8.0B","quantization_level":"Q4_0"}}]}"#;
const PS: &str = r#"{"models":[{"name":"llama3:latest","model":"llama3:latest","size":6654289920,"digest":"365c0bd3c000a25d28ddbf732fe1c6add414de7275464c4e4d1c3b5fcb5d8ad1","details":{"format":"gguf","family":"llama"},"expires_at":"2099-01-01T00:00:00Z","size_vram":6654289920}]}"#;
const SHOW: &str = r#"{"details":{"format":"gguf","family":"llama"},"model_info":{"general.architecture":"llama"},"capabilities":["completion"]}"#;
const GENERATE: &str = r#"{"model":"llama3","created_at":"2026-01-01T00:00:00Z","response":"Rayleigh scattering.","done":true,"done_reason":"stop","total_duration":1000,"load_duration":0,"prompt_eval_count":8,"prompt_eval_duration":500,"eval_count":4,"eval_duration":500}"#;
const CHAT: &str = r#"{"model":"llama3","created_at":"2026-01-01T00:00:00Z","message":{"role":"assistant","content":"Rayleigh scattering."},"done":true,"done_reason":"stop","total_duration":1000,"load_duration":0,"prompt_eval_count":8,"prompt_eval_duration":500,"eval_count":4,"eval_duration":500}"#;
const EMBED: &str = r#"{"model":"all-minilm","embeddings":[[0.1,0.2,0.3,0.4]],"total_duration":1000,"load_duration":0,"prompt_eval_count":2}"#;
const NOT_FOUND: &str = r#"{"error":"404 page not found"}"#;

/// A running fast upstream.
#[derive(Debug)]
pub struct FastUpstream {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl FastUpstream {
    /// Serves `listener` until dropped.
    pub fn spawn(listener: TcpListener) -> anyhow::Result<FastUpstream> {
        let addr = listener.local_addr()?;
        let task = tokio::spawn(serve(listener));
        Ok(FastUpstream { addr, task })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for FastUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(listener: TcpListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service_fn(answer))
                .await;
        });
    }
}

/// The canned answer for `request`, once its body is read (a client may not
/// send the next request before the body of this one is consumed).
async fn answer(request: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = request.into_parts();
    let _ = body.collect().await;
    let (status, body) = canned(&parts.method, parts.uri.path());
    let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/json; charset=utf-8"),
    );
    headers.insert(CONTENT_LENGTH, HeaderValue::from(body.len()));
    Ok(response)
}

fn canned(method: &Method, path: &str) -> (StatusCode, &'static str) {
    let body = match (method, path) {
        (&Method::GET, "/api/version") => VERSION,
        (&Method::GET, "/api/tags") => TAGS,
        (&Method::GET, "/api/ps") => PS,
        (&Method::POST, "/api/show") => SHOW,
        (&Method::POST, "/api/generate") => GENERATE,
        (&Method::POST, "/api/chat") => CHAT,
        (&Method::POST, "/api/embed") => EMBED,
        _ => return (StatusCode::NOT_FOUND, NOT_FOUND),
    };
    (StatusCode::OK, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_canned_answer_is_json() {
        let routes = [
            (Method::GET, "/api/version"),
            (Method::GET, "/api/tags"),
            (Method::GET, "/api/ps"),
            (Method::POST, "/api/show"),
            (Method::POST, "/api/generate"),
            (Method::POST, "/api/chat"),
            (Method::POST, "/api/embed"),
            (Method::GET, "/nowhere"),
        ];
        for (method, path) in routes {
            let (_, body) = canned(&method, path);
            assert!(
                serde_json::from_str::<serde_json::Value>(body).is_ok(),
                "{path}: {body}"
            );
        }
        assert_eq!(canned(&Method::GET, "/nowhere").0, StatusCode::NOT_FOUND);
    }
}
