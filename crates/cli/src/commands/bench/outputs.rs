//! Where the reports go (`--json-file`, `--csv`, `--plot`): each path is
//! checked before any work by the rule of `--stats-json`
//! ([`crate::statsfile`]): a file is replaced only if it is a regular file
//! of this user's that is empty or holds what an earlier bench wrote there
//! (its JSON by its keys, its CSV by its header line, its SVG by the
//! plotting library's `<svg` and the figure's title; a PNG cannot be told
//! apart, so only an empty one), never a symlink, a device, a FIFO, a
//! socket, a directory or another user's file; its directory must exist;
//! `-` is refused (`--json` prints the JSON on standard output). Each is
//! written whole under a temporary name and renamed over the old file.
//! Documented in docs/bench.md.

use std::path::Path;

use crate::statsfile;
use crate::ui::exit::usage;
use crate::ui::shown;

use super::{plot, report, BenchArgs};

/// One report file: its option, path and what an earlier run wrote there.
pub struct Report<'a> {
    /// `--json-file`, `--csv` or `--plot`.
    pub option: &'static str,
    /// Where.
    pub path: &'a Path,
    earlier: fn(&[u8]) -> bool,
}

impl Report<'_> {
    /// `OPTION PATH`, for messages.
    fn label(&self) -> String {
        format!("{} {}", self.option, shown(self.path))
    }

    /// Writes `bytes`, whole or not at all.
    pub fn write(&self, bytes: &[u8]) -> anyhow::Result<()> {
        statsfile::write_file(self.path, &self.label(), bytes, &self.earlier)
    }
}

fn json(text: &[u8]) -> bool {
    serde_json::from_slice(text).is_ok_and(|v| report::is_bench_json(&v))
}

/// A PNG cannot be told from any other picture: only an empty file.
fn nothing(_: &[u8]) -> bool {
    false
}

fn plot_kind(path: &Path) -> fn(&[u8]) -> bool {
    let svg = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"));
    match svg {
        true => plot::is_bench_svg,
        false => nothing,
    }
}

/// The reports `args` asks for.
pub fn reports(args: &BenchArgs) -> Vec<Report<'_>> {
    let mut v = Vec::new();
    if let Some(path) = &args.json_file {
        v.push(Report {
            option: "--json-file",
            path,
            earlier: json,
        });
    }
    if let Some(path) = &args.csv {
        v.push(Report {
            option: "--csv",
            path,
            earlier: report::is_bench_csv,
        });
    }
    if let Some(path) = &args.plot {
        v.push(Report {
            option: "--plot",
            path,
            earlier: plot_kind(path),
        });
    }
    v
}

/// Checks every report path before any work; a refusal is a usage error
/// naming the option and the path.
pub fn check(args: &BenchArgs) -> anyhow::Result<()> {
    for r in reports(args) {
        let refuse = |why: &str| usage(format!("{}: {why}", r.label()));
        if r.path.as_os_str() == "-" {
            return Err(refuse(match r.option {
                "--json-file" => "not a file name here: --json prints the JSON on standard output",
                _ => "not a file name here: give a file",
            }));
        }
        if let Some(why) = statsfile::place_refusal(r.path, &r.earlier) {
            return Err(refuse(&why));
        }
    }
    Ok(())
}
