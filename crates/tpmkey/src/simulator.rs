//! A private software TPM (`swtpm`) for tests and the CLI's `--simulator`.
//!
//! The simulator listens on two free loopback TCP ports (command port P and
//! control port P+1) and keeps its NVRAM in a caller-chosen directory, so
//! the owner seed — and therefore every key created with it — survives
//! restarts.  On drop we send TPM2_Shutdown and the swtpm control
//! "shutdown" command so the state is written out cleanly, then reap the
//! process.  A software TPM offers no protection against anyone who can read
//! the state directory; the CLI must say so.  The directory is kept 0700 and
//! swtpm writes its files 0600 (`--tpmstate …,mode=0600`, and umask 077 for
//! its lock file), so at least no other user can read them.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Options for [`Simulator::start_with`].
#[derive(Debug, Clone, Default)]
pub struct SimulatorOptions {
    /// Write swtpm's log here.  With `log_level` ≥ 20 swtpm logs every
    /// command and response in hex, which security tests use to check that
    /// secrets never cross the "bus" in clear.
    pub log_file: Option<PathBuf>,
    /// swtpm log level (default 20 when `log_file` is set).
    pub log_level: Option<u32>,
    /// The swtpm binary (default: `swtpm` from `PATH`, or `$TPMCRYPT_SWTPM`).
    pub swtpm_binary: Option<PathBuf>,
}

/// A running swtpm.  Dropping it stops the process.
#[derive(Debug)]
pub struct Simulator {
    child: Option<Child>,
    port: u16,
    state_dir: PathBuf,
    /// The state directory's lock (see [`lock_state`]), released after
    /// swtpm has stopped (fields drop after [`Drop::drop`]).
    _lock: std::fs::File,
}

/// How long a start waits for another process's simulator on the same
/// state to stop.
const LOCK_WAIT: Duration = Duration::from_secs(60);

