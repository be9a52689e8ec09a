//! Tampering, truncation, reordering and splicing: every one must fail as an
//! integrity error, with the exact error the engine promises, and — with any
//! worker count — without writing plaintext of the failing segment or any
//! segment after it.
//!
//! Files have three segments (small segments), in both modes and all key
//! sizes, in two shapes: last segment partial, and last segment full (the
//! shape in which a cut at a segment boundary is recognisable as such).

use std::ops::Range;

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use tpmcrypt_cipher::format::HEADER_MAC_LEN;
use tpmcrypt_cipher::recipient::{Identity, Recipient};
use tpmcrypt_cipher::recovery::RecoveryKey;
use tpmcrypt_cipher::stream::Layout;
use tpmcrypt_cipher::{Decryptor, Encryptor, Error, Mode, Params, StreamOptions};

const WORKERS: [usize; 3] = [1, 2, 3];

fn recovery_key(seed: u64) -> RecoveryKey {
    RecoveryKey::generate(&mut ChaCha20Rng::seed_from_u64(seed))
}

fn decryptor(seed: u64) -> Decryptor {
    Decryptor::new(vec![
        Box::new(recovery_key(seed).into_identity().unwrap()) as Box<dyn Identity>
    ])
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    /// p0 + p1 + p1/2 plaintext bytes: the last segment is partial.
    PartialLast,
    /// p0 + 2·p1 plaintext bytes: the last segment is full.
    FullLast,
}

struct Segment {
    ct: Range<usize>,
    pt: Range<usize>,
}

/// One session and two files of it (same length, different randomness).
struct Fixture {
    name: String,
    enc: Encryptor,
    layout: Layout,
    plain: Vec<u8>,
    /// File A and file B.
    files: [Vec<u8>; 2],
    /// Length of the tpmcrypt header.
    header_len: usize,
    /// Offset of segment 0 (after the stream header).
    payload_start: usize,
    segs: Vec<Segment>,
}

fn fixture(mode: Mode, bits: u32, shape: Shape) -> Fixture {
    // Small segments of a valid shape: for cbc, (size - tag) % 16 == 0 with
    // a tag of key_len bytes.
    let segment_size = match mode {
        Mode::Gcm => 96,
        Mode::Cbc => bits / 8 + 16 * 5,
    };
    let params = Params::new(mode, bits)
        .unwrap()
        .with_segment_size(segment_size)
        .unwrap();
    let recipients: Vec<Box<dyn Recipient>> = vec![Box::new(recovery_key(1).recipient().unwrap())];
    let enc = Encryptor::with_rng(&recipients, params, &mut ChaCha20Rng::seed_from_u64(7)).unwrap();
    let layout = enc.layout();
    let (p0, p1) = (
        layout.plaintext_segment_len(0),
        layout.plaintext_segment_len(1),
    );
    let len = match shape {
        Shape::PartialLast => p0 + p1 + p1 / 2,
        Shape::FullLast => p0 + 2 * p1,
    };
    let mut plain = vec![0u8; len];
    ChaCha20Rng::seed_from_u64(len as u64).fill_bytes(&mut plain);
    let files = [1u64, 2].map(|seed| {
        let mut out = Vec::new();
        enc.encrypt_with_rng(
            &plain[..],
            &mut out,
            &StreamOptions::sequential(),
            &mut ChaCha20Rng::seed_from_u64(seed),
        )
        .unwrap();
        out
    });
    let header_len = enc.header().len();
    let payload_start = header_len + layout.stream_header_len();

    let mut segs = Vec::new();
    let (mut at, mut pt_at, mut left, mut index) = (payload_start, 0, len, 0u64);
    loop {
        let full = layout.plaintext_segment_len(index);
        if left <= full {
            let n = layout.sealed_len(left);
            segs.push(Segment {
                ct: at..at + n,
                pt: pt_at..pt_at + left,
            });
            break;
        }
        let n = layout.ciphertext_segment_len(index);
        segs.push(Segment {
            ct: at..at + n,
            pt: pt_at..pt_at + full,
        });
        at += n;
        pt_at += full;
        left -= full;
        index += 1;
    }
    assert_eq!(segs.len(), 3);
    assert_eq!(segs[2].ct.end, files[0].len());
    if shape == Shape::FullLast {
        assert_eq!(segs[2].ct.len(), layout.ciphertext_segment_len(2));
    } else {
        assert!(segs[2].ct.len() < layout.ciphertext_segment_len(2));
    }
    Fixture {
        name: format!("{mode:?}/{bits}/{shape:?}"),
        enc,
        layout,
        plain,
        files,
        header_len,
        payload_start,
        segs,
    }
}

