//! `tpmcrypt bench` end to end: the real binary, `--quick --simulator`
//! (swtpm must be installed: without it these tests fail, by design).

mod common;

use std::path::Path;
use std::process::Command;

use common::{assert_error_line, assert_ok, run_within};
use serde_json::Value;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_tpmcrypt")
}

fn schema() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/bench.schema.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("docs/bench.schema.json is JSON")
}

fn validate(doc: &Value) {
    let schema = schema();
    let validator = jsonschema::validator_for(&schema).expect("the schema compiles");
    let errors: Vec<String> = validator
        .iter_errors(doc)
        .map(|e| format!("{e} at {}", e.instance_path))
        .collect();
    assert!(
        errors.is_empty(),
        "JSON does not match its schema:\n{}",
        errors.join("\n")
    );
}

fn cpu_has_aes() -> bool {
    std::fs::read_to_string("/proc/cpuinfo")
        .map(|t| {
            t.lines()
                .filter(|l| l.starts_with("flags"))
                .any(|l| l.split_whitespace().any(|f| f == "aes"))
        })
        .unwrap_or(false)
}

fn series<'a>(doc: &'a Value, id: &str) -> &'a Value {
    doc["bulk"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["id"] == id))
        .unwrap_or_else(|| panic!("series {id} missing"))
}

/// Sum over all sizes of the fastest sample: the least disturbed by other
/// load on the machine.
fn sum_of_min(s: &Value) -> f64 {
    s["points"]
        .as_array()
        .map(|a| a.iter().filter_map(|p| p["min_ms"].as_f64()).sum())
        .unwrap_or_else(|| panic!("no points in {}", s["id"]))
}

