//! How a vector is stored: compact little-endian floats when that gives back
//! exactly the JSON text upstream sent, the text itself otherwise.
//!
//! Ollama is written in Go, and Go's `encoding/json` prints a float with the
//! shortest digits that read back as the same value (`strconv.AppendFloat(..,
//! -1, 32)` for a `float32`, `64` for a `float64`), in plain decimal between
//! `1e-6` and `1e21` and as `d.ddde±x` outside (exponent without leading
//! zeros). [`encode`] parses each number as an `f32` (then, failing that, an
//! `f64`), prints it back the way Go does and keeps the compact form only if
//! every number prints back to the very bytes received; any other text (other
//! spacing, more digits, another encoder) is stored as text. So a cached
//! answer is always byte-identical to the one Ollama gave, and a
//! 4096-dimension `float32` embedding takes 16 kB instead of about 40-80 kB.
//!
//! ```text
//! compact: 0x00 'v' 0x01 <width: 4 or 8> <little-endian floats …>
//! text:    the JSON array itself (starts with '[')
//! ```
//!
//! The leading zero byte cannot start JSON, so a value written before
//! compact vectors existed (text) is still read as text; the third byte is
//! the format's version.

use bytes::{BufMut, Bytes, BytesMut};

/// The first bytes of a compact vector, before the float width.
const MAGIC: [u8; 3] = [0x00, b'v', 0x01];

/// The stored form of `text` (a JSON array of numbers): compact when every
/// number prints back to the same bytes, else `text` itself.
pub fn encode(text: &Bytes) -> Bytes {
    compact::<f32>(text)
        .or_else(|| compact::<f64>(text))
        .unwrap_or_else(|| text.clone())
}

/// The JSON text of a stored vector; `None` when `stored` is neither a
/// compact vector nor a JSON array of numbers (a corrupt entry).
pub fn decode(stored: &Bytes) -> Option<Bytes> {
    match stored.get(..MAGIC.len()) {
        Some(magic) if magic == MAGIC => match stored.get(MAGIC.len()) {
            Some(4) => render::<f32>(&stored[MAGIC.len() + 1..]),
            Some(8) => render::<f64>(&stored[MAGIC.len() + 1..]),
            _ => None,
        },
        _ => super::plan::is_vector(stored).then(|| stored.clone()),
    }
}

/// A float width Go prints and this module stores.
trait Float: Copy + std::str::FromStr + ryu::Float {
    /// Bytes per value.
    const WIDTH: usize;
    fn to_le(self, out: &mut BytesMut);
    fn from_le(bytes: &[u8]) -> Self;
    fn is_zero(self) -> bool;
    fn is_negative(self) -> bool;
    /// Whether Go prints it in exponent form.
    fn exponent_form(self) -> bool;
}

impl Float for f32 {
    const WIDTH: usize = 4;
    fn to_le(self, out: &mut BytesMut) {
        out.put_f32_le(self);
    }
    fn from_le(bytes: &[u8]) -> Self {
        let mut raw = [0; 4];
        raw.copy_from_slice(bytes);
        f32::from_le_bytes(raw)
    }
    fn is_zero(self) -> bool {
        self == 0.0
    }
    fn is_negative(self) -> bool {
        self.is_sign_negative()
    }
    fn exponent_form(self) -> bool {
        let abs = self.abs();
        abs != 0.0 && !(1e-6..1e21).contains(&abs)
    }
}

impl Float for f64 {
    const WIDTH: usize = 8;
    fn to_le(self, out: &mut BytesMut) {
        out.put_f64_le(self);
    }
    fn from_le(bytes: &[u8]) -> Self {
        let mut raw = [0; 8];
        raw.copy_from_slice(bytes);
        f64::from_le_bytes(raw)
    }
    fn is_zero(self) -> bool {
        self == 0.0
    }
    fn is_negative(self) -> bool {
        self.is_sign_negative()
    }
    fn exponent_form(self) -> bool {
        let abs = self.abs();
        abs != 0.0 && !(1e-6..1e21).contains(&abs)
    }
}

