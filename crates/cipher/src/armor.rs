//! ASCII armor: a tpmcrypt file as strict PEM-style text, as `age` has it.
//!
//! ```text
//! -----BEGIN TPMCRYPT ENCRYPTED FILE-----
//! iVRQTUMNChoBAS...   (base64 of the binary file, 64 columns a line)
//! ...
//! AAECAw==            (the last line: 1 to 64 columns, padded)
//! -----END TPMCRYPT ENCRYPTED FILE-----
//! ```
//!
//! [`ArmoredWriter`] armors what is written to it (wrap it around the output
//! of [`Encryptor::encrypt`] or [`Encryptor::wrap_output`]);
//! [`ArmoredReader`] takes either form and yields the binary file: armored
//! input is decoded, binary input is passed through. Both hold one line at
//! a time (plus a fixed buffer), whatever the length of the stream.
//!
//! The reader is strict, as the age specification is (RFC 7468's strict
//! form): nothing but whitespace (space, tab, CR, LF) before the BEGIN line
//! or after the END line; lines end in LF or CRLF, the one the BEGIN line
//! uses, throughout; every data line has exactly 64 columns except the last,
//! which has 1 to 64; standard base64 with padding, canonical (no stray bits
//! in the last character, padding only at the very end); at least one data
//! line. Anything else is an [`ArmorError`], which reaches callers of
//! [`Decryptor::decrypt_any_file`] as [`Error::Armor`] (an integrity
//! error), and readers of [`ArmoredReader`] as an `io::Error` of kind
//! `InvalidData` that [`armor_error`] finds.
//!
//! **Detection is unambiguous.** A binary tpmcrypt file starts with the
//! magic byte 0x89 ([`crate::format::MAGIC`]), never with `-` or
//! whitespace; an armored file starts with `-` or whitespace, never with
//! 0x89. So the first byte decides: `-` or whitespace is armor (and must be
//! exactly that), anything else is passed through as binary (and must then
//! be a binary tpmcrypt file). A file that merely starts with "-----BEGIN"
//! is never taken for binary ciphertext, nor binary ciphertext for armor.
//!
//! ```
//! use std::io::{Read, Write};
//! use tpmcrypt_cipher::armor::{ArmoredReader, ArmoredWriter};
//!
//! let mut w = ArmoredWriter::new(Vec::new());
//! w.write_all(&[0x89, b'T', b'P', b'M', b'C'])?;
//! let text = w.finish()?;
//! assert_eq!(
//!     std::str::from_utf8(&text)?,
//!     "-----BEGIN TPMCRYPT ENCRYPTED FILE-----\niVRQTUM=\n-----END TPMCRYPT ENCRYPTED FILE-----\n"
//! );
//! let mut back = Vec::new();
//! ArmoredReader::new(&text[..]).read_to_end(&mut back)?;
//! assert_eq!(back, [0x89, b'T', b'P', b'M', b'C']);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`Encryptor::encrypt`]: crate::Encryptor::encrypt
//! [`Encryptor::wrap_output`]: crate::Encryptor::wrap_output

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::ops::Range;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;

use crate::error::{Error, Result};
use crate::format::Header;
use crate::session::{Decryptor, Encryptor};
use crate::stream::StreamOptions;

/// The first line of an armored file.
pub const BEGIN: &str = "-----BEGIN TPMCRYPT ENCRYPTED FILE-----";
/// The last line of an armored file.
pub const END: &str = "-----END TPMCRYPT ENCRYPTED FILE-----";
/// Base64 columns of every data line but the last.
pub const COLUMNS: usize = 64;
/// Binary bytes a full data line holds.
const LINE_BYTES: usize = COLUMNS / 4 * 3;
/// The longest line the reader takes in before it gives up on it: a data
/// line, CR, LF (the BEGIN and END lines are shorter).
const MAX_LINE: usize = COLUMNS + 2;
/// The writer hands its text to the inner writer in pieces of about this.
const WRITE_CHUNK: usize = 64 << 10;

