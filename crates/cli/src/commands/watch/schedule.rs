//! The coordinator's scheduling as a pure state machine: settle timers,
//! the ready queue, retries with backoff, and what becomes of a file after
//! a worker's attempt. It never reads the clock (every call that needs the
//! time is given it) and does no I/O, so that it is tested apart from the
//! event loop (`coord.rs`), which feeds it events and carries out what it
//! answers.
//!
//! A file (by path relative to SRC) is Waiting for its due time (settle or
//! backoff), Ready (in the queue for a worker) or InFlight. Events while it
//! is in flight mark it dirty: it is looked at again once settled, whatever
//! the attempt's result.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Longest wait between retries of a failing file.
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// Longest wait between re-checks of a file still open for writing.
pub const MAX_BUSY_WAIT: Duration = Duration::from_secs(30);
/// First wait after a failure (doubled on each consecutive one).
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// Shortest first wait for a file still open for writing.
const MIN_BUSY_WAIT: Duration = Duration::from_millis(100);
/// A ready file due later than this is put back to wait (its due time was
/// pushed back while it was queued).
const DISPATCH_SLACK: Duration = Duration::from_millis(1);

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

/// A worker's attempt, as far as scheduling is concerned.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Attempt {
    /// The ciphertext is durable: failures and the latency clock reset.
    Encrypted,
    /// Nothing (more) to do: unchanged, not a regular file, gone.
    Finished,
    /// Still open for writing: looked at again with backoff.
    Busy,
    /// Modified too recently: looked at again after this long.
    NotSettled(Duration),
    /// Changed while being encrypted: done again once settled.
    Changed,
    /// Failed: retried with backoff.
    Failed,
}

/// What becomes of a file after an attempt.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Disposition {
    /// Done: no longer tracked.
    Done,
    /// Looked at again at this time (a retry, or events arrived while it
    /// was in flight).
    Again(Instant),
}

/// The answer to [`Schedule::finished`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Finished {
    /// The event latency is measured from (taken before an `Encrypted`
    /// attempt resets it).
    pub event_at: Option<Instant>,
    /// Consecutive failures or busy answers, counting this one (0 for
    /// other attempts): for the log.
    pub attempt: u32,
    /// The backoff this attempt earned (Busy, Failed), for the log.
    pub wait: Option<Duration>,
    /// What becomes of the file.
    pub disposition: Disposition,
}

/// Counts for the gauges.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Gauges {
    /// Waiting for their due time.
    pub settling: u64,
    /// Queued for a worker.
    pub ready: u64,
    /// Being encrypted.
    pub in_flight: u64,
}

/// The scheduling state (see the module's comment).
pub struct Schedule {
    settle: Duration,
    entries: HashMap<PathBuf, Entry>,
    timers: BinaryHeap<Reverse<(Instant, PathBuf)>>,
    ready: VecDeque<PathBuf>,
    in_flight: usize,
}

/// `base` doubled `n` times, at most `max`.
pub fn backoff(base: Duration, n: u32, max: Duration) -> Duration {
    base.saturating_mul(1u32 << n.min(20)).min(max)
}

impl Schedule {
    /// An empty schedule; files settle for `settle`.
    pub fn new(settle: Duration) -> Schedule {
        Schedule {
            settle,
            entries: HashMap::new(),
            timers: BinaryHeap::new(),
            ready: VecDeque::new(),
            in_flight: 0,
        }
    }

    /// Files tracked (waiting, ready or in flight).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether `rel` is tracked.
    pub fn contains(&self, rel: &Path) -> bool {
        self.entries.contains_key(rel)
    }

    /// The paths in flight that are `rel` or, with `tree`, beneath it.
    pub fn in_flight_under(&self, rel: &Path, tree: bool) -> Vec<PathBuf> {
        self.entries
            .iter()
            .filter(|(p, e)| {
                e.state == State::InFlight && (p.as_path() == rel || (tree && p.starts_with(rel)))
            })
            .map(|(p, _)| p.clone())
            .collect()
    }

