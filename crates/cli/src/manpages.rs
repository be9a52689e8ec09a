//! Man pages from the clap definitions themselves, so they never drift
//! from `--help`: `tpmcrypt man-pages DIR` (for `scripts/package`) writes
//! `tpmcrypt.1` and one page per subcommand, nested ones too
//! (`tpmcrypt-key-create.1`). It is read before clap parses, outside the
//! clap tree: a hidden subcommand would still be offered by the shell
//! completions.

use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::Context;
use clap::CommandFactory;

use crate::args::Cli;
use crate::ui::exit;

/// `tpmcrypt man-pages DIR`: `None` for any other command line, else the
/// exit code (errors as one line on stderr, as every error).
pub fn from_args(args: &[OsString]) -> Option<i32> {
    if args.get(1).map(OsString::as_os_str) != Some(OsStr::new("man-pages")) {
        return None;
    }
    let code = match &args[2..] {
        [flag] if flag == "--help" || flag == "-h" => crate::ui::stdout::line(
            "Write the manual pages into DIR (created if missing)\n\n\
                 Usage: tpmcrypt man-pages DIR\n\n\
                 A DIR that begins with - is named as ./-DIR.",
        )
        .map_or_else(|err| exit::code_for(&err), |()| exit::OK),
        // `--help` or any other option is not a directory to make.
        [dir] if dir.as_encoded_bytes().starts_with(b"-") => {
            stderr_line!(
                "error: man-pages takes one directory, not an option ({}); for a directory of \
                 that name, give ./{}",
                crate::ui::shown(Path::new(dir)),
                crate::ui::shown(Path::new(dir))
            );
            exit::USAGE
        }
        [dir] if !dir.is_empty() => match run(Path::new(dir)) {
            Ok(code) => code,
            Err(err) => {
                stderr_line!("error: {}", crate::ui::one_line(&err));
                exit::code_for(&err)
            }
        },
        _ => {
            stderr_line!("error: usage: tpmcrypt man-pages DIR (one directory)");
            exit::USAGE
        }
    };
    Some(code)
}

/// Writes every page into `dir` (created if missing), replacing pages of
/// the same names. A page name that is a symbolic link is refused, not
/// followed (a shared directory could point one anywhere).
pub fn run(dir: &Path) -> anyhow::Result<i32> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // As clap_mangen::generate_to, which would follow links.
    let mut cmd = Cli::command().disable_help_subcommand(true);
    cmd.build();
    write_pages(&cmd, dir)?;
    Ok(exit::OK)
}

/// Writes the page of `cmd` and of each visible subcommand below it.
fn write_pages(cmd: &clap::Command, dir: &Path) -> anyhow::Result<()> {
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        write_pages(sub, dir)?;
    }
    let man = clap_mangen::Man::new(cmd.clone());
    let path = dir.join(man.get_filename());
    let mut page = Vec::new();
    man.render(&mut page)?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .with_context(|| format!("{}: cannot write the page", path.display()))?;
    file.write_all(&page)
        .with_context(|| format!("{}: cannot write the page", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::process::Command;

    use super::*;

    /// The page names the clap tree calls for: `tpmcrypt`, then
    /// `tpmcrypt-SUB[-SUB…]` for every visible subcommand at any depth.
    fn expected_pages() -> BTreeSet<String> {
        fn walk(cmd: &clap::Command, name: &str, out: &mut BTreeSet<String>) {
            out.insert(format!("{name}.1"));
            for sub in cmd.get_subcommands() {
                if sub.is_hide_set() || sub.get_name() == "help" {
                    continue;
                }
                walk(sub, &format!("{name}-{}", sub.get_name()), out);
            }
        }
        let mut out = BTreeSet::new();
        walk(&Cli::command(), "tpmcrypt", &mut out);
        out
    }

    /// Every command of the clap tree has a page, no page is left over, and
    /// each renders with `man -l` without a groff warning, naming its
    /// command and every long flag `--help` shows.
    #[test]
    fn every_subcommand_has_a_page_that_renders() {
        let dir = tempfile::tempdir().unwrap();
        run(dir.path()).unwrap();
        let expected = expected_pages();
        assert!(expected.contains("tpmcrypt-key-create.1"), "{expected:?}");
        assert!(
            expected.contains("tpmcrypt-recovery-create.1"),
            "{expected:?}"
        );
        let written: BTreeSet<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(written, expected);
        for page in &expected {
            let out = Command::new("man")
                .args(["--warnings", "-E", "UTF-8", "-l"])
                .arg(dir.path().join(page))
                .env("MANWIDTH", "80")
                .env("MAN_KEEP_FORMATTING", "")
                .output()
                .expect("man (man-db, installed by scripts/setup-deps)");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success() && stderr.is_empty(),
                "{page}: {stderr}"
            );
            let text = String::from_utf8_lossy(&out.stdout);
            let command = page.trim_end_matches(".1");
            assert!(
                text.contains("NAME") && text.contains(command),
                "{page}: {text}"
            );
        }
    }

    /// A page name that is a symbolic link (planted in a shared directory)
    /// is refused, and the file it points to is left as it was.
    #[test]
    fn a_symlinked_page_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        let pages = dir.path().join("man");
        std::fs::create_dir(&pages).unwrap();
        std::os::unix::fs::symlink(&victim, pages.join("tpmcrypt.1")).unwrap();
        let err = run(&pages).expect_err("a symlinked page is refused");
        assert!(format!("{err:#}").contains("tpmcrypt.1"), "{err:#}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
    }

    /// A page shows the same flags as `--help`: every visible long flag of
    /// `tpmcrypt encrypt` is on its page.
    #[test]
    fn a_page_carries_the_flags_of_its_help() {
        let dir = tempfile::tempdir().unwrap();
        run(dir.path()).unwrap();
        let page = std::fs::read_to_string(dir.path().join("tpmcrypt-encrypt.1")).unwrap();
        let cmd = Cli::command();
        let encrypt = cmd.find_subcommand("encrypt").unwrap();
        let mut n = 0;
        for arg in encrypt.get_arguments().filter(|a| !a.is_hide_set()) {
            if let Some(long) = arg.get_long() {
                // roff escapes '-' as "\-".
                let escaped = format!("\\-\\-{}", long.replace('-', "\\-"));
                assert!(page.contains(&escaped), "--{long} missing");
                n += 1;
            }
        }
        assert!(n > 5, "{n} flags");
    }
}
