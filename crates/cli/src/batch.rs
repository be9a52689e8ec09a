//! Group commit: durability is a property of a batch of outputs, not of
//! each file. The outputs of a batch wait, complete, under their temporary
//! names; then
//! 1. their data is made durable together: one `syncfs` per file system
//!    (a batch of one file is `fsync`ed instead, so one large file does not
//!    wait for everything else on its file system). Only file systems known
//!    to write back on `syncfs` get one (ext2/3/4, xfs, btrfs, f2fs, zfs,
//!    tmpfs, ramfs, overlayfs): on FUSE (sshfs, ntfs-3g, gocryptfs, …), a
//!    network file system or one unknown, each output is `fsync`ed;
//! 2. each is renamed to its final name (never over a file that appeared
//!    meanwhile, unless `--force`);
//! 3. the directories that received one are made durable, once;
//! 4. only then, for `--in-place`, each original still as it was read is
//!    removed, and the directories that lost one are made durable, once.
//!
//! So the guarantees of one file at a time hold: an original is removed
//! only after its ciphertext is durable under its final name, and a crash
//! at any moment leaves each file as its original or as a complete output
//! (or both), never neither. What changes is the count of disk waits: a
//! few per batch and directory instead of two per file.
//!
//! A batch is bounded ([`Limits`]: up to 4,096 files, 256 MiB, one second)
//! so that open files, dirty memory and the work a crash would redo stay
//! small, and a parallel run's to a quarter of its files (at least 256:
//! [`Limits::for_tasks`]), so that its batches' disk waits overlap the
//! writing of the next and only the last commit waits alone. Steps 3 and
//! 4 sync a single directory with fsync, several with one `syncfs` per
//! file system. A run's full batches are chained
//! ([`Batch::commit_chained`]): the next batch's `syncfs` (step 1) is
//! also the earlier batch's step 3 and the sync of its removals, so a
//! batch costs one disk wait instead of three. The per-file work of steps 2 and 4 (a
//! link or rename, a check and a removal: a few directory operations
//! each) is shared out over one thread per CPU for a batch of 128 files or
//! more; the outcomes keep the order of the outputs.

use std::collections::BTreeSet;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::atomic::{self, AtomicFile, Kind, NamingDir};
use crate::replace;
use crate::stamp::Stamp;

/// Bounds of one batch.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Outputs (each holds an open file).
    pub files: usize,
    /// Bytes written (dirty page cache a crash could lose).
    pub bytes: u64,
    /// Time since the batch's first output.
    pub age: Duration,
    /// Tasks a parallel run may have under way or done and waiting for
    /// an earlier one (each holds open files, as a batch's outputs do).
    /// As many as a batch, where the open files allow: while one batch
    /// commits (its syncs wait for the disk), the workers write the next.
    pub window: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits::for_run(Some(1))
    }
}

impl Limits {
    /// The bounds for a run on `jobs` workers: the open-file limit (raised
    /// first to its hard maximum) is shared out so that every file the
    /// pipeline may hold at once fits in it. A task holds at most two
    /// (its output, and its input until an `--in-place` original is
    /// removed) from its start to its batch's commit, and the tasks under
    /// way or waiting number at most `window`, those waiting in a batch at
    /// most `files`, and as many again in a batch named but not finished
    /// ([`Batch::commit_chained`]); a reserve covers standard streams, the
    /// TPM or agent, keys, and a directory listing per worker.
    pub fn for_run(jobs: Option<usize>) -> Self {
        // Workers not given (-j): one per CPU, which is not asked of the
        // system for a run that may need one thread; a generous guess
        // keeps their descriptors in reserve all the same.
        let reserve = 32 + jobs.unwrap_or(64) as u64;
        let slots = (open_file_limit().saturating_sub(reserve) / 2).max(2) as usize;
        let files = (slots / 3).clamp(1, 4096);
        Limits {
            files,
            bytes: 256 << 20,
            age: Duration::from_secs(1),
            window: slots.saturating_sub(2 * files).clamp(1, files),
        }
    }

    /// These bounds for a run of `tasks` outputs: a batch holds at most a
    /// quarter of them (at least [`Limits::PIPELINED`]). While a batch
    /// waits for the disk the workers write the next; only the last
    /// batch's commit has nothing beside it, so the smaller it is the
    /// less of the run waits alone (2,000 files of 4 KiB on two CPUs: one
    /// batch 0.18 s, four 0.17 s).
    pub fn for_tasks(self, tasks: usize) -> Self {
        let files = self.files.min(tasks.div_ceil(4).max(Self::PIPELINED));
        Limits {
            files,
            window: self.window.min(files),
            ..self
        }
    }

    /// Runs of up to this many outputs are one batch.
    pub const PIPELINED: usize = 256;
}

/// An `--in-place` original that changed, or was replaced, after it was
/// read: it is kept beside its new output rather than removed.
#[derive(Debug, thiserror::Error)]
#[error("changed or replaced after it was read; kept it (its output is complete)")]
pub struct OriginalChanged;

