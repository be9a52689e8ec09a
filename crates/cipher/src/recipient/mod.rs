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

use crate::error::{Error, Result};
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

    /// As [`Recipient::wrap`] with the operating system's RNG, which lets
    /// a recipient use a library that draws its own randomness from it
    /// (P-256: AWS-LC's or ring's ephemeral ECDH, about 4x fewer
    /// instructions than the RustCrypto arithmetic `wrap` uses). [`crate::session::Encryptor::new`]
    /// wraps with this; `Encryptor::with_rng` with [`Recipient::wrap`].
    fn wrap_with_os_rng(&self, key: &SessionKey) -> Result<Stanza> {
        self.wrap(key, &mut rand_core::OsRng)
    }

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

    /// Whether this identity's private key is in this process's memory (a
    /// recovery key, a software key), so that unwrapping costs microseconds
    /// and no device. A decryptor tries such identities before its session
    /// cache and does not offer the cache what they unwrap. `false` (a TPM
    /// key, anything that may be slow or limited) by default.
    fn in_memory(&self) -> bool {
        false
    }
}

/// Fingerprint of a DER-encoded SubjectPublicKeyInfo.
pub fn fingerprint_spki(spki_der: &[u8]) -> [u8; FINGERPRINT_LEN] {
    let digest = Sha256::digest(spki_der);
    let mut fp = [0u8; FINGERPRINT_LEN];
    fp.copy_from_slice(&digest[..FINGERPRINT_LEN]);
    fp
}

/// Parses a PEM SubjectPublicKeyInfo (one `PUBLIC KEY` block) as a TPM key
/// recipient, as [`tpm_recipient_from_spki_der`] does.
pub fn tpm_recipient_from_pem(pem: &[u8]) -> Result<Box<dyn Recipient>> {
    let der = decode_public_key_pem(pem)
        .map_err(|e| Error::InvalidRecipient(format!("not a PEM public key ({e})")))?;
    tpm_recipient_from_spki_der(&der)
}

/// Decodes one PEM block (RFC 7468: boundaries, labels and base64 are
/// checked strictly) that must be a `PUBLIC KEY`. Lines of any width are
/// accepted as long as every line but the last has the width of the first
/// (OpenSSL wraps at 64 columns, other tools at 76, or not at all).
pub(crate) fn decode_public_key_pem(pem: &[u8]) -> Result<Vec<u8>> {
    let bad = |e: pem_rfc7468::Error| Error::InvalidRecipient(format!("bad PEM block ({e})"));
    let width = pem
        .split(|&b| b == b'\n')
        .skip_while(|l| !l.trim_ascii_start().starts_with(b"-----BEGIN "))
        .nth(1)
        .map_or(0, |l| l.trim_ascii_end().len())
        .max(4);
    let mut decoder = pem_rfc7468::Decoder::new_wrapped(pem, width).map_err(bad)?;
    check_pem_label(decoder.type_label())?;
    let mut der = Vec::new();
    decoder.decode_to_end(&mut der).map_err(bad)?;
    Ok(der)
}

/// Refuses a PEM block that is not a `PUBLIC KEY`, saying what it is.
pub(crate) fn check_pem_label(label: &str) -> Result<()> {
    let why = match label {
        "PUBLIC KEY" => return Ok(()),
        "TSS2 PRIVATE KEY" => {
            "a TSS2 PRIVATE KEY block is a TPM key file, not a recipient: give its public key"
                .to_string()
        }
        "RSA PUBLIC KEY" => "an RSA PUBLIC KEY (PKCS#1) block: give the key as a PUBLIC KEY \
                             (SubjectPublicKeyInfo) block"
            .to_string(),
        l if l.contains("PRIVATE KEY") => format!(
            "a {l} block is a private key (an identity), not a recipient: give its public \
             key or recipient string"
        ),
        l => format!("a {l} PEM block is not a public key"),
    };
    Err(Error::InvalidRecipient(why))
}

/// Parses a DER SubjectPublicKeyInfo as a TPM key recipient: RSA keys become
/// [`rsa::RsaRecipient`], P-256 keys [`p256::P256Recipient`] of kind
/// [`kind::TPM_P256`]. Only keys a TPM key can have are accepted (RSA-2048
/// with a TPM-compatible exponent, NIST P-256): a file encrypted to any other
/// key could never be opened by tpmcrypt.
pub fn tpm_recipient_from_spki_der(der: &[u8]) -> Result<Box<dyn Recipient>> {
    use openssl::pkey::Id;
    use spki::der::Decode as _;
    // Strict DER, nothing after it (OpenSSL alone ignores trailing bytes).
    spki::SubjectPublicKeyInfoRef::from_der(der).map_err(|_| {
        Error::InvalidRecipient("not a DER SubjectPublicKeyInfo (public key)".into())
    })?;
    let pkey = openssl::pkey::PKey::public_key_from_der(der)
        .map_err(|_| Error::InvalidRecipient("not a public key OpenSSL can read".into()))?;
    let other = |name: &str| {
        Err(Error::InvalidRecipient(format!(
            "{name} keys cannot be TPM key recipients (only RSA-2048 and NIST P-256)"
        )))
    };
    match pkey.id() {
        Id::RSA => Ok(Box::new(rsa::RsaRecipient::from_spki_der(der)?)),
        Id::EC => {
            check_p256(&pkey)?;
            Ok(Box::new(p256::P256Recipient::from_spki_der(
                kind::TPM_P256,
                der,
            )?))
        }
        Id::RSA_PSS => other("RSA-PSS (signature-only)"),
        Id::ED25519 => other("Ed25519"),
        Id::ED448 => other("Ed448"),
        Id::X25519 => other("X25519"),
        Id::X448 => other("X448"),
        Id::DSA => other("DSA"),
        Id::DH => other("DH"),
        _ => Err(Error::InvalidRecipient(
            "this kind of key cannot be a TPM key recipient (only RSA-2048 and NIST P-256)".into(),
        )),
    }
}

/// Refuses an EC key on any curve but NIST P-256, naming the curve.
fn check_p256(pkey: &openssl::pkey::PKey<openssl::pkey::Public>) -> Result<()> {
    use openssl::nid::Nid;
    // OpenSSL reads the point at infinity (an empty point) as a key, then
    // cannot give it as an EC key.
    let ec = pkey.ec_key().map_err(|_| {
        Error::InvalidRecipient("an EC public key whose point is not a usable P-256 point".into())
    })?;
    match ec.group().curve_name() {
        Some(Nid::X9_62_PRIME256V1) => Ok(()),
        Some(nid) => Err(Error::InvalidRecipient(format!(
            "an EC key on curve {}: only NIST P-256 keys can be TPM key recipients",
            nid.short_name().unwrap_or("unknown")
        ))),
        None => Err(Error::InvalidRecipient(
            "an EC key with explicit curve parameters: only NIST P-256 keys (named curve) can \
             be TPM key recipients"
                .into(),
        )),
    }
}
