//! Turning inputs and flags into (source, sink) tasks, and running a
//! transform over each task with crash-safe outputs. Shared by `encrypt` and
//! `decrypt`, which differ only in the transform and the naming rule.

use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::{self, IsTerminal, Write};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::Args;
use tpmcrypt_cipher::{StreamOptions, Timings};

use crate::atomic::{self, AtomicFile};
use crate::batch::{self, Batch, CommitError, Original, Pending};
use crate::stamp::Stamp;
use crate::ui::exit::{self, usage};
use crate::ui::{one_line, printable, shown};

/// Options shared by encrypt and decrypt: where inputs come from and where
/// outputs go.
#[derive(Args, Debug, Clone)]
pub struct FileArgs {
    /// Output file ("-" for stdout). Only with a single input, and never
    /// that input itself (to replace a file, use --in-place).
    #[arg(short, long, value_name = "OUT")]
    pub output: Option<PathBuf>,

    /// Recurse into directories given as inputs (symlinks are not followed).
    #[arg(short = 'r', long)]
    pub recursive: bool,

    /// Replace each input with its output: the original is removed only
    /// after the output is fsynced and renamed into place, and only if it
    /// is still the file that was read (one that changed is kept). Regular
    /// files only.
    #[arg(long, conflicts_with = "output")]
    pub in_place: bool,

    /// Overwrite existing outputs.
    #[arg(short, long)]
    pub force: bool,

    /// Rename outputs into place without waiting for the disk, as cp does.
    /// Faster for large files; but after a power failure an output may be
    /// empty or short (it then fails to decrypt, never decrypts wrong).
    /// Not allowed with --in-place, which removes originals.
    #[arg(long, conflicts_with = "in_place")]
    pub no_sync: bool,

    /// Worker threads for large inputs, 1 to 1024 (default: number of CPUs).
    #[arg(short = 'j', long, value_name = "N", value_parser = crate::options::parse_workers)]
    pub jobs: Option<usize>,

    /// Write the run's figures (files, bytes, time, files/s, commit time,
    /// unwraps, TPM unbinds and time) as JSON to FILE. An existing FILE is
    /// replaced only if it is empty or holds figures written before.
    #[arg(long, value_name = "FILE")]
    pub stats_json: Option<PathBuf>,

    /// Force a crypto backend (default: the fastest measured for the mode).
    #[arg(long, value_enum)]
    pub backend: Option<crate::args::value::BackendArg>,

    /// Input files or directories; none or "-" reads stdin.
    #[arg(value_name = "INPUT")]
    pub inputs: Vec<PathBuf>,
}

/// Suffix of encrypted files.
pub const SUFFIX: &str = "tpmc";

/// Which way files are named.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Naming {
    /// `X` → `X.tpmc`.
    Encrypt,
    /// `X.tpmc` → `X`.
    Decrypt,
    /// `X` → `X`, replaced (`rekey`): any tpmcrypt file, by content.
    Rekey,
}

/// Where data comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Standard input.
    Stdin,
    /// A regular file.
    File(PathBuf),
}

/// Where data goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sink {
    /// Standard output.
    Stdout,
    /// A file, written atomically.
    File(PathBuf),
}

/// One input and its output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Task {
    /// Input.
    pub source: Source,
    /// Output.
    pub sink: Sink,
    /// Found by a recursive walk, which does not follow symlinks: one
    /// swapped in for the file since is not followed either.
    pub walked: bool,
    /// Its output's name was not in its directory when the walk read it
    /// (so no one more look is needed to know; one that appears since is
    /// still never replaced).
    pub fresh_sink: bool,
}

impl Task {
    /// What to name in error messages.
    pub fn label(&self) -> String {
        match &self.source {
            Source::Stdin => "<stdin>".into(),
            Source::File(p) => shown(p),
        }
    }
}

fn is_dash(p: &Path) -> bool {
    p.as_os_str() == "-"
}

/// A standard stream, as a path names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// `/dev/stdin`, `/dev/fd/0`, `/proc/self/fd/0`.
    In,
    /// `-`, `/dev/stdout`, `/dev/fd/1`, `/proc/self/fd/1`.
    Out,
    /// `/dev/stderr`, `/dev/fd/2`, `/proc/self/fd/2`.
    Err,
}

/// The standard stream `path` names, if any: an output path that names
/// one means it (`-o`, `--stats-json`), never a file there to replace.
pub fn stream_named(path: &Path) -> Option<Stream> {
    match path.as_os_str().as_encoded_bytes() {
        b"-" | b"/dev/stdout" | b"/dev/fd/1" | b"/proc/self/fd/1" => Some(Stream::Out),
        b"/dev/stdin" | b"/dev/fd/0" | b"/proc/self/fd/0" => Some(Stream::In),
        b"/dev/stderr" | b"/dev/fd/2" | b"/proc/self/fd/2" => Some(Stream::Err),
        _ => None,
    }
}

/// Where `-o OUT` writes: standard output for the names of it (see
/// [`stream_named`]), as `--stats-json` reads them; the names of standard
/// input and error are refused. Taken as files, they were replaced with
/// `--force` (as root, the system's `/dev/stdout` symlink by a file
/// holding the output).
fn sink_of(out: &Path) -> anyhow::Result<Sink> {
    match stream_named(out) {
        Some(Stream::Out) => Ok(Sink::Stdout),
        Some(Stream::In | Stream::Err) => Err(usage(format!(
            "-o {}: names standard input or standard error, not a place for the output \
             (-o - writes to standard output)",
            shown(out)
        ))),
        None => Ok(Sink::File(out.to_path_buf())),
    }
}

/// The output name for `input`.
pub fn output_name(input: &Path, naming: Naming) -> anyhow::Result<PathBuf> {
    match naming {
        Naming::Rekey => Ok(input.to_path_buf()),
        Naming::Encrypt => {
            let mut name = input.as_os_str().to_owned();
            name.push(".");
            name.push(SUFFIX);
            // Made through its directory, such a ciphertext could be
            // written, but no run could then open it by its path (a walk
            // more than about 450 levels deep).
            let longest = libc::PATH_MAX as usize - 1;
            if name.len() > longest {
                return Err(usage(format!(
                    "{}: its ciphertext's path would be {} bytes, more than the system allows \
                     ({longest}), and no later run could open it by that path; run from a \
                     directory nearer to it",
                    shown(input),
                    name.len()
                )));
            }
            Ok(PathBuf::from(name))
        }
        Naming::Decrypt => {
            // Bytes, not text: a name that is not UTF-8 keeps every byte.
            let s = input.as_os_str().as_bytes();
            match s.strip_suffix(format!(".{SUFFIX}").as_bytes()) {
                Some(stem) if !stem.is_empty() && !stem.ends_with(b"/") => {
                    Ok(PathBuf::from(OsStr::from_bytes(stem)))
                }
                _ => Err(usage(format!(
                    "{}: cannot derive an output name (no .{SUFFIX} suffix); use -o",
                    shown(input)
                ))),
            }
        }
    }
}

/// A file a recursive run leaves out, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// The file.
    pub path: PathBuf,
    /// Why, as shown after its name.
    pub why: &'static str,
}

/// What a run will do: its tasks, and the files it leaves out.
#[derive(Debug, Default)]
pub struct Plan {
    /// One per input.
    pub tasks: Vec<Task>,
    /// Files met while recursing that are not inputs.
    pub skipped: Vec<Skipped>,
    /// Files and directories met while recursing that fail by themselves
    /// (a directory that cannot be read, a ciphertext with no name to give
    /// its output): each is an error line, and the others go on.
    pub failed: Vec<(PathBuf, String)>,
    /// Inputs named more than once (`a ./a`, or named and found by `-r`):
    /// the first name, and the one left out (each is done once).
    pub same: Vec<(PathBuf, PathBuf)>,
}

