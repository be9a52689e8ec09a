//! An in-memory pipe for plaintext between a decryption and an
//! encryption running at once (`rekey`): the plaintext never touches a
//! disk, and every buffer that held it is zeroized when dropped. Bounded,
//! so a fast side waits for a slow one in constant memory.
//!
//! The reader sees the end of the stream only when the writer said it was
//! complete ([`PipeWriter::finish`]); a writer dropped without it (its
//! decryption failed) is an error for the reader, so a truncated plaintext
//! is never sealed as a complete file.

use std::io::{self, Read, Write};

use crossbeam_channel::{bounded, Receiver, Sender};
use zeroize::Zeroizing;

enum Msg {
    Data(Zeroizing<Vec<u8>>),
    End,
}

/// The writing end.
pub struct PipeWriter {
    tx: Option<Sender<Msg>>,
    /// Buffers the reader is done with, to be filled again (a fresh
    /// buffer per write would cost a page fault per page of plaintext).
    free: Receiver<Zeroizing<Vec<u8>>>,
}

/// The reading end.
pub struct PipeReader {
    rx: Receiver<Msg>,
    free: Sender<Zeroizing<Vec<u8>>>,
    current: Zeroizing<Vec<u8>>,
    at: usize,
    ended: bool,
}

/// A pipe holding at most `depth` writes in flight.
pub fn pipe(depth: usize) -> (PipeWriter, PipeReader) {
    let (tx, rx) = bounded(depth.max(1));
    // Every buffer is in the pipe, being read, or free: at most depth + 2.
    let (free_tx, free_rx) = bounded(depth.max(1) + 2);
    (
        PipeWriter {
            tx: Some(tx),
            free: free_rx,
        },
        PipeReader {
            rx,
            free: free_tx,
            current: Zeroizing::new(Vec::new()),
            at: 0,
            ended: false,
        },
    )
}

fn reader_gone() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "the encryption stopped")
}

impl PipeWriter {
    /// Marks the stream complete: the reader then sees its end.
    pub fn finish(mut self) -> io::Result<()> {
        match self.tx.take() {
            Some(tx) => tx.send(Msg::End).map_err(|_| reader_gone()),
            None => Err(reader_gone()),
        }
    }
}

impl Write for PipeWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let tx = self.tx.as_ref().ok_or_else(reader_gone)?;
        let mut data = self
            .free
            .try_recv()
            .unwrap_or_else(|_| Zeroizing::new(Vec::new()));
        data.clear();
        data.extend_from_slice(buf);
        tx.send(Msg::Data(data)).map_err(|_| reader_gone())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for PipeReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.at == self.current.len() {
            if self.ended || buf.is_empty() {
                return Ok(0);
            }
            match self.rx.recv() {
                Ok(Msg::Data(d)) => {
                    let done = std::mem::replace(&mut self.current, d);
                    // Zeroized when dropped, here or by the writer.
                    let _ = self.free.try_send(done);
                    self.at = 0;
                }
                Ok(Msg::End) => self.ended = true,
                Err(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the decryption stopped before the end of the file",
                    ))
                }
            }
        }
        let n = buf.len().min(self.current.len() - self.at);
        buf[..n].copy_from_slice(&self.current[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_flows_and_ends_only_when_finished() {
        let (mut w, mut r) = pipe(2);
        let t = std::thread::spawn(move || {
            w.write_all(b"hello ").unwrap();
            w.write_all(b"world").unwrap();
            w.finish().unwrap();
        });
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        t.join().unwrap();
        assert_eq!(got, b"hello world");
    }

    #[test]
    fn a_writer_dropped_unfinished_is_an_error_not_an_end() {
        let (mut w, mut r) = pipe(2);
        w.write_all(b"partial").unwrap();
        drop(w);
        let mut got = Vec::new();
        let err = r.read_to_end(&mut got).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn a_reader_gone_fails_the_writer() {
        let (mut w, r) = pipe(1);
        drop(r);
        assert_eq!(w.write(b"x").unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }
}
