//! The ASN.1 of the `TSS2 PRIVATE KEY` format (draft-bottomley-tpm2-keys;
//! openssl_tpm2_engine's `tpm2-asn.h`), encoded and decoded with the `der`
//! crate, and its PEM armor with `pem-rfc7468`.
//!
//! Every field of the format is `EXPLICIT`ly tagged:
//!
//! ```text
//! TPMPolicy     ::= SEQUENCE { commandCode [0] EXPLICIT INTEGER,
//!                              commandPolicy [1] EXPLICIT OCTET STRING }
//! TPMAuthPolicy ::= SEQUENCE { name [0] EXPLICIT UTF8String OPTIONAL,
//!                              policy [1] EXPLICIT SEQUENCE OF TPMPolicy }
//! ```
//!
//! and `TPMKey` as shown in [`crate::keyfile`].

use der::asn1::{ContextSpecific, ObjectIdentifier, OctetStringRef, Utf8StringRef};
use der::{
    Decode, DecodeValue, EncodeValue, ErrorKind, FixedTag, Header, Length, Reader, Sequence,
    SliceReader, Tag, TagNumber, Writer,
};

/// id-loadablekey, 2.23.133.10.1.3.
pub(crate) const OID_LOADABLE_KEY: ObjectIdentifier =
    ObjectIdentifier::new_unwrap("2.23.133.10.1.3");
/// id-importablekey, 2.23.133.10.1.4.
pub(crate) const OID_IMPORTABLE_KEY: ObjectIdentifier =
    ObjectIdentifier::new_unwrap("2.23.133.10.1.4");
/// id-sealedkey, 2.23.133.10.1.5.
pub(crate) const OID_SEALED_KEY: ObjectIdentifier = ObjectIdentifier::new_unwrap("2.23.133.10.1.5");

/// Most policy commands a key file may carry.
pub(crate) const MAX_POLICY_COMMANDS: usize = 32;

/// A structural problem in a key file, as one line of text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Asn1Error(pub String);

impl From<der::Error> for Asn1Error {
    fn from(e: der::Error) -> Self {
        Asn1Error(format!("DER: {e}"))
    }
}

fn fail<T>(m: impl Into<String>) -> Result<T, Asn1Error> {
    Err(Asn1Error(m.into()))
}

/// A BOOLEAN that reads any non-zero octet as TRUE and writes DER's 0xFF.
///
/// Hand-written rather than `der`'s `bool`, which (rightly, for DER) refuses
/// a TRUE other than 0xFF: OpenSSL-based writers of this format have been
/// seen emitting other non-zero values, and such files have always loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LaxBool(pub bool);

impl FixedTag for LaxBool {
    const TAG: Tag = Tag::Boolean;
}

impl<'a> DecodeValue<'a> for LaxBool {
    fn decode_value<R: Reader<'a>>(reader: &mut R, header: Header) -> der::Result<Self> {
        if header.length != Length::ONE {
            return Err(reader.error(ErrorKind::Length { tag: Self::TAG }));
        }
        Ok(LaxBool(reader.read_byte()? != 0))
    }
}

impl EncodeValue for LaxBool {
    fn value_len(&self) -> der::Result<Length> {
        Ok(Length::ONE)
    }

    fn encode_value(&self, writer: &mut impl Writer) -> der::Result<()> {
        writer.write_byte(if self.0 { 0xFF } else { 0x00 })
    }
}

/// `TPMPolicy`: one policy command and its parameters.
#[derive(Debug, Clone, PartialEq, Eq, Sequence)]
pub(crate) struct TpmPolicy<'a> {
    #[asn1(context_specific = "0")]
    pub command_code: u32,
    #[asn1(context_specific = "1")]
    pub command_policy: OctetStringRef<'a>,
}

/// `TPMAuthPolicy`: a named policy that a signed (PolicyAuthorize) policy
/// may stand for (see [`crate::signed`]).
#[derive(Debug, Clone, PartialEq, Eq, Sequence)]
pub(crate) struct TpmAuthPolicy<'a> {
    #[asn1(context_specific = "0", optional = "true")]
    pub name: Option<Utf8StringRef<'a>>,
    #[asn1(context_specific = "1")]
    pub policy: Vec<TpmPolicy<'a>>,
}

