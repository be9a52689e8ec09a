//! The key file parser must reject malformed input with an error — never a
//! panic — because key files come from disk and may be hostile.

use proptest::prelude::*;
use tpmcrypt_tpmkey::{Error, KeyBlob};

/// A key file written by `tpm2_encodeobject` (tpm2-tools 5.4) for an
/// RSA-2048 OAEP key under the ECC owner primary.
const PEM: &str = include_str!("data/tpm2-tools-rsa2048.pem");

fn good_der() -> Vec<u8> {
    KeyBlob::from_pem(PEM).unwrap().to_der()
}

#[test]
fn round_trip() {
    let blob = KeyBlob::from_pem(PEM).unwrap();
    assert_eq!(KeyBlob::from_pem(&blob.to_pem()).unwrap(), blob);
    assert_eq!(KeyBlob::from_der(&blob.to_der()).unwrap(), blob);
}

#[test]
fn specific_malformations() {
    let der = good_der();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", vec![]),
        ("truncated", der[..der.len() - 1].to_vec()),
        ("bad outer tag", {
            let mut d = der.clone();
            d[0] = 0x31;
            d
        }),
        ("huge length", {
            let mut d = der.clone();
            d[1] = 0x84;
            d[2] = 0x7f;
            d[3] = 0xff;
            d
        }),
        ("indefinite", {
            let mut d = der.clone();
            d[1] = 0x80;
            d
        }),
        ("bad OID", {
            let mut d = der.clone();
            d[9] = 0x09;
            d
        }),
        ("trailing garbage", {
            let mut d = der.clone();
            d.push(0);
            d
        }),
        ("importable OID", {
            let mut d = der.clone();
            d[11] = 0x04;
            d
        }),
    ];
    for (what, d) in cases {
        match KeyBlob::from_der(&d) {
            Err(Error::KeyFile(_)) => {}
            other => panic!("{what}: expected KeyFile error, got {other:?}"),
        }
    }
    for pem in [
        "",
        "-----BEGIN TSS2 PRIVATE KEY-----\n!!!!\n-----END TSS2 PRIVATE KEY-----\n",
        "-----BEGIN TSS2 PRIVATE KEY-----\nAAAA\n",
        "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n",
    ] {
        assert!(KeyBlob::from_pem(pem).is_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..700)) {
        let _ = KeyBlob::from_der(&data);
    }

    #[test]
    fn mutated_key_never_panics(
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
    ) {
        let mut d = good_der();
        for (pos, val) in edits {
            let i = pos % d.len();
            d[i] = val;
        }
        let cut = cut % (d.len() + 1);
        d.truncate(cut);
        if let Ok(b) = KeyBlob::from_der(&d) {
            // anything accepted must re-encode and re-parse identically
            prop_assert_eq!(KeyBlob::from_der(&b.to_der()).unwrap(), b.clone());
            let _ = b.public_key_pem();
        }
    }

    #[test]
    fn random_pem_text_never_panics(s in "\\PC{0,300}") {
        let _ = KeyBlob::from_pem(&s);
        let _ = KeyBlob::from_pem(&format!("-----BEGIN TSS2 PRIVATE KEY-----\n{s}\n-----END TSS2 PRIVATE KEY-----\n"));
    }
}

/// Key files written by tpm2-tools 5.4 (`tpm2_create` + `tpm2_encodeobject`
/// under the standard ECC SRK) for keys tpmcrypt could never unbind with:
/// each is refused from its public area alone, naming the reason.
#[test]
fn tpm2_tools_keys_that_could_never_unbind() {
    for (pem, reason) in [
        (
            include_str!("data/tpm2-tools-rsa2048-oaep-sha1.pem"),
            "OAEP-SHA1",
        ),
        (
            include_str!("data/tpm2-tools-rsa2048-rsaes.pem"),
            "RSAES-PKCS#1",
        ),
        (
            include_str!("data/tpm2-tools-ecc-p256-ecdsa-sign.pem"),
            "decrypt attribute",
        ),
        (
            include_str!("data/tpm2-tools-ecc-p256-no-auth.pem"),
            "nothing can authorize",
        ),
    ] {
        match KeyBlob::from_pem(pem) {
            Err(e @ Error::Unusable(_)) => {
                assert!(e.to_string().contains(reason), "{e}");
                assert_eq!(e.exit_class(), tpmcrypt_tpmkey::ExitClass::Unusable);
            }
            other => panic!("{reason}: {other:?}"),
        }
    }
}