/// Plans the tasks for the given inputs and flags.
pub fn plan(args: &FileArgs, naming: Naming) -> anyhow::Result<Plan> {
    let stdin_only = args.inputs.is_empty() || (args.inputs.len() == 1 && is_dash(&args.inputs[0]));
    if stdin_only {
        return stdin_plan(args, naming);
    }
    if args.inputs.iter().any(|p| is_dash(p)) {
        return Err(usage("\"-\" (stdin) cannot be mixed with file inputs"));
    }
    let (mut sources, mut skipped, mut failed, same, names) = gather(args, naming)?;
    if let Some(out) = &args.output {
        if sources.len() != 1 || args.recursive {
            return Err(usage("-o takes exactly one input file"));
        }
        let sink = sink_of(out)?;
        let (src, walked) = sources.remove(0);
        if naming != Naming::Rekey && sink != Sink::Stdout {
            refuse_output_that_is_its_input(&src, out, naming)?;
        }
        return Ok(Plan {
            tasks: vec![Task {
                source: Source::File(src),
                sink,
                walked,
                fresh_sink: false,
            }],
            skipped,
            failed,
            same,
        });
    }
    let mut tasks = named_tasks(sources, naming, &mut failed, &names)?;
    if naming == Naming::Encrypt {
        skip_ciphertext_named_as_outputs(&mut tasks, &mut skipped);
    }
    skipped.retain(|s| !failed.iter().any(|(p, _)| *p == s.path));
    if naming != Naming::Rekey {
        refuse_outputs_that_are_inputs(&tasks)?;
    }
    Ok(Plan {
        tasks,
        skipped,
        failed,
        same,
    })
}

/// The one task of a run that reads standard input.
fn stdin_plan(args: &FileArgs, naming: Naming) -> anyhow::Result<Plan> {
    if args.in_place {
        return Err(usage("--in-place needs input files, not stdin"));
    }
    let sink = match &args.output {
        Some(p) => sink_of(p)?,
        None => Sink::Stdout,
    };
    // `-o a - < a`: the input is the output all the same.
    if let Sink::File(out) = &sink {
        refuse_output_that_is_its_input(Path::new("/dev/stdin"), out, naming)?;
    }
    Ok(Plan {
        tasks: vec![Task {
            source: Source::Stdin,
            sink,
            walked: false,
            fresh_sink: false,
        }],
        skipped: Vec::new(),
        failed: Vec::new(),
        same: Vec::new(),
    })
}

/// A task per source, each output named after its input. A file found by
/// the walk that cannot be named fails by itself (into `failed`); one
/// named on the command line is a usage error.
fn named_tasks(
    sources: Vec<(PathBuf, bool)>,
    naming: Naming,
    failed: &mut Vec<(PathBuf, String)>,
    names: &DirNames,
) -> anyhow::Result<Vec<Task>> {
    let mut tasks = Vec::with_capacity(sources.len());
    for (src, walked) in sources {
        match output_name(&src, naming) {
            Ok(out) => tasks.push(Task {
                fresh_sink: walked && is_fresh(names, &out),
                sink: Sink::File(out),
                source: Source::File(src),
                walked,
            }),
            Err(e) if walked => failed.push((src, format!("{e:#}"))),
            Err(e) => return Err(e),
        }
    }
    Ok(tasks)
}

/// A walked input that is another task's output (`f.tpmc` beside `f`) is
/// looked at now, not when opened: if it is a tpmcrypt file already, it is
/// left out here, as it would be by the run, so that it is not taken for
/// an input the run would overwrite (the run then reports that `f.tpmc`
/// exists). Only such inputs are read at planning time.
fn skip_ciphertext_named_as_outputs(tasks: &mut Vec<Task>, skipped: &mut Vec<Skipped>) {
    let outputs: std::collections::HashSet<&Path> = tasks
        .iter()
        .filter_map(|t| match &t.sink {
            Sink::File(p) => Some(p.as_path()),
            Sink::Stdout => None,
        })
        .collect();
    let mut left_out = Vec::new();
    for (i, t) in tasks.iter().enumerate() {
        if let Source::File(p) = &t.source {
            if t.walked && outputs.contains(p.as_path()) && starts_with_magic(p).unwrap_or(false) {
                left_out.push(i);
            }
        }
    }
    for i in left_out.into_iter().rev() {
        if let Source::File(path) = tasks.remove(i).source {
            skipped.push(Skipped { path, why: ALREADY });
        }
    }
    skipped.sort_by(|a, b| a.path.cmp(&b.path));
}

/// Whether `out`'s name was not among those its directory held when the
/// walk read it (false when that directory was not read).
fn is_fresh(names: &DirNames, out: &Path) -> bool {
    match (names.get(atomic::parent_dir(out)), out.file_name()) {
        (Some(seen), Some(name)) => !seen.contains(name),
        _ => false,
    }
}

/// The names each directory the walk read held then.
type DirNames = std::collections::HashMap<PathBuf, std::collections::HashSet<std::ffi::OsString>>;

/// What [`gather`] found: the inputs (each with whether a walk found
/// it), the files left out, those failing by themselves, the inputs
/// named more than once, and the names in each directory walked.
type Gathered = (
    Vec<(PathBuf, bool)>,
    Vec<Skipped>,
    Vec<(PathBuf, String)>,
    Vec<(PathBuf, PathBuf)>,
    DirNames,
);

/// The file inputs: those named, then those found by walking the named
/// directories (with `-r`), each entry once.
fn gather(args: &FileArgs, naming: Naming) -> anyhow::Result<Gathered> {
    let mut sources = Vec::new();
    let mut walk_out = Walked::default();
    for input in &args.inputs {
        let meta = fs::symlink_metadata(input).with_context(|| shown(input))?;
        if meta.is_dir() {
            if !args.recursive {
                return Err(usage(format!(
                    "{}: is a directory (use -r to recurse)",
                    shown(input)
                )));
            }
            walk(input, naming, &mut walk_out).with_context(|| shown(input))?;
        } else {
            sources.push((input.clone(), false));
        }
    }
    let Walked {
        inputs,
        skipped,
        failed,
        names,
    } = walk_out;
    sources.extend(inputs.into_iter().map(|p| (p, true)));
    // One input cannot be named twice; a walk of one tree meets each entry
    // once.
    let same = if args.inputs.len() > 1 {
        drop_repeated(&mut sources)
    } else {
        Vec::new()
    };
    Ok((sources, skipped, failed, same, names))
}

/// Keeps the first of the sources that name one directory entry (the
/// same name in the same directory, however the path spells it: `a`,
/// `./a`, `d/../a`, through a symlinked directory) and returns the pairs
/// (first, repeated) of those left out. Two different names of one file
/// (hard or symbolic links) stay two inputs: each has its own output.
fn drop_repeated(sources: &mut Vec<(PathBuf, bool)>) -> Vec<(PathBuf, PathBuf)> {
    use std::collections::HashMap;
    let mut dirs: HashMap<PathBuf, Option<(u64, u64)>> = HashMap::new();
    let mut seen: HashMap<(u64, u64, std::ffi::OsString), PathBuf> = HashMap::new();
    let mut same = Vec::new();
    sources.retain(|(path, _)| {
        let dir = atomic::parent_dir(path).to_path_buf();
        let dir_id = *dirs
            .entry(dir)
            .or_insert_with_key(|d| fs::metadata(d).ok().map(|m| (m.dev(), m.ino())));
        let (Some((dev, ino)), Some(name)) = (dir_id, path.file_name()) else {
            return true;
        };
        match seen.entry((dev, ino, name.to_os_string())) {
            std::collections::hash_map::Entry::Occupied(first) => {
                same.push((first.get().clone(), path.clone()));
                false
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(path.clone());
                true
            }
        }
    });
    same
}

/// What [`walk`] found.
#[derive(Default)]
struct Walked {
    inputs: Vec<PathBuf>,
    skipped: Vec<Skipped>,
    failed: Vec<(PathBuf, String)>,
    names: DirNames,
}

