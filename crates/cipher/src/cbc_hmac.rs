//! AES-CBC with HMAC-SHA2, the RFC 7518 §5.2 AES_CBC_HMAC_SHA2 composition:
//! encrypt-then-MAC, tag = HMAC(MAC_KEY, A ‖ IV ‖ E ‖ AL) truncated to half the
//! hash. A128CBC-HS256, A192CBC-HS384 and A256CBC-HS512 by key size. This is
//! the only place CBC is used, so unauthenticated CBC can never be reached.

use std::ops::Range;
use std::sync::Arc;

use subtle::ConstantTimeEq;
use zeroize::Zeroizing;

use crate::backend::{AuthFailed, Backend, CbcKey, Hash, AES_BLOCK};
use crate::error::{Error, Result};

/// A keyed CBC-HMAC instance.
pub struct CbcHmac {
    backend: Arc<dyn Backend>,
    cbc: Box<dyn CbcKey>,
    mac_key: Zeroizing<Vec<u8>>,
    hash: Hash,
}

impl CbcHmac {
    /// `key` is the RFC 7518 composite key `MAC_KEY ‖ ENC_KEY` of 32, 48 or 64
    /// bytes.
    pub fn new(backend: Arc<dyn Backend>, key: &[u8]) -> Result<Self> {
        let hash = match key.len() {
            32 => Hash::Sha256,
            48 => Hash::Sha384,
            64 => Hash::Sha512,
            n => {
                return Err(Error::InvalidParams(format!(
                    "CBC-HMAC key must be 32, 48 or 64 bytes, got {n}"
                )))
            }
        };
        let half = key.len() / 2;
        let cbc = backend.cbc(&key[half..])?;
        Ok(CbcHmac {
            backend,
            cbc,
            mac_key: Zeroizing::new(key[..half].to_vec()),
            hash,
        })
    }

    /// Tag length in bytes (16, 24 or 32).
    pub fn tag_len(&self) -> usize {
        self.hash.output_len() / 2
    }

    /// Tag length for an AES key of `key_len` bytes.
    pub fn tag_len_for(key_len: usize) -> usize {
        key_len
    }

    fn tag(&self, aad: &[u8], iv_and_ct: &[u8]) -> Result<Vec<u8>> {
        let al = ((aad.len() as u64) * 8).to_be_bytes();
        let mut mac = self
            .backend
            .hmac(self.hash, &self.mac_key, &[aad, iv_and_ct, &al])?;
        mac.truncate(self.tag_len());
        Ok(mac)
    }

    /// `buf` holds 16 reserved bytes followed by the plaintext; on return it
    /// holds `IV ‖ E ‖ T`.
    pub fn seal(&mut self, iv: &[u8; AES_BLOCK], aad: &[u8], buf: &mut Vec<u8>) -> Result<()> {
        if buf.len() < AES_BLOCK {
            return Err(Error::Backend("cbc-hmac: missing IV room".into()));
        }
        buf[..AES_BLOCK].copy_from_slice(iv);
        self.cbc.encrypt(iv, buf, AES_BLOCK)?;
        let tag = self.tag(aad, buf)?;
        buf.extend_from_slice(&tag);
        Ok(())
    }

    /// `buf` holds `IV ‖ E ‖ T`; verifies T before decrypting anything and
    /// returns where the plaintext is.
    pub fn open(
        &mut self,
        aad: &[u8],
        buf: &mut [u8],
    ) -> std::result::Result<Range<usize>, AuthFailed> {
        let tag_len = self.tag_len();
        if buf.len() < AES_BLOCK * 2 + tag_len {
            return Err(AuthFailed);
        }
        let body_len = buf.len() - tag_len;
        let (body, tag) = buf.split_at_mut(body_len);
        let expect = self.tag(aad, body).map_err(|_| AuthFailed)?;
        if !bool::from(expect.ct_eq(tag)) {
            return Err(AuthFailed);
        }
        let (iv, ct) = body.split_at_mut(AES_BLOCK);
        let mut iv_arr = [0u8; AES_BLOCK];
        iv_arr.copy_from_slice(iv);
        let n = self.cbc.decrypt(&iv_arr, ct)?;
        Ok(AES_BLOCK..AES_BLOCK + n)
    }
}
