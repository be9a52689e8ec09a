//! End-to-end tests of the `tpmcrypt` binary: every test runs the real
//! executable in a scratch directory and checks files, exit codes and the
//! one-line error contract (`error: <file>: <cause>` on stderr).
//!
//! Exit codes: 0 ok, 1 other (I/O, exists), 2 usage, 3 integrity, 4 TPM.

mod common;

use std::fs;
use std::io::{Read as _, Write as _};
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    assert_ok, bytes, chmod, listing, mode_of, recovery, run, run_stdin, tpmcrypt, KillDelay,
    Layout, Rng, Run,
};
use serde_json::Value;
use tempfile::TempDir;

const OK: i32 = 0;
const OTHER: i32 = 1;
const USAGE: i32 = 2;
const INTEGRITY: i32 = 3;

const PARTIAL_MARKER: &str = ".tpmcrypt-partial.";

// ---------------------------------------------------------------- helpers

/// A scratch directory holding a recovery identity `id`; returns the
/// directory and the identity's recipient string.
fn scratch() -> (TempDir, String) {
    // tmpfs, as common::scratch: this machine's /tmp may be ext4 without
    // a journal, where every output is fsynced on its own (no batches).
    let dir = common::scratch("tpmcrypt-cli-");
    let r = recovery(dir.path(), "id");
    (dir, r)
}

/// Asserts exit `code` and exactly one stderr line, `error: <label>: …`.
fn assert_error(r: &Run, code: i32, label: &str, what: &str) {
    common::assert_error_line(r, code, Some(label), &[], what);
}

/// Asserts a usage error: exit 2 and one `error: …` line.
fn assert_usage(r: &Run, what: &str) {
    common::assert_error_line(r, USAGE, None, &[], what);
}

fn partials(dir: &Path) -> Vec<String> {
    listing(dir)
        .into_iter()
        .filter(|n| n.contains(PARTIAL_MARKER))
        .collect()
}

/// `inspect --json` of `file`, parsed.
fn inspect_json(dir: &Path, file: &str, extra: &[&str]) -> Value {
    let mut args = vec!["inspect", "--json", file];
    args.extend_from_slice(extra);
    let r = run(dir, &args);
    assert_ok(&r, "inspect --json");
    serde_json::from_slice(&r.stdout).expect("inspect --json prints JSON")
}

fn payload_offset(dir: &Path, file: &str) -> usize {
    inspect_json(dir, file, &[])["payload_offset"]
        .as_u64()
        .expect("payload_offset") as usize
}

fn segment_arg(mode: &str, bits: u32) -> usize {
    if mode == "cbc" && bits == 192 {
        4104
    } else {
        4096
    }
}

// ---------------------------------------------------------------- recovery

#[test]
fn recovery_create_and_recipient() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let r = run(d, &["recovery", "create", "--out", "id"]);
    assert_ok(&r, "recovery create");
    let out = String::from_utf8(r.stdout).unwrap();
    assert_eq!(out.lines().count(), 1, "one line: {out:?}");
    let recipient = out.trim().to_string();
    assert!(recipient.starts_with("tpmcrypt-recovery:"), "{recipient}");
    assert!(recipient.len() > "tpmcrypt-recovery:".len() + 40);
    assert_eq!(mode_of(&d.join("id")), 0o600);
    let original = fs::read(d.join("id")).unwrap();

    let r = run(d, &["recovery", "recipient", "id"]);
    assert_ok(&r, "recovery recipient");
    assert_eq!(String::from_utf8(r.stdout).unwrap().trim(), recipient);

    // No overwrite without --force.
    let r = run(d, &["recovery", "create", "--out", "id"]);
    assert_error(&r, OTHER, "id", "recovery create over an existing file");
    assert!(r.stdout.is_empty());
    assert_eq!(fs::read(d.join("id")).unwrap(), original, "file changed");

    // --force replaces it with a new key, still 0600.
    chmod(&d.join("id"), 0o644);
    let r = run(
        d,
        &["recovery", "create", "--force", "--yes", "--out", "id"],
    );
    assert_ok(&r, "recovery create --force");
    let second = String::from_utf8(r.stdout).unwrap().trim().to_string();
    assert!(second.starts_with("tpmcrypt-recovery:"));
    assert_ne!(second, recipient, "--force produced the same key");
    assert_eq!(mode_of(&d.join("id")), 0o600);
    let r = run(d, &["recovery", "recipient", "id"]);
    assert_eq!(String::from_utf8(r.stdout).unwrap().trim(), second);

    // Not an identity / missing file.
    fs::write(d.join("junk"), "hello\n").unwrap();
    let r = run(d, &["recovery", "recipient", "junk"]);
    assert_error(&r, USAGE, "junk", "recovery recipient of a non-identity");
    let r = run(d, &["recovery", "recipient", "missing"]);
    assert_error(&r, OTHER, "missing", "recovery recipient of a missing file");
}

// ---------------------------------------------------------------- round trips

/// Every mode × key size, sizes around segment boundaries, many files in
/// one invocation (sequential: small files), then stdin → stdout with two
/// workers (the parallel engine), checking the ciphertext size each time.
#[test]
fn round_trip_modes_bits_and_sizes() {
    let (dir, r) = scratch();
    let d = dir.path();
    for mode in ["gcm", "cbc"] {
        for bits in [128u32, 192, 256] {
            let seg = segment_arg(mode, bits);
            let layout = Layout::new(mode, bits, seg);
            let (p0, p) = (layout.plain(0), layout.plain(1));
            let sizes = [
                0,
                1,
                p0 - 1,
                p0,
                p0 + 1,
                p0 + p - 1,
                p0 + p,
                p0 + p + 1,
                p0 + 3 * p + 17,
            ];
            let sub = d.join(format!("{mode}{bits}"));
            fs::create_dir(&sub).unwrap();
            let mut names = Vec::new();
            let mut originals = Vec::new();
            for (i, &len) in sizes.iter().enumerate() {
                let name = format!("f{i}");
                let data = bytes(len, ((bits as u64) << 8) | i as u64);
                fs::write(sub.join(&name), &data).unwrap();
                names.push(name);
                originals.push(data);
            }
            let what = format!("{mode}/{bits}");
            let seg_s = seg.to_string();
            let bits_s = bits.to_string();
            let mut args = vec![
                "encrypt",
                "-R",
                &r,
                "--mode",
                mode,
                "--bits",
                &bits_s,
                "--segment-size",
                &seg_s,
                "-j",
                "1",
            ];
            args.extend(names.iter().map(String::as_str));
            assert_ok(&run(&sub, &args), &what);

            let info = inspect_json(&sub, "f0.tpmc", &[]);
            assert_eq!(info["mode"], mode);
            assert_eq!(info["key_bits"], bits);
            assert_eq!(info["segment_size"], seg);
            let offset = info["payload_offset"].as_u64().unwrap() as usize;
            for (name, data) in names.iter().zip(&originals) {
                let ct = fs::read(sub.join(format!("{name}.tpmc"))).unwrap();
                assert_eq!(
                    ct.len(),
                    offset + layout.payload_len(data.len()),
                    "{what}: ciphertext size of {} plaintext bytes",
                    data.len()
                );
                fs::remove_file(sub.join(name)).unwrap();
            }

            let mut args = vec!["decrypt", "-i", "../id", "-j", "1"];
            let cts: Vec<String> = names.iter().map(|n| format!("{n}.tpmc")).collect();
            args.extend(cts.iter().map(String::as_str));
            assert_ok(&run(&sub, &args), &what);
            for (name, data) in names.iter().zip(&originals) {
                assert_eq!(&fs::read(sub.join(name)).unwrap(), data, "{what}: {name}");
            }

            // stdin → stdout, parallel (stdin is always parallel unless -j 1).
            for &len in &[0, p0 + 3 * p + 17] {
                let data = bytes(len, 77 + bits as u64);
                let enc = run_stdin(
                    &sub,
                    &[
                        "encrypt",
                        "-R",
                        &r,
                        "--mode",
                        mode,
                        "--bits",
                        &bits_s,
                        "--segment-size",
                        &seg_s,
                        "-j",
                        "2",
                    ],
                    &data,
                );
                assert_ok(&enc, &what);
                assert_eq!(enc.stdout.len(), offset + layout.payload_len(len));
                let dec = run_stdin(&sub, &["decrypt", "-i", "../id", "-j", "2"], &enc.stdout);
                assert_ok(&dec, &what);
                assert!(dec.stdout == data, "{what}: stdin round trip of {len}");
            }
        }
    }
}

/// `-o FILE`, `-o -`, `-` as input, stdin → `-o FILE`, and the default
/// 1 MiB segments.
#[test]
fn round_trip_output_variants() {
    let (dir, r) = scratch();
    let d = dir.path();
    let data = bytes(1_100_000, 5); // two default-size segments
    fs::write(d.join("plain"), &data).unwrap();

    assert_ok(
        &run(d, &["encrypt", "-R", &r, "-o", "a.bin", "plain"]),
        "-o file",
    );
    let info = inspect_json(d, "a.bin", &[]);
    assert_eq!(info["segment_size"], 1 << 20);
    assert_eq!(info["mode"], "gcm");
    assert_eq!(info["key_bits"], 256);
    assert!(!d.join("plain.tpmc").exists());

    let enc = run(d, &["encrypt", "-R", &r, "-o", "-", "plain"]);
    assert_ok(&enc, "-o -");
    assert!(enc.stdout.starts_with(b"\x89TPMC\r\n\x1a"));
    fs::write(d.join("b.bin"), &enc.stdout).unwrap();

    let enc = run_stdin(d, &["encrypt", "-R", &r, "-o", "c.bin"], &data);
    assert_ok(&enc, "stdin -> -o file");
    assert!(enc.stdout.is_empty());
    let enc = run_stdin(d, &["encrypt", "-R", &r, "-"], &data);
    assert_ok(&enc, "- -> stdout");
    fs::write(d.join("d.bin"), &enc.stdout).unwrap();

    for name in ["a.bin", "b.bin", "c.bin", "d.bin"] {
        let dec = run(d, &["decrypt", "-i", "id", "-o", "-", name]);
        assert_ok(&dec, name);
        assert!(dec.stdout == data, "{name} via -o -");
        let ct = fs::read(d.join(name)).unwrap();
        let dec = run_stdin(d, &["decrypt", "-i", "id"], &ct);
        assert_ok(&dec, name);
        assert!(dec.stdout == data, "{name} via stdin");
        let out = format!("{name}.out");
        assert_ok(&run(d, &["decrypt", "-i", "id", "-o", &out, name]), name);
        assert!(fs::read(d.join(&out)).unwrap() == data, "{name} via -o");
    }
    // Two encryptions of the same plaintext differ (fresh session, salt).
    assert_ne!(fs::read(d.join("a.bin")).unwrap(), enc.stdout);
}

/// The calls of the kinds in `trace` (strace's `-e trace=`) a run makes,
/// in order, as strace saw them.
fn traced(dir: &Path, trace: &str, args: &[&str]) -> Vec<String> {
    traced_at(dir, None, trace, args)
}

/// `prlimit --nofile=N:N`, the wrapper that sets an open-file limit of `n`.
fn file_limit(dir: &Path, n: u32) -> Command {
    let mut cmd = common::wrapper(dir, "prlimit");
    cmd.arg(format!("--nofile={n}:{n}"));
    cmd
}

/// A run of tpmcrypt with `args` under an open-file limit of `n`.
fn run_at_file_limit(dir: &Path, n: u32, args: &[&str]) -> Run {
    let out = file_limit(dir, n)
        .arg(common::bin())
        .args(args)
        .output()
        .expect("prlimit");
    out.into()
}

/// [`traced`], under an open-file limit of `nofile` if given.
fn traced_at(dir: &Path, nofile: Option<u32>, trace: &str, args: &[&str]) -> Vec<String> {
    let log = dir.join("strace.log");
    let mut cmd = match nofile {
        Some(n) => {
            let mut cmd = file_limit(dir, n);
            cmd.arg("strace");
            cmd
        }
        None => common::wrapper(dir, "strace"),
    };
    let status = cmd
        .args(["-f", "-qq", "-o"])
        .arg(&log)
        .args(["-e", &format!("trace={trace}")])
        .arg(common::bin())
        .args(args)
        .status()
        .expect("strace (installed by scripts/setup-deps)");
    assert!(status.success(), "{args:?} under strace: {status}");
    let text = fs::read_to_string(&log).unwrap();
    fs::remove_file(&log).unwrap();
    common::calls_made(&text).map(str::to_owned).collect()
}

/// The sync calls (`fsync`, `fdatasync`, `sync_file_range`) a run makes,
/// as strace saw them.
fn syncs_of(dir: &Path, args: &[&str]) -> Vec<String> {
    let calls = traced(dir, "fsync,fdatasync,sync_file_range,syncfs", args);
    calls.into_iter().filter(|l| l.contains("sync")).collect()
}

/// The files a run opens, as strace saw them (`openat` calls).
fn opens_of(dir: &Path, args: &[&str]) -> Vec<String> {
    traced(dir, "open,openat,openat2", args)
}

/// A script runs one process per file: such a run does no start-up work it
/// has no use for. It does not read the cgroup files behind the CPU count
/// (worker threads are for large or many files), and it still does its job.
#[test]
fn a_one_file_run_does_not_look_up_the_cpu_count() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("small"), bytes(16 << 10, 3)).unwrap();
    let runs = [
        vec![
            "encrypt",
            "-q",
            "--no-sync",
            "-R",
            &r,
            "-o",
            "small.tpmc",
            "small",
        ],
        vec![
            "decrypt",
            "-q",
            "--no-sync",
            "-i",
            "id",
            "-o",
            "small.out",
            "small.tpmc",
        ],
    ];
    for args in &runs {
        let opens = opens_of(d, args);
        assert!(
            opens.iter().any(|l| l.contains("\"small")),
            "{args:?}: strace saw the input opened: {opens:?}"
        );
        let cgroup: Vec<_> = opens.iter().filter(|l| l.contains("cgroup")).collect();
        assert!(cgroup.is_empty(), "{args:?} read cgroup files: {cgroup:?}");
    }
    assert_eq!(fs::read(d.join("small.out")).unwrap(), bytes(16 << 10, 3));
}

/// A recursive encrypt opens each input once: whether a file found by the
/// walk is a tpmcrypt file already is seen by its first bytes when the run
/// opens it (it used to be opened, read and closed once more by the walk).
/// One that is, is still left out (what `-v` says of it: tests/files.rs).
#[test]
fn a_recursive_encrypt_opens_each_input_once() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::create_dir(d.join("t")).unwrap();
    for i in 0..30 {
        fs::write(d.join(format!("t/f{i:02}")), bytes(1000, i)).unwrap();
    }
    fs::write(d.join("x"), b"x").unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", &r, "-o", "t/old.tpmc", "x"]),
        "old",
    );
    let opens = opens_of(d, &["encrypt", "-R", &r, "-r", "--no-sync", "t"]);
    for i in 0..30 {
        let name = format!("\"t/f{i:02}\"");
        let n = opens.iter().filter(|l| l.contains(&name)).count();
        assert_eq!(n, 1, "t/f{i:02} opened {n} times: {opens:#?}");
    }
    assert!(
        !d.join("t/old.tpmc.tpmc").exists(),
        "a tpmcrypt file encrypted again"
    );
    let res = run(d, &["decrypt", "-i", "id", "-o", "-", "t/f07.tpmc"]);
    assert_ok(&res, "decrypt");
    assert_eq!(res.stdout, bytes(1000, 7));
}

/// `--in-place` removes its originals directory by directory: the
/// originals of one directory are moved aside and unlinked through one
/// open of it (per batch and thread), not one each (a path lookup and a
/// descriptor per file). Each name is still made under the directory's
/// shared lock, taken and released around it. Every file is still its
/// ciphertext afterwards, with nothing moved aside left over.
#[test]
fn in_place_removes_originals_through_one_open_of_their_directory() {
    let (dir, r) = scratch();
    let d = dir.path();
    let tree = d.join("tree");
    const N: usize = 300;
    for i in 0..N {
        let sub = tree.join(["a", "b", "c"][i % 3]);
        fs::create_dir_all(&sub).unwrap();
        fs::write(sub.join(format!("f{i:03}")), bytes(100, i as u64)).unwrap();
    }
    let calls = traced(
        d,
        "open,openat,flock,renameat2,unlink,unlinkat",
        &["encrypt", "-R", &r, "-r", "--in-place", "tree"],
    );
    let count = |what: &str| calls.iter().filter(|l| l.contains(what)).count();
    assert!(
        count(".tpmcrypt-removing.") >= N,
        "the originals are moved aside"
    );
    assert!(count("LOCK_SH") >= N, "each name made under the lock");
    for sub in ["a", "b", "c"] {
        let opens = count(&format!("\"tree/{sub}\""));
        assert!(
            opens <= 12,
            "tree/{sub} opened {opens} times for {N} / 3 files"
        );
        let names = common::listing(&tree.join(sub));
        assert_eq!(names.len(), N / 3, "{names:?}");
        assert!(names.iter().all(|n| n.ends_with(".tpmc")), "{names:?}");
    }
    let back = run(d, &["decrypt", "-i", "id", "-r", "--in-place", "tree"]);
    assert_ok(&back, "decrypt");
    assert_eq!(fs::read(tree.join("b/f004")).unwrap(), bytes(100, 4));
}

/// Group commit: a 2,000-file `--in-place` run makes its outputs durable by
/// batch (one syncfs each) and syncs each directory once per batch, so its
/// sync calls are O(batches + directories), not two per file as before;
/// and every file round-trips.
/// Each original moved aside gives its directory a name of tpmcrypt's
/// own, so the directory's clean mark must be gone first. Removing the
/// mark takes the directory's inode lock for writing even when there is
/// none, and two threads removing originals in one directory spent a
/// tenth of their CPU spinning on that lock: the mark is looked for, and
/// removed only where it is. The build before made 300 removals here.
#[test]
fn originals_are_removed_without_removing_a_mark_that_is_not_there() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::create_dir(d.join("t")).unwrap();
    for i in 0..300 {
        fs::write(d.join(format!("t/f{i:03}")), bytes(100, i)).unwrap();
    }
    let calls = traced(
        d,
        "fgetxattr,fremovexattr",
        &["encrypt", "-R", &r, "-r", "--in-place", "t"],
    );
    let count = |name: &str| calls.iter().filter(|l| l.contains(name)).count();
    // At most the one a listing of the run set, then removed.
    assert!(
        count("fremovexattr(") <= 1,
        "{} removals of the mark",
        count("fremovexattr(")
    );
    assert!(count("fgetxattr(") >= 300, "{calls:?}");
    let left = common::listing(&d.join("t"));
    assert_eq!(left.len(), 300);
    assert!(left.iter().all(|n| n.ends_with(".tpmc")), "{left:?}");
}

