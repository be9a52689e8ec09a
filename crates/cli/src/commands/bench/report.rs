//! The results of a run: the JSON document (schema: docs/bench.schema.json),
//! the derived split and crossover figures, the stdout tables and the CSV.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::bulk::{Series, HARDWARE, SOFTWARE};
use super::matrix::Row;
use super::peers::Peer;
use super::perfile::PerFile;
use super::stats::Fit;
use super::sysinfo::System;
use super::tpm::TpmResult;

/// Bumped on incompatible changes to the JSON.
pub const SCHEMA_VERSION: u32 = 1;

/// Files per session the split is amortised over.
pub const FILES_PER_SESSION: [u32; 4] = [1, 10, 100, 1000];

/// The whole run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    /// [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Seconds since the Unix epoch at the start.
    pub started_unix: u64,
    /// Wall time of the whole run, seconds.
    pub duration_s: f64,
    /// How the run was set up.
    pub config: Config,
    /// Machine and versions.
    pub system: System,
    /// TPM costs.
    pub tpm: TpmResult,
    /// How software AES was obtained, and whether it worked.
    pub software_aes: SoftwareAes,
    /// Every bulk series, hardware then software.
    pub bulk: Vec<Series>,
    /// Hardware over software AES, OpenSSL, per mode, direction and size.
    pub speedup: Vec<Speedup>,
    /// Unbind sources the split was computed for (measured and projected).
    pub unbind_sources: Vec<UnbindSource>,
    /// The split of one file's decryption time.
    pub split: Vec<SplitRow>,
    /// Sizes where bulk time equals one unbind (amortised or not).
    pub crossover: Vec<Crossover>,
    /// The mode × key-size matrix.
    pub matrix: Matrix,
    /// Other tools on the same files.
    pub peers: Vec<Peer>,
    /// Trees of small files through the command line, split per file.
    pub per_file: PerFile,
    /// Anything the reader must know (noise, missing parts, projections).
    pub warnings: Vec<String>,
}

/// Run settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Config {
    /// `--quick`.
    pub quick: bool,
    /// File sizes (bytes).
    pub sizes: Vec<u64>,
    /// `--repeat`.
    pub repeat: u32,
    /// Untimed warm-up runs per point.
    pub warmup: u32,
    /// Minimum length of one timed sample (short operations are batched).
    pub min_sample_ms: f64,
    /// Worker threads of the streaming engine (1: per-core figures).
    pub workers: u32,
    /// max/min above which a result is flagged noisy.
    pub noisy_ratio: f64,
}

/// Software AES.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SoftwareAes {
    /// Whether software figures were obtained.
    pub available: bool,
    /// How: a child process with `OPENSSL_ia32cap` set.
    pub method: String,
    /// The `OPENSSL_ia32cap` value used.
    pub openssl_ia32cap: String,
    /// OpenSSL version in the child.
    pub child_openssl_version: Option<String>,
    /// Software / hardware time (fastest samples) of raw AES-256-CBC
    /// decryption at the largest size: the check that the mask took effect.
    pub mask_slowdown: Option<f64>,
    /// `mask_slowdown` ≥ 1.5.
    pub mask_verified: bool,
    /// Why unavailable or unverified.
    pub reason: Option<String>,
    /// The pure-Rust backend cannot be switched to software AES at run time.
    pub rustcrypto_note: String,
}

/// Hardware vs software AES at one point.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Speedup {
    /// Mode (`cbc-raw`, `cbc-hs512`, `gcm`).
    pub mode: String,
    /// `encrypt` or `decrypt`.
    pub direction: String,
    /// Bytes.
    pub size: u64,
    /// Median with AES-NI, ms.
    pub hardware_ms: f64,
    /// Median with AES-NI masked, ms.
    pub software_ms: f64,
    /// software_ms / hardware_ms.
    pub speedup: f64,
    /// Either side noisy.
    pub noisy: bool,
}

/// Where an unbind time comes from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UnbindSource {
    /// Short id (`measured-rsa2048`, `chip-typical-rsa2048`, `study-tpm12`, …).
    pub id: String,
    /// Human description.
    pub label: String,
    /// True unless measured on this machine's TPM in this run.
    pub projection: bool,
    /// One unbind, ms.
    pub unbind_ms: f64,
    /// Key creation, ms, when known.
    pub create_ms: Option<f64>,
}

