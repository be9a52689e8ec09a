//! Read-only health checks for `tpmcrypt doctor` (see [`crate::probe`]):
//! GetCapability, TestParms, ReadPublic and PCR_Read, and keys loaded and
//! flushed. Nothing here authorizes with a key or changes TPM state.

use tss_esapi::constants::{CapabilityType, PropertyTag};
use tss_esapi::handles::ObjectHandle;
use tss_esapi::interface_types::algorithm::HashingAlgorithm;
use tss_esapi::interface_types::ecc::EccCurve;
use tss_esapi::interface_types::key_bits::RsaKeyBits;
use tss_esapi::structures::{
    CapabilityData, EccScheme, HashScheme, KeyDerivationFunctionScheme, PublicEccParametersBuilder,
    PublicParameters, PublicRsaParametersBuilder, RsaExponent, RsaScheme,
    SymmetricCipherParameters, SymmetricDefinitionObject,
};

use super::rc::{cause_of, classify, Op};
use super::{policy, srk, Tpm};
use crate::error::{Error, Result};
use crate::keyfile::{KeyBlob, PARENT_PERSISTENT_SRK};
use crate::probe::TpmHealth;
use crate::probe::{AlgorithmCheck, KeyCheck, Lockout, PcrBankAlloc, PcrCheck, PersistentSrk};

/// TPMA_PERMANENT.inLockout.
const PERMANENT_IN_LOCKOUT: u32 = 1 << 9;

impl Tpm {
    /// The TPM's identity, PCR banks, the algorithms tpmcrypt needs,
    /// dictionary-attack state and the persistent SRK, read without
    /// changing anything.
    pub fn health(&mut self) -> Result<TpmHealth> {
        let info = self.info()?;
        self.alive()?;
        let r = self.health_inner(info);
        self.finish(r)
    }

    fn health_inner(&mut self, info: crate::TpmInfo) -> Result<TpmHealth> {
        let family = super::u32_to_ascii(self.prop(PropertyTag::FamilyIndicator)?)
            .trim_end_matches('\0')
            .trim()
            .to_string();
        let lockout = Lockout {
            counter: self.prop(PropertyTag::LockoutCounter)?,
            max_tries: self.prop(PropertyTag::MaxAuthFail)?,
            interval_secs: self.prop(PropertyTag::LockoutInterval)?,
            recovery_secs: self.prop(PropertyTag::LockoutRecovery)?,
            in_lockout: self.prop(PropertyTag::Permanent)? & PERMANENT_IN_LOCKOUT != 0,
        };
        let pcr_banks = self.pcr_banks()?;
        let algorithms = self.algorithms()?;
        let srk = match srk::open_persistent(&mut self.ctx, PARENT_PERSISTENT_SRK) {
            Ok(None) => PersistentSrk::Absent,
            Ok(Some(s)) => {
                let mut h = ObjectHandle::from(s.handle);
                self.ctx
                    .tr_close(&mut h)
                    .map_err(|e| classify(Op::Other("TR_Close"), e, None))?;
                PersistentSrk::Present { rsa: s.rsa }
            }
            Err(e @ Error::ConnectionLost { .. }) => return Err(e),
            Err(e) => PersistentSrk::Unusable(e.to_string()),
        };
        Ok(TpmHealth {
            info,
            family,
            pcr_banks,
            algorithms,
            lockout,
            srk,
        })
    }

    fn prop(&mut self, tag: PropertyTag) -> Result<u32> {
        self.property(tag)
            .map(|v| v.unwrap_or(0))
            .map_err(|e| classify(Op::Other("GetCapability(properties)"), e, None))
    }

    fn pcr_banks(&mut self) -> Result<Vec<PcrBankAlloc>> {
        let (data, _) = self
            .ctx
            .execute_without_session(|c| c.get_capability(CapabilityType::AssignedPcr, 0, 16))
            .map_err(|e| classify(Op::Other("GetCapability(pcrs)"), e, None))?;
        let CapabilityData::AssignedPcr(list) = data else {
            return Ok(Vec::new());
        };
        Ok(list
            .get_selections()
            .iter()
            .map(|sel| PcrBankAlloc {
                bank: hash_name(sel.hashing_algorithm()),
                pcrs: sel
                    .selected()
                    .into_iter()
                    .map(|slot| u32::from(slot).trailing_zeros() as u8)
                    .collect(),
            })
            .filter(|b| !b.pcrs.is_empty())
            .collect())
    }

