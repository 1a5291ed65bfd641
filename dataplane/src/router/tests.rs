use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant, SystemTime};

use serde_json::json;

use super::*;

struct Spec {
    name: &'static str,
    weight: u32,
    slots: u32,
    installed: &'static [&'static str],
    loaded: &'static [&'static str],
    healthy: bool,
    checked: u64,
    kind: HostKind,
}

fn spec(name: &'static str) -> Spec {
    Spec {
        name,
        weight: 1,
        slots: 100,
        installed: &[],
        loaded: &[],
        healthy: true,
        checked: 1,
        kind: HostKind::Ollama,
    }
}

impl Spec {
    fn weight(mut self, weight: u32) -> Self {
        self.weight = weight;
        self
    }
    fn slots(mut self, slots: u32) -> Self {
        self.slots = slots;
        self
    }
    fn installed(mut self, models: &'static [&'static str]) -> Self {
        self.installed = models;
        self
    }
    fn loaded(mut self, models: &'static [&'static str]) -> Self {
        self.loaded = models;
        self
    }
    fn unhealthy(mut self) -> Self {
        self.healthy = false;
        self
    }
    fn checked(mut self, checked: u64) -> Self {
        self.checked = checked;
        self
    }
    fn cloud(mut self) -> Self {
        self.kind = HostKind::Cloud;
        self
    }
    fn engine(mut self) -> Self {
        self.kind = HostKind::Openai;
        self
    }
    fn build(self) -> Arc<Host> {
        let url = format!("http://{}:11434", self.name);
        let uri: http::Uri = url.parse().unwrap();
        let set = |models: &[&str]| models.iter().map(|m| normalize_model(m)).collect();
        Arc::new(Host {
            runners: Default::default(),
            engine: Default::default(),
            name: self.name.into(),
            url,
            scheme: uri.scheme().unwrap().clone(),
            authority: uri.authority().unwrap().clone(),
            weight: self.weight,
            max_concurrent: self.slots,
            kind: self.kind,
            healthy: self.healthy,
            installed: set(self.installed),
            loaded: set(self.loaded),
            installed_names: Vec::new(),
            loaded_names: Vec::new(),
            last_checked: Some(SystemTime::UNIX_EPOCH + Duration::from_secs(self.checked)),
            cloud_keys: Vec::new(),
            cloud_accounts: Vec::new(),
            fallback_models: Vec::new(),
            owner: None,
            vram: Default::default(),
        })
    }
}

fn fleet(specs: Vec<Spec>) -> Router {
    let mut router = Router::default();
    router.update_hosts(&hosts(specs));
    router
}

fn hosts(specs: Vec<Spec>) -> Vec<Arc<Host>> {
    specs.into_iter().map(Spec::build).collect()
}

/// Places and releases at once; returns the host name and reason.
fn pick(router: &mut Router, model: Option<&str>) -> (String, RouteReason) {
    let placement = router.place(model, Strategy::ModelAware).expect("a host");
    (placement.host.name.to_string(), placement.reason)
}

fn names(router: &mut Router, model: Option<&str>, count: usize) -> String {
    (0..count).map(|_| pick(router, model).0).collect()
}

#[test]
fn weights_two_to_one_interleave_exactly() {
    let mut router = fleet(vec![spec("A").weight(2), spec("B")]);
    let sequence = names(&mut router, None, 30);
    assert_eq!(sequence, "ABA".repeat(10));
    assert_eq!(sequence.matches('A').count(), 20);
    assert!(!sequence.contains("BB"));
    // Every window of three picks holds exactly two A.
    let bytes = sequence.as_bytes();
    assert!(
        bytes
            .windows(3)
            .all(|w| w.iter().filter(|&&c| c == b'A').count() == 2)
    );
    assert_eq!(router.decisions().round_robin, 30);
}

#[test]
fn weights_five_one_one_are_smooth() {
    let mut router = fleet(vec![spec("A").weight(5), spec("B"), spec("C")]);
    // nginx's documented sequence for 5:1:1.
    assert_eq!(names(&mut router, None, 7), "AABACAA");
}

