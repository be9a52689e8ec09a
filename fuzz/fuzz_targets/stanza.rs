//! Recovery recipient strings and P-256 stanzas: `recovery::parse_recipient`
//! on arbitrary text, and a recovery identity's `unwrap` on arbitrary
//! stanzas — raw, addressed to it (its fingerprint in front), and valid
//! stanzas with bytes flipped. Nothing may panic; a flipped valid stanza
//! must never yield a session key other than the real one.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use rand_chacha::rand_core::SeedableRng;
use tpmcrypt_cipher::recipient::{Identity, Recipient};
use tpmcrypt_cipher::recovery::{self, RecoveryKey};
use tpmcrypt_cipher::{SessionKey, Stanza};

struct Fixture {
    identity: Box<dyn Identity>,
    fingerprint: [u8; 16],
    valid: Stanza,
    key: [u8; 32],
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let key = RecoveryKey::from_scalar_bytes(&[7u8; 32]).expect("scalar");
        let recipient = key.recipient().expect("recipient");
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(1);
        let session = SessionKey::from_bytes(&[0x42; 32]);
        let valid = recipient.wrap(&session, &mut rng).expect("wrap");
        Fixture {
            fingerprint: recipient.fingerprint(),
            identity: Box::new(key.into_identity().expect("identity")),
            valid,
            key: [0x42; 32],
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    // Recipient strings, with and without the prefix.
    let text = String::from_utf8_lossy(data);
    let _ = recovery::parse_recipient(&text);
    let _ = recovery::parse_recipient(&format!("{}{text}", recovery::RECIPIENT_PREFIX));
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let stanza = match selector % 3 {
        // Anything.
        0 => match rest.split_first() {
            Some((&kind, body)) => Stanza {
                kind,
                body: body.to_vec(),
            },
            None => return,
        },
        // Addressed to the identity.
        1 => {
            let mut body = f.fingerprint.to_vec();
            body.extend_from_slice(rest);
            Stanza { kind: 1, body }
        }
        // A valid stanza with (position, xor) pairs applied after the
        // fingerprint.
        _ => {
            let mut s = f.valid.clone();
            for pair in rest.chunks_exact(2) {
                let at = 16 + pair[0] as usize % (s.body.len() - 16);
                s.body[at] ^= pair[1];
            }
            s
        }
    };
    let changed = stanza.body != f.valid.body || stanza.kind != f.valid.kind;
    if let Ok(Some(key)) = f.identity.unwrap(&stanza) {
        assert!(
            !changed || key.expose() == &f.key,
            "a modified stanza unwrapped to another key"
        );
    }
});
