//! `tpmcrypt recovery create|recipient`.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::Subcommand;
use tpmcrypt_cipher::recovery::RecoveryKey;

/// `tpmcrypt recovery …`.
#[derive(Subcommand, Debug)]
pub enum RecoveryCommand {
    /// Create a recovery identity and print its recipient string.
    Create {
        /// Where to write the identity (mode 0600). Keep it offline.
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
        /// Overwrite an existing identity, destroying it (asks first; --yes
        /// to confirm without a terminal). Only a file `recovery create`
        /// wrote, or an empty one, is ever replaced.
        #[arg(short, long)]
        force: bool,
        /// With --force: overwrite without asking.
        #[arg(long, requires = "force")]
        yes: bool,
    },
    /// Print the recipient string of an existing recovery identity.
    Recipient {
        /// The identity file.
        identity: PathBuf,
    },
}

/// Runs a recovery subcommand.
pub fn run(cmd: &RecoveryCommand) -> anyhow::Result<i32> {
    match cmd {
        RecoveryCommand::Create { out, force, yes } => create(out, *force, *yes),
        RecoveryCommand::Recipient { identity } => {
            let bytes = crate::keys::read_identity_file(identity)?;
            let key = crate::keys::recovery_key(identity, &bytes)?;
            crate::ui::stdout::write_all(format!("{}\n", key.recipient_string()).as_bytes())?;
            Ok(crate::ui::exit::OK)
        }
    }
}

/// How an identity file `recovery create` writes begins.
const IDENTITY_FIRST_LINE: &str = "# tpmcrypt recovery identity";

fn create(out: &Path, force: bool, yes: bool) -> anyhow::Result<i32> {
    crate::ui::refuse_dash(
        "--out",
        out,
        "a recovery identity is a secret key (mode 0600)",
    )?;
    // A device, a FIFO, a socket or a symlink (`/dev/null`, `/dev/stdout`)
    // is never replaced by the key, nor called an identity.
    if let Some(kind) = fs::symlink_metadata(out)
        .ok()
        .as_ref()
        .and_then(crate::ui::not_regular)
    {
        return Err(crate::ui::exit::usage(format!(
            "--out {}: is {kind}; a recovery identity is written only to a regular file of its \
             own",
            crate::ui::shown(out)
        )));
    }
    // The recipient is printed: no key is made that nobody would see.
    crate::ui::stdout::ensure_open()?;
    let exists = fs::symlink_metadata(out).is_ok();
    if exists && !force {
        return Err(anyhow::anyhow!(
            "already exists (to destroy that identity and write a new one: --force)"
        ))
        .with_context(|| out.display().to_string());
    }
    if exists {
        // Only an identity this command made (its first line says so,
        // and it holds the key) or an empty file (as `mktemp` makes) is
        // replaced: never a document, nor a PCR signer's key (a bare P-256
        // key as well) or another secret --force was given by mistake.
        let empty = fs::metadata(out).is_ok_and(|m| m.len() == 0);
        let identity = || {
            crate::keys::read_identity_file(out).is_ok_and(|bytes| {
                bytes.starts_with(IDENTITY_FIRST_LINE.as_bytes())
                    && crate::keys::recovery_key(out, &bytes).is_ok()
            })
        };
        if !empty && !identity() {
            return Err(crate::ui::exit::usage(format!(
                "--out {}: exists and is not a recovery identity: not replaced",
                crate::ui::shown(out)
            )));
        }
        let what = format!(
            "overwrite the recovery identity {} (files encrypted to its recipient can then be \
             recovered only from another copy of it)",
            crate::ui::printable(&out.display().to_string())
        );
        if !crate::commands::key::confirm_destroy(&what, yes)? {
            stderr_line!("{} kept", out.display());
            return Ok(crate::ui::exit::OTHER);
        }
    }
    let key = RecoveryKey::generate(&mut rand_core::OsRng);
    let comment = format!(
        "{}, created {}\nKeep this file offline: it decrypts every file encrypted to its recipient.",
        IDENTITY_FIRST_LINE.trim_start_matches("# "),
        humantime_now()
    );
    let contents = key.to_file_contents(&comment)?;
    let ctx = || out.display().to_string();
    // The private key is written straight into a new 0600 file (never a
    // wider mode, not even briefly) beside its final name, made durable,
    // and renamed into place only once its recipient has been printed:
    // a crash leaves the old identity or the new one, never neither, and
    // no identity is kept whose recipient nobody saw (stdout full, gone).
    let mut tmp_name = out.as_os_str().to_owned();
    tmp_name.push(format!(".new{}", std::process::id()));
    let target = std::path::PathBuf::from(tmp_name);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&target)
        .with_context(ctx)?;
    let written = file
        .write_all(contents.as_bytes())
        .and_then(|()| file.sync_all());
    if let Err(e) = written {
        let _ = fs::remove_file(&target);
        return Err(e).with_context(ctx);
    }
    if let Err(e) = crate::ui::stdout::write_all(format!("{}\n", key.recipient_string()).as_bytes())
    {
        let _ = fs::remove_file(&target);
        return Err(e.context(format!(
            "the recipient could not be printed, so the identity {} was not kept",
            crate::ui::shown(out)
        )));
    }
    let placed = if exists {
        fs::rename(&target, out)
    } else {
        crate::atomic::rename_noreplace(&target, out)
    };
    if let Err(e) = placed {
        let _ = fs::remove_file(&target);
        return Err(anyhow::Error::new(e).context("the identity was not kept")).with_context(ctx);
    }
    crate::atomic::sync_dir(crate::atomic::parent_dir(out)).with_context(ctx)?;
    Ok(crate::ui::exit::OK)
}

fn humantime_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("at unix time {secs}")
}
