//! The stateless segment primitive: payload parameters and their layout,
//! per-file keys, nonces, and sealing or opening ONE segment. It keeps no
//! state between segments; the engine ([`crate::stream`]) and the
//! `Read`/`Write` adapters ([`crate::io`]) drive it.
//!
//! The `gcm` payload is Tink's AES-GCM-HKDF streaming AEAD, byte for byte:
//!
//! ```text
//! stream header = len (1 byte) ‖ salt (key_len bytes) ‖ nonce prefix (7 bytes)
//! file key      = HKDF-SHA256(ikm = session key, salt, info = tpmcrypt header, key_len)
//! nonce_i       = prefix ‖ BE32(i) ‖ (i is last ? 0x01 : 0x00)
//! segment_i     = AES-GCM(file key, nonce_i, aad = ∅, plaintext_i)   (ciphertext ‖ tag)
//! ```
//!
//! Segment 0 is shorter by the stream header so that every ciphertext
//! segment, header included, is `segment_size` bytes. The `cbc` payload uses
//! the same stream header and nonce bytes, but each segment is an RFC 7518
//! AES_CBC_HMAC_SHA2 ciphertext `IV ‖ E ‖ T` with `nonce_i` as associated
//! data, so position and the last-segment flag are authenticated.

use std::ops::Range;
use std::sync::Arc;

use zeroize::Zeroizing;

use crate::backend::{
    compiled, AuthFailed, Backend, GcmKey, Hash, AES_BLOCK, GCM_NONCE_LEN, GCM_TAG_LEN,
};
use crate::cbc_hmac::CbcHmac;
use crate::error::{Error, Result};

/// Largest ciphertext segment accepted (bounds memory on hostile input).
pub const MAX_SEGMENT_SIZE: u32 = 16 << 20;
/// Default ciphertext segment size: 1 MiB, Tink's `AES*_GCM_HKDF_1MB`.
pub const DEFAULT_SEGMENT_SIZE: u32 = 1 << 20;

/// Payload mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Segmented AES-GCM, byte-compatible with Tink's AES-GCM-HKDF streaming AEAD.
    Gcm,
    /// Segmented AES-CBC with HMAC-SHA2 (RFC 7518 §5.2), encrypt-then-MAC.
    Cbc,
}

impl Mode {
    pub(crate) fn to_byte(self) -> u8 {
        match self {
            Mode::Gcm => 1,
            Mode::Cbc => 2,
        }
    }

    pub(crate) fn from_byte(b: u8) -> Result<Self> {
        match b {
            1 => Ok(Mode::Gcm),
            2 => Ok(Mode::Cbc),
            other => Err(Error::malformed(format!("unknown payload mode {other}"))),
        }
    }

    /// Lower-case name used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Gcm => "gcm",
            Mode::Cbc => "cbc",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "gcm" => Ok(Mode::Gcm),
            "cbc" => Ok(Mode::Cbc),
            other => Err(Error::InvalidParams(format!(
                "unknown mode {other:?} (gcm or cbc)"
            ))),
        }
    }
}

/// Payload parameters fixed per file (and per session).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Payload mode.
    pub mode: Mode,
    /// AES key length in bytes: 16, 24 or 32.
    pub key_len: usize,
    /// Ciphertext segment size in bytes.
    pub segment_size: u32,
}

impl Params {
    /// Parameters with the default segment size for the mode and key size.
    pub fn new(mode: Mode, key_bits: u32) -> Result<Self> {
        let key_len = match key_bits {
            128 => 16,
            192 => 24,
            256 => 32,
            other => {
                return Err(Error::InvalidParams(format!(
                    "key size must be 128, 192 or 256 bits, not {other}"
                )))
            }
        };
        let segment_size = match (mode, key_len) {
            // CBC segments hold whole blocks: (size - tag) must be a multiple
            // of 16, and the HS384 tag is 24 bytes.
            (Mode::Cbc, 24) => DEFAULT_SEGMENT_SIZE - 8,
            _ => DEFAULT_SEGMENT_SIZE,
        };
        let params = Params {
            mode,
            key_len,
            segment_size,
        };
        params.validate()?;
        Ok(params)
    }

    /// Same parameters with another ciphertext segment size (tests and
    /// benchmarks use small segments).
    pub fn with_segment_size(mut self, segment_size: u32) -> Result<Self> {
        self.segment_size = segment_size;
        self.validate()?;
        Ok(self)
    }

    /// Key size in bits.
    pub fn key_bits(&self) -> u32 {
        (self.key_len * 8) as u32
    }