/// An original to remove once its output is durable (`--in-place`).
pub struct Original {
    /// Its path.
    pub path: PathBuf,
    /// The open input, to check it is still the file that was read.
    pub file: File,
    /// How it was before the read.
    pub stamp: Stamp,
    /// Whether any change to its inode since (its ctime: a new hard link,
    /// a chmod) counts as a change: yes for a user's file (`--in-place`,
    /// `rekey`); for a ciphertext the watch daemon replaces, only its
    /// inode, size, mtime and mode must still be as they were (a backup
    /// that hard-links DEST must not turn every replacement into a new
    /// version).
    pub exact: bool,
}

/// A complete output waiting for its batch to commit.
pub struct Pending<T> {
    /// The caller's tag (the task).
    pub tag: T,
    /// The output under its temporary name.
    pub out: AtomicFile,
    /// Bytes it holds (for the batch's byte bound).
    pub bytes: u64,
    /// The original to remove after commit, if any.
    pub original: Option<Original>,
}

/// Why a pending output did not make it.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    // The causes are in the messages, not `source`s: a chain printed whole
    // would show them twice.
    /// Making the data durable failed (a full disk seen at write-back).
    #[error("cannot make the output durable: {0}")]
    Sync(io::Error),
    /// The rename to the final name failed (it exists now, …).
    #[error("{0}")]
    Rename(io::Error),
    /// The directory holding the final name could not be made durable.
    #[error("cannot make the directory {0} durable: {1}")]
    Directory(String, io::Error),
    /// The output is in place, but removing the original failed or it
    /// changed: it is kept.
    #[error("{0:#}")]
    Original(anyhow::Error),
    /// The caller's check before the rename refused it (see
    /// [`Batch::commit_with`]): the output stays a temporary, removed.
    #[error("{0:#}")]
    Refused(anyhow::Error),
}

/// Outputs collected until a bound is reached.
pub struct Batch<T> {
    limits: Limits,
    pending: Vec<Pending<T>>,
    bytes: u64,
    since: Option<Instant>,
    /// A batch named by [`Batch::commit_chained`] whose names the next
    /// commit makes durable, before its originals are removed.
    named: Option<Vec<Named<T>>>,
    /// Directories that lost originals since their last sync.
    removed_from: BTreeSet<PathBuf>,
}

impl<T: Send> Batch<T> {
    /// An empty batch.
    pub fn new(limits: Limits) -> Self {
        Batch {
            limits,
            pending: Vec::new(),
            bytes: 0,
            since: None,
            named: None,
            removed_from: BTreeSet::new(),
        }
    }

    /// Adds an output; true when the batch should now be committed.
    pub fn push(&mut self, p: Pending<T>) -> bool {
        self.bytes += p.bytes;
        self.since.get_or_insert_with(Instant::now);
        self.pending.push(p);
        self.pending.len() >= self.limits.files
            || self.bytes >= self.limits.bytes
            || self.since.is_some_and(|t| t.elapsed() >= self.limits.age)
    }

    /// Whether nothing waits (nor a batch named by
    /// [`Batch::commit_chained`], nor removals to make durable).
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty() && self.named.is_none() && self.removed_from.is_empty()
    }

    /// When the batch reaches its age bound (None while empty).
    pub fn deadline(&self) -> Option<Instant> {
        self.since.map(|t| t + self.limits.age)
    }

    /// Commits every waiting output (steps 1-4 above) and returns each
    /// tag with its outcome, in the order they were pushed. A large batch
    /// is named, and its originals removed, on several threads.
    ///
    /// A batch named by [`Batch::commit_chained`] is finished first: its
    /// names are made durable by the `syncfs` of the waiting outputs' data
    /// (or, with none waiting, of their own), then its originals removed.
    /// Every removal is made durable before this returns.
    pub fn commit(&mut self) -> Vec<(T, Result<(), CommitError>)> {
        // Waiting outputs go as a chained batch would (one disk wait for
        // their data and the names given before them), then are finished.
        let mut out = match self.pending.is_empty() {
            true => Vec::new(),
            false => self.commit_chained(),
        };
        if let Some(named) = self.named.take() {
            let threads = threads_for(named.len());
            out.extend(finish(named, threads, &[], &mut self.removed_from));
        }
        sync_removals(std::mem::take(&mut self.removed_from));
        out
    }

    /// Commits a full batch with one disk wait instead of three, its steps
    /// chained with the next batch's: one `syncfs` makes this batch's data
    /// durable (step 1) and, with it, the names given at the last call
    /// (step 3) and the removals made since; then that earlier batch's
    /// originals are removed (step 4) and this batch is named (step 2).
    /// Returns the earlier batch's outcomes; this one's come from the next
    /// call or from [`Batch::commit`], which a run must end with. Each
    /// output still goes data, name, removal of its original, each step
    /// durable before the next; only its names wait for the next batch to
    /// be made durable. A directory whose file system got no `syncfs`
    /// (FUSE, NFS, a batch of one) is synced as [`Batch::commit`] does.
    pub fn commit_chained(&mut self) -> Vec<(T, Result<(), CommitError>)> {
        let (synced, durable_devs) = make_durable(self.take());
        // Removals made before that syncfs are durable on its devices.
        self.removed_from
            .retain(|d| !dev_of(d).is_some_and(|dev| durable_devs.contains(&dev)));
        let out = match self.named.take() {
            Some(named) => {
                let threads = threads_for(named.len());
                finish(named, threads, &durable_devs, &mut self.removed_from)
            }
            None => Vec::new(),
        };
        let threads = threads_for(synced.len());
        let named = par_map(synced, threads, |(p, r)| name(p, r, |_| Ok(())));
        self.named = (!named.is_empty()).then_some(named);
        out
    }

    /// [`Batch::commit`], calling `before_rename` for each output whose
    /// data is durable, just before its rename (the watch daemon records
    /// the output in its journal there), one output after another. An
    /// error refuses that rename.
    pub fn commit_with(
        &mut self,
        mut before_rename: impl FnMut(&T) -> Result<(), CommitError>,
    ) -> Vec<(T, Result<(), CommitError>)> {
        let (synced, _) = make_durable(self.take());
        let named = synced
            .into_iter()
            .map(|(p, r)| name(p, r, &mut before_rename))
            .collect();
        let mut removed_from = BTreeSet::new();
        let out = finish(named, 1, &[], &mut removed_from);
        sync_removals(removed_from);
        out
    }

    fn take(&mut self) -> Vec<Pending<T>> {
        self.bytes = 0;
        self.since = None;
        std::mem::take(&mut self.pending)
    }
}

