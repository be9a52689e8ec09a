//! Signed PCR policies (TPM2_PolicyAuthorize), as systemd and
//! openssl_tpm2_engine use them.
//!
//! A key made with a *PCR signer* has the authPolicy
//! `PolicyAuthorize(signer)` (then `PolicyAuthValue` when it also has a
//! PIN): no PCR value is fixed when it is created. Whoever holds the
//! signer's private key later signs PCR policies ("PCRs sha256:0,7 hold
//! these values"); the TPM lets the key be used when one of them holds now:
//! `PolicyPCR` + `VerifySignature` + `PolicyAuthorize`.
//!
//! In the key file (draft-bottomley-tpm2-keys, as openssl_tpm2_engine writes
//! signed policies), the key's own policy `[1]` is one `PolicyAuthorize`
//! whose parameters are `TPM2B_PUBLIC keySign || TPM2B_DIGEST policyRef ||
//! TPMT_SIGNATURE` (the NULL signature there), optionally followed by
//! `PolicyAuthValue`; each signed policy is one `TPMAuthPolicy` of
//! `authPolicy [3]`: `PolicyPCR` then `PolicyAuthorize` with the signature
//! over `SHA-256(approvedPolicy || policyRef)`. See docs/signed-policies.md.

use openssl::bn::BigNum;
use openssl::ec::{EcGroup, EcKey};
use openssl::ecdsa::EcdsaSig;
use openssl::nid::Nid;
use openssl::pkey::{PKey, Private};
use tss_esapi::attributes::ObjectAttributesBuilder;
use tss_esapi::interface_types::algorithm::{HashingAlgorithm, PublicAlgorithm};
use tss_esapi::interface_types::ecc::EccCurve;
use tss_esapi::structures::{
    EccParameter, EccPoint, EccScheme, EccSignature, HashScheme, KeyDerivationFunctionScheme,
    Public, PublicBuilder, PublicEccParametersBuilder, Signature, SymmetricDefinitionObject,
};
use tss_esapi::traits::{Marshall, UnMarshall};
use zeroize::Zeroizing;

use crate::error::{Error, Result};
use crate::keyfile::{
    marshal_tpm2b, marshal_tpm2b_public, parse_policy_pcr, parse_tpm2b_public, policy_pcr_command,
    PolicyCommand, TPM_CC_POLICY_PCR,
};
use crate::pcr::PcrSelection;

/// TPM_CC_PolicyAuthorize.
pub const TPM_CC_POLICY_AUTHORIZE: u32 = 0x0000_016A;

/// Most signed policies one key file holds.
pub const MAX_SIGNED_POLICIES: usize = 16;

/// TPMT_SIGNATURE with sigAlg TPM_ALG_NULL: the placeholder in the key's own
/// PolicyAuthorize (the real signatures are in the signed policies).
const NULL_SIGNATURE: [u8; 2] = [0x00, 0x10];

/// How a signed policy's PCR values are recorded in its name (`[0]`).
const LABEL_PREFIX: &str = "tpmcrypt-pcrs ";

fn sig_err<T>(m: impl Into<String>) -> Result<T> {
    Err(Error::SignedPolicy(m.into()))
}

fn sha256(data: &[u8]) -> Result<Vec<u8>> {
    use sha2::Digest as _;
    Ok(sha2::Sha256::digest(data).to_vec())
}

/// The public half of a PCR signer, as the TPM sees it: an ECDSA-SHA256
/// P-256 signing key (TPMT_PUBLIC).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignerPublic {
    public: Public,
}

