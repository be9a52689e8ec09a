//! The results of a run: the JSON document (schema: docs/bench.schema.json),
//! the derived split and crossover figures; the stdout tables are in
//! `text.rs`, the CSV in `csv.rs`.

mod csv;
mod text;

use serde::{Deserialize, Serialize};

use super::bulk::{Series, HARDWARE, SOFTWARE};
use super::matrix::Row;
use super::peers::Peer;
use super::perfile::PerFile;
use super::stats::Fit;
use super::sysinfo::System;
use super::tpm::TpmResult;

pub use self::csv::is_bench_csv;

/// Whether `v` is a document of this JSON (the keys of [`Results`] that
/// no other figures tpmcrypt writes have): a file an earlier bench wrote,
/// which `--json-file` may replace.
pub fn is_bench_json(v: &serde_json::Value) -> bool {
    v.get("schema_version")
        .is_some_and(serde_json::Value::is_u64)
        && ["bulk", "tpm", "split", "software_aes"]
            .iter()
            .all(|k| v.get(k).is_some())
}

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

impl Results {
    /// The series with this id.
    pub fn series(&self, id: &str) -> Option<&Series> {
        self.bulk.iter().find(|s| s.id == id)
    }

    /// Computes speed-ups, split and crossovers from the bulk series and
    /// the unbind sources.
    pub fn derive(&mut self) {
        self.speedup = self.speedups();
        let mut split = Vec::new();
        let mut crossover = Vec::new();
        for src in &self.unbind_sources {
            for mode in ["cbc-hs512", "gcm", "cbc-raw"] {
                for aes in [HARDWARE, SOFTWARE] {
                    let id = format!("{aes}/openssl/{mode}/decrypt");
                    let Some(s) = self.bulk.iter().find(|s| s.id == id) else {
                        continue;
                    };
                    split.extend(split_rows(src, s));
                    crossover.extend(self.crossovers(src, s));
                }
            }
        }
        self.split = split;
        self.crossover = crossover;
    }

    /// Hardware over software AES, OpenSSL, per mode, direction and size.
    fn speedups(&self) -> Vec<Speedup> {
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
        speedup
    }

    /// The crossover of one decryption series with one unbind source, per
    /// number of files per session.
    fn crossovers(&self, src: &UnbindSource, s: &Series) -> Vec<Crossover> {
        let min_size = self.config.sizes.iter().copied().min().unwrap_or(0) as f64;
        let max_size = self.config.sizes.iter().copied().max().unwrap_or(0) as f64;
        FILES_PER_SESSION
            .iter()
            .map(|&n| {
                let bytes = s
                    .model
                    .as_ref()
                    .map(|m: &Fit| m.size_for_ms(src.unbind_ms / f64::from(n)));
                Crossover {
                    unbind_source: src.id.clone(),
                    projection: src.projection,
                    aes: s.aes.clone(),
                    mode: s.mode.clone(),
                    files_per_session: n,
                    bytes,
                    extrapolated: bytes.is_some_and(|b| b > 0.0 && (b < min_size || b > max_size)),
                }
            })
            .collect()
    }
}

/// The split of one decryption series with one unbind source, per size and
/// number of files per session.
fn split_rows(src: &UnbindSource, s: &Series) -> Vec<SplitRow> {
    let mut rows = Vec::new();
    for p in &s.points {
        for n in FILES_PER_SESSION {
            let u = src.unbind_ms / f64::from(n);
            let total = u + p.time.median_ms;
            rows.push(SplitRow {
                unbind_source: src.id.clone(),
                projection: src.projection,
                aes: s.aes.clone(),
                mode: s.mode.clone(),
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
    rows
}
