//! One file, start to finish: open beneath SRC without following symlinks,
//! check it is settled and has no writer, encrypt it under a temporary name,
//! check it did not change meanwhile, make the ciphertext durable, and with
//! `--delete-plaintext` verify the ciphertext against the source before
//! removing the source.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use sha2::{Digest, Sha256};
use tpmcrypt_cipher::{Decryptor, Encryptor, Header, StreamOptions};
use tracing::warn;

use super::fsio::{self, Kind, OpenError, Writers};
use super::journal::{Journal, Record};
use super::show;
use crate::atomic::AtomicFile;
use crate::batch::Original;
use crate::stamp::Stamp;

/// One session: the key every file is encrypted under until the next
/// rotation, and a decryptor that knows it (for verification).
pub struct Session {
    /// Shared by all workers (it is Sync).
    pub encryptor: Encryptor,
    /// Knows this session's key: verifies without any identity or TPM.
    pub verifier: Decryptor,
    /// Session id as shown by `tpmcrypt inspect`.
    pub id: String,
}

impl Session {
    /// Draws a session key and wraps it to the recipients.
    pub fn new(
        recipients: &[Box<dyn tpmcrypt_cipher::Recipient>],
        params: tpmcrypt_cipher::Params,
    ) -> anyhow::Result<Session> {
        let encryptor = Encryptor::new(recipients, params)?;
        let verifier = encryptor.verifier()?;
        let header = Header::read_from(&mut encryptor.header())?;
        let id = hex::encode(&header.stanza_digest()[..16]);
        Ok(Session {
            encryptor,
            verifier,
            id,
        })
    }
}

/// What every worker shares.
pub struct Ctx {
    /// SRC, opened as a directory: every source is opened beneath it.
    pub src_root: File,
    /// DEST (canonical).
    pub dest: PathBuf,
    /// DEST's device and inode at start: a DEST removed or replaced since
    /// is never written to (nor recreated).
    pub dest_id: (u64, u64),
    /// Minimum age of the last modification.
    pub settle: Duration,
    /// Remove verified sources.
    pub delete: bool,
    /// The current session (replaced on rotation).
    pub session: Mutex<Arc<Session>>,
    /// Whether the "no leases" notice was logged.
    pub lease_noted: AtomicBool,
    /// Sources already warned about as kept for want of a lease.
    pub no_lease_warned: Mutex<HashSet<PathBuf>>,
    /// The journal (the coordinator's; a worker records a ciphertext in it
    /// before giving it its final name).
    pub journal: Arc<Mutex<Journal>>,
}

