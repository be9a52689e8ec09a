//! What the results were measured on: CPU model and AES-related features,
//! versions, the time-stamp counter rate.

use serde::{Deserialize, Serialize};

/// CPU flags that matter for AES speed, in the order reported.
pub const FEATURES: [&str; 7] = [
    "aes",
    "pclmulqdq",
    "vaes",
    "vpclmulqdq",
    "ssse3",
    "avx2",
    "avx512f",
];

/// The machine and software the run used.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct System {
    /// tpmcrypt's version.
    pub tpmcrypt_version: String,
    /// OpenSSL's version string (as linked).
    pub openssl_version: String,
    /// `model name` from /proc/cpuinfo.
    pub cpu_model: String,
    /// Logical CPUs available to this process.
    pub cpus: usize,
    /// Where the feature flags came from (`/proc/cpuinfo` or `cpuid`).
    pub features_source: String,
    /// Feature name → present, for [`FEATURES`].
    pub cpu_features: std::collections::BTreeMap<String, bool>,
    /// Kernel release.
    pub kernel: String,
    /// Measured time-stamp counter rate (Hz), calibrated against the
    /// monotonic clock over the whole run; null off x86-64.
    pub tsc_hz: Option<f64>,
}

/// Flags from /proc/cpuinfo's first `flags` line.
pub fn cpuinfo_flags() -> Option<Vec<String>> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("flags"))?;
    let (_, flags) = line.split_once(':')?;
    Some(flags.split_whitespace().map(str::to_string).collect())
}

fn cpuid_feature(name: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        match name {
            "aes" => std::arch::is_x86_feature_detected!("aes"),
            "pclmulqdq" => std::arch::is_x86_feature_detected!("pclmulqdq"),
            "ssse3" => std::arch::is_x86_feature_detected!("ssse3"),
            "avx2" => std::arch::is_x86_feature_detected!("avx2"),
            "avx512f" => std::arch::is_x86_feature_detected!("avx512f"),
            _ => false,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = name;
        false
    }
}

/// Whether the CPU has AES instructions (x86 AES-NI).
pub fn has_aes_ni() -> bool {
    match cpuinfo_flags() {
        Some(f) => f.iter().any(|x| x == "aes"),
        None => cpuid_feature("aes"),
    }
}

/// Collects everything but the TSC rate (filled in at the end of the run).
pub fn collect() -> System {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = text
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let flags = cpuinfo_flags();
    let features_source = if flags.is_some() {
        "/proc/cpuinfo"
    } else {
        "cpuid"
    };
    let cpu_features = FEATURES
        .iter()
        .map(|f| {
            let on = match &flags {
                Some(fl) => fl.iter().any(|x| x == f),
                None => cpuid_feature(f),
            };
            (f.to_string(), on)
        })
        .collect();
    System {
        tpmcrypt_version: env!("CARGO_PKG_VERSION").to_string(),
        openssl_version: openssl::version::version().to_string(),
        cpu_model,
        cpus: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        features_source: features_source.to_string(),
        cpu_features,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
        tsc_hz: None,
    }
}
