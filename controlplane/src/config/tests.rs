//! Loader tests: defaults, the Python project's config, every error class, env overrides and the
//! shipped examples.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use proptest::prelude::*;

use super::*;

const ONE_HOST: &str = "ollama:\n  hosts:\n    - url: http://127.0.0.1:11434\n      name: local\n";

fn load(yaml: &str) -> Loaded {
    load_with(yaml, &[]).unwrap_or_else(|error| panic!("config should load:\n{error}"))
}

fn load_with(yaml: &str, vars: &[(&str, &str)]) -> Result<Loaded, ConfigError> {
    load_str(yaml, &Env::from_pairs(vars.iter().copied()))
}

/// The problems of a config that must fail, one per entry.
fn problems(yaml: &str, vars: &[(&str, &str)]) -> Vec<String> {
    match load_with(yaml, vars) {
        Ok(_) => panic!("config should not load:\n{yaml}"),
        Err(error) => error.problems(),
    }
}

fn with_host(rest: &str) -> String {
    format!("{ONE_HOST}{rest}")
}

#[test]
fn every_default() {
    let Loaded { config, warnings } = load(ONE_HOST);
    assert!(warnings.is_empty(), "{warnings:?}");

    assert_eq!(config.proxy, ProxyConfig::default());
    assert_eq!(config.proxy.host, "127.0.0.1");
    assert_eq!(config.proxy.port, 11435);
    assert_eq!(config.proxy.max_concurrent, 2);
    assert!(!config.proxy.allow_model_management);
    assert_eq!(config.proxy.drain_timeout, Duration::from_secs(30));
    assert_eq!(config.proxy.max_request_body_mb, 50);
    assert_eq!(config.proxy.max_request_body_bytes(), 50 * 1024 * 1024);
    assert_eq!(config.proxy.max_connections, 4096);
    assert_eq!(config.proxy.max_connections_per_ip, 1024);
    assert_eq!(config.proxy.first_request_timeout, Duration::from_secs(10));
    assert_eq!(config.proxy.idle_timeout, Duration::from_secs(60));
    assert_eq!(config.proxy.body_read_timeout, Duration::from_secs(30));
    assert_eq!(config.proxy.upstream_stall_timeout, Duration::from_secs(60));
    assert_eq!(config.proxy.client_stall_timeout, Duration::from_secs(60));

    assert_eq!(config.ollama.request_timeout, Duration::from_secs(300));
    assert_eq!(config.ollama.non_streamed_timeout, Duration::from_secs(300));
    let host = &config.ollama.hosts[0];
    assert_eq!(host.url, "http://127.0.0.1:11434");
    assert_eq!(host.name, "local");
    assert_eq!(host.weight, 1);
    assert_eq!(host.model_sync_interval, Duration::from_secs(30));
    assert_eq!(host.max_concurrent, 2);
    assert_eq!(host.kind, HostKind::Ollama);
    assert!(host.api_keys.is_empty() && host.fallback_models.is_empty());

    let queue = &config.queue;
    assert_eq!(queue, &QueueConfig::default());
    for (tier, depth, wait) in [
        (Tier::High, 50, 120),
        (Tier::Normal, 100, 300),
        (Tier::Low, 200, 600),
    ] {
        let block = queue.tier(tier);
        assert_eq!(
            (block.max_depth, block.max_wait),
            (depth, Duration::from_secs(wait))
        );
        assert_eq!(block.high_watermark_pct, 80);
        assert_eq!(block.promote_after, None);
    }
    assert_eq!(queue.overflow_status_code, 503);
    assert_eq!(queue.max_queued_mb, 512);
    assert_eq!(queue.fair_share.half_life, Duration::from_secs(60));
    assert_eq!(queue.model_swap, ModelSwapConfig::default());
    assert!(queue.model_swap.enabled && queue.model_swap.unload);
    assert_eq!(
        queue.model_swap.max_defer,
        [1, 5, 30].map(Duration::from_secs)
    );
    assert_eq!(queue.model_swap.idle_grace, Duration::from_millis(300));

    assert!(!config.webhooks.enabled);
    assert_eq!(config.webhooks.url, "");
    assert_eq!(config.webhooks.events, WebhookEvent::DEFAULTS);
    assert!(config.webhooks.allowed_hosts.is_empty());

    assert!(!config.auth.enabled);
    assert!(config.auth.keys.is_empty());
    assert_eq!(config.auth.rate_limit.max_failures, 10);
    assert_eq!(config.auth.rate_limit.window_seconds, 60);

    assert_eq!(config.logging.level, LogLevel::Info);
    assert_eq!(config.logging.format, LogFormat::Text);

    assert!(config.client_injection.listeners.is_empty());
    assert!(!config.client_injection.allow_public_injection);

    assert_eq!(config.routing.strategy, RoutingStrategy::RoundRobin);
    assert_eq!(config.routing.fallback, RoutingFallback::AnyHealthy);
    assert_eq!(config.routing.model_poll_timeout, Duration::from_secs(3));
    assert!(!config.routing.require_host_at_start);
    assert_eq!(config.routing.acquire_timeout, Duration::from_secs(5));

    let cache = &config.embedding_cache;
    assert!(!cache.enabled);
    assert_eq!(cache.backend, CacheBackend::Memory);
    assert_eq!(cache.ttl, Duration::from_secs(86_400));
    assert_eq!(cache.max_entry_bytes, 32_768);
    assert_eq!(cache.key_prefix, "oqp:embed:");
    assert_eq!(cache.connect_timeout, Duration::from_secs(2));
    assert_eq!(cache.max_memory_mb, 256);
    assert!(!cache.per_client);
    assert_eq!(cache.max_inputs, 2048);

    assert_eq!(config.keep_alive.default_json, "\"5m\"");
    assert!(!config.keep_alive.override_client);
    assert_eq!(config.keep_alive.max, Duration::from_secs(1800));

    // On by default where only this machine reaches it (the default listener, loopback).
    assert!(config.dashboard.enabled);
    assert_eq!(config.dashboard.refresh_seconds, 5);

    assert_eq!(config.control_plane.listen, "127.0.0.1:50051");
    assert!(config.control_plane.node_token.is_none());
    assert_eq!(config.control_plane.state_dir, Path::new("./oqp-state"));
    assert!(config.control_plane.tls.is_none());
    assert!(config.nodes.is_empty());
}

/// A config as the Python project documents it (README examples, 0.4 key sources, deprecated
/// keys), which must load unchanged.
const PYTHON_CONFIG: &str = r#"
proxy:
  host: "0.0.0.0"
  port: 11435
  max_concurrent: 4
  allow_model_management: false
  drain_timeout: 30
  max_request_body_mb: 50

ollama:
  hosts:
    - url: "http://forge:11434/"
      name: "primary"
      weight: 2
      model_sync_interval: 30
    - url: "http://helm:11434"
      name: "secondary"
      weight: 1
      model_sync_interval: 30
  health_check_interval: 30
  request_timeout: 300

queue:
  high:   {max_depth: 50,  max_wait: 120, high_watermark_pct: 80}
  normal: {max_depth: 100, max_wait: 300, high_watermark_pct: 80}
  low:    {max_depth: 200, max_wait: 600, high_watermark_pct: 80}
  overflow_status_code: 429
  max_queued_mb: 512

webhooks:
  enabled: true
  url: "https://hooks.example.com/ollama-alerts"
  events: [queue.full, queue.high_watermark, queue.drained, host.unhealthy, host.recovered]
  allowed_hosts: []

auth:
  enabled: true
  keys:
    - key: "sk-my-interactive-key"
      client_id: "openwebui"
      description: "Open WebUI"
      max_priority: high
      scope: inference
      max_concurrent: 0
    - key: "sk-my-batch-key"
      client_id: "memsearch-watch"
      description: "Background embedding jobs"
      max_priority: low
      max_concurrent: 2
    - key: "sk-my-admin-key"
      client_id: "admin"
      description: "Admin"
      max_priority: high
      management: true
    - key: "sk-my-readonly-key"
      client_id: "homepage"
      description: "Status widget — cannot spend GPU time"
      scope: read
      management: false
    - key_env: OQP_KEY_SEARXNG
      client_id: searxng-mcp
      max_priority: normal
    - key: "sk-my-metrics-key"
      client_id: "prometheus-scraper"
      scope: read
    - key: "sk-local"
      client_id: "localllm"
  rate_limit:
    max_failures: 10
    window_seconds: 60

logging:
  level: INFO
  format: json

client_injection:
  listeners:
    - listen_port: 11436
      inject_as: memsearch-watch
      bind: 127.0.0.1
    - listen_port: 11437
      inject_as: localllm
  allow_public_injection: false

routing:
  strategy: model_aware
  fallback: any_healthy
  model_poll_timeout: 3

embedding_cache:
  enabled: true
  backend: "redis://valkey:6379/0"
  ttl: 86400
  max_entry_bytes: 32768
  key_prefix: "oqp:embed:"
  connect_timeout: 2

keep_alive:
  default: "5m"
  override: false

dashboard:
  enabled: true
  refresh_seconds: 5
"#;

#[test]
fn the_python_config_loads() {
    let Loaded { config, warnings } =
        load_with(PYTHON_CONFIG, &[("OQP_KEY_SEARXNG", "sk-searxng")])
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.proxy.max_concurrent, 4);
    assert_eq!(config.ollama.hosts[0].url, "http://forge:11434");
    assert_eq!(config.ollama.hosts[0].weight, 2);
    assert_eq!(config.ollama.hosts[1].max_concurrent, 4);
    assert_eq!(config.queue.overflow_status_code, 429);
    assert!(config.webhooks.enabled);
    assert_eq!(config.auth.keys.len(), 7);
    let admin = config.auth.key("admin").unwrap();
    assert_eq!(admin.scope, Scope::Management);
    assert_eq!(admin.default_priority, Tier::Normal);
    let homepage = config.auth.key("homepage").unwrap();
    assert_eq!(
        (homepage.scope, homepage.max_priority),
        (Scope::Read, Tier::Normal)
    );
    let batch = config.auth.key("memsearch-watch").unwrap();
    assert_eq!(
        (
            batch.max_priority,
            batch.default_priority,
            batch.max_concurrent
        ),
        (Tier::Low, Tier::Low, 2)
    );
    assert_eq!(
        config
            .auth
            .key("searxng-mcp")
            .unwrap()
            .key
            .as_ref()
            .unwrap()
            .expose(),
        "sk-searxng"
    );
    assert_eq!(config.logging.level, LogLevel::Info);
    assert_eq!(config.logging.format, LogFormat::Json);
    assert_eq!(config.client_injection.listeners[1].bind, "127.0.0.1");
    assert_eq!(config.routing.strategy, RoutingStrategy::ModelAware);
    assert_eq!(
        config.embedding_cache.backend,
        CacheBackend::Redis("redis://valkey:6379/0".to_string())
    );
    assert!(config.dashboard.enabled);

    assert!(
        warnings
            .iter()
            .any(|w| w.contains("ollama.health_check_interval")),
        "{warnings:?}"
    );
    let deprecated: Vec<_> = warnings
        .iter()
        .filter(|w| w.contains(".management"))
        .collect();
    assert_eq!(deprecated.len(), 1, "{warnings:?}");
    assert!(deprecated[0].contains("client_id=admin"));
    assert!(
        !warnings.iter().any(|w| w.contains("SECURITY")),
        "auth is on: {warnings:?}"
    );
}

