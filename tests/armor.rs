//! ASCII armor end to end: `encrypt -a` writes strict PEM-style text,
//! `decrypt` and `inspect` recognise it by its first byte, and armor that
//! is not strictly what `encrypt -a` writes is refused like any other
//! damaged ciphertext (exit 3, one error line, no output left behind).

mod common;

use std::fs;
use std::path::Path;

use common::{assert_error_line, assert_ok, run, run_stdin};

const BEGIN: &str = "-----BEGIN TPMCRYPT ENCRYPTED FILE-----";
const END: &str = "-----END TPMCRYPT ENCRYPTED FILE-----";

/// Checks `text` is armor as `encrypt -a` writes it: the BEGIN line, data
/// lines of 64 columns but the last (1 to 64), the END line, LF endings.
fn assert_strict_armor(text: &[u8], what: &str) {
    let text = std::str::from_utf8(text).unwrap_or_else(|_| panic!("{what}: not text"));
    assert!(!text.contains('\r'), "{what}: CR in armor");
    let lines: Vec<&str> = text.split_terminator('\n').collect();
    assert!(text.ends_with('\n'), "{what}: no final LF");
    assert_eq!(lines.first(), Some(&BEGIN), "{what}");
    assert_eq!(lines.last(), Some(&END), "{what}");
    let data = &lines[1..lines.len() - 1];
    assert!(!data.is_empty(), "{what}: no data lines");
    for l in &data[..data.len() - 1] {
        assert_eq!(l.len(), 64, "{what}: {l:?}");
    }
    let last = data[data.len() - 1];
    assert!((1..=64).contains(&last.len()), "{what}: last line {last:?}");
    let b64 = |c: char| c.is_ascii_alphanumeric() || c == '+' || c == '/' || c == '=';
    assert!(data.iter().all(|l| l.chars().all(b64)), "{what}");
}

/// A recovery identity `id.key` in `d`; its recipient.
fn setup(d: &Path) -> String {
    common::recovery(d, "id.key")
}

#[test]
fn encrypt_a_writes_strict_armor_that_decrypt_recognises() {
    let dir = common::scratch("armor-rt");
    let d = dir.path();
    let r = setup(d);
    // Empty, tiny, one segment and a bit, and above the parallel
    // threshold (4 MiB: the parallel engine on both sides).
    for (i, len) in [0usize, 1, (1 << 20) + 7, 5 << 20].into_iter().enumerate() {
        let plain = common::bytes(len, i as u64 + 1);
        let name = format!("f{i}");
        fs::write(d.join(&name), &plain).unwrap();
        let out = run(d, &["encrypt", "-a", "-R", &r, &name]);
        assert_ok(&out, "encrypt -a");
        let ct = fs::read(d.join(format!("{name}.tpmc"))).unwrap();
        assert_strict_armor(&ct, &name);
        fs::remove_file(d.join(&name)).unwrap();
        assert_ok(
            &run(d, &["decrypt", "-i", "id.key", &format!("{name}.tpmc")]),
            "decrypt",
        );
        assert_eq!(fs::read(d.join(&name)).unwrap(), plain, "{name}");
        // stdin to stdout both ways, and -o.
        let armored = run_stdin(d, &["encrypt", "--armor", "-R", &r], &plain);
        assert_ok(&armored, "encrypt -a, stdin to stdout");
        assert_strict_armor(&armored.stdout, "stdout");
        let back = run_stdin(d, &["decrypt", "-i", "id.key"], &armored.stdout);
        assert_ok(&back, "decrypt of armor on stdin");
        assert_eq!(back.stdout, plain);
        let o = format!("{name}.out");
        let via_o = run(
            d,
            &["decrypt", "-i", "id.key", "-o", &o, &format!("{name}.tpmc")],
        );
        assert_ok(&via_o, "decrypt -o");
        assert_eq!(fs::read(d.join(&o)).unwrap(), plain);
    }
}

#[test]
fn armor_with_crlf_throughout_and_whitespace_around_decrypts() {
    let dir = common::scratch("armor-crlf");
    let d = dir.path();
    let r = setup(d);
    let plain = common::bytes(100_000, 9);
    let ct = run_stdin(d, &["encrypt", "-a", "-R", &r], &plain);
    assert_ok(&ct, "encrypt -a");
    let text = String::from_utf8(ct.stdout).unwrap();
    let crlf = format!("\r\n \t\n{}\r\n\n", text.replace('\n', "\r\n"));
    fs::write(d.join("c.tpmc"), crlf).unwrap();
    let out = run(d, &["decrypt", "-i", "id.key", "-o", "-", "c.tpmc"]);
    assert_ok(&out, "decrypt of CRLF armor");
    assert_eq!(out.stdout, plain);
}

