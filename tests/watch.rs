//! End-to-end tests of `tpmcrypt watch`: the real binary watching a scratch
//! SRC, checked by decrypting DEST with `tpmcrypt decrypt`.

mod common;

use std::collections::HashMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{symlink, PermissionsExt};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{bytes, recovery, run, run_within, tpmcrypt, KillDelay, Rng};
use serde_json::Value;
use tempfile::TempDir;

const PARTIAL_MARKER: &str = ".tpmcrypt-partial.";

/// A scratch directory with a recovery identity `id`, SRC and DEST.
struct Scratch {
    dir: TempDir,
    recipient: String,
}

impl Scratch {
    fn new() -> Scratch {
        // tmpfs (see common::scratch): batches, not an fsync per output.
        let dir = common::scratch("tpmcrypt-watch-");
        let recipient = recovery(dir.path(), "id");
        fs::create_dir(dir.path().join("src")).expect("mkdir src");
        Scratch { dir, recipient }
    }
    fn path(&self) -> &Path {
        self.dir.path()
    }
    fn src(&self) -> PathBuf {
        self.path().join("src")
    }
    fn dest(&self) -> PathBuf {
        self.path().join("dest")
    }
    fn stats(&self) -> Value {
        let b = fs::read(self.path().join("stats.json")).expect("stats.json");
        serde_json::from_slice(&b).expect("stats json")
    }
    fn log(&self, n: usize) -> String {
        fs::read_to_string(self.path().join(format!("log.{n}"))).unwrap_or_default()
    }

    /// Starts the daemon (log in `log.N`); waits for READY=1 if `ready`.
    fn start(&self, n: usize, extra: &[&str], ready: bool) -> Child {
        self.start_with(n, extra, ready, &[], None)
    }

    /// [`Scratch::start`], the binary run by `wrap` (a program and its
    /// arguments, e.g. strace) if not empty, and as `uid` if given.
    fn start_with(
        &self,
        n: usize,
        extra: &[&str],
        ready: bool,
        wrap: &[&str],
        uid: Option<u32>,
    ) -> Child {
        self.start_env(n, extra, ready, wrap, uid, &[])
    }

    /// [`Scratch::start_with`], with these environment variables.
    fn start_env(
        &self,
        n: usize,
        extra: &[&str],
        ready: bool,
        wrap: &[&str],
        uid: Option<u32>,
        env: &[(&str, &str)],
    ) -> Child {
        let sock_path = self.path().join(format!("notify.{n}"));
        let _ = fs::remove_file(&sock_path);
        let sock = UnixDatagram::bind(&sock_path).expect("bind notify socket");
        sock.set_read_timeout(Some(Duration::from_millis(100)))
            .expect("timeout");
        let log = fs::File::create(self.path().join(format!("log.{n}"))).expect("log");
        let src = self.src();
        let dest = self.dest();
        let stats = self.path().join("stats.json");
        let mut args: Vec<&str> = vec![
            "watch",
            src.to_str().expect("utf8"),
            "--out",
            dest.to_str().expect("utf8"),
            "-R",
            &self.recipient,
            "--stats-interval",
            "200ms",
            "--stats-json",
            stats.to_str().expect("utf8"),
        ];
        if !extra.contains(&"--settle") {
            args.extend_from_slice(&["--settle", "50ms"]);
        }
        args.extend_from_slice(extra);
        let mut cmd = match wrap.split_first() {
            Some((program, wrap_args)) => {
                let mut cmd = common::wrapper(self.path(), program);
                cmd.args(wrap_args).arg(common::bin());
                cmd
            }
            None => tpmcrypt(self.path()),
        };
        if let Some(uid) = uid {
            use std::os::unix::process::CommandExt;
            // The daemon must be able to write its stats and notify.
            for p in [self.path(), sock_path.as_path()] {
                fs::set_permissions(p, fs::Permissions::from_mode(0o777)).expect("chmod");
            }
            cmd.uid(uid).gid(uid);
        }
        cmd.envs(env.iter().copied());
        let mut child = cmd
            .args(&args)
            .env("NOTIFY_SOCKET", &sock_path)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn watch");
        if ready {
            let deadline = Instant::now() + Duration::from_secs(30);
            let mut buf = [0u8; 1024];
            loop {
                if let Ok(k) = sock.recv(&mut buf) {
                    if String::from_utf8_lossy(&buf[..k])
                        .lines()
                        .any(|l| l == "READY=1")
                    {
                        break;
                    }
                }
                if let Ok(Some(st)) = child.try_wait() {
                    panic!("watch exited early ({st}): {}", self.log(n));
                }
                assert!(Instant::now() < deadline, "not ready: {}", self.log(n));
            }
        }
        child
    }

    /// [`Scratch::start`] (waiting for READY=1) with the debug build's
    /// pause hook, `TPMCRYPT_WATCH_TEST_PAUSE=spec` (worker.rs `pause`).
    fn start_paused(&self, n: usize, extra: &[&str], spec: &str) -> Child {
        self.start_env(
            n,
            extra,
            true,
            &[],
            None,
            &[("TPMCRYPT_WATCH_TEST_PAUSE", spec)],
        )
    }

    /// Decrypts every .tpmc under DEST (next to it) and returns relative
    /// path (without .tpmc) → plaintext.
    fn decrypt_all(&self) -> HashMap<PathBuf, Vec<u8>> {
        let dest = self.dest();
        let r = run(
            self.path(),
            &[
                "decrypt",
                "-q",
                "-f",
                "-i",
                "id",
                "-r",
                dest.to_str().expect("utf8"),
            ],
        );
        assert_eq!(r.code, 0, "decrypt -r DEST failed: {}", r.stderr);
        let mut out = HashMap::new();
        for ct in walk(&dest) {
            let s = ct.to_string_lossy().into_owned();
            if let Some(plain) = s.strip_suffix(".tpmc") {
                let rel = Path::new(plain)
                    .strip_prefix(&dest)
                    .expect("under dest")
                    .to_path_buf();
                out.insert(rel, fs::read(plain).expect("decrypted output"));
                fs::remove_file(plain).expect("rm decrypted");
            }
        }
        out
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let ft = e.file_type().expect("file type");
        if ft.is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path());
        }
    }
    out
}

fn ciphertexts(dest: &Path) -> usize {
    walk(dest)
        .iter()
        .filter(|p| {
            p.to_string_lossy().ends_with(".tpmc") && !p.to_string_lossy().contains(PARTIAL_MARKER)
        })
        .count()
}

fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: signalling our own child.
    unsafe {
        libc::kill(child.id() as i32, sig);
    }
}