impl Ctx {
    /// The session to use for the next file.
    pub fn session(&self) -> Arc<Session> {
        self.session
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Version `n` of the ciphertext of `rel`: DEST/rel.tpmc for 1,
    /// DEST/rel.vN.tpmc for N ≥ 2 (the names are bytes, as the source's).
    pub fn version_path(&self, rel: &Path, n: u32) -> PathBuf {
        let mut name = self.dest.join(rel).into_os_string();
        if n > 1 {
            name.push(format!(".v{n}"));
        }
        name.push(".");
        name.push(crate::files::SUFFIX);
        PathBuf::from(name)
    }

    /// Appends `rec` to the journal (None: forgets `rel`) and hands it to
    /// the kernel. A failure is only logged: without the record a restart
    /// adds a version rather than rewriting this one, which loses nothing.
    pub fn record(&self, rel: &Path, rec: Option<Record>) {
        let mut j = self.journal.lock().unwrap_or_else(|e| e.into_inner());
        let written = match rec {
            Some(r) => j.put(rel, r),
            None => j.remove(rel),
        };
        if let Err(e) = written.and_then(|()| j.flush()) {
            warn!("{}: cannot write the journal: {e}", show(rel));
        }
    }

    /// Whether the journal still holds `rec` for `rel`: without
    /// --delete-plaintext, a source removed (or moved out of SRC) while its
    /// job was in flight has its record forgotten at once (coord.rs
    /// `forget`), and a ciphertext that job was to replace is then no
    /// longer its own: the job may have opened a newcomer of that name.
    pub fn still_recorded(&self, rel: &Path, rec: &Record) -> bool {
        let j = self.journal.lock().unwrap_or_else(|e| e.into_inner());
        j.get(rel).as_ref() == Some(rec)
    }

    /// Fails unless DEST is still the directory the daemon started with.
    pub fn check_dest(&self) -> anyhow::Result<()> {
        match fs::symlink_metadata(&self.dest) {
            Ok(m) if (m.dev(), m.ino()) == self.dest_id => Ok(()),
            _ => bail!(
                "{}: DEST was removed, moved or replaced (it is not recreated)",
                super::show(&self.dest)
            ),
        }
    }

    /// Creates the directories of `rel` below DEST, never DEST itself, and
    /// checks that each is a directory, not a symlink to elsewhere (which
    /// would be followed when writing).
    fn create_dest_dirs(&self, rel: &Path) -> anyhow::Result<()> {
        let Some(parent) = rel.parent() else {
            return Ok(());
        };
        let mut dir = self.dest.clone();
        for part in parent.components() {
            dir.push(part);
            match fs::create_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(
                        anyhow::Error::from(e).context(format!("creating {}", super::show(&dir)))
                    )
                }
            }
            let kind = fs::symlink_metadata(&dir)
                .map(|m| Kind::from_mode(m.mode()))
                .with_context(|| super::show(&dir))?;
            if kind != Kind::Dir {
                bail!(
                    "{}: a {} in DEST where a directory belongs (never followed)",
                    super::show(&dir),
                    kind.name()
                );
            }
        }
        Ok(())
    }

    /// Where the ciphertext of `job` goes, and whether it may replace what
    /// is there. A ciphertext is replaced only when the journal says it
    /// belongs to this source, still in SRC, and, with --delete-plaintext,
    /// nothing is lost by replacing it: it holds exactly the version at
    /// hand, or (made by this session) a prefix of the source as it is now,
    /// as when a log was appended to. Any other existing ciphertext may be
    /// the only copy of a plaintext that is gone (a source overwritten
    /// after it was encrypted, say), so the lowest free version number is
    /// taken instead.
    fn target(&self, job: &Job, st: &Stamp, src: &File, session: &Session) -> (u32, PathBuf, bool) {
        let rel = &job.rel;
        if let Some(p) = job.prev {
            let path = self.version_path(rel, p.version);
            if ciphertext_present(&path, &p)
                && (!self.delete
                    || p.same_source(st.size, st.mtime_ns, st.ino)
                    || (job.fresh && decrypts_to_a_prefix(session, &path, src)))
            {
                return (p.version, path, true);
            }
        }
        let taken = |path: &Path| fs::symlink_metadata(path).is_ok();
        let first = self.version_path(rel, 1);
        if !taken(&first) {
            return (1, first, false);
        }
        let mut n = 2;
        loop {
            let path = self.version_path(rel, n);
            if !taken(&path) || n == u32::MAX {
                return (n, path, false);
            }
            n += 1;
        }
    }
}

/// A file to encrypt.
pub struct Job {
    /// Path relative to SRC.
    pub rel: PathBuf,
    /// What the journal says was encrypted last time.
    pub prev: Option<Record>,
    /// Whether `prev` was recorded by this run (see [`Journal::is_fresh`]).
    pub fresh: bool,
}

