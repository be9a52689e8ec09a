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

/// tpmcrypt run in `d` as the other user, its home and agent socket in `d`.
fn run_as_other_user(d: &Path, args: &[&str]) -> Run {
    let out = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(common::bin())
        .args(args)
        .current_dir(d)
        .env("TPMCRYPT_HOME", d.join("home"))
        .env("TPMCRYPT_AGENT_SOCK", d.join("agent.sock"))
        .output()
        .expect("setpriv");
    out.into()
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
    try:
        while True:
            chunk = c.recv(128)
            if not chunk:
                break
            data += chunk
        op = data[1] if len(data) > 1 else 0
        c.sendall({1: b"\x01", 2: b"\x00", 4: b"\x00\x00\x00\x00\x00"}.get(op, b"\x02"))
    except OSError:
        pass
    with open(log, "a") as f:
        f.write(data.hex() + "\n")
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

/// An agent process, killed however the test ends (a failed assertion
/// included).
struct Stop(std::process::Child);

impl Drop for Stop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `tpmcrypt agent` with its socket at `sock` and waits for it.
fn start_agent(d: &Path, sock: &Path) -> std::process::Child {
    let agent = tpmcrypt(d)
        .args(["agent", "--ttl", "1m"])
        .env("TPMCRYPT_AGENT_SOCK", sock)
        .stderr(Stdio::null())
        .spawn()
        .expect("agent");
    let start = Instant::now();
    while !common::agent_socket_ready(sock) {
        assert!(start.elapsed() < Duration::from_secs(10), "no socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    agent
}

/// `encrypt` runs started at the same moment, none finding a session in
/// the agent, all end up in one: the agent keeps the first session handed
/// to it and gives it to the others in answer, instead of letting each
/// replace the one before (the build before: 2 or 3 sessions of 32 runs,
/// so that decrypting them cost as many TPM unbinds).
#[test]
fn encrypt_runs_started_together_share_one_session() {
    let dir = scratch();
    let d = dir.path();
    let rec = recovery(d, "rec.key");
    let sock = d.join("agent.sock");
    let mut agent = Stop(start_agent(d, &sock));
    const N: usize = 32;
    for round in 0..3 {
        let children: Vec<_> = (0..N)
            .map(|i| {
                let name = format!("f{round}-{i}");
                fs::write(d.join(&name), bytes(100 + i, i as u64)).unwrap();
                tpmcrypt(d)
                    .env("TPMCRYPT_AGENT_SOCK", &sock)
                    .args(["encrypt", "-R", &rec, &name])
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("encrypt")
            })
            .collect();
        for c in children {
            let out = c.wait_with_output().unwrap();
            assert!(out.status.success(), "{out:?}");
        }
        let ids: std::collections::BTreeSet<String> = (0..N)
            .map(|i| {
                let r = common::run(d, &["inspect", "--json", &format!("f{round}-{i}.tpmc")]);
                assert_ok(&r, "inspect");
                let v: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
                v["session_id"].to_string()
            })
            .collect();
        assert_eq!(
            ids.len(),
            1,
            "round {round}: {N} runs in {} sessions",
            ids.len()
        );
        // The next round starts without a session.
        drop(agent);
        let _ = fs::remove_file(&sock);
        agent = Stop(start_agent(d, &sock));
    }
    drop(agent);
}

/// An agent that runs out of file descriptors for a while (its accept
/// fails with EMFILE) waits and goes on serving once it has them again;
/// meanwhile encrypt runs go on without it. The build before exited
/// (status 1), and nothing started it again outside systemd.
#[test]
fn an_agent_out_of_descriptors_for_a_while_goes_on() {
    let dir = scratch();
    let d = dir.path();
    let rec = recovery(d, "rec.key");
    let sock = d.join("agent.sock");
    let mut agent = Stop(start_agent(d, &sock));
    let pid = agent.0.id();
    let prlimit = |limit: &str| {
        let out = Command::new("prlimit")
            .args(["--pid", &pid.to_string(), &format!("--nofile={limit}:")])
            .output()
            .expect("prlimit");
        assert!(out.status.success(), "{out:?}");
    };
    // The lowest free descriptor as the soft limit (the hard one stays):
    // the next accept fails.
    let free = (0..)
        .find(|fd| !Path::new(&format!("/proc/{pid}/fd/{fd}")).exists())
        .unwrap();
    prlimit(&free.to_string());
    let encrypt = |name: &str| {
        fs::write(d.join(name), b"data").unwrap();
        let out = tpmcrypt(d)
            .env("TPMCRYPT_AGENT_SOCK", &sock)
            .args(["-v", "encrypt", "-R", &rec, name])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let first = encrypt("a");
    assert!(first.contains("a session of its own"), "{first}");
    std::thread::sleep(Duration::from_millis(300));
    assert!(agent.0.try_wait().unwrap().is_none(), "the agent exited");
    prlimit("1024");
    let second = encrypt("b");
    assert!(second.contains("shared through the agent"), "{second}");
    assert!(agent.0.try_wait().unwrap().is_none(), "the agent exited");
}

/// A file encrypted to a fresh recovery identity `rec.key` in `d`.
fn encrypted_file(d: &Path) -> PathBuf {
    let rec = recovery(d, "rec.key");
    fs::write(d.join("secret.txt"), bytes(5000, 3)).unwrap();
    let r = common::run(d, &["encrypt", "-R", &rec, "secret.txt"]);
    assert_ok(&r, "encrypt");
    d.join("secret.txt.tpmc")
}

/// A file encrypted to a fresh TPM key `k` on the simulator: decrypting it
/// asks the agent first and then offers it the key the TPM unwrapped (a
/// recovery key's never reaches the agent), so a client that skipped a
/// check would send a squatter the session key.
fn tpm_encrypted_file(d: &Path) -> PathBuf {
    assert_ok(
        &common::run(d, &["--simulator", "key", "create", "k"]),
        "key create on the simulator",
    );
    fs::write(d.join("secret.txt"), bytes(5000, 3)).unwrap();
    let r = common::run(d, &["encrypt", "-k", "k", "secret.txt"]);
    assert_ok(&r, "encrypt");
    d.join("secret.txt.tpmc")
}

/// The command that decrypts [`tpm_encrypted_file`] to stdout.
fn tpm_decrypt(d: &Path) -> Command {
    let mut cmd = tpmcrypt(d);
    cmd.args(["--simulator", "decrypt", "-o", "-", "secret.txt.tpmc"]);
    cmd
}

/// [`tpm_decrypt`] with `env` set and `remove` removed.
fn decrypt_with(d: &Path, env: &[(&str, &Path)], remove: &[&str]) -> Run {
    let mut cmd = tpm_decrypt(d);
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
    tpm_encrypted_file(d);
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
    tpm_encrypted_file(d);
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

    // Only the outer directory squatted: the agent refuses before it
    // creates anything in it, and says whose it is (the build before made
    // its own tpmcrypt/ inside the other user's directory, then refused;
    // with that directory swapped for a symlink at the right moment, it
    // made one wherever the symlink pointed).
    fs::remove_dir_all(&base).unwrap();
    their_dir(&base, 0o777);
    let r: Run = cmd.output().expect("spawn").into();
    common::assert_error_line(
        &r,
        1,
        None,
        &["tpmcrypt-0", "owned by uid 65534"],
        "agent under a squatted directory",
    );
    assert!(
        !base.join("tpmcrypt").exists(),
        "the agent created a directory inside another user's"
    );
}

/// A user who is not root cannot even look into the 0700 directory
/// another user made first at `$TMPDIR/tpmcrypt-UID`: the warning of an
/// `encrypt` and the error of `agent --stop` said only "Permission
/// denied"; they now name the directory and its owner, as the agent does.
#[test]
fn a_squatted_fallback_that_cannot_be_entered_is_named_with_its_owner() {
    require_root();
    const VICTIM: u32 = 65533;
    let dir = scratch();
    let d = dir.path();
    common::chmod(d, 0o755);
    let r = recovery(d, "id");
    let work = d.join("work");
    fs::create_dir(&work).unwrap();
    fs::write(work.join("f"), b"their data").unwrap();
    chown(&work, VICTIM);
    chown(&work.join("f"), VICTIM);
    let tmp = d.join("tmp");
    fs::create_dir(&tmp).unwrap();
    common::chmod(&tmp, 0o1777);
    their_dir(&tmp.join(format!("tpmcrypt-{VICTIM}")), 0o700);
    let as_victim = |args: &[&str]| -> Run {
        Command::new("setpriv")
            .args(["--reuid", "65533", "--regid", "65533", "--clear-groups"])
            .arg(common::bin())
            .args(args)
            .current_dir(&work)
            .env("HOME", &work)
            .env("TPMCRYPT_HOME", work.join("home"))
            .env("TMPDIR", &tmp)
            .env_remove("TPMCRYPT_AGENT_SOCK")
            .env_remove("XDG_RUNTIME_DIR")
            .output()
            .expect("setpriv")
            .into()
    };
    let enc = as_victim(&["encrypt", "-R", &r, "f"]);
    assert_eq!(enc.code, 0, "{}", enc.stderr);
    assert!(
        enc.stderr.contains("not using the agent")
            && enc.stderr.contains(&format!("tpmcrypt-{VICTIM}"))
            && enc.stderr.contains("owned by uid 65534")
            && !enc.stderr.contains("Permission denied"),
        "{}",
        enc.stderr
    );
    assert!(work.join("f.tpmc").exists());
    let stop = as_victim(&["agent", "--stop"]);
    common::assert_error_line(
        &stop,
        1,
        None,
        &[&format!("tpmcrypt-{VICTIM}"), "owned by uid 65534"],
        "agent --stop",
    );
}

#[test]
fn a_listener_of_another_uid_behind_our_own_paths_gets_nothing() {
    // Every path checks out (our directory, 0700; a socket file we own), but
    // the process listening on it is another user's: only SO_PEERCRED on
    // the client side can tell.
    let dir = scratch();
    let d = dir.path();
    tpm_encrypted_file(d);
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

/// A directory of ours that anyone may write to (`d/loose`, mode 0777),
/// and the other user's fake agent listening at `agent.sock` in it:
/// (the directory, the socket, the squatter).
fn squatter_in_a_loose_directory(d: &Path) -> (PathBuf, PathBuf, Squatter) {
    let loose = d.join("loose");
    fs::create_dir(&loose).unwrap();
    let logdir = d.join("log");
    their_dir(&logdir, 0o755);
    common::chmod(&loose, 0o777);
    let sock = loose.join("agent.sock");
    let squatter = Squatter::start(d, &sock, &logdir);
    (loose, sock, squatter)
}

#[test]
fn a_world_writable_socket_directory_of_our_own_is_refused() {
    // Our own directory, but anyone may swap the socket in it.
    let dir = scratch();
    let d = dir.path();
    tpm_encrypted_file(d);
    let (loose, sock, squatter) = squatter_in_a_loose_directory(d);
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

/// A decrypt that a recovery identity serves never needs the agent, so it
/// does not look at the socket: one it would refuse costs it no warning
/// and gets nothing, through the front (one file to stdout) and through
/// tpmcrypt-full (`-r`). A decrypt that does need the agent still warns
/// (`a_world_writable_socket_directory_of_our_own_is_refused`).
#[test]
fn a_recovery_decrypt_never_looks_at_a_socket_it_would_refuse() {
    let dir = scratch();
    let d = dir.path();
    let file = encrypted_file(d);
    fs::create_dir(d.join("tree")).unwrap();
    fs::copy(&file, d.join("tree/a.tpmc")).unwrap();
    fs::copy(&file, d.join("tree/b.tpmc")).unwrap();
    let (_, sock, squatter) = squatter_in_a_loose_directory(d);
    let sock = sock.to_str().unwrap();
    let env = [("TPMCRYPT_AGENT_SOCK", sock)];
    let front = ["decrypt", "-i", "rec.key", "-o", "-", "secret.txt.tpmc"];
    let full = ["decrypt", "-i", "rec.key", "-r", "tree"];
    for (what, args) in [("one file", &front[..]), ("-r", &full[..])] {
        let r = run_env(d, &env, args);
        assert_eq!(r.code, 0, "{what}: {}", r.stderr);
        assert!(
            !r.stderr.contains("agent"),
            "{what}: a run that needs no agent spoke of it: {:?}",
            r.stderr
        );
        assert_eq!(squatter.received(), Vec::<String>::new(), "{what}");
    }
    assert_eq!(fs::read(d.join("tree/a")).unwrap(), bytes(5000, 3));
    assert_eq!(fs::read(d.join("tree/b")).unwrap(), bytes(5000, 3));
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

/// A real `TSS2 PRIVATE KEY` file (written by tpm2-tools), for keystore
/// commands refused before they would touch a TPM.
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
    // Importing needs the TPM that holds the key (it must load there), so
    // the key is made on the simulator; the refusals below need no TPM.
    assert_ok(
        &common::run(d, &["--simulator", "key", "create", "k"]),
        "key create on the simulator",
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

    // `--out -` reads as standard output, as `-o -` does for encrypt and
    // decrypt: a secret key is not printed, nor hidden in a file named
    // `-`. Refused, with the way to name such a file.
    let r = common::run(d, &["recovery", "create", "--out", "-"]);
    common::assert_error_line(
        &r,
        2,
        None,
        &["--out -", "secret", "./-"],
        "recovery create --out -",
    );
    assert!(r.stdout.is_empty(), "nothing printed: {:?}", r.stdout);
    assert!(!d.join("-").exists(), "no file named -");
    assert_ok(
        &common::run(d, &["recovery", "create", "--out", "./-"]),
        "recovery create --out ./-",
    );
    // Nor a device or a symlink (as root, `--out /dev/null --force --yes`
    // replaced the device by the key; `/dev/stdout`, a symlink, likewise).
    let dev = std::ffi::CString::new(d.join("null").to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    let made = unsafe { libc::mknod(dev.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
    assert_eq!(made, 0, "mknod (root, as CI runs the tests)");
    std::os::unix::fs::symlink("rec.key", d.join("link.key")).unwrap();
    for (out, kind) in [("null", "a device"), ("link.key", "a symbolic link")] {
        let r = common::run(d, &["recovery", "create", "--out", out, "--force", "--yes"]);
        common::assert_error_line(&r, 2, None, &[kind, "regular file"], out);
    }
    let kind = |p: &str| fs::symlink_metadata(d.join(p)).unwrap().file_type();
    assert!(std::os::unix::fs::FileTypeExt::is_char_device(&kind(
        "null"
    )));
    assert!(kind("link.key").is_symlink());
    assert_eq!(common::mode_of(&d.join("-")), 0o600);

    // --force replaces only a recovery identity, or an empty file: not a
    // document, nor a PCR signer's private key, both of which the build
    // before replaced (calling each "the recovery identity" when it asked).
    fs::write(d.join("thesis.txt"), b"thesis").unwrap();
    assert_ok(
        &common::run(d, &["pcr-signer", "create", "--out", "sig.key"]),
        "pcr-signer create",
    );
    let signer = fs::read(d.join("sig.key")).unwrap();
    // Nor is a signer's key, or a signed policy, put in a file named `-`
    // (the build before did both, exit 0).
    let dash = fs::read(d.join("-")).unwrap();
    let r = common::run(d, &["pcr-signer", "create", "--out", "-"]);
    common::assert_error_line(&r, 2, None, &["--out -", "secret", "./-"], "pcr-signer -");
    let r = common::run(
        d,
        &[
            "pcr", "sign", "--signer", "sig.key", "--pcrs", "sha256:0", "--values", "v", "-o", "-",
        ],
    );
    common::assert_error_line(&r, 2, None, &["--out -", "./-"], "pcr sign -o -");
    assert_eq!(fs::read(d.join("-")).unwrap(), dash, "./- untouched");
    for out in ["thesis.txt", "sig.key"] {
        let r = common::run(d, &["recovery", "create", "--out", out, "--force", "--yes"]);
        common::assert_error_line(
            &r,
            2,
            None,
            &["is not a recovery identity", "not replaced"],
            out,
        );
        assert!(r.stdout.is_empty(), "{out}: no recipient printed");
    }
    assert_eq!(fs::read(d.join("thesis.txt")).unwrap(), b"thesis");
    assert_eq!(fs::read(d.join("sig.key")).unwrap(), signer);
    fs::write(d.join("empty.key"), b"").unwrap();
    assert_ok(
        &common::run(
            d,
            &[
                "recovery",
                "create",
                "--out",
                "empty.key",
                "--force",
                "--yes",
            ],
        ),
        "recovery create over an empty file",
    );
    assert!(fs::read_to_string(d.join("empty.key"))
        .unwrap()
        .contains("PRIVATE KEY"));
}

// ------------------------------------------------ the keystore is the user's

/// Fingerprints of the stanzas of an encrypted file (`inspect --json`).
fn stanza_fingerprints(d: &Path, file: &str) -> Vec<String> {
    let r = common::run(d, &["inspect", "--json", file]);
    assert_ok(&r, "inspect");
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).expect("json");
    v["recipients"]
        .as_array()
        .expect("recipients")
        .iter()
        .map(|s| s["fingerprint"].as_str().expect("fingerprint").to_string())
        .collect()
}

fn key_fingerprint(d: &Path, name: &str) -> String {
    let r = common::run(d, &["key", "list", "--json"]);
    assert_ok(&r, "key list");
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).expect("json");
    v.as_array()
        .expect("list")
        .iter()
        .find(|k| k["name"] == name)
        .unwrap_or_else(|| panic!("no key {name} in {v}"))["fingerprint"]
        .as_str()
        .expect("fingerprint")
        .to_string()
}

#[test]
fn encrypt_to_a_key_uses_the_key_file_and_refuses_a_keystore_others_can_write() {
    let dir = scratch();
    let d = dir.path();
    let ks = d.join(".tpmcrypt-home");
    assert_ok(
        &common::run(d, &["--simulator", "key", "create", "k"]),
        "create",
    );
    let fp = key_fingerprint(d, "k");
    fs::write(d.join("f"), b"for k only").unwrap();

    // An attacker's public key in k.pub.pem (a P-256 key, as k is).
    let attacker = Command::new("sh")
        .arg("-c")
        .arg("openssl ecparam -name prime256v1 -genkey -noout | openssl ec -pubout 2>/dev/null")
        .output()
        .expect("openssl");
    assert!(attacker.status.success());
    let genuine = fs::read(ks.join("k.pub.pem")).unwrap();
    fs::write(ks.join("k.pub.pem"), &attacker.stdout).unwrap();
    let r = common::run(d, &["encrypt", "--key", "k", "f"]);
    common::assert_error_line(
        &r,
        1,
        None,
        &["k.pub.pem", "does not hold the public half of k.key.pem"],
        "a replaced k.pub.pem",
    );
    assert!(
        !d.join("f.tpmc").exists(),
        "nothing encrypted to the attacker"
    );
    fs::write(ks.join("k.pub.pem"), &genuine).unwrap();
    assert_ok(&common::run(d, &["encrypt", "--key", "k", "f"]), "encrypt");
    assert_eq!(stanza_fingerprints(d, "f.tpmc"), vec![fp.clone()]);
    fs::remove_file(d.join("f.tpmc")).unwrap();
    // Without k.pub.pem (a copy for other tools) the key file suffices.
    fs::remove_file(ks.join("k.pub.pem")).unwrap();
    assert_ok(
        &common::run(d, &["encrypt", "--key", "k", "f"]),
        "no pub.pem",
    );
    assert_eq!(stanza_fingerprints(d, "f.tpmc"), vec![fp]);
    fs::remove_file(d.join("f.tpmc")).unwrap();

    // A keystore directory, key file or metadata file others could write.
    let json = ks.join("k.json");
    let cases: [(&Path, u32, Option<u32>, &str); 4] = [
        (&ks, 0o777, None, "writable by other users (mode 0777)"),
        (
            &ks.join("k.key.pem"),
            0o666,
            None,
            "the key file is writable",
        ),
        (&json, 0o622, None, "metadata file is writable"),
        (&json, 0o600, Some(NOBODY), "owned by uid 65534"),
    ];
    for (path, mode, owner, needle) in cases {
        require_root();
        let old_mode = fs::metadata(path).unwrap().permissions().mode() & 0o7777;
        common::chmod(path, mode);
        if let Some(uid) = owner {
            chown(path, uid);
        }
        let r = common::run(d, &["encrypt", "--key", "k", "f"]);
        common::assert_error_line(&r, 1, None, &[needle], &format!("{}", path.display()));
        assert!(!d.join("f.tpmc").exists());
        chown(path, 0);
        common::chmod(path, old_mode);
    }
    // A recovery recipient slipped into k.json by another user is refused
    // with it (above); restored, the key works again.
    assert_ok(&common::run(d, &["encrypt", "--key", "k", "f"]), "restored");
}

#[test]
fn a_damaged_key_file_affects_only_that_key_and_never_a_recovery_identity() {
    let dir = scratch();
    let d = dir.path();
    let ks = d.join(".tpmcrypt-home");
    assert_ok(
        &common::run(d, &["--simulator", "key", "create", "k"]),
        "create",
    );
    encrypted_file(d);
    fs::write(d.join("g"), b"for k").unwrap();
    assert_ok(
        &common::run(d, &["encrypt", "--key", "k", "g"]),
        "encrypt g",
    );
    fs::remove_file(d.join("g")).unwrap();
    // What a crash or a full disk leaves of another key.
    fs::write(ks.join("other.key.pem"), b"").unwrap();
    common::chmod(&ks.join("other.key.pem"), 0o600);
    // A P-256 key file whose public point was damaged (one bit of y):
    // encrypting to it is one usage error naming the file and the cause
    // (the build before: OpenSSL's error stack, exit 1, no file named).
    assert_ok(
        &common::run(d, &["--simulator", "key", "create", "bad"]),
        "create bad",
    );
    let unpem = |pem: &str| {
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        openssl::base64::decode_block(&body).unwrap()
    };
    let public = unpem(&fs::read_to_string(ks.join("bad.pub.pem")).unwrap());
    let mut key = unpem(&fs::read_to_string(ks.join("bad.key.pem")).unwrap());
    let y = &public[public.len() - 32..];
    let at = key
        .windows(32)
        .position(|w| w == y)
        .expect("y in the key file");
    key[at + 31] ^= 1;
    let pem = format!(
        "-----BEGIN TSS2 PRIVATE KEY-----\n{}\n-----END TSS2 PRIVATE KEY-----\n",
        openssl::base64::encode_block(&key)
    );
    fs::write(ks.join("bad.key.pem"), pem).unwrap();
    fs::write(d.join("h"), b"for bad").unwrap();
    let r = common::run(d, &["encrypt", "--key", "bad", "h"]);
    common::assert_error_line(
        &r,
        2,
        None,
        &["bad.key.pem", "not on NIST P-256"],
        "encrypt --key bad",
    );
    assert!(!d.join("h.tpmc").exists());
    fs::remove_file(d.join("h")).unwrap();
    for f in ["bad.key.pem", "bad.pub.pem", "bad.json"] {
        fs::remove_file(ks.join(f)).unwrap();
    }

    let r = common::run(
        d,
        &["decrypt", "-i", "rec.key", "-o", "-", "secret.txt.tpmc"],
    );
    assert_eq!(r.code, 0, "recovery decrypt: {}", r.stderr);
    assert_eq!(r.stdout, bytes(5000, 3));
    assert!(
        r.stderr
            .starts_with("warning: keystore key other skipped: ")
            && r.stderr.contains("other.key.pem"),
        "{}",
        r.stderr
    );
    let r = common::run(d, &["--simulator", "decrypt", "g.tpmc"]);
    assert_eq!(r.code, 0, "decrypt with k: {}", r.stderr);
    assert_eq!(fs::read(d.join("g")).unwrap(), b"for k");
    let r = common::run(d, &["key", "list"]);
    assert_eq!(r.code, 0, "key list: {}", r.stderr);
    assert!(
        String::from_utf8_lossy(&r.stdout).contains("\nk "),
        "{:?}",
        r.stdout
    );
    assert!(
        r.stderr.contains("warning: key other skipped") && r.stderr.contains("other.key.pem"),
        "{}",
        r.stderr
    );
    // A keystore others can write is left out of a decrypt, with a warning;
    // the recovery identity still works.
    common::chmod(&ks, 0o777);
    let r = common::run(
        d,
        &["decrypt", "-i", "rec.key", "-o", "-", "secret.txt.tpmc"],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stderr.starts_with("warning: not using the keystore: ") && r.stderr.contains("mode 0777"),
        "{}",
        r.stderr
    );
    // The same with --simulator: the simulator is never needed, so its
    // state directory (in the keystore) is no reason to fail.
    let r = common::run(
        d,
        &[
            "--simulator",
            "decrypt",
            "-i",
            "rec.key",
            "-o",
            "-",
            "secret.txt.tpmc",
        ],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.stdout, bytes(5000, 3));
}

// ------------------------------------------------ the docs tell the truth

fn repo_file(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel);
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The README's main flow, run verbatim by bash -e with HOME in a scratch
/// directory and the simulator as the TPM.
#[test]
fn readme_flow_works_when_typed_literally() {
    let readme = repo_file("README.md");
    let marker = "<!-- tested: tests/boundaries.rs readme_flow_works_when_typed_literally -->";
    let after = &readme[readme
        .find(marker)
        .expect("the README marks its tested flow")..];
    let start = after.find("```sh\n").expect("a sh block") + "```sh\n".len();
    let block = &after[start..];
    let script = &block[..block.find("```").expect("end of the block")];

    let dir = scratch();
    let home = dir.path().join("home");
    let cwd = dir.path().join("work");
    fs::create_dir_all(home.join("Documents/sub")).unwrap();
    fs::create_dir_all(cwd.join("photos/2024")).unwrap();
    fs::create_dir_all(cwd.join("dir")).unwrap();
    let fixtures: [(&Path, &str, u64); 9] = [
        (&home, "Documents/a.txt", 1),
        (&home, "Documents/sub/b.odt", 2),
        (&cwd, "notes.txt", 3),
        (&cwd, "report.pdf", 4),
        (&cwd, "photos/1.jpg", 5),
        (&cwd, "photos/2024/2.jpg", 6),
        (&cwd, "x.csv", 7),
        (&cwd, "y.csv", 8),
        (&cwd, "dir/inside", 9),
    ];
    for (base, rel, seed) in fixtures {
        fs::write(base.join(rel), bytes(3000 + seed as usize, seed)).unwrap();
    }
    let bin_dir = common::bin().parent().expect("bin dir").to_path_buf();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = common::wrapper(&cwd, "bash")
        .args(["-e", "-u", "-o", "pipefail", "-c", script])
        .env("HOME", &home)
        .env("PATH", path)
        .env("TPMCRYPT_SIMULATOR", "1")
        .env_remove("TPMCRYPT_HOME")
        .env_remove("XDG_DATA_HOME")
        .env_remove("XDG_RUNTIME_DIR")
        .output()
        .expect("bash");
    assert!(
        out.status.success(),
        "the README flow failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    // Everything came back where it started, and the in-place encryptions
    // left no plaintext behind on the way.
    for (base, rel, seed) in fixtures.iter().filter(|f| !f.1.ends_with(".csv")) {
        assert_eq!(
            fs::read(base.join(rel)).unwrap(),
            bytes(3000 + *seed as usize, *seed),
            "{rel}"
        );
    }
    assert_eq!(
        fs::read(cwd.join("restored/dir/inside")).unwrap(),
        bytes(3009, 9)
    );
    for enc in [
        "x.csv.tpmc",
        "y.csv.tpmc",
        "notes.txt.tpmc",
        "report.pdf.tpmc",
    ] {
        assert!(cwd.join(enc).exists(), "{enc}");
    }
    assert!(!cwd.join("x.csv").exists() && !cwd.join("y.csv").exists());
    assert!(fs::read_to_string(home.join("recovery.pub"))
        .unwrap()
        .starts_with("tpmcrypt-recovery:"));
}

/// docs/format.md's stanza table gives each kind's body and stanza size;
/// the header of a file encrypted to one recipient of each kind is exactly
/// 16 + stanza + 32 bytes.
#[test]
fn format_doc_stanza_sizes_match_what_is_written() {
    let doc = repo_file("docs/format.md");
    let size_of = |kind: &str| -> (usize, usize) {
        let row = doc
            .lines()
            .find(|l| l.starts_with("| 0x0") && l.contains(&format!("`{kind}`")))
            .unwrap_or_else(|| panic!("no row for {kind}"));
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let n = cells.len();
        (
            cells[n - 3].parse().expect("body size"),
            cells[n - 2].parse().expect("stanza size"),
        )
    };
    let dir = scratch();
    let d = dir.path();
    let rec = recovery(d, "rec.key");
    let keygen = |cmd: &str, out: &str| {
        let st = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "{cmd} 2>/dev/null | openssl pkey -pubout -out {out}"
            ))
            .current_dir(d)
            .status()
            .expect("openssl");
        assert!(st.success(), "{cmd}");
    };
    keygen(
        "openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048",
        "rsa.pem",
    );
    keygen(
        "openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256",
        "ec.pem",
    );
    fs::write(d.join("f"), b"x").unwrap();
    for (kind, recipient) in [
        ("recovery-p256", rec.as_str()),
        ("tpm-p256", "ec.pem"),
        ("tpm-rsa2048", "rsa.pem"),
    ] {
        let (body, stanza) = size_of(kind);
        assert_eq!(stanza, body + 3, "{kind}: kind (1) + length (2) + body");
        let r = common::run(d, &["encrypt", "-f", "-R", recipient, "f"]);
        assert_ok(&r, kind);
        let r = common::run(d, &["inspect", "--json", "f.tpmc"]);
        let v: serde_json::Value = serde_json::from_slice(&r.stdout).expect("json");
        assert_eq!(v["recipients"][0]["kind"], kind);
        assert_eq!(
            v["header_length"].as_u64().expect("header_length") as usize,
            16 + stanza + 32,
            "{kind}"
        );
    }
}

// ------------------------------- found by attacking the boundaries above

/// Runs `cmd` for at most `secs` seconds; a run still going then is killed
/// and reported as hung.
fn run_bounded(mut cmd: Command, secs: u64, what: &str) -> Run {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let deadline = Instant::now() + Duration::from_secs(secs);
    while child.try_wait().expect("try_wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running after {secs} s (hung)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output").into()
}

#[test]
fn a_symlink_of_another_user_on_the_way_to_the_socket_is_refused() {
    let dir = scratch();
    let d = dir.path();
    encrypted_file(d);
    let tmp = d.join("tmp");
    fs::create_dir(&tmp).unwrap();
    common::chmod(&tmp, 0o1777);
    let elsewhere = d.join("elsewhere");
    fs::create_dir(&elsewhere).unwrap();
    common::chmod(&elsewhere, 0o700);
    // SAFETY: geteuid cannot fail.
    let link = tmp.join(format!("tpmcrypt-{}", unsafe { libc::geteuid() }));
    std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
    chown(&link, NOBODY);
    let mut cmd = tpmcrypt(d);
    cmd.args(["agent", "--ttl", "1m"])
        .env("TMPDIR", &tmp)
        .env_remove("TPMCRYPT_AGENT_SOCK")
        .env_remove("XDG_RUNTIME_DIR");
    let r = run_bounded(cmd, 10, "agent behind another user's symlink");
    common::assert_error_line(
        &r,
        1,
        None,
        &["symlink", "owned by uid 65534"],
        "agent behind another user's symlink",
    );
    assert!(
        common::listing(&elsewhere).is_empty(),
        "nothing made where the symlink points"
    );
}

#[test]
fn the_agent_removes_only_the_socket_it_bound() {
    let dir = scratch();
    let d = dir.path();
    let run_dir = d.join("run");
    let sock = run_dir.join("agent.sock");
    let mut agent = start_agent(d, &sock);
    // The path comes to name something else: the agent must leave it.
    fs::rename(&sock, run_dir.join("moved.sock")).unwrap();
    fs::write(&sock, b"precious").unwrap();
    // SAFETY: plain kill(2) of our child.
    unsafe {
        libc::kill(agent.id() as i32, libc::SIGTERM);
    }
    let status = agent.wait().expect("wait");
    assert!(status.success(), "{status}");
    assert_eq!(fs::read(&sock).unwrap(), b"precious");
}

#[test]
fn a_key_file_that_is_a_fifo_or_a_device_never_hangs_a_recovery() {
    let dir = scratch();
    let d = dir.path();
    let ks = d.join(".tpmcrypt-home");
    encrypted_file(d);
    fs::create_dir(&ks).unwrap();
    common::chmod(&ks, 0o700);
    let fifo = ks.join("fifo.key.pem");
    let st = Command::new("mkfifo")
        .arg("-m600")
        .arg(&fifo)
        .status()
        .expect("mkfifo");
    assert!(st.success());
    std::os::unix::fs::symlink("/dev/zero", ks.join("zero.key.pem")).unwrap();
    let meta_fifo = ks.join("other.json");
    Command::new("mkfifo")
        .arg("-m600")
        .arg(&meta_fifo)
        .status()
        .expect("mkfifo");
    fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tpmkey/tests/data/tpm2-tools-rsa2048.pem"),
        ks.join("other.key.pem"),
    )
    .unwrap();
    common::chmod(&ks.join("other.key.pem"), 0o600);
    let mut cmd = tpmcrypt(d);
    cmd.args(["decrypt", "-i", "rec.key", "-o", "-", "secret.txt.tpmc"]);
    let r = run_bounded(cmd, 10, "decrypt beside a FIFO key file");
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.stdout, bytes(5000, 3));
    for needle in [
        "keystore key fifo skipped",
        "not a regular file",
        "keystore key zero skipped",
        "is a symlink",
        "keystore key other skipped",
    ] {
        assert!(r.stderr.contains(needle), "{needle}: {}", r.stderr);
    }
    let mut cmd = tpmcrypt(d);
    cmd.args(["key", "list"]);
    let r = run_bounded(cmd, 10, "key list beside a FIFO key file");
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[test]
fn a_stopped_agent_with_a_full_queue_never_hangs_a_decrypt() {
    let dir = scratch();
    let d = dir.path();
    tpm_encrypted_file(d);
    let sock = d.join("run/agent.sock");
    let mut agent = start_agent(d, &sock);
    // SAFETY: plain kill(2) of our child.
    unsafe {
        libc::kill(agent.id() as i32, libc::SIGSTOP);
    }
    // Fill its accept queue with connections nobody accepts.
    let fill = Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(
            "import socket,sys,time\nss=[]\nwhile True:\n s=socket.socket(socket.AF_UNIX)\n s.setblocking(0)\n try:\n  s.connect(sys.argv[1])\n except BlockingIOError:\n  break\n ss.append(s)\nprint(len(ss),flush=True)\ntime.sleep(60)",
        )
        .arg(&sock)
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut filler = fill;
    let mut line = String::new();
    use std::io::BufRead;
    std::io::BufReader::new(filler.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read");
    assert!(line.trim().parse::<u32>().is_ok(), "{line}");
    let mut cmd = tpm_decrypt(d);
    cmd.env("TPMCRYPT_AGENT_SOCK", &sock);
    let r = run_bounded(cmd, 10, "decrypt with a stuck agent");
    let _ = filler.kill();
    let _ = filler.wait();
    let _ = agent.kill();
    let _ = agent.wait();
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.stdout, bytes(5000, 3));
    assert!(
        r.stderr.contains("not accepting connections") || r.stderr.contains("not answering"),
        "{}",
        r.stderr
    );
}

#[test]
fn a_bare_socket_name_is_checked_in_the_working_directory() {
    // TPMCRYPT_AGENT_SOCK=agent.sock names the working directory: one that
    // another user owns and anyone can write is no place for the agent.
    let dir = scratch();
    let d = dir.path();
    let theirs = d.join("theirs");
    their_dir(&theirs, 0o777);
    let mut cmd = tpmcrypt(d);
    cmd.current_dir(&theirs)
        .env("TPMCRYPT_AGENT_SOCK", "agent.sock")
        .args(["agent", "--ttl", "1m"]);
    let r = run_bounded(cmd, 10, "agent with a bare socket name");
    common::assert_error_line(
        &r,
        1,
        None,
        &["owned by uid 65534"],
        "agent in another user's working directory",
    );
    assert!(common::listing(&theirs).is_empty(), "no socket made there");
}

#[test]
fn an_io_cause_is_printed_once_and_a_silent_agent_is_named() {
    let dir = scratch();
    let d = dir.path();
    // A keystore not made yet is listed as empty (reading makes nothing);
    // one that cannot be made names its cause once.
    let r = common::run(d, &["--keystore", "/proc/nonexistent/ks", "key", "list"]);
    assert_ok(&r, "key list of a keystore not made");
    let r = common::run(
        d,
        &[
            "--keystore",
            "/proc/nonexistent/ks",
            "--simulator",
            "key",
            "create",
            "k",
        ],
    );
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert_eq!(
        r.stderr.matches("No such file or directory").count(),
        1,
        "{}",
        r.stderr
    );
    // An agent of our own that accepts and never answers.
    let sock = d.join("silent.sock");
    let mut silent = Command::new("/usr/bin/python3")
        .arg("-c")
        .arg("import socket,sys,time\ns=socket.socket(socket.AF_UNIX)\ns.bind(sys.argv[1])\ns.listen(8)\ncs=[]\nwhile True:\n c,_=s.accept()\n cs.append(c)")
        .arg(&sock)
        .spawn()
        .expect("python3");
    // Python binds and listens in two steps: ready once it accepts.
    let start = Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(start.elapsed() < Duration::from_secs(10), "no socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut cmd = tpmcrypt(d);
    cmd.args(["agent", "--stop"])
        .env("TPMCRYPT_AGENT_SOCK", &sock);
    let r = run_bounded(cmd, 10, "agent --stop of a silent agent");
    let _ = silent.kill();
    let _ = silent.wait();
    common::assert_error_line(&r, 1, None, &["not answering"], "silent agent");
}

#[test]
fn encrypt_in_place_never_locks_a_private_key_away_with_itself() {
    let dir = scratch();
    let d = dir.path();
    let home = d.join("home");
    fs::create_dir(&home).unwrap();
    let rec = recovery(&home, "recovery.key");
    tools_key(&home);
    fs::write(home.join("notes"), b"notes").unwrap();
    let identity = fs::read(home.join("recovery.key")).unwrap();
    let keyfile = fs::read(home.join("tools.pem")).unwrap();
    let r = common::run(d, &["encrypt", "-R", &rec, "-r", "--in-place", "home"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("is a tpmcrypt recovery identity: --in-place would remove it")
            && r.stderr.contains("is a TPM key file"),
        "{}",
        r.stderr
    );
    assert_eq!(fs::read(home.join("recovery.key")).unwrap(), identity);
    assert_eq!(fs::read(home.join("tools.pem")).unwrap(), keyfile);
    assert!(home.join("notes.tpmc").exists() && !home.join("notes").exists());
    // A copy, without --in-place, is the user's to make.
    let r = common::run(d, &["encrypt", "-R", &rec, "home/recovery.key"]);
    assert_ok(&r, "encrypt a copy of the identity");
    assert_eq!(fs::read(home.join("recovery.key")).unwrap(), identity);
}

#[test]
fn key_commands_report_a_closed_stdout() {
    let dir = scratch();
    let d = dir.path();
    assert_ok(
        &common::run(d, &["--simulator", "key", "create", "k"]),
        "create",
    );
    for args in ["key list", "key list --json", "key show k", "key export k"] {
        let r = common::run_with_stdout_closed(d, args);
        common::assert_error_line(&r, 1, None, &["standard output is closed"], args);
    }
}

// ------------------------------------- found by attacking the merged build

#[test]
fn only_exact_temporaries_are_left_out_or_cleaned_up() {
    let dir = scratch();
    let d = dir.path();
    let rec = recovery(d, "rec.key");
    let t = d.join("t");
    fs::create_dir(&t).unwrap();
    // Names that merely contain the marker are a user's files.
    fs::write(
        t.join(".report.tpmcrypt-partial.4000000.backup"),
        b"precious",
    )
    .unwrap();
    fs::write(t.join("notes.tpmcrypt-partial.txt"), b"notes").unwrap();
    fs::write(t.join("report"), b"report").unwrap();
    let r = common::run(d, &["-v", "encrypt", "-R", &rec, "-r", "--in-place", "t"]);
    assert_ok(&r, "encrypt -r");
    let names = common::listing(&t);
    assert_eq!(
        names,
        vec![
            ".report.tpmcrypt-partial.4000000.backup.tpmc",
            "notes.tpmcrypt-partial.txt.tpmc",
            "report.tpmc"
        ],
        "every plaintext encrypted, none deleted"
    );
    let r = common::run(d, &["decrypt", "-i", "rec.key", "-r", "--in-place", "t"]);
    assert_ok(&r, "decrypt -r");
    assert_eq!(
        fs::read(t.join(".report.tpmcrypt-partial.4000000.backup")).unwrap(),
        b"precious"
    );
    assert_eq!(
        fs::read(t.join("notes.tpmcrypt-partial.txt")).unwrap(),
        b"notes"
    );
}

#[test]
fn a_bad_file_or_directory_in_a_tree_fails_by_itself() {
    let dir = scratch();
    let d = dir.path();
    let rec = recovery(d, "rec.key");
    let t = d.join("t");
    fs::create_dir_all(t.join("locked")).unwrap();
    fs::write(t.join("a"), b"a").unwrap();
    fs::write(t.join("locked/x"), b"x").unwrap();
    assert_ok(
        &common::run(d, &["encrypt", "-R", &rec, "-r", "--in-place", "t"]),
        "encrypt",
    );
    fs::copy(t.join("a.tpmc"), t.join(".tpmc")).unwrap();
    common::chmod(&t.join("locked"), 0o000);
    // As another user, so that the mode 000 counts.
    chown(d, NOBODY);
    for p in ["t", "t/a.tpmc", "t/.tpmc", "rec.key"] {
        chown(&d.join(p), NOBODY);
    }
    let r = run_as_other_user(d, &["decrypt", "-i", "rec.key", "-r", "--in-place", "t"]);
    chown(d, 0);
    common::chmod(&t.join("locked"), 0o755);
    assert_eq!(r.code, 1, "{}", r.stderr);
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{:?}", r.stderr);
    assert!(
        lines.iter().any(|l| l.starts_with("error: t/.tpmc: ")),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("error: t/locked: cannot read the directory: Permission denied")),
        "{lines:?}"
    );
    assert_eq!(fs::read(t.join("a")).unwrap(), b"a", "the rest went on");
}

#[test]
fn a_new_version_renamed_over_an_original_being_removed_is_kept() {
    let dir = scratch();
    let d = dir.path();
    let rec = recovery(d, "rec.key");
    fs::write(d.join("f"), b"original").unwrap();
    fs::write(d.join("f.new"), b"NEWVERSION").unwrap();
    // strace holds the run in its first unlink, after the output is durable
    // and the original was checked; meanwhile an editor saves a new version.
    let child = common::wrapper(d, "strace")
        .args(["-f", "-qq", "-o", "/dev/null"])
        .args(["-e", "inject=unlink,unlinkat:delay_enter=1500000:when=1"])
        .arg(common::bin())
        .args(["encrypt", "-R", &rec, "--in-place", "f"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("strace");
    common::wait_in_syscall(
        child.id(),
        &[libc::SYS_unlink, libc::SYS_unlinkat],
        "the run's unlink",
    );
    fs::rename(d.join("f.new"), d.join("f")).unwrap();
    let out = child.wait_with_output().expect("wait");
    let _ = out;
    assert_eq!(
        fs::read(d.join("f")).unwrap(),
        b"NEWVERSION",
        "the new version kept"
    );
    let r = common::run(d, &["decrypt", "-i", "rec.key", "-o", "-", "f.tpmc"]);
    assert_ok(&r, "decrypt");
    assert_eq!(r.stdout, b"original");
}

/// kill -9 while an `--in-place` original is moved aside for its removal,
/// with bytes appended to it meanwhile (through a descriptor opened
/// before): the moved-aside original is never taken for a temporary and
/// deleted; the next run puts it back under its name (beside its
/// ciphertext, as a crash before the removal would leave it), or, when the
/// name is taken, leaves it and says where it is. strace holds the run
/// just after its first rename, which moves the original aside (the output
/// got its name before that, with linkat).
#[test]
fn an_original_moved_aside_by_a_killed_run_is_never_deleted() {
    use std::io::Write as _;
    let dir = scratch();
    let d = dir.path();
    let rec = recovery(d, "rec.key");
    for taken in [false, true] {
        let t = d.join("t");
        let _ = fs::remove_dir_all(&t);
        fs::create_dir(&t).unwrap();
        fs::write(t.join("log"), b"line1\n").unwrap();
        let mut writer = fs::OpenOptions::new()
            .append(true)
            .open(t.join("log"))
            .unwrap();
        let child = common::wrapper(d, "strace")
            .args(["-f", "-qq", "-o", "/dev/null", "-e", "trace=renameat2"])
            .args(["-e", "inject=renameat2:delay_exit=3000000:when=1"])
            .arg(common::bin())
            .args(["encrypt", "-R", &rec, "--in-place", "t/log"])
            .stderr(Stdio::null())
            .spawn()
            .expect("strace");
        let aside = || {
            common::listing(&t)
                .into_iter()
                .find(|n| n.starts_with(".log.tpmcrypt-"))
        };
        let until = std::time::Instant::now() + Duration::from_secs(20);
        while aside().is_none() {
            assert!(std::time::Instant::now() < until, "never moved aside");
            std::thread::sleep(Duration::from_millis(10));
        }
        writer.write_all(b"line2\n").unwrap();
        let pid = common::child_pids_of(child.id())
            .into_iter()
            .next()
            .expect("tpmcrypt under strace");
        // SAFETY: kill on the PID of our own child's child.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
        let _ = child.wait_with_output();
        let kept = aside().expect("moved aside");
        if taken {
            fs::write(t.join("log"), b"a new log").unwrap();
        }
        // The next run, with other work in that directory: a walk of it,
        // or (the name taken: a walk would meet the new log) a named file.
        fs::write(t.join("other"), b"other").unwrap();
        let next: &[&str] = if taken { &["t/other"] } else { &["-r", "t"] };
        let mut args = vec!["encrypt", "-R", &rec, "--in-place"];
        args.extend(next);
        let r = common::run(d, &args);
        assert_ok(&r, "the next run");
        assert!(t.join("other.tpmc").exists(), "the next run's work");
        if taken {
            assert_eq!(fs::read(t.join(&kept)).unwrap(), b"line1\nline2\n");
            assert!(
                r.stderr.contains(&format!("t/{kept}")) && r.stderr.contains("t/log"),
                "both paths named: {}",
                r.stderr
            );
        } else {
            assert_eq!(fs::read(t.join("log")).unwrap(), b"line1\nline2\n");
            assert_eq!(common::listing(&t), ["log", "log.tpmc", "other.tpmc"]);
        }
        let r = common::run(d, &["decrypt", "-i", "rec.key", "-o", "-", "t/log.tpmc"]);
        assert_ok(&r, "decrypt");
        assert_eq!(r.stdout, b"line1\n");
    }
}

#[test]
fn output_that_cannot_be_written_is_an_error() {
    let dir = scratch();
    let d = dir.path();
    for args in ["--help", "recovery --help", "--version"] {
        let out = common::wrapper(d, "sh")
            .arg("-c")
            .arg(format!("exec \"$0\" {args} >/dev/full"))
            .arg(common::bin())
            .output()
            .expect("sh");
        let r: Run = out.into();
        assert_eq!(r.code, 1, "{args}: {}", r.stderr);
    }
    let out = common::wrapper(d, "sh")
        .arg("-c")
        .arg("exec \"$0\" recovery create --out r.key >/dev/full")
        .arg(common::bin())
        .output()
        .expect("sh");
    let r: Run = out.into();
    common::assert_error_line(
        &r,
        1,
        None,
        &["was not kept"],
        "recovery create to a full stdout",
    );
    assert!(
        !d.join("r.key").exists(),
        "no identity nobody saw the recipient of"
    );
    assert!(common::listing(d).iter().all(|n| !n.starts_with("r.key")));
    // A key file that is not a TPM key at all is refused as such (exit 2).
    let st = Command::new("sh")
        .arg("-c")
        .arg("openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out p256.key 2>/dev/null")
        .current_dir(d)
        .status()
        .expect("openssl");
    assert!(st.success());
    let r = common::run(
        d,
        &["--simulator", "key", "import", "p256.key", "--name", "imp"],
    );
    assert_eq!(r.code, 2, "{}", r.stderr);
}

/// A directory the user may write to but not read (a drop box) cannot be
/// opened to be synced. Where its parent can be, on the same file system,
/// a `syncfs` through the parent makes its entries durable, and
/// `--in-place` completes: the output named, the original removed, no
/// warning (before, the run kept the original and failed). Where the
/// parent cannot be opened either, the original is kept and the error says
/// what is true: the ciphertext is complete under its name, the directory
/// not known to be durable. (It once said "cannot write the ciphertext",
/// which the user could take for a missing or partial output.)
#[test]
fn a_drop_box_run_completes_where_its_parent_can_be_synced() {
    require_root();
    let dir = scratch();
    let d = dir.path();
    let rec = recovery(d, "rec.key");
    their_dir(&d.join("box"), 0o755);
    fs::write(d.join("box/f"), b"secret").unwrap();
    chown(&d.join("box/f"), NOBODY);
    common::chmod(&d.join("box"), 0o300);
    let r = run_as_other_user(d, &["encrypt", "-R", &rec, "--in-place", "box/f"]);
    common::chmod(&d.join("box"), 0o755);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.stderr, "", "no error and no warning");
    assert!(!d.join("box/f").exists(), "the original is removed");
    let back = common::run(d, &["decrypt", "-i", "rec.key", "-o", "-", "box/f.tpmc"]);
    assert_ok(&back, "decrypt");
    assert_eq!(back.stdout, b"secret");

    // A drop box in a directory the user may not read either.
    their_dir(&d.join("p"), 0o755);
    their_dir(&d.join("p/box"), 0o755);
    fs::write(d.join("p/box/g"), b"other").unwrap();
    chown(&d.join("p/box/g"), NOBODY);
    common::chmod(&d.join("p/box"), 0o300);
    common::chmod(&d.join("p"), 0o300);
    let r = run_as_other_user(d, &["encrypt", "-R", &rec, "--in-place", "p/box/g"]);
    common::chmod(&d.join("p"), 0o755);
    common::chmod(&d.join("p/box"), 0o755);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert_eq!(
        r.stderr.trim_end(),
        "error: p/box/g.tpmc: complete, but cannot make the directory p/box durable: \
         Permission denied (os error 13); p/box/g is kept",
    );
    assert_eq!(fs::read(d.join("p/box/g")).unwrap(), b"other");
}

/// A relative `XDG_DATA_HOME` or `XDG_RUNTIME_DIR` is ignored, as the XDG
/// Base Directory specification asks (and so is a relative `TMPDIR` for
/// the agent's socket): before, each working directory got a keystore and
/// an agent socket of its own (`rel/tpmcrypt` made wherever the command
/// ran), and a key created in one directory was missing in the next.
#[test]
fn relative_xdg_directories_are_ignored() {
    let dir = scratch();
    let d = dir.path();
    let home = d.join("home");
    let work = d.join("work");
    fs::create_dir_all(&home).unwrap();
    fs::create_dir_all(&work).unwrap();
    let tmp = d.join("tmp");
    fs::create_dir_all(&tmp).unwrap();
    let run = |env: &[(&str, &str)], args: &[&str]| {
        let mut cmd = common::tpmcrypt(&work);
        cmd.env("HOME", &home)
            .env_remove("TPMCRYPT_HOME")
            .env_remove("TPMCRYPT_AGENT_SOCK")
            .env_remove("XDG_DATA_HOME")
            .env_remove("XDG_RUNTIME_DIR")
            .env("TMPDIR", &tmp);
        for (k, v) in env {
            cmd.env(k, v);
        }
        common::Run::from(cmd.args(args).output().expect("run"))
    };
    let r = run(&[("XDG_DATA_HOME", "rel")], &["key", "list"]);
    assert_ok(&r, "key list");
    assert!(
        !work.join("rel").exists(),
        "a keystore made in the working directory"
    );
    let said = format!("{}{}", String::from_utf8_lossy(&r.stdout), r.stderr);
    assert!(
        said.contains(&home.join(".local/share/tpmcrypt").display().to_string()),
        "the default keystore: {said}"
    );
    assert!(
        !home.join(".local/share/tpmcrypt").exists(),
        "a keystore made by a command that only reads"
    );
    let uid = unsafe { libc::geteuid() };
    for (env, socket) in [
        (
            vec![("XDG_RUNTIME_DIR", "relrun")],
            tmp.join(format!("tpmcrypt-{uid}/tpmcrypt/agent.sock")),
        ),
        (
            vec![("XDG_RUNTIME_DIR", "relrun"), ("TMPDIR", "reltmp")],
            PathBuf::from(format!("/tmp/tpmcrypt-{uid}/tpmcrypt/agent.sock")),
        ),
    ] {
        let r = run(&env, &["agent", "--stop"]);
        common::assert_error_line(
            &r,
            1,
            None,
            &[&format!("no agent is running at {}", socket.display())],
            "agent --stop",
        );
    }
    // A relative HOME, without XDG_DATA_HOME: no keystore is made from it
    // (`HOME=~`, as a unit file's Environment= line gives it, made `./~`).
    for home_value in ["~", "."] {
        let r = run(&[("HOME", home_value)], &["key", "list"]);
        common::assert_error_line(
            &r,
            r.code,
            None,
            &["HOME is not an absolute path"],
            home_value,
        );
        assert_ne!(r.code, 0, "{home_value}");
    }
    assert!(!work.join("~").exists() && !work.join(".local").exists());
    // An absolute one is used, as before.
    let xdg = d.join("xdg-data");
    let r = run(
        &[("XDG_DATA_HOME", xdg.to_str().unwrap())],
        &["key", "list"],
    );
    assert_ok(&r, "key list");
    let said = format!("{}{}", String::from_utf8_lossy(&r.stdout), r.stderr);
    assert!(
        said.contains(&xdg.join("tpmcrypt").display().to_string()),
        "{said}"
    );
}

/// Two agents started on one stale socket (left by an agent killed with
/// SIGKILL), the second while the first is between removing the stale
/// socket and binding its own: the second is refused, and the first is
/// the one agent there, which `agent --stop` stops. The build before let
/// both bind: the first removed the second's socket, and the second then
/// ran for ever, holding whatever keys it was given, out of reach of
/// `agent --stop`.
#[test]
fn two_agents_starting_on_a_stale_socket_never_both_run() {
    let dir = scratch();
    let d = dir.path();
    let sock = d.join("run").join("agent.sock");
    let mut killed = start_agent(d, &sock);
    killed.kill().expect("kill -9");
    killed.wait().expect("wait");
    assert!(sock.exists(), "a stale socket is left");
    // The first: held 1.5 s in its removal of the stale socket.
    let first = common::wrapper(d, "strace")
        .args(["-f", "-qq", "-o", "/dev/null"])
        .args(["-e", "inject=unlink,unlinkat:delay_enter=1500000:when=1"])
        .arg(common::bin())
        .args(["agent", "--ttl", "1m"])
        .env("TPMCRYPT_AGENT_SOCK", &sock)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("strace");
    let first_pid = first.id();
    let first = Stop(first);
    // Whatever happens, no agent is left running (killing strace would
    // leave the agent it traces).
    struct StopAgents<'a>(&'a Path, &'a Path);
    impl Drop for StopAgents<'_> {
        fn drop(&mut self) {
            for _ in 0..2 {
                let _ = tpmcrypt(self.0)
                    .args(["agent", "--stop"])
                    .env("TPMCRYPT_AGENT_SOCK", self.1)
                    .output();
            }
        }
    }
    let _stop_agents = StopAgents(d, &sock);
    common::wait_in_syscall(
        first_pid,
        &[libc::SYS_unlink, libc::SYS_unlinkat],
        "the first agent's unlink",
    );
    // The second, meanwhile.
    let second = tpmcrypt(d)
        .args(["agent", "--ttl", "1m"])
        .env("TPMCRYPT_AGENT_SOCK", &sock)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("agent");
    let r = common::finished_by(
        second,
        Instant::now() + Duration::from_secs(5),
        "the second agent",
    );
    common::assert_error_line(
        &r,
        1,
        None,
        &["an agent is already running", "agent.sock"],
        "the second agent",
    );
    // Said as what it is: not "invalid input", which it was called once.
    assert!(!r.stderr.contains("invalid input"), "{}", r.stderr);
    // The first binds once its removal is done, and is the agent there.
    let start = Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no agent listens"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let stop = || -> Run {
        tpmcrypt(d)
            .args(["agent", "--stop"])
            .env("TPMCRYPT_AGENT_SOCK", &sock)
            .output()
            .expect("agent --stop")
            .into()
    };
    assert_ok(&stop(), "agent --stop");
    let mut first = first;
    let status = first.0.wait().expect("wait");
    assert!(status.success(), "the first agent stopped: {status}");
    let again = stop();
    assert_eq!(again.code, 1, "no agent left: {}", again.stderr);
}

/// Where session keys cannot be locked in memory (the locked-memory limit
/// is 0 and the process lacks CAP_IPC_LOCK), a run says so in one
/// warning, once, and still works; so does the agent, in its log. The
/// build before said nothing: keys could go to swap unannounced.
#[test]
fn a_key_that_cannot_be_locked_in_memory_is_named() {
    require_root();
    let dir = scratch();
    let d = dir.path();
    let rec = recovery(d, "rec.key");
    fs::write(d.join("f"), b"secret").unwrap();
    let unlockable = |args: &[&str]| -> Run {
        common::wrapper(d, "setpriv")
            .args(["--bounding-set=-ipc_lock", "prlimit", "--memlock=0:0"])
            .arg(common::bin())
            .args(args)
            .output()
            .expect("setpriv")
            .into()
    };
    let warned = |r: &Run| -> Vec<String> {
        r.stderr
            .lines()
            .filter(|l| l.contains("could not be locked in memory"))
            .map(str::to_string)
            .collect()
    };
    let r = unlockable(&["encrypt", "-R", &rec, "f"]);
    assert_ok(&r, "encrypt");
    let lines = warned(&r);
    assert_eq!(lines.len(), 1, "{}", r.stderr);
    assert!(
        lines[0].starts_with("warning: ")
            && lines[0].contains("locked-memory limit 0 KiB")
            && lines[0].contains("swap"),
        "{}",
        lines[0]
    );
    let r = unlockable(&["decrypt", "-i", "rec.key", "-o", "-", "f.tpmc"]);
    assert_ok(&r, "decrypt");
    assert_eq!(r.stdout, b"secret");
    assert_eq!(warned(&r).len(), 1, "{}", r.stderr);
    // As things usually are: not a word.
    let r = common::run(d, &["decrypt", "-i", "rec.key", "-o", "-", "f.tpmc"]);
    assert_ok(&r, "decrypt");
    assert!(warned(&r).is_empty(), "{}", r.stderr);
    // The agent, given an encryption session to hold.
    let sock = d.join("agent.sock");
    let log = d.join("agent.log");
    let agent = common::wrapper(d, "setpriv")
        .args(["--bounding-set=-ipc_lock", "prlimit", "--memlock=0:0"])
        .arg(common::bin())
        .args(["agent", "--ttl", "1m"])
        .env("TPMCRYPT_AGENT_SOCK", &sock)
        .stderr(fs::File::create(&log).unwrap())
        .spawn()
        .expect("agent");
    let agent = Stop(agent);
    let start = Instant::now();
    while !common::agent_socket_ready(&sock) {
        assert!(start.elapsed() < Duration::from_secs(10), "no socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    fs::write(d.join("g"), b"g").unwrap();
    let r: Run = tpmcrypt(d)
        .env("TPMCRYPT_AGENT_SOCK", &sock)
        .args(["-v", "encrypt", "-R", &rec, "g"])
        .output()
        .unwrap()
        .into();
    assert_ok(&r, "encrypt with the agent");
    assert!(
        r.stderr.contains("shared through the agent"),
        "{}",
        r.stderr
    );
    drop(agent);
    let text = fs::read_to_string(&log).unwrap();
    assert_eq!(
        text.lines()
            .filter(|l| l.contains("could not be locked in memory"))
            .count(),
        1,
        "{text}"
    );
}

/// The simulator's state holds a TPM's seeds: it is trusted as the
/// keystore is. Before, with the keystore in a directory another user
/// controls, root's `--simulator` run (`doctor`, `key create`, `pcr sign`)
/// followed their symlink `simulator` to a directory of root's (standing
/// for `/etc`), made it 0700 and wrote the TPM's state into it.
#[test]
fn the_simulators_state_is_trusted_as_the_keystore_is() {
    require_root();
    let dir = scratch();
    let d = dir.path();
    let etc = d.join("etc");
    fs::create_dir(&etc).unwrap();
    common::chmod(&etc, 0o755);
    fs::write(etc.join("passwd"), b"root:x:0:0").unwrap();
    let ks = d.join("ks");
    their_dir(&ks, 0o755);
    std::os::unix::fs::symlink(&etc, ks.join("simulator")).unwrap();
    chown(&ks.join("simulator"), NOBODY);
    let signer = d.join("signer");
    let made = tpmcrypt(d)
        .args(["pcr-signer", "create", "--out"])
        .arg(&signer)
        .output()
        .expect("spawn");
    assert_ok(&made.into(), "pcr-signer create");
    let signer = signer.to_str().unwrap();
    for args in [
        &["doctor"][..],
        &["key", "create", "k"],
        &[
            "pcr",
            "sign",
            "--current",
            "--pcrs",
            "sha256:16",
            "--signer",
            signer,
            "-o",
            "p",
        ],
    ] {
        let r: Run = tpmcrypt(d)
            .env("TPMCRYPT_HOME", &ks)
            .arg("--simulator")
            .args(args)
            .output()
            .expect("spawn")
            .into();
        assert_eq!(
            common::mode_of(&etc),
            0o755,
            "{args:?} changed the mode of root's directory: {}",
            r.stderr
        );
        assert_eq!(
            common::listing(&etc),
            ["passwd"],
            "{args:?} wrote into root's directory: {}",
            r.stderr
        );
        let said = format!("{}{}", String::from_utf8_lossy(&r.stdout), r.stderr);
        assert!(said.contains("uid 65534"), "{args:?}: {said}");
        assert_ne!(r.code, 0, "{args:?}: {said}");
    }
}

/// The second half of [`the_simulators_state_is_trusted_as_the_keystore_is`]:
/// a keystore not made yet in a sticky directory (as /tmp), whose parent
/// the other user makes (0777) while root is asked for the new key's PIN.
/// Before, the simulator made the keystore there, unchecked, and root's key
/// files were written into it (exit 0).
#[test]
fn a_keystore_whose_parent_another_user_made_meanwhile_gets_no_key() {
    require_root();
    let dir = scratch();
    let d = dir.path();
    let public = d.join("tmp");
    fs::create_dir(&public).unwrap();
    common::chmod(&public, 0o1777);
    let later = public.join("later");
    let askpass = d.join("askpass");
    fs::write(
        &askpass,
        format!(
            "#!/bin/sh\n[ -d {0} ] || \
             setpriv --reuid 65534 --regid 65534 --clear-groups mkdir -m 0777 {0}\n\
             echo 1234\n",
            later.display()
        ),
    )
    .unwrap();
    common::chmod(&askpass, 0o755);
    let r: Run = tpmcrypt(d)
        .env("TPMCRYPT_HOME", later.join("ks"))
        .env("TPMCRYPT_ASKPASS", &askpass)
        .args(["--simulator", "key", "create", "--pin", "k"])
        .output()
        .expect("spawn")
        .into();
    assert_ne!(r.code, 0, "key create in their directory: {}", r.stderr);
    assert!(r.stderr.contains("uid 65534"), "{}", r.stderr);
    assert_eq!(
        fs::metadata(&later).map(|m| m.uid()).ok(),
        Some(NOBODY),
        "the askpass program made the parent: {}",
        r.stderr
    );
    assert!(
        common::listing(&later).is_empty(),
        "root's run made {:?} in the other user's directory",
        common::listing(&later)
    );
}
