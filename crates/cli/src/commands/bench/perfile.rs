//! The per-file series: `tpmcrypt encrypt -r` and `decrypt -r` through the
//! real command line (this executable, run as a child process) over a
//! generated tree of files of one size, durable and `--no-sync`, each run
//! reporting its own split with `--stats-json`: files/s, and per file the
//! session-key unwrap, AES, read + write and durability.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context as _};
use serde::{Deserialize, Serialize};

/// File sizes of the series.
pub const SIZES: [u64; 3] = [4 << 10, 64 << 10, 1 << 20];

/// The series, or why it is missing.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PerFile {
    /// Whether it ran.
    pub available: bool,
    /// Why not, or what failed.
    pub reason: Option<String>,
    /// The commands run (DIR stands for the tree).
    pub commands: Vec<String>,
    /// One point per direction, durability and size.
    pub points: Vec<PerFilePoint>,
}

/// One run of a whole tree: the run with the median wall time of `runs`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PerFilePoint {
    /// `encrypt` or `decrypt`.
    pub direction: String,
    /// `durable` (the default) or `no-sync`.
    pub sync: String,
    /// Bytes per file.
    pub size: u64,
    /// Files in the tree.
    pub files: u64,
    /// Runs made; the median one (by wall time) is reported.
    pub runs: u32,
    /// Files per second of the whole process run.
    pub files_per_s: f64,
    /// Wall time per file, ms (the process's own, start-up excluded).
    pub total_ms: f64,
    /// Getting the session key (decrypt: one unwrap per run), per file.
    pub unwrap_ms: f64,
    /// AES (sealing/opening segments), CPU time summed over threads.
    pub aes_cpu_ms: f64,
    /// Reading input and writing output, summed over threads.
    pub io_ms: f64,
    /// Waiting for durability (group commits), wall time.
    pub commit_ms: f64,
    /// The rest of the wall time: setup, opening and creating files,
    /// hand-over between threads (with several threads, the CPU figures
    /// above overlap and this is a lower bound).
    pub other_ms: f64,
}

/// The figures of one `--stats-json`.
#[derive(Debug, Clone, Copy, Default)]
struct Stats {
    files: f64,
    total_ms: f64,
    unwrap_ms: f64,
    aes_ms: f64,
    io_ms: f64,
    commit_ms: f64,
}

fn stats_of(path: &Path) -> anyhow::Result<Stats> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let num = |x: &serde_json::Value| x.as_f64().context("a figure missing in --stats-json");
    Ok(Stats {
        files: num(&v["files_ok"])?,
        total_ms: num(&v["wall_ms"]["total"])?,
        unwrap_ms: num(&v["wall_ms"]["unwrap"])?,
        aes_ms: num(&v["aes_cpu_ms"])?,
        io_ms: num(&v["read_ms"])? + num(&v["write_ms"])?,
        commit_ms: num(&v["wall_ms"]["commit"])?,
    })
}

/// How many files of `size` a tree holds: about 1 MiB of them with
/// `--quick` (at least 8), 16 MiB otherwise (at least 32).
fn files_for(size: u64, quick: bool) -> u64 {
    let (bytes, min) = if quick {
        (1u64 << 20, 8)
    } else {
        (16 << 20, 32)
    };
    (bytes / size).clamp(min, 4096)
}

/// What the child processes need: the executable, a recovery key pair,
/// and an environment that reaches no agent, TPM or user keystore.
struct Setup {
    exe: PathBuf,
    dir: PathBuf,
    key: PathBuf,
    recipient: String,
}

