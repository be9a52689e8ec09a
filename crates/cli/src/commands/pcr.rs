//! Signed PCR policies: `tpmcrypt pcr-signer create`, `tpmcrypt pcr sign`,
//! `tpmcrypt key add-policy` and `key create --pcr-signer` (the TPM and
//! key-file side lives in `tpmcrypt_tpmkey::signed`; docs/signed-policies.md).

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::{Args, Subcommand};
use tpmcrypt_tpmkey::signed::{digest_len, PcrSigner, SignedPolicy, SignerPublic};
use tpmcrypt_tpmkey::{KeyAlg, KeyBlob, Keystore, PcrSelection, Tpm};

use crate::ui::exit::usage;
use crate::ui::Ui;

/// `tpmcrypt pcr-signer`.
#[derive(Subcommand, Debug)]
pub enum PcrSignerCommand {
    /// Make a PCR signer: an ECDSA P-256 key that signs PCR policies. The
    /// private key goes to --out (mode 0600; keep it offline or on the
    /// build host), the public key is printed (for key create --pcr-signer).
    Create {
        /// Where to write the private key (must not exist).
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
    },
}

/// `tpmcrypt pcr`.
#[derive(Subcommand, Debug)]
pub enum PcrCommand {
    /// Sign a PCR policy ("these PCRs hold these values") for keys created
    /// with --pcr-signer; attach it with `tpmcrypt key add-policy`.
    Sign(SignArgs),
}

/// `tpmcrypt pcr sign`.
#[derive(Args, Debug)]
pub struct SignArgs {
    /// The signer's private key (pcr-signer create --out).
    #[arg(long, value_name = "FILE")]
    pub signer: PathBuf,
    /// The PCRs the policy covers, e.g. sha256:0,7.
    #[arg(long, value_name = "BANK:LIST", value_parser = crate::args::value::pcrs_value)]
    pub pcrs: String,
    /// Sign the values the PCRs hold now on this machine's TPM.
    #[arg(long, conflicts_with = "values", required_unless_present = "values")]
    pub current: bool,
    /// Sign predicted values from FILE: the text tpm2_pcrread prints
    /// ("  sha256:" then "    7 : 0x…" lines) or the binary it writes with
    /// -o (each selected PCR's value, ascending, concatenated).
    #[arg(long, value_name = "FILE")]
    pub values: Option<PathBuf>,
    /// Where to write the signed policy (a public file, mode 0644).
    #[arg(short, long, value_name = "FILE")]
    pub out: PathBuf,
    /// Replace FILE if it exists.
    #[arg(short, long)]
    pub force: bool,
}

/// Runs `pcr-signer …`.
pub fn run_signer(cmd: &PcrSignerCommand) -> anyhow::Result<i32> {
    match cmd {
        PcrSignerCommand::Create { out } => create_signer(out),
    }
}

/// Runs `pcr …`.
pub fn run(cmd: &PcrCommand, ui: &Ui) -> anyhow::Result<i32> {
    match cmd {
        PcrCommand::Sign(args) => sign(args, ui),
    }
}

/// Reads a key or policy file whole (see [`crate::ui::read_small`]).
fn read_small(path: &Path) -> anyhow::Result<Vec<u8>> {
    crate::ui::read_small(path, "a key or policy file")
}

fn create_signer(out: &Path) -> anyhow::Result<i32> {
    crate::ui::refuse_dash("--out", out, "a PCR signer is a secret key (mode 0600)")?;
    crate::ui::stdout::ensure_open()?;
    let ctx = || crate::ui::shown(out);
    if fs::symlink_metadata(out).is_ok() {
        return Err(anyhow::anyhow!(
            "already exists (a PCR signer is never overwritten: keys trust it)"
        ))
        .with_context(ctx);
    }
    let signer = PcrSigner::generate()?;
    let public = signer.public()?.to_pem()?;
    let pem = signer.to_pem()?;
    let mut tmp_name = out.as_os_str().to_owned();
    tmp_name.push(format!(
        ".new{}.{:016x}",
        std::process::id(),
        crate::atomic::random_u64()
    ));
    let tmp = PathBuf::from(tmp_name);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(ctx)?;
    let placed = file
        .write_all(&pem)
        .and_then(|()| file.sync_all())
        .map_err(anyhow::Error::new)
        .and_then(|()| crate::ui::stdout::write_all(public.as_bytes()))
        .and_then(|()| crate::atomic::rename_noreplace(&tmp, out).map_err(anyhow::Error::new));
    if let Err(e) = placed {
        let _ = fs::remove_file(&tmp);
        return Err(e.context("the PCR signer was not kept")).with_context(ctx);
    }
    crate::atomic::sync_dir(crate::atomic::parent_dir(out)).with_context(ctx)?;
    Ok(crate::ui::exit::OK)
}

