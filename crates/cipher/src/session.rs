//! Sessions: one random session key wrapped once per recipient, shared by
//! every file encrypted in the session; per-file keys derived with HKDF from
//! a random per-file salt. Decryptors cache unwrapped session keys by the
//! hash of their wrapped form, so N files of one session cost one unwrap
//! (one TPM operation).

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hmac::{Hmac, Mac};
use rand_core::{CryptoRngCore, OsRng};
use subtle::ConstantTimeEq;
use zeroize::Zeroizing;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::format::{Header, Params, HEADER_MAC_LEN};
use crate::io::{StreamReader, StreamWriter};
use crate::recipient::{Identity, Recipient};
use crate::secret::SessionKey;
use crate::stream::{
    self, timed, Direction, FileKeys, Layout, Step, StreamOptions, Timings, NONCE_PREFIX_LEN,
};

const HEADER_MAC_INFO: &[u8] = b"tpmcrypt/v1/header-mac";

/// HMAC-SHA256 over the unsigned header under a key derived from the
/// session key; the one definition of the header MAC.
fn header_mac(session_key: &SessionKey, unsigned: &[u8]) -> Result<[u8; HEADER_MAC_LEN]> {
    let mut key = Zeroizing::new([0u8; 32]);
    hkdf::Hkdf::<sha2::Sha256>::new(None, session_key.expose())
        .expand(HEADER_MAC_INFO, &mut key[..])
        .map_err(|_| Error::Backend("hkdf".into()))?;
    let mut mac = <Hmac<sha2::Sha256> as Mac>::new_from_slice(&key[..])
        .map_err(|_| Error::Backend("hmac".into()))?;
    mac.update(unsigned);
    Ok(mac.finalize().into_bytes().into())
}

/// Encrypts any number of files in one session.
pub struct Encryptor {
    layout: Layout,
    backend: Arc<dyn Backend>,
    session_key: SessionKey,
    header: Vec<u8>,
}

impl Encryptor {
    /// Starts a session: draws a session key and wraps it to every recipient.
    /// Each recipient wraps with [`Recipient::wrap_with_os_rng`].
    pub fn new(recipients: &[Box<dyn Recipient>], params: Params) -> Result<Self> {
        let session_key = SessionKey::generate(&mut OsRng);
        let stanzas = recipients
            .iter()
            .map(|r| r.wrap_with_os_rng(&session_key))
            .collect::<Result<Vec<_>>>()?;
        Self::from_stanzas(params, session_key, &stanzas)
    }

    /// As [`Encryptor::new`] with a caller-supplied RNG (tests use a seeded
    /// one to compare backends byte for byte).
    pub fn with_rng(
        recipients: &[Box<dyn Recipient>],
        params: Params,
        rng: &mut dyn CryptoRngCore,
    ) -> Result<Self> {
        let session_key = SessionKey::generate(rng);
        Self::with_session_key(recipients, params, session_key, rng)
    }

    /// As [`Encryptor::new`] with a given session key.
    pub fn with_session_key(
        recipients: &[Box<dyn Recipient>],
        params: Params,
        session_key: SessionKey,
        rng: &mut dyn CryptoRngCore,
    ) -> Result<Self> {
        let stanzas = recipients
            .iter()
            .map(|r| r.wrap(&session_key, rng))
            .collect::<Result<Vec<_>>>()?;
        Self::from_stanzas(params, session_key, &stanzas)
    }

    /// A session of `session_key`, wrapped in `stanzas`.
    fn from_stanzas(
        params: Params,
        session_key: SessionKey,
        stanzas: &[crate::format::Stanza],
    ) -> Result<Self> {
        let layout = Layout::new(&params)?;
        let mut header = Header::encode_unsigned(&params, stanzas)?;
        let mac = header_mac(&session_key, &header)?;
        header.extend_from_slice(&mac);
        Ok(Encryptor {
            layout,
            backend: params.default_backend(),
            session_key,
            header,
        })
    }

