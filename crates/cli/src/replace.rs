//! Outputs that replace their own input under the same name (`rekey`):
//! the new file is made durable under a temporary name, then exchanged
//! with the original in one step (`renameat2(RENAME_EXCHANGE)`), so the
//! name holds the old complete file or the new one at every moment, and
//! a crash leaves one of them, never neither. The original must still be
//! the file that was read, before the exchange and after it (a version
//! saved under the name in between is put back); it is removed only once
//! the directory holding the new file is durable.

use std::fs;
use std::os::unix::fs::MetadataExt;

use crate::atomic::{AtomicFile, Displaced};
use crate::batch::{CommitError, Original};
use crate::files::{Sink, Source, Task};
use crate::stamp::Stamp;

/// The original changed, or another file took its name, after it was
/// read: it is left as it is, and its new version is not kept.
#[derive(Debug, thiserror::Error)]
#[error("changed or replaced after it was read; left as it was (its rekeyed version was not kept)")]
pub struct ChangedMeanwhile;

/// A file with other hard links: replacing this name would leave the old
/// version under the others.
#[derive(Debug, thiserror::Error)]
#[error("has {0} hard links: replacing this name would leave the old version under the others (remove the other links first)")]
pub struct SharedInput(u64);

/// An input that is not a regular file (a FIFO, a device): nothing to
/// replace.
#[derive(Debug, thiserror::Error)]
#[error("not a regular file: only regular files are replaced")]
pub struct NotRegular;

/// Whether `task` writes its output over its own input.
pub fn replaces_input(task: &Task) -> bool {
    matches!((&task.source, &task.sink), (Source::File(a), Sink::File(b)) if a == b)
}

/// What an input that is to be replaced must not be, checked on the open
/// file before anything is written: not a regular file, or one with other
/// names.
pub fn refuse_input(task: &Task, meta: &fs::Metadata) -> Option<anyhow::Error> {
    if !replaces_input(task) {
        return None;
    }
    if !meta.is_file() {
        return Some(NotRegular.into());
    }
    (meta.nlink() > 1).then(|| SharedInput(meta.nlink()).into())
}

/// Whether `m` is the original's inode, with the content as read (the
/// ctime may differ: an exchange changes it).
fn is_as_read(o: &Original, m: &fs::Metadata) -> bool {
    let now = Stamp::of(m);
    (now.dev, now.ino, now.size, now.mtime_ns, now.mode)
        == (
            o.stamp.dev,
            o.stamp.ino,
            o.stamp.size,
            o.stamp.mtime_ns,
            o.stamp.mode,
        )
}

/// Puts the durable `out` in the place of its original `o` (see the
/// module). On success the original is returned, displaced, for removal
/// once the directory is durable.
pub fn exchange(out: AtomicFile, o: &Original) -> Result<Displaced, CommitError> {
    let unchanged = o.file.metadata().is_ok_and(|m| match o.exact {
        true => Stamp::of(&m) == o.stamp,
        false => is_as_read(o, &m),
    });
    // Gone (removed meanwhile) counts as changed: it is not brought back.
    let named = fs::symlink_metadata(&o.path);
    if !unchanged || !named.is_ok_and(|m| is_as_read(o, &m)) {
        return Err(CommitError::Original(ChangedMeanwhile.into()));
    }
    crash_point("checked");
    let displaced = out.exchange().map_err(CommitError::Rename)?;
    let Some(path) = displaced.path() else {
        // Replaced (no exchange on this file system): checked just before.
        return Ok(displaced);
    };
    let moved = fs::symlink_metadata(path);
    let still = o.file.metadata();
    if matches!((&moved, &still), (Ok(m), Ok(s)) if is_as_read(o, m) && is_as_read(o, s)) {
        crash_point("exchanged");
        return Ok(displaced);
    }
    // Another version took the name between the check and the exchange:
    // it gets its name back, and the new file is dropped.
    match displaced.put_back() {
        Ok(()) => Err(CommitError::Original(ChangedMeanwhile.into())),
        Err(e) => Err(CommitError::Original(anyhow::anyhow!(
            "changed while it was being replaced, and could not be put back: {e}"
        ))),
    }
}

