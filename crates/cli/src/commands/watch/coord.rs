//! Start-up checks and the coordinator loop: events in, jobs out, outcomes
//! back; signals, stats, rotation, shutdown.

use std::collections::HashSet;
use std::collections::VecDeque;
use std::fs::{self, File};
use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use crossbeam_channel::{bounded, never, select, unbounded, Receiver, Sender};
use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind, RemoveKind, RenameMode};
use notify::{Event, EventKind, RecursiveMode, Watcher};
use tpmcrypt_cipher::{Mode, Params, Recipient};
use tracing::{debug, error, info, warn};

use super::fsio::{self, Kind};
use super::journal::{Journal, Record};
use super::schedule::{Attempt, Schedule};
use super::setup::{self, Roots};
use super::stats::{self, Counters, Stats};
use super::units::human_duration;
use super::worker::{self, Ctx, Job, Outcome, Session, Step};
use super::{commit, log, scan, show, WatchArgs};
use crate::args::value::BitsArg;
use crate::options;
use crate::ui::exit::usage;

/// Files tracked at once (waiting, queued or in flight). Beyond this the
/// coordinator stops reading events (inotify then overflows, which forces a
/// rescan later) instead of growing memory.
const MAX_ENTRIES: usize = 200_000;
/// Capacity of the event channel from the inotify thread.
const EVENT_QUEUE: usize = 8192;
enum Ctl {
    Stop(i32),
    Hup,
}

struct Coordinator {
    src: PathBuf,
    ctx: Arc<Ctx>,
    settle: Duration,
    /// Settle timers, ready queue, retries (no I/O, no clock).
    sched: Schedule,
    work: Option<Arc<JobQueue>>,
    journal: Arc<Mutex<Journal>>,
    journal_failed: bool,
    stats: Arc<Mutex<Stats>>,
    rescan: bool,
    /// Without --delete-plaintext: paths whose source went (removed, or
    /// moved out of SRC) while their job was in flight; their outcome
    /// writes no record.
    gone_in_flight: HashSet<PathBuf>,
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

/// The flags resolved into what the daemon runs with. (Resolved here until
/// the CLI's shared option layer provides it.)
struct Plan {
    recipients: Vec<Box<dyn Recipient>>,
    params: Params,
    mode: Mode,
    workers: usize,
    metrics: Option<SocketAddr>,
}

/// Resolves and checks the flags; a usage error (exit 2) when they do not
/// make sense.
fn resolve(args: &WatchArgs, ui: &crate::ui::Ui) -> anyhow::Result<Plan> {
    if args.recipients.is_empty() && args.keys.is_empty() {
        return Err(usage("watch needs --key NAME or --recipient RECIPIENT"));
    }
    let workers = options::workers(args.workers);
    if workers == 0 || workers > 1024 {
        return Err(usage("--workers must be between 1 and 1024"));
    }
    let metrics = args
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
    Ok(Plan {
        recipients,
        params,
        mode: params.mode,
        workers,
        metrics,
    })
}

/// Runs the daemon until SIGTERM/SIGINT.
pub fn run(args: &WatchArgs, ui: &crate::ui::Ui) -> anyhow::Result<i32> {
    let plan = resolve(args, ui)?;
    let dirs = setup::prepare(args)?;
    let sink = log::init(args.log.as_deref(), ui.verbose)?;
    fsio::ignore_sigio();
    let started = Instant::now();
    announce(args, &plan, &dirs);
    // With --delete-plaintext the records are kept, but only sources kept
    // for their other hard links are skipped on them (only this run's
    // session can verify a ciphertext before a deletion).
    let journal = Arc::new(Mutex::new(
        Journal::load(&dirs.state)
            .with_context(|| format!("reading the journal in {}", show(&dirs.state)))?,
    ));

    let session = Session::new(&plan.recipients, plan.params)?;
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
    if let Some(addr) = plan.metrics {
        spawn_metrics(addr, &stats, started)?;
    }

    let ctx = context(args, &dirs, &journal, session)?;
    let pool = Pool::start(&ctx, plan.workers)?;
    let (ev_rx, watcher) = start_watcher(&dirs.src)?;

    let mut c = Coordinator {
        src: dirs.src.clone(),
        ctx,
        settle: args.settle,
        sched: Schedule::new(args.settle),
        work: Some(pool.work.clone()),
        journal,
        journal_failed: false,
        stats: stats.clone(),
        rescan: false,
        gone_in_flight: HashSet::new(),
    };
    c.start(&dirs.state)?;
    let end = c.run_loop(&LoopIo {
        args,
        ctl_rx: &ctl_rx,
        ev_rx: &ev_rx,
        done_rx: &pool.done_rx,
        sink: &sink,
        recipients: &plan.recipients,
        params: plan.params,
        started,
        roots: &dirs.roots,
    });

    // Shutdown: no new files; finish those in flight.
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    drop(ev_rx);
    drop(watcher);
    c.finish(pool);
    c.update_gauges();
    let s = stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if let Some(path) = &args.stats_json {
        if let Err(e) = stats::write_json(path, &s.snapshot(started)) {
            warn!("--stats-json {}: {e:#}", path.display());
        }
    }
    info!("stopped: {}", s.line());
    drop(dirs); // the locks go last
    match end {
        End::Signal => Ok(crate::ui::exit::OK),
        End::Fatal(msg) => Err(anyhow::anyhow!(msg)),
    }
}

/// What the workers and the committer share.
fn context(
    args: &WatchArgs,
    dirs: &setup::Dirs,
    journal: &Arc<Mutex<Journal>>,
    session: Session,
) -> anyhow::Result<Arc<Ctx>> {
    Ok(Arc::new(Ctx {
        src_root: File::open(&dirs.src).with_context(|| dirs.src.display().to_string())?,
        dest: dirs.dest.clone(),
        dest_id: dirs.roots.dest.1,
        journal: journal.clone(),
        settle: args.settle,
        delete: args.delete_plaintext,
        session: Mutex::new(Arc::new(session)),
        lease_noted: AtomicBool::new(false),
        no_lease_warned: Mutex::new(HashSet::new()),
    }))
}

/// The start-up log lines, and the clean-up of temporaries an interrupted
/// run left in DEST.
fn announce(args: &WatchArgs, plan: &Plan, dirs: &setup::Dirs) {
    info!(
        "watching {} → {} ({} workers, settle {}, mode {}{})",
        show(&dirs.src),
        show(&dirs.dest),
        plan.workers,
        human_duration(args.settle),
        plan.mode.name(),
        if args.delete_plaintext {
            ", deleting verified plaintext"
        } else {
            ""
        }
    );
    if dirs.dest_created {
        info!("created DEST {} (it did not exist)", show(&dirs.dest));
    }
    let cleaned = scan::clean_partials(&dirs.dest, &dirs.src);
    if cleaned > 0 {
        info!("removed {cleaned} temporary file(s) left by an interrupted run");
    }
}

/// Serves `--metrics` from a thread of its own.
fn spawn_metrics(
    addr: SocketAddr,
    stats: &Arc<Mutex<Stats>>,
    started: Instant,
) -> anyhow::Result<()> {
    let listener =
        std::net::TcpListener::bind(addr).with_context(|| format!("--metrics {addr}"))?;
    let stats = stats.clone();
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || stats::serve_metrics(listener, stats, started))?;
    info!("metrics on http://{addr}/metrics");
    Ok(())
}

