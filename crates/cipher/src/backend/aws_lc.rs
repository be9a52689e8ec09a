//! `aws-lc-rs`: AWS-LC, Amazon's BoringSSL/OpenSSL-derived library (the
//! default provider of rustls). Its AES-GCM has a 512-bit VAES + VPCLMULQDQ
//! path, which AMD Zen 4/5 and recent Intel cores run at about twice the
//! speed of the 256-bit path ring has (23 against 11 GB/s a core on a Zen 5
//! EPYC); where it lacks AVX-512 its AES-GCM is the 128-bit AES-NI one,
//! and ring is the default (see [`super::aws_lc_gcm_is_wide`]). This
//! backend offers GCM with 128-, 192- and 256-bit keys, HMAC and HKDF, and
//! leaves CBC to the others.
//!
//! Key schedules live in AWS-LC's heap, which it wipes when it frees them
//! (`OPENSSL_free` cleanses). Not everything: each seal and open copies
//! the GHASH key table onto the stack, unwiped, and the last round keys
//! stay in vector registers until overwritten (`docs/threat-model.md`).

use aws_lc_rs::aead::{AES_128_GCM, AES_192_GCM, AES_256_GCM};

use super::{Backend, CbcKey};
use crate::error::{Error, Result};

/// The AWS-LC backend (GCM with 128-, 192- and 256-bit keys, HMAC, HKDF).
#[derive(Clone, Copy, Debug, Default)]
pub struct AwsLc;

const NAME: &str = "aws-lc";

super::ring_api::ring_api!(aws_lc_rs, NAME);

impl Backend for AwsLc {
    fn name(&self) -> &'static str {
        NAME
    }

    fn gcm(&self, key: &[u8]) -> Result<Box<dyn GcmKey>> {
        let alg = match key.len() {
            16 => &AES_128_GCM,
            24 => &AES_192_GCM,
            32 => &AES_256_GCM,
            _ => {
                return Err(Error::Unsupported {
                    backend: NAME,
                    what: "AES-GCM with this key size (only 128, 192 and 256 bits)",
                })
            }
        };
        gcm_key(alg, key)
    }

    fn cbc(&self, _key: &[u8]) -> Result<Box<dyn CbcKey>> {
        Err(Error::Unsupported {
            backend: NAME,
            what: "AES-CBC",
        })
    }

    fn hmac(&self, hash: Hash, key: &[u8], parts: &[&[u8]]) -> Result<Vec<u8>> {
        hmac(hash, key, parts)
    }

    fn hkdf_sha256(&self, ikm: &[u8], salt: &[u8], info: &[u8], out: &mut [u8]) -> Result<()> {
        hkdf_sha256(ikm, salt, info, out)
    }
}

/// `OPENSSL_ia32cap` is OpenSSL's debugging knob, but AWS-LC reads it too,
/// once, in a constructor that runs as the executable loads, and takes it
/// harder: a value that claims a feature the CPU lacks aborts the process
/// ("Fatal Error: HW capability found …", SIGABRT, whatever the command),
/// and an empty one leaves its capabilities unset, so AES runs without its
/// assembly (24 times slower). The constructor below runs before AWS-LC's
/// (a numbered `.init_array` entry runs before the unnumbered ones, where
/// AWS-LC's `__attribute__((constructor))` goes) and renames every such
/// entry of the environment in place (`openssl_ia32cap=`: `getenv` is
/// case-sensitive); [`super::restore_openssl_ia32cap`], at the start of `main`,
/// renames them back, so the environment is as it came, entries, order
/// and duplicates, for OpenSSL (whose libcrypto read it when it was
/// loaded, before this executable's constructors) and for the programs
/// this one starts. So AWS-LC uses the CPU as it is, as ring does.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
pub(super) mod ia32cap {
    use std::sync::atomic::{AtomicPtr, Ordering};

    const NAME: &[u8] = b"OPENSSL_ia32cap=";
    const SLOTS: usize = 16;

    extern "C" {
        static mut environ: *mut *mut libc::c_char;
    }

    /// The entries renamed (their first byte lowered), or null. More
    /// than [`SLOTS`] such entries: the others stay, and AWS-LC reads
    /// the first of them (as it would have read the first entry).
    static RENAMED: [AtomicPtr<libc::c_char>; SLOTS] =
        [const { AtomicPtr::new(std::ptr::null_mut()) }; SLOTS];

    extern "C" fn hide() {
        // SAFETY: runs before main, on the one thread there is. `environ`
        // is the initial, NUL-terminated array of NUL-terminated strings
        // on the process's stack, which is writable; each string is read
        // only up to its first differing byte or its NUL.
        unsafe {
            let mut entry = environ;
            if entry.is_null() {
                return;
            }
            let mut slot = 0;
            while !(*entry).is_null() && slot < SLOTS {
                let s = *entry;
                if std::ffi::CStr::from_ptr(s).to_bytes().starts_with(NAME) {
                    *s = b'o' as libc::c_char;
                    RENAMED[slot].store(s, Ordering::SeqCst);
                    slot += 1;
                }
                entry = entry.add(1);
            }
        }
    }

    #[used]
    #[link_section = ".init_array.00500"]
    static HIDE: extern "C" fn() = hide;

    /// Renames back what `hide` renamed (see the module).
    pub(in crate::backend) fn restore() {
        for slot in &RENAMED {
            let s = slot.swap(std::ptr::null_mut(), Ordering::SeqCst);
            if !s.is_null() {
                // SAFETY: an entry `hide` renamed, still in place (nothing
                // ran before main to change the environment); the caller
                // is single-threaded.
                unsafe { *s = b'O' as libc::c_char };
            }
        }
    }
}
