//! The config loader (`oqp_controlplane::config::load_str`) on arbitrary
//! YAML, with environment overrides taken from the input too. Properties:
//! nothing panics (a bad file is a list of errors, exit code 2, never a
//! crash), and loading is deterministic.
//!
//! Input: UTF-8 text; lines before a line `---env---` are the YAML, lines
//! after it are `NAME=value` overrides.

#![no_main]

use libfuzzer_sys::fuzz_target;
use oqp_controlplane::config::{Env, load_str};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (yaml, overrides) = text.split_once("\n---env---\n").unwrap_or((text, ""));
    let env = Env::from_pairs(
        overrides
            .lines()
            .filter_map(|line| line.split_once('='))
            .map(|(name, value)| (name.to_owned(), value.to_owned())),
    );
    let first = load_str(yaml, &env);
    let second = load_str(yaml, &env);
    match (&first, &second) {
        (Ok(a), Ok(b)) => assert_eq!(a.warnings, b.warnings, "deterministic warnings"),
        (Err(a), Err(b)) => {
            assert_eq!(a.to_string(), b.to_string(), "deterministic errors");
            assert!(!a.to_string().is_empty());
            let _ = a.exit_code();
        }
        _ => panic!("loading the same text twice disagreed"),
    }
});
