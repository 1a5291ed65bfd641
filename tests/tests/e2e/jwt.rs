//! End to end: verified end users from a signed token (`jwt:`), through the real planes with
//! a loopback JWKS server and tokens signed in the test. A token is the credential of
//! `auth.keys[].jwt` (each user the sub-client `<client_id>/<sub>`) or names the user of an app
//! key (`users.jwt`); a token that fails a check is 401 in the route's shape, with the check
//! named; keys the issuer rotates are picked up from the first token that names the new one;
//! an issuer that is down at start refuses tokens with the reason until it answers.

use std::time::{Duration, Instant};

use oqp_tests::client::{HttpClient, Reply, wait_until};
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::Stack;
use oqp_tests::jwt::{JwksServer, SigningKey, hs256, key_set, now, unsigned};
use serde_json::{Value, json};

const ISSUER: &str = "https://login.example.com/realms/main";
const AUDIENCE: &str = "oqp";
const APP: &str = "sk-app-0123456789abcdef";
const ADMIN: &str = "sk-admin-0123456789abcdef";
const MODEL: &str = "llama3.2:3b";

/// Long enough to never decide a test by itself.
const PATIENCE: Duration = Duration::from_secs(20);

/// A config whose `people` key takes tokens from `jwks_url` and whose `app` key names its
/// users with a token in `X-User-Token`.
fn config(fake: &str, jwks_url: &str, allowed: &str) -> String {
    format!(
        r#"proxy:
  max_concurrent: 4
ollama:
  hosts:
    - url: "{fake}"
      name: gpu
      max_concurrent: 4
auth:
  enabled: true
  keys:
    - client_id: admin
      key: "{ADMIN}"
      scope: management
    - client_id: people
      jwt:
        issuer: "{ISSUER}"
        audiences: ["{AUDIENCE}", other]
        jwks_url: "{jwks_url}"
        algorithms: [ES256, EdDSA, RS256]
        refresh_min_interval: 1s
{allowed}      users:
        max_concurrent: 1
    - client_id: app
      key: "{APP}"
      users:
        jwt:
          issuer: "{ISSUER}"
          audiences: ["{AUDIENCE}"]
          jwks_url: "{jwks_url}"
          header: X-User-Token
          refresh_min_interval: 1s
{allowed_users}"#,
        allowed_users = allowed.replace("        ", "          "),
    )
}

/// `allowed_hosts` for the loopback JWKS server (exempt from the SSRF check on purpose).
const LOOPBACK: &str = "        allowed_hosts: [\"127.0.0.1\"]\n";

fn claims(sub: &str) -> Value {
    json!({ "iss": ISSUER, "aud": AUDIENCE, "sub": sub, "exp": now() + 600, "iat": now() })
}

fn chat() -> Value {
    json!({"model": MODEL, "stream": false, "messages": [{"role": "user", "content": "hi"}]})
}

async fn chat_with(stack: &Stack, path: &str, headers: &[(&str, &str)]) -> Reply {
    HttpClient::new()
        .post_json(&format!("{}{path}", stack.url()), headers, &chat())
        .await
}

async fn chat_as(stack: &Stack, token: &str) -> Reply {
    let auth = format!("Bearer {token}");
    chat_with(stack, "/api/chat", &[("authorization", &auth)]).await
}

/// The client ids the fake saw, in order.
fn seen(fake: &FakeOllama) -> Vec<String> {
    fake.handle()
        .requests_to("/api/chat")
        .iter()
        .filter_map(|request| request.header("x-client-id"))
        .collect()
}

/// Sends `token` until it is accepted, or [`PATIENCE`] ends; the last reply.
async fn until_accepted(stack: &Stack, token: &str) -> Reply {
    let reply = wait_until(PATIENCE, || async {
        let reply = chat_as(stack, token).await;
        if reply.status == 200 {
            Ok(reply)
        } else {
            Err(reply)
        }
    })
    .await;
    reply.unwrap_or_else(|reply| reply)
}

async fn stack_with(keys: &str, allowed: &str) -> (FakeOllama, JwksServer, Stack) {
    let fake = FakeOllama::builder().model(MODEL).spawn().await;
    let jwks = JwksServer::start(keys).await;
    let stack = Stack::start(&config(&fake.url(), &jwks.url(), allowed)).await;
    (fake, jwks, stack)
}

