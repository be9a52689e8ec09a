//! `tpmcrypt rekey`: re-encrypts tpmcrypt files to a new set of
//! recipients, in place, one streaming pass per file (decrypt and encrypt
//! at once, the plaintext only in zeroized memory buffers), with the crash
//! safety of `--in-place`: each name holds its old or its new complete
//! ciphertext at every moment (see `crate::replace`).
//!
//! Who a file is encrypted to afterwards: the `-k` keys (each with the
//! recovery recipients attached to it) and the `-R` recipients, plus the
//! recovery recipients the file already has (unless `--no-keep-recovery`),
//! less every `--drop-recovery` recipient. A kept recovery recipient is
//! found by its fingerprint among the recovery recipients this run knows
//! (`-R`, the keystore's keys, `-i` identities); a file with one it does
//! not know fails, untouched: a recovery recipient is never dropped
//! silently. Files with the same new recipients and parameters share one
//! new session, so a batch that was one session stays one.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::File;
use std::io::{Seek, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use clap::Args;
use rand_core::CryptoRngCore;
use tpmcrypt_cipher::armor;
use tpmcrypt_cipher::format::{Header, Stanza, FINGERPRINT_LEN};
use tpmcrypt_cipher::recipient::{kind, Recipient};
use tpmcrypt_cipher::{Decryptor, Encryptor, Error as CipherError, Params, StreamOptions};

use crate::files::{self, FileArgs, Holds, Naming, RunOptions};
use crate::keys;
use crate::options;
use crate::ui::exit::usage;
use crate::ui::Ui;

/// `tpmcrypt rekey`.
#[derive(Args, Debug)]
pub struct RekeyArgs {
    /// A TPM key from the keystore to encrypt to, by name (its recovery
    /// recipients are added too). May be repeated.
    #[arg(
        short = 'k',
        long = "key",
        value_name = "NAME",
        required_unless_present = "recipients"
    )]
    pub keys: Vec<String>,

    /// A recipient to encrypt to: a recovery recipient string or a
    /// recipients file, as for `encrypt -R`. May be repeated.
    #[arg(short = 'R', long = "recipient", value_name = "RECIPIENT")]
    pub recipients: Vec<OsString>,

    /// Identity file to open the files with (a recovery identity), before
    /// the keystore's keys. May be repeated.
    #[arg(short = 'i', long = "identity", value_name = "IDENTITY")]
    pub identities: Vec<PathBuf>,

    /// Do not keep the recovery recipients the files have: only -k's and
    /// -R's.
    #[arg(long)]
    pub no_keep_recovery: bool,

    /// A recovery recipient (string or recipients file) no file keeps,
    /// whatever adds it (the file, a -k key, -R): to retire a recovery key.
    /// May be repeated.
    #[arg(long, value_name = "RECIPIENT")]
    pub drop_recovery: Vec<OsString>,

    /// Recurse into directories (symlinks are not followed); every
    /// tpmcrypt file found, by content, is rekeyed.
    #[arg(short = 'r', long)]
    pub recursive: bool,

    /// Worker threads for large files, 1 to 1024 (default: number of CPUs).
    #[arg(short = 'j', long, value_name = "N", value_parser = crate::options::parse_workers)]
    pub jobs: Option<usize>,

    /// Files or directories (with -r) to rekey in place.
    #[arg(value_name = "FILE", required = true)]
    pub inputs: Vec<PathBuf>,
}

/// A recipient shared by the sessions that name it.
struct Shared(Arc<dyn Recipient>);

impl Recipient for Shared {
    fn wrap(
        &self,
        key: &tpmcrypt_cipher::SessionKey,
        rng: &mut dyn CryptoRngCore,
    ) -> tpmcrypt_cipher::Result<Stanza> {
        self.0.wrap(key, rng)
    }
    fn wrap_with_os_rng(
        &self,
        key: &tpmcrypt_cipher::SessionKey,
    ) -> tpmcrypt_cipher::Result<Stanza> {
        self.0.wrap_with_os_rng(key)
    }
    fn kind(&self) -> u8 {
        self.0.kind()
    }
    fn fingerprint(&self) -> [u8; FINGERPRINT_LEN] {
        self.0.fingerprint()
    }
}

