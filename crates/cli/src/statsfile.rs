//! Where `encrypt`/`decrypt --stats-json` may write. The path is checked
//! before any work: it must never take the place of the run's data (an
//! input, an output, a file inside a tree the run walks), and it replaces
//! only a regular file this user owns that is empty or holds figures an
//! earlier run wrote (never a device, a FIFO, a socket, a symlink, a
//! directory, another user's file, or any other file: a key, a PIN file,
//! someone's data); its directory must exist. `-` and `/dev/stdout`
//! write to standard output (unless it carries the run's data),
//! `/dev/stderr` to standard error. Documented in docs/bench.md.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write as _};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;

use crate::files::FileArgs;
use crate::files::{Plan, Sink, Source, Stream};
use crate::ui::exit::usage;
use crate::ui::shown;

/// Where the figures go.
#[derive(Debug, PartialEq, Eq)]
pub enum Target {
    /// Standard output (`-`, `/dev/stdout`).
    Stdout,
    /// Standard error (`/dev/stderr`).
    Stderr,
    /// A regular file, written whole or not at all.
    File(PathBuf),
}

/// Checks `path` against the run's plan (see the module's text); a
/// refusal is a usage error naming `--stats-json` and the path.
pub fn check(path: &Path, plan: &Plan, args: &FileArgs) -> anyhow::Result<Target> {
    let refuse = |why: String| usage(format!("--stats-json {}: {why}", shown(path)));
    match crate::files::stream_named(path) {
        Some(Stream::Out) => {
            if plan.tasks.iter().any(|t| t.sink == Sink::Stdout) {
                return Err(refuse(
                    "standard output carries the run's data; give a file".into(),
                ));
            }
            return Ok(Target::Stdout);
        }
        Some(Stream::Err) => return Ok(Target::Stderr),
        // Standard input's names are symlinks there: refused below.
        Some(Stream::In) | None => {}
    }
    if let Ok(m) = fs::symlink_metadata(path) {
        let same =
            |p: &Path| fs::metadata(p).is_ok_and(|o| (o.dev(), o.ino()) == (m.dev(), m.ino()));
        for t in &plan.tasks {
            if let Source::File(p) = &t.source {
                if m.is_file() && same(p) {
                    return Err(refuse(format!("is an input of this run ({})", shown(p))));
                }
            }
        }
    }
    if let Some(why) = place_refusal(path, &json_of(run_figures)) {
        return Err(refuse(why));
    }
    let Some(key) = entry_key(path, &mut HashMap::new()) else {
        return Err(refuse(format!(
            "its directory {} does not exist or cannot be reached",
            shown(crate::atomic::parent_dir(path))
        )));
    };
    let mut dirs = HashMap::new();
    for t in &plan.tasks {
        if let Sink::File(out) = &t.sink {
            if entry_key(out, &mut dirs).as_ref() == Some(&key) {
                return Err(refuse(format!("is an output of this run ({})", shown(out))));
            }
        }
    }
    if args.recursive {
        for input in &args.inputs {
            let tree = match fs::symlink_metadata(input) {
                Ok(m) if m.is_dir() => fs::canonicalize(input),
                _ => continue,
            };
            if tree.is_ok_and(|tree| key.0.starts_with(&tree)) {
                return Err(refuse(format!(
                    "is inside {}, a tree this run walks",
                    shown(input)
                )));
            }
        }
    }
    Ok(Target::File(path.to_path_buf()))
}

/// Why the file at `path` may not be replaced by figures, or None if it
/// may (or nothing is there): only a regular file this user owns that is
/// empty (made by `mktemp` for them) or holds figures written before (as
/// `earlier` tells) is replaced. Anything else may be a device (as root,
/// `/dev/null` replaced by a file), someone's data, a key the run reads
/// (`-i`, a keystore key file, a PIN file) or a recipients file: a hostile
/// round found each of them replaced by the JSON. Also for `watch
/// --stats-json`.
pub fn replace_refusal(path: &Path, earlier: fn(&serde_json::Value) -> bool) -> Option<String> {
    replace_refusal_of(path, &json_of(earlier))
}

/// What an earlier run wrote, told from the bytes of a file (its first
/// MiB; never called for an empty file).
pub type Earlier<'a> = &'a dyn Fn(&[u8]) -> bool;

/// A JSON document `earlier` recognises.
fn json_of(earlier: fn(&serde_json::Value) -> bool) -> impl Fn(&[u8]) -> bool {
    move |text| serde_json::from_slice::<serde_json::Value>(text).is_ok_and(|v| earlier(&v))
}

