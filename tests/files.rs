//! End-to-end tests of the file boundaries of `encrypt` and `decrypt`:
//! names are bytes, recursion decides by content, sizes are not trusted,
//! `--in-place` keeps who owns a file, and standard output that is gone
//! (a closed pipe, a closed descriptor) is never taken for success.

mod common;

use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;

use common::{assert_error_line, assert_ok, finished_by, recovery, run, tpmcrypt, Run};

/// A scratch directory holding a recovery identity `id`; returns the
/// directory and the identity's recipient string.
fn scratch() -> (tempfile::TempDir, String) {
    // tmpfs (see common::scratch): batches, not an fsync per output.
    let dir = common::scratch("tpmcrypt-files-");
    let r = recovery(dir.path(), "id");
    (dir, r)
}

/// Runs the binary with arguments that need not be UTF-8.
fn run_os(dir: &Path, args: &[&OsStr]) -> Run {
    tpmcrypt(dir).args(args).output().expect("spawn").into()
}

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// The names in `dir`, as bytes, sorted.
fn raw_listing(dir: &Path) -> Vec<Vec<u8>> {
    let mut v: Vec<Vec<u8>> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_vec())
        .collect();
    v.sort();
    v
}

// ------------------------------------------------------------ names are bytes

/// Two names that differ only in a byte that is not UTF-8 (`caf\xe9.txt`,
/// `caf\xe8.txt`) stay two files through `encrypt --in-place` and
/// `decrypt --in-place -f`, each under its exact byte name; an error line
/// shows such a byte escaped (`\xe9`), never as U+FFFD.
#[test]
fn names_that_are_not_utf8_keep_their_bytes() {
    let (dir, r) = scratch();
    let d = dir.path();
    let e9 = OsStr::from_bytes(b"caf\xe9.txt");
    let e8 = OsStr::from_bytes(b"caf\xe8.txt");
    fs::write(d.join(e9), b"e9 content").unwrap();
    fs::write(d.join(e8), b"e8 content").unwrap();
    let res = run_os(
        d,
        &[os("encrypt"), os("-R"), os(&r), os("--in-place"), e9, e8],
    );
    assert_ok(&res, "encrypt --in-place");
    let ct9 = OsStr::from_bytes(b"caf\xe9.txt.tpmc");
    let ct8 = OsStr::from_bytes(b"caf\xe8.txt.tpmc");
    assert_eq!(
        raw_listing(d),
        vec![
            b"caf\xe8.txt.tpmc".to_vec(),
            b"caf\xe9.txt.tpmc".to_vec(),
            b"id".to_vec()
        ]
    );
    let res = run_os(
        d,
        &[
            os("decrypt"),
            os("-i"),
            os("id"),
            os("--in-place"),
            os("-f"),
            ct9,
            ct8,
        ],
    );
    assert_ok(&res, "decrypt --in-place -f");
    assert_eq!(
        raw_listing(d),
        vec![
            b"caf\xe8.txt".to_vec(),
            b"caf\xe9.txt".to_vec(),
            b"id".to_vec()
        ]
    );
    assert_eq!(fs::read(d.join(e9)).unwrap(), b"e9 content");
    assert_eq!(fs::read(d.join(e8)).unwrap(), b"e8 content");

    // -r finds them too, and names them exactly.
    fs::create_dir(d.join("t")).unwrap();
    fs::rename(d.join(e9), d.join("t").join(e9)).unwrap();
    let res = run(d, &["encrypt", "-R", &r, "-r", "--in-place", "t"]);
    assert_ok(&res, "encrypt -r");
    assert_eq!(
        raw_listing(&d.join("t")),
        vec![b"caf\xe9.txt.tpmc".to_vec()]
    );
    let res = run(d, &["decrypt", "-i", "id", "-r", "--in-place", "t"]);
    assert_ok(&res, "decrypt -r");
    assert_eq!(raw_listing(&d.join("t")), vec![b"caf\xe9.txt".to_vec()]);

    // An error about such a name shows the byte escaped.
    fs::write(d.join(ct8), b"in the way").unwrap();
    let res = run_os(d, &[os("encrypt"), os("-R"), os(&r), e8]);
    assert_error_line(&res, 1, Some("caf\\xe8.txt"), &["already exists"], "exists");
    assert!(
        res.stderr.contains("caf\\xe8.txt.tpmc already exists"),
        "{}",
        res.stderr
    );
    assert!(!res.stderr.contains('\u{fffd}'), "{}", res.stderr);
}