/// Refuses `-o OUT IN` where OUT is IN itself (`-o a a`, `-o ./a a`, a
/// hard link): written over, the input would be replaced by its own
/// output, a step only `--in-place` takes with the checks it needs (a
/// version saved meanwhile is kept). Before, `-o a a` replaced the input
/// without `--force`, and lost a version an editor saved during the run.
fn refuse_output_that_is_its_input(src: &Path, out: &Path, naming: Naming) -> anyhow::Result<()> {
    let id = |m: fs::Metadata| (m.dev(), m.ino());
    // The output's own name: a symlink there is replaced, not followed.
    let (Ok(input), Ok(output)) = (fs::metadata(src), fs::symlink_metadata(out)) else {
        return Ok(());
    };
    if id(input) != id(output) {
        return Ok(());
    }
    let what = match naming {
        Naming::Decrypt => "plaintext",
        _ => "ciphertext",
    };
    Err(usage(format!(
        "-o {}: that is the input {} itself; to replace a file by its {what}, use --in-place",
        shown(out),
        shown(src)
    )))
}

/// A file a run reads its keys from: `what` as shown ("the identity file
/// (-i id)").
pub struct KeyFile<'a> {
    pub what: String,
    pub path: &'a Path,
}

impl<'a> KeyFile<'a> {
    /// Each of `paths` named by `flag` (`-i`, `-R`, `--pin-file`) that is
    /// a file there (a `-R` may be a recipient itself, not a file).
    /// `-` is standard input, when that is a regular file (`-R - < recips`).
    pub fn named(kind: &str, flag: &str, paths: impl IntoIterator<Item = &'a Path>) -> Vec<Self> {
        paths
            .into_iter()
            .map(|p| {
                (
                    p,
                    if is_dash(p) {
                        Path::new("/dev/stdin")
                    } else {
                        p
                    },
                )
            })
            .filter(|(_, read)| fs::metadata(read).is_ok_and(|m| m.is_file()))
            .map(|(p, read)| KeyFile {
                what: format!("the {kind} file ({flag} {})", shown(p)),
                path: read,
            })
            .collect()
    }
}

/// Refuses, before any work and even with `--force`, a run that would
/// write an output over a file it reads its keys from (`decrypt -i id -o
/// id -f`, or `id.tpmc`'s derived `id`), or that would remove one as an
/// `--in-place` original: written over, the only identity that opens a
/// file would be replaced by that file's plaintext. Before, both ran and
/// exited 0.
/// The keystore's directory (`keystore`), where TPM keys live, takes no
/// output (so no `--in-place` run there either: its output is beside).
pub fn refuse_outputs_over_key_files(
    plan: &Plan,
    in_place: bool,
    keys: &[KeyFile],
    keystore: Option<&Path>,
) -> anyhow::Result<()> {
    let id = |m: fs::Metadata| (m.dev(), m.ino());
    let keys: Vec<_> = keys
        .iter()
        .filter_map(|k| fs::metadata(k.path).ok().map(|m| (id(m), k)))
        .collect();
    let store = keystore.and_then(|d| fs::metadata(d).ok()).map(id);
    if keys.is_empty() && store.is_none() {
        return Ok(());
    }
    let key_at = |m: io::Result<fs::Metadata>| {
        let at = m.ok().map(id)?;
        keys.iter().find(|(k, _)| *k == at).map(|(_, k)| k)
    };
    let in_store =
        |p: &Path| store.is_some() && fs::metadata(atomic::parent_dir(p)).ok().map(id) == store;
    let store_shown = || shown(keystore.unwrap_or(Path::new(".")));
    for task in &plan.tasks {
        // Standard output opened on a key file (`1<>id`, `>> id`).
        if task.sink == Sink::Stdout {
            let out = fs::metadata("/dev/stdout").ok().filter(|m| m.is_file());
            if let Some(k) = key_at(out.ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))) {
                return Err(usage(format!(
                    "standard output: that is {}, which this run reads: refusing to write over it",
                    k.what
                )));
            }
        }
        if let Sink::File(out) = &task.sink {
            // The output's own name: a symlink there is replaced.
            if let Some(k) = key_at(fs::symlink_metadata(out)) {
                return Err(usage(format!(
                    "{}: that is {}, which this run reads: refusing to write over it",
                    shown(out),
                    k.what
                )));
            }
            if in_store(out) {
                return Err(usage(format!(
                    "{}: that is in the keystore {}: refusing to write there",
                    shown(out),
                    store_shown()
                )));
            }
        }
        if let (true, Source::File(src)) = (in_place, &task.source) {
            if let Some(k) = key_at(fs::metadata(src)) {
                return Err(usage(format!(
                    "{}: that is {}, which this run reads: refusing to remove it with --in-place",
                    shown(src),
                    k.what
                )));
            }
        }
    }
    Ok(())
}

/// Refuses a run in which one input's output is another of its inputs
/// (`encrypt a a.tpmc`): that input would be overwritten, with --force,
/// before it is read.
fn refuse_outputs_that_are_inputs(tasks: &[Task]) -> anyhow::Result<()> {
    let id = |m: &fs::Metadata| (m.dev(), m.ino());
    // Usually no output exists yet: then the inputs need no second look.
    let exists = |t: &Task| {
        !t.fresh_sink && matches!(&t.sink, Sink::File(out) if fs::symlink_metadata(out).is_ok())
    };
    if !tasks.iter().any(exists) {
        return Ok(());
    }
    let inputs: std::collections::HashMap<_, &Path> = tasks
        .iter()
        .filter_map(|t| match &t.source {
            Source::File(p) => fs::metadata(p).ok().map(|m| (id(&m), p.as_path())),
            Source::Stdin => None,
        })
        .collect();
    for task in tasks {
        let (Source::File(src), Sink::File(out)) = (&task.source, &task.sink) else {
            continue;
        };
        // The output's own name: a symlink there is replaced, not followed.
        let Ok(m) = fs::symlink_metadata(out) else {
            continue;
        };
        if let Some(other) = inputs.get(&id(&m)).filter(|p| **p != src.as_path()) {
            return Err(usage(format!(
                "{} is an input and also the output of {}",
                shown(other),
                shown(src)
            )));
        }
    }
    Ok(())
}

/// Collects the inputs under `dir`, never following symlinks, deciding by
/// content, not by name: when encrypting, every regular file that is not
/// already a tpmcrypt file (by its magic bytes), whatever its name; when
/// decrypting, every `*.tpmc` file (one that is not ciphertext then fails,
/// as a damaged one would) and no other. Everything else met is recorded
/// in `skipped` with the reason. Crash leftovers are never inputs.
fn walk(dir: &Path, naming: Naming, found: &mut Walked) -> io::Result<()> {
    let mut entries: Vec<_> = fs::read_dir(dir)?.collect::<io::Result<_>>()?;
    entries.sort_by_key(|e| e.file_name());
    found.names.insert(
        dir.to_path_buf(),
        entries.iter().map(|e| e.file_name()).collect(),
    );
    for entry in entries {
        let path = entry.path();
        let ft = entry.file_type()?;
        let name = entry.file_name();
        let name = name.as_bytes();
        let why = if ft.is_dir() {
            // A subdirectory that cannot be read fails by itself, named;
            // the rest of the tree goes on.
            if let Err(e) = walk(&path, naming, found) {
                found.failed.push((
                    path,
                    format!(
                        "cannot read the directory: {}",
                        tpmcrypt_tpmkey::error::io_text(&e)
                    ),
                ));
            }
            continue;
        } else if ft.is_symlink() {
            "a symbolic link (not followed)"
        } else if !ft.is_file() {
            "not a regular file"
        } else if atomic::is_temporary_name(name) {
            // Removed if its process is gone (the directory may be marked
            // clean, and then not listed for it: see atomic.rs).
            atomic::remove_if_stale_temporary(&path, name);
            "a temporary of an interrupted run"
        } else if atomic::parse_aside(OsStr::from_bytes(name)).is_some() {
            // Put back under its name if its run was interrupted (never
            // removed); not an input of this run either way.
            atomic::restore_moved_aside(&path);
            "an original moved aside for its removal by an --in-place run"
        } else {
            match pick(&path, name, naming) {
                None => {
                    found.inputs.push(path);
                    continue;
                }
                Some(why) => why,
            }
        };
        found.skipped.push(Skipped { path, why });
    }
    Ok(())
}

