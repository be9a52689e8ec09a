//! Tink's published AES-GCM-HKDF streaming AEAD vectors, run through our
//! segment engine (`stream::run`) on every backend, sequential and parallel.
//!
//! Source: tink-java,
//! `src/test/java/com/google/crypto/tink/streamingaead/internal/testing/AesGcmHkdfStreamingTestUtil.java`
//! (`createTestVector0` … `createTestVector7`; vector 0 is also the
//! cross-language `test_manually_created_test_vector`).
//!
//! Tink ciphertext = header ‖ segments, header = len ‖ salt ‖ nonce prefix.
//! Tink derives the AES key as HKDF-<hash>(ikm = key, salt, info = aad, L =
//! derived key size). Our format fixes the hash to SHA-256 (and the info to
//! the tpmcrypt header), so the key is derived here and handed to
//! `FileKeys::from_material`; for the SHA-256 vector `FileKeys::derive` (the
//! production path) is checked to agree.

use std::sync::Arc;

use hkdf::Hkdf;
use tpmcrypt_cipher::backend::{self, Backend};
use tpmcrypt_cipher::stream::{self, Direction, FileKeys, Layout, NONCE_PREFIX_LEN};
use tpmcrypt_cipher::{Error, Mode, Params, StreamOptions};

#[derive(Clone, Copy, Debug)]
enum HkdfHash {
    Sha1,
    Sha256,
    Sha512,
}

struct Vector {
    name: &'static str,
    key: &'static str,
    hash: HkdfHash,
    segment_size: u32,
    derived_key_size: usize,
    plaintext: &'static [u8],
    aad: &'static [u8],
    ciphertext: &'static str,
}

const KEY16: &str = "6eb56cdc726dfbe5d57f2fcdc6e9345b";
const KEY32: &str = "00112233445566778899aabbccddeeff6eb56cdc726dfbe5d57f2fcdc6e9345b";
const EMPTY_32_CT: &str = "28fae780c70a82d1256c8303a1261ac6a98cf557b4e173967a62f3c149517ba5b2431da93b3c6e90f508b34dc14bfda59bab05681c6ad3fa";

const VECTORS: &[Vector] = &[
    Vector {
        name: "v0: three segments",
        key: KEY16,
        hash: HkdfHash::Sha1,
        segment_size: 64,
        derived_key_size: 16,
        plaintext:
            b"This is a fairly long plaintext. It is of the exact length to create three output blocks. ",
        aad: b"aad",
        ciphertext: concat!(
            "18",
            "93b3af5e14ab378d065addfc8484da64",
            "2c0862877baea8",
            "db92d9c77406a406168478821c4298eab3e6d531277f4c1a051714faebcaefcbca7b7be05e9445ea",
            "a0bb2904153398a25084dd80ae0edcd1c3079fcea2cd3770630ee36f7539207b",
            "8ec9d754956d486b71cdf989f0ed6fba6779b63558be0a66e668df14e1603cd2",
            "af8944844078345286d0b292e772e7190775c51a0f83e40c0b75821027e7e538e111",
        ),
    },
    Vector {
        name: "v1: empty, SHA-1",
        key: KEY16,
        hash: HkdfHash::Sha1,
        segment_size: 64,
        derived_key_size: 16,
        plaintext: b"",
        aad: b"",
        ciphertext: "18ec99b2c3884194023bd41bb9bff309205354c750fa0cb3c0d02609abf71f88eaeaa48d7deca27f",
    },
    Vector {
        name: "v2: empty, SHA-256",
        key: KEY16,
        hash: HkdfHash::Sha256,
        segment_size: 64,
        derived_key_size: 16,
        plaintext: b"",
        aad: b"",
        ciphertext: "18be78bce0cab6fd38a9041eea8ab0ffc4cf17e3c00b661d3927f5f79069f41a210fedc40b25648c",
    },
    Vector {
        name: "v3: empty, SHA-512",
        key: KEY16,
        hash: HkdfHash::Sha512,
        segment_size: 64,
        derived_key_size: 16,
        plaintext: b"",
        aad: b"",
        ciphertext: "18fec8139ccb406e0f140d7e2bcc41e1b899bc1b121574cc31d1c78ed2ca1cdf324665b8dce21095",
    },
    Vector {
        name: "v4: 32-byte ikm, 16-byte derived key",
        key: KEY32,
        hash: HkdfHash::Sha1,
        segment_size: 64,
        derived_key_size: 16,
        plaintext: b"",
        aad: b"",
        ciphertext: "180880e85a24207a7b72cefde26306ed09d7d76e58104b751d005a3ffd72dd6151f0d9c8ccf163f7",
    },
    Vector {
        name: "v5: 32-byte derived key",
        key: KEY32,
        hash: HkdfHash::Sha1,
        segment_size: 64,
        derived_key_size: 32,
        plaintext: b"",
        aad: b"",
        ciphertext: EMPTY_32_CT,
    },
    Vector {
        name: "v6: segment size 128",
        key: KEY32,
        hash: HkdfHash::Sha1,
        segment_size: 128,
        derived_key_size: 32,
        plaintext: b"",
        aad: b"",
        ciphertext: EMPTY_32_CT,
    },
    Vector {
        name: "v7: plaintext exactly filling segment 0",
        key: KEY32,
        hash: HkdfHash::Sha1,
        segment_size: 120,
        derived_key_size: 32,
        plaintext: b"BLOCK 1.BLOCK 2.BLOCK 3.BLOCK 4.BLOCK 5.BLOCK 6.BLOCK 7.BLOCK 8.",
        aad: &[0, 1, 2, 3],
        ciphertext: concat!(
            "28782994617714a80fa085e15051a16854522330d6d0f26c049b2192f09cdd98",
            "b2eb90c753bfff277a29e54fa4afb15d648c28477eb07f012535c767f5fdce24",
            "ffffae318480c1d37357d6d3c511159318afa09ef38aa3f5456fd7817c5c02dd",
            "6e1a7fef174c8bd24e38b5982ac105497c0101ac5581fe5b",
        ),
    },
];

