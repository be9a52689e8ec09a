//! Key files: [`KeyBlob`] ⇄ the standard `TSS2 PRIVATE KEY` PEM.
//!
//! The format (draft-bottomley-tpm2-keys, used by tpm2-tools'
//! `tpm2_encodeobject`/`tpm2_load -r`, tpm2-openssl, openssl_tpm2_engine and
//! the kernel's trusted keys) is
//!
//! ```text
//! TPMKey ::= SEQUENCE {
//!     type        OBJECT IDENTIFIER,            -- 2.23.133.10.1.3 loadable key
//!     emptyAuth   [0] EXPLICIT BOOLEAN OPTIONAL,
//!     policy      [1] EXPLICIT SEQUENCE OF TPMPolicy OPTIONAL,
//!     secret      [2] EXPLICIT OCTET STRING OPTIONAL,   -- importable keys only
//!     authPolicy  [3] EXPLICIT SEQUENCE OF TPMAuthPolicy OPTIONAL,
//!     description [4] EXPLICIT UTF8String OPTIONAL,
//!     rsaParent   [5] EXPLICIT BOOLEAN OPTIONAL,
//!     parent      INTEGER,                       -- 0x40000001 or 0x81xxxxxx
//!     pubkey      OCTET STRING,                  -- TPM2B_PUBLIC
//!     privkey     OCTET STRING }                 -- TPM2B_PRIVATE
//! TPMPolicy ::= SEQUENCE {
//!     commandCode   [0] EXPLICIT INTEGER,
//!     commandPolicy [1] EXPLICIT OCTET STRING }  -- command parameters
//! ```
//!
//! Using the standard format means keys made here can be inspected and used by
//! stock tools, and keys made by those tools can be imported.  We write the
//! policy the way the kernel and openssl_tpm2_engine do: TPM2_PolicyPCR with
//! `pcrDigest || TPML_PCR_SELECTION`, then TPM2_PolicyAuthValue with empty
//! parameters.

use openssl::bn::BigNum;
use openssl::ec::{EcGroup, EcKey};
use openssl::nid::Nid;
use openssl::pkey::{PKey, Public as PkPublic};
use openssl::rsa::Rsa;
use tss_esapi::interface_types::algorithm::HashingAlgorithm;
use tss_esapi::interface_types::ecc::EccCurve;
use tss_esapi::structures::{EccScheme, HashScheme, Private, Public, PublicBuffer, RsaScheme};
use tss_esapi::traits::{Marshall, UnMarshall};

use crate::asn1::{self, Asn1Error, LaxBool, TpmAuthPolicy, TpmKey, TpmPolicy, PEM_LABEL};
use crate::error::{Error, Result};
use crate::pcr::PcrSelection;
use crate::signed::{self, TPM_CC_POLICY_AUTHORIZE};

/// TPM_CC_PolicyPCR.
pub const TPM_CC_POLICY_PCR: u32 = 0x0000_017F;
/// TPM_CC_PolicyAuthValue.
pub const TPM_CC_POLICY_AUTH_VALUE: u32 = 0x0000_016B;

/// Parent handle meaning "the primary derived from the owner hierarchy with
/// the standard SRK template" (created on the fly, never persisted).
pub const PARENT_OWNER_PRIMARY: u32 = 0x4000_0001;
/// Conventional persistent SRK handle.
pub const PARENT_PERSISTENT_SRK: u32 = 0x8100_0001;

/// Largest TPM2B we accept (TPM2B sizes are u16 anyway).
const MAX_TPM2B: usize = 0xFFFF;

/// The asymmetric algorithm of a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyAlg {
    /// RSA-2048, unbound with TPM2_RSA_Decrypt (OAEP, SHA-256).
    Rsa2048,
    /// NIST P-256, unbound with TPM2_ECDH_ZGen.
    EccP256,
}

impl KeyAlg {
    /// Short name used in metadata and the CLI (`rsa2048`, `ecc-p256`).
    pub fn as_str(self) -> &'static str {
        match self {
            KeyAlg::Rsa2048 => "rsa2048",
            KeyAlg::EccP256 => "ecc-p256",
        }
    }

    /// Parses the names produced by [`KeyAlg::as_str`] (plus a few aliases).
    pub fn parse(s: &str) -> Result<KeyAlg> {
        match s.to_ascii_lowercase().as_str() {
            "rsa2048" | "rsa" | "rsa-2048" => Ok(KeyAlg::Rsa2048),
            "ecc-p256" | "ecc" | "p256" | "ecc256" | "eccp256" | "p-256" => Ok(KeyAlg::EccP256),
            other => Err(Error::InvalidInput(format!(
                "unknown key algorithm '{other}' (rsa2048 or ecc-p256)"
            ))),
        }
    }
}

