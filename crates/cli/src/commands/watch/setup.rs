//! Start-up checks: SRC, DEST and the state directory made canonical and
//! kept apart (nothing the daemon writes may be inside SRC), DEST and the
//! state directory created and locked; and the roots' identities, checked
//! while running.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::Context as _;

use super::{show, WatchArgs};
use crate::ui::exit::usage;

/// SRC, DEST and the state directory, canonical, checked and locked.
pub struct Dirs {
    /// The watched directory.
    pub src: PathBuf,
    /// Where ciphertexts go.
    pub dest: PathBuf,
    /// The state directory (journal, lock).
    pub state: PathBuf,
    /// DEST did not exist and was created.
    pub dest_created: bool,
    /// Their identities at start.
    pub roots: Roots,
    /// The state directory's lock and DEST's, held (never read) until this
    /// is dropped, in that order.
    _locks: (File, File),
}

/// Checks and prepares SRC, DEST and the state directory (see the module's
/// comment); a usage error (exit 2) when they overlap.
pub fn prepare(args: &WatchArgs) -> anyhow::Result<Dirs> {
    let (src_arg, dest_arg) = (&args.src, &args.out);
    // SRC, DEST, state: canonical, DEST and state not inside SRC.
    let src = fs::canonicalize(src_arg).with_context(|| src_arg.display().to_string())?;
    if !fs::metadata(&src)?.is_dir() {
        return Err(usage(format!(
            "{}: SRC is not a directory",
            src_arg.display()
        )));
    }
    if let Some(other) = watched_dest_around(&src) {
        return Err(usage(format!(
            "SRC {} is inside {}, the DEST of a tpmcrypt watch (it holds {}): its ciphertext \
             would be encrypted again{}",
            show(&src),
            show(&other),
            STATE_DIR,
            if args.delete_plaintext {
                " and removed"
            } else {
                ""
            }
        )));
    }
    let dest_canon = canonical_to_be(dest_arg)?;
    if dest_canon.starts_with(&src) {
        return Err(usage(format!(
            "DEST {} is inside SRC {}: ciphertext would be encrypted again",
            dest_canon.display(),
            src.display()
        )));
    }
    let state_arg = args
        .state_dir
        .clone()
        .unwrap_or_else(|| dest_canon.join(STATE_DIR));
    let state_canon = canonical_to_be(&state_arg)?;
    if state_canon.starts_with(&src) {
        return Err(usage(format!(
            "--state-dir {} is inside SRC {}",
            state_canon.display(),
            src.display()
        )));
    }
    // Files the daemon itself writes: inside SRC each write would be
    // encrypted again (a new version every interval, or every log line).
    for (flag, file) in [("--stats-json", &args.stats_json), ("--log", &args.log)] {
        if let Some(file) = file {
            let canon = canonical_to_be(file)?;
            if canon.starts_with(&src) {
                return Err(usage(format!(
                    "{flag} {} is inside SRC {}: it would be encrypted again every time it is written",
                    canon.display(),
                    src.display()
                )));
            }
        }
    }
    // Appended to: never other data, a block device or a directory.
    if let Some(file) = &args.log {
        if let Some(why) = super::log::append_refusal(file) {
            return Err(usage(format!("--log {}: {why}", file.display())));
        }
    }
    // Replaced at every interval: never a device (as root, `/dev/null`
    // became a file), a key, or anything but figures written before.
    if let Some(file) = &args.stats_json {
        if let Some(why) = crate::statsfile::replace_refusal(file, super::stats::watch_figures) {
            return Err(usage(format!("--stats-json {}: {why}", file.display())));
        }
    }
    let dest_created = fs::symlink_metadata(&dest_canon).is_err();
    fs::create_dir_all(&dest_canon).map_err(|e| not_writable(&dest_canon, "DEST", e))?;
    let dest = fs::canonicalize(&dest_canon)?;
    probe_writable(&dest).map_err(|e| not_writable(&dest, "DEST", e))?;
    fs::create_dir_all(&state_canon)
        .map_err(|e| not_writable(&state_canon, "the state directory", e))?;
    let state = fs::canonicalize(&state_canon)?;
    let dest_lock = lock_dest(&dest)?;
    let lock = lock_state(&state)?;
    let roots = Roots::new(&src, &dest, &state, &lock)?;

    Ok(Dirs {
        src,
        dest,
        state,
        dest_created,
        roots,
        _locks: (lock, dest_lock),
    })
}

/// SRC, DEST, the state directory and its lock file as they were at
/// start, by device and inode: a directory removed (and perhaps
/// recreated), moved away or mounted over is no longer the one watched or
/// locked.
pub struct Roots {
    src: (PathBuf, (u64, u64)),
    /// DEST: its path, and its device and inode.
    pub dest: (PathBuf, (u64, u64)),
    state: (PathBuf, (u64, u64)),
    lock: (PathBuf, (u64, u64)),
}