/// What happened.
pub enum Outcome {
    /// The ciphertext is durable (and the source removed, if `deleted`).
    Encrypted {
        /// The version encrypted.
        rec: Record,
        /// The source was verified and removed.
        deleted: bool,
        /// Kept under --delete-plaintext: no lease could be taken on it.
        no_lease: bool,
        /// When the ciphertext became durable.
        done_at: Instant,
        /// Time spent by the worker.
        service: Duration,
    },
    /// Already encrypted and unchanged since (journal).
    Unchanged,
    /// Not a regular file: skipped, never followed or read.
    NotRegular(Kind),
    /// No longer there.
    Gone,
    /// Some process still has it open for writing.
    Busy,
    /// Modified less than --settle ago: try again after this long.
    NotSettled(Duration),
    /// It changed while being encrypted: do it again.
    Changed,
    /// An error; retried with backoff.
    Failed(anyhow::Error),
}

/// The source of a ciphertext to remove once it is committed
/// (`--delete-plaintext`).
pub struct Source {
    /// Its directory beneath SRC.
    pub dir: OwnedFd,
    /// The source, open.
    pub file: File,
    /// How it was when encrypted.
    pub st0: Stamp,
}

/// A ciphertext complete under its temporary name, verified if its source
/// is to be removed: what the committer needs besides the file.
pub struct Item {
    /// Path relative to SRC.
    pub rel: PathBuf,
    /// Its journal record (written just before the rename).
    pub rec: Record,
    /// The record of the ciphertext it replaces, as the job was given it
    /// (see [`Ctx::still_recorded`]).
    pub replaces: Option<Record>,
    /// The source to remove after the commit, if any.
    pub source: Option<Source>,
    /// Kept under --delete-plaintext: no lease could be taken on it.
    pub no_lease: bool,
    /// Kept under --delete-plaintext for its other hard links: how many
    /// links it has (0: not kept for that).
    pub links: u64,
    /// Time the worker spent on it.
    pub service: Duration,
    /// When the worker handed it over (a batch's age counts from its
    /// oldest output's).
    pub ready_at: Instant,
}

/// A ciphertext handed to the committer.
pub struct Ready {
    /// All but the files.
    pub item: Item,
    /// The ciphertext under its temporary name.
    pub out: AtomicFile,
    /// The ciphertext it replaces, open (exchanged with it at the commit).
    pub old: Option<Original>,
}

/// What a worker did with a job.
pub enum Step {
    /// Finished (nothing to commit).
    Done(Outcome),
    /// A ciphertext to commit with the next batch.
    Commit(Box<Ready>),
}

/// Processes one job; never panics through (a panic becomes a failure).
pub fn process(ctx: &Ctx, job: &Job) -> Step {
    let started = Instant::now();
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        encrypt_one(ctx, job, started)
    })) {
        Ok(Ok(step)) => step,
        Ok(Err(e)) => Step::Done(Outcome::Failed(e)),
        Err(_) => Step::Done(Outcome::Failed(anyhow::anyhow!(
            "internal error (worker panicked)"
        ))),
    }
}

