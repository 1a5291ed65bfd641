//! A certificate's validity period, read from its DER: just enough of X.509 to say "expired"
//! or "not yet valid" at start instead of leaving every client to find out.

use std::time::{SystemTime, UNIX_EPOCH};

/// Why `cert` is not valid at `now` ("expired on …", "is not valid before …"), or `None` when
/// it is, or when its validity cannot be read (rustls and the clients judge it then).
pub(super) fn problem(cert: &[u8], now: SystemTime) -> Option<String> {
    let ((not_before, shown_before), (not_after, shown_after)) = validity(cert)?;
    let now = i64::try_from(now.duration_since(UNIX_EPOCH).ok()?.as_secs()).ok()?;
    if now > not_after {
        Some(format!("expired on {shown_after}"))
    } else if now < not_before {
        Some(format!("is not valid before {shown_before}"))
    } else {
        None
    }
}

/// A time: Unix seconds, and as shown in messages.
type Time = (i64, String);

/// `Certificate → tbsCertificate → validity`: (notBefore, notAfter).
fn validity(cert: &[u8]) -> Option<(Time, Time)> {
    let (tag, certificate, _) = tlv(cert)?;
    if tag != 0x30 {
        return None;
    }
    let (tag, tbs, _) = tlv(certificate)?;
    if tag != 0x30 {
        return None;
    }
    // [0] version (optional), serialNumber, signature, issuer, then validity.
    let (first, _, mut rest) = tlv(tbs)?;
    if first == 0xa0 {
        rest = tlv(rest)?.2;
    }
    rest = tlv(rest)?.2;
    rest = tlv(rest)?.2;
    let (tag, validity, _) = tlv(rest)?;
    if tag != 0x30 {
        return None;
    }
    let (before_tag, before, rest) = tlv(validity)?;
    let (after_tag, after, _) = tlv(rest)?;
    Some((time(before_tag, before)?, time(after_tag, after)?))
}

/// The subject's Common Name (the first `CN`), read from the DER of a certificate that rustls
/// already verified: `tbsCertificate → subject → RDN → (2.5.4.3, string)`.
pub(super) fn common_name(cert: &[u8]) -> Option<String> {
    const COMMON_NAME: [u8; 3] = [0x55, 0x04, 0x03];
    let (_, certificate, _) = tlv(cert)?;
    let (_, tbs, _) = tlv(certificate)?;
    let (first, _, mut rest) = tlv(tbs)?;
    if first == 0xa0 {
        rest = tlv(rest)?.2;
    }
    // Past [0] version (optional) and serialNumber: signature, issuer, validity; then the
    // subject.
    for _ in 0..3 {
        rest = tlv(rest)?.2;
    }
    let (tag, mut names, _) = tlv(rest)?;
    if tag != 0x30 {
        return None;
    }
    while !names.is_empty() {
        let (_, set, after) = tlv(names)?;
        names = after;
        let (_, attribute, _) = tlv(set)?;
        let (oid_tag, oid, value) = tlv(attribute)?;
        if oid_tag == 0x06 && oid == COMMON_NAME {
            let (string_tag, text, _) = tlv(value)?;
            // UTF8String, PrintableString, IA5String.
            if !matches!(string_tag, 0x0c | 0x13 | 0x16) {
                return None;
            }
            return String::from_utf8(text.to_vec()).ok();
        }
    }
    None
}

/// One DER element: tag, contents, what follows.
fn tlv(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, mut rest) = rest.split_first()?;
    let length = if first < 0x80 {
        usize::from(first)
    } else {
        let count = usize::from(first & 0x7f);
        if count == 0 || count > 4 || rest.len() < count {
            return None;
        }
        let (bytes, after) = rest.split_at(count);
        rest = after;
        bytes
            .iter()
            .fold(0usize, |length, &byte| (length << 8) | usize::from(byte))
    };
    if rest.len() < length {
        return None;
    }
    let (content, after) = rest.split_at(length);
    Some((tag, content, after))
}

/// UTCTime (`YYMMDDHHMMSSZ`, 1950–2049) or GeneralizedTime (`YYYYMMDDHHMMSSZ`).
fn time(tag: u8, content: &[u8]) -> Option<Time> {
    let text = std::str::from_utf8(content).ok()?;
    let digits = text.strip_suffix('Z')?;
    let (year, rest) = match (tag, digits.len()) {
        (0x17, 12) => {
            let short: i64 = digits.get(..2)?.parse().ok()?;
            (
                if short >= 50 {
                    1900 + short
                } else {
                    2000 + short
                },
                &digits[2..],
            )
        }
        (0x18, 14) => (digits.get(..4)?.parse().ok()?, &digits[4..]),
        _ => return None,
    };
    let field = |at: usize| -> Option<i64> { rest.get(at..at + 2)?.parse().ok() };
    let (month, day, hour, minute, second) =
        (field(0)?, field(2)?, field(4)?, field(6)?, field(8)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        return None;
    }
    let unix = days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second;
    let shown = format!("{year:04}-{month:02}-{day:02} {hour:02}:{minute:02}:{second:02} UTC");
    Some((unix, shown))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_common_name_is_read_from_the_subject() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "lab");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "svc-backup");
        let cert = params.self_signed(&key).unwrap();
        assert_eq!(common_name(cert.der()).as_deref(), Some("svc-backup"));
        let mut params = rcgen::CertificateParams::new(vec!["host".to_owned()]).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        let cert = params.self_signed(&key).unwrap();
        assert_eq!(common_name(cert.der()), None);
    }

    #[test]
    fn dates_count_days_from_the_epoch() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(2026, 12, 4), 20_791);
    }

    #[test]
    fn both_time_forms_are_read() {
        assert_eq!(
            time(0x17, b"200101000000Z"),
            Some((1_577_836_800, "2020-01-01 00:00:00 UTC".to_owned()))
        );
        assert_eq!(
            time(0x18, b"20900101000000Z").map(|(unix, _)| unix),
            Some(3_786_912_000)
        );
        assert_eq!(time(0x17, b"2001010000Z"), None);
        assert_eq!(time(0x16, b"200101000000Z"), None);
    }

    #[test]
    fn garbage_is_not_a_certificate() {
        assert_eq!(problem(b"", SystemTime::now()), None);
        assert_eq!(problem(&[0x30, 0x84, 0xff], SystemTime::now()), None);
    }
}
