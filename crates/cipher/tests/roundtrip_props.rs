//! Round-trip and determinism properties of the whole file format: header,
//! recipient stanzas, streaming payload, on every mode, key size, backend and
//! worker count, with small segments so that many segments are cheap.

use std::sync::Arc;

use proptest::prelude::*;
use rand_chacha::rand_core::{CryptoRng, RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use tpmcrypt_cipher::backend::{self, Backend};
use tpmcrypt_cipher::recipient::rsa::{RsaIdentity, RsaRecipient, SoftwareRsa};
use tpmcrypt_cipher::recipient::{Identity, Recipient};
use tpmcrypt_cipher::recovery::RecoveryKey;
use tpmcrypt_cipher::stream::Layout;
use tpmcrypt_cipher::{Decryptor, Encryptor, Header, Mode, Params, SessionKey, StreamOptions};

const MODES: [Mode; 2] = [Mode::Gcm, Mode::Cbc];
const BITS: [u32; 3] = [128, 192, 256];

/// A deterministic recovery key (the tests need the same key twice: once as
/// recipient, once as identity).
fn recovery_key(seed: u64) -> RecoveryKey {
    RecoveryKey::generate(&mut ChaCha20Rng::seed_from_u64(seed))
}

fn recipients(seed: u64) -> Vec<Box<dyn Recipient>> {
    vec![Box::new(recovery_key(seed).recipient().unwrap())]
}

fn decryptor(seed: u64) -> Decryptor {
    Decryptor::new(vec![
        Box::new(recovery_key(seed).into_identity().unwrap()) as Box<dyn Identity>
    ])
}

fn params(mode: Mode, bits: u32, segment_size: u32) -> Params {
    Params::new(mode, bits)
        .unwrap()
        .with_segment_size(segment_size)
        .unwrap_or_else(|e| panic!("{mode:?}/{bits}/{segment_size}: {e}"))
}

/// Smallest segment size `Layout::new` accepts for the mode and key size.
fn min_segment(mode: Mode, bits: u32) -> u32 {
    (1..400)
        .find(|&s| {
            Params::new(mode, bits)
                .unwrap()
                .with_segment_size(s)
                .is_ok()
        })
        .unwrap()
}

/// Valid small segment sizes: gcm any size from the minimum (at least 64)
/// to 300; cbc sizes with (size - tag) a multiple of 16 (tag = key length).
fn segment_sizes(mode: Mode, bits: u32) -> BoxedStrategy<u32> {
    let key_len = bits / 8;
    match mode {
        Mode::Gcm => (min_segment(mode, bits).max(64)..=300).boxed(),
        Mode::Cbc => {
            let first = (min_segment(mode, bits) - key_len) / 16;
            (first..=first + 15)
                .prop_map(move |k| key_len + 16 * k)
                .boxed()
        }
    }
}

fn supports(b: &dyn Backend, mode: Mode, key_len: usize) -> bool {
    match mode {
        Mode::Gcm => b.supports_gcm(key_len),
        Mode::Cbc => b.supports_cbc(),
    }
}

fn backends_for(mode: Mode, key_len: usize) -> Vec<Arc<dyn Backend>> {
    let all: Vec<_> = {
        // Every backend, OpenSSL included (see backend::enable_openssl).
        backend::enable_openssl();
        backend::all()
    }
    .into_iter()
    .filter(|b| supports(b.as_ref(), mode, key_len))
    .collect();
    assert!(!all.is_empty());
    all
}

fn plaintext(len: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; len];
    ChaCha20Rng::seed_from_u64(seed ^ 0x5eed).fill_bytes(&mut data);
    data
}

fn encrypt(enc: &Encryptor, plain: &[u8], workers: usize, seed: u64) -> Vec<u8> {
    let mut out = Vec::new();
    let n = enc
        .encrypt_with_rng(
            plain,
            &mut out,
            &StreamOptions::parallel(workers),
            &mut ChaCha20Rng::seed_from_u64(seed),
        )
        .unwrap_or_else(|e| panic!("encrypt {} bytes: {e}", plain.len()));
    assert_eq!(n, plain.len() as u64);
    out
}

fn decrypt(dec: &Decryptor, file: &[u8], workers: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let n = dec
        .decrypt(file, &mut out, &StreamOptions::parallel(workers))
        .unwrap_or_else(|e| panic!("decrypt {} bytes: {e}", file.len()));
    assert_eq!(n, out.len() as u64);
    out
}