fn encrypt_one(ctx: &Ctx, job: &Job, started: Instant) -> anyhow::Result<Step> {
    pause("open", &job.rel);
    // The source's directory is needed only to remove the source.
    let (dir, file) = match fsio::open_beneath(&ctx.src_root, &job.rel, ctx.delete) {
        Ok(x) => x,
        Err(OpenError::NotRegular(k)) => return Ok(Step::Done(Outcome::NotRegular(k))),
        Err(OpenError::Io(e)) if e.kind() == io::ErrorKind::NotFound => {
            return Ok(Step::Done(Outcome::Gone))
        }
        Err(OpenError::Io(e)) => return Err(anyhow::Error::from(e).context("cannot open")),
    };
    let st0 = Stamp::of(&file.metadata()?);
    // Under --delete-plaintext a source is kept when removing it could
    // lose data: it has other hard links, or no lease can be taken on it
    // (not the owner and no CAP_LEASE, or unsupported), so that a writer
    // still holding it open cannot be ruled out. A kept source is skipped
    // like any source when unchanged.
    let links = ctx.delete && st0.nlink > 1;
    let no_lease = ctx.delete && !links && fsio::writers(&file) == Writers::Unknown;
    let kept = links || no_lease;
    if let Some(outcome) = not_now(ctx, job, &file, &st0, !ctx.delete || kept) {
        return Ok(Step::Done(outcome));
    }
    ctx.check_dest()?;
    ctx.create_dest_dirs(&job.rel)?;
    let session = ctx.session();
    let Temporary {
        out,
        rec,
        dest,
        replaces,
        old,
    } = match encrypt_to_temporary(ctx, job, &file, &st0, &session)? {
        Ok(t) => t,
        Err(outcome) => return Ok(Step::Done(outcome)),
    };
    let mut source = None;
    if ctx.delete && !kept {
        // Read back from the temporary (the bytes the commit makes
        // durable): the workers verify in parallel, the committer only
        // removes.
        let verified = out
            .open_for_reading()
            .map_err(anyhow::Error::from)
            .and_then(|ct| verify(&session, &ct, &file));
        if let Err(e) = verified {
            // Appended to since it was encrypted (a writer's open, close
            // and settle can all fit in that time): done again, not an
            // error.
            if Stamp::of(&file.metadata()?) != st0 {
                return Ok(Step::Done(Outcome::Changed));
            }
            return Err(e.context(format!("verifying {}", show(&dest))));
        }
        // Asked for under --delete-plaintext, so always there.
        let dir = dir.context("the source's directory is not open")?;
        source = Some(Source { dir, file, st0 });
    }
    pause("ready", &job.rel);
    Ok(Step::Commit(Box::new(Ready {
        item: Item {
            rel: job.rel.clone(),
            rec,
            replaces,
            source,
            no_lease,
            links: if links { st0.nlink } else { 0 },
            service: started.elapsed(),
            ready_at: Instant::now(),
        },
        out,
        old,
    })))
}

/// Why the source is not to be encrypted now, if it is not: unchanged
/// since its record (when `skippable`), modified less than --settle ago,
/// or open for writing.
fn not_now(ctx: &Ctx, job: &Job, file: &File, st0: &Stamp, skippable: bool) -> Option<Outcome> {
    if skippable {
        if let Some(prev) = job.prev {
            if prev.same_source(st0.size, st0.mtime_ns, st0.ino)
                && ciphertext_present(&ctx.version_path(&job.rel, prev.version), &prev)
            {
                return Some(Outcome::Unchanged);
            }
        }
    }
    if !st0.mtime_in_future() {
        let age = st0.age();
        if age < ctx.settle {
            return Some(Outcome::NotSettled(ctx.settle - age));
        }
    }
    match fsio::writers(file) {
        Writers::Busy => return Some(Outcome::Busy),
        Writers::Unknown => {
            if !ctx.lease_noted.swap(true, Ordering::Relaxed) {
                tracing::info!(
                    "file leases are not available here (not the files' owner, or unsupported); \
                     an open writer is detected by --settle and by re-checking after encryption{}",
                    if ctx.delete {
                        "; with --delete-plaintext such files are encrypted but kept"
                    } else {
                        ""
                    }
                );
            }
        }
        Writers::None => {}
    }
    None
}