#[test]
fn the_non_streamed_timeout_follows_the_request_timeout_unless_set() {
    let hosts = "  hosts:\n    - {url: http://127.0.0.1:11434, name: local}\n";
    let config = load(&format!("ollama:\n  request_timeout: 20\n{hosts}")).config;
    assert_eq!(config.ollama.non_streamed_timeout, Duration::from_secs(20));
    let config = load(&format!(
        "ollama:\n  request_timeout: 20\n  non_streamed_timeout: 900\n{hosts}"
    ))
    .config;
    assert_eq!(config.ollama.request_timeout, Duration::from_secs(20));
    assert_eq!(config.ollama.non_streamed_timeout, Duration::from_secs(900));
    let compiled = crate::compile::snapshot(
        &config,
        &Default::default(),
        &std::collections::HashMap::new(),
        &[],
        1,
    );
    assert_eq!(compiled.proxy.unwrap().non_streamed_timeout_ms, 900_000);
}

#[test]
fn partial_tiers_keep_their_own_defaults() {
    let config = load(&with_host(
        "queue:\n  high: {max_wait: 60}\n  low: {max_depth: 0, promote_after: 90s}\n",
    ))
    .config;
    assert_eq!(config.queue.high.max_depth, 50);
    assert_eq!(config.queue.high.max_wait, Duration::from_secs(60));
    assert_eq!(config.queue.high.high_watermark_pct, 80);
    assert_eq!(config.queue.low.max_depth, 0);
    assert_eq!(config.queue.low.max_wait, Duration::from_secs(600));
    assert_eq!(
        config.queue.low.promote_after,
        Some(Duration::from_secs(90))
    );
    assert_eq!(config.queue.normal, TierConfig::default_for(Tier::Normal));

    let errors = problems(
        &with_host("queue:\n  normal: {high_watermark_pct: 0}\n  low: {max_depth: -1}\n"),
        &[],
    );
    assert_eq!(
        errors,
        [
            "queue.normal.high_watermark_pct must be in 1..=100, got 0",
            "queue.low.max_depth must be a non-negative integer (0 = never queue), got -1",
        ]
    );
}

#[test]
fn durations_take_seconds_or_humantime() {
    let config = load(&with_host(
        "proxy: {drain_timeout: 1.5}\nqueue: {high: {max_wait: \"2m\"}, fair_share: {half_life: 90s}}\n\
         routing: {acquire_timeout: 250ms}\n",
    ))
    .config;
    assert_eq!(config.proxy.drain_timeout, Duration::from_millis(1500));
    assert_eq!(config.queue.high.max_wait, Duration::from_secs(120));
    assert_eq!(config.queue.fair_share.half_life, Duration::from_secs(90));
    assert_eq!(config.routing.acquire_timeout, Duration::from_millis(250));

    let errors = problems(&with_host("proxy: {drain_timeout: soon}\n"), &[]);
    assert!(
        errors[0].starts_with("proxy.drain_timeout: \"soon\" is not a duration"),
        "{errors:?}"
    );
}

#[test]
fn connection_limits_are_bounded_and_name_their_key() {
    let config = load(&with_host(
        "proxy: {max_connections: 10, max_connections_per_ip: 2, idle_timeout: 250ms, \
         client_stall_timeout: 0.5}\n",
    ))
    .config;
    assert_eq!(config.proxy.max_connections, 10);
    assert_eq!(config.proxy.max_connections_per_ip, 2);
    assert_eq!(config.proxy.idle_timeout, Duration::from_millis(250));
    assert_eq!(
        config.proxy.client_stall_timeout,
        Duration::from_millis(500)
    );

    let errors = problems(
        &with_host(
            "proxy: {max_connections: 0, max_connections_per_ip: 0, first_request_timeout: 0, \
             upstream_stall_timeout: 2d}\n",
        ),
        &[],
    );
    for key in [
        "proxy.max_connections must be >= 1",
        "proxy.max_connections_per_ip must be >= 1",
        "proxy.first_request_timeout must be",
        "proxy.upstream_stall_timeout must be <= 24h",
    ] {
        assert!(
            errors.iter().any(|e| e.starts_with(key)),
            "{key}: {errors:?}"
        );
    }
}

const KEY_SUFFIX: &str = "\n      client_id: alice\n";

fn key_problems(source: &str, vars: &[(&str, &str)]) -> Vec<String> {
    problems(
        &with_host(&format!("auth:\n  keys:\n    - {source}{KEY_SUFFIX}")),
        vars,
    )
}

#[test]
fn key_source_errors_name_the_client_and_never_the_value() {
    let subject = "auth.keys[] entry for client_id='alice'";
    assert_eq!(
        key_problems("description: no key", &[]),
        [format!(
            "{subject} has no key: set exactly one of key, key_env or key_file"
        )]
    );
    assert_eq!(
        key_problems(
            "key: sk-value-one\n      key_env: ALICE_KEY",
            &[("ALICE_KEY", "sk-value-two")]
        ),
        [format!(
            "{subject} sets key, key_env — set exactly one of key, key_env or key_file"
        )]
    );
    assert_eq!(
        key_problems("key_env: ALICE_KEY", &[]),
        [format!(
            "{subject} names key_env='ALICE_KEY', which is not set in the environment"
        )]
    );
    let missing = key_problems("key_file: /nonexistent/alice.key", &[]);
    assert_eq!(missing.len(), 1);
    assert!(
        missing[0].starts_with(&format!(
            "{subject} names key_file='/nonexistent/alice.key', which cannot be read: "
        )),
        "{missing:?}"
    );
    assert_eq!(
        key_problems("key_env: ALICE_KEY", &[("ALICE_KEY", "  ")]),
        [format!(
            "{subject} resolved to an empty key from key_env='ALICE_KEY'. An empty credential would \
             authenticate no one and is never intentional"
        )]
    );
    assert_eq!(
        key_problems("key: \"\"", &[]),
        [format!(
            "{subject} resolved to an empty key from key. An empty credential would authenticate \
             no one and is never intentional"
        )]
    );
    // No message ever carries a key value.
    for message in key_problems(
        "key: sk-value-one\n      key_env: ALICE_KEY\n      key_file: /x",
        &[("ALICE_KEY", "sk-value-two")],
    ) {
        assert!(!message.contains("sk-value"), "{message}");
    }
}

#[test]
fn key_file_is_stripped_and_its_mode_checked() {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    writeln!(file, "sk-from-file  ").unwrap();
    let path = file.path().display().to_string();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(file.path(), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let yaml = with_host(&format!(
        "auth:\n  keys:\n    - key_file: {path}{KEY_SUFFIX}"
    ));
    let Loaded { config, warnings } = load(&yaml);
    assert_eq!(
        config.auth.keys[0].key.as_ref().unwrap().expose(),
        "sk-from-file"
    );
    #[cfg(unix)]
    {
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("client_id='alice'") && warnings[0].contains(&path),
            "{warnings:?}"
        );
        assert!(warnings[0].contains("0644"));

        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(file.path(), std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(load(&yaml).warnings.is_empty());
        // Shared with a service's group (a container's gid, the package's `oqp`): no warning.
        std::fs::set_permissions(file.path(), std::fs::Permissions::from_mode(0o640)).unwrap();
        assert!(load(&yaml).warnings.is_empty());
        // Writable by the group is not reading.
        std::fs::set_permissions(file.path(), std::fs::Permissions::from_mode(0o660)).unwrap();
        assert_eq!(load(&yaml).warnings.len(), 1);
    }

    let empty = tempfile::NamedTempFile::new().unwrap();
    let yaml = with_host(&format!(
        "auth:\n  keys:\n    - key_file: {}{KEY_SUFFIX}",
        empty.path().display()
    ));
    assert!(problems(&yaml, &[])[0].contains("resolved to an empty key from key_file="));
}

#[test]
fn management_and_scope() {
    let keys = |entry: &str| {
        with_host(&format!(
            "auth:\n  keys:\n    - key: k1\n      client_id: ops\n      {entry}\n"
        ))
    };

    let errors = problems(&keys("management: true\n      scope: read"), &[]);
    assert_eq!(errors.len(), 1);
    assert!(
        errors[0].contains("contradict") && errors[0].contains("ops"),
        "{errors:?}"
    );

    let loaded = load(&keys("management: true\n      scope: management"));
    assert_eq!(loaded.config.auth.keys[0].scope, Scope::Management);
    assert!(loaded.warnings[0].contains("auth.keys[client_id=ops].management"));

    let loaded = load(&keys("management: false\n      scope: read"));
    assert_eq!(loaded.config.auth.keys[0].scope, Scope::Read);
    assert!(loaded.warnings.is_empty());

    let errors = problems(&keys("scope: admin\n      max_priority: urgent"), &[]);
    assert_eq!(
        errors,
        [
            "auth.keys[client_id=ops].scope: unknown value 'admin' (expected read, inference or management)",
            "auth.keys[client_id=ops].max_priority: unknown value 'urgent' (expected high, normal or low)",
        ]
    );
}

#[test]
fn key_fields() {
    let yaml = with_host(
        "auth:\n  keys:\n    - {key: k1, client_id: a, max_priority: low, default_priority: high}\n    \
         - {key: k2, client_id: b, max_priority: high, weight: 2.5, max_queued: 7, expires: 2999-01-01T00:00:00Z}\n    \
         - {key: k3, client_id: c, max_priority: high, default_priority: low, expires: none}\n",
    );
    let Loaded { config, warnings } = load(&yaml);
    let [a, b, c] = &config.auth.keys[..] else {
        panic!()
    };
    assert_eq!((a.max_priority, a.default_priority), (Tier::Low, Tier::Low));
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("auth.keys[client_id=a].default_priority")),
        "{warnings:?}"
    );
    assert_eq!(
        (b.default_priority, b.weight, b.max_queued),
        (Tier::Normal, 2.5, 7)
    );
    assert!(b.expires.is_some());
    assert_eq!((c.default_priority, c.expires), (Tier::Low, None));

    let errors = problems(
        &with_host(
            "auth:\n  keys:\n    - {key: k1, client_id: a, weight: 0, max_queued: -1, expires: tomorrow}\n",
        ),
        &[],
    );
    assert_eq!(errors.len(), 3, "{errors:?}");
    assert!(errors[0].starts_with("auth.keys[client_id=a].weight must be a number > 0"));
}

#[test]
fn key_max_concurrent_is_bounded_by_the_proxy() {
    let errors = problems(
        &with_host(
            "proxy: {max_concurrent: 2}\nauth:\n  keys:\n    - {key: k1, client_id: batch, max_concurrent: 3}\n",
        ),
        &[],
    );
    assert_eq!(
        errors,
        [
            "auth.keys[client_id=batch].max_concurrent (3) exceeds proxy.max_concurrent (2). Set max_concurrent <= 2 or increase proxy.max_concurrent.",
        ]
    );
    let errors = problems(&with_host("proxy: {max_concurrent: 0}\n"), &[]);
    assert_eq!(errors, ["proxy.max_concurrent must be >= 1, got 0"]);
}

#[test]
fn auth_needs_keys_and_unique_ids() {
    assert_eq!(
        problems(&with_host("auth: {enabled: true}\n"), &[]),
        [
            "auth.enabled is true but no API keys are configured. Add at least one key to auth.keys or set auth.enabled: false.",
        ]
    );
    let errors = problems(
        &with_host(
            "auth:\n  keys:\n    - {key: k1, client_id: a}\n    - {key: k1, client_id: b}\n    - {key: k2, client_id: a}\n",
        ),
        &[],
    );
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors.iter().any(|e| e.contains("duplicate client_id 'a'")));
    assert!(
        errors
            .iter()
            .any(|e| e.contains("client_id='a' and client_id='b' resolve to the same key"))
    );
    assert!(errors.iter().all(|e| !e.contains("k1")));
}

