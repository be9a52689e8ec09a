//! The [`Tpm`] handle: opening the TPM, creating keys, unbinding.
//!
//! Every public operation is self-contained: it (re)derives or opens the
//! SRK, loads what it needs, runs its command(s) in a salted,
//! parameter-encrypted session and flushes everything before returning, so
//! the TPM holds no transient object or session of ours afterwards — also
//! on error paths, and also on TPMs without a resource manager.

mod health;
mod policy;
mod rc;
mod scope;
mod srk;

use tss_esapi::attributes::ObjectAttributesBuilder;
use tss_esapi::constants::{CapabilityType, PropertyTag, SessionType, StartupType};
use tss_esapi::handles::{KeyHandle, ObjectHandle};
use tss_esapi::interface_types::algorithm::{HashingAlgorithm, PublicAlgorithm};
use tss_esapi::interface_types::ecc::EccCurve;
use tss_esapi::interface_types::key_bits::RsaKeyBits;
use tss_esapi::structures::{
    Auth, CapabilityData, Data, Digest, EccParameter, EccPoint, EccScheme, HashScheme,
    KeyDerivationFunctionScheme, Public, PublicBuilder, PublicEccParametersBuilder, PublicKeyRsa,
    PublicRsaParametersBuilder, RsaDecryptionScheme, RsaExponent, RsaScheme,
    SymmetricDefinitionObject,
};
use tss_esapi::Context;
use zeroize::Zeroizing;

use crate::error::io_cause;
use crate::error::{Error, Result};
use crate::keyfile::{key_alg_of, marshal_tpm2b, marshal_tpm2b_public, KeyAlg, KeyBlob};
use crate::pcr::PcrSelection;
use crate::tcti::Tcti;
use rc::{cause_of, classify, raw_rc, tpm_code, Op, RC_INITIALIZE};
use scope::{with_object, with_salted_session};

/// The TPM rejects authValues longer than the nameAlg digest (SHA-256).
pub const MAX_PIN_LEN: usize = 32;

/// What [`Tpm::info`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpmInfo {
    /// TPM_PT_MANUFACTURER as text, e.g. "IBM", "INTC", "STM", "NTC".
    pub manufacturer: String,
    /// TPM_PT_VENDOR_STRING_1..4 concatenated and trimmed.
    pub vendor: String,
    /// Firmware version from TPM_PT_FIRMWARE_VERSION_1/2 (`major.minor.x.y`).
    pub firmware_version: String,
    /// True for software TPMs (swtpm/libtpms, IBM simulator): such a TPM
    /// gives no hardware protection at all.
    pub is_simulator: bool,
    /// The TCTI we are connected through.
    pub tcti: String,
}

/// Transient objects and sessions currently loaded in the TPM (for leak
/// checks in tests and `tpmcrypt doctor`-style diagnostics).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadedHandles {
    /// Transient object handles (0x80xxxxxx).
    pub transient: Vec<u32>,
    /// Loaded HMAC/policy session handles (0x02xxxxxx / 0x03xxxxxx).
    pub sessions: Vec<u32>,
}

/// An open connection to a TPM.
pub struct Tpm {
    ctx: Context,
    tcti: Tcti,
    unbinds: u64,
    /// The signed policies unbinds used (see [`Tpm::signed_policies_used`]).
    signed_used: Vec<String>,
    /// Set once the connection broke (command, cause): ESYS cannot go on
    /// after a TCTI failure, so later calls report the loss again instead
    /// of an ESYS sequence error.
    lost: Option<(&'static str, String)>,
}

impl std::fmt::Debug for Tpm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tpm")
            .field("tcti", &self.tcti.to_string())
            .field("unbinds", &self.unbinds)
            .finish()
    }
}

fn u32_to_ascii(v: u32) -> String {
    v.to_be_bytes()
        .iter()
        .filter(|b| b.is_ascii_graphic() || **b == b' ')
        .map(|b| char::from(*b))
        .collect()
}

