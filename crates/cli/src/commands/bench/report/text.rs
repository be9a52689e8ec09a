//! The readable report printed on stdout: one function per section (the
//! header, TPM, bulk, speed-up, split, model, matrix, other tools, per
//! file, notes), in the order they are printed.

use std::fmt::Write as _;

use super::super::bulk::{Series, HARDWARE, SOFTWARE};
use super::super::stats::human_size;
use super::{human_bytes_f, Crossover, Results, SplitRow, UnbindSource};

impl Results {
    /// The readable report.
    pub fn table(&self) -> String {
        let mut o = String::new();
        self.header_section(&mut o);
        self.tpm_section(&mut o);
        self.bulk_section(&mut o);
        self.speedup_section(&mut o);
        for src in &self.unbind_sources {
            self.split_section(&mut o, src);
        }
        self.model_section(&mut o);
        self.matrix_section(&mut o);
        self.peers_section(&mut o);
        self.per_file_section(&mut o);
        self.notes_section(&mut o);
        o
    }

    /// The title, the machine and how the run was set up.
    fn header_section(&self, o: &mut String) {
        let sys = &self.system;
        let feat = |n: &str| {
            if sys.cpu_features.get(n).copied().unwrap_or(false) {
                "yes"
            } else {
                "no"
            }
        };
        let _ = writeln!(
            o,
            "tpmcrypt bench{}",
            if self.config.quick { " --quick" } else { "" }
        );
        let _ = writeln!(o, "  CPU: {} ({} logical CPUs)", sys.cpu_model, sys.cpus);
        let _ = writeln!(
            o,
            "  features ({}): aes {} · pclmulqdq {} · vaes {} · vpclmulqdq {} · avx2 {} · avx512f {}",
            sys.features_source,
            feat("aes"),
            feat("pclmulqdq"),
            feat("vaes"),
            feat("vpclmulqdq"),
            feat("avx2"),
            feat("avx512f")
        );
        let _ = writeln!(
            o,
            "  tpmcrypt {} · {} · TSC {} · kernel {}",
            sys.tpmcrypt_version,
            sys.openssl_version,
            sys.tsc_hz
                .map(|h| format!("{:.3} GHz", h / 1e9))
                .unwrap_or_else(|| "n/a".into()),
            sys.kernel
        );
        let _ = writeln!(
            o,
            "  {} repeats (median, min–max), {} warm-up, samples ≥ {} ms, engine on {} thread; '!' marks noisy results (max/min > {})",
            self.config.repeat, self.config.warmup, self.config.min_sample_ms, self.config.workers, self.config.noisy_ratio
        );
    }

    /// TPM costs.
    fn tpm_section(&self, o: &mut String) {
        let t = &self.tpm;
        let _ = writeln!(o, "\n== TPM costs ==");
        if t.available {
            let _ = writeln!(
                o,
                "  {} firmware {} ({}) via {}{}",
                t.manufacturer.as_deref().unwrap_or("?"),
                t.firmware_version.as_deref().unwrap_or("?"),
                t.vendor.as_deref().unwrap_or(""),
                t.tcti.as_deref().unwrap_or("?"),
                if t.is_simulator == Some(true) {
                    "\n  SIMULATOR: a software TPM — these are not a TPM chip's timings"
                } else {
                    ""
                }
            );
            let _ = writeln!(
                o,
                "  {:<22} {:>10} {:>10} {:>10}",
                "operation (ms)", "median", "min", "max"
            );
            for op in &t.ops {
                let _ = writeln!(
                    o,
                    "  {:<22} {:>10} {:>10} {:>10}{}",
                    op.name,
                    ms(op.time.median_ms),
                    ms(op.time.min_ms),
                    ms(op.time.max_ms),
                    if op.time.noisy { " !" } else { "" }
                );
            }
        } else {
            let _ = writeln!(
                o,
                "  TPM unavailable: {}",
                t.reason.as_deref().unwrap_or("?")
            );
        }
        if let (true, Some(r)) = (t.available, &t.reason) {
            let _ = writeln!(o, "  stopped early: {r}");
        }
        let _ = writeln!(
            o,
            "  unbinds performed: {} · Tpm::unbind_count(): {}",
            t.unbinds_performed, t.unbind_count
        );
    }