/// `TPMKey`, the whole key file.
///
/// Encoded with the derived [`Sequence`] code. Decoded with
/// [`TpmKey::decode_strict`] alone, whose optional-field loop is written here
/// because the derived decoder is laxer than this format's reader has
/// always been: it silently skips a repeated or out-of-order optional field
/// (`der`'s context-specific lookup passes over lower tag numbers), cannot
/// name the field it refused ("unknown optional field [6]", an import
/// secret), and refuses well-formed fields after `privkey`,
/// which this reader accepts and ignores so that later revisions of the
/// format stay readable.
#[derive(Debug, Clone, PartialEq, Eq, Sequence)]
pub(crate) struct TpmKey<'a> {
    pub key_type: ObjectIdentifier,
    #[asn1(context_specific = "0", optional = "true")]
    pub empty_auth: Option<LaxBool>,
    #[asn1(context_specific = "1", optional = "true")]
    pub policy: Option<Vec<TpmPolicy<'a>>>,
    #[asn1(context_specific = "2", optional = "true")]
    pub secret: Option<OctetStringRef<'a>>,
    #[asn1(context_specific = "3", optional = "true")]
    pub auth_policy: Option<Vec<TpmAuthPolicy<'a>>>,
    #[asn1(context_specific = "4", optional = "true")]
    pub description: Option<Utf8StringRef<'a>>,
    #[asn1(context_specific = "5", optional = "true")]
    pub rsa_parent: Option<LaxBool>,
    pub parent: u32,
    pub pubkey: OctetStringRef<'a>,
    pub privkey: OctetStringRef<'a>,
}

/// Reads one `[n] EXPLICIT` field.
fn explicit<'a, T: der::Decode<'a>>(r: &mut SliceReader<'a>) -> der::Result<T> {
    Ok(r.decode::<ContextSpecific<T>>()?.value)
}

impl<'a> TpmKey<'a> {
    /// Decodes a whole key file (one SEQUENCE, nothing after it) the way
    /// the format's reader always has; see [`TpmKey`]. Refuses importable
    /// and sealed objects by their OID before reading further, and an
    /// import secret or and reads signed policies (`[3]`).
    pub(crate) fn decode_strict(data: &'a [u8]) -> Result<Self, Asn1Error> {
        let mut outer = SliceReader::new(data)?;
        let header = Header::decode(&mut outer)?;
        header.tag.assert_eq(Tag::Sequence)?;
        let body = outer.read_slice(header.length)?;
        outer.finish(())?;
        let mut r = SliceReader::new(body)?;

        let key_type: ObjectIdentifier = r.decode()?;
        if key_type == OID_IMPORTABLE_KEY {
            return fail(
                "importable TPM keys (OID 2.23.133.10.1.4) are not supported; load it with \
                 tpm2-tools and re-encode it with tpm2_encodeobject",
            );
        }
        if key_type == OID_SEALED_KEY {
            return fail("this is a sealed data object (OID 2.23.133.10.1.5), not a key");
        }
        if key_type != OID_LOADABLE_KEY {
            return fail("not a TPM loadable key (wrong OID)");
        }
        let mut key = TpmKey {
            key_type,
            empty_auth: None,
            policy: None,
            secret: None,
            auth_policy: None,
            description: None,
            rsa_parent: None,
            parent: 0,
            pubkey: OctetStringRef::new(&[])?,
            privkey: OctetStringRef::new(&[])?,
        };
        key.decode_optional_fields(&mut r)?;
        key.parent = r.decode()?;
        key.pubkey = r.decode()?;
        key.privkey = r.decode()?;
        while !r.is_finished() {
            r.decode::<der::asn1::AnyRef<'a>>()?;
        }
        Ok(key)
    }

    /// The context-tagged fields between `type` and `parent`, each at most
    /// once and in increasing tag order.
    fn decode_optional_fields(&mut self, r: &mut SliceReader<'a>) -> Result<(), Asn1Error> {
        let mut last: Option<TagNumber> = None;
        while let Ok(Tag::ContextSpecific { number, .. }) = r.peek_tag() {
            if last.is_some_and(|l| number <= l) {
                return fail("optional fields out of order or repeated");
            }
            last = Some(number);
            match number.value() {
                0 => self.empty_auth = Some(explicit(r)?),
                1 => {
                    let policy: Vec<TpmPolicy<'a>> = explicit(r)?;
                    if policy.len() > MAX_POLICY_COMMANDS {
                        return fail("too many policy commands");
                    }
                    self.policy = Some(policy);
                }
                2 => {
                    explicit::<OctetStringRef<'a>>(r)?;
                    return fail("key has an import secret; only loadable keys are supported");
                }
                3 => {
                    let policies: Vec<TpmAuthPolicy<'a>> = explicit(r)?;
                    if policies.len() > crate::signed::MAX_SIGNED_POLICIES
                        || policies
                            .iter()
                            .any(|p| p.policy.len() > MAX_POLICY_COMMANDS)
                    {
                        return fail("too many signed policies or policy commands");
                    }
                    self.auth_policy = Some(policies);
                }
                4 => {
                    let description = explicit(r).map_err(|e| match e.kind() {
                        ErrorKind::Utf8(_) => Asn1Error("description is not UTF-8".into()),
                        _ => Asn1Error::from(e),
                    })?;
                    self.description = Some(description);
                }
                5 => self.rsa_parent = Some(explicit(r)?),
                n => return fail(format!("unknown optional field [{n}]")),
            }
        }
        Ok(())
    }
}

