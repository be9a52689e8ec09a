//! Logging for the daemon: `LEVEL target: message` lines through `tracing`,
//! on stderr (journald-friendly: no colours unless `ui::colour` allows, and a
//! `<N>` syslog priority prefix when stderr is the journal) or appended to
//! a `--log` file that SIGHUP reopens (for logrotate).

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tracing::{Event, Level, Subscriber};

use crate::files::Stream;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::registry::LookupSpan;

/// Where log lines go.
#[derive(Clone)]
pub enum Sink {
    /// Standard error (no `--log`, or `--log /dev/stderr`).
    Stderr,
    /// `--log /dev/stdout` (or `-`).
    Stdout,
    /// A `--log` file, reopened by name on SIGHUP.
    File(PathBuf, Arc<Mutex<File>>),
}

/// Why log lines must not be appended to `path`, if they must not: the
/// daemon appends to a new or empty file, to a log it wrote before, to a
/// FIFO or to a character device (`/dev/null`, `/dev/kmsg`), never to
/// other data (a typo naming a key, an identity, a ciphertext, or
/// `/etc/passwd` as root), a block device or a directory. Symbolic links
/// are followed, as a log's usually are; the rule holds for what they
/// name. `None` for a name that does not exist (it is created).
pub fn append_refusal(path: &Path) -> Option<String> {
    match crate::files::stream_named(path) {
        Some(Stream::Out | Stream::Err) => return None,
        Some(Stream::In) => {
            return Some(
                "names standard input: log lines go to a file, standard output or standard error"
                    .into(),
            )
        }
        None => {}
    }
    let m = std::fs::metadata(path).ok()?;
    refusal_for(&m, || starts_as_a_log(path))
}

fn refusal_for(m: &std::fs::Metadata, ours: impl FnOnce() -> bool) -> Option<String> {
    use std::os::unix::fs::FileTypeExt as _;
    let ft = m.file_type();
    if ft.is_fifo() || ft.is_char_device() {
        return None;
    }
    if let Some(kind) = crate::ui::not_regular(m) {
        return Some(format!(
            "is {kind}, not a file to append log lines to: refusing to write to it"
        ));
    }
    (m.len() > 0 && !ours()).then(|| {
        "exists and is neither empty nor a tpmcrypt log: refusing to append to it \
         (remove it, or give another name)"
            .to_string()
    })
}

/// Whether the file's first line is one of ours: an RFC 3339 time, a
/// level, a target (`2026-11-27T19:00:00.123Z INFO tpmcrypt::watch: …`).
fn starts_as_a_log(path: &Path) -> bool {
    use std::io::Read as _;
    let Ok(f) = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
    else {
        return false;
    };
    let mut head = Vec::with_capacity(256);
    if f.take(256).read_to_end(&mut head).is_err() {
        return false;
    }
    is_log_line(&head)
}

fn is_log_line(head: &[u8]) -> bool {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let Ok(line) = std::str::from_utf8(line) else {
        return false;
    };
    let mut words = line.splitn(3, ' ');
    let (Some(time), Some(level), Some(rest)) = (words.next(), words.next(), words.next()) else {
        return false;
    };
    humantime::parse_rfc3339(time).is_ok()
        && ["ERROR", "WARN", "INFO", "DEBUG", "TRACE"].contains(&level)
        && rest.split_once(": ").is_some()
}

impl Sink {
    /// Opens `path` to append to, if [`append_refusal`] allows it, and
    /// checks that what was opened is what was looked at (a name swapped
    /// meanwhile is refused as well). A FIFO nobody reads is an error,
    /// not a wait.
    fn open(path: &Path) -> io::Result<File> {
        let refused = |why: String| io::Error::new(io::ErrorKind::InvalidInput, why);
        if let Some(why) = append_refusal(path) {
            return Err(refused(why));
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o640)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path)?;
        let m = file.metadata()?;
        // Swapped after the look: what was opened must pass the rule as
        // well (its first line is read through the path again, so a
        // regular file must still be the one the path names).
        let same = || {
            std::fs::metadata(path).is_ok_and(|p| p.dev() == m.dev() && p.ino() == m.ino())
                && starts_as_a_log(path)
        };
        if let Some(why) = refusal_for(&m, same) {
            return Err(refused(why));
        }
        // Writes block again (a FIFO's reader that is slow is waited for).
        // SAFETY: fcntl on a descriptor this function owns.
        let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
        if flags >= 0 {
            // SAFETY: as above.
            unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) };
        }
        Ok(file)
    }

    /// Reopens the log file (after logrotate moved it away). Returns false
    /// when logging to stderr (nothing to reopen). A name that now holds
    /// anything [`append_refusal`] refuses is not written to: the log goes
    /// on in the file open before.
    pub fn reopen(&self) -> io::Result<bool> {
        let Sink::File(path, file) = self else {
            return Ok(false);
        };
        let new = Sink::open(path)?;
        *file.lock().unwrap_or_else(|e| e.into_inner()) = new;
        Ok(true)
    }
}

