//! End-to-end tests of the TPM features of the `tpmcrypt` binary, against
//! real software TPMs: each test starts its own swtpm (own state, own
//! ports) and passes `--tpm swtpm:…`, or uses `--simulator` where a
//! per-command simulator is enough. tpm2-tools and openssl drive the TPM
//! from outside (PCR extension, lockout parameters, interop, leak checks).
//!
//! A missing swtpm, tpm2-tools or openssl makes the tests FAIL, never skip.
//!
//! Exit codes: 0 ok, 2 usage, 4 TPM unavailable or refused.

mod common;
use common::{closed_tcti, lockout_counter, swtpm};

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{assert_ok, bytes, recovery, tpm2_tool, tpm_handles, tpmcrypt, Run};
use serde_json::Value;
use tempfile::TempDir;
use tpmcrypt_tpmkey::Simulator;

const OK: i32 = 0;
const USAGE: i32 = 2;
const TPM: i32 = 4;

const PIN: &str = "2468";

// ---------------------------------------------------------------- helpers

fn scratch() -> TempDir {
    common::scratch("tpmcrypt-tpm-")
}

/// Runs `tpmcrypt --tpm TCTI ARGS…` in `dir` with extra environment.
fn tc_env(dir: &Path, tcti: &str, env: &[(&str, &str)], args: &[&str]) -> Run {
    let mut cmd = tpmcrypt(dir);
    cmd.arg("--tpm").arg(tcti).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("spawn tpmcrypt").into()
}

/// Runs `tpmcrypt --tpm TCTI ARGS…` in `dir`.
fn tc(dir: &Path, tcti: &str, args: &[&str]) -> Run {
    tc_env(dir, tcti, &[], args)
}

/// Runs `tpmcrypt ARGS…` in `dir` (no TPM selected).
fn plain(dir: &Path, args: &[&str]) -> Run {
    common::run(dir, args)
}

fn stdout(r: &Run) -> String {
    String::from_utf8_lossy(&r.stdout).into_owned()
}

/// Asserts exit `code` and exactly one stderr line, starting `error: ` and
/// containing every needle (case-insensitively).
fn assert_one_line(r: &Run, code: i32, needles: &[&str], what: &str) {
    common::assert_error_line(r, code, None, needles, what);
}

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

fn assert_no_handles(sim: &Simulator, dir: &Path, after: &str) {
    let h = tpm_handles(sim, dir);
    assert!(h.is_empty(), "after {after}: the TPM still holds {h:?}");
}

/// The keystore of the scratch directory (see `common::tpmcrypt`).
fn keystore(dir: &Path) -> PathBuf {
    dir.join(".tpmcrypt-home")
}

/// What `key create` reported.
struct Created {
    fingerprint: String,
    secs: f64,
}

/// Parses `created key NAME (ALG) in S s on …; fingerprint FP`.
fn parse_created(r: &Run, name: &str, alg: &str) -> Created {
    let out = stdout(r);
    let line = out
        .lines()
        .find(|l| l.starts_with("created key "))
        .unwrap_or_else(|| panic!("no 'created key' line in {out:?}"));
    let prefix = format!("created key {name} ({alg}) in ");
    let rest = line
        .strip_prefix(&prefix)
        .unwrap_or_else(|| panic!("{line:?} does not start with {prefix:?}"));
    let secs: f64 = rest
        .split(' ')
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no creation time in {line:?}"));
    let fingerprint = line
        .rsplit("fingerprint ")
        .next()
        .expect("fingerprint")
        .trim()
        .to_string();
    assert_eq!(fingerprint.len(), 32, "{line:?}");
    assert!(fingerprint.bytes().all(|b| b.is_ascii_hexdigit()), "{line}");
    Created { fingerprint, secs }
}

/// `key create` with options; asserts success and parses the report.
fn create_key(dir: &Path, tcti: &str, name: &str, alg: &str, opts: &[&str], pin: bool) -> Created {
    let mut args = vec!["key", "create", name, "--alg", alg];
    args.extend_from_slice(opts);
    if pin {
        args.push("--pin");
    }
    let env: &[(&str, &str)] = if pin { &[("TPMCRYPT_PIN", PIN)] } else { &[] };
    let r = tc_env(dir, tcti, env, &args);
    assert_ok(&r, &format!("key create {name}"));
    parse_created(&r, name, alg)
}

/// `inspect --json FILE`.
fn inspect(dir: &Path, file: &str) -> Value {
    let r = plain(dir, &["inspect", "--json", file]);
    assert_ok(&r, "inspect --json");
    serde_json::from_slice(&r.stdout).expect("inspect --json prints JSON")
}

/// `key list --json`, by name.
fn key_list(dir: &Path) -> Vec<Value> {
    let r = plain(dir, &["key", "list", "--json"]);
    assert_ok(&r, "key list --json");
    let v: Value = serde_json::from_slice(&r.stdout).expect("key list --json prints JSON");
    v.as_array().expect("a JSON array").clone()
}

/// The SHA-256 of a PEM public key's DER (SubjectPublicKeyInfo), computed
/// by openssl; tpmcrypt's fingerprint is its first 16 bytes.
fn openssl_spki_sha256(dir: &Path, pem: &str) -> String {
    let der = format!("{pem}.der");
    openssl(
        dir,
        &[
            "pkey", "-pubin", "-in", pem, "-outform", "DER", "-out", &der,
        ],
    );
    let out = openssl(dir, &["dgst", "-sha256", "-r", &der]);
    out.split_whitespace().next().expect("digest").to_string()
}

/// Asserts the `-v` summary of a decrypt.
fn assert_summary(r: &Run, files: usize, unwraps: u64, unbinds: u64, what: &str) {
    let want = format!("tpmcrypt: decrypted {files} file(s), ");
    let tail = format!("0 failed, {unwraps} session key unwrap(s), {unbinds} TPM unbind(s)");
    let line = r
        .stderr
        .lines()
        .find(|l| l.starts_with("tpmcrypt: decrypted "))
        .unwrap_or_else(|| panic!("{what}: no summary in {:?}", r.stderr));
    assert!(
        line.starts_with(&want) && line.ends_with(&tail),
        "{what}: summary {line:?}, want {want:?} … {tail:?}"
    );
}

/// A `tpmcrypt agent` child, killed (by its own pid) if the test ends early.
struct AgentProc(Option<Child>);

impl AgentProc {
    fn start(dir: &Path) -> AgentProc {
        Self::start_with_ttl(dir, "5m")
    }

    fn start_with_ttl(dir: &Path, ttl: &str) -> AgentProc {
        let child = tpmcrypt(dir)
            .args(["agent", "--ttl", ttl])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn tpmcrypt agent");
        let mut agent = AgentProc(Some(child));
        let sock = dir.join(".tpmcrypt-agent.sock");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !common::agent_socket_ready(&sock) {
            if let Some(status) = agent.child().try_wait().expect("try_wait") {
                panic!("tpmcrypt agent exited at once: {status}");
            }
            assert!(Instant::now() < deadline, "agent socket never appeared");
            std::thread::sleep(Duration::from_millis(20));
        }
        agent
    }

    fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("agent child")
    }

    /// Waits for the agent to exit by itself; returns whether it succeeded.
    fn wait_exit(mut self) -> bool {
        let mut child = self.0.take().expect("agent child");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                return status.success();
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("tpmcrypt agent did not exit after agent --stop");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

// ---------------------------------------------------------------- 1. round trips

#[test]
fn round_trips_for_every_algorithm_and_policy() {
    let dir = scratch();
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    let mut report = Vec::new();
    let mut expected = Vec::new();
    for (i, alg) in ["rsa2048", "ecc-p256"].into_iter().enumerate() {
        for (j, (policy, pcrs, pin)) in [
            ("plain", false, false),
            ("pcr", true, false),
            ("pin", false, true),
            ("pcr-pin", true, true),
        ]
        .into_iter()
        .enumerate()
        {
            let name = format!("{alg}-{policy}");
            let opts: &[&str] = if pcrs { &["--pcrs", "sha256:0,7"] } else { &[] };
            let created = create_key(d, &t, &name, alg, opts, pin);
            assert_no_handles(&sim, d, &format!("key create {name}"));

            let plaintext = bytes(1000 + 4096 * j + i, (10 * i + j) as u64 + 1);
            let src = format!("{name}.txt");
            let ct = format!("{name}.tpmc");
            fs::write(d.join(&src), &plaintext).unwrap();
            assert_ok(
                &plain(d, &["encrypt", "--key", &name, "-o", &ct, &src]),
                &format!("encrypt --key {name}"),
            );
            let info = inspect(d, &ct);
            let recips = info["recipients"].as_array().expect("recipients");
            assert_eq!(recips.len(), 1, "{name}: {info}");
            let kind = if alg == "rsa2048" {
                "tpm-rsa2048"
            } else {
                "tpm-p256"
            };
            assert_eq!(recips[0]["kind"], kind, "{name}");
            assert_eq!(recips[0]["fingerprint"], created.fingerprint.as_str());

            let env: &[(&str, &str)] = if pin { &[("TPMCRYPT_PIN", PIN)] } else { &[] };
            let out = format!("{name}.out");
            let start = Instant::now();
            let r = tc_env(d, &t, env, &["decrypt", "-v", "-o", &out, &ct]);
            let took = start.elapsed();
            assert_ok(&r, &format!("decrypt {name}"));
            // Only the addressed key touches the TPM, once.
            assert_summary(&r, 1, 1, 1, &format!("decrypt {name}"));
            assert_eq!(
                fs::read(d.join(&out)).unwrap(),
                plaintext,
                "{name}: round trip"
            );
            assert_no_handles(&sim, d, &format!("decrypt {name}"));
            report.push(format!(
                "{name:<17} create {:>6.3} s, decrypt command {:>6.3} s",
                created.secs,
                took.as_secs_f64()
            ));
            expected.push((name, alg, pcrs, pin, created.fingerprint));
        }
    }

    // key list --json, key show and key export agree with key create.
    let list = key_list(d);
    let names: Vec<&str> = list.iter().map(|k| k["name"].as_str().unwrap()).collect();
    let mut want: Vec<&str> = expected.iter().map(|e| e.0.as_str()).collect();
    want.sort();
    assert_eq!(names, want, "key list --json names");
    for (name, alg, pcrs, pin, fp) in &expected {
        let k = list.iter().find(|k| k["name"] == name.as_str()).unwrap();
        assert_eq!(k["alg"], *alg, "{name}");
        assert_eq!(k["fingerprint"], fp.as_str(), "{name}");
        assert_eq!(
            k["pcrs"],
            if *pcrs {
                Value::from("sha256:0,7")
            } else {
                Value::Null
            },
            "{name}"
        );
        assert_eq!(k["pin"], *pin, "{name}");
        assert_eq!(k["simulator"], true, "{name}: swtpm is a simulator");
        assert_eq!(k["recovery"], Value::Array(vec![]), "{name}");

        let r = plain(d, &["key", "show", name]);
        assert_ok(&r, "key show");
        let show = stdout(&r);
        let field = |f: &str| -> String {
            show.lines()
                .find_map(|l| l.strip_prefix(&format!("{f}:")))
                .unwrap_or_else(|| panic!("key show {name}: no {f} in {show}"))
                .trim()
                .to_string()
        };
        assert_eq!(field("name"), *name);
        assert_eq!(field("algorithm"), *alg);
        assert_eq!(field("fingerprint"), *fp);
        assert_eq!(field("pcrs"), if *pcrs { "sha256:0,7" } else { "none" });
        assert_eq!(field("pin"), if *pin { "yes" } else { "no" });
        assert!(field("simulator").starts_with("yes"), "{show}");

        let r = plain(d, &["key", "export", name]);
        assert_ok(&r, "key export");
        let pem = stdout(&r);
        assert!(pem.starts_with("-----BEGIN PUBLIC KEY-----"), "{pem}");
        assert_eq!(
            pem,
            fs::read_to_string(keystore(d).join(format!("{name}.pub.pem"))).unwrap(),
            "{name}: export = NAME.pub.pem"
        );
        let file = format!("{name}.export.pem");
        fs::write(d.join(&file), &pem).unwrap();
        let text = openssl(d, &["pkey", "-pubin", "-in", &file, "-noout", "-text_pub"]);
        if *alg == "rsa2048" {
            assert!(text.contains("Public-Key: (2048 bit)"), "{name}: {text}");
        } else {
            assert!(
                text.contains("prime256v1") || text.contains("P-256"),
                "{name}: {text}"
            );
        }
        let digest = openssl_spki_sha256(d, &file);
        assert_eq!(
            &digest[..32],
            fp,
            "{name}: fingerprint = SHA-256(SPKI)[..16]"
        );
    }
    eprintln!("TPM round trips (swtpm):\n  {}", report.join("\n  "));
}

// ---------------------------------------------------------------- 2. unbind count

#[test]
fn one_tpm_unbind_per_session_and_the_agent() {
    let dir = scratch();
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    create_key(d, &t, "k", "ecc-p256", &[], false);

    // 1,000 files, one encrypt, one decrypt: one TPM unbind.
    let bulk = d.join("bulk");
    fs::create_dir(&bulk).unwrap();
    for i in 0..1000 {
        fs::write(
            bulk.join(format!("f{i:04}")),
            bytes(i % 97 + 1, i as u64 + 7),
        )
        .unwrap();
    }
    let start = Instant::now();
    assert_ok(
        &plain(d, &["encrypt", "--key", "k", "--in-place", "-r", "bulk"]),
        "encrypt 1000",
    );
    let enc_secs = start.elapsed().as_secs_f64();
    let cts = common::listing(&bulk);
    assert_eq!(cts.len(), 1000);
    assert!(cts.iter().all(|n| n.ends_with(".tpmc")), "{:?}", &cts[..3]);
    let start = Instant::now();
    let r = tc(d, &t, &["decrypt", "-v", "--in-place", "-r", "bulk"]);
    let dec_secs = start.elapsed().as_secs_f64();
    assert_ok(&r, "decrypt 1000");
    assert_summary(&r, 1000, 1, 1, "decrypt 1000 files");
    for i in 0..1000 {
        assert_eq!(
            fs::read(bulk.join(format!("f{i:04}"))).unwrap(),
            bytes(i % 97 + 1, i as u64 + 7),
            "file {i}"
        );
    }
    assert_no_handles(&sim, d, "decrypt 1000");

    // Ten files of one session, decrypted one command at a time through the
    // agent: the first command unbinds, the others ask the agent.
    let ten = d.join("ten");
    fs::create_dir(&ten).unwrap();
    for i in 0..10 {
        fs::write(ten.join(format!("g{i}")), bytes(100 + i, i as u64 + 99)).unwrap();
    }
    assert_ok(
        &plain(d, &["encrypt", "--key", "k", "-r", "ten"]),
        "encrypt 10",
    );
    let agent = AgentProc::start(d);
    let decrypt_one = |i: usize| -> Run {
        let r = tc(
            d,
            &t,
            &["decrypt", "-v", "-o", "-", &format!("ten/g{i}.tpmc")],
        );
        assert_ok(&r, &format!("decrypt g{i}"));
        assert_eq!(r.stdout, bytes(100 + i, i as u64 + 99), "g{i}");
        r
    };
    let mut agent_secs = Vec::new();
    for i in 0..10 {
        let start = Instant::now();
        let r = decrypt_one(i);
        agent_secs.push(start.elapsed().as_secs_f64());
        if i == 0 {
            assert_summary(&r, 1, 1, 1, "first decrypt with the agent");
        } else {
            assert_summary(&r, 1, 0, 0, &format!("decrypt {i} with the agent"));
        }
    }
    // Deleting a key while the agent holds session keys says that they
    // may still open its files until they expire (the build before said
    // nothing, and they did).
    create_key(d, &t, "spare", "ecc-p256", &[], false);
    let r = plain(d, &["key", "delete", "spare", "--yes"]);
    assert_ok(&r, "key delete");
    assert!(
        r.stderr
            .contains("the running agent still holds session keys")
            && r.stderr.contains("agent --stop"),
        "{}",
        r.stderr
    );
    let r = plain(d, &["agent", "--stop"]);
    assert_ok(&r, "agent --stop");
    assert!(
        agent.wait_exit(),
        "the agent exits with success when stopped"
    );
    // Keys are gone with the agent: the TPM is needed again.
    let r = decrypt_one(5);
    assert_summary(&r, 1, 1, 1, "decrypt after agent --stop");
    assert_no_handles(&sim, d, "decrypts with and without the agent");
    eprintln!(
        "1000 files: encrypt {enc_secs:.2} s, decrypt {dec_secs:.2} s (1 TPM unbind); \
         agent-assisted decrypt commands: first {:.3} s, next ones {:.3}-{:.3} s",
        agent_secs[0],
        agent_secs[1..].iter().cloned().fold(f64::MAX, f64::min),
        agent_secs[1..].iter().cloned().fold(0.0, f64::max)
    );
}

/// A script that runs `encrypt` once per file, while an agent runs: every
/// one of 1,000 runs joins the agent's session, so decrypting all of the
/// files (after the agent is gone) costs one TPM unbind, counted on the
/// wire to the TPM (one ECDH_ZGen); --new-session opts out.
#[test]
fn encrypt_runs_join_the_agents_session() {
    let dir = scratch();
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    create_key(d, &t, "k", "ecc-p256", &[], false);
    let files = d.join("files");
    fs::create_dir(&files).unwrap();
    let agent = AgentProc::start(d);
    const N: usize = 1000;
    for i in 0..N {
        let name = format!("files/f{i:04}");
        fs::write(d.join(&name), bytes(200 + i, i as u64 + 5)).unwrap();
        let r = plain(d, &["-v", "encrypt", "--key", "k", "--in-place", &name]);
        assert_ok(&r, &name);
        let want = if i == 0 {
            "a new session, shared through the agent"
        } else {
            "the agent's current session"
        };
        assert!(r.stderr.contains(want), "{name}: {}", r.stderr);
    }
    let ids: BTreeSet<String> = (0..N)
        .step_by(37)
        .chain([N - 1])
        .map(|i| inspect(d, &format!("files/f{i:04}.tpmc"))["session_id"].to_string())
        .collect();
    assert_eq!(ids.len(), 1, "one session for {N} runs");
    // --new-session: a session of its own, not handed to the agent.
    fs::write(d.join("own"), b"own").unwrap();
    let r = plain(d, &["-v", "encrypt", "--key", "k", "--new-session", "own"]);
    assert!(r.stderr.contains("a session of its own"), "{}", r.stderr);
    assert!(!ids.contains(&inspect(d, "own.tpmc")["session_id"].to_string()));
    // Deleting a key whose encryption session the agent holds says so. The
    // build before counted only keys unwrapped for a decrypt and said
    // nothing, while the session's key still opened the deleted key's file.
    create_key(d, &t, "gone", "ecc-p256", &[], false);
    fs::write(d.join("g"), b"g").unwrap();
    assert_ok(&plain(d, &["encrypt", "--key", "gone", "g"]), "encrypt g");
    let r = plain(d, &["key", "delete", "gone", "--yes"]);
    assert_ok(&r, "key delete gone");
    assert!(
        r.stderr
            .contains("the running agent still holds session keys")
            && r.stderr.contains("open files of gone"),
        "{}",
        r.stderr
    );
    let r = plain(d, &["agent", "--stop"]);
    assert_ok(&r, "agent --stop");
    assert!(agent.wait_exit(), "agent exit status");

    let counter = common::Counter::start(common::port_of(&t));
    let proxied = format!("swtpm:host=127.0.0.1,port={}", counter.port);
    let r = tc(d, &proxied, &["decrypt", "-v", "--in-place", "-r", "files"]);
    assert_ok(&r, "decrypt");
    assert_summary(&r, N, 1, 1, "decrypt the files of 1,000 encrypt runs");
    const TPM_CC_ECDH_ZGEN: u32 = 0x154;
    let codes = counter.codes.lock().unwrap().clone();
    let unbinds = codes.iter().filter(|&&c| c == TPM_CC_ECDH_ZGEN).count();
    assert_eq!(unbinds, 1, "TPM commands on the wire: {codes:x?}");
    for i in 0..N {
        assert_eq!(
            fs::read(files.join(format!("f{i:04}"))).unwrap(),
            bytes(200 + i, i as u64 + 5)
        );
    }
    assert_no_handles(&sim, d, "decrypt");
}

/// How many copies of `needle` the process `pid` holds in its writable
/// memory (heap, anonymous mappings, stack), read through /proc/PID/mem.
fn copies_in_memory(pid: u32, needle: &[u8]) -> usize {
    use std::io::{Read as _, Seek as _, SeekFrom};
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let mut mem = fs::File::open(format!("/proc/{pid}/mem")).expect("open /proc/PID/mem");
    let mut found = 0;
    for line in maps.lines() {
        let mut parts = line.split_whitespace();
        let (Some(range), Some(perms)) = (parts.next(), parts.next()) else {
            continue;
        };
        let path = parts.nth(3).unwrap_or("");
        let anonymous = path.is_empty() || path.starts_with('[');
        if !perms.starts_with("rw") || !anonymous || path == "[vvar]" {
            continue;
        }
        let (a, b) = range.split_once('-').unwrap();
        let (a, b) = (
            u64::from_str_radix(a, 16).unwrap(),
            u64::from_str_radix(b, 16).unwrap(),
        );
        let mut buf = vec![0u8; (b - a) as usize];
        if mem.seek(SeekFrom::Start(a)).is_err() || mem.read_exact(&mut buf).is_err() {
            continue;
        }
        found += buf.windows(needle.len()).filter(|w| *w == needle).count();
    }
    found
}

/// A session handed to the agent by `encrypt` is wiped from the agent's
/// memory when it expires: no copy of the key is left in its heap (the
/// request it arrived in was read into a growing buffer, and every
/// growth left an unwiped copy behind).
#[test]
fn an_expired_session_leaves_no_copy_of_its_key_in_the_agents_memory() {
    let dir = scratch();
    let d = dir.path();
    let recipient = recovery(d, "rec.key");
    let mut agent = AgentProc::start_with_ttl(d, "3s");
    let pid = agent.child().id();
    fs::write(d.join("f"), b"secret data").unwrap();
    let r = plain(d, &["-v", "encrypt", "-R", &recipient, "f"]);
    assert_ok(&r, "encrypt");
    assert!(
        r.stderr.contains("shared through the agent"),
        "{}",
        r.stderr
    );
    let key = reveal_session_key(d, "f.tpmc", "rec.key");
    // The scan sees the key while the agent holds it.
    assert!(copies_in_memory(pid, &key) >= 1, "scan self-check");
    // The agent drops what expired by itself (within 250 ms of the 3 s;
    // a loaded machine may take longer to get there).
    std::thread::sleep(Duration::from_millis(3300));
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut left = copies_in_memory(pid, &key);
    while left > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        left = copies_in_memory(pid, &key);
    }
    assert_eq!(
        left, 0,
        "the expired session key is still in the agent's memory"
    );
}

fn reveal_session_key(dir: &Path, file: &str, id: &str) -> Vec<u8> {
    let r = plain(
        dir,
        &["inspect", "--json", "-i", id, "--reveal-session-key", file],
    );
    assert_ok(&r, "inspect --reveal-session-key");
    let v: Value = serde_json::from_slice(&r.stdout).expect("JSON");
    hex::decode(v["session_key"].as_str().expect("session_key")).expect("hex")
}

// ---------------------------------------------------------------- 3. PCR policy

