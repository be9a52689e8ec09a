//! The front's command line ([`super::FrontCli`]) against the whole one
//! ([`super::Cli`]): for `encrypt` and `decrypt` they must agree on every
//! argument list (both refuse it, or both give the same values), and any
//! other command must not parse in the front (it is handed over).

use std::ffi::OsString;

use clap::{CommandFactory, Parser};

use super::{Cli, Command, FrontCli, FrontCommand};

fn argv(words: &[&str]) -> Vec<OsString> {
    std::iter::once("tpmcrypt")
        .chain(words.iter().copied())
        .map(OsString::from)
        .collect()
}

/// The two parses of `words`, as text (`None`: refused).
fn both(words: &[&str]) -> (Option<String>, Option<String>) {
    let full = Cli::try_parse_from(argv(words)).ok().map(|c| {
        let args = match &c.command {
            Command::Encrypt(a) => format!("encrypt {a:?}"),
            Command::Decrypt(a) => format!("decrypt {a:?}"),
            other => format!("{other:?}"),
        };
        format!("{:?} {args}", c.globals)
    });
    let front = FrontCli::try_parse_from(argv(words)).ok().map(|c| {
        let args = match &c.command {
            FrontCommand::Encrypt(a) => format!("encrypt {a:?}"),
            FrontCommand::Decrypt(a) => format!("decrypt {a:?}"),
        };
        format!("{:?} {args}", c.globals)
    });
    (front, full)
}

#[test]
fn the_front_parses_encrypt_and_decrypt_as_the_whole_command_line_does() {
    let cases: &[&[&str]] = &[
        &["encrypt", "-R", "tpmcrypt-recovery:x", "f"],
        &[
            "-v",
            "encrypt",
            "-q",
            "-R",
            "r",
            "-o",
            "out",
            "--no-sync",
            "f",
        ],
        &["encrypt", "-R", "r", "-r", "--in-place", "dir", "-v"],
        &[
            "--keystore",
            "/k",
            "encrypt",
            "-k",
            "main",
            "-f",
            "-o",
            "o",
            "f",
        ],
        &[
            "encrypt",
            "--keystore=/k",
            "--tpm",
            "swtpm:port=1",
            "-k",
            "a",
            "-k",
            "b",
            "-",
        ],
        &["encrypt", "-R", "r", "--mode", "cbc", "--bits", "128", "f"],
        &[
            "encrypt",
            "-R",
            "r",
            "--segment-size",
            "64KiB",
            "-j",
            "2",
            "f",
        ],
        &["encrypt", "-R", "r", "--backend", "ring", "--armor", "f"],
        &["encrypt", "-R", "r", "--new-session", "f", "g", "h"],
        &["--simulator", "decrypt", "-o", "out", "f.tpmc"],
        &["decrypt", "-i", "id", "--no-sync", "-f", "f.tpmc"],
        &["decrypt", "-i", "id", "-i", "id2", "-r", "--in-place", "d"],
        &["decrypt", "--pin-file", "pin", "-o", "-", "f.tpmc", "-q"],
        &["decrypt", "--", "-f.tpmc"],
        // Refused by both.
        &["encrypt"],
        &["encrypt", "--bogus", "f"],
        &["encrypt", "-R", "r", "--bits", "100", "f"],
        &["decrypt", "-o"],
        &["encrypt", "-R", "r", "--segment-size", "lots", "f"],
    ];
    for words in cases {
        let (front, full) = both(words);
        assert_eq!(front, full, "{words:?}");
    }
    // Every flag of the two commands, alone and with a value, in each
    // position: whatever the whole command line makes of it, the front
    // makes the same.
    let whole = Cli::command();
    for (name, rest) in [
        ("encrypt", ["-R", "r", "f"]),
        ("decrypt", ["-i", "id", "f"]),
    ] {
        let sub = whole.find_subcommand(name).expect(name);
        let mut n = 0;
        for arg in sub.get_arguments() {
            let flag = match (arg.get_long(), arg.get_short()) {
                (Some(l), _) => format!("--{l}"),
                (None, Some(s)) => format!("-{s}"),
                (None, None) => continue,
            };
            for value in [None, Some("1"), Some("x"), Some("256"), Some("gcm")] {
                let mut words = vec![name, flag.as_str()];
                words.extend(value);
                words.extend(rest);
                let (front, full) = both(&words);
                assert_eq!(front, full, "{words:?}");
                n += usize::from(full.is_some());
            }
        }
        assert!(n > 10, "{name}: only {n} argument lists parsed at all");
    }
}

#[test]
fn the_front_parses_no_other_command() {
    for words in [
        &["key", "list"][..],
        &["watch", "s", "--out", "d", "-R", "r"],
        &["inspect", "f"],
        &["rekey", "-R", "r", "f"],
        &["agent"],
        &["completions", "bash"],
        &["--version"],
        &["--help"],
        &["encrypt", "--help"],
        &["decrypt", "-h"],
        &[],
    ] {
        assert!(
            FrontCli::try_parse_from(argv(words)).is_err(),
            "{words:?} parsed in the front"
        );
    }
}