/// Encrypts the source into a temporary beside its ciphertext's name:
/// the temporary, its record and that name; or `Changed` if the source
/// changed meanwhile (the temporary is then dropped, nothing renamed).
fn encrypt_to_temporary(
    ctx: &Ctx,
    job: &Job,
    file: &File,
    st0: &Stamp,
    session: &Session,
) -> anyhow::Result<Result<Temporary, Outcome>> {
    let (version, dest, replace) = ctx.target(job, st0, file, session);
    let replaces = if replace { job.prev } else { None };
    // The ciphertext to replace, open now: it is replaced only if its name
    // still holds it at the commit. Gone or swapped already: done again.
    let old = match replaces {
        Some(prev) => match open_ciphertext(&dest, &prev) {
            Some(o) => Some(o),
            None => return Ok(Err(Outcome::Changed)),
        },
        None => None,
    };
    let mode = (st0.mode & 0o777) | 0o600;
    // A new ciphertext is written with no name (`O_TMPFILE`, where DEST's
    // file system takes it) and linked at commit: DEST gains one entry,
    // where a temporary costs two and a rename. `target` found the name
    // free a moment ago; should it be taken since, the link refuses.
    // Replacing needs a rename, so a temporary.
    let out = if replace {
        AtomicFile::create(&dest, mode, true)
    } else {
        AtomicFile::create_unnamed(&dest, mode, true, true)
    };
    let mut out = out.with_context(|| format!("creating a temporary for {}", show(&dest)))?;
    let result = {
        let w = BufWriter::with_capacity(64 << 10, out.file());
        session
            .encryptor
            .encrypt_file(file, w, &StreamOptions::sequential())
    };
    let st1 = Stamp::of(&file.metadata()?);
    if st1 != *st0 {
        return Ok(Err(Outcome::Changed));
    }
    result.context("encrypting")?;
    let ct = out.file().metadata()?;
    let rec = Record {
        size: st0.size,
        mtime_ns: st0.mtime_ns,
        ino: st0.ino,
        ct_len: ct.len(),
        version,
        ct_ino: ct.ino(),
    };
    Ok(Ok(Temporary {
        out,
        rec,
        dest,
        replaces,
        old,
    }))
}

/// A ciphertext complete under its temporary name.
struct Temporary {
    out: AtomicFile,
    /// Its journal record.
    rec: Record,
    /// Its final name.
    dest: PathBuf,
    /// The record of the ciphertext it is to replace, if any.
    replaces: Option<Record>,
    /// That ciphertext, open: the commit exchanges the new one with it
    /// only if its name still holds it (see [`crate::replace::exchange`]).
    old: Option<Original>,
}

/// Whether DEST holds, at `path`, the ciphertext `rec` describes: a regular
/// file (a symlink there is never followed) of its size and, when known,
/// its inode.
pub fn ciphertext_present(path: &Path, rec: &Record) -> bool {
    fs::symlink_metadata(path)
        .map(|m| m.is_file() && m.len() == rec.ct_len && (rec.ct_ino == 0 || m.ino() == rec.ct_ino))
        .unwrap_or(false)
}

/// Opens the ciphertext `rec` describes at `path` (no symlink followed),
/// as an original that only it may be exchanged with: None unless it is
/// there, a regular file of its size and, when known, its inode.
fn open_ciphertext(path: &Path, rec: &Record) -> Option<Original> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let m = file.metadata().ok()?;
    let ok = m.is_file() && m.len() == rec.ct_len && (rec.ct_ino == 0 || m.ino() == rec.ct_ino);
    ok.then(|| Original {
        path: path.to_path_buf(),
        stamp: Stamp::of(&m),
        file,
        // A backup's hard link to it (`cp -al DEST`) is no reason to keep it.
        exact: false,
    })
}

/// A `Write` that compares what it is given with a file, from its start,
/// and fails at the first difference or past the file's end.
struct PrefixCheck<'a> {
    file: &'a File,
    off: u64,
    buf: Vec<u8>,
}

