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

/// `url` with the password (and any query, which may carry one) hidden:
/// `redis://user:***@host:6379/0`.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<invalid url>".to_owned();
    };
    let (rest, query) = match rest.split_once('?') {
        Some((rest, _)) => (rest, "?***"),
        None => (rest, ""),
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    let authority = match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{user}:***@{host}"),
            None => format!("***@{host}"),
        },
        None => authority.to_owned(),
    };
    format!("{scheme}://{authority}{path}{query}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_the_last_four_characters() {
        assert_eq!(redact_key("sk-abcdefghijklmnop"), "…mnop");
        assert_eq!(redact_key("short"), "…");
    }

    #[test]
    fn urls_never_show_passwords() {
        assert_eq!(redact_url("redis://valkey:6379/0"), "redis://valkey:6379/0");
        assert_eq!(
            redact_url("redis://:s3cret@valkey:6379/0"),
            "redis://:***@valkey:6379/0"
        );
        assert_eq!(
            redact_url("rediss://app:s3cret@valkey/1?protocol=resp3"),
            "rediss://app:***@valkey/1?***"
        );
        assert_eq!(redact_url("redis://s3cret@valkey"), "redis://***@valkey");
        assert_eq!(redact_url("garbage"), "<invalid url>");
    }
}
