//! `tpmcrypt`: thin glue over the cipher and TPM libraries. Errors become
//! one line on stderr and a documented exit code here, and only here.
//!
//! Two executables are built from this library:
//! * `tpmcrypt-full` ([`main_full`]): every command; it alone loads
//!   tpm2-tss and OpenSSL;
//! * `tpmcrypt` ([`front::main`]): the one users run. It serves by itself
//!   the runs that need neither library (one file encrypted to recovery
//!   recipients, one file whose session key the agent or a `-i` identity
//!   opens) and hands every other run, unchanged, to `tpmcrypt-full`
//!   with `execve`: a one-process-per-file script does not pay for
//!   loading libraries its runs do not use.

/// `eprintln!` that never panics: a standard error nobody reads any more
/// (a log collector that died, `2>&1 | head -1`) loses the line, and the
/// run goes on (`eprintln!` would end it with a panic, exit 101).
macro_rules! stderr_line {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

/// `eprint!` that never panics (see [`stderr_line!`]).
macro_rules! stderr_text {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stderr(), $($t)*);
    }};
}

mod args;
mod atomic;
mod batch;
mod commands;
mod dirscan;
mod files;
pub mod front;
mod harden;
mod keys;
mod manpages;
mod options;
mod pin;
mod plainpipe;
mod replace;
mod stamp;
mod statsfile;
mod tpm;
mod ui;
mod version;

use clap::CommandFactory;

use crate::args::{Cli, Command};
use crate::ui::{exit, stdout, Ui};

/// The whole command line: every command (the `tpmcrypt-full` executable).
pub fn main_full() -> ! {
    // Before any thread starts (see the function).
    tpmcrypt_cipher::backend::restore_openssl_ia32cap();
    // Before anything may hold a key.
    harden::disable_core_dumps();
    harden::lock_secrets_or_say_so();
    harden::say_lock_waits();
    // This executable loads libcrypto anyway (tpm2-tss needs it), and
    // OpenSSL is the fastest backend for CBC and 192-bit keys.
    tpmcrypt_cipher::backend::enable_openssl();
    // tpm2-tss logs its own errors to stderr; ours say it better, once.
    if std::env::var_os("TSS2_LOG").is_none() {
        std::env::set_var("TSS2_LOG", "all+NONE");
    }
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(code) = manpages::from_args(&argv) {
        std::process::exit(code);
    }
    // The matches say where --tpm's value came from (flag or TPMCRYPT_TCTI).
    let (cli, tpm_from_env) = match parse::<Cli>(&argv) {
        Ok(parsed) => parsed,
        Err(e) => {
            // --help and --version arrive here too (on stdout, exit 0), and
            // so does the help shown for a bare `tpmcrypt` or `tpmcrypt key`
            // (exit 2): those are printed whole.
            if !e.use_stderr() {
                if let Err(err) = stdout::ensure_open() {
                    stderr_line!("{} {}", ui::colour::error(), ui::one_line(&err));
                    std::process::exit(exit::OTHER);
                }
                // Help that cannot be written (a full device) is an error.
                let mut text = match ui::colour::stdout() {
                    true => e.render().ansi().to_string(),
                    false => e.render().to_string(),
                };
                if e.kind() == clap::error::ErrorKind::DisplayVersion && version::is_long(&text) {
                    text = version::long();
                }
                if let Err(err) = stdout::write_all(text.as_bytes()) {
                    if stdout::is_broken_pipe(&err) {
                        stdout::end_by_sigpipe();
                    }
                    stderr_line!("{} {}", ui::colour::error(), ui::one_line(&err));
                    std::process::exit(exit::OTHER);
                }
                std::process::exit(exit::OK);
            }
            if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                let _ = e.print();
            } else {
                stderr_line!("{}", ui::colour::error_line(&args::usage_error_line(&e)));
            }
            std::process::exit(exit::USAGE);
        }
    };
    let ui = ui_of(&cli.globals, tpm_from_env);
    let result = match &cli.command {
        Command::Encrypt(a) => commands::crypt::encrypt(a, &ui),
        Command::Decrypt(a) => commands::crypt::decrypt(a, &ui),
        Command::Inspect(a) => commands::inspect::run(a),
        Command::Rekey(a) => commands::rekey::run(a, &ui),
        Command::Watch(a) => commands::watch::run(a, &ui),
        #[cfg(feature = "bench")]
        Command::Bench(a) => commands::bench::run(a, &ui),
        Command::Recovery(c) => commands::recovery::run(c),
        Command::Key(c) => commands::key::run(c, &ui),
        Command::PcrSigner(c) => commands::pcr::run_signer(c),
        Command::Pcr(c) => commands::pcr::run(c, &ui),
        Command::Agent(a) => commands::agent::run(a),
        Command::Doctor(a) => commands::doctor::run(a, &ui),
        Command::Completions { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut Cli::command(), "tpmcrypt", &mut script);
            stdout::write_all(&script).map(|()| exit::OK)
        }
    };
    std::process::exit(code_of(result));
}

