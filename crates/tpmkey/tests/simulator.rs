//! The simulator's state is private: the directory 0700, every file swtpm
//! writes in it 0600, whatever the umask, also for a directory and lock
//! file left wider by an older version.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use tpmcrypt_tpmkey::{KeyAlg, Simulator, Tpm};

fn mode(p: &Path) -> u32 {
    fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .permissions()
        .mode()
        & 0o7777
}

/// Starts swtpm in `state`, makes it write its state (a key is created, the
/// simulator stopped cleanly), and checks every mode; returns the files seen.
fn check_state_modes(state: &Path) -> Vec<String> {
    let sim = Simulator::start(state).expect("start swtpm (install the swtpm package)");
    {
        let mut tpm = Tpm::open(&sim.tcti()).expect("open swtpm");
        tpm.create_key(KeyAlg::EccP256, None, None)
            .expect("create a key");
    }
    // The lock file exists while swtpm runs.
    assert_eq!(mode(&state.join(".lock")), 0o600, ".lock while running");
    sim.stop();
    assert_eq!(mode(state), 0o700, "state directory");
    let mut names = Vec::new();
    for entry in fs::read_dir(state).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        assert!(entry.file_type().unwrap().is_file(), "{name}: not a file");
        assert_eq!(mode(&entry.path()), 0o600, "{name}");
        names.push(name);
    }
    names.sort();
    assert!(
        names.iter().any(|n| n.ends_with(".permall")),
        "no permanent state written: {names:?}"
    );
    names
}

#[test]
fn state_is_0700_and_files_0600_whatever_the_umask() {
    // Made before the umask is cleared: a directory every user may write
    // to is no place for a TPM's state, and is refused.
    let dir = tempfile::tempdir().unwrap();
    // Only test in this binary: the umask is process-wide.
    // SAFETY: umask cannot fail.
    let old = unsafe { libc::umask(0) };

    // Fresh state directory.
    let fresh = dir.path().join("fresh/state");
    let names = check_state_modes(&fresh);
    println!("fresh state: 0700, files 0600: {names:?}");

    // A directory and files made wider than that (e.g. by an older
    // tpmcrypt whose swtpm wrote 0640 files and a 0660 lock file).
    fs::set_permissions(&fresh, fs::Permissions::from_mode(0o755)).unwrap();
    for entry in fs::read_dir(&fresh).unwrap() {
        let p = entry.unwrap().path();
        let wide = if p.ends_with(".lock") { 0o660 } else { 0o640 };
        fs::set_permissions(&p, fs::Permissions::from_mode(wide)).unwrap();
    }
    let names = check_state_modes(&fresh);
    println!("tightened state: 0700, files 0600: {names:?}");

    // SAFETY: umask cannot fail.
    unsafe { libc::umask(old) };
}
