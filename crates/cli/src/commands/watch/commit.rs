//! The committer: the workers hand it complete ciphertexts under their
//! temporary names, and it makes them durable in groups with
//! [`crate::batch`] (one `syncfs` per batch instead of an fsync per file
//! and directory), then removes the sources that `--delete-plaintext`
//! asks to remove. Per batch:
//! 1. the ciphertexts' data is made durable (`syncfs`; a batch of one is
//!    fsynced);
//! 2. each is recorded in the journal, then renamed to its final name;
//! 3. the directories that received one are made durable;
//! 4. only then each source to remove is moved aside and unlinked (see
//!    [`worker::remove_source`]), and the directories that lost one are
//!    made durable, once.
//!
//! The outcomes go to the coordinator only after step 4, so a path stays
//! in flight (never taken twice) until its source is gone or kept.

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use tracing::{debug, warn};

use super::show;
use super::worker::{self, Ctx, Item, Outcome, Ready, Removal};
use crate::batch::{self, Batch, CommitError, Limits, Pending};
use crate::replace::ChangedMeanwhile;

/// How long the oldest ciphertext of a batch may wait for others, from
/// when its worker handed it over: short, since it adds to every file's
/// latency (the p99 goal is 100 ms).
pub const BATCH_AGE: Duration = Duration::from_millis(20);

/// The watch daemon's batch bounds: [`BATCH_AGE`], 256 MiB, and half of
/// the outputs a batch may hold open elsewhere (each pending file here
/// also holds its source and the source's directory open).
pub fn limits() -> Limits {
    Limits {
        files: (batch::max_open_outputs() / 2).max(32),
        bytes: 256 << 20,
        age: batch_age(),
        // Not used here: the daemon's workers bound themselves.
        window: 1,
    }
}

/// [`BATCH_AGE`]; in debug builds, for the tests only,
/// `TPMCRYPT_WATCH_TEST_BATCH_AGE_MS` instead, so that a test counting
/// sync calls per batch sees batches of many files however slowly a
/// loaded machine runs its workers. Release builds have no such setting.
fn batch_age() -> Duration {
    #[cfg(debug_assertions)]
    if let Some(ms) = std::env::var("TPMCRYPT_WATCH_TEST_BATCH_AGE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return Duration::from_millis(ms);
    }
    BATCH_AGE
}

/// The batch being filled, and when its oldest output became ready (its
/// worker finished it). The age bound counts from then, not from when the
/// committer took it: outputs that queued up while the previous batch was
/// committing (a slow disk) are committed at once, not held another
/// [`BATCH_AGE`] on top of that wait.
struct Filling<T> {
    batch: Batch<T>,
    age: Duration,
    oldest: Option<Instant>,
    /// The batch reached its bound of files or bytes.
    full: bool,
}

impl<T: Send> Filling<T> {
    fn new(limits: Limits) -> Self {
        Filling {
            batch: Batch::new(limits),
            age: limits.age,
            oldest: None,
            full: false,
        }
    }

    /// Adds an output a worker finished at `ready_at`; true when the
    /// batch is due (full, or its oldest output is old enough).
    fn push(&mut self, p: Pending<T>, ready_at: Instant) -> bool {
        self.full = self.batch.push(p);
        let oldest = self.oldest.map_or(ready_at, |t| t.min(ready_at));
        self.oldest = Some(oldest);
        self.full || oldest + self.age <= Instant::now()
    }

    /// When the batch is due by age (None while empty).
    fn deadline(&self) -> Option<Instant> {
        let own = self.batch.deadline()?;
        Some(self.oldest.map_or(own, |t| own.min(t + self.age)))
    }

    /// The batch to commit, and when its oldest output was ready; the
    /// next one starts empty.
    fn take(&mut self) -> (&mut Batch<T>, Option<Instant>) {
        self.full = false;
        (&mut self.batch, self.oldest.take())
    }
}