const INJECTION_KEYS: &str =
    "auth:\n  keys:\n    - {key: k1, client_id: batch}\n    - {key: k2, client_id: ui}\n";

fn injection(listeners: &str, allow_public: bool) -> String {
    with_host(&format!(
        "{INJECTION_KEYS}client_injection:\n  allow_public_injection: {allow_public}\n  listeners:\n{listeners}"
    ))
}

#[test]
fn injection_cross_checks() {
    let errors = problems(
        &injection(
            "    - {listen_port: 11435, inject_as: batch}\n    - {listen_port: 11436, inject_as: batch}\n    \
             - {listen_port: 11436, inject_as: ui}\n    - {listen_port: 80, inject_as: ui}\n    \
             - {listen_port: 11437, inject_as: nobody}\n    - {listen_port: 11438, inject_as: ui, bind: 0.0.0.0}\n",
            false,
        ),
        &[],
    );
    assert_eq!(
        errors,
        [
            "client_injection.listeners[].listen_port 11435 conflicts with another port (proxy.port or another injection listener).",
            "client_injection.listeners[].listen_port 11436 conflicts with another port (proxy.port or another injection listener).",
            "client_injection.listeners[].listen_port must be in 1024-65535, got 80",
            "client_injection.listeners[].inject_as 'nobody' does not match any auth.keys[].client_id. Known IDs: ['batch', 'ui']",
            "client_injection.listeners[listen_port=11438].bind is '0.0.0.0' (non-loopback) but allow_public_injection is false. \
         Bind to 127.0.0.1, or set client_injection.allow_public_injection: true to expose this port to the network.",
        ]
    );

    // Loopback is parsed, not string-compared.
    let loaded = load(&injection(
        "    - {listen_port: 11436, inject_as: batch, bind: 127.0.0.5}\n    - {listen_port: 11437, inject_as: ui, bind: \"::1\"}\n    \
         - {listen_port: 11438, inject_as: ui, bind: LocalHost}\n",
        false,
    ));
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);

    let loaded = load(&injection(
        "    - {listen_port: 11436, inject_as: batch, bind: 192.168.1.5}\n",
        true,
    ));
    assert_eq!(loaded.warnings.len(), 1);
    assert!(
        loaded.warnings[0]
            .starts_with("WARNING: allow_public_injection is true AND auth.enabled is false.")
    );

    let loaded = load(&with_host(
        "auth:\n  enabled: true\n  keys:\n    - {key: k1, client_id: batch}\nclient_injection:\n  \
         allow_public_injection: true\n  listeners:\n    - {listen_port: 11436, inject_as: batch, bind: 192.168.1.5}\n",
    ));
    assert_eq!(loaded.warnings.len(), 1, "{:?}", loaded.warnings);
    assert!(loaded.warnings[0].contains("non-loopback"));
}

#[test]
fn hosts() {
    let yaml = "ollama:\n  hosts:\n    - {url: \"https://ollama.com/\", name: cloud, api_keys: [{key: ck1, account: me@example.com}, {key_env: CK2}], fallback_models: [\"gpt-oss:20b\"]}\n    \
                - {url: \"http://gpu:11434\", name: gpu, max_concurrent: 1, kind: ollama}\n";
    let Loaded { config, .. } =
        load_with(yaml, &[("CK2", "ck2"), ("OLLAMA_API_KEYS", "ck1,ck3")]).unwrap();
    let [cloud, gpu] = &config.ollama.hosts[..] else {
        panic!()
    };
    assert_eq!(
        (cloud.kind, cloud.url.as_str()),
        (HostKind::Cloud, "https://ollama.com")
    );
    let pool: Vec<(&str, &str)> = cloud
        .api_keys
        .iter()
        .map(|k| (k.key.expose(), k.account.as_str()))
        .collect();
    assert_eq!(pool, [("ck1", "me@example.com"), ("ck2", ""), ("ck3", "")]);
    assert_eq!(cloud.fallback_models, ["gpt-oss:20b"]);
    assert_eq!((gpu.kind, gpu.max_concurrent), (HostKind::Ollama, 1));
    assert!(
        gpu.api_keys.is_empty(),
        "OLLAMA_API_KEYS only feeds cloud hosts"
    );

    let errors = problems(
        "ollama:\n  hosts:\n    - {url: \"ftp://a\", name: a, weight: 0, model_sync_interval: 0}\n    \
         - {url: \"http://b:1\", name: a, api_keys: [{key: x}]}\n",
        &[],
    );
    assert_eq!(
        errors,
        [
            "ollama.hosts[0].url must start with http:// or https://, got scheme 'ftp'",
            "ollama.hosts[0].weight must be a positive integer, got 0",
            "ollama.hosts[0].model_sync_interval must be >= 1 second, got 0s",
            "ollama.hosts[1].api_keys is only allowed on cloud hosts (kind: cloud)",
        ]
    );
    let errors = problems(
        "ollama:\n  hosts:\n    - {url: \"http://b:1\", name: a}\n    - {url: \"http://c:1\", name: a}\n",
        &[],
    );
    assert_eq!(
        errors,
        ["ollama.hosts: duplicate name 'a' (entries 0 and 1); every host needs a unique name"]
    );
    assert!(problems("{}", &[])[0].starts_with("ollama.hosts is required"));
    assert!(problems("ollama: {hosts: []}", &[])[0].starts_with("ollama.hosts is required"));
}

#[test]
fn engine_host_kinds() {
    let yaml = "ollama:\n  hosts:\n    - {url: \"http://llama:8080\", name: llama, kind: openai}\n    \
                - {url: \"http://box:11434\", name: box, kind: AUTO}\n    \
                - {url: \"http://gpu:11434\", name: gpu}\n";
    let kinds: Vec<HostKind> = load(yaml)
        .config
        .ollama
        .hosts
        .iter()
        .map(|host| host.kind)
        .collect();
    assert_eq!(kinds, [HostKind::Openai, HostKind::Auto, HostKind::Ollama]);

    let errors = problems(
        "ollama:\n  hosts:\n    - {url: \"http://a:1\", name: a, kind: openai, api_keys: [{key: x}]}\n    \
         - {url: \"http://b:1\", name: b, kind: vllm}\n",
        &[],
    );
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert_eq!(
        errors[0],
        "ollama.hosts[0].api_keys is only allowed on cloud hosts (kind: cloud)"
    );
    for word in ["ollama.hosts[1].kind", "openai", "auto"] {
        assert!(errors[1].contains(word), "{errors:?}");
    }
}

#[test]
fn other_sections() {
    let config = load(&with_host(
        "keep_alive: {default: -1, override: true}\nembedding_cache: {backend: \"rediss://:pw@valkey:6380/1\"}\n\
         logging: {level: WARNING}\nwebhooks: {events: [key.revoked, queue.full, queue.full]}\n\
         control_plane: {listen: \"127.0.0.1:6000\", state_dir: /var/lib/oqp, tls: {cert: c.pem, key: k.pem}}\n\
         nodes: {gpu1: {host: 0.0.0.0, port: 11500}}\n",
    ))
    .config;
    assert_eq!(config.keep_alive.default_json, "-1");
    assert!(config.keep_alive.override_client);
    assert!(
        matches!(config.embedding_cache.backend, CacheBackend::Redis(ref url) if url.starts_with("rediss://"))
    );
    assert_eq!(config.logging.level, LogLevel::Warn);
    assert_eq!(
        config.webhooks.events,
        [WebhookEvent::KeyRevoked, WebhookEvent::QueueFull]
    );
    assert!(!config.webhooks.enabled);
    assert_eq!(config.control_plane.state_dir, Path::new("/var/lib/oqp"));
    assert_eq!(
        config.control_plane.tls.as_ref().unwrap().cert,
        Path::new("c.pem")
    );
    assert_eq!(
        config.nodes["gpu1"],
        NodeOverride {
            host: Some("0.0.0.0".into()),
            port: Some(11500),
            url: None,
        }
    );
}

/// Two boxes, each host owned by the node beside it.
const TWO_BOXES: &str = "control_plane: {node_token: tok}\n\
    nodes: {box1: {host: 0.0.0.0, url: \"http://10.0.0.1:11435/\"}, box2: {host: 10.0.0.2, port: 0}, edge: {port: 11500}}\n\
    ollama:\n  hosts:\n    - {url: \"http://10.0.0.1:11434\", name: gpu1, node: box1}\n    - {url: \"http://10.0.0.2:11434\", name: gpu2, node: box2}\n";

#[test]
fn nodes_own_hosts_and_say_how_peers_reach_them() {
    let config = load(TWO_BOXES).config;
    let owners: Vec<Option<&str>> = config
        .ollama
        .hosts
        .iter()
        .map(|h| h.node.as_deref())
        .collect();
    assert_eq!(owners, [Some("box1"), Some("box2")]);
    assert_eq!(
        config.nodes["box1"].url.as_deref(),
        Some("http://10.0.0.1:11435")
    );
    assert_eq!(config.nodes["box2"].port, Some(0), "port 0: any free port");
    assert_eq!(
        crate::compile::configured_url(&config, "box1").as_deref(),
        Some("http://10.0.0.1:11435")
    );
    assert_eq!(
        crate::compile::configured_url(&config, "box2"),
        None,
        "a node on port 0 is reached where it reports it is bound"
    );
    assert_eq!(
        crate::compile::configured_url(&config, "edge").as_deref(),
        Some("http://127.0.0.1:11500"),
        "from proxy.host and the node's port"
    );
}

#[test]
fn with_several_nodes_every_host_names_a_listed_owner() {
    let yaml = TWO_BOXES
        .replace("name: gpu1, node: box1", "name: gpu1")
        .replace("node: box2", "node: box3")
        + "    - {url: \"http://10.0.0.3:11434\", name: gpu3, node: \"  \"}\n";
    let problems = problems(&yaml, &[]);
    assert_eq!(problems.len(), 3, "{problems:#?}");
    assert!(
        problems[0]
            .starts_with("ollama.hosts[0].node is required when nodes lists two or more nodes")
            && problems[0].contains("host 'gpu1'")
            && problems[0].contains("box1, box2, edge"),
        "{problems:#?}"
    );
    assert!(
        problems[1].starts_with("ollama.hosts[1].node: node 'box3' is not listed under nodes"),
        "{problems:#?}"
    );
    assert!(
        problems[2].starts_with("ollama.hosts[2].node must name a node"),
        "{problems:#?}"
    );
}

#[test]
fn an_unlisted_owner_is_an_error_even_without_nodes() {
    let problems = problems(
        "control_plane: {node_token: t}\nollama:\n  hosts:\n    - {url: \"http://127.0.0.1:11434\", name: local, node: box1}\n",
        &[],
    );
    assert_eq!(
        problems,
        ["ollama.hosts[0].node: node 'box1' is not listed under nodes (listed: none)"]
    );
    // A host with an owner needs the token that signs the hop, even with one node listed.
    let one = "nodes: {box1: {port: 11500}}\nollama:\n  hosts:\n    - {url: \"http://127.0.0.1:11434\", name: local, node: box1}\n";
    assert!(problems_of(one)[0].starts_with("control_plane.node_token is required"));
    // One node listed, hosts without owners: every data plane owns every host, as before.
    load(&with_host("nodes: {box1: {port: 11500}}\n"));
}