fn pin_auth(pin: Option<&[u8]>) -> Result<Option<Auth>> {
    match pin {
        None | Some([]) => Ok(None),
        Some(p) if p.len() > MAX_PIN_LEN => Err(Error::InvalidInput(format!(
            "PIN too long ({} bytes, at most {MAX_PIN_LEN})",
            p.len()
        ))),
        Some(p) => Auth::try_from(p.to_vec())
            .map(Some)
            .map_err(|e| Error::InvalidInput(format!("PIN: {e}"))),
    }
}

impl Tpm {
    /// Opens the TPM named by a TCTI string (tpm2-tools syntax).
    pub fn open(tcti: &str) -> Result<Tpm> {
        Tpm::open_tcti(&tcti.parse()?)
    }

    /// Opens the TPM selected by `TPMCRYPT_TCTI`, or `/dev/tpmrm0`.
    pub fn open_default() -> Result<Tpm> {
        Tpm::open_tcti(&Tcti::from_env()?)
    }

    /// Opens the TPM behind a parsed [`Tcti`].
    pub fn open_tcti(tcti: &Tcti) -> Result<Tpm> {
        let unavailable = |cause: String| Error::Unavailable {
            tcti: tcti.to_string(),
            cause,
        };
        // tpm2-tss reports a refused connection or a missing device as a
        // bare TCTI code; our own probe names the cause.
        let why = |e: &tss_esapi::Error| match tcti.probe() {
            Err(cause) => cause,
            Ok(()) => cause_of(e),
        };
        if let Tcti::Device { path } = tcti {
            // Check first: the most common failure. And a TPM is a
            // character device: tpm2-tss would write its commands into
            // whatever else the path names (a file's first bytes, a
            // disk's first sector, for a mistyped /dev/sda).
            use std::os::unix::fs::FileTypeExt;
            match std::fs::metadata(path) {
                Err(e) => return Err(unavailable(format!("{path}: {}", io_cause(&e)))),
                Ok(m) if !m.file_type().is_char_device() => {
                    let kind = match m.file_type() {
                        t if t.is_file() => "a regular file",
                        t if t.is_dir() => "a directory",
                        t if t.is_block_device() => "a block device (a disk)",
                        t if t.is_fifo() => "a FIFO",
                        t if t.is_socket() => "a socket",
                        _ => "not a device",
                    };
                    return Err(unavailable(format!(
                        "{path} is {kind}, not a TPM (a character device such as \
                         /dev/tpmrm0); nothing was written to it"
                    )));
                }
                Ok(_) => {}
            }
        }
        let conf = tcti.to_name_conf().map_err(|e| match e {
            Error::InvalidInput(why) => Error::BadTcti(why),
            other => other,
        })?;
        let ctx = Context::new(conf).map_err(|e| unavailable(why(&e)))?;
        let mut tpm = Tpm {
            ctx,
            tcti: tcti.clone(),
            unbinds: 0,
            signed_used: Vec::new(),
            lost: None,
        };
        // Probe; simulators that were not started need TPM2_Startup.
        match tpm.property(PropertyTag::Manufacturer) {
            Ok(_) => {}
            Err(e) if raw_rc(&e).and_then(tpm_code) == Some(RC_INITIALIZE) => {
                tpm.ctx
                    .execute_without_session(|c| c.startup(StartupType::Clear))
                    .map_err(|e| unavailable(format!("TPM2_Startup failed: {}", cause_of(&e))))?;
            }
            Err(e) => return Err(unavailable(why(&e))),
        }
        Ok(tpm)
    }

    /// The TCTI this handle is connected through.
    pub fn tcti(&self) -> &Tcti {
        &self.tcti
    }

    fn property(&mut self, tag: PropertyTag) -> tss_esapi::Result<Option<u32>> {
        self.ctx
            .execute_without_session(|c| c.get_tpm_property(tag))
    }

    /// Manufacturer, firmware version and whether this is a software TPM.
    pub fn info(&mut self) -> Result<TpmInfo> {
        self.alive()?;
        let r = self.info_inner();
        self.finish(r)
    }

