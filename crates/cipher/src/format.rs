//! The tpmcrypt v1 header: magic, version, payload parameters, recipient
//! stanzas and a MAC over all of it. The byte layout is documented in
//! `docs/format.md`; this module is the only code that reads or writes it.

use std::io::Read;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::io_util::read_full;

pub use crate::segment::{Mode, Params, DEFAULT_SEGMENT_SIZE, MAX_SEGMENT_SIZE};

/// First eight bytes of every tpmcrypt file (PNG-style: a high byte to catch
/// 7-bit transfers, CR LF and ^Z to catch newline and EOF translation).
pub const MAGIC: [u8; 8] = [0x89, b'T', b'P', b'M', b'C', 0x0D, 0x0A, 0x1A];
/// The format version this crate writes and reads.
pub const VERSION: u8 = 1;
/// Length of the header MAC (HMAC-SHA256).
pub const HEADER_MAC_LEN: usize = 32;
/// Most recipient stanzas a header may carry.
pub const MAX_STANZAS: usize = 64;
/// Largest stanza body accepted.
pub const MAX_STANZA_BODY: usize = 4096;

/// Length of a key fingerprint carried at the start of every stanza body.
pub const FINGERPRINT_LEN: usize = 16;

const FIXED_LEN: usize = 16;

/// One recipient's wrapped copy of the session key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stanza {
    /// Recipient kind (see [`crate::recipient::kind`]).
    pub kind: u8,
    /// Kind-specific body; starts with the recipient key's fingerprint.
    pub body: Vec<u8>,
}

impl Stanza {
    /// The recipient key fingerprint at the start of the body, if present.
    pub fn fingerprint(&self) -> Option<&[u8]> {
        self.body.get(..FINGERPRINT_LEN)
    }
}

/// A parsed header, with its raw bytes kept: they are the associated data of
/// the payload, so they must be exactly what was read.
#[derive(Clone, Debug)]
pub struct Header {
    /// Payload parameters.
    pub params: Params,
    /// Recipient stanzas, in file order.
    pub stanzas: Vec<Stanza>,
    raw: Vec<u8>,
    stanzas_at: std::ops::Range<usize>,
}

impl Header {
    /// Serialises a header without its MAC (the MAC needs the session key;
    /// see [`crate::session`]).
    pub fn encode_unsigned(params: &Params, stanzas: &[Stanza]) -> Result<Vec<u8>> {
        params.validate()?;
        if stanzas.is_empty() || stanzas.len() > MAX_STANZAS {
            return Err(Error::InvalidParams(format!(
                "a file needs 1 to {MAX_STANZAS} recipients, got {}",
                stanzas.len()
            )));
        }
        let mut out = Vec::with_capacity(FIXED_LEN + stanzas.len() * 300 + HEADER_MAC_LEN);
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(params.mode.to_byte());
        out.push(params.key_len as u8);
        out.extend_from_slice(&params.segment_size.to_be_bytes());
        out.push(stanzas.len() as u8);
        for stanza in stanzas {
            let len = u16::try_from(stanza.body.len())
                .ok()
                .filter(|&l| (l as usize) <= MAX_STANZA_BODY)
                .ok_or_else(|| Error::InvalidParams("recipient stanza too large".into()))?;
            out.push(stanza.kind);
            out.extend_from_slice(&len.to_be_bytes());
            out.extend_from_slice(&stanza.body);
        }
        Ok(out)
    }

    /// Reads exactly one header from `input`, leaving it positioned at the
    /// payload. Structural checks only: the MAC is checked once the session
    /// key is known.
    pub fn read_from<R: Read + ?Sized>(input: &mut R) -> Result<Header> {
        let mut raw = vec![0u8; FIXED_LEN];
        let n = read_full(input, &mut raw)?;
        if n < MAGIC.len() || raw[..MAGIC.len()] != MAGIC {
            return Err(Error::NotTpmcrypt);
        }
        if n < FIXED_LEN {
            // The magic is there: a tpmcrypt file, cut short.
            return Err(truncated_header());
        }
        if raw[8] != VERSION {
            return Err(Error::UnsupportedVersion(raw[8]));
        }
        let mode = Mode::from_byte(raw[9])?;
        let key_len = raw[10] as usize;
        if !matches!(key_len, 16 | 24 | 32) {
            return Err(Error::malformed(format!("invalid key length {key_len}")));
        }
        let segment_size = u32::from_be_bytes([raw[11], raw[12], raw[13], raw[14]]);
        let params = Params {
            mode,
            key_len,
            segment_size,
        };
        params
            .validate()
            .map_err(|e| Error::malformed(e.to_string()))?;
        let count = raw[15] as usize;
        if count == 0 || count > MAX_STANZAS {
            return Err(Error::malformed(format!("invalid recipient count {count}")));
        }
        let stanzas_start = raw.len();
        let mut stanzas = Vec::with_capacity(count);
        for _ in 0..count {
            let at = raw.len();
            raw.resize(at + 3, 0);
            read_exact_or(input, &mut raw[at..], truncated_header)?;
            let kind = raw[at];
            let len = u16::from_be_bytes([raw[at + 1], raw[at + 2]]) as usize;
            if len > MAX_STANZA_BODY {
                return Err(Error::malformed(format!("recipient stanza of {len} bytes")));
            }
            let body_at = raw.len();
            raw.resize(body_at + len, 0);
            read_exact_or(input, &mut raw[body_at..], truncated_header)?;
            stanzas.push(Stanza {
                kind,
                body: raw[body_at..].to_vec(),
            });
        }
        let stanzas_at = stanzas_start..raw.len();
        let mac_at = raw.len();
        raw.resize(mac_at + HEADER_MAC_LEN, 0);
        read_exact_or(input, &mut raw[mac_at..], truncated_header)?;
        Ok(Header {
            params,
            stanzas,
            raw,
            stanzas_at,
        })
    }

