//! `tpmcrypt recovery create|recipient`.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::Context as _;
use tpmcrypt_cipher::recovery::RecoveryKey;
use zeroize::Zeroizing;

use crate::args::RecoveryCommand;

/// Runs a recovery subcommand.
pub fn run(cmd: &RecoveryCommand) -> anyhow::Result<i32> {
    match cmd {
        RecoveryCommand::Create { out, force } => create(out, *force),
        RecoveryCommand::Recipient { identity } => {
            let text = Zeroizing::new(
                fs::read_to_string(identity).with_context(|| identity.display().to_string())?,
            );
            let key = RecoveryKey::parse(&text).with_context(|| identity.display().to_string())?;
            println!("{}", key.recipient_string());
            Ok(crate::exit::OK)
        }
    }
}

fn create(out: &Path, force: bool) -> anyhow::Result<i32> {
    let key = RecoveryKey::generate(&mut rand_core::OsRng);
    let comment = format!(
        "tpmcrypt recovery identity, created {}\nKeep this file offline: it decrypts every file encrypted to its recipient.",
        humantime_now()
    );
    let contents = key.to_file_contents(&comment)?;
    let ctx = || out.display().to_string();
    // The private key is written straight into a new 0600 file (never a
    // wider mode, not even briefly).
    if force && fs::symlink_metadata(out).is_ok() {
        fs::remove_file(out).with_context(ctx)?;
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(out)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                anyhow::anyhow!("already exists (use --force to overwrite)")
            } else {
                e.into()
            }
        })
        .with_context(ctx)?;
    file.write_all(contents.as_bytes()).with_context(ctx)?;
    file.sync_all().with_context(ctx)?;
    crate::atomic::sync_dir(crate::atomic::parent_dir(out)).with_context(ctx)?;
    println!("{}", key.recipient_string());
    Ok(crate::exit::OK)
}

fn humantime_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("at unix time {secs}")
}
