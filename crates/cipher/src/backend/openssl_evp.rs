//! OpenSSL EVP through the `openssl` crate: AES-NI, CLMUL and the stitched
//! AES-GCM assembly where the CPU has them.

use openssl::cipher::{Cipher, CipherRef};
use openssl::cipher_ctx::CipherCtx;
use openssl::hash::MessageDigest;
use openssl::md::Md;
use openssl::pkey::{Id, PKey};
use openssl::pkey_ctx::PkeyCtx;
use openssl::sign::Signer;
use zeroize::Zeroizing;

use super::{
    check_aes_key, AuthFailed, Backend, CbcKey, GcmKey, Hash, AES_BLOCK, GCM_NONCE_LEN, GCM_TAG_LEN,
};
use crate::error::{Error, Result};

/// The OpenSSL backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct OpenSsl;

const NAME: &str = "openssl";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    Encrypt,
    Decrypt,
}

/// A cipher context bound to one key; re-initialised with the key only when
/// the direction changes, so the key schedule is computed once per direction.
struct Ctx {
    cipher: &'static CipherRef,
    key: Zeroizing<Vec<u8>>,
    ctx: CipherCtx,
    dir: Option<Dir>,
}

impl Ctx {
    fn new(cipher: &'static CipherRef, key: &[u8]) -> Result<Self> {
        Ok(Ctx {
            cipher,
            key: Zeroizing::new(key.to_vec()),
            ctx: CipherCtx::new().map_err(Error::backend)?,
            dir: None,
        })
    }

    fn start(
        &mut self,
        dir: Dir,
        iv: &[u8],
    ) -> std::result::Result<(), openssl::error::ErrorStack> {
        if self.dir != Some(dir) {
            match dir {
                Dir::Encrypt => self
                    .ctx
                    .encrypt_init(Some(self.cipher), Some(&self.key), None)?,
                Dir::Decrypt => self
                    .ctx
                    .decrypt_init(Some(self.cipher), Some(&self.key), None)?,
            }
            self.dir = Some(dir);
        }
        match dir {
            Dir::Encrypt => self.ctx.encrypt_init(None, None, Some(iv)),
            Dir::Decrypt => self.ctx.decrypt_init(None, None, Some(iv)),
        }
    }
}

fn gcm_cipher(len: usize) -> &'static CipherRef {
    match len {
        16 => Cipher::aes_128_gcm(),
        24 => Cipher::aes_192_gcm(),
        _ => Cipher::aes_256_gcm(),
    }
}

fn cbc_cipher(len: usize) -> &'static CipherRef {
    match len {
        16 => Cipher::aes_128_cbc(),
        24 => Cipher::aes_192_cbc(),
        _ => Cipher::aes_256_cbc(),
    }
}

struct Gcm(Ctx);

impl GcmKey for Gcm {
    fn seal(&mut self, nonce: &[u8; GCM_NONCE_LEN], aad: &[u8], buf: &mut Vec<u8>) -> Result<()> {
        let ctx = &mut self.0;
        ctx.start(Dir::Encrypt, nonce).map_err(Error::backend)?;
        if !aad.is_empty() {
            ctx.ctx.cipher_update(aad, None).map_err(Error::backend)?;
        }
        let len = buf.len();
        ctx.ctx
            .cipher_update_inplace(buf, len)
            .map_err(Error::backend)?;
        ctx.ctx.cipher_final(&mut []).map_err(Error::backend)?;
        let mut tag = [0u8; GCM_TAG_LEN];
        ctx.ctx.tag(&mut tag).map_err(Error::backend)?;
        buf.extend_from_slice(&tag);
        Ok(())
    }

    fn open(
        &mut self,
        nonce: &[u8; GCM_NONCE_LEN],
        aad: &[u8],
        buf: &mut [u8],
    ) -> std::result::Result<usize, AuthFailed> {
        let ct_len = buf.len().checked_sub(GCM_TAG_LEN).ok_or(AuthFailed)?;
        let (ct, tag) = buf.split_at_mut(ct_len);
        let ctx = &mut self.0;
        ctx.start(Dir::Decrypt, nonce).map_err(|_| AuthFailed)?;
        ctx.ctx.set_tag(tag).map_err(|_| AuthFailed)?;
        if !aad.is_empty() {
            ctx.ctx.cipher_update(aad, None).map_err(|_| AuthFailed)?;
        }
        ctx.ctx
            .cipher_update_inplace(ct, ct_len)
            .map_err(|_| AuthFailed)?;
        ctx.ctx.cipher_final(&mut []).map_err(|_| AuthFailed)?;
        Ok(ct_len)
    }
}

struct Cbc(Ctx);

