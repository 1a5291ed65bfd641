//! What the in-process embedding cache and one embed request really cost,
//! measured with a counting global allocator (this binary's own), not taken
//! from the cache's weigher.
//!
//! The allocator counts requested bytes; each live allocation is charged
//! [`MALLOC_OVERHEAD`] more for the allocator's chunk header and rounding.

use std::alloc::System;
use std::time::Duration;

use bytes::Bytes;
use oqp_dataplane::cache::{self, Namespace};
use oqp_dataplane::policy::{CacheBackend, CacheSettings};
use oqp_dataplane::scheduler::Tier;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, Stats, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// glibc's per-chunk cost: an 8-byte header and rounding to 16.
const MALLOC_OVERHEAD: i64 = 16;

/// Live bytes the change `stats` left behind, allocator overhead included.
fn retained(stats: Stats) -> i64 {
    // stats_alloc counts a growing realloc in bytes_allocated too.
    let bytes = stats.bytes_allocated as i64 - stats.bytes_deallocated as i64;
    let count = stats.allocations as i64 - stats.deallocations as i64;
    bytes + count * MALLOC_OVERHEAD
}

fn settings(max_memory_bytes: u64) -> CacheSettings {
    CacheSettings {
        enabled: true,
        backend: CacheBackend::Memory,
        ttl: Duration::from_secs(3600),
        max_entry_bytes: 32_768,
        key_prefix: "oqp:embed:".to_owned(),
        connect_timeout: Duration::from_secs(2),
        max_memory_bytes,
        per_client: false,
        max_inputs: 2048,
    }
}

/// The tests share one allocator: they must not run side by side.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn the_memory_cache_holds_no_more_than_max_memory() {
    let _serial = SERIAL.lock().await;
    let capacity: u64 = 4 << 20;
    let region = Region::new(GLOBAL);
    let cache = cache::connect(&settings(capacity)).await.unwrap();
    // The attack's shape: many distinct short inputs, small vectors. Twice
    // what the cache can hold, in request-sized batches.
    let vector = Bytes::from_static(b"[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8]");
    for batch in 0..100u32 {
        let plan = cache::plan(
            Namespace::Embed,
            &Bytes::from(format!(
                r#"{{"model":"m","input":[{}]}}"#,
                (0..2048)
                    .map(|i| format!(r#""text {batch} {i}""#))
                    .collect::<Vec<_>>()
                    .join(",")
            )),
        )
        .unwrap();
        let keys = cache.keys(&plan, "client");
        cache
            .store(
                keys.into_iter()
                    .map(|key| (key, Bytes::copy_from_slice(&vector)))
                    .collect(),
            )
            .await;
    }
    cache.settle().await;
    let held = retained(region.change());
    eprintln!("200k entries offered, cache of {capacity} bytes: {held} bytes held");
    assert!(
        held <= capacity as i64 * 11 / 10,
        "the cache holds {held} bytes for a {capacity}-byte capacity"
    );
}

/// An Ollama `/api/embed` answer with one `dims`-long float32 vector per
/// input.
fn answer(inputs: usize, dims: usize) -> Bytes {
    let vector = format!(
        "[{}]",
        (0..dims)
            // Shortest float32 digits, as Ollama prints them.
            .map(|i| format!("{}", 0.012_345_67_f32 + i as f32 * 1e-5))
            .collect::<Vec<_>>()
            .join(",")
    );
    let vectors = vec![vector; inputs].join(",");
    Bytes::from(format!(
        r#"{{"model":"m","embeddings":[{vectors}],"total_duration":1,"prompt_eval_count":2}}"#
    ))
}

#[tokio::test]
async fn a_max_size_embed_request_works_in_bounded_memory() {
    let _serial = SERIAL.lock().await;
    for (text, dims) in [(16, 8), (200, 8), (16, 384)] {
        let cache = cache::connect(&settings(1 << 30)).await.unwrap();
        let inputs: Vec<String> = (0..2048)
            .map(|i| format!("\"{i:0>width$}\"", width = text))
            .collect();
        let body = Bytes::from(format!(r#"{{"model":"m","input":[{}]}}"#, inputs.join(",")));
        let answer = answer(2048, dims);
        let outside = body.len() + answer.len();
        let region = Region::new(GLOBAL);
        let plan = cache::plan_within(Namespace::Embed, &body, 2048)
            .unwrap()
            .unwrap();
        let resolved = cache
            .resolve(&plan, "client", "/api/embed", Tier::Normal, |_, _| {
                let answer = answer.clone();
                async move { Ok::<_, ()>(answer) }
            })
            .await
            .unwrap();
        drop((plan, resolved));
        let stats = region.change();
        let working = stats.bytes_allocated as i64 + stats.allocations as i64 * MALLOC_OVERHEAD;
        let kept = retained(stats);
        eprintln!(
            "2048 inputs of {text} bytes, {dims} dims: body {} + answer {} bytes; \
             allocated {working} bytes while resolving; {kept} bytes kept by the cache",
            body.len(),
            answer.len()
        );
        // Everything the request allocates (a bound on its peak, the cache's
        // new entries included) is a few kilobytes per input plus a small
        // multiple of the bytes it carries.
        assert!(
            working <= 4 * outside as i64 + 4096 * 2048,
            "{working} bytes allocated for {outside} bytes of body and answer"
        );
        // Refused above the cap: nothing per input is built.
        let over = Bytes::from(format!(
            r#"{{"model":"m","input":[{},"one more"]}}"#,
            inputs.join(",")
        ));
        let region = Region::new(GLOBAL);
        assert!(cache::plan_within(Namespace::Embed, &over, 2048).is_err());
        assert!(region.change().bytes_allocated < 4096);
    }
}
