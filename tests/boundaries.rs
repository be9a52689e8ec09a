//! Trust boundaries seen from a hostile local user: another uid that gets to
//! a path first (the agent's socket directory, a socket it listens on) must
//! never receive a session key, and the victim is told so.
//!
//! The other user is uid 65534 (nobody), impersonated with `setpriv`, so
//! these tests run as root, as CI does.

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{assert_ok, bytes, recovery, tpmcrypt, Run};

const NOBODY: u32 = 65534;

fn scratch() -> tempfile::TempDir {
    let dir = common::scratch("tpmcrypt-boundary-");
    // The other user must be able to reach the places it squats.
    common::chmod(dir.path(), 0o755);
    dir
}

fn require_root() {
    // SAFETY: geteuid cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "these tests impersonate another local user (setpriv, chown): run them as root, as CI does"
    );
}

fn chown(path: &Path, uid: u32) {
    std::os::unix::fs::lchown(path, Some(uid), Some(uid))
        .unwrap_or_else(|e| panic!("chown {}: {e}", path.display()));
}

/// A directory owned by the other user, created as root then given away.
fn their_dir(path: &Path, mode: u32) {
    fs::create_dir_all(path).expect("mkdir");
    common::chmod(path, mode);
    chown(path, NOBODY);
}

/// A fake agent run by the other user: it answers the agent protocol as a
/// real agent would (so an unchecking client goes on and sends its keys)
/// and records every request it receives, in hex, one per line.
const SQUATTER: &str = r#"
import os, socket, sys
path, log = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
os.chmod(path, 0o666)
s.listen(16)
open(log + ".ready", "w").close()
while True:
    c, _ = s.accept()
    data = b""
    while True:
        chunk = c.recv(128)
        if not chunk:
            break
        data += chunk
    with open(log, "a") as f:
        f.write(data.hex() + "\n")
    op = data[1] if len(data) > 1 else 0
    c.sendall({1: b"\x01", 2: b"\x00", 4: b"\x00\x00\x00\x00\x00"}.get(op, b"\x02"))
    c.close()
"#;

struct Squatter {
    child: Child,
    log: PathBuf,
}

impl Squatter {
    /// Starts the fake agent as uid 65534, listening at `socket`; its log
    /// lives in `logdir` (writable by it).
    fn start(dir: &Path, socket: &Path, logdir: &Path) -> Squatter {
        require_root();
        let script = dir.join("squatter.py");
        fs::write(&script, SQUATTER).expect("script");
        common::chmod(&script, 0o644);
        let log = logdir.join("received");
        let child = Command::new("setpriv")
            .args([
                "--reuid",
                "65534",
                "--regid",
                "65534",
                "--clear-groups",
                "/usr/bin/python3",
            ])
            .arg(&script)
            .arg(socket)
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn setpriv python3 (util-linux, python3)");
        let ready = logdir.join("received.ready");
        let start = Instant::now();
        while !ready.exists() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the fake agent did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Squatter { child, log }
    }

    /// What the victim sent it, one request per line. A connection on
    /// which no byte came (how a client learns the peer's uid) is no line.
    fn received(&self) -> Vec<String> {
        fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect()
    }
}

impl Drop for Squatter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A file encrypted to a fresh recovery identity `rec.key` in `d`.
fn encrypted_file(d: &Path) -> PathBuf {
    let rec = recovery(d, "rec.key");
    fs::write(d.join("secret.txt"), bytes(5000, 3)).unwrap();
    let r = common::run(d, &["encrypt", "-R", &rec, "secret.txt"]);
    assert_ok(&r, "encrypt");
    d.join("secret.txt.tpmc")
}

