//! Low-level file access for the watcher: opening a path beneath SRC
//! without following any symlink, probing for writers with a file lease,
//! and removing a verified source.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path};

pub use crate::atomic::{lstat_at, rename_noreplace_at, unlink_at, Kind};

fn cstr(name: &OsStr) -> io::Result<CString> {
    CString::new(name.as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name contains NUL"))
}

fn openat(dir: &impl AsRawFd, name: &OsStr, flags: i32) -> io::Result<OwnedFd> {
    let c = cstr(name)?;
    // SAFETY: valid directory fd and NUL-terminated name.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags | libc::O_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by openat and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Why a path could not be opened as a regular file beneath SRC.
#[derive(Debug)]
pub enum OpenError {
    /// Not a regular file (or a directory on the way is a symlink).
    NotRegular(Kind),
    /// An I/O error (NotFound: gone).
    Io(io::Error),
}

impl From<io::Error> for OpenError {
    fn from(e: io::Error) -> Self {
        // O_NOFOLLOW on a symlink gives ELOOP.
        match e.raw_os_error() {
            Some(libc::ELOOP) => OpenError::NotRegular(Kind::Symlink),
            _ => OpenError::Io(e),
        }
    }
}

/// Opens `rel` (relative to the SRC directory `root`) for reading, walking
/// one component at a time with O_NOFOLLOW, so that no symlink anywhere on
/// the path is followed and nothing outside SRC is read. Non-regular files
/// are refused before they are opened (opening a device can have side
/// effects). Returns the file and, when `want_parent`, its directory open.
///
/// A file directly in SRC is looked up through `root` itself: its own
/// descriptor for the parent (`openat(root, ".")`) is opened only when
/// asked for, since each such open is one more inotify event in SRC (a
/// duplicate of `root` would not do: it would share `root`'s `flock`s).
pub fn open_beneath(
    root: &File,
    rel: &Path,
    want_parent: bool,
) -> Result<(Option<OwnedFd>, File), OpenError> {
    let mut names = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) => names.push(n),
            Component::CurDir => {}
            _ => {
                return Err(OpenError::Io(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "path escapes SRC",
                )))
            }
        }
    }
    let Some((last, dirs)) = names.split_last() else {
        return Err(OpenError::NotRegular(Kind::Dir));
    };
    // The directory reached so far; None while it is `root`.
    let mut dir: Option<OwnedFd> = None;
    for d in dirs {
        let at = dir.as_ref().map_or(root.as_raw_fd(), AsRawFd::as_raw_fd);
        let next = openat(
            &at,
            d,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        );
        dir = Some(match next {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
                let kind = lstat_at(&at, d).map(|k| k.0).unwrap_or(Kind::Symlink);
                return Err(OpenError::NotRegular(kind));
            }
            Err(e) => return Err(e.into()),
        });
    }
    let at = dir.as_ref().map_or(root.as_raw_fd(), AsRawFd::as_raw_fd);
    let (kind, _, _) = lstat_at(&at, last)?;
    if kind != Kind::File {
        return Err(OpenError::NotRegular(kind));
    }
    // O_NONBLOCK: should the entry be swapped for a FIFO meanwhile, the
    // open does not hang (and fstat then refuses it).
    let fd = openat(
        &at,
        last,
        libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY,
    )?;
    let file = File::from(fd);
    let kind = Kind::from_mode(file.metadata()?.mode());
    if kind != Kind::File {
        return Err(OpenError::NotRegular(kind));
    }
    let parent = match dir {
        Some(fd) => want_parent.then_some(fd),
        None if want_parent => Some(openat(
            root,
            OsStr::new("."),
            libc::O_RDONLY | libc::O_DIRECTORY,
        )?),
        None => None,
    };
    Ok((parent, file))
}

/// Whether anybody has a file open for writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writers {
    /// Nobody (a read lease was granted).
    None,
    /// Some process has it open for writing.
    Busy,
    /// Cannot tell: leases are not available (not the file's owner and no
    /// CAP_LEASE, or the file system does not support them).
    Unknown,
}