impl SignerPublic {
    fn from_ec(key: &EcKey<openssl::pkey::Public>) -> Result<SignerPublic> {
        let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1)?;
        if key.group().curve_name() != Some(Nid::X9_62_PRIME256V1) {
            return Err(Error::InvalidInput(
                "a PCR signer is a NIST P-256 key".into(),
            ));
        }
        let mut ctx = openssl::bn::BigNumContext::new()?;
        let (mut x, mut y) = (BigNum::new()?, BigNum::new()?);
        key.public_key()
            .affine_coordinates(&group, &mut x, &mut y, &mut ctx)?;
        let coord = |b: &BigNum| {
            b.to_vec_padded(32)
                .map_err(Error::from)
                .and_then(|v| EccParameter::try_from(v).map_err(|e| tpm_err(&e)))
        };
        let attrs = ObjectAttributesBuilder::new()
            .with_user_with_auth(true)
            .with_sign_encrypt(true)
            .with_decrypt(false)
            .with_restricted(false)
            .build()
            .map_err(|e| tpm_err(&e))?;
        let params = PublicEccParametersBuilder::new()
            .with_symmetric(SymmetricDefinitionObject::Null)
            .with_ecc_scheme(EccScheme::EcDsa(HashScheme::new(HashingAlgorithm::Sha256)))
            .with_curve(EccCurve::NistP256)
            .with_key_derivation_function_scheme(KeyDerivationFunctionScheme::Null)
            .with_is_signing_key(true)
            .with_is_decryption_key(false)
            .with_restricted(false)
            .build()
            .map_err(|e| tpm_err(&e))?;
        let public = PublicBuilder::new()
            .with_public_algorithm(PublicAlgorithm::Ecc)
            .with_name_hashing_algorithm(HashingAlgorithm::Sha256)
            .with_object_attributes(attrs)
            .with_ecc_parameters(params)
            .with_ecc_unique_identifier(EccPoint::new(coord(&x)?, coord(&y)?))
            .build()
            .map_err(|e| tpm_err(&e))?;
        Ok(SignerPublic { public })
    }

    /// Reads a `-----BEGIN PUBLIC KEY-----` PEM (as `pcr-signer create`
    /// prints it).
    pub fn from_pem(pem: &[u8]) -> Result<SignerPublic> {
        let key = PKey::public_key_from_pem(pem)
            .map_err(|_| Error::InvalidInput("not a PEM public key (BEGIN PUBLIC KEY)".into()))?;
        let ec = key
            .ec_key()
            .map_err(|_| Error::InvalidInput("a PCR signer is a NIST P-256 key".into()))?;
        SignerPublic::from_ec(&ec)
    }

    /// The key as SubjectPublicKeyInfo PEM.
    pub fn to_pem(&self) -> Result<String> {
        let pem = self.pkey()?.public_key_to_pem()?;
        String::from_utf8(pem).map_err(|_| Error::SignedPolicy("non-UTF-8 PEM".into()))
    }

    /// Parses a marshalled TPM2B_PUBLIC, which must be an ECDSA-SHA256
    /// P-256 signing key.
    pub fn from_tpm2b(data: &[u8]) -> Result<SignerPublic> {
        let public = parse_tpm2b_public(data)?;
        let ok = matches!(&public, Public::Ecc { parameters, object_attributes, .. }
            if parameters.ecc_curve() == EccCurve::NistP256
                && parameters.ecc_scheme() == EccScheme::EcDsa(HashScheme::new(HashingAlgorithm::Sha256))
                && object_attributes.sign_encrypt())
            && public.name_hashing_algorithm() == HashingAlgorithm::Sha256;
        if !ok {
            return sig_err("the policy signer is not an ECDSA-SHA256 P-256 signing key");
        }
        Ok(SignerPublic { public })
    }

    /// Marshalled TPM2B_PUBLIC.
    pub fn to_tpm2b(&self) -> Result<Vec<u8>> {
        marshal_tpm2b_public(&self.public)
    }

    /// The tss-esapi public area (for TPM2_LoadExternal).
    pub(crate) fn public(&self) -> &Public {
        &self.public
    }

    /// The TPM name: `0x000B || SHA-256(TPMT_PUBLIC)`.
    pub fn name(&self) -> Result<Vec<u8>> {
        let tpmt = self.public.marshall().map_err(|e| tpm_err(&e))?;
        let mut name = vec![0x00, 0x0B];
        name.extend(sha256(&tpmt)?);
        Ok(name)
    }

    /// A short identification: the hex name without its algorithm prefix.
    pub fn fingerprint(&self) -> Result<String> {
        Ok(hex::encode(&self.name()?[2..18]))
    }

    fn pkey(&self) -> Result<PKey<openssl::pkey::Public>> {
        let Public::Ecc { unique, .. } = &self.public else {
            return sig_err("not an ECC key");
        };
        let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1)?;
        let x = BigNum::from_slice(unique.x().value())?;
        let y = BigNum::from_slice(unique.y().value())?;
        let key = EcKey::from_public_key_affine_coordinates(&group, &x, &y)?;
        key.check_key()?;
        Ok(PKey::from_ec_key(key)?)
    }

    /// Whether `signature` (a marshalled TPMT_SIGNATURE) is this key's
    /// ECDSA-SHA256 signature of `digest`, checked in software.
    fn verifies(&self, digest: &[u8], signature: &Signature) -> Result<bool> {
        let Signature::EcDsa(sig) = signature else {
            return Ok(false);
        };
        if sig.hashing_algorithm() != HashingAlgorithm::Sha256 {
            return Ok(false);
        }
        let r = BigNum::from_slice(sig.signature_r().value())?;
        let s = BigNum::from_slice(sig.signature_s().value())?;
        let sig = EcdsaSig::from_private_components(r, s)?;
        let pkey = self.pkey()?;
        let ec = pkey.ec_key()?;
        Ok(sig.verify(digest, &ec).unwrap_or(false))
    }
}

