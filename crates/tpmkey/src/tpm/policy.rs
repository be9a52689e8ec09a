//! Key policies: computing them at creation, satisfying them at use.
//!
//! A PCR-bound key carries authPolicy = PolicyPCR(pcrDigest, selection)
//! [+ PolicyAuthValue when it also has a PIN].  We compute that digest with a
//! TPM trial session rather than in software so the TPM's own definition of
//! the policy hash is used, and store the PCR digest and selection in the key
//! file so the exact same PolicyPCR can be replayed later.  Replaying with the
//! stored digest (instead of an empty one) makes the TPM fail PolicyPCR
//! itself with TPM_RC_VALUE when PCRs changed, which we report precisely.

use openssl::hash::{Hasher, MessageDigest};
use tss_esapi::interface_types::resource_handles::Hierarchy;
use tss_esapi::interface_types::session_handles::{AuthSession, PolicySession};
use tss_esapi::structures::{Digest, Name, Nonce, PcrSelectionList};
use tss_esapi::Context;

use super::rc::{classify, Op};
use super::scope::{with_object, with_trial_session};
use crate::error::{Error, Result};
use crate::keyfile::{
    parse_policy_pcr, policy_pcr_command, PolicyCommand, TPM_CC_POLICY_AUTH_VALUE,
    TPM_CC_POLICY_PCR,
};
use crate::pcr::PcrSelection;
use crate::signed::SignedPolicy;

/// Reads the selected PCRs and returns SHA-256 over their concatenated
/// values (the `pcrDigest` of TPM2_PolicyPCR for a SHA-256 policy session).
pub(crate) fn pcr_digest(ctx: &mut Context, sel: &PcrSelection) -> Result<Vec<u8>> {
    let mut hasher = Hasher::new(MessageDigest::sha256())?;
    for value in pcr_values(ctx, sel)? {
        hasher.update(&value)?;
    }
    Ok(hasher.finish()?.to_vec())
}

/// Reads the selected PCRs, ascending.
pub(crate) fn pcr_values(ctx: &mut Context, sel: &PcrSelection) -> Result<Vec<Vec<u8>>> {
    let mut values = Vec::new();
    // PCR_Read returns at most 8 digests per call; read one PCR at a time
    // so the concatenation order is unambiguous (ascending index).
    for idx in sel.indices() {
        let one = PcrSelection::new(sel.bank(), &[*idx])?.to_tss()?;
        let (_, _, digests) = ctx
            .execute_without_session(|c| c.pcr_read(one))
            .map_err(|e| classify(Op::Other("PCR_Read"), e, None))?;
        let value = digests.value().first().ok_or_else(|| Error::Tpm {
            op: "PCR_Read",
            detail: format!("the TPM has no PCR {idx} in the {} bank", sel),
        })?;
        values.push(value.value().to_vec());
    }
    Ok(values)
}

/// Satisfies a signed policy in `session`: PolicyPCR with the signed
/// digest, the signer loaded (public part only, owner hierarchy: a ticket
/// from the NULL hierarchy is not accepted by PolicyAuthorize) to verify
/// the signature, PolicyAuthorize with the ticket, then the key's own
/// commands after its PolicyAuthorize (`rest`: PolicyAuthValue).
pub(crate) fn apply_signed(
    ctx: &mut Context,
    session: AuthSession,
    policy: &SignedPolicy,
    rest: &[PolicyCommand],
) -> Result<()> {
    let ps = policy_session(session)?;
    let bad = |e: tss_esapi::Error| Error::SignedPolicy(e.to_string());
    let pcrs = policy.selection.to_string();
    let list: PcrSelectionList = policy.selection.to_tss()?;
    let digest = Digest::try_from(policy.pcr_digest.clone()).map_err(bad)?;
    ctx.execute_without_session(|c| c.policy_pcr(ps, digest, list))
        .map_err(|e| classify(Op::PolicyPcr, e, Some(&pcrs)))?;
    let signer = ctx
        .execute_without_session(|c| {
            c.load_external_public(policy.signer.public().clone(), Hierarchy::Owner)
        })
        .map_err(|e| classify(Op::Other("LoadExternal (PCR signer)"), e, None))?;
    let ahash = Digest::try_from(policy.signed_digest()?).map_err(bad)?;
    let signature = policy.signature.clone();
    let ticket = with_object(ctx, signer, |ctx| {
        ctx.execute_without_session(|c| c.verify_signature(signer, ahash, signature))
            .map_err(|e| classify(Op::Other("VerifySignature"), e, None))
    })?;
    let approved = Digest::try_from(policy.approved_policy()?).map_err(bad)?;
    let policy_ref = Nonce::try_from(policy.policy_ref.clone()).map_err(bad)?;
    let name = Name::try_from(policy.signer.name()?).map_err(bad)?;
    ctx.execute_without_session(|c| c.policy_authorize(ps, approved, policy_ref, &name, ticket))
        .map_err(|e| classify(Op::Other("PolicyAuthorize"), e, None))?;
    apply(ctx, session, rest, None)
}

/// Computes (authPolicy digest, policy commands for the key file).
pub(crate) fn build_policy(
    ctx: &mut Context,
    sel: &PcrSelection,
    with_auth_value: bool,
) -> Result<(Digest, Vec<PolicyCommand>)> {
    let pcr_digest = pcr_digest(ctx, sel)?;
    let mut commands = vec![policy_pcr_command(sel, &pcr_digest)?];
    if with_auth_value {
        commands.push(PolicyCommand {
            command_code: TPM_CC_POLICY_AUTH_VALUE,
            command_policy: Vec::new(),
        });
    }
    let digest = with_trial_session(ctx, |ctx, session| {
        apply(ctx, session, &commands, None)?;
        let ps = policy_session(session)?;
        ctx.execute_without_session(|c| c.policy_get_digest(ps))
            .map_err(|e| classify(Op::Other("PolicyGetDigest"), e, None))
    })?;
    Ok((digest, commands))
}

fn policy_session(session: AuthSession) -> Result<PolicySession> {
    PolicySession::try_from(session).map_err(|e| Error::Tpm {
        op: "policy session",
        detail: e.to_string(),
    })
}

/// Runs the key file's policy commands in `session`.
pub(crate) fn apply(
    ctx: &mut Context,
    session: AuthSession,
    commands: &[PolicyCommand],
    pcrs_text: Option<&str>,
) -> Result<()> {
    let ps = policy_session(session)?;
    for cmd in commands {
        match cmd.command_code {
            TPM_CC_POLICY_PCR => {
                let (sel, digest) = parse_policy_pcr(&cmd.command_policy)?;
                let list: PcrSelectionList = sel.to_tss()?;
                let digest = Digest::try_from(digest).map_err(|e| Error::KeyFile(e.to_string()))?;
                ctx.execute_without_session(|c| c.policy_pcr(ps, digest, list))
                    .map_err(|e| classify(Op::PolicyPcr, e, pcrs_text))?;
            }
            TPM_CC_POLICY_AUTH_VALUE => {
                ctx.execute_without_session(|c| c.policy_auth_value(ps))
                    .map_err(|e| classify(Op::Other("PolicyAuthValue"), e, None))?;
            }
            other => {
                return Err(Error::UnsupportedPolicy(format!(
                    "policy command 0x{other:x} is not supported"
                )))
            }
        }
    }
    Ok(())
}
