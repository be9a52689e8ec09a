//! Crash-safe output files: written with no name (`O_TMPFILE`, see
//! [`AtomicFile::create_unnamed`]) or under a temporary name in the target
//! directory, fsynced, given the final name only on complete success, and
//! the directory fsynced. A failed or interrupted run never leaves a
//! partial file under the final name. A file with no name leaves nothing
//! at all; a temporary is removed on drop, and one left by a crash
//! (kill -9) carries a recognisable name that later runs clean up. An
//! interrupt (Ctrl-C, SIGTERM, SIGHUP) removes the temporaries at once,
//! once [`remove_temporaries_on_interrupt`] is in force.

use std::collections::BTreeSet;
use std::ffi::{CStr, CString, OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::sync::{Mutex, MutexGuard};

use crate::ui::shown;

/// Marker in temporary file names: `.NAME.tpmcrypt-partial.PID.RANDOM`.
pub const PARTIAL_MARKER: &str = ".tpmcrypt-partial.";

/// The temporaries of this process that are being written. A rename into
/// place happens under its lock, so an interrupt sees each output either
/// as a temporary (and removes it) or complete under its final name.
/// A set, not a list: a batch holds thousands, and each rename takes one
/// out (a list made that O(n²)).
static PENDING: Mutex<BTreeSet<PathBuf>> = Mutex::new(BTreeSet::new());

fn pending() -> MutexGuard<'static, BTreeSet<PathBuf>> {
    // A panic elsewhere while holding it leaves the list itself intact.
    PENDING.lock().unwrap_or_else(|e| e.into_inner())
}

/// From now on SIGINT, SIGTERM and SIGHUP remove the temporaries being
/// written before the process ends by that signal (so a shell still sees
/// 130, 143 or 129). Without it they would wait, hidden, for the next run
/// with the same output to clean them up.
pub fn remove_temporaries_on_interrupt() -> io::Result<()> {
    // Once per process (the front installs it before its check).
    static INSTALLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if INSTALLED.swap(true, std::sync::atomic::Ordering::SeqCst) {
        return Ok(());
    }
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])?;
    std::thread::spawn(move || {
        if let Some(signal) = signals.forever().next() {
            INTERRUPTED.store(true, Ordering::SeqCst);
            remove_scratch_trees();
            // A TPM operation under way ends first, flushing what it
            // loaded (a TPM without a resource manager keeps it).
            tpmcrypt_tpmkey::operation::end_operations(std::time::Duration::from_secs(5));
            // Held to the end: no rename into place can follow the clean-up.
            let list = pending();
            for tmp in list.iter() {
                let _ = fs::remove_file(tmp);
            }
            let _ = signal_hook::low_level::emulate_default_handler(signal);
            std::process::exit(128 + signal);
        }
    });
    Ok(())
}

/// Set once an interrupt's clean-up has begun.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Called before the process ends with a command's result: while an
/// interrupt's clean-up runs, the main thread (which may have just seen a
/// child stopped by it fail) waits for it to end the process by the
/// signal, rather than end it first with its own error and code.
pub fn wait_if_interrupted() {
    while INTERRUPTED.load(Ordering::SeqCst) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Scratch trees of this process (`bench`, `bench watch`): the path and
/// whether an interrupt removes it (not with `--keep`).
static SCRATCH: Mutex<Vec<(PathBuf, bool)>> = Mutex::new(Vec::new());

fn scratch_trees() -> MutexGuard<'static, Vec<(PathBuf, bool)>> {
    SCRATCH.lock().unwrap_or_else(|e| e.into_inner())
}

/// A scratch tree under the interrupt's clean-up until dropped (see
/// [`scratch_on_interrupt`]).
#[cfg(feature = "bench")]
#[must_use = "the tree is looked after only while this is held"]
pub struct ScratchTree(PathBuf);

#[cfg(feature = "bench")]
impl Drop for ScratchTree {
    fn drop(&mut self) {
        scratch_trees().retain(|(p, _)| *p != self.0);
    }
}

/// From now on SIGINT, SIGTERM and SIGHUP first stop this process's
/// children (the programs working in `tree`: a watch daemon, `encrypt -r`
/// runs, swtpm; SIGTERM, then SIGKILL after 5 s), then remove `tree`
/// unless `remove` is false (`--keep`), then end the process as
/// [`remove_temporaries_on_interrupt`] does (128 + the signal).
#[cfg(feature = "bench")]
pub fn scratch_on_interrupt(tree: &Path, remove: bool) -> io::Result<ScratchTree> {
    remove_temporaries_on_interrupt()?;
    scratch_trees().push((tree.to_path_buf(), remove));
    Ok(ScratchTree(tree.to_path_buf()))
}

/// The interrupt's work on the scratch trees (see [`scratch_on_interrupt`]).
fn remove_scratch_trees() {
    let trees = scratch_trees().clone();
    if trees.is_empty() {
        return;
    }
    stop_children(std::time::Duration::from_secs(5));
    for (tree, _) in trees.iter().filter(|(_, remove)| *remove) {
        // The main thread may still be making entries (a file being
        // written into a tree): a few tries.
        for _ in 0..5 {
            match fs::remove_dir_all(tree) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                _ => break,
            }
        }
    }
}

/// This process's children, from /proc (every thread's).
fn children() -> Vec<libc::pid_t> {
    let mut pids = Vec::new();
    let Ok(tasks) = fs::read_dir("/proc/self/task") else {
        return pids;
    };
    for task in tasks.flatten() {
        let list = fs::read_to_string(task.path().join("children")).unwrap_or_default();
        pids.extend(
            list.split_whitespace()
                .filter_map(|p| p.parse::<libc::pid_t>().ok()),
        );
    }
    pids
}

/// Whether child `pid` has ended (or was reaped already), without reaping
/// it: whoever spawned it still waits for it.
fn ended(pid: libc::pid_t) -> bool {
    // SAFETY: waitid writes into the zeroed siginfo we pass.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let r = libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOWAIT | libc::WNOHANG,
        );
        r != 0 || info.si_pid() != 0
    }
}