/// For the kill -9 tests only, and only in debug builds: with
/// `TPMCRYPT_REKEY_TEST_CRASH_AT=checked` the process kills itself
/// (SIGKILL) at its first replacement, once the new file is durable and
/// the original checked, before the exchange; with `=exchanged`, after
/// the exchange, before the displaced original is removed. Release builds
/// have no such hook.
#[cfg(debug_assertions)]
fn crash_point(at: &str) {
    if std::env::var_os("TPMCRYPT_REKEY_TEST_CRASH_AT").is_some_and(|v| v == at) {
        // SAFETY: sending a signal to this very process.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

#[cfg(not(debug_assertions))]
fn crash_point(_at: &str) {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{Batch, Limits, Pending};
    use std::fs::File;
    use std::io::Write;
    use std::path::Path;

    fn pending(dir: &Path, name: &str, old: &[u8], new: &[u8]) -> Pending<&'static str> {
        let path = dir.join(name);
        fs::write(&path, old).unwrap();
        let file = File::open(&path).unwrap();
        let stamp = Stamp::of(&file.metadata().unwrap());
        let mut out = AtomicFile::create(&path, 0o600, true).unwrap();
        out.file().write_all(new).unwrap();
        Pending {
            tag: "t",
            out,
            bytes: new.len() as u64,
            original: Some(Original {
                path,
                file,
                stamp,
                exact: true,
            }),
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn an_output_takes_its_originals_name_and_nothing_is_left() {
        let d = tempfile::tempdir().unwrap();
        let mut batch = Batch::new(Limits::default());
        batch.push(pending(d.path(), "a", b"old a", b"new a"));
        batch.push(pending(d.path(), "b", b"old b", b"new b"));
        for (_, r) in batch.commit() {
            assert!(r.is_ok(), "{r:?}");
        }
        assert_eq!(fs::read(d.path().join("a")).unwrap(), b"new a");
        assert_eq!(fs::read(d.path().join("b")).unwrap(), b"new b");
        assert_eq!(names(d.path()), vec!["a", "b"]);
    }

    #[test]
    fn an_original_changed_or_replaced_before_the_commit_is_left_as_it_is() {
        let d = tempfile::tempdir().unwrap();
        let mut batch = Batch::new(Limits::default());
        batch.push(pending(d.path(), "appended", b"old", b"new"));
        batch.push(pending(d.path(), "replaced", b"old", b"new"));
        batch.push(pending(d.path(), "removed", b"old", b"new"));
        fs::OpenOptions::new()
            .append(true)
            .open(d.path().join("appended"))
            .unwrap()
            .write_all(b" and more")
            .unwrap();
        // An editor's save: a new file renamed over the name.
        fs::write(d.path().join("saved"), b"saved").unwrap();
        fs::rename(d.path().join("saved"), d.path().join("replaced")).unwrap();
        fs::remove_file(d.path().join("removed")).unwrap();
        for (_, r) in batch.commit() {
            let err = r.expect_err("refused").to_string();
            assert!(
                err.contains("changed or replaced after it was read"),
                "{err}"
            );
        }
        assert_eq!(
            fs::read(d.path().join("appended")).unwrap(),
            b"old and more"
        );
        assert_eq!(fs::read(d.path().join("replaced")).unwrap(), b"saved");
        assert_eq!(names(d.path()), vec!["appended", "replaced"]);
    }

    #[test]
    fn an_exchange_can_be_put_back() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("f");
        fs::write(&dest, b"theirs").unwrap();
        let mut out = AtomicFile::create(&dest, 0o600, true).unwrap();
        out.file().write_all(b"ours").unwrap();
        let displaced = out.exchange().unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"ours");
        assert_eq!(fs::read(displaced.path().unwrap()).unwrap(), b"theirs");
        displaced.put_back().unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"theirs");
        assert_eq!(names(d.path()), vec!["f"]);
    }
}