/// Plaintext lengths around the segment boundaries of `layout`.
fn boundary_lengths(layout: &Layout) -> Vec<usize> {
    let p0 = layout.plaintext_segment_len(0);
    let p1 = layout.plaintext_segment_len(1);
    let mut v = vec![
        0,
        1,
        p0 - 1,
        p0,
        p0 + 1,
        p0 + p1 - 1,
        p0 + p1,
        p0 + p1 + 1,
        p0 + 2 * p1,
        p0 + 7 * p1 + 5,
    ];
    v.sort_unstable();
    v.dedup();
    v
}

/// Encrypts with the session's backend, checks the payload length, and
/// decrypts with every backend that supports the parameters.
fn round_trip(enc: &Encryptor, dec: &[Decryptor], len: usize, workers: usize, seed: u64) {
    let layout = enc.layout();
    let plain = plaintext(len, seed);
    let file = encrypt(enc, &plain, workers, seed);
    assert_eq!(&file[..enc.header().len()], enc.header());
    assert_eq!(
        (file.len() - enc.header().len()) as u64,
        layout.payload_len(len as u64),
        "payload_len({len}) for {layout:?}"
    );
    for d in dec {
        assert!(decrypt(d, &file, workers) == plain, "{layout:?} len {len}");
    }
}

#[test]
fn boundary_sizes_every_mode_key_size_and_worker_count() {
    let mut runs = 0;
    for mode in MODES {
        for bits in BITS {
            let min = min_segment(mode, bits);
            let key_len = (bits / 8) as usize;
            // The minimum, and a larger size of the right shape.
            for seg in [min, min + 96] {
                let p = params(mode, bits, seg);
                let seed = u64::from(seg) * 1000 + u64::from(bits);
                let enc =
                    Encryptor::with_rng(&recipients(1), p, &mut ChaCha20Rng::seed_from_u64(seed))
                        .unwrap();
                assert_eq!(enc.layout(), Layout::new(&p).unwrap());
                let decs: Vec<_> = backends_for(mode, key_len)
                    .into_iter()
                    .map(|b| decryptor(1).with_backend(b))
                    .collect();
                for len in boundary_lengths(&enc.layout()) {
                    for workers in [1, 2, 3] {
                        round_trip(&enc, &decs, len, workers, seed + len as u64);
                        runs += 1;
                    }
                }
                for d in &decs {
                    assert_eq!(d.unwrap_count(), 1, "one unwrap per decryptor and session");
                }
            }
        }
    }
    println!("boundary round trips: {runs}");
}

/// An exhaustive sweep of small lengths on the smallest segments, where every
/// length is near some boundary.
#[test]
fn every_small_length_on_minimal_segments() {
    for mode in MODES {
        for bits in BITS {
            let p = params(mode, bits, min_segment(mode, bits));
            let enc =
                Encryptor::with_rng(&recipients(2), p, &mut ChaCha20Rng::seed_from_u64(9)).unwrap();
            let dec = [decryptor(2)];
            let limit = 3 * enc.layout().plaintext_segment_len(1) + 2;
            for len in 0..limit {
                round_trip(&enc, &dec, len, 1 + len % 3, len as u64);
            }
        }
    }
}

fn mode_strategy() -> impl Strategy<Value = Mode> {
    prop_oneof![Just(Mode::Gcm), Just(Mode::Cbc)]
}

fn case_strategy() -> impl Strategy<Value = (Mode, u32, u32)> {
    (mode_strategy(), prop::sample::select(BITS.to_vec()))
        .prop_flat_map(|(mode, bits)| (Just(mode), Just(bits), segment_sizes(mode, bits)))
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 64,
        // Integration tests have no lib.rs for proptest to anchor a
        // regressions file to; failures print their minimal case instead.
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Any length, any valid segment size, encrypted on one backend and
    /// decrypted on another, with any worker count.
    #[test]
    fn random_round_trip(
        (mode, bits, seg) in case_strategy(),
        len in 0usize..2500,
        workers in 1usize..=3,
        seed in any::<u64>(),
        pick in any::<(usize, usize)>(),
    ) {
        let p = params(mode, bits, seg);
        let key_len = p.key_len;
        let bs = backends_for(mode, key_len);
        let enc = Encryptor::with_rng(&recipients(3), p, &mut ChaCha20Rng::seed_from_u64(seed))
            .unwrap()
            .with_backend(bs[pick.0 % bs.len()].clone());
        let dec = [decryptor(3).with_backend(bs[pick.1 % bs.len()].clone())];
        round_trip(&enc, &dec, len, workers, seed);
    }

    /// Same session randomness and file randomness give the same bytes on
    /// every backend, and every backend reads every other's files.
    #[test]
    fn backends_agree_byte_for_byte(
        (mode, bits, seg) in case_strategy(),
        len in 0usize..1500,
        seed in any::<u64>(),
    ) {
        let p = params(mode, bits, seg);
        let files: Vec<(String, Vec<u8>)> = backends_for(mode, p.key_len)
            .into_iter()
            .map(|b| {
                let enc = Encryptor::with_rng(
                    &recipients(4), p, &mut ChaCha20Rng::seed_from_u64(seed),
                )
                .unwrap()
                .with_backend(b.clone());
                (b.name().to_string(), encrypt(&enc, &plaintext(len, seed), 2, !seed))
            })
            .collect();
        for (name, file) in &files[1..] {
            prop_assert!(
                file == &files[0].1,
                "{} and {} differ for {:?}", name, files[0].0, p
            );
        }
        let plain = plaintext(len, seed);
        for b in backends_for(mode, p.key_len) {
            prop_assert!(decrypt(&decryptor(4).with_backend(b), &files[0].1, 1) == plain);
        }
    }
}