fn tpm_err(e: &tss_esapi::Error) -> Error {
    Error::SignedPolicy(format!("TPM structure: {e}"))
}

/// A PCR signer's private key (ECDSA P-256), kept offline.
pub struct PcrSigner {
    key: EcKey<Private>,
}

impl PcrSigner {
    /// A new random key.
    pub fn generate() -> Result<PcrSigner> {
        let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1)?;
        Ok(PcrSigner {
            key: EcKey::generate(&group)?,
        })
    }

    /// Reads a PKCS#8 `PRIVATE KEY` PEM (as `pcr-signer create` writes it).
    pub fn from_pem(pem: &[u8]) -> Result<PcrSigner> {
        let key = PKey::private_key_from_pem(pem)
            .map_err(|_| Error::InvalidInput("not a PEM private key".into()))?;
        let key = key
            .ec_key()
            .map_err(|_| Error::InvalidInput("a PCR signer is a NIST P-256 key".into()))?;
        if key.group().curve_name() != Some(Nid::X9_62_PRIME256V1) {
            return Err(Error::InvalidInput(
                "a PCR signer is a NIST P-256 key".into(),
            ));
        }
        Ok(PcrSigner { key })
    }

    /// The private key as PKCS#8 PEM (for a 0600 file).
    pub fn to_pem(&self) -> Result<Zeroizing<Vec<u8>>> {
        let pkey = PKey::from_ec_key(self.key.clone())?;
        Ok(Zeroizing::new(pkey.private_key_to_pem_pkcs8()?))
    }

    /// The public half.
    pub fn public(&self) -> Result<SignerPublic> {
        let public = EcKey::from_public_key(self.key.group(), self.key.public_key())?;
        SignerPublic::from_ec(&public)
    }

    /// Signs the policy "the PCRs of `selection` hold `values`" (one value
    /// per selected PCR, ascending).
    pub fn sign(&self, selection: &PcrSelection, values: &[Vec<u8>]) -> Result<SignedPolicy> {
        let len = digest_len(selection);
        if values.len() != selection.indices().len() || values.iter().any(|v| v.len() != len) {
            return sig_err(format!(
                "{} values of {len} bytes are needed for {selection}",
                selection.indices().len()
            ));
        }
        let pcr_digest = sha256(&values.concat())?;
        let approved = approved_policy(selection, &pcr_digest)?;
        let ahash = sha256(&approved)?; // policyRef is empty
        let sig = EcdsaSig::sign(&ahash, &self.key)?;
        let param = |b: &openssl::bn::BigNumRef| {
            b.to_vec_padded(32)
                .map_err(Error::from)
                .and_then(|v| EccParameter::try_from(v).map_err(|e| tpm_err(&e)))
        };
        let signature = Signature::EcDsa(
            EccSignature::create(HashingAlgorithm::Sha256, param(sig.r())?, param(sig.s())?)
                .map_err(|e| tpm_err(&e))?,
        );
        Ok(SignedPolicy {
            selection: selection.clone(),
            values: Some(values.to_vec()),
            pcr_digest,
            signer: self.public()?,
            policy_ref: Vec::new(),
            signature,
        })
    }
}

