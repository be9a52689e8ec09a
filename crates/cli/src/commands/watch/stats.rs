//! Counters, latency histograms, and their three outlets: a log line, a
//! JSON file rewritten atomically, and Prometheus text over a tiny
//! loopback-only HTTP server.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use crate::atomic::AtomicFile;

/// Latencies are recorded in whole microseconds, 1 µs … 10⁴ s (longer ones
/// count as 10⁴ s).
const HIGHEST_US: u64 = 10_000_000_000;
/// Two significant digits: buckets under 1 % wide.
const SIGFIG: u8 = 2;

/// A latency histogram with 1 % resolution: constant memory however long
/// the daemon runs. The quantiles come from `hdrhistogram`; the count, sum
/// and maximum are kept exactly beside it.
#[derive(Clone)]
pub struct Histogram {
    hist: hdrhistogram::Histogram<u64>,
    count: u64,
    sum_us: f64,
    max_us: f64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            // Only fails for bounds out of range, which these constants are not.
            hist: hdrhistogram::Histogram::new_with_bounds(1, HIGHEST_US, SIGFIG)
                .expect("valid histogram bounds"),
            count: 0,
            sum_us: 0.0,
            max_us: 0.0,
        }
    }
}

impl Histogram {
    /// Adds one observation.
    pub fn record(&mut self, d: Duration) {
        let us = (d.as_secs_f64() * 1e6).max(1.0);
        self.hist.saturating_record(us as u64);
        self.count += 1;
        self.sum_us += us;
        self.max_us = self.max_us.max(us);
    }

    /// The `q` quantile (0 < q ≤ 1) in milliseconds, 0 when empty: the
    /// middle of its bucket, never above the maximum.
    pub fn quantile_ms(&self, q: f64) -> f64 {
        if self.count == 0 {
            return 0.0;
        }
        let v = self.hist.median_equivalent(self.hist.value_at_quantile(q));
        (v as f64).min(self.max_us) / 1e3
    }