/// The PEM label of a key file.
pub(crate) const PEM_LABEL: &str = "TSS2 PRIVATE KEY";

/// Largest PEM block read (a key file is a few kilobytes).
const MAX_PEM: usize = 1 << 20;

/// Decodes the `label` PEM block found in `text`, which may have other text
/// around it (comments, other blocks), with CRLF or LF line ends.
///
/// Finding the block is written here: `pem-rfc7468` reads one block that
/// ends its input, and key files have always been accepted with text after
/// the block and with other blocks before it. The block itself (its
/// boundaries, label and base64) is decoded by `pem-rfc7468`, whose lines
/// must all have the width of the first but the last: every known writer
/// wraps at 64 columns (OpenSSL's PEM writer, which tpm2-tools,
/// tpm2-openssl and openssl_tpm2_engine use), others at 76 or not at all.
pub(crate) fn pem_decode(text: &str, label: &str) -> Result<Vec<u8>, Asn1Error> {
    let begin = format!("-----BEGIN {label}-----");
    let end = format!("-----END {label}-----");
    let start = text
        .find(&begin)
        .ok_or_else(|| Asn1Error(format!("no '{begin}' line")))?;
    let stop = text[start..]
        .find(&end)
        .map(|i| start + i + end.len())
        .ok_or_else(|| Asn1Error(format!("no '{end}' line")))?;
    let block = &text.as_bytes()[start..stop];
    if block.len() > MAX_PEM {
        return fail("PEM too large");
    }
    let bad = |e: pem_rfc7468::Error| Asn1Error(format!("bad PEM block: {e}"));
    let width = block
        .split(|&b| b == b'\n')
        .nth(1)
        .map_or(0, |l| l.trim_ascii_end().len())
        .max(4);
    let mut decoder = pem_rfc7468::Decoder::new_wrapped(block, width).map_err(bad)?;
    let mut der = Vec::new();
    decoder.decode_to_end(&mut der).map_err(bad)?;
    Ok(der)
}