#[test]
fn loaded_beats_installed_beats_fallback() {
    let mut router = fleet(vec![
        spec("A").installed(&["llama3"]),
        spec("B").installed(&["llama3"]).loaded(&["llama3"]),
        spec("C"),
    ]);
    for _ in 0..5 {
        assert_eq!(
            pick(&mut router, Some("llama3")),
            ("B".into(), RouteReason::Loaded)
        );
    }
    // Nobody has qwen3: fallback over all three, round-robin.
    assert_eq!(
        pick(&mut router, Some("qwen3")),
        ("A".into(), RouteReason::Fallback)
    );
    let mut router = fleet(vec![spec("A").installed(&["llama3"]), spec("B").weight(9)]);
    assert_eq!(
        pick(&mut router, Some("llama3")),
        ("A".into(), RouteReason::Installed)
    );
    let decisions = router.decisions();
    assert_eq!(decisions.installed, 1);
    assert_eq!(RouteReason::Installed.metric_label(), "model_match");
    assert_eq!(RouteReason::Loaded.metric_label(), "model_match");
}

#[test]
fn model_names_compare_like_ollama() {
    let mut router = fleet(vec![spec("A"), spec("B").installed(&["Llama3:latest"])]);
    assert_eq!(pick(&mut router, Some("llama3")).0, "B");
    assert_eq!(pick(&mut router, Some("LLAMA3:latest")).0, "B");
    let mut router = fleet(vec![
        spec("A"),
        spec("cloud").cloud().installed(&["gpt-oss:120b"]),
    ]);
    assert_eq!(
        pick(&mut router, Some("gpt-oss:120b-cloud")),
        ("cloud".into(), RouteReason::Installed)
    );
    assert_eq!(pick(&mut router, Some("gpt-oss:120b:cloud")).0, "cloud");
    assert_eq!(
        strip_cloud_suffix("qwen3-coder:480b-cloud"),
        "qwen3-coder:480b"
    );
    assert_eq!(strip_cloud_suffix("gpt-oss:120b:CLOUD"), "gpt-oss:120b");
    assert_eq!(strip_cloud_suffix("-cloud"), "-cloud");
}

#[test]
fn fallback_spreads_by_weight_when_nobody_has_the_model() {
    let mut router = fleet(vec![spec("A").weight(2), spec("B")]);
    assert_eq!(names(&mut router, Some("nowhere"), 6), "ABAABA");
    assert_eq!(router.decisions().fallback, 6);
}

#[test]
fn slot_exhaustion_refuses_and_release_frees() {
    let mut router = fleet(vec![spec("A").slots(1), spec("B").slots(1)]);
    let first = router.place(None, Strategy::RoundRobin).unwrap();
    let second = router.place(None, Strategy::RoundRobin).unwrap();
    assert_ne!(first.host.name, second.host.name);
    assert!(router.place(None, Strategy::RoundRobin).is_none());
    assert_eq!(router.slots_in_use("A") + router.slots_in_use("B"), 2);
    let freed = first.host.name.clone();
    drop(first);
    assert_eq!(router.slots_in_use(&freed), 0);
    let third = router.place(None, Strategy::RoundRobin).unwrap();
    assert_eq!(third.host.name, freed);
}

#[test]
fn a_busy_host_with_the_model_is_waited_for_not_bypassed() {
    let mut router = fleet(vec![spec("A").slots(1).installed(&["llama3"]), spec("B")]);
    let held = router.place(Some("llama3"), Strategy::ModelAware).unwrap();
    assert_eq!(&*held.host.name, "A");
    // B has a free slot but not the model: the request waits for A.
    assert!(router.place(Some("llama3"), Strategy::ModelAware).is_none());
    // A busy host with the model loaded does not stop an idle one that has it installed.
    let mut router = fleet(vec![
        spec("A")
            .slots(1)
            .loaded(&["llama3"])
            .installed(&["llama3"]),
        spec("B").installed(&["llama3"]),
    ]);
    let held = router.place(Some("llama3"), Strategy::ModelAware).unwrap();
    assert_eq!(held.reason, RouteReason::Loaded);
    assert_eq!(
        pick(&mut router, Some("llama3")),
        ("B".into(), RouteReason::Installed)
    );
}

