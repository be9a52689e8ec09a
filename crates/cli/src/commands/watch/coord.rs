//! Start-up checks and the coordinator loop: events in, jobs out, outcomes
//! back; signals, stats, rotation, shutdown.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use crossbeam_channel::{bounded, never, select, unbounded, Receiver, Sender, TrySendError};
use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind, RemoveKind, RenameMode};
use notify::{Event, EventKind, RecursiveMode, Watcher};
use tpmcrypt_cipher::{Params, Recipient};
use tracing::{debug, error, info, warn};

use super::fsio::{self, Kind};
use super::journal::Journal;
use super::stats::{self, Counters, Stats};
use super::units::human_duration;
use super::worker::{self, Ctx, Job, Outcome, Session};
use super::{log, scan, show, WatchArgs};
use crate::args::value::BitsArg;
use crate::options;
use crate::ui::exit::usage;

/// Files tracked at once (waiting, queued or in flight). Beyond this the
/// coordinator stops reading events (inotify then overflows, which forces a
/// rescan later) instead of growing memory.
const MAX_ENTRIES: usize = 200_000;
/// Capacity of the event channel from the inotify thread.
const EVENT_QUEUE: usize = 8192;
/// Longest wait between retries of a failing file.
const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// Longest wait between re-checks of a file still open for writing.
const MAX_BUSY_WAIT: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    /// Waiting for `due` (settle, backoff).
    Waiting,
    /// In the ready queue or the work channel.
    Ready,
    /// A worker has it.
    InFlight,
}

struct Entry {
    state: State,
    due: Instant,
    /// The last close-write (or move-in) event: latency is measured from it.
    event_at: Option<Instant>,
    /// Something happened to it while in flight: look again afterwards.
    dirty: bool,
    /// Consecutive failures (backoff).
    failures: u32,
    /// Consecutive "still open for writing" answers.
    busy: u32,
}

enum Ctl {
    Stop(i32),
    Hup,
}

struct Coordinator {
    src: PathBuf,
    ctx: Arc<Ctx>,
    settle: Duration,
    entries: HashMap<PathBuf, Entry>,
    timers: BinaryHeap<Reverse<(Instant, PathBuf)>>,
    ready: VecDeque<PathBuf>,
    work_tx: Option<Sender<Job>>,
    in_flight: usize,
    journal: Arc<Mutex<Journal>>,
    journal_failed: bool,
    stats: Arc<Mutex<Stats>>,
    rescan: bool,
}

/// What the loop needs besides the coordinator.
struct LoopIo<'a> {
    args: &'a WatchArgs,
    ctl_rx: &'a Receiver<Ctl>,
    ev_rx: &'a Receiver<(notify::Result<Event>, Instant)>,
    done_rx: &'a Receiver<(PathBuf, Outcome)>,
    sink: &'a log::Sink,
    recipients: &'a [Box<dyn Recipient>],
    params: Params,
    started: Instant,
    roots: &'a Roots,
}

