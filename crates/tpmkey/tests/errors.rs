//! Failure modes: each must map to its own actionable error and leave the
//! TPM without transient objects or sessions of ours.

mod common;

use common::*;
use tpmcrypt_tpmkey::{Error, ExitClass, KeyAlg, PcrSelection, Tpm};

#[test]
fn pcr_extended_after_creation_is_pcr_mismatch() {
    let sim = start();
    let sel = PcrSelection::parse("sha256:0,7").unwrap();
    let mut tpm = sim.open();
    let rsa = tpm.create_key(KeyAlg::Rsa2048, Some(&sel), None).unwrap();
    let ecc = tpm
        .create_key(KeyAlg::EccP256, Some(&sel), Some(b"1234"))
        .unwrap();
    drop(tpm); // swtpm serves one client at a time
    sim.tool_ok(&[
        "tpm2_pcrextend",
        "7:sha256=0000000000000000000000000000000000000000000000000000000000000001",
    ]);
    let mut tpm = sim.open();
    let ct = rsa_encrypt(&rsa, &random32());
    let err = tpm.rsa_decrypt(&rsa, None, &ct).unwrap_err();
    assert!(matches!(err, Error::PcrMismatch { .. }), "{err:?}");
    assert!(err
        .to_string()
        .contains("PCR values changed since the key was created"));
    assert!(err.to_string().contains("sha256:0,7"));
    assert_eq!(err.exit_class(), ExitClass::TpmRefused);
    assert_clean(&mut tpm);
    let (point, _) = ecdh_software(&ecc);
    let err = tpm.ecdh_zgen(&ecc, Some(b"1234"), &point).unwrap_err();
    assert!(matches!(err, Error::PcrMismatch { .. }), "{err:?}");
    assert_clean(&mut tpm);
    // A PCR outside the selection does not matter.
    let k = tpm.create_key(KeyAlg::Rsa2048, Some(&sel), None).unwrap();
    drop(tpm);
    sim.tool_ok(&[
        "tpm2_pcrextend",
        "16:sha256=0000000000000000000000000000000000000000000000000000000000000001",
    ]);
    let mut tpm = sim.open();
    let secret = random32();
    let pt = tpm
        .rsa_decrypt(&k, None, &rsa_encrypt(&k, &secret))
        .unwrap();
    assert_eq!(&pt[..], &secret[..]);
}

#[test]
fn wrong_pin_then_lockout() {
    let sim = start();
    sim.tool_ok(&[
        "tpm2_dictionarylockout",
        "--setup-parameters",
        "--max-tries=3",
        "--recovery-time=600",
        "--lockout-recovery-time=600",
    ]);
    let mut tpm = sim.open();
    let key = tpm
        .create_key(KeyAlg::Rsa2048, None, Some(b"1234"))
        .unwrap();
    let pkey = tpm
        .create_key(
            KeyAlg::EccP256,
            Some(&PcrSelection::parse("sha256:7").unwrap()),
            Some(b"1234"),
        )
        .unwrap();
    let nopin = tpm.create_key(KeyAlg::Rsa2048, None, None).unwrap();
    let ct = rsa_encrypt(&key, &random32());

    let err = tpm.rsa_decrypt(&key, Some(b"0000"), &ct).unwrap_err();
    assert!(matches!(err, Error::WrongPin), "{err:?}");
    assert!(err.to_string().contains("wrong PIN"));
    assert_eq!(err.exit_class(), ExitClass::TpmRefused);
    assert_clean(&mut tpm);
    // missing PIN = empty authValue = also wrong
    let err = tpm.rsa_decrypt(&key, None, &ct).unwrap_err();
    assert!(matches!(err, Error::WrongPin), "{err:?}");
    // wrong PIN through the policy-session path (PolicyAuthValue)
    let (point, _) = ecdh_software(&pkey);
    let err = tpm.ecdh_zgen(&pkey, Some(b"9999"), &point).unwrap_err();
    assert!(
        matches!(err, Error::WrongPin | Error::Lockout { .. }),
        "{err:?}"
    );
    assert_clean(&mut tpm);

    // Three failures with max-tries=3: now locked out, even with the right PIN.
    let mut saw_lockout = None;
    for _ in 0..3 {
        match tpm.rsa_decrypt(&key, Some(b"1234"), &ct) {
            Err(e @ Error::Lockout { .. }) => {
                saw_lockout = Some(e);
                break;
            }
            Err(Error::WrongPin) => continue,
            other => panic!("unexpected: {other:?}"),
        }
    }
    let err = saw_lockout.expect("TPM should be in lockout");
    let msg = err.to_string();
    assert!(msg.contains("wait 600 seconds"), "{msg}");
    assert!(
        msg.contains("tpm2_dictionarylockout --clear-lockout"),
        "{msg}"
    );
    assert_eq!(err.exit_class(), ExitClass::TpmRefused);
    assert_clean(&mut tpm);
    // Keys without a PIN are noDA and keep working during lockout.
    let secret = random32();
    let pt = tpm
        .rsa_decrypt(&nopin, None, &rsa_encrypt(&nopin, &secret))
        .unwrap();
    assert_eq!(&pt[..], &secret[..]);
    // Clearing the lockout restores the PIN key.
    drop(tpm);
    sim.tool_ok(&["tpm2_dictionarylockout", "--clear-lockout"]);
    let mut tpm = sim.open();
    let secret = random32();
    let pt = tpm
        .rsa_decrypt(&key, Some(b"1234"), &rsa_encrypt(&key, &secret))
        .unwrap();
    assert_eq!(&pt[..], &secret[..]);
    assert_clean(&mut tpm);
}

