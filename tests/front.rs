//! The two executables: `tpmcrypt`, the front users run, serves by itself
//! the runs that need neither tpm2-tss nor OpenSSL and hands every other
//! run to `tpmcrypt-full` with execve (crates/cli/src/front.rs). These
//! tests check what that split promises:
//! * the front does not load the libraries (the whole point: about half
//!   of a small run's time, `scripts/bench-process`);
//! * the runs it serves start no other program, and the ones it hands
//!   over start `tpmcrypt-full` once, with the same arguments;
//! * a run handed over says and does exactly what `tpmcrypt-full` run
//!   directly says and does, and one served says what it would have said;
//! * `tpmcrypt-full` is found beside the front or in `../libexec/tpmcrypt/`,
//!   never in PATH, and its absence is one error line.
//!
//! A missing swtpm, strace or ldd makes the tests FAIL, never skip.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{assert_ok, bytes, recovery, run, tpmcrypt, Run};

fn scratch() -> tempfile::TempDir {
    common::scratch("tpmcrypt-front-")
}

/// `tpmcrypt-full`, built beside the front.
fn full() -> PathBuf {
    common::bin().with_file_name("tpmcrypt-full")
}

/// Runs `tpmcrypt-full ARGS` in `dir` with the environment of [`tpmcrypt`].
fn run_full(dir: &Path, args: &[&str]) -> Run {
    let mut cmd = common::wrapper(dir, full().to_str().expect("utf-8 path"));
    cmd.args(args).output().expect("spawn tpmcrypt-full").into()
}

/// The shared libraries `binary` loads, as `ldd` names them.
fn libraries(binary: &Path) -> Vec<String> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .unwrap_or_else(|e| panic!("cannot run ldd: {e}"));
    assert!(out.status.success(), "ldd {}", binary.display());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

/// The programs a run of `args` in `dir` executed (strace -f), in order,
/// each with its argv; and the run itself.
fn executed(dir: &Path, env: &[(&str, &str)], args: &[&str]) -> (Vec<String>, Run) {
    let log = dir.join(format!(".execve-{}.log", std::process::id()));
    let mut cmd = common::wrapper(dir, "strace");
    cmd.args([
        "-f",
        "-qq",
        "-s",
        "256",
        "-e",
        "trace=execve",
        "-e",
        "signal=none",
        "-o",
    ])
    .arg(&log)
    .arg(common::bin())
    .args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let r: Run = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run strace: {e}"))
        .into();
    let text = fs::read_to_string(&log).expect("strace log");
    fs::remove_file(&log).expect("remove strace log");
    (execs_of(&text), r)
}

/// The programs an strace log of `execve` shows started, with their argv
/// (not the environment's address); the tries of a `PATH` search that
/// found nothing and the first try of a restarted call are left out.
fn execs_of(text: &str) -> Vec<String> {
    common::calls_made(text)
        .filter(|l| l.contains("execve(") && !l.contains("ENOENT"))
        // The program and its argv (not the environment's address).
        .map(|l| {
            let call = l.split_once("execve(").map_or(l, |(_, rest)| rest);
            call.split_once("], ")
                .map_or(call, |(argv, _)| argv)
                .to_string()
        })
        .collect()
}

