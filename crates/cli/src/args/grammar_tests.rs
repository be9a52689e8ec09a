//! The table test of issue #13: every flag that takes a duration or a size
//! takes the one grammar ([`super::value`]), and a bad value is a usage
//! error that shows the valid forms. The table is checked to be complete:
//! a new flag whose value is a DURATION or a SIZE must be added here.

use std::time::Duration;

use clap::{ArgMatches, CommandFactory};

use super::Cli;

const DURATION_FORMS: &str = "e.g. 200ms, 1.5s, 10m, 1h30m, 7d; a bare number is seconds";
const SIZE_FORMS: &str = "e.g. 4096, 64KiB, 16K, 1M, 1.5MiB";

/// (subcommand path, flag, what else the command needs).
fn duration_flags() -> Vec<(
    &'static [&'static str],
    &'static str,
    &'static [&'static str],
)> {
    const WATCH: &[&str] = &["s", "--out", "o", "-R", "x"];
    let mut v: Vec<(&[&str], &str, &[&str])> = vec![
        (&["watch"], "--settle", WATCH),
        (&["watch"], "--stats-interval", WATCH),
        (&["watch"], "--rotate", WATCH),
        (&["agent"], "--ttl", &[]),
        (&["doctor"], "--timeout", &[]),
    ];
    if cfg!(feature = "bench") {
        v.extend([
            (&["bench"][..], "--unbind", &[][..]),
            (&["bench", "watch"], "--duration", &[]),
            (&["bench", "watch"], "--settle", &[]),
            (&["bench", "watch"], "--calibrate-duration", &[]),
        ]);
    }
    v
}

fn size_flags() -> Vec<(
    &'static [&'static str],
    &'static str,
    &'static [&'static str],
)> {
    let mut v: Vec<(&[&str], &str, &[&str])> = vec![(&["encrypt"], "--segment-size", &["-R", "x"])];
    if cfg!(feature = "bench") {
        v.extend([
            (&["bench"][..], "--sizes", &[][..]),
            (&["bench", "watch"], "--size", &[]),
        ]);
    }
    v
}

fn parse(path: &[&str], flag: &str, value: &str, rest: &[&str]) -> Result<ArgMatches, String> {
    let mut argv = vec!["tpmcrypt".to_string()];
    argv.extend(path.iter().chain(rest).map(|s| s.to_string()));
    // `--flag=value`, so that "-1s" reaches the parser as a value.
    argv.push(format!("{flag}={value}"));
    Cli::command()
        .try_get_matches_from(argv)
        .map_err(|e| super::usage_error_line(&e))
}

/// The matches of the innermost subcommand.
fn leaf(m: &ArgMatches) -> &ArgMatches {
    match m.subcommand() {
        Some((_, sub)) => leaf(sub),
        None => m,
    }
}

fn id(flag: &str) -> String {
    flag.trim_start_matches('-').replace('-', "_")
}

/// The duration a flag was given, whichever type it keeps it as.
fn duration_of(m: &ArgMatches, flag: &str) -> Duration {
    let m = leaf(m);
    let id = id(flag);
    if let Ok(Some(d)) = m.try_get_one::<Duration>(&id) {
        return *d;
    }
    let text = m.get_one::<String>(&id).expect("the flag's value");
    super::value::ttl(text).expect("a valid ttl")
}

fn size_of(m: &ArgMatches, flag: &str) -> u64 {
    let m = leaf(m);
    let id = id(flag);
    if let Ok(Some(v)) = m.try_get_one::<u32>(&id) {
        return u64::from(*v);
    }
    *m.get_one::<u64>(&id).expect("the flag's value")
}

#[test]
fn every_duration_flag_takes_every_form_and_refuses_with_the_forms() {
    let good = [
        ("200ms", Duration::from_millis(200)),
        ("1.5s", Duration::from_millis(1500)),
        ("1h30m", Duration::from_secs(5400)),
        ("1h 30m", Duration::from_secs(5400)),
        ("2d", Duration::from_secs(2 * 86400)),
        ("45", Duration::from_secs(45)),
        ("2.5", Duration::from_millis(2500)),
    ];
    for (path, flag, rest) in duration_flags() {
        for (text, want) in good {
            let m = parse(path, flag, text, rest)
                .unwrap_or_else(|e| panic!("{path:?} {flag} {text}: {e}"));
            assert_eq!(duration_of(&m, flag), want, "{path:?} {flag} {text}");
        }
        for bad in ["5y", "10 parsecs", "-1s", "1.5.5s", "ms", ""] {
            let err = parse(path, flag, bad, rest).expect_err(bad);
            assert!(err.contains(DURATION_FORMS), "{flag} {bad:?}: {err}");
        }
    }
}

#[test]
fn every_size_flag_takes_every_form_and_refuses_with_the_forms() {
    let good = [
        ("4096", 4096),
        ("64KiB", 64 << 10),
        ("16K", 16 << 10),
        ("1M", 1 << 20),
        ("1.5MiB", 3 << 19),
    ];
    for (path, flag, rest) in size_flags() {
        for (text, want) in good {
            let m = parse(path, flag, text, rest)
                .unwrap_or_else(|e| panic!("{path:?} {flag} {text}: {e}"));
            let got = match leaf(&m).try_get_many::<u64>(&id(flag)) {
                Ok(Some(mut many)) if flag == "--sizes" => *many.next().expect("one size"),
                _ => size_of(&m, flag),
            };
            assert_eq!(got, want, "{path:?} {flag} {text}");
        }
        for bad in ["1.5", "16KB", "1.3K", "5T", "x", "-4K"] {
            let err = parse(path, flag, bad, rest).expect_err(bad);
            assert!(err.contains(SIZE_FORMS), "{flag} {bad:?}: {err}");
        }
    }
}

/// Every flag of every command whose value is a DURATION or a SIZE is in
/// the tables above, so none escapes the grammar.
#[test]
fn the_tables_name_every_duration_and_size_flag() {
    fn walk(cmd: &clap::Command, path: &mut Vec<String>, found: &mut Vec<(String, String)>) {
        for arg in cmd.get_arguments() {
            let names = arg.get_value_names().unwrap_or_default();
            let kind = names.first().map(|n| n.as_str()).unwrap_or("");
            if ["DURATION", "SIZE", "SIZES", "MS", "BYTES", "SECONDS"].contains(&kind) {
                let flag = format!("--{}", arg.get_long().unwrap_or_default());
                found.push((path.join(" "), flag));
            }
        }
        for sub in cmd.get_subcommands() {
            path.push(sub.get_name().to_string());
            walk(sub, path, found);
            path.pop();
        }
    }
    let mut found = Vec::new();
    walk(&Cli::command(), &mut Vec::new(), &mut found);
    let mut listed: Vec<(String, String)> = duration_flags()
        .into_iter()
        .chain(size_flags())
        .map(|(p, f, _)| (p.join(" "), f.to_string()))
        .collect();
    found.sort();
    listed.sort();
    assert_eq!(found, listed);
}
