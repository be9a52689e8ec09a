//! A file's identity and version (device, inode, size, time stamps, mode):
//! taken before a file is read and compared after, so that an input that
//! changed while it was read is never taken for what was read, and an
//! original is removed only if it is still the file that was encrypted.
//! Used by `encrypt`/`decrypt` and by the watch daemon.

use std::os::unix::fs::MetadataExt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The identity and version of a source file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    /// Device.
    pub dev: u64,
    /// Inode.
    pub ino: u64,
    /// Size.
    pub size: u64,
    /// mtime, ns since the epoch.
    pub mtime_ns: i128,
    /// ctime, ns since the epoch.
    pub ctime_ns: i128,
    /// Mode bits.
    pub mode: u32,
    /// Hard links (names) it has.
    pub nlink: u64,
}

fn now_ns() -> i128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i128)
        .unwrap_or(0)
}

impl Stamp {
    /// From metadata.
    pub fn of(m: &std::fs::Metadata) -> Stamp {
        Stamp {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
            ctime_ns: m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128,
            mode: m.mode(),
            nlink: m.nlink(),
        }
    }

    /// How long ago the file was last modified (zero if in the future).
    pub fn age(&self) -> Duration {
        let ns = (now_ns() - self.mtime_ns).max(0);
        Duration::from_nanos(ns.min(u64::MAX as i128) as u64)
    }

    /// Whether mtime is implausibly far in the future (clock skew, touch -d).
    pub fn mtime_in_future(&self) -> bool {
        self.mtime_ns > now_ns() + 1_000_000_000
    }
}
