//! `Read` and `Write` adapters over the segment primitive, as the `age`
//! crate offers them: [`StreamWriter`] (from [`Encryptor::wrap_output`])
//! encrypts what is written to it, [`StreamReader`] (from
//! [`Decryptor::unwrap_input`]) decrypts what is read from it.
//!
//! Both are sequential and hold one segment at a time, whatever the length
//! of the stream. The reader authenticates each segment before it returns
//! any of its bytes, so everything it returns is authentic; a truncated or
//! tampered stream is an [`std::io::Error`] of kind `InvalidData` that
//! carries the [`Error`] (see [`cipher_error`]). For throughput on many
//! cores, use [`Encryptor::encrypt`] and [`Decryptor::decrypt`], which run
//! the parallel engine and write the same bytes.
//!
//! ```
//! use std::io::{Read, Write};
//! use tpmcrypt_cipher::io::cipher_error;
//! use tpmcrypt_cipher::recovery::RecoveryKey;
//! use tpmcrypt_cipher::{Decryptor, Encryptor, Error, Mode, Params, Recipient};
//!
//! let key = RecoveryKey::generate(&mut rand_core::OsRng);
//! let to: Vec<Box<dyn Recipient>> = vec![Box::new(key.recipient()?)];
//! let params = Params::new(Mode::Cbc, 128)?.with_segment_size(4096)?;
//! let encryptor = Encryptor::new(&to, params)?;
//! let mut writer = encryptor.wrap_output(Vec::new())?;
//! for line in 0..1000 {
//!     writeln!(writer, "line {line}")?;
//! }
//! let mut file = writer.finish()?;
//!
//! let decryptor = Decryptor::new(vec![Box::new(key.into_identity()?)]);
//! let mut text = String::new();
//! decryptor.unwrap_input(&file[..])?.read_to_string(&mut text)?;
//! assert_eq!(text.lines().nth(999), Some("line 999"));
//!
//! // Cut off the last segment: reading fails, it does not end early.
//! file.truncate(file.len() - 100);
//! let err = decryptor
//!     .unwrap_input(&file[..])?
//!     .read_to_end(&mut Vec::new())
//!     .unwrap_err();
//! assert!(cipher_error(&err).is_some_and(Error::is_integrity));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`Encryptor::wrap_output`]: crate::Encryptor::wrap_output
//! [`Decryptor::unwrap_input`]: crate::Decryptor::unwrap_input
//! [`Encryptor::encrypt`]: crate::Encryptor::encrypt
//! [`Decryptor::decrypt`]: crate::Decryptor::decrypt

use std::io::{self, Read, Write};
use std::ops::Range;

use crate::backend::AES_BLOCK;
use crate::error::Error;
use crate::segment::{Direction, SegmentCrypter};
use crate::stream::Chunker;

/// The cipher error an adapter's `io::Error` carries, if it carries one.
pub fn cipher_error(e: &io::Error) -> Option<&Error> {
    e.get_ref().and_then(|inner| inner.downcast_ref::<Error>())
}

/// An `io::Error` for a cipher error: an I/O error is passed on as it is;
/// anything else (a failed or missing segment) is `InvalidData`.
fn to_io(e: Error) -> io::Error {
    match e {
        Error::Io(e) => e,
        other => io::Error::new(io::ErrorKind::InvalidData, other),
    }
}

/// The error returned by every call after one failed: a stream that went
/// wrong never looks finished.
fn poisoned() -> io::Error {
    io::Error::other("the encrypted stream failed earlier")
}

/// Encrypts everything written to it into a tpmcrypt file on `W`.
///
/// The header is written when the writer is made; each segment is sealed
/// and written once the next byte arrives (a segment's nonce says whether
/// it is the last). [`StreamWriter::finish`] must be called to seal the
/// last segment: a writer dropped without it leaves a file that fails to
/// decrypt as truncated.
pub struct StreamWriter<W: Write> {
    inner: W,
    crypter: SegmentCrypter,
    reserve: usize,
    buf: Vec<u8>,
    index: u64,
    failed: bool,
}

