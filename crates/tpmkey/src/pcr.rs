//! PCR selections (`sha256:0,7`) used to lock keys to a boot state.
//!
//! Only one bank per selection is supported: that covers every real use
//! (`sha256:0,2,4,7`), keeps the policy digest computation obvious, and
//! matches what the key file's PolicyPCR command can carry unambiguously.

use std::fmt;
use std::str::FromStr;

use tss_esapi::interface_types::algorithm::HashingAlgorithm;
use tss_esapi::structures::{PcrSelectionList, PcrSelectionListBuilder, PcrSlot};

use crate::error::{Error, Result};

/// Highest PCR index (PC client TPMs have 24 PCRs).
pub const MAX_PCR: u8 = 23;

/// A PCR bank (hash algorithm).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PcrBank {
    /// The SHA-1 bank.
    Sha1,
    /// The SHA-256 bank.
    Sha256,
}

impl PcrBank {
    /// TPM_ALG_ID of the bank.
    pub fn alg_id(self) -> u16 {
        match self {
            PcrBank::Sha1 => 0x0004,
            PcrBank::Sha256 => 0x000B,
        }
    }

    fn from_alg_id(id: u16) -> Option<PcrBank> {
        match id {
            0x0004 => Some(PcrBank::Sha1),
            0x000B => Some(PcrBank::Sha256),
            _ => None,
        }
    }

    pub(crate) fn hashing_algorithm(self) -> HashingAlgorithm {
        match self {
            PcrBank::Sha1 => HashingAlgorithm::Sha1,
            PcrBank::Sha256 => HashingAlgorithm::Sha256,
        }
    }

    fn name(self) -> &'static str {
        match self {
            PcrBank::Sha1 => "sha1",
            PcrBank::Sha256 => "sha256",
        }
    }
}

/// A set of PCRs in one bank, kept sorted and de-duplicated.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PcrSelection {
    bank: PcrBank,
    indices: Vec<u8>,
}

impl PcrSelection {
    /// Builds a selection; indices are sorted, de-duplicated and checked.
    pub fn new(bank: PcrBank, indices: &[u8]) -> Result<PcrSelection> {
        let mut v = indices.to_vec();
        v.sort_unstable();
        v.dedup();
        if v.is_empty() {
            return Err(Error::InvalidInput("PCR selection selects no PCR".into()));
        }
        if let Some(bad) = v.iter().find(|i| **i > MAX_PCR) {
            return Err(Error::InvalidInput(format!(
                "PCR index {bad} out of range (0-{MAX_PCR})"
            )));
        }
        Ok(PcrSelection { bank, indices: v })
    }

    /// Parses `sha256:0,7` / `sha1:0-3,7` (tpm2-tools syntax, one bank).
    pub fn parse(s: &str) -> Result<PcrSelection> {
        s.parse()
    }

    /// The bank.
    pub fn bank(&self) -> PcrBank {
        self.bank
    }

    /// Selected PCR indices, ascending.
    pub fn indices(&self) -> &[u8] {
        &self.indices
    }