    fn info_inner(&mut self) -> Result<TpmInfo> {
        let get = |tpm: &mut Tpm, tag| {
            tpm.property(tag)
                .map_err(|e| classify(Op::Other("GetCapability(properties)"), e, None))
                .map(|v| v.unwrap_or(0))
        };
        let manufacturer = u32_to_ascii(get(self, PropertyTag::Manufacturer)?);
        let mut vendor = String::new();
        for tag in [
            PropertyTag::VendorString1,
            PropertyTag::VendorString2,
            PropertyTag::VendorString3,
            PropertyTag::VendorString4,
        ] {
            vendor.push_str(&u32_to_ascii(get(self, tag)?));
        }
        let fw1 = get(self, PropertyTag::FirmwareVersion1)?;
        let fw2 = get(self, PropertyTag::FirmwareVersion2)?;
        let firmware_version = format!(
            "{}.{}.{}.{}",
            fw1 >> 16,
            fw1 & 0xFFFF,
            fw2 >> 16,
            fw2 & 0xFFFF
        );
        let vendor = vendor.trim().to_string();
        let is_simulator = manufacturer.trim() == "IBM"
            || vendor.contains("SW   TPM")
            || vendor.to_ascii_lowercase().contains("swtpm")
            || self.tcti.is_network_simulator();
        Ok(TpmInfo {
            manufacturer: manufacturer.trim().to_string(),
            vendor,
            firmware_version,
            is_simulator,
            tcti: self.tcti.to_string(),
        })
    }

    /// Number of unbind commands (RSA_Decrypt / ECDH_ZGen) issued so far
    /// through this handle, whether or not the TPM accepted them.
    pub fn unbind_count(&self) -> u64 {
        self.unbinds
    }

    /// Hex name of the SRK new keys would be created under.  It is a hash of
    /// the SRK public key, so it identifies this TPM's owner seed: keys
    /// created with one SRK name only load where the SRK name is the same.
    pub fn srk_name(&mut self) -> Result<String> {
        self.alive()?;
        let r = self.srk_name_inner();
        self.finish(r)
    }

    fn srk_name_inner(&mut self) -> Result<String> {
        srk::with_default_srk(&mut self.ctx, |ctx, srk| {
            let name = ctx
                .tr_get_name(ObjectHandle::from(srk.handle))
                .map_err(|e| classify(Op::Other("TR_GetName"), e, None))?;
            Ok(name
                .value()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>())
        })
    }

    /// Creates a new decryption key under the SRK.
    ///
    /// * `pcrs`: bind the key to the current values of these PCRs.
    /// * `pin`: require this authValue (at most 32 bytes); the key is then
    ///   subject to dictionary-attack protection.
    pub fn create_key(
        &mut self,
        alg: KeyAlg,
        pcrs: Option<&PcrSelection>,
        pin: Option<&[u8]>,
    ) -> Result<KeyBlob> {
        let has_pin = pin_auth(pin)?.is_some();
        self.create_with(alg, pin, pcrs.is_none(), |ctx| match pcrs {
            Some(sel) => policy::build_policy(ctx, sel, has_pin),
            None => Ok((Digest::default(), Vec::new())),
        })
    }

    /// Creates a new decryption key whose policy is PolicyAuthorize by
    /// `signer` (then PolicyAuthValue with a `pin`): it is used under any
    /// PCR policy the signer signs, and under no other (see
    /// [`crate::signed`]). Its authPolicy is computed in software.
    pub fn create_key_signed(
        &mut self,
        alg: KeyAlg,
        signer: &crate::signed::SignerPublic,
        pin: Option<&[u8]>,
    ) -> Result<KeyBlob> {
        let mut commands = vec![crate::signed::key_authorize_command(signer)?];
        if pin_auth(pin)?.is_some() {
            commands.push(crate::keyfile::PolicyCommand {
                command_code: crate::keyfile::TPM_CC_POLICY_AUTH_VALUE,
                command_policy: Vec::new(),
            });
        }
        let digest = crate::keyfile::policy_digest(&commands)?;
        let digest = Digest::try_from(digest).map_err(|e| Error::Tpm {
            op: "policy digest",
            detail: e.to_string(),
        })?;
        self.create_with(alg, pin, false, move |_| Ok((digest, commands)))
    }

