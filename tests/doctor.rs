//! `tpmcrypt doctor` and the TCTI conventions, end to end against real
//! swtpm processes (each test starts its own), with tpm2-tools to change
//! and read TPM state from outside. A missing swtpm or tpm2-tools makes
//! the tests FAIL, never skip.
//!
//! Doctor's exit status is a sum of bits (docs/doctor.md): 4 no TPM,
//! 8 algorithms, 16 lockout, 32 keys, 64 PCR policy, 128 agent.

mod common;
use common::{closed_tcti, lockout_counter, swtpm};

use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::{assert_ok, tpm2_tool, tpmcrypt, Run};
use serde_json::Value;
use tpmcrypt_tpmkey::Simulator;

const PIN: &str = "2468";

/// Environment variables to set.
type Env<'a> = &'a [(&'a str, &'a str)];
const BIT_TPM: i32 = 4;
const BIT_LOCKOUT: i32 = 16;
const BIT_PCR: i32 = 64;
const BIT_AGENT: i32 = 128;

/// Runs tpmcrypt in `dir` with extra environment and arguments.
fn run_env(dir: &Path, env: &[(&str, &str)], args: &[&str]) -> Run {
    let mut cmd = tpmcrypt(dir);
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("spawn tpmcrypt").into()
}

/// `doctor --json` with `env` and `args`; returns the exit code and JSON.
fn doctor_json(dir: &Path, env: &[(&str, &str)], args: &[&str]) -> (i32, Value) {
    let mut all = vec!["doctor", "--json"];
    all.extend_from_slice(args);
    let r = run_env(dir, env, &all);
    let v: Value = serde_json::from_slice(&r.stdout).unwrap_or_else(|e| {
        panic!(
            "doctor --json printed no JSON ({e}): {:?}; stderr {}",
            String::from_utf8_lossy(&r.stdout),
            r.stderr
        )
    });
    assert_eq!(v["status"], r.code, "status field = exit code: {v}");
    (r.code, v)
}

fn create_key(dir: &Path, tcti: &str, name: &str, extra: &[&str], pin: bool) {
    let mut args = vec!["--tpm", tcti, "key", "create", name];
    args.extend_from_slice(extra);
    let mut env = vec![];
    if pin {
        args.push("--pin");
        env.push(("TPMCRYPT_PIN", PIN));
    }
    assert_ok(&run_env(dir, &env, &args), &format!("key create {name}"));
}

fn key<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["keystore"]["keys"]
        .as_array()
        .and_then(|a| a.iter().find(|k| k["name"] == name))
        .unwrap_or_else(|| panic!("no key {name} in {v}"))
}

/// What tpm2-tools reads of the TPM's state that doctor must not change:
/// the variable properties (lockout counter included), persistent and
/// transient handles, loaded sessions and every PCR.
fn tpm_state(sim: &Simulator, dir: &Path) -> String {
    let mut out = String::new();
    for args in [
        &["tpm2_getcap", "properties-variable"][..],
        &["tpm2_getcap", "handles-persistent"],
        &["tpm2_getcap", "handles-transient"],
        &["tpm2_getcap", "handles-loaded-session"],
        &["tpm2_getcap", "handles-saved-session"],
        &["tpm2_pcrread"],
    ] {
        out.push_str(&tpm2_tool(sim, dir, args));
    }
    out
}

