//! `tpmcrypt`: thin glue over the cipher and TPM libraries. Errors become
//! one line on stderr and a documented exit code here, and only here.

mod args;
mod atomic;
mod batch;
mod commands;
mod files;
mod harden;
mod keys;
mod manpages;
mod options;
mod stamp;
mod statsfile;
mod tpm;
mod ui;
mod version;

use clap::{CommandFactory, Parser};

use crate::args::{Cli, Command};
use crate::ui::{exit, stdout, Ui};

fn main() {
    // Before anything may hold a key.
    harden::disable_core_dumps();
    // tpm2-tss logs its own errors to stderr; ours say it better, once.
    if std::env::var_os("TSS2_LOG").is_none() {
        std::env::set_var("TSS2_LOG", "all+NONE");
    }
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(code) = manpages::from_args(&argv) {
        std::process::exit(code);
    }
    let cli = match Cli::try_parse_from(&argv) {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version arrive here too (on stdout, exit 0), and
            // so does the help shown for a bare `tpmcrypt` or `tpmcrypt key`
            // (exit 2): those are printed whole.
            if !e.use_stderr() {
                if let Err(err) = stdout::ensure_open() {
                    eprintln!("error: {}", ui::one_line(&err));
                    std::process::exit(exit::OTHER);
                }
                // Help that cannot be written (a full device) is an error.
                let mut text = e.render().to_string();
                if e.kind() == clap::error::ErrorKind::DisplayVersion && version::is_long(&text) {
                    text = version::long();
                }
                if let Err(err) = stdout::write_all(text.as_bytes()) {
                    if stdout::is_broken_pipe(&err) {
                        stdout::end_by_sigpipe();
                    }
                    eprintln!("error: {}", ui::one_line(&err));
                    std::process::exit(exit::OTHER);
                }
                std::process::exit(exit::OK);
            }
            if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                let _ = e.print();
            } else {
                eprintln!("{}", args::usage_error_line(&e));
            }
            std::process::exit(exit::USAGE);
        }
    };
    let ui = Ui {
        verbose: cli.verbose,
        quiet: cli.quiet,
        keystore: cli.keystore.clone(),
        tpm: cli.tpm.clone().filter(|t| !t.trim().is_empty()),
        simulator: cli.simulator,
    };
    let result = match &cli.command {
        Command::Encrypt(a) => commands::crypt::encrypt(a, &ui),
        Command::Decrypt(a) => commands::crypt::decrypt(a, &ui),
        Command::Inspect(a) => commands::inspect::run(a),
        Command::Watch(a) => commands::watch::run(a, &ui),
        #[cfg(feature = "bench")]
        Command::Bench(a) => commands::bench::run(a, &ui),
        Command::Recovery(c) => commands::recovery::run(c),
        Command::Key(c) => commands::key::run(c, &ui),
        Command::Agent(a) => commands::agent::run(a),
        Command::Completions { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut Cli::command(), "tpmcrypt", &mut script);
            stdout::write_all(&script).map(|()| exit::OK)
        }
    };
    let code = match result {
        Ok(code) => code,
        Err(err) if stdout::is_broken_pipe(&err) => stdout::end_by_sigpipe(),
        Err(err) => {
            eprintln!("error: {}", ui::one_line(&err));
            exit::code_for(&err)
        }
    };
    std::process::exit(code);
}
