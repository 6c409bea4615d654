//! Durations as Istio's YAML writes them: Go's format (`30ms`, `1.5s`, `5m`, `1h30m`), which also
//! covers protobuf JSON's `"<seconds>s"`.

use std::fmt;
use std::time::Duration as StdDuration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::text::Quoted;

/// A non-negative duration parsed from Go's notation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Duration(pub StdDuration);

impl Duration {
    pub fn parse(text: &str) -> Result<Self, String> {
        let invalid = || {
            format!(
                "{} is not a duration (e.g. 30ms, 1.5s, 5m, 1h30m)",
                Quoted(text)
            )
        };
        let mut rest = text.trim();
        if rest == "0" {
            return Ok(Self(StdDuration::ZERO));
        }
        if rest.is_empty() || rest.starts_with('-') {
            return Err(invalid());
        }
        let mut nanos: u128 = 0;
        while !rest.is_empty() {
            let number_end = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .ok_or_else(invalid)?;
            let (number, tail) = rest.split_at(number_end);
            let unit_end = tail
                .find(|c: char| c.is_ascii_digit() || c == '.')
                .unwrap_or(tail.len());
            let (unit, tail) = tail.split_at(unit_end);
            let per_unit: u128 = match unit {
                "ns" => 1,
                "us" | "µs" => 1_000,
                "ms" => 1_000_000,
                "s" => 1_000_000_000,
                "m" => 60_000_000_000,
                "h" => 3_600_000_000_000,
                _ => return Err(invalid()),
            };
            let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
            if whole.is_empty() && fraction.is_empty() {
                return Err(invalid());
            }
            let whole: u128 = match whole {
                "" => 0,
                w => w.parse().map_err(|_| invalid())?,
            };
            let mut part = whole.checked_mul(per_unit).ok_or_else(invalid)?;
            let mut scale = per_unit;
            for digit in fraction.chars() {
                let digit = digit.to_digit(10).ok_or_else(invalid)?;
                scale /= 10;
                part += u128::from(digit) * scale;
            }
            nanos = nanos.checked_add(part).ok_or_else(invalid)?;
            rest = tail;
        }
        let secs = u64::try_from(nanos / 1_000_000_000).map_err(|_| invalid())?;
        Ok(Self(StdDuration::new(secs, (nanos % 1_000_000_000) as u32)))
    }

    pub fn as_std(self) -> StdDuration {
        self.0
    }

    /// As a protobuf Duration for Envoy.
    pub fn to_proto(self) -> envoy_types::pb::google::protobuf::Duration {
        envoy_types::pb::google::protobuf::Duration {
            seconds: i64::try_from(self.0.as_secs()).unwrap_or(i64::MAX),
            nanos: self.0.subsec_nanos() as i32,
        }
    }
}

impl fmt::Display for Duration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (secs, nanos) = (self.0.as_secs(), self.0.subsec_nanos());
        if nanos == 0 {
            write!(f, "{secs}s")
        } else if nanos % 1_000_000 == 0 && secs == 0 {
            write!(f, "{}ms", nanos / 1_000_000)
        } else {
            let text = format!("{secs}.{nanos:09}");
            write!(f, "{}s", text.trim_end_matches('0'))
        }
    }
}

impl<'de> Deserialize<'de> for Duration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// In protobuf JSON's form (seconds with a fraction: `0.030s`), which Istio's API and MCP bodies
/// read.
impl Serialize for Duration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let (secs, nanos) = (self.0.as_secs(), self.0.subsec_nanos());
        match nanos {
            0 => serializer.collect_str(&format_args!("{secs}s")),
            _ => {
                let fraction = format!("{nanos:09}");
                let fraction = fraction.trim_end_matches('0');
                serializer.collect_str(&format_args!("{secs}.{fraction}s"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(text: &str) -> u128 {
        Duration::parse(text).unwrap().0.as_millis()
    }

    #[test]
    fn go_notation() {
        assert_eq!(ms("30ms"), 30);
        assert_eq!(ms("1.5s"), 1500);
        assert_eq!(ms("5m"), 300_000);
        assert_eq!(ms("1h30m"), 5_400_000);
        assert_eq!(ms(".5s"), 500);
        assert_eq!(ms("0"), 0);
        assert_eq!(Duration::parse("250us").unwrap().0.as_micros(), 250);
        for bad in ["", "5", "-1s", "1d", "s", "1.2.3s", "1sm"] {
            assert!(Duration::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn shown_as_parsed() {
        for text in ["30ms", "2s", "1.5s"] {
            assert_eq!(Duration::parse(text).unwrap().to_string(), text);
        }
    }
}