    fn create_with(
        &mut self,
        alg: KeyAlg,
        pin: Option<&[u8]>,
        user_with_auth: bool,
        policy: impl FnOnce(&mut Context) -> Result<(Digest, Vec<crate::keyfile::PolicyCommand>)>,
    ) -> Result<KeyBlob> {
        let auth = pin_auth(pin)?;
        let has_pin = auth.is_some();
        self.alive()?;
        let r = srk::with_default_srk(&mut self.ctx, |ctx, srk| {
            let (auth_policy, commands) = policy(ctx)?;
            let template = key_template(alg, auth_policy, user_with_auth, has_pin)?;
            // Salted session with decrypt: the PIN inside inSensitive is
            // encrypted on the wire.
            let created = with_salted_session(ctx, srk.handle, SessionType::Hmac, |ctx, s| {
                ctx.execute_with_session(Some(s), |c| {
                    c.create(srk.handle, template, auth, None, None, None)
                })
                .map_err(|e| classify(Op::Other("Create"), e, None))
            })?;
            Ok(KeyBlob {
                parent: srk.parent,
                empty_auth: !has_pin,
                policy: commands,
                auth_policies: Vec::new(),
                description: None,
                rsa_parent: srk.rsa && srk.parent == crate::keyfile::PARENT_OWNER_PRIMARY,
                public: marshal_tpm2b_public(&created.out_public)?,
                private: marshal_tpm2b(created.out_private.value())?,
            })
        });
        self.finish(r)
    }

    /// Checks that this TPM loads `key` under the parent its file names (the
    /// persistent SRK, or the owner primary of the standard template), then
    /// flushes it: the key can be used here, without using it. TPM2_Load
    /// authorizes only the parent, never the key, so no dictionary-attack
    /// try is spent whatever the key's PIN.
    pub fn check_loads(&mut self, key: &KeyBlob) -> Result<()> {
        let public = key.public_area()?;
        let private = key.private_area()?;
        self.alive()?;
        let parent = match key.parent {
            crate::keyfile::PARENT_OWNER_PRIMARY => format!(
                "the owner-hierarchy primary of the standard {} template, 0x{:08x}",
                if key.rsa_parent { "RSA" } else { "ECC" },
                key.parent
            ),
            handle => format!("persistent key 0x{handle:08x}"),
        };
        let r = srk::with_srk_for(&mut self.ctx, key.parent, key.rsa_parent, |ctx, srk| {
            let handle = with_salted_session(ctx, srk.handle, SessionType::Hmac, |ctx, s| {
                ctx.execute_with_session(Some(s), |c| c.load(srk.handle, private, public))
                    .map_err(|e| classify(Op::Load, e, None))
            })?;
            with_object(ctx, handle, |_| Ok(()))
        })
        .map_err(|e| match e {
            Error::WrongTpm { detail } => Error::WrongParent { parent, detail },
            other => other,
        });
        self.finish(r)
    }

    /// TPM2_RSA_Decrypt with OAEP/SHA-256 and an empty label.
    pub fn rsa_decrypt(
        &mut self,
        key: &KeyBlob,
        pin: Option<&[u8]>,
        ciphertext: &[u8],
    ) -> Result<Zeroizing<Vec<u8>>> {
        if ciphertext.len() != 256 {
            return Err(Error::InvalidInput(format!(
                "RSA-2048 ciphertext must be 256 bytes, got {}",
                ciphertext.len()
            )));
        }
        let ct = PublicKeyRsa::try_from(ciphertext.to_vec())
            .map_err(|e| Error::InvalidInput(format!("ciphertext: {e}")))?;
        let plain = self.unbind(key, pin, KeyAlg::Rsa2048, move |c, k| {
            c.rsa_decrypt(
                k,
                ct,
                RsaDecryptionScheme::Oaep(HashScheme::new(HashingAlgorithm::Sha256)),
                Data::default(),
            )
        })?;
        Ok(Zeroizing::new(plain.value().to_vec()))
    }

