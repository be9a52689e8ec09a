//! The session-key agent: a per-user process that holds unwrapped session
//! keys for a bounded time, so that a user who decrypts ten files one
//! command at a time pays one TPM operation, not ten.
//!
//! It knows nothing of payload encryption: it stores 32-byte secrets under
//! 32-byte ids (the hash of a wrapped session key).
//!
//! # Protocol
//! One request per connection on a Unix stream socket
//! (`$XDG_RUNTIME_DIR/tpmcrypt/agent.sock`, else
//! `${TMPDIR:-/tmp}/tpmcrypt-UID/tpmcrypt/agent.sock`; mode 0600 in a 0700
//! directory; `TPMCRYPT_AGENT_SOCK` overrides).
//!
//! # Who may talk to whom
//! Both ends check the other before a secret moves (see [`crate::trust`]):
//! * the agent accepts only peers with its own uid (`SO_PEERCRED`), and
//!   binds only in a directory owned by its uid, writable by nobody else,
//!   under directories that are the user's or root's;
//! * a client sends nothing (not even a PING) to a socket whose directory
//!   or socket file fails those checks, and on every connection verifies
//!   that the listening process runs as its own uid (`SO_PEERCRED` on the
//!   client side). Another local user who creates the directory first, or
//!   listens on a socket there, is refused and named in a warning; a
//!   decrypt then goes on without the agent.
//!
//! ```text
//! request  = version (1) ‖ op (1) ‖ body
//!   op 1 GET   body = id (32)              response = 0x00 ‖ secret (32) | 0x01 (absent)
//!   op 2 PUT   body = id (32) ‖ secret (32) response = 0x00
//!   op 3 STOP  body = ∅                    response = 0x00, then the agent wipes and exits
//!   op 4 PING  body = ∅                    response = 0x00 ‖ entries (u32 BE) ‖ sessions (u32 BE)
//!   op 5 SESSION_GET body = scope (32)     response = 0x00 ‖ secret (32) ‖ header | 0x01 (absent)
//!   op 6 SESSION_PUT body = scope (32) ‖ secret (32) ‖ header (≤ 64 KiB)
//!                                          response = 0x00
//! ```
//!
//! # Encryption sessions across invocations
//! A script that runs `encrypt` once per file would make one session per
//! file, and decrypting its files would cost one unwrap (one TPM operation)
//! each. With an agent running, `encrypt` asks it for the current session of
//! its *scope* (a hash of the recipients and parameters): the session key
//! and the header that wraps it (SESSION_GET), and offers a new session
//! when there is none (SESSION_OFFER): the agent keeps it unless another
//! `encrypt` offered one first, and then answers with that one, which the
//! run uses instead, so runs started together share one session.
//! SESSION_PUT replaces the session of a scope whatever it holds (a run
//! given a session that does not check out). A session is handed out for at most
//! [`MAX_SESSION_USES`] invocations and for the agent's TTL after it was
//! made; then the next `encrypt` starts a new one. Session keys stay in the
//! agent's locked memory only, and the same socket rules apply.

pub mod activation;
pub mod session;

use std::collections::HashMap;
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use zeroize::Zeroize;

use crate::error::{Error, Result};
use crate::trust;
use tpmcrypt_cipher::SessionKey;

/// Environment variable overriding the socket path.
pub const ENV_SOCK: &str = "TPMCRYPT_AGENT_SOCK";
const VERSION: u8 = 1;
const OP_GET: u8 = 1;
const OP_PUT: u8 = 2;
const OP_STOP: u8 = 3;
const OP_PING: u8 = 4;
const OP_SESSION_GET: u8 = 5;
const OP_SESSION_PUT: u8 = 6;
const OP_SESSION_OFFER: u8 = 7;
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest session header the agent keeps (real ones are well under 4 KiB).
pub const MAX_SESSION_HEADER: usize = 64 << 10;
/// `encrypt` invocations one shared session is handed to before the agent
/// lets the next one start a new session.
pub const MAX_SESSION_USES: u64 = 10_000;

/// Id of a secret (SHA-256 of the wrapped session key).
pub type SecretId = [u8; 32];

/// The default socket path: `TPMCRYPT_AGENT_SOCK`, else
/// `$XDG_RUNTIME_DIR/tpmcrypt/agent.sock`, else (cron, ssh sessions without
/// a runtime directory) `${TMPDIR:-/tmp}/tpmcrypt-UID/tpmcrypt/agent.sock`
/// (a relative `XDG_RUNTIME_DIR` or `TMPDIR` counts as unset),
/// a place another user can reach first: hence [`AgentClient::connect`]'s
/// checks.
pub fn socket_path() -> PathBuf {
    let non_empty = |v: &str| std::env::var_os(v).filter(|s| !s.is_empty());
    if let Some(p) = non_empty(ENV_SOCK) {
        return PathBuf::from(p);
    }
    let base = trust::env_dir("XDG_RUNTIME_DIR").unwrap_or_else(|| {
        let tmp = trust::env_dir("TMPDIR").unwrap_or_else(|| PathBuf::from("/tmp"));
        tmp.join(format!("tpmcrypt-{}", trust::euid()))
    });
    base.join("tpmcrypt").join("agent.sock")
}

