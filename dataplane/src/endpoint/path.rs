//! The canonical form of a request path, the only form oqp classifies.
//!
//! Ollama's router (gin over Go's `net/url`) matches the percent-decoded
//! path: `/api/%70ull` is `/api/pull` to it and `/api%2Fdelete` is
//! `/api/delete`. Reverse proxies in front of it may also merge slashes or
//! resolve dot segments. Rather than decode and hope every layer decodes
//! alike, oqp refuses any path that some layer could read as another: one
//! with a `%` escape, an empty segment (`//`) or a `.`/`..` segment. No
//! Ollama route or model name needs them, so the path oqp classifies is
//! byte for byte the path it forwards and the path Ollama routes.

/// Why a path is not canonical.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotCanonical {
    /// Not an absolute path (`*`, an authority, empty).
    #[error("not an absolute path")]
    NotAbsolute,
    /// A `%` escape, which the upstream would decode.
    #[error("percent escape")]
    Escaped,
    /// An empty segment (`//`), which some layers merge.
    #[error("empty segment")]
    EmptySegment,
    /// A `.` or `..` segment, which some layers resolve.
    #[error("dot segment")]
    DotSegment,
}

/// Returns `path` if it is canonical: absolute, without `%` escapes, empty
/// segments or dot segments (a trailing `/` is allowed: it is a route of its
/// own, which Ollama answers with a redirect or 404).
pub fn canonical(path: &str) -> Result<&str, NotCanonical> {
    let Some(rest) = path.strip_prefix('/') else {
        return Err(NotCanonical::NotAbsolute);
    };
    if path.contains('%') {
        return Err(NotCanonical::Escaped);
    }
    let mut segments = rest.split('/').peekable();
    while let Some(segment) = segments.next() {
        match segment {
            "" if segments.peek().is_some() => return Err(NotCanonical::EmptySegment),
            "." | ".." => return Err(NotCanonical::DotSegment),
            _ => {}
        }
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn encoded_and_ambiguous_paths_are_refused() {
        for path in [
            "/api/%70ull",
            "/api%2Fdelete",
            "/api%2fdelete",
            "/api/pull%00",
            "/%2e%2e/api/pull",
            "/api/tags%3F",
            "/api//pull",
            "//api/pull",
            "/api/./pull",
            "/api/x/../pull",
            "/api/pull/.",
            "/api/pull/..",
            "/..",
            "*",
            "",
            "api/pull",
        ] {
            assert!(canonical(path).is_err(), "{path:?} accepted");
        }
    }

    #[test]
    fn the_routes_clients_use_are_canonical() {
        for path in [
            "/",
            "/api/tags",
            "/api/tags/",
            "/v1/models/llama3.2:latest",
            "/v1/models/hf.co:x",
            "/api/blobs/sha256:ab",
            "/.well-known",
            "/api/...",
        ] {
            assert_eq!(canonical(path), Ok(path));
        }
    }

    /// What Go's `net/url` does to a path before gin routes it, followed by
    /// what a normalising reverse proxy does (merge slashes, resolve dot
    /// segments): the most any layer in front of Ollama reads into a path.
    fn as_routed(path: &str) -> Option<String> {
        let bytes = path.as_bytes();
        let mut decoded = Vec::with_capacity(bytes.len());
        let mut index = 0;
        while index < bytes.len() {
            if bytes[index] == b'%' {
                let hex = std::str::from_utf8(bytes.get(index + 1..index + 3)?).ok()?;
                decoded.push(u8::from_str_radix(hex, 16).ok()?);
                index += 3;
            } else {
                decoded.push(bytes[index]);
                index += 1;
            }
        }
        let decoded = String::from_utf8(decoded).ok()?;
        let mut stack: Vec<&str> = Vec::new();
        for segment in decoded.split('/').filter(|s| !s.is_empty()) {
            match segment {
                "." => {}
                ".." => {
                    stack.pop();
                }
                other => stack.push(other),
            }
        }
        let trailing = decoded.len() > 1 && decoded.ends_with('/');
        let mut routed = format!("/{}", stack.join("/"));
        if trailing && !stack.is_empty() {
            routed.push('/');
        }
        Some(routed)
    }

    proptest! {
        /// No accepted path is routed as another path by any layer.
        #[test]
        fn an_accepted_path_is_routed_as_itself(
            parts in proptest::collection::vec(
                prop_oneof![
                    Just("api".to_owned()),
                    Just("pull".to_owned()),
                    Just("".to_owned()),
                    Just(".".to_owned()),
                    Just("..".to_owned()),
                    Just("%70".to_owned()),
                    Just("%2F".to_owned()),
                    Just("%2e".to_owned()),
                    Just("%".to_owned()),
                    "[a-z.:%/]{0,6}",
                ],
                0..6,
            )
        ) {
            let path = format!("/{}", parts.join("/"));
            if let Ok(accepted) = canonical(&path) {
                let routed = as_routed(accepted);
                prop_assert_eq!(routed.as_deref(), Some(accepted));
            }
        }
    }
}