/// Bytes of one PCR value in the selection's bank.
pub fn digest_len(selection: &PcrSelection) -> usize {
    match selection.bank() {
        crate::pcr::PcrBank::Sha1 => 20,
        crate::pcr::PcrBank::Sha256 => 32,
    }
}

/// `approvedPolicy`: the policy digest of `PolicyPCR(selection, pcrDigest)`
/// from the all-zero start.
pub fn approved_policy(selection: &PcrSelection, pcr_digest: &[u8]) -> Result<Vec<u8>> {
    let mut data = vec![0u8; 32];
    data.extend_from_slice(&TPM_CC_POLICY_PCR.to_be_bytes());
    data.extend(selection.to_tpml());
    data.extend_from_slice(pcr_digest);
    sha256(&data)
}

/// One signed PCR policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedPolicy {
    /// The PCRs it covers.
    pub selection: PcrSelection,
    /// Their values, when recorded (tpmcrypt records them in the policy's
    /// name; checked against `pcr_digest` before they are believed).
    pub values: Option<Vec<Vec<u8>>>,
    /// SHA-256 of the concatenated values (PolicyPCR's pcrDigest).
    pub pcr_digest: Vec<u8>,
    /// Who signed it.
    pub signer: SignerPublic,
    /// PolicyAuthorize's policyRef (tpmcrypt signs with an empty one).
    pub policy_ref: Vec<u8>,
    /// The signature over `SHA-256(approvedPolicy || policyRef)`.
    pub signature: Signature,
}

impl SignedPolicy {
    /// `approvedPolicy` of this policy.
    pub fn approved_policy(&self) -> Result<Vec<u8>> {
        approved_policy(&self.selection, &self.pcr_digest)
    }

    /// The digest the signer signed: `SHA-256(approvedPolicy || policyRef)`.
    pub fn signed_digest(&self) -> Result<Vec<u8>> {
        let mut data = self.approved_policy()?;
        data.extend_from_slice(&self.policy_ref);
        sha256(&data)
    }

    /// Checks the signature in software (no TPM, no try spent).
    pub fn verify(&self) -> Result<()> {
        if self
            .signer
            .verifies(&self.signed_digest()?, &self.signature)?
        {
            Ok(())
        } else {
            sig_err(format!(
                "the signature of the signed policy for {} is invalid",
                self.selection
            ))
        }
    }

    /// The name (`[0]`) this policy is written with: its PCR values.
    pub fn label(&self) -> String {
        match &self.values {
            Some(values) => {
                let pairs: Vec<String> = self
                    .selection
                    .indices()
                    .iter()
                    .zip(values)
                    .map(|(i, v)| format!("{i}={}", hex::encode(v)))
                    .collect();
                format!(
                    "{LABEL_PREFIX}{}:{}",
                    self.selection.to_string().split(':').next().unwrap_or(""),
                    pairs.join(",")
                )
            }
            None => format!("signed policy for {}", self.selection),
        }
    }

