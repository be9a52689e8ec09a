//! `tpmcrypt key …`: create, import, list, show, export and delete TPM keys.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context as _;
use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;
use tpmcrypt_cipher::recipient::fingerprint_spki;
use tpmcrypt_tpmkey::{KeyAlg, KeyMeta, Keystore, PcrSelection};

use crate::keys;
use crate::ui::exit::usage;
use crate::ui::Ui;
use tpmcrypt_tpmkey::identity::Target;
use zeroize::Zeroizing;

/// `tpmcrypt key`.
#[derive(Subcommand, Debug)]
pub enum KeyCommand {
    /// Create a decryption key inside the TPM, under the storage root key.
    Create(CreateArgs),
    /// Import a `TSS2 PRIVATE KEY` PEM (e.g. written by tpm2_encodeobject).
    /// Only a key this TPM can unbind with is taken: an unrestricted
    /// decryption key (RSA-2048 with the NULL or OAEP-SHA256 scheme, P-256
    /// with NULL or ECDH) that loads under the standard storage key.
    Import {
        /// The key file.
        file: PathBuf,
        /// Name in the keystore (default: the file name without extensions).
        #[arg(long)]
        name: Option<String>,
        /// The key needs a PIN. Without --pin or --no-pin the key file's
        /// emptyAuth field decides; an explicit FALSE there is ambiguous
        /// (tpm2-tools up to 5.4 writes it for keys without a password) and
        /// is refused until you say which.
        #[arg(long, conflicts_with = "no_pin")]
        pin: bool,
        /// The key has no PIN (see --pin).
        #[arg(long)]
        no_pin: bool,
    },
    /// List keys.
    List {
        /// Print the keys as a JSON array on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Show one key.
    Show {
        /// Key name.
        name: String,
        /// Print the key as a JSON object on stdout (as one element of
        /// `key list --json`).
        #[arg(long)]
        json: bool,
    },
    /// Print a key's public half as PEM (for hosts that only encrypt).
    Export {
        /// Key name.
        name: String,
    },
    /// Attach signed PCR policies (tpmcrypt pcr sign -o FILE) to a key
    /// created with --pcr-signer; decrypt uses the one that holds.
    AddPolicy {
        /// Key name.
        name: String,
        /// Signed policy files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Delete a key. Files encrypted only to it become unreadable.
    Delete {
        /// Key name.
        name: String,
        /// Do not ask.
        #[arg(long)]
        yes: bool,
    },
}

/// Asks before a private key is destroyed: `--yes`, or a "y" typed on a
/// terminal. Without either (a script, no terminal) it is a usage error
/// naming what would be lost, so nothing is destroyed by accident.
pub fn confirm_destroy(what: &str, yes: bool) -> anyhow::Result<bool> {
    if yes {
        return Ok(true);
    }
    if !std::io::stdin().is_terminal() {
        return Err(usage(format!(
            "refusing to {what} without confirmation: add --yes"
        )));
    }
    confirm(&format!("{}? [y/N] ", capitalize(what)))
}

fn capitalize(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

/// Key algorithm.
#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum AlgArg {
    /// RSA-2048, unbound with TPM2_RSA_Decrypt (OAEP, SHA-256).
    Rsa2048,
    /// ECC P-256, unbound with TPM2_ECDH_ZGen (default; fast on real chips).
    EccP256,
}

/// `tpmcrypt key create`.
#[derive(Args, Debug)]
pub struct CreateArgs {
    /// Name of the key in the keystore.
    pub name: String,
    /// Key algorithm.
    #[arg(long, value_enum, default_value_t = AlgArg::EccP256)]
    pub alg: AlgArg,
    /// Seal the key's use to the current values of these PCRs, e.g. sha256:0,7.
    #[arg(long, value_name = "BANK:LIST", value_parser = crate::args::value::pcrs_value)]
    pub pcrs: Option<String>,
    /// Let the key be used under any PCR policy this signer signs (its
    /// public key, as pcr-signer create prints it) instead of fixing PCR
    /// values now; --pcrs names the PCRs its policies cover.
    #[arg(long, value_name = "FILE", requires = "pcrs")]
    pub pcr_signer: Option<PathBuf>,
    /// Require a PIN (from --pin-file, a systemd credential, TPMCRYPT_PIN,
    /// the terminal or TPMCRYPT_ASKPASS; see `decrypt --help`).
    #[arg(long)]
    pub pin: bool,
    /// Also encrypt every file for this key to recovery recipients
    /// (tpmcrypt-recovery:…, or a recipients file of them, "-" for stdin:
    /// every line counts). May be repeated.
    #[arg(long, value_name = "RECIPIENT")]
    pub recovery: Vec<std::ffi::OsString>,
    /// Replace an existing key of the same name, destroying it (asks
    /// first; --yes to confirm without a terminal).
    #[arg(short, long)]
    pub force: bool,
    /// With --force: destroy the existing key without asking.
    #[arg(long, requires = "force")]
    pub yes: bool,
}

/// Runs a key subcommand.
pub fn run(cmd: &KeyCommand, ui: &Ui) -> anyhow::Result<i32> {
    let store = keys::keystore(ui)?;
    match cmd {
        KeyCommand::Create(args) => create(args, ui, &store),
        KeyCommand::Import {
            file,
            name,
            pin,
            no_pin,
        } => import(&store, ui, file, name.as_deref(), (*pin, *no_pin)),
        KeyCommand::List { json } => list(&store, *json),
        KeyCommand::Show { name, json: true } => {
            let info = describe(&store, name)?;
            crate::ui::stdout::line(&serde_json::to_string_pretty(&info)?)?;
            Ok(crate::ui::exit::OK)
        }
        KeyCommand::Show { name, json: false } => show(&store, name),
        KeyCommand::Export { name } => {
            let (blob, _) = store.load(name)?;
            crate::ui::stdout::write_all(blob.public_key_pem()?.as_bytes())?;
            Ok(crate::ui::exit::OK)
        }
        KeyCommand::Delete { name, yes } => delete(&store, name, *yes),
        KeyCommand::AddPolicy { name, files } => {
            crate::commands::pcr::add_policies(&store, name, files)
        }
    }
}

fn default_name(file: &std::path::Path) -> anyhow::Result<String> {
    // The bytes before the first dot; a stem that is not UTF-8 gives no
    // key name (never one with U+FFFD standing in for its bytes).
    let base = file
        .file_name()
        .map(|f| f.as_encoded_bytes())
        .unwrap_or_default();
    let stem = base.split(|&b| b == b'.').next().unwrap_or_default();
    let stem = std::str::from_utf8(stem).unwrap_or_default().to_string();
    if stem.is_empty() {
        return Err(usage(
            "cannot derive a key name from the file name; use --name",
        ));
    }
    Ok(stem)
}

/// "a key named … exists already": exit 1 (the command line was fine).
fn exists_already(name: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "a key named {name:?} exists already (to destroy it and create a new one: key create \
         {name} --force; files encrypted only to it become unreadable)"
    )
}

/// Whether an imported key needs a PIN: --pin/--no-pin, else the key
/// file's emptyAuth field where it is unambiguous. A key imported the wrong
/// way costs a dictionary-attack try at its first use, so an explicit
/// FALSE (which tpm2-tools up to 5.4 writes for keys without a password)
/// is refused until the user says which.
fn import_has_pin(
    file: &std::path::Path,
    pem: &str,
    pin: bool,
    no_pin: bool,
) -> anyhow::Result<bool> {
    if pin || no_pin {
        return Ok(pin);
    }
    match tpmcrypt_tpmkey::KeyBlob::declared_empty_auth(pem)
        .with_context(|| file.display().to_string())?
    {
        Some(true) => Ok(false),
        None => Ok(true),
        Some(false) => Err(usage(format!(
            "{}: the key file says the key needs a password (emptyAuth FALSE), but tpm2-tools \
             up to 5.4 writes that for keys without one; say which with --pin or --no-pin (a \
             wrong guess costs a dictionary-attack try at first use)",
            file.display()
        ))),
    }
}

fn confirm(prompt: &str) -> anyhow::Result<bool> {
    stderr_text!("{prompt}");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}

/// `key import FILE`: records a TPM key file in the keystore once the
/// TPM shows it loads there.
fn import(
    store: &Keystore,
    ui: &Ui,
    file: &Path,
    name: Option<&str>,
    pin_flags: (bool, bool),
) -> anyhow::Result<i32> {
    // Nothing is imported that could not be reported.
    crate::ui::stdout::ensure_open()?;
    let (pin, no_pin) = pin_flags;
    let name = match name {
        Some(n) => n.to_string(),
        None => default_name(file)?,
    };
    tpmcrypt_tpmkey::keystore::validate_name(&name)?;
    if store.exists(&name) {
        return Err(exists_already(&name));
    }
    // Read once, and at most a key file's size (`/dev/zero` was read
    // until memory ran out).
    let pem = String::from_utf8(crate::ui::read_small(file, "a TPM key file")?)
        .map_err(|_| usage(format!("{}: not a PEM key file", crate::ui::shown(file))))?;
    // A key tpmcrypt could never unbind with is refused before
    // anything else is asked; the TPM then shows that it loads the
    // key under the standard storage key.
    tpmcrypt_tpmkey::KeyBlob::from_pem(&pem)
        .map_err(|e| usage(format!("{}: {e}", crate::ui::shown(file))))?;
    let has_pin = Some(import_has_pin(file, &pem, pin, no_pin)?);
    let access = crate::tpm::access(ui)?;
    let (blob, meta) = store
        .import_checked(&name, &pem, has_pin, |blob| {
            access.with(|tpm| tpm.check_loads(blob))
        })
        .with_context(|| file.display().to_string())?;
    let fp = hex::encode(fingerprint_spki(&blob.public_key_der()?));
    crate::ui::stdout::line(&format!("imported {name} ({}), fingerprint {fp}", meta.alg))
        .context(format!("key {name} was imported; only its report failed"))?;
    for other in store.list()?.iter().filter(|n| **n != name) {
        if describe(store, other).is_ok_and(|k| k.fingerprint == fp) {
            stderr_line!(
                "{} key {other} is the same TPM key (fingerprint {fp}); one key \
                 under two names shares one PIN",
                crate::ui::colour::warning()
            );
        }
    }
    Ok(crate::ui::exit::OK)
}

/// `key show NAME`: one field a line.
fn show(store: &Keystore, name: &str) -> anyhow::Result<i32> {
    let info = describe(store, name)?;
    crate::ui::stdout::line(&format!("name:        {}", info.name))?;
    crate::ui::stdout::line(&format!("algorithm:   {}", info.alg))?;
    crate::ui::stdout::line(&format!("fingerprint: {}", info.fingerprint))?;
    crate::ui::stdout::line(&format!(
        "pcrs:        {}",
        info.pcrs.as_deref().unwrap_or("none")
    ))?;
    if let Some(line) = crate::commands::pcr::show_signer(store, name)? {
        crate::ui::stdout::line(&line)?;
    }
    crate::ui::stdout::line(&format!(
        "pin:         {}",
        if info.pin { "yes" } else { "no" }
    ))?;
    crate::ui::stdout::line(&format!("created:     {}", info.created))?;
    crate::ui::stdout::line(&format!(
        "tpm:         {}",
        info.tpm.as_deref().unwrap_or("unknown")
    ))?;
    crate::ui::stdout::line(&format!(
        "simulator:   {}",
        if info.simulator {
            "yes (NOT secure)"
        } else {
            "no"
        }
    ))?;
    for r in &info.recovery {
        crate::ui::stdout::line(&format!("recovery:    {r}"))?;
    }
    crate::ui::stdout::line(&format!("key file:    {}", store.key_path(name).display()))?;
    crate::ui::stdout::line(&format!("public key:  {}", store.pub_path(name).display()))?;
    Ok(crate::ui::exit::OK)
}

/// `key delete NAME`: after a confirmation (or `--yes`).
fn delete(store: &Keystore, name: &str, yes: bool) -> anyhow::Result<i32> {
    // Nothing is done that could not be reported.
    crate::ui::stdout::ensure_open()?;
    if !store.exists(name) {
        // A delete cut short left the public key or metadata: nothing to
        // confirm (the key file, the only thing of value, is gone).
        if store.has_leftovers(name) {
            store.delete_leftovers(name)?;
            crate::ui::stdout::line(&format!(
                "deleted what was left of {name} (its key file was gone)"
            ))?;
            return Ok(crate::ui::exit::OK);
        }
        return Err(usage(format!("no key named {name:?}")));
    }
    if !confirm_destroy(
        &format!(
            "delete key {name} (files encrypted only to it, not to a recovery \
             recipient, become unreadable)"
        ),
        yes,
    )? {
        stderr_line!("not deleted");
        return Ok(crate::ui::exit::OTHER);
    }
    store.delete(name)?;
    let said = crate::ui::stdout::line(&format!("deleted {name}"))
        .context(format!("key {name} was deleted; only its report failed"));
    // The agent keeps session keys by file or by encryption scope, not by
    // key: those it holds (unwrapped for a decrypt, or a shared encryption
    // session's) still open files of the deleted key until they expire.
    let agent =
        tpmcrypt_tpmkey::agent::AgentClient::checked(&tpmcrypt_tpmkey::agent::socket_path());
    if let Ok(Some(client)) = agent {
        if client
            .held()
            .is_ok_and(|held| held.secrets > 0 || held.sessions.is_some_and(|n| n > 0))
        {
            stderr_line!(
                "tpmcrypt: note: the running agent still holds session keys, some of which may \
                 open files of {name} until they expire; `tpmcrypt agent --stop` wipes them now"
            );
        }
    }
    said?;
    Ok(crate::ui::exit::OK)
}

/// `--recovery` values: recovery recipients only.
fn recovery_recipients(values: &[std::ffi::OsString]) -> anyhow::Result<Vec<String>> {
    keys::read_recipients(values)?
        .into_iter()
        .map(|given| {
            given.recovery.ok_or_else(|| {
                usage(format!(
                    "{}: --recovery takes recovery recipients (tpmcrypt-recovery:…), not a TPM \
                     public key",
                    given.origin
                ))
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()
}

/// `--pin`: the new key's PIN (see [`crate::pin::new_pin`]).
fn new_pin(args: &CreateArgs, ui: &Ui) -> anyhow::Result<Option<Zeroizing<Vec<u8>>>> {
    if !args.pin {
        if ui.pin_file.is_some() {
            // Without --pin the key would get no PIN at all.
            return Err(usage(
                "--pin-file gives a PIN, but the key would be made without one: add --pin",
            ));
        }
        return Ok(None);
    }
    crate::pin::new_pin(ui, &args.name).map(Some)
}

fn create(args: &CreateArgs, ui: &Ui, store: &Keystore) -> anyhow::Result<i32> {
    // Nothing is made that could not be reported.
    crate::ui::stdout::ensure_open()?;
    tpmcrypt_tpmkey::keystore::validate_name(&args.name)?;
    if store.exists(&args.name) {
        if !args.force {
            return Err(exists_already(&args.name));
        }
        let what = format!(
            "destroy the existing key {name} (its private half exists only in this TPM, so \
             files encrypted only to it, not to a recovery recipient, become unreadable)",
            name = args.name
        );
        if !confirm_destroy(&what, args.yes)? {
            stderr_line!("key {} kept", args.name);
            return Ok(crate::ui::exit::OTHER);
        }
    }
    let pcrs = args.pcrs.as_deref().map(PcrSelection::parse).transpose()?;
    // Recovery recipients are checked before the (slow) TPM work.
    let recovery = recovery_recipients(&args.recovery)?;
    let signer = args
        .pcr_signer
        .as_deref()
        .map(crate::commands::pcr::read_signer)
        .transpose()?;
    let pin = new_pin(args, ui)?;
    let alg = match args.alg {
        AlgArg::Rsa2048 => KeyAlg::Rsa2048,
        AlgArg::EccP256 => KeyAlg::EccP256,
    };
    let simulator = matches!(crate::tpm::target(ui)?, Target::Simulator(_));
    let access = crate::tpm::access(ui)?;
    let (blob, elapsed, info, srk_name) = access.with(|tpm| {
        let info = tpm.info()?;
        let srk_name = tpm.srk_name()?;
        let start = Instant::now();
        let pin = pin.as_deref().map(|p| &p[..]);
        let blob = crate::commands::pcr::create_key(tpm, alg, pcrs.as_ref(), signer.as_ref(), pin)?;
        Ok((blob, start.elapsed(), info, srk_name))
    })?;
    let mut meta = KeyMeta::for_key(&args.name, &blob)?;
    meta.srk_name = Some(srk_name);
    meta.tpm = Some(format!(
        "{} {} firmware {}",
        info.manufacturer, info.vendor, info.firmware_version
    ));
    meta.simulator = simulator || info.is_simulator;
    meta.recovery = recovery;
    if signer.is_some() {
        meta.pcrs = pcrs.as_ref().map(|s| s.to_string());
    }
    store.save(&args.name, &blob, &meta, args.force)?;
    let fp = hex::encode(fingerprint_spki(&blob.public_key_der()?));
    crate::ui::stdout::line(&format!(
        "created key {} ({}) in {:.3} s on {} {}; fingerprint {fp}",
        args.name,
        alg.as_str(),
        elapsed.as_secs_f64(),
        info.manufacturer,
        if meta.simulator {
            "(software TPM: NOT secure)"
        } else {
            ""
        }
    ))
    .and_then(|()| {
        crate::ui::stdout::line(&format!(
            "public key: {}",
            store.pub_path(&args.name).display()
        ))
    })
    .context(format!(
        "key {} was created; only its report failed",
        args.name
    ))?;
    if meta.recovery.is_empty() {
        stderr_line!(
            "hint: without --recovery, files for this key die with this TPM; see README (Recovery)"
        );
    }
    Ok(crate::ui::exit::OK)
}

#[derive(Serialize)]
struct KeyInfo {
    name: String,
    alg: String,
    fingerprint: String,
    pcrs: Option<String>,
    pin: bool,
    /// RFC 3339.
    created: String,
    tpm: Option<String>,
    simulator: bool,
    recovery: Vec<String>,
}

fn describe(store: &Keystore, name: &str) -> anyhow::Result<KeyInfo> {
    let (blob, meta) = store.load(name)?;
    Ok(KeyInfo {
        name: name.to_string(),
        alg: meta.alg.clone(),
        fingerprint: hex::encode(fingerprint_spki(&blob.public_key_der()?)),
        pcrs: meta.pcrs.clone(),
        pin: meta.has_pin,
        created: crate::ui::rfc3339_unix(meta.created),
        tpm: meta.tpm.clone(),
        simulator: meta.simulator,
        recovery: meta.recovery.clone(),
    })
}

fn list(store: &Keystore, json: bool) -> anyhow::Result<i32> {
    // A damaged or untrusted key file is named in a warning; the others
    // are listed.
    let mut infos = Vec::new();
    for name in store.list()? {
        match describe(store, &name) {
            Ok(info) => infos.push(info),
            Err(e) => stderr_line!(
                "{} key {name} skipped: {}",
                crate::ui::colour::warning(),
                crate::ui::printable(&format!("{e:#}"))
            ),
        }
    }
    if json {
        crate::ui::stdout::line(&serde_json::to_string_pretty(&infos)?)?;
    } else if infos.is_empty() {
        stderr_line!("no keys in {}", store.dir().display());
    } else {
        crate::ui::stdout::line(&format!(
            "{:<20} {:<9} {:<32} {:<12} {:<4} RECOVERY",
            "NAME", "ALG", "FINGERPRINT", "PCRS", "PIN"
        ))?;
        for k in infos {
            crate::ui::stdout::line(&format!(
                "{:<20} {:<9} {:<32} {:<12} {:<4} {}",
                k.name,
                k.alg,
                k.fingerprint,
                k.pcrs.as_deref().unwrap_or("-"),
                if k.pin { "yes" } else { "no" },
                k.recovery.len()
            ))?;
        }
    }
    Ok(crate::ui::exit::OK)
}

#[cfg(test)]
mod tests {
    use super::default_name;
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt as _;
    use std::path::Path;

    #[test]
    fn a_key_name_is_taken_from_the_bytes_before_the_first_dot() {
        let name = |b: &[u8]| default_name(Path::new(OsStr::from_bytes(b))).ok();
        assert_eq!(name(b"dir/work.key.pem").as_deref(), Some("work"));
        assert_eq!(name(b"work.\xff.pem").as_deref(), Some("work"));
        assert_eq!(name(b"w\xffrk.pem"), None, "never a name with U+FFFD in it");
        assert_eq!(name(b".pem"), None);
    }
}