impl<W: Write> StreamWriter<W> {
    /// A writer sealing with `crypter` after the header already written.
    pub(crate) fn new(inner: W, crypter: SegmentCrypter) -> Self {
        let reserve = crypter.reserve();
        let mut buf = Vec::with_capacity(crypter.layout().segment_size + 2 * AES_BLOCK);
        buf.resize(reserve, 0);
        StreamWriter {
            inner,
            crypter,
            reserve,
            buf,
            index: 0,
            failed: false,
        }
    }

    /// Seals the buffered segment as segment `index` and writes it.
    fn seal_and_write(&mut self, last: bool) -> io::Result<()> {
        self.failed = true;
        self.crypter
            .seal(self.index, last, &mut self.buf)
            .map_err(to_io)?;
        self.inner.write_all(&self.buf)?;
        self.buf.clear();
        self.buf.resize(self.reserve, 0);
        self.index += 1;
        self.failed = false;
        Ok(())
    }

    /// Seals and writes the last segment, flushes, and returns the inner
    /// writer.
    pub fn finish(mut self) -> io::Result<W> {
        if self.failed {
            return Err(poisoned());
        }
        self.seal_and_write(true)?;
        self.inner.flush()?;
        Ok(self.inner)
    }
}

impl<W: Write> Write for StreamWriter<W> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.failed {
            return Err(poisoned());
        }
        if data.is_empty() {
            return Ok(0);
        }
        let full = self.crypter.layout().plaintext_segment_len(self.index);
        if self.buf.len() - self.reserve == full {
            // More is coming, so the buffered segment is not the last.
            self.seal_and_write(false)?;
        }
        let full = self.crypter.layout().plaintext_segment_len(self.index);
        let n = data.len().min(full - (self.buf.len() - self.reserve));
        self.buf.extend_from_slice(&data[..n]);
        Ok(n)
    }

    /// Flushes the inner writer; the buffered part of a segment stays
    /// buffered until the segment is full or [`StreamWriter::finish`].
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Decrypts a tpmcrypt payload read from `R`, one authenticated segment at
/// a time.
pub struct StreamReader<R: Read> {
    chunker: Chunker<R>,
    crypter: SegmentCrypter,
    buf: Vec<u8>,
    ready: Range<usize>,
    state: ReadState,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ReadState {
    Reading,
    Done,
    Failed,
}

impl<R: Read> StreamReader<R> {
    /// A reader opening with `crypter` the segments that follow the stream
    /// header in `inner`.
    pub(crate) fn new(inner: R, crypter: SegmentCrypter) -> Self {
        StreamReader {
            chunker: Chunker::new(inner),
            crypter,
            buf: Vec::new(),
            ready: 0..0,
            state: ReadState::Reading,
        }
    }

    /// Reads and opens the next segment into `buf`.
    fn open_next(&mut self) -> io::Result<()> {
        self.state = ReadState::Failed;
        let layout = self.crypter.layout();
        let want = layout.ciphertext_segment_len(self.chunker.index());
        let buf = std::mem::take(&mut self.buf);
        let Some(mut chunk) = self.chunker.next(buf, 0, want)? else {
            return Err(io::Error::other("read past the last segment"));
        };
        let outcome = crate::stream::process(Direction::Open, &mut self.crypter, &mut chunk);
        self.buf = chunk.buf;
        let (range, _) = outcome.map_err(to_io)?;
        self.ready = range;
        self.state = if chunk.last {
            ReadState::Done
        } else {
            ReadState::Reading
        };
        Ok(())
    }
}

impl<R: Read> Read for StreamReader<R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.ready.is_empty() {
            match self.state {
                ReadState::Done => return Ok(0),
                ReadState::Failed => return Err(poisoned()),
                ReadState::Reading => self.open_next()?,
            }
        }
        let n = out.len().min(self.ready.len());
        out[..n].copy_from_slice(&self.buf[self.ready.start..self.ready.start + n]);
        self.ready.start += n;
        Ok(n)
    }
}
