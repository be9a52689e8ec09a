//! The segment pipeline engine: runs the segments of one payload through
//! the stateless primitive of [`crate::segment`] on N workers in constant
//! memory, writing them strictly in order. Its segment source is a reader
//! thread for streams or positional reads for regular files.
//!
//! The primitive's items are re-exported here under their former paths.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::bounded;

use crate::backend::{Backend, AES_BLOCK};
use crate::error::{Error, Result};
use crate::segment::input_reserve;

pub use crate::io_util::read_full;
pub use crate::segment::{
    segment_nonce, Direction, FileKeys, Layout, SegmentCrypter, NONCE_PREFIX_LEN,
};

/// Where the engine's time went, summed over its threads and over every
/// run given the same counters: sealing or opening segments (AES, CPU
/// time of the threads that did it), reading input and writing output.
/// Measured per segment step with the monotonic clock (two clock reads a
/// step), so cheap enough to keep on; shared by reference, so one set can
/// count a whole run of many files on many threads.
#[derive(Debug, Default)]
pub struct Timings {
    crypto_ns: AtomicU64,
    read_ns: AtomicU64,
    write_ns: AtomicU64,
    segments: AtomicU64,
    active: AtomicU64,
    peak_threads: AtomicU64,
}

/// A reading of [`Timings`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimingsSnapshot {
    /// Sealing/opening segments, summed over the threads that did it.
    pub crypto: Duration,
    /// Reading input (headers and segments), summed over threads.
    pub read: Duration,
    /// Writing output (headers, segments, flush), summed over threads.
    pub write: Duration,
    /// Segments sealed or opened.
    pub segments: u64,
    /// Most threads sealing or opening at once.
    pub peak_threads: u64,
}

/// Which counter a measured step adds to.
#[derive(Clone, Copy, Debug)]
pub enum Step {
    /// Sealing or opening a segment.
    Crypto,
    /// Reading input.
    Read,
    /// Writing output.
    Write,
}

impl Timings {
    /// Counters at zero.
    pub fn new() -> Self {
        Timings::default()
    }

    /// The figures so far.
    pub fn snapshot(&self) -> TimingsSnapshot {
        let d = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
        TimingsSnapshot {
            crypto: d(&self.crypto_ns),
            read: d(&self.read_ns),
            write: d(&self.write_ns),
            segments: self.segments.load(Ordering::Relaxed),
            peak_threads: self.peak_threads.load(Ordering::Relaxed),
        }
    }

    /// Adds `elapsed` to the counter of `step`.
    pub fn add(&self, step: Step, elapsed: Duration) {
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        let counter = match step {
            Step::Crypto => {
                self.segments.fetch_add(1, Ordering::Relaxed);
                &self.crypto_ns
            }
            Step::Read => &self.read_ns,
            Step::Write => &self.write_ns,
        };
        counter.fetch_add(ns, Ordering::Relaxed);
    }

    /// Counts a thread that seals or opens until the guard is dropped.
    fn enter(&self) -> ThreadGuard<'_> {
        let now = self.active.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak_threads.fetch_max(now, Ordering::Relaxed);
        ThreadGuard(self)
    }
}

struct ThreadGuard<'a>(&'a Timings);

impl Drop for ThreadGuard<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Runs `f`, adding its duration to `step` when there are counters.
pub fn timed<T>(timings: Option<&Timings>, step: Step, f: impl FnOnce() -> T) -> T {
    match timings {
        None => f(),
        Some(t) => {
            let start = Instant::now();
            let out = f();
            t.add(step, start.elapsed());
            out
        }
    }
}

/// How to run the engine.
#[derive(Clone, Copy, Default)]
pub struct StreamOptions<'a> {
    /// Worker threads; 0 or 1 runs everything on the calling thread.
    pub workers: usize,
    /// Called with the number of plaintext bytes done, as segments complete.
    pub progress: Option<&'a (dyn Fn(u64) + Sync)>,
    /// Counters to add the engine's read, AES and write time to.
    pub timings: Option<&'a Timings>,
}

impl<'a> StreamOptions<'a> {
    /// Single-threaded, no progress.
    pub fn sequential() -> Self {
        StreamOptions::default()
    }

    /// `workers` threads.
    pub fn parallel(workers: usize) -> Self {
        StreamOptions {
            workers,
            progress: None,
            timings: None,
        }
    }
}

/// What a chunk's buffer holds before it grows (fourfold at each step, up
/// to the segment): a small input zeroes and faults in this much, not a
/// whole segment (1 MiB by default), which cost a one-file run more than
/// its AES did.
const FIRST_FILL: usize = 64 << 10;

/// Cuts the input into segment-sized chunks, reading one byte ahead so that
/// the last chunk is known when it is read (the last-segment flag is part of
/// the nonce).
pub(crate) struct Chunker<R: Read> {
    input: R,
    carry: Option<u8>,
    index: u64,
    done: bool,
    /// How much of a buffer's room the first read of a chunk may use
    /// before it is known to need more (at most [`FIRST_FILL`]).
    first_fill: usize,
}

