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

/// The TPM crate's error in `err`'s chain, also where it travels inside a
/// cipher error (a TPM identity's failure).
fn tpm_error(err: &anyhow::Error) -> Option<&tpmcrypt_tpmkey::Error> {
    err.chain().find_map(|cause| {
        if let Some(CipherError::External(inner)) = cause.downcast_ref::<CipherError>() {
            return inner.downcast_ref::<tpmcrypt_tpmkey::Error>();
        }
        cause.downcast_ref::<tpmcrypt_tpmkey::Error>()
    })
}

/// What the user can do about `err`, in the CLI's terms (flags, commands),
/// for the end of its line; the libraries know nothing of the CLI.
pub fn hint(err: &anyhow::Error) -> Option<&'static str> {
    use tpmcrypt_tpmkey::Error as E;
    match tpm_error(err)? {
        E::Unavailable { tcti, .. } if tcti.starts_with("swtpm:") || tcti.starts_with("mssim:") => {
            Some(
                " Check that the TPM simulator runs at that address, or select another TPM with \
             --tpm / TPMCRYPT_TCTI. To just try the tool, use --simulator (a software TPM: NOT \
             secure, keys are not protected by hardware)",
            )
        }
        E::Unavailable { .. } => Some(
            " Check that the machine has a TPM 2.0 and that you may use it (e.g. /dev/tpmrm0 is \
             usually group 'tss'), or select another one with --tpm / TPMCRYPT_TCTI. To just try \
             the tool, use --simulator (a software TPM: NOT secure, keys are not protected by \
             hardware)",
        ),
        E::PinNotRecorded(_) => Some("; re-import its key file with `tpmcrypt key import --pin`"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unavailable(tcti: &str) -> anyhow::Error {
        let e = tpmcrypt_tpmkey::Error::Unavailable {
            tcti: tcti.into(),
            cause: "connection refused".into(),
        };
        // As a TPM identity's failure reaches the CLI: inside a cipher error.
        anyhow::Error::new(CipherError::External(Box::new(e))).context("f.tpmc")
    }

    #[test]
    fn an_unreachable_tpm_gets_the_hint_for_its_kind() {
        let sim = hint(&unavailable("swtpm:host=127.0.0.1,port=1")).unwrap();
        assert!(sim.starts_with(" Check that the TPM simulator runs at that address"));
        let dev = hint(&unavailable("device:/dev/tpmrm0")).unwrap();
        assert!(dev.contains("group 'tss'"));
        for h in [sim, dev] {
            assert!(h.contains("--tpm / TPMCRYPT_TCTI") && h.contains("--simulator"));
            assert!(h.contains("NOT secure"));
        }
        assert_eq!(code_for(&unavailable("device:/dev/tpmrm0")), TPM);
    }

    #[test]
    fn a_key_recorded_without_its_pin_is_told_how_to_fix_it() {
        let e = anyhow::Error::new(tpmcrypt_tpmkey::Error::PinNotRecorded("k".into()));
        assert_eq!(
            hint(&e),
            Some("; re-import its key file with `tpmcrypt key import --pin`")
        );
        assert_eq!(code_for(&e), TPM);
        assert_eq!(hint(&anyhow::anyhow!("plain")), None);
    }
}
