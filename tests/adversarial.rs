//! Adversarial and fault tests of the `tpmcrypt` binary: every header byte
//! and every segment edge flipped, truncations at and around every segment
//! boundary, segments dropped, duplicated, reordered or spliced from another
//! file, hostile headers; a full disk; the session key looked for on disk;
//! the agent's peer-uid check against another user; the TPM going away in
//! the middle of a run; two runs racing for one output; output permissions;
//! kill -9 of `encrypt -o` / `decrypt -o` at random moments; a TPM reset
//! under PCR-bound keys; dictionary-attack lockout.
//!
//! swtpm, tpm2-tools and python3 are required, and so is root (to mount a
//! tmpfs and to run a client as another uid): without them the tests FAIL,
//! they never skip. `docs/reliability.md` records what these tests tried.
//!
//! Exit codes: 0 ok, 1 other (I/O, exists), 3 integrity, 4 TPM.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write as _;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    assert_ok, bytes, chmod, listing, mode_of, recovery, run, tpm2_tool, tpm_handles, tpmcrypt,
    KillDelay, Layout, Rng, Run,
};
use serde_json::Value;
use tempfile::TempDir;
use tpmcrypt_tpmkey::Simulator;

const OK: i32 = 0;
const OTHER: i32 = 1;
const INTEGRITY: i32 = 3;
const TPM: i32 = 4;

const PARTIAL_MARKER: &str = ".tpmcrypt-partial.";

/// Every cause an integrity failure may name (`docs/format.md`, "What is
/// detected"); an error line naming none of them does not say why.
const ANY_CAUSE: &[&str] = &[
    "not a tpmcrypt file",
    "unsupported tpmcrypt format version",
    "malformed header",
    "header authentication failed",
    "failed authentication",
    "truncated",
    "no identity matches",
    "could not be unwrapped",
];

// ---------------------------------------------------------------- helpers

fn scratch() -> TempDir {
    common::scratch("tpmcrypt-adv-")
}

/// Asserts exit `code` and exactly one stderr line `error: <label>: …`
/// that mentions every needle (case-insensitively).
fn assert_one_error(r: &Run, code: i32, label: &str, needles: &[&str], what: &str) {
    common::assert_error_line(r, code, Some(label), needles, what);
    // A cause is named once, not repeated along its chain.
    let lower = r.stderr.to_lowercase();
    for n in needles {
        assert_eq!(
            lower.matches(&n.to_lowercase()).count(),
            1,
            "{what}: {n:?} repeated in {:?}",
            r.stderr
        );
    }
}

/// Every regular file under `dir` (symlinks not followed), sorted.
fn walk_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let entry = entry.expect("entry");
            let ft = entry.file_type().expect("file type");
            if ft.is_dir() {
                stack.push(entry.path());
            } else if ft.is_file() {
                out.push(entry.path());
            }
        }
    }
    out.sort();
    out
}

/// Temporaries (`.NAME.tpmcrypt-partial.…`) anywhere under `dir`.
fn partials_under(dir: &Path) -> Vec<PathBuf> {
    walk_files(dir)
        .into_iter()
        .filter(|p| p.to_string_lossy().contains(PARTIAL_MARKER))
        .collect()
}

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn require_root(what: &str) {
    assert!(
        is_root(),
        "{what} needs root (to mount a tmpfs / run a client as another uid); \
         run the adversarial tests as root, e.g. in the CI container"
    );
}

/// The header length of a tpmcrypt file, from its bytes as
/// `docs/format.md` describes them (fixed 16, stanzas, 32-byte MAC).
fn header_len(ct: &[u8]) -> usize {
    let count = ct[15] as usize;
    let mut at = 16;
    for _ in 0..count {
        let len = u16::from_be_bytes([ct[at + 1], ct[at + 2]]) as usize;
        at += 3 + len;
    }
    at + 32
}

/// A ciphertext and where its parts are.
struct Parsed {
    ct: Vec<u8>,
    /// End of the tpmcrypt header (= start of the stream header).
    offset: usize,
    /// Stream header length.
    sh: usize,
    /// Byte ranges of the sealed segments (without the stream header).
    sealed: Vec<std::ops::Range<usize>>,
    /// Byte ranges of the segments as units of `segment size` bytes
    /// (for gcm, segment 0 includes the stream header).
    units: Vec<std::ops::Range<usize>>,
    layout: Layout,
}

fn parse_ct(ct: Vec<u8>, layout: Layout) -> Parsed {
    let offset = header_len(&ct);
    let sh = layout.stream_header();
    let base = if layout.cbc { offset + sh } else { offset };
    let mut units = Vec::new();
    let mut at = base;
    while at < ct.len() {
        let end = (at + layout.segment).min(ct.len());
        units.push(at..end);
        at = end;
    }
    let sealed = units
        .iter()
        .enumerate()
        .map(|(i, r)| {
            if i == 0 && !layout.cbc {
                r.start + sh..r.end
            } else {
                r.clone()
            }
        })
        .collect();
    Parsed {
        ct,
        offset,
        sh,
        sealed,
        units,
        layout,
    }
}

/// One damaged file and the causes its error line may give.
struct Case {
    name: String,
    bytes: Vec<u8>,
    causes: Vec<String>,
}

fn case(name: impl Into<String>, bytes: Vec<u8>, causes: &[&str]) -> Case {
    let causes = if causes.is_empty() { ANY_CAUSE } else { causes };
    Case {
        name: name.into(),
        bytes,
        causes: causes.iter().map(|s| s.to_string()).collect(),
    }
}

fn seg_failed(i: usize) -> String {
    format!("segment {i} failed authentication")
}