    /// Whether a job for `rel` is handed out and not yet finished.
    pub fn is_in_flight(&self, rel: &Path) -> bool {
        self.entries
            .get(rel)
            .is_some_and(|e| e.state == State::InFlight)
    }

    /// Jobs handed out and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// The earliest timer, for the loop's wake-up.
    pub fn next_due(&self) -> Option<Instant> {
        self.timers.peek().map(|Reverse((t, _))| *t)
    }

    /// A file was seen (closed after writing, created, moved in, found by
    /// a scan): it is due at `due` (de-duplicated by path; an event while
    /// in flight marks it to be done again).
    pub fn seen(&mut self, rel: PathBuf, due: Instant, event_at: Option<Instant>) {
        let Some(e) = self.entries.get_mut(&rel) else {
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
            return;
        };
        if event_at.is_some() {
            e.event_at = event_at;
        }
        match e.state {
            State::InFlight => {
                e.dirty = true;
                e.due = e.due.max(due);
            }
            // A later due date is picked up when the entry leaves the
            // ready queue.
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

    /// A tracked file was written to (not closed): its settle restarts
    /// from `settle_at`, or, in flight, it is done again afterwards.
    pub fn written(&mut self, rel: &Path, settle_at: Instant) {
        if let Some(e) = self.entries.get_mut(rel) {
            match e.state {
                State::InFlight => e.dirty = true,
                _ => e.due = e.due.max(settle_at),
            }
        }
    }

    /// A path went away (`tree`: a directory and all beneath it). Returns
    /// the paths whose journal records go: the tracked files beneath a
    /// tree, or the path itself; never one in flight, which stays until its
    /// attempt finishes (the worker finds it gone, and its record says
    /// which ciphertext is its own).
    pub fn forget(&mut self, rel: &Path, tree: bool) -> Vec<PathBuf> {
        let gone: Vec<PathBuf> = if tree {
            let mut v: Vec<PathBuf> = self
                .entries
                .keys()
                .filter(|p| p.starts_with(rel))
                .cloned()
                .collect();
            v.sort();
            v
        } else {
            vec![rel.to_path_buf()]
        };
        gone.into_iter()
            .filter(|p| {
                if self.is_in_flight(p) {
                    return false;
                }
                self.entries.remove(p);
                true
            })
            .collect()
    }

    /// Time passes: files due by `now` join the ready queue, in order of
    /// due time, then path.
    pub fn tick(&mut self, now: Instant) {
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

    /// The next file to hand to a worker, if any is ready at `now`. The
    /// caller then says whether it was [`sent`](Self::sent) or
    /// [`not`](Self::not_sent).
    pub fn next_job(&mut self, now: Instant) -> Option<PathBuf> {
        while let Some(rel) = self.ready.pop_front() {
            let Some(e) = self.entries.get_mut(&rel) else {
                continue;
            };
            if e.state != State::Ready {
                continue;
            }
            if e.due > now + DISPATCH_SLACK {
                e.state = State::Waiting;
                let due = e.due;
                self.timers.push(Reverse((due, rel)));
                continue;
            }
            return Some(rel);
        }
        None
    }

    /// The file [`next_job`](Self::next_job) gave is now in a worker's hands.
    pub fn sent(&mut self, rel: &Path) {
        if let Some(e) = self.entries.get_mut(rel) {
            e.state = State::InFlight;
            self.in_flight += 1;
        }
    }

    /// The file [`next_job`](Self::next_job) gave could not be handed out
    /// (workers busy): it is first in the queue again.
    pub fn not_sent(&mut self, rel: PathBuf) {
        self.ready.push_front(rel);
    }

    /// `n` jobs handed out will never finish (dropped from the work
    /// channel at shutdown).
    pub fn abandoned(&mut self, n: usize) {
        self.in_flight -= n.min(self.in_flight);
    }

    /// A worker's attempt at `rel` ended at `now`. None if `rel` is not
    /// tracked.
    pub fn finished(&mut self, rel: &Path, attempt: Attempt, now: Instant) -> Option<Finished> {
        self.in_flight = self.in_flight.saturating_sub(1);
        let settle = self.settle;
        let e = self.entries.get_mut(rel)?;
        let (dirty, event_at) = (e.dirty, e.event_at);
        let (mut count, mut wait, mut retry_at) = (0, None, None);
        match attempt {
            Attempt::Encrypted => {
                e.failures = 0;
                e.busy = 0;
                e.event_at = None;
            }
            Attempt::Finished => {}
            Attempt::Busy => {
                e.busy += 1;
                count = e.busy;
                wait = Some(backoff(
                    settle.max(MIN_BUSY_WAIT),
                    e.busy - 1,
                    MAX_BUSY_WAIT,
                ));
            }
            Attempt::NotSettled(d) => retry_at = Some(now + d),
            Attempt::Changed => retry_at = Some(now + settle),
            Attempt::Failed => {
                e.failures += 1;
                count = e.failures;
                wait = Some(backoff(FIRST_BACKOFF, e.failures - 1, MAX_BACKOFF));
            }
        }
        if let Some(w) = wait {
            retry_at = Some(now + w);
        }
        let disposition = if dirty {
            // Events arrived meanwhile: look again once settled.
            let due = e.due.max(now);
            Disposition::Again(retry_at.map_or(due, |r| r.min(due).max(now)))
        } else if let Some(at) = retry_at {
            Disposition::Again(at)
        } else {
            Disposition::Done
        };
        match disposition {
            Disposition::Done => {
                self.entries.remove(rel);
            }
            Disposition::Again(at) => {
                e.state = State::Waiting;
                e.dirty = false;
                e.due = at;
                self.timers.push(Reverse((at, rel.to_path_buf())));
            }
        }
        Some(Finished {
            event_at,
            attempt: count,
            wait,
            disposition,
        })
    }

    /// Counts for the gauges.
    pub fn gauges(&self) -> Gauges {
        let mut g = Gauges {
            in_flight: self.in_flight as u64,
            ..Gauges::default()
        };
        for e in self.entries.values() {
            match e.state {
                State::Waiting => g.settling += 1,
                State::Ready => g.ready += 1,
                State::InFlight => {}
            }
        }
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SETTLE: Duration = Duration::from_millis(200);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    /// Everything ready at `now`, handed out in order.
    fn take_all(s: &mut Schedule, now: Instant) -> Vec<PathBuf> {
        s.tick(now);
        let mut out = Vec::new();
        while let Some(rel) = s.next_job(now) {
            s.sent(&rel);
            out.push(rel);
        }
        out
    }

    #[test]
    fn a_closed_file_is_ready_once_settled() {
        let t0 = Instant::now();
        let mut s = Schedule::new(SETTLE);
        s.seen(p("a"), t0 + SETTLE, Some(t0));
        assert!(take_all(&mut s, t0 + ms(199)).is_empty());
        assert_eq!(s.next_due(), Some(t0 + SETTLE));
        assert_eq!(take_all(&mut s, t0 + SETTLE), [p("a")]);
        assert_eq!(s.in_flight(), 1);
    }

    #[test]
    fn settle_restarts_on_a_write() {
        let t0 = Instant::now();
        let mut s = Schedule::new(SETTLE);
        s.seen(p("a"), t0 + SETTLE, Some(t0));
        s.written(&p("a"), t0 + ms(150) + SETTLE);
        assert!(take_all(&mut s, t0 + SETTLE).is_empty());
        assert!(take_all(&mut s, t0 + ms(349)).is_empty());
        assert_eq!(take_all(&mut s, t0 + ms(350)), [p("a")]);
        // A second close-write also moves it, and is de-duplicated.
        let mut s = Schedule::new(SETTLE);
        s.seen(p("b"), t0 + SETTLE, Some(t0));
        s.seen(p("b"), t0 + ms(100) + SETTLE, Some(t0 + ms(100)));
        assert!(take_all(&mut s, t0 + SETTLE).is_empty());
        assert_eq!(take_all(&mut s, t0 + ms(300)), [p("b")]);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn a_write_pushes_back_a_file_already_queued() {
        let t0 = Instant::now();
        let mut s = Schedule::new(SETTLE);
        s.seen(p("a"), t0, None);
        s.tick(t0);
        s.written(&p("a"), t0 + SETTLE);
        assert_eq!(s.next_job(t0), None);
        assert_eq!(take_all(&mut s, t0 + SETTLE), [p("a")]);
    }

    #[test]
    fn a_file_written_during_encryption_is_redone_once_settled() {
        let t0 = Instant::now();
        let mut s = Schedule::new(SETTLE);
        s.seen(p("a"), t0 + SETTLE, Some(t0));
        assert_eq!(take_all(&mut s, t0 + SETTLE), [p("a")]);
        // Closed again while in flight: not handed out twice at once.
        let t1 = t0 + ms(300);
        s.seen(p("a"), t1 + SETTLE, Some(t1));
        assert!(take_all(&mut s, t1 + SETTLE).is_empty());
        let f = s
            .finished(&p("a"), Attempt::Encrypted, t0 + ms(400))
            .unwrap();
        assert_eq!(f.event_at, Some(t1));
        assert_eq!(f.disposition, Disposition::Again(t1 + SETTLE));
        assert!(take_all(&mut s, t1 + SETTLE - ms(1)).is_empty());
        assert_eq!(take_all(&mut s, t1 + SETTLE), [p("a")]);
        // This time nothing happened meanwhile: done.
        let f = s
            .finished(&p("a"), Attempt::Encrypted, t1 + ms(600))
            .unwrap();
        assert_eq!(f.disposition, Disposition::Done);
        assert_eq!(f.event_at, None, "the latency clock was reset");
        assert_eq!(s.len(), 0);
    }

    #[test]
    fn a_file_that_changed_under_the_worker_is_redone_after_settle() {
        let t0 = Instant::now();
        let mut s = Schedule::new(SETTLE);
        s.seen(p("a"), t0, None);
        take_all(&mut s, t0);
        let f = s.finished(&p("a"), Attempt::Changed, t0 + ms(50)).unwrap();
        assert_eq!(f.disposition, Disposition::Again(t0 + ms(250)));
        assert!(take_all(&mut s, t0 + ms(249)).is_empty());
        assert_eq!(take_all(&mut s, t0 + ms(250)), [p("a")]);
        let f = s.finished(&p("a"), Attempt::NotSettled(ms(70)), t0 + ms(300));
        assert_eq!(f.unwrap().disposition, Disposition::Again(t0 + ms(370)));
    }

    #[test]
    fn failures_back_off_up_to_a_limit_and_reset_on_success() {
        let mut now = Instant::now();
        let mut s = Schedule::new(SETTLE);
        s.seen(p("a"), now, None);
        let mut waits = Vec::new();
        for n in 1..=11 {
            assert_eq!(take_all(&mut s, now), [p("a")]);
            let f = s.finished(&p("a"), Attempt::Failed, now).unwrap();
            assert_eq!(f.attempt, n);
            let wait = f.wait.unwrap();
            assert_eq!(f.disposition, Disposition::Again(now + wait));
            assert!(take_all(&mut s, now + wait - ms(1)).is_empty());
            waits.push(wait.as_secs());
            now += wait;
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        take_all(&mut s, now);
        s.finished(&p("a"), Attempt::Encrypted, now).unwrap();
        // Seen again later: the count starts over.
        s.seen(p("a"), now, None);
        take_all(&mut s, now);
        let f = s.finished(&p("a"), Attempt::Failed, now).unwrap();
        assert_eq!((f.attempt, f.wait), (1, Some(Duration::from_secs(1))));
    }

    #[test]
    fn a_file_open_for_writing_is_looked_at_again_with_backoff() {
        let mut now = Instant::now();
        let mut s = Schedule::new(SETTLE);
        s.seen(p("a"), now, None);
        let mut waits = Vec::new();
        for _ in 0..10 {
            take_all(&mut s, now);
            let f = s.finished(&p("a"), Attempt::Busy, now).unwrap();
            waits.push(f.wait.unwrap().as_millis());
            now += f.wait.unwrap();
        }
        assert_eq!(
            waits,
            [200, 400, 800, 1600, 3200, 6400, 12800, 25600, 30000, 30000]
        );
        // A short settle still waits at least 100ms.
        let mut s = Schedule::new(Duration::ZERO);
        s.seen(p("b"), now, None);
        take_all(&mut s, now);
        let f = s.finished(&p("b"), Attempt::Busy, now).unwrap();
        assert_eq!(f.wait, Some(ms(100)));
    }

    #[test]
    fn finished_files_are_forgotten() {
        let t0 = Instant::now();
        let mut s = Schedule::new(SETTLE);
        s.seen(p("a"), t0, None);
        take_all(&mut s, t0);
        let f = s.finished(&p("a"), Attempt::Finished, t0).unwrap();
        assert_eq!(f.disposition, Disposition::Done);
        assert!(!s.contains(&p("a")));
        assert_eq!(s.finished(&p("a"), Attempt::Finished, t0), None);
        assert_eq!(s.in_flight(), 0);
    }

    #[test]
    fn order_is_by_due_time_then_path_whatever_the_arrival_order() {
        let t0 = Instant::now();
        let names = ["d/x", "b", "c", "a", "d/a"];
        let mut orders = Vec::new();
        for rot in 0..names.len() {
            let mut s = Schedule::new(SETTLE);
            for i in 0..names.len() {
                s.seen(p(names[(i + rot) % names.len()]), t0, None);
            }
            s.seen(p("late"), t0 - ms(5), None);
            orders.push(take_all(&mut s, t0));
        }
        let want: Vec<PathBuf> = ["late", "a", "b", "c", "d/a", "d/x"].map(p).into();
        for o in orders {
            assert_eq!(o, want);
        }
    }

    #[test]
    fn a_busy_work_channel_keeps_the_queue_order() {
        let t0 = Instant::now();
        let mut s = Schedule::new(SETTLE);
        for n in ["a", "b", "c"] {
            s.seen(p(n), t0, None);
        }
        s.tick(t0);
        let first = s.next_job(t0).unwrap();
        s.sent(&first);
        let second = s.next_job(t0).unwrap();
        s.not_sent(second.clone());
        assert_eq!(s.next_job(t0), Some(second));
        assert_eq!(
            s.gauges(),
            Gauges {
                settling: 0,
                ready: 2,
                in_flight: 1
            }
        );
    }

    #[test]
    fn a_removed_tree_is_forgotten_except_what_is_in_flight() {
        let t0 = Instant::now();
        let mut s = Schedule::new(SETTLE);
        s.seen(p("d/a"), t0, None);
        take_all(&mut s, t0);
        for n in ["d/b", "d/e/c", "dx", "x"] {
            s.seen(p(n), t0 + SETTLE, None);
        }
        assert_eq!(s.forget(&p("d"), true), [p("d/b"), p("d/e/c")]);
        assert!(s.contains(&p("d/a")) && s.contains(&p("dx")));
        assert_eq!(s.forget(&p("x"), false), [p("x")]);
        assert_eq!(s.forget(&p("d/a"), false), Vec::<PathBuf>::new());
        assert_eq!(
            s.gauges(),
            Gauges {
                settling: 1,
                ready: 0,
                in_flight: 1
            }
        );
        s.abandoned(1);
        assert_eq!(s.in_flight(), 0);
    }
}
