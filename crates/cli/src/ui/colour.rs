//! Colour: the one decision whether text on a stream may carry ANSI
//! colour, taken here for every part of tpmcrypt (the `error:` and
//! `warning:` prefixes, clap's help and usage errors, the watch daemon's
//! log levels).
//!
//! The policy, in order (<https://no-color.org>, and the `CLICOLOR`
//! convention clap's own `anstream` follows):
//! 1. `NO_COLOR` set to anything but the empty string: never;
//! 2. `CLICOLOR_FORCE` set to anything but "" or "0": always;
//! 3. otherwise only where the stream is a terminal, `TERM` is not
//!    `dumb`, and `CLICOLOR` is not "0".
//!
//! A log file, a pipe, the journal and a CI log never get colour unless
//! forced.

use std::io::IsTerminal;
use std::sync::OnceLock;

/// The environment the decision reads, apart from the stream itself.
#[derive(Debug, Default, Clone)]
pub struct Env {
    /// `NO_COLOR`.
    pub no_color: Option<String>,
    /// `CLICOLOR_FORCE`.
    pub clicolor_force: Option<String>,
    /// `CLICOLOR`.
    pub clicolor: Option<String>,
    /// `TERM`.
    pub term: Option<String>,
}

impl Env {
    fn current() -> Env {
        let var = |name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
        Env {
            no_color: var("NO_COLOR"),
            clicolor_force: var("CLICOLOR_FORCE"),
            clicolor: var("CLICOLOR"),
            term: var("TERM"),
        }
    }
}

/// The policy (see the module documentation), given the environment and
/// whether the stream is a terminal.
pub fn decide(env: &Env, terminal: bool) -> bool {
    let set = |v: &Option<String>| v.as_deref().is_some_and(|s| !s.is_empty());
    if set(&env.no_color) {
        return false;
    }
    if set(&env.clicolor_force) && env.clicolor_force.as_deref() != Some("0") {
        return true;
    }
    terminal && env.term.as_deref() != Some("dumb") && env.clicolor.as_deref() != Some("0")
}

/// Whether standard error may carry colour (decided once per process).
pub fn stderr() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| decide(&Env::current(), std::io::stderr().is_terminal()))
}

/// Whether standard output may carry colour (clap's help).
pub fn stdout() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| decide(&Env::current(), std::io::stdout().is_terminal()))
}

/// clap's colour setting for what it prints itself (on standard error).
pub fn clap_choice() -> clap::ColorChoice {
    if stderr() {
        clap::ColorChoice::Always
    } else {
        clap::ColorChoice::Never
    }
}

/// Bold red, as clap shows its own `error:`.
const RED: &str = "\x1b[1;31m";
/// Bold yellow, as clap shows `warning:`.
const YELLOW: &str = "\x1b[1;33m";
const RESET: &str = "\x1b[0m";

fn paint(on: bool, style: &str, text: &str) -> String {
    if on {
        format!("{style}{text}{RESET}")
    } else {
        text.to_string()
    }
}

/// `error:` for a line on standard error, coloured where [`stderr`] says.
pub fn error() -> String {
    paint(stderr(), RED, "error:")
}

/// `warning:` for a line on standard error, coloured where [`stderr`] says.
pub fn warning() -> String {
    paint(stderr(), YELLOW, "warning:")
}

/// A line that begins with `error: ` (clap's usage errors, rendered
/// plain), with that prefix coloured where [`stderr`] says.
pub fn error_line(line: &str) -> String {
    match line.strip_prefix("error:") {
        Some(rest) => format!("{}{rest}", error()),
        None => line.to_string(),
    }
}

/// The watch log's level names: `ERROR` red, `WARN` yellow, `INFO` green,
/// the rest blue, where `on`.
pub fn level(on: bool, level: &tracing::Level) -> String {
    let style = match *level {
        tracing::Level::ERROR => "\x1b[31m",
        tracing::Level::WARN => "\x1b[33m",
        tracing::Level::INFO => "\x1b[32m",
        _ => "\x1b[34m",
    };
    paint(on, style, level.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(no: Option<&str>, force: Option<&str>, cli: Option<&str>, term: &str) -> Env {
        Env {
            no_color: no.map(str::to_string),
            clicolor_force: force.map(str::to_string),
            clicolor: cli.map(str::to_string),
            term: Some(term.to_string()),
        }
    }

    #[test]
    fn no_color_wins_and_only_terminals_get_colour() {
        let plain = env(None, None, None, "xterm");
        assert!(decide(&plain, true));
        assert!(!decide(&plain, false));
        // NO_COLOR of any non-empty value, even with CLICOLOR_FORCE.
        assert!(!decide(&env(Some("1"), None, None, "xterm"), true));
        assert!(!decide(&env(Some("0"), Some("1"), None, "xterm"), true));
        // An empty NO_COLOR is as unset (no-color.org).
        assert!(decide(&env(Some(""), None, None, "xterm"), true));
        assert!(decide(&env(None, Some("1"), None, "xterm"), false));
        assert!(!decide(&env(None, Some("0"), None, "xterm"), false));
        assert!(!decide(&env(None, None, Some("0"), "xterm"), true));
        assert!(!decide(&env(None, None, None, "dumb"), true));
    }

    #[test]
    fn painting_is_off_or_wraps_the_text() {
        assert_eq!(paint(false, RED, "error:"), "error:");
        assert_eq!(paint(true, RED, "error:"), "\x1b[1;31merror:\x1b[0m");
        assert_eq!(level(false, &tracing::Level::WARN), "WARN");
        assert_eq!(level(true, &tracing::Level::INFO), "\x1b[32mINFO\x1b[0m");
    }
}
