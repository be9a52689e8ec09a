//! Logging for the daemon: `LEVEL target: message` lines through `tracing`,
//! on stderr (journald-friendly: no colours unless `ui::colour` allows, and a
//! `<N>` syslog priority prefix when stderr is the journal) or appended to
//! a `--log` file that SIGHUP reopens (for logrotate).

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::registry::LookupSpan;

/// Where log lines go.
#[derive(Clone)]
pub struct Sink {
    file: Option<(PathBuf, Arc<Mutex<File>>)>,
}

impl Sink {
    fn open(path: &Path) -> io::Result<File> {
        OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o640)
            .open(path)
    }

    /// Reopens the log file (after logrotate moved it away). Returns false
    /// when logging to stderr (nothing to reopen).
    pub fn reopen(&self) -> io::Result<bool> {
        let Some((path, file)) = &self.file else {
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
    /// The log file.
    File(&'a Mutex<File>),
}

impl Write for LineWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            LineWriter::Stderr(s) => s.write(buf),
            LineWriter::File(f) => f.lock().unwrap_or_else(|e| e.into_inner()).write(buf),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        match self {
            LineWriter::Stderr(s) => s.lock().write_all(buf),
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
        match &self.file {
            Some((_, f)) => LineWriter::File(f),
            None => LineWriter::Stderr(io::stderr()),
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
    let sink = match log_file {
        Some(p) => {
            let f = Sink::open(p)
                .map_err(|e| anyhow::Error::from(e).context(format!("--log {}", p.display())))?;
            Sink {
                file: Some((p.to_path_buf(), Arc::new(Mutex::new(f)))),
            }
        }
        None => Sink { file: None },
    };
    let on_stderr = log_file.is_none();
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
