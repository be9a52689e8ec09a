//! AES backends behind one trait.
//!
//! Every backend provides the same four primitives: AES-GCM with a 96-bit
//! nonce, AES-CBC with PKCS#7 padding, HMAC-SHA2 and HKDF-SHA256. The
//! constructions built from them (the Tink-compatible GCM stream, the RFC 7518
//! CBC-HMAC composition) live once, in [`crate::segment`], so swapping a
//! backend can never change the file format: the property tests check that all
//! backends produce identical bytes for identical inputs and randomness.

//!
//! Each backend sits behind the cargo feature of its name (`openssl`,
//! `ring`, `rustcrypto`, `aws-lc`); all four are on by default, as the
//! command line offers `--backend` and the fastest one differs by mode, key
//! size and CPU. Any
//! non-empty subset builds; a backend left out is a clear error from
//! [`by_name`].

#[cfg(not(any(
    feature = "openssl",
    feature = "ring",
    feature = "rustcrypto",
    feature = "aws-lc"
)))]
compile_error!(
    "tpmcrypt-cipher needs at least one backend feature: openssl, ring, rustcrypto or aws-lc"
);

#[cfg(feature = "aws-lc")]
mod aws_lc;
#[cfg(feature = "openssl")]
mod openssl_evp;
#[cfg(any(feature = "ring", feature = "aws-lc"))]
mod ring_api;
#[cfg(feature = "ring")]
mod ring_gcm;
#[cfg(feature = "rustcrypto")]
mod rustcrypto;

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::segment::Mode;

#[cfg(feature = "aws-lc")]
pub use aws_lc::AwsLc;
#[cfg(feature = "openssl")]
pub use openssl_evp::OpenSsl;
#[cfg(feature = "ring")]
pub use ring_gcm::Ring;
#[cfg(feature = "rustcrypto")]
pub use rustcrypto::RustCrypto;

/// Length of a GCM tag in bytes.
pub const GCM_TAG_LEN: usize = 16;
/// Length of a GCM nonce in bytes.
pub const GCM_NONCE_LEN: usize = 12;
/// AES block size; also the CBC IV length.
pub const AES_BLOCK: usize = 16;

/// Hash functions used with HMAC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hash {
    /// SHA-256 (32-byte output).
    Sha256,
    /// SHA-384 (48-byte output).
    Sha384,
    /// SHA-512 (64-byte output).
    Sha512,
}

impl Hash {
    /// Output length in bytes.
    pub fn output_len(self) -> usize {
        match self {
            Hash::Sha256 => 32,
            Hash::Sha384 => 48,
            Hash::Sha512 => 64,
        }
    }
}

/// An AES-GCM key, ready to seal and open segments. Implementations may keep
/// a context between calls, hence `&mut self`.
pub trait GcmKey: Send {
    /// Encrypts `buf` in place and appends the 16-byte tag.
    fn seal(&mut self, nonce: &[u8; GCM_NONCE_LEN], aad: &[u8], buf: &mut Vec<u8>) -> Result<()>;

    /// Authenticates and decrypts `buf` = ciphertext ‖ tag in place and
    /// returns the plaintext length (the plaintext is `buf[..len]`).
    /// Fails with [`AuthFailed`] on any mismatch; `buf` is then garbage.
    fn open(
        &mut self,
        nonce: &[u8; GCM_NONCE_LEN],
        aad: &[u8],
        buf: &mut [u8],
    ) -> std::result::Result<usize, AuthFailed>;
}

/// An AES-CBC key with PKCS#7 padding. Never used on its own: only inside the
/// encrypt-then-MAC composition in [`crate::segment`].
pub trait CbcKey: Send {
    /// Encrypts `buf[start..]` in place, growing `buf` by the padding.
    fn encrypt(&mut self, iv: &[u8; AES_BLOCK], buf: &mut Vec<u8>, start: usize) -> Result<()>;

    /// Decrypts `buf` in place and strips the padding; returns the plaintext
    /// length. Fails on a length that is not a whole number of blocks or on
    /// bad padding.
    fn decrypt(
        &mut self,
        iv: &[u8; AES_BLOCK],
        buf: &mut [u8],
    ) -> std::result::Result<usize, AuthFailed>;
}

/// Authentication (or padding) failure; carries no detail on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuthFailed;

/// One implementation of the primitives.
pub trait Backend: Send + Sync {
    /// Short, stable name (`openssl`, `rustcrypto`, `ring`, `aws-lc`).
    fn name(&self) -> &'static str;

    /// Whether this backend implements AES-GCM with `key_len`-byte keys
    /// (from [`serves`]).
    fn supports_gcm(&self, key_len: usize) -> bool {
        serves(self.name(), Mode::Gcm, key_len)
    }

