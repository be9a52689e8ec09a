//! The command line: every subcommand and flag, documented where it is
//! declared (clap turns these doc comments into `--help`). Each command's
//! own flags live in its module (`commands::…`); the values several
//! commands share, and their parsers, in [`value`].

pub mod value;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// Encrypt files with keys bound to this machine's TPM.
#[derive(Parser, Debug)]
#[command(name = "tpmcrypt", version, long_version = crate::version::LONG, about, long_about = None)]
pub struct Cli {
    #[command(flatten)]
    pub globals: Globals,

    #[command(subcommand)]
    pub command: Command,
}

// The options every command takes, before or after its name. (No doc
// comment: clap would take it for the about of the command it is
// flattened into.)
#[derive(Args, Debug)]
pub struct Globals {
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
    /// swtpm:host=127.0.0.1,port=2321, tabrmd). Without it: TPMCRYPT_TCTI,
    /// then TPM2TOOLS_TCTI, then TSS2_TCTI, then device:/dev/tpmrm0.
    #[arg(long, global = true, env = "TPMCRYPT_TCTI", value_name = "TCTI", value_parser = value::tcti_value)]
    pub tpm: Option<String>,

    /// Use a private software TPM (swtpm) whose state lives in the keystore.
    /// For trying the tool: it is NOT secure.
    #[arg(long, global = true, env = "TPMCRYPT_SIMULATOR", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::SetTrue)]
    pub simulator: bool,

    /// Read a key's PIN from FILE (decrypt, key create): one line, in a
    /// file of yours that nobody else may read (chmod 600). See `decrypt
    /// --help` for every PIN source, in order.
    #[arg(long, global = true, value_name = "FILE")]
    pub pin_file: Option<PathBuf>,
}

/// The command line as the front (`tpmcrypt`, see `front.rs`) parses it:
/// the global options and only the two commands it may serve, with the
/// very arguments `tpmcrypt-full` parses them with. Building the whole
/// tree (every command's arguments, `bench`'s and `watch`'s among them)
/// was about 6 % of the CPU time of a short `encrypt`. Any other command,
/// and any command-line error, fails to parse here, and the run is
/// handed to `tpmcrypt-full`, which says what it says of it.
#[derive(Parser, Debug)]
#[command(name = "tpmcrypt")]
pub struct FrontCli {
    #[command(flatten)]
    pub globals: Globals,

    #[command(subcommand)]
    pub command: FrontCommand,
}

/// The commands the front may serve.
#[derive(Subcommand, Debug)]
pub enum FrontCommand {
    /// As [`Command::Encrypt`].
    Encrypt(crate::commands::crypt::EncryptArgs),
    /// As [`Command::Decrypt`].
    Decrypt(crate::commands::crypt::DecryptArgs),
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Encrypt files (or stdin) to one or more recipients.
    Encrypt(crate::commands::crypt::EncryptArgs),
    /// Decrypt files (or stdin) with identities.
    ///
    /// A key's PIN comes from, first that has one: --pin-file FILE; the
    /// systemd credential tpmcrypt-pin.KEY or tpmcrypt-pin (in
    /// $CREDENTIALS_DIRECTORY); TPMCRYPT_PIN (the weakest: for tests); the
    /// terminal; without a terminal, TPMCRYPT_ASKPASS (or SSH_ASKPASS with
    /// a display). A PIN the TPM refuses is never presented again in the
    /// run: a wrong PIN from a file or TPMCRYPT_PIN costs one
    /// dictionary-attack try per key, however many files and sessions; a
    /// typed one (terminal, askpass) is asked for again, each PIN typed
    /// costing one try, at most 3 per key.
    Decrypt(crate::commands::crypt::DecryptArgs),
    /// Re-encrypt files in place to new recipients (a new TPM key, a
    /// retired key, a rotated recovery key), keeping their recovery
    /// recipients unless told otherwise. See docs/rekey.md.
    Rekey(crate::commands::rekey::RekeyArgs),
    /// Print a file's header without decrypting it.
    Inspect(crate::commands::inspect::InspectArgs),
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
    Recovery(crate::commands::recovery::RecoveryCommand),
    /// Check whether this machine can use tpmcrypt, and if not, why.
    ///
    /// Read-only: no dictionary-attack try is spent, no TPM state changes.
    /// Exit status 0 when all is well; otherwise the sum of a bit per
    /// missing capability: 4 no TPM, 8 algorithms, 16 lockout, 32 keys,
    /// 64 PCR policy, 128 agent (docs/doctor.md).
    Doctor(crate::commands::doctor::DoctorArgs),
    /// Make a PCR signer (signs PCR policies for keys made with --pcr-signer).
    #[command(subcommand, name = "pcr-signer")]
    PcrSigner(crate::commands::pcr::PcrSignerCommand),
    /// Signed PCR policies: sign PCR values for keys made with --pcr-signer.
    #[command(subcommand)]
    Pcr(crate::commands::pcr::PcrCommand),
    /// Print a shell completion script.
    Completions {
        /// Shell to generate for.
        shell: clap_complete::Shell,
    },
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