/// Takes `DIR/.tpmcrypt.lock` (0600, never through a symlink), waiting up
/// to [`LOCK_WAIT`] for another process using the same state: one swtpm
/// at a time may have it, and a second one started beside the first
/// failed at once ("Could not lock access to lockfile"), so that two
/// `--simulator` runs at the same moment failed one in five. Now they
/// take turns. A wait is said (once a process), and given up when the
/// process is ending by a signal; a lock file removed or replaced while
/// another process held it is taken again as the name now gives it.
fn lock_state(dir: &Path) -> Result<std::fs::File> {
    use std::os::unix::fs::PermissionsExt;
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    const WHAT: &str = "the simulator's state lock";
    let path = dir.join(".tpmcrypt.lock");
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        let file = crate::trust::open_lock_file(&path, "the simulator's lock file")?;
        // One made wider by hand is tightened, as swtpm's files are.
        let meta = file.metadata().map_err(|e| Error::io(&path, e))?;
        if meta.permissions().mode() & 0o077 != 0 {
            file.set_permissions(std::fs::Permissions::from_mode(STATE_FILE_MODE))
                .map_err(|e| Error::io(&path, e))?;
        }
        while !crate::trust::try_flock(&file, libc::LOCK_EX).map_err(|e| Error::io(&path, e))? {
            crate::trust::say_lock_wait(&SAID, &path, WHAT);
            if crate::operation::ending() {
                return Err(Error::Simulator(format!(
                    "interrupted while waiting for {WHAT} {}",
                    path.display()
                )));
            }
            if Instant::now() >= deadline {
                return Err(Error::Simulator(format!(
                    "its state in {} has been in use by another process for {} s (a watch \
                     daemon or agent run with --simulator?)",
                    dir.display(),
                    LOCK_WAIT.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if crate::trust::still_names(&path, &file) {
            return Ok(file);
        }
    }
}

/// Finds P such that P and P+1 are currently free on 127.0.0.1.
fn free_port_pair() -> Result<u16> {
    for _ in 0..50 {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .map_err(|e| Error::Simulator(format!("cannot bind a loopback port: {e}")))?;
        let port = l
            .local_addr()
            .map_err(|e| Error::Simulator(e.to_string()))?
            .port();
        if port < 1024 || port == u16::MAX {
            continue;
        }
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port + 1)).is_ok() {
            return Ok(port);
        }
    }
    Err(Error::Simulator("no free pair of loopback ports".into()))
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

impl Simulator {
    /// Starts swtpm with its state in `state_dir` (created if missing).
    pub fn start(state_dir: &Path) -> Result<Simulator> {
        Simulator::start_with(state_dir, &SimulatorOptions::default())
    }

    /// Starts swtpm with options.
    pub fn start_with(state_dir: &Path, opts: &SimulatorOptions) -> Result<Simulator> {
        create_private_dir(state_dir)?;
        if let Some(log) = &opts.log_file {
            no_comma(log, "the log file")?;
        }
        let lock = lock_state(state_dir)?;
        let binary = opts
            .swtpm_binary
            .clone()
            .or_else(|| std::env::var_os("TPMCRYPT_SWTPM").map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from("swtpm"));
        let mut last_err = String::new();
        // Ports may be taken between our probe and swtpm's bind; retry.
        for _ in 0..8 {
            let port = free_port_pair()?;
            let mut cmd = Command::new(&binary);
            cmd.arg("socket")
                .arg("--tpm2")
                .arg("--server")
                .arg(format!("type=tcp,port={port},bindaddr=127.0.0.1"))
                .arg("--ctrl")
                .arg(format!("type=tcp,port={},bindaddr=127.0.0.1", port + 1))
                .arg("--tpmstate")
                .arg(format!("dir={},mode=0600", state_dir.display()))
                .arg("--flags")
                .arg("not-need-init,startup-clear")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            if let Some(log) = &opts.log_file {
                cmd.arg("--log").arg(format!(
                    "file={},level={}",
                    log.display(),
                    opts.log_level.unwrap_or(20)
                ));
            }
            prepare_child(&mut cmd);
            let mut child = cmd.spawn().map_err(|e| {
                Error::Simulator(format!(
                    "cannot run '{}': {e} (install the swtpm package)",
                    binary.display()
                ))
            })?;
            match wait_ready(&mut child, port) {
                Ok(()) => {
                    return Ok(Simulator {
                        child: Some(child),
                        port,
                        state_dir: state_dir.to_path_buf(),
                        _lock: lock,
                    })
                }
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    last_err = e;
                }
            }
        }
        Err(Error::Simulator(last_err))
    }

    /// The TCTI string for this simulator (`swtpm:host=127.0.0.1,port=P`),
    /// usable with [`crate::Tpm::open`] and as `TPM2TOOLS_TCTI`.
    pub fn tcti(&self) -> String {
        format!("swtpm:host=127.0.0.1,port={}", self.port)
    }

    /// The command port (the control port is one higher).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The NVRAM state directory.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// Stops the simulator now (Drop does the same).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // 1. TPM2_Shutdown(SU_CLEAR): marks an orderly shutdown so the next
        //    start does not count as a power loss (which would bump the
        //    dictionary-attack counter).  Needs the command port to be free,
        //    i.e. all Tpm handles closed; time-limited otherwise.
        let _ = send_tpm_shutdown(self.port);
        // 2. swtpm CMD_SHUTDOWN on the control channel: swtpm saves its
        //    state and exits.
        let _ = send_ctrl(self.port + 1, CMD_SHUTDOWN);
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Simulator {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// swtpm control command codes (swtpm's `tpm_ioctl.h`).
const CMD_GET_CAPABILITY: u32 = 1;
const CMD_SHUTDOWN: u32 = 3;

fn send_ctrl(port: u16, cmd: u32) -> std::io::Result<Vec<u8>> {
    let mut s = TcpStream::connect_timeout(&addr(port), Duration::from_secs(1))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(&cmd.to_be_bytes())?;
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf)?;
    Ok(buf[..n].to_vec())
}

fn send_tpm_shutdown(port: u16) -> std::io::Result<()> {
    let mut s = TcpStream::connect_timeout(&addr(port), Duration::from_secs(1))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    // tag=TPM_ST_NO_SESSIONS, size=12, cc=TPM_CC_Shutdown, SU_CLEAR
    s.write_all(&[0x80, 0x01, 0, 0, 0, 12, 0, 0, 0x01, 0x45, 0, 0])?;
    let mut buf = [0u8; 10];
    s.read_exact(&mut buf)?;
    Ok(())
}

/// Waits until swtpm answers on its control channel (which it opens after
/// the command socket), or fails if it exits (e.g. port collision).
fn wait_ready(child: &mut Child, port: u16) -> std::result::Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let mut msg = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut msg);
            }
            // Its lines as one (an error is one line).
            let msg = msg.split_whitespace().collect::<Vec<_>>().join(" ");
            if msg.is_empty() {
                return Err(format!("swtpm exited ({status}) before it answered"));
            }
            return Err(format!("swtpm exited ({status}): {msg}"));
        }
        if let Ok(resp) = send_ctrl(port + 1, CMD_GET_CAPABILITY) {
            if resp.len() >= 4 && resp[..4] == [0, 0, 0, 0] {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            return Err("swtpm did not become ready within 10 s".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Mode of the state directory.
const STATE_DIR_MODE: u32 = 0o700;
/// Mode of every file in it (swtpm's `--tpmstate mode=`).
const STATE_FILE_MODE: u32 = 0o600;
/// swtpm's lock file, created with mode 0660 & ~umask.
const LOCK_FILE: &str = ".lock";

/// Refuses a path swtpm would cut short: it takes its options as
/// `KEY=VALUE,…`, so a comma in the path would end it there, and a `dir=`
/// after it would name another directory than the one checked here.
fn no_comma(path: &Path, what: &str) -> Result<()> {
    match path.as_os_str().as_encoded_bytes().contains(&b',') {
        true => Err(Error::Simulator(format!(
            "{what} {} has a comma in its path, which swtpm would take for the end of it",
            path.display()
        ))),
        false => Ok(()),
    }
}

/// Creates the state directory 0700, or tightens an existing one (and a
/// lock file left by an older swtpm run) so no other user can read the
/// simulated TPM's secrets.
///
/// It holds a TPM's seeds, so it is trusted as the keystore is
/// ([`crate::trust`]): made only where nobody else could have made it (or
/// a directory on the way) first, and checked again as made, since another
/// user may make a missing directory on the way meanwhile; an existing one
/// must be the caller's, under directories nobody else may change. Before,
/// a state directory that another user had made a symlink to, say, `/etc`
/// had root's run chmod that directory and write the TPM's state into it.
/// Modes are then changed through descriptors, never through a path that
/// could be swapped in between.
fn create_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
    const WHAT: &str = "the simulator's state directory";
    no_comma(dir, WHAT)?;
    // Each missing directory made alone and checked before the next is
    // made in it: made in one go, a directory on the way that another
    // user swapped for a symlink would have root make the rest there.
    crate::trust::create_private_dirs(dir, WHAT)?;
    crate::trust::check_private_dir(dir, WHAT)?;
    let d = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|e| Error::io(dir, e))?;
    let meta = d.metadata().map_err(|e| Error::io(dir, e))?;
    crate::trust::check_private(dir, &meta, WHAT)?;
    if meta.mode() & 0o077 != 0 {
        d.set_permissions(std::fs::Permissions::from_mode(STATE_DIR_MODE))
            .map_err(|e| Error::io(dir, e))?;
    }
    // The directory is the caller's under trusted ones: the path names the
    // one just checked. Never through a symlink, never blocking on a FIFO.
    let lock = dir.join(LOCK_FILE);
    if let Ok(file) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&lock)
    {
        if let Ok(meta) = file.metadata() {
            if meta.is_file() && meta.uid() == crate::trust::euid() && meta.mode() & 0o077 != 0 {
                file.set_permissions(std::fs::Permissions::from_mode(STATE_FILE_MODE))
                    .map_err(|e| Error::io(&lock, e))?;
            }
        }
    }
    Ok(())
}

/// Prepares the child: SIGTERM swtpm if our process dies without dropping
/// the [`Simulator`] (e.g. a test is killed), so no orphan keeps the ports;
/// umask 077, so files swtpm creates without `--tpmstate mode=` (its lock
/// file) are private too; and mark every inherited descriptor close-on-exec.
///
/// The latter is essential: tpm2-tss opens its sockets without
/// `SOCK_CLOEXEC`, so a swtpm started while any `Tpm` is open would inherit
/// that connection and keep it alive after the `Tpm` is dropped — and since
/// swtpm serves one client at a time, the other simulator would hang
/// forever.  (`CLOSE_RANGE_CLOEXEC` rather than closing keeps std's
/// exec-error pipe working.)
fn prepare_child(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: only async-signal-safe syscalls, no allocation, no Rust state.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            libc::umask(0o077);
            let r = libc::syscall(
                libc::SYS_close_range,
                3 as libc::c_uint,
                libc::c_uint::MAX,
                CLOSE_RANGE_CLOEXEC,
            );
            if r != 0 {
                for fd in 3..4096 {
                    libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
                }
            }
            Ok(())
        });
    }
}
