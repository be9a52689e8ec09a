//! The software recovery key: a P-256 key pair kept offline, so that files
//! encrypted to a TPM key can still be opened if the TPM dies.
//!
//! Recipient string: `tpmcrypt-recovery:` followed by the compressed SEC1
//! public point in unpadded base64url. Identity file: comment lines (`#`)
//! and a PKCS#8 `PRIVATE KEY` PEM block, written 0600 by the CLI.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use p256::elliptic_curve::sec1::ToEncodedPoint;
use p256::elliptic_curve::ALGORITHM_OID;
use p256::pkcs8::der::pem::PemLabel;
use p256::pkcs8::der::{Decode, SecretDocument};
use p256::pkcs8::{AssociatedOid, EncodePrivateKey, LineEnding, PrivateKeyInfo};
use p256::{EncodedPoint, NistP256, SecretKey};
use rand_core::CryptoRngCore;
use sec1::EcPrivateKey;
use zeroize::Zeroizing;

use crate::error::{Error, Result};
use crate::recipient::kind;
use crate::recipient::p256::{EcdhP256, P256Identity, P256Recipient, POINT_LEN};

/// Prefix of a recovery recipient string.
pub const RECIPIENT_PREFIX: &str = "tpmcrypt-recovery:";

/// A recovery private key.
pub struct RecoveryKey {
    secret: SecretKey,
    /// Its public point, uncompressed: computed once (a scalar
    /// multiplication), not at every use.
    public: [u8; POINT_LEN],
    /// The same scalar as AWS-LC's key, when AWS-LC is built in: its
    /// P-256 (assembly, a precomputed table for the public point) takes
    /// about a fifth of the time of the portable arithmetic for the two
    /// scalar multiplications a decryption with this key makes, which a
    /// one-process-per-file script pays at every file.
    #[cfg(feature = "aws-lc")]
    lc: Option<aws_lc_rs::agreement::PrivateKey>,
}

impl RecoveryKey {
    /// Generates a new recovery key.
    pub fn generate(rng: &mut dyn CryptoRngCore) -> Self {
        let mut rng = rng;
        RecoveryKey::from_secret(SecretKey::random(&mut rng))
    }

    /// A key from its raw 32-byte big-endian scalar (known-answer tests).
    #[doc(hidden)]
    pub fn from_scalar_bytes(bytes: &[u8; 32]) -> Result<Self> {
        let secret = SecretKey::from_bytes(bytes.into())
            .map_err(|_| Error::InvalidIdentity("scalar out of range".into()))?;
        Ok(RecoveryKey::from_secret(secret))
    }

    fn from_secret(secret: SecretKey) -> Self {
        #[cfg(feature = "aws-lc")]
        if let Some((lc, public)) = crate::recipient::p256::aws_lc_key(&secret) {
            return RecoveryKey {
                secret,
                public,
                lc: Some(lc),
            };
        }
        let mut public = [0u8; POINT_LEN];
        public.copy_from_slice(secret.public_key().to_encoded_point(false).as_bytes());
        RecoveryKey {
            secret,
            public,
            #[cfg(feature = "aws-lc")]
            lc: None,
        }
    }