#[test]
fn many_files_are_made_durable_by_batch_not_one_by_one() {
    let (dir, r) = scratch();
    let d = dir.path();
    let tree = d.join("tree");
    const N: usize = 2000;
    for sub in ["a", "b"] {
        fs::create_dir_all(tree.join(sub)).unwrap();
    }
    for i in 0..N {
        let sub = if i % 2 == 0 { "a" } else { "b" };
        fs::write(tree.join(format!("{sub}/f{i:04}")), bytes(4096, i as u64)).unwrap();
    }
    let calls = syncs_of(d, &["encrypt", "-R", &r, "-r", "--in-place", "tree"]);
    let count = |name: &str| {
        calls
            .iter()
            .filter(|l| l.contains(&format!("{name}(")))
            .count()
    };
    let (syncfs, fsync) = (count("syncfs"), count("fsync"));
    // Per batch (at most 4,096 files or one second): one syncfs for the
    // data, one for the renames in both directories, one for the removals.
    assert!(syncfs >= 1, "syncfs per batch: {calls:?}");
    assert!(
        fsync <= 2 * syncfs,
        "{fsync} fsyncs for {syncfs} syncfs: not O(batches + directories)"
    );
    assert!(
        syncfs + fsync < N / 50,
        "{syncfs} syncfs + {fsync} fsync for {N} files"
    );
    let left = common::listing(&tree.join("a"));
    assert_eq!(left.len(), N / 2);
    assert!(
        left.iter().all(|n| n.ends_with(".tpmc")),
        "{:?}",
        &left[..3]
    );
    let r = run(d, &["decrypt", "-i", "id", "-r", "--in-place", "tree"]);
    assert_ok(&r, "decrypt");
    for i in [0, 1, 999, 1998, 1999] {
        let sub = if i % 2 == 0 { "a" } else { "b" };
        assert_eq!(
            fs::read(tree.join(format!("{sub}/f{i:04}"))).unwrap(),
            bytes(4096, i as u64)
        );
    }
}

/// An output is written with no name and gets one (`linkat`) only after
/// its data is durable; then its inode, whose link count that changed, is
/// made durable too before the run ends: one file is fsynced again, a
/// batch of several gets a `syncfs` (without a journal a directory's fsync
/// would not write the files' inodes). No temporary is ever renamed.
#[test]
fn outputs_are_named_after_their_data_is_durable_and_then_synced_again() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::create_dir(d.join("flat")).unwrap();
    for i in 0..20 {
        fs::write(d.join(format!("flat/f{i:02}")), bytes(4096, i)).unwrap();
    }
    fs::write(d.join("one"), bytes(4096, 99)).unwrap();
    let is = |l: &String, call: &str| l.contains(&format!("{call}("));
    for (args, after) in [
        (vec!["encrypt", "-R", &r, "-r", "flat"], "syncfs"),
        (vec!["encrypt", "-R", &r, "one"], "fsync"),
    ] {
        let calls = traced(
            d,
            "fsync,fdatasync,syncfs,linkat,rename,renameat,renameat2",
            &args,
        );
        let links: Vec<usize> = (0..calls.len())
            .filter(|&i| is(&calls[i], "linkat"))
            .collect();
        let expected = if args.contains(&"-r") { 20 } else { 1 };
        assert_eq!(links.len(), expected, "{args:?}: {calls:#?}");
        assert!(
            !calls.iter().any(|l| is(l, "renameat2") || is(l, "rename")),
            "{calls:#?}"
        );
        let first_sync = calls.iter().position(|l| l.contains("sync")).unwrap();
        assert!(
            first_sync < links[0],
            "{args:?}: named before its data was durable: {calls:#?}"
        );
        let last = *links.last().unwrap();
        assert!(
            calls[last..].iter().any(|l| is(l, after)),
            "{args:?}: no {after} after the last name was given: {calls:#?}"
        );
    }
    let back = run(d, &["decrypt", "-i", "id", "-o", "f07", "flat/f07.tpmc"]);
    assert_ok(&back, "decrypt");
    assert_eq!(fs::read(d.join("f07")).unwrap(), bytes(4096, 7));
}

/// A `-r` walk of a directory marked clean removes a dead run's temporary
/// and puts back its moved-aside original, as the listing of an unmarked
/// one does (before, the walk only skipped the temporary).
#[test]
fn a_walk_of_a_marked_directory_cleans_what_crashed_runs_left() {
    let (dir, r) = scratch();
    let d = dir.path();
    let big = d.join("big");
    fs::create_dir(&big).unwrap();
    for i in 0..300 {
        fs::write(big.join(format!("f{i:03}")), b"x").unwrap();
    }
    fs::write(big.join("a"), b"a").unwrap();
    assert_ok(
        &run(d, &["encrypt", "--no-sync", "-R", &r, "big/a"]),
        "marks",
    );
    let mark = xattr(&big);
    assert!(mark.is_some(), "the directory is marked");
    fs::remove_file(big.join("a")).unwrap();
    // Left as a killed run leaves them (PID 2147483646 is never alive),
    // the mark kept as if it had been set after them (a copy, a race).
    let temporary = big.join(".g.tpmc.tpmcrypt-partial.2147483646.00000000000000aa");
    let aside = big.join(".notes.tpmcrypt-removing.2147483646.0123456789abcdef");
    fs::write(&temporary, b"partial").unwrap();
    fs::write(&aside, b"precious").unwrap();
    assert_eq!(xattr(&big), mark);
    assert_ok(
        &run(d, &["encrypt", "--no-sync", "-R", &r, "-r", "big"]),
        "walk",
    );
    assert!(!temporary.exists(), "the dead run's temporary is removed");
    assert!(!aside.exists());
    assert!(big.join("notes.tpmc").exists() || big.join("notes").exists());
}

/// The value of `user.tpmcrypt.clean` on `dir`, if any.
fn xattr(dir: &Path) -> Option<Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    let mut buf = [0u8; 64];
    // SAFETY: valid C strings and a live buffer of its length.
    let n = unsafe {
        libc::getxattr(
            path.as_ptr(),
            c"user.tpmcrypt.clean".as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    (n >= 0).then(|| buf[..n as usize].to_vec())
}

/// A script that runs tpmcrypt once per file in a directory of thousands
/// listed the whole directory in every process, for the temporaries of
/// crashed runs (6 ms a run at 20,000 files, 4 × the rest of it). A run
/// that finds a large directory clean now marks it, and the next runs
/// do not list it; a run that leaves a temporary there (here: killed)
/// removes the mark first, so the run after it lists the directory and
/// removes the temporary.
#[test]
fn one_file_runs_list_a_large_directory_only_until_it_is_found_clean() {
    let (dir, r) = scratch();
    let d = dir.path();
    let big = d.join("big");
    fs::create_dir(&big).unwrap();
    for i in 0..2000 {
        fs::write(big.join(format!("f{i:04}")), b"x").unwrap();
    }
    for name in ["a", "b", "c"] {
        fs::write(big.join(name), bytes(16384, name.len() as u64)).unwrap();
    }
    let listings = |input: &str| -> usize {
        let log = d.join(format!("strace-{input}.log"));
        let status = common::wrapper(d, "strace")
            .args(["-f", "-qq", "-o"])
            .arg(&log)
            .args(["-e", "trace=getdents64"])
            .arg(common::bin())
            .args(["encrypt", "--no-sync", "-R", &r])
            .arg(big.join(input))
            .status()
            .expect("strace");
        assert!(status.success(), "{status}");
        fs::read_to_string(&log)
            .unwrap()
            .lines()
            .filter(|l| l.contains("getdents64("))
            .count()
    };
    assert!(listings("a") > 0, "the first run lists the directory");
    assert_eq!(
        listings("b"),
        0,
        "a run in a directory found clean lists nothing"
    );
    // A run killed while writing under a temporary name (replacing a file).
    fs::write(big.join("out.tpmc"), b"old").unwrap();
    let mut child = common::tpmcrypt(d)
        .args(["encrypt", "-f", "-R", &r, "-o"])
        .arg(big.join("out.tpmc"))
        .arg("-")
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&bytes(4096, 9)).unwrap();
    let is_temporary = |n: &str| n.starts_with(".out.tpmc.tpmcrypt-partial.");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !common::listing(&big).iter().any(|n| is_temporary(n)) {
        assert!(Instant::now() < deadline, "no temporary appeared");
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    drop(stdin);
    assert!(
        listings("c") > 0,
        "the run after a killed one lists the directory"
    );
    let left: Vec<String> = common::listing(&big)
        .into_iter()
        .filter(|n| n.contains("tpmcrypt"))
        .collect();
    assert!(
        left.is_empty(),
        "the killed run's temporary is removed: {left:?}"
    );
    assert_eq!(fs::read(big.join("out.tpmc")).unwrap(), b"old");
}

/// A run of many files is committed in four batches or so, where the
/// open-file limit allows one batch of them all (as it did, up to 4,096):
/// while a batch waits for the disk the workers write the next, and only
/// the last batch's commit waits alone. Counted as runs of `linkat` (the
/// outputs getting their names) between syncs. A batch is also closed one
/// second after its first output (`batch::Limits::age`): on a busy machine
/// (under strace, 300 outputs can take longer) that made six batches, so
/// a batch short of a quarter other than the last must show that second,
/// from the sync before it (or the start) to its own.
#[test]
fn a_run_of_many_files_commits_in_about_four_batches() {
    let (dir, r) = scratch();
    let d = dir.path();
    const N: usize = 1200;
    const QUARTER: usize = N / 4;
    fs::create_dir(d.join("t")).unwrap();
    for i in 0..N {
        fs::write(d.join(format!("t/f{i:04}")), bytes(64, i as u64)).unwrap();
    }
    // An open-file limit that allows one batch of them all (1,349 files),
    // whatever the machine's: the build before made it one batch.
    let log = d.join("strace.log");
    let status = file_limit(d, 8192)
        .arg("strace")
        .args(["-f", "-qq", "-ttt", "-o"])
        .arg(&log)
        .args(["-e", "trace=execve,syncfs,fsync,linkat"])
        .arg(common::bin())
        .args(["encrypt", "-R", &r, "-r", "t"])
        .status()
        .expect("strace (installed by scripts/setup-deps)");
    assert!(status.success(), "encrypt under strace: {status}");
    let text = fs::read_to_string(&log).unwrap();
    let calls: Vec<&str> = common::calls_made(&text).collect();
    // Each line: PID, seconds since the epoch, the call.
    let at = |line: &str| -> f64 {
        let stamp = line.split_whitespace().nth(1).unwrap_or_default();
        stamp
            .parse()
            .unwrap_or_else(|e| panic!("no time in {line:?}: {e}"))
    };
    let start = at(calls
        .iter()
        .find(|c| c.contains("execve("))
        .expect("the run's execve"));
    // Per batch: its outputs named, and when its sync came after the one
    // before it (the first: after the start).
    let mut batches: Vec<(usize, f64)> = Vec::new();
    let (mut last_was_link, mut last_sync, mut before) = (false, start, start);
    for c in &calls {
        let is_link = c.contains("linkat(");
        if is_link && !last_was_link {
            batches.push((0, last_sync - before));
            before = last_sync;
        }
        if is_link {
            batches.last_mut().unwrap().0 += 1;
        }
        if c.contains("sync") {
            last_sync = at(c);
        }
        if is_link || c.contains("sync") {
            last_was_link = is_link;
        }
    }
    let sizes: Vec<usize> = batches.iter().map(|b| b.0).collect();
    assert_eq!(sizes.iter().sum::<usize>(), N, "{sizes:?}: {calls:#?}");
    assert!(
        sizes.len() >= 4 && sizes.iter().all(|&n| n <= QUARTER),
        "batches of {sizes:?} outputs: a quarter of the run at most"
    );
    for (i, &(n, waited)) in batches.iter().enumerate() {
        if n < QUARTER && i + 1 < batches.len() {
            assert!(
                waited >= 0.99,
                "batch {i} of {sizes:?} closed at {n} outputs, {waited:.3} s after the sync \
                 before it: neither full nor a second old"
            );
        }
    }
    assert_eq!(listing(&d.join("t")).len(), 2 * N);
}

/// The removals of a run over many directories are made durable with one
/// `syncfs` through one open directory per file system, not by opening
/// every directory at once: at a low open-file limit that ran out of
/// descriptors, and the run warned, for each directory, that the removal
/// of its originals "may not be durable yet" (271 times for 300
/// directories at 36 descriptors).
#[test]
fn removals_in_many_directories_are_made_durable_at_a_low_open_file_limit() {
    let (dir, r) = scratch();
    let d = dir.path();
    const DIRS: usize = 300;
    for i in 0..DIRS {
        let sub = d.join(format!("t/d{i:03}"));
        fs::create_dir_all(&sub).unwrap();
        fs::write(sub.join("a"), bytes(500, i as u64)).unwrap();
        fs::write(sub.join("b"), bytes(700, i as u64)).unwrap();
    }
    let res = run_at_file_limit(
        d,
        36,
        &[
            "encrypt",
            "-q",
            "-j",
            "1",
            "-R",
            &r,
            "--in-place",
            "-r",
            "t",
        ],
    );
    assert_ok(&res, "encrypt at 36 descriptors");
    assert!(res.stderr.is_empty(), "{}", res.stderr);
    for i in [0, 150, 299] {
        let names = listing(&d.join(format!("t/d{i:03}")));
        assert_eq!(names, ["a.tpmc", "b.tpmc"]);
    }
}

/// A run of many batches makes each batch's names durable with the next
/// batch's data, one disk wait per batch instead of three, and still
/// removes no original before a sync that began after its output got its
/// name (and the run ends with every name and removal synced). Small
/// batches come from a low open-file limit (about ten files each here).
#[test]
fn in_place_runs_of_many_batches_wait_once_per_batch_and_remove_originals_only_behind_a_sync() {
    let (dir, r) = scratch();
    let d = dir.path();
    const N: usize = 300;
    for k in 0..3 {
        fs::create_dir(d.join(format!("t{k}"))).unwrap();
    }
    for i in 0..N {
        fs::write(d.join(format!("t{}/f{i:03}", i % 3)), bytes(4096, i as u64)).unwrap();
    }
    let args = [
        "encrypt",
        "-R",
        &r,
        "-j",
        "2",
        "-r",
        "--in-place",
        "t0",
        "t1",
        "t2",
    ];
    let lines = traced_at(
        d,
        Some(96),
        "fsync,fdatasync,syncfs,linkat,renameat2,unlink",
        &args,
    );
    // Each call: its name, its text, the line it began on, the line it
    // ended on (strace splits a call that another thread's interrupts).
    let mut calls: Vec<(String, String, usize, usize)> = Vec::new();
    let mut open: std::collections::HashMap<String, usize> = Default::default();
    for (i, l) in lines.iter().enumerate() {
        let (pid, rest) = l.split_once(' ').unwrap();
        let rest = rest.trim_start();
        if let Some(call) = rest.strip_suffix("<unfinished ...>") {
            open.insert(pid.to_owned(), calls.len());
            let name = call.split('(').next().unwrap().to_owned();
            calls.push((name, call.to_owned(), i, usize::MAX));
        } else if rest.starts_with("<... ") {
            let k = open.remove(pid).expect("a call resumed that began");
            calls[k].1.push_str(rest);
            calls[k].3 = i;
        } else if let Some((name, _)) = rest.split_once('(') {
            calls.push((name.to_owned(), rest.to_owned(), i, i));
        }
    }
    let syncs: Vec<(usize, usize)> = calls
        .iter()
        .filter(|c| c.0.contains("sync"))
        .map(|c| (c.2, c.3))
        .collect();
    let quoted = |text: &str, nth: usize| text.split('"').nth(nth).map(str::to_owned);
    let mut linked: std::collections::HashMap<String, usize> = Default::default();
    let mut link_groups = 0;
    let mut last_was_link = false;
    for c in &calls {
        let is_link = c.0 == "linkat";
        if is_link {
            // linkat(fd, "", dirfd, "NAME", …) or linkat(AT_FDCWD, "/proc/…", dirfd, "NAME", …)
            let name = quoted(&c.1, 3).expect("linkat names its output");
            linked.insert(name, c.3);
            link_groups += usize::from(!last_was_link);
        }
        if is_link || c.0.contains("sync") {
            last_was_link = is_link;
        }
    }
    assert_eq!(linked.len(), N, "every output named once");
    let mut removed = 0;
    for c in calls.iter().filter(|c| c.0 == "renameat2") {
        let from = quoted(&c.1, 1).unwrap();
        if !quoted(&c.1, 3).unwrap().contains(".tpmcrypt-removing.") {
            continue;
        }
        removed += 1;
        let name = from.rsplit('/').next().unwrap();
        let named_at = linked[&format!("{name}.tpmc")];
        assert!(
            syncs.iter().any(|&(b, e)| b > named_at && e < c.2),
            "{from} was moved aside for removal with no sync between its output's name and it"
        );
    }
    assert_eq!(removed, N);
    // Many batches, and about one sync each (it was three: the data, the
    // names, the removals).
    assert!(link_groups >= 10, "{link_groups} batches");
    assert!(
        syncs.len() <= link_groups + 3,
        "{} syncs for {link_groups} batches",
        syncs.len()
    );
    // Every file is its ciphertext, which decrypts to what it was.
    for k in 0..3 {
        let names = listing(&d.join(format!("t{k}")));
        assert_eq!(names.len(), N / 3, "{names:?}");
        assert!(names.iter().all(|n| n.ends_with(".tpmc")), "{names:?}");
    }
    let back = run(d, &["decrypt", "-i", "id", "-o", "f151", "t1/f151.tpmc"]);
    assert_ok(&back, "decrypt");
    assert_eq!(fs::read(d.join("f151")).unwrap(), bytes(4096, 151));
}

/// A FUSE file system (here bindfs; sshfs, ntfs-3g, gocryptfs alike) does
/// not pass `syncfs` on to its server, so a batch there is made durable by
/// an fsync of each output (and of each directory), never by `syncfs`.
/// Needs root to mount, as CI runs the tests.
#[test]
fn outputs_on_fuse_are_each_fsynced() {
    // SAFETY: geteuid cannot fail.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "mounting bindfs needs root (CI runs as root)"
    );
    let (dir, r) = scratch();
    let d = dir.path();
    fs::create_dir_all(d.join("under/tree")).unwrap();
    fs::create_dir(d.join("mnt")).unwrap();
    const N: usize = 20;
    for i in 0..N {
        fs::write(d.join(format!("under/tree/f{i:02}")), bytes(2000, i as u64)).unwrap();
    }
    let status = Command::new("bindfs")
        .arg(d.join("under"))
        .arg(d.join("mnt"))
        .status()
        .expect("bindfs (installed by scripts/setup-deps)");
    assert!(status.success(), "bindfs: {status}");
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _mounted = Unmount(d.join("mnt"));
    let log = d.join("strace.log");
    let status = common::wrapper(d, "strace")
        .args(["-f", "-qq", "-y", "-o"])
        .arg(&log)
        .args(["-e", "trace=fsync,fdatasync,syncfs"])
        .arg(common::bin())
        .args(["encrypt", "-R", &r, "-r", "--in-place", "mnt/tree"])
        .status()
        .expect("strace (installed by scripts/setup-deps)");
    assert!(status.success(), "encrypt under strace: {status}");
    let calls = fs::read_to_string(&log).unwrap();
    assert!(!calls.contains("syncfs("), "syncfs on FUSE: {calls}");
    for i in 0..N {
        let tmp = format!(".f{i:02}.tpmc{PARTIAL_MARKER}");
        assert!(
            calls
                .lines()
                .any(|l| l.contains("fsync(") && l.contains(&tmp)),
            "f{i:02}.tpmc not fsynced: {calls}"
        );
    }
    assert!(
        calls
            .lines()
            .any(|l| l.contains("fsync(") && l.ends_with("/mnt/tree>) = 0")),
        "its directory not fsynced: {calls}"
    );
    assert_eq!(listing(&d.join("under/tree")).len(), N);
    assert!(listing(&d.join("under/tree"))
        .iter()
        .all(|n| n.ends_with(".tpmc")));
}