fn dev_ino(m: &fs::Metadata) -> (u64, u64) {
    (m.dev(), m.ino())
}

impl Roots {
    fn new(src: &Path, dest: &Path, state: &Path, lock: &File) -> anyhow::Result<Roots> {
        let id = |p: &Path| -> anyhow::Result<(PathBuf, (u64, u64))> {
            let m = fs::symlink_metadata(p).with_context(|| show(p))?;
            Ok((p.to_path_buf(), dev_ino(&m)))
        };
        Ok(Roots {
            src: id(src)?,
            dest: id(dest)?,
            state: id(state)?,
            lock: (state.join("lock"), dev_ino(&lock.metadata()?)),
        })
    }

    /// An error message if any of them changed.
    pub fn check(&self) -> Result<(), String> {
        let same = |(p, id): &(PathBuf, (u64, u64))| {
            fs::symlink_metadata(p).is_ok_and(|m| dev_ino(&m) == *id)
        };
        if !same(&self.src) {
            return Err(format!(
                "{}: SRC was removed, moved or replaced: stopping (a restart watches the \
                 directory that has its name now)",
                show(&self.src.0)
            ));
        }
        if !same(&self.dest) {
            return Err(format!(
                "{}: DEST was removed, moved or replaced: stopping (it is not recreated: its \
                 lock and journal went with it)",
                show(&self.dest.0)
            ));
        }
        if !same(&self.state) || !same(&self.lock) {
            return Err(format!(
                "{}: the state directory's lock was removed or replaced: stopping (another \
                 daemon could take this DEST)",
                show(&self.lock.0)
            ));
        }
        Ok(())
    }
}

/// The default state directory's name, inside DEST.
const STATE_DIR: &str = ".tpmcrypt-watch";

/// The directory, `src` or one of its ancestors, that is (or was) the DEST
/// of a tpmcrypt watch: it holds a state directory with a lock file.
fn watched_dest_around(src: &Path) -> Option<PathBuf> {
    src.ancestors()
        .find(|dir| {
            fs::symlink_metadata(dir.join(STATE_DIR).join("lock")).is_ok_and(|m| m.is_file())
        })
        .map(Path::to_path_buf)
}

/// The canonical form `path` will have once created: its deepest existing
/// ancestor canonicalised, plus the rest.
fn canonical_to_be(path: &Path) -> anyhow::Result<PathBuf> {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()?.join(path)
    };
    let mut existing = abs.as_path();
    let mut rest = Vec::new();
    loop {
        match fs::canonicalize(existing) {
            Ok(mut out) => {
                for part in rest.iter().rev() {
                    match part {
                        std::path::Component::ParentDir => {
                            out.pop();
                        }
                        std::path::Component::Normal(n) => out.push(n),
                        _ => {}
                    }
                }
                return Ok(out);
            }
            Err(_) => match existing.components().next_back() {
                Some(last) if existing.parent().is_some() => {
                    rest.push(last);
                    existing = existing.parent().unwrap_or(Path::new("/"));
                }
                _ => return Err(usage(format!("{}: not a usable path", path.display()))),
            },
        }
    }
}

fn not_writable(path: &Path, what: &str, e: io::Error) -> anyhow::Error {
    anyhow::anyhow!("{}: {what} is not writable: {e}", path.display())
}

fn probe_writable(dir: &Path) -> io::Result<()> {
    let f = crate::atomic::AtomicFile::create(&dir.join(".tpmcrypt-watch-probe"), 0o600, true)?;
    drop(f);
    Ok(())
}

/// Takes an exclusive `flock` on `f` without waiting; false if another
/// process holds one.
fn try_lock(f: &File) -> bool {
    // SAFETY: flock on a valid fd.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// Holds an exclusive lock on DEST itself: one daemon per DEST, whatever
/// their state directories.
fn lock_dest(dest: &Path) -> anyhow::Result<File> {
    let f = File::open(dest).with_context(|| show(dest))?;
    // A run that names something in DEST holds its shared lock for the
    // microseconds that takes (`atomic::naming_in`): not another daemon.
    let mut tries = 0;
    while !try_lock(&f) {
        if tries == 50 {
            return Err(anyhow::anyhow!(
                "{}: another tpmcrypt watch is using this DEST",
                show(dest)
            ));
        }
        tries += 1;
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    Ok(f)
}

/// Holds an exclusive lock on the state directory: one daemon per state
/// directory.
fn lock_state(state: &Path) -> anyhow::Result<File> {
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(state.join("lock"))
        .map_err(|e| not_writable(state, "the state directory", e))?;
    if !try_lock(&f) {
        return Err(anyhow::anyhow!(
            "{}: another tpmcrypt watch is using this state directory",
            state.display()
        ));
    }
    Ok(f)
}
