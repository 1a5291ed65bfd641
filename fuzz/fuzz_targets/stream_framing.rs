//! The streamed-response wrapper (`oqp_dataplane::upstream::ResponseBody`)
//! over arbitrary chunks, ending cleanly or failing, for each `Framing`, and
//! `total_duration` / `Framing::of` on the raw bytes. Properties: nothing
//! panics; the client receives every upstream byte unchanged, in order; a
//! failure adds exactly one in-band error frame for NDJSON and SSE (on its
//! own line) and nothing for opaque bodies (which end with an error); the
//! completion hook runs once, with `total_duration` read from the tail; the
//! tail's index (`Fields`) reads every field as a backward search for its last
//! `"name":` does.
//!
//! Input: the first byte picks the framing and whether the upstream fails;
//! the rest is split into chunks at every 0xff byte.

#![no_main]

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body::{Body as _, Frame};
use http_body_util::{BodyExt, StreamBody};
use libfuzzer_sys::fuzz_target;
use oqp_dataplane::body::BoxError;
use oqp_dataplane::upstream::{Field, Fields, Framing, Outcome, ResponseBody, total_duration};
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let _ = total_duration(rest);
    let fields = Fields::of(rest);
    for field in Field::ALL {
        assert_eq!(
            fields.number(field),
            searched(rest, field.name()),
            "{}",
            field.name()
        );
    }
    if let Ok(value) = http::HeaderValue::from_bytes(rest) {
        let _ = Framing::of(Some(&value));
    }

    let framing = [Framing::Ndjson, Framing::Sse, Framing::Opaque][usize::from(selector % 3)];
    let fails = selector & 0x80 != 0;
    let chunks: Vec<Bytes> = rest
        .split(|byte| *byte == 0xff)
        .map(Bytes::copy_from_slice)
        .collect();
    let mut frames: Vec<Result<Frame<Bytes>, BoxError>> = chunks
        .iter()
        .cloned()
        .map(|chunk| Ok(Frame::data(chunk)))
        .collect();
    if fails {
        frames.push(Err("upstream connection reset".into()));
    }
    let inner = StreamBody::new(futures_util::stream::iter(frames)).boxed();
    let outcomes: Arc<Mutex<Vec<Outcome>>> = Arc::default();
    let record = outcomes.clone();
    let mut body = ResponseBody::new(
        inner,
        framing,
        "fuzz".into(),
        None,
        Some(Box::new(move |outcome| {
            record.lock().expect("lock").push(outcome);
        })),
        // Every frame is ready, so the stall timer is never reached.
        std::time::Duration::from_secs(60),
    );

    // Every frame is ready at once: poll with a no-op waker.
    let mut context = Context::from_waker(Waker::noop());
    let (mut received, mut errored) = (Vec::new(), false);
    loop {
        match Pin::new(&mut body).poll_frame(&mut context) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    received.extend_from_slice(data);
                }
            }
            Poll::Ready(Some(Err(_))) => errored = true,
            Poll::Ready(None) => break,
            Poll::Pending => panic!("a ready stream is never pending"),
        }
        if errored {
            break;
        }
    }
    drop(body);

    let sent: Vec<u8> = chunks.concat();
    assert!(received.starts_with(&sent), "every upstream byte, in order");
    let extra = &received[sent.len()..];
    let newline = !sent.is_empty() && sent.last() != Some(&b'\n');
    match (fails, framing) {
        (false, _) => assert!(extra.is_empty() && !errored),
        (true, Framing::Opaque) => assert!(extra.is_empty() && errored),
        (true, Framing::Ndjson) => {
            assert!(!errored);
            let line = extra
                .strip_prefix(if newline { &b"\n"[..] } else { b"" })
                .expect("own line");
            let line = line.strip_suffix(b"\n").expect("ends the line");
            let value: Value = serde_json::from_slice(line).expect("the error line is JSON");
            assert!(value["error"].is_string());
            assert!(!line.contains(&b'\n'));
        }
        (true, Framing::Sse) => {
            assert!(!errored);
            let frame = extra
                .strip_prefix(if newline { &b"\n"[..] } else { b"" })
                .expect("own line");
            let frame = frame
                .strip_prefix(b"data: ")
                .and_then(|frame| frame.strip_suffix(b"\n\n"))
                .expect("one SSE data frame");
            let value: Value = serde_json::from_slice(frame).expect("the error frame is JSON");
            assert!(value["error"]["message"].is_string());
        }
    }
    let outcomes = outcomes.lock().expect("lock");
    assert_eq!(outcomes.len(), 1, "the completion hook runs once");
    assert_eq!(outcomes[0].complete, !fails);
    assert!(!outcomes[0].cancelled);
    if !fails {
        let tail = &sent[sent.len().saturating_sub(2048)..];
        assert_eq!(outcomes[0].total_duration, total_duration(tail));
    }
});

/// The number after the last `"name":` in `tail`, found by a backward search: the reading
/// the index must agree with.
fn searched(tail: &[u8], name: &str) -> Option<u64> {
    let needle = format!("\"{name}\":");
    let at = tail
        .windows(needle.len())
        .rposition(|window| window == needle.as_bytes())?;
    let value = tail[at + needle.len()..].trim_ascii_start();
    let digits: String = value
        .iter()
        .take_while(|byte| byte.is_ascii_digit())
        .map(|byte| char::from(*byte))
        .collect();
    digits.parse().ok()
}