    use std::time::Duration;

    use super::{usage_error_line, Cli, Command};

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

    #[test]
    fn every_duration_and_size_flag_takes_the_one_grammar() {
        let watch = ["tpmcrypt", "watch", "s", "--out", "o", "-R", "x"];
        let cli = Cli::try_parse_from(
            watch
                .iter()
                .chain(&["--settle", "1h30m", "--rotate", "1.5h"]),
        )
        .expect("compound and decimal durations");
        let Command::Watch(w) = cli.command else {
            panic!("not watch")
        };
        assert_eq!(w.settle, Duration::from_secs(5400));
        assert_eq!(w.rotate, Some(Duration::from_secs(5400)));
        Cli::try_parse_from(["tpmcrypt", "agent", "--ttl", "1h 30m"]).expect("--ttl 1h 30m");
        Cli::try_parse_from(["tpmcrypt", "agent", "--ttl", "45"]).expect("--ttl in seconds");
        // A bad value is a usage error that shows the valid forms.
        let settle: Vec<&str> = watch.iter().chain(&["--settle", "5y"]).copied().collect();
        assert!(line_for(&settle).contains("e.g. 200ms, 1.5s, 10m, 1h30m"));
        let ttl = line_for(&["tpmcrypt", "agent", "--ttl", "5x"]);
        assert!(ttl.contains("e.g. 200ms, 1.5s, 10m, 1h30m"), "{ttl}");
        let sizes = line_for(&["tpmcrypt", "bench", "--sizes", "16K,5Q"]);
        assert!(sizes.contains("e.g. 4096, 64KiB, 16K, 1M"), "{sizes}");
    }
}

#[cfg(test)]
mod front_tests;
#[cfg(test)]
mod grammar_tests;

#[cfg(test)]
mod range_tests {
    use super::*;

    /// A `--ttl` the agent cannot add to its clock is a usage error, not
    /// an agent that panics at its first request (a hostile tester's
    /// `--ttl 18446744073709551615` and `--ttl 213503982334601d`).
    #[test]
    fn a_ttl_beyond_any_clock_is_a_usage_error() {
        for ttl in ["18446744073709551615", "213503982334601d", "40000d"] {
            let r = Cli::try_parse_from(["tpmcrypt", "agent", "--ttl", ttl]);
            assert!(r.is_err(), "--ttl {ttl} accepted");
        }
        assert!(Cli::try_parse_from(["tpmcrypt", "agent", "--ttl", "30d"]).is_ok());
    }

    /// The load generator's rates and utilisation are finite and positive:
    /// NaN, infinity and values that make a zero or endless interval are
    /// usage errors (they panicked or never ended).
    #[cfg(feature = "bench")]
    #[test]
    fn bench_watch_rates_are_finite_and_positive() {
        let base = ["tpmcrypt", "bench", "watch"];
        for (flag, v) in [
            ("--rate", "nan"),
            ("--rate", "inf"),
            ("--rate", "1e-300"),
            ("--rate", "1e308"),
            ("--rate", "0"),
            ("--calibrate-rate", "nan"),
            ("--calibrate-rate", "0"),
            ("--calibrate-rate", "inf"),
            ("--utilisation", "0"),
            ("--utilisation", "nan"),
            ("--utilisation", "1e-300"),
        ] {
            let args: Vec<&str> = base.iter().copied().chain([flag, v]).collect();
            let r = Cli::try_parse_from(args);
            assert!(r.is_err(), "{flag} {v} accepted");
        }
        let ok: Vec<&str> = base.iter().copied().chain(["--rate", "2000"]).collect();
        assert!(Cli::try_parse_from(ok).is_ok());
    }
}
