//! The command line: every subcommand and flag, documented where it is
//! declared (clap turns these doc comments into `--help`).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Encrypt files with keys bound to this machine's TPM.
#[derive(Parser, Debug)]
#[command(name = "tpmcrypt", version, about, long_about = None)]
pub struct Cli {
    /// Print a summary (files, bytes, session key unwraps) on stderr.
    #[arg(short, long, global = true)]
    pub verbose: bool,

    /// Never show a progress bar.
    #[arg(short, long, global = true)]
    pub quiet: bool,

    /// Key directory (default: $XDG_DATA_HOME/tpmcrypt).
    #[arg(long, global = true, env = "TPMCRYPT_HOME", value_name = "DIR")]
    pub keystore: Option<PathBuf>,

    /// The TPM, as a TCTI in tpm2-tools syntax (device:/dev/tpmrm0,
    /// swtpm:host=127.0.0.1,port=2321, tabrmd). Default device:/dev/tpmrm0.
    #[arg(long, global = true, env = "TPMCRYPT_TCTI", value_name = "TCTI", value_parser = tcti_value)]
    pub tpm: Option<String>,

    /// Use a private software TPM (swtpm) whose state lives in the keystore.
    /// For trying the tool: it is NOT secure.
    #[arg(long, global = true, env = "TPMCRYPT_SIMULATOR", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::SetTrue)]
    pub simulator: bool,

    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Encrypt files (or stdin) to one or more recipients.
    Encrypt(EncryptArgs),
    /// Decrypt files (or stdin) with identities.
    ///
    /// A key's PIN comes from TPMCRYPT_PIN or a prompt. A PIN the TPM
    /// refuses is never presented again in the run: a wrong TPMCRYPT_PIN
    /// costs one dictionary-attack try per key, however many files and
    /// sessions; on a terminal you are asked again, each PIN typed costing
    /// one try, at most 3 per key.
    Decrypt(DecryptArgs),
    /// Print a file's header without decrypting it.
    Inspect(InspectArgs),
    /// Keep a directory encrypted: encrypt every file that lands in it.
    Watch(crate::commands::watch::WatchArgs),
    /// Measure where the time goes: TPM unbind vs bulk AES, by file size.
    #[cfg(feature = "bench")]
    Bench(crate::commands::bench::BenchArgs),
    /// Manage TPM keys.
    #[command(subcommand)]
    Key(crate::commands::key::KeyCommand),
    /// Hold unwrapped session keys for a while (one TPM operation per session).
    Agent(crate::commands::agent::AgentArgs),
    /// Manage software recovery keys.
    #[command(subcommand)]
    Recovery(RecoveryCommand),
    /// Print a shell completion script.
    Completions {
        /// Shell to generate for.
        shell: clap_complete::Shell,
    },
}

/// Payload mode.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModeArg {
    /// Segmented AES-GCM, Tink AES-GCM-HKDF streaming compatible (default).
    Gcm,
    /// Segmented AES-CBC with HMAC-SHA2 (RFC 7518), encrypt-then-MAC.
    Cbc,
}

/// AES key size.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BitsArg {
    /// AES-128.
    #[value(name = "128")]
    B128,
    /// AES-192 (not Tink-interoperable in gcm mode).
    #[value(name = "192")]
    B192,
    /// AES-256 (default).
    #[value(name = "256")]
    B256,
}

impl BitsArg {
    /// Key size in bits.
    pub fn bits(self) -> u32 {
        match self {
            BitsArg::B128 => 128,
            BitsArg::B192 => 192,
            BitsArg::B256 => 256,
        }
    }
}

/// Crypto backend.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendArg {
    /// OpenSSL EVP.
    Openssl,
    /// ring (GCM 128/256 only).
    Ring,
    /// RustCrypto (pure Rust).
    Rustcrypto,
}

