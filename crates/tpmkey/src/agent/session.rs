//! The agent as a session cache: for decryption (unwrapped session keys,
//! so many files and many processes cost one unwrap) and for encryption
//! (one shared session, so files encrypted by many invocations decrypt
//! with one unwrap). The keys travel as the cipher's [`SessionKey`]:
//! locked in memory and wiped when dropped, here and in the agent.

use std::sync::atomic::{AtomicBool, Ordering};

use tpmcrypt_cipher::recipient::Recipient;
use tpmcrypt_cipher::{Encryptor, Params, SessionCache, SessionKey};

use super::AgentClient;

/// Called with what a failed request said of the agent (another user's
/// listener, a stuck agent), for the caller to warn about.
pub type OnFailure = Box<dyn Fn(&crate::Error) + Send + Sync>;

/// A running agent as the decryptor's [`SessionCache`]. Its first request
/// (the GET of a session key) is also what tells whether an agent answers:
/// a per-process decrypt pays one round trip when the agent holds its key,
/// not a PING first. After a failed request the agent is not asked again.
pub struct AgentCache {
    client: AgentClient,
    /// Set at the first failed request.
    off: AtomicBool,
    on_failure: OnFailure,
}

impl AgentCache {
    /// The agent behind `client` (from [`AgentClient::checked`] or
    /// [`AgentClient::connect`]); `on_failure` hears of a failed request
    /// that means more than "no agent there", once.
    pub fn new(client: AgentClient, on_failure: OnFailure) -> AgentCache {
        AgentCache {
            client,
            off: AtomicBool::new(false),
            on_failure,
        }
    }

    fn failed(&self, e: std::io::Error) {
        if !self.off.swap(true, Ordering::Relaxed) {
            if let Err(e) = self.client.failure(e) {
                (self.on_failure)(&e);
            }
        }
    }
}

impl SessionCache for AgentCache {
    fn get(&self, stanza_digest: &[u8; 32]) -> Option<SessionKey> {
        if self.off.load(Ordering::Relaxed) {
            return None;
        }
        match self.client.get(stanza_digest) {
            Ok(secret) => secret,
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

/// How an encryptor came by its session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionSource {
    /// A session of its own (no agent, or a new session was asked for).
    Own,
    /// A new session, handed to the agent for the next invocations.
    Started,
    /// The agent's current session for the same recipients and parameters.
    Joined,
}

impl SessionSource {
    /// A short token (`own`, `started`, `joined`) for machine output.
    pub fn token(self) -> &'static str {
        match self {
            SessionSource::Own => "own",
            SessionSource::Started => "started",
            SessionSource::Joined => "joined",
        }
    }

    /// A phrase for people.
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
/// `agent` is given (so that files of many invocations decrypt with one
/// unwrap), else a new session, which is then handed to the agent. The
/// first request tells whether an agent answers (no PING first);
/// `on_failure` hears what a failed one said of the agent.
pub fn encryptor(
    recipients: &[Box<dyn Recipient>],
    params: Params,
    agent: Option<&AgentClient>,
    on_failure: &dyn Fn(&crate::Error),
) -> tpmcrypt_cipher::Result<(Encryptor, SessionSource)> {
    let own = || Ok((Encryptor::new(recipients, params)?, SessionSource::Own));
    let Some(client) = agent else {
        return own();
    };
    let scope = session_scope(recipients, &params);
    let mut replace = false;
    match client.session_get(&scope) {
        Ok(Some((key, header))) => {
            // A session that does not check out (other recipients, a header
            // the key does not authenticate) is not used: a new one
            // replaces it.
            if let Ok(e) = Encryptor::resume(&header, key, params, recipients) {
                return Ok((e, SessionSource::Joined));
            }
            replace = true;
        }
        Ok(None) => {}
        // No agent answers there (or another user's, or a silent one): a
        // session of its own, nothing handed over.
        Err(e) => {
            if let Err(e) = client.failure(e) {
                on_failure(&e);
            }
            return own();
        }
    }
    let encryptor = Encryptor::new(recipients, params)?;
    let (key, header) = (encryptor.session_key().expose(), encryptor.header());
    if replace {
        let source = match client.session_put(&scope, key, header) {
            Ok(()) => SessionSource::Started,
            Err(_) => SessionSource::Own,
        };
        return Ok((encryptor, source));
    }
    // Offered, not put: a run that offered one first, between our
    // SESSION_GET and now, keeps its session, and this run joins it.
    match client.session_offer(&scope, key, header) {
        Ok(None) => Ok((encryptor, SessionSource::Started)),
        Ok(Some((key, header))) => match Encryptor::resume(&header, key, params, recipients) {
            Ok(e) => Ok((e, SessionSource::Joined)),
            Err(_) => Ok((encryptor, SessionSource::Own)),
        },
        Err(_) => Ok((encryptor, SessionSource::Own)),
    }
}
