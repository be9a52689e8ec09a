//! Recipients wrap the session key; identities unwrap it.
//!
//! A recipient needs only a public key, so encryption never needs a TPM or a
//! secret. Three kinds exist: the software recovery key and a TPM-held
//! P-256 key share one ECIES construction ([`p256`]); a TPM-held RSA-2048
//! key uses RSA-OAEP ([`rsa`]). The private half is behind a small trait
//! ([`p256::EcdhP256`], [`rsa::RsaOaepDecrypt`]) so that the TPM crate
//! supplies only the one operation the TPM performs.

pub mod p256;
pub mod rsa;

use rand_core::CryptoRngCore;
use sha2::{Digest, Sha256};

use crate::error::Result;
use crate::format::{Stanza, FINGERPRINT_LEN};
use crate::secret::SessionKey;

/// Stanza kind bytes.
pub mod kind {
    /// Software recovery key (P-256 ECIES).
    pub const RECOVERY_P256: u8 = 0x01;
    /// TPM-held P-256 key (same ECIES; TPM2_ECDH_ZGen unwraps).
    pub const TPM_P256: u8 = 0x02;
    /// TPM-held RSA-2048 key (RSA-OAEP-SHA256; TPM2_RSA_Decrypt unwraps).
    pub const TPM_RSA2048: u8 = 0x03;

    /// Human name of a kind, for `inspect`.
    pub fn name(kind: u8) -> &'static str {
        match kind {
            RECOVERY_P256 => "recovery-p256",
            TPM_P256 => "tpm-p256",
            TPM_RSA2048 => "tpm-rsa2048",
            _ => "unknown",
        }
    }
}

/// Something the session key can be wrapped to.
pub trait Recipient: Send + Sync {
    /// Wraps `key` into a stanza addressed to this recipient.
    fn wrap(&self, key: &SessionKey, rng: &mut dyn CryptoRngCore) -> Result<Stanza>;

    /// The stanza kind this recipient writes.
    fn kind(&self) -> u8;

    /// SHA-256 of the recipient's SubjectPublicKeyInfo, first 16 bytes.
    fn fingerprint(&self) -> [u8; FINGERPRINT_LEN];
}

/// Something that can unwrap session keys.
pub trait Identity: Send + Sync {
    /// Unwraps `stanza` if it is addressed to this identity; `Ok(None)` if it
    /// is not. An error means the stanza is ours but could not be opened
    /// (tampered, or the TPM refused).
    fn unwrap(&self, stanza: &Stanza) -> Result<Option<SessionKey>>;
}

/// Fingerprint of a DER-encoded SubjectPublicKeyInfo.
pub fn fingerprint_spki(spki_der: &[u8]) -> [u8; FINGERPRINT_LEN] {
    let digest = Sha256::digest(spki_der);
    let mut fp = [0u8; FINGERPRINT_LEN];
    fp.copy_from_slice(&digest[..FINGERPRINT_LEN]);
    fp
}

/// Parses a PEM SubjectPublicKeyInfo as a TPM key recipient: RSA keys become
/// [`rsa::RsaRecipient`], P-256 keys [`p256::P256Recipient`] of kind
/// [`kind::TPM_P256`].
pub fn tpm_recipient_from_pem(pem: &[u8]) -> Result<Box<dyn Recipient>> {
    use crate::error::Error;
    let pkey = openssl::pkey::PKey::public_key_from_pem(pem)
        .map_err(|_| Error::InvalidRecipient("not a PEM public key".into()))?;
    let der = pkey
        .public_key_to_der()
        .map_err(|e| Error::InvalidRecipient(e.to_string()))?;
    match pkey.id() {
        openssl::pkey::Id::RSA => Ok(Box::new(rsa::RsaRecipient::from_spki_der(&der)?)),
        openssl::pkey::Id::EC => Ok(Box::new(p256::P256Recipient::from_spki_der(
            kind::TPM_P256,
            &der,
        )?)),
        _ => Err(Error::InvalidRecipient(
            "only RSA and EC P-256 public keys are supported".into(),
        )),
    }
}