/// Every damaged variant of `a` (with `b` from the same session and `c`
/// from another session, all three of the same length and parameters).
fn corruption_cases(a: &Parsed, b: &Parsed, c: &Parsed) -> Vec<Case> {
    let ct = &a.ct;
    let n = a.units.len();
    assert_eq!(n, 3, "the matrix expects three segments");
    let mut cases = Vec::new();
    let flip = |at: usize| {
        let mut v = ct.clone();
        v[at] ^= 0x01;
        v
    };

    // Every header byte.
    for at in 0..a.offset {
        let causes: Vec<&str> = match at {
            0..=7 => vec!["not a tpmcrypt file"],
            8 => vec!["unsupported tpmcrypt format version"],
            _ if at >= a.offset - 32 => vec!["header authentication failed"],
            _ => vec![],
        };
        cases.push(case(format!("flip-header-{at:04}"), flip(at), &causes));
    }
    // Every stream header byte.
    for at in a.offset..a.offset + a.sh {
        let causes: Vec<&str> = if at == a.offset {
            vec!["malformed header"]
        } else {
            vec!["segment 0 failed authentication"]
        };
        cases.push(case(format!("flip-stream-{at:05}"), flip(at), &causes));
    }
    // First and last 32 bytes of every sealed segment (IVs and tags included).
    for (i, r) in a.sealed.iter().enumerate() {
        let mut at: BTreeSet<usize> = (r.start..r.start + 32).collect();
        at.extend(r.end - 32..r.end);
        let cause = seg_failed(i);
        for p in at {
            cases.push(case(format!("flip-seg{i}-{p:05}"), flip(p), &[&cause]));
        }
    }

    // Truncation at every boundary and one byte either side.
    let mut cuts = BTreeSet::new();
    let mut boundaries = vec![a.offset, a.offset + a.sh];
    boundaries.extend(a.units.iter().skip(1).map(|r| r.start));
    for b in &boundaries {
        cuts.extend([b - 1, *b, b + 1]);
    }
    cuts.insert(ct.len() - 1);
    for (i, r) in a.units.iter().enumerate() {
        let mid = (r.start + r.end) / 2;
        cases.push(case(format!("cut-mid-seg{i}"), ct[..mid].to_vec(), &[]));
    }
    for len in cuts {
        // A cut exactly at the end of segment k (not the last) is reported
        // as such.
        let at_unit_end = a.units[..n - 1].iter().position(|r| r.end == len);
        let msg;
        let causes: Vec<&str> = match at_unit_end {
            Some(k) => {
                msg = format!("truncated: the file ends after segment {k}");
                vec![msg.as_str()]
            }
            None => vec![],
        };
        cases.push(case(format!("cut-{len:05}"), ct[..len].to_vec(), &causes));
    }

    // Dropped, duplicated and reordered segments.
    let head = &ct[..a.units[0].start];
    let unit = |i: usize| &ct[a.units[i].clone()];
    let assemble = |order: &[usize]| {
        let mut v = head.to_vec();
        for &i in order {
            v.extend_from_slice(unit(i));
        }
        v
    };
    let truncated_after = |k: usize| format!("truncated: the file ends after segment {k}");
    for (name, order, cause) in [
        ("drop-0", vec![1, 2], None),
        ("drop-1", vec![0, 2], Some(seg_failed(1))),
        ("drop-2", vec![0, 1], Some(truncated_after(1))),
        ("dup-0", vec![0, 0, 1, 2], Some(seg_failed(1))),
        ("dup-1", vec![0, 1, 1, 2], Some(seg_failed(2))),
        ("dup-2", vec![0, 1, 2, 2], None),
        ("swap-01", vec![1, 0, 2], None),
        ("swap-12", vec![0, 2, 1], Some(seg_failed(1))),
        ("swap-02", vec![2, 1, 0], None),
        ("reverse-all", vec![2, 1, 0, 0], None),
    ] {
        let causes: Vec<&str> = cause.iter().map(String::as_str).collect();
        cases.push(case(name, assemble(&order), &causes));
    }

    // Splices from another file of the same session, and from another
    // session.
    for i in 0..n {
        let mut v = ct.clone();
        v[a.sealed[i].clone()].copy_from_slice(&b.ct[b.sealed[i].clone()]);
        cases.push(case(format!("splice-seg{i}"), v, &[&seg_failed(i)]));
    }
    let mut v = ct.clone();
    v[a.offset..a.offset + a.sh].copy_from_slice(&b.ct[b.offset..b.offset + b.sh]);
    cases.push(case(
        "splice-stream-header",
        v,
        &["segment 0 failed authentication"],
    ));
    let mut v = ct[..a.offset].to_vec();
    v.extend_from_slice(&b.ct[b.offset..b.units[0].end]);
    v.extend_from_slice(&ct[a.units[0].end..]);
    cases.push(case(
        "splice-stream-header-and-seg0",
        v,
        &["segment 1 failed authentication"],
    ));
    assert_eq!(a.offset, c.offset);
    let mut v = c.ct[..c.offset].to_vec();
    v.extend_from_slice(&ct[a.offset..]);
    cases.push(case(
        "header-of-other-session",
        v,
        &["segment 0 failed authentication"],
    ));

    // Appended data.
    for (name, extra) in [
        ("append-1", vec![0u8]),
        ("append-16", bytes(16, 3)),
        ("append-segment", bytes(4096, 4)),
        ("append-last-segment-again", unit(n - 1).to_vec()),
        (
            "append-other-files-last-segment",
            b.ct[b.units[n - 1].clone()].to_vec(),
        ),
    ] {
        let mut v = ct.clone();
        v.extend_from_slice(&extra);
        cases.push(case(name, v, &[]));
    }

    // Tiny and hostile files.
    let mut hdr = |name: &str, edit: &dyn Fn(&mut Vec<u8>), causes: &[&str]| {
        let mut v = ct.clone();
        edit(&mut v);
        cases.push(case(name, v, causes));
    };
    hdr(
        "segment-size-4g",
        &|v| v[11..15].copy_from_slice(&u32::MAX.to_be_bytes()),
        &["malformed header"],
    );
    hdr(
        "segment-size-16m-plus-1",
        &|v| v[11..15].copy_from_slice(&((16u32 << 20) + 1).to_be_bytes()),
        &["malformed header"],
    );
    // The largest size the parser takes, except where cbc needs the size
    // less the tag to be whole blocks (cbc-192).
    let max = 16usize << 20;
    let valid = !a.layout.cbc || (max - a.layout.key_len) % 16 == 0;
    hdr(
        "segment-size-16m",
        &|v| v[11..15].copy_from_slice(&(max as u32).to_be_bytes()),
        &[if valid {
            "header authentication failed"
        } else {
            "must be a multiple of 16"
        }],
    );
    hdr(
        "segment-size-0",
        &|v| v[11..15].copy_from_slice(&0u32.to_be_bytes()),
        &["malformed header"],
    );
    for count in [0u8, 65, 255] {
        hdr(
            &format!("stanza-count-{count}"),
            &|v| v[15] = count,
            &["malformed header"],
        );
    }
    for count in [2u8, 3, 64] {
        hdr(&format!("stanza-count-{count}"), &|v| v[15] = count, &[]);
    }
    for len in [0u16, 128, 130, 4096, 4097, u16::MAX] {
        hdr(
            &format!("stanza-length-{len}"),
            &|v| v[17..19].copy_from_slice(&len.to_be_bytes()),
            &[],
        );
    }
    hdr(
        "stanza-kind-unknown",
        &|v| v[16] = 0x7f,
        &["no identity matches"],
    );
    for (name, bytes, causes) in [
        ("zero-length", Vec::new(), vec!["not a tpmcrypt file"]),
        ("one-byte-magic", vec![0x89], vec!["not a tpmcrypt file"]),
        ("one-byte-x", b"x".to_vec(), vec!["not a tpmcrypt file"]),
        (
            "magic-only",
            ct[..8].to_vec(),
            vec!["ends inside the header"],
        ),
        ("fixed-header-only", ct[..16].to_vec(), vec![]),
        ("header-only", ct[..a.offset].to_vec(), vec![]),
        (
            "header-and-stream-header-only",
            ct[..a.offset + a.sh].to_vec(),
            vec![],
        ),
        (
            "plain-text",
            b"just some text\n".repeat(300),
            vec!["not a tpmcrypt file"],
        ),
        ("zeros", vec![0u8; ct.len()], vec!["not a tpmcrypt file"]),
    ] {
        cases.push(case(name, bytes, &causes));
    }
    cases
}

// ---------------------------------------------------------------- 1. corruption matrix