    /// Joins a session that already exists (another process's, kept by
    /// the agent): its header and its session key. The header must parse,
    /// carry `params`, be addressed to exactly `recipients` (kinds and
    /// fingerprints, in order) and be authenticated by `session_key`; files
    /// written then share the header, so decrypting all of them costs one
    /// unwrap.
    pub fn resume(
        header: &[u8],
        session_key: SessionKey,
        params: Params,
        recipients: &[Box<dyn Recipient>],
    ) -> Result<Self> {
        let parsed = Header::read_from(&mut &header[..])?;
        let addressed = parsed
            .stanzas
            .iter()
            .map(|s| (s.kind, s.fingerprint().map(<[u8]>::to_vec)));
        let wanted = recipients
            .iter()
            .map(|r| (r.kind(), Some(r.fingerprint().to_vec())));
        if !addressed.eq(wanted) {
            return Err(Error::InvalidParams(
                "the session is addressed to other recipients".into(),
            ));
        }
        if parsed.raw().len() != header.len() {
            return Err(Error::MalformedHeader(
                "trailing bytes after a session's header".into(),
            ));
        }
        if parsed.params != params {
            return Err(Error::InvalidParams(
                "the session's parameters differ from the ones asked for".into(),
            ));
        }
        verify_header(&parsed, &session_key)?;
        Ok(Encryptor {
            layout: Layout::new(&params)?,
            backend: params.default_backend(),
            session_key,
            header: header.to_vec(),
        })
    }

    /// The session key (to hand the session to an agent, which keeps it in
    /// locked memory for other processes of the same user).
    pub fn session_key(&self) -> &SessionKey {
        &self.session_key
    }

    /// Uses `backend` instead of the default.
    pub fn with_backend(mut self, backend: Arc<dyn Backend>) -> Self {
        self.backend = backend;
        self
    }

    /// The backend in use.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The header every file of this session starts with.
    pub fn header(&self) -> &[u8] {
        &self.header
    }

    /// The payload layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// A decryptor that already holds this session's key, so a writer can
    /// verify its own ciphertext without any identity (or TPM) before it
    /// deletes a plaintext.
    pub fn verifier(&self) -> Result<Decryptor> {
        let header = Header::read_from(&mut &self.header[..])?;
        let decryptor = Decryptor::new(Vec::new()).with_backend(self.backend.clone());
        decryptor.insert_session_key(&header, SessionKey::from_bytes(self.session_key.expose()))?;
        Ok(decryptor)
    }

    /// Encrypts one file with a fresh random salt and nonce prefix.
    pub fn encrypt<R: Read, W: Write + Send>(
        &self,
        input: R,
        output: W,
        opts: &StreamOptions<'_>,
    ) -> Result<u64> {
        self.encrypt_with_rng(input, output, opts, &mut OsRng)
    }

    /// As [`Encryptor::encrypt`] with a caller-supplied RNG.
    pub fn encrypt_with_rng<R: Read, W: Write + Send>(
        &self,
        mut input: R,
        mut output: W,
        opts: &StreamOptions<'_>,
        rng: &mut dyn CryptoRngCore,
    ) -> Result<u64> {
        let keys = self.begin_file(&mut output, rng, opts.timings)?;
        let n = stream::run(
            Direction::Seal,
            &self.backend,
            &keys,
            &mut input,
            &mut output,
            opts,
        )?;
        timed(opts.timings, Step::Write, || output.flush())?;
        Ok(n)
    }

