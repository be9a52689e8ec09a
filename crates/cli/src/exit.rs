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
            | CipherError::InvalidParams(_)
            | CipherError::Unsupported { .. } = e
            {
                return USAGE;
            }
            // A TPM identity's failure travels inside the cipher error.
            if let CipherError::External(inner) = e {
                if let Some(t) = inner.downcast_ref::<tpmcrypt_tpmkey::Error>() {
                    return tpm_code(t);
                }
            }
        }
        if let Some(t) = cause.downcast_ref::<tpmcrypt_tpmkey::Error>() {
            return tpm_code(t);
        }
    }
    OTHER
}

fn tpm_code(e: &tpmcrypt_tpmkey::Error) -> i32 {
    match e.exit_class() {
        tpmcrypt_tpmkey::ExitClass::TpmRefused => TPM,
        tpmcrypt_tpmkey::ExitClass::Unusable => USAGE,
        tpmcrypt_tpmkey::ExitClass::Other => OTHER,
    }
}