type Fp = [u8; FINGERPRINT_LEN];

/// Who the files are encrypted to, as resolved from the flags.
struct Targets {
    /// `-R` and `-k` (with their recovery), less the dropped ones.
    new: Vec<Arc<dyn Recipient>>,
    /// Recovery recipients this run knows, by fingerprint.
    known: HashMap<Fp, Arc<dyn Recipient>>,
    /// Fingerprints of the recovery recipients no file keeps.
    dropped: Vec<Fp>,
    /// Whether files keep the recovery recipients they have.
    keep: bool,
}

impl Targets {
    /// The recipients of a file whose header is `header`, in order: the
    /// new ones, then its own recovery recipients that are kept.
    fn for_header(&self, header: &Header) -> Result<Vec<Arc<dyn Recipient>>, CipherError> {
        let mut out = self.new.clone();
        let has = |out: &[Arc<dyn Recipient>], fp: &[u8]| {
            out.iter()
                .any(|r| r.kind() == kind::RECOVERY_P256 && r.fingerprint() == fp)
        };
        let known = |fp: &[u8]| fp.try_into().ok().and_then(|f: Fp| self.known.get(&f));
        // Its recovery recipients, and its P-256 "TPM" recipients that are
        // a recovery key this run knows: a file encrypted to a recovery
        // key's PEM public key names it with the kind of every PEM P-256
        // key, and that key must not be retired with the TPM keys.
        let own = header
            .stanzas
            .iter()
            .filter(|s| {
                self.keep
                    && (s.kind == kind::RECOVERY_P256
                        || (s.kind == kind::TPM_P256
                            && s.fingerprint().is_some_and(|f| known(f).is_some())))
            })
            .filter_map(Stanza::fingerprint);
        for fp in own {
            if self.dropped.iter().any(|d| d == fp) || has(&out, fp) {
                continue;
            }
            match known(fp) {
                Some(r) => out.push(r.clone()),
                None => {
                    return Err(CipherError::InvalidRecipient(format!(
                        "its recovery recipient {} is not known here (give it with -R to keep \
                         it, or --drop-recovery / --no-keep-recovery to drop it); left as it was",
                        hex::encode(fp)
                    )))
                }
            }
        }
        Ok(out)
    }
}

/// Fingerprints of the recovery recipients `values` name (`--drop-recovery`).
fn recovery_fingerprints(values: &[OsString]) -> anyhow::Result<Vec<Fp>> {
    let mut out = Vec::new();
    for g in keys::read_recipients(values)? {
        if g.recovery.is_none() {
            return Err(usage(format!(
                "{}: --drop-recovery takes recovery recipients (tpmcrypt-recovery:…)",
                g.origin
            )));
        }
        out.push(g.recipient.fingerprint());
    }
    Ok(out)
}

/// The recovery recipients of the `-i` identities.
fn identity_recipients(files: &options::IdentityFiles) -> anyhow::Result<Vec<Arc<dyn Recipient>>> {
    let mut out: Vec<Arc<dyn Recipient>> = Vec::new();
    for (p, bytes) in files {
        // parse_identity names any other problem.
        if let Ok(key) = keys::recovery_key(p, bytes) {
            out.push(Arc::new(key.recipient()?));
        }
    }
    Ok(out)
}

/// The recovery recipients attached to the keystore's keys (none if there
/// is no keystore).
fn keystore_recovery(ui: &Ui) -> Vec<Arc<dyn Recipient>> {
    // Never creates a keystore: only one that exists is read.
    let dir = match &ui.keystore {
        Some(d) => d.clone(),
        None => match tpmcrypt_tpmkey::Keystore::default_dir() {
            Ok(d) => d,
            Err(_) => return Vec::new(),
        },
    };
    if !dir.is_dir() {
        return Vec::new();
    }
    let Ok(store) = keys::keystore(ui) else {
        return Vec::new();
    };
    let names = store.list().unwrap_or_default();
    names
        .iter()
        .filter_map(|n| tpmcrypt_tpmkey::identity::key_recipients(&store, n).ok())
        .flatten()
        .filter(|r| r.kind() == kind::RECOVERY_P256)
        .map(Arc::from)
        .collect()
}