impl std::fmt::Display for KeyAlg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One policy command as stored in the key file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyCommand {
    /// TPM_CC of the policy command.
    pub command_code: u32,
    /// The command's parameters (without the session handle), marshalled.
    pub command_policy: Vec<u8>,
}

/// One `TPMAuthPolicy` of the key file's `authPolicy [3]`: a signed policy
/// (see [`crate::signed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthPolicy {
    /// Its name (`[0]`); tpmcrypt records the PCR values here.
    pub name: Option<String>,
    /// Its policy commands (PolicyPCR, then PolicyAuthorize).
    pub policy: Vec<PolicyCommand>,
}

/// A TPM-wrapped key as stored in a key file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyBlob {
    /// Parent handle ([`PARENT_OWNER_PRIMARY`] or a persistent handle).
    pub parent: u32,
    /// True when the key has no authValue (no PIN).
    pub empty_auth: bool,
    /// Policy commands to replay for keys with an authPolicy.
    pub policy: Vec<PolicyCommand>,
    /// Signed policies (`[3]`) for a key whose policy is PolicyAuthorize.
    pub auth_policies: Vec<AuthPolicy>,
    /// Free-text description (`[4]`), if any.
    pub description: Option<String>,
    /// The owner-hierarchy parent is an RSA primary rather than ECC (`[5]`).
    pub rsa_parent: bool,
    /// Marshalled TPM2B_PUBLIC.
    pub public: Vec<u8>,
    /// Marshalled TPM2B_PRIVATE.
    pub private: Vec<u8>,
}

fn kf<T>(m: impl Into<String>) -> Result<T> {
    Err(Error::KeyFile(m.into()))
}

impl From<Asn1Error> for Error {
    fn from(e: Asn1Error) -> Self {
        Error::KeyFile(e.0)
    }
}

/// Parses a marshalled TPM2B_PUBLIC, requiring it to span exactly `data`.
pub(crate) fn parse_tpm2b_public(data: &[u8]) -> Result<Public> {
    let size = match data {
        [a, b, ..] => usize::from(u16::from_be_bytes([*a, *b])),
        _ => return kf("TPM2B_PUBLIC truncated"),
    };
    if size + 2 != data.len() || size == 0 {
        return kf("TPM2B_PUBLIC size does not match its contents");
    }
    let buf =
        PublicBuffer::unmarshall(data).map_err(|e| Error::KeyFile(format!("TPM2B_PUBLIC: {e}")))?;
    let public = Public::try_from(buf).map_err(|e| Error::KeyFile(format!("TPM2B_PUBLIC: {e}")))?;
    Ok(public)
}

/// Marshals a TPM2B_PUBLIC.
pub(crate) fn marshal_tpm2b_public(public: &Public) -> Result<Vec<u8>> {
    let buf = PublicBuffer::try_from(public.clone()).map_err(|e| Error::Tpm {
        op: "marshal public",
        detail: e.to_string(),
    })?;
    buf.marshall().map_err(|e| Error::Tpm {
        op: "marshal public",
        detail: e.to_string(),
    })
}

/// Wraps raw private bytes as a TPM2B_PRIVATE.
pub(crate) fn marshal_tpm2b(data: &[u8]) -> Result<Vec<u8>> {
    let len = u16::try_from(data.len()).map_err(|_| Error::KeyFile("TPM2B too large".into()))?;
    let mut out = Vec::with_capacity(data.len() + 2);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(data);
    Ok(out)
}

/// Returns the payload of a TPM2B, requiring the size to match exactly.
fn tpm2b_payload(data: &[u8], what: &str) -> Result<Vec<u8>> {
    match data {
        [a, b, rest @ ..] if usize::from(u16::from_be_bytes([*a, *b])) == rest.len() => {
            Ok(rest.to_vec())
        }
        _ => kf(format!("{what} size does not match its contents")),
    }
}

