//! The `tpmcrypt` executable: serves by itself the runs that need neither
//! tpm2-tss nor OpenSSL, and hands every other run to `tpmcrypt-full`.
//!
//! Why: a script that runs one `tpmcrypt` per file pays, at every start,
//! for loading the shared libraries the process links. tpm2-tss and
//! libcrypto cost about 1 ms of CPU per start (`docs/bench.md`, "One
//! process per file"), more than a whole small encryption. Nothing here
//! calls into either, so the linker leaves them out of this executable
//! (`--as-needed`); `tests/front.rs` checks that it does.
//!
//! Served here, through the very code `tpmcrypt-full` runs
//! ([`crate::commands::crypt`]):
//! * `encrypt` to recovery recipients given as strings (`-R
//!   tpmcrypt-recovery:…`) or in a recipients file (`-R FILE`, a regular
//!   file of such lines and comments; a PEM key in it hands the run
//!   over) and to the keystore's P-256 keys (`-k`), in
//!   AES-GCM with 128- or 256-bit keys (192 too where AWS-LC's 512-bit
//!   path is its default), any inputs. Encrypting never needs the TPM;
//! * `decrypt` of one named file that a `-i` identity opens (in memory:
//!   the agent is not asked) or whose session key the agent holds, checked
//!   before anything is written.
//!
//! Everything else, and anything in doubt (a recipients file with a PEM key
//! or on standard input, an RSA key, CBC,
//! `--backend openssl`, a PIN file or keystore that would earn a warning,
//! a file the agent and `-i` cannot open (an agent socket refused counts
//! as no agent; the socket is looked at only when the agent is asked), a
//! command-line
//! error, `--help`), is handed over with `execve`: the same process, the
//! same arguments, environment and descriptors, so `tpmcrypt-full` says
//! and does exactly what it would have said and done if run directly.
//! Nothing the front did before a hand-over is visible: it has written
//! nothing, printed nothing and consumed no input (it reads only regular
//! files before deciding, never a pipe, FIFO or device). A served decrypt
//! finds its session key before the run ([`Decryptor::prefetch`]) and
//! counts it only when the run uses it (no key the front unwraps is given
//! to the agent: its identities are all in memory).
//!
//! Known difference: the file is opened by name twice, for the check and
//! for the run. One replaced in between by a file only a TPM key opens
//! fails with "no identity matches" (exit 3), where tpmcrypt-full would
//! have used the TPM; nothing is lost, and running it again works. When no
//! `-i` identity opens the file, the agent is asked during the check, so a
//! run that then fails before it needs the key (its output exists) has
//! asked the agent where tpmcrypt-full would not have: invisible with an
//! agent that answers (the warnings of one that does not are held, and
//! said only when the key is used), but one that never answers costs its
//! timeout. A
//! hand-over after the agent failed to answer asks it once more. Signals
//! are taken (temporaries removed, then the signal's exit) before the
//! agent is asked, as tpmcrypt-full takes them before it asks.

use std::ffi::OsString;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tpmcrypt_cipher::format::Header;
use tpmcrypt_cipher::recipient::{Identity, Recipient};
use tpmcrypt_cipher::{recovery, Decryptor, Params, SessionCache};
use tpmcrypt_tpmkey::agent::session::AgentCache;
use tpmcrypt_tpmkey::agent::{self, AgentClient};

use crate::args::value::BackendArg;
use crate::args::{FrontCli, FrontCommand};
use crate::commands::agent::LazyAgent;
use crate::commands::crypt::{self, DecryptArgs, EncryptArgs, TpmUse};
use crate::files::{self, Source};
use crate::ui::Ui;

/// The file name of the executable that runs every command.
pub const FULL: &str = "tpmcrypt-full";

/// Where [`FULL`] is looked for, after the directory of this executable:
/// `../libexec/tpmcrypt/` from it (`/usr/bin/tpmcrypt` →
/// `/usr/libexec/tpmcrypt/tpmcrypt-full`, as the Debian package installs).
const LIBEXEC: &str = "../libexec/tpmcrypt";

