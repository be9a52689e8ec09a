use super::*;
use proptest::prelude::*;

fn armor(bytes: &[u8]) -> Vec<u8> {
    let mut w = ArmoredWriter::new(Vec::new());
    w.write_all(bytes).unwrap();
    w.finish().unwrap()
}

fn dearmor(text: &[u8]) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    ArmoredReader::new(text).read_to_end(&mut out)?;
    Ok(out)
}

fn err_of(text: &[u8]) -> ArmorError {
    let e = dearmor(text).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
    armor_error(&e)
        .cloned()
        .unwrap_or_else(|| panic!("not an armor error: {e}"))
}

/// An armored text built from lines, each ended by `eol`.
fn text(lines: &[&str], eol: &str) -> Vec<u8> {
    lines
        .iter()
        .flat_map(|l| [*l, eol])
        .collect::<String>()
        .into_bytes()
}

/// Bytes that start like a binary tpmcrypt file, `len` long.
fn payload(len: usize) -> Vec<u8> {
    let mut v: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    if let Some(b) = v.first_mut() {
        *b = 0x89;
    }
    v
}

/// 150 bytes: three full lines and a short one.
fn four_lines() -> Vec<String> {
    let text = String::from_utf8(armor(&payload(150))).unwrap();
    text.lines().map(str::to_owned).collect()
}

#[test]
fn lines_are_64_columns_but_the_last_and_end_in_lf() {
    for len in [1, 47, 48, 49, 95, 96, 97, 1000] {
        let t = String::from_utf8(armor(&payload(len))).unwrap();
        assert!(t.ends_with(&format!("\n{END}\n")), "{len}");
        assert!(t.starts_with(&format!("{BEGIN}\n")), "{len}");
        assert!(!t.contains('\r'));
        let lines: Vec<&str> = t.lines().collect();
        let data = &lines[1..lines.len() - 1];
        assert_eq!(data.len(), len.div_ceil(48), "{len}");
        for l in &data[..data.len() - 1] {
            assert_eq!(l.len(), 64, "{len}");
        }
        let last = data[data.len() - 1];
        assert!(
            (1..=64).contains(&last.len()) && last.len() % 4 == 0,
            "{len}"
        );
        assert_eq!(dearmor(t.as_bytes()).unwrap(), payload(len), "{len}");
    }
}

#[test]
fn crlf_throughout_and_whitespace_around_are_accepted() {
    let lines = four_lines();
    let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
    let mut crlf = b" \t\r\n\n".to_vec();
    crlf.extend(text(&refs, "\r\n"));
    crlf.extend(b"\n \r\n\t");
    assert_eq!(dearmor(&crlf).unwrap(), payload(150));
    // The END line may end the input without a line ending.
    let mut bare = text(&refs, "\n");
    bare.pop();
    assert_eq!(dearmor(&bare).unwrap(), payload(150));
}

#[test]
fn mixed_line_endings_are_refused() {
    let lines = four_lines();
    let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
    let mut t = text(&refs[..2], "\r\n");
    t.extend(text(&refs[2..], "\n"));
    assert_eq!(err_of(&t), ArmorError::MixedLineEndings(3));
    let mut t = text(&refs[..2], "\n");
    t.extend(text(&refs[2..], "\r\n"));
    assert_eq!(err_of(&t), ArmorError::MixedLineEndings(3));
}

#[test]
fn binary_input_passes_through_untouched() {
    let mut v = payload(100_000);
    v[1..9].copy_from_slice(b"-----BEG");
    assert_eq!(dearmor(&v).unwrap(), v);
    assert_eq!(dearmor(b"").unwrap(), b"");
    let mut r = ArmoredReader::new(&v[..]);
    r.read_to_end(&mut Vec::new()).unwrap();
    assert!(!r.is_armored());
}

#[test]
fn other_pem_or_text_is_not_armor() {
    assert_eq!(
        err_of(b"-----BEGIN PGP MESSAGE-----\n"),
        ArmorError::NoBegin
    );
    assert_eq!(err_of(b"  hello\n"), ArmorError::NoBegin);
    assert_eq!(
        err_of(format!("{BEGIN} \n").as_bytes()),
        ArmorError::NoBegin
    );
    // The BEGIN line alone, without its line ending.
    assert_eq!(err_of(BEGIN.as_bytes()), ArmorError::NoBegin);
    // Whitespace, then binary ciphertext: not either form.
    let mut v = b" ".to_vec();
    v.extend(payload(10));
    assert_eq!(err_of(&v), ArmorError::NoBegin);
}

#[test]
fn bad_base64_is_refused() {
    let lines = four_lines();
    for (at, bad) in [(1, "*"), (2, " "), (3, "=")] {
        let mut l = lines.clone();
        l[at].replace_range(10..11, bad);
        let refs: Vec<&str> = l.iter().map(String::as_str).collect();
        assert_eq!(
            err_of(&text(&refs, "\n")),
            ArmorError::BadBase64(at as u64 + 1),
            "{bad}"
        );
    }
}

