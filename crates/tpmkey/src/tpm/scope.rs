//! Scoped TPM resources: every transient object and session we create is
//! flushed when its scope ends, on success *and* on error.
//!
//! This matters because tpmcrypt often talks to TPMs without a resource
//! manager (swtpm over TCP, `/dev/tpm0`): anything we leave loaded stays
//! loaded, eats one of the TPM's 3 object/session slots and, for sessions,
//! keeps state an attacker could observe.  The closure style (rather than a
//! Drop guard holding `&mut Context`) keeps the borrow checker happy while
//! still guaranteeing the flush; if a closure panics, `tss_esapi::Context`'s
//! own Drop flushes whatever it still tracks.

use tss_esapi::attributes::SessionAttributesBuilder;
use tss_esapi::constants::SessionType;
use tss_esapi::handles::{KeyHandle, ObjectHandle, SessionHandle};
use tss_esapi::interface_types::algorithm::HashingAlgorithm;
use tss_esapi::interface_types::session_handles::AuthSession;
use tss_esapi::structures::SymmetricDefinition;
use tss_esapi::Context;

use super::rc::{classify, Op};
use crate::error::{Error, Result};

/// Combines the closure result with the cleanup result: the closure's error
/// wins (it is the interesting one), a cleanup error is reported otherwise.
fn combine<T>(r: Result<T>, cleanup: std::result::Result<(), tss_esapi::Error>) -> Result<T> {
    match (r, cleanup) {
        (Err(e), _) => Err(e),
        (Ok(v), Ok(())) => Ok(v),
        (Ok(_), Err(e)) => Err(classify(Op::Other("FlushContext"), e, None)),
    }
}

/// Runs `f` with a transient object, then flushes it.
pub(crate) fn with_object<T>(
    ctx: &mut Context,
    handle: KeyHandle,
    f: impl FnOnce(&mut Context) -> Result<T>,
) -> Result<T> {
    let r = f(ctx);
    let cleanup = ctx.flush_context(ObjectHandle::from(handle));
    combine(r, cleanup)
}

/// Runs `f` with a session, then flushes it.
pub(crate) fn with_session<T>(
    ctx: &mut Context,
    session: AuthSession,
    f: impl FnOnce(&mut Context, AuthSession) -> Result<T>,
) -> Result<T> {
    let r = f(ctx, session);
    let cleanup = ctx.flush_context(ObjectHandle::from(SessionHandle::from(session)));
    combine(r, cleanup)
}

/// Starts a session salted to `salt_key` (the SRK) with AES-128-CFB
/// parameter encryption in both directions, and runs `f` with it.
///
/// Salting makes the session key unknown to a bus eavesdropper even for
/// keys with an empty or guessable authValue, so the encrypted unbind
/// result and PIN-bearing parameters are really protected.
/// `continueSession` is set so the TPM never flushes it behind ESYS's back;
/// [`with_session`] flushes it explicitly.
pub(crate) fn with_salted_session<T>(
    ctx: &mut Context,
    salt_key: KeyHandle,
    session_type: SessionType,
    f: impl FnOnce(&mut Context, AuthSession) -> Result<T>,
) -> Result<T> {
    let session = ctx
        .execute_without_session(|c| {
            c.start_auth_session(
                Some(salt_key),
                None,
                None,
                session_type,
                SymmetricDefinition::AES_128_CFB,
                HashingAlgorithm::Sha256,
            )
        })
        .map_err(|e| classify(Op::Other("StartAuthSession"), e, None))?
        .ok_or_else(|| Error::Tpm {
            op: "StartAuthSession",
            detail: "no session handle returned".into(),
        })?;
    with_session(ctx, session, |ctx, s| {
        let (attrs, mask) = SessionAttributesBuilder::new()
            .with_decrypt(true)
            .with_encrypt(true)
            .with_continue_session(true)
            .build();
        ctx.tr_sess_set_attributes(s, attrs, mask)
            .map_err(|e| classify(Op::Other("TR_SetSessionAttributes"), e, None))?;
        f(ctx, s)
    })
}

/// Runs `f` with an unsalted trial session (used only to compute policy
/// digests; nothing secret passes through it).
pub(crate) fn with_trial_session<T>(
    ctx: &mut Context,
    f: impl FnOnce(&mut Context, AuthSession) -> Result<T>,
) -> Result<T> {
    let session = ctx
        .execute_without_session(|c| {
            c.start_auth_session(
                None,
                None,
                None,
                SessionType::Trial,
                SymmetricDefinition::Null,
                HashingAlgorithm::Sha256,
            )
        })
        .map_err(|e| classify(Op::Other("StartAuthSession(trial)"), e, None))?
        .ok_or_else(|| Error::Tpm {
            op: "StartAuthSession",
            detail: "no session handle returned".into(),
        })?;
    with_session(ctx, session, f)
}
