//! The embedding cache's request split and keys (`oqp_dataplane::cache`):
//! `plan` on arbitrary bodies, the keys of its items, partial fetch bodies,
//! and canonical JSON. Properties: nothing panics; canonical JSON is a fixed
//! point; keys are deterministic, distinct per distinct item, and differ
//! between the shared and a per-client scope; a partial fetch body is itself
//! a plan of exactly the items asked for.
//!
//! Input: the first byte picks the namespace (`/api/embed` or the legacy
//! `/api/embeddings`) and the subset to fetch; the rest is the body.

#![no_main]

use std::collections::HashSet;

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use oqp_dataplane::cache::key::canonical;
use oqp_dataplane::cache::{Namespace, plan};
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    if let Ok(value) = serde_json::from_slice::<Value>(body) {
        let once = canonical(&value);
        let reparsed: Value = serde_json::from_str(&once).expect("canonical JSON parses");
        assert_eq!(
            once,
            canonical(&reparsed),
            "canonical JSON is a fixed point"
        );
    }
    let namespace = if selector & 1 == 0 {
        Namespace::Embed
    } else {
        Namespace::Embeddings
    };
    let body = Bytes::copy_from_slice(body);
    let Some(plan) = plan(namespace, &body) else {
        return;
    };
    assert!(!plan.is_empty());
    let shared = plan.keys("oqp:embed:", None);
    assert_eq!(shared.len(), plan.len());
    assert_eq!(
        shared,
        plan.keys("oqp:embed:", None),
        "keys are deterministic"
    );
    let distinct: HashSet<&String> = shared.iter().collect();
    assert_eq!(
        distinct.len(),
        shared.len(),
        "distinct items, distinct keys"
    );
    for (shared, private) in shared.iter().zip(plan.keys("oqp:embed:", Some("alice"))) {
        assert_ne!(shared, &private, "a per-client key is not the shared one");
    }

    // Fetch every other item (by the selector's bits): the partial body
    // must plan to exactly those items.
    let wanted: Vec<usize> = (0..plan.len())
        .filter(|i| (selector >> (1 + i % 7)) & 1 == 1)
        .collect();
    if wanted.is_empty() {
        // A full hit fetches nothing.
        return;
    }
    let fetch = plan.fetch(&wanted);
    if fetch.is_whole() {
        assert_eq!(fetch.body, body);
        return;
    }
    assert_eq!(fetch.items(), wanted.as_slice());
    let partial = oqp_dataplane::cache::plan(namespace, &fetch.body)
        .expect("a partial fetch body is itself cacheable");
    let texts: Vec<&str> = (0..partial.len()).map(|i| partial.item(i)).collect();
    let expected: Vec<&str> = wanted.iter().map(|&i| plan.item(i)).collect();
    assert_eq!(texts, expected);
    assert_eq!(
        partial.keys("oqp:embed:", None),
        wanted
            .iter()
            .map(|&i| shared[i].clone())
            .collect::<Vec<_>>(),
        "the same items under the same parameters keep their keys"
    );
});