fn decrypt_with(d: &Path, env: &[(&str, &Path)], remove: &[&str]) -> Run {
    let mut cmd = tpmcrypt(d);
    cmd.args(["decrypt", "-i", "rec.key", "-o", "-", "secret.txt.tpmc"]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    for k in remove {
        cmd.env_remove(k);
    }
    cmd.output().expect("spawn").into()
}

fn assert_refused_and_nothing_sent(r: &Run, squatter: &Squatter, needles: &[&str], what: &str) {
    assert_eq!(
        r.code, 0,
        "{what}: decrypt goes on without the agent: {}",
        r.stderr
    );
    assert_eq!(r.stdout, bytes(5000, 3), "{what}: plaintext");
    assert_eq!(
        squatter.received(),
        Vec::<String>::new(),
        "{what}: the other user's listener received requests (a session key is 66 bytes: 0102…)"
    );
    let warning = r
        .stderr
        .lines()
        .find(|l| l.starts_with("warning: not using the agent"))
        .unwrap_or_else(|| panic!("{what}: no warning about the agent in {:?}", r.stderr));
    for n in needles {
        assert!(warning.contains(n), "{what}: {n:?} not in {warning:?}");
    }
}

#[test]
fn a_socket_in_another_users_directory_gets_nothing() {
    let dir = scratch();
    let d = dir.path();
    encrypted_file(d);
    let theirs = d.join("theirs");
    their_dir(&theirs, 0o755);
    let sock = theirs.join("agent.sock");
    let squatter = Squatter::start(d, &sock, &theirs);
    let r = decrypt_with(d, &[("TPMCRYPT_AGENT_SOCK", &sock)], &[]);
    assert_refused_and_nothing_sent(
        &r,
        &squatter,
        &["owned by uid 65534, not by you"],
        "TPMCRYPT_AGENT_SOCK in another user's directory",
    );
}

#[test]
fn the_tmp_fallback_squatted_by_another_user_gets_nothing() {
    // No XDG_RUNTIME_DIR (cron, ssh without pam_systemd): the socket is
    // looked for under $TMPDIR/tpmcrypt-UID, which the other user made first.
    let dir = scratch();
    let d = dir.path();
    encrypted_file(d);
    let tmp = d.join("tmp");
    fs::create_dir(&tmp).unwrap();
    common::chmod(&tmp, 0o1777);
    // SAFETY: geteuid cannot fail.
    let base = tmp.join(format!("tpmcrypt-{}", unsafe { libc::geteuid() }));
    their_dir(&base, 0o777);
    their_dir(&base.join("tpmcrypt"), 0o777);
    let sock = base.join("tpmcrypt/agent.sock");
    let squatter = Squatter::start(d, &sock, &base);
    let r = decrypt_with(
        d,
        &[("TMPDIR", &tmp)],
        &["TPMCRYPT_AGENT_SOCK", "XDG_RUNTIME_DIR"],
    );
    assert_refused_and_nothing_sent(&r, &squatter, &["tpmcrypt-0"], "squatted /tmp fallback");

    // The victim's own agent refuses to start there, naming the directory.
    let mut cmd = tpmcrypt(d);
    cmd.args(["agent", "--ttl", "1m"])
        .env("TMPDIR", &tmp)
        .env_remove("TPMCRYPT_AGENT_SOCK")
        .env_remove("XDG_RUNTIME_DIR");
    let r: Run = cmd.output().expect("spawn").into();
    common::assert_error_line(
        &r,
        1,
        None,
        &["tpmcrypt-0", "owned by uid 65534"],
        "agent in a squatted directory",
    );
}

#[test]
fn a_listener_of_another_uid_behind_our_own_paths_gets_nothing() {
    // Every path checks out (our directory, 0700; a socket file we own), but
    // the process listening on it is another user's: only SO_PEERCRED on
    // the client side can tell.
    let dir = scratch();
    let d = dir.path();
    encrypted_file(d);
    let ours = d.join("ours");
    their_dir(&ours, 0o777);
    let logdir = d.join("log");
    their_dir(&logdir, 0o755);
    let sock = ours.join("agent.sock");
    let squatter = Squatter::start(d, &sock, &logdir);
    chown(&sock, 0);
    common::chmod(&sock, 0o600);
    chown(&ours, 0);
    common::chmod(&ours, 0o700);
    assert_eq!(fs::metadata(&sock).unwrap().uid(), 0);
    let r = decrypt_with(d, &[("TPMCRYPT_AGENT_SOCK", &sock)], &[]);
    assert_refused_and_nothing_sent(
        &r,
        &squatter,
        &["runs as uid 65534", "nothing was sent"],
        "listener of another uid",
    );
}

#[test]
fn a_world_writable_socket_directory_of_our_own_is_refused() {
    // Our own directory, but anyone may swap the socket in it.
    let dir = scratch();
    let d = dir.path();
    encrypted_file(d);
    let loose = d.join("loose");
    fs::create_dir(&loose).unwrap();
    let logdir = d.join("log");
    their_dir(&logdir, 0o755);
    common::chmod(&loose, 0o777);
    let sock = loose.join("agent.sock");
    let squatter = Squatter::start(d, &sock, &logdir);
    let r = decrypt_with(d, &[("TPMCRYPT_AGENT_SOCK", &sock)], &[]);
    assert_refused_and_nothing_sent(
        &r,
        &squatter,
        &["writable by other users (mode 0777)"],
        "world-writable socket directory",
    );
    assert_eq!(
        fs::metadata(&loose).unwrap().permissions().mode() & 0o777,
        0o777
    );
}

// ------------------------------------------------ exit codes tell the truth

fn run_env(d: &Path, env: &[(&str, &str)], args: &[&str]) -> Run {
    let mut cmd = tpmcrypt(d);
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("spawn").into()
}

/// (environment, arguments, what the error line names).
type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str], &'a [&'a str]);

