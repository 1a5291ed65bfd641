use std::sync::Arc;
use std::time::{Duration, Instant};

use super::chain::{Chain, Shape};
use super::index::{ENTRY_BYTES, Hold, Index};

fn turn(scope: &str, history: &[&str]) -> Chain {
    let messages: Vec<serde_json::Value> = history
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            serde_json::json!({ "role": role, "content": text })
        })
        .collect();
    let body = serde_json::json!({ "model": "m", "messages": messages }).to_string();
    Chain::of(Shape::OllamaChat, body.as_bytes(), scope, "m:latest", None).unwrap()
}

#[test]
fn a_follow_up_finds_the_runner_that_answered_its_history() {
    let mut index = Index::new(100);
    let a: Arc<str> = Arc::from("a");
    let first = turn("t", &["hi"]);
    let slot = index.place(&a, "m:latest", 2, &first).unwrap();
    index.answered(slot, first.answered("hello").unwrap(), Instant::now());
    let next = turn("t", &["hi", "hello", "more"]);
    let warm = index.lookup(&next);
    assert_eq!(warm.len(), 1);
    assert_eq!(warm[0].host, a);
    assert_eq!(warm[0].tokens, next.points[1].tokens);
    // Placed again there, it continues the same entry: one conversation.
    index.place(&a, "m:latest", 2, &next).unwrap();
    assert_eq!(index.len(), 1);
    // Another tenant's identical history finds nothing.
    assert!(
        index
            .lookup(&turn("u", &["hi", "hello", "more"]))
            .is_empty()
    );
}

#[test]
fn a_runner_keeps_no_more_conversations_than_its_capacity_least_recent_out() {
    let mut index = Index::new(100);
    let a: Arc<str> = Arc::from("a");
    for text in ["one", "two", "three"] {
        index.place(&a, "m:latest", 2, &turn("t", &[text])).unwrap();
    }
    assert_eq!(index.len(), 2);
    assert!(index.lookup(&turn("t", &["one"])).is_empty());
    assert_eq!(index.lookup(&turn("t", &["three"])).len(), 1);
    index.forget_runner("a", "m:latest");
    assert!(index.is_empty());
}

#[test]
fn new_reload_options_empty_the_runner() {
    let mut index = Index::new(100);
    let a: Arc<str> = Arc::from("a");
    index
        .place(&a, "m:latest", 4, &turn("t", &["one"]))
        .unwrap();
    let body =
        r#"{"model":"m","messages":[{"role":"user","content":"two"}],"options":{"num_ctx":9000}}"#;
    let other = Chain::of(Shape::OllamaChat, body.as_bytes(), "t", "m:latest", None).unwrap();
    index.place(&a, "m:latest", 4, &other).unwrap();
    assert_eq!(index.len(), 1);
    assert!(index.lookup(&turn("t", &["one"])).is_empty());
}

#[test]
fn a_late_answer_does_not_land_on_the_conversation_that_took_its_place() {
    let mut index = Index::new(100);
    let a: Arc<str> = Arc::from("a");
    let first = turn("t", &["one"]);
    let slot = index.place(&a, "m:latest", 1, &first).unwrap();
    index
        .place(&a, "m:latest", 1, &turn("t", &["two"]))
        .unwrap();
    index.answered(slot, first.answered("late").unwrap(), Instant::now());
    assert!(index.lookup(&turn("t", &["one", "late", "x"])).is_empty());
}

#[test]
fn the_wait_grows_with_what_runs_past_its_expected_time() {
    let mut index = Index::new(10);
    let a: Arc<str> = Arc::from("a");
    let start = Instant::now();
    index.started(&a, "m:latest", start);
    assert_eq!(index.wait("a", "m:latest", 2, 8, start, 1.0), 0.0);
    index.started(&a, "m:latest", start);
    assert!((index.wait("a", "m:latest", 2, 8, start, 1.0) - 1.0).abs() < 1e-9);
    let later = start + Duration::from_secs(3);
    assert!((index.wait("a", "m:latest", 2, 8, later, 1.0) - 3.0).abs() < 1e-9);
    index.ended(
        "a",
        "m:latest",
        start,
        Duration::from_secs(3),
        Some(0.001),
        None,
    );
    assert_eq!(index.wait("a", "m:latest", 2, 8, later, 1.0), 0.0);
    assert_eq!(index.prefill_rate("a", "m:latest"), Some(0.001));
}