    /// Every header byte, MAC included: the associated data of the payload.
    pub fn raw(&self) -> &[u8] {
        &self.raw
    }

    /// The header bytes the MAC covers.
    pub fn unsigned(&self) -> &[u8] {
        &self.raw[..self.raw.len() - HEADER_MAC_LEN]
    }

    /// The stored MAC.
    pub fn mac(&self) -> &[u8] {
        &self.raw[self.raw.len() - HEADER_MAC_LEN..]
    }

    /// Offset of the payload (the Tink-compatible stream) in the file.
    pub fn payload_offset(&self) -> usize {
        self.raw.len()
    }

    /// SHA-256 of the stanza bytes: the identity of the wrapped session key,
    /// under which decryptors cache the unwrapped key.
    pub fn stanza_digest(&self) -> [u8; 32] {
        stanza_digest(&self.raw[self.stanzas_at.clone()])
    }

    /// Session id: the first 16 bytes of [`Header::stanza_digest`]. Every
    /// file of one session shows the same id.
    pub fn session_id(&self) -> [u8; 16] {
        session_id_of(&self.stanza_digest())
    }
}

/// SHA-256 over the serialised stanza region.
pub(crate) fn stanza_digest(stanza_bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(stanza_bytes).into()
}

pub(crate) fn session_id_of(digest: &[u8; 32]) -> [u8; 16] {
    let mut id = [0u8; 16];
    id.copy_from_slice(&digest[..16]);
    id
}

fn truncated_header() -> Error {
    Error::malformed("the file ends inside the header")
}

fn read_exact_or<R: Read + ?Sized>(
    input: &mut R,
    buf: &mut [u8],
    on_eof: impl FnOnce() -> Error,
) -> Result<()> {
    let n = read_full(input, buf)?;
    if n < buf.len() {
        return Err(on_eof());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let params = Params::new(Mode::Gcm, 256).unwrap();
        let stanzas = vec![
            Stanza {
                kind: 1,
                body: vec![7; 129],
            },
            Stanza {
                kind: 3,
                body: vec![9; 272],
            },
        ];
        let mut bytes = Header::encode_unsigned(&params, &stanzas).unwrap();
        bytes.extend_from_slice(&[0xAA; HEADER_MAC_LEN]);
        bytes
    }

    #[test]
    fn round_trip() {
        let bytes = sample();
        let header = Header::read_from(&mut &bytes[..]).unwrap();
        assert_eq!(header.raw(), &bytes[..]);
        assert_eq!(header.stanzas.len(), 2);
        assert_eq!(header.stanzas[1].body.len(), 272);
        assert_eq!(header.params.key_len, 32);
        assert_eq!(header.mac(), &[0xAA; 32]);
        assert_eq!(header.payload_offset(), bytes.len());
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = sample();
        for cut in 0..bytes.len() {
            assert!(
                Header::read_from(&mut &bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
    }

    /// A file cut inside the fixed header but after its magic is a
    /// truncated tpmcrypt file, not "not a tpmcrypt file" (as the build
    /// before said of 8 to 15 bytes); shorter than the magic, it is not one.
    #[test]
    fn a_header_cut_after_the_magic_is_truncated() {
        let bytes = sample();
        for n in 0..FIXED_LEN {
            let e = Header::read_from(&mut &bytes[..n]).expect_err("refused");
            match n < MAGIC.len() {
                true => assert!(matches!(e, Error::NotTpmcrypt), "{n}: {e}"),
                false => assert!(e.to_string().contains("ends inside the header"), "{n}: {e}"),
            }
        }
    }

    #[test]
    fn bad_magic_version_mode() {
        let mut bytes = sample();
        bytes[0] ^= 1;
        assert!(matches!(
            Header::read_from(&mut &bytes[..]),
            Err(Error::NotTpmcrypt)
        ));
        let mut bytes = sample();
        bytes[8] = 2;
        assert!(matches!(
            Header::read_from(&mut &bytes[..]),
            Err(Error::UnsupportedVersion(2))
        ));
        let mut bytes = sample();
        bytes[9] = 9;
        assert!(matches!(
            Header::read_from(&mut &bytes[..]),
            Err(Error::MalformedHeader(_))
        ));
    }

    #[test]
    fn hostile_sizes_are_refused() {
        let mut bytes = sample();
        bytes[11..15].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            Header::read_from(&mut &bytes[..]),
            Err(Error::MalformedHeader(_))
        ));
        let mut bytes = sample();
        bytes[15] = 200;
        assert!(matches!(
            Header::read_from(&mut &bytes[..]),
            Err(Error::MalformedHeader(_))
        ));
        let mut bytes = sample();
        bytes[17..19].copy_from_slice(&u16::MAX.to_be_bytes());
        assert!(matches!(
            Header::read_from(&mut &bytes[..]),
            Err(Error::MalformedHeader(_))
        ));
    }

    #[test]
    fn session_id_depends_only_on_stanzas() {
        let a = Header::read_from(&mut &sample()[..]).unwrap();
        let mut other = sample();
        let n = other.len();
        other[n - 1] ^= 0xFF; // a different MAC, same stanzas
        let b = Header::read_from(&mut &other[..]).unwrap();
        assert_eq!(a.session_id(), b.session_id());
        let mut other = sample();
        other[FIXED_LEN + 5] ^= 1;
        let c = Header::read_from(&mut &other[..]).unwrap();
        assert_ne!(a.session_id(), c.session_id());
    }
}
