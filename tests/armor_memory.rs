//! Constant memory for armor: 1 GiB streams through `encrypt -a` and
//! `decrypt` of the armor on a pipe (1.4 GB of text) with a bounded resident
//! set, as tests/memory.rs checks for binary. The input is a sparse file,
//! so the test costs CPU, not disk. This file holds a single test so that
//! RUSAGE_CHILDREN sees only these two processes.

mod common;
use common::max_child_rss_kib;

use std::fs::File;
use std::process::Stdio;

const LIMIT_KIB: i64 = 64 * 1024;

#[test]
fn one_gib_of_armor_streams_in_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let recipient = common::recovery(d, "id.key");
    let input = d.join("sparse");
    let len: u64 = 1 << 30;
    File::create(&input).unwrap().set_len(len).unwrap();

    // encrypt -a (regular file: parallel positional reads, armor on the
    // way out) | decrypt (a pipe of armor: decoded by the streaming path)
    let mut enc = common::tpmcrypt(d)
        .args(["encrypt", "-a", "-R", &recipient, "-o", "-"])
        .arg(&input)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pipe = enc.stdout.take().unwrap();
    let dec = common::tpmcrypt(d)
        .args(["-v", "decrypt", "-i", "id.key", "-o", "/dev/null"])
        .stdin(Stdio::from(pipe))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let dec_out = dec.wait_with_output().unwrap();
    let enc_status = enc.wait().unwrap();
    assert!(enc_status.success(), "encrypt -a failed");
    let stderr = String::from_utf8_lossy(&dec_out.stderr);
    assert!(dec_out.status.success(), "decrypt failed: {stderr}");
    assert!(stderr.contains(&format!("{len} bytes")), "{stderr}");

    let rss = max_child_rss_kib();
    eprintln!("largest child max RSS: {rss} KiB for 1 GiB through armor");
    assert!(rss > 0);
    assert!(rss < LIMIT_KIB, "max RSS {rss} KiB exceeds {LIMIT_KIB} KiB");
}