#[test]
fn several_nodes_need_reachable_addresses_and_a_node_token() {
    let yaml = TWO_BOXES
        .replace("control_plane: {node_token: tok}", "control_plane: {}")
        .replace(", url: \"http://10.0.0.1:11435/\"", "");
    let problems = problems(&yaml, &[]);
    assert_eq!(problems.len(), 2, "{problems:#?}");
    assert!(
        problems[0].starts_with("control_plane.node_token is required"),
        "{problems:#?}"
    );
    assert!(
        problems[1].starts_with("nodes.box1.url is required"),
        "{problems:#?}"
    );
    assert!(problems[1].contains("'0.0.0.0'"), "{problems:#?}");
    let bad_url = problems_of(&TWO_BOXES.replace("http://10.0.0.1:11435/", "ftp://x"));
    assert!(
        bad_url[0].starts_with("nodes.box1.url must be an http://"),
        "{bad_url:#?}"
    );
    // Every URL accepted converts in the data plane: no path, no wildcard.
    let with_path = problems_of(&TWO_BOXES.replace("11435/", "11435/oqp"));
    assert!(
        with_path[0].starts_with("nodes.box1.url must be scheme://host[:port] only"),
        "{with_path:#?}"
    );
    let wildcard = problems_of(&TWO_BOXES.replace("10.0.0.1:11435", "0.0.0.0:11435"));
    assert!(
        wildcard[0].contains("wildcard address '0.0.0.0'"),
        "{wildcard:#?}"
    );
}

fn problems_of(yaml: &str) -> Vec<String> {
    problems(yaml, &[])
}

#[test]
fn node_token_sources() {
    let loaded = load_with(
        &with_host("control_plane: {node_token_env: NODE_TOKEN}\n"),
        &[("NODE_TOKEN", "tok")],
    )
    .unwrap();
    assert_eq!(
        loaded.config.control_plane.node_token.unwrap().expose(),
        "tok"
    );
    let errors = problems(
        &with_host("control_plane: {node_token: a, node_token_file: /x}\n"),
        &[],
    );
    assert_eq!(
        errors,
        [
            "control_plane sets node_token, node_token_file — set at most one of node_token, node_token_env or node_token_file",
        ]
    );
    let warnings = load(&with_host("control_plane: {listen: \"0.0.0.0:50051\"}\n")).warnings;
    assert_eq!(warnings.len(), 2, "{warnings:?}");
}

#[test]
fn keep_alive_values() {
    let json = |value: &str| {
        load(&with_host(&format!("keep_alive: {{default: {value}}}\n")))
            .config
            .keep_alive
            .default_json
    };
    assert_eq!(json("\"10m\""), "\"10m\"");
    assert_eq!(json("\"0\""), "\"0\"");
    assert_eq!(json("300"), "300");
    assert_eq!(json("1.5"), "1.5");
    assert_eq!(json("\"-1s\""), "\"-1s\"");
    let errors = problems(&with_host("keep_alive: {default: \"5\"}\n"), &[]);
    assert!(
        errors[0].starts_with("keep_alive.default: '5' is not a duration Ollama accepts"),
        "{errors:?}"
    );
    let max = |value: &str| {
        load(&with_host(&format!("keep_alive: {{max: {value}}}\n")))
            .config
            .keep_alive
            .max
    };
    assert_eq!(max("\"2h\""), Duration::from_secs(7200));
    assert_eq!(max("90"), Duration::from_secs(90));
    let errors = problems(&with_host("keep_alive: {max: 0}\n"), &[]);
    assert!(
        errors[0].starts_with("keep_alive.max must be >= 1 second"),
        "{errors:?}"
    );
}

#[test]
fn section_value_errors() {
    let errors = problems(
        &with_host(
            "embedding_cache: {backend: \"http://user:hunter2@cache\"}\nwebhooks: {enabled: true, url: \"ftp://x\", events: [queue.exploded]}\n\
             routing: {strategy: fastest}\nlogging: {format: xml}\nqueue: {overflow_status_code: 500}\ndashboard: {refresh_seconds: 0}\n",
        ),
        &[],
    );
    assert_eq!(
        errors,
        [
            "queue.overflow_status_code must be 503 or 429, got 500",
            "webhooks.events[0]: unknown value 'queue.exploded' (expected queue.full, queue.high_watermark, queue.drained, \
         queue.over_capacity, host.unhealthy, host.recovered, key.revoked, key.rotated, client.budget_exceeded, audit, cloud.under_reserve or cloud.refused)",
            "webhooks.url: Webhook URL must use http or https scheme, got: 'ftp'",
            "logging.format: unknown value 'xml' (expected text or json)",
            "routing.strategy: unknown value 'fastest' (expected model_aware or round_robin)",
            "embedding_cache.backend must be memory or a redis:// or rediss:// URL, got a http:// URL",
            "dashboard.refresh_seconds must be >= 1 second, got 0",
        ]
    );
    assert!(errors.iter().all(|e| !e.contains("hunter2")));
}

#[test]
fn env_overrides() {
    let vars = [
        ("OQP_PROXY__PORT", "8080"),
        ("OQP_PROXY__HOST", "0.0.0.0"),
        ("OQP_OLLAMA__HOSTS__0__URL", "http://ollama:11434/"),
        ("OQP_OLLAMA__HOSTS__1__URL", "http://second:11434"),
        ("OQP_OLLAMA__HOSTS__1__NAME", "second"),
        ("OQP_AUTH__ENABLED", "true"),
        ("OQP_AUTH__KEYS__0__KEY_ENV", "ALICE_KEY"),
        ("OQP_AUTH__KEYS__0__CLIENT_ID", "alice"),
        ("OQP_AUTH__KEYS__0__WEIGHT", "2.5"),
        ("OQP_CONTROL_PLANE__NODE_TOKEN", "12345"),
        ("OQP_EMBEDDING_CACHE__ENABLED", "TRUE"),
        ("OQP_QUEUE__HIGH__MAX_WAIT", "90s"),
        ("OQP_CONFIG", "/nowhere.yml"),
        ("ALICE_KEY", "sk-alice"),
    ];
    let Loaded { config, warnings } = load_with(ONE_HOST, &vars).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.proxy.port, 8080);
    assert_eq!(config.ollama.hosts[0].url, "http://ollama:11434");
    assert_eq!(config.ollama.hosts[0].name, "local");
    assert_eq!(config.ollama.hosts[1].name, "second");
    assert!(config.auth.enabled);
    assert_eq!(
        config.auth.keys[0].key.as_ref().unwrap().expose(),
        "sk-alice"
    );
    assert_eq!(config.auth.keys[0].weight, 2.5);
    assert_eq!(
        config.control_plane.node_token.as_ref().unwrap().expose(),
        "12345"
    );
    assert!(config.embedding_cache.enabled);
    assert_eq!(config.queue.high.max_wait, Duration::from_secs(90));
    assert!(warnings.is_empty(), "{warnings:?}");

    let errors = problems(
        ONE_HOST,
        &[
            ("OQP_PROXY", "1"),
            ("OQP_PROXY__PORT", "2"),
            ("OQP_OLLAMA__HOSTS__5__URL", "x"),
        ],
    );
    assert_eq!(
        errors,
        [
            "OQP_OLLAMA__HOSTS__5__URL: index 5 is past the end of ollama.hosts (1 item(s)); the next new item is index 1",
            "OQP_PROXY__PORT: cannot set proxy.port: proxy is a number, not a section (is another variable setting proxy itself?)",
            "proxy: invalid type: integer `1`, expected a section of key: value pairs",
        ]
    );
}

#[test]
fn env_only_configuration() {
    let config = load_with(
        "",
        &[
            ("OQP_OLLAMA__HOSTS__0__URL", "http://localhost:11434"),
            ("OQP_OLLAMA__HOSTS__0__NAME", "local"),
        ],
    )
    .unwrap()
    .config;
    assert_eq!(config.ollama.hosts[0].url, "http://localhost:11434");
    assert_eq!(
        default_path(&Env::from_pairs([("OQP_CONFIG", "/etc/oqp.yml")])),
        Path::new("/etc/oqp.yml")
    );
    assert_eq!(default_path(&Env::empty()), Path::new("config.yml"));
}

#[test]
fn unknown_keys_are_warnings_with_their_path() {
    let warnings = load(&with_host("proxy: {prot: 8080}\nauth:\n  keys:\n    - {key: k, client_id: a, scpoe: read}\nextra: 1\n")).warnings;
    assert_eq!(
        warnings,
        [
            "unknown key 'extra' (ignored)",
            "unknown key 'proxy.prot' (ignored)",
            "unknown key 'auth.keys[0].scpoe' (ignored)",
        ]
    );
}

#[test]
fn yaml_syntax_error_has_a_line() {
    let error = load_with("proxy:\n  port: 1\n bad: [\n", &[]).unwrap_err();
    let text = error.to_string();
    assert!(text.starts_with("YAML syntax error at line "), "{text}");
    assert_eq!(error.exit_code(), 2);
    // Only the syntax error: nothing else is checked in a file that did not parse.
    assert_eq!(error.problems().len(), 1, "{text}");
    let duplicate = load_with("proxy: {port: 1}\nproxy: {port: 2}\n", &[])
        .unwrap_err()
        .to_string();
    assert!(
        duplicate.starts_with("YAML syntax error at line 1"),
        "{duplicate}"
    );
    assert!(
        duplicate.contains("duplicate entry with key \"proxy\""),
        "{duplicate}"
    );
}

#[test]
fn several_schema_errors_are_reported_together() {
    let errors = problems(
        "proxy: {port: 99999}\nollama:\n  hosts:\n    - {url: \"http://a\", name: a, weight: -1}\n    - {name: b}\n\
         queue: {high: {max_wait: [1]}}\nauth: {keys: [{key: k}]}\nrouting: {require_host_at_start: maybe}\n",
        &[],
    );
    assert_eq!(errors.len(), 5, "{errors:?}");
    assert!(errors[0].starts_with("queue.high.max_wait: invalid type: sequence"));
    assert!(errors[1].starts_with("routing.require_host_at_start: invalid value"));
    assert!(errors[2].starts_with("ollama.hosts[1]: missing field `url`"));
    assert!(errors[3].starts_with("auth.keys[0]: missing field `client_id`"));
    assert_eq!(
        errors[4],
        "proxy.port: invalid port 99999 (must be 1-65535)"
    );
}

#[test]
fn missing_file() {
    let error = load_file(Path::new("/nonexistent/config.yml"), &Env::empty()).unwrap_err();
    assert_eq!(
        error.to_string(),
        "config file not found: /nonexistent/config.yml\nhint: copy examples/quickstart.yml to /nonexistent/config.yml and edit it (every setting: examples/config.example.yml)"
    );
    assert_eq!(error.exit_code(), ConfigError::EXIT_CODE);
}

#[test]
fn debug_never_shows_a_secret() {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    write!(file, "sk-file-secret").unwrap();
    let yaml = format!(
        "ollama:\n  hosts:\n    - {{url: \"https://ollama.com\", name: cloud, api_keys: [{{key: sk-cloud-secret}}]}}\n\
         auth:\n  enabled: true\n  keys:\n    - {{key: sk-literal-secret, client_id: a}}\n    - {{key_env: B_KEY, client_id: b}}\n    \
         - {{key_file: {}, client_id: c}}\ncontrol_plane: {{node_token: sk-node-secret}}\n\
         embedding_cache: {{backend: \"redis://:sk-redis-secret@valkey:6379\"}}\n",
        file.path().display()
    );
    let vars = [
        ("B_KEY", "sk-env-secret"),
        ("OLLAMA_API_KEY", "sk-pool-secret"),
    ];
    let loaded = load_with(&yaml, &vars).unwrap_or_else(|e| panic!("{e}"));
    let printed = format!("{loaded:?} {:#?}", loaded.config);
    assert!(!printed.contains("secret"), "{printed}");
    assert_eq!(loaded.config.ollama.hosts[0].api_keys.len(), 2);
}

