//! Other file-encryption tools on the same files, when installed: each run
//! is a whole process (start-up, key derivation, I/O, AES), so these are
//! compared with `tpmcrypt encrypt` run the same way, not with the
//! in-memory figures.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context as _};
use serde::{Deserialize, Serialize};

use super::stats::Summary;

/// Largest file given to the peers (they write real files).
pub const MAX_PEER_SIZE: u64 = 256 << 20;

/// One tool's timings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Peer {
    /// `tpmcrypt`, `openssl`, `gpg`, `age`, `rage`.
    pub tool: String,
    /// Found and usable.
    pub available: bool,
    /// Why not, when unavailable or failed.
    pub reason: Option<String>,
    /// First line of its version output.
    pub version: Option<String>,
    /// The command timed (IN/OUT stand for the files).
    pub command: Option<String>,
    /// Encryption wall time by file size.
    pub points: Vec<PeerPoint>,
}

/// One file size.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeerPoint {
    /// Bytes.
    pub size: u64,
    /// Wall time per encryption (whole process).
    #[serde(flatten)]
    pub time: Summary,
    /// Throughput at the median, MB/s.
    pub mb_per_s: f64,
}

/// Looks `name` up in PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| {
            use std::os::unix::fs::PermissionsExt;
            p.metadata()
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

fn version_of(bin: &Path, arg: &str) -> Option<String> {
    let out = Command::new(bin).arg(arg).output().ok()?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    text.lines().next().map(|l| l.trim().to_string())
}

fn run_ok(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{:?} failed ({}): {}",
            cmd.get_program(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
}

/// Builds the command line for (input, output).
type Builder = Box<dyn Fn(&Path, &Path) -> Command>;

/// A prepared tool.
struct Tool {
    name: &'static str,
    version: Option<String>,
    shown: String,
    build: Builder,
}

fn setup(name: &'static str, dir: &Path) -> Result<Tool, String> {
    match name {
        "tpmcrypt" => setup_tpmcrypt(dir),
        "openssl" => setup_openssl(),
        "gpg" => setup_gpg(dir),
        "age" | "rage" => setup_age(name, dir),
        other => Err(format!("unknown tool {other}")),
    }
}

fn exe(n: &str) -> Result<PathBuf, String> {
    which(n).ok_or_else(|| format!("{n} not found in PATH"))
}

/// The tpmcrypt users run (the front), to a fresh recovery recipient.
fn setup_tpmcrypt(dir: &Path) -> Result<Tool, String> {
    let name = "tpmcrypt";
    let bin = super::user_executable().map_err(|e| e.to_string())?;
    let key = dir.join("recovery.key");
    let out = run_ok(
        Command::new(&bin)
            .args(["recovery", "create", "--force", "--out"])
            .arg(&key),
    )
    .map_err(|e| format!("{e:#}"))?;
    let recipient = out
        .split_whitespace()
        .find(|w| w.starts_with("tpmcrypt-recovery:"))
        .ok_or("no recipient printed by `tpmcrypt recovery create`")?
        .to_string();
    let b = bin.clone();
    Ok(Tool {
        name,
        version: Some(format!("tpmcrypt {}", env!("CARGO_PKG_VERSION"))),
        shown: "tpmcrypt encrypt -q -f -R tpmcrypt-recovery:… -o OUT IN".into(),
        build: Box::new(move |i, o| {
            let mut c = Command::new(&b);
            c.args(["encrypt", "-q", "-f", "-R", &recipient, "-o"])
                .arg(o)
                .arg(i);
            c
        }),
    })
}

/// `openssl enc`, password-based.
fn setup_openssl() -> Result<Tool, String> {
    let name = "openssl";
    let bin = exe("openssl")?;
    Ok(Tool {
        name,
        version: version_of(&bin, "version"),
        shown: "openssl enc -aes-256-cbc -pbkdf2 -pass pass:x -in IN -out OUT".into(),
        build: Box::new(move |i, o| {
            let mut c = Command::new(&bin);
            c.args(["enc", "-aes-256-cbc", "-pbkdf2", "-pass", "pass:x", "-in"])
                .arg(i)
                .arg("-out")
                .arg(o);
            c
        }),
    })
}

/// `gpg --symmetric` in a private GNUPGHOME.
fn setup_gpg(dir: &Path) -> Result<Tool, String> {
    let name = "gpg";
    let bin = exe("gpg")?;
    let home = dir.join("gnupg");
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&home)
            .map_err(|e| format!("{}: {e}", home.display()))?;
    }
    Ok(Tool {
        name,
        version: version_of(&bin, "--version"),
        shown: "gpg --batch --yes --pinentry-mode loopback --symmetric --passphrase x \
                -o OUT IN (GNUPGHOME=temp)"
            .into(),
        build: Box::new(move |i, o| {
            let mut c = Command::new(&bin);
            c.env("GNUPGHOME", &home)
                .args([
                    "--batch",
                    "--yes",
                    "--quiet",
                    "--pinentry-mode",
                    "loopback",
                    "--symmetric",
                    "--passphrase",
                    "x",
                    "-o",
                ])
                .arg(o)
                .arg(i);
            c
        }),
    })
}