    /// TPM2_ECDH_ZGen: returns the x coordinate of `key · peer` (the
    /// standard ECDH shared secret Z).  `peer` is an uncompressed SEC1
    /// point (`0x04 || x || y`, 65 bytes).
    pub fn ecdh_zgen(
        &mut self,
        key: &KeyBlob,
        pin: Option<&[u8]>,
        peer: &[u8],
    ) -> Result<Zeroizing<[u8; 32]>> {
        if peer.len() != 65 || peer[0] != 0x04 {
            return Err(Error::InvalidInput(
                "peer point must be an uncompressed P-256 point (65 bytes, 0x04||x||y)".into(),
            ));
        }
        let coord = |b: &[u8]| {
            EccParameter::try_from(b.to_vec())
                .map_err(|e| Error::InvalidInput(format!("peer point: {e}")))
        };
        let point = EccPoint::new(coord(&peer[1..33])?, coord(&peer[33..65])?);
        let out = self.unbind(key, pin, KeyAlg::EccP256, move |c, k| {
            c.ecdh_z_gen(k, point)
        })?;
        let x = out.x().value();
        if x.len() > 32 {
            return Err(Error::Tpm {
                op: "ECDH_ZGen",
                detail: format!("unexpected x coordinate length {}", x.len()),
            });
        }
        let mut z = Zeroizing::new([0u8; 32]);
        z[32 - x.len()..].copy_from_slice(x);
        Ok(z)
    }

    /// Loads `key`, authorizes it (policy and/or PIN) in a salted,
    /// parameter-encrypted session, runs `op`, and flushes everything.
    fn unbind<T>(
        &mut self,
        key: &KeyBlob,
        pin: Option<&[u8]>,
        expected: KeyAlg,
        op: impl FnOnce(&mut Context, KeyHandle) -> tss_esapi::Result<T>,
    ) -> Result<T> {
        let public = key.public_area()?;
        let private = key.private_area()?;
        let alg = key_alg_of(&public)?;
        if alg != expected {
            return Err(Error::InvalidInput(format!(
                "this is an {alg} key; the operation needs an {expected} key"
            )));
        }
        let auth = pin_auth(pin)?;
        let needs_policy = key.needs_policy_session()?;
        if needs_policy && key.policy.is_empty() {
            return Err(Error::UnsupportedPolicy(
                "the key has an authPolicy but the key file carries no policy commands to \
                 satisfy it"
                    .into(),
            ));
        }
        let pcrs_text = key.pcr_policy()?.map(|(s, _)| s.to_string());
        let pcrs_text = pcrs_text.as_deref();
        self.alive()?;
        let chosen = match self.choose_signed(key) {
            Ok(c) => c,
            Err(e) => return self.finish(Err(e)),
        };
        let Tpm { ctx, unbinds, .. } = self;
        let r = srk::with_srk_for(ctx, key.parent, key.rsa_parent, |ctx, srk| {
            let key_handle = with_salted_session(ctx, srk.handle, SessionType::Hmac, |ctx, s| {
                ctx.execute_with_session(Some(s), |c| c.load(srk.handle, private, public))
                    .map_err(|e| classify(Op::Load, e, None))
            })?;
            with_object(ctx, key_handle, |ctx| {
                if let Some(a) = auth {
                    ctx.tr_set_auth(ObjectHandle::from(key_handle), a)
                        .map_err(|e| classify(Op::Other("TR_SetAuth"), e, None))?;
                }
                let ty = if needs_policy {
                    SessionType::Policy
                } else {
                    SessionType::Hmac
                };
                with_salted_session(ctx, srk.handle, ty, |ctx, s| {
                    match &chosen {
                        Some((p, _)) => policy::apply_signed(ctx, s, p, &key.policy[1..])?,
                        None if needs_policy => policy::apply(ctx, s, &key.policy, pcrs_text)?,
                        None => {}
                    }
                    *unbinds += 1;
                    ctx.execute_with_session(Some(s), |c| op(c, key_handle))
                        .map_err(|e| classify(Op::Unbind, e, pcrs_text))
                })
            })
        });
        self.finish(r)
    }

