//! Glue between the TPM crate and the cipher crate: a lazily opened TPM
//! connection, PINs asked for at most once, and keystore keys as cipher
//! identities. Encrypting never comes here: it needs only public keys.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use tpmcrypt_cipher::recipient::p256::{EcdhP256, P256Identity, POINT_LEN};
use tpmcrypt_cipher::recipient::rsa::{RsaIdentity, RsaOaepDecrypt};
use tpmcrypt_cipher::recipient::{kind, Identity};
use tpmcrypt_tpmkey::{KeyAlg, KeyBlob, KeyMeta, Simulator, Tcti, Tpm};
use zeroize::Zeroizing;

use crate::Ui;

/// Environment variable holding a key's PIN (instead of a prompt).
pub const ENV_PIN: &str = "TPMCRYPT_PIN";

/// Which TPM to use, from `--tpm`/`TPMCRYPT_TCTI` and `--simulator`.
#[derive(Clone, Debug)]
pub enum Target {
    /// A TCTI (default `device:/dev/tpmrm0`).
    Tcti(Tcti),
    /// A private swtpm whose state lives in this directory.
    Simulator(PathBuf),
}

impl Target {
    /// From the global flags.
    pub fn from_ui(ui: &Ui) -> anyhow::Result<Target> {
        if ui.simulator {
            // Not checked here: the keystore's own users check it (and a
            // decrypt that leaves an untrusted keystore out never starts
            // the simulator), so `-i` still works beside one.
            let dir = match &ui.keystore {
                Some(dir) => dir.clone(),
                None => tpmcrypt_tpmkey::Keystore::default_dir()?,
            };
            return Ok(Target::Simulator(dir.join("simulator")));
        }
        Ok(Target::Tcti(match &ui.tpm {
            Some(t) => t.parse()?,
            None => Tcti::from_env()?,
        }))
    }
}

struct Conn {
    // Field order matters: the TPM context is closed before swtpm stops.
    tpm: Tpm,
    _simulator: Option<Simulator>,
}

/// A TPM connection opened on first use and shared by every identity of
/// one command, so N unwraps cost one connection (and one swtpm start).
pub struct TpmAccess {
    target: Target,
    conn: Mutex<Option<Conn>>,
    /// Time spent talking to the TPM (connecting included), for `-v`.
    busy: Mutex<std::time::Duration>,
}

