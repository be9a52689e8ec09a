//! Man pages from the clap definitions themselves, so they never drift
//! from `--help`: `tpmcrypt man-pages DIR` (hidden; `scripts/package` runs
//! it) writes `tpmcrypt.1` and one page per subcommand, nested ones too
//! (`tpmcrypt-key-create.1`).

use std::path::Path;

use anyhow::Context;
use clap::CommandFactory;

use crate::args::Cli;
use crate::ui::exit;

/// Writes every page into `dir` (created if missing), replacing pages of
/// the same names.
pub fn run(dir: &Path) -> anyhow::Result<i32> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    clap_mangen::generate_to(Cli::command(), dir)
        .with_context(|| format!("writing man pages to {}", dir.display()))?;
    Ok(exit::OK)
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