    /// Parses an identity file (comments and a PKCS#8 PEM block).
    pub fn parse(text: &str) -> Result<Self> {
        let begin = text.find("-----BEGIN PRIVATE KEY-----").ok_or_else(|| {
            Error::InvalidIdentity("no PRIVATE KEY block (not a tpmcrypt recovery identity)".into())
        })?;
        let not_p256 = || Error::InvalidIdentity("the PRIVATE KEY block is not a P-256 key".into());
        // The block ends at its END line; only comments and blank lines
        // may follow it, as they may come before it.
        const END: &str = "-----END PRIVATE KEY-----";
        let block_end = text[begin..]
            .find(END)
            .map(|i| begin + i + END.len())
            .ok_or_else(|| {
                Error::InvalidIdentity("the PRIVATE KEY block has no END line".into())
            })?;
        // The rest of the END line, then whole lines.
        let only_comments = text[block_end..].lines().enumerate().all(|(i, l)| {
            let l = l.trim();
            l.is_empty() || (i > 0 && l.starts_with('#'))
        });
        if !only_comments {
            return Err(Error::InvalidIdentity(
                "text after the PRIVATE KEY block (only # comment lines may follow it)".into(),
            ));
        }
        let (secret, embedded) =
            decode_pkcs8_pem(&text[begin..block_end]).map_err(|e| match e {
                Pkcs8Error::Pem => Error::InvalidIdentity(
                    "the PRIVATE KEY block is not valid PEM (base64 in lines of one width, \
                     no blank line inside)"
                        .into(),
                ),
                Pkcs8Error::Key => not_p256(),
            })?;
        let key = RecoveryKey::from_secret(secret);
        // The check `SecretKey::from_pkcs8_pem` makes (an embedded public
        // key must be the scalar's), against the point computed once above
        // rather than by a second scalar multiplication.
        if let Some(embedded) = embedded {
            let ours = EncodedPoint::from_bytes(key.public).map_err(|_| not_p256())?;
            let ours = match embedded.is_compressed() {
                true => ours.compress(),
                false => ours,
            };
            if ours != embedded {
                return Err(not_p256());
            }
        }
        Ok(key)
    }

    /// The identity file contents (secret: the caller writes it 0600).
    pub fn to_file_contents(&self, comment: &str) -> Result<Zeroizing<String>> {
        let pem = self
            .secret
            .to_pkcs8_pem(LineEnding::LF)
            .map_err(|e| Error::Backend(e.to_string()))?;
        let mut out = String::new();
        for line in comment.lines() {
            out.push_str("# ");
            out.push_str(line);
            out.push('\n');
        }
        out.push_str(&format!("# recipient: {}\n", self.recipient_string()));
        out.push_str(&pem);
        Ok(Zeroizing::new(out))
    }

    /// The public recipient string.
    pub fn recipient_string(&self) -> String {
        let point = self.secret.public_key().to_encoded_point(true);
        format!(
            "{RECIPIENT_PREFIX}{}",
            URL_SAFE_NO_PAD.encode(point.as_bytes())
        )
    }

    /// The matching recipient.
    pub fn recipient(&self) -> Result<P256Recipient> {
        P256Recipient::from_sec1(kind::RECOVERY_P256, &self.public)
    }

    /// This key as an identity.
    pub fn into_identity(self) -> Result<P256Identity<RecoveryKey>> {
        P256Identity::new(kind::RECOVERY_P256, self)
    }
}

impl EcdhP256 for RecoveryKey {
    fn public_point(&self) -> [u8; POINT_LEN] {
        self.public
    }

    fn ecdh(&self, peer: &[u8; POINT_LEN]) -> Result<Zeroizing<[u8; 32]>> {
        #[cfg(feature = "aws-lc")]
        if let Some(lc) = &self.lc {
            return crate::recipient::p256::aws_lc_ecdh(lc, peer);
        }
        let peer = p256::PublicKey::from_sec1_bytes(peer)
            .map_err(|_| Error::Unwrap("invalid P-256 point".into()))?;
        let shared = p256::ecdh::diffie_hellman(self.secret.to_nonzero_scalar(), peer.as_affine());
        let mut z = Zeroizing::new([0u8; 32]);
        z.copy_from_slice(shared.raw_secret_bytes());
        Ok(z)
    }

    fn in_memory(&self) -> bool {
        true
    }
}

/// A PKCS#8 PEM `PRIVATE KEY` of P-256 (id-ecPublicKey, prime256v1) as its
/// scalar and the public key embedded in it, if any: what
/// `SecretKey::from_pkcs8_pem` decodes, without its own scalar
/// multiplication to check the embedded key (the caller checks it).
fn decode_pkcs8_pem(
    pem: &str,
) -> std::result::Result<(SecretKey, Option<EncodedPoint>), Pkcs8Error> {
    let (label, doc) = SecretDocument::from_pem(pem).map_err(|_| Pkcs8Error::Pem)?;
    PrivateKeyInfo::validate_pem_label(label).map_err(|_| Pkcs8Error::Pem)?;
    fn key<E>(_: E) -> Pkcs8Error {
        Pkcs8Error::Key
    }
    let info = PrivateKeyInfo::try_from(doc.as_bytes()).map_err(key)?;
    info.algorithm
        .assert_oids(ALGORITHM_OID, NistP256::OID)
        .map_err(key)?;
    let ec = EcPrivateKey::from_der(info.private_key).map_err(key)?;
    let secret = SecretKey::from_slice(ec.private_key).map_err(key)?;
    let embedded = match ec.public_key {
        Some(bytes) => Some(EncodedPoint::from_bytes(bytes).map_err(key)?),
        None => None,
    };
    Ok((secret, embedded))
}

