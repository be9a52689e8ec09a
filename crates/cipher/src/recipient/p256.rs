//! P-256 ECIES key wrapping, used by the recovery key and by TPM P-256 keys.
//!
//! ```text
//! e, E   = fresh ephemeral key pair;  R = recipient public key
//! Z      = x-coordinate of e·R   (TPM2_ECDH_ZGen computes d·E on the TPM side)
//! K_wrap = HKDF-SHA256(ikm = Z, salt = E ‖ R (uncompressed SEC1), info = "tpmcrypt/v1/p256-wrap" ‖ kind, 32)
//! body   = fingerprint(R) ‖ E ‖ AES-256-GCM(K_wrap, nonce = 0^12, aad = fingerprint(R), session key)
//! ```
//! K_wrap is used exactly once, so the fixed nonce is safe.

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::Aes256Gcm;
use p256::ecdh::EphemeralSecret;
use p256::elliptic_curve::sec1::ToEncodedPoint;
use p256::pkcs8::{DecodePublicKey, EncodePublicKey};
use p256::PublicKey;
use rand_core::CryptoRngCore;
use zeroize::Zeroizing;

use super::{fingerprint_spki, Identity, Recipient};
use crate::error::{Error, Result};
use crate::format::{Stanza, FINGERPRINT_LEN};
use crate::secret::{SessionKey, SESSION_KEY_LEN};

/// Length of an uncompressed SEC1 P-256 point.
pub const POINT_LEN: usize = 65;
const WRAPPED_LEN: usize = SESSION_KEY_LEN + 16;
/// Length of a P-256 stanza body.
pub const BODY_LEN: usize = FINGERPRINT_LEN + POINT_LEN + WRAPPED_LEN;
const INFO: &[u8] = b"tpmcrypt/v1/p256-wrap";

/// The one private-key operation a P-256 identity needs.
pub trait EcdhP256: Send + Sync {
    /// The identity's public key, uncompressed SEC1.
    fn public_point(&self) -> [u8; POINT_LEN];

    /// Z = x-coordinate of (private key · `peer`), `peer` uncompressed SEC1.
    fn ecdh(&self, peer: &[u8; POINT_LEN]) -> Result<Zeroizing<[u8; 32]>>;

    /// Whether the private key is in this process's memory (see
    /// [`Identity::in_memory`]); `false` by default.
    fn in_memory(&self) -> bool {
        false
    }
}

/// A P-256 public key as a recipient of a given stanza kind.
#[derive(Clone, Debug)]
pub struct P256Recipient {
    kind: u8,
    public: PublicKey,
    fingerprint: [u8; FINGERPRINT_LEN],
}

impl P256Recipient {
    /// From a public key.
    pub fn new(kind: u8, public: PublicKey) -> Result<Self> {
        let der = public
            .to_public_key_der()
            .map_err(|e| Error::InvalidRecipient(e.to_string()))?;
        Ok(P256Recipient {
            kind,
            public,
            fingerprint: fingerprint_spki(der.as_bytes()),
        })
    }

    /// From a DER SubjectPublicKeyInfo (must be a P-256 key).
    pub fn from_spki_der(kind: u8, der: &[u8]) -> Result<Self> {
        let public = PublicKey::from_public_key_der(der)
            .map_err(|_| Error::InvalidRecipient("not a P-256 public key".into()))?;
        Self::new(kind, public)
    }

    /// From an uncompressed or compressed SEC1 point.
    pub fn from_sec1(kind: u8, point: &[u8]) -> Result<Self> {
        let public = PublicKey::from_sec1_bytes(point)
            .map_err(|_| Error::InvalidRecipient("not a valid P-256 point".into()))?;
        Self::new(kind, public)
    }

    /// The public key.
    pub fn public_key(&self) -> &PublicKey {
        &self.public
    }
}