    /// Mean in milliseconds.
    pub fn mean_ms(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum_us / self.count as f64 / 1e3
        }
    }

    /// The summary exported.
    pub fn summary(&self) -> LatencySummary {
        LatencySummary {
            count: self.count,
            mean_ms: round3(self.mean_ms()),
            p50_ms: round3(self.quantile_ms(0.50)),
            p95_ms: round3(self.quantile_ms(0.95)),
            p99_ms: round3(self.quantile_ms(0.99)),
            max_ms: round3(self.max_us / 1e3),
            sum_s: self.sum_us / 1e6,
        }
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Latency figures as exported.
#[derive(Serialize, Clone, Debug, Default)]
pub struct LatencySummary {
    /// Observations.
    pub count: u64,
    /// Mean (ms).
    pub mean_ms: f64,
    /// Median (ms).
    pub p50_ms: f64,
    /// 95th percentile (ms).
    pub p95_ms: f64,
    /// 99th percentile (ms).
    pub p99_ms: f64,
    /// Maximum (ms).
    pub max_ms: f64,
    /// Sum (s), for Prometheus.
    pub sum_s: f64,
}

/// The counters, as kept and as exported (flattened into `--stats-json`).
#[derive(Default, Clone, Copy, Serialize)]
pub struct Counters {
    /// Files encrypted (ciphertext durable).
    pub files: u64,
    /// Plaintext bytes encrypted.
    pub bytes: u64,
    /// Attempts that failed (each is retried).
    pub failures: u64,
    /// Files found already encrypted and unchanged.
    pub unchanged: u64,
    /// Entries that are not regular files (symlinks, FIFOs, …).
    pub skipped: u64,
    /// Files that changed while being encrypted (done again).
    pub changed: u64,
    /// Sources removed after verification (--delete-plaintext).
    pub deleted: u64,
    /// Encryptions whose source was kept under --delete-plaintext because
    /// no file lease could be taken on it (an open writer cannot be ruled
    /// out).
    pub kept_no_lease: u64,
    /// Files waiting for --settle.
    pub settling: u64,
    /// Files ready, waiting for a worker.
    pub queue_depth: u64,
    /// Files being encrypted.
    pub in_flight: u64,
    /// Session keys drawn (1 + rotations).
    pub sessions: u64,
}

/// Everything counted. Owned by the coordinator, shared (behind a mutex)
/// with the metrics server.
#[derive(Default, Clone)]
pub struct Stats {
    /// Files, bytes, failures, queue sizes, sessions.
    pub counters: Counters,
    /// Close-write event → durable ciphertext.
    pub latency: Histogram,
    /// Worker start → durable ciphertext.
    pub service: Histogram,
}

/// The JSON document of `--stats-json`.
#[derive(Serialize)]
pub struct Snapshot {
    /// When it was taken, RFC 3339 (UTC).
    pub time: String,
    /// Seconds since start.
    pub uptime_s: f64,
    /// See [`Counters`].
    #[serde(flatten)]
    pub counters: Counters,
    /// Close-write event → durable ciphertext.
    pub latency: LatencySummary,
    /// Time a worker spends on one file.
    pub service: LatencySummary,
}

impl Stats {
    /// The exported view.
    pub fn snapshot(&self, started: Instant) -> Snapshot {
        Snapshot {
            time: crate::ui::rfc3339(SystemTime::now()),
            uptime_s: started.elapsed().as_secs_f64(),
            counters: self.counters,
            latency: self.latency.summary(),
            service: self.service.summary(),
        }
    }

    /// One log line.
    pub fn line(&self) -> String {
        let l = self.latency.summary();
        format!(
            "{} files ({:.1} MiB), {} unchanged, {} failed, {} settling, {} queued, {} in flight; \
             latency p50 {:.1} ms, p95 {:.1} ms, p99 {:.1} ms",
            self.counters.files,
            self.counters.bytes as f64 / (1 << 20) as f64,
            self.counters.unchanged,
            self.counters.failures,
            self.counters.settling,
            self.counters.queue_depth,
            self.counters.in_flight,
            l.p50_ms,
            l.p95_ms,
            l.p99_ms
        )
    }

    /// Prometheus text exposition format (0.0.4).
    pub fn prometheus(&self, started: Instant) -> String {
        let mut out = String::new();
        for (name, kind, help, value) in self.scalar_metrics(started) {
            out.push_str(&format!(
                "# HELP tpmcrypt_watch_{name} {help}\n# TYPE tpmcrypt_watch_{name} {kind}\n\
                 tpmcrypt_watch_{name} {value}\n"
            ));
        }
        for (name, help, h) in [
            (
                "latency_seconds",
                "Close-write event to durable ciphertext.",
                &self.latency,
            ),
            ("service_seconds", "Worker time per file.", &self.service),
        ] {
            summary_metric(&mut out, name, help, h);
        }
        out
    }

    /// The counters and gauges: (name, type, help, value). Over 80 lines
    /// only because it is a table, one row per metric.
    fn scalar_metrics(
        &self,
        started: Instant,
    ) -> [(&'static str, &'static str, &'static str, String); 13] {
        [
            (
                "files_total",
                "counter",
                "Files encrypted (ciphertext durable).",
                self.counters.files.to_string(),
            ),
            (
                "bytes_total",
                "counter",
                "Plaintext bytes encrypted.",
                self.counters.bytes.to_string(),
            ),
            (
                "failures_total",
                "counter",
                "Failed attempts (each is retried).",
                self.counters.failures.to_string(),
            ),
            (
                "unchanged_total",
                "counter",
                "Files found already encrypted and unchanged.",
                self.counters.unchanged.to_string(),
            ),
            (
                "skipped_total",
                "counter",
                "Entries skipped: symlinks, FIFOs, sockets, devices.",
                self.counters.skipped.to_string(),
            ),
            (
                "changed_total",
                "counter",
                "Files that changed while being encrypted.",
                self.counters.changed.to_string(),
            ),
            (
                "deleted_total",
                "counter",
                "Plaintexts removed after verification.",
                self.counters.deleted.to_string(),
            ),
            (
                "kept_no_lease_total",
                "counter",
                "Sources kept under --delete-plaintext: no file lease could be taken.",
                self.counters.kept_no_lease.to_string(),
            ),
            (
                "settling",
                "gauge",
                "Files waiting for --settle.",
                self.counters.settling.to_string(),
            ),
            (
                "queue_depth",
                "gauge",
                "Files waiting for a worker.",
                self.counters.queue_depth.to_string(),
            ),
            (
                "in_flight",
                "gauge",
                "Files being encrypted.",
                self.counters.in_flight.to_string(),
            ),
            (
                "sessions_total",
                "counter",
                "Session keys drawn.",
                self.counters.sessions.to_string(),
            ),
            (
                "uptime_seconds",
                "gauge",
                "Seconds since start.",
                format!("{:.3}", started.elapsed().as_secs_f64()),
            ),
        ]
    }
}

/// A histogram as a Prometheus summary: quantiles, sum and count.
fn summary_metric(out: &mut String, name: &str, help: &str, h: &Histogram) {
    out.push_str(&format!(
        "# HELP tpmcrypt_watch_{name} {help}\n# TYPE tpmcrypt_watch_{name} summary\n"
    ));
    for q in [0.5, 0.95, 0.99] {
        out.push_str(&format!(
            "tpmcrypt_watch_{name}{{quantile=\"{q}\"}} {:.6}\n",
            h.quantile_ms(q) / 1e3
        ));
    }
    let s = h.summary();
    out.push_str(&format!(
        "tpmcrypt_watch_{name}_sum {:.6}\ntpmcrypt_watch_{name}_count {}\n",
        s.sum_s, s.count
    ));
}

/// Writes the JSON snapshot to `path`, crash-safe (temporary, fsync,
/// rename).
pub fn write_json(path: &Path, snap: &Snapshot) -> anyhow::Result<()> {
    // Checked at start (see `setup`) and again before every write: what
    // took its place since (a key moved onto the name, a device) is not
    // renamed over.
    if let Some(why) = crate::statsfile::replace_refusal(path, watch_figures) {
        anyhow::bail!("{why} (it changed since the daemon started)");
    }
    // One write: serde_json writes each token by itself (about 150 one-byte
    // writes a snapshot, straight to the file).
    let mut text = serde_json::to_vec_pretty(snap)?;
    text.push(b'\n');
    let mut f = AtomicFile::create(path, 0o644, true)?;
    f.file().write_all(&text)?;
    f.commit()?;
    Ok(())
}

/// Figures [`write_json`] wrote.
pub fn watch_figures(v: &serde_json::Value) -> bool {
    v.get("uptime_s").is_some() && v.get("latency").is_some()
}

/// Parses and checks a `--metrics` address: an IP literal on loopback.
pub fn metrics_addr(text: &str) -> anyhow::Result<SocketAddr> {
    let addr: SocketAddr = text.parse().map_err(|_| {
        crate::ui::exit::usage(format!(
            "--metrics {text:?}: expected IP:PORT such as 127.0.0.1:9464"
        ))
    })?;
    if !addr.ip().is_loopback() {
        return Err(crate::ui::exit::usage(format!(
            "--metrics {text}: refusing a non-loopback address (metrics are served on 127.0.0.1 or [::1] only)"
        )));
    }
    Ok(addr)
}

/// Serves `GET /metrics` on `listener` until the process exits.
pub fn serve_metrics(listener: TcpListener, stats: Arc<Mutex<Stats>>, started: Instant) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        if let Err(e) = answer(conn, &stats, started) {
            tracing::debug!("metrics request: {e}");
        }
    }
}

