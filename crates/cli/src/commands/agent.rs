//! `tpmcrypt agent`: holds unwrapped session keys for a bounded time so
//! that separate `decrypt` commands of one session cost one TPM operation.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use clap::Args;
use tpmcrypt_cipher::{SessionCache, SessionKey};
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

/// The running agent as a session cache for the decryptor.
pub struct AgentCache(AgentClient);

impl AgentCache {
    /// The agent at the default socket, if one is running and passes the
    /// ownership checks of [`AgentClient::connect`]. One that fails them
    /// is named in a warning and not used: nothing is sent to it.
    pub fn connect() -> Option<AgentCache> {
        match AgentClient::connect(&agent::socket_path()) {
            Ok(client) => client.map(AgentCache),
            Err(e) => {
                eprintln!(
                    "warning: not using the agent: {}",
                    crate::files::printable(&e.to_string())
                );
                None
            }
        }
    }
}

impl SessionCache for AgentCache {
    fn get(&self, stanza_digest: &[u8; 32]) -> Option<SessionKey> {
        let secret = self.0.get(stanza_digest).ok().flatten()?;
        Some(SessionKey::from_bytes(secret.expose()))
    }

    fn put(&self, stanza_digest: &[u8; 32], key: &SessionKey) {
        // Best effort: the agent is a cache, decryption goes on without it.
        let _ = self.0.put(stanza_digest, key.expose());
    }
}
