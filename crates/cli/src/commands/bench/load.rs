//! The load generator (`tpmcrypt bench watch …`): starts the daemon on
//! scratch directories, drops files into SRC with Poisson arrivals, and
//! compares the measured latency with a queueing model.
//!
//! Model: the daemon is an M/M/c queue whose c servers are the workers.
//! Arrivals are Poisson at rate λ (the --settle delay shifts every arrival
//! by the same constant, which keeps them Poisson). The mean service time S
//! is the daemon's own per-file figure measured in a calibration run at low
//! load, together with the fixed overhead D = (mean latency − S) at low
//! load (settle plus timer and dispatch). Then, with a = λS and ρ = a/c,
//!
//! ```text
//! W = D + S + C(c, a) · S / (c (1 − ρ))      (C: Erlang's C formula)
//! ```
//!
//! For comparison the M/M/1 figure of one server c times as fast is shown
//! too: W₁ = D + (S/c) / (1 − ρ).

use std::collections::HashSet;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::Args;
use rand_core::{OsRng, RngCore};

use crate::commands::watch::{parse_duration, parse_size};

/// Load generator settings.
#[derive(Args, Debug, Clone)]
pub struct LoadArgs {
    /// Offered load in files per second (Poisson arrivals).
    #[arg(long, default_value_t = 500.0, value_parser = crate::args::value::positive_rate)]
    pub rate: f64,

    /// Instead of --rate: the target utilisation ρ; the rate is ρ·c/S with
    /// S from the calibration run.
    #[arg(long, value_name = "RHO", value_parser = crate::args::value::positive_rate)]
    pub utilisation: Option<f64>,

    /// Size of each file (e.g. 64KiB).
    #[arg(long, value_name = "SIZE", default_value = "64KiB", value_parser = parse_size)]
    pub size: u64,

    /// How long files are generated.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    pub duration: Duration,

    /// Daemon workers (c in the model).
    #[arg(long, default_value_t = 8)]
    pub workers: usize,

    /// The daemon's --settle.
    #[arg(long, value_name = "DURATION", default_value = "10ms", value_parser = parse_duration)]
    pub settle: Duration,

    /// Rate of the low-load calibration run that measures S.
    #[arg(long, default_value_t = 20.0, value_parser = crate::args::value::positive_rate)]
    pub calibrate_rate: f64,

    /// Length of the calibration run.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    pub calibrate_duration: Duration,

    /// Skip the calibration (and the model).
    #[arg(long)]
    pub no_calibrate: bool,

    /// Pass --delete-plaintext to the daemon.
    #[arg(long)]
    pub delete_plaintext: bool,

    /// Scratch directory parent (default: the system temporary directory).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,

    /// Keep the scratch directory.
    #[arg(long)]
    pub keep: bool,

    /// Print the results as JSON on stdout; the running commentary goes
    /// to stderr.
    #[arg(long)]
    pub json: bool,
}

/// What one run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Phase {
    /// Offered rate.
    pub offered_rate: f64,
    /// Files written.
    pub sent: u64,
    /// Achieved arrival rate.
    pub arrival_rate: f64,
    /// Ciphertexts present at the end.
    pub encrypted: u64,
    /// sent − encrypted.
    pub lost: u64,
    /// Files per second from the first write to the last ciphertext.
    pub throughput: f64,
    /// The daemon's final --stats-json.
    pub daemon: serde_json::Value,
    /// Writer close → ciphertext renamed into place (ms): mean, p50, p95, p99.
    pub end_to_end_ms: [f64; 4],
    /// Daemon exit code.
    pub exit_code: i32,
}

/// Whether the commentary goes to stderr (`--json`: stdout is the JSON
/// document alone).
static TEXT_ON_STDERR: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A line of commentary: on stdout, or on stderr under `--json`.
macro_rules! say {
    ($($t:tt)*) => {
        if TEXT_ON_STDERR.load(std::sync::atomic::Ordering::Relaxed) {
            stderr_line!($($t)*)
        } else {
            println!($($t)*)
        }
    };
}