/// Runs the daemon until SIGTERM/SIGINT.
pub fn run(args: &WatchArgs, ui: &crate::ui::Ui) -> anyhow::Result<i32> {
    let (src_arg, dest_arg) = (&args.src, &args.out);
    if args.recipients.is_empty() && args.keys.is_empty() {
        return Err(usage("watch needs --key NAME or --recipient RECIPIENT"));
    }
    let workers = options::workers(args.workers);
    if workers == 0 || workers > 1024 {
        return Err(usage("--workers must be between 1 and 1024"));
    }
    let metrics_addr = args
        .metrics
        .as_deref()
        .map(stats::metrics_addr)
        .transpose()?;
    let recipients = options::recipients(
        ui,
        &options::RecipientFlags {
            recipients: &args.recipients,
            keys: &args.keys,
            plaintext_from_stdin: false,
        },
    )?;
    let params = options::params(args.mode, BitsArg::B256, None)?;

    // SRC, DEST, state: canonical, DEST and state not inside SRC.
    let src = fs::canonicalize(src_arg).with_context(|| src_arg.display().to_string())?;
    if !fs::metadata(&src)?.is_dir() {
        return Err(usage(format!(
            "{}: SRC is not a directory",
            src_arg.display()
        )));
    }
    if let Some(other) = watched_dest_around(&src) {
        return Err(usage(format!(
            "SRC {} is inside {}, the DEST of a tpmcrypt watch (it holds {}): its ciphertext \
             would be encrypted again{}",
            show(&src),
            show(&other),
            STATE_DIR,
            if args.delete_plaintext {
                " and removed"
            } else {
                ""
            }
        )));
    }
    let dest_canon = canonical_to_be(dest_arg)?;
    if dest_canon.starts_with(&src) {
        return Err(usage(format!(
            "DEST {} is inside SRC {}: ciphertext would be encrypted again",
            dest_canon.display(),
            src.display()
        )));
    }
    let state_arg = args
        .state_dir
        .clone()
        .unwrap_or_else(|| dest_canon.join(STATE_DIR));
    let state_canon = canonical_to_be(&state_arg)?;
    if state_canon.starts_with(&src) {
        return Err(usage(format!(
            "--state-dir {} is inside SRC {}",
            state_canon.display(),
            src.display()
        )));
    }
    // Files the daemon itself writes: inside SRC each write would be
    // encrypted again (a new version every interval, or every log line).
    for (flag, file) in [("--stats-json", &args.stats_json), ("--log", &args.log)] {
        if let Some(file) = file {
            let canon = canonical_to_be(file)?;
            if canon.starts_with(&src) {
                return Err(usage(format!(
                    "{flag} {} is inside SRC {}: it would be encrypted again every time it is written",
                    canon.display(),
                    src.display()
                )));
            }
        }
    }
    let dest_created = fs::symlink_metadata(&dest_canon).is_err();
    fs::create_dir_all(&dest_canon).map_err(|e| not_writable(&dest_canon, "DEST", e))?;
    let dest = fs::canonicalize(&dest_canon)?;
    probe_writable(&dest).map_err(|e| not_writable(&dest, "DEST", e))?;
    fs::create_dir_all(&state_canon)
        .map_err(|e| not_writable(&state_canon, "the state directory", e))?;
    let state = fs::canonicalize(&state_canon)?;
    let dest_lock = lock_dest(&dest)?;
    let lock = lock_state(&state)?;
    let roots = Roots::new(&src, &dest, &state, &lock)?;

    let sink = log::init(args.log.as_deref(), ui.verbose)?;
    fsio::ignore_sigio();
    let started = Instant::now();
    info!(
        "watching {} → {} ({} workers, settle {}, mode {}{})",
        show(&src),
        show(&dest),
        workers,
        human_duration(args.settle),
        params.mode.name(),
        if args.delete_plaintext {
            ", deleting verified plaintext"
        } else {
            ""
        }
    );

    if dest_created {
        info!("created DEST {} (it did not exist)", show(&dest));
    }
    let cleaned = scan::clean_partials(&dest, &src);
    if cleaned > 0 {
        info!("removed {cleaned} temporary file(s) left by an interrupted run");
    }
    // With --delete-plaintext the records are kept, but only sources kept
    // for their other hard links are skipped on them (only this run's
    // session can verify a ciphertext before a deletion).
    let journal =
        Arc::new(Mutex::new(Journal::load(&state).with_context(|| {
            format!("reading the journal in {}", show(&state))
        })?));

    let session = Session::new(&recipients, params)?;
    info!("session {}", session.id);
    let stats = Arc::new(Mutex::new(Stats {
        counters: Counters {
            sessions: 1,
            ..Counters::default()
        },
        ..Stats::default()
    }));

    // Signals first, so that a SIGTERM during the scan is not lost.
    let (ctl_tx, ctl_rx) = unbounded::<Ctl>();
    spawn_signals(ctl_tx)?;

    if let Some(addr) = metrics_addr {
        let listener =
            std::net::TcpListener::bind(addr).with_context(|| format!("--metrics {addr}"))?;
        let stats = stats.clone();
        std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || stats::serve_metrics(listener, stats, started))?;
        info!("metrics on http://{addr}/metrics");
    }

    let ctx = Arc::new(Ctx {
        src_root: File::open(&src).with_context(|| src.display().to_string())?,
        dest: dest.clone(),
        dest_id: roots.dest.1,
        journal: journal.clone(),
        settle: args.settle,
        delete: args.delete_plaintext,
        session: Mutex::new(Arc::new(session)),
        lease_noted: AtomicBool::new(false),
        no_lease_warned: Mutex::new(HashSet::new()),
    });

    let (work_tx, work_rx) = bounded::<Job>(workers * 2);
    let (done_tx, done_rx) = unbounded::<(PathBuf, Outcome)>();
    let mut handles = Vec::new();
    for i in 0..workers {
        let ctx = ctx.clone();
        let rx = work_rx.clone();
        let tx = done_tx.clone();
        handles.push(
            std::thread::Builder::new()
                .name(format!("worker-{i}"))
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        let outcome = worker::process(&ctx, &job);
                        if tx.send((job.rel, outcome)).is_err() {
                            break;
                        }
                    }
                })?,
        );
    }
    drop(done_tx);

    // Watch before scanning: nothing that arrives during the scan is missed
    // (the scan and the events may both see a file; it is done once).
    let (ev_tx, ev_rx) = bounded::<(notify::Result<Event>, Instant)>(EVENT_QUEUE);
    let mut watcher = notify::RecommendedWatcher::new(
        move |res: notify::Result<Event>| {
            let _ = ev_tx.send((res, Instant::now()));
        },
        notify::Config::default().with_follow_symlinks(false),
    )
    .context("starting inotify")?;
    watcher
        .watch(&src, RecursiveMode::Recursive)
        .with_context(|| format!("watching {}", src.display()))?;

    let mut c = Coordinator {
        src: src.clone(),
        ctx: ctx.clone(),
        settle: args.settle,
        entries: HashMap::new(),
        timers: BinaryHeap::new(),
        ready: VecDeque::new(),
        work_tx: Some(work_tx),
        in_flight: 0,
        journal,
        journal_failed: false,
        stats: stats.clone(),
        rescan: false,
    };
    let (queued, unchanged) = c.startup_scan();
    c.journal()
        .compact()
        .with_context(|| format!("writing the journal in {}", show(&state)))?;
    info!("start-up scan: {queued} file(s) to encrypt, {unchanged} already encrypted");
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);

    let end = c.run_loop(&LoopIo {
        args,
        ctl_rx: &ctl_rx,
        ev_rx: &ev_rx,
        done_rx: &done_rx,
        sink: &sink,
        recipients: &recipients,
        params,
        started,
        roots: &roots,
    });

    // Shutdown: no new files; finish those in flight.
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    drop(ev_rx);
    drop(watcher);
    let mut abandoned = 0;
    while work_rx.try_recv().is_ok() {
        abandoned += 1;
    }
    c.in_flight -= abandoned.min(c.in_flight);
    c.work_tx = None;
    drop(work_rx);
    if c.in_flight > 0 {
        info!("stopping: finishing {} file(s) in flight", c.in_flight);
    } else {
        info!("stopping: nothing in flight");
    }
    while c.in_flight > 0 {
        match done_rx.recv() {
            Ok((rel, outcome)) => c.on_outcome(rel, outcome),
            Err(_) => break,
        }
    }
    for h in handles {
        let _ = h.join();
    }
    let synced = c.journal().sync();
    if let Err(e) = synced {
        warn!("journal: {e}");
    }
    c.update_gauges();
    let s = stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if let Some(path) = &args.stats_json {
        if let Err(e) = stats::write_json(path, &s.snapshot(started)) {
            warn!("--stats-json {}: {e:#}", path.display());
        }
    }
    info!("stopped: {}", s.line());
    drop(lock);
    drop(dest_lock);
    match end {
        End::Signal => Ok(crate::ui::exit::OK),
        End::Fatal(msg) => Err(anyhow::anyhow!(msg)),
    }
}