/// `inspect --json` of a file whose name is not UTF-8: `file` shows the
/// name as error lines do, `file_hex` gives its exact bytes.
#[test]
fn inspect_json_gives_the_exact_bytes_of_a_name() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("p"), b"x").unwrap();
    let name = OsStr::from_bytes(b"n\xff.tpmc");
    let res = run_os(
        d,
        &[os("encrypt"), os("-R"), os(&r), os("-o"), name, os("p")],
    );
    assert_ok(&res, "encrypt -o");
    let res = run_os(d, &[os("inspect"), os("--json"), name]);
    assert_ok(&res, "inspect");
    let v: serde_json::Value = serde_json::from_slice(&res.stdout).unwrap();
    assert_eq!(v["file"], "n\\xff.tpmc");
    assert_eq!(v["file_hex"], hex::encode(b"n\xff.tpmc"));
    // A UTF-8 name has no file_hex.
    fs::rename(d.join(name), d.join("été.tpmc")).unwrap();
    let res = run(d, &["inspect", "--json", "été.tpmc"]);
    let v: serde_json::Value = serde_json::from_slice(&res.stdout).unwrap();
    assert_eq!(v["file"], "été.tpmc");
    assert!(v.get("file_hex").is_none(), "{v}");
}

// ------------------------------------------------- recursion decides by content

use std::os::unix::fs::symlink;

/// `encrypt -r` (with `--in-place`) encrypts a plaintext file that happens
/// to be named `*.tpmc` and leaves out only real tpmcrypt files; `-v`
/// names every file it left out and why, and counts them in its summary.
/// `decrypt -r` takes what is ciphertext: a `*.tpmc` that is not fails
/// (exit 3), a ciphertext without the suffix is reported as left out.
#[test]
fn recursion_decides_by_content_and_reports_what_it_skips() {
    let (dir, r) = scratch();
    let d = dir.path();
    let t = d.join("t");
    fs::create_dir(&t).unwrap();
    fs::write(t.join("real"), b"real plaintext").unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", &r, "--in-place", "t/real"]),
        "real",
    );
    fs::write(t.join("fake.tpmc"), b"plaintext named like ciphertext").unwrap();
    fs::write(t.join("plain"), b"plain").unwrap();
    symlink(d.join("id"), t.join("link")).unwrap();

    let res = run(d, &["-v", "encrypt", "-R", &r, "-r", "--in-place", "t"]);
    assert_ok(&res, "encrypt -r --in-place");
    assert!(!t.join("fake.tpmc").exists(), "plaintext left in the clear");
    assert!(t.join("fake.tpmc.tpmc").exists());
    assert!(t.join("plain.tpmc").exists() && !t.join("plain").exists());
    assert!(
        !t.join("real.tpmc.tpmc").exists(),
        "ciphertext encrypted again"
    );
    let lines: Vec<&str> = res.stderr.lines().collect();
    assert!(
        lines.contains(&"tpmcrypt: skipped t/real.tpmc: already a tpmcrypt file"),
        "{}",
        res.stderr
    );
    assert!(
        lines.contains(&"tpmcrypt: skipped t/link: a symbolic link (not followed)"),
        "{}",
        res.stderr
    );
    assert!(
        res.stderr
            .contains("tpmcrypt: encrypted 2 file(s), 36 bytes, 2 skipped, 0 failed"),
        "{}",
        res.stderr
    );

    // decrypt -r: fake.tpmc.tpmc and plain.tpmc decrypt, real.tpmc too; a
    // ciphertext without the suffix is named as left out.
    fs::rename(t.join("real.tpmc"), t.join("renamed")).unwrap();
    let res = run(d, &["-v", "decrypt", "-i", "id", "-r", "--in-place", "t"]);
    assert_ok(&res, "decrypt -r");
    assert_eq!(
        fs::read(t.join("fake.tpmc")).unwrap(),
        b"plaintext named like ciphertext"
    );
    assert_eq!(fs::read(t.join("plain")).unwrap(), b"plain");
    assert!(
        res.stderr.contains(
            "tpmcrypt: skipped t/renamed: a tpmcrypt file without the .tpmc suffix (decrypt it with -o)"
        ),
        "{}",
        res.stderr
    );
    assert!(
        res.stderr.contains(", 2 skipped, 0 failed"),
        "{}",
        res.stderr
    );
    // The plaintext fake.tpmc, now in a decrypt -r, is not ciphertext: an
    // integrity failure, not a silent skip.
    let res = run(d, &["decrypt", "-i", "id", "-r", "t"]);
    assert_error_line(
        &res,
        3,
        Some("t/fake.tpmc"),
        &["not a tpmcrypt file"],
        "fake",
    );
}