/// Where the Debian package installs [`FULL`], the one place looked at
/// when this executable's own path is unknown (no `/proc`).
const INSTALLED: &str = "/usr/libexec/tpmcrypt/tpmcrypt-full";

/// The `tpmcrypt` executable's `main`.
pub fn main() -> ! {
    // Before any thread starts (see the function).
    tpmcrypt_cipher::backend::restore_openssl_ia32cap();
    // Before anything may hold a key.
    crate::harden::disable_core_dumps();
    crate::harden::lock_secrets_or_say_so();
    crate::harden::say_lock_waits();
    let argv: Vec<OsString> = std::env::args_os().collect();
    if let Some(code) = serve(&argv) {
        std::process::exit(code);
    }
    hand_over(&argv)
}

/// Why a run the front began must go to `tpmcrypt-full` after all.
#[derive(Debug)]
struct HandOver;

impl std::fmt::Display for HandOver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("this run needs tpmcrypt-full")
    }
}

impl std::error::Error for HandOver {}

/// Runs what the front serves and returns its exit code; `None` hands the
/// run over.
fn serve(argv: &[OsString]) -> Option<i32> {
    // Any command-line error, --help or --version: said by tpmcrypt-full.
    // Only encrypt and decrypt parse here (see `FrontCli`).
    let (cli, tpm_from_env) = crate::parse::<FrontCli>(argv).ok()?;
    let ui = crate::ui_of(&cli.globals, tpm_from_env);
    let result = match &cli.command {
        FrontCommand::Encrypt(args) => encrypt(args, &ui)?,
        FrontCommand::Decrypt(args) => decrypt(args, &ui)?,
    };
    match result {
        Err(e) if e.is::<HandOver>() => None,
        result => Some(crate::code_of(result)),
    }
}

/// Whether tpmcrypt-full's default backend for `params` is OpenSSL's (CBC;
/// GCM with 192-bit keys where AWS-LC's 512-bit path does not run and
/// ring has none), which the front does not load: it keeps its speed by
/// handing the run over.
fn openssl_would_serve(params: &Params) -> bool {
    params.preferred_backend() == "openssl"
}

/// Whether the front serves this `--backend` (OpenSSL is not loaded here).
fn backend_served(arg: Option<BackendArg>) -> bool {
    !matches!(arg, Some(BackendArg::Openssl))
}

/// `encrypt` to recovery recipient strings and P-256 keystore keys, in GCM
/// with a key size aws-lc and ring serve (the default backend's choice
/// would be OpenSSL's for the others, and its speed is kept for them).
fn encrypt(args: &EncryptArgs, ui: &Ui) -> Option<anyhow::Result<i32>> {
    let start = Instant::now();
    if !backend_served(args.files.backend) {
        return None;
    }
    let params = crate::options::params(args.mode, args.bits, args.segment_size).ok()?;
    if openssl_would_serve(&params) {
        return None;
    }
    let mut recipients = Vec::new();
    for value in &args.recipients {
        match value
            .to_str()
            .filter(|s| s.starts_with(recovery::RECIPIENT_PREFIX))
        {
            Some(s) => recipients.push(Box::new(recovery::parse_recipient(s).ok()?) as _),
            None => recipients.extend(recovery_recipients_file(value)?),
        }
    }
    for name in &args.keys {
        recipients.extend(key_recipients(ui, name)?);
    }
    Some(crypt::encrypt_to(args, ui, start, params, &recipients))
}

