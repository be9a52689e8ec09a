//! The measuring engine: runs every part of the bench in order (TPM, bulk
//! AES with and without AES-NI, the matrix, other tools, per file) and
//! gathers what it measured, with the warnings a reader needs, into
//! [`Results`]. Printing and writing them is the report's job.

use std::io::IsTerminal;
use std::os::unix::fs::PermissionsExt;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressStyle};
use tempfile::TempDir;

use super::bulk::{self, Plan, Series, HARDWARE, SOFTWARE};
use super::child::{self, ChildPlan};
use super::report::{self, Config, Matrix, Results, SoftwareAes};
use super::{matrix, peers, perfile, stats, sysinfo, tpm};
use super::{BenchArgs, RUSTCRYPTO_NOTE, SOFTWARE_MASK};

/// What every step needs: the settings resolved from the flags, the
/// scratch directory, the random input and the warnings gathered so far.
struct Setup<'a> {
    args: &'a BenchArgs,
    quick: bool,
    sizes: Vec<u64>,
    plan: Plan,
    tmp: TempDir,
    /// An interrupt stops the children working in `tmp` and removes it.
    _interrupt: crate::atomic::ScratchTree,
    src: Vec<u8>,
    mplan: matrix::MatrixPlan,
    peer_sizes: Vec<u64>,
    warnings: Vec<String>,
}

/// Measures everything `args` asks for. Also returns whether the TPM was
/// named explicitly (--tpm, --simulator), in which case not reaching it is
/// an error.
pub fn measure(args: &BenchArgs, ui: &crate::ui::Ui) -> anyhow::Result<(Results, bool)> {
    let started = Instant::now();
    let clock = stats::TscClock::start();
    let mut s = Setup::new(args)?;
    let tpm_source = tpm_source(ui, &mut s.warnings);
    let explicit_tpm = !matches!(tpm_source, tpm::Source::Default);
    let bar = progress_bar(&s, ui);
    let mut tick = |msg: &str| {
        bar.set_message(msg.to_string());
        bar.inc(1);
    };

    // 1. TPM.
    bar.set_message("TPM");
    let tpm_res = tpm::run(
        &tpm_source,
        &s.tmp.path().join("swtpm"),
        s.plan.repeat,
        &mut tick,
    );
    tpm_warnings(&tpm_res, &tpm_source, &mut s.warnings);

    // 2. Bulk, hardware.
    let mut all_series = s.hardware(&mut tick)?;
    let hz_parent = clock.hz();
    for series in &mut all_series {
        series.finish(hz_parent);
    }

    // 2b. Bulk, software (child), and the software half of the matrix.
    bar.set_message("software AES (child process)");
    let (software, sw_cells) = s.software(&bar, hz_parent, &mut all_series);

    // 4. Matrix (hardware half here).
    let matrix = s.matrix(sw_cells, &mut tick)?;
    // 6. Peers.
    if !args.no_peers {
        bar.set_message("other tools");
    }
    let peers = s.peers(&mut tick);
    // 7. Per file, through the command line.
    if !args.no_per_file {
        bar.set_message("per file");
    }
    let per_file = s.per_file(&mut tick);
    bar.finish_and_clear();

    // 3 + 5. Unbind sources, split, crossovers, projections.
    let mut system = sysinfo::collect();
    system.tsc_hz = clock.hz();
    for series in &mut all_series {
        // Re-derive cycles/B with the whole-run calibration.
        series.finish(system.tsc_hz);
    }
    let unbind_sources = super::unbind_sources(&tpm_res, args);
    projection_warning(&unbind_sources, &mut s.warnings);
    noisy_warning(&all_series, &mut s.warnings);

    let mut results = Results {
        schema_version: report::SCHEMA_VERSION,
        started_unix: started_unix(started),
        duration_s: 0.0,
        config: s.config(),
        system,
        tpm: tpm_res,
        software_aes: software,
        bulk: all_series,
        speedup: Vec::new(),
        unbind_sources,
        split: Vec::new(),
        crossover: Vec::new(),
        matrix,
        peers,
        per_file,
        warnings: s.warnings,
    };
    results.derive();
    Ok((results, explicit_tpm))
}

