//! In-process AES throughput of each backend, without I/O: seals and opens
//! 1 MiB segments repeatedly and prints GB/s and cycles per byte estimates.
//! Used to choose the default backend (see docs/format.md, "Backends").
//!
//! cargo run --release -p tpmcrypt-cipher --example backend_speed

use std::sync::Arc;
use std::time::Instant;

use tpmcrypt_cipher::backend::{self, Backend, Hash};
use tpmcrypt_cipher::cbc_hmac::CbcHmac;

const SEG: usize = 1 << 20;
const ROUNDS: usize = 256;
const NONCE: [u8; 12] = [7u8; 12];

fn main() {
    let mut buf = vec![0x5au8; SEG];
    println!(
        "{:<11} {:<16} {:>9} {:>9}",
        "backend", "primitive", "seal GB/s", "open GB/s"
    );
    for b in {
        // Every backend, OpenSSL included (see backend::enable_openssl).
        backend::enable_openssl();
        backend::all()
    } {
        for key_len in [16usize, 24, 32] {
            if b.supports_gcm(key_len) {
                gcm_row(b.as_ref(), key_len, &mut buf);
            }
        }
        if b.supports_cbc() {
            for key_len in [16usize, 24, 32] {
                cbc_row(&b, key_len, &mut buf);
            }
        }
    }
}

/// Best of three: sealing and opening ROUNDS segments with AES-GCM.
fn gcm_row(b: &dyn Backend, key_len: usize, buf: &mut Vec<u8>) {
    let Ok(mut k) = b.gcm(&vec![1u8; key_len]) else {
        return;
    };
    let mut best_seal = f64::MAX;
    let mut best_open = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..ROUNDS {
            buf.truncate(SEG);
            k.seal(&NONCE, &[], buf).expect("seal");
        }
        best_seal = best_seal.min(t.elapsed().as_secs_f64());
        buf.truncate(SEG);
        k.seal(&NONCE, &[], buf).expect("seal");
        let sealed = buf.clone();
        let t = Instant::now();
        for _ in 0..ROUNDS {
            buf.copy_from_slice(&sealed);
            k.open(&NONCE, &[], buf).expect("open");
        }
        best_open = best_open.min(t.elapsed().as_secs_f64());
    }
    let gb = (SEG * ROUNDS) as f64 / 1e9;
    println!(
        "{:<11} {:<16} {:>9.2} {:>9.2}",
        b.name(),
        format!("aes-{}-gcm", key_len * 8),
        gb / best_seal,
        gb / best_open
    );
}

/// Best of three: sealing ROUNDS / 4 segments with CBC-HMAC.
fn cbc_row(b: &Arc<dyn Backend>, key_len: usize, buf: &mut Vec<u8>) {
    let Ok(mut k) = CbcHmac::new(b.clone(), &vec![2u8; key_len * 2]) else {
        return;
    };
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..ROUNDS / 4 {
            buf.truncate(SEG);
            k.seal(&[3u8; 16], &NONCE, buf).expect("seal");
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    let gb = (SEG * ROUNDS / 4) as f64 / 1e9;
    let hs = match key_len {
        16 => Hash::Sha256,
        24 => Hash::Sha384,
        _ => Hash::Sha512,
    };
    println!(
        "{:<11} {:<16} {:>9.2} {:>9}",
        b.name(),
        format!("a{}cbc-hs{}", key_len * 8, hs.output_len() * 8),
        gb / best,
        "-"
    );
}