/// 100,000 conversations fit in a few tens of MB (the heap the index's tables hold).
#[test]
fn a_hundred_thousand_conversations_fit_in_a_few_tens_of_megabytes() {
    let chains: Vec<Chain> = (0..100_000)
        .map(|i| turn("t", &[&format!("conversation {i}")]))
        .collect();
    let hosts: Vec<Arc<str>> = (0..100).map(|i| Arc::from(format!("h{i}"))).collect();
    let mut index = Index::new(100_000);
    for (i, chain) in chains.iter().enumerate() {
        index
            .place(&hosts[i % 100], "m:latest", 1_000, chain)
            .unwrap();
    }
    let bytes = index.heap_bytes();
    assert_eq!(index.len(), 100_000);
    let per_entry = bytes / 100_000;
    eprintln!("index: {bytes} bytes for 100000 conversations, {per_entry} per conversation");
    assert!(
        per_entry <= ENTRY_BYTES,
        "{per_entry} bytes per conversation"
    );
    assert!(bytes < 40 << 20, "{bytes} bytes");
}

#[test]
fn a_conversation_returns_to_the_engine_slot_that_holds_it() {
    let mut index = Index::new(100);
    let a: Arc<str> = Arc::from("a");
    let t0 = Instant::now();
    let one = index
        .place(&a, "m:latest", 8, &turn("t", &["one"]))
        .unwrap();
    let first = index.engine_slot(&a, "m:latest", 2, Some(one), t0).unwrap();
    assert!(
        first.named,
        "a new conversation takes an empty slot by name"
    );
    let two = index
        .place(&a, "m:latest", 8, &turn("t", &["two"]))
        .unwrap();
    let second = index.engine_slot(&a, "m:latest", 2, Some(two), t0).unwrap();
    assert_ne!(first.slot, second.slot, "the other slot is free");
    index.ended(
        "a",
        "m:latest",
        t0,
        Duration::from_secs(1),
        None,
        Some(first.slot),
    );
    index.ended(
        "a",
        "m:latest",
        t0,
        Duration::from_secs(1),
        None,
        Some(second.slot),
    );
    // The first conversation's next turn names the slot it was in, whichever is older.
    let again = index
        .place(&a, "m:latest", 8, &turn("t", &["one", "x", "y"]))
        .map(|slot| {
            index
                .engine_slot(&a, "m:latest", 2, Some(slot), t0)
                .unwrap()
        });
    assert_eq!(again.map(|c| c.slot), Some(first.slot));
    assert_eq!(
        index.held_in(one),
        None,
        "the entry moved on to its next turn"
    );
}

#[test]
fn a_new_conversation_sets_aside_the_least_recently_used_and_it_comes_back_by_the_ram_cache() {
    let mut index = Index::new(100);
    let a: Arc<str> = Arc::from("a");
    let t0 = Instant::now();
    let mut slots = Vec::new();
    for (i, text) in ["one", "two"].iter().enumerate() {
        let at = t0 + Duration::from_secs(i as u64);
        let slot = index.place(&a, "m:latest", 8, &turn("t", &[text])).unwrap();
        let choice = index
            .engine_slot(&a, "m:latest", 2, Some(slot), at)
            .unwrap();
        index.ended("a", "m:latest", at, Duration::ZERO, None, Some(choice.slot));
        slots.push((slot, choice.slot));
    }
    // A third conversation takes the slot of the least recently used one ("one").
    let at = t0 + Duration::from_secs(5);
    let three = index
        .place(&a, "m:latest", 8, &turn("t", &["three"]))
        .unwrap();
    let choice = index
        .engine_slot(&a, "m:latest", 2, Some(three), at)
        .unwrap();
    assert_eq!(choice.slot, slots[0].1);
    assert_eq!(
        index.held_in(slots[0].0),
        None,
        "set aside in the RAM cache"
    );
    assert_eq!(index.held_in(slots[1].0), Some(slots[1].1));
    // While it runs, "one" comes back: the only idle slot holds "two", named so that the
    // engine restores "one" from its RAM cache into it.
    let one = index
        .place(&a, "m:latest", 8, &turn("t", &["one", "a", "b"]))
        .unwrap();
    let back = index.engine_slot(&a, "m:latest", 2, Some(one), at).unwrap();
    assert_eq!((back.slot, back.named), (slots[1].1, true));
    // Every slot busy: the engine chooses.
    let four = index
        .place(&a, "m:latest", 8, &turn("t", &["four"]))
        .unwrap();
    assert_eq!(index.engine_slot(&a, "m:latest", 2, Some(four), at), None);
}

