//! What the `ring` and `aws-lc` backends share: `aws-lc-rs` offers ring's
//! API (`aead::LessSafeKey`, `hmac`, `hkdf`) over AWS-LC, so the code that
//! drives it is written once, for either crate, by [`ring_api`].

/// Defines, in the calling module, over the ring-compatible crate `$lib`
/// and the backend name `$name`: the GCM key type and `gcm_key`, `hmac`
/// and `hkdf_sha256` functions for its `Backend` impl to call.
macro_rules! ring_api {
    ($lib:ident, $name:expr) => {
        use $lib::aead::{Aad, LessSafeKey, Nonce, UnboundKey};
        use $lib::{hkdf, hmac};

        use super::{AuthFailed, GcmKey, Hash, GCM_NONCE_LEN};

        struct Gcm(LessSafeKey);

        impl GcmKey for Gcm {
            fn seal(
                &mut self,
                nonce: &[u8; GCM_NONCE_LEN],
                aad: &[u8],
                buf: &mut Vec<u8>,
            ) -> Result<()> {
                let nonce = Nonce::assume_unique_for_key(*nonce);
                let tag = self
                    .0
                    .seal_in_place_separate_tag(nonce, Aad::from(aad), buf)
                    .map_err(|_| Error::Backend(format!("{}: seal failed", $name)))?;
                buf.extend_from_slice(tag.as_ref());
                Ok(())
            }

            fn open(
                &mut self,
                nonce: &[u8; GCM_NONCE_LEN],
                aad: &[u8],
                buf: &mut [u8],
            ) -> std::result::Result<usize, AuthFailed> {
                self.0
                    .open_in_place(Nonce::assume_unique_for_key(*nonce), Aad::from(aad), buf)
                    .map(|pt| pt.len())
                    .map_err(|_| AuthFailed)
            }
        }

        /// A GCM key of algorithm `alg` (whose key length `key` has).
        fn gcm_key(alg: &'static $lib::aead::Algorithm, key: &[u8]) -> Result<Box<dyn GcmKey>> {
            let key = UnboundKey::new(alg, key)
                .map_err(|_| Error::Backend(format!("{}: bad key", $name)))?;
            Ok(Box::new(Gcm(LessSafeKey::new(key))))
        }

        /// Output length for the HKDF API.
        struct Len(usize);

        impl hkdf::KeyType for Len {
            fn len(&self) -> usize {
                self.0
            }
        }

        fn hmac(hash: Hash, key: &[u8], parts: &[&[u8]]) -> Result<Vec<u8>> {
            let alg = match hash {
                Hash::Sha256 => hmac::HMAC_SHA256,
                Hash::Sha384 => hmac::HMAC_SHA384,
                Hash::Sha512 => hmac::HMAC_SHA512,
            };
            let key = hmac::Key::new(alg, key);
            let mut ctx = hmac::Context::with_key(&key);
            for part in parts {
                ctx.update(part);
            }
            Ok(ctx.sign().as_ref().to_vec())
        }

        fn hkdf_sha256(ikm: &[u8], salt: &[u8], info: &[u8], out: &mut [u8]) -> Result<()> {
            let too_long = || Error::InvalidParams("HKDF output longer than 255 blocks".into());
            if out.len() > 255 * 32 {
                return Err(too_long());
            }
            let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, salt).extract(ikm);
            let info = [info];
            let okm = prk.expand(&info, Len(out.len())).map_err(|_| too_long())?;
            okm.fill(out).map_err(|_| too_long())
        }
    };
}

pub(super) use ring_api;