/// Takes a read lease on `file` (held until [`unlease`] or close). The
/// kernel grants one only when no process has the file open for writing.
/// SIGIO, sent if a writer opens the file while the lease is held, must be
/// ignored by the process ([`ignore_sigio`]).
pub fn lease(file: &File) -> Writers {
    // SAFETY: fcntl on a valid fd with an integer argument.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLEASE, libc::F_RDLCK) };
    if rc == 0 {
        return Writers::None;
    }
    match io::Error::last_os_error().raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EBUSY) => Writers::Busy,
        _ => Writers::Unknown,
    }
}

/// Releases a lease taken by [`lease`].
pub fn unlease(file: &File) {
    // SAFETY: fcntl on a valid fd with an integer argument.
    unsafe {
        libc::fcntl(file.as_raw_fd(), libc::F_SETLEASE, libc::F_UNLCK);
    }
}

/// Probes for writers without keeping a lease.
pub fn writers(file: &File) -> Writers {
    let w = lease(file);
    if w == Writers::None {
        unlease(file);
    }
    w
}

pub use crate::atomic::{aside_name, parse_aside, ASIDE_MARKER, RESTORED_MARKER};

/// `fsync` on a directory (or any fd).
pub fn fsync(fd: &impl AsRawFd) -> io::Result<()> {
    // SAFETY: valid fd.
    if unsafe { libc::fsync(fd.as_raw_fd()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether the read lease taken by [`lease`] is still held with no break
/// pending (a writer opening the file breaks it: `F_GETLEASE` then answers
/// `F_UNLCK`).
pub fn lease_intact(file: &File) -> bool {
    // SAFETY: fcntl on a valid fd.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETLEASE) };
    rc == libc::F_RDLCK
}

/// Opens the directory `rel` beneath `root` (no symlink followed).
pub fn open_dir_beneath(root: &File, rel: &Path) -> io::Result<OwnedFd> {
    let mut dir = openat(root, OsStr::new("."), libc::O_RDONLY | libc::O_DIRECTORY)?;
    for c in rel.components() {
        match c {
            Component::Normal(n) => {
                dir = openat(
                    &dir,
                    n,
                    libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                )?
            }
            Component::CurDir => {}
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "path escapes SRC",
                ))
            }
        }
    }
    Ok(dir)
}

/// The device and inode of an open file or directory.
fn id_of(fd: &impl AsRawFd) -> io::Result<(u64, u64)> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat on a valid descriptor into a buffer of its type.
    if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: initialised by the successful fstat.
    let st = unsafe { st.assume_init() };
    Ok((st.st_dev, st.st_ino))
}

/// Whether the open directory `dir` is still the directory `rel` beneath
/// `root`, looked up now one component at a time with no symlink
/// followed (`rel` empty: `root` itself). A directory opened earlier
/// follows the directory wherever it is moved, in SRC or out of it.
pub fn is_still_beneath(root: &File, rel: &Path, dir: &impl AsRawFd) -> bool {
    let mut at: Option<OwnedFd> = None;
    for c in rel.components() {
        let name = match c {
            Component::Normal(n) => n,
            Component::CurDir => continue,
            _ => return false,
        };
        let from = at.as_ref().map_or(root.as_raw_fd(), AsRawFd::as_raw_fd);
        match openat(
            &from,
            name,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        ) {
            Ok(fd) => at = Some(fd),
            Err(_) => return false,
        }
    }
    let now = match &at {
        Some(fd) => id_of(fd),
        None => id_of(root),
    };
    matches!((now, id_of(dir)), (Ok(a), Ok(b)) if a == b)
}