impl Setup<'_> {
    /// Bulk AES with AES-NI, in this process.
    fn hardware(&self, tick: &mut dyn FnMut(&str)) -> anyhow::Result<Vec<Series>> {
        let mut all_series = Vec::new();
        for (b, mode) in &bulk::hardware_pairs() {
            let [e, d] = bulk::run_pair(&self.plan, &self.src, b, *mode, HARDWARE, tick)
                .with_context(|| format!("bulk {} {}", b.name(), mode.name()))?;
            all_series.push(e);
            all_series.push(d);
        }
        Ok(all_series)
    }

    fn new(args: &BenchArgs) -> anyhow::Result<Setup<'_>> {
        let quick = args.quick;
        let mut sizes = args
            .sizes
            .clone()
            .unwrap_or_else(|| super::default_sizes(quick));
        sizes.sort_unstable();
        sizes.dedup();
        let repeat = args.repeat.unwrap_or(if quick { 3 } else { 7 });
        let plan = Plan {
            sizes: sizes.clone(),
            repeat,
            warmup: if quick { 1 } else { 2 },
            min_sample_ms: if quick { 2.0 } else { 5.0 },
        };
        let tmp = tempfile::Builder::new()
            .prefix("tpmcrypt-bench-")
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir()
            .context("creating a temporary directory")?;
        let interrupt = crate::atomic::scratch_on_interrupt(tmp.path(), true)
            .context("setting up the clean-up on interrupts")?;
        Ok(Setup {
            args,
            quick,
            peer_sizes: super::peer_sizes(&sizes, quick),
            sizes,
            plan,
            tmp,
            _interrupt: interrupt,
            src: bulk::random_source()?,
            mplan: matrix::MatrixPlan::new(quick),
            warnings: Vec::new(),
        })
    }

    /// The number of progress steps of the whole run.
    fn steps(&self) -> u64 {
        let pairs = bulk::hardware_pairs().len() + bulk::software_pairs().len();
        let mut steps = u64::from(self.plan.repeat) * 4 + (pairs * self.sizes.len() * 2) as u64;
        if !self.args.no_matrix {
            steps += self.mplan.cells() as u64 * 2;
        }
        if !self.args.no_peers {
            steps += (peers::TOOLS.len() * self.peer_sizes.len()) as u64;
        }
        if !self.args.no_per_file {
            steps += perfile::steps();
        }
        steps
    }

    /// Software AES in the child process, appended to `all_series`, and
    /// the check that the mask slowed OpenSSL down.
    fn software(
        &mut self,
        bar: &ProgressBar,
        hz: Option<f64>,
        all_series: &mut Vec<Series>,
    ) -> (SoftwareAes, Vec<matrix::Cell>) {
        let child_plan = ChildPlan {
            sizes: self.sizes.clone(),
            repeat: self.plan.repeat,
            warmup: self.plan.warmup,
            min_sample_ms: self.plan.min_sample_ms,
            matrix: !self.args.no_matrix,
            quick: self.quick,
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
        match child::spawn(&child_plan, bar) {
            Ok(out) => {
                software.available = true;
                software.child_openssl_version = Some(out.openssl_version);
                if out.openssl_ia32cap.as_deref() != Some(SOFTWARE_MASK) {
                    software.reason = Some("the child did not see OPENSSL_ia32cap".into());
                }
                let mut sw = out.series;
                for s in &mut sw {
                    s.finish(hz);
                }
                all_series.extend(sw);
                sw_cells = out.matrix;
            }
            Err(e) => {
                software.reason = Some(format!("{e:#}"));
                self.warnings
                    .push(format!("software AES not measured: {e:#}"));
            }
        }
        self.check_mask(all_series, &mut software);
        (software, sw_cells)
    }

    /// The mask must really slow OpenSSL down: raw CBC decryption (which
    /// AES-NI pipelines) at the largest size.
    fn check_mask(&mut self, all_series: &[Series], software: &mut SoftwareAes) {
        let largest = self.sizes.last().copied().unwrap_or(0);
        let at = |aes: &str| {
            all_series
                .iter()
                .find(|s| s.id == format!("{aes}/openssl/cbc-raw/decrypt"))
                .and_then(|s| s.at(largest))
        };
        if let (Some(h), Some(s)) = (at(HARDWARE), at(SOFTWARE)) {
            // Fastest samples: the least disturbed by other load.
            let r = s.time.min_ms / h.time.min_ms;
            software.mask_slowdown = Some(r);
            software.mask_verified = r >= 1.5;
            if !software.mask_verified && sysinfo::has_aes_ni() {
                self.warnings.push(format!(
                    "OPENSSL_ia32cap={SOFTWARE_MASK} did not slow OpenSSL's AES down ({r:.2}×): \
                     the 'software' figures may still use AES-NI"
                ));
            }
        }
        if !sysinfo::has_aes_ni() {
            self.warnings.push(
                "this CPU has no AES-NI: 'hardware' and 'software' are both software AES".into(),
            );
        }
    }

    /// The mode × key-size matrix: the hardware half measured here, joined
    /// with the child's software half.
    fn matrix(
        &self,
        sw_cells: Vec<matrix::Cell>,
        tick: &mut dyn FnMut(&str),
    ) -> anyhow::Result<Matrix> {
        if self.args.no_matrix {
            return Ok(Matrix {
                available: false,
                reason: Some("--no-matrix".into()),
                rows: Vec::new(),
            });
        }
        let hw_cells = matrix::run(&self.mplan, tick).context("mode × key matrix")?;
        Ok(Matrix {
            available: true,
            reason: None,
            rows: matrix::join(&hw_cells, &sw_cells),
        })
    }

    /// Other tools on the same files.
    fn peers(&mut self, tick: &mut dyn FnMut(&str)) -> Vec<peers::Peer> {
        if self.args.no_peers {
            return Vec::new();
        }
        let repeat = self.plan.repeat;
        let repeat = if self.quick {
            repeat.min(2)
        } else {
            repeat.min(5)
        };
        let res = peers::run(self.tmp.path(), &self.peer_sizes, repeat, &self.src, tick);
        for p in &res {
            if !p.available {
                self.warnings.push(format!(
                    "{} skipped: {}",
                    p.tool,
                    p.reason.as_deref().unwrap_or("?")
                ));
            }
        }
        res
    }

    /// Trees of small files through the command line.
    fn per_file(&mut self, tick: &mut dyn FnMut(&str)) -> perfile::PerFile {
        if self.args.no_per_file {
            return perfile::PerFile {
                available: false,
                reason: Some("--no-per-file".into()),
                commands: Vec::new(),
                points: Vec::new(),
            };
        }
        let res = perfile::run(self.tmp.path(), self.quick, &self.src, tick);
        if let Some(r) = &res.reason {
            self.warnings
                .push(format!("per-file series not measured: {r}"));
        }
        res
    }

    fn config(&self) -> Config {
        Config {
            quick: self.quick,
            sizes: self.sizes.clone(),
            repeat: self.plan.repeat,
            warmup: self.plan.warmup,
            min_sample_ms: self.plan.min_sample_ms,
            workers: 1,
            noisy_ratio: stats::NOISY_RATIO,
        }
    }
}