    /// Bulk AES by size, one table per direction.
    fn bulk_section(&self, o: &mut String) {
        let cols: Vec<&Series> = self
            .bulk
            .iter()
            .filter(|s| s.direction == "encrypt")
            .collect();
        for dir in ["encrypt", "decrypt"] {
            let _ = writeln!(
                o,
                "\n== Bulk AES-256, {dir}, ms per file (in memory; hw = AES-NI, sw = AES-NI/CLMUL masked) =="
            );
            let _ = write!(o, "  {:>9}", "size");
            for s in &cols {
                let _ = write!(
                    o,
                    " {:>10}",
                    format!(
                        "{}-{}",
                        if s.aes == HARDWARE { "hw" } else { "sw" },
                        short_backend(&s.backend)
                    )
                );
            }
            let _ = write!(o, "\n  {:>9}", "");
            for s in &cols {
                let _ = write!(o, " {:>10}", s.mode);
            }
            let _ = writeln!(o);
            for &size in &self.config.sizes {
                let _ = write!(o, "  {:>9}", human_size(size));
                for c in &cols {
                    let id = c.id.replace("/encrypt", &format!("/{dir}"));
                    let cell = self
                        .series(&id)
                        .and_then(|s| s.at(size))
                        .map(|p| {
                            format!(
                                "{}{}",
                                ms(p.time.median_ms),
                                if p.time.noisy { "!" } else { "" }
                            )
                        })
                        .unwrap_or_else(|| "-".into());
                    let _ = write!(o, " {cell:>10}");
                }
                let _ = writeln!(o);
            }
        }
        let _ = writeln!(o, "  ({})", self.software_aes.rustcrypto_note);
    }

    /// Hardware over software AES.
    fn speedup_section(&self, o: &mut String) {
        if !self.speedup.is_empty() {
            let _ = writeln!(
                o,
                "\n== Hardware over software AES (OpenSSL, same code, AES-NI/CLMUL masked), × =="
            );
            let keys: Vec<(&str, &str)> = ["cbc-raw", "cbc-hs512", "gcm"]
                .iter()
                .flat_map(|m| ["encrypt", "decrypt"].map(|d| (*m, d)))
                .collect();
            let _ = write!(o, "  {:>9}", "size");
            for (m, d) in &keys {
                let _ = write!(o, " {:>13}", format!("{m} {}", &d[..3]));
            }
            let _ = writeln!(o);
            for &size in &self.config.sizes {
                let _ = write!(o, "  {:>9}", human_size(size));
                for (m, d) in &keys {
                    let cell = self
                        .speedup
                        .iter()
                        .find(|s| s.mode == *m && s.direction == *d && s.size == size)
                        .map(|s| format!("{:.1}{}", s.speedup, if s.noisy { "!" } else { "" }))
                        .unwrap_or_else(|| "-".into());
                    let _ = write!(o, " {cell:>13}");
                }
                let _ = writeln!(o);
            }
        }
    }

