//! `Header::read_from` on arbitrary bytes: never panics, never reads past
//! what it reports, and a header it accepts re-encodes to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tpmcrypt_cipher::format::{MAX_STANZAS, MAX_STANZA_BODY};
use tpmcrypt_cipher::Header;

fuzz_target!(|data: &[u8]| {
    let mut input = data;
    let Ok(header) = Header::read_from(&mut input) else {
        return;
    };
    let len = header.payload_offset();
    assert_eq!(
        input.len(),
        data.len() - len,
        "consumed more than the header"
    );
    assert_eq!(header.raw(), &data[..len]);
    assert!((1..=MAX_STANZAS).contains(&header.stanzas.len()));
    assert!(header
        .stanzas
        .iter()
        .all(|s| s.body.len() <= MAX_STANZA_BODY));
    assert!(header.params.validate().is_ok());
    let unsigned = Header::encode_unsigned(&header.params, &header.stanzas)
        .expect("an accepted header re-encodes");
    assert_eq!(unsigned, header.unsigned(), "re-encoding differs");
    let _ = header.session_id();
});
