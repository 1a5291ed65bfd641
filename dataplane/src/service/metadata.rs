//! The metadata phase: reads that are never queued, answered by a host or, for the
//! listings, by the union over the hosts ([`crate::router`]), filtered by a key's allowlist.

use std::sync::Arc;

use http::{HeaderValue, Method, Response, header};

use crate::app::App;
use crate::auth::Identity;
use crate::body::{self, Body};
use crate::error::{Cause, Failures, ProxyError};
use crate::headers;
use crate::policy::{Host, HostKind, Policy};
use crate::proxy::{self, Outbound};
use crate::translate;

/// A metadata read: `/api/tags` and `/api/ps` answer the union over the
/// healthy hosts (every model a client can use, once); `/api/show` goes to
/// a host that has the model; the rest to any healthy host, failing over.
pub(super) async fn metadata(
    app: &Arc<App>,
    policy: &Arc<Policy>,
    identity: &Identity,
    outbound: Outbound,
    model: Option<&str>,
) -> Result<Response<Body>, ProxyError> {
    let mut hosts = metadata_hosts(policy, model);
    let path = outbound.path_and_query.path().to_owned();
    let listing = outbound.method == Method::GET
        && matches!(path.as_str(), "/api/tags" | "/api/ps" | "/v1/models");
    // OpenAI-compatible engines do not speak Ollama's metadata routes: oqp answers for them
    // from what it knows ([`translate`]), and asks an Ollama host first for the rest.
    let engines = hosts.iter().any(|host| host.kind == HostKind::Openai);
    if engines && !listing {
        let only_engines = hosts.iter().all(|host| host.kind == HostKind::Openai);
        let native = matches!(outbound.method, Method::GET | Method::HEAD | Method::POST);
        match path.as_str() {
            "/api/show" => {
                if let Some(shown) = model.and_then(|model| translate::show(policy, model)) {
                    return Ok(translate_metadata(shown));
                }
            }
            "/api/version" if only_engines && native => {
                return Ok(translate_metadata(translate::version()));
            }
            "/" if only_engines && native => {
                let mut response = Response::new(body::full("Ollama is running"));
                response.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; charset=utf-8"),
                );
                return Ok(response);
            }
            _ => {}
        }
        // Stable: Ollama hosts first, in their order.
        hosts.sort_by_key(|host| host.kind == HostKind::Openai);
    }
    // A key limited to some models sees only those: its listings are read whole and
    // filtered, even from one host.
    let filtered = listing && identity.has_allowlist();
    if filtered || (listing && path != "/v1/models" && (hosts.len() > 1 || engines)) {
        let mut response = union_response(app, policy, &hosts, outbound, &path).await?;
        if filtered {
            response = filter_listing(response, &path, identity).await?;
        }
        return Ok(response);
    }
    let active = app.track_active();
    let answer = proxy::send(
        &app.upstream,
        policy.proxy.request_timeout,
        &hosts,
        outbound,
        |host, _| app.metrics.host_failure(&host.name),
    )
    .await?;
    app.metrics.host_request(&answer.host.name);
    for _ in &answer.failed {
        app.metrics.failover();
    }
    Ok(proxy::respond(
        answer,
        Some(Box::new(active)),
        None,
        policy.proxy.upstream_stall_timeout,
    ))
}

/// A metadata answer oqp writes for OpenAI-compatible engines, in Ollama's content type.
pub(super) fn translate_metadata(value: serde_json::Value) -> Response<Body> {
    let mut response = Response::new(body::json(&value));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json; charset=utf-8"),
    );
    response
}