impl KeyBlob {
    /// Parses DER.  Never panics; any structural problem is [`Error::KeyFile`].
    pub fn from_der(data: &[u8]) -> Result<KeyBlob> {
        let key = TpmKey::decode_strict(data)?;
        if key.pubkey.as_bytes().len() > MAX_TPM2B + 2
            || key.privkey.as_bytes().len() > MAX_TPM2B + 2
        {
            return kf("TPM structures too large");
        }
        let policy = key
            .policy
            .unwrap_or_default()
            .into_iter()
            .map(|p| PolicyCommand {
                command_code: p.command_code,
                command_policy: p.command_policy.as_bytes().to_vec(),
            });
        let commands = |list: Vec<TpmPolicy<'_>>| {
            list.into_iter()
                .map(|p| PolicyCommand {
                    command_code: p.command_code,
                    command_policy: p.command_policy.as_bytes().to_vec(),
                })
                .collect::<Vec<_>>()
        };
        let auth_policies = key
            .auth_policy
            .unwrap_or_default()
            .into_iter()
            .map(|a| AuthPolicy {
                name: a.name.map(|n| n.as_str().to_string()),
                policy: commands(a.policy),
            });
        let blob = KeyBlob {
            parent: key.parent,
            empty_auth: key.empty_auth.is_some_and(|b| b.0),
            policy: policy.collect(),
            auth_policies: auth_policies.collect(),
            description: key.description.map(|d| d.as_str().to_string()),
            rsa_parent: key.rsa_parent.is_some_and(|b| b.0),
            public: key.pubkey.as_bytes().to_vec(),
            private: key.privkey.as_bytes().to_vec(),
        };
        blob.validate()?;
        Ok(blob)
    }

    /// Checks the TPM structures and the parent handle.
    fn validate(&self) -> Result<()> {
        let hi = self.parent >> 24;
        if self.parent != PARENT_OWNER_PRIMARY && hi != 0x81 {
            return kf(format!(
                "unsupported parent handle 0x{:08x} (expected 0x40000001 or a persistent \
                 0x81xxxxxx handle)",
                self.parent
            ));
        }
        tpm2b_payload(&self.private, "TPM2B_PRIVATE")?;
        if self.private.len() < 3 {
            return kf("empty TPM2B_PRIVATE");
        }
        let public = parse_tpm2b_public(&self.public)?;
        key_alg_of(&public)?;
        check_authorization(&public, &self.policy)?;
        for p in &self.policy {
            match p.command_code {
                TPM_CC_POLICY_PCR => {
                    parse_policy_pcr(&p.command_policy)?;
                }
                TPM_CC_POLICY_AUTH_VALUE => {}
                TPM_CC_POLICY_AUTHORIZE => {
                    signed::parse_authorize(&p.command_policy)?;
                }
                other => {
                    return kf(format!("unsupported policy command 0x{other:x}"));
                }
            }
        }
        self.check_signed()
    }

    /// A key's signed policies need a key whose policy starts with
    /// PolicyAuthorize, and each must have the shape tpmcrypt satisfies.
    /// Their signatures are checked where they are used.
    fn check_signed(&self) -> Result<()> {
        let signer = self.signer()?;
        if signer.is_none() && !self.auth_policies.is_empty() {
            return kf("signed policies ([3]) in a key whose policy is not PolicyAuthorize");
        }
        if self
            .policy
            .iter()
            .skip(1)
            .any(|p| p.command_code != TPM_CC_POLICY_AUTH_VALUE)
            && signer.is_some()
        {
            return kf("PolicyAuthorize may be followed only by PolicyAuthValue");
        }
        self.signed_policies().map(|_| ())
    }

    /// The PCR signer of a key whose policy is PolicyAuthorize (its first
    /// command), or `None`.
    pub fn signer(&self) -> Result<Option<signed::SignerPublic>> {
        match self.policy.first() {
            Some(p) if p.command_code == TPM_CC_POLICY_AUTHORIZE => {
                Ok(Some(signed::parse_authorize(&p.command_policy)?.0))
            }
            _ => Ok(None),
        }
    }

    /// The signed policies the key file holds, as read (unverified).
    pub fn signed_policies(&self) -> Result<Vec<signed::SignedPolicy>> {
        self.auth_policies
            .iter()
            .map(|a| signed::SignedPolicy::from_commands(a.name.as_deref(), &a.policy))
            .collect::<Result<Vec<_>>>()
            .map_err(|e| Error::KeyFile(format!("signed policy: {e}")))
    }

    /// Adds a signed policy once it is shown to be the key signer's (in
    /// software). Returns false when an equal one is there already.
    pub fn add_signed_policy(&mut self, policy: &signed::SignedPolicy) -> Result<bool> {
        let Some(signer) = self.signer()? else {
            return Err(Error::SignedPolicy(
                "this key was not created with a PCR signer (key create --pcr-signer)".into(),
            ));
        };
        if policy.signer != signer {
            return Err(Error::SignedPolicy(format!(
                "signer mismatch: the policy is signed by {}, the key trusts {}",
                policy.signer.fingerprint()?,
                signer.fingerprint()?
            )));
        }
        self.check_policy_ref(policy)?;
        policy.verify()?;
        let existing = self.signed_policies()?;
        // The same values signed by the key's signer (a planted copy by
        // another signer does not count: it is never used).
        if existing.iter().any(|p| {
            p.selection == policy.selection
                && p.pcr_digest == policy.pcr_digest
                && p.signer == signer
                && p.verify().is_ok()
        }) {
            return Ok(false);
        }
        if existing.len() >= signed::MAX_SIGNED_POLICIES {
            return Err(Error::SignedPolicy(format!(
                "the key holds {} signed policies already, the most a key file may",
                existing.len()
            )));
        }
        self.auth_policies.push(AuthPolicy {
            name: Some(policy.label()),
            policy: policy.commands()?,
        });
        Ok(true)
    }

    /// A signed policy works only with the policyRef of the key's own
    /// PolicyAuthorize (tpmcrypt's keys use an empty one; openssl_tpm2_engine
    /// binds each key to a random one).
    pub fn check_policy_ref(&self, policy: &signed::SignedPolicy) -> Result<()> {
        let key_ref = match self.policy.first() {
            Some(p) if p.command_code == TPM_CC_POLICY_AUTHORIZE => {
                signed::parse_authorize(&p.command_policy)?.1
            }
            _ => Vec::new(),
        };
        if policy.policy_ref != key_ref {
            return Err(Error::SignedPolicy(
                "the policy is signed for another policyRef than the key's".into(),
            ));
        }
        Ok(())
    }

    /// Keeps only the signed policies `keep` selects; returns how many went.
    pub fn retain_signed_policies(
        &mut self,
        mut keep: impl FnMut(&signed::SignedPolicy) -> bool,
    ) -> Result<usize> {
        let policies = self.signed_policies()?;
        let before = self.auth_policies.len();
        let mut it = policies.iter();
        self.auth_policies
            .retain(|_| it.next().is_some_and(&mut keep));
        Ok(before - self.auth_policies.len())
    }

    /// Encodes DER: emptyAuth always, the policy when there is one, the
    /// description when set and rsaParent when TRUE.
    ///
    /// # Panics
    ///
    /// If a field is larger than DER lengths allow here (256 MiB), which
    /// no blob that was parsed or made by a TPM can be.
    pub fn to_der(&self) -> Vec<u8> {
        use der::Encode as _;
        self.to_asn1()
            .and_then(|key| key.to_der())
            .expect("a key blob's fields fit DER lengths")
    }

    /// The blob as the format's ASN.1 structure, borrowing its fields.
    fn to_asn1(&self) -> der::Result<TpmKey<'_>> {
        let policy = self
            .policy
            .iter()
            .map(|p| {
                Ok(TpmPolicy {
                    command_code: p.command_code,
                    command_policy: der::asn1::OctetStringRef::new(&p.command_policy)?,
                })
            })
            .collect::<der::Result<Vec<_>>>()?;
        let auth_policy = self
            .auth_policies
            .iter()
            .map(|a| {
                Ok(TpmAuthPolicy {
                    name: a
                        .name
                        .as_deref()
                        .map(der::asn1::Utf8StringRef::new)
                        .transpose()?,
                    policy: a
                        .policy
                        .iter()
                        .map(|p| {
                            Ok(TpmPolicy {
                                command_code: p.command_code,
                                command_policy: der::asn1::OctetStringRef::new(&p.command_policy)?,
                            })
                        })
                        .collect::<der::Result<Vec<_>>>()?,
                })
            })
            .collect::<der::Result<Vec<_>>>()?;
        Ok(TpmKey {
            key_type: asn1::OID_LOADABLE_KEY,
            empty_auth: Some(LaxBool(self.empty_auth)),
            policy: (!policy.is_empty()).then_some(policy),
            secret: None,
            auth_policy: (!auth_policy.is_empty()).then_some(auth_policy),
            description: self
                .description
                .as_deref()
                .map(der::asn1::Utf8StringRef::new)
                .transpose()?,
            rsa_parent: self.rsa_parent.then_some(LaxBool(true)),
            parent: self.parent,
            pubkey: der::asn1::OctetStringRef::new(&self.public)?,
            privkey: der::asn1::OctetStringRef::new(&self.private)?,
        })
    }

    /// Parses a `-----BEGIN TSS2 PRIVATE KEY-----` PEM.
    pub fn from_pem(pem: &str) -> Result<KeyBlob> {
        let der = asn1::pem_decode(pem, PEM_LABEL)?;
        KeyBlob::from_der(&der)
    }

    /// What a `TSS2 PRIVATE KEY` PEM says of its authValue, as written:
    /// `Some(true)` (emptyAuth TRUE: no PIN), `Some(false)` (an explicit
    /// FALSE) or `None` (the field is absent, which the key-file
    /// specification reads as "needs authorization"). [`KeyBlob`] folds the
    /// last two together; an importer needs them apart, because tpm2-tools
    /// up to 5.4 writes an explicit FALSE for keys *without* a password.
    pub fn declared_empty_auth(pem: &str) -> Result<Option<bool>> {
        let der = asn1::pem_decode(pem, PEM_LABEL)?;
        Ok(TpmKey::decode_strict(&der)?.empty_auth.map(|b| b.0))
    }

    /// Encodes as a `TSS2 PRIVATE KEY` PEM (64-column lines, LF).
    ///
    /// # Panics
    ///
    /// As [`KeyBlob::to_der`].
    pub fn to_pem(&self) -> String {
        asn1::pem_encode(&self.to_der(), PEM_LABEL).expect("a key file's DER fits PEM")
    }

    /// The public area.
    pub fn public_area(&self) -> Result<Public> {
        parse_tpm2b_public(&self.public)
    }

    /// The private blob in tss-esapi form.
    pub(crate) fn private_area(&self) -> Result<Private> {
        let payload = tpm2b_payload(&self.private, "TPM2B_PRIVATE")?;
        Private::try_from(payload).map_err(|e| Error::KeyFile(format!("TPM2B_PRIVATE: {e}")))
    }

    /// The key's algorithm.
    pub fn alg(&self) -> Result<KeyAlg> {
        key_alg_of(&self.public_area()?)
    }

    /// The PCR binding recorded in the key file policy, if any.
    pub fn pcr_policy(&self) -> Result<Option<(PcrSelection, Vec<u8>)>> {
        match self
            .policy
            .iter()
            .find(|p| p.command_code == TPM_CC_POLICY_PCR)
        {
            Some(p) => parse_policy_pcr(&p.command_policy).map(Some),
            None => Ok(None),
        }
    }

    /// Whether the key needs a policy session (it has an authPolicy and the
    /// authValue alone does not authorize user actions).
    pub fn needs_policy_session(&self) -> Result<bool> {
        let public = self.public_area()?;
        Ok(!public.object_attributes().user_with_auth() && !public.auth_policy().is_empty())
    }

    /// The public key as DER SubjectPublicKeyInfo.
    pub fn public_key_der(&self) -> Result<Vec<u8>> {
        Ok(self.public_pkey()?.public_key_to_der()?)
    }

    /// The public key as `-----BEGIN PUBLIC KEY-----` PEM.
    pub fn public_key_pem(&self) -> Result<String> {
        let pem = self.public_pkey()?.public_key_to_pem()?;
        String::from_utf8(pem).map_err(|_| Error::KeyFile("non-UTF-8 PEM".into()))
    }

    /// The public key as an OpenSSL key (for software encryption to it).
    pub fn public_pkey(&self) -> Result<PKey<PkPublic>> {
        match self.public_area()? {
            Public::Rsa {
                parameters, unique, ..
            } => {
                let n = BigNum::from_slice(unique.value())?;
                let e = match parameters.exponent().value() {
                    0 => 65537,
                    e => e,
                };
                let e = BigNum::from_u32(e)?;
                Ok(PKey::from_rsa(Rsa::from_public_components(n, e)?)?)
            }
            Public::Ecc {
                parameters, unique, ..
            } => {
                if parameters.ecc_curve() != EccCurve::NistP256 {
                    return kf("only NIST P-256 ECC keys are supported");
                }
                let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1)?;
                let x = BigNum::from_slice(unique.x().value())?;
                let y = BigNum::from_slice(unique.y().value())?;
                let off_curve =
                    |_| Error::KeyFile("the ECC public point is not on NIST P-256".into());
                let key =
                    EcKey::from_public_key_affine_coordinates(&group, &x, &y).map_err(off_curve)?;
                key.check_key().map_err(off_curve)?;
                Ok(PKey::from_ec_key(key)?)
            }
            _ => kf("unsupported key type"),
        }
    }

    /// For ECC keys: the uncompressed SEC1 public point (65 bytes), checked
    /// to be on NIST P-256. Read from the public area without OpenSSL (the
    /// front `tpmcrypt` encrypts to it; see [`crate::identity::p256_key_recipients`]).
    pub fn ecc_public_point(&self) -> Result<Vec<u8>> {
        let Public::Ecc {
            parameters, unique, ..
        } = self.public_area()?
        else {
            return Err(Error::InvalidInput("not an ECC key".into()));
        };
        if parameters.ecc_curve() != EccCurve::NistP256 {
            return kf("only NIST P-256 ECC keys are supported");
        }
        let mut point = vec![0x04];
        for coordinate in [unique.x().value(), unique.y().value()] {
            // Big-endian, possibly without its leading zero bytes.
            let Some(pad) = 32usize.checked_sub(coordinate.len()) else {
                return kf("an ECC coordinate longer than 32 bytes");
            };
            point.extend(std::iter::repeat(0).take(pad));
            point.extend_from_slice(coordinate);
        }
        p256::PublicKey::from_sec1_bytes(&point)
            .map_err(|_| Error::KeyFile("the ECC public point is not on NIST P-256".into()))?;
        Ok(point)
    }
}

