//! The two libraries alone decrypt a file addressed to a TPM key: runs
//! `examples/decrypt_with_tpm_key.rs` (built by `cargo test` beside the
//! tests) against a private swtpm, for an RSA key and a P-256 key with a
//! PIN, as a separate process.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use tpmcrypt_cipher::recipient::tpm_recipient_from_pem;
use tpmcrypt_cipher::{Encryptor, Mode, Params, StreamOptions};
use tpmcrypt_tpmkey::KeyAlg;

/// The example's executable: cargo builds examples into `examples/` beside
/// the `deps/` directory this test runs from (`cargo test --all-targets`
/// alone builds them only as tests, without this executable).
fn example_exe() -> PathBuf {
    let me = std::env::current_exe().expect("current_exe");
    let dir = me
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target dir");
    let exe = dir.join("examples").join("decrypt_with_tpm_key");
    assert!(
        exe.is_file(),
        "{} is missing: `cargo build --all-targets` builds it, as ./scripts/test \
         does first, and so does `cargo test` without --all-targets (with it, \
         examples are built only as tests)",
        exe.display()
    );
    exe
}

fn round_trip(alg: KeyAlg, pin: Option<&str>) {
    let sim = common::start();
    let blob = {
        let mut tpm = sim.open();
        tpm.create_key(alg, None, pin.map(str::as_bytes))
            .expect("create key")
        // The handle closes here: swtpm serves one connection at a time.
    };
    let key_file = sim.path("k.key.pem");
    std::fs::write(&key_file, blob.to_pem()).unwrap();

    let pem = blob.public_key_pem().unwrap();
    let recipient = tpm_recipient_from_pem(pem.as_bytes()).unwrap();
    let params = Params::new(Mode::Gcm, 256)
        .unwrap()
        .with_segment_size(4096)
        .unwrap();
    let encryptor = Encryptor::new(&[recipient], params).unwrap();
    let plaintext: Vec<u8> = (0..50_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut file = Vec::new();
    encryptor
        .encrypt(&plaintext[..], &mut file, &StreamOptions::sequential())
        .unwrap();

    let mut cmd = Command::new(example_exe());
    cmd.arg(&key_file)
        .arg(sim.tcti())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env_remove("KEY_PIN");
    if let Some(pin) = pin {
        cmd.env("KEY_PIN", pin);
    }
    let mut child = cmd.spawn().expect("run the example");
    child.stdin.take().unwrap().write_all(&file).unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "example failed: {stderr}");
    assert!(out.stdout == plaintext, "plaintext differs");
    assert!(
        stderr.contains("with 1 TPM unbind(s)"),
        "one unbind expected: {stderr}"
    );

    // Tampered: the example refuses, and writes nothing of the last segment.
    let mut bad = file.clone();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    let mut child = cmd.spawn().expect("run the example");
    child.stdin.take().unwrap().write_all(&bad).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "a tampered file must be refused");
    assert!(out.stdout.len() < plaintext.len());
}

#[test]
fn the_libraries_alone_decrypt_with_an_rsa_tpm_key() {
    round_trip(KeyAlg::Rsa2048, None);
}

#[test]
fn the_libraries_alone_decrypt_with_a_p256_tpm_key_and_its_pin() {
    round_trip(KeyAlg::EccP256, Some("1234"));
}
