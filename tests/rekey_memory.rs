//! Constant memory for rekey: a 512 MiB file is rekeyed with a bounded
//! resident set, as tests/memory.rs checks for encrypt and decrypt. This
//! file holds a single test so that RUSAGE_CHILDREN sees only its own
//! processes: in tests/rekey.rs it also saw the children of the tests
//! running beside it (a `rekey -r` of six files in parallel, 45–76 MiB
//! resident), and failed on a busy machine, where those overlap it.

mod common;
use common::{assert_ok, max_child_rss_kib, recovery, run};

use std::fs;

const LIMIT_KIB: i64 = 64 * 1024;

/// A 512 MiB file is rekeyed in constant memory: the plaintext streams
/// through bounded buffers, never whole (every child of this test
/// process, rekey included, stays under 64 MiB resident).
#[test]
fn a_large_file_is_rekeyed_in_constant_memory() {
    let dir = common::scratch("tpmcrypt-rekey-");
    let d = dir.path();
    let r1 = recovery(d, "r1.key");
    let r2 = recovery(d, "r2.key");
    let f = fs::File::create(d.join("big")).unwrap();
    f.set_len(512 << 20).unwrap();
    drop(f);
    assert_ok(
        &run(d, &["encrypt", "-q", "-R", &r1, "--in-place", "big"]),
        "encrypt",
    );
    let r = run(
        d,
        &[
            "-v",
            "-q",
            "rekey",
            "-i",
            "r1.key",
            "-R",
            &r2,
            "--no-keep-recovery",
            "big.tpmc",
        ],
    );
    assert_ok(&r, "rekey");
    assert!(
        common::rekey_summary(&r).contains(&format!("rekeyed 1 file(s), {} bytes", 512u64 << 20)),
        "{}",
        r.stderr
    );
    let rss = max_child_rss_kib();
    assert!(rss > 0);
    assert!(rss < LIMIT_KIB, "a child had {rss} KiB resident");
    assert_ok(
        &run(
            d,
            &[
                "decrypt",
                "-q",
                "-i",
                "r2.key",
                "-o",
                "/dev/null",
                "big.tpmc",
            ],
        ),
        "decrypt",
    );
}
