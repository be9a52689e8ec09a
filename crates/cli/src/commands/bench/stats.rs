//! Small statistics: medians and spread of repeated timings, the noise flag,
//! a least-squares fit of time against size, and the time-stamp counter.

use std::time::Instant;

use serde::{Deserialize, Serialize};

/// A result whose max/min ratio exceeds this is flagged as noisy.
pub const NOISY_RATIO: f64 = 1.5;

/// Summary of repeated measurements of one quantity, in milliseconds.
///
/// Exact order statistics over every sample, not a histogram: there are
/// few samples (--repeat, at most 1000), all of them are published in the
/// JSON, and the median must be the one a reader recomputes from them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    /// Every sample, in the order measured.
    pub samples_ms: Vec<f64>,
    /// Median of the samples.
    pub median_ms: f64,
    /// Smallest sample.
    pub min_ms: f64,
    /// Largest sample.
    pub max_ms: f64,
    /// max / min (1 when there is one sample).
    pub spread: f64,
    /// spread > [`NOISY_RATIO`].
    pub noisy: bool,
}

impl Summary {
    /// Summarises `samples_ms` (which must not be empty: an empty set gives
    /// zeros, flagged noisy so it cannot pass for a measurement).
    pub fn of(samples_ms: Vec<f64>) -> Summary {
        if samples_ms.is_empty() {
            return Summary {
                samples_ms,
                median_ms: 0.0,
                min_ms: 0.0,
                max_ms: 0.0,
                spread: f64::INFINITY,
                noisy: true,
            };
        }
        let mut sorted = samples_ms.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median_ms = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        let min_ms = sorted[0];
        let max_ms = sorted[n - 1];
        let spread = if min_ms > 0.0 { max_ms / min_ms } else { 1.0 };
        Summary {
            samples_ms,
            median_ms,
            min_ms,
            max_ms,
            spread,
            noisy: spread > NOISY_RATIO,
        }
    }
}

/// `time = overhead + size / bandwidth`, fitted by least squares.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Fit {
    /// Per-file (per-call) overhead in microseconds; may come out slightly
    /// negative when the overhead is below the noise.
    pub overhead_us: f64,
    /// Asymptotic bandwidth in MB/s (10^6 bytes per second).
    pub bandwidth_mb_s: f64,
    /// Cycles per byte of the size term, using the calibrated TSC rate
    /// (null when there is no time-stamp counter).
    pub cycles_per_byte: Option<f64>,
    /// Root-mean-square relative error of the fit over the points.
    pub rms_rel_error: f64,
}

impl Fit {
    /// Predicted time in milliseconds for `size` bytes.
    #[cfg(test)]
    pub fn predict_ms(&self, size: f64) -> f64 {
        self.overhead_us / 1e3 + size / (self.bandwidth_mb_s * 1e6) * 1e3
    }

    /// The size at which the predicted time equals `ms` (never negative).
    pub fn size_for_ms(&self, ms: f64) -> f64 {
        let rest_ms = ms - self.overhead_us.max(0.0) / 1e3;
        (rest_ms / 1e3 * self.bandwidth_mb_s * 1e6).max(0.0)
    }
}

/// Weighted least squares of `t = a + b·s` over `(size_bytes, time_ms)`,
/// with weights 1/t² so that every size counts by its relative error (a plain
/// fit would let the largest size decide everything and the overhead would
/// be lost in its noise). None with fewer than two distinct sizes or a
/// non-positive slope.
pub fn fit(points: &[(f64, f64)], tsc_hz: Option<f64>) -> Option<Fit> {
    let pts: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|(s, t)| s.is_finite() && t.is_finite() && *t > 0.0)
        .collect();
    let distinct = {
        let mut s: Vec<f64> = pts.iter().map(|p| p.0).collect();
        s.sort_by(f64::total_cmp);
        s.dedup();
        s.len()
    };
    if distinct < 2 {
        return None;
    }
    let (mut sw, mut sx, mut sy, mut sxx, mut sxy) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x, y) in &pts {
        let w = 1.0 / (y * y);
        sw += w;
        sx += w * x;
        sy += w * y;
        sxx += w * x * x;
        sxy += w * x * y;
    }
    let det = sw * sxx - sx * sx;
    if det.abs() < f64::MIN_POSITIVE {
        return None;
    }
    let b = (sw * sxy - sx * sy) / det; // ms per byte
    let a = (sy - b * sx) / sw; // ms
    if b.is_nan() || b <= 0.0 {
        return None;
    }
    let rms = (pts
        .iter()
        .map(|&(x, y)| ((a + b * x - y) / y).powi(2))
        .sum::<f64>()
        / pts.len() as f64)
        .sqrt();
    Some(Fit {
        overhead_us: a * 1e3,
        bandwidth_mb_s: 1.0 / (b * 1e-3) / 1e6,
        cycles_per_byte: tsc_hz.map(|hz| b * 1e-3 * hz),
        rms_rel_error: rms,
    })
}

/// Reads the time-stamp counter (None off x86-64).
pub fn rdtsc() -> Option<u64> {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: RDTSC is available on every x86-64 CPU and has no
        // memory effects.
        Some(unsafe { core::arch::x86_64::_rdtsc() })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// Calibrates the TSC against the monotonic clock over a whole run: created
/// at the start, read at the end (the longer the run, the better).
pub struct TscClock {
    t0: Instant,
    c0: Option<u64>,
}

impl TscClock {
    /// Starts the calibration interval.
    pub fn start() -> TscClock {
        TscClock {
            t0: Instant::now(),
            c0: rdtsc(),
        }
    }

    /// TSC ticks per second measured since [`TscClock::start`]; at least
    /// 50 ms must have passed (it sleeps for the rest otherwise).
    pub fn hz(&self) -> Option<f64> {
        let c0 = self.c0?;
        let min = std::time::Duration::from_millis(50);
        let el = self.t0.elapsed();
        if el < min {
            std::thread::sleep(min - el);
        }
        let c1 = rdtsc()?;
        let secs = self.t0.elapsed().as_secs_f64();
        (c1 > c0 && secs > 0.0).then(|| (c1 - c0) as f64 / secs)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_noise() {
        let s = Summary::of(vec![3.0, 1.0, 2.0]);
        assert_eq!(s.median_ms, 2.0);
        assert!(s.noisy);
        let s = Summary::of(vec![1.0, 1.1, 1.2, 1.3]);
        assert!((s.median_ms - 1.15).abs() < 1e-9);
        assert!(!s.noisy);
    }

    #[test]
    fn fit_recovers_a_line() {
        // 50 µs + size / 100 MB/s.
        let pts: Vec<(f64, f64)> = [1e4, 1e5, 1e6, 1e7]
            .iter()
            .map(|&s| (s, 0.05 + s / 100e6 * 1e3))
            .collect();
        let f = fit(&pts, Some(2.5e9)).expect("fit");
        assert!((f.overhead_us - 50.0).abs() < 1e-6, "{f:?}");
        assert!((f.bandwidth_mb_s - 100.0).abs() < 1e-6, "{f:?}");
        assert!((f.cycles_per_byte.unwrap_or(0.0) - 25.0).abs() < 1e-6);
        assert!((f.size_for_ms(f.predict_ms(3e6)) - 3e6).abs() < 1e-3);
        assert!(fit(&pts[..1], None).is_none());
    }
}