fn uncompressed(public: &PublicKey) -> Result<[u8; POINT_LEN]> {
    let encoded = public.to_encoded_point(false);
    encoded
        .as_bytes()
        .try_into()
        .map_err(|_| Error::Backend("unexpected SEC1 encoding length".into()))
}

/// An ephemeral ECDH with `peer` (uncompressed SEC1) by AWS-LC: the
/// ephemeral public point and Z. The scalar is drawn here from the
/// operating system (`SecretKey::random`, wiped when dropped), not by
/// AWS-LC's own generator, whose first use in a process seeds itself from
/// CPU jitter for about 23 ms (`perf`: `jent_*`).
#[cfg(feature = "aws-lc")]
fn os_rng_ecdh(peer: &[u8; POINT_LEN]) -> Result<([u8; POINT_LEN], Zeroizing<[u8; 32]>)> {
    let secret = p256::SecretKey::random(&mut rand_core::OsRng);
    let (key, e_point) =
        aws_lc_key(&secret).ok_or_else(|| Error::Backend("AWS-LC P-256: ephemeral key".into()))?;
    Ok((e_point, aws_lc_ecdh(&key, peer)?))
}

/// `secret` as AWS-LC's key and its public point, uncompressed; `None` if
/// AWS-LC refuses it (it does not for a scalar `SecretKey` holds). AWS-LC
/// wipes the key when it frees it.
#[cfg(feature = "aws-lc")]
pub(crate) fn aws_lc_key(
    secret: &p256::SecretKey,
) -> Option<(aws_lc_rs::agreement::PrivateKey, [u8; POINT_LEN])> {
    use aws_lc_rs::agreement::{PrivateKey, ECDH_P256};
    use zeroize::Zeroize as _;
    let mut scalar = secret.to_bytes();
    let key = PrivateKey::from_private_key(&ECDH_P256, &scalar);
    scalar.as_mut_slice().zeroize();
    let key = key.ok()?;
    let public = point_of(key.compute_public_key().ok()?.as_ref()).ok()?;
    Some((key, public))
}

/// Z = x-coordinate of (`key` · `peer`), by AWS-LC, which refuses a point
/// off the curve (Wycheproof's invalid-curve vectors,
/// `tests/wycheproof.rs`).
#[cfg(feature = "aws-lc")]
pub(crate) fn aws_lc_ecdh(
    key: &aws_lc_rs::agreement::PrivateKey,
    peer: &[u8; POINT_LEN],
) -> Result<Zeroizing<[u8; 32]>> {
    use aws_lc_rs::agreement::{agree, UnparsedPublicKey, ECDH_P256};
    let invalid = || Error::Unwrap("invalid P-256 point".into());
    agree(
        key,
        UnparsedPublicKey::new(&ECDH_P256, peer),
        invalid(),
        |z| {
            let mut out = Zeroizing::new([0u8; 32]);
            if z.len() != out.len() {
                return Err(invalid());
            }
            out.copy_from_slice(z);
            Ok(out)
        },
    )
}

/// The same by ring (which does not wipe the ephemeral scalar).
#[cfg(all(feature = "ring", not(feature = "aws-lc")))]
fn os_rng_ecdh(peer: &[u8; POINT_LEN]) -> Result<([u8; POINT_LEN], Zeroizing<[u8; 32]>)> {
    use ring::agreement::{agree_ephemeral, EphemeralPrivateKey, UnparsedPublicKey, ECDH_P256};
    let failed = |what: &str| Error::Backend(format!("ring P-256: {what}"));
    let ephemeral = EphemeralPrivateKey::generate(&ECDH_P256, &ring::rand::SystemRandom::new())
        .map_err(|_| failed("ephemeral key"))?;
    let e_point = point_of(
        ephemeral
            .compute_public_key()
            .map_err(|_| failed("public point"))?
            .as_ref(),
    )?;
    let mut z = Zeroizing::new([0u8; 32]);
    agree_ephemeral(
        ephemeral,
        &UnparsedPublicKey::new(&ECDH_P256, peer),
        |shared| z.copy_from_slice(shared),
    )
    .map_err(|_| failed("ECDH"))?;
    Ok((e_point, z))
}

