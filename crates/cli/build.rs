//! Records, for `tpmcrypt --version`, the tpm2-tss (ESYS) version this
//! binary is built against, as pkg-config reports it.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_LIBDIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_SYSROOT_DIR");
    // Only the version: tss-esapi-sys already emits the link flags.
    let version = match pkg_config::Config::new()
        .cargo_metadata(false)
        .env_metadata(false)
        .probe("tss2-esys")
    {
        Ok(lib) => lib.version,
        Err(e) => {
            println!("cargo:warning=tpm2-tss version unknown (pkg-config tss2-esys: {e})");
            "unknown".to_owned()
        }
    };
    println!("cargo:rustc-env=TPMCRYPT_TSS2_ESYS_VERSION={version}");
}
