//! Error type for everything in this crate.
//!
//! The variants are deliberately fine-grained for the failures a user can act
//! on (wrong PIN, PCRs changed, lockout, wrong machine, no TPM), because a
//! generic "TPM error 0x98e" tells nobody what to do.  [`Error::exit_class`]
//! lets the CLI turn them into exit codes without matching on every variant.

use std::path::PathBuf;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Coarse classification of an error, for a caller that maps errors to
/// outcomes (the CLI's exit codes) without matching every variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitClass {
    /// The TPM is unavailable, or it refused to use the key (policy, PIN,
    /// lockout, different TPM).
    TpmRefused,
    /// A key or recipient tpmcrypt can never use, refused when it is
    /// given: bad input.
    Unusable,
    /// Anything else (bad input, I/O, malformed key file, internal errors).
    Other,
}

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No TPM could be reached through the TCTI (`cause` says why, e.g.
    /// "connection refused" or "/dev/tpmrm0: permission denied").
    #[error("TPM unreachable ({tcti}): {cause}.")]
    Unavailable {
        /// The TCTI tried.
        tcti: String,
        /// Why it failed.
        cause: String,
    },

    /// The TPM answered earlier in this run, then the connection to it
    /// broke (the TPM or simulator stopped, the device went away).
    #[error("TPM unreachable ({tcti}): connection lost during {op}; {detail}")]
    ConnectionLost {
        /// The TCTI in use.
        tcti: String,
        /// The operation under way.
        op: &'static str,
        /// What the TSS said.
        detail: String,
    },

    /// The key's PCR policy is not satisfied by the current PCR values.
    #[error(
        "the PCR values changed since the key was created (key is bound to PCRs {pcrs}); the TPM \
         refuses to use it in the current boot state. If the change is legitimate (firmware, \
         bootloader or kernel update), decrypt with a recovery recipient and create a new key"
    )]
    PcrMismatch {
        /// The key's PCR selection, e.g. `sha256:0,7`.
        pcrs: String,
    },

    /// A key under a signed PCR policy has no signed policy that holds
    /// now (the message names the PCRs that differ, with their values).
    #[error("{0}")]
    NoSignedPolicy(String),

    /// A signed PCR policy that cannot be used: its signature is invalid,
    /// it was signed by another signer than the key's, or it is malformed.
    #[error("signed PCR policy refused: {0}")]
    SignedPolicy(String),

    /// The PIN (authValue) was wrong.
    #[error(
        "wrong PIN for this key (TPM authorization failed). Repeated failures put the TPM into \
         dictionary-attack lockout"
    )]
    WrongPin,

    /// The TPM refused a key's PIN, and no other PIN will be asked for in
    /// this run; `origin` says where that PIN came from.
    #[error(
        "wrong PIN for this key (the PIN from {origin}; TPM authorization failed). Repeated \
         failures put the TPM into dictionary-attack lockout"
    )]
    PinRejected {
        /// Where the PIN came from (`--pin-file FILE`, `TPMCRYPT_PIN`, …).
        origin: String,
    },

    /// The TPM is in dictionary-attack lockout.
    #[error(
        "the TPM is in dictionary-attack lockout after too many wrong PINs; wait {} or run \
         `tpm2_dictionarylockout --clear-lockout` (needs the lockout authorization)",
        match .retry_after_secs { Some(s) => format!("{s} seconds"), None => "a while".to_string() }
    )]
    Lockout {
        /// Seconds until the next try is allowed, if the TPM says.
        retry_after_secs: Option<u32>,
    },

    /// The TPM has no room for another object or session: on a TPM
    /// reached without a resource manager (`swtpm:`, `device:/dev/tpm0`),
    /// programs killed mid-command leave theirs loaded for ever.
    #[error(
        "the TPM has no room left for {op} ({detail}): objects or sessions of programs killed \
         mid-command are still loaded (a TPM reached without a resource manager keeps them). \
         Free them with `tpm2_flushcontext -t`, then `-l` and `-s`, when no other program uses \
         the TPM, or reach it through /dev/tpmrm0"
    )]
    TpmFull {
        /// The TPM command.
        op: &'static str,
        /// What the TPM said.
        detail: String,
    },

    /// The key file was made under a different TPM (or the TPM was cleared).
    #[error(
        "this key belongs to a different TPM (or this TPM's owner hierarchy was cleared since the \
         key was created): the TPM rejected it ({detail})"
    )]
    WrongTpm {
        /// What the TPM said.
        detail: String,
    },

    /// The TPM does not load the key under the parent its file names (the
    /// standard storage key): it was made under another parent, or on
    /// another TPM.
    #[error(
        "the TPM cannot load this key under the standard storage key ({parent}): it was made \
         under another parent key, or on another TPM ({detail})"
    )]
    WrongParent {
        /// The parent the key file names.
        parent: String,
        /// What the TPM said.
        detail: String,
    },

    /// The key needs a policy we do not know how to satisfy.
    #[error("unsupported key policy: {0}")]
    UnsupportedPolicy(String),

    /// A key file (PEM/DER/TPM structures) is malformed.
    #[error("invalid TPM key file: {0}")]
    KeyFile(String),

    /// A well-formed key that tpmcrypt could never unbind with: not an
    /// unrestricted decryption key, a scheme the TPM would refuse with
    /// OAEP-SHA256 or ECDH, an algorithm or curve we do not use, or no way
    /// to authorize it.
    #[error("tpmcrypt can never unbind with this key: {0}")]
    Unusable(String),

    /// A TCTI that parses but that tpm2-tss refuses (a host it cannot
    /// take, a tabrmd option it does not know): bad input. Found when the
    /// TPM is opened, not when the TCTI is parsed: tss-esapi's parsers
    /// would put a regular-expression engine in the front's start.
    #[error("{0}")]
    BadTcti(String),

    /// A key name that is not one, or that names no key: bad input.
    #[error("{0}")]
    KeyName(String),

    /// A recipient that cannot be used (a keystore key's public half, or a
    /// recovery recipient recorded for it). The CLI treats it as bad input.
    #[error("{0}")]
    InvalidRecipient(String),

    /// Another agent serves the socket, or is starting there.
    #[error("{0}")]
    AgentRunning(String),

    /// Invalid argument (TCTI string, PCR selection, key name, ciphertext...).
    #[error("invalid input: {0}")]
    InvalidInput(String),

    /// Any other TPM failure.
    #[error("TPM command {op} failed: {detail}")]
    Tpm {
        /// The TPM command.
        op: &'static str,
        /// What the TPM or TSS said.
        detail: String,
    },

    /// The software TPM could not be started.
    #[error("cannot start the software TPM (swtpm): {0}")]
    Simulator(String),

    /// Keystore-level problems (name taken, key not found...).
    #[error("keystore: {0}")]
    Keystore(String),

    /// A path that another user could have placed or changed (see
    /// [`crate::trust`]): refused before anything secret goes near it.
    #[error("{path}: {why}")]
    Untrusted {
        /// The path refused.
        path: PathBuf,
        /// Why.
        why: String,
    },

    /// A key recorded as having no PIN that the TPM refused without one:
    /// it has a PIN after all (its record must be corrected).
    #[error("key {0} was refused without a PIN: it has one, but is recorded as having none")]
    PinNotRecorded(String),

    /// A key needs a PIN and none can be had (no terminal, no PIN given).
    #[error("{0}")]
    PinUnavailable(String),

    /// A PIN the TPM refused earlier in this run: not presented again, so
    /// that one wrong PIN costs one dictionary-attack try.
    #[error(
        "the PIN for key {0} was refused earlier in this run; not trying it again (each try \
         counts towards the TPM's dictionary-attack lockout)"
    )]
    PinRefusedBefore(String),

    /// File system errors, with the path involved.
    // The cause is part of the message and deliberately not a `source`:
    // an error chain printed whole would show it twice.
    #[error("{path}: {error}")]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The I/O error.
        error: std::io::Error,
    },

    /// OpenSSL failures while converting public keys: OpenSSL's message,
    /// made text where it happened (see the `From` below).
    #[error("crypto: {0}")]
    Crypto(String),
}

