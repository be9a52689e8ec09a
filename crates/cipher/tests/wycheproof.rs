//! Wycheproof known-answer tests, run against every backend.
//!
//! The vectors are read at run time from `shared/vectors/wycheproof/` next to
//! the workspace (C2SP/wycheproof `testvectors_v1`); they are not copied into
//! this repository. A missing directory is a failure, never a skip.
//!
//! Each test counts, per backend, the vectors it executed; a backend is
//! skipped only where it declares the primitive unsupported
//! (`supports_gcm(key_len)`, `supports_cbc()`), and the test then checks that
//! the backend really refuses it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::Value;
use tpmcrypt_cipher::backend::{self, Backend, Hash, AES_BLOCK, GCM_NONCE_LEN};
use tpmcrypt_cipher::cbc_hmac::CbcHmac;
use tpmcrypt_cipher::recipient::p256::{EcdhP256, P256Recipient};
use tpmcrypt_cipher::recipient::rsa::{RsaIdentity, RsaOaepDecrypt, RsaRecipient, SoftwareRsa};
use tpmcrypt_cipher::recipient::{kind, Identity, Recipient};
use tpmcrypt_cipher::recovery::RecoveryKey;
use tpmcrypt_cipher::SessionKey;

const VECTOR_DIR: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../shared/vectors/wycheproof/"
);

fn load(name: &str) -> Value {
    let dir = PathBuf::from(VECTOR_DIR);
    assert!(
        dir.is_dir(),
        "Wycheproof vector directory {} is missing: these tests need the C2SP/wycheproof \
         testvectors_v1 files there (they are deliberately not vendored)",
        dir.display()
    );
    let path = dir.join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read Wycheproof file {}: {e}", path.display()));
    let json: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not valid JSON: {e}", path.display()));
    assert!(
        !groups(&json).is_empty(),
        "{} has no test groups",
        path.display()
    );
    json
}

fn groups(json: &Value) -> &Vec<Value> {
    json["testGroups"].as_array().expect("testGroups array")
}

fn tests(group: &Value) -> &Vec<Value> {
    group["tests"].as_array().expect("tests array")
}

fn hex_field(v: &Value, key: &str) -> Vec<u8> {
    let s = v[key]
        .as_str()
        .unwrap_or_else(|| panic!("field {key} missing in {v}"));
    hex::decode(s).unwrap_or_else(|e| panic!("field {key} is not hex: {e}"))
}

fn num(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("field {key} missing or not a number in {v}"))
}