/// A run over more files than the open-file limit allows at once (a soft
/// and hard limit of 64, 8 workers, 600 files) waits for descriptors
/// rather than failing files with "Too many open files".
#[test]
fn a_low_open_file_limit_fails_no_file() {
    let (dir, r) = scratch();
    let d = dir.path();
    const N: usize = 600;
    fs::create_dir(d.join("t")).unwrap();
    for i in 0..N {
        fs::write(d.join(format!("t/f{i:03}")), bytes(100, i as u64)).unwrap();
    }
    for args in [
        vec!["encrypt", "-R", &r, "-j", "8", "-r", "--in-place", "t"],
        vec!["decrypt", "-i", "id", "-j", "8", "-r", "--in-place", "t"],
        vec!["encrypt", "-R", &r, "-j", "8", "-r", "t"],
    ] {
        let res = run_at_file_limit(d, 64, &args);
        assert_ok(&res, &format!("{args:?}"));
        assert!(res.stderr.is_empty(), "{args:?}: {}", res.stderr);
    }
    let names = listing(&d.join("t"));
    assert_eq!(names.len(), 2 * N);
    assert_eq!(fs::read(d.join("t/f599")).unwrap(), bytes(100, 599));
}

/// By default an output is fsynced before and its directory after the
/// rename; `--no-sync` renames without waiting for the disk, like cp, and
/// is refused with `--in-place`, which removes originals.
#[test]
fn no_sync_skips_fsync_only_when_asked() {
    let (dir, r) = scratch();
    let d = dir.path();
    let data = bytes(6 << 20, 8); // above the parallel threshold
    fs::write(d.join("plain"), &data).unwrap();

    let synced = syncs_of(d, &["encrypt", "-R", &r, "-o", "a.tpmc", "plain"]);
    let fsyncs = synced.iter().filter(|l| l.contains("fsync(")).count();
    assert!(fsyncs >= 2, "file and directory fsync expected: {synced:?}");
    let unsynced = syncs_of(
        d,
        &["encrypt", "--no-sync", "-R", &r, "-o", "b.tpmc", "plain"],
    );
    assert!(unsynced.is_empty(), "--no-sync synced: {unsynced:?}");
    let unsynced = syncs_of(
        d,
        &["decrypt", "--no-sync", "-i", "id", "-o", "b.out", "b.tpmc"],
    );
    assert!(unsynced.is_empty(), "--no-sync synced: {unsynced:?}");
    assert!(fs::read(d.join("b.out")).unwrap() == data);
    assert!(partials(d).is_empty(), "{:?}", partials(d));

    let res = run(
        d,
        &["encrypt", "--no-sync", "--in-place", "-R", &r, "plain"],
    );
    assert_usage(&res, "--no-sync --in-place");
    assert!(fs::read(d.join("plain")).unwrap() == data);
    assert!(!d.join("plain.tpmc").exists());
}

/// What a run printed on a pseudo-terminal (util-linux `script`), with
/// escape sequences removed.
fn on_terminal(dir: &Path, args: &str) -> String {
    let typescript = dir.join("typescript");
    let status = common::wrapper(dir, "script")
        .args(["-q", "-e", "-c"])
        .arg(format!("{} {args}", common::bin().display()))
        .arg(&typescript)
        .stdout(Stdio::null())
        .status()
        .expect("script (util-linux)");
    assert!(status.success(), "{args} on a terminal: {status}");
    let raw = fs::read(&typescript).unwrap();
    fs::remove_file(&typescript).unwrap();
    let text = String::from_utf8_lossy(&raw);
    let mut plain = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            // CSI: ESC [ parameters final-byte
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    plain
}

/// The progress bar is drawn on stderr for a large input when stderr is a
/// terminal, and never with `-q`, for small inputs or off a terminal.
#[test]
fn progress_bar_only_on_a_terminal() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::File::create(d.join("big"))
        .unwrap()
        .set_len(65 << 20)
        .unwrap();
    fs::write(d.join("small"), b"small").unwrap();

    let shown = on_terminal(d, &format!("encrypt -R {r} -o big.tpmc big"));
    assert!(shown.contains("/65.00 MiB"), "no bar: {shown:?}");
    let shown = on_terminal(d, "decrypt -i id -o big.out big.tpmc");
    assert!(shown.contains("/65.00 MiB"), "no bar: {shown:?}");
    assert_eq!(fs::metadata(d.join("big.out")).unwrap().len(), 65 << 20);

    let quiet = on_terminal(d, &format!("-q encrypt -R {r} -o big2.tpmc big"));
    assert!(!quiet.contains(" MiB"), "bar despite -q: {quiet:?}");
    let small = on_terminal(d, &format!("encrypt -R {r} -o small.tpmc small"));
    assert!(!small.contains(" MiB"), "bar for 5 bytes: {small:?}");
    let off = run(d, &["encrypt", "-R", &r, "-o", "big3.tpmc", "big"]);
    assert_ok(&off, "off a terminal");
    assert!(off.stderr.is_empty(), "{:?}", off.stderr);
}

/// A file above the 4 MiB threshold goes through the worker pool; the
/// result is the same whichever side runs in parallel.
#[test]
fn large_file_parallel_and_sequential_agree() {
    let (dir, r) = scratch();
    let d = dir.path();
    let data = bytes((4 << 20) + 12_345, 9);
    fs::write(d.join("big"), &data).unwrap();
    for (jobs, seg) in [("2", "65536"), ("1", "65536"), ("2", "1048576")] {
        let _ = fs::remove_file(d.join("big.tpmc"));
        assert_ok(
            &run(
                d,
                &[
                    "encrypt",
                    "-R",
                    &r,
                    "-j",
                    jobs,
                    "--segment-size",
                    seg,
                    "big",
                ],
            ),
            "encrypt big",
        );
        for dj in ["1", "2"] {
            let dec = run(d, &["decrypt", "-i", "id", "-j", dj, "-o", "-", "big.tpmc"]);
            assert_ok(&dec, "decrypt big");
            assert!(dec.stdout == data, "encrypt -j {jobs} / decrypt -j {dj}");
        }
    }
    // Default -j (number of CPUs) to a file.
    assert_ok(
        &run(d, &["decrypt", "-i", "id", "-o", "big.out", "big.tpmc"]),
        "decrypt big default -j",
    );
    assert!(fs::read(d.join("big.out")).unwrap() == data);
}

#[test]
fn backends_interoperate() {
    let (dir, r) = scratch();
    let d = dir.path();
    let backends = ["openssl", "ring", "rustcrypto", "aws-lc"];
    // aws-lc offers GCM only, ring GCM with 128- and 256-bit keys only.
    let serves = |b: &str, mode: &str, bits: u32| match b {
        "ring" => mode == "gcm" && bits != 192,
        "aws-lc" => mode == "gcm",
        _ => true,
    };
    let combos: &[(&str, u32)] = &[
        ("gcm", 128),
        ("gcm", 192),
        ("gcm", 256),
        ("cbc", 128),
        ("cbc", 192),
        ("cbc", 256),
    ];
    let mut n = 0;
    for (bi, backend) in backends.iter().enumerate() {
        for &(mode, bits) in combos {
            let seg = segment_arg(mode, bits).to_string();
            let bits_s = bits.to_string();
            let data = bytes(3 * 4096 + 7, n);
            n += 1;
            let name = format!("{backend}-{mode}-{bits}");
            fs::write(d.join(&name), &data).unwrap();
            let args = [
                "encrypt",
                "-R",
                &r,
                "--backend",
                backend,
                "--mode",
                mode,
                "--bits",
                &bits_s,
                "--segment-size",
                &seg,
                &name,
            ];
            let enc = run(d, &args);
            if !serves(backend, mode, bits) {
                assert_usage(&enc, &name);
                assert!(!d.join(format!("{name}.tpmc")).exists());
                continue;
            }
            assert_ok(&enc, &name);
            // Decrypt with every backend that supports the file.
            for other in backends.iter().cycle().skip(bi + 1).take(backends.len()) {
                if !serves(other, mode, bits) {
                    continue;
                }
                let dec = run(
                    d,
                    &[
                        "decrypt",
                        "--backend",
                        other,
                        "-i",
                        "id",
                        "-o",
                        "-",
                        &format!("{name}.tpmc"),
                    ],
                );
                assert_ok(&dec, &format!("{name} decrypted by {other}"));
                assert!(dec.stdout == data, "{name} decrypted by {other}");
            }
        }
    }
    // Decrypting cbc with ring fails cleanly: one error line, no output.
    let dec = run(
        d,
        &[
            "decrypt",
            "--backend",
            "ring",
            "-i",
            "id",
            "-o",
            "ring-out",
            "openssl-cbc-128.tpmc",
        ],
    );
    // Not an integrity failure: the file is fine, the backend cannot do it.
    assert!(
        dec.code != OK && dec.code != INTEGRITY,
        "ring and cbc: exit {}",
        dec.code
    );
    assert_error(&dec, dec.code, "openssl-cbc-128.tpmc", "ring and cbc");
    assert!(dec.stderr.contains("ring"), "{}", dec.stderr);
    assert!(!d.join("ring-out").exists());
    assert!(partials(d).is_empty());
    let r2 = run(d, &["encrypt", "-R", &r, "--backend", "nope", "x"]);
    assert_usage(&r2, "unknown backend");
}

#[test]
fn recipients_as_string_file_and_several() {
    let (dir, ra) = scratch();
    let d = dir.path();
    let rb = recovery(d, "id2");
    recovery(d, "id3");
    fs::write(d.join("recipient.txt"), format!("# a comment\n{rb}\n")).unwrap();
    let data = bytes(10_000, 3);
    fs::write(d.join("p"), &data).unwrap();

    // As a file holding the string.
    assert_ok(
        &run(d, &["encrypt", "-R", "recipient.txt", "-o", "f.tpmc", "p"]),
        "recipient file",
    );
    let dec = run(d, &["decrypt", "-i", "id2", "-o", "-", "f.tpmc"]);
    assert_ok(&dec, "identity of the recipient file");
    assert!(dec.stdout == data);
    let dec = run(d, &["decrypt", "-i", "id", "-o", "out", "f.tpmc"]);
    assert_error(&dec, INTEGRITY, "f.tpmc", "not a recipient");
    assert!(!d.join("out").exists());

    // Two recipients: either identity decrypts; a third does not.
    assert_ok(
        &run(
            d,
            &[
                "encrypt",
                "-R",
                &ra,
                "-R",
                "recipient.txt",
                "-o",
                "two.tpmc",
                "p",
            ],
        ),
        "two recipients",
    );
    let info = inspect_json(d, "two.tpmc", &[]);
    let recips = info["recipients"].as_array().unwrap();
    assert_eq!(recips.len(), 2);
    assert_ne!(recips[0]["fingerprint"], recips[1]["fingerprint"]);
    for id in ["id", "id2"] {
        let dec = run(d, &["decrypt", "-i", id, "-o", "-", "two.tpmc"]);
        assert_ok(&dec, id);
        assert!(dec.stdout == data, "{id}");
    }
    let dec = run(d, &["decrypt", "-i", "id3", "-o", "-", "two.tpmc"]);
    assert_error(&dec, INTEGRITY, "two.tpmc", "third identity");
    assert!(dec.stdout.is_empty());
    // Several identities: any one that matches will do.
    let dec = run(
        d,
        &["decrypt", "-i", "id3", "-i", "id2", "-o", "-", "two.tpmc"],
    );
    assert_ok(&dec, "-i id3 -i id2");
    assert!(dec.stdout == data);

    // Invalid recipients are usage errors.
    for bad in ["nonsense", "tpmcrypt-recovery:AAAA", "tpmcrypt-recovery:!!"] {
        let r = run(d, &["encrypt", "-R", bad, "-o", "x.tpmc", "p"]);
        assert_usage(&r, bad);
        assert_eq!(r.stderr.lines().count(), 1, "{bad}: {}", r.stderr);
        assert!(!d.join("x.tpmc").exists());
    }
    fs::write(d.join("empty.txt"), "nothing here\n").unwrap();
    let r = run(d, &["encrypt", "-R", "empty.txt", "-o", "x.tpmc", "p"]);
    assert_usage(&r, "file without a recipient");
    // Invalid identity file: usage; missing identity file: other.
    let r = run(d, &["decrypt", "-i", "empty.txt", "-o", "-", "f.tpmc"]);
    assert_error(&r, USAGE, "empty.txt", "text file as identity");
    let r = run(d, &["decrypt", "-i", "missing", "-o", "-", "f.tpmc"]);
    assert_error(&r, OTHER, "missing", "missing identity");
}

// ---------------------------------------------------------------- recipients files