fn answer(mut conn: TcpStream, stats: &Mutex<Stats>, started: Instant) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    conn.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut req = Vec::with_capacity(512);
    let mut buf = [0u8; 512];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 8192 {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            break;
        }
        req.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&req);
    let mut words = line.split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let (status, body) = match (method, target) {
        ("GET", "/metrics") | ("GET", "/") => {
            let s = stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
            ("200 OK", s.prometheus(started))
        }
        ("GET", _) => ("404 Not Found", "not found\n".to_string()),
        _ => ("405 Method Not Allowed", "GET only\n".to_string()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes())?;
    conn.write_all(body.as_bytes())?;
    conn.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_within_one_percent() {
        let mut h = Histogram::default();
        for ms in 1..=1000u64 {
            h.record(Duration::from_millis(ms));
        }
        for (q, want) in [(0.5, 500.0), (0.95, 950.0), (0.99, 990.0)] {
            let got = h.quantile_ms(q);
            assert!((got - want).abs() / want < 0.01, "q{q}: {got} vs {want}");
        }
        assert!((h.mean_ms() - 500.5).abs() < 0.01);
        assert_eq!(Histogram::default().quantile_ms(0.5), 0.0);
    }

    #[test]
    fn prometheus_text_has_every_metric_with_help_type_and_value() {
        let mut s = Stats::default();
        let c = &mut s.counters;
        (c.files, c.bytes, c.failures, c.unchanged, c.skipped) = (1, 2, 3, 4, 5);
        (c.changed, c.deleted, c.kept_no_lease, c.settling) = (6, 7, 8, 9);
        (c.queue_depth, c.in_flight, c.sessions) = (10, 11, 12);
        s.latency.record(Duration::from_millis(250));
        s.service.record(Duration::from_millis(40));
        s.service.record(Duration::from_millis(60));
        let text = s.prometheus(Instant::now());
        let lines: Vec<&str> = text.lines().collect();
        let scalars = [
            ("files_total", "counter", "1"),
            ("bytes_total", "counter", "2"),
            ("failures_total", "counter", "3"),
            ("unchanged_total", "counter", "4"),
            ("skipped_total", "counter", "5"),
            ("changed_total", "counter", "6"),
            ("deleted_total", "counter", "7"),
            ("kept_no_lease_total", "counter", "8"),
            ("settling", "gauge", "9"),
            ("queue_depth", "gauge", "10"),
            ("in_flight", "gauge", "11"),
            ("sessions_total", "counter", "12"),
        ];
        for (i, (name, kind, value)) in scalars.iter().enumerate() {
            let at = &lines[3 * i..3 * i + 3];
            assert!(
                at[0].starts_with(&format!("# HELP tpmcrypt_watch_{name} ")),
                "{at:?}"
            );
            assert_eq!(at[1], format!("# TYPE tpmcrypt_watch_{name} {kind}"));
            assert_eq!(at[2], format!("tpmcrypt_watch_{name} {value}"));
        }
        assert_eq!(lines[37], "# TYPE tpmcrypt_watch_uptime_seconds gauge");
        assert!(lines[38].starts_with("tpmcrypt_watch_uptime_seconds 0.0"));
        assert_eq!(lines[40], "# TYPE tpmcrypt_watch_latency_seconds summary");
        assert!(lines[41].starts_with("tpmcrypt_watch_latency_seconds{quantile=\"0.5\"} 0.2"));
        assert_eq!(lines[44], "tpmcrypt_watch_latency_seconds_sum 0.250000");
        assert_eq!(lines[45], "tpmcrypt_watch_latency_seconds_count 1");
        assert_eq!(lines[47], "# TYPE tpmcrypt_watch_service_seconds summary");
        assert_eq!(lines[51], "tpmcrypt_watch_service_seconds_sum 0.100000");
        assert_eq!(lines[52], "tpmcrypt_watch_service_seconds_count 2");
        assert_eq!(lines.len(), 53);
        assert!(text.ends_with('\n'));
    }

    #[test]
    fn quantiles_of_a_wide_spread_within_one_percent_of_exact() {
        // 20 µs … 20 s, geometric, with a heavy tail, out of order.
        let mut us: Vec<u64> = (0..5000u64)
            .map(|i| (20.0 * 1.0014f64.powi(((i * 7919) % 5000) as i32)) as u64)
            .collect();
        let mut h = Histogram::default();
        for &u in &us {
            h.record(Duration::from_micros(u));
        }
        us.sort_unstable();
        for q in [0.01, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0] {
            let rank = ((q * us.len() as f64).ceil() as usize).clamp(1, us.len());
            let want = us[rank - 1] as f64 / 1e3;
            let got = h.quantile_ms(q);
            assert!((got - want).abs() / want < 0.01, "q{q}: {got} vs {want}");
            assert!(got <= h.summary().max_ms + 1e-9);
        }
        assert_eq!(h.summary().count, 5000);
        let sum: u64 = us.iter().sum();
        assert!((h.summary().sum_s - sum as f64 / 1e6).abs() < 1e-6);
    }

    #[test]
    fn metrics_only_on_loopback() {
        assert!(metrics_addr("127.0.0.1:9464").is_ok());
        assert!(metrics_addr("[::1]:9464").is_ok());
        assert!(metrics_addr("0.0.0.0:9464").is_err());
        assert!(metrics_addr("192.168.1.2:80").is_err());
        assert!(metrics_addr("localhost:80").is_err());
    }
}