pub(crate) struct Chunk {
    pub(crate) index: u64,
    pub(crate) last: bool,
    pub(crate) buf: Vec<u8>,
}

impl<R: Read> Chunker<R> {
    pub(crate) fn new(input: R) -> Self {
        Chunker {
            input,
            carry: None,
            index: 0,
            done: false,
            first_fill: FIRST_FILL,
        }
    }

    /// A chunker for an input expected to hold `len` bytes (a regular
    /// file's region): a smaller input zeroes only its own length and one
    /// byte, not [`FIRST_FILL`]. An input longer than expected is still
    /// read whole (the room then grows as usual).
    pub(crate) fn with_len_hint(input: R, len: u64) -> Self {
        let fill = usize::try_from(len.saturating_add(1)).unwrap_or(FIRST_FILL);
        Chunker {
            first_fill: fill.min(FIRST_FILL),
            ..Chunker::new(input)
        }
    }

    /// Fills `buf` with `reserve` bytes of room and up to `want` bytes of
    /// input. Returns None once the last chunk has been handed out.
    /// Index of the chunk `next` hands out.
    pub(crate) fn index(&self) -> u64 {
        self.index
    }

    pub(crate) fn next(
        &mut self,
        mut buf: Vec<u8>,
        reserve: usize,
        want: usize,
    ) -> io::Result<Option<Chunk>> {
        if self.done {
            return Ok(None);
        }
        let end = reserve + want;
        // A reused buffer keeps its length: only bytes never used before
        // are zeroed.
        let mut target = end.min(reserve + self.first_fill);
        if buf.len() < target {
            buf.resize(target, 0);
        }
        let mut filled = reserve;
        if let Some(b) = self.carry.take() {
            buf[filled] = b;
            filled += 1;
        }
        loop {
            filled += read_full(&mut self.input, &mut buf[filled..target])?;
            if filled < target || target == end {
                break;
            }
            target = end.min(reserve + (target - reserve).saturating_mul(4));
            if buf.len() < target {
                buf.resize(target, 0);
            }
        }
        buf.truncate(filled);
        let last = if filled < end {
            true
        } else {
            let mut one = [0u8; 1];
            if read_full(&mut self.input, &mut one)? == 1 {
                self.carry = Some(one[0]);
                false
            } else {
                true
            }
        };
        let chunk = Chunk {
            index: self.index,
            last,
            buf,
        };
        self.index += 1;
        self.done = last;
        Ok(Some(chunk))
    }
}

/// Room for one segment and what sealing adds to it.
fn segment_capacity(layout: &Layout) -> usize {
    layout.segment_size + AES_BLOCK * 2
}

/// The buffers in circulation for `workers` threads, each holding one
/// segment: their number bounds the engine's memory. Returns the count and
/// the pool, already filled.
fn buffer_pool(
    layout: &Layout,
    workers: usize,
) -> (
    usize,
    crossbeam_channel::Sender<Vec<u8>>,
    crossbeam_channel::Receiver<Vec<u8>>,
) {
    let buffers = workers.saturating_mul(2).saturating_add(2);
    let (tx, rx) = bounded::<Vec<u8>>(buffers);
    for _ in 0..buffers {
        // The channel has room for exactly `buffers` items.
        let _ = tx.send(Vec::with_capacity(segment_capacity(layout)));
    }
    (buffers, tx, rx)
}

/// Runs the segments of one payload (after its stream header) through
/// `keys`, from `input` to `output`. Returns the plaintext byte count.
/// Output is written strictly in order; when opening, a segment is written
/// only after it authenticated, and nothing after a failed one.
pub fn run<R: Read, W: Write + Send>(
    direction: Direction,
    backend: &Arc<dyn Backend>,
    keys: &FileKeys,
    input: &mut R,
    output: &mut W,
    opts: &StreamOptions<'_>,
) -> Result<u64> {
    if opts.workers <= 1 {
        let chunker = Chunker::new(input);
        run_sequential(direction, backend, keys, chunker, output, opts)
    } else {
        let job = Job {
            direction,
            backend,
            keys,
            opts,
        };
        run_parallel(&job, input, output)
    }
}

fn want(direction: Direction, layout: &Layout, index: u64) -> usize {
    match direction {
        Direction::Seal => layout.plaintext_segment_len(index),
        Direction::Open => layout.ciphertext_segment_len(index),
    }
}

/// Seals or opens one chunk; returns the range of `buf` to write and the
/// plaintext byte count.
pub(crate) fn process(
    direction: Direction,
    crypter: &mut SegmentCrypter,
    chunk: &mut Chunk,
) -> Result<(Range<usize>, u64)> {
    match direction {
        Direction::Seal => {
            let plain = (chunk.buf.len() - crypter.reserve()) as u64;
            crypter.seal(chunk.index, chunk.last, &mut chunk.buf)?;
            Ok((0..chunk.buf.len(), plain))
        }
        Direction::Open => {
            if chunk.index == 0 && chunk.buf.is_empty() {
                return Err(Error::TruncatedHeader);
            }
            let range = crypter.open(chunk.index, chunk.last, &mut chunk.buf)?;
            let plain = range.len() as u64;
            Ok((range, plain))
        }
    }
}

