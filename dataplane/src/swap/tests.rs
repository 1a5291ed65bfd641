//! Unit tests of one host's VRAM view: fit, switches, polls, learning and bypass detection.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use super::*;
use crate::policy::{Host, HostKind, Vram};

const GIB: u64 = 1 << 30;

fn host(capacity: Option<u64>, resident: &[(&str, u64)], checked: SystemTime) -> Host {
    Host {
        runners: Default::default(),
        engine: Default::default(),
        name: Arc::from("gpu"),
        url: "http://gpu:11434".to_owned(),
        scheme: http::uri::Scheme::HTTP,
        authority: "gpu:11434".parse().unwrap(),
        weight: 1,
        max_concurrent: 2,
        kind: HostKind::Ollama,
        healthy: true,
        installed: Default::default(),
        loaded: Default::default(),
        installed_names: Vec::new(),
        loaded_names: Vec::new(),
        last_checked: Some(checked),
        cloud_keys: Vec::new(),
        cloud_accounts: Vec::new(),
        fallback_models: Vec::new(),
        owner: None,
        vram: Vram {
            capacity,
            resident: resident
                .iter()
                .map(|(m, b)| ((*m).to_owned(), *b))
                .collect(),
            sizes: [("a", 6 * GIB), ("b", 6 * GIB), ("c", 3 * GIB)]
                .into_iter()
                .map(|(m, b)| (m.to_owned(), b))
                .collect(),
        },
    }
}

fn names(vram: &HostVram) -> Vec<String> {
    let mut names: Vec<String> = vram
        .stat(Instant::now())
        .resident
        .into_iter()
        .map(|(m, _)| m)
        .collect();
    names.sort();
    names
}

#[test]
fn a_model_fits_beside_the_resident_ones_only_within_the_capacity() {
    let now = Instant::now();
    let mut vram = HostVram::new(
        &host(Some(10 * GIB), &[("a", 6 * GIB)], SystemTime::now()),
        now,
    );
    assert_eq!(vram.fit("a", now), Fit::Resident);
    assert_eq!(vram.fit("c", now), Fit::Room);
    assert_eq!(vram.fit("b", now), Fit::Switch);
    // An unknown model's footprint is unknown: it fits only in an empty VRAM.
    assert_eq!(vram.fit("unknown", now), Fit::Switch);
    let mut empty = HostVram::new(&host(Some(10 * GIB), &[], SystemTime::now()), now);
    assert_eq!(empty.fit("unknown", now), Fit::Room);
}

#[test]
fn without_a_configured_capacity_nothing_is_held_until_the_host_is_seen_evicting() {
    let now = Instant::now();
    let t0 = SystemTime::now();
    let at = |s: u64| t0 + Duration::from_secs(s);
    let mut vram = HostVram::new(&host(None, &[("a", 6 * GIB)], t0), now);
    assert_eq!(vram.capacity(), Some(6 * GIB));
    assert!(!vram.holds_back());
    assert_eq!(
        vram.fit("b", now),
        Fit::Room,
        "never seen evicting: Ollama's behaviour"
    );
    // a and c together (c sent by this data plane): the capacity is at least 9 GiB.
    vram.dispatched("c", now, at(1));
    vram.completed("c", None, now);
    vram.apply(
        &host(None, &[("a", 6 * GIB), ("c", 3 * GIB)], at(5)),
        now,
        at(5),
    );
    assert_eq!(vram.capacity(), Some(9 * GIB));
    assert!(vram.stat(now).capacity_learned);
    // b came and a went between two polls: the host evicts.
    vram.dispatched("b", now, at(6));
    vram.completed("b", None, now);
    vram.apply(
        &host(None, &[("b", 6 * GIB), ("c", 3 * GIB)], at(10)),
        now,
        at(10),
    );
    assert!(vram.holds_back());
    assert_eq!(
        vram.fit("a", now),
        Fit::Switch,
        "a and b were never seen together"
    );
    assert_eq!(vram.fit("c", now), Fit::Resident);
    assert!(!vram.bypassed(now), "oqp loaded those models itself");
}

