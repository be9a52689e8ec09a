//! RSA-OAEP key wrapping for TPM-held RSA-2048 keys: OAEP with SHA-256 and
//! MGF1-SHA-256, empty label — exactly what TPM2_RSA_Decrypt (and
//! `tpm2_rsadecrypt -s oaep`) undoes.
//!
//! ```text
//! body = fingerprint(R) ‖ RSA-OAEP-SHA256(R, session key)   (16 + 256 bytes)
//! ```

use openssl::md::Md;
use openssl::pkey::{PKey, Public};
use openssl::pkey_ctx::PkeyCtx;
use openssl::rsa::Padding;
use rand_core::CryptoRngCore;
use zeroize::Zeroizing;

use super::{fingerprint_spki, kind, Identity, Recipient};
use crate::error::{Error, Result};
use crate::format::{Stanza, FINGERPRINT_LEN};
use crate::secret::{SessionKey, SESSION_KEY_LEN};

/// The one private-key operation an RSA identity needs.
pub trait RsaOaepDecrypt: Send + Sync {
    /// DER SubjectPublicKeyInfo of the key.
    fn public_spki_der(&self) -> Vec<u8>;

    /// RSA-OAEP (SHA-256, MGF1-SHA-256, empty label) decryption.
    fn decrypt(&self, ciphertext: &[u8]) -> Result<Zeroizing<Vec<u8>>>;

    /// Whether the private key is in this process's memory (see
    /// [`Identity::in_memory`]); `false` by default.
    fn in_memory(&self) -> bool {
        false
    }
}

/// An RSA public key as a recipient.
#[derive(Clone)]
pub struct RsaRecipient {
    public: PKey<Public>,
    fingerprint: [u8; FINGERPRINT_LEN],
}

impl RsaRecipient {
    /// From a DER SubjectPublicKeyInfo. Only a key a TPM can hold as an
    /// RSA-2048 decryption key is accepted: a 2048-bit modulus and a prime
    /// public exponent of at most 32 bits (TPMT_PUBLIC stores it as a
    /// UINT32). Anything else would give files no TPM key can open.
    pub fn from_spki_der(der: &[u8]) -> Result<Self> {
        let public = PKey::public_key_from_der(der)
            .map_err(|_| Error::InvalidRecipient("not a DER public key".into()))?;
        let rsa = public
            .rsa()
            .map_err(|_| Error::InvalidRecipient("not an RSA key".into()))?;
        let bits = rsa.n().num_bits();
        if bits != 2048 {
            return Err(Error::InvalidRecipient(format!(
                "an RSA key of {bits} bits: only RSA-2048 keys can be TPM key recipients"
            )));
        }
        check_exponent(rsa.e())?;
        Ok(RsaRecipient {
            public,
            fingerprint: fingerprint_spki(der),
        })
    }
}

/// Refuses a public exponent no TPM key has: the TPM stores it in 32 bits
/// and requires a prime greater than 2.
fn check_exponent(e: &openssl::bn::BigNumRef) -> Result<()> {
    let mut ctx = openssl::bn::BigNumContext::new().map_err(Error::backend)?;
    let prime = e.is_prime(64, &mut ctx).map_err(Error::backend)?;
    if e.num_bits() > 32 || !e.is_bit_set(0) || !prime {
        let shown = e.to_dec_str().map(|s| s.to_string()).unwrap_or_default();
        return Err(Error::InvalidRecipient(format!(
            "RSA public exponent {shown} is not one a TPM key can have (a prime of at most 32 bits)"
        )));
    }
    Ok(())
}

/// Applies the OAEP parameters to a context: one place for them.
fn oaep<T>(ctx: &mut PkeyCtx<T>) -> std::result::Result<(), openssl::error::ErrorStack> {
    ctx.set_rsa_padding(Padding::PKCS1_OAEP)?;
    ctx.set_rsa_oaep_md(Md::sha256())?;
    ctx.set_rsa_mgf1_md(Md::sha256())
}

impl Recipient for RsaRecipient {
    fn wrap(&self, key: &SessionKey, _rng: &mut dyn CryptoRngCore) -> Result<Stanza> {
        // OpenSSL draws the OAEP seed from its own CSPRNG.
        let mut ctx = PkeyCtx::new(&self.public).map_err(Error::backend)?;
        ctx.encrypt_init().map_err(Error::backend)?;
        oaep(&mut ctx).map_err(Error::backend)?;
        let mut ct = Vec::new();
        ctx.encrypt_to_vec(key.expose(), &mut ct)
            .map_err(Error::backend)?;
        let mut body = Vec::with_capacity(FINGERPRINT_LEN + ct.len());
        body.extend_from_slice(&self.fingerprint);
        body.extend_from_slice(&ct);
        Ok(Stanza {
            kind: kind::TPM_RSA2048,
            body,
        })
    }

    fn kind(&self) -> u8 {
        kind::TPM_RSA2048
    }

    fn fingerprint(&self) -> [u8; FINGERPRINT_LEN] {
        self.fingerprint
    }
}

/// An RSA identity around any [`RsaOaepDecrypt`].
pub struct RsaIdentity<D: RsaOaepDecrypt> {
    decrypt: D,
    fingerprint: [u8; FINGERPRINT_LEN],
}

impl<D: RsaOaepDecrypt> RsaIdentity<D> {
    /// Wraps `decrypt` as an identity.
    pub fn new(decrypt: D) -> Self {
        let fingerprint = fingerprint_spki(&decrypt.public_spki_der());
        RsaIdentity {
            decrypt,
            fingerprint,
        }
    }
}

impl<D: RsaOaepDecrypt> Identity for RsaIdentity<D> {
    fn unwrap(&self, stanza: &Stanza) -> Result<Option<SessionKey>> {
        if stanza.kind != kind::TPM_RSA2048 || stanza.fingerprint() != Some(&self.fingerprint[..]) {
            return Ok(None);
        }
        let plain = self.decrypt.decrypt(&stanza.body[FINGERPRINT_LEN..])?;
        let bytes: &[u8; SESSION_KEY_LEN] = plain[..]
            .try_into()
            .map_err(|_| Error::Unwrap("RSA stanza holds a key of the wrong length".into()))?;
        Ok(Some(SessionKey::from_bytes(bytes)))
    }

    fn in_memory(&self) -> bool {
        self.decrypt.in_memory()
    }
}

/// A software RSA private key, for tests and for escrow tooling; the TPM
/// implementation lives in the CLI's glue.
pub struct SoftwareRsa(pub PKey<openssl::pkey::Private>);

impl RsaOaepDecrypt for SoftwareRsa {
    fn public_spki_der(&self) -> Vec<u8> {
        self.0.public_key_to_der().unwrap_or_default()
    }

    fn decrypt(&self, ciphertext: &[u8]) -> Result<Zeroizing<Vec<u8>>> {
        let fail = |_| Error::Unwrap("RSA-OAEP decryption failed".into());
        let mut ctx = PkeyCtx::new(&self.0).map_err(fail)?;
        ctx.decrypt_init().map_err(fail)?;
        oaep(&mut ctx).map_err(fail)?;
        let mut out = Zeroizing::new(Vec::new());
        ctx.decrypt_to_vec(ciphertext, &mut out).map_err(fail)?;
        Ok(out)
    }

    fn in_memory(&self) -> bool {
        true
    }
}