/// The recipients of `-R FILE` when FILE is a regular file that lists
/// recovery recipients only (and comments and blank lines), as
/// [`crate::keys::read_recipients`] reads them. None for anything else,
/// which tpmcrypt-full then reads and says: a PEM public key (OpenSSL reads
/// those), a line that does not parse, a file without a recipient, one too
/// large, standard input, or what is not a regular file (never read here:
/// a FIFO would block, or give tpmcrypt-full less than it held).
fn recovery_recipients_file(value: &std::ffi::OsStr) -> Option<Vec<Box<dyn Recipient>>> {
    use std::io::Read as _;

    use crate::keys::MAX_RECIPIENTS_FILE;

    if crate::keys::is_stdin(value) {
        return None;
    }
    let file = open_regular(Path::new(value))?;
    let mut data = Vec::new();
    file.take(MAX_RECIPIENTS_FILE + 1)
        .read_to_end(&mut data)
        .ok()?;
    if data.len() as u64 > MAX_RECIPIENTS_FILE {
        return None;
    }
    let no_pem = |_: &[u8]| {
        Err(tpmcrypt_cipher::Error::InvalidRecipient(
            "read by tpmcrypt-full".into(),
        ))
    };
    let entries = tpmcrypt_cipher::recipients_file::parse_with(&data, no_pem).ok()?;
    if entries.is_empty() {
        return None;
    }
    Some(entries.into_iter().map(|e| e.recipient).collect())
}

/// The recipients of keystore key `name` (`-k`), if it is a P-256 key
/// whose recipients need no OpenSSL to read (as
/// [`crate::keys::key_recipients`] would give them).
fn key_recipients(ui: &Ui, name: &str) -> Option<Vec<Box<dyn Recipient>>> {
    let store = crate::keys::keystore_with(ui, name).ok()?;
    tpmcrypt_tpmkey::identity::p256_key_recipients(&store, name).ok()?
}

/// `decrypt` of one named file that the agent or a `-i` identity opens.
fn decrypt(args: &DecryptArgs, ui: &Ui) -> Option<anyhow::Result<i32>> {
    let start = Instant::now();
    let single_file = matches!(args.files.inputs.as_slice(), [one] if one.as_os_str() != "-");
    if !single_file || args.files.recursive || ui.pin_file.is_some() {
        return None;
    }
    if !backend_served(args.files.backend) {
        return None;
    }
    // tpmcrypt-full checks the TPM's name and every PIN source even when
    // no key needs them.
    crate::tpm::target(ui).ok()?;
    crate::pin::pins(ui).ok()?;
    let keys = keystore_keys(ui)?;
    let identities = args
        .identities
        .iter()
        .map(|p| regular_identity(p))
        .collect::<Option<Vec<Box<dyn Identity>>>>()?;
    if identities.is_empty() && keys == 0 {
        // "No identity" is tpmcrypt-full's usage error, before any other.
        return None;
    }
    // The agent's failures while the front decides (a socket it refuses
    // included) are said only once the run uses the key found then
    // (tpmcrypt-full, which asks the agent there, would say them once more
    // after a hand-over, and not at all in a run that fails before); after
    // that, as they come. The socket is looked at only when the agent is
    // asked: not at all when a -i identity in memory opens the file.
    let held = Held::default();
    let cache = || {
        let on = held.clone();
        let find = move || {
            let client = match AgentClient::checked(&agent::socket_path()) {
                Ok(client) => client?,
                Err(e) => {
                    on.say(e.to_string());
                    return None;
                }
            };
            let on = on.clone();
            let on_failure = move |e: &tpmcrypt_tpmkey::Error| on.say(e.to_string());
            Some(AgentCache::new(client, Box::new(on_failure)))
        };
        Some(Box::new(HeldAgent {
            agent: LazyAgent::new(find),
            held: held.clone(),
        }) as Box<dyn SessionCache>)
    };
    let check = |plan: &files::Plan, decryptor: &Decryptor| -> anyhow::Result<()> {
        let [task] = plan.tasks.as_slice() else {
            return Err(HandOver.into());
        };
        let Source::File(path) = &task.source else {
            return Err(HandOver.into());
        };
        let header = read_header(path).ok_or(HandOver)?;
        // CBC, and 192-bit keys where OpenSSL is their default: its
        // speed, in tpmcrypt-full.
        let params = &header.params;
        if args.files.backend.is_none() && openssl_would_serve(params) {
            return Err(HandOver.into());
        }
        // Found now (by a -i identity, else the agent), counted only when
        // the run uses it, as tpmcrypt-full does.
        // Before the agent is asked: a signal now ends the run as it would
        // end tpmcrypt-full's, which asks the agent within its run.
        let _ = crate::atomic::remove_temporaries_on_interrupt();
        decryptor.prefetch(&header).map_err(|_| HandOver)?;
        Ok(())
    };
    Some(crypt::decrypt_with(
        args, ui, start, identities, &cache, &check, &NoTpm,
    ))
}