/// SIGTERM and wait (at most 60 s); returns the exit code.
fn stop(mut child: Child) -> i32 {
    signal(&child, libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(st) = child.try_wait().expect("wait") {
            return st.code().unwrap_or(-1);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("watch did not stop within 60 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn write_file(path: &Path, data: &[u8]) {
    if let Some(p) = path.parent() {
        fs::create_dir_all(p).expect("mkdir");
    }
    fs::write(path, data).expect("write");
}

// ------------------------------------------------------------------ tests

#[test]
fn startup_scan_and_files_arriving_during_it() {
    let s = Scratch::new();
    let mut want = HashMap::new();
    for i in 0..1500u64 {
        let rel = PathBuf::from(format!("old/d{}/f{i}", i % 7));
        let data = bytes((i as usize * 37) % 3000, i);
        write_file(&s.src().join(&rel), &data);
        want.insert(rel, data);
    }
    let child = s.start(0, &[], false);
    // While it starts up (and scans), more files arrive, some in new
    // directories.
    for i in 0..300u64 {
        let rel = PathBuf::from(format!("new/sub{}/deeper/g{i}", i % 3));
        let data = bytes(100 + i as usize, 1000 + i);
        write_file(&s.src().join(&rel), &data);
        want.insert(rel, data);
    }
    let n = want.len();
    wait_for("all ciphertexts", Duration::from_secs(60), || {
        ciphertexts(&s.dest()) == n
    });
    assert_eq!(stop(child), 0, "{}", s.log(0));
    let got = s.decrypt_all();
    assert_eq!(got.len(), n);
    for (rel, data) in &want {
        assert_eq!(got.get(rel), Some(data), "{}", rel.display());
        // Without --delete-plaintext sources are left alone.
        assert!(s.src().join(rel).exists());
    }
    let st = s.stats();
    assert_eq!(st["files"], n as u64);
    assert_eq!(st["failures"], 0);
}

#[test]
fn slow_writer_is_taken_only_after_close_and_settle() {
    let s = Scratch::new();
    let child = s.start(0, &[], true);
    let path = s.src().join("slow.bin");
    let ct = s.dest().join("slow.bin.tpmc");
    let data = bytes(40 * 1000, 7);
    let mut f = fs::File::create(&path).expect("create");
    for chunk in data.chunks(1000) {
        f.write_all(chunk).expect("write");
        f.flush().expect("flush");
        std::thread::sleep(Duration::from_millis(60)); // longer than --settle
        assert!(!ct.exists(), "taken while the writer still had it open");
    }
    drop(f);
    wait_for("the ciphertext", Duration::from_secs(10), || ct.exists());
    assert_eq!(stop(child), 0);
    let got = s.decrypt_all();
    assert_eq!(got.get(Path::new("slow.bin")), Some(&data));
    // A file with an open writer that is not writing is not taken either.
    let child = s.start(1, &[], true);
    let idle = s.src().join("idle");
    let mut f = fs::File::create(&idle).expect("create");
    f.write_all(b"first part").expect("write");
    std::thread::sleep(Duration::from_millis(600));
    assert!(!s.dest().join("idle.tpmc").exists(), "taken while open");
    f.write_all(b", second part").expect("write");
    drop(f);
    wait_for("idle.tpmc", Duration::from_secs(10), || {
        s.dest().join("idle.tpmc").exists()
    });
    assert_eq!(stop(child), 0);
    let got = s.decrypt_all();
    assert_eq!(
        got.get(Path::new("idle")).map(Vec::as_slice),
        Some(&b"first part, second part"[..])
    );
}

#[test]
fn a_recipients_file_gives_every_recipient() {
    let s = Scratch::new();
    let d = s.path();
    let rb = recovery(d, "id2");
    let rc = recovery(d, "id3");
    fs::write(d.join("recips.txt"), format!("# team\n{rb}\n\n{rc}\n")).unwrap();
    let child = s.start(0, &["-R", "recips.txt"], true);
    let data = bytes(3000, 5);
    write_file(&s.src().join("a"), &data);
    let ct = s.dest().join("a.tpmc");
    wait_for("a.tpmc", Duration::from_secs(30), || ct.exists());
    assert_eq!(stop(child), 0, "{}", s.log(0));
    let r = run(d, &["inspect", "--json", ct.to_str().unwrap()]);
    assert_eq!(r.code, 0, "inspect: {}", r.stderr);
    let v: Value = serde_json::from_slice(&r.stdout).unwrap();
    assert_eq!(
        v["recipients"].as_array().unwrap().len(),
        3,
        "-R string and both lines of the file: {v}"
    );
    for id in ["id", "id2", "id3"] {
        let r = run(d, &["decrypt", "-i", id, "-o", "-", ct.to_str().unwrap()]);
        assert_eq!(r.code, 0, "decrypt -i {id}: {}", r.stderr);
        assert!(r.stdout == data, "{id}");
    }

    // A file with a bad line: the daemon does not start.
    fs::write(d.join("bad.txt"), format!("{rb}\n{rc}x\n")).unwrap();
    let mut child = s.start(1, &["-R", "bad.txt"], false);
    let status = child.wait().expect("wait");
    assert_eq!(status.code(), Some(2), "{}", s.log(1));
    let log = s.log(1);
    assert_eq!(log.lines().count(), 1, "{log}");
    assert!(log.starts_with("error: bad.txt: line 2: "), "{log}");
}

#[test]
fn burst_of_5000_small_files() {
    let s = Scratch::new();
    let child = s.start(0, &["--workers", "4"], true);
    let t = Instant::now();
    for i in 0..5000u64 {
        fs::write(
            s.src().join(format!("b{i:05}")),
            bytes(64 + (i % 512) as usize, i),
        )
        .expect("write");
    }
    wait_for("5000 ciphertexts", Duration::from_secs(90), || {
        ciphertexts(&s.dest()) == 5000
    });
    eprintln!("burst of 5000 encrypted in {:?}", t.elapsed());
    assert_eq!(stop(child), 0, "{}", s.log(0));
    let st = s.stats();
    assert_eq!(st["files"], 5000);
    assert_eq!(st["failures"], 0);
    let got = s.decrypt_all();
    assert_eq!(got.len(), 5000);
    for i in 0..5000u64 {
        let rel = PathBuf::from(format!("b{i:05}"));
        assert_eq!(got[&rel], bytes(64 + (i % 512) as usize, i), "b{i:05}");
    }
}

fn vm_hwm_kib(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

#[test]
fn large_file_streams_in_constant_memory() {
    // The issue's 1 GiB: sixteen times the memory bound checked.
    const MIB: usize = 1 << 20;
    const SIZE_MIB: usize = 1024;
    let s = Scratch::new();
    let child = s.start(0, &["--delete-plaintext"], true);
    let path = s.src().join("big");
    let mut f = fs::File::create(&path).expect("create");
    let mut hasher = Fnv::default();
    for i in 0..SIZE_MIB {
        let chunk = bytes(MIB, i as u64 + 1);
        hasher.update(&chunk);
        f.write_all(&chunk).expect("write");
    }
    drop(f);
    let ct = s.dest().join("big.tpmc");
    wait_for(
        "the large file to be encrypted and removed",
        Duration::from_secs(120),
        || ct.exists() && !path.exists(),
    );
    let hwm = vm_hwm_kib(child.id());
    assert_eq!(stop(child), 0);
    assert!(hwm < 64 * 1024, "peak RSS {hwm} KiB");
    eprintln!("peak RSS while encrypting {SIZE_MIB} MiB: {hwm} KiB");
    // Decrypt to a file and compare by hash, streaming.
    let out = s.path().join("big.out");
    let r = run(
        s.path(),
        &[
            "decrypt",
            "-q",
            "-i",
            "id",
            "-o",
            out.to_str().expect("utf8"),
            ct.to_str().expect("utf8"),
        ],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let mut check = Fnv::default();
    let mut rd = fs::File::open(&out).expect("open");
    let mut buf = vec![0u8; MIB];
    let mut total = 0;
    loop {
        let k = rd.read(&mut buf).expect("read");
        if k == 0 {
            break;
        }
        total += k;
        check.update(&buf[..k]);
    }
    assert_eq!(total, SIZE_MIB * MIB);
    assert_eq!(check.0, hasher.0);
}

/// FNV-1a, enough to compare two streams in a test.
struct Fnv(u64);
impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf29ce484222325)
    }
}
impl Fnv {
    fn update(&mut self, data: &[u8]) {
        for &b in data {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x100000001b3);
        }
    }
}

#[test]
fn kill_9_at_random_moments_loses_nothing() {
    let s = Scratch::new();
    let mut want: HashMap<PathBuf, Vec<u8>> = HashMap::new();
    let mut rng = Rng(0x9e3779b97f4a7c15);
    // Five rounds per trial: a round is done in about 150 ms, and its
    // sources go in two or three batches a few milliseconds apart, now
    // that a batch no longer waits 20 ms behind a busy commit; a kill
    // lands between them in about 1 round in 20 (it was 1 in 4), so 20
    // rounds alone left none in about 1 run in 3.
    let rounds = 5 * common::kill_trials() as u64;
    // Rounds whose kill came after some but not all files of that round
    // were done (the kill met work under way, not an idle daemon); the
    // delay bound adapts so that most kills do.
    let mut mid_work = 0;
    let mut delay = KillDelay::new(400, 2, 2000); // ms
    for round in 0..rounds {
        for k in 0..25u64 {
            let rel = PathBuf::from(format!("r{round}/f{k}"));
            let size = match rng.below(4) {
                0 => 0,
                1 => rng.below(4096) as usize,
                2 => rng.below(256 << 10) as usize,
                _ => rng.below(3 << 20) as usize,
            };
            let data = bytes(size, round * 100 + k + 1);
            write_file(&s.src().join(&rel), &data);
            want.insert(rel, data);
        }
        let mut child = s.start(
            round as usize,
            &["--delete-plaintext", "--workers", "2"],
            false,
        );
        std::thread::sleep(Duration::from_millis(delay.pick(&mut rng)));
        child.kill().expect("kill -9");
        child.wait().expect("wait");
        // Never neither: each source is still there or has a ciphertext
        // under its final name.
        for rel in want.keys() {
            let mut ct = s.dest().join(rel).into_os_string();
            ct.push(".tpmc");
            assert!(
                s.src().join(rel).exists() || Path::new(&ct).exists(),
                "round {round}: {} is neither in SRC nor in DEST",
                rel.display()
            );
        }
        let done = (0..25)
            .filter(|k| !s.src().join(format!("r{round}/f{k}")).exists())
            .count();
        match done {
            25 => delay.finished(),
            0 => delay.not_begun(),
            _ => mid_work += 1,
        }
    }
    println!(
        "watch kill -9: {rounds} rounds of 25 files, {mid_work} killed with part of their \
         round done, last delay bound {} ms",
        delay.bound
    );
    assert!(mid_work > 0, "no kill met work under way");
    // A last, clean run finishes the job.
    let child = s.start(99, &["--delete-plaintext"], true);
    wait_for("SRC to be emptied", Duration::from_secs(60), || {
        walk(&s.src()).is_empty()
    });
    assert_eq!(stop(child), 0, "{}", s.log(99));
    // No temporaries left, nothing partial under a final name: every .tpmc
    // decrypts, to exactly its source.
    let leftovers: Vec<_> = walk(&s.dest())
        .into_iter()
        .filter(|p| p.to_string_lossy().contains(PARTIAL_MARKER))
        .collect();
    assert!(leftovers.is_empty(), "leftover temporaries: {leftovers:?}");
    let got = s.decrypt_all();
    for (rel, data) in &want {
        assert_eq!(got.get(rel), Some(data), "{}", rel.display());
    }
    // Nothing else: a kill between a replacement's journal record and its
    // rename once left a second version, byte for byte the first
    // (`a_kill_between_a_replacements_record_and_its_rename_adds_no_version`).
    let extra: Vec<_> = got.keys().filter(|p| !want.contains_key(*p)).collect();
    assert!(extra.is_empty(), "not sources: {extra:?}");
}

#[test]
fn restart_does_not_encrypt_unchanged_files_again() {
    let s = Scratch::new();
    for i in 0..50u64 {
        write_file(&s.src().join(format!("d/f{i}")), &bytes(1000, i));
    }
    let child = s.start(0, &[], true);
    wait_for("50 ciphertexts", Duration::from_secs(30), || {
        ciphertexts(&s.dest()) == 50
    });
    assert_eq!(stop(child), 0);
    let mtimes = |s: &Scratch| -> HashMap<PathBuf, std::time::SystemTime> {
        walk(&s.dest())
            .into_iter()
            .filter(|p| p.to_string_lossy().ends_with(".tpmc"))
            .map(|p| {
                let m = fs::metadata(&p).expect("meta").modified().expect("mtime");
                (p, m)
            })
            .collect()
    };
    let before = mtimes(&s);
    // One file changes while the daemon is down.
    std::thread::sleep(Duration::from_millis(20));
    write_file(&s.src().join("d/f7"), b"changed while down");
    let child = s.start(1, &[], true);
    wait_for("f7 to be encrypted again", Duration::from_secs(30), || {
        s.stats()["files"] == 1
    });
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(stop(child), 0);
    let st = s.stats();
    assert_eq!(st["files"], 1, "{st}");
    assert_eq!(st["unchanged"], 49, "{st}");
    let after = mtimes(&s);
    for (p, m) in &before {
        if p.ends_with("f7.tpmc") {
            assert_ne!(after[p], *m);
        } else {
            assert_eq!(after[p], *m, "{} was rewritten", p.display());
        }
    }
    assert!(s.log(1).contains("49 already encrypted"), "{}", s.log(1));
    let got = s.decrypt_all();
    assert_eq!(got[Path::new("d/f7")], b"changed while down");
}

#[test]
fn symlinks_are_never_followed() {
    let s = Scratch::new();
    let outside = s.path().join("outside");
    fs::create_dir(&outside).expect("mkdir");
    fs::write(outside.join("secret"), b"not for SRC").expect("write");
    symlink(outside.join("secret"), s.src().join("link")).expect("symlink");
    symlink(&outside, s.src().join("dirlink")).expect("symlink");
    fs::write(s.src().join("plain"), b"plain").expect("write");
    let child = s.start(0, &[], true);
    // One more, created while running.
    symlink(outside.join("secret"), s.src().join("late-link")).expect("symlink");
    std::thread::sleep(Duration::from_millis(400));
    fs::write(s.src().join("plain2"), b"plain2").expect("write");
    wait_for("plain2", Duration::from_secs(10), || {
        s.dest().join("plain2.tpmc").exists()
    });
    assert_eq!(stop(child), 0);
    let log = s.log(0);
    for name in ["link", "dirlink", "late-link"] {
        assert!(
            log.contains(&format!("skipping {name}: symlink")),
            "{name} not logged: {log}"
        );
        assert!(!s.dest().join(format!("{name}.tpmc")).exists());
    }
    assert!(!s.dest().join("dirlink").exists());
    let got = s.decrypt_all();
    assert_eq!(got.len(), 2);
    assert_eq!(
        fs::read(outside.join("secret")).expect("read"),
        b"not for SRC"
    );
}

#[test]
fn dest_inside_src_is_refused() {
    let s = Scratch::new();
    for dest in ["src/enc", "src", "src/a/../b"] {
        let r = run(
            s.path(),
            &["watch", "src", "--out", dest, "-R", &s.recipient],
        );
        assert_eq!(r.code, 2, "{dest}: {}", r.stderr);
        assert!(r.stderr.contains("inside SRC"), "{}", r.stderr);
    }
    assert!(!s.src().join("enc").exists());
    // Through a symlink too.
    symlink(s.src(), s.path().join("alias")).expect("symlink");
    let r = run(
        s.path(),
        &["watch", "src", "--out", "alias/x", "-R", &s.recipient],
    );
    assert_eq!(r.code, 2, "{}", r.stderr);
    // And without any recipient it is a usage error.
    let r = run(s.path(), &["watch", "src", "--out", "dest"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
}

#[test]
fn read_only_dest_is_reported() {
    use std::os::unix::process::CommandExt;
    let s = Scratch::new();
    fs::create_dir(s.dest()).expect("mkdir");
    fs::create_dir_all(s.src()).expect("mkdir src");
    fs::set_permissions(s.dest(), fs::Permissions::from_mode(0o555)).expect("chmod");
    let dest = s.dest();
    let mut cmd = tpmcrypt(s.path());
    cmd.args([
        "watch",
        "src",
        "--out",
        dest.to_str().expect("utf8"),
        "-R",
        &s.recipient,
    ]);
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        // Root ignores permissions: run the daemon as an unprivileged uid,
        // for which the 0555 DEST really is read-only.
        fs::set_permissions(s.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
        cmd.uid(65534).gid(65534);
    }
    let r: common::Run = cmd.output().expect("spawn watch").into();
    let _ = fs::set_permissions(s.dest(), fs::Permissions::from_mode(0o755));
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(r.stderr.starts_with("error: "), "{}", r.stderr);
    assert!(r.stderr.contains("not writable"), "{}", r.stderr);
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
}

#[test]
fn sigterm_finishes_in_flight_files() {
    let s = Scratch::new();
    let child = s.start(0, &["--settle", "0ms"], true);
    let data = bytes(96 << 20, 5);
    fs::write(s.src().join("inflight"), &data).expect("write");
    // Wait until its temporary exists: it is being encrypted.
    wait_for("encryption to start", Duration::from_secs(20), || {
        walk(&s.dest())
            .iter()
            .any(|p| p.to_string_lossy().contains(PARTIAL_MARKER))
            || s.dest().join("inflight.tpmc").exists()
    });
    let code = stop(child);
    assert_eq!(code, 0, "{}", s.log(0));
    assert!(s.dest().join("inflight.tpmc").exists(), "{}", s.log(0));
    assert!(walk(&s.dest())
        .iter()
        .all(|p| !p.to_string_lossy().contains(PARTIAL_MARKER)));
    let got = s.decrypt_all();
    assert!(got[Path::new("inflight")] == data);
    assert!(s.log(0).contains("stopping"), "{}", s.log(0));
}

#[test]
fn delete_plaintext_removes_only_verified_sources() {
    let s = Scratch::new();
    for i in 0..20u64 {
        write_file(&s.src().join(format!("f{i}")), &bytes(5000 + i as usize, i));
    }
    let child = s.start(0, &["--delete-plaintext"], true);
    // A file held open by a writer is neither encrypted nor removed.
    let mut open = fs::File::create(s.src().join("open")).expect("create");
    open.write_all(b"still being written").expect("write");
    wait_for("the 20 sources to go", Duration::from_secs(30), || {
        (0..20).all(|i| !s.src().join(format!("f{i}")).exists())
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(s.src().join("open").exists());
    assert!(!s.dest().join("open.tpmc").exists());
    drop(open);
    wait_for("the open file to go", Duration::from_secs(10), || {
        !s.src().join("open").exists()
    });
    assert_eq!(stop(child), 0);
    let st = s.stats();
    assert_eq!(st["deleted"], 21, "{st}");
    let got = s.decrypt_all();
    for i in 0..20u64 {
        assert_eq!(
            got[&PathBuf::from(format!("f{i}"))],
            bytes(5000 + i as usize, i)
        );
    }
    assert_eq!(got[Path::new("open")], b"still being written");
}

/// Under --delete-plaintext a source with another hard link is encrypted
/// but kept (removing one name would leave the plaintext under the other),
/// with a warning, and not encrypted again while unchanged.
#[test]
fn delete_plaintext_keeps_hard_linked_sources() {
    let s = Scratch::new();
    write_file(&s.src().join("linked"), b"two names");
    fs::hard_link(s.src().join("linked"), s.path().join("elsewhere")).expect("link");
    write_file(&s.src().join("single"), b"one name");
    let child = s.start(0, &["--delete-plaintext"], true);
    wait_for("single to go", Duration::from_secs(30), || {
        !s.src().join("single").exists() && s.dest().join("linked.tpmc").exists()
    });
    // Time for any repeated encryption to show in the counters.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(stop(child), 0);
    assert_eq!(fs::read(s.src().join("linked")).unwrap(), b"two names");
    assert!(
        s.log(0).contains("linked: kept: it has 2 hard links"),
        "{}",
        s.log(0)
    );
    let st = s.stats();
    assert_eq!(
        (st["files"].as_u64(), st["deleted"].as_u64()),
        (Some(2), Some(1)),
        "{st}"
    );
    let got = s.decrypt_all();
    assert_eq!(got[Path::new("linked")], b"two names");
    assert_eq!(got[Path::new("single")], b"one name");
}

#[test]
fn metrics_sighup_and_rotation() {
    let s = Scratch::new();
    // A non-loopback address is refused.
    refused_at_start(&s, "--metrics", "0.0.0.0:9464", "non-loopback");

    // A port the kernel just found free (one derived from the PID could be
    // any other process's, e.g. another test's swtpm: "Address in use").
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let logfile = s.path().join("daemon.log");
    let child = s.start(
        0,
        &[
            "--metrics",
            &addr,
            "--log",
            logfile.to_str().expect("utf8"),
            "--rotate",
            "1s",
        ],
        true,
    );
    fs::write(s.src().join("a"), b"a").expect("write");
    wait_for("a.tpmc", Duration::from_secs(10), || {
        s.dest().join("a.tpmc").exists()
    });
    let fetch = || {
        let mut conn = std::net::TcpStream::connect(&addr).expect("connect to metrics");
        conn.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")
            .expect("send");
        let mut body = String::new();
        conn.read_to_string(&mut body).expect("read");
        body
    };
    // a.tpmc has its name a moment before the daemon counts it.
    wait_for("the metrics to count a", Duration::from_secs(10), || {
        fetch().contains("tpmcrypt_watch_files_total 1")
    });
    let body = fetch();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert!(body.contains("tpmcrypt_watch_files_total 1"), "{body}");
    assert!(
        body.contains("tpmcrypt_watch_latency_seconds{quantile=\"0.99\"}"),
        "{body}"
    );
    // logrotate: move the log away, SIGHUP, a new file appears.
    fs::rename(&logfile, s.path().join("daemon.log.1")).expect("rename");
    signal(&child, libc::SIGHUP);
    wait_for("the log to be reopened", Duration::from_secs(5), || {
        fs::read_to_string(&logfile)
            .map(|l| l.contains("reopened"))
            .unwrap_or(false)
    });
    // Rotation: a file after a rotation belongs to another session.
    std::thread::sleep(Duration::from_millis(1300));
    fs::write(s.src().join("b"), b"b").expect("write");
    wait_for("b.tpmc", Duration::from_secs(10), || {
        s.dest().join("b.tpmc").exists()
    });
    assert_eq!(stop(child), 0);
    let session = |name: &str| -> String {
        let r = run(s.path(), &["inspect", "--json", &format!("dest/{name}")]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let v: Value = serde_json::from_slice(&r.stdout).expect("json");
        v["session_id"].to_string()
    };
    assert_ne!(session("a.tpmc"), session("b.tpmc"));
    let log = fs::read_to_string(s.path().join("daemon.log.1")).expect("old log");
    assert!(log.contains("INFO tpmcrypt::watch"), "{log}");
    assert!(s.stats()["sessions"].as_u64().unwrap_or(0) >= 2);
}

/// An unreadable file is reported and retried with backoff, never dropped:
/// the daemon runs as an unprivileged uid, a root-only file appears, and
/// once it is made readable it is encrypted.
#[test]
fn unreadable_files_are_reported_and_retried() {
    use std::os::unix::process::CommandExt;
    const NOBODY: u32 = 65534;
    let s = Scratch::new();
    let chown = |p: &Path| {
        let c = std::ffi::CString::new(p.to_str().expect("utf8")).expect("cstring");
        // SAFETY: a valid NUL-terminated path.
        let rc = unsafe { libc::chown(c.as_ptr(), NOBODY, NOBODY) };
        assert_eq!(rc, 0, "chown {} (the tests run as root)", p.display());
    };
    fs::set_permissions(s.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    for d in [s.src(), s.dest()] {
        fs::create_dir_all(&d).expect("mkdir");
        chown(&d);
    }
    let log_path = s.path().join("log.nobody");
    let log = fs::File::create(&log_path).expect("log");
    let mut child = tpmcrypt(s.path())
        .args(["watch", s.src().to_str().expect("utf8"), "--out"])
        .arg(s.dest())
        .args(["-R", &s.recipient, "--settle", "20ms"])
        .env_remove("NOTIFY_SOCKET")
        .uid(NOBODY)
        .gid(NOBODY)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn watch as nobody");
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        child.try_wait().expect("try_wait").is_none(),
        "{}",
        fs::read_to_string(&log_path).unwrap_or_default()
    );

    let secret = s.src().join("secret");
    let data = bytes(5000, 77);
    // Written under another name, then renamed in: the daemon sees a
    // complete file it cannot open.
    let staging = s.path().join("staging");
    fs::write(&staging, &data).expect("write");
    fs::set_permissions(&staging, fs::Permissions::from_mode(0o600)).expect("chmod 600");
    fs::rename(&staging, &secret).expect("rename into SRC");
    let ct = s.dest().join("secret.tpmc");
    wait_for(
        "the unreadable file to be reported",
        Duration::from_secs(20),
        || {
            fs::read_to_string(&log_path)
                .unwrap_or_default()
                .contains("secret")
        },
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(!ct.exists(), "nothing written for an unreadable file");
    assert!(secret.exists(), "the source is never dropped");

    fs::set_permissions(&secret, fs::Permissions::from_mode(0o644)).expect("chmod 644");
    wait_for(
        "the retried file to be encrypted",
        Duration::from_secs(60),
        || ct.exists(),
    );
    assert_eq!(stop(child), 0);
    let got = s.decrypt_all();
    assert_eq!(got[&PathBuf::from("secret")], data);
    let log = fs::read_to_string(&log_path).expect("log");
    assert!(
        log.lines()
            .any(|l| l.contains("secret") && (l.contains("ermission") || l.contains("retry"))),
        "the failure is reported: {log}"
    );
}

/// The systemd unit in dist/systemd/ is valid for systemd (`systemd-analyze verify`,
/// with ExecStart pointing at the binary under test), keeps its hardening
/// (`systemd-analyze security` exposure at most 2.0 of 10; it is 1.7), and every flag
/// its ExecStart passes exists in `tpmcrypt watch --help`.
#[test]
fn systemd_unit_verifies_and_its_flags_exist() {
    let dir = common::scratch("unit");
    let unit_src =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../dist/systemd/tpmcrypt-watch.service");
    let text = fs::read_to_string(&unit_src).unwrap();
    assert!(
        text.contains("ExecStart=/usr/bin/tpmcrypt watch"),
        "ExecStart moved?"
    );
    let unit = dir.path().join("tpmcrypt-watch.service");
    let bin = common::bin();
    fs::write(
        &unit,
        text.replace("/usr/bin/tpmcrypt", &bin.display().to_string()),
    )
    .unwrap();

    let out = std::process::Command::new("systemd-analyze")
        .arg("verify")
        .arg(&unit)
        .output()
        .expect("systemd-analyze (package systemd, installed by scripts/setup-deps)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.trim().is_empty(),
        "verify: {stderr}"
    );

    let out = std::process::Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--threshold=20", "--no-pager"])
        .arg(&unit)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "exposure above 2.0: {}",
        report.lines().last().unwrap_or_default()
    );

    let help = run(dir.path(), &["watch", "--help"]);
    assert_eq!(help.code, 0);
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    let exec: String = text
        .split("ExecStart=")
        .nth(1)
        .unwrap()
        .lines()
        .take_while(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join(" ");
    let flags: Vec<&str> = exec
        .split_whitespace()
        .filter(|w| w.starts_with("--"))
        .collect();
    assert!(flags.len() >= 4, "{exec}");
    for flag in flags {
        assert!(
            help.contains(flag),
            "ExecStart passes {flag}, unknown to watch"
        );
    }
}

// ------------------------------------------- versions (never replace a lost plaintext)

impl Scratch {
    /// Decrypts one ciphertext in this process with the identity `id`.
    fn decrypt_one(&self, ct: &Path) -> Vec<u8> {
        let id = fs::read_to_string(self.path().join("id")).expect("identity");
        common::decrypt_in_process(&id, ct)
    }
}

/// The name of version `n` of `name` in DEST: `NAME.tpmc`, then
/// `NAME.vN.tpmc` (as docs/watch.md documents).
fn version_name(name: &str, n: usize) -> String {
    if n == 1 {
        format!("{name}.tpmc")
    } else {
        format!("{name}.v{n}.tpmc")
    }
}

/// Uploads `contents` one after the other as SRC/`name`: each is written
/// outside SRC and renamed in once the previous upload is gone (taken by
/// the daemon), as an uploader that never overwrites would.
fn upload_in_turn(s: &Scratch, name: &str, contents: &[Vec<u8>]) {
    let target = s.src().join(name);
    for (i, data) in contents.iter().enumerate() {
        let staging = s.path().join(format!("staging.{name}.{i}"));
        fs::write(&staging, data).expect("write staging");
        wait_for(
            "the previous upload to be taken",
            Duration::from_secs(60),
            || !target.exists(),
        );
        fs::rename(&staging, &target).expect("rename into SRC");
    }
}

/// Under --delete-plaintext a name that comes back (a second upload of
/// `report.txt`, a log appended to after it was taken) never replaces the
/// ciphertext of the earlier one, whose plaintext is gone: every version
/// is kept, numbered in arrival order, and decrypts to what was uploaded.
#[test]
fn delete_plaintext_keeps_every_version_of_a_repeated_name() {
    const UPLOADS: usize = 40;
    const APPENDS: usize = 25;
    let s = Scratch::new();
    let child = s.start(0, &["--delete-plaintext", "--settle", "20ms"], true);
    let contents: Vec<Vec<u8>> = (0..UPLOADS)
        .map(|i| {
            let mut d = format!("upload {i}\n").into_bytes();
            d.extend(bytes(i * 997 % 20_000, i as u64 + 1));
            d
        })
        .collect();
    // An appending writer at the same time: each line is appended with
    // open/append/close, sometimes to a file the daemon has just taken.
    let log_path = s.src().join("app.log");
    let appender = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for j in 0..APPENDS {
            let line = format!("line {j:03} of the log\n");
            let mut f = fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log_path)
                .expect("open log");
            f.write_all(line.as_bytes()).expect("append");
            drop(f);
            lines.extend_from_slice(line.as_bytes());
            std::thread::sleep(Duration::from_millis(if j % 3 == 0 { 5 } else { 60 }));
        }
        lines
    });
    upload_in_turn(&s, "report.txt", &contents);
    let lines = appender.join().expect("appender");
    wait_for("SRC to be emptied", Duration::from_secs(60), || {
        walk(&s.src()).is_empty()
    });
    assert_eq!(stop(child), 0, "{}", s.log(0));

    // Every upload, in order, under its version name.
    for (i, data) in contents.iter().enumerate() {
        let ct = s.dest().join(version_name("report.txt", i + 1));
        assert!(
            ct.exists(),
            "{} missing: {:?}",
            ct.display(),
            walk(&s.dest())
        );
        assert_eq!(&s.decrypt_one(&ct), data, "version {}", i + 1);
    }
    assert!(!s
        .dest()
        .join(version_name("report.txt", UPLOADS + 1))
        .exists());
    // The log's versions, in order, hold every line exactly once.
    let mut joined = Vec::new();
    let mut n = 1;
    loop {
        let ct = s.dest().join(version_name("app.log", n));
        if !ct.exists() {
            break;
        }
        joined.extend(s.decrypt_one(&ct));
        n += 1;
    }
    assert!(
        n > 2,
        "the log was taken only once: the test proved nothing"
    );
    assert_eq!(
        String::from_utf8_lossy(&joined),
        String::from_utf8_lossy(&lines)
    );
    let st = s.stats();
    assert_eq!(st["failures"], 0, "{st}\n{}", s.log(0));
    assert_eq!(
        st["deleted"].as_u64(),
        Some((UPLOADS + n - 1) as u64),
        "{st}"
    );
}

/// kill -9 while versions of one name keep arriving: after a clean last
/// run, every upload survives as exactly one version, in arrival order.
#[test]
fn kill_9_while_versions_arrive_loses_none() {
    const UPLOADS: usize = 30;
    let s = Scratch::new();
    let contents: Vec<Vec<u8>> = (0..UPLOADS)
        .map(|i| {
            let mut d = format!("upload {i}\n").into_bytes();
            d.extend(bytes(i * 7919 % 200_000, 100 + i as u64));
            d
        })
        .collect();
    let uploader = {
        let want = contents.clone();
        let src = s.src();
        let staging_dir = s.path().to_path_buf();
        std::thread::spawn(move || {
            let target = src.join("report.txt");
            for (i, data) in want.iter().enumerate() {
                let staging = staging_dir.join(format!("staging.{i}"));
                fs::write(&staging, data).expect("write staging");
                let deadline = Instant::now() + Duration::from_secs(120);
                while target.exists() {
                    assert!(Instant::now() < deadline, "upload {i} never taken");
                    std::thread::sleep(Duration::from_millis(2));
                }
                fs::rename(&staging, &target).expect("rename into SRC");
            }
        })
    };
    let mut rng = Rng(0x51ed_270b_2c3f_9a1d);
    for round in 0..6 {
        let mut child = s.start(round, &["--delete-plaintext", "--settle", "10ms"], false);
        std::thread::sleep(Duration::from_millis(100 + rng.below(400)));
        child.kill().expect("kill -9");
        child.wait().expect("wait");
    }
    let before = ciphertexts(&s.dest());
    println!("versions of report.txt before the last run: {before}");
    assert!(before > 0, "no kill met work under way");
    let child = s.start(9, &["--delete-plaintext", "--settle", "10ms"], true);
    uploader.join().expect("uploader");
    wait_for("SRC to be emptied", Duration::from_secs(60), || {
        walk(&s.src()).is_empty()
    });
    assert_eq!(stop(child), 0, "{}", s.log(9));
    let mut got = Vec::new();
    for n in 1.. {
        let ct = s.dest().join(version_name("report.txt", n));
        if !ct.exists() {
            break;
        }
        got.push(s.decrypt_one(&ct));
    }
    assert_eq!(
        ciphertexts(&s.dest()),
        got.len(),
        "versions are numbered without gaps"
    );
    // A kill between a ciphertext and the removal of its source does not
    // add a duplicate either: the journal knew whose ciphertext it was.
    assert_eq!(got.len(), UPLOADS, "every upload, once");
    assert!(
        got == contents,
        "versions differ from the uploads, or are out of order"
    );
}

/// A directory moved out of SRC while the daemon runs takes its files'
/// journal records with it on disk too: a file of the same name made
/// there while the daemon is stopped is a newcomer at the next start, and
/// the gone file's ciphertext is never replaced by it. (The records used
/// to be dropped in memory only, and a restart trusted them again.)
#[test]
fn a_directory_moved_out_keeps_its_ciphertexts_after_a_restart() {
    let s = Scratch::new();
    let child = s.start_env(0, &[], true, &[], None, &[("TPMCRYPT_LOG", "debug")]);
    let dir = s.src().join("d");
    let a_ct = s.dest().join("d/a.tpmc");
    write_file(&dir.join("a"), b"a, the first");
    write_file(&dir.join("b"), b"b, the first");
    wait_for("d/a.tpmc and d/b.tpmc", Duration::from_secs(10), || {
        a_ct.exists() && s.dest().join("d/b.tpmc").exists()
    });
    std::thread::sleep(Duration::from_millis(100));
    // Moved out of SRC: one event for the directory, none for its files.
    fs::rename(&dir, s.path().join("d-elsewhere")).expect("mv d out of SRC");
    // Stopped once the daemon has seen it go (a stop drops events not yet
    // handled, as a crash would lose them).
    wait_for("d's records dropped", Duration::from_secs(30), || {
        s.log(0).contains("d went: its records are dropped")
    });
    assert_eq!(stop(child), 0, "{}", s.log(0));
    // While it is stopped: a new d/a.
    write_file(&dir.join("a"), b"a, a newcomer");
    let child = s.start(1, &[], true);
    let a2 = s.dest().join(format!("d/{}", version_name("a", 2)));
    wait_for("the newcomer's ciphertext", Duration::from_secs(10), || {
        s.stats()["files"] == 1
    });
    assert_eq!(stop(child), 0, "{}", s.log(1));
    assert_eq!(
        s.decrypt_one(&a_ct),
        b"a, the first",
        "the gone file's ciphertext was replaced"
    );
    assert_eq!(s.decrypt_one(&a2), b"a, a newcomer");
}

/// A directory moved out of SRC and back, unchanged, is recognised: its
/// files are the very ones encrypted (same inode, size and mtime, and
/// their ciphertexts in place), so no version is added for them.
#[test]
fn a_directory_moved_out_and_back_is_not_encrypted_again() {
    let s = Scratch::new();
    let child = s.start(0, &[], true);
    let dir = s.src().join("d");
    write_file(&dir.join("f"), b"f");
    write_file(&dir.join("sub/g"), b"g");
    wait_for("d's ciphertexts", Duration::from_secs(10), || {
        s.dest().join("d/f.tpmc").exists() && s.dest().join("d/sub/g.tpmc").exists()
    });
    std::thread::sleep(Duration::from_millis(100));
    let out = s.path().join("d-out");
    fs::rename(&dir, &out).expect("mv d out");
    std::thread::sleep(Duration::from_millis(300));
    fs::rename(&out, &dir).expect("mv d back");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(stop(child), 0, "{}", s.log(0));
    assert_eq!(ciphertexts(&s.dest()), 2, "{:?}", walk(&s.dest()));
    assert_eq!(s.stats()["files"], 2, "encrypted again");
}

/// Without --delete-plaintext, a source removed while its job is in flight
/// is gone: a new file of the same name that the job then opens is a
/// newcomer, and the removed source's ciphertext, the only copy of its
/// plaintext, is never replaced by it. (The job used to carry the record
/// as it was when dispatched, and replaced it.)
#[test]
fn a_source_removed_while_in_flight_keeps_its_ciphertext() {
    let s = Scratch::new();
    let child = s.start_paused(0, &[], "a:1500");
    let a = s.src().join("a");
    let ct = s.dest().join("a.tpmc");
    write_file(&a, b"the old a");
    wait_for("a.tpmc", Duration::from_secs(30), || ct.exists());
    wait_for("the first job's end", Duration::from_secs(30), || {
        s.stats()["files"] == 1
    });
    // A job for a (opened for writing, unchanged), held before it opens
    // the file; meanwhile a is removed and a newcomer takes its name.
    drop(
        fs::OpenOptions::new()
            .append(true)
            .open(&a)
            .expect("open a"),
    );
    held(&s, 0, "a", 2);
    fs::remove_file(&a).expect("rm a");
    write_file(&a, b"a newcomer");
    let a2 = s.dest().join(version_name("a", 2));
    wait_for("the newcomer's encryption", Duration::from_secs(30), || {
        s.stats()["files"] == 2
    });
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(stop(child), 0, "{}", s.log(0));
    assert_eq!(
        s.decrypt_one(&ct),
        b"the old a",
        "the gone a's ciphertext was replaced"
    );
    assert_eq!(s.decrypt_one(&a2), b"a newcomer");
    assert_eq!(ciphertexts(&s.dest()), 2, "{:?}", walk(&s.dest()));
}

/// A removal's journal line is handed to the kernel at once: a kill -9
/// right after the daemon forgot a removed source leaves no record for a
/// newcomer of that name to take as its own, so the gone file's ciphertext
/// stays. (The line used to wait in a buffer until the loop's next turn.)
#[test]
fn a_kill_right_after_a_removal_keeps_the_gone_files_ciphertext() {
    let s = Scratch::new();
    let a = s.src().join("a");
    let ct = s.dest().join("a.tpmc");
    let child = s.start_env(
        0,
        &[],
        true,
        &[],
        None,
        &[("TPMCRYPT_WATCH_TEST_CRASH_AT", "forgotten")],
    );
    write_file(&a, b"the old a");
    wait_for("a's encryption", Duration::from_secs(30), || {
        fs::read(s.path().join("stats.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .is_some_and(|v| v["files"] == 1)
    });
    fs::remove_file(&a).expect("rm a");
    self_killed(&s, child, 0, "forgotten");
    write_file(&a, b"a newcomer");
    let child = s.start(1, &[], true);
    let a2 = s.dest().join(version_name("a", 2));
    wait_for("the newcomer's encryption", Duration::from_secs(30), || {
        a2.exists() || s.decrypt_one(&ct) != b"the old a"
    });
    assert_eq!(stop(child), 0, "{}", s.log(1));
    assert_eq!(
        s.decrypt_one(&ct),
        b"the old a",
        "the gone a's ciphertext was replaced"
    );
    assert_eq!(s.decrypt_one(&a2), b"a newcomer");
}

/// Without --delete-plaintext DEST mirrors SRC: the ciphertext of a source
/// still in SRC follows its edits. But a ciphertext whose source is gone
/// (removed, or taken by an earlier --delete-plaintext run) is never
/// replaced by a newcomer of the same name.
#[test]
fn a_ciphertext_whose_plaintext_is_gone_is_never_replaced() {
    let s = Scratch::new();
    let child = s.start(0, &[], true);
    let a = s.src().join("a");
    let a_ct = s.dest().join("a.tpmc");
    fs::write(&a, b"a, first").expect("write");
    wait_for("a.tpmc", Duration::from_secs(10), || a_ct.exists());
    // An edit: the mirror follows.
    std::thread::sleep(Duration::from_millis(100));
    fs::write(&a, b"a, edited").expect("write");
    wait_for("a.tpmc to follow the edit", Duration::from_secs(10), || {
        fs::read(s.path().join("stats.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .is_some_and(|v| v["files"] == 2)
    });
    assert_eq!(s.decrypt_one(&a_ct), b"a, edited");
    // Removed, then a new file of the same name: a second version.
    fs::remove_file(&a).expect("rm");
    std::thread::sleep(Duration::from_millis(300));
    fs::write(&a, b"a, another file").expect("write");
    let a2 = s.dest().join(version_name("a", 2));
    wait_for("a.v2.tpmc", Duration::from_secs(10), || a2.exists());
    assert_eq!(stop(child), 0, "{}", s.log(0));
    assert_eq!(s.decrypt_one(&a_ct), b"a, edited");
    assert_eq!(s.decrypt_one(&a2), b"a, another file");

    // A run with --delete-plaintext takes b; a later run without it finds
    // a new b: b.tpmc, whose plaintext is gone, stays.
    let b = s.src().join("b");
    let b_ct = s.dest().join("b.tpmc");
    fs::write(&b, b"b, deleted after encryption").expect("write");
    let child = s.start(1, &["--delete-plaintext"], true);
    wait_for("b to be taken", Duration::from_secs(10), || !b.exists());
    assert_eq!(stop(child), 0, "{}", s.log(1));
    fs::write(&b, b"b, a newcomer").expect("write");
    let child = s.start(2, &[], true);
    let b2 = s.dest().join(version_name("b", 2));
    wait_for("b.v2.tpmc", Duration::from_secs(10), || b2.exists());
    assert_eq!(stop(child), 0, "{}", s.log(2));
    assert_eq!(s.decrypt_one(&b_ct), b"b, deleted after encryption");
    assert_eq!(s.decrypt_one(&b2), b"b, a newcomer");
    // The untouched ones were not encrypted again on restart.
    assert_eq!(s.decrypt_one(&a_ct), b"a, edited");
    assert_eq!(ciphertexts(&s.dest()), 4, "{:?}", walk(&s.dest()));
}

/// A source whose name looks like a temporary's
/// (`NAME.tpmcrypt-partial.PID.…`) is a file like any other: its ciphertext
/// is not taken for a crash leftover and removed at the next start.
#[test]
fn a_source_named_like_a_temporary_survives_a_restart() {
    let s = Scratch::new();
    let name = format!("notes{PARTIAL_MARKER}2147483646.txt");
    fs::write(s.src().join(&name), b"not a leftover").expect("write");
    let child = s.start(0, &["--delete-plaintext"], true);
    let ct = s.dest().join(format!("{name}.tpmc"));
    wait_for("the source to be taken", Duration::from_secs(10), || {
        !s.src().join(&name).exists()
    });
    assert_eq!(stop(child), 0, "{}", s.log(0));
    assert!(ct.exists());
    let child = s.start(1, &["--delete-plaintext"], true);
    assert_eq!(stop(child), 0, "{}", s.log(1));
    assert!(
        ct.exists(),
        "the ciphertext was removed as a leftover: {}",
        s.log(1)
    );
    assert_eq!(s.decrypt_one(&ct), b"not a leftover");
}

// ------------------------------------------------- SRC, DEST and the lock

/// Waits (at most 10 s) for the daemon to exit on its own; its exit code.
fn exits_by_itself(mut child: Child, log: impl Fn() -> String) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(st) = child.try_wait().expect("wait") {
            return st.code().unwrap_or(-1);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the daemon kept running: {}", log());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SRC removed and recreated, or moved away: the daemon would watch a
/// directory that is no longer SRC. It stops with an error and a non-zero
/// exit (systemd restarts it on the new SRC); a restart takes what landed.
#[test]
fn src_removed_recreated_or_moved_stops_the_daemon() {
    for how in ["recreated", "moved"] {
        let s = Scratch::new();
        let child = s.start(0, &[], true);
        fs::write(s.src().join("before"), b"before").expect("write");
        wait_for("before.tpmc", Duration::from_secs(10), || {
            s.dest().join("before.tpmc").exists()
        });
        match how {
            "recreated" => fs::remove_dir_all(s.src()).expect("rm SRC"),
            _ => fs::rename(s.src(), s.path().join("src.old")).expect("mv SRC"),
        }
        fs::create_dir(s.src()).expect("mkdir SRC");
        fs::write(s.src().join("after"), b"after").expect("write");
        let code = exits_by_itself(child, || s.log(0));
        let log = s.log(0);
        assert_eq!(code, 1, "{how}: {log}");
        assert!(log.contains("error: "), "{how}: {log}");
        assert!(log.contains("SRC"), "{how}: {log}");
        assert!(!s.dest().join("after.tpmc").exists(), "{how}");
        // The restarted daemon watches the new SRC.
        let child = s.start(1, &[], true);
        wait_for("after.tpmc", Duration::from_secs(10), || {
            s.dest().join("after.tpmc").exists()
        });
        assert_eq!(stop(child), 0, "{}", s.log(1));
    }
}

/// DEST removed: it is not recreated behind the operator's back (with a
/// fresh state directory, so without the lock a second daemon could take
/// it); the daemon stops with an error, non-zero, and keeps the plaintext.
#[test]
fn dest_removed_stops_the_daemon_and_is_not_recreated() {
    let s = Scratch::new();
    let child = s.start(0, &["--delete-plaintext"], true);
    fs::write(s.src().join("one"), b"one").expect("write");
    wait_for("one to be taken", Duration::from_secs(10), || {
        !s.src().join("one").exists()
    });
    fs::remove_dir_all(s.dest()).expect("rm DEST");
    fs::write(s.src().join("two"), b"two").expect("write");
    let code = exits_by_itself(child, || s.log(0));
    let log = s.log(0);
    assert_eq!(code, 1, "{log}");
    assert!(log.contains("error: ") && log.contains("DEST"), "{log}");
    assert!(!s.dest().exists(), "DEST was recreated: {log}");
    assert_eq!(fs::read(s.src().join("two")).expect("two kept"), b"two");
}

/// One daemon per DEST: a second one is refused while the first runs, and
/// if the lock file is removed under the first, it stops rather than let a
/// second one in.
#[test]
fn one_daemon_per_dest_even_if_the_lock_goes() {
    let s = Scratch::new();
    let child = s.start(0, &[], true);
    let other_src = s.path().join("src2");
    fs::create_dir(&other_src).expect("mkdir");
    let dest = s.dest();
    let r = run(
        s.path(),
        &[
            "watch",
            "src2",
            "--out",
            dest.to_str().expect("utf8"),
            "-R",
            &s.recipient,
        ],
    );
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(r.stderr.contains("another tpmcrypt watch"), "{}", r.stderr);
    fs::remove_file(s.dest().join(".tpmcrypt-watch/lock")).expect("rm lock");
    let code = exits_by_itself(child, || s.log(0));
    assert_eq!(code, 1, "{}", s.log(0));
    assert!(s.log(0).contains("lock"), "{}", s.log(0));
}

// ------------------------------------------------------- non-UTF-8 names

/// File names are bytes: `caf\xe9.txt` and `caf\xe8.txt` (the same text
/// under a lossy conversion) are both encrypted under their exact byte
/// names, are remembered by the journal across a restart, and the log
/// shows them escaped and distinct.
#[test]
fn non_utf8_names_keep_their_bytes() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let s = Scratch::new();
    let names: [&[u8]; 3] = [b"caf\xe9.txt", b"caf\xe8.txt", b"d\xff/x"];
    for (i, n) in names.iter().enumerate() {
        write_file(
            &s.src().join(OsStr::from_bytes(n)),
            format!("file {i}").as_bytes(),
        );
    }
    let child = s.start(0, &["-v"], true);
    let cts: Vec<PathBuf> = names
        .iter()
        .map(|n| {
            let mut b = n.to_vec();
            b.extend_from_slice(b".tpmc");
            s.dest().join(OsStr::from_bytes(&b))
        })
        .collect();
    wait_for("three ciphertexts", Duration::from_secs(10), || {
        cts.iter().all(|c| c.exists())
    });
    assert_eq!(stop(child), 0, "{}", s.log(0));
    assert_eq!(ciphertexts(&s.dest()), 3, "{:?}", walk(&s.dest()));
    for (i, ct) in cts.iter().enumerate() {
        assert_eq!(s.decrypt_one(ct), format!("file {i}").as_bytes());
    }
    let log = s.log(0);
    for shown in ["caf\\xe9.txt", "caf\\xe8.txt", "d\\xff/x"] {
        assert!(log.contains(shown), "{shown} not in the log: {log}");
    }
    assert!(!log.contains('\u{fffd}'), "lossy name in the log: {log}");
    // The journal kept the exact names: nothing is encrypted again.
    let child = s.start(1, &[], true);
    assert_eq!(stop(child), 0, "{}", s.log(1));
    assert!(s.log(1).contains("3 already encrypted"), "{}", s.log(1));
    // And with --delete-plaintext both sources go, both versions stay.
    let child = s.start(2, &["--delete-plaintext"], true);
    wait_for("SRC to be emptied", Duration::from_secs(10), || {
        walk(&s.src()).is_empty()
    });
    assert_eq!(stop(child), 0, "{}", s.log(2));
    for (i, ct) in cts.iter().enumerate() {
        assert_eq!(s.decrypt_one(ct), format!("file {i}").as_bytes());
    }
}

/// Two daemons with SRC and DEST swapped (or SRC inside another daemon's
/// DEST) would encrypt each other's ciphertext forever, and with
/// --delete-plaintext remove the first one's ciphertexts, journal and
/// lock. A SRC that is, or is inside, the DEST of a watch is refused.
#[test]
fn src_inside_a_watchs_dest_is_refused() {
    let s = Scratch::new();
    let child = s.start(0, &[], true);
    fs::create_dir(s.dest().join("sub")).expect("mkdir");
    for src in ["dest", "dest/sub"] {
        let err = s.path().join("err");
        let second = tpmcrypt(s.path())
            .args(["watch", src, "--out", "other", "-R", &s.recipient])
            .arg("--delete-plaintext")
            .stdout(Stdio::null())
            .stderr(fs::File::create(&err).expect("stderr file"))
            .spawn()
            .expect("spawn");
        let stderr = || fs::read_to_string(&err).unwrap_or_default();
        let code = exits_by_itself(second, stderr);
        assert_eq!(code, 2, "{src}: {}", stderr());
        assert!(
            stderr().contains("the DEST of a tpmcrypt watch"),
            "{}",
            stderr()
        );
        assert_eq!(stderr().lines().count(), 1, "{}", stderr());
    }
    assert!(!s.path().join("other").exists());
    assert_eq!(stop(child), 0, "{}", s.log(0));
    assert!(s.dest().join(".tpmcrypt-watch/lock").exists());
}

/// The lock is in the state directory, but two daemons with the same DEST
/// and different --state-dir would still share DEST: DEST itself is
/// locked too.
#[test]
fn one_daemon_per_dest_whatever_the_state_dir() {
    let s = Scratch::new();
    let state1 = s.path().join("state1");
    let child = s.start(0, &["--state-dir", state1.to_str().expect("utf8")], true);
    let other_src = s.path().join("src2");
    fs::create_dir(&other_src).expect("mkdir");
    let err = s.path().join("err");
    let second = tpmcrypt(s.path())
        .args(["watch", "src2", "--out", "dest", "-R", &s.recipient])
        .args(["--state-dir", "state2"])
        .stdout(Stdio::null())
        .stderr(fs::File::create(&err).expect("stderr file"))
        .spawn()
        .expect("spawn");
    let stderr = || fs::read_to_string(&err).unwrap_or_default();
    let code = exits_by_itself(second, stderr);
    assert_eq!(code, 1, "{}", stderr());
    assert!(stderr().contains("another tpmcrypt watch"), "{}", stderr());
    assert_eq!(stderr().lines().count(), 1, "{}", stderr());
    assert_eq!(stop(child), 0, "{}", s.log(0));
}

/// A directory of DEST swapped for a symlink is never followed: nothing is
/// written where it points, the failure is logged and retried, and the
/// source is kept.
#[test]
fn a_symlink_in_dest_is_never_followed() {
    let s = Scratch::new();
    let outside = s.path().join("outside");
    fs::create_dir(&outside).expect("mkdir");
    fs::create_dir_all(s.dest()).expect("mkdir dest");
    symlink(&outside, s.dest().join("sub")).expect("symlink");
    let child = s.start(0, &["--delete-plaintext"], true);
    write_file(&s.src().join("sub/f"), b"secret");
    wait_for("the failure to be logged", Duration::from_secs(10), || {
        s.log(0).contains("symlink")
    });
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(stop(child), 0, "{}", s.log(0));
    assert!(
        walk(&outside).is_empty(),
        "written through the symlink: {:?}",
        walk(&outside)
    );
    assert_eq!(fs::read(s.src().join("sub/f")).expect("kept"), b"secret");
}

/// An uploader that overwrites report.txt in place while the daemon is
/// verifying the ciphertext of the previous upload: that ciphertext is the
/// only copy of the previous contents, so it is kept, and the new contents
/// become a second version.
#[test]
fn a_source_overwritten_after_its_ciphertext_was_made_keeps_both() {
    let s = Scratch::new();
    let child = s.start(0, &["--delete-plaintext", "--settle", "10ms"], true);
    let first = bytes(96 << 20, 41);
    let second = b"the second upload, written over the first".to_vec();
    let staging = s.path().join("staging");
    fs::write(&staging, &first).expect("write");
    let src = s.src().join("report.txt");
    fs::rename(&staging, &src).expect("rename in");
    let v1 = s.dest().join(version_name("report.txt", 1));
    wait_for("the first ciphertext", Duration::from_secs(60), || {
        v1.exists()
    });
    // Now being verified: overwrite the source in place.
    fs::write(&src, &second).expect("overwrite");
    wait_for("SRC to be emptied", Duration::from_secs(60), || {
        !src.exists()
    });
    assert_eq!(stop(child), 0, "{}", s.log(0));
    let v2 = s.dest().join(version_name("report.txt", 2));
    assert!(
        s.decrypt_one(&v1) == first,
        "the first upload's ciphertext was replaced: {}",
        s.log(0)
    );
    assert_eq!(s.decrypt_one(&v2), second);
}

/// A kill -9 between the journal record of a ciphertext and its rename
/// into place leaves a record for a ciphertext that is not there; an older
/// ciphertext of the same length under that name must not pass for it
/// (the file would never be encrypted again). The record before it still
/// holds for that older ciphertext, which the mirror replaces, as the
/// killed run would have.
#[test]
fn a_record_ahead_of_its_ciphertext_is_not_trusted() {
    use std::os::unix::fs::MetadataExt;
    let s = Scratch::new();
    let p = s.src().join("p");
    fs::write(&p, b"old contents").expect("write");
    let ct = s.dest().join("p.tpmc");
    let child = s.start(0, &[], true);
    wait_for("p.tpmc", Duration::from_secs(10), || ct.exists());
    assert_eq!(stop(child), 0, "{}", s.log(0));
    std::thread::sleep(Duration::from_millis(20));
    fs::write(&p, b"new contents").expect("write"); // same length
                                                    // What the worker had recorded for the new version when it was killed:
                                                    // version 1, of the same length, in a temporary (another inode).
    let m = fs::metadata(&p).expect("stat");
    let old = fs::metadata(&ct).expect("stat ct");
    let line = format!(
        "+ {} {} {} {} {} 1 {}\n",
        m.size(),
        m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
        m.ino(),
        old.len(),
        hex::encode("p"),
        old.ino() + 1
    );
    fs::OpenOptions::new()
        .append(true)
        .open(s.dest().join(".tpmcrypt-watch/journal"))
        .expect("journal")
        .write_all(line.as_bytes())
        .expect("append");
    let child = s.start(1, &[], true);
    wait_for("p to be encrypted again", Duration::from_secs(10), || {
        walk(&s.dest())
            .iter()
            .filter(|c| c.to_string_lossy().ends_with(".tpmc"))
            .any(|c| {
                common::decrypt_in_process(&fs::read_to_string(s.path().join("id")).expect("id"), c)
                    == b"new contents"
            })
    });
    assert_eq!(stop(child), 0, "{}", s.log(1));
    assert_eq!(s.decrypt_one(&ct), b"new contents", "the mirror followed");
    assert_eq!(ciphertexts(&s.dest()), 1, "{:?}", walk(&s.dest()));
}

/// A --stats-json or --log inside SRC would be encrypted again every time
/// it is written (a new version each interval): refused like DEST.
#[test]
fn stats_json_or_log_inside_src_is_refused() {
    let s = Scratch::new();
    for (flag, path) in [
        ("--stats-json", "src/stats.json"),
        ("--stats-json", "src/sub/../stats.json"),
        ("--log", "src/watch.log"),
    ] {
        refused_at_start(&s, flag, path, "inside SRC");
        assert!(!s.dest().exists(), "{flag} {path}: DEST was created");
    }
    assert_eq!(fs::read_dir(s.src()).expect("ls src").count(), 0);
}

/// --stats-json is replaced at every interval, so it must never name what
/// is not figures: a device (as root, `/dev/null` was replaced by a file),
/// a symlink, someone's file. Refused at start, with one line; an empty
/// file and figures of an earlier run are replaced.
#[test]
fn stats_json_replaces_only_figures() {
    let s = Scratch::new();
    let d = s.path();
    let c = std::ffi::CString::new(d.join("null").to_str().expect("utf-8")).expect("c");
    // SAFETY: a valid NUL-terminated path.
    let made = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
    assert_eq!(made, 0, "mknod (needs root, as CI runs the tests)");
    fs::write(d.join("notes.txt"), b"precious").expect("notes");
    std::os::unix::fs::symlink("notes.txt", d.join("link.json")).expect("symlink");
    for (path, why) in [
        ("null", "a device"),
        ("notes.txt", "neither empty nor figures"),
        ("link.json", "a symbolic link"),
    ] {
        refused_at_start(&s, "--stats-json", path, why);
    }
    let meta = fs::symlink_metadata(d.join("null")).expect("null");
    assert!(std::os::unix::fs::FileTypeExt::is_char_device(
        &meta.file_type()
    ));
    assert_eq!(fs::read(d.join("notes.txt")).expect("notes"), b"precious");
    // A key moved onto the name while the daemon runs is not replaced at
    // the next interval (200 ms), nor at exit: the rule is checked before
    // every write.
    let child = s.start(7, &[], true);
    let key = b"-----BEGIN PRIVATE KEY-----\nnot figures\n-----END PRIVATE KEY-----\n";
    fs::write(d.join("key.tmp"), key).expect("key");
    fs::rename(d.join("key.tmp"), d.join("stats.json")).expect("move the key");
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(stop(child), 0, "{}", s.log(7));
    assert_eq!(
        fs::read(d.join("stats.json")).expect("key"),
        key,
        "{}",
        s.log(7)
    );
    assert!(s.log(7).contains("--stats-json"), "{}", s.log(7));
    // Empty, then the figures of the run before: replaced both times
    // (`start` gives `--stats-json stats.json`).
    fs::write(d.join("stats.json"), b"").expect("empty");
    for n in 0..2 {
        let child = s.start(n, &[], true);
        assert_eq!(stop(child), 0, "{}", s.log(n));
        let v: serde_json::Value =
            serde_json::from_slice(&fs::read(d.join("stats.json")).expect("stats")).expect("json");
        assert!(v.get("uptime_s").is_some(), "{v}");
    }
}

/// `watch … FLAG PATH` is refused at start: exit 2 and one line that says
/// `why` (a daemon that starts instead fails the test, not hangs it).
fn refused_at_start(s: &Scratch, flag: &str, path: &str, why: &str) {
    let args = [
        "watch",
        "src",
        "--out",
        "dest",
        "-R",
        &s.recipient,
        flag,
        path,
    ];
    let r = run_within(s.path(), &args, 30);
    assert_eq!(r.code, 2, "{flag} {path}: {}", r.stderr);
    assert!(r.stderr.contains(why), "{flag} {path}: {}", r.stderr);
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
}

/// `--log` appends only to a log: a typo naming a key, notes or a block
/// device is refused at start (exit 2, one line) and left as it was; a
/// log of an earlier run is appended to; a key moved onto the name before
/// a SIGHUP is not written to (the log goes on in the file open before).
#[test]
fn a_log_is_appended_only_to_a_log() {
    let s = Scratch::new();
    let d = s.path();
    fs::write(d.join("notes.txt"), b"precious").expect("notes");
    std::os::unix::fs::symlink("notes.txt", d.join("link.log")).expect("symlink");
    fs::create_dir(d.join("logdir")).expect("dir");
    // A block device node with no driver behind it: opening it fails on
    // every build, so a regression cannot write to a real disk.
    let c = std::ffi::CString::new(d.join("disk").to_str().expect("utf-8")).expect("c");
    // SAFETY: a valid NUL-terminated path.
    let made = unsafe { libc::mknod(c.as_ptr(), libc::S_IFBLK | 0o600, libc::makedev(231, 7)) };
    assert_eq!(made, 0, "mknod (needs root, as CI runs the tests)");
    for (path, why) in [
        ("notes.txt", "neither empty nor a tpmcrypt log"),
        ("link.log", "neither empty nor a tpmcrypt log"),
        ("logdir", "a directory"),
        ("disk", "a device"),
        ("/dev/stdin", "names standard input"),
    ] {
        refused_at_start(&s, "--log", path, why);
    }
    assert_eq!(fs::read(d.join("notes.txt")).expect("notes"), b"precious");
    assert!(!d.join("dest").exists(), "nothing made before the refusal");

    // Two runs on one log: the second appends to the first's lines.
    let logfile = d.join("daemon.log");
    let log_arg = logfile.to_str().expect("utf-8");
    for n in 0..2 {
        let child = s.start(n, &["--log", log_arg], true);
        assert_eq!(stop(child), 0, "{}", s.log(n));
    }
    let log = fs::read_to_string(&logfile).expect("log");
    assert_eq!(log.matches("signal 15: stopping").count(), 2, "{log}");

    // A key moved onto the name, then SIGHUP: the key is kept as it was.
    let child = s.start(2, &["--log", log_arg], true);
    fs::rename(&logfile, d.join("daemon.log.1")).expect("rotate");
    let key = b"-----BEGIN PRIVATE KEY-----\nnot a log\n-----END PRIVATE KEY-----\n";
    fs::write(&logfile, key).expect("key");
    signal(&child, libc::SIGHUP);
    let old = d.join("daemon.log.1");
    wait_for("the refusal in the old log", Duration::from_secs(5), || {
        fs::read_to_string(&old).is_ok_and(|l| l.contains("cannot reopen the log file"))
    });
    assert_eq!(stop(child), 0, "{}", s.log(2));
    assert_eq!(fs::read(&logfile).expect("key"), key);
    let old = fs::read_to_string(&old).expect("old log");
    assert!(old.contains("neither empty nor a tpmcrypt log"), "{old}");
}

/// The plaintexts of every version of `name` in DEST, concatenated in
/// version order.
fn all_versions(got: &HashMap<PathBuf, Vec<u8>>, name: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for n in 1..10 {
        let v = version_name(name, n);
        if let Some(p) = got.get(Path::new(v.trim_end_matches(".tpmc"))) {
            out.extend_from_slice(p);
        }
    }
    out
}

/// --delete-plaintext removes a source only if what goes is what was
/// encrypted: the removal is slowed down (each unlink waits 4 s) and, in
/// that window, a writer appends to one source and an upload is renamed
/// over another. Nothing may be lost: the appended line and the new upload
/// end up encrypted, as further versions.
#[test]
fn delete_plaintext_loses_nothing_written_during_the_removal() {
    assert!(
        Command::new("strace").arg("-V").output().is_ok(),
        "strace is needed (installed by scripts/setup-deps)"
    );
    let s = Scratch::new();
    let stage = s.path().join("stage");
    fs::create_dir(&stage).expect("mkdir stage");
    let child = s.start_with(
        0,
        &["--delete-plaintext", "--settle", "200ms", "--workers", "2"],
        true,
        &[
            "strace",
            "-f",
            "-o",
            "/dev/null",
            "-e",
            "inject=unlinkat,unlink:delay_enter=4000000",
        ],
        None,
    );
    write_file(&s.src().join("app.log"), b"line1\n");
    write_file(&s.src().join("up.txt"), b"first upload\n");
    write_file(&stage.join("up.txt"), b"second upload\n");
    wait_for("the first ciphertexts", Duration::from_secs(30), || {
        s.dest().join("app.log.tpmc").exists() && s.dest().join("up.txt.tpmc").exists()
    });
    // Verified and being removed (each unlink takes 4 s).
    std::thread::sleep(Duration::from_millis(400));
    let mut log = fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(s.src().join("app.log"))
        .expect("open app.log");
    log.write_all(b"line2\n").expect("append");
    drop(log);
    fs::rename(stage.join("up.txt"), s.src().join("up.txt")).expect("mv");
    // Give the new files time to be taken (each removal takes 4 s).
    let _ = std::panic::catch_unwind(|| {
        wait_for("SRC to empty", Duration::from_secs(40), || {
            fs::read_dir(s.src())
                .map(|d| d.count() == 0)
                .unwrap_or(false)
                && ciphertexts(&s.dest()) >= 4
        })
    });
    // SIGTERM to the daemon, not to strace (which would only detach).
    for pid in common::child_pids_of(child.id()) {
        // SAFETY: signalling a process this test started.
        unsafe {
            libc::kill(pid as i32, libc::SIGTERM);
        }
    }
    assert_eq!(stop(child), 0, "{}", s.log(0));
    let got = s.decrypt_all();
    assert_eq!(
        all_versions(&got, "app.log"),
        b"line1\nline2\n",
        "{}",
        s.log(0)
    );
    assert_eq!(
        all_versions(&got, "up.txt"),
        b"first upload\nsecond upload\n",
        "{}",
        s.log(0)
    );
}

/// Without leases (the daemon is neither root nor the files' owner) an
/// open writer cannot be seen: with --delete-plaintext such a file is
/// encrypted but kept, with a warning, so that a writer still holding it
/// open loses nothing.
#[test]
fn delete_plaintext_keeps_files_it_cannot_lease() {
    assert_eq!(
        // SAFETY: geteuid cannot fail.
        unsafe { libc::geteuid() },
        0,
        "this test runs the daemon as another user on root's files: run it as root, as CI does"
    );
    let s = Scratch::new();
    fs::set_permissions(s.src(), fs::Permissions::from_mode(0o777)).expect("chmod");
    let child = s.start_with(
        0,
        &["--delete-plaintext", "--settle", "200ms"],
        true,
        &[],
        Some(65534),
    );
    let path = s.src().join("app.log");
    let mut w = fs::File::create(&path).expect("create");
    w.write_all(b"line1\n").expect("write");
    std::thread::sleep(Duration::from_millis(1500));
    w.write_all(b"line2\n").expect("write");
    drop(w);
    wait_for("line2 to be encrypted", Duration::from_secs(30), || {
        !path.exists()
            || fs::read(s.path().join("stats.json"))
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                .and_then(|v| v["files"].as_u64())
                >= Some(2)
    });
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(stop(child), 0, "{}", s.log(0));
    assert_eq!(fs::read(&path).expect("app.log kept"), b"line1\nline2\n");
    assert!(
        s.log(0).contains("app.log: kept: no file lease"),
        "{}",
        s.log(0)
    );
    let st = s.stats();
    assert_eq!(st["deleted"], 0, "{st}");
    assert!(st["kept_no_lease"].as_u64() >= Some(1), "{st}");
    let got = s.decrypt_all();
    let last = (1..10)
        .rev()
        .find_map(|n| {
            got.get(Path::new(
                version_name("app.log", n).trim_end_matches(".tpmc"),
            ))
        })
        .expect("a ciphertext of app.log");
    assert_eq!(last, b"line1\nline2\n", "{}", s.log(0));
}

/// A source moved aside for removal by a daemon killed before the unlink
/// is renamed back at the next start and encrypted, never removed
/// unencrypted; if its name was taken meanwhile it is kept under a
/// `.tpmcrypt-restored.` name and encrypted too.
#[test]
fn a_source_moved_aside_by_a_killed_daemon_is_recovered() {
    let s = Scratch::new();
    let dead = 2_147_483_646; // no such process
    let aside = |name: &str| format!(".{name}.tpmcrypt-removing.{dead}.0123456789abcdef");
    write_file(
        &s.src().join("sub").join(aside("app.log")),
        b"moved aside\n",
    );
    write_file(&s.src().join(aside("up.txt")), b"older upload\n");
    write_file(&s.src().join("up.txt"), b"newer upload\n");
    let child = s.start(0, &["--delete-plaintext"], true);
    wait_for("SRC to empty", Duration::from_secs(30), || {
        walk(&s.src()).is_empty()
    });
    assert_eq!(stop(child), 0, "{}", s.log(0));
    let got = s.decrypt_all();
    assert_eq!(
        got[Path::new("sub/app.log")],
        b"moved aside\n",
        "{}",
        s.log(0)
    );
    assert_eq!(got[Path::new("up.txt")], b"newer upload\n");
    let restored: Vec<_> = got
        .iter()
        .filter(|(p, _)| {
            p.to_string_lossy()
                .starts_with(".up.txt.tpmcrypt-restored.")
        })
        .collect();
    assert_eq!(restored.len(), 1, "{got:?}");
    assert_eq!(restored[0].1, b"older upload\n");
    assert_eq!(got.len(), 3, "{:?}", got.keys());
}

/// The daemon commits in groups: 500 files dropped at once (in 5
/// directories, --delete-plaintext) cost a few sync calls per batch, not
/// two or three per file. strace -y names each synced file, so the
/// journal's and the statistics' own syncs (per interval) are told apart.
#[test]
fn watch_syncs_per_batch_not_per_file() {
    const N: usize = 500;
    let s = Scratch::new();
    for i in 0..N {
        write_file(
            &s.src().join(format!("d{}/f{i:03}", i % 5)),
            &bytes(4096, i as u64),
        );
    }
    let trace = s.path().join("strace.log");
    let child = s.start_env(
        0,
        &["--delete-plaintext", "--workers", "2"],
        true,
        &[
            "strace",
            "-f",
            "-qq",
            "-y",
            "-o",
            trace.to_str().expect("utf8"),
            "-e",
            "trace=fsync,fdatasync,syncfs",
        ],
        None,
        // A batch waits up to 300 ms for more (20 ms in production): under
        // strace on a loaded machine the workers fill a 20 ms batch with
        // few files (CI once saw 101 batches for 500 files), and this test
        // counts syncs per batch, not how full batches get.
        &[
            ("TPMCRYPT_LOG", "debug"),
            ("TPMCRYPT_WATCH_TEST_BATCH_AGE_MS", "300"),
        ],
    );
    wait_for("SRC to be emptied", Duration::from_secs(120), || {
        walk(&s.src()).is_empty()
    });
    for pid in common::child_pids_of(child.id()) {
        // SAFETY: signalling a process this test started.
        unsafe {
            libc::kill(pid as i32, libc::SIGTERM);
        }
    }
    assert_eq!(stop(child), 0, "{}", s.log(0));
    assert_eq!(ciphertexts(&s.dest()), N, "{}", s.log(0));
    let text = fs::read_to_string(&trace).expect("strace log");
    // The statistics file is replaced in the scratch root once per
    // interval: its directory's syncs count with it (a slow run has more).
    let root = format!("<{}>", s.path().display());
    let own =
        |l: &&str| l.contains(".tpmcrypt-watch") || l.contains("stats.json") || l.contains(&root);
    let syncs: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("sync") && l.contains('('))
        .filter(|l| !own(l))
        .collect();
    let batches = s
        .log(0)
        .lines()
        .filter(|l| l.contains("committed a batch of"))
        .count();
    eprintln!("{N} files: {} sync calls, {batches} batches", syncs.len());
    // Per batch: the data (syncfs), the new names' directories, the
    // removals' directories; a few more for SRC's and DEST's start-up.
    assert!(
        syncs.len() <= 3 * batches + 8,
        "{} sync calls for {batches} batches of {N} files: not O(batches + directories):\n{}",
        syncs.len(),
        syncs.join("\n")
    );
    // Batches hold many files each, and the syncs are far fewer than the
    // files (one file at a time made two or three each).
    assert!(
        batches > 0 && batches <= N / 5,
        "{batches} batches for {N} files"
    );
    assert!(syncs.len() < N, "{} sync calls for {N} files", syncs.len());
}

/// Starts the daemon with the debug build's crash hook at `at` and waits
/// for it to kill itself there.
fn killed_at(s: &Scratch, n: usize, flags: &[&str], at: &str) {
    let child = s.start_env(
        n,
        flags,
        false,
        &[],
        None,
        &[("TPMCRYPT_WATCH_TEST_CRASH_AT", at)],
    );
    self_killed(s, child, n, at);
}

/// Waits for daemon `n`, started with the crash hook at `at`, to kill
/// itself there (SIGKILL).
fn self_killed(s: &Scratch, mut child: Child, n: usize, at: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{at}: the daemon did not kill itself there: {}", s.log(n));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{at}: {}", s.log(n));
}

/// A kill between the journal record of a ciphertext that is to replace
/// an earlier one and its rename: the last record on disk names a
/// ciphertext that never got its name, but the record before it still
/// holds for the ciphertext in place. The next run replaces that one, as
/// the killed run would have, instead of adding a version beside it: with
/// --delete-plaintext a byte-for-byte duplicate (the rare duplicate the
/// kill -9 loop used to meet), without it a second version of a source
/// whose mirror should have followed its edit.
#[test]
fn a_kill_between_a_replacements_record_and_its_rename_adds_no_version() {
    for delete in [true, false] {
        let s = Scratch::new();
        let flags: &[&str] = if delete { &["--delete-plaintext"] } else { &[] };
        let src = s.src().join("a");
        let ct = s.dest().join("a.tpmc");
        write_file(&src, b"first");
        let want: &[u8] = if delete {
            // a.tpmc made, the source not removed yet.
            killed_at(&s, 0, flags, "renamed");
            b"first"
        } else {
            let child = s.start(0, flags, true);
            wait_for("a.tpmc", Duration::from_secs(30), || ct.exists());
            assert_eq!(stop(child), 0, "{}", s.log(0));
            // An edit while the daemon is down: a.tpmc must follow it.
            write_file(&src, b"first, then edited");
            b"first, then edited"
        };
        assert_eq!(s.decrypt_one(&ct), b"first");
        // The next run encrypts a again, to replace a.tpmc, and is killed
        // after recording it.
        killed_at(&s, 1, flags, "recorded");
        assert_eq!(s.decrypt_one(&ct), b"first", "delete {delete}: replaced");
        let child = s.start(2, flags, true);
        // (Not stats.json's count: the file of the runs before is there
        // until this run writes its own.)
        wait_for("a's encryption", Duration::from_secs(30), || {
            if delete {
                !src.exists()
            } else {
                s.decrypt_one(&ct) == want
            }
        });
        assert_eq!(stop(child), 0, "{}", s.log(2));
        assert_eq!(
            ciphertexts(&s.dest()),
            1,
            "delete {delete}: a version was added: {:?}",
            walk(&s.dest())
        );
        assert_eq!(s.decrypt_one(&ct), want, "delete {delete}");
    }
}

/// Each --stats-json snapshot is one write, not one per JSON token (it was
/// about 150 writes of a byte or a word, every interval).
#[test]
fn a_stats_snapshot_is_one_write() {
    let s = Scratch::new();
    let trace = s.path().join("strace.log");
    let child = s.start_env(
        0,
        &[],
        true,
        &[
            "strace",
            "-f",
            "-qq",
            "-y",
            "-s",
            "8192",
            "-o",
            trace.to_str().expect("utf8"),
            "-e",
            "trace=write",
        ],
        None,
        &[],
    );
    // Several intervals of 200 ms.
    std::thread::sleep(Duration::from_millis(1200));
    for pid in common::child_pids_of(child.id()) {
        // SAFETY: signalling a process this test started.
        unsafe {
            libc::kill(pid as i32, libc::SIGTERM);
        }
    }
    assert_eq!(stop(child), 0, "{}", s.log(0));
    let text = fs::read_to_string(&trace).expect("strace log");
    let writes: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("write(") && l.contains(".stats.json"))
        .collect();
    assert!(writes.len() >= 2, "no snapshot written:\n{text}");
    let short: Vec<&&str> = writes.iter().filter(|l| !l.contains("\\n}\\n\"")).collect();
    assert!(
        short.is_empty(),
        "{} of {} writes to the snapshot's temporary are not a whole snapshot:\n{}",
        short.len(),
        writes.len(),
        short
            .iter()
            .take(5)
            .map(|l| l.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Deterministic kills inside a group commit (a hook of debug builds:
/// TPMCRYPT_WATCH_TEST_CRASH_AT, see commands/watch/commit.rs): after the
/// batch's data is durable but before any rename, and after the renames
/// but before any source is removed. Each leaves every source in SRC, and
/// the next run finishes the job without a duplicate version.
#[test]
fn kill_inside_a_group_commit_loses_nothing() {
    for at in ["synced", "renamed"] {
        let s = Scratch::new();
        let want: Vec<(PathBuf, Vec<u8>)> = (0..40u64)
            .map(|i| (PathBuf::from(format!("d{}/f{i}", i % 3)), bytes(3000, i)))
            .collect();
        for (rel, data) in &want {
            write_file(&s.src().join(rel), data);
        }
        killed_at(&s, 0, &["--delete-plaintext", "--workers", "2"], at);
        // No source was removed: none had its batch finished.
        for (rel, _) in &want {
            assert!(s.src().join(rel).exists(), "{at}: {} gone", rel.display());
        }
        let named = ciphertexts(&s.dest());
        if at == "synced" {
            // The batch's new ciphertexts had no name yet (written with
            // none where DEST's file system takes O_TMPFILE, else under a
            // temporary one): the kill left none under a final name.
            assert_eq!(named, 0, "{at}: a ciphertext was named before its batch");
        } else {
            assert!(named > 0, "{at}: the first batch's ciphertexts");
        }
        let child = s.start(1, &["--delete-plaintext"], true);
        wait_for("SRC to be emptied", Duration::from_secs(60), || {
            walk(&s.src()).is_empty()
        });
        assert_eq!(stop(child), 0, "{}", s.log(1));
        let got = s.decrypt_all();
        assert_eq!(got.len(), want.len(), "{at}: {:?}", got.keys());
        for (rel, data) in &want {
            assert_eq!(got.get(rel), Some(data), "{at}: {}", rel.display());
        }
    }
}

/// Under --delete-plaintext a source is removed only from where it is
/// beneath SRC: a directory moved out of SRC while one of its files was
/// in flight keeps that file (its ciphertext is made all the same). The
/// removal used to go through the directory opened at pickup, which
/// follows the directory wherever it goes, so a file outside SRC was
/// removed. A directory not moved loses its verified source as before.
#[test]
fn a_directory_moved_out_while_in_flight_keeps_its_file() {
    let s = Scratch::new();
    let out = s.path().join("out");
    fs::create_dir(&out).expect("mkdir out");
    for d in ["moved", "stays"] {
        fs::create_dir(s.src().join(d)).expect("mkdir");
    }
    // Each doc.txt's job is held 2.5 s once its ciphertext is complete
    // and verified, before the commit and the removal.
    let child = s.start_paused(0, &["--delete-plaintext"], "doc.txt:2500:ready");
    write_file(&s.src().join("moved/doc.txt"), b"moved out in flight");
    write_file(&s.src().join("stays/doc.txt"), b"stays in SRC");
    held(&s, 0, "moved/doc.txt", 1);
    fs::rename(s.src().join("moved"), out.join("moved")).expect("mv moved out");
    let ct = s.dest().join("moved/doc.txt.tpmc");
    wait_for("both commits", Duration::from_secs(30), || {
        ct.exists() && !s.src().join("stays/doc.txt").exists()
    });
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(stop(child), 0, "{}", s.log(0));
    assert_eq!(
        fs::read(out.join("moved/doc.txt")).ok().as_deref(),
        Some(&b"moved out in flight"[..]),
        "a file moved out of SRC was removed: {}",
        s.log(0)
    );
    assert_eq!(s.decrypt_one(&ct), b"moved out in flight");
    assert_eq!(
        s.decrypt_one(&s.dest().join("stays/doc.txt.tpmc")),
        b"stays in SRC"
    );
    assert!(
        s.log(0)
            .contains("moved/doc.txt: kept: its directory was moved"),
        "{}",
        s.log(0)
    );
}

/// A directory renamed inside SRC while one of its files is in flight
/// (--delete-plaintext): the job under the old path keeps the file, which
/// the job under the new path encrypts and removes; neither job takes
/// the other's file for one that changed. (The old path's job used to
/// remove the file through the renamed directory, and the new path's job
/// then found its file gone after its commit.)
#[test]
fn a_directory_renamed_in_src_while_in_flight_is_removed_by_its_new_path() {
    let s = Scratch::new();
    fs::create_dir(s.src().join("sub2")).expect("mkdir");
    let child = s.start_paused(0, &["--delete-plaintext"], "big.bin:2500:ready");
    let data = bytes(300_000, 7);
    write_file(&s.src().join("sub2/big.bin"), &data);
    held(&s, 0, "sub2/big.bin", 1);
    fs::rename(s.src().join("sub2"), s.src().join("sub2renamed")).expect("mv");
    let moved = s.src().join("sub2renamed/big.bin");
    wait_for("the renamed file to go", Duration::from_secs(30), || {
        !moved.exists()
    });
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(stop(child), 0, "{}", s.log(0));
    let log = s.log(0);
    assert!(
        !log.contains("changed while being encrypted"),
        "a job took a removal by another for a change: {log}"
    );
    assert!(log.contains("sub2/big.bin: kept"), "{log}");
    for ct in ["sub2/big.bin.tpmc", "sub2renamed/big.bin.tpmc"] {
        assert_eq!(s.decrypt_one(&s.dest().join(ct)), data, "{ct}");
    }
    assert_eq!(s.stats()["deleted"], 1);
}

/// A ciphertext is replaced (its source edited) only if its name still
/// holds it at the commit: a file put at that name while the new version
/// was encrypted (the old ciphertext moved aside first) is left alone,
/// and the new version takes the next free name. (The commit's rename
/// used to overwrite whatever held the name.)
#[test]
fn a_replacement_never_overwrites_a_file_put_at_its_name_meanwhile() {
    let s = Scratch::new();
    let child = s.start_paused(0, &[], "a:2000:ready");
    let ct = encrypted_then_edited(&s);
    // The edit's job is held, complete; meanwhile the old ciphertext is
    // moved aside and another file takes its name.
    held(&s, 0, "a", 2);
    let aside = s.dest().join("kept-aside.tpmc");
    fs::rename(&ct, &aside).expect("mv a.tpmc aside");
    fs::write(&ct, b"not tpmcrypt's").expect("a foreign a.tpmc");
    let a2 = s.dest().join(version_name("a", 2));
    wait_for("a.v2.tpmc", Duration::from_secs(30), || a2.exists());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(stop(child), 0, "{}", s.log(0));
    assert_eq!(
        fs::read(&ct).expect("a.tpmc"),
        b"not tpmcrypt's",
        "the file put at a.tpmc was overwritten: {}",
        s.log(0)
    );
    assert_eq!(s.decrypt_one(&aside), b"a, first");
    assert_eq!(s.decrypt_one(&a2), b"a, edited");
}

/// A replacement is an exchange with the ciphertext it replaces: a kill
/// just before it leaves the old ciphertext under the name, a kill just
/// after it the new one, with the old one under a temporary name; either
/// way the next run ends with the edit's ciphertext under the name, no
/// version added and no temporary left.
#[test]
fn a_kill_at_a_replacements_exchange_leaves_one_ciphertext() {
    for at in ["checked", "exchanged"] {
        let s = Scratch::new();
        let src = s.src().join("a");
        let ct = s.dest().join("a.tpmc");
        write_file(&src, b"first");
        let child = s.start(0, &[], true);
        wait_for("a.tpmc", Duration::from_secs(30), || ct.exists());
        assert_eq!(stop(child), 0, "{}", s.log(0));
        write_file(&src, b"first, then edited");
        let child = s.start_env(
            1,
            &[],
            false,
            &[],
            None,
            &[("TPMCRYPT_REKEY_TEST_CRASH_AT", at)],
        );
        self_killed(&s, child, 1, at);
        let expect: &[u8] = if at == "checked" {
            b"first"
        } else {
            b"first, then edited"
        };
        assert_eq!(s.decrypt_one(&ct), expect, "{at}");
        let child = s.start(2, &[], true);
        wait_for("a.tpmc to follow the edit", Duration::from_secs(30), || {
            s.decrypt_one(&ct) == b"first, then edited"
        });
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(stop(child), 0, "{}", s.log(2));
        let state = s.dest().join(".tpmcrypt-watch");
        let left: Vec<_> = walk(&s.dest())
            .into_iter()
            .filter(|p| !p.starts_with(&state))
            .collect();
        assert_eq!(left, vec![ct.clone()], "{at}: {}", s.log(1));
    }
}

/// A hard link to a ciphertext made while its replacement is in flight (a
/// backup that hard-links DEST, `cp -al`) is no reason to give up the
/// replacement: the name takes the edit, the backup keeps the old
/// ciphertext, and no version is added. (Found by a hostile round: the
/// exchange took the link's new ctime for a change, and a stress run with
/// frequent `cp -al` made 554 versions of 40 sources.)
#[test]
fn a_backups_hard_link_does_not_turn_a_replacement_into_a_version() {
    let s = Scratch::new();
    let child = s.start_paused(0, &[], "a:2000:ready");
    let ct = encrypted_then_edited(&s);
    held(&s, 0, "a", 2);
    let backup = s.path().join("backup.tpmc");
    fs::hard_link(&ct, &backup).expect("ln a.tpmc backup");
    wait_for("the edit's job", Duration::from_secs(30), || {
        s.stats()["files"] == 2
    });
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(stop(child), 0, "{}", s.log(0));
    assert_eq!(s.decrypt_one(&ct), b"a, edited", "{}", s.log(0));
    assert_eq!(s.decrypt_one(&backup), b"a, first");
    assert_eq!(ciphertexts(&s.dest()), 1, "{:?}", walk(&s.dest()));
}

/// Directories below SRC renamed back and forth while the daemon starts
/// (its watches are set up by walking the tree) do not keep it from
/// starting. (Found by a hostile round: 15 starts of 20 ended with
/// `error: watching SRC: No path was found`.)
#[test]
fn a_tree_renamed_during_start_up_is_still_watched() {
    let s = Scratch::new();
    for i in 0..50 {
        fs::create_dir_all(s.src().join(format!("churn/s{i}/t"))).expect("mkdir");
    }
    let stop_churn = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let (src, stop_churn) = (s.src(), stop_churn.clone());
        std::thread::spawn(move || {
            let (a, b) = (src.join("churn"), src.join("churn2"));
            let mut n = 0u64;
            while !stop_churn.load(std::sync::atomic::Ordering::Relaxed) {
                let (from, to) = if n % 2 == 0 { (&a, &b) } else { (&b, &a) };
                if fs::rename(from, to).is_ok() {
                    n += 1;
                }
                std::thread::sleep(Duration::from_micros(500));
            }
            n
        })
    };
    for n in 0..6 {
        // Waits for READY=1 (or panics with the log if it exits first).
        let child = s.start(n, &[], true);
        assert_eq!(stop(child), 0, "{}", s.log(n));
    }
    stop_churn.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(
        churn.join().expect("churn") > 100,
        "the tree was hardly renamed"
    );
    // Still a working daemon on the settled tree.
    let child = s.start(6, &[], true);
    let dir = ["churn", "churn2"]
        .iter()
        .map(|d| s.src().join(d))
        .find(|d| d.exists())
        .expect("the churned directory");
    write_file(&dir.join("s7/t/f"), b"after the churn");
    let rel = dir.file_name().expect("name").to_owned();
    let ct = s.dest().join(rel).join("s7/t/f.tpmc");
    wait_for("f.tpmc", Duration::from_secs(30), || ct.exists());
    assert_eq!(stop(child), 0, "{}", s.log(6));
    assert_eq!(s.decrypt_one(&ct), b"after the churn");
}

/// A source a killed daemon had moved aside to remove, once its verified
/// ciphertext was durable under its final name (the journal records it),
/// is removed at the next start under --delete-plaintext, not encrypted a
/// second time. (It used to be renamed back; when an upload had taken its
/// name meanwhile it was kept under another and encrypted again: the
/// rare extra ciphertext of `kill_9_while_versions_arrive_loses_none`.)
#[test]
fn a_moved_aside_source_whose_ciphertext_is_made_is_removed_at_start() {
    let s = Scratch::new();
    let a = s.src().join("a");
    write_file(&a, b"encrypted before the kill");
    // Killed after the commit (a.tpmc and its record), before the removal.
    killed_at(&s, 0, &["--delete-plaintext"], "renamed");
    assert!(s.dest().join("a.tpmc").exists());
    // As if killed between the move aside and the unlink; then an upload
    // takes the name.
    let dead = 2_147_483_646; // no such process
    let aside = s
        .src()
        .join(format!(".a.tpmcrypt-removing.{dead}.0123456789abcdef"));
    fs::rename(&a, &aside).expect("move aside");
    write_file(&a, b"an upload after the kill");
    let child = s.start(1, &["--delete-plaintext"], true);
    wait_for("SRC to empty", Duration::from_secs(30), || {
        walk(&s.src()).is_empty()
    });
    assert_eq!(stop(child), 0, "{}", s.log(1));
    let got = s.decrypt_all();
    assert_eq!(got[Path::new("a")], b"encrypted before the kill");
    assert_eq!(
        got[Path::new("a.v2")],
        b"an upload after the kill",
        "{}",
        s.log(1)
    );
    assert_eq!(got.len(), 2, "{:?} {}", got.keys(), s.log(1));
}

/// Waits until daemon `n`'s job for `rel` has been held by the pause hook
/// `times` times in all (the hook logs each pause as it begins), so that a
/// test acts within the pause, not after a sleep it hopes is long enough.
fn held(s: &Scratch, n: usize, rel: &str, times: usize) {
    let line = format!("test pause: {rel} held");
    wait_for(&line, Duration::from_secs(60), || {
        s.log(n).matches(&line).count() >= times
    });
}

/// Writes SRC/a ("a, first"), waits for its ciphertext a.tpmc and the end
/// of its job, then edits it ("a, edited"), so that a job to replace
/// a.tpmc follows; returns a.tpmc's path.
fn encrypted_then_edited(s: &Scratch) -> PathBuf {
    let a = s.src().join("a");
    let ct = s.dest().join("a.tpmc");
    write_file(&a, b"a, first");
    wait_for("a.tpmc", Duration::from_secs(30), || ct.exists());
    wait_for("the first job's end", Duration::from_secs(30), || {
        s.stats()["files"] == 1
    });
    std::thread::sleep(Duration::from_millis(100));
    fs::write(&a, b"a, edited").expect("edit a");
    ct
}
