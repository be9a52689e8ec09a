//! End-to-end attacks on outputs written with no name (`O_TMPFILE`) and
//! linked in at the end: what another user, a careless operator or a
//! crash can make of the time between the file's creation and its name.

mod common;

use std::fs;
use std::io::Write as _;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{bytes, recovery, tpmcrypt};

/// A FIFO at `path`, so that a run waits for its input while its output
/// is open.
fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

/// The output directory is renamed while the output is being written, and
/// a symlink to another directory put under its name (what anyone who may
/// write the parent can do): the output must not be named in that other
/// directory, which the user never asked for (a plaintext readable there
/// by whoever owns it). The named temporary's rename failed there; a
/// link by path followed the symlink.
#[test]
fn an_output_is_never_linked_into_a_directory_swapped_in_mid_run() {
    let dir = common::scratch("tpmcrypt-unnamed-");
    let d = dir.path();
    let r = recovery(d, "id");
    fs::create_dir(d.join("out")).unwrap();
    fs::create_dir(d.join("elsewhere")).unwrap();
    let out = d.join("out").canonicalize().unwrap();
    let fifo = d.join("in.fifo");
    mkfifo(&fifo);
    let child = tpmcrypt(d)
        .args(["encrypt", "-q", "-R", &r, "-o", "out/x.tpmc", "in.fifo"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut writer = fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    writer.write_all(&bytes(1 << 20, 7)).unwrap();
    let start = Instant::now();
    while !common::has_a_file_open_in(child.id(), &out) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no output opened"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    fs::rename(d.join("out"), d.join("out.moved")).unwrap();
    std::os::unix::fs::symlink(d.join("elsewhere"), d.join("out")).unwrap();
    drop(writer);
    let done = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&done.stderr);
    let names: Vec<_> = fs::read_dir(d.join("elsewhere"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        names.is_empty(),
        "the output was linked into the swapped-in directory: {names:?} (exit {:?}, {stderr})",
        done.status.code()
    );
    // Reported (as the old rename's failure was), in one line, and the
    // output is complete in the directory it was written in.
    assert_eq!(done.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("moved or replaced"), "{stderr}");
    assert!(d.join("out.moved/x.tpmc").is_file(), "{stderr}");
}

/// `-o NAME/` or `-o NAME/.` (a careless operator meaning a directory
/// that does not exist): refused as before (the error of the old rename),
/// exit 1, and no file named NAME is made (linking by `Path::file_name`
/// dropped the `/` and the `/.`).
#[test]
fn an_output_named_with_a_trailing_slash_is_refused_and_nothing_is_made() {
    let dir = common::scratch("tpmcrypt-unnamed-");
    let d = dir.path();
    let r = recovery(d, "id");
    fs::write(d.join("f"), b"hello").unwrap();
    for (extra, name, says) in [
        (&[][..], "newdir/", "Not a directory"),
        (&["--no-sync"][..], "newdir/", "Not a directory"),
        (&[][..], "newdir/.", "No such file or directory"),
    ] {
        let mut args = vec!["encrypt", "-q", "-R", &r];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["-o", name, "f"]);
        let out = tpmcrypt(d).args(&args).output().expect("spawn");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(!d.join("newdir").exists(), "{args:?}: a file was made");
    }
}

/// The same swap during a group commit of `--in-place -r` (the names are
/// given after a pause made by strace before the first link): no output
/// reaches the swapped-in directory, each is reported, and every
/// original stays, beside its output in the directory it was in.
#[test]
fn an_in_place_batch_whose_directory_is_swapped_keeps_every_original() {
    let dir = common::scratch("tpmcrypt-unnamed-");
    let d = dir.path();
    let r = recovery(d, "id");
    fs::create_dir(d.join("tree")).unwrap();
    fs::create_dir(d.join("elsewhere")).unwrap();
    for i in 0..3u64 {
        fs::write(d.join(format!("tree/f{i}")), bytes(3000, i)).unwrap();
    }
    let child = common::wrapper(d, "strace")
        .args(["-f", "-qq", "-o", "/dev/null"])
        .args(["-e", "inject=linkat:delay_enter=1500000:when=1"])
        .arg(common::bin())
        .args(["encrypt", "-q", "--in-place", "-R", &r, "-r", "tree"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("strace (installed by scripts/setup-deps)");
    // Wait for the outputs to be open with no name, then swap.
    let tree = d.join("tree").canonicalize().unwrap();
    let start = Instant::now();
    while common::unnamed_output_in(&tree).is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no output opened"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(300));
    fs::rename(d.join("tree"), d.join("tree.moved")).unwrap();
    std::os::unix::fs::symlink("elsewhere", d.join("tree")).unwrap();
    let done = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert_eq!(
        fs::read_dir(d.join("elsewhere")).unwrap().count(),
        0,
        "{stderr}"
    );
    assert_eq!(done.status.code(), Some(1), "{stderr}");
    for i in 0..3u64 {
        let original = d.join(format!("tree.moved/f{i}"));
        assert_eq!(fs::read(&original).unwrap(), bytes(3000, i), "{stderr}");
    }
}