/// One row of the split.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SplitRow {
    /// [`UnbindSource::id`].
    pub unbind_source: String,
    /// Projection (see [`UnbindSource::projection`]).
    pub projection: bool,
    /// `hardware` or `software`.
    pub aes: String,
    /// Mode decrypted via OpenSSL: `cbc-hs512` (the `cbc` payload), `gcm`,
    /// or `cbc-raw` (the study's bare AES-256-CBC).
    pub mode: String,
    /// Backend of the bulk part.
    pub backend: String,
    /// Bytes.
    pub size: u64,
    /// Files decrypted per session (one unbind per session).
    pub files_per_session: u32,
    /// Bulk decryption of one file, ms (median).
    pub bulk_ms: f64,
    /// Unbind time per file: unbind / files_per_session.
    pub unbind_ms_per_file: f64,
    /// unbind_ms_per_file + bulk_ms.
    pub total_ms: f64,
    /// Percentage of total_ms spent in the TPM.
    pub tpm_share_pct: f64,
}

/// Size where bulk decryption takes as long as the (amortised) unbind.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Crossover {
    /// [`UnbindSource::id`].
    pub unbind_source: String,
    /// Projection.
    pub projection: bool,
    /// `hardware` or `software`.
    pub aes: String,
    /// Mode.
    pub mode: String,
    /// Files per session.
    pub files_per_session: u32,
    /// Bytes, from the fitted model; null without a model. Extrapolated
    /// when outside the measured sizes (see `extrapolated`).
    pub bytes: Option<f64>,
    /// The crossover lies outside the measured range of sizes.
    pub extrapolated: bool,
}

/// The matrix section.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Matrix {
    /// Whether it ran.
    pub available: bool,
    /// Why not.
    pub reason: Option<String>,
    /// Rows (mode, key size, message size).
    pub rows: Vec<Row>,
}

/// An unbind from a named reference point.
pub struct Chip {
    /// `--chip` name.
    pub name: &'static str,
    /// Description.
    pub label: &'static str,
    /// RSA-2048 decrypt, ms.
    pub rsa_unbind_ms: f64,
    /// ECDH, ms.
    pub ecdh_ms: f64,
    /// RSA-2048 key creation, ms.
    pub rsa_create_ms: f64,
    /// P-256 key creation, ms.
    pub ecc_create_ms: f64,
}

/// Reference points for projections: not measurements of any product;
/// values inside the published ranges for discrete TPM 2.0 chips (RSA-2048
/// decrypt 50–550 ms, ECDH 30–250 ms, RSA-2048 creation 1.5–7.5 s, P-256
/// creation 50–230 ms), and the study's TPM 1.2.
pub const CHIPS: [Chip; 4] = [
    Chip {
        name: "fast",
        label: "fast TPM 2.0 (low end of published ranges)",
        rsa_unbind_ms: 50.0,
        ecdh_ms: 30.0,
        rsa_create_ms: 1500.0,
        ecc_create_ms: 50.0,
    },
    Chip {
        name: "typical",
        label: "typical discrete TPM 2.0 (middle of published ranges)",
        rsa_unbind_ms: 200.0,
        ecdh_ms: 100.0,
        rsa_create_ms: 4000.0,
        ecc_create_ms: 120.0,
    },
    Chip {
        name: "slow",
        label: "slow TPM 2.0 (high end of published ranges)",
        rsa_unbind_ms: 550.0,
        ecdh_ms: 250.0,
        rsa_create_ms: 7500.0,
        ecc_create_ms: 230.0,
    },
    Chip {
        name: "tpm12-study",
        label: "the study's TPM 1.2 (unbind 1.29 s, key creation 3.75 s)",
        rsa_unbind_ms: 1290.0,
        ecdh_ms: f64::NAN,
        rsa_create_ms: 3750.0,
        ecc_create_ms: f64::NAN,
    },
];

/// Looks a chip up by name.
pub fn chip(name: &str) -> Option<&'static Chip> {
    CHIPS.iter().find(|c| c.name == name)
}

/// `16 KiB`, `1 MiB`, `1 GiB`, `100 B`.
pub fn human_size(b: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (u, n) in UNITS {
        if b >= n {
            let v = b as f64 / n as f64;
            return if (v - v.round()).abs() < 1e-9 {
                format!("{} {u}", v.round() as u64)
            } else {
                format!("{v:.1} {u}")
            };
        }
    }
    format!("{b} B")
}

/// Human size of a float byte count (for crossovers).
pub fn human_bytes_f(b: f64) -> String {
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.2} MiB", b / (1u64 << 20) as f64)
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b:.0} B")
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