/// Every damaged variant of three-segment files (gcm and cbc, 128, 192 and
/// 256 bits) through one `decrypt -r` over all of them: every case refused with
/// exit 3, each named in exactly one error line that names its cause, no
/// output and no temporary anywhere; then a few cases alone to stdout, which
/// must stay empty when segment 0 is bad.
#[test]
fn corruption_matrix_is_refused_case_by_case() {
    let dir = scratch();
    let d = dir.path();
    let r = recovery(d, "id");
    fs::create_dir(d.join("cases")).unwrap();
    let mut all: BTreeMap<String, Case> = BTreeMap::new();
    let mut singles: Vec<(String, Vec<u8>)> = Vec::new();
    // Every mode and key size. A cbc segment minus its tag must be whole
    // blocks, so cbc-192 (a 24-byte tag) takes 4104 bytes instead of 4096.
    for (mode, bits, segment) in [
        ("gcm", 128u32, 4096usize),
        ("gcm", 192, 4096),
        ("gcm", 256, 4096),
        ("cbc", 128, 4096),
        ("cbc", 192, 4104),
        ("cbc", 256, 4096),
    ] {
        let layout = Layout::new(mode, bits, segment);
        let segment_s = segment.to_string();
        let len = layout.plain(0) + layout.plain(1) + 100;
        let tag = format!("{mode}{bits}");
        let src = d.join(format!("src-{tag}"));
        fs::create_dir(&src).unwrap();
        let (pa, pb, pc) = (bytes(len, 1), bytes(len, 2), bytes(len, 3));
        fs::write(src.join("a"), &pa).unwrap();
        fs::write(src.join("b"), &pb).unwrap();
        fs::write(src.join("c"), &pc).unwrap();
        let bits_s = bits.to_string();
        let common = [
            "encrypt",
            "-R",
            &r,
            "--mode",
            mode,
            "--bits",
            &bits_s,
            "--segment-size",
            &segment_s,
        ];
        let mut one_session = common.to_vec();
        one_session.extend(["a", "b"]);
        assert_ok(&run(&src, &one_session), "encrypt a b");
        let mut other = common.to_vec();
        other.push("c");
        assert_ok(&run(&src, &other), "encrypt c");
        let read = |n: &str| parse_ct(fs::read(src.join(n)).unwrap(), layout);
        let (a, b, c) = (read("a.tpmc"), read("b.tpmc"), read("c.tpmc"));
        // The layout assumptions hold, and the intact file decrypts.
        let expect_len = a.offset
            + layout.stream_header()
            + layout.sealed(layout.plain(0))
            + layout.sealed(layout.plain(1))
            + layout.sealed(100);
        assert_eq!(a.ct.len(), expect_len, "{tag}: ciphertext length");
        assert_eq!(a.ct[..a.offset], b.ct[..b.offset], "{tag}: one session");
        assert_ne!(a.ct[..a.offset], c.ct[..c.offset], "{tag}: two sessions");
        let ok = run(&src, &["decrypt", "-i", "../id", "-o", "-", "a.tpmc"]);
        assert_ok(&ok, &format!("{tag}: intact"));
        assert!(ok.stdout == pa, "{tag}: intact file round trip");

        let sub = d.join("cases").join(&tag);
        fs::create_dir(&sub).unwrap();
        for cs in corruption_cases(&a, &b, &c) {
            assert_ne!(cs.bytes, a.ct, "{tag}/{}: not damaged", cs.name);
            let rel = format!("cases/{tag}/{}.tpmc", cs.name);
            fs::write(d.join(&rel), &cs.bytes).unwrap();
            let first_seg0_flip = cs.name == format!("flip-seg0-{:05}", a.sealed[0].start);
            if first_seg0_flip
                || [
                    "flip-header-0179",
                    "cut-mid-seg0",
                    "drop-0",
                    "splice-seg0",
                    "splice-stream-header",
                    "header-of-other-session",
                ]
                .contains(&cs.name.as_str())
            {
                singles.push((format!("{tag}-{}", cs.name), cs.bytes.clone()));
            }
            assert!(all.insert(rel, cs).is_none(), "duplicate case name");
        }
    }

    // One run over all of them.
    let started = Instant::now();
    let res = run(d, &["decrypt", "-i", "id", "-r", "cases"]);
    let took = started.elapsed();
    assert_eq!(res.code, INTEGRITY, "exit code of the bulk run");
    let mut named: BTreeMap<&str, usize> = BTreeMap::new();
    for line in res.stderr.lines() {
        let rest = line
            .strip_prefix("error: ")
            .unwrap_or_else(|| panic!("stray stderr line {line:?}"));
        let (file, cause) = rest
            .split_once(": ")
            .unwrap_or_else(|| panic!("no cause in {line:?}"));
        let cs = all
            .get(file)
            .unwrap_or_else(|| panic!("error line for an unknown file: {line:?}"));
        assert!(
            cs.causes.iter().any(|c| cause.contains(c.as_str())),
            "{file}: cause {cause:?} is none of {:?}",
            cs.causes
        );
        let key = all.get_key_value(file).expect("known").0;
        *named.entry(key.as_str()).or_default() += 1;
    }
    let refused = all
        .keys()
        .filter(|k| named.get(k.as_str()) == Some(&1))
        .count();
    for k in all.keys() {
        assert_eq!(
            named.get(k.as_str()),
            Some(&1),
            "{k}: not named in exactly one error line"
        );
    }
    // Nothing was written: every file under cases/ is a case.
    let files = walk_files(&d.join("cases"));
    assert_eq!(files.len(), all.len(), "outputs or temporaries were left");
    assert!(partials_under(d).is_empty(), "temporaries left");
    println!(
        "corruption matrix: {} cases tried, {refused} refused (exit 3, one line each), \
         no output, no temporary; one decrypt -r run in {:.2} s",
        all.len(),
        took.as_secs_f64()
    );
    assert_eq!(refused, all.len());

    // Segment 0 (or the header) bad: nothing at all on stdout, whatever
    // the number of workers, from a file or from stdin.
    fs::create_dir(d.join("single")).unwrap();
    for (name, data) in &singles {
        let file = format!("single/{name}.tpmc");
        fs::write(d.join(&file), data).unwrap();
        for jobs in ["1", "2"] {
            let res = run(d, &["decrypt", "-i", "id", "-j", jobs, "-o", "-", &file]);
            assert_one_error(&res, INTEGRITY, &file, &[], name);
            assert!(res.stdout.is_empty(), "{name} -j {jobs}: stdout written");
        }
        let res = common::run_stdin(d, &["decrypt", "-i", "id"], data);
        assert_one_error(&res, INTEGRITY, "<stdin>", &[], name);
        assert!(res.stdout.is_empty(), "{name} from stdin: stdout written");
    }
    assert_eq!(singles.len(), 6 * 7, "single cases");
    println!(
        "corruption matrix: {} cases decrypted alone to stdout (-j 1, -j 2, stdin): \
         stdout empty",
        singles.len()
    );
}

// ---------------------------------------------------------------- 2. disk full

/// A command whose child may write at most `limit` bytes per file, with
/// SIGXFSZ ignored so that write(2) returns EFBIG instead of killing it.
fn with_fsize_limit(mut cmd: Command, limit: u64) -> Command {
    // SAFETY: setrlimit and signal are async-signal-safe; nothing else runs
    // between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: limit as libc::rlim_t,
                rlim_max: limit as libc::rlim_t,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    cmd
}

/// A 2 MiB tmpfs mounted for the test, unmounted on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Tmpfs {
        fs::create_dir_all(at).unwrap();
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0755"),
                "tmpfs",
            ])
            .arg(at)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "mount -t tmpfs failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs(at.to_path_buf())
    }

    fn used_kib(&self) -> u64 {
        // SAFETY: a zeroed statvfs is a valid out-parameter.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        let path = std::ffi::CString::new(self.0.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: valid path and out-pointer.
        assert_eq!(unsafe { libc::statvfs(path.as_ptr(), &mut st) }, 0);
        (st.f_blocks - st.f_bfree) * st.f_frsize / 1024
    }

    /// The space used once it has fallen to `at_most` KiB, or after 10 s
    /// with the processes that hold a file on this mount. A file unlinked
    /// here stays allocated while any process has it open, and that
    /// includes, for a moment, a child another test thread is forking:
    /// the child holds a copy of every descriptor this process has open
    /// until its exec closes them. So one reading just after an unlink
    /// can see the space still in use although nothing leaks.
    fn used_kib_settled(&self, at_most: u64) -> (u64, Vec<String>) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let used = self.used_kib();
            if used <= at_most || Instant::now() > deadline {
                return (used, self.holders());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// "PID COMMAND -> FILE" for every descriptor open on this mount.
    fn holders(&self) -> Vec<String> {
        let mut out = Vec::new();
        let Ok(procs) = fs::read_dir("/proc") else {
            return out;
        };
        for p in procs.flatten() {
            let pid = p.file_name().to_string_lossy().into_owned();
            if !pid.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let Ok(fds) = fs::read_dir(p.path().join("fd")) else {
                continue;
            };
            for fd in fds.flatten() {
                let Ok(target) = fs::read_link(fd.path()) else {
                    continue;
                };
                if target.starts_with(&self.0) {
                    let comm = fs::read_to_string(p.path().join("comm")).unwrap_or_default();
                    out.push(format!("{pid} {} -> {}", comm.trim(), target.display()));
                }
            }
        }
        out
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Encrypting or decrypting onto a full disk (a 2 MiB tmpfs, ENOSPC) or
/// past RLIMIT_FSIZE (EFBIG): one clear line, exit 1, the input untouched
/// (also with --in-place), nothing under the final name, no temporary, and
/// the space given back.
#[test]
fn disk_full_leaves_nothing_behind() {
    require_root("disk_full_leaves_nothing_behind");
    let dir = scratch();
    let d = dir.path();
    let r = recovery(d, "id");
    let big = bytes(3 << 20, 7);
    fs::write(d.join("big"), &big).unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", &r, "-o", "ct.tpmc", "big"]),
        "encrypt",
    );
    let ct = fs::read(d.join("ct.tpmc")).unwrap();

    // RLIMIT_FSIZE of 1 MiB: EFBIG.
    let limited = |args: &[&str]| -> Run {
        let mut cmd = with_fsize_limit(tpmcrypt(d), 1 << 20);
        cmd.args(args).output().expect("spawn").into()
    };
    // Each line names the output that could not be written, and whose
    // data it was.
    let res = limited(&["encrypt", "-R", &r, "-o", "out.tpmc", "big"]);
    let of_big = "cannot write the ciphertext of big";
    assert_one_error(
        &res,
        OTHER,
        "out.tpmc",
        &["file too large", of_big],
        "rlimit encrypt",
    );
    println!("RLIMIT_FSIZE: {}", res.stderr.trim());
    let res = limited(&["encrypt", "-R", &r, "big"]);
    assert_one_error(
        &res,
        OTHER,
        "big.tpmc",
        &["file too large", of_big],
        "rlimit encrypt",
    );
    let res = limited(&["decrypt", "-i", "id", "-o", "plain", "ct.tpmc"]);
    assert_one_error(
        &res,
        OTHER,
        "plain",
        &["file too large", "cannot write the plaintext of ct.tpmc"],
        "rlimit decrypt",
    );
    let res = limited(&["encrypt", "-R", &r, "-j", "2", "--in-place", "big"]);
    assert_one_error(
        &res,
        OTHER,
        "big.tpmc",
        &["file too large", of_big],
        "rlimit in-place",
    );
    assert_eq!(
        listing(d),
        vec!["big", "ct.tpmc", "id"],
        "rlimit: outputs or temporaries left"
    );
    assert!(fs::read(d.join("big")).unwrap() == big, "input changed");
    assert!(fs::read(d.join("ct.tpmc")).unwrap() == ct, "input changed");

    // A real full disk: ENOSPC.
    let full = Tmpfs::mount(&d.join("full"), "2m");
    let before = full.used_kib();
    let f = "full/out.tpmc";
    let res = run(d, &["encrypt", "-R", &r, "-o", f, "big"]);
    assert_one_error(
        &res,
        OTHER,
        f,
        &["no space left on device", of_big],
        "ENOSPC encrypt",
    );
    println!("disk full: {}", res.stderr.trim());
    let res = run(d, &["decrypt", "-i", "id", "-o", "full/plain", "ct.tpmc"]);
    assert_one_error(
        &res,
        OTHER,
        "full/plain",
        &["no space left", "cannot write the plaintext of ct.tpmc"],
        "ENOSPC decrypt",
    );
    // In place, on the full file system itself: the original survives.
    let middle = bytes(1200 << 10, 8);
    fs::write(d.join("full/f"), &middle).unwrap();
    let res = run(d, &["encrypt", "-R", &r, "--in-place", "full/f"]);
    assert_one_error(
        &res,
        OTHER,
        "full/f.tpmc",
        &["no space left", "cannot write the ciphertext of full/f"],
        "ENOSPC in-place",
    );
    assert!(
        fs::read(d.join("full/f")).unwrap() == middle,
        "original lost"
    );
    assert_eq!(listing(&d.join("full")), vec!["f"], "ENOSPC: leftovers");
    fs::remove_file(d.join("full/f")).unwrap();
    let (used, holders) = full.used_kib_settled(before + 4);
    assert!(
        used <= before + 4,
        "space not given back: {used} KiB used, {before} KiB before; held by {holders:?}"
    );
    assert!(fs::read(d.join("big")).unwrap() == big, "input changed");
    // /dev/full as the output, and as stdout.
    let res = run(d, &["encrypt", "-R", &r, "-o", "/dev/full", "big"]);
    assert_one_error(
        &res,
        OTHER,
        "/dev/full",
        &["no space left", of_big],
        "ENOSPC /dev/full",
    );
    let dev_full = fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("open /dev/full");
    let res: Run = tpmcrypt(d)
        .args(["decrypt", "-i", "id", "-o", "-", "ct.tpmc"])
        .stdout(dev_full)
        .output()
        .expect("spawn")
        .into();
    assert_one_error(
        &res,
        OTHER,
        "<stdout>",
        &["no space left", "cannot write the plaintext of ct.tpmc"],
        "ENOSPC stdout",
    );
    assert_eq!(
        listing(d),
        vec!["big", "ct.tpmc", "full", "id"],
        "leftovers"
    );
    // The same commands succeed once there is room.
    let small = bytes(100 << 10, 9);
    fs::write(d.join("small"), &small).unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", &r, "-o", "full/s.tpmc", "small"]),
        "encrypt with room",
    );
    let back = run(d, &["decrypt", "-i", "id", "-o", "-", "full/s.tpmc"]);
    assert_ok(&back, "decrypt with room");
    assert!(back.stdout == small);
    println!(
        "disk full: 4 EFBIG (RLIMIT_FSIZE), 3 ENOSPC (2 MiB tmpfs) and 2 ENOSPC (/dev/full) runs \
         refused cleanly, each line naming the output"
    );
}