/// Whether a regular file met by [`walk`] is an input (None) or why not.
fn pick(path: &Path, name: &[u8], naming: Naming) -> Option<&'static str> {
    let named_ct = name.ends_with(format!(".{SUFFIX}").as_bytes());
    match naming {
        // The name promises ciphertext: a file that is not fails loudly.
        Naming::Decrypt if named_ct => None,
        Naming::Decrypt => match starts_with_magic(path) {
            Ok(true) => Some("a tpmcrypt file without the .tpmc suffix (decrypt it with -o)"),
            Ok(false) => Some("not a tpmcrypt file"),
            Err(_) => Some("cannot be read"),
        },
        // By content, whatever the name.
        Naming::Rekey => match starts_with_magic(path) {
            Ok(true) => None,
            Ok(false) => Some("not a tpmcrypt file"),
            Err(_) => Some("cannot be read"),
        },
        // By content too, but looked at when the run opens it (see
        // `RunOptions::skip_ciphertext`): one open per file, not two.
        Naming::Encrypt => None,
    }
}

/// What kind of private key a file whose first bytes are `head` is, if it
/// is one tpmcrypt decrypts with (a TPM key file, a recovery identity): an
/// `--in-place` encryption of it to itself could never be undone.
fn private_key_kind(head: &[u8]) -> Option<&'static str> {
    use memchr::memmem;
    let has = |needle: &[u8]| memmem::find(head, needle).is_some();
    if head.starts_with(b"-----BEGIN TSS2 PRIVATE KEY-----") {
        Some("a TPM key file (TSS2 PRIVATE KEY)")
    } else if has(b"# recipient: tpmcrypt-recovery:") && has(b"PRIVATE KEY-----") {
        Some("a tpmcrypt recovery identity")
    } else {
        None
    }
}

/// A walked input that is a tpmcrypt file already: an encrypt run skips
/// it (and says so with `-v`), as it would a file of another kind.
#[derive(Debug, thiserror::Error)]
#[error("{ALREADY}")]
pub struct AlreadyEncrypted;

const ALREADY: &str = "already a tpmcrypt file";

/// The first bytes of an open file (read at offset 0, the position kept):
/// enough to tell a tpmcrypt file ([`HEAD_LEN`]) and a private key.
struct Head {
    buf: [u8; 1024],
    len: usize,
}

impl Head {
    fn read(file: &File) -> io::Result<Head> {
        use std::os::unix::fs::FileExt as _;
        let mut head = Head {
            buf: [0; 1024],
            len: 0,
        };
        while head.len < head.buf.len() {
            match file.read_at(&mut head.buf[head.len..], head.len as u64) {
                Ok(0) => break,
                Ok(k) => head.len += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(head)
    }

    fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    /// What [`is_tpmcrypt_head`] looks at.
    fn magic(&self) -> &[u8] {
        &self.buf[..self.len.min(HEAD_LEN)]
    }
}

/// How many first bytes tell a tpmcrypt file: its magic, or the BEGIN
/// line of its ASCII armor.
const HEAD_LEN: usize = {
    let (m, b) = (
        tpmcrypt_cipher::format::MAGIC.len(),
        tpmcrypt_cipher::armor::BEGIN.len(),
    );
    if m > b {
        m
    } else {
        b
    }
};

/// Whether `head` (a file's first [`HEAD_LEN`] bytes, or all of a shorter
/// one) begins a tpmcrypt file or its ASCII armor.
fn is_tpmcrypt_head(head: &[u8]) -> bool {
    head.starts_with(&tpmcrypt_cipher::format::MAGIC)
        || head.starts_with(tpmcrypt_cipher::armor::BEGIN.as_bytes())
}

/// Whether `path` begins with the tpmcrypt magic bytes, or with the BEGIN
/// line of its ASCII armor (`encrypt -a`).
fn starts_with_magic(path: &Path) -> io::Result<bool> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt;
    let mut head = [0u8; 64];
    // Never blocks on a FIFO swapped in for the file, never follows a link.
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path)?;
    let n = tpmcrypt_cipher::stream::read_full(&mut file.take(HEAD_LEN as u64), &mut head)?;
    Ok(is_tpmcrypt_head(&head[..n]))
}

/// A transform from an input to an output (encrypt or decrypt one stream).
pub type Transform<'a> = dyn Fn(
        &mut File,
        &mut (dyn Write + Send),
        &StreamOptions<'_>,
    ) -> Result<u64, tpmcrypt_cipher::Error>
    + Sync
    + 'a;

/// Settings for [`run`].
#[derive(Clone)]
pub struct RunOptions {
    /// Worker threads (`-j`); `None`: one per CPU, asked of the system only
    /// when a run has use for more than one thread (see [`RunOptions::jobs`]).
    pub jobs: Option<usize>,
    /// Inputs at least this large use the worker pool.
    pub parallel_threshold: u64,
    /// Overwrite existing outputs.
    pub force: bool,
    /// Remove inputs after their outputs are durable.
    pub in_place: bool,
    /// Rename outputs into place without fsync (`--no-sync`; never with
    /// `in_place`).
    pub no_sync: bool,
    /// Show progress bars on a terminal.
    pub progress: bool,
    /// Refuse to write to a terminal (ciphertext).
    pub refuse_tty_output: bool,
    /// What the outputs hold: ciphertext when encrypting.
    pub output_kind: Holds,
    /// Inputs found by the walk that are tpmcrypt files already are
    /// skipped (encrypt), seen by their first bytes once opened for the
    /// run (the walk does not open every file to look).
    pub skip_ciphertext: bool,
    /// Bounds of a group commit (see [`crate::batch`]).
    pub batch: batch::Limits,
    /// The engine's read, AES and write time over the whole run.
    pub timings: std::sync::Arc<Timings>,
}

impl RunOptions {
    /// Worker threads for large inputs and for many files. The CPU count
    /// (which reads cgroup files) is looked up on first use only: a run
    /// over one small file never needs it.
    pub fn jobs(&self) -> usize {
        crate::options::workers(self.jobs)
    }
}

/// What a run's outputs hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holds {
    /// Encrypting: the inputs are plaintext.
    Ciphertext,
    /// Decrypting.
    Plaintext,
}

impl std::fmt::Display for Holds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Holds::Ciphertext => "ciphertext",
            Holds::Plaintext => "plaintext",
        })
    }
}

/// Writing an output failed (disk full, file too large, broken pipe, …).
/// The error line then names the output, not the input:
/// `error: OUT: cannot write the ciphertext of IN: No space left on device`.
#[derive(Debug, thiserror::Error)]
#[error("cannot write the {kind} of {input}")]
pub struct WriteError {
    /// The output, as given (or `<stdout>`).
    pub output: String,
    /// The input's label.
    pub input: String,
    /// What the output holds.
    pub kind: Holds,
}

/// A writer that remembers whether a write to it failed, so a failure of
/// the transform can be blamed on the output rather than the input.
struct Tap<'a> {
    inner: &'a mut (dyn Write + Send),
    failed: bool,
    /// The failure was EPIPE: the reader went away.
    reader_gone: bool,
}

impl Tap<'_> {
    fn noted<T>(&mut self, r: io::Result<T>) -> io::Result<T> {
        if let Err(e) = &r {
            if e.kind() != io::ErrorKind::Interrupted {
                self.failed = true;
                self.reader_gone |= e.kind() == io::ErrorKind::BrokenPipe;
            }
        }
        r
    }
}

