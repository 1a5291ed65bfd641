//! The one reading of a request body (`oqp_dataplane::view::BodyView`) against a
//! reference decoder with Go's `encoding/json` rules (case-insensitive keys, the last
//! occurrence deciding, `null` as Go treats it), on arbitrary bytes: the same verdict
//! (one JSON value or not), model, name, stream, embedding inputs, keep_alive members and
//! app user field. The reference is the one the property tests use.

#![no_main]

use libfuzzer_sys::fuzz_target;
use oqp_dataplane::view::{BodyView, NotString};

#[path = "../../dataplane/src/view/reference.rs"]
mod reference;

fuzz_target!(|data: &[u8]| {
    reference::agrees(data);
});
