//! `tpmcrypt bench`: where the time of a TPM-bound file encryption goes.
//!
//! 1. TPM costs (key creation, one unbind) on a real TPM or a private swtpm;
//! 2. bulk AES by file size through the real streaming engine, with AES-NI
//!    and with AES-NI/CLMUL masked (a child process with `OPENSSL_ia32cap`);
//! 3. the split of one file's decryption into unbind and bulk AES, per file
//!    and amortised over a session, and the crossover size;
//! 4. a mode × key-size matrix at packet sizes (OpenSSL EVP);
//! 5. a model (overhead + size / bandwidth) and projections onto TPM chips;
//! 6. other tools on the same files, when installed;
//! 7. per file through the command line: `encrypt -r`/`decrypt -r` of
//!    trees of small files, split into unwrap, AES, I/O and durability.
//!
//! Described in docs/bench.md; JSON schema in docs/bench.schema.json.
//!
//! Layout: `engine.rs` measures (each part in its own module: `tpm`,
//! `bulk`, `child` for software AES, `matrix`, `peers`, `perfile`) and
//! returns `report::Results`; `report/` derives the split and prints or
//! writes it (`text.rs`, `csv.rs`; JSON through serde); `plot.rs` draws the
//! figure. `load.rs` is `bench watch`, which runs the watch daemon as a
//! child process. All of it is behind the `bench` cargo feature.

mod bulk;
mod child;
mod engine;
mod load;
mod matrix;
mod outputs;
mod peers;
mod perfile;
mod plot;
mod report;
mod stats;
mod sysinfo;
mod tpm;

use std::path::{Component, Path, PathBuf};
use std::time::Instant;

use anyhow::Context as _;
use clap::Args;

use self::report::{UnbindSource, CHIPS};

/// `OPENSSL_ia32cap` value that clears AES-NI (CPUID.1:ECX bit 25 → bit 57)
/// and PCLMULQDQ (CPUID.1:ECX bit 1 → bit 33) for OpenSSL 3.
pub const SOFTWARE_MASK: &str = "~0x200000200000000";

pub(crate) const RUSTCRYPTO_NOTE: &str =
    "software AES is measured with OpenSSL only: RustCrypto's `aes` \
    picks its software path only at compile time (cfg aes_force_soft) and ring has no switch, \
    so their software speed cannot be measured at run time";

/// Benchmarks other than the default one.
#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand {
    /// Load-test the watch daemon: Poisson arrivals at --rate, measured
    /// latency and throughput beside the M/M/c queueing model.
    Watch(load::LoadArgs),
}

/// `tpmcrypt bench`.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    /// A different benchmark.
    #[command(subcommand)]
    pub command: Option<BenchCommand>,

    /// File sizes, comma-separated, with K/M/G suffixes (powers of 1024),
    /// e.g. 16K,1M,64M [default: 16K, 32K … 16M, 64M, 256M, 1G].
    #[arg(long, value_name = "SIZES", value_delimiter = ',', value_parser = parse_size)]
    pub sizes: Option<Vec<u64>>,

    /// Timed repetitions per point, and rounds of TPM operations
    /// [default: 7, or 3 with --quick].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub repeat: Option<u32>,

    /// A short run (under a minute): small sizes, few repeats, trimmed
    /// matrix.
    #[arg(long)]
    pub quick: bool,

    /// Print every result as JSON on stdout instead of the table (schema:
    /// docs/bench.schema.json); the table goes to stderr.
    #[arg(long)]
    pub json: bool,

    /// Write every result as JSON to FILE (as --json prints it).
    #[arg(long, value_name = "FILE")]
    pub json_file: Option<PathBuf>,

    /// Write every result as CSV (one line per value).
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,

    /// Draw the figure (.svg or .png).
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,

    /// Project the split onto a TPM whose unbind takes this long, e.g.
    /// 300ms, 1.2s.
    #[arg(long, value_name = "DURATION", value_parser = crate::args::value::positive_duration)]
    pub unbind: Option<std::time::Duration>,

    /// Project the split onto a reference TPM: fast, typical, slow (points
    /// within the published TPM 2.0 ranges) or tpm12-study.
    #[arg(long, value_name = "NAME", value_parser = chip_names())]
    pub chip: Option<String>,

    /// Skip the mode × key-size matrix.
    #[arg(long)]
    pub no_matrix: bool,

    /// Skip the other tools (openssl enc, gpg, age, rage).
    #[arg(long)]
    pub no_peers: bool,

    /// Skip the per-file series (encrypt -r / decrypt -r of trees of
    /// 4 KiB, 64 KiB and 1 MiB files through the command line).
    #[arg(long)]
    pub no_per_file: bool,

    /// Internal: the software-AES child process.
    #[arg(long, hide = true, value_name = "JSON")]
    pub child: Option<String>,
}