    /// For a key under signed policies: the one that holds now, checked in
    /// software first (signer, signature) and matched against the PCR
    /// values read from the TPM, so nothing that would fail reaches the
    /// key's authorization. Records which was used.
    fn choose_signed(
        &mut self,
        key: &KeyBlob,
    ) -> Result<Option<(crate::signed::SignedPolicy, String)>> {
        let Some(signer) = key.signer()? else {
            return Ok(None);
        };
        let all = key.signed_policies()?;
        let mut usable = Vec::new();
        let mut refusal = None;
        for (i, p) in all.iter().enumerate() {
            let check = if p.signer != signer {
                Err(Error::SignedPolicy(format!(
                    "signer mismatch: signed policy {} of the key file is signed by {}, the key \
                     trusts {}",
                    i + 1,
                    p.signer.fingerprint()?,
                    signer.fingerprint()?
                )))
            } else {
                key.check_policy_ref(p).and_then(|()| p.verify())
            };
            match check {
                Ok(()) => usable.push((i, p.clone())),
                Err(e) => refusal = refusal.or(Some(e)),
            }
        }
        if let (true, Some(e)) = (usable.is_empty(), refusal) {
            return Err(e);
        }
        let policies: Vec<_> = usable.iter().map(|(_, p)| p.clone()).collect();
        let mut read: Vec<(PcrSelection, Vec<Vec<u8>>)> = Vec::new();
        let ctx = &mut self.ctx;
        let chosen = crate::signed::choose(&policies, |sel| {
            if let Some((_, v)) = read.iter().find(|(s, _)| s == sel) {
                return Ok(v.clone());
            }
            let v = policy::pcr_values(ctx, sel)?;
            read.push((sel.clone(), v.clone()));
            Ok(v)
        })?;
        let at = policies.iter().position(|p| p == chosen).unwrap_or(0);
        let text = format!(
            "signed policy {} of {} ({})",
            usable[at].0 + 1,
            all.len(),
            chosen.selection
        );
        self.signed_used.push(text.clone());
        Ok(Some((chosen.clone(), text)))
    }

    /// Whether a signed policy of `key` holds now, as an unbind would
    /// choose one (Ok for a key bound to no PCR signer): signer, signature
    /// and policyRef checked in software, the PCRs read (PCR_Read only,
    /// nothing that needs the key's authorization). Recorded nowhere.
    pub fn signed_policy_holds(&mut self, key: &KeyBlob) -> Result<()> {
        let used = self.signed_used.len();
        let chosen = self.choose_signed(key).map(|_| ());
        self.signed_used.truncate(used);
        chosen
    }

    /// The signed policies unbinds used so far, as "signed policy 2 of 3
    /// (sha256:0,7)".
    pub fn signed_policies_used(&self) -> &[String] {
        &self.signed_used
    }

    /// The values of the PCRs of `sel` now, ascending.
    pub fn pcr_values(&mut self, sel: &PcrSelection) -> Result<Vec<Vec<u8>>> {
        self.alive()?;
        let r = policy::pcr_values(&mut self.ctx, sel);
        self.finish(r)
    }

    /// Fails with [`Error::ConnectionLost`] once the connection broke.
    fn alive(&mut self) -> Result<()> {
        match self.lost.clone() {
            None => Ok(()),
            Some((op, detail)) => self.finish(Err(Error::ConnectionLost {
                tcti: String::new(),
                op,
                detail,
            })),
        }
    }

    /// Completes an error of a public method: how long a lockout lasts
    /// (TPM_PT_LOCKOUT_INTERVAL); for a lost connection, the TCTI and, for
    /// a simulator, whether a new connection is refused too.
    fn finish<T>(&mut self, r: Result<T>) -> Result<T> {
        match r {
            Err(Error::Lockout {
                retry_after_secs: None,
            }) => {
                let secs = self.property(PropertyTag::LockoutInterval).ok().flatten();
                Err(Error::Lockout {
                    retry_after_secs: secs,
                })
            }
            Err(Error::ConnectionLost { op, detail, .. }) => {
                if self.lost.is_none() {
                    self.lost = Some((op, detail.clone()));
                }
                // A device may be held open by our own (broken) context:
                // probing it would only say "busy".
                let now = match self.tcti {
                    Tcti::Device { .. } => None,
                    _ => self.tcti.probe().err(),
                };
                Err(Error::ConnectionLost {
                    tcti: self.tcti.to_string(),
                    op,
                    detail: match now {
                        Some(cause) => format!("a new connection fails: {cause}"),
                        None => detail,
                    },
                })
            }
            other => other,
        }
    }