impl Write for Tap<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let r = self.inner.write(buf);
        self.noted(r)
    }

    fn flush(&mut self) -> io::Result<()> {
        let r = self.inner.flush();
        self.noted(r)
    }
}

/// A regular input whose size or time stamps changed while it was read:
/// what was read may mix two versions of it, so the output is not kept
/// (or, already streamed to stdout or a device, is reported as such).
#[derive(Debug, thiserror::Error)]
#[error("changed while it was being read (size or time stamps differ); {outcome}")]
pub struct InputChanged {
    outcome: &'static str,
}

/// `--in-place` on a symlink: the link would be replaced by its target's
/// output, so it is refused before anything is read.
#[derive(Debug, thiserror::Error)]
#[error(
    "is a symbolic link: symlinks are not followed with --in-place (give the file it points to)"
)]
pub struct InPlaceSymlink;

/// `--in-place` on a FIFO, a device or a socket: there is no file to
/// replace (a FIFO's data would be taken, then the run failed; a device
/// was left as it was, with a ciphertext beside it, and no word).
#[derive(Debug, thiserror::Error)]
#[error("is not a regular file (a FIFO, a device or a socket): --in-place replaces regular files only (give it without --in-place)")]
pub struct InPlaceNotRegular;

/// `--in-place` of a file whose owner or group this user may not give to
/// its output (not root, another user's file): the output would change who
/// owns the file, so nothing is done.
#[derive(Debug, thiserror::Error)]
#[error("replacing it would change who owns it: cannot give its output the owner and group of the original (uid {uid}, gid {gid})")]
pub struct OwnerNotKept {
    uid: u32,
    gid: u32,
}

/// `encrypt --in-place` of a file with other hard links: removing this name
/// would leave the plaintext readable under the others, so nothing is done.
#[derive(Debug, thiserror::Error)]
#[error("has {0} hard links: --in-place would leave the plaintext under the others (encrypt without --in-place, or remove the other links)")]
pub struct SharedOriginal(u64);

/// Totals over a run.
#[derive(Default, Debug)]
pub struct Summary {
    /// Tasks that succeeded.
    pub ok: u64,
    /// Tasks that failed.
    pub failed: u64,
    /// Plaintext bytes processed.
    pub bytes: u64,
    /// Exit code of the first failure.
    pub first_code: Option<i32>,
    /// Time spent waiting for outputs to become durable (group commits).
    pub durable_wait: std::time::Duration,
    /// Walked inputs left out once opened (see
    /// `RunOptions::skip_ciphertext`), in task order.
    pub skipped: Vec<Skipped>,
}

/// Runs `transform` over every task; a failing task is reported as
/// `error: <file>: <cause>` and does not stop the others.
pub fn run(tasks: &[Task], opts: &RunOptions, transform: &Transform<'_>) -> Summary {
    // Before any worker thread: reading it sets it for a moment.
    let _ = current_umask();
    // Best effort: without it an interrupted run's temporary waits for the
    // next run to clean it up, as after kill -9.
    let _ = atomic::remove_temporaries_on_interrupt();
    let files_only = tasks
        .iter()
        .all(|t| matches!((&t.source, &t.sink), (Source::File(_), Sink::File(_))));
    if files_only && tasks.len() > 1 && opts.jobs() > 1 {
        return run_parallel(tasks, opts, transform);
    }
    let mut summary = Summary::default();
    let mut batch = Batch::new(opts.batch);
    for (i, task) in tasks.iter().enumerate() {
        // An input that may block (a FIFO, stdin, a device) must not hold
        // back outputs that are complete already.
        if !batch.is_empty() && !is_regular_input(task) {
            commit(&mut batch, tasks, opts, &mut summary);
        }
        match run_one(i, task, opts, transform) {
            // Standard output is the only output of such a run.
            Err(err) if task.sink == Sink::Stdout && crate::ui::stdout::is_broken_pipe(&err) => {
                crate::ui::stdout::end_by_sigpipe()
            }
            r => {
                let r = retry_out_of_files(r, i, tasks, opts, transform, &mut batch, &mut summary);
                take(r, task, &mut batch, tasks, opts, &mut summary)
            }
        }
    }
    commit(&mut batch, tasks, opts, &mut summary);
    summary
}

