use super::*;
use crate::config::{self, Env};

fn config(yaml: &str) -> Config {
    config::load_str(yaml, &Env::empty()).unwrap().config
}

const TWO_HOSTS: &str = "ollama:\n  hosts:\n    \
    - {url: \"http://gpu:11434\", name: gpu, model_sync_interval: 5}\n    \
    - {url: \"https://ollama.com\", name: cloud, api_keys: [{key: ck-first}, {key: ck-second}]}\n\
    routing:\n  model_poll_timeout: 2\n\
    webhooks:\n  enabled: true\n  url: \"https://hooks.example.com/h\"\n";

#[test]
fn targets_follow_the_config() {
    let targets = Target::all(&config(TWO_HOSTS));
    let [gpu, cloud] = &targets[..] else {
        panic!("{targets:?}")
    };
    assert_eq!(gpu.name(), "gpu");
    assert_eq!(gpu.url, "http://gpu:11434");
    assert_eq!(gpu.bearer, None);
    assert_eq!(gpu.interval, Duration::from_secs(5));
    assert_eq!(gpu.timeout, Duration::from_secs(2));
    assert_eq!(cloud.kind, HostKind::Cloud);
    assert_eq!(cloud.bearer.as_ref().map(Secret::expose), Some("ck-first"));
    let printed = format!("{cloud:?}");
    assert!(
        !printed.contains("ck-first") && !printed.contains("ollama.com"),
        "{printed}"
    );
}

#[test]
fn only_a_new_server_invalidates_what_was_learned() {
    let targets = Target::all(&config(TWO_HOSTS));
    let gpu = &targets[0];
    let slower = Target {
        interval: Duration::from_secs(60),
        ..gpu.clone()
    };
    assert!(gpu.same_upstream(&slower));
    assert_ne!(gpu, &slower);
    let moved = Target {
        url: "http://gpu2:11434".to_owned(),
        ..gpu.clone()
    };
    assert!(!gpu.same_upstream(&moved));
}

fn up(models: &[&str]) -> Observation {
    Observation {
        tags: Ok(models.iter().map(|m| ((*m).to_owned(), 1)).collect()),
        ps: Some(Vec::new()),
        shown: None,
        learned: Default::default(),
    }
}

fn down() -> Observation {
    Observation {
        tags: Err("connection refused".to_owned()),
        ps: None,
        shown: None,
        learned: Default::default(),
    }
}

#[test]
fn transitions_emit_webhooks_but_the_first_poll_does_not() {
    let hub = Hub::new(config(TWO_HOSTS));
    let target = Target::all(&hub.config())[0].clone();
    let queued = || hub.webhooks().stats().queued;
    let mut known = None;

    record(&hub, &target, &mut known, &down());
    assert_eq!((known, queued()), (Some(false), 0), "first poll is silent");
    assert!(!hub.current().hosts[0].healthy);

    record(&hub, &target, &mut known, &up(&["a"]));
    assert_eq!((known, queued()), (Some(true), 1), "host.recovered");
    assert!(hub.current().hosts[0].healthy);
    assert_eq!(hub.current().hosts[0].installed_models, ["a"]);

    let version = hub.current().version;
    record(&hub, &target, &mut known, &up(&["a"]));
    assert_eq!(queued(), 1, "no event without a transition");
    assert_eq!(
        hub.current().version,
        version,
        "nothing changed, nothing published"
    );

    record(&hub, &target, &mut known, &down());
    assert_eq!((known, queued()), (Some(false), 2), "host.unhealthy");
    record(&hub, &target, &mut known, &down());
    assert_eq!(queued(), 2);
    // The model list survives the outage.
    assert_eq!(hub.current().hosts[0].installed_models, ["a"]);
}

#[test]
fn a_healthy_first_poll_is_silent_too() {
    let hub = Hub::new(config(TWO_HOSTS));
    let target = Target::all(&hub.config())[0].clone();
    let mut known = None;
    record(&hub, &target, &mut known, &up(&[]));
    assert_eq!(hub.webhooks().stats().queued, 0);
    assert_eq!(known, Some(true));
}
