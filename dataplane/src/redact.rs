//! Redaction of secrets for status, logs and `Debug` output.

/// A key shown as `…` and its last four characters (nothing for short keys).
pub fn redact_key(key: &str) -> String {
    let count = key.chars().count();
    if count < 12 {
        return "…".to_owned();
    }
    let tail: String = key.chars().skip(count - 4).collect();
    format!("…{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_the_last_four_characters() {
        assert_eq!(redact_key("sk-abcdefghijklmnop"), "…mnop");
        assert_eq!(redact_key("short"), "…");
    }
}