/// Runs openssl in `dir`, asserting success; returns stdout.
fn openssl(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run openssl: {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Generates a key pair with `openssl genpkey ARGS` and writes its public
/// half (SubjectPublicKeyInfo PEM) to `name`; returns the PEM text.
fn public_pem(dir: &Path, name: &str, genpkey: &[&str]) -> String {
    let private = format!("{name}.private");
    let mut args = vec!["genpkey", "-out", &private];
    args.extend_from_slice(genpkey);
    openssl(dir, &args);
    openssl(dir, &["pkey", "-in", &private, "-pubout", "-out", name]);
    fs::read_to_string(dir.join(name)).unwrap()
}

/// tpmcrypt's fingerprint of a PEM public key: the first 16 bytes of the
/// SHA-256 of its DER, computed by openssl.
fn pem_fingerprint(dir: &Path, pem: &str) -> String {
    let der = format!("{pem}.der");
    openssl(
        dir,
        &[
            "pkey", "-pubin", "-in", pem, "-outform", "DER", "-out", &der,
        ],
    );
    let out = openssl(dir, &["dgst", "-sha256", "-r", &der]);
    out[..32].to_string()
}

/// The (kind, fingerprint) of every stanza of `file`, in order.
fn stanzas(dir: &Path, file: &str) -> Vec<(String, String)> {
    inspect_json(dir, file, &[])["recipients"]
        .as_array()
        .expect("recipients")
        .iter()
        .map(|r| {
            (
                r["kind"].as_str().unwrap().to_string(),
                r["fingerprint"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The fingerprint of recovery identity `id` (from a file encrypted to it).
fn recovery_fingerprint(dir: &Path, recipient: &str) -> String {
    let r = run_stdin(dir, &["encrypt", "-R", recipient, "-o", "fp.tpmc"], b"x");
    assert_ok(&r, "encrypt to one recovery recipient");
    let s = stanzas(dir, "fp.tpmc");
    fs::remove_file(dir.join("fp.tpmc")).unwrap();
    assert_eq!(s.len(), 1);
    s[0].1.clone()
}

#[test]
fn recipients_file_every_entry_counts() {
    let (dir, ra) = scratch();
    let d = dir.path();
    let rb = recovery(d, "id2");
    let rc = recovery(d, "id3");
    let ec = public_pem(
        d,
        "ec.pub",
        &["-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"],
    );
    let rsa = public_pem(
        d,
        "rsa.pub",
        &["-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"],
    );
    let data = bytes(5_000, 11);
    fs::write(d.join("p"), &data).unwrap();

    // Recovery lines and PEM keys, mixed, with comments and blank lines.
    let file = format!(
        "# recipients of the backup\n\n{rb}\n{ec}\n   # an indented comment\r\n{rc}\n\n{rsa}"
    );
    fs::write(d.join("recips.txt"), file).unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", "recips.txt", "-o", "f.tpmc", "p"]),
        "encrypt to a recipients file",
    );
    let want = vec![
        ("recovery-p256".to_string(), recovery_fingerprint(d, &rb)),
        ("tpm-p256".to_string(), pem_fingerprint(d, "ec.pub")),
        ("recovery-p256".to_string(), recovery_fingerprint(d, &rc)),
        ("tpm-rsa2048".to_string(), pem_fingerprint(d, "rsa.pub")),
    ];
    assert_eq!(stanzas(d, "f.tpmc"), want, "one stanza per entry, in order");
    for id in ["id2", "id3"] {
        let dec = run(d, &["decrypt", "-i", id, "-o", "-", "f.tpmc"]);
        assert_ok(&dec, id);
        assert!(dec.stdout == data, "{id}");
    }
    let dec = run(d, &["decrypt", "-i", "id", "-o", "-", "f.tpmc"]);
    assert_error(&dec, INTEGRITY, "f.tpmc", "an identity not in the file");

    // `-R -`: the same file from standard input.
    let r = run_stdin(
        d,
        &["encrypt", "-R", "-", "-R", &ra, "-o", "s.tpmc", "p"],
        &fs::read(d.join("recips.txt")).unwrap(),
    );
    assert_ok(&r, "-R - from stdin");
    let mut want_stdin = want.clone();
    want_stdin.push(("recovery-p256".to_string(), recovery_fingerprint(d, &ra)));
    assert_eq!(stanzas(d, "s.tpmc"), want_stdin, "-R - and -R string");
    let dec = run(d, &["decrypt", "-i", "id3", "-o", "-", "s.tpmc"]);
    assert_ok(&dec, "decrypt what -R - encrypted");
    assert!(dec.stdout == data);
}

#[test]
fn recipients_file_with_a_bad_entry_is_refused_naming_the_line() {
    let (dir, ra) = scratch();
    let d = dir.path();
    let rb = recovery(d, "id2");
    let ec = public_pem(
        d,
        "ec.pub",
        &["-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"],
    );
    fs::write(d.join("p"), b"plaintext").unwrap();
    let identity = fs::read_to_string(d.join("id")).unwrap();
    let id_begin = 1 + identity
        .lines()
        .position(|l| l.starts_with("-----BEGIN"))
        .unwrap();
    let mut bad_base64: Vec<String> = ec.lines().map(str::to_string).collect();
    bad_base64[1].replace_range(0..4, "!!!!");
    let bad_base64 = bad_base64.join("\n");
    let id_line = format!("line {id_begin}");
    let id_needles = [id_line.as_str(), "private"];
    let truncated: String = ec.lines().take(3).map(|l| format!("{l}\n")).collect();
    let cases: Vec<(&str, String, &[&str])> = vec![
        (
            "a word",
            format!("# c\n{ra}\nnot a recipient\n{rb}\n"),
            &["line 3"],
        ),
        (
            "a bad recovery line",
            format!("{ra}\ntpmcrypt-recovery:AAAA\n"),
            &["line 2"],
        ),
        (
            "bad base64 in a PEM block",
            format!("{ra}\n\n{bad_base64}\n"),
            &["line 3"],
        ),
        (
            "a PEM block without END",
            format!("# c\n{truncated}{ra}\n"),
            &["line 2"],
        ),
        (
            "trailing garbage after a public key",
            format!("{ec}garbage\n"),
            &["line 5"],
        ),
        ("an identity file", identity.clone(), &id_needles),
        (
            "only comments",
            "# nothing\n\n   \n# here\n".to_string(),
            &["no recipient"],
        ),
        ("an empty file", String::new(), &["no recipient"]),
    ];
    for (what, text, needles) in cases {
        fs::write(d.join("bad.txt"), text).unwrap();
        let r = run(d, &["encrypt", "-R", "bad.txt", "-o", "x.tpmc", "p"]);
        common::assert_error_line(&r, USAGE, Some("bad.txt"), needles, what);
        assert!(!d.join("x.tpmc").exists(), "{what}: an output was written");
    }
    fs::write(
        d.join("bad.bin"),
        [b'#', b' ', 0xff, b'\n', b'x', 0xff, b'\n'],
    )
    .unwrap();
    let r = run(d, &["encrypt", "-R", "bad.bin", "-o", "x.tpmc", "p"]);
    common::assert_error_line(&r, USAGE, Some("bad.bin"), &["line 2"], "invalid UTF-8");
    // The entry's text is not echoed (it may be a secret pasted by mistake).
    fs::write(d.join("secret.txt"), format!("{ra}\nhunter2-secret\n")).unwrap();
    let r = run(d, &["encrypt", "-R", "secret.txt", "-o", "x.tpmc", "p"]);
    common::assert_error_line(&r, USAGE, Some("secret.txt"), &["line 2"], "unknown line");
    assert!(!r.stderr.contains("hunter2"), "{}", r.stderr);

    // `-R -` only once, and never when the plaintext comes from stdin too.
    let text = format!("{ra}\n");
    for (what, args) in [
        (
            "-R - twice",
            vec!["encrypt", "-R", "-", "-R", "-", "-o", "x.tpmc", "p"],
        ),
        (
            "-R - and plaintext on stdin",
            vec!["encrypt", "-R", "-", "-o", "x.tpmc"],
        ),
        (
            "-R - and input -",
            vec!["encrypt", "-R", "-", "-o", "x.tpmc", "-"],
        ),
    ] {
        let r = run_stdin(d, &args, text.as_bytes());
        common::assert_error_line(&r, USAGE, None, &["standard input"], what);
        assert!(!d.join("x.tpmc").exists(), "{what}: an output was written");
    }
}

#[test]
fn a_recovery_key_given_as_a_pem_public_key_still_opens_the_file() {
    // `openssl pkey -pubout` of a recovery identity is a P-256 PEM public
    // key: a recipient tpmcrypt takes (as tpm-p256), so the identity must
    // open what is encrypted to it.
    let (dir, _) = scratch();
    let d = dir.path();
    openssl(d, &["pkey", "-in", "id", "-pubout", "-out", "id.pub.pem"]);
    let data = bytes(2_000, 21);
    fs::write(d.join("p"), &data).unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", "id.pub.pem", "-o", "f.tpmc", "p"]),
        "encrypt to the recovery key's PEM",
    );
    let dec = run(d, &["decrypt", "-i", "id", "-o", "-", "f.tpmc"]);
    assert_ok(&dec, "the recovery identity opens it");
    assert!(dec.stdout == data);
    let r = run(d, &["recovery", "create", "--out", "other"]);
    assert_ok(&r, "another identity");
    let dec = run(d, &["decrypt", "-i", "other", "-o", "-", "f.tpmc"]);
    assert_error(&dec, INTEGRITY, "f.tpmc", "another recovery identity");
}

#[test]
fn recipients_no_tpm_key_can_decrypt_are_refused() {
    let (dir, _) = scratch();
    let d = dir.path();
    fs::write(d.join("p"), b"plaintext").unwrap();
    let rsa = |bits: &'static str| vec!["-algorithm", "RSA", "-pkeyopt", bits];
    let ec = |curve: &'static str| vec!["-algorithm", "EC", "-pkeyopt", curve];
    let refused: Vec<(&str, Vec<&str>, &[&str])> = vec![
        (
            "rsa1024.pub",
            rsa("rsa_keygen_bits:1024"),
            &["1024", "2048"],
        ),
        (
            "rsa3072.pub",
            rsa("rsa_keygen_bits:3072"),
            &["3072", "2048"],
        ),
        (
            "rsa4096.pub",
            rsa("rsa_keygen_bits:4096"),
            &["4096", "2048"],
        ),
        (
            "rsa-big-e.pub",
            vec![
                "-algorithm",
                "RSA",
                "-pkeyopt",
                "rsa_keygen_bits:2048",
                "-pkeyopt",
                "rsa_keygen_pubexp:4294967311",
            ],
            &["exponent"],
        ),
        ("rsa-pss.pub", vec!["-algorithm", "RSA-PSS"], &["RSA-PSS"]),
        ("p384.pub", ec("ec_paramgen_curve:P-384"), &["P-256"]),
        ("k256.pub", ec("ec_paramgen_curve:secp256k1"), &["P-256"]),
        ("ed25519.pub", vec!["-algorithm", "ED25519"], &["Ed25519"]),
        ("x25519.pub", vec!["-algorithm", "X25519"], &["X25519"]),
    ];
    for (name, args, needles) in refused {
        public_pem(d, name, &args);
        let r = run(d, &["encrypt", "-R", name, "-o", "x.tpmc", "p"]);
        common::assert_error_line(&r, USAGE, Some(name), needles, name);
        assert!(!d.join("x.tpmc").exists(), "{name}: an output was written");
    }
    // P-256 keys whose point is the point at infinity (an empty point) or
    // off the curve: usage errors like the rest (the build before said the
    // first with OpenSSL's error stack, exit 1).
    for (name, base64) in [
        ("infinity.pub", "MBkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDAgAA"),
        (
            "off-curve.pub",
            "MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE6sfunBt8drCg1L1gpIkog9g525IM\n\
             TCUv+Xgiva3xtjaZ/WmWgm0GAYltwUM1Z6nFtNR4uee+WnUXqkVZH5IutA==",
        ),
    ] {
        let pem = format!("-----BEGIN PUBLIC KEY-----\n{base64}\n-----END PUBLIC KEY-----\n");
        fs::write(d.join(name), pem).unwrap();
        let r = run(d, &["encrypt", "-R", name, "-o", "x.tpmc", "p"]);
        common::assert_error_line(&r, USAGE, Some(name), &["invalid recipient"], name);
        assert!(!d.join("x.tpmc").exists(), "{name}: an output was written");
    }
    // What a TPM does hold is accepted: RSA-2048 with e = 65537 or 3, P-256.
    for (name, args) in [
        ("rsa2048.pub", rsa("rsa_keygen_bits:2048")),
        (
            "rsa2048-e3.pub",
            vec![
                "-algorithm",
                "RSA",
                "-pkeyopt",
                "rsa_keygen_bits:2048",
                "-pkeyopt",
                "rsa_keygen_pubexp:3",
            ],
        ),
        ("p256.pub", ec("ec_paramgen_curve:P-256")),
    ] {
        public_pem(d, name, &args);
        let r = run(d, &["encrypt", "-R", name, "-o", "ok.tpmc", "p"]);
        assert_ok(&r, name);
        fs::remove_file(d.join("ok.tpmc")).unwrap();
    }
}

/// An identity file is read only up to 1 MiB (a recovery identity is
/// under 1 KiB): `-i /dev/zero`, or a large file given by mistake, is one
/// usage error, not a read until memory runs out (the build before read
/// both to the end: under a 1 GiB address-space limit, "out of memory",
/// exit 1). A file that is not text gets the same line from `decrypt -i`
/// and `recovery recipient` (the latter said "stream did not contain
/// valid UTF-8", exit 1).
#[test]
fn an_identity_file_is_never_read_past_a_mebibyte() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("p"), b"plaintext").unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", &r, "-o", "p.tpmc", "p"]),
        "encrypt",
    );
    let big = fs::File::create(d.join("big.key")).unwrap();
    big.set_len(4 << 30).unwrap();
    drop(big);
    for identity in ["/dev/zero", "big.key"] {
        let out = common::wrapper(d, "prlimit")
            .arg("--as=1073741824")
            .arg(common::bin())
            .args(["decrypt", "-i", identity, "-o", "-", "p.tpmc"])
            .output()
            .expect("prlimit");
        let r = Run::from(out);
        common::assert_error_line(
            &r,
            USAGE,
            Some(identity),
            &["invalid identity", "larger than 1024 KiB"],
            identity,
        );
        assert!(r.stdout.is_empty(), "{identity}: output");
    }
    fs::write(d.join("latin1.key"), b"# caf\xe9\n").unwrap();
    for args in [
        &["decrypt", "-i", "latin1.key", "-o", "-", "p.tpmc"][..],
        &["recovery", "recipient", "latin1.key"],
    ] {
        let r = run(d, args);
        common::assert_error_line(
            &r,
            USAGE,
            Some("latin1.key"),
            &["invalid identity", "not a text file"],
            &args.join(" "),
        );
    }
}

/// A standard error nobody reads any more (a log collector that died, a
/// `2>&1 | head -1`) never ends a run: its warnings are lost, its work is
/// done. The build before panicked on the warning (exit 101, no output).
#[test]
fn a_warning_to_a_closed_stderr_does_not_end_the_run() {
    use std::os::fd::{FromRawFd as _, OwnedFd};
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("p"), b"plaintext").unwrap();
    // An agent socket in a directory anyone may write to: the run warns
    // that it does not use it, and goes on.
    let loose = d.join("loose");
    fs::create_dir(&loose).unwrap();
    chmod(&loose, 0o777);
    drop(std::os::unix::net::UnixListener::bind(loose.join("agent.sock")).unwrap());
    let mut fds = [0; 2];
    // SAFETY: a valid array of two descriptors. Close-on-exec, so that no
    // child another test thread starts keeps the reader open.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both descriptors were just made and are owned here.
    let (reader, writer) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(reader);
    let out = tpmcrypt(d)
        .env("TPMCRYPT_AGENT_SOCK", loose.join("agent.sock"))
        .args(["encrypt", "-R", &r, "-o", "p.tpmc", "p"])
        .stderr(Stdio::from(writer))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let dec = run(d, &["decrypt", "-i", "id", "-o", "-", "p.tpmc"]);
    assert_ok(&dec, "decrypt");
    assert_eq!(dec.stdout, b"plaintext");
    // The same run with stderr readable says why it does not use the agent.
    let out = tpmcrypt(d)
        .env("TPMCRYPT_AGENT_SOCK", loose.join("agent.sock"))
        .args(["encrypt", "-f", "-R", &r, "-o", "p.tpmc", "p"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("warning: ") && stderr.contains("agent"),
        "{stderr}"
    );
}

// ---------------------------------------------------------------- files

#[test]
fn many_inputs_names_and_existing_outputs() {
    let (dir, r) = scratch();
    let d = dir.path();
    let names = ["a", "b.txt", "c.tar.gz"];
    for (i, n) in names.iter().enumerate() {
        fs::write(d.join(n), bytes(100 + i, i as u64)).unwrap();
    }
    assert_ok(
        &run(d, &["encrypt", "-R", &r, "a", "b.txt", "c.tar.gz"]),
        "encrypt three",
    );
    for n in names {
        assert!(d.join(format!("{n}.tpmc")).exists(), "{n}.tpmc");
        assert!(d.join(n).exists(), "original {n} kept");
    }

    // Existing outputs: exit 1, the existing file untouched, the others done.
    let before = fs::read(d.join("a.tpmc")).unwrap();
    fs::remove_file(d.join("b.txt.tpmc")).unwrap();
    let res = run(d, &["encrypt", "-R", &r, "a", "b.txt"]);
    assert_error(&res, OTHER, "a", "existing output");
    assert!(res.stderr.contains("already exists"), "{}", res.stderr);
    assert_eq!(fs::read(d.join("a.tpmc")).unwrap(), before);
    assert!(
        d.join("b.txt.tpmc").exists(),
        "other inputs still processed"
    );
    // Decrypt refuses to overwrite plaintext.
    let orig_a = fs::read(d.join("a")).unwrap();
    fs::write(d.join("a"), b"changed").unwrap();
    let res = run(d, &["decrypt", "-i", "id", "a.tpmc"]);
    assert_error(&res, OTHER, "a.tpmc", "existing plaintext");
    assert_eq!(fs::read(d.join("a")).unwrap(), b"changed");
    // --force replaces.
    assert_ok(
        &run(d, &["decrypt", "-i", "id", "--force", "a.tpmc"]),
        "--force",
    );
    assert_eq!(fs::read(d.join("a")).unwrap(), orig_a);
    assert_ok(&run(d, &["encrypt", "-R", &r, "-f", "a"]), "encrypt -f");
    assert_ne!(fs::read(d.join("a.tpmc")).unwrap(), before, "replaced");
    assert!(partials(d).is_empty());

    // Decrypt strips .tpmc.
    for n in names {
        fs::rename(d.join(n), d.join(format!("{n}.orig"))).unwrap();
    }
    assert_ok(
        &run(
            d,
            &[
                "decrypt",
                "-i",
                "id",
                "a.tpmc",
                "b.txt.tpmc",
                "c.tar.gz.tpmc",
            ],
        ),
        "decrypt three",
    );
    for n in names {
        assert_eq!(
            fs::read(d.join(n)).unwrap(),
            fs::read(d.join(format!("{n}.orig"))).unwrap(),
            "{n}"
        );
    }
    // No .tpmc suffix and no -o: usage.
    fs::copy(d.join("a.tpmc"), d.join("noext")).unwrap();
    let res = run(d, &["decrypt", "-i", "id", "noext"]);
    assert_usage(&res, "no .tpmc suffix");
    let res = run(d, &["decrypt", "-i", "id", "-o", "-", "noext"]);
    assert_ok(&res, "no suffix with -o -");
    assert_eq!(res.stdout, orig_a);

    // -o with two inputs, directories without -r, -o with -r, stdin mixed.
    let res = run(d, &["encrypt", "-R", &r, "-o", "x", "a", "b.txt"]);
    assert_usage(&res, "-o with two inputs");
    fs::create_dir(d.join("sub")).unwrap();
    fs::write(d.join("sub/z"), b"z").unwrap();
    let res = run(d, &["encrypt", "-R", &r, "sub"]);
    assert_usage(&res, "directory without -r");
    assert!(res.stderr.starts_with("error: sub: "), "{}", res.stderr);
    let res = run(d, &["encrypt", "-R", &r, "-r", "-o", "x", "sub"]);
    assert_usage(&res, "-o with -r");
    let res = run(d, &["encrypt", "-R", &r, "a", "-"]);
    assert_usage(&res, "stdin mixed with files");
    let res = run(d, &["encrypt", "-R", &r, "missing"]);
    assert_error(&res, OTHER, "missing", "missing input");
    let res = run(d, &["encrypt", "-R", &r, "-o", "no-such-dir/x", "a"]);
    assert_error(&res, OTHER, "a", "output in a missing directory");
    assert!(!d.join("x").exists());
    assert!(!d.join("sub/z.tpmc").exists());
}

/// (A plaintext named `*.tpmc` is encrypted like any other: recursion
/// decides by content; tests/files.rs has the details.)
#[test]
fn recursion_skips_links_and_picks_by_content() {
    let (dir, r) = scratch();
    let d = dir.path();
    let tree = d.join("tree");
    let outside = d.join("outside");
    fs::create_dir_all(tree.join("sub/deeper")).unwrap();
    fs::create_dir(&outside).unwrap();
    fs::write(outside.join("secret"), b"outside").unwrap();
    let files = ["top", "sub/mid", "sub/deeper/low", "sub/deeper/.hidden"];
    for (i, f) in files.iter().enumerate() {
        fs::write(tree.join(f), bytes(1000 + i, 40 + i as u64)).unwrap();
    }
    fs::write(tree.join("sub/old.tpmc"), b"not really ciphertext").unwrap();
    symlink(outside.join("secret"), tree.join("link-to-file")).unwrap();
    symlink(&outside, tree.join("sub/link-to-dir")).unwrap();

    assert_ok(&run(d, &["encrypt", "-R", &r, "-r", "tree"]), "encrypt -r");
    for f in files {
        assert!(tree.join(format!("{f}.tpmc")).exists(), "{f}.tpmc");
    }
    assert!(!tree.join("link-to-file.tpmc").exists(), "followed a link");
    assert!(
        tree.join("sub/old.tpmc.tpmc").exists(),
        "left a plaintext named .tpmc"
    );
    assert_eq!(listing(&outside), vec!["secret"], "followed a dir link");
    assert_eq!(
        listing(&tree.join("sub")),
        vec![
            "deeper",
            "link-to-dir",
            "mid",
            "mid.tpmc",
            "old.tpmc",
            "old.tpmc.tpmc"
        ]
    );
    fs::remove_file(tree.join("sub/old.tpmc.tpmc")).unwrap();

    // Decrypt -r: only .tpmc files; the bogus one fails (exit 3) without
    // stopping the others.
    let originals: Vec<Vec<u8>> = files
        .iter()
        .map(|f| fs::read(tree.join(f)).unwrap())
        .collect();
    for f in files {
        fs::remove_file(tree.join(f)).unwrap();
    }
    fs::write(tree.join("new-plain"), b"plain").unwrap();
    let res = run(d, &["decrypt", "-i", "id", "-r", "tree"]);
    assert_error(&res, INTEGRITY, "tree/sub/old.tpmc", "bogus .tpmc");
    for (f, data) in files.iter().zip(&originals) {
        assert_eq!(&fs::read(tree.join(f)).unwrap(), data, "{f}");
    }
    assert!(!tree.join("sub/old").exists());
    assert!(!tree.join("new-plain.tpmc").exists());
    assert_eq!(fs::read(tree.join("new-plain")).unwrap(), b"plain");
    let res = run(d, &["decrypt", "-i", "id", "tree"]);
    assert_usage(&res, "decrypt a directory without -r");
}

#[test]
fn in_place_encrypt_and_decrypt() {
    let (dir, r) = scratch();
    let d = dir.path();
    let names = ["one", "two", "three"];
    let mut originals = Vec::new();
    for (i, n) in names.iter().enumerate() {
        let data = bytes(5000 * i, 60 + i as u64);
        fs::write(d.join(n), &data).unwrap();
        originals.push(data);
    }
    chmod(&d.join("two"), 0o640);
    assert_ok(
        &run(
            d,
            &["encrypt", "-R", &r, "--in-place", "one", "two", "three"],
        ),
        "encrypt --in-place",
    );
    assert_eq!(
        listing(d),
        vec!["id", "one.tpmc", "three.tpmc", "two.tpmc"],
        "originals removed"
    );
    assert_eq!(mode_of(&d.join("two.tpmc")), 0o640);
    assert_ok(
        &run(
            d,
            &[
                "decrypt",
                "-i",
                "id",
                "--in-place",
                "one.tpmc",
                "two.tpmc",
                "three.tpmc",
            ],
        ),
        "decrypt --in-place",
    );
    assert_eq!(listing(d), vec!["id", "one", "three", "two"]);
    for (n, data) in names.iter().zip(&originals) {
        assert_eq!(&fs::read(d.join(n)).unwrap(), data, "{n}");
    }
    assert_eq!(mode_of(&d.join("two")), 0o640);

    // A failing in-place decrypt keeps its input.
    assert_ok(
        &run(d, &["encrypt", "-R", &r, "--in-place", "one"]),
        "encrypt one",
    );
    let mut ct = fs::read(d.join("one.tpmc")).unwrap();
    let last = ct.len() - 1;
    ct[last] ^= 1;
    fs::write(d.join("one.tpmc"), &ct).unwrap();
    let res = run(d, &["decrypt", "-i", "id", "--in-place", "one.tpmc"]);
    assert_error(&res, INTEGRITY, "one.tpmc", "tampered in-place");
    assert_eq!(fs::read(d.join("one.tpmc")).unwrap(), ct);
    assert!(!d.join("one").exists());
    // An existing output keeps the input too.
    fs::write(d.join("two.tpmc"), b"in the way").unwrap();
    let res = run(d, &["encrypt", "-R", &r, "--in-place", "two"]);
    assert_error(&res, OTHER, "two", "in-place over an existing output");
    assert_eq!(fs::read(d.join("two")).unwrap(), originals[1]);
    assert_eq!(fs::read(d.join("two.tpmc")).unwrap(), b"in the way");

    let res = run_stdin(d, &["encrypt", "-R", &r, "--in-place"], b"x");
    assert_usage(&res, "--in-place with stdin");
    let res = run(d, &["encrypt", "-R", &r, "--in-place", "-o", "x", "two"]);
    assert_usage(&res, "--in-place with -o");
}

#[test]
fn output_permissions_follow_input() {
    let (dir, r) = scratch();
    let d = dir.path();
    for (name, mode) in [("a", 0o640), ("b", 0o600), ("c", 0o604)] {
        fs::write(d.join(name), bytes(3000, mode as u64)).unwrap();
        chmod(&d.join(name), mode);
        assert_ok(&run(d, &["encrypt", "-R", &r, name]), name);
        let ct = format!("{name}.tpmc");
        assert_eq!(mode_of(&d.join(&ct)), mode, "encrypt {name}");
        let out = format!("{name}.out");
        assert_ok(&run(d, &["decrypt", "-i", "id", "-o", &out, &ct]), name);
        assert_eq!(mode_of(&d.join(&out)), mode, "decrypt {name}");
    }
    // From stdin: 0666 minus the umask.
    let status = std::process::Command::new("sh")
        .current_dir(d)
        .arg("-c")
        .arg(format!(
            "umask 027; printf hello | '{}' encrypt -R '{r}' -o s.tpmc",
            common::bin().display()
        ))
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(mode_of(&d.join("s.tpmc")), 0o640);
}

// ---------------------------------------------------------------- sessions

#[test]
fn one_unwrap_per_session() {
    let (dir, r) = scratch();
    let d = dir.path();
    let batch = |prefix: &str, n: usize| -> Vec<String> {
        (0..n)
            .map(|i| {
                let name = format!("{prefix}{i:02}");
                fs::write(d.join(&name), bytes(i * 37, i as u64)).unwrap();
                name
            })
            .collect()
    };
    let first = batch("a", 50);
    let mut args = vec!["encrypt", "-R", &r, "--in-place"];
    args.extend(first.iter().map(String::as_str));
    assert_ok(&run(d, &args), "encrypt 50");

    let cts: Vec<String> = first.iter().map(|n| format!("{n}.tpmc")).collect();
    let mut args = vec!["decrypt", "-v", "-i", "id"];
    args.extend(cts.iter().map(String::as_str));
    let res = run(d, &args);
    assert_ok(&res, "decrypt 50");
    assert!(
        res.stderr.contains("1 session key unwrap(s)"),
        "stderr: {}",
        res.stderr
    );
    assert!(
        res.stderr.contains("decrypted 50 file(s)"),
        "{}",
        res.stderr
    );

    // Two batches, two sessions: two unwraps.
    let second = batch("b", 5);
    let mut args = vec!["encrypt", "-R", &r];
    args.extend(second.iter().map(String::as_str));
    assert_ok(&run(d, &args), "second batch");
    for n in &second {
        fs::remove_file(d.join(n)).unwrap();
    }
    for n in &first {
        fs::remove_file(d.join(n)).unwrap();
    }
    let res = run(d, &["decrypt", "-v", "-i", "id", "-r", "."]);
    assert_ok(&res, "decrypt both batches");
    assert!(
        res.stderr.contains("decrypted 55 file(s)")
            && res.stderr.contains("2 session key unwrap(s)"),
        "stderr: {}",
        res.stderr
    );
}

// ---------------------------------------------------------------- inspect

#[test]
fn inspect_text_and_json() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("x"), bytes(10_000, 1)).unwrap();
    fs::write(d.join("y"), bytes(20, 2)).unwrap();
    assert_ok(
        &run(
            d,
            &[
                "encrypt",
                "-R",
                &r,
                "--bits",
                "128",
                "--segment-size",
                "4096",
                "x",
                "y",
            ],
        ),
        "encrypt",
    );
    let size = fs::metadata(d.join("x.tpmc")).unwrap().len();
    let x = inspect_json(d, "x.tpmc", &[]);
    let keys: Vec<&str> = x.as_object().unwrap().keys().map(String::as_str).collect();
    for k in [
        "file",
        "format_version",
        "mode",
        "key_bits",
        "segment_size",
        "header_length",
        "payload_offset",
        "session_id",
        "hkdf_hash",
        "tink_compatible",
        "recipients",
    ] {
        assert!(keys.contains(&k), "missing {k} in {x}");
    }
    assert!(!keys.contains(&"session_key"), "session key without asking");
    assert_eq!(x["file"], "x.tpmc");
    assert_eq!(x["format_version"], 1);
    assert_eq!(x["mode"], "gcm");
    assert_eq!(x["key_bits"], 128);
    assert_eq!(x["segment_size"], 4096);
    assert_eq!(x["hkdf_hash"], "SHA256");
    assert_eq!(x["tink_compatible"], true);
    let offset = x["payload_offset"].as_u64().unwrap();
    assert_eq!(x["header_length"].as_u64().unwrap(), offset);
    assert!(offset > 16 + 32 && offset < size, "{offset}");
    let sid = x["session_id"].as_str().unwrap();
    assert_eq!(sid.len(), 32);
    assert!(sid.bytes().all(|b| b.is_ascii_hexdigit()));
    let recips = x["recipients"].as_array().unwrap();
    assert_eq!(recips.len(), 1);
    assert_eq!(recips[0]["kind"], "recovery-p256");
    assert_eq!(recips[0]["kind_id"], 1);
    let fp = recips[0]["fingerprint"].as_str().unwrap();
    assert_eq!(fp.len(), 32);

    // Same invocation: same session; another invocation: another session,
    // same recipient fingerprint.
    let y = inspect_json(d, "y.tpmc", &[]);
    assert_eq!(y["session_id"], x["session_id"]);
    assert_ok(&run(d, &["encrypt", "-R", &r, "-o", "z.tpmc", "x"]), "z");
    let z = inspect_json(d, "z.tpmc", &[]);
    assert_ne!(z["session_id"], x["session_id"]);
    assert_eq!(z["recipients"][0]["fingerprint"], fp);
    assert_eq!(z["segment_size"], 1 << 20);
    assert_eq!(z["key_bits"], 256);

    // Session key: 64 hex chars, shared within a session.
    let kx = inspect_json(d, "x.tpmc", &["-i", "id", "--reveal-session-key"]);
    let ky = inspect_json(d, "y.tpmc", &["-i", "id", "--reveal-session-key"]);
    let kz = inspect_json(d, "z.tpmc", &["-i", "id", "--reveal-session-key"]);
    let key = kx["session_key"].as_str().unwrap();
    assert_eq!(key.len(), 64);
    assert!(key.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(ky["session_key"], kx["session_key"]);
    assert_ne!(kz["session_key"], kx["session_key"]);
    let res = run(d, &["inspect", "x.tpmc", "--reveal-session-key"]);
    assert_usage(&res, "--reveal-session-key without -i");
    assert!(res.stdout.is_empty());
    recovery(d, "other");
    let res = run(
        d,
        &["inspect", "-i", "other", "--reveal-session-key", "x.tpmc"],
    );
    assert_error(&res, INTEGRITY, "x.tpmc", "reveal with the wrong identity");
    assert!(res.stdout.is_empty());

    // Text form.
    let res = run(
        d,
        &["inspect", "-i", "id", "--reveal-session-key", "x.tpmc"],
    );
    assert_ok(&res, "inspect");
    let text = String::from_utf8(res.stdout).unwrap();
    for needle in [
        "mode:            gcm".to_string(),
        "key bits:        128".to_string(),
        "segment size:    4096".to_string(),
        format!("payload offset:  {offset}"),
        format!("session id:      {sid}"),
        "tink compatible: yes".to_string(),
        format!("recovery-p256  {fp}"),
        format!("session key:     {key}"),
    ] {
        assert!(text.contains(&needle), "{needle:?} not in:\n{text}");
    }
    let res = run(d, &["inspect", "x.tpmc"]);
    assert!(!String::from_utf8(res.stdout)
        .unwrap()
        .contains("session key"));

    // Not Tink-compatible: cbc, and gcm with 192-bit keys.
    for (mode, bits, seg) in [("cbc", "192", "4104"), ("gcm", "192", "4096")] {
        let out = format!("{mode}{bits}.tpmc");
        assert_ok(
            &run(
                d,
                &[
                    "encrypt",
                    "-R",
                    &r,
                    "--mode",
                    mode,
                    "--bits",
                    bits,
                    "--segment-size",
                    seg,
                    "-o",
                    &out,
                    "y",
                ],
            ),
            &out,
        );
        let j = inspect_json(d, &out, &[]);
        assert_eq!(j["mode"], mode);
        assert_eq!(j["key_bits"], 192);
        assert_eq!(j["segment_size"].to_string(), seg);
        assert_eq!(j["tink_compatible"], false);
        let res = run(d, &["inspect", &out]);
        assert!(String::from_utf8(res.stdout)
            .unwrap()
            .contains("tink compatible: no"));
    }

    // Not a tpmcrypt file.
    fs::write(d.join("junk"), b"just some text\n").unwrap();
    let res = run(d, &["inspect", "junk"]);
    assert_error(&res, INTEGRITY, "junk", "inspect junk");
    let res = run(d, &["inspect", "missing"]);
    assert_error(&res, OTHER, "missing", "inspect missing");
}

// ---------------------------------------------------------------- integrity

struct Tampered {
    name: &'static str,
    bytes: Vec<u8>,
    /// Expected in the error message, if anything specific.
    message: Option<&'static str>,
}

/// Damaged copies of `ct`, whose header ends at `offset`, followed by a
/// stream header of `stream_header` bytes; ciphertext segments of `seg`
/// bytes start at `base`.
fn tampered_variants(
    ct: &[u8],
    offset: usize,
    stream_header: usize,
    base: usize,
    seg: usize,
) -> Vec<Tampered> {
    let flip = |at: usize| {
        let mut v = ct.to_vec();
        v[at] ^= 0x01;
        v
    };
    let cut = |len: usize| ct[..len].to_vec();
    let segment = |i: usize| base + i * seg..base + (i + 1) * seg;
    let mut appended = ct.to_vec();
    appended.push(0);
    let mut with_copy = ct.to_vec();
    with_copy.extend_from_slice(&ct[segment(1)]);
    let mut swapped = ct.to_vec();
    swapped[segment(1)].copy_from_slice(&ct[segment(2)]);
    swapped[segment(2)].copy_from_slice(&ct[segment(1)]);
    let t = |name, bytes, message| Tampered {
        name,
        bytes,
        message,
    };
    vec![
        t("magic", flip(0), Some("not a tpmcrypt file")),
        t("version", flip(8), None),
        t("mode byte", flip(9), None),
        t("segment size", flip(13), None),
        t("stanza count", flip(15), None),
        t("stanza body", flip(40), None),
        t("header mac", flip(offset - 1), Some("header")),
        t("stream header length", flip(offset), None),
        t("salt", flip(offset + 3), None),
        t("segment 0", flip(base + seg / 2), Some("segment 0")),
        t(
            "segment 2",
            flip(base + 2 * seg + seg / 2),
            Some("segment 2"),
        ),
        t("last tag byte", flip(ct.len() - 1), None),
        t("empty", Vec::new(), None),
        t("cut in magic", cut(5), None),
        t("cut in header", cut(offset - 1), None),
        t("cut at payload", cut(offset), None),
        t("cut in stream header", cut(offset + 4), None),
        t("cut after stream header", cut(offset + stream_header), None),
        t(
            "cut at segment boundary",
            cut(base + 3 * seg),
            Some("truncated"),
        ),
        t("cut mid segment", cut(base + 3 * seg + 100), None),
        t("cut last byte", cut(ct.len() - 1), None),
        t("appended byte", appended, None),
        t("appended segment", with_copy, None),
        t("swapped segments", swapped, None),
    ]
}

/// Encrypts `plain` in `dir` to `out` with `layout` (4096-byte segments).
/// Returns the ciphertext, where its payload starts, and where segment 0
/// starts (gcm counts the stream header in segment 0; cbc does not).
fn encrypt_4k_segments(dir: &Path, r: &str, layout: &Layout, out: &str) -> (Vec<u8>, usize, usize) {
    assert_eq!(layout.segment, 4096);
    let mode = if layout.cbc { "cbc" } else { "gcm" };
    let bits = (layout.key_len * 8).to_string();
    let args = [
        "encrypt",
        "-R",
        r,
        "--mode",
        mode,
        "--bits",
        &bits,
        "--segment-size",
        "4096",
        "-o",
        out,
        "plain",
    ];
    assert_ok(&run(dir, &args), mode);
    let ct = fs::read(dir.join(out)).unwrap();
    let offset = payload_offset(dir, out);
    let base = if layout.cbc {
        offset + layout.stream_header()
    } else {
        offset
    };
    (ct, offset, base)
}

/// Every kind of damage: exit 3, one `error: <file>:` line, no output under
/// the final name and no temporary left; to stdout, at most an
/// authenticated prefix of the plaintext.
#[test]
fn integrity_failures() {
    let (dir, r) = scratch();
    let d = dir.path();
    recovery(d, "other");
    for (mode, bits) in [("gcm", 256u32), ("cbc", 128)] {
        let seg = 4096;
        let layout = Layout::new(mode, bits, seg);
        let len = layout.plain(0) + 4 * layout.plain(1) + 100; // 6 segments
        let data = bytes(len, 11);
        fs::write(d.join("plain"), &data).unwrap();
        let ct_name = format!("{mode}.tpmc");
        let (ct, offset, base) = encrypt_4k_segments(d, &r, &layout, &ct_name);
        let mut cases = tampered_variants(&ct, offset, layout.stream_header(), base, seg);
        cases.push(Tampered {
            name: "intact, wrong identity",
            bytes: ct.clone(),
            message: Some("no identity matches"),
        });
        cases.push(Tampered {
            name: "not tpmcrypt",
            bytes: b"hello, this is plain text\n".repeat(100),
            message: Some("not a tpmcrypt file"),
        });
        for (i, case) in cases.iter().enumerate() {
            let what = format!("{mode}: {}", case.name);
            let sub = d.join(format!("case-{mode}-{i}"));
            fs::create_dir(&sub).unwrap();
            fs::write(sub.join("bad.tpmc"), &case.bytes).unwrap();
            let id = if case.name.starts_with("intact") {
                "../other"
            } else {
                "../id"
            };
            // File → file (sequential).
            let res = run(&sub, &["decrypt", "-i", id, "bad.tpmc"]);
            assert_error(&res, INTEGRITY, "bad.tpmc", &what);
            if let Some(m) = case.message {
                assert!(
                    res.stderr.contains(m),
                    "{what}: {:?} lacks {m:?}",
                    res.stderr
                );
            }
            // File → -o file.
            let res = run(&sub, &["decrypt", "-i", id, "-o", "out", "bad.tpmc"]);
            assert_error(&res, INTEGRITY, "bad.tpmc", &what);
            assert_eq!(listing(&sub), vec!["bad.tpmc"], "{what}: leftovers");
            // stdin → stdout, parallel: at most an authenticated prefix.
            let res = run_stdin(&sub, &["decrypt", "-i", id, "-j", "2"], &case.bytes);
            assert_error(&res, INTEGRITY, "<stdin>", &what);
            assert!(
                data.starts_with(&res.stdout),
                "{what}: stdout is not a prefix of the plaintext"
            );
            assert!(res.stdout.len() < data.len(), "{what}: everything written");
        }
    }
}

/// Tampering with segment 2: stdout holds exactly segments 0 and 1.
#[test]
fn stdout_stops_before_the_tampered_segment() {
    let (dir, r) = scratch();
    let d = dir.path();
    for (mode, bits) in [("gcm", 128u32), ("cbc", 256)] {
        let layout = Layout::new(mode, bits, 4096);
        let len = layout.plain(0) + 7 * layout.plain(1) + 5;
        let data = bytes(len, 21);
        fs::write(d.join("plain"), &data).unwrap();
        let name = format!("{mode}.tpmc");
        let (mut ct, _, base) = encrypt_4k_segments(d, &r, &layout, &name);
        ct[base + 2 * 4096 + 1000] ^= 0x80;
        fs::write(d.join(&name), &ct).unwrap();
        let expect = &data[..layout.plain(0) + layout.plain(1)];
        for args in [
            vec!["decrypt", "-i", "id", "-o", "-", &name],
            vec!["decrypt", "-i", "id", "-j", "1", "-o", "-", &name],
            vec!["decrypt", "-i", "id", "-j", "2", "-o", "-", &name],
        ] {
            let res = run(d, &args);
            assert_error(&res, INTEGRITY, &name, mode);
            assert!(res.stderr.contains("segment 2"), "{}", res.stderr);
            assert!(
                res.stdout == expect,
                "{mode} {args:?}: {} bytes",
                res.stdout.len()
            );
        }
        for jobs in ["1", "2"] {
            let res = run_stdin(d, &["decrypt", "-i", "id", "-j", jobs], &ct);
            assert_error(&res, INTEGRITY, "<stdin>", mode);
            assert!(
                res.stdout == expect,
                "{mode} stdin -j {jobs}: {}",
                res.stdout.len()
            );
        }
    }
}

// ---------------------------------------------------------------- crashes

/// SIGKILL while writing `-o out.tpmc` from a slow pipe: no `out.tpmc`,
/// and nothing else either (the output had no name yet). The next run to
/// that output removes a temporary a dead process left (as runs on file
/// systems without `O_TMPFILE`, or older versions, leave them), never one
/// of a live process.
#[test]
fn kill_during_encrypt_leaves_no_output() {
    let (dir, r) = scratch();
    let d = dir.path();
    let mut child = tpmcrypt(d)
        .args(["encrypt", "-R", &r, "-o", "out.tpmc"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&bytes(100_000, 1)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let here = d.canonicalize().unwrap();
    while !common::has_a_file_open_in(child.id(), &here) {
        assert!(Instant::now() < deadline, "no output opened");
        std::thread::sleep(Duration::from_millis(5));
    }
    stdin.write_all(&bytes(1000, 2)).unwrap();
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    drop(stdin);
    let before = listing(d);
    assert!(!d.join("out.tpmc").exists());
    assert!(partials(d).is_empty(), "left behind: {before:?}");

    // A temporary of a dead process goes; one of a live process (this
    // one) is left alone.
    let dead = format!(".out.tpmc{PARTIAL_MARKER}2147483646.0123456789abcdef");
    fs::write(d.join(&dead), b"stale").unwrap();
    let live = format!(".out.tpmc{PARTIAL_MARKER}{}.0000", std::process::id());
    fs::write(d.join(&live), b"busy").unwrap();
    let res = run_stdin(d, &["encrypt", "-R", &r, "-o", "out.tpmc"], b"fine");
    assert_ok(&res, "rerun");
    assert_eq!(partials(d), vec![live], "stale temporary not cleaned");
    let res = run(d, &["decrypt", "-i", "id", "-o", "-", "out.tpmc"]);
    assert_ok(&res, "decrypt rerun");
    assert_eq!(res.stdout, b"fine");
}

/// Waits until `path` exists with at least `len` bytes.
fn wait_for_len(path: &Path, len: u64, what: &str) {
    let started = Instant::now();
    while fs::metadata(path).map(|m| m.len()).unwrap_or(0) < len {
        assert!(started.elapsed() < Duration::from_secs(30), "{what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The length of the ciphertext of `data` (for one recipient, default
/// parameters), from a reference run in `d`, whose files it removes.
fn output_len(d: &Path, r: &str, data: &[u8]) -> u64 {
    fs::write(d.join("ref"), data).unwrap();
    assert_ok(&run(d, &["encrypt", "-R", r, "ref"]), "reference run");
    let len = fs::metadata(d.join("ref.tpmc")).unwrap().len();
    fs::remove_file(d.join("ref")).unwrap();
    fs::remove_file(d.join("ref.tpmc")).unwrap();
    len
}

/// The one partial output in `dir`, once it exists: a path to read or
/// measure it by (`/proc/PID/fd/N` while it has no name yet).
fn partial_path(dir: &Path) -> PathBuf {
    let started = Instant::now();
    loop {
        if let Some(name) = partials(dir).into_iter().next() {
            return dir.join(name);
        }
        if let Some(path) = common::unnamed_output_in(dir) {
            return path;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no partial output"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn append(path: &Path, data: &[u8]) {
    fs::OpenOptions::new()
        .append(true)
        .open(path)
        .unwrap()
        .write_all(data)
        .unwrap();
}

/// Starts tpmcrypt under strace, which holds its first `syscall` for
/// `delay_ms` milliseconds: a deterministic pause at a known point of a run.
fn held_at_first(d: &Path, syscall: &str, delay_ms: u64, args: &[&str]) -> std::process::Child {
    common::wrapper(d, "strace")
        .args(["-f", "-qq", "-o", "/dev/null", "-e"])
        .arg(format!("trace={syscall}"))
        .arg("-e")
        .arg(format!(
            "inject={syscall}:delay_enter={}:when=1",
            delay_ms * 1000
        ))
        .arg(common::bin())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("strace (installed by scripts/setup-deps)")
}

/// A regular input that changes while it is read is not taken for what was
/// read: to a file, the output is not kept (and an `--in-place` original is
/// not removed); to stdout, the run fails. Each run is paused mid-read
/// deterministically: stdout by a pipe nobody reads yet, a file output by
/// strace delaying its first write-back call (after 16 MiB).
#[test]
fn input_changed_while_read_is_refused() {
    let (dir, r) = scratch();
    let d = dir.path();
    let data = bytes(40 << 20, 21);

    // To stdout: tpmcrypt blocks on the full pipe after its first segments.
    fs::write(d.join("s"), &data).unwrap();
    let mut child = tpmcrypt(d)
        .args(["encrypt", "-R", &r, "-o", "-", "s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).unwrap(); // the input is open and stamped
    append(d.join("s").as_path(), b"tail");
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let res: Run = child.wait_with_output().unwrap().into();
    assert_error(&res, 1, "s", "stdout, input appended to");
    assert!(
        res.stderr.contains("changed while it was being read"),
        "{}",
        res.stderr
    );

    // To a file, plain and --in-place: nothing kept, the input as it now is.
    for (name, extra) in [("f", None), ("g", Some("--in-place"))] {
        let input = d.join(name);
        fs::write(&input, &data).unwrap();
        let mut args = vec!["encrypt", "-R", &r];
        args.extend(extra);
        args.push(name);
        let child = held_at_first(d, "sync_file_range", 1000, &args);
        wait_for_len(&partial_path(d), 16 << 20, "16 MiB written");
        append(&input, b"tail");
        let res: Run = child.wait_with_output().unwrap().into();
        assert_error(&res, 1, name, &format!("{name}: input appended to"));
        assert!(
            res.stderr.contains("its output was not kept"),
            "{}",
            res.stderr
        );
        let mut now = data.clone();
        now.extend_from_slice(b"tail");
        assert!(fs::read(&input).unwrap() == now, "{name}: input lost");
        assert!(
            !d.join(format!("{name}.tpmc")).exists(),
            "{name}: output kept"
        );
        assert!(partials(d).is_empty(), "{:?}", partials(d));
    }
}

/// `--in-place` removes an original only while it is still the file that
/// was encrypted: one rewritten, or replaced by a rename (as editors save),
/// between the read and the removal is kept, beside the complete output of
/// what was read. strace holds the run in its first fsync (the output's,
/// after the read) while the original changes.
#[test]
fn in_place_keeps_an_original_that_changed_after_the_read() {
    let (dir, r) = scratch();
    let d = dir.path();
    let id_text = fs::read_to_string(d.join("id")).unwrap();
    let old = bytes(3 << 20, 22);
    let new = bytes(1000, 23);
    let full = output_len(d, &r, &old);
    for how in ["rewritten", "renamed-over"] {
        let input = d.join(how);
        fs::write(&input, &old).unwrap();
        let child = held_at_first(d, "fsync", 1500, &["encrypt", "-R", &r, "--in-place", how]);
        wait_for_len(&partial_path(d), full, "the whole output written");
        // Past the read and its check, into the delayed fsync.
        common::wait_in_syscall(child.id(), &[libc::SYS_fsync], how);
        if how == "rewritten" {
            fs::write(&input, &new).unwrap();
        } else {
            fs::write(d.join("next"), &new).unwrap();
            fs::rename(d.join("next"), &input).unwrap();
        }
        let res: Run = child.wait_with_output().unwrap().into();
        assert_error(&res, 1, how, how);
        assert!(
            res.stderr
                .contains("changed or replaced after it was read; kept it"),
            "{how}: {}",
            res.stderr
        );
        assert!(
            fs::read(&input).unwrap() == new,
            "{how}: the new version is gone"
        );
        let ct = d.join(format!("{how}.tpmc"));
        assert!(
            common::decrypt_in_process(&id_text, &ct) == old,
            "{how}: the output is not the version read"
        );
        assert!(partials(d).is_empty(), "{:?}", partials(d));
    }
}

/// Ctrl-C, SIGTERM and SIGHUP remove the temporary at once (it no longer
/// waits for the next run), and the process still ends by that signal:
/// mid-stream (stdin held open) and in `--in-place`'s final fsync (held by
/// strace), where the original must stay.
#[test]
fn interrupt_removes_the_temporary_at_once() {
    use std::os::unix::process::ExitStatusExt;
    let (dir, r) = scratch();
    let d = dir.path();
    let signal = |pid: u32, name: &str| {
        let status = Command::new("kill")
            .args([format!("-{name}"), pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{name}");
    };
    for (name, number) in [("INT", 2), ("TERM", 15), ("HUP", 1)] {
        let mut child = tpmcrypt(d)
            .args(["encrypt", "-R", &r, "-o", "out.tpmc", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(&bytes(3 << 20, 24)).unwrap();
        wait_for_len(&partial_path(d), 1 << 20, "a segment written");
        signal(child.id(), name);
        let status = child.wait().unwrap();
        drop(stdin);
        assert_eq!(status.signal(), Some(number), "SIG{name}: {status}");
        assert!(partials(d).is_empty(), "SIG{name}: {:?}", partials(d));
        assert!(!d.join("out.tpmc").exists(), "SIG{name}: output");
    }

    let data = bytes(3 << 20, 25);
    let full = output_len(d, &r, &data);
    fs::write(d.join("p"), &data).unwrap();
    let child = held_at_first(d, "fsync", 1500, &["encrypt", "-R", &r, "--in-place", "p"]);
    // The whole output is written before its fsync.
    wait_for_len(&partial_path(d), full, "the whole output written");
    let pid = common::child_pids_of(child.id())
        .into_iter()
        .next()
        .expect("tpmcrypt under strace");
    signal(pid, "TERM");
    let res: Run = child.wait_with_output().unwrap().into();
    assert_ne!(res.code, 0, "in place: {}", res.stderr);
    assert!(partials(d).is_empty(), "in place: {:?}", partials(d));
    assert!(
        fs::read(d.join("p")).unwrap() == data,
        "in place: the original"
    );
    assert!(!d.join("p.tpmc").exists(), "in place: output");
}

/// A file name with a newline or a terminal escape sequence is encrypted
/// like any other, and an error about it stays one line with the control
/// characters shown escaped, never sent to the terminal.
#[test]
fn control_characters_in_names_are_escaped_in_errors() {
    let (dir, r) = scratch();
    let d = dir.path();
    let name = "a\nb\u{1b}[31m";
    fs::write(d.join(name), b"odd").unwrap();
    assert_ok(&run(d, &["encrypt", "-R", &r, name]), "odd name");
    let ct = format!("{name}.tpmc");
    assert!(d.join(&ct).exists());
    let res = run(d, &["encrypt", "-R", &r, name]);
    assert_error(&res, 1, "a\\nb\\x1b[31m", "odd name, output exists");
    assert!(
        res.stderr.contains("a\\nb\\x1b[31m.tpmc already exists"),
        "{}",
        res.stderr
    );
    assert!(
        !res.stderr.contains('\u{1b}'),
        "raw escape: {:?}",
        res.stderr
    );
    let res = run(d, &["decrypt", "-i", "id", "-o", "-", &ct]);
    assert_ok(&res, "decrypt odd name");
    assert_eq!(res.stdout, b"odd");
}

/// A name whose `.tpmc` output is just within the 255-byte limit encrypts
/// and decrypts (its temporary is named to fit); one whose output would not
/// fit is refused in one line, with nothing written.
#[test]
fn names_near_the_length_limit() {
    let (dir, r) = scratch();
    let d = dir.path();
    let long = "n".repeat(250);
    fs::write(d.join(&long), b"long name").unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", &r, "--in-place", &long]),
        "250 bytes",
    );
    assert!(d.join(format!("{long}.tpmc")).exists() && !d.join(&long).exists());
    let ct = format!("{long}.tpmc");
    assert_ok(
        &run(d, &["decrypt", "-i", "id", "--in-place", &ct]),
        "decrypt",
    );
    assert_eq!(fs::read(d.join(&long)).unwrap(), b"long name");

    let too_long = "m".repeat(251);
    fs::write(d.join(&too_long), b"x").unwrap();
    let res = run(d, &["encrypt", "-R", &r, &too_long]);
    assert_error(&res, 1, &too_long, "251 bytes");
    assert!(
        res.stderr.contains("creating"),
        "refused before the work: {}",
        res.stderr
    );
    assert!(res.stderr.contains("File name too long"), "{}", res.stderr);
    assert!(partials(d).is_empty());
}

/// `-o DIR` is refused in one line that says why, with or without --force
/// (it used to suggest --force, which cannot replace a directory).
#[test]
fn a_directory_as_output_is_refused() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("a"), b"x").unwrap();
    fs::create_dir(d.join("od")).unwrap();
    for extra in [None, Some("--force")] {
        let mut args = vec!["encrypt", "-R", &r, "-o", "od", "a"];
        args.extend(extra);
        let res = run(d, &args);
        assert_error(&res, 1, "a", "-o DIR");
        assert!(res.stderr.contains("od is a directory"), "{}", res.stderr);
        assert!(!res.stderr.contains("--force"), "{}", res.stderr);
    }
    assert!(fs::read_dir(d.join("od")).unwrap().next().is_none());
    assert!(partials(d).is_empty());
}

/// One input's output may not be another input of the same run: `encrypt
/// --force a a.tpmc` would overwrite a.tpmc before reading it. The run is
/// refused before anything is written, however the names are spelled.
#[test]
fn an_output_that_is_another_input_is_refused() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("a"), b"plain a").unwrap();
    fs::write(d.join("a.tpmc"), b"some other file").unwrap();
    for args in [
        vec!["encrypt", "-R", &r, "--force", "a", "a.tpmc"],
        vec![
            "encrypt",
            "-R",
            &r,
            "--force",
            "--in-place",
            "./a.tpmc",
            "a",
        ],
    ] {
        let res = run(d, &args);
        assert_usage(&res, "output is another input");
        assert!(
            res.stderr.contains("is an input and also the output of"),
            "{}",
            res.stderr
        );
        assert_eq!(fs::read(d.join("a")).unwrap(), b"plain a");
        assert_eq!(fs::read(d.join("a.tpmc")).unwrap(), b"some other file");
        assert_eq!(listing(d).len(), 3, "{:?}", listing(d)); // a, a.tpmc, id
    }
}

/// `-o IN IN` (however spelled) is refused before anything is written:
/// `-o a a` replaced the input with its own ciphertext without `--force`,
/// through a path that did not check the original again, so a version an
/// editor saved during the run was lost. `--in-place` is the way.
#[test]
fn an_output_that_is_its_own_input_is_refused() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("a"), b"plain a").unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", &r, "-o", "x.tpmc", "a"]),
        "x.tpmc",
    );
    let ct = fs::read(d.join("x.tpmc")).unwrap();
    let before = listing(d);
    for args in [
        vec!["encrypt", "-R", &r, "-o", "a", "a"],
        vec!["encrypt", "-R", &r, "-o", "./a", "a"],
        vec!["encrypt", "-R", &r, "--force", "-o", "./a", "a"],
        vec!["encrypt", "-R", &r, "--force", "-o", "a", "./a"],
        vec!["decrypt", "-i", "id", "-o", "x.tpmc", "x.tpmc"],
        vec!["decrypt", "-i", "id", "-f", "-o", "./x.tpmc", "x.tpmc"],
    ] {
        let res = run(d, &args);
        assert_usage(&res, "output is its own input");
        assert!(
            res.stderr.contains("itself") && res.stderr.contains("--in-place"),
            "{args:?}: {}",
            res.stderr
        );
        assert_eq!(fs::read(d.join("a")).unwrap(), b"plain a", "{args:?}");
        assert_eq!(fs::read(d.join("x.tpmc")).unwrap(), ct, "{args:?}");
        assert_eq!(listing(d), before, "{args:?}");
    }
    // Standard input redirected from the output (`-o a - < a`), also
    // with --force.
    for args in [
        vec!["encrypt", "-R", &r, "--force", "-o", "a", "-"],
        vec!["decrypt", "-i", "id", "--force", "-o", "x.tpmc", "-"],
    ] {
        let from = if args[0] == "encrypt" { "a" } else { "x.tpmc" };
        let res: Run = tpmcrypt(d)
            .args(&args)
            .stdin(fs::File::open(d.join(from)).unwrap())
            .output()
            .unwrap()
            .into();
        assert_usage(&res, "stdin is the output");
        assert!(res.stderr.contains("itself"), "{}", res.stderr);
        assert_eq!(fs::read(d.join("a")).unwrap(), b"plain a", "{args:?}");
        assert_eq!(fs::read(d.join("x.tpmc")).unwrap(), ct, "{args:?}");
    }
    // The names of standard output are standard output (they were files:
    // with --force, as root, `/dev/stdout` was replaced; never tried here
    // with --force, which would replace this machine's if it regressed);
    // those of standard input and error are refused.
    for out in ["/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"] {
        let res = run(d, &["encrypt", "-R", &r, "-o", out, "a"]);
        assert_ok(&res, out);
        assert!(res.stdout.starts_with(b"\x89TPMC"), "{out}");
    }
    assert!(fs::symlink_metadata("/dev/stdout")
        .unwrap()
        .file_type()
        .is_symlink());
    for out in ["/dev/stdin", "/dev/stderr", "/proc/self/fd/0"] {
        let res = run(d, &["encrypt", "-R", &r, "-o", out, "a"]);
        assert_usage(&res, out);
        assert!(
            res.stderr.contains("standard input or standard error"),
            "{}",
            res.stderr
        );
    }
    // `-o -` is standard output, also for an input named `-`.
    fs::write(d.join("-"), b"dash").unwrap();
    let res = run(d, &["encrypt", "-R", &r, "-o", "-", "./-"]);
    assert_ok(&res, "-o - of ./-");
    assert!(
        res.stdout.starts_with(b"\x89TPMC"),
        "{:?}",
        &res.stdout[..8]
    );
    assert_eq!(fs::read(d.join("-")).unwrap(), b"dash");
}

/// `encrypt --in-place` refuses a file with other hard links (removing one
/// name would leave the plaintext under the others); `decrypt --in-place`
/// of a linked ciphertext is fine.
#[test]
fn in_place_encryption_refuses_hard_linked_files() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("f"), b"secret").unwrap();
    fs::hard_link(d.join("f"), d.join("g")).unwrap();
    let res = run(d, &["encrypt", "-R", &r, "--in-place", "f"]);
    assert_error(&res, 1, "f", "hard-linked original");
    assert!(res.stderr.contains("has 2 hard links"), "{}", res.stderr);
    assert_eq!(fs::read(d.join("f")).unwrap(), b"secret");
    assert_eq!(fs::read(d.join("g")).unwrap(), b"secret");
    assert!(!d.join("f.tpmc").exists());
    assert!(partials(d).is_empty());

    fs::remove_file(d.join("g")).unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", &r, "--in-place", "f"]),
        "one link",
    );
    fs::hard_link(d.join("f.tpmc"), d.join("copy.tpmc")).unwrap();
    let res = run(d, &["decrypt", "-i", "id", "--in-place", "f.tpmc"]);
    assert_ok(&res, "decrypt a linked ciphertext in place");
    assert_eq!(fs::read(d.join("f")).unwrap(), b"secret");
    assert!(!d.join("f.tpmc").exists() && d.join("copy.tpmc").exists());
}

/// SIGKILL at random moments of `--in-place` over many files, which are
/// committed as one batch (synced together, renamed, then originals
/// removed): every file is there as plaintext or as ciphertext that
/// decrypts to it, never neither; a kill can land while outputs wait under
/// temporary names, between the renames, or between the removals of the
/// originals; and the next run leaves no temporary behind.
#[test]
fn kill_during_in_place_never_loses_a_file() {
    let (dir, r) = scratch();
    let d = dir.path();
    let id_text = fs::read_to_string(d.join("id")).unwrap();
    let decrypt_in_process = |path: &Path| common::decrypt_in_process(&id_text, path);

    const FILES: usize = 200;
    let mut rng = Rng(0x5eed_1234_abcd);
    let mut delay = KillDelay::new(20, 2, 2000);
    let (mut interrupted, mut trials) = (0, 0);
    let want = common::kill_trials();
    while trials < want || (interrupted == 0 && trials < 2 * want) {
        trials += 1;
        let trial = d.join(format!("t{trials}"));
        fs::create_dir(&trial).unwrap();
        let mut names = Vec::with_capacity(FILES);
        for i in 0..FILES {
            let name = format!("f{i:03}");
            fs::write(trial.join(&name), bytes(4096, (trials * 1000 + i) as u64)).unwrap();
            names.push(name);
        }
        // Alternate: usually encrypt, sometimes decrypt, in place.
        let decrypting = trials % 4 == 0;
        if decrypting {
            let mut args = vec!["encrypt", "-R", &r, "--in-place"];
            args.extend(names.iter().map(String::as_str));
            assert_ok(&run(&trial, &args), "setup");
        }
        let cts: Vec<String> = names.iter().map(|n| format!("{n}.tpmc")).collect();
        let mut args: Vec<&str> = if decrypting {
            let mut a = vec!["decrypt", "-i", "../id", "--in-place"];
            a.extend(cts.iter().map(String::as_str));
            a
        } else {
            let mut a = vec!["encrypt", "-R", &r, "--in-place"];
            a.extend(names.iter().map(String::as_str));
            a
        };
        args.push("-q");
        let mut cmd = tpmcrypt(&trial);
        if trials % 2 == 1 {
            // Batches of about ten files (the open files are shared out
            // among them), so that the kill lands among chained commits:
            // one batch named while the one before loses its originals.
            use std::os::unix::process::CommandExt as _;
            // SAFETY: only setrlimit, async-signal-safe, between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    let lim = libc::rlimit {
                        rlim_cur: 96,
                        rlim_max: 96,
                    };
                    match libc::setrlimit(libc::RLIMIT_NOFILE, &lim) {
                        0 => Ok(()),
                        _ => Err(std::io::Error::last_os_error()),
                    }
                });
            }
        }
        let mut child = cmd
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let wait = 1 + delay.pick(&mut rng);
        std::thread::sleep(Duration::from_millis(wait));
        let _ = child.kill();
        child.wait().unwrap();

        let mut done = 0;
        let mut both = 0;
        let temporaries = common::listing(&trial)
            .iter()
            .filter(|n| n.contains(".tpmcrypt-partial."))
            .count();
        for (i, name) in names.iter().enumerate() {
            let original = bytes(4096, (trials * 1000 + i) as u64);
            let plain = trial.join(name);
            let ct = trial.join(format!("{name}.tpmc"));
            let (has_plain, has_ct) = (plain.exists(), ct.exists());
            assert!(
                has_plain || has_ct,
                "trial {trials}: {name} lost (neither plaintext nor ciphertext)"
            );
            if has_plain {
                assert!(
                    fs::read(&plain).unwrap() == original,
                    "trial {trials}: {name} plaintext differs"
                );
            }
            if has_ct {
                assert!(
                    decrypt_in_process(&ct) == original,
                    "trial {trials}: {name}.tpmc does not decrypt to the original"
                );
            }
            if (has_ct && !decrypting) || (has_plain && decrypting) {
                done += 1;
            }
            if has_ct && has_plain {
                both += 1;
            }
        }
        // Adapt the delay so that kills land mid-run: while outputs wait
        // under temporary names, between renames (an output beside its
        // original), or between removals of originals.
        if done == FILES && both == 0 && temporaries == 0 {
            delay.finished();
        } else if done == 0 && both == 0 && temporaries == 0 {
            delay.not_begun();
        } else {
            interrupted += 1;
        }
        // The next run cleans up what the killed one left.
        let again: Vec<&str> = if decrypting {
            vec!["decrypt", "-i", "../id", "--in-place", "-r", "-q", "."]
        } else {
            vec!["encrypt", "-R", &r, "--in-place", "-r", "-q", "."]
        };
        let _ = run(&trial, &again);
        let left: Vec<String> = common::listing(&trial)
            .into_iter()
            .filter(|n| n.contains(".tpmcrypt-partial."))
            .collect();
        assert!(
            left.is_empty(),
            "trial {trials}: temporaries left: {left:?}"
        );
        fs::remove_dir_all(&trial).unwrap();
    }
    eprintln!(
        "{trials} trials, {interrupted} killed mid-run, last delay bound {} ms",
        delay.bound
    );
    assert!(
        interrupted > 0,
        "no kill landed in the middle of a run in {trials} trials"
    );
}