fn tc_id(t: &Value) -> u64 {
    num(t, "tcId")
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Expect {
    Valid,
    Invalid,
    Acceptable,
}

fn expect(t: &Value) -> Expect {
    match t["result"].as_str() {
        Some("valid") => Expect::Valid,
        Some("invalid") => Expect::Invalid,
        Some("acceptable") => Expect::Acceptable,
        other => panic!("tcId {}: unknown result {other:?}", tc_id(t)),
    }
}

/// Executed / skipped vector counts per backend for one file.
#[derive(Default)]
struct Counts {
    by_backend: BTreeMap<&'static str, (usize, usize)>,
}

impl Counts {
    fn ran(&mut self, b: &dyn Backend) {
        self.by_backend.entry(b.name()).or_default().0 += 1;
    }

    fn skipped(&mut self, b: &dyn Backend) {
        self.by_backend.entry(b.name()).or_default().1 += 1;
    }

    /// Prints the counts and asserts that every backend for which
    /// `supported` holds executed at least one vector (and that the others
    /// executed none).
    fn finish(&self, file: &str, supported: impl Fn(&dyn Backend) -> bool) {
        for b in {
            // Every backend, OpenSSL included (see backend::enable_openssl).
            backend::enable_openssl();
            backend::all()
        } {
            let (ran, skipped) = self.by_backend.get(b.name()).copied().unwrap_or_default();
            println!(
                "{file}: backend {:<10} executed {ran:>4}, skipped (declared unsupported) {skipped:>4}",
                b.name()
            );
            if supported(b.as_ref()) {
                assert!(ran > 0, "{file}: backend {} executed no vectors", b.name());
            } else {
                assert_eq!(
                    ran,
                    0,
                    "{file}: backend {} ran unsupported vectors",
                    b.name()
                );
                assert!(skipped > 0);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// AES-GCM

#[test]
fn aes_gcm() {
    let json = load("aes_gcm_test.json");
    let mut counts = Counts::default();
    for group in groups(&json) {
        if num(group, "ivSize") != 96 || num(group, "tagSize") != 128 {
            continue;
        }
        let key_len = (num(group, "keySize") / 8) as usize;
        for b in {
            // Every backend, OpenSSL included (see backend::enable_openssl).
            backend::enable_openssl();
            backend::all()
        } {
            if !b.supports_gcm(key_len) {
                assert!(
                    b.gcm(&vec![0u8; key_len]).is_err(),
                    "{} declares {key_len}-byte GCM unsupported but accepts the key",
                    b.name()
                );
                for _ in tests(group) {
                    counts.skipped(b.as_ref());
                }
                continue;
            }
            for t in tests(group) {
                check_gcm(b.as_ref(), t);
                counts.ran(b.as_ref());
            }
        }
    }
    counts.finish("aes_gcm_test.json", |b| b.supports_gcm(16));
}

fn check_gcm(b: &dyn Backend, t: &Value) {
    let id = tc_id(t);
    let name = b.name();
    let key = hex_field(t, "key");
    let nonce: [u8; GCM_NONCE_LEN] = hex_field(t, "iv").try_into().expect("96-bit iv");
    let aad = hex_field(t, "aad");
    let msg = hex_field(t, "msg");
    let mut sealed = hex_field(t, "ct");
    sealed.extend_from_slice(&hex_field(t, "tag"));
    // One key object for seal and open, so that contexts kept between calls
    // (OpenSSL re-initialises only on a change of direction) are exercised.
    let mut gcm = b
        .gcm(&key)
        .unwrap_or_else(|e| panic!("{name} tcId {id}: {e}"));
    match expect(t) {
        Expect::Valid => {
            let mut buf = msg.clone();
            gcm.seal(&nonce, &aad, &mut buf)
                .unwrap_or_else(|e| panic!("{name} tcId {id}: seal: {e}"));
            assert_eq!(
                hex::encode(&buf),
                hex::encode(&sealed),
                "{name} tcId {id}: seal"
            );
            for round in 0..2 {
                let mut buf = sealed.clone();
                let n = gcm
                    .open(&nonce, &aad, &mut buf)
                    .unwrap_or_else(|_| panic!("{name} tcId {id}: open #{round} failed"));
                assert_eq!(&buf[..n], &msg[..], "{name} tcId {id}: open #{round}");
            }
        }
        Expect::Invalid | Expect::Acceptable => {
            let mut buf = sealed.clone();
            assert!(
                gcm.open(&nonce, &aad, &mut buf).is_err(),
                "{name} tcId {id}: invalid ciphertext opened"
            );
            // The context must still work after a failure.
            let mut probe = b"probe".to_vec();
            gcm.seal(&nonce, &aad, &mut probe).unwrap();
            assert!(gcm.open(&nonce, &aad, &mut probe).is_ok());
        }
    }
}

// ---------------------------------------------------------------------------
// AES-CBC with PKCS#7

#[test]
fn aes_cbc_pkcs5() {
    let json = load("aes_cbc_pkcs5_test.json");
    let mut counts = Counts::default();
    for group in groups(&json) {
        for b in {
            // Every backend, OpenSSL included (see backend::enable_openssl).
            backend::enable_openssl();
            backend::all()
        } {
            if !b.supports_cbc() {
                assert!(b.cbc(&[0u8; 16]).is_err());
                for _ in tests(group) {
                    counts.skipped(b.as_ref());
                }
                continue;
            }
            for t in tests(group) {
                check_cbc(b.as_ref(), t);
                counts.ran(b.as_ref());
            }
        }
    }
    counts.finish("aes_cbc_pkcs5_test.json", |b| b.supports_cbc());
}

fn check_cbc(b: &dyn Backend, t: &Value) {
    let id = tc_id(t);
    let name = b.name();
    let key = hex_field(t, "key");
    let iv: [u8; AES_BLOCK] = hex_field(t, "iv").try_into().expect("128-bit iv");
    let msg = hex_field(t, "msg");
    let ct = hex_field(t, "ct");
    let mut cbc = b
        .cbc(&key)
        .unwrap_or_else(|e| panic!("{name} tcId {id}: {e}"));
    match expect(t) {
        Expect::Valid => {
            // At offset 0 and behind a reserved prefix that must stay intact.
            for start in [0usize, AES_BLOCK, 3] {
                let mut buf = vec![0xA5u8; start];
                buf.extend_from_slice(&msg);
                cbc.encrypt(&iv, &mut buf, start)
                    .unwrap_or_else(|e| panic!("{name} tcId {id}: encrypt: {e}"));
                assert!(buf[..start].iter().all(|&x| x == 0xA5), "{name} tcId {id}");
                assert_eq!(
                    hex::encode(&buf[start..]),
                    hex::encode(&ct),
                    "{name} tcId {id}: encrypt at offset {start}"
                );
            }
            for round in 0..2 {
                let mut buf = ct.clone();
                let n = cbc
                    .decrypt(&iv, &mut buf)
                    .unwrap_or_else(|_| panic!("{name} tcId {id}: decrypt #{round} failed"));
                assert_eq!(&buf[..n], &msg[..], "{name} tcId {id}: decrypt #{round}");
            }
        }
        Expect::Invalid | Expect::Acceptable => {
            let mut buf = ct.clone();
            assert!(
                cbc.decrypt(&iv, &mut buf).is_err(),
                "{name} tcId {id}: bad padding accepted"
            );
            // The key object must still work after a padding failure, in
            // both directions (OpenSSL keeps one context per key).
            let mut probe = b"0123456789abcdef0123".to_vec();
            cbc.encrypt(&iv, &mut probe, 0).unwrap();
            assert_eq!(probe.len(), 32);
            let mut bad = ct.clone();
            assert!(cbc.decrypt(&iv, &mut bad).is_err());
            let n = cbc.decrypt(&iv, &mut probe).unwrap();
            assert_eq!(&probe[..n], b"0123456789abcdef0123");
        }
    }
}

// ---------------------------------------------------------------------------
// HKDF-SHA256

#[test]
fn hkdf_sha256() {
    let json = load("hkdf_sha256_test.json");
    let mut counts = Counts::default();
    for group in groups(&json) {
        for t in tests(group) {
            let id = tc_id(t);
            let ikm = hex_field(t, "ikm");
            let salt = hex_field(t, "salt");
            let info = hex_field(t, "info");
            let size = num(t, "size") as usize;
            for b in {
                // Every backend, OpenSSL included (see backend::enable_openssl).
                backend::enable_openssl();
                backend::all()
            } {
                let name = b.name();
                let mut out = vec![0u8; size];
                let got = b.hkdf_sha256(&ikm, &salt, &info, &mut out);
                match expect(t) {
                    Expect::Valid => {
                        got.unwrap_or_else(|e| panic!("{name} tcId {id}: {e}"));
                        assert_eq!(
                            hex::encode(&out),
                            hex::encode(hex_field(t, "okm")),
                            "{name} tcId {id}"
                        );
                    }
                    Expect::Invalid | Expect::Acceptable => {
                        assert!(got.is_err(), "{name} tcId {id}: invalid size accepted")
                    }
                }
                counts.ran(b.as_ref());
            }
        }
    }
    counts.finish("hkdf_sha256_test.json", |_| true);
}

// ---------------------------------------------------------------------------
// HMAC-SHA256 / HMAC-SHA512

fn check_hmac_file(file: &str, hash: Hash) {
    let json = load(file);
    let mut counts = Counts::default();
    for group in groups(&json) {
        let tag_len = (num(group, "tagSize") / 8) as usize;
        assert!(tag_len <= hash.output_len());
        for t in tests(group) {
            let id = tc_id(t);
            let key = hex_field(t, "key");
            let msg = hex_field(t, "msg");
            let tag = hex_field(t, "tag");
            for b in {
                // Every backend, OpenSSL included (see backend::enable_openssl).
                backend::enable_openssl();
                backend::all()
            } {
                let name = b.name();
                let full = b
                    .hmac(hash, &key, &[&msg])
                    .unwrap_or_else(|e| panic!("{name} tcId {id}: {e}"));
                assert_eq!(full.len(), hash.output_len(), "{name} returns the full tag");
                // The same MAC over the message in two parts.
                let cut = msg.len() / 3;
                let parts = b
                    .hmac(hash, &key, &[&msg[..cut], &[], &msg[cut..]])
                    .unwrap();
                assert_eq!(full, parts, "{name} tcId {id}: multi-part hmac");
                let matches = full[..tag_len] == tag[..];
                match expect(t) {
                    Expect::Valid => assert!(matches, "{name} tcId {id}: tag mismatch"),
                    Expect::Invalid => assert!(!matches, "{name} tcId {id}: bad tag matched"),
                    Expect::Acceptable => {}
                }
                counts.ran(b.as_ref());
            }
        }
    }
    counts.finish(file, |_| true);
}

#[test]
fn hmac_sha256() {
    check_hmac_file("hmac_sha256_test.json", Hash::Sha256);
}

#[test]
fn hmac_sha512() {
    check_hmac_file("hmac_sha512_test.json", Hash::Sha512);
}

// ---------------------------------------------------------------------------
// AES_CBC_HMAC_SHA2 (RFC 7518 §5.2)

/// Wycheproof's `ct` for these files is E alone: the IV is in `iv` and the
/// tag in `tag` (tcId 1 is RFC 7518 Appendix B.1, whose E starts c80edfa3),
/// so our `IV ‖ E ‖ T` is `iv ‖ ct ‖ tag`.
fn check_cbc_hmac_file(file: &str, composite_len: usize) {
    let json = load(file);
    let mut counts = Counts::default();
    for group in groups(&json) {
        assert_eq!(num(group, "keySize") as usize, composite_len * 8);
        assert_eq!(num(group, "ivSize"), 128);
        for b in {
            // Every backend, OpenSSL included (see backend::enable_openssl).
            backend::enable_openssl();
            backend::all()
        } {
            if !b.supports_cbc() {
                assert!(CbcHmac::new(b.clone(), &vec![0u8; composite_len]).is_err());
                for _ in tests(group) {
                    counts.skipped(b.as_ref());
                }
                continue;
            }
            for t in tests(group) {
                check_cbc_hmac(&b, t, composite_len);
                counts.ran(b.as_ref());
            }
        }
    }
    counts.finish(file, |b| b.supports_cbc());
}

fn check_cbc_hmac(b: &Arc<dyn Backend>, t: &Value, composite_len: usize) {
    let id = tc_id(t);
    let name = b.name();
    let key = hex_field(t, "key");
    assert_eq!(key.len(), composite_len);
    let iv = hex_field(t, "iv");
    let aad = hex_field(t, "aad");
    let msg = hex_field(t, "msg");
    let mut expected = iv.clone();
    expected.extend_from_slice(&hex_field(t, "ct"));
    expected.extend_from_slice(&hex_field(t, "tag"));
    let mut aead = CbcHmac::new(b.clone(), &key).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(aead.tag_len(), composite_len / 2);
    assert_eq!(CbcHmac::tag_len_for(composite_len / 2), aead.tag_len());
    match expect(t) {
        Expect::Valid => {
            let iv: [u8; AES_BLOCK] = iv.try_into().expect("128-bit iv");
            let mut buf = vec![0u8; AES_BLOCK];
            buf.extend_from_slice(&msg);
            aead.seal(&iv, &aad, &mut buf)
                .unwrap_or_else(|e| panic!("{name} tcId {id}: seal: {e}"));
            assert_eq!(
                hex::encode(&buf),
                hex::encode(&expected),
                "{name} tcId {id}"
            );
            for round in 0..2 {
                let mut buf = expected.clone();
                let range = aead
                    .open(&aad, &mut buf)
                    .unwrap_or_else(|_| panic!("{name} tcId {id}: open #{round} failed"));
                assert_eq!(&buf[range], &msg[..], "{name} tcId {id}: open #{round}");
            }
        }
        Expect::Invalid | Expect::Acceptable => {
            let mut buf = expected.clone();
            assert!(
                aead.open(&aad, &mut buf).is_err(),
                "{name} tcId {id}: invalid ciphertext opened"
            );
        }
    }
}

#[test]
fn a128cbc_hs256() {
    check_cbc_hmac_file("a128cbc_hs256_test.json", 32);
}

#[test]
fn a192cbc_hs384() {
    check_cbc_hmac_file("a192cbc_hs384_test.json", 48);
}

#[test]
fn a256cbc_hs512() {
    check_cbc_hmac_file("a256cbc_hs512_test.json", 64);
}

// ---------------------------------------------------------------------------
// RSA-OAEP (SHA-256, MGF1-SHA-256, empty label) — OpenSSL only, not a backend

#[test]
fn rsa_oaep_2048_sha256() {
    let file = "rsa_oaep_2048_sha256_mgf1sha256_test.json";
    let json = load(file);
    let (mut ran, mut skipped_label) = (0usize, 0usize);
    for group in groups(&json) {
        assert_eq!(group["sha"].as_str(), Some("SHA-256"));
        assert_eq!(group["mgfSha"].as_str(), Some("SHA-256"));
        let pem = group["privateKeyPem"].as_str().expect("privateKeyPem");
        let pkey = openssl::pkey::PKey::private_key_from_pem(pem.as_bytes()).expect("PEM key");
        let rsa = SoftwareRsa(pkey.clone());
        for t in tests(group) {
            let id = tc_id(t);
            if !hex_field(t, "label").is_empty() {
                // Our construction always uses the empty label.
                skipped_label += 1;
                continue;
            }
            let got = rsa.decrypt(&hex_field(t, "ct"));
            match expect(t) {
                Expect::Valid => {
                    let plain = got.unwrap_or_else(|e| panic!("tcId {id}: {e}"));
                    assert_eq!(&plain[..], &hex_field(t, "msg")[..], "tcId {id}");
                }
                Expect::Invalid => assert!(got.is_err(), "tcId {id}: invalid ciphertext accepted"),
                Expect::Acceptable => {}
            }
            ran += 1;
        }

        // And the wrap/unwrap stanza round trip with the same key.
        let der = pkey.public_key_to_der().unwrap();
        let recipient = RsaRecipient::from_spki_der(&der).unwrap();
        let identity = RsaIdentity::new(SoftwareRsa(pkey));
        let session = SessionKey::from_bytes(&[0x42; 32]);
        let stanza = recipient
            .wrap(&session, &mut rand_core::OsRng)
            .expect("wrap");
        assert_eq!(stanza.kind, kind::TPM_RSA2048);
        let back = identity.unwrap(&stanza).unwrap().expect("addressed to us");
        assert_eq!(back.expose(), session.expose());
    }
    println!("{file}: openssl (SoftwareRsa) executed {ran:>4}, skipped (non-empty label) {skipped_label:>4}");
    assert!(ran > 0);
}

// ---------------------------------------------------------------------------
// ECDH P-256 through the recipient parser and RecoveryKey::ecdh

#[test]
fn ecdh_secp256r1() {
    let file = "ecdh_secp256r1_test.json";
    let json = load(file);
    let (mut valid, mut rejected, mut acceptable_ok) = (0usize, 0usize, 0usize);
    for group in groups(&json) {
        assert_eq!(group["curve"].as_str(), Some("secp256r1"));
        assert_eq!(group["encoding"].as_str(), Some("asn"));
        for t in tests(group) {
            let id = tc_id(t);
            let outcome = ecdh_vector(t);
            match (expect(t), outcome) {
                (Expect::Valid, Ok(shared)) => {
                    assert_eq!(
                        hex::encode(shared),
                        hex::encode(hex_field(t, "shared")),
                        "tcId {id}"
                    );
                    valid += 1;
                }
                (Expect::Valid, Err(e)) => panic!("tcId {id}: valid vector failed: {e}"),
                (Expect::Invalid, Ok(_)) => panic!("tcId {id}: invalid vector accepted"),
                (Expect::Invalid, Err(_)) => rejected += 1,
                (Expect::Acceptable, Ok(shared)) => {
                    // If accepted, the result must still be right.
                    assert_eq!(
                        hex::encode(shared),
                        hex::encode(hex_field(t, "shared")),
                        "tcId {id}"
                    );
                    acceptable_ok += 1;
                }
                (Expect::Acceptable, Err(_)) => rejected += 1,
            }
            // Invalid-curve points must also be refused by ecdh() itself,
            // not only by the SPKI parser in front of it.
            let flags = t["flags"].as_array().unwrap();
            if flags.iter().any(|f| f == "InvalidCurveAttack") {
                let public = hex_field(t, "public");
                let raw = &public[public.len() - 65..];
                assert_eq!(raw[0], 0x04, "tcId {id}: uncompressed point at the end");
                let key = recovery_key(t);
                assert!(
                    key.ecdh(raw.try_into().unwrap()).is_err(),
                    "tcId {id}: ecdh accepted a point off the curve"
                );
            }
        }
    }
    println!(
        "{file}: p256 (RecoveryKey::ecdh) executed {}: {valid} valid equal, {acceptable_ok} acceptable accepted, {rejected} rejected",
        valid + rejected + acceptable_ok
    );
    assert!(valid > 0 && rejected > 0);
}

fn recovery_key(t: &Value) -> RecoveryKey {
    // Wycheproof writes the scalar as a signed big-endian integer: strip the
    // sign byte, left-pad to 32 bytes.
    let mut private = hex_field(t, "private");
    while private.len() > 32 && private[0] == 0 {
        private.remove(0);
    }
    let mut scalar = [0u8; 32];
    scalar[32 - private.len()..].copy_from_slice(&private);
    RecoveryKey::from_scalar_bytes(&scalar).expect("private scalar in range")
}

/// The production path: a SubjectPublicKeyInfo parsed as a P-256 recipient
/// (as `tpm_recipient_from_pem` does), its uncompressed point handed to
/// `EcdhP256::ecdh` of a recovery key.
fn ecdh_vector(t: &Value) -> Result<[u8; 32], String> {
    let key = recovery_key(t);
    let recipient = P256Recipient::from_spki_der(kind::TPM_P256, &hex_field(t, "public"))
        .map_err(|e| e.to_string())?;
    use p256::elliptic_curve::sec1::ToEncodedPoint;
    let point: [u8; 65] = recipient
        .public_key()
        .to_encoded_point(false)
        .as_bytes()
        .try_into()
        .unwrap();
    let z = key.ecdh(&point).map_err(|e| e.to_string())?;
    Ok(*z)
}
