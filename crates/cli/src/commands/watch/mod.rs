//! `tpmcrypt watch`: a daemon that keeps a directory encrypted. Every file
//! closed after writing in SRC (recursively) is encrypted, once it has
//! settled, to DEST under the same relative path plus `.tpmc`, crash-safely;
//! with `--delete-plaintext` the source is removed once its ciphertext is
//! durable and verified. See docs/watch.md.
//!
//! Threads: notify's inotify reader feeds a bounded event channel; one
//! coordinator owns all state (pending files de-duplicated by path, settle
//! timers, the journal, the stats) and hands jobs to N workers through a
//! bounded channel; the workers share one `Encryptor` per session and hand
//! complete ciphertexts to one committer thread, which makes them durable
//! in groups (`commit.rs`, on `crate::batch`) and sends the outcomes back.
//!
//! The coordinator (`coord.rs`) is glue: it checks and locks the
//! directories (`setup.rs`), feeds inotify events, scans and worker
//! outcomes to the scheduling state machine (`schedule.rs`: settle timers,
//! ready queue, retries, what becomes of a file after an attempt; given the
//! time, never reading it) and carries out the rest (jobs, journal, stats,
//! log).

mod commit;
mod coord;
mod fsio;
mod journal;
mod log;
mod scan;
mod schedule;
mod setup;
mod stats;
mod units;
mod worker;

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;

/// The daemon's duration and size syntax (`--settle 10ms`), for tools that
/// start the daemon and take the same flags (the bench's load generator).
#[cfg(feature = "bench")]
pub use units::{parse_duration, parse_size};

use crate::args::value::ModeArg;

/// `tpmcrypt watch`.
#[derive(Args, Debug)]
pub struct WatchArgs {
    /// Directory to watch, recursively. Symlinks in it are never followed.
    pub src: PathBuf,

    /// Where ciphertext goes: SRC/a/b.txt becomes DEST/a/b.txt.tpmc. Must
    /// not be inside SRC.
    #[arg(long, value_name = "DEST")]
    pub out: PathBuf,

    /// Recipient: a recovery recipient string (tpmcrypt-recovery:…), or a
    /// recipients file ("-" for stdin): recovery recipient lines and PEM
    /// public keys, # comments. May be repeated.
    #[arg(short = 'R', long = "recipient", value_name = "RECIPIENT")]
    pub recipients: Vec<std::ffi::OsString>,

    /// A key from the keystore, by name (its public half only).
    #[arg(short = 'k', long = "key", value_name = "NAME")]
    pub keys: Vec<String>,

    /// Remove each source once its ciphertext is durable and has been
    /// decrypted and compared with it. A source on which no file lease can
    /// be taken (the daemon is neither root nor its owner) is kept.
    #[arg(long)]
    pub delete_plaintext: bool,

    /// Files encrypted at once, 1 to 1024 (default: number of CPUs). The work is
    /// mostly waiting for fsync: on slow disks more workers help.
    #[arg(long, value_name = "N", value_parser = crate::options::parse_workers)]
    pub workers: Option<usize>,

    /// Payload mode.
    #[arg(long, value_enum, default_value_t = ModeArg::Gcm)]
    pub mode: ModeArg,

    /// How long a file must stay unmodified after it is closed before it is
    /// taken (ms, s, m, h).
    #[arg(long, value_name = "DURATION", default_value = "200ms", value_parser = units::parse_duration)]
    pub settle: Duration,

    /// Write statistics as JSON to FILE (atomically, every --stats-interval
    /// and at exit). An existing FILE must be empty or hold figures
    /// written before.
    #[arg(long, value_name = "FILE")]
    pub stats_json: Option<PathBuf>,

    /// How often statistics are logged and written.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = units::parse_duration)]
    pub stats_interval: Duration,

    /// Serve Prometheus metrics at http://ADDR/metrics (loopback only,
    /// e.g. 127.0.0.1:9464).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,

    /// Draw a new session key this often (default: one per run).
    #[arg(long, value_name = "DURATION", value_parser = units::parse_duration)]
    pub rotate: Option<Duration>,

    /// State directory (journal, lock) [default: DEST/.tpmcrypt-watch].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,

    /// Log to FILE instead of stderr (SIGHUP reopens it). FILE must be new,
    /// empty, a log this daemon wrote, a FIFO or a character device; `-`
    /// or /dev/stdout means standard output. Other data is never appended to.
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
}

/// Runs the daemon.
pub fn run(args: &WatchArgs, ui: &crate::ui::Ui) -> anyhow::Result<i32> {
    coord::run(args, ui)
}

/// A path for log lines and messages: its bytes as they are where they are
/// UTF-8 (control characters escaped), every other byte as `\xNN`, so that
/// two names that differ only in such bytes are shown differently. For
/// display only: the daemon itself handles paths as bytes.
fn show(path: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut out = String::new();
    for chunk in path.as_os_str().as_bytes().utf8_chunks() {
        out.push_str(&crate::ui::printable(chunk.valid()));
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;

    #[test]
    fn show_escapes_bytes_that_are_not_utf8() {
        let shown = |b: &[u8]| show(Path::new(OsStr::from_bytes(b)));
        assert_eq!(shown(b"caf\xe9.txt"), "caf\\xe9.txt");
        assert_eq!(shown(b"caf\xe8.txt"), "caf\\xe8.txt");
        assert_eq!(shown("d/café\n".as_bytes()), "d/café\\n");
    }
}