// ---------------------------------------------------------------- usage

/// An environment variable set but empty counts as unset, as for
/// `XDG_DATA_HOME` (a shell's `TPMCRYPT_HOME=` or a unit's `Environment=`
/// with nothing after it): it made every command a usage error, even one
/// given `--keystore`. An empty value given on the command line is still
/// an error: `--keystore "$KS"` with `KS` unset must not fall back to the
/// default keystore.
#[test]
fn an_empty_environment_variable_counts_as_unset() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("p"), b"secret").unwrap();
    let ks = d.join("ks");
    let ks = ks.to_str().unwrap();
    // `args` with `var` set to `value`.
    let with = |var: &str, value: &Path, args: &[&str]| -> Run {
        tpmcrypt(d)
            .env(var, value)
            .args(args)
            .output()
            .unwrap()
            .into()
    };
    let empty = Path::new("");
    for var in ["TPMCRYPT_HOME", "TPMCRYPT_SIMULATOR", "TPMCRYPT_TCTI"] {
        let res = with(var, empty, &["--keystore", ks, "key", "list"]);
        assert_eq!(res.code, 0, "{var}= with --keystore: {}", res.stderr);
        let res = with(var, empty, &["encrypt", "-R", &r, "p"]);
        assert_eq!(res.code, 0, "{var}= encrypt: {}", res.stderr);
        fs::remove_file(d.join("p.tpmc")).unwrap();
    }
    // TPMCRYPT_HOME= is the default keystore, in $XDG_DATA_HOME.
    let mut cmd = tpmcrypt(d);
    cmd.env("TPMCRYPT_HOME", "")
        .env("XDG_DATA_HOME", d.join("xdg"));
    let res: Run = cmd.args(["key", "list"]).output().unwrap().into();
    assert_eq!(res.code, 0, "TPMCRYPT_HOME= key list: {}", res.stderr);
    assert!(
        res.stderr
            .contains(&*d.join("xdg/tpmcrypt").to_string_lossy()),
        "the default keystore: {:?}",
        res.stderr
    );
    let res = run(d, &["--keystore", "", "key", "list"]);
    assert_usage(&res, "--keystore ''");
}

