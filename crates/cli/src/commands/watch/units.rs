//! Durations ("200ms", "1.5s", "10m", "24h", "7d") and byte sizes
//! ("64KiB", "1M", "4096") for the watch flags, in the CLI's one grammar
//! (`crate::args::value`), and durations shown to humans.

use std::time::Duration;

/// Parses a duration in the CLI's one grammar ([`crate::args::value::duration`]),
/// at most 10^9 seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let d = crate::args::value::duration(text)?;
    if d.as_secs_f64() > 1e9 {
        return Err(format!("{text:?}: out of range"));
    }
    Ok(d)
}

/// Parses a byte count in the CLI's one grammar
/// ([`crate::args::value::size`]: powers of 1024).
// Used by the bench's load generator only (`bench watch --size`).
#[cfg_attr(not(feature = "bench"), allow(dead_code))]
pub fn parse_size(text: &str) -> Result<u64, String> {
    crate::args::value::size(text)
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
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
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