/// The directory holding the socket `path` (`.` for a bare file name).
fn socket_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Connects to `path` without blocking for longer than [`IO_TIMEOUT`]: an
/// agent that is stopped (SIGSTOP) with a full accept queue makes a
/// blocking connect wait forever; this one gives up and the caller goes on
/// without the agent.
fn connect_bounded(path: &Path) -> io::Result<UnixStream> {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: an all-zero sockaddr_un is a valid value of the type.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long for a Unix socket",
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    // SAFETY: plain socket(2); the fd is owned by `stream` right after.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh socket that nothing else owns.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
    let rc = unsafe { libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), len) };
    if rc != 0 {
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            // Linux: the agent's accept queue is full (it is stopped or
            // stuck). Waiting would not help a short-lived client.
            Some(libc::EAGAIN) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the agent is not accepting connections (its queue is full)",
                ))
            }
            // Not seen for Unix sockets on Linux, but allowed by POSIX.
            Some(libc::EINPROGRESS) => {
                let mut fds = libc::pollfd {
                    fd,
                    events: libc::POLLOUT,
                    revents: 0,
                };
                let ms = IO_TIMEOUT.as_millis() as libc::c_int;
                // SAFETY: one valid pollfd.
                if unsafe { libc::poll(&mut fds, 1, ms) } <= 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the agent is not accepting connections",
                    ));
                }
                if let Some(e) = stream.take_error()? {
                    return Err(e);
                }
            }
            _ => return Err(err),
        }
    }
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// Checks the socket at `path` and its directory before anything is sent
/// there. `Ok(false)`: nothing is there (no agent).
fn check_socket(path: &Path) -> Result<bool> {
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        // ENOTDIR: a component of the path is a file; nothing listens there.
        Err(e)
            if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ENOTDIR) =>
        {
            return Ok(false)
        }
        // A directory on the way that we may not search: if another user
        // owns it (one who made `$TMPDIR/tpmcrypt-UID` first), say so.
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            let (reachable, _) = trust::deepest_existing(path);
            trust::check_dir_to_create_in(reachable)?;
            return Err(io_err(path, e));
        }
        Err(e) => return Err(io_err(path, e)),
    };
    trust::check_private_dir(socket_dir(path), "the agent's socket directory")?;
    if !meta.file_type().is_socket() {
        return Err(Error::Untrusted {
            path: path.to_path_buf(),
            why: "the agent's socket path is not a socket".into(),
        });
    }
    trust::check_owned(path, &meta, "the agent's socket")?;
    Ok(true)
}

fn io_err(path: &Path, e: io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        error: e,
    }
}

/// What a running agent holds (its answer to PING).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    /// Unwrapped session keys of files decrypted (each opens a session's
    /// files without the TPM).
    pub secrets: u32,
    /// Shared encryption sessions (each key opens the files of the
    /// `encrypt` runs that joined it); `None` from an agent too old to
    /// count them.
    pub sessions: Option<u32>,
}

/// A client of a running agent.
pub struct AgentClient {
    path: PathBuf,
}

impl AgentClient {
    /// A client for the agent at `path`, if one answers there: `Ok(None)`
    /// if no socket is there or nothing listens on it; an error
    /// ([`Error::Untrusted`]) if the socket, its directory or the process
    /// listening on it could belong to another user, in which case nothing
    /// was sent.
    pub fn connect(path: &Path) -> Result<Option<AgentClient>> {
        let Some(client) = AgentClient::checked(path)? else {
            return Ok(None);
        };
        match client.ping() {
            Ok(_) => Ok(Some(client)),
            Err(e) => client.failure(e).map(|()| None),
        }
    }

    /// A client for the socket at `path` once it and its directory pass
    /// the checks of [`AgentClient::connect`], without asking the agent
    /// anything yet: for a caller whose first request tells as much as a
    /// PING would (read its error with [`AgentClient::failure`]). `Ok(None)`
    /// if no socket is there.
    pub fn checked(path: &Path) -> Result<Option<AgentClient>> {
        if !check_socket(path)? {
            return Ok(None);
        }
        Ok(Some(AgentClient {
            path: path.to_path_buf(),
        }))
    }

