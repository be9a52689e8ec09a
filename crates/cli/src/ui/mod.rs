//! What the user sees: output preferences, one-line error text with
//! control characters escaped, exit codes ([`exit`]) and standard output
//! ([`stdout`]). Every module that shows text to a person takes it from
//! here.

pub mod colour;
pub mod exit;
pub mod stdout;

use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Largest file [`read_small`] reads.
pub const MAX_SMALL_FILE: u64 = 64 * 1024;

/// Reads `path`, a file that is small when it is what it should be
/// (`what`: "a key or policy file"), whole: at most [`MAX_SMALL_FILE`]
/// bytes, else a usage error (a device such as `/dev/zero`, or a wrong
/// file, is never read until memory runs out).
pub fn read_small(path: &std::path::Path, what: &str) -> anyhow::Result<Vec<u8>> {
    use anyhow::Context as _;
    use std::io::Read as _;
    let ctx = || shown(path);
    let file = std::fs::File::open(path).with_context(ctx)?;
    let mut data = Vec::new();
    file.take(MAX_SMALL_FILE + 1)
        .read_to_end(&mut data)
        .with_context(ctx)?;
    if data.len() as u64 > MAX_SMALL_FILE {
        return Err(exit::usage(format!("{}: too large for {what}", ctx())));
    }
    Ok(data)
}

/// `-` given for a file that is only ever written as a file of its own
/// (`what`: "a recovery identity is a secret key"): `-` is standard
/// output everywhere else (`-o -`), so a file named `-` is not what was
/// meant; a usage error that says how to name such a file.
pub fn refuse_dash(option: &str, path: &std::path::Path, what: &str) -> anyhow::Result<()> {
    if path.as_os_str() != "-" {
        return Ok(());
    }
    Err(exit::usage(format!(
        "{option} -: {what} and is written only to a file of its own, never to standard \
         output (for a file named -, give ./-)"
    )))
}

/// What a file that is not regular is ("a device", "a symbolic link"
/// as `lstat` sees it), for a refusal to replace it; None for a regular
/// file.
pub fn not_regular(m: &std::fs::Metadata) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt as _;
    let ft = m.file_type();
    Some(if ft.is_file() {
        return None;
    } else if ft.is_dir() {
        "a directory"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else if ft.is_char_device() || ft.is_block_device() {
        "a device"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else {
        "a special file"
    })
}

/// Output preferences shared by the commands.
#[derive(Clone)]
pub struct Ui {
    /// Print summaries.
    pub verbose: bool,
    /// No progress bars.
    pub quiet: bool,
    /// `--keystore`, if given.
    pub keystore: Option<std::path::PathBuf>,
    /// `--tpm`, if given.
    pub tpm: Option<String>,
    /// Whether that value came from `TPMCRYPT_TCTI` rather than the flag.
    pub tpm_from_env: bool,
    /// `--simulator`.
    pub simulator: bool,
    /// `--pin-file`, if given.
    pub pin_file: Option<std::path::PathBuf>,
}

/// A path as it may stand in one line on a terminal: as [`printable`], and
/// each byte that is not UTF-8 shown as `\xNN` (two names that differ
/// only there stay two names, where a lossy conversion would show both
/// with U+FFFD). For display only: the path itself is used as bytes.
pub fn shown(path: &Path) -> String {
    let mut out = String::new();
    for chunk in path.as_os_str().as_bytes().utf8_chunks() {
        out.push_str(&printable(chunk.valid()));
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

/// The cause chain on one line, as [`printable`].
pub fn one_line(err: &anyhow::Error) -> String {
    let hint = exit::hint(err).unwrap_or("");
    printable(&format!("{err:#}{hint}"))
}

/// A time as every timestamp tpmcrypt shows is written (JSON, logs, `key
/// show`): RFC 3339 in UTC, to the millisecond, e.g.
/// `2026-11-23T15:54:37.120Z`.
pub fn rfc3339(t: std::time::SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// Seconds since the Unix epoch (as key metadata keeps them) as
/// [`rfc3339`], to the second.
pub fn rfc3339_unix(secs: u64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
    humantime::format_rfc3339_seconds(t).to_string()
}

/// Text as it may stand in one line on a terminal: control characters (a
/// newline in a file name, a terminal escape sequence) are shown escaped,
/// `\n`, `\x1b`, never passed through.
pub fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;

    use super::*;

    #[test]
    fn printable_escapes_control_characters_only() {
        assert_eq!(printable("a\nb\tc\rd"), "a\\nb\\tc\\rd");
        assert_eq!(printable("\u{1b}[2J\u{7f}\u{9b}"), "\\x1b[2J\\x7f\\x9b");
        assert_eq!(printable("été/日本 \\ ok"), "été/日本 \\ ok");
        let err = anyhow::anyhow!("line one\nline two").context("x\ny");
        assert_eq!(one_line(&err), "x\\ny: line one\\nline two");
    }

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339_unix(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_unix(1_795_449_277), "2026-11-23T15:54:37Z");
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(1_795_449_277_120);
        assert_eq!(rfc3339(t), "2026-11-23T15:54:37.120Z");
    }

    #[test]
    fn shown_escapes_bytes_that_are_not_utf8() {
        let p = Path::new(OsStr::from_bytes(b"d\n/caf\xe9\xe8 \xc3\xa9"));
        assert_eq!(shown(p), "d\\n/caf\\xe9\\xe8 é");
    }
}