/// The agent's warnings while the front decides, said when the run uses
/// the key (see [`HeldAgent`]); `None` once said, and later ones at once.
#[derive(Clone)]
struct Held(Arc<Mutex<Option<Vec<String>>>>);

impl Default for Held {
    fn default() -> Self {
        Held(Arc::new(Mutex::new(Some(Vec::new()))))
    }
}

impl Held {
    fn say(&self, text: String) {
        let mut held = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match held.as_mut() {
            Some(list) => list.push(text),
            None => crate::commands::agent::say_not_using(&text),
        }
    }

    fn release(&self) {
        let said = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
        for text in said.into_iter().flatten() {
            crate::commands::agent::say_not_using(&text);
        }
    }
}

/// The agent as the run's session cache, with its warnings held until the
/// key the front's check found is used.
struct HeldAgent<F> {
    agent: LazyAgent<F>,
    held: Held,
}

impl<F: Fn() -> Option<AgentCache> + Send + Sync> SessionCache for HeldAgent<F> {
    fn get(&self, digest: &[u8; 32]) -> Option<tpmcrypt_cipher::SessionKey> {
        self.agent.get(digest)
    }
    fn put(&self, digest: &[u8; 32], key: &tpmcrypt_cipher::SessionKey) {
        self.agent.put(digest, key)
    }
    fn used(&self, _digest: &[u8; 32]) {
        self.held.release();
    }
}

/// A `-i` identity, if `path` is a regular file: one from a pipe, a FIFO
/// or a device is left to tpmcrypt-full, which must be the one to read it.
fn regular_identity(path: &Path) -> Option<Box<dyn Identity>> {
    let bytes = crate::keys::read_identity(open_regular(path)?, path).ok()?;
    crate::keys::parse_identity(path, &bytes).ok()
}

/// `path` opened for reading if it is a regular file, without blocking
/// (a FIFO swapped in after the check is not waited for, nor emptied).
fn open_regular(path: &Path) -> Option<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    if !std::fs::metadata(path).ok()?.is_file() {
        return None;
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    file.metadata().ok()?.is_file().then_some(file)
}

/// The header of the (binary or armored) tpmcrypt file at `path`.
fn read_header(path: &Path) -> Option<Header> {
    // Only a regular file: a FIFO's writer must meet tpmcrypt-full's open,
    // not this one (which would take its data, or end its writes with EPIPE).
    let file = open_regular(path)?;
    tpmcrypt_cipher::armor::read_any_header(&file)
        .ok()
        .map(|(header, _)| header)
}

/// How many keys the keystore holds, when reading it would earn no warning
/// in tpmcrypt-full (it reads every key, whichever one a file needs): no
/// keystore (0), or a trusted one whose every key file loads; else `None`.
fn keystore_keys(ui: &Ui) -> Option<usize> {
    let Some(dir) = crate::keys::decrypt_keystore_dir(ui) else {
        return Some(0);
    };
    let store = tpmcrypt_tpmkey::Keystore::open(&dir).ok()?;
    store.check_trusted().ok()?;
    let names = store.list().ok()?;
    for name in &names {
        // What identity() reads of each key without a TPM.
        let (blob, _) = store.load(name).ok()?;
        if blob.alg().ok()? == tpmcrypt_tpmkey::KeyAlg::EccP256 {
            blob.ecc_public_point().ok()?;
        }
    }
    Some(names.len())
}

/// A run the front serves uses no TPM.
struct NoTpm;

impl TpmUse for NoTpm {
    fn is_open(&self) -> bool {
        false
    }
    fn describe(&self) -> String {
        String::new()
    }
    fn signed_policies_used(&self) -> Vec<String> {
        Vec::new()
    }
    fn unbind_count(&self) -> u64 {
        0
    }
    fn busy(&self) -> Duration {
        Duration::ZERO
    }
}