/// Why the loop ended.
enum End {
    /// SIGTERM or SIGINT: exit 0.
    Signal,
    /// SRC, DEST or the lock is no longer what the daemon started with: an
    /// error, exit 1 (systemd's `Restart=on-failure` starts it again).
    Fatal(String),
}

/// How often the loop checks that SRC, DEST and the lock are still there.
const ROOTS_EVERY: Duration = Duration::from_millis(250);

/// SRC, DEST, the state directory and its lock file as they were at
/// start, by device and inode: a directory removed (and perhaps
/// recreated), moved away or mounted over is no longer the one watched or
/// locked.
struct Roots {
    src: (PathBuf, (u64, u64)),
    dest: (PathBuf, (u64, u64)),
    state: (PathBuf, (u64, u64)),
    lock: (PathBuf, (u64, u64)),
}

fn dev_ino(m: &fs::Metadata) -> (u64, u64) {
    (m.dev(), m.ino())
}

impl Roots {
    fn new(src: &Path, dest: &Path, state: &Path, lock: &File) -> anyhow::Result<Roots> {
        let id = |p: &Path| -> anyhow::Result<(PathBuf, (u64, u64))> {
            let m = fs::symlink_metadata(p).with_context(|| show(p))?;
            Ok((p.to_path_buf(), dev_ino(&m)))
        };
        Ok(Roots {
            src: id(src)?,
            dest: id(dest)?,
            state: id(state)?,
            lock: (state.join("lock"), dev_ino(&lock.metadata()?)),
        })
    }

    /// An error message if any of them changed.
    fn check(&self) -> Result<(), String> {
        let same = |(p, id): &(PathBuf, (u64, u64))| {
            fs::symlink_metadata(p).is_ok_and(|m| dev_ino(&m) == *id)
        };
        if !same(&self.src) {
            return Err(format!(
                "{}: SRC was removed, moved or replaced: stopping (a restart watches the \
                 directory that has its name now)",
                show(&self.src.0)
            ));
        }
        if !same(&self.dest) {
            return Err(format!(
                "{}: DEST was removed, moved or replaced: stopping (it is not recreated: its \
                 lock and journal went with it)",
                show(&self.dest.0)
            ));
        }
        if !same(&self.state) || !same(&self.lock) {
            return Err(format!(
                "{}: the state directory's lock was removed or replaced: stopping (another \
                 daemon could take this DEST)",
                show(&self.lock.0)
            ));
        }
        Ok(())
    }
}

