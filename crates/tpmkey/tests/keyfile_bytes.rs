//! Key files are re-written byte for byte: a file parsed and written again
//! is the file read. The fixtures were written by tpm2-tools 5.4
//! (`tpm2_encodeobject`) and by tpmcrypt itself before its DER and PEM code
//! moved to the `der` and `pem-rfc7468` crates, so these tests pin the
//! output of the old encoder.

use tpmcrypt_tpmkey::keyfile::{
    PARENT_PERSISTENT_SRK, TPM_CC_POLICY_AUTH_VALUE, TPM_CC_POLICY_PCR,
};
use tpmcrypt_tpmkey::{KeyBlob, PcrSelection};

/// `tpm2_encodeobject` output: emptyAuth FALSE, no policy, parent 0x40000001.
const TOOLS: &str = include_str!("data/tpm2-tools-rsa2048.pem");
/// Written by tpmcrypt: emptyAuth TRUE, a PolicyPCR + PolicyAuthValue
/// policy, a description longer than 127 bytes (long-form length, UTF-8),
/// rsaParent TRUE and the persistent SRK as parent.
const FULL: &str = include_str!("data/tpmcrypt-policy-description.pem");

#[test]
fn tpm2_tools_key_file_is_rewritten_byte_for_byte() {
    let blob = KeyBlob::from_pem(TOOLS).unwrap();
    assert_eq!(blob.to_pem(), TOOLS);
    assert_eq!(KeyBlob::from_der(&blob.to_der()).unwrap(), blob);
    assert_eq!(KeyBlob::declared_empty_auth(TOOLS).unwrap(), Some(false));
}

#[test]
fn key_file_with_every_field_is_rewritten_byte_for_byte() {
    let blob = KeyBlob::from_pem(FULL).unwrap();
    assert_eq!(blob.to_pem(), FULL);
    assert!(blob.empty_auth);
    assert!(blob.rsa_parent);
    assert_eq!(blob.parent, PARENT_PERSISTENT_SRK);
    let description = blob.description.as_deref().unwrap();
    assert!(description.len() > 127 && description.ends_with("é ✓"));
    let codes: Vec<u32> = blob.policy.iter().map(|p| p.command_code).collect();
    assert_eq!(codes, [TPM_CC_POLICY_PCR, TPM_CC_POLICY_AUTH_VALUE]);
    let sel = PcrSelection::parse("sha256:0,7").unwrap();
    assert_eq!(blob.pcr_policy().unwrap(), Some((sel, vec![0xAB; 32])));
    assert_eq!(KeyBlob::declared_empty_auth(FULL).unwrap(), Some(true));
    // The tpm2-tools key with these fields set writes the same bytes.
    let mut built = KeyBlob::from_pem(TOOLS).unwrap();
    built.empty_auth = true;
    built.policy = blob.policy.clone();
    built.description = blob.description.clone();
    built.rsa_parent = true;
    built.parent = PARENT_PERSISTENT_SRK;
    assert_eq!(built.to_pem(), FULL);
}