/// Sends SIGTERM to every child, waits up to `grace` for them to end,
/// then SIGKILLs the rest and waits for them.
fn stop_children(grace: std::time::Duration) {
    let pids = children();
    for &pid in &pids {
        // SAFETY: signalling our own child (not yet reaped: listed above).
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let deadline = std::time::Instant::now() + grace;
    let mut left: Vec<libc::pid_t> = pids;
    while !left.is_empty() {
        left.retain(|&pid| !ended(pid));
        if std::time::Instant::now() > deadline {
            for &pid in &left {
                // SAFETY: as above.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while !left.is_empty() && std::time::Instant::now() < end {
                left.retain(|&pid| !ended(pid));
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The longest file name Linux file systems take (ext4, xfs, btrfs, tmpfs).
const NAME_MAX: usize = 255;

/// The start of a temporary's name, `.NAME.tpmcrypt-partial.`, before the
/// PID and a random part. NAME keeps its bytes (it need not be UTF-8) but
/// is shortened, at a character boundary when it is UTF-8, so that the
/// whole name stays within the 255 bytes a file name may have: an output
/// whose own name is near that limit still gets a temporary.
fn partial_prefix(name: &OsStr) -> OsString {
    // The limit less the dot, the marker, a PID of up to 10 digits, a dot
    // and 16 hex digits.
    const NAME_ROOM: usize = NAME_MAX - 1 - PARTIAL_MARKER.len() - 10 - 1 - 16;
    let name = name.as_bytes();
    let mut end = name.len().min(NAME_ROOM);
    // Back over UTF-8 continuation bytes (at most three).
    let is_continuation = |b: u8| b & 0xc0 == 0x80;
    let mut back = 0;
    while end < name.len() && back < 3 && end > 0 && is_continuation(name[end]) {
        end -= 1;
        back += 1;
    }
    let mut prefix = b".".to_vec();
    prefix.extend_from_slice(&name[..end]);
    prefix.extend_from_slice(PARTIAL_MARKER.as_bytes());
    OsString::from_vec(prefix)
}

/// Whether a file name is of the exact form of a temporary
/// (`.NAME.tpmcrypt-partial.PID.` and 16 hex digits): a user's file that
/// merely contains the marker is not one.
pub fn is_temporary_name(name: &[u8]) -> bool {
    stale_temporary_pid(name).is_some()
}

/// An output file being written.
pub struct AtomicFile {
    tmp: PathBuf,
    dest: PathBuf,
    file: File,
    replace: bool,
    synced: bool,
    /// Written with no name at all (`O_TMPFILE`), linked in at commit:
    /// see [`AtomicFile::create_unnamed`].
    unnamed: bool,
    /// The directory an unnamed file was created in (`O_PATH`), which
    /// it is linked into: not whatever the path names by then.
    dir: Option<Arc<OutputDir>>,
}

impl AtomicFile {
    /// Starts writing `dest`. `mode` is applied to the file before it gets
    /// its final name. Fails early when `dest` exists and `replace` is false.
    pub fn create(dest: &Path, mode: u32, replace: bool) -> io::Result<Self> {
        let (dir, name) = check_dest(dest, replace)?;
        Self::create_named(dest, dir, name, mode, replace)
    }

    /// Starts writing `dest`, which must not exist, as a file with no name
    /// (`O_TMPFILE`) that gets `dest` as its first name at commit
    /// (`linkat`, which never replaces). Creating and naming it then costs
    /// the directory one entry, where a temporary costs two and a rename;
    /// and an interrupted or killed run leaves nothing behind, not even a
    /// temporary for the next run to clean up. Only where the file system
    /// takes `O_TMPFILE`, `/proc/self/fd` can name the file, and `syncfs`
    /// makes it durable (see [`syncfs_is_durable`]): elsewhere this is
    /// [`AtomicFile::create`] with a temporary.
    ///
    /// `known_absent`: the caller saw `dest`'s directory without it a
    /// moment ago, so it is not looked up again (if it appeared since, the
    /// commit still refuses to replace it). `durable`: the output is to be
    /// made durable; one that is not (`--no-sync`) is written with no name
    /// wherever the file system takes `O_TMPFILE`, `syncfs` or not.
    pub fn create_unnamed(
        dest: &Path,
        mode: u32,
        known_absent: bool,
        durable: bool,
    ) -> io::Result<Self> {
        let (dir, name) = match known_absent {
            true => name_of(dest)?,
            false => check_dest(dest, false)?,
        };
        match open_unnamed(dir, durable)? {
            Some((file, dir)) => {
                file.set_permissions(fs::Permissions::from_mode(mode & 0o7777))?;
                Ok(AtomicFile {
                    tmp: PathBuf::new(),
                    dest: dest.to_path_buf(),
                    file,
                    replace: false,
                    synced: false,
                    unnamed: true,
                    dir: Some(dir),
                })
            }
            None => Self::create_named(dest, dir, name, mode, false),
        }
    }

    fn create_named(
        dest: &Path,
        dir: &Path,
        name: &OsStr,
        mode: u32,
        replace: bool,
    ) -> io::Result<Self> {
        let (tmp, file) = under_temporary_name(dir, name, |tmp| {
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(tmp)
        })?;
        file.set_permissions(fs::Permissions::from_mode(mode & 0o7777))?;
        Ok(AtomicFile {
            tmp,
            dest: dest.to_path_buf(),
            file,
            replace,
            synced: false,
            unnamed: false,
            dir: None,
        })
    }

    /// Gives the file, before anything is written to it, the owner and
    /// group `uid`, `gid` (those of the original it replaces), then `mode`
    /// again. Nothing is changed when it has them already; a user who may
    /// not give a file away (not root) gets the error, and nothing is left.
    pub fn set_owner(&mut self, uid: u32, gid: u32, mode: u32) -> io::Result<()> {
        use std::os::unix::fs::MetadataExt;
        let meta = self.file.metadata()?;
        if (meta.uid(), meta.gid()) == (uid, gid) {
            return Ok(());
        }
        std::os::unix::fs::fchown(&self.file, Some(uid), Some(gid))?;
        // chown may clear bits of the mode; set it once more.
        self.file
            .set_permissions(fs::Permissions::from_mode(mode & 0o7777))
    }

    /// The file to write to.
    pub fn file(&mut self) -> &mut File {
        &mut self.file
    }

    /// Makes the data durable (fsync), so that a full disk or an I/O error
    /// is seen before [`AtomicFile::commit`], which then does not sync again.
    pub fn sync(&mut self) -> io::Result<()> {
        self.file.sync_all()?;
        self.synced = true;
        Ok(())
    }

    /// Makes the file durable and gives it its final name: fsync the data
    /// (unless [`AtomicFile::sync`] did), rename (refusing to replace unless
    /// allowed), fsync the directory.
    pub fn commit(mut self) -> io::Result<()> {
        if !self.synced {
            self.file.sync_all()?;
        }
        let unnamed = self.unnamed;
        self.rename()?;
        if unnamed {
            // Its link count changed from 0 to 1 on the way: without a
            // journal, the directory's fsync does not write the file's
            // inode, which must not stay unlinked on disk.
            self.file.sync_all()?;
        }
        sync_dir(parent_dir(&self.dest))
    }

    /// Gives the file its final name once its data is durable (the caller
    /// made it so: [`AtomicFile::sync`], or a `syncfs` of its file system),
    /// without syncing the directory: a batch syncs each directory once.
    ///
    /// A file made by [`AtomicFile::create_unnamed`] is returned: its link
    /// count went from 0 to 1, and without a journal no directory sync
    /// writes that, so the caller makes its inode durable too (an `fsync`
    /// of it, or a `syncfs` of its file system).
    pub fn rename_durable(mut self) -> io::Result<Option<File>> {
        let unnamed = self.unnamed;
        self.rename()?;
        if !unnamed {
            return Ok(None);
        }
        match self.file.try_clone() {
            Ok(file) => Ok(Some(file)),
            // No descriptor to spare: make it durable here instead.
            Err(_) => self.file.sync_all().map(|()| None),
        }
    }

    /// The file system of the file, as `syncfs` takes it.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.file.as_fd()
    }

    /// The temporary, opened again for reading (it is written through a
    /// write-only descriptor): the same inode, never a symlink, so that
    /// what is read back is what was written.
    pub fn open_for_reading(&self) -> io::Result<File> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::MetadataExt;
        let f = if self.unnamed {
            // The descriptor's own file (this process's /proc entry).
            File::open(format!("/proc/self/fd/{}", self.file.as_raw_fd()))?
        } else {
            OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&self.tmp)?
        };
        let (a, b) = (f.metadata()?, self.file.metadata()?);
        if (a.dev(), a.ino()) != (b.dev(), b.ino()) {
            return Err(io::Error::other("the temporary was replaced"));
        }
        Ok(f)
    }

    /// The final name.
    pub fn dest(&self) -> &Path {
        &self.dest
    }

    /// The device of the file system the file is on (0 if unknown).
    pub fn file_dev(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        if let Some(dir) = &self.dir {
            // Made in that directory, so on its file system.
            return dir.id.0;
        }
        self.file.metadata().map(|m| m.dev()).unwrap_or(0)
    }

    /// Records that the data was made durable by other means (a `syncfs`
    /// of its file system that reported no error).
    pub fn mark_synced(&mut self) {
        self.synced = true;
    }

    /// Gives the file its final name without waiting for the disk, as `cp`
    /// does (`--no-sync`). A crash cannot leave a partial file under the
    /// final name, but a power failure soon after may: the kernel can
    /// persist the rename before the data. Such a file fails to decrypt; it
    /// never decrypts wrong. Never used when an original is to be removed.
    pub fn commit_unsynced(mut self) -> io::Result<()> {
        self.rename()
    }

    fn rename(&mut self) -> io::Result<()> {
        if self.unnamed {
            // Nothing an interrupt must remove: no lock to take.
            let dir = self.dir.take().ok_or_else(no_dir)?;
            link_unnamed(&self.file, &dir, &self.dest)?;
            self.unnamed = false;
            return still_there(&dir, &self.dest);
        }
        let mut list = pending();
        if self.replace {
            fs::rename(&self.tmp, &self.dest)?;
        } else {
            rename_noreplace(&self.tmp, &self.dest)?;
        }
        // From here the temporary name is gone; nothing for Drop to remove.
        list.remove(&self.tmp);
        self.tmp = PathBuf::new();
        Ok(())
    }
}

impl AtomicFile {
    /// Swaps the complete file with the one under its final name in one
    /// step (`renameat2(RENAME_EXCHANGE)`), so that name always holds one
    /// complete file or the other: the caller made the data durable. The
    /// file that was under the name is now under the temporary name,
    /// returned as [`Displaced`]. Where the file system cannot exchange,
    /// the file is renamed over the name instead (also one step; nothing
    /// is then displaced).
    pub fn exchange(mut self) -> io::Result<Displaced> {
        if self.unnamed {
            self.name_temporarily()?;
        }
        let (ctmp, cdest) = (cstring(&self.tmp)?, cstring(&self.dest)?);
        let mut list = pending();
        // SAFETY: two valid NUL-terminated paths, resolved as rename(2) would.
        let rc = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                ctmp.as_ptr(),
                libc::AT_FDCWD,
                cdest.as_ptr(),
                libc::RENAME_EXCHANGE,
            )
        };
        let tmp = std::mem::take(&mut self.tmp);
        if rc == 0 {
            // The temporary name stays in the list: an interrupt now
            // removes the displaced file, never the one under the name.
            return Ok(Displaced {
                path: tmp,
                dest: self.dest.clone(),
            });
        }
        let err = io::Error::last_os_error();
        if !matches!(err.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOSYS)) {
            self.tmp = tmp;
            return Err(err);
        }
        if let Err(e) = fs::rename(&tmp, &self.dest) {
            self.tmp = tmp;
            return Err(e);
        }
        list.remove(&tmp);
        Ok(Displaced {
            path: PathBuf::new(),
            dest: self.dest.clone(),
        })
    }
}

impl AtomicFile {
    /// Gives an unnamed file a temporary name (an exchange needs one).
    fn name_temporarily(&mut self) -> io::Result<()> {
        let (dir, name) = (parent_dir(&self.dest), self.dest.file_name());
        let name = name.ok_or_else(|| io::Error::other("output has no file name"))?;
        let fd = self.dir.as_ref().ok_or_else(no_dir)?;
        let file = &self.file;
        let (tmp, ()) = under_temporary_name(dir, name, |tmp| link_unnamed(file, fd, tmp))?;
        self.tmp = tmp;
        self.unnamed = false;
        let fd = self.dir.take().ok_or_else(no_dir)?;
        still_there(&fd, &self.dest)
    }
}

/// The file an [`AtomicFile::exchange`] took the name of, now under the
/// temporary name. Dropped, it is removed.
pub struct Displaced {
    path: PathBuf,
    dest: PathBuf,
}