/// The benches time things: one at a time, or they slow each other down.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn quick_run_on_the_simulator() {
    let _serial = serial();
    assert!(
        Command::new("swtpm").arg("--version").output().is_ok(),
        "swtpm is not installed: this test needs it (apt-get install swtpm)"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("bench.json");
    let csv = dir.path().join("bench.csv");
    let svg = dir.path().join("bench.svg");
    let repeat = 2u64;
    let t = std::time::Instant::now();
    let out = Command::new(bin())
        .args([
            "bench",
            "--quick",
            "--simulator",
            "--repeat",
            &repeat.to_string(),
        ])
        .arg("--json-file")
        .arg(&json)
        .arg("--csv")
        .arg(&csv)
        .arg("--plot")
        .arg(&svg)
        .env_remove("TPMCRYPT_TCTI")
        .output()
        .expect("run tpmcrypt bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    eprintln!("bench --quick took {:?}", t.elapsed());
    assert!(out.status.success(), "bench failed: {:?}", out.status);

    // The JSON matches its schema.
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json written"))
        .expect("valid JSON");
    validate(&doc);

    // The TPM part ran on the simulator, and every unbind the bench
    // performed is one the Tpm counted.
    let tpm = &doc["tpm"];
    assert_eq!(tpm["available"], true, "TPM part: {}", tpm["reason"]);
    assert_eq!(tpm["is_simulator"], true);
    assert_eq!(tpm["source"], "simulator");
    // Three unbinds a round: RSA, P-256, and P-256 under a signed PCR
    // policy (measured beside the plain one).
    assert_eq!(tpm["unbinds_performed"].as_u64(), Some(repeat * 3));
    assert_eq!(tpm["unbind_count"].as_u64(), Some(repeat * 3));
    assert_eq!(tpm["ops"].as_array().map(Vec::len), Some(5));
    assert!(
        stdout.contains("unbind_ecc_p256_signed"),
        "the text report shows the signed-policy unbind: {stdout}"
    );
    assert!(
        stdout.contains("SIMULATOR"),
        "the table must say it is a simulator"
    );

    // The report says whether this CPU has AES-NI, as /proc/cpuinfo does.
    let has_aes = cpu_has_aes();
    assert_eq!(
        doc["system"]["cpu_features"]["aes"], has_aes,
        "cpu_features.aes"
    );
    // Software AES is slower than AES-NI (a ratio inside this run); without
    // AES-NI there is no hardware figure to compare, which the line above
    // has checked the report says.
    if has_aes {
        // Decryption: AES-NI pipelines CBC decryption and GCM, so the gap is
        // wide (10× or more) and survives a busy machine.
        for mode in ["cbc-raw", "gcm"] {
            let hw = sum_of_min(series(&doc, &format!("hardware/openssl/{mode}/decrypt")));
            let sw = sum_of_min(series(&doc, &format!("software/openssl/{mode}/decrypt")));
            assert!(
                sw > 2.0 * hw,
                "{mode}: software AES ({sw} ms) not clearly slower than AES-NI ({hw} ms)"
            );
        }
        assert_eq!(doc["software_aes"]["mask_verified"], true);
    }

    // Split and crossover exist for the measured unbind.
    assert!(doc["split"]
        .as_array()
        .is_some_and(|a| a.iter().any(|r| r["unbind_source"] == "measured-rsa2048")));

    // The per-file series ran through the command line, with sane values.
    check_per_file(&doc);

    // The plot is a non-empty SVG document.
    let text = std::fs::read_to_string(&svg).expect("plot written");
    assert!(!text.is_empty());
    let xml = roxmltree::Document::parse(&text).expect("the SVG parses as XML");
    assert_eq!(xml.root_element().tag_name().name(), "svg");

    // CSV: a header and rows of the same width.
    let csv = std::fs::read_to_string(&csv).expect("csv written");
    let mut lines = csv.lines();
    let width = lines.next().expect("header").split(',').count();
    assert!(lines.clone().count() > 10);
    for l in lines.clone() {
        assert_eq!(l.split(',').count(), width, "ragged CSV line: {l}");
    }
    assert_eq!(lines.filter(|l| l.starts_with("perfile,")).count(), 12 * 6);
    assert!(stdout.contains("== Per file, through the command line"));
}

/// encrypt and decrypt, durable and --no-sync, at 4 KiB, 64 KiB and 1 MiB:
/// every point's parts are there and consistent with each other.
fn check_per_file(doc: &Value) {
    let pf = &doc["per_file"];
    assert_eq!(pf["available"], true, "per-file series: {}", pf["reason"]);
    let points = pf["points"].as_array().expect("per_file.points");
    assert_eq!(points.len(), 12);
    for p in points {
        let num = |k: &str| p[k].as_f64().unwrap_or_else(|| panic!("{k}: {p}"));
        let (total, commit, unwrap) = (num("total_ms"), num("commit_ms"), num("unwrap_ms"));
        assert!(num("files") >= 8.0, "{p}");
        assert!(
            total > 0.0 && num("aes_cpu_ms") > 0.0 && num("io_ms") > 0.0,
            "{p}"
        );
        // files/s is the inverse of the wall time per file.
        assert!((num("files_per_s") * total / 1e3 - 1.0).abs() < 1e-6, "{p}");
        // Wall-time parts fit in the wall time; CPU parts in the CPUs' time.
        assert!(commit + unwrap + num("other_ms") <= total * 1.001, "{p}");
        let cpus = doc["system"]["cpus"].as_f64().expect("cpus");
        assert!(
            num("aes_cpu_ms") + num("io_ms") <= total * cpus * 1.05 + 0.01,
            "{p}"
        );
        match p["sync"].as_str() {
            Some("no-sync") => assert_eq!(commit, 0.0, "{p}"),
            _ => assert!(commit > 0.0, "durable runs wait for durability: {p}"),
        }
        match p["direction"].as_str() {
            Some("encrypt") => assert_eq!(unwrap, 0.0, "{p}"),
            _ => assert!(unwrap > 0.0, "a decrypt run unwraps its session key: {p}"),
        }
    }
    for size in [4096, 65536, 1 << 20] {
        assert!(points.iter().any(|p| p["size"] == size), "size {size}");
    }
}

#[test]
fn unreachable_tpm_is_reported_and_the_rest_still_runs() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("bench.json");
    let png = dir.path().join("bench.png");
    let out = Command::new(bin())
        .args([
            "bench",
            "--tpm",
            "swtpm:host=127.0.0.1,port=1",
            "--sizes",
            "16K,64K",
            "--repeat",
            "1",
            "--no-matrix",
            "--no-peers",
            "--chip",
            "typical",
            // The per-file series is checked by quick_run_on_the_simulator.
            "--no-per-file",
        ])
        .arg("--json-file")
        .arg(&json)
        .arg("--plot")
        .arg(&png)
        .env_remove("TPMCRYPT_SIMULATOR")
        .output()
        .expect("run tpmcrypt bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        out.status.code(),
        Some(4),
        "an explicit TPM that fails exits 4"
    );
    assert!(stdout.contains("TPM unavailable"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.lines().count() == 1 && stderr.starts_with("error: TPM unavailable: "),
        "one line says why: {stderr}"
    );
    assert!(stdout.contains("PROJECTION"));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json written"))
        .expect("valid JSON");
    validate(&doc);
    assert_eq!(doc["tpm"]["available"], false);
    assert_eq!(doc["tpm"]["unbind_count"], 0);
    assert!(doc["bulk"].as_array().is_some_and(|a| !a.is_empty()));
    assert!(doc["split"]
        .as_array()
        .is_some_and(|a| a.iter().all(|r| r["projection"] == true) && !a.is_empty()));
    let png = std::fs::read(&png).expect("plot written");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
}

#[test]
fn simulator_from_the_environment() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("bench.json");
    let out = Command::new(bin())
        .args([
            "bench",
            "--sizes",
            "16K,32K",
            "--repeat",
            "1",
            "--no-matrix",
            "--no-peers",
            "--no-per-file",
        ])
        .arg("--json")
        .arg("--json-file")
        .arg(&json)
        .env("TPMCRYPT_SIMULATOR", "1")
        .env_remove("TPMCRYPT_TCTI")
        .output()
        .expect("run tpmcrypt bench");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "bench failed: {:?}", out.status);
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json written"))
        .expect("valid JSON");
    validate(&doc);
    // --json is a flag: stdout is the same document, and nothing else (the
    // table goes to stderr).
    let printed: Value = serde_json::from_slice(&out.stdout).expect("--json prints JSON alone");
    assert_eq!(printed, doc, "--json and --json-file differ");
    assert!(String::from_utf8_lossy(&out.stderr).contains("SIMULATOR"));
    assert_eq!(doc["tpm"]["source"], "simulator");
    assert_eq!(doc["tpm"]["unbinds_performed"], 3);
    assert_eq!(doc["tpm"]["unbind_count"], 3);
}

