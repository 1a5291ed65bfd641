//! An IP network (`address/prefix`), for `auth.trusted_proxies`.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// An IPv4 or IPv6 network. Built only by parsing, so its address is always the network's
/// first address and its prefix fits the family.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

/// A string that is not `address[/prefix]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{0}' is not an IP address or CIDR")]
pub struct CidrError(String);

impl Cidr {
    /// Whether `address` is inside the network. An IPv4-mapped IPv6 address counts as IPv4.
    pub fn contains(&self, address: IpAddr) -> bool {
        match (self.network, canonical(address)) {
            (IpAddr::V4(network), IpAddr::V4(address)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(address) & mask == u32::from(network)
            }
            (IpAddr::V6(network), IpAddr::V6(address)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(address) & mask == u128::from(network)
            }
            _ => false,
        }
    }
}

/// `::ffff:a.b.c.d` as `a.b.c.d`; every other address as it is.
pub fn canonical(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(address, IpAddr::V4),
        v4 => v4,
    }
}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let error = || CidrError(text.to_owned());
        let (address, prefix) = match text.split_once('/') {
            Some((address, prefix)) => (address, Some(prefix)),
            None => (text, None),
        };
        let address: IpAddr = address.parse().map_err(|_| error())?;
        let bits: u8 = if address.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(prefix) if !prefix.is_empty() && prefix.bytes().all(|b| b.is_ascii_digit()) => {
                prefix
                    .parse::<u8>()
                    .ok()
                    .filter(|p| *p <= bits)
                    .ok_or_else(error)?
            }
            Some(_) => return Err(error()),
            None => bits,
        };
        let cidr = Cidr {
            network: address,
            prefix,
        };
        let network = match address {
            IpAddr::V4(v4) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
                IpAddr::from((u32::from(v4) & mask).to_be_bytes())
            }
            IpAddr::V6(v6) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
                IpAddr::from((u128::from(v6) & mask).to_be_bytes())
            }
        };
        Ok(Cidr { network, ..cidr })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl fmt::Debug for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(text: &str) -> Cidr {
        text.parse().unwrap()
    }

    #[test]
    fn parses_and_normalises() {
        assert_eq!(cidr("10.1.2.3/8").to_string(), "10.0.0.0/8");
        assert_eq!(cidr("192.168.1.10").to_string(), "192.168.1.10/32");
        assert_eq!(cidr("fd00::1/8").to_string(), "fd00::/8");
        assert_eq!(cidr("0.0.0.0/0").to_string(), "0.0.0.0/0");
        for bad in [
            "",
            "10.0.0.0/33",
            "10.0.0.0/",
            "10.0.0.0/+8",
            "host/8",
            "::/129",
        ] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn contains_by_family_and_prefix() {
        let ten = cidr("10.0.0.0/8");
        assert!(ten.contains("10.255.0.1".parse().unwrap()));
        assert!(ten.contains("::ffff:10.0.0.1".parse().unwrap()));
        assert!(!ten.contains("11.0.0.1".parse().unwrap()));
        assert!(!ten.contains("::1".parse().unwrap()));
        assert!(cidr("0.0.0.0/0").contains("8.8.8.8".parse().unwrap()));
        assert!(cidr("fd00::/8").contains("fd12::1".parse().unwrap()));
    }
}
