//! Ownership checks for the paths tpmcrypt trusts with secrets: the agent's
//! socket and its directory, and the keystore.
//!
//! The rule, the same as OpenSSH and GnuPG apply to their sockets and key
//! directories: a path is trusted only if nobody but the caller (and root)
//! could have put it there or changed it since.
//! * the object itself (the keystore directory, a key file, the socket and
//!   the directory holding it) is owned by the caller's effective uid and is
//!   not writable by group or others;
//! * every directory above it is owned by the caller or by root, and is not
//!   writable by group or others unless it has the sticky bit (as `/tmp`
//!   has), where only an entry's owner may rename or remove it.
//!
//! A Unix socket is further checked on every connection: the process on the
//! other end must run as the caller's uid ([`peer_uid`], `SO_PEERCRED`).

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

const GROUP_OTHER_WRITE: u32 = 0o022;
const STICKY: u32 = 0o1000;

/// The caller's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

fn untrusted(path: &Path, why: String) -> Error {
    Error::Untrusted {
        path: path.to_path_buf(),
        why,
    }
}

/// The deepest of `path` and its ancestors that this process can see
/// (`.` for a relative path none of whose directories can be seen), and
/// the ones below it, deepest first: missing, or in a directory we may not
/// search.
pub(crate) fn deepest_existing(path: &Path) -> (&Path, Vec<&Path>) {
    let mut missing = Vec::new();
    let mut at = path;
    while fs::symlink_metadata(at).is_err() {
        missing.push(at);
        match at.parent() {
            Some(p) if !p.as_os_str().is_empty() => at = p,
            _ => {
                at = Path::new(".");
                break;
            }
        }
    }
    (at, missing)
}

/// Opens the lock file `path`, creating it (mode 0600) where it is
/// missing: never through a symlink, never blocking, and only a regular
/// file of the caller's (`what` names it in errors).
pub(crate) fn open_lock_file(path: &Path, what: &str) -> Result<fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(untrusted(path, format!("{what} is not a regular file")));
    }
    check_owned(path, &meta, what)?;
    Ok(file)
}

static LOCK_WAIT_HOOK: std::sync::OnceLock<fn(&Path, &str)> = std::sync::OnceLock::new();

/// Has `hook` called with a lock file's path and what it locks (`the
/// keystore's lock`, `the simulator's state lock`) the first time this
/// process waits for such a lock that another process holds: a run that
/// would otherwise wait without a word, behind a stopped process.
pub fn on_lock_wait(hook: fn(lock: &Path, what: &str)) {
    let _ = LOCK_WAIT_HOOK.set(hook);
}

/// Says, through the hook of [`on_lock_wait`], that this process waits for
/// `what` (`lock`), unless `said` says it did already.
pub(crate) fn say_lock_wait(said: &std::sync::atomic::AtomicBool, lock: &Path, what: &str) {
    if let Some(hook) = LOCK_WAIT_HOOK.get() {
        if !said.swap(true, std::sync::atomic::Ordering::SeqCst) {
            hook(lock, what);
        }
    }
}

/// Whether `path` still names `file` (the same inode): a lock file removed
/// or replaced since it was opened stands between no two processes.
pub(crate) fn still_names(path: &Path, file: &fs::File) -> bool {
    match (fs::symlink_metadata(path), file.metadata()) {
        (Ok(named), Ok(open)) => named.dev() == open.dev() && named.ino() == open.ino(),
        _ => false,
    }
}

/// Takes `how` (`LOCK_EX`, `LOCK_SH`) on `file` without waiting: false
/// if another process holds a lock that stands in the way.
pub(crate) fn try_flock(file: &fs::File, how: libc::c_int) -> std::io::Result<bool> {
    loop {
        // SAFETY: flock on a descriptor the caller owns.
        if unsafe { libc::flock(file.as_raw_fd(), how | libc::LOCK_NB) } == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::WouldBlock => return Ok(false),
            std::io::ErrorKind::Interrupted => {}
            _ => return Err(e),
        }
    }
}

/// Checks that `meta` (of `path`) is owned by the caller and not writable
/// by group or others. `what` names the object in the error.
pub fn check_private(path: &Path, meta: &fs::Metadata, what: &str) -> Result<()> {
    check_owned(path, meta, what)?;
    let mode = meta.mode() & 0o7777;
    if mode & GROUP_OTHER_WRITE != 0 {
        return Err(untrusted(
            path,
            format!(
                "{what} is writable by other users (mode {:04o}); fix it with chmod go-w",
                mode
            ),
        ));
    }
    Ok(())
}