fn run_sequential<R: Read, W: Write>(
    direction: Direction,
    backend: &Arc<dyn Backend>,
    keys: &FileKeys,
    mut chunker: Chunker<R>,
    output: &mut W,
    opts: &StreamOptions<'_>,
) -> Result<u64> {
    let layout = keys.layout();
    let mut crypter = keys.crypter(backend)?;
    let reserve = input_reserve(direction, &layout);
    let mut buf = Vec::new();
    let mut total = 0u64;
    let t = opts.timings;
    let _counted = t.map(Timings::enter);
    loop {
        let index = chunker.index;
        let want = want(direction, &layout, index);
        let Some(mut chunk) = timed(t, Step::Read, || chunker.next(buf, reserve, want))? else {
            return Ok(total);
        };
        let (range, plain) = timed(t, Step::Crypto, || {
            process(direction, &mut crypter, &mut chunk)
        })?;
        timed(t, Step::Write, || output.write_all(&chunk.buf[range]))?;
        total += plain;
        if let Some(progress) = opts.progress {
            progress(total);
        }
        buf = chunk.buf;
    }
}

/// One worker's supply of segments from a segment source: the engine's
/// workers all run the same loop over a feed, whatever the source.
trait Feed: Send {
    /// Whether a worker may leave a finished segment for another to write
    /// and go on: yes when the buffers belong to a pool.
    const MAY_LEAVE: bool;

    /// The next segment and the outcome of reading it, in the order the
    /// source hands them out; None once all are handed out, or once
    /// `stopped` says the run has stopped while the feed waits.
    fn next(&mut self, stopped: &dyn Fn() -> bool) -> Option<(Chunk, Result<()>)>;

    /// Takes back the buffer of a segment that has been written.
    fn recycle(&mut self, buf: Vec<u8>);

    /// Told when this worker leaves the run (it is over for it, or
    /// stopped), so that no other worker waits for what it would free.
    fn leave(&mut self) {}
}

/// Feed from the reader thread of a stream: segments arrive on a channel
/// and their buffers go back to the reader's pool. Every worker holds a
/// clone of both ends, so the reader stops once all workers are gone.
struct ChannelFeed {
    jobs: crossbeam_channel::Receiver<(Chunk, Result<()>)>,
    pool: crossbeam_channel::Sender<Vec<u8>>,
}

impl Feed for ChannelFeed {
    const MAY_LEAVE: bool = true;

    fn next(&mut self, _stopped: &dyn Fn() -> bool) -> Option<(Chunk, Result<()>)> {
        self.jobs.recv().ok()
    }

    fn recycle(&mut self, buf: Vec<u8>) {
        // The reader may have stopped already; then nobody needs it.
        let _ = self.pool.send(buf);
    }
}

/// Feed from a regular file: the worker takes the next segment index and
/// reads the segment itself with a positional read into its own buffer, so
/// reading is parallel and a segment is read, sealed and written by one
/// thread while it is in that core's cache. A worker done before its turn
/// leaves its segment, buffer and all, to be written by the worker whose
/// turn it is, and goes on with a spare buffer while there is one: a worker
/// held up (by another process on its core) does not hold up the others.
struct RegionFeed<'r, 'f> {
    region: &'r Region<'f>,
    /// The worker's buffer, which it gets back when it writes its own
    /// segment, so that it stays in its core's cache; empty (no capacity)
    /// while its segment waits for its turn.
    own: Vec<u8>,
    spares: &'r Spares,
    timings: Option<&'r Timings>,
}

/// Spare segment buffers shared by a region's workers: how far the others
/// may get ahead of a worker that is held up.
const REGION_SPARES: usize = 2;

/// The spare buffers of a region's workers. A worker waiting for one
/// sleeps on a condition variable: it neither spins nor yields its CPU in
/// a loop (a channel's timed receive did, and on a CPU shared with another
/// busy process each yield gave the CPU away: a run to a pipe took up to
/// five times as long).
struct Spares {
    /// The free spares, and whether the run is over for the workers.
    state: std::sync::Mutex<(Vec<Vec<u8>>, bool)>,
    freed: std::sync::Condvar,
}