fn compact<F: Float>(text: &[u8]) -> Option<Bytes> {
    // Exactly `[n,n,…]`, as Go writes it: no spaces, at least one number
    // (a compact `[]` could not tell `[]` from `[ ]`, and is no smaller).
    let inner = text.strip_prefix(b"[")?.strip_suffix(b"]")?;
    if inner.is_empty() {
        return None;
    }
    let count = inner.iter().filter(|&&b| b == b',').count() + 1;
    let mut out = BytesMut::with_capacity(MAGIC.len() + 1 + count * F::WIDTH);
    out.extend_from_slice(&MAGIC);
    out.put_u8(F::WIDTH as u8);
    let mut printed = Vec::with_capacity(32);
    // A number never holds a comma; printing back to the same bytes proves
    // each piece is one JSON number, written as Go writes it.
    for number in inner.split(|&b| b == b',') {
        let value: F = std::str::from_utf8(number).ok()?.parse().ok()?;
        printed.clear();
        go_format(value, &mut printed);
        if printed != number {
            return None;
        }
        value.to_le(&mut out);
    }
    Some(out.freeze())
}

fn render<F: Float>(floats: &[u8]) -> Option<Bytes> {
    if floats.is_empty() || !floats.len().is_multiple_of(F::WIDTH) {
        return None;
    }
    let mut out = Vec::with_capacity(floats.len() / F::WIDTH * 12 + 2);
    out.push(b'[');
    for (i, raw) in floats.chunks_exact(F::WIDTH).enumerate() {
        if i > 0 {
            out.push(b',');
        }
        go_format(F::from_le(raw), &mut out);
    }
    out.push(b']');
    Some(Bytes::from(out))
}

/// Appends `value` as Go's `encoding/json` prints it.
fn go_format<F: Float>(value: F, out: &mut Vec<u8>) {
    if value.is_zero() {
        out.extend_from_slice(if value.is_negative() { b"-0" } else { b"0" });
        return;
    }
    let mut buffer = ryu::Buffer::new();
    let shortest = buffer.format_finite(value).as_bytes();
    let (negative, digits, point) = decompose(shortest);
    if negative {
        out.push(b'-');
    }
    let digits = &digits.0[..digits.1];
    if value.exponent_form() {
        out.push(digits[0]);
        if digits.len() > 1 {
            out.push(b'.');
            out.extend_from_slice(&digits[1..]);
        }
        let exponent = point - 1;
        out.push(b'e');
        out.push(if exponent < 0 { b'-' } else { b'+' });
        out.extend_from_slice(exponent.unsigned_abs().to_string().as_bytes());
    } else if point <= 0 {
        out.extend_from_slice(b"0.");
        out.resize(out.len() + point.unsigned_abs() as usize, b'0');
        out.extend_from_slice(digits);
    } else {
        let point = point as usize;
        if point >= digits.len() {
            out.extend_from_slice(digits);
            out.resize(out.len() + point - digits.len(), b'0');
        } else {
            out.extend_from_slice(&digits[..point]);
            out.push(b'.');
            out.extend_from_slice(&digits[point..]);
        }
    }
}

/// Significant digits of ryu's output (at most 17) and how many there are.
type Digits = ([u8; 24], usize);

/// ryu's shortest text (`-1.25e-7`, `0.001`, `123.0`, `1e16`) as sign,
/// significant digits and decimal point position: the value is
/// `0.d₁d₂… × 10^point`.
fn decompose(text: &[u8]) -> (bool, Digits, i32) {
    let (negative, text) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, text),
    };
    let (mantissa, exponent) = match text.iter().position(|&b| b == b'e') {
        Some(at) => (
            &text[..at],
            std::str::from_utf8(&text[at + 1..])
                .ok()
                .and_then(|e| e.parse::<i32>().ok())
                .unwrap_or(0),
        ),
        None => (text, 0),
    };
    let mut digits: Digits = ([0; 24], 0);
    let mut point = 0i32;
    let mut seen_point = false;
    for &byte in mantissa {
        match byte {
            b'.' => seen_point = true,
            b'0' if digits.1 == 0 => {
                // A leading zero moves the point left once past it.
                if seen_point {
                    point -= 1;
                }
            }
            digit => {
                if digits.1 < digits.0.len() {
                    digits.0[digits.1] = digit;
                    digits.1 += 1;
                }
                if !seen_point {
                    point += 1;
                }
            }
        }
    }
    while digits.1 > 1 && digits.0[digits.1 - 1] == b'0' {
        digits.1 -= 1;
    }
    (negative, digits, point + exponent)
}

