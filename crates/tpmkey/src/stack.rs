//! Which TPM software stack this process runs on: the tpm2-tss ESYS
//! library the dynamic linker actually loaded (`tpmcrypt --version`).
//!
//! tpm2-tss has no run-time version call, so the loaded library is named by
//! its file: the path `dladdr` reports for one of its functions, with
//! symbolic links resolved (`…/libtss2-esys.so.0.0.0`). It costs one
//! `dladdr` and one `realpath`, and no TPM.

use std::ffi::{CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

/// The file of the tpm2-tss ESYS library loaded into this process, if the
/// dynamic linker can say (it cannot in a static build).
pub fn esys_library() -> Option<PathBuf> {
    let symbol = tss_esapi::tss2_esys::Esys_Initialize as *const libc::c_void;
    // SAFETY: `info` is plain data that dladdr fills; `symbol` is the
    // address of a function of this process.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    if unsafe { libc::dladdr(symbol, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr returned a NUL-terminated name that lives as long as
    // the library stays loaded, which ESYS does for the whole process.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    let path = PathBuf::from(OsStr::from_bytes(name.to_bytes()));
    // The linked name (`libtss2-esys.so.0`) is a link to the real file.
    Some(std::fs::canonicalize(&path).unwrap_or(path))
}

#[cfg(test)]
mod tests {
    /// The loaded library is found, is a file, and is tpm2-tss's ESYS.
    #[test]
    fn the_loaded_esys_library_is_named() {
        let path = super::esys_library().expect("dladdr names the library");
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("libtss2-esys.so"), "{}", path.display());
        assert!(path.is_file(), "{}", path.display());
    }
}