#[test]
fn release_hook_runs_when_a_slot_frees() {
    let released = Arc::new(AtomicUsize::new(0));
    let mut router = fleet(vec![spec("A")]);
    let counter = released.clone();
    router.set_release_hook(Arc::new(move || {
        counter.fetch_add(1, Ordering::SeqCst);
    }));
    let placement = router.place(None, Strategy::RoundRobin).unwrap();
    assert_eq!(released.load(Ordering::SeqCst), 0);
    placement.slot.release();
    assert_eq!(released.load(Ordering::SeqCst), 1);
}

#[test]
fn down_marks_last_until_a_newer_poll() {
    let specs = || vec![spec("A"), spec("B")];
    let mut router = fleet(specs());
    router.mark_down("A");
    assert!(router.stats()[0].marked_down);
    assert_eq!(names(&mut router, None, 4), "BBBB");
    // A snapshot with the same poll result (say, a key change) keeps the mark.
    router.update_hosts(&hosts(specs()));
    assert_eq!(names(&mut router, None, 2), "BB");
    // A newer poll clears it.
    router.update_hosts(&hosts(vec![spec("A").checked(2), spec("B").checked(2)]));
    assert!(names(&mut router, None, 4).contains('A'));
    assert!(!router.stats()[0].marked_down);
}

#[test]
fn no_healthy_host_means_every_host_is_a_candidate() {
    let mut router = fleet(vec![spec("A"), spec("B").unhealthy()]);
    router.mark_down("A");
    assert_eq!(names(&mut router, None, 4), "ABAB");
    // …but a full host is still never chosen.
    let mut router = fleet(vec![spec("A").slots(1).unhealthy()]);
    let _held = router.place(None, Strategy::RoundRobin).unwrap();
    assert!(router.place(None, Strategy::RoundRobin).is_none());
}

#[test]
fn a_healthy_but_busy_fleet_does_not_spill_onto_down_hosts() {
    let mut router = fleet(vec![spec("A").slots(1), spec("B").unhealthy()]);
    let _held = router.place(None, Strategy::RoundRobin).unwrap();
    assert!(router.place(None, Strategy::RoundRobin).is_none());
}

#[test]
fn a_404_forgets_the_model_until_a_newer_inventory() {
    let specs = |checked| {
        vec![
            spec("A").installed(&["llama3"]).checked(checked),
            spec("B").installed(&["llama3"]).checked(checked),
        ]
    };
    let mut router = fleet(specs(1));
    router.forget_model("A", "llama3:latest");
    assert_eq!(names(&mut router, Some("llama3"), 3), "BBB");
    assert_eq!(router.stats()[0].forgotten_models, 1);
    router.update_hosts(&hosts(specs(1)));
    assert_eq!(names(&mut router, Some("llama3"), 2), "BB");
    router.update_hosts(&hosts(specs(2)));
    assert!(names(&mut router, Some("llama3"), 4).contains('A'));
}

#[test]
fn failover_excludes_tried_hosts_and_keeps_preferences() {
    let mut router = fleet(vec![
        spec("A").installed(&["llama3"]),
        spec("B").installed(&["llama3"]),
        spec("C"),
    ]);
    let first = router.place(Some("llama3"), Strategy::ModelAware).unwrap();
    assert_eq!(&*first.host.name, "A");
    router.mark_down("A");
    let mut tried = vec![first.host.name.clone()];
    drop(first);
    let second = router
        .failover(Some("llama3"), Strategy::ModelAware, &tried)
        .unwrap();
    assert_eq!(
        (&*second.host.name, second.reason),
        ("B", RouteReason::Installed)
    );
    tried.push(second.host.name.clone());
    // Nobody untried has the model: fall back to C.
    let third = router
        .failover(Some("llama3"), Strategy::ModelAware, &tried)
        .unwrap();
    assert_eq!(
        (&*third.host.name, third.reason),
        ("C", RouteReason::Fallback)
    );
    tried.push(third.host.name.clone());
    assert!(
        router
            .failover(Some("llama3"), Strategy::ModelAware, &tried)
            .is_none()
    );
}

