//! The positional-read engine (`Encryptor::encrypt_file`,
//! `Decryptor::decrypt_file` on regular files, several workers) must write
//! the same bytes and fail the same way as the streaming engine.

use std::fs::{self, File};
use std::io::{Seek, SeekFrom, Write};

use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha20Rng;
use tpmcrypt_cipher::recipient::{Identity, Recipient};
use tpmcrypt_cipher::recovery::RecoveryKey;
use tpmcrypt_cipher::stream::Layout;
use tpmcrypt_cipher::{Decryptor, Encryptor, Error, Mode, Params, StreamOptions};

fn key() -> RecoveryKey {
    RecoveryKey::generate(&mut ChaCha20Rng::seed_from_u64(7))
}

fn data(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

fn file_with(dir: &std::path::Path, name: &str, bytes: &[u8]) -> File {
    let path = dir.join(name);
    fs::write(&path, bytes).unwrap();
    File::open(path).unwrap()
}

#[test]
fn positional_reads_round_trip_at_segment_boundaries() {
    let dir = tempfile::tempdir().unwrap();
    let recipients: Vec<Box<dyn Recipient>> = vec![Box::new(key().recipient().unwrap())];
    let identity: Box<dyn Identity> = Box::new(key().into_identity().unwrap());
    let decryptor = Decryptor::new(vec![identity]);
    for (mode, bits, seg) in [
        (Mode::Gcm, 256, 200u32),
        (Mode::Gcm, 128, 97),
        (Mode::Cbc, 192, 168),
        (Mode::Cbc, 256, 160),
    ] {
        let params = Params::new(mode, bits)
            .unwrap()
            .with_segment_size(seg)
            .unwrap();
        let layout = Layout::new(&params).unwrap();
        let (p0, p) = (
            layout.plaintext_segment_len(0),
            layout.plaintext_segment_len(1),
        );
        let encryptor = Encryptor::new(&recipients, params).unwrap();
        let sizes = [
            0,
            1,
            p0 - 1,
            p0,
            p0 + 1,
            p0 + p - 1,
            p0 + p,
            p0 + p + 1,
            p0 + 9 * p + 3,
        ];
        for len in sizes {
            for workers in [1, 2, 3] {
                let plain = data(len);
                let input = file_with(dir.path(), "in", &plain);
                let opts = StreamOptions::parallel(workers);
                let mut sealed = Vec::new();
                let n = encryptor.encrypt_file(&input, &mut sealed, &opts).unwrap();
                assert_eq!(n as usize, len);
                let ct = file_with(dir.path(), "ct", &sealed);
                let mut opened = Vec::new();
                decryptor.decrypt_file(&ct, &mut opened, &opts).unwrap();
                assert_eq!(opened, plain, "{mode:?}/{bits} len {len} workers {workers}");
                // The streaming decryptor reads the same bytes.
                let mut streamed = Vec::new();
                decryptor
                    .decrypt(&sealed[..], &mut streamed, &opts)
                    .unwrap();
                assert_eq!(streamed, plain);
            }
        }
    }
    assert_eq!(decryptor.unwrap_count(), 4, "one unwrap per session");
}

#[test]
fn positional_reads_start_at_the_current_position() {
    let dir = tempfile::tempdir().unwrap();
    let recipients: Vec<Box<dyn Recipient>> = vec![Box::new(key().recipient().unwrap())];
    let params = Params::new(Mode::Gcm, 256)
        .unwrap()
        .with_segment_size(100)
        .unwrap();
    let encryptor = Encryptor::new(&recipients, params).unwrap();
    let plain = data(1000);
    let mut input = file_with(dir.path(), "in", &plain);
    input.seek(SeekFrom::Start(10)).unwrap();
    let mut sealed = Vec::new();
    encryptor
        .encrypt_file(&input, &mut sealed, &StreamOptions::parallel(2))
        .unwrap();
    let decryptor = Decryptor::new(vec![
        Box::new(key().into_identity().unwrap()) as Box<dyn Identity>
    ]);
    let mut opened = Vec::new();
    decryptor
        .decrypt(&sealed[..], &mut opened, &StreamOptions::sequential())
        .unwrap();
    assert_eq!(opened, &plain[10..]);
}

#[test]
fn positional_reads_detect_tampering_truncation_and_appending() {
    let dir = tempfile::tempdir().unwrap();
    let recipients: Vec<Box<dyn Recipient>> = vec![Box::new(key().recipient().unwrap())];
    let params = Params::new(Mode::Gcm, 256)
        .unwrap()
        .with_segment_size(128)
        .unwrap();
    let layout = Layout::new(&params).unwrap();
    let encryptor = Encryptor::new(&recipients, params).unwrap();
    let plain = data(layout.plaintext_segment_len(0) + 5 * layout.plaintext_segment_len(1) + 7);
    let mut sealed = Vec::new();
    encryptor
        .encrypt(&plain[..], &mut sealed, &StreamOptions::sequential())
        .unwrap();
    let header_len = sealed.len() - layout.payload_len(plain.len() as u64) as usize;
    let seg2 = header_len + 128 + 128 + 10;
    let decryptor = Decryptor::new(vec![
        Box::new(key().into_identity().unwrap()) as Box<dyn Identity>
    ]);
    let opts = StreamOptions::parallel(3);

    let mut bad = sealed.clone();
    bad[seg2] ^= 1;
    let mut out = Vec::new();
    let err = decryptor
        .decrypt_file(&file_with(dir.path(), "t", &bad), &mut out, &opts)
        .unwrap_err();
    assert!(matches!(err, Error::SegmentAuth { index: 2 }), "{err}");
    assert_eq!(
        out,
        &plain[..layout.plaintext_segment_len(0) + layout.plaintext_segment_len(1)]
    );

    let cut = &sealed[..header_len + 128 * 3];
    let err = decryptor
        .decrypt_file(&file_with(dir.path(), "c", cut), Vec::new(), &opts)
        .unwrap_err();
    assert!(matches!(err, Error::Truncated { index: 2 }), "{err}");

    let mut long = sealed.clone();
    long.write_all(b"x").unwrap();
    let err = decryptor
        .decrypt_file(&file_with(dir.path(), "a", &long), Vec::new(), &opts)
        .unwrap_err();
    assert!(err.is_integrity(), "{err}");

    let err = decryptor
        .decrypt_file(
            &file_with(dir.path(), "h", &sealed[..header_len - 3]),
            Vec::new(),
            &opts,
        )
        .unwrap_err();
    assert!(err.is_integrity(), "{err}");
}

/// An external cache (the agent) is asked before an identity that is not
/// in memory (a TPM key) and fed what that identity unwrapped; a wrong
/// cached key is ignored, not trusted.
#[test]
fn external_session_cache_is_consulted_and_fed() {
    let sealed = sealed_for_cache(b"agent");
    let shared = Shared::default();
    let first = Decryptor::new(vec![device()]).with_session_cache(Box::new(shared.clone()));
    first
        .decrypt(&sealed[..], Vec::new(), &StreamOptions::sequential())
        .unwrap();
    assert_eq!(first.unwrap_count(), 1);
    assert_eq!(shared.gets(), 1, "the cache was asked first");
    assert_eq!(shared.len(), 1, "the unwrapped key was offered");

    // A second process with no identity at all decrypts from the cache.
    let second = Decryptor::new(vec![]).with_session_cache(Box::new(shared.clone()));
    let mut out = Vec::new();
    second
        .decrypt(&sealed[..], &mut out, &StreamOptions::sequential())
        .unwrap();
    assert_eq!(out, b"agent");
    assert_eq!(second.unwrap_count(), 0);

    // A wrong key in the cache is not trusted.
    shared.0.lock().unwrap().entries[0].1 = [0u8; 32];
    let third = Decryptor::new(vec![]).with_session_cache(Box::new(shared));
    let err = third
        .decrypt(&sealed[..], Vec::new(), &StreamOptions::sequential())
        .unwrap_err();
    assert!(matches!(err, Error::NoMatchingIdentity), "{err}");
}

/// An identity whose key is in memory (a recovery key) opens the file
/// before the cache is asked, and its key is not offered to the cache: a
/// cache that lacks the key costs such a run nothing. One in memory that
/// does not match leaves the cache to answer.
#[test]
fn an_identity_in_memory_goes_before_the_cache_and_feeds_it_nothing() {
    let sealed = sealed_for_cache(b"memory");
    let shared = Shared::default();
    let recovery = Decryptor::new(vec![Box::new(key().into_identity().unwrap()) as _])
        .with_session_cache(Box::new(shared.clone()));
    let mut out = Vec::new();
    recovery
        .decrypt(&sealed[..], &mut out, &StreamOptions::sequential())
        .unwrap();
    assert_eq!(out, b"memory");
    assert_eq!(recovery.unwrap_count(), 1);
    assert_eq!(shared.gets(), 0, "the cache was asked");
    assert_eq!(shared.len(), 0, "a key unwrapped in memory was offered");

    // Prefetched (the front's check), then used: the same.
    let prefetching = Decryptor::new(vec![Box::new(key().into_identity().unwrap()) as _])
        .with_session_cache(Box::new(shared.clone()));
    let header = tpmcrypt_cipher::format::Header::read_from(&mut &sealed[..]).unwrap();
    prefetching.prefetch(&header).unwrap();
    prefetching
        .decrypt(&sealed[..], Vec::new(), &StreamOptions::sequential())
        .unwrap();
    assert_eq!((shared.gets(), shared.len()), (0, 0), "prefetch");

    // Listed after a TPM key, an identity in memory still goes first.
    let both = Decryptor::new(vec![
        device(),
        Box::new(key().into_identity().unwrap()) as _,
    ])
    .with_session_cache(Box::new(shared.clone()));
    both.decrypt(&sealed[..], Vec::new(), &StreamOptions::sequential())
        .unwrap();
    assert_eq!((shared.gets(), shared.len()), (0, 0), "in memory second");

    // A recovery key that is not a recipient: the cache is asked and used.
    Decryptor::new(vec![device()])
        .with_session_cache(Box::new(shared.clone()))
        .decrypt(&sealed[..], Vec::new(), &StreamOptions::sequential())
        .unwrap();
    assert_eq!((shared.gets(), shared.len()), (1, 1));
    let other = RecoveryKey::generate(&mut ChaCha20Rng::seed_from_u64(99));
    let stranger = Decryptor::new(vec![Box::new(other.into_identity().unwrap()) as _])
        .with_session_cache(Box::new(shared.clone()));
    let mut out = Vec::new();
    stranger
        .decrypt(&sealed[..], &mut out, &StreamOptions::sequential())
        .unwrap();
    assert_eq!(out, b"memory");
    assert_eq!(stranger.unwrap_count(), 0);
    assert_eq!(shared.gets(), 2, "the cache was not asked");
}

/// A sender who wrapped another key for one recipient than for the
/// others (the header MAC made with theirs): the key that recipient's
/// identity unwraps fails the MAC, which is a stanza it cannot open, not
/// the end of the search. The session cache and the other identities
/// still open the file (before, adding such a `-i` made a file the agent
/// or a TPM key opened fail with "header authentication failed").
#[test]
fn a_key_the_header_mac_refuses_does_not_stop_the_search() {
    struct Liar(Box<dyn Recipient>);
    impl Recipient for Liar {
        fn wrap(
            &self,
            _key: &tpmcrypt_cipher::SessionKey,
            rng: &mut dyn rand_core::CryptoRngCore,
        ) -> tpmcrypt_cipher::Result<tpmcrypt_cipher::format::Stanza> {
            self.0
                .wrap(&tpmcrypt_cipher::SessionKey::from_bytes(&[7; 32]), rng)
        }
        fn kind(&self) -> u8 {
            self.0.kind()
        }
        fn fingerprint(&self) -> [u8; 16] {
            self.0.fingerprint()
        }
    }
    let liar = || RecoveryKey::generate(&mut ChaCha20Rng::seed_from_u64(11));
    let recipients: Vec<Box<dyn Recipient>> = vec![
        Box::new(Liar(Box::new(liar().recipient().unwrap()))),
        Box::new(key().recipient().unwrap()),
    ];
    let encryptor = Encryptor::new(&recipients, Params::new(Mode::Gcm, 256).unwrap()).unwrap();
    let mut sealed = Vec::new();
    encryptor
        .encrypt(&b"mixed"[..], &mut sealed, &StreamOptions::sequential())
        .unwrap();
    let lied_to = || Box::new(liar().into_identity().unwrap()) as Box<dyn Identity>;

    // Alone, the lied-to key fails as before: the header MAC refuses it.
    let err = Decryptor::new(vec![lied_to()])
        .decrypt(&sealed[..], Vec::new(), &StreamOptions::sequential())
        .unwrap_err();
    assert!(err.is_integrity(), "{err}");

    // With an identity not in memory (a TPM key) that gets the right key.
    let shared = Shared::default();
    let both =
        Decryptor::new(vec![lied_to(), device()]).with_session_cache(Box::new(shared.clone()));
    let mut out = Vec::new();
    both.decrypt(&sealed[..], &mut out, &StreamOptions::sequential())
        .unwrap();
    assert_eq!(out, b"mixed");
    assert_eq!((shared.gets(), shared.len()), (1, 1), "asked, then fed");

    // With the session cache holding the key.
    let cached = Decryptor::new(vec![lied_to()]).with_session_cache(Box::new(shared.clone()));
    let mut out = Vec::new();
    cached
        .decrypt(&sealed[..], &mut out, &StreamOptions::sequential())
        .unwrap();
    assert_eq!(out, b"mixed");
    assert_eq!(cached.unwrap_count(), 0);
}

type Entries = Vec<([u8; 32], [u8; 32])>;

/// A session cache in memory that counts the times it is asked.
#[derive(Clone, Default)]
struct Shared(std::sync::Arc<std::sync::Mutex<CacheState>>);

#[derive(Default)]
struct CacheState {
    entries: Entries,
    gets: usize,
}

impl Shared {
    fn gets(&self) -> usize {
        self.0.lock().unwrap().gets
    }
    fn len(&self) -> usize {
        self.0.lock().unwrap().entries.len()
    }
}

impl tpmcrypt_cipher::SessionCache for Shared {
    fn get(&self, digest: &[u8; 32]) -> Option<tpmcrypt_cipher::SessionKey> {
        let mut state = self.0.lock().unwrap();
        state.gets += 1;
        state
            .entries
            .iter()
            .find(|(d, _)| d == digest)
            .map(|(_, k)| tpmcrypt_cipher::SessionKey::from_bytes(k))
    }
    fn put(&self, digest: &[u8; 32], key: &tpmcrypt_cipher::SessionKey) {
        self.0
            .lock()
            .unwrap()
            .entries
            .push((*digest, *key.expose()));
    }
}

/// The recovery key behind an identity that says its key is not in memory,
/// as a TPM key's does.
struct Device(Box<dyn Identity>);

impl Identity for Device {
    fn unwrap(
        &self,
        stanza: &tpmcrypt_cipher::format::Stanza,
    ) -> tpmcrypt_cipher::Result<Option<tpmcrypt_cipher::SessionKey>> {
        self.0.unwrap(stanza)
    }
}

fn device() -> Box<dyn Identity> {
    Box::new(Device(Box::new(key().into_identity().unwrap())))
}

fn sealed_for_cache(plain: &[u8]) -> Vec<u8> {
    let recipients: Vec<Box<dyn Recipient>> = vec![Box::new(key().recipient().unwrap())];
    let params = Params::new(Mode::Gcm, 256).unwrap();
    let encryptor = Encryptor::new(&recipients, params).unwrap();
    let mut sealed = Vec::new();
    encryptor
        .encrypt(plain, &mut sealed, &StreamOptions::sequential())
        .unwrap();
    sealed
}

#[test]
fn verifier_opens_the_sessions_files_without_identities() {
    let recipients: Vec<Box<dyn Recipient>> = vec![Box::new(key().recipient().unwrap())];
    let encryptor = Encryptor::new(&recipients, Params::new(Mode::Cbc, 128).unwrap()).unwrap();
    let mut sealed = Vec::new();
    encryptor
        .encrypt(&data(5000)[..], &mut sealed, &StreamOptions::sequential())
        .unwrap();
    let verifier = encryptor.verifier().unwrap();
    let mut out = Vec::new();
    verifier
        .decrypt(&sealed[..], &mut out, &StreamOptions::sequential())
        .unwrap();
    assert_eq!(out, data(5000));
    assert_eq!(verifier.unwrap_count(), 0);
    let other = Encryptor::new(&recipients, Params::new(Mode::Cbc, 128).unwrap()).unwrap();
    let mut foreign = Vec::new();
    other
        .encrypt(&b"x"[..], &mut foreign, &StreamOptions::sequential())
        .unwrap();
    assert!(verifier
        .decrypt(&foreign[..], Vec::new(), &StreamOptions::sequential())
        .is_err());
}

/// Files whose size is not their length (procfs shows 0, sysfs 4096) are
/// read to their end, with one worker or several.
#[test]
fn files_whose_size_lies_are_read_to_their_end() {
    use std::io::Read;
    let recipients: Vec<Box<dyn Recipient>> = vec![Box::new(key().recipient().unwrap())];
    let identity: Box<dyn Identity> = Box::new(key().into_identity().unwrap());
    let decryptor = Decryptor::new(vec![identity]);
    let params = Params::new(Mode::Gcm, 256)
        .unwrap()
        .with_segment_size(64)
        .unwrap();
    let encryptor = Encryptor::new(&recipients, params).unwrap();
    for path in [
        "/proc/version",
        "/sys/kernel/mm/transparent_hugepage/enabled",
    ] {
        let mut expect = Vec::new();
        File::open(path).unwrap().read_to_end(&mut expect).unwrap();
        assert_ne!(fs::metadata(path).unwrap().len(), expect.len() as u64);
        for workers in [1, 3] {
            let opts = StreamOptions {
                workers,
                progress: None,
                timings: None,
            };
            let mut ct = Vec::new();
            encryptor
                .encrypt_file(&File::open(path).unwrap(), &mut ct, &opts)
                .unwrap();
            let mut back = Vec::new();
            decryptor
                .decrypt(&ct[..], &mut back, &StreamOptions::sequential())
                .unwrap();
            assert_eq!(back, expect, "{path}, {workers} worker(s)");
        }
    }
}

/// An output that fails part-way stops a several-worker positional run with
/// the write error (no worker is left waiting for its turn), nothing after
/// the failed write reaches the output, and progress is reported in order.
#[test]
fn positional_runs_stop_at_a_failed_write_and_report_progress_in_order() {
    struct FailsAfter {
        written: Vec<u8>,
        writes_left: usize,
    }
    impl Write for FailsAfter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.writes_left == 0 {
                return Err(std::io::Error::other("disk full"));
            }
            self.writes_left -= 1;
            self.written.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let recipients: Vec<Box<dyn Recipient>> = vec![Box::new(key().recipient().unwrap())];
    let params = Params::new(Mode::Gcm, 128)
        .unwrap()
        .with_segment_size(256)
        .unwrap();
    let layout = Layout::new(&params).unwrap();
    let encryptor = Encryptor::new(&recipients, params).unwrap();
    let plain = data(layout.plaintext_segment_len(0) + 40 * layout.plaintext_segment_len(1));
    let input = file_with(dir.path(), "p", &plain);
    let mut sealed = Vec::new();
    encryptor
        .encrypt(&plain[..], &mut sealed, &StreamOptions::sequential())
        .unwrap();
    let header_len = sealed.len() - layout.payload_len(plain.len() as u64) as usize;
    let decryptor = Decryptor::new(vec![
        Box::new(key().into_identity().unwrap()) as Box<dyn Identity>
    ]);
    let ciphertext = file_with(dir.path(), "c", &sealed);
    for workers in [2, 3, 8] {
        // The header and stream header take the first writes; then segments.
        let mut out = FailsAfter {
            written: Vec::new(),
            writes_left: 7,
        };
        let err = encryptor
            .encrypt_file(&input, &mut out, &StreamOptions::parallel(workers))
            .unwrap_err();
        assert!(
            matches!(&err, Error::Io(e) if e.to_string() == "disk full"),
            "{err}"
        );
        // Whole segments only (segment 0 is shorter by the stream header).
        let payload = out.written.len() - header_len;
        assert!(
            payload > 0 && payload < sealed.len() - header_len,
            "{workers}: {payload}"
        );
        assert_eq!(payload % 256, 0, "{workers}: {payload}");

        let mut out = FailsAfter {
            written: Vec::new(),
            writes_left: 5,
        };
        let mut at = ciphertext.try_clone().unwrap();
        at.seek(SeekFrom::Start(0)).unwrap();
        let err = decryptor
            .decrypt_file(&at, &mut out, &StreamOptions::parallel(workers))
            .unwrap_err();
        assert!(
            matches!(&err, Error::Io(e) if e.to_string() == "disk full"),
            "{err}"
        );
        assert_eq!(out.written, &plain[..out.written.len()]);
        assert_eq!(
            out.written.len(),
            layout.plaintext_segment_len(0) + 4 * layout.plaintext_segment_len(1)
        );

        let seen = std::sync::Mutex::new(Vec::new());
        let record = |done: u64| seen.lock().unwrap().push(done);
        let opts = StreamOptions {
            timings: None,
            workers,
            progress: Some(&record),
        };
        at.seek(SeekFrom::Start(0)).unwrap();
        let mut back = Vec::new();
        decryptor.decrypt_file(&at, &mut back, &opts).unwrap();
        assert_eq!(back, plain);
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len(), 41, "{workers}");
        assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
        assert_eq!(seen.last().copied(), Some(plain.len() as u64));
    }
}