#[test]
fn examples_load() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut examples: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            // oqp configs are the `.yml` files; compose and other tools'
            // files live beside them.
            path.extension().is_some_and(|ext| ext == "yml")
                && !path.ends_with("docker-compose.yml")
        })
        .collect();
    examples.sort();
    assert!(examples.len() >= 2, "{examples:?}");
    for path in &examples {
        let loaded =
            load_file(path, &Env::empty()).unwrap_or_else(|e| panic!("{}:\n{e}", path.display()));
        let name = path.file_name().unwrap().to_string_lossy();
        if name == "config.example.yml" || name == "quickstart.yml" {
            assert!(loaded.warnings.is_empty(), "{name}: {:?}", loaded.warnings);
        }
    }
    let example = load_file(&dir.join("config.example.yml"), &Env::empty())
        .unwrap()
        .config;
    let quickstart = load_file(&dir.join("quickstart.yml"), &Env::empty())
        .unwrap()
        .config;
    assert_eq!(quickstart.ollama.hosts[0].url, "http://127.0.0.1:11434");
    assert!(!quickstart.auth.enabled);
    // The full example states every default.
    assert_eq!(example.proxy, ProxyConfig::default());
    assert_eq!(example.queue, QueueConfig::default());
    assert_eq!(example.routing, RoutingConfig::default());
    assert_eq!(example.embedding_cache, EmbeddingCacheConfig::default());
    assert_eq!(example.keep_alive, KeepAliveConfig::default());
    assert_eq!(example.webhooks, WebhooksConfig::default());
    assert_eq!(example.dashboard, DashboardConfig::default());
    assert_eq!(example.logging, LoggingConfig::default());
    assert_eq!(example.cloud, CloudConfig::default());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn env_values_round_trip_through_typed_fields(port in 1u16.., token in any::<i64>(), flag in any::<bool>()) {
        let vars = [
            ("OQP_PROXY__PORT".to_string(), port.to_string()),
            ("OQP_CONTROL_PLANE__NODE_TOKEN".to_string(), token.to_string()),
            ("OQP_DASHBOARD__ENABLED".to_string(), flag.to_string()),
        ];
        let config = load_str(ONE_HOST, &Env::from_pairs(vars)).unwrap().config;
        prop_assert_eq!(config.proxy.port, port);
        let node_token = config.control_plane.node_token.unwrap();
        prop_assert_eq!(node_token.expose(), token.to_string());
        prop_assert_eq!(config.dashboard.enabled, flag);
    }
}

#[test]
fn the_programs_own_variables_are_not_overrides() {
    let env = Env::from_pairs([("OQP_LOG", "debug"), ("OQP_NODE_TOKEN", "secret-token")]);
    let loaded = load_str(
        "ollama:\n  hosts:\n    - {url: 'http://127.0.0.1:11434', name: local}\n",
        &env,
    )
    .unwrap();
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
}

#[test]
fn a_cloud_host_at_plain_http_is_warned_about() {
    let yaml = "ollama:\n  hosts:\n    - {url: \"http://ollama.com\", name: cloud, api_keys: [{key: ck1}]}\n    \
                - {url: \"http://relay.lan:8080\", name: relay, kind: cloud, api_keys: [{key: ck2}]}\n    \
                - {url: \"http://127.0.0.1:9443\", name: tunnel, kind: cloud, api_keys: [{key: ck3}]}\n    \
                - {url: \"https://ollama.com\", name: secure, api_keys: [{key: ck4}]}\n    \
                - {url: \"http://gpu:11434\", name: gpu}\n";
    let Loaded { warnings, .. } = load(yaml);
    let plaintext: Vec<&String> = warnings
        .iter()
        .filter(|w| w.contains("cloud host at http://"))
        .collect();
    assert_eq!(plaintext.len(), 2, "{warnings:?}");
    assert!(plaintext[0].starts_with("ollama.hosts[0] ('cloud')"));
    assert!(plaintext[1].starts_with("ollama.hosts[1] ('relay')"));
    assert!(
        !warnings
            .iter()
            .any(|w| w.contains("ck1") || w.contains("ck2")),
        "{warnings:?}"
    );
}

/// Every duration and size key, as a config with `{}` where its value goes, its path, and the
/// largest value it accepts.
const BOUNDED_KEYS: &[(&str, &str, &str)] = &[
    ("proxy: {drain_timeout: {}}\n", "proxy.drain_timeout", "1d"),
    (
        "proxy: {max_request_body_mb: {}}\n",
        "proxy.max_request_body_mb",
        "1048576",
    ),
    (
        "queue: {high: {max_wait: {}}}\n",
        "queue.high.max_wait",
        "1d",
    ),
    ("queue: {low: {max_wait: {}}}\n", "queue.low.max_wait", "1d"),
    (
        "queue: {low: {promote_after: {}, max_wait: 1d}}\n",
        "queue.low.promote_after",
        "1d",
    ),
    (
        "queue: {max_queued_mb: {}}\n",
        "queue.max_queued_mb",
        "1048576",
    ),
    (
        "queue: {fair_share: {half_life: {}}}\n",
        "queue.fair_share.half_life",
        "30d",
    ),
    (
        "auth: {rate_limit: {window_seconds: {}}}\n",
        "auth.rate_limit.window_seconds",
        "86400",
    ),
    (
        "routing: {model_poll_timeout: {}}\n",
        "routing.model_poll_timeout",
        "1h",
    ),
    (
        "routing: {acquire_timeout: {}}\n",
        "routing.acquire_timeout",
        "1d",
    ),
    (
        "embedding_cache: {ttl: {}}\n",
        "embedding_cache.ttl",
        "365d",
    ),
    (
        "embedding_cache: {connect_timeout: {}}\n",
        "embedding_cache.connect_timeout",
        "1h",
    ),
    (
        "embedding_cache: {max_memory_mb: {}}\n",
        "embedding_cache.max_memory_mb",
        "1048576",
    ),
    (
        "embedding_cache: {max_entry_bytes: {}}\n",
        "embedding_cache.max_entry_bytes",
        "1073741824",
    ),
    (
        "dashboard: {refresh_seconds: {}}\n",
        "dashboard.refresh_seconds",
        "86400",
    ),
    (
        "queue: {model_swap: {idle_grace: {}}}\n",
        "queue.model_swap.idle_grace",
        "10s",
    ),
];

#[test]
fn every_duration_and_size_key_has_an_upper_bound_named_in_its_error() {
    let hosts = |sync: &str| {
        format!(
            "ollama:\n  request_timeout: {sync}\n  non_streamed_timeout: {sync}\n  hosts:\n    - {{url: http://127.0.0.1:11434, name: local, model_sync_interval: {sync}}}\n"
        )
    };
    let mut cases: Vec<(String, String, &str)> = BOUNDED_KEYS
        .iter()
        .map(|(yaml, path, max)| (with_host(yaml), (*path).to_owned(), *max))
        .collect();
    // The hosts' own keys: both in one file, each reported under its own path.
    cases.push((hosts("{}"), "ollama.request_timeout".into(), "1d"));
    cases.push((hosts("{}"), "ollama.non_streamed_timeout".into(), "1d"));
    cases.push((
        hosts("{}"),
        "ollama.hosts[0].model_sync_interval".into(),
        "1d",
    ));
    // `embedding_cache.ttl: 40000000000` once stopped the data plane from applying snapshots.
    for huge in ["40000000000", "18446744073709551615", "1000000y"] {
        for (yaml, path, max) in &cases {
            let file = yaml.replace("{}", huge);
            let errors = problems(&file, &[]);
            // A value past i64 (or a duration string for a count) fails as a number; the rest
            // name the bound.
            let named = |e: &String| {
                e.starts_with(path.as_str()) && (e.contains("at most") || huge != "40000000000")
            };
            assert!(errors.iter().any(named), "{path} = {huge}: {errors:?}");
            let file = yaml.replace("{}", max);
            if let Err(error) = load_with(&file, &[]) {
                panic!("{path} = {max} should load: {error}");
            }
        }
    }
}

#[test]
fn trusted_proxies_are_normalised_and_bad_entries_named() {
    let loaded = load(&with_host(
        "auth:\n  trusted_proxies: [\"10.1.2.3/8\", \"192.168.1.10\", \"fd00::1/8\", \"10.0.0.0/8\"]\n",
    ));
    assert_eq!(
        loaded.config.auth.trusted_proxies,
        ["10.0.0.0/8", "192.168.1.10/32", "fd00::/8"]
    );
    assert!(load(&with_host("")).config.auth.trusted_proxies.is_empty());
    let errors = problems(
        &with_host("auth:\n  trusted_proxies: [\"10.0.0.0/33\", \"proxy.lan\"]\n"),
        &[],
    );
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors[0]
            .starts_with("auth.trusted_proxies[0]: '10.0.0.0/33' is not an IP address or CIDR"),
        "{errors:?}"
    );
    assert!(
        errors[1].starts_with("auth.trusted_proxies[1]: 'proxy.lan'"),
        "{errors:?}"
    );
}

#[test]
fn embedding_cache_max_inputs_is_bounded() {
    let config = load(&with_host("embedding_cache: {max_inputs: 16}\n")).config;
    assert_eq!(config.embedding_cache.max_inputs, 16);
    for bad in ["0", "100001", "-1"] {
        let errors = problems(
            &with_host(&format!("embedding_cache: {{max_inputs: {bad}}}\n")),
            &[],
        );
        assert_eq!(
            errors,
            [format!(
                "embedding_cache.max_inputs must be between 1 and 100000, got {bad}"
            )]
        );
    }
}

/// The VRAM config of every host of `yaml` (a `hosts:` list body).
fn vram_of(hosts: &str) -> Vec<Option<u64>> {
    let config = load(&format!("ollama:\n  hosts:\n{hosts}")).config;
    config.ollama.hosts.iter().map(|host| host.vram).collect()
}