fn all_fixtures() -> Vec<Fixture> {
    let mut v = Vec::new();
    for mode in [Mode::Gcm, Mode::Cbc] {
        for bits in [128, 192, 256] {
            for shape in [Shape::PartialLast, Shape::FullLast] {
                v.push(fixture(mode, bits, shape));
            }
        }
    }
    v
}

/// What a tampered file must fail with.
#[derive(Clone, Copy, Debug)]
enum Want {
    Segment(u64),
    Truncated(u64),
    TruncatedHeader,
    HeaderAuth,
    NotTpmcrypt,
    UnsupportedVersion,
    Malformed,
    NoMatchingIdentity,
    /// Any integrity error (header bytes whose exact failure depends on how
    /// the change reshapes the header).
    Integrity,
}

impl Want {
    fn accepts(self, e: &Error) -> bool {
        match self {
            Want::Segment(i) => matches!(e, Error::SegmentAuth { index } if *index == i),
            Want::Truncated(i) => matches!(e, Error::Truncated { index } if *index == i),
            Want::TruncatedHeader => matches!(e, Error::TruncatedHeader),
            Want::HeaderAuth => matches!(e, Error::HeaderAuth),
            Want::NotTpmcrypt => matches!(e, Error::NotTpmcrypt),
            Want::UnsupportedVersion => matches!(e, Error::UnsupportedVersion(_)),
            Want::Malformed => matches!(e, Error::MalformedHeader(_)),
            Want::NoMatchingIdentity => matches!(e, Error::NoMatchingIdentity),
            Want::Integrity => true,
        }
    }
}

impl Fixture {
    /// Plaintext bytes of the segments before segment `k`: all that may be
    /// written when segment `k` fails.
    fn before(&self, k: u64) -> &[u8] {
        &self.plain[..self.segs[k as usize].pt.start]
    }

    fn seg(&self, file: usize, k: usize) -> &[u8] {
        &self.files[file][self.segs[k].ct.clone()]
    }

    /// Reassembles file A from its header and the given segment bytes.
    fn with_segments(&self, segs: &[&[u8]]) -> Vec<u8> {
        let mut out = self.files[0][..self.payload_start].to_vec();
        for s in segs {
            out.extend_from_slice(s);
        }
        out
    }

    /// Decrypts `bytes` with every worker count and checks the failure and
    /// that nothing beyond `written` was output.
    fn expect(&self, dec: &Decryptor, bytes: &[u8], want: Want, written: &[u8], what: &str) {
        self.expect_with(&WORKERS, dec, bytes, want, written, what)
    }

    fn expect_with(
        &self,
        workers: &[usize],
        dec: &Decryptor,
        bytes: &[u8],
        want: Want,
        written: &[u8],
        what: &str,
    ) {
        for &workers in workers {
            let mut out = Vec::new();
            let got = dec.decrypt(bytes, &mut out, &StreamOptions::parallel(workers));
            let ctx = format!("{} {what} ({workers} workers)", self.name);
            match got {
                Ok(n) => panic!("{ctx}: decrypted {n} bytes, expected {want:?}"),
                Err(e) => {
                    assert!(e.is_integrity(), "{ctx}: {e:?} is not an integrity error");
                    assert!(want.accepts(&e), "{ctx}: got {e:?}, expected {want:?}");
                }
            }
            assert!(
                out == written,
                "{ctx}: wrote {} bytes, expected exactly the {} bytes of earlier segments",
                out.len(),
                written.len()
            );
        }
    }

