//! Shared helpers for the end-to-end tests: run the real binary in a
//! scratch directory and capture what it did.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// Path of the binary under test.
pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tpmcrypt"))
}

/// A command for the binary, run in `dir`, with a clean environment for
/// the variables tpmcrypt reads.
pub fn tpmcrypt(dir: &Path) -> Command {
    let mut cmd = Command::new(bin());
    // A keystore and agent socket of the test's own, never the user's.
    cmd.current_dir(dir)
        .env("TPMCRYPT_HOME", dir.join(".tpmcrypt-home"))
        .env("TPMCRYPT_AGENT_SOCK", dir.join(".tpmcrypt-agent.sock"))
        .env_remove("TPMCRYPT_TCTI")
        .env_remove("TPM2TOOLS_TCTI")
        .env_remove("TSS2_TCTI")
        .env_remove("TPMCRYPT_SIMULATOR")
        .env_remove("TPMCRYPT_PIN")
        .stdin(Stdio::null());
    cmd
}

/// A command for `program` (e.g. strace) that will run the binary: the same
/// directory and environment as [`tpmcrypt`].
pub fn wrapper(dir: &Path, program: &str) -> Command {
    let mut cmd = Command::new(program);
    for (key, value) in tpmcrypt(dir).get_envs() {
        match value {
            Some(v) => cmd.env(key, v),
            None => cmd.env_remove(key),
        };
    }
    cmd.current_dir(dir).stdin(Stdio::null());
    cmd
}

/// The result of a run.
pub struct Run {
    pub code: i32,
    pub stdout: Vec<u8>,
    pub stderr: String,
}

impl From<Output> for Run {
    fn from(o: Output) -> Self {
        Run {
            code: o.status.code().unwrap_or(-1),
            stdout: o.stdout,
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
}

/// Runs `args` in `dir`.
pub fn run(dir: &Path, args: &[&str]) -> Run {
    tpmcrypt(dir)
        .args(args)
        .output()
        .expect("spawn tpmcrypt")
        .into()
}

/// The run of `child`, which must end by `deadline`: else it is killed
/// and the test fails (a run that waits on a FIFO, or a daemon that
/// started where it should have refused, fails the test, not hangs it).
pub fn finished_by(
    mut child: std::process::Child,
    deadline: std::time::Instant,
    what: &str,
) -> Run {
    while child.try_wait().expect("wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running at its deadline");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    child.wait_with_output().expect("output").into()
}

/// An exclusive `flock` on a file (made 0644 if missing, as `flock(1)`
/// makes it), taken by the test itself so that it is held as long as the
/// test wants, and let go at once on drop (`LOCK_UN` lets go of it even
/// where a child another thread is forking holds a copy of the descriptor).
pub struct HeldLock(std::fs::File);

impl HeldLock {
    pub fn take(path: &Path) -> HeldLock {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(path)
            .expect("open the lock file");
        // SAFETY: flock on a descriptor we own.
        let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
        assert_eq!(r, 0, "flock {}", path.display());
        HeldLock(file)
    }
}

impl Drop for HeldLock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: as above.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// A child's standard error, read line by line on a thread as it comes,
/// so that a test waits for what the run says ("waiting for the keystore's
/// lock …") instead of sleeping and hoping the run got there.
pub struct StderrLines {
    seen: std::sync::Arc<(std::sync::Mutex<String>, std::sync::Condvar)>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl StderrLines {
    /// Takes `child`'s piped standard error.
    pub fn of(child: &mut std::process::Child) -> StderrLines {
        use std::io::BufRead;
        let pipe = child.stderr.take().expect("stderr piped");
        let seen = std::sync::Arc::new((std::sync::Mutex::new(String::new()), Default::default()));
        let shared = seen.clone();
        let reader = std::thread::spawn(move || {
            let mut lines = std::io::BufReader::new(pipe);
            let mut line = Vec::new();
            while lines.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
                let (text, cv): &(std::sync::Mutex<String>, std::sync::Condvar) = &shared;
                text.lock()
                    .expect("lock")
                    .push_str(&String::from_utf8_lossy(&line));
                cv.notify_all();
                line.clear();
            }
        });
        StderrLines {
            seen,
            reader: Some(reader),
        }
    }

    /// Whether a line containing `needle` came within `within`.
    pub fn wait_for(&self, needle: &str, within: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + within;
        let (text, cv) = &*self.seen;
        let mut got = text.lock().expect("lock");
        while !got.contains(needle) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            got = cv.wait_timeout(got, left).expect("lock").0;
        }
        true
    }

    /// The run of `child` (see [`finished_by`]), with all it said.
    pub fn finished_by(
        mut self,
        child: std::process::Child,
        deadline: std::time::Instant,
        what: &str,
    ) -> Run {
        let mut run = finished_by(child, deadline, what);
        // The pipe ends with the run, unless something it started still
        // holds it: then what came so far.
        if let Some(reader) = self.reader.take() {
            let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while !reader.is_finished() && std::time::Instant::now() < until {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            if reader.is_finished() {
                reader.join().expect("stderr reader");
            }
        }
        run.stderr = self.seen.0.lock().expect("lock").clone();
        run
    }
}

/// Runs `args` in `dir`, which must end within `secs` seconds (see
/// [`finished_by`]).
pub fn run_within(dir: &Path, args: &[&str], secs: u64) -> Run {
    let child = tpmcrypt(dir)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn tpmcrypt");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    finished_by(child, deadline, &format!("{args:?}"))
}

/// Runs `args` in `dir` with `input` on stdin.
pub fn run_stdin(dir: &Path, args: &[&str], input: &[u8]) -> Run {
    use std::io::Write;
    let mut child = tpmcrypt(dir)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tpmcrypt");
    let mut stdin = child.stdin.take().expect("stdin");
    let data = input.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&data);
    });
    let out = child.wait_with_output().expect("wait");
    writer.join().expect("stdin writer");
    out.into()
}