/// The `tpmcrypt` executable users run (the front, `crate::front`), for
/// the runs the bench times through the command line: beside this one
/// (`cargo install`, a build tree) or `../../bin/tpmcrypt` from
/// `/usr/libexec/tpmcrypt/`; else this executable itself.
fn user_executable() -> std::io::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let front = exe.parent().map(|dir| {
        [dir.join("tpmcrypt"), dir.join("../../bin/tpmcrypt")]
            .into_iter()
            .find(|p| p.is_file())
    });
    Ok(front.flatten().unwrap_or(exe))
}

/// A child of the bench ends with it (`PR_SET_PDEATHSIG`, as swtpm's does:
/// SIGTERM when the thread that started it ends, also by SIGKILL) and
/// creates what it creates for this user only (umask 077): a `bench
/// watch` daemon killed with its bench ran on, orphaned, for ever.
fn dies_with_this_process(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: getpid cannot fail.
    let parent = unsafe { libc::getpid() };
    // SAFETY: only async-signal-safe calls in the child, no allocation.
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            libc::umask(0o077);
            // The bench ended before the prctl took effect.
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

fn chip_names() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(CHIPS.iter().map(|c| c.name))
}

/// Parses `16K`, `1M`, `1G`, `16KiB`, `4096` (the CLI's one size grammar,
/// [`crate::args::value::size`]: powers of 1024), from 1 byte to 4GiB.
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let v = crate::args::value::size(s)?;
    if v == 0 || v > 4 << 30 {
        return Err(format!("{t:?}: sizes must be between 1 byte and 4G"));
    }
    Ok(v)
}

/// Runs the benchmark: measures (the engine), then reports (stdout table,
/// JSON, CSV, plot).
pub fn run(args: &BenchArgs, ui: &crate::ui::Ui) -> anyhow::Result<i32> {
    if let Some(BenchCommand::Watch(load)) = &args.command {
        return load::run_load(load);
    }
    if let Some(plan) = &args.child {
        return child::run(plan);
    }
    check_args(args)?;
    let started = Instant::now();
    let (mut results, explicit_tpm) = engine::measure(args, ui)?;
    results.duration_s = started.elapsed().as_secs_f64();
    let json = serde_json::to_string_pretty(&results)? + "\n";
    // The table first: a report that cannot be written loses nothing else.
    if args.json {
        stderr_text!("{}", results.table());
        crate::ui::stdout::write_all(json.as_bytes())?;
    } else {
        crate::ui::stdout::write_all(results.table().as_bytes())?;
    }
    let mut failed = None;
    for report in outputs::reports(args) {
        let bytes = match report.option {
            "--json-file" => Ok(json.clone().into_bytes()),
            "--csv" => results.csv().map(String::into_bytes).map_err(Into::into),
            _ => plot::render(report.path, &plot::data(&results)),
        };
        let written = bytes
            .with_context(|| format!("{} {}", report.option, crate::ui::shown(report.path)))
            .and_then(|b| report.write(&b));
        // Every report is tried; the first failure is the run's error.
        if let Err(e) = written {
            failed.get_or_insert(e);
        }
    }
    if let Some(e) = failed {
        return Err(e);
    }
    // A TPM asked for (--tpm, --simulator) that could not be used, or
    // failed part-way: the report is out, the run's one line says why.
    if let Some(why) = explicit_tpm.then(|| tpm_failure(&results.tpm)).flatten() {
        stderr_line!("{} {why}", crate::ui::colour::error());
        return Ok(crate::ui::exit::TPM);
    }
    Ok(crate::ui::exit::OK)
}

/// Why the TPM part failed, as the run's error line: not reached, or
/// stopped early (its `reason` once reached).
fn tpm_failure(t: &tpm::TpmResult) -> Option<String> {
    let reason = || crate::ui::printable(t.reason.as_deref().unwrap_or("unknown reason"));
    if !t.available {
        Some(format!("TPM unavailable: {}", reason()))
    } else {
        t.reason
            .as_ref()
            .map(|_| format!("TPM measurement stopped early: {}", reason()))
    }
}

/// Usage errors the flags' parsers cannot see.
fn check_args(args: &BenchArgs) -> anyhow::Result<()> {
    // Report files are written after a run of minutes: two of them at one
    // path would silently leave only the last.
    let outputs = [
        ("--json-file", &args.json_file),
        ("--csv", &args.csv),
        ("--plot", &args.plot),
    ];
    for (i, (a, pa)) in outputs.iter().enumerate() {
        for (b, pb) in &outputs[i + 1..] {
            if let (Some(pa), Some(pb)) = (pa, pb) {
                if same_path(pa, pb) {
                    return Err(crate::ui::exit::usage(format!(
                        "{a} and {b} name the same file ({}): each report needs its own",
                        crate::ui::shown(pa)
                    )));
                }
            }
        }
    }
    if let Some(p) = &args.plot {
        let ok = p
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e.eq_ignore_ascii_case("svg") || e.eq_ignore_ascii_case("png"));
        if !ok {
            return Err(crate::ui::exit::usage(
                "--plot: the file must end in .svg or .png",
            ));
        }
    }
    outputs::check(args)
}