/// One output after step 2: its tag, its outcome so far, its directory,
/// what follows its commit, and (a file that got its first name) the
/// file, whose inode must be made durable too.
type Named<T> = (T, Result<(), CommitError>, PathBuf, After, Option<File>);

/// Step 2 for one output whose data is durable (`r`): its rename.
fn name<T>(
    p: Pending<T>,
    r: Result<(), CommitError>,
    before_rename: impl FnOnce(&T) -> Result<(), CommitError>,
) -> Named<T> {
    let Pending {
        tag, out, original, ..
    } = p;
    let dir = atomic::parent_dir(out.dest()).to_path_buf();
    let r = r.and_then(|()| before_rename(&tag));
    match original {
        // An output that takes its own original's name (rekey).
        Some(o) if o.path == out.dest() => match r.and_then(|()| replace::exchange(out, &o)) {
            Ok(displaced) => (tag, Ok(()), dir, After::Unlink(displaced), None),
            Err(e) => (tag, Err(e), dir, After::Nothing, None),
        },
        original => {
            let after = original.map_or(After::Nothing, After::Remove);
            match r.and_then(|()| out.rename_durable().map_err(CommitError::Rename)) {
                Ok(linked) => (tag, Ok(()), dir, after, linked),
                Err(e) => (tag, Err(e), dir, after, None),
            }
        }
    }
}

/// Steps 3 and 4 for the named outputs, the removals on `threads`; the
/// directories that lost an original are added to `removed_from`, for the
/// caller to make durable. Names in a directory on one of `durable_devs`
/// were made durable already (by a `syncfs` after they were given, which
/// wrote their inodes too); the others' directories are synced here.
fn finish<T: Send>(
    mut named: Vec<Named<T>>,
    threads: usize,
    durable_devs: &[u64],
    removed_from: &mut BTreeSet<PathBuf>,
) -> Vec<(T, Result<(), CommitError>)> {
    let covered = |dir: &Path| dev_of(dir).is_some_and(|dev| durable_devs.contains(&dev));
    let dirs: BTreeSet<PathBuf> = named
        .iter()
        .filter(|n| n.1.is_ok())
        .map(|n| n.2.clone())
        .filter(|d| durable_devs.is_empty() || !covered(d))
        .collect();
    // A file that got its first name: its inode too (one alone is
    // fsynced; several go with the syncfs of their directories below).
    let linked = named
        .iter()
        .filter(|n| n.4.is_some() && dirs.contains(&n.2))
        .count();
    if linked == 1 {
        if let Some(n) = named
            .iter_mut()
            .find(|n| n.4.is_some() && dirs.contains(&n.2))
        {
            if let Some(Err(e)) = n.4.as_ref().map(File::sync_all) {
                n.1 = Err(CommitError::Sync(e));
            }
        }
    }
    for n in &mut named {
        n.4 = None;
    }
    let failed_dirs = sync_dirs(&dirs, linked > 1);
    // Step 4: originals, only behind a durable output. Each thread keeps
    // the directory of its last removal open: the originals of one
    // directory are mostly together, and are removed through one open of
    // it rather than one each.
    let done = par_map_with(
        named,
        threads,
        || None,
        |at, (tag, r, dir, original, _)| {
            let r = r.and_then(|()| match failed_dirs.iter().find(|(d, _)| *d == dir) {
                Some((d, e)) => Err(CommitError::Directory(
                    crate::ui::shown(d),
                    io::Error::new(e.kind(), e.to_string()),
                )),
                None => Ok(()),
            });
            match (r, original) {
                (Ok(()), After::Remove(o)) => {
                    let gone = remove_original(&o, at);
                    let from = gone
                        .is_ok()
                        .then(|| atomic::parent_dir(&o.path).to_path_buf());
                    (tag, gone.map_err(CommitError::Original), from)
                }
                (Ok(()), After::Unlink(displaced)) => {
                    // The new file is durable under the name; the old one goes
                    // (left behind, it is a temporary the next run removes).
                    let from = displaced.remove().is_ok().then_some(dir);
                    (tag, Ok(()), from)
                }
                (r, _) => (tag, r, None),
            }
        },
    );
    let mut out = Vec::with_capacity(done.len());
    for (tag, r, from) in done {
        removed_from.extend(from);
        out.push((tag, r));
    }
    out
}

