//! `tpmcrypt encrypt` and `tpmcrypt decrypt`: one session per invocation —
//! one session key for everything encrypted, one unwrap per session for
//! everything decrypted.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args;
use tpmcrypt_cipher::{Decryptor, TimingsSnapshot};

use crate::args::value::{BitsArg, ModeArg};
use crate::files::{self, FileArgs, Holds, Naming, RunOptions, Summary};
use crate::keys;
use crate::options;
use crate::statsfile;
use crate::ui::Ui;

/// `tpmcrypt encrypt`.
#[derive(Args, Debug)]
pub struct EncryptArgs {
    /// Recipient: a recovery recipient string (tpmcrypt-recovery:…), or a
    /// recipients file ("-" for stdin): recovery recipient lines and PEM
    /// public keys (e.g. `key export` output), # comments. May be repeated.
    #[arg(
        short = 'R',
        long = "recipient",
        value_name = "RECIPIENT",
        required_unless_present = "keys"
    )]
    pub recipients: Vec<std::ffi::OsString>,

    /// A TPM key from the keystore, by name (its public half only: no TPM
    /// is needed to encrypt). Its recovery recipients are added too.
    #[arg(short = 'k', long = "key", value_name = "NAME")]
    pub keys: Vec<String>,

    /// Payload mode.
    #[arg(long, value_enum, default_value_t = ModeArg::Gcm)]
    pub mode: ModeArg,

    /// AES key size in bits (192 is not Tink-interoperable).
    #[arg(long, value_enum, default_value_t = BitsArg::B256)]
    pub bits: BitsArg,

    /// Ciphertext segment size (advanced; default 1MiB): bytes, or K, M
    /// (powers of 1024), e.g. 64KiB.
    #[arg(long, value_name = "SIZE", hide = true, value_parser = crate::args::value::size_u32)]
    pub segment_size: Option<u32>,

    /// Start a session of this run's own even when an agent runs (by
    /// default `encrypt` joins the agent's current session for the same
    /// recipients and parameters, so that files encrypted by many runs
    /// decrypt with one TPM operation).
    #[arg(long)]
    pub new_session: bool,

    /// Allow writing ciphertext to a terminal.
    #[arg(long, hide = true)]
    pub allow_tty: bool,

    /// Write ASCII armor (PEM-style text, 64-column base64 lines) instead
    /// of binary; `decrypt` and `inspect` recognise it by themselves.
    #[arg(short = 'a', long)]
    pub armor: bool,

    #[command(flatten)]
    pub files: FileArgs,
}

/// `tpmcrypt decrypt`.
#[derive(Args, Debug)]
pub struct DecryptArgs {
    /// Identity file (a recovery identity). May be repeated. Keys in the
    /// keystore are always tried too (the TPM is used only if a file is
    /// addressed to one of them).
    #[arg(short = 'i', long = "identity", value_name = "IDENTITY")]
    pub identities: Vec<PathBuf>,

    #[command(flatten)]
    pub files: FileArgs,
}

fn run_options(
    files: &FileArgs,
    ui: &Ui,
    refuse_tty_output: bool,
    output_kind: Holds,
) -> RunOptions {
    RunOptions {
        jobs: files.jobs,
        // Below a few segments the threads cost more than they save.
        parallel_threshold: 4 << 20,
        force: files.force,
        in_place: files.in_place,
        no_sync: files.no_sync,
        progress: !ui.quiet,
        refuse_tty_output,
        output_kind,
        skip_ciphertext: output_kind == Holds::Ciphertext,
        batch: crate::batch::Limits::for_run(files.jobs),
        timings: Default::default(),
    }
}

/// With `-v`, names every file a recursive run leaves out, and why; and
/// always, one error line for each file or directory the walk found
/// failing by itself (counted as a failure of the run).
pub(crate) fn report_skipped(plan: &files::Plan, ui: &Ui) {
    for (first, again) in &plan.same {
        stderr_line!(
            "tpmcrypt: {} and {} are the same file: done once",
            crate::ui::shown(first),
            crate::ui::shown(again)
        );
    }
    if ui.verbose {
        for s in &plan.skipped {
            stderr_line!("tpmcrypt: skipped {}: {}", crate::ui::shown(&s.path), s.why);
        }
    }
    for (path, why) in &plan.failed {
        stderr_line!(
            "{} {}: {}",
            crate::ui::colour::error(),
            crate::ui::shown(path),
            crate::ui::printable(why)
        );
    }
}

/// The walk's own failures, added to the run's.
fn with_walk_failures(mut summary: Summary, plan: &files::Plan) -> Summary {
    if !plan.failed.is_empty() {
        summary.failed += plan.failed.len() as u64;
        summary.first_code.get_or_insert(crate::ui::exit::OTHER);
    }
    summary
}