#[test]
fn pcr_extended_after_creation_refuses_only_keys_bound_to_it() {
    let dir = scratch();
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    create_key(d, &t, "boot", "ecc-p256", &["--pcrs", "sha256:0,7"], false);
    create_key(d, &t, "bootrsa", "rsa2048", &["--pcrs", "sha256:7"], false);
    create_key(
        d,
        &t,
        "other",
        "ecc-p256",
        &["--pcrs", "sha256:0,16"],
        false,
    );
    for k in ["boot", "bootrsa", "other"] {
        fs::write(d.join(k), bytes(3000, k.len() as u64)).unwrap();
        assert_ok(&plain(d, &["encrypt", "--key", k, k]), "encrypt");
    }
    // Before the change every key works.
    let r = tc(d, &t, &["decrypt", "-o", "-", "boot.tpmc"]);
    assert_ok(&r, "decrypt before the PCR change");

    // No tpmcrypt command is connected now (swtpm serves one at a time).
    tpm2_tool(
        &sim,
        d,
        &[
            "tpm2_pcrextend",
            "7:sha256=00000000000000000000000000000000000000000000000000000000000000aa",
        ],
    );
    for (k, pcrs) in [("boot", "sha256:0,7"), ("bootrsa", "sha256:7")] {
        let r = tc(d, &t, &["decrypt", "-o", "-", &format!("{k}.tpmc")]);
        assert_one_line(
            &r,
            TPM,
            &["PCR", pcrs],
            &format!("decrypt {k} after extend"),
        );
        assert!(
            r.stderr.starts_with(&format!("error: {k}.tpmc: ")),
            "{}",
            r.stderr
        );
        assert!(r.stdout.is_empty(), "{k}: no plaintext on failure");
        assert_no_handles(&sim, d, &format!("PCR failure of {k}"));
    }
    // A key bound to PCRs that did not change still works.
    let r = tc(d, &t, &["decrypt", "-o", "-", "other.tpmc"]);
    assert_ok(&r, "decrypt a key bound to unchanged PCRs");
    assert_eq!(r.stdout, bytes(3000, 5));
    assert_no_handles(&sim, d, "decrypt other");
}

// ---------------------------------------------------------------- 4. PIN and lockout

/// A file that a key without a PIN opens costs no dictionary-attack try,
/// whatever PIN is given: that key is tried before the PIN keys, even when
/// a PIN key comes first by name ("pinned" < "plain") and in the header.
#[test]
fn a_key_without_a_pin_is_tried_first() {
    let dir = scratch();
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    create_key(d, &t, "pinned", "ecc-p256", &[], true);
    create_key(d, &t, "plain", "ecc-p256", &[], false);
    fs::write(d.join("f"), b"either key").unwrap();
    let r = plain(d, &["encrypt", "-k", "pinned", "-k", "plain", "f"]);
    assert_ok(&r, "encrypt to both");
    let before = lockout_counter(&sim, d);
    for _ in 0..2 {
        let r = tc_env(
            d,
            &t,
            &[("TPMCRYPT_PIN", "1111")],
            &["decrypt", "-o", "-", "f.tpmc"],
        );
        assert_ok(&r, "decrypt with a wrong PIN for the other key");
        assert_eq!(r.stdout, b"either key");
    }
    assert_eq!(lockout_counter(&sim, d), before, "no try spent");
    assert_no_handles(&sim, d, "decrypt");
}

/// A PIN is one line wherever it comes from: a key made with
/// `TPMCRYPT_PIN` ending in `\r\n` opens with a PIN file holding the same
/// line, and no try is spent; a new PIN with a control character in it is
/// refused before the TPM is asked.
#[test]
fn a_pin_is_one_line_from_every_source() {
    let dir = scratch();
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    let r = tc_env(
        d,
        &t,
        &[("TPMCRYPT_PIN", "2468\r\n")],
        &["key", "create", "k", "--pin"],
    );
    assert_ok(&r, "key create with a CRLF PIN");
    fs::write(d.join("f"), b"one line").unwrap();
    assert_ok(&plain(d, &["encrypt", "-k", "k", "f"]), "encrypt");
    fs::write(d.join("pin"), b"2468\n").unwrap();
    common::chmod(&d.join("pin"), 0o600);
    let before = lockout_counter(&sim, d);
    let r = tc(
        d,
        &t,
        &["--pin-file", "pin", "decrypt", "-o", "-", "f.tpmc"],
    );
    assert_ok(&r, "decrypt with the PIN from a file");
    assert_eq!(r.stdout, b"one line");
    assert_eq!(lockout_counter(&sim, d), before, "no try spent");
    let r = tc_env(
        d,
        &t,
        &[("TPMCRYPT_PIN", "24\t68")],
        &["key", "create", "tab", "--pin"],
    );
    assert_one_line(&r, USAGE, &["control character"], "a tab in a new PIN");
    // Longer than any key's PIN (32 bytes): a usage error naming the file.
    fs::write(d.join("long"), format!("{}\n", "7".repeat(33))).unwrap();
    common::chmod(&d.join("long"), 0o600);
    let r = tc(
        d,
        &t,
        &["--pin-file", "long", "decrypt", "-o", "-", "f.tpmc"],
    );
    assert_one_line(
        &r,
        USAGE,
        &["long", "at most 32 bytes"],
        "decrypt, long PIN",
    );
    let r = tc(
        d,
        &t,
        &["--pin-file", "long", "key", "create", "l", "--pin"],
    );
    assert_one_line(&r, USAGE, &["long", "at most 32 bytes"], "create, long PIN");
    assert_eq!(lockout_counter(&sim, d), before);
}

#[test]
fn wrong_pin_then_dictionary_attack_lockout() {
    let dir = scratch();
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    tpm2_tool(
        &sim,
        d,
        &[
            "tpm2_dictionarylockout",
            "--setup-parameters",
            "--max-tries=3",
            "--recovery-time=600",
            "--lockout-recovery-time=600",
        ],
    );
    create_key(d, &t, "pinned", "ecc-p256", &[], true);
    create_key(d, &t, "open", "ecc-p256", &[], false);
    fs::write(d.join("a"), b"PIN-protected").unwrap();
    fs::write(d.join("b"), b"no PIN").unwrap();
    assert_ok(&plain(d, &["encrypt", "--key", "pinned", "a"]), "encrypt a");
    assert_ok(&plain(d, &["encrypt", "--key", "open", "b"]), "encrypt b");

    let attempt = |pin: &str| {
        tc_env(
            d,
            &t,
            &[("TPMCRYPT_PIN", pin)],
            &["decrypt", "-o", "-", "a.tpmc"],
        )
    };
    let r = attempt("1111");
    assert_one_line(
        &r,
        TPM,
        &["a.tpmc", "wrong PIN for this key"],
        "first wrong PIN",
    );
    assert_no_handles(&sim, d, "wrong PIN");

    // max-tries=3: the third failure exhausts the budget; from then on the
    // TPM answers with lockout, even to the right PIN.
    let mut wrong = 1;
    let lockout = loop {
        let r = attempt("1111");
        if r.stderr.contains("is in dictionary-attack lockout") {
            break r;
        }
        assert_one_line(
            &r,
            TPM,
            &["wrong PIN for this key"],
            &format!("wrong PIN #{}", wrong + 1),
        );
        wrong += 1;
        assert!(
            wrong <= 3,
            "no lockout after {wrong} wrong PINs (max-tries=3)"
        );
    };
    assert_eq!(wrong, 3, "lockout after exactly max-tries wrong PINs");
    assert_one_line(
        &lockout,
        TPM,
        &["a.tpmc", "is in dictionary-attack lockout", "600 seconds"],
        "lockout",
    );
    assert_no_handles(&sim, d, "lockout");
    let r = attempt(PIN);
    assert_one_line(
        &r,
        TPM,
        &["is in dictionary-attack lockout"],
        "right PIN during lockout",
    );
    assert!(r.stdout.is_empty());
    // Keys without a PIN are not subject to dictionary-attack protection.
    let r = tc(d, &t, &["decrypt", "-o", "-", "b.tpmc"]);
    assert_ok(&r, "no-PIN key during lockout");
    assert_eq!(r.stdout, b"no PIN");
    assert_no_handles(&sim, d, "decrypt during lockout");
}