/// Runs `args` (words split by the shell) in `dir` with standard output
/// closed at start (`>&-`).
pub fn run_with_stdout_closed(dir: &Path, args: &str) -> Run {
    wrapper(dir, "sh")
        .arg("-c")
        .arg(format!("exec \"$0\" {args} >&-"))
        .arg(bin())
        .output()
        .expect("sh")
        .into()
}

/// Creates a recovery identity `name` in `dir`; returns its recipient string.
pub fn recovery(dir: &Path, name: &str) -> String {
    let r = run(dir, &["recovery", "create", "--out", name]);
    assert_eq!(r.code, 0, "recovery create failed: {}", r.stderr);
    String::from_utf8(r.stdout)
        .expect("utf8")
        .trim()
        .to_string()
}

/// Deterministic pseudo-random bytes (xorshift), so failures reproduce.
pub fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Names of the entries of `dir`, sorted.
pub fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Trials for the kill -9 loops: 20 in the regular suite, more with
/// The lines of an strace log (`-o`) for the calls a run made, each once.
/// A call the kernel restarted (an `execve` that met a signal while it
/// waited for its lock, a `connect` under `SA_RESTART`) is printed twice,
/// its first try ending `= ? ERESTART…`; that try is left out, and where
/// another process's line split it (`<unfinished ...>`, then `<... NAME
/// resumed> … = ? ERESTART…`), both of its halves.
pub fn calls_made(log: &str) -> impl Iterator<Item = &str> {
    let lines: Vec<&str> = log.lines().collect();
    let mut left_out = vec![false; lines.len()];
    for (i, line) in lines.iter().enumerate() {
        if !line.contains("= ? ERESTART") {
            continue;
        }
        left_out[i] = true;
        let Some((_, resumed)) = line.split_once("<... ") else {
            continue;
        };
        let pid = line.split_whitespace().next();
        let call = format!("{}(", resumed.split_whitespace().next().unwrap_or_default());
        if let Some(j) = (0..i).rev().find(|&j| {
            lines[j].split_whitespace().next() == pid
                && lines[j].contains(&call)
                && lines[j].ends_with("<unfinished ...>")
        }) {
            left_out[j] = true;
        }
    }
    lines
        .into_iter()
        .zip(left_out)
        .filter(|&(_, out)| !out)
        .map(|(line, _)| line)
}

