//! Key creation and unbind round trips against a real swtpm.

mod common;

use std::time::Instant;

use common::*;
use tpmcrypt_tpmkey::{KeyAlg, PcrSelection};

fn round_trip(alg: KeyAlg, pcrs: Option<&str>, pin: Option<&[u8]>) {
    let sim = start();
    let mut tpm = sim.open();
    let sel = pcrs.map(|p| PcrSelection::parse(p).unwrap());
    let t = Instant::now();
    let blob = tpm.create_key(alg, sel.as_ref(), pin).unwrap();
    let create = t.elapsed();
    assert_clean(&mut tpm);
    assert_eq!(blob.alg().unwrap(), alg);
    assert_eq!(blob.empty_auth, pin.is_none());
    assert_eq!(blob.pcr_policy().unwrap().map(|(s, _)| s), sel);
    // The key survives a trip through the PEM format.
    let blob = tpmcrypt_tpmkey::KeyBlob::from_pem(&blob.to_pem()).unwrap();

    for i in 0..2u64 {
        let t = Instant::now();
        match alg {
            KeyAlg::Rsa2048 => {
                let secret = random32();
                let ct = rsa_encrypt(&blob, &secret);
                let pt = tpm.rsa_decrypt(&blob, pin, &ct).unwrap();
                assert_eq!(&pt[..], &secret[..]);
            }
            KeyAlg::EccP256 => {
                let (point, z) = ecdh_software(&blob);
                let tz = tpm.ecdh_zgen(&blob, pin, &point).unwrap();
                assert_eq!(&tz[..], &z[..]);
            }
        }
        eprintln!(
            "TIMING {alg} pcrs={pcrs:?} pin={}: create {:?}, unbind {:?}",
            pin.is_some(),
            create,
            t.elapsed()
        );
        assert_eq!(tpm.unbind_count(), i + 1, "one unbind command per unbind");
        assert_clean(&mut tpm);
    }
}

#[test]
fn rsa_plain() {
    round_trip(KeyAlg::Rsa2048, None, None);
}

#[test]
fn rsa_pcr_and_pin() {
    round_trip(KeyAlg::Rsa2048, Some("sha256:0,7"), Some(b"1234"));
}

#[test]
fn rsa_pin_only() {
    round_trip(KeyAlg::Rsa2048, None, Some(b"correct horse"));
}

#[test]
fn rsa_pcr_only() {
    round_trip(KeyAlg::Rsa2048, Some("sha256:0,7"), None);
}

#[test]
fn ecc_plain() {
    round_trip(KeyAlg::EccP256, None, None);
}

#[test]
fn ecc_pcr_and_pin() {
    round_trip(KeyAlg::EccP256, Some("sha256:0,7"), Some(b"1234"));
}

#[test]
fn ecc_pin_only() {
    round_trip(KeyAlg::EccP256, None, Some(b"pin"));
}

#[test]
fn ecc_pcr_only_sha1_bank() {
    round_trip(KeyAlg::EccP256, Some("sha1:0,1,2,3,4,5,6,7,8,9"), None);
}

#[test]
fn info_and_srk_and_persistence() {
    let sim = start();
    let state = sim.sim.state_dir().to_path_buf();
    let mut tpm = sim.open();
    let info = tpm.info().unwrap();
    assert_eq!(info.manufacturer, "IBM");
    assert!(info.is_simulator);
    let t = Instant::now();
    let name = tpm.srk_name().unwrap();
    eprintln!(
        "TIMING SRK (ECC primary) derivation {:?}; info {info:?}",
        t.elapsed()
    );
    assert_eq!(name.len(), 68, "sha256 name: 2-byte alg + 32 bytes");
    let blob = tpm.create_key(KeyAlg::EccP256, None, None).unwrap();
    assert_clean(&mut tpm);
    drop(tpm);
    // Restart the simulator on the same state: same SRK, key still works.
    let Sim { sim: s, dir } = sim;
    s.stop();
    let s2 = start_in(&state);
    let mut tpm = tpmcrypt_tpmkey::Tpm::open(&s2.tcti()).unwrap();
    assert_eq!(tpm.srk_name().unwrap(), name);
    let (point, z) = ecdh_software(&blob);
    assert_eq!(&tpm.ecdh_zgen(&blob, None, &point).unwrap()[..], &z[..]);
    drop(tpm);
    drop(s2);
    drop(dir);
}

#[test]
fn wrong_alg_and_bad_input_are_rejected_without_tpm_state() {
    let sim = start();
    let mut tpm = sim.open();
    let rsa = tpm.create_key(KeyAlg::Rsa2048, None, None).unwrap();
    let ecc = tpm.create_key(KeyAlg::EccP256, None, None).unwrap();
    assert!(tpm.rsa_decrypt(&ecc, None, &[0u8; 256]).is_err());
    assert!(tpm.ecdh_zgen(&rsa, None, &[4u8; 65]).is_err());
    assert!(tpm.rsa_decrypt(&rsa, None, &[0u8; 10]).is_err());
    assert!(tpm.ecdh_zgen(&ecc, None, &[4u8; 64]).is_err());
    // Invalid ciphertext / off-curve point: the TPM rejects it, and
    // nothing is left loaded.
    assert!(tpm.rsa_decrypt(&rsa, None, &[1u8; 256]).is_err());
    assert_clean(&mut tpm);
    assert!(tpm.ecdh_zgen(&ecc, None, &[4u8; 65]).is_err());
    assert_clean(&mut tpm);
    assert!(tpm
        .create_key(KeyAlg::EccP256, None, Some(&[b'x'; 33]))
        .is_err());
}