fn targets(
    args: &RekeyArgs,
    ui: &Ui,
    identity_files: &options::IdentityFiles,
) -> anyhow::Result<Targets> {
    let dropped = recovery_fingerprints(&args.drop_recovery)?;
    let is_dropped =
        |r: &dyn Recipient| r.kind() == kind::RECOVERY_P256 && dropped.contains(&r.fingerprint());
    let mut new: Vec<Arc<dyn Recipient>> = Vec::new();
    let add = |r: Arc<dyn Recipient>, new: &mut Vec<Arc<dyn Recipient>>| {
        let dup = new
            .iter()
            .any(|n| n.kind() == r.kind() && n.fingerprint() == r.fingerprint());
        if !dup && !is_dropped(r.as_ref()) {
            new.push(r);
        }
    };
    for r in keys::parse_recipients(&args.recipients)? {
        add(Arc::from(r), &mut new);
    }
    for name in &args.keys {
        for r in keys::key_recipients(ui, name)? {
            if is_dropped(r.as_ref()) {
                stderr_line!(
                    "tpmcrypt: warning: key {name} still adds the dropped recovery recipient {} \
                     to what is encrypted for it (recreate or re-import it with another --recovery)",
                    hex::encode(r.fingerprint())
                );
            }
            add(Arc::from(r), &mut new);
        }
    }
    if new.is_empty() {
        return Err(usage(
            "no recipient left to encrypt to (every -R/-k recipient is dropped)",
        ));
    }
    let mut known = HashMap::new();
    let pool = new
        .iter()
        .cloned()
        .chain(identity_recipients(identity_files)?)
        .chain(keystore_recovery(ui));
    for r in pool.filter(|r| r.kind() == kind::RECOVERY_P256) {
        known.entry(r.fingerprint()).or_insert(r);
    }
    Ok(Targets {
        new,
        known,
        dropped,
        keep: !args.no_keep_recovery,
    })
}

/// The transform of one file, and the sessions it opened.
struct Rekeyer {
    decryptor: Decryptor,
    targets: Targets,
    sessions: Mutex<HashMap<Vec<u8>, Arc<Encryptor>>>,
}

impl Rekeyer {
    /// The session for `params` and `to`: one per distinct pair in a run.
    fn session(
        &self,
        params: Params,
        to: &[Arc<dyn Recipient>],
    ) -> Result<Arc<Encryptor>, CipherError> {
        let mut id = vec![params.mode as u8, params.key_len as u8];
        id.extend_from_slice(&params.segment_size.to_be_bytes());
        for r in to {
            id.push(r.kind());
            id.extend_from_slice(&r.fingerprint());
        }
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = sessions.get(&id) {
            return Ok(e.clone());
        }
        let boxed: Vec<Box<dyn Recipient>> = to
            .iter()
            .map(|r| Box::new(Shared(r.clone())) as Box<dyn Recipient>)
            .collect();
        let e = Arc::new(Encryptor::new(&boxed, params)?);
        sessions.insert(id, e.clone());
        Ok(e)
    }

    /// Rekeys one file onto `output`: its header says who it keeps; then
    /// its payload is decrypted into an encryption in one pass.
    fn rekey(
        &self,
        input: &mut File,
        output: &mut (dyn Write + Send),
        opts: &StreamOptions<'_>,
    ) -> Result<u64, CipherError> {
        // An armored file stays armored (`-r` picks it by content).
        let (header, armored) = armor::read_any_header(input)?;
        let to = self.targets.for_header(&header)?;
        // The session key before anything is written: a file no identity
        // opens fails here.
        self.decryptor.session_key(&header)?;
        let encryptor = self.session(header.params, &to)?;
        input.rewind()?;
        let (mut writer, reader) = crate::plainpipe::pipe(4);
        std::thread::scope(|scope| {
            let sealing = scope.spawn(|| seal(&encryptor, reader, output, opts, armored));
            let opened = self.decryptor.decrypt_any_file(input, &mut writer, opts);
            let finished = opened.and_then(|n| writer.finish().map(|()| n).map_err(Into::into));
            let sealed = sealing
                .join()
                .unwrap_or_else(|e| std::panic::resume_unwind(e));
            match (finished, sealed) {
                (Ok(n), Ok(m)) if n == m => Ok(n),
                (Ok(_), Ok(_)) => Err(CipherError::Io(std::io::Error::other(
                    "the plaintext read and the plaintext sealed differ in length",
                ))),
                // A failed decryption explains a failed encryption (its
                // input ended), unless writing failed first.
                (Err(e), Ok(_)) => Err(e),
                (Ok(_), Err(e)) => Err(e),
                (Err(d), Err(e)) => Err(if is_pipe(&d) { e } else { d }),
            }
        })
    }
}