/// Go's float printing, for the cache's own tests.
#[cfg(test)]
pub(crate) mod tests_support {
    /// Appends `value` as Go's `encoding/json` prints a float32.
    pub(crate) fn go_format(value: f32, out: &mut Vec<u8>) {
        super::go_format(value, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn go32(x: f32) -> String {
        let mut out = Vec::new();
        go_format(x, &mut out);
        String::from_utf8(out).unwrap()
    }

    fn go64(x: f64) -> String {
        let mut out = Vec::new();
        go_format(x, &mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn floats_print_as_go_prints_them() {
        // What `json.Marshal(float32(x))` prints.
        for (x, go) in [
            (0.1f32, "0.1"),
            (1.0, "1"),
            (-2.5, "-2.5"),
            (100.0, "100"),
            (123_456_789.0, "123456790"),
            (0.000001, "0.000001"),
            (0.000_000_999_999_9, "9.999999e-7"),
            (1e-7, "1e-7"),
            (1.5e-10, "1.5e-10"),
            (1e21, "1e+21"),
            (3.402_823_5e38, "3.4028235e+38"),
            (0.012_345_679, "0.012345679"),
            (-0.0, "-0"),
            (0.0, "0"),
            (1e20, "100000000000000000000"),
        ] {
            assert_eq!(go32(x), go, "{x:e}");
        }
        for (x, go) in [
            (0.1f64, "0.1"),
            (1.0 / 3.0, "0.3333333333333333"),
            (1e-7, "1e-7"),
            (2e21, "2e+21"),
            (-123.456, "-123.456"),
        ] {
            assert_eq!(go64(x), go, "{x:e}");
        }
    }

    #[test]
    fn go_float32_text_is_stored_compactly_and_comes_back_identical() {
        let text = Bytes::from_static(b"[0.1,-0.012345679,1e-7,3.4028235e+38,0,-0,0.000001]");
        let stored = encode(&text);
        assert_eq!(&stored[..4], &[0, b'v', 1, 4]);
        assert_eq!(stored.len(), 4 + 7 * 4);
        assert_eq!(decode(&stored).unwrap(), text);
    }

    #[test]
    fn float64_text_is_stored_in_eight_bytes() {
        let text = Bytes::from_static(b"[0.3333333333333333,-0.1]");
        let stored = encode(&text);
        assert_eq!(stored[3], 8);
        assert_eq!(decode(&stored).unwrap(), text);
    }

    #[test]
    fn text_that_would_not_print_back_stays_text() {
        for text in [
            "[1.0]",
            "[ 1]",
            "[1 ,2]",
            "[1e-07]",
            "[0.10]",
            "[1E5]",
            "[0.100000000000000000000001]",
            "[]",
            "[1,]",
        ] {
            let text = Bytes::from(text);
            assert_eq!(encode(&text), text, "{text:?}");
        }
        // Old (text) entries and corrupt ones.
        assert_eq!(decode(&Bytes::from_static(b"[1,2]")).unwrap(), "[1,2]");
        for bad in [
            &b"{}"[..],
            b"\x00v\x01\x04abc",
            b"\x00v\x01\x05abcd",
            b"\x00v\x02",
        ] {
            assert!(decode(&Bytes::copy_from_slice(bad)).is_none(), "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn every_finite_f32_round_trips(bits in any::<u32>()) {
            let x = f32::from_bits(bits);
            prop_assume!(x.is_finite());
            let printed = go32(x);
            // The shortest text reads back as the same float.
            prop_assert_eq!(printed.parse::<f32>().unwrap().to_bits(), x.to_bits());
            let text = Bytes::from(format!("[{printed}]"));
            let stored = encode(&text);
            prop_assert_eq!(stored.len(), 8);
            prop_assert_eq!(decode(&stored).unwrap(), text);
        }

        #[test]
        fn every_finite_f64_round_trips(bits in any::<u64>()) {
            let x = f64::from_bits(bits);
            prop_assume!(x.is_finite());
            let printed = go64(x);
            prop_assert_eq!(printed.parse::<f64>().unwrap().to_bits(), x.to_bits());
            let text = Bytes::from(format!("[{printed},{printed}]"));
            prop_assert_eq!(decode(&encode(&text)).unwrap(), text);
        }
    }
}
