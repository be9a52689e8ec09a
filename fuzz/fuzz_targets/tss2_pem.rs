//! `KeyBlob::from_pem` and `from_der` on arbitrary input (TSS2 PRIVATE KEY
//! files, as `key import` reads them), and everything the CLI then asks of
//! a parsed blob: its public area (libtss2-mu unmarshalling), algorithm,
//! PCR policy and public key. Nothing may panic; an accepted blob
//! re-encodes to DER that parses to the same blob.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tpmcrypt_tpmkey::KeyBlob;

fn exercise(blob: &KeyBlob) {
    let der = blob.to_der();
    let again = KeyBlob::from_der(&der).expect("re-encoded DER parses");
    assert_eq!(&again, blob, "DER round trip");
    let again = KeyBlob::from_pem(&blob.to_pem()).expect("re-encoded PEM parses");
    assert_eq!(&again, blob, "PEM round trip");
    let _ = blob.public_area();
    let _ = blob.alg();
    let _ = blob.pcr_policy();
    let _ = blob.needs_policy_session();
    let _ = blob.public_key_der();
    let _ = blob.ecc_public_point();
}

fuzz_target!(|data: &[u8]| {
    if let Ok(blob) = KeyBlob::from_der(data) {
        exercise(&blob);
    }
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(blob) = KeyBlob::from_pem(text) {
            exercise(&blob);
        }
    }
});