impl Write for PrefixCheck<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buf.resize(data.len(), 0);
        self.file.read_exact_at(&mut self.buf, self.off)?;
        if self.buf != data {
            return Err(io::Error::other("differs"));
        }
        self.off += data.len() as u64;
        Ok(data.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Whether the ciphertext at `ct` decrypts, with this session's key, to
/// the first bytes of `src` (false for another session's ciphertext).
fn decrypts_to_a_prefix(session: &Session, ct: &Path, src: &File) -> bool {
    let Ok(ct) = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(ct)
    else {
        return false;
    };
    let mut check = PrefixCheck {
        file: src,
        off: 0,
        buf: Vec::new(),
    };
    session
        .verifier
        .decrypt_file(&ct, &mut check, &StreamOptions::sequential())
        .is_ok()
}

/// A `Write` that only hashes.
struct HashWriter(Sha256);

impl Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Decrypts the ciphertext (its temporary) with the session's own key and compares
/// it, by SHA-256 and length, with the source as it is now.
fn verify(session: &Session, ct: &File, src: &File) -> anyhow::Result<()> {
    let mut plain = HashWriter(Sha256::new());
    let n = session
        .verifier
        .decrypt_file(ct, &mut plain, &StreamOptions::sequential())?;
    let mut source = Sha256::new();
    let mut buf = vec![0u8; 64 << 10];
    let mut off = 0u64;
    loop {
        let k = src.read_at(&mut buf, off)?;
        if k == 0 {
            break;
        }
        source.update(&buf[..k]);
        off += k as u64;
    }
    if n != off || plain.0.finalize() != source.finalize() {
        bail!("the ciphertext does not decrypt to the source");
    }
    Ok(())
}

/// What became of a verified source at its removal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// Removed.
    Removed,
    /// Kept: it changed, or is not the file encrypted any more (encrypted
    /// again).
    Changed,
    /// Kept: its directory is no longer where it was beneath SRC (moved
    /// out, or renamed: under its new path it is a job of its own).
    Moved,
}

/// Removes the source if it is still exactly what was encrypted, and still
/// where it was beneath SRC (`root`): its directory, opened at pickup,
/// must still be the one at `rel`'s parent (checked before and after the
/// move aside below). Under a read lease (no writer has it open; a new
/// writer's open breaks the lease and waits), the open file must be
/// unchanged and its name must still refer to it. The name is then first
/// moved aside (never replacing anything) to
/// `.NAME.tpmcrypt-removing.PID.RANDOM`, so that an append or an upload
/// renamed in from now on lands on a new file, encrypted in its turn; and
/// only if the moved inode is the one encrypted, unchanged, with a single
/// name and its lease not being broken, is it unlinked. Otherwise it is
/// put back under its name (or, if that was taken meanwhile, kept as
/// `.NAME.tpmcrypt-restored.PID.RANDOM`) to be encrypted again. The
/// removal is made durable by the caller (with the batch's other
/// removals).
pub fn remove_source(
    root: &File,
    dir: &OwnedFd,
    rel: &Path,
    name: &std::ffi::OsStr,
    file: &File,
    st0: &Stamp,
) -> io::Result<Removal> {
    let parent = rel.parent().unwrap_or(Path::new(""));
    let in_place = || fsio::is_still_beneath(root, parent, dir);
    if !in_place() {
        return Ok(Removal::Moved);
    }
    let lease = fsio::lease(file);
    if lease != Writers::None {
        // Busy: a writer. Unknown cannot happen (such sources are kept).
        return Ok(Removal::Changed);
    }
    let result = (|| {
        if Stamp::of(&file.metadata()?) != *st0 {
            return Ok(Removal::Changed);
        }
        match fsio::lstat_at(dir, name) {
            Ok((Kind::File, dev, ino)) if dev == st0.dev && ino == st0.ino => {}
            _ => return Ok(Removal::Changed),
        }
        let aside = fsio::aside_name(name, fsio::ASIDE_MARKER);
        match crate::atomic::naming_in_fd(dir, || fsio::rename_noreplace_at(dir, name, &aside)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Removal::Changed),
            Err(e) => return Err(e),
        }
        // The rename changes the inode's ctime: size and mtime are
        // compared; any write would have broken the lease.
        let moved = fsio::lstat_at(dir, &aside);
        let now = Stamp::of(&file.metadata()?);
        let same = matches!(moved, Ok((Kind::File, dev, ino)) if dev == st0.dev && ino == st0.ino)
            && (now.dev, now.ino, now.size, now.mtime_ns, now.nlink)
                == (st0.dev, st0.ino, st0.size, st0.mtime_ns, 1)
            && fsio::lease_intact(file);
        if same && in_place() {
            fsio::unlink_at(dir, &aside)?;
            return Ok(Removal::Removed);
        }
        put_back(dir, rel, name, &aside)?;
        Ok(if same {
            Removal::Moved
        } else {
            Removal::Changed
        })
    })();
    fsio::unlease(file);
    result
}

