//! `tpmcrypt --version`: the version, the AES backends compiled in and which
//! one each mode uses by default, and the tpm2-tss version built against
//! (pkg-config at build time, `build.rs`) and loaded (at run time).
//!
//! `-V` stays one line. The long text is made only when `--version` is
//! asked for, so no other run pays for it.

use tpmcrypt_cipher::backend;
use tpmcrypt_cipher::segment::{Mode, Params};

/// What clap prints for `--version` (after the name); [`long`] extends it.
pub const LONG: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    "\ntpm2-tss ",
    env!("TPMCRYPT_TSS2_ESYS_VERSION"),
    " (built against)"
);

/// Whether `rendered` is clap's `--version` text (not `-V`'s one line).
pub fn is_long(rendered: &str) -> bool {
    rendered.contains(" (built against)")
}

/// The full `--version` text.
pub fn long() -> String {
    let compiled: Vec<&str> = backend::all().iter().map(|b| b.name()).collect();
    let loaded = match tpmcrypt_tpmkey::stack::esys_library() {
        Some(path) => path.display().to_string(),
        None => "unknown".to_owned(),
    };
    format!(
        "tpmcrypt {}\n\
         backends: {} (default: {})\n\
         tpm2-tss {} (built against); loaded: {loaded}\n",
        env!("CARGO_PKG_VERSION"),
        compiled.join(", "),
        defaults(),
        env!("TPMCRYPT_TSS2_ESYS_VERSION"),
    )
}

/// The default backend of each mode and key size, grouped:
/// `aws-lc for AES-128/256-GCM, openssl for AES-192-GCM and AES-CBC`.
fn defaults() -> String {
    let cases = [
        (Mode::Gcm, 128, "AES-128-GCM"),
        (Mode::Gcm, 192, "AES-192-GCM"),
        (Mode::Gcm, 256, "AES-256-GCM"),
        (Mode::Cbc, 128, "AES-CBC"),
    ];
    let mut groups: Vec<(&'static str, Vec<&str>)> = Vec::new();
    for (mode, bits, label) in cases {
        let Ok(params) = Params::new(mode, bits) else {
            continue;
        };
        let name = params.default_backend().name();
        match groups.iter_mut().find(|(n, _)| *n == name) {
            Some((_, labels)) => labels.push(label),
            None => groups.push((name, vec![label])),
        }
    }
    let parts: Vec<String> = groups
        .into_iter()
        .map(|(name, labels)| format!("{name} for {}", labels.join(", ")))
        .collect();
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The long text names every compiled-in backend, a default for each
    /// mode, and both tpm2-tss lines; clap's `--version` is recognised.
    #[test]
    fn the_long_version_names_backends_and_tpm2_tss() {
        let text = long();
        let mut lines = text.lines();
        assert_eq!(
            lines.next(),
            Some(concat!("tpmcrypt ", env!("CARGO_PKG_VERSION")))
        );
        let backends = lines.next().unwrap();
        for b in backend::all() {
            assert!(backends.contains(b.name()), "{backends}");
        }
        for label in ["AES-128-GCM", "AES-192-GCM", "AES-256-GCM", "AES-CBC"] {
            assert!(backends.contains(label), "{backends}");
        }
        let tss = lines.next().unwrap();
        assert!(!tss.contains("unknown"), "{tss}");
        assert!(tss.contains("libtss2-esys.so"), "{tss}");
        assert!(is_long(&format!("tpmcrypt {LONG}\n")));
        assert!(!is_long(concat!(
            "tpmcrypt ",
            env!("CARGO_PKG_VERSION"),
            "\n"
        )));
    }
}