/// Deterministic cross-backend check over every mode and key size, through
/// `with_session_key` (a given key) and `with_rng` (a drawn one).
#[test]
fn every_backend_produces_identical_files() {
    for mode in MODES {
        for bits in BITS {
            let p = params(mode, bits, min_segment(mode, bits) + 32);
            let layout = Layout::new(&p).unwrap();
            let len = layout.plaintext_segment_len(0) + 3 * layout.plaintext_segment_len(1) + 7;
            let plain = plaintext(len, 77);
            let bs = backends_for(mode, p.key_len);
            let expect_backends = match (mode, bits) {
                (Mode::Cbc, _) => 2,
                (Mode::Gcm, 192) => 3,
                (Mode::Gcm, _) => 4,
            };
            assert_eq!(bs.len(), expect_backends, "{mode:?}/{bits}");
            let mut outputs = Vec::new();
            for b in &bs {
                let given = Encryptor::with_session_key(
                    &recipients(5),
                    p,
                    SessionKey::from_bytes(&[0x5A; 32]),
                    &mut ChaCha20Rng::seed_from_u64(11),
                )
                .unwrap()
                .with_backend(b.clone());
                assert_eq!(given.backend().name(), b.name());
                let drawn =
                    Encryptor::with_rng(&recipients(5), p, &mut ChaCha20Rng::seed_from_u64(12))
                        .unwrap()
                        .with_backend(b.clone());
                for workers in [1, 3] {
                    outputs.push((
                        b.name(),
                        workers,
                        encrypt(&given, &plain, workers, 13),
                        encrypt(&drawn, &plain, workers, 13),
                    ));
                }
            }
            let (_, _, first_given, first_drawn) = &outputs[0];
            assert_ne!(first_given, first_drawn, "different session keys");
            for (name, workers, given, drawn) in &outputs {
                assert!(given == first_given, "{mode:?}/{bits}: {name} x{workers}");
                assert!(drawn == first_drawn, "{mode:?}/{bits}: {name} x{workers}");
            }
            for b in &bs {
                let dec = decryptor(5).with_backend(b.clone());
                assert!(decrypt(&dec, first_given, 2) == plain);
                assert!(decrypt(&dec, first_drawn, 2) == plain);
                assert_eq!(dec.unwrap_count(), 2);
            }
        }
    }
}

/// An RNG that counts what is drawn from it.
struct Counting<R> {
    inner: R,
    drawn: usize,
}

impl<R: RngCore> RngCore for Counting<R> {
    fn next_u32(&mut self) -> u32 {
        self.drawn += 4;
        self.inner.next_u32()
    }
    fn next_u64(&mut self) -> u64 {
        self.drawn += 8;
        self.inner.next_u64()
    }
    fn fill_bytes(&mut self, dest: &mut [u8]) {
        self.drawn += dest.len();
        self.inner.fill_bytes(dest)
    }
    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand_chacha::rand_core::Error> {
        self.drawn += dest.len();
        self.inner.try_fill_bytes(dest)
    }
}

impl<R: CryptoRng> CryptoRng for Counting<R> {}