/// Commits what the workers send until they are all gone (their senders
/// dropped), then commits the rest and returns.
pub fn run(
    ctx: Arc<Ctx>,
    rx: Receiver<Box<Ready>>,
    done: Sender<(PathBuf, Outcome)>,
    limits: Limits,
) {
    let mut filling = Filling::new(limits);
    loop {
        let msg = match filling.deadline() {
            Some(at) => rx.recv_deadline(at),
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match msg {
            Ok(ready) => {
                if add(&mut filling, *ready) {
                    // What else is waiting already (it queued up behind
                    // the previous commit) joins the batch.
                    while !filling.full {
                        match rx.try_recv() {
                            Ok(more) => {
                                add(&mut filling, *more);
                            }
                            Err(_) => break,
                        }
                    }
                    commit(&ctx, filling.take(), &done);
                }
            }
            Err(RecvTimeoutError::Timeout) => commit(&ctx, filling.take(), &done),
            Err(RecvTimeoutError::Disconnected) => {
                commit(&ctx, filling.take(), &done);
                return;
            }
        }
    }
}

/// Adds a ciphertext to the batch being filled; true when it is due.
fn add(filling: &mut Filling<Item>, ready: Ready) -> bool {
    let Ready { item, out, old } = ready;
    let bytes = item.rec.ct_len;
    let ready_at = item.ready_at;
    filling.push(
        Pending {
            tag: item,
            out,
            bytes,
            original: old,
        },
        ready_at,
    )
}

/// Steps 1-4 for one batch; sends every outcome.
fn commit(
    ctx: &Ctx,
    (batch, oldest): (&mut Batch<Item>, Option<Instant>),
    done: &Sender<(PathBuf, Outcome)>,
) {
    if batch.is_empty() {
        return;
    }
    let mut first = true;
    let started = Instant::now();
    let ms = |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64() * 1e3;
    let waited = oldest.map_or(0.0, |t| ms(t, started));
    let mut synced = started;
    let mut went = std::collections::HashSet::new();
    let results = batch.commit_with(|item| {
        if std::mem::take(&mut first) {
            synced = Instant::now();
            crash_point("synced");
        }
        // Never into a DEST recreated meanwhile (by another daemon, say).
        ctx.check_dest().map_err(CommitError::Refused)?;
        // Never over the ciphertext of a source that went while this one
        // was encrypted (the job runs again, as a newcomer).
        if let Some(prev) = item.replaces.filter(|_| !ctx.delete) {
            if !ctx.still_recorded(&item.rel, &prev) {
                went.insert(item.rel.clone());
                return Err(CommitError::Refused(anyhow::anyhow!(
                    "its source went while it was encrypted"
                )));
            }
        }
        // Recorded before the ciphertext has its name (and so before any
        // removal of the source): after a kill -9 the next run knows
        // whose ciphertext it is, and rewrites it rather than adding a
        // version.
        ctx.record(&item.rel, Some(item.rec));
        crash_point("recorded");
        Ok(())
    });
    let done_at = Instant::now();
    let files = results.len();
    crash_point("renamed");
    let mut removed_from: Vec<OwnedFd> = Vec::new();
    let mut outcomes = Vec::with_capacity(files);
    for (item, r) in results {
        let rel = item.rel.clone();
        let outcome = match r {
            Ok(()) => finish(ctx, item, done_at, &mut removed_from),
            Err(_) if went.contains(&item.rel) => Outcome::Changed,
            Err(CommitError::Original(e)) if e.is::<ChangedMeanwhile>() => {
                // The ciphertext it was to replace is no longer at its
                // name (moved, replaced): whatever is there is left alone,
                // and the source is done again, under a free name.
                ctx.record(&item.rel, None);
                warn!(
                    "{}: the ciphertext it was to replace was moved or replaced meanwhile; \
                     left as it is, and encrypted again under a free name",
                    show(&ctx.version_path(&item.rel, item.rec.version))
                );
                Outcome::Changed
            }
            Err(e) => {
                if matches!(
                    e,
                    CommitError::Rename(_) | CommitError::Directory(..) | CommitError::Original(_)
                ) {
                    // Perhaps the name was taken meanwhile: whatever is
                    // there is not this source's.
                    ctx.record(&item.rel, None);
                }
                let dest = ctx.version_path(&item.rel, item.rec.version);
                Outcome::Failed(anyhow::Error::from(e).context(format!("writing {}", show(&dest))))
            }
        };
        outcomes.push((rel, outcome));
    }
    let removed = removed_from.len();
    if removed > 0 {
        // A removal that is not durable yet loses nothing: the ciphertext
        // is. A failure is only reported.
        if let Err(e) = batch::sync_open_dirs(removed_from) {
            warn!("the removal of verified sources may not be durable yet: {e}");
        }
    }
    debug!(
        "committed a batch of {files} file(s), {removed} source(s) removed: oldest ready \
         {waited:.1} ms before; data durable in {:.1} ms, names {:.1} ms, removals {:.1} ms",
        ms(started, synced),
        ms(synced, done_at),
        ms(done_at, Instant::now())
    );
    for o in outcomes {
        if done.send(o).is_err() {
            return;
        }
    }
}

/// After the commit of one ciphertext: the warnings of a kept source, or
/// the removal of a verified one (its directory then waits in
/// `removed_from` to be made durable).
fn finish(ctx: &Ctx, item: Item, done_at: Instant, removed_from: &mut Vec<OwnedFd>) -> Outcome {
    let Item {
        rel,
        rec,
        replaces: _,
        source,
        no_lease,
        links,
        service,
        ready_at: _,
    } = item;
    if no_lease {
        warn_no_lease(ctx, &rel);
    } else if links > 1 {
        warn!(
            "{}: kept: it has {links} hard links, and removing this name would leave the \
             plaintext under the others",
            show(&rel)
        );
    }
    let mut deleted = false;
    if let Some(src) = source {
        let Some(name) = rel.file_name() else {
            return Outcome::Failed(anyhow::anyhow!("no file name"));
        };
        match worker::remove_source(&ctx.src_root, &src.dir, &rel, name, &src.file, &src.st0) {
            Ok(Removal::Removed) => {
                deleted = true;
                removed_from.push(src.dir);
            }
            Ok(Removal::Changed) => return Outcome::Changed,
            Ok(Removal::Moved) => warn!(
                "{}: kept: its directory was moved or renamed while it was encrypted (a \
                 source is removed only from where it is beneath SRC; under a new path in \
                 SRC it is a job of its own)",
                show(&rel)
            ),
            Err(e) => {
                return Outcome::Failed(
                    anyhow::Error::from(e).context("removing the verified source"),
                )
            }
        }
    }
    Outcome::Encrypted {
        rec,
        deleted,
        no_lease,
        done_at,
        service,
    }
}

/// Logs once per source that it is kept for want of a lease.
fn warn_no_lease(ctx: &Ctx, rel: &std::path::Path) {
    let first = ctx
        .no_lease_warned
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(rel.to_path_buf());
    if first {
        warn!(
            "{}: kept: no file lease can be taken on it (the daemon is not its owner and has \
             no CAP_LEASE, or the file system has no leases), so a writer that still has it \
             open cannot be ruled out",
            show(rel)
        );
    }
}

/// For the kill -9 tests only, and only in debug builds: with
/// `TPMCRYPT_WATCH_TEST_CRASH_AT=synced` the daemon kills itself (SIGKILL)
/// in its first batch after the data is durable and before any rename;
/// with `=recorded`, after the first ciphertext's journal record and
/// before its rename; with `=renamed`, after the renames and the directory
/// sync and before any source is removed; with `=forgotten`, right after
/// the daemon forgot a source that went (coord.rs `forget`). Release builds have no such
/// hook.
#[cfg(debug_assertions)]
pub(super) fn crash_point(at: &str) {
    if std::env::var_os("TPMCRYPT_WATCH_TEST_CRASH_AT").is_some_and(|v| v == at) {
        // SAFETY: sending a signal to this very process.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

#[cfg(not(debug_assertions))]
pub(super) fn crash_point(_at: &str) {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::atomic::AtomicFile;

    fn pending(dir: &std::path::Path, i: usize, bytes: u64) -> Pending<usize> {
        let out = AtomicFile::create(&dir.join(format!("f{i}.tpmc")), 0o600, false)
            .expect("temporary in a temporary directory");
        Pending {
            tag: i,
            out,
            bytes,
            original: None,
        }
    }

    #[test]
    fn a_batch_closes_by_count_bytes_or_age() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let d = dir.path();
        let daemon = limits();
        assert!(daemon.files >= 32 && daemon.bytes == 256 << 20);
        assert_eq!(daemon.age, BATCH_AGE);

        // By count: the daemon's byte and age bounds, a small count.
        let few = Limits {
            files: 3,
            age: Duration::from_secs(3600),
            ..daemon
        };
        let mut b = Batch::new(few);
        assert!(b.deadline().is_none());
        assert!(!b.push(pending(d, 0, 1)));
        assert!(!b.push(pending(d, 1, 1)));
        assert!(b.push(pending(d, 2, 1)));

        // By bytes: the daemon's 256 MiB.
        let mut b = Batch::new(Limits {
            age: Duration::from_secs(3600),
            ..daemon
        });
        assert!(!b.push(pending(d, 3, daemon.bytes - 1)));
        assert!(b.push(pending(d, 4, 1)));

        // By age: the committer wakes at the deadline, BATCH_AGE after the
        // first output, and a later one closes it.
        let mut b = Batch::new(daemon);
        let before = Instant::now();
        assert!(!b.push(pending(d, 5, 1)));
        let after = Instant::now();
        let at = b.deadline().expect("a deadline once not empty");
        assert!(at >= before + BATCH_AGE && at <= after + BATCH_AGE);
        std::thread::sleep(BATCH_AGE);
        assert!(b.push(pending(d, 6, 1)));
    }

    #[test]
    fn an_output_that_waited_behind_a_commit_is_not_held_again() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let d = dir.path();
        let mut f = Filling::new(limits());
        // Finished by its worker BATCH_AGE ago, and queued meanwhile (the
        // committer was busy with the previous batch): due at once, not
        // BATCH_AGE after the committer took it.
        let now = Instant::now();
        let waited = now
            .checked_sub(BATCH_AGE)
            .expect("a monotonic clock past BATCH_AGE");
        assert!(f.push(pending(d, 0, 1), waited));
        assert!(f.deadline().is_some_and(|at| at <= now));

        // A fresh output alone waits for others until BATCH_AGE after it
        // was ready; an older one pushed after it moves the deadline up.
        let mut f = Filling::new(limits());
        let fresh = Instant::now();
        assert!(!f.push(pending(d, 1, 1), fresh));
        assert!(f.deadline().is_some_and(|at| at >= fresh + BATCH_AGE));
        let older = fresh.checked_sub(BATCH_AGE / 2).expect("a monotonic clock");
        assert!(!f.push(pending(d, 2, 1), older));
        assert!(f.deadline().is_some_and(|at| at <= older + BATCH_AGE));
    }
}