#[test]
fn a_switch_stops_new_work_for_its_victims_and_waits_for_their_requests() {
    let now = Instant::now();
    let wall = SystemTime::now();
    let mut vram = HostVram::new(&host(Some(10 * GIB), &[("a", 6 * GIB)], wall), now);
    assert!(!vram.dispatched("a", now, wall), "resident: no load");
    assert_eq!(
        vram.begin_switch("b", false, None, now),
        vec!["a".to_owned()]
    );
    assert_eq!(
        vram.fit("a", now),
        Fit::Blocked,
        "no new work for the victim"
    );
    assert_eq!(
        vram.fit("b", now),
        Fit::Blocked,
        "the victim has a request in flight"
    );
    assert!(vram.cold(now).switching);
    vram.completed("a", None, now);
    assert_eq!(vram.fit("b", now), Fit::Room);
    assert!(vram.dispatched("b", now, wall), "the first request loads");
    assert_eq!(names(&vram), vec!["b"]);
    assert_eq!(
        vram.fit("b", now),
        Fit::Resident,
        "the rest of the batch is warm"
    );
    let stat = vram.stat(now);
    assert_eq!((stat.switches, stat.switching_to), (1, None));
    assert_eq!(vram.cold(now).settled_at, Some(now));
}

#[test]
fn a_switch_still_draining_at_its_requesters_bound_is_given_up_and_charged_to_it() {
    let now = Instant::now();
    let wall = SystemTime::now();
    let mut vram = HostVram::new(&host(Some(10 * GIB), &[("a", 6 * GIB)], wall), now);
    vram.dispatched("a", now, wall);
    let by = crate::scheduler::Requester {
        client: Arc::from("yvonne"),
        group: None,
        tier: crate::scheduler::Tier::Normal,
        bound: Duration::from_secs(5),
    };
    vram.begin_switch("b", false, Some(by.clone()), now);
    let early = now + Duration::from_secs(4);
    assert_eq!(vram.fit("a", early), Fit::Blocked);
    assert_eq!(vram.cold(early).drain_until, Some(now + by.bound));
    assert!(
        vram.take_charges().is_empty(),
        "nothing charged while it drains"
    );
    // The bound: a's long request still runs; the switch is given up and a takes work again.
    let bound = now + by.bound;
    assert_eq!(vram.fit("a", bound), Fit::Resident);
    assert_eq!(vram.fit("b", bound), Fit::Switch);
    assert_eq!(vram.switching_to(), None);
    let cold = vram.cold(bound);
    assert!(!cold.switching);
    assert_eq!(cold.gave_up_at, Some(bound));
    assert_eq!(vram.stat(bound).given_up, 1);
    assert_eq!(vram.take_charges(), vec![(by.clone(), by.bound)]);
    // A switch that drains in time is charged its drain, once.
    vram.begin_switch("b", false, Some(by.clone()), bound);
    let later = bound + Duration::from_secs(2);
    vram.completed("a", None, later);
    assert_eq!(vram.fit("b", later), Fit::Room);
    assert_eq!(vram.fit("b", later), Fit::Room);
    assert_eq!(vram.take_charges(), vec![(by, Duration::from_secs(2))]);
}

#[test]
fn victims_are_the_least_recently_used_models_until_the_new_one_fits() {
    let now = Instant::now();
    let wall = SystemTime::now();
    let mut vram = HostVram::new(
        &host(Some(10 * GIB), &[("a", 6 * GIB), ("c", 3 * GIB)], wall),
        now,
    );
    vram.dispatched("a", now, wall);
    vram.completed("a", None, now);
    vram.dispatched("c", now + Duration::from_secs(1), wall);
    vram.completed("c", None, now + Duration::from_secs(1));
    // b (6 GiB) needs a out (a was used longer ago); c (3 GiB) may stay.
    assert_eq!(
        vram.begin_switch("b", false, None, now),
        vec!["a".to_owned()]
    );
    assert_eq!(vram.fit("c", now), Fit::Resident);
}

