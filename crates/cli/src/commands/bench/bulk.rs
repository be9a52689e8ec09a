//! Bulk AES by file size, through the real streaming engine (in memory) and
//! through the raw CBC primitive, for every backend.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context as _};
use serde::{Deserialize, Serialize};
use tpmcrypt_cipher::backend::{self, Backend};
use tpmcrypt_cipher::recovery::RecoveryKey;
use tpmcrypt_cipher::{Encryptor, Mode, Params, Recipient, StreamOptions};

use super::stats::{Fit, Summary};

/// `aes` value of series computed with AES-NI/CLMUL available.
pub const HARDWARE: &str = "hardware";
/// `aes` value of series computed in the child with AES-NI/CLMUL masked.
pub const SOFTWARE: &str = "software";

/// Which construction is timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BulkMode {
    /// The `gcm` payload (Tink-compatible segmented AES-256-GCM).
    Gcm,
    /// The `cbc` payload: segmented AES-256-CBC + HMAC-SHA-512 (A256CBC-HS512).
    CbcHmac,
    /// Raw AES-256-CBC over the whole buffer through the backend primitive
    /// (no MAC, no segments): the study's measurement.
    CbcRaw,
}

impl BulkMode {
    /// Stable name used in JSON, CSV and tables.
    pub fn name(self) -> &'static str {
        match self {
            BulkMode::Gcm => "gcm",
            BulkMode::CbcHmac => "cbc-hs512",
            BulkMode::CbcRaw => "cbc-raw",
        }
    }
}

/// How measurements are taken.
#[derive(Debug, Clone)]
pub struct Plan {
    /// File sizes in bytes.
    pub sizes: Vec<u64>,
    /// Timed runs per point (fewer for points slower than 1 s, at least 3).
    pub repeat: u32,
    /// Untimed runs before timing.
    pub warmup: u32,
    /// Each sample repeats the operation back to back until it lasts at
    /// least this long, and reports the mean per operation.
    pub min_sample_ms: f64,
}

/// One size of one series.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Point {
    /// Plaintext bytes.
    pub size: u64,
    /// Timed samples taken.
    pub runs: u32,
    /// Operations averaged in each sample.
    pub batch: u32,
    /// Time per operation.
    #[serde(flatten)]
    pub time: Summary,
    /// Plaintext throughput at the median, MB/s (10^6 B/s).
    pub mb_per_s: f64,
    /// Cycles per byte at the median (calibrated TSC), null without TSC.
    pub cycles_per_byte: Option<f64>,
}

/// Timings of one (backend, mode, direction, hardware/software) by size.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Series {
    /// `aes/backend/mode/direction`, unique in a run.
    pub id: String,
    /// Backend name (`openssl`, `ring`, `rustcrypto`).
    pub backend: String,
    /// `hardware` or `software`.
    pub aes: String,
    /// `gcm`, `cbc-hs512` or `cbc-raw`.
    pub mode: String,
    /// AES key size.
    pub key_bits: u32,
    /// `encrypt` or `decrypt`.
    pub direction: String,
    /// By size, ascending.
    pub points: Vec<Point>,
    /// Fit of time against size; null with fewer than two sizes.
    pub model: Option<Fit>,
}

impl Series {
    /// The point measured at `size`.
    pub fn at(&self, size: u64) -> Option<&Point> {
        self.points.iter().find(|p| p.size == size)
    }

    /// Fills in cycles per byte and the model once the TSC rate is known.
    pub fn finish(&mut self, tsc_hz: Option<f64>) {
        for p in &mut self.points {
            p.cycles_per_byte = tsc_hz.map(|hz| p.time.median_ms / 1e3 * hz / p.size as f64);
        }
        let pts: Vec<(f64, f64)> = self
            .points
            .iter()
            .map(|p| (p.size as f64, p.time.median_ms))
            .collect();
        self.model = super::stats::fit(&pts, tsc_hz);
    }
}

