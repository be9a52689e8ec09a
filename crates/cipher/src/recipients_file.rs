//! Recipients files: every recipient a file (or standard input) names.
//!
//! ```text
//! # a comment                        (ignored, as are blank lines)
//! tpmcrypt-recovery:A2bx…            (one recovery recipient per line)
//! -----BEGIN PUBLIC KEY-----         (a TPM key's public half, PEM)
//! MIIBIjANBgkqhkiG9w0BAQEFAAOCAQ8AMIIBCgKCAQEA…
//! -----END PUBLIC KEY-----
//! ```
//!
//! Any number of entries, in any order. One entry that does not parse makes
//! the whole file refused, with its line number: a file silently encrypted
//! to fewer recipients than its author listed is a file someone cannot
//! recover. Leading and trailing white space (and a CR of CRLF line ends)
//! is ignored on every line; PEM blocks are decoded strictly (RFC 7468).

use crate::error::Error;
use crate::recipient::{decode_public_key_pem, tpm_recipient_from_spki_der, Recipient};
use crate::recovery;

/// The line a PEM block starts with.
const PEM_BEGIN: &[u8] = b"-----BEGIN ";
/// The line a PEM block ends with.
const PEM_END: &[u8] = b"-----END ";

/// One recipient of a recipients file.
pub struct Entry {
    /// The line the entry starts on (1-based).
    pub line: usize,
    /// The recipient.
    pub recipient: Box<dyn Recipient>,
    /// For a recovery recipient line, the recipient string (trimmed).
    pub recovery: Option<String>,
}

/// An entry that does not parse: where, and why.
#[derive(Debug)]
pub struct LineError {
    /// The line the entry starts on (1-based).
    pub line: usize,
    /// Why it is refused (an [`Error::InvalidRecipient`]).
    pub error: Error,
}

impl std::fmt::Display for LineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {}", self.line, self.error)
    }
}

impl std::error::Error for LineError {}

fn refuse(line: usize, why: impl Into<String>) -> LineError {
    LineError {
        line,
        error: Error::InvalidRecipient(why.into()),
    }
}

/// Parses a whole recipients file. An empty list (only comments and blank
/// lines) is not an error here: the caller decides.
pub fn parse(data: &[u8]) -> Result<Vec<Entry>, LineError> {
    parse_with(data, pem_entry)
}

/// As [`parse`], with `pem` reading each PEM block (its lines from BEGIN to
/// END). A caller that cannot read PEM keys refuses them there, without
/// the code that reads them.
pub fn parse_with(
    data: &[u8],
    pem: impl Fn(&[u8]) -> crate::error::Result<Box<dyn Recipient>>,
) -> Result<Vec<Entry>, LineError> {
    let lines = split_lines(data);
    let mut entries = Vec::new();
    let mut i = 0;
    while let Some(&(start, raw)) = lines.get(i) {
        let line = i + 1;
        let text = raw.trim_ascii();
        if text.is_empty() || text.starts_with(b"#") {
            i += 1;
            continue;
        }
        if text.starts_with(PEM_BEGIN) {
            let end = (i + 1..lines.len())
                .find(|&j| lines[j].1.trim_ascii().starts_with(PEM_END))
                .ok_or_else(|| refuse(line, "PEM block without an END line"))?;
            let (end_start, end_raw) = lines[end];
            let block = &data[start..end_start + end_raw.len()];
            entries.push(Entry {
                line,
                recipient: pem(block).map_err(|error| LineError { line, error })?,
                recovery: None,
            });
            i = end + 1;
            continue;
        }
        let text = std::str::from_utf8(text).map_err(|_| refuse(line, "not UTF-8 text"))?;
        if !text.starts_with(recovery::RECIPIENT_PREFIX) {
            // The line itself is not shown: it may be a secret pasted by
            // mistake.
            return Err(refuse(
                line,
                format!(
                    "neither a {} line, a PEM PUBLIC KEY block, a # comment nor a blank line",
                    recovery::RECIPIENT_PREFIX
                ),
            ));
        }
        let parsed = recovery::parse_recipient(text).map_err(|error| LineError { line, error })?;
        entries.push(Entry {
            line,
            recipient: Box::new(parsed),
            recovery: Some(text.to_string()),
        });
        i += 1;
    }
    Ok(entries)
}