#[test]
fn with_explicit_unloads_the_switch_waits_for_the_unload_answers() {
    let now = Instant::now();
    let wall = SystemTime::now();
    let mut vram = HostVram::new(&host(Some(10 * GIB), &[("a", 6 * GIB)], wall), now);
    vram.begin_switch("b", true, None, now);
    assert_eq!(vram.fit("b", now), Fit::Blocked);
    assert_eq!(vram.take_unloads(), vec!["a".to_owned()]);
    assert!(vram.take_unloads().is_empty(), "once");
    assert_eq!(vram.fit("b", now), Fit::Blocked);
    vram.unloaded("a");
    assert_eq!(vram.fit("b", now), Fit::Room);
}

#[test]
fn an_aborted_switch_gives_the_victims_back() {
    let now = Instant::now();
    let mut vram = HostVram::new(
        &host(Some(10 * GIB), &[("a", 6 * GIB)], SystemTime::now()),
        now,
    );
    vram.begin_switch("b", false, None, now);
    assert_eq!(vram.abort_switch(now).as_deref(), Some("b"));
    assert_eq!(vram.fit("a", now), Fit::Resident);
}

#[test]
fn a_poll_that_may_predate_the_data_planes_own_change_is_not_applied() {
    let now = Instant::now();
    let t0 = SystemTime::now();
    let mut vram = HostVram::new(&host(Some(10 * GIB), &[("a", 6 * GIB)], t0), now);
    vram.begin_switch("b", false, None, now);
    vram.fit("b", now);
    vram.dispatched("b", now, t0 + Duration::from_secs(10));
    // Polled a second later than the change, but within the margin: may still show a.
    let stale = t0 + Duration::from_secs(11);
    vram.apply(&host(Some(10 * GIB), &[("a", 6 * GIB)], stale), now, stale);
    assert_eq!(names(&vram), vec!["b"]);
    // A later poll is the truth.
    let later = t0 + Duration::from_secs(20);
    vram.apply(&host(Some(10 * GIB), &[("b", 6 * GIB)], later), now, later);
    assert_eq!(names(&vram), vec!["b"]);
    assert!(!vram.stat(now).bypassed);
}

#[test]
fn models_loaded_around_oqp_turn_holding_off_for_the_host() {
    let now = Instant::now();
    let t0 = SystemTime::now();
    let mut vram = HostVram::new(&host(Some(10 * GIB), &[("a", 6 * GIB)], t0), now);
    // Twice, a poll shows a model oqp did not send.
    let t1 = t0 + Duration::from_secs(10);
    vram.apply(&host(Some(10 * GIB), &[("b", 6 * GIB)], t1), now, t1);
    assert!(!vram.bypassed(now), "one change is not enough");
    let t2 = t0 + Duration::from_secs(20);
    vram.apply(&host(Some(10 * GIB), &[("a", 6 * GIB)], t2), now, t2);
    assert!(vram.bypassed(now));
    assert!(vram.stat(now).bypassed);
    // Plain fair share: everything runs.
    assert_eq!(vram.fit("c", now), Fit::Room);
    assert_eq!(vram.fit("b", now), Fit::Room);
    assert!(!vram.bypassed(now + BYPASS_WINDOW));
}