/// Where a run's time went, for `-v`: the whole run, files per second,
/// the wait for durability (group commits) and the TPM (if used).
pub struct Timing {
    /// When the command started.
    pub start: Instant,
    /// From the start to the first file: keys, recipients, the walk.
    pub setup: Duration,
    /// The files themselves, from the first to the last commit.
    pub files: Duration,
    /// Getting session keys (decrypt): the agent, unwraps, TPM unbinds.
    pub unwrap: Duration,
    /// Time spent with the TPM, if it was used.
    pub tpm: Option<Duration>,
    /// How `encrypt` came by its session.
    pub session: Option<&'static str>,
    /// The engine's read, AES and write time, summed over its threads.
    pub engine: TimingsSnapshot,
}

/// The run's wall time in parts that add up to it: setup, unwrap, the
/// files (read, AES and write, on however many threads), commit, other.
struct WallSplit {
    total: Duration,
    setup: Duration,
    unwrap: Duration,
    files: Duration,
    commit: Duration,
    other: Duration,
}

impl WallSplit {
    fn of(timing: &Timing, commit: Duration) -> WallSplit {
        let total = timing.start.elapsed();
        // Unwraps and commits happen while the files run; the rest of
        // that time is the files'.
        let files = timing.files.saturating_sub(timing.unwrap + commit);
        WallSplit {
            total,
            setup: timing.setup,
            unwrap: timing.unwrap,
            files,
            commit,
            other: total.saturating_sub(timing.setup + timing.files),
        }
    }

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1e3
    }

    fn line(&self) -> String {
        let ms = Self::ms;
        format!(
            "tpmcrypt: wall {:.3} s = setup {:.1} + unwrap {:.1} + files {:.1} + commit {:.1} + other {:.1} ms",
            self.total.as_secs_f64(),
            ms(self.setup),
            ms(self.unwrap),
            ms(self.files),
            ms(self.commit),
            ms(self.other)
        )
    }

    fn json(&self) -> serde_json::Value {
        let ms = Self::ms;
        serde_json::json!({
            "total": ms(self.total),
            "setup": ms(self.setup),
            "unwrap": ms(self.unwrap),
            "files": ms(self.files),
            "commit": ms(self.commit),
            "other": ms(self.other),
        })
    }
}

/// The engine's line of `-v`: CPU time summed over threads.
fn engine_line(e: &TimingsSnapshot) -> String {
    let ms = WallSplit::ms;
    format!(
        "tpmcrypt: in the files: aes {:.2} ms cpu over {} thread(s) ({} segment(s)), read {:.2} ms, write {:.2} ms (summed over threads)",
        ms(e.crypto),
        e.peak_threads,
        e.segments,
        ms(e.read),
        ms(e.write)
    )
}

fn finish(
    summary: Summary,
    plan: &files::Plan,
    ui: &Ui,
    verb: &str,
    unwraps: Option<(u64, u64)>,
    timing: Timing,
    stats_json: Option<&statsfile::Target>,
) -> anyhow::Result<i32> {
    let wall = WallSplit::of(&timing, summary.durable_wait);
    if let Some(target) = stats_json {
        write_stats(target, &summary, plan, verb, unwraps, &timing, &wall)?;
    }
    if ui.verbose {
        for s in &summary.skipped {
            stderr_line!("tpmcrypt: skipped {}: {}", crate::ui::shown(&s.path), s.why);
        }
        let mut line = format!(
            "tpmcrypt: {verb} {} file(s), {} bytes",
            summary.ok, summary.bytes
        );
        let skipped = plan.skipped.len() + summary.skipped.len();
        if skipped > 0 {
            line.push_str(&format!(", {skipped} skipped"));
        }
        line.push_str(&format!(", {} failed", summary.failed));
        if let Some((n, tpm)) = unwraps {
            line.push_str(&format!(", {n} session key unwrap(s), {tpm} TPM unbind(s)"));
        }
        stderr_line!("{line}");
        let secs = wall.total.as_secs_f64();
        let mut split = format!(
            "tpmcrypt: {secs:.3} s ({:.0} files/s, {:.1} MB/s); committing (sync, rename, remove originals) {:.3} s",
            summary.ok as f64 / secs.max(1e-9),
            summary.bytes as f64 / 1e6 / secs.max(1e-9),
            summary.durable_wait.as_secs_f64()
        );
        if let Some(tpm) = timing.tpm {
            split.push_str(&format!("; TPM {:.1} ms", tpm.as_secs_f64() * 1e3));
        }
        stderr_line!("{split}");
        stderr_line!("{}", wall.line());
        stderr_line!("{}", engine_line(&timing.engine));
    }
    Ok(summary.first_code.unwrap_or(crate::ui::exit::OK))
}

