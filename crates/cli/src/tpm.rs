//! The CLI's side of the TPM: which TPM the global flags name (PINs come
//! from [`crate::pin`]). Keys as identities live in
//! [`tpmcrypt_tpmkey::identity`]. Encrypting never comes here: it needs
//! only public keys.

use std::sync::Arc;

use tpmcrypt_tpmkey::identity::{Target, TpmAccess};
use tpmcrypt_tpmkey::{tcti, Tcti, TctiSource};

use crate::ui::Ui;

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
            stderr_line!(
                "tpmcrypt: using a software TPM (swtpm, state in {}): NOT secure, for trying the tool only",
                dir.display()
            )
        })),
    ))
}