/// The [`KeyAlg`] of a public area, rejecting anything we cannot unbind with:
/// TPM2_RSA_Decrypt with OAEP-SHA256 needs an unrestricted decryption key
/// whose scheme is NULL or OAEP-SHA256 (the TPM refuses any other pairing),
/// TPM2_ECDH_ZGen one whose scheme is NULL or ECDH.
pub(crate) fn key_alg_of(public: &Public) -> Result<KeyAlg> {
    let attrs = public.object_attributes();
    if attrs.restricted() {
        return unusable("it is a restricted key (a storage or attestation key)");
    }
    if !attrs.decrypt() {
        return unusable("it lacks the decrypt attribute (a signing key)");
    }
    match public {
        Public::Rsa { parameters, .. } => {
            if parameters.key_bits() != tss_esapi::interface_types::key_bits::RsaKeyBits::Rsa2048 {
                return unusable("only RSA-2048 keys are supported");
            }
            match parameters.rsa_scheme() {
                RsaScheme::Null => {}
                RsaScheme::Oaep(h) if h.hashing_algorithm() == HashingAlgorithm::Sha256 => {}
                other => {
                    return unusable(format!(
                        "its scheme is {}; tpmcrypt unbinds with OAEP-SHA256, which the TPM \
                         refuses for this key",
                        rsa_scheme_name(other)
                    ))
                }
            }
            Ok(KeyAlg::Rsa2048)
        }
        Public::Ecc { parameters, .. } => {
            if parameters.ecc_curve() != EccCurve::NistP256 {
                return unusable("only NIST P-256 ECC keys are supported");
            }
            match parameters.ecc_scheme() {
                EccScheme::Null | EccScheme::EcDh(_) => Ok(KeyAlg::EccP256),
                other => unusable(format!(
                    "its scheme is {:?}; TPM2_ECDH_ZGen needs the NULL or ECDH scheme",
                    other.algorithm()
                )),
            }
        }
        _ => unusable("unsupported key type (only RSA and ECC keys)"),
    }
}