/// `tpmcrypt-full`: beside this executable, else in
/// `../libexec/tpmcrypt/` from it. Never looked up in `PATH`: a directory
/// there may be another user's.
fn full_path() -> Option<PathBuf> {
    let Ok(exe) = std::env::current_exe() else {
        // Without /proc, only where the package installs it: argv[0] is
        // whatever the caller chose, and a directory named by it may be
        // another user's.
        return Some(PathBuf::from(INSTALLED)).filter(|p| p.is_file());
    };
    // The executable's path is its real one: `..` from its directory is
    // the parent (so that every name on the way can be judged).
    let dir = exe.parent()?;
    let libexec = dir
        .parent()
        .map(|up| up.join(LIBEXEC.trim_start_matches("../")).join(FULL));
    std::iter::once(dir.join(FULL))
        .chain(libexec)
        .find(|p| p.is_file())
}

/// Why `full` must not be run, if so: it, or its directory, is owned by
/// another user than root and this one, or writable by others, or by a
/// group other than this user's own (a build made under umask 002 has
/// the user's private group, which may write); or a directory above is
/// ([`refused`]).
/// It runs with this user's environment and descriptors (PIN sources,
/// the agent's socket), so it must be what root or this user put there,
/// and what nobody else could replace.
fn untrusted(full: &Path) -> Option<String> {
    let Some(dir) = full.parent() else {
        return refused(full, "it", false);
    };
    refused(full, "it", false)
        .or_else(|| refused(dir, "its directory", false))
        .or_else(|| {
            dir.ancestors().skip(1).find_map(|d| {
                let what = format!(
                    "the directory {} above it",
                    crate::ui::printable(&d.display().to_string())
                );
                refused(d, &what, true)
            })
        })
}

/// Why the name `found` (absolute, with no `..`) may not be what root or
/// this user put there, if so: walked from `/`, each entry on the way is
/// judged itself, not what it leads to: a symlink must be root's or this
/// user's, and each directory holding an entry must pass [`refused`]
/// (the one holding `found` itself even if sticky: in a sticky directory
/// anyone may take a name that was free). [`untrusted`] judges the real
/// path the name leads to; this, the names on the way, which another user
/// could have chosen.
fn name_untrusted(found: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt as _;
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    let mut on_the_way: Vec<&Path> = found.ancestors().collect();
    on_the_way.reverse();
    for pair in on_the_way.windows(2) {
        let (holder, entry) = (pair[0], pair[1]);
        let last = entry == found;
        let what = if last {
            "the directory it is found in".to_string()
        } else {
            format!(
                "the directory {} on the way to it",
                crate::ui::printable(&holder.display().to_string())
            )
        };
        if let Some(why) = refused(holder, &what, !last) {
            return Some(why);
        }
        let Ok(m) = std::fs::symlink_metadata(entry) else {
            return Some(format!(
                "{} could not be looked at",
                crate::ui::printable(&entry.display().to_string())
            ));
        };
        if m.file_type().is_symlink() && m.uid() != 0 && m.uid() != me {
            let name = if last {
                "it".to_string()
            } else {
                crate::ui::printable(&entry.display().to_string())
            };
            return Some(format!(
                "{name} is a symlink owned by uid {}, not by you (uid {me}) or root",
                m.uid()
            ));
        }
    }
    None
}