/// OpenSSL's error as text at once: the message is the same, and a program
/// that only shows errors from other causes (the front `tpmcrypt`, which
/// never calls OpenSSL) then links no OpenSSL code to format them.
impl From<openssl::error::ErrorStack> for Error {
    fn from(e: openssl::error::ErrorStack) -> Self {
        Error::Crypto(e.to_string())
    }
}

impl Error {
    /// Which CLI exit class this error belongs to.
    pub fn exit_class(&self) -> ExitClass {
        match self {
            Error::Unavailable { .. }
            | Error::ConnectionLost { .. }
            | Error::PcrMismatch { .. }
            | Error::NoSignedPolicy(_)
            | Error::SignedPolicy(_)
            | Error::WrongPin
            | Error::PinRejected { .. }
            | Error::Lockout { .. }
            | Error::TpmFull { .. }
            | Error::WrongTpm { .. }
            | Error::WrongParent { .. }
            | Error::PinUnavailable(_)
            | Error::PinNotRecorded(_)
            | Error::PinRefusedBefore(_)
            | Error::Simulator(_) => ExitClass::TpmRefused,
            Error::Unusable(_)
            | Error::InvalidRecipient(_)
            | Error::KeyName(_)
            | Error::BadTcti(_) => ExitClass::Unusable,
            _ => ExitClass::Other,
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            error: source,
        }
    }
}

/// An I/O error's text without its " (os error N)" suffix, as it ends an
/// error line ("Permission denied").
///
/// ```
/// let e = std::io::Error::from_raw_os_error(2);
/// assert_eq!(tpmcrypt_tpmkey::error::io_text(&e), "No such file or directory");
/// ```
pub fn io_text(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.rfind(" (os error ") {
        Some(i) => text[..i].to_string(),
        None => text,
    }
}

/// An I/O error as a short lower-case cause ("connection refused"),
/// without the "(os error N)" suffix.
pub(crate) fn io_cause(e: &std::io::Error) -> String {
    let text = io_text(e);
    let mut chars = text.chars();
    match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}
