//! The hidden names of a directory, listed without an allocation per entry.
//!
//! Every run that writes an output lists that output's directory once, for
//! the temporaries of crashed runs (`atomic::clean_stale_partials_once`).
//! Only hidden names (a leading `.`) can be one, but `std::fs::read_dir`
//! allocates every entry's name and the caller joined it to a path: in a
//! directory of 20,000 files that was about a third of the listing's cost,
//! paid by each process of a one-process-per-file script.

use std::ffi::{CStr, CString, OsStr};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// An open directory stream, closed on drop.
struct Dir(*mut libc::DIR);

impl Drop for Dir {
    fn drop(&mut self) {
        // SAFETY: a stream from opendir, closed once.
        unsafe { libc::closedir(self.0) };
    }
}

/// Calls `each` with every name in `dir` that starts with `.`, except `.`
/// and `..`, in directory order. Names the callback removes or adds may or
/// may not be seen (as with `read_dir`). Returns how many names the
/// directory listed, `.` and `..` included.
pub fn for_each_hidden_name(dir: &Path, mut each: impl FnMut(&OsStr)) -> io::Result<usize> {
    let path = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL byte in a path"))?;
    // SAFETY: a valid NUL-terminated path; glibc opens it O_CLOEXEC.
    let stream = unsafe { libc::opendir(path.as_ptr()) };
    if stream.is_null() {
        return Err(io::Error::last_os_error());
    }
    let stream = Dir(stream);
    let mut listed = 0;
    loop {
        // SAFETY: errno is thread-local; readdir's stream is ours alone.
        let entry = unsafe {
            *libc::__errno_location() = 0;
            libc::readdir64(stream.0)
        };
        if entry.is_null() {
            let err = io::Error::last_os_error();
            return match err.raw_os_error() {
                Some(0) | None => Ok(listed),
                Some(_) => Err(err),
            };
        }
        // SAFETY: d_name is NUL-terminated and valid until the next readdir.
        let name = unsafe { CStr::from_ptr((*entry).d_name.as_ptr()) }.to_bytes();
        listed += 1;
        if name.first() == Some(&b'.') && name != b"." && name != b".." {
            each(OsStr::from_bytes(name));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// The same hidden names `read_dir` lists, and no others.
    #[test]
    fn lists_exactly_the_hidden_names() {
        let dir = tempfile::tempdir().unwrap();
        for name in [
            "a",
            ".b",
            "..c",
            ".",
            "d.",
            ".e.tpmcrypt-partial.1.0123456789abcdef",
        ] {
            let _ = std::fs::write(dir.path().join(name), b"");
        }
        std::fs::create_dir(dir.path().join(".sub")).unwrap();
        let mut got = BTreeSet::new();
        for_each_hidden_name(dir.path(), |n| {
            got.insert(n.to_owned());
        })
        .unwrap();
        let want: BTreeSet<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n.as_bytes().starts_with(b"."))
            .collect();
        assert_eq!(got, want);
        assert_eq!(got.len(), 4);
        let all = for_each_hidden_name(dir.path(), |_| {}).unwrap();
        assert_eq!(all, std::fs::read_dir(dir.path()).unwrap().count() + 2);
        let missing = for_each_hidden_name(&dir.path().join("none"), |_| {});
        assert_eq!(missing.unwrap_err().kind(), io::ErrorKind::NotFound);
    }
}