/// CI once counted tpmcrypt-full twice for one run: the kernel restarted
/// its `execve` (a signal came while the exec waited for its lock), and
/// strace prints such a call once per try. The count is of programs
/// started, so the first try is not one.
#[test]
fn a_restarted_execve_is_one_program_started() {
    let log = "\
7 execve(\"/b/tpmcrypt\", [\"tpmcrypt\", \"decrypt\"], 0x7ffd /* 9 vars */) = 0
7 execve(\"/b/tpmcrypt-full\", [\"tpmcrypt\", \"decrypt\"], 0x7ffe /* 9 vars */) = ? ERESTARTNOINTR (To be restarted)
7 execve(\"/b/tpmcrypt-full\", [\"tpmcrypt\", \"decrypt\"], 0x7ffe /* 9 vars */) = 0
8 execve(\"/usr/local/bin/x\", [\"x\"], 0x7ffe /* 9 vars */) = -1 ENOENT (No such file or directory)
9 execve(\"/b/tpmcrypt-full\", [\"tpmcrypt\", \"-v\"], 0x7ffe /* 9 vars */ <unfinished ...>
10 +++ exited with 0 +++
9 <... execve resumed>) = ? ERESTARTNOINTR (To be restarted)
9 execve(\"/b/tpmcrypt-full\", [\"tpmcrypt\", \"-v\"], 0x7ffe /* 9 vars */) = 0
";
    assert_eq!(
        execs_of(log),
        [
            "\"/b/tpmcrypt\", [\"tpmcrypt\", \"decrypt\"",
            "\"/b/tpmcrypt-full\", [\"tpmcrypt\", \"decrypt\"",
            "\"/b/tpmcrypt-full\", [\"tpmcrypt\", \"-v\"",
        ]
    );
}

/// Copies an executable with `cp`: a descriptor open for writing in this
/// process would be inherited by the other tests' children forked
/// meanwhile, and running the copy would fail with ETXTBSY.
fn copy_executable(from: &Path, to: &Path) {
    let status = Command::new("cp")
        .arg(from)
        .arg(to)
        .status()
        .expect("spawn cp");
    assert!(status.success(), "cp {} {}", from.display(), to.display());
}

/// In `d`: a recovery identity `id`, a file `f` of `len` bytes (`seed`)
/// and `f.tpmc`, encrypted to `id` in a session of its own.
fn encrypted_file(d: &Path, len: usize, seed: u64) {
    let r = recovery(d, "id");
    fs::write(d.join("f"), bytes(len, seed)).unwrap();
    let args = ["encrypt", "--new-session", "-R", &r, "-o", "f.tpmc", "f"];
    assert_ok(&run(d, &args), "encrypt");
}

const LIBRARIES_OF_FULL: [&str; 4] = ["libcrypto", "libssl", "libtss2-esys", "libtss2-tctildr"];

/// The front loads neither OpenSSL nor tpm2-tss's ESYS; tpmcrypt-full
/// does (so this test can tell them apart).
#[test]
fn the_front_loads_neither_openssl_nor_tpm2_tss() {
    let front = libraries(&common::bin());
    for lib in LIBRARIES_OF_FULL {
        assert!(
            !front.iter().any(|l| l.starts_with(lib)),
            "tpmcrypt loads {lib}: {front:?}"
        );
    }
    let full = libraries(&full());
    for lib in ["libcrypto", "libtss2-esys"] {
        assert!(
            full.iter().any(|l| l.starts_with(lib)),
            "tpmcrypt-full does not load {lib}: {full:?}"
        );
    }
}

/// Encrypting to a recovery recipient and decrypting with its identity
/// run in the front alone; a command it does not serve starts
/// tpmcrypt-full once, with the front's own argv[0] and arguments.
#[test]
fn served_runs_start_nothing_and_others_start_tpmcrypt_full_once() {
    let dir = scratch();
    let d = dir.path();
    let r = recovery(d, "id");
    fs::write(d.join("f"), bytes(20_000, 1)).unwrap();

    let (calls, run) = executed(d, &[], &["encrypt", "--no-sync", "-R", &r, "f"]);
    assert_ok(&run, "encrypt -R");
    assert_eq!(calls.len(), 1, "encrypt -R executed: {calls:?}");
    let (calls, run) = executed(d, &[], &["decrypt", "-i", "id", "-o", "g", "f.tpmc"]);
    assert_ok(&run, "decrypt -i");
    assert_eq!(calls.len(), 1, "decrypt -i executed: {calls:?}");
    assert_eq!(fs::read(d.join("g")).unwrap(), bytes(20_000, 1));
    // AES-192-GCM: served where its default is AWS-LC's 512-bit path,
    // handed over where it is OpenSSL's.
    let args = [
        "encrypt",
        "--no-sync",
        "--bits",
        "192",
        "-R",
        &r,
        "-o",
        "f192",
        "f",
    ];
    let (calls, run) = executed(d, &[], &args);
    assert_ok(&run, "encrypt --bits 192");
    let expect = if common::default_gcm_backend() == "aws-lc" {
        1
    } else {
        2
    };
    assert_eq!(calls.len(), expect, "--bits 192 executed: {calls:?}");

    // A recipients file of recovery recipients is served; one with a PEM
    // key (OpenSSL reads those) or on standard input is handed over.
    fs::write(d.join("list"), format!("# team\n{r}\n\n")).unwrap();
    fs::write(d.join("with-pem"), format!("{r}\n{}", p256_pem())).unwrap();
    let (calls, run) = executed(
        d,
        &[],
        &["encrypt", "--no-sync", "-R", "list", "-o", "l", "f"],
    );
    assert_ok(&run, "encrypt -R list");
    assert_eq!(calls.len(), 1, "encrypt -R FILE executed: {calls:?}");
    let back = common::run(d, &["decrypt", "-i", "id", "-o", "l.out", "l"]);
    assert_ok(&back, "decrypt of -R list");
    assert_eq!(fs::read(d.join("l.out")).unwrap(), bytes(20_000, 1));

    for args in [
        &["encrypt", "-R", "with-pem", "-o", "p", "f"][..],
        &["encrypt", "-R", "-", "-o", "s", "f"],
        &["--version"][..],
        &["key", "list"],
        &["encrypt", "--mode", "cbc", "-R", &r, "-o", "c", "f"],
        &["decrypt", "-i", "id", "-o", "h", "-", "f.tpmc"],
        &["encrypt"],
    ] {
        let (calls, _) = executed(d, &[], args);
        assert_eq!(calls.len(), 2, "{args:?} executed: {calls:?}");
        let front = format!("{:?}", common::bin().display().to_string());
        let full = format!("{:?}", full().display().to_string());
        assert!(calls[0].starts_with(&front), "{calls:?}");
        // The same argv, argv[0] included: only the program differs.
        assert_eq!(calls[1].replacen(&full, &front, 1), calls[0], "{args:?}");
    }
}

/// Runs handed over, and runs the front serves or begins, say exactly what
/// tpmcrypt-full says: the same exit code, stdout and stderr, and the same
/// files afterwards.
#[test]
fn every_run_says_what_tpmcrypt_full_says() {
    let dir = scratch();
    let d = dir.path();
    let r = recovery(d, "id");
    let other = recovery(d, "other");
    fs::write(d.join("f"), bytes(5_000, 2)).unwrap();
    fs::write(d.join("notes.txt"), "not a tpmcrypt file\n").unwrap();
    fs::write(d.join("list"), format!("# recipients\n{r}\n")).unwrap();
    fs::write(d.join("with-pem"), format!("{r}\n{}", p256_pem())).unwrap();
    fs::write(d.join("bad-line"), format!("{r}\nsomething else\n")).unwrap();
    fs::write(d.join("only-comments"), "# none yet\n\n").unwrap();
    fs::write(d.join("bad-point"), "tpmcrypt-recovery:AAAA\n").unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", &r, "-o", "f.tpmc", "f"]),
        "encrypt",
    );
    assert_ok(
        &run(d, &["encrypt", "-a", "-R", &r, "-o", "f.asc", "f"]),
        "armor",
    );
    assert_ok(
        &run(d, &["encrypt", "-R", &other, "-o", "o.tpmc", "f"]),
        "other",
    );
    let cases: Vec<Vec<&str>> = vec![
        // Served, or begun and then handed over, by the front.
        vec!["decrypt", "-i", "id", "-o", "OUT", "f.tpmc"],
        vec!["decrypt", "-i", "id", "-o", "OUT", "f.asc"],
        vec!["decrypt", "-i", "id", "-o", "OUT", "o.tpmc"],
        vec!["decrypt", "-i", "id", "-o", "OUT", "notes.txt"],
        vec!["decrypt", "-i", "id", "-o", "OUT", "absent"],
        vec!["decrypt", "-i", "id", "-o", "f", "f.tpmc"],
        vec!["decrypt", "-i", "absent-id", "-o", "OUT", "f.tpmc"],
        vec!["decrypt", "-o", "OUT", "f.tpmc"],
        vec![
            "-v",
            "decrypt",
            "--no-sync",
            "-i",
            "id",
            "-o",
            "OUT",
            "f.tpmc",
        ],
        vec!["encrypt", "-R", &r, "-o", "OUT", "f"],
        vec!["encrypt", "-R", "tpmcrypt-recovery:AAAA", "-o", "OUT", "f"],
        vec!["encrypt", "-R", &r, "-o", "OUT", "absent"],
        vec!["encrypt", "-R", &r, "-o", "f.tpmc", "f"],
        vec![
            "encrypt",
            "--backend",
            "openssl",
            "-R",
            &r,
            "-o",
            "OUT",
            "f",
        ],
        vec!["encrypt", "--bits", "192", "-R", &r, "-o", "OUT", "f"],
        vec!["encrypt", "-R", "list", "-o", "OUT", "f"],
        vec!["encrypt", "-R", "list", "-R", &r, "-o", "OUT", "f"],
        // Handed over at once.
        vec!["encrypt", "-R", "with-pem", "-o", "OUT", "f"],
        vec!["encrypt", "-R", "bad-line", "-o", "OUT", "f"],
        vec!["encrypt", "-R", "only-comments", "-o", "OUT", "f"],
        vec!["encrypt", "-R", "bad-point", "-o", "OUT", "f"],
        vec!["encrypt", "-R", ".", "-o", "OUT", "f"],
        vec!["encrypt", "-o", "OUT", "f"],
        vec!["encrypt", "--no-such-flag"],
        vec!["decrypt", "--help"],
        vec!["--version"],
        vec!["key", "list"],
        vec![],
    ];
    for case in &cases {
        let a = run(d, case);
        let a_out = fs::read(d.join("OUT")).ok();
        let _ = fs::remove_file(d.join("OUT"));
        let b = run_full(d, case);
        let b_out = fs::read(d.join("OUT")).ok();
        let _ = fs::remove_file(d.join("OUT"));
        assert_eq!(a.code, b.code, "{case:?}: exit codes ({})", a.stderr);
        assert_eq!(
            String::from_utf8_lossy(&a.stdout),
            String::from_utf8_lossy(&b.stdout),
            "{case:?}: stdout"
        );
        // -v reports times, which differ from run to run.
        let words = |s: &str| -> Vec<String> {
            s.split_whitespace()
                .filter(|w| !w.chars().any(|c| c.is_ascii_digit()))
                .map(str::to_string)
                .collect()
        };
        assert_eq!(words(&a.stderr), words(&b.stderr), "{case:?}: stderr");
        assert_eq!(a_out.is_some(), b_out.is_some(), "{case:?}: an output");
        if case.first() == Some(&"decrypt") {
            assert_eq!(a_out, b_out, "{case:?}: the plaintext");
        }
    }
    assert_eq!(fs::read(d.join("f")).unwrap(), bytes(5_000, 2), "f kept");

    // A standard output closed at start is closed for tpmcrypt-full too.
    for args in ["completions bash", "--version", "decrypt -i id -o - f.tpmc"] {
        let r = common::run_with_stdout_closed(d, args);
        common::assert_error_line(&r, 1, None, &["standard output is closed"], args);
    }
}

/// A P-256 public key in PEM, as a TPM key's public half is written.
fn p256_pem() -> String {
    let group = openssl::ec::EcGroup::from_curve_name(openssl::nid::Nid::X9_62_PRIME256V1).unwrap();
    let key = openssl::ec::EcKey::generate(&group).unwrap();
    String::from_utf8(key.public_key_to_pem().unwrap()).unwrap()
}

/// The front reads a recipients file only if it is a regular file: a
/// FIFO given as `-R` is left to tpmcrypt-full, which gets all it holds
/// (the front neither blocks on it nor reads any of it).
#[test]
fn a_recipients_fifo_is_left_for_tpmcrypt_full() {
    let dir = scratch();
    let d = dir.path();
    let r = recovery(d, "id");
    fs::write(d.join("f"), bytes(3_000, 4)).unwrap();
    let fifo = d.join("rfifo");
    let status = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(status.success());
    let writer = {
        let fifo = fifo.clone();
        let line = format!("# from a pipe\n{r}\n");
        std::thread::spawn(move || fs::write(fifo, line))
    };
    let (calls, run) = executed(d, &[], &["encrypt", "-R", "rfifo", "-o", "g", "f"]);
    writer.join().unwrap().expect("write the FIFO");
    assert_ok(&run, "encrypt -R FIFO");
    assert_eq!(calls.len(), 2, "handed over: {calls:?}");
    let back = common::run(d, &["decrypt", "-i", "id", "-o", "g.out", "g"]);
    assert_ok(&back, "decrypt");
    assert_eq!(fs::read(d.join("g.out")).unwrap(), bytes(3_000, 4));
}

/// Without tpmcrypt-full the front still serves what it serves, and a run
/// it would hand over is one error line naming what is missing.
#[test]
fn without_tpmcrypt_full_a_handed_over_run_is_one_error_line() {
    let dir = scratch();
    let d = dir.path();
    let r = recovery(d, "id");
    let alone = d.join("alone");
    fs::create_dir(&alone).unwrap();
    copy_executable(&common::bin(), &alone.join("tpmcrypt"));
    fs::write(d.join("f"), bytes(3_000, 3)).unwrap();
    let lone = |args: &[&str]| -> Run {
        let mut cmd = common::wrapper(d, alone.join("tpmcrypt").to_str().unwrap());
        cmd.args(args).output().expect("spawn").into()
    };
    assert_ok(
        &lone(&["encrypt", "-R", &r, "f"]),
        "encrypt -R without tpmcrypt-full",
    );
    let x = lone(&["key", "list"]);
    common::assert_error_line(&x, 1, None, &["tpmcrypt-full", "not installed"], "key list");
    // Not looked up in PATH, even where one is.
    let mut cmd = common::wrapper(d, alone.join("tpmcrypt").to_str().unwrap());
    let path = full().parent().unwrap().display().to_string();
    let x: Run = cmd
        .env("PATH", format!("{path}:/usr/bin:/bin"))
        .arg("--version")
        .output()
        .expect("spawn")
        .into();
    common::assert_error_line(&x, 1, None, &["tpmcrypt-full"], "--version, full in PATH");
}

/// The name `tpmcrypt-full` is judged where it is found, not only where it
/// leads: a symlink of another user's there, one put in a directory anyone
/// may write to (even a sticky one, as /tmp: the name was free to take),
/// or a directory on the way there that is another user's symlink, is not
/// followed, however trusted the program it names. (Found by a hostile
/// round: root ran `tpmcrypt inspect FILE` from a sticky directory holding
/// only the front, another user linked `tpmcrypt-full` to /usr/bin/rm
/// there, and FILE was removed.)
#[test]
fn a_name_another_user_could_have_put_there_is_not_followed() {
    use std::os::unix::fs::{lchown, symlink, PermissionsExt as _};
    let dir = scratch();
    let d = dir.path();
    let mode = |p: &Path, m: u32| fs::set_permissions(p, fs::Permissions::from_mode(m)).unwrap();
    // A program of root's in a directory of root's, which says it ran.
    let rootbin = d.join("rootbin");
    fs::create_dir(&rootbin).unwrap();
    mode(&rootbin, 0o755);
    let marker = d.join("ran");
    let prog = rootbin.join("prog");
    fs::write(&prog, format!("#!/bin/sh\ntouch {}\n", marker.display())).unwrap();
    mode(&prog, 0o755);
    let version = |front: &Path| -> Run {
        let mut cmd = common::wrapper(d, front.to_str().unwrap());
        cmd.arg("--version").output().expect("spawn").into()
    };
    // Only the front, in a sticky directory anyone may write to.
    let ww = d.join("ww");
    fs::create_dir(&ww).unwrap();
    mode(&ww, 0o1777);
    copy_executable(&common::bin(), &ww.join("tpmcrypt"));
    symlink(&prog, ww.join("tpmcrypt-full")).unwrap();
    lchown(ww.join("tpmcrypt-full"), Some(65534), Some(65534)).unwrap();
    let r = version(&ww.join("tpmcrypt"));
    common::assert_error_line(
        &r,
        1,
        None,
        &[
            "tpmcrypt-full: the directory it is found in is writable by other users",
            "not run",
        ],
        "another's symlink in a sticky directory",
    );
    assert!(!marker.exists(), "the program it names was run");
    // In a directory of root's, a symlink of another user's.
    let inst = d.join("inst");
    fs::create_dir(&inst).unwrap();
    mode(&inst, 0o755);
    copy_executable(&common::bin(), &inst.join("tpmcrypt"));
    symlink(&prog, inst.join("tpmcrypt-full")).unwrap();
    lchown(inst.join("tpmcrypt-full"), Some(65534), Some(65534)).unwrap();
    let r = version(&inst.join("tpmcrypt"));
    common::assert_error_line(
        &r,
        1,
        None,
        &["a symlink owned by uid 65534", "not run"],
        "another's symlink",
    );
    assert!(!marker.exists(), "the program it names was run");
    // The same symlink, root's own: followed.
    lchown(inst.join("tpmcrypt-full"), Some(0), Some(0)).unwrap();
    let r = version(&inst.join("tpmcrypt"));
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(marker.exists(), "root's own symlink was not followed");
    fs::remove_file(&marker).unwrap();
    // In ../libexec/tpmcrypt/, through a libexec that is another user's
    // symlink to a directory of root's.
    let root_lib = d.join("rootlib");
    fs::create_dir_all(root_lib.join("tpmcrypt")).unwrap();
    mode(&root_lib, 0o755);
    mode(&root_lib.join("tpmcrypt"), 0o755);
    fs::copy(&prog, root_lib.join("tpmcrypt/tpmcrypt-full")).unwrap();
    let prefix = d.join("prefix");
    fs::create_dir_all(prefix.join("bin")).unwrap();
    mode(&prefix, 0o755);
    mode(&prefix.join("bin"), 0o755);
    copy_executable(&common::bin(), &prefix.join("bin/tpmcrypt"));
    symlink(&root_lib, prefix.join("libexec")).unwrap();
    lchown(prefix.join("libexec"), Some(65534), Some(65534)).unwrap();
    let r = version(&prefix.join("bin/tpmcrypt"));
    common::assert_error_line(
        &r,
        1,
        None,
        &["a symlink owned by uid 65534", "not run"],
        "through another's symlinked libexec",
    );
    assert!(!marker.exists(), "the program it names was run");
}

/// An access ACL that lets another user write to tpmcrypt-full or to its
/// directory is as a mode bit that does: not run. (Its mode shows only the
/// ACL's mask in the group bits, `0775 root:root`, which the rule for the
/// caller's own group let through.)
#[test]
fn an_acl_that_lets_another_user_write_is_refused() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = scratch();
    let d = dir.path();
    let inst = d.join("inst");
    fs::create_dir(&inst).unwrap();
    fs::set_permissions(&inst, fs::Permissions::from_mode(0o755)).unwrap();
    copy_executable(&common::bin(), &inst.join("tpmcrypt"));
    copy_executable(&full(), &inst.join("tpmcrypt-full"));
    let version = || -> Run {
        let mut cmd = common::wrapper(d, inst.join("tpmcrypt").to_str().unwrap());
        cmd.arg("--version").output().expect("spawn").into()
    };
    let setfacl = |args: &[&str], path: &Path| {
        let ok = Command::new("setfacl")
            .args(args)
            .arg(path)
            .status()
            .expect("setfacl (acl, installed by scripts/setup-deps)");
        assert!(ok.success(), "setfacl {args:?}");
    };
    assert_ok(&version(), "--version");
    for path in [inst.join("tpmcrypt-full"), inst.clone()] {
        // Read and run only: still trusted.
        setfacl(&["-m", "u:65534:rx"], &path);
        assert_ok(&version(), "an ACL that lets another user read");
        setfacl(&["-m", "u:65534:rwx"], &path);
        let r = version();
        common::assert_error_line(
            &r,
            1,
            None,
            &["writable by other users through its ACL", "not run"],
            &path.display().to_string(),
        );
        assert!(r.stdout.is_empty());
        setfacl(&["-b"], &path);
        assert_ok(&version(), "the ACL removed");
    }
}

/// A tpmcrypt-full that another user owns, or that others may replace (it
/// or its directory writable by them, or a directory above writable by
/// them and not sticky, or theirs), is not run: one error line (exit
/// 1). The build before ran it, with this user's environment and
/// descriptors (PIN sources, the agent's socket).
#[test]
fn a_tpmcrypt_full_another_user_could_have_put_there_is_not_run() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = scratch();
    let d = dir.path();
    let inst = d.join("inst");
    fs::create_dir(&inst).unwrap();
    fs::set_permissions(&inst, fs::Permissions::from_mode(0o755)).unwrap();
    copy_executable(&common::bin(), &inst.join("tpmcrypt"));
    copy_executable(&full(), &inst.join("tpmcrypt-full"));
    let copy = inst.join("tpmcrypt-full");
    let version = || -> Run {
        let mut cmd = common::wrapper(d, inst.join("tpmcrypt").to_str().unwrap());
        cmd.arg("--version").output().expect("spawn").into()
    };
    assert_ok(&version(), "--version");
    std::os::unix::fs::chown(&copy, Some(65534), Some(65534)).expect("chown (root, as CI runs)");
    let r = version();
    common::assert_error_line(&r, 1, None, &["owned by uid 65534", "not run"], "another's");
    assert!(r.stdout.is_empty());
    std::os::unix::fs::chown(&copy, Some(0), Some(0)).unwrap();
    fs::set_permissions(&copy, fs::Permissions::from_mode(0o777)).unwrap();
    let r = version();
    common::assert_error_line(&r, 1, None, &["writable by other users", "not run"], "0777");
    fs::set_permissions(&copy, fs::Permissions::from_mode(0o755)).unwrap();
    fs::set_permissions(&inst, fs::Permissions::from_mode(0o1777)).unwrap();
    let r = version();
    common::assert_error_line(
        &r,
        1,
        None,
        &["its directory is writable by other users", "not run"],
        "a sticky directory",
    );
    fs::set_permissions(&inst, fs::Permissions::from_mode(0o755)).unwrap();
    assert_ok(&version(), "--version again");
    // A directory above it that another user may write to (and so swap
    // its directory for one of theirs between the check and the exec), or
    // owns. The build before checked only its own directory, and ran it.
    let mode = fs::metadata(d).unwrap().permissions().mode();
    fs::set_permissions(d, fs::Permissions::from_mode(0o777)).unwrap();
    let r = version();
    fs::set_permissions(d, fs::Permissions::from_mode(mode)).unwrap();
    common::assert_error_line(
        &r,
        1,
        None,
        &["above it is writable by other users", "not run"],
        "a directory above, 0777",
    );
    std::os::unix::fs::chown(d, Some(65534), None).unwrap();
    let r = version();
    std::os::unix::fs::chown(d, Some(0), None).unwrap();
    common::assert_error_line(
        &r,
        1,
        None,
        &["above it is owned by uid 65534", "not run"],
        "a directory above, another user's",
    );
    fs::set_permissions(d, fs::Permissions::from_mode(0o1777)).unwrap();
    let r = version();
    fs::set_permissions(d, fs::Permissions::from_mode(mode)).unwrap();
    assert_ok(&r, "a sticky directory above (as /tmp)");
    // A symlink to a file of root's in a directory of another user's
    // (who could swap the file): the real path is what is checked. The
    // build before checked the directories on the symlink's side.
    let theirs = d.join("theirs");
    fs::create_dir(&theirs).unwrap();
    copy_executable(&full(), &theirs.join("tpmcrypt-full"));
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
    fs::remove_file(&copy).unwrap();
    std::os::unix::fs::symlink(theirs.join("tpmcrypt-full"), &copy).unwrap();
    let r = version();
    common::assert_error_line(
        &r,
        1,
        None,
        &["its directory is owned by uid 65534", "not run"],
        "a symlink into another user's directory",
    );
}

/// Installed as the Debian package lays it out: bin/tpmcrypt and
/// libexec/tpmcrypt/tpmcrypt-full.
#[test]
fn tpmcrypt_full_is_found_in_libexec() {
    let dir = scratch();
    let d = dir.path();
    fs::create_dir_all(d.join("usr/bin")).unwrap();
    fs::create_dir_all(d.join("usr/libexec/tpmcrypt")).unwrap();
    copy_executable(&common::bin(), &d.join("usr/bin/tpmcrypt"));
    copy_executable(&full(), &d.join("usr/libexec/tpmcrypt/tpmcrypt-full"));
    let mut cmd = common::wrapper(d, d.join("usr/bin/tpmcrypt").to_str().unwrap());
    let r: Run = cmd.arg("--version").output().expect("spawn").into();
    assert_ok(&r, "--version");
    assert!(
        String::from_utf8_lossy(&r.stdout).contains("tpm2-tss"),
        "{}",
        String::from_utf8_lossy(&r.stdout)
    );
}

/// A TPM-key file whose session key the agent holds is decrypted by the
/// front alone, with no TPM command; without the agent the run is handed
/// over and costs one unbind.
#[test]
fn the_agent_serves_a_tpm_key_file_in_the_front() {
    let dir = scratch();
    let d = dir.path();
    let sim = common::swtpm(d, "swtpm");
    let tcti = sim.tcti();
    let tc = |args: &[&str]| -> Run {
        let mut cmd = tpmcrypt(d);
        cmd.arg("--tpm").arg(&tcti).args(args);
        cmd.output().expect("spawn").into()
    };
    assert_ok(
        &tc(&["key", "create", "--alg", "ecc-p256", "k"]),
        "key create",
    );
    assert_ok(
        &tc(&["key", "create", "--alg", "rsa2048", "r"]),
        "key create rsa",
    );
    fs::write(d.join("f"), bytes(40_000, 4)).unwrap();
    // Encrypting to a P-256 key is served; to an RSA key, handed over.
    let (calls, r) = executed(d, &[], &["encrypt", "--key", "k", "-o", "f.tpmc", "f"]);
    assert_ok(&r, "encrypt --key k");
    assert_eq!(calls.len(), 1, "encrypt --key k: {calls:?}");
    let (calls, r) = executed(d, &[], &["encrypt", "--key", "r", "-o", "r.tpmc", "f"]);
    assert_ok(&r, "encrypt --key r");
    assert_eq!(calls.len(), 2, "encrypt --key r: {calls:?}");
    // A public key file that is not the key's: refused as tpmcrypt-full
    // refuses it.
    let home = d.join(".tpmcrypt-home");
    let pubs = [home.join("k.pub.pem"), home.join("r.pub.pem")];
    let saved = fs::read(&pubs[0]).unwrap();
    fs::copy(&pubs[1], &pubs[0]).unwrap();
    let a = run(d, &["encrypt", "--key", "k", "-o", "x.tpmc", "f"]);
    let b = run_full(d, &["encrypt", "--key", "k", "-o", "x.tpmc", "f"]);
    assert_eq!(
        (a.code, &a.stderr),
        (b.code, &b.stderr),
        "a foreign k.pub.pem"
    );
    assert_ne!(a.code, 0, "{}", a.stderr);
    fs::write(&pubs[0], saved).unwrap();

    // No agent: handed over, one unbind.
    let env = [("TPMCRYPT_TCTI", tcti.as_str())];
    let (calls, r) = executed(d, &env, &["-v", "decrypt", "-o", "g1", "f.tpmc"]);
    assert_ok(&r, "decrypt without agent");
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(r.stderr.contains(" 1 TPM unbind(s)"), "{}", r.stderr);

    let mut agent = Agent::start(d);
    // The first decrypt unbinds and hands the key to the agent.
    assert_ok(&tc(&["decrypt", "-o", "g2", "f.tpmc"]), "first decrypt");
    let (calls, r) = executed(d, &env, &["-v", "decrypt", "-o", "g3", "f.tpmc"]);
    assert_ok(&r, "decrypt, the agent holding the key");
    assert_eq!(calls.len(), 1, "served by the front: {calls:?}");
    assert!(r.stderr.contains(" 0 TPM unbind(s)"), "{}", r.stderr);
    for out in ["g1", "g2", "g3"] {
        assert_eq!(fs::read(d.join(out)).unwrap(), bytes(40_000, 4), "{out}");
    }
    agent.stop();
}

/// `tpmcrypt agent` in the test's directory, stopped when dropped.
struct Agent(Child);

impl Agent {
    fn start(dir: &Path) -> Agent {
        let child = tpmcrypt(dir)
            .args(["agent", "--ttl", "5m"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn tpmcrypt agent");
        let sock = dir.join(".tpmcrypt-agent.sock");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !common::agent_socket_ready(&sock) {
            assert!(Instant::now() < deadline, "agent socket never appeared");
            std::thread::sleep(Duration::from_millis(20));
        }
        Agent(child)
    }

    fn stop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
    }
}

// ------------------------------------- found by attacking the front

/// A `-i` identity on a pipe is tpmcrypt-full's to read: the front
/// neither reads it nor consumes standard input (the run needs the TPM).
#[test]
fn an_identity_on_a_pipe_is_left_for_tpmcrypt_full() {
    let dir = scratch();
    let d = dir.path();
    let sim = common::swtpm(d, "swtpm");
    let tcti = sim.tcti();
    recovery(d, "id");
    let tc = |args: &[&str]| -> Run {
        let mut cmd = tpmcrypt(d);
        cmd.env("TPMCRYPT_TCTI", &tcti).args(args);
        cmd.output().expect("spawn").into()
    };
    assert_ok(
        &tc(&["key", "create", "--alg", "ecc-p256", "k"]),
        "key create",
    );
    fs::write(d.join("f"), bytes(7_000, 5)).unwrap();
    assert_ok(
        &tc(&["encrypt", "--key", "k", "-o", "t.tpmc", "f"]),
        "encrypt",
    );
    // A recovery identity that does not open t.tpmc, on standard input.
    let identity = fs::read(d.join("id")).unwrap();
    let mut cmd = tpmcrypt(d);
    cmd.env("TPMCRYPT_TCTI", &tcti)
        .args(["decrypt", "-i", "/dev/stdin", "-o", "g", "t.tpmc"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(&identity).expect("write identity");
    }
    let r: Run = child.wait_with_output().expect("wait").into();
    assert_ok(&r, "decrypt -i /dev/stdin of a TPM-key file");
    assert_eq!(fs::read(d.join("g")).unwrap(), bytes(7_000, 5));
}

/// A PIN source tpmcrypt-full refuses (a credential others can read) is
/// refused whoever serves the run, even one a `-i` identity opens.
#[test]
fn a_pin_source_tpmcrypt_full_refuses_is_refused() {
    let dir = scratch();
    let d = dir.path();
    encrypted_file(d, 1_000, 6);
    fs::create_dir(d.join("creds")).unwrap();
    fs::write(d.join("creds/tpmcrypt-pin"), "1234\n").unwrap();
    common::chmod(&d.join("creds/tpmcrypt-pin"), 0o644);
    let creds = d.join("creds").display().to_string();
    let args = ["decrypt", "-i", "id", "-o", "g", "f.tpmc"];
    let a: Run = tpmcrypt(d)
        .env("CREDENTIALS_DIRECTORY", &creds)
        .args(args)
        .output()
        .expect("spawn")
        .into();
    let b: Run = common::wrapper(d, full().to_str().unwrap())
        .env("CREDENTIALS_DIRECTORY", &creds)
        .args(args)
        .output()
        .expect("spawn")
        .into();
    assert_eq!((a.code, &a.stderr), (b.code, &b.stderr));
    assert_eq!(a.code, 2, "{}", a.stderr);
    assert!(!d.join("g").exists(), "no plaintext written");
}

/// A run that fails before it needs the session key (its output exists)
/// unwraps nothing, and its wall-time parts add up to its total.
#[test]
fn a_served_decrypt_counts_and_times_as_tpmcrypt_full_does() {
    let dir = scratch();
    let d = dir.path();
    encrypted_file(d, 2_000, 7);
    for exe in [common::bin(), full()] {
        let x: Run = common::wrapper(d, exe.to_str().unwrap())
            .args(["-v", "decrypt", "-i", "id", "-o", "f", "f.tpmc"])
            .output()
            .expect("spawn")
            .into();
        assert_eq!(x.code, 1, "{}", x.stderr);
        assert!(
            x.stderr.contains(" 0 session key unwrap(s)"),
            "{exe:?}: {}",
            x.stderr
        );
    }
    for i in 0..5 {
        let out = format!("g{i}");
        let stats = format!("s{i}.json");
        let args = [
            "decrypt",
            "--stats-json",
            &stats,
            "-i",
            "id",
            "-o",
            &out,
            "f.tpmc",
        ];
        assert_ok(&run(d, &args), "decrypt --stats-json");
        let v: serde_json::Value =
            serde_json::from_slice(&fs::read(d.join(&stats)).unwrap()).expect("json");
        let w = &v["wall_ms"];
        let part = |k: &str| w[k].as_f64().unwrap_or_else(|| panic!("{k}: {w}"));
        let sum: f64 = ["setup", "unwrap", "files", "commit", "other"]
            .iter()
            .map(|k| part(k))
            .sum();
        assert!(sum <= part("total") + 0.01, "parts {sum} > total: {w}");
        assert_eq!(v["session_key_unwraps"], 1, "{v}");
    }
}

/// A recovery identity opens the file in memory before the agent is
/// asked, so an agent that never answers costs a run the front serves
/// nothing: no connection, no wait, no warning (before, one 2 s wait and a
/// warning). A run whose identity is not a recipient asks it, and a SIGINT
/// while it waits ends the run as it ends tpmcrypt-full's.
#[test]
fn an_agent_that_never_answers_costs_a_recovery_decrypt_nothing() {
    use std::os::unix::net::UnixListener;
    use std::os::unix::process::ExitStatusExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let dir = scratch();
    let d = dir.path();
    encrypted_file(d, 1_500, 8);
    recovery(d, "other");
    let listener = UnixListener::bind(d.join(".tpmcrypt-agent.sock")).expect("bind");
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming() {
            count.fetch_add(1, Ordering::SeqCst);
            // Kept open, never answered.
            held.push(conn);
        }
    });
    let (calls, x) = executed(d, &[], &["decrypt", "-i", "id", "-o", "g", "f.tpmc"]);
    assert_ok(&x, "decrypt beside a silent agent");
    assert_eq!(calls.len(), 1, "served by the front: {calls:?}");
    assert_eq!(accepted.load(Ordering::SeqCst), 0, "connections");
    assert!(!x.stderr.contains("agent"), "{}", x.stderr);
    assert_eq!(fs::read(d.join("g")).unwrap(), bytes(1_500, 8));

    // A run that fails before it needs the key (its output exists) says
    // what tpmcrypt-full says, which never asks the agent: no warning.
    let args = ["decrypt", "-i", "id", "-o", "g", "f.tpmc"];
    let a = run(d, &args);
    let b = run_full(d, &args);
    assert_eq!((a.code, &a.stderr), (b.code, &b.stderr), "output exists");
    assert!(!a.stderr.contains("agent"), "{}", a.stderr);

    // SIGINT ignored by the caller (a script's background job) still ends
    // a run waiting on the agent, as it ends tpmcrypt-full's, which asks
    // the agent after it has taken the signals: nothing is written.
    let script = format!(
        "trap '' INT; exec {} decrypt -i other -o h f.tpmc",
        common::bin().display()
    );
    let mut child = common::wrapper(d, "sh")
        .args(["-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    // Once it has asked the agent, it waits for the answer.
    let deadline = Instant::now() + Duration::from_secs(30);
    while accepted.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "never asked the agent");
        std::thread::sleep(Duration::from_millis(5));
    }
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let status = child.wait().expect("wait");
    assert!(
        status.signal() == Some(libc::SIGINT) || status.code() == Some(128 + libc::SIGINT),
        "not ended by SIGINT: {status:?}"
    );
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "connections");
    assert!(!d.join("h").exists(), "h written despite SIGINT");
}

