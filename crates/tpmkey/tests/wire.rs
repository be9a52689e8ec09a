//! What crosses the "bus": with swtpm's command log we check that neither
//! the unwrapped secret nor the PIN ever travels in clear (salted sessions
//! with AES-CFB parameter encryption), while the public key does (positive
//! control proving the log captures the traffic).

mod common;

use common::*;
use tpmcrypt_tpmkey::{KeyAlg, PcrSelection, Simulator, SimulatorOptions, Tpm};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02X}")).collect()
}

/// All bytes logged by swtpm, as one upper-case hex string.
fn wire_hex(log: &std::path::Path) -> String {
    let text = std::fs::read_to_string(log).unwrap();
    text.lines()
        .filter(|l| !l.contains(':'))
        .flat_map(|l| l.split_whitespace())
        .filter(|t| t.len() == 2 && t.chars().all(|c| c.is_ascii_hexdigit()))
        .collect()
}

#[test]
fn secrets_and_pins_never_cross_the_wire_in_clear() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("swtpm.log");
    let sim = Simulator::start_with(
        &dir.path().join("state"),
        &SimulatorOptions {
            log_file: Some(log.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    let pin = b"pin-4f9a1c77e2";
    let sel = PcrSelection::parse("sha256:7").unwrap();
    let mut tpm = Tpm::open(&sim.tcti()).unwrap();
    let rsa = tpm.create_key(KeyAlg::Rsa2048, None, Some(pin)).unwrap();
    let ecc = tpm
        .create_key(KeyAlg::EccP256, Some(&sel), Some(pin))
        .unwrap();
    let secret = random32();
    let pt = tpm
        .rsa_decrypt(&rsa, Some(pin), &rsa_encrypt(&rsa, &secret))
        .unwrap();
    assert_eq!(&pt[..], &secret[..]);
    let (point, z) = ecdh_software(&ecc);
    let tz = tpm.ecdh_zgen(&ecc, Some(pin), &point).unwrap();
    assert_eq!(&tz[..], &z[..]);
    drop(tpm);
    drop(sim); // flushes the log

    let wire = wire_hex(&log);
    assert!(wire.len() > 10_000, "log too small: {}", wire.len());
    // positive control: the public key is visible on the wire
    let n = &rsa.public[rsa.public.len() - 64..];
    assert!(wire.contains(&hex(n)), "public key not in log?");
    assert!(
        !wire.contains(&hex(&secret)),
        "RSA-unwrapped secret visible on the wire"
    );
    assert!(!wire.contains(&hex(&z[..16])), "ECDH Z visible on the wire");
    assert!(!wire.contains(&hex(pin)), "PIN visible on the wire");
}