    /// The policy as the key file's TPMAuthPolicy commands: PolicyPCR, then
    /// PolicyAuthorize with the signature.
    pub fn commands(&self) -> Result<Vec<PolicyCommand>> {
        let signature = self.signature.marshall().map_err(|e| tpm_err(&e))?;
        Ok(vec![
            policy_pcr_command(&self.selection, &self.pcr_digest)?,
            authorize_command(&self.signer, &self.policy_ref, &signature)?,
        ])
    }

    /// Reads a TPMAuthPolicy's name and commands back.
    pub fn from_commands(name: Option<&str>, commands: &[PolicyCommand]) -> Result<SignedPolicy> {
        let [pcr, auth] = commands else {
            return sig_err("a signed policy tpmcrypt can use is PolicyPCR then PolicyAuthorize");
        };
        if pcr.command_code != TPM_CC_POLICY_PCR || auth.command_code != TPM_CC_POLICY_AUTHORIZE {
            return sig_err("a signed policy tpmcrypt can use is PolicyPCR then PolicyAuthorize");
        }
        let (selection, pcr_digest) = parse_policy_pcr(&pcr.command_policy)?;
        if pcr_digest.len() != 32 {
            return sig_err("the PolicyPCR digest of a signed policy is not SHA-256");
        }
        let (signer, policy_ref, signature) = parse_authorize(&auth.command_policy)?;
        let signature = Signature::unmarshall(&signature)
            .ok()
            .filter(|s| s.marshall().ok().as_deref() == Some(&signature[..]))
            .ok_or_else(|| Error::SignedPolicy("malformed policy signature".into()))?;
        let values = name
            .and_then(|n| parse_label(n, &selection))
            .filter(|v| sha256(&v.concat()).ok().as_deref() == Some(&pcr_digest[..]));
        Ok(SignedPolicy {
            selection,
            values,
            pcr_digest,
            signer,
            policy_ref,
            signature,
        })
    }
}

/// The PEM label of a signed policy file (`pcr sign -o`): the DER of one
/// `TPMAuthPolicy`, exactly as it goes into a key file's `[3]`.
pub const POLICY_PEM_LABEL: &str = "TSS2 SIGNED POLICY";

impl SignedPolicy {
    /// The policy as a `TSS2 SIGNED POLICY` PEM file.
    pub fn to_pem(&self) -> Result<String> {
        use der::Encode as _;
        let label = self.label();
        let commands = self.commands()?;
        let der_err = |e: der::Error| Error::SignedPolicy(format!("DER: {e}"));
        let policy = commands
            .iter()
            .map(|c| {
                Ok(crate::asn1::TpmPolicy {
                    command_code: c.command_code,
                    command_policy: der::asn1::OctetStringRef::new(&c.command_policy)?,
                })
            })
            .collect::<der::Result<Vec<_>>>()
            .map_err(der_err)?;
        let auth = crate::asn1::TpmAuthPolicy {
            name: Some(der::asn1::Utf8StringRef::new(&label).map_err(der_err)?),
            policy,
        };
        let der = auth.to_der().map_err(der_err)?;
        crate::asn1::pem_encode(&der, POLICY_PEM_LABEL).map_err(|e| Error::SignedPolicy(e.0))
    }

    /// Reads a `TSS2 SIGNED POLICY` PEM file (unverified: see
    /// [`SignedPolicy::verify`]).
    pub fn from_pem(text: &str) -> Result<SignedPolicy> {
        use der::Decode as _;
        let bad = |m: String| Error::SignedPolicy(format!("not a signed policy file: {m}"));
        let der = crate::asn1::pem_decode(text, POLICY_PEM_LABEL).map_err(|e| bad(e.0))?;
        let auth = crate::asn1::TpmAuthPolicy::from_der(&der).map_err(|e| bad(e.to_string()))?;
        let commands: Vec<PolicyCommand> = auth
            .policy
            .iter()
            .map(|p| PolicyCommand {
                command_code: p.command_code,
                command_policy: p.command_policy.as_bytes().to_vec(),
            })
            .collect();
        SignedPolicy::from_commands(auth.name.map(|n| n.as_str()), &commands)
    }
}