/// The (backend, mode) pairs measured with hardware AES.
pub fn hardware_pairs() -> Vec<(Arc<dyn Backend>, BulkMode)> {
    let mut out = Vec::new();
    for b in backend::all() {
        if b.supports_gcm(32) {
            out.push((b.clone(), BulkMode::Gcm));
        }
        if b.supports_cbc() {
            out.push((b.clone(), BulkMode::CbcHmac));
            out.push((b.clone(), BulkMode::CbcRaw));
        }
    }
    out
}

/// The pairs measured with AES-NI masked: only OpenSSL honours the mask.
pub fn software_pairs() -> Vec<(Arc<dyn Backend>, BulkMode)> {
    let b: Arc<dyn Backend> = Arc::new(backend::OpenSsl);
    vec![
        (b.clone(), BulkMode::Gcm),
        (b.clone(), BulkMode::CbcHmac),
        (b, BulkMode::CbcRaw),
    ]
}

/// Random bytes that inputs are cut from (cycled for larger sizes).
pub fn random_source() -> anyhow::Result<Vec<u8>> {
    let mut src = vec![0u8; 4 << 20];
    openssl::rand::rand_bytes(&mut src).context("random bytes")?;
    Ok(src)
}

/// Reads `remaining` bytes cycling through `src`.
struct CycleReader<'a> {
    src: &'a [u8],
    pos: usize,
    remaining: u64,
}

impl Read for CycleReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (buf.len() as u64)
            .min(self.remaining)
            .min((self.src.len() - self.pos) as u64) as usize;
        buf[..n].copy_from_slice(&self.src[self.pos..self.pos + n]);
        self.pos = (self.pos + n) % self.src.len();
        self.remaining -= n as u64;
        Ok(n)
    }
}

fn fill(buf: &mut Vec<u8>, src: &[u8], size: u64) {
    buf.clear();
    let mut left = size as usize;
    while left > 0 {
        let n = left.min(src.len());
        buf.extend_from_slice(&src[..n]);
        left -= n;
    }
}

/// Counts and discards what is written.
struct CountingSink(u64);

impl Write for CountingSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Warm-up, calibrate the batch, then time `plan.repeat` samples of `op`
/// (which returns the seconds one operation took).
pub fn measure(
    plan: &Plan,
    size: u64,
    mut op: impl FnMut() -> anyhow::Result<f64>,
) -> anyhow::Result<Point> {
    // The first run is the first warm-up (and sizes the batch); operations
    // longer than a second need no more warming.
    let first = op()?.max(1e-9);
    if first < 1.0 {
        for _ in 1..plan.warmup {
            op()?;
        }
    }
    let batch = ((plan.min_sample_ms / 1e3 / first).ceil() as u32).clamp(1, 100_000);
    let runs = if first > 1.0 {
        plan.repeat.min(3)
    } else {
        plan.repeat
    };
    let mut samples = Vec::with_capacity(runs as usize);
    for _ in 0..runs {
        let mut total = 0.0;
        for _ in 0..batch {
            total += op()?;
        }
        samples.push(total / f64::from(batch) * 1e3);
    }
    let time = Summary::of(samples);
    Ok(Point {
        size,
        runs,
        batch,
        mb_per_s: size as f64 / (time.median_ms / 1e3) / 1e6,
        time,
        cycles_per_byte: None,
    })
}

fn new_series(b: &dyn Backend, mode: BulkMode, aes: &str, direction: &str) -> Series {
    Series {
        id: format!("{aes}/{}/{}/{direction}", b.name(), mode.name()),
        backend: b.name().to_string(),
        aes: aes.to_string(),
        mode: mode.name().to_string(),
        key_bits: 256,
        direction: direction.to_string(),
        points: Vec::new(),
        model: None,
    }
}

/// Ciphertext capacity for `size` bytes of plaintext (1 MiB segments, at
/// most 64 bytes of overhead each, plus the header).
fn ct_capacity(size: u64) -> usize {
    (size + (size >> 20) * 64 + 65_536) as usize
}