impl BackendArg {
    /// The backend's name in the cipher crate.
    pub fn name(self) -> &'static str {
        match self {
            BackendArg::Openssl => "openssl",
            BackendArg::Ring => "ring",
            BackendArg::Rustcrypto => "rustcrypto",
        }
    }
}

/// Options shared by encrypt and decrypt: where inputs come from and where
/// outputs go.
#[derive(Args, Debug, Clone)]
pub struct FileArgs {
    /// Output file ("-" for stdout). Only with a single input.
    #[arg(short, long, value_name = "OUT")]
    pub output: Option<PathBuf>,

    /// Recurse into directories given as inputs (symlinks are not followed).
    #[arg(short = 'r', long)]
    pub recursive: bool,

    /// Replace each input with its output: the original is removed only
    /// after the output is fsynced and renamed into place, and only if it
    /// is still the file that was read (one that changed is kept).
    #[arg(long, conflicts_with = "output")]
    pub in_place: bool,

    /// Overwrite existing outputs.
    #[arg(short, long)]
    pub force: bool,

    /// Rename outputs into place without waiting for the disk, as cp does.
    /// Faster for large files; but after a power failure an output may be
    /// empty or short (it then fails to decrypt, never decrypts wrong).
    /// Not allowed with --in-place, which removes originals.
    #[arg(long, conflicts_with = "in_place")]
    pub no_sync: bool,

    /// Worker threads for large inputs (default: number of CPUs).
    #[arg(short = 'j', long, value_name = "N")]
    pub jobs: Option<usize>,

    /// Write the run's figures (files, bytes, time, files/s, commit time,
    /// unwraps, TPM unbinds and time) as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub stats_json: Option<PathBuf>,

    /// Force a crypto backend (default: the fastest measured for the mode).
    #[arg(long, value_enum)]
    pub backend: Option<BackendArg>,

    /// Input files or directories; none or "-" reads stdin.
    #[arg(value_name = "INPUT")]
    pub inputs: Vec<PathBuf>,
}

/// `tpmcrypt encrypt`.
#[derive(Args, Debug)]
pub struct EncryptArgs {
    /// Recipient: a recovery recipient string (tpmcrypt-recovery:…), or a
    /// recipients file ("-" for stdin): recovery recipient lines and PEM
    /// public keys (e.g. `key export` output), # comments. May be repeated.
    #[arg(
        short = 'R',
        long = "recipient",
        value_name = "RECIPIENT",
        required_unless_present = "keys"
    )]
    pub recipients: Vec<std::ffi::OsString>,

    /// A TPM key from the keystore, by name (its public half only: no TPM
    /// is needed to encrypt). Its recovery recipients are added too.
    #[arg(short = 'k', long = "key", value_name = "NAME")]
    pub keys: Vec<String>,

    /// Payload mode.
    #[arg(long, value_enum, default_value_t = ModeArg::Gcm)]
    pub mode: ModeArg,

    /// AES key size in bits (192 is not Tink-interoperable).
    #[arg(long, value_enum, default_value_t = BitsArg::B256)]
    pub bits: BitsArg,

    /// Ciphertext segment size in bytes (advanced; default 1 MiB).
    #[arg(long, value_name = "BYTES", hide = true)]
    pub segment_size: Option<u32>,

    /// Start a session of this run's own even when an agent runs (by
    /// default `encrypt` joins the agent's current session for the same
    /// recipients and parameters, so that files encrypted by many runs
    /// decrypt with one TPM operation).
    #[arg(long)]
    pub new_session: bool,

    /// Allow writing ciphertext to a terminal.
    #[arg(long, hide = true)]
    pub allow_tty: bool,

    #[command(flatten)]
    pub files: FileArgs,
}

/// `tpmcrypt decrypt`.
#[derive(Args, Debug)]
pub struct DecryptArgs {
    /// Identity file (a recovery identity). May be repeated. Keys in the
    /// keystore are always tried too (the TPM is used only if a file is
    /// addressed to one of them).
    #[arg(short = 'i', long = "identity", value_name = "IDENTITY")]
    pub identities: Vec<PathBuf>,