#[test]
fn a_set_aside_conversation_is_not_named_into_an_empty_slot() {
    let mut index = Index::new(100);
    let a: Arc<str> = Arc::from("a");
    let t0 = Instant::now();
    let one = index
        .place(&a, "m:latest", 8, &turn("t", &["one"]))
        .unwrap();
    let first = index.engine_slot(&a, "m:latest", 3, Some(one), t0).unwrap();
    index.ended("a", "m:latest", t0, Duration::ZERO, None, Some(first.slot));
    // A request of no conversation takes a slot; "one"'s slot stays (empty ones first).
    let other = index.engine_slot(&a, "m:latest", 3, None, t0).unwrap();
    assert_ne!(other.slot, first.slot);
    let at = t0 + Duration::from_secs(1);
    let two = index
        .place(&a, "m:latest", 8, &turn("t", &["two"]))
        .unwrap();
    let second = index.engine_slot(&a, "m:latest", 3, Some(two), at).unwrap();
    assert_ne!(second.slot, first.slot, "the empty slot is taken first");
    // Both others busy, a third conversation takes "one"'s slot.
    let three = index
        .place(&a, "m:latest", 8, &turn("t", &["three"]))
        .unwrap();
    let third = index
        .engine_slot(&a, "m:latest", 3, Some(three), at)
        .unwrap();
    assert_eq!(third.slot, first.slot);
    index.ended("a", "m:latest", t0, Duration::ZERO, None, Some(other.slot));
    // "one" comes back while the only idle slot is one oqp never saw hold a conversation...
    let one = index
        .place(&a, "m:latest", 8, &turn("t", &["one", "a", "b"]))
        .unwrap();
    let back = index.engine_slot(&a, "m:latest", 3, Some(one), at).unwrap();
    // ...but it did hold the request of no conversation: named.
    assert_eq!((back.slot, back.named), (other.slot, true));
    // A runner seen anew (another slot count) knows nothing: never named into an empty
    // slot is only for set-aside conversations.
    let fresh = index.engine_slot(&a, "m:latest", 4, Some(one), at).unwrap();
    assert!(fresh.named);
}

/// A hold of at least `floor`, at most 30 s, at 250 ms per 1,000 tokens where nothing is learned.
fn hold(floor: Duration) -> Hold {
    Hold {
        floor,
        ceiling: Duration::from_secs(30),
        fallback_rate: 0.000_25,
    }
}