/// Makes the removals from `dirs` durable. One that is not yet durable
/// loses nothing (its output is), so a failure here is only reported.
fn sync_removals(dirs: BTreeSet<PathBuf>) {
    for (dir, e) in sync_dirs(&dirs, false) {
        stderr_line!(
            "{} {}: the removal of originals may not be durable yet: {e}",
            crate::ui::colour::warning(),
            crate::ui::shown(&dir)
        );
    }
}

/// The device of the file system `dir` is on (None if it cannot be asked:
/// then it is synced by itself).
fn dev_of(dir: &Path) -> Option<u64> {
    std::fs::metadata(dir).ok().map(|m| m.dev())
}

/// Threads for the per-file steps of a commit of `n` outputs: one for a
/// small batch (a thread costs more than it saves), else one per CPU, at
/// most eight (twice the CPUs measured no faster, even where each removal
/// waits for the disk).
fn threads_for(n: usize) -> usize {
    const MIN_PER_THREAD: usize = 64;
    let cpus = std::thread::available_parallelism().map_or(1, |c| c.get());
    (n / MIN_PER_THREAD).clamp(1, cpus.min(8))
}

/// `f` over `items` on up to `threads` threads, each taking a contiguous
/// run of them (the outputs of one directory are mostly together, so
/// threads seldom wait for one another's directory), results in order.
fn par_map<I: Send, O: Send>(items: Vec<I>, threads: usize, f: impl Fn(I) -> O + Sync) -> Vec<O> {
    par_map_with(items, threads, || (), |_, i| f(i))
}