impl Spares {
    fn new(count: usize, capacity: usize) -> Self {
        Spares {
            state: std::sync::Mutex::new((
                (0..count).map(|_| Vec::with_capacity(capacity)).collect(),
                false,
            )),
            freed: std::sync::Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (Vec<Vec<u8>>, bool)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A spare, once one is free; None once the run is over (a worker
    /// left) or `stopped` says it stopped. A worker that panicked leaves
    /// without telling: `stopped` is asked every 50 ms.
    fn take(&self, stopped: &dyn Fn() -> bool) -> Option<Vec<u8>> {
        let mut state = self.lock();
        loop {
            if state.1 || stopped() {
                return None;
            }
            if let Some(buf) = state.0.pop() {
                return Some(buf);
            }
            state = self
                .freed
                .wait_timeout(state, Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn put(&self, buf: Vec<u8>) {
        self.lock().0.push(buf);
        self.freed.notify_one();
    }

    fn close(&self) {
        self.lock().1 = true;
        self.freed.notify_all();
    }
}

impl Feed for RegionFeed<'_, '_> {
    const MAY_LEAVE: bool = true;

    fn next(&mut self, stopped: &dyn Fn() -> bool) -> Option<(Chunk, Result<()>)> {
        // Its own buffer if it has it back, else a spare (waited for; none
        // once the run is over).
        let buf = if self.own.capacity() > 0 {
            std::mem::take(&mut self.own)
        } else {
            self.spares.take(stopped)?
        };
        let mut chunk = self.region.take(buf)?;
        let read = timed(self.timings, Step::Read, || self.region.read(&mut chunk));
        Some((chunk, read))
    }

    fn recycle(&mut self, buf: Vec<u8>) {
        // The first buffer back after a write is the worker's own segment's.
        if self.own.capacity() == 0 {
            self.own = buf;
        } else {
            self.spares.put(buf);
        }
    }

    fn leave(&mut self) {
        // Every segment is taken, or the run is over: nothing more to wait
        // for a spare for.
        self.spares.close();
    }
}

/// What the engine runs: the direction, the keys and how.
struct Job<'a> {
    direction: Direction,
    backend: &'a Arc<dyn Backend>,
    keys: &'a FileKeys,
    opts: &'a StreamOptions<'a>,
}

/// The reader of a stream, run on the calling thread; told whether the run
/// has stopped.
type Reader<'a> = Box<dyn FnOnce(&dyn Fn() -> bool) + 'a>;

/// The one pipeline engine. Each feed gets a worker thread, except that
/// without a `reader` the calling thread works the first feed itself; with
/// one, the calling thread runs the reader. A worker seals or opens its
/// segment and hands it in ([`Turns::hand_in`]): segments are written
/// strictly in order, by the worker whose turn it is, and nothing after a
/// failed segment is written.
fn run_engine<W: Write + Send, F: Feed>(
    job: &Job<'_>,
    feeds: Vec<F>,
    output: &mut W,
    reader: Option<Reader<'_>>,
) -> Result<u64> {
    let timings = job.opts.timings;
    let turns = Turns::new(output, job.opts.progress, timings);
    // Every worker counts as sealing or opening from the start of the run
    // until it ends, also one whose thread starts after a quick run is over.
    let mut feeds: Vec<_> = feeds
        .into_iter()
        .map(|feed| (feed, timings.map(Timings::enter)))
        .collect();
    let work = |(mut feed, _counted): (F, Option<ThreadGuard<'_>>)| -> Result<()> {
        let mut crypter = match job.keys.crypter(job.backend) {
            Ok(crypter) => crypter,
            Err(e) => {
                feed.leave();
                return Err(e);
            }
        };
        while !turns.stopped() {
            let Some((mut chunk, read)) = feed.next(&|| turns.stopped()) else {
                break;
            };
            let outcome = read.and_then(|()| {
                timed(timings, Step::Crypto, || {
                    process(job.direction, &mut crypter, &mut chunk)
                })
            });
            match turns.hand_in(chunk, outcome, F::MAY_LEAVE) {
                Handed::Stop => break,
                Handed::Go(spent) => spent.into_iter().for_each(|buf| feed.recycle(buf)),
            }
        }
        feed.leave();
        Ok(())
    };
    let mine = if reader.is_none() && !feeds.is_empty() {
        Some(feeds.remove(0))
    } else {
        None
    };
    let worker_error = std::thread::scope(|scope| {
        let others: Vec<_> = feeds
            .into_iter()
            .map(|feed| scope.spawn(|| turns.stop_on_unwind(|| work(feed))))
            .collect();
        let mut outcomes = Vec::with_capacity(others.len() + 1);
        if let Some(feed) = mine {
            outcomes.push(Ok(turns.stop_on_unwind(|| work(feed))));
        }
        if let Some(reader) = reader {
            reader(&|| turns.stopped());
        }
        outcomes.extend(others.into_iter().map(|h| h.join()));
        first_worker_error(outcomes)
    });
    turns.finish(worker_error)
}

/// The first error among the workers' outcomes, a panic counting as one.
fn first_worker_error(outcomes: Vec<std::thread::Result<Result<()>>>) -> Option<Error> {
    let mut worker_error = None;
    for outcome in outcomes {
        let e = match outcome {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => e,
            Err(_) => Error::Backend("worker thread panicked".into()),
        };
        worker_error = worker_error.or(Some(e));
    }
    worker_error
}

/// [`run`] on `workers` threads: the calling thread reads segments into
/// buffers from a bounded pool and hands them to the engine's workers.
fn run_parallel<R: Read, W: Write + Send>(
    job: &Job<'_>,
    input: &mut R,
    output: &mut W,
) -> Result<u64> {
    let layout = job.keys.layout();
    let workers = job.opts.workers;
    let (_, pool_tx, pool_rx) = buffer_pool(&layout, workers);
    let (job_tx, job_rx) = bounded::<(Chunk, Result<()>)>(workers);
    let feeds: Vec<_> = (0..workers)
        .map(|_| ChannelFeed {
            jobs: job_rx.clone(),
            pool: pool_tx.clone(),
        })
        .collect();
    drop((job_rx, pool_tx));
    let reserve = input_reserve(job.direction, &layout);
    let timings = job.opts.timings;
    let mut chunker = Chunker::new(input);
    // Moved into the reader, so dropped when it returns: workers waiting
    // for a segment then learn that there are no more.
    let read = move |stopped: &dyn Fn() -> bool| {
        loop {
            // A run that stopped (a failed segment) may hold every pooled
            // buffer in segments left for a turn that never comes: wait
            // for a buffer a little at a time, and leave once stopped, so
            // that the workers waiting for a segment learn there are none.
            let buf = match pool_rx.recv_timeout(std::time::Duration::from_millis(5)) {
                Ok(buf) => buf,
                Err(crossbeam_channel::RecvTimeoutError::Timeout) if !stopped() => continue,
                Err(_) => break,
            };
            if stopped() {
                break;
            }
            let index = chunker.index;
            let want = want(job.direction, &layout, index);
            let next = timed(timings, Step::Read, || chunker.next(buf, reserve, want));
            let sent = match next {
                Ok(Some(chunk)) => job_tx.send((chunk, Ok(()))),
                Ok(None) => break,
                // Reported in its place in the order, as that segment's.
                Err(e) => {
                    let chunk = Chunk {
                        index,
                        last: true,
                        buf: Vec::new(),
                    };
                    let _ = job_tx.send((chunk, Err(Error::Io(e))));
                    break;
                }
            };
            if sent.is_err() {
                break;
            }
        }
    };
    run_engine(job, feeds, output, Some(Box::new(read)))
}

/// Offset of segment `index` within a region cut into a first segment of
/// `first` bytes and further segments of `rest` bytes.
fn segment_offset(index: u64, first: u64, rest: u64) -> u64 {
    if index == 0 {
        0
    } else {
        first + (index - 1) * rest
    }
}

/// Number of segments for a region of `len` bytes (at least one: an empty
/// input is one empty last segment).
fn segment_count(len: u64, first: u64, rest: u64) -> u64 {
    if len <= first {
        1
    } else {
        1 + (len - first).div_ceil(rest)
    }
}

/// As [`run`], for a regular file whose region `[start, end)` is known.
/// Each worker owns one segment buffer and takes the next segment: a
/// positional read, the seal or open, then, when all segments before it are
/// written, its own write. Reading is parallel, and a segment is read,
/// sealed and written by one thread while it is still in that core's
/// cache. A worker done before its turn leaves its segment for the worker
/// whose turn it is to write, and goes on with one of [`REGION_SPARES`]
/// spare buffers, so one worker held up does not stop the rest. The
/// calling thread is one of the workers. A single worker uses [`run`].
#[allow(clippy::too_many_arguments)]
pub fn run_file<W: Write + Send>(
    direction: Direction,
    backend: &Arc<dyn Backend>,
    keys: &FileKeys,
    file: &std::fs::File,
    start: u64,
    end: u64,
    output: &mut W,
    opts: &StreamOptions<'_>,
) -> Result<u64> {
    use std::io::{Seek, SeekFrom};

    let len = end.saturating_sub(start);
    if opts.workers <= 1 {
        let mut reader = file;
        reader.seek(SeekFrom::Start(start))?;
        let chunker = Chunker::with_len_hint(Read::take(reader, len), len);
        return run_sequential(direction, backend, keys, chunker, output, opts);
    }
    let layout = keys.layout();
    let first = want(direction, &layout, 0) as u64;
    let rest = want(direction, &layout, 1) as u64;
    let region = Region {
        file,
        start,
        len,
        first,
        rest,
        count: segment_count(len, first, rest),
        reserve: input_reserve(direction, &layout),
        next_index: std::sync::atomic::AtomicU64::new(0),
    };
    let capacity = segment_capacity(&layout);
    let spares = Spares::new(REGION_SPARES, capacity);
    let feeds = (0..opts.workers)
        .map(|_| RegionFeed {
            region: &region,
            own: Vec::with_capacity(capacity),
            spares: &spares,
            timings: opts.timings,
        })
        .collect();
    let job = Job {
        direction,
        backend,
        keys,
        opts,
    };
    run_engine(&job, feeds, output, None)
}

/// The segments of a file region, handed out in order to whichever worker
/// asks next.
struct Region<'f> {
    file: &'f std::fs::File,
    start: u64,
    len: u64,
    first: u64,
    rest: u64,
    count: u64,
    reserve: usize,
    next_index: std::sync::atomic::AtomicU64,
}

impl Region<'_> {
    /// The next segment, sized in `buf` but not yet read; None when all are
    /// taken.
    fn take(&self, mut buf: Vec<u8>) -> Option<Chunk> {
        use std::sync::atomic::Ordering;
        let index = self.next_index.fetch_add(1, Ordering::Relaxed);
        if index >= self.count {
            return None;
        }
        let offset = segment_offset(index, self.first, self.rest);
        let cap = if index == 0 { self.first } else { self.rest };
        let seg_len = (self.len - offset).min(cap) as usize;
        buf.resize(self.reserve + seg_len, 0);
        Some(Chunk {
            index,
            last: index + 1 == self.count,
            buf,
        })
    }

    fn read(&self, chunk: &mut Chunk) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let offset = self.start + segment_offset(chunk.index, self.first, self.rest);
        match self
            .file
            .read_exact_at(&mut chunk.buf[self.reserve..], offset)
        {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Err(Error::Io(io::Error::other(
                "the input shrank while it was being read",
            ))),
            Err(e) => Err(Error::Io(e)),
        }
    }
}

/// The output, written in segment order by the workers in turn. The first
/// failed segment stops everything: nothing after it is written.
struct Turns<'o, W> {
    state: std::sync::Mutex<TurnState<'o, W>>,
    turn: std::sync::Condvar,
    stopped: std::sync::atomic::AtomicBool,
    progress: Option<&'o (dyn Fn(u64) + Sync)>,
    timings: Option<&'o Timings>,
}

struct TurnState<'o, W> {
    output: &'o mut W,
    next: u64,
    total: u64,
    outcome: Option<Result<u64>>,
    /// Segments handed in before their turn, by workers that went on.
    pending: BTreeMap<u64, (Chunk, Outcome)>,
}