/// The P-256 wrap (recovery and TPM P-256 recipients) takes all of its
/// randomness (the ephemeral key) from the RNG it is given: the same seed
/// gives the same stanza and leaves the RNG in the same state, and a
/// different seed gives a different ephemeral key.
#[test]
fn p256_wrap_uses_only_the_supplied_rng() {
    let recipient = recovery_key(6).recipient().unwrap();
    let session = SessionKey::from_bytes(&[0x11; 32]);
    let wrap = |seed: u64| {
        let mut rng = Counting {
            inner: ChaCha20Rng::seed_from_u64(seed),
            drawn: 0,
        };
        let stanza = recipient.wrap(&session, &mut rng).unwrap();
        (stanza, rng.drawn, rng.inner.next_u64())
    };
    let (a, drawn_a, next_a) = wrap(1);
    let (b, drawn_b, next_b) = wrap(1);
    let (c, _, _) = wrap(2);
    assert_eq!(a, b, "same seed, same stanza");
    assert!(
        drawn_a >= 32,
        "the ephemeral scalar comes from the RNG ({drawn_a} bytes)"
    );
    assert_eq!((drawn_a, next_a), (drawn_b, next_b));
    assert_ne!(a.body, c.body);

    // A whole session header is therefore a function of the seed.
    let p = params(Mode::Gcm, 256, 128);
    let h1 = Encryptor::with_rng(&recipients(6), p, &mut ChaCha20Rng::seed_from_u64(3)).unwrap();
    let h2 = Encryptor::with_rng(&recipients(6), p, &mut ChaCha20Rng::seed_from_u64(3)).unwrap();
    let h3 = Encryptor::with_rng(&recipients(6), p, &mut ChaCha20Rng::seed_from_u64(4)).unwrap();
    assert_eq!(h1.header(), h2.header());
    assert_ne!(h1.header(), h3.header());
}

#[test]
fn payload_len_matches_files() {
    for mode in MODES {
        for bits in BITS {
            let p = params(mode, bits, min_segment(mode, bits) + 16);
            let enc =
                Encryptor::with_rng(&recipients(7), p, &mut ChaCha20Rng::seed_from_u64(1)).unwrap();
            let layout = enc.layout();
            let mut lens = boundary_lengths(&layout);
            lens.extend([2, 15, 16, 17, 31, 32, 33, 1000]);
            for len in lens {
                let file = encrypt(&enc, &plaintext(len, 0), 1, 0);
                let header = Header::read_from(&mut &file[..]).unwrap();
                assert_eq!(header.raw(), enc.header());
                assert_eq!(header.payload_offset(), enc.header().len());
                assert_eq!(
                    (file.len() - header.payload_offset()) as u64,
                    layout.payload_len(len as u64),
                    "{mode:?}/{bits} len {len}"
                );
            }
        }
    }
}

#[test]
fn decryptor_unwraps_once_per_session() {
    let p = params(Mode::Gcm, 128, 100);
    let one = Encryptor::with_rng(&recipients(8), p, &mut ChaCha20Rng::seed_from_u64(1)).unwrap();
    let dec = decryptor(8);
    let mut files = Vec::new();
    for i in 0..20 {
        let plain = plaintext(i * 37, i as u64);
        files.push((encrypt(&one, &plain, 1 + i % 2, i as u64), plain));
    }
    for (file, plain) in &files {
        assert!(&decrypt(&dec, file, 2) == plain);
    }
    assert_eq!(dec.unwrap_count(), 1, "20 files of one session");

    let cbc = params(Mode::Cbc, 192, 104);
    let two = Encryptor::with_rng(&recipients(8), cbc, &mut ChaCha20Rng::seed_from_u64(2)).unwrap();
    assert_ne!(one.header(), two.header());
    let dec = decryptor(8);
    for i in 0..20usize {
        let plain = plaintext(i * 11, 100 + i as u64);
        let enc = if i % 2 == 0 { &one } else { &two };
        let file = encrypt(enc, &plain, 1, i as u64);
        assert!(decrypt(&dec, &file, 1) == plain);
    }
    assert_eq!(dec.unwrap_count(), 2, "files of two sessions");
    let header = Header::read_from(&mut &files[0].0[..]).unwrap();
    assert!(dec.has_session_key(&header));
}

/// A file to two recipient kinds opens with either identity alone.
#[test]
fn rsa_and_recovery_recipients() {
    let rsa = openssl::rsa::Rsa::generate(2048).unwrap();
    let pkey = openssl::pkey::PKey::from_rsa(rsa).unwrap();
    let der = pkey.public_key_to_der().unwrap();
    let mut recips = recipients(9);
    recips.push(Box::new(RsaRecipient::from_spki_der(&der).unwrap()));
    let p = params(Mode::Cbc, 256, 96);
    let enc = Encryptor::with_rng(&recips, p, &mut ChaCha20Rng::seed_from_u64(1)).unwrap();
    let plain = plaintext(1000, 1);
    let file = encrypt(&enc, &plain, 2, 1);
    let header = Header::read_from(&mut &file[..]).unwrap();
    assert_eq!(header.stanzas.len(), 2);
    let by_rsa = Decryptor::new(vec![Box::new(RsaIdentity::new(SoftwareRsa(pkey)))]);
    assert!(decrypt(&by_rsa, &file, 1) == plain);
    assert!(decrypt(&decryptor(9), &file, 3) == plain);
}