impl Displaced {
    /// Where it is now (None when the file system could not exchange and
    /// the file under the name was replaced instead).
    pub fn path(&self) -> Option<&Path> {
        (!self.path.as_os_str().is_empty()).then_some(self.path.as_path())
    }

    /// Exchanges the two files back: the displaced file gets its name
    /// again, and the one that took it is removed.
    pub fn put_back(mut self) -> io::Result<()> {
        let Some(path) = self.path().map(Path::to_path_buf) else {
            return Err(io::Error::other("nothing to put back"));
        };
        let (cpath, cdest) = (cstring(&path)?, cstring(&self.dest)?);
        let _list = pending();
        // SAFETY: as in `exchange`.
        let rc = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                cpath.as_ptr(),
                libc::AT_FDCWD,
                cdest.as_ptr(),
                libc::RENAME_EXCHANGE,
            )
        };
        if rc != 0 {
            // The name holds a complete file; the displaced one is kept
            // under a name no clean-up of temporaries touches.
            let err = io::Error::last_os_error();
            let mut kept = self.dest.as_os_str().to_owned();
            kept.push(format!(".kept-{}", std::process::id()));
            let kept = PathBuf::from(kept);
            if rename_noreplace(&path, &kept).is_ok() {
                self.path = PathBuf::new();
                return Err(io::Error::other(format!("{err}; kept as {}", shown(&kept))));
            }
            self.path = PathBuf::new();
            return Err(io::Error::other(format!("{err}; kept as {}", shown(&path))));
        }
        Ok(())
    }

    /// Removes the displaced file.
    pub fn remove(mut self) -> io::Result<()> {
        let path = std::mem::take(&mut self.path);
        if path.as_os_str().is_empty() {
            return Ok(());
        }
        let mut list = pending();
        let r = fs::remove_file(&path);
        list.remove(&path);
        r
    }
}

impl Drop for Displaced {
    fn drop(&mut self) {
        if !self.path.as_os_str().is_empty() {
            let mut list = pending();
            let _ = fs::remove_file(&self.path);
            list.remove(&self.path);
        }
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            let mut list = pending();
            let _ = fs::remove_file(&self.tmp);
            list.remove(&self.tmp);
        }
    }
}

/// A writer that starts write-back of what it wrote every few MiB
/// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`), so the disk works while we
/// encrypt and the final fsync has little left to wait for.
pub struct Writeback<'a> {
    file: &'a mut File,
    written: u64,
    started: u64,
}

const WRITEBACK_CHUNK: u64 = 16 << 20;

impl<'a> Writeback<'a> {
    /// Wraps `file`, positioned at its start.
    pub fn new(file: &'a mut File) -> Self {
        Writeback {
            file,
            written: 0,
            started: 0,
        }
    }
}

impl io::Write for Writeback<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.file.write(buf)?;
        self.written += n as u64;
        if self.written - self.started >= WRITEBACK_CHUNK {
            use std::os::fd::AsRawFd;
            // SAFETY: a valid fd and a range inside what we wrote; the call
            // only schedules write-back. Its failure is harmless (the final
            // fsync still makes everything durable), so it is ignored.
            unsafe {
                libc::sync_file_range(
                    self.file.as_raw_fd(),
                    self.started as libc::off64_t,
                    (self.written - self.started) as libc::off64_t,
                    libc::SYNC_FILE_RANGE_WRITE,
                );
            }
            self.started = self.written;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

/// Runs `make` on a fresh temporary name for `name` in `dir` (a name
/// taken is tried again, 16 times at most), recording the name for an
/// interrupt to remove under the same lock. Returns the name and what
/// `make` made.
fn under_temporary_name<T>(
    dir: &Path,
    name: &OsStr,
    mut make: impl FnMut(&Path) -> io::Result<T>,
) -> io::Result<(PathBuf, T)> {
    let prefix = partial_prefix(name);
    naming_in(dir, || {
        let mut last_err = None;
        for _ in 0..16 {
            let mut tmp_name = prefix.clone();
            tmp_name.push(format!("{}.{:016x}", std::process::id(), random_u64()));
            let tmp = dir.join(tmp_name);
            let mut list = pending();
            match make(&tmp) {
                Ok(made) => {
                    list.insert(tmp.clone());
                    return Ok((tmp, made));
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last_err = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last_err.unwrap_or_else(|| io::Error::other("could not create a temporary file")))
    })
}

/// The checks made before an output is started: `dest` is not a directory,
/// does not exist unless it may be replaced, and has a name that fits.
/// Returns its directory and name.
fn check_dest(dest: &Path, replace: bool) -> io::Result<(&Path, &OsStr)> {
    match fs::symlink_metadata(dest) {
        // Not even --force replaces a directory.
        Ok(m) if m.is_dir() => {
            return Err(io::Error::other(format!(
                "{} is a directory (an output is a file)",
                shown(dest)
            )))
        }
        Ok(_) if !replace => return Err(exists(dest)),
        _ => {}
    }
    name_of(dest)
}

/// `dest`'s directory and name, refusing a name too long for a file.
fn name_of(dest: &Path) -> io::Result<(&Path, &OsStr)> {
    let dir = parent_dir(dest);
    let name = dest
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "output has no file name"))?;
    if name.len() > NAME_MAX {
        // Known before any work is done, rather than at the rename.
        return Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG));
    }
    Ok((dir, name))
}

/// A directory that outputs with no name are created in and linked into
/// (`O_PATH`: only the write and search permissions any new file needs),
/// and its identity when opened.
struct OutputDir {
    fd: OwnedFd,
    id: (u64, u64),
    /// Whether `syncfs` makes files in it durable ([`syncfs_is_durable`]),
    /// asked once per directory rather than once per file.
    syncfs_durable: bool,
}

impl OutputDir {
    fn open(dir: &Path) -> io::Result<Arc<Self>> {
        use std::os::unix::fs::MetadataExt;
        let f = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
            .open(dir)?;
        let m = f.metadata()?;
        Ok(Arc::new(OutputDir {
            id: (m.dev(), m.ino()),
            syncfs_durable: syncfs_is_durable(std::os::fd::AsFd::as_fd(&f)),
            fd: OwnedFd::from(f),
        }))
    }

    /// `dir` opened, or the one this thread opened last if that was it
    /// (a walk gives a thread many files of one directory in a row):
    /// one open per directory, not per file. With `fresh`, opened anew.
    fn cached(dir: &Path, fresh: bool) -> io::Result<Arc<Self>> {
        use std::cell::RefCell;
        thread_local! {
            static LAST: RefCell<Option<(PathBuf, Arc<OutputDir>)>> = const { RefCell::new(None) };
        }
        LAST.with(|last| {
            let mut last = last.borrow_mut();
            match &*last {
                Some((p, d)) if !fresh && p == dir => Ok(d.clone()),
                _ => {
                    *last = None;
                    let d = Self::open(dir)?;
                    *last = Some((dir.to_path_buf(), d.clone()));
                    Ok(d)
                }
            }
        })
    }

    /// A new file with no name in it (`O_TMPFILE`, mode 0600).
    fn tmpfile(&self) -> io::Result<File> {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: openat relative to a valid directory descriptor, with a
        // NUL-terminated name; a new descriptor is owned by the File below.
        let fd = unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c".".as_ptr(),
                libc::O_WRONLY | libc::O_TMPFILE | libc::O_CLOEXEC,
                0o600 as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just opened, owned by nothing else.
        Ok(unsafe { File::from_raw_fd(fd) })
    }
}

/// A new file with no name in `dir` (`O_TMPFILE`, mode 0600), with the
/// directory it is in, or None where that cannot be used: the file system
/// does not take it, or is not one whose `syncfs` makes it durable, or
/// `/proc/self/fd` is not there to give it a name later.
fn open_unnamed(dir: &Path, durable: bool) -> io::Result<Option<(File, Arc<OutputDir>)>> {
    use std::sync::OnceLock;
    static PROC_FD: OnceLock<bool> = OnceLock::new();
    if !*PROC_FD.get_or_init(|| Path::new("/proc/self/fd").is_dir()) {
        return Ok(None);
    }
    let mut out_dir = OutputDir::cached(dir, false)?;
    // A file system whose `syncfs` is not durable (ext4 without a journal)
    // is known before any file is made there: none is made to be dropped.
    if durable && !out_dir.syncfs_durable {
        return Ok(None);
    }
    let mut made = out_dir.tmpfile();
    if made
        .as_ref()
        .is_err_and(|e| e.raw_os_error() == Some(libc::ENOENT))
    {
        // The directory opened before was removed since: the path's own.
        out_dir = OutputDir::cached(dir, true)?;
        made = out_dir.tmpfile();
    }
    let file = match made {
        Ok(f) => f,
        // Not taken by this file system (or kernel): a temporary instead.
        Err(e) => {
            return match e.raw_os_error() {
                Some(libc::EOPNOTSUPP) | Some(libc::EISDIR) | Some(libc::EINVAL) => Ok(None),
                _ => Err(e),
            }
        }
    };
    // On the directory's file system, whose kind was asked once.
    Ok((out_dir.syncfs_durable || !durable).then_some((file, out_dir)))
}

