//! Exit codes and error classification: the one place where an error
//! becomes a number. Documented in the README ("Exit codes").

use tpmcrypt_cipher::Error as CipherError;

/// Success.
pub const OK: i32 = 0;
/// Anything not covered below (I/O, permissions, …).
pub const OTHER: i32 = 1;
/// Bad command line or arguments.
pub const USAGE: i32 = 2;
/// Integrity or authentication failure: tampered, truncated, wrong key.
pub const INTEGRITY: i32 = 3;
/// TPM unavailable, or the TPM refused (policy, PIN, lockout).
#[allow(dead_code)] // raised by the TPM commands
pub const TPM: i32 = 4;

/// A usage error detected after argument parsing (conflicting options,
/// a directory without `-r`, …).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Builds a usage error.
pub fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

/// Maps an error chain to its exit code.
pub fn code_for(err: &anyhow::Error) -> i32 {
    for cause in err.chain() {
        if cause.is::<UsageError>() {
            return USAGE;
        }
        if let Some(e) = cause.downcast_ref::<CipherError>() {
            if e.is_integrity() {
                return INTEGRITY;
            }
            if let CipherError::InvalidRecipient(_)
            | CipherError::InvalidIdentity(_)
            | CipherError::InvalidParams(_) = e
            {
                return USAGE;
            }
        }
    }
    OTHER
}