/// Ignores SIGIO (a lease break would otherwise kill the process).
pub fn ignore_sigio() {
    // SAFETY: setting a signal disposition to SIG_IGN.
    unsafe {
        libc::signal(libc::SIGIO, libc::SIG_IGN);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn a_directory_is_beneath_only_where_it_is_now() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        fs::create_dir_all(d.join("src/a/b")).unwrap();
        fs::create_dir(d.join("out")).unwrap();
        let root = File::open(d.join("src")).unwrap();
        let b = File::open(d.join("src/a/b")).unwrap();
        assert!(is_still_beneath(&root, Path::new("a/b"), &b));
        assert!(!is_still_beneath(&root, Path::new("a"), &b));
        // SRC itself, for a file at the top.
        assert!(is_still_beneath(&root, Path::new(""), &root));
        // Renamed inside SRC: not at its old path, at its new one.
        fs::rename(d.join("src/a"), d.join("src/c")).unwrap();
        assert!(!is_still_beneath(&root, Path::new("a/b"), &b));
        assert!(is_still_beneath(&root, Path::new("c/b"), &b));
        // A symlink at the old path to where it is now is not followed.
        std::os::unix::fs::symlink("c", d.join("src/a")).unwrap();
        assert!(!is_still_beneath(&root, Path::new("a/b"), &b));
        // Moved out of SRC.
        fs::rename(d.join("src/c"), d.join("out/c")).unwrap();
        assert!(!is_still_beneath(&root, Path::new("c/b"), &b));
        assert!(!is_still_beneath(&root, Path::new("../out/c/b"), &b));
    }

    #[test]
    fn symlinks_are_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::create_dir(d.join("sub")).unwrap();
        fs::write(d.join("sub/f"), b"x").unwrap();
        std::os::unix::fs::symlink("/etc", d.join("etc")).unwrap();
        std::os::unix::fs::symlink("sub/f", d.join("link")).unwrap();
        std::os::unix::fs::symlink("sub", d.join("sublink")).unwrap();
        let root = File::open(d).unwrap();
        assert!(open_beneath(&root, Path::new("sub/f"), true).is_ok());
        for p in ["etc/passwd", "link", "sublink/f"] {
            match open_beneath(&root, Path::new(p), false) {
                Err(OpenError::NotRegular(Kind::Symlink)) => {}
                other => panic!("{p}: {other:?}"),
            }
        }
        assert!(matches!(
            open_beneath(&root, Path::new("../x"), true),
            Err(OpenError::Io(_))
        ));
        assert!(matches!(
            open_beneath(&root, Path::new("sub"), false),
            Err(OpenError::NotRegular(Kind::Dir))
        ));
    }

    #[test]
    fn the_parent_is_opened_only_when_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::create_dir(d.join("sub")).unwrap();
        fs::write(d.join("top"), b"t").unwrap();
        fs::write(d.join("sub/f"), b"f").unwrap();
        let root = File::open(d).unwrap();
        let id = |fd: &OwnedFd| {
            let m = File::from(fd.try_clone().unwrap()).metadata().unwrap();
            (m.dev(), m.ino())
        };
        let of = |p: &Path| {
            let m = fs::metadata(p).unwrap();
            (m.dev(), m.ino())
        };
        for (rel, parent) in [("top", d.to_path_buf()), ("sub/f", d.join("sub"))] {
            let (none, file) = open_beneath(&root, Path::new(rel), false).unwrap();
            assert!(none.is_none(), "{rel}");
            let m = file.metadata().unwrap();
            assert_eq!((m.dev(), m.ino()), of(&d.join(rel)), "{rel}");
            let (some, _) = open_beneath(&root, Path::new(rel), true).unwrap();
            assert_eq!(id(&some.expect("asked for")), of(&parent), "{rel}");
        }
    }

    #[test]
    fn aside_names_round_trip() {
        let a = aside_name(OsStr::new("app.log"), ASIDE_MARKER);
        let (pid, name) = parse_aside(&a).unwrap();
        assert_eq!(pid, std::process::id() as i32);
        assert_eq!(name, Some(OsStr::new("app.log")));
        let long = "x".repeat(250);
        let a = aside_name(OsStr::new(&long), ASIDE_MARKER);
        assert!(a.len() <= 255);
        assert_eq!(parse_aside(&a).unwrap().1, None);
        assert!(parse_aside(OsStr::new("app.log.tpmcrypt-removing.1.0123456789abcdef")).is_none());
        assert!(parse_aside(OsStr::new(".a.tpmcrypt-removing.1.notahexnumber00")).is_none());
        let r = aside_name(OsStr::new("a"), RESTORED_MARKER);
        assert!(parse_aside(&r).is_none());
    }

    #[test]
    fn lease_sees_writers() {
        ignore_sigio();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let w = File::create(&p).unwrap();
        let r = File::open(&p).unwrap();
        assert_ne!(writers(&r), Writers::None);
        drop(w);
        // A child that another test thread is forking holds a copy of `w`
        // until its exec: a moment, so a few tries.
        let mut seen = writers(&r);
        for _ in 0..100 {
            if seen != Writers::Busy {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
            seen = writers(&r);
        }
        assert_ne!(seen, Writers::Busy);
    }
}