/// A relative `TPMCRYPT_HOME` (a space, a `~` no shell expanded) made a
/// keystore in each working directory: `key create` put a key under
/// `./ /`. It is a usage error, before anything is read or made; a
/// relative `--keystore` typed on the command line is still a path like
/// any other.
#[test]
fn a_relative_tpmcrypt_home_is_refused() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("p"), b"secret").unwrap();
    for home in [" ", "~/keys", "keys"] {
        for args in [
            vec!["key", "list"],
            vec!["recovery", "create", "--out", "rk"],
            vec!["encrypt", "-R", &r, "p"],
        ] {
            let before = listing(d);
            let res: Run = tpmcrypt(d)
                .env("TPMCRYPT_HOME", home)
                .args(&args)
                .output()
                .unwrap()
                .into();
            assert_usage(&res, &format!("TPMCRYPT_HOME={home:?} {args:?}"));
            assert!(
                res.stderr.contains("TPMCRYPT_HOME is not an absolute path"),
                "{home:?}: {}",
                res.stderr
            );
            assert_eq!(listing(d), before, "{home:?} {args:?} made something");
        }
    }
    let res = run(d, &["--keystore", "rel", "key", "list"]);
    assert_eq!(res.code, 0, "a relative --keystore: {}", res.stderr);
    // --keystore overrides the variable, which is then not used at all.
    let ks = d.join("ks");
    let res: Run = tpmcrypt(d)
        .env("TPMCRYPT_HOME", "keys")
        .args(["--keystore", ks.to_str().unwrap(), "key", "list"])
        .output()
        .unwrap()
        .into();
    assert_eq!(
        res.code, 0,
        "--keystore beside a relative TPMCRYPT_HOME: {}",
        res.stderr
    );
}