#[test]
fn host_vram_takes_byte_sizes_and_names_its_key() {
    const GIB: u64 = 1 << 30;
    assert_eq!(
        vram_of(
            "    - {url: http://a:11434, name: a, vram: 24GiB}\n\
             \x20   - {url: http://b:11434, name: b, vram: 24 GB}\n\
             \x20   - {url: http://c:11434, name: c, vram: 8000MiB}\n\
             \x20   - {url: http://d:11434, name: d, vram: 17179869184}\n\
             \x20   - {url: http://e:11434, name: e}\n"
        ),
        [
            Some(24 * GIB),
            Some(24_000_000_000),
            Some(8000 << 20),
            Some(16 * GIB),
            None
        ]
    );
    let config = load_with(ONE_HOST, &[("OQP_OLLAMA__HOSTS__0__VRAM", "12GiB")])
        .unwrap()
        .config;
    assert_eq!(config.ollama.hosts[0].vram, Some(12 * GIB));

    let errors = problems(
        "ollama:\n  hosts:\n    - {url: http://a:11434, name: a}\n    \
         - {url: http://b:11434, name: b, vram: lots}\n    \
         - {url: http://c:11434, name: c, vram: -1}\n    \
         - {url: http://d:11434, name: d, vram: 1.5}\n",
        &[],
    );
    assert_eq!(errors.len(), 3, "{errors:?}");
    assert!(
        errors[0].starts_with("ollama.hosts[1].vram: not a byte size"),
        "{errors:?}"
    );
    assert!(
        errors[1].starts_with("ollama.hosts[2].vram: a byte size cannot be negative"),
        "{errors:?}"
    );
    assert!(
        errors[2].starts_with("ollama.hosts[3].vram: invalid type: floating point"),
        "{errors:?}"
    );
    assert!(!errors.iter().any(|e| e.contains("lots")), "{errors:?}");

    let errors = problems(
        "ollama:\n  hosts:\n    - {url: http://a:11434, name: a, vram: 0}\n    \
         - {url: http://b:11434, name: b, vram: 1000}\n    \
         - {url: http://c:11434, name: c, vram: 2PiB}\n",
        &[],
    );
    assert_eq!(
        errors,
        [
            "ollama.hosts[0].vram must be > 0 (omit it to learn the capacity from what is seen resident)",
            "ollama.hosts[1].vram must be between 1 MiB and 1 PiB, got 1000 bytes",
            "ollama.hosts[2].vram must be between 1 MiB and 1 PiB, got 2251799813685248 bytes",
        ]
    );

    let Loaded { config, warnings } = load(
        "ollama:\n  hosts:\n    - {url: https://ollama.com, name: cloud, vram: 24GiB, api_keys: [{key: k}]}\n",
    );
    assert_eq!(config.ollama.hosts[0].vram, None);
    assert_eq!(
        warnings,
        ["ollama.hosts[0].vram has no effect on a cloud host (its models are not loaded here)"]
    );
}

#[test]
fn model_swap_settings() {
    let swap = |yaml: &str| load(&with_host(yaml)).config.queue.model_swap;
    assert_eq!(swap("queue:\n  model_swap:\n"), ModelSwapConfig::default());
    let all =
        swap("queue:\n  model_swap: {enabled: false, max_defer: 2.5, idle_grace: 0, unload: no}\n");
    assert!(!all.enabled && !all.unload);
    assert_eq!(all.max_defer, [Duration::from_millis(2500); 3]);
    assert_eq!(all.idle_grace, Duration::ZERO);
    // Missing tiers keep their own defaults.
    let each = swap("queue:\n  model_swap: {max_defer: {high: 500ms, low: 60}, idle_grace: 1.5}\n");
    assert!(each.enabled && each.unload);
    assert_eq!(
        each.max_defer,
        [
            Duration::from_millis(500),
            Duration::from_secs(5),
            Duration::from_secs(60)
        ]
    );
    assert_eq!(each.idle_grace, Duration::from_millis(1500));
    assert_eq!(each.max_defer(Tier::Low), Duration::from_secs(60));
    // Overrides, the way every queue key has them.
    let config = load_with(
        ONE_HOST,
        &[
            ("OQP_QUEUE__MODEL_SWAP__ENABLED", "false"),
            ("OQP_QUEUE__MODEL_SWAP__MAX_DEFER__NORMAL", "3"),
            ("OQP_QUEUE__MODEL_SWAP__IDLE_GRACE", "250ms"),
        ],
    )
    .unwrap()
    .config;
    let env = config.queue.model_swap;
    assert!(!env.enabled);
    assert_eq!(env.max_defer[1], Duration::from_secs(3));
    assert_eq!(env.idle_grace, Duration::from_millis(250));
    // A tier's max_wait bounds its max_defer; the tier's own max_wait counts.
    let config = load(&with_host(
        "queue:\n  high: {max_wait: 2}\n  model_swap: {max_defer: {high: 1.5}}\n",
    ))
    .config;
    assert_eq!(
        config.queue.model_swap.max_defer[0],
        Duration::from_millis(1500)
    );
    // A default is lowered to half a short max_wait rather than outlast it.
    let config = load(&with_host(
        "queue:\n  high: {max_wait: 1}\n  low: {max_wait: 40}\n",
    ))
    .config;
    assert_eq!(
        config.queue.model_swap.max_defer,
        [
            Duration::from_millis(500),
            Duration::from_secs(5),
            Duration::from_secs(20)
        ]
    );
    // An unknown tier is an unknown key, as everywhere.
    let warnings = load(&with_host(
        "queue:\n  model_swap: {max_defer: {urgent: 1}}\n",
    ))
    .warnings;
    assert_eq!(
        warnings,
        ["unknown key 'queue.model_swap.max_defer.urgent' (ignored)"]
    );
}

#[test]
fn model_swap_errors_name_their_key() {
    let errors = problems(
        &with_host(
            "queue:\n  high: {max_wait: 1}\n  model_swap:\n    \
             max_defer: {high: 1, normal: 0, low: 601}\n    idle_grace: 11\n",
        ),
        &[],
    );
    assert_eq!(
        errors,
        [
            "queue.model_swap.max_defer.high (1s) must be below queue.high.max_wait (1s): a request held that long would expire",
            "queue.model_swap.max_defer.normal must be > 0 (set queue.model_swap.enabled: false to never hold requests back)",
            "queue.model_swap.max_defer.low (10m 1s) must be below queue.low.max_wait (10m): a request held that long would expire",
            "queue.model_swap.idle_grace must be at most 10s, got 11s",
        ]
    );
    let errors = problems(&with_host("queue:\n  model_swap: {max_defer: 0}\n"), &[]);
    assert_eq!(
        errors,
        [
            "queue.model_swap.max_defer must be > 0 (set queue.model_swap.enabled: false to never hold requests back)"
        ]
    );
    let errors = problems(
        &with_host("queue:\n  normal: {max_wait: 4}\n  model_swap: {max_defer: 4}\n"),
        &[],
    );
    assert_eq!(
        errors,
        [
            "queue.model_swap.max_defer (4s) must be below queue.normal.max_wait (4s): a request held that long would expire"
        ]
    );
    for (yaml, path) in [
        ("{enabled: maybe}", "queue.model_swap.enabled: "),
        ("{unload: 2}", "queue.model_swap.unload: "),
        ("{idle_grace: -1}", "queue.model_swap.idle_grace: "),
        ("{idle_grace: soon}", "queue.model_swap.idle_grace: "),
        ("{max_defer: [1]}", "queue.model_swap.max_defer: "),
        (
            "{max_defer: {low: soon}}",
            "queue.model_swap.max_defer.low: ",
        ),
        ("{max_defer: -2}", "queue.model_swap.max_defer: "),
        ("3", "queue.model_swap: "),
    ] {
        let errors = problems(&with_host(&format!("queue:\n  model_swap: {yaml}\n")), &[]);
        assert_eq!(errors.len(), 1, "{yaml}: {errors:?}");
        assert!(errors[0].starts_with(path), "{yaml}: {errors:?}");
    }
}

#[test]
fn key_budgets() {
    let loaded = load(&with_host(
        "auth:\n  keys:\n    \
         - {key: k1, client_id: a, budget: {gpu_seconds: 2h, tokens: 2000000, window: 1d}}\n    \
         - {key: k2, client_id: b, budget: {tokens: 500, window: 7D}}\n    \
         - {key: k3, client_id: c}\n    \
         - {key: k4, client_id: d, budget: {usd: 5.25, window: 30d}}\n",
    ));
    let keys = &loaded.config.auth.keys;
    assert_eq!(
        keys[3].budget,
        Some(Budget {
            gpu_ns: 0,
            tokens: 0,
            usd_micros: 5_250_000,
            window: BudgetWindow::Days30
        })
    );
    assert_eq!(
        keys[0].budget,
        Some(Budget {
            gpu_ns: 7_200_000_000_000,
            tokens: 2_000_000,
            usd_micros: 0,
            window: BudgetWindow::Day
        })
    );
    let week = keys[1].budget.unwrap();
    assert_eq!(
        (week.gpu_ns, week.tokens, week.window),
        (0, 500, BudgetWindow::Week)
    );
    assert_eq!(week.window.seconds(), 604_800);
    assert_eq!(week.window.anchor_unix_s(), 345_600, "a Monday");
    assert_eq!(keys[2].budget, None);

    let errors = problems_of(&with_host(
        "auth:\n  keys:\n    \
         - {key: k1, client_id: a, budget: {gpu_seconds: 60, window: 2d}}\n    \
         - {key: k2, client_id: b, budget: {window: 1h}}\n    \
         - {key: k3, client_id: c, budget: {gpu_seconds: 0, window: 1h}}\n    \
         - {key: k4, client_id: d, budget: {tokens: -5, window: 1h}}\n    \
         - {key: k5, client_id: e, budget: {tokens: 5}}\n    \
         - {key: k6, client_id: f, budget: {usd: -1, window: 1h}}\n",
    ));
    assert_eq!(
        errors,
        [
            "auth.keys[client_id=a].budget.window must be one of 1h, 1d, 7d, 30d, got '2d'",
            "auth.keys[client_id=b].budget sets none of gpu_seconds, tokens and usd; set one or more, or remove it",
            "auth.keys[client_id=c].budget.gpu_seconds must be > 0",
            "auth.keys[client_id=d].budget.tokens must be a positive integer, got -5",
            "auth.keys[client_id=e].budget.window is required (one of 1h, 1d, 7d, 30d)",
            "auth.keys[client_id=f].budget.usd must be a positive amount of USD (at most 1e9), got -1",
        ]
    );
    // A misspelt budget field is reported with its path.
    let warnings = load(&with_host(
        "auth:\n  keys:\n    - {key: k1, client_id: a, budget: {gpu_second: 60, tokens: 5, window: 1h}}\n",
    ))
    .warnings;
    assert!(
        warnings.iter().any(|w| w.contains("budget.gpu_second")),
        "{warnings:?}"
    );
}

#[test]
fn key_models_and_users() {
    let loaded = load(&with_host(
        "auth:\n  keys:\n    \
         - {key: k1, client_id: students, models: ['llama3.2*', ' qwen3:* ']}\n    \
         - {key: k2, client_id: webui, users: {header: X-OpenWebUI-User-Id, max_concurrent: 1, \
         max_queued: 20, budget: {tokens: 2000000, window: 1d}, session_header: X-OpenWebUI-Chat-Id}}\n    \
         - {key: k3, client_id: librechat, users: {body_field: metadata.user_id}}\n",
    ));
    let keys = &loaded.config.auth.keys;
    assert_eq!(keys[0].models, ["llama3.2*", "qwen3:*"]);
    assert!(keys[0].users.is_none());
    let users = keys[1].users.clone().unwrap();
    assert_eq!(
        users.source,
        UserSource::Header("X-OpenWebUI-User-Id".into())
    );
    assert_eq!((users.max_concurrent, users.max_queued), (1, 20));
    assert_eq!(users.budget.unwrap().tokens, 2_000_000);
    assert_eq!(users.session_header.as_deref(), Some("X-OpenWebUI-Chat-Id"));
    assert!(keys[1].models.is_empty(), "no list: every model");
    assert_eq!(
        keys[2].users.clone().unwrap().source,
        UserSource::BodyField("metadata.user_id".into())
    );

    let errors = problems_of(&with_host(
        "auth:\n  keys:\n    \
         - {key: k1, client_id: a, models: []}\n    \
         - {key: k2, client_id: b, models: ['llama 3']}\n    \
         - {key: k3, client_id: c, users: {header: X-User, body_field: user}}\n    \
         - {key: k4, client_id: d, users: {max_concurrent: 1}}\n    \
         - {key: k5, client_id: e, users: {header: 'bad header'}}\n    \
         - {key: k6, client_id: f, users: {body_field: 'metadata..id'}}\n    \
         - {key: k7, client_id: g/h}\n",
    ));
    assert_eq!(
        errors,
        [
            "auth.keys[client_id=a].models is empty: the key could use no model; list some, or remove models to allow every model",
            "auth.keys[client_id=b].models[0] 'llama 3' is not a model name pattern (at most 256 characters, no spaces)",
            "auth.keys[client_id=c].users: set header or body_field, not both",
            "auth.keys[client_id=d].users: set header (e.g. X-OpenWebUI-User-Id), body_field (e.g. user) or jwt to say where the app names its user",
            "auth.keys[client_id=e].users.header 'bad header' is not a header name",
            "auth.keys[client_id=f].users.body_field 'metadata..id' is not a path of keys (e.g. user, metadata.user_id)",
            "auth.keys[6].client_id 'g/h' must not contain '/' (it separates an app key's users: <client_id>/<user>)",
        ]
    );
}

