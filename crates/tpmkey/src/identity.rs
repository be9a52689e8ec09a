//! TPM keys as cipher identities and recipients.
//!
//! A [`KeyBlob`] becomes a [`tpmcrypt_cipher::Identity`] here: the cipher
//! crate unwraps a file's session key by calling back into the TPM (RSA-OAEP
//! decryption or ECDH Z generation) only when a stanza is addressed to the
//! key. One lazily opened connection ([`TpmAccess`]) serves every key of a
//! run, and PINs come from a [`PinSource`] the caller supplies (a terminal
//! prompt, a file, an askpass program) under a per-run budget ([`Pins`]).
//!
//! ```no_run
//! use std::sync::Arc;
//! use tpmcrypt_cipher::Decryptor;
//! use tpmcrypt_tpmkey::identity::{self, NoPin, Pins, Target, TpmAccess};
//! use tpmcrypt_tpmkey::{KeyBlob, Tcti};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let blob = KeyBlob::from_pem(&std::fs::read_to_string("my.key.pem")?)?;
//! let access = TpmAccess::new(Target::Tcti("swtpm:port=2321".parse::<Tcti>()?));
//! let pins = Arc::new(Pins::new(Box::new(NoPin)));
//! let key = identity::identity("my", blob, false, &access, &pins)?;
//! let decryptor = Decryptor::new(vec![key]);
//! # let _ = decryptor;
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tpmcrypt_cipher::recipient::p256::{EcdhP256, P256Identity, POINT_LEN};
use tpmcrypt_cipher::recipient::rsa::{RsaIdentity, RsaOaepDecrypt};
use tpmcrypt_cipher::recipient::{self, kind, Identity, Recipient};
use tpmcrypt_cipher::recovery;
use zeroize::Zeroizing;

use crate::{Error, KeyAlg, KeyBlob, Keystore, Result, Simulator, Tcti, Tpm};

/// Which TPM to use.
#[derive(Clone, Debug)]
pub enum Target {
    /// A TCTI (default `device:/dev/tpmrm0`).
    Tcti(Tcti),
    /// A private swtpm whose state lives in this directory (NOT secure:
    /// for trying the tool and for tests).
    Simulator(PathBuf),
}

struct Conn {
    // Field order matters: the TPM context is closed before swtpm stops.
    tpm: Tpm,
    _simulator: Option<Simulator>,
}

/// Called once when a [`Target::Simulator`] is started, with its state
/// directory (the CLI warns that a software TPM protects nothing).
pub type SimulatorNotice = Box<dyn Fn(&std::path::Path) + Send + Sync>;

/// A TPM connection opened on first use and shared by every identity of
/// one run, so N unwraps cost one connection (and one swtpm start).
pub struct TpmAccess {
    target: Target,
    conn: Mutex<Option<Conn>>,
    /// Time spent talking to the TPM (connecting included).
    busy: Mutex<Duration>,
    notice: Option<SimulatorNotice>,
}

impl TpmAccess {
    /// Nothing is opened yet.
    pub fn new(target: Target) -> Arc<TpmAccess> {
        Self::with_notice(target, None)
    }