/// The values a tpmcrypt label records, if it is one for `selection`.
fn parse_label(name: &str, selection: &PcrSelection) -> Option<Vec<Vec<u8>>> {
    let rest = name.strip_prefix(LABEL_PREFIX)?;
    let (_, pairs) = rest.split_once(':')?;
    let mut values = Vec::new();
    for (pair, want) in pairs.split(',').zip(selection.indices()) {
        let (idx, hexv) = pair.split_once('=')?;
        if idx.parse::<u8>().ok()? != *want {
            return None;
        }
        values.push(hex::decode(hexv).ok()?);
    }
    (values.len() == selection.indices().len()).then_some(values)
}

/// PolicyAuthorize's parameters in a key file: `TPM2B_PUBLIC keySign ||
/// TPM2B_DIGEST policyRef || TPMT_SIGNATURE`.
pub(crate) fn authorize_command(
    signer: &SignerPublic,
    policy_ref: &[u8],
    signature: &[u8],
) -> Result<PolicyCommand> {
    let mut body = signer.to_tpm2b()?;
    body.extend(marshal_tpm2b(policy_ref)?);
    body.extend_from_slice(signature);
    Ok(PolicyCommand {
        command_code: TPM_CC_POLICY_AUTHORIZE,
        command_policy: body,
    })
}

/// The key's own PolicyAuthorize: the signer, an empty policyRef and the
/// NULL signature.
pub fn key_authorize_command(signer: &SignerPublic) -> Result<PolicyCommand> {
    authorize_command(signer, &[], &NULL_SIGNATURE)
}

/// Splits PolicyAuthorize parameters into (signer, policyRef, signature).
pub(crate) fn parse_authorize(body: &[u8]) -> Result<(SignerPublic, Vec<u8>, Vec<u8>)> {
    let tpm2b = |data: &[u8], what: &str| -> Result<(usize, usize)> {
        match data {
            [a, b, ..] => {
                let n = usize::from(u16::from_be_bytes([*a, *b]));
                if data.len() < n + 2 {
                    return sig_err(format!("PolicyAuthorize {what} truncated"));
                }
                Ok((2, n + 2))
            }
            _ => sig_err(format!("PolicyAuthorize {what} truncated")),
        }
    };
    let (_, pub_end) = tpm2b(body, "keySign")?;
    let signer = SignerPublic::from_tpm2b(&body[..pub_end])?;
    let rest = &body[pub_end..];
    let (start, ref_end) = tpm2b(rest, "policyRef")?;
    if ref_end - start > 32 {
        return sig_err("PolicyAuthorize policyRef too long");
    }
    Ok((
        signer,
        rest[start..ref_end].to_vec(),
        rest[ref_end..].to_vec(),
    ))
}

/// The policy digest after `PolicyAuthorize(keySign, policyRef)`: it
/// replaces whatever came before with `H(H(0 || CC || name) || policyRef)`.
pub(crate) fn authorize_digest(body: &[u8]) -> Result<Vec<u8>> {
    let (signer, policy_ref, _) = parse_authorize(body)?;
    let mut data = vec![0u8; 32];
    data.extend_from_slice(&TPM_CC_POLICY_AUTHORIZE.to_be_bytes());
    data.extend(signer.name()?);
    let mut second = sha256(&data)?;
    second.extend(policy_ref);
    sha256(&second)
}