/// `TPMCRYPT_KILL_TRIALS` (`scripts/reliability` runs 100).
pub fn kill_trials() -> usize {
    std::env::var("TPMCRYPT_KILL_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(20)
}

/// The children of process `pid` (from /proc), e.g. the program a wrapper
/// such as strace started.
pub fn child_pids_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Waits (up to 30 s, else the test fails) until a thread of process
/// `pid` or of one of its children is in one of the system calls `nrs`, as
/// `/proc/PID/task/TID/syscall` shows it, also while strace holds the
/// call: a test acts once a run is inside the call strace delays, rather
/// than after a sleep it hopes is long enough.
pub fn wait_in_syscall(pid: u32, nrs: &[libc::c_long], what: &str) {
    let nrs: Vec<String> = nrs.iter().map(|n| n.to_string()).collect();
    let inside = || {
        std::iter::once(pid).chain(child_pids_of(pid)).any(|p| {
            std::fs::read_dir(format!("/proc/{p}/task"))
                .into_iter()
                .flatten()
                .flatten()
                .any(|t| {
                    std::fs::read_to_string(t.path().join("syscall")).is_ok_and(|l| {
                        l.split_whitespace()
                            .next()
                            .is_some_and(|n| nrs.iter().any(|x| x == n))
                    })
                })
        })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !inside() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: never got there"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Whether the agent's socket at `sock` is ready: there, a socket, and of
/// mode 0600. The agent binds and listens (one call in std), then sets the
/// mode; so a socket that merely exists may still refuse a connection, or
/// show the umask's mode, for a moment.
pub fn agent_socket_ready(sock: &Path) -> bool {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    std::fs::symlink_metadata(sock)
        .is_ok_and(|m| m.file_type().is_socket() && m.permissions().mode() & 0o777 == 0o600)
}

/// xorshift64: random but reproducible choices (kill moments, file sizes).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The bound of the random wait before a kill -9, adapted after every
/// trial so that the kills land while the work is under way: shorter after
/// a trial whose work was already finished, longer after one that had not
/// begun. Units are the caller's (ms or µs).
pub struct KillDelay {
    pub bound: u64,
    min: u64,
    max: u64,
}

impl KillDelay {
    pub fn new(start: u64, min: u64, max: u64) -> Self {
        KillDelay {
            bound: start,
            min,
            max,
        }
    }

    /// How long to wait before the next kill.
    pub fn pick(&self, rng: &mut Rng) -> u64 {
        rng.below(self.bound)
    }

    /// The kill came after the work was done: aim earlier.
    pub fn finished(&mut self) {
        self.bound = (self.bound * 2 / 3).max(self.min);
    }

    /// The kill came before any work was done: aim later.
    pub fn not_begun(&mut self) {
        self.bound = (self.bound * 3 / 2).min(self.max);
    }
}

/// Payload parameters as docs/format.md describes them: the tests compute
/// sizes and offsets from the document, independently of the implementation.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub cbc: bool,
    pub key_len: usize,
    pub segment: usize,
}

impl Layout {
    pub fn new(mode: &str, bits: u32, segment: usize) -> Self {
        Layout {
            cbc: mode == "cbc",
            key_len: bits as usize / 8,
            segment,
        }
    }

    /// Length byte, salt, 7-byte nonce prefix.
    pub fn stream_header(&self) -> usize {
        1 + self.key_len + 7
    }

    /// Plaintext bytes in full segment `i`.
    pub fn plain(&self, i: usize) -> usize {
        if self.cbc {
            // IV, one padding block at most, HMAC tag of key_len bytes.
            self.segment - 32 - self.key_len
        } else if i == 0 {
            self.segment - self.stream_header() - 16
        } else {
            self.segment - 16
        }
    }

    pub fn sealed(&self, n: usize) -> usize {
        if self.cbc {
            16 + (n / 16 + 1) * 16 + self.key_len
        } else {
            n + 16
        }
    }

    /// Payload length (stream header and segments) for `len` plaintext bytes.
    pub fn payload_len(&self, len: usize) -> usize {
        let mut total = self.stream_header();
        let mut left = len;
        let mut i = 0;
        while left > self.plain(i) {
            total += self.sealed(self.plain(i));
            left -= self.plain(i);
            i += 1;
        }
        total + self.sealed(left)
    }
}

/// A scratch directory, on tmpfs when there is one: the CLI fsyncs every
/// output, and thousands of fsyncs on a shared disk would dominate.
pub fn scratch(prefix: &str) -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    let mut b = tempfile::Builder::new();
    b.prefix(prefix);
    if shm.is_dir() {
        if let Ok(d) = b.tempdir_in(shm) {
            return d;
        }
    }
    b.tempdir().expect("tempdir")
}

/// Decrypts `path` in this process (not through the binary) with the
/// recovery identity whose file text is `id_text`.
pub fn decrypt_in_process(id_text: &str, path: &Path) -> Vec<u8> {
    use tpmcrypt_cipher::recovery::RecoveryKey;
    use tpmcrypt_cipher::{Decryptor, Identity, StreamOptions};
    let identity: Box<dyn Identity> = Box::new(
        RecoveryKey::parse(id_text)
            .expect("identity")
            .into_identity()
            .expect("identity"),
    );
    let mut out = Vec::new();
    Decryptor::new(vec![identity])
        .decrypt(
            std::fs::File::open(path).unwrap(),
            &mut out,
            &StreamOptions::sequential(),
        )
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    out
}

/// Runs a tpm2-tools command (`args[0]`) in `dir` against `sim`.
pub fn tpm2_tool_output(sim: &tpmcrypt_tpmkey::Simulator, dir: &Path, args: &[&str]) -> Output {
    Command::new(args[0])
        .args(&args[1..])
        .env("TPM2TOOLS_TCTI", sim.tcti())
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} (install tpm2-tools): {e}", args[0]))
}