/// A sealed or opened segment: the range of its buffer to write and its
/// plaintext byte count, or why it failed.
type Outcome = Result<(Range<usize>, u64)>;

/// What a worker does after handing in a segment.
enum Handed {
    /// Go on, recycling these buffers (its own and any it wrote for others).
    Go(Vec<Vec<u8>>),
    /// The run is over (done or failed).
    Stop,
}

impl<'o, W: Write> Turns<'o, W> {
    fn new(
        output: &'o mut W,
        progress: Option<&'o (dyn Fn(u64) + Sync)>,
        timings: Option<&'o Timings>,
    ) -> Self {
        Turns {
            state: std::sync::Mutex::new(TurnState {
                output,
                next: 0,
                total: 0,
                outcome: None,
                pending: BTreeMap::new(),
            }),
            turn: std::sync::Condvar::new(),
            stopped: std::sync::atomic::AtomicBool::new(false),
            progress,
            timings,
        }
    }

    fn stopped(&self) -> bool {
        self.stopped.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TurnState<'o, W>> {
        // A worker that panicked holding the lock has set `stopped` first
        // (see stop_on_unwind); the state is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stop(&self, state: &mut TurnState<'o, W>, outcome: Result<u64>) {
        state.outcome.get_or_insert(outcome);
        self.stopped
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.turn.notify_all();
    }