    /// What a failed request says of the agent: [`Error::Untrusted`] if the
    /// process listening there is another user's (nothing was sent to it);
    /// an error if something listens but does not answer (a stopped or
    /// stuck agent: not "no agent", which would invite starting another);
    /// `Ok(())` if no agent is there (nothing listens on the socket).
    pub fn failure(&self, e: io::Error) -> Result<()> {
        match e.kind() {
            io::ErrorKind::PermissionDenied => Err(Error::Untrusted {
                path: self.path.clone(),
                why: e.to_string(),
            }),
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Err(io_err(
                &self.path,
                io::Error::new(e.kind(), "an agent is there but not answering"),
            )),
            _ => Ok(()),
        }
    }

    fn call(&self, request: &[u8], response_len: usize) -> io::Result<Vec<u8>> {
        let mut stream = connect_bounded(&self.path)?;
        // The peer is checked on every connection, before a byte is sent:
        // the socket may have been replaced since `connect` checked it.
        let me = trust::euid();
        match trust::peer_uid(&stream)? {
            uid if uid == me => {}
            uid => {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "the process listening on the agent's socket runs as uid {uid}, not as \
                         you (uid {me}); nothing was sent to it"
                    ),
                ))
            }
        }
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        stream.set_write_timeout(Some(IO_TIMEOUT))?;
        stream.write_all(request)?;
        stream.shutdown(std::net::Shutdown::Write)?;
        let mut out = Vec::with_capacity(response_len);
        stream.take(response_len as u64).read_to_end(&mut out)?;
        Ok(out)
    }

    /// Number of secrets held.
    pub fn ping(&self) -> io::Result<u32> {
        self.held().map(|held| held.secrets)
    }

    /// What the agent holds: its PING's answer.
    pub fn held(&self) -> io::Result<Held> {
        let r = self.call(&[VERSION, OP_PING], 9)?;
        match r.as_slice() {
            [0, a, b, c, d, rest @ ..] => Ok(Held {
                secrets: u32::from_be_bytes([*a, *b, *c, *d]),
                sessions: match rest {
                    [e, f, g, h] => Some(u32::from_be_bytes([*e, *f, *g, *h])),
                    // An agent of a build before sessions were counted.
                    [] => None,
                    _ => return Err(io::Error::other("bad agent response")),
                },
            }),
            _ => Err(io::Error::other("bad agent response")),
        }
    }

    /// The secret stored under `id`, if any.
    pub fn get(&self, id: &SecretId) -> io::Result<Option<SessionKey>> {
        let mut req = vec![VERSION, OP_GET];
        req.extend_from_slice(id);
        let mut r = self.call(&req, 33)?;
        let out = match r.as_slice() {
            [0, rest @ ..] if rest.len() == 32 => {
                let mut key = [0u8; 32];
                key.copy_from_slice(rest);
                let secret = SessionKey::from_bytes(&key);
                key.zeroize();
                Some(secret)
            }
            [1] => None,
            _ => {
                r.zeroize();
                return Err(io::Error::other("bad agent response"));
            }
        };
        r.zeroize();
        Ok(out)
    }

    /// Stores `secret` under `id`.
    pub fn put(&self, id: &SecretId, secret: &[u8; 32]) -> io::Result<()> {
        let mut req = Vec::with_capacity(66);
        req.extend_from_slice(&[VERSION, OP_PUT]);
        req.extend_from_slice(id);
        req.extend_from_slice(secret);
        let result = self.call(&req, 1);
        req.zeroize();
        match result?.as_slice() {
            [0] => Ok(()),
            _ => Err(io::Error::other("the agent refused the key")),
        }
    }

    /// The current encryption session of `scope`: its key and header.
    pub fn session_get(&self, scope: &SecretId) -> io::Result<Option<(SessionKey, Vec<u8>)>> {
        let mut req = vec![VERSION, OP_SESSION_GET];
        req.extend_from_slice(scope);
        let mut r = self.call(&req, 1 + 32 + MAX_SESSION_HEADER)?;
        let out = match r.as_slice() {
            [0, held @ ..] if held.len() > 32 => Ok(Some(held_session(held))),
            [1] => Ok(None),
            _ => Err(io::Error::other("bad agent response")),
        };
        r.zeroize();
        out
    }

    /// Hands the agent a new encryption session for `scope`.
    pub fn session_put(
        &self,
        scope: &SecretId,
        secret: &[u8; 32],
        header: &[u8],
    ) -> io::Result<()> {
        match self
            .hand_session(OP_SESSION_PUT, scope, secret, header, 1)?
            .as_slice()
        {
            [0] => Ok(()),
            _ => Err(io::Error::other("the agent refused the session")),
        }
    }

    /// Offers the agent a new encryption session for `scope`: `None` if it
    /// keeps it, or the session it already holds for `scope` (offered by
    /// another run meanwhile), for the caller to use instead.
    pub fn session_offer(
        &self,
        scope: &SecretId,
        secret: &[u8; 32],
        header: &[u8],
    ) -> io::Result<Option<(SessionKey, Vec<u8>)>> {
        let max = 1 + 32 + MAX_SESSION_HEADER;
        let mut r = self.hand_session(OP_SESSION_OFFER, scope, secret, header, max)?;
        let out = match r.as_slice() {
            [0] => Ok(None),
            [3, held @ ..] if held.len() > 32 => Ok(Some(held_session(held))),
            _ => Err(io::Error::other("the agent refused the session")),
        };
        r.zeroize();
        out
    }

    /// SESSION_PUT or SESSION_OFFER (`op`) of a session for `scope`: the
    /// agent's answer, of at most `max` bytes.
    fn hand_session(
        &self,
        op: u8,
        scope: &SecretId,
        secret: &[u8; 32],
        header: &[u8],
        max: usize,
    ) -> io::Result<Vec<u8>> {
        if header.is_empty() || header.len() > MAX_SESSION_HEADER {
            return Err(io::Error::other("session header too large for the agent"));
        }
        let mut req = Vec::with_capacity(66 + header.len());
        req.extend_from_slice(&[VERSION, op]);
        req.extend_from_slice(scope);
        req.extend_from_slice(secret);
        req.extend_from_slice(header);
        let result = self.call(&req, max);
        req.zeroize();
        result
    }

    /// Asks the agent to wipe everything and exit.
    pub fn stop(&self) -> io::Result<()> {
        match self.call(&[VERSION, OP_STOP], 1)?.as_slice() {
            [0] => Ok(()),
            _ => Err(io::Error::other("the agent did not accept STOP")),
        }
    }
}