#[test]
fn a_model_loaded_by_a_request_oqp_sent_uncounted_is_excused_once_and_only_within_the_grace() {
    let now = Instant::now();
    let t0 = SystemTime::now();
    let at = |s: u64| t0 + Duration::from_secs(s);
    let poll = |vram: &mut HostVram, model: &str, s: u64| {
        vram.apply(
            &host(Some(10 * GIB), &[(model, 6 * GIB)], at(s)),
            now,
            at(s),
        );
    };
    let mut vram = HostVram::new(&host(Some(10 * GIB), &[("a", 6 * GIB)], t0), now);
    // Two requests sent without their model recorded, each shown loading by the next poll.
    vram.uncounted(at(5));
    poll(&mut vram, "b", 10);
    vram.uncounted(at(15));
    poll(&mut vram, "a", 20);
    assert!(!vram.bypassed(now), "oqp sent both: {:?}", vram.stat(now));
    // One uncounted dispatch excuses one model, not a later one as well.
    vram.uncounted(at(25));
    poll(&mut vram, "b", 30);
    poll(&mut vram, "a", 40);
    assert!(!vram.bypassed(now), "one change around oqp is not enough");
    // Nor one older than the grace, nor one the poll predates.
    vram.uncounted(at(50));
    vram.uncounted(at(200));
    poll(&mut vram, "b", 50 + UNCOUNTED_GRACE.as_secs() + 1);
    assert!(vram.bypassed(now), "{:?}", vram.stat(now));
}

#[test]
fn the_load_cost_is_learned_from_load_durations_and_defaults_to_a_few_seconds() {
    let now = Instant::now();
    let wall = SystemTime::now();
    let mut vram = HostVram::new(&host(Some(10 * GIB), &[], wall), now);
    assert_eq!(vram.load_cost("a"), DEFAULT_LOAD_COST);
    assert!(vram.dispatched("a", now, wall));
    vram.completed("a", Some(Duration::from_millis(1500)), now);
    assert_eq!(vram.load_cost("a"), Duration::from_millis(1500));
    vram.dispatched("a", now, wall);
    vram.completed("a", Some(Duration::from_millis(3)), now);
    assert_eq!(
        vram.load_cost("a"),
        Duration::from_millis(1500),
        "a warm start is no load"
    );
}

#[test]
fn requests_in_flight_keep_their_model_resident_whatever_a_poll_says() {
    let now = Instant::now();
    let t0 = SystemTime::now();
    let mut vram = HostVram::new(&host(Some(10 * GIB), &[("a", 6 * GIB)], t0), now);
    vram.dispatched("a", now, t0);
    let t1 = t0 + Duration::from_secs(10);
    vram.apply(&host(Some(10 * GIB), &[], t1), now, t1);
    assert_eq!(vram.fit("a", now), Fit::Resident);
}

#[test]
fn an_unseen_models_footprint_is_its_file_size_scaled_as_the_models_seen_resident() {
    let now = Instant::now();
    let mut host = host(Some(10 * GIB), &[("a", 8 * GIB)], SystemTime::now());
    // On disk a and b take 2 GiB each; a takes 8 GiB once loaded (weights and context).
    host.vram.sizes = [("a", 2 * GIB), ("b", 2 * GIB), ("d", GIB / 4)]
        .into_iter()
        .map(|(m, b)| (m.to_owned(), b))
        .collect();
    let mut vram = HostVram::new(&host, now);
    assert_eq!(
        vram.fit("b", now),
        Fit::Switch,
        "b is taken to need 8 GiB too"
    );
    assert_eq!(vram.fit("d", now), Fit::Room, "1 GiB fits beside a");
}

#[test]
fn once_the_host_evicts_the_view_never_holds_more_than_the_capacity() {
    let now = Instant::now();
    let t0 = SystemTime::now();
    let at = |s: u64| t0 + Duration::from_secs(s);
    let mut vram = HostVram::new(&host(None, &[("a", 6 * GIB)], t0), now);
    // Sent in turn before the host was known to evict: the view believes both resident.
    vram.dispatched("b", now, at(9));
    vram.completed("b", Some(Duration::from_millis(500)), now);
    vram.dispatched("a", now + Duration::from_secs(1), at(10));
    vram.completed(
        "a",
        Some(Duration::from_millis(500)),
        now + Duration::from_secs(1),
    );
    // The polls show one model, then the other: the host evicts, and b (used longest ago)
    // is not there any more.
    vram.apply(&host(None, &[("b", 6 * GIB)], at(10)), now, at(10));
    assert!(vram.holds_back());
    assert_eq!(names(&vram), vec!["a"]);
    assert_eq!(vram.fit("b", now), Fit::Switch);
}