fn unusable<T>(m: impl Into<String>) -> Result<T> {
    Err(Error::Unusable(m.into()))
}

/// An RSA scheme as people write it (`OAEP-SHA1`, `RSAES-PKCS#1-v1_5`).
fn rsa_scheme_name(scheme: RsaScheme) -> String {
    let hash = |h: HashScheme| format!("{:?}", h.hashing_algorithm()).to_uppercase();
    match scheme {
        RsaScheme::Oaep(h) => format!("OAEP-{}", hash(h)),
        RsaScheme::RsaEs => "RSAES-PKCS#1-v1_5".to_string(),
        RsaScheme::RsaSsa(h) => format!("RSASSA-{} (signing)", hash(h)),
        RsaScheme::RsaPss(h) => format!("RSAPSS-{} (signing)", hash(h)),
        other => format!("{:?}", other.algorithm()),
    }
}

/// Whether anything can authorize the key's use the way tpmcrypt does:
/// its authValue (userWithAuth), or a policy whose commands the key file
/// carries and which give the key's authPolicy (recomputed here in
/// software, so nothing is sent to the TPM and no try is spent).
fn check_authorization(public: &Public, policy: &[PolicyCommand]) -> Result<()> {
    let attrs = public.object_attributes();
    let auth_policy = public.auth_policy();
    if attrs.user_with_auth() {
        return Ok(());
    }
    if auth_policy.is_empty() {
        return unusable(
            "it has neither userWithAuth nor an authPolicy: nothing can authorize its use",
        );
    }
    if policy.is_empty() {
        return unusable(
            "its use needs a policy, and the key file carries no policy commands to satisfy it",
        );
    }
    if public.name_hashing_algorithm() != HashingAlgorithm::Sha256 {
        return unusable("its policy is not a SHA-256 policy (tpmcrypt's policy sessions are)");
    }
    if policy_digest(policy)? != auth_policy.value() {
        return unusable("the policy commands in the key file do not give the key's authPolicy");
    }
    Ok(())
}