    /// The split for one unbind source, and its crossovers.
    fn split_section(&self, o: &mut String, src: &UnbindSource) {
        let mode = "cbc-hs512";
        let rows: Vec<&SplitRow> = self
            .split
            .iter()
            .filter(|r| r.unbind_source == src.id && r.mode == mode)
            .collect();
        if rows.is_empty() {
            return;
        }
        let _ =
            writeln!(
            o,
            "\n== Split: decrypt one file = unbind + bulk AES-256-CBC-HS512 (OpenSSL) — {}{} ==",
            if src.projection { "PROJECTION: " } else { "measured: " },
            src.label
        );
        let _ = writeln!(
            o,
            "  unbind {} ms; TPM share of the time per file, by files per session",
            ms(src.unbind_ms)
        );
        let _ = writeln!(
            o,
            "  {:>9} {:>10} {:>7} {:>7} {:>7} {:>7}   {:>10} {:>7} {:>7} {:>7} {:>7}",
            "size", "hw bulk ms", "1", "10", "100", "1000", "sw bulk ms", "1", "10", "100", "1000"
        );
        for &size in &self.config.sizes {
            let _ = write!(o, "  {:>9}", human_size(size));
            for aes in [HARDWARE, SOFTWARE] {
                let r: Vec<&&SplitRow> = rows
                    .iter()
                    .filter(|r| r.aes == aes && r.size == size)
                    .collect();
                match r.first() {
                    Some(first) => {
                        let _ = write!(o, " {:>10}", ms(first.bulk_ms));
                        for x in &r {
                            let _ = write!(o, " {:>6.1}%", x.tpm_share_pct);
                        }
                    }
                    None => {
                        let _ = write!(o, " {:>10} {:>7} {:>7} {:>7} {:>7}", "-", "", "", "", "");
                    }
                }
                if aes == HARDWARE {
                    let _ = write!(o, "  ");
                }
            }
            let _ = writeln!(o);
        }
        for aes in [HARDWARE, SOFTWARE] {
            self.crossover_line(o, src, mode, aes);
        }
    }

    /// The crossover sizes for one unbind source, mode and AES.
    fn crossover_line(&self, o: &mut String, src: &UnbindSource, mode: &str, aes: &str) {
        let c: Vec<&Crossover> = self
            .crossover
            .iter()
            .filter(|c| c.unbind_source == src.id && c.mode == mode && c.aes == aes)
            .collect();
        if c.is_empty() {
            return;
        }
        let _ = write!(o, "  crossover ({aes} AES), bulk = unbind:");
        for x in c {
            let _ = write!(
                o,
                " {}{}",
                match x.bytes {
                    Some(b) if b > 0.0 => human_bytes_f(b),
                    Some(_) => "none (overhead > unbind)".into(),
                    None => "n/a".into(),
                },
                if x.files_per_session == 1 {
                    String::new()
                } else {
                    format!(" (÷{})", x.files_per_session)
                }
            );
            if x.extrapolated && x.bytes.is_some_and(|b| b > 0.0) {
                let _ = write!(o, "*");
            }
            let _ = write!(o, ";");
        }
        let _ = writeln!(o, "  (* = extrapolated beyond measured sizes)");
    }

    /// The fitted model of every series.
    fn model_section(&self, o: &mut String) {
        let _ = writeln!(
            o,
            "\n== Model: time = overhead + size / bandwidth (weighted least squares) =="
        );
        let _ = writeln!(
            o,
            "  {:<36} {:>12} {:>10} {:>10} {:>8}",
            "series", "overhead µs", "MB/s", "cycles/B", "rms err"
        );
        for s in &self.bulk {
            if let Some(m) = &s.model {
                let _ = writeln!(
                    o,
                    "  {:<36} {:>12.1} {:>10.1} {:>10} {:>7.1}%",
                    s.id,
                    m.overhead_us,
                    m.bandwidth_mb_s,
                    m.cycles_per_byte
                        .map(|c| format!("{c:.2}"))
                        .unwrap_or_else(|| "n/a".into()),
                    m.rms_rel_error * 100.0
                );
            }
        }
    }

