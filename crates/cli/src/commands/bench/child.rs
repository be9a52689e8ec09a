//! The software-AES child: this binary run again (hidden `bench --child`)
//! with `OPENSSL_ia32cap` masking AES-NI and PCLMULQDQ, so that OpenSSL
//! takes its software path; the parent reads its series on stdout and its
//! progress on stderr.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use anyhow::{anyhow, bail, Context as _};
use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};

use super::bulk::{self, Plan, Series, SOFTWARE};
use super::matrix;
use super::SOFTWARE_MASK;

/// What the parent asks the child to do.
#[derive(Serialize, Deserialize)]
pub struct ChildPlan {
    pub sizes: Vec<u64>,
    pub repeat: u32,
    pub warmup: u32,
    pub min_sample_ms: f64,
    pub matrix: bool,
    pub quick: bool,
}

/// What the child prints on stdout.
#[derive(Serialize, Deserialize)]
pub struct ChildOut {
    pub openssl_version: String,
    pub openssl_ia32cap: Option<String>,
    pub series: Vec<Series>,
    pub matrix: Vec<matrix::Cell>,
}

/// Runs this binary as the software-AES child and collects its results.
pub fn spawn(plan: &ChildPlan, bar: &ProgressBar) -> anyhow::Result<ChildOut> {
    let exe = std::env::current_exe().context("locating this executable")?;
    let mut child = Command::new(exe)
        .args(["bench", "--child", &serde_json::to_string(plan)?])
        .env("OPENSSL_ia32cap", SOFTWARE_MASK)
        .env_remove("TPMCRYPT_SIMULATOR")
        .env_remove("TPMCRYPT_TCTI")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the software-AES child process")?;
    let stderr = child.stderr.take();
    let bar2 = bar.clone();
    let errs = std::thread::spawn(move || {
        let mut other = String::new();
        if let Some(e) = stderr {
            for line in BufReader::new(e).lines().map_while(Result::ok) {
                if let Some(msg) = line.strip_prefix("@tick ") {
                    bar2.set_message(format!("software: {msg}"));
                    bar2.inc(1);
                } else {
                    other.push_str(&line);
                    other.push('\n');
                }
            }
        }
        other
    });
    let mut out = String::new();
    if let Some(mut s) = child.stdout.take() {
        std::io::Read::read_to_string(&mut s, &mut out).context("reading the child's output")?;
    }
    let status = child.wait()?;
    let errs = errs.join().unwrap_or_default();
    if !status.success() {
        bail!("the software-AES child failed ({status}): {}", errs.trim());
    }
    serde_json::from_str(&out).map_err(|e| anyhow!("the software-AES child's output: {e}"))
}

/// The child: software series and the software half of the matrix.
pub fn run(plan_json: &str) -> anyhow::Result<i32> {
    let p: ChildPlan = serde_json::from_str(plan_json)
        .map_err(|e| crate::ui::exit::usage(format!("--child: {e}")))?;
    let plan = Plan {
        sizes: p.sizes,
        repeat: p.repeat,
        warmup: p.warmup,
        min_sample_ms: p.min_sample_ms,
    };
    let src = bulk::random_source()?;
    let mut tick = |msg: &str| stderr_line!("@tick {msg}");
    let mut series = Vec::new();
    for (b, mode) in bulk::software_pairs() {
        let [e, d] = bulk::run_pair(&plan, &src, &b, mode, SOFTWARE, &mut tick)?;
        series.push(e);
        series.push(d);
    }
    let cells = if p.matrix {
        matrix::run(&matrix::MatrixPlan::new(p.quick), &mut tick)?
    } else {
        Vec::new()
    };
    let out = ChildOut {
        openssl_version: openssl::version::version().to_string(),
        openssl_ia32cap: std::env::var("OPENSSL_ia32cap").ok(),
        series,
        matrix: cells,
    };
    println!("{}", serde_json::to_string(&out)?);
    Ok(crate::ui::exit::OK)
}