fn derive(hash: HkdfHash, ikm: &[u8], salt: &[u8], info: &[u8], len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    match hash {
        HkdfHash::Sha1 => Hkdf::<sha1::Sha1>::new(Some(salt), ikm).expand(info, &mut out),
        HkdfHash::Sha256 => Hkdf::<sha2::Sha256>::new(Some(salt), ikm).expand(info, &mut out),
        HkdfHash::Sha512 => Hkdf::<sha2::Sha512>::new(Some(salt), ikm).expand(info, &mut out),
    }
    .expect("hkdf length");
    out
}

struct Parsed {
    layout: Layout,
    salt: Vec<u8>,
    prefix: [u8; NONCE_PREFIX_LEN],
    segments: Vec<u8>,
}

fn parse(v: &Vector) -> Parsed {
    let ct = hex::decode(v.ciphertext).unwrap();
    let layout = Layout::new(&Params {
        mode: Mode::Gcm,
        key_len: v.derived_key_size,
        segment_size: v.segment_size,
    })
    .unwrap_or_else(|e| panic!("{}: layout: {e}", v.name));
    let header_len = layout.stream_header_len();
    assert_eq!(ct[0] as usize, header_len, "{}: header length byte", v.name);
    let salt = ct[1..1 + v.derived_key_size].to_vec();
    let prefix: [u8; NONCE_PREFIX_LEN] = ct[1 + v.derived_key_size..header_len].try_into().unwrap();
    let segments = ct[header_len..].to_vec();
    // Our layout predicts Tink's payload length.
    assert_eq!(
        layout.payload_len(v.plaintext.len() as u64),
        ct.len() as u64,
        "{}: payload_len",
        v.name
    );
    Parsed {
        layout,
        salt,
        prefix,
        segments,
    }
}

fn run_vec(
    direction: Direction,
    backend: &Arc<dyn Backend>,
    keys: &FileKeys,
    input: &[u8],
    workers: usize,
) -> Result<(Vec<u8>, u64), Error> {
    let mut out = Vec::new();
    let n = stream::run(
        direction,
        backend,
        keys,
        &mut &input[..],
        &mut out,
        &StreamOptions::parallel(workers),
    )?;
    Ok((out, n))
}