/// A writer for one log line.
pub enum LineWriter<'a> {
    /// Standard error.
    Stderr(io::Stderr),
    /// Standard output.
    Stdout(io::Stdout),
    /// The log file.
    File(&'a Mutex<File>),
}

impl Write for LineWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            LineWriter::Stderr(s) => s.write(buf),
            LineWriter::Stdout(s) => s.write(buf),
            LineWriter::File(f) => f.lock().unwrap_or_else(|e| e.into_inner()).write(buf),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        match self {
            LineWriter::Stderr(s) => s.lock().write_all(buf),
            LineWriter::Stdout(s) => s.lock().write_all(buf),
            LineWriter::File(f) => f.lock().unwrap_or_else(|e| e.into_inner()).write_all(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Sink {
    type Writer = LineWriter<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        match self {
            Sink::File(_, f) => LineWriter::File(f),
            Sink::Stdout => LineWriter::Stdout(io::stdout()),
            Sink::Stderr => LineWriter::Stderr(io::stderr()),
        }
    }
}

/// The line format.
struct LineFormat {
    /// ANSI colours for the level (a terminal).
    colour: bool,
    /// `<N>` syslog priority prefix (stderr is the journal).
    priority: bool,
    /// Leading RFC 3339 timestamp (a log file).
    time: bool,
}

impl<S, N> FormatEvent<S, N> for LineFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let level = *meta.level();
        if self.priority {
            let prio = match level {
                Level::ERROR => 3,
                Level::WARN => 4,
                Level::INFO => 6,
                _ => 7,
            };
            write!(writer, "<{prio}>")?;
        }
        if self.time {
            let now = crate::ui::rfc3339(std::time::SystemTime::now());
            write!(writer, "{now} ")?;
        }
        write!(writer, "{} ", crate::ui::colour::level(self.colour, &level))?;
        let target = meta.target();
        match target.strip_prefix("tpmcrypt::commands::") {
            Some(rest) => write!(writer, "tpmcrypt::{rest}: ")?,
            None => write!(writer, "{target}: ")?,
        }
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// Whether stderr is the systemd journal ($JOURNAL_STREAM names its
/// device and inode).
fn stderr_is_journal() -> bool {
    let Ok(v) = std::env::var("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = v.split_once(':') else {
        return false;
    };
    let Ok(meta) = std::fs::metadata("/proc/self/fd/2") else {
        return false;
    };
    dev.parse() == Ok(meta.dev()) && ino.parse() == Ok(meta.ino())
}

/// Installs the global subscriber. Returns the sink, for SIGHUP.
pub fn init(log_file: Option<&Path>, verbose: bool) -> anyhow::Result<Sink> {
    // The names of standard output and error mean those streams, as
    // they do for `-o` and `--stats-json`: nothing there to reopen.
    let sink = match log_file.map(|p| (p, crate::files::stream_named(p))) {
        None | Some((_, Some(Stream::Err))) => Sink::Stderr,
        Some((_, Some(Stream::Out))) => Sink::Stdout,
        Some((p, _)) => {
            let f = Sink::open(p)
                .map_err(|e| anyhow::Error::from(e).context(format!("--log {}", p.display())))?;
            Sink::File(p.to_path_buf(), Arc::new(Mutex::new(f)))
        }
    };
    let on_stderr = matches!(sink, Sink::Stderr);
    let format = LineFormat {
        colour: on_stderr && crate::ui::colour::stderr(),
        priority: on_stderr && stderr_is_journal(),
        time: !on_stderr,
    };
    let level = match std::env::var("TPMCRYPT_LOG").ok().as_deref() {
        Some("trace") => Level::TRACE,
        Some("debug") => Level::DEBUG,
        Some("warn") => Level::WARN,
        Some("error") => Level::ERROR,
        _ if verbose => Level::DEBUG,
        _ => Level::INFO,
    };
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(sink.clone())
        .event_format(format)
        .finish();
    // Already set (only if run twice in one process): keep the first.
    let _ = tracing::subscriber::set_global_default(subscriber);
    Ok(sink)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_line_of_ours_starts_a_log() {
        let now = crate::ui::rfc3339(std::time::SystemTime::now());
        for level in ["ERROR", "WARN", "INFO", "DEBUG", "TRACE"] {
            let line = format!("{now} {level} tpmcrypt::watch: session 1\nmore");
            assert!(is_log_line(line.as_bytes()), "{line}");
        }
        for text in [
            "-----BEGIN PRIVATE KEY-----\n",
            "root:x:0:0:root:/root:/bin/bash\n",
            "2026-11-27T19:00:00.123Z INFO\n",
            "2026-11-27T19:00:00.123Z NOTICE tpmcrypt::watch: x\n",
            "yesterday INFO tpmcrypt::watch: x\n",
            "",
        ] {
            assert!(!is_log_line(text.as_bytes()), "{text}");
        }
        assert!(!is_log_line(b"\xff\xfe INFO a: b"));
    }
}