impl Results {
    /// The series with this id.
    pub fn series(&self, id: &str) -> Option<&Series> {
        self.bulk.iter().find(|s| s.id == id)
    }

    /// Computes speed-ups, split and crossovers from the bulk series and
    /// the unbind sources.
    pub fn derive(&mut self) {
        let mut speedup = Vec::new();
        for mode in ["cbc-raw", "cbc-hs512", "gcm"] {
            for dir in ["encrypt", "decrypt"] {
                let hw = self.series(&format!("{HARDWARE}/openssl/{mode}/{dir}"));
                let sw = self.series(&format!("{SOFTWARE}/openssl/{mode}/{dir}"));
                let (Some(hw), Some(sw)) = (hw, sw) else {
                    continue;
                };
                for p in &hw.points {
                    if let Some(q) = sw.at(p.size) {
                        speedup.push(Speedup {
                            mode: mode.into(),
                            direction: dir.into(),
                            size: p.size,
                            hardware_ms: p.time.median_ms,
                            software_ms: q.time.median_ms,
                            speedup: q.time.median_ms / p.time.median_ms,
                            noisy: p.time.noisy || q.time.noisy,
                        });
                    }
                }
            }
        }
        self.speedup = speedup;
        self.split.clear();
        self.crossover.clear();
        let min_size = self.config.sizes.iter().copied().min().unwrap_or(0) as f64;
        let max_size = self.config.sizes.iter().copied().max().unwrap_or(0) as f64;
        for src in &self.unbind_sources {
            for mode in ["cbc-hs512", "gcm", "cbc-raw"] {
                for aes in [HARDWARE, SOFTWARE] {
                    let id = format!("{aes}/openssl/{mode}/decrypt");
                    let Some(s) = self.bulk.iter().find(|s| s.id == id) else {
                        continue;
                    };
                    for p in &s.points {
                        for n in FILES_PER_SESSION {
                            let u = src.unbind_ms / f64::from(n);
                            let total = u + p.time.median_ms;
                            self.split.push(SplitRow {
                                unbind_source: src.id.clone(),
                                projection: src.projection,
                                aes: aes.into(),
                                mode: mode.into(),
                                backend: s.backend.clone(),
                                size: p.size,
                                files_per_session: n,
                                bulk_ms: p.time.median_ms,
                                unbind_ms_per_file: u,
                                total_ms: total,
                                tpm_share_pct: 100.0 * u / total,
                            });
                        }
                    }
                    for n in FILES_PER_SESSION {
                        let bytes = s
                            .model
                            .as_ref()
                            .map(|m: &Fit| m.size_for_ms(src.unbind_ms / f64::from(n)));
                        self.crossover.push(Crossover {
                            unbind_source: src.id.clone(),
                            projection: src.projection,
                            aes: aes.into(),
                            mode: mode.into(),
                            files_per_session: n,
                            bytes,
                            extrapolated: bytes
                                .is_some_and(|b| b > 0.0 && (b < min_size || b > max_size)),
                        });
                    }
                }
            }
        }
    }