/// The default state directory's name, inside DEST.
const STATE_DIR: &str = ".tpmcrypt-watch";

/// The directory, `src` or one of its ancestors, that is (or was) the DEST
/// of a tpmcrypt watch: it holds a state directory with a lock file.
fn watched_dest_around(src: &Path) -> Option<PathBuf> {
    src.ancestors()
        .find(|dir| {
            fs::symlink_metadata(dir.join(STATE_DIR).join("lock")).is_ok_and(|m| m.is_file())
        })
        .map(Path::to_path_buf)
}

/// The canonical form `path` will have once created: its deepest existing
/// ancestor canonicalised, plus the rest.
fn canonical_to_be(path: &Path) -> anyhow::Result<PathBuf> {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()?.join(path)
    };
    let mut existing = abs.as_path();
    let mut rest = Vec::new();
    loop {
        match fs::canonicalize(existing) {
            Ok(mut out) => {
                for part in rest.iter().rev() {
                    match part {
                        std::path::Component::ParentDir => {
                            out.pop();
                        }
                        std::path::Component::Normal(n) => out.push(n),
                        _ => {}
                    }
                }
                return Ok(out);
            }
            Err(_) => match existing.components().next_back() {
                Some(last) if existing.parent().is_some() => {
                    rest.push(last);
                    existing = existing.parent().unwrap_or(Path::new("/"));
                }
                _ => return Err(usage(format!("{}: not a usable path", path.display()))),
            },
        }
    }
}

fn not_writable(path: &Path, what: &str, e: io::Error) -> anyhow::Error {
    anyhow::anyhow!("{}: {what} is not writable: {e}", path.display())
}

fn probe_writable(dir: &Path) -> io::Result<()> {
    let f = crate::atomic::AtomicFile::create(&dir.join(".tpmcrypt-watch-probe"), 0o600, true)?;
    drop(f);
    Ok(())
}

/// Takes an exclusive `flock` on `f` without waiting; false if another
/// process holds one.
fn try_lock(f: &File) -> bool {
    // SAFETY: flock on a valid fd.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// Holds an exclusive lock on DEST itself: one daemon per DEST, whatever
/// their state directories.
fn lock_dest(dest: &Path) -> anyhow::Result<File> {
    let f = File::open(dest).with_context(|| show(dest))?;
    if !try_lock(&f) {
        return Err(anyhow::anyhow!(
            "{}: another tpmcrypt watch is using this DEST",
            show(dest)
        ));
    }
    Ok(f)
}

/// Holds an exclusive lock on the state directory: one daemon per state
/// directory.
fn lock_state(state: &Path) -> anyhow::Result<File> {
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(state.join("lock"))
        .map_err(|e| not_writable(state, "the state directory", e))?;
    if !try_lock(&f) {
        return Err(anyhow::anyhow!(
            "{}: another tpmcrypt watch is using this state directory",
            state.display()
        ));
    }
    Ok(f)
}

fn spawn_signals(tx: Sender<Ctl>) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                let msg = match sig {
                    SIGHUP => Ctl::Hup,
                    other => Ctl::Stop(other),
                };
                if tx.send(msg).is_err() {
                    break;
                }
            }
        })?;
    Ok(())
}

fn backoff(base: Duration, n: u32, max: Duration) -> Duration {
    base.saturating_mul(1u32 << n.min(20)).min(max)
}