    /// The default backend for these parameters: the fastest correct one
    /// compiled in, by measurement on x86-64 with AES-NI and CLMUL
    /// (`examples/backend_speed.rs`; figures in `docs/format.md`,
    /// "Backends"): for AES-GCM, aws-lc where its 512-bit VAES path runs
    /// ([`crate::backend::aws_lc_gcm_is_wide`]); elsewhere ring for 128-
    /// and 256-bit keys (its 256-bit VAES path, where AWS-LC has only
    /// 128-bit AES-NI; on CPUs without VAES both run the same AES-NI
    /// assembly) and OpenSSL for 192-bit keys, which ring lacks; OpenSSL
    /// for CBC; then RustCrypto. All backends write identical bytes, so
    /// this is only speed.
    pub fn default_backend(&self) -> Arc<dyn Backend> {
        let serves =
            |b: &&Arc<dyn Backend>| crate::backend::serves(b.name(), self.mode, self.key_len);
        let built: Vec<_> = self
            .backend_order()
            .iter()
            .filter_map(|name| compiled(name))
            .collect();
        // With no backend able to, the first one's error says why at first use.
        match built.iter().find(serves) {
            Some(b) => b.clone(),
            None => built[0].clone(),
        }
    }

    /// The name of the backend a build with every backend compiled in (and
    /// OpenSSL enabled) takes by default: the first of the order that
    /// serves these parameters. A program with fewer (`tpmcrypt`'s front,
    /// which never loads OpenSSL) asks it to know what the full one would
    /// use.
    pub fn preferred_backend(&self) -> &'static str {
        let order = self.backend_order();
        order
            .into_iter()
            .find(|name| crate::backend::serves(name, self.mode, self.key_len))
            .unwrap_or(order[0])
    }

    /// The backends in the order they are preferred for these parameters
    /// on this CPU, fastest first.
    fn backend_order(&self) -> [&'static str; 4] {
        match self.mode {
            Mode::Gcm if crate::backend::aws_lc_gcm_is_wide() => {
                ["aws-lc", "ring", "openssl", "rustcrypto"]
            }
            Mode::Gcm => ["ring", "openssl", "aws-lc", "rustcrypto"],
            Mode::Cbc => ["openssl", "rustcrypto", "aws-lc", "ring"],
        }
    }

    /// Checks that the parameters describe a well-formed payload; every rule
    /// about segment sizes lives in [`Layout::new`].
    pub fn validate(&self) -> Result<()> {
        Layout::new(self).map(|_| ())
    }
}

/// Length of the nonce prefix in the stream header.
pub const NONCE_PREFIX_LEN: usize = 7;

/// Where segments start and how long they are, derived from [`Params`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Payload mode.
    pub mode: Mode,
    /// AES key length in bytes.
    pub key_len: usize,
    /// Ciphertext segment size in bytes.
    pub segment_size: usize,
}

impl Layout {
    /// Validates `params` and returns the layout. The one place for the rules
    /// on segment sizes.
    pub fn new(params: &Params) -> Result<Self> {
        if !matches!(params.key_len, 16 | 24 | 32) {
            return Err(Error::InvalidParams(format!(
                "invalid key length {}",
                params.key_len
            )));
        }
        let layout = Layout {
            mode: params.mode,
            key_len: params.key_len,
            segment_size: params.segment_size as usize,
        };
        if params.segment_size > MAX_SEGMENT_SIZE {
            return Err(Error::InvalidParams(format!(
                "segment size {} exceeds {MAX_SEGMENT_SIZE}",
                params.segment_size
            )));
        }
        // Segment 0 must hold at least one plaintext byte.
        let min = match layout.mode {
            Mode::Gcm => layout.stream_header_len() + GCM_TAG_LEN + 1,
            Mode::Cbc => layout.cbc_overhead() + AES_BLOCK,
        };
        if layout.segment_size < min {
            return Err(Error::InvalidParams(format!(
                "segment size {} is below the minimum {min}",
                layout.segment_size
            )));
        }
        if layout.mode == Mode::Cbc
            && (layout.segment_size - CbcHmac::tag_len_for(layout.key_len)) % AES_BLOCK != 0
        {
            return Err(Error::InvalidParams(format!(
                "cbc segment size {} minus the {}-byte tag must be a multiple of 16",
                layout.segment_size,
                CbcHmac::tag_len_for(layout.key_len)
            )));
        }
        Ok(layout)
    }