/// An uncompressed SEC1 point from a library's bytes.
#[cfg(any(feature = "aws-lc", feature = "ring"))]
fn point_of(bytes: &[u8]) -> Result<[u8; POINT_LEN]> {
    bytes
        .try_into()
        .map_err(|_| Error::Backend("P-256 public point of the wrong length".into()))
}

fn wrap_cipher(kind: u8, z: &[u8; 32], ephemeral: &[u8], recipient: &[u8]) -> Result<Aes256Gcm> {
    let mut salt = Vec::with_capacity(POINT_LEN * 2);
    salt.extend_from_slice(ephemeral);
    salt.extend_from_slice(recipient);
    let mut info = INFO.to_vec();
    info.push(kind);
    let mut key = Zeroizing::new([0u8; 32]);
    hkdf::Hkdf::<sha2::Sha256>::new(Some(&salt), z)
        .expand(&info, &mut key[..])
        .map_err(|_| Error::Backend("hkdf".into()))?;
    Aes256Gcm::new_from_slice(&key[..]).map_err(|_| Error::Backend("aes-gcm key".into()))
}

impl Recipient for P256Recipient {
    fn wrap(&self, key: &SessionKey, mut rng: &mut dyn CryptoRngCore) -> Result<Stanza> {
        let ephemeral = EphemeralSecret::random(&mut rng);
        let e_point = uncompressed(&ephemeral.public_key())?;
        let shared = ephemeral.diffie_hellman(&self.public);
        let mut z = Zeroizing::new([0u8; 32]);
        z.copy_from_slice(shared.raw_secret_bytes());
        self.seal(key, &z, &e_point)
    }

    /// The same stanza, the ephemeral key and Z from AWS-LC, else ring
    /// (each draws the ephemeral key from the operating system's RNG
    /// itself). AWS-LC first: it wipes the ephemeral scalar and Z when it
    /// frees them, and ring does not (either one gives the session key).
    #[cfg(any(feature = "aws-lc", feature = "ring"))]
    fn wrap_with_os_rng(&self, key: &SessionKey) -> Result<Stanza> {
        let (e_point, z) = os_rng_ecdh(&uncompressed(&self.public)?)?;
        self.seal(key, &z, &e_point)
    }

    fn kind(&self) -> u8 {
        self.kind
    }

    fn fingerprint(&self) -> [u8; FINGERPRINT_LEN] {
        self.fingerprint
    }
}

impl P256Recipient {
    /// The stanza: `key` sealed under the key derived from Z.
    fn seal(&self, key: &SessionKey, z: &[u8; 32], e_point: &[u8; POINT_LEN]) -> Result<Stanza> {
        let cipher = wrap_cipher(self.kind, z, e_point, &uncompressed(&self.public)?)?;
        let wrapped = cipher
            .encrypt(
                &[0u8; 12].into(),
                Payload {
                    msg: key.expose(),
                    aad: &self.fingerprint,
                },
            )
            .map_err(|_| Error::Backend("aes-gcm wrap".into()))?;
        let mut body = Vec::with_capacity(BODY_LEN);
        body.extend_from_slice(&self.fingerprint);
        body.extend_from_slice(e_point);
        body.extend_from_slice(&wrapped);
        Ok(Stanza {
            kind: self.kind,
            body,
        })
    }
}

/// A P-256 identity: the ECIES unwrap around any [`EcdhP256`] (a software
/// key or a TPM key).
pub struct P256Identity<E: EcdhP256> {
    ecdh: E,
    recipient: P256Recipient,
}

