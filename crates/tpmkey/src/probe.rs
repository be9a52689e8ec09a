//! Read-only diagnostics: what `tpmcrypt doctor` reports, as plain data.
//!
//! Nothing here changes TPM state or spends a dictionary-attack try: the
//! TPM is asked with GetCapability, TestParms, ReadPublic and PCR_Read, and
//! keys are loaded and flushed (TPM2_Load authorizes only the parent, never
//! the key). The TPM-facing half is [`crate::Tpm::health`] and
//! [`crate::Tpm::check_key`]; this module also checks what can be checked
//! without a TPM connection: device nodes and the tpm2-abrmd daemon.

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::error::io_cause;
use crate::TpmInfo;

/// The TPM's state as [`crate::Tpm::health`] reads it.
#[derive(Debug, Clone)]
pub struct TpmHealth {
    /// Manufacturer, vendor, firmware, simulator or not.
    pub info: TpmInfo,
    /// TPM_PT_FAMILY_INDICATOR, e.g. "2.0".
    pub family: String,
    /// The PCR banks allocated, with the PCRs of each.
    pub pcr_banks: Vec<PcrBankAlloc>,
    /// The algorithms tpmcrypt needs, each checked with TestParms.
    pub algorithms: Vec<AlgorithmCheck>,
    /// Dictionary-attack state.
    pub lockout: Lockout,
    /// The persistent storage key at 0x81000001.
    pub srk: PersistentSrk,
}

/// One allocated PCR bank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PcrBankAlloc {
    /// The bank's hash, as tpm2-tools names it (`sha1`, `sha256`, …).
    pub bank: String,
    /// The PCRs allocated in it.
    pub pcrs: Vec<u8>,
}

/// Whether the TPM supports one algorithm tpmcrypt needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AlgorithmCheck {
    /// Stable name: `rsa2048-oaep-sha256`, `ecc-p256-ecdh`, `aes128-cfb`.
    pub name: &'static str,
    /// What it is for.
    pub purpose: &'static str,
    /// `None` if TestParms accepted it; otherwise what the TPM said.
    pub refused: Option<String>,
}

/// Dictionary-attack state (TPM_PT_LOCKOUT_* and TPMA_PERMANENT).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lockout {
    /// TPM_PT_LOCKOUT_COUNTER: failed authorizations counted.
    pub counter: u32,
    /// TPM_PT_MAX_AUTH_FAIL: failures that put the TPM in lockout.
    pub max_tries: u32,
    /// Seconds after which one failure is forgotten.
    pub interval_secs: u32,
    /// Seconds the lockout hierarchy stays locked after a failure.
    pub recovery_secs: u32,
    /// TPMA_PERMANENT.inLockout.
    pub in_lockout: bool,
}

impl Lockout {
    /// Tries left before lockout (0 in lockout).
    pub fn remaining(&self) -> u32 {
        if self.in_lockout {
            0
        } else {
            self.max_tries.saturating_sub(self.counter)
        }
    }
}

/// The persistent SRK handle's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PersistentSrk {
    /// Nothing at 0x81000001: keys use the owner primary of the standard
    /// template, re-derived each time.
    Absent,
    /// A storage key is there.
    Present {
        /// True for RSA, false for ECC.
        rsa: bool,
    },
    /// Something is there that is not a storage key (or cannot be read).
    Unusable(String),
}

/// What [`crate::Tpm::check_key`] found for one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyCheck {
    /// `None` if the TPM loads the key under its parent; otherwise why not.
    pub load_error: Option<String>,
    /// The key's PCR policy, if it has one.
    pub pcr: Option<PcrCheck>,
    /// Whether the key needs a PIN.
    pub pin: bool,
}

/// A key's PCR policy against the PCRs' current values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PcrCheck {
    /// The PCRs the key is bound to, e.g. `sha256:0,7`.
    pub selection: String,
    /// Whether their current values give the digest the key recorded;
    /// `Err` if they could not be read.
    pub satisfied: Result<bool, String>,
    /// For a key bound to a PCR signer (PolicyAuthorize): why none of its
    /// signed policies holds now (decrypt's refusal), when none does.
    pub signed_refusal: Option<String>,
}

