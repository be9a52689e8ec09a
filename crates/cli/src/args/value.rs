//! Values several commands share (payload mode, key size, backend) and
//! the parsers that check a flag's value as it is parsed, so that a bad
//! one is a usage error (exit 2). A leaf: it imports no command.

use clap::ValueEnum;

/// Payload mode.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModeArg {
    /// Segmented AES-GCM, Tink AES-GCM-HKDF streaming compatible (default).
    Gcm,
    /// Segmented AES-CBC with HMAC-SHA2 (RFC 7518), encrypt-then-MAC.
    Cbc,
}

/// AES key size.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BitsArg {
    /// AES-128.
    #[value(name = "128")]
    B128,
    /// AES-192 (not Tink-interoperable in gcm mode).
    #[value(name = "192")]
    B192,
    /// AES-256 (default).
    #[value(name = "256")]
    B256,
}

impl BitsArg {
    /// Key size in bits.
    pub fn bits(self) -> u32 {
        match self {
            BitsArg::B128 => 128,
            BitsArg::B192 => 192,
            BitsArg::B256 => 256,
        }
    }
}

/// Crypto backend.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendArg {
    /// OpenSSL EVP.
    Openssl,
    /// ring (GCM 128/256 only).
    Ring,
    /// RustCrypto (pure Rust).
    Rustcrypto,
    /// AWS-LC (GCM only; 512-bit VAES where the CPU has AVX-512).
    #[value(name = "aws-lc")]
    AwsLc,
}

impl BackendArg {
    /// The backend's name in the cipher crate.
    pub fn name(self) -> &'static str {
        match self {
            BackendArg::Openssl => "openssl",
            BackendArg::Ring => "ring",
            BackendArg::Rustcrypto => "rustcrypto",
            BackendArg::AwsLc => "aws-lc",
        }
    }
}

/// `--tpm`/`TPMCRYPT_TCTI`, checked as it is parsed so that a bad TCTI is
/// a usage error (exit 2), whichever command would have used it.
/// An empty value (`TPMCRYPT_TCTI=`) means the default, as an unset one.
pub fn tcti_value(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Ok(String::new());
    }
    s.parse::<tpmcrypt_tpmkey::Tcti>()
        .map(|_| s.to_string())
        .map_err(value_error)
}

/// `--pcrs BANK:LIST`, checked as it is parsed (a bad bank or index is a
/// usage error).
pub fn pcrs_value(s: &str) -> Result<String, String> {
    tpmcrypt_tpmkey::PcrSelection::parse(s)
        .map(|_| s.to_string())
        .map_err(value_error)
}

/// The units a duration may use, as its error message names them.
const DURATION_UNITS: &[&str] = &["ms", "s", "sec", "m", "min", "h", "d"];

/// The forms a duration may take, for error messages.
const DURATION_FORMS: &str = "a number and a unit (ms, s, m, h or d), e.g. 200ms, 1.5s, 10m, \
                              1h30m, 7d; a bare number is seconds";

/// A duration flag (`--settle`, `--stats-interval`, `--rotate`, `--ttl`,
/// `bench --unbind`, the load generator's): the one grammar every command
/// uses, parsed by `humantime` ("200ms", "1.5s", "1h30m", "1h 30m", "0"),
/// and a bare number is seconds ("45", "1.5"), for every flag alike (as
/// `--ttl` always took it, and as systemd reads a time span).
///
/// A thin layer over the crate, because humantime also knows weeks,
/// months and years (and spellings such as "nsec") that tpmcrypt never
/// documented: "5y" has always been refused, and stays a usage error
/// showing the valid forms.
pub fn duration(text: &str) -> Result<std::time::Duration, String> {
    let t = text.trim();
    let bad = |why: &dyn std::fmt::Display| format!("{text:?}: {why}; expected {DURATION_FORMS}");
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return humantime::parse_duration(&format!("{t}s")).map_err(|e| bad(&e));
    }
    let units = t
        .split(|c: char| c.is_ascii_digit() || c == '.' || c.is_whitespace())
        .filter(|u| !u.is_empty());
    for unit in units {
        if !DURATION_UNITS.contains(&unit) {
            return Err(bad(&format_args!("unknown unit {unit:?}")));
        }
    }
    humantime::parse_duration(t).map_err(|e| bad(&e))
}