#[test]
fn a_long_conversation_is_expected_back_for_as_long_as_re_reading_it_would_take() {
    let mut index = Index::new(100);
    let a: Arc<str> = Arc::from("a");
    let t0 = Instant::now();
    let floor = Duration::from_secs(1);
    let long = (0..4000)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let first = turn("t", &[&long]);
    let tokens = first.tokens;
    assert!(tokens >= 2000, "{tokens}");
    let slot = index.place(&a, "m:latest", 4, &first).unwrap();
    // The runner learns a prefill rate of 4 ms a token from an answer.
    index.started(&a, "m:latest", t0);
    index.ended(
        "a",
        "m:latest",
        t0,
        Duration::from_secs(1),
        Some(0.004),
        None,
    );
    let answer = first.answered("ok").unwrap();
    let held = answer.tokens;
    index.answered(slot, answer, t0);
    let reread = Duration::from_secs_f64(f64::from(held) * 0.004);
    assert!(reread > 2 * floor, "{reread:?}");
    // Past the floor, still within what re-reading it would take: held.
    assert_eq!(
        index.returning("a", "m:latest", t0 + 2 * floor, hold(floor)),
        1
    );
    assert_eq!(
        index.returning(
            "a",
            "m:latest",
            t0 + reread - Duration::from_millis(10),
            hold(floor)
        ),
        1
    );
    assert_eq!(
        index.returning("a", "m:latest", t0 + reread, hold(floor)),
        0
    );
    // Never past the ceiling.
    let short = Hold {
        ceiling: Duration::from_secs(2),
        ..hold(floor)
    };
    assert_eq!(index.returning("a", "m:latest", t0 + 2 * floor, short), 0);
    // A short conversation keeps the floor.
    assert_eq!(hold(floor).window(10, 0.004), floor);
    assert_eq!(hold(floor).window(10, f64::NAN), floor);
}

#[test]
fn a_conversation_just_answered_is_expected_back_until_its_next_turn_or_the_grace_ends() {
    let mut index = Index::new(100);
    let a: Arc<str> = Arc::from("a");
    let t0 = Instant::now();
    let grace = Duration::from_secs(1);
    let first = turn("t", &["hi"]);
    let slot = index.place(&a, "m:latest", 4, &first).unwrap();
    assert_eq!(index.returning("a", "m:latest", t0, hold(grace)), 0);
    index.answered(slot, first.answered("hello").unwrap(), t0);
    assert_eq!(index.returning("a", "m:latest", t0, hold(grace)), 1);
    assert_eq!(index.returning("a", "m:latest", t0 + grace, hold(grace)), 0);
    index.place(&a, "m:latest", 4, &turn("t", &["hi", "hello", "more"]));
    assert_eq!(
        index.returning("a", "m:latest", t0, hold(grace)),
        0,
        "it came back"
    );
}

#[test]
fn a_conversation_waiting_for_its_host_counts_as_returning_there() {
    let mut index = Index::new(100);
    let a: Arc<str> = Arc::from("a");
    let t0 = Instant::now();
    let grace = Duration::from_secs(1);
    let first = turn("t", &["hi"]);
    let slot = index.place(&a, "m:latest", 4, &first).unwrap();
    index.answered(slot, first.answered("hello").unwrap(), t0);
    let later = t0 + 2 * grace;
    assert_eq!(index.returning("a", "m:latest", later, hold(grace)), 0);
    let next = turn("t", &["hi", "hello", "more"]);
    index.waiting("a", "m:latest", &next, later);
    assert_eq!(index.returning("a", "m:latest", later, hold(grace)), 1);
    // Another tenant's identical turn is not it.
    index.waiting(
        "a",
        "m:latest",
        &turn("u", &["hi", "hello", "more"]),
        later + grace,
    );
    assert_eq!(
        index.returning("a", "m:latest", later + grace, hold(grace)),
        0
    );
}

#[test]
fn a_runner_whose_named_slot_missed_is_tracked_but_no_longer_named() {
    let mut index = Index::new(100);
    let a: Arc<str> = Arc::from("a");
    let t0 = Instant::now();
    assert!(!index.stop_naming("a", "m:latest"), "an unknown runner");
    let one = index
        .place(&a, "m:latest", 8, &turn("t", &["one"]))
        .unwrap();
    assert!(
        index
            .engine_slot(&a, "m:latest", 2, Some(one), t0)
            .unwrap()
            .named
    );
    assert!(index.stop_naming("a", "m:latest"));
    assert!(!index.stop_naming("a", "m:latest"), "said once");
    let two = index
        .place(&a, "m:latest", 8, &turn("t", &["two"]))
        .unwrap();
    let choice = index.engine_slot(&a, "m:latest", 2, Some(two), t0).unwrap();
    assert!(!choice.named);
    assert_eq!(index.held_in(two), Some(choice.slot), "still tracked");
}