#[test]
fn tink_aes_gcm_hkdf_streaming_vectors() {
    let mut executed = std::collections::BTreeMap::<&str, usize>::new();
    for v in VECTORS {
        let p = parse(v);
        let ikm = hex::decode(v.key).unwrap();
        let derived = derive(v.hash, &ikm, &p.salt, v.aad, v.derived_key_size);
        for b in {
            // Every backend, OpenSSL included (see backend::enable_openssl).
            backend::enable_openssl();
            backend::all()
        } {
            if !b.supports_gcm(v.derived_key_size) {
                continue;
            }
            let keys = FileKeys::from_material(p.layout, &derived, p.prefix).unwrap();
            for workers in [1, 2] {
                let ctx = format!("{} [{} backend, {workers} workers]", v.name, b.name());
                let (plain, n) = run_vec(Direction::Open, &b, &keys, &p.segments, workers)
                    .unwrap_or_else(|e| panic!("{ctx}: open: {e}"));
                assert_eq!(plain, v.plaintext, "{ctx}: open");
                assert_eq!(n, v.plaintext.len() as u64, "{ctx}: open count");

                let (sealed, n) = run_vec(Direction::Seal, &b, &keys, v.plaintext, workers)
                    .unwrap_or_else(|e| panic!("{ctx}: seal: {e}"));
                assert_eq!(
                    hex::encode(&sealed),
                    hex::encode(&p.segments),
                    "{ctx}: seal must reproduce Tink's segments byte for byte"
                );
                assert_eq!(n, v.plaintext.len() as u64, "{ctx}: seal count");

                // A cut or modified ciphertext must not open.
                let cut = &p.segments[..p.segments.len() - 1];
                let err = run_vec(Direction::Open, &b, &keys, cut, workers).unwrap_err();
                assert!(err.is_integrity(), "{ctx}: cut: {err}");
                let mut bad = p.segments.clone();
                bad[0] ^= 0x80;
                let err = run_vec(Direction::Open, &b, &keys, &bad, workers).unwrap_err();
                assert!(
                    matches!(err, Error::SegmentAuth { index: 0 }),
                    "{ctx}: flipped: {err}"
                );
            }

            if matches!(v.hash, HkdfHash::Sha256) {
                // The production HKDF path gives the same key.
                let keys =
                    FileKeys::derive(b.as_ref(), p.layout, &ikm, &p.salt, v.aad, p.prefix).unwrap();
                let (sealed, _) = run_vec(Direction::Seal, &b, &keys, v.plaintext, 1).unwrap();
                assert_eq!(sealed, p.segments, "{}: FileKeys::derive", v.name);
                let (plain, _) = run_vec(Direction::Open, &b, &keys, &p.segments, 2).unwrap();
                assert_eq!(plain, v.plaintext, "{}: FileKeys::derive", v.name);
                let mut material = vec![0u8; p.layout.key_material_len()];
                b.hkdf_sha256(&ikm, &p.salt, v.aad, &mut material).unwrap();
                assert_eq!(material, derived, "{}: backend hkdf_sha256", v.name);
            }
            *executed.entry(b.name()).or_default() += 1;
        }
    }
    for b in {
        // Every backend, OpenSSL included (see backend::enable_openssl).
        backend::enable_openssl();
        backend::all()
    } {
        let n = executed.get(b.name()).copied().unwrap_or(0);
        println!(
            "tink AES-GCM-HKDF vectors: backend {:<10} executed {n} of {}",
            b.name(),
            VECTORS.len()
        );
        assert_eq!(n, VECTORS.len(), "{} supports 128/256-bit GCM", b.name());
    }
}

/// The segment split Tink uses: segment 0 is shorter by the stream header,
/// and a plaintext that exactly fills its last segment gets no trailing
/// empty segment (v7 is one segment of 120 bytes, header included).
#[test]
fn tink_segment_layout() {
    let v0 = parse(&VECTORS[0]);
    assert_eq!(v0.layout.plaintext_segment_len(0), 24);
    assert_eq!(v0.layout.plaintext_segment_len(1), 48);
    assert_eq!(v0.segments.len(), 40 + 64 + 34);
    let v7 = parse(&VECTORS[7]);
    assert_eq!(v7.layout.plaintext_segment_len(0), 64);
    assert_eq!(v7.layout.stream_header_len() + v7.segments.len(), 120);
}