    /// Length of the stream header: length byte, salt, nonce prefix.
    pub fn stream_header_len(&self) -> usize {
        1 + self.key_len + NONCE_PREFIX_LEN
    }

    /// IV, one block of padding at most, and the tag.
    fn cbc_overhead(&self) -> usize {
        AES_BLOCK + AES_BLOCK + CbcHmac::tag_len_for(self.key_len)
    }

    /// Bytes by which segment 0 is shortened (Tink counts the stream header
    /// as part of the first segment; the cbc payload does not).
    fn first_cut(&self) -> usize {
        match self.mode {
            Mode::Gcm => self.stream_header_len(),
            Mode::Cbc => 0,
        }
    }

    /// Ciphertext length of a full segment `index`.
    pub fn ciphertext_segment_len(&self, index: u64) -> usize {
        if index == 0 {
            self.segment_size - self.first_cut()
        } else {
            self.segment_size
        }
    }

    /// Plaintext length of a full segment `index`.
    pub fn plaintext_segment_len(&self, index: u64) -> usize {
        let overhead = match self.mode {
            Mode::Gcm => GCM_TAG_LEN,
            Mode::Cbc => self.cbc_overhead(),
        };
        self.ciphertext_segment_len(index) - overhead
    }

    /// Ciphertext length of a segment holding `plaintext_len` bytes.
    pub fn sealed_len(&self, plaintext_len: usize) -> usize {
        match self.mode {
            Mode::Gcm => plaintext_len + GCM_TAG_LEN,
            Mode::Cbc => {
                AES_BLOCK
                    + (plaintext_len / AES_BLOCK + 1) * AES_BLOCK
                    + CbcHmac::tag_len_for(self.key_len)
            }
        }
    }

    /// Total payload length (stream header and all segments) for a
    /// plaintext of `len` bytes.
    pub fn payload_len(&self, len: u64) -> u64 {
        let mut total = self.stream_header_len() as u64;
        let mut left = len;
        let mut index = 0u64;
        loop {
            let full = self.plaintext_segment_len(index) as u64;
            if left <= full {
                return total + self.sealed_len(left as usize) as u64;
            }
            total += self.ciphertext_segment_len(index) as u64;
            left -= full;
            index += 1;
        }
    }

    /// Length of the derived key material: the AES-GCM key, or for cbc the
    /// RFC 7518 composite key (MAC_KEY ‖ ENC_KEY) followed by a 32-byte
    /// IV-derivation key.
    pub fn key_material_len(&self) -> usize {
        match self.mode {
            Mode::Gcm => self.key_len,
            Mode::Cbc => 2 * self.key_len + IV_KEY_LEN,
        }
    }
}

const IV_KEY_LEN: usize = 32;

/// The per-segment nonce (gcm) or associated data (cbc).
pub fn segment_nonce(
    prefix: &[u8; NONCE_PREFIX_LEN],
    index: u32,
    last: bool,
) -> [u8; GCM_NONCE_LEN] {
    let mut nonce = [0u8; GCM_NONCE_LEN];
    nonce[..NONCE_PREFIX_LEN].copy_from_slice(prefix);
    nonce[NONCE_PREFIX_LEN..11].copy_from_slice(&index.to_be_bytes());
    nonce[11] = last as u8;
    nonce
}

/// Per-file key material and nonce prefix, enough to build a segment
/// crypter on any thread.
pub struct FileKeys {
    layout: Layout,
    material: Zeroizing<Vec<u8>>,
    nonce_prefix: [u8; NONCE_PREFIX_LEN],
}

impl FileKeys {
    /// Derives the file key with HKDF-SHA256 (Tink's construction: the
    /// associated data is the HKDF info).
    pub fn derive(
        backend: &dyn Backend,
        layout: Layout,
        ikm: &[u8],
        salt: &[u8],
        associated_data: &[u8],
        nonce_prefix: [u8; NONCE_PREFIX_LEN],
    ) -> Result<Self> {
        let mut material = Zeroizing::new(vec![0u8; layout.key_material_len()]);
        backend.hkdf_sha256(ikm, salt, associated_data, &mut material)?;
        Ok(FileKeys {
            layout,
            material,
            nonce_prefix,
        })
    }

    /// Uses already-derived key material (for known-answer tests whose HKDF
    /// hash is not SHA-256).
    pub fn from_material(
        layout: Layout,
        material: &[u8],
        nonce_prefix: [u8; NONCE_PREFIX_LEN],
    ) -> Result<Self> {
        if material.len() != layout.key_material_len() {
            return Err(Error::InvalidParams(
                "key material of the wrong length".into(),
            ));
        }
        Ok(FileKeys {
            layout,
            material: Zeroizing::new(material.to_vec()),
            nonce_prefix,
        })
    }