#[test]
fn the_readme_jwt_example_loads() {
    let readme = include_str!("../../../README.md");
    let section = &readme[readme.find("## JWT users").unwrap()..];
    let block = &section[section.find("```yaml\n").unwrap() + 8..];
    let block = &block[..block.find("```").unwrap()];
    let loaded = load_with(&with_host(block), &[("PORTAL_KEY", "sk-portal")]).unwrap();
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    let keys = &loaded.config.auth.keys;
    assert_eq!(keys.len(), 2);
    assert!(keys[0].key.is_none() && keys[1].key.is_some());
}

#[test]
fn jwt_keys_and_users() {
    let loaded = load(&with_host(
        "auth:\n  keys:\n    \
         - {client_id: people, jwt: {issuer: 'https://idp', audiences: [oqp], jwks_url: \
         'https://idp/jwks', algorithms: [es256]}, users: {max_concurrent: 2}}\n    \
         - {key: k2, client_id: app, users: {jwt: {issuer: 'https://idp', audiences: [oqp], \
         jwks_file: /etc/oqp/jwks.json, header: X-User-Token, user_claim: email}}}\n",
    ));
    let keys = &loaded.config.auth.keys;
    assert!(keys[0].key.is_none(), "the token is the credential");
    let users = keys[0].users.clone().unwrap();
    assert_eq!(users.max_concurrent, 2);
    let UserSource::Jwt(jwt) = users.source else {
        panic!("{users:?}")
    };
    assert_eq!(jwt.header, "Authorization");
    assert_eq!(jwt.user_claim, "sub");
    assert_eq!(jwt.algorithms, ["ES256"]);
    assert_eq!(jwt.refresh_min_interval, std::time::Duration::from_secs(60));
    assert_eq!(
        jwt.jwks,
        crate::config::JwksSource::Url("https://idp/jwks".into())
    );
    let UserSource::Jwt(jwt) = keys[1].users.clone().unwrap().source else {
        panic!()
    };
    assert_eq!(
        (jwt.header.as_str(), jwt.user_claim.as_str()),
        ("X-User-Token", "email")
    );
    assert_eq!(jwt.algorithms, ["RS256", "ES256", "EdDSA"]);

    let errors = problems_of(&with_host(
        "auth:\n  keys:\n    \
         - {client_id: a, key: k1, jwt: {issuer: i, audiences: [x], jwks_file: f}}\n    \
         - {client_id: b, jwt: {issuer: i, audiences: [x], jwks_file: f, algorithms: [HS256]}}\n    \
         - {client_id: c, jwt: {jwks_url: 'ftp://idp/keys'}}\n    \
         - {key: k4, client_id: d, users: {jwt: {issuer: i, audiences: [x], jwks_file: f}}}\n    \
         - {key: k5, client_id: e, users: {jwt: {issuer: i, audiences: [x], jwks_file: f, \
         header: Authorization}}}\n    \
         - {client_id: f, jwt: {issuer: i, audiences: [x], jwks_file: f}, users: {header: X-U}}\n",
    ));
    assert_eq!(
        errors,
        [
            "auth.keys[client_id=a]: set jwt or a key (key, key_env, key_file), not both; an app that authenticates with its key and names each user with a token sets users.jwt",
            "auth.keys[client_id=b].jwt.algorithms: 'HS256' is not accepted (one of RS256, RS384, RS512, PS256, PS384, PS512, ES256, ES384, EdDSA; none and HS* never are: a token's signature must come from the issuer's private key)",
            "auth.keys[client_id=c].jwt.issuer is required: the iss of the tokens (e.g. https://login.example.com/realms/main)",
            "auth.keys[client_id=c].jwt.audiences is required: the aud values a token may carry (the client id the identity provider issued the tokens for)",
            "auth.keys[client_id=c].jwt.jwks_url 'ftp://idp/keys' is not an http or https URL",
            "auth.keys[client_id=d].users.jwt.header is required: the header the app sends each user's token in (e.g. X-User-Token)",
            "auth.keys[client_id=e].users.jwt.header: Authorization carries the app's key; name another header for the user's token (e.g. X-User-Token)",
            "auth.keys[client_id=f].users: the key's own jwt names each user; remove users.header",
        ]
    );
}

#[test]
fn routing_affinity_reads_its_keys_and_names_a_bad_value() {
    let loaded = load(&with_host(
        "routing:\n  affinity:\n    enabled: false\n    session_header: X-Session-Id\n    epsilon: 0.5\n    \
         share_across_keys: true\n    ram_cache_per_runner: 2\n    prefill_ms_per_1k: 100\n    max_conversations: 500\n",
    ));
    let affinity = &loaded.config.routing.affinity;
    assert!(!affinity.enabled);
    assert_eq!(affinity.session_header.as_deref(), Some("X-Session-Id"));
    assert_eq!(affinity.epsilon, 0.5);
    assert!(affinity.share_across_keys);
    assert_eq!(affinity.ram_cache_per_runner, 2);
    assert_eq!(affinity.prefill_ms_per_1k, 100.0);
    assert_eq!(affinity.max_conversations, 500);
    assert_eq!(
        load(ONE_HOST).config.routing.affinity,
        AffinityConfig::default()
    );
    let errors = problems_of(&with_host(
        "routing:\n  affinity:\n    epsilon: -1\n    session_header: \"bad header\"\n    max_conversations: 0\n",
    ));
    assert_eq!(errors.len(), 3, "{errors:?}");
    assert!(
        errors
            .iter()
            .any(|e| e.starts_with("routing.affinity.epsilon must be")),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.contains("routing.affinity.session_header 'bad header'")),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.starts_with("routing.affinity.max_conversations must be")),
        "{errors:?}"
    );
}

#[test]
fn listener_tls_files() {
    let loaded = load(&with_host(
        "proxy:\n  tls:\n    cert_file: /etc/oqp/cert.pem\n    key_file: /etc/oqp/key.pem\n",
    ));
    let tls = loaded.config.proxy.tls.expect("proxy.tls");
    assert_eq!(tls.cert_file, std::path::PathBuf::from("/etc/oqp/cert.pem"));
    assert_eq!(tls.key_file, std::path::PathBuf::from("/etc/oqp/key.pem"));
    assert_eq!(load(ONE_HOST).config.proxy.tls, None);

    let errors = problems(
        &with_host("proxy:\n  tls:\n    cert_file: cert.pem\n    key_file: /k.pem\n"),
        &[],
    );
    assert!(
        errors[0].starts_with("proxy.tls.cert_file: 'cert.pem' is not an absolute path"),
        "{errors:?}"
    );
    let errors = problems(&with_host("proxy:\n  tls:\n    cert_file: /c.pem\n"), &[]);
    assert!(
        errors[0].starts_with("proxy.tls needs cert_file and key_file"),
        "{errors:?}"
    );
    let listener = load(&with_host(
        "auth:\n  keys:\n    - key: \"sk-embedder-0123456789\"\n      client_id: embedder\n\
         client_injection:\n  listeners:\n    - listen_port: 11436\n      inject_as: embedder\n      \
         tls: {cert_file: /c.pem, key_file: /k.pem}\n",
    ));
    let tls = listener.config.client_injection.listeners[0].tls.clone();
    assert_eq!(
        tls.map(|tls| tls.key_file),
        Some(std::path::PathBuf::from("/k.pem"))
    );
}

#[test]
fn client_certificates_name_clients_by_subject() {
    let loaded = load(&with_host(
        "proxy:\n  tls: {cert_file: /c.pem, key_file: /k.pem, client_ca_file: /ca.pem}\n\
         auth:\n  keys:\n    - {client_id: backup, tls_subject: svc-backup}\n",
    ));
    let tls = loaded.config.proxy.tls.expect("proxy.tls");
    assert_eq!(
        tls.client_ca_file,
        Some(std::path::PathBuf::from("/ca.pem"))
    );
    let key = &loaded.config.auth.keys[0];
    assert_eq!(key.tls_subject.as_deref(), Some("svc-backup"));
    assert!(key.key.is_none());

    let errors = problems_of(&with_host(
        "proxy:\n  tls: {cert_file: /c.pem, key_file: /k.pem, client_ca_file: ca.pem}\n\
         auth:\n  keys:\n    - {client_id: a, tls_subject: svc, key: k1}\n    \
         - {client_id: b, tls_subject: svc}\n",
    ));
    assert_eq!(
        errors,
        [
            "proxy.tls.client_ca_file: 'ca.pem' is not an absolute path (the data plane reads it on its own box)",
            "auth.keys[client_id=a]: set tls_subject or a key (key, key_env, key_file), not both",
        ]
    );
    let errors = problems_of(&with_host(
        "auth:\n  keys:\n    - {client_id: a, tls_subject: svc}\n    - {client_id: b, tls_subject: svc}\n",
    ));
    assert_eq!(
        errors,
        [
            "auth.keys: client_id='a' and client_id='b' name the same tls_subject 'svc'; a certificate identifies one client"
        ]
    );
}

#[test]
fn audit_rotation_is_configured_within_bounds() {
    let config = load(&with_host(
        "control_plane: {audit: {max_file_mb: 2, keep_files: 0}}\n",
    ))
    .config;
    assert_eq!(
        config.control_plane.audit,
        crate::config::AuditConfig {
            max_file_mb: 2,
            keep_files: 0
        }
    );
    assert_eq!(
        load(&with_host("")).config.control_plane.audit,
        crate::config::AuditConfig::default()
    );
    let errors = problems(
        &with_host("control_plane: {audit: {max_file_mb: 0, keep_files: 101}}\n"),
        &[],
    );
    assert!(
        errors
            .iter()
            .any(|e| e.contains("control_plane.audit.max_file_mb must be 1 to 1024, got 0")),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.contains("control_plane.audit.keep_files must be 0 to 100, got 101")),
        "{errors:?}"
    );
}

#[test]
fn the_dashboard_is_on_by_default_only_where_the_proxy_listens_on_loopback() {
    let enabled = |rest: &str| load(&with_host(rest)).config.dashboard.enabled;
    assert!(enabled(""));
    assert!(enabled("proxy:\n  host: \"::1\"\n"));
    assert!(enabled("proxy:\n  host: localhost\n"));
    assert!(!enabled("proxy:\n  host: 0.0.0.0\n"));
    assert!(!enabled("proxy:\n  host: 192.168.1.10\n"));
    // One node listening outward is enough to keep it off by default.
    assert!(!enabled("nodes:\n  box1:\n    host: 0.0.0.0\n"));
    assert!(enabled("nodes:\n  box1:\n    host: 127.0.0.1\n"));
    // Stated, it is what it says.
    assert!(enabled(
        "proxy:\n  host: 0.0.0.0\ndashboard:\n  enabled: true\n"
    ));
    assert!(!enabled("dashboard:\n  enabled: false\n"));
}