/// Checks that `meta` (of `path`) is owned by the caller. Enough for a
/// socket, whose write permission lets others connect (which the agent
/// refuses by their uid) but not replace it (which its directory decides).
pub fn check_owned(path: &Path, meta: &fs::Metadata, what: &str) -> Result<()> {
    let me = euid();
    if meta.uid() != me {
        return Err(untrusted(
            path,
            format!(
                "{what} is owned by uid {}, not by you (uid {me}); another user may have put it there",
                meta.uid()
            ),
        ));
    }
    Ok(())
}

/// `path` made absolute against the working directory, as the kernel
/// resolves it; an empty path is the working directory.
fn absolute(path: &Path) -> Result<PathBuf> {
    if path.is_absolute() {
        return Ok(path.to_path_buf());
    }
    let cwd = std::env::current_dir().map_err(|e| Error::io(".", e))?;
    Ok(cwd.join(path))
}

/// Checks the symlinks on the way to `path`, as it is spelt: a symlink
/// that another user owns (say, in a sticky `/tmp`) could be re-pointed at
/// any moment, so the path is not trusted whatever it points to now.
fn check_symlinks_on_the_way(path: &Path) -> Result<()> {
    let me = euid();
    let mut prefix = PathBuf::new();
    for component in absolute(path)?.components() {
        prefix.push(component);
        let Ok(meta) = fs::symlink_metadata(&prefix) else {
            continue;
        };
        if meta.file_type().is_symlink() && meta.uid() != me && meta.uid() != 0 {
            return Err(untrusted(
                &prefix,
                format!(
                    "this symlink on the way to {} is owned by uid {}, neither you nor root, \
                     who can re-point it",
                    path.display(),
                    meta.uid()
                ),
            ));
        }
    }
    Ok(())
}

/// Checks every directory above `path` (which must exist), both as `path`
/// is spelt (no symlink of another user on the way) and as it resolves:
/// owned by the caller or root, and not writable by group or others unless
/// sticky.
pub fn check_ancestors(path: &Path) -> Result<()> {
    check_chain(path, 1, path)
}

/// As [`check_ancestors`], and `dir` itself by the same rule: a directory
/// in which something of the caller's may be created (its owner the caller
/// or root; not writable by others unless sticky).
pub fn check_dir_to_create_in(dir: &Path) -> Result<()> {
    check_chain(dir, 0, &dir.join("…"))
}

/// The rule of [`check_above`] for every directory of `path`, once
/// resolved, but the last `skip`; messages name `shown`.
fn check_chain(path: &Path, skip: usize, shown: &Path) -> Result<()> {
    check_symlinks_on_the_way(path)?;
    let canonical = fs::canonicalize(absolute(path)?).map_err(|e| Error::io(path, e))?;
    for dir in canonical.ancestors().skip(skip) {
        check_above(dir, shown)?;
    }
    Ok(())
}

/// The rule for a directory `dir` above `path`.
fn check_above(dir: &Path, path: &Path) -> Result<()> {
    let meta = fs::metadata(dir).map_err(|e| Error::io(dir, e))?;
    if meta.uid() != euid() && meta.uid() != 0 {
        return Err(untrusted(
            dir,
            format!(
                "this directory above {} is owned by uid {}, neither you nor root",
                path.display(),
                meta.uid()
            ),
        ));
    }
    let mode = meta.mode() & 0o7777;
    if mode & GROUP_OTHER_WRITE != 0 && mode & STICKY == 0 {
        return Err(untrusted(
            dir,
            format!(
                "this directory above {} is writable by other users (mode {:04o}) and not sticky",
                path.display(),
                mode
            ),
        ));
    }
    Ok(())
}

/// Checks a directory the caller keeps secrets in: a directory, private
/// ([`check_private`]), under trusted ancestors ([`check_ancestors`]).
pub fn check_private_dir(dir: &Path, what: &str) -> Result<()> {
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    check_ancestors(dir)?;
    let link = fs::symlink_metadata(dir).map_err(|e| Error::io(dir, e))?;
    if link.file_type().is_symlink() {
        // Its owner was checked on the way; what it points to counts.
        check_owned(dir, &link, &format!("{what} (a symlink)"))?;
    }
    let meta = fs::metadata(dir).map_err(|e| Error::io(dir, e))?;
    if !meta.is_dir() {
        return Err(untrusted(dir, format!("{what} is not a directory")));
    }
    check_private(dir, &meta, what)
}