/// Encrypts `input` onto `output`, as ASCII armor if `armored`.
fn seal<R: std::io::Read>(
    encryptor: &Encryptor,
    input: R,
    output: &mut (dyn Write + Send),
    opts: &StreamOptions<'_>,
    armored: bool,
) -> Result<u64, CipherError> {
    if !armored {
        return encryptor.encrypt(input, output, opts);
    }
    let mut out = armor::ArmoredWriter::new(output);
    let n = encryptor.encrypt(input, &mut out, opts)?;
    out.finish()?;
    Ok(n)
}

/// Whether a decryption failed only because its encryption stopped.
fn is_pipe(e: &CipherError) -> bool {
    matches!(e, CipherError::Io(io) if io.kind() == std::io::ErrorKind::BrokenPipe)
}

fn file_args(args: &RekeyArgs) -> anyhow::Result<FileArgs> {
    if args.inputs.iter().any(|p| p.as_os_str() == "-") {
        return Err(usage(
            "rekey replaces files in place: it takes file names, not stdin",
        ));
    }
    Ok(FileArgs {
        output: None,
        recursive: args.recursive,
        in_place: true,
        force: false,
        no_sync: false,
        jobs: args.jobs,
        stats_json: None,
        backend: None,
        inputs: args.inputs.clone(),
    })
}

/// Runs `rekey`.
pub fn run(args: &RekeyArgs, ui: &Ui) -> anyhow::Result<i32> {
    let start = Instant::now();
    let fargs = file_args(args)?;
    // Each -i file read once: for its recipient and as an identity.
    let identity_files = options::read_identity_files(&args.identities)?;
    let targets = targets(args, ui, &identity_files)?;
    let options::Identities {
        list: identities,
        access,
    } = options::identities_read(ui, &identity_files)?;
    let plan = files::plan(&fargs, Naming::Rekey)?;
    let decryptor =
        Decryptor::new(identities).with_session_cache(Box::new(crate::commands::agent::cache()));
    let rekeyer = Rekeyer {
        decryptor,
        targets,
        sessions: Mutex::new(HashMap::new()),
    };
    let opts = RunOptions {
        jobs: args.jobs,
        parallel_threshold: 4 << 20,
        force: false,
        in_place: true,
        no_sync: false,
        progress: !ui.quiet,
        refuse_tty_output: false,
        output_kind: Holds::Ciphertext,
        skip_ciphertext: false,
        batch: crate::batch::Limits::for_run(args.jobs),
        timings: Default::default(),
    };
    crate::commands::crypt::report_skipped(&plan, ui);
    let mut summary = files::run(&plan.tasks, &opts, &|input, output, stream| {
        rekeyer.rekey(input, output, stream)
    });
    if !plan.failed.is_empty() {
        summary.failed += plan.failed.len() as u64;
        summary.first_code.get_or_insert(crate::ui::exit::OTHER);
    }
    if ui.verbose {
        let sessions = rekeyer.sessions.lock().map(|s| s.len()).unwrap_or(0);
        stderr_line!(
            "tpmcrypt: rekeyed {} file(s), {} bytes, {} skipped, {} failed, {} session key unwrap(s), {} TPM unbind(s), {} new session(s), {:.3} s",
            summary.ok,
            summary.bytes,
            plan.skipped.len(),
            summary.failed,
            rekeyer.decryptor.unwrap_count(),
            access.unbind_count(),
            sessions,
            start.elapsed().as_secs_f64()
        );
    }
    Ok(summary.first_code.unwrap_or(crate::ui::exit::OK))
}