impl CbcKey for Cbc {
    fn encrypt(&mut self, iv: &[u8; AES_BLOCK], buf: &mut Vec<u8>, start: usize) -> Result<()> {
        let ctx = &mut self.0;
        ctx.start(Dir::Encrypt, iv).map_err(Error::backend)?;
        let len = buf.len() - start;
        buf.resize(buf.len() + AES_BLOCK, 0);
        let written = ctx
            .ctx
            .cipher_update_inplace(&mut buf[start..], len)
            .map_err(Error::backend)?;
        let fin = ctx
            .ctx
            .cipher_final(&mut buf[start + written..])
            .map_err(Error::backend)?;
        buf.truncate(start + written + fin);
        Ok(())
    }

    fn decrypt(
        &mut self,
        iv: &[u8; AES_BLOCK],
        buf: &mut [u8],
    ) -> std::result::Result<usize, AuthFailed> {
        if buf.is_empty() || buf.len() % AES_BLOCK != 0 {
            return Err(AuthFailed);
        }
        let ctx = &mut self.0;
        ctx.start(Dir::Decrypt, iv).map_err(|_| AuthFailed)?;
        let len = buf.len();
        // `cipher_update_inplace` asserts (panics) unless the buffer has one
        // block of room beyond the input, so all but the last block are
        // decrypted in place and the last one through a small stack buffer.
        // OpenSSL holds back the last decrypted block until `final`, so each
        // update writes at most its input length, behind what it has read.
        let body = len - AES_BLOCK;
        let mut written = ctx
            .ctx
            .cipher_update_inplace(buf, body)
            .map_err(|_| AuthFailed)?;
        let mut last_in = [0u8; AES_BLOCK];
        last_in.copy_from_slice(&buf[body..]);
        let mut out = Zeroizing::new([0u8; 2 * AES_BLOCK]);
        let n = ctx
            .ctx
            .cipher_update(&last_in, Some(&mut out[..]))
            .map_err(|_| AuthFailed)?;
        buf[written..written + n].copy_from_slice(&out[..n]);
        written += n;
        let fin = ctx
            .ctx
            .cipher_final(&mut out[..AES_BLOCK])
            .map_err(|_| AuthFailed)?;
        buf[written..written + fin].copy_from_slice(&out[..fin]);
        Ok(written + fin)
    }
}

fn digest(hash: Hash) -> MessageDigest {
    match hash {
        Hash::Sha256 => MessageDigest::sha256(),
        Hash::Sha384 => MessageDigest::sha384(),
        Hash::Sha512 => MessageDigest::sha512(),
    }
}

impl Backend for OpenSsl {
    fn name(&self) -> &'static str {
        NAME
    }

    fn gcm(&self, key: &[u8]) -> Result<Box<dyn GcmKey>> {
        check_aes_key(NAME, key)?;
        Ok(Box::new(Gcm(Ctx::new(gcm_cipher(key.len()), key)?)))
    }

    fn cbc(&self, key: &[u8]) -> Result<Box<dyn CbcKey>> {
        check_aes_key(NAME, key)?;
        Ok(Box::new(Cbc(Ctx::new(cbc_cipher(key.len()), key)?)))
    }

    fn hmac(&self, hash: Hash, key: &[u8], parts: &[&[u8]]) -> Result<Vec<u8>> {
        let pkey = PKey::hmac(key).map_err(Error::backend)?;
        let mut signer = Signer::new(digest(hash), &pkey).map_err(Error::backend)?;
        for part in parts {
            signer.update(part).map_err(Error::backend)?;
        }
        signer.sign_to_vec().map_err(Error::backend)
    }

    fn hkdf_sha256(&self, ikm: &[u8], salt: &[u8], info: &[u8], out: &mut [u8]) -> Result<()> {
        if out.len() > 255 * 32 {
            return Err(Error::InvalidParams(
                "HKDF output longer than 255 blocks".into(),
            ));
        }
        if out.is_empty() {
            return Ok(());
        }
        let mut ctx = PkeyCtx::new_id(Id::HKDF).map_err(Error::backend)?;
        ctx.derive_init().map_err(Error::backend)?;
        ctx.set_hkdf_md(Md::sha256()).map_err(Error::backend)?;
        ctx.set_hkdf_key(ikm).map_err(Error::backend)?;
        // An empty salt is HMAC-equivalent to the RFC's default of zeros;
        // OpenSSL rejects a zero-length salt, so leave it unset then.
        if !salt.is_empty() {
            ctx.set_hkdf_salt(salt).map_err(Error::backend)?;
        }
        if !info.is_empty() {
            ctx.add_hkdf_info(info).map_err(Error::backend)?;
        }
        ctx.derive(Some(out)).map_err(Error::backend)?;
        Ok(())
    }
}