    fn expect_ok(&self, dec: &Decryptor, bytes: &[u8], what: &str) {
        for workers in WORKERS {
            let mut out = Vec::new();
            dec.decrypt(bytes, &mut out, &StreamOptions::parallel(workers))
                .unwrap_or_else(|e| panic!("{} {what}: {e}", self.name));
            assert!(out == self.plain, "{} {what}", self.name);
        }
    }
}

#[test]
fn untampered_files_decrypt() {
    for f in all_fixtures() {
        let dec = decryptor(1);
        f.expect_ok(&dec, &f.files[0], "file A");
        f.expect_ok(&dec, &f.files[1], "file B");
        assert_ne!(f.files[0], f.files[1]);
    }
}

#[test]
fn every_header_byte_is_authenticated() {
    for f in all_fixtures()
        .into_iter()
        .filter(|f| f.name.ends_with("PartialLast"))
    {
        // One decryptor with the session key cached (flips outside the
        // stanzas hit the cache, which must still check the header MAC) and
        // fresh ones (every flip goes through unwrapping).
        let cached = decryptor(1);
        f.expect_ok(&cached, &f.files[0], "priming");
        let stream_header = f.header_len..f.payload_start;
        for i in 0..f.payload_start {
            let want = match i {
                0..=7 => Want::NotTpmcrypt,
                8 => Want::UnsupportedVersion,
                9 => Want::Malformed,  // mode 1/2 flipped to an unknown mode
                10 => Want::Malformed, // key length
                _ if i >= f.header_len - HEADER_MAC_LEN && i < f.header_len => Want::HeaderAuth,
                _ if i == stream_header.start => Want::Malformed, // stream header length byte
                _ if stream_header.contains(&i) => Want::Segment(0), // salt, nonce prefix
                _ => Want::Integrity,
            };
            for mask in [0x01u8, 0x80] {
                let mut bad = f.files[0].clone();
                bad[i] ^= mask;
                let what = format!("byte {i} ^ {mask:#04x}");
                // Header failures happen before any worker starts; two
                // worker counts are enough here.
                f.expect_with(&[1, 2], &cached, &bad, want, &[], &what);
                f.expect_with(&[1, 2], &decryptor(1), &bad, want, &[], &what);
            }
        }
        assert_eq!(cached.unwrap_count(), 1, "{}", f.name);
    }
}

#[test]
fn flipped_segment_bytes() {
    for f in all_fixtures() {
        let dec = decryptor(1);
        for (k, seg) in f.segs.iter().enumerate() {
            let mid = seg.ct.start + seg.ct.len() / 2;
            for pos in [seg.ct.start, mid, seg.ct.end - 1] {
                let mut bad = f.files[0].clone();
                bad[pos] ^= 0x01;
                let k = k as u64;
                let what = format!("segment {k} byte {pos}");
                f.expect(&dec, &bad, Want::Segment(k), f.before(k), &what);
            }
        }
        assert_eq!(dec.unwrap_count(), 1);
    }
}