/// [`par_map`], each thread with a state of its own (made by `init`,
/// dropped when the thread is done) that `f` is given with each item.
fn par_map_with<I: Send, O: Send, S>(
    items: Vec<I>,
    threads: usize,
    init: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, I) -> O + Sync,
) -> Vec<O> {
    if threads <= 1 || items.len() <= 1 {
        let mut state = init();
        return items.into_iter().map(|i| f(&mut state, i)).collect();
    }
    let per = items.len().div_ceil(threads);
    let mut chunks: Vec<Vec<I>> = Vec::new();
    let mut it = items.into_iter().peekable();
    while it.peek().is_some() {
        chunks.push(it.by_ref().take(per).collect());
    }
    let (f, init) = (&f, &init);
    std::thread::scope(|scope| {
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|chunk| {
                scope.spawn(move || {
                    let mut state = init();
                    chunk
                        .into_iter()
                        .map(|i| f(&mut state, i))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// What follows an output's commit: its original removed (`--in-place`),
/// or the original it displaced (rekey) unlinked.
enum After {
    Nothing,
    Remove(Original),
    Unlink(atomic::Displaced),
}

type Synced<T> = Vec<(Pending<T>, Result<(), CommitError>)>;

/// `fsync`s each file of `files` (several at once: a network or FUSE
/// server answers them in parallel), each result in its place.
fn fsync_each<T: Send>(
    files: Vec<T>,
    sync: impl Fn(&mut T) -> io::Result<()> + Sync,
) -> Vec<(T, io::Result<()>)> {
    const THREADS: usize = 8;
    par_map(files, THREADS, |mut f| {
        let r = sync(&mut f);
        (f, r)
    })
}

/// Step 1. One `syncfs` per file system that honours it; a batch of one,
/// and every output on another file system (FUSE, NFS, …), is `fsync`ed.
/// When a `syncfs` reports a write-back error, each file of that file
/// system is `fsync`ed to learn whose it is (the others then pass at no
/// cost).
///
/// Also returns the devices whose `syncfs` succeeded: everything written
/// on them before it (names, removals) is durable too.
fn make_durable<T: Send>(mut pending: Vec<Pending<T>>) -> (Synced<T>, Vec<u64>) {
    if pending.len() == 1 {
        let mut p = pending.remove(0);
        let r = p.out.sync().map_err(CommitError::Sync);
        return (vec![(p, r)], Vec::new());
    }
    let devs: Vec<u64> = pending.iter().map(|p| p.out.file_dev()).collect();
    // Per device: whether its syncfs made everything durable.
    let mut devices: Vec<(u64, bool)> = Vec::new();
    for (p, &dev) in pending.iter().zip(&devs) {
        if devices.iter().any(|(d, _)| *d == dev) {
            continue;
        }
        let ok = atomic::syncfs_is_durable(p.out.fd()) && {
            // SAFETY: syncfs on a valid open descriptor.
            unsafe { libc::syncfs(p.out.fd().as_raw_fd()) == 0 }
        };
        devices.push((dev, ok));
    }
    let mut done = Vec::with_capacity(pending.len());
    let mut rest = Vec::new();
    for (i, (mut p, dev)) in pending.into_iter().zip(devs).enumerate() {
        if devices.iter().any(|(d, ok)| *d == dev && *ok) {
            p.out.mark_synced();
            done.push((i, p, Ok(())));
        } else {
            rest.push((i, p));
        }
    }
    let synced = fsync_each(rest, |(_, p): &mut (usize, Pending<T>)| p.out.sync());
    done.extend(
        synced
            .into_iter()
            .map(|((i, p), r)| (i, p, r.map_err(CommitError::Sync))),
    );
    // In the order they were pushed.
    done.sort_by_key(|(i, _, _)| *i);
    let durable = devices.into_iter().filter(|(_, ok)| *ok).map(|(d, _)| d);
    (
        done.into_iter().map(|(_, p, r)| (p, r)).collect(),
        durable.collect(),
    )
}

/// Makes the entries of `dirs` durable (see [`sync_open`]). Returns
/// those that failed.
/// With `whole`, even one directory gets the `syncfs` of its file system
/// (which then also writes the inodes of files linked into it).
///
/// Of several directories, one per file system that honours `syncfs` is
/// opened: its `syncfs` covers the others there, which need no descriptor
/// (opening them all ran out of descriptors at a low open-file limit).
fn sync_dirs(dirs: &BTreeSet<PathBuf>, whole: bool) -> Vec<(PathBuf, io::Error)> {
    let mut failed = Vec::new();
    let mut open = Vec::with_capacity(dirs.len());
    let several = whole || dirs.len() > 1;
    // Devices with a directory open whose file system honours syncfs, and
    // the directories there that ride on it.
    let mut synced_devs: Vec<u64> = Vec::new();
    let mut riders = Vec::new();
    // A directory stood in for by its parent: its file system's syncfs.
    let mut anchored = false;
    for d in dirs {
        if several {
            if let Some(dev) = dev_of(d).filter(|dev| synced_devs.contains(dev)) {
                riders.push((d.clone(), dev));
                continue;
            }
        }
        match atomic::open_directory(d) {
            Ok(f) => {
                if several && atomic::syncfs_is_durable(std::os::fd::AsFd::as_fd(&f)) {
                    synced_devs.extend(f.metadata().ok().map(|m| m.dev()));
                }
                open.push((d.clone(), f))
            }
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => match syncfs_anchor(d) {
                Some((f, dev)) => {
                    anchored = true;
                    synced_devs.push(dev);
                    open.push((d.clone(), f));
                }
                None => failed.push((d.clone(), e)),
            },
            Err(e) => failed.push((d.clone(), e)),
        }
    }
    failed.extend(sync_open(open, several || anchored, riders));
    failed
}

/// A directory this user may write but not read (a drop box, mode 0300)
/// cannot be opened to be synced. Its entries are made durable all the
/// same by a `syncfs` of its file system, through its parent where that
/// can be opened, is on the same file system, and the file system honours
/// `syncfs`. Returns the parent, opened, and the device.
fn syncfs_anchor(dir: &Path) -> Option<(File, u64)> {
    let dev = dev_of(dir)?;
    let parent = atomic::open_directory(atomic::parent_dir(dir)).ok()?;
    let same = parent.metadata().ok()?.dev() == dev;
    (same && atomic::syncfs_is_durable(std::os::fd::AsFd::as_fd(&parent))).then_some((parent, dev))
}

/// Makes the entries of the open directories `dirs` durable (see
/// [`sync_open`]). Returns the first error.
pub fn sync_open_dirs(dirs: Vec<std::os::fd::OwnedFd>) -> io::Result<()> {
    let open = dirs.into_iter().map(|fd| ((), File::from(fd))).collect();
    match sync_open(open, false, Vec::new()).into_iter().next() {
        Some(((), e)) => Err(e),
        None => Ok(()),
    }
}

/// The one policy for directories: one directory (or several names of
/// one) is fsynced; several are made durable with one `syncfs` per file
/// system that honours it (each directory fsync is a journal commit of its
/// own, and a tree of many directories would pay one per directory and
/// batch), the others are fsynced, several at once. Returns the tags of
/// those that failed.
///
/// `riders`: directories not opened, each with its device, on which one of
/// `dirs` is open with a file system that honours `syncfs` (the caller saw
/// to that): they share that `syncfs` and its outcome.
fn sync_open<T: Send>(
    dirs: Vec<(T, File)>,
    whole: bool,
    riders: Vec<(T, u64)>,
) -> Vec<(T, io::Error)> {
    let copy = |e: &io::Error| io::Error::new(e.kind(), e.to_string());
    let mut failed = Vec::new();
    // One entry per directory, with the tags of all its names.
    let mut each: Vec<((u64, u64), File, Vec<T>)> = Vec::new();
    for (tag, f) in dirs {
        match f.metadata() {
            Ok(m) => match each.iter_mut().find(|(id, _, _)| *id == (m.dev(), m.ino())) {
                Some((_, _, tags)) => tags.push(tag),
                None => each.push(((m.dev(), m.ino()), f, vec![tag])),
            },
            Err(e) => failed.push((tag, e)),
        }
    }
    let mut fail_all = |tags: Vec<T>, e: &io::Error| {
        failed.extend(tags.into_iter().map(|t| (t, copy(e))));
    };
    let mut by_device: Vec<(u64, File, Vec<T>)> = Vec::new();
    let mut one_by_one = Vec::new();
    let single = each.len() == 1 && !whole;
    for ((dev, _), f, tags) in each {
        match by_device.iter_mut().find(|(dv, _, _)| *dv == dev) {
            Some((_, _, all)) => all.extend(tags),
            None if !single && atomic::syncfs_is_durable(std::os::fd::AsFd::as_fd(&f)) => {
                by_device.push((dev, f, tags))
            }
            None => one_by_one.push((tags, f)),
        }
    }
    let mut unsynced = Vec::new();
    for (tag, dev) in riders {
        match by_device.iter_mut().find(|(dv, _, _)| *dv == dev) {
            Some((_, _, tags)) => tags.push(tag),
            // Its device's directory could not be asked what it is.
            None => unsynced.push(tag),
        }
    }
    fail_all(
        unsynced,
        &io::Error::other("its file system could not be synced"),
    );
    for (_, f, tags) in by_device {
        // SAFETY: syncfs on a valid open descriptor.
        if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
            fail_all(tags, &io::Error::last_os_error());
        }
    }
    let synced = fsync_each(one_by_one, |(_, f): &mut (Vec<T>, File)| f.sync_all());
    for ((tags, _), r) in synced {
        if let Err(e) = r {
            fail_all(tags, &e);
        }
    }
    failed
}

/// How many outputs a batch may hold open: a quarter of the open-file
/// limit (raised to its hard maximum first), between 64 and 4,096.
pub fn max_open_outputs() -> usize {
    (open_file_limit() / 4).clamp(64, 4096) as usize
}

/// The open-file limit, its soft value raised to the hard one first (at
/// most 65,536), as many tools do; 64 if it cannot be read.
fn open_file_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid struct; raising the soft
    // limit up to the hard one needs no privilege.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 64;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max.min(65_536),
                rlim_max: lim.rlim_max,
            };
            if raised.rlim_cur > lim.rlim_cur && libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0
            {
                lim.rlim_cur = raised.rlim_cur;
            }
        }
    }
    lim.rlim_cur
}

/// Removes an `--in-place` original once its output is durable, but only
/// while it is still the file that was read: unchanged through the open
/// file, and still under its name (an editor that saved a new version by
/// renaming it into place keeps that version). Not durable yet: its
/// directory is synced with the others'.
///
/// The check and the removal cannot be one step, so the original is first
/// renamed aside (to `.NAME.tpmcrypt-removing.PID.RANDOM`, never over
/// anything), checked again there, and only then unlinked: a new version
/// renamed over the name, or bytes appended, after the first check is put
/// back or kept, not lost. Killed in between, the run leaves it there; the
/// next run puts it back ([`atomic::restore_moved_aside`]).
///
/// Every step names the original relative to its directory, open in `at`
/// (opened here unless the last original was in the same directory):
/// consecutive originals of one directory share one open of it
/// ([`NamingDir`]).
fn remove_original(o: &Original, at: &mut Option<NamingDir>) -> anyhow::Result<()> {
    use anyhow::Context as _;
    const WHAT: &str = "removing the original";
    let name = o
        .path
        .file_name()
        .context("removing the original: no file name")?;
    let parent = atomic::parent_dir(&o.path);
    // The directory, open already if the last original was in it too.
    let dir = match at.take() {
        Some(d) if d.path() == parent => at.insert(d),
        _ => at.insert(NamingDir::open(parent)),
    };
    let same = |(_, dev, ino): (Kind, u64, u64)| dev == o.stamp.dev && ino == o.stamp.ino;
    let unchanged = || o.file.metadata().is_ok_and(|m| Stamp::of(&m) == o.stamp);
    let named = dir.lstat(name).context(WHAT)?;
    if !unchanged() || !same(named) {
        return Err(OriginalChanged.into());
    }
    // A name of its own form, never a temporary's: a crash before the
    // unlink leaves it for the next run to put back, never to delete.
    let aside = atomic::aside_name(name, atomic::ASIDE_MARKER);
    dir.naming(|| dir.rename_noreplace(name, &aside))
        .context(WHAT)?;
    // The rename itself changes the ctime; everything else must be as read.
    let unchanged_but_renamed = || {
        o.file.metadata().is_ok_and(|m| {
            let now = Stamp::of(&m);
            (now.size, now.mtime_ns, now.mode, now.nlink)
                == (o.stamp.size, o.stamp.mtime_ns, o.stamp.mode, o.stamp.nlink)
        })
    };
    let moved = dir.lstat(&aside).context(WHAT)?;
    if same(moved) && unchanged_but_renamed() {
        return dir.unlink(&aside).context(WHAT);
    }
    // Changed or replaced between the check and the rename: put it back.
    if dir.rename_noreplace(&aside, name).is_ok() {
        return Err(OriginalChanged.into());
    }
    // Its name was taken meanwhile: keep it under a name no clean-up of
    // temporaries touches.
    let mut kept = name.to_owned();
    kept.push(format!(".kept-{}", std::process::id()));
    let shown = match dir.rename_noreplace(&aside, &kept) {
        Ok(()) => crate::ui::shown(&parent.join(&kept)),
        Err(_) => crate::ui::shown(&parent.join(&aside)),
    };
    Err(anyhow::anyhow!(
        "changed while its original was being removed, and its name was taken meanwhile; \
         that version is kept as {shown}"
    ))
}

/// For tests: the batch's final names.
#[cfg(test)]
fn names<T>(b: &Batch<T>) -> Vec<&std::path::Path> {
    b.pending.iter().map(|p| p.out.dest()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::path::Path;

    /// A directory to sync that another user swapped for a FIFO is an
    /// error at once, not an open that waits for a writer.
    #[test]
    fn a_directory_swapped_for_a_fifo_is_an_error_not_a_hang() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("d");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let dirs: BTreeSet<PathBuf> = [fifo.clone()].into();
        std::thread::spawn(move || {
            let _ = tx.send(sync_dirs(&dirs, false));
        });
        let failed = match rx.recv_timeout(Duration::from_secs(5)) {
            Ok(failed) => failed,
            Err(_) => {
                // Unblock the open the old code is stuck in.
                let _ = std::fs::OpenOptions::new().write(true).open(&fifo);
                panic!("syncing a FIFO as a directory blocked");
            }
        };
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert_eq!(failed[0].1.raw_os_error(), Some(libc::ENOTDIR));
    }

    fn output(dir: &Path, name: &str, data: &[u8]) -> AtomicFile {
        use std::io::Write;
        let mut out = AtomicFile::create(&dir.join(name), 0o644, false).unwrap();
        out.file().write_all(data).unwrap();
        out
    }

    #[test]
    fn a_run_is_cut_into_about_four_batches_within_its_bounds() {
        let roomy = Limits {
            files: 4096,
            bytes: 256 << 20,
            age: Duration::from_secs(1),
            window: 4096,
        };
        let cut = |l: Limits, n| {
            let l = l.for_tasks(n);
            (l.files, l.window)
        };
        assert_eq!(cut(roomy, 2000), (500, 500));
        assert_eq!(cut(roomy, 20_000), (4096, 4096));
        // A small run stays one batch.
        assert_eq!(cut(roomy, 100), (256, 256));
        // Never beyond what the open files allow.
        let tight = Limits {
            files: 100,
            window: 60,
            ..roomy
        };
        assert_eq!(cut(tight, 2000), (100, 60));
        assert_eq!(roomy.for_tasks(2000).bytes, 256 << 20);
    }

    #[test]
    fn a_batch_renames_everything_and_removes_originals_after() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        let mut batch = Batch::new(Limits {
            files: 3,
            bytes: u64::MAX,
            age: Duration::from_secs(60),
            window: 1,
        });
        for i in 0..3 {
            let orig = dir.join(format!("o{i}"));
            std::fs::write(&orig, b"plain").unwrap();
            let file = File::open(&orig).unwrap();
            let stamp = Stamp::of(&file.metadata().unwrap());
            let full = batch.push(Pending {
                tag: i,
                out: output(dir, &format!("o{i}.tpmc"), b"cipher"),
                bytes: 6,
                original: Some(Original {
                    path: orig,
                    file,
                    stamp,
                    exact: true,
                }),
            });
            assert_eq!(full, i == 2);
            // Nothing is in place before the commit.
            assert!(!dir.join(format!("o{i}.tpmc")).exists());
        }
        assert_eq!(names(&batch).len(), 3);
        // One original changes before the commit: it is kept.
        std::fs::write(dir.join("o1"), b"plain, appended").unwrap();
        let results = batch.commit();
        assert_eq!(results.len(), 3);
        for (i, r) in results {
            assert!(dir.join(format!("o{i}.tpmc")).exists());
            if i == 1 {
                assert!(matches!(r, Err(CommitError::Original(_))), "{r:?}");
                assert!(dir.join("o1").exists());
            } else {
                assert!(r.is_ok(), "{r:?}");
                assert!(!dir.join(format!("o{i}")).exists());
            }
        }
        assert!(batch.is_empty());
    }

    #[test]
    fn par_map_keeps_the_order_on_any_number_of_threads() {
        for threads in [1, 2, 3, 8, 2000] {
            let seen = std::sync::Mutex::new(std::collections::HashSet::new());
            let out = par_map((0..1000).collect(), threads, |i: usize| {
                seen.lock().unwrap().insert(std::thread::current().id());
                i * 2
            });
            assert_eq!(out, (0..1000).map(|i| i * 2).collect::<Vec<_>>());
            let used = seen.lock().unwrap().len();
            assert_eq!(used, threads.min(1000), "threads {threads}");
        }
        assert!(par_map(Vec::<u8>::new(), 4, |b| b).is_empty());
    }

    #[test]
    fn a_large_batch_is_committed_on_several_threads_with_each_outcome_in_place() {
        const N: usize = 300;
        assert!(threads_for(N) >= std::thread::available_parallelism().unwrap().get().min(4));
        let d = tempfile::tempdir().unwrap();
        // Several directories, as a tree's are.
        let dirs: Vec<_> = (0..5).map(|k| d.path().join(format!("d{k}"))).collect();
        for dir in &dirs {
            std::fs::create_dir(dir).unwrap();
        }
        let mut batch = Batch::new(Limits {
            files: N,
            bytes: u64::MAX,
            age: Duration::from_secs(60),
            window: N,
        });
        let at = |i: usize| dirs[i % dirs.len()].join(format!("o{i}"));
        for i in 0..N {
            let orig = at(i);
            std::fs::write(&orig, b"plain").unwrap();
            let file = File::open(&orig).unwrap();
            let stamp = Stamp::of(&file.metadata().unwrap());
            let dest = dirs[i % dirs.len()].join(format!("o{i}.tpmc"));
            // Half with no name until the commit, half under a temporary.
            let mut out = match i % 2 {
                0 => AtomicFile::create_unnamed(&dest, 0o644, false, true).unwrap(),
                _ => AtomicFile::create(&dest, 0o644, false).unwrap(),
            };
            std::io::Write::write_all(out.file(), format!("cipher {i}").as_bytes()).unwrap();
            batch.push(Pending {
                tag: i,
                out,
                bytes: 6,
                original: Some(Original {
                    path: orig,
                    file,
                    stamp,
                    exact: true,
                }),
            });
        }
        // Before the commit: two originals change, one output's name is
        // taken by someone else.
        let changed = [7, 151];
        for i in changed {
            std::fs::write(at(i), b"plain, appended").unwrap();
        }
        let taken = 200;
        std::fs::write(at(taken).with_extension("tpmc"), b"someone else's").unwrap();
        let results = batch.commit();
        assert_eq!(
            results.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
            (0..N).collect::<Vec<_>>()
        );
        for (i, r) in results {
            let out = std::fs::read(at(i).with_extension("tpmc")).unwrap();
            if i == taken {
                assert!(matches!(r, Err(CommitError::Rename(_))), "{i}: {r:?}");
                assert_eq!(out, b"someone else's");
                assert!(at(i).exists(), "the original of {i} is kept");
                continue;
            }
            assert_eq!(out, format!("cipher {i}").as_bytes());
            if changed.contains(&i) {
                assert!(matches!(r, Err(CommitError::Original(_))), "{i}: {r:?}");
                assert_eq!(std::fs::read(at(i)).unwrap(), b"plain, appended");
            } else {
                assert!(r.is_ok(), "{i}: {r:?}");
                assert!(!at(i).exists(), "the original of {i} is removed");
            }
        }
        // Nothing else is left: no temporary, nothing moved aside.
        let left: usize = dirs
            .iter()
            .map(|dir| std::fs::read_dir(dir).unwrap().count())
            .sum();
        assert_eq!(left, N + changed.len() + 1);
    }

    #[test]
    fn chained_commits_remove_a_batchs_originals_after_the_next_sync_and_commit_ends_it() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        let mut batch = Batch::new(Limits {
            files: 2,
            bytes: u64::MAX,
            age: Duration::from_secs(60),
            window: 2,
        });
        let add = |batch: &mut Batch<usize>, i: usize| {
            let orig = dir.join(format!("o{i}"));
            std::fs::write(&orig, b"plain").unwrap();
            let file = File::open(&orig).unwrap();
            let stamp = Stamp::of(&file.metadata().unwrap());
            let dest = dir.join(format!("o{i}.tpmc"));
            let mut out = AtomicFile::create_unnamed(&dest, 0o644, false, true).unwrap();
            std::io::Write::write_all(out.file(), b"cipher").unwrap();
            let original = Some(Original {
                path: orig,
                file,
                stamp,
                exact: true,
            });
            batch.push(Pending {
                tag: i,
                out,
                bytes: 6,
                original,
            })
        };
        let there = |i: usize, ext: &str| dir.join(format!("o{i}{ext}")).exists();
        assert!(!add(&mut batch, 0));
        assert!(add(&mut batch, 1));
        // The first batch: named, its originals kept, no outcome yet.
        assert!(batch.commit_chained().is_empty());
        assert!(there(0, ".tpmc") && there(1, ".tpmc") && there(0, "") && there(1, ""));
        assert!(!batch.is_empty());
        assert!(!add(&mut batch, 2));
        assert!(add(&mut batch, 3));
        // The second: its sync made the first's names durable, so the
        // first's originals go, and its outcomes come back, in order.
        let first = batch.commit_chained();
        assert_eq!(first.iter().map(|(t, _)| *t).collect::<Vec<_>>(), [0, 1]);
        assert!(first.iter().all(|(_, r)| r.is_ok()), "{first:?}");
        assert!(!there(0, "") && !there(1, ""));
        assert!(there(2, ".tpmc") && there(3, ".tpmc") && there(2, "") && there(3, ""));
        // A commit ends it: the second batch finished, then a new one.
        assert!(!add(&mut batch, 4));
        let rest = batch.commit();
        assert_eq!(rest.iter().map(|(t, _)| *t).collect::<Vec<_>>(), [2, 3, 4]);
        assert!(rest.iter().all(|(_, r)| r.is_ok()), "{rest:?}");
        assert!((2..5).all(|i| there(i, ".tpmc") && !there(i, "")));
        assert!(batch.is_empty());
        assert!(batch.commit().is_empty());
    }

    #[test]
    fn a_name_taken_meanwhile_fails_only_that_output() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        let mut batch = Batch::new(Limits::default());
        batch.push(Pending {
            tag: "a",
            out: output(dir, "a.tpmc", b"x"),
            bytes: 1,
            original: None,
        });
        batch.push(Pending {
            tag: "b",
            out: output(dir, "b.tpmc", b"y"),
            bytes: 1,
            original: None,
        });
        std::fs::write(dir.join("b.tpmc"), b"someone else's").unwrap();
        let results = batch.commit();
        assert!(results[0].1.is_ok());
        assert!(matches!(results[1].1, Err(CommitError::Rename(_))));
        assert_eq!(
            std::fs::read(dir.join("b.tpmc")).unwrap(),
            b"someone else's"
        );
        // No temporary is left behind.
        let left: Vec<_> = std::fs::read_dir(dir).unwrap().collect();
        assert_eq!(left.len(), 2);
    }
}
