//! `tpmcrypt agent`: holds unwrapped session keys for a bounded time so
//! that separate `decrypt` commands of one session cost one TPM operation.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use clap::Args;
use tpmcrypt_cipher::recipient::Recipient;
use tpmcrypt_cipher::{Encryptor, Params, SessionCache, SessionKey};
use tpmcrypt_tpmkey::agent::{self, Agent, AgentClient};

/// `tpmcrypt agent`.
#[derive(Args, Debug)]
pub struct AgentArgs {
    /// How long each session key is kept after it was unwrapped.
    #[arg(long, default_value = "15m", value_name = "DURATION", value_parser = crate::args::ttl_value)]
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
        eprintln!("agent stopped");
        return Ok(crate::exit::OK);
    }
    let ttl = agent::parse_duration(&args.ttl)?;
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGHUP,
    ] {
        signal_hook::flag::register(signal, stop.clone())?;
    }
    let server = Agent::bind(&path, ttl)?;
    eprintln!(
        "tpmcrypt agent: listening on {} (keys kept {})",
        path.display(),
        args.ttl
    );
    server.serve(&stop)?;
    eprintln!("tpmcrypt agent: stopped, keys wiped");
    Ok(crate::exit::OK)
}

/// The running agent as a session cache for the decryptor. Its first
/// request (the GET of a session key) is also what tells whether an agent
/// answers: a per-process decrypt pays one round trip to the agent when
/// the agent holds its key, not a PING first.
pub struct AgentCache {
    client: AgentClient,
    /// Set at the first failed request: the agent is not asked again.
    off: AtomicBool,
}

fn warn_not_using(e: &tpmcrypt_tpmkey::Error) {
    eprintln!(
        "warning: not using the agent: {}",
        crate::files::printable(&e.to_string())
    );
}

/// The agent's socket at the default path, if one is there and it and its
/// directory pass the ownership checks of [`AgentClient::connect`]; one
/// that fails them is named in a warning and not used. Nothing is sent
/// yet: the caller's first request is read with [`AgentClient::failure`],
/// as a PING would be, and the process listening is checked on every
/// connection before anything is sent.
fn checked_client() -> Option<AgentClient> {
    match AgentClient::checked(&agent::socket_path()) {
        Ok(client) => client,
        Err(e) => {
            warn_not_using(&e);
            None
        }
    }
}

impl AgentCache {
    /// The agent's socket, if one is there and it and its directory pass
    /// the ownership checks (else a warning, and no agent). Nothing is sent
    /// yet; the first request is checked as [`AgentClient::connect`] checks
    /// its PING, and the process listening is checked on every connection.
    pub fn connect() -> Option<AgentCache> {
        checked_client().map(|client| AgentCache {
            client,
            off: AtomicBool::new(false),
        })
    }

    /// A request failed: the agent is not asked again, and one that is
    /// another user's or does not answer is named in a warning.
    fn failed(&self, e: std::io::Error) {
        if !self.off.swap(true, Ordering::Relaxed) {
            if let Err(e) = self.client.failure(e) {
                warn_not_using(&e);
            }
        }
    }
}

/// How `encrypt` came by its session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionSource {
    /// A session of its own (no agent, or --new-session).
    Own,
    /// A new session, handed to the agent for the next invocations.
    Started,
    /// The agent's current session for the same recipients and parameters.
    Joined,
}

impl SessionSource {
    /// For `--stats-json`.
    pub fn token(self) -> &'static str {
        match self {
            SessionSource::Own => "own",
            SessionSource::Started => "started",
            SessionSource::Joined => "joined",
        }
    }

    /// For the -v summary.
    pub fn describe(self) -> &'static str {
        match self {
            SessionSource::Own => "a session of its own",
            SessionSource::Started => "a new session, shared through the agent",
            SessionSource::Joined => "the agent's current session",
        }
    }
}

/// The scope under which the agent keeps an encryption session: the
/// recipients (kind and fingerprint, in order) and the parameters.
fn session_scope(recipients: &[Box<dyn Recipient>], params: &Params) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"tpmcrypt/v1/encrypt-scope");
    h.update([params.mode as u8, params.key_len as u8]);
    h.update(params.segment_size.to_be_bytes());
    for r in recipients {
        h.update([r.kind()]);
        h.update(r.fingerprint());
    }
    h.finalize().into()
}

/// An encryptor for `recipients`: the agent's current session for them if
/// an agent runs (so that files of many invocations decrypt with one
/// unwrap), else a new session, which is then handed to the agent.
pub fn encryptor(
    recipients: &[Box<dyn Recipient>],
    params: Params,
    use_agent: bool,
) -> tpmcrypt_cipher::Result<(Encryptor, SessionSource)> {
    let own = || Ok((Encryptor::new(recipients, params)?, SessionSource::Own));
    let Some(client) = use_agent.then(checked_client).flatten() else {
        return own();
    };
    let scope = session_scope(recipients, &params);
    match client.session_get(&scope) {
        Ok(Some((secret, header))) => {
            let key = SessionKey::from_bytes(secret.expose());
            // A session that does not check out (other recipients, a header
            // the key does not authenticate) is not used: a new one
            // replaces it.
            if let Ok(e) = Encryptor::resume(&header, key, params, recipients) {
                return Ok((e, SessionSource::Joined));
            }
        }
        Ok(None) => {}
        // No agent answers there (or another user's, or a silent one,
        // named in a warning): a session of its own, nothing handed over.
        Err(e) => {
            if let Err(e) = client.failure(e) {
                warn_not_using(&e);
            }
            return own();
        }
    }
    let encryptor = Encryptor::new(recipients, params)?;
    let source =
        match client.session_put(&scope, encryptor.session_key().expose(), encryptor.header()) {
            Ok(()) => SessionSource::Started,
            Err(_) => SessionSource::Own,
        };
    Ok((encryptor, source))
}

impl SessionCache for AgentCache {
    fn get(&self, stanza_digest: &[u8; 32]) -> Option<SessionKey> {
        if self.off.load(Ordering::Relaxed) {
            return None;
        }
        match self.client.get(stanza_digest) {
            Ok(secret) => secret.map(|s| SessionKey::from_bytes(s.expose())),
            Err(e) => {
                self.failed(e);
                None
            }
        }
    }

    fn put(&self, stanza_digest: &[u8; 32], key: &SessionKey) {
        // Best effort: the agent is a cache, decryption goes on without it.
        if !self.off.load(Ordering::Relaxed) {
            if let Err(e) = self.client.put(stanza_digest, key.expose()) {
                self.failed(e);
            }
        }
    }
}