    /// The layout these keys were made for.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// A crypter for one thread.
    pub fn crypter(&self, backend: &Arc<dyn Backend>) -> Result<SegmentCrypter> {
        let aead = match self.layout.mode {
            Mode::Gcm => Aead::Gcm(backend.gcm(&self.material)?),
            Mode::Cbc => {
                let composite = 2 * self.layout.key_len;
                Aead::Cbc {
                    cbc: CbcHmac::new(backend.clone(), &self.material[..composite])?,
                    iv_key: Zeroizing::new(self.material[composite..].to_vec()),
                    backend: backend.clone(),
                }
            }
        };
        Ok(SegmentCrypter {
            layout: self.layout,
            prefix: self.nonce_prefix,
            aead,
        })
    }
}

enum Aead {
    Gcm(Box<dyn GcmKey>),
    Cbc {
        cbc: CbcHmac,
        iv_key: Zeroizing<Vec<u8>>,
        backend: Arc<dyn Backend>,
    },
}

/// Seals and opens single segments.
pub struct SegmentCrypter {
    layout: Layout,
    prefix: [u8; NONCE_PREFIX_LEN],
    aead: Aead,
}

impl SegmentCrypter {
    /// The layout of the segments this crypter seals and opens.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Bytes to reserve before the plaintext in a buffer passed to `seal`.
    pub fn reserve(&self) -> usize {
        input_reserve(Direction::Seal, &self.layout)
    }

    /// Seals `buf[reserve()..]` in place into a complete ciphertext segment.
    pub fn seal(&mut self, index: u64, last: bool, buf: &mut Vec<u8>) -> Result<()> {
        let index = segment_index(index)?;
        let nonce = segment_nonce(&self.prefix, index, last);
        match &mut self.aead {
            Aead::Gcm(key) => key.seal(&nonce, &[], buf),
            Aead::Cbc {
                cbc,
                iv_key,
                backend,
            } => {
                // An unpredictable IV: a PRF of the segment's position under
                // a key of its own (SP 800-38A, Appendix C).
                let prf = backend.hmac(Hash::Sha256, iv_key, &[&nonce])?;
                let mut iv = [0u8; AES_BLOCK];
                iv.copy_from_slice(&prf[..AES_BLOCK]);
                cbc.seal(&iv, &nonce, buf)
            }
        }
    }

    fn open_once(
        &mut self,
        index: u32,
        last: bool,
        buf: &mut [u8],
    ) -> std::result::Result<Range<usize>, AuthFailed> {
        let nonce = segment_nonce(&self.prefix, index, last);
        match &mut self.aead {
            Aead::Gcm(key) => key.open(&nonce, &[], buf).map(|n| 0..n),
            Aead::Cbc { cbc, .. } => cbc.open(&nonce, buf),
        }
    }

    /// Authenticates and decrypts a complete ciphertext segment in place and
    /// returns where its plaintext is. When the last segment is full-size
    /// and fails, it is tried as a middle segment to tell truncation at a
    /// segment boundary apart from tampering.
    pub fn open(&mut self, index: u64, last: bool, buf: &mut [u8]) -> Result<Range<usize>> {
        let idx = segment_index(index)?;
        let full = buf.len() == self.layout.ciphertext_segment_len(index);
        let backup = (last && full).then(|| Zeroizing::new(buf.to_vec()));
        match self.open_once(idx, last, buf) {
            Ok(range) => Ok(range),
            Err(AuthFailed) => {
                if let Some(mut copy) = backup {
                    if self.open_once(idx, false, &mut copy).is_ok() {
                        return Err(Error::Truncated { index });
                    }
                }
                Err(Error::SegmentAuth { index })
            }
        }
    }
}

fn segment_index(index: u64) -> Result<u32> {
    u32::try_from(index).map_err(|_| Error::InvalidParams("more than 2^32 segments".into()))
}

/// Which way the engine runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Direction {
    /// Plaintext in, ciphertext segments out.
    Seal,
    /// Ciphertext segments in, plaintext out.
    Open,
}

/// Room kept before the input in each buffer: sealing cbc writes its IV
/// there (the one place for this rule).
pub(crate) fn input_reserve(direction: Direction, layout: &Layout) -> usize {
    match (direction, layout.mode) {
        (Direction::Seal, Mode::Cbc) => AES_BLOCK,
        _ => 0,
    }
}
