//! The one error type of the cipher crate.
//!
//! Variants are grouped by what the caller should tell the user: integrity
//! failures (the file is not what it claims: tampered, truncated, wrong key)
//! are kept apart from I/O and usage problems so that the CLI can map them to
//! a documented exit code in one place.

use std::io;

/// Everything that can go wrong while reading, writing or encrypting a
/// tpmcrypt file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading the input or writing the output failed. Transparent: the
    /// I/O error is this error's message, not also its source, so that a
    /// cause chain (`{:#}`) names it once.
    #[error(transparent)]
    Io(#[from] io::Error),

    /// The input does not start with the tpmcrypt magic bytes.
    #[error("not a tpmcrypt file (bad magic bytes)")]
    NotTpmcrypt,

    /// The file was written by a newer, incompatible version of the format.
    #[error("unsupported tpmcrypt format version {0}")]
    UnsupportedVersion(u8),

    /// The header is structurally invalid (bad lengths, unknown mode, …).
    #[error("malformed header: {0}")]
    MalformedHeader(String),

    /// The header MAC did not verify: a byte of the header was changed.
    #[error("header authentication failed (the header was modified)")]
    HeaderAuth,

    /// A payload segment did not authenticate.
    #[error("segment {index} failed authentication (modified, reordered, or from another file)")]
    SegmentAuth {
        /// Zero-based segment number.
        index: u64,
    },

    /// The payload ends at a segment boundary before its last segment.
    #[error("truncated: the file ends after segment {index}, before its last segment")]
    Truncated {
        /// Zero-based number of the last segment that was present.
        index: u64,
    },

    /// The payload ends inside its stream header or has no segment at all.
    #[error("truncated: the file ends before its payload")]
    TruncatedHeader,

    /// ASCII armor that is not strictly what [`crate::armor`] writes.
    #[error(transparent)]
    Armor(#[from] crate::armor::ArmorError),

    /// None of the supplied identities can open any recipient stanza.
    #[error("no identity matches any recipient of this file")]
    NoMatchingIdentity,

    /// A stanza addressed to one of our identities failed to unwrap.
    #[error("the session key could not be unwrapped: {0}")]
    Unwrap(String),

    /// A recipient string or public key could not be parsed.
    #[error("invalid recipient: {0}")]
    InvalidRecipient(String),

    /// An identity file could not be parsed.
    #[error("invalid identity: {0}")]
    InvalidIdentity(String),

    /// Invalid encryption parameters (key size, segment size, …).
    #[error("invalid parameters: {0}")]
    InvalidParams(String),

    /// The selected backend cannot do what was asked (e.g. ring and CBC).
    #[error("backend {backend} does not support {what}")]
    Unsupported {
        /// Backend name.
        backend: &'static str,
        /// What was asked of it.
        what: &'static str,
    },

    /// A cryptographic library reported an internal failure.
    #[error("crypto library error: {0}")]
    Backend(String),

    /// A recipient or identity implemented outside this crate failed (for
    /// example a TPM); the CLI inspects the source to pick an exit code.
    #[error("{0}")]
    External(Box<dyn std::error::Error + Send + Sync + 'static>),
}

impl Error {
    /// True for failures that mean "this ciphertext is not authentic or not
    /// for you": tampering, truncation, appended data, wrong key.
    pub fn is_integrity(&self) -> bool {
        matches!(
            self,
            Error::NotTpmcrypt
                | Error::UnsupportedVersion(_)
                | Error::MalformedHeader(_)
                | Error::HeaderAuth
                | Error::SegmentAuth { .. }
                | Error::Truncated { .. }
                | Error::TruncatedHeader
                | Error::Armor(_)
                | Error::NoMatchingIdentity
                | Error::Unwrap(_)
        )
    }

    pub(crate) fn malformed(msg: impl Into<String>) -> Self {
        Error::MalformedHeader(msg.into())
    }

    pub(crate) fn backend(e: impl std::fmt::Display) -> Self {
        Error::Backend(e.to_string())
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