/// Runs file-to-file tasks on `opts.jobs` workers at once (small files are
/// otherwise one core's work each, one after another), at most a batch's
/// window of them under way or waiting (each holds open files). Results
/// are taken in task order, so error lines, the batch and the summary are
/// as a sequential run's; a batch whose next result is slow to come (a large
/// file, a FIFO) is committed at its age bound rather than held back.
fn run_parallel(tasks: &[Task], opts: &RunOptions, transform: &Transform<'_>) -> Summary {
    use crossbeam_channel::{bounded, RecvTimeoutError};
    use std::collections::BTreeMap;
    let mut summary = Summary::default();
    let limits = opts.batch.for_tasks(tasks.len());
    let mut batch = Batch::new(limits);
    // One progress bar per file would flicker over one another.
    let worker_opts = RunOptions {
        progress: false,
        ..opts.clone()
    };
    let (work_tx, work_rx) = bounded::<usize>(tasks.len());
    let (done_tx, done_rx) = bounded::<(usize, anyhow::Result<Done>)>(limits.window);
    std::thread::scope(|scope| {
        for _ in 0..opts.jobs().min(tasks.len()) {
            let (work_rx, done_tx) = (work_rx.clone(), done_tx.clone());
            let worker_opts = &worker_opts;
            scope.spawn(move || {
                for i in work_rx {
                    let r = run_one(i, &tasks[i], worker_opts, transform);
                    if done_tx.send((i, r)).is_err() {
                        break;
                    }
                }
            });
        }
        drop(done_tx);
        let mut sent = 0;
        while sent < tasks.len().min(limits.window) {
            let _ = work_tx.send(sent);
            sent += 1;
        }
        let mut waiting = BTreeMap::new();
        let mut next = 0;
        while next < tasks.len() {
            if let Some(r) = waiting.remove(&next) {
                let r =
                    retry_out_of_files(r, next, tasks, opts, transform, &mut batch, &mut summary);
                take(r, &tasks[next], &mut batch, tasks, opts, &mut summary);
                next += 1;
                if sent < tasks.len() {
                    let _ = work_tx.send(sent);
                    sent += 1;
                }
                continue;
            }
            match done_rx.recv_timeout(opts.batch.age) {
                Ok((i, r)) => {
                    waiting.insert(i, r);
                }
                Err(RecvTimeoutError::Timeout) => commit(&mut batch, tasks, opts, &mut summary),
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        drop(work_tx);
    });
    commit(&mut batch, tasks, opts, &mut summary);
    summary
}

/// A task that failed for want of a file descriptor (EMFILE, ENFILE) is
/// run again once the batch is committed (its outputs and originals
/// closed), a few times with a growing pause: waiting frees descriptors,
/// so a file never fails for that alone while some can be freed.
fn retry_out_of_files(
    mut r: anyhow::Result<Done>,
    i: usize,
    tasks: &[Task],
    opts: &RunOptions,
    transform: &Transform<'_>,
    batch: &mut Batch<(usize, u64)>,
    summary: &mut Summary,
) -> anyhow::Result<Done> {
    if !matches!(tasks[i].source, Source::File(_)) {
        return r;
    }
    for attempt in 0..10u64 {
        match &r {
            Err(e) if out_of_files(e) => {}
            _ => return r,
        }
        commit(batch, tasks, opts, summary);
        std::thread::sleep(std::time::Duration::from_millis(20 * attempt));
        r = run_one(i, &tasks[i], opts, transform);
    }
    r
}

/// Whether `err` comes from the limit of open files.
fn out_of_files(err: &anyhow::Error) -> bool {
    err.chain().any(|c| {
        c.downcast_ref::<io::Error>()
            .and_then(io::Error::raw_os_error)
            .is_some_and(|n| n == libc::EMFILE || n == libc::ENFILE)
    })
}

/// Takes one task's result, in task order: counts it, adds its output to
/// the batch (committing a full one), or reports its error.
fn take(
    r: anyhow::Result<Done>,
    task: &Task,
    batch: &mut Batch<(usize, u64)>,
    tasks: &[Task],
    opts: &RunOptions,
    summary: &mut Summary,
) {
    match r {
        Ok(Done::Finished(n)) => {
            summary.ok += 1;
            summary.bytes += n;
        }
        Ok(Done::Pending(p)) => {
            if batch.push(p) {
                // One disk wait per batch: its names are made durable with
                // the next batch's data (the run ends with a full commit).
                commit_by(Batch::commit_chained, batch, tasks, opts, summary);
            }
        }
        Err(err) if err.is::<AlreadyEncrypted>() => {
            if let Source::File(path) = &task.source {
                summary.skipped.push(Skipped {
                    path: path.clone(),
                    why: ALREADY,
                });
            }
        }
        Err(err) => report(summary, &task.label(), &err),
    }
}

/// Commits a batch, and one chained before it, completely (see
/// [`crate::batch`]), and counts their outcomes.
fn commit(
    batch: &mut Batch<(usize, u64)>,
    tasks: &[Task],
    opts: &RunOptions,
    summary: &mut Summary,
) {
    commit_by(Batch::commit, batch, tasks, opts, summary)
}

type Outcomes = Vec<((usize, u64), Result<(), CommitError>)>;

/// Commits with `how` and counts the outcomes it returns.
fn commit_by(
    how: fn(&mut Batch<(usize, u64)>) -> Outcomes,
    batch: &mut Batch<(usize, u64)>,
    tasks: &[Task],
    opts: &RunOptions,
    summary: &mut Summary,
) {
    if batch.is_empty() {
        return;
    }
    let start = std::time::Instant::now();
    let results = how(batch);
    summary.durable_wait += start.elapsed();
    for ((i, n), r) in results {
        let task = &tasks[i];
        match r {
            Ok(()) => {
                summary.ok += 1;
                summary.bytes += n;
            }
            Err(e) => {
                let Sink::File(dest) = &task.sink else {
                    continue;
                };
                let (label, err) = match e {
                    // The output is durable; only the original was kept.
                    CommitError::Original(e) => (task.label(), e),
                    e @ CommitError::Rename(_) if is_exists(&e) => {
                        (task.label(), anyhow::Error::new(e))
                    }
                    // Complete under its name, but not known to be durable
                    // (a directory that may not be read cannot be synced).
                    e @ CommitError::Directory(..) => {
                        let kept = match opts.in_place {
                            true => format!("; {} is kept", task.label()),
                            false => String::new(),
                        };
                        let err = anyhow::anyhow!("complete, but {e}{kept}");
                        (shown(dest), err)
                    }
                    e => {
                        let err = anyhow::Error::new(e).context(WriteError {
                            output: shown(dest),
                            input: task.label(),
                            kind: opts.output_kind,
                        });
                        (shown(dest), err)
                    }
                };
                report_labelled(summary, &label, &err);
            }
        }
    }
}

fn is_regular_input(task: &Task) -> bool {
    match &task.source {
        Source::Stdin => false,
        // The walk takes regular files only: no second stat of each.
        Source::File(_) if task.walked => true,
        Source::File(p) => fs::metadata(p).is_ok_and(|m| m.is_file()),
    }
}

fn is_exists(e: &CommitError) -> bool {
    matches!(e, CommitError::Rename(io) if io.kind() == io::ErrorKind::AlreadyExists)
}

fn report(summary: &mut Summary, task_label: &str, err: &anyhow::Error) {
    let label = match err.downcast_ref::<WriteError>() {
        Some(w) => w.output.clone(),
        None => task_label.to_string(),
    };
    report_labelled(summary, &label, err);
}

fn report_labelled(summary: &mut Summary, label: &str, err: &anyhow::Error) {
    let code = exit::code_for(err);
    let error = crate::ui::colour::error();
    stderr_line!("{error} {}: {}", printable(label), one_line(err));
    summary.failed += 1;
    summary.first_code.get_or_insert(code);
}

/// What [`run_one`] left: a finished task, or an output waiting for its
/// batch to commit.
enum Done {
    Finished(u64),
    Pending(Pending<(usize, u64)>),
}

fn stdio_file(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<File> {
    Ok(File::from(fd.try_clone_to_owned()?))
}

/// What a pipe on standard input or output is grown to: the size of a
/// segment, which is read and written whole.
const PIPE_SIZE: i32 = 1 << 20;

/// Grows `file`'s buffer to [`PIPE_SIZE`] if it is a pipe with less (a
/// pipe holds 64 KiB by default, so each segment written into one took 16
/// turns of writer and reader). Where that is refused (more than the
/// system's `fs.pipe-max-size`, or the user's pipe pages over their soft
/// limit) the pipe stays as it is: only speed is at stake.
fn grow_pipe(file: &File) {
    use std::os::fd::AsRawFd as _;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a valid descriptor with an integer argument; on
    // anything but a pipe F_GETPIPE_SZ fails (EBADF) and nothing is done.
    unsafe {
        let size = libc::fcntl(fd, libc::F_GETPIPE_SZ);
        if size > 0 && size < PIPE_SIZE {
            libc::fcntl(fd, libc::F_SETPIPE_SZ, PIPE_SIZE);
        }
    }
}

/// An input opened for its task, and what its output keeps of it.
struct Opened {
    file: File,
    /// The size of a regular file (read in parallel); None for a stream.
    size: Option<u64>,
    /// The output's permissions.
    mode: u32,
    /// How a regular input was before the read.
    stamp: Option<Stamp>,
    /// With `--in-place`: the owner the output keeps.
    owner: Option<(u32, u32)>,
}

/// Opens a task's input, refusing what the run must not read or remove.
fn open_source(task: &Task, opts: &RunOptions) -> anyhow::Result<Opened> {
    let path = match &task.source {
        Source::Stdin => {
            crate::ui::stdout::ensure_stdin_open()?;
            let file = stdio_file(io::stdin().as_fd())?;
            grow_pipe(&file);
            return Ok(Opened {
                file,
                size: None,
                mode: 0o666 & !current_umask(),
                stamp: None,
                owner: None,
            });
        }
        Source::File(path) => path,
    };
    // A walked input is opened with O_NOFOLLOW, which refuses one that
    // became a symlink since the walk; a named one is looked at first, to
    // say why it is refused.
    if opts.in_place && !task.walked {
        let kind = fs::symlink_metadata(path)?.file_type();
        if kind.is_symlink() {
            return Err(usage(InPlaceSymlink.to_string()));
        }
        // Never opened: a FIFO would wait for a writer and take its data.
        if !kind.is_file() && !kind.is_dir() {
            return Err(usage(InPlaceNotRegular.to_string()));
        }
    }
    // A walked input was a regular file when its directory was read; what
    // is opened is checked below either way.
    if !task.walked && fs::metadata(path)?.is_dir() {
        return Err(usage("is a directory (use -r to recurse)"));
    }
    // Regular files are read in parallel; pipes and devices (e.g.
    // `<(tar c dir)`) are streamed.
    let file = open_input(path, opts.in_place, task.walked)?;
    let meta = file.metadata()?;
    if meta.is_dir() {
        return Err(usage("is a directory (use -r to recurse)"));
    }
    if opts.in_place && !meta.is_file() {
        return Err(usage(InPlaceNotRegular.to_string()));
    }
    if task.walked && !meta.is_file() {
        return Err(anyhow::anyhow!(
            "is no longer a regular file (replaced since its directory was read); left as it is"
        ));
    }
    let check_magic = opts.skip_ciphertext && task.walked && meta.is_file();
    let check_key = opts.in_place && opts.output_kind == Holds::Ciphertext;
    // The first bytes, read once for both checks below.
    let head = match check_magic || check_key {
        true => Some(Head::read(&file)?),
        false => None,
    };
    if check_magic && head.as_ref().is_some_and(|h| is_tpmcrypt_head(h.magic())) {
        return Err(AlreadyEncrypted.into());
    }
    if let Some(refused) = crate::replace::refuse_input(task, &meta) {
        return Err(refused);
    }
    if opts.in_place && opts.output_kind == Holds::Ciphertext && meta.nlink() > 1 {
        // Removing one name would leave the plaintext under the others.
        return Err(anyhow::Error::new(SharedOriginal(meta.nlink())));
    }
    if let Some(head) = head.as_ref().filter(|_| check_key) {
        if let Some(what) = private_key_kind(head.bytes()) {
            return Err(usage(format!(
                "is {what}: --in-place would remove it, and it may be the key \
                 needed to open its own ciphertext; encrypt a copy without --in-place"
            )));
        }
    }
    Ok(Opened {
        size: meta.is_file().then_some(meta.len()),
        stamp: meta.is_file().then(|| Stamp::of(&meta)),
        // An output that replaces its original keeps who owns it.
        owner: opts.in_place.then(|| (meta.uid(), meta.gid())),
        // A regular file's output keeps its mode; a FIFO's or a device's
        // mode says nothing of what flows through it, so that output is
        // made as one from stdin is (the umask decides).
        mode: match meta.is_file() {
            true => meta.permissions().mode() & 0o777,
            false => 0o666 & !current_umask(),
        },
        file,
    })
}

/// Written to stdout or a device: what was written is not a copy of one
/// version of an input that changed.
const STREAMED: &str = "what was written is not a copy of one version of it";
/// Written to a file that is not kept when its input changed.
const DISCARDED: &str = "its output was not kept";

/// One task's transform, run into whichever output its sink opens.
struct Transfer<'a> {
    task: &'a Task,
    opts: &'a RunOptions,
    transform: &'a Transform<'a>,
    input: File,
    stamp: Option<Stamp>,
    stream_opts: StreamOptions<'a>,
}

impl Transfer<'_> {
    fn write_error(&self, output: &dyn std::fmt::Display) -> WriteError {
        WriteError {
            output: output.to_string(),
            input: self.task.label(),
            kind: self.opts.output_kind,
        }
    }

    /// Whether a regular input is no longer as it was before the read.
    fn changed(&self) -> bool {
        match (&self.stamp, self.input.metadata()) {
            (Some(st0), Ok(meta)) => Stamp::of(&meta) != *st0,
            (Some(_), Err(_)) => true,
            (None, _) => false,
        }
    }

    /// Runs the transform into `out`; a failure after a failed write is
    /// the output's (and, on stdout, EPIPE is told apart). A regular input
    /// must be as it was before the read.
    fn run_into(
        &mut self,
        out: &mut (dyn Write + Send),
        name: &dyn std::fmt::Display,
        outcome: &'static str,
    ) -> anyhow::Result<u64> {
        let mut tap = Tap {
            inner: out,
            failed: false,
            reader_gone: false,
        };
        let n = match (self.transform)(&mut self.input, &mut tap, &self.stream_opts) {
            Ok(n) => n,
            Err(e) if tap.failed => {
                let err = anyhow::Error::new(e);
                // Only standard output's reader going away ends a run quietly.
                let err = if tap.reader_gone && self.task.sink == Sink::Stdout {
                    let gone = io::Error::from(io::ErrorKind::BrokenPipe);
                    err.context(crate::ui::stdout::WriteFailed(gone))
                } else {
                    err
                };
                return Err(err.context(self.write_error(name)));
            }
            // An input that changed explains a failed read (it shrank, or
            // holds more than its size said) better than the read does.
            Err(e) if self.changed() => {
                return Err(anyhow::Error::new(e).context(InputChanged { outcome }))
            }
            Err(e) => return Err(e.into()),
        };
        if self.changed() {
            return Err(InputChanged { outcome }.into());
        }
        Ok(n)
    }
}

fn run_one(
    index: usize,
    task: &Task,
    opts: &RunOptions,
    transform: &Transform<'_>,
) -> anyhow::Result<Done> {
    let opened = open_source(task, opts)?;
    let workers = match opened.size {
        Some(n) if n < opts.parallel_threshold => 1,
        _ => opts.jobs().max(1),
    };
    let bar = make_bar(opts.progress, opened.size);
    let tick = |done: u64| {
        if let Some(bar) = &bar {
            bar.set_position(done);
        }
    };
    let mut transfer = Transfer {
        task,
        opts,
        transform,
        input: opened.file,
        stamp: opened.stamp,
        stream_opts: StreamOptions {
            workers,
            progress: bar.as_ref().map(|_| &tick as &(dyn Fn(u64) + Sync)),
            timings: Some(&opts.timings),
        },
    };
    let n = match &task.sink {
        Sink::Stdout => to_stdout(&mut transfer)?,
        // An output named after a walked input is never a device's.
        Sink::File(dest) if !task.walked && is_special(dest) => {
            // A device or FIFO (e.g. /dev/null): nothing to rename into place.
            let mut out = fs::OpenOptions::new().write(true).open(dest)?;
            transfer.run_into(&mut out, &shown(dest), STREAMED)?
        }
        Sink::File(dest) => {
            let out = NewFile {
                dest,
                mode: opened.mode,
                owner: opened.owner,
                bar: bar.as_ref(),
            };
            return to_file(index, out, transfer);
        }
    };
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    Ok(Done::Finished(n))
}

/// Runs a transfer into standard output, if it is there and may take it.
fn to_stdout(transfer: &mut Transfer<'_>) -> anyhow::Result<u64> {
    use crate::ui::stdout;
    if stdout::closed_at_start() {
        // Rather than write into the /dev/null put in its place.
        let closed = anyhow::Error::new(stdout::Closed);
        return Err(closed.context(transfer.write_error(&stdout::LABEL)));
    }
    let out = io::stdout();
    if transfer.opts.refuse_tty_output && out.is_terminal() {
        return Err(usage(
            "refusing to write ciphertext to a terminal (use -o FILE or --armor, or redirect it)",
        ));
    }
    let mut out = stdio_file(out.as_fd())?;
    grow_pipe(&out);
    transfer.run_into(&mut out, &stdout::LABEL, STREAMED)
}

/// A file output to create, and the progress bar to clear once written.
struct NewFile<'a> {
    dest: &'a Path,
    mode: u32,
    owner: Option<(u32, u32)>,
    bar: Option<&'a indicatif::ProgressBar>,
}