/// As [`tpm2_tool_output`], asserting success; returns stdout.
pub fn tpm2_tool(sim: &tpmcrypt_tpmkey::Simulator, dir: &Path, args: &[&str]) -> String {
    let out = tpm2_tool_output(sim, dir, args);
    assert!(
        out.status.success(),
        "{args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The transient objects and sessions the TPM still holds, as
/// `tpm2_getcap` lists them (each "- 0x…" line).
pub fn tpm_handles(sim: &tpmcrypt_tpmkey::Simulator, dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for cap in ["handles-transient", "handles-loaded-session"] {
        let text = tpm2_tool(sim, dir, &["tpm2_getcap", cap]);
        out.extend(
            text.lines()
                .filter(|l| l.contains("0x"))
                .map(|l| format!("{cap}: {}", l.trim())),
        );
    }
    out
}

/// Asserts that a run succeeded.
pub fn assert_ok(r: &Run, what: &str) {
    assert_eq!(
        r.code, 0,
        "{what}: expected success, got {}; stderr: {}",
        r.code, r.stderr
    );
}

/// The one-line error contract: exit `code`, exactly one stderr line,
/// starting `error: <label>: ` (or just `error: ` without a label) and
/// mentioning every needle (case-insensitively).
pub fn assert_error_line(r: &Run, code: i32, label: Option<&str>, needles: &[&str], what: &str) {
    assert_eq!(
        r.code, code,
        "{what}: expected exit {code}, got {}; stderr: {}",
        r.code, r.stderr
    );
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "{what}: expected exactly one stderr line, got {:?}",
        r.stderr
    );
    let prefix = match label {
        Some(label) => format!("error: {label}: "),
        None => "error: ".to_string(),
    };
    assert!(
        lines[0].starts_with(&prefix) && lines[0].len() > prefix.len(),
        "{what}: stderr {:?} does not start with {prefix:?}",
        lines[0]
    );
    let lower = lines[0].to_lowercase();
    for n in needles {
        assert!(
            lower.contains(&n.to_lowercase()),
            "{what}: stderr {:?} does not mention {n:?}",
            lines[0]
        );
    }
}

/// Permission bits of `path` itself (a symlink is not followed).
pub fn mode_of(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o7777
}

/// Sets the permission bits of `path`.
pub fn chmod(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

/// Starts a swtpm of its own whose state lives in `dir/name`.
pub fn swtpm(dir: &Path, name: &str) -> tpmcrypt_tpmkey::Simulator {
    tpmcrypt_tpmkey::Simulator::start(&dir.join(name))
        .unwrap_or_else(|e| panic!("cannot start swtpm (install the swtpm package): {e}"))
}

/// A loopback TCP port held closed: bound, never listening. A connection
/// to it is refused, and while it is held the kernel hands it to no other
/// `bind(…:0)` on the machine. A port merely found closed, or freed by a
/// stopped swtpm, can be the next one's (any test's, in any process): a
/// test that then expected "connection refused" reached that TPM instead.
pub struct ClosedPort(std::os::fd::OwnedFd);

/// Holds `port` on 127.0.0.1 closed (see [`ClosedPort`]); 0 for any free
/// port. `SO_REUSEADDR`, as a stopped swtpm's connections may still be in
/// TIME_WAIT on its port.
pub fn hold_closed(port: u16) -> std::io::Result<(ClosedPort, u16)> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: socket(2) returns a new descriptor, owned from here on.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a valid descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    let addr = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
        },
        sin_zero: [0; 8],
    };
    let mut bound: libc::sockaddr_in = addr;
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: valid descriptor, option and address buffers of their sizes.
    let ok = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        ) == 0
            && libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_in).cast(),
                len,
            ) == 0
            && libc::getsockname(
                fd.as_raw_fd(),
                (&mut bound as *mut libc::sockaddr_in).cast(),
                &mut len,
            ) == 0
    };
    if !ok {
        return Err(std::io::Error::last_os_error());
    }
    Ok((ClosedPort(fd), u16::from_be(bound.sin_port)))
}