#[test]
fn round_robin_ignores_models() {
    let mut router = fleet(vec![spec("A").installed(&["llama3"]), spec("B")]);
    let picks: Vec<(String, RouteReason)> = (0..4)
        .map(|_| {
            let placement = router.place(Some("llama3"), Strategy::RoundRobin).unwrap();
            (placement.host.name.to_string(), placement.reason)
        })
        .collect();
    let hosts: String = picks.iter().map(|(host, _)| host.as_str()).collect();
    assert_eq!(hosts, "ABAB");
    assert!(picks.iter().all(|(_, r)| *r == RouteReason::RoundRobin));
}

#[test]
fn state_survives_snapshots_and_removed_hosts_keep_their_slots() {
    let mut router = fleet(vec![spec("A").slots(1), spec("B").slots(1)]);
    let held = router.place(None, Strategy::RoundRobin).unwrap();
    assert_eq!(&*held.host.name, "A");
    router.update_hosts(&hosts(vec![spec("B").slots(1)]));
    assert_eq!(router.stats().len(), 1);
    // A is gone from the snapshot: never chosen, but its running request still counts.
    assert_eq!(router.slots_in_use("A"), 1);
    router.update_hosts(&hosts(vec![spec("A").slots(1), spec("B").slots(1)]));
    assert_eq!(pick(&mut router, None).0, "B");
    drop(held);
    assert!(names(&mut router, None, 2).contains('A'));
}

#[test]
fn unions_dedupe_by_name_first_host_wins() {
    let a = json!({"models": [
        {"name": "llama3:latest", "model": "llama3:latest", "size": 1},
        {"name": "qwen3:8b", "model": "qwen3:8b", "size": 2},
    ]});
    let b = json!({"models": [
        {"name": "Llama3:latest", "model": "llama3:latest", "size": 99},
        {"name": "phi4:latest", "model": "phi4:latest", "size": 3},
        {"digest": "nameless"},
    ]});
    let broken = json!({"error": "boom"});
    let tags = union_tags(&[a.clone(), broken, b.clone()]);
    let listed: Vec<(&str, u64)> = tags["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["name"].as_str().unwrap(), m["size"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        listed,
        [("llama3:latest", 1), ("qwen3:8b", 2), ("phi4:latest", 3)]
    );
    assert_eq!(union_ps(&[b, a])["models"].as_array().unwrap().len(), 3);
    assert_eq!(union_tags(&[]), json!({"models": []}));
}

#[test]
fn recognises_model_not_found() {
    use http::StatusCode;
    let native = br#"{"error":"model 'x' not found"}"#;
    let openai = br#"{"error":{"message":"model \"x\" not found, try pulling it first","type":"not_found_error"}}"#;
    assert!(is_model_not_found(StatusCode::NOT_FOUND, native));
    assert!(is_model_not_found(StatusCode::NOT_FOUND, openai));
    assert!(!is_model_not_found(
        StatusCode::NOT_FOUND,
        b"404 page not found"
    ));
    assert!(!is_model_not_found(StatusCode::BAD_REQUEST, native));
}

#[test]
fn routing_decision_cost() {
    // Not a benchmark: prints the order of magnitude of one place + release.
    let specs = (0..4)
        .map(|i| {
            let name: &'static str = ["h0", "h1", "h2", "h3"][i];
            spec(name)
                .weight(i as u32 + 1)
                .installed(&["llama3", "qwen3:8b"])
        })
        .collect();
    let mut router = fleet(specs);
    let rounds = 100_000u32;
    let start = Instant::now();
    for round in 0..rounds {
        let model = if round % 2 == 0 { "llama3" } else { "qwen3:8b" };
        let placement = router.place(Some(model), Strategy::ModelAware);
        assert!(placement.is_some());
    }
    let per_decision = start.elapsed() / rounds;
    println!("routing decision (4 hosts, model_aware, place+release): {per_decision:?}");
    assert_eq!(router.decisions().installed, u64::from(rounds));
}

#[test]
fn only_models_a_host_lists_are_forgotten_so_the_set_is_bounded() {
    let mut router = fleet(vec![spec("A").installed(&["llama3"]), spec("B")]);
    for i in 0..10_000 {
        router.forget_model("A", &format!("made-up-{i}"));
    }
    router.forget_model("A", "llama3");
    assert_eq!(router.stats()[0].forgotten_models, 1);
}