// ---------------------------------------------------------- sizes that lie

/// Decrypts `ct` in `d` to stdout.
fn decrypted(d: &Path, ct: &str) -> Vec<u8> {
    let res = run(d, &["decrypt", "-i", "id", "-o", "-", ct]);
    assert_ok(&res, ct);
    res.stdout
}

/// Files whose size is not their length (procfs says 0, sysfs 4096) are
/// read to their end: the ciphertext decrypts to exactly their bytes.
#[test]
fn files_whose_size_lies_are_read_to_the_end() {
    let (dir, r) = scratch();
    let d = dir.path();
    for (src, ct) in [
        ("/proc/version", "version.tpmc"),
        ("/sys/kernel/mm/transparent_hugepage/enabled", "thp.tpmc"),
    ] {
        let expect = fs::read(src).unwrap();
        assert!(!expect.is_empty());
        assert_ne!(fs::metadata(src).unwrap().len(), expect.len() as u64);
        let res = run(d, &["encrypt", "-R", &r, "-o", ct, src]);
        assert_ok(&res, src);
        assert_eq!(decrypted(d, ct), expect, "{src}");
    }
    // /proc/cpuinfo is longer than a page; its MHz lines change.
    let res = run(d, &["encrypt", "-R", &r, "-o", "cpu.tpmc", "/proc/cpuinfo"]);
    assert_ok(&res, "cpuinfo");
    let stable = |b: &[u8]| -> String {
        String::from_utf8_lossy(b)
            .lines()
            .filter(|l| !l.contains("MHz"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let expect = stable(&fs::read("/proc/cpuinfo").unwrap());
    assert!(expect.len() > 1000);
    assert_eq!(stable(&decrypted(d, "cpu.tpmc")), expect);
}

// ---------------------------------------------- --in-place keeps the owner

use std::ffi::OsString;
use std::os::unix::fs::MetadataExt;

use common::{bytes, chmod, mode_of};

const USAGE: i32 = 2;

fn owner(path: &Path) -> (u32, u32) {
    let m = fs::symlink_metadata(path).unwrap();
    (m.uid(), m.gid())
}

/// Run as root, `--in-place` of another user's file gives its output that
/// user's owner, group and mode, both ways.
#[test]
fn in_place_keeps_owner_group_and_mode() {
    let (dir, r) = scratch();
    let d = dir.path();
    let f = d.join("theirs");
    fs::write(&f, bytes(10_000, 3)).unwrap();
    std::os::unix::fs::chown(&f, Some(65534), Some(65534)).expect("chown (tests run as root)");
    chmod(&f, 0o640);
    assert_ok(
        &run(d, &["encrypt", "-R", &r, "--in-place", "theirs"]),
        "encrypt",
    );
    let ct = d.join("theirs.tpmc");
    assert_eq!(owner(&ct), (65534, 65534));
    assert_eq!(mode_of(&ct), 0o640);
    assert_ok(
        &run(d, &["decrypt", "-i", "id", "--in-place", "theirs.tpmc"]),
        "decrypt",
    );
    assert_eq!(owner(&f), (65534, 65534));
    assert_eq!(mode_of(&f), 0o640);
    assert_eq!(fs::read(&f).unwrap(), bytes(10_000, 3));
}

/// A user who may not give a file to its owner (not root, another user's
/// file in a directory it may write) is refused before anything is done.
#[test]
fn in_place_refuses_what_it_cannot_give_back_to_its_owner() {
    let (dir, r) = scratch();
    let d = dir.path();
    chmod(d, 0o755);
    let sub = d.join("sub");
    fs::create_dir(&sub).unwrap();
    std::os::unix::fs::chown(&sub, Some(65534), Some(65534)).unwrap();
    fs::write(sub.join("roots"), b"root's file").unwrap();
    chmod(&sub.join("roots"), 0o644);
    let out = common::wrapper(&sub, "setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(common::bin())
        .args(["encrypt", "-R", &r, "--in-place", "roots"])
        .env("TPMCRYPT_HOME", sub.join(".home"))
        .output()
        .expect("setpriv (util-linux)");
    let res: Run = out.into();
    assert_error_line(&res, 1, Some("roots"), &["owner"], "other user's file");
    assert_eq!(fs::read(sub.join("roots")).unwrap(), b"root's file");
    assert_eq!(owner(&sub.join("roots")), (0, 0));
    let names: Vec<_> = fs::read_dir(&sub)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![OsString::from("roots")], "nothing written");
}

/// `--in-place` on a symlink is refused up front, in one line that says
/// symlinks are not followed (exit 2); the link and its target stay.
#[test]
fn in_place_on_a_symlink_says_symlinks_are_not_followed() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("target"), b"target").unwrap();
    symlink("target", d.join("link")).unwrap();
    let res = run(d, &["encrypt", "-R", &r, "--in-place", "link"]);
    assert_error_line(
        &res,
        USAGE,
        Some("link"),
        &["symbolic link", "not followed"],
        "link",
    );
    assert!(fs::symlink_metadata(d.join("link"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(fs::read(d.join("target")).unwrap(), b"target");
    assert!(!d.join("link.tpmc").exists());
    // Without --in-place a named symlink is read, as cat does; decrypt
    // --in-place refuses one too.
    assert_ok(
        &run(d, &["encrypt", "-R", &r, "link"]),
        "without --in-place",
    );
    assert_eq!(decrypted(d, "link.tpmc"), b"target");
    symlink("link.tpmc", d.join("l2.tpmc")).unwrap();
    let res = run(d, &["decrypt", "-i", "id", "--in-place", "l2.tpmc"]);
    assert_error_line(&res, USAGE, Some("l2.tpmc"), &["not followed"], "l2.tpmc");
    assert!(d.join("link.tpmc").exists() && !d.join("l2").exists());
}

/// `--in-place` on a FIFO, a device or a socket is refused up front, in
/// one line (exit 2), without opening it. Before, a FIFO was opened (the
/// run waited for a writer, took its data, then failed with "Illegal
/// seek"), and a device was encrypted beside itself and left, exit 0.
#[test]
fn in_place_on_what_is_not_a_regular_file_is_refused_without_opening_it() {
    use std::os::unix::fs::FileTypeExt as _;
    let (dir, r) = scratch();
    let d = dir.path();
    let c = |p: &str| std::ffi::CString::new(d.join(p).to_str().unwrap()).unwrap();
    // SAFETY: valid NUL-terminated paths.
    unsafe {
        assert_eq!(libc::mkfifo(c("fifo").as_ptr(), 0o600), 0);
        assert_eq!(libc::mkfifo(c("f.tpmc").as_ptr(), 0o600), 0);
        let dev = libc::S_IFCHR | 0o666;
        assert_eq!(
            libc::mknod(c("null").as_ptr(), dev, libc::makedev(1, 3)),
            0,
            "mknod (needs root, as CI runs the tests)"
        );
    }
    let _socket = std::os::unix::net::UnixListener::bind(d.join("sock")).unwrap();
    for args in [
        vec!["encrypt", "-R", &r, "--in-place", "fifo"],
        vec!["encrypt", "-R", &r, "--in-place", "null"],
        vec!["encrypt", "-R", &r, "--in-place", "sock"],
        vec!["decrypt", "-i", "id", "--in-place", "f.tpmc"],
    ] {
        let name = *args.last().unwrap();
        let child = tpmcrypt(d)
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let res = finished_by(child, deadline, &format!("{args:?}"));
        assert_error_line(
            &res,
            USAGE,
            Some(name),
            &["not a regular file", "--in-place"],
            name,
        );
    }
    let kind = |p: &str| fs::symlink_metadata(d.join(p)).unwrap().file_type();
    assert!(kind("fifo").is_fifo() && kind("f.tpmc").is_fifo());
    assert!(kind("null").is_char_device() && kind("sock").is_socket());
    let names = raw_listing(d);
    assert_eq!(names.len(), 5, "nothing written: {names:?}"); // and id
}

/// In a tree deeper than the system's path limit, a file whose
/// ciphertext's path would be longer than that limit is not encrypted
/// (one line), where before its ciphertext was made (through its
/// directory) and its plaintext removed, and no later run could open it.
#[test]
fn a_ciphertext_whose_path_would_be_too_long_is_not_made() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::create_dir(d.join("deep")).unwrap();
    // 600 levels of `dddddddd`, each with a file `f`, made through
    // directory descriptors (their paths soon pass the limit).
    let c = |s: &str| std::ffi::CString::new(s).unwrap();
    let top = std::ffi::CString::new(d.join("deep").to_str().unwrap()).unwrap();
    // SAFETY: valid NUL-terminated names and descriptors this loop owns.
    unsafe {
        let mut fd = libc::open(top.as_ptr(), libc::O_DIRECTORY | libc::O_RDONLY);
        assert!(fd >= 0);
        for level in 0..600 {
            assert_eq!(libc::mkdirat(fd, c("dddddddd").as_ptr(), 0o755), 0);
            let next = libc::openat(
                fd,
                c("dddddddd").as_ptr(),
                libc::O_DIRECTORY | libc::O_RDONLY,
            );
            assert!(next >= 0);
            libc::close(fd);
            fd = next;
            let f = libc::openat(fd, c("f").as_ptr(), libc::O_CREAT | libc::O_WRONLY, 0o644);
            assert!(f >= 0);
            let text = format!("level {level}");
            assert_eq!(
                libc::write(f, text.as_ptr().cast(), text.len()),
                text.len() as isize
            );
            libc::close(f);
        }
        libc::close(fd);
    }
    // `deep` + 454 × `/dddddddd` + `/f` is 4,092 bytes: readable, but its
    // `.tpmc` would be 4,097.
    let at = |level: usize, name: &str| {
        let mut p = String::from("deep");
        for _ in 0..=level {
            p.push_str("/dddddddd");
        }
        p.push('/');
        p.push_str(name);
        p
    };
    assert_eq!(at(453, "f").len(), 4092);
    let res = run(d, &["encrypt", "-R", &r, "-r", "--in-place", "deep"]);
    assert_eq!(res.code, 1, "{}", res.stderr);
    assert_eq!(
        res.stderr.matches("more than the system allows").count(),
        1,
        "{}",
        res.stderr
    );
    // Whether `name` is in the directory at `level` (looked up through
    // descriptors: the paths are too long to name from here).
    let exists = |level: usize, name: &str| -> bool {
        // SAFETY: valid NUL-terminated names; every descriptor is closed.
        unsafe {
            let mut fd = libc::open(top.as_ptr(), libc::O_DIRECTORY | libc::O_RDONLY);
            for _ in 0..=level {
                let next = libc::openat(
                    fd,
                    c("dddddddd").as_ptr(),
                    libc::O_DIRECTORY | libc::O_RDONLY,
                );
                libc::close(fd);
                fd = next;
            }
            let mut st: libc::stat = std::mem::zeroed();
            let found =
                libc::fstatat(fd, c(name).as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) == 0;
            libc::close(fd);
            found
        }
    };
    assert!(
        exists(453, "f") && !exists(453, "f.tpmc"),
        "the plaintext was removed"
    );
    assert!(!exists(452, "f") && exists(452, "f.tpmc"));
    // Every ciphertext made can be opened again.
    let back = run(d, &["decrypt", "-i", "id", "-r", "--in-place", "deep"]);
    assert!(
        !back.stderr.contains("f.tpmc: File name too long"),
        "{}",
        back.stderr
    );
    assert!(exists(452, "f") && !exists(452, "f.tpmc"));
}

/// A file the walk found, replaced by a FIFO before it is opened (by
/// anyone who may write in the tree), is refused with one line: the run
/// used to wait in `open(2)` for a writer, forever.
#[test]
fn a_walked_file_swapped_for_a_fifo_never_holds_the_run() {
    let (dir, r) = scratch();
    let d = dir.path();
    let tree = d.join("t");
    fs::create_dir(&tree).unwrap();
    for i in 0..2000 {
        fs::write(tree.join(format!("f{i:04}")), b"x").unwrap();
    }
    fs::write(tree.join("zzz"), b"last").unwrap();
    // strace holds the run in its first linkat (naming the first output,
    // with the walk over) until the last file is swapped.
    let child = common::wrapper(d, "strace")
        .args(["-f", "-qq", "-o", "/dev/null", "-e", "trace=linkat"])
        .args(["-e", "inject=linkat:delay_enter=2000000:when=1"])
        .arg(common::bin())
        .args(["encrypt", "-R", &r, "-j", "1", "--no-sync", "-r", "t"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("strace");
    common::wait_in_syscall(child.id(), &[libc::SYS_linkat], "the first linkat");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    fs::remove_file(tree.join("zzz")).unwrap();
    let fifo = std::ffi::CString::new(tree.join("zzz").to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let res = finished_by(child, deadline, "encrypt -r");
    assert_eq!(res.code, 1, "{}", res.stderr);
    assert_eq!(res.stderr.lines().count(), 1, "{}", res.stderr);
    assert!(res.stderr.contains("zzz") && res.stderr.contains("no longer a regular file"));
    assert!(tree.join("f1999.tpmc").exists() && !tree.join("zzz.tpmc").exists());
}

// ------------------------------------------------------ standard output gone

use std::io::Read as _;
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;

/// A pipe: (read end, write end).
fn pipe() -> (fs::File, fs::File) {
    use std::os::fd::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two new descriptors, each then owned by a File.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(rc, 0, "pipe2: {}", std::io::Error::last_os_error());
    unsafe { (fs::File::from_raw_fd(fds[0]), fs::File::from_raw_fd(fds[1])) }
}

/// Starts the binary with stdout on a pipe whose reader reads `keep` bytes
/// and then goes away (with 0, it is gone before the start); returns how
/// the run ended and its stderr.
fn with_reader_gone(d: &Path, args: &[&str], keep: usize) -> (std::process::ExitStatus, String) {
    let (reader, writer) = pipe();
    let reader = (keep > 0).then_some(reader);
    let mut child = tpmcrypt(d)
        .args(args)
        .stdout(writer)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(mut reader) = reader {
        let mut buf = vec![0u8; keep];
        reader.read_exact(&mut buf).unwrap();
    }
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (child.wait().unwrap(), err)
}

/// `decrypt … | head -c 10`: when the reader goes away the run ends
/// quietly by SIGPIPE, as cat does (a shell shows 141), with nothing on
/// stderr; so does `encrypt -o -`, and `inspect` whose reader is gone.
#[test]
fn a_reader_that_goes_away_ends_the_run_quietly() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("big"), bytes(6 << 20, 9)).unwrap();
    assert_ok(&run(d, &["encrypt", "-R", &r, "big"]), "encrypt");
    for args in [
        vec!["decrypt", "-i", "id", "-o", "-", "big.tpmc"],
        vec!["encrypt", "-R", &r, "-o", "-", "big"],
        vec!["inspect", "--json", "big.tpmc"],
    ] {
        let keep = if args[0] == "inspect" { 0 } else { 10 };
        let (status, err) = with_reader_gone(d, &args, keep);
        assert_eq!(
            status.signal(),
            Some(libc::SIGPIPE),
            "{args:?}: {status}: {err}"
        );
        assert_eq!(err, "", "{args:?}");
    }
}

/// Runs `args` under sh with stdout closed (`>&-`).
fn stdout_closed(d: &Path, args: &str) -> Run {
    let out = common::wrapper(d, "sh")
        .arg("-c")
        .arg(format!("exec '{}' {args} >&-", common::bin().display()))
        .output()
        .unwrap();
    out.into()
}

/// With stdout closed (`>&-`) a run that would write to it fails in one
/// line (exit 1) instead of losing its output and exiting 0.
#[test]
fn a_closed_stdout_is_an_error() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("p"), b"plain").unwrap();
    assert_ok(&run(d, &["encrypt", "-R", &r, "p"]), "encrypt");
    for args in [
        "decrypt -i id -o - p.tpmc".to_string(),
        format!("encrypt -R {r} -o - p"),
        "inspect p.tpmc".to_string(),
        "recovery recipient id".to_string(),
        "completions bash".to_string(),
    ] {
        let res = stdout_closed(d, &args);
        assert_error_line(&res, 1, None, &["standard output"], &args);
    }
    // A file output is not concerned.
    let res = stdout_closed(d, "decrypt -i id -o q p.tpmc");
    assert_ok(&res, "-o q");
    assert_eq!(fs::read(d.join("q")).unwrap(), b"plain");
    // Nor is a closed standard input (`<&-`) an empty one: the build
    // before encrypted nothing from it and exited 0.
    for args in [
        format!("encrypt -R {r} -o e.tpmc"),
        "decrypt -i id -o e".to_string(),
        "encrypt -R - -o e.tpmc p".to_string(),
    ] {
        let res: Run = common::wrapper(d, "sh")
            .arg("-c")
            .arg(format!("exec '{}' {args} <&-", common::bin().display()))
            .output()
            .unwrap()
            .into();
        assert_error_line(&res, 1, None, &["standard input is closed"], &args);
        assert!(
            !d.join("e.tpmc").exists() && !d.join("e").exists(),
            "{args}"
        );
    }
}

/// A FIFO given with `-o` whose reader goes away is an output that failed:
/// one line naming it (exit 1), not the quiet end of a closed stdout.
#[test]
fn a_fifo_output_whose_reader_goes_away_is_an_error() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("big"), bytes(6 << 20, 9)).unwrap();
    assert_ok(&run(d, &["encrypt", "-R", &r, "big"]), "encrypt");
    let fifo = d.join("fifo");
    let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let reader = std::thread::spawn(move || {
        let mut f = fs::File::open(&fifo).unwrap();
        let mut buf = [0u8; 10];
        f.read_exact(&mut buf).unwrap();
    });
    let res = run(d, &["decrypt", "-i", "id", "-o", "fifo", "big.tpmc"]);
    reader.join().unwrap();
    assert_error_line(&res, 1, Some("fifo"), &["broken pipe"], "fifo reader gone");
    assert!(!res.stderr.contains("standard output"), "{}", res.stderr);
}

