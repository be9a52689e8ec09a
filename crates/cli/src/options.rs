//! The one option-resolution layer: flags as parsed (`args::value`, each
//! command's own args) become what the libraries take — recipients,
//! identities, [`Params`], a worker count, a backend — checked once, the
//! same way for `encrypt`, `decrypt` and `watch`.
//!
//! The parts are separate functions, not one constructor, because the
//! commands resolve them at different moments (an encrypt checks its
//! backend only once its inputs are planned, and a watch has no backend
//! flag), and the order in which errors are found is part of the
//! behaviour.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use tpmcrypt_cipher::recipient::{Identity, Recipient};
use tpmcrypt_cipher::{backend, Mode, Params};
use tpmcrypt_tpmkey::identity::TpmAccess;

use crate::args::value::{BackendArg, BitsArg, ModeArg};
use crate::keys;
use crate::ui::exit::usage;
use crate::ui::Ui;

/// The library's mode for `--mode`.
pub fn mode(arg: ModeArg) -> Mode {
    match arg {
        ModeArg::Gcm => Mode::Gcm,
        ModeArg::Cbc => Mode::Cbc,
    }
}

/// `--mode`, `--bits` and `--segment-size` as the cipher's parameters
/// (a combination the format refuses is its error).
pub fn params(
    mode_arg: ModeArg,
    bits: BitsArg,
    segment_size: Option<u32>,
) -> anyhow::Result<Params> {
    let mut params = Params::new(mode(mode_arg), bits.bits())?;
    if let Some(size) = segment_size {
        params = params.with_segment_size(size)?;
    }
    Ok(params)
}

/// The flags that name who a file is encrypted to.
pub struct RecipientFlags<'a> {
    /// `-R` values: recipient strings and recipients files (`-` is stdin).
    pub recipients: &'a [OsString],
    /// `-k` names of keystore keys.
    pub keys: &'a [String],
    /// Whether the plaintext is read from standard input, which `-R -`
    /// then cannot read too.
    pub plaintext_from_stdin: bool,
}

/// Every recipient `-R` and `-k` name, `-R` first.
pub fn recipients(ui: &Ui, flags: &RecipientFlags<'_>) -> anyhow::Result<Vec<Box<dyn Recipient>>> {
    if flags.plaintext_from_stdin && flags.recipients.iter().any(|r| keys::is_stdin(r)) {
        return Err(usage(
            "-R - reads the recipients from standard input, so the plaintext cannot come \
             from it too: name the input files",
        ));
    }
    let mut recipients = keys::parse_recipients(flags.recipients)?;
    for name in flags.keys {
        recipients.extend(keys::key_recipients(ui, name)?);
    }
    Ok(recipients)
}

/// What a decrypt unwraps session keys with.
pub struct Identities {
    /// The `-i` files, then the keystore's keys.
    pub list: Vec<Box<dyn Identity>>,
    /// The TPM the keystore's keys use (opened on first use).
    pub access: Arc<TpmAccess>,
}

/// Every identity a decrypt may use: the `-i` files, then the keystore's
/// keys (through the TPM the global flags name, opened on first use).
/// None at all is a usage error.
pub fn identities(ui: &Ui, files: &[PathBuf]) -> anyhow::Result<Identities> {
    identities_read(ui, &read_identity_files(files)?)
}

/// `-i` identity files, each read once (a pipe, `<(cmd)`, has nothing
/// left for a second read), with their paths.
pub type IdentityFiles = Vec<(PathBuf, zeroize::Zeroizing<Vec<u8>>)>;

/// Reads `-i` identity files (see [`IdentityFiles`]).
pub fn read_identity_files(files: &[PathBuf]) -> anyhow::Result<IdentityFiles> {
    files
        .iter()
        .map(|p| Ok((p.clone(), keys::read_identity_file(p)?)))
        .collect()
}

/// [`identities`] of files already read.
pub fn identities_read(ui: &Ui, files: &IdentityFiles) -> anyhow::Result<Identities> {
    let mut identities = files
        .iter()
        .map(|(p, bytes)| keys::parse_identity(p, bytes))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let access = crate::tpm::access(ui)?;
    identities.extend(keys::keystore_identities(ui, &access)?);
    if identities.is_empty() {
        return Err(usage(
            "no identity: give -i IDENTITY, or create a TPM key with `tpmcrypt key create`",
        ));
    }
    Ok(Identities {
        list: identities,
        access,
    })
}

/// The number of CPUs, the default worker count. Looked up on first use
/// only (it reads cgroup files): a run over one small file never needs it.
pub fn default_workers() -> usize {
    static CPUS: OnceLock<usize> = OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Most workers `-j` and `--workers` accept: each is a thread with a
/// segment buffer (1 MiB, up to 16), so a larger number only costs memory
/// and start-up, and a number near the largest integer hung the engine
/// (its buffer count wrapped around).
pub const MAX_WORKERS: usize = 1024;

/// Parses `-j N` / `--workers N`: 1 to [`MAX_WORKERS`].
pub fn parse_workers(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=MAX_WORKERS).contains(&n) => Ok(n),
        _ => Err(format!("must be a whole number from 1 to {MAX_WORKERS}")),
    }
}

/// `-j`/`--workers`, or one worker per CPU.
pub fn workers(given: Option<usize>) -> usize {
    given.unwrap_or_else(default_workers)
}

/// `--backend`, if given, checked against what it must do: with
/// `params`, to encrypt in that mode and key size (decrypting reads both
/// from each file's header, and the engine checks there).
pub fn backend(
    arg: Option<BackendArg>,
    params: Option<&Params>,
) -> anyhow::Result<Option<Arc<dyn backend::Backend>>> {
    let Some(arg) = arg else {
        return Ok(None);
    };
    let b = backend::by_name(arg.name())?;
    if let Some(params) = params {
        let mode = params.mode;
        if (mode == Mode::Cbc && !b.supports_cbc())
            || !b.supports_gcm(params.key_len) && mode == Mode::Gcm
        {
            return Err(usage(format!(
                "backend {} does not support {} with {}-bit keys",
                b.name(),
                mode.name(),
                params.key_bits()
            )));
        }
    }
    Ok(Some(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_become_params() {
        let p = params(ModeArg::Cbc, BitsArg::B128, Some(1 << 16)).unwrap();
        assert_eq!((p.mode, p.key_bits()), (Mode::Cbc, 128));
        assert!(params(ModeArg::Gcm, BitsArg::B256, Some(10)).is_err());
    }

    #[test]
    fn a_backend_that_cannot_do_the_params_is_a_usage_error() {
        let p = params(ModeArg::Cbc, BitsArg::B256, None).unwrap();
        let err = backend(Some(BackendArg::Ring), Some(&p))
            .err()
            .expect("ring has no cbc");
        assert_eq!(crate::ui::exit::code_for(&err), crate::ui::exit::USAGE);
        assert_eq!(
            err.to_string(),
            "backend ring does not support cbc with 256-bit keys"
        );
        assert!(backend(Some(BackendArg::Ring), None).unwrap().is_some());
        assert!(backend(None, Some(&p)).unwrap().is_none());
    }

    #[test]
    fn workers_default_to_the_cpus() {
        assert_eq!(workers(Some(3)), 3);
        assert!(workers(None) >= 1);
        assert_eq!(workers(None), default_workers());
    }
}