#[test]
fn armored_trees_in_place_both_ways() {
    let dir = common::scratch("armor-tree");
    let d = dir.path();
    let r = setup(d);
    fs::create_dir_all(d.join("t/sub")).unwrap();
    let files = [("t/a", 10usize), ("t/sub/b", 200_000), ("t/sub/c", 0)];
    for (i, (f, len)) in files.iter().enumerate() {
        fs::write(d.join(f), common::bytes(*len, i as u64 + 3)).unwrap();
    }
    assert_ok(
        &run(d, &["encrypt", "-a", "-R", &r, "-r", "--in-place", "t"]),
        "encrypt -a -r --in-place",
    );
    for (f, _) in &files {
        assert!(!d.join(f).exists(), "{f} left in place");
        assert_strict_armor(&fs::read(d.join(format!("{f}.tpmc"))).unwrap(), f);
    }
    // Armored files are tpmcrypt files: a second run leaves them out.
    let again = run(d, &["-v", "encrypt", "-R", &r, "-r", "t"]);
    assert_ok(&again, "encrypt -r over armor");
    assert_eq!(
        again.stderr.matches("already a tpmcrypt file").count(),
        3,
        "{}",
        again.stderr
    );
    assert!(!d.join("t/a.tpmc.tpmc").exists());
    assert_ok(
        &run(d, &["decrypt", "-i", "id.key", "-r", "--in-place", "t"]),
        "decrypt -r --in-place",
    );
    for (i, (f, len)) in files.iter().enumerate() {
        assert_eq!(
            fs::read(d.join(f)).unwrap(),
            common::bytes(*len, i as u64 + 3),
            "{f}"
        );
        assert!(!d.join(format!("{f}.tpmc")).exists());
    }
}

#[test]
fn inspect_reads_armor_and_says_so() {
    let dir = common::scratch("armor-inspect");
    let d = dir.path();
    let r = setup(d);
    fs::write(d.join("p"), b"hello").unwrap();
    assert_ok(
        &run(d, &["encrypt", "-R", &r, "-o", "bin.tpmc", "p"]),
        "encrypt",
    );
    assert_ok(
        &run(d, &["encrypt", "-a", "-R", &r, "-o", "arm.tpmc", "p"]),
        "encrypt -a",
    );
    let json = |f: &str| -> serde_json::Value {
        let out = run(d, &["inspect", "--json", f]);
        assert_ok(&out, "inspect");
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let (bin, arm) = (json("bin.tpmc"), json("arm.tpmc"));
    assert_eq!(bin["armored"], false);
    assert_eq!(arm["armored"], true);
    assert_eq!(arm["mode"], bin["mode"]);
    assert_eq!(arm["recipients"], bin["recipients"]);
    let text = run(d, &["inspect", "arm.tpmc"]);
    assert!(String::from_utf8_lossy(&text.stdout).contains("armor:"));
    fs::write(d.join("bad.tpmc"), format!("{BEGIN}\n*AAA\n{END}\n")).unwrap();
    let bad = run(d, &["inspect", "bad.tpmc"]);
    assert_error_line(
        &bad,
        3,
        Some("bad.tpmc"),
        &["line 2", "base64"],
        "inspect of bad armor",
    );
}

/// The armor of `plain` encrypted to `r`, as lines (without their LF).
/// Sized so that the last data line is padded with "==".
fn armored_lines(d: &Path, r: &str) -> (Vec<u8>, Vec<String>) {
    for len in 3000.. {
        let plain = common::bytes(len, 5);
        let ct = run_stdin(d, &["encrypt", "-a", "-R", r], &plain);
        assert_ok(&ct, "encrypt -a");
        let text = String::from_utf8(ct.stdout).unwrap();
        let lines: Vec<String> = text.lines().map(str::to_owned).collect();
        if lines[lines.len() - 2].ends_with("==") {
            return (plain, lines);
        }
    }
    unreachable!()
}

fn joined(lines: &[String]) -> String {
    lines.iter().map(|l| format!("{l}\n")).collect()
}

/// Sets the unused low bits of the last base64 character before "==".
fn stray_bits(line: &str) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let at = line.len() - 3;
    let c = line.as_bytes()[at];
    let v = ALPHABET.iter().position(|&a| a == c).unwrap();
    let mut s = line.to_owned();
    s.replace_range(at..at + 1, &(ALPHABET[v | 1] as char).to_string());
    s
}

/// Every way armor can be wrong: the case's name, its text, and what the
/// Every way armor can be wrong: the case's name, its text, and what the
/// error line must mention.
fn corruptions(d: &Path, r: &str) -> Vec<(&'static str, Vec<u8>, &'static str)> {
    let (_, lines) = armored_lines(d, r);
    let mut all = line_faults(&lines);
    all.extend(frame_faults(&lines));
    all.push(("header only", header_only(d, r), "truncated"));
    all.push((
        "changed data char",
        payload_char_changed(&lines),
        "authentication",
    ));
    all
}

