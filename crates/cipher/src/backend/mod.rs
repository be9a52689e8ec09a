//! AES backends behind one trait.
//!
//! Every backend provides the same four primitives: AES-GCM with a 96-bit
//! nonce, AES-CBC with PKCS#7 padding, HMAC-SHA2 and HKDF-SHA256. The
//! constructions built from them (the Tink-compatible GCM stream, the RFC 7518
//! CBC-HMAC composition) live once, in [`crate::stream`], so swapping a
//! backend can never change the file format: the property tests check that all
//! backends produce identical bytes for identical inputs and randomness.

mod openssl_evp;
mod ring_gcm;
mod rustcrypto;

use std::sync::Arc;

use crate::error::{Error, Result};

pub use openssl_evp::OpenSsl;
pub use ring_gcm::Ring;
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
/// encrypt-then-MAC composition in [`crate::stream`].
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
    /// Short, stable name (`openssl`, `rustcrypto`, `ring`).
    fn name(&self) -> &'static str;

    /// Whether this backend implements AES-GCM with `key_len`-byte keys.
    fn supports_gcm(&self, key_len: usize) -> bool;

    /// Whether this backend implements AES-CBC.
    fn supports_cbc(&self) -> bool;

    /// An AES-GCM key of 16, 24 or 32 bytes.
    fn gcm(&self, key: &[u8]) -> Result<Box<dyn GcmKey>>;

    /// An AES-CBC key of 16, 24 or 32 bytes.
    fn cbc(&self, key: &[u8]) -> Result<Box<dyn CbcKey>>;

    /// HMAC over the concatenation of `parts`; returns the full-length tag.
    fn hmac(&self, hash: Hash, key: &[u8], parts: &[&[u8]]) -> Result<Vec<u8>>;

    /// HKDF-SHA256 (RFC 5869) filling `out`.
    fn hkdf_sha256(&self, ikm: &[u8], salt: &[u8], info: &[u8], out: &mut [u8]) -> Result<()>;
}

/// Names accepted by [`by_name`].
pub const NAMES: [&str; 3] = ["openssl", "ring", "rustcrypto"];

/// All backends compiled in.
pub fn all() -> Vec<Arc<dyn Backend>> {
    vec![Arc::new(OpenSsl), Arc::new(Ring), Arc::new(RustCrypto)]
}

/// Looks a backend up by name.
pub fn by_name(name: &str) -> Result<Arc<dyn Backend>> {
    match name {
        "openssl" => Ok(Arc::new(OpenSsl)),
        "ring" => Ok(Arc::new(Ring)),
        "rustcrypto" => Ok(Arc::new(RustCrypto)),
        other => Err(Error::InvalidParams(format!(
            "unknown backend {other:?} (known: {})",
            NAMES.join(", ")
        ))),
    }
}

/// The default backend for a payload mode and key size: the fastest correct
/// one, by measurement on x86-64 with AES-NI and CLMUL (`examples/backend_speed.rs`;
/// figures in `docs/format.md`, "Backends"): ring for AES-GCM with 128- and
/// 256-bit keys, OpenSSL for CBC and for 192-bit keys, which ring does not
/// implement. All backends write identical bytes, so this is only speed.
pub fn default_for(mode: crate::Mode, key_len: usize) -> Arc<dyn Backend> {
    match mode {
        crate::Mode::Gcm if Ring.supports_gcm(key_len) => Arc::new(Ring),
        _ => Arc::new(OpenSsl),
    }
}

pub(crate) fn check_aes_key(backend: &'static str, key: &[u8]) -> Result<()> {
    match key.len() {
        16 | 24 | 32 => Ok(()),
        _ => Err(Error::InvalidParams(format!(
            "{backend}: AES key must be 16, 24 or 32 bytes, got {}",
            key.len()
        ))),
    }
}