    fn algorithms(&mut self) -> Result<Vec<AlgorithmCheck>> {
        let internal = |e: tss_esapi::Error| Error::Tpm {
            op: "TestParms parameters",
            detail: e.to_string(),
        };
        let rsa = PublicRsaParametersBuilder::new()
            .with_symmetric(SymmetricDefinitionObject::Null)
            .with_scheme(RsaScheme::Oaep(HashScheme::new(HashingAlgorithm::Sha256)))
            .with_key_bits(RsaKeyBits::Rsa2048)
            .with_exponent(RsaExponent::ZERO_EXPONENT)
            .with_is_decryption_key(true)
            .with_restricted(false)
            .build()
            .map_err(internal)?;
        let ecc = PublicEccParametersBuilder::new()
            .with_symmetric(SymmetricDefinitionObject::Null)
            .with_ecc_scheme(EccScheme::EcDh(HashScheme::new(HashingAlgorithm::Sha256)))
            .with_curve(EccCurve::NistP256)
            .with_key_derivation_function_scheme(KeyDerivationFunctionScheme::Null)
            .with_is_decryption_key(true)
            .with_restricted(false)
            .build()
            .map_err(internal)?;
        let aes = SymmetricCipherParameters::new(SymmetricDefinitionObject::AES_128_CFB);
        let mut out = Vec::new();
        for (name, purpose, parms) in [
            (
                "rsa2048-oaep-sha256",
                "RSA keys (--alg rsa2048)",
                PublicParameters::Rsa(rsa),
            ),
            (
                "ecc-p256-ecdh",
                "ECC keys (the default)",
                PublicParameters::Ecc(ecc),
            ),
            (
                "aes128-cfb",
                "encrypted sessions and the storage key",
                PublicParameters::SymCipher(aes),
            ),
        ] {
            let refused = match self.ctx.execute_without_session(|c| c.test_parms(parms)) {
                Ok(()) => None,
                Err(e) => {
                    // A broken connection is not a missing algorithm.
                    if let Error::ConnectionLost { .. } = classify(Op::Other("TestParms"), e, None)
                    {
                        return Err(classify(Op::Other("TestParms"), e, None));
                    }
                    Some(cause_of(&e))
                }
            };
            out.push(AlgorithmCheck {
                name,
                purpose,
                refused,
            });
        }
        Ok(out)
    }

    /// Checks one key without using it: whether this TPM loads it (Load,
    /// then flush: no dictionary-attack try, whatever its PIN), and for a
    /// PCR-bound key whether the PCRs' current values give the digest its
    /// policy recorded (PCR_Read; no policy session is started).
    pub fn check_key(&mut self, key: &KeyBlob) -> Result<KeyCheck> {
        let load_error = match self.check_loads(key) {
            Ok(()) => None,
            Err(e @ Error::ConnectionLost { .. }) => return Err(e),
            Err(e) => Some(e.to_string()),
        };
        let pcr = match key.pcr_policy()? {
            None if key.signer()?.is_some() => Some(self.check_signed(key)?),
            None => None,
            Some((sel, recorded)) => {
                self.alive()?;
                let current = policy::pcr_digest(&mut self.ctx, &sel);
                let satisfied = match self.finish(current) {
                    Ok(digest) => Ok(digest == recorded),
                    Err(e @ Error::ConnectionLost { .. }) => return Err(e),
                    Err(e) => Err(e.to_string()),
                };
                Some(PcrCheck {
                    selection: sel.to_string(),
                    satisfied,
                    signed_refusal: None,
                })
            }
        };
        Ok(KeyCheck {
            load_error,
            pcr,
            pin: !key.empty_auth,
        })
    }
}

impl Tpm {
    /// Whether one of the signed policies of a key bound to a PCR signer
    /// holds now, as decrypt chooses it (signer, signature, policyRef and
    /// the current PCRs checked in software, PCR_Read only: no policy
    /// session, no try).
    fn check_signed(&mut self, key: &KeyBlob) -> Result<PcrCheck> {
        let selection = match key.signed_policies()?.first() {
            Some(p) => p.selection.to_string(),
            None => "(none signed yet)".to_string(),
        };
        let used = self.signed_used.len();
        let chosen = self.choose_signed(key);
        self.signed_used.truncate(used);
        let (satisfied, signed_refusal) = match chosen {
            Ok(_) => (Ok(true), None),
            Err(e @ Error::ConnectionLost { .. }) => return Err(e),
            Err(e @ (Error::NoSignedPolicy(_) | Error::SignedPolicy(_))) => {
                (Ok(false), Some(e.to_string()))
            }
            Err(e) => (Err(e.to_string()), None),
        };
        Ok(PcrCheck {
            selection,
            satisfied,
            signed_refusal,
        })
    }
}

/// A hash as tpm2-tools names PCR banks.
fn hash_name(h: HashingAlgorithm) -> String {
    match h {
        HashingAlgorithm::Sha1 => "sha1".into(),
        HashingAlgorithm::Sha256 => "sha256".into(),
        HashingAlgorithm::Sha384 => "sha384".into(),
        HashingAlgorithm::Sha512 => "sha512".into(),
        HashingAlgorithm::Sm3_256 => "sm3_256".into(),
        HashingAlgorithm::Sha3_256 => "sha3_256".into(),
        HashingAlgorithm::Sha3_384 => "sha3_384".into(),
        HashingAlgorithm::Sha3_512 => "sha3_512".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}