#[test]
fn per_minute_limits_on_keys_users_and_by_default() {
    let loaded = load(&with_host(
        "auth:\n  default_rate_limit: {requests_per_minute: 60}\n  keys:\n    \
         - {key: k1, client_id: a, rate_limit: {requests_per_minute: 10, tokens_per_minute: 20000}}\n    \
         - {key: k2, client_id: b}\n    \
         - {key: k3, client_id: c, rate_limit: {requests_per_minute: 0, tokens_per_minute: 0}}\n    \
         - key: k4\n      client_id: webui\n      users: {header: X-User, rate_limit: {tokens_per_minute: 5000}}\n",
    ));
    let auth = &loaded.config.auth;
    let limit = |requests_per_minute, tokens_per_minute| MinuteLimit {
        requests_per_minute,
        tokens_per_minute,
    };
    assert_eq!(auth.default_rate_limit, Some(limit(60, 0)));
    assert_eq!(auth.keys[0].rate_limit, Some(limit(10, 20_000)));
    assert_eq!(auth.keys[1].rate_limit, None);
    assert_eq!(auth.keys[2].rate_limit, Some(limit(0, 0)));
    assert_eq!(auth.keys[3].rate_limit, None);
    assert_eq!(
        auth.keys[3].users.as_ref().unwrap().rate_limit,
        Some(limit(0, 5000))
    );
    // The snapshot carries each key's own limit, else the default's (an explicit zero opts
    // out); a stored key takes the default too.
    let stored = oqp_proto::policy::v1::Client {
        client_id: "stored".into(),
        ..Default::default()
    };
    let snapshot = crate::compile::snapshot(
        &loaded.config,
        &Default::default(),
        &Default::default(),
        &[stored],
        1,
    );
    let of = |id: &str| {
        let client = snapshot.clients.iter().find(|c| c.client_id == id).unwrap();
        client
            .rate_limit
            .map(|limit| (limit.requests_per_minute, limit.tokens_per_minute))
    };
    assert_eq!(of("a"), Some((10, 20_000)));
    assert_eq!(of("b"), Some((60, 0)));
    assert_eq!(of("c"), Some((0, 0)));
    assert_eq!(of("webui"), Some((60, 0)));
    assert_eq!(of("stored"), Some((60, 0)));
    let users = snapshot.clients.iter().find(|c| c.client_id == "webui");
    let users = users.unwrap().users.as_ref().unwrap();
    assert_eq!(users.rate_limit.unwrap().tokens_per_minute, 5000);

    let errors = problems_of(&with_host(
        "auth:\n  keys:\n    \
         - {key: k1, client_id: a, rate_limit: {}}\n    \
         - {key: k2, client_id: b, rate_limit: {tokens_per_minute: -5}}\n    \
         - {key: k3, client_id: c, rate_limit: {requests_per_minute: 2000000}}\n    \
         - {key: k4, client_id: d, users: {header: X-User, rate_limit: {requests_per_minute: -2}}}\n",
    ));
    assert_eq!(
        errors,
        [
            "auth.keys[client_id=a].rate_limit sets neither requests_per_minute nor tokens_per_minute; set one or both (0 = no limit of that kind), or remove it",
            "auth.keys[client_id=b].rate_limit.tokens_per_minute must be an integer from 0 (no limit) to 1000000000000, got -5",
            "auth.keys[client_id=c].rate_limit.requests_per_minute must be an integer from 0 (no limit) to 1000000, got 2000000",
            "auth.keys[client_id=d].users.rate_limit.requests_per_minute must be an integer from 0 (no limit) to 1000000, got -2",
        ]
    );
    let errors = problems_of(&with_host(
        "auth:\n  default_rate_limit: {requests_per_minute: -1}\n  keys:\n    - {key: k1, client_id: a}\n",
    ));
    assert_eq!(
        errors,
        [
            "auth.default_rate_limit.requests_per_minute must be an integer from 0 (no limit) to 1000000, got -1"
        ]
    );
}

#[test]
fn the_request_log_is_off_unless_it_names_a_file() {
    assert_eq!(load(&with_host("")).config.logging.requests, None);
    let loaded = load(&with_host(
        "logging:\n  requests: {file: /var/log/oqp/requests.jsonl, retention_days: 7}\n",
    ));
    assert_eq!(
        loaded.config.logging.requests,
        Some(RequestLogConfig {
            file: "/var/log/oqp/requests.jsonl".into(),
            retention_days: 7
        })
    );
    let defaulted = load(&with_host("logging:\n  requests: {file: requests.jsonl}\n"));
    assert_eq!(
        defaulted.config.logging.requests.unwrap().retention_days,
        RequestLogConfig::DEFAULT_RETENTION_DAYS
    );
    assert_eq!(
        problems_of(&with_host("logging:\n  requests: {retention_days: 7}\n")),
        [
            "logging.requests.file is required (the request log's path, e.g. /var/log/oqp/requests.jsonl); remove logging.requests to turn the log off"
        ]
    );
    assert_eq!(
        problems_of(&with_host(
            "logging:\n  requests: {file: r.jsonl, retention_days: 0}\n"
        )),
        ["logging.requests.retention_days must be between 1 and 3650, got 0"]
    );
}

#[test]
fn capture_is_a_keys_setting_bounded_and_only_with_a_request_log() {
    let loaded = load(&with_host(
        "logging:\n  requests: {file: /tmp/oqp-requests.jsonl}\nauth:\n  keys:\n    \
         - {key: k1, client_id: a, capture: {max_bytes: 4096}}\n    \
         - {key: k2, client_id: b}\n    \
         - key: k3\n      client_id: webui\n      users: {header: X-User}\n      capture: {max_bytes: 1048576}\n",
    ));
    let keys = &loaded.config.auth.keys;
    assert_eq!(keys[0].capture, Some(4096));
    assert_eq!(keys[1].capture, None);
    assert_eq!(keys[2].capture, Some(1_048_576));
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    let snapshot = crate::compile::snapshot(
        &loaded.config,
        &Default::default(),
        &Default::default(),
        &[],
        1,
    );
    let of = |id: &str| {
        let client = snapshot.clients.iter().find(|c| c.client_id == id);
        client.unwrap().capture_max_bytes
    };
    assert_eq!((of("a"), of("b"), of("webui")), (4096, 0, 1_048_576));

    // Without the request log there is nowhere to write it: said, not refused.
    let loaded = load(&with_host(
        "auth:\n  keys:\n    - {key: k1, client_id: a, capture: {max_bytes: 10}}\n",
    ));
    assert_eq!(
        loaded.warnings,
        ["auth.keys[client_id=a].capture is set, but logging.requests is off: nothing is captured"]
    );
    // A user's capture is the app key's: `users.capture` is not a setting.
    let loaded = load(&with_host(
        "logging:\n  requests: {file: /tmp/oqp-requests.jsonl}\nauth:\n  keys:\n    \
         - {key: k1, client_id: a, users: {header: X-User, capture: {max_bytes: 10}}}\n",
    ));
    assert_eq!(
        loaded.warnings,
        ["unknown key 'auth.keys[0].users.capture' (ignored)"]
    );

    let errors = problems_of(&with_host(
        "auth:\n  keys:\n    \
         - {key: k1, client_id: a, capture: {}}\n    \
         - {key: k2, client_id: b, capture: {max_bytes: 0}}\n    \
         - {key: k3, client_id: c, capture: {max_bytes: 1048577}}\n",
    ));
    assert_eq!(
        errors,
        [
            "auth.keys[client_id=a].capture sets no max_bytes; set how many bytes of each request and answer the request log keeps (1 to 1048576), or remove it",
            "auth.keys[client_id=b].capture.max_bytes must be an integer from 1 to 1048576, got 0",
            "auth.keys[client_id=c].capture.max_bytes must be an integer from 1 to 1048576, got 1048577",
        ]
    );
}

#[test]
fn claims_to_policy_lists_values_each_selecting_a_ceiling_and_models() {
    let jwt = |claims_to_policy: &str| {
        with_host(&format!(
            "auth:\n  keys:\n    - client_id: people\n      jwt:\n        issuer: https://idp.example\n        \
             audiences: [oqp]\n        jwks_file: /etc/oqp/jwks.json\n        claims_to_policy: {claims_to_policy}\n"
        ))
    };
    let loaded = load(&jwt(
        "{claim: groups, policies: [{value: admins, max_priority: high}, \
         {value: interns, max_priority: low, models: [\"qwen3*\"]}]}",
    ));
    let Some(UserSource::Jwt(config)) = loaded.config.auth.keys[0]
        .users
        .as_ref()
        .map(|users| users.source.clone())
    else {
        panic!("a token-keyed entry");
    };
    let claims = config.claims_to_policy.unwrap();
    assert_eq!(claims.claim, "groups");
    assert_eq!(claims.policies[0].value, "admins");
    assert_eq!(claims.policies[0].max_priority, Some(Tier::High));
    assert!(claims.policies[0].models.is_empty());
    assert_eq!(claims.policies[1].max_priority, Some(Tier::Low));
    assert_eq!(claims.policies[1].models, ["qwen3*"]);
    let snapshot = crate::compile::snapshot(
        &loaded.config,
        &Default::default(),
        &Default::default(),
        &[],
        1,
    );
    let wire = snapshot.clients[0]
        .users
        .as_ref()
        .unwrap()
        .jwt
        .as_ref()
        .unwrap();
    let wire = wire.claims_to_policy.as_ref().unwrap();
    assert_eq!(wire.claim, "groups");
    assert_eq!(
        wire.policies[1].max_priority,
        oqp_proto::policy::v1::Tier::Low as i32
    );

    let errors = problems_of(&jwt(
        "{policies: [{value: admins, max_priority: highest}, {value: admins, max_priority: low}, \
         {max_priority: low}, {value: staff}]}",
    ));
    let at = "auth.keys[client_id=people].jwt.claims_to_policy";
    for expected in [
        format!("{at}.claim is required"),
        format!("{at}.policies[0].max_priority"),
        format!("{at}.policies[1].value 'admins' is listed twice"),
        format!("{at}.policies[2].value is required"),
        format!("{at}.policies[3] selects nothing"),
    ] {
        assert!(
            errors.iter().any(|error| error.starts_with(&expected)),
            "{expected}: {errors:?}"
        );
    }

    // A budget replaces users.budget over its window: it needs one, and the same window.
    let budget = "{claim: groups, policies: [{value: interns, budget: {tokens: 10, window: 1d}}]}";
    let with_users = |users: &str| format!("{}      users: {users}\n", jwt(budget));
    let loaded = load(&with_users("{budget: {tokens: 1000, window: 1d}}"));
    let users = loaded.config.auth.keys[0].users.as_ref().unwrap();
    let UserSource::Jwt(config) = &users.source else {
        panic!("a token-keyed entry");
    };
    let policy = &config.claims_to_policy.as_ref().unwrap().policies[0];
    assert_eq!(policy.budget.as_ref().unwrap().tokens, 10);
    assert_eq!(
        problems_of(&jwt(budget)),
        [format!(
            "{at}.policies[0].budget needs users.budget: the window a user's usage is summed \
             over, and the budget of users in no listed group"
        )]
    );
    assert_eq!(
        problems_of(&with_users("{budget: {tokens: 1000, window: 7d}}")),
        [format!(
            "{at}.policies[0].budget.window must be users.budget's (7d): a user's usage is \
             summed over that window"
        )]
    );
}