#[test]
fn truncation_at_and_around_segment_boundaries() {
    for f in all_fixtures() {
        let dec = decryptor(1);
        let file = &f.files[0];
        let cut = |n: usize| &file[..n];
        let none: &[u8] = &[];

        // Inside the tpmcrypt header, at its end, inside the stream header,
        // at its end (no segment at all).
        f.expect(
            &dec,
            cut(f.header_len - 1),
            Want::Malformed,
            none,
            "cut in header",
        );
        f.expect(
            &dec,
            cut(f.header_len),
            Want::TruncatedHeader,
            none,
            "cut after header",
        );
        f.expect(
            &dec,
            cut(f.header_len + 1),
            Want::TruncatedHeader,
            none,
            "cut at stream header + 1",
        );
        f.expect(
            &dec,
            cut(f.payload_start - 1),
            Want::TruncatedHeader,
            none,
            "cut at segment 0 - 1",
        );
        f.expect(
            &dec,
            cut(f.payload_start),
            Want::TruncatedHeader,
            none,
            "cut at segment 0",
        );
        f.expect(
            &dec,
            cut(f.payload_start + 1),
            Want::Segment(0),
            none,
            "cut at segment 0 + 1",
        );

        // At the end of each full segment before the last: recognised as a
        // truncation, reported with the index of the last segment present,
        // and that segment's plaintext is not written.
        for k in 0..2u64 {
            let end = f.segs[k as usize].ct.end;
            let w = f.before(k);
            f.expect(
                &dec,
                cut(end),
                Want::Truncated(k),
                w,
                &format!("cut after segment {k}"),
            );
            f.expect(
                &dec,
                cut(end - 1),
                Want::Segment(k),
                w,
                &format!("cut at end of {k} - 1"),
            );
            let w1 = f.before(k + 1);
            f.expect(
                &dec,
                cut(end + 1),
                Want::Segment(k + 1),
                w1,
                &format!("cut at end of {k} + 1"),
            );
        }
        f.expect(
            &dec,
            cut(file.len() - 1),
            Want::Segment(2),
            f.before(2),
            "cut last byte",
        );
    }
}

#[test]
fn dropped_duplicated_and_swapped_segments() {
    for f in all_fixtures() {
        let dec = decryptor(1);
        let (s0, s1, s2) = (f.seg(0, 0), f.seg(0, 1), f.seg(0, 2));
        let cases: [(&str, Vec<&[u8]>, Want); 8] = [
            ("drop 0", vec![s1, s2], Want::Segment(0)),
            ("drop 1", vec![s0, s2], Want::Segment(1)),
            // The file then ends with full segment 1: a truncation.
            ("drop 2", vec![s0, s1], Want::Truncated(1)),
            ("duplicate 0", vec![s0, s0, s1, s2], Want::Segment(1)),
            ("duplicate 1", vec![s0, s1, s1, s2], Want::Segment(2)),
            ("duplicate 2", vec![s0, s1, s2, s2], Want::Segment(2)),
            ("swap 0 and 1", vec![s1, s0, s2], Want::Segment(0)),
            ("swap 1 and 2", vec![s0, s2, s1], Want::Segment(1)),
        ];
        for (what, segs, want) in cases {
            let bad = f.with_segments(&segs);
            let written = match want {
                Want::Segment(k) | Want::Truncated(k) => f.before(k),
                _ => unreachable!(),
            };
            f.expect(&dec, &bad, want, written, what);
        }
    }
}

#[test]
fn splicing_between_files_of_one_session() {
    for f in all_fixtures() {
        let dec = decryptor(1);
        let (a, b) = (&f.files[0], &f.files[1]);

        // Segment k of file B in file A: B has its own salt, hence its own
        // file key, so the segment does not authenticate in A.
        for k in 0..3 {
            let mut bad = a.clone();
            bad[f.segs[k].ct.clone()].copy_from_slice(&b[f.segs[k].ct.clone()]);
            let k = k as u64;
            f.expect(
                &dec,
                &bad,
                Want::Segment(k),
                f.before(k),
                &format!("B's segment {k}"),
            );
        }

        // The tpmcrypt header is the same for every file of a session (it
        // holds the wrapped session key and the parameters, nothing
        // per-file), so swapping it is a no-op and the file still decrypts.
        // That is safe: what makes each file's keys unique is the stream
        // header (random salt and nonce prefix), which is part of the
        // payload, and the file key is HKDF(session key, salt, info = the
        // whole tpmcrypt header), so neither header can be exchanged or
        // altered without the segments failing.
        assert_eq!(&a[..f.header_len], &b[..f.header_len]);
        assert_eq!(&a[..f.header_len], f.enc.header());
        let mut swapped = b[..f.header_len].to_vec();
        swapped.extend_from_slice(&a[f.header_len..]);
        f.expect_ok(&dec, &swapped, "A with B's tpmcrypt header");

        // B's stream header on A's segments: another file key.
        let mut bad = a.clone();
        bad[f.header_len..f.payload_start].copy_from_slice(&b[f.header_len..f.payload_start]);
        f.expect(&dec, &bad, Want::Segment(0), &[], "B's stream header");

        assert_eq!(dec.unwrap_count(), 1);
    }
}