/// `--stats-json FILE`: the figures of `-v` as JSON (documented in
/// docs/bench.md), written whole or not at all.
fn write_stats(
    target: &statsfile::Target,
    summary: &Summary,
    plan: &files::Plan,
    verb: &str,
    unwraps: Option<(u64, u64)>,
    timing: &Timing,
    wall: &WallSplit,
) -> anyhow::Result<()> {
    let secs = wall.total.as_secs_f64();
    let e = &timing.engine;
    let stats = serde_json::json!({
        "command": if verb == "encrypted" { "encrypt" } else { "decrypt" },
        "files_ok": summary.ok,
        "files_failed": summary.failed,
        "files_skipped": plan.skipped.len() + summary.skipped.len(),
        "bytes": summary.bytes,
        "seconds": secs,
        "files_per_second": summary.ok as f64 / secs.max(1e-9),
        "commit_seconds": summary.durable_wait.as_secs_f64(),
        "session_key_unwraps": unwraps.map(|u| u.0),
        "tpm_unbinds": unwraps.map(|u| u.1),
        "tpm_ms": timing.tpm.map(|t| t.as_secs_f64() * 1e3),
        "session": timing.session,
        "aes_cpu_ms": WallSplit::ms(e.crypto),
        "aes_threads": e.peak_threads,
        "segments": e.segments,
        "read_ms": WallSplit::ms(e.read),
        "write_ms": WallSplit::ms(e.write),
        "wall_ms": wall.json(),
    });
    let text = serde_json::to_string_pretty(&stats)? + "\n";
    statsfile::write(target, &text)
}

/// Refuses an output over `keys` (the run's -i or -R files), its
/// `--pin-file` or into the keystore (see
/// [`files::refuse_outputs_over_key_files`]).
fn refuse_outputs_over_keys<'a>(
    plan: &files::Plan,
    files: &FileArgs,
    ui: &'a Ui,
    mut keys: Vec<files::KeyFile<'a>>,
) -> anyhow::Result<()> {
    keys.extend(files::KeyFile::named(
        "PIN",
        "--pin-file",
        ui.pin_file.as_deref(),
    ));
    files::refuse_outputs_over_key_files(
        plan,
        files.in_place,
        &keys,
        crate::keys::decrypt_keystore_dir(ui).as_deref(),
    )
}

/// Checks `--stats-json`, if given, against the plan: before any work.
fn stats_target(files: &FileArgs, plan: &files::Plan) -> anyhow::Result<Option<statsfile::Target>> {
    files
        .stats_json
        .as_deref()
        .map(|p| statsfile::check(p, plan, files))
        .transpose()
}

/// Runs `encrypt`.
pub fn encrypt(args: &EncryptArgs, ui: &Ui) -> anyhow::Result<i32> {
    let start = std::time::Instant::now();
    let params = options::params(args.mode, args.bits, args.segment_size)?;
    let plaintext_from_stdin = args.files.inputs.is_empty()
        || args
            .files
            .inputs
            .iter()
            .any(|p| keys::is_stdin(p.as_os_str()));
    let recipients = options::recipients(
        ui,
        &options::RecipientFlags {
            recipients: &args.recipients,
            keys: &args.keys,
            plaintext_from_stdin,
        },
    )?;
    encrypt_to(args, ui, start, params, &recipients)
}

/// The rest of `encrypt` once the recipients are read (the front
/// executable reads recovery recipients alone, see [`crate::front`]).
pub(crate) fn encrypt_to(
    args: &EncryptArgs,
    ui: &Ui,
    start: Instant,
    params: tpmcrypt_cipher::Params,
    recipients: &[Box<dyn tpmcrypt_cipher::recipient::Recipient>],
) -> anyhow::Result<i32> {
    let plan = files::plan(&args.files, Naming::Encrypt)?;
    let recipients_files =
        files::KeyFile::named("recipients", "-R", args.recipients.iter().map(Path::new));
    refuse_outputs_over_keys(&plan, &args.files, ui, recipients_files)?;
    let stats = stats_target(&args.files, &plan)?;
    let (mut encryptor, source) =
        crate::commands::agent::encryptor(recipients, params, !args.new_session)?;
    if let Some(b) = options::backend(args.files.backend, Some(&params))? {
        encryptor = encryptor.with_backend(b);
    }
    // Armor is text: it may go to a terminal.
    let refuse_tty = !args.allow_tty && !args.armor;
    let opts = run_options(&args.files, ui, refuse_tty, Holds::Ciphertext);
    report_skipped(&plan, ui);
    let setup = start.elapsed();
    let summary = files::run(&plan.tasks, &opts, &|input, output, stream| {
        if args.armor {
            encryptor.encrypt_file_armored(input, output, stream)
        } else {
            encryptor.encrypt_file(input, output, stream)
        }
    });
    let files_wall = start.elapsed() - setup;
    let summary = with_walk_failures(summary, &plan);
    if ui.verbose {
        stderr_line!("tpmcrypt: encrypted in {}", source.describe());
    }
    finish(
        summary,
        &plan,
        ui,
        "encrypted",
        None,
        Timing {
            start,
            setup,
            files: files_wall,
            unwrap: Duration::ZERO,
            tpm: None,
            session: Some(source.token()),
            engine: opts.timings.snapshot(),
        },
        stats.as_ref(),
    )
}

