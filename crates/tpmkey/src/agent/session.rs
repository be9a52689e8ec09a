//! The agent as a session cache: for decryption (unwrapped session keys,
//! so many files and many processes cost one unwrap) and for encryption
//! (one shared session, so files encrypted by many invocations decrypt
//! with one unwrap). The keys travel as the cipher's [`SessionKey`]:
//! locked in memory and wiped when dropped, here and in the agent.

use tpmcrypt_cipher::recipient::Recipient;
use tpmcrypt_cipher::{Encryptor, Params, SessionCache, SessionKey};

use super::AgentClient;

/// A running agent as the decryptor's [`SessionCache`].
pub struct AgentCache(AgentClient);

impl AgentCache {
    /// The agent behind `client` (checked by [`AgentClient::connect`]).
    pub fn new(client: AgentClient) -> AgentCache {
        AgentCache(client)
    }
}

impl SessionCache for AgentCache {
    fn get(&self, stanza_digest: &[u8; 32]) -> Option<SessionKey> {
        self.0.get(stanza_digest).ok().flatten()
    }

    fn put(&self, stanza_digest: &[u8; 32], key: &SessionKey) {
        // Best effort: the agent is a cache, decryption goes on without it.
        let _ = self.0.put(stanza_digest, key.expose());
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
/// unwrap), else a new session, which is then handed to the agent.
pub fn encryptor(
    recipients: &[Box<dyn Recipient>],
    params: Params,
    agent: Option<&AgentClient>,
) -> tpmcrypt_cipher::Result<(Encryptor, SessionSource)> {
    let Some(client) = agent else {
        return Ok((Encryptor::new(recipients, params)?, SessionSource::Own));
    };
    let scope = session_scope(recipients, &params);
    if let Ok(Some((key, header))) = client.session_get(&scope) {
        // A session that does not check out (other recipients, a header
        // the key does not authenticate) is not used: a new one replaces it.
        if let Ok(e) = Encryptor::resume(&header, key, params, recipients) {
            return Ok((e, SessionSource::Joined));
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