/// Each line with the offset it starts at, without its LF.
fn split_lines(data: &[u8]) -> Vec<(usize, &[u8])> {
    let mut out = Vec::new();
    let mut start = 0;
    for line in data.split(|&b| b == b'\n') {
        out.push((start, line));
        start += line.len() + 1;
    }
    out
}

/// Decodes one PEM block as a TPM key recipient.
fn pem_entry(block: &[u8]) -> crate::error::Result<Box<dyn Recipient>> {
    tpm_recipient_from_spki_der(&decode_public_key_pem(block)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recipient::kind;
    use crate::recovery::RecoveryKey;

    fn recovery_line() -> String {
        RecoveryKey::generate(&mut rand_core::OsRng).recipient_string()
    }

    fn p256_pem() -> String {
        let group = openssl::ec::EcGroup::from_curve_name(openssl::nid::Nid::X9_62_PRIME256V1)
            .expect("group");
        let key = openssl::ec::EcKey::generate(&group).expect("key");
        let pem = openssl::pkey::PKey::from_ec_key(key)
            .expect("pkey")
            .public_key_to_pem()
            .expect("pem");
        String::from_utf8(pem).expect("utf8")
    }

    #[test]
    fn every_entry_in_order() {
        let (a, b, pem) = (recovery_line(), recovery_line(), p256_pem());
        let text = format!("# c\r\n\r\n  {a}  \r\n{pem}\n# tail\n{b}");
        let entries = parse(text.as_bytes()).unwrap();
        let got: Vec<_> = entries
            .iter()
            .map(|e| (e.line, e.recipient.kind(), e.recovery.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                (3, kind::RECOVERY_P256, Some(a)),
                (4, kind::TPM_P256, None),
                (10, kind::RECOVERY_P256, Some(b)),
            ]
        );
        assert!(parse(b"").unwrap().is_empty());
        assert!(parse(b"# only\n\n   \n").unwrap().is_empty());
    }

    #[test]
    fn pem_lines_of_any_one_width() {
        let pem = p256_pem();
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        for width in [64, 76, 70, 4, body.len()] {
            let lines: Vec<String> = body
                .as_bytes()
                .chunks(width)
                .map(|c| String::from_utf8(c.to_vec()).unwrap())
                .collect();
            let text = format!(
                "-----BEGIN PUBLIC KEY-----\r\n{}\r\n-----END PUBLIC KEY-----\r\n",
                lines.join("\r\n")
            );
            let entries = parse(text.as_bytes()).unwrap_or_else(|e| panic!("{width}: {e}"));
            assert_eq!(entries.len(), 1);
        }
        // Lines of different widths are not a PEM encoding.
        assert_eq!(body.len(), 124);
        let ragged = format!(
            "-----BEGIN PUBLIC KEY-----\n{}\n{}\n-----END PUBLIC KEY-----\n",
            &body[..60],
            &body[60..]
        );
        assert!(parse(ragged.as_bytes()).is_err());
    }

    #[test]
    fn the_first_bad_entry_is_named() {
        let (a, pem) = (recovery_line(), p256_pem());
        let two_blocks = format!("{pem}{pem}");
        let no_end = pem.lines().take(2).collect::<Vec<_>>().join("\n");
        for (text, line) in [
            (format!("{a}\nword\n"), 2),
            (format!("{a}\n\ntpmcrypt-recovery:AAAA\n"), 3),
            (format!("# x\n{no_end}\n{a}\n"), 2),
            (format!("{pem}garbage\n"), 5),
            (format!("{pem}-----END PUBLIC KEY-----\n"), 5),
            (two_blocks.replacen("-----END PUBLIC KEY-----\n", "", 1), 1),
            (pem.replace("PUBLIC KEY", "PRIVATE KEY"), 1),
            (pem.replace("PUBLIC KEY", "TSS2 PRIVATE KEY"), 1),
            (format!("{a}\n\u{a0}x\n"), 2),
        ] {
            let err = parse(text.as_bytes())
                .err()
                .unwrap_or_else(|| panic!("{text:?}"));
            assert_eq!(err.line, line, "{text:?}: {err}");
            assert!(matches!(err.error, Error::InvalidRecipient(_)), "{err}");
        }
        let err = parse(b"# \xff\n\xfe\n").err().expect("not UTF-8");
        assert_eq!(err.line, 2);
        assert!(!err.to_string().contains("word"));
    }
}