/// Of `policies`, the one whose PCR digest `current` (the values of its
/// selection now) gives, or a message naming, for the closest one, the
/// PCRs that differ with their values.
pub fn choose(
    policies: &[SignedPolicy],
    mut current: impl FnMut(&PcrSelection) -> Result<Vec<Vec<u8>>>,
) -> Result<&SignedPolicy> {
    if policies.is_empty() {
        return Err(Error::NoSignedPolicy(
            "the key has no signed PCR policy yet".into(),
        ));
    }
    let mut closest: Option<(usize, String)> = None;
    for p in policies {
        let now = current(&p.selection)?;
        if sha256(&now.concat())? == p.pcr_digest {
            return Ok(p);
        }
        let (n, text) = match &p.values {
            Some(want) => {
                let diffs: Vec<String> = p
                    .selection
                    .indices()
                    .iter()
                    .zip(want.iter().zip(&now))
                    .filter(|(_, (w, n))| w != n)
                    .map(|(i, (w, n))| {
                        format!("PCR {i} is {} (signed: {})", hex::encode(n), hex::encode(w))
                    })
                    .collect();
                (diffs.len(), diffs.join("; "))
            }
            None => (
                usize::MAX,
                format!(
                    "PCRs {} differ (the policy does not record which)",
                    p.selection
                ),
            ),
        };
        if closest.as_ref().map_or(true, |(best, _)| n < *best) {
            closest = Some((n, text));
        }
    }
    let detail = closest.map(|(_, t)| t).unwrap_or_default();
    Err(Error::NoSignedPolicy(format!(
        "no signed PCR policy of the key matches the current PCRs ({} signed); closest: {detail}",
        policies.len()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signed_policy_round_trips_and_verifies() {
        let signer = PcrSigner::generate().unwrap();
        let sel = PcrSelection::parse("sha256:0,7").unwrap();
        let values = vec![vec![1u8; 32], vec![2u8; 32]];
        let p = signer.sign(&sel, &values).unwrap();
        p.verify().unwrap();
        let back = SignedPolicy::from_commands(Some(&p.label()), &p.commands().unwrap()).unwrap();
        assert_eq!(back, p);
        // Another signer's key in its place: the signature no longer holds.
        let mut other = p.clone();
        other.signer = PcrSigner::generate().unwrap().public().unwrap();
        assert!(matches!(other.verify(), Err(Error::SignedPolicy(_))));
        // Other values under the same signature: refused too.
        let mut moved = p.clone();
        moved.pcr_digest = vec![0; 32];
        assert!(moved.verify().is_err());
        // A label that lies about the values is not believed.
        let lie = p.label().replace("=0101", "=0909");
        let back = SignedPolicy::from_commands(Some(&lie), &p.commands().unwrap()).unwrap();
        assert_eq!(back.values, None);
        // The policy file round-trips; a damaged one is refused, not used.
        let pem = p.to_pem().unwrap();
        assert_eq!(SignedPolicy::from_pem(&pem).unwrap(), p);
        assert!(SignedPolicy::from_pem(&pem[..pem.len() / 2]).is_err());
    }

    #[test]
    fn choose_names_the_pcrs_that_differ_from_the_closest_policy() {
        let signer = PcrSigner::generate().unwrap();
        let sel = PcrSelection::parse("sha256:0,7").unwrap();
        let a = signer.sign(&sel, &[vec![1; 32], vec![2; 32]]).unwrap();
        let b = signer.sign(&sel, &[vec![3; 32], vec![4; 32]]).unwrap();
        let both = [a, b];
        let now = |v: Vec<Vec<u8>>| move |_: &PcrSelection| Ok(v.clone());
        let got = choose(&both, now(vec![vec![3; 32], vec![4; 32]])).unwrap();
        assert_eq!(got, &both[1]);
        let err = choose(&both, now(vec![vec![1; 32], vec![9; 32]]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("PCR 7 is {}", hex::encode([9; 32]))),
            "{err}"
        );
        assert!(
            err.contains(&format!("signed: {}", hex::encode([2; 32]))),
            "{err}"
        );
        assert!(!err.contains("PCR 0 is"), "{err}");
    }
}