    /// tss-esapi form, for PCR_Read and PolicyPCR.
    pub(crate) fn to_tss(&self) -> Result<PcrSelectionList> {
        let slots: Vec<PcrSlot> = self
            .indices
            .iter()
            .map(|i| PcrSlot::try_from(1u32 << i))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::InvalidInput(format!("PCR selection: {e}")))?;
        PcrSelectionListBuilder::new()
            .with_selection(self.bank.hashing_algorithm(), &slots)
            .build()
            .map_err(|e| Error::InvalidInput(format!("PCR selection: {e}")))
    }

    /// Marshalled TPML_PCR_SELECTION (count=1, sizeofSelect=3), as it
    /// appears in the PolicyPCR command parameters stored in key files.
    pub fn to_tpml(&self) -> Vec<u8> {
        let mut select = [0u8; 3];
        for i in &self.indices {
            select[usize::from(i / 8)] |= 1 << (i % 8);
        }
        let mut out = Vec::with_capacity(10);
        out.extend_from_slice(&1u32.to_be_bytes());
        out.extend_from_slice(&self.bank.alg_id().to_be_bytes());
        out.push(3);
        out.extend_from_slice(&select);
        out
    }

    /// Parses a marshalled TPML_PCR_SELECTION; returns the selection and the
    /// number of bytes consumed.  Never panics on malformed input.
    pub fn from_tpml(data: &[u8]) -> Result<(PcrSelection, usize)> {
        let bad = |m: &str| Error::KeyFile(format!("PCR selection in policy: {m}"));
        let count = data
            .get(0..4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
            .ok_or_else(|| bad("truncated"))?;
        if count != 1 {
            return Err(bad("only single-bank selections are supported"));
        }
        let alg = data
            .get(4..6)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))
            .ok_or_else(|| bad("truncated"))?;
        let bank = PcrBank::from_alg_id(alg).ok_or_else(|| bad("unsupported PCR bank"))?;
        let size = usize::from(*data.get(6).ok_or_else(|| bad("truncated"))?);
        if size > 4 {
            return Err(bad("sizeofSelect too large"));
        }
        let select = data.get(7..7 + size).ok_or_else(|| bad("truncated"))?;
        let mut indices = Vec::new();
        for (byte_idx, byte) in select.iter().enumerate() {
            for bit in 0..8u8 {
                if byte & (1 << bit) != 0 {
                    // byte_idx <= 3, so this cannot overflow a u8.
                    indices.push(byte_idx as u8 * 8 + bit);
                }
            }
        }
        let sel = PcrSelection::new(bank, &indices).map_err(|e| bad(&e.to_string()))?;
        Ok((sel, 7 + size))
    }
}

impl FromStr for PcrSelection {
    type Err = Error;

    fn from_str(s: &str) -> Result<PcrSelection> {
        let bad = |m: String| Error::InvalidInput(format!("PCR selection '{s}': {m}"));
        let (bank, list) = s
            .trim()
            .split_once(':')
            .ok_or_else(|| bad("expected BANK:LIST, e.g. sha256:0,7".into()))?;
        let bank = match bank.trim().to_ascii_lowercase().as_str() {
            "sha256" => PcrBank::Sha256,
            "sha1" => PcrBank::Sha1,
            other => return Err(bad(format!("unsupported bank '{other}' (sha256 or sha1)"))),
        };
        let parse_idx = |t: &str| -> Result<u8> {
            t.trim()
                .parse::<u8>()
                .ok()
                .filter(|i| *i <= MAX_PCR)
                .ok_or_else(|| bad(format!("'{t}' is not a PCR index 0-{MAX_PCR}")))
        };
        let mut indices = Vec::new();
        for item in list.split(',') {
            if let Some((a, b)) = item.split_once('-') {
                let (a, b) = (parse_idx(a)?, parse_idx(b)?);
                if a > b {
                    return Err(bad(format!("empty range '{item}'")));
                }
                indices.extend(a..=b);
            } else {
                indices.push(parse_idx(item)?);
            }
        }
        PcrSelection::new(bank, &indices)
    }
}

impl fmt::Display for PcrSelection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list: Vec<String> = self.indices.iter().map(|i| i.to_string()).collect();
        write!(f, "{}:{}", self.bank.name(), list.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_display() {
        let p = PcrSelection::parse("sha256:7,0,7").unwrap();
        assert_eq!(p.indices(), &[0, 7]);
        assert_eq!(p.to_string(), "sha256:0,7");
        assert_eq!(
            PcrSelection::parse("sha1:0-2").unwrap().to_string(),
            "sha1:0,1,2"
        );
        for bad in [
            "",
            "sha256",
            "sha256:",
            "sha384:0",
            "sha256:24",
            "sha256:a",
            "sha256:3-1",
            ":1",
        ] {
            assert!(PcrSelection::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tpml_round_trip() {
        let p = PcrSelection::parse("sha256:0,7,16,23").unwrap();
        let b = p.to_tpml();
        assert_eq!(b, [0, 0, 0, 1, 0, 0x0b, 3, 0x81, 0x00, 0x81]);
        let (q, n) = PcrSelection::from_tpml(&b).unwrap();
        assert_eq!((q, n), (p, b.len()));
        for i in 0..b.len() {
            assert!(PcrSelection::from_tpml(&b[..i]).is_err());
        }
    }
}
