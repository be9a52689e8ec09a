//! `tpmcrypt watch` (being written).

use std::path::PathBuf;

use clap::Args;

/// `tpmcrypt watch`.
#[derive(Args, Debug)]
pub struct WatchArgs {
    /// Directory to watch.
    pub src: PathBuf,
}

/// Runs the daemon.
pub fn run(_args: &WatchArgs, _ui: &crate::Ui) -> anyhow::Result<i32> {
    Err(crate::exit::usage("watch is not implemented yet"))
}