/// A conversation's turn as the router reads it: `history` alternating user and assistant.
fn conversation(history: &[String]) -> crate::affinity::Chain {
    let messages: Vec<serde_json::Value> = history
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            json!({ "role": role, "content": text })
        })
        .collect();
    let body = json!({ "model": "m", "messages": messages }).to_string();
    crate::affinity::Chain::of(
        crate::affinity::Shape::OllamaChat,
        body.as_bytes(),
        "t",
        "m:latest",
        None,
    )
    .unwrap()
}

#[test]
fn a_spill_does_not_take_the_slot_a_conversation_just_answered_there_comes_back_to() {
    use crate::scheduler::Offer;
    let mut router = fleet(vec![
        spec("A").slots(1).loaded(&["m"]),
        spec("B").slots(1).loaded(&["m"]),
    ]);
    let words = |seed: usize| {
        (0..800)
            .map(|i| format!("w{}", seed * 1000 + i))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let t0 = Instant::now();
    let run = |offer: Offer<Placement>| match offer {
        Offer::Run(placement) => placement,
        _ => panic!("expected to run"),
    };
    // X's first turn on A, answered and ended; Y's first turn on B, answered, still running.
    let x = vec![words(1)];
    let placed =
        run(router.offer_for(Some("m"), Some(&conversation(&x)), Strategy::ModelAware, t0));
    assert_eq!(&*placed.host.name, "A");
    let slot = placed.affinity.unwrap().slot.unwrap();
    router.answered(slot, conversation(&x).answered("ok").unwrap(), t0);
    drop(placed);
    let y = vec![words(2)];
    let running =
        run(router.offer_for(Some("m"), Some(&conversation(&y)), Strategy::ModelAware, t0));
    assert_eq!(&*running.host.name, "B");
    let slot = running.affinity.unwrap().slot.unwrap();
    router.answered(slot, conversation(&y).answered("ok").unwrap(), t0);
    // Y's next turn: its home B is busy, A is free but X is expected back there.
    let next = vec![words(2), "ok".to_owned(), words(3)];
    let soon = t0 + Duration::from_millis(10);
    router.begin_pass();
    assert!(matches!(
        router.offer_for(
            Some("m"),
            Some(&conversation(&next)),
            Strategy::ModelAware,
            soon
        ),
        Offer::Wait
    ));
    // X did not come back within the grace: Y spills to A, re-reading there rather than
    // waiting for B.
    let late = t0 + Duration::from_secs(3);
    router.begin_pass();
    let spilled = run(router.offer_for(
        Some("m"),
        Some(&conversation(&next)),
        Strategy::ModelAware,
        late,
    ));
    assert_eq!(&*spilled.host.name, "A");
    assert_eq!(
        spilled.affinity.map(|verdict| verdict.outcome),
        Some(crate::affinity::Outcome::Spill)
    );
    drop(running);
}

/// A conversation that thinks longer than a second keeps its host's slot from a spill while
/// re-reading its history elsewhere would take longer than its think: another host's
/// conversation waits for its own host (here it would re-read its whole history otherwise),
/// and spills once the hold has run out.
#[test]
fn a_long_conversation_keeps_its_slot_from_a_spill_while_it_thinks() {
    use crate::scheduler::Offer;
    let mut router = fleet(vec![
        spec("A").slots(1).loaded(&["m"]),
        spec("B").slots(1).loaded(&["m"]),
    ]);
    let words = |seed: usize, count: usize| {
        (0..count)
            .map(|i| format!("w{}", seed * 10_000 + i))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let t0 = Instant::now();
    let run = |offer: Offer<Placement>| match offer {
        Offer::Run(placement) => placement,
        _ => panic!("expected to run"),
    };
    // X: a long history on A, answered and ended; A learned 2 ms a token.
    let x = vec![words(1, 3000)];
    let placed =
        run(router.offer_for(Some("m"), Some(&conversation(&x)), Strategy::ModelAware, t0));
    assert_eq!(&*placed.host.name, "A");
    let slot = placed.affinity.unwrap().slot.unwrap();
    router.answered(slot, conversation(&x).answered("ok").unwrap(), t0);
    router.ended("A", "m", t0, Some(0.002), None, t0);
    drop(placed);
    let hold = Duration::from_secs_f64(f64::from(conversation(&x).tokens) * 0.002);
    assert!(hold > Duration::from_secs(4), "{hold:?}");
    // Y: a short one on B, still running.
    let y = vec![words(2, 300)];
    let running =
        run(router.offer_for(Some("m"), Some(&conversation(&y)), Strategy::ModelAware, t0));
    assert_eq!(&*running.host.name, "B");
    let slot = running.affinity.unwrap().slot.unwrap();
    router.answered(slot, conversation(&y).answered("ok").unwrap(), t0);
    let next = vec![words(2, 300), "ok".to_owned(), words(3, 300)];
    // Three seconds on (a fixed second's hold would be over): Y's wait for B costs more than
    // re-reading it on A, but X is still expected back there.
    let thinking = t0 + Duration::from_secs(3);
    router.begin_pass();
    assert!(matches!(
        router.offer_for(
            Some("m"),
            Some(&conversation(&next)),
            Strategy::ModelAware,
            thinking
        ),
        Offer::Wait
    ));
    // Past X's hold: Y spills to A.
    let late = t0 + hold + Duration::from_millis(10);
    router.begin_pass();
    let spilled = run(router.offer_for(
        Some("m"),
        Some(&conversation(&next)),
        Strategy::ModelAware,
        late,
    ));
    assert_eq!(&*spilled.host.name, "A");
    assert_eq!(
        spilled.affinity.map(|verdict| verdict.outcome),
        Some(crate::affinity::Outcome::Spill)
    );
    drop(running);
}

/// Places under `round_robin` and releases at once; returns the host names, one letter each.
fn round_robin_names(router: &mut Router, model: Option<&str>, count: usize) -> String {
    (0..count)
        .map(|_| {
            let placement = router.place(model, Strategy::RoundRobin).expect("a host");
            placement.host.name.to_string()
        })
        .collect()
}

#[test]
fn round_robin_sends_a_model_to_the_engines_that_list_it_only() {
    // A mixed fleet: Ollama hosts a and b (alike, as round_robin assumes), engines c and d, each
    // with its one model.
    let mut router = fleet(vec![
        spec("a").loaded(&["llama3"]),
        spec("b").installed(&["llama3"]),
        spec("c").engine().installed(&["tiny"]),
        spec("d").engine().installed(&["embed"]),
    ]);
    // An Ollama model never reaches an engine (which would answer with its own model).
    assert_eq!(round_robin_names(&mut router, Some("llama3"), 4), "abab");
    // An engine's model never reaches an Ollama host (which would answer 404).
    assert_eq!(round_robin_names(&mut router, Some("tiny"), 3), "ccc");
    assert_eq!(round_robin_names(&mut router, Some("embed"), 2), "dd");
    // A model only one Ollama host lists still goes round among the Ollama hosts.
    let mut router = fleet(vec![
        spec("a").installed(&["llama3"]),
        spec("b"),
        spec("c").engine().installed(&["tiny"]),
    ]);
    assert_eq!(round_robin_names(&mut router, Some("llama3"), 4), "abab");
}

#[test]
fn round_robin_without_a_listing_host_keeps_every_candidate() {
    // No host lists the model (or none is named): every host takes its turn, as before.
    let mut router = fleet(vec![spec("a"), spec("b").engine().installed(&["tiny"])]);
    assert_eq!(round_robin_names(&mut router, Some("unknown"), 4), "abab");
    assert_eq!(round_robin_names(&mut router, None, 2), "ab");
    // An engine that lists the model but is busy: the request waits for it.
    let mut router = fleet(vec![
        spec("a"),
        spec("b").engine().slots(1).installed(&["tiny"]),
    ]);
    let held = router.place(Some("tiny"), Strategy::RoundRobin).expect("b");
    assert_eq!(&*held.host.name, "b");
    assert!(router.place(Some("tiny"), Strategy::RoundRobin).is_none());
    drop(held);
    assert!(router.place(Some("tiny"), Strategy::RoundRobin).is_some());
}