#[test]
fn one_wrong_pin_costs_one_try_whatever_the_number_of_sessions() {
    let dir = scratch();
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    tpm2_tool(
        &sim,
        d,
        &[
            "tpm2_dictionarylockout",
            "--setup-parameters",
            "--max-tries=5",
            "--recovery-time=600",
            "--lockout-recovery-time=600",
        ],
    );
    create_key(d, &t, "pinned", "ecc-p256", &[], true);
    // Three files, each its own session (one encrypt each).
    for i in 0..3 {
        let name = format!("f{i}");
        fs::write(d.join(&name), bytes(100 + i, i as u64)).unwrap();
        assert_ok(&plain(d, &["encrypt", "--key", "pinned", &name]), "encrypt");
        fs::remove_file(d.join(&name)).unwrap();
    }
    let args = ["decrypt", "f0.tpmc", "f1.tpmc", "f2.tpmc"];
    assert_eq!(lockout_counter(&sim, d), 0);

    // A wrong TPMCRYPT_PIN: the first session's unbind fails, and the PIN
    // is not presented again for the other two.
    let r = tc_env(d, &t, &[("TPMCRYPT_PIN", "1111")], &args);
    assert_eq!(r.code, TPM, "{}", r.stderr);
    assert_eq!(
        r.stderr.matches("wrong PIN for this key").count(),
        1,
        "{}",
        r.stderr
    );
    assert_eq!(
        r.stderr.matches("refused earlier in this run").count(),
        2,
        "{}",
        r.stderr
    );
    assert_eq!(lockout_counter(&sim, d), 1, "one wrong PIN, one try");
    assert_no_handles(&sim, d, "wrong PIN over three sessions");

    // No PIN at all (no terminal, no TPMCRYPT_PIN): exit 4, no try spent.
    let r = tc(d, &t, &["decrypt", "-o", "-", "f0.tpmc"]);
    assert_one_line(&r, TPM, &["needs a PIN", "TPMCRYPT_PIN"], "no PIN");
    assert_eq!(lockout_counter(&sim, d), 1, "a missing PIN costs nothing");

    // The right PIN still works: the TPM was never locked out.
    let r = tc_env(d, &t, &[("TPMCRYPT_PIN", PIN)], &args);
    assert_ok(&r, "right PIN");
    assert_eq!(fs::read(d.join("f2")).unwrap(), bytes(102, 2));
    assert_eq!(lockout_counter(&sim, d), 1);
    for f in ["f0", "f1", "f2"] {
        fs::remove_file(d.join(f)).unwrap();
    }

    // The same key imported as having no PIN: refused once, said so, and
    // not tried again for the next session.
    let other = d.join("other-home");
    let r = tpmcrypt(d)
        .env("TPMCRYPT_HOME", &other)
        .args(["--tpm", &t, "key", "import", "--no-pin", "--name", "nopin"])
        .arg(keystore(d).join("pinned.key.pem"))
        .output()
        .expect("spawn");
    assert_ok(&r.into(), "import --no-pin");
    let r: Run = tpmcrypt(d)
        .env("TPMCRYPT_HOME", &other)
        .args(["--tpm", &t, "decrypt", "f0.tpmc", "f1.tpmc"])
        .output()
        .expect("spawn")
        .into();
    assert_eq!(r.code, TPM, "{}", r.stderr);
    assert!(
        r.stderr.contains("key nopin was refused without a PIN")
            && r.stderr.contains("import --pin"),
        "{}",
        r.stderr
    );
    assert_eq!(
        r.stderr.matches("refused earlier in this run").count(),
        1,
        "{}",
        r.stderr
    );
    assert_eq!(
        lockout_counter(&sim, d),
        2,
        "one try for the mis-imported key"
    );
    assert_no_handles(&sim, d, "mis-imported key");

    // On a terminal a refused PIN is asked for again (each typed PIN is one
    // try), and the right one opens every session.
    use std::io::Write as _;
    let cmdline = format!(
        "{} --tpm '{t}' decrypt f0.tpmc f1.tpmc f2.tpmc",
        common::bin().display()
    );
    let mut child = common::wrapper(d, "script")
        .args(["-qec", &cmdline, "/dev/null"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn script (util-linux)");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin
        .write_all(format!("1111\n{PIN}\n").as_bytes())
        .expect("type");
    let out = child.wait_with_output().expect("wait");
    drop(stdin);
    let screen = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "typed PINs: {screen}");
    assert_eq!(screen.matches("Wrong PIN").count(), 1, "{screen}");
    for (i, f) in ["f0", "f1", "f2"].iter().enumerate() {
        assert_eq!(fs::read(d.join(f)).unwrap(), bytes(100 + i, i as u64));
    }
    assert_eq!(
        lockout_counter(&sim, d),
        3,
        "one try for the one wrong typed PIN"
    );
    // One key under two names shares one PIN budget.
    let copy = d.join("pk-copy.pem");
    fs::copy(keystore(d).join("pinned.key.pem"), &copy).unwrap();
    let r: Run = tpmcrypt(d)
        .args([
            "--tpm",
            &t,
            "key",
            "import",
            "--pin",
            "--name",
            "pinned-again",
        ])
        .arg(&copy)
        .output()
        .expect("spawn")
        .into();
    assert_ok(&r, "import the same key again");
    assert!(
        r.stderr.contains("key pinned is the same TPM key"),
        "{}",
        r.stderr
    );
    for f in ["f0", "f1", "f2"] {
        fs::remove_file(d.join(f)).unwrap();
    }
    let r = tc_env(d, &t, &[("TPMCRYPT_PIN", "1111")], &args);
    assert_eq!(r.code, TPM, "{}", r.stderr);
    assert_eq!(
        lockout_counter(&sim, d),
        4,
        "one try for one key under two names"
    );
}

// ---------------------------------------------------------------- 5. TPM absent

/// `--tpm device:PATH` (or `TPMCRYPT_TCTI`) where PATH is not a character
/// device: a file, a FIFO (a disk, for a mistyped `/dev/sda`) is exit 4
/// in one line naming what it is, and is left as it was. The build before
/// handed it to tpm2-tss, which wrote a TPM command over the file's first
/// bytes, `doctor` included, and a FIFO read back its own command.
#[test]
fn a_device_tcti_that_is_not_a_device_is_never_written() {
    let dir = scratch();
    let d = dir.path();
    let notes = d.join("notes");
    fs::write(&notes, b"my precious notes\n").unwrap();
    let tcti = format!("device:{}", notes.display());
    let r = tc(d, &tcti, &["key", "create", "k"]);
    assert_one_line(&r, TPM, &["is a regular file, not a TPM"], "key create");
    let mut cmd = tpmcrypt(d);
    cmd.env("TPMCRYPT_TCTI", &tcti).args(["doctor"]);
    let r: Run = cmd.output().expect("spawn").into();
    assert_ne!(r.code, 0, "doctor: {}", r.stderr);
    assert!(
        String::from_utf8_lossy(&r.stdout).contains("is a regular file, not a TPM"),
        "doctor: {}",
        String::from_utf8_lossy(&r.stdout)
    );
    assert_eq!(fs::read(&notes).unwrap(), b"my precious notes\n");
    let fifo = d.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let r = tc(
        d,
        &format!("device:{}", fifo.display()),
        &["key", "create", "k"],
    );
    assert_one_line(&r, TPM, &["is a FIFO, not a TPM"], "key create on a FIFO");
    // A TCTI that parses but that tpm2-tss refuses is bad input (exit 2),
    // not a missing TPM (the build before: exit 1).
    for bad in ["swtpm:host=a=b,port=2", "tabrmd:bus_name=x"] {
        let r = tc(d, bad, &["key", "create", "k"]);
        assert_one_line(&r, USAGE, &["TCTI", bad], bad);
    }
    assert!(key_list(d).is_empty(), "no key made");
}

#[test]
fn absent_tpm_is_exit_4_and_names_the_simulator() {
    let dir = scratch();
    let d = dir.path();
    let closed = closed_tcti();
    for tcti in [closed.as_str(), "device:/nonexistent"] {
        let r = tc(d, tcti, &["key", "create", "k"]);
        assert_one_line(
            &r,
            TPM,
            &["--simulator"],
            &format!("key create --tpm {tcti}"),
        );
        // Also through the environment.
        let mut cmd = tpmcrypt(d);
        cmd.env("TPMCRYPT_TCTI", tcti).args(["key", "create", "k"]);
        let r: Run = cmd.output().expect("spawn").into();
        assert_one_line(&r, TPM, &["--simulator"], &format!("TPMCRYPT_TCTI={tcti}"));
    }
    assert!(key_list(d).is_empty(), "a failed create leaves no key");

    // Decrypting a file for a keystore key without its TPM.
    let sim = swtpm(d, "swtpm");
    create_key(d, &sim.tcti(), "k", "ecc-p256", &[], false);
    drop(sim);
    fs::write(d.join("f"), b"x").unwrap();
    assert_ok(&plain(d, &["encrypt", "--key", "k", "f"]), "encrypt");
    for tcti in [closed.as_str(), "device:/nonexistent"] {
        let r = tc(d, tcti, &["decrypt", "-o", "-", "f.tpmc"]);
        assert_one_line(
            &r,
            TPM,
            &["f.tpmc", "--simulator"],
            &format!("decrypt --tpm {tcti}"),
        );
    }
}

/// A TPM reached without a resource manager whose object slots are full
/// of what killed programs left (swtpm has three): the error names the
/// cause and the remedy, in one line, and once freed the run works.
#[test]
fn a_tpm_full_of_leftovers_is_named_with_its_remedy() {
    let dir = scratch();
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    create_key(d, &t, "k", "ecc-p256", &[], false);
    fs::write(d.join("f"), b"full").unwrap();
    assert_ok(&plain(d, &["encrypt", "-k", "k", "f"]), "encrypt");
    for i in 0..3 {
        tpm2_tool(
            &sim,
            d,
            &["tpm2_createprimary", "-C", "o", "-c", &format!("p{i}.ctx")],
        );
    }
    let r = tc(d, &t, &["decrypt", "-o", "-", "f.tpmc"]);
    assert_one_line(
        &r,
        TPM,
        &["no room left", "tpm2_flushcontext -t"],
        "decrypt on a full TPM",
    );
    assert!(r.stdout.is_empty());
    tpm2_tool(&sim, d, &["tpm2_flushcontext", "-t"]);
    let r = tc(d, &t, &["decrypt", "-o", "-", "f.tpmc"]);
    assert_ok(&r, "decrypt once freed");
    assert_eq!(r.stdout, b"full");
}

// ---------------------------------------------------------------- 6. other TPM

#[test]
fn key_from_another_tpm_is_refused() {
    let dir = scratch();
    let d = dir.path();
    let a = swtpm(d, "swtpm-a");
    let b = swtpm(d, "swtpm-b");
    create_key(d, &a.tcti(), "k", "ecc-p256", &[], false);
    create_key(d, &a.tcti(), "r", "rsa2048", &[], true);
    for k in ["k", "r"] {
        fs::write(d.join(k), bytes(500, 3)).unwrap();
        assert_ok(&plain(d, &["encrypt", "--key", k, k]), "encrypt");
        let r = tc_env(
            d,
            &b.tcti(),
            &[("TPMCRYPT_PIN", PIN)],
            &["decrypt", "-o", "-", &format!("{k}.tpmc")],
        );
        assert_one_line(&r, TPM, &["different TPM"], &format!("{k} on another TPM"));
        assert_no_handles(&b, d, "decrypt on the wrong TPM");
        let r = tc_env(
            d,
            &a.tcti(),
            &[("TPMCRYPT_PIN", PIN)],
            &["decrypt", "-o", "-", &format!("{k}.tpmc")],
        );
        assert_ok(&r, "decrypt on its own TPM");
        assert_eq!(r.stdout, bytes(500, 3));
    }
    assert_no_handles(&a, d, "decrypt on its own TPM");
}

// ---------------------------------------------------------------- 7. recovery

#[test]
fn recovery_recipient_decrypts_without_any_tpm() {
    let dir = scratch();
    let d = dir.path();
    let recipient = recovery(d, "recovery.key");
    let sim = swtpm(d, "swtpm");
    let r = tc(
        d,
        &sim.tcti(),
        &["key", "create", "k", "--recovery", &recipient],
    );
    assert_ok(&r, "key create --recovery");
    assert!(
        !r.stderr.contains("hint:"),
        "no recovery hint: {}",
        r.stderr
    );
    let created = parse_created(&r, "k", "ecc-p256");
    drop(sim);
    let list = key_list(d);
    assert_eq!(list[0]["recovery"], Value::from(vec![recipient.clone()]));

    let closed = closed_tcti();
    let data = bytes(70_000, 17);
    fs::write(d.join("doc"), &data).unwrap();
    let mut cmd = tpmcrypt(d);
    cmd.env("TPMCRYPT_TCTI", &closed)
        .args(["encrypt", "--key", "k", "doc"]);
    let r: Run = cmd.output().expect("spawn").into();
    assert_ok(&r, "encrypt --key k without a TPM");

    let info = inspect(d, "doc.tpmc");
    let recips = info["recipients"].as_array().expect("recipients");
    assert_eq!(recips.len(), 2, "{info}");
    let kinds: BTreeSet<&str> = recips.iter().map(|r| r["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        BTreeSet::from(["recovery-p256", "tpm-p256"]),
        "{info}"
    );
    let tpm_fp = recips.iter().find(|r| r["kind"] == "tpm-p256").unwrap();
    assert_eq!(tpm_fp["fingerprint"], created.fingerprint.as_str());

    let mut cmd = tpmcrypt(d);
    cmd.env("TPMCRYPT_TCTI", &closed).args([
        "decrypt",
        "-v",
        "-i",
        "recovery.key",
        "-o",
        "doc.out",
        "doc.tpmc",
    ]);
    let r: Run = cmd.output().expect("spawn").into();
    assert_ok(&r, "decrypt -i recovery.key with no TPM reachable");
    assert_summary(&r, 1, 1, 0, "recovery decrypt");
    assert_eq!(fs::read(d.join("doc.out")).unwrap(), data);
    // Without the recovery identity the TPM is needed, and absent.
    let mut cmd = tpmcrypt(d);
    cmd.env("TPMCRYPT_TCTI", &closed)
        .args(["decrypt", "-o", "-", "doc.tpmc"]);
    let r: Run = cmd.output().expect("spawn").into();
    assert_one_line(
        &r,
        TPM,
        &["--simulator"],
        "decrypt without recovery, no TPM",
    );
}

// ---------------------------------------------------------------- 8. interop

#[test]
fn tpm2_tools_interoperate_both_ways() {
    let dir = scratch();
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    let srk_attrs = "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|noda|restricted|decrypt";
    let flush = || {
        tpm2_tool(&sim, d, &["tpm2_flushcontext", "-t"]);
        tpm2_tool(&sim, d, &["tpm2_flushcontext", "-l"]);
        tpm2_tool(&sim, d, &["tpm2_flushcontext", "-s"]);
    };

    // tpm2-tools → tpmcrypt.
    tpm2_tool(
        &sim,
        d,
        &[
            "tpm2_createprimary",
            "-C",
            "o",
            "-g",
            "sha256",
            "-G",
            "ecc",
            "-a",
            srk_attrs,
            "-c",
            "p.ctx",
        ],
    );
    // Positive control for the leak checks: tpm2-tools without a resource
    // manager leaves the primary loaded, and tpm2_getcap sees it.
    let h = tpm_handles(&sim, d);
    assert!(
        h.iter().any(|l| l.contains("0x80")),
        "tpm2_getcap shows the primary tpm2_createprimary left: {h:?}"
    );
    flush();
    assert_no_handles(&sim, d, "tpm2_flushcontext");
    tpm2_tool(
        &sim,
        d,
        &[
            "tpm2_create",
            "-C",
            "p.ctx",
            "-G",
            "rsa2048:oaep",
            "-a",
            "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|decrypt",
            "-u",
            "k.pub",
            "-r",
            "k.priv",
        ],
    );
    flush();
    tpm2_tool(
        &sim,
        d,
        &[
            "tpm2_encodeobject",
            "-C",
            "p.ctx",
            "-u",
            "k.pub",
            "-r",
            "k.priv",
            "-o",
            "tools.pem",
        ],
    );
    flush();
    // tpm2-tools 5.4 writes emptyAuth FALSE for this key without a
    // password: ambiguous, so tpmcrypt asks rather than guess (a wrong guess
    // costs a dictionary-attack try at first use).
    let r = plain(d, &["key", "import", "tools.pem"]);
    assert_one_line(
        &r,
        USAGE,
        &["tools.pem", "emptyAuth FALSE", "--pin or --no-pin"],
        "import of an ambiguous key file",
    );
    assert!(key_list(d).is_empty(), "nothing imported");
    let r = tc(d, &t, &["key", "import", "tools.pem", "--no-pin"]);
    assert_ok(&r, "key import");
    let out = stdout(&r);
    assert!(
        out.starts_with("imported tools (rsa2048), fingerprint "),
        "{out}"
    );
    let list = key_list(d);
    assert_eq!(list[0]["name"], "tools");
    assert_eq!(list[0]["pin"], false, "a key made without -p needs no PIN");
    fs::write(d.join("m"), bytes(12_345, 8)).unwrap();
    assert_ok(
        &plain(d, &["encrypt", "--key", "tools", "m"]),
        "encrypt to the imported key",
    );
    let r = tc(d, &t, &["decrypt", "-v", "-o", "-", "m.tpmc"]);
    assert_ok(&r, "decrypt with the tpm2-tools key");
    assert_summary(&r, 1, 1, 1, "decrypt with the tpm2-tools key");
    assert_eq!(r.stdout, bytes(12_345, 8));
    assert_no_handles(&sim, d, "decrypt with the imported key");

    // tpmcrypt → tpm2-tools.
    create_key(d, &t, "ours", "rsa2048", &[], false);
    let ks = keystore(d);
    let key_pem = ks.join("ours.key.pem");
    let pub_pem = ks.join("ours.pub.pem");
    assert!(fs::read_to_string(&key_pem)
        .unwrap()
        .starts_with("-----BEGIN TSS2 PRIVATE KEY-----"));
    let secret = bytes(32, 4242);
    fs::write(d.join("secret.bin"), &secret).unwrap();
    openssl(
        d,
        &[
            "pkeyutl",
            "-encrypt",
            "-pubin",
            "-inkey",
            pub_pem.to_str().unwrap(),
            "-pkeyopt",
            "rsa_padding_mode:oaep",
            "-pkeyopt",
            "rsa_oaep_md:sha256",
            "-pkeyopt",
            "rsa_mgf1_md:sha256",
            "-in",
            "secret.bin",
            "-out",
            "ct.bin",
        ],
    );
    assert_eq!(fs::metadata(d.join("ct.bin")).unwrap().len(), 256);
    tpm2_tool(
        &sim,
        d,
        &[
            "tpm2_load",
            "-r",
            key_pem.to_str().unwrap(),
            "-c",
            "ours.ctx",
        ],
    );
    flush();
    tpm2_tool(
        &sim,
        d,
        &[
            "tpm2_rsadecrypt",
            "-c",
            "ours.ctx",
            "-s",
            "oaep",
            "-o",
            "pt.bin",
            "ct.bin",
        ],
    );
    flush();
    assert_eq!(
        fs::read(d.join("pt.bin")).unwrap(),
        secret,
        "tpm2_rsadecrypt"
    );
}

// ---------------------------------------------------------------- 10. encrypt needs no TPM

#[test]
fn encrypt_never_touches_the_tpm() {
    let dir = scratch();
    let d = dir.path();
    let state = "swtpm";
    let sim = swtpm(d, state);
    create_key(
        d,
        &sim.tcti(),
        "k",
        "ecc-p256",
        &["--pcrs", "sha256:0,7"],
        true,
    );
    create_key(d, &sim.tcti(), "r", "rsa2048", &[], false);
    drop(sim); // no TPM anywhere from here on
    let closed = closed_tcti();
    fs::write(d.join("x"), bytes(5000, 1)).unwrap();
    fs::write(d.join("y"), bytes(6000, 2)).unwrap();
    // Neither a TPM nor the PIN is needed to encrypt (stdin is not a terminal).
    let mut cmd = tpmcrypt(d);
    cmd.env("TPMCRYPT_TCTI", &closed)
        .args(["encrypt", "--key", "k", "--key", "r", "x"]);
    let r: Run = cmd.output().expect("spawn").into();
    assert_ok(&r, "encrypt with TPMCRYPT_TCTI at a closed port");
    assert!(r.stderr.is_empty(), "encrypt is silent: {}", r.stderr);
    let r = tc(d, "device:/nonexistent", &["encrypt", "--key", "k", "y"]);
    assert_ok(&r, "encrypt with --tpm device:/nonexistent");
    assert_eq!(
        inspect(d, "x.tpmc")["recipients"].as_array().unwrap().len(),
        2
    );

    // The same TPM again (same state, new ports): the files decrypt.
    let sim = swtpm(d, state);
    let r = tc_env(
        d,
        &sim.tcti(),
        &[("TPMCRYPT_PIN", PIN)],
        &["decrypt", "-v", "-o", "-", "y.tpmc"],
    );
    assert_ok(&r, "decrypt y after the TPM restarted");
    assert_summary(&r, 1, 1, 1, "decrypt y");
    assert_eq!(r.stdout, bytes(6000, 2));
    let r = tc_env(
        d,
        &sim.tcti(),
        &[("TPMCRYPT_PIN", PIN)],
        &["decrypt", "-v", "-o", "-", "x.tpmc"],
    );
    assert_ok(&r, "decrypt x (two TPM recipients) after the TPM restarted");
    assert_summary(&r, 1, 1, 1, "decrypt x");
    assert_eq!(r.stdout, bytes(5000, 1));
}

// ---------------------------------------------------------------- 11. delete

#[test]
fn key_delete_needs_yes_without_a_terminal() {
    let dir = scratch();
    let d = dir.path();
    // A per-command private simulator is enough here.
    let r = plain(d, &["--simulator", "key", "create", "k"]);
    assert_ok(&r, "key create --simulator");
    assert!(r.stderr.contains("NOT secure"), "{}", r.stderr);
    fs::write(d.join("f"), b"simulated").unwrap();
    assert_ok(&plain(d, &["encrypt", "--key", "k", "f"]), "encrypt");
    let r = plain(d, &["--simulator", "decrypt", "-o", "-", "f.tpmc"]);
    assert_ok(&r, "decrypt --simulator (state kept between commands)");
    assert_eq!(r.stdout, b"simulated");

    let ks = keystore(d);
    let files = ["k.key.pem", "k.pub.pem", "k.json"];
    let r = plain(d, &["key", "delete", "k"]);
    assert_eq!(r.code, USAGE, "delete without --yes: {}", r.stderr);
    assert!(r.stderr.contains("--yes"), "{}", r.stderr);
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    for f in files {
        assert!(ks.join(f).exists(), "{f} kept");
    }
    assert_eq!(key_list(d).len(), 1);

    let r = plain(d, &["key", "delete", "k", "--yes"]);
    assert_ok(&r, "delete --yes");
    for f in files {
        assert!(!ks.join(f).exists(), "{f} removed");
    }
    assert!(key_list(d).is_empty());
    let r = plain(d, &["--simulator", "decrypt", "-o", "-", "f.tpmc"]);
    assert_ne!(r.code, OK, "no key, no plaintext");
    assert!(r.stdout.is_empty());
    let r = plain(d, &["key", "delete", "k", "--yes"]);
    assert_eq!(r.code, USAGE, "deleting a missing key: {}", r.stderr);

    // Standard output closed: nothing is done (the build before made the
    // key, then failed). Full: the key is made, and the error says so
    // (before: a bare write error, and a retry found the key there).
    let r = common::run_with_stdout_closed(d, "--simulator key create kc");
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("standard output is closed"),
        "{}",
        r.stderr
    );
    assert!(key_list(d).is_empty(), "a key made with stdout closed");
    let full = || {
        fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap()
    };
    let r: Run = tpmcrypt(d)
        .args(["--simulator", "key", "create", "kf"])
        .stdout(full())
        .output()
        .unwrap()
        .into();
    assert_eq!(r.code, 1, "{}", r.stderr);
    let last = r.stderr.lines().last().unwrap_or("");
    assert!(
        last.starts_with("error: key kf was created; only its report failed: <stdout>")
            && last.contains("No space left"),
        "{}",
        r.stderr
    );
    assert_eq!(key_list(d).len(), 1, "kf made");
    let r: Run = tpmcrypt(d)
        .args(["key", "delete", "kf", "--yes"])
        .stdout(full())
        .output()
        .unwrap()
        .into();
    assert_one_line(
        &r,
        1,
        &["key kf was deleted", "only its report failed"],
        "delete > /dev/full",
    );
    assert!(key_list(d).is_empty(), "kf deleted");
}

/// `tpmcrypt ARGS…` under strace, with `action` (`delay_enter=US`,
/// `signal=SIGKILL:when=N`) injected at its renames.
fn at_renames(d: &Path, action: &str, args: &[&str]) -> Command {
    let mut cmd = common::wrapper(d, "strace");
    cmd.args(["-f", "-qq", "-o", "/dev/null"])
        .args(["-e", "trace=rename,renameat,renameat2"])
        .args(["-e", &format!("inject=rename,renameat,renameat2:{action}")])
        .arg(common::bin())
        .args(args);
    cmd
}

/// The keystore's writes are locked and committed as one. Two `key create`
/// of one name at once (the first held in its renames by strace): one
/// key, one "exists already", and a file encrypted to the key that was
/// reported made decrypts. Then `key create --force` killed at each of its
/// renames: the old key or the new one, each with its own metadata, never
/// the old key file beside the new key's metadata (which dropped the old
/// key's recovery recipient from every file encrypted after). A delete cut
/// short is finished by deleting again.
#[test]
fn keystore_writes_are_locked_and_never_half_done() {
    let dir = scratch();
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let tcti = sim.tcti();
    let ks = keystore(d);
    let temporaries = || -> Vec<String> {
        fs::read_dir(&ks)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.contains(".tmp"))
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_ok(&tc(d, &tcti, &["key", "create", "first"]), "key create");
    let slow = at_renames(
        d,
        "delay_enter=400000",
        &["--tpm", &tcti, "key", "create", "dup"],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("strace");
    let deadline = Instant::now() + Duration::from_secs(30);
    while temporaries().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the slow run never wrote its files"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let fast = tc(d, &tcti, &["key", "create", "dup"]);
    let slow: Run = slow.wait_with_output().expect("wait").into();
    let (won, lost) = if slow.code == OK {
        (&slow, &fast)
    } else {
        (&fast, &slow)
    };
    assert_ok(won, "one key create");
    assert_eq!(lost.code, 1, "the other: {}", lost.stderr);
    assert!(lost.stderr.contains("exists"), "{}", lost.stderr);
    let made = parse_created(won, "dup", "ecc-p256");
    let listed = key_list(d);
    let dup = listed
        .iter()
        .find(|k| k["name"] == "dup")
        .expect("dup listed");
    assert_eq!(dup["fingerprint"], made.fingerprint.as_str(), "{listed:?}");
    fs::write(d.join("f"), b"kept").unwrap();
    assert_ok(&plain(d, &["encrypt", "-k", "dup", "f"]), "encrypt -k dup");
    let r = tc(d, &tcti, &["decrypt", "-o", "-", "f.tpmc"]);
    assert_ok(&r, "decrypt with the key reported made");
    assert_eq!(r.stdout, b"kept");

    // `key create --force` killed at its 1st … 4th rename.
    let recipient = recovery(d, "recovery.key");
    for when in 1..=4 {
        let name = format!("k{when}");
        let old = create_key(
            d,
            &tcti,
            &name,
            "ecc-p256",
            &["--recovery", &recipient],
            false,
        );
        let kill = format!("signal=SIGKILL:when={when}");
        let args = ["--tpm", &tcti, "key", "create", "--force", "--yes", &name];
        let killed = at_renames(d, &kill, &args).output().expect("strace");
        assert!(!killed.status.success(), "rename {when}: not killed");
        let listed = key_list(d);
        let k = listed
            .iter()
            .find(|k| k["name"] == name.as_str())
            .expect("listed");
        let is_old = k["fingerprint"] == old.fingerprint.as_str();
        let want: Vec<Value> = if is_old {
            vec![Value::from(recipient.clone())]
        } else {
            vec![]
        };
        assert_eq!(k["recovery"], Value::from(want), "rename {when}: {k}");
        let file = format!("g{when}");
        fs::write(d.join(&file), b"g").unwrap();
        let r = plain(d, &["encrypt", "-k", &name, &file]);
        assert_ok(&r, &format!("rename {when}: encrypt -k"));
        let info = inspect(d, &format!("{file}.tpmc"));
        let n = info["recipients"].as_array().expect("recipients").len();
        assert_eq!(n, if is_old { 2 } else { 1 }, "rename {when}: {info}");
        // The next write finds nothing left over.
        assert_ok(
            &tc(d, &tcti, &["key", "create", &format!("z{when}")]),
            "key create",
        );
        assert_eq!(temporaries(), Vec::<String>::new(), "rename {when}");
    }

    // A delete cut short after the key file: the rest goes on `key delete`.
    fs::remove_file(ks.join("first.key.pem")).unwrap();
    let r = plain(d, &["key", "delete", "first"]);
    assert_ok(&r, "key delete of what was left");
    assert!(!ks.join("first.json").exists() && !ks.join("first.pub.pem").exists());
    let r = plain(d, &["key", "delete", "first", "--yes"]);
    assert_eq!(r.code, USAGE, "nothing left: {}", r.stderr);
    drop(sim);
}

/// Readers see one version of a key, and a save cut short is finished
/// wherever the key is next used. A reader waits for a writer holding the
/// keystore's lock (it read the old key file beside the new metadata, and
/// `encrypt -k` failed with "changed by something other than tpmcrypt").
/// A `key create` killed between its renames leaves a key that `encrypt -k`
/// finds (it said "no key named") and that `key delete` does not remove
/// without a confirmation (it was taken for leftovers and deleted). A
/// commit record naming a symlink is refused, and the key file kept.
/// `key add-policy` reading a FIFO does not hold the lock.
#[test]
fn keystore_readers_and_interrupted_saves() {
    let dir = scratch();
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let tcti = sim.tcti();
    let ks = keystore(d);
    create_key(d, &tcti, "k", "ecc-p256", &[], false);
    fs::write(d.join("f"), b"f").unwrap();

    // A writer holds the lock: the reader says it waits, and does, until
    // the writer lets go.
    let holder = common::HeldLock::take(&ks.join(".lock"));
    let mut reader = tpmcrypt(d)
        .args(["encrypt", "-k", "k", "-o", "f1.tpmc", "f"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let said = common::StderrLines::of(&mut reader);
    assert!(
        said.wait_for("waiting for", Duration::from_secs(30)),
        "no wait said"
    );
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        reader.try_wait().expect("try_wait").is_none(),
        "did not wait for the writer"
    );
    assert!(
        !d.join("f1.tpmc").exists(),
        "wrote while the writer held the lock"
    );
    drop(holder);
    let r = said.finished_by(
        reader,
        Instant::now() + Duration::from_secs(30),
        "encrypt -k",
    );
    assert_ok(&r, "encrypt -k");

    // `key create n` killed at its 3rd rename: record and n.json there.
    let killed = at_renames(
        d,
        "signal=SIGKILL:when=3",
        &["--tpm", &tcti, "key", "create", "n"],
    )
    .output()
    .expect("strace");
    assert!(!killed.status.success());
    assert!(ks.join(".n.commit").exists() && !ks.join("n.key.pem").exists());
    let r = plain(d, &["key", "delete", "n"]);
    assert_eq!(r.code, USAGE, "a key, not leftovers: {}", r.stderr);
    assert_ok(
        &plain(d, &["encrypt", "-k", "n", "-o", "f2.tpmc", "f"]),
        "encrypt -k n",
    );
    assert!(ks.join("n.key.pem").exists() && !ks.join(".n.commit").exists());

    // A record that names a symlink as a temporary: refused, key kept.
    let key = fs::read(ks.join("k.key.pem")).unwrap();
    fs::write(d.join("victim"), b"not a key").unwrap();
    let tmp = ".k.key.pem.tmp2.0123456789abcdef";
    std::os::unix::fs::symlink(d.join("victim"), ks.join(tmp)).unwrap();
    fs::write(
        ks.join(".k.commit"),
        format!("{{\"renames\":[[\"{tmp}\",\"k.key.pem\"]]}}"),
    )
    .unwrap();
    common::chmod(&ks.join(".k.commit"), 0o600);
    let r = plain(d, &["encrypt", "-k", "k", "-o", "f3.tpmc", "f"]);
    assert_ne!(r.code, OK);
    assert!(
        r.stderr.contains("damaged record") && r.stderr.contains("remove it"),
        "{}",
        r.stderr
    );
    assert_eq!(fs::read(ks.join("k.key.pem")).unwrap(), key);
    fs::remove_file(ks.join(".k.commit")).unwrap();
    fs::remove_file(ks.join(tmp)).unwrap();

    // add-policy held on a FIFO does not hold the keystore.
    let fifo = d.join("policy.fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let mut stuck = tpmcrypt(d)
        .args(["key", "add-policy", "k", fifo.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("add-policy");
    std::thread::sleep(Duration::from_millis(300));
    let child = tpmcrypt(d)
        .args(["--tpm", &tcti, "key", "create", "y"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("key create");
    let r = common::finished_by(
        child,
        Instant::now() + Duration::from_secs(20),
        "key create",
    );
    let _ = stuck.kill();
    let _ = stuck.wait();
    assert_ok(&r, "key create while add-policy waits on a FIFO");
    drop(sim);
}

// ---------------------------------------------------------------- fallback

/// A keystore key the TPM refuses (PCRs changed) or that would need a PIN
/// nobody can give must not hide another keystore key the file is also
/// encrypted to.
#[test]
fn a_refused_key_does_not_block_another_recipient() {
    let dir = scratch();
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    // Keys are tried in name order: the troublesome ones come first.
    create_key(d, &t, "a-boot", "ecc-p256", &["--pcrs", "sha256:7"], false);
    create_key(d, &t, "b-pin", "ecc-p256", &[], true);
    create_key(d, &t, "z-plain", "ecc-p256", &[], false);
    fs::write(d.join("p"), bytes(2000, 21)).unwrap();
    fs::write(d.join("q"), bytes(2100, 22)).unwrap();
    assert_ok(
        &plain(d, &["encrypt", "--key", "a-boot", "--key", "z-plain", "p"]),
        "encrypt p",
    );
    assert_ok(
        &plain(d, &["encrypt", "--key", "b-pin", "--key", "z-plain", "q"]),
        "encrypt q",
    );
    tpm2_tool(
        &sim,
        d,
        &[
            "tpm2_pcrextend",
            "7:sha256=00000000000000000000000000000000000000000000000000000000000000bb",
        ],
    );
    let r = tc(d, &t, &["decrypt", "-o", "-", "p.tpmc"]);
    assert_ok(&r, "PCR-bound key refused, the other key opens p");
    assert_eq!(r.stdout, bytes(2000, 21));
    // No TPMCRYPT_PIN and no terminal: the key without a PIN opens q.
    let r = tc(d, &t, &["decrypt", "-o", "-", "q.tpmc"]);
    assert_ok(&r, "PIN unavailable, the other key opens q");
    assert_eq!(r.stdout, bytes(2100, 22));
    assert_no_handles(&sim, d, "fallback decrypts");
    // With only the refused key, its own error is reported.
    assert_ok(&plain(d, &["key", "delete", "z-plain", "--yes"]), "delete");
    let r = tc(d, &t, &["decrypt", "-o", "-", "p.tpmc"]);
    assert_one_line(&r, TPM, &["p.tpmc", "PCR"], "only the refused key left");
}

/// `watch --key NAME` encrypts with the keystore key's public half (no TPM
/// in the daemon) plus its recovery recipient; the TPM decrypts the whole
/// run's files with one unbind, and the recovery key alone opens them too.
#[test]
fn key_create_recovery_file_records_every_recipient() {
    let dir = scratch();
    let d = dir.path();
    let r1 = recovery(d, "r1.key");
    let r2 = recovery(d, "r2.key");
    fs::write(d.join("rec.txt"), format!("# team\n{r1}\n\n{r2}\n")).unwrap();
    let r = plain(
        d,
        &["--simulator", "key", "create", "k", "--recovery", "rec.txt"],
    );
    assert_ok(&r, "key create --recovery FILE");
    let list = key_list(d);
    assert_eq!(
        list[0]["recovery"],
        serde_json::json!([r1, r2]),
        "every line of the file is recorded"
    );
    fs::write(d.join("m"), bytes(777, 1)).unwrap();
    assert_ok(
        &plain(d, &["encrypt", "--key", "k", "m"]),
        "encrypt --key k",
    );
    assert_eq!(
        inspect(d, "m.tpmc")["recipients"].as_array().unwrap().len(),
        3
    );
    let r = plain(d, &["decrypt", "-i", "r2.key", "-o", "-", "m.tpmc"]);
    assert_ok(&r, "the second recovery recipient alone");
    assert_eq!(r.stdout, bytes(777, 1));

    // A bad line, or a PEM key (not a recovery recipient): no key is made.
    let pem = stdout(&plain(d, &["key", "export", "k"]));
    // The key's PEM in a recipients file with a recovery line: the TPM
    // opens the file, and so does the recovery key.
    fs::write(
        d.join("team.txt"),
        format!("# the key\n{pem}\n# backup\n{r1}\n"),
    )
    .unwrap();
    assert_ok(
        &plain(d, &["encrypt", "-R", "team.txt", "-o", "t.tpmc", "m"]),
        "encrypt -R with the key's PEM",
    );
    assert_eq!(
        inspect(d, "t.tpmc")["recipients"].as_array().unwrap().len(),
        2
    );
    let r = plain(d, &["--simulator", "-v", "decrypt", "-o", "-", "t.tpmc"]);
    assert_ok(&r, "the TPM key opens it");
    assert_summary(&r, 1, 1, 1, "the TPM key opens it");
    assert_eq!(r.stdout, bytes(777, 1));
    let r = plain(d, &["decrypt", "-i", "r1.key", "-o", "-", "t.tpmc"]);
    assert_ok(&r, "the recovery line of the file opens it");
    assert_eq!(r.stdout, bytes(777, 1));
    for (what, text, line) in [
        ("a bad line", format!("{r1}\n# c\n{r2}x\n"), "line 3"),
        ("a public key", format!("{r1}\n{pem}"), "line 2"),
    ] {
        fs::write(d.join("bad.txt"), text).unwrap();
        let r = plain(
            d,
            &[
                "--simulator",
                "key",
                "create",
                "k2",
                "--recovery",
                "bad.txt",
            ],
        );
        assert_one_line(&r, USAGE, &["bad.txt", line], what);
        assert_eq!(key_list(d).len(), 1, "{what}: a key was created");
    }
}

/// Makes a key with tpm2-tools under the primary in `parent` and encodes it
/// as `NAME.pem` (the tools leave objects loaded: flushed after each step).
fn tools_key(sim: &Simulator, d: &Path, name: &str, parent: &str, alg: &str, attrs: &str) {
    let flush = || {
        for what in ["-t", "-l", "-s"] {
            tpm2_tool(sim, d, &["tpm2_flushcontext", what]);
        }
    };
    let (public, private, pem) = (
        format!("{name}.pub"),
        format!("{name}.priv"),
        format!("{name}.pem"),
    );
    tpm2_tool(
        sim,
        d,
        &[
            "tpm2_create",
            "-C",
            parent,
            "-G",
            alg,
            "-a",
            attrs,
            "-u",
            &public,
            "-r",
            &private,
        ],
    );
    flush();
    tpm2_tool(
        sim,
        d,
        &[
            "tpm2_encodeobject",
            "-C",
            parent,
            "-u",
            &public,
            "-r",
            &private,
            "-o",
            &pem,
        ],
    );
    flush();
}

#[test]
fn key_import_refuses_keys_that_could_never_unbind() {
    let dir = scratch();
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    let srk_attrs = "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|noda|restricted|decrypt";
    let attrs = "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|decrypt";
    let primary = |ctx: &str, extra: &[&str]| {
        let mut args = vec!["tpm2_createprimary", "-C", "o", "-g", "sha256", "-G", "ecc"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["-c", ctx]);
        tpm2_tool(&sim, d, &args);
        for what in ["-t", "-l", "-s"] {
            tpm2_tool(&sim, d, &["tpm2_flushcontext", what]);
        }
    };
    // The standard storage key, and a primary from tpm2_createprimary's own
    // default template (no noDA): another key altogether.
    primary("p.ctx", &["-a", srk_attrs]);
    primary("other.ctx", &[]);

    // (name, parent, tpm2_create -G, -a, exit code, words of the error)
    type Case<'a> = (&'a str, &'a str, &'a str, &'a str, i32, &'a [&'a str]);
    let refused: &[Case] = &[
        (
            "oaep-sha1",
            "p.ctx",
            "rsa2048:oaep-sha1",
            attrs,
            USAGE,
            &["OAEP", "SHA1"],
        ),
        ("rsaes", "p.ctx", "rsa2048:rsaes", attrs, USAGE, &["PKCS#1"]),
        (
            "rsa-sign",
            "p.ctx",
            "rsa2048:rsassa",
            "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|sign",
            USAGE,
            &["decrypt"],
        ),
        (
            "ecc-sign",
            "p.ctx",
            "ecc256:ecdsa",
            "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|sign",
            USAGE,
            &["decrypt"],
        ),
        ("p384", "p.ctx", "ecc384:ecdh", attrs, USAGE, &["P-256"]),
        ("rsa3072", "p.ctx", "rsa3072:oaep", attrs, USAGE, &["2048"]),
        (
            "storage",
            "p.ctx",
            "rsa2048:null:aes128cfb",
            "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|restricted|decrypt",
            USAGE,
            &["restricted"],
        ),
        (
            "no-auth",
            "p.ctx",
            "ecc256:null",
            "fixedtpm|fixedparent|sensitivedataorigin|decrypt",
            USAGE,
            &["authoriz"],
        ),
        (
            "other-parent",
            "other.ctx",
            "rsa2048:oaep",
            attrs,
            TPM,
            &["storage key"],
        ),
    ];
    for (name, parent, alg, a, code, needles) in refused {
        tools_key(&sim, d, name, parent, alg, a);
        let r = tc(
            d,
            &t,
            &["key", "import", &format!("{name}.pem"), "--no-pin"],
        );
        assert_one_line(&r, *code, needles, name);
        assert!(r.stdout.is_empty(), "{name}");
        assert_no_handles(&sim, d, &format!("import of {name}"));
    }
    assert!(key_list(d).is_empty(), "a refused key was stored");
    // The same key file put into the keystore by hand: encrypting to it is
    // refused too (nothing could ever decrypt the file), as a damaged
    // keystore entry (exit 1) with the reason.
    let hand = keystore(d).join("hand.key.pem");
    fs::create_dir_all(keystore(d)).unwrap();
    common::chmod(&keystore(d), 0o700);
    fs::copy(d.join("oaep-sha1.pem"), &hand).unwrap();
    common::chmod(&hand, 0o600);
    fs::write(d.join("m"), b"data").unwrap();
    let r = plain(d, &["encrypt", "--key", "hand", "m"]);
    assert_one_line(
        &r,
        1,
        &["hand.key.pem", "OAEP-SHA1"],
        "encrypt --key to a hand-placed key",
    );
    assert!(!d.join("m.tpmc").exists(), "a file was encrypted to it");
    fs::remove_file(&hand).unwrap();

    // What tpmcrypt does unbind with is imported, and decrypts.
    let accepted = [
        ("rsa-null", "rsa2048:null"),
        ("rsa-oaep", "rsa2048:oaep"),
        ("ecc-null", "ecc256:null"),
        ("ecc-ecdh", "ecc256:ecdh"),
        ("ecc-ecdh-sha1", "ecc256:ecdh-sha1"),
    ];
    for (i, (name, alg)) in accepted.iter().enumerate() {
        tools_key(&sim, d, name, "p.ctx", alg, attrs);
        assert_ok(
            &tc(
                d,
                &t,
                &["key", "import", &format!("{name}.pem"), "--no-pin"],
            ),
            &format!("import {name}"),
        );
        let plain_name = format!("m-{name}");
        fs::write(d.join(&plain_name), bytes(100 + i, i as u64)).unwrap();
        assert_ok(
            &plain(d, &["encrypt", "--key", name, &plain_name]),
            &format!("encrypt to {name}"),
        );
        let r = tc(
            d,
            &t,
            &["decrypt", "-o", "-", &format!("{plain_name}.tpmc")],
        );
        assert_ok(&r, &format!("decrypt with {name}"));
        assert_eq!(r.stdout, bytes(100 + i, i as u64), "{name}");
    }
    assert_eq!(key_list(d).len(), accepted.len());
    // Without the TPM, nothing shows that the key loads: not imported.
    let r = tc(
        d,
        &closed_tcti(),
        &[
            "key",
            "import",
            "rsa-null.pem",
            "--name",
            "later",
            "--no-pin",
        ],
    );
    assert_one_line(&r, TPM, &["unreachable"], "import without a TPM");
    assert_eq!(key_list(d).len(), accepted.len(), "imported without a TPM");
    // A key file is read once, and only so far: through a pipe (the build
    // before read it twice, so the keystore's read found nothing), and
    // never /dev/zero until memory runs out (as it did before).
    let pem = fs::read(d.join("ecc-null.pem")).unwrap();
    let mut cmd = tpmcrypt(d);
    cmd.env("TPMCRYPT_TCTI", &t)
        .args(["key", "import", "/dev/stdin", "--name", "piped", "--no-pin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn");
    {
        use std::io::Write as _;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(&pem).unwrap();
    }
    let r = common::finished_by(
        child,
        Instant::now() + Duration::from_secs(30),
        "import from a pipe",
    );
    assert_ok(&r, "import from a pipe");
    assert_eq!(
        key_list(d).len(),
        accepted.len() + 1,
        "imported from a pipe"
    );
    let r = common::run_within(
        d,
        &[
            "--tpm",
            &t,
            "key",
            "import",
            "/dev/zero",
            "--name",
            "z",
            "--no-pin",
        ],
        20,
    );
    assert_one_line(&r, USAGE, &["/dev/zero", "too large"], "import /dev/zero");
    // No import spent a dictionary-attack try.
    let props = tpm2_tool(&sim, d, &["tpm2_getcap", "properties-variable"]);
    assert!(
        props.contains("TPM2_PT_LOCKOUT_COUNTER: 0x0"),
        "lockout counter moved: {props}"
    );
}

#[test]
fn watch_with_a_keystore_key() {
    let dir = scratch();
    let d = dir.path();
    let rec = recovery(d, "rec.key");
    let r = plain(
        d,
        &["--simulator", "key", "create", "k", "--recovery", &rec],
    );
    assert_ok(&r, "key create --simulator --recovery");
    let (src, out) = (d.join("src"), d.join("out"));
    fs::create_dir_all(&src).unwrap();
    fs::create_dir_all(&out).unwrap();
    let mut daemon = tpmcrypt(d)
        // A closed TPM: the daemon must not need one.
        .env("TPMCRYPT_TCTI", closed_tcti())
        .args([
            "watch", "src", "--out", "out", "--key", "k", "--settle", "10ms",
        ])
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn watch");
    let names: Vec<String> = (0..5).map(|i| format!("f{i}")).collect();
    // Give the watcher time to arm, then drop the files.
    std::thread::sleep(Duration::from_millis(500));
    for (i, n) in names.iter().enumerate() {
        fs::write(src.join(n), bytes(1000 + i, i as u64)).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !names.iter().all(|n| out.join(format!("{n}.tpmc")).exists()) {
        assert!(Instant::now() < deadline, "watch did not encrypt the files");
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: signalling our own child.
    unsafe {
        libc::kill(daemon.id() as i32, libc::SIGTERM);
    }
    assert!(
        daemon.wait().expect("wait").success(),
        "watch exits 0 on SIGTERM"
    );

    let v = inspect(d, "out/f0.tpmc");
    let kinds: BTreeSet<String> = v["recipients"]
        .as_array()
        .expect("recipients")
        .iter()
        .map(|r| r["kind"].as_str().expect("kind").to_string())
        .collect();
    assert_eq!(
        kinds,
        BTreeSet::from(["recovery-p256".to_string(), "tpm-p256".to_string()])
    );
    let r = plain(d, &["--simulator", "-v", "decrypt", "-r", "out"]);
    assert_ok(&r, "decrypt the daemon's output");
    assert_summary(&r, names.len(), 1, 1, "one daemon run is one session");
    for (i, n) in names.iter().enumerate() {
        assert_eq!(
            fs::read(out.join(n)).unwrap(),
            bytes(1000 + i, i as u64),
            "{n}"
        );
    }
    let r = plain(d, &["decrypt", "-i", "rec.key", "-o", "-", "out/f3.tpmc"]);
    assert_ok(&r, "recovery key alone");
    assert_eq!(r.stdout, bytes(1003, 3));
}

/// The agent's connections a run made, as strace saw them (`connect` calls
/// to its socket), and the run itself.
fn agent_connects(dir: &Path, args: &[&str]) -> (usize, Vec<u8>) {
    let log = dir.join("strace-connect.log");
    let out = common::wrapper(dir, "strace")
        .args(["-f", "-qq", "-o"])
        .arg(&log)
        .args(["-e", "trace=connect"])
        .arg(common::bin())
        .args(args)
        .output()
        .expect("strace (installed by scripts/setup-deps)");
    assert!(
        out.status.success(),
        "{args:?} under strace: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = fs::read_to_string(&log).unwrap();
    fs::remove_file(&log).unwrap();
    let n = common::calls_made(&text)
        .filter(|l| l.contains(".tpmcrypt-agent.sock"))
        .count();
    (n, out.stdout)
}

/// A per-process decrypt asks the agent what it needs and nothing more:
/// the first request (GET of the session key) is also what tells whether
/// an agent answers there, with no PING before it. A TPM-key decrypt whose
/// key the agent holds connects once (served by the front); one whose key
/// it lacks three times: the front's GET, then tpmcrypt-full's GET and its
/// PUT of the key the TPM unwrapped (the front hands over with the same
/// arguments and environment, so tpmcrypt-full cannot know the answer; a
/// round trip beside an unbind), and the next decrypt of that session
/// finds it. A recovery key unwraps in memory before the agent is asked:
/// it never connects, whether the agent has the key or not.
#[test]
fn a_decrypt_asks_the_agent_once_for_its_key() {
    let dir = scratch();
    let d = dir.path();
    let r = recovery(d, "id");
    assert_ok(
        &plain(d, &["--simulator", "key", "create", "k"]),
        "key create",
    );
    fs::write(d.join("f"), bytes(16 << 10, 5)).unwrap();
    assert_ok(&plain(d, &["encrypt", "-R", &r, "-k", "k", "f"]), "encrypt");
    let agent = AgentProc::start(d);
    let recovery_args = ["decrypt", "-i", "id", "-o", "-", "f.tpmc"];
    let tpm_args = ["--simulator", "decrypt", "-o", "-", "f.tpmc"];
    for (args, want, what) in [
        (
            &recovery_args[..],
            0,
            "a recovery key, the agent lacking the key",
        ),
        (&tpm_args[..], 3, "the TPM key, the agent lacking the key"),
        (
            &tpm_args[..],
            1,
            "the TPM key, the agent holding the key (GET)",
        ),
        (
            &recovery_args[..],
            0,
            "a recovery key, the agent holding the key",
        ),
    ] {
        let (n, out) = agent_connects(d, args);
        assert_eq!(out, bytes(16 << 10, 5), "decrypt with {what}");
        assert_eq!(n, want, "connections with {what}");
    }
    let r = plain(d, &["agent", "--stop"]);
    assert_ok(&r, "agent --stop");
    assert!(agent.wait_exit(), "the agent exits when stopped");
}

/// `encrypt` asks the agent for its current session without a PING first:
/// the first run of a scope connects twice (SESSION_GET finds none, then
/// SESSION_OFFER of its new session), the next one once (it joins); and the
/// files of both decrypt with one unwrap.
#[test]
fn an_encrypt_asks_the_agent_once_for_its_session() {
    let dir = scratch();
    let d = dir.path();
    let r = recovery(d, "id");
    fs::write(d.join("a"), bytes(4000, 1)).unwrap();
    fs::write(d.join("b"), bytes(4000, 2)).unwrap();
    let agent = AgentProc::start(d);
    let (first, _) = agent_connects(d, &["encrypt", "-R", &r, "a"]);
    assert_eq!(
        first, 2,
        "connections of the first encrypt (SESSION_GET, SESSION_OFFER)"
    );
    let (next, _) = agent_connects(d, &["encrypt", "-R", &r, "b"]);
    assert_eq!(
        next, 1,
        "connections of an encrypt that joins (SESSION_GET)"
    );
    let stop = plain(d, &["agent", "--stop"]);
    assert_ok(&stop, "agent --stop");
    assert!(agent.wait_exit(), "the agent exits when stopped");
    fs::remove_file(d.join("a")).unwrap();
    fs::remove_file(d.join("b")).unwrap();
    let r = plain(d, &["decrypt", "-v", "-i", "id", "a.tpmc", "b.tpmc"]);
    assert_ok(&r, "decrypt both");
    assert_summary(&r, 2, 1, 0, "two files of one session");
    assert_eq!(fs::read(d.join("a")).unwrap(), bytes(4000, 1));
    assert_eq!(fs::read(d.join("b")).unwrap(), bytes(4000, 2));
}

/// A key name that is not one, or that names no key, is bad input: exit 2,
/// one line, the name escaped. The build before gave exit 1 for these
/// (and printed a newline in a name as it was).
#[test]
fn bad_and_missing_key_names_are_usage_errors() {
    let dir = scratch();
    let d = dir.path();
    for name in ["../evil", ".x", "a\nb", &"n".repeat(65)] {
        let r = plain(d, &["key", "create", name]);
        assert_one_line(
            &r,
            USAGE,
            &["invalid key name"],
            &format!("create {name:?}"),
        );
    }
    fs::write(d.join("k.pem"), b"x").unwrap();
    let r = plain(d, &["key", "import", "k.pem", "--name", "my key"]);
    assert_one_line(&r, USAGE, &["invalid key name"], "import as 'my key'");

    for args in [
        &["key", "show", "nokey"][..],
        &["key", "export", "nokey"][..],
        &["key", "add-policy", "nokey", "k.pem"][..],
    ] {
        let r = plain(d, args);
        assert_one_line(&r, USAGE, &["no key named", "nokey"], &format!("{args:?}"));
    }
    // None of these made the keystore directory (the build before made
    // it, and a lock file in it, for commands that only read).
    fs::write(d.join("p"), b"p").unwrap();
    let r = plain(d, &["encrypt", "-k", "nokey", "p"]);
    assert_eq!(r.code, USAGE, "{}", r.stderr);
    assert_ok(&plain(d, &["key", "list"]), "key list");
    assert!(!keystore(d).exists(), "a keystore made by reading it");
}

/// `--simulator` runs on one keystore at the same moment take turns with
/// its software TPM. The build before started a second swtpm on the same
/// state, which failed at once (exit 1, "Could not lock access to
/// lockfile", with a literal `\n` in the line): one of five or six runs
/// started together.
#[test]
fn simulator_runs_on_one_keystore_take_turns() {
    let dir = scratch();
    let d = dir.path();
    let held = Simulator::start(&keystore(d).join("simulator")).expect("swtpm");
    let spawn = |name: &str| {
        tpmcrypt(d)
            .args(["--simulator", "key", "create", name])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn")
    };
    let waiting = spawn("first");
    std::thread::sleep(Duration::from_millis(1000));
    drop(held);
    let r = common::finished_by(waiting, Instant::now() + Duration::from_secs(30), "first");
    assert_ok(&r, "key create while another process had the simulator");
    let runs: Vec<_> = (0..6).map(|i| spawn(&format!("k{i}"))).collect();
    for (i, child) in runs.into_iter().enumerate() {
        let r = common::finished_by(child, Instant::now() + Duration::from_secs(60), "k");
        assert_ok(&r, &format!("k{i}, six at once"));
    }
    assert_eq!(key_list(d).len(), 7);
}

/// A keystore of `dir` holding one key file, `k.key.pem` (not a key: what
/// a `key delete k` removes), for the tests of its lock.
fn keystore_with_a_key_file(dir: &Path) -> PathBuf {
    let ks = keystore(dir);
    fs::create_dir_all(&ks).unwrap();
    common::chmod(&ks, 0o700);
    fs::write(ks.join("k.key.pem"), b"junk").unwrap();
    common::chmod(&ks.join("k.key.pem"), 0o600);
    ks
}

/// A keystore's lock file removed while one process holds it and another
/// waits on it: the waiter, once it gets that file, finds that the name
/// now gives another (which a third process has locked) and waits for
/// that one. The build before went ahead beside the third.
#[test]
fn a_lock_file_removed_while_waited_for_is_taken_again() {
    let dir = scratch();
    let d = dir.path();
    let ks = keystore_with_a_key_file(d);
    let lock = ks.join(".lock");
    let first = common::HeldLock::take(&lock);
    let mut waiter = tpmcrypt(d)
        .args(["key", "delete", "k", "--yes"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let said = common::StderrLines::of(&mut waiter);
    // Said once it has the file open and waits on it.
    assert!(
        said.wait_for("waiting for", Duration::from_secs(30)),
        "no wait said"
    );
    fs::remove_file(&lock).unwrap();
    let third = common::HeldLock::take(&lock);
    drop(first);
    std::thread::sleep(Duration::from_millis(1000));
    let done_early = waiter.try_wait().expect("try_wait").is_some();
    drop(third);
    let r = said.finished_by(
        waiter,
        Instant::now() + Duration::from_secs(20),
        "key delete",
    );
    assert!(
        !done_early,
        "went ahead while another process held the lock file the name gives: {}",
        r.stderr
    );
    assert_ok(&r, "key delete");
    assert!(!ks.join("k.key.pem").exists());
}

/// swtpm takes its state directory as `dir=PATH,…`: a keystore path with
/// a comma (`x,mode=0644,dir=/elsewhere`) had it keep the TPM's state in
/// another directory than the one checked. Refused now, nothing made.
#[test]
fn a_keystore_path_with_a_comma_keeps_no_simulator_state() {
    let dir = scratch();
    let d = dir.path();
    let elsewhere = d.join("elsewhere");
    fs::create_dir(&elsewhere).unwrap();
    let ks = format!("{},mode=0644,dir=", elsewhere.display());
    let r = common::run(d, &["--keystore", &ks, "--simulator", "key", "create", "k"]);
    assert_ne!(r.code, 0, "{}", r.stderr);
    assert!(r.stderr.contains("comma"), "{}", r.stderr);
    assert!(
        common::listing(&elsewhere).is_empty(),
        "state written into another directory: {:?}",
        common::listing(&elsewhere)
    );
}

/// A run waiting for the simulator another process has says so once, and
/// a signal ends the wait at once. The build before waited without a
/// word, and a SIGTERM took 5 s to end it (the time a signal gives a TPM
/// operation under way to end).
#[test]
fn a_wait_for_the_simulator_is_said_and_a_signal_ends_it() {
    let dir = scratch();
    let d = dir.path();
    assert_ok(
        &plain(d, &["--simulator", "key", "create", "k"]),
        "key create",
    );
    fs::write(d.join("f"), b"x").unwrap();
    assert_ok(&plain(d, &["encrypt", "--key", "k", "f"]), "encrypt");
    let held = Simulator::start(&keystore(d).join("simulator")).expect("swtpm");
    let mut child = tpmcrypt(d)
        .args(["--simulator", "decrypt", "-o", "-", "f.tpmc"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let said = common::StderrLines::of(&mut child);
    assert!(
        said.wait_for("waiting for the simulator", Duration::from_secs(30)),
        "no wait said"
    );
    let sent = Instant::now();
    // SAFETY: plain kill(2) of our child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let r = said.finished_by(child, Instant::now() + Duration::from_secs(20), "decrypt");
    let took = sent.elapsed();
    assert!(
        r.code == -1 || r.code == 128 + libc::SIGTERM,
        "{}: {}",
        r.code,
        r.stderr
    );
    assert!(
        took < Duration::from_secs(3),
        "ended {took:?} after SIGTERM: {}",
        r.stderr
    );
    assert_eq!(
        r.stderr
            .lines()
            .filter(|l| l.starts_with("tpmcrypt: waiting for the simulator's state lock"))
            .count(),
        1,
        "{}",
        r.stderr
    );
    assert!(
        r.stdout.is_empty(),
        "decrypted while another had the simulator"
    );
    drop(held);
}

/// SIGINT or SIGTERM while a TPM command is under way, on a TPM without a
/// resource manager (swtpm reached directly, as `/dev/tpm0` would be): the
/// run ends by the signal once the operation is over, and leaves no
/// object or session loaded. The build before ended at once, leaving them:
/// two or three such interrupts filled the TPM.
#[test]
fn an_interrupt_during_a_tpm_operation_leaves_nothing_loaded() {
    const TPM_CC_LOAD: u32 = 0x157;
    let dir = scratch();
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    create_key(d, &t, "k", "ecc-p256", &[], false);
    fs::write(d.join("f"), b"x").unwrap();
    assert_ok(&plain(d, &["encrypt", "--key", "k", "f"]), "encrypt");
    for signal in [libc::SIGINT, libc::SIGTERM] {
        let slow = common::Counter::start_slowed(common::port_of(&t), Duration::from_millis(200));
        let proxied = format!("swtpm:host=127.0.0.1,port={}", slow.port);
        let child = tpmcrypt(d)
            .env("TPMCRYPT_TCTI", &proxied)
            .args(["decrypt", "-o", "-", "f.tpmc"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let start = Instant::now();
        while !slow.codes.lock().unwrap().contains(&TPM_CC_LOAD) {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "no TPM2_Load seen"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // SAFETY: plain kill(2) of our child.
        unsafe { libc::kill(child.id() as i32, signal) };
        let r = common::finished_by(child, Instant::now() + Duration::from_secs(20), "decrypt");
        // Ended by the signal (re-raised: no exit code) (a plaintext it finished may have been written).
        assert!(
            r.code == -1 || r.code == 128 + signal,
            "{}: {}",
            r.code,
            r.stderr
        );
        assert_no_handles(&sim, d, &format!("decrypt ended by signal {signal}"));
    }
}

/// A run that must wait for the keystore's lock, which another process
/// holds (a stopped or slow run), says so once on standard error, then
/// goes on when it is free. The build before waited without a word.
#[test]
fn a_wait_for_the_keystore_lock_is_said() {
    let dir = scratch();
    let d = dir.path();
    let ks = keystore_with_a_key_file(d);
    let holder = Command::new("flock")
        .args(["-x"])
        .arg(ks.join(".lock"))
        .args(["sleep", "2"])
        .spawn()
        .expect("flock (util-linux)");
    let start = Instant::now();
    while !ks.join(".lock").exists() {
        assert!(start.elapsed() < Duration::from_secs(10), "no lock file");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    let r = plain(d, &["key", "delete", "k", "--yes"]);
    let mut holder = holder;
    let _ = holder.wait();
    assert_ok(&r, "key delete behind a held lock");
    assert_eq!(
        r.stderr
            .lines()
            .filter(|l| l.contains("waiting for the keystore's lock"))
            .count(),
        1,
        "{}",
        r.stderr
    );
    assert!(!ks.join("k.key.pem").exists());
}