#[test]
fn unreachable_tpm_is_unavailable_naming_tcti_and_cause() {
    // Reserve a port nobody listens on.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    let tcti = format!("swtpm:host=127.0.0.1,port={port}");
    let err = Tpm::open(&tcti).unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    let msg = err.to_string();
    // What to do about it (--tpm, --simulator) is the CLI's to say: its
    // hint is tested in crates/cli (exit.rs) and tests/adversarial.rs.
    let want = format!("TPM unreachable ({tcti}): connection refused.");
    assert_eq!(msg, want);
    assert!(!msg.contains("not recognized"), "{msg}");
    assert_eq!(err.exit_class(), ExitClass::TpmRefused);

    let err = Tpm::open("device:/nonexistent/tpmrm0").unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    let msg = err.to_string();
    let want = "TPM unreachable (device:/nonexistent/tpmrm0): /nonexistent/tpmrm0: no such file \
                or directory.";
    assert_eq!(msg, want);
}

/// A TPM that answered, then stopped: `ConnectionLost`, naming the TCTI,
/// the command and that a new connection is refused; exit class 4.
#[test]
fn tpm_that_stops_is_connection_lost() {
    let sim = start();
    let tcti = sim.tcti();
    let mut tpm = sim.open();
    let key = tpm.create_key(KeyAlg::EccP256, None, None).unwrap();
    let Sim { sim, dir: _dir } = sim;
    sim.stop();
    let (point, _) = ecdh_software(&key);
    let err = tpm.ecdh_zgen(&key, None, &point).unwrap_err();
    assert!(matches!(err, Error::ConnectionLost { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!(
            "TPM unreachable ({tcti}): connection lost during CreatePrimary (storage root key); \
             a new connection fails: connection refused"
        )
    );
    assert_eq!(err.exit_class(), ExitClass::TpmRefused);
    // Later calls report the same loss, not an ESYS sequence error.
    let again = tpm.ecdh_zgen(&key, None, &point).unwrap_err();
    assert_eq!(again.to_string(), err.to_string());
    let again = tpm.srk_name().unwrap_err();
    assert!(matches!(again, Error::ConnectionLost { .. }), "{again:?}");
}

#[test]
fn key_from_another_tpm_is_wrong_tpm() {
    let a = start();
    let b = start();
    let mut ta = a.open();
    let rsa = ta.create_key(KeyAlg::Rsa2048, None, None).unwrap();
    let ecc = ta.create_key(KeyAlg::EccP256, None, Some(b"1")).unwrap();
    let mut tb = b.open();
    assert_ne!(ta.srk_name().unwrap(), tb.srk_name().unwrap());
    let err = tb
        .rsa_decrypt(&rsa, None, &rsa_encrypt(&rsa, &random32()))
        .unwrap_err();
    assert!(matches!(err, Error::WrongTpm { .. }), "{err:?}");
    assert!(err.to_string().contains("belongs to a different TPM"));
    assert_eq!(err.exit_class(), ExitClass::TpmRefused);
    assert_clean(&mut tb);
    let (point, _) = ecdh_software(&ecc);
    let err = tb.ecdh_zgen(&ecc, Some(b"1"), &point).unwrap_err();
    assert!(matches!(err, Error::WrongTpm { .. }), "{err:?}");
    assert_clean(&mut tb);
    assert_clean(&mut ta);
}

#[test]
fn persistent_srk_is_used_when_present() {
    let sim = start();
    sim.tools_srk("srk.ctx");
    sim.tool_ok(&[
        "tpm2_evictcontrol",
        "-C",
        "o",
        "-c",
        "srk.ctx",
        "0x81000001",
    ]);
    sim.tool_ok(&["tpm2_flushcontext", "-t"]);
    let mut tpm = sim.open();
    let key = tpm.create_key(KeyAlg::Rsa2048, None, None).unwrap();
    assert_eq!(key.parent, 0x8100_0001);
    let secret = random32();
    assert_eq!(
        &tpm.rsa_decrypt(&key, None, &rsa_encrypt(&key, &secret))
            .unwrap()[..],
        &secret[..]
    );
    assert_clean(&mut tpm);
    // The same primary re-derived transiently also loads it (identical
    // template), so a key file saying 0x40000001 works too.
    let mut alt = key.clone();
    alt.parent = 0x4000_0001;
    assert_eq!(
        &tpm.rsa_decrypt(&alt, None, &rsa_encrypt(&key, &secret))
            .unwrap()[..],
        &secret[..]
    );
    assert_clean(&mut tpm);
}

/// Regression: tpm2-tss sockets lack CLOEXEC; a simulator started while
/// another Tpm connection is open must not inherit (and pin) it.
#[test]
fn simulator_does_not_inherit_open_tpm_connections() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let a = start();
        let tpm = a.open();
        let b = start();
        drop(tpm);
        let mut again = a.open();
        again.info().unwrap();
        drop(again);
        drop(b);
        tx.send(()).unwrap();
    });
    rx.recv_timeout(std::time::Duration::from_secs(30))
        .expect("reconnecting hung: the second swtpm inherited the first connection");
}