/// The SHA-256 policy digest the commands give, from the all-zero start.
pub(crate) fn policy_digest(policy: &[PolicyCommand]) -> Result<Vec<u8>> {
    use sha2::Digest as _;
    let mut digest = vec![0u8; 32];
    for p in policy {
        let mut data = digest.clone();
        data.extend_from_slice(&p.command_code.to_be_bytes());
        match p.command_code {
            // H(old || CC || pcrs || pcrDigest); the file holds
            // TPM2B pcrDigest || TPML_PCR_SELECTION.
            TPM_CC_POLICY_PCR => {
                let (sel, pcr_digest) = parse_policy_pcr(&p.command_policy)?;
                data.extend(sel.to_tpml());
                data.extend_from_slice(&pcr_digest);
            }
            TPM_CC_POLICY_AUTH_VALUE => {}
            // PolicyAuthorize replaces the digest: H(H(0 || CC || name) || ref).
            TPM_CC_POLICY_AUTHORIZE => {
                digest = signed::authorize_digest(&p.command_policy)?;
                continue;
            }
            other => return kf(format!("unsupported policy command 0x{other:x}")),
        }
        digest = sha2::Sha256::digest(&data).to_vec();
    }
    Ok(digest)
}

/// Builds the PolicyPCR command parameters: TPM2B_DIGEST pcrDigest ||
/// TPML_PCR_SELECTION pcrs.
pub(crate) fn policy_pcr_command(sel: &PcrSelection, pcr_digest: &[u8]) -> Result<PolicyCommand> {
    let mut body = marshal_tpm2b(pcr_digest)?;
    body.extend(sel.to_tpml());
    Ok(PolicyCommand {
        command_code: TPM_CC_POLICY_PCR,
        command_policy: body,
    })
}

