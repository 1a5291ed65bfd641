//! Lenient scalar types for the raw schema.
//!
//! The file format is shared with a Python project whose YAML 1.1 parser and lax validation
//! accepted `yes`/`no` booleans and numbers written as strings, and environment overrides arrive
//! as text coerced by shape. These wrappers accept every spelling an existing config or an
//! override may use, and reject the rest with a message that never repeats a string value
//! (it may be a credential).

use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserialize, Deserializer, Visitor};

/// Text; numbers and booleans are accepted and printed back (`12345` → `"12345"`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Text(pub String);

/// An integer; range checks with precise messages happen during resolution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Int(pub i64);

/// A floating-point number.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Float(pub f64);

/// A boolean: `true`/`false`, `yes`/`no`, `on`/`off` (any case), `1`/`0`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Flag(pub bool);

/// A duration: a number of seconds (int or float) or a humantime string (`"90s"`, `"5m"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Seconds(pub Duration);

/// A byte size: a non-negative integer of bytes, or a string with a unit (`"24GiB"`, `"24 GB"`,
/// `"8000MiB"`; binary units are powers of 1024, decimal ones of 1000).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Bytes(pub u64);

/// `queue.model_swap.max_defer`: one duration for every tier, or a map of tiers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum PerTier {
    All(Seconds),
    Each {
        high: Option<Seconds>,
        normal: Option<Seconds>,
        low: Option<Seconds>,
    },
}

/// `keep_alive.default` before validation: a string or a number, kept as written.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum KeepAliveValue {
    Text(String),
    Int(i64),
    Float(f64),
}

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TextVisitor;
        impl Visitor<'_> for TextVisitor {
            type Value = Text;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
        }
        deserializer.deserialize_any(TextVisitor)
    }
}

