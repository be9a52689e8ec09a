//! Minimal, strict DER reader/writer for the `TSS2 PRIVATE KEY` structure.
//!
//! The key file format needs only a handful of universal types (SEQUENCE,
//! OID, BOOLEAN, INTEGER, OCTET STRING) plus context tags.  A tiny
//! hand-written codec keeps the parser auditable: every read is bounds
//! checked and returns an error, so malformed or hostile files (this parser
//! is fuzzed) can never panic or allocate based on an unchecked length.

/// Error produced by the DER layer; callers wrap it with context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DerError(pub String);

type DResult<T> = std::result::Result<T, DerError>;

fn err<T>(m: impl Into<String>) -> DResult<T> {
    Err(DerError(m.into()))
}

pub(crate) const TAG_BOOLEAN: u8 = 0x01;
pub(crate) const TAG_INTEGER: u8 = 0x02;
pub(crate) const TAG_OCTET_STRING: u8 = 0x04;
pub(crate) const TAG_OID: u8 = 0x06;
pub(crate) const TAG_UTF8_STRING: u8 = 0x0C;
pub(crate) const TAG_SEQUENCE: u8 = 0x30;

/// Tag byte of a constructed, context-specific `[n]` (explicit tagging).
pub(crate) const fn context(n: u8) -> u8 {
    0xA0 | n
}

/// A cursor over DER bytes.
pub(crate) struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Self {
        Reader { data, pos: 0 }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    /// Tag of the next element, without consuming it.
    pub(crate) fn peek_tag(&self) -> Option<u8> {
        self.data.get(self.pos).copied()
    }

    /// Reads one TLV, returning its tag and content.
    pub(crate) fn read_any(&mut self) -> DResult<(u8, &'a [u8])> {
        let rest = self.data.get(self.pos..).unwrap_or_default();
        let (&tag, rest) = match rest.split_first() {
            Some(x) => x,
            None => return err("unexpected end of data"),
        };
        if tag & 0x1F == 0x1F {
            return err("multi-byte tags are not supported");
        }
        let (&first, rest) = match rest.split_first() {
            Some(x) => x,
            None => return err("truncated length"),
        };
        let (len, len_bytes) = if first < 0x80 {
            (usize::from(first), 0usize)
        } else {
            let n = usize::from(first & 0x7F);
            if n == 0 {
                return err("indefinite length is not DER");
            }
            if n > 4 {
                return err("length too large");
            }
            let bytes = match rest.get(..n) {
                Some(b) => b,
                None => return err("truncated length"),
            };
            if bytes[0] == 0 {
                return err("non-minimal length encoding");
            }
            let mut len: usize = 0;
            for b in bytes {
                len = (len << 8) | usize::from(*b);
            }
            if len < 0x80 {
                return err("non-minimal length encoding");
            }
            (len, n)
        };
        let rest = &rest[len_bytes..];
        let content = match rest.get(..len) {
            Some(c) => c,
            None => return err("length exceeds available data"),
        };
        self.pos += 2 + len_bytes + len;
        Ok((tag, content))
    }

    /// Reads one TLV and checks its tag.
    pub(crate) fn read(&mut self, tag: u8) -> DResult<&'a [u8]> {
        let (t, c) = self.read_any()?;
        if t != tag {
            return err(format!("expected tag 0x{tag:02x}, found 0x{t:02x}"));
        }
        Ok(c)
    }

    pub(crate) fn read_bool(&mut self) -> DResult<bool> {
        match self.read(TAG_BOOLEAN)? {
            [0x00] => Ok(false),
            // DER requires 0xFF, but OpenSSL-based writers have been seen
            // emitting other non-zero values; accept any non-zero as TRUE.
            [_] => Ok(true),
            _ => err("BOOLEAN must be one byte"),
        }
    }

    /// Reads a non-negative INTEGER that fits in a u32.
    pub(crate) fn read_u32(&mut self) -> DResult<u32> {
        let c = self.read(TAG_INTEGER)?;
        decode_u32(c)
    }

    /// Asserts that all data was consumed.
    pub(crate) fn finish(&self) -> DResult<()> {
        if self.is_empty() {
            Ok(())
        } else {
            err("trailing data")
        }
    }
}

/// Decodes INTEGER content as a non-negative u32.
pub(crate) fn decode_u32(c: &[u8]) -> DResult<u32> {
    match c {
        [] => err("empty INTEGER"),
        [b, ..] if b & 0x80 != 0 => err("negative INTEGER"),
        [0, next, ..] if next & 0x80 == 0 => err("non-minimal INTEGER"),
        _ => {
            let c = if c[0] == 0 { &c[1..] } else { c };
            if c.len() > 4 {
                return err("INTEGER too large");
            }
            Ok(c.iter().fold(0u32, |acc, b| (acc << 8) | u32::from(*b)))
        }
    }
}

/// Encodes one TLV.
pub(crate) fn tlv(tag: u8, content: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(content.len() + 6);
    out.push(tag);
    let len = content.len();
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes = (len as u32).to_be_bytes();
        let skip = bytes.iter().take_while(|b| **b == 0).count();
        out.push(0x80 | (4 - skip) as u8);
        out.extend_from_slice(&bytes[skip..]);
    }
    out.extend_from_slice(content);
    out
}

/// Encodes a non-negative INTEGER.
pub(crate) fn integer_u32(v: u32) -> Vec<u8> {
    let bytes = v.to_be_bytes();
    let skip = bytes.iter().take_while(|b| **b == 0).count().min(3);
    let mut c = Vec::with_capacity(5);
    if bytes[skip] & 0x80 != 0 {
        c.push(0);
    }
    c.extend_from_slice(&bytes[skip..]);
    tlv(TAG_INTEGER, &c)
}

/// Encodes a BOOLEAN.
pub(crate) fn boolean(v: bool) -> Vec<u8> {
    tlv(TAG_BOOLEAN, &[if v { 0xFF } else { 0x00 }])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers() {
        for v in [
            0u32,
            1,
            0x7f,
            0x80,
            0xff,
            0x100,
            0x4000_0001,
            0x8100_0001,
            u32::MAX,
        ] {
            let enc = integer_u32(v);
            let mut r = Reader::new(&enc);
            assert_eq!(r.read_u32().unwrap(), v);
            r.finish().unwrap();
        }
        assert_eq!(integer_u32(0x8100_0001), [2, 5, 0, 0x81, 0, 0, 1]);
    }

    #[test]
    fn lengths() {
        let long = vec![7u8; 300];
        let enc = tlv(TAG_OCTET_STRING, &long);
        assert_eq!(&enc[..4], &[4, 0x82, 1, 44]);
        assert_eq!(Reader::new(&enc).read(TAG_OCTET_STRING).unwrap(), &long[..]);
        for bad in [
            &[4u8, 0x80][..],
            &[4, 0x85, 1, 1, 1, 1, 1],
            &[4, 0x84, 0xff, 0xff, 0xff, 0xff],
            &[4, 0x81, 0x05, 1, 2, 3, 4, 5],
            &[4, 3, 1],
            &[0x1f, 1, 0],
            &[4],
        ] {
            assert!(Reader::new(bad).read_any().is_err(), "{bad:?}");
        }
    }
}
