//! The mode × key-size matrix (CBC, CTR, CCM, GCM × 128/192/256 at small
//! message sizes), through OpenSSL EVP directly, like the IPsec AES-NI study.
//! CTR and CCM exist here only: tpmcrypt never offers them for files.

use std::time::Instant;

use anyhow::Context as _;
use openssl::cipher::{Cipher, CipherRef};
use openssl::cipher_ctx::CipherCtx;
use serde::{Deserialize, Serialize};

use super::stats::Summary;

/// Modes in the matrix.
pub const MODES: [&str; 4] = ["cbc", "ctr", "ccm", "gcm"];
/// Key sizes in the matrix.
pub const KEY_BITS: [u32; 3] = [128, 192, 256];
/// Message sizes in the matrix.
pub const SIZES: [usize; 6] = [64, 128, 256, 512, 1024, 16384];

/// What to measure.
#[derive(Debug, Clone)]
pub struct MatrixPlan {
    /// Modes.
    pub modes: Vec<&'static str>,
    /// Key sizes.
    pub key_bits: Vec<u32>,
    /// Message sizes.
    pub sizes: Vec<usize>,
    /// Timed samples per cell (median reported).
    pub samples: u32,
    /// Length of one sample.
    pub sample_ms: f64,
}

impl MatrixPlan {
    /// The full matrix or the trimmed one for `--quick`.
    pub fn new(quick: bool) -> MatrixPlan {
        if quick {
            MatrixPlan {
                modes: vec!["cbc", "gcm"],
                key_bits: vec![128, 256],
                sizes: vec![64, 1024, 16384],
                samples: 3,
                sample_ms: 3.0,
            }
        } else {
            MatrixPlan {
                modes: MODES.to_vec(),
                key_bits: KEY_BITS.to_vec(),
                sizes: SIZES.to_vec(),
                samples: 5,
                sample_ms: 20.0,
            }
        }
    }

    /// Number of cells.
    pub fn cells(&self) -> usize {
        self.modes.len() * self.key_bits.len() * self.sizes.len()
    }
}

/// One measured cell on one side (hardware or software).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cell {
    /// `cbc`, `ctr`, `ccm`, `gcm`.
    pub mode: String,
    /// AES key size.
    pub key_bits: u32,
    /// Message size in bytes.
    pub size: u64,
    /// Median throughput, MB/s.
    pub mb_per_s: f64,
    /// Time per message, ms.
    #[serde(flatten)]
    pub time: Summary,
}

/// A cell with both sides.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    /// Mode.
    pub mode: String,
    /// AES key size.
    pub key_bits: u32,
    /// Message size in bytes.
    pub size: u64,
    /// Throughput with AES-NI, MB/s.
    pub hardware_mb_s: f64,
    /// Throughput with AES-NI and CLMUL masked, MB/s (null if not measured).
    pub software_mb_s: Option<f64>,
    /// (hardware / software − 1) × 100.
    pub improvement_pct: Option<f64>,
    /// Either side noisy (max/min > 1.5).
    pub noisy: bool,
}

fn cipher(mode: &str, bits: u32) -> Option<&'static CipherRef> {
    Some(match (mode, bits) {
        ("cbc", 128) => Cipher::aes_128_cbc(),
        ("cbc", 192) => Cipher::aes_192_cbc(),
        ("cbc", 256) => Cipher::aes_256_cbc(),
        ("ctr", 128) => Cipher::aes_128_ctr(),
        ("ctr", 192) => Cipher::aes_192_ctr(),
        ("ctr", 256) => Cipher::aes_256_ctr(),
        ("ccm", 128) => Cipher::aes_128_ccm(),
        ("ccm", 192) => Cipher::aes_192_ccm(),
        ("ccm", 256) => Cipher::aes_256_ccm(),
        ("gcm", 128) => Cipher::aes_128_gcm(),
        ("gcm", 192) => Cipher::aes_192_gcm(),
        ("gcm", 256) => Cipher::aes_256_gcm(),
        _ => return None,
    })
}