/// Renames a moved-aside source back to `name`, never replacing anything:
/// if the name was taken meanwhile, the file is kept as
/// `.NAME.tpmcrypt-restored.PID.RANDOM` (encrypted like any file).
fn put_back(
    dir: &OwnedFd,
    rel: &Path,
    name: &std::ffi::OsStr,
    aside: &std::ffi::OsStr,
) -> io::Result<()> {
    match fsio::rename_noreplace_at(dir, aside, name) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let kept = fsio::aside_name(name, fsio::RESTORED_MARKER);
            fsio::rename_noreplace_at(dir, aside, &kept)?;
            warn!(
                "{}: changed while being removed, and its name was taken meanwhile: kept as {}",
                show(rel),
                show(Path::new(&kept))
            );
        }
        Err(e) => return Err(e),
    }
    fsio::fsync(dir)
}

/// For the tests only, and only in debug builds: with
/// `TPMCRYPT_WATCH_TEST_PAUSE=NAME:MS` a worker waits MS milliseconds
/// before it opens a source whose file name is NAME, and with
/// `NAME:MS:ready` once its ciphertext is complete (and, under
/// --delete-plaintext, verified), before handing it to the committer; so
/// that a test can act on the source, or on DEST, while its job is in
/// flight. Each pause is logged (`test pause: REL held MS ms at STAGE`)
/// as it begins. Release builds have no such hook.
#[cfg(debug_assertions)]
fn pause(stage: &str, rel: &Path) {
    let Some(spec) = std::env::var_os("TPMCRYPT_WATCH_TEST_PAUSE") else {
        return;
    };
    let spec = spec.to_string_lossy().into_owned();
    let mut parts = spec.splitn(3, ':');
    let (Some(name), Some(ms)) = (parts.next(), parts.next()) else {
        return;
    };
    if parts.next().unwrap_or("open") != stage {
        return;
    }
    if rel.file_name().is_some_and(|n| n == name) {
        if let Ok(ms) = ms.parse() {
            // Said first, so that a test acts once the job is held rather
            // than after a sleep it hopes is long enough.
            tracing::info!("test pause: {} held {ms} ms at {stage}", rel.display());
            std::thread::sleep(Duration::from_millis(ms));
        }
    }
}

#[cfg(not(debug_assertions))]
fn pause(_stage: &str, _rel: &Path) {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn put_back_never_replaces_a_name_taken_meanwhile() {
        let d = tempfile::tempdir().unwrap();
        let dir = OwnedFd::from(File::open(d.path()).unwrap());
        let aside = fsio::aside_name(OsStr::new("f"), fsio::ASIDE_MARKER);
        // The name is free: renamed back.
        fs::write(d.path().join(&aside), b"moved aside").unwrap();
        put_back(&dir, Path::new("f"), OsStr::new("f"), &aside).unwrap();
        assert_eq!(fs::read(d.path().join("f")).unwrap(), b"moved aside");
        assert!(!d.path().join(&aside).exists());
        // The name was taken (a new upload): both kept.
        fs::write(d.path().join(&aside), b"older").unwrap();
        put_back(&dir, Path::new("f"), OsStr::new("f"), &aside).unwrap();
        assert_eq!(fs::read(d.path().join("f")).unwrap(), b"moved aside");
        let restored: Vec<_> = fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n.to_string_lossy().starts_with(".f.tpmcrypt-restored."))
            .collect();
        assert_eq!(restored.len(), 1);
        assert_eq!(fs::read(d.path().join(&restored[0])).unwrap(), b"older");
        assert!(fsio::parse_aside(&restored[0]).is_none());
    }
}