/// The global flags as the commands see them.
fn ui_of(cli: &args::Globals, tpm_from_env: bool) -> Ui {
    Ui {
        verbose: cli.verbose,
        quiet: cli.quiet,
        keystore: cli.keystore.clone(),
        tpm: cli.tpm.clone().filter(|t| !t.trim().is_empty()),
        tpm_from_env,
        simulator: cli.simulator,
        pin_file: cli.pin_file.clone(),
    }
}

/// A command's result as the process's exit code; an error is one line on
/// stderr first (a closed stdout ends the process as SIGPIPE would).
fn code_of(result: anyhow::Result<i32>) -> i32 {
    // An interrupt being cleaned up ends the process by its signal.
    atomic::wait_if_interrupted();
    match result {
        Ok(code) => code,
        Err(err) if stdout::is_broken_pipe(&err) => stdout::end_by_sigpipe(),
        Err(err) => {
            stderr_line!("{} {}", ui::colour::error(), ui::one_line(&err));
            exit::code_for(&err)
        }
    }
}

/// The command line, parsed with clap's colour set by the one decision
/// ([`ui::colour`]), and whether `--tpm`'s value came from `TPMCRYPT_TCTI`.
fn parse<P: clap::Parser>(argv: &[std::ffi::OsString]) -> Result<(P, bool), clap::Error> {
    // Named `tpmcrypt` in usage and help whichever executable runs (the
    // front hands runs to `tpmcrypt-full`) and whatever argv[0] is.
    let mut cmd = P::command()
        .color(ui::colour::clap_choice())
        .bin_name("tpmcrypt");
    // A variable set but empty counts as unset, as XDG_DATA_HOME does (a
    // shell's `TPMCRYPT_HOME=`, a unit's `Environment=TPMCRYPT_HOME=`):
    // clap took it for a value missing, and every command was a usage
    // error, even one given --keystore. An empty value on the command
    // line stays an error.
    let empty: Vec<clap::Id> = cmd
        .get_arguments()
        .filter(|a| {
            a.get_env()
                .and_then(std::env::var_os)
                .is_some_and(|v| v.is_empty())
        })
        .map(|a| a.get_id().clone())
        .collect();
    for id in empty {
        cmd = cmd.mut_arg(id, |a| a.env(None::<&str>));
    }
    let mut matches = cmd.try_get_matches_from_mut(argv)?;
    let from_env =
        |id: &str| matches.value_source(id) == Some(clap::parser::ValueSource::EnvVariable);
    let tpm_from_env = from_env("tpm");
    // TPMCRYPT_HOME comes to --keystore through clap, not through
    // `Keystore::default_dir`, so its rule is applied here; a relative
    // --keystore is a path on the command line like any other, relative to
    // where it is typed.
    if from_env("keystore") {
        if let Some(dir) = matches.get_one::<std::path::PathBuf>("keystore") {
            tpmcrypt_tpmkey::keystore::check_env_home(dir)
                .map_err(|e| cmd.error(clap::error::ErrorKind::ValueValidation, e))?;
        }
    }
    P::from_arg_matches_mut(&mut matches)
        .map(|cli| (cli, tpm_from_env))
        .map_err(|e| e.format(&mut cmd))
}
