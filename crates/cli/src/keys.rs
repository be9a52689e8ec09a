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

/// Opens the keystore named by `--keystore`/`TPMCRYPT_HOME`, or the
/// default, and refuses one that another user could have written to.
pub fn keystore(ui: &crate::Ui) -> anyhow::Result<tpmcrypt_tpmkey::Keystore> {
    let store = match &ui.keystore {
        Some(dir) => tpmcrypt_tpmkey::Keystore::open(dir)?,
        None => tpmcrypt_tpmkey::Keystore::open_default()?,
    };
    store.check_trusted()?;
    Ok(store)
}

/// The recipients a file encrypted to keystore key `name` gets: the key's
/// public half, taken from its key file (no TPM needed) and checked against
/// `NAME.pub.pem`, and any recovery recipients recorded for it.
pub fn key_recipients(ui: &crate::Ui, name: &str) -> anyhow::Result<Vec<Box<dyn Recipient>>> {
    let store = keystore(ui)?;
    tpmcrypt_tpmkey::keystore::validate_name(name)?;
    if !store.exists(name) {
        return Err(usage(format!(
            "no key named {name:?} in {}",
            store.dir().display()
        )));
    }
    let (der, meta) = store.public_key_der(name)?;
    let pem = openssl::pkey::PKey::public_key_from_der(&der)
        .and_then(|k| k.public_key_to_pem())
        .with_context(|| store.key_path(name).display().to_string())?;
    let mut recipients = vec![recipient::tpm_recipient_from_pem(&pem)
        .with_context(|| store.key_path(name).display().to_string())?];
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
    // A keystore is a convenience here: one that cannot be trusted, or a
    // damaged key file, is named in a warning and left out, and never
    // blocks an identity given with -i (the way back when the TPM is gone).
    let warn = |what: String, e: &dyn std::fmt::Display| {
        eprintln!(
            "warning: {what}: {}",
            crate::files::printable(&e.to_string())
        );
    };
    let store = tpmcrypt_tpmkey::Keystore::open(&dir)?;
    if let Err(e) = store.check_trusted() {
        warn("not using the keystore".into(), &e);
        return Ok(Vec::new());
    }
    let names = match store.list() {
        Ok(names) => names,
        Err(e) => {
            warn("not using the keystore".into(), &e);
            return Ok(Vec::new());
        }
    };
    let pins = std::sync::Arc::new(crate::tpm::Pins::default());
    let mut out = Vec::new();
    for name in names {
        let identity = store
            .load(&name)
            .map_err(anyhow::Error::from)
            .and_then(|(blob, meta)| crate::tpm::identity(&name, blob, &meta, access, &pins));
        match identity {
            Ok(identity) => out.push(identity),
            Err(e) => warn(format!("keystore key {name} skipped"), &e),
        }
    }
    Ok(out)
}
