//! The `Read`/`Write` adapters (`Encryptor::wrap_output`,
//! `Decryptor::unwrap_input`): byte-for-byte agreement with the engine,
//! truncation and tampering as errors that carry the cipher error, and
//! round trips over lengths around segment boundaries.

use std::io::{self, Read, Write};

use proptest::prelude::*;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use tpmcrypt_cipher::io::cipher_error;
use tpmcrypt_cipher::recipient::{Identity, Recipient};
use tpmcrypt_cipher::recovery::RecoveryKey;
use tpmcrypt_cipher::{Decryptor, Encryptor, Error, Mode, Params, StreamOptions};

fn key() -> RecoveryKey {
    RecoveryKey::generate(&mut ChaCha20Rng::seed_from_u64(41))
}

fn encryptor(mode: Mode, bits: u32, segment: u32) -> Encryptor {
    let to: Vec<Box<dyn Recipient>> = vec![Box::new(key().recipient().unwrap())];
    let params = Params::new(mode, bits)
        .unwrap()
        .with_segment_size(segment)
        .unwrap();
    Encryptor::with_rng(&to, params, &mut ChaCha20Rng::seed_from_u64(7)).unwrap()
}

fn decryptor() -> Decryptor {
    Decryptor::new(vec![
        Box::new(key().into_identity().unwrap()) as Box<dyn Identity>
    ])
}

fn plaintext(len: usize) -> Vec<u8> {
    let mut data = vec![0u8; len];
    ChaCha20Rng::seed_from_u64(len as u64).fill_bytes(&mut data);
    data
}

/// Encrypts through the writer, in writes of `piece` bytes.
fn write_in_pieces(enc: &Encryptor, plain: &[u8], piece: usize, seed: u64) -> Vec<u8> {
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let mut writer = enc.wrap_output_with_rng(Vec::new(), &mut rng).unwrap();
    for part in plain.chunks(piece.max(1)) {
        writer.write_all(part).unwrap();
    }
    writer.finish().unwrap()
}

fn engine_encrypt(enc: &Encryptor, plain: &[u8], workers: usize, seed: u64) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let opts = StreamOptions::parallel(workers);
    enc.encrypt_with_rng(plain, &mut out, &opts, &mut rng)
        .unwrap();
    out
}

/// Reads everything through the reader, in reads of `piece` bytes (an
/// error of `unwrap_input`, which reads the headers, as one of `read`).
fn read_in_pieces(dec: &Decryptor, file: &[u8], piece: usize) -> io::Result<Vec<u8>> {
    let mut reader = dec
        .unwrap_input(file)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; piece.max(1)];
    loop {
        match reader.read(&mut buf)? {
            0 => return Ok(out),
            n => out.extend_from_slice(&buf[..n]),
        }
    }
}

/// Lengths around the first segment boundaries of a 100-byte gcm segment.
fn boundary_lengths(enc: &Encryptor) -> Vec<usize> {
    let l = enc.layout();
    let (p0, p1) = (l.plaintext_segment_len(0), l.plaintext_segment_len(1));
    vec![
        0,
        1,
        p0 - 1,
        p0,
        p0 + 1,
        p0 + p1 - 1,
        p0 + p1,
        p0 + p1 + 1,
        p0 + 3 * p1,
    ]
}

#[test]
fn the_writer_writes_the_engines_bytes_and_each_reads_the_other() {
    for (mode, bits, seg) in [
        (Mode::Gcm, 256, 100),
        (Mode::Gcm, 128, 64),
        (Mode::Cbc, 256, 160),
    ] {
        let enc = encryptor(mode, bits, seg);
        let dec = decryptor();
        for len in boundary_lengths(&enc) {
            let plain = plaintext(len);
            let engine = engine_encrypt(&enc, &plain, 3, len as u64);
            for piece in [1, 7, 1000] {
                let written = write_in_pieces(&enc, &plain, piece, len as u64);
                assert!(written == engine, "{mode:?}/{bits} len {len} piece {piece}");
                assert_eq!(read_in_pieces(&dec, &engine, piece).unwrap(), plain);
            }
            let mut out = Vec::new();
            let opts = StreamOptions::parallel(2);
            dec.decrypt(&engine[..], &mut out, &opts).unwrap();
            assert_eq!(out, plain);
        }
    }
}