/// Encrypts one message per call with a fresh IV (as a packet would be),
/// keeping the key schedule in the context.
struct Sealer {
    ctx: CipherCtx,
    mode: &'static str,
    iv: Vec<u8>,
    out: Vec<u8>,
    tag: [u8; 16],
}

impl Sealer {
    fn new(mode: &'static str, bits: u32, size: usize) -> anyhow::Result<Sealer> {
        let c = cipher(mode, bits).context("unknown cipher")?;
        let mut ctx = CipherCtx::new()?;
        let key = vec![0x11u8; bits as usize / 8];
        let iv_len = match mode {
            "cbc" | "ctr" => 16,
            _ => 12,
        };
        ctx.encrypt_init(Some(c), None, None)?;
        if mode == "ccm" || mode == "gcm" {
            ctx.set_iv_length(iv_len)?;
        }
        if mode == "ccm" {
            ctx.set_tag_length(16)?;
        }
        ctx.encrypt_init(None, Some(&key), None)?;
        Ok(Sealer {
            ctx,
            mode,
            iv: vec![0x22u8; iv_len],
            out: vec![0u8; size + 32],
            tag: [0u8; 16],
        })
    }

    fn seal(&mut self, msg: &[u8]) -> anyhow::Result<()> {
        self.iv[0] = self.iv[0].wrapping_add(1);
        self.ctx.encrypt_init(None, None, Some(&self.iv))?;
        if self.mode == "ccm" {
            self.ctx.set_data_len(msg.len())?;
        }
        let n = self.ctx.cipher_update(msg, Some(&mut self.out))?;
        self.ctx.cipher_final(&mut self.out[n..])?;
        if self.mode == "ccm" || self.mode == "gcm" {
            self.ctx.tag(&mut self.tag)?;
        }
        Ok(())
    }
}

/// Measures every cell of `plan`; `tick` after each.
pub fn run(plan: &MatrixPlan, tick: &mut dyn FnMut(&str)) -> anyhow::Result<Vec<Cell>> {
    let mut cells = Vec::new();
    for &mode in &plan.modes {
        for &bits in &plan.key_bits {
            for &size in &plan.sizes {
                let msg = vec![0x5au8; size];
                let mut s = Sealer::new(mode, bits, size)?;
                // Warm up and size the batch.
                let t = Instant::now();
                let mut n = 0u32;
                while t.elapsed().as_secs_f64() * 1e3 < plan.sample_ms / 2.0 {
                    s.seal(&msg)?;
                    n += 1;
                }
                let per = t.elapsed().as_secs_f64() / f64::from(n.max(1));
                let batch = ((plan.sample_ms / 1e3 / per) as u32).max(1);
                let mut samples = Vec::new();
                for _ in 0..plan.samples {
                    let t = Instant::now();
                    for _ in 0..batch {
                        s.seal(&msg)?;
                    }
                    samples.push(t.elapsed().as_secs_f64() * 1e3 / f64::from(batch));
                }
                let time = Summary::of(samples);
                cells.push(Cell {
                    mode: mode.to_string(),
                    key_bits: bits,
                    size: size as u64,
                    mb_per_s: size as f64 / (time.median_ms / 1e3) / 1e6,
                    time,
                });
                tick("mode × key matrix");
            }
        }
    }
    Ok(cells)
}

/// Joins the hardware cells with the software ones.
pub fn join(hw: &[Cell], sw: &[Cell]) -> Vec<Row> {
    hw.iter()
        .map(|h| {
            let s = sw
                .iter()
                .find(|s| s.mode == h.mode && s.key_bits == h.key_bits && s.size == h.size);
            Row {
                mode: h.mode.clone(),
                key_bits: h.key_bits,
                size: h.size,
                hardware_mb_s: h.mb_per_s,
                software_mb_s: s.map(|s| s.mb_per_s),
                improvement_pct: s.map(|s| (h.mb_per_s / s.mb_per_s - 1.0) * 100.0),
                noisy: h.time.noisy || s.is_some_and(|s| s.time.noisy),
            }
        })
        .collect()
}
