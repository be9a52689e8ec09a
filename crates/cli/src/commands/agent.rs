//! `tpmcrypt agent`: holds unwrapped session keys for a bounded time so
//! that separate `decrypt` commands of one session cost one TPM operation.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use clap::Args;
use tpmcrypt_cipher::recipient::Recipient;
use tpmcrypt_cipher::{Encryptor, Params};
use tpmcrypt_tpmkey::agent::session::{self, AgentCache, SessionSource};
use tpmcrypt_tpmkey::agent::{self, Agent, AgentClient};

/// `tpmcrypt agent`.
#[derive(Args, Debug)]
pub struct AgentArgs {
    /// How long each session key is kept after it was unwrapped.
    #[arg(long, default_value = "15m", value_name = "DURATION", value_parser = crate::args::value::ttl_value)]
    pub ttl: String,
    /// Stop the running agent (it wipes every key first).
    #[arg(long)]
    pub stop: bool,
}

/// Runs the agent in the foreground, or stops a running one.
pub fn run(args: &AgentArgs) -> anyhow::Result<i32> {
    let path = agent::socket_path();
    if args.stop {
        let client = AgentClient::connect(&path)?
            .ok_or_else(|| anyhow::anyhow!("no agent is running at {}", path.display()))?;
        client.stop()?;
        stderr_line!("agent stopped");
        return Ok(crate::ui::exit::OK);
    }
    let ttl = crate::args::value::ttl(&args.ttl).map_err(crate::ui::exit::usage)?;
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGHUP,
    ] {
        signal_hook::flag::register(signal, stop.clone())?;
    }
    let (server, how) = match inherited_socket()? {
        Some(fd) => (
            Agent::from_inherited(fd, &path, ttl)?,
            " (socket from systemd)",
        ),
        None => (Agent::bind(&path, ttl)?, ""),
    };
    say(&format!(
        "tpmcrypt agent: listening on {}{how} (keys kept {})",
        path.display(),
        args.ttl
    ));
    server.serve(&stop)?;
    say("tpmcrypt agent: stopped, keys wiped");
    Ok(crate::ui::exit::OK)
}

/// A line on stderr that may find no reader (a journal restarted, a pipe
/// closed): the agent goes on, where `eprintln!` would panic.
fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The listening socket systemd passed (`LISTEN_FDS`, for this process:
/// `LISTEN_PID`), if any; the variables are removed so that no child sees
/// them. More than one socket is an error: the agent listens on one.
fn inherited_socket() -> anyhow::Result<Option<std::os::fd::OwnedFd>> {
    use std::os::fd::FromRawFd;
    let mut fds = sd_notify::listen_fds()
        .map_err(|e| anyhow::anyhow!("LISTEN_FDS/LISTEN_PID from systemd: {e}"))?;
    let Some(fd) = fds.next() else {
        return Ok(None);
    };
    if fds.next().is_some() {
        anyhow::bail!(
            "systemd passed more than one socket (LISTEN_FDS); the agent's socket unit has one \
             ListenStream="
        );
    }
    // SAFETY: sd_notify checked that the fd is open (it set FD_CLOEXEC on
    // it), and systemd passed it to this process (LISTEN_PID) for it alone.
    Ok(Some(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }))
}

fn warn_not_using(e: &tpmcrypt_tpmkey::Error) {
    say_not_using(&e.to_string());
}

/// The warning that the agent is not used, for the reason `why`.
pub(crate) fn say_not_using(why: &str) {
    stderr_line!(
        "{} not using the agent: {}",
        crate::ui::colour::warning(),
        crate::ui::printable(why)
    );
}

/// The agent's socket at the default path, if one is there and it and its
/// directory pass the ownership checks of [`AgentClient::connect`]; one
/// that fails them is named in a warning and not used. Nothing is sent
/// yet: the first request is read as a PING would be, and the process
/// listening is checked on every connection before anything is sent.
fn checked_client() -> Option<AgentClient> {
    match AgentClient::checked(&agent::socket_path()) {
        Ok(client) => client,
        Err(e) => {
            warn_not_using(&e);
            None
        }
    }
}

/// The agent (see [`checked_client`]) as the decryptor's session cache,
/// looked for at the cache's first request (see [`LazyAgent`]).
pub fn cache() -> LazyAgent<impl Fn() -> Option<AgentCache> + Send + Sync> {
    LazyAgent::new(|| checked_client().map(|c| AgentCache::new(c, Box::new(warn_not_using))))
}

/// An agent cache made by `find` at its first request. A decrypt asks
/// its in-memory identities (recovery keys) before the cache, so a run
/// that they serve never looks at the socket, never connects, and never
/// warns about a socket it would not have used.
pub struct LazyAgent<F> {
    find: F,
    agent: std::sync::OnceLock<Option<AgentCache>>,
}

impl<F: Fn() -> Option<AgentCache> + Send + Sync> LazyAgent<F> {
    /// A cache that calls `find` once, when first asked.
    pub fn new(find: F) -> Self {
        LazyAgent {
            find,
            agent: std::sync::OnceLock::new(),
        }
    }

    fn agent(&self) -> Option<&AgentCache> {
        self.agent.get_or_init(&self.find).as_ref()
    }
}

impl<F: Fn() -> Option<AgentCache> + Send + Sync> tpmcrypt_cipher::SessionCache for LazyAgent<F> {
    fn get(&self, digest: &[u8; 32]) -> Option<tpmcrypt_cipher::SessionKey> {
        self.agent()?.get(digest)
    }
    fn put(&self, digest: &[u8; 32], key: &tpmcrypt_cipher::SessionKey) {
        if let Some(agent) = self.agent() {
            agent.put(digest, key)
        }
    }
    fn used(&self, digest: &[u8; 32]) {
        // Not looked for yet: nothing of it was used.
        if let Some(Some(agent)) = self.agent.get() {
            agent.used(digest)
        }
    }
}

/// An encryptor for `recipients`, joining the agent's session when
/// `use_agent` (see [`session::encryptor`]).
pub fn encryptor(
    recipients: &[Box<dyn Recipient>],
    params: Params,
    use_agent: bool,
) -> tpmcrypt_cipher::Result<(Encryptor, SessionSource)> {
    let client = use_agent.then(checked_client).flatten();
    session::encryptor(recipients, params, client.as_ref(), &warn_not_using)
}