/// A TPM device node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceNode {
    /// Its path.
    pub path: PathBuf,
    /// `/dev/tpmrm*`: the kernel resource manager (several processes may
    /// use the TPM at once); `/dev/tpm*` is the raw device (one at a time).
    pub resource_manager: bool,
    /// Its metadata, if it exists.
    pub meta: Option<NodeMeta>,
    /// `None` if this process can open it for reading and writing;
    /// otherwise why not (e.g. "permission denied", "busy").
    pub open_error: Option<String>,
}

/// Owner and permissions of a device node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeMeta {
    /// Permission bits (`0o660`).
    pub mode: u32,
    /// Owner uid.
    pub uid: u32,
    /// Owner gid.
    pub gid: u32,
    /// The group's name, if it has one (usually `tss`).
    pub group: Option<String>,
    /// Whether it is a character device.
    pub char_device: bool,
}

/// Checks the device node at `path`: exists, owner and mode, whether this
/// process can open it. Opening a raw `/dev/tpm0` that another process
/// holds says "busy"; nothing is sent to the TPM.
pub fn device_node(path: &Path) -> DeviceNode {
    let resource_manager = path
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with("tpmrm"));
    let meta = fs::metadata(path).ok().map(|m| NodeMeta {
        mode: m.mode() & 0o7777,
        uid: m.uid(),
        gid: m.gid(),
        group: group_name(m.gid()),
        char_device: m.file_type().is_char_device(),
    });
    let open_error = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .err()
        .map(|e| match e.raw_os_error() {
            Some(libc::EBUSY) => "busy: another process holds it (the raw device admits one \
                                  user at a time, e.g. tpm2-abrmd)"
                .to_string(),
            _ => io_cause(&e),
        });
    DeviceNode {
        path: path.to_path_buf(),
        resource_manager,
        meta,
        open_error,
    }
}

/// The TPM device nodes present under `/dev` (`tpm0`, `tpmrm0`, …).
pub fn device_nodes() -> Vec<PathBuf> {
    let mut nodes: Vec<PathBuf> = fs::read_dir("/dev")
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with("tpm"))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    nodes.sort();
    nodes
}

/// Whether a tpm2-abrmd process runs (the D-Bus resource manager the
/// `tabrmd` TCTI talks to), from `/proc/*/comm`.
pub fn tabrmd_running() -> bool {
    let Ok(procs) = fs::read_dir("/proc") else {
        return false;
    };
    procs.filter_map(|e| e.ok()).any(|e| {
        fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim_end() == "tpm2-abrmd")
    })
}

/// The name of group `gid`, through the C library (NSS, as `ls -l`).
fn group_name(gid: u32) -> Option<String> {
    let mut buf = vec![0 as libc::c_char; 16 << 10];
    // SAFETY: a zeroed `group` is a valid out-parameter.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; `buf` outlives `grp`'s use.
    let rc = unsafe { libc::getgrgid_r(gid, &mut grp, buf.as_mut_ptr(), buf.len(), &mut result) };
    if rc != 0 || result.is_null() || grp.gr_name.is_null() {
        return None;
    }
    // SAFETY: getgrgid_r succeeded: gr_name is a NUL-terminated string in `buf`.
    let name = unsafe { std::ffi::CStr::from_ptr(grp.gr_name) };
    Some(name.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_node_says_so_and_a_present_one_is_described() {
        let n = device_node(Path::new("/nonexistent/tpmrm9"));
        assert!(n.resource_manager);
        assert!(n.meta.is_none());
        assert!(n.open_error.unwrap().contains("no such file"));
        // /dev/null stands in for a character device anyone may open.
        let n = device_node(Path::new("/dev/null"));
        assert!(!n.resource_manager);
        let meta = n.meta.unwrap();
        assert!(meta.char_device);
        assert_eq!(meta.mode & 0o666, 0o666);
        assert_eq!(meta.group.as_deref(), Some("root"));
        assert_eq!(n.open_error, None);
    }

    #[test]
    fn remaining_tries_are_zero_in_lockout() {
        let mut l = Lockout {
            counter: 2,
            max_tries: 3,
            interval_secs: 1000,
            recovery_secs: 1000,
            in_lockout: false,
        };
        assert_eq!(l.remaining(), 1);
        l.counter = 5;
        assert_eq!(l.remaining(), 0);
        l.counter = 0;
        l.in_lockout = true;
        assert_eq!(l.remaining(), 0);
    }
}