/// `lines` changed by `f`, joined.
fn edited(lines: &[String], f: &dyn Fn(&mut Vec<String>)) -> Vec<u8> {
    let mut l = lines.to_vec();
    f(&mut l);
    joined(&l).into_bytes()
}

/// Faults inside the data lines.
fn line_faults(lines: &[String]) -> Vec<(&'static str, Vec<u8>, &'static str)> {
    let n = lines.len();
    let with = |f: &dyn Fn(&mut Vec<String>)| edited(lines, f);
    vec![
        (
            "bad base64 char",
            with(&|l| l[2].replace_range(5..6, "*")),
            "invalid base64",
        ),
        (
            "space in a line",
            with(&|l| l[2].replace_range(5..6, " ")),
            "invalid base64",
        ),
        (
            "stray bits",
            with(&|l| l[n - 2] = stray_bits(&l[n - 2])),
            "invalid base64",
        ),
        (
            "missing padding",
            with(&|l| {
                let len = l[n - 2].len();
                l[n - 2].truncate(len - 2)
            }),
            "invalid base64",
        ),
        // 63 columns are no line's base64; 60 may be the last line only.
        (
            "63 columns mid-file",
            with(&|l| l[2].truncate(63)),
            "line 3: invalid base64",
        ),
        (
            "60 columns mid-file",
            with(&|l| l[2].truncate(60)),
            "line 4: data after a line shorter than 64",
        ),
        ("65 columns", with(&|l| l[2].push('A')), "longer than 64"),
        (
            "empty line",
            with(&|l| l.insert(3, String::new())),
            "empty line",
        ),
        (
            "one CRLF among LF",
            with(&|l| l[3].push('\r')),
            "mixed line endings",
        ),
    ]
}

/// Faults of the frame: what comes after the data, the BEGIN and END lines.
fn frame_faults(lines: &[String]) -> Vec<(&'static str, Vec<u8>, &'static str)> {
    let n = lines.len();
    let good = joined(lines);
    let with = |f: &dyn Fn(&mut Vec<String>)| edited(lines, f);
    vec![
        (
            "garbage after END",
            format!("{good}x\n").into_bytes(),
            "after the end line",
        ),
        (
            "a second armor after END",
            format!("{good}{good}").into_bytes(),
            "after the end line",
        ),
        (
            "truncated END",
            good.as_bytes()[..good.len() - 8].to_vec(),
            "without its end line",
        ),
        (
            "missing END",
            with(&|l| drop(l.pop())),
            "without its end line",
        ),
        (
            "cut mid-data",
            good.as_bytes()[..good.len() / 2].to_vec(),
            "without its end line",
        ),
        (
            "malformed END",
            with(&|l| l[n - 1].push('-')),
            "malformed end line",
        ),
        (
            "BEGIN only",
            format!("{BEGIN}\n").into_bytes(),
            "without its end line",
        ),
        (
            "BEGIN and END only",
            format!("{BEGIN}\n{END}\n").into_bytes(),
            "no data",
        ),
        (
            "other PEM",
            b"-----BEGIN PGP MESSAGE-----\nAAAA\n".to_vec(),
            "not a tpmcrypt file",
        ),
    ]
}

/// A data character of the payload changed (the header is in the first
/// lines): still armor, no longer authentic.
fn payload_char_changed(lines: &[String]) -> Vec<u8> {
    let mut flipped = lines.to_vec();
    let n = flipped.len();
    let c = if flipped[n - 3].starts_with('A') {
        "B"
    } else {
        "A"
    };
    flipped[n - 3].replace_range(0..1, c);
    joined(&flipped).into_bytes()
}

/// The binary header alone, armored: valid armor, truncated ciphertext.
fn header_only(d: &Path, r: &str) -> Vec<u8> {
    let full = run_stdin(d, &["encrypt", "-R", r], b"x");
    assert_ok(&full, "encrypt");
    fs::write(d.join("h.tpmc"), &full.stdout).unwrap();
    let info = run(d, &["inspect", "--json", "h.tpmc"]);
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    let header_len = info["payload_offset"].as_u64().unwrap() as usize;
    fs::remove_file(d.join("h.tpmc")).unwrap();
    armor_of(&full.stdout[..header_len])
}

/// `bytes` armored (for the one case made by hand: armor of a cut
/// binary file).
fn armor_of(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    let mut w = tpmcrypt_cipher::armor::ArmoredWriter::new(Vec::new());
    w.write_all(bytes).unwrap();
    w.finish().unwrap()
}