    /// Encrypts the rest of `file`. For a regular file the workers read
    /// their segments themselves (positional reads in parallel); anything
    /// else (a pipe) is streamed.
    pub fn encrypt_file<W: Write + Send>(
        &self,
        file: &File,
        mut output: W,
        opts: &StreamOptions<'_>,
    ) -> Result<u64> {
        let Some((start, end)) = regular_region(file)? else {
            return self.encrypt(file, output, opts);
        };
        let keys = self.begin_file(&mut output, &mut OsRng, opts.timings)?;
        let n = stream::run_file(
            Direction::Seal,
            &self.backend,
            &keys,
            file,
            start,
            end,
            &mut output,
            opts,
        )?;
        ends_at(file, end)?;
        timed(opts.timings, Step::Write, || output.flush())?;
        Ok(n)
    }

    /// A `Write` that encrypts one file onto `output`, sequentially and in
    /// constant memory; the header is written now. Call
    /// [`StreamWriter::finish`] at the end.
    ///
    /// ```
    /// use std::io::{Read, Write};
    /// use tpmcrypt_cipher::recovery::RecoveryKey;
    /// use tpmcrypt_cipher::{Decryptor, Encryptor, Mode, Params, Recipient};
    ///
    /// let key = RecoveryKey::generate(&mut rand_core::OsRng);
    /// let to: Vec<Box<dyn Recipient>> = vec![Box::new(key.recipient()?)];
    /// let encryptor = Encryptor::new(&to, Params::new(Mode::Gcm, 256)?)?;
    /// let mut writer = encryptor.wrap_output(Vec::new())?;
    /// writer.write_all(b"written in ")?;
    /// writer.write_all(b"pieces")?;
    /// let file = writer.finish()?;
    ///
    /// let decryptor = Decryptor::new(vec![Box::new(key.into_identity()?)]);
    /// let mut plain = String::new();
    /// decryptor.unwrap_input(&file[..])?.read_to_string(&mut plain)?;
    /// assert_eq!(plain, "written in pieces");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn wrap_output<W: Write>(&self, output: W) -> Result<StreamWriter<W>> {
        self.wrap_output_with_rng(output, &mut OsRng)
    }

    /// As [`Encryptor::wrap_output`] with a caller-supplied RNG.
    pub fn wrap_output_with_rng<W: Write>(
        &self,
        mut output: W,
        rng: &mut dyn CryptoRngCore,
    ) -> Result<StreamWriter<W>> {
        let keys = self.begin_file(&mut output, rng, None)?;
        let crypter = keys.crypter(&self.backend)?;
        Ok(StreamWriter::new(output, crypter))
    }

    /// Draws the per-file salt and nonce prefix, writes the header and the
    /// stream header, and derives the file key.
    fn begin_file<W: Write>(
        &self,
        output: &mut W,
        rng: &mut dyn CryptoRngCore,
        timings: Option<&Timings>,
    ) -> Result<FileKeys> {
        let key_len = self.layout.key_len;
        let mut stream_header = vec![0u8; self.layout.stream_header_len()];
        stream_header[0] = stream_header.len() as u8;
        rng.fill_bytes(&mut stream_header[1..]);
        let (salt, prefix) = stream_header[1..].split_at(key_len);
        let mut nonce_prefix = [0u8; NONCE_PREFIX_LEN];
        nonce_prefix.copy_from_slice(prefix);
        let keys = FileKeys::derive(
            self.backend.as_ref(),
            self.layout,
            self.session_key.expose(),
            salt,
            &self.header,
            nonce_prefix,
        )?;
        timed(timings, Step::Write, || {
            output.write_all(&self.header)?;
            output.write_all(&stream_header)
        })?;
        Ok(keys)
    }
}

/// `(position, end)` of a regular file whose size can be trusted, to be
/// read with positional reads; None for what is to be read to its end
/// instead: pipes and devices, and files whose size is not their length.
/// A size is trusted when it is not 0 (procfs, and FUSE file systems
/// such as lxcfs, show generated files as empty) and the file system is
/// not one whose files are generated when read (procfs, sysfs, …, where
/// sysfs shows 4096 for any file). What a trusted size missed is caught
/// afterwards by [`ends_at`].
fn regular_region(file: &File) -> Result<Option<(u64, u64)>> {
    let meta = file.metadata()?;
    if !meta.is_file() || meta.len() == 0 || generated_when_read(file) {
        return Ok(None);
    }
    let mut f = file;
    let pos = f.stream_position()?;
    Ok(Some((pos, meta.len().max(pos))))
}

