//! The conventions of issue #13, through the real binary: colour only on a
//! terminal and never with NO_COLOR (commands, clap, the watch daemon's
//! log); one duration and one size grammar, bad values exit 2 showing the
//! valid forms; `--json` a flag that switches stdout to JSON, files named
//! by `--json-file`; RFC 3339 timestamps in JSON and logs.

mod common;

use std::path::Path;
use std::process::Command;

use common::{run, tpmcrypt, wrapper};

const ESC: &str = "\x1b[";

/// Runs tpmcrypt with `args` on a pseudo-terminal (util-linux `script`),
/// stdin, stdout and stderr all on it, with `env` set; returns what the
/// terminal showed. `timeout` (seconds) stops a daemon with SIGTERM.
fn on_a_terminal(dir: &Path, args: &[&str], env: &[(&str, &str)], timeout: Option<u32>) -> String {
    let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let mut line = match timeout {
        Some(t) => format!("timeout -s TERM {t} "),
        None => String::new(),
    };
    line.push_str(&quote(&common::bin().to_string_lossy()));
    for a in args {
        line.push(' ');
        line.push_str(&quote(a));
    }
    let mut cmd = wrapper(dir, "script");
    cmd.args(["-qec", &line, "/dev/null"]);
    clean_colour_env(&mut cmd);
    cmd.envs(env.iter().copied());
    let out = cmd.output().expect("run script (util-linux)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// No colour variable of the caller's leaks in; a terminal that can show
/// colour.
fn clean_colour_env(cmd: &mut Command) {
    for v in ["NO_COLOR", "CLICOLOR", "CLICOLOR_FORCE"] {
        cmd.env_remove(v);
    }
    cmd.env("TERM", "xterm-256color");
}

/// Runs with stdout and stderr pipes (the same clean colour environment).
fn piped(dir: &Path, args: &[&str], timeout: Option<&str>) -> (String, String) {
    let mut cmd = match timeout {
        Some(t) => {
            let mut c = wrapper(dir, "timeout");
            c.args(["-s", "TERM", t]).arg(common::bin());
            c
        }
        None => tpmcrypt(dir),
    };
    clean_colour_env(&mut cmd);
    let out = cmd.args(args).output().expect("spawn");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn colour_only_on_a_terminal_and_never_with_no_color() {
    let d = tempfile::tempdir().expect("tempdir");
    let dir = d.path();
    let runtime = ["inspect", "missing.tpmc"];
    let usage = ["encrypt", "--bits", "100", "-R", "x"];
    let red_error = "\x1b[1;31merror:\x1b[0m";

    // On a terminal: the error prefix of a run and of a usage error (clap's)
    // are red, and clap's help is styled.
    let tty = on_a_terminal(dir, &runtime, &[], None);
    assert!(
        tty.contains(&format!("{red_error} missing.tpmc")),
        "{tty:?}"
    );
    let tty = on_a_terminal(dir, &usage, &[], None);
    assert!(
        tty.contains(&format!("{red_error} invalid value '100'")),
        "{tty:?}"
    );
    let tty = on_a_terminal(dir, &["encrypt", "--help"], &[], None);
    assert!(tty.contains(ESC), "help on a terminal is styled: {tty:?}");

    // NO_COLOR on the same terminal: not one escape sequence, and the
    // text is the same.
    for args in [&runtime[..], &usage, &["encrypt", "--help"]] {
        let plain = on_a_terminal(dir, args, &[("NO_COLOR", "1")], None);
        assert!(!plain.contains(ESC), "{args:?} with NO_COLOR: {plain:?}");
        assert!(
            plain.contains("error:") || plain.contains("Usage:"),
            "{plain:?}"
        );
    }
    // An empty NO_COLOR is as unset (no-color.org).
    let tty = on_a_terminal(dir, &runtime, &[("NO_COLOR", "")], None);
    assert!(tty.contains(red_error), "{tty:?}");

    // stderr a pipe: no colour, whatever else.
    for args in [&runtime[..], &usage, &["encrypt", "--help"]] {
        let (out, err) = piped(dir, args, None);
        assert!(
            !out.contains(ESC) && !err.contains(ESC),
            "{args:?}: {err:?}"
        );
    }
    let (_, err) = piped(dir, &runtime, None);
    assert!(err.starts_with("error: missing.tpmc"), "{err:?}");
}

#[test]
fn the_watch_log_follows_the_same_colour_decision() {
    let d = tempfile::tempdir().expect("tempdir");
    let dir = d.path();
    let recipient = common::recovery(dir, "id");
    std::fs::create_dir(dir.join("src")).expect("mkdir");
    let args = ["watch", "src", "--out", "dst", "-R", &recipient];

    let tty = on_a_terminal(dir, &args, &[], Some(3));
    assert!(
        tty.contains("\x1b[32mINFO\x1b[0m tpmcrypt::watch"),
        "{tty:?}"
    );
    let plain = on_a_terminal(dir, &args, &[("NO_COLOR", "1")], Some(3));
    assert!(plain.contains("INFO tpmcrypt::watch"), "{plain:?}");
    assert!(!plain.contains(ESC), "{plain:?}");
    let (_, err) = piped(dir, &args, Some("3"));
    assert!(err.contains("INFO tpmcrypt::watch"), "{err:?}");
    assert!(!err.contains(ESC), "{err:?}");
}

/// A bad duration or size is exit 2 with the valid forms shown, for every
/// such flag, through the real binary (the full table, with the values
/// each takes, is `args::grammar_tests`).
#[test]
fn bad_durations_and_sizes_are_usage_errors_showing_the_forms() {
    let d = tempfile::tempdir().expect("tempdir");
    let dir = d.path();
    let watch = ["watch", "s", "--out", "o", "-R", "x"];
    let mut cases: Vec<(Vec<&str>, &str)> = vec![
        (
            watch.iter().copied().chain(["--settle", "5y"]).collect(),
            "e.g. 200ms",
        ),
        (
            watch
                .iter()
                .copied()
                .chain(["--rotate", "1parsec"])
                .collect(),
            "e.g. 200ms",
        ),
        (
            watch
                .iter()
                .copied()
                .chain(["--stats-interval", "1h30x"])
                .collect(),
            "e.g. 200ms",
        ),
        (vec!["agent", "--ttl", "0"], "longer than zero"),
        (vec!["agent", "--ttl", "fortnight"], "e.g. 200ms"),
        (
            vec!["encrypt", "-R", "x", "--segment-size", "64KB"],
            "e.g. 4096, 64KiB",
        ),
        (
            vec!["encrypt", "-R", "x", "--segment-size", "8G"],
            "too large",
        ),
    ];
    if cfg!(feature = "bench") {
        cases.extend([
            (
                vec!["bench", "--sizes", "16K,1.5"],
                "not a whole number of bytes",
            ),
            (vec!["bench", "--sizes", "16KB"], "ambiguous unit"),
            (vec!["bench", "--unbind", "0"], "longer than zero"),
            (vec!["bench", "--unbind-ms", "300"], "'--unbind'"),
            (vec!["bench", "watch", "--size", "1.3K"], "e.g. 4096, 64KiB"),
            (
                vec!["bench", "watch", "--duration", "3 weeks"],
                "e.g. 200ms",
            ),
        ]);
    }
    for (args, needle) in cases {
        let r = run(dir, &args);
        assert_eq!(r.code, 2, "{args:?}: {}", r.stderr);
        assert!(r.stderr.starts_with("error: "), "{args:?}: {}", r.stderr);
        assert!(r.stderr.contains(needle), "{args:?}: {}", r.stderr);
        assert_eq!(r.stderr.lines().count(), 1, "{args:?}: {}", r.stderr);
    }
}

/// `--json` is a flag everywhere (a path after it is not taken as its
/// value); files are named with `--json-file`/`--stats-json`.
#[cfg(feature = "bench")]
#[test]
fn json_is_a_flag_and_files_take_json_file() {
    let d = tempfile::tempdir().expect("tempdir");
    let r = run(d.path(), &["bench", "--json", "out.json", "--no-peers"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("'out.json'"), "{}", r.stderr);
    assert!(!d.path().join("out.json").exists());

    // Two report files at one path: the second would silently replace the
    // first after a run of minutes; refused before any work.
    for (a, b) in [
        ("--json-file", "--csv"),
        ("--csv", "--plot"),
        ("--json-file", "--plot"),
    ] {
        let r = run(d.path(), &["bench", a, "r.svg", b, "./r.svg", "--no-peers"]);
        assert_eq!(r.code, 2, "{a} {b}: {}", r.stderr);
        assert!(r.stderr.contains("same file"), "{}", r.stderr);
        assert!(!d.path().join("r.svg").exists());
    }
}

fn assert_rfc3339(text: &str, what: &str) {
    let t = humantime::parse_rfc3339(text)
        .unwrap_or_else(|e| panic!("{what}: {text:?} is not RFC 3339: {e}"));
    let age = std::time::SystemTime::now()
        .duration_since(t)
        .unwrap_or_default();
    assert!(age.as_secs() < 3600, "{what}: {text} is not about now");
}

/// The watch daemon's log file and its --stats-json carry RFC 3339 times.
#[test]
fn watch_log_and_stats_timestamps_are_rfc3339() {
    let d = tempfile::tempdir().expect("tempdir");
    let dir = d.path();
    let recipient = common::recovery(dir, "id");
    std::fs::create_dir(dir.join("src")).expect("mkdir");
    std::fs::write(dir.join("src/a.txt"), b"hello").expect("write");
    let args = [
        "watch",
        "src",
        "--out",
        "dst",
        "-R",
        &recipient,
        "--log",
        "watch.log",
        "--stats-json",
        "stats.json",
        "--stats-interval",
        "1",
    ];
    let _ = piped(dir, &args, Some("3"));
    assert!(
        dir.join("dst/a.txt.tpmc").exists(),
        "the daemon did not run"
    );
    let log = std::fs::read_to_string(dir.join("watch.log")).expect("log written");
    assert!(log.lines().count() >= 2, "{log}");
    for line in log.lines() {
        let stamp = line.split(' ').next().unwrap_or_default();
        assert_rfc3339(stamp, "log line");
    }
    let stats: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("stats.json")).expect("stats written"))
            .expect("stats JSON");
    assert_rfc3339(
        stats["time"].as_str().expect("time is a string"),
        "stats time",
    );
    assert_eq!(stats["files"], 1);
}

/// `key list --json`, `key show --json` and `key show` give a key's
/// creation time in RFC 3339; `key show --json` is one element of the list.
#[test]
fn key_times_are_rfc3339_and_key_show_has_json() {
    let d = tempfile::tempdir().expect("tempdir");
    let dir = d.path();
    let r = run(dir, &["--simulator", "key", "create", "k"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let r = run(dir, &["--simulator", "key", "list", "--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let list: serde_json::Value = serde_json::from_slice(&r.stdout).expect("list JSON");
    let created = list[0]["created"].as_str().expect("created is a string");
    assert_rfc3339(created, "key list created");
    let r = run(dir, &["--simulator", "key", "show", "--json", "k"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let one: serde_json::Value = serde_json::from_slice(&r.stdout).expect("show JSON");
    assert_eq!(one, list[0]);
    let r = run(dir, &["--simulator", "key", "show", "k"]);
    let text = String::from_utf8_lossy(&r.stdout);
    assert!(
        text.contains(&format!("created:     {created}\n")),
        "{text}"
    );
}
