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

mod bulk;
mod load;
mod matrix;
mod peers;
mod perfile;
mod plot;
mod report;
mod stats;
mod sysinfo;
mod tpm;

use std::io::{BufRead, BufReader, IsTerminal};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context as _};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use self::bulk::{Plan, Series, HARDWARE, SOFTWARE};
use self::report::{Config, Matrix, Results, SoftwareAes, UnbindSource, CHIPS};

/// `OPENSSL_ia32cap` value that clears AES-NI (CPUID.1:ECX bit 25 → bit 57)
/// and PCLMULQDQ (CPUID.1:ECX bit 1 → bit 33) for OpenSSL 3.
pub const SOFTWARE_MASK: &str = "~0x200000200000000";

const RUSTCRYPTO_NOTE: &str = "software AES is measured with OpenSSL only: RustCrypto's `aes` \
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
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = parse_size)]
    pub sizes: Option<Vec<u64>>,

    /// Timed repetitions per point, and rounds of TPM operations
    /// [default: 7, or 3 with --quick].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub repeat: Option<u32>,

    /// A short run (under a minute): small sizes, few repeats, trimmed
    /// matrix.
    #[arg(long)]
    pub quick: bool,

    /// Write every result as JSON (schema: docs/bench.schema.json).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,

    /// Write every result as CSV (one line per value).
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,

    /// Draw the figure (.svg or .png).
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,

    /// Project the split onto a TPM whose unbind takes this long (ms).
    #[arg(long, value_name = "MS")]
    pub unbind_ms: Option<f64>,

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

fn chip_names() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(CHIPS.iter().map(|c| c.name))
}

/// Parses `16K`, `1M`, `1G`, `16KiB`, `4096`.
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let upper = t.to_ascii_uppercase();
    let digits_end = upper
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(upper.len());
    let (num, unit) = upper.split_at(digits_end);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{t:?}: expected a size like 16K, 1M or 1G"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        "G" | "GB" | "GIB" => 1 << 30,
        _ => return Err(format!("{t:?}: unknown unit (use K, M or G)")),
    };
    let v = n
        .checked_mul(mult)
        .ok_or_else(|| format!("{t:?}: too large"))?;
    if v == 0 || v > 4 << 30 {
        return Err(format!("{t:?}: sizes must be between 1 byte and 4G"));
    }
    Ok(v)
}

/// What the parent asks the child to do.
#[derive(Serialize, Deserialize)]
struct ChildPlan {
    sizes: Vec<u64>,
    repeat: u32,
    warmup: u32,
    min_sample_ms: f64,
    matrix: bool,
    quick: bool,
}

/// What the child prints on stdout.
#[derive(Serialize, Deserialize)]
struct ChildOut {
    openssl_version: String,
    openssl_ia32cap: Option<String>,
    series: Vec<Series>,
    matrix: Vec<matrix::Cell>,
}

