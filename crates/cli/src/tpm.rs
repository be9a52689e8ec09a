//! The CLI's side of the TPM: which TPM the global flags name, and PINs
//! from `TPMCRYPT_PIN` or the terminal. Keys as identities live in
//! [`tpmcrypt_tpmkey::identity`]. Encrypting never comes here: it needs
//! only public keys.

use std::sync::Arc;

use tpmcrypt_tpmkey::identity::{Pin, PinSource, Pins, Target, TpmAccess, MAX_TYPED_PINS};
use tpmcrypt_tpmkey::{tcti, Tcti, TctiSource};
use zeroize::Zeroizing;

use crate::ui::Ui;

/// Environment variable holding a key's PIN (instead of a prompt).
pub const ENV_PIN: &str = "TPMCRYPT_PIN";

/// Which TPM to use, from `--tpm`/`TPMCRYPT_TCTI` and `--simulator`.
pub fn target(ui: &Ui) -> anyhow::Result<Target> {
    chosen(ui).map(|(target, _)| target)
}

/// How [`chosen`] chose the TPM, as the user named it: `--simulator`,
/// `--tpm`, an environment variable, or `default`.
pub fn source_name(source: TctiSource) -> &'static str {
    match source {
        TctiSource::Given => "--tpm",
        TctiSource::Env(name) => name,
        TctiSource::Default => "default",
    }
}

/// Which TPM to use and what chose it: `--simulator`, else `--tpm` >
/// `TPMCRYPT_TCTI` > `TPM2TOOLS_TCTI` > `TSS2_TCTI` > `device:/dev/tpmrm0`.
pub fn chosen(ui: &Ui) -> anyhow::Result<(Target, &'static str)> {
    if ui.simulator {
        // Not checked here: the keystore's own users check it (and a
        // decrypt that leaves an untrusted keystore out never starts
        // the simulator), so `-i` still works beside one.
        let dir = match &ui.keystore {
            Some(dir) => dir.clone(),
            None => tpmcrypt_tpmkey::Keystore::default_dir()?,
        };
        return Ok((Target::Simulator(dir.join("simulator")), "--simulator"));
    }
    let (tcti, source) = match &ui.tpm {
        Some(t) if ui.tpm_from_env => (t.parse()?, TctiSource::Env(tcti::ENV_TCTI)),
        Some(t) => (t.parse()?, TctiSource::Given),
        // A TPM2TOOLS_TCTI/TSS2_TCTI we cannot use is a usage error, as a
        // bad --tpm/TPMCRYPT_TCTI is.
        None => Tcti::from_env_with_source().map_err(|e| match e {
            tpmcrypt_tpmkey::Error::InvalidInput(why) => crate::ui::exit::usage(why),
            other => other.into(),
        })?,
    };
    Ok((Target::Tcti(tcti), source_name(source)))
}

/// The TPM `access` opens and what chose it, for `-v`:
/// `swtpm:host=…,port=… (from TPM2TOOLS_TCTI)`.
pub fn describe(ui: &Ui, access: &TpmAccess) -> String {
    let by = chosen(ui).map_or("?", |(_, by)| by);
    match access.target() {
        Target::Tcti(t) => format!("{t} (from {by})"),
        Target::Simulator(dir) => format!(
            "a software TPM, state in {} (from {by})",
            crate::ui::shown(dir)
        ),
    }
}

/// The TPM the global flags name, opened on first use; starting the
/// simulator is announced on stderr.
pub fn access(ui: &Ui) -> anyhow::Result<Arc<TpmAccess>> {
    Ok(TpmAccess::with_notice(
        target(ui)?,
        Some(Box::new(|dir| {
            eprintln!(
                "tpmcrypt: using a software TPM (swtpm, state in {}): NOT secure, for trying the tool only",
                dir.display()
            )
        })),
    ))
}

/// PINs from `TPMCRYPT_PIN` (presented once: it would be wrong again) or
/// typed on the terminal without echo (asked again after a refusal).
struct EnvOrTerminal;

impl PinSource for EnvOrTerminal {
    fn pin(&self, name: &str, refused: u32) -> tpmcrypt_tpmkey::Result<Pin> {
        let prompt = if refused > 0 {
            format!(
                "Wrong PIN. PIN for key {name} (try {} of {MAX_TYPED_PINS}): ",
                refused + 1
            )
        } else {
            format!("PIN for key {name}: ")
        };
        Ok(Pin {
            may_retry: std::env::var_os(ENV_PIN).is_none(),
            secret: read_pin(&prompt)?,
        })
    }
}

/// The run's PIN budget over `TPMCRYPT_PIN` and the terminal.
pub fn pins() -> Arc<Pins> {
    Arc::new(Pins::new(Box::new(EnvOrTerminal)))
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