#[test]
fn usage_errors_and_help() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::write(d.join("p"), b"x").unwrap();
    for (what, args) in [
        (
            "unknown flag",
            vec!["encrypt", "--frobnicate", "-R", &r, "p"],
        ),
        ("unknown subcommand", vec!["frobnicate"]),
        ("encrypt without -R", vec!["encrypt", "p"]),
        ("decrypt without -i", vec!["decrypt", "p.tpmc"]),
        ("bad mode", vec!["encrypt", "-R", &r, "--mode", "ecb", "p"]),
        ("bad bits", vec!["encrypt", "-R", &r, "--bits", "512", "p"]),
        (
            "tiny segments",
            vec!["encrypt", "-R", &r, "--segment-size", "10", "p"],
        ),
        (
            "huge segments",
            vec!["encrypt", "-R", &r, "--segment-size", "4000000000", "p"],
        ),
        (
            "cbc segment not whole blocks",
            vec![
                "encrypt",
                "-R",
                &r,
                "--mode",
                "cbc",
                "--segment-size",
                "4100",
                "p",
            ],
        ),
        ("bad -j", vec!["encrypt", "-R", &r, "-j", "many", "p"]),
        ("completions for no shell", vec!["completions", "nosh"]),
    ] {
        let res = run(d, &args);
        assert_usage(&res, what);
        assert!(res.stdout.is_empty(), "{what}: stdout {:?}", res.stdout);
    }
    assert!(!d.join("p.tpmc").exists());

    // A bare `tpmcrypt`: exit 2 and the subcommands on stderr (as the help
    // when nothing at all is set, as one error line when the environment
    // sets an option, as in these tests).
    let res = run(d, &[]);
    assert_eq!(res.code, USAGE, "no subcommand: {}", res.stderr);
    assert!(
        res.stderr.contains("encrypt, decrypt") || res.stderr.contains("Usage: tpmcrypt"),
        "no subcommand: {}",
        res.stderr
    );
    assert!(res.stdout.is_empty());

    let res = run(d, &["completions", "bash"]);
    assert_ok(&res, "completions bash");
    let text = String::from_utf8(res.stdout).unwrap();
    assert!(
        text.contains("tpmcrypt") && text.contains("encrypt"),
        "{text}"
    );
    let res = run(d, &["--help"]);
    assert_ok(&res, "--help");
    let text = String::from_utf8(res.stdout).unwrap();
    for sub in ["encrypt", "decrypt", "inspect", "recovery", "completions"] {
        assert!(text.contains(sub), "--help lacks {sub}");
    }
    let res = run(d, &["encrypt", "--help"]);
    assert_ok(&res, "encrypt --help");
    let text = String::from_utf8(res.stdout).unwrap();
    assert!(
        text.contains("--recipient") && text.contains("--mode"),
        "{text}"
    );
    assert!(!text.contains("segment-size"), "hidden flag shown: {text}");
    let res = run(d, &["--version"]);
    assert_ok(&res, "--version");
    assert!(String::from_utf8(res.stdout)
        .unwrap()
        .starts_with("tpmcrypt "));
}

/// Many small files run on several workers at once, but their error lines
/// come in the order of the files, one per file, every time.
#[test]
fn files_in_parallel_report_in_order() {
    let (dir, r) = scratch();
    let d = dir.path();
    let tree = d.join("tree");
    fs::create_dir(&tree).unwrap();
    for i in 0..300 {
        fs::write(tree.join(format!("f{i:03}")), bytes(2000 + i, i as u64)).unwrap();
    }
    for round in 0..3 {
        let taken = [40 + round, 150 + round, 260 + round];
        for i in taken {
            fs::write(tree.join(format!("f{i:03}.tpmc")), b"taken").unwrap();
        }
        let mut args = vec!["encrypt", "-R", &r, "-j", "2", "-q"];
        let names: Vec<String> = (0..300).map(|i| format!("tree/f{i:03}")).collect();
        args.extend(names.iter().map(String::as_str));
        for i in 0..300 {
            let _ = fs::remove_file(tree.join(format!("f{i:03}.tpmc")));
        }
        for i in taken {
            fs::write(tree.join(format!("f{i:03}.tpmc")), b"taken").unwrap();
        }
        let res = run(d, &args);
        assert_eq!(res.code, 1, "{}", res.stderr);
        let lines: Vec<&str> = res.stderr.lines().collect();
        let want: Vec<String> = taken
            .iter()
            .map(|i| format!("error: tree/f{i:03}: creating tree/f{i:03}.tpmc: tree/f{i:03}.tpmc already exists"))
            .collect();
        assert_eq!(lines.len(), 3, "{lines:?}");
        for (line, want) in lines.iter().zip(&want) {
            assert!(
                line.starts_with(want.as_str()),
                "round {round}: {line:?}, want {want:?}"
            );
        }
        for i in (0..300).filter(|i| !taken.contains(i)) {
            assert!(tree.join(format!("f{i:03}.tpmc")).exists(), "f{i:03}");
        }
    }
}

/// `-v` says where a run's time went: the whole run, files/s, the wait for
/// durability; with a TPM identity also the time spent with the TPM.
#[test]
fn verbose_reports_the_split_of_the_run() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::create_dir(d.join("t")).unwrap();
    for i in 0..50 {
        fs::write(d.join(format!("t/f{i}")), bytes(1000, i)).unwrap();
    }
    let res = run(d, &["-v", "encrypt", "-R", &r, "-r", "t"]);
    assert_ok(&res, "encrypt -v");
    let split = res
        .stderr
        .lines()
        .find(|l| l.contains("files/s"))
        .unwrap_or_else(|| panic!("no split line: {}", res.stderr));
    let secs: f64 = split
        .strip_prefix("tpmcrypt: ")
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{split}"));
    assert!(secs > 0.0, "{split}");
    assert!(split.contains("committing (sync, rename"), "{split}");
    // The wall-clock split adds up, and the engine's own figures are there:
    // AES as CPU time over its threads, read and write time.
    let wall = res
        .stderr
        .lines()
        .find(|l| l.starts_with("tpmcrypt: wall "))
        .unwrap_or_else(|| panic!("no wall split line: {}", res.stderr));
    let figures: Vec<f64> = wall
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|w| w.parse().ok())
        .collect();
    // wall T s = setup + unwrap + files + commit + other (ms).
    assert!(figures.len() >= 6, "{wall}");
    let parts: f64 = figures[1..6].iter().sum();
    assert!(
        (parts - figures[0] * 1e3).abs() <= 2.0,
        "the parts {parts} ms do not add up to the wall time: {wall}"
    );
    let engine = res
        .stderr
        .lines()
        .find(|l| l.contains(" cpu over "))
        .unwrap_or_else(|| panic!("no engine split line: {}", res.stderr));
    for word in ["aes ", "read ", "write "] {
        assert!(engine.contains(word), "{word:?} missing: {engine}");
    }
}

/// `--stats-json FILE` writes the run's figures as JSON.
#[test]
fn stats_json_gives_the_figures_of_the_run() {
    let (dir, r) = scratch();
    let d = dir.path();
    fs::create_dir(d.join("t")).unwrap();
    for i in 0..20 {
        fs::write(d.join(format!("t/f{i}")), bytes(3000, i)).unwrap();
    }
    let res = run(
        d,
        &[
            "encrypt",
            "-R",
            &r,
            "-r",
            "--in-place",
            "--stats-json",
            "enc.json",
            "t",
        ],
    );
    assert_ok(&res, "encrypt");
    let v: serde_json::Value =
        serde_json::from_slice(&fs::read(d.join("enc.json")).unwrap()).unwrap();
    assert_eq!(v["command"], "encrypt");
    assert_eq!(v["files_ok"], 20);
    assert_eq!(v["bytes"], 60_000);
    assert_eq!(v["session"], "own");
    assert!(v["seconds"].as_f64().unwrap() > 0.0);
    assert!(v["commit_seconds"].as_f64().unwrap() >= 0.0);
    assert_split_is_consistent(&v);
    let res = run(
        d,
        &[
            "decrypt",
            "-i",
            "id",
            "-r",
            "--in-place",
            "--stats-json",
            "dec.json",
            "t",
        ],
    );
    assert_ok(&res, "decrypt");
    let v: serde_json::Value =
        serde_json::from_slice(&fs::read(d.join("dec.json")).unwrap()).unwrap();
    assert_eq!(v["command"], "decrypt");
    assert_eq!(v["files_ok"], 20);
    assert_eq!(v["session_key_unwraps"], 1);
    assert_eq!(v["tpm_unbinds"], 0);
    assert_split_is_consistent(&v);
    // One unwrap with the recovery key: some time, less than the run.
    let unwrap = v["wall_ms"]["unwrap"].as_f64().unwrap();
    assert!(unwrap > 0.0 && unwrap < v["wall_ms"]["total"].as_f64().unwrap());
}