/// Whether `file` lives on a file system whose files are made when read,
/// with a size that says nothing of their length. Unknown: assumed not
/// (the check after the read still holds).
fn generated_when_read(file: &File) -> bool {
    use std::os::fd::AsRawFd;
    // statfs(2) f_type values (linux/magic.h).
    const GENERATED: [u32; 11] = [
        0x9fa0,      // proc
        0x6265_6572, // sysfs
        0x6462_6720, // debugfs
        0x7472_6163, // tracefs
        0x7363_6673, // securityfs
        0x6265_6570, // configfs
        0x0027_e0eb, // cgroup
        0x6367_7270, // cgroup2
        0xde5e_81e4, // efivarfs
        0x6165_676c, // pstore
        0xcafe_4a11, // bpf
    ];
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: a valid open fd and a buffer of the right type for fstatfs.
    let rc = unsafe { libc::fstatfs(file.as_raw_fd(), st.as_mut_ptr()) };
    if rc != 0 {
        return false;
    }
    // SAFETY: fstatfs succeeded, so it filled the buffer.
    let f_type = unsafe { st.assume_init() }.f_type as u32;
    GENERATED.contains(&f_type)
}

/// Checks that nothing follows `end` in `file`: a file read by its size
/// that holds more (it grew, or its file system reports a size short of
/// its length) would otherwise be taken for a shorter one.
fn ends_at(file: &File, end: u64) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let mut probe = [0u8; 1];
    loop {
        match file.read_at(&mut probe, end) {
            Ok(0) => return Ok(()),
            Ok(_) => {
                return Err(Error::Io(std::io::Error::other(
                    "the input is longer than its size said (it grew while it was read, or its file system reports a wrong size)",
                )))
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// A session-key cache that outlives one process (the agent): asked
/// after the identities whose key is in memory ([`Identity::in_memory`])
/// and before the others, told about every key one of the others
/// unwrapped.
pub trait SessionCache: Send + Sync {
    /// The key cached under `stanza_digest`, if any.
    fn get(&self, stanza_digest: &[u8; 32]) -> Option<SessionKey>;
    /// Offers a key unwrapped by an identity not in memory (a TPM's).
    fn put(&self, stanza_digest: &[u8; 32], key: &SessionKey);
    /// A key [`Decryptor::prefetch`] found (through this cache or an
    /// identity) is now used by the run. Nothing by default.
    fn used(&self, _stanza_digest: &[u8; 32]) {}
}

/// Decrypts files with a set of identities, caching session keys.
pub struct Decryptor {
    identities: Vec<Box<dyn Identity>>,
    cache: Mutex<HashMap<[u8; 32], Arc<SessionKey>>>,
    external: Option<Box<dyn SessionCache>>,
    unwraps: AtomicU64,
    /// Nanoseconds spent getting session keys not held yet.
    fetch_ns: AtomicU64,
    backend: Option<Arc<dyn Backend>>,
    /// Keys found by [`Decryptor::prefetch`] and not used yet.
    prefetched: Mutex<HashMap<[u8; 32], Prefetched>>,
}

/// A session key [`Decryptor::prefetch`] found, with what using it counts.
struct Prefetched {
    key: SessionKey,
    from: Found,
    /// Nanoseconds it took.
    ns: u64,
}

/// Where a session key not held yet came from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Found {
    /// The external session cache (nothing unwrapped).
    Cache,
    /// Unwrapped by an identity whose key is in memory: counted, not
    /// offered to the session cache (it costs microseconds to unwrap again,
    /// and a cache that lacks it is not asked for it).
    InMemory,
    /// Unwrapped by another identity (a TPM's): counted, and offered.
    Identity,
}

impl Decryptor {
    /// A decryptor trying `identities` in order.
    pub fn new(identities: Vec<Box<dyn Identity>>) -> Self {
        Decryptor {
            identities,
            cache: Mutex::new(HashMap::new()),
            external: None,
            unwraps: AtomicU64::new(0),
            fetch_ns: AtomicU64::new(0),
            backend: None,
            prefetched: Mutex::new(HashMap::new()),
        }
    }

    /// Forces a backend (default: [`Params::default_backend`] of the file).
    pub fn with_backend(mut self, backend: Arc<dyn Backend>) -> Self {
        self.backend = Some(backend);
        self
    }

    /// Consults `cache` before the identities and feeds it what they unwrap.
    pub fn with_session_cache(mut self, cache: Box<dyn SessionCache>) -> Self {
        self.external = Some(cache);
        self
    }

    /// How many session keys were unwrapped (identity operations performed).
    pub fn unwrap_count(&self) -> u64 {
        self.unwraps.load(Ordering::Relaxed)
    }

    /// Time spent getting session keys this decryptor did not hold yet:
    /// asking the session cache and unwrapping (a TPM's unbind included).
    pub fn unwrap_time(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.fetch_ns.load(Ordering::Relaxed))
    }

    /// Seeds the cache with a session key obtained elsewhere (an agent).
    /// The key is checked against the header MAC before it is used.
    pub fn insert_session_key(&self, header: &Header, key: SessionKey) -> Result<()> {
        verify_header(header, &key)?;
        self.lock_cache()
            .insert(header.stanza_digest(), Arc::new(key));
        Ok(())
    }

    /// Whether the session key of `header` is cached already.
    pub fn has_session_key(&self, header: &Header) -> bool {
        self.lock_cache().contains_key(&header.stanza_digest())
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Arc<SessionKey>>> {
        // A poisoned lock only means another thread panicked mid-insert; the
        // map itself is still consistent.
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The session key of `header`, from the cache or by unwrapping a stanza
    /// (at most once per session), verified against the header MAC.
    pub fn session_key(&self, header: &Header) -> Result<Arc<SessionKey>> {
        let digest = header.stanza_digest();
        let mut cache = self.lock_cache();
        if let Some(key) = cache.get(&digest) {
            verify_header(header, key)?;
            return Ok(key.clone());
        }
        let start = std::time::Instant::now();
        let fetched = self.fetch_session_key(header, &digest);
        let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.fetch_ns.fetch_add(ns, Ordering::Relaxed);
        let key = Arc::new(fetched?);
        cache.insert(digest, key.clone());
        Ok(key)
    }

    /// Finds the session key of `header` now, from the session cache or
    /// by unwrapping a stanza, and keeps it aside: it is counted, timed and
    /// offered to the session cache only when [`Decryptor::session_key`]
    /// first needs it, so a run that fails before then (its output exists,
    /// say) has the effects of one that never looked. Tells a caller,
    /// before any work, whether this decryptor can open the file.
    pub fn prefetch(&self, header: &Header) -> Result<()> {
        let digest = header.stanza_digest();
        if self.lock_cache().contains_key(&digest) {
            return Ok(());
        }
        let start = std::time::Instant::now();
        let (key, from) = self.find_session_key(header, &digest)?;
        let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.prefetched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(digest, Prefetched { key, from, ns });
        Ok(())
    }

    /// A session key not held yet: one [`Decryptor::prefetch`] found, or
    /// found now (see [`Decryptor::find_session_key`]). One an identity
    /// unwrapped is counted; one a TPM's unwrapped is offered to the
    /// external cache.
    fn fetch_session_key(&self, header: &Header, digest: &[u8; 32]) -> Result<SessionKey> {
        let prefetched = self
            .prefetched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(digest);
        let (key, from) = match prefetched {
            Some(p) => {
                self.fetch_ns.fetch_add(p.ns, Ordering::Relaxed);
                if let Some(external) = &self.external {
                    external.used(digest);
                }
                (p.key, p.from)
            }
            None => self.find_session_key(header, digest)?,
        };
        if from != Found::Cache {
            self.unwraps.fetch_add(1, Ordering::Relaxed);
        }
        if let (Some(external), Found::Identity) = (&self.external, from) {
            external.put(digest, &key);
        }
        Ok(key)
    }

    /// The session key, checked against the header MAC: unwrapped by an
    /// identity whose key is in memory, else from the external cache, else
    /// unwrapped by another identity. An identity in memory is never slower
    /// than a round trip to the cache, and a cache that lacks the key is
    /// then not asked at all.
    fn find_session_key(&self, header: &Header, digest: &[u8; 32]) -> Result<(SessionKey, Found)> {
        let mut first_err = None;
        if let Some(key) = self.unwrap_with(header, true, &mut first_err) {
            return Ok((key, Found::InMemory));
        }
        if let Some(key) = self.external.as_ref().and_then(|c| c.get(digest)) {
            // A key that fails the MAC is ignored: the identities decide.
            if verify_header(header, &key).is_ok() {
                return Ok((key, Found::Cache));
            }
        }
        match self.unwrap_with(header, false, &mut first_err) {
            Some(key) => Ok((key, Found::Identity)),
            None => Err(first_err.unwrap_or(Error::NoMatchingIdentity)),
        }
    }

    /// The key of the first of the identities with [`Identity::in_memory`]
    /// equal to `in_memory` that opens a stanza of `header` with a key the
    /// header MAC accepts, in the order given (explicit ones, e.g. a
    /// recovery key, before TPM keys), each against every stanza. A stanza
    /// one identity cannot open (a TPM that refuses: PCRs changed, PIN,
    /// lockout), or whose key the header MAC refuses (a sender who wrapped
    /// different keys for different recipients), does not stop the others;
    /// the first such error is kept in `first_err`, reported only if none
    /// succeeds.
    fn unwrap_with(
        &self,
        header: &Header,
        in_memory: bool,
        first_err: &mut Option<Error>,
    ) -> Option<SessionKey> {
        for identity in self
            .identities
            .iter()
            .filter(|i| i.in_memory() == in_memory)
        {
            for stanza in &header.stanzas {
                let verified = identity.unwrap(stanza).and_then(|key| match key {
                    Some(key) => verify_header(header, &key).map(|()| Some(key)),
                    None => Ok(None),
                });
                match verified {
                    Ok(Some(key)) => return Some(key),
                    Ok(None) => {}
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
        None
    }

    /// A `Read` that decrypts the file read from `input`, sequentially and
    /// in constant memory. The header is read and the session key found
    /// now; each segment is authenticated before any of its bytes is
    /// returned (see [`crate::io`] for the errors). Example: see
    /// [`Encryptor::wrap_output`].
    pub fn unwrap_input<R: Read>(&self, mut input: R) -> Result<StreamReader<R>> {
        let header = Header::read_from(&mut input)?;
        let (backend, keys) = self.begin_payload(&header, &mut input, None)?;
        let crypter = keys.crypter(&backend)?;
        Ok(StreamReader::new(input, crypter))
    }

    /// Decrypts one file: header, then payload.
    pub fn decrypt<R: Read, W: Write + Send>(
        &self,
        mut input: R,
        output: W,
        opts: &StreamOptions<'_>,
    ) -> Result<u64> {
        let header = timed(opts.timings, Step::Read, || Header::read_from(&mut input))?;
        self.decrypt_payload(&header, input, output, opts)
    }

    /// Decrypts the payload that follows an already-read `header`.
    pub fn decrypt_payload<R: Read, W: Write + Send>(
        &self,
        header: &Header,
        mut input: R,
        mut output: W,
        opts: &StreamOptions<'_>,
    ) -> Result<u64> {
        let (backend, keys) = self.begin_payload(header, &mut input, opts.timings)?;
        let n = stream::run(
            Direction::Open,
            &backend,
            &keys,
            &mut input,
            &mut output,
            opts,
        )?;
        timed(opts.timings, Step::Write, || output.flush())?;
        Ok(n)
    }

    /// Decrypts `file` from its current position. For a regular file the
    /// workers read their segments themselves; anything else is streamed.
    pub fn decrypt_file<W: Write + Send>(
        &self,
        file: &File,
        mut output: W,
        opts: &StreamOptions<'_>,
    ) -> Result<u64> {
        if regular_region(file)?.is_none() {
            return self.decrypt(file, output, opts);
        }
        let mut input = file;
        let header = timed(opts.timings, Step::Read, || Header::read_from(&mut input))?;
        let (backend, keys) = self.begin_payload(&header, &mut input, opts.timings)?;
        let (start, end) = regular_region(file)?.unwrap_or_default();
        let n = stream::run_file(
            Direction::Open,
            &backend,
            &keys,
            file,
            start,
            end,
            &mut output,
            opts,
        )?;
        ends_at(file, end)?;
        timed(opts.timings, Step::Write, || output.flush())?;
        Ok(n)
    }

    /// Gets the session key, reads the stream header and derives the file key.
    fn begin_payload<R: Read>(
        &self,
        header: &Header,
        input: &mut R,
        timings: Option<&Timings>,
    ) -> Result<(Arc<dyn Backend>, FileKeys)> {
        let key = self.session_key(header)?;
        let layout = Layout::new(&header.params)?;
        let backend = self
            .backend
            .clone()
            .unwrap_or_else(|| header.params.default_backend());
        let mut stream_header = vec![0u8; layout.stream_header_len()];
        let got = timed(timings, Step::Read, || {
            stream::read_full(input, &mut stream_header)
        })?;
        if got < stream_header.len() {
            return Err(Error::TruncatedHeader);
        }
        if stream_header[0] as usize != stream_header.len() {
            return Err(Error::malformed_stream_header());
        }
        let (salt, prefix) = stream_header[1..].split_at(layout.key_len);
        let mut nonce_prefix = [0u8; NONCE_PREFIX_LEN];
        nonce_prefix.copy_from_slice(prefix);
        let keys = FileKeys::derive(
            backend.as_ref(),
            layout,
            key.expose(),
            salt,
            header.raw(),
            nonce_prefix,
        )?;
        Ok((backend, keys))
    }
}

fn verify_header(header: &Header, key: &SessionKey) -> Result<()> {
    let expect = header_mac(key, header.unsigned())?;
    if bool::from(expect.ct_eq(header.mac())) {
        Ok(())
    } else {
        Err(Error::HeaderAuth)
    }
}

impl Error {
    fn malformed_stream_header() -> Self {
        Error::MalformedHeader("bad stream header length byte".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{Mode, Stanza};
    use crate::recovery::RecoveryKey;
    use crate::stream::StreamOptions;

    /// A recipient that may wrap only through `wrap_with_os_rng`.
    struct OsRngOnly(crate::recipient::p256::P256Recipient);

    impl Recipient for OsRngOnly {
        fn wrap(&self, _: &SessionKey, _: &mut dyn CryptoRngCore) -> Result<Stanza> {
            Err(Error::Backend("wrap with a caller's RNG".into()))
        }
        fn wrap_with_os_rng(&self, key: &SessionKey) -> Result<Stanza> {
            self.0.wrap_with_os_rng(key)
        }
        fn kind(&self) -> u8 {
            self.0.kind()
        }
        fn fingerprint(&self) -> [u8; crate::format::FINGERPRINT_LEN] {
            self.0.fingerprint()
        }
    }

    /// `Encryptor::new` wraps with the OS-RNG path (ring's P-256 when built
    /// with ring), `with_rng` with the caller's RNG; both open with the
    /// identity.
    #[test]
    fn new_wraps_with_the_os_rng_and_with_rng_with_the_callers() {
        let key = RecoveryKey::generate(&mut OsRng);
        let only: Vec<Box<dyn Recipient>> = vec![Box::new(OsRngOnly(key.recipient().unwrap()))];
        let params = Params::new(Mode::Gcm, 256).unwrap();
        let enc = Encryptor::new(&only, params).unwrap();
        assert!(Encryptor::with_rng(&only, params, &mut OsRng).is_err());
        let identity = key.into_identity().unwrap();
        let header = Header::read_from(&mut &enc.header()[..]).unwrap();
        let opened = identity.unwrap(&header.stanzas[0]).unwrap().unwrap();
        assert_eq!(opened.expose(), enc.session_key().expose());
    }

    #[test]
    fn a_resumed_session_writes_files_one_unwrap_opens() {
        let key = RecoveryKey::generate(&mut OsRng);
        let recipients: Vec<Box<dyn Recipient>> = vec![Box::new(key.recipient().unwrap())];
        let params = Params::new(Mode::Gcm, 256).unwrap();
        let first = Encryptor::new(&recipients, params).unwrap();
        let session_key = SessionKey::from_bytes(first.session_key().expose());
        let second = Encryptor::resume(first.header(), session_key, params, &recipients).unwrap();
        let opts = StreamOptions::default();
        let mut a = Vec::new();
        let mut b = Vec::new();
        first.encrypt(&b"first"[..], &mut a, &opts).unwrap();
        second.encrypt(&b"second"[..], &mut b, &opts).unwrap();
        assert_eq!(&a[..first.header().len()], &b[..first.header().len()]);
        let decryptor = Decryptor::new(vec![Box::new(key.into_identity().unwrap())]);
        for (ct, pt) in [(&a, &b"first"[..]), (&b, &b"second"[..])] {
            let mut out = Vec::new();
            decryptor.decrypt(&ct[..], &mut out, &opts).unwrap();
            assert_eq!(out, pt);
        }
        assert_eq!(decryptor.unwrap_count(), 1);

        // Another key, other parameters or a header with trailing bytes are
        // refused.
        let wrong = SessionKey::from_bytes(&[7; 32]);
        assert!(matches!(
            Encryptor::resume(first.header(), wrong, params, &recipients),
            Err(Error::HeaderAuth)
        ));
        let same = || SessionKey::from_bytes(first.session_key().expose());
        let other = Params::new(Mode::Gcm, 128).unwrap();
        assert!(Encryptor::resume(first.header(), same(), other, &recipients).is_err());
        let mut long = first.header().to_vec();
        long.push(0);
        assert!(Encryptor::resume(&long, same(), params, &recipients).is_err());
        let another: Vec<Box<dyn Recipient>> = vec![Box::new(
            RecoveryKey::generate(&mut OsRng).recipient().unwrap(),
        )];
        assert!(Encryptor::resume(first.header(), same(), params, &another).is_err());
    }

    #[test]
    fn a_file_longer_than_its_region_is_refused() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(b"0123456789").unwrap();
        assert!(ends_at(&f, 10).is_ok());
        let err = ends_at(&f, 5).unwrap_err();
        assert!(err.to_string().contains("longer than its size"), "{err}");
    }

    #[test]
    fn sizes_are_trusted_only_on_real_file_systems() {
        let mut f = tempfile::tempfile().unwrap();
        assert_eq!(regular_region(&f).unwrap(), None, "empty: read to the end");
        f.write_all(b"data").unwrap();
        f.rewind().unwrap();
        assert_eq!(regular_region(&f).unwrap(), Some((0, 4)));
        for path in [
            "/proc/version",
            "/sys/kernel/mm/transparent_hugepage/enabled",
        ] {
            let f = File::open(path).unwrap();
            assert_eq!(regular_region(&f).unwrap(), None, "{path}");
        }
    }
}