/// Gives the unnamed `file` its first name: `dest`'s file name in `dir`,
/// the directory it was created in (not whatever `dest`'s directory path
/// names by now: another user who may write its parent could have put a
/// symlink to a directory of theirs there), never replacing one (`linkat`
/// of `/proc/self/fd/N`, which needs no privilege, where `AT_EMPTY_PATH`
/// would).
fn link_unnamed(file: &File, dir: &OutputDir, dest: &Path) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let from = CString::new(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map_err(|_| io::Error::other("descriptor path"))?;
    // The last component as written (`Path::file_name` drops a trailing
    // `/` or `/.`, which name a directory: refused as a link by path is).
    let name = match dest.as_os_str().as_bytes().rsplit(|&b| b == b'/').next() {
        Some(b"") => return Err(io::Error::from_raw_os_error(libc::ENOTDIR)),
        Some(b".") | Some(b"..") | None => return Err(io::Error::from_raw_os_error(libc::ENOENT)),
        Some(name) => name,
    };
    let to = CString::new(name).map_err(|_| io::Error::other("NUL in a name"))?;
    // The descriptor itself (`AT_EMPTY_PATH`) where this process may, which
    // spares the kernel the lookup of the /proc path: with the capability
    // to (root), or a kernel that lets the opener of an O_TMPFILE do it.
    // Refused once (ENOENT), it is not asked again.
    if !EMPTY_PATH_REFUSED.load(Ordering::Relaxed) {
        // SAFETY: a valid descriptor, an empty NUL-terminated path, a valid
        // directory descriptor and NUL-terminated name.
        let rc = unsafe {
            libc::linkat(
                file.as_raw_fd(),
                c"".as_ptr(),
                dir.fd.as_raw_fd(),
                to.as_ptr(),
                libc::AT_EMPTY_PATH,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::ENOENT) | Some(libc::EPERM) | Some(libc::EINVAL) => {
                EMPTY_PATH_REFUSED.store(true, Ordering::Relaxed)
            }
            Some(libc::EEXIST) => return Err(exists(dest)),
            _ => return Err(err),
        }
    }
    // SAFETY: a valid NUL-terminated path and name, a valid directory
    // descriptor; AT_SYMLINK_FOLLOW makes the link to the file the
    // descriptor is open on.
    let rc = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            from.as_ptr(),
            dir.fd.as_raw_fd(),
            to.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EEXIST) => Err(exists(dest)),
        _ => Err(err),
    }
}

/// Set once `linkat(AT_EMPTY_PATH)` was refused (see [`link_unnamed`]).
static EMPTY_PATH_REFUSED: AtomicBool = AtomicBool::new(false);

/// After a link into `dir`: an error if `dest`'s directory path no longer
/// names `dir` (moved or replaced during the run), for the run to report
/// rather than take for done what is not where it was asked for.
fn still_there(dir: &OutputDir, dest: &Path) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let created_in = dir.id;
    match fs::metadata(parent_dir(dest)).map(|m| (m.dev(), m.ino())) {
        Ok(now) if now == created_in => Ok(()),
        _ => Err(io::Error::other(format!(
            "the directory of {} was moved or replaced during the run; \
             the output was named in the directory it was created in",
            shown(dest)
        ))),
    }
}

/// An unnamed file without its directory (never: kept from creation).
fn no_dir() -> io::Error {
    io::Error::other("the output's directory is not known")
}

/// Whether `syncfs` on `fd`'s file system makes its data durable: only on
/// file systems known to write back on `syncfs` (by `statfs` type). FUSE
/// (sshfs, ntfs-3g, gocryptfs, bindfs) does not pass it to its server,
/// nor does a network file system reliably; those, and every unknown
/// type, get an `fsync` per file. So does ext2, or ext4 made without a
/// journal ([`journal_in`]): there a batch's removals and the next
/// batch's writes reach the disk in any order, and a power cut left an
/// original under its name holding another file's blocks (a crash test on
/// such a file system, `docs/reliability.md` row 33).
pub fn syncfs_is_durable(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    match fs_kind(fd) {
        Some(EXT_MAGIC) => device_of(fd).is_some_and(ext4_has_journal),
        Some(kind) => SYNCFS_DURABLE.contains(&kind),
        None => false,
    }
}

/// ext2, ext3 and ext4 (one `statfs` type).
const EXT_MAGIC: u64 = 0xEF53;

/// File systems known to write back on `syncfs` (ext: when journaled).
const SYNCFS_DURABLE: [u64; 8] = [
    EXT_MAGIC,
    0x5846_5342, // xfs
    0x9123_683E, // btrfs
    0xF2F5_2010, // f2fs
    0x2FC1_2FC1, // zfs
    0x0102_1994, // tmpfs (nothing to write back)
    0x8584_58F6, // ramfs (nothing to write back)
    0x794C_7630, // overlayfs: syncs its upper file system
];

/// The device of the file system `fd` is on.
fn device_of(fd: std::os::fd::BorrowedFd<'_>) -> Option<u64> {
    use std::os::fd::AsRawFd;
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat on a valid descriptor into a buffer of its type.
    if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: initialised by the successful fstat.
    Some(unsafe { st.assume_init() }.st_dev)
}

/// [`journal_in`] this machine's `/sys` and `/proc`, asked once a device
/// in a run.
fn ext4_has_journal(dev: u64) -> bool {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static SEEN: Mutex<Option<HashMap<u64, bool>>> = Mutex::new(None);
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    *seen
        .get_or_insert_with(HashMap::new)
        .entry(dev)
        .or_insert_with(|| journal_in(dev, Path::new("/sys"), Path::new("/proc")))
}

/// Whether the file system on device `dev`, if the kernel's ext4 driver
/// mounts it, keeps a journal: `PROC/fs/ext4/NAME/options` lists a
/// `data=` mode only then (NAME, the block device's, from
/// `SYS/dev/block/MAJ:MIN/uevent`). True for a device the ext4 driver does
/// not show (another file system, or no `/proc` or `/sys` to read):
/// only a mount found without a journal is told apart.
fn journal_in(dev: u64, sys: &Path, proc: &Path) -> bool {
    let read = |p: PathBuf| fs::read_to_string(p).ok();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    read(sys.join(format!("dev/block/{major}:{minor}/uevent")))
        .and_then(|uevent| {
            uevent
                .lines()
                .find_map(|l| l.strip_prefix("DEVNAME="))
                .map(str::to_string)
        })
        // The kernel names a superblock `cciss!c0d0p1` for `cciss/c0d0p1`.
        .map(|name| name.replace('/', "!"))
        .filter(|name| !name.is_empty() && name != "." && name != "..")
        .and_then(|name| read(proc.join("fs/ext4").join(name).join("options")))
        .map_or(true, |options| {
            options.lines().any(|l| l.starts_with("data="))
        })
}

/// `statfs` type of `fd`'s file system.
fn fs_kind(fd: std::os::fd::BorrowedFd<'_>) -> Option<u64> {
    use std::os::fd::AsRawFd;
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: fstatfs on a valid descriptor into a buffer of its type.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: initialised by the successful fstatfs.
    Some(unsafe { st.assume_init() }.f_type as u64 & 0xFFFF_FFFF)
}

fn exists(dest: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!("{} already exists (use --force to overwrite)", shown(dest)),
    )
}

/// The directory a path lives in ("." for a bare name).
pub fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// fsyncs a directory so that a rename or unlink in it is durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    open_directory(dir)?.sync_all()
}

fn cstring(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))
}

/// Renames `from` to `to` unless `to` exists: rename(2) that fails if the
/// destination exists, so two concurrent runs never both end up "writing"
/// one output.
pub fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let (cfrom, cto) = (cstring(from)?, cstring(to)?);
    // AT_FDCWD resolves them as rename(2) would.
    match renameat_noreplace(libc::AT_FDCWD, &cfrom, &cto) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(exists(to)),
        r => r,
    }
}

/// `renameat2(dir, from, dir, to, RENAME_NOREPLACE)`; on a file system
/// without that flag, `linkat` (which refuses to replace too), then the
/// old name unlinked. `to` taken: AlreadyExists.
fn renameat_noreplace(dir: std::os::fd::RawFd, from: &CStr, to: &CStr) -> io::Result<()> {
    // SAFETY: `dir` is AT_FDCWD or an open directory of the caller's, the
    // names NUL-terminated.
    if unsafe { libc::renameat2(dir, from.as_ptr(), dir, to.as_ptr(), libc::RENAME_NOREPLACE) } == 0
    {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EINVAL) | Some(libc::ENOSYS) => {
            // SAFETY: as above.
            if unsafe { libc::linkat(dir, from.as_ptr(), dir, to.as_ptr(), 0) } != 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: as above.
            if unsafe { libc::unlinkat(dir, from.as_ptr(), 0) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        }
        _ => Err(err),
    }
}

/// What a directory entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link (never followed).
    Symlink,
    /// A FIFO.
    Fifo,
    /// A socket.
    Socket,
    /// A device node.
    Device,
}

impl Kind {
    /// From a `st_mode`.
    pub fn from_mode(mode: u32) -> Kind {
        match mode & libc::S_IFMT {
            libc::S_IFREG => Kind::File,
            libc::S_IFDIR => Kind::Dir,
            libc::S_IFLNK => Kind::Symlink,
            libc::S_IFIFO => Kind::Fifo,
            libc::S_IFSOCK => Kind::Socket,
            _ => Kind::Device,
        }
    }

