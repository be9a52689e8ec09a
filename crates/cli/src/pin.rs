//! Where a key's PIN comes from, first that has one wins:
//!
//! 1. `--pin-file FILE`;
//! 2. a systemd credential (`LoadCredential=`/`LoadCredentialEncrypted=`):
//!    `$CREDENTIALS_DIRECTORY/tpmcrypt-pin.NAME` for key NAME, else
//!    `$CREDENTIALS_DIRECTORY/tpmcrypt-pin`;
//! 3. `TPMCRYPT_PIN` (the weakest: an environment is inherited by every
//!    child and readable in /proc by the same user; for tests), one line
//!    as a file's (a final `\n` or `\r\n` dropped);
//! 4. the terminal (`/dev/tty`), without echo;
//! 5. without a terminal, an askpass program: `TPMCRYPT_ASKPASS`, else
//!    `SSH_ASKPASS` when `DISPLAY` or `WAYLAND_DISPLAY` is set (as ssh
//!    does), run with the prompt as its argument; the first line it prints
//!    is the PIN.
//!
//! Files (1, 2) are read once, at the start of a run, and must be regular
//! files (not symlinks) owned by the user and neither readable nor
//! writable by anyone else (mode 0600 or 0400; a credential may also be
//! root's with an ACL, see [`read_pin_file`]): anything else is a usage
//! error (exit 2) before anything is done. Their PIN is one line (a final
//! newline is dropped). A PIN from a file or the environment is presented
//! at most once per key and run; one typed (terminal, askpass) may be
//! asked for again, at most [`MAX_TYPED_PINS`] times (see
//! [`tpmcrypt_tpmkey::identity::Pins`]). PIN buffers are zeroized.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::Read;
use std::os::unix::ffi::OsStringExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use tpmcrypt_tpmkey::identity::{Pin, PinSource, Pins, MAX_TYPED_PINS};
use tpmcrypt_tpmkey::tpm::MAX_PIN_LEN;
use tpmcrypt_tpmkey::Error as TpmError;
use zeroize::Zeroizing;

use crate::ui::exit::usage;
use crate::ui::{shown, Ui};

/// Environment variable holding a key's PIN (the weakest source).
pub const ENV_PIN: &str = "TPMCRYPT_PIN";
/// The askpass program tpmcrypt runs when there is no terminal.
pub const ENV_ASKPASS: &str = "TPMCRYPT_ASKPASS";
/// The name of the systemd credential holding a PIN (`.NAME` for one key).
pub const CREDENTIAL: &str = "tpmcrypt-pin";
/// The largest PIN file read (a TPM authValue is at most a digest long).
const MAX_PIN_FILE: u64 = 4096;

/// A PIN read from a file, and how to name that file.
struct FilePin {
    secret: Zeroizing<Vec<u8>>,
    origin: String,
}

/// The PIN sources of one run (see the module documentation).
pub struct PinChain {
    file: Option<FilePin>,
    /// Credentials by file name (`tpmcrypt-pin`, `tpmcrypt-pin.NAME`).
    credentials: HashMap<String, FilePin>,
    verbose: bool,
}

impl PinChain {
    /// Reads `--pin-file` and the credentials now: a file that is not
    /// private, not one line, or not there is a usage error.
    pub fn new(ui: &Ui) -> anyhow::Result<PinChain> {
        let file = match &ui.pin_file {
            Some(path) => Some(FilePin {
                secret: read_pin_file(path, "the --pin-file", false)?,
                origin: format!("--pin-file {}", shown(path)),
            }),
            None => None,
        };
        let credentials = match std::env::var_os("CREDENTIALS_DIRECTORY") {
            Some(dir) if !dir.is_empty() => read_credentials(Path::new(&dir))?,
            _ => HashMap::new(),
        };
        Ok(PinChain {
            file,
            credentials,
            verbose: ui.verbose,
        })
    }

    /// The PIN of key `name`, asked with `prompt` where a person answers.
    pub fn ask(&self, name: &str, prompt: &str) -> tpmcrypt_tpmkey::Result<Pin> {
        let pin = self.find(name, prompt)?;
        if self.verbose {
            stderr_line!("tpmcrypt: the PIN for key {name} comes from {}", pin.origin);
        }
        Ok(pin)
    }