/// The TCTI of a port pair nobody listens on, held closed for the rest of
/// this test process (see [`ClosedPort`]): connecting is refused.
pub fn closed_tcti() -> String {
    for _ in 0..20 {
        let (first, port) = hold_closed(0).expect("bind a loopback port");
        if port == u16::MAX {
            continue;
        }
        if let Ok((second, _)) = hold_closed(port + 1) {
            std::mem::forget((first, second));
            return format!("swtpm:host=127.0.0.1,port={port}");
        }
    }
    panic!("no closed loopback port pair found");
}

/// The TPM's dictionary-attack failure counter (TPM2_PT_LOCKOUT_COUNTER),
/// as tpm2-tools reads it.
pub fn lockout_counter(sim: &tpmcrypt_tpmkey::Simulator, dir: &Path) -> u64 {
    let out = tpm2_tool(sim, dir, &["tpm2_getcap", "properties-variable"]);
    let line = out
        .lines()
        .find(|l| l.starts_with("TPM2_PT_LOCKOUT_COUNTER:"))
        .unwrap_or_else(|| panic!("no lockout counter in {out}"));
    let hex = line.rsplit("0x").next().unwrap_or_default().trim();
    u64::from_str_radix(hex, 16).unwrap_or_else(|e| panic!("{line}: {e}"))
}

/// The largest resident set (KiB) of any child this test process waited
/// for (RUSAGE_CHILDREN): a test file that measures it holds one test.
pub fn max_child_rss_kib() -> i64 {
    // SAFETY: getrusage writes into the zeroed struct we pass.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    assert_eq!(rc, 0, "getrusage failed");
    usage.ru_maxrss
}

/// The descriptors of process `pid` (`/proc/PID/fd/N`), each with the
/// path it names (a file with no name shows as `DIR/#INODE (deleted)`).
fn descriptors(pid: &str) -> Vec<(PathBuf, PathBuf)> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    fds.flatten()
        .filter_map(|fd| Some((fd.path(), std::fs::read_link(fd.path()).ok()?)))
        .collect()
}

/// Whether process `pid` has a file open in directory `dir` (given
/// canonical), as its descriptors name them: an output being written with
/// no name yet shows as `DIR/#INODE (deleted)`.
pub fn has_a_file_open_in(pid: u32, dir: &Path) -> bool {
    descriptors(&pid.to_string())
        .iter()
        .any(|(_, target)| target.parent() == Some(dir))
}

/// A path through which an output being written with no name yet in
/// `dir` can be read or measured (`/proc/PID/fd/N` of whichever process
/// holds it: its link shows `DIR/#INODE (deleted)`).
pub fn unnamed_output_in(dir: &Path) -> Option<PathBuf> {
    let dir = dir.canonicalize().ok()?;
    let unnamed = |target: &Path| {
        target.parent() == Some(dir.as_path())
            && target
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('#'))
            && target.to_string_lossy().ends_with(" (deleted)")
    };
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|pid| pid.bytes().all(|b| b.is_ascii_digit()))
        .find_map(|pid| {
            descriptors(&pid)
                .into_iter()
                .find(|(_, target)| unnamed(target))
                .map(|(fd, _)| fd)
        })
}