/// What is wrong with an armored input. Line numbers count from 1, the
/// BEGIN line included.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArmorError {
    /// It starts like armor (`-` or whitespace) but not with the BEGIN line.
    #[error("not a tpmcrypt file (starts like ASCII armor, but not with \"{BEGIN}\")")]
    NoBegin,
    /// A line holds a byte that is not base64, or base64 that is not
    /// canonical (wrong padding, stray bits).
    #[error("ASCII armor line {0}: invalid base64")]
    BadBase64(u64),
    /// A data line longer than 64 columns.
    #[error("ASCII armor line {0}: longer than 64 columns")]
    LongLine(u64),
    /// A data line follows one that was shorter than 64 columns (or
    /// padded), which can only be the last.
    #[error("ASCII armor line {0}: data after a line shorter than 64 columns (only the last line may be short)")]
    ShortLine(u64),
    /// An empty line among the data lines.
    #[error("ASCII armor line {0}: empty line")]
    EmptyLine(u64),
    /// A line ends in LF where the BEGIN line ended in CRLF, or the other
    /// way round.
    #[error("ASCII armor line {0}: mixed line endings (LF and CRLF)")]
    MixedLineEndings(u64),
    /// A line that starts like the END line but is not it.
    #[error("ASCII armor line {0}: malformed END line")]
    BadEnd(u64),
    /// The END line comes right after the BEGIN line.
    #[error("ASCII armor holds no data")]
    NoData,
    /// The input ends before the END line.
    #[error("truncated: the ASCII armor ends without its END line")]
    MissingEnd,
    /// Something other than whitespace follows the END line.
    #[error("data after the END line of the ASCII armor")]
    TrailingData,
}

impl From<ArmorError> for io::Error {
    fn from(e: ArmorError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// The armor error an `io::Error` from [`ArmoredReader`] carries, if any.
pub fn armor_error(e: &io::Error) -> Option<&ArmorError> {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<ArmorError>())
}

/// A cipher error with an armor failure that travelled as an I/O error
/// brought back to [`Error::Armor`].
pub fn lift(e: Error) -> Error {
    match e {
        Error::Io(io) => match armor_error(&io) {
            Some(a) => Error::Armor(a.clone()),
            None => Error::Io(io),
        },
        other => other,
    }
}

/// Whitespace allowed around the armor.
fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\r' | b'\n')
}

/// Whether an input whose first byte is `first` is to be read as armor
/// (see the module documentation: the first byte decides).
pub fn starts_armor(first: u8) -> bool {
    first == b'-' || is_space(first)
}