    /// For log lines.
    pub fn name(self) -> &'static str {
        match self {
            Kind::File => "regular file",
            Kind::Dir => "directory",
            Kind::Symlink => "symlink",
            Kind::Fifo => "FIFO",
            Kind::Socket => "socket",
            Kind::Device => "device",
        }
    }
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`: kind, device, inode.
pub fn lstat_at(dir: &impl AsRawFd, name: &OsStr) -> io::Result<(Kind, u64, u64)> {
    let c = cstring(Path::new(name))?;
    // SAFETY: an all-zero stat is a valid out-buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd, NUL-terminated name, valid out-pointer.
    let rc = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            c.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((Kind::from_mode(st.st_mode), st.st_dev, st.st_ino))
}

/// Removes `name` from `dir` (`unlinkat`). Not durable yet: callers sync
/// the directories of a batch's removals together.
pub fn unlink_at(dir: &impl AsRawFd, name: &OsStr) -> io::Result<()> {
    let c = cstring(Path::new(name))?;
    // SAFETY: valid directory fd and NUL-terminated name.
    if unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// [`rename_noreplace`] within one open directory: `renameat2(dir, from,
/// dir, to, RENAME_NOREPLACE)`, never replacing `to` (AlreadyExists), and
/// on a file system without that flag `linkat` then `unlinkat`.
pub fn rename_noreplace_at(dir: &impl AsRawFd, from: &OsStr, to: &OsStr) -> io::Result<()> {
    let (f, t) = (cstring(Path::new(from))?, cstring(Path::new(to))?);
    renameat_noreplace(dir.as_raw_fd(), &f, &t)
}

/// A directory opened once for names of tpmcrypt's own made in it one
/// after another (originals moved aside for their removal), each made
/// under [`NamingDir::naming`]: the protocol of [`naming_in`] without
/// opening the directory (a path lookup, and a descriptor) for each, and
/// its entries named relative to it. A directory this user may write to
/// but not read is opened `O_PATH`, with its mark removed by path; one
/// that cannot be opened at all (no descriptor left) is worked on by path.
pub struct NamingDir {
    /// None: not opened; names are resolved from `path`.
    dir: Option<OwnedFd>,
    path: PathBuf,
    /// Opened for reading: its lock and mark are reached through `dir`.
    readable: bool,
}

impl NamingDir {
    /// Opens `dir` (as well as it can: see [`NamingDir`]).
    pub fn open(dir: &Path) -> NamingDir {
        let path = dir.to_path_buf();
        if let Some(d) = open_dir(dir) {
            return NamingDir {
                dir: Some(d.into()),
                path,
                readable: true,
            };
        }
        let d = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
            .open(dir);
        NamingDir {
            dir: d.ok().map(OwnedFd::from),
            path,
            readable: false,
        }
    }

    /// The path it was opened by.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `make`, which gives this directory a name of tpmcrypt's own,
    /// as [`naming_in_fd`] does: the mark removed first, the shared lock
    /// held until the name exists and released at once (a lock kept, even
    /// over one batch, could stop a watch daemon from taking its DEST).
    pub fn naming<T>(&self, make: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
        match &self.dir {
            Some(d) if self.readable => naming_in_fd(d, make),
            _ => {
                // Not readable: no lock, and the mark (which no run of this
                // user could set: setting it needs a listing) removed before
                // and after by path.
                remove_clean_mark_by_path(&self.path);
                let made = make();
                remove_clean_mark_by_path(&self.path);
                made
            }
        }
    }

    /// [`lstat_at`] of `name` in this directory.
    pub fn lstat(&self, name: &OsStr) -> io::Result<(Kind, u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        match &self.dir {
            Some(d) => lstat_at(d, name),
            None => fs::symlink_metadata(self.path.join(name))
                .map(|m| (Kind::from_mode(m.mode()), m.dev(), m.ino())),
        }
    }

    /// [`rename_noreplace_at`] in this directory.
    pub fn rename_noreplace(&self, from: &OsStr, to: &OsStr) -> io::Result<()> {
        match &self.dir {
            Some(d) => rename_noreplace_at(d, from, to),
            None => rename_noreplace(&self.path.join(from), &self.path.join(to)),
        }
    }

    /// [`unlink_at`] in this directory.
    pub fn unlink(&self, name: &OsStr) -> io::Result<()> {
        match &self.dir {
            Some(d) => unlink_at(d, name),
            None => fs::remove_file(self.path.join(name)),
        }
    }
}

pub(crate) fn random_u64() -> u64 {
    use rand_core::RngCore as _;
    rand_core::OsRng.next_u64()
}

/// Removes the temporaries crashed runs left in `dest`'s directory (of
/// processes no longer alive), at most once per directory and process: a
/// run over 2,000 files in one directory lists it once, not once per
/// output (which cost O(n²)). Returns how many were removed.
/// Only names of the exact form tpmcrypt gives its temporaries
/// (`.NAME.tpmcrypt-partial.PID.` and 16 hex digits) of dead processes go;
/// originals moved aside by dead processes are put back
/// ([`restore_moved_aside`]), never removed.
///
/// A directory that carries the clean mark ([`CLEAN_MARK`]) is not listed
/// at all, unless this run will itself give it names of its own
/// (`will_name`: it replaces a file, or removes originals): a script that
/// runs tpmcrypt once per file in a directory of 20,000 files paid about
/// 6 ms a process for the listing, 4 × the rest of a run. Every run that
/// gives a directory such a name removes the mark first
/// ([`naming_in`]), so a crashed run's leftovers are always listed by the
/// next run. A listing that found nothing left, made under the
/// directory's exclusive lock (no run was naming anything there
/// meanwhile), sets the mark, in a directory of [`MARK_FROM`] names or
/// more (a smaller one lists in less time than the mark takes). A sticky
/// directory (`/tmp`) is always listed: a run may not be able to remove a
/// mark there.
pub fn clean_stale_partials_once(dest: &Path, will_name: bool) -> usize {
    use std::collections::HashSet;
    use std::os::unix::fs::MetadataExt;
    use std::sync::OnceLock;
    static CLEANED: OnceLock<Mutex<HashSet<PathBuf>>> = OnceLock::new();
    let dir = parent_dir(dest).to_path_buf();
    {
        let mut cleaned = CLEANED
            .get_or_init(|| Mutex::new(HashSet::new()))
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if !cleaned.insert(dir.clone()) {
            return 0;
        }
    }
    let opened = open_dir(&dir);
    let meta = opened.as_ref().and_then(|d| d.metadata().ok());
    let markable = meta.as_ref().is_some_and(|m| m.mode() & libc::S_ISVTX == 0);
    if let (false, true, Some(d), Some(m)) = (will_name, markable, &opened, &meta) {
        if has_clean_mark(d, m) {
            return 0;
        }
    }
    // Held through the listing and the marking: a run naming something
    // here holds the shared lock from before it removes the mark until
    // its name exists, so either the listing sees the name or the mark
    // set here is removed after.
    let exclusive = match &opened {
        Some(d) if markable && !will_name => flock(d, libc::LOCK_EX | libc::LOCK_NB),
        _ => false,
    };
    // Let go of explicitly on every return: closing the descriptor alone
    // would leave it held while a child that another thread is forking
    // has a copy of it.
    let _unlock = opened.as_ref().filter(|_| exclusive).map(Unlock);
    let swept = sweep(&dir);
    if swept.listed < MARK_FROM {
        // Listed in microseconds: not worth a mark.
        return swept.removed;
    }
    if let (true, 0, Some(d), Some(m)) = (exclusive, swept.remaining, &opened, &meta) {
        // What was removed or put back is durable before the mark is.
        if swept.removed + swept.restored == 0 || d.sync_all().is_ok() {
            write_mark(d, &mark_value(m));
            // A run that could not take the shared lock may have named
            // something during the listing.
            if sweep(&dir).remaining > 0 {
                let _ = remove_clean_mark(d);
            }
        }
    }
    swept.removed
}

/// The size of directory, in names, from which a listing that found it
/// clean marks it: a smaller one is listed in less time than the mark
/// takes to set, and is left as it is.
const MARK_FROM: usize = 256;

/// What a listing of a directory for leftovers did and found.
struct Swept {
    /// Temporaries of dead processes removed.
    removed: usize,
    /// Originals moved aside by dead processes put back.
    restored: usize,
    /// Names of tpmcrypt's own still there: of live processes, or that
    /// could not be removed or put back.
    remaining: usize,
    /// Names in the directory, `.` and `..` included.
    listed: usize,
}

/// Lists `dir` once for the leftovers of crashed runs: removes their
/// temporaries and puts back their moved-aside originals.
fn sweep(dir: &Path) -> Swept {
    let mut swept = Swept {
        removed: 0,
        restored: 0,
        remaining: 0,
        listed: 0,
    };
    // Both kinds of name are hidden ones (`parse_marked`).
    let listed = crate::dirscan::for_each_hidden_name(dir, |name| {
        let path = dir.join(name);
        if is_temporary_name(name.as_bytes()) {
            match remove_if_stale_temporary(&path, name.as_bytes()) {
                true => swept.removed += 1,
                false => swept.remaining += 1,
            }
        } else if parse_aside(name).is_some() {
            // An original moved aside is never removed: put back, or kept.
            match restore_moved_aside(&path) {
                Restored::Back(_) => swept.restored += 1,
                Restored::NotOurs | Restored::Left => swept.remaining += 1,
            }
        }
    });
    match listed {
        Ok(n) => swept.listed = n,
        // Not known to be clean.
        Err(_) => swept.remaining += 1,
    }
    swept
}

/// The extended attribute that marks a directory in which the last run
/// that listed it, holding its exclusive lock, found no name of
/// tpmcrypt's own (a temporary, an original moved aside): see
/// [`clean_stale_partials_once`]. Its value is the directory's device and
/// inode (16 bytes): a mark copied with the directory (`cp -a`,
/// `rsync -X`, `tar --xattrs`) onto one that may hold leftovers is not
/// trusted.
pub const CLEAN_MARK: &std::ffi::CStr = c"user.tpmcrypt.clean";

/// `dir` opened for its lock and its mark (following symbolic links, as
/// the paths of its files do); None where it cannot be.
fn open_dir(dir: &Path) -> Option<File> {
    open_directory(dir).ok()
}

/// Opens `dir` for reading, refusing anything but a directory: a name
/// another user swapped for a FIFO would otherwise block the open, and
/// the run with it, until someone wrote to the FIFO.
pub fn open_directory(dir: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(dir)
}

/// Lets go of a `flock` when dropped.
struct Unlock<'a>(&'a File);

