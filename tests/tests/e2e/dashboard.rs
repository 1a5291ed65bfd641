//! The dashboard you can log into: with auth on, `/dashboard` answers 401 with the login
//! form; a key of scope read or higher is exchanged once for an `HttpOnly`, `SameSite=Strict`
//! session cookie that the page's polls carry; signing out, expiry, revocation and
//! cross-site POSTs end or refuse it; the cookie reads and nothing else; each key's usage view
//! shows what its scope allows. Then the same in headless Chromium, typing into the form.

use std::time::Duration;

use http::Method;
use oqp_dataplane::dashboard::session::SESSION_TTL;
use oqp_tests::browser::{self, Browser};
use oqp_tests::client::{HttpClient, Reply};
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::{ConfigYaml, Host, Key, Stack};
use serde_json::{Value, json};

const READ: &str = "sk-read-0123456789";
const CHAT: &str = "sk-chat-0123456789";
const BATCH: &str = "sk-batch-0123456789";
const ADMIN: &str = "sk-admin-0123456789";
const WEBUI: &str = "sk-webui-0123456789";

fn config(url: &str, refresh_seconds: u32) -> String {
    ConfigYaml::new()
        .host(Host::ollama("primary", url))
        .key(Key::new(READ, "widget").set("scope", "read"))
        .key(
            Key::new(CHAT, "chat")
                .set("models", r#"["llama3*"]"#)
                .set("budget", "{gpu_seconds: 3600, tokens: 100000, window: 1d}"),
        )
        .key(Key::new(BATCH, "batch"))
        .key(Key::new(WEBUI, "webui").set(
            "users",
            "{header: X-User, budget: {tokens: 5000, window: 1d}}",
        ))
        .key(Key::new(ADMIN, "admin").set("scope", "management"))
        .under(
            "dashboard",
            &format!("  refresh_seconds: {refresh_seconds}\n"),
        )
        .yaml()
}

const GENERATE: &str = r#"{"model":"llama3","prompt":"hi","stream":false}"#;

/// The browser-like headers of a POST from the dashboard's own page.
fn same_origin(base: &str) -> [(&'static str, String); 2] {
    [
        ("origin", base.to_owned()),
        ("sec-fetch-site", "same-origin".to_owned()),
    ]
}

async fn post(
    http: &HttpClient,
    url: &str,
    content_type: &str,
    extra: &[(&str, String)],
    body: &str,
) -> Reply {
    let mut headers: Vec<(&str, &str)> = vec![("content-type", content_type)];
    headers.extend(extra.iter().map(|(name, value)| (*name, value.as_str())));
    http.send(Method::POST, url, &headers, body.to_owned())
        .await
}

/// Signs in with `key` through the form, as a browser would; the cookie (`name=value`).
async fn sign_in(http: &HttpClient, base: &str, key: &str) -> String {
    let reply = post(
        http,
        &format!("{base}/dashboard/login"),
        "application/x-www-form-urlencoded",
        &same_origin(base),
        &format!("key={key}"),
    )
    .await;
    assert_eq!(reply.status, 303, "{}", reply.text());
    cookie_of(&reply)
}

/// The `name=value` part of a reply's `Set-Cookie`.
fn cookie_of(reply: &Reply) -> String {
    let set = reply.header("set-cookie").expect("a Set-Cookie");
    set.split(';').next().unwrap().to_owned()
}

async fn get_with_cookie(http: &HttpClient, url: &str, cookie: &str) -> Reply {
    http.get(url, &[("cookie", cookie)]).await
}

fn assert_login_form(reply: &Reply) {
    assert_eq!(reply.status, 401);
    assert_eq!(
        reply.header("content-type").as_deref(),
        Some("text/html; charset=utf-8")
    );
    assert_eq!(reply.header("www-authenticate").as_deref(), Some("Bearer"));
    let csp = reply.header("content-security-policy").unwrap();
    assert!(csp.contains("form-action 'self'"), "{csp}");
    let page = reply.text();
    assert!(page.contains("id=\"login-form\""), "{page}");
    assert!(page.contains("type=\"password\""));
}

#[tokio::test]
async fn a_key_is_exchanged_once_for_a_strict_session_cookie() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), 5)).await;
    let app = stack.control.dataplane().unwrap().app().clone();
    let http = HttpClient::new();
    let base = stack.url();
    let dashboard = format!("{base}/dashboard");

    // No key, no session: 401, and its body is the login form (the dashboard is on by
    // default: the proxy listens on loopback).
    assert_login_form(&http.get(&dashboard, &[]).await);

    // The form's key for a cookie: HttpOnly, SameSite=Strict, an expiry, no Secure on plain
    // HTTP; back to the dashboard with a 303 (a reload does not post the key again).
    let reply = post(
        &http,
        &format!("{base}/dashboard/login"),
        "application/x-www-form-urlencoded",
        &same_origin(&base),
        &format!("key={READ}"),
    )
    .await;
    assert_eq!(reply.status, 303);
    assert_eq!(reply.header("location").as_deref(), Some("../dashboard"));
    let set = reply.header("set-cookie").unwrap();
    let attributes: Vec<&str> = set.split("; ").collect();
    assert!(attributes[0].starts_with("oqp_session="), "{set}");
    assert_eq!(attributes[0].len(), "oqp_session=".len() + 43, "256 bits");
    assert_eq!(
        &attributes[1..],
        [
            "Path=/",
            &format!("Max-Age={}", SESSION_TTL.as_secs()),
            "HttpOnly",
            "SameSite=Strict"
        ]
    );
    assert!(!set.contains(READ) && !reply.text().contains(READ));
    let cookie = cookie_of(&reply);

    // The cookie opens the page and its polls.
    let page = get_with_cookie(&http, &dashboard, &cookie).await;
    assert_eq!(page.status, 200);
    assert!(page.text().contains("var REFRESH_MS = 5000;"));
    for path in [
        "/queue/summary",
        "/queue/status",
        "/dashboard/usage",
        "/metrics",
    ] {
        let reply = get_with_cookie(&http, &format!("{base}{path}"), &cookie).await;
        assert_eq!(reply.status, 200, "{path}");
    }
    // It reads, nothing else: no inference, no queue control (the key is read-scoped, but a
    // management key's session gets no more: checked below).
    let generate = http
        .send(
            Method::POST,
            &format!("{base}/api/generate"),
            &[("cookie", &cookie), ("content-type", "application/json")],
            GENERATE,
        )
        .await;
    assert_eq!(generate.status, 401);
    let admin_cookie = sign_in(&http, &base, ADMIN).await;
    let pause = http
        .send(
            Method::POST,
            &format!("{base}/queue/pause"),
            &[("cookie", &admin_cookie)],
            "",
        )
        .await;
    assert_eq!(pause.status, 401, "a session never controls the queue");
    assert!(fake.handle().requests_to("/api/generate").is_empty());

    // A Bearer key keeps working for scripts, without any cookie.
    let scripted = http
        .get(&dashboard, &[("authorization", &format!("Bearer {READ}"))])
        .await;
    assert_eq!(scripted.status, 200);
    assert!(scripted.header("set-cookie").is_none());

    // Behind a TLS reverse proxy the cookie is Secure too.
    let proxied = post(
        &http,
        &format!("{base}/dashboard/login"),
        "application/x-www-form-urlencoded",
        &[("x-forwarded-proto", "https".to_owned())],
        &format!("key={READ}"),
    )
    .await;
    assert!(
        proxied.header("set-cookie").unwrap().ends_with("; Secure"),
        "{:?}",
        proxied.header("set-cookie")
    );

    // JSON for scripts that want a session: the same cookie, the expiry in the body.
    let reply = http
        .post_json(
            &format!("{base}/dashboard/login"),
            &[],
            &json!({"key": READ}),
        )
        .await;
    assert_eq!(reply.status, 200);
    let body = reply.json();
    assert_eq!(body["client_id"], "widget");
    assert_eq!(body["scope"], "read");
    assert!(body["expires_at"].as_str().unwrap().ends_with('Z'));
    assert!(reply.header("set-cookie").unwrap().contains("HttpOnly"));

    // A wrong key: the form again, saying so, and no cookie; JSON gets JSON.
    let wrong = post(
        &http,
        &format!("{base}/dashboard/login"),
        "application/x-www-form-urlencoded",
        &same_origin(&base),
        "key=sk-wrong-0123456789",
    )
    .await;
    assert_login_form(&wrong);
    assert!(wrong.text().contains("That key was not accepted."));
    assert!(!wrong.text().contains("sk-wrong"), "the key is not echoed");
    assert!(wrong.header("set-cookie").is_none());
    let wrong = http
        .post_json(
            &format!("{base}/dashboard/login"),
            &[],
            &json!({"key": "sk-wrong-0123456789"}),
        )
        .await;
    assert_eq!(wrong.status, 401);
    assert!(wrong.json()["error"].is_string());

    // Signing out ends the session on the server and removes the cookie.
    let out = post(
        &http,
        &format!("{base}/dashboard/logout"),
        "application/x-www-form-urlencoded",
        &[
            ("cookie", cookie.clone()),
            ("origin", base.clone()),
            ("sec-fetch-site", "same-origin".to_owned()),
        ],
        "",
    )
    .await;
    assert_eq!(out.status, 303);
    let cleared = out.header("set-cookie").unwrap();
    assert!(cleared.starts_with("oqp_session=; ") && cleared.contains("Max-Age=0"));
    assert_login_form(&get_with_cookie(&http, &dashboard, &cookie).await);
    let summary = get_with_cookie(&http, &format!("{base}/queue/summary"), &cookie).await;
    assert_eq!(summary.status, 401);

    // Expiry: a session past its end is gone.
    let cookie = sign_in(&http, &base, READ).await;
    assert_eq!(
        get_with_cookie(&http, &dashboard, &cookie).await.status,
        200
    );
    app.sessions.age(SESSION_TTL);
    assert_login_form(&get_with_cookie(&http, &dashboard, &cookie).await);

    // Revocation: a session is only as good as its key in the current snapshot.
    let cookie = sign_in(&http, &base, READ).await;
    assert_eq!(
        get_with_cookie(&http, &dashboard, &cookie).await.status,
        200
    );
    let without_reader = config(&fake.url(), 5).replace(
        &format!("    - key: \"{READ}\"\n      client_id: widget\n      scope: read\n"),
        "",
    );
    let version = stack.rewrite_and_reload(&without_reader).unwrap();
    stack.wait_for_version(version).await;
    assert_login_form(&get_with_cookie(&http, &dashboard, &cookie).await);

    // None of these failures counted against the address: signing in still works.
    let cookie = sign_in(&http, &base, CHAT).await;
    assert_eq!(
        get_with_cookie(&http, &dashboard, &cookie).await.status,
        200
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn cross_site_posts_are_refused() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), 5)).await;
    let app = stack.control.dataplane().unwrap().app().clone();
    let http = HttpClient::new();
    let base = stack.url();
    let login = format!("{base}/dashboard/login");
    let form = "application/x-www-form-urlencoded";
    let body = format!("key={READ}");

    // Another site cannot sign a visitor in (under its own key, say).
    for headers in [
        vec![("origin", "http://evil.example".to_owned())],
        vec![("origin", "null".to_owned())],
        vec![("sec-fetch-site", "cross-site".to_owned())],
        vec![
            ("origin", base.clone()),
            ("sec-fetch-site", "same-site".to_owned()),
        ],
    ] {
        let reply = post(&http, &login, form, &headers, &body).await;
        assert_eq!(reply.status, 403, "{headers:?}");
        assert!(reply.header("set-cookie").is_none());
    }
    // Only forms and JSON are read.
    let plain = post(&http, &login, "text/plain", &same_origin(&base), &body).await;
    assert_eq!(plain.status, 415);
    assert!(app.sessions.is_empty(), "no session was opened");

    // Nor sign them out.
    let cookie = sign_in(&http, &base, READ).await;
    let reply = post(
        &http,
        &format!("{base}/dashboard/logout"),
        form,
        &[
            ("cookie", cookie.clone()),
            ("origin", "http://evil.example".to_owned()),
        ],
        "",
    )
    .await;
    assert_eq!(reply.status, 403);
    let page = get_with_cookie(&http, &format!("{base}/dashboard"), &cookie).await;
    assert_eq!(page.status, 200, "the session is still open");

    // A login body is small.
    let huge = format!("key={}", "a".repeat(10_000));
    let reply = post(&http, &login, form, &same_origin(&base), &huge).await;
    assert_eq!(reply.status, 413);
    stack.shutdown().await;
}

