//! Interoperability with Google Tink: the `gcm` payload of a tpmcrypt file
//! is Tink's AES-GCM-HKDF streaming AEAD, byte for byte (ikm = session key,
//! HKDF-SHA256, derived key size = key_bits / 8, the header's ciphertext
//! segment size, associated data = the file's first `payload_offset` bytes).
//!
//! `tests/tink_decrypt.py` drives the Python Tink library using only what
//! `tpmcrypt inspect --json -i ID --reveal-session-key` prints and the file's
//! bytes. Python with tink comes from `TPMCRYPT_TEST_PYTHON` if set, or else
//! from a venv created once under the cargo target directory
//! (`python3 -m venv` + `pip install tink`). Missing Python, venv, pip or
//! tink is a test failure, never a skip.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use common::{assert_ok, bytes, recovery, run};
use serde_json::Value;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/tink_decrypt.py");

fn has_tink(python: &Path) -> bool {
    Command::new(python)
        .args(["-c", "import tink; from tink import streaming_aead"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn describe(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs a setup step; a failure panics with what to install.
fn setup_step(what: &str, cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| {
        panic!(
            "tink interop setup: cannot run {what} ({e}). The Tink interop test needs \
             python3 with the venv module and network access to PyPI, or \
             TPMCRYPT_TEST_PYTHON pointing at a python that can `import tink`."
        )
    });
    assert!(
        out.status.success(),
        "tink interop setup: {what} failed. The Tink interop test needs python3 with \
         the venv module and network access to PyPI (pip install tink), or \
         TPMCRYPT_TEST_PYTHON pointing at a python that can `import tink`.\n{}",
        describe(&out)
    );
}

fn create_venv() -> PathBuf {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tink-venv");
    let python = venv.join("bin/python");
    if has_tink(&python) {
        return python;
    }
    // Built under a private name and renamed into place, so that concurrent
    // test runs never see a half-made venv.
    let tmp = PathBuf::from(format!("{}.tmp.{}", venv.display(), std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(tmp.parent().expect("parent")).expect("create target tmp dir");
    setup_step(
        "`python3 -m venv`",
        Command::new("python3").arg("-m").arg("venv").arg(&tmp),
    );
    setup_step(
        "`pip install tink`",
        Command::new(tmp.join("bin/python")).args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "tink",
        ]),
    );
    assert!(
        has_tink(&tmp.join("bin/python")),
        "tink interop setup: `import tink` fails after pip install tink"
    );
    if !has_tink(&python) {
        let _ = fs::remove_dir_all(&venv);
        if let Err(e) = fs::rename(&tmp, &venv) {
            assert!(has_tink(&python), "cannot move the venv into place: {e}");
        }
    }
    let _ = fs::remove_dir_all(&tmp);
    assert!(
        has_tink(&python),
        "the venv at {} has no tink",
        venv.display()
    );
    python
}

/// A python interpreter that can `import tink`.
fn python() -> &'static Path {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| match std::env::var_os("TPMCRYPT_TEST_PYTHON") {
        Some(p) => {
            let p = PathBuf::from(p);
            assert!(
                has_tink(&p),
                "TPMCRYPT_TEST_PYTHON={} cannot `import tink` (pip install tink)",
                p.display()
            );
            p
        }
        None => create_venv(),
    })
}

fn script(dir: &Path, args: &[&str]) -> Output {
    Command::new(python())
        .current_dir(dir)
        .arg(SCRIPT)
        .args(args)
        .output()
        .expect("run tink_decrypt.py")
}

/// Writes `inspect --json -i id --reveal-session-key` of `file` to
/// `<file>.json` and returns it parsed.
fn reveal(dir: &Path, file: &str) -> Value {
    let r = run(
        dir,
        &[
            "inspect",
            "--json",
            "-i",
            "id",
            "--reveal-session-key",
            file,
        ],
    );
    assert_ok(&r, "inspect --reveal-session-key");
    fs::write(dir.join(format!("{file}.json")), &r.stdout).unwrap();
    let info: Value = serde_json::from_slice(&r.stdout).unwrap();
    assert_eq!(info["mode"], "gcm");
    assert_eq!(info["hkdf_hash"], "SHA256");
    assert_eq!(info["tink_compatible"], true);
    assert_eq!(info["session_key"].as_str().unwrap().len(), 64);
    info
}

/// Tink decrypts `file` (exit 0) and the plaintext is returned.
fn tink_decrypt(dir: &Path, file: &str) -> Vec<u8> {
    let out = format!("{file}.tink-plain");
    let o = script(dir, &["decrypt", &format!("{file}.json"), file, &out]);
    assert!(
        o.status.success(),
        "tink could not decrypt {file}: {}",
        describe(&o)
    );
    fs::read(dir.join(out)).unwrap()
}