    /// Lists loaded transient objects and sessions.
    pub fn loaded_handles(&mut self) -> Result<LoadedHandles> {
        self.alive()?;
        let r = self.loaded_handles_inner();
        self.finish(r)
    }

    fn loaded_handles_inner(&mut self) -> Result<LoadedHandles> {
        let mut out = LoadedHandles::default();
        for (first, is_session) in [
            (0x8000_0000u32, false),
            (0x0200_0000, true),
            (0x0300_0000, true),
        ] {
            let (data, _) = self
                .ctx
                .execute_without_session(|c| c.get_capability(CapabilityType::Handles, first, 64))
                .map_err(|e| classify(Op::Other("GetCapability(handles)"), e, None))?;
            if let CapabilityData::Handles(list) = data {
                for h in list.iter() {
                    let raw = u32::from(*h);
                    if raw >> 24 != first >> 24 {
                        continue;
                    }
                    if is_session {
                        out.sessions.push(raw);
                    } else {
                        out.transient.push(raw);
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Public template of a tpmcrypt decryption key.
///
/// * RSA: OAEP/SHA-256 scheme, so `tpm2_rsadecrypt -s oaep` works and the
///   TPM refuses PKCS#1 v1.5 (no padding-oracle surface); exponent 65537.
/// * ECC: P-256 with NULL scheme, usable with TPM2_ECDH_ZGen.
/// * `user_with_auth` is cleared for PCR-bound keys so the authValue alone
///   can never bypass the PCR policy; noDA is set only for keys without a
///   PIN (there is nothing to guess, and lockout should not block them).
fn key_template(
    alg: KeyAlg,
    auth_policy: Digest,
    user_with_auth: bool,
    has_pin: bool,
) -> Result<Public> {
    let internal = |e: tss_esapi::Error| Error::Tpm {
        op: "key template",
        detail: e.to_string(),
    };
    let attrs = ObjectAttributesBuilder::new()
        .with_fixed_tpm(true)
        .with_fixed_parent(true)
        .with_sensitive_data_origin(true)
        .with_user_with_auth(user_with_auth)
        .with_no_da(!has_pin)
        .with_decrypt(true)
        .with_sign_encrypt(false)
        .with_restricted(false)
        .build()
        .map_err(internal)?;
    let builder = PublicBuilder::new()
        .with_name_hashing_algorithm(HashingAlgorithm::Sha256)
        .with_object_attributes(attrs)
        .with_auth_policy(auth_policy);
    match alg {
        KeyAlg::Rsa2048 => builder
            .with_public_algorithm(PublicAlgorithm::Rsa)
            .with_rsa_parameters(
                PublicRsaParametersBuilder::new()
                    .with_symmetric(SymmetricDefinitionObject::Null)
                    .with_scheme(RsaScheme::Oaep(HashScheme::new(HashingAlgorithm::Sha256)))
                    .with_key_bits(RsaKeyBits::Rsa2048)
                    .with_exponent(RsaExponent::ZERO_EXPONENT)
                    .with_is_decryption_key(true)
                    .with_is_signing_key(false)
                    .with_restricted(false)
                    .build()
                    .map_err(internal)?,
            )
            .with_rsa_unique_identifier(PublicKeyRsa::default())
            .build()
            .map_err(internal),
        KeyAlg::EccP256 => builder
            .with_public_algorithm(PublicAlgorithm::Ecc)
            .with_ecc_parameters(
                PublicEccParametersBuilder::new()
                    .with_symmetric(SymmetricDefinitionObject::Null)
                    .with_ecc_scheme(EccScheme::Null)
                    .with_curve(EccCurve::NistP256)
                    .with_key_derivation_function_scheme(KeyDerivationFunctionScheme::Null)
                    .with_is_decryption_key(true)
                    .with_is_signing_key(false)
                    .with_restricted(false)
                    .build()
                    .map_err(internal)?,
            )
            .with_ecc_unique_identifier(EccPoint::default())
            .build()
            .map_err(internal),
    }
}