/// Runs a transfer into a new file renamed into place as `dest`: a
/// durable one waits for its batch (with its original, for
/// `--in-place`); with `--no-sync` it is renamed at once.
fn to_file(index: usize, new: NewFile<'_>, mut transfer: Transfer<'_>) -> anyhow::Result<Done> {
    let NewFile {
        dest,
        mode,
        owner,
        bar,
    } = new;
    let opts = transfer.opts;
    let replace = opts.force || crate::replace::replaces_input(transfer.task);
    // A run that names things here itself (a temporary, an original
    // moved aside) always lists the directory.
    atomic::clean_stale_partials_once(dest, replace || opts.in_place);
    let durable = opts.in_place || !opts.no_sync;
    let out = match replace {
        true => AtomicFile::create(dest, mode, true),
        // The usual case: a new name, written with none until it is done.
        false => AtomicFile::create_unnamed(dest, mode, transfer.task.fresh_sink, durable),
    };
    let mut out = out.with_context(|| format!("creating {}", shown(dest)))?;
    if let Some((uid, gid)) = owner {
        // Before any byte is written: refused, nothing is left.
        out.set_owner(uid, gid, mode)
            .map_err(|e| anyhow::Error::new(e).context(OwnerNotKept { uid, gid }))?;
    }
    // A small file's header, stream header and segment reach the file in
    // one write rather than three (each costs a system call); a segment
    // larger than the buffer is written straight through. The transform
    // flushes at its end, so a failed write is still the output's.
    let n = if durable {
        let mut w = io::BufWriter::with_capacity(SMALL_WRITE, atomic::Writeback::new(out.file()));
        transfer.run_into(&mut w, &shown(dest), DISCARDED)?
    } else {
        let mut w = io::BufWriter::with_capacity(SMALL_WRITE, out.file());
        transfer.run_into(&mut w, &shown(dest), DISCARDED)?
    };
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if durable {
        // Made durable, renamed, and its original removed with the rest
        // of its batch.
        let original = match (&transfer.task.source, transfer.stamp, opts.in_place) {
            (Source::File(src), Some(stamp), true) => Some(Original {
                path: src.clone(),
                file: transfer.input,
                stamp,
                exact: true,
            }),
            _ => None,
        };
        return Ok(Done::Pending(Pending {
            tag: (index, n),
            out,
            bytes: n,
            original,
        }));
    }
    let write_error = transfer.write_error(&shown(dest));
    out.commit_unsynced().map_err(|e| {
        if e.kind() == io::ErrorKind::AlreadyExists {
            // Another run took the name first: as when it existed.
            anyhow::Error::new(e)
        } else {
            // A failed rename or directory fsync is the output's.
            anyhow::Error::new(e).context(write_error)
        }
    })?;
    Ok(Done::Finished(n))
}