#[test]
fn non_canonical_padding_or_bits_are_refused() {
    // 5 bytes: "iVRQTUM=" is canonical; "iVRQTUN=" has a stray bit,
    // "iVRQTUM" lacks its padding, "iVRQTU==" pads too early.
    assert_eq!(
        dearmor(&text(&[BEGIN, "iVRQTUM=", END], "\n")).unwrap(),
        [0x89, b'T', b'P', b'M', b'C']
    );
    for bad in ["iVRQTUN=", "iVRQTUM", "iVRQTU==", "iVRQTUM==", "iVRQ=UM="] {
        assert_eq!(
            err_of(&text(&[BEGIN, bad, END], "\n")),
            ArmorError::BadBase64(2),
            "{bad}"
        );
    }
}

#[test]
fn only_the_last_line_may_be_short_and_none_long() {
    let lines = four_lines();
    // 63 columns in the middle: a short line that is not the last.
    let mut l = lines.clone();
    l[1].truncate(60);
    let refs: Vec<&str> = l.iter().map(String::as_str).collect();
    assert_eq!(err_of(&text(&refs, "\n")), ArmorError::ShortLine(3));
    // A padded full-length line is the last one too.
    let mut l = lines.clone();
    l[1] = STANDARD.encode([7u8; 47]);
    assert_eq!(l[1].len(), 64);
    let refs: Vec<&str> = l.iter().map(String::as_str).collect();
    assert_eq!(err_of(&text(&refs, "\n")), ArmorError::ShortLine(3));
    // 65 and far more columns.
    for extra in ["A", "AAAA", &"A".repeat(100_000)] {
        let mut l = lines.clone();
        l[2].push_str(extra);
        let refs: Vec<&str> = l.iter().map(String::as_str).collect();
        assert_eq!(err_of(&text(&refs, "\n")), ArmorError::LongLine(3));
    }
    let mut l = lines.clone();
    l.insert(2, String::new());
    let refs: Vec<&str> = l.iter().map(String::as_str).collect();
    assert_eq!(err_of(&text(&refs, "\n")), ArmorError::EmptyLine(3));
}

#[test]
fn the_end_line_must_be_there_whole_and_last() {
    let good = armor(&payload(150));
    let end = good.len() - END.len() - 1;
    // Truncated footer, missing footer, cut inside the data.
    for cut in [good.len() - 5, end, end - 1, end - 30, BEGIN.len() + 1] {
        assert_eq!(err_of(&good[..cut]), ArmorError::MissingEnd, "{cut}");
    }
    let mut t = good[..end].to_vec();
    t.extend(b"-----END TPMCRYPT ENCRYPTED FILE----\n");
    assert_eq!(err_of(&t), ArmorError::BadEnd(6));
    for tail in [&b"x"[..], b"\n\n-", b"\0", &good[..]] {
        let mut t = good.clone();
        t.extend(tail);
        assert_eq!(err_of(&t), ArmorError::TrailingData);
    }
    assert_eq!(err_of(&text(&[BEGIN, END], "\n")), ArmorError::NoData);
    assert_eq!(err_of(&armor(b"")), ArmorError::NoData);
}

#[test]
fn a_failed_reader_stays_failed() {
    let mut r = ArmoredReader::new(&b"-----BEGIN X\n"[..]);
    assert!(r.read(&mut [0; 10]).is_err());
    assert!(r.read(&mut [0; 10]).is_err());
}