// ------------------------------------------------ the same file named twice

/// One file named twice (`a a ./a`, or named and found by `-r`) is one
/// input: done once, with one line per repetition on stderr, exit 0. Two
/// hard links are two names (two outputs); `--in-place` refuses them as
/// before.
#[test]
fn the_same_file_named_twice_is_done_once() {
    let (dir, r) = scratch();
    let d = dir.path();
    for force in [true, false] {
        fs::write(d.join("a"), b"alpha").unwrap();
        let mut args = vec!["encrypt", "-R", &r, "--in-place"];
        if force {
            args.push("-f");
        }
        args.extend(["a", "a", "./a"]);
        let res = run(d, &args);
        assert_ok(&res, &format!("{args:?}"));
        assert_eq!(
            res.stderr.lines().collect::<Vec<_>>(),
            [
                "tpmcrypt: a and a are the same file: done once",
                "tpmcrypt: a and ./a are the same file: done once"
            ],
            "{args:?}"
        );
        assert_eq!(common::listing(d), ["a.tpmc", "id"], "{args:?}");
        let res = run(
            d,
            &["decrypt", "-i", "id", "--in-place", "a.tpmc", "./a.tpmc"],
        );
        assert_ok(&res, "decrypt");
        assert_eq!(fs::read(d.join("a")).unwrap(), b"alpha");
    }
    // Named and found by -r.
    fs::create_dir(d.join("t")).unwrap();
    fs::write(d.join("t/b"), b"beta").unwrap();
    let res = run(d, &["encrypt", "-R", &r, "--in-place", "-r", "t", "t/b"]);
    assert_ok(&res, "-r t t/b");
    assert_eq!(
        res.stderr.trim(),
        "tpmcrypt: t/b and t/b are the same file: done once"
    );
    assert_eq!(common::listing(&d.join("t")), ["b.tpmc"]);
    // Hard links: two names, two outputs.
    fs::hard_link(d.join("a"), d.join("h")).unwrap();
    let res = run(d, &["encrypt", "-R", &r, "a", "h"]);
    assert_ok(&res, "hard links");
    assert!(res.stderr.is_empty(), "{}", res.stderr);
    assert!(d.join("a.tpmc").exists() && d.join("h.tpmc").exists());
}

