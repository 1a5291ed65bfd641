//! Request ids: echoed from `X-Request-ID` when the client sends one,
//! generated otherwise, and carried in every response and error body.

use http::HeaderMap;

/// The header that carries the id both ways.
pub const HEADER: &str = "x-request-id";

/// Longest id accepted from a client; a longer one is replaced.
const MAX_LEN: usize = 128;

/// The client's id if it sent a usable one, else a fresh 16-hex-digit id.
pub fn from_headers(headers: &HeaderMap) -> String {
    headers
        .get(HEADER)
        .and_then(|value| value.to_str().ok())
        .filter(|id| !id.is_empty() && id.len() <= MAX_LEN)
        .map(str::to_owned)
        .unwrap_or_else(generate)
}

/// A fresh random id.
pub fn generate() -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let random = rand::random::<u64>();
    // Written digit by digit into one buffer, not through `format!` nor a `char` at a time:
    // every request without an id of its own takes one.
    let mut digits = [0u8; 16];
    for (at, digit) in digits.iter_mut().enumerate() {
        *digit = HEX[((random >> ((15 - at) * 4)) & 0xf) as usize];
    }
    // Hex digits: always UTF-8.
    std::str::from_utf8(&digits)
        .map(str::to_owned)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echoes_a_sent_id_and_generates_otherwise() {
        let mut headers = HeaderMap::new();
        assert_eq!(from_headers(&headers).len(), 16);
        headers.insert(HEADER, "abc-123".parse().unwrap());
        assert_eq!(from_headers(&headers), "abc-123");
        headers.insert(HEADER, "".parse().unwrap());
        assert_eq!(from_headers(&headers).len(), 16);
    }
}
