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

/// `--ttl DURATION`, checked as it is parsed.
pub fn ttl_value(s: &str) -> Result<String, String> {
    tpmcrypt_tpmkey::agent::parse_duration(s)
        .map(|_| s.to_string())
        .map_err(value_error)
}

/// A library's "invalid input: …" as clap shows it after "invalid value
/// '…' for '--flag'": the reason alone.
fn value_error(e: tpmcrypt_tpmkey::Error) -> String {
    match e {
        tpmcrypt_tpmkey::Error::InvalidInput(reason) => reason,
        other => other.to_string(),
    }
}