impl<E: EcdhP256> P256Identity<E> {
    /// Wraps `ecdh` as an identity whose own recipient writes stanzas of
    /// `kind` (it opens stanzas of both P-256 kinds).
    pub fn new(kind: u8, ecdh: E) -> Result<Self> {
        let recipient = P256Recipient::from_sec1(kind, &ecdh.public_point())?;
        Ok(P256Identity { ecdh, recipient })
    }

    /// The matching recipient (of the kind given to [`P256Identity::new`]).
    pub fn recipient(&self) -> &P256Recipient {
        &self.recipient
    }
}

/// The stanza kinds of this ECIES: the kind names where the private key is
/// expected to be (software or TPM), not a different construction.
fn is_p256_kind(kind: u8) -> bool {
    kind == super::kind::RECOVERY_P256 || kind == super::kind::TPM_P256
}

impl<E: EcdhP256> Identity for P256Identity<E> {
    /// Opens a stanza of either P-256 kind addressed to this key: a file
    /// encrypted to the PEM public key of a recovery key (which parses as a
    /// TPM P-256 recipient) opens with that recovery key, and vice versa.
    fn unwrap(&self, stanza: &Stanza) -> Result<Option<SessionKey>> {
        if !is_p256_kind(stanza.kind)
            || stanza.fingerprint() != Some(&self.recipient.fingerprint[..])
        {
            return Ok(None);
        }
        if stanza.body.len() != BODY_LEN {
            return Err(Error::Unwrap("P-256 stanza of the wrong length".into()));
        }
        let mut e_point = [0u8; POINT_LEN];
        e_point.copy_from_slice(&stanza.body[FINGERPRINT_LEN..FINGERPRINT_LEN + POINT_LEN]);
        PublicKey::from_sec1_bytes(&e_point)
            .map_err(|_| Error::Unwrap("ephemeral key is not a valid P-256 point".into()))?;
        let z = self.ecdh.ecdh(&e_point)?;
        let cipher = wrap_cipher(stanza.kind, &z, &e_point, &self.ecdh.public_point())?;
        let plain = Zeroizing::new(
            cipher
                .decrypt(
                    &[0u8; 12].into(),
                    Payload {
                        msg: &stanza.body[FINGERPRINT_LEN + POINT_LEN..],
                        aad: &self.recipient.fingerprint,
                    },
                )
                .map_err(|_| Error::Unwrap("P-256 stanza failed authentication".into()))?,
        );
        let bytes: &[u8; SESSION_KEY_LEN] = plain[..]
            .try_into()
            .map_err(|_| Error::Unwrap("wrapped key of the wrong length".into()))?;
        Ok(Some(SessionKey::from_bytes(bytes)))
    }

    fn in_memory(&self) -> bool {
        self.ecdh.in_memory()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recovery::RecoveryKey;

    /// A stanza wrapped with the library's own RNG (AWS-LC where built in,
    /// else ring) opens with the key, each with a fresh ephemeral point.
    #[test]
    fn os_rng_wrap_opens_with_a_fresh_ephemeral_each_time() {
        let key = RecoveryKey::generate(&mut rand_core::OsRng);
        let recipient = key.recipient().unwrap();
        let identity = key.into_identity().unwrap();
        let session = SessionKey::generate(&mut rand_core::OsRng);
        let points: Vec<Vec<u8>> = (0..8)
            .map(|_| {
                let stanza = recipient.wrap_with_os_rng(&session).unwrap();
                assert_eq!(stanza.body.len(), BODY_LEN);
                let got = identity
                    .unwrap(&stanza)
                    .unwrap()
                    .expect("addressed to the key");
                assert_eq!(got.expose(), session.expose());
                stanza.body[FINGERPRINT_LEN..FINGERPRINT_LEN + POINT_LEN].to_vec()
            })
            .collect();
        for (i, a) in points.iter().enumerate() {
            assert_eq!(a[0], 0x04, "uncompressed point");
            assert!(
                points[i + 1..].iter().all(|b| b != a),
                "ephemeral point reused"
            );
        }
    }
}
