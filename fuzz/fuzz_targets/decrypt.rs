//! `Decryptor::decrypt` with a fixed recovery identity, over arbitrary
//! bytes and over mutations of valid files (gcm and cbc, three segments of
//! 4096 bytes, made with the identity in `fixtures/`). Nothing may panic;
//! whatever is written before an error is an authenticated prefix of the
//! plaintext; a mutated file that still decrypts must give the plaintext.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tpmcrypt_cipher::recovery::RecoveryKey;
use tpmcrypt_cipher::{Decryptor, StreamOptions};

const IDENTITY: &str = include_str!("../fixtures/identity.key");
/// The plaintext of both fixture files: `fixtures/plain`.
const PLAIN: &[u8] = include_bytes!("../fixtures/plain");
const VALID: [&[u8]; 2] = [
    include_bytes!("../fixtures/gcm128.tpmc"),
    include_bytes!("../fixtures/cbc256.tpmc"),
];

/// One decryptor for the whole run: its session-key cache only ever holds
/// keys of headers whose MAC verified (the fixtures' session keys), so the
/// unwrap path still runs for every other header.
fn decryptor() -> &'static Decryptor {
    static D: OnceLock<Decryptor> = OnceLock::new();
    D.get_or_init(|| {
        let key = RecoveryKey::parse(IDENTITY).expect("fixture identity");
        Decryptor::new(vec![Box::new(key.into_identity().expect("identity"))])
    })
}

/// Applies (op, position, value) triples to `file`.
fn mutate(file: &[u8], ops: &[u8]) -> Vec<u8> {
    let mut v = file.to_vec();
    for op in ops.chunks_exact(4) {
        if v.is_empty() {
            break;
        }
        let at = u16::from_be_bytes([op[1], op[2]]) as usize % v.len();
        let val = op[3];
        match op[0] % 5 {
            0 => v[at] ^= val.max(1),
            1 => v.truncate(at),
            2 => v.insert(at, val),
            3 => {
                let end = (at + val as usize).min(v.len());
                v.drain(at..end);
            }
            _ => {
                // Copy a run of bytes from elsewhere (segment splicing).
                let from = (at * 7 + val as usize * 131) % v.len();
                let n = (val as usize * 16).min(v.len() - at).min(v.len() - from);
                let run: Vec<u8> = v[from..from + n].to_vec();
                v[at..at + n].copy_from_slice(&run);
            }
        }
    }
    v
}

fn check(input: &[u8], valid: bool) {
    let mut out = Vec::new();
    let result = decryptor().decrypt(input, &mut out, &StreamOptions::sequential());
    match result {
        Ok(n) => {
            assert_eq!(n as usize, out.len());
            if valid {
                assert!(out == PLAIN, "a changed file decrypted to other data");
            }
        }
        Err(_) => {
            if valid {
                assert!(PLAIN.starts_with(&out), "unauthenticated output written");
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    match data.split_first() {
        Some((&sel, ops)) if sel & 0x80 != 0 => {
            let file = VALID[sel as usize % VALID.len()];
            check(&mutate(file, ops), true);
        }
        _ => {
            // A valid prefix of a fixture makes the raw input get further.
            let valid = data.len() >= 16 && VALID.iter().any(|f| f.starts_with(&data[..16]));
            check(data, valid);
        }
    }
});