/// The workers and the committer, and their channels.
/// The jobs handed to the workers: bounded, and waited on without
/// spinning. An idle worker sleeps on a condition variable; a channel's
/// receiver first spins and yields the CPU several times, and on two busy
/// CPUs each of those yields was a context switch (about four a file).
pub(crate) struct JobQueue {
    state: Mutex<QueueState>,
    ready: Condvar,
    cap: usize,
}

struct QueueState {
    jobs: VecDeque<Job>,
    closed: bool,
}

impl JobQueue {
    fn new(cap: usize) -> JobQueue {
        JobQueue {
            state: Mutex::new(QueueState {
                jobs: VecDeque::with_capacity(cap),
                closed: false,
            }),
            ready: Condvar::new(),
            cap,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `job`, or gives it back if the queue is full or closed.
    fn try_send(&self, job: Job) -> Result<(), Job> {
        let mut st = self.lock();
        if st.closed || st.jobs.len() >= self.cap {
            return Err(job);
        }
        st.jobs.push_back(job);
        drop(st);
        self.ready.notify_one();
        Ok(())
    }

    /// The next job, waiting for one; None once the queue is closed.
    fn recv(&self) -> Option<Job> {
        let mut st = self.lock();
        loop {
            if st.closed {
                return None;
            }
            if let Some(job) = st.jobs.pop_front() {
                return Some(job);
            }
            st = self.ready.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Closes the queue: the workers take no more jobs. Returns how many
    /// were waiting (dropped).
    fn close(&self) -> usize {
        let mut st = self.lock();
        st.closed = true;
        let n = st.jobs.len();
        st.jobs.clear();
        drop(st);
        self.ready.notify_all();
        n
    }
}

struct Pool {
    work: Arc<JobQueue>,
    done_rx: Receiver<(PathBuf, Outcome)>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

impl Pool {
    /// Starts the committer and `workers` workers.
    fn start(ctx: &Arc<Ctx>, workers: usize) -> anyhow::Result<Pool> {
        let work = Arc::new(JobQueue::new(workers * 2));
        let (done_tx, done_rx) = unbounded::<(PathBuf, Outcome)>();
        // Complete ciphertexts wait for the committer here; a full channel
        // holds the workers back (each pending file holds files open).
        let limits = commit::limits();
        let (commit_tx, commit_rx) = bounded::<Box<worker::Ready>>(limits.files);
        let mut handles = Vec::new();
        {
            let (ctx, tx) = (ctx.clone(), done_tx.clone());
            handles.push(
                std::thread::Builder::new()
                    .name("committer".into())
                    .spawn(move || commit::run(ctx, commit_rx, tx, limits))?,
            );
        }
        for i in 0..workers {
            let ctx = ctx.clone();
            let queue = work.clone();
            let tx = done_tx.clone();
            let commit_tx = commit_tx.clone();
            handles.push(
                std::thread::Builder::new()
                    .name(format!("worker-{i}"))
                    .spawn(move || work_on(&ctx, &queue, &tx, &commit_tx))?,
            );
        }
        Ok(Pool {
            work,
            done_rx,
            handles,
        })
    }
}

/// A worker thread: jobs in, outcomes (or ciphertexts to commit) out.
fn work_on(
    ctx: &Ctx,
    queue: &JobQueue,
    tx: &Sender<(PathBuf, Outcome)>,
    commit_tx: &Sender<Box<worker::Ready>>,
) {
    while let Some(job) = queue.recv() {
        let sent = match worker::process(ctx, &job) {
            Step::Done(outcome) => tx.send((job.rel, outcome)).is_ok(),
            Step::Commit(ready) => commit_tx.send(ready).is_ok(),
        };
        if !sent {
            break;
        }
    }
}

/// The event channel from the inotify thread (with each event's time).
type Events = Receiver<(notify::Result<Event>, Instant)>;

/// Watches `src` (before the start-up scan: nothing that arrives during
/// the scan is missed; the scan and the events may both see a file, it is
/// done once).
fn start_watcher(src: &Path) -> anyhow::Result<(Events, notify::RecommendedWatcher)> {
    let (ev_tx, ev_rx) = bounded::<(notify::Result<Event>, Instant)>(EVENT_QUEUE);
    let mut watcher = notify::RecommendedWatcher::new(
        move |res: notify::Result<Event>| {
            if res.as_ref().is_ok_and(|ev| ignored(&ev.kind)) {
                return;
            }
            let _ = ev_tx.send((res, Instant::now()));
        },
        notify::Config::default().with_follow_symlinks(false),
    )
    .context("starting inotify")?;
    // A directory below SRC renamed or removed while the watches are being
    // set up makes the recursive walk fail; SRC itself is still there, so
    // the walk is tried again (a busy tree settles between two renames).
    // It used to end the daemon at its start.
    let mut tries = 0;
    loop {
        match watcher.watch(src, RecursiveMode::Recursive) {
            Ok(()) => break,
            Err(e) if tries < WATCH_TRIES && vanished_below(src, &e) => {
                tries += 1;
                debug!("a directory in SRC went while it was being watched ({e}); again");
                let _ = watcher.unwatch(src);
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => {
                return Err(anyhow::Error::from(e).context(format!("watching {}", src.display())))
            }
        }
    }
    Ok((ev_rx, watcher))
}

/// How many times the start-up watch of SRC is tried while directories
/// below it come and go.
const WATCH_TRIES: u32 = 200;

/// Whether `e`, from watching `src` recursively, is a path below `src`
/// gone meanwhile (and `src` itself still a directory).
fn vanished_below(src: &Path, e: &notify::Error) -> bool {
    let gone = match &e.kind {
        notify::ErrorKind::PathNotFound | notify::ErrorKind::WatchNotFound => true,
        notify::ErrorKind::Io(io) => {
            matches!(io.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR))
        }
        _ => false,
    };
    gone && std::fs::symlink_metadata(src).is_ok_and(|m| m.is_dir())
}

/// Events [`Coordinator::on_event`] does nothing with, dropped on the
/// inotify thread so that they never wake the coordinator: notify 8 asks the
/// kernel for every open in SRC, and each file brings at least two (its
/// writer's and the worker's own), beside the three events the daemon uses.
fn ignored(kind: &EventKind) -> bool {
    matches!(
        kind,
        EventKind::Access(
            AccessKind::Open(_) | AccessKind::Read | AccessKind::Close(AccessMode::Read)
        )
    )
}

/// Why the loop ended.
enum End {
    /// SIGTERM or SIGINT: exit 0.
    Signal,
    /// SRC, DEST or the lock is no longer what the daemon started with: an
    /// error, exit 1 (systemd's `Restart=on-failure` starts it again).
    Fatal(String),
}

/// The loop's timers besides the files'.
struct Clocks {
    /// --stats-interval (at least 100ms).
    interval: Duration,
    /// --rotate (at least 1s).
    rotate: Option<Duration>,
    next_stats: Instant,
    next_rotate: Option<Instant>,
    /// systemd's watchdog is on: pinged every half its period.
    watchdog: bool,
    watchdog_every: Duration,
    next_watchdog: Instant,
    next_roots: Instant,
    /// What the last stats line showed (files, failures, pending): a line
    /// is logged only when it changes.
    last_logged: (u64, u64, u64),
}

impl Clocks {
    fn new(args: &WatchArgs) -> Clocks {
        let interval = args.stats_interval.max(Duration::from_millis(100));
        let rotate = args.rotate.map(|d| d.max(Duration::from_secs(1)));
        let mut watchdog_usec = 0u64;
        let watchdog = sd_notify::watchdog_enabled(false, &mut watchdog_usec);
        Clocks {
            interval,
            rotate,
            next_stats: Instant::now() + interval,
            next_rotate: rotate.map(|d| Instant::now() + d),
            watchdog,
            watchdog_every: Duration::from_micros(watchdog_usec / 2),
            next_watchdog: Instant::now(),
            next_roots: Instant::now(),
            last_logged: (u64::MAX, u64::MAX, u64::MAX),
        }
    }

    /// When the loop must wake at the latest (`files`: the next file's
    /// timer).
    fn wake(&self, files: Option<Instant>) -> Instant {
        let mut wake = self.next_stats.min(self.next_roots);
        if let Some(t) = files {
            wake = wake.min(t);
        }
        if let Some(t) = self.next_rotate {
            wake = wake.min(t);
        }
        if self.watchdog {
            wake = wake.min(self.next_watchdog);
        }
        wake
    }
}

/// How often the loop checks that SRC, DEST and the lock are still there.
const ROOTS_EVERY: Duration = Duration::from_millis(250);

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

impl Coordinator {
    /// The start-up scan, the journal compacted, readiness told.
    fn start(&mut self, state: &Path) -> anyhow::Result<()> {
        let (queued, unchanged) = self.startup_scan();
        self.journal()
            .compact()
            .with_context(|| format!("writing the journal in {}", show(state)))?;
        info!("start-up scan: {queued} file(s) to encrypt, {unchanged} already encrypted");
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
        Ok(())
    }

    /// Shutdown: jobs not yet taken are dropped, those in flight finished,
    /// the threads joined, the journal synced.
    fn finish(&mut self, pool: Pool) {
        let Pool {
            work,
            done_rx,
            handles,
        } = pool;
        let abandoned = work.close();
        self.sched.abandoned(abandoned);
        self.work = None;
        if self.sched.in_flight() > 0 {
            info!(
                "stopping: finishing {} file(s) in flight",
                self.sched.in_flight()
            );
        } else {
            info!("stopping: nothing in flight");
        }
        while self.sched.in_flight() > 0 {
            match done_rx.recv() {
                Ok((rel, outcome)) => self.on_outcome(rel, outcome),
                Err(_) => break,
            }
        }
        for h in handles {
            let _ = h.join();
        }
        if let Err(e) = self.sync_journal() {
            warn!("journal: {e}");
        }
    }

    /// The loop: timers fired, ready files handed out, housekeeping done,
    /// then a wait for a signal, an outcome, events or the next timer.
    fn run_loop(&mut self, io: &LoopIo<'_>) -> End {
        let mut clocks = Clocks::new(io.args);
        let never_ev = never();
        loop {
            self.sched.tick(Instant::now());
            self.dispatch();
            if self.rescan && self.sched.len() < MAX_ENTRIES / 2 {
                self.rescan = false;
                info!("rescanning {}", show(&self.src));
                self.scan_dir(Path::new(""), false, None);
                self.dispatch();
            }
            let flushed = self.journal().flush();
            if let Err(e) = flushed {
                self.journal_error(e);
            }
            if let Err(end) = self.housekeeping(io, &mut clocks, Instant::now()) {
                return end;
            }
            let wake = clocks.wake(self.sched.next_due());
            let timeout = wake.saturating_duration_since(Instant::now());
            let events = if self.sched.len() < MAX_ENTRIES {
                io.ev_rx
            } else {
                &never_ev
            };
            if let Some(end) = self.wait(io, events, timeout) {
                return end;
            }
        }
    }

    /// What is due at `now` besides files: the roots' check, the stats,
    /// the session key's rotation, systemd's watchdog.
    fn housekeeping(
        &mut self,
        io: &LoopIo<'_>,
        clocks: &mut Clocks,
        now: Instant,
    ) -> Result<(), End> {
        if now >= clocks.next_roots {
            clocks.next_roots = now + ROOTS_EVERY;
            if let Err(msg) = io.roots.check() {
                error!("{msg}");
                return Err(End::Fatal(msg));
            }
        }
        if now >= clocks.next_stats {
            clocks.next_stats = now + clocks.interval;
            self.report_stats(io, &mut clocks.last_logged);
        }
        if let (Some(at), Some(every)) = (clocks.next_rotate, clocks.rotate) {
            if now >= at {
                clocks.next_rotate = Some(now + every);
                self.rotate_session(io);
            }
        }
        if clocks.watchdog && now >= clocks.next_watchdog {
            let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Watchdog]);
            clocks.next_watchdog = now + clocks.watchdog_every;
        }
        Ok(())
    }

    /// Every --stats-interval: the stats line (when something changed),
    /// --stats-json, the journal synced, systemd's status.
    fn report_stats(&mut self, io: &LoopIo<'_>, last_logged: &mut (u64, u64, u64)) {
        self.update_gauges();
        let s = self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let key = (
            s.counters.files,
            s.counters.failures,
            s.counters.settling + s.counters.queue_depth + s.counters.in_flight,
        );
        if key != *last_logged {
            info!("stats: {}", s.line());
            *last_logged = key;
        }
        if let Some(path) = &io.args.stats_json {
            if let Err(e) = stats::write_json(path, &s.snapshot(io.started)) {
                warn!("--stats-json {}: {e:#}", path.display());
            }
        }
        if let Err(e) = self.sync_journal() {
            self.journal_error(e);
        }
        let status = format!(
            "{} files encrypted, {} queued",
            s.counters.files,
            s.counters.settling + s.counters.queue_depth
        );
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Status(&status)]);
    }

    /// --rotate: a new session key for the files taken from now on.
    fn rotate_session(&self, io: &LoopIo<'_>) {
        match Session::new(io.recipients, io.params) {
            Ok(s) => {
                info!("rotated the session key: session {}", s.id);
                *self.ctx.session.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(s);
                self.count(|c| c.sessions += 1);
            }
            Err(e) => error!("cannot rotate the session key: {e:#}"),
        }
    }

    /// Waits up to `timeout` for a signal, outcomes or events, and handles
    /// them. Some when the loop is to end.
    fn wait(&mut self, io: &LoopIo<'_>, events: &Events, timeout: Duration) -> Option<End> {
        select! {
            recv(io.ctl_rx) -> msg => match msg {
                Ok(Ctl::Stop(sig)) => {
                    info!("signal {sig}: stopping");
                    return Some(End::Signal);
                }
                Ok(Ctl::Hup) => match io.sink.reopen() {
                    Ok(true) => info!("SIGHUP: log file reopened"),
                    Ok(false) => info!("SIGHUP received (logging to stderr: nothing to reopen)"),
                    Err(e) => error!("SIGHUP: cannot reopen the log file: {e}"),
                },
                Err(_) => return Some(End::Signal),
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
                        if self.sched.len() >= MAX_ENTRIES {
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
        None
    }

    /// Makes what the journal holds durable, without holding its lock
    /// while the disk works.
    fn sync_journal(&self) -> io::Result<()> {
        let file = self.journal().flush_for_sync()?;
        file.map_or(Ok(()), |f| f.sync_data())
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
        let ctx = &self.ctx;
        self.journal().settle(|rel, rec| {
            worker::ciphertext_present(&ctx.version_path(rel, rec.version), rec)
        });
        let mut present = HashSet::new();
        let unchanged = self.scan_dir(Path::new(""), true, Some(&mut present));
        // A record whose source is still in SRC, changed or not, says whose
        // ciphertext it is (which its new version may replace); those of
        // sources that are gone are dropped, so that their ciphertexts are
        // never replaced.
        self.journal().retain(|p, _| present.contains(p));
        (self.sched.len(), unchanged.len())
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
        let room = MAX_ENTRIES.saturating_sub(self.sched.len());
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
            let f = match startup {
                true => match self.recover_aside(f) {
                    Some(f) => f,
                    None => continue,
                },
                false => f,
            };
            if let Some(p) = present.as_deref_mut() {
                p.insert(f.rel.clone());
            }
            if self.sched.contains(&f.rel) {
                continue;
            }
            // Under --delete-plaintext only sources kept for their other
            // hard links are skipped on a record.
            let skippable = !self.ctx.delete || f.meta.nlink() > 1;
            let m = &f.meta;
            let mtime = m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128;
            let ctx = &self.ctx;
            let is_it = |rec: &Record| {
                rec.same_source(m.size(), mtime, m.ino())
                    && worker::ciphertext_present(&ctx.version_path(&f.rel, rec.version), rec)
            };
            let rec = self.journal().get(&f.rel);
            let known = match rec {
                Some(rec) => skippable && is_it(&rec),
                // Forgotten with a directory that left SRC and came back.
                None if skippable => {
                    let recognised = self.journal().recognise(&f.rel, is_it);
                    recognised
                        .unwrap_or_else(|e| {
                            warn!("{}: cannot write the journal: {e}", show(&f.rel));
                            None
                        })
                        .is_some()
                }
                None => false,
            };
            if known {
                unchanged.insert(f.rel);
                continue;
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
    /// between the move and the unlink). Under --delete-plaintext, when the
    /// journal records exactly this file (inode, size, mtime, one name) as
    /// encrypted and its ciphertext is in place, the removal is finished:
    /// a source is moved aside only after its verified ciphertext is
    /// durable under its final name (`None`: nothing left to do).
    /// Otherwise it is renamed back to its name, never replacing anything;
    /// if that cannot be done it stays where it is and is encrypted under
    /// that name like any file. It used to be renamed back always, and when
    /// the name had been taken meanwhile (an upload) it was encrypted a
    /// second time, under its kept name.
    fn recover_aside(&self, f: scan::Found) -> Option<scan::Found> {
        let Some((pid, original)) = f.rel.file_name().and_then(fsio::parse_aside) else {
            return Some(f);
        };
        // At start nothing is moved aside by this process yet: its own PID
        // there is a previous one's, reused.
        if pid != std::process::id() as i32 && crate::atomic::pid_alive(pid) {
            return Some(f);
        }
        let Some(original) = original else {
            warn!(
                "{}: left by an interrupted removal (its name is unknown): encrypted as it is",
                show(&f.rel)
            );
            return Some(f);
        };
        let parent = f.rel.parent().unwrap_or(Path::new(""));
        if self.finish_removal(&f, parent, original) {
            return None;
        }
        let mut back = parent.join(original);
        let renamed = fsio::open_dir_beneath(&self.ctx.src_root, parent).and_then(|dir| {
            let aside = f.rel.file_name().unwrap_or_default();
            match fsio::rename_noreplace_at(&dir, aside, original) {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    // Its name was taken meanwhile: kept under another.
                    let kept = fsio::aside_name(original, fsio::RESTORED_MARKER);
                    fsio::rename_noreplace_at(&dir, aside, &kept)?;
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
                Some(scan::Found { rel: back, ..f })
            }
            Err(e) => {
                warn!(
                    "{}: left by an interrupted removal, cannot be renamed back to {}: {e}; \
                     encrypted as it is",
                    show(&f.rel),
                    show(&back)
                );
                Some(f)
            }
        }
    }

    /// Finishes the removal of the moved-aside `f` (of `parent/original`)
    /// if the journal says its ciphertext is made (see
    /// [`Coordinator::recover_aside`]); whether it did.
    fn finish_removal(&self, f: &scan::Found, parent: &Path, original: &std::ffi::OsStr) -> bool {
        if !self.ctx.delete || f.meta.nlink() != 1 {
            return false;
        }
        let rel = parent.join(original);
        let m = &f.meta;
        let mtime = m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128;
        let encrypted = self.journal().get(&rel).is_some_and(|rec| {
            rec.same_source(m.size(), mtime, m.ino())
                && worker::ciphertext_present(&self.ctx.version_path(&rel, rec.version), &rec)
        });
        if !encrypted {
            return false;
        }
        let aside = f.rel.file_name().unwrap_or_default();
        let removed = fsio::open_dir_beneath(&self.ctx.src_root, parent).and_then(|dir| {
            // Still the very file (nothing took the name since the scan).
            match fsio::lstat_at(&dir, aside) {
                Ok((Kind::File, _, ino)) if ino == m.ino() => {}
                _ => return Ok(false),
            }
            fsio::unlink_at(&dir, aside)?;
            fsio::fsync(&dir)?;
            Ok(true)
        });
        match removed {
            Ok(true) => {
                info!(
                    "{}: left by an interrupted removal of {}, whose ciphertext is made: removed",
                    show(&f.rel),
                    show(&rel)
                );
                if let Err(e) = self.journal().remove(&rel) {
                    warn!("{}: cannot write the journal: {e}", show(&rel));
                }
                true
            }
            Ok(false) => false,
            Err(e) => {
                warn!(
                    "{}: left by an interrupted removal, cannot be removed: {e}",
                    show(&f.rel)
                );
                false
            }
        }
    }

    /// Makes `rel` due at `due` (see [`Schedule::seen`]). A source this
    /// process has moved aside to remove it is not a new file.
    fn schedule(&mut self, rel: PathBuf, due: Instant, event_at: Option<Instant>) {
        if rel
            .file_name()
            .and_then(fsio::parse_aside)
            .is_some_and(|(pid, _)| pid == std::process::id() as i32)
        {
            return;
        }
        self.sched.seen(rel, due, event_at);
    }

    /// Hands ready entries to the workers while the work channel has room.
    fn dispatch(&mut self) {
        let Some(queue) = &self.work else { return };
        let now = Instant::now();
        while let Some(rel) = self.sched.next_job(now) {
            let (prev, fresh) = {
                let j = self.journal.lock().unwrap_or_else(|e| e.into_inner());
                (j.get(&rel), j.is_fresh(&rel))
            };
            let job = Job {
                prev,
                fresh,
                rel: rel.clone(),
            };
            match queue.try_send(job) {
                Ok(()) => self.sched.sent(&rel),
                Err(job) => {
                    self.sched.not_sent(job.rel);
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
                EventKind::Remove(RemoveKind::File) => self.forget(&rel, false),
                // A name moved out of SRC may be a directory's (the event
                // does not say), with files of its own beneath it.
                EventKind::Modify(ModifyKind::Name(RenameMode::From))
                | EventKind::Remove(RemoveKind::Any)
                | EventKind::Remove(RemoveKind::Other)
                | EventKind::Remove(RemoveKind::Folder) => self.forget(&rel, true),
                EventKind::Modify(ModifyKind::Data(_)) => self.sched.written(&rel, settle_at),
                _ => {}
            }
        }
    }

    /// A path went away (removed or moved out of SRC).
    fn forget(&mut self, rel: &Path, tree: bool) {
        // In flight: the worker will find it gone (or, if a new file took
        // the name, its own events bring it back). Its record is kept: the
        // worker itself moves a source aside before removing it, and puts
        // it back if it changed (or a crash leaves it aside, renamed back
        // at the next start), and that source's record says which
        // ciphertext is its own. The outcome settles the record (Gone
        // removes it).
        for p in self.sched.forget(rel, tree) {
            let removed = self.journal().remove(&p);
            if let Err(e) = removed {
                self.journal_error(e);
            }
        }
        if tree {
            // Beneath a directory that went: the records of files not in
            // flight (not scheduled, or scheduled and just forgotten).
            let sched = &self.sched;
            let removed = self.journal().remove_under(rel, |p| !sched.is_in_flight(p));
            if let Err(e) = removed {
                self.journal_error(e);
            }
        }
        if !self.ctx.delete {
            // Without --delete-plaintext the daemon moves no source itself:
            // one in flight that went is gone, and its record with it, now
            // (its job's commit then refuses to replace the ciphertext it
            // was about: commit.rs), and its outcome writes none.
            for p in self.sched.in_flight_under(rel, tree) {
                let removed = self.journal().remove(&p);
                if let Err(e) = removed {
                    self.journal_error(e);
                }
                self.gone_in_flight.insert(p);
            }
        }
        // Handed to the kernel at once: after a kill -9 a record of a source
        // that went must not be left for a newcomer of its name to take as
        // its own.
        let flushed = self.journal().flush();
        if let Err(e) = flushed {
            self.journal_error(e);
        }
        debug!("{} went: its records are dropped", show(rel));
        super::commit::crash_point("forgotten");
    }

    /// A worker's outcome: the schedule says what becomes of the file;
    /// the stats, the journal and the log follow.
    fn on_outcome(&mut self, rel: PathBuf, outcome: Outcome) {
        let Some(f) = self
            .sched
            .finished(&rel, attempt_of(&outcome), Instant::now())
        else {
            return;
        };
        let wait = f.wait.unwrap_or_default();
        // Its source went while it was in flight: no record, whatever the
        // outcome (the committer may have written one for the ciphertext
        // it made).
        let gone = self.gone_in_flight.remove(&rel);
        if gone && !matches!(outcome, Outcome::Encrypted { .. }) {
            let removed = self.journal().remove(&rel);
            if let Err(e) = removed {
                self.journal_error(e);
            }
        }
        match outcome {
            Outcome::Encrypted {
                rec,
                deleted,
                no_lease,
                done_at,
                service,
            } => {
                {
                    let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
                    s.counters.files += 1;
                    s.counters.bytes += rec.size;
                    s.service.record(service);
                    if let Some(t) = f.event_at {
                        s.latency.record(done_at.saturating_duration_since(t));
                    }
                    s.counters.deleted += u64::from(deleted);
                    s.counters.kept_no_lease += u64::from(no_lease);
                }
                if gone {
                    debug!("encrypted {}, whose source is gone", show(&rel));
                    let removed = self.journal().remove(&rel);
                    if let Err(e) = removed {
                        self.journal_error(e);
                    }
                } else {
                    self.record_encrypted(&rel, rec, deleted);
                }
            }
            Outcome::Unchanged => self.count(|c| c.unchanged += 1),
            Outcome::NotRegular(kind) => {
                info!(
                    "skipping {}: {} (only regular files are encrypted; symlinks are not followed)",
                    show(&rel),
                    kind.name()
                );
                self.count(|c| c.skipped += 1);
            }
            Outcome::Gone => {
                debug!("{} is gone", show(&rel));
                // Its record was kept while it was in flight (see forget).
                let removed = self.journal().remove(&rel);
                if let Err(err) = removed {
                    self.journal_error(err);
                }
            }
            Outcome::Busy => debug!(
                "{} is still open for writing; looking again in {}",
                show(&rel),
                human_duration(wait)
            ),
            Outcome::NotSettled(_) => {}
            Outcome::Changed => {
                info!(
                    "{} changed while being encrypted: doing it again",
                    show(&rel)
                );
                self.count(|c| c.changed += 1);
            }
            Outcome::Failed(err) => {
                warn!(
                    "{}: {} (attempt {}; retrying in {})",
                    show(&rel),
                    crate::ui::one_line(&err),
                    f.attempt,
                    human_duration(wait)
                );
                self.count(|c| c.failures += 1);
            }
        }
    }

    /// The journal after an encryption: the record, or none for a source
    /// removed.
    fn record_encrypted(&mut self, rel: &Path, rec: Record, deleted: bool) {
        let r = if deleted {
            debug!("encrypted and removed {}", show(rel));
            self.journal().remove(rel)
        } else {
            debug!("encrypted {}", show(rel));
            self.journal().put(rel, rec)
        };
        if let Err(err) = r {
            self.journal_error(err);
        }
    }

    /// Adds to a counter.
    fn count(&self, add: impl FnOnce(&mut Counters)) {
        add(&mut self
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .counters);
    }

    fn update_gauges(&self) {
        let g = self.sched.gauges();
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.counters.settling = g.settling;
        s.counters.queue_depth = g.ready;
        s.counters.in_flight = g.in_flight;
    }
}

/// What an outcome means for the schedule.
fn attempt_of(outcome: &Outcome) -> Attempt {
    match outcome {
        Outcome::Encrypted { .. } => Attempt::Encrypted,
        Outcome::Unchanged | Outcome::NotRegular(_) | Outcome::Gone => Attempt::Finished,
        Outcome::Busy => Attempt::Busy,
        Outcome::NotSettled(d) => Attempt::NotSettled(*d),
        Outcome::Changed => Attempt::Changed,
        Outcome::Failed(_) => Attempt::Failed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(name: &str) -> Job {
        Job {
            rel: PathBuf::from(name),
            prev: None,
            fresh: false,
        }
    }

    #[test]
    fn only_events_the_loop_ignores_are_dropped() {
        use notify::event::{DataChange, MetadataKind};
        for kind in [
            EventKind::Access(AccessKind::Open(AccessMode::Any)),
            EventKind::Access(AccessKind::Open(AccessMode::Read)),
            EventKind::Access(AccessKind::Read),
            EventKind::Access(AccessKind::Close(AccessMode::Read)),
        ] {
            assert!(ignored(&kind), "{kind:?}");
        }
        for kind in [
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
            EventKind::Create(CreateKind::File),
            EventKind::Create(CreateKind::Folder),
            EventKind::Modify(ModifyKind::Data(DataChange::Any)),
            EventKind::Modify(ModifyKind::Metadata(MetadataKind::Any)),
            EventKind::Modify(ModifyKind::Name(RenameMode::To)),
            EventKind::Modify(ModifyKind::Name(RenameMode::From)),
            EventKind::Remove(RemoveKind::File),
            EventKind::Remove(RemoveKind::Folder),
            // A rescan request comes as Other with a flag.
            EventKind::Other,
            EventKind::Any,
        ] {
            assert!(!ignored(&kind), "{kind:?}");
        }
    }

    #[test]
    fn the_job_queue_is_bounded_ordered_and_closes() {
        let q = Arc::new(JobQueue::new(2));
        assert!(q.try_send(job("a")).is_ok());
        assert!(q.try_send(job("b")).is_ok());
        let back = q
            .try_send(job("c"))
            .expect_err("a full queue gives the job back");
        assert_eq!(back.rel, Path::new("c"));
        assert_eq!(q.recv().map(|j| j.rel), Some(PathBuf::from("a")));
        assert!(q.try_send(job("c")).is_ok());
        assert_eq!(q.close(), 2, "b and c were waiting");
        assert!(q.recv().is_none());
        assert!(q.try_send(job("d")).is_err(), "closed");

        // A worker waiting on an empty queue takes a job sent later, and
        // one still waiting when the queue closes ends.
        let q = Arc::new(JobQueue::new(2));
        let waiting: Vec<_> = (0..2)
            .map(|_| {
                let q = q.clone();
                std::thread::spawn(move || q.recv().map(|j| j.rel))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        assert!(q.try_send(job("x")).is_ok());
        let deadline = Instant::now() + Duration::from_secs(10);
        while q.lock().jobs.len() == 1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(q.close(), 0, "the job was taken");
        let mut got: Vec<_> = waiting.into_iter().map(|t| t.join().unwrap()).collect();
        got.sort();
        assert_eq!(got, vec![None, Some(PathBuf::from("x"))]);
    }
}