impl<'de> Deserialize<'de> for Int {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct IntVisitor;
        impl Visitor<'_> for IntVisitor {
            type Value = Int;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Int, E> {
                Ok(Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Int, E> {
                i64::try_from(v)
                    .map(Int)
                    .map_err(|_| E::custom(format!("{v} is too large")))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Int, E> {
                if v.fract() == 0.0 && v.abs() < 9.0e15 {
                    return Ok(Int(v as i64));
                }
                Err(E::custom(format!("expected an integer, got {v}")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Int, E> {
                v.trim()
                    .parse()
                    .map(Int)
                    .map_err(|_| E::invalid_type(de::Unexpected::Str(v), &self))
            }
        }
        deserializer.deserialize_any(IntVisitor)
    }
}

impl<'de> Deserialize<'de> for Float {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct FloatVisitor;
        impl Visitor<'_> for FloatVisitor {
            type Value = Float;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Float, E> {
                Ok(Float(v as f64))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Float, E> {
                Ok(Float(v as f64))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Float, E> {
                Ok(Float(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Float, E> {
                match v.trim().parse::<f64>() {
                    Ok(number) if number.is_finite() => Ok(Float(number)),
                    _ => Err(E::invalid_type(de::Unexpected::Str(v), &self)),
                }
            }
        }
        deserializer.deserialize_any(FloatVisitor)
    }
}

impl<'de> Deserialize<'de> for Flag {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct FlagVisitor;
        impl Visitor<'_> for FlagVisitor {
            type Value = Flag;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("true or false")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Flag, E> {
                Ok(Flag(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Flag, E> {
                match v {
                    0 => Ok(Flag(false)),
                    1 => Ok(Flag(true)),
                    _ => Err(E::invalid_value(de::Unexpected::Signed(v), &self)),
                }
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Flag, E> {
                match v {
                    0 => Ok(Flag(false)),
                    1 => Ok(Flag(true)),
                    _ => Err(E::invalid_value(de::Unexpected::Unsigned(v), &self)),
                }
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Flag, E> {
                match v.trim().to_ascii_lowercase().as_str() {
                    "true" | "yes" | "on" | "1" => Ok(Flag(true)),
                    "false" | "no" | "off" | "0" => Ok(Flag(false)),
                    _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
                }
            }
        }
        deserializer.deserialize_any(FlagVisitor)
    }
}

impl<'de> Deserialize<'de> for Seconds {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SecondsVisitor;
        impl Visitor<'_> for SecondsVisitor {
            type Value = Seconds;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number of seconds or a duration such as \"90s\" or \"5m\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Seconds, E> {
                Ok(Seconds(Duration::from_secs(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Seconds, E> {
                u64::try_from(v)
                    .map(|v| Seconds(Duration::from_secs(v)))
                    .map_err(|_| E::custom(format!("a duration cannot be negative, got {v}")))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Seconds, E> {
                Duration::try_from_secs_f64(v).map(Seconds).map_err(|_| {
                    E::custom(format!(
                        "a duration must be a non-negative finite number, got {v}"
                    ))
                })
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Seconds, E> {
                parse_duration(v).map(Seconds).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(SecondsVisitor)
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct BytesVisitor;
        impl Visitor<'_> for BytesVisitor {
            type Value = Bytes;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte size such as 24GiB, \"24 GB\", 8000MiB or a number of bytes")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Bytes, E> {
                Ok(Bytes(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Bytes, E> {
                u64::try_from(v)
                    .map(Bytes)
                    .map_err(|_| E::custom(format!("a byte size cannot be negative, got {v}")))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Bytes, E> {
                Err(E::invalid_type(de::Unexpected::Float(v), &self))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Bytes, E> {
                parse_bytes(v).map(Bytes).ok_or_else(|| {
                    E::custom(
                        "not a byte size: use a number of bytes or a number with a unit such \
                         as 24GiB, \"24 GB\" or 8000MiB",
                    )
                })
            }
        }
        deserializer.deserialize_any(BytesVisitor)
    }
}

impl<'de> Deserialize<'de> for PerTier {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        /// The map form; unknown tiers are reported as unknown keys like any other.
        #[derive(Default, serde::Deserialize)]
        #[serde(default)]
        struct Each {
            high: Option<Seconds>,
            normal: Option<Seconds>,
            low: Option<Seconds>,
        }
        struct PerTierVisitor;
        impl<'de> Visitor<'de> for PerTierVisitor {
            type Value = PerTier;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number of seconds, or a map of tiers {high, normal, low} to seconds")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<PerTier, E> {
                Seconds::deserialize(de::value::U64Deserializer::new(v)).map(PerTier::All)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<PerTier, E> {
                Seconds::deserialize(de::value::I64Deserializer::new(v)).map(PerTier::All)
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<PerTier, E> {
                Seconds::deserialize(de::value::F64Deserializer::new(v)).map(PerTier::All)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<PerTier, E> {
                Seconds::deserialize(de::value::StrDeserializer::new(v)).map(PerTier::All)
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<PerTier, A::Error> {
                let each = Each::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(PerTier::Each {
                    high: each.high,
                    normal: each.normal,
                    low: each.low,
                })
            }
        }
        deserializer.deserialize_any(PerTierVisitor)
    }
}

impl<'de> Deserialize<'de> for KeepAliveValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeepAliveVisitor;
        impl Visitor<'_> for KeepAliveVisitor {
            type Value = KeepAliveValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration string such as \"5m\" or a number of seconds")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<KeepAliveValue, E> {
                Ok(KeepAliveValue::Text(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<KeepAliveValue, E> {
                Ok(KeepAliveValue::Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<KeepAliveValue, E> {
                i64::try_from(v)
                    .map(KeepAliveValue::Int)
                    .map_err(|_| E::custom(format!("{v} is too large")))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<KeepAliveValue, E> {
                if v.is_finite() {
                    Ok(KeepAliveValue::Float(v))
                } else {
                    Err(E::custom(format!("expected a finite number, got {v}")))
                }
            }
        }
        deserializer.deserialize_any(KeepAliveVisitor)
    }
}

/// Parses `"90"`, `"1.5"` (seconds) or a humantime duration (`"90s"`, `"5m"`, `"1h 30m"`).
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if let Ok(seconds) = text.parse::<f64>()
        && text
            .bytes()
            .all(|b| b.is_ascii_digit() || b == b'.' || b == b'-')
    {
        return Duration::try_from_secs_f64(seconds)
            .map_err(|_| format!("a duration cannot be negative, got {text}"));
    }
    humantime::parse_duration(text).map_err(|error| {
        format!(
            "{text:?} is not a duration ({error}); use seconds or a string like \"90s\" or \"5m\""
        )
    })
}

/// Parses a byte size written with an optional unit (`"24GiB"`, `"24 GB"`, `"1.5 TiB"`, `"1024"`);
/// `None` if it is not one or overflows `u64`.
pub(crate) fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    // A plain integer is exact; `bytesize` would go through a float.
    if let Ok(bytes) = text.parse::<u64>() {
        return Some(bytes);
    }
    let size: bytesize::ByteSize = text.parse().ok()?;
    // `bytesize` saturates instead of failing on overflow.
    (size.as_u64() != u64::MAX).then_some(size.as_u64())
}

/// Whether `text` is a valid Go `time.ParseDuration` string, which is what Ollama applies to a
/// string `keep_alive`: `"0"`, or one or more `<number><unit>` with unit ns, us, µs, ms, s, m, h,
/// optionally signed. A unitless number other than `"0"` is invalid.
pub(crate) fn is_go_duration(text: &str) -> bool {
    let rest = text.strip_prefix(['-', '+']).unwrap_or(text);
    if rest == "0" {
        return true;
    }
    if rest.is_empty() {
        return false;
    }
    let mut rest = rest;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number = &rest[..number_len];
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return false;
        }
        rest = &rest[number_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        if !matches!(
            &rest[..unit_len],
            "ns" | "us" | "µs" | "μs" | "ms" | "s" | "m" | "h"
        ) {
            return false;
        }
        rest = &rest[unit_len..];
    }
    true
}

/// Formats a duration for messages: `90s`, `5m`, `1m 30s`, `250ms`.
pub(crate) fn show(duration: Duration) -> String {
    humantime::format_duration(duration).to_string()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn from_yaml<T: for<'de> Deserialize<'de>>(yaml: &str) -> Result<T, String> {
        serde_yaml::from_str(yaml).map_err(|error| error.to_string())
    }

    #[test]
    fn durations_accept_numbers_and_strings() {
        assert_eq!(
            from_yaml::<Seconds>("90"),
            Ok(Seconds(Duration::from_secs(90)))
        );
        assert_eq!(
            from_yaml::<Seconds>("1.5"),
            Ok(Seconds(Duration::from_millis(1500)))
        );
        assert_eq!(
            from_yaml::<Seconds>("\"90s\""),
            Ok(Seconds(Duration::from_secs(90)))
        );
        assert_eq!(
            from_yaml::<Seconds>("5m"),
            Ok(Seconds(Duration::from_secs(300)))
        );
        assert_eq!(
            from_yaml::<Seconds>("\"30\""),
            Ok(Seconds(Duration::from_secs(30)))
        );
        assert!(from_yaml::<Seconds>("-1").is_err());
        assert!(
            from_yaml::<Seconds>("soon")
                .unwrap_err()
                .contains("not a duration")
        );
    }

    #[test]
    fn lenient_scalars() {
        assert_eq!(from_yaml::<Text>("12345"), Ok(Text("12345".into())));
        assert_eq!(from_yaml::<Text>("true"), Ok(Text("true".into())));
        assert_eq!(from_yaml::<Int>("\"42\""), Ok(Int(42)));
        assert_eq!(from_yaml::<Int>("42.0"), Ok(Int(42)));
        assert!(from_yaml::<Int>("4.5").is_err());
        assert_eq!(from_yaml::<Flag>("yes"), Ok(Flag(true)));
        assert_eq!(from_yaml::<Flag>("Off"), Ok(Flag(false)));
        assert!(from_yaml::<Flag>("maybe").is_err());
        assert_eq!(from_yaml::<Float>("\"2.5\""), Ok(Float(2.5)));
        assert!(from_yaml::<Text>("[1, 2]").is_err());
    }

    #[test]
    fn byte_sizes() {
        const GIB: u64 = 1 << 30;
        assert_eq!(from_yaml::<Bytes>("24GiB"), Ok(Bytes(24 * GIB)));
        assert_eq!(from_yaml::<Bytes>("24 GB"), Ok(Bytes(24_000_000_000)));
        assert_eq!(from_yaml::<Bytes>("8000MiB"), Ok(Bytes(8000 << 20)));
        assert_eq!(from_yaml::<Bytes>("\" 16 gib \""), Ok(Bytes(16 * GIB)));
        assert_eq!(from_yaml::<Bytes>("1.5 GiB"), Ok(Bytes(3 * GIB / 2)));
        assert_eq!(from_yaml::<Bytes>("25769803776"), Ok(Bytes(24 * GIB)));
        assert_eq!(from_yaml::<Bytes>("\"1024\""), Ok(Bytes(1024)));
        for bad in [
            "-1",
            "1.5",
            "lots",
            "24 XB",
            "\"\"",
            "[1]",
            "99999999999 EiB",
        ] {
            let error = from_yaml::<Bytes>(bad).unwrap_err();
            assert!(
                !error.contains("lots") && !error.contains("XB"),
                "{bad}: {error}"
            );
        }
    }

    #[test]
    fn per_tier_durations() {
        assert_eq!(
            from_yaml::<PerTier>("2"),
            Ok(PerTier::All(Seconds(Duration::from_secs(2))))
        );
        assert_eq!(
            from_yaml::<PerTier>("\"500ms\""),
            Ok(PerTier::All(Seconds(Duration::from_millis(500))))
        );
        assert_eq!(
            from_yaml::<PerTier>("{high: 0.5, low: 60}"),
            Ok(PerTier::Each {
                high: Some(Seconds(Duration::from_millis(500))),
                normal: None,
                low: Some(Seconds(Duration::from_secs(60))),
            })
        );
        assert!(from_yaml::<PerTier>("[1]").is_err());
        assert!(from_yaml::<PerTier>("{high: soon}").is_err());
        assert!(from_yaml::<PerTier>("-1").is_err());
    }

    #[test]
    fn go_durations() {
        for valid in [
            "0", "5m", "-1s", "1h30m", "1.5h", "300ms", "10us", "+2m", "-0",
        ] {
            assert!(is_go_duration(valid), "{valid}");
        }
        for invalid in ["", "5", "300", "m", "5 m", "1d", "5m3", "1..5s", "forever"] {
            assert!(!is_go_duration(invalid), "{invalid}");
        }
    }
}