/// A session as the agent sends it (more than 32 bytes): its key, then the
/// header that wraps it.
fn held_session(held: &[u8]) -> (SessionKey, Vec<u8>) {
    let mut key = [0u8; 32];
    key.copy_from_slice(&held[..32]);
    let secret = SessionKey::from_bytes(&key);
    key.zeroize();
    (secret, held[32..].to_vec())
}

/// A moment on the clock that counts the time the machine is suspended
/// (`CLOCK_BOOTTIME`): a TTL is wall time a key is held, and must not be
/// stretched by a laptop's sleep, as on `CLOCK_MONOTONIC` (behind
/// `std::time::Instant`), which stops while the machine is suspended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct BootTime(Duration);

impl BootTime {
    fn now() -> Self {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid timespec to fill; CLOCK_BOOTTIME exists on every
        // Linux this runs on (2.6.39 and later).
        unsafe {
            libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts);
        }
        BootTime(Duration::new(
            u64::try_from(ts.tv_sec).unwrap_or(0),
            u32::try_from(ts.tv_nsec).unwrap_or(0),
        ))
    }

    fn checked_add(self, d: Duration) -> Option<Self> {
        self.0.checked_add(d).map(BootTime)
    }

    fn saturating_add(self, d: Duration) -> Self {
        BootTime(self.0.saturating_add(d))
    }

    fn saturating_duration_since(self, earlier: BootTime) -> Duration {
        self.0.saturating_sub(earlier.0)
    }
}

/// An encryption session the agent hands to `encrypt` invocations.
struct SharedSession {
    secret: SessionKey,
    header: Vec<u8>,
    expires: BootTime,
    uses: u64,
}

/// A running agent's state.
pub struct Agent {
    listener: UnixListener,
    path: PathBuf,
    ttl: Duration,
    secrets: HashMap<SecretId, (SessionKey, BootTime)>,
    sessions: HashMap<SecretId, SharedSession>,
    /// (device, inode) of the socket as bound: only that file is removed
    /// on exit, whatever the path has come to name since. None for a
    /// socket inherited from systemd, which stays its to remove.
    inode: Option<(u64, u64)>,
    /// Where each request's fixed part (which may carry a secret) is read:
    /// allocated once, locked in memory where allowed, wiped after use.
    request: Box<[u8]>,
    /// `SOCKET.lock`, flocked for the agent's life (see [`Agent::bind`]);
    /// None for a socket inherited from systemd.
    _lock: Option<fs::File>,
}

/// Takes the lock of the agent that binds `path`: `PATH.lock` beside it
/// (in the checked, private socket directory), created 0600, never
/// through a symlink, and `flock`ed without waiting. Held, it makes the
/// look for a stale socket, its removal and the bind one step: without
/// it, an agent starting a moment after another could remove the socket
/// the other had just bound, leaving that one running out of reach.
fn agent_lock(path: &Path) -> Result<fs::File> {
    let mut name = path.as_os_str().to_os_string();
    name.push(".lock");
    let lock_path = PathBuf::from(name);
    loop {
        let file = trust::open_lock_file(&lock_path, "the agent's lock file")?;
        let meta = file.metadata().map_err(|e| io_err(&lock_path, e))?;
        trust::check_private(&lock_path, &meta, "the agent's lock file")?;
        if !trust::try_flock(&file, libc::LOCK_EX).map_err(|e| io_err(&lock_path, e))? {
            return Err(Error::AgentRunning(format!(
                "an agent is already running at {} (or starting: {} is locked)",
                path.display(),
                lock_path.display()
            )));
        }
        // Removed or replaced since it was opened here (while another
        // agent held it): locked, it would stand in the way of no agent
        // that opens the file the name now gives.
        if trust::still_names(&lock_path, &file) {
            return Ok(file);
        }
    }
}

