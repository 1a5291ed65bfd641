//! What reading one large request body costs, measured with a counting global allocator
//! (this binary's own): the body's one reading ([`BodyView`]), its affinity chain, its
//! embedding inputs and its keep_alive rewrite allocate at most about the body's size (no
//! tree of the body is built: texts are hashed as they are read).
//!
//! The allocator counts every byte allocated while the region is open: their sum bounds the
//! peak from above.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::alloc::System;
use std::sync::Arc;
use std::time::Duration;

use oqp_dataplane::affinity::{Chain, Shape};
use oqp_dataplane::policy::KeepAlive;
use oqp_dataplane::rewrite::insert_keep_alive;
use oqp_dataplane::view::BodyView;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const MB: usize = 1 << 20;

/// A chat body of about `size` bytes: many turns, every other one with escapes (which
/// are decoded, one string at a time) and multi-part content.
fn chat_body(size: usize) -> Vec<u8> {
    let turn = "the quick brown fox jumps over the lazy dog; ".repeat(1_000);
    let mut body = String::with_capacity(size + 100_000);
    body.push_str(r#"{"model":"m","stream":false,"options":{"num_ctx":8192},"messages":["#);
    let mut index = 0;
    while body.len() < size {
        if index > 0 {
            body.push(',');
        }
        match index % 3 {
            0 => body.push_str(&format!(r#"{{"role":"user","content":"{turn}"}}"#)),
            1 => body.push_str(&format!(
                r#"{{"role":"assistant","content":"{}\n\u00e9\"quoted\""}}"#,
                turn
            )),
            _ => body.push_str(&format!(
                r#"{{"role":"user","content":[{{"type":"text","text":"{turn}"}},{{"type":"text","text":"\t{turn}"}}]}}"#
            )),
        }
        index += 1;
    }
    body.push_str("]}");
    body.into_bytes()
}

/// The tests share one allocator: they must not run side by side.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn reading_a_48_mb_chat_body_allocates_a_small_multiple_of_it() {
    let _serial = SERIAL.lock().unwrap();
    let body = chat_body(48 * MB);
    let region = Region::new(GLOBAL);
    let view = BodyView::read(&body).unwrap();
    let chain =
        Chain::read(Shape::OllamaChat, &body, &view, "alice", "m:latest", None).expect("a chain");
    let inputs = view.input_count(&body);
    let stats = region.change();
    let allocated = stats.bytes_allocated;
    println!(
        "48 MB chat body ({} bytes, {} turns): the reading allocated {allocated} bytes in all ({:.2}× the body), {} allocations",
        body.len(),
        chain.points.len(),
        allocated as f64 / body.len() as f64,
        stats.allocations,
    );
    assert_eq!(inputs, 0);
    assert!(chain.points.len() > 500);
    // A third of the turns have escapes: each is decoded alone (serde_json's scratch buffer,
    // then the string) and freed before the next. The sum of everything allocated bounds the
    // peak from above: a small multiple of the body, where the tree built before took many.
    assert!(
        allocated <= 2 * body.len(),
        "{allocated} bytes allocated for a {} byte body",
        body.len()
    );
}

#[test]
fn a_keep_alive_rewrite_copies_the_body_once() {
    let _serial = SERIAL.lock().unwrap();
    let body = chat_body(8 * MB);
    let keep_alive = KeepAlive {
        default_json: Some(Arc::from(r#""5m""#)),
        override_client: false,
        max: Duration::from_secs(30 * 60),
        bounded: false,
    };
    let region = Region::new(GLOBAL);
    let view = BodyView::read(&body).unwrap();
    let rewritten = insert_keep_alive(&body, &view, &keep_alive).expect("inserted");
    let allocated = region.change().bytes_allocated;
    assert!(rewritten.ends_with(br#","keep_alive":"5m"}"#));
    assert!(
        allocated <= body.len() + body.len() / 8,
        "{allocated} bytes allocated for a {} byte body",
        body.len()
    );
}
