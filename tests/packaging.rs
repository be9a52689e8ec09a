//! End-to-end tests of what packaging ships from the binary itself:
//! `--version` (version, backends, tpm2-tss) and the man pages written by
//! the hidden `tpmcrypt man-pages DIR`. The Debian package as installed is
//! checked by scripts/package-check (run by ./scripts/test).

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::process::Command;

use common::{assert_ok, run};

/// `--version` is three lines: the version, the backends compiled in with
/// the default of each mode, and tpm2-tss as built against and as loaded
/// (a file that exists); `-V` stays one line.
#[test]
fn version_names_backends_and_tpm2_tss() {
    let dir = tempfile::tempdir().unwrap();
    let r = run(dir.path(), &["--version"]);
    assert_ok(&r, "--version");
    let text = String::from_utf8(r.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert_eq!(lines[0], concat!("tpmcrypt ", env!("CARGO_PKG_VERSION")));
    let backends = lines[1].strip_prefix("backends: ").expect(lines[1]);
    for name in ["openssl", "ring", "rustcrypto", "aws-lc"] {
        assert!(backends.contains(name), "{backends}");
    }
    let gcm = format!(
        "(default: {} for AES-128-GCM",
        common::default_gcm_backend()
    );
    assert!(backends.contains(&gcm), "{backends}");
    let built = pkg_config_esys_version();
    let tss = lines[2];
    assert!(
        tss.starts_with(&format!("tpm2-tss {built} (built against); loaded: /")),
        "{tss} (pkg-config says {built})"
    );
    let loaded = tss.split("loaded: ").nth(1).unwrap();
    assert!(Path::new(loaded).is_file(), "{loaded}");
    assert!(loaded.contains("libtss2-esys.so"), "{loaded}");

    let r = run(dir.path(), &["-V"]);
    assert_ok(&r, "-V");
    assert_eq!(
        String::from_utf8(r.stdout).unwrap(),
        concat!("tpmcrypt ", env!("CARGO_PKG_VERSION"), "\n")
    );
}

fn pkg_config_esys_version() -> String {
    let out = Command::new("pkg-config")
        .args(["--modversion", "tss2-esys"])
        .output()
        .expect("pkg-config");
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// The subcommands `tpmcrypt [path…] --help` lists under "Commands:",
/// without `help`.
fn listed_subcommands(dir: &Path, path: &[&str]) -> Vec<String> {
    let mut args: Vec<&str> = path.to_vec();
    args.push("--help");
    let r = run(dir, &args);
    assert_ok(&r, "--help");
    let text = String::from_utf8(r.stdout).unwrap();
    let Some(start) = text.find("\nCommands:\n") else {
        return Vec::new();
    };
    text[start + "\nCommands:\n".len()..]
        .lines()
        .take_while(|l| l.starts_with("  "))
        // A wrapped description continues further in.
        .filter(|l| !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect()
}

/// Every page the help tree calls for: `tpmcrypt.1`, `tpmcrypt-key.1`,
/// `tpmcrypt-key-create.1`, …
fn pages_from_help(dir: &Path, path: &mut Vec<String>, out: &mut BTreeSet<String>) {
    let name = std::iter::once("tpmcrypt".to_owned())
        .chain(path.iter().cloned())
        .collect::<Vec<_>>()
        .join("-");
    out.insert(format!("{name}.1"));
    let args: Vec<&str> = path.iter().map(String::as_str).collect();
    for sub in listed_subcommands(dir, &args) {
        path.push(sub);
        pages_from_help(dir, path, out);
        path.pop();
    }
}

/// `tpmcrypt man-pages DIR` writes exactly one page per command that
/// `--help` lists, at every depth, and each renders with `man -l` without
/// a warning; the hidden command itself is in neither help nor pages.
#[test]
fn man_pages_cover_the_help_tree_and_render() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("man/man1");
    let r = run(dir.path(), &["man-pages", out.to_str().unwrap()]);
    assert_ok(&r, "man-pages");
    // `--help` is help, and another option a usage error: neither makes a
    // directory of that name (the build before wrote 26 pages into
    // `./--help`).
    let r = run(dir.path(), &["man-pages", "--help"]);
    assert_ok(&r, "man-pages --help");
    assert!(String::from_utf8_lossy(&r.stdout).contains("Usage: tpmcrypt man-pages DIR"));
    let r = run(dir.path(), &["man-pages", "-x"]);
    common::assert_error_line(&r, 2, None, &["not an option", "./-x"], "man-pages -x");
    assert!(!dir.path().join("--help").exists() && !dir.path().join("-x").exists());
    let mut expected = BTreeSet::new();
    pages_from_help(dir.path(), &mut Vec::new(), &mut expected);
    assert!(expected.contains("tpmcrypt-key-create.1"), "{expected:?}");
    assert!(!expected.iter().any(|p| p.contains("man-pages")));
    let written: BTreeSet<String> = fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(written, expected);
    for page in &written {
        let r = Command::new("man")
            .args(["--warnings", "-E", "UTF-8", "-l"])
            .arg(out.join(page))
            .env("MANWIDTH", "80")
            .output()
            .expect("man (man-db, installed by scripts/setup-deps)");
        let stderr = String::from_utf8_lossy(&r.stderr);
        assert!(r.status.success() && stderr.is_empty(), "{page}: {stderr}");
        let text = String::from_utf8_lossy(&r.stdout);
        assert!(text.contains(page.trim_end_matches(".1")), "{page}: {text}");
    }
    // Nor in any completion script (a hidden subcommand would still be
    // offered there).
    for shell in ["bash", "zsh", "fish"] {
        let r = run(dir.path(), &["completions", shell]);
        assert_ok(&r, shell);
        let script = String::from_utf8_lossy(&r.stdout);
        assert!(!script.contains("man-pages"), "{shell} completes man-pages");
    }
    // The version is in each page's footer, so a page shows what it is of.
    let top = fs::read_to_string(out.join("tpmcrypt.1")).unwrap();
    assert!(top.contains(env!("CARGO_PKG_VERSION")), "{top}");
}