    fn find(&self, name: &str, prompt: &str) -> tpmcrypt_tpmkey::Result<Pin> {
        let fixed = |f: &FilePin| Pin {
            secret: f.secret.clone(),
            may_retry: false,
            origin: f.origin.clone(),
        };
        if let Some(f) = &self.file {
            return Ok(fixed(f));
        }
        let own = format!("{CREDENTIAL}.{name}");
        if let Some(f) = self
            .credentials
            .get(&own)
            .or(self.credentials.get(CREDENTIAL))
        {
            return Ok(fixed(f));
        }
        if let Some(pin) = std::env::var_os(ENV_PIN) {
            // One line, as from a file: a final `\n` or `\r\n` (an env
            // file written on Windows, `$(cat pinfile)` kept raw) is not
            // part of the PIN, or a PIN file and the environment would
            // hold two different PINs for one key.
            let raw = Zeroizing::new(pin.into_vec());
            let secret = if raw.is_empty() {
                Zeroizing::new(Vec::new())
            } else {
                one_line(&raw).ok_or_else(|| {
                    TpmError::PinUnavailable(format!(
                        "{ENV_PIN} must hold the PIN on one line (at most {MAX_PIN_FILE} bytes)"
                    ))
                })?
            };
            return Ok(Pin {
                secret,
                may_retry: false,
                origin: ENV_PIN.into(),
            });
        }
        if std::fs::File::open("/dev/tty").is_ok() {
            return terminal(prompt);
        }
        match askpass_program() {
            Some(program) => askpass(&program, prompt),
            None => Err(TpmError::PinUnavailable(format!(
                "key {name} needs a PIN and there is no terminal: give --pin-file FILE, a \
                 systemd credential {CREDENTIAL}, {ENV_ASKPASS}=PROGRAM, or {ENV_PIN} (the \
                 weakest)"
            ))),
        }
    }
}

impl PinSource for PinChain {
    fn pin(&self, name: &str, refused: u32) -> tpmcrypt_tpmkey::Result<Pin> {
        let prompt = if refused > 0 {
            format!(
                "Wrong PIN. PIN for key {name} (try {} of {MAX_TYPED_PINS}): ",
                refused + 1
            )
        } else {
            format!("PIN for key {name}: ")
        };
        self.ask(name, &prompt)
    }
}

/// The run's PIN budget over its PIN sources.
pub fn pins(ui: &Ui) -> anyhow::Result<Arc<Pins>> {
    Ok(Arc::new(Pins::new(Box::new(PinChain::new(ui)?))))
}

/// A new key's PIN: from a file or the environment as it is, typed twice
/// where a person types it. An empty PIN is refused.
pub fn new_pin(ui: &Ui, name: &str) -> anyhow::Result<Zeroizing<Vec<u8>>> {
    let chain = PinChain::new(ui)?;
    let pin = chain.ask(name, &format!("New PIN for key {name}: "))?;
    if pin.secret.is_empty() {
        return Err(usage(format!("empty PIN (from {})", pin.origin)));
    }
    if let Some(why) = too_long(&pin.secret) {
        return Err(usage(format!("{why} (from {})", pin.origin)));
    }
    // A control character (a stray `\r`, a tab) could not be given the
    // same way from a file, the environment and a terminal: each wrong
    // try would cost a dictionary-attack try.
    if pin.secret.iter().any(|b| b.is_ascii_control()) {
        return Err(usage(format!(
            "the new PIN (from {}) holds a control character; use printable characters only",
            pin.origin
        )));
    }
    if pin.may_retry {
        let again = chain.ask(name, "Repeat the PIN: ")?;
        if again.secret != pin.secret {
            return Err(usage("the PINs differ"));
        }
    }
    Ok(pin.secret)
}

fn terminal(prompt: &str) -> tpmcrypt_tpmkey::Result<Pin> {
    let pin = rpassword::prompt_password(prompt).map_err(|e| {
        TpmError::PinUnavailable(format!("cannot read a PIN from the terminal: {e}"))
    })?;
    Ok(Pin {
        secret: Zeroizing::new(pin.into_bytes()),
        may_retry: true,
        origin: "the terminal".into(),
    })
}

/// `TPMCRYPT_ASKPASS`, else `SSH_ASKPASS` where a display is (as ssh).
fn askpass_program() -> Option<OsString> {
    let set = |v: &str| std::env::var_os(v).filter(|s| !s.is_empty());
    set(ENV_ASKPASS).or_else(|| {
        set("SSH_ASKPASS").filter(|_| set("DISPLAY").or(set("WAYLAND_DISPLAY")).is_some())
    })
}

/// Runs the askpass `program` with `prompt` as its argument; its first line
/// of output is the PIN. A failure or a cancel (non-zero exit) is "no PIN",
/// which spends no dictionary-attack try.
fn askpass(program: &OsString, prompt: &str) -> tpmcrypt_tpmkey::Result<Pin> {
    let name = shown(Path::new(program));
    let unavailable = |why: String| TpmError::PinUnavailable(format!("askpass {name}: {why}"));
    let mut child = Command::new(program)
        .arg(prompt.trim_end())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| unavailable(format!("cannot run it: {e}")))?;
    let mut out = Zeroizing::new(Vec::with_capacity(MAX_PIN_FILE as usize + 1));
    let read = match child.stdout.take() {
        Some(stdout) => stdout.take(MAX_PIN_FILE + 1).read_to_end(&mut out),
        None => Ok(0),
    };
    // Whatever it printed beyond the limit is not waited for.
    let status = child
        .wait()
        .map_err(|e| unavailable(format!("cannot wait for it: {e}")))?;
    read.map_err(|e| unavailable(format!("cannot read its answer: {e}")))?;
    if !status.success() {
        return Err(unavailable(format!("cancelled ({status})")));
    }
    let end = out.iter().position(|&b| b == b'\n').unwrap_or(out.len());
    let mut line = &out[..end];
    if let [rest @ .., b'\r'] = line {
        line = rest;
    }
    Ok(Pin {
        secret: Zeroizing::new(line.to_vec()),
        may_retry: true,
        origin: format!("askpass {name}"),
    })
}