/// `--ttl DURATION`: a [`duration`] ("15m", or "45" seconds), never zero. Checked as it is parsed; the text itself is kept, as
/// the agent shows it.
pub fn ttl_value(s: &str) -> Result<String, String> {
    ttl(s).map(|_| s.to_string())
}

/// The duration `--ttl` names (see [`ttl_value`]).
pub fn ttl(s: &str) -> Result<std::time::Duration, String> {
    let d = duration(s)?;
    if d.is_zero() {
        return Err(format!(
            "{s:?}: must be longer than zero, e.g. 90s, 15m, 2h"
        ));
    }
    // The agent adds it to its clock: a time no session needs, and one
    // that cannot overflow an `Instant`.
    if d > MAX_TTL {
        return Err(format!(
            "{s:?}: longer than a year; expected {DURATION_FORMS}"
        ));
    }
    Ok(d)
}

/// The longest `--ttl`: a year.
pub const MAX_TTL: std::time::Duration = std::time::Duration::from_secs(366 * 24 * 3600);

/// A rate or ratio (`bench watch --rate`, `--calibrate-rate`,
/// `--utilisation`): a finite number within `1e-3..=1e6`, so that the time
/// between two arrivals is neither endless nor zero.
#[cfg_attr(not(feature = "bench"), allow(dead_code))]
pub fn positive_rate(text: &str) -> Result<f64, String> {
    let v: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?}: not a number"))?;
    if !(1e-3..=1e6).contains(&v) {
        return Err(format!("{text:?}: must be between 0.001 and 1000000"));
    }
    Ok(v)
}

/// A positive [`duration`] (`bench --unbind`): zero is a usage error.
#[cfg_attr(not(feature = "bench"), allow(dead_code))]
pub fn positive_duration(text: &str) -> Result<std::time::Duration, String> {
    let d = duration(text)?;
    if d.is_zero() {
        return Err(format!(
            "{text:?}: must be longer than zero, e.g. 300ms, 1.2s"
        ));
    }
    Ok(d)
}

/// The forms a size may take, for error messages.
const SIZE_FORMS: &str = "a number of bytes and an optional unit K, M or G (KiB, MiB, GiB: \
                          powers of 1024), e.g. 4096, 64KiB, 16K, 1M, 1.5MiB";

/// A size flag (`--sizes`, `--segment-size`, the load generator's
/// `--size`): a number of bytes with an optional unit, "4096", "64KiB",
/// "16K", "1M", "2g", "1.5MiB".
///
/// Units are powers of 1024 (`K`, `Ki`, `KiB` in any case), and stop at
/// `G`. `KB`, `MB` and `GB` are refused rather than guessed: they mean
/// 1000 to some tools (dd, bytesize, systemd) and 1024 to others, and a
/// size that silently means another thing is worse than a usage error. A
/// fraction is taken where the result is a whole number of bytes ("1.5K"
/// is 1536; "1.5", "1.3K" are refused). Written out here, not through
/// `bytesize`, because that crate reads `KB` as 1000 and rounds a fraction
/// of a byte away ("1.5" became 1).
pub fn size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let bad = |why: &str| format!("{text:?}: {why}; expected {SIZE_FORMS}");
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "ki" | "kib" => 10,
        "m" | "mi" | "mib" => 20,
        "g" | "gi" | "gib" => 30,
        "kb" | "mb" | "gb" => return Err(bad("ambiguous unit (1000 or 1024?)")),
        _ => return Err(bad("unknown unit")),
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    let digits = |d: &str| d.bytes().all(|b| b.is_ascii_digit());
    if int.is_empty() || !digits(int) || !digits(frac) || (num.contains('.') && frac.is_empty()) {
        return Err(bad("not a size"));
    }
    let int: u128 = int.parse().map_err(|_| bad("too large"))?;
    if frac.len() > 9 {
        return Err(bad("too many decimals"));
    }
    let scale = 10u128.pow(frac.len() as u32);
    let frac_bytes = frac.parse::<u128>().unwrap_or(0) << shift;
    if frac_bytes % scale != 0 {
        return Err(bad("not a whole number of bytes"));
    }
    let bytes = int
        .checked_shl(shift)
        .filter(|b| b >> shift == int)
        .and_then(|b| b.checked_add(frac_bytes / scale))
        .and_then(|b| u64::try_from(b).ok());
    bytes.ok_or_else(|| bad("too large"))
}