/// [`replace_refusal`] for a file of any format: `earlier` tells what an
/// earlier run wrote from its bytes (also `bench --csv`, `--plot`).
pub fn replace_refusal_of(path: &Path, earlier: Earlier) -> Option<String> {
    let m = fs::symlink_metadata(path).ok()?;
    if let Some(kind) = crate::ui::not_regular(&m) {
        return Some(format!(
            "is {kind}, not a regular file: refusing to replace it"
        ));
    }
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    if m.uid() != me {
        return Some(format!(
            "belongs to another user (uid {}): refusing to replace it",
            m.uid()
        ));
    }
    (!holds_figures(path, earlier)).then(|| {
        "exists and is neither empty nor figures tpmcrypt wrote: refusing to replace it \
         (remove it, or give another name)"
            .to_string()
    })
}

/// Figures of an `encrypt` or `decrypt` run.
fn run_figures(v: &serde_json::Value) -> bool {
    v.get("command").is_some_and(serde_json::Value::is_string) && v.get("files_ok").is_some()
}

/// Whether the regular file `path` is empty or holds figures `earlier`
/// recognises.
fn holds_figures(path: &Path, earlier: Earlier) -> bool {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    const MAX: u64 = 1 << 20;
    let Ok(file) = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    else {
        return false;
    };
    let mut text = Vec::new();
    if file.take(MAX + 1).read_to_end(&mut text).is_err() || text.len() as u64 > MAX {
        return false;
    }
    if text.is_empty() {
        return true;
    }
    earlier(&text)
}

/// Why figures may not be written at `path`, or None if they may: what
/// [`replace_refusal_of`] refuses, a name ending in `/`, and a directory
/// that does not exist. Checked before any work (`--stats-json`, and
/// `bench --json-file`, `--csv`, `--plot`).
pub fn place_refusal(path: &Path, earlier: Earlier) -> Option<String> {
    if fs::symlink_metadata(path).is_ok() {
        if let Some(why) = replace_refusal_of(path, earlier) {
            return Some(why);
        }
    }
    if path.as_os_str().as_encoded_bytes().ends_with(b"/") {
        return Some("ends with /: give a file name".into());
    }
    let dir = crate::atomic::parent_dir(path);
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => None,
        Ok(_) => Some(format!("{} is not a directory", shown(dir))),
        Err(_) => Some(format!(
            "its directory {} does not exist or cannot be reached",
            shown(dir)
        )),
    }
}

/// Writes `bytes` to the regular file `path` (`label`: the option and
/// path, for errors), checked once more against [`replace_refusal_of`]
/// (something else may have been put there since the run began), under a
/// temporary name renamed over it: a failure leaves the old file.
pub fn write_file(path: &Path, label: &str, bytes: &[u8], earlier: Earlier) -> anyhow::Result<()> {
    if let Some(why) = replace_refusal_of(path, earlier) {
        anyhow::bail!("{label}: {why} (it changed during the run)");
    }
    let mut out =
        crate::atomic::AtomicFile::create(path, 0o644, true).with_context(|| label.to_string())?;
    out.file()
        .write_all(bytes)
        .with_context(|| label.to_string())?;
    out.commit().with_context(|| label.to_string())
}

/// A directory entry as (its directory, resolved; its name): two paths
/// that name one entry (`a`, `./a`, `t/sub/../a`) get one key. Resolved
/// directories are cached in `dirs` (a run names thousands of outputs in
/// a few directories).
fn entry_key(
    path: &Path,
    dirs: &mut HashMap<PathBuf, Option<PathBuf>>,
) -> Option<(PathBuf, std::ffi::OsString)> {
    let name = path.file_name()?.to_os_string();
    let dir = crate::atomic::parent_dir(path).to_path_buf();
    let resolved = dirs
        .entry(dir)
        .or_insert_with_key(|d| fs::canonicalize(d).ok())
        .clone()?;
    Some((resolved, name))
}

/// Writes `text` to `target`. A file is checked once more (it may have
/// been replaced by something that is not a regular file since), then
/// written under a temporary name and renamed over it.
pub fn write(target: &Target, text: &str) -> anyhow::Result<()> {
    match target {
        Target::Stdout => {
            let mut out = io::stdout().lock();
            out.write_all(text.as_bytes())
                .and_then(|()| out.flush())
                .context("--stats-json: writing to standard output")
        }
        Target::Stderr => io::stderr()
            .write_all(text.as_bytes())
            .context("--stats-json: writing to standard error"),
        Target::File(path) => write_file(
            path,
            &format!("--stats-json {}", shown(path)),
            text.as_bytes(),
            &json_of(run_figures),
        ),
    }
}