/// A zeroed heap buffer of `len` bytes, locked in memory where the process
/// is allowed to (best effort: it is wiped after each use either way).
fn locked_buffer(len: usize) -> Box<[u8]> {
    let buf = vec![0u8; len].into_boxed_slice();
    // Counted with the session keys' locks, so that a key dropped from a
    // page this buffer shares does not unlock it. Owned by the agent for
    // its whole life: never unlocked.
    tpmcrypt_cipher::secret::lock_memory(buf.as_ptr(), len);
    buf
}

impl Agent {
    /// Binds the socket at `path` (creating its directory 0700, the socket
    /// 0600). Refuses if another agent answers there; removes a stale socket.
    pub fn bind(path: &Path, ttl: Duration) -> Result<Agent> {
        // A directory we create is 0700; the socket is made 0600 right after
        // bind (until then it has the umask's mode, which with any usual
        // umask denies others the write permission that connect needs), and
        // every peer's uid is checked. The umask is left alone: changing it
        // would race with other threads creating files.
        let dir = socket_dir(path);
        trust::create_private_dirs(dir, "the agent's socket directory")?;
        // A directory that existed already may be another user's.
        trust::check_private_dir(dir, "the agent's socket directory")?;
        let lock = agent_lock(path)?;
        if fs::symlink_metadata(path).is_ok() {
            if AgentClient::connect(path)?.is_some() {
                return Err(Error::AgentRunning(format!(
                    "an agent is already running at {}",
                    path.display()
                )));
            }
            fs::remove_file(path).map_err(|e| io_err(path, e))?;
        }
        let bound = UnixListener::bind(path);
        let listener = bound.map_err(|e| io_err(path, e))?;
        fs::set_permissions(path, fs::Permissions::from_mode(0o600))
            .map_err(|e| io_err(path, e))?;
        let bound = fs::symlink_metadata(path).map_err(|e| io_err(path, e))?;
        let inode = (bound.dev(), bound.ino());
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err(path, e))?;
        Ok(Agent {
            listener,
            path: path.to_path_buf(),
            ttl,
            secrets: HashMap::new(),
            sessions: HashMap::new(),
            inode: Some(inode),
            request: locked_buffer(REQUEST_HEAD),
            _lock: Some(lock),
        })
    }

    /// Serves until STOP or until `stop` is set (e.g. by SIGTERM); expired
    /// secrets are wiped as their time runs out. Everything is wiped and the
    /// socket removed on return.
    pub fn serve(mut self, stop: &AtomicBool) -> Result<()> {
        while !stop.load(Ordering::Relaxed) {
            self.expire();
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if self.handle(stream) {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wait_for_client(),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // Out of descriptors or memory for a while, or a client
                // gone before it was accepted: wait a little and go on
                // (outside systemd, nothing would start the agent again).
                Err(e) if is_transient(&e) => std::thread::sleep(Duration::from_millis(100)),
                Err(e) => return Err(io_err(&self.path, e)),
            }
        }
        Ok(())
    }

    /// Sleeps until a client connects, a signal arrives (poll returns
    /// EINTR, so a SIGTERM is seen at once), the next secret expires, or
    /// 250 ms pass, whichever comes first. A client is served as soon as it
    /// connects: no polling interval adds to its round trip.
    fn wait_for_client(&self) {
        use std::os::fd::AsRawFd;
        let now = BootTime::now();
        let next_expiry = self
            .secrets
            .values()
            .map(|(_, expires)| *expires)
            .chain(self.sessions.values().map(|s| s.expires))
            .map(|expires| expires.saturating_duration_since(now))
            .min()
            .unwrap_or(Duration::MAX);
        let timeout = next_expiry.min(Duration::from_millis(250));
        let mut fds = libc::pollfd {
            fd: self.listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // Round up so that a secret due in 0.4 ms is not polled for in a
        // busy loop of 0 ms waits.
        let ms = timeout.as_millis().max(1) as libc::c_int;
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe {
            libc::poll(&mut fds, 1, ms);
        }
    }

    /// Secrets currently held.
    pub fn len(&self) -> usize {
        self.secrets.len()
    }

    /// Whether no secret is held.
    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty()
    }

    fn expire(&mut self) {
        let now = BootTime::now();
        self.secrets.retain(|_, (_, expires)| *expires > now);
        self.sessions.retain(|_, s| s.expires > now);
    }

    /// Handles one connection; returns true on STOP.
    fn handle(&mut self, mut stream: UnixStream) -> bool {
        // SO_PEERCRED: only our own uid may talk to the agent.
        if !trust::peer_uid(&stream).is_ok_and(|uid| uid == trust::euid()) {
            return false;
        }
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
        let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
        // Taken out of `self` for the request (moving the box moves no
        // bytes), and put back wiped.
        let mut head = std::mem::take(&mut self.request);
        let response = match read_request(&mut stream, &mut head) {
            Ok((len, header)) => Some(self.respond(&head[..len], header)),
            Err(_) => None,
        };
        head.zeroize();
        self.request = head;
        let Some((mut response, stop)) = response else {
            return false;
        };
        let _ = stream.write_all(&response);
        response.zeroize();
        stop
    }

    /// The response to one request, and whether it was STOP.
    fn respond(&mut self, req: &[u8], header: Vec<u8>) -> (Vec<u8>, bool) {
        let mut stop = false;
        let response: Vec<u8> = match req {
            _ if !header.is_empty()
                && !matches!(req, [VERSION, OP_SESSION_PUT | OP_SESSION_OFFER, ..]) =>
            {
                vec![2]
            }
            [VERSION, OP_GET, id @ ..] if id.len() == 32 => {
                let mut key = [0u8; 32];
                key.copy_from_slice(id);
                match self.secrets.get(&key) {
                    Some((secret, _)) => {
                        let mut r = Vec::with_capacity(33);
                        r.push(0);
                        r.extend_from_slice(secret.expose());
                        r
                    }
                    None => vec![1],
                }
            }
            [VERSION, OP_PUT, rest @ ..] if rest.len() == 64 => {
                let mut id = [0u8; 32];
                id.copy_from_slice(&rest[..32]);
                let mut key = [0u8; 32];
                key.copy_from_slice(&rest[32..]);
                self.secrets
                    .insert(id, (SessionKey::from_bytes(&key), self.expiry()));
                key.zeroize();
                vec![0]
            }
            [VERSION, OP_STOP] => {
                stop = true;
                vec![0]
            }
            [VERSION, OP_SESSION_GET, scope @ ..] if scope.len() == 32 => self.session_get(scope),
            [VERSION, op @ (OP_SESSION_PUT | OP_SESSION_OFFER), rest @ ..]
                if rest.len() == 64 && !header.is_empty() && header.len() <= MAX_SESSION_HEADER =>
            {
                if *op == OP_SESSION_OFFER {
                    // One offered first, still live: that one, to the
                    // caller (SESSION_GET's answer retagged in place, so
                    // that no copy of its key is left unwiped).
                    let mut held = self.session_get(&rest[..32]);
                    if held.first() == Some(&0) {
                        held[0] = 3;
                        return (held, false);
                    }
                }
                let mut scope = [0u8; 32];
                scope.copy_from_slice(&rest[..32]);
                let mut key = [0u8; 32];
                key.copy_from_slice(&rest[32..64]);
                self.sessions.insert(
                    scope,
                    SharedSession {
                        secret: SessionKey::from_bytes(&key),
                        header,
                        expires: self.expiry(),
                        uses: 1,
                    },
                );
                key.zeroize();
                vec![0]
            }
            [VERSION, OP_PING] => {
                let mut r = vec![0u8];
                r.extend_from_slice(&(self.secrets.len() as u32).to_be_bytes());
                r.extend_from_slice(&(self.sessions.len() as u32).to_be_bytes());
                r
            }
            _ => vec![2],
        };
        (response, stop)
    }
}