impl TpmAccess {
    /// Nothing is opened yet.
    pub fn new(target: Target) -> Arc<TpmAccess> {
        Arc::new(TpmAccess {
            target,
            conn: Mutex::new(None),
            busy: Mutex::new(std::time::Duration::ZERO),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Option<Conn>> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the TPM, connecting (or starting the simulator) first.
    pub fn with<T>(
        &self,
        f: impl FnOnce(&mut Tpm) -> tpmcrypt_tpmkey::Result<T>,
    ) -> tpmcrypt_tpmkey::Result<T> {
        let mut guard = self.lock();
        let start = std::time::Instant::now();
        let result = (|| {
            if guard.is_none() {
                *guard = Some(self.connect()?);
            }
            match guard.as_mut() {
                Some(conn) => f(&mut conn.tpm),
                None => Err(tpmcrypt_tpmkey::Error::InvalidInput(
                    "no TPM connection".into(),
                )),
            }
        })();
        *self.busy.lock().unwrap_or_else(|e| e.into_inner()) += start.elapsed();
        result
    }

    /// Time spent talking to the TPM so far.
    pub fn busy(&self) -> std::time::Duration {
        *self.busy.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn connect(&self) -> tpmcrypt_tpmkey::Result<Conn> {
        match &self.target {
            Target::Tcti(tcti) => Ok(Conn {
                tpm: Tpm::open_tcti(tcti)?,
                _simulator: None,
            }),
            Target::Simulator(dir) => {
                eprintln!("tpmcrypt: using a software TPM (swtpm, state in {}): NOT secure, for trying the tool only", dir.display());
                let sim = Simulator::start(dir)?;
                let tpm = Tpm::open(&sim.tcti())?;
                Ok(Conn {
                    tpm,
                    _simulator: Some(sim),
                })
            }
        }
    }

    /// Unbind commands issued so far (0 if the TPM was never opened).
    pub fn unbind_count(&self) -> u64 {
        self.lock().as_ref().map_or(0, |c| c.tpm.unbind_count())
    }
}

/// Wrong PINs a run accepts for one key when the user types them: each
/// costs one dictionary-attack try. A PIN from `TPMCRYPT_PIN` is presented
/// once per key and run, since it would be wrong again.
pub const MAX_TYPED_PINS: u32 = 3;

/// What a run knows of one key's PIN.
enum PinState {
    /// Not asked yet, or asked again after a typed PIN was refused.
    Unknown { refused: u32 },
    /// The PIN to present.
    Known {
        pin: Zeroizing<Vec<u8>>,
        typed: bool,
        refused: u32,
    },
    /// Refused by the TPM, and not to be presented again in this run.
    Refused,
}

/// PINs per key name, asked for once per command. One the TPM refuses is
/// never presented again: a run over the files of many sessions costs one
/// dictionary-attack try for a wrong `TPMCRYPT_PIN`, and one per PIN typed
/// on a terminal (at most [`MAX_TYPED_PINS`]).
#[derive(Default)]
pub struct Pins {
    cache: Mutex<HashMap<String, PinState>>,
}

impl Pins {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, PinState>> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The PIN of the key `id` (named `name`): `TPMCRYPT_PIN`, else a
    /// prompt without echo.
    fn get(&self, id: &str, name: &str) -> tpmcrypt_tpmkey::Result<Zeroizing<Vec<u8>>> {
        let mut cache = self.lock();
        let refused = match cache.get(id) {
            Some(PinState::Known { pin, .. }) => return Ok(pin.clone()),
            Some(PinState::Refused) => {
                return Err(tpmcrypt_tpmkey::Error::PinRefusedBefore(name.to_string()))
            }
            Some(PinState::Unknown { refused }) => *refused,
            None => 0,
        };
        let typed = std::env::var_os(ENV_PIN).is_none();
        let prompt = if refused > 0 {
            format!(
                "Wrong PIN. PIN for key {name} (try {} of {MAX_TYPED_PINS}): ",
                refused + 1
            )
        } else {
            format!("PIN for key {name}: ")
        };
        let pin = read_pin(&prompt)?;
        cache.insert(
            id.to_string(),
            PinState::Known {
                pin: pin.clone(),
                typed,
                refused,
            },
        );
        Ok(pin)
    }

    /// The TPM refused the PIN of `name`: ask again next time if it was
    /// typed and tries are left, else never present one again. Returns
    /// whether another PIN may be asked for.
    fn refused(&self, name: &str) -> bool {
        let mut cache = self.lock();
        let next = match cache.get(name) {
            Some(PinState::Known {
                typed: true,
                refused,
                ..
            }) if refused + 1 < MAX_TYPED_PINS => PinState::Unknown {
                refused: refused + 1,
            },
            _ => PinState::Refused,
        };
        let again = matches!(next, PinState::Unknown { .. });
        cache.insert(name.to_string(), next);
        again
    }

    /// Marks `name` as not to be tried again in this run.
    fn give_up(&self, name: &str) {
        self.lock().insert(name.to_string(), PinState::Refused);
    }
}

/// Reads a PIN from `TPMCRYPT_PIN` or the terminal (no echo).
pub fn read_pin(prompt: &str) -> tpmcrypt_tpmkey::Result<Zeroizing<Vec<u8>>> {
    if let Some(pin) = std::env::var_os(ENV_PIN) {
        use std::os::unix::ffi::OsStrExt;
        return Ok(Zeroizing::new(pin.as_bytes().to_vec()));
    }
    let pin = rpassword::prompt_password(prompt).map_err(|e| {
        tpmcrypt_tpmkey::Error::PinUnavailable(format!(
            "this key needs a PIN: set {ENV_PIN} or run on a terminal ({e})"
        ))
    })?;
    Ok(Zeroizing::new(pin.into_bytes()))
}

fn external(e: tpmcrypt_tpmkey::Error) -> tpmcrypt_cipher::Error {
    tpmcrypt_cipher::Error::External(Box::new(e))
}

/// A keystore key with the TPM behind it.
struct TpmKey {
    name: String,
    /// What PINs are cached under: the key's public area, so that one key
    /// kept under two names shares one PIN budget.
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
    fn with_pin<T>(
        &self,
        op: impl Fn(&mut Tpm, Option<&[u8]>) -> tpmcrypt_tpmkey::Result<T>,
    ) -> tpmcrypt_tpmkey::Result<T> {
        use tpmcrypt_tpmkey::Error;
        if !self.has_pin {
            if self.pins.is_refused(&self.pin_id) {
                return Err(Error::PinRefusedBefore(self.name.clone()));
            }
            return self.access.with(|tpm| op(tpm, None)).map_err(|e| match e {
                Error::WrongPin => {
                    self.pins.give_up(&self.pin_id);
                    Error::PinUnavailable(format!(
                        "key {} was refused without a PIN: it has one, but is recorded as \
                         having none; re-import its key file with `tpmcrypt key import --pin`",
                        self.name
                    ))
                }
                other => other,
            });
        }
        loop {
            let pin = self.pins.get(&self.pin_id, &self.name)?;
            match self.access.with(|tpm| op(tpm, Some(&pin[..]))) {
                Err(Error::WrongPin) => {
                    if !self.pins.refused(&self.pin_id) {
                        return Err(Error::WrongPin);
                    }
                }
                other => return other,
            }
        }
    }
}

impl Pins {
    fn is_refused(&self, name: &str) -> bool {
        matches!(self.lock().get(name), Some(PinState::Refused))
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

/// A keystore key as a cipher identity; the TPM is touched only when a
/// stanza is addressed to it.
pub fn identity(
    name: &str,
    blob: KeyBlob,
    meta: &KeyMeta,
    access: &Arc<TpmAccess>,
    pins: &Arc<Pins>,
) -> anyhow::Result<Box<dyn Identity>> {
    use sha2::Digest;
    let key = TpmKey {
        name: name.to_string(),
        pin_id: hex::encode(sha2::Sha256::digest(&blob.public)),
        has_pin: meta.has_pin,
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
                .map_err(|_| anyhow::anyhow!("key {name}: unexpected public point length"))?;
            Box::new(P256Identity::new(kind::TPM_P256, TpmEcc { key, point })?)
        }
    })
}
