//! Parsing durations ("200ms", "1.5s", "10m", "24h", "7d") and byte sizes
//! ("64KiB", "1M", "4096") for the watch flags.

use std::time::Duration;

/// Parses a duration: a decimal number followed by ms, s, m, h or d
/// ("0" alone is accepted).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("{text:?}: missing unit (ms, s, m, h or d)"))?;
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{text:?}: not a number followed by a unit"))?;
    let scale = match unit.trim() {
        "ms" => 1e-3,
        "s" | "sec" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        "d" => 86400.0,
        other => {
            return Err(format!(
                "{text:?}: unknown unit {other:?} (ms, s, m, h or d)"
            ))
        }
    };
    let secs = value * scale;
    if !secs.is_finite() || !(0.0..=1e9).contains(&secs) {
        return Err(format!("{text:?}: out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Parses a byte count: a number with an optional K/M/G suffix (powers of
/// 1024; "KiB", "k", "KB" all mean 1024).
// Used by the bench's load generator only (`bench watch --size`).
#[cfg_attr(not(feature = "bench"), allow(dead_code))]
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: u64 = num
        .parse()
        .map_err(|_| format!("{text:?}: not a size such as 65536 or 64KiB"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        other => return Err(format!("{text:?}: unknown unit {other:?}")),
    };
    value
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?}: too large"))
}

/// A duration for humans: "850 µs", "12.3 ms", "4.20 s".
pub fn human_duration(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 1e-3 {
        format!("{:.0} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("200ms"), Ok(Duration::from_millis(200)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86400)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("ms").is_err());
        assert!(parse_duration("5y").is_err());
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("65536"), Ok(65536));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999999G").is_err());
    }
}
