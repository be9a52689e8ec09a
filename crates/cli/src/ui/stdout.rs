//! Standard output that is gone. A reader that went away (`tpmcrypt decrypt
//! … | head -c 10`) ends the run quietly by SIGPIPE, as cat does (a shell
//! shows status 141); descriptor 1 closed when tpmcrypt started (`>&-`) is
//! an error, never a sink: the Rust runtime would put /dev/null there, and
//! the output would be lost with exit 0.

use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether descriptor 1 was closed when the process started.
static CLOSED_AT_START: AtomicBool = AtomicBool::new(false);

/// Runs before `main` and before the Rust runtime opens /dev/null on a
/// closed descriptor 1, so a closed stdout can still be told from one
/// redirected to /dev/null.
#[used]
#[link_section = ".init_array"]
static NOTE_CLOSED_STDOUT: extern "C" fn() = note_closed_stdout;

extern "C" fn note_closed_stdout() {
    // Read-only: a write to it fails (EBADF) instead of vanishing.
    if take_if_closed(1, libc::O_RDONLY) {
        CLOSED_AT_START.store(true, Ordering::Relaxed);
    }
}

/// Whether descriptor `target` is closed. If it is, it is taken by
/// /dev/null opened with `flags` (the access it is not meant for, so that
/// its use fails with EBADF), so that no file opened later lands there.
fn take_if_closed(target: libc::c_int, flags: libc::c_int) -> bool {
    // SAFETY: plain system calls; fcntl(F_GETFD) only asks whether the
    // descriptor is open, and the one opened here is this function's.
    unsafe {
        if libc::fcntl(target, libc::F_GETFD) != -1 {
            return false;
        }
        let fd = libc::open(c"/dev/null".as_ptr(), flags);
        if fd >= 0 && fd != target {
            libc::dup2(fd, target);
            libc::close(fd);
        }
    }
    true
}

/// Whether descriptor 0 was closed when the process started.
static STDIN_CLOSED_AT_START: AtomicBool = AtomicBool::new(false);

/// As [`NOTE_CLOSED_STDOUT`], for standard input: closed at start (`<&-`),
/// it is an error to read, not an empty input (the runtime's /dev/null
/// would encrypt nothing and exit 0).
#[used]
#[link_section = ".init_array"]
static NOTE_CLOSED_STDIN: extern "C" fn() = note_closed_stdin;

extern "C" fn note_closed_stdin() {
    // Write-only: a read fails (EBADF) instead of seeing an empty input.
    if take_if_closed(0, libc::O_WRONLY) {
        STDIN_CLOSED_AT_START.store(true, Ordering::Relaxed);
    }
}

/// Standard input was closed when tpmcrypt started (`<&-`).
#[derive(Debug, thiserror::Error)]
#[error("standard input is closed; there is nothing to read")]
pub struct StdinClosed;

/// Whether standard input was closed when tpmcrypt started.
pub fn stdin_closed_at_start() -> bool {
    STDIN_CLOSED_AT_START.load(Ordering::Relaxed)
}

/// Fails when standard input was closed at start: call it before reading
/// it.
pub fn ensure_stdin_open() -> anyhow::Result<()> {
    if stdin_closed_at_start() {
        return Err(anyhow::Error::new(StdinClosed));
    }
    Ok(())
}

/// Standard output was closed when tpmcrypt started (`>&-`).
#[derive(Debug, thiserror::Error)]
#[error("standard output is closed; nothing would be written")]
pub struct Closed;

/// Writing to standard output failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot write to standard output")]
pub struct WriteFailed(#[source] pub io::Error);

/// The name error lines give standard output.
pub const LABEL: &str = "<stdout>";

/// Whether standard output was closed when tpmcrypt started.
pub fn closed_at_start() -> bool {
    CLOSED_AT_START.load(Ordering::Relaxed)
}

/// Fails when standard output was closed at start: call it before any work
/// whose result goes there.
pub fn ensure_open() -> anyhow::Result<()> {
    if closed_at_start() {
        return Err(anyhow::Error::new(Closed).context(LABEL));
    }
    Ok(())
}

/// Writes `bytes` to standard output, whole, and flushes it.
pub fn write_all(bytes: &[u8]) -> anyhow::Result<()> {
    ensure_open()?;
    let mut out = io::stdout().lock();
    out.write_all(bytes)
        .and_then(|()| out.flush())
        .map_err(|e| anyhow::Error::new(WriteFailed(e)).context(LABEL))
}

/// Writes one line of text to standard output (for the commands that
/// print a few lines: `key list`, `key show`, …).
pub fn line(text: &str) -> anyhow::Result<()> {
    let mut bytes = Vec::with_capacity(text.len() + 1);
    bytes.extend_from_slice(text.as_bytes());
    bytes.push(b'\n');
    write_all(&bytes)
}

/// Whether `err` is a write to standard output whose reader went away.
pub fn is_broken_pipe(err: &anyhow::Error) -> bool {
    // Through every context layer, as anyhow looks for a context type.
    err.downcast_ref::<WriteFailed>()
        .is_some_and(|w| w.0.kind() == io::ErrorKind::BrokenPipe)
}

/// Ends the process as cat does when its reader goes away: by SIGPIPE,
/// with nothing on stderr (nothing was lost that anyone would read).
pub fn end_by_sigpipe() -> ! {
    // SAFETY: restores the default action of SIGPIPE (the Rust runtime
    // ignores it) and raises it in this thread; nothing is shared.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::raise(libc::SIGPIPE);
    }
    std::process::exit(128 + libc::SIGPIPE)
}