/// The split of a non-empty run in `--stats-json`: AES, read and write
/// time from the engine, and a wall-clock split whose parts add up.
fn assert_split_is_consistent(v: &serde_json::Value) {
    let num = |key: &str| {
        v[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing or not a number: {v}"))
    };
    let wall = |key: &str| {
        v["wall_ms"][key]
            .as_f64()
            .unwrap_or_else(|| panic!("wall_ms.{key} missing: {v}"))
    };
    let total = wall("total");
    assert!((total - num("seconds") * 1e3).abs() < 1.0, "{v}");
    let parts: Vec<f64> = ["setup", "unwrap", "files", "commit", "other"]
        .iter()
        .map(|k| wall(k))
        .collect();
    assert!(parts.iter().all(|&p| p >= 0.0), "{v}");
    let sum: f64 = parts.iter().sum();
    assert!(
        sum <= total + 1.0 && sum >= total - 1.0,
        "{sum} vs {total}: {v}"
    );
    assert!(
        (wall("commit") - num("commit_seconds") * 1e3).abs() < 0.01,
        "{v}"
    );
    // The engine's figures: CPU time summed over its threads, so AES is
    // bounded by the threads times the wall time of the files part.
    assert!(num("aes_cpu_ms") > 0.0, "{v}");
    assert!(num("read_ms") > 0.0 && num("write_ms") > 0.0, "{v}");
    let threads = num("aes_threads");
    assert!(threads >= 1.0, "{v}");
    assert!(num("aes_cpu_ms") <= threads * wall("files") + 1.0, "{v}");
    assert!(num("segments") >= v["files_ok"].as_f64().unwrap(), "{v}");
}

/// `--stats-json` never takes the place of a run's data: a path that is an
/// input, an output, or inside a tree walked with `-r` is a usage error
/// before any work (the data untouched); a path that exists and is not a
/// regular file this user owns (a device, a FIFO, a symlink, another
/// user's file) is refused, never renamed over. `-`, `/dev/stdout` and
/// `/dev/stderr` are written to, unless standard output carries the data.
#[test]
fn stats_json_never_replaces_data_or_a_special_file() {
    use std::os::unix::fs::FileTypeExt as _;
    let (dir, r) = scratch();
    let d = dir.path();
    let refused = |res: &Run, what: &str| {
        common::assert_error_line(res, USAGE, None, &["--stats-json"], what);
    };
    fs::write(d.join("x"), b"precious").unwrap();
    assert_ok(&run(d, &["encrypt", "-R", &r, "x"]), "encrypt x");
    fs::remove_file(d.join("x")).unwrap();
    let ct = fs::read(d.join("x.tpmc")).unwrap();
    // The only ciphertext, as the input.
    let res = run(
        d,
        &["decrypt", "-i", "id", "x.tpmc", "--stats-json", "x.tpmc"],
    );
    refused(&res, "the input");
    assert!(fs::read(d.join("x.tpmc")).unwrap() == ct, "the input lost");
    assert!(!d.join("x").exists(), "work was done");
    // An output: of -o, of the naming rule, in a walked tree.
    fs::create_dir(d.join("t")).unwrap();
    fs::write(d.join("t/y"), b"precious2").unwrap();
    let res = run(
        d,
        &[
            "encrypt",
            "-R",
            &r,
            "-o",
            "o.tpmc",
            "t/y",
            "--stats-json",
            "o.tpmc",
        ],
    );
    refused(&res, "the -o output");
    assert!(!d.join("o.tpmc").exists());
    for stats in [
        "t/y.tpmc",
        "./t/y.tpmc",
        "t/stats.json",
        "t/sub/../stats.json",
    ] {
        fs::create_dir_all(d.join("t/sub")).unwrap();
        let res = run(
            d,
            &[
                "encrypt",
                "-R",
                &r,
                "-r",
                "--in-place",
                "t",
                "--stats-json",
                stats,
            ],
        );
        refused(&res, stats);
        assert_eq!(fs::read(d.join("t/y")).unwrap(), b"precious2", "{stats}");
        assert_eq!(listing(&d.join("t")), ["sub", "y"], "{stats}");
    }
    // Not a regular file of this user's: a device, a FIFO, a symlink.
    fs::create_dir(d.join("devx")).unwrap();
    let c = |p: &str| std::ffi::CString::new(d.join(p).to_str().unwrap()).unwrap();
    // SAFETY: valid NUL-terminated paths.
    unsafe {
        assert_eq!(
            libc::mknod(
                c("devx/null").as_ptr(),
                libc::S_IFCHR | 0o666,
                libc::makedev(1, 3)
            ),
            0,
            "mknod (needs root, as CI runs the tests)"
        );
        assert_eq!(libc::mkfifo(c("devx/fifo").as_ptr(), 0o600), 0);
    }
    symlink("elsewhere.json", d.join("devx/link")).unwrap();
    fs::write(d.join("p"), b"plain").unwrap();
    for (stats, what) in [
        ("devx/null", "a device"),
        ("devx/fifo", "a FIFO"),
        ("devx/link", "a symlink"),
    ] {
        let res = run(
            d,
            &["encrypt", "-R", &r, "-o", "-", "p", "--stats-json", stats],
        );
        refused(&res, what);
    }
    let ft = |p: &str| fs::symlink_metadata(d.join(p)).unwrap().file_type();
    assert!(ft("devx/null").is_char_device(), "the device was replaced");
    assert!(ft("devx/fifo").is_fifo(), "the FIFO was replaced");
    assert!(ft("devx/link").is_symlink(), "the symlink was replaced");
    // Standard output: when it is not the data's.
    let res = run(
        d,
        &[
            "encrypt",
            "-R",
            &r,
            "-o",
            "p.tpmc",
            "p",
            "--stats-json",
            "-",
        ],
    );
    assert_ok(&res, "--stats-json -");
    let v: Value = serde_json::from_slice(&res.stdout).expect("JSON on stdout");
    assert_eq!(v["files_ok"], 1);
    assert!(!d.join("-").exists(), "a file named -");
    for stats in ["-", "/dev/stdout"] {
        let res = run(
            d,
            &["encrypt", "-R", &r, "-o", "-", "p", "--stats-json", stats],
        );
        refused(&res, &format!("{stats} with the data on stdout"));
        assert!(res.stdout.is_empty(), "{stats}: work was done");
    }
    let res = run(
        d,
        &[
            "encrypt",
            "-R",
            &r,
            "-f",
            "p",
            "--stats-json",
            "/dev/stderr",
        ],
    );
    assert_ok(&res, "--stats-json /dev/stderr");
    let v: Value = serde_json::from_str(&res.stderr).expect("JSON on stderr");
    assert_eq!(v["command"], "encrypt");
    // An existing regular file of this user's that is no input or output
    // is replaced if it is empty (mktemp) or figures of an earlier run;
    // any other file is not: someone's data, or a file the run reads its
    // keys, PIN or recipients from (each was replaced by the JSON before).
    fs::write(d.join("stats.json"), b"").unwrap();
    for round in 0..2 {
        let res = run(
            d,
            &["encrypt", "-R", &r, "-f", "p", "--stats-json", "stats.json"],
        );
        assert_ok(&res, &format!("replacing stats.json, round {round}"));
        let v: Value = serde_json::from_slice(&fs::read(d.join("stats.json")).unwrap()).unwrap();
        assert_eq!(v["files_ok"], 1);
    }
    fs::write(d.join("notes.txt"), b"old notes").unwrap();
    fs::write(d.join("pin"), b"1234\n").unwrap();
    common::chmod(&d.join("pin"), 0o600);
    fs::write(d.join("recipients"), format!("{r}\n")).unwrap();
    let id = fs::read(d.join("id")).unwrap();
    for (args, file) in [
        (vec!["encrypt", "-R", &r, "-f", "p"], "notes.txt"),
        (vec!["encrypt", "-R", "recipients", "-f", "p"], "recipients"),
        (vec!["decrypt", "-i", "id", "-f", "p.tpmc"], "id"),
        (
            vec!["--pin-file", "pin", "decrypt", "-i", "id", "-f", "p.tpmc"],
            "pin",
        ),
    ] {
        let before = fs::read(d.join(file)).unwrap();
        let mut args = args.clone();
        args.extend(["--stats-json", file]);
        let res = run(d, &args);
        common::assert_error_line(&res, USAGE, None, &["--stats-json", "refusing"], file);
        assert_eq!(fs::read(d.join(file)).unwrap(), before, "{file} replaced");
    }
    assert_eq!(fs::read(d.join("id")).unwrap(), id);
    // Checked again when the figures are written: a key moved onto the
    // name during the run is left as it is (the run held open by its
    // standard input meanwhile).
    fs::write(d.join("late.json"), b"").unwrap();
    let mut child = tpmcrypt(d)
        .args([
            "encrypt",
            "-R",
            &r,
            "-o",
            "late.tpmc",
            "-",
            "--stats-json",
            "late.json",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    std::io::Write::write_all(&mut stdin, b"some data").unwrap();
    // Its output is open: the checks made at start are behind it.
    let here = d.canonicalize().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !common::has_a_file_open_in(child.id(), &here) {
        assert!(Instant::now() < deadline, "no output opened");
        std::thread::sleep(Duration::from_millis(5));
    }
    fs::rename(d.join("id"), d.join("late.json")).unwrap();
    drop(stdin);
    let late: Run = child.wait_with_output().unwrap().into();
    assert_eq!(
        fs::read(d.join("late.json")).unwrap(),
        id,
        "the key was replaced"
    );
    common::assert_error_line(
        &late,
        1,
        None,
        &["--stats-json", "changed during the run"],
        "late",
    );
    fs::rename(d.join("late.json"), d.join("id")).unwrap();
    // Its directory must exist: checked before any work, like the rest.
    fs::remove_file(d.join("p.tpmc")).unwrap();
    let res = run(
        d,
        &[
            "encrypt",
            "-R",
            &r,
            "p",
            "--stats-json",
            "no/such/dir/s.json",
        ],
    );
    common::assert_error_line(
        &res,
        USAGE,
        None,
        &["no/such/dir", "does not exist"],
        "no dir",
    );
    assert!(!d.join("p.tpmc").exists(), "work was done");
    // Nor a file for a directory, nor a name that ends with a slash.
    for (stats, why) in [("p/s.json", "not a directory"), ("nodir/", "ends with /")] {
        let res = run(d, &["encrypt", "-R", &r, "p", "--stats-json", stats]);
        common::assert_error_line(&res, USAGE, None, &[why], stats);
        assert!(!d.join("p.tpmc").exists(), "{stats}: work was done");
    }
    fs::write(d.join("theirs.json"), b"theirs").unwrap();
    std::os::unix::fs::lchown(d.join("theirs.json"), Some(65534), Some(65534)).unwrap();
    let res = run(
        d,
        &[
            "encrypt",
            "-R",
            &r,
            "-f",
            "p",
            "--stats-json",
            "theirs.json",
        ],
    );
    refused(&res, "another user's file");
    assert_eq!(fs::read(d.join("theirs.json")).unwrap(), b"theirs");
}

/// `-j` and `--workers` outside 1..=1024 are a usage error, at once. A
/// number near the largest integer used to hang a run over a file of
/// several segments (the engine's count of buffers wrapped around), and
/// `-j 0` was taken as one worker.
#[test]
fn a_worker_count_out_of_range_is_a_usage_error() {
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    let recipient = recovery(d, "id.key");
    fs::write(d.join("big"), bytes(3 << 20, 5)).unwrap();
    for (args, what) in [
        (
            vec![
                "encrypt",
                "-j",
                "18446744073709551615",
                "-R",
                &recipient,
                "-o",
                "-",
                "big",
            ],
            "encrypt -j 2^64-1",
        ),
        (
            vec!["encrypt", "-j", "0", "-R", &recipient, "-o", "-", "big"],
            "encrypt -j 0",
        ),
        (
            vec!["decrypt", "-j", "1025", "-i", "id.key", "-o", "-", "big"],
            "decrypt -j 1025",
        ),
        (vec!["rekey", "-j", "99999", "big"], "rekey -j 99999"),
        (
            vec!["watch", "--workers", "0", "src", "dst"],
            "watch --workers 0",
        ),
    ] {
        let out = common::wrapper(d, "timeout")
            .arg("30")
            .arg(common::bin())
            .args(&args)
            .output()
            .expect("timeout");
        let r: Run = out.into();
        assert_eq!(
            r.code, USAGE,
            "{what}: exit {}; stderr {}",
            r.code, r.stderr
        );
        assert!(
            r.stderr.contains("from 1 to 1024"),
            "{what}: stderr {:?}",
            r.stderr
        );
        assert!(r.stdout.is_empty(), "{what}: wrote to stdout");
    }
    let r = run(
        d,
        &[
            "encrypt", "-j", "1024", "-R", &recipient, "-o", "big.tpmc", "big",
        ],
    );
    assert_ok(&r, "encrypt -j 1024");
}

/// Workers of a large file that wait for a spare buffer (the worker whose
/// turn it is to write is held up, here by a busy process on the one CPU
/// the run may use) sleep until one is freed: they do not yield the CPU in
/// a loop. The build before waited with a channel's timed receive, which
/// spun and called `sched_yield` (211 times here; 18,000 in a 1 GiB
/// decrypt, where on such a CPU it made the run up to five times slower).
#[test]
fn workers_waiting_for_a_buffer_do_not_spin() {
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    let recipient = recovery(d, "id.key");
    let plain = bytes(24 << 20, 8);
    fs::write(d.join("big"), &plain).unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", &recipient, "-o", "big.tpmc", "big"]),
        "encrypt",
    );
    let mut hog = common::wrapper(d, "taskset")
        .args(["-c", "0", "sh", "-c", "while :; do :; done"])
        .spawn()
        .expect("taskset");
    let log = d.join("yield.log");
    let out = common::wrapper(d, "taskset")
        .args([
            "-c",
            "0",
            "strace",
            "-f",
            "-qq",
            "-e",
            "trace=sched_yield",
            "-o",
        ])
        .arg(&log)
        .arg(common::bin())
        .args(["decrypt", "-j", "4", "-i", "id.key", "-o", "-", "big.tpmc"])
        .output()
        .expect("taskset and strace (installed by scripts/setup-deps)");
    let _ = hog.kill();
    let _ = hog.wait();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stdout == plain, "decrypted output differs");
    let yields = fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter(|l| l.contains("sched_yield"))
        .count();
    assert_eq!(yields, 0, "the workers yielded the CPU {yields} times");
}

/// A pipe on standard output (encrypt -o -, decrypt -o -) or input
/// (decrypt of `-`) is grown to hold a whole segment, 1 MiB where the
/// system allows that much (`fs.pipe-max-size`), so that a segment is not
/// passed on in 16 turns of 64 KiB; the data is the same.
#[test]
fn pipes_on_stdin_and_stdout_are_grown_to_a_segment() {
    use std::os::fd::AsRawFd as _;
    let (dir, r) = scratch();
    let d = dir.path();
    let max: i32 = fs::read_to_string("/proc/sys/fs/pipe-max-size")
        .expect("fs.pipe-max-size")
        .trim()
        .parse()
        .expect("a number");
    let want = max.min(1 << 20);
    assert!(
        want > 65536,
        "fs.pipe-max-size is {max}: nothing to grow to"
    );
    let pipe_size = |fd: i32| unsafe { libc::fcntl(fd, libc::F_GETPIPE_SZ) };
    let data = bytes(3 << 20, 5);
    fs::write(d.join("plain"), &data).expect("write");
    let mut enc = tpmcrypt(d)
        .args(["encrypt", "-q", "-R", &r, "-o", "-", "plain"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn encrypt");
    let mut out = enc.stdout.take().expect("stdout");
    let mut ct = Vec::new();
    out.read_to_end(&mut ct).expect("read");
    assert!(enc.wait().expect("wait").success());
    assert_eq!(pipe_size(out.as_raw_fd()), want, "encrypt's stdout");

    let mut dec = tpmcrypt(d)
        .args(["decrypt", "-q", "-i", "id", "-o", "-", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn decrypt");
    let mut input = dec.stdin.take().expect("stdin");
    // The size once all is written (decrypt grows the pipe before its
    // first read), then the end of its input.
    let writer = std::thread::spawn(move || {
        input.write_all(&ct).expect("feed");
        pipe_size(input.as_raw_fd())
    });
    let mut out = dec.stdout.take().expect("stdout");
    let mut plain = Vec::new();
    out.read_to_end(&mut plain).expect("read");
    assert_eq!(writer.join().expect("writer"), want, "decrypt's stdin");
    assert!(dec.wait().expect("wait").success());
    assert_eq!(pipe_size(out.as_raw_fd()), want, "decrypt's stdout");
    assert!(plain == data, "decrypted data differs");
}

/// An output over a file the run reads its keys from (`decrypt -i id -o
/// id -f`, `encrypt -R recipients -o recipients -f`, a `--pin-file`, or
/// a derived name that is one), or `--in-place` of such a file, is refused
/// before any work, even with `-f`: the only identity that opens a file
/// must never be replaced by that file's plaintext. (Found by a hostile
/// round: both runs exited 0, the identity or recipients file gone.)
#[test]
fn an_output_over_the_runs_own_key_file_is_refused() {
    let (dir, r) = scratch();
    let d = dir.path();
    let id = fs::read(d.join("id")).unwrap();
    fs::write(d.join("p"), b"plaintext").unwrap();
    fs::write(d.join("recips"), format!("{r}\n")).unwrap();
    assert_ok(&run(d, &["encrypt", "-R", &r, "p"]), "encrypt");
    let refused = |args: &[&str], needles: &[&str], what: &str| {
        let res = run(d, args);
        common::assert_error_line(&res, USAGE, None, needles, what);
    };
    refused(
        &["decrypt", "-i", "id", "-o", "id", "-f", "p.tpmc"],
        &["id: that is the identity file (-i id)", "refusing"],
        "-o id",
    );
    refused(
        &["decrypt", "-i", "id", "-o", "./id", "-f", "p.tpmc"],
        &["the identity file (-i id)"],
        "-o ./id",
    );
    refused(
        &["encrypt", "-R", "recips", "-o", "recips", "-f", "p"],
        &["the recipients file (-R recips)"],
        "-o recips",
    );
    fs::write(d.join("pin"), b"1234\n").unwrap();
    common::chmod(&d.join("pin"), 0o600);
    refused(
        &[
            "--pin-file",
            "pin",
            "decrypt",
            "-i",
            "id",
            "-o",
            "pin",
            "-f",
            "p.tpmc",
        ],
        &["the PIN file (--pin-file pin)"],
        "-o pin",
    );
    // A derived name: id.tpmc decrypts to id.
    fs::copy(d.join("p.tpmc"), d.join("id.tpmc")).unwrap();
    refused(
        &["decrypt", "-i", "id", "-f", "id.tpmc"],
        &["the identity file (-i id)"],
        "id.tpmc → id",
    );
    // In place, the file would be removed.
    refused(
        &["encrypt", "-R", "recips", "--in-place", "recips"],
        &["the recipients file (-R recips)", "--in-place"],
        "--in-place recips",
    );
    // Standard output opened on the identity (`>> id`), and recipients read
    // from standard input that is the output (`-R - -o recips < recips`).
    for out in ["-", "/dev/stdout"] {
        let appending = fs::OpenOptions::new()
            .append(true)
            .open(d.join("id"))
            .unwrap();
        let res: Run = tpmcrypt(d)
            .args(["decrypt", "-i", "id", "-o", out, "-f", "p.tpmc"])
            .stdout(appending)
            .output()
            .unwrap()
            .into();
        common::assert_error_line(
            &res,
            USAGE,
            None,
            &["standard output: that is the identity file (-i id)"],
            out,
        );
    }
    let res: Run = tpmcrypt(d)
        .args(["encrypt", "-R", "-", "-o", "recips", "-f", "p"])
        .stdin(fs::File::open(d.join("recips")).unwrap())
        .output()
        .unwrap()
        .into();
    common::assert_error_line(
        &res,
        USAGE,
        None,
        &["recips: that is the recipients file (-R -)"],
        "-R - < recips",
    );
    // The keystore's directory, where TPM keys live: no output there, and
    // no original of --in-place.
    fs::create_dir(d.join("ks")).unwrap();
    common::chmod(&d.join("ks"), 0o700);
    fs::write(d.join("ks/notes"), b"a file there").unwrap();
    common::chmod(&d.join("ks/notes"), 0o600);
    refused(
        &[
            "--keystore",
            "ks",
            "decrypt",
            "-i",
            "id",
            "-o",
            "ks/notes",
            "-f",
            "p.tpmc",
        ],
        &["that is in the keystore ks", "refusing to write there"],
        "-o into the keystore",
    );
    refused(
        &[
            "--keystore",
            "ks",
            "encrypt",
            "-R",
            &r,
            "--in-place",
            "ks/notes",
        ],
        &["notes.tpmc: that is in the keystore ks"],
        "--in-place in the keystore",
    );
    assert_eq!(fs::read(d.join("ks/notes")).unwrap(), b"a file there");
    assert_eq!(fs::read(d.join("id")).unwrap(), id, "the identity changed");
    assert_eq!(
        fs::read_to_string(d.join("recips")).unwrap(),
        format!("{r}\n")
    );
    // Elsewhere, as before.
    assert_ok(
        &run(d, &["decrypt", "-i", "id", "-o", "p2", "-f", "p.tpmc"]),
        "decrypt",
    );
    assert_eq!(fs::read(d.join("p2")).unwrap(), b"plaintext");
}