#[test]
fn damaged_armor_is_exit_3_with_one_line_and_no_output() {
    let dir = common::scratch("armor-bad");
    let d = dir.path();
    let r = setup(d);
    let cases = corruptions(d, &r);
    assert_eq!(cases.len(), 20, "the cases docs/reliability.md lists");
    for (what, text, needle) in cases {
        fs::write(d.join("x.tpmc"), &text).unwrap();
        let before = common::listing(d);
        let out = run(d, &["decrypt", "-i", "id.key", "x.tpmc"]);
        assert_error_line(&out, 3, Some("x.tpmc"), &[needle], what);
        assert_eq!(common::listing(d), before, "{what}: output left behind");
        // --in-place keeps the damaged file as it was.
        let out = run(d, &["decrypt", "-i", "id.key", "--in-place", "x.tpmc"]);
        assert_error_line(&out, 3, Some("x.tpmc"), &[needle], what);
        assert_eq!(fs::read(d.join("x.tpmc")).unwrap(), text, "{what}");
        assert_eq!(common::listing(d), before, "{what}: output left behind");
        // From stdin, the same verdict.
        let out = run_stdin(d, &["decrypt", "-i", "id.key", "-o", "y"], &text);
        assert_error_line(&out, 3, Some("<stdin>"), &[needle], what);
        assert!(!d.join("y").exists(), "{what}: -o output left behind");
    }
}

#[test]
fn plaintext_that_looks_like_armor_is_still_just_plaintext() {
    let dir = common::scratch("armor-lookalike");
    let d = dir.path();
    let r = setup(d);
    // A plaintext that starts with "-----BEGIN" (even ours) is encrypted
    // like any other, and its binary ciphertext starts with the magic byte,
    // never with "-": detection never mistakes one for the other.
    let pem = format!("{BEGIN}\nnot really\n");
    fs::create_dir(d.join("t")).unwrap();
    fs::write(d.join("t/pgp.asc"), b"-----BEGIN PGP MESSAGE-----\nhi\n").unwrap();
    let enc = run(d, &["-v", "encrypt", "-R", &r, "-r", "t"]);
    assert_ok(&enc, "encrypt -r");
    assert!(d.join("t/pgp.asc.tpmc").exists(), "{}", enc.stderr);
    for plain in [pem.as_bytes(), b"-----BEGIN PGP MESSAGE-----\n", b"  \n"] {
        for armor in [&[][..], &["-a"]] {
            let mut args = vec!["encrypt", "-R", &r];
            args.extend(armor);
            let ct = run_stdin(d, &args, plain);
            assert_ok(&ct, "encrypt");
            assert_eq!(ct.stdout[0] == 0x89, armor.is_empty());
            let back = run_stdin(d, &["decrypt", "-i", "id.key"], &ct.stdout);
            assert_ok(&back, "decrypt");
            assert_eq!(back.stdout, plain);
        }
    }
}

/// Runs `args` with a pseudo-terminal as stdout (util-linux `script`);
/// returns the exit code and what the terminal showed.
fn on_terminal(dir: &Path, args: &str) -> (i32, String) {
    let typescript = dir.join("typescript");
    let status = common::wrapper(dir, "script")
        .args(["-q", "-e", "-c"])
        .arg(format!("{} {args}", common::bin().display()))
        .arg(&typescript)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("script (util-linux)");
    let shown = String::from_utf8_lossy(&fs::read(&typescript).unwrap()).into_owned();
    fs::remove_file(&typescript).unwrap();
    (status.code().unwrap_or(-1), shown)
}

#[test]
fn armor_may_go_to_a_terminal_and_comes_back_from_one() {
    let dir = common::scratch("armor-tty");
    let d = dir.path();
    let r = setup(d);
    let plain = common::bytes(1000, 4);
    fs::write(d.join("p"), &plain).unwrap();
    let (code, shown) = on_terminal(d, &format!("encrypt -R {r} -o - p"));
    assert_eq!(code, 2, "binary ciphertext to a terminal: {shown}");
    assert!(
        shown.contains("refusing to write ciphertext to a terminal"),
        "{shown}"
    );
    let (code, shown) = on_terminal(d, &format!("encrypt -a -R {r} -o - p"));
    assert_eq!(code, 0, "{shown}");
    // The terminal turned every LF into CRLF: armor copied from a
    // terminal decrypts as it is.
    let begin = shown.find(BEGIN).expect("BEGIN line shown");
    let end = shown.find(END).expect("END line shown") + END.len();
    let copied = format!("{}\r\n", &shown[begin..end]);
    assert!(copied.contains("\r\n") && !copied.replace("\r\n", "").contains('\n'));
    let back = run_stdin(d, &["decrypt", "-i", "id.key"], copied.as_bytes());
    assert_ok(&back, "decrypt of armor copied from a terminal");
    assert_eq!(back.stdout, plain);
}