    /// Whether this backend implements AES-CBC (from [`serves`]).
    fn supports_cbc(&self) -> bool {
        serves(self.name(), Mode::Cbc, 16)
    }

    /// An AES-GCM key of 16, 24 or 32 bytes.
    fn gcm(&self, key: &[u8]) -> Result<Box<dyn GcmKey>>;

    /// An AES-CBC key of 16, 24 or 32 bytes.
    fn cbc(&self, key: &[u8]) -> Result<Box<dyn CbcKey>>;

    /// HMAC over the concatenation of `parts`; returns the full-length tag.
    fn hmac(&self, hash: Hash, key: &[u8], parts: &[&[u8]]) -> Result<Vec<u8>>;

    /// HKDF-SHA256 (RFC 5869) filling `out`.
    fn hkdf_sha256(&self, ikm: &[u8], salt: &[u8], info: &[u8], out: &mut [u8]) -> Result<()>;
}

/// Puts `OPENSSL_ia32cap` back into the environment, which this crate
/// hides from AWS-LC while it loads (see `backend/aws_lc.rs`): call it
/// first thing in `main`, before any thread starts. Without the `aws-lc`
/// feature, nothing was hidden and this does nothing.
pub fn restore_openssl_ia32cap() {
    #[cfg(all(feature = "aws-lc", target_os = "linux", target_arch = "x86_64"))]
    aws_lc::ia32cap::restore();
}

/// Whether AWS-LC runs its 512-bit AES-GCM here: it does where the CPU
/// and the kernel offer VAES, VPCLMULQDQ and AVX-512 F, DQ, BW and VL (the
/// test of AWS-LC's `crypto_gcm_avx512_enabled`). Elsewhere its AES-GCM
/// is the 128-bit AES-NI one, slower than ring's 256-bit VAES path on a
/// CPU with VAES but no AVX-512 (Zen 3, Alder Lake).
pub fn aws_lc_gcm_is_wide() -> bool {
    #[cfg(all(feature = "aws-lc", target_arch = "x86_64"))]
    {
        std::arch::is_x86_feature_detected!("vaes")
            && std::arch::is_x86_feature_detected!("vpclmulqdq")
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(all(feature = "aws-lc", target_arch = "x86_64")))]
    false
}

/// Whether the backend named `name`, compiled in or not, implements
/// `mode` with `key_len`-byte keys: each of them AES-GCM with 128- and
/// 256-bit keys, all but ring 192-bit ones (ring has no AES-192), and
/// OpenSSL and RustCrypto AES-CBC. The one table of what each backend
/// does: [`Backend::supports_gcm`] and [`Backend::supports_cbc`] answer
/// from it, and so does [`crate::Params::preferred_backend`] for backends
/// a build left out.
pub fn serves(name: &str, mode: Mode, key_len: usize) -> bool {
    let sizes = matches!(key_len, 16 | 24 | 32);
    match mode {
        Mode::Gcm => sizes && NAMES.contains(&name) && !(name == "ring" && key_len == 24),
        Mode::Cbc => sizes && matches!(name, "openssl" | "rustcrypto"),
    }
}

/// Names of every backend there is, compiled in or not.
pub const NAMES: [&str; 4] = ["openssl", "ring", "rustcrypto", "aws-lc"];

/// OpenSSL's backend, once [`enable_openssl`] ran in this process.
#[cfg(feature = "openssl")]
static OPENSSL: std::sync::OnceLock<fn() -> Arc<dyn Backend>> = std::sync::OnceLock::new();

/// Makes OpenSSL's EVP backend available to [`by_name`], [`all`] and
/// [`crate::Params::default_backend`] in this process (with the `openssl`
/// feature; without it this does nothing).
///
/// It is not available before: a program that never calls this never
/// references OpenSSL's code, so the linker leaves libcrypto out of it and
/// its every start skips loading it (about 0.8 ms of CPU on a small run).
/// ring and RustCrypto serve every mode and key size without it, writing
/// the same bytes; OpenSSL is only the fastest for CBC and 192-bit keys.
pub fn enable_openssl() {
    #[cfg(feature = "openssl")]
    {
        let _ = OPENSSL.set(|| Arc::new(OpenSsl));
    }
}

/// The backend of `name` if this build has it compiled in (and, for
/// OpenSSL, [`enable_openssl`] ran).
pub(crate) fn compiled(name: &str) -> Option<Arc<dyn Backend>> {
    #[cfg(test)]
    enable_openssl();
    match name {
        #[cfg(feature = "openssl")]
        "openssl" => OPENSSL.get().map(|make| make()),
        #[cfg(feature = "ring")]
        "ring" => Some(Arc::new(Ring)),
        #[cfg(feature = "rustcrypto")]
        "rustcrypto" => Some(Arc::new(RustCrypto)),
        #[cfg(feature = "aws-lc")]
        "aws-lc" => Some(Arc::new(AwsLc)),
        _ => None,
    }
}

