//! The state journal: which source files are already encrypted, as of which
//! version (size, mtime, inode), so that a restart does not encrypt them
//! again.
//!
//! It is an append-only text file, one record per line:
//!
//! ```text
//! + SIZE MTIME_NS INODE CT_LEN HEX(relative path) VERSION CT_INODE    encrypted
//! - HEX(relative path)                                                   forgotten
//! ```
//!
//! VERSION says which ciphertext holds it: `NAME.tpmc` for version 1,
//! `NAME.vN.tpmc` for version N (see docs/watch.md); CT_INODE is the
//! ciphertext's inode. Both may be absent (journals of earlier versions:
//! version 1, inode unknown). A record also means "this ciphertext belongs
//! to the source still at this path": only then may a newer version of that
//! source replace it.
//!
//! A record is appended just before its ciphertext gets its final name (so
//! that a kill -9 before the source is removed does not lead to a duplicate
//! version); a record whose ciphertext did not get there is recognised by
//! CT_INODE and CT_LEN and never trusted, and the path's record before it
//! (for the ciphertext that one was to replace) holds instead
//! ([`Journal::settle`]). A crash can lose the tail: those
//! files get encrypted again as new versions, which loses nothing. At start-up it is read, checked
//! against SRC and DEST (a record whose source is gone or whose ciphertext
//! is missing or of the wrong size is dropped) and rewritten compactly with
//! a crash-safe rename.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use crate::atomic::AtomicFile;

/// File name of the journal inside the state directory.
pub const JOURNAL: &str = "journal";

/// The version of a source file that was encrypted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i128,
    /// Inode number.
    pub ino: u64,
    /// Size of the ciphertext written for it.
    pub ct_len: u64,
    /// Which ciphertext: 1 for `NAME.tpmc`, N for `NAME.vN.tpmc`.
    pub version: u32,
    /// The ciphertext's inode (0: unknown, from an older journal).
    pub ct_ino: u64,
}

impl Record {
    /// Whether a source with this (size, mtime, inode) is the version
    /// recorded.
    pub fn same_source(&self, size: u64, mtime_ns: i128, ino: u64) -> bool {
        self.size == size && self.mtime_ns == mtime_ns && self.ino == ino
    }
}

/// The journal: records by path relative to SRC, and the file they are
/// appended to.
pub struct Journal {
    path: PathBuf,
    records: HashMap<PathBuf, Record>,
    /// Paths whose record was written by this process (and not forgotten
    /// since): their ciphertext was made in this run from the source still
    /// at that path, which this run has not removed.
    fresh: HashSet<PathBuf>,
    out: Option<BufWriter<File>>,
    dirty: bool,
    /// As loaded: every record of a path since it was last forgotten,
    /// oldest first, until [`Journal::settle`] picks the one that holds.
    loaded: HashMap<PathBuf, Vec<Record>>,
    /// Records forgotten with a directory that left SRC, in memory only:
    /// if the very file comes back ([`Journal::recognise`]), its record
    /// is restored instead of a version being added.
    gone: HashMap<PathBuf, Record>,
}

/// At most this many forgotten records are kept for recognition.
const MAX_GONE: usize = 100_000;

fn decode_path(h: &str) -> Option<PathBuf> {
    hex::decode(h)
        .ok()
        .map(|b| PathBuf::from(std::ffi::OsString::from_vec(b)))
}

fn parse_line(line: &str) -> Option<(PathBuf, Option<Record>)> {
    let mut parts = line.split(' ');
    match parts.next()? {
        "+" => {
            let size = parts.next()?.parse().ok()?;
            let mtime_ns = parts.next()?.parse().ok()?;
            let ino = parts.next()?.parse().ok()?;
            let ct_len = parts.next()?.parse().ok()?;
            let path = decode_path(parts.next()?)?;
            let (version, ct_ino) = match parts.next() {
                None => (1, 0),
                Some(v) => (
                    v.parse().ok().filter(|&v| v >= 1)?,
                    parts.next()?.parse().ok()?,
                ),
            };
            if parts.next().is_some() {
                return None;
            }
            Some((
                path,
                Some(Record {
                    size,
                    mtime_ns,
                    ino,
                    ct_len,
                    version,
                    ct_ino,
                }),
            ))
        }
        "-" => Some((decode_path(parts.next()?)?, None)),
        _ => None,
    }
}