    /// Hands in a finished segment. If it is not its turn yet and the
    /// worker `may_leave` it (its buffer belongs to a pool, not to the
    /// worker), it is kept for whoever writes the segment before it, and the
    /// worker goes on; otherwise the worker waits for its turn. The worker
    /// whose turn it is writes its segment and then every kept one that
    /// follows it in order.
    fn hand_in(&self, chunk: Chunk, outcome: Outcome, may_leave: bool) -> Handed {
        let mut state = self.lock();
        if may_leave && state.next != chunk.index && state.outcome.is_none() {
            state.pending.insert(chunk.index, (chunk, outcome));
            return Handed::Go(Vec::new());
        }
        while state.next != chunk.index && state.outcome.is_none() {
            state = self.turn.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        let mut spent = Vec::new();
        let mut item = Some((chunk, outcome));
        while let Some((chunk, outcome)) = item.take() {
            if state.outcome.is_some() || !self.write_one(&mut state, &chunk, outcome) {
                return Handed::Stop;
            }
            spent.push(chunk.buf);
            let next = state.next;
            item = state.pending.remove(&next);
        }
        self.turn.notify_all();
        Handed::Go(spent)
    }

    /// Writes the segment whose turn it is (or, if it failed, stops the
    /// run). Returns whether to go on.
    fn write_one(&self, state: &mut TurnState<'o, W>, chunk: &Chunk, outcome: Outcome) -> bool {
        let timings = self.timings;
        let written = outcome.and_then(|(range, plain)| {
            timed(timings, Step::Write, || {
                state.output.write_all(&chunk.buf[range])
            })?;
            Ok(plain)
        });
        match written {
            Ok(plain) => {
                state.total += plain;
                if let Some(progress) = self.progress {
                    progress(state.total);
                }
                state.next += 1;
                if chunk.last {
                    let total = state.total;
                    self.stop(state, Ok(total));
                    return false;
                }
                true
            }
            Err(e) => {
                self.stop(state, Err(e));
                false
            }
        }
    }

    /// Runs `work`, stopping the run if it panics so that no other worker
    /// waits for a turn that will never come; the panic then goes on.
    fn stop_on_unwind(&self, work: impl FnOnce() -> Result<()>) -> Result<()> {
        struct Guard<'t, 'o, W: Write>(&'t Turns<'o, W>);
        impl<W: Write> Drop for Guard<'_, '_, W> {
            fn drop(&mut self) {
                if std::thread::panicking() {
                    let turns = self.0;
                    let mut state = turns.lock();
                    let stopped = Error::Backend("worker thread panicked".into());
                    turns.stop(&mut state, Err(stopped));
                }
            }
        }
        let _guard = Guard(self);
        work()
    }

    /// The run's result: the total once the last segment is written, else
    /// the first failure (a failed segment before a worker's own error, as
    /// the segment's is the cause).
    fn finish(self, worker_error: Option<Error>) -> Result<u64> {
        let state = self.state.into_inner().unwrap_or_else(|p| p.into_inner());
        match (state.outcome, worker_error) {
            (Some(outcome), _) => outcome,
            (None, Some(e)) => Err(e),
            (None, None) => Err(Error::Io(io::Error::other(
                "segment pipeline stopped early",
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::GcmKey;
    use crate::segment::{Mode, Params};

    /// A reader of `len` bytes that records the largest slice it was asked
    /// to fill.
    struct Recording {
        left: usize,
        largest: usize,
    }

    impl Read for Recording {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.largest = self.largest.max(buf.len());
            let n = buf.len().min(self.left);
            buf[..n].fill(7);
            self.left -= n;
            Ok(n)
        }
    }

    /// Whether segment 0 may go on, and the segments sealed before it may.
    type Held = Arc<(std::sync::Mutex<(bool, Vec<u32>)>, std::sync::Condvar)>;

    /// A backend whose GCM keys hold up the seal of segment 0 until told,
    /// and log which segments they sealed while it was held up.
    struct HoldFirst {
        inner: Arc<dyn Backend>,
        held: Held,
    }

    struct HoldFirstKey {
        inner: Box<dyn GcmKey>,
        held: Held,
    }

    impl GcmKey for HoldFirstKey {
        fn seal(&mut self, nonce: &[u8; 12], aad: &[u8], buf: &mut Vec<u8>) -> Result<()> {
            let index = u32::from_be_bytes([nonce[7], nonce[8], nonce[9], nonce[10]]);
            let (lock, cvar) = &*self.held;
            let mut state = lock.lock().unwrap();
            if index == 0 {
                // Held until the others can go no further (or 10 s).
                let deadline = Instant::now() + Duration::from_secs(10);
                while !state.0 && Instant::now() < deadline {
                    state = cvar
                        .wait_timeout(state, Duration::from_millis(20))
                        .unwrap()
                        .0;
                }
            } else if !state.0 {
                state.1.push(index);
            }
            drop(state);
            self.inner.seal(nonce, aad, buf)
        }

        fn open(
            &mut self,
            nonce: &[u8; 12],
            aad: &[u8],
            buf: &mut [u8],
        ) -> std::result::Result<usize, crate::backend::AuthFailed> {
            self.inner.open(nonce, aad, buf)
        }
    }

    impl Backend for HoldFirst {
        fn name(&self) -> &'static str {
            self.inner.name()
        }
        fn gcm(&self, key: &[u8]) -> Result<Box<dyn GcmKey>> {
            Ok(Box::new(HoldFirstKey {
                inner: self.inner.gcm(key)?,
                held: self.held.clone(),
            }))
        }
        fn cbc(&self, key: &[u8]) -> Result<Box<dyn crate::backend::CbcKey>> {
            self.inner.cbc(key)
        }
        fn hmac(&self, hash: crate::backend::Hash, key: &[u8], parts: &[&[u8]]) -> Result<Vec<u8>> {
            self.inner.hmac(hash, key, parts)
        }
        fn hkdf_sha256(&self, ikm: &[u8], salt: &[u8], info: &[u8], out: &mut [u8]) -> Result<()> {
            self.inner.hkdf_sha256(ikm, salt, info, out)
        }
    }

    /// While one worker is held up on a segment of a regular file, the
    /// others go on with the next segments, as far as the spare buffers
    /// allow and no further; the output is the same as a sequential run's.
    #[test]
    fn a_held_up_worker_does_not_hold_up_the_others_of_a_file() {
        let params = Params::new(Mode::Gcm, 256)
            .unwrap()
            .with_segment_size(4096)
            .unwrap();
        let layout = Layout::new(&params).unwrap();
        let inner = crate::backend::all().remove(0);
        let held: Held = Arc::new((
            std::sync::Mutex::new((false, Vec::new())),
            std::sync::Condvar::new(),
        ));
        let backend: Arc<dyn Backend> = Arc::new(HoldFirst {
            inner: inner.clone(),
            held: held.clone(),
        });
        let keys = FileKeys::from_material(layout, &[9u8; 32], [3u8; NONCE_PREFIX_LEN]).unwrap();
        let plain: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&plain).unwrap();
        // Lets segment 0 go once the others have stopped sealing for a
        // while (they are waiting for a buffer): no new segment in three
        // looks 200 ms apart, so that a worker a loaded machine leaves
        // unscheduled for a moment is not taken for one that waits.
        let release = {
            let held = held.clone();
            std::thread::spawn(move || {
                let (lock, cvar) = &*held;
                let mut seen = usize::MAX;
                let mut still = 0;
                loop {
                    std::thread::sleep(Duration::from_millis(200));
                    let mut state = lock.lock().unwrap();
                    still = if state.1.len() == seen { still + 1 } else { 0 };
                    if still == 3 {
                        state.0 = true;
                        cvar.notify_all();
                        return;
                    }
                    seen = state.1.len();
                }
            })
        };
        let mut sealed = Vec::new();
        let opts = StreamOptions::parallel(2);
        let n = run_file(
            Direction::Seal,
            &backend,
            &keys,
            &file,
            0,
            plain.len() as u64,
            &mut sealed,
            &opts,
        )
        .unwrap();
        release.join().unwrap();
        assert_eq!(n, plain.len() as u64);
        let while_held = held.0.lock().unwrap().1.clone();
        // Its own buffer and the spares, and no more.
        assert_eq!(
            while_held.len(),
            1 + REGION_SPARES,
            "while segment 0 was held up, the other worker sealed {while_held:?}"
        );
        let mut expected = Vec::new();
        run(
            Direction::Seal,
            &inner,
            &keys,
            &mut &plain[..],
            &mut expected,
            &StreamOptions::sequential(),
        )
        .unwrap();
        assert!(
            sealed == expected,
            "the output differs from a sequential run's"
        );
    }

    /// A 16 KiB input cut into 1 MiB segments is read into a buffer that
    /// grows with it: a short run does not zero (and fault in) a whole
    /// segment it never fills.
    #[test]
    fn a_small_input_does_not_touch_a_whole_segment() {
        let mut input = Recording {
            left: 16 << 10,
            largest: 0,
        };
        let mut chunker = Chunker::new(&mut input);
        let chunk = chunker
            .next(Vec::new(), 0, 1 << 20)
            .unwrap()
            .expect("one chunk");
        assert!(chunk.last);
        assert_eq!(chunk.buf.len(), 16 << 10);
        assert!(chunk.buf.iter().all(|&b| b == 7));
        assert!(chunker.next(Vec::new(), 0, 1 << 20).unwrap().is_none());
        assert!(
            input.largest <= 64 << 10,
            "asked to fill {} bytes at once",
            input.largest
        );
    }

    /// With the input's length known, a small input zeroes its own length
    /// and one byte (the look-ahead), not [`FIRST_FILL`].
    #[test]
    fn a_length_hint_zeroes_only_the_input() {
        for len in [0usize, 1, 4096, 40_000] {
            let data = vec![9u8; len];
            let mut input = &data[..];
            let mut chunker = Chunker::with_len_hint(&mut input, len as u64);
            let chunk = chunker
                .next(Vec::new(), AES_BLOCK, 1 << 20)
                .unwrap()
                .expect("one chunk");
            assert!(chunk.last, "len {len}");
            assert_eq!(chunk.buf.len(), AES_BLOCK + len);
            assert!(
                chunk.buf.capacity() <= AES_BLOCK + len + 1 + 64,
                "len {len}: room for {} bytes",
                chunk.buf.capacity()
            );
        }
    }

    /// Inputs around the growth steps and the segment size come out whole,
    /// in segments of the requested size, with the right last flag.
    #[test]
    fn growing_reads_cut_segments_exactly() {
        let seg = 1 << 20;
        for len in [
            0,
            1,
            FIRST_FILL - 1,
            FIRST_FILL,
            FIRST_FILL + 1,
            4 * FIRST_FILL + 3,
            seg - 1,
            seg,
            seg + 1,
            2 * seg + FIRST_FILL,
        ] {
            // No hint, the right one, and hints a file that changed size
            // would give (shorter and longer than the input).
            let hints = [None, Some(len), Some(len / 2), Some(len + 5000)];
            for (reserve, hint) in [0, AES_BLOCK]
                .into_iter()
                .flat_map(|r| hints.map(|h| (r, h)))
            {
                let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
                let mut input = &data[..];
                let mut chunker = match hint {
                    None => Chunker::new(&mut input),
                    Some(h) => Chunker::with_len_hint(&mut input, h as u64),
                };
                let mut got = Vec::new();
                let mut buf = Vec::new();
                let mut lasts = Vec::new();
                while let Some(chunk) = chunker.next(buf, reserve, seg).unwrap() {
                    let body = &chunk.buf[reserve..];
                    assert!(body.len() <= seg);
                    if !chunk.last {
                        assert_eq!(body.len(), seg, "len {len}: short middle segment");
                    }
                    got.extend_from_slice(body);
                    lasts.push(chunk.last);
                    buf = chunk.buf;
                }
                assert_eq!(got, data, "len {len} reserve {reserve} hint {hint:?}");
                assert_eq!(lasts.iter().filter(|&&l| l).count(), 1);
                assert!(lasts.last().copied().unwrap_or(false));
            }
        }
    }
}