/// `client`'s issuer as `/queue/status` shows it.
async fn jwt_status(stack: &Stack, client: &str) -> Value {
    let auth = format!("Bearer {ADMIN}");
    let reply = HttpClient::new()
        .get(
            &format!("{}/queue/status", stack.url()),
            &[("authorization", &auth)],
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()["clients"][client]["jwt"].clone()
}

fn error_text(reply: &Reply) -> String {
    reply.json()["error"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test]
async fn a_token_is_the_credential_and_its_subject_the_user() {
    let es = SigningKey::es256("es-1");
    let ed = SigningKey::ed25519("ed-1");
    let (fake, _jwks, stack) = stack_with(&key_set(&[&es, &ed]), LOOPBACK).await;

    let reply = until_accepted(&stack, &es.sign(&claims("alice"))).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    // EdDSA too, and a token for the second audience.
    let mut bob = claims("bob");
    bob["aud"] = json!(["someone-else", "other"]);
    let reply = chat_as(&stack, &ed.sign(&bob)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(seen(&fake), ["people/alice", "people/bob"]);

    // The app's key with a user token beside it: the token's subject is the app's user.
    let token = es.sign(&claims("carol"));
    let auth = format!("Bearer {APP}");
    let reply = chat_with(
        &stack,
        "/api/chat",
        &[("authorization", &auth), ("x-user-token", &token)],
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    // Without one, the app itself; with a bad one, refused.
    let reply = chat_with(&stack, "/api/chat", &[("authorization", &auth)]).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let mut stranger = claims("dave");
    stranger["aud"] = json!("another-app");
    let reply = chat_with(
        &stack,
        "/api/chat",
        &[
            ("authorization", &auth),
            ("x-user-token", &es.sign(&stranger)),
        ],
    )
    .await;
    assert_eq!(reply.status, 401, "{}", reply.text());
    assert!(error_text(&reply).contains("audience"), "{}", reply.text());
    assert_eq!(
        seen(&fake),
        ["people/alice", "people/bob", "app/carol", "app"],
        "the user token never reaches Ollama, and a refused one sends nothing"
    );
    let upstream = fake.handle().requests_to("/api/chat");
    assert!(
        upstream
            .iter()
            .all(|request| request.header("x-user-token").is_none()
                && request.header("authorization").is_none())
    );
}

#[tokio::test]
async fn a_token_that_fails_a_check_is_refused_in_the_routes_shape() {
    let key = SigningKey::es256("es-1");
    let impostor = SigningKey::es256("es-1");
    let (fake, _jwks, stack) = stack_with(&key_set(&[&key]), LOOPBACK).await;
    assert_eq!(
        until_accepted(&stack, &key.sign(&claims("alice")))
            .await
            .status,
        200
    );

    let with = |change: &dyn Fn(&mut Value)| {
        let mut claims = claims("mallory");
        change(&mut claims);
        claims
    };
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "wrong audience",
            key.sign(&with(&|c| c["aud"] = json!("another-app"))),
            "audience",
        ),
        (
            "wrong issuer",
            key.sign(&with(&|c| c["iss"] = json!("https://evil.example.com"))),
            "issuer",
        ),
        (
            "expired beyond the leeway",
            key.sign(&with(&|c| c["exp"] = json!(now() - 120))),
            "expired",
        ),
        (
            "not valid yet",
            key.sign(&with(&|c| c["nbf"] = json!(now() + 600))),
            "not valid yet",
        ),
        (
            "no exp",
            key.sign(&with(&|c| {
                c.as_object_mut().unwrap().remove("exp");
            })),
            "no exp claim",
        ),
        (
            "signed by another key under the same kid",
            impostor.sign(&claims("mallory")),
            "signature",
        ),
        ("alg none", unsigned(&claims("mallory")), "malformed"),
        (
            "HS256 with the public key as secret",
            hs256(
                &claims("mallory"),
                "es-1",
                key.jwk["x"].as_str().unwrap().as_bytes(),
            ),
            "not accepted",
        ),
        (
            "a user claim that is not a user id",
            key.sign(&with(&|c| c["sub"] = json!("a/b"))),
            "sub",
        ),
    ];
    for (case, token, reason) in &cases {
        let reply = chat_as(&stack, token).await;
        assert_eq!(reply.status, 401, "{case}: {}", reply.text());
        assert!(
            error_text(&reply).contains(reason),
            "{case}: {}",
            reply.text()
        );
        assert_eq!(
            reply.header("www-authenticate").as_deref(),
            Some("Bearer error=\"invalid_token\""),
            "{case}"
        );
    }
    // The Anthropic route answers in Anthropic's shape, the Responses route in OpenAI's.
    let expired = format!("Bearer {}", cases[2].1);
    let reply = chat_with(&stack, "/v1/messages", &[("authorization", &expired)]).await;
    assert_eq!(reply.status, 401);
    assert_eq!(reply.json()["type"], "error");
    assert_eq!(reply.json()["error"]["type"], "authentication_error");
    assert!(
        reply.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("expired")
    );
    let reply = chat_with(&stack, "/v1/responses", &[("authorization", &expired)]).await;
    assert_eq!(reply.status, 401);
    assert_eq!(reply.json()["error"]["code"], "invalid_token");
    // Nothing refused reached Ollama.
    assert_eq!(seen(&fake), ["people/alice"]);
}

#[tokio::test]
async fn an_rs256_token_is_verified_and_a_tampered_signature_is_not() {
    let key = SigningKey::rs256("rsa-1");
    let (fake, _jwks, stack) = stack_with(&key_set(&[&key]), LOOPBACK).await;
    // The token is the credential (`people`, which lists RS256) and names an app's user.
    let reply = until_accepted(&stack, &key.sign(&claims("carol"))).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let app = format!("Bearer {APP}");
    let token = key.sign(&claims("dave"));
    let reply = chat_with(
        &stack,
        "/api/chat",
        &[("authorization", &app), ("X-User-Token", &token)],
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());

    // The same token with one character of its signature changed (not the last, whose low
    // bits are padding): refused.
    let mut forged = key.sign(&claims("mallory")).into_bytes();
    let at = forged.len() - 10;
    forged[at] = if forged[at] == b'A' { b'B' } else { b'A' };
    let reply = chat_as(&stack, &String::from_utf8(forged).unwrap()).await;
    assert_eq!(reply.status, 401, "{}", reply.text());
    assert!(error_text(&reply).contains("signature"), "{}", reply.text());
    assert_eq!(seen(&fake), ["people/carol", "app/dave"]);
}

#[tokio::test]
async fn a_group_claim_selects_the_users_ceiling_models_and_budget() {
    let key = SigningKey::es256("es-1");
    let fake = FakeOllama::builder()
        .model(MODEL)
        .model("qwen3:8b")
        .spawn()
        .await;
    let jwks = JwksServer::start(&key_set(&[&key])).await;
    let config = config(&fake.url(), &jwks.url(), LOOPBACK)
        .replacen(
            "        refresh_min_interval: 1s\n",
            "        refresh_min_interval: 1s\n        claims_to_policy:\n          claim: groups\n          \
             policies:\n            - {value: admins, max_priority: high}\n            \
             - {value: interns, max_priority: low, models: [\"qwen3*\"], \
             budget: {tokens: 1, window: 1d}}\n",
            1,
        )
        .replacen(
            "      users:\n        max_concurrent: 1\n",
            "      users:\n        max_concurrent: 1\n        budget: {tokens: 1000000, window: 1d}\n",
            1,
        );
    let stack = Stack::start(&config).await;
    let token = |sub: &str, groups: Value| {
        let mut claims = claims(sub);
        claims["groups"] = groups;
        key.sign(&claims)
    };
    let ask = |token: String, model: &'static str| {
        let stack = &stack;
        async move {
            let auth = format!("Bearer {token}");
            let body = json!({"model": model, "stream": false,
                              "messages": [{"role": "user", "content": "hi"}]});
            HttpClient::new()
                .post_json(
                    &format!("{}/api/chat", stack.url()),
                    &[("authorization", &auth), ("x-queue-priority", "high")],
                    &body,
                )
                .await
        }
    };
    // Config order decides: an admin who is also an intern is an admin.
    let admin = token("ada", json!(["staff", "interns", "admins"]));
    assert_eq!(until_accepted(&stack, &admin).await.status, 200);
    let reply = ask(admin, MODEL).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    // An intern asking for high runs low, and only on the models of its group.
    let intern = token("ivan", json!("interns"));
    let reply = ask(intern.clone(), MODEL).await;
    assert_eq!(reply.status, 403, "{}", reply.text());
    let reply = ask(intern.clone(), "qwen3:8b").await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    // In no group: the entry's own ceiling (normal) and models (all).
    let reply = ask(token("olga", json!(["staff"])), MODEL).await;
    assert_eq!(reply.status, 200, "{}", reply.text());

    let auth = format!("Bearer {ADMIN}");
    let status = HttpClient::new()
        .get(
            &format!("{}/queue/status", stack.url()),
            &[("authorization", &auth)],
        )
        .await
        .json();
    let processed = |tier: &str| status["queue"][tier]["processed"].as_u64();
    // until_accepted's request asked for no tier (normal); then one of each.
    assert_eq!(
        (processed("high"), processed("normal"), processed("low")),
        (Some(1), Some(2), Some(1)),
        "{status}"
    );
    // The intern's budget (one token a day, in place of the users' million) is spent by
    // that answer; the admin's is the users' budget.
    let deadline = Instant::now() + PATIENCE;
    let refused = loop {
        let reply = ask(intern.clone(), "qwen3:8b").await;
        if reply.status != 200 || Instant::now() >= deadline {
            break reply;
        }
    };
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert!(
        error_text(&refused).contains("budget"),
        "{}",
        refused.text()
    );
    let reply = ask(token("ada", json!("admins")), MODEL).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

#[tokio::test]
async fn a_rotated_key_is_picked_up_from_the_first_token_that_names_it() {
    let old = SigningKey::es256("2026-11");
    let new = SigningKey::es256("2026-12");
    let (fake, jwks, stack) = stack_with(&key_set(&[&old]), LOOPBACK).await;
    assert_eq!(
        until_accepted(&stack, &old.sign(&claims("alice")))
            .await
            .status,
        200
    );
    let before = jwks.hits();

    // The issuer rotates: the old key leaves, a new one signs.
    jwks.serve(&key_set(&[&new]));
    let reply = chat_as(&stack, &new.sign(&claims("bob"))).await;
    assert_eq!(
        reply.status,
        401,
        "not in the snapshot yet: {}",
        reply.text()
    );
    assert!(
        error_text(&reply).contains("unknown key id"),
        "{}",
        reply.text()
    );
    let reply = until_accepted(&stack, &new.sign(&claims("bob"))).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert!(
        jwks.hits() - before <= 3,
        "asked at most once a second while tokens kept asking: {} fetches",
        jwks.hits() - before
    );
    // The old key is gone with the old set.
    let reply = chat_as(&stack, &old.sign(&claims("alice"))).await;
    assert_eq!(reply.status, 401, "{}", reply.text());
    assert_eq!(seen(&fake), ["people/alice", "people/bob"]);
}

#[tokio::test]
async fn an_issuer_down_at_start_refuses_tokens_with_the_reason_until_it_answers() {
    let key = SigningKey::ed25519("ed-1");
    let fake = FakeOllama::builder().model(MODEL).spawn().await;
    let jwks = JwksServer::start(&key_set(&[&key])).await;
    jwks.fail();
    let stack = Stack::start(&config(&fake.url(), &jwks.url(), LOOPBACK)).await;

    // The control plane started anyway; tokens are refused, saying why.
    let token = key.sign(&claims("alice"));
    let deadline = Instant::now() + PATIENCE;
    let reply = loop {
        let reply = chat_as(&stack, &token).await;
        if error_text(&reply).contains("503") || Instant::now() >= deadline {
            break reply;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(reply.status, 401);
    assert!(
        error_text(&reply).contains("no signing keys for this issuer yet")
            && error_text(&reply).contains("503"),
        "{}",
        reply.text()
    );
    // Status says why, for each client whose users come with tokens of this issuer.
    for client in ["people", "app"] {
        let jwt = jwt_status(&stack, client).await;
        assert_eq!(jwt["issuer"], ISSUER, "{client}: {jwt}");
        assert_eq!(jwt["keys"], 0, "{client}: {jwt}");
        let error = jwt["error"].as_str().unwrap_or_default();
        assert!(error.contains("503"), "{client}: {jwt}");
    }
    // An app key's own requests do not depend on the issuer.
    let auth = format!("Bearer {APP}");
    assert_eq!(
        chat_with(&stack, "/api/chat", &[("authorization", &auth)])
            .await
            .status,
        200
    );

    // The issuer comes back: tokens work without a restart.
    jwks.serve(&key_set(&[&key]));
    let reply = until_accepted(&stack, &token).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let jwt = jwt_status(&stack, "people").await;
    assert_eq!(jwt["keys"], 1, "{jwt}");
    assert!(jwt.get("error").is_none(), "{jwt}");
    assert_eq!(seen(&fake), ["app", "people/alice"]);
}

#[tokio::test]
async fn a_jwks_url_on_a_private_address_is_refused_by_the_ssrf_check() {
    let key = SigningKey::es256("es-1");
    // No allowed_hosts: the loopback server is what the SSRF rules keep the control plane from.
    let (fake, jwks, stack) = stack_with(&key_set(&[&key]), "").await;
    let token = key.sign(&claims("alice"));
    let deadline = Instant::now() + PATIENCE;
    let reply = loop {
        let reply = chat_as(&stack, &token).await;
        if error_text(&reply).contains("SSRF") || Instant::now() >= deadline {
            break reply;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(reply.status, 401);
    assert!(error_text(&reply).contains("SSRF"), "{}", reply.text());
    assert_eq!(jwks.hits(), 0, "nothing was sent to a private address");
    assert!(seen(&fake).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_policy_holds_on_the_box_that_runs_a_forwarded_request() {
    // One host, owned by node `a`: every request that enters at `b` is forwarded to `a`, which
    // must apply the group the edge selected from the token, not the key's models and
    // `users.budget`.
    let _exclusive = crate::support::exclusive().await;
    const TOKEN: &str = "node-token-0123456789";
    const BIG: &str = "qwen3:8b";
    let key = SigningKey::es256("es-1");
    let fake = FakeOllama::builder().model(MODEL).model(BIG).spawn().await;
    let jwks = JwksServer::start(&key_set(&[&key])).await;
    let yaml = format!(
        r#"proxy:
  host: "127.0.0.1"
  max_concurrent: 4
ollama:
  hosts:
    - url: "{fake}"
      name: gpu
      max_concurrent: 4
      node: a
nodes:
  a: {{port: 0}}
  b: {{port: 0}}
control_plane:
  node_token: "{TOKEN}"
auth:
  enabled: true
  keys:
    - client_id: admin
      key: "{ADMIN}"
      scope: management
    - client_id: people
      models: ["llama3.2*"]
      jwt:
        issuer: "{ISSUER}"
        audiences: ["{AUDIENCE}"]
        jwks_url: "{jwks}"
        refresh_min_interval: 1s
        allowed_hosts: ["127.0.0.1"]
        claims_to_policy:
          claim: groups
          policies:
            - {{value: big, models: ["qwen3*"], budget: {{tokens: 1000000, window: 1d}}}}
            - {{value: small, models: ["qwen3*"], budget: {{tokens: 1, window: 1d}}}}
      users:
        budget: {{tokens: 1, window: 1d}}
"#,
        fake = fake.url(),
        jwks = jwks.url(),
    );
    let cluster = oqp_tests::cluster::Cluster::builder(env!("CARGO_BIN_EXE_oqp-bench"), &yaml)
        .node("a")
        .node("b")
        .node_token(TOKEN)
        .admin_key(ADMIN)
        .start()
        .await;
    cluster.wait_peer("b", "a").await;
    let token = |sub: &str, group: &str| {
        let mut claims = claims(sub);
        claims["groups"] = json!([group]);
        key.sign(&claims)
    };
    let edge = cluster.url("b");
    let ask = |token: String, model: &'static str| {
        let url = format!("{edge}/api/chat");
        async move {
            let auth = format!("Bearer {token}");
            let body = json!({"model": model, "stream": false,
                              "messages": [{"role": "user", "content": "hi"}]});
            HttpClient::new()
                .post_json(&url, &[("authorization", &auth)], &body)
                .await
        }
    };
    // Until the issuer's keys reach both boxes.
    let big = token("ada", "big");
    let deadline = Instant::now() + PATIENCE;
    let first = loop {
        let reply = ask(big.clone(), BIG).await;
        if reply.status == 200 || Instant::now() >= deadline {
            break reply;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(first.status, 200, "{}", first.text());
    // The group's model, which the key alone does not allow, runs on the owner, again and
    // again past `users.budget` (one token), within the group's budget.
    for _ in 0..3 {
        let reply = ask(big.clone(), BIG).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let status = cluster.queue_status("a").await.unwrap();
    assert_eq!(
        status["clients"]["people/ada"]["processed"], 4,
        "run by the owner: {status:#}"
    );
    // The group's models replace the key's.
    let reply = ask(big.clone(), MODEL).await;
    assert_eq!(reply.status, 403, "{}", reply.text());
    // Past the group's budget, refused.
    let small = token("ivan", "small");
    let deadline = Instant::now() + PATIENCE;
    let refused = loop {
        let reply = ask(small.clone(), BIG).await;
        if reply.status != 200 || Instant::now() >= deadline {
            break reply;
        }
    };
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert!(
        error_text(&refused).contains("budget"),
        "{}",
        refused.text()
    );
    let served: Vec<String> = seen(&fake);
    assert!(
        served
            .iter()
            .all(|id| id == "people/ada" || id == "people/ivan"),
        "{served:?}"
    );
    cluster.shutdown().await;
}