/// Every cut of the payload fails: at a segment boundary as truncation, and
/// never with a clean end of stream.
#[test]
fn a_truncated_file_is_an_error_carrying_the_cipher_error() {
    let enc = encryptor(Mode::Gcm, 256, 100);
    let dec = decryptor();
    let plain = plaintext(350);
    let file = write_in_pieces(&enc, &plain, 64, 1);
    let header = enc.header().len();
    for cut in header..file.len() {
        let err = read_in_pieces(&dec, &file[..cut], 50).expect_err("a cut file read whole");
        assert_eq!(
            err.kind(),
            io::ErrorKind::InvalidData,
            "cut at {cut}: {err}"
        );
        let cause = cipher_error(&err).unwrap_or_else(|| panic!("cut at {cut}: {err}"));
        assert!(
            cause.is_integrity() || matches!(cause, Error::TruncatedHeader),
            "{cause}"
        );
    }
    // A cut at the end of segment 1 (a full middle segment) is truncation.
    let at = header + 100 + 100;
    let err = read_in_pieces(&dec, &file[..at], 50).unwrap_err();
    assert!(
        matches!(cipher_error(&err), Some(Error::Truncated { index: 1 })),
        "{err}"
    );
}

/// A flipped byte in segment 1 fails that segment: the reader returns all
/// of segment 0 and nothing of segment 1, and then only errors.
#[test]
fn a_tampered_segment_returns_none_of_its_bytes() {
    let enc = encryptor(Mode::Gcm, 256, 100);
    let dec = decryptor();
    let plain = plaintext(300);
    let mut file = write_in_pieces(&enc, &plain, 300, 2);
    let header = enc.header().len();
    file[header + 100 + 10] ^= 1;
    let mut reader = dec.unwrap_input(&file[..]).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 16];
    let err = loop {
        match reader.read(&mut buf) {
            Ok(0) => panic!("a tampered file read to its end"),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => break e,
        }
    };
    let p0 = enc.layout().plaintext_segment_len(0);
    assert_eq!(got, plain[..p0]);
    assert!(
        matches!(cipher_error(&err), Some(Error::SegmentAuth { index: 1 })),
        "{err}"
    );
    assert!(
        reader.read(&mut buf).is_err(),
        "a failed stream must not end cleanly"
    );
}

/// A writer dropped without `finish` leaves a file that reads as truncated.
#[test]
fn a_writer_not_finished_leaves_a_truncated_file() {
    let enc = encryptor(Mode::Gcm, 256, 100);
    let mut out = Vec::new();
    {
        let mut writer = enc.wrap_output(&mut out).unwrap();
        writer.write_all(&plaintext(250)).unwrap();
    }
    let err = read_in_pieces(&decryptor(), &out, 4096).unwrap_err();
    assert!(cipher_error(&err).is_some_and(Error::is_integrity), "{err}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any length, any write and read sizes, both modes: the reader returns
    /// what the writer was given, and the engine agrees byte for byte.
    #[test]
    fn round_trip_around_segment_boundaries(
        cbc in any::<bool>(),
        segments in 0usize..4,
        offset in -2i64..=2,
        write_piece in 1usize..200,
        read_piece in 1usize..200,
    ) {
        let enc = if cbc {
            encryptor(Mode::Cbc, 128, 112)
        } else {
            encryptor(Mode::Gcm, 128, 80)
        };
        let l = enc.layout();
        let edge = l.plaintext_segment_len(0) + segments.saturating_sub(1) * l.plaintext_segment_len(1);
        let len = if segments == 0 { offset.unsigned_abs() as usize } else { (edge as i64 + offset) as usize };
        let plain = plaintext(len);
        let written = write_in_pieces(&enc, &plain, write_piece, 3);
        prop_assert!(written == engine_encrypt(&enc, &plain, 2, 3));
        prop_assert_eq!(read_in_pieces(&decryptor(), &written, read_piece).unwrap(), plain);
    }
}