/// Why [`decode_pkcs8_pem`] refused a block.
enum Pkcs8Error {
    /// Not a well-formed PEM block.
    Pem,
    /// Well-formed, but not a P-256 PKCS#8 key.
    Key,
}

/// Parses a recovery recipient string.
pub fn parse_recipient(s: &str) -> Result<P256Recipient> {
    let encoded = s.strip_prefix(RECIPIENT_PREFIX).ok_or_else(|| {
        Error::InvalidRecipient(format!(
            "expected a string starting with {RECIPIENT_PREFIX}"
        ))
    })?;
    let point = URL_SAFE_NO_PAD
        .decode(encoded.trim())
        .map_err(|_| Error::InvalidRecipient("recovery recipient is not valid base64url".into()))?;
    if point.len() != 33 {
        return Err(Error::InvalidRecipient(
            "recovery recipient has the wrong length".into(),
        ));
    }
    // A compressed SEC1 point and nothing else: p256 would also read a
    // "compact" point (tag 5, x alone), which names the key or its
    // negation.
    if !matches!(point[0], 2 | 3) {
        return Err(Error::InvalidRecipient(
            "recovery recipient is not a compressed P-256 point".into(),
        ));
    }
    P256Recipient::from_sec1(kind::RECOVERY_P256, &point)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recipient::{Identity, Recipient};
    use crate::secret::SessionKey;
    use p256::pkcs8::{DecodePrivateKey, ObjectIdentifier};

    /// AWS-LC's P-256 and the portable one give the same public point and
    /// the same Z for the same keys, and both refuse a point off the curve.
    #[cfg(feature = "aws-lc")]
    #[test]
    fn aws_lc_and_portable_p256_agree() {
        use rand_core::RngCore as _;
        let mut rng = rand_core::OsRng;
        for _ in 0..32 {
            let key = RecoveryKey::generate(&mut rng);
            assert!(key.lc.is_some(), "AWS-LC refused a valid scalar");
            let portable = key.secret.public_key().to_encoded_point(false);
            assert_eq!(&key.public[..], portable.as_bytes());
            let peer = RecoveryKey::generate(&mut rng);
            let z = key.ecdh(&peer.public).unwrap();
            let reference = p256::ecdh::diffie_hellman(
                key.secret.to_nonzero_scalar(),
                peer.secret.public_key().as_affine(),
            );
            assert_eq!(&z[..], &reference.raw_secret_bytes()[..]);
            let mut off_curve = peer.public;
            off_curve[40] ^= 1;
            assert!(key.ecdh(&off_curve).is_err());
            let mut junk = [0u8; POINT_LEN];
            rng.fill_bytes(&mut junk);
            assert!(key.ecdh(&junk).is_err());
        }
    }

    #[test]
    fn identity_file_round_trip_and_wrap() {
        let mut rng = rand_core::OsRng;
        let key = RecoveryKey::generate(&mut rng);
        let text = key.to_file_contents("created by a test").unwrap();
        let recipient_str = key.recipient_string();
        assert!(text.contains(&recipient_str));
        let parsed = RecoveryKey::parse(&text).unwrap();
        assert_eq!(parsed.recipient_string(), recipient_str);

        let recipient = parse_recipient(&recipient_str).unwrap();
        let session = SessionKey::generate(&mut rng);
        let stanza = recipient.wrap(&session, &mut rng).unwrap();
        let identity = parsed.into_identity().unwrap();
        let got = identity.unwrap(&stanza).unwrap().expect("addressed to us");
        assert_eq!(got.expose(), session.expose());

        // Any flipped bit of the stanza body is detected or misaddressed.
        for i in 0..stanza.body.len() {
            let mut bad = stanza.clone();
            bad.body[i] ^= 0x01;
            match identity.unwrap(&bad) {
                Ok(None) | Err(_) => {}
                Ok(Some(_)) => panic!("flipped byte {i} still unwrapped"),
            }
        }
    }

    #[test]
    fn other_identity_is_not_addressed() {
        let mut rng = rand_core::OsRng;
        let a = RecoveryKey::generate(&mut rng);
        let b = RecoveryKey::generate(&mut rng);
        let stanza = a
            .recipient()
            .unwrap()
            .wrap(&SessionKey::generate(&mut rng), &mut rng)
            .unwrap();
        assert!(b
            .into_identity()
            .unwrap()
            .unwrap(&stanza)
            .unwrap()
            .is_none());
    }

    #[test]
    fn a_stanza_of_the_tpm_kind_to_the_same_key_opens() {
        // What `-R` makes of the recovery key's PEM public key.
        let mut rng = rand_core::OsRng;
        let key = RecoveryKey::generate(&mut rng);
        let as_pem = P256Recipient::new(kind::TPM_P256, key.secret.public_key()).unwrap();
        let session = SessionKey::generate(&mut rng);
        let stanza = as_pem.wrap(&session, &mut rng).unwrap();
        assert_eq!(stanza.kind, kind::TPM_P256);
        let identity = key.into_identity().unwrap();
        let got = identity.unwrap(&stanza).unwrap().expect("addressed to us");
        assert_eq!(got.expose(), session.expose());
        // The kind is bound into the wrap key: relabelled, it fails.
        let mut relabelled = stanza.clone();
        relabelled.kind = kind::RECOVERY_P256;
        assert!(identity.unwrap(&relabelled).is_err());
    }

    /// A PKCS#8 P-256 key whose inner ECPrivateKey carries `public`.
    fn pkcs8_pem(scalar: &[u8], public: Option<&[u8]>, curve: ObjectIdentifier) -> String {
        use p256::pkcs8::der::asn1::OctetStringRef;
        use p256::pkcs8::der::{Encode, EncodePem};
        use p256::pkcs8::AlgorithmIdentifierRef;
        let ec = EcPrivateKey {
            private_key: scalar,
            parameters: None,
            public_key: public,
        };
        let inner = ec.to_der().unwrap();
        let info = PrivateKeyInfo::new(
            AlgorithmIdentifierRef {
                oid: ALGORITHM_OID,
                parameters: Some((&curve).into()),
            },
            OctetStringRef::new(&inner).unwrap().as_bytes(),
        );
        format!("# a comment\n{}", info.to_pem(LineEnding::LF).unwrap())
    }

    /// The identity parser accepts exactly the PKCS#8 keys p256's own
    /// parser accepts (which checks an embedded public key against the
    /// scalar), and yields the same key.
    #[test]
    fn identity_parsing_agrees_with_p256s_pkcs8_parser() {
        let mut rng = rand_core::OsRng;
        let (a, b) = (
            RecoveryKey::generate(&mut rng),
            RecoveryKey::generate(&mut rng),
        );
        let scalar = a.secret.to_bytes();
        let compress = |k: &RecoveryKey| EncodedPoint::from_bytes(k.public).unwrap().compress();
        let (ca, cb) = (compress(&a), compress(&b));
        let p384 = ObjectIdentifier::new_unwrap("1.3.132.0.34");
        let cases = [
            a.to_file_contents("ours").unwrap().to_string(),
            pkcs8_pem(&scalar, Some(&a.public), NistP256::OID),
            pkcs8_pem(&scalar, Some(ca.as_bytes()), NistP256::OID),
            pkcs8_pem(&scalar, None, NistP256::OID),
            pkcs8_pem(&scalar[1..], None, NistP256::OID),
            pkcs8_pem(&scalar, Some(&b.public), NistP256::OID),
            pkcs8_pem(&scalar, Some(cb.as_bytes()), NistP256::OID),
            pkcs8_pem(&scalar, Some(&a.public[..33]), NistP256::OID),
            pkcs8_pem(&scalar, Some(&[4u8; 65]), NistP256::OID),
            pkcs8_pem(&scalar, Some(&a.public), p384),
            pkcs8_pem(&[0u8; 32], None, NistP256::OID),
            pkcs8_pem(&[0xffu8; 32], None, NistP256::OID),
            a.to_file_contents("label")
                .unwrap()
                .replace("PRIVATE KEY-----", "EC PRIVATE KEY-----"),
        ];
        let mut accepted = 0;
        for (i, text) in cases.iter().enumerate() {
            let begin = text.find("-----BEGIN").unwrap();
            let reference = SecretKey::from_pkcs8_pem(text[begin..].trim_end());
            match (RecoveryKey::parse(text), reference) {
                (Ok(ours), Ok(theirs)) => {
                    accepted += 1;
                    assert_eq!(ours.secret.to_bytes(), theirs.to_bytes(), "case {i}");
                    let public = theirs.public_key().to_encoded_point(false);
                    assert_eq!(&ours.public[..], public.as_bytes(), "case {i}");
                }
                (Err(e), Err(_)) => assert!(
                    e.to_string().contains("P-256") || e.to_string().contains("PRIVATE KEY"),
                    "case {i}: {e}"
                ),
                (ours, theirs) => panic!(
                    "case {i}: ours {:?}, p256's {:?}",
                    ours.is_ok(),
                    theirs.is_ok()
                ),
            }
        }
        assert_eq!(accepted, 5);
    }

    #[test]
    fn bad_recipient_strings() {
        for s in [
            "",
            "tpmcrypt-recovery:",
            "tpmcrypt-recovery:!!!",
            "age1xyz",
            "tpmcrypt-recovery:AAAA",
        ] {
            assert!(parse_recipient(s).is_err(), "{s}");
        }
    }

    /// Comment lines and blank lines may follow the PEM block as they may
    /// precede it (the build before refused a note added after it as "not
    /// a P-256 key"); other text there is named as such, and so is a block
    /// that is not well-formed PEM.
    #[test]
    fn comments_may_follow_the_block_and_other_faults_are_named() {
        let key = RecoveryKey::generate(&mut rand_core::OsRng);
        let text = key.to_file_contents("a note").unwrap().to_string();
        for tail in [
            "",
            "\n",
            "\n\n",
            "# copied to USB 2\n",
            "\n  # indented\n\n",
        ] {
            let parsed = RecoveryKey::parse(&format!("{text}{tail}"))
                .unwrap_or_else(|e| panic!("{tail:?}: {e}"));
            assert_eq!(parsed.public, key.public);
        }
        for (bad, says) in [
            (
                format!("{text}copied to USB 2\n"),
                "text after the PRIVATE KEY block",
            ),
            (format!("{text}{text}"), "text after the PRIVATE KEY block"),
            (
                text.trim_end().to_string() + "trailing",
                "text after the PRIVATE KEY block",
            ),
            (
                text.replacen("\n", "\n\n", text.lines().count() - 2),
                "not valid PEM",
            ),
            (text.replace("-----END PRIVATE KEY-----", ""), "no END line"),
        ] {
            let e = RecoveryKey::parse(&bad).err().expect("refused").to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    /// A recipient string holds a compressed SEC1 point (tag 2 or 3 and
    /// x). Any other tag before the same x is refused: p256 also reads
    /// tag 5 ("compact", x alone) as a point, which for about half of all
    /// keys is the negated one, so a file encrypted to it would not open
    /// with the recovery key.
    #[test]
    fn a_recipient_string_must_hold_a_compressed_sec1_point() {
        let key = RecoveryKey::generate(&mut rand_core::OsRng);
        let good = key.recipient_string();
        let point = URL_SAFE_NO_PAD
            .decode(good.strip_prefix(RECIPIENT_PREFIX).unwrap())
            .unwrap();
        assert!(matches!(point[0], 2 | 3));
        assert!(parse_recipient(&good).is_ok());
        for tag in [0u8, 1, 4, 5, 6, 7, 0x82, 0xff] {
            let mut bad = point.clone();
            bad[0] = tag;
            let s = format!("{RECIPIENT_PREFIX}{}", URL_SAFE_NO_PAD.encode(&bad));
            assert!(parse_recipient(&s).is_err(), "tag {tag} accepted");
        }
    }
}
