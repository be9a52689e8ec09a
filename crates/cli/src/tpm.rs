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
            let store = crate::keys::keystore(ui)?;
            return Ok(Target::Simulator(store.dir().join("simulator")));
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
}

impl TpmAccess {
    /// Nothing is opened yet.
    pub fn new(target: Target) -> Arc<TpmAccess> {
        Arc::new(TpmAccess {
            target,
            conn: Mutex::new(None),
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
        if guard.is_none() {
            *guard = Some(self.connect()?);
        }
        match guard.as_mut() {
            Some(conn) => f(&mut conn.tpm),
            None => Err(tpmcrypt_tpmkey::Error::InvalidInput(
                "no TPM connection".into(),
            )),
        }
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

/// PINs per key name, asked for once per command.
#[derive(Default)]
pub struct Pins {
    cache: Mutex<HashMap<String, Zeroizing<Vec<u8>>>>,
}

impl Pins {
    /// The PIN of key `name`: `TPMCRYPT_PIN`, else a prompt without echo.
    pub fn get(&self, name: &str) -> tpmcrypt_tpmkey::Result<Zeroizing<Vec<u8>>> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pin) = cache.get(name) {
            return Ok(pin.clone());
        }
        let pin = read_pin(&format!("PIN for key {name}: "))?;
        cache.insert(name.to_string(), pin.clone());
        Ok(pin)
    }
}

/// Reads a PIN from `TPMCRYPT_PIN` or the terminal (no echo).
pub fn read_pin(prompt: &str) -> tpmcrypt_tpmkey::Result<Zeroizing<Vec<u8>>> {
    if let Some(pin) = std::env::var_os(ENV_PIN) {
        use std::os::unix::ffi::OsStrExt;
        return Ok(Zeroizing::new(pin.as_bytes().to_vec()));
    }
    let pin = rpassword::prompt_password(prompt).map_err(|e| {
        tpmcrypt_tpmkey::Error::InvalidInput(format!(
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
    blob: KeyBlob,
    has_pin: bool,
    access: Arc<TpmAccess>,
    pins: Arc<Pins>,
}

impl TpmKey {
    fn pin(&self) -> tpmcrypt_tpmkey::Result<Option<Zeroizing<Vec<u8>>>> {
        if self.has_pin {
            self.pins.get(&self.name).map(Some)
        } else {
            Ok(None)
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
        let pin = self.key.pin().map_err(external)?;
        self.key
            .access
            .with(|tpm| tpm.rsa_decrypt(&self.key.blob, pin.as_deref().map(|p| &p[..]), ciphertext))
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
        let pin = self.key.pin().map_err(external)?;
        self.key
            .access
            .with(|tpm| tpm.ecdh_zgen(&self.key.blob, pin.as_deref().map(|p| &p[..]), peer))
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
    let key = TpmKey {
        name: name.to_string(),
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