/// Measures encrypt and decrypt of one (backend, mode) at every size;
/// `tick` is called after each point.
pub fn run_pair(
    plan: &Plan,
    src: &[u8],
    b: &Arc<dyn Backend>,
    mode: BulkMode,
    aes: &str,
    tick: &mut dyn FnMut(&str),
) -> anyhow::Result<[Series; 2]> {
    let mut enc_s = new_series(b.as_ref(), mode, aes, "encrypt");
    let mut dec_s = new_series(b.as_ref(), mode, aes, "decrypt");
    match mode {
        BulkMode::Gcm | BulkMode::CbcHmac => {
            stream_pair(plan, src, b, mode, [&mut enc_s, &mut dec_s], tick)?
        }
        BulkMode::CbcRaw => raw_pair(plan, src, b, [&mut enc_s, &mut dec_s], tick)?,
    }
    Ok([enc_s, dec_s])
}

/// Encrypt and decrypt through the streaming engine (gcm, cbc-hs512).
fn stream_pair(
    plan: &Plan,
    src: &[u8],
    b: &Arc<dyn Backend>,
    mode: BulkMode,
    [enc_s, dec_s]: [&mut Series; 2],
    tick: &mut dyn FnMut(&str),
) -> anyhow::Result<()> {
    let recovery = RecoveryKey::generate(&mut rand_core::OsRng);
    let recipients: Vec<Box<dyn Recipient>> = vec![Box::new(recovery.recipient()?)];
    let m = if mode == BulkMode::Gcm {
        Mode::Gcm
    } else {
        Mode::Cbc
    };
    let enc = Encryptor::new(&recipients, Params::new(m, 256)?)?.with_backend(b.clone());
    let dec = enc.verifier()?;
    let opts = StreamOptions::sequential();
    let mut ct: Vec<u8> = Vec::new();
    for &size in &plan.sizes {
        if ct.capacity() < ct_capacity(size) {
            ct = Vec::new(); // free the old buffer first
            ct.reserve_exact(ct_capacity(size));
        }
        let p = measure(plan, size, || {
            let t = Instant::now();
            ct.clear();
            let reader = CycleReader {
                src,
                pos: 0,
                remaining: size,
            };
            let n = enc.encrypt(reader, &mut ct, &opts)?;
            let el = t.elapsed().as_secs_f64();
            if n != size {
                bail!("encrypted {n} bytes, expected {size}");
            }
            Ok(el)
        })?;
        enc_s.points.push(p);
        tick(&enc_s.id);
        let p = measure(plan, size, || {
            let t = Instant::now();
            let mut sink = CountingSink(0);
            let n = dec.decrypt(&ct[..], &mut sink, &opts)?;
            let el = t.elapsed().as_secs_f64();
            if n != size || sink.0 != size {
                bail!("decrypted {n} bytes, expected {size}");
            }
            Ok(el)
        })?;
        dec_s.points.push(p);
        tick(&dec_s.id);
    }
    Ok(())
}

/// Bare AES-256-CBC, in place, without the format (the study's figure).
fn raw_pair(
    plan: &Plan,
    src: &[u8],
    b: &Arc<dyn Backend>,
    [enc_s, dec_s]: [&mut Series; 2],
    tick: &mut dyn FnMut(&str),
) -> anyhow::Result<()> {
    let mut key = [0u8; 32];
    openssl::rand::rand_bytes(&mut key)?;
    let mut k = b.cbc(&key)?;
    let iv = [0x42u8; 16];
    let mut ct: Vec<u8> = Vec::new();
    for &size in &plan.sizes {
        let mut buf: Vec<u8> = Vec::with_capacity(size as usize + 16);
        let p = measure(plan, size, || {
            fill(&mut buf, src, size);
            let t = Instant::now();
            k.encrypt(&iv, &mut buf, 0)?;
            Ok(t.elapsed().as_secs_f64())
        })?;
        enc_s.points.push(p);
        tick(&enc_s.id);
        ct.clear();
        ct.extend_from_slice(&buf);
        let p = measure(plan, size, || {
            buf.clear();
            buf.extend_from_slice(&ct);
            let t = Instant::now();
            let n = k
                .decrypt(&iv, &mut buf)
                .map_err(|_| anyhow!("raw CBC decryption failed"))?;
            let el = t.elapsed().as_secs_f64();
            if n as u64 != size {
                bail!("raw CBC decrypted {n} bytes, expected {size}");
            }
            Ok(el)
        })?;
        dec_s.points.push(p);
        tick(&dec_s.id);
    }
    Ok(())
}