/// The shortest run that still writes every report: one size, one
/// repeat, nothing optional (a tenth of a second).
const SHORT: [&str; 8] = [
    "bench",
    "--sizes",
    "16K",
    "--repeat",
    "1",
    "--no-matrix",
    "--no-peers",
    "--no-per-file",
];

/// `bench SHORT… extra…` in `dir`, which must end within 20 s (a FIFO
/// must not hold it).
fn short_run(dir: &Path, extra: &[&str]) -> common::Run {
    let mut args: Vec<&str> = SHORT.to_vec();
    args.extend_from_slice(extra);
    run_within(dir, &args, 20)
}

/// --json-file, --csv and --plot replace only what an earlier bench wrote
/// there (or an empty file), checked before any work; never a key, a
/// symlink, a FIFO, a device, a directory or another user's file; their
/// directory must exist; `-` is refused; written under a temporary name
/// and renamed (a hard link to the old file keeps the old contents).
#[test]
fn report_files_never_replace_data_or_a_special_file() {
    use std::fs;
    use std::os::unix::fs::{symlink, FileTypeExt, MetadataExt};
    let _serial = serial();
    let dir = common::scratch("bench-reports");
    let d = dir.path();
    // What an earlier run wrote, for each option.
    let r = short_run(
        d,
        &[
            "--json-file",
            "old.json",
            "--csv",
            "old.csv",
            "--plot",
            "old.svg",
        ],
    );
    assert_ok(&r, "a first run");
    let earlier = |opt: &str| match opt {
        "--json-file" => ("old.json", "json"),
        "--csv" => ("old.csv", "csv"),
        _ => ("old.svg", "svg"),
    };
    let refused = |r: &common::Run, opt: &str, path: &str, what: &str| {
        assert_error_line(r, 2, Some(&format!("{opt} {path}")), &[], what);
        assert!(
            r.stdout.is_empty(),
            "{what}: work was done before the refusal"
        );
    };
    fs::write(d.join("rec.key"), b"tpmcrypt-recovery-identity: precious\n").unwrap();
    fs::create_dir(d.join("adir")).unwrap();
    let c = std::ffi::CString::new(d.join("fifo").to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for opt in ["--json-file", "--csv", "--plot"] {
        let (old, ext) = earlier(opt);
        // A key file, under the option's own extension too.
        let key = format!("key.{ext}");
        fs::copy(d.join("rec.key"), d.join(&key)).unwrap();
        // A symlink to an earlier report, a FIFO, a directory, another
        // user's earlier report.
        let link = format!("link.{ext}");
        symlink(old, d.join(&link)).unwrap();
        let fifo = format!("fifo.{ext}");
        fs::rename(d.join("fifo"), d.join(&fifo)).unwrap();
        let adir = format!("adir.{ext}");
        fs::rename(d.join("adir"), d.join(&adir)).unwrap();
        let theirs = format!("theirs.{ext}");
        fs::copy(d.join(old), d.join(&theirs)).unwrap();
        std::os::unix::fs::lchown(d.join(&theirs), Some(65534), Some(65534))
            .expect("chown (the tests run as root, as CI does)");
        for (path, what) in [
            (key.as_str(), "a recovery key"),
            (&link, "a symlink"),
            (&fifo, "a FIFO"),
            (&adir, "a directory"),
            (&theirs, "another user's file"),
            (&format!("nodir/r.{ext}"), "a missing directory"),
        ] {
            let r = short_run(d, &[opt, path]);
            refused(&r, opt, path, &format!("{opt} {what}"));
        }
        assert_eq!(
            fs::read(d.join(&key)).unwrap(),
            fs::read(d.join("rec.key")).unwrap(),
            "{opt}: the key was replaced"
        );
        assert!(fs::symlink_metadata(d.join(&link)).unwrap().is_symlink());
        assert!(fs::symlink_metadata(d.join(&fifo))
            .unwrap()
            .file_type()
            .is_fifo());
        assert!(d.join(&adir).is_dir());
        assert_eq!(fs::metadata(d.join(&theirs)).unwrap().uid(), 65534);
        assert!(!d.join("nodir").exists());
        fs::rename(d.join(&fifo), d.join("fifo")).unwrap();
        fs::rename(d.join(&adir), d.join("adir")).unwrap();
    }
    // `-` is no file name here (--json prints the JSON on stdout).
    for (opt, path) in [("--json-file", "-"), ("--csv", "-")] {
        let r = short_run(d, &[opt, path]);
        refused(&r, opt, path, &format!("{opt} -"));
        assert!(!d.join("-").exists(), "{opt}: a file named -");
    }
    // One bad path refuses the run before any report is written.
    let r = short_run(d, &["--json-file", "nodir/x.json", "--csv", "ok.csv"]);
    refused(&r, "--json-file", "nodir/x.json", "one bad path of two");
    assert!(!d.join("ok.csv").exists(), "the other report was written");

    // What an earlier bench wrote, and empty files, are replaced: under a
    // temporary name renamed over them (a hard link keeps the old file).
    fs::write(d.join("empty.png"), b"").unwrap();
    fs::hard_link(d.join("old.json"), d.join("old-link.json")).unwrap();
    let before = fs::read(d.join("old.json")).unwrap();
    let r = short_run(
        d,
        &[
            "--json-file",
            "old.json",
            "--csv",
            "old.csv",
            "--plot",
            "empty.png",
        ],
    );
    assert_ok(&r, "replacing earlier reports");
    assert_eq!(
        fs::read(d.join("old-link.json")).unwrap(),
        before,
        "written in place"
    );
    assert_ne!(
        fs::read(d.join("old.json")).unwrap(),
        before,
        "not replaced"
    );
    assert!(fs::read(d.join("empty.png"))
        .unwrap()
        .starts_with(b"\x89PNG"));
    let r = short_run(d, &["--plot", "old.svg"]);
    assert_ok(&r, "replacing an earlier SVG");
    // A PNG cannot be told from any other: a non-empty one is kept.
    let r = short_run(d, &["--plot", "empty.png"]);
    refused(&r, "--plot", "empty.png", "a non-empty PNG");
}

/// A TPM asked for with --tpm that fails part-way ("no room" for another
/// object: what killed programs leave on a TPM without a resource
/// manager) is exit 4 with one line, the report still printed.
#[test]
fn an_explicit_tpm_that_stops_early_is_exit_4() {
    let _serial = serial();
    let dir = common::scratch("bench-tpm-full");
    let d = dir.path();
    let sim = common::swtpm(d, "swtpm");
    for i in 0..3 {
        common::tpm2_tool(
            &sim,
            d,
            &["tpm2_createprimary", "-C", "o", "-c", &format!("p{i}.ctx")],
        );
    }
    let r = short_run(d, &["--tpm", &sim.tcti(), "--json-file", "r.json"]);
    assert_error_line(&r, 4, None, &["stopped early", "no room"], "a full TPM");
    assert!(
        String::from_utf8_lossy(&r.stdout).contains("TPM measurement stopped early"),
        "the table is printed"
    );
    let doc: Value =
        serde_json::from_slice(&std::fs::read(d.join("r.json")).expect("json written")).unwrap();
    assert!(doc["tpm"]["reason"]
        .as_str()
        .is_some_and(|r| r.contains("no room")));
}

/// Waits up to `secs` for `child`, which must end by `signal` (as a shell
/// sees it, 128 + the signal); killed and failed otherwise.
fn ended_by(mut child: std::process::Child, signal: i32, secs: u64, what: &str) {
    use std::os::unix::process::ExitStatusExt;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running {secs} s after the signal");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(status.signal(), Some(signal), "{what}: {status:?}");
}

/// Whether process `pid` is still running (not gone, not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit(')').next().map(|r| r.trim_start().to_string()))
        .is_some_and(|r| !r.starts_with('Z'))
}