impl Drop for Unlock<'_> {
    fn drop(&mut self) {
        flock(self.0, libc::LOCK_UN);
    }
}

fn flock(dir: &impl std::os::fd::AsRawFd, op: libc::c_int) -> bool {
    // SAFETY: flock on an open descriptor.
    unsafe { libc::flock(dir.as_raw_fd(), op) == 0 }
}

/// The value of the mark for the directory of metadata `m`: its device
/// and inode.
fn mark_value(m: &fs::Metadata) -> [u8; 16] {
    use std::os::unix::fs::MetadataExt;
    let mut v = [0u8; 16];
    v[..8].copy_from_slice(&m.dev().to_le_bytes());
    v[8..].copy_from_slice(&m.ino().to_le_bytes());
    v
}

/// Whether `dir`, of metadata `m`, carries a mark set on this very
/// directory.
fn has_clean_mark(dir: &File, m: &fs::Metadata) -> bool {
    use std::os::fd::AsRawFd;
    let mut got = [0u8; 17];
    // SAFETY: reads at most got.len() bytes into a live buffer, on an open
    // descriptor.
    let n = unsafe {
        libc::fgetxattr(
            dir.as_raw_fd(),
            CLEAN_MARK.as_ptr(),
            got.as_mut_ptr().cast(),
            got.len(),
        )
    };
    n == 16 && got[..16] == mark_value(m)
}

/// Sets the mark to `v`; where it cannot be set (no extended attributes,
/// no right to), the directory is listed by every run, as before.
fn write_mark(dir: &File, v: &[u8; 16]) {
    use std::os::fd::AsRawFd;
    // SAFETY: a 16-byte value from a live buffer, on an open descriptor.
    unsafe {
        libc::fsetxattr(
            dir.as_raw_fd(),
            CLEAN_MARK.as_ptr(),
            v.as_ptr().cast(),
            v.len(),
            0,
        )
    };
}