/// `age` or `rage`, to a freshly generated key.
fn setup_age(name: &'static str, dir: &Path) -> Result<Tool, String> {
    let bin = exe(name)?;
    let keygen = exe(&format!("{name}-keygen"))?;
    let key = dir.join(format!("{name}.key"));
    run_ok(Command::new(&keygen).arg("-o").arg(&key)).map_err(|e| format!("{e:#}"))?;
    let text = std::fs::read_to_string(&key).map_err(|e| e.to_string())?;
    let recipient = text
        .split_whitespace()
        .find(|w| w.starts_with("age1"))
        .ok_or("no public key in the generated age key file")?
        .to_string();
    Ok(Tool {
        name,
        version: version_of(&bin, "--version"),
        shown: format!("{name} -r age1… -o OUT IN"),
        build: Box::new(move |i, o| {
            let mut c = Command::new(&bin);
            c.args(["-r", &recipient, "-o"]).arg(o).arg(i);
            c
        }),
    })
}

/// The tools, in report order.
pub const TOOLS: [&str; 5] = ["tpmcrypt", "openssl", "gpg", "age", "rage"];

/// Times each available tool on a file of every size (≤ [`MAX_PEER_SIZE`]).
pub fn run(
    dir: &Path,
    sizes: &[u64],
    repeat: u32,
    src: &[u8],
    tick: &mut dyn FnMut(&str),
) -> Vec<Peer> {
    let sizes: Vec<u64> = sizes
        .iter()
        .copied()
        .filter(|&s| s <= MAX_PEER_SIZE)
        .collect();
    let (tools, peers) = setup_all(dir);
    let mut results: Vec<Peer> = tools
        .iter()
        .map(|t| Peer {
            tool: t.name.to_string(),
            available: true,
            reason: None,
            version: t.version.clone(),
            command: Some(t.shown.clone()),
            points: Vec::new(),
        })
        .collect();
    let input = dir.join("input.bin");
    let output = dir.join("output.enc");
    for &size in &sizes {
        if let Err(e) = write_input(&input, src, size) {
            for r in &mut results {
                r.reason = Some(format!("{e:#}"));
            }
            break;
        }
        for (t, r) in tools.iter().zip(results.iter_mut()) {
            if r.reason.is_some() {
                continue;
            }
            let runs = if size > (16 << 20) {
                repeat.min(3)
            } else {
                repeat
            };
            match time_tool(t, &input, &output, runs) {
                Ok(samples) => {
                    let time = Summary::of(samples);
                    r.points.push(PeerPoint {
                        size,
                        mb_per_s: size as f64 / (time.median_ms / 1e3) / 1e6,
                        time,
                    });
                }
                Err(e) => {
                    r.reason = Some(format!("{e:#}"));
                    r.available = false;
                }
            }
            tick(t.name);
        }
    }
    let _ = std::fs::remove_file(&input);
    let _ = std::fs::remove_file(&output);
    results.extend(peers);
    results
}

/// Sets every tool up: those ready, and those unavailable (with why).
fn setup_all(dir: &Path) -> (Vec<Tool>, Vec<Peer>) {
    let mut peers = Vec::new();
    let mut tools = Vec::new();
    for name in TOOLS {
        match setup(name, dir) {
            Ok(t) => tools.push(t),
            Err(reason) => peers.push(Peer {
                tool: name.to_string(),
                available: false,
                reason: Some(reason),
                version: None,
                command: None,
                points: Vec::new(),
            }),
        }
    }
    (tools, peers)
}

/// `runs` timed runs of one tool (ms), after one untimed run that warms
/// the page cache and the binary; the first failure ends it.
fn time_tool(t: &Tool, input: &Path, output: &Path, runs: u32) -> anyhow::Result<Vec<f64>> {
    let mut samples = Vec::new();
    for i in 0..=runs {
        let _ = std::fs::remove_file(output);
        let start = Instant::now();
        run_ok(&mut (t.build)(input, output))?;
        if i > 0 {
            samples.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(samples)
}

fn write_input(path: &Path, src: &[u8], size: u64) -> anyhow::Result<()> {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| path.display().to_string())?,
    );
    let mut left = size as usize;
    while left > 0 {
        let n = left.min(src.len());
        f.write_all(&src[..n])?;
        left -= n;
    }
    f.flush()?;
    Ok(())
}