/// A private directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> anyhow::Result<TempDir> {
        use std::os::unix::fs::DirBuilderExt;
        let base = std::env::temp_dir();
        for i in 0..100u32 {
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0);
            let p = base.join(format!(
                "tpmcrypt-bench-{}-{nanos:x}-{i}",
                std::process::id()
            ));
            match std::fs::DirBuilder::new().mode(0o700).create(&p) {
                Ok(()) => return Ok(TempDir(p)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e).with_context(|| p.display().to_string()),
            }
        }
        bail!("cannot create a temporary directory in {}", base.display())
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the benchmark.
pub fn run(args: &BenchArgs, ui: &crate::Ui) -> anyhow::Result<i32> {
    if let Some(BenchCommand::Watch(load)) = &args.command {
        return load::run_load(load);
    }
    if let Some(plan) = &args.child {
        return run_child(plan);
    }
    if let Some(ms) = args.unbind_ms {
        if !(ms.is_finite() && ms > 0.0) {
            return Err(crate::exit::usage("--unbind-ms must be a positive number"));
        }
    }
    if let Some(p) = &args.plot {
        let ok = p
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e.eq_ignore_ascii_case("svg") || e.eq_ignore_ascii_case("png"));
        if !ok {
            return Err(crate::exit::usage(
                "--plot: the file must end in .svg or .png",
            ));
        }
    }
    let started = Instant::now();
    let clock = stats::TscClock::start();
    let quick = args.quick;
    let mut sizes = args.sizes.clone().unwrap_or_else(|| default_sizes(quick));
    sizes.sort_unstable();
    sizes.dedup();
    let repeat = args.repeat.unwrap_or(if quick { 3 } else { 7 });
    let plan = Plan {
        sizes: sizes.clone(),
        repeat,
        warmup: if quick { 1 } else { 2 },
        min_sample_ms: if quick { 2.0 } else { 5.0 },
    };
    let tmp = TempDir::new()?;
    let src = bulk::random_source()?;
    let mut warnings = Vec::new();

    // TPM source: never fall back to the simulator silently.
    // The TPM comes from the global --tpm/TPMCRYPT_TCTI and
    // --simulator/TPMCRYPT_SIMULATOR flags.
    let tpm_source = if ui.simulator {
        if ui.tpm.is_some() {
            warnings.push("--simulator given: the TCTI from --tpm/TPMCRYPT_TCTI is ignored".into());
        }
        tpm::Source::Simulator
    } else if let Some(t) = &ui.tpm {
        tpm::Source::Tcti(t.clone())
    } else {
        tpm::Source::Default
    };
    let explicit_tpm = !matches!(tpm_source, tpm::Source::Default);

    // Progress.
    let hw_pairs = bulk::hardware_pairs();
    let sw_pairs = bulk::software_pairs();
    let mplan = matrix::MatrixPlan::new(quick);
    let peer_sizes = peer_sizes(&sizes, quick);
    let steps = u64::from(repeat) * 4
        + ((hw_pairs.len() + sw_pairs.len()) * sizes.len() * 2) as u64
        + if args.no_matrix {
            0
        } else {
            mplan.cells() as u64 * 2
        }
        + if args.no_peers {
            0
        } else {
            (peers::TOOLS.len() * peer_sizes.len()) as u64
        }
        + if args.no_per_file {
            0
        } else {
            perfile::steps()
        };
    let bar = if !ui.quiet && std::io::stderr().is_terminal() {
        let b = ProgressBar::new(steps);
        b.set_style(
            ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        b
    } else {
        ProgressBar::hidden()
    };
    let mut tick = |msg: &str| {
        bar.set_message(msg.to_string());
        bar.inc(1);
    };

    // 1. TPM.
    bar.set_message("TPM");
    let tpm_res = tpm::run(&tpm_source, &tmp.0.join("swtpm"), repeat, &mut tick);
    if !tpm_res.available {
        let hint = match tpm_source {
            tpm::Source::Default => {
                " — use --tpm TCTI for another TPM, or --simulator for a software TPM (not a chip's timings)"
            }
            _ => "",
        };
        warnings.push(format!(
            "no TPM measured: {}{hint}; the split below uses projections only",
            tpm_res.reason.as_deref().unwrap_or("unknown reason")
        ));
    } else if let Some(r) = &tpm_res.reason {
        warnings.push(format!("TPM measurement stopped early: {r}"));
    }
    if tpm_res.is_simulator == Some(true) {
        warnings.push(
            "the TPM measured is a simulator (swtpm): its times are software on this CPU, \
             not a TPM chip's; see the projections for hardware TPMs"
                .into(),
        );
    }
    if tpm_res.unbinds_performed != tpm_res.unbind_count {
        warnings.push(format!(
            "unbind count mismatch: performed {}, Tpm::unbind_count() {}",
            tpm_res.unbinds_performed, tpm_res.unbind_count
        ));
    }

    // 2. Bulk, hardware.
    let mut all_series = Vec::new();
    for (b, mode) in &hw_pairs {
        let [e, d] = bulk::run_pair(&plan, &src, b, *mode, HARDWARE, &mut tick)
            .with_context(|| format!("bulk {} {}", b.name(), mode.name()))?;
        all_series.push(e);
        all_series.push(d);
    }
    let hz_parent = clock.hz();
    for s in &mut all_series {
        s.finish(hz_parent);
    }

    // 2b. Bulk, software (child), and the software half of the matrix.
    bar.set_message("software AES (child process)");
    let child_plan = ChildPlan {
        sizes: sizes.clone(),
        repeat,
        warmup: plan.warmup,
        min_sample_ms: plan.min_sample_ms,
        matrix: !args.no_matrix,
        quick,
    };
    let mut software = SoftwareAes {
        available: false,
        method: format!(
            "child process (this binary, hidden `bench --child` mode) with OPENSSL_ia32cap={SOFTWARE_MASK}: \
             OpenSSL without AES-NI and PCLMULQDQ"
        ),
        openssl_ia32cap: SOFTWARE_MASK.into(),
        child_openssl_version: None,
        mask_slowdown: None,
        mask_verified: false,
        reason: None,
        rustcrypto_note: RUSTCRYPTO_NOTE.into(),
    };
    let mut sw_cells = Vec::new();
    match spawn_child(&child_plan, &bar) {
        Ok(out) => {
            software.available = true;
            software.child_openssl_version = Some(out.openssl_version);
            if out.openssl_ia32cap.as_deref() != Some(SOFTWARE_MASK) {
                software.reason = Some("the child did not see OPENSSL_ia32cap".into());
            }
            let mut sw = out.series;
            for s in &mut sw {
                s.finish(hz_parent);
            }
            all_series.extend(sw);
            sw_cells = out.matrix;
        }
        Err(e) => {
            software.reason = Some(format!("{e:#}"));
            warnings.push(format!("software AES not measured: {e:#}"));
        }
    }
    // The mask must really slow OpenSSL down: raw CBC decryption (which
    // AES-NI pipelines) at the largest size.
    let largest = sizes.last().copied().unwrap_or(0);
    let hw_raw = all_series
        .iter()
        .find(|s| s.id == format!("{HARDWARE}/openssl/cbc-raw/decrypt"))
        .and_then(|s| s.at(largest));
    let sw_raw = all_series
        .iter()
        .find(|s| s.id == format!("{SOFTWARE}/openssl/cbc-raw/decrypt"))
        .and_then(|s| s.at(largest));
    if let (Some(h), Some(s)) = (hw_raw, sw_raw) {
        // Fastest samples: the least disturbed by other load.
        let r = s.time.min_ms / h.time.min_ms;
        software.mask_slowdown = Some(r);
        software.mask_verified = r >= 1.5;
        if !software.mask_verified && sysinfo::has_aes_ni() {
            warnings.push(format!(
                "OPENSSL_ia32cap={SOFTWARE_MASK} did not slow OpenSSL's AES down ({r:.2}×): \
                 the 'software' figures may still use AES-NI"
            ));
        }
    }
    if !sysinfo::has_aes_ni() {
        warnings
            .push("this CPU has no AES-NI: 'hardware' and 'software' are both software AES".into());
    }

    // 4. Matrix (hardware half here).
    let matrix = if args.no_matrix {
        Matrix {
            available: false,
            reason: Some("--no-matrix".into()),
            rows: Vec::new(),
        }
    } else {
        let hw_cells = matrix::run(&mplan, &mut tick).context("mode × key matrix")?;
        Matrix {
            available: true,
            reason: None,
            rows: matrix::join(&hw_cells, &sw_cells),
        }
    };

    // 6. Peers.
    let peer_results = if args.no_peers {
        Vec::new()
    } else {
        bar.set_message("other tools");
        peers::run(
            &tmp.0,
            &peer_sizes,
            if quick { repeat.min(2) } else { repeat.min(5) },
            &src,
            &mut tick,
        )
    };
    for p in &peer_results {
        if !p.available {
            warnings.push(format!(
                "{} skipped: {}",
                p.tool,
                p.reason.as_deref().unwrap_or("?")
            ));
        }
    }
    // 7. Per file, through the command line.
    let per_file = if args.no_per_file {
        perfile::PerFile {
            available: false,
            reason: Some("--no-per-file".into()),
            commands: Vec::new(),
            points: Vec::new(),
        }
    } else {
        bar.set_message("per file");
        perfile::run(&tmp.0, quick, &src, &mut tick)
    };
    if let (false, Some(r)) = (args.no_per_file, &per_file.reason) {
        warnings.push(format!("per-file series not measured: {r}"));
    }
    bar.finish_and_clear();

    // 3 + 5. Unbind sources, split, crossovers, projections.
    let mut system = sysinfo::collect();
    system.tsc_hz = clock.hz();
    for s in &mut all_series {
        // Re-derive cycles/B with the whole-run calibration.
        s.finish(system.tsc_hz);
    }
    let unbind_sources = unbind_sources(&tpm_res, args);
    if unbind_sources.iter().any(|s| s.projection) {
        warnings.push(
            "PROJECTION rows combine this machine's AES timings with unbind times that were not \
             measured here (--unbind-ms, --chip, the study's TPM 1.2); chip values are points \
             within published ranges, not measurements of a product"
                .into(),
        );
    }
    let noisy: Vec<String> = all_series
        .iter()
        .flat_map(|s| {
            s.points
                .iter()
                .filter(|p| p.time.noisy)
                .map(move |p| format!("{} @ {}", s.id, report::human_size(p.size)))
        })
        .collect();
    if !noisy.is_empty() {
        let total: usize = all_series.iter().map(|s| s.points.len()).sum();
        warnings.push(format!(
            "{} of {total} bulk points are noisy (max/min > {}), marked '!': {}{}",
            noisy.len(),
            stats::NOISY_RATIO,
            noisy.iter().take(8).cloned().collect::<Vec<_>>().join(", "),
            if noisy.len() > 8 { ", …" } else { "" }
        ));
    }

    let mut results = Results {
        schema_version: report::SCHEMA_VERSION,
        started_unix: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
            .saturating_sub(started.elapsed().as_secs()),
        duration_s: 0.0,
        config: Config {
            quick,
            sizes: sizes.clone(),
            repeat,
            warmup: plan.warmup,
            min_sample_ms: plan.min_sample_ms,
            workers: 1,
            noisy_ratio: stats::NOISY_RATIO,
        },
        system,
        tpm: tpm_res,
        software_aes: software,
        bulk: all_series,
        speedup: Vec::new(),
        unbind_sources,
        split: Vec::new(),
        crossover: Vec::new(),
        matrix,
        peers: peer_results,
        per_file,
        warnings,
    };
    results.derive();

    if let Some(p) = &args.plot {
        plot::render(p, &plot_data(&results)).with_context(|| p.display().to_string())?;
    }
    results.duration_s = started.elapsed().as_secs_f64();
    print!("{}", results.table());
    if let Some(p) = &args.json {
        let text = serde_json::to_string_pretty(&results)?;
        std::fs::write(p, text + "\n").with_context(|| p.display().to_string())?;
    }
    if let Some(p) = &args.csv {
        std::fs::write(p, results.csv()?).with_context(|| p.display().to_string())?;
    }
    drop(tmp);
    if explicit_tpm && !results.tpm.available {
        return Ok(crate::exit::TPM);
    }
    Ok(crate::exit::OK)
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
    if let Some(ms) = args.unbind_ms {
        v.push(UnbindSource {
            id: "unbind-ms".into(),
            label: format!("--unbind-ms {ms}"),
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

fn plot_data(r: &Results) -> plot::PlotData {
    let src = r.unbind_sources.first();
    let unbind_label = src
        .map(|s| {
            format!(
                "{}{}: {:.1} ms",
                if s.projection {
                    "PROJECTION, "
                } else {
                    "measured, "
                },
                s.id,
                s.unbind_ms
            )
        })
        .unwrap_or_else(|| "no unbind".into());
    let share = |aes: &str, size: u64| {
        let s = src?;
        r.split
            .iter()
            .find(|x| {
                x.unbind_source == s.id
                    && x.aes == aes
                    && x.mode == "cbc-hs512"
                    && x.size == size
                    && x.files_per_session == 1
            })
            .map(|x| x.tpm_share_pct)
    };
    let bars = r
        .config
        .sizes
        .iter()
        .filter_map(|&size| {
            Some(plot::Bar {
                size,
                hw_tpm_pct: share(HARDWARE, size)?,
                sw_tpm_pct: share(SOFTWARE, size),
            })
        })
        .collect();
    let mut curves = Vec::new();
    for id in [
        "hardware/openssl/cbc-raw/decrypt",
        "hardware/openssl/cbc-hs512/decrypt",
        "hardware/openssl/gcm/decrypt",
        "hardware/ring/gcm/decrypt",
        "software/openssl/cbc-raw/decrypt",
        "software/openssl/cbc-hs512/decrypt",
        "software/openssl/gcm/decrypt",
    ] {
        if let Some(s) = r.series(id) {
            curves.push(plot::Curve {
                label: format!(
                    "{} {} ({})",
                    if s.aes == HARDWARE {
                        "AES-NI"
                    } else {
                        "software"
                    },
                    s.mode,
                    s.backend
                ),
                points: s
                    .points
                    .iter()
                    .map(|p| (p.size as f64, p.mb_per_s))
                    .collect(),
                software: s.aes == SOFTWARE,
            });
        }
    }
    if let (Some(src), Some(s)) = (src, r.series("hardware/openssl/cbc-hs512/decrypt")) {
        curves.push(plot::Curve {
            label: format!("AES-NI cbc-hs512 + one unbind ({:.1} ms)", src.unbind_ms),
            points: s
                .points
                .iter()
                .map(|p| {
                    (
                        p.size as f64,
                        p.size as f64 / ((p.time.median_ms + src.unbind_ms) / 1e3) / 1e6,
                    )
                })
                .collect(),
            software: false,
        });
    }
    plot::PlotData {
        title: format!(
            "tpmcrypt bench — {} — tpmcrypt {}",
            r.system.cpu_model, r.system.tpmcrypt_version
        ),
        unbind_label,
        bars,
        curves,
    }
}

/// Runs this binary as the software-AES child and collects its results.
fn spawn_child(plan: &ChildPlan, bar: &ProgressBar) -> anyhow::Result<ChildOut> {
    let exe = std::env::current_exe().context("locating this executable")?;
    let mut child = Command::new(exe)
        .args(["bench", "--child", &serde_json::to_string(plan)?])
        .env("OPENSSL_ia32cap", SOFTWARE_MASK)
        .env_remove("TPMCRYPT_SIMULATOR")
        .env_remove("TPMCRYPT_TCTI")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the software-AES child process")?;
    let stderr = child.stderr.take();
    let bar2 = bar.clone();
    let errs = std::thread::spawn(move || {
        let mut other = String::new();
        if let Some(e) = stderr {
            for line in BufReader::new(e).lines().map_while(Result::ok) {
                if let Some(msg) = line.strip_prefix("@tick ") {
                    bar2.set_message(format!("software: {msg}"));
                    bar2.inc(1);
                } else {
                    other.push_str(&line);
                    other.push('\n');
                }
            }
        }
        other
    });
    let mut out = String::new();
    if let Some(mut s) = child.stdout.take() {
        std::io::Read::read_to_string(&mut s, &mut out).context("reading the child's output")?;
    }
    let status = child.wait()?;
    let errs = errs.join().unwrap_or_default();
    if !status.success() {
        bail!("the software-AES child failed ({status}): {}", errs.trim());
    }
    serde_json::from_str(&out).map_err(|e| anyhow!("the software-AES child's output: {e}"))
}

/// The child: software series and the software half of the matrix.
fn run_child(plan_json: &str) -> anyhow::Result<i32> {
    let p: ChildPlan =
        serde_json::from_str(plan_json).map_err(|e| crate::exit::usage(format!("--child: {e}")))?;
    let plan = Plan {
        sizes: p.sizes,
        repeat: p.repeat,
        warmup: p.warmup,
        min_sample_ms: p.min_sample_ms,
    };
    let src = bulk::random_source()?;
    let mut tick = |msg: &str| eprintln!("@tick {msg}");
    let mut series = Vec::new();
    for (b, mode) in bulk::software_pairs() {
        let [e, d] = bulk::run_pair(&plan, &src, &b, mode, SOFTWARE, &mut tick)?;
        series.push(e);
        series.push(d);
    }
    let cells = if p.matrix {
        matrix::run(&matrix::MatrixPlan::new(p.quick), &mut tick)?
    } else {
        Vec::new()
    };
    let out = ChildOut {
        openssl_version: openssl::version::version().to_string(),
        openssl_ia32cap: std::env::var("OPENSSL_ia32cap").ok(),
        series,
        matrix: cells,
    };
    println!("{}", serde_json::to_string(&out)?);
    Ok(crate::exit::OK)
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
