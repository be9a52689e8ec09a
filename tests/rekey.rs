//! End-to-end tests of `tpmcrypt rekey`: files re-encrypted in place to a
//! new recipient set, recovery recipients kept unless told otherwise, a
//! batch that was one session staying one, the boundaries of `--in-place`
//! (not tpmcrypt, no identity, symlinks, hard links, the same file
//! twice), kill -9 at random moments, and the three use cases of the issue
//! on real swtpm instances: a replaced TPM, a retired key, a rotated
//! recovery key.

mod common;
use common::swtpm;

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::{
    assert_error_line, assert_ok, bytes, listing, recovery, rekey_summary, run, tpmcrypt, Run,
};
use serde_json::Value;

const INTEGRITY: i32 = 3;
const USAGE: i32 = 2;
const OTHER: i32 = 1;

fn scratch() -> tempfile::TempDir {
    common::scratch("tpmcrypt-rekey-")
}

/// `inspect --json FILE`: (session id, {(kind, fingerprint)}).
fn who(d: &Path, file: &str) -> (String, BTreeSet<(String, String)>) {
    let r = run(d, &["inspect", "--json", file]);
    assert_ok(&r, "inspect --json");
    let v: Value = serde_json::from_slice(&r.stdout).expect("JSON");
    let set = v["recipients"]
        .as_array()
        .expect("recipients")
        .iter()
        .map(|r| {
            (
                r["kind"].as_str().unwrap().to_string(),
                r["fingerprint"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    (v["session_id"].as_str().unwrap().to_string(), set)
}

/// The fingerprint of the recovery recipient in a header with only it.
fn recovery_fp(d: &Path, recipient: &str) -> String {
    fs::write(d.join(".fp-probe"), b"x").unwrap();
    assert_ok(
        &run(
            d,
            &[
                "encrypt",
                "-R",
                recipient,
                "-o",
                ".fp-probe.tpmc",
                ".fp-probe",
            ],
        ),
        "probe",
    );
    let (_, set) = who(d, ".fp-probe.tpmc");
    fs::remove_file(d.join(".fp-probe")).unwrap();
    fs::remove_file(d.join(".fp-probe.tpmc")).unwrap();
    set.into_iter().next().unwrap().1
}

fn rec(fp: &str) -> (String, String) {
    ("recovery-p256".to_string(), fp.to_string())
}

/// `decrypt -o - FILE` with `args` before it: the plaintext.
fn plaintext(d: &Path, args: &[&str], file: &str) -> Run {
    let mut a = vec!["decrypt"];
    a.extend_from_slice(args);
    a.extend_from_slice(&["-o", "-", file]);
    run(d, &a)
}

// ------------------------------------------------------------ without a TPM

/// A batch of files encrypted together to recovery key 1 is rekeyed,
/// through identity 1, to recovery key 2: each keeps its plaintext, its
/// permissions and its recovery recipient 1 (kept by default, known from
/// -i), gains 2, and the batch shares one new session (one unwrap to
/// decrypt it all). With --drop-recovery, 1 is gone and its identity no
/// longer opens anything.
#[test]
fn a_batch_is_rekeyed_in_place_keeps_its_recovery_and_stays_one_session() {
    let dir = scratch();
    let d = dir.path();
    let r1 = recovery(d, "r1.key");
    let r2 = recovery(d, "r2.key");
    let (fp1, fp2) = (recovery_fp(d, &r1), recovery_fp(d, &r2));
    fs::create_dir(d.join("docs")).unwrap();
    let sizes = [0usize, 1, 5000, 3 << 20, 9 << 20];
    for (i, n) in sizes.iter().enumerate() {
        fs::write(d.join(format!("docs/f{i}")), bytes(*n, i as u64 + 3)).unwrap();
    }
    fs::write(d.join("docs/plain.txt"), b"not encrypted").unwrap();
    assert_ok(
        &run(
            d,
            &[
                "encrypt",
                "-R",
                &r1,
                "--in-place",
                "docs/f0",
                "docs/f1",
                "docs/f2",
                "docs/f3",
                "docs/f4",
            ],
        ),
        "encrypt",
    );
    common::chmod(&d.join("docs/f2.tpmc"), 0o640);
    let (old_session, _) = who(d, "docs/f0.tpmc");

    let r = run(d, &["-v", "rekey", "-i", "r1.key", "-R", &r2, "-r", "docs"]);
    assert_ok(&r, "rekey");
    let line = rekey_summary(&r);
    assert!(
        line.starts_with("tpmcrypt: rekeyed 5 file(s), ")
            && line.contains(
                ", 1 skipped, 0 failed, 1 session key unwrap(s), 0 TPM unbind(s), 1 new session(s)"
            ),
        "{line}"
    );
    let mut sessions = BTreeSet::new();
    for i in 0..sizes.len() {
        let f = format!("docs/f{i}.tpmc");
        let (session, set) = who(d, &f);
        assert_eq!(set, BTreeSet::from([rec(&fp1), rec(&fp2)]), "{f}");
        sessions.insert(session);
    }
    assert_eq!(sessions.len(), 1, "one new session: {sessions:?}");
    assert!(!sessions.contains(&old_session), "a new session");
    assert_eq!(common::mode_of(&d.join("docs/f2.tpmc")), 0o640, "mode kept");
    assert_eq!(
        fs::read(d.join("docs/plain.txt")).unwrap(),
        b"not encrypted"
    );
    assert_eq!(
        listing(&d.join("docs")),
        vec![
            "f0.tpmc",
            "f1.tpmc",
            "f2.tpmc",
            "f3.tpmc",
            "f4.tpmc",
            "plain.txt"
        ],
        "nothing left beside the files"
    );
    let r = run(
        d,
        &["-v", "decrypt", "-i", "r2.key", "-r", "--in-place", "docs"],
    );
    assert_ok(&r, "decrypt with identity 2");
    assert!(
        r.stderr.contains("decrypted 5 file(s)") && r.stderr.contains(", 1 session key unwrap(s)"),
        "{}",
        r.stderr
    );
    for (i, n) in sizes.iter().enumerate() {
        assert_eq!(
            fs::read(d.join(format!("docs/f{i}"))).unwrap(),
            bytes(*n, i as u64 + 3),
            "f{i}"
        );
    }

    // Recovery key 1 retired.
    fs::write(d.join("one"), b"secret one").unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", &r1, "-R", &r2, "--in-place", "one"]),
        "encrypt",
    );
    let r = run(
        d,
        &[
            "rekey",
            "-i",
            "r2.key",
            "-R",
            &r2,
            "--drop-recovery",
            &r1,
            "one.tpmc",
        ],
    );
    assert_ok(&r, "rekey --drop-recovery");
    assert_eq!(who(d, "one.tpmc").1, BTreeSet::from([rec(&fp2)]));
    assert_error_line(
        &plaintext(d, &["-i", "r1.key"], "one.tpmc"),
        INTEGRITY,
        None,
        &[],
        "identity 1 no longer opens it",
    );
    assert_eq!(
        plaintext(d, &["-i", "r2.key"], "one.tpmc").stdout,
        b"secret one"
    );
}

/// A file whose recovery recipient this run does not know (no -R, no
/// keystore key, no -i names it) fails with one line, exit 2, untouched,
/// and costs no unwrap; --no-keep-recovery drops it instead.
#[test]
fn an_unknown_recovery_recipient_is_never_dropped_silently() {
    let dir = scratch();
    let d = dir.path();
    let r1 = recovery(d, "r1.key");
    let r2 = recovery(d, "r2.key");
    let r3 = recovery(d, "r3.key");
    fs::write(d.join("f"), b"data").unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", &r1, "-R", &r2, "--in-place", "f"]),
        "encrypt",
    );
    let before = fs::read(d.join("f.tpmc")).unwrap();
    let r = run(d, &["-v", "rekey", "-i", "r1.key", "-R", &r3, "f.tpmc"]);
    assert_eq!(r.code, USAGE, "{}", r.stderr);
    let errors: Vec<_> = r
        .stderr
        .lines()
        .filter(|l| l.starts_with("error: "))
        .collect();
    assert_eq!(errors.len(), 1, "{}", r.stderr);
    assert!(
        errors[0].starts_with("error: f.tpmc: ") && errors[0].contains("not known here"),
        "{}",
        errors[0]
    );
    assert!(
        rekey_summary(&r).contains(" 0 session key unwrap(s)"),
        "{}",
        r.stderr
    );
    assert_eq!(fs::read(d.join("f.tpmc")).unwrap(), before, "untouched");
    assert_eq!(listing(d), vec!["f.tpmc", "r1.key", "r2.key", "r3.key"]);

    let r = run(
        d,
        &[
            "rekey",
            "-i",
            "r1.key",
            "-R",
            &r3,
            "--no-keep-recovery",
            "f.tpmc",
        ],
    );
    assert_ok(&r, "--no-keep-recovery");
    assert_eq!(
        who(d, "f.tpmc").1,
        BTreeSet::from([rec(&recovery_fp(d, &r3))])
    );
    assert_eq!(plaintext(d, &["-i", "r3.key"], "f.tpmc").stdout, b"data");
}

/// A file encrypted to a recovery key's PEM public key names that key
/// in a stanza of kind `tpm-p256` (the kind of every PEM P-256
/// recipient). Rekeyed through that very key, it keeps the key, now as a
/// recovery recipient; `--no-keep-recovery` or `--drop-recovery` still
/// drop it. The build before dropped it as a TPM recipient, silently
/// (exit 0), and the recovery key no longer opened the file.
#[test]
fn a_recovery_key_given_as_a_pem_is_kept_as_a_recovery_recipient() {
    let dir = scratch();
    let d = dir.path();
    let r1 = recovery(d, "r1.key");
    let r2 = recovery(d, "r2.key");
    let out = std::process::Command::new("openssl")
        .args(["pkey", "-in", "r1.key", "-pubout", "-out", "r1.pub.pem"])
        .current_dir(d)
        .output()
        .expect("openssl");
    assert!(out.status.success(), "{out:?}");
    for f in ["a", "b", "c"] {
        fs::write(d.join(f), f.as_bytes()).unwrap();
        assert_ok(
            &run(d, &["encrypt", "-R", "r1.pub.pem", "--in-place", f]),
            "encrypt",
        );
    }
    let (_, before) = who(d, "a.tpmc");
    assert_eq!(before.len(), 1);
    assert_eq!(before.iter().next().unwrap().0, "tpm-p256");
    let fp1 = recovery_fp(d, &r1);
    assert_eq!(
        before.iter().next().unwrap().1,
        fp1,
        "one fingerprint a key"
    );

    assert_ok(
        &run(d, &["rekey", "-i", "r1.key", "-R", &r2, "a.tpmc"]),
        "rekey",
    );
    let fp2 = recovery_fp(d, &r2);
    assert_eq!(who(d, "a.tpmc").1, BTreeSet::from([rec(&fp1), rec(&fp2)]));
    assert_eq!(plaintext(d, &["-i", "r1.key"], "a.tpmc").stdout, b"a");
    assert_eq!(plaintext(d, &["-i", "r2.key"], "a.tpmc").stdout, b"a");

    for (file, flag) in [
        ("b.tpmc", vec!["--no-keep-recovery"]),
        ("c.tpmc", vec!["--drop-recovery", r1.as_str()]),
    ] {
        let mut args = vec!["rekey", "-i", "r1.key", "-R", &r2];
        args.extend_from_slice(&flag);
        args.push(file);
        assert_ok(&run(d, &args), file);
        assert_eq!(who(d, file).1, BTreeSet::from([rec(&fp2)]), "{flag:?}");
    }

    // An identity given through a pipe (`-i <(cmd)`, here /dev/stdin) is
    // read once: the build before read it twice, found nothing the second
    // time, and called the identity invalid (exit 2).
    let mut child = tpmcrypt(d)
        .args(["rekey", "-i", "/dev/stdin", "-R", &r1, "a.tpmc"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    {
        use std::io::Write as _;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin
            .write_all(&fs::read(d.join("r2.key")).unwrap())
            .unwrap();
    }
    let r: Run = child.wait_with_output().expect("wait").into();
    assert_ok(&r, "rekey -i /dev/stdin");
    assert_eq!(plaintext(d, &["-i", "r1.key"], "a.tpmc").stdout, b"a");
}

/// What rekey must not touch: a file that is not a tpmcrypt file (exit
/// 3), one no identity opens (exit 3), a symlink (exit 2), a file with
/// two names (exit 1), each one line and untouched, the others still
/// done; a file named twice is done once; stdin and a missing recipient
/// are usage errors.
#[test]
fn what_cannot_be_rekeyed_is_left_untouched() {
    let dir = scratch();
    let d = dir.path();
    let r1 = recovery(d, "r1.key");
    let r2 = recovery(d, "r2.key");
    let other = recovery(d, "other.key");
    fs::write(d.join("plain"), b"plain text").unwrap();
    for f in ["a", "b", "linked"] {
        fs::write(d.join(f), f.as_bytes()).unwrap();
    }
    assert_ok(
        &run(d, &["encrypt", "-R", &r1, "--in-place", "a", "b", "linked"]),
        "encrypt",
    );
    fs::write(d.join("theirs"), b"theirs").unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", &other, "--in-place", "theirs"]),
        "encrypt",
    );
    std::os::unix::fs::symlink("a.tpmc", d.join("sym.tpmc")).unwrap();
    fs::hard_link(d.join("linked.tpmc"), d.join("second-name.tpmc")).unwrap();
    let snapshot = |f: &str| fs::read(d.join(f)).unwrap();
    let keep: Vec<(&str, Vec<u8>)> = ["plain", "theirs.tpmc", "linked.tpmc"]
        .iter()
        .map(|f| (*f, snapshot(f)))
        .collect();
    for (file, code, needle) in [
        ("plain", INTEGRITY, "not a tpmcrypt file"),
        ("theirs.tpmc", INTEGRITY, "no identity"),
        ("sym.tpmc", USAGE, "symbolic link"),
        ("linked.tpmc", OTHER, "hard links"),
    ] {
        let r = run(
            d,
            &[
                "rekey",
                "-i",
                "r1.key",
                "-R",
                &r2,
                "--no-keep-recovery",
                file,
            ],
        );
        assert_error_line(&r, code, Some(file), &[needle], file);
    }
    for (f, b) in &keep {
        assert_eq!(&snapshot(f), b, "{f} untouched");
    }
    assert!(fs::symlink_metadata(d.join("sym.tpmc"))
        .unwrap()
        .file_type()
        .is_symlink());

    let r = run(
        d,
        &[
            "rekey",
            "-i",
            "r1.key",
            "-R",
            &r2,
            "--no-keep-recovery",
            "plain",
            "a.tpmc",
            "./a.tpmc",
            "b.tpmc",
        ],
    );
    assert_eq!(r.code, INTEGRITY, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("a.tpmc and ./a.tpmc are the same file: done once"),
        "{}",
        r.stderr
    );
    for f in ["a", "b"] {
        assert_eq!(
            plaintext(d, &["-i", "r2.key"], &format!("{f}.tpmc")).stdout,
            f.as_bytes()
        );
    }

    assert_error_line(
        &run(d, &["rekey", "-R", &r2, "-"]),
        USAGE,
        None,
        &["stdin"],
        "stdin",
    );
    let r = run(d, &["rekey", "a.tpmc"]);
    assert_eq!(r.code, USAGE, "no recipient: {}", r.stderr);
    let r = run(d, &["rekey", "-R", &r2, "--drop-recovery", &r2, "a.tpmc"]);
    assert_error_line(&r, USAGE, None, &["no recipient left"], "all dropped");
}

/// kill -9 at random moments of a rekey of several files: after each kill
/// every file is under its name, complete, and decrypts to its plaintext
/// (with the old or the new identity: it is the old or the new
/// ciphertext, never neither), and the next run finishes the job and
/// leaves nothing beside the files.
#[test]
fn kill_9_at_any_moment_leaves_each_file_old_or_new() {
    let dir = scratch();
    let d = dir.path();
    let r1 = recovery(d, "r1.key");
    let r2 = recovery(d, "r2.key");
    let (id1, id2) = (
        fs::read_to_string(d.join("r1.key")).unwrap(),
        fs::read_to_string(d.join("r2.key")).unwrap(),
    );
    let fp2 = recovery_fp(d, &r2);
    fs::create_dir(d.join("v")).unwrap();
    let plain: Vec<Vec<u8>> = (0..6)
        .map(|i| bytes((i + 1) * (3 << 20) / 2, i as u64 + 11))
        .collect();
    let mut rng = common::Rng(0x5eed_4e6b_e71c_0001);
    let mut delay = common::KillDelay::new(300_000, 1_000, 5_000_000); // µs
    let (mut mid, mut trials) = (0, 0);
    let want = common::kill_trials();
    while trials < want || (mid == 0 && trials < 3 * want) {
        trials += 1;
        for (i, p) in plain.iter().enumerate() {
            fs::write(d.join(format!("v/f{i}")), p).unwrap();
        }
        assert_ok(
            &run(d, &["encrypt", "-q", "-R", &r1, "--in-place", "-r", "v"]),
            "encrypt",
        );
        let mut child = tpmcrypt(d)
            .args([
                "rekey",
                "-q",
                "-i",
                "r1.key",
                "-R",
                &r2,
                "--no-keep-recovery",
                "-r",
                "v",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_micros(delay.pick(&mut rng)));
        let _ = child.kill();
        let status = child.wait().unwrap();
        let mut new = 0;
        for (i, p) in plain.iter().enumerate() {
            let f = d.join(format!("v/f{i}.tpmc"));
            assert!(f.exists(), "trial {trials}: f{i}.tpmc missing");
            let is_new = who(d, &format!("v/f{i}.tpmc")).1 == BTreeSet::from([rec(&fp2)]);
            let id = if is_new { &id2 } else { &id1 };
            assert!(
                common::decrypt_in_process(id, &f) == *p,
                "trial {trials}: f{i} wrong"
            );
            new += usize::from(is_new);
        }
        if new == plain.len() {
            delay.finished();
        } else if new == 0 && listing(&d.join("v")).len() == plain.len() {
            delay.not_begun();
        } else {
            mid += 1;
        }
        assert!(
            status.code() != Some(0) || new == plain.len(),
            "exit 0 with files left old"
        );
        // The next run finishes, and leaves nothing but the files.
        assert_ok(
            &run(
                d,
                &[
                    "rekey",
                    "-q",
                    "-i",
                    "r1.key",
                    "-i",
                    "r2.key",
                    "-R",
                    &r2,
                    "--no-keep-recovery",
                    "-r",
                    "v",
                ],
            ),
            "next run",
        );
        let names = listing(&d.join("v"));
        assert_eq!(names.len(), plain.len(), "trial {trials}: {names:?}");
        for (i, p) in plain.iter().enumerate() {
            assert!(common::decrypt_in_process(&id2, &d.join(format!("v/f{i}.tpmc"))) == *p);
            fs::remove_file(d.join(format!("v/f{i}.tpmc"))).unwrap();
        }
    }
    assert!(mid > 0, "no kill landed mid-run in {trials} trials");
    eprintln!("rekey kill -9: {trials} trials, {mid} mid-run");
}

/// kill -9 at the two moments of a replacement (a hook of debug builds,
/// `TPMCRYPT_REKEY_TEST_CRASH_AT`): once the new file is durable and the
/// original checked, before the exchange (every file is still the old
/// ciphertext, the batch's temporaries beside them); and after the first
/// exchange, before the displaced original is removed (the first file is
/// the new ciphertext, the old one under a temporary name). Either way the next run finishes
/// and leaves nothing but the files.
#[test]
fn kill_inside_a_replacement_leaves_each_file_old_or_new() {
    let dir = scratch();
    let d = dir.path();
    let r1 = recovery(d, "r1.key");
    let r2 = recovery(d, "r2.key");
    let fp2 = recovery_fp(d, &r2);
    let id2 = fs::read_to_string(d.join("r2.key")).unwrap();
    for (at, first_new) in [("checked", false), ("exchanged", true)] {
        let v = d.join(at);
        fs::create_dir(&v).unwrap();
        for i in 0..3 {
            fs::write(v.join(format!("f{i}")), bytes(70_000 * (i + 1), i as u64)).unwrap();
        }
        assert_ok(
            &run(d, &["encrypt", "-R", &r1, "--in-place", "-r", at]),
            "encrypt",
        );
        let args = [
            "rekey",
            "-i",
            "r1.key",
            "-R",
            &r2,
            "--no-keep-recovery",
            "-r",
            at,
        ];
        let out = tpmcrypt(d)
            .env("TPMCRYPT_REKEY_TEST_CRASH_AT", at)
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), None, "{at}: killed by its signal");
        let names = listing(&v);
        // The batch's three temporaries (one of them, after the exchange,
        // holding the displaced original) beside the three files.
        let partials = names
            .iter()
            .filter(|n| n.contains(".tpmcrypt-partial."))
            .count();
        assert_eq!((names.len(), partials), (6, 3), "{at}: {names:?}");
        for i in 0..3 {
            let is_new = who(d, &format!("{at}/f{i}.tpmc")).1 == BTreeSet::from([rec(&fp2)]);
            assert_eq!(is_new, first_new && i == 0, "{at}: f{i}");
        }
        let mut again = vec!["rekey", "-i", "r1.key", "-i", "r2.key"];
        again.extend_from_slice(&args[3..]);
        assert_ok(&run(d, &again), "next run");
        assert_eq!(listing(&v), vec!["f0.tpmc", "f1.tpmc", "f2.tpmc"], "{at}");
        for i in 0..3 {
            let got = common::decrypt_in_process(&id2, &v.join(format!("f{i}.tpmc")));
            assert!(got == bytes(70_000 * (i + 1), i as u64), "{at}: f{i}");
        }
    }
}

/// Run as root, a rekey of another user's file keeps its owner, group and
/// mode; run as that other user, a rekey of root's file (in a directory
/// it may write) is refused before anything is written, in a line that
/// speaks of replacing it (rekey has no --in-place flag to name).
#[test]
fn rekey_keeps_the_owner_and_refuses_what_it_cannot_give_back() {
    use std::os::unix::fs::MetadataExt;
    let dir = scratch();
    let d = dir.path();
    common::chmod(d, 0o755);
    let r1 = recovery(d, "r1.key");
    let r2 = recovery(d, "r2.key");
    common::chmod(&d.join("r1.key"), 0o644);
    let sub = d.join("sub");
    fs::create_dir(&sub).unwrap();
    std::os::unix::fs::chown(&sub, Some(65534), Some(65534)).unwrap();
    for f in ["theirs", "roots"] {
        fs::write(sub.join(f), f.as_bytes()).unwrap();
        assert_ok(
            &run(
                d,
                &["encrypt", "-R", &r1, "--in-place", &format!("sub/{f}")],
            ),
            "encrypt",
        );
    }
    let theirs = sub.join("theirs.tpmc");
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).expect("chown (tests run as root)");
    common::chmod(&theirs, 0o640);
    common::chmod(&sub.join("roots.tpmc"), 0o644);
    assert_ok(
        &run(d, &["rekey", "-i", "r1.key", "-R", &r2, "sub/theirs.tpmc"]),
        "rekey as root",
    );
    let m = fs::metadata(&theirs).unwrap();
    assert_eq!(
        (m.uid(), m.gid(), common::mode_of(&theirs)),
        (65534, 65534, 0o640)
    );
    let before = fs::read(sub.join("roots.tpmc")).unwrap();
    let out = common::wrapper(&sub, "setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(common::bin())
        .args(["rekey", "-i", "../r1.key", "-R", &r2, "roots.tpmc"])
        .env("TPMCRYPT_HOME", sub.join(".home"))
        .output()
        .expect("setpriv (util-linux)");
    let res: Run = out.into();
    assert_error_line(
        &res,
        OTHER,
        Some("roots.tpmc"),
        &["owner", "replacing it"],
        "root's file",
    );
    assert!(!res.stderr.contains("--in-place"), "{}", res.stderr);
    assert_eq!(fs::read(sub.join("roots.tpmc")).unwrap(), before);
    assert_eq!(
        listing(&sub),
        vec!["roots.tpmc", "theirs.tpmc"],
        "nothing written"
    );
}

// ------------------------------------------------------------ on swtpm

fn tc(d: &Path, tcti: &str, args: &[&str]) -> Run {
    let mut a = vec!["--tpm", tcti];
    a.extend_from_slice(args);
    run(d, &a)
}

/// The fingerprint `key create` reports.
fn create_key(d: &Path, tcti: &str, name: &str, recovery: &str) -> String {
    let r = tc(d, tcti, &["key", "create", name, "--recovery", recovery]);
    assert_ok(&r, "key create");
    let out = String::from_utf8_lossy(&r.stdout).into_owned();
    let line = out
        .lines()
        .find(|l| l.starts_with("created key "))
        .expect("created key");
    line.rsplit("fingerprint ")
        .next()
        .unwrap()
        .trim()
        .to_string()
}

/// `n` files in `dir`, encrypted together to key `key`.
fn batch(d: &Path, dir: &str, key: &str, n: usize) {
    fs::create_dir(d.join(dir)).unwrap();
    for i in 0..n {
        fs::write(d.join(format!("{dir}/f{i}")), bytes(i * 999 + 1, i as u64)).unwrap();
    }
    assert_ok(
        &run(d, &["encrypt", "-k", key, "--in-place", "-r", dir]),
        "encrypt",
    );
}

fn check_batch(d: &Path, dir: &str, n: usize, want: &BTreeSet<(String, String)>) {
    let mut sessions = BTreeSet::new();
    for i in 0..n {
        let (s, set) = who(d, &format!("{dir}/f{i}.tpmc"));
        assert_eq!(&set, want, "{dir}/f{i}.tpmc");
        sessions.insert(s);
    }
    assert_eq!(sessions.len(), 1, "{dir}: one session");
}

fn decrypts_with_one_unbind(d: &Path, tcti: &str, dir: &str, n: usize, extra: &[&str]) {
    let mut a = vec!["-v", "decrypt", "-r", "--in-place"];
    a.extend_from_slice(extra);
    a.push(dir);
    let r = tc(d, tcti, &a);
    assert_ok(&r, "decrypt");
    assert!(
        r.stderr.contains(&format!("decrypted {n} file(s)"))
            && r.stderr
                .contains("0 failed, 1 session key unwrap(s), 1 TPM unbind(s)"),
        "{}",
        r.stderr
    );
    for i in 0..n {
        assert_eq!(
            fs::read(d.join(format!("{dir}/f{i}"))).unwrap(),
            bytes(i * 999 + 1, i as u64)
        );
    }
}

/// The issue's three use cases on swtpm.
/// (1) TPM replaced: files for key A of TPM 1; TPM 1 is gone (its state
/// removed); `rekey -i recovery.key -k B` (B on TPM 2) needs no TPM and
/// one unwrap; then the batch decrypts with B for one unbind.
/// (2) key retired: rekey from A (unbound once, on the TPM) to B; the
/// files no longer name A and still name the recovery key.
/// (3) recovery key rotated: `-k A -R NEW --drop-recovery OLD`: the old
/// recovery key opens nothing, the new one everything.
#[test]
fn a_replaced_tpm_a_retired_key_and_a_rotated_recovery_key() {
    let dir = scratch();
    let d = dir.path();
    let r1 = recovery(d, "recovery.key");
    let fp1 = recovery_fp(d, &r1);
    let n = 20;

    // (1) TPM replaced.
    let tpm1 = swtpm(d, "tpm1");
    let fa = create_key(d, &tpm1.tcti(), "a", &r1);
    batch(d, "one", "a", n);
    tpm1.stop();
    fs::remove_dir_all(d.join("tpm1")).unwrap();
    let tpm2 = swtpm(d, "tpm2");
    let t2 = tpm2.tcti();
    let fb = create_key(d, &t2, "b", &r1);
    let r = tc(
        d,
        &t2,
        &["-v", "rekey", "-i", "recovery.key", "-k", "b", "-r", "one"],
    );
    assert_ok(&r, "rekey after the TPM was replaced");
    assert!(
        rekey_summary(&r).contains(&format!("rekeyed {n} file(s)")),
        "{}",
        r.stderr
    );
    assert!(
        rekey_summary(&r).contains("1 session key unwrap(s), 0 TPM unbind(s), 1 new session(s)"),
        "{}",
        r.stderr
    );
    let tpm_b = ("tpm-p256".to_string(), fb.clone());
    check_batch(d, "one", n, &BTreeSet::from([tpm_b.clone(), rec(&fp1)]));
    decrypts_with_one_unbind(d, &t2, "one", n, &[]);

    // (2) Key retired: c on TPM 2, files rekeyed from c (the TPM) to b.
    let fc = create_key(d, &t2, "c", &r1);
    batch(d, "two", "c", n);
    let r = tc(d, &t2, &["-v", "rekey", "-k", "b", "-r", "two"]);
    assert_ok(&r, "rekey from c to b");
    assert!(
        rekey_summary(&r).contains("1 session key unwrap(s), 1 TPM unbind(s), 1 new session(s)"),
        "{}",
        r.stderr
    );
    check_batch(d, "two", n, &BTreeSet::from([tpm_b.clone(), rec(&fp1)]));
    for i in 0..n {
        let (_, set) = who(d, &format!("two/f{i}.tpmc"));
        assert!(
            !set.iter().any(|(_, fp)| *fp == fc || *fp == fa),
            "names a retired key"
        );
    }
    decrypts_with_one_unbind(d, &t2, "two", n, &[]);

    // (3) Recovery key rotated, on files for b.
    let r2 = recovery(d, "recovery2.key");
    let fp2 = recovery_fp(d, &r2);
    batch(d, "three", "b", n);
    let r = tc(
        d,
        &t2,
        &[
            "-v",
            "rekey",
            "-k",
            "b",
            "-R",
            &r2,
            "--drop-recovery",
            &r1,
            "-r",
            "three",
        ],
    );
    assert_ok(&r, "rekey rotating the recovery key");
    assert!(
        r.stderr
            .contains("warning: key b still adds the dropped recovery recipient"),
        "{}",
        r.stderr
    );
    check_batch(d, "three", n, &BTreeSet::from([tpm_b, rec(&fp2)]));
    let empty = d.join("empty-keystore");
    let no_keys = ["--keystore", empty.to_str().unwrap()];
    let mut a = no_keys.to_vec();
    a.extend_from_slice(&["-i", "recovery.key"]);
    assert_eq!(
        plaintext(d, &a, "three/f3.tpmc").code,
        INTEGRITY,
        "old recovery key"
    );
    let mut a = no_keys.to_vec();
    a.extend_from_slice(&["-i", "recovery2.key"]);
    let r = plaintext(d, &a, "three/f3.tpmc");
    assert_ok(&r, "new recovery key");
    assert_eq!(r.stdout, bytes(3 * 999 + 1, 3));
    decrypts_with_one_unbind(d, &t2, "three", n, &[]);
    let handles = common::tpm_handles(&tpm2, d);
    assert!(handles.is_empty(), "the TPM still holds {handles:?}");
}

/// An armored file (`encrypt -a`), which `-r` picks by content, is
/// rekeyed like a binary one and stays armored: rekey keeps a file's
/// format as it keeps its payload parameters.
#[test]
fn an_armored_file_is_rekeyed_and_stays_armored() {
    let dir = scratch();
    let d = dir.path();
    let r1 = recovery(d, "r1.key");
    let r2 = recovery(d, "r2.key");
    let (fp1, fp2) = (recovery_fp(d, &r1), recovery_fp(d, &r2));
    fs::create_dir(d.join("docs")).unwrap();
    let sizes = [0usize, 70_000];
    for (i, n) in sizes.iter().enumerate() {
        fs::write(d.join(format!("docs/a{i}")), bytes(*n, i as u64 + 11)).unwrap();
    }
    fs::write(d.join("docs/b"), b"binary one").unwrap();
    assert_ok(
        &run(
            d,
            &[
                "encrypt",
                "-a",
                "-R",
                &r1,
                "--in-place",
                "docs/a0",
                "docs/a1",
            ],
        ),
        "encrypt -a",
    );
    assert_ok(
        &run(d, &["encrypt", "-R", &r1, "--in-place", "docs/b"]),
        "encrypt",
    );

    let r = run(d, &["-v", "rekey", "-i", "r1.key", "-R", &r2, "-r", "docs"]);
    assert_ok(&r, "rekey of armored and binary files");
    assert!(
        rekey_summary(&r).starts_with("tpmcrypt: rekeyed 3 file(s), "),
        "{}",
        r.stderr
    );
    for (i, n) in sizes.iter().enumerate() {
        let f = format!("docs/a{i}.tpmc");
        let text = fs::read(d.join(&f)).unwrap();
        assert!(
            text.starts_with(b"-----BEGIN TPMCRYPT ENCRYPTED FILE-----\n"),
            "{f} stays armored"
        );
        assert_eq!(who(d, &f).1, BTreeSet::from([rec(&fp1), rec(&fp2)]), "{f}");
        assert_eq!(
            plaintext(d, &["-i", "r2.key"], &f).stdout,
            bytes(*n, i as u64 + 11),
            "{f}"
        );
    }
    let b = fs::read(d.join("docs/b.tpmc")).unwrap();
    assert!(!b.starts_with(b"-----"), "a binary file stays binary");
    assert_eq!(
        plaintext(d, &["-i", "r2.key"], "docs/b.tpmc").stdout,
        b"binary one"
    );
    assert_eq!(
        listing(&d.join("docs")),
        vec!["a0.tpmc", "a1.tpmc", "b.tpmc"]
    );
}