    /// The mode × key-size matrix.
    fn matrix_section(&self, o: &mut String) {
        let _ = writeln!(o, "\n== Mode × key size (OpenSSL EVP, one message per call): hw MB/s / sw MB/s (+improvement %) ==");
        if !self.matrix.available {
            let _ = writeln!(
                o,
                "  not run: {}",
                self.matrix.reason.as_deref().unwrap_or("?")
            );
        } else {
            let mut sizes: Vec<u64> = self.matrix.rows.iter().map(|r| r.size).collect();
            sizes.sort_unstable();
            sizes.dedup();
            let _ = write!(o, "  {:<9}", "mode");
            for s in &sizes {
                let _ = write!(o, " {:>22}", human_size(*s));
            }
            let _ = writeln!(o);
            let mut keys: Vec<(String, u32)> = self
                .matrix
                .rows
                .iter()
                .map(|r| (r.mode.clone(), r.key_bits))
                .collect();
            keys.dedup();
            for (m, b) in keys {
                let _ = write!(o, "  {:<9}", format!("{m}-{b}"));
                for s in &sizes {
                    let cell = self
                        .matrix
                        .rows
                        .iter()
                        .find(|r| r.mode == m && r.key_bits == b && r.size == *s)
                        .map(|r| match (r.software_mb_s, r.improvement_pct) {
                            (Some(sw), Some(p)) => format!(
                                "{:.0}/{:.0} ({:+.0}%){}",
                                r.hardware_mb_s,
                                sw,
                                p,
                                if r.noisy { "!" } else { "" }
                            ),
                            _ => format!("{:.0}/-", r.hardware_mb_s),
                        })
                        .unwrap_or_default();
                    let _ = write!(o, " {cell:>22}");
                }
                let _ = writeln!(o);
            }
        }
    }

    /// Other tools.
    fn peers_section(&self, o: &mut String) {
        let _ = writeln!(
            o,
            "\n== Other tools, whole process, encrypt one file (ms) =="
        );
        for p in &self.peers {
            if !p.available {
                let _ = writeln!(
                    o,
                    "  {:<9} skipped: {}",
                    p.tool,
                    p.reason.as_deref().unwrap_or("?")
                );
                continue;
            }
            let _ = write!(o, "  {:<9}", p.tool);
            for pt in &p.points {
                let _ = write!(
                    o,
                    " {}: {}{}",
                    human_size(pt.size),
                    ms(pt.time.median_ms),
                    if pt.time.noisy { "!" } else { "" }
                );
                let _ = write!(o, ";");
            }
            let _ = writeln!(o, "  [{}]", p.version.as_deref().unwrap_or("?"));
        }
    }

    /// Notes and warnings.
    fn notes_section(&self, o: &mut String) {
        if !self.warnings.is_empty() {
            let _ = writeln!(o, "\n== Notes ==");
            for w in &self.warnings {
                let _ = writeln!(o, "  * {w}");
            }
        }
    }

    /// The per-file table: one line per direction, durability and size.
    fn per_file_section(&self, o: &mut String) {
        let pf = &self.per_file;
        if !pf.available {
            return;
        }
        let _ = writeln!(
            o,
            "\n== Per file, through the command line (encrypt -r / decrypt -r of a tree; ms per file) =="
        );
        let _ = writeln!(
            o,
            "  {:<8} {:<8} {:>7} {:>6} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
            "",
            "",
            "size",
            "files",
            "files/s",
            "total",
            "unwrap",
            "aes cpu",
            "i/o",
            "commit",
            "other"
        );
        for p in &pf.points {
            let _ = writeln!(
                o,
                "  {:<8} {:<8} {:>7} {:>6} {:>9.0} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3}",
                p.direction,
                p.sync,
                human_size(p.size),
                p.files,
                p.files_per_s,
                p.total_ms,
                p.unwrap_ms,
                p.aes_cpu_ms,
                p.io_ms,
                p.commit_ms,
                p.other_ms
            );
        }
        let _ = writeln!(
            o,
            "  (aes cpu and i/o are CPU time summed over threads; unwrap: the recovery key's, once per run; other: the rest of the wall time)"
        );
    }
}

fn ms(v: f64) -> String {
    if v >= 1000.0 {
        format!("{v:.0}")
    } else if v >= 100.0 {
        format!("{v:.1}")
    } else if v >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn short_backend(b: &str) -> &str {
    match b {
        "rustcrypto" => "rc",
        "openssl" => "ossl",
        other => other,
    }
}
