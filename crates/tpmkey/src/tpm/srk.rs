//! The storage root key (SRK): the parent of every tpmcrypt key.
//!
//! Keys are stored wrapped by their parent, so the parent must be
//! reproducible.  We use either the persistent SRK at 0x81000001 (the TCG
//! convention, provisioned by e.g. `tpm2_createprimary` + `tpm2_evictcontrol`
//! or systemd) or, when none exists, re-derive the primary key from the
//! owner hierarchy with exactly the template that tpm2-openssl and tpm2-tools
//! (`tpm2_load -r key.pem` with parent 0x40000001) use.  Since primary keys
//! are a deterministic function of the hierarchy seed and the template, the
//! same primary comes back every time — which is what makes key files
//! interoperable with those tools.  Any template difference (one attribute
//! bit, a non-empty `unique`) would yield a different key and break loading.

use tss_esapi::attributes::ObjectAttributesBuilder;
use tss_esapi::constants::CapabilityType;
use tss_esapi::handles::{KeyHandle, ObjectHandle, PersistentTpmHandle, TpmHandle};
use tss_esapi::interface_types::algorithm::{HashingAlgorithm, PublicAlgorithm};
use tss_esapi::interface_types::ecc::EccCurve;
use tss_esapi::interface_types::key_bits::RsaKeyBits;
use tss_esapi::interface_types::resource_handles::Hierarchy;
use tss_esapi::interface_types::session_handles::AuthSession;
use tss_esapi::structures::{
    CapabilityData, EccPoint, EccScheme, KeyDerivationFunctionScheme, Public, PublicBuilder,
    PublicEccParametersBuilder, PublicKeyRsa, PublicRsaParametersBuilder, RsaExponent, RsaScheme,
    SymmetricDefinitionObject,
};
use tss_esapi::Context;

use super::rc::{classify, Op};
use crate::error::{Error, Result};
use crate::keyfile::{PARENT_OWNER_PRIMARY, PARENT_PERSISTENT_SRK};

/// TPM_ECC_NIST_P256.
const TPM_ECC_NIST_P256: u16 = 0x0003;

/// Attributes of the standard SRK template:
/// fixedTPM|fixedParent|sensitiveDataOrigin|userWithAuth|noDA|restricted|decrypt
/// (0x00030472).
fn srk_attributes() -> Result<tss_esapi::attributes::ObjectAttributes> {
    ObjectAttributesBuilder::new()
        .with_fixed_tpm(true)
        .with_fixed_parent(true)
        .with_sensitive_data_origin(true)
        .with_user_with_auth(true)
        .with_no_da(true)
        .with_restricted(true)
        .with_decrypt(true)
        .build()
        .map_err(|e| internal("SRK attributes", e))
}

fn internal(what: &'static str, e: tss_esapi::Error) -> Error {
    Error::Tpm {
        op: what,
        detail: e.to_string(),
    }
}

/// ECC P-256 SRK template (tpm2-openssl / `tpm2_createprimary -G ecc` with
/// the attributes above): nameAlg SHA-256, AES-128-CFB, NULL scheme and
/// KDF, empty authPolicy, empty unique.
pub(crate) fn ecc_template() -> Result<Public> {
    PublicBuilder::new()
        .with_public_algorithm(PublicAlgorithm::Ecc)
        .with_name_hashing_algorithm(HashingAlgorithm::Sha256)
        .with_object_attributes(srk_attributes()?)
        .with_ecc_parameters(
            PublicEccParametersBuilder::new()
                .with_symmetric(SymmetricDefinitionObject::AES_128_CFB)
                .with_ecc_scheme(EccScheme::Null)
                .with_curve(EccCurve::NistP256)
                .with_key_derivation_function_scheme(KeyDerivationFunctionScheme::Null)
                .with_is_decryption_key(true)
                .with_restricted(true)
                .build()
                .map_err(|e| internal("SRK template", e))?,
        )
        .with_ecc_unique_identifier(EccPoint::default())
        .build()
        .map_err(|e| internal("SRK template", e))
}

/// RSA-2048 SRK template, for TPMs without ECC: same attributes, exponent 0
/// (= 65537), AES-128-CFB, NULL scheme, empty unique.
pub(crate) fn rsa_template() -> Result<Public> {
    PublicBuilder::new()
        .with_public_algorithm(PublicAlgorithm::Rsa)
        .with_name_hashing_algorithm(HashingAlgorithm::Sha256)
        .with_object_attributes(srk_attributes()?)
        .with_rsa_parameters(
            PublicRsaParametersBuilder::new()
                .with_symmetric(SymmetricDefinitionObject::AES_128_CFB)
                .with_scheme(RsaScheme::Null)
                .with_key_bits(RsaKeyBits::Rsa2048)
                .with_exponent(RsaExponent::ZERO_EXPONENT)
                .with_is_decryption_key(true)
                .with_restricted(true)
                .build()
                .map_err(|e| internal("SRK template", e))?,
        )
        .with_rsa_unique_identifier(PublicKeyRsa::default())
        .build()
        .map_err(|e| internal("SRK template", e))
}

/// An SRK we hold for the duration of one operation.
pub(crate) struct Srk {
    pub(crate) handle: KeyHandle,
    /// Parent value to record in key files.
    pub(crate) parent: u32,
    /// True if the primary is RSA (recorded as `rsaParent` in key files).
    pub(crate) rsa: bool,
    /// Transient primaries are flushed; persistent ones only closed in ESYS.
    transient: bool,
}