fn unif(rng: &mut OsRng) -> f64 {
    ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// Mean, p50, p95 and p99 of the generator's end-to-end latencies, exact
/// (nearest rank). Kept by hand rather than through a histogram: a run's
/// samples are all in memory anyway (one per file sent, to pair each close
/// with its ciphertext), and the figures are compared with the daemon's
/// own histogram quantiles, so they should carry no bucket error of their
/// own.
fn percentiles(mut v: Vec<f64>) -> [f64; 4] {
    if v.is_empty() {
        return [0.0; 4];
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    [mean, at(0.5), at(0.95), at(0.99)]
}

struct Daemon {
    child: Child,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_daemon(args: &LoadArgs, dir: &Path, recipient: &Path) -> anyhow::Result<Daemon> {
    let exe = std::env::current_exe().context("locating the tpmcrypt executable")?;
    let sock_path = dir.join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).context("notify socket")?;
    sock.set_read_timeout(Some(Duration::from_millis(200)))?;
    let log = private_file(&dir.join("daemon.log"))?;
    let mut cmd = Command::new(exe);
    cmd.arg("watch")
        .arg(dir.join("src"))
        .arg("--out")
        .arg(dir.join("dest"))
        .arg("-R")
        .arg(recipient)
        .arg("--settle")
        .arg(format!("{}ms", args.settle.as_millis()))
        .arg("--workers")
        .arg(args.workers.to_string())
        .arg("--stats-json")
        .arg(dir.join("stats.json"))
        .arg("--stats-interval")
        .arg("1s")
        .env("NOTIFY_SOCKET", &sock_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    if args.delete_plaintext {
        cmd.arg("--delete-plaintext");
    }
    super::dies_with_this_process(&mut cmd);
    let mut daemon = Daemon {
        child: cmd.spawn().context("starting tpmcrypt watch")?,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut buf = [0u8; 4096];
    loop {
        if let Ok(n) = sock.recv(&mut buf) {
            if String::from_utf8_lossy(&buf[..n])
                .lines()
                .any(|l| l == "READY=1")
            {
                return Ok(daemon);
            }
        }
        if let Some(status) = daemon.child.try_wait()? {
            bail!(
                "the daemon exited ({status}) before it was ready; see {}",
                dir.join("daemon.log").display()
            );
        }
        if Instant::now() > deadline {
            bail!("the daemon did not become ready within 30 s");
        }
    }
}

/// A new directory for this user only (0700, whatever the umask).
fn private_dir(path: &Path) -> std::io::Result<()> {
    fs::DirBuilder::new().mode(0o700).create(path)
}

/// A new file for this user only (0600, whatever the umask).
fn private_file(path: &Path) -> std::io::Result<fs::File> {
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

fn name_of(i: u64) -> String {
    format!("f{i:08}")
}

/// One run: start the daemon, generate, drain, stop.
fn run_phase(
    args: &LoadArgs,
    base: &Path,
    label: &str,
    rate: f64,
    duration: Duration,
    recipient: &Path,
) -> anyhow::Result<Phase> {
    let dir = base.join(label);
    for d in [&dir, &dir.join("src"), &dir.join("dest")] {
        private_dir(d)?;
    }
    let mut daemon = start_daemon(args, &dir, recipient)?;

    // Watch DEST for ciphertexts renamed into place.
    let (watcher, rx) = watch_dest(&dir.join("dest"))?;

    let (closed, t0, gen_elapsed) = generate(args, &dir.join("src"), rate, duration)?;
    let sent = closed.len() as u64;

    // Drain: wait for every ciphertext (or give up after 60 s of silence).
    let seen = drain(&rx, sent);
    drop(watcher);
    let last_done = seen.iter().flatten().max().copied().unwrap_or(t0);

    // SAFETY: sending SIGTERM to our own child.
    unsafe {
        libc::kill(daemon.child.id() as i32, libc::SIGTERM);
    }
    let status = daemon.child.wait()?;
    let exit_code = status.code().unwrap_or(-1);
    let daemon_stats: serde_json::Value = fs::read(dir.join("stats.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(serde_json::Value::Null);

    let names: HashSet<std::ffi::OsString> = fs::read_dir(dir.join("dest"))?
        .flatten()
        .map(|e| e.file_name())
        .collect();
    let encrypted = (0..sent)
        .filter(|&i| names.contains(std::ffi::OsStr::new(&format!("{}.tpmc", name_of(i)))))
        .count() as u64;
    let e2e: Vec<f64> = closed
        .iter()
        .zip(&seen)
        .filter_map(|(c, s)| s.map(|s| s.saturating_duration_since(*c).as_secs_f64() * 1e3))
        .collect();
    Ok(Phase {
        offered_rate: rate,
        sent,
        arrival_rate: sent as f64 / gen_elapsed.as_secs_f64(),
        encrypted,
        lost: sent - encrypted,
        throughput: encrypted as f64
            / last_done
                .saturating_duration_since(t0)
                .as_secs_f64()
                .max(1e-9),
        daemon: daemon_stats,
        end_to_end_ms: percentiles(e2e),
        exit_code,
    })
}

/// The file number of a ciphertext's name (`f00000042.tpmc` → 42).
fn file_number(name: &std::ffi::OsStr) -> Option<u64> {
    name.to_str()?
        .strip_prefix('f')?
        .strip_suffix(".tpmc")?
        .parse::<u64>()
        .ok()
}

/// The observer of DEST: a thread that sends (file number, when) for each
/// ciphertext given its name (renamed into place, or linked: a new one is
/// written with no name), until dropped.
///
/// It asks the kernel for `IN_MOVED_TO` and `IN_CREATE` alone (a
/// temporary's name is not a ciphertext's, and is passed over). The daemon
/// creates, writes, names and syncs in DEST several times a file, and an
/// observer subscribed to every event (as a general watcher is) costs the
/// daemon an event queued per step and the machine a thread woken per
/// event, a load the daemon never has outside the benchmark.
struct DestObserver {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for DestObserver {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn watch_dest(dest: &Path) -> anyhow::Result<(DestObserver, mpsc::Receiver<(u64, Instant)>)> {
    use inotify::{EventMask, Inotify, WatchMask};
    use std::os::fd::AsRawFd as _;
    use std::sync::atomic::{AtomicBool, Ordering};

    let (tx, rx) = mpsc::channel::<(u64, Instant)>();
    let mut ino = Inotify::init().context("starting inotify")?;
    ino.watches()
        .add(
            dest,
            WatchMask::MOVED_TO | WatchMask::CREATE | WatchMask::ONLYDIR,
        )
        .with_context(|| format!("watching {}", dest.display()))?;
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let dest = dest.to_path_buf();
    let thread = std::thread::Builder::new()
        .name("dest-observer".into())
        .spawn(move || {
            let mut buf = vec![0u8; 64 << 10];
            let fd = ino.as_raw_fd();
            while !stopped.load(Ordering::Relaxed) {
                let mut pfd = libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, for the inotify descriptor this
                // thread owns.
                if unsafe { libc::poll(&mut pfd, 1, 100) } <= 0 {
                    continue;
                }
                let events = match ino.read_events(&mut buf) {
                    Ok(events) => events,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(_) => return,
                };
                let at = Instant::now();
                for ev in events {
                    if ev.mask.contains(EventMask::Q_OVERFLOW) {
                        // Events were lost: what is in DEST now is there by
                        // now (a late time, never a missed file).
                        let Ok(dir) = fs::read_dir(&dest) else {
                            continue;
                        };
                        for e in dir.flatten() {
                            if let Some(i) = file_number(&e.file_name()) {
                                let _ = tx.send((i, at));
                            }
                        }
                    } else if let Some(i) = ev.name.and_then(file_number) {
                        let _ = tx.send((i, at));
                    }
                }
            }
        })
        .context("starting the observer of DEST")?;
    Ok((
        DestObserver {
            stop,
            thread: Some(thread),
        },
        rx,
    ))
}

/// Writes files into SRC with Poisson arrivals at `rate` for `duration`.
/// Returns when each was closed, the start, and the generation time.
fn generate(
    args: &LoadArgs,
    src: &Path,
    rate: f64,
    duration: Duration,
) -> anyhow::Result<(Vec<Instant>, Instant, Duration)> {
    let mut data = vec![0u8; args.size as usize];
    OsRng.fill_bytes(&mut data);
    let mut rng = OsRng;
    let mut closed: Vec<Instant> = Vec::new();
    let t0 = Instant::now();
    let end = t0 + duration;
    let mut next = t0;
    loop {
        next += Duration::from_secs_f64(-(1.0 - unif(&mut rng)).ln() / rate);
        if next >= end {
            break;
        }
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        }
        let i = closed.len() as u64;
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(src.join(name_of(i)))?;
        f.write_all(&data)?;
        drop(f);
        closed.push(Instant::now());
    }
    let gen_elapsed = t0.elapsed().max(duration);
    Ok((closed, t0, gen_elapsed))
}

/// Waits until `sent` ciphertexts were seen, or 60 s without one; when
/// each file's ciphertext appeared.
fn drain(rx: &mpsc::Receiver<(u64, Instant)>, sent: u64) -> Vec<Option<Instant>> {
    let mut seen: Vec<Option<Instant>> = vec![None; sent as usize];
    let mut count = 0u64;
    let mut last = Instant::now();
    while count < sent {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok((i, at)) => {
                if let Some(slot) = seen.get_mut(i as usize) {
                    if slot.is_none() {
                        *slot = Some(at);
                        count += 1;
                    }
                }
                last = Instant::now();
            }
            Err(_) => {
                if last.elapsed() > Duration::from_secs(60) {
                    break;
                }
            }
        }
    }
    seen
}

fn num(v: &serde_json::Value, path: &[&str]) -> f64 {
    let mut v = v;
    for p in path {
        v = &v[*p];
    }
    v.as_f64().unwrap_or(0.0)
}

/// Erlang's C formula: the probability that an arrival waits, for c
/// servers and offered load a = λS (< c).
pub fn erlang_c(c: usize, a: f64) -> f64 {
    let rho = a / c as f64;
    if rho >= 1.0 {
        return 1.0;
    }
    let mut term = 1.0; // a^k / k!
    let mut sum = 0.0;
    for k in 0..c {
        if k > 0 {
            term *= a / k as f64;
        }
        sum += term;
    }
    let last = term * a / c as f64 / (1.0 - rho); // a^c / c! / (1 − ρ)
    last / (sum + last)
}

/// Runs the load test and prints a report. Exit code 0 when nothing was
/// lost and the daemon stopped cleanly.
pub fn run_load(args: &LoadArgs) -> anyhow::Result<i32> {
    if args.workers == 0 || args.rate <= 0.0 || args.size == 0 {
        return Err(crate::ui::exit::usage(
            "--workers, --rate and --size must be positive",
        ));
    }
    TEXT_ON_STDERR.store(args.json, std::sync::atomic::Ordering::Relaxed);
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    fs::create_dir_all(&parent).with_context(|| parent.display().to_string())?;
    let scratch = tempfile::Builder::new()
        .prefix(&format!("tpmcrypt-watch-load.{}.", std::process::id()))
        .permissions(fs::Permissions::from_mode(0o700))
        .tempdir_in(&parent)
        .with_context(|| parent.display().to_string())?;
    // An interrupt stops the daemon and removes the tree (plaintext, an
    // identity) unless --keep.
    let interrupt = crate::atomic::scratch_on_interrupt(scratch.path(), !args.keep)
        .context("setting up the clean-up on interrupts")?;
    let result = run_in(args, scratch.path());
    drop(interrupt);
    if args.keep {
        stderr_line!("scratch directory kept: {}", scratch.keep().display());
    }
    result
}

fn run_in(args: &LoadArgs, base: &Path) -> anyhow::Result<i32> {
    let exe = std::env::current_exe()?;
    let mut create = Command::new(&exe);
    create
        .args(["recovery", "create", "--out"])
        .arg(base.join("id"))
        .stdin(Stdio::null());
    super::dies_with_this_process(&mut create);
    let out = create.output()?;
    if !out.status.success() {
        bail!("recovery create: {}", String::from_utf8_lossy(&out.stderr));
    }
    let recipient = base.join("recipient");
    private_file(&recipient)?.write_all(&out.stdout)?;
    let c = args.workers;

    let calib = calibrate(args, base, &recipient)?;

    let rate = match (args.utilisation, &calib) {
        (Some(rho), Some((s, _, _))) if *s > 0.0 => rho * c as f64 / (s / 1e3),
        (Some(_), _) => bail!("--utilisation needs the calibration run"),
        (None, _) => args.rate,
    };
    say!(
        "run: {rate:.0} files/s (Poisson) of {} B for {} s, {c} workers, settle {} ms",
        args.size,
        args.duration.as_secs_f64(),
        args.settle.as_millis()
    );
    let p = run_phase(args, base, "run", rate, args.duration, &recipient)?;
    print_phase(args, &p);
    let model = match &calib {
        Some((s_ms, d_ms, _)) => model(c, *s_ms, *d_ms, &p),
        None => serde_json::Value::Null,
    };
    if args.json {
        let doc = serde_json::json!({
            "run": p,
            "calibration": calib.as_ref().map(|c| &c.2),
            "model": model,
        });
        crate::ui::stdout::line(&serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(if p.lost == 0 && p.exit_code == 0 {
        crate::ui::exit::OK
    } else {
        crate::ui::exit::OTHER
    })
}

/// The low-load calibration run: (S, D, the run) in ms, or None with
/// --no-calibrate.
fn calibrate(
    args: &LoadArgs,
    base: &Path,
    recipient: &Path,
) -> anyhow::Result<Option<(f64, f64, Phase)>> {
    if args.no_calibrate {
        return Ok(None);
    }
    let c = args.workers;
    say!(
        "calibration: {:.0} files/s for {} s ({} B files, {} workers, settle {} ms)",
        args.calibrate_rate,
        args.calibrate_duration.as_secs_f64(),
        args.size,
        c,
        args.settle.as_millis()
    );
    let p = run_phase(
        args,
        base,
        "calibrate",
        args.calibrate_rate,
        args.calibrate_duration,
        recipient,
    )?;
    let s = num(&p.daemon, &["service", "mean_ms"]);
    let l = num(&p.daemon, &["latency", "mean_ms"]);
    say!(
        "  S (mean service time) = {s:.2} ms; mean latency {l:.2} ms; fixed overhead D = {:.2} ms",
        l - s
    );
    Ok(Some((s, l - s, p)))
}

/// Prints what one run measured.
fn print_phase(args: &LoadArgs, p: &Phase) {
    let d = &p.daemon;
    say!(
        "  sent {} (arrival rate {:.1}/s), encrypted {}, lost {}, daemon failures {}, daemon exit {}",
        p.sent,
        p.arrival_rate,
        p.encrypted,
        p.lost,
        num(d, &["failures"]),
        p.exit_code
    );
    say!(
        "  throughput {:.1} files/s, {:.1} MiB/s",
        p.throughput,
        p.throughput * args.size as f64 / (1 << 20) as f64
    );
    say!(
        "  latency close-write event → durable ciphertext (daemon): mean {:.2} ms, p50 {:.2}, p95 {:.2}, p99 {:.2}, max {:.2}",
        num(d, &["latency", "mean_ms"]),
        num(d, &["latency", "p50_ms"]),
        num(d, &["latency", "p95_ms"]),
        num(d, &["latency", "p99_ms"]),
        num(d, &["latency", "max_ms"]),
    );
    let [m, p50, p95, p99] = p.end_to_end_ms;
    say!(
        "  latency writer close → .tpmc renamed (generator): mean {m:.2} ms, p50 {p50:.2}, p95 {p95:.2}, p99 {p99:.2}"
    );
    say!(
        "  service time under load: mean {:.2} ms, p99 {:.2} ms",
        num(d, &["service", "mean_ms"]),
        num(d, &["service", "p99_ms"])
    );
}

/// The M/M/c model of the run, printed beside the measurement, and as JSON
/// (null when overloaded).
fn model(c: usize, s_ms: f64, d_ms: f64, p: &Phase) -> serde_json::Value {
    let d = &p.daemon;
    let lambda = p.arrival_rate;
    let s = s_ms / 1e3;
    let a = lambda * s;
    let rho = a / c as f64;
    let measured = num(d, &["latency", "mean_ms"]);
    if rho >= 1.0 {
        say!("  model: ρ = λS/c = {rho:.2} ≥ 1: overloaded, no steady state");
        serde_json::Value::Null
    } else {
        let cw = erlang_c(c, a);
        let wq = cw * s / (c as f64 * (1.0 - rho)) * 1e3;
        let w_mmc = d_ms + s_ms + wq;
        let w_mm1 = d_ms + (s_ms / c as f64) / (1.0 - rho);
        let err = (measured - w_mmc) / w_mmc * 100.0;
        say!(
            "  model M/M/{c}: λ = {lambda:.1}/s, S = {s_ms:.2} ms, ρ = λS/c = {rho:.2}, P(wait) = {cw:.3}, Wq = {wq:.2} ms"
        );
        say!(
            "    predicted mean latency D + S + Wq = {w_mmc:.2} ms; measured {measured:.2} ms ({err:+.1} %)"
        );
        say!(
            "    (M/M/1 with one server {c}× as fast: {w_mm1:.2} ms, {:+.1} %)",
            (measured - w_mm1) / w_mm1 * 100.0
        );
        serde_json::json!({
            "c": c, "lambda": lambda, "service_ms": s_ms, "overhead_ms": d_ms,
            "rho": rho, "erlang_c": cw, "wq_ms": wq, "predicted_mean_ms": w_mmc,
            "predicted_mm1_mean_ms": w_mm1, "measured_mean_ms": measured,
            "error_percent": err,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erlang_c_known_values() {
        // One server: P(wait) = ρ.
        assert!((erlang_c(1, 0.5) - 0.5).abs() < 1e-12);
        // Two servers at ρ = 0.5: 2ρ²/(1+ρ) = 1/3.
        assert!((erlang_c(2, 1.0) - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(erlang_c(2, 2.0), 1.0);
    }

    #[test]
    fn the_observer_reports_ciphertexts_given_their_names_in_dest() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path();
        let (observer, rx) = watch_dest(dest).unwrap();
        // Written under a temporary name, then renamed, as the daemon
        // replaces a ciphertext; names that are not a ciphertext of the
        // generator's; and one made under its name (as a link of a file
        // with no name appears).
        for (tmp, name) in [
            (".t1", "f00000007.tpmc"),
            (".t2", "other.tpmc"),
            (".t3", "f00000009.tpmc"),
        ] {
            fs::write(dest.join(tmp), b"x").unwrap();
            fs::rename(dest.join(tmp), dest.join(name)).unwrap();
        }
        fs::write(dest.join("f00000011.tpmc"), b"made under its name").unwrap();
        fs::write(dest.join(".f00000013.tpmc.tmp"), b"a temporary").unwrap();
        let mut got = Vec::new();
        while let Ok((i, _)) = rx.recv_timeout(Duration::from_secs(5)) {
            got.push(i);
            if got.len() == 3 {
                break;
            }
        }
        assert_eq!(got, [7, 9, 11]);
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        let t = Instant::now();
        drop(observer);
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "the observer ends when dropped"
        );
    }

    #[test]
    fn percentile_picks() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentiles(v), [50.5, 50.0, 95.0, 99.0]);
    }
}