/// `--segment-size`: a [`size`] that fits in 32 bits (the format then
/// checks its range).
pub fn size_u32(text: &str) -> Result<u32, String> {
    let v = size(text)?;
    u32::try_from(v).map_err(|_| format!("{text:?}: too large; at most 4GiB - 1"))
}

/// A library's "invalid input: …" as clap shows it after "invalid value
/// '…' for '--flag'": the reason alone.
fn value_error(e: tpmcrypt_tpmkey::Error) -> String {
    match e {
        tpmcrypt_tpmkey::Error::InvalidInput(reason) => reason,
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn one_duration_grammar_takes_every_form_the_flags_took() {
        let ok = [
            ("200ms", Duration::from_millis(200)),
            ("1.5s", Duration::from_millis(1500)),
            ("1.5 s", Duration::from_millis(1500)),
            ("0", Duration::ZERO),
            ("0ms", Duration::ZERO),
            ("10m", Duration::from_secs(600)),
            ("10min", Duration::from_secs(600)),
            ("2sec", Duration::from_secs(2)),
            ("1h30m", Duration::from_secs(5400)),
            ("24h", Duration::from_secs(86400)),
            ("7d", Duration::from_secs(7 * 86400)),
        ];
        for (text, want) in ok {
            assert_eq!(duration(text), Ok(want), "{text}");
        }
        // A bare number is seconds, for every duration flag.
        assert_eq!(duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(duration("1.5"), Ok(Duration::from_millis(1500)));
        for bad in ["ms", "5y", "2w", "-1s", "", "1.5.5s", ".", "1..5", "-1"] {
            let err = duration(bad).expect_err(bad);
            assert!(err.contains("e.g. 200ms, 1.5s"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_ttl_is_a_duration_or_seconds_and_never_zero() {
        assert_eq!(ttl("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(ttl("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(ttl("45"), Ok(Duration::from_secs(45)));
        for bad in ["", "0s", "0", "m", "5x", "-1s"] {
            assert!(ttl(bad).is_err(), "{bad}");
        }
        assert_eq!(ttl_value("1m").as_deref(), Ok("1m"));
    }

    #[test]
    fn sizes_are_powers_of_1024_whatever_their_spelling() {
        for (text, want) in [
            ("4096", 4096),
            ("65536", 65536),
            ("16K", 16 << 10),
            ("16Ki", 16 << 10),
            ("64KiB", 64 << 10),
            ("1m", 1 << 20),
            ("1M", 1 << 20),
            ("2g", 2 << 30),
            ("1GiB", 1 << 30),
            ("4096B", 4096),
            ("0", 0),
            ("1.5MiB", 3 << 19),
            ("1.5K", 1536),
            ("0.5k", 512),
            (" 8 KiB ", 8192),
            ("16G", 16 << 30),
            ("18446744073709551615", u64::MAX),
        ] {
            assert_eq!(size(text), Ok(want), "{text}");
        }
        for bad in [
            "x",
            "",
            "5T",
            "99999999999999G",
            "99999999999999999999",
            "1Q",
            "1.5",
            "1.3K",
            "16kb",
            "1MB",
            "2GB",
            ".5K",
            "5.K",
            "1.2.3K",
            "-1K",
            "17179869184G",
            "0.0000000001K",
        ] {
            let err = size(bad).expect_err(bad);
            assert!(err.contains("e.g. 4096, 64KiB"), "{bad}: {err}");
        }
    }
}
