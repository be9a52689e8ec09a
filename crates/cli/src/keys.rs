//! Reading recipients (`-R`) and identities (`-i`) from the command line.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::io::Read as _;
use std::path::Path;

use anyhow::Context as _;
use tpmcrypt_cipher::recipient::{Identity, Recipient};
use tpmcrypt_cipher::recovery::{self, RecoveryKey};
use zeroize::Zeroizing;

use crate::ui::exit::usage;

/// Largest recipients file read: a list of recipients is a few KiB, and a
/// device such as /dev/zero must not be read forever.
pub(crate) const MAX_RECIPIENTS_FILE: u64 = 1 << 20;

/// One recipient named on the command line.
pub struct Given {
    /// The recipient.
    pub recipient: Box<dyn Recipient>,
    /// For a recovery recipient, its recipient string.
    pub recovery: Option<String>,
    /// Where it came from, for messages: the string, or `FILE: line N`.
    pub origin: String,
}

/// Whether `value` is `-`, standard input.
pub fn is_stdin(value: &OsStr) -> bool {
    value == "-"
}

/// Every recipient the `-R` values name (see [`read_recipients`]).
pub fn parse_recipients(values: &[OsString]) -> anyhow::Result<Vec<Box<dyn Recipient>>> {
    Ok(read_recipients(values)?
        .into_iter()
        .map(|g| g.recipient)
        .collect())
}

/// Reads every `-R` value: a recovery recipient string, `-` (a recipients
/// file on standard input, at most once), or a recipients file (see
/// [`tpmcrypt_cipher::recipients_file`]). A file is taken whole or refused
/// whole, naming the first line that does not parse; a file without any
/// recipient is refused too.
pub fn read_recipients(values: &[OsString]) -> anyhow::Result<Vec<Given>> {
    if values.iter().filter(|v| is_stdin(v)).count() > 1 {
        return Err(usage(
            "-R - (recipients from standard input) may be given only once",
        ));
    }
    let mut out = Vec::new();
    for value in values {
        if let Some(s) = value
            .to_str()
            .filter(|s| s.starts_with(recovery::RECIPIENT_PREFIX))
        {
            out.push(Given {
                recipient: Box::new(recovery::parse_recipient(s)?),
                recovery: Some(s.to_string()),
                origin: s.to_string(),
            });
            continue;
        }
        let (label, data) = read_recipients_file(value)?;
        let entries = tpmcrypt_cipher::recipients_file::parse(&data).map_err(|e| {
            anyhow::Error::new(e.error).context(format!("{label}: line {}", e.line))
        })?;
        if entries.is_empty() {
            return Err(usage(format!(
                "{label}: no recipient in this file (only comments and blank lines)"
            )));
        }
        out.extend(entries.into_iter().map(|e| Given {
            recipient: e.recipient,
            recovery: e.recovery,
            origin: format!("{label}: line {}", e.line),
        }));
    }
    Ok(out)
}

/// The contents of a recipients file (or of standard input for `-`) and
/// the name to show for it.
fn read_recipients_file(value: &OsStr) -> anyhow::Result<(String, Vec<u8>)> {
    let mut data = Vec::new();
    let label = if is_stdin(value) {
        crate::ui::stdout::ensure_stdin_open()?;
        let label = "<stdin>".to_string();
        std::io::stdin()
            .lock()
            .take(MAX_RECIPIENTS_FILE + 1)
            .read_to_end(&mut data)
            .with_context(|| label.clone())?;
        label
    } else {
        let path = Path::new(value);
        let label = path.display().to_string();
        let file = fs::File::open(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                usage(format!(
                    "recipient {label:?} is neither a {} string nor a file",
                    recovery::RECIPIENT_PREFIX
                ))
            } else {
                anyhow::Error::from(e).context(label.clone())
            }
        })?;
        file.take(MAX_RECIPIENTS_FILE + 1)
            .read_to_end(&mut data)
            .with_context(|| label.clone())?;
        label
    };
    if data.len() as u64 > MAX_RECIPIENTS_FILE {
        return Err(usage(format!(
            "{label}: larger than {} KiB: not a recipients file",
            MAX_RECIPIENTS_FILE >> 10
        )));
    }
    Ok((label, data))
}

/// Largest identity file read: a recovery identity is under 1 KiB, and a
/// device such as /dev/zero, or a large file given by mistake, must not be
/// read until memory runs out.
const MAX_IDENTITY_FILE: u64 = 1 << 20;

/// Loads one `-i` identity file.
pub fn load_identity(path: &Path) -> anyhow::Result<Box<dyn Identity>> {
    parse_identity(path, &read_identity_file(path)?)
}

/// The bytes of identity file `path` (at most [`MAX_IDENTITY_FILE`]).
pub fn read_identity_file(path: &Path) -> anyhow::Result<Zeroizing<Vec<u8>>> {
    let file = fs::File::open(path).with_context(|| path.display().to_string())?;
    read_identity(file, path)
}