/// The engine's timings count every segment once, on every path (streamed
/// and positional, sequential and parallel), with the read, AES and write
/// time of a non-empty run above zero, and the threads that sealed or
/// opened at once.
#[test]
fn timings_count_every_segment_on_every_path() {
    use tpmcrypt_cipher::Timings;
    let dir = tempfile::tempdir().unwrap();
    let recipients: Vec<Box<dyn Recipient>> = vec![Box::new(key().recipient().unwrap())];
    let identity: Box<dyn Identity> = Box::new(key().into_identity().unwrap());
    let decryptor = Decryptor::new(vec![identity]);
    let params = Params::new(Mode::Gcm, 256)
        .unwrap()
        .with_segment_size(4096)
        .unwrap();
    let layout = Layout::new(&params).unwrap();
    let len = layout.plaintext_segment_len(0) + 9 * layout.plaintext_segment_len(1) + 5;
    let plain = data(len);
    let encryptor = Encryptor::new(&recipients, params).unwrap();
    for workers in [1, 3] {
        let input = file_with(dir.path(), "p", &plain);
        let timings = Timings::new();
        let opts = StreamOptions {
            workers,
            progress: None,
            timings: Some(&timings),
        };
        let mut sealed = Vec::new();
        encryptor.encrypt_file(&input, &mut sealed, &opts).unwrap();
        encryptor.encrypt(&plain[..], &mut sealed, &opts).unwrap();
        let t = timings.snapshot();
        assert_eq!(t.segments, 2 * 11, "workers {workers}");
        assert_eq!(t.peak_threads, workers as u64);
        assert!(t.crypto.as_nanos() > 0 && t.read.as_nanos() > 0 && t.write.as_nanos() > 0);
        // Decrypting (one ciphertext, through a file): as many segments again.
        let ct = file_with(dir.path(), "c", &sealed[..sealed.len() / 2]);
        let timings = Timings::new();
        let opts = StreamOptions {
            timings: Some(&timings),
            ..opts
        };
        let mut back = Vec::new();
        decryptor.decrypt_file(&ct, &mut back, &opts).unwrap();
        assert_eq!(back, plain);
        let t = timings.snapshot();
        assert_eq!(t.segments, 11);
        assert!(t.crypto.as_nanos() > 0 && t.read.as_nanos() > 0 && t.write.as_nanos() > 0);
    }
    assert!(decryptor.unwrap_time().as_nanos() > 0);
    assert_eq!(decryptor.unwrap_count(), 1);
}
