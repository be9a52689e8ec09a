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
}

impl BackendArg {
    /// The backend's name in the cipher crate.
    pub fn name(self) -> &'static str {
        match self {
            BackendArg::Openssl => "openssl",
            BackendArg::Ring => "ring",
            BackendArg::Rustcrypto => "rustcrypto",
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
const DURATION_FORMS: &str =
    "a number and a unit (ms, s, m, h or d), e.g. 200ms, 1.5s, 10m, 1h30m, 7d";

/// A duration flag (`--settle`, `--stats-interval`, `--rotate`, `--ttl`,
/// the load generator's): the one grammar every command uses, parsed by
/// `humantime` ("200ms", "1.5s", "1h30m", "1h 30m", "0").
///
/// A thin layer over the crate, because humantime also knows weeks,
/// months and years (and spellings such as "nsec") that tpmcrypt never
/// documented: "5y" has always been refused, and stays a usage error
/// showing the valid forms.
pub fn duration(text: &str) -> Result<std::time::Duration, String> {
    let t = text.trim();
    let bad = |why: &dyn std::fmt::Display| format!("{text:?}: {why}; expected {DURATION_FORMS}");
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

/// `--ttl DURATION`: a [`duration`], or a bare number of seconds ("45"),
/// and never zero. Checked as it is parsed; the text itself is kept, as
/// the agent shows it.
pub fn ttl_value(s: &str) -> Result<String, String> {
    ttl(s).map(|_| s.to_string())
}

/// The duration `--ttl` names (see [`ttl_value`]).
pub fn ttl(s: &str) -> Result<std::time::Duration, String> {
    let t = s.trim();
    let d = if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        let secs = t
            .parse()
            .map_err(|_| format!("{s:?}: too large; expected {DURATION_FORMS}"))?;
        std::time::Duration::from_secs(secs)
    } else {
        duration(s)?
    };
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

/// A size flag (`--sizes`, the load generator's `--size`): a number of
/// bytes with an optional unit, "4096", "64KiB", "16K", "1M", "2g".
///
/// A thin layer over `bytesize`, because tpmcrypt's units have always been
/// powers of 1024 whatever their spelling (`K`, `KB` and `KiB` all mean
/// 1024, where bytesize reads `K` and `KB` as 1000), and stop at `G`; and
/// because bytesize saturates a value too large for 64 bits where this
/// refuses it. A bare number is read exactly, as an integer.
pub fn size(text: &str) -> Result<u64, String> {
    const FORMS: &str = "a number of bytes and an optional unit K, M or G \
                         (powers of 1024), e.g. 4096, 64KiB, 16K, 1M";
    let t = text.trim();
    let bad = |why: &str| format!("{text:?}: {why}; expected {FORMS}");
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        return t.parse().map_err(|_| bad("too large"));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => "B",
        "k" | "kb" | "kib" => "KiB",
        "m" | "mb" | "mib" => "MiB",
        "g" | "gb" | "gib" => "GiB",
        _ => return Err(bad("unknown unit")),
    };
    let bytes = format!("{num} {unit}")
        .parse::<bytesize::ByteSize>()
        .map_err(|_| bad("not a size"))?
        .as_u64();
    if bytes == u64::MAX {
        return Err(bad("too large"));
    }
    Ok(bytes)
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
        for bad in ["10", "ms", "5y", "2w", "-1s", "", "1.5.5s"] {
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
            ("16kb", 16 << 10),
            ("64KiB", 64 << 10),
            ("1m", 1 << 20),
            ("1M", 1 << 20),
            ("2g", 2 << 30),
            ("1GiB", 1 << 30),
            ("4096B", 4096),
            ("0", 0),
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
        ] {
            let err = size(bad).expect_err(bad);
            assert!(err.contains("e.g. 4096, 64KiB"), "{bad}: {err}");
        }
    }
}