#[test]
fn a_healthy_simulator_is_exit_0_with_every_field() {
    let dir = common::scratch("tpmcrypt-doctor-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    create_key(d, &t, "plain", &[], false);
    create_key(
        d,
        &t,
        "sealed",
        &["--alg", "rsa2048", "--pcrs", "sha256:0,7"],
        true,
    );
    let (code, v) = doctor_json(d, &[], &["--tpm", &t]);
    assert_eq!(code, 0, "{v:#}");
    assert_eq!(v["version"], 1);
    assert_eq!(v["problems"], serde_json::json!([]));
    let tpm = &v["tpm"];
    assert_eq!(tpm["tcti"], t.as_str());
    assert_eq!(tpm["chosen_by"], "--tpm");
    assert_eq!(tpm["reachable"], true);
    assert_eq!(tpm["simulator"], true);
    assert_eq!(tpm["family"], "2.0");
    assert!(tpm["manufacturer"].as_str().is_some_and(|m| !m.is_empty()));
    assert!(tpm["firmware"].as_str().is_some_and(|f| f.contains('.')));
    let banks = tpm["pcr_banks"].as_array().expect("pcr_banks");
    let sha256 = banks
        .iter()
        .find(|b| b["bank"] == "sha256")
        .expect("sha256 bank");
    assert_eq!(sha256["pcrs"].as_array().map(Vec::len), Some(24));
    let algs: Vec<(&str, bool)> = tpm["algorithms"]
        .as_array()
        .expect("algorithms")
        .iter()
        .map(|a| (a["name"].as_str().unwrap(), a["supported"] == true))
        .collect();
    assert_eq!(
        algs,
        [
            ("rsa2048-oaep-sha256", true),
            ("ecc-p256-ecdh", true),
            ("aes128-cfb", true)
        ]
    );
    let l = &tpm["lockout"];
    assert_eq!(l["in_lockout"], false);
    assert_eq!(l["counter"], 0);
    assert_eq!(l["remaining_tries"], l["max_tries"]);
    assert_eq!(tpm["srk"]["present"], false);
    assert_eq!(tpm["srk"]["handle"], "0x81000001");
    let plain = key(&v, "plain");
    assert_eq!(plain["alg"], "ecc-p256");
    assert_eq!(plain["loads"], true);
    assert_eq!(plain["pin"], false);
    assert_eq!(plain["pcrs"], Value::Null);
    let sealed = key(&v, "sealed");
    assert_eq!(sealed["alg"], "rsa2048");
    assert_eq!(sealed["loads"], true);
    assert_eq!(sealed["pin"], true);
    assert_eq!(sealed["pcrs"], "sha256:0,7");
    assert_eq!(sealed["pcr_policy_satisfied"], true);
    for f in ["aes_ni", "vaes", "pclmulqdq", "avx512_aes_gcm"] {
        assert!(v["cpu"][f].is_boolean(), "cpu.{f}: {v}");
    }
    assert_eq!(v["backend"]["default_gcm"], common::default_gcm_backend());
    let wide = common::default_gcm_backend() == "aws-lc";
    assert_eq!(v["cpu"]["avx512_aes_gcm"], wide);
    let gcm_192 = if wide { "aws-lc" } else { "openssl" };
    assert_eq!(v["backend"]["default_gcm_192"], gcm_192);
    assert_eq!(v["backend"]["default_cbc"], "openssl");
    assert_eq!(v["agent"]["running"], false);
    let warnings = v["warnings"].to_string();
    assert!(warnings.contains("simulator"), "{warnings}");

    // The same as text: one line per subject, and the verdict.
    let r = run_env(d, &[], &["--tpm", &t, "doctor"]);
    assert_ok(&r, "doctor");
    let text = String::from_utf8_lossy(&r.stdout);
    for needle in [
        &format!("TPM          {t} (from --tpm)"),
        "SIMULATOR",
        "ecc-p256-ecdh ok",
        "  sealed     rsa2048; loads; PCRs sha256:0,7 satisfied; PIN needed",
        "  SRK        none at 0x81000001",
        "result: ready (exit 0)",
    ] {
        assert!(text.contains(needle), "no {needle:?} in:\n{text}");
    }
}

#[test]
fn no_tpm_sets_the_tpm_bit_with_a_one_line_reason() {
    let dir = common::scratch("tpmcrypt-doctor-");
    let d = dir.path();
    let closed = closed_tcti();
    let (code, v) = doctor_json(d, &[], &["--tpm", &closed]);
    assert_eq!(code, BIT_TPM, "{v:#}");
    assert_eq!(v["tpm"]["reachable"], false);
    let problems = v["problems"].as_array().expect("problems");
    assert_eq!(problems.len(), 1, "{v:#}");
    assert_eq!(problems[0]["check"], "tpm");
    assert_eq!(problems[0]["bit"], BIT_TPM);
    let reason = problems[0]["reason"].as_str().unwrap();
    assert!(
        reason.contains(&closed) && reason.contains("connection refused"),
        "{reason}"
    );
    assert!(!reason.contains('\n'));
    // The rest is still reported.
    assert!(v["cpu"]["aes_ni"].is_boolean());
    assert_eq!(v["agent"]["running"], false);

    // A device node that is not there: the node is described too.
    let (code, v) = doctor_json(d, &[], &["--tpm", "device:/nonexistent/tpmrm0"]);
    assert_eq!(code, BIT_TPM, "{v:#}");
    assert_eq!(v["tpm"]["device"]["exists"], false);
    assert_eq!(v["tpm"]["device"]["resource_manager"], true);
    assert_eq!(v["tpm"]["device"]["can_open"], false);

    // As text: the reason on one line, and the bit in the verdict.
    let r = run_env(d, &[], &["--tpm", &closed, "doctor"]);
    assert_eq!(r.code, BIT_TPM);
    let text = String::from_utf8_lossy(&r.stdout);
    let line = format!("problem [4]: TPM unreachable ({closed}): connection refused");
    assert!(text.contains(&line), "no {line:?} in:\n{text}");
    assert!(text.contains("result: 1 problem(s) (exit 4)"), "{text}");
}

#[test]
fn a_key_whose_pcrs_changed_is_reported() {
    let dir = common::scratch("tpmcrypt-doctor-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    create_key(d, &t, "boot", &["--pcrs", "sha256:7"], false);
    create_key(d, &t, "other", &["--pcrs", "sha256:8"], false);
    let (code, _) = doctor_json(d, &[], &["--tpm", &t]);
    assert_eq!(code, 0);
    tpm2_tool(
        &sim,
        d,
        &[
            "tpm2_pcrextend",
            "7:sha256=00000000000000000000000000000000000000000000000000000000000000aa",
        ],
    );
    let (code, v) = doctor_json(d, &[], &["--tpm", &t]);
    assert_eq!(code, BIT_PCR, "{v:#}");
    assert_eq!(key(&v, "boot")["pcr_policy_satisfied"], false);
    assert_eq!(key(&v, "boot")["loads"], true);
    assert_eq!(key(&v, "other")["pcr_policy_satisfied"], true);
    let reason = v["problems"][0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("key boot") && reason.contains("sha256:7"),
        "{reason}"
    );
}

#[test]
fn doctor_spends_no_try_and_changes_no_state() {
    let dir = common::scratch("tpmcrypt-doctor-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    tpm2_tool(
        &sim,
        d,
        &[
            "tpm2_dictionarylockout",
            "--setup-parameters",
            "--max-tries=2",
            "--recovery-time=600",
            "--lockout-recovery-time=600",
        ],
    );
    create_key(d, &t, "pinned", &[], true);
    create_key(d, &t, "sealed", &["--pcrs", "sha256:7"], true);
    fs::write(d.join("a"), b"secret").unwrap();
    assert_ok(
        &run_env(d, &[], &["encrypt", "--key", "pinned", "a"]),
        "encrypt",
    );
    // One wrong PIN: the counter is 1, one try left.
    let r = run_env(
        d,
        &[("TPMCRYPT_PIN", "1111")],
        &["--tpm", &t, "decrypt", "-o", "-", "a.tpmc"],
    );
    assert_eq!(r.code, 4, "{}", r.stderr);
    assert_eq!(lockout_counter(&sim, d), 1);

    let before = tpm_state(&sim, d);
    for _ in 0..3 {
        let (code, v) = doctor_json(d, &[], &["--tpm", &t]);
        assert_eq!(code, 0, "{v:#}");
        assert_eq!(v["tpm"]["lockout"]["counter"], 1);
        assert_eq!(v["tpm"]["lockout"]["remaining_tries"], 1);
        assert_eq!(key(&v, "pinned")["loads"], true);
        assert_eq!(key(&v, "sealed")["pcr_policy_satisfied"], true);
        let r = run_env(d, &[], &["--tpm", &t, "doctor"]);
        assert_ok(&r, "doctor as text");
    }
    let after = tpm_state(&sim, d);
    assert_eq!(before, after, "doctor changed the TPM's state");
    assert_eq!(lockout_counter(&sim, d), 1, "doctor spent a try");

    // The second wrong PIN locks the TPM out: doctor says so (bit 16),
    // and still spends nothing.
    let r = run_env(
        d,
        &[("TPMCRYPT_PIN", "1111")],
        &["--tpm", &t, "decrypt", "-o", "-", "a.tpmc"],
    );
    assert_eq!(r.code, 4, "{}", r.stderr);
    let before = tpm_state(&sim, d);
    let (code, v) = doctor_json(d, &[], &["--tpm", &t]);
    assert_eq!(code, BIT_LOCKOUT, "{v:#}");
    assert_eq!(v["tpm"]["lockout"]["in_lockout"], true);
    assert_eq!(v["tpm"]["lockout"]["remaining_tries"], 0);
    assert_eq!(key(&v, "pinned")["loads"], true);
    assert_eq!(
        tpm_state(&sim, d),
        before,
        "doctor changed the TPM's state in lockout"
    );
}

#[test]
fn an_untrusted_agent_socket_sets_the_agent_bit_and_a_running_agent_is_counted() {
    let dir = common::scratch("tpmcrypt-doctor-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    // A socket in a directory anyone may write to: not used, bit 128.
    let open_dir = d.join("shared");
    fs::create_dir(&open_dir).unwrap();
    fs::set_permissions(&open_dir, fs::Permissions::from_mode(0o777)).unwrap();
    let sock = open_dir.join("agent.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let sock_env = sock.to_str().unwrap();
    let (code, v) = doctor_json(d, &[("TPMCRYPT_AGENT_SOCK", sock_env)], &["--tpm", &t]);
    assert_eq!(code, BIT_AGENT, "{v:#}");
    assert_eq!(v["agent"]["trusted"], false);
    assert!(
        v["agent"]["error"].as_str().unwrap().contains("writable"),
        "{v:#}"
    );

    // A running agent of ours: running, trusted, secrets counted.
    let mut agent = tpmcrypt(d)
        .args(["agent", "--ttl", "5m"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn agent");
    let sock = d.join(".tpmcrypt-agent.sock");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !sock.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "agent socket never appeared"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (code, v) = doctor_json(d, &[], &["--tpm", &t]);
    let _ = agent.kill();
    let _ = agent.wait();
    assert_eq!(code, 0, "{v:#}");
    assert_eq!(v["agent"]["running"], true);
    assert_eq!(v["agent"]["trusted"], true);
    assert_eq!(v["agent"]["secrets_held"], 0);
    assert_eq!(v["agent"]["sessions_held"], 0);
}

/// `--tpm` > TPMCRYPT_TCTI > TPM2TOOLS_TCTI > TSS2_TCTI > default, each
/// named in doctor's report.
#[test]
fn tcti_precedence_is_shown_by_doctor() {
    let dir = common::scratch("tpmcrypt-doctor-");
    let d = dir.path();
    let [a, b, c, e] = [closed_tcti(), closed_tcti(), closed_tcti(), closed_tcti()];
    let all = [
        ("TPMCRYPT_TCTI", b.as_str()),
        ("TPM2TOOLS_TCTI", c.as_str()),
        ("TSS2_TCTI", e.as_str()),
    ];
    let cases: [(Env, &[&str], &str, &str); 5] = [
        (&all, &["--tpm", &a], &a, "--tpm"),
        (&all, &[], &b, "TPMCRYPT_TCTI"),
        (&all[1..], &[], &c, "TPM2TOOLS_TCTI"),
        (&all[2..], &[], &e, "TSS2_TCTI"),
        (&[], &[], "device:/dev/tpmrm0", "default"),
    ];
    for (env, args, tcti, by) in cases {
        let mut cmd_env: Vec<(&str, &str)> = env.to_vec();
        // Blank values count as unset.
        if env.len() < 3 {
            cmd_env.push(("TPMCRYPT_TCTI", ""));
        }
        let (code, v) = doctor_json(d, &cmd_env, args);
        assert_eq!(code & BIT_TPM, BIT_TPM, "{by}: {v:#}");
        assert_eq!(v["tpm"]["chosen_by"], by, "{v:#}");
        assert_eq!(v["tpm"]["tcti"], tcti, "{by}: {v:#}");
    }
    // A value tpmcrypt cannot use is named with its variable, not skipped.
    let (code, v) = doctor_json(d, &[("TPM2TOOLS_TCTI", "cmd:tpm2_send")], &[]);
    assert_eq!(code, BIT_TPM, "{v:#}");
    assert!(v["problems"][0]["reason"]
        .as_str()
        .unwrap()
        .contains("TPM2TOOLS_TCTI: unknown TCTI 'cmd'"));
}

/// The same precedence decides which TPM a decrypt uses, and `-v` says
/// which one and why.
#[test]
fn tcti_precedence_decides_decrypt_and_v_names_it() {
    let dir = common::scratch("tpmcrypt-doctor-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    let closed = closed_tcti();
    create_key(d, &t, "k", &[], false);
    fs::write(d.join("f"), b"hello").unwrap();
    assert_ok(&run_env(d, &[], &["encrypt", "--key", "k", "f"]), "encrypt");
    // Each time the real TPM is named by the winner and a closed one by
    // every variable below it.
    let cases: [(Env, &[&str], &str); 4] = [
        (
            &[
                ("TPMCRYPT_TCTI", &closed),
                ("TPM2TOOLS_TCTI", &closed),
                ("TSS2_TCTI", &closed),
            ],
            &["--tpm", &t],
            "--tpm",
        ),
        (
            &[
                ("TPMCRYPT_TCTI", &t),
                ("TPM2TOOLS_TCTI", &closed),
                ("TSS2_TCTI", &closed),
            ],
            &[],
            "TPMCRYPT_TCTI",
        ),
        (
            &[("TPM2TOOLS_TCTI", &t), ("TSS2_TCTI", &closed)],
            &[],
            "TPM2TOOLS_TCTI",
        ),
        (&[("TSS2_TCTI", &t)], &[], "TSS2_TCTI"),
    ];
    for (env, args, by) in cases {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["-v", "decrypt", "-o", "-", "f.tpmc"]);
        let r = run_env(d, env, &all);
        assert_ok(&r, by);
        assert_eq!(r.stdout, b"hello");
        let want = format!("tpmcrypt: TPM {t} (from {by})");
        assert!(
            r.stderr.lines().any(|l| l == want),
            "{by}: no {want:?} in {}",
            r.stderr
        );
    }
    // A bad TPM2TOOLS_TCTI is a usage error naming the variable.
    let r = run_env(
        d,
        &[("TPM2TOOLS_TCTI", "cmd:x")],
        &["decrypt", "-o", "-", "f.tpmc"],
    );
    common::assert_error_line(
        &r,
        2,
        None,
        &["TPM2TOOLS_TCTI", "unknown TCTI 'cmd'"],
        "bad TPM2TOOLS_TCTI",
    );
}

/// What another process left loaded is reported (a warning, not a bit),
/// and doctor works beside it.
#[test]
fn handles_left_loaded_by_others_are_reported() {
    let dir = common::scratch("tpmcrypt-doctor-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    create_key(d, &t, "k", &[], false);
    // Without a resource manager, tpm2_createprimary leaves its primary loaded.
    tpm2_tool(
        &sim,
        d,
        &["tpm2_createprimary", "-C", "o", "-c", "primary.ctx"],
    );
    let (code, v) = doctor_json(d, &[], &["--tpm", &t]);
    assert_eq!(code, 0, "{v:#}");
    assert_eq!(
        v["tpm"]["loaded"]["transient"].as_array().map(Vec::len),
        Some(1),
        "{v:#}"
    );
    assert_eq!(key(&v, "k")["loads"], true);
    assert!(
        v["warnings"].to_string().contains("1 transient objects"),
        "{v:#}"
    );
    // Doctor flushed only its own: the primary is still there.
    assert_eq!(common::tpm_handles(&sim, d).len(), 1);
    // With every object slot taken (swtpm has 3), the key cannot load, and
    // the reason says the TPM is full, not only that the key does not load.
    for _ in 0..2 {
        tpm2_tool(&sim, d, &["tpm2_createprimary", "-C", "o", "-c", "p.ctx"]);
    }
    let (code, v) = doctor_json(d, &[], &["--tpm", &t]);
    assert_eq!(code, 32, "{v:#}");
    assert_eq!(key(&v, "k")["loads"], false);
    let reason = v["problems"][0]["reason"].as_str().unwrap();
    assert!(reason.contains("tpm2_flushcontext -t -s"), "{reason}");
}

/// A keystore another user could write to is a problem (bit 32), and its
/// keys are not read.
#[test]
fn an_untrusted_keystore_sets_the_keys_bit() {
    let dir = common::scratch("tpmcrypt-doctor-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    create_key(d, &t, "k", &[], false);
    let home = d.join(".tpmcrypt-home");
    fs::set_permissions(&home, fs::Permissions::from_mode(0o777)).unwrap();
    let (code, v) = doctor_json(d, &[], &["--tpm", &t]);
    assert_eq!(code, 32, "{v:#}");
    assert_eq!(v["keystore"]["trusted"], false);
    assert_eq!(v["keystore"]["keys"], serde_json::json!([]));
    assert_eq!(v["problems"][0]["check"], "keystore");
    // An absent keystore is no problem, and is not created.
    let none = d.join("none");
    let (code, v) = doctor_json(d, &[], &["--tpm", &t, "--keystore", none.to_str().unwrap()]);
    assert_eq!(code, 0, "{v:#}");
    assert_eq!(v["keystore"]["exists"], false);
    assert!(!none.exists(), "doctor created the keystore");
}

/// Text from the environment never reaches the terminal as control
/// characters.
#[test]
fn control_characters_are_escaped_in_the_text_report() {
    let dir = common::scratch("tpmcrypt-doctor-");
    let d = dir.path();
    let evil = "swtpm:host=\u{1b}[31mevil,port=1";
    let r = run_env(d, &[("TPM2TOOLS_TCTI", evil)], &["doctor"]);
    assert_eq!(r.code, BIT_TPM, "{}", r.stderr);
    assert!(
        !r.stdout.contains(&0x1b),
        "{:?}",
        String::from_utf8_lossy(&r.stdout)
    );
    let text = String::from_utf8_lossy(&r.stdout);
    assert!(text.contains("\\x1b[31mevil"), "{text}");
}

/// A keystore path that is there but is no directory is a problem, not
/// "no keystore yet".
#[test]
fn a_keystore_that_is_not_a_directory_is_a_problem() {
    let dir = common::scratch("tpmcrypt-doctor-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    let file = d.join("store");
    fs::write(&file, b"not a keystore").unwrap();
    let (code, v) = doctor_json(d, &[], &["--tpm", &t, "--keystore", file.to_str().unwrap()]);
    assert_eq!(code, 32, "{v:#}");
    assert_eq!(v["keystore"]["exists"], true);
    let reason = v["problems"][0]["reason"].as_str().unwrap();
    assert!(reason.contains("not a directory"), "{reason}");
}

/// A persistent SRK at 0x81000001 is reported with its algorithm, and
/// keys made under it are checked under it.
#[test]
fn a_persistent_srk_is_reported() {
    let dir = common::scratch("tpmcrypt-doctor-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    tpm2_tool(
        &sim,
        d,
        &[
            "tpm2_createprimary",
            "-C",
            "o",
            "-G",
            "rsa2048",
            "-c",
            "srk.ctx",
        ],
    );
    tpm2_tool(
        &sim,
        d,
        &[
            "tpm2_evictcontrol",
            "-C",
            "o",
            "-c",
            "srk.ctx",
            "0x81000001",
        ],
    );
    tpm2_tool(&sim, d, &["tpm2_flushcontext", "-t"]);
    create_key(d, &t, "k", &[], false);
    let (code, v) = doctor_json(d, &[], &["--tpm", &t]);
    assert_eq!(code, 0, "{v:#}");
    assert_eq!(v["tpm"]["srk"]["present"], true);
    assert_eq!(v["tpm"]["srk"]["alg"], "rsa");
    assert_eq!(key(&v, "k")["loads"], true);
}

/// A TCTI whose ports accept connections and never answer: doctor gives
/// up after --timeout and reports the TPM unreachable (bit 4), where
/// tpm2-tss alone would wait for ever.
#[test]
fn a_tpm_that_never_answers_is_given_up_after_the_timeout() {
    let dir = common::scratch("tpmcrypt-doctor-");
    let d = dir.path();
    let (cmd, _ctrl, port) = loop {
        let cmd = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = cmd.local_addr().expect("addr").port();
        if let Ok(ctrl) = TcpListener::bind(("127.0.0.1", port + 1)) {
            break (cmd, ctrl, port);
        }
    };
    let _ = &cmd;
    let tcti = format!("swtpm:host=127.0.0.1,port={port}");
    let start = std::time::Instant::now();
    let (code, v) = doctor_json(d, &[], &["--tpm", &tcti, "--timeout", "2s"]);
    let took = start.elapsed();
    assert_eq!(code, BIT_TPM, "{v:#}");
    assert!(took < std::time::Duration::from_secs(10), "took {took:?}");
    let reason = v["problems"][0]["reason"].as_str().unwrap();
    assert!(reason.contains("no answer within 2s"), "{reason}");
    assert_eq!(v["tpm"]["chosen_by"], "--tpm");
    let r = run_env(d, &[], &["doctor", "--timeout", "0"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
}

/// A key bound to a PCR signer (`key create --pcr-signer`) is checked as
/// decrypt would use it: with no signed policy attached, or none that the
/// current PCRs satisfy, the PCR bit is set (decrypt would refuse it, exit
/// 4); once the current values are signed and attached, it is not.
#[test]
fn a_signed_policy_key_is_checked_against_its_signed_policies() {
    let dir = common::scratch("tpmcrypt-doctor-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    let r = run_env(d, &[], &["pcr-signer", "create", "--out", "signer.key"]);
    assert_ok(&r, "pcr-signer create");
    std::fs::write(d.join("signer.pub"), &r.stdout).unwrap();
    create_key(
        d,
        &t,
        "signed",
        &["--pcr-signer", "signer.pub", "--pcrs", "sha256:7"],
        false,
    );
    let (code, v) = doctor_json(d, &[], &["--tpm", &t]);
    assert_eq!(code, BIT_PCR, "no signed policy attached yet: {v:#}");
    assert_eq!(key(&v, "signed")["pcr_policy_satisfied"], false, "{v:#}");
    assert_eq!(key(&v, "signed")["pcrs"], "sha256:7", "{v:#}");
    let reason = v["problems"][0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("key signed") && reason.contains("no signed PCR policy yet"),
        "{reason}"
    );
    let text = run_env(d, &[], &["--tpm", &t, "doctor"]);
    let line = String::from_utf8_lossy(&text.stdout).into_owned();
    assert!(
        line.contains("NOT SATISFIED (no signed policy holds)") && !line.contains("PCRs changed"),
        "{line}"
    );

    let sign = [
        "--tpm",
        &t,
        "pcr",
        "sign",
        "--signer",
        "signer.key",
        "--pcrs",
        "sha256:7",
        "--current",
        "-o",
        "now.policy",
    ];
    assert_ok(&run_env(d, &[], &sign), "pcr sign");
    let add = ["key", "add-policy", "signed", "now.policy"];
    assert_ok(&run_env(d, &[], &add), "key add-policy");
    let (code, v) = doctor_json(d, &[], &["--tpm", &t]);
    assert_eq!(code, 0, "its signed policy holds: {v:#}");
    assert_eq!(key(&v, "signed")["pcr_policy_satisfied"], true, "{v:#}");

    tpm2_tool(
        &sim,
        d,
        &[
            "tpm2_pcrextend",
            "7:sha256=00000000000000000000000000000000000000000000000000000000000000aa",
        ],
    );
    let (code, v) = doctor_json(d, &[], &["--tpm", &t]);
    assert_eq!(code, BIT_PCR, "PCR 7 moved past its policy: {v:#}");
    assert_eq!(key(&v, "signed")["pcr_policy_satisfied"], false, "{v:#}");
    let reason = v["problems"][0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("key signed") && reason.contains("PCR 7 is"),
        "{reason}"
    );
    assert!(
        !reason.contains("create a new key"),
        "a signed key needs a new signed policy, not a new key: {reason}"
    );
}
