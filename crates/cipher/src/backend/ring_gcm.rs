//! `ring`: BoringSSL-derived AES-GCM assembly (AES-NI + CLMUL, AVX, and VAES
//! where present). ring implements neither AES-CBC nor 192-bit AES keys.

use ring::aead::{AES_128_GCM, AES_256_GCM};

use super::{Backend, CbcKey};
use crate::error::{Error, Result};

/// The ring backend (GCM with 128- and 256-bit keys, HMAC, HKDF).
#[derive(Clone, Copy, Debug, Default)]
pub struct Ring;

const NAME: &str = "ring";

super::ring_api::ring_api!(ring, NAME);

impl Backend for Ring {
    fn name(&self) -> &'static str {
        NAME
    }

    fn gcm(&self, key: &[u8]) -> Result<Box<dyn GcmKey>> {
        let alg = match key.len() {
            16 => &AES_128_GCM,
            32 => &AES_256_GCM,
            _ => {
                return Err(Error::Unsupported {
                    backend: NAME,
                    what: "AES-GCM with this key size (only 128 and 256 bits)",
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