/// Without /proc the front does not trust argv[0] to find tpmcrypt-full:
/// a `tpmcrypt-full` beside a symlink to the front is never run.
#[test]
fn without_proc_argv0_never_chooses_tpmcrypt_full() {
    let dir = scratch();
    let d = dir.path();
    let evil = d.join("evil");
    fs::create_dir(&evil).unwrap();
    std::os::unix::fs::symlink(common::bin(), evil.join("tpmcrypt")).unwrap();
    let marker = d.join("ran");
    fs::write(
        evil.join("tpmcrypt-full"),
        format!("#!/bin/sh\ntouch {}\n", marker.display()),
    )
    .unwrap();
    common::chmod(&evil.join("tpmcrypt-full"), 0o755);
    let script = format!(
        "mount -t tmpfs none /proc && exec {} key list",
        evil.join("tpmcrypt").display()
    );
    let x: Run = common::wrapper(d, "unshare")
        .args(["-m", "sh", "-c", &script])
        .output()
        .expect("spawn unshare")
        .into();
    assert!(
        !marker.exists(),
        "argv[0]'s tpmcrypt-full ran: {}",
        x.stderr
    );
    assert!(x.stderr.lines().count() <= 2, "{}", x.stderr);
}

/// `OPENSSL_ia32cap` is OpenSSL's knob. AWS-LC (the default AES-GCM
/// backend, linked into both executables) reads it too, as the
/// executable loads: a value that claims features this CPU lacks stopped
/// every command there (SIGABRT), an empty one turned its assembly off.
/// tpmcrypt hides it from AWS-LC, and it still reaches tpmcrypt-full
/// after the front hands over, for OpenSSL to read.
#[test]
fn openssl_ia32cap_is_left_to_openssl() {
    let dir = scratch();
    let d = dir.path();
    encrypted_file(d, 3_000, 9);
    let r = recovery(d, "id2");
    for value in ["0xffffffffffffffff:0xffffffffffffffff", ""] {
        let dec = tpmcrypt(d)
            .env("OPENSSL_ia32cap", value)
            .args(["decrypt", "-i", "id", "-o", "-", "f.tpmc"])
            .output()
            .expect("spawn");
        let dec: Run = dec.into();
        assert_eq!(
            dec.code, 0,
            "decrypt, OPENSSL_ia32cap={value:?}: {}",
            dec.stderr
        );
        assert!(dec.stdout == bytes(3_000, 9), "OPENSSL_ia32cap={value:?}");
        let enc: Run = tpmcrypt(d)
            .env("OPENSSL_ia32cap", value)
            .args(["encrypt", "-R", &r, "-o", "g.tpmc", "--force", "f"])
            .output()
            .expect("spawn")
            .into();
        assert_eq!(
            enc.code, 0,
            "encrypt, OPENSSL_ia32cap={value:?}: {}",
            enc.stderr
        );
    }
    // A run handed over (the agent) keeps its environment as it came,
    // order and duplicate entries included (started through execve(2)
    // by Python's ctypes: Command cannot repeat a name).
    let env = [
        format!("TPMCRYPT_HOME={}", d.join("home").display()),
        format!(
            "TPMCRYPT_AGENT_SOCK={}",
            d.join(".tpmcrypt-agent.sock").display()
        ),
        "OPENSSL_ia32cap=~0x0".to_string(),
        "X=1".to_string(),
        "OPENSSL_ia32cap=second".to_string(),
    ];
    let script = r#"
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
def arr(items):
    a = (ctypes.c_char_p * (len(items) + 1))(*[i.encode() for i in items], None)
    return a
prog, env = sys.argv[1], sys.argv[2].split("\n")
libc.execve(prog.encode(), arr([prog, "agent", "--ttl", "1m"]), arr(env))
sys.exit("execve failed: %d" % ctypes.get_errno())
"#;
    let mut agent = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(common::bin())
        .arg(env.join("\n"))
        .current_dir(d)
        .stderr(Stdio::null())
        .spawn()
        .expect("python3");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !d.join(".tpmcrypt-agent.sock").exists() {
        assert!(Instant::now() < deadline, "agent socket never appeared");
        std::thread::sleep(Duration::from_millis(20));
    }
    let exe = fs::read_link(format!("/proc/{}/exe", agent.id())).unwrap();
    let environ = fs::read(format!("/proc/{}/environ", agent.id())).unwrap();
    let _ = agent.kill();
    let _ = agent.wait();
    assert!(exe.ends_with("tpmcrypt-full"), "{}", exe.display());
    let got: Vec<String> = environ
        .split(|&b| b == 0)
        .filter(|v| !v.is_empty())
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect();
    assert_eq!(got, env, "the environment tpmcrypt-full got");
}