    /// As [`TpmAccess::new`], calling `notice` when a simulator starts.
    pub fn with_notice(target: Target, notice: Option<SimulatorNotice>) -> Arc<TpmAccess> {
        Arc::new(TpmAccess {
            target,
            conn: Mutex::new(None),
            busy: Mutex::new(Duration::ZERO),
            notice,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Option<Conn>> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the TPM, connecting (or starting the simulator) first.
    pub fn with<T>(&self, f: impl FnOnce(&mut Tpm) -> Result<T>) -> Result<T> {
        // Not ended by a signal half-way (see crate::operation).
        let _operation = crate::operation::begin();
        let mut guard = self.lock();
        let start = Instant::now();
        let result = (|| {
            if guard.is_none() {
                *guard = Some(self.connect()?);
            }
            match guard.as_mut() {
                Some(conn) => f(&mut conn.tpm),
                None => Err(Error::InvalidInput("no TPM connection".into())),
            }
        })();
        *self.busy.lock().unwrap_or_else(|e| e.into_inner()) += start.elapsed();
        result
    }

    /// Time spent talking to the TPM so far.
    pub fn busy(&self) -> Duration {
        *self.busy.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn connect(&self) -> Result<Conn> {
        match &self.target {
            Target::Tcti(tcti) => Ok(Conn {
                tpm: Tpm::open_tcti(tcti)?,
                _simulator: None,
            }),
            Target::Simulator(dir) => {
                if let Some(notice) = &self.notice {
                    notice(dir);
                }
                let sim = Simulator::start(dir)?;
                let tpm = Tpm::open(&sim.tcti())?;
                Ok(Conn {
                    tpm,
                    _simulator: Some(sim),
                })
            }
        }
    }

    /// Whether the TPM was opened (a connection made, or tried and kept).
    pub fn is_open(&self) -> bool {
        self.lock().is_some()
    }

    /// The TPM this access opens.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// Unbind commands issued so far (0 if the TPM was never opened).
    pub fn unbind_count(&self) -> u64 {
        self.lock().as_ref().map_or(0, |c| c.tpm.unbind_count())
    }

    /// The signed PCR policies unbinds used so far (see
    /// [`Tpm::signed_policies_used`]).
    pub fn signed_policies_used(&self) -> Vec<String> {
        self.lock()
            .as_ref()
            .map_or_else(Vec::new, |c| c.tpm.signed_policies_used().to_vec())
    }
}

/// A PIN as a [`PinSource`] hands it over.
pub struct Pin {
    /// The PIN's bytes.
    pub secret: Zeroizing<Vec<u8>>,
    /// Whether another PIN may be asked for if the TPM refuses this one:
    /// true for a person typing, false for a PIN read from a file or the
    /// environment (it would be wrong again, and each try counts towards
    /// the TPM's dictionary-attack lockout).
    pub may_retry: bool,
    /// Where it came from, for messages (`--pin-file /etc/pin`,
    /// `TPMCRYPT_PIN`, `the terminal`); never the PIN itself.
    pub origin: String,
}

/// Where the PINs of keys come from (as `age`'s `Callbacks` for
/// passphrases): a prompt, a file, an askpass program.
pub trait PinSource: Send + Sync {
    /// The PIN of the key `name`. `refused` is how many PINs the TPM has
    /// refused for it in this run (0 on the first ask).
    fn pin(&self, name: &str, refused: u32) -> Result<Pin>;
}

/// A [`PinSource`] for keys without a PIN: asking is an error.
pub struct NoPin;

impl PinSource for NoPin {
    fn pin(&self, name: &str, _refused: u32) -> Result<Pin> {
        Err(Error::PinUnavailable(format!(
            "key {name} needs a PIN and none was given"
        )))
    }
}

/// Wrong PINs a run accepts for one key when a person types them: each
/// costs one dictionary-attack try. A PIN that may not be retried (see
/// [`Pin::may_retry`]) is presented once per key and run.
pub const MAX_TYPED_PINS: u32 = 3;

/// What a run knows of one key's PIN.
enum PinState {
    /// Not asked yet, or asked again after a typed PIN was refused.
    Unknown { refused: u32 },
    /// The PIN to present.
    Known {
        pin: Zeroizing<Vec<u8>>,
        may_retry: bool,
        refused: u32,
        origin: String,
    },
    /// Refused by the TPM, and not to be presented again in this run.
    Refused,
}

/// The run's record: each key's state, and the PINs the TPM refused for
/// it (a PIN typed or handed over again is known to fail: it is not
/// presented, and spends no dictionary-attack try).
#[derive(Default)]
struct Book {
    states: HashMap<String, PinState>,
    spent: HashMap<String, Vec<Zeroizing<Vec<u8>>>>,
}

impl Book {
    /// The PIN of `id` was refused (by the TPM, or as one refused before):
    /// ask again next time if it was typed and tries are left, else never
    /// present one again. Returns whether another PIN may be asked for,
    /// and where the refused one came from.
    fn refuse(&mut self, id: &str) -> (bool, String) {
        let (next, origin) = match self.states.remove(id) {
            Some(PinState::Known {
                pin,
                may_retry,
                refused,
                origin,
            }) => {
                self.spent.entry(id.to_string()).or_default().push(pin);
                let next = if may_retry && refused + 1 < MAX_TYPED_PINS {
                    PinState::Unknown {
                        refused: refused + 1,
                    }
                } else {
                    PinState::Refused
                };
                (next, origin)
            }
            _ => (PinState::Refused, String::from("an unknown source")),
        };
        let again = matches!(next, PinState::Unknown { .. });
        self.states.insert(id.to_string(), next);
        (again, origin)
    }

    fn was_refused(&self, id: &str, pin: &[u8]) -> bool {
        self.spent
            .get(id)
            .is_some_and(|pins| pins.iter().any(|p| p[..] == *pin))
    }
}

/// PINs per key, asked for once per run. One the TPM refuses is never
/// presented again: a run over the files of many sessions costs one
/// dictionary-attack try for a wrong PIN from a file, and one per PIN
/// typed (at most [`MAX_TYPED_PINS`]); a refused PIN typed again is not
/// presented (it counts as one of the typed tries, without a TPM try).
/// An empty PIN is never presented either. Keys are told apart by their
/// public area, so one key kept under two names shares one budget.
pub struct Pins {
    source: Box<dyn PinSource>,
    book: Mutex<Book>,
}

impl Pins {
    /// An empty budget over `source`.
    pub fn new(source: Box<dyn PinSource>) -> Pins {
        Pins {
            source,
            book: Mutex::new(Book::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The PIN of the key `id` (named `name`), asking the source once.
    fn get(&self, id: &str, name: &str) -> Result<Zeroizing<Vec<u8>>> {
        let mut book = self.lock();
        loop {
            let refused = match book.states.get(id) {
                Some(PinState::Known { pin, .. }) => return Ok(pin.clone()),
                Some(PinState::Refused) => return Err(Error::PinRefusedBefore(name.to_string())),
                Some(PinState::Unknown { refused }) => *refused,
                None => 0,
            };
            let Pin {
                secret,
                may_retry,
                origin,
            } = self.source.pin(name, refused)?;
            if secret.is_empty() {
                return Err(Error::PinUnavailable(format!(
                    "the PIN for key {name} from {origin} is empty; not presenting it"
                )));
            }
            let spent = book.was_refused(id, &secret);
            book.states.insert(
                id.to_string(),
                PinState::Known {
                    pin: secret.clone(),
                    may_retry,
                    refused,
                    origin,
                },
            );
            if !spent {
                return Ok(secret);
            }
            // Known to fail: refused without asking the TPM.
            if !book.refuse(id).0 {
                return Err(Error::PinRefusedBefore(name.to_string()));
            }
        }
    }

    /// The TPM refused the PIN of `id` (see [`Book::refuse`]).
    fn refused(&self, id: &str) -> (bool, String) {
        self.lock().refuse(id)
    }

    /// Marks `id` as not to be tried again in this run.
    fn give_up(&self, id: &str) {
        self.lock().states.insert(id.to_string(), PinState::Refused);
    }

    fn is_refused(&self, id: &str) -> bool {
        matches!(self.lock().states.get(id), Some(PinState::Refused))
    }
}

fn external(e: Error) -> tpmcrypt_cipher::Error {
    tpmcrypt_cipher::Error::External(Box::new(e))
}

/// A key with the TPM behind it.
struct TpmKey {
    name: String,
    /// What PINs are cached under: the key's public area.
    pin_id: String,
    blob: KeyBlob,
    has_pin: bool,
    access: Arc<TpmAccess>,
    pins: Arc<Pins>,
}

impl TpmKey {
    /// Runs `op` with the key's PIN (if it has one), within the run's PIN
    /// budget: a PIN the TPM refused is not presented again; a typed one is
    /// asked for anew while tries are left. A key recorded as having no PIN
    /// that the TPM refuses without one needs a PIN after all: that is said,
    /// and the key is not tried again either.
    fn with_pin<T>(&self, op: impl Fn(&mut Tpm, Option<&[u8]>) -> Result<T>) -> Result<T> {
        if !self.has_pin {
            if self.pins.is_refused(&self.pin_id) {
                return Err(Error::PinRefusedBefore(self.name.clone()));
            }
            return self.access.with(|tpm| op(tpm, None)).map_err(|e| match e {
                Error::WrongPin => {
                    self.pins.give_up(&self.pin_id);
                    Error::PinNotRecorded(self.name.clone())
                }
                other => other,
            });
        }
        if self.blob.signer()?.is_some() {
            // No signed policy holds: refused before anyone is asked for a
            // PIN that could not be used.
            self.access
                .with(|tpm| tpm.signed_policy_holds(&self.blob))?;
        }
        loop {
            let pin = self.pins.get(&self.pin_id, &self.name)?;
            match self.access.with(|tpm| op(tpm, Some(&pin[..]))) {
                Err(Error::WrongPin) => {
                    let (again, origin) = self.pins.refused(&self.pin_id);
                    if !again {
                        return Err(Error::PinRejected { origin });
                    }
                }
                other => return other,
            }
        }
    }
}

struct TpmRsa {
    key: TpmKey,
    spki: Vec<u8>,
}

impl RsaOaepDecrypt for TpmRsa {
    fn public_spki_der(&self) -> Vec<u8> {
        self.spki.clone()
    }

    fn decrypt(&self, ciphertext: &[u8]) -> tpmcrypt_cipher::Result<Zeroizing<Vec<u8>>> {
        self.key
            .with_pin(|tpm, pin| tpm.rsa_decrypt(&self.key.blob, pin, ciphertext))
            .map_err(external)
    }
}

struct TpmEcc {
    key: TpmKey,
    point: [u8; POINT_LEN],
}

impl EcdhP256 for TpmEcc {
    fn public_point(&self) -> [u8; POINT_LEN] {
        self.point
    }

    fn ecdh(&self, peer: &[u8; POINT_LEN]) -> tpmcrypt_cipher::Result<Zeroizing<[u8; 32]>> {
        self.key
            .with_pin(|tpm, pin| tpm.ecdh_zgen(&self.key.blob, pin, peer))
            .map_err(external)
    }
}

/// The TPM key `blob` (called `name` in messages) as a cipher identity;
/// the TPM is touched only when a stanza is addressed to it. `has_pin`:
/// whether the key needs a PIN (asked for through `pins`).
pub fn identity(
    name: &str,
    blob: KeyBlob,
    has_pin: bool,
    access: &Arc<TpmAccess>,
    pins: &Arc<Pins>,
) -> Result<Box<dyn Identity>> {
    use sha2::Digest;
    let key = TpmKey {
        name: name.to_string(),
        pin_id: hex::encode(sha2::Sha256::digest(&blob.public)),
        has_pin,
        access: access.clone(),
        pins: pins.clone(),
        blob,
    };
    Ok(match key.blob.alg()? {
        KeyAlg::Rsa2048 => {
            let spki = key.blob.public_key_der()?;
            Box::new(RsaIdentity::new(TpmRsa { key, spki }))
        }
        KeyAlg::EccP256 => {
            let point: [u8; POINT_LEN] = key
                .blob
                .ecc_public_point()?
                .as_slice()
                .try_into()
                .map_err(|_| {
                    Error::KeyFile(format!("key {name}: unexpected public point length"))
                })?;
            Box::new(
                P256Identity::new(kind::TPM_P256, TpmEcc { key, point })
                    .map_err(|e| Error::KeyFile(format!("key {name}: {e}")))?,
            )
        }
    })
}

/// The identities of a keystore, and the keys left out.
pub struct KeystoreIdentities {
    /// One identity per usable key: those without a PIN first, each part
    /// in name order.
    pub identities: Vec<Box<dyn Identity>>,
    /// Keys that could not be loaded (damaged, mismatched), with why.
    pub skipped: Vec<(String, Error)>,
}

/// Every key of `store` as an identity (nothing is read from the TPM
/// until a file is addressed to one of them). Fails only when the
/// keystore as a whole cannot be used (untrusted, unreadable); a damaged
/// key is listed in [`KeystoreIdentities::skipped`].
pub fn keystore_identities(
    store: &Keystore,
    access: &Arc<TpmAccess>,
    pins: &Arc<Pins>,
) -> Result<KeystoreIdentities> {
    store.check_trusted()?;
    let mut out = KeystoreIdentities {
        identities: Vec::new(),
        skipped: Vec::new(),
    };
    let mut found = Vec::new();
    for name in store.list()? {
        let identity = store.load(&name).and_then(|(blob, meta)| {
            identity(&name, blob, meta.has_pin, access, pins).map(|i| (meta.has_pin, i))
        });
        match identity {
            Ok(identity) => found.push(identity),
            Err(e) => out.skipped.push((name, e)),
        }
    }
    // Keys without a PIN first: a file one of them opens costs no
    // dictionary-attack try, however wrong the PIN given for the others.
    found.sort_by_key(|(has_pin, _)| *has_pin);
    out.identities = found.into_iter().map(|(_, i)| i).collect();
    Ok(out)
}

/// [`key_recipients`] without OpenSSL, for a P-256 key: the same
/// recipients, or `Ok(None)` where only [`key_recipients`] can decide (an
/// RSA key; a `NAME.pub.pem` that is not byte for byte the DER of the key
/// file's public half, which that refuses or accepts). The front
/// `tpmcrypt` encrypts with it, and hands the run over on `None` or an
/// error.
pub fn p256_key_recipients(
    store: &Keystore,
    name: &str,
) -> Result<Option<Vec<Box<dyn Recipient>>>> {
    use p256::pkcs8::EncodePublicKey as _;
    let (blob, meta, pub_pem) = store.load_with_public(name)?;
    if blob.alg()? != KeyAlg::EccP256 {
        return Ok(None);
    }
    let point = blob.ecc_public_point()?;
    let public = p256::PublicKey::from_sec1_bytes(&point)
        .map_err(|_| Error::KeyFile(format!("key {name}: not a P-256 point")))?;
    let der = public
        .to_public_key_der()
        .map_err(|e| Error::KeyFile(format!("key {name}: {e}")))?;
    if let Some(pem) = pub_pem {
        let same = pem_rfc7468::decode_vec(&pem)
            .is_ok_and(|(label, theirs)| label == "PUBLIC KEY" && theirs == der.as_bytes());
        if !same {
            return Ok(None);
        }
    }
    let key = recipient::p256::P256Recipient::new(recipient::kind::TPM_P256, public)
        .map_err(|e| Error::KeyFile(format!("key {name}: {e}")))?;
    with_recovery(name, Box::new(key), &meta).map(Some)
}

/// A key's recipient, then the recovery recipients recorded for it.
fn with_recovery(
    name: &str,
    key: Box<dyn Recipient>,
    meta: &crate::KeyMeta,
) -> Result<Vec<Box<dyn Recipient>>> {
    let mut recipients = vec![key];
    for r in &meta.recovery {
        recipients.push(Box::new(recovery::parse_recipient(r).map_err(|e| {
            Error::InvalidRecipient(format!("key {name}: recovery recipient: {e}"))
        })?));
    }
    Ok(recipients)
}

/// The recipients a file encrypted to keystore key `name` gets: the key's
/// public half, taken from its key file (no TPM needed) and checked
/// against `NAME.pub.pem` by the keystore, and any recovery recipients
/// recorded for it.
pub fn key_recipients(store: &Keystore, name: &str) -> Result<Vec<Box<dyn Recipient>>> {
    let at = || store.key_path(name).display().to_string();
    // A damaged key file is a key that cannot work, named.
    let (der, meta) = store.public_key_der(name).map_err(|e| match e {
        Error::KeyFile(_) => Error::InvalidRecipient(format!("{}: {e}", at())),
        e => e,
    })?;
    let pem = openssl::pkey::PKey::public_key_from_der(&der)?.public_key_to_pem()?;
    let key = recipient::tpm_recipient_from_pem(&pem)
        .map_err(|e| Error::InvalidRecipient(format!("{}: {e}", at())))?;
    with_recovery(name, key, &meta)
}
