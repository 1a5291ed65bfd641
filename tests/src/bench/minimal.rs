//! The floor: the least a reverse proxy can do. Plain hyper, HTTP/1.1 on
//! both sides, one pooled client to one upstream, bodies streamed through in
//! both directions, no parsing, no policy, no queue. oqp's figures are read
//! against this one, so that the cost of proxying at all (one more hop, one
//! more process) is not charged to oqp.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::{Request, Response, StatusCode, Uri};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

type ProxyBody = BoxBody<Bytes, hyper::Error>;

/// A running minimal proxy.
#[derive(Debug)]
pub struct MinimalProxy {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl MinimalProxy {
    /// Serves `listener`, forwarding every request to `upstream`
    /// (`http://host:port`).
    pub fn spawn(listener: TcpListener, upstream: &str) -> anyhow::Result<MinimalProxy> {
        let addr = listener.local_addr()?;
        let task = tokio::spawn(serve(listener, upstream.parse()?));
        Ok(MinimalProxy { addr, task })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MinimalProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Forwards every request on `listener` to `upstream` until the task is
/// dropped.
pub async fn serve(listener: TcpListener, upstream: Uri) {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Incoming> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(connector);
    let target = Arc::new((
        upstream.scheme().cloned().unwrap_or(Scheme::HTTP),
        upstream
            .authority()
            .cloned()
            .unwrap_or_else(|| Authority::from_static("127.0.0.1:11434")),
    ));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let client = client.clone();
        let target = target.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let client = client.clone();
                let target = target.clone();
                async move { Ok::<_, Infallible>(forward(&client, &target, request).await) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn forward(
    client: &Client<HttpConnector, Incoming>,
    target: &(Scheme, Authority),
    request: Request<Incoming>,
) -> Response<ProxyBody> {
    let (mut parts, body) = request.into_parts();
    let mut uri = parts.uri.into_parts();
    uri.scheme = Some(target.0.clone());
    uri.authority = Some(target.1.clone());
    parts.uri = match Uri::from_parts(uri) {
        Ok(uri) => uri,
        Err(_) => return bad_gateway(),
    };
    match client.request(Request::from_parts(parts, body)).await {
        Ok(response) => response.map(BodyExt::boxed),
        Err(_) => bad_gateway(),
    }
}

fn bad_gateway() -> Response<ProxyBody> {
    let mut response = Response::new(
        Full::new(Bytes::from_static(b"{\"error\":\"bad gateway\"}"))
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = StatusCode::BAD_GATEWAY;
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::HttpClient;
    use crate::fake::FakeOllama;

    #[tokio::test]
    async fn forwards_requests_and_streams_answers() {
        let fake = FakeOllama::builder().model("llama3").spawn().await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = MinimalProxy::spawn(listener, &fake.url()).unwrap();
        let http = HttpClient::new();
        let url = format!("http://{}", proxy.addr());
        let tags = http.get(&format!("{url}/api/tags"), &[]).await;
        assert_eq!(tags.status, 200);
        assert_eq!(tags.json()["models"][0]["name"], "llama3:latest");
        let (status, _, lines) = http
            .post_lines(
                &format!("{url}/api/generate"),
                &[],
                &serde_json::json!({"model": "llama3", "prompt": "hi"}),
            )
            .await;
        assert_eq!(status, 200);
        assert_eq!(lines.len(), 6, "five tokens and the final object");
    }
}
