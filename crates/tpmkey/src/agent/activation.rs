//! Socket activation: the agent serving a listening socket the service
//! manager made and passed down (`tpmcrypt-agent.socket`, `LISTEN_FDS`).
//!
//! Such a socket is taken only if it is what the agent would have bound
//! itself: a Unix stream socket that listens, bound at the path clients
//! look for ([`super::socket_path`]), in a directory that passes the same
//! checks (the user's, 0700-like, under trusted directories), the socket
//! file the user's and not writable by others. Every connection's peer uid
//! is checked as on a socket the agent binds ([`Agent::serve`]). The socket
//! file is the service manager's: the agent never removes it.

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{io_err, locked_buffer, socket_dir, Agent, REQUEST_HEAD};
use crate::error::{Error, Result};
use crate::trust;

/// One integer socket option of `fd`.
fn sockopt(fd: &OwnedFd, name: libc::c_int) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `value` and `len` are valid out-pointers of the right size.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            name,
            (&mut value as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(value)
}

fn refused(why: impl Into<String>) -> Error {
    Error::InvalidInput(format!("the socket passed by systemd: {}", why.into()))
}

/// Whether `fd` is a listening Unix stream socket.
fn check_listener(fd: &OwnedFd) -> Result<()> {
    let opt = |name, what: &str| {
        sockopt(fd, name).map_err(|e| refused(format!("not a socket ({what}: {e})")))
    };
    if opt(libc::SO_DOMAIN, "SO_DOMAIN")? != libc::AF_UNIX {
        return Err(refused("not a Unix socket (ListenStream= takes a path)"));
    }
    if opt(libc::SO_TYPE, "SO_TYPE")? != libc::SOCK_STREAM {
        return Err(refused("not a stream socket (use ListenStream=)"));
    }
    if opt(libc::SO_ACCEPTCONN, "SO_ACCEPTCONN")? != 1 {
        return Err(refused(
            "not listening (the socket unit must have Accept=no)",
        ));
    }
    Ok(())
}

/// `path` with its directory resolved (the socket itself is not followed).
fn resolved(path: &Path) -> PathBuf {
    let dir = fs::canonicalize(socket_dir(path)).unwrap_or_else(|_| socket_dir(path).into());
    match path.file_name() {
        Some(name) => dir.join(name),
        None => dir,
    }
}

impl Agent {
    /// Serves `fd`, a listening socket inherited from the service manager,
    /// if it is bound at `expected` (where clients look) and passes the
    /// checks of the module documentation; else an error, and `fd` is
    /// closed.
    pub fn from_inherited(fd: OwnedFd, expected: &Path, ttl: Duration) -> Result<Agent> {
        check_listener(&fd)?;
        let listener = UnixListener::from(fd);
        let addr = listener
            .local_addr()
            .map_err(|e| refused(format!("no address: {e}")))?;
        let Some(path) = addr.as_pathname().map(Path::to_path_buf) else {
            return Err(refused(
                "not bound to a path (abstract or unnamed); ListenStream= takes a path",
            ));
        };
        if resolved(&path) != resolved(expected) {
            return Err(refused(format!(
                "it is bound at {}, but clients look for the agent at {} \
                 ($TPMCRYPT_AGENT_SOCK, else $XDG_RUNTIME_DIR/tpmcrypt/agent.sock): \
                 fix ListenStream= in the socket unit",
                path.display(),
                expected.display()
            )));
        }
        trust::check_private_dir(socket_dir(&path), "the agent's socket directory")?;
        let meta = fs::symlink_metadata(&path).map_err(|e| io_err(&path, e))?;
        {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(refused(format!("{} is not a socket", path.display())));
            }
        }
        trust::check_private(&path, &meta, "the agent's socket")?;
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err(&path, e))?;
        Ok(Agent {
            listener,
            path,
            ttl,
            secrets: Default::default(),
            sessions: Default::default(),
            inode: None,
            request: locked_buffer(REQUEST_HEAD),
            _lock: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn private_dir() -> (tempfile::TempDir, PathBuf) {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("run");
        fs::create_dir(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
        (base, dir)
    }

    #[test]
    fn a_listening_socket_at_the_expected_path_is_taken_and_left_in_place() {
        let (_base, dir) = private_dir();
        let path = dir.join("agent.sock");
        let listener = UnixListener::bind(&path).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        let agent =
            Agent::from_inherited(listener.into(), &path, Duration::from_secs(5)).expect("taken");
        drop(agent);
        assert!(path.exists(), "the service manager's socket is not removed");
    }

    #[test]
    fn what_the_agent_would_not_have_bound_is_refused() {
        let (_base, dir) = private_dir();
        let path = dir.join("agent.sock");
        let ttl = Duration::from_secs(5);
        // Bound elsewhere than where clients look.
        let listener = UnixListener::bind(&path).unwrap();
        let err = Agent::from_inherited(listener.into(), &dir.join("other.sock"), ttl)
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("clients look for the agent at"), "{err}");
        fs::remove_file(&path).unwrap();
        // A connected socket, not a listener.
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let err = Agent::from_inherited(a.into(), &path, ttl)
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("not listening"), "{err}");
        // A datagram socket.
        let d = std::os::unix::net::UnixDatagram::unbound().unwrap();
        let err = Agent::from_inherited(d.into(), &path, ttl)
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("not a stream socket"), "{err}");
        // A file.
        let f = fs::File::create(dir.join("file")).unwrap();
        let err = Agent::from_inherited(f.into(), &path, ttl)
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("not a socket"), "{err}");
        // A directory others may write to.
        let listener = UnixListener::bind(&path).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
        let err = Agent::from_inherited(listener.into(), &path, ttl)
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("writable by other users"), "{err}");
        // A socket file others may write to.
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
        fs::remove_file(&path).unwrap();
        let listener = UnixListener::bind(&path).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o666)).unwrap();
        let err = Agent::from_inherited(listener.into(), &path, ttl)
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("writable by other users"), "{err}");
    }
}