#[test]
fn armor_errors_lift_to_integrity_errors() {
    let io: io::Error = ArmorError::MissingEnd.into();
    let e = lift(Error::Io(io));
    assert!(matches!(e, Error::Armor(ArmorError::MissingEnd)));
    assert!(e.is_integrity());
    assert!(!lift(Error::Io(io::Error::other("disk"))).is_integrity());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn round_trip_in_any_pieces(
        len in 1usize..5000,
        writes in proptest::collection::vec(1usize..200, 1..20),
        reads in proptest::collection::vec(1usize..200, 1..20),
    ) {
        let data = payload(len);
        let mut w = ArmoredWriter::new(Vec::new());
        let mut at = 0;
        for n in writes.iter().cycle() {
            if at == data.len() {
                break;
            }
            let end = (at + n).min(data.len());
            w.write_all(&data[at..end]).unwrap();
            if n % 3 == 0 {
                w.flush().unwrap();
            }
            at = end;
        }
        let text = w.finish().unwrap();
        prop_assert_eq!(&text, &armor(&data));
        let mut r = ArmoredReader::new(&text[..]);
        let mut back = Vec::new();
        for n in reads.iter().cycle() {
            let mut buf = vec![0u8; *n];
            let got = r.read(&mut buf).unwrap();
            if got == 0 {
                break;
            }
            back.extend_from_slice(&buf[..got]);
        }
        prop_assert!(r.is_armored());
        prop_assert_eq!(back, data);
    }

    #[test]
    fn a_changed_frame_byte_is_always_refused(
        len in 1usize..400,
        at in any::<prop::sample::Index>(),
        to in any::<u8>(),
    ) {
        // The frame: the BEGIN and END lines and every line ending (a
        // changed data character is the cipher's to catch, by its MAC).
        let data = payload(len);
        let mut text = armor(&data);
        let frame: Vec<usize> = (0..text.len())
            .filter(|&i| i <= BEGIN.len() || i >= text.len() - END.len() - 2 || text[i] == b'\n')
            .collect();
        let i = frame[at.index(frame.len())];
        prop_assume!(text[i] != to);
        let trailing_space = i == text.len() - 1 && is_space(to);
        text[i] = to;
        match dearmor(&text) {
            // No longer armor by its first byte: passed through, as binary
            // (which then fails on the magic bytes).
            Ok(back) if i == 0 => prop_assert!(!starts_armor(to) && back == text),
            Ok(back) => prop_assert!(trailing_space && back == data),
            Err(e) => prop_assert!(armor_error(&e).is_some()),
        }
    }

    #[test]
    fn accepted_armor_is_the_one_armor_of_its_bytes(
        len in 1usize..300,
        edits in proptest::collection::vec(
            (any::<prop::sample::Index>(), 0u8..3, prop::sample::select(&b"A=\n\r -/+a0"[..])),
            1..4,
        ),
    ) {
        // Random edits (insert, delete, replace) of armor characters into
        // valid armor: whatever is still accepted must be exactly what the
        // writer makes of the bytes read, but for CRLF and whitespace
        // around. Strictness means one text per file.
        let mut text = armor(&payload(len));
        for (at, op, c) in edits {
            let i = at.index(text.len());
            match op {
                0 => text.insert(i, c),
                1 => drop(text.remove(i)),
                _ => text[i] = c,
            }
        }
        if let Ok(back) = dearmor(&text) {
            let s = String::from_utf8(text.clone()).unwrap();
            let canonical = s.trim_matches([' ', '\t', '\r', '\n']).replace("\r\n", "\n") + "\n";
            if starts_armor(text[0]) {
                prop_assert_eq!(canonical.into_bytes(), armor(&back));
            } else {
                prop_assert_eq!(back, text);
            }
        }
    }
}

mod decrypt_any_file {
    use super::*;
    use crate::recovery::RecoveryKey;
    use crate::{Encryptor, Mode, Params, Recipient};

    fn setup() -> (Encryptor, Decryptor) {
        let key = RecoveryKey::generate(&mut rand_core::OsRng);
        let to: Vec<Box<dyn Recipient>> = vec![Box::new(key.recipient().unwrap())];
        let params = Params::new(Mode::Gcm, 256)
            .unwrap()
            .with_segment_size(4096)
            .unwrap();
        let enc = Encryptor::new(&to, params).unwrap();
        (
            enc,
            Decryptor::new(vec![Box::new(key.into_identity().unwrap())]),
        )
    }

    fn file_with(bytes: &[u8]) -> File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(bytes).unwrap();
        use std::io::Seek as _;
        f.rewind().unwrap();
        f
    }

    #[test]
    fn takes_binary_and_armor_alike_on_many_workers() {
        let (enc, dec) = setup();
        let plain = payload(100_000);
        let mut binary = Vec::new();
        enc.encrypt(&plain[..], &mut binary, &StreamOptions::sequential())
            .unwrap();
        let mut w = ArmoredWriter::new(Vec::new());
        enc.encrypt(&plain[..], &mut w, &StreamOptions::parallel(3))
            .unwrap();
        let armored = w.finish().unwrap();
        for input in [&binary, &armored] {
            for opts in [StreamOptions::sequential(), StreamOptions::parallel(3)] {
                let mut out = Vec::new();
                dec.decrypt_any_file(&file_with(input), &mut out, &opts)
                    .unwrap();
                assert_eq!(out, plain);
            }
        }
    }

    #[test]
    fn bad_armor_is_an_integrity_error_of_its_own() {
        let (enc, dec) = setup();
        let mut w = ArmoredWriter::new(Vec::new());
        enc.encrypt(&payload(20_000)[..], &mut w, &StreamOptions::sequential())
            .unwrap();
        let armored = w.finish().unwrap();
        let mut garbage = armored.clone();
        garbage.extend(b"x");
        let mut long = armored.clone();
        long.insert(BEGIN.len() + 2, b'A');
        let cases = [
            (&armored[..armored.len() - 3], ArmorError::MissingEnd),
            (&garbage[..], ArmorError::TrailingData),
            (&long[..], ArmorError::LongLine(2)),
        ];
        for (input, want) in cases {
            for opts in [StreamOptions::sequential(), StreamOptions::parallel(3)] {
                let e = dec
                    .decrypt_any_file(&file_with(input), Vec::new(), &opts)
                    .unwrap_err();
                assert!(e.is_integrity(), "{e}");
                assert!(matches!(&e, Error::Armor(a) if *a == want), "{e:?}");
            }
        }
    }
}