/// Whether `file`, from its current position, starts like armor. Reads
/// one byte positionally, so the position is unchanged; an empty file is
/// not armor.
pub fn file_starts_armor(file: &File) -> io::Result<bool> {
    use std::io::Seek as _;
    use std::os::unix::fs::FileExt as _;
    let pos = (&*file).stream_position()?;
    let mut one = [0u8; 1];
    loop {
        match file.read_at(&mut one, pos) {
            Ok(0) => return Ok(false),
            Ok(_) => return Ok(starts_armor(one[0])),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// The header of the tpmcrypt file `file`, binary or armored, read from
/// its current position, and whether it was armored.
pub fn read_any_header(file: &File) -> Result<(Header, bool)> {
    if file_starts_armor(file)? {
        let header = Header::read_from(&mut ArmoredReader::new(file)).map_err(lift)?;
        Ok((header, true))
    } else {
        Ok((Header::read_from(&mut &*file)?, false))
    }
}

/// Armors everything written to it onto `W`: the BEGIN line now, 64-column
/// base64 lines as the bytes come, and the last line and the END line at
/// [`ArmoredWriter::finish`], which must be called (a writer dropped
/// without it leaves armor with no END line, which fails to decrypt).
/// Lines end in LF.
pub struct ArmoredWriter<W: Write> {
    inner: W,
    /// Bytes of a line not full yet.
    partial: [u8; LINE_BYTES],
    partial_len: usize,
    /// Text not handed to `inner` yet.
    text: Vec<u8>,
    failed: bool,
}

impl<W: Write> ArmoredWriter<W> {
    /// A writer armoring onto `inner`.
    pub fn new(inner: W) -> Self {
        let mut text = Vec::with_capacity(WRITE_CHUNK + COLUMNS + 1);
        text.extend_from_slice(BEGIN.as_bytes());
        text.push(b'\n');
        ArmoredWriter {
            inner,
            partial: [0; LINE_BYTES],
            partial_len: 0,
            text,
            failed: false,
        }
    }

    /// Appends one encoded line of at most 48 bytes to the text.
    fn line(text: &mut Vec<u8>, bytes: &[u8]) {
        let at = text.len();
        text.resize(at + COLUMNS, 0);
        let n = STANDARD
            .encode_slice(bytes, &mut text[at..])
            .unwrap_or_default();
        text.truncate(at + n);
        text.push(b'\n');
    }

    /// Hands the text to the inner writer.
    fn drain(&mut self) -> io::Result<()> {
        if self.text.is_empty() {
            return Ok(());
        }
        self.failed = true;
        self.inner.write_all(&self.text)?;
        self.text.clear();
        self.failed = false;
        Ok(())
    }

    /// Writes the last line and the END line, flushes, and returns the
    /// inner writer.
    pub fn finish(mut self) -> io::Result<W> {
        if self.failed {
            return Err(poisoned());
        }
        if self.partial_len > 0 {
            Self::line(&mut self.text, &self.partial[..self.partial_len]);
        }
        self.text.extend_from_slice(END.as_bytes());
        self.text.push(b'\n');
        self.drain()?;
        self.inner.flush()?;
        Ok(self.inner)
    }
}

fn poisoned() -> io::Error {
    io::Error::other("the ASCII armor stream failed earlier")
}

impl<W: Write> Write for ArmoredWriter<W> {
    fn write(&mut self, mut data: &[u8]) -> io::Result<usize> {
        if self.failed {
            return Err(poisoned());
        }
        let given = data.len();
        if self.partial_len > 0 {
            let n = data.len().min(LINE_BYTES - self.partial_len);
            self.partial[self.partial_len..self.partial_len + n].copy_from_slice(&data[..n]);
            self.partial_len += n;
            data = &data[n..];
            if self.partial_len < LINE_BYTES {
                return Ok(given);
            }
            Self::line(&mut self.text, &self.partial);
            self.partial_len = 0;
        }
        let mut lines = data.chunks_exact(LINE_BYTES);
        for full in &mut lines {
            Self::line(&mut self.text, full);
            if self.text.len() >= WRITE_CHUNK {
                self.drain()?;
            }
        }
        let rest = lines.remainder();
        self.partial[..rest.len()].copy_from_slice(rest);
        self.partial_len = rest.len();
        if self.text.len() >= WRITE_CHUNK {
            self.drain()?;
        }
        Ok(given)
    }

    /// Hands complete lines to the inner writer and flushes it; a part of a
    /// line stays buffered until the line is full or
    /// [`ArmoredWriter::finish`].
    fn flush(&mut self) -> io::Result<()> {
        if self.failed {
            return Err(poisoned());
        }
        self.drain()?;
        self.inner.flush()
    }
}

/// Reads a tpmcrypt file in either form and yields the binary file: armor
/// is decoded (strictly, see the module documentation), anything else is
/// passed through untouched. The input is read through a 64 KiB buffer;
/// the decoder holds one line.
pub struct ArmoredReader<R: Read> {
    inner: BufReader<R>,
    state: ReadState,
    /// Decoded bytes not returned yet.
    decoded: [u8; LINE_BYTES],
    ready: Range<usize>,
    /// The line being read.
    line: [u8; MAX_LINE + 1],
    /// The number of the last line read.
    line_no: u64,
    /// An error found after bytes were returned: the next read's.
    error: Option<io::Error>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ReadState {
    /// Nothing read yet.
    Detect,
    /// Not armor: passed through.
    Binary,
    /// Data lines; `crlf`: lines end in CRLF; `last`: the previous line was
    /// short or padded, so only the END line may follow; `lines`: data
    /// lines so far.
    Armored { crlf: bool, last: bool, lines: u64 },
    /// The END line and the whitespace after it were read.
    Done,
    /// An error was returned: every later read fails.
    Failed,
}

/// One line as read: its length in the line buffer (without LF), and
/// whether it ended in LF (or else at the end of the input).
struct Line {
    len: usize,
    lf: bool,
}

impl<R: Read> ArmoredReader<R> {
    /// A reader over `inner`; nothing is read until the first read.
    pub fn new(inner: R) -> Self {
        ArmoredReader {
            inner: BufReader::with_capacity(64 << 10, inner),
            state: ReadState::Detect,
            decoded: [0; LINE_BYTES],
            ready: 0..0,
            line: [0; MAX_LINE + 1],
            line_no: 0,
            error: None,
        }
    }

    /// Whether the input turned out to be armor (false before the first
    /// read, and for binary input).
    pub fn is_armored(&self) -> bool {
        matches!(self.state, ReadState::Armored { .. } | ReadState::Done)
    }

    /// Whether the whole input was read: the END line and what follows it
    /// for armor, the end of the input for binary.
    pub fn at_end(&mut self) -> io::Result<bool> {
        Ok(match self.state {
            ReadState::Done => true,
            ReadState::Binary => self.inner.fill_buf()?.is_empty(),
            _ => false,
        })
    }

    /// Reads the next line into `self.line`, at most [`MAX_LINE`] bytes
    /// before its LF (one more means too long).
    fn read_line(&mut self) -> io::Result<Line> {
        let mut len = 0;
        loop {
            let buf = self.inner.fill_buf()?;
            if buf.is_empty() {
                return Ok(Line { len, lf: false });
            }
            let room = MAX_LINE + 1 - len;
            let take = buf.len().min(room);
            if let Some(at) = buf[..take].iter().position(|&b| b == b'\n') {
                self.line[len..len + at].copy_from_slice(&buf[..at]);
                self.inner.consume(at + 1);
                return Ok(Line {
                    len: len + at,
                    lf: true,
                });
            }
            self.line[len..len + take].copy_from_slice(&buf[..take]);
            self.inner.consume(take);
            len += take;
            if len > MAX_LINE {
                return Ok(Line { len, lf: false });
            }
        }
    }

    /// Skips leading whitespace and reads the BEGIN line, or decides the
    /// input is binary.
    fn detect(&mut self) -> io::Result<()> {
        let first = self.inner.fill_buf()?.first().copied();
        if !first.is_some_and(starts_armor) {
            self.state = ReadState::Binary;
            return Ok(());
        }
        loop {
            let buf = self.inner.fill_buf()?;
            let spaces = buf.iter().take_while(|&&b| is_space(b)).count();
            let more = spaces == buf.len() && !buf.is_empty();
            self.inner.consume(spaces);
            if !more {
                break;
            }
        }
        let line = self.read_line()?;
        self.line_no = 1;
        let text = &self.line[..line.len];
        let crlf = text.ends_with(b"\r");
        let text = text.strip_suffix(b"\r").unwrap_or(text);
        if !line.lf || text != BEGIN.as_bytes() {
            return Err(ArmorError::NoBegin.into());
        }
        self.state = ReadState::Armored {
            crlf,
            last: false,
            lines: 0,
        };
        Ok(())
    }

    /// Reads the next line of the armor: decodes a data line into
    /// `self.decoded`, or takes the END line and checks what follows.
    fn next_line(&mut self, crlf: bool, last: bool, lines: u64) -> io::Result<()> {
        if !last && self.full_line_at_hand(crlf) {
            self.state = ReadState::Armored {
                crlf,
                last: self.ready.len() < LINE_BYTES,
                lines: lines + 1,
            };
            return Ok(());
        }
        let line = self.read_line()?;
        self.line_no += 1;
        let no = self.line_no;
        if line.len > MAX_LINE {
            return Err(ArmorError::LongLine(no).into());
        }
        if line.len == 0 && !line.lf {
            return Err(ArmorError::MissingEnd.into());
        }
        let raw = &self.line[..line.len];
        let text = match (crlf, raw.strip_suffix(b"\r")) {
            (true, Some(t)) => t,
            (false, None) => raw,
            // The END line may end the input without a line ending.
            (true, None) if !line.lf && raw == END.as_bytes() => raw,
            _ => return Err(ArmorError::MixedLineEndings(no).into()),
        };
        if text == END.as_bytes() {
            if lines == 0 {
                return Err(ArmorError::NoData.into());
            }
            return self.trailing();
        }
        if text.starts_with(b"-----") {
            return Err(if line.lf {
                ArmorError::BadEnd(no)
            } else {
                ArmorError::MissingEnd
            }
            .into());
        }
        if !line.lf {
            return Err(ArmorError::MissingEnd.into());
        }
        if last {
            return Err(ArmorError::ShortLine(no).into());
        }
        if text.is_empty() {
            return Err(ArmorError::EmptyLine(no).into());
        }
        if text.len() > COLUMNS {
            return Err(ArmorError::LongLine(no).into());
        }
        let n = STANDARD
            .decode_slice(text, &mut self.decoded)
            .map_err(|_| ArmorError::BadBase64(no))?;
        self.ready = 0..n;
        self.state = ReadState::Armored {
            crlf,
            last: text.len() < COLUMNS || n < LINE_BYTES,
            lines: lines + 1,
        };
        Ok(())
    }

    /// The common case, without copying the line: a 64-column line of
    /// valid base64 and its line ending already in the buffer, decoded into
    /// `self.decoded`. Anything else (false) takes the general path, which
    /// accepts no more than this does and names what is wrong.
    fn full_line_at_hand(&mut self, crlf: bool) -> bool {
        let width = COLUMNS + 1 + usize::from(crlf);
        let buf = self.inner.buffer();
        if buf.len() < width || buf[width - 1] != b'\n' || (crlf && buf[COLUMNS] != b'\r') {
            return false;
        }
        let Ok(n) = STANDARD.decode_slice(&buf[..COLUMNS], &mut self.decoded) else {
            return false;
        };
        self.inner.consume(width);
        self.line_no += 1;
        self.ready = 0..n;
        true
    }

    /// After the END line: whitespace only, to the end of the input.
    fn trailing(&mut self) -> io::Result<()> {
        loop {
            let buf = self.inner.fill_buf()?;
            if buf.is_empty() {
                self.state = ReadState::Done;
                return Ok(());
            }
            if !buf.iter().all(|&b| is_space(b)) {
                return Err(ArmorError::TrailingData.into());
            }
            let n = buf.len();
            self.inner.consume(n);
        }
    }

    /// One step of the state machine; an error leaves it failed.
    fn step(&mut self) -> io::Result<()> {
        let state = self.state;
        self.state = ReadState::Failed;
        let r = match state {
            ReadState::Detect => self.detect(),
            ReadState::Armored { crlf, last, lines } => self.next_line(crlf, last, lines),
            other => {
                self.state = other;
                Ok(())
            }
        };
        if r.is_err() {
            self.state = ReadState::Failed;
        }
        r
    }
}

impl<R: Read> Read for ArmoredReader<R> {
    /// Fills `out` with as many decoded lines as are at hand (a read blocks
    /// only when it has nothing to return yet). An armor error after some
    /// bytes were returned is the next read's error.
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let mut n = 0;
        while n < out.len() {
            if !self.ready.is_empty() {
                let k = (out.len() - n).min(self.ready.len());
                out[n..n + k]
                    .copy_from_slice(&self.decoded[self.ready.start..self.ready.start + k]);
                self.ready.start += k;
                n += k;
                continue;
            }
            let more_at_hand = !self.inner.buffer().is_empty();
            match self.state {
                ReadState::Binary if n == 0 => return self.inner.read(out),
                ReadState::Failed if n == 0 => {
                    return Err(self.error.take().unwrap_or_else(poisoned))
                }
                ReadState::Detect | ReadState::Armored { .. } if n == 0 || more_at_hand => {
                    if let Err(e) = self.step() {
                        if n == 0 {
                            return Err(e);
                        }
                        self.error = Some(e);
                    }
                }
                _ => break,
            }
        }
        Ok(n)
    }
}

impl Encryptor {
    /// As [`Encryptor::encrypt_file`] (positional reads in parallel for a
    /// regular file), writing ASCII armor: the base64 is made on the way
    /// out, by the thread that writes.
    pub fn encrypt_file_armored<W: std::io::Write + Send>(
        &self,
        file: &File,
        output: W,
        opts: &StreamOptions<'_>,
    ) -> Result<u64> {
        let mut armored = ArmoredWriter::new(output);
        let n = self.encrypt_file(file, &mut armored, opts)?;
        armored.finish()?;
        Ok(n)
    }
}

impl Decryptor {
    /// Decrypts `file` from its current position, binary or armored (the
    /// first byte decides, see [`crate::armor`]). Binary input takes
    /// [`Decryptor::decrypt_file`] (positional reads in parallel for a
    /// regular file); armor is decoded on the way, by the streaming path,
    /// in constant memory. An armor failure is [`Error::Armor`].
    pub fn decrypt_any_file<W: std::io::Write + Send>(
        &self,
        file: &File,
        output: W,
        opts: &StreamOptions<'_>,
    ) -> Result<u64> {
        let regular = file.metadata()?.file_type().is_file();
        if regular && !file_starts_armor(file)? {
            return self.decrypt_file(file, output, opts);
        }
        let mut input = ArmoredReader::new(file);
        let n = self.decrypt(&mut input, output, opts).map_err(lift)?;
        // The engine reads to the end of its input; a stream that had more
        // would have failed above. Checked anyway: nothing may follow.
        if !input.at_end().map_err(|e| lift(e.into()))? {
            return Err(Error::Armor(ArmorError::TrailingData));
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests;