fn sign(args: &SignArgs, ui: &Ui) -> anyhow::Result<i32> {
    let sel = PcrSelection::parse(&args.pcrs)?;
    crate::ui::refuse_dash(
        "--out",
        &args.out,
        "a signed policy is a file for key add-policy",
    )?;
    check_replaceable(&args.out, args.force)?;
    let signer = read_signer_key(&args.signer)?;
    let values = match &args.values {
        Some(file) => read_values(file, &sel)?,
        None => {
            let access = crate::tpm::access(ui)?;
            access.with(|tpm| tpm.pcr_values(&sel))?
        }
    };
    let policy = signer.sign(&sel, &values)?;
    write_public(&args.out, policy.to_pem()?.as_bytes())?;
    for (i, v) in sel.indices().iter().zip(&values) {
        stderr_line!("tpmcrypt: PCR {i}: {}", hex::encode(v));
    }
    crate::ui::stdout::line(&format!(
        "signed a policy for {sel} into {}",
        crate::ui::shown(&args.out)
    ))?;
    Ok(crate::ui::exit::OK)
}

/// `-o FILE` may be replaced only with --force, and only when it is a
/// signed policy: never the signer itself, nor any other file.
fn check_replaceable(out: &Path, force: bool) -> anyhow::Result<()> {
    let ctx = || crate::ui::shown(out);
    if fs::symlink_metadata(out).is_err() {
        return Ok(());
    }
    let is_policy = read_small(out)
        .ok()
        .and_then(|d| String::from_utf8(d).ok())
        .is_some_and(|t| SignedPolicy::from_pem(&t).is_ok());
    if !is_policy {
        return Err(anyhow::anyhow!(
            "exists and is not a signed policy file: not replaced"
        ))
        .with_context(ctx);
    }
    if !force {
        return Err(anyhow::anyhow!(
            "already exists (use --force to replace it)"
        ))
        .with_context(ctx);
    }
    Ok(())
}

/// The signer's private key: the caller's file, readable by nobody else
/// (a public key given by mistake is said to be one first).
fn read_signer_key(path: &Path) -> anyhow::Result<PcrSigner> {
    let ctx = || crate::ui::shown(path);
    let pem = zeroize::Zeroizing::new(
        // Its errors name the path already.
        tpmcrypt_tpmkey::trust::read_private_file(path, "the PCR signer key")?,
    );
    let signer = PcrSigner::from_pem(&pem).map_err(|e| usage(format!("{}: {e}", ctx())))?;
    let mode = fs::metadata(path).with_context(ctx)?.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(anyhow::anyhow!(
            "the PCR signer key is readable by others (mode {:o}); chmod 600 it",
            mode & 0o777
        ))
        .with_context(ctx);
    }
    Ok(signer)
}

