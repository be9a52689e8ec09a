//! RustCrypto: `aes-gcm`, `aes`, `cbc`, `hmac`, `hkdf`. Pure Rust; uses AES-NI
//! and CLMUL through runtime CPU detection, and a constant-time bitsliced
//! software AES elsewhere.

use aes::cipher::block_padding::Pkcs7;
use aes::cipher::{BlockDecryptMut, BlockEncryptMut, KeyIvInit};
use aes::{Aes128, Aes192, Aes256};
use aes_gcm::aead::consts::U12;
use aes_gcm::aead::{AeadInPlace, KeyInit};
use aes_gcm::{AesGcm, Tag};
use hmac::{Hmac, Mac};
use zeroize::Zeroizing;

use super::{
    check_aes_key, AuthFailed, Backend, CbcKey, GcmKey, Hash, AES_BLOCK, GCM_NONCE_LEN, GCM_TAG_LEN,
};
use crate::error::{Error, Result};

/// The RustCrypto backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct RustCrypto;

const NAME: &str = "rustcrypto";

struct Gcm<A>(AesGcm<A, U12>);

impl<A> GcmKey for Gcm<A>
where
    A: aes::cipher::BlockCipher
        + aes::cipher::BlockSizeUser<BlockSize = aes::cipher::consts::U16>
        + aes::cipher::BlockEncrypt
        + Send,
{
    fn seal(&mut self, nonce: &[u8; GCM_NONCE_LEN], aad: &[u8], buf: &mut Vec<u8>) -> Result<()> {
        let tag = self
            .0
            .encrypt_in_place_detached(nonce.into(), aad, buf)
            .map_err(|_| Error::Backend("aes-gcm: message too long".into()))?;
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
        let tag = Tag::<aes_gcm::aead::consts::U16>::clone_from_slice(tag);
        self.0
            .decrypt_in_place_detached(nonce.into(), aad, ct, &tag)
            .map_err(|_| AuthFailed)?;
        Ok(ct_len)
    }
}

struct Cbc {
    key: Zeroizing<Vec<u8>>,
}

fn cbc_encrypt<C>(key: &[u8], iv: &[u8; AES_BLOCK], buf: &mut [u8], len: usize) -> Result<usize>
where
    C: aes::cipher::BlockEncryptMut + aes::cipher::BlockCipher + aes::cipher::KeyInit,
    cbc::Encryptor<C>: KeyIvInit + BlockEncryptMut,
{
    let enc = cbc::Encryptor::<C>::new_from_slices(key, iv)
        .map_err(|_| Error::Backend("cbc: bad key length".into()))?;
    enc.encrypt_padded_mut::<Pkcs7>(buf, len)
        .map(|ct| ct.len())
        .map_err(|_| Error::Backend("cbc: buffer too small".into()))
}

fn cbc_decrypt<C>(
    key: &[u8],
    iv: &[u8; AES_BLOCK],
    buf: &mut [u8],
) -> std::result::Result<usize, AuthFailed>
where
    C: aes::cipher::BlockDecryptMut + aes::cipher::BlockCipher + aes::cipher::KeyInit,
    cbc::Decryptor<C>: KeyIvInit + BlockDecryptMut,
{
    let dec = cbc::Decryptor::<C>::new_from_slices(key, iv).map_err(|_| AuthFailed)?;
    dec.decrypt_padded_mut::<Pkcs7>(buf)
        .map(|pt| pt.len())
        .map_err(|_| AuthFailed)
}

impl CbcKey for Cbc {
    fn encrypt(&mut self, iv: &[u8; AES_BLOCK], buf: &mut Vec<u8>, start: usize) -> Result<()> {
        let len = buf.len() - start;
        buf.resize(buf.len() + AES_BLOCK, 0);
        let region = &mut buf[start..];
        let n = match self.key.len() {
            16 => cbc_encrypt::<Aes128>(&self.key, iv, region, len)?,
            24 => cbc_encrypt::<Aes192>(&self.key, iv, region, len)?,
            _ => cbc_encrypt::<Aes256>(&self.key, iv, region, len)?,
        };
        buf.truncate(start + n);
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
        match self.key.len() {
            16 => cbc_decrypt::<Aes128>(&self.key, iv, buf),
            24 => cbc_decrypt::<Aes192>(&self.key, iv, buf),
            _ => cbc_decrypt::<Aes256>(&self.key, iv, buf),
        }
    }
}

/// HMAC over `parts` with the given concrete hash type.
macro_rules! hmac_parts {
    ($hash:ty, $key:expr, $parts:expr) => {{
        let mut mac = <Hmac<$hash> as KeyInit>::new_from_slice($key)
            .map_err(|_| Error::Backend("hmac: bad key".into()))?;
        for part in $parts {
            mac.update(part);
        }
        mac.finalize().into_bytes().to_vec()
    }};
}

impl Backend for RustCrypto {
    fn name(&self) -> &'static str {
        NAME
    }

    fn gcm(&self, key: &[u8]) -> Result<Box<dyn GcmKey>> {
        check_aes_key(NAME, key)?;
        let bad = |_| Error::Backend("aes-gcm: bad key length".into());
        Ok(match key.len() {
            16 => Box::new(Gcm(AesGcm::<Aes128, U12>::new_from_slice(key).map_err(bad)?)),
            24 => Box::new(Gcm(AesGcm::<Aes192, U12>::new_from_slice(key).map_err(bad)?)),
            _ => Box::new(Gcm(AesGcm::<Aes256, U12>::new_from_slice(key).map_err(bad)?)),
        })
    }

    fn cbc(&self, key: &[u8]) -> Result<Box<dyn CbcKey>> {
        check_aes_key(NAME, key)?;
        Ok(Box::new(Cbc {
            key: Zeroizing::new(key.to_vec()),
        }))
    }

    fn hmac(&self, hash: Hash, key: &[u8], parts: &[&[u8]]) -> Result<Vec<u8>> {
        Ok(match hash {
            Hash::Sha256 => hmac_parts!(sha2::Sha256, key, parts),
            Hash::Sha384 => hmac_parts!(sha2::Sha384, key, parts),
            Hash::Sha512 => hmac_parts!(sha2::Sha512, key, parts),
        })
    }

    fn hkdf_sha256(&self, ikm: &[u8], salt: &[u8], info: &[u8], out: &mut [u8]) -> Result<()> {
        let salt = if salt.is_empty() { None } else { Some(salt) };
        hkdf::Hkdf::<sha2::Sha256>::new(salt, ikm)
            .expand(info, out)
            .map_err(|_| Error::InvalidParams("HKDF output longer than 255 blocks".into()))
    }
}