#[test]
fn bad_values_of_tpm_pcrs_and_ttl_are_usage_errors() {
    let dir = scratch();
    let d = dir.path();
    encrypted_file(d);
    let cases: [Case; 6] = [
        (
            &[],
            &["key", "create", "k", "--pcrs", "sha256:0,99"],
            &["--pcrs", "99"],
        ),
        (
            &[],
            &["key", "create", "k", "--pcrs", "md5:0"],
            &["--pcrs", "md5"],
        ),
        (
            &[],
            &[
                "--tpm",
                "bogus:x",
                "decrypt",
                "-i",
                "rec.key",
                "secret.txt.tpmc",
            ],
            &["--tpm", "bogus"],
        ),
        (
            &[("TPMCRYPT_TCTI", "swtpm:host=127.0.0.1,port=99999")],
            &["decrypt", "-i", "rec.key", "secret.txt.tpmc"],
            &["--tpm", "99999"],
        ),
        (&[], &["agent", "--ttl", "5x"], &["--ttl", "5x"]),
        (&[], &["agent", "--ttl", "0s"], &["--ttl", "0s"]),
    ];
    for (env, args, needles) in cases {
        let r = run_env(d, env, args);
        common::assert_error_line(&r, 2, None, needles, &format!("{args:?}"));
    }
}

/// A real `TSS2 PRIVATE KEY` file (written by tpm2-tools), for the keystore
/// commands that never touch a TPM.
fn tools_key(d: &Path) -> PathBuf {
    let src =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tpmkey/tests/data/tpm2-tools-rsa2048.pem");
    let dst = d.join("tools.pem");
    fs::copy(&src, &dst).expect("copy the key file");
    dst
}

#[test]
fn a_key_that_exists_is_exit_1_and_a_cause_is_printed_once() {
    let dir = scratch();
    let d = dir.path();
    tools_key(d);
    assert_ok(
        &common::run(
            d,
            &["key", "import", "tools.pem", "--name", "k", "--no-pin"],
        ),
        "import",
    );
    let again = common::run(
        d,
        &["key", "import", "tools.pem", "--name", "k", "--no-pin"],
    );
    common::assert_error_line(
        &again,
        1,
        None,
        &["\"k\"", "exists already"],
        "import twice",
    );
    let create = common::run(d, &["key", "create", "k"]);
    common::assert_error_line(
        &create,
        1,
        None,
        &["\"k\"", "exists already"],
        "create over",
    );
    let missing = common::run(d, &["key", "import", "missing.pem", "--name", "m"]);
    common::assert_error_line(&missing, 1, None, &["missing.pem"], "import a missing file");
    assert_eq!(
        missing.stderr.matches("missing.pem").count(),
        1,
        "the path is named once: {}",
        missing.stderr
    );
    assert_eq!(
        missing
            .stderr
            .to_lowercase()
            .matches("no such file")
            .count(),
        1,
        "the cause is printed once: {}",
        missing.stderr
    );
}

// ------------------------------------- destroying a private key is confirmed

#[test]
fn destroying_a_private_key_needs_confirmation_everywhere() {
    let dir = scratch();
    let d = dir.path();
    let sim = |args: &[&str]| {
        let mut all = vec!["--simulator"];
        all.extend_from_slice(args);
        common::run(d, &all)
    };
    assert_ok(&sim(&["key", "create", "k"]), "create");
    let key = d.join(".tpmcrypt-home/k.key.pem");
    let before = fs::read(&key).unwrap();
    let r = sim(&["key", "create", "k", "--force"]);
    common::assert_error_line(
        &r,
        2,
        None,
        &["destroy the existing key k", "become unreadable", "--yes"],
        "create --force without --yes",
    );
    assert_eq!(fs::read(&key).unwrap(), before, "the key was not replaced");
    assert_ok(
        &sim(&["key", "create", "k", "--force", "--yes"]),
        "create --force --yes",
    );
    assert_ne!(fs::read(&key).unwrap(), before, "replaced once confirmed");

    recovery(d, "rec.key");
    let before = fs::read(d.join("rec.key")).unwrap();
    let r = common::run(d, &["recovery", "create", "--out", "rec.key", "--force"]);
    common::assert_error_line(
        &r,
        2,
        None,
        &["overwrite the recovery identity rec.key", "--yes"],
        "recovery create --force without --yes",
    );
    assert_eq!(fs::read(d.join("rec.key")).unwrap(), before);
    let r = common::run(
        d,
        &["recovery", "create", "--out", "rec.key", "--force", "--yes"],
    );
    assert_ok(&r, "recovery create --force --yes");
    assert_ne!(fs::read(d.join("rec.key")).unwrap(), before);
    assert_eq!(common::mode_of(&d.join("rec.key")), 0o600);
    assert_eq!(
        common::listing(d)
            .iter()
            .filter(|n| n.contains("rec.key"))
            .count(),
        1,
        "no temporary left: {:?}",
        common::listing(d)
    );
}