/// Creates what is missing of `dir`, each directory 0700: nothing is
/// created under a path another user could redirect. The deepest part
/// that exists must be a directory the caller may create in (its owner
/// the caller or root, not writable by others unless sticky, and the same
/// above it); then each missing directory is made alone and checked (the
/// caller's, private, not a symlink another user swapped in) before the
/// next is made inside it. `what` names them in errors.
pub(crate) fn create_private_dirs(dir: &Path, what: &str) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let (at, missing) = deepest_existing(dir);
    if missing.is_empty() {
        return Ok(());
    }
    check_dir_to_create_in(at)?;
    for d in missing.into_iter().rev() {
        match fs::DirBuilder::new().mode(0o700).create(d) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(Error::io(d, e)),
        }
        check_private_dir(d, what)?;
    }
    Ok(())
}

/// The largest key file, metadata or public key file tpmcrypt reads (real
/// ones are a few KiB): a key file that is `/dev/zero` must not eat memory.
pub const MAX_KEY_FILE: u64 = 1 << 20;

/// Reads a file the caller keeps keys in, without following a symlink and
/// without blocking on a FIFO: it must be a regular file owned by the
/// caller, not writable by others, and at most [`MAX_KEY_FILE`] bytes.
/// Checked on the open file itself (`fstat`), so nothing can be swapped in
/// between the check and the read.
pub fn read_private_file(path: &Path, what: &str) -> Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => untrusted(path, format!("{what} is a symlink")),
            _ => Error::io(path, e),
        })?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if !meta.file_type().is_file() {
        return Err(untrusted(path, format!("{what} is not a regular file")));
    }
    check_private(path, &meta, what)?;
    let mut data = Vec::new();
    file.take(MAX_KEY_FILE + 1)
        .read_to_end(&mut data)
        .map_err(|e| Error::io(path, e))?;
    if data.len() as u64 > MAX_KEY_FILE {
        return Err(untrusted(
            path,
            format!("{what} is larger than {MAX_KEY_FILE} bytes: not a key file"),
        ));
    }
    Ok(data)
}

/// The uid of the process at the other end of a connected Unix socket.
pub fn peer_uid(stream: &UnixStream) -> std::io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: u32::MAX,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid out-pointers of the right size.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// The directory an environment variable names, if it is set, not empty
/// and absolute. The XDG Base Directory specification has a relative
/// `XDG_DATA_HOME` or `XDG_RUNTIME_DIR` ignored (taken as it is, each
/// working directory would get a keystore or an agent socket of its own),
/// and `TMPDIR` is read the same way for the agent's socket.
pub fn env_dir(var: &str) -> Option<std::path::PathBuf> {
    std::env::var_os(var)
        .map(std::path::PathBuf::from)
        .filter(|p| p.is_absolute())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn private_dir_rules() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("d");
        fs::create_dir(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
        check_private_dir(&dir, "dir").unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
        let err = check_private_dir(&dir, "the keystore")
            .unwrap_err()
            .to_string();
        assert!(err.contains("writable by other users (mode 0777)"), "{err}");
        // A subdirectory of a world-writable, non-sticky directory.
        let sub = dir.join("s");
        fs::create_dir(&sub).unwrap();
        fs::set_permissions(&sub, fs::Permissions::from_mode(0o700)).unwrap();
        let err = check_private_dir(&sub, "dir").unwrap_err().to_string();
        assert!(err.contains("above"), "{err}");
        // Sticky makes it acceptable (as /tmp).
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o1777)).unwrap();
        check_private_dir(&sub, "dir").unwrap();
        // A file, not a directory.
        let file = sub.join("f");
        fs::write(&file, b"x").unwrap();
        assert!(check_private_dir(&file, "dir").is_err());
        fs::set_permissions(&file, fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_private_file(&file, "file").unwrap(), b"x");
        fs::set_permissions(&file, fs::Permissions::from_mode(0o646)).unwrap();
        assert!(read_private_file(&file, "file").is_err());
    }
}