    #[command(flatten)]
    pub files: FileArgs,
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

/// `tpmcrypt recovery …`.
#[derive(Subcommand, Debug)]
pub enum RecoveryCommand {
    /// Create a recovery identity and print its recipient string.
    Create {
        /// Where to write the identity (mode 0600). Keep it offline.
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
        /// Overwrite an existing identity, destroying it (asks first; --yes
        /// to confirm without a terminal).
        #[arg(short, long)]
        force: bool,
        /// With --force: overwrite without asking.
        #[arg(long, requires = "force")]
        yes: bool,
    },
    /// Print the recipient string of an existing recovery identity.
    Recipient {
        /// The identity file.
        identity: PathBuf,
    },
}

/// `--tpm`/`TPMCRYPT_TCTI`, checked as it is parsed so that a bad TCTI is
/// a usage error (exit 2), whichever command would have used it.
/// An empty value (`TPMCRYPT_TCTI=`) means the default, as an unset one.
pub fn tcti_value(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Ok(String::new());
    }
    s.parse::<tpmcrypt_tpmkey::Tcti>()
        .map(|_| s.to_string())
        .map_err(value_error)
}

/// `--pcrs BANK:LIST`, checked as it is parsed (a bad bank or index is a
/// usage error).
pub fn pcrs_value(s: &str) -> Result<String, String> {
    tpmcrypt_tpmkey::PcrSelection::parse(s)
        .map(|_| s.to_string())
        .map_err(value_error)
}

/// `--ttl DURATION`, checked as it is parsed.
pub fn ttl_value(s: &str) -> Result<String, String> {
    tpmcrypt_tpmkey::agent::parse_duration(s)
        .map(|_| s.to_string())
        .map_err(value_error)
}

/// A library's "invalid input: …" as clap shows it after "invalid value
/// '…' for '--flag'": the reason alone.
fn value_error(e: tpmcrypt_tpmkey::Error) -> String {
    match e {
        tpmcrypt_tpmkey::Error::InvalidInput(reason) => reason,
        other => other.to_string(),
    }
}

/// A clap parse error as the one line every tpmcrypt error is: clap's
/// `error: …` with its details (the valid values, a tip) joined on, and
/// without the usage block and the `--help` pointer that follow.
pub fn usage_error_line(err: &clap::Error) -> String {
    let text = err.render().to_string();
    let mut line = String::new();
    for part in text.lines().map(str::trim) {
        if part.starts_with("Usage:") || part.starts_with("For more information") {
            break;
        }
        if part.is_empty() {
            continue;
        }
        if !line.is_empty() {
            line.push_str(if line.ends_with(':') { " " } else { "; " });
        }
        line.push_str(part);
    }
    line.push_str(" (see --help)");
    line
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{usage_error_line, Cli};

    fn line_for(args: &[&str]) -> String {
        let err = Cli::try_parse_from(args).expect_err("a usage error");
        usage_error_line(&err)
    }

    #[test]
    fn parse_errors_are_one_line_with_their_details() {
        let bits = line_for(&["tpmcrypt", "encrypt", "--bits", "100", "-R", "x"]);
        assert_eq!(
            bits,
            "error: invalid value '100' for '--bits <BITS>'; \
             [possible values: 128, 192, 256] (see --help)"
        );
        let missing = line_for(&["tpmcrypt", "recovery", "create"]);
        assert_eq!(
            missing,
            "error: the following required arguments were not provided: \
             --out <FILE> (see --help)"
        );
        let typo = line_for(&["tpmcrypt", "encrypt", "--bitz", "128"]);
        assert!(typo.starts_with("error: unexpected argument '--bitz' found; "));
        assert!(typo.contains("--bits"), "{typo}");
        for line in [bits, missing, typo] {
            assert!(!line.contains('\n'), "{line:?}");
        }
    }
}