#[test]
fn splicing_between_sessions() {
    // Same recipient, same parameters, another session: its header is valid
    // (MAC and all) but carries another session key.
    for f in all_fixtures() {
        let recipients: Vec<Box<dyn Recipient>> =
            vec![Box::new(recovery_key(1).recipient().unwrap())];
        let other = Encryptor::with_rng(
            &recipients,
            Params::new(f.layout.mode, (f.layout.key_len * 8) as u32)
                .unwrap()
                .with_segment_size(f.layout.segment_size as u32)
                .unwrap(),
            &mut ChaCha20Rng::seed_from_u64(99),
        )
        .unwrap();
        assert_eq!(other.header().len(), f.header_len);
        assert_ne!(other.header(), f.enc.header());
        let dec = decryptor(1);
        let mut bad = other.header().to_vec();
        bad.extend_from_slice(&f.files[0][f.header_len..]);
        f.expect(&dec, &bad, Want::Segment(0), &[], "other session's header");
        assert_eq!(dec.unwrap_count(), 1);
    }
}

#[test]
fn appended_data() {
    for f in all_fixtures() {
        let dec = decryptor(1);
        let seg_size = f.layout.segment_size;
        let mut one = f.files[0].clone();
        one.push(0);
        f.expect(&dec, &one, Want::Segment(2), f.before(2), "1 byte appended");
        let mut whole = f.files[0].clone();
        whole.extend(std::iter::repeat_n(0xAA, seg_size));
        f.expect(
            &dec,
            &whole,
            Want::Segment(2),
            f.before(2),
            "a segment of garbage appended",
        );
        let mut copy = f.files[0].clone();
        copy.extend_from_slice(f.seg(0, 1));
        f.expect(
            &dec,
            &copy,
            Want::Segment(2),
            f.before(2),
            "a copy of segment 1 appended",
        );
    }
}

#[test]
fn wrong_or_no_identity() {
    for f in all_fixtures() {
        f.expect(
            &decryptor(2),
            &f.files[0],
            Want::NoMatchingIdentity,
            &[],
            "wrong identity",
        );
        f.expect(
            &Decryptor::new(Vec::new()),
            &f.files[0],
            Want::NoMatchingIdentity,
            &[],
            "no identity",
        );
    }
}