// ---------------------------------------------------------------- 3. key never on disk

fn find(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Files under `dir` that contain the key (raw, or in hex).
fn files_holding(dir: &Path, key: &[u8]) -> (usize, Vec<PathBuf>) {
    let hex_lower = hex::encode(key);
    let hex_upper = hex_lower.to_uppercase();
    let files = walk_files(dir);
    let holding = files
        .iter()
        .filter(|p| {
            let data = fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            find(&data, key)
                || find(&data, hex_lower.as_bytes())
                || find(&data, hex_upper.as_bytes())
        })
        .cloned()
        .collect();
    (files.len(), holding)
}

fn reveal(dir: &Path, file: &str, id: &str) -> Vec<u8> {
    let res = run(
        dir,
        &["inspect", "--json", "-i", id, "--reveal-session-key", file],
    );
    assert_ok(&res, "inspect --reveal-session-key");
    let v: Value = serde_json::from_slice(&res.stdout).expect("JSON");
    let key = hex::decode(v["session_key"].as_str().expect("session_key")).expect("hex");
    assert_eq!(key.len(), 32);
    key
}

fn assert_key_not_on_disk(dir: &Path, key: &[u8], what: &str) -> usize {
    // The scan finds a planted copy: it would see a leak.
    let plant = dir.join("planted");
    fs::write(&plant, [b"xx".as_slice(), key].concat()).unwrap();
    let (_, found) = files_holding(dir, key);
    assert_eq!(found, vec![plant.clone()], "{what}: scan self-check");
    fs::remove_file(&plant).unwrap();
    let (n, found) = files_holding(dir, key);
    assert!(found.is_empty(), "{what}: session key found in {found:?}");
    n
}

/// The session key appears in no file the tool wrote: outputs, identities,
/// the keystore, the simulator's state, temporaries of in-place runs.
#[test]
fn session_key_never_reaches_disk() {
    // Recovery identity only.
    let dir = scratch();
    let d = dir.path();
    let r = recovery(d, "id");
    fs::write(d.join("big"), bytes(5 << 20, 5)).unwrap();
    fs::write(d.join("small"), bytes(1000, 6)).unwrap();
    fs::write(d.join("inplace"), bytes(70_000, 7)).unwrap();
    assert_ok(
        &run(
            d,
            &["encrypt", "-R", &r, "-j", "2", "big", "small", "inplace"],
        ),
        "encrypt",
    );
    let key = reveal(d, "big.tpmc", "id");
    assert_eq!(reveal(d, "inplace.tpmc", "id"), key, "one session");
    assert_ok(
        &run(
            d,
            &[
                "decrypt", "-i", "id", "-j", "2", "-o", "big.out", "big.tpmc",
            ],
        ),
        "decrypt big",
    );
    assert_ok(
        &run(d, &["decrypt", "-i", "id", "-o", "small.out", "small.tpmc"]),
        "decrypt small",
    );
    fs::remove_file(d.join("inplace")).unwrap();
    assert_ok(
        &run(d, &["decrypt", "-i", "id", "--in-place", "inplace.tpmc"]),
        "decrypt --in-place",
    );
    let n1 = assert_key_not_on_disk(d, &key, "recovery identity");

    // A TPM key (simulator): keystore and swtpm state included.
    let dir = scratch();
    let d = dir.path();
    let r = recovery(d, "id");
    let sim = |args: &[&str]| {
        let mut full = vec!["--simulator"];
        full.extend_from_slice(args);
        run(d, &full)
    };
    assert_ok(&sim(&["key", "create", "k"]), "key create --simulator");
    fs::write(d.join("f"), bytes(300_000, 8)).unwrap();
    assert_ok(
        &run(d, &["encrypt", "--key", "k", "-R", &r, "f"]),
        "encrypt --key",
    );
    let res = sim(&["-v", "decrypt", "-o", "f.out", "f.tpmc"]);
    assert_ok(&res, "decrypt with the TPM key");
    assert!(
        res.stderr.contains("1 TPM unbind(s)"),
        "the TPM key was not used: {}",
        res.stderr
    );
    let key = reveal(d, "f.tpmc", "id");
    assert!(
        d.join(".tpmcrypt-home/simulator").is_dir(),
        "no simulator state"
    );
    let n2 = assert_key_not_on_disk(d, &key, "TPM key on --simulator");
    println!(
        "session key on disk: scanned {n1} files (recovery identity) and {n2} files \
         (TPM key, keystore and swtpm state): raw and hex key in none"
    );
}

// ---------------------------------------------------------------- 4. agent peer uid

/// A `tpmcrypt agent` child, killed (by its own pid) if the test ends early.
struct AgentProc(Option<Child>);

impl AgentProc {
    fn alive(&mut self) -> bool {
        self.0
            .as_mut()
            .map(|c| c.try_wait().expect("try_wait").is_none())
            .unwrap_or(false)
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

/// Connects to the agent socket, sends `request` (hex), prints `CONNECTED`
/// once connected and `RESP:<hex>` with everything received.
const AGENT_CLIENT: &str = r#"
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
s.connect(sys.argv[1])
print("CONNECTED", flush=True)
try:
    s.sendall(bytes.fromhex(sys.argv[2]))
    s.shutdown(socket.SHUT_WR)
except OSError:
    pass
data = b""
while True:
    try:
        chunk = s.recv(256)
    except OSError:
        break
    if not chunk:
        break
    data += chunk
print("RESP:" + data.hex())
"#;

const NOBODY: u32 = 65534;

/// Runs the Python agent client, as `uid` if given; returns the response.
fn agent_request(dir: &Path, sock: &Path, request: &[u8], uid: Option<u32>) -> Vec<u8> {
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.arg("-c")
        .arg(AGENT_CLIENT)
        .arg(sock)
        .arg(hex::encode(request))
        .current_dir(dir)
        .env_clear()
        .stdin(Stdio::null());
    if let Some(uid) = uid {
        cmd.uid(uid).gid(uid);
    }
    let out = cmd
        .output()
        .expect("run /usr/bin/python3 (install python3)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines().any(|l| l == "CONNECTED"),
        "uid {uid:?} could not connect (the test must get past file permissions): {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let resp = text
        .lines()
        .find_map(|l| l.strip_prefix("RESP:"))
        .unwrap_or_else(|| panic!("no response line: {text}"));
    hex::decode(resp).expect("hex")
}

/// The agent answers only its own uid: with the socket made world-writable,
/// uid 65534 connects but gets no byte back (not even for PING, or GET of a
/// key the agent holds), cannot stop it, and cannot decrypt through it;
/// root's requests keep working. The socket is 0600 in a 0700 directory as
/// created.
#[test]
fn agent_refuses_other_uids() {
    require_root("agent_refuses_other_uids");
    let dir = scratch();
    let d = dir.path();
    let run_dir = d.join("run");
    let sock = run_dir.join("agent.sock");
    let cmd = || {
        let mut c = tpmcrypt(d);
        c.env("TPMCRYPT_AGENT_SOCK", &sock);
        c
    };
    let r = recovery(d, "id");
    recovery(d, "other");
    fs::write(d.join("f"), bytes(20_000, 9)).unwrap();
    let res: Run = cmd()
        .args(["encrypt", "-R", &r, "f"])
        .output()
        .unwrap()
        .into();
    assert_ok(&res, "encrypt");

    let mut agent = AgentProc(Some(
        cmd()
            .args(["agent", "--ttl", "5m"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn tpmcrypt agent"),
    ));
    // Its mode is set just after the bind: looked at once it is set (or
    // at the deadline, when the assertions below say what it is).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !common::agent_socket_ready(&sock) && Instant::now() < deadline {
        assert!(agent.alive(), "agent exited at once");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        fs::symlink_metadata(&sock).unwrap().file_type().is_socket(),
        "not a socket"
    );
    assert_eq!(mode_of(&sock), 0o600, "socket mode as created");
    assert_eq!(mode_of(&run_dir), 0o700, "socket directory mode as created");

    // Root puts the session key into the agent, as a decrypt with a TPM
    // key does (a recovery key's is not offered: it unwraps in memory).
    let key = reveal(d, "f.tpmc", "id");
    let ct = fs::read(d.join("f.tpmc")).unwrap();
    let digest = openssl::sha::sha256(&ct[16..header_len(&ct) - 32]);
    let ping = [1u8, 4];
    let mut get = vec![1u8, 1];
    get.extend_from_slice(&digest);
    let mut put = vec![1u8, 2];
    put.extend_from_slice(&digest);
    put.extend_from_slice(&key);
    // PING: status, keys held, shared encryption sessions held.
    assert_eq!(
        agent_request(d, &sock, &ping, None),
        [0, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(agent_request(d, &sock, &put, None), [0], "root PUT");
    assert_eq!(
        agent_request(d, &sock, &ping, None),
        [0, 0, 0, 0, 1, 0, 0, 0, 0]
    );
    let mut want = vec![0u8];
    want.extend_from_slice(&key);
    assert_eq!(agent_request(d, &sock, &get, None), want, "root GET");

    // Open every file permission; only SO_PEERCRED stands in the way.
    chmod(d, 0o755);
    chmod(&run_dir, 0o755);
    chmod(&sock, 0o666);
    chmod(&d.join("other"), 0o644);
    chmod(&d.join("f.tpmc"), 0o644);
    for (what, req) in [
        ("PING", &ping[..]),
        ("GET", &get[..]),
        ("STOP", &[1, 3][..]),
    ] {
        let resp = agent_request(d, &sock, req, Some(NOBODY));
        assert!(resp.is_empty(), "uid {NOBODY} {what}: got {resp:?}");
        assert!(agent.alive(), "agent died after uid {NOBODY} {what}");
    }
    let as_nobody = |args: &[&str]| -> Run {
        let mut c = cmd();
        c.uid(NOBODY).gid(NOBODY).args(args);
        c.output().expect("spawn tpmcrypt as nobody").into()
    };
    let res = as_nobody(&["agent", "--stop"]);
    assert_eq!(res.code, OTHER, "nobody's agent --stop: {}", res.stderr);
    assert!(agent.alive(), "nobody stopped the agent");
    // With an identity that is not a recipient, only the agent could help.
    let res = as_nobody(&["decrypt", "-i", "other", "-o", "-", "f.tpmc"]);
    // Root's agent directory is not nobody's: its client sends nothing there
    // and says so, then fails for want of an identity.
    let (warning, rest) = res.stderr.split_once('\n').unwrap_or_default();
    assert!(
        warning.starts_with("warning: not using the agent: ")
            && warning.contains("owned by uid 0, not by you (uid 65534)"),
        "{}",
        res.stderr
    );
    let res = Run {
        stderr: rest.to_string(),
        ..res
    };
    assert_one_error(
        &res,
        INTEGRITY,
        "f.tpmc",
        &["no identity matches"],
        "nobody via agent",
    );
    assert!(res.stdout.is_empty());
    let res: Run = cmd()
        .args(["decrypt", "-i", "other", "-o", "-", "f.tpmc"])
        .output()
        .unwrap()
        .into();
    assert_ok(&res, "root via agent with a non-recipient identity");
    assert_eq!(
        agent_request(d, &sock, &ping, None),
        [0, 0, 0, 0, 1, 0, 0, 0, 0]
    );

    let res: Run = cmd().args(["agent", "--stop"]).output().unwrap().into();
    assert_ok(&res, "agent --stop");
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.alive() {
        assert!(Instant::now() < deadline, "agent did not stop");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!sock.exists(), "socket left after stop");
    println!(
        "agent: uid {NOBODY} got 0 bytes for PING, GET and STOP; root served before and after"
    );
}

// ---------------------------------------------------------------- 5. TPM goes away

/// Writes `data` into the FIFO at `path` once `reader` has opened it
/// (never blocks on a reader that died).
fn write_fifo(path: &Path, data: &[u8], reader: &mut Child) {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut f = loop {
        match fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
        {
            Ok(f) => break f,
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
                assert!(
                    reader.try_wait().unwrap().is_none(),
                    "the reader exited before opening the FIFO"
                );
                assert!(Instant::now() < deadline, "nobody opened the FIFO");
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("open FIFO: {e}"),
        }
    };
    // SAFETY: a valid fd; clears O_NONBLOCK so write_all blocks normally.
    unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, 0) };
    f.write_all(data).unwrap();
}

/// The swtpm stops between two sessions of one `decrypt` run (the run is
/// held on a FIFO input while the TPM goes): the first session's file is
/// written, every later file fails with exit 4 and one clear line, inputs
/// untouched, no outputs; after a restart from the same state (new ports)
/// everything decrypts.
#[test]
fn tpm_going_away_mid_run() {
    let dir = scratch();
    let d = dir.path();
    let state = d.join("swtpm");
    let sim = Simulator::start(&state)
        .unwrap_or_else(|e| panic!("cannot start swtpm (install the swtpm package): {e}"));
    let tcti = sim.tcti();
    assert_ok(
        &run(d, &["--tpm", &tcti, "key", "create", "k"]),
        "key create",
    );
    let plain: Vec<Vec<u8>> = (0..4)
        .map(|i| bytes(50_000 + i * 1000, 20 + i as u64))
        .collect();
    for (i, p) in plain.iter().enumerate() {
        fs::write(d.join(format!("f{i}")), p).unwrap();
    }
    // Three sessions: f0 | f1 f2 | f3.
    assert_ok(&run(d, &["encrypt", "--key", "k", "f0"]), "encrypt f0");
    assert_ok(
        &run(d, &["encrypt", "--key", "k", "f1", "f2"]),
        "encrypt f1 f2",
    );
    assert_ok(&run(d, &["encrypt", "--key", "k", "f3"]), "encrypt f3");
    for i in 0..4 {
        fs::remove_file(d.join(format!("f{i}"))).unwrap();
    }
    let cts: Vec<Vec<u8>> = (0..4)
        .map(|i| fs::read(d.join(format!("f{i}.tpmc"))).unwrap())
        .collect();
    // f1.tpmc reaches the run through a FIFO, so the run waits there.
    fs::rename(d.join("f1.tpmc"), d.join("f1.data")).unwrap();
    let fifo = std::ffi::CString::new(d.join("f1.tpmc").as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0, "mkfifo");

    // One file at a time (-j 1), so that the TPM goes away between files
    // (with workers, f2 and f3 would be done before the FIFO is fed).
    let mut child = tpmcrypt(d)
        .args([
            "--tpm", &tcti, "decrypt", "-j", "1", "f0.tpmc", "f1.tpmc", "f2.tpmc", "f3.tpmc",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn decrypt");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !d.join("f0").exists() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "decrypt ended before the FIFO"
        );
        assert!(Instant::now() < deadline, "f0 never decrypted");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The TPM goes away, then the run goes on.
    let port = sim.port();
    sim.stop();
    // Its ports stay closed until the restart below (which must find new
    // ones): freed, the kernel could give them to the next bind on the
    // machine, another test's swtpm, which then answered `key create`.
    let held = [port, port + 1].map(|p| {
        common::hold_closed(p)
            .unwrap_or_else(|e| panic!("hold the stopped swtpm's port {p} closed: {e}"))
    });
    write_fifo(&d.join("f1.tpmc"), &cts[1], &mut child);
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("decrypt hung after the TPM went away");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let res: Run = child.wait_with_output().unwrap().into();
    assert_eq!(res.code, TPM, "exit code; stderr: {}", res.stderr);
    let lines: Vec<&str> = res.stderr.lines().collect();
    assert_eq!(lines.len(), 3, "one line per failed file: {:?}", res.stderr);
    // The TCTI given with --tpm, what was lost, and why now.
    for (line, f) in lines.iter().zip(["f1.tpmc", "f2.tpmc", "f3.tpmc"]) {
        assert_eq!(
            *line,
            format!(
                "error: {f}: TPM unreachable ({tcti}): connection lost during CreatePrimary \
                 (storage root key); a new connection fails: connection refused"
            ),
            "TPM-gone line"
        );
    }
    assert!(fs::read(d.join("f0")).unwrap() == plain[0], "f0 decrypted");
    for i in [2usize, 3] {
        assert!(
            fs::read(d.join(format!("f{i}.tpmc"))).unwrap() == cts[i],
            "input changed"
        );
        assert!(!d.join(format!("f{i}")).exists(), "output f{i} written");
    }
    assert!(!d.join("f1").exists(), "output f1 written");
    assert!(partials_under(d).is_empty(), "temporaries left");
    let gone_line = lines[0].to_string();

    // Never reachable (swtpm is down): one line per file, exit 4.
    let res = run(d, &["--tpm", &tcti, "decrypt", "f2.tpmc", "f3.tpmc"]);
    assert_eq!(res.code, TPM, "unreachable: {}", res.stderr);
    let lines: Vec<&str> = res.stderr.lines().collect();
    assert_eq!(lines.len(), 2, "one line per file: {:?}", res.stderr);
    for (line, f) in lines.iter().zip(["f2.tpmc", "f3.tpmc"]) {
        let want = format!(
            "error: {f}: TPM unreachable ({tcti}): connection refused. Check that the TPM \
             simulator runs at that address, or select another TPM with --tpm / TPMCRYPT_TCTI. "
        );
        assert!(
            line.starts_with(&want),
            "{line:?} does not start with {want:?}"
        );
        assert!(line.contains("--simulator"), "{line:?}");
    }
    let res = run(d, &["--tpm", &tcti, "key", "create", "k2"]);
    assert_eq!(res.code, TPM, "key create, unreachable: {}", res.stderr);
    let want = format!("error: TPM unreachable ({tcti}): connection refused. ");
    assert!(
        res.stderr.starts_with(&want) && res.stderr.lines().count() == 1,
        "{:?} does not start with {want:?}",
        res.stderr
    );
    assert!(!d.join("f2").exists() && !d.join("f3").exists(), "outputs");
    assert!(partials_under(d).is_empty(), "temporaries left");
    let unreachable_line = res.stderr.trim().to_string();

    // Same state, new ports: everything decrypts.
    fs::remove_file(d.join("f1.tpmc")).unwrap();
    fs::rename(d.join("f1.data"), d.join("f1.tpmc")).unwrap();
    fs::remove_file(d.join("f0")).unwrap();
    let sim = Simulator::start(&state).expect("restart swtpm");
    assert_ne!(sim.tcti(), tcti, "expected new ports");
    drop(held);
    let res = run(
        d,
        &[
            "--tpm",
            &sim.tcti(),
            "-v",
            "decrypt",
            "f0.tpmc",
            "f1.tpmc",
            "f2.tpmc",
            "f3.tpmc",
        ],
    );
    assert_ok(&res, "decrypt after restart");
    assert!(
        res.stderr.contains("3 TPM unbind(s)"),
        "three sessions: {}",
        res.stderr
    );
    for (i, p) in plain.iter().enumerate() {
        assert!(fs::read(d.join(format!("f{i}"))).unwrap() == *p, "f{i}");
    }
    println!(
        "TPM gone mid-run: 1 file done before, 3 refused with exit 4 ({gone_line:?}); \
         unreachable: {unreachable_line:?}; all 4 after restart"
    );
}

// ---------------------------------------------------------------- 6. racing runs

/// Two `encrypt -o same.tpmc` runs fed by slow pipes, both mid-write at
/// once (both temporaries seen): exactly one wins, the other reports that
/// the output exists (exit 1) and leaves no temporary; the output decrypts
/// to one input, complete.
#[test]
fn concurrent_runs_on_one_output() {
    let dir = scratch();
    let d = dir.path();
    let r = recovery(d, "id");
    let rounds = 4;
    for round in 0..rounds {
        let inputs = [
            bytes(300_000, 100 + round as u64),
            bytes(310_000, 200 + round as u64),
        ];
        let out = format!("same{round}.tpmc");
        let mut children: Vec<Child> = (0..2)
            .map(|_| {
                tpmcrypt(d)
                    .args(["encrypt", "-R", &r, "-o", &out])
                    .stdin(Stdio::piped())
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("spawn encrypt")
            })
            .collect();
        let mut stdins: Vec<_> = children.iter_mut().map(|c| c.stdin.take()).collect();
        for (s, data) in stdins.iter_mut().zip(&inputs) {
            s.as_mut()
                .expect("stdin")
                .write_all(&data[..100_000])
                .unwrap();
        }
        // Both are writing their outputs now (with no name yet, or under
        // a temporary one where the file system cannot do that).
        let deadline = Instant::now() + Duration::from_secs(20);
        let here = d.canonicalize().unwrap();
        loop {
            let n = children
                .iter()
                .filter(|c| common::has_a_file_open_in(c.id(), &here))
                .count();
            if n == 2 {
                break;
            }
            assert!(Instant::now() < deadline, "round {round}: {n} outputs open");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!d.join(&out).exists());
        // The one finishing first differs by round.
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let mut s = stdins[i].take().expect("stdin");
            s.write_all(&inputs[i][100_000..]).unwrap();
            drop(s);
            std::thread::sleep(Duration::from_millis(30));
        }
        let results: Vec<Run> = children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap().into())
            .collect();
        let winners: Vec<usize> = (0..2).filter(|&i| results[i].code == OK).collect();
        assert_eq!(
            winners.len(),
            1,
            "round {round}: exactly one run must win: {:?} / {:?}",
            results[0].stderr,
            results[1].stderr
        );
        let loser = &results[1 - winners[0]];
        assert_one_error(
            loser,
            OTHER,
            "<stdin>",
            &["already exists"],
            &format!("round {round} loser"),
        );
        let back = run(d, &["decrypt", "-i", "id", "-o", "-", &out]);
        assert_ok(&back, "decrypt the surviving output");
        assert!(
            back.stdout == inputs[0] || back.stdout == inputs[1],
            "round {round}: the output is neither input ({} bytes)",
            back.stdout.len()
        );
        assert!(partials_under(d).is_empty(), "round {round}: temporaries");
    }
    println!("racing runs: {rounds} rounds, one winner and one 'already exists' each");
}

// ---------------------------------------------------------------- 7. permissions

/// A tpmcrypt command run with umask 0: modes must come from the tool, not
/// from the umask.
fn with_umask(mut cmd: Command, mask: u32) -> Command {
    // SAFETY: umask is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            libc::umask(mask as libc::mode_t);
            Ok(())
        });
    }
    cmd
}

/// Outputs keep the input's mode (never wider), identities are 0600, the
/// keystore 0700 with 0600 key files, even with umask 0.
#[test]
fn permissions_are_never_wider() {
    let dir = scratch();
    let d = dir.path();
    let u0 = |args: &[&str]| -> Run {
        let mut c = with_umask(tpmcrypt(d), 0);
        c.args(args).output().expect("spawn").into()
    };
    let u = |mask: u32, args: &[&str], input: &[u8]| -> Run {
        let mut c = with_umask(tpmcrypt(d), mask);
        let mut child = c
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        child.stdin.take().unwrap().write_all(input).unwrap();
        child.wait_with_output().unwrap().into()
    };
    let res = u0(&["recovery", "create", "--out", "id"]);
    assert_ok(&res, "recovery create");
    assert_eq!(mode_of(&d.join("id")), 0o600, "identity file");
    let r = String::from_utf8(res.stdout).unwrap().trim().to_string();
    let mut checked = 1;
    for mode in [0o600, 0o400, 0o640, 0o604] {
        let name = format!("m{mode:o}");
        fs::write(d.join(&name), b"secret").unwrap();
        chmod(&d.join(&name), mode);
        assert_ok(&u0(&["encrypt", "-R", &r, &name]), "encrypt");
        let ct = d.join(format!("{name}.tpmc"));
        assert_eq!(mode_of(&ct), mode, "{name}.tpmc");
        assert_ok(
            &u0(&[
                "decrypt",
                "-i",
                "id",
                "-o",
                &format!("{name}.out"),
                &format!("{name}.tpmc"),
            ]),
            "decrypt",
        );
        assert_eq!(mode_of(&d.join(format!("{name}.out"))), mode, "{name}.out");
        let ip = format!("{name}.ip");
        fs::write(d.join(&ip), b"secret").unwrap();
        chmod(&d.join(&ip), mode);
        assert_ok(&u0(&["encrypt", "-R", &r, "--in-place", &ip]), "in place");
        assert_eq!(mode_of(&d.join(format!("{ip}.tpmc"))), mode, "{ip}.tpmc");
        assert_ok(
            &u0(&["decrypt", "-i", "id", "--in-place", &format!("{ip}.tpmc")]),
            "in place back",
        );
        assert_eq!(mode_of(&d.join(&ip)), mode, "{ip}");
        checked += 4;
    }
    // From stdin there is no input mode: the umask decides.
    let res = u(0o077, &["encrypt", "-R", &r, "-o", "stdin.tpmc"], b"x");
    assert_ok(&res, "encrypt stdin");
    assert_eq!(mode_of(&d.join("stdin.tpmc")), 0o600, "stdin, umask 077");
    checked += 1;

    // Keystore with a simulator key, umask 0.
    let res = u0(&["--simulator", "key", "create", "k"]);
    assert_ok(&res, "key create --simulator");
    let store = d.join(".tpmcrypt-home");
    assert_eq!(mode_of(&store), 0o700, "keystore directory");
    assert_eq!(mode_of(&store.join("k.key.pem")), 0o600, "k.key.pem");
    checked += 2;
    let sim_dir = store.join("simulator");
    assert_eq!(mode_of(&sim_dir), 0o700, "simulator state directory");
    checked += 1;
    // swtpm's state files and lock file are 0600 too.
    for f in walk_files(&store) {
        let m = mode_of(&f);
        let name = f.to_string_lossy();
        if f.starts_with(&sim_dir) {
            assert_eq!(m, 0o600, "{name}: simulator state file ({m:o})");
        } else if name.ends_with(".key.pem") || name.ends_with(".json") {
            assert_eq!(m, 0o600, "{name}");
        } else {
            assert_eq!(m & 0o022, 0, "{name}: writable by others ({m:o})");
        }
        checked += 1;
    }
    println!("permissions: {checked} modes checked with umask 0");
}

// ---------------------------------------------------------------- 8. kill -9 with -o

/// What one kill -9 loop saw.
#[derive(Default, Debug)]
struct KillCounts {
    trials: usize,
    /// Killed while writing: a temporary left, nothing under the final name.
    mid_write: usize,
    /// Killed before the output was started.
    before: usize,
    /// The run had finished (or was past its rename).
    done: usize,
}

/// `encrypt -o OUT IN` and `decrypt -o OUT IN` (not in place) killed with
/// SIGKILL at random moments (self-adjusting delay so that kills land
/// while the output is written): after each kill OUT is absent or complete
/// and correct byte for byte — never partial —, the input is unchanged,
/// and a kill while the output was written leaves nothing beside it (the
/// output has no name until complete; where the file system cannot do
/// that, the temporary `.OUT.tpmcrypt-partial.PID.*` left is removed by the
/// next run), and the next run writes OUT completely.
#[test]
fn kill_9_during_encrypt_and_decrypt_to_an_output() {
    let dir = scratch();
    let d = dir.path();
    let r = recovery(d, "id");
    let id_text = fs::read_to_string(d.join("id")).unwrap();
    let plain = bytes(16 << 20, 81);
    fs::write(d.join("plain"), &plain).unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", &r, "-o", "ct.tpmc", "plain"]),
        "encrypt the decrypt loop's input",
    );
    let ct = fs::read(d.join("ct.tpmc")).unwrap();
    let want = common::kill_trials();
    let mut rng = Rng(0x6b11_9d1e_0a5e_ed01);
    let started = Instant::now();
    let mut report = Vec::new();
    for op in ["encrypt", "decrypt"] {
        let out_dir = d.join(format!("out-{op}"));
        fs::create_dir(&out_dir).unwrap();
        let out_dir_real = out_dir.canonicalize().unwrap();
        let out = out_dir.join("OUT");
        let out_s = out.to_str().unwrap().to_string();
        let (args, input, input_bytes): (Vec<&str>, &str, &[u8]) = if op == "encrypt" {
            (
                vec!["encrypt", "-q", "-R", &r, "-o", &out_s, "plain"],
                "plain",
                &plain,
            )
        } else {
            (
                vec!["decrypt", "-q", "-i", "id", "-o", &out_s, "ct.tpmc"],
                "ct.tpmc",
                &ct,
            )
        };
        // OUT as it must be when present: the plaintext, or a ciphertext
        // that decrypts to it.
        let check_out = |what: &str| {
            let got = if op == "encrypt" {
                common::decrypt_in_process(&id_text, &out)
            } else {
                fs::read(&out).unwrap()
            };
            assert!(
                got == plain,
                "{op}, {what}: OUT is not complete and correct"
            );
        };
        let mut n = KillCounts::default();
        let mut delay = KillDelay::new(30_000, 1000, 2_000_000); // µs
        while n.trials < want || (n.mid_write == 0 && n.trials < 3 * want) {
            n.trials += 1;
            let t = n.trials;
            let mut child = tpmcrypt(d)
                .args(&args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn tpmcrypt");
            std::thread::sleep(Duration::from_micros(delay.pick(&mut rng)));
            // Writing its output (which may have no name yet) when killed.
            let writing = common::has_a_file_open_in(child.id(), &out_dir_real);
            let _ = child.kill();
            let status = child.wait().unwrap();

            assert!(
                fs::read(d.join(input)).unwrap() == input_bytes,
                "{op} trial {t}: input changed"
            );
            let names = listing(&out_dir);
            let partial_prefix = format!(".OUT{PARTIAL_MARKER}");
            let partials = names
                .iter()
                .filter(|n| n.starts_with(&partial_prefix))
                .count();
            assert!(
                names
                    .iter()
                    .all(|n| n == "OUT" || n.starts_with(&partial_prefix)),
                "{op} trial {t}: unexpected files {names:?}"
            );
            if out.exists() {
                check_out(&format!("trial {t}"));
                assert_eq!(partials, 0, "{op} trial {t}: temporary beside OUT");
                n.done += 1;
                delay.finished();
                fs::remove_file(&out).unwrap();
                continue;
            }
            assert!(
                !status.success(),
                "{op} trial {t}: exit 0 without an output"
            );
            if partials == 0 && !writing {
                n.before += 1;
                delay.not_begun();
                continue;
            }
            // Killed mid-write: an output with no name yet leaves nothing;
            // a temporary is cleaned up by the next run, which succeeds.
            n.mid_write += 1;
            assert_ok(&run(d, &args), &format!("{op} trial {t}: next run"));
            check_out(&format!("trial {t}, next run"));
            assert_eq!(
                listing(&out_dir),
                vec!["OUT"],
                "{op} trial {t}: the next run left temporaries"
            );
            fs::remove_file(&out).unwrap();
        }
        assert!(
            n.mid_write > 0,
            "{op}: no kill landed while the output was written in {} trials",
            n.trials
        );
        report.push(format!(
            "{op} -o: {} trials, {} killed mid-write (temporary cleaned by the next run), \
             {} before the output, {} after it was complete",
            n.trials, n.mid_write, n.before, n.done
        ));
    }
    for line in &report {
        println!("kill -9 {line}");
    }
    println!("kill -9 -o loops: {:.1} s", started.elapsed().as_secs_f64());
}

// ---------------------------------------------------------------- 9. TPM reset, DA lockout

/// After a refused run: every ciphertext unchanged, no output, no
/// temporary, nothing left loaded in the TPM.
fn assert_nothing_lost(d: &Path, sim: &Simulator, cts: &[(String, Vec<u8>)], what: &str) {
    for (name, data) in cts {
        assert!(
            fs::read(d.join(name)).unwrap() == *data,
            "{what}: {name} changed"
        );
        let out = name.strip_suffix(".tpmc").expect("a .tpmc name");
        assert!(!d.join(out).exists(), "{what}: output {out} written");
    }
    assert!(partials_under(d).is_empty(), "{what}: temporaries left");
    let held = tpm_handles(sim, d);
    assert!(held.is_empty(), "{what}: the TPM still holds {held:?}");
}

/// The value extended into the PCR before the keys are created.
const PCR16_EXTEND: &str =
    "16:sha256=5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed";

/// A TPM reset (swtpm stopped and started on the same state: PCRs back to
/// their reset value) under keys bound to an extended PCR: decrypt exits 4
/// with one line per file naming the PCR mismatch, writes nothing, leaves
/// the inputs and the TPM clean; extending the PCR to the same value again
/// makes every file decrypt.
#[test]
fn tpm_reset_clears_the_pcr_and_re_extending_restores_access() {
    let dir = scratch();
    let d = dir.path();
    let state = d.join("swtpm");
    let sim = Simulator::start(&state)
        .unwrap_or_else(|e| panic!("cannot start swtpm (install the swtpm package): {e}"));
    tpm2_tool(&sim, d, &["tpm2_pcrextend", PCR16_EXTEND]);
    let extended = tpm2_tool(&sim, d, &["tpm2_pcrread", "sha256:16"]);
    for (name, alg) in [("e", "ecc-p256"), ("r", "rsa2048")] {
        let res = run(
            d,
            &[
                "--tpm",
                &sim.tcti(),
                "key",
                "create",
                name,
                "--alg",
                alg,
                "--pcrs",
                "sha256:16",
            ],
        );
        assert_ok(&res, &format!("key create {name}"));
    }
    let plain: Vec<Vec<u8>> = (0..2).map(|i| bytes(40_000 + i, 90 + i as u64)).collect();
    for (i, key) in ["e", "r"].iter().enumerate() {
        fs::write(d.join(format!("f{i}")), &plain[i]).unwrap();
        assert_ok(
            &run(d, &["encrypt", "--key", key, &format!("f{i}")]),
            "encrypt",
        );
        fs::remove_file(d.join(format!("f{i}"))).unwrap();
    }
    let cts: Vec<(String, Vec<u8>)> = (0..2)
        .map(|i| {
            let name = format!("f{i}.tpmc");
            let data = fs::read(d.join(&name)).unwrap();
            (name, data)
        })
        .collect();
    let res = run(d, &["--tpm", &sim.tcti(), "decrypt", "-o", "-", "f0.tpmc"]);
    assert_ok(&res, "decrypt before the reset");
    assert!(res.stdout == plain[0]);

    // Power cycle: same state directory, PCRs back to zero.
    sim.stop();
    let sim = Simulator::start(&state).expect("restart swtpm");
    let tcti = sim.tcti();
    let after = tpm2_tool(&sim, d, &["tpm2_pcrread", "sha256:16"]);
    assert_ne!(after, extended, "PCR 16 survived the reset");
    assert!(after.contains(&format!("0x{}", "0".repeat(64))), "{after}");

    let started = Instant::now();
    let res = run(d, &["--tpm", &tcti, "decrypt", "f0.tpmc", "f1.tpmc"]);
    let took = started.elapsed();
    assert_eq!(res.code, TPM, "after the reset: {}", res.stderr);
    let lines: Vec<&str> = res.stderr.lines().collect();
    assert_eq!(lines.len(), 2, "one line per file: {:?}", res.stderr);
    for (line, f) in lines.iter().zip(["f0.tpmc", "f1.tpmc"]) {
        let want = format!(
            "error: {f}: the PCR values changed since the key was created (key is bound to \
             PCRs sha256:16); the TPM refuses to use it in the current boot state."
        );
        assert!(line.starts_with(&want), "{line:?} is not {want:?}…");
    }
    assert_nothing_lost(d, &sim, &cts, "after the reset");

    // The same measurement again: the keys work.
    tpm2_tool(&sim, d, &["tpm2_pcrextend", PCR16_EXTEND]);
    assert_eq!(tpm2_tool(&sim, d, &["tpm2_pcrread", "sha256:16"]), extended);
    let res = run(d, &["--tpm", &tcti, "-v", "decrypt", "f0.tpmc", "f1.tpmc"]);
    assert_ok(&res, "decrypt after re-extending");
    assert!(res.stderr.contains("2 TPM unbind(s)"), "{}", res.stderr);
    for (i, p) in plain.iter().enumerate() {
        assert!(fs::read(d.join(format!("f{i}"))).unwrap() == *p, "f{i}");
    }
    assert!(tpm_handles(&sim, d).is_empty(), "handles after success");
    println!(
        "TPM reset: PCR 16 back to 0, 2 files (ECC and RSA keys) refused with exit 4 in \
         {:.2} s ({:?}); after re-extending, both decrypt",
        took.as_secs_f64(),
        lines[0]
    );
}

/// Wrong PINs until the TPM locks out (max-tries 2): every run exits 4
/// with one line (wrong PIN, then lockout, also for the right PIN), writes
/// nothing, changes no input and leaves the TPM clean; once the lockout is
/// cleared (`tpm2_dictionarylockout --clear-lockout`), the next run with
/// the right PIN decrypts everything.
#[test]
fn dictionary_attack_lockout_loses_nothing_and_the_next_run_works() {
    let dir = scratch();
    let d = dir.path();
    let sim = Simulator::start(&d.join("swtpm"))
        .unwrap_or_else(|e| panic!("cannot start swtpm (install the swtpm package): {e}"));
    let tcti = sim.tcti();
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
    let res: Run = tpmcrypt(d)
        .args(["--tpm", &tcti, "key", "create", "p", "--pin"])
        .env("TPMCRYPT_PIN", "7391")
        .output()
        .expect("spawn")
        .into();
    assert_ok(&res, "key create --pin");
    let plain = [bytes(30_000, 95), bytes(70_000, 96)];
    fs::write(d.join("a"), &plain[0]).unwrap();
    fs::write(d.join("b"), &plain[1]).unwrap();
    assert_ok(&run(d, &["encrypt", "--key", "p", "a"]), "encrypt a");
    assert_ok(&run(d, &["encrypt", "--key", "p", "b"]), "encrypt b");
    fs::remove_file(d.join("a")).unwrap();
    fs::remove_file(d.join("b")).unwrap();
    let cts: Vec<(String, Vec<u8>)> = ["a.tpmc", "b.tpmc"]
        .iter()
        .map(|n| (n.to_string(), fs::read(d.join(n)).unwrap()))
        .collect();
    let decrypt = |pin: &str| -> Run {
        tpmcrypt(d)
            .args(["--tpm", &tcti, "decrypt", "a.tpmc"])
            .env("TPMCRYPT_PIN", pin)
            .output()
            .expect("spawn")
            .into()
    };

    let mut wrong = 0;
    let lockout = loop {
        let res = decrypt("0000");
        assert_nothing_lost(d, &sim, &cts, &format!("wrong PIN #{}", wrong + 1));
        if res.stderr.contains("is in dictionary-attack lockout") {
            break res;
        }
        assert_one_error(
            &res,
            TPM,
            "a.tpmc",
            &["wrong PIN for this key"],
            "wrong PIN",
        );
        wrong += 1;
        assert!(
            wrong <= 2,
            "no lockout after {wrong} wrong PINs (max-tries 2)"
        );
    };
    assert_eq!(wrong, 2, "lockout after exactly max-tries wrong PINs");
    common::assert_error_line(
        &lockout,
        TPM,
        Some("a.tpmc"),
        &["is in dictionary-attack lockout", "600 seconds"],
        "lockout",
    );
    let res = decrypt("7391");
    common::assert_error_line(
        &res,
        TPM,
        Some("a.tpmc"),
        &["is in dictionary-attack lockout"],
        "right PIN during lockout",
    );
    assert_nothing_lost(d, &sim, &cts, "right PIN during lockout");

    tpm2_tool(&sim, d, &["tpm2_dictionarylockout", "--clear-lockout"]);
    let res: Run = tpmcrypt(d)
        .args(["--tpm", &tcti, "-v", "decrypt", "a.tpmc", "b.tpmc"])
        .env("TPMCRYPT_PIN", "7391")
        .output()
        .expect("spawn")
        .into();
    assert_ok(&res, "decrypt after the lockout is cleared");
    assert!(fs::read(d.join("a")).unwrap() == plain[0], "a");
    assert!(fs::read(d.join("b")).unwrap() == plain[1], "b");
    assert!(tpm_handles(&sim, d).is_empty(), "handles after success");
    println!(
        "DA lockout: {wrong} wrong PINs, then lockout ({:?}) also for the right PIN; \
         nothing written or lost; after --clear-lockout both files decrypt",
        lockout.stderr.trim()
    );
}