// ------------------------------------------- an output has no name until done

/// An output being written has no name until it is complete (`O_TMPFILE`,
/// linked in at the end): a run killed with SIGKILL while writing leaves
/// nothing at all in the output's directory, not even a temporary for the
/// next run to clean up. (A temporary with a name was left there before.)
#[test]
fn a_killed_run_leaves_nothing_in_the_output_directory() {
    use std::io::Write as _;
    let (dir, r) = scratch();
    let d = dir.path();
    let out = d.join("out");
    fs::create_dir(&out).unwrap();
    let out = out.canonicalize().unwrap();
    let fifo = d.join("in.fifo");
    let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for command in [
        vec!["encrypt", "-q", "-R", &r, "-o", "out/x.tpmc", "in.fifo"],
        vec![
            "encrypt",
            "-q",
            "-R",
            &r,
            "--no-sync",
            "-o",
            "out/y.tpmc",
            "in.fifo",
        ],
    ] {
        let mut child = tpmcrypt(d)
            .args(&command)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn");
        // Opening the writer waits for the run to open its input.
        let mut writer = fs::OpenOptions::new().write(true).open(&fifo).unwrap();
        writer.write_all(&bytes(3 << 20, 5)).unwrap();
        let start = std::time::Instant::now();
        while !common::has_a_file_open_in(child.id(), &out) {
            assert!(
                start.elapsed().as_secs() < 20,
                "{command:?}: no output opened"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        drop(writer);
        assert_eq!(raw_listing(&out), Vec::<Vec<u8>>::new(), "{command:?}");
    }
}

/// The plaintext of a ciphertext read from a FIFO does not take the FIFO's
/// mode (a FIFO anyone may write to, 0666, made the plaintext readable by
/// anyone): like one read from stdin, it is made under the umask.
#[test]
fn an_output_read_from_a_fifo_is_made_under_the_umask() {
    use std::io::Write as _;
    use std::os::unix::fs::PermissionsExt as _;
    use std::os::unix::process::CommandExt as _;
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("secret"), b"the plaintext").unwrap();
    assert_ok(&run(d, &["encrypt", "-R", &r, "secret"]), "encrypt");
    let ct = fs::read(d.join("secret.tpmc")).unwrap();
    let fifo = d.join("in.fifo");
    let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    fs::set_permissions(&fifo, fs::Permissions::from_mode(0o666)).unwrap();
    let mut cmd = tpmcrypt(d);
    cmd.args(["decrypt", "-i", "id", "-o", "out", "in.fifo"]);
    // SAFETY: umask is async-signal-safe and cannot fail.
    unsafe {
        cmd.pre_exec(|| {
            libc::umask(0o077);
            Ok(())
        });
    }
    let child = cmd.spawn().expect("spawn");
    let mut w = fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    w.write_all(&ct).unwrap();
    drop(w);
    let res: common::Run = child.wait_with_output().unwrap().into();
    assert_ok(&res, "decrypt from a FIFO");
    assert_eq!(fs::read(d.join("out")).unwrap(), b"the plaintext");
    let mode = fs::metadata(d.join("out")).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "plaintext mode {mode:o}");
}