/// A long file (more segments than the parallel engine keeps in flight):
/// a failure deep inside still stops the output at exactly the failing
/// segment, whatever the worker count.
#[test]
fn late_failure_in_a_long_file() {
    for (mode, bits, segment_size) in [(Mode::Gcm, 256, 80), (Mode::Cbc, 128, 64)] {
        let params = Params::new(mode, bits)
            .unwrap()
            .with_segment_size(segment_size)
            .unwrap();
        let recipients: Vec<Box<dyn Recipient>> =
            vec![Box::new(recovery_key(1).recipient().unwrap())];
        let enc =
            Encryptor::with_rng(&recipients, params, &mut ChaCha20Rng::seed_from_u64(3)).unwrap();
        let layout = enc.layout();
        let (p0, p1) = (
            layout.plaintext_segment_len(0),
            layout.plaintext_segment_len(1),
        );
        let segments = 64;
        let mut plain = vec![0u8; p0 + (segments - 1) * p1];
        ChaCha20Rng::seed_from_u64(5).fill_bytes(&mut plain);
        let mut file = Vec::new();
        enc.encrypt_with_rng(
            &plain[..],
            &mut file,
            &StreamOptions::parallel(3),
            &mut ChaCha20Rng::seed_from_u64(6),
        )
        .unwrap();
        let start = enc.header().len() + layout.stream_header_len();
        let seg_start = |k: usize| {
            if k == 0 {
                start
            } else {
                start + layout.ciphertext_segment_len(0) + (k - 1) * segment_size as usize
            }
        };
        let pt_start = |k: usize| if k == 0 { 0 } else { p0 + (k - 1) * p1 };
        assert_eq!(seg_start(segments), file.len());
        let dec = decryptor(1);
        for workers in [1, 2, 3, 4] {
            let ctx = format!("{mode:?}/{bits} with {workers} workers");
            let opts = StreamOptions::parallel(workers);
            let mut bad = file.clone();
            bad[seg_start(37) + 5] ^= 0x40;
            let mut out = Vec::new();
            let err = dec.decrypt(&bad[..], &mut out, &opts).unwrap_err();
            assert!(
                matches!(err, Error::SegmentAuth { index: 37 }),
                "{ctx}: {err:?}"
            );
            assert!(
                out == plain[..pt_start(37)],
                "{ctx}: wrote {} bytes",
                out.len()
            );

            let mut out = Vec::new();
            let err = dec
                .decrypt(&file[..seg_start(50)], &mut out, &opts)
                .unwrap_err();
            assert!(
                matches!(err, Error::Truncated { index: 49 }),
                "{ctx}: {err:?}"
            );
            assert!(
                out == plain[..pt_start(49)],
                "{ctx}: wrote {} bytes",
                out.len()
            );

            let mut out = Vec::new();
            dec.decrypt(&file[..], &mut out, &opts).unwrap();
            assert!(out == plain, "{ctx}");
        }
    }
}

/// A failed segment in a parallel stream ends the run, however the workers
/// and the reader stand at that moment: one run in a few hundred used to
/// hang forever (every pooled buffer held by segments left for a turn that
/// never came, the reader waiting for a buffer, a worker for a segment).
/// Each run has 10 s; hundreds of runs give the race its chances.
#[test]
fn a_failed_segment_never_hangs_a_parallel_stream() {
    for (mode, bits) in [(Mode::Gcm, 256), (Mode::Cbc, 128)] {
        let params = Params::new(mode, bits)
            .unwrap()
            .with_segment_size(64)
            .unwrap();
        let recipients: Vec<Box<dyn Recipient>> =
            vec![Box::new(recovery_key(1).recipient().unwrap())];
        let enc =
            Encryptor::with_rng(&recipients, params, &mut ChaCha20Rng::seed_from_u64(7)).unwrap();
        let mut plain = vec![0u8; 40 * 64];
        ChaCha20Rng::seed_from_u64(8).fill_bytes(&mut plain);
        let mut file = Vec::new();
        enc.encrypt(&plain[..], &mut file, &StreamOptions::sequential())
            .unwrap();
        let body = enc.header().len() + enc.layout().stream_header_len();
        let file = std::sync::Arc::new(file);
        for round in 0..300usize {
            let workers = 2 + round % 3;
            let mut bad = (*file).clone();
            let at = body + (round * 37) % (bad.len() - body);
            bad[at] ^= 0x01;
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let dec = decryptor(1);
                let mut out = Vec::new();
                // A Read that is not a slice: the engine's stream path.
                let input = std::io::Cursor::new(bad);
                let r = dec.decrypt(input, &mut out, &StreamOptions::parallel(workers));
                let _ = tx.send(r.is_err());
            });
            let failed = rx
                .recv_timeout(std::time::Duration::from_secs(10))
                .unwrap_or_else(|_| panic!("{mode:?}: round {round} ({workers} workers) hangs"));
            assert!(failed, "{mode:?}: round {round}: a tampered file decrypted");
        }
    }
}