/// Waits up to 10 s for every process of `pids` to end.
fn all_end(pids: &[u32], what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while pids.iter().any(|&p| alive(p)) {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: {:?} still running (orphaned)",
            pids.iter().filter(|&&p| alive(p)).collect::<Vec<_>>()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Polls `ready` every 20 ms for up to 20 s; kills `child` and fails if
/// it never holds.
fn wait_for<T>(
    child: &mut std::process::Child,
    what: &str,
    mut ready: impl FnMut() -> Option<T>,
) -> T {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        if let Some(v) = ready() {
            return v;
        }
        if std::time::Instant::now() > deadline || child.try_wait().expect("wait").is_some() {
            let _ = child.kill();
            let _ = child.wait();
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            panic!("{what}: never ready; stderr: {err}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

const SIGNALS: [(i32, &str); 3] = [
    (libc::SIGTERM, "TERM"),
    (libc::SIGINT, "INT"),
    (libc::SIGHUP, "HUP"),
];

/// `bench watch` interrupted (SIGTERM, SIGINT, SIGHUP) stops its daemon
/// and removes its scratch tree (plaintext, a generated identity) before
/// it ends by the signal; killed (SIGKILL), its daemon still ends with it.
/// Under umask 0 its scratch directories are 0700 and its files 0600.
#[test]
fn an_interrupted_bench_watch_stops_its_daemon_and_removes_its_scratch_tree() {
    use common::mode_of;
    let _serial = serial();
    let dir = common::scratch("bench-watch-signals");
    let d = dir.path();
    for (signal, name) in SIGNALS.into_iter().chain([(libc::SIGKILL, "KILL")]) {
        let parent = d.join(name);
        std::fs::create_dir(&parent).unwrap();
        let mut child = common::wrapper(d, "sh")
            .arg("-c")
            .arg("umask 0; exec \"$0\" \"$@\"")
            .arg(common::bin())
            .args(["bench", "watch", "--duration", "30s", "--no-calibrate"])
            .args(["--rate", "20", "--workers", "1", "--dir"])
            .arg(&parent)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn");
        let pid = child.id();
        let is_daemon = |p: &u32| {
            // `tpmcrypt-full watch SRC …` (the bench is `… bench watch …`).
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.split(|&b| b == 0).nth(1) == Some(&b"watch"[..]))
        };
        let (daemon, tree) = wait_for(&mut child, name, || {
            let tree = std::fs::read_dir(&parent).ok()?.flatten().next()?.path();
            let daemon = common::child_pids_of(pid).into_iter().find(is_daemon)?;
            let src = tree.join("run/src");
            let first = std::fs::read_dir(&src).ok()?.flatten().next()?.path();
            let ready = first.exists() && tree.join("run/daemon.log").exists();
            ready.then_some((daemon, tree))
        });
        for sub in ["", "run", "run/src", "run/dest"] {
            assert_eq!(
                mode_of(&tree.join(sub)),
                0o700,
                "{name}: {sub}/ under umask 0"
            );
        }
        for f in ["recipient", "run/daemon.log", "run/src/f00000000"] {
            assert_eq!(mode_of(&tree.join(f)), 0o600, "{name}: {f} under umask 0");
        }
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid as i32, signal) };
        ended_by(child, signal, 20, name);
        all_end(&[daemon], name);
        if signal == libc::SIGKILL {
            // Nothing can run after SIGKILL: the tree stays (docs/bench.md).
            std::fs::remove_dir_all(&tree).unwrap();
        } else {
            assert!(
                common::listing(&parent).is_empty(),
                "{name}: scratch tree left: {:?}",
                common::listing(&parent)
            );
        }
    }
}

/// `bench` interrupted during its per-file series (SIGTERM, SIGINT,
/// SIGHUP) stops its `encrypt -r`/`decrypt -r` runs and removes its
/// scratch tree before it ends by the signal.
#[test]
fn an_interrupted_bench_removes_its_scratch_tree() {
    let _serial = serial();
    let dir = common::scratch("bench-signals");
    let d = dir.path();
    for (signal, name) in SIGNALS {
        let tmp = d.join(name);
        std::fs::create_dir(&tmp).unwrap();
        let mut child = common::tpmcrypt(d)
            .args([
                "bench",
                "--sizes",
                "16K",
                "--repeat",
                "1",
                "--no-matrix",
                "--no-peers",
            ])
            .env("TMPDIR", &tmp)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn");
        let pid = child.id();
        let children = wait_for(&mut child, name, || {
            let tree = std::fs::read_dir(&tmp).ok()?.flatten().next()?.path();
            let kids = common::child_pids_of(pid);
            (tree.join("perfile/tree").exists() && !kids.is_empty()).then_some(kids)
        });
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid as i32, signal) };
        ended_by(child, signal, 20, name);
        all_end(&children, name);
        assert!(
            common::listing(&tmp).is_empty(),
            "{name}: left {:?}",
            common::listing(&tmp)
        );
    }
}
