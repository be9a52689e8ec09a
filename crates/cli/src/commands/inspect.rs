//! `tpmcrypt inspect`: the header, without decrypting. JSON field names are
//! documented in docs/format.md ("inspect --json").

use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;
use serde::Serialize;
use tpmcrypt_cipher::armor::{self, ArmoredReader};
use tpmcrypt_cipher::recipient::kind;
use tpmcrypt_cipher::{Decryptor, Header, Mode};

use crate::keys;

#[derive(Serialize)]
struct RecipientInfo {
    kind: &'static str,
    kind_id: u8,
    fingerprint: String,
}

#[derive(Serialize)]
struct Inspect {
    file: String,
    /// The path's exact bytes, when it is not UTF-8 (`file` then shows
    /// those bytes escaped, `\xNN`).
    #[serde(skip_serializing_if = "Option::is_none")]
    file_hex: Option<String>,
    format_version: u8,
    /// Whether the file is ASCII armor (the other fields describe the
    /// binary file it holds).
    armored: bool,
    mode: &'static str,
    key_bits: u32,
    segment_size: u32,
    header_length: usize,
    payload_offset: usize,
    session_id: String,
    hkdf_hash: &'static str,
    tink_compatible: bool,
    recipients: Vec<RecipientInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    session_key: Option<String>,
}

/// `tpmcrypt inspect`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// The file to inspect.
    pub file: PathBuf,

    /// Print JSON (field names are documented in docs/format.md).
    #[arg(long)]
    pub json: bool,

    /// Identity used with --reveal-session-key.
    #[arg(short = 'i', long = "identity", value_name = "IDENTITY")]
    pub identities: Vec<PathBuf>,

    /// DANGEROUS: print the unwrapped session key in hex (for escrow, or to
    /// decrypt the payload with another implementation such as Tink). Anyone
    /// who sees it can decrypt every file of the session.
    #[arg(long, requires = "identities")]
    pub reveal_session_key: bool,
}

/// Runs `inspect`.
pub fn run(args: &InspectArgs) -> anyhow::Result<i32> {
    let label = || crate::ui::shown(&args.file);
    // Binary or armored: the first byte decides (tpmcrypt_cipher::armor).
    let mut input = ArmoredReader::new(File::open(&args.file).with_context(label)?);
    let header = Header::read_from(&mut input)
        .map_err(armor::lift)
        .with_context(label)?;
    let session_key = if args.reveal_session_key {
        let identities = args
            .identities
            .iter()
            .map(|p| keys::load_identity(p))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let key = Decryptor::new(identities)
            .session_key(&header)
            .with_context(label)?;
        Some(hex::encode(key.expose()))
    } else {
        None
    };
    let params = header.params;
    let info = Inspect {
        file: label(),
        file_hex: args
            .file
            .to_str()
            .is_none()
            .then(|| hex::encode(args.file.as_os_str().as_bytes())),
        format_version: tpmcrypt_cipher::format::VERSION,
        armored: input.is_armored(),
        mode: params.mode.name(),
        key_bits: params.key_bits(),
        segment_size: params.segment_size,
        header_length: header.payload_offset(),
        payload_offset: header.payload_offset(),
        session_id: hex::encode(header.session_id()),
        hkdf_hash: "SHA256",
        tink_compatible: params.mode == Mode::Gcm && params.key_len != 24,
        recipients: header
            .stanzas
            .iter()
            .map(|s| RecipientInfo {
                kind: kind::name(s.kind),
                kind_id: s.kind,
                fingerprint: s.fingerprint().map(hex::encode).unwrap_or_default(),
            })
            .collect(),
        session_key,
    };
    crate::ui::stdout::write_all(render(&info, args.json)?.as_bytes())?;
    Ok(crate::ui::exit::OK)
}

/// The text `inspect` prints: JSON, or one field a line.
fn render(info: &Inspect, json: bool) -> anyhow::Result<String> {
    use std::fmt::Write as _;
    if json {
        return Ok(serde_json::to_string_pretty(info)? + "\n");
    }
    let mut out = String::new();
    let tink = if info.tink_compatible { "yes" } else { "no" };
    writeln!(out, "file:            {}", info.file)?;
    writeln!(out, "format version:  {}", info.format_version)?;
    if info.armored {
        writeln!(out, "armor:           yes (ASCII armor of the binary file)")?;
    }
    writeln!(out, "mode:            {}", info.mode)?;
    writeln!(out, "key bits:        {}", info.key_bits)?;
    writeln!(
        out,
        "segment size:    {} bytes (ciphertext)",
        info.segment_size
    )?;
    writeln!(
        out,
        "payload offset:  {} (the Tink-compatible stream starts here)",
        info.payload_offset
    )?;
    writeln!(out, "tink compatible: {tink}")?;
    writeln!(out, "session id:      {}", info.session_id)?;
    writeln!(out, "recipients:")?;
    for r in &info.recipients {
        writeln!(out, "  {:<14} {}", r.kind, r.fingerprint)?;
    }
    if let Some(key) = &info.session_key {
        writeln!(out, "session key:     {key}")?;
    }
    Ok(out)
}