/// Whether an `accept` error passes by itself.
fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::EMFILE
                | libc::ENFILE
                | libc::ENOBUFS
                | libc::ENOMEM
                | libc::ECONNABORTED
                | libc::EPROTO
        )
    )
}

/// Length of the fixed part of the longest request (SESSION_PUT):
/// version, op, id or scope, secret.
const REQUEST_HEAD: usize = 2 + 32 + 32;

/// Reads one request: its fixed part into `head`, the agent's own buffer
/// (on the heap, allocated once, locked where allowed, wiped after each
/// request), and what follows it (a session header, which is not secret;
/// at most one byte more than [`MAX_SESSION_HEADER`], so that a longer one
/// is seen and refused). Secrets are never read into a buffer that grows
/// or moves: each growth of a `Vec` frees the old copy unwiped, and each
/// move of an array leaves one on the stack, so a session key would
/// outlive its expiry. Returns the length of the fixed part read.
fn read_request(stream: &mut UnixStream, head: &mut [u8]) -> io::Result<(usize, Vec<u8>)> {
    let mut stream = WithDeadline {
        stream,
        until: std::time::Instant::now() + REQUEST_DEADLINE,
    };
    let mut len = 0;
    while len < head.len() {
        match stream.read(&mut head[len..]) {
            Ok(0) => return Ok((len, Vec::new())),
            Ok(n) => len += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let mut header = Vec::new();
    stream
        .take(MAX_SESSION_HEADER as u64 + 1)
        .read_to_end(&mut header)?;
    Ok((len, header))
}

/// The time a client has to send its whole request (a real one sends it
/// at once). The agent serves one connection at a time, so a client that
/// trickles its request, a byte before each read times out, must not hold
/// it: the others would wait, keys would outlive their TTL, and a SIGTERM
/// would wait with them.
const REQUEST_DEADLINE: Duration = Duration::from_secs(1);

/// A stream whose reads together end at `until`.
struct WithDeadline<'a> {
    stream: &'a mut UnixStream,
    until: std::time::Instant,
}

impl Read for WithDeadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self
            .until
            .saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

impl Agent {
    /// When a secret put now expires: after the TTL, or (a TTL beyond the
    /// clock's range) as late as the clock allows.
    fn expiry(&self) -> BootTime {
        let now = BootTime::now();
        now.checked_add(self.ttl)
            .unwrap_or_else(|| now.saturating_add(Duration::from_secs(366 * 24 * 3600)))
    }

    /// SESSION_GET: the session of `scope`, counted as one more use; one
    /// used [`MAX_SESSION_USES`] times is dropped so the caller makes anew.
    fn session_get(&mut self, scope: &[u8]) -> Vec<u8> {
        let mut id = [0u8; 32];
        id.copy_from_slice(scope);
        let spent = match self.sessions.get_mut(&id) {
            Some(s) if s.uses < MAX_SESSION_USES => {
                s.uses += 1;
                let mut r = Vec::with_capacity(33 + s.header.len());
                r.push(0);
                r.extend_from_slice(s.secret.expose());
                r.extend_from_slice(&s.header);
                return r;
            }
            Some(_) => true,
            None => false,
        };
        if spent {
            self.sessions.remove(&id);
        }
        vec![1]
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.secrets.clear();
        self.sessions.clear();
        let ours = fs::symlink_metadata(&self.path)
            .is_ok_and(|m| m.file_type().is_socket() && Some((m.dev(), m.ino())) == self.inode);
        if ours {
            let _ = fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// An agent bound at `path`, serving on a thread until the flag is set.
    fn serving(
        path: &Path,
        ttl: Duration,
    ) -> (Arc<AtomicBool>, std::thread::JoinHandle<Result<()>>) {
        let agent = Agent::bind(path, ttl).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        (stop, std::thread::spawn(move || agent.serve(&flag)))
    }

    /// The TTL's clock counts suspended time: it is never behind the
    /// monotonic clock (which stops during a suspend) and runs with it.
    #[test]
    fn the_ttl_clock_counts_suspended_time() {
        let mono = || {
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: a valid timespec to fill.
            unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
            Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
        };
        // A thread preempted between the two readings of a pair sees them
        // apart: three tries, one of which must agree.
        let mut seen = Vec::new();
        for _ in 0..3 {
            let (m0, b0) = (mono(), BootTime::now());
            assert!(b0.0 >= m0, "boot time {:?} behind monotonic {m0:?}", b0.0);
            std::thread::sleep(Duration::from_millis(50));
            let (m1, b1) = (mono(), BootTime::now());
            let (dm, db) = (m1 - m0, b1.saturating_duration_since(b0));
            assert!(db >= Duration::from_millis(50), "{db:?}");
            if db.abs_diff(dm) < Duration::from_millis(20) {
                return;
            }
            seen.push((db, dm));
        }
        panic!("boot time against monotonic time: {seen:?}");
    }

    #[test]
    fn put_get_expire_stop() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/agent.sock");
        // A TTL long enough that a loaded machine's stalls never expire the
        // secret before the checks that it is still there.
        let agent = Agent::bind(&path, Duration::from_secs(3)).unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dir_mode = fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dir_mode, 0o700);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let server = std::thread::spawn(move || agent.serve(&flag));

        let client = AgentClient::connect(&path).unwrap().expect("agent answers");
        assert!(
            Agent::bind(&path, Duration::from_secs(1)).is_err(),
            "second agent refused"
        );
        let id = [7u8; 32];
        assert!(client.get(&id).unwrap().is_none());
        client.put(&id, &[9u8; 32]).unwrap();
        assert_eq!(client.get(&id).unwrap().unwrap().expose(), &[9u8; 32]);
        assert_eq!(client.ping().unwrap(), 1);
        std::thread::sleep(Duration::from_millis(3200));
        assert!(client.get(&id).unwrap().is_none(), "expired");
        assert_eq!(client.ping().unwrap(), 0);

        client.put(&id, &[1u8; 32]).unwrap();
        client.stop().unwrap();
        server.join().unwrap().unwrap();
        assert!(!path.exists(), "socket removed on stop");
        assert!(AgentClient::connect(&path).unwrap().is_none());
    }

    #[test]
    fn encryption_sessions_are_shared_until_they_expire() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let (stop, server) = serving(&path, Duration::from_secs(3));
        let client = AgentClient::connect(&path).unwrap().unwrap();
        let scope = [3u8; 32];
        assert!(client.session_get(&scope).unwrap().is_none());
        let header = vec![0xAB; 3000];
        client.session_put(&scope, &[5u8; 32], &header).unwrap();
        for _ in 0..3 {
            let (key, h) = client.session_get(&scope).unwrap().expect("shared");
            assert_eq!(key.expose(), &[5u8; 32]);
            assert_eq!(h, header);
        }
        assert!(
            client.session_get(&[4u8; 32]).unwrap().is_none(),
            "other scope"
        );
        assert_eq!(client.ping().unwrap(), 0, "not a decryption secret");
        assert_eq!(
            client.held().unwrap(),
            Held {
                secrets: 0,
                sessions: Some(1)
            },
            "but a session held"
        );
        assert!(client
            .session_put(&scope, &[5u8; 32], &vec![0; MAX_SESSION_HEADER + 1])
            .is_err());
        // An offer where a session is held gets that session back and
        // changes nothing; one for a scope without a session is kept.
        let (key, h) = client
            .session_offer(&scope, &[6u8; 32], &[0xCD; 10])
            .unwrap()
            .expect("the held session");
        assert_eq!((key.expose(), &h), (&[5u8; 32], &header));
        let (key, _) = client.session_get(&scope).unwrap().unwrap();
        assert_eq!(key.expose(), &[5u8; 32], "the offer replaced nothing");
        let other = [9u8; 32];
        assert!(client
            .session_offer(&other, &[7u8; 32], &[0xEF; 10])
            .unwrap()
            .is_none());
        let (key, h) = client.session_get(&other).unwrap().unwrap();
        assert_eq!((key.expose(), h.as_slice()), (&[7u8; 32], &[0xEF; 10][..]));
        // SESSION_PUT still replaces.
        client.session_put(&other, &[8u8; 32], &[1; 10]).unwrap();
        assert_eq!(
            client.session_get(&other).unwrap().unwrap().0.expose(),
            &[8u8; 32]
        );
        std::thread::sleep(Duration::from_millis(3200));
        assert!(client.session_get(&scope).unwrap().is_none(), "expired");
        stop.store(true, Ordering::Relaxed);
        server.join().unwrap().unwrap();
    }

    /// A client that trickles its request (a byte every 300 ms) holds the
    /// agent for at most the request deadline: another client is served
    /// meanwhile (on the build before, it timed out).
    #[test]
    fn a_client_trickling_its_request_does_not_hold_the_agent() {
        use std::io::Write as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let (stop, server) = serving(&path, Duration::from_secs(60));
        let slow_path = path.clone();
        let slow = std::thread::spawn(move || {
            let mut s = UnixStream::connect(&slow_path).unwrap();
            for _ in 0..20 {
                if s.write_all(&[VERSION]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        });
        std::thread::sleep(Duration::from_millis(200));
        let start = std::time::Instant::now();
        let client = AgentClient::connect(&path).unwrap().unwrap();
        assert_eq!(client.ping().unwrap(), 0);
        assert!(
            // The request deadline is 1 s; the trickle lasts 6 s.
            start.elapsed() < Duration::from_millis(4000),
            "{:?}",
            start.elapsed()
        );
        stop.store(true, Ordering::Relaxed);
        slow.join().unwrap();
        server.join().unwrap().unwrap();
    }

    #[test]
    fn sigterm_flag_stops_and_wipes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let (stop, server) = serving(&path, Duration::from_secs(60));
        let client = AgentClient::connect(&path).unwrap().unwrap();
        client.put(&[1; 32], &[2; 32]).unwrap();
        stop.store(true, Ordering::Relaxed);
        server.join().unwrap().unwrap();
        assert!(!path.exists());
    }

    #[test]
    fn malformed_requests_get_an_error_byte() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let (stop, server) = serving(&path, Duration::from_secs(60));
        for req in [
            &[][..],
            &[1][..],
            &[9, 1][..],
            &[1, 1, 0, 0][..],
            &[1, 2, 3][..],
        ] {
            let mut s = UnixStream::connect(&path).unwrap();
            s.write_all(req).unwrap();
            s.shutdown(std::net::Shutdown::Write).unwrap();
            let mut out = Vec::new();
            s.read_to_end(&mut out).unwrap();
            assert_eq!(out, vec![2], "{req:?}");
        }
        stop.store(true, Ordering::Relaxed);
        server.join().unwrap().unwrap();
    }
}