/// Writes up to this size are gathered into one (see [`to_file`]).
const SMALL_WRITE: usize = 64 << 10;

/// Opens an input; for `--in-place`, never through a symlink (one swapped in
/// after the check is refused as well).
fn open_input(path: &Path, in_place: bool, walked: bool) -> anyhow::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = fs::OpenOptions::new();
    options.read(true);
    if in_place || walked {
        // O_NONBLOCK: a FIFO swapped in after the check (or the walk) is
        // not waited for, then refused; it changes nothing for a regular
        // file. Without it another user who may write in a walked tree
        // could hold a run forever.
        options.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
    }
    options.open(path).map_err(|e| {
        if walked && e.raw_os_error() == Some(libc::ELOOP) {
            // Another user swapped a symlink in since the directory was
            // read: following it could read a file that is not theirs.
            anyhow::anyhow!("became a symbolic link after the directory was read; not followed")
        } else if in_place && e.raw_os_error() == Some(libc::ELOOP) {
            usage(InPlaceSymlink.to_string())
        } else {
            e.into()
        }
    })
}

/// An existing output that is neither a regular file nor a directory
/// (character device, FIFO, socket) is written in place.
fn is_special(path: &Path) -> bool {
    fs::metadata(path)
        .map(|m| !m.is_file() && !m.is_dir())
        .unwrap_or(false)
}

fn make_bar(enabled: bool, size: Option<u64>) -> Option<indicatif::ProgressBar> {
    const MIN: u64 = 64 << 20;
    let size = size.filter(|&s| enabled && s >= MIN && io::stderr().is_terminal())?;
    let bar = indicatif::ProgressBar::new(size);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    ) {
        bar.set_style(style);
    }
    Some(bar)
}

/// The process's umask, read once: [`run`] reads it on the main thread
/// before any worker exists (reading it means setting it for a moment).
fn current_umask() -> u32 {
    static UMASK: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    // SAFETY: umask cannot fail; it is set back immediately.
    *UMASK.get_or_init(|| unsafe {
        let old = libc::umask(0o077);
        libc::umask(old);
        old as u32
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(inputs: &[&str], output: Option<&str>) -> FileArgs {
        FileArgs {
            output: output.map(PathBuf::from),
            recursive: false,
            in_place: false,
            force: false,
            no_sync: false,
            jobs: None,
            stats_json: None,
            backend: None,
            inputs: inputs.iter().map(PathBuf::from).collect(),
        }
    }

    #[test]
    fn a_walked_input_is_never_opened_through_a_symlink() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("secret");
        fs::write(&target, b"root only").unwrap();
        let link = d.path().join("z");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = open_input(&link, false, true).unwrap_err().to_string();
        assert!(err.contains("became a symbolic link"), "{err}");
        // Named on the command line (not walked), a symlink is followed.
        assert!(open_input(&link, false, false).is_ok());
    }

    #[test]
    fn stdin_to_stdout_or_file() {
        let t = plan(&args(&[], None), Naming::Encrypt).unwrap().tasks;
        assert_eq!(
            t,
            vec![Task {
                source: Source::Stdin,
                sink: Sink::Stdout,
                walked: false,
                fresh_sink: false,
            }]
        );
        let t = plan(&args(&["-"], Some("out")), Naming::Encrypt)
            .unwrap()
            .tasks;
        assert_eq!(t[0].sink, Sink::File("out".into()));
    }

    #[test]
    fn names() {
        assert_eq!(
            output_name(Path::new("a/b.txt"), Naming::Encrypt).unwrap(),
            PathBuf::from("a/b.txt.tpmc")
        );
        assert_eq!(
            output_name(Path::new("a/b.txt.tpmc"), Naming::Decrypt).unwrap(),
            PathBuf::from("a/b.txt")
        );
        assert!(output_name(Path::new("a/b.txt"), Naming::Decrypt).is_err());
        assert!(output_name(Path::new(".tpmc"), Naming::Decrypt).is_err());
        assert!(output_name(Path::new("a/.tpmc"), Naming::Decrypt).is_err());
        assert_eq!(
            output_name(
                Path::new(OsStr::from_bytes(b"caf\xe9.tpmc")),
                Naming::Decrypt
            )
            .unwrap(),
            PathBuf::from(OsStr::from_bytes(b"caf\xe9"))
        );
    }

    #[test]
    fn directories_need_recursion_and_skip_links() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::create_dir(d.join("sub")).unwrap();
        fs::write(d.join("a"), b"a").unwrap();
        fs::write(d.join("sub/b"), b"b").unwrap();
        fs::write(d.join("sub/b.tpmc"), tpmcrypt_cipher::format::MAGIC).unwrap();
        fs::write(d.join("sub/plain.tpmc"), b"x").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", d.join("link")).unwrap();
        let mut a = args(&[d.to_str().unwrap()], None);
        assert!(plan(&a, Naming::Encrypt).is_err());
        a.recursive = true;
        let enc = plan(&a, Naming::Encrypt).unwrap();
        let sources: Vec<_> = enc.tasks.into_iter().map(|t| t.source).collect();
        // sub/b.tpmc is sub/b's output, so it is looked at now; another
        // tpmcrypt file would be left out by the run, once opened.
        assert_eq!(
            sources,
            vec![
                Source::File(d.join("a")),
                Source::File(d.join("sub/b")),
                Source::File(d.join("sub/plain.tpmc"))
            ]
        );
        let skipped = |p: &str, why| Skipped {
            path: d.join(p),
            why,
        };
        assert_eq!(
            enc.skipped,
            vec![
                skipped("link", "a symbolic link (not followed)"),
                skipped("sub/b.tpmc", "already a tpmcrypt file")
            ]
        );
        let dec = plan(&a, Naming::Decrypt).unwrap();
        let sinks: Vec<_> = dec.tasks.into_iter().map(|t| t.sink).collect();
        assert_eq!(
            sinks,
            vec![Sink::File(d.join("sub/b")), Sink::File(d.join("sub/plain"))]
        );
        assert_eq!(
            dec.skipped,
            vec![
                skipped("a", "not a tpmcrypt file"),
                skipped("link", "a symbolic link (not followed)"),
                skipped("sub/b", "not a tpmcrypt file")
            ]
        );
    }

    #[test]
    fn output_with_many_inputs_is_a_usage_error() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        fs::write(&a, b"").unwrap();
        fs::write(&b, b"").unwrap();
        let err = plan(
            &args(&[a.to_str().unwrap(), b.to_str().unwrap()], Some("o")),
            Naming::Encrypt,
        )
        .unwrap_err();
        assert_eq!(exit::code_for(&err), exit::USAGE);
    }
}