pub(crate) fn parse_policy_pcr(body: &[u8]) -> Result<(PcrSelection, Vec<u8>)> {
    let (dlen, rest) = match body {
        [a, b, rest @ ..] => (usize::from(u16::from_be_bytes([*a, *b])), rest),
        _ => return kf("PolicyPCR parameters truncated"),
    };
    if dlen > 64 {
        return kf("PolicyPCR digest too long");
    }
    let digest = rest
        .get(..dlen)
        .ok_or_else(|| Error::KeyFile("PolicyPCR digest truncated".into()))?;
    let (sel, used) = PcrSelection::from_tpml(&rest[dlen..])?;
    if dlen + used != rest.len() {
        return kf("trailing bytes in PolicyPCR parameters");
    }
    Ok((sel, digest.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key file written by `tpm2_encodeobject` (tpm2-tools 5.4) for an
    /// RSA-2048 OAEP key under the ECC owner primary.
    pub(crate) const TPM2_TOOLS_PEM: &str = include_str!("../tests/data/tpm2-tools-rsa2048.pem");

    #[test]
    fn parses_tpm2_tools_output_and_round_trips() {
        let blob = KeyBlob::from_pem(TPM2_TOOLS_PEM).unwrap();
        assert_eq!(blob.parent, PARENT_OWNER_PRIMARY);
        assert_eq!(blob.alg().unwrap(), KeyAlg::Rsa2048);
        assert!(blob.policy.is_empty());
        let der = asn1::pem_decode(TPM2_TOOLS_PEM, PEM_LABEL).unwrap();
        assert_eq!(blob.to_der(), der, "re-encoding must be byte-identical");
        assert_eq!(KeyBlob::from_pem(&blob.to_pem()).unwrap(), blob);
        assert!(blob
            .public_key_pem()
            .unwrap()
            .starts_with("-----BEGIN PUBLIC KEY-----"));
    }

    #[test]
    fn policy_round_trip() {
        let mut blob = KeyBlob::from_pem(TPM2_TOOLS_PEM).unwrap();
        let sel = PcrSelection::parse("sha256:0,7").unwrap();
        blob.policy = vec![
            policy_pcr_command(&sel, &[0xAB; 32]).unwrap(),
            PolicyCommand {
                command_code: TPM_CC_POLICY_AUTH_VALUE,
                command_policy: vec![],
            },
        ];
        blob.description = Some("test key".into());
        blob.parent = PARENT_PERSISTENT_SRK;
        let back = KeyBlob::from_der(&blob.to_der()).unwrap();
        assert_eq!(back, blob);
        assert_eq!(back.pcr_policy().unwrap(), Some((sel, vec![0xAB; 32])));
    }

    /// The tpm2-tools key with its public area changed by `f`, re-parsed.
    fn with_public(f: impl FnOnce(Public) -> Public) -> Result<KeyBlob> {
        let mut blob = KeyBlob::from_pem(TPM2_TOOLS_PEM).unwrap();
        blob.public = marshal_tpm2b_public(&f(blob.public_area().unwrap())).unwrap();
        KeyBlob::from_der(&blob.to_der())
    }

    /// The tpm2-tools key (RSA-2048, userWithAuth) with another RSA scheme,
    /// attributes and authPolicy.
    fn rsa_key(
        scheme: RsaScheme,
        user_with_auth: bool,
        policy: &[u8],
    ) -> impl FnOnce(Public) -> Public + '_ {
        move |p| match p {
            Public::Rsa {
                object_attributes,
                name_hashing_algorithm,
                parameters,
                unique,
                ..
            } => {
                // TPMA_OBJECT bit 6: userWithAuth.
                let raw = u32::from(object_attributes) & !0x40;
                let raw = raw | if user_with_auth { 0x40 } else { 0 };
                let object_attributes = tss_esapi::attributes::ObjectAttributes::from(raw);
                Public::Rsa {
                    object_attributes,
                    name_hashing_algorithm,
                    auth_policy: tss_esapi::structures::Digest::try_from(policy.to_vec()).unwrap(),
                    parameters: tss_esapi::structures::PublicRsaParameters::new(
                        parameters.symmetric_definition_object(),
                        scheme,
                        parameters.key_bits(),
                        parameters.exponent(),
                    ),
                    unique,
                }
            }
            other => other,
        }
    }

    #[test]
    fn keys_that_could_never_unbind_are_unusable() {
        let sha = |h| HashScheme::new(h);
        for scheme in [
            RsaScheme::Oaep(sha(HashingAlgorithm::Sha1)),
            RsaScheme::Oaep(sha(HashingAlgorithm::Sha384)),
            RsaScheme::RsaEs,
        ] {
            let r = with_public(rsa_key(scheme, true, &[]));
            assert!(matches!(r, Err(Error::Unusable(_))), "{scheme:?}: {r:?}");
        }
        for scheme in [
            RsaScheme::Null,
            RsaScheme::Oaep(sha(HashingAlgorithm::Sha256)),
        ] {
            with_public(rsa_key(scheme, true, &[])).unwrap();
        }
        // Nothing authorizes it: no userWithAuth, no authPolicy.
        let r = with_public(rsa_key(RsaScheme::Null, false, &[]));
        assert!(matches!(r, Err(Error::Unusable(_))), "{r:?}");
        // A policy the file has no commands for, or commands that do not
        // give it.
        let r = with_public(rsa_key(RsaScheme::Null, false, &[7; 32]));
        assert!(matches!(r, Err(Error::Unusable(_))), "{r:?}");
        let sel = PcrSelection::parse("sha256:0,7").unwrap();
        let commands = vec![policy_pcr_command(&sel, &[0xAB; 32]).unwrap()];
        let right = policy_digest(&commands).unwrap();
        let mut blob = KeyBlob::from_pem(TPM2_TOOLS_PEM).unwrap();
        blob.policy = commands;
        for (policy, ok) in [(right.clone(), true), (vec![7; 32], false)] {
            let public = rsa_key(RsaScheme::Null, false, &policy)(blob.public_area().unwrap());
            let mut b = blob.clone();
            b.public = marshal_tpm2b_public(&public).unwrap();
            let r = KeyBlob::from_der(&b.to_der());
            assert_eq!(r.is_ok(), ok, "{r:?}");
        }
    }

    #[test]
    fn a_signed_policy_must_carry_the_keys_signer_and_policy_ref() {
        let signer = crate::signed::PcrSigner::generate().unwrap();
        let public = signer.public().unwrap();
        let sel = PcrSelection::parse("sha256:7").unwrap();
        let policy = signer.sign(&sel, &[vec![0; 32]]).unwrap();
        let mut blob = KeyBlob::from_pem(TPM2_TOOLS_PEM).unwrap();
        blob.policy = vec![signed::authorize_command(&public, &[1; 32], &[0, 0x10]).unwrap()];
        let err = blob.add_signed_policy(&policy).unwrap_err().to_string();
        assert!(err.contains("policyRef"), "{err}");
        blob.policy = vec![signed::key_authorize_command(&public).unwrap()];
        assert!(blob.add_signed_policy(&policy).unwrap());
        assert!(!blob.add_signed_policy(&policy).unwrap(), "twice: once");
        let other = crate::signed::PcrSigner::generate().unwrap();
        let err = blob
            .add_signed_policy(&other.sign(&sel, &[vec![0; 32]]).unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("signer mismatch"), "{err}");
    }

    #[test]
    fn every_truncation_fails_cleanly() {
        let der = asn1::pem_decode(TPM2_TOOLS_PEM, PEM_LABEL).unwrap();
        for i in 0..der.len() {
            assert!(KeyBlob::from_der(&der[..i]).is_err());
        }
        // flipping every byte must never panic
        for i in 0..der.len() {
            let mut d = der.clone();
            d[i] ^= 0xFF;
            let _ = KeyBlob::from_der(&d);
        }
    }
}
