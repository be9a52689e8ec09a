//! Turning TPM/TSS response codes into actionable [`Error`]s.
//!
//! tss-esapi's `Tss2ResponseCode::kind()` ignores the TSS layer bits, so an
//! ESYS or TCTI error could be misread as a TPM error.  We recover the raw
//! 32-bit code and classify it ourselves, with the operation as context
//! (an integrity failure means "wrong TPM" on Load but something else
//! elsewhere).

use std::error::Error as _;

use crate::error::Error;

/// What we were doing when the TPM said no.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// Creating/loading the storage root key.
    Srk,
    /// TPM2_Load of the user's key under the SRK.
    Load,
    /// TPM2_PolicyPCR while satisfying the key's policy.
    PolicyPcr,
    /// The unbind command itself (RSA_Decrypt / ECDH_ZGen).
    Unbind,
    /// Anything else.
    Other(&'static str),
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Srk => "CreatePrimary (storage root key)",
            Op::Load => "Load",
            Op::PolicyPcr => "PolicyPCR",
            Op::Unbind => "unbind (RSA_Decrypt/ECDH_ZGen)",
            Op::Other(n) => n,
        }
    }
}

pub(crate) const RC_INITIALIZE: u32 = 0x100;
pub(crate) const RC_PCR_CHANGED: u32 = 0x128;
pub(crate) const RC_VALUE: u32 = 0x084;
pub(crate) const RC_HANDLE: u32 = 0x08B;
pub(crate) const RC_AUTH_FAIL: u32 = 0x08E;
pub(crate) const RC_POLICY_FAIL: u32 = 0x09D;
pub(crate) const RC_INTEGRITY: u32 = 0x09F;
pub(crate) const RC_BAD_AUTH: u32 = 0x0A2;
pub(crate) const RC_LOCKOUT: u32 = 0x921;
/// TPM_RC_OBJECT_MEMORY, TPM_RC_SESSION_MEMORY, TPM_RC_MEMORY: no room.
pub(crate) const RC_OBJECT_MEMORY: u32 = 0x902;
pub(crate) const RC_SESSION_MEMORY: u32 = 0x903;
pub(crate) const RC_MEMORY: u32 = 0x904;

/// TSS layer of TCTI errors (connection problems).
const LAYER_TCTI: u32 = 0x000A_0000;

/// The raw TSS2_RC inside a tss-esapi error, if it is a response code.
pub(crate) fn raw_rc(e: &tss_esapi::Error) -> Option<u32> {
    match e {
        tss_esapi::Error::Tss2Error(rc) => {
            // The inner bitfield types print "Response code value: 0x...".
            let text = rc.source()?.to_string();
            let hex = text.rsplit("0x").next()?;
            u32::from_str_radix(hex.trim(), 16).ok()
        }
        tss_esapi::Error::WrapperError(_) => None,
    }
}

/// The TPM error number with parameter/handle/session numbers stripped, for
/// codes that come from the TPM itself (or a resource manager passing them
/// through).  `None` for TSS-internal errors.
pub(crate) fn tpm_code(rc: u32) -> Option<u32> {
    let layer = rc & 0xFFFF_0000;
    if layer != 0 && layer != 0x000B_0000 {
        return None;
    }
    let base = rc & 0xFFFF;
    if base & 0x80 != 0 {
        Some(0x80 | (base & 0x3F))
    } else {
        Some(base & 0xFFF)
    }
}

/// A TSS-internal (not TPM) response code as a short cause, e.g.
/// `I/O error (TSS rc 0xa000a)`: tss-esapi prints these as "response code
/// not recognized".
pub(crate) fn tss_cause(rc: u32) -> String {
    let what = match rc & 0xFFFF {
        1 => "general failure",
        8 => "no connection",
        9 => "timed out",
        10 => "I/O error",
        12 => "not permitted",
        17 => "malformed response",
        19 => "response too short",
        20 => "incompatible TCTI",
        21 => "not supported",
        23 => "out of memory",
        _ => "TSS error",
    };
    format!("{what} (TSS rc 0x{rc:x})")
}

/// A tss-esapi error as a cause: TSS-internal codes by [`tss_cause`],
/// everything else as tss-esapi prints it, with the raw code.
pub(crate) fn cause_of(e: &tss_esapi::Error) -> String {
    match raw_rc(e) {
        Some(r) if tpm_code(r).is_none() => tss_cause(r),
        Some(r) => format!("{e} (TPM rc 0x{r:x})"),
        None => e.to_string(),
    }
}

/// Classifies `e` from operation `op`.  `pcrs` describes the key's PCR
/// binding (for the mismatch message).
pub(crate) fn classify(op: Op, e: tss_esapi::Error, pcrs: Option<&str>) -> Error {
    let raw = raw_rc(&e);
    let detail = match raw {
        Some(r) => format!("{e} (TPM rc 0x{r:x})"),
        None => e.to_string(),
    };
    if let Some(r) = raw {
        if r & 0xFFFF_0000 == LAYER_TCTI {
            // The TCTI is filled in (and the connection probed) by the
            // `Tpm` method that ran the command: see `Tpm::finish`.
            return Error::ConnectionLost {
                tcti: String::new(),
                op: op.name(),
                detail: tss_cause(r),
            };
        }
    }
    let pcr_mismatch = || Error::PcrMismatch {
        pcrs: pcrs.unwrap_or("(see key metadata)").to_string(),
    };
    match (op, raw.and_then(tpm_code)) {
        (_, Some(RC_LOCKOUT)) => Error::Lockout {
            retry_after_secs: None,
        },
        (_, Some(RC_OBJECT_MEMORY | RC_SESSION_MEMORY | RC_MEMORY)) => Error::TpmFull {
            op: op.name(),
            detail,
        },
        (Op::Load, Some(RC_INTEGRITY)) => Error::WrongTpm { detail },
        (Op::Load, Some(RC_HANDLE)) => Error::WrongTpm {
            detail: format!("the key's parent does not exist on this TPM: {detail}"),
        },
        (Op::PolicyPcr, Some(RC_VALUE)) => pcr_mismatch(),
        (Op::PolicyPcr | Op::Unbind, Some(RC_PCR_CHANGED)) => pcr_mismatch(),
        (Op::Unbind, Some(RC_POLICY_FAIL)) => pcr_mismatch(),
        (Op::Unbind, Some(RC_AUTH_FAIL | RC_BAD_AUTH)) => Error::WrongPin,
        _ => Error::Tpm {
            op: op.name(),
            detail,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_parameter_numbers() {
        assert_eq!(tpm_code(0x98E), Some(RC_AUTH_FAIL));
        assert_eq!(tpm_code(0x1C4), Some(RC_VALUE));
        assert_eq!(tpm_code(0x99D), Some(RC_POLICY_FAIL));
        assert_eq!(tpm_code(0x921), Some(RC_LOCKOUT));
        assert_eq!(tpm_code(0x000A_000A), None);
        assert_eq!(tpm_code(0x0007_001A), None);
    }

    #[test]
    fn tss_causes_are_named() {
        assert_eq!(tss_cause(0x000A_000A), "I/O error (TSS rc 0xa000a)");
        assert_eq!(tss_cause(0x000A_0008), "no connection (TSS rc 0xa0008)");
        assert_eq!(tss_cause(0x000A_00FF), "TSS error (TSS rc 0xa00ff)");
    }
}