/// The bytes of the identity file `path` open as `file`, at most
/// [`MAX_IDENTITY_FILE`]: a longer one is refused.
pub fn read_identity(file: impl std::io::Read, path: &Path) -> anyhow::Result<Zeroizing<Vec<u8>>> {
    let label = || path.display().to_string();
    // Room for any identity from the start, so that the buffer is never
    // moved, leaving a copy of the key behind.
    let mut bytes = Zeroizing::new(Vec::with_capacity(16 << 10));
    file.take(MAX_IDENTITY_FILE + 1)
        .read_to_end(&mut bytes)
        .with_context(label)?;
    if bytes.len() as u64 > MAX_IDENTITY_FILE {
        return Err(tpmcrypt_cipher::Error::InvalidIdentity(format!(
            "larger than {} KiB: not a tpmcrypt identity",
            MAX_IDENTITY_FILE >> 10
        )))
        .with_context(label);
    }
    Ok(bytes)
}

/// The identity in `bytes`, read from `path` (named in errors).
pub fn parse_identity(path: &Path, bytes: &[u8]) -> anyhow::Result<Box<dyn Identity>> {
    Ok(Box::new(recovery_key(path, bytes)?.into_identity()?))
}

/// The recovery key in identity file `bytes`, read from `path` (named in
/// errors).
pub fn recovery_key(path: &Path, bytes: &[u8]) -> anyhow::Result<RecoveryKey> {
    let label = || path.display().to_string();
    let text = std::str::from_utf8(bytes)
        .map_err(|_| {
            tpmcrypt_cipher::Error::InvalidIdentity(
                "not a text file (not a tpmcrypt identity)".into(),
            )
        })
        .with_context(label)?;
    RecoveryKey::parse(text).with_context(label)
}

/// Opens the keystore named by `--keystore`/`TPMCRYPT_HOME`, or the
/// default, and refuses one that another user could have written to.
pub fn keystore(ui: &crate::ui::Ui) -> anyhow::Result<tpmcrypt_tpmkey::Keystore> {
    let store = match &ui.keystore {
        Some(dir) => tpmcrypt_tpmkey::Keystore::open(dir)?,
        None => tpmcrypt_tpmkey::Keystore::open_default()?,
    };
    store.check_trusted()?;
    Ok(store)
}

/// The recipients a file encrypted to keystore key `name` gets (see
/// [`tpmcrypt_tpmkey::identity::key_recipients`]).
pub fn key_recipients(ui: &crate::ui::Ui, name: &str) -> anyhow::Result<Vec<Box<dyn Recipient>>> {
    let store = keystore_with(ui, name)?;
    Ok(tpmcrypt_tpmkey::identity::key_recipients(&store, name)?)
}

/// The trusted keystore (see [`keystore`]), if it holds a key `name`.
pub fn keystore_with(ui: &crate::ui::Ui, name: &str) -> anyhow::Result<tpmcrypt_tpmkey::Keystore> {
    let store = keystore(ui)?;
    tpmcrypt_tpmkey::keystore::validate_name(name)?;
    if !store.exists(name) {
        return Err(usage(format!(
            "no key named {name:?} in {}",
            store.dir().display()
        )));
    }
    Ok(store)
}

/// The keystore directory a decrypt reads its keys from, if there is one.
pub fn decrypt_keystore_dir(ui: &crate::ui::Ui) -> Option<std::path::PathBuf> {
    let dir = match &ui.keystore {
        Some(d) => d.clone(),
        None => tpmcrypt_tpmkey::Keystore::default_dir().ok()?,
    };
    dir.is_dir().then_some(dir)
}

/// Every key of the keystore as an identity (nothing is read from the TPM
/// until a file is addressed to one of them). An absent keystore is empty.
pub fn keystore_identities(
    ui: &crate::ui::Ui,
    access: &std::sync::Arc<tpmcrypt_tpmkey::identity::TpmAccess>,
) -> anyhow::Result<Vec<Box<dyn Identity>>> {
    // PIN files are checked first: a bad one is a usage error, whatever
    // the keystore holds.
    let pins = crate::pin::pins(ui)?;
    let Some(dir) = decrypt_keystore_dir(ui) else {
        return Ok(Vec::new());
    };
    // A keystore is a convenience here: one that cannot be trusted, or a
    // damaged key file, is named in a warning and left out, and never
    // blocks an identity given with -i (the way back when the TPM is gone).
    let warn = |what: String, e: &dyn std::fmt::Display| {
        let warning = crate::ui::colour::warning();
        stderr_line!("{warning} {what}: {}", crate::ui::printable(&e.to_string()));
    };
    let store = tpmcrypt_tpmkey::Keystore::open(&dir)?;
    match tpmcrypt_tpmkey::identity::keystore_identities(&store, access, &pins) {
        Ok(found) => {
            for (name, e) in &found.skipped {
                warn(format!("keystore key {name} skipped"), e);
            }
            Ok(found.identities)
        }
        Err(e) => {
            warn("not using the keystore".into(), &e);
            Ok(Vec::new())
        }
    }
}