/// Writes a public file (0644) under a temporary name, then renames it.
fn write_public(path: &Path, data: &[u8]) -> anyhow::Result<()> {
    let ctx = || crate::ui::shown(path);
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(format!(
        ".new{}.{:016x}",
        std::process::id(),
        crate::atomic::random_u64()
    ));
    let tmp = PathBuf::from(tmp_name);
    let r = (|| -> std::io::Result<()> {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)?;
        f.set_permissions(fs::Permissions::from_mode(0o644))?;
        f.write_all(data)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if r.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    r.with_context(ctx)?;
    crate::atomic::sync_dir(crate::atomic::parent_dir(path)).with_context(ctx)
}

/// Predicted PCR values from `file`: tpm2_pcrread's text or its `-o` binary.
fn read_values(file: &Path, sel: &PcrSelection) -> anyhow::Result<Vec<Vec<u8>>> {
    let data = read_small(file)?;
    let len = digest_len(sel);
    let n = sel.indices().len();
    let bad = |m: String| usage(format!("{}: {m}", crate::ui::shown(file)));
    match std::str::from_utf8(&data) {
        Ok(text) if text.contains(':') => parse_pcrread_text(text, sel).map_err(bad),
        _ if data.len() == n * len => Ok(data.chunks(len).map(<[u8]>::to_vec).collect()),
        _ => Err(bad(format!(
            "neither tpm2_pcrread text nor its binary output for {sel} ({n} values of {len} \
             bytes, {} in all); got {} bytes",
            n * len,
            data.len()
        ))),
    }
}

/// Parses the text tpm2_pcrread prints: a bank line (`  sha256:`) followed
/// by `  INDEX : 0xHEX` lines. Every PCR of `sel` must be given, once.
/// Hand-written, not a YAML crate: the YAML 1.2 core schema types `0x…` as
/// an integer (a 256-bit digest is not one), and this one shape is all
/// tpm2_pcrread prints; anything else is refused with its line number.
fn parse_pcrread_text(text: &str, sel: &PcrSelection) -> Result<Vec<Vec<u8>>, String> {
    let bank = sel.to_string();
    let bank = bank.split(':').next().unwrap_or_default().to_string();
    let mut in_bank = false;
    let mut found: Vec<Option<Vec<u8>>> = vec![None; sel.indices().len()];
    for (no, line) in text.lines().enumerate() {
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        if let Some(name) = t.strip_suffix(':') {
            in_bank = name.trim().eq_ignore_ascii_case(&bank);
            continue;
        }
        let Some((idx, value)) = t.split_once(':') else {
            return Err(format!("line {}: expected INDEX : 0xHEX", no + 1));
        };
        if !in_bank {
            continue;
        }
        let idx: u8 = idx
            .trim()
            .parse()
            .map_err(|_| format!("line {}: '{}' is not a PCR index", no + 1, idx.trim()))?;
        let value = value.trim();
        let hexv = value
            .strip_prefix("0x")
            .or_else(|| value.strip_prefix("0X"))
            .unwrap_or(value);
        let bytes = hex::decode(hexv).map_err(|_| format!("line {}: not hex", no + 1))?;
        if bytes.len() != digest_len(sel) {
            return Err(format!(
                "line {}: PCR {idx} has {} bytes, a {bank} value has {}",
                no + 1,
                bytes.len(),
                digest_len(sel)
            ));
        }
        if let Some(pos) = sel.indices().iter().position(|i| *i == idx) {
            if found[pos].replace(bytes).is_some() {
                return Err(format!("PCR {idx} is given twice"));
            }
        }
    }
    let missing: Vec<String> = sel
        .indices()
        .iter()
        .zip(&found)
        .filter(|(_, v)| v.is_none())
        .map(|(i, _)| i.to_string())
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "no {bank} value for PCR(s) {} (the file must give every PCR of {sel})",
            missing.join(",")
        ));
    }
    Ok(found.into_iter().flatten().collect())
}

/// The signer of `key create --pcr-signer FILE`.
pub fn read_signer(file: &Path) -> anyhow::Result<SignerPublic> {
    let data = read_small(file)?;
    SignerPublic::from_pem(&data).map_err(|e| usage(format!("{}: {e}", crate::ui::shown(file))))
}

/// Creates the key of `key create`: under a signer's PolicyAuthorize
/// when one is given, else bound to the current PCRs (or to nothing).
pub fn create_key(
    tpm: &mut Tpm,
    alg: KeyAlg,
    pcrs: Option<&PcrSelection>,
    signer: Option<&SignerPublic>,
    pin: Option<&[u8]>,
) -> tpmcrypt_tpmkey::Result<KeyBlob> {
    match signer {
        Some(signer) => tpm.create_key_signed(alg, signer, pin),
        None => tpm.create_key(alg, pcrs, pin),
    }
}