/// Whether two report paths are one file: the same existing file, or the
/// same path once `.` components are dropped (neither exists yet).
fn same_path(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(ma), Ok(mb)) => {
            use std::os::unix::fs::MetadataExt;
            ma.dev() == mb.dev() && ma.ino() == mb.ino()
        }
        _ => {
            let norm = |p: &Path| {
                let parts = p.components().filter(|c| *c != Component::CurDir);
                parts.collect::<PathBuf>()
            };
            norm(a) == norm(b)
        }
    }
}

fn default_sizes(quick: bool) -> Vec<u64> {
    if quick {
        return vec![16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20];
    }
    let mut v: Vec<u64> = (14..=24).map(|e| 1u64 << e).collect();
    v.extend([64 << 20, 256 << 20, 1 << 30]);
    v
}

fn peer_sizes(sizes: &[u64], quick: bool) -> Vec<u64> {
    let v = sizes.iter().copied().filter(|&s| s <= peers::MAX_PEER_SIZE);
    if quick {
        // Smallest and largest only.
        let v: Vec<u64> = v.collect();
        let mut out: Vec<u64> = v.first().into_iter().chain(v.last()).copied().collect();
        out.dedup();
        out
    } else {
        // Every fourth size (and the largest) keeps the process count sane.
        let v: Vec<u64> = v.collect();
        let mut out: Vec<u64> = v.iter().step_by(4).copied().collect();
        if let Some(&l) = v.last() {
            if out.last() != Some(&l) {
                out.push(l);
            }
        }
        out
    }
}

fn unbind_sources(t: &tpm::TpmResult, args: &BenchArgs) -> Vec<UnbindSource> {
    let mut v = Vec::new();
    if t.available {
        let what = format!(
            "{} {}{}",
            t.manufacturer.as_deref().unwrap_or("?"),
            t.firmware_version.as_deref().unwrap_or("?"),
            if t.is_simulator == Some(true) {
                " (swtpm simulator)"
            } else {
                ""
            }
        );
        for (alg, unbind, create) in [
            ("rsa2048", "unbind_rsa2048", "create_rsa2048"),
            ("ecc-p256", "unbind_ecc_p256", "create_ecc_p256"),
        ] {
            if let Some(u) = t.median_ms(unbind) {
                v.push(UnbindSource {
                    id: format!("measured-{alg}"),
                    label: format!("{alg} unbind on {what}"),
                    projection: false,
                    unbind_ms: u,
                    create_ms: t.median_ms(create),
                });
            }
        }
    }
    if let Some(d) = args.unbind {
        let ms = d.as_secs_f64() * 1e3;
        v.push(UnbindSource {
            id: "unbind-ms".into(),
            label: format!("--unbind {}", humantime::format_duration(d)),
            projection: true,
            unbind_ms: ms,
            create_ms: None,
        });
    }
    let mut chips: Vec<&report::Chip> = Vec::new();
    if let Some(c) = args.chip.as_deref().and_then(report::chip) {
        chips.push(c);
    }
    if let Some(study) = report::chip("tpm12-study") {
        if !chips.iter().any(|c| c.name == study.name) {
            chips.push(study);
        }
    }
    for c in chips {
        v.push(UnbindSource {
            id: format!("chip-{}-rsa2048", c.name),
            label: format!("{}: RSA-2048 unbind", c.label),
            projection: true,
            unbind_ms: c.rsa_unbind_ms,
            create_ms: Some(c.rsa_create_ms),
        });
        if c.ecdh_ms.is_finite() {
            v.push(UnbindSource {
                id: format!("chip-{}-ecdh", c.name),
                label: format!("{}: ECDH unbind", c.label),
                projection: true,
                unbind_ms: c.ecdh_ms,
                create_ms: Some(c.ecc_create_ms),
            });
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("16K"), Ok(16384));
        assert_eq!(parse_size("1m"), Ok(1 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("0").is_err());
        assert!(parse_size("5T").is_err());
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999999999999").is_err());
    }

    #[test]
    fn default_sizes_match_the_study() {
        let s = default_sizes(false);
        assert_eq!(s.first(), Some(&(16 << 10)));
        assert!(s.contains(&(16 << 20)));
        assert_eq!(s.last(), Some(&(1 << 30)));
        assert_eq!(s.len(), 14);
    }

    #[test]
    fn peer_sizes_are_capped() {
        let s = peer_sizes(&default_sizes(false), false);
        assert!(s.iter().all(|&x| x <= peers::MAX_PEER_SIZE));
        assert_eq!(s.last(), Some(&peers::MAX_PEER_SIZE));
    }
}