/// A TCP proxy in front of swtpm's command port that records the command
/// code of every TPM command passing through (swtpm's server speaks the
/// bare TPM protocol: a 10-byte header with the size, then the body).
pub struct Counter {
    /// The port to give the swtpm TCTI instead of swtpm's.
    pub port: u16,
    /// The command codes seen, in order.
    pub codes: std::sync::Arc<std::sync::Mutex<Vec<u32>>>,
}

impl Counter {
    /// Listens on a free pair of ports (the swtpm TCTI uses port and
    /// port + 1): commands on the first are counted, the control channel on
    /// the second is piped through as it is.
    pub fn start(tpm_port: u16) -> Counter {
        Counter::start_slowed(tpm_port, std::time::Duration::ZERO)
    }

    /// As [`Counter::start`], holding each response back by `delay` (a
    /// slow TPM, whose commands a test can interrupt half-way).
    pub fn start_slowed(tpm_port: u16, delay: std::time::Duration) -> Counter {
        let (listener, control) = loop {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let p = l.local_addr().unwrap().port();
            if p == u16::MAX {
                continue;
            }
            if let Ok(c) = std::net::TcpListener::bind(("127.0.0.1", p + 1)) {
                break (l, c);
            }
        };
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for client in control.incoming() {
                let Ok(client) = client else { return };
                let Ok(ctl) = std::net::TcpStream::connect(("127.0.0.1", tpm_port + 1)) else {
                    return;
                };
                pipe(client.try_clone().unwrap(), ctl.try_clone().unwrap());
                pipe(ctl, client);
            }
        });
        let codes = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = codes.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(mut client) = client else { return };
                let Ok(mut tpm) = std::net::TcpStream::connect(("127.0.0.1", tpm_port)) else {
                    return;
                };
                while let Some(cmd) = read_message(&mut client) {
                    seen.lock()
                        .unwrap()
                        .push(u32::from_be_bytes([cmd[6], cmd[7], cmd[8], cmd[9]]));
                    let relayed = std::io::Write::write_all(&mut tpm, &cmd)
                        .ok()
                        .and_then(|()| read_message(&mut tpm));
                    std::thread::sleep(delay);
                    match relayed {
                        Some(resp) if std::io::Write::write_all(&mut client, &resp).is_ok() => {}
                        _ => break,
                    }
                }
            }
        });
        Counter { port, codes }
    }
}

fn pipe(mut from: std::net::TcpStream, mut to: std::net::TcpStream) {
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from, &mut to);
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
}

fn read_message(s: &mut std::net::TcpStream) -> Option<Vec<u8>> {
    let mut head = [0u8; 10];
    std::io::Read::read_exact(s, &mut head).ok()?;
    let size = u32::from_be_bytes([head[2], head[3], head[4], head[5]]) as usize;
    let mut msg = head.to_vec();
    msg.resize(size.max(10), 0);
    std::io::Read::read_exact(s, &mut msg[10..]).ok()?;
    Some(msg)
}

/// The swtpm TCTI's port (`swtpm:host=…,port=N`).
pub fn port_of(tcti: &str) -> u16 {
    tcti.rsplit("port=").next().unwrap().trim().parse().unwrap()
}

/// The default AES-GCM backend (128- and 256-bit keys) on this machine,
/// told from /proc/cpuinfo: aws-lc where its 512-bit VAES AES-GCM runs
/// (VAES, VPCLMULQDQ, AVX-512 F/DQ/BW/VL), else ring.
#[allow(dead_code)]
pub fn default_gcm_backend() -> &'static str {
    let info = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
    let flags: Vec<&str> = info
        .lines()
        .find(|l| l.starts_with("flags"))
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default();
    let wide = [
        "vaes",
        "vpclmulqdq",
        "avx512f",
        "avx512dq",
        "avx512bw",
        "avx512vl",
    ]
    .iter()
    .all(|f| flags.contains(f));
    if wide {
        "aws-lc"
    } else {
        "ring"
    }
}

/// The `-v` summary line of a rekey.
pub fn rekey_summary(r: &Run) -> String {
    r.stderr
        .lines()
        .find(|l| l.starts_with("tpmcrypt: rekeyed "))
        .unwrap_or_else(|| panic!("no rekey summary in {:?}", r.stderr))
        .to_string()
}