/// `key show`'s line for a key under signed policies: its signer and how
/// many policies it holds.
pub fn show_signer(store: &Keystore, name: &str) -> anyhow::Result<Option<String>> {
    let (blob, _) = store.load(name)?;
    Ok(match blob.signer()? {
        Some(signer) => Some(format!(
            "pcr signer:  {} ({} signed policies)",
            signer.fingerprint()?,
            blob.auth_policies.len()
        )),
        None => None,
    })
}

/// `key add-policy NAME FILE…`: attaches signed policies to a key, each
/// checked in software first (the key's signer, a valid signature, the
/// key's PCR selection).
pub fn add_policies(store: &Keystore, name: &str, files: &[PathBuf]) -> anyhow::Result<i32> {
    // The key is looked at first (a missing key, or one without a signer,
    // is said before its files are), then the policy files are read and
    // parsed before the keystore's lock is taken: a FIFO or a slow pipe
    // must not hold it (every write, and every load of a key whose save
    // was cut short, waits for it).
    let no_signer = || {
        usage(format!(
            "key {name} was not created with a PCR signer (key create --pcr-signer)"
        ))
    };
    let (first, _) = store.load(name)?;
    if first.signer()?.is_none() {
        return Err(no_signer());
    }
    let mut policies = Vec::with_capacity(files.len());
    for file in files {
        let text = String::from_utf8(read_small(file)?).map_err(|_| {
            usage(format!(
                "{}: not a signed policy file",
                crate::ui::shown(file)
            ))
        })?;
        let policy = SignedPolicy::from_pem(&text)
            .map_err(|e| usage(format!("{}: {e}", crate::ui::shown(file))))?;
        policies.push((file, policy));
    }
    // Read, add, write back under the keystore's lock: two runs at once
    // would otherwise each write the key file without the other's policy.
    let lock = store.lock()?;
    // Read again: the key may have been replaced since the first look.
    let (mut blob, meta) = store.load_locked(&lock, name)?;
    if blob.signer()?.is_none() {
        return Err(no_signer());
    }
    let mut added = 0;
    for (file, policy) in policies {
        if let Some(want) = meta.pcr_selection()? {
            if want != policy.selection {
                return Err(usage(format!(
                    "{}: the policy covers {}, key {name} is used under {want}",
                    crate::ui::shown(file),
                    policy.selection
                )));
            }
        }
        let new = blob
            .add_signed_policy(&policy)
            .with_context(|| crate::ui::shown(file))?;
        if new {
            added += 1;
        } else {
            stderr_line!(
                "tpmcrypt: {}: key {name} holds this policy already",
                crate::ui::shown(file)
            );
        }
    }
    if added > 0 {
        store.save_locked(&lock, name, &blob, &meta, true)?;
    }
    crate::ui::stdout::line(&format!(
        "key {name}: {added} signed policy(ies) added, {} in all",
        blob.auth_policies.len()
    ))?;
    Ok(crate::ui::exit::OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tpm2_pcrread_text_is_read_for_the_selection() {
        let sel = PcrSelection::parse("sha256:0,7").unwrap();
        let z = "00".repeat(32);
        let a = "ab".repeat(32);
        let text = format!(
            "  sha1:\n    0 : 0x{}\n  sha256:\n    0 : 0x{z}\n    1 : 0x{z}\n    7 : 0x{}\n",
            "11".repeat(20),
            a.to_uppercase()
        );
        let v = parse_pcrread_text(&text, &sel).unwrap();
        assert_eq!(v, vec![vec![0; 32], vec![0xab; 32]]);
        let missing = parse_pcrread_text(&format!("sha256:\n  0 : 0x{z}\n"), &sel).unwrap_err();
        assert!(missing.contains("PCR(s) 7"), "{missing}");
        let twice = format!("sha256:\n 0 : {z}\n 0 : {z}\n 7 : {z}\n");
        assert!(parse_pcrread_text(&twice, &sel)
            .unwrap_err()
            .contains("twice"));
        let short = format!("sha256:\n 0 : {z}\n 7 : 0xabcd\n");
        assert!(parse_pcrread_text(&short, &sel)
            .unwrap_err()
            .contains("2 bytes"));
    }
}