    /// The readable report.
    pub fn table(&self) -> String {
        let mut o = String::new();
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

        // TPM.
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

        // Bulk.
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

        // Speed-up.
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

        // Split.
        for src in &self.unbind_sources {
            let mode = "cbc-hs512";
            let rows: Vec<&SplitRow> = self
                .split
                .iter()
                .filter(|r| r.unbind_source == src.id && r.mode == mode)
                .collect();
            if rows.is_empty() {
                continue;
            }
            let _ = writeln!(
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
                "size",
                "hw bulk ms",
                "1",
                "10",
                "100",
                "1000",
                "sw bulk ms",
                "1",
                "10",
                "100",
                "1000"
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
                            let _ =
                                write!(o, " {:>10} {:>7} {:>7} {:>7} {:>7}", "-", "", "", "", "");
                        }
                    }
                    if aes == HARDWARE {
                        let _ = write!(o, "  ");
                    }
                }
                let _ = writeln!(o);
            }
            for aes in [HARDWARE, SOFTWARE] {
                let c: Vec<&Crossover> = self
                    .crossover
                    .iter()
                    .filter(|c| c.unbind_source == src.id && c.mode == mode && c.aes == aes)
                    .collect();
                if c.is_empty() {
                    continue;
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
        }

        // Model.
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

        // Matrix.
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

        // Peers.
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

        self.per_file_table(&mut o);

        if !self.warnings.is_empty() {
            let _ = writeln!(o, "\n== Notes ==");
            for w in &self.warnings {
                let _ = writeln!(o, "  * {w}");
            }
        }
        o
    }

    /// One CSV table, long format: one line per measured or derived value.
    pub fn csv(&self) -> String {
        let mut o = String::from(
            "section,item,aes,backend,mode,key_bits,direction,size_bytes,files_per_session,median_ms,min_ms,max_ms,runs,noisy,mb_per_s,cycles_per_byte,tpm_share_pct,overhead_us,bandwidth_mb_s,projection\n",
        );
        let f = |v: Option<f64>| v.map(|x| format!("{x}")).unwrap_or_default();
        for op in &self.tpm.ops {
            let _ = writeln!(
                o,
                "tpm,{},,,,,,,,{},{},{},{},{},,,,,,false",
                op.name,
                op.time.median_ms,
                op.time.min_ms,
                op.time.max_ms,
                op.time.samples_ms.len(),
                op.time.noisy
            );
        }
        for s in &self.bulk {
            for p in &s.points {
                let _ = writeln!(
                    o,
                    "bulk,{},{},{},{},{},{},{},,{},{},{},{},{},{},{},,,,false",
                    s.id,
                    s.aes,
                    s.backend,
                    s.mode,
                    s.key_bits,
                    s.direction,
                    p.size,
                    p.time.median_ms,
                    p.time.min_ms,
                    p.time.max_ms,
                    p.runs,
                    p.time.noisy,
                    p.mb_per_s,
                    f(p.cycles_per_byte)
                );
            }
            if let Some(m) = &s.model {
                let _ = writeln!(
                    o,
                    "model,{},{},{},{},{},{},,,,,,,,,{},,{},{},false",
                    s.id,
                    s.aes,
                    s.backend,
                    s.mode,
                    s.key_bits,
                    s.direction,
                    f(m.cycles_per_byte),
                    m.overhead_us,
                    m.bandwidth_mb_s
                );
            }
        }
        for r in &self.split {
            let _ = writeln!(
                o,
                "split,{},{},{},{},256,decrypt,{},{},{},,,,,,,{},,,{}",
                r.unbind_source,
                r.aes,
                r.backend,
                r.mode,
                r.size,
                r.files_per_session,
                r.total_ms,
                r.tpm_share_pct,
                r.projection
            );
        }
        for r in &self.matrix.rows {
            let _ = writeln!(
                o,
                "matrix,hardware,hardware,openssl,{},{},encrypt,{},,,,,,{},{},,,,,false",
                r.mode, r.key_bits, r.size, r.noisy, r.hardware_mb_s
            );
            if let Some(sw) = r.software_mb_s {
                let _ = writeln!(
                    o,
                    "matrix,software,software,openssl,{},{},encrypt,{},,,,,,{},{},,,,,false",
                    r.mode, r.key_bits, r.size, r.noisy, sw
                );
            }
        }
        self.per_file_csv(&mut o);
        for p in &self.peers {
            for pt in &p.points {
                let _ = writeln!(
                    o,
                    "peer,{},,,,,encrypt,{},,{},{},{},{},{},{},,,,,false",
                    p.tool,
                    pt.size,
                    pt.time.median_ms,
                    pt.time.min_ms,
                    pt.time.max_ms,
                    pt.time.samples_ms.len(),
                    pt.time.noisy,
                    pt.mb_per_s
                );
            }
        }
        o
    }
}

impl Results {
    /// The per-file table: one line per direction, durability and size.
    fn per_file_table(&self, o: &mut String) {
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

    /// The per-file series in the CSV: one line per part of each point
    /// (`median_ms` is ms per file; `files_per_session` the tree's files).
    fn per_file_csv(&self, o: &mut String) {
        for p in &self.per_file.points {
            let parts = [
                ("total", p.total_ms),
                ("unwrap", p.unwrap_ms),
                ("aes_cpu", p.aes_cpu_ms),
                ("io", p.io_ms),
                ("commit", p.commit_ms),
                ("other", p.other_ms),
            ];
            for (item, v) in parts {
                let mb_s = if item == "total" {
                    format!("{}", p.files_per_s * p.size as f64 / 1e6)
                } else {
                    String::new()
                };
                let _ = writeln!(
                    o,
                    "perfile,{item},,,{},256,{},{},{},{v},,,{},false,{mb_s},,,,,false",
                    p.sync, p.direction, p.size, p.files, p.runs
                );
            }
        }
    }
}

fn short_backend(b: &str) -> &str {
    match b {
        "rustcrypto" => "rc",
        "openssl" => "ossl",
        other => other,
    }
}