impl Setup {
    fn new(dir: &Path) -> anyhow::Result<Setup> {
        let exe = super::user_executable().context("locating the tpmcrypt executable")?;
        let dir = dir.join("perfile");
        std::fs::create_dir_all(dir.join("keystore"))?;
        let mut s = Setup {
            exe,
            key: dir.join("recovery.key"),
            dir,
            recipient: String::new(),
        };
        let out = s
            .command()
            .args(["recovery", "create", "--force", "--out"])
            .arg(&s.key)
            .output()
            .context("running `tpmcrypt recovery create`")?;
        s.recipient = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .find(|w| w.starts_with("tpmcrypt-recovery:"))
            .context("no recipient printed by `tpmcrypt recovery create`")?
            .to_string();
        Ok(s)
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.exe);
        c.env("TPMCRYPT_AGENT_SOCK", self.dir.join("no-agent.sock"))
            .env("TPMCRYPT_HOME", self.dir.join("keystore"))
            .env_remove("TPMCRYPT_SIMULATOR")
            .env_remove("TPMCRYPT_TCTI")
            .stdin(Stdio::null());
        super::dies_with_this_process(&mut c);
        c
    }

    /// Runs `tpmcrypt -q VERB … DIR` with `--stats-json` and reads it.
    fn run(&self, verb: &str, no_sync: bool, tree: &Path) -> anyhow::Result<Stats> {
        let json = self.dir.join(format!("{verb}.json"));
        let mut c = self.command();
        c.args(["-q", verb, "-r", "--stats-json"]).arg(&json);
        match verb {
            "encrypt" => c.args(["--new-session", "-R", &self.recipient]),
            _ => c.arg("-i").arg(&self.key),
        };
        if no_sync {
            c.arg("--no-sync");
        }
        let out = c
            .arg(tree)
            .output()
            .with_context(|| format!("running {verb}"))?;
        if !out.status.success() {
            bail!(
                "`tpmcrypt {verb} -r` failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        stats_of(&json)
    }
}

/// Writes `files` files of `size` bytes (cut from `src`) into a new `tree`.
fn make_tree(tree: &Path, files: u64, size: u64, src: &[u8]) -> anyhow::Result<()> {
    std::fs::create_dir(tree).with_context(|| tree.display().to_string())?;
    for i in 0..files {
        let at = (i as usize * 4099) % src.len().saturating_sub(size as usize).max(1);
        let end = (at + size as usize).min(src.len());
        std::fs::write(tree.join(format!("f{i:05}")), &src[at..end])?;
    }
    Ok(())
}

/// One encrypt and one decrypt of a fresh tree.
fn one_round(
    setup: &Setup,
    size: u64,
    files: u64,
    no_sync: bool,
    src: &[u8],
) -> anyhow::Result<[Stats; 2]> {
    let tree = setup.dir.join("tree");
    let _ = std::fs::remove_dir_all(&tree);
    make_tree(&tree, files, size, src)?;
    let enc = setup.run("encrypt", no_sync, &tree)?;
    for i in 0..files {
        std::fs::remove_file(tree.join(format!("f{i:05}")))?;
    }
    let dec = setup.run("decrypt", no_sync, &tree)?;
    std::fs::remove_dir_all(&tree)?;
    Ok([enc, dec])
}

/// The median run (by wall time) as a point, per file.
fn point(direction: &str, no_sync: bool, size: u64, mut runs: Vec<Stats>) -> PerFilePoint {
    runs.sort_by(|a, b| a.total_ms.total_cmp(&b.total_ms));
    let n = runs.len() as u32;
    let s = runs[runs.len() / 2];
    let per = |v: f64| v / s.files.max(1.0);
    let parts = s.unwrap_ms + s.aes_ms + s.io_ms + s.commit_ms;
    PerFilePoint {
        direction: direction.into(),
        sync: if no_sync { "no-sync" } else { "durable" }.into(),
        size,
        files: s.files as u64,
        runs: n,
        files_per_s: s.files / (s.total_ms / 1e3).max(1e-9),
        total_ms: per(s.total_ms),
        unwrap_ms: per(s.unwrap_ms),
        aes_cpu_ms: per(s.aes_ms),
        io_ms: per(s.io_ms),
        commit_ms: per(s.commit_ms),
        other_ms: per((s.total_ms - parts).max(0.0)),
    }
}

/// Runs the series; a failure leaves it unavailable, with the reason.
pub fn run(tmp: &Path, quick: bool, src: &[u8], tick: &mut dyn FnMut(&str)) -> PerFile {
    match run_all(tmp, quick, src, tick) {
        Ok(points) => PerFile {
            available: true,
            reason: None,
            commands: commands(),
            points,
        },
        Err(e) => PerFile {
            available: false,
            reason: Some(format!("{e:#}")),
            commands: commands(),
            points: Vec::new(),
        },
    }
}

fn commands() -> Vec<String> {
    vec![
        "tpmcrypt -q encrypt -r --new-session -R tpmcrypt-recovery:… [--no-sync] --stats-json J DIR".into(),
        "tpmcrypt -q decrypt -r -i recovery.key [--no-sync] --stats-json J DIR".into(),
    ]
}

fn run_all(
    tmp: &Path,
    quick: bool,
    src: &[u8],
    tick: &mut dyn FnMut(&str),
) -> anyhow::Result<Vec<PerFilePoint>> {
    let setup = Setup::new(tmp)?;
    let runs = if quick { 1 } else { 3 };
    let mut points = Vec::new();
    for size in SIZES {
        let files = files_for(size, quick);
        for no_sync in [false, true] {
            tick(&format!(
                "per file: {} × {files}",
                super::stats::human_size(size)
            ));
            let (mut enc, mut dec) = (Vec::new(), Vec::new());
            for _ in 0..runs {
                let [e, d] = one_round(&setup, size, files, no_sync, src)?;
                enc.push(e);
                dec.push(d);
            }
            points.push(point("encrypt", no_sync, size, enc));
            points.push(point("decrypt", no_sync, size, dec));
        }
    }
    Ok(points)
}

/// Steps of the progress bar.
pub fn steps() -> u64 {
    (SIZES.len() * 2) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_run_is_reported_per_file() {
        let run = |total_ms| Stats {
            files: 10.0,
            total_ms,
            unwrap_ms: 1.0,
            aes_ms: 2.0,
            io_ms: 3.0,
            commit_ms: 4.0,
        };
        let p = point("decrypt", true, 4096, vec![run(50.0), run(20.0), run(30.0)]);
        assert_eq!(p.runs, 3);
        assert_eq!(p.sync, "no-sync");
        assert!((p.total_ms - 3.0).abs() < 1e-9);
        assert!((p.files_per_s - 10.0 / 0.030).abs() < 1e-6);
        assert!((p.other_ms - 2.0).abs() < 1e-9);
        assert!((p.aes_cpu_ms - 0.2).abs() < 1e-9);
    }

    #[test]
    fn trees_are_small_with_quick() {
        assert_eq!(files_for(4 << 10, true), 256);
        assert_eq!(files_for(1 << 20, true), 8);
        assert_eq!(files_for(1 << 20, false), 32);
    }
}