/// Runs `decrypt`.
pub fn decrypt(args: &DecryptArgs, ui: &Ui) -> anyhow::Result<i32> {
    let start = std::time::Instant::now();
    let options::Identities {
        list: identities,
        access,
    } = options::identities(ui, &args.identities)?;
    let cache = || {
        Some(Box::new(crate::commands::agent::cache()) as Box<dyn tpmcrypt_cipher::SessionCache>)
    };
    decrypt_with(
        args,
        ui,
        start,
        identities,
        &cache,
        &|_, _| Ok(()),
        &Tpm(ui, &access),
    )
}

/// What a decrypt reports of the TPM its keystore keys use.
pub(crate) trait TpmUse {
    /// Whether the run opened the TPM.
    fn is_open(&self) -> bool;
    /// The TPM opened, for `-v`.
    fn describe(&self) -> String;
    /// The signed policies the run's keys were used under.
    fn signed_policies_used(&self) -> Vec<String>;
    /// How many unbinds the TPM did.
    fn unbind_count(&self) -> u64;
    /// How long the run waited for the TPM.
    fn busy(&self) -> Duration;
}

/// The keystore's TPM as [`TpmUse`].
struct Tpm<'a>(&'a Ui, &'a tpmcrypt_tpmkey::identity::TpmAccess);

impl TpmUse for Tpm<'_> {
    fn is_open(&self) -> bool {
        self.1.is_open()
    }
    fn describe(&self) -> String {
        crate::tpm::describe(self.0, self.1)
    }
    fn signed_policies_used(&self) -> Vec<String> {
        self.1.signed_policies_used()
    }
    fn unbind_count(&self) -> u64 {
        self.1.unbind_count()
    }
    fn busy(&self) -> Duration {
        self.1.busy()
    }
}

/// The rest of `decrypt` once the identities are read (the front
/// executable passes `-i` identities alone and no TPM, see
/// [`crate::front`]).
pub(crate) fn decrypt_with(
    args: &DecryptArgs,
    ui: &Ui,
    start: Instant,
    identities: Vec<Box<dyn tpmcrypt_cipher::recipient::Identity>>,
    cache: &dyn Fn() -> Option<Box<dyn tpmcrypt_cipher::SessionCache>>,
    check: &dyn Fn(&files::Plan, &Decryptor) -> anyhow::Result<()>,
    access: &dyn TpmUse,
) -> anyhow::Result<i32> {
    let plan = files::plan(&args.files, Naming::Decrypt)?;
    let identity_files = files::KeyFile::named(
        "identity",
        "-i",
        args.identities.iter().map(PathBuf::as_path),
    );
    refuse_outputs_over_keys(&plan, &args.files, ui, identity_files)?;
    let stats = stats_target(&args.files, &plan)?;
    let mut decryptor = Decryptor::new(identities);
    if let Some(cache) = cache() {
        decryptor = decryptor.with_session_cache(cache);
    }
    if let Some(b) = options::backend(args.files.backend, None)? {
        decryptor = decryptor.with_backend(b);
    }
    // What the check fetched is the run's unwrap: timed with the files.
    let checking = Instant::now();
    check(&plan, &decryptor)?;
    let checked = checking.elapsed();
    let opts = run_options(&args.files, ui, false, Holds::Plaintext);
    report_skipped(&plan, ui);
    let setup = start.elapsed().saturating_sub(checked);
    let summary = files::run(&plan.tasks, &opts, &|input, output, stream| {
        decryptor.decrypt_any_file(input, output, stream)
    });
    let files_wall = start.elapsed() - setup;
    let summary = with_walk_failures(summary, &plan);
    if ui.verbose && access.is_open() {
        stderr_line!("tpmcrypt: TPM {}", access.describe());
    }
    if ui.verbose {
        for used in access.signed_policies_used() {
            stderr_line!("tpmcrypt: the TPM key was used under its {used}");
        }
    }
    finish(
        summary,
        &plan,
        ui,
        "decrypted",
        Some((decryptor.unwrap_count(), access.unbind_count())),
        Timing {
            start,
            setup,
            files: files_wall,
            unwrap: decryptor.unwrap_time(),
            tpm: Some(access.busy()),
            session: None,
            engine: opts.timings.snapshot(),
        },
        stats.as_ref(),
    )
}