fn format_put(rel: &Path, r: &Record) -> String {
    format!(
        "+ {} {} {} {} {} {} {}\n",
        r.size,
        r.mtime_ns,
        r.ino,
        r.ct_len,
        hex::encode(rel.as_os_str().as_bytes()),
        r.version,
        r.ct_ino
    )
}

impl Journal {
    /// Reads the journal in `state_dir` (missing means empty). Malformed
    /// lines, such as a torn last line after a crash, are ignored.
    pub fn load(state_dir: &Path) -> io::Result<Journal> {
        let path = state_dir.join(JOURNAL);
        let mut loaded: HashMap<PathBuf, Vec<Record>> = HashMap::new();
        match File::open(&path) {
            Ok(f) => {
                for line in BufReader::new(f).split(b'\n') {
                    let line = line?;
                    let Ok(text) = std::str::from_utf8(&line) else {
                        continue;
                    };
                    match parse_line(text) {
                        Some((p, Some(r))) => loaded.entry(p).or_default().push(r),
                        Some((p, None)) => {
                            loaded.remove(&p);
                        }
                        None => {}
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let records = loaded
            .iter()
            .filter_map(|(p, rs)| Some((p.clone(), *rs.last()?)))
            .collect();
        Ok(Journal {
            path,
            records,
            fresh: HashSet::new(),
            out: None,
            dirty: false,
            loaded,
            gone: HashMap::new(),
        })
    }

    /// Settles each path's record as loaded to the newest one that `holds`
    /// (its ciphertext is in place: same size and inode), else the newest.
    /// A record is written just before its ciphertext gets its name, so
    /// after a kill between the two the newest names a ciphertext that
    /// never got there, and the one before it, for the ciphertext that was
    /// to be replaced, still holds. Once, at start-up.
    pub fn settle(&mut self, holds: impl Fn(&Path, &Record) -> bool) {
        for (p, rs) in std::mem::take(&mut self.loaded) {
            if let Some(r) = rs.iter().rev().find(|r| holds(&p, r)) {
                self.records.insert(p, *r);
            }
        }
    }

    /// The record for `rel`.
    pub fn get(&self, rel: &Path) -> Option<Record> {
        self.records.get(rel).copied()
    }

    /// Whether the record for `rel` was written by this process.
    pub fn is_fresh(&self, rel: &Path) -> bool {
        self.fresh.contains(rel)
    }

    /// Keeps only the records for which `keep` returns true.
    pub fn retain(&mut self, mut keep: impl FnMut(&Path, &Record) -> bool) {
        self.records.retain(|p, r| keep(p, r));
        let records = &self.records;
        self.fresh.retain(|p| records.contains_key(p));
    }

    /// Rewrites the journal with the current records (crash-safe) and opens
    /// it for appending.
    pub fn compact(&mut self) -> io::Result<()> {
        self.out = None;
        let mut f = AtomicFile::create(&self.path, 0o600, true)?;
        {
            let mut w = BufWriter::new(f.file());
            for (p, r) in &self.records {
                w.write_all(format_put(p, r).as_bytes())?;
            }
            w.flush()?;
        }
        f.commit()?;
        self.out = Some(BufWriter::new(
            OpenOptions::new().append(true).open(&self.path)?,
        ));
        Ok(())
    }

    /// Records that `rel` is encrypted as `r`.
    pub fn put(&mut self, rel: &Path, r: Record) -> io::Result<()> {
        if self.records.get(rel) == Some(&r) {
            return Ok(());
        }
        self.gone.remove(rel);
        self.records.insert(rel.to_path_buf(), r);
        self.fresh.insert(rel.to_path_buf());
        self.append(format_put(rel, &r))
    }

    /// Forgets `rel` and every path beneath it for which `forget` is true,
    /// on disk too (a line each): a restart must not take a newcomer of
    /// the same name for the source a record was about.
    pub fn remove_under(&mut self, rel: &Path, forget: impl Fn(&Path) -> bool) -> io::Result<()> {
        let mut under: Vec<PathBuf> = self
            .records
            .keys()
            .filter(|p| p.starts_with(rel) && forget(p))
            .cloned()
            .collect();
        under.sort();
        for p in under {
            if let Some(r) = self.records.get(&p).copied() {
                if self.gone.len() >= MAX_GONE {
                    self.gone.clear();
                }
                self.gone.insert(p.clone(), r);
            }
            self.remove(&p)?;
        }
        Ok(())
    }

    /// A record forgotten with its directory, restored if `is_it` says the
    /// file now at `rel` is the one it was about (same inode, size and
    /// mtime, its ciphertext in place): a directory moved out of SRC and
    /// back is not encrypted again. The record is written again, not as
    /// this run's ([`Journal::is_fresh`] stays false).
    pub fn recognise(
        &mut self,
        rel: &Path,
        is_it: impl FnOnce(&Record) -> bool,
    ) -> io::Result<Option<Record>> {
        let Some(r) = self.gone.get(rel).copied() else {
            return Ok(None);
        };
        if !is_it(&r) {
            return Ok(None);
        }
        self.gone.remove(rel);
        self.records.insert(rel.to_path_buf(), r);
        self.append(format_put(rel, &r))?;
        Ok(Some(r))
    }

    /// Forgets `rel`.
    pub fn remove(&mut self, rel: &Path) -> io::Result<()> {
        self.fresh.remove(rel);
        if self.records.remove(rel).is_none() {
            return Ok(());
        }
        self.append(format!("- {}\n", hex::encode(rel.as_os_str().as_bytes())))
    }

    fn append(&mut self, line: String) -> io::Result<()> {
        if let Some(out) = &mut self.out {
            out.write_all(line.as_bytes())?;
            self.dirty = true;
        }
        Ok(())
    }

    /// Hands buffered records to the kernel (they survive a kill -9 from
    /// here on).
    pub fn flush(&mut self) -> io::Result<()> {
        if let Some(out) = &mut self.out {
            out.flush()?;
        }
        Ok(())
    }

    /// Flushes, and returns the journal file to fsync (`None`: nothing
    /// appended since the last time), so that the fsync runs without the
    /// journal's lock: workers recording their ciphertexts do not wait for
    /// the disk (a sync behind another process's write burst can take
    /// hundreds of milliseconds). After a failed fsync nothing is retried:
    /// Linux reports a write-back error once.
    pub fn flush_for_sync(&mut self) -> io::Result<Option<File>> {
        if !self.dirty {
            return Ok(None);
        }
        let Some(out) = &mut self.out else {
            return Ok(None);
        };
        out.flush()?;
        let file = out.get_ref().try_clone()?;
        self.dirty = false;
        Ok(Some(file))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A journal in a new directory, open for appending.
    fn fresh() -> (tempfile::TempDir, Journal) {
        let dir = tempfile::tempdir().unwrap();
        let mut j = Journal::load(dir.path()).unwrap();
        j.compact().unwrap();
        (dir, j)
    }

    /// A record whose ciphertext has inode `ct_ino`.
    fn record(ct_ino: u64) -> Record {
        Record {
            size: 1,
            mtime_ns: 2,
            ino: 3,
            ct_len: 4,
            version: 1,
            ct_ino,
        }
    }

    #[test]
    fn round_trip_and_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let mut j = Journal::load(dir.path()).unwrap();
        j.compact().unwrap();
        let r = Record {
            size: 5,
            mtime_ns: 1_700_000_000_123_456_789,
            ino: 42,
            ct_len: 99,
            version: 1,
            ct_ino: 7,
        };
        let v3 = Record { version: 3, ..r };
        let raw = std::ffi::OsStr::from_bytes(b"caf\xe9/x\xff");
        j.put(Path::new("a/b c.txt"), r).unwrap();
        j.put(Path::new(raw), v3).unwrap();
        j.put(Path::new("gone"), r).unwrap();
        j.remove(Path::new("gone")).unwrap();
        j.flush().unwrap();
        // A torn record from a crash mid-write.
        let mut f = OpenOptions::new()
            .append(true)
            .open(dir.path().join(JOURNAL))
            .unwrap();
        f.write_all(b"+ 1 2 3").unwrap();
        let j = Journal::load(dir.path()).unwrap();
        assert_eq!(j.records.len(), 2);
        assert_eq!(j.get(Path::new("a/b c.txt")), Some(r));
        assert_eq!(j.get(Path::new(raw)), Some(v3));
        // An earlier version's line: version 1, ciphertext inode unknown.
        let (p, old) = parse_line("+ 1 2 3 4 61").unwrap();
        assert_eq!(p, Path::new("a"));
        assert_eq!(old.map(|r| (r.version, r.ct_ino)), Some((1, 0)));
        assert_eq!(parse_line("+ 1 2 3 4 61 2"), None, "torn");
        assert_eq!(parse_line("+ 1 2 3 4 61 0 5"), None, "no version 0");
        assert!(r.same_source(5, 1_700_000_000_123_456_789, 42));
        assert!(!r.same_source(5, 1_700_000_000_123_456_788, 42));
    }

    #[test]
    fn settle_picks_the_newest_record_whose_ciphertext_is_in_place() {
        let (dir, mut j) = fresh();
        let r = record;
        let (a, b, c) = (Path::new("a"), Path::new("b"), Path::new("c"));
        // a: replaced, and the replacement got its name (inode 2 in place).
        j.put(a, r(1)).unwrap();
        j.put(a, r(2)).unwrap();
        // b: a kill before the replacement (inode 4) got its name.
        j.put(b, r(3)).unwrap();
        j.put(b, r(4)).unwrap();
        // c: forgotten between its two records: the first no longer holds.
        j.put(c, r(5)).unwrap();
        j.remove(c).unwrap();
        j.put(c, r(6)).unwrap();
        j.flush().unwrap();
        let in_place = [2, 3, 5];
        let mut j = Journal::load(dir.path()).unwrap();
        assert_eq!(j.get(b), Some(r(4)), "as loaded: the newest");
        j.settle(|_, rec| in_place.contains(&rec.ct_ino));
        assert_eq!(j.get(a), Some(r(2)));
        assert_eq!(j.get(b), Some(r(3)));
        assert_eq!(j.get(c), Some(r(6)), "none holds: the newest");
        // Compacted, the settled records are what the next start reads.
        j.compact().unwrap();
        let j = Journal::load(dir.path()).unwrap();
        assert_eq!(j.get(b), Some(r(3)));
    }

    #[test]
    fn remove_under_forgets_a_tree_on_disk_but_what_is_kept() {
        let (dir, mut j) = fresh();
        let r = record(5);
        for p in ["d/a", "d/b", "d/e/f", "dx", "e"] {
            j.put(Path::new(p), r).unwrap();
        }
        j.remove_under(Path::new("d"), |p| p != Path::new("d/b"))
            .unwrap();
        j.flush().unwrap();
        let j = Journal::load(dir.path()).unwrap();
        let mut left: Vec<_> = j.records.keys().cloned().collect();
        left.sort();
        assert_eq!(left, ["d/b", "dx", "e"].map(PathBuf::from));
    }

    #[test]
    fn a_forgotten_record_is_restored_only_for_the_very_file() {
        let (dir, mut j) = fresh();
        let r = record(5);
        let (a, b) = (Path::new("d/a"), Path::new("d/b"));
        j.put(a, r).unwrap();
        j.put(b, r).unwrap();
        j.remove_under(Path::new("d"), |_| true).unwrap();
        assert_eq!(j.get(a), None);
        // Another file at d/b: not restored, and asked again later still
        // not (its forgotten record stays for the very file).
        assert_eq!(j.recognise(b, |_| false).unwrap(), None);
        assert_eq!(j.get(b), None);
        // The very file at d/a: restored, not as this run's.
        assert_eq!(j.recognise(a, |x| x == &r).unwrap(), Some(r));
        assert_eq!(j.get(a), Some(r));
        assert!(!j.is_fresh(a));
        j.flush().unwrap();
        let j2 = Journal::load(dir.path()).unwrap();
        assert_eq!((j2.get(a), j2.get(b)), (Some(r), None), "on disk too");
        // A new record for d/b drops its forgotten one.
        j.put(b, Record { ct_ino: 9, ..r }).unwrap();
        j.remove(b).unwrap();
        assert_eq!(j.recognise(b, |_| true).unwrap(), None);
    }

    #[test]
    fn flush_for_sync_flushes_and_hands_out_the_file_only_when_written() {
        let (dir, mut j) = fresh();
        assert!(j.flush_for_sync().unwrap().is_none(), "nothing appended");
        let r = record(5);
        j.put(Path::new("x"), r).unwrap();
        let file = j
            .flush_for_sync()
            .unwrap()
            .expect("appended: a file to sync");
        file.sync_data().unwrap();
        // Flushed: another reader sees the record.
        assert_eq!(
            Journal::load(dir.path()).unwrap().get(Path::new("x")),
            Some(r)
        );
        assert!(j.flush_for_sync().unwrap().is_none(), "synced already");
    }
}
