//! The CLI's side of the TPM: which TPM the global flags name (PINs come
//! from [`crate::pin`]). Keys as identities live in
//! [`tpmcrypt_tpmkey::identity`]. Encrypting never comes here: it needs
//! only public keys.

use std::sync::Arc;

use tpmcrypt_tpmkey::identity::{Target, TpmAccess};
use tpmcrypt_tpmkey::Tcti;

use crate::ui::Ui;

/// Which TPM to use, from `--tpm`/`TPMCRYPT_TCTI` and `--simulator`.
pub fn target(ui: &Ui) -> anyhow::Result<Target> {
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