/// The TPM source: never fall back to the simulator silently. The TPM
/// comes from the global --tpm/TPMCRYPT_TCTI and
/// --simulator/TPMCRYPT_SIMULATOR flags.
fn tpm_source(ui: &crate::ui::Ui, warnings: &mut Vec<String>) -> tpm::Source {
    if ui.simulator {
        if ui.tpm.is_some() {
            warnings.push("--simulator given: the TCTI from --tpm/TPMCRYPT_TCTI is ignored".into());
        }
        tpm::Source::Simulator
    } else if let Some(t) = &ui.tpm {
        tpm::Source::Tcti(t.clone())
    } else {
        tpm::Source::Default
    }
}

fn progress_bar(s: &Setup, ui: &crate::ui::Ui) -> ProgressBar {
    if ui.quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(s.steps());
    b.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    b
}

fn tpm_warnings(t: &tpm::TpmResult, source: &tpm::Source, warnings: &mut Vec<String>) {
    if !t.available {
        let hint = match source {
            tpm::Source::Default => {
                " — use --tpm TCTI for another TPM, or --simulator for a software TPM (not a chip's timings)"
            }
            _ => "",
        };
        warnings.push(format!(
            "no TPM measured: {}{hint}; the split below uses projections only",
            t.reason.as_deref().unwrap_or("unknown reason")
        ));
    } else if let Some(r) = &t.reason {
        warnings.push(format!("TPM measurement stopped early: {r}"));
    }
    if t.is_simulator == Some(true) {
        warnings.push(
            "the TPM measured is a simulator (swtpm): its times are software on this CPU, \
             not a TPM chip's; see the projections for hardware TPMs"
                .into(),
        );
    }
    if t.unbinds_performed != t.unbind_count {
        warnings.push(format!(
            "unbind count mismatch: performed {}, Tpm::unbind_count() {}",
            t.unbinds_performed, t.unbind_count
        ));
    }
}

/// Seconds since the Unix epoch when `started` was taken.
fn started_unix(started: Instant) -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
        .saturating_sub(started.elapsed().as_secs())
}

fn projection_warning(sources: &[report::UnbindSource], warnings: &mut Vec<String>) {
    if sources.iter().any(|s| s.projection) {
        warnings.push(
            "PROJECTION rows combine this machine's AES timings with unbind times that were not \
             measured here (--unbind, --chip, the study's TPM 1.2); chip values are points \
             within published ranges, not measurements of a product"
                .into(),
        );
    }
}

fn noisy_warning(all_series: &[Series], warnings: &mut Vec<String>) {
    let noisy: Vec<String> = all_series
        .iter()
        .flat_map(|s| {
            s.points
                .iter()
                .filter(|p| p.time.noisy)
                .map(move |p| format!("{} @ {}", s.id, super::stats::human_size(p.size)))
        })
        .collect();
    if noisy.is_empty() {
        return;
    }
    let total: usize = all_series.iter().map(|s| s.points.len()).sum();
    warnings.push(format!(
        "{} of {total} bulk points are noisy (max/min > {}), marked '!': {}{}",
        noisy.len(),
        stats::NOISY_RATIO,
        noisy.iter().take(8).cloned().collect::<Vec<_>>().join(", "),
        if noisy.len() > 8 { ", …" } else { "" }
    ));
}