/// Why `path` (`what`) lets another user swap what runs, if it does:
/// owned by another user than root and this one, or writable by others
/// (or by a group other than this user's own), unless `sticky_ok` and it
/// is sticky, as `/tmp` is. A directory above that of `tpmcrypt-full` is
/// held to it with `sticky_ok`: before, only that one directory was
/// checked, and another user who could write to a directory above
/// `libexec/tpmcrypt/` exchanged it for one of their own between the check
/// and the exec, so that root ran their program (in 207 tries). The path
/// is canonical (see [`hand_over`]): no symlink on the way.
fn refused(path: &Path, what: &str, sticky_ok: bool) -> Option<String> {
    use std::os::unix::fs::MetadataExt as _;
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    // SAFETY: getegid cannot fail.
    let my_group = unsafe { libc::getegid() };
    let m = std::fs::metadata(path).ok()?;
    if m.uid() != 0 && m.uid() != me {
        return Some(format!(
            "{what} is owned by uid {}, not by you (uid {me}) or root",
            m.uid()
        ));
    }
    // With an access ACL the group bits are its mask, the most that any
    // named user or group may do: write there may be another user's.
    if m.mode() & 0o020 != 0 && has_access_acl(path) {
        return Some(format!(
            "{what} may be writable by other users through its ACL (mode {:04o}, `getfacl` shows it)",
            m.mode() & 0o7777
        ));
    }
    let writable = m.mode() & 0o002 != 0 || (m.mode() & 0o020 != 0 && m.gid() != my_group);
    let sticky = m.mode() & 0o1000 != 0;
    if writable && !(sticky_ok && sticky) {
        return Some(format!(
            "{what} is writable by other users{} (mode {:04o})",
            if sticky_ok { " and not sticky" } else { "" },
            m.mode() & 0o7777
        ));
    }
    None
}

/// Whether `path` has an access ACL beyond its mode bits (a minimal one
/// is not stored). Where that cannot be told (a file system without
/// extended attributes), none.
fn has_access_acl(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt as _;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: valid NUL-terminated strings; a null buffer of size 0 asks
    // only for the attribute's size.
    let size = unsafe {
        libc::getxattr(
            c.as_ptr(),
            c"system.posix_acl_access".as_ptr(),
            std::ptr::null_mut(),
            0,
        )
    };
    size > 0
}

/// Replaces this process with `tpmcrypt-full`, given the same arguments.
fn hand_over(argv: &[OsString]) -> ! {
    let Some(full) = full_path() else {
        stderr_line!(
            "{} {FULL} is not installed beside tpmcrypt (nor in {LIBEXEC}/ from it): \
             reinstall tpmcrypt",
            crate::ui::colour::error()
        );
        std::process::exit(crate::ui::exit::OTHER);
    };
    // Its real path, checked and run: through a symlink there, the file
    // run could sit in a directory another user may change, which the
    // checks of the directories on the symlink's side never saw (a hostile
    // round swapped such a file, and root ran theirs).
    // And the name where it was found: a symlink there, or on the way
    // there, is judged itself, since who could put it there chose what
    // runs (a hostile round had root run another user's link to rm).
    let found = full;
    let full = std::fs::canonicalize(&found).unwrap_or_else(|_| found.clone());
    let why = untrusted(&full)
        .map(|why| (&full, why))
        .or_else(|| name_untrusted(&found).map(|why| (&found, why)));
    if let Some((path, why)) = why {
        stderr_line!(
            "{} {}: {why}; not run",
            crate::ui::colour::error(),
            crate::ui::printable(&path.display().to_string())
        );
        std::process::exit(crate::ui::exit::OTHER);
    }
    if crate::ui::stdout::stdin_closed_at_start() {
        // Closed again, as it was given (see below).
        // SAFETY: descriptor 0 is the write-only /dev/null put there at
        // start (ui::stdout); nothing in this process uses it.
        unsafe { libc::close(0) };
    }
    if crate::ui::stdout::closed_at_start() {
        // Closed again, as it was given: tpmcrypt-full tells a closed
        // standard output from /dev/null only at its own start.
        // SAFETY: descriptor 1 is the read-only /dev/null put there at
        // start (ui::stdout); nothing in this process uses it.
        unsafe { libc::close(1) };
    }
    let mut cmd = std::process::Command::new(&full);
    if let Some(arg0) = argv.first() {
        cmd.arg0(arg0);
    }
    let err = cmd.args(argv.iter().skip(1)).exec();
    stderr_line!(
        "{} cannot run {}: {err}",
        crate::ui::colour::error(),
        crate::ui::printable(&full.display().to_string())
    );
    std::process::exit(crate::ui::exit::OTHER)
}