/// The credentials named `tpmcrypt-pin` or `tpmcrypt-pin.NAME` in `dir`.
fn read_credentials(dir: &Path) -> anyhow::Result<HashMap<String, FilePin>> {
    let mut out = HashMap::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        // No credentials for this unit: nothing to read.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(usage(format!("$CREDENTIALS_DIRECTORY {}: {e}", shown(dir)))),
    };
    for entry in entries {
        let entry = entry.map_err(|e| usage(format!("{}: {e}", shown(dir))))?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if name == CREDENTIAL || name.starts_with(&format!("{CREDENTIAL}.")) {
            let path = entry.path();
            let secret = read_pin_file(&path, "the credential", true)?;
            let origin = format!("the systemd credential {name} ({})", shown(&path));
            out.insert(name, FilePin { secret, origin });
        }
    }
    Ok(out)
}

/// Reads a PIN file: a regular file (not followed if a symlink, not a
/// FIFO), the user's, readable and writable by nobody else, one line.
///
/// A systemd `credential` may also be root's and show a group read bit:
/// for a service with `User=`, systemd writes it root's, mode 0400, with
/// an ACL entry for the user, whose mask `stat` shows as mode 0440 (where
/// the file system has no ACLs it makes it the user's instead). Others'
/// bits and group write stay refused.
pub fn read_pin_file(
    path: &Path,
    what: &str,
    credential: bool,
) -> anyhow::Result<Zeroizing<Vec<u8>>> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let at = shown(path);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => usage(format!("{at}: {what} is a symlink; name the file itself")),
            _ => usage(format!("{at}: cannot open {what}: {e}")),
        })?;
    let meta = file.metadata().map_err(|e| usage(format!("{at}: {e}")))?;
    if !meta.file_type().is_file() {
        return Err(usage(format!("{at}: {what} is not a regular file")));
    }
    let me = tpmcrypt_tpmkey::trust::euid();
    if meta.uid() != me && !(credential && meta.uid() == 0) {
        return Err(usage(format!(
            "{at}: {what} is owned by uid {}, not by you (uid {me})",
            meta.uid()
        )));
    }
    let mode = meta.mode() & 0o7777;
    let forbidden = if credential { 0o027 } else { 0o077 };
    if mode & forbidden != 0 {
        return Err(usage(format!(
            "{at}: {what} is open to other users (mode {mode:04o}); make it private with \
             chmod 600"
        )));
    }
    let mut data = Zeroizing::new(Vec::with_capacity(MAX_PIN_FILE as usize + 1));
    file.take(MAX_PIN_FILE + 1)
        .read_to_end(&mut data)
        .map_err(|e| usage(format!("{at}: cannot read {what}: {e}")))?;
    let pin = one_line(&data).ok_or_else(|| {
        usage(format!(
            "{at}: {what} must hold the PIN on one line (non-empty, at most {MAX_PIN_FILE} \
             bytes)"
        ))
    })?;
    if let Some(why) = too_long(&pin) {
        return Err(usage(format!("{at}: {why}")));
    }
    Ok(pin)
}

/// Why `pin` can be no key's PIN, if it is longer than a TPM takes (a
/// key's authValue is at most its name digest, 32 bytes): refused before
/// the TPM is asked, as a usage error.
fn too_long(pin: &[u8]) -> Option<String> {
    (pin.len() > MAX_PIN_LEN).then(|| {
        format!(
            "the PIN is {} bytes long; a TPM key's PIN is at most {MAX_PIN_LEN} bytes",
            pin.len()
        )
    })
}

/// The one line of `data` without its final newline (`\n` or `\r\n`), if
/// `data` is one non-empty line of at most [`MAX_PIN_FILE`] bytes.
fn one_line(data: &[u8]) -> Option<Zeroizing<Vec<u8>>> {
    if data.len() as u64 > MAX_PIN_FILE {
        return None;
    }
    let mut line = data.strip_suffix(b"\n").unwrap_or(data);
    line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.is_empty() || line.contains(&b'\n') {
        return None;
    }
    Some(Zeroizing::new(line.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::one_line;

    #[test]
    fn a_pin_file_is_one_non_empty_line() {
        let got = |d: &[u8]| one_line(d).map(|p| p.to_vec());
        assert_eq!(got(b"1234\n"), Some(b"1234".to_vec()));
        assert_eq!(got(b"1234"), Some(b"1234".to_vec()));
        assert_eq!(got(b"1234\r\n"), Some(b"1234".to_vec()));
        assert_eq!(
            got(b" 12 34 "),
            Some(b" 12 34 ".to_vec()),
            "spaces are kept"
        );
        for bad in [&b""[..], b"\n", b"\r\n", b"1234\n5678\n", b"1234\n\n"] {
            assert_eq!(got(bad), None, "{bad:?}");
        }
        assert_eq!(got(&vec![b'7'; 5000]), None, "too long");
    }
}