/// Asks every host at once and merges their model lists.
pub(super) async fn union_response(
    app: &Arc<App>,
    policy: &Arc<Policy>,
    hosts: &[Arc<Host>],
    outbound: Outbound,
    path: &str,
) -> Result<Response<Body>, ProxyError> {
    // The engines' entries come from what oqp knows of them ([`translate`]); `/v1/models`
    // they answer themselves.
    let ollama_listing = matches!(path, "/api/tags" | "/api/ps");
    let engines: Vec<Arc<Host>> = hosts
        .iter()
        .filter(|host| ollama_listing && host.kind == HostKind::Openai)
        .cloned()
        .collect();
    let asks = hosts
        .iter()
        .filter(|host| !(ollama_listing && host.kind == HostKind::Openai))
        .map(|host| listing_of(app, policy, host, &outbound));
    let mut answers: Vec<(Arc<str>, serde_json::Value)> = Vec::new();
    let mut failures = Failures::none();
    for outcome in futures_util::future::join_all(asks).await {
        match outcome {
            Ok(answer) => answers.push(answer),
            Err((host, cause)) => failures.push(host, cause),
        }
    }
    for host in &engines {
        let listed = translate::listing_entries(std::slice::from_ref(host), path);
        answers.push((host.name.clone(), listed));
    }
    if answers.is_empty() {
        return Err(ProxyError::AllHostsFailed(failures));
    }
    let bodies: Vec<serde_json::Value> = answers.iter().map(|(_, body)| body.clone()).collect();
    let merged = match path {
        "/api/ps" => crate::router::union_ps(&bodies),
        "/v1/models" => crate::router::union_openai_models(&bodies),
        _ => crate::router::union_tags(&bodies),
    };
    let mut response = Response::new(body::json(&merged));
    let names: Vec<&str> = answers.iter().map(|(name, _)| &**name).collect();
    let map = response.headers_mut();
    map.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json; charset=utf-8"),
    );
    if let Ok(value) = HeaderValue::from_str(&names.join(", ")) {
        map.insert(headers::FAILOVER_HOST, value);
    }
    Ok(response)
}

/// One host's listing for a union: its answer's JSON, or the host and why it gave none (it
/// is left out, and named in the 503 if no host answers).
async fn listing_of(
    app: &App,
    policy: &Policy,
    host: &Arc<Host>,
    outbound: &Outbound,
) -> Result<(Arc<str>, serde_json::Value), (Arc<str>, Cause)> {
    use http_body_util::BodyExt;
    let failed = |cause: Cause| Err((host.name.clone(), cause));
    let request = proxy::request_for(
        host,
        &outbound.method,
        &outbound.path_and_query,
        outbound.headers.clone(),
        body::empty(),
    );
    let Ok(request) = request else {
        return failed(Cause::ConnectionFailed);
    };
    let response = match app
        .upstream
        .send(request, policy.proxy.request_timeout)
        .await
    {
        Ok(response) => response,
        Err(error) => return failed(error.cause()),
    };
    if !response.status().is_success() {
        return failed(Cause::Http(response.status()));
    }
    // Bounded like any upstream body: a host that sends its head
    // and then nothing must not hold the union.
    let bytes = match tokio::time::timeout(
        policy.proxy.upstream_stall_timeout,
        response.into_body().collect(),
    )
    .await
    {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(_)) => return failed(Cause::ConnectionClosed),
        Err(_) => return failed(Cause::Timeout),
    };
    match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Ok(value) => Ok((host.name.clone(), value)),
        Err(_) => failed(Cause::InvalidAnswer),
    }
}

/// A listing (`/api/tags`, `/api/ps`, `/v1/models`) with only the models `identity` may use.
pub(super) async fn filter_listing(
    response: Response<Body>,
    path: &str,
    identity: &Identity,
) -> Result<Response<Body>, ProxyError> {
    use http_body_util::BodyExt;
    let (mut parts, body) = response.into_parts();
    let bytes = body
        .collect()
        .await
        .map_err(|_| ProxyError::hosts_failed())?
        .to_bytes();
    let mut value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|_| ProxyError::hosts_failed())?;
    let (list, field) = if path == "/v1/models" {
        ("data", "id")
    } else {
        ("models", "name")
    };
    if let Some(entries) = value
        .get_mut(list)
        .and_then(serde_json::Value::as_array_mut)
    {
        entries.retain(|entry| {
            entry
                .get(field)
                .or_else(|| entry.get("model"))
                .and_then(serde_json::Value::as_str)
                .is_some_and(|name| identity.may_use(name))
        });
    }
    parts.headers.remove(header::CONTENT_LENGTH);
    Ok(Response::from_parts(parts, body::json(&value)))
}

/// Hosts for a metadata request: the healthy ones (all when none is marked
/// healthy), those that have `model` installed first. Hosts other nodes own
/// are read too: a read takes no slot, and `/api/tags` lists every model a
/// client can use through any box.
pub(super) fn metadata_hosts(policy: &Policy, model: Option<&str>) -> Vec<Arc<Host>> {
    let every = || policy.hosts.iter().chain(&policy.remote);
    let mut hosts: Vec<Arc<Host>> = every().filter(|h| h.healthy).cloned().collect();
    if hosts.is_empty() {
        hosts = every().cloned().collect();
    }
    if let Some(model) = model {
        let model = crate::policy::normalize_model(model);
        // Stable: hosts with the model keep their order, ahead of the rest.
        hosts.sort_by_key(|host| !host.installed.contains(&model));
    }
    hosts
}
