//! Walking SRC (start-up scan, new or moved-in directories, rescans after
//! an inotify overflow) and cleaning crash leftovers out of DEST.

use std::ffi::OsStr;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::fsio::Kind;
use crate::atomic::PARTIAL_MARKER;

/// An entry found by a scan.
pub struct Found {
    /// Path relative to SRC.
    pub rel: PathBuf,
    /// What it is.
    pub kind: Kind,
    /// lstat of the entry.
    pub meta: fs::Metadata,
}

/// Walks `src/rel` depth-first without following symlinks, calling `each`
/// for every non-directory entry until it returns false. Unreadable
/// directories are reported through `each_err` and skipped.
pub fn walk(
    src: &Path,
    rel: &Path,
    each: &mut dyn FnMut(Found) -> bool,
    each_err: &mut dyn FnMut(&Path, io::Error),
) -> bool {
    let entries = match fs::read_dir(src.join(rel)) {
        Ok(e) => e,
        Err(e) => {
            each_err(rel, e);
            return true;
        }
    };
    let mut subdirs = Vec::new();
    for entry in entries {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                each_err(rel, e);
                continue;
            }
        };
        let child = rel.join(entry.file_name());
        // lstat; an entry that vanished meanwhile is skipped.
        let Ok(meta) = entry.metadata() else {
            continue;
        };
        let kind = Kind::from_mode(meta.mode());
        if kind == Kind::Dir {
            subdirs.push(child);
        } else if !each(Found {
            rel: child,
            kind,
            meta,
        }) {
            return false;
        }
    }
    for sub in subdirs {
        if !walk(src, &sub, each, each_err) {
            return false;
        }
    }
    true
}

/// Whether `name` is exactly a temporary's name,
/// `.NAME.tpmcrypt-partial.PID.RANDOM` (RANDOM: 16 hex digits), and if so
/// its PID. A ciphertext never matches (its name ends in `.tpmc`), even
/// when its source's name contains the marker.
fn partial_pid(name: &OsStr) -> Option<i32> {
    crate::atomic::parse_marked(name.as_bytes(), PARTIAL_MARKER).map(|(_, pid)| pid)
}

/// Removes temporaries (`.NAME.tpmcrypt-partial.PID.RANDOM`) left under
/// `dest` by processes that no longer run. Returns how many were removed.
/// Never looks into `src` (SRC may lie inside DEST): nothing there is ours.
pub fn clean_partials(dest: &Path, src: &Path) -> usize {
    let me = std::process::id() as i32;
    let mut removed = 0;
    let mut stack = vec![dest.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(ft) = entry.file_type() else { continue };
            if ft.is_dir() {
                if entry.path() != src {
                    stack.push(entry.path());
                }
                continue;
            }
            let Some(pid) = partial_pid(&entry.file_name()) else {
                continue;
            };
            // Our own PID cannot own a temporary yet: it is a previous
            // process's that had the same PID.
            if (pid == me || !crate::atomic::pid_alive(pid))
                && fs::remove_file(entry.path()).is_ok()
            {
                removed += 1;
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walk_reports_files_and_specials_without_following() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::create_dir_all(d.join("a/b")).unwrap();
        fs::write(d.join("a/b/f"), b"x").unwrap();
        fs::write(d.join("g"), b"y").unwrap();
        std::os::unix::fs::symlink("/etc", d.join("etc")).unwrap();
        let mut seen = Vec::new();
        walk(
            d,
            Path::new(""),
            &mut |f| {
                seen.push((f.rel, f.kind));
                true
            },
            &mut |_, _| {},
        );
        seen.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            seen,
            vec![
                (PathBuf::from("a/b/f"), Kind::File),
                (PathBuf::from("etc"), Kind::Symlink),
                (PathBuf::from("g"), Kind::File),
            ]
        );
    }

    #[test]
    fn partials_of_dead_processes_go() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::create_dir(d.join("sub")).unwrap();
        let stale = d.join(format!(
            "sub/.x.tpmc{PARTIAL_MARKER}2147483646.00000000000000ab"
        ));
        let mine = d.join(format!(
            ".y.tpmc{PARTIAL_MARKER}{}.0123456789abcdef",
            std::process::id()
        ));
        fs::write(&stale, b"x").unwrap();
        fs::write(&mine, b"x").unwrap();
        fs::write(d.join("keep.tpmc"), b"x").unwrap();
        // Ciphertexts of sources whose names contain the marker.
        let lookalikes = [
            format!("notes{PARTIAL_MARKER}2147483646.txt.tpmc"),
            format!(".z{PARTIAL_MARKER}2147483646.0123456789abcdef.tpmc"),
            format!(".z{PARTIAL_MARKER}2147483646.0123456789abcdef.v2.tpmc"),
        ];
        for l in &lookalikes {
            fs::write(d.join(l), b"x").unwrap();
        }
        // SRC inside DEST: not ours.
        fs::create_dir(d.join("src")).unwrap();
        let in_src = d.join(format!("src/.w{PARTIAL_MARKER}2147483646.0123456789abcdef"));
        fs::write(&in_src, b"x").unwrap();
        assert_eq!(clean_partials(d, &d.join("src")), 2);
        assert!(d.join("keep.tpmc").exists());
        assert!(in_src.exists());
        for l in &lookalikes {
            assert!(d.join(l).exists(), "{l}");
        }
    }
}
