//! Reading recipients (`-R`) and identities (`-i`) from the command line.

use std::fs;
use std::path::Path;

use anyhow::Context as _;
use tpmcrypt_cipher::recipient::{self, Identity, Recipient};
use tpmcrypt_cipher::recovery::{self, RecoveryKey};
use zeroize::Zeroizing;

use crate::exit::usage;

/// Parses one `-R` value: a recovery recipient string, or a file holding
/// one or a PEM public key.
pub fn parse_recipient(value: &str) -> anyhow::Result<Box<dyn Recipient>> {
    if value.starts_with(recovery::RECIPIENT_PREFIX) {
        return Ok(Box::new(recovery::parse_recipient(value)?));
    }
    let path = Path::new(value);
    if !path.exists() {
        return Err(usage(format!(
            "recipient {value:?} is neither a {} string nor a file",
            recovery::RECIPIENT_PREFIX
        )));
    }
    let bytes = fs::read(path).with_context(|| value.to_string())?;
    let text = String::from_utf8_lossy(&bytes);
    if text.contains("-----BEGIN PUBLIC KEY-----") {
        return recipient::tpm_recipient_from_pem(&bytes).with_context(|| value.to_string());
    }
    let line = text
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with(recovery::RECIPIENT_PREFIX))
        .ok_or_else(|| {
            usage(format!(
                "{value}: no recipient string or PEM public key in this file"
            ))
        })?;
    Ok(Box::new(
        recovery::parse_recipient(line).with_context(|| value.to_string())?,
    ))
}

/// Loads one `-i` identity file.
pub fn load_identity(path: &Path) -> anyhow::Result<Box<dyn Identity>> {
    let label = || path.display().to_string();
    let bytes = Zeroizing::new(fs::read(path).with_context(label)?);
    let text = std::str::from_utf8(&bytes)
        .map_err(|_| {
            tpmcrypt_cipher::Error::InvalidIdentity(
                "not a text file (not a tpmcrypt identity)".into(),
            )
        })
        .with_context(label)?;
    let key = RecoveryKey::parse(text).with_context(label)?;
    Ok(Box::new(key.into_identity()?))
}

/// Opens the keystore named by `--keystore`/`TPMCRYPT_HOME`, or the default.
pub fn keystore(ui: &crate::Ui) -> anyhow::Result<tpmcrypt_tpmkey::Keystore> {
    Ok(match &ui.keystore {
        Some(dir) => tpmcrypt_tpmkey::Keystore::open(dir)?,
        None => tpmcrypt_tpmkey::Keystore::open_default()?,
    })
}

/// The recipients a file encrypted to keystore key `name` gets: the key's
/// public half (no TPM needed) and any recovery recipients recorded for it.
pub fn key_recipients(ui: &crate::Ui, name: &str) -> anyhow::Result<Vec<Box<dyn Recipient>>> {
    let store = keystore(ui)?;
    tpmcrypt_tpmkey::keystore::validate_name(name)?;
    let pub_path = store.pub_path(name);
    let pem = fs::read(&pub_path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            usage(format!(
                "no key named {name:?} in {}",
                store.dir().display()
            ))
        } else {
            anyhow::Error::from(e).context(pub_path.display().to_string())
        }
    })?;
    let mut recipients =
        vec![recipient::tpm_recipient_from_pem(&pem)
            .with_context(|| pub_path.display().to_string())?];
    let (_, meta) = store.load(name)?;
    for r in &meta.recovery {
        recipients.push(Box::new(
            recovery::parse_recipient(r)
                .with_context(|| format!("key {name}: recovery recipient"))?,
        ));
    }
    Ok(recipients)
}

/// Every key of the keystore as an identity (nothing is read from the TPM
/// until a file is addressed to one of them). An absent keystore is empty.
pub fn keystore_identities(
    ui: &crate::Ui,
    access: &std::sync::Arc<crate::tpm::TpmAccess>,
) -> anyhow::Result<Vec<Box<dyn Identity>>> {
    let dir = match &ui.keystore {
        Some(d) => d.clone(),
        None => match tpmcrypt_tpmkey::Keystore::default_dir() {
            Ok(d) => d,
            Err(_) => return Ok(Vec::new()),
        },
    };
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let store = tpmcrypt_tpmkey::Keystore::open(&dir)?;
    let pins = std::sync::Arc::new(crate::tpm::Pins::default());
    let mut out = Vec::new();
    for name in store.list()? {
        let (blob, meta) = store
            .load(&name)
            .with_context(|| format!("keystore key {name}"))?;
        out.push(crate::tpm::identity(&name, blob, &meta, access, &pins)?);
    }
    Ok(out)
}
