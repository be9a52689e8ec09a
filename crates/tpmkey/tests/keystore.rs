//! Keystore files, permissions and metadata, with keys from a real swtpm.

mod common;

use std::os::unix::fs::PermissionsExt;

use common::*;
use tpmcrypt_tpmkey::{KeyAlg, KeyMeta, Keystore, PcrSelection};

fn mode(p: &std::path::Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn save_load_list_delete() {
    let sim = start();
    let mut tpm = sim.open();
    let sel = PcrSelection::parse("sha256:0,7").unwrap();
    let blob = tpm
        .create_key(KeyAlg::EccP256, Some(&sel), Some(b"42"))
        .unwrap();
    let info = tpm.info().unwrap();
    let mut meta = KeyMeta::for_key("work", &blob).unwrap();
    meta.srk_name = Some(tpm.srk_name().unwrap());
    meta.tpm = Some(format!("{} {}", info.manufacturer, info.firmware_version));
    meta.simulator = info.is_simulator;
    assert_eq!(meta.pcrs.as_deref(), Some("sha256:0,7"));
    assert!(meta.has_pin);
    assert_eq!(meta.key_alg().unwrap(), KeyAlg::EccP256);

    let dir = sim.path("ks");
    let ks = Keystore::open(&dir).unwrap();
    assert!(!dir.exists(), "opening makes nothing");
    assert!(ks.list().unwrap().is_empty());
    ks.save("work", &blob, &meta, false).unwrap();
    assert_eq!(mode(&dir), 0o700, "the first save makes it");
    assert!(
        ks.save("work", &blob, &meta, false).is_err(),
        "no silent overwrite"
    );
    assert!(ks.save("../evil", &blob, &meta, false).is_err());
    assert_eq!(mode(&ks.key_path("work")), 0o600);
    assert_eq!(mode(&ks.meta_path("work")), 0o600);
    assert!(std::fs::read_to_string(ks.pub_path("work"))
        .unwrap()
        .starts_with("-----BEGIN PUBLIC KEY-----"));
    assert_eq!(ks.list().unwrap(), vec!["work".to_string()]);

    let (b2, m2) = ks.load("work").unwrap();
    assert_eq!(b2, blob);
    assert_eq!(m2, meta);
    let (point, z) = ecdh_software(&b2);
    assert_eq!(
        &tpm.ecdh_zgen(&b2, Some(b"42"), &point).unwrap()[..],
        &z[..]
    );

    // No temp files or commit records left behind (the lock file stays).
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != ".lock")
        .collect();
    assert_eq!(names.len(), 3, "{names:?}");

    ks.delete("work").unwrap();
    assert!(ks.list().unwrap().is_empty());
    assert!(ks.load("work").is_err());
    assert!(ks.delete("work").is_err());
}

/// `Keystore::default_dir` took a relative `TPMCRYPT_HOME` as it was, a
/// keystore relative to each working directory; it is refused (the CLI
/// makes the same check where clap reads the variable).
#[test]
fn a_relative_tpmcrypt_home_is_refused() {
    // The only test of this binary that touches the environment.
    for rel in [" ", "~/keys", "keys"] {
        std::env::set_var("TPMCRYPT_HOME", rel);
        let err = Keystore::default_dir().expect_err(rel).to_string();
        assert!(
            err.contains("TPMCRYPT_HOME is not an absolute path"),
            "{rel:?}: {err}"
        );
    }
    std::env::set_var("TPMCRYPT_HOME", "/var/lib/tpmcrypt");
    assert_eq!(
        Keystore::default_dir().unwrap(),
        std::path::Path::new("/var/lib/tpmcrypt")
    );
    std::env::remove_var("TPMCRYPT_HOME");
}