/// Whether a persistent handle exists.
fn persistent_exists(ctx: &mut Context, handle: u32) -> Result<bool> {
    let (data, _) = ctx
        .execute_without_session(|c| c.get_capability(CapabilityType::Handles, handle, 1))
        .map_err(|e| classify(Op::Other("GetCapability(handles)"), e, None))?;
    Ok(match data {
        CapabilityData::Handles(list) => list
            .iter()
            .any(|h| matches!(h, TpmHandle::Persistent(p) if u32::from(*p) == handle)),
        _ => false,
    })
}

/// Whether the TPM implements NIST P-256.
pub(crate) fn has_ecc_p256(ctx: &mut Context) -> Result<bool> {
    let r = ctx.execute_without_session(|c| {
        c.get_capability(CapabilityType::EccCurves, u32::from(TPM_ECC_NIST_P256), 1)
    });
    match r {
        Ok((CapabilityData::EccCurves(list), _)) => Ok(list
            .iter()
            .any(|c| matches!(EccCurve::from(*c), EccCurve::NistP256))),
        Ok(_) => Ok(false),
        // TPMs without ECC may reject the capability query altogether.
        Err(_) => Ok(false),
    }
}

/// Runs `f` with the SRK identified by a key file's `parent`/`rsaParent`
/// (for loading existing keys), releasing it afterwards.
pub(crate) fn with_srk_for<T>(
    ctx: &mut Context,
    parent: u32,
    rsa_parent: bool,
    f: impl FnOnce(&mut Context, &Srk) -> Result<T>,
) -> Result<T> {
    let srk = if parent == PARENT_OWNER_PRIMARY {
        create_primary(ctx, rsa_parent)?
    } else {
        open_persistent(ctx, parent)?.ok_or_else(|| Error::WrongTpm {
            detail: format!(
                "the key's parent, persistent handle 0x{parent:08x}, does not exist on this TPM"
            ),
        })?
    };
    run_and_release(ctx, srk, f)
}

/// Runs `f` with the SRK to create new keys under: the persistent SRK if
/// provisioned, else the owner primary (ECC, or RSA on ECC-less TPMs).
pub(crate) fn with_default_srk<T>(
    ctx: &mut Context,
    f: impl FnOnce(&mut Context, &Srk) -> Result<T>,
) -> Result<T> {
    let srk = match open_persistent(ctx, PARENT_PERSISTENT_SRK)? {
        Some(s) => s,
        None => {
            let rsa = !has_ecc_p256(ctx)?;
            create_primary(ctx, rsa)?
        }
    };
    run_and_release(ctx, srk, f)
}

fn run_and_release<T>(
    ctx: &mut Context,
    srk: Srk,
    f: impl FnOnce(&mut Context, &Srk) -> Result<T>,
) -> Result<T> {
    if srk.transient {
        let handle = srk.handle;
        super::scope::with_object(ctx, handle, |ctx| f(ctx, &srk))
    } else {
        let r = f(ctx, &srk);
        let mut h = ObjectHandle::from(srk.handle);
        let close = ctx.tr_close(&mut h);
        match (r, close) {
            (Err(e), _) => Err(e),
            (Ok(v), Ok(())) => Ok(v),
            (Ok(_), Err(e)) => Err(classify(Op::Other("TR_Close"), e, None)),
        }
    }
}

fn create_primary(ctx: &mut Context, rsa: bool) -> Result<Srk> {
    let template = if rsa {
        rsa_template()?
    } else {
        ecc_template()?
    };
    // The owner hierarchy's auth is empty on virtually all systems; a
    // password session carrying the empty value is all that is sent.
    let result = ctx
        .execute_with_session(Some(AuthSession::Password), |c| {
            c.create_primary(Hierarchy::Owner, template, None, None, None, None)
        })
        .map_err(|e| classify(Op::Srk, e, None))?;
    Ok(Srk {
        handle: result.key_handle,
        parent: PARENT_OWNER_PRIMARY,
        rsa,
        transient: true,
    })
}

pub(crate) fn open_persistent(ctx: &mut Context, handle: u32) -> Result<Option<Srk>> {
    if !persistent_exists(ctx, handle)? {
        return Ok(None);
    }
    let tpm_handle = PersistentTpmHandle::new(handle)
        .map_err(|e| Error::KeyFile(format!("bad persistent parent handle: {e}")))?;
    let obj = ctx
        .execute_without_session(|c| c.tr_from_tpm_public(TpmHandle::Persistent(tpm_handle)))
        .map_err(|e| classify(Op::Srk, e, None))?;
    let key = KeyHandle::from(obj);
    // Make sure it really is a storage key before trusting it as a parent.
    let public = ctx
        .execute_without_session(|c| c.read_public(key))
        .map(|(p, _, _)| p);
    let check = match public {
        Ok(p) => {
            let a = p.object_attributes();
            if a.restricted() && a.decrypt() && !a.sign_encrypt() {
                Ok(matches!(p, Public::Rsa { .. }))
            } else {
                Err(Error::Tpm {
                    op: "ReadPublic(SRK)",
                    detail: format!(
                        "persistent handle 0x{handle:08x} is not a storage (restricted decryption) key"
                    ),
                })
            }
        }
        Err(e) => Err(classify(Op::Srk, e, None)),
    };
    match check {
        Ok(rsa) => Ok(Some(Srk {
            handle: key,
            parent: handle,
            rsa,
            transient: false,
        })),
        Err(e) => {
            let mut h = obj;
            let _ = ctx.tr_close(&mut h);
            Err(e)
        }
    }
}