/// Encodes a PEM block: 64-column lines, LF line ends.
pub(crate) fn pem_encode(der: &[u8], label: &str) -> Result<String, Asn1Error> {
    pem_rfc7468::encode_string(label, pem_rfc7468::LineEnding::LF, der)
        .map_err(|e| Asn1Error(format!("PEM: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use der::Encode as _;

    const TOOLS_PEM: &str = include_str!("../tests/data/tpm2-tools-rsa2048.pem");

    fn tools_key() -> Vec<u8> {
        pem_decode(TOOLS_PEM, PEM_LABEL).unwrap()
    }

    /// The tpm2-tools key with `fields` (whole TLVs) in place of its
    /// optional fields, and `tail` after privkey.
    fn with_fields(fields: &[&[u8]], tail: &[u8]) -> Vec<u8> {
        let der = tools_key();
        let key = TpmKey::decode_strict(&der).unwrap();
        let mut body = key.key_type.to_der().unwrap();
        fields.iter().for_each(|f| body.extend_from_slice(f));
        body.extend(key.parent.to_der().unwrap());
        body.extend(key.pubkey.to_der().unwrap());
        body.extend(key.privkey.to_der().unwrap());
        body.extend_from_slice(tail);
        let mut out = Header::new(Tag::Sequence, Length::try_from(body.len()).unwrap())
            .unwrap()
            .to_der()
            .unwrap();
        out.extend(body);
        out
    }

    fn refusal(der: &[u8]) -> String {
        TpmKey::decode_strict(der).unwrap_err().0
    }

    #[test]
    fn optional_fields_are_read_in_order_once_and_named_when_refused() {
        const EA_TRUE_01: &[u8] = &[0xA0, 3, 1, 1, 0x01];
        const RSA_PARENT: &[u8] = &[0xA5, 3, 1, 1, 0xFF];
        let der = with_fields(&[EA_TRUE_01, RSA_PARENT], &[]);
        let key = TpmKey::decode_strict(&der).unwrap();
        assert_eq!(
            key.empty_auth,
            Some(LaxBool(true)),
            "a TRUE of 0x01 is TRUE"
        );
        assert_eq!(key.rsa_parent, Some(LaxBool(true)));
        for (fields, want) in [
            (&[EA_TRUE_01, EA_TRUE_01][..], "out of order or repeated"),
            (&[RSA_PARENT, EA_TRUE_01], "out of order or repeated"),
            (&[&[0xA6, 3, 1, 1, 0xFF]], "unknown optional field [6]"),
            (&[&[0xA2, 4, 4, 2, 1, 2]], "import secret"),
            (&[&[0xA4, 3, 0x0C, 1, 0xFF]], "description is not UTF-8"),
            (
                &[&[0xA0, 4, 1, 2, 0, 0]],
                "DER: incorrect length for BOOLEAN",
            ),
        ] {
            let msg = refusal(&with_fields(fields, &[]));
            assert!(msg.contains(want), "{msg}");
            assert!(!msg.contains('\n'), "{msg}");
        }
        // A well-formed field after privkey is skipped; a broken one is not.
        TpmKey::decode_strict(&with_fields(&[], &[0xA0, 3, 1, 1, 0xFF])).unwrap();
        assert!(refusal(&with_fields(&[], &[0xA0, 3, 1])).starts_with("DER: "));
    }

    #[test]
    fn auth_policy_is_read_and_its_shape_checked() {
        let der = tools_key();
        let mut key = TpmKey::decode_strict(&der).unwrap();
        let one = TpmAuthPolicy {
            name: Some(Utf8StringRef::new("signed").unwrap()),
            policy: vec![TpmPolicy {
                command_code: 0x16B,
                command_policy: OctetStringRef::new(&[]).unwrap(),
            }],
        };
        key.auth_policy = Some(vec![one.clone()]);
        let encoded = key.to_der().unwrap();
        let back = TpmKey::decode_strict(&encoded).unwrap();
        assert_eq!(back.auth_policy, Some(vec![one.clone()]));
        key.auth_policy = Some(vec![one; crate::signed::MAX_SIGNED_POLICIES + 1]);
        let msg = refusal(&key.to_der().unwrap());
        assert_eq!(msg, "too many signed policies or policy commands");
        // Not an authPolicy at all: said as a DER error, not as a policy.
        let msg = refusal(&with_fields(&[&[0xA3, 3, 1, 1, 0xFF]], &[]));
        assert!(msg.starts_with("DER: unexpected ASN.1 DER tag"), "{msg}");
    }

    #[test]
    fn pem_blocks_are_found_in_text_and_decoded_strictly() {
        let der = tools_key();
        let body: String = TOOLS_PEM
            .lines()
            .filter(|l| !l.starts_with("-----"))
            .collect();
        let wrapped = |width: usize| {
            let lines: Vec<&str> = body
                .as_bytes()
                .chunks(width)
                .map(|c| std::str::from_utf8(c).unwrap())
                .collect();
            format!(
                "-----BEGIN TSS2 PRIVATE KEY-----\n{}\n-----END TSS2 PRIVATE KEY-----\n",
                lines.join("\n")
            )
        };
        for text in [
            TOOLS_PEM.to_string(),
            TOOLS_PEM.replace('\n', "\r\n"),
            format!("# a comment\n{TOOLS_PEM}and text after\n"),
            format!("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n{TOOLS_PEM}"),
            wrapped(76),
            wrapped(body.len()),
        ] {
            assert_eq!(pem_decode(&text, PEM_LABEL).unwrap(), der, "{text}");
        }
        assert_eq!(pem_encode(&der, PEM_LABEL).unwrap(), TOOLS_PEM);
        // Lines of uneven width are not base64 as RFC 7468 wraps it.
        let uneven = TOOLS_PEM.replacen('\n', "\n\n", 2);
        let msg = pem_decode(&uneven, PEM_LABEL).unwrap_err().0;
        assert!(msg.starts_with("bad PEM block: "), "{msg}");
    }
}