/// Removes the mark, durably when there was one: a crash must not leave a
/// name of ours in a directory whose mark says there is none.
fn remove_clean_mark(dir: &impl std::os::fd::AsRawFd) -> io::Result<()> {
    // Looked for first: a removal takes the directory's inode lock for
    // writing even when there is nothing to remove, so it waits behind
    // every name made or removed there (two threads removing originals in
    // one directory spent a tenth of their CPU spinning on that lock); a
    // look takes none. Only its answer "none there" (or "none possible")
    // skips the removal.
    // SAFETY: a size query (no buffer) of an attribute, on an open
    // descriptor.
    let size = unsafe {
        libc::fgetxattr(
            dir.as_raw_fd(),
            CLEAN_MARK.as_ptr(),
            std::ptr::null_mut(),
            0,
        )
    };
    if size < 0
        && matches!(
            io::Error::last_os_error().raw_os_error(),
            Some(libc::ENODATA | libc::EOPNOTSUPP)
        )
    {
        return Ok(());
    }
    // SAFETY: an attribute name on an open descriptor.
    if unsafe { libc::fremovexattr(dir.as_raw_fd(), CLEAN_MARK.as_ptr()) } != 0 {
        // None there (ENODATA), or none possible: nothing to undo. A mark
        // this user may not remove is only in a sticky directory, where
        // none is trusted.
        return Ok(());
    }
    // SAFETY: fsync on an open descriptor.
    match unsafe { libc::fsync(dir.as_raw_fd()) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Removes the mark of a directory this user may write to but not read
/// (a drop box), by its path: it cannot be opened, locked or synced.
fn remove_clean_mark_by_path(dir: &Path) {
    if let Ok(c) = cstring(dir) {
        // SAFETY: two valid NUL-terminated strings.
        unsafe { libc::removexattr(c.as_ptr(), CLEAN_MARK.as_ptr()) };
    }
}

/// Runs `make`, which gives directory `dir` a name of tpmcrypt's own (a
/// temporary, an original moved aside), with the directory's clean mark
/// removed first (see [`naming_in_fd`]).
pub fn naming_in<T>(dir: &Path, make: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
    NamingDir::open(dir).naming(make)
}

/// [`naming_in`], for a directory already open. The directory's shared
/// lock is held until the name exists, so that a run listing it under
/// the exclusive lock either sees the name or sets its mark before this
/// one removes it; it is released at once (a lock kept would stop a
/// watch daemon from taking its DEST). It is not waited for: anyone who
/// may read a directory may lock it, and the watch daemon holds its
/// DEST's exclusively. Without it, the mark is removed again once the
/// name exists, and the listing run lists once more after marking (what
/// is left is a crash in the microseconds between the two, during such a
/// listing: its name is then found by the next run that names anything
/// there or walks it with `-r`).
pub fn naming_in_fd<T>(
    dir: &impl std::os::fd::AsRawFd,
    make: impl FnOnce() -> io::Result<T>,
) -> io::Result<T> {
    let locked = flock(dir, libc::LOCK_SH | libc::LOCK_NB);
    let made = remove_clean_mark(dir).and_then(|()| make());
    if locked {
        flock(dir, libc::LOCK_UN);
    } else if made.is_ok() {
        remove_clean_mark(dir)?;
    }
    made
}

/// Removes `path`, named `name`, if it is a temporary of a process no
/// longer alive (as [`clean_stale_partials_once`] would): a `-r` walk
/// that meets one removes it, also in a directory marked clean.
pub fn remove_if_stale_temporary(path: &Path, name: &[u8]) -> bool {
    stale_temporary_pid(name).is_some_and(|pid| !pid_alive(pid) && fs::remove_file(path).is_ok())
}

/// The PID in a name of the exact form of a temporary, if it is one.
fn stale_temporary_pid(name: &[u8]) -> Option<i32> {
    parse_marked(name, PARTIAL_MARKER).map(|(_, pid)| pid)
}

/// Parses a name of the exact form tpmcrypt gives the files it keeps for
/// a while (`.NAME` + `marker` + `PID.` + 16 hex digits: temporaries, and
/// the watch daemon's moved-aside sources): NAME and PID. The last marker
/// counts, so NAME may itself contain one.
pub fn parse_marked<'a>(name: &'a [u8], marker: &str) -> Option<(&'a [u8], i32)> {
    let marker = marker.as_bytes();
    if !name.starts_with(b".") {
        return None;
    }
    let at = name.windows(marker.len()).rposition(|w| w == marker)?;
    let rest = &name[at + marker.len()..];
    let dot = rest.iter().position(|&b| b == b'.')?;
    let (pid, hex) = (&rest[..dot], &rest[dot + 1..]);
    let ok = !pid.is_empty()
        && pid.iter().all(u8::is_ascii_digit)
        && hex.len() == 16
        && hex.iter().all(u8::is_ascii_hexdigit);
    let pid = std::str::from_utf8(pid).ok()?.parse().ok()?;
    ok.then_some((&name[1..at], pid))
}

/// Marker in the name a source (watch) or an `--in-place` original
/// (encrypt, decrypt) is moved to just before its removal:
/// `.NAME.tpmcrypt-removing.PID.RANDOM` (RANDOM: 16 hex digits; NAME is
/// left out when the whole would exceed 255 bytes).
pub const ASIDE_MARKER: &str = ".tpmcrypt-removing.";
/// Marker in the name a moved-aside source is kept under when it turned
/// out to be changed and its own name was taken meanwhile:
/// `.NAME.tpmcrypt-restored.PID.RANDOM`. It is encrypted like any file.
pub const RESTORED_MARKER: &str = ".tpmcrypt-restored.";

/// `.NAME` + `marker` + this process's PID + `.` + 16 random hex digits
/// (NAME left out if the name would be too long).
pub fn aside_name(name: &OsStr, marker: &str) -> std::ffi::OsString {
    use std::os::unix::ffi::OsStringExt;
    let suffix = format!("{marker}{}.{:016x}", std::process::id(), random_u64());
    let mut out = vec![b'.'];
    if 1 + name.len() + suffix.len() <= 255 {
        out.extend_from_slice(name.as_bytes());
    }
    out.extend_from_slice(suffix.as_bytes());
    std::ffi::OsString::from_vec(out)
}

/// If `name` is exactly a moved-aside name (`.NAME.tpmcrypt-removing.PID.
/// RANDOM`): its PID and, if it was kept in it, NAME.
pub fn parse_aside(name: &OsStr) -> Option<(i32, Option<&OsStr>)> {
    let (original, pid) = parse_marked(name.as_bytes(), ASIDE_MARKER)?;
    let original = (!original.is_empty() && original != b"." && original != b"..")
        .then(|| OsStr::from_bytes(original));
    Some((pid, original))
}

/// What became of a moved-aside original found by [`restore_moved_aside`].
#[derive(Debug, PartialEq, Eq)]
pub enum Restored {
    /// Not a moved-aside name, or its process still runs: left alone.
    NotOurs,
    /// Renamed back to its name.
    Back(PathBuf),
    /// Left where it is (its name is taken or unknown); a warning said so.
    Left,
}

/// An original that an `--in-place` run (or the watch daemon) moved
/// aside for its removal, and that is still there because that process
/// was killed in the moment between the move and the unlink. It may hold
/// bytes appended meanwhile, so it is never deleted: it is renamed back
/// to its name, never replacing anything (as if the crash had come before
/// the removal: the original beside its ciphertext), or, when that name
/// is taken or unknown, left as it is, with a warning naming both paths.
/// Each path is handled once per process.
pub fn restore_moved_aside(path: &Path) -> Restored {
    use std::collections::HashSet;
    static HANDLED: Mutex<Option<HashSet<PathBuf>>> = Mutex::new(None);
    let Some((pid, original)) = path.file_name().and_then(parse_aside) else {
        return Restored::NotOurs;
    };
    if pid_alive(pid) {
        return Restored::NotOurs;
    }
    {
        let mut handled = HANDLED.lock().unwrap_or_else(|e| e.into_inner());
        if !handled
            .get_or_insert_with(HashSet::new)
            .insert(path.to_path_buf())
        {
            return Restored::Left;
        }
    }
    let what = "an original that an interrupted run was removing";
    let Some(original) = original else {
        stderr_line!(
            "tpmcrypt: warning: {}: {what}; its name is not known: left as it is",
            shown(path)
        );
        return Restored::Left;
    };
    let back = parent_dir(path).join(original);
    match rename_noreplace(path, &back) {
        Ok(()) => {
            // Best effort: not durable yet, it is still under one name or
            // the other.
            let _ = sync_dir(parent_dir(path));
            stderr_line!(
                "tpmcrypt: {}: {what}: put back as {}",
                shown(path),
                shown(&back)
            );
            Restored::Back(back)
        }
        Err(e) => {
            let why = if e.kind() == io::ErrorKind::AlreadyExists {
                format!("{} exists", shown(&back))
            } else {
                format!("cannot rename it back to {}: {e}", shown(&back))
            };
            stderr_line!(
                "tpmcrypt: warning: {}: {what}; {why}: left as it is (compare the two, keep what you need)",
                shown(path)
            );
            Restored::Left
        }
    }
}

/// Whether process `pid` exists.
pub fn pid_alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ext4 without a journal (its options list no `data=` mode) is told
    /// apart; one with a journal, or a device the ext4 driver does not
    /// show, is not.
    #[test]
    fn an_ext4_without_a_journal_is_told_apart() {
        let root = tempfile::tempdir().unwrap();
        let (sys, proc) = (root.path().join("sys"), root.path().join("proc"));
        let dev = |major: u32, minor: u32, name: &str, options: Option<&str>| {
            let d = sys.join(format!("dev/block/{major}:{minor}"));
            fs::create_dir_all(&d).unwrap();
            fs::write(
                d.join("uevent"),
                format!("MAJOR={major}\nMINOR={minor}\nDEVNAME={name}\n"),
            )
            .unwrap();
            if let Some(options) = options {
                let p = proc.join("fs/ext4").join(name.replace('/', "!"));
                fs::create_dir_all(&p).unwrap();
                fs::write(p.join("options"), options).unwrap();
            }
            libc::makedev(major, minor)
        };
        let journaled = dev(7, 1, "loop1", Some("rw\nbarrier\ndata=ordered\ncommit=5\n"));
        let bare = dev(
            7,
            2,
            "loop2",
            Some("rw\nnojournal_checksum\nbarrier\ncommit=5\n"),
        );
        let other = dev(8, 1, "sda1", None);
        let slashed = dev(104, 1, "cciss/c0d0p1", Some("rw\n"));
        assert!(journal_in(journaled, &sys, &proc));
        assert!(!journal_in(bare, &sys, &proc));
        assert!(!journal_in(slashed, &sys, &proc));
        assert!(journal_in(other, &sys, &proc), "not ext4's: as before");
        assert!(
            journal_in(libc::makedev(9, 9), &sys, &proc),
            "unknown device"
        );
    }
    use std::io::Write;

    #[test]
    fn an_unnamed_file_is_linked_through_proc_where_its_descriptor_may_not_be() {
        // As for a user without the capability on a kernel before 6.10:
        // every later link in this process takes the /proc path.
        EMPTY_PATH_REFUSED.store(true, Ordering::Relaxed);
        // tmpfs takes O_TMPFILE and syncfs (the root file system may be
        // ext4 without a journal, where outputs are named temporaries).
        let d = tempfile::tempdir_in("/dev/shm").unwrap();
        let dest = d.path().join("out");
        let mut f = AtomicFile::create_unnamed(&dest, 0o640, false, true).unwrap();
        assert!(f.unnamed, "this file system takes O_TMPFILE");
        f.file().write_all(b"data").unwrap();
        f.commit().unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"data");
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&fs::metadata(&dest).unwrap().permissions())
                & 0o777,
            0o640
        );
        // And it never replaces a name taken meanwhile.
        let mut g =
            AtomicFile::create_unnamed(&dest.with_extension("b"), 0o600, false, true).unwrap();
        fs::write(dest.with_extension("b"), b"theirs").unwrap();
        g.file().write_all(b"mine").unwrap();
        let err = g.commit().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists, "{err}");
        assert_eq!(fs::read(dest.with_extension("b")).unwrap(), b"theirs");
    }

    #[test]
    fn names_near_the_limit_get_a_temporary_that_fits() {
        let dir = tempfile::tempdir().unwrap();
        for name in [
            "x".repeat(255),
            "é".repeat(127),
            format!("{}.tpmc", "y".repeat(250)),
        ] {
            let dest = dir.path().join(&name);
            let mut f = AtomicFile::create(&dest, 0o600, false).unwrap();
            let tmp_name = f.tmp.file_name().unwrap().as_bytes().to_vec();
            assert!(tmp_name.len() <= 255, "{}", tmp_name.len());
            assert!(tmp_name.starts_with(partial_prefix(dest.file_name().unwrap()).as_bytes()));
            f.file().write_all(b"long").unwrap();
            f.commit().unwrap();
            assert_eq!(fs::read(&dest).unwrap(), b"long");
            // A stale temporary of that output (a dead PID) is recognised.
            let mut stale = partial_prefix(dest.file_name().unwrap());
            stale.push("2147483646.0000000000000000");
            assert!(stale_temporary_pid(stale.as_bytes()) == Some(2147483646));
        }
    }

    /// A name that is not UTF-8 gets a temporary with its exact bytes, and
    /// the stale temporaries of one such name are not taken for those of
    /// another that a lossy conversion would confuse it with.
    #[test]
    fn temporaries_of_names_that_are_not_utf8_keep_their_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let e9 = dir.path().join(OsStr::from_bytes(b"caf\xe9"));
        let e8 = dir.path().join(OsStr::from_bytes(b"caf\xe8"));
        let f = AtomicFile::create(&e9, 0o600, false).unwrap();
        assert!(f
            .tmp
            .file_name()
            .unwrap()
            .as_bytes()
            .starts_with(b".caf\xe9.tpmcrypt-partial."));
        drop(f);
        let mut stale = partial_prefix(e9.file_name().unwrap());
        stale.push("2147483646.00000000000000ff");
        fs::write(dir.path().join(&stale), b"x").unwrap();
        assert_eq!(clean_stale_partials_once(&e8, false), 1);
        assert!(!dir.path().join(&stale).exists());
        // Shortened names stay within the limit and keep whole characters.
        let long = OsString::from("é".repeat(127));
        let p = partial_prefix(&long);
        assert!(std::str::from_utf8(p.as_bytes()).is_ok());
        let raw = OsString::from_vec(vec![0xe9; 255]);
        assert!(partial_prefix(&raw).len() <= 255 - 27);
    }

    #[test]
    fn a_directory_is_never_an_output() {
        let dir = tempfile::tempdir().unwrap();
        for replace in [false, true] {
            let err = AtomicFile::create(dir.path(), 0o600, replace)
                .err()
                .expect("refused");
            assert!(
                err.to_string()
                    .ends_with("is a directory (an output is a file)"),
                "{err}"
            );
        }
    }

    #[test]
    fn commit_renames_and_drop_cleans() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("out");
        let mut f = AtomicFile::create(&dest, 0o640, false).unwrap();
        f.file().write_all(b"hello").unwrap();
        assert!(!dest.exists());
        f.commit().unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"hello");
        assert_eq!(
            fs::metadata(&dest).unwrap().permissions().mode() & 0o777,
            0o640
        );

        let other = dir.path().join("other");
        let mut f = AtomicFile::create(&other, 0o600, false).unwrap();
        f.file().write_all(b"partial").unwrap();
        drop(f);
        assert!(!other.exists());
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "temporary left behind"
        );
    }

    #[test]
    fn refuses_to_replace_without_force() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("out");
        fs::write(&dest, b"old").unwrap();
        assert!(AtomicFile::create(&dest, 0o600, false).is_err());
        // A destination that appears while writing is not clobbered either.
        let racing = dir.path().join("racing");
        let f = AtomicFile::create(&racing, 0o600, false).unwrap();
        fs::write(&racing, b"theirs").unwrap();
        assert!(f.commit().is_err());
        assert_eq!(fs::read(&racing).unwrap(), b"theirs");
        let f = AtomicFile::create(&dest, 0o600, true).unwrap();
        f.commit().unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"");
    }

    #[test]
    fn a_directory_is_cleaned_once_and_only_of_exact_temporaries() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("f.tpmc");
        let dead = format!(".f.tpmc{PARTIAL_MARKER}2147483646.0123456789abcdef");
        let other = format!(".g{PARTIAL_MARKER}2147483646.0123456789abcdef");
        let lookalike = format!(".h{PARTIAL_MARKER}2147483646.notatemporary");
        let live = format!(
            ".f.tpmc{PARTIAL_MARKER}{}.0123456789abcdef",
            std::process::id()
        );
        for n in [&dead, &other, &lookalike, &live] {
            fs::write(dir.path().join(n), b"x").unwrap();
        }
        assert_eq!(clean_stale_partials_once(&dest, false), 2);
        for (n, kept) in [
            (&dead, false),
            (&other, false),
            (&lookalike, true),
            (&live, true),
        ] {
            assert_eq!(dir.path().join(n).exists(), kept, "{n}");
        }
        // Once per directory: a new leftover waits for the next run.
        fs::write(dir.path().join(&dead), b"x").unwrap();
        assert_eq!(
            clean_stale_partials_once(&dir.path().join("g.tpmc"), false),
            0
        );
    }

    #[test]
    fn stale_partials_of_dead_processes_are_cleaned() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("f.tpmc");
        // PID 0x7fffffff is never alive.
        let stale = dir.path().join(format!(
            ".f.tpmc{PARTIAL_MARKER}2147483646.0000000000000000"
        ));
        let live = dir.path().join(format!(
            ".f.tpmc{PARTIAL_MARKER}{}.0000000000000000",
            std::process::id()
        ));
        fs::write(&stale, b"x").unwrap();
        fs::write(&live, b"x").unwrap();
        assert_eq!(clean_stale_partials_once(&dest, false), 1);
        assert!(!stale.exists());
        assert!(live.exists());
    }

    /// A directory of `n` files (enough names to be marked when n ≥ 256).
    fn big_dir(n: usize) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..n {
            fs::write(dir.path().join(format!("f{i}")), b"").unwrap();
        }
        dir
    }

    /// `name` in `dir` by a path never used before (through a new symbolic
    /// link in `dir` to itself): each clean-up runs once per directory path and
    /// process, and a new path stands for the next process.
    fn via_new_path(dir: &Path, name: &str) -> PathBuf {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let link = dir.join(format!("link{}", N.fetch_add(1, Ordering::Relaxed)));
        std::os::unix::fs::symlink(dir, &link).unwrap();
        link.join(name)
    }

    fn marked(dir: &Path) -> bool {
        has_clean_mark(&open_dir(dir).unwrap(), &fs::metadata(dir).unwrap())
    }

    /// A leftover of a dead run, of the exact form of a temporary.
    fn dead_temporary(dir: &Path) -> PathBuf {
        dir.join(format!(
            ".g.tpmc{PARTIAL_MARKER}2147483646.00000000000000aa"
        ))
    }

    #[test]
    fn a_large_directory_found_clean_is_marked_and_a_run_naming_something_there_unmarks_it() {
        let dir = big_dir(300);
        let d = dir.path();
        assert_eq!(clean_stale_partials_once(&d.join("x.tpmc"), false), 0);
        assert!(marked(d), "a clean directory of 300 names is marked");
        // A run gives it a name of its own, then dies: the mark is gone,
        // so the next run (here: another path to the same directory, as a
        // new process would) lists it and removes the leftover.
        let stale = dead_temporary(d);
        naming_in(d, || fs::write(&stale, b"x")).unwrap();
        assert!(!marked(d), "naming something removes the mark");
        let lock = open_dir(d).unwrap();
        assert!(
            flock(&lock, libc::LOCK_EX | libc::LOCK_NB),
            "the shared lock is released (a watch daemon takes its DEST's)"
        );
        drop(Unlock(&lock));
        assert_eq!(
            clean_stale_partials_once(&via_new_path(d, "x.tpmc"), false),
            1
        );
        assert!(!stale.exists());
        assert!(marked(d), "marked again once clean");
        // Through an open directory (the watch daemon's way) as well.
        let fd = open_dir(d).unwrap();
        naming_in_fd(&fd, || Ok(())).unwrap();
        assert!(!marked(d));
    }

    #[test]
    fn a_marked_directory_is_not_listed_unless_the_run_names_things_there() {
        let dir = big_dir(300);
        let d = dir.path();
        clean_stale_partials_once(&d.join("x.tpmc"), false);
        assert!(marked(d));
        // Planted without removing the mark (no run of tpmcrypt does
        // that): a run trusting the mark does not list the directory.
        let stale = dead_temporary(d);
        fs::write(&stale, b"x").unwrap();
        assert_eq!(
            clean_stale_partials_once(&via_new_path(d, "x.tpmc"), false),
            0
        );
        assert!(stale.exists(), "not listed");
        // A run that will name things there lists it all the same.
        assert_eq!(
            clean_stale_partials_once(&via_new_path(d, "x.tpmc"), true),
            1
        );
        assert!(!stale.exists());
    }

    /// A directory that could not be opened (no descriptor left) is still
    /// worked on, by path: an original moved aside and removed there, the
    /// mark gone, as through an open directory.
    #[test]
    fn a_directory_not_opened_is_named_in_by_path() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        fs::write(dir.join("f"), b"x").unwrap();
        for opened in [false, true] {
            fs::write(dir.join("g"), b"y").unwrap();
            let mut at = NamingDir::open(dir);
            assert!(at.dir.is_some() && at.readable);
            if !opened {
                at = NamingDir {
                    dir: None,
                    path: dir.to_path_buf(),
                    readable: false,
                };
            }
            let (kind, _, ino) = at.lstat(OsStr::new("g")).unwrap();
            assert_eq!(
                (kind, ino),
                (Kind::File, fs::metadata(dir.join("g")).unwrap().ino())
            );
            let aside = aside_name(OsStr::new("g"), ASIDE_MARKER);
            at.naming(|| at.rename_noreplace(OsStr::new("g"), &aside))
                .unwrap();
            let taken = at.rename_noreplace(&aside, OsStr::new("f")).unwrap_err();
            assert_eq!(taken.kind(), io::ErrorKind::AlreadyExists, "{opened}");
            at.unlink(&aside).unwrap();
            let mut left: Vec<_> = fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            left.sort();
            assert_eq!(left, ["f"], "opened: {opened}");
        }
    }

    #[test]
    fn no_mark_while_a_name_of_a_live_run_is_there_or_one_is_being_made() {
        let dir = big_dir(300);
        let d = dir.path();
        let live = d.join(format!(
            ".g.tpmc{PARTIAL_MARKER}{}.00000000000000bb",
            std::process::id()
        ));
        fs::write(&live, b"x").unwrap();
        clean_stale_partials_once(&d.join("x.tpmc"), false);
        assert!(!marked(d), "a live run's temporary is there");
        fs::remove_file(&live).unwrap();
        // A run between removing the mark and making its name holds the
        // shared lock: the listing does not mark.
        let held = open_dir(d).unwrap();
        assert!(flock(&held, libc::LOCK_SH | libc::LOCK_NB));
        clean_stale_partials_once(&via_new_path(d, "x.tpmc"), false);
        assert!(!marked(d), "a run is naming something");
        drop(Unlock(&held));
        clean_stale_partials_once(&via_new_path(d, "x.tpmc"), false);
        assert!(marked(d));
    }

    #[test]
    fn a_mark_copied_onto_another_directory_is_not_trusted() {
        let dir = big_dir(300);
        let d = dir.path();
        clean_stale_partials_once(&via_new_path(d, "x.tpmc"), false);
        assert!(marked(d));
        // As `cp -a` would: the same value on a directory holding an
        // original a killed --in-place run moved aside.
        let copy = big_dir(300);
        let c = copy.path();
        write_mark(
            &open_dir(c).unwrap(),
            &mark_value(&fs::metadata(d).unwrap()),
        );
        let aside = c.join(".notes.tpmcrypt-removing.2147483646.0123456789abcdef");
        fs::write(&aside, b"precious").unwrap();
        assert!(!marked(c), "a mark of another directory");
        clean_stale_partials_once(&via_new_path(c, "x.tpmc"), false);
        assert_eq!(fs::read(c.join("notes")).unwrap(), b"precious", "put back");
    }

    #[test]
    fn small_and_sticky_directories_are_never_marked() {
        let small = big_dir(10);
        clean_stale_partials_once(&small.path().join("x.tpmc"), false);
        assert!(!marked(small.path()));
        let sticky = big_dir(300);
        fs::set_permissions(sticky.path(), fs::Permissions::from_mode(0o1777)).unwrap();
        clean_stale_partials_once(&sticky.path().join("x.tpmc"), false);
        assert!(!marked(sticky.path()));
        // And a mark found in one is not trusted.
        write_mark(
            &open_dir(sticky.path()).unwrap(),
            &mark_value(&fs::metadata(sticky.path()).unwrap()),
        );
        let stale = dead_temporary(sticky.path());
        fs::write(&stale, b"x").unwrap();
        assert_eq!(
            clean_stale_partials_once(&via_new_path(sticky.path(), "x.tpmc"), false),
            1
        );
    }
}