/// All backends compiled in.
pub fn all() -> Vec<Arc<dyn Backend>> {
    NAMES.iter().filter_map(|name| compiled(name)).collect()
}

/// Looks a backend up by name. A known backend left out of this build is
/// an [`Error::InvalidParams`] that says so.
pub fn by_name(name: &str) -> Result<Arc<dyn Backend>> {
    if let Some(backend) = compiled(name) {
        return Ok(backend);
    }
    let built: Vec<_> = all().iter().map(|b| b.name()).collect();
    #[cfg(feature = "openssl")]
    if name == "openssl" {
        return Err(Error::InvalidParams(format!(
            "backend \"openssl\" is not enabled in this process (enable_openssl; available: {})",
            built.join(", ")
        )));
    }
    if NAMES.contains(&name) {
        return Err(Error::InvalidParams(format!(
            "backend {name:?} is not compiled into this build (compiled in: {})",
            built.join(", ")
        )));
    }
    Err(Error::InvalidParams(format!(
        "unknown backend {name:?} (known: {})",
        built.join(", ")
    )))
}

#[cfg(any(feature = "openssl", feature = "rustcrypto"))]
pub(crate) fn check_aes_key(backend: &'static str, key: &[u8]) -> Result<()> {
    match key.len() {
        16 | 24 | 32 => Ok(()),
        _ => Err(Error::InvalidParams(format!(
            "{backend}: AES key must be 16, 24 or 32 bytes, got {}",
            key.len()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In every feature subset: a compiled-in backend is found by name, a
    /// known one left out is an error that says so, an unknown one is
    /// unknown, and `all` lists exactly the compiled-in ones.
    #[test]
    fn by_name_tells_left_out_from_unknown() {
        for name in NAMES {
            let built = [
                ("openssl", cfg!(feature = "openssl")),
                ("ring", cfg!(feature = "ring")),
                ("rustcrypto", cfg!(feature = "rustcrypto")),
                ("aws-lc", cfg!(feature = "aws-lc")),
            ]
            .iter()
            .any(|&(n, on)| n == name && on);
            match by_name(name) {
                Ok(b) => assert!(built && b.name() == name, "{name}"),
                Err(e) => {
                    assert!(!built, "{name}: {e}");
                    assert!(matches!(e, Error::InvalidParams(_)));
                    assert!(
                        e.to_string().contains("not compiled into this build"),
                        "{e}"
                    );
                }
            }
            assert_eq!(all().iter().any(|b| b.name() == name), built, "{name}");
        }
        match by_name("aesni") {
            Err(e) => assert!(e.to_string().contains("unknown backend"), "{e}"),
            Ok(b) => panic!("found {}", b.name()),
        }
    }

    /// The table of what each backend does ([`serves`]) is what each one
    /// compiled in does: a key it says is served is made and seals, one it
    /// says is not is refused.
    #[test]
    fn serves_is_what_each_backend_does() {
        for b in all() {
            for len in [16, 24, 32] {
                let key = vec![7u8; len];
                let gcm = b.gcm(&key).and_then(|mut k| {
                    let mut buf = b"segment".to_vec();
                    k.seal(&[0; GCM_NONCE_LEN], b"", &mut buf)
                });
                let cbc = b.cbc(&key).and_then(|mut k| {
                    let mut buf = b"segment".to_vec();
                    k.encrypt(&[0; AES_BLOCK], &mut buf, 0)
                });
                let name = b.name();
                assert_eq!(
                    serves(name, Mode::Gcm, len),
                    gcm.is_ok(),
                    "{name} gcm {len}"
                );
                assert_eq!(
                    serves(name, Mode::Cbc, len),
                    cbc.is_ok(),
                    "{name} cbc {len}"
                );
            }
        }
    }

    /// With every backend built, the default is the preferred one by name
    /// (what the front, without OpenSSL, asks to know the full default).
    #[cfg(all(
        feature = "openssl",
        feature = "ring",
        feature = "rustcrypto",
        feature = "aws-lc"
    ))]
    #[test]
    fn the_preferred_backend_is_the_default_of_a_full_build() {
        for mode in [Mode::Gcm, Mode::Cbc] {
            for bits in [128, 192, 256] {
                let p = crate::Params::new(mode, bits).unwrap();
                assert_eq!(
                    p.preferred_backend(),
                    p.default_backend().name(),
                    "{mode:?} {bits}"
                );
            }
        }
    }
}
