//! `tpmcrypt bench` (being written).

use clap::Args;

/// `tpmcrypt bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// A quick run.
    #[arg(long)]
    pub quick: bool,
}

/// Runs the benchmark.
pub fn run(_args: &BenchArgs, _ui: &crate::Ui) -> anyhow::Result<i32> {
    Err(crate::exit::usage("bench is not implemented yet"))
}