#[test]
fn tink_decrypts_tpmcrypt_gcm_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let r = recovery(d, "id");
    let mut checked = 0;
    for bits in [128u32, 256] {
        let bits_s = bits.to_string();
        // Plaintext bytes in segment 0 and the next ones with 4 KiB segments.
        let p0 = 4096 - (1 + bits as usize / 8 + 7) - 16;
        let p = 4096 - 16;
        for (seg, sizes) in [
            (None, vec![0usize, 1, 1_200_000]),
            (Some("4096"), vec![1, p0, p0 + 2 * p, 50_000]),
        ] {
            let mut args = vec!["encrypt", "-R", &r, "--bits", &bits_s];
            if let Some(seg) = seg {
                args.extend(["--segment-size", seg]);
            }
            let names: Vec<String> = sizes
                .iter()
                .map(|len| {
                    let name = format!("b{bits}-s{}-{len}", seg.unwrap_or("default"));
                    fs::write(d.join(&name), bytes(*len, *len as u64 + 1)).unwrap();
                    name
                })
                .collect();
            args.extend(names.iter().map(String::as_str));
            assert_ok(&run(d, &args), "encrypt");
            for (name, len) in names.iter().zip(&sizes) {
                let file = format!("{name}.tpmc");
                let info = reveal(d, &file);
                assert_eq!(info["key_bits"], bits);
                assert_eq!(
                    info["segment_size"],
                    seg.map_or(1u64 << 20, |s| s.parse::<u64>().unwrap())
                );
                let plain = tink_decrypt(d, &file);
                assert_eq!(plain.len(), *len, "{file}: length");
                assert!(
                    plain == fs::read(d.join(name)).unwrap(),
                    "{file}: Tink's plaintext differs from the original"
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 14);
}

#[test]
fn tink_rejects_a_modified_header_or_payload() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let r = recovery(d, "id");
    let data = bytes(20_000, 3);
    fs::write(d.join("p"), &data).unwrap();
    assert_ok(
        &run(
            d,
            &[
                "encrypt",
                "-R",
                &r,
                "--segment-size",
                "4096",
                "-o",
                "f.tpmc",
                "p",
            ],
        ),
        "encrypt",
    );
    let info = reveal(d, "f.tpmc");
    let offset = info["payload_offset"].as_u64().unwrap() as usize;
    // Unmodified, Tink accepts it: the rejections below are about the change.
    assert!(tink_decrypt(d, "f.tpmc") == data);

    // One flipped byte of the associated data (the tpmcrypt header),
    // anywhere in it: magic, parameters, stanza, MAC.
    for at in [0, 12, 20, offset / 2, offset - 1] {
        let at_s = at.to_string();
        let o = script(
            d,
            &[
                "decrypt",
                "f.tpmc.json",
                "f.tpmc",
                "rejected",
                "--flip-ad-byte",
                &at_s,
            ],
        );
        assert_eq!(
            o.status.code(),
            Some(3),
            "Tink accepted the payload with header byte {at} flipped: {}",
            describe(&o)
        );
        assert!(!d.join("rejected").exists());
    }
    // One flipped payload byte (segment 2).
    let mut ct = fs::read(d.join("f.tpmc")).unwrap();
    ct[offset + 2 * 4096 + 100] ^= 0x01;
    fs::write(d.join("g.tpmc"), &ct).unwrap();
    fs::copy(d.join("f.tpmc.json"), d.join("g.tpmc.json")).unwrap();
    let o = script(d, &["decrypt", "g.tpmc.json", "g.tpmc", "rejected"]);
    assert_eq!(o.status.code(), Some(3), "{}", describe(&o));
}

/// The other direction: Tink encrypts under a tpmcrypt session (its header
/// as associated data), tpmcrypt decrypts header ‖ Tink ciphertext.
#[test]
fn tpmcrypt_decrypts_tink_ciphertext() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let r = recovery(d, "id");
    fs::write(d.join("seed"), b"template").unwrap();
    for (bits, seg) in [("128", "4096"), ("256", "1048576")] {
        let template = format!("t{bits}.tpmc");
        assert_ok(
            &run(
                d,
                &[
                    "encrypt",
                    "-R",
                    &r,
                    "--bits",
                    bits,
                    "--segment-size",
                    seg,
                    "-o",
                    &template,
                    "seed",
                ],
            ),
            "template",
        );
        reveal(d, &template);
        for len in [0usize, 1, 30_000, 1_100_000] {
            let plain = format!("plain-{bits}-{len}");
            let data = bytes(len, len as u64 + 99);
            fs::write(d.join(&plain), &data).unwrap();
            let out = format!("{plain}.tpmc");
            let o = script(
                d,
                &[
                    "encrypt",
                    &format!("{template}.json"),
                    &template,
                    &plain,
                    &out,
                ],
            );
            assert!(o.status.success(), "tink encrypt: {}", describe(&o));
            let dec = run(d, &["decrypt", "-i", "id", "-o", "-", &out]);
            assert_ok(&dec, &format!("tpmcrypt decrypting Tink's {out}"));
            assert!(dec.stdout == data, "{out}: plaintext differs");
        }
    }
}