impl Coordinator {
    fn run_loop(&mut self, io: &LoopIo<'_>) -> End {
        let interval = io.args.stats_interval.max(Duration::from_millis(100));
        let rotate = io.args.rotate.map(|d| d.max(Duration::from_secs(1)));
        let mut next_stats = Instant::now() + interval;
        let mut next_rotate = rotate.map(|d| Instant::now() + d);
        let mut watchdog_usec = 0u64;
        let watchdog = sd_notify::watchdog_enabled(false, &mut watchdog_usec);
        let watchdog_every = Duration::from_micros(watchdog_usec / 2);
        let mut next_watchdog = Instant::now();
        let mut next_roots = Instant::now();
        let mut last_logged = (u64::MAX, u64::MAX, u64::MAX);
        let never_ev = never();
        loop {
            self.fire_timers();
            self.dispatch();
            if self.rescan && self.entries.len() < MAX_ENTRIES / 2 {
                self.rescan = false;
                info!("rescanning {}", show(&self.src));
                self.scan_dir(Path::new(""), false, None);
                self.dispatch();
            }
            let flushed = self.journal().flush();
            if let Err(e) = flushed {
                self.journal_error(e);
            }
            let now = Instant::now();
            if now >= next_roots {
                next_roots = now + ROOTS_EVERY;
                if let Err(msg) = io.roots.check() {
                    error!("{msg}");
                    return End::Fatal(msg);
                }
            }
            if now >= next_stats {
                next_stats = now + interval;
                self.update_gauges();
                let s = self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let key = (
                    s.counters.files,
                    s.counters.failures,
                    s.counters.settling + s.counters.queue_depth + s.counters.in_flight,
                );
                if key != last_logged {
                    info!("stats: {}", s.line());
                    last_logged = key;
                }
                if let Some(path) = &io.args.stats_json {
                    if let Err(e) = stats::write_json(path, &s.snapshot(io.started)) {
                        warn!("--stats-json {}: {e:#}", path.display());
                    }
                }
                let synced = self.journal().sync();
                if let Err(e) = synced {
                    self.journal_error(e);
                }
                let status = format!(
                    "{} files encrypted, {} queued",
                    s.counters.files,
                    s.counters.settling + s.counters.queue_depth
                );
                let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Status(&status)]);
            }
            if let (Some(at), Some(every)) = (next_rotate, rotate) {
                if now >= at {
                    next_rotate = Some(now + every);
                    match Session::new(io.recipients, io.params) {
                        Ok(s) => {
                            info!("rotated the session key: session {}", s.id);
                            *self.ctx.session.lock().unwrap_or_else(|e| e.into_inner()) =
                                Arc::new(s);
                            self.stats
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .counters
                                .sessions += 1;
                        }
                        Err(e) => error!("cannot rotate the session key: {e:#}"),
                    }
                }
            }
            if watchdog && now >= next_watchdog {
                let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Watchdog]);
                next_watchdog = now + watchdog_every;
            }

            let mut wake = next_stats.min(next_roots);
            if let Some(Reverse((t, _))) = self.timers.peek() {
                wake = wake.min(*t);
            }
            if let Some(t) = next_rotate {
                wake = wake.min(t);
            }
            if watchdog {
                wake = wake.min(next_watchdog);
            }
            let timeout = wake.saturating_duration_since(Instant::now());
            let events = if self.entries.len() < MAX_ENTRIES {
                io.ev_rx
            } else {
                &never_ev
            };
            select! {
                recv(io.ctl_rx) -> msg => match msg {
                    Ok(Ctl::Stop(sig)) => {
                        info!("signal {sig}: stopping");
                        return End::Signal;
                    }
                    Ok(Ctl::Hup) => match io.sink.reopen() {
                        Ok(true) => info!("SIGHUP: log file reopened"),
                        Ok(false) => info!("SIGHUP received (logging to stderr: nothing to reopen)"),
                        Err(e) => error!("SIGHUP: cannot reopen the log file: {e}"),
                    },
                    Err(_) => return End::Signal,
                },
                recv(io.done_rx) -> msg => {
                    if let Ok((rel, outcome)) = msg {
                        self.on_outcome(rel, outcome);
                        while let Ok((rel, outcome)) = io.done_rx.try_recv() {
                            self.on_outcome(rel, outcome);
                        }
                    }
                }
                recv(events) -> msg => {
                    if let Ok((ev, at)) = msg {
                        self.on_event(ev, at);
                        for _ in 0..4096 {
                            if self.entries.len() >= MAX_ENTRIES {
                                break;
                            }
                            match io.ev_rx.try_recv() {
                                Ok((ev, at)) => self.on_event(ev, at),
                                Err(_) => break,
                            }
                        }
                    }
                }
                default(timeout) => {}
            }
        }
    }

    fn journal(&self) -> std::sync::MutexGuard<'_, Journal> {
        self.journal.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn journal_error(&mut self, e: io::Error) {
        if !self.journal_failed {
            self.journal_failed = true;
            error!("cannot write the journal (a restart may encrypt files again): {e}");
        }
    }

    fn rel<'a>(&self, path: &'a Path) -> Option<&'a Path> {
        let rel = path.strip_prefix(&self.src).ok()?;
        (!rel.as_os_str().is_empty()).then_some(rel)
    }

    /// The start-up scan: everything not already encrypted is due now.
    /// Returns (files queued, files already encrypted).
    fn startup_scan(&mut self) -> (usize, usize) {
        let mut present = HashSet::new();
        let unchanged = self.scan_dir(Path::new(""), true, Some(&mut present));
        // A record whose source is still in SRC, changed or not, says whose
        // ciphertext it is (which its new version may replace); those of
        // sources that are gone are dropped, so that their ciphertexts are
        // never replaced.
        self.journal().retain(|p, _| present.contains(p));
        (self.entries.len(), unchanged.len())
    }

    /// Scans `src/rel`: regular files not already encrypted (per the
    /// journal) and not already tracked become due now. Returns the paths
    /// found already encrypted.
    fn scan_dir(
        &mut self,
        rel: &Path,
        startup: bool,
        mut present: Option<&mut HashSet<PathBuf>>,
    ) -> HashSet<PathBuf> {
        let mut unchanged = HashSet::new();
        let mut found = Vec::new();
        let mut full = false;
        let room = MAX_ENTRIES.saturating_sub(self.entries.len());
        let src = self.src.clone();
        scan::walk(
            &src,
            rel,
            &mut |f| {
                if found.len() >= room {
                    full = true;
                    return false;
                }
                found.push(f);
                true
            },
            &mut |dir, e| warn!("cannot scan {}: {e}", show(&src.join(dir))),
        );
        let now = Instant::now();
        let mut skipped = 0;
        for f in found {
            if f.kind != Kind::File {
                info!(
                    "skipping {}: {} (only regular files are encrypted; symlinks are not followed)",
                    show(&f.rel),
                    f.kind.name()
                );
                skipped += 1;
                continue;
            }
            let f = if startup { self.recover_aside(f) } else { f };
            if let Some(p) = present.as_deref_mut() {
                p.insert(f.rel.clone());
            }
            if self.entries.contains_key(&f.rel) {
                continue;
            }
            // Under --delete-plaintext only sources kept for their other
            // hard links are skipped on a record.
            let skippable = !self.ctx.delete || f.meta.nlink() > 1;
            let rec = self.journal().get(&f.rel);
            if let Some(rec) = rec.filter(|_| skippable) {
                let m = &f.meta;
                let mtime = m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128;
                if rec.same_source(m.size(), mtime, m.ino())
                    && worker::ciphertext_present(&self.ctx.version_path(&f.rel, rec.version), &rec)
                {
                    unchanged.insert(f.rel);
                    continue;
                }
            }
            self.schedule(f.rel, now, None);
        }
        {
            let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
            s.counters.skipped += skipped;
            if startup {
                s.counters.unchanged += unchanged.len() as u64;
            }
        }
        if full {
            warn!("too many files pending ({MAX_ENTRIES}); the rest will be picked up by a rescan");
            self.rescan = true;
        }
        unchanged
    }

    /// A source moved aside for removal by a daemon that is gone (killed
    /// between the move and the unlink) is renamed back to its name, never
    /// replacing anything; if that cannot be done it stays where it is and
    /// is encrypted under that name like any file. Never removed.
    fn recover_aside(&self, f: scan::Found) -> scan::Found {
        let Some((pid, original)) = f.rel.file_name().and_then(fsio::parse_aside) else {
            return f;
        };
        // At start nothing is moved aside by this process yet: its own PID
        // there is a previous one's, reused.
        if pid != std::process::id() as i32 && crate::atomic::pid_alive(pid) {
            return f;
        }
        let Some(original) = original else {
            warn!(
                "{}: left by an interrupted removal (its name is unknown): encrypted as it is",
                show(&f.rel)
            );
            return f;
        };
        let parent = f.rel.parent().unwrap_or(Path::new(""));
        let mut back = parent.join(original);
        let renamed = fsio::open_dir_beneath(&self.ctx.src_root, parent).and_then(|dir| {
            let aside = f.rel.file_name().unwrap_or_default();
            match fsio::rename_noreplace(&dir, aside, original) {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    // Its name was taken meanwhile: kept under another.
                    let kept = fsio::aside_name(original, fsio::RESTORED_MARKER);
                    fsio::rename_noreplace(&dir, aside, &kept)?;
                    back = parent.join(kept);
                }
                r => r?,
            }
            fsio::fsync(&dir)
        });
        match renamed {
            Ok(()) => {
                info!(
                    "{}: left by an interrupted removal: renamed back to {}",
                    show(&f.rel),
                    show(&back)
                );
                scan::Found { rel: back, ..f }
            }
            Err(e) => {
                warn!(
                    "{}: left by an interrupted removal, cannot be renamed back to {}: {e}; \
                     encrypted as it is",
                    show(&f.rel),
                    show(&back)
                );
                f
            }
        }
    }

    /// Makes `rel` due at `due` (de-duplicated by path). A source this
    /// process has moved aside to remove it is not a new file.
    fn schedule(&mut self, rel: PathBuf, due: Instant, event_at: Option<Instant>) {
        if rel
            .file_name()
            .and_then(fsio::parse_aside)
            .is_some_and(|(pid, _)| pid == std::process::id() as i32)
        {
            return;
        }
        match self.entries.get_mut(&rel) {
            None => {
                self.entries.insert(
                    rel.clone(),
                    Entry {
                        state: State::Waiting,
                        due,
                        event_at,
                        dirty: false,
                        failures: 0,
                        busy: 0,
                    },
                );
                self.timers.push(Reverse((due, rel)));
            }
            Some(e) => {
                if event_at.is_some() {
                    e.event_at = event_at;
                }
                match e.state {
                    State::InFlight => {
                        e.dirty = true;
                        e.due = e.due.max(due);
                    }
                    // A later due date is picked up when the entry leaves
                    // the ready queue.
                    State::Ready => e.due = due,
                    State::Waiting => {
                        let earlier = due < e.due;
                        e.due = due;
                        if earlier {
                            self.timers.push(Reverse((due, rel)));
                        }
                    }
                }
            }
        }
    }

    /// Re-arms an entry after an attempt.
    fn reschedule(&mut self, rel: PathBuf, due: Instant) {
        if let Some(e) = self.entries.get_mut(&rel) {
            e.state = State::Waiting;
            e.dirty = false;
            e.due = due;
            self.timers.push(Reverse((due, rel)));
        }
    }

    /// Moves due entries to the ready queue.
    fn fire_timers(&mut self) {
        let now = Instant::now();
        while let Some(Reverse((t, _))) = self.timers.peek() {
            if *t > now {
                break;
            }
            let Some(Reverse((_, rel))) = self.timers.pop() else {
                break;
            };
            let Some(e) = self.entries.get_mut(&rel) else {
                continue;
            };
            if e.state != State::Waiting {
                continue;
            }
            if e.due > now {
                // Postponed since this timer was set.
                let due = e.due;
                self.timers.push(Reverse((due, rel)));
                continue;
            }
            e.state = State::Ready;
            self.ready.push_back(rel);
        }
    }

    /// Hands ready entries to the workers while the work channel has room.
    fn dispatch(&mut self) {
        let Some(tx) = &self.work_tx else { return };
        let now = Instant::now();
        while let Some(rel) = self.ready.pop_front() {
            let Some(e) = self.entries.get_mut(&rel) else {
                continue;
            };
            if e.state != State::Ready {
                continue;
            }
            if e.due > now + Duration::from_millis(1) {
                e.state = State::Waiting;
                let due = e.due;
                self.timers.push(Reverse((due, rel)));
                continue;
            }
            let (prev, fresh) = {
                let j = self.journal.lock().unwrap_or_else(|e| e.into_inner());
                (j.get(&rel), j.is_fresh(&rel))
            };
            let job = Job { prev, fresh, rel };
            match tx.try_send(job) {
                Ok(()) => {
                    e.state = State::InFlight;
                    self.in_flight += 1;
                }
                Err(TrySendError::Full(job)) | Err(TrySendError::Disconnected(job)) => {
                    self.ready.push_front(job.rel);
                    break;
                }
            }
        }
    }

    fn on_event(&mut self, ev: notify::Result<Event>, at: Instant) {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                if matches!(e.kind, notify::ErrorKind::MaxFilesWatch) {
                    error!(
                        "inotify watch limit reached (raise fs.inotify.max_user_watches): \
                         new directories are not watched"
                    );
                } else {
                    warn!("inotify: {e}");
                }
                self.rescan = true;
                return;
            }
        };
        if ev.need_rescan() {
            warn!("inotify queue overflowed: rescanning");
            self.rescan = true;
            return;
        }
        let settle_at = at + self.settle;
        for path in &ev.paths {
            // SRC itself removed or moved away: the periodic check of the
            // roots stops the daemon.
            let Some(rel) = self.rel(path).map(Path::to_path_buf) else {
                continue;
            };
            match ev.kind {
                EventKind::Access(AccessKind::Close(AccessMode::Write)) => {
                    self.schedule(rel, settle_at, Some(at));
                }
                EventKind::Create(CreateKind::Folder) => {
                    // Files may have landed before the watch was added.
                    self.scan_dir(&rel, false, None);
                }
                EventKind::Create(_) => self.schedule(rel, settle_at, None),
                EventKind::Modify(ModifyKind::Name(RenameMode::To)) => {
                    match fs::symlink_metadata(path) {
                        Ok(m) if m.is_dir() => {
                            self.scan_dir(&rel, false, None);
                        }
                        Ok(_) => self.schedule(rel, settle_at, Some(at)),
                        Err(_) => {}
                    }
                }
                EventKind::Modify(ModifyKind::Name(RenameMode::From))
                | EventKind::Remove(RemoveKind::File)
                | EventKind::Remove(RemoveKind::Any)
                | EventKind::Remove(RemoveKind::Other) => self.forget(&rel, false),
                EventKind::Remove(RemoveKind::Folder) => self.forget(&rel, true),
                EventKind::Modify(ModifyKind::Data(_)) => {
                    if let Some(e) = self.entries.get_mut(&rel) {
                        match e.state {
                            State::InFlight => e.dirty = true,
                            _ => e.due = e.due.max(settle_at),
                        }
                    }
                }
                _ => {}
            }
        }
    }

    /// A path went away (removed or moved out of SRC).
    fn forget(&mut self, rel: &Path, tree: bool) {
        let gone: Vec<PathBuf> = if tree {
            self.entries
                .keys()
                .filter(|p| p.starts_with(rel))
                .cloned()
                .collect()
        } else {
            vec![rel.to_path_buf()]
        };
        for p in gone {
            // In flight: the worker will find it gone (or, if a new file
            // took the name, its own events bring it back). Its record is
            // kept: the worker itself moves a source aside before removing
            // it, and puts it back if it changed (or a crash leaves it
            // aside, renamed back at the next start), and that source's
            // record says which ciphertext is its own. The outcome settles
            // the record (Gone removes it).
            if self
                .entries
                .get(&p)
                .is_some_and(|e| e.state == State::InFlight)
            {
                continue;
            }
            self.entries.remove(&p);
            let removed = self.journal().remove(&p);
            if let Err(e) = removed {
                self.journal_error(e);
            }
        }
        if tree {
            self.journal().retain(|p, _| !p.starts_with(rel));
        }
    }

    fn on_outcome(&mut self, rel: PathBuf, outcome: Outcome) {
        self.in_flight = self.in_flight.saturating_sub(1);
        let now = Instant::now();
        let Some(e) = self.entries.get_mut(&rel) else {
            return;
        };
        let dirty = e.dirty;
        let event_at = e.event_at;
        let mut done = true;
        let mut retry_at = None;
        match outcome {
            Outcome::Encrypted {
                rec,
                deleted,
                no_lease,
                done_at,
                service,
            } => {
                e.failures = 0;
                e.busy = 0;
                e.event_at = None;
                {
                    let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
                    s.counters.files += 1;
                    s.counters.bytes += rec.size;
                    s.service.record(service);
                    if let Some(t) = event_at {
                        s.latency.record(done_at.saturating_duration_since(t));
                    }
                    if deleted {
                        s.counters.deleted += 1;
                    }
                    if no_lease {
                        s.counters.kept_no_lease += 1;
                    }
                }
                let r = if deleted {
                    debug!("encrypted and removed {}", show(&rel));
                    self.journal().remove(&rel)
                } else {
                    debug!("encrypted {}", show(&rel));
                    self.journal().put(&rel, rec)
                };
                if let Err(err) = r {
                    self.journal_error(err);
                }
            }
            Outcome::Unchanged => {
                self.stats
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .counters
                    .unchanged += 1;
            }
            Outcome::NotRegular(kind) => {
                info!(
                    "skipping {}: {} (only regular files are encrypted; symlinks are not followed)",
                    show(&rel),
                    kind.name()
                );
                self.stats
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .counters
                    .skipped += 1;
            }
            Outcome::Gone => {
                debug!("{} is gone", show(&rel));
                // Its record was kept while it was in flight (see forget).
                let removed = self.journal().remove(&rel);
                if let Err(err) = removed {
                    self.journal_error(err);
                }
            }
            Outcome::Busy => {
                e.busy += 1;
                let wait = backoff(
                    self.settle.max(Duration::from_millis(100)),
                    e.busy - 1,
                    MAX_BUSY_WAIT,
                );
                debug!(
                    "{} is still open for writing; looking again in {}",
                    show(&rel),
                    human_duration(wait)
                );
                done = false;
                retry_at = Some(now + wait);
            }
            Outcome::NotSettled(d) => {
                done = false;
                retry_at = Some(now + d);
            }
            Outcome::Changed => {
                info!(
                    "{} changed while being encrypted: doing it again",
                    show(&rel)
                );
                self.stats
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .counters
                    .changed += 1;
                done = false;
                retry_at = Some(now + self.settle);
            }
            Outcome::Failed(err) => {
                e.failures += 1;
                let wait = backoff(Duration::from_secs(1), e.failures - 1, MAX_BACKOFF);
                warn!(
                    "{}: {} (attempt {}; retrying in {})",
                    show(&rel),
                    crate::ui::one_line(&err),
                    e.failures,
                    human_duration(wait)
                );
                self.stats
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .counters
                    .failures += 1;
                done = false;
                retry_at = Some(now + wait);
            }
        }
        if dirty {
            // Events arrived meanwhile: look again once settled.
            let due = self.entries.get(&rel).map_or(now, |e| e.due).max(now);
            let due = retry_at.map_or(due, |r| r.min(due).max(now));
            self.reschedule(rel, due);
        } else if done {
            self.entries.remove(&rel);
        } else if let Some(at) = retry_at {
            self.reschedule(rel, at);
        }
    }

    fn update_gauges(&self) {
        let mut settling = 0;
        let mut ready = 0;
        for e in self.entries.values() {
            match e.state {
                State::Waiting => settling += 1,
                State::Ready => ready += 1,
                State::InFlight => {}
            }
        }
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.counters.settling = settling;
        s.counters.queue_depth = ready;
        s.counters.in_flight = self.in_flight as u64;
    }
}