/// The usage view of whoever holds `cookie`, once `check` holds (usage is recorded when a
/// response ends).
async fn usage_until(
    http: &HttpClient,
    base: &str,
    cookie: &str,
    check: impl Fn(&Value) -> bool,
) -> Value {
    let url = format!("{base}/dashboard/usage");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let view = get_with_cookie(http, &url, cookie).await.json();
        if check(&view) {
            return view;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "usage view never matched: {view}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn row<'a>(view: &'a Value, client: &str) -> Option<&'a Value> {
    view["clients"]
        .as_array()
        .unwrap()
        .iter()
        .find(|row| row["client_id"] == client)
}

#[tokio::test]
async fn each_key_sees_the_usage_its_scope_allows() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), 5)).await;
    let http = HttpClient::new();
    let base = stack.url();
    for (key, user) in [(CHAT, None), (BATCH, None), (WEBUI, Some("alice"))] {
        let authorization = format!("Bearer {key}");
        let mut headers = vec![
            ("authorization", authorization.as_str()),
            ("content-type", "application/json"),
        ];
        if let Some(user) = user {
            headers.push(("x-user", user));
        }
        let reply = http
            .send(
                Method::POST,
                &format!("{base}/api/generate"),
                &headers,
                GENERATE,
            )
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }

    // Management: everyone, with budgets, allowlists and an app's users.
    let admin = sign_in(&http, &base, ADMIN).await;
    let view = usage_until(&http, &base, &admin, |view| {
        ["chat", "batch"]
            .iter()
            .all(|id| row(view, id).is_some_and(|r| r["requests"] == 1))
            && row(view, "webui").is_some_and(|r| r["users"][0]["requests"] == 1)
    })
    .await;
    assert_eq!(view["everyone"], true);
    assert_eq!(view["day"].as_str().unwrap().len(), 10);
    for id in ["widget", "chat", "batch", "webui", "admin"] {
        assert!(row(&view, id).is_some(), "{id} listed: {view}");
    }
    let chat = row(&view, "chat").unwrap();
    assert_eq!(chat["models"], json!(["llama3*"]));
    let budget = &chat["budget"];
    assert_eq!(budget["window"], "1d");
    assert_eq!(budget["gpu_seconds_limit"], 3600.0);
    assert_eq!(budget["tokens_limit"], 100000);
    assert_eq!(budget["tokens_used"], chat["tokens"]);
    assert!(chat["tokens"].as_u64().unwrap() > 0);
    assert!(chat["gpu_seconds"].is_f64(), "GPU seconds: {chat}");
    let batch = row(&view, "batch").unwrap();
    assert!(batch["models"].is_null() && batch["budget"].is_null());
    let alice = &row(&view, "webui").unwrap()["users"][0];
    assert_eq!(alice["user"], "alice");
    assert_eq!(alice["budget"]["tokens_limit"], 5000);
    assert_eq!(alice["budget"]["tokens_used"], alice["tokens"]);

    // A key below management: its own row only (an app's with its users).
    let chat_session = sign_in(&http, &base, CHAT).await;
    let own = usage_until(&http, &base, &chat_session, |_| true).await;
    assert_eq!(own["everyone"], false);
    let ids: Vec<&str> = own["clients"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| row["client_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["chat"]);
    assert_eq!(row(&own, "chat").unwrap()["budget"], *budget);
    let webui = sign_in(&http, &base, WEBUI).await;
    let own = usage_until(&http, &base, &webui, |_| true).await;
    assert_eq!(own["clients"].as_array().unwrap().len(), 1);
    assert_eq!(own["clients"][0]["users"][0]["user"], "alice");
    // The same for a Bearer key: scripts see what the page shows.
    let scripted = http
        .get(
            &format!("{base}/dashboard/usage"),
            &[("authorization", &format!("Bearer {READ}"))],
        )
        .await
        .json();
    assert_eq!(scripted["clients"][0]["client_id"], "widget");
    assert_eq!(scripted["clients"].as_array().unwrap().len(), 1);
    stack.shutdown().await;
}

#[tokio::test]
async fn off_the_loopback_listener_the_dashboard_is_off_unless_asked_for() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let yaml = format!(
        "proxy:\n  host: 0.0.0.0\n{}",
        config(&fake.url(), 5).replace("dashboard:\n  refresh_seconds: 5\n", "")
    );
    let stack = Stack::start(&yaml).await;
    let http = HttpClient::new();
    let base = stack.url();
    for (method, path) in [
        (Method::GET, "/dashboard"),
        (Method::GET, "/dashboard/usage"),
        (Method::POST, "/dashboard/login"),
        (Method::POST, "/dashboard/logout"),
    ] {
        let reply = http
            .send(
                method.clone(),
                &format!("{base}{path}"),
                &[("authorization", &format!("Bearer {READ}"))],
                "",
            )
            .await;
        assert_eq!(reply.status, 404, "{method} {path}");
    }
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signing_in_and_out_in_headless_chromium() {
    let _exclusive = crate::support::exclusive().await;
    let Some(binary) = browser::find() else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "chromium is required in CI (scripts/setup.sh installs it)"
        );
        eprintln!("SKIPPED: chromium is not installed; run scripts/setup.sh");
        return;
    };
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), 1)).await;
    let app = stack.control.dataplane().unwrap().app().clone();
    let http = HttpClient::new();
    let base = stack.url();
    let reply = http
        .send(
            Method::POST,
            &format!("{base}/api/generate"),
            &[
                ("authorization", &format!("Bearer {CHAT}")),
                ("content-type", "application/json"),
            ],
            GENERATE,
        )
        .await;
    assert_eq!(reply.status, 200);

    let browser = Browser::launch(&binary).await.unwrap();
    let mut page = browser.page().await.unwrap();
    page.call("Page.enable", json!({})).await.unwrap();
    page.navigate(&format!("{base}/dashboard")).await.unwrap();
    let limit = Duration::from_secs(20);
    let login_form = "document.getElementById('login-form') !== null";
    page.wait_for(login_form, limit).await.unwrap();

    // Sign in by typing the key and submitting the form.
    let submit = format!(
        "document.getElementById('key').value = '{ADMIN}';\
         document.getElementById('login-form').requestSubmit(); true"
    );
    page.evaluate(&submit).await.unwrap();
    // The tiles fill from the polls, which the session cookie authenticates.
    let tiles = "document.getElementById('tile-processed') !== null && \
                 document.getElementById('tile-processed').textContent === '1'";
    page.wait_for(tiles, limit).await.unwrap();
    page.wait_for(
        "document.getElementById('usage').textContent.indexOf('chat') >= 0",
        limit,
    )
    .await
    .unwrap();
    assert_eq!(
        page.evaluate("location.pathname").await.unwrap(),
        "/dashboard"
    );
    assert_eq!(
        page.evaluate("document.getElementById('logout').hidden")
            .await
            .unwrap(),
        false
    );
    assert_eq!(app.sessions.len(), 1);
    // The key is nowhere the page can reach: not in the DOM, not in a cookie it can read,
    // not in storage.
    let kept = format!(
        "document.documentElement.outerHTML.indexOf('{ADMIN}') >= 0 || \
         document.cookie !== '' || localStorage.length > 0 || sessionStorage.length > 0"
    );
    assert_eq!(page.evaluate(&kept).await.unwrap(), false);
    // The browser's own record of the cookie: HttpOnly, SameSite=Strict, with an expiry.
    let cookies = page.call("Storage.getCookies", json!({})).await.unwrap();
    let cookie = &cookies["cookies"][0];
    assert_eq!(cookie["name"], "oqp_session", "{cookies}");
    assert_eq!(cookie["httpOnly"], true);
    assert_eq!(cookie["sameSite"], "Strict");
    assert_eq!(cookie["session"], false, "it has an expiry");

    // Sign out: the session ends on the server and the page shows the form.
    page.evaluate("document.getElementById('logout').click(); true")
        .await
        .unwrap();
    page.wait_for(login_form, limit).await.unwrap();
    assert!(app.sessions.is_empty());

    // An expired session: the next poll is refused and the page turns into the form.
    page.evaluate(&submit).await.unwrap();
    page.wait_for(tiles, limit).await.unwrap();
    app.sessions.age(SESSION_TTL);
    page.wait_for(login_form, limit).await.unwrap();
    stack.shutdown().await;
}
