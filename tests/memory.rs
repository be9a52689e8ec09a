//! Constant memory: a 4 GiB file streams through `encrypt` and `decrypt`
//! with a bounded resident set (the limit: ~64 MiB). The input is a
//! sparse file, so the test costs CPU, not disk. This file holds a single
//! test so that RUSAGE_CHILDREN sees only these two processes.

mod common;
use common::max_child_rss_kib;

use std::fs::File;
use std::process::Stdio;

const LIMIT_KIB: i64 = 64 * 1024;

#[test]
fn four_gib_streams_in_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let recipient = common::recovery(d, "id.key");
    let input = d.join("sparse");
    File::create(&input).unwrap().set_len(4 << 30).unwrap();

    // encrypt (regular file: parallel positional reads) | decrypt (pipe:
    // streaming reader) > /dev/null
    let mut enc = common::tpmcrypt(d)
        .args(["encrypt", "-R", &recipient, "-o", "-"])
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
    assert!(enc_status.success(), "encrypt failed");
    let stderr = String::from_utf8_lossy(&dec_out.stderr);
    assert!(dec_out.status.success(), "decrypt failed: {stderr}");
    assert!(
        stderr.contains(&format!("{} bytes", 4u64 << 30)),
        "{stderr}"
    );

    let rss = max_child_rss_kib();
    eprintln!("largest child max RSS: {} KiB for a 4 GiB stream", rss);
    assert!(rss > 0);
    assert!(rss < LIMIT_KIB, "max RSS {rss} KiB exceeds {LIMIT_KIB} KiB");
}
