//! Interoperability with tpm2-tools (Debian 12: tpm2-tools 5.4).

mod common;

use common::*;
use tpmcrypt_tpmkey::{KeyAlg, KeyBlob, Keystore};

/// Our transient SRK is the same object `tpm2_createprimary -G ecc` makes
/// with the standard SRK attributes.
#[test]
fn srk_matches_tpm2_createprimary() {
    let sim = start();
    let ours = sim.open().srk_name().unwrap();
    sim.tools_srk("p.ctx");
    let out = sim.tool_ok(&["tpm2_readpublic", "-c", "p.ctx"]);
    sim.tool_ok(&["tpm2_flushcontext", "-t"]);
    let name = out
        .lines()
        .find_map(|l| l.strip_prefix("name: "))
        .expect("tpm2_createprimary prints the name");
    assert_eq!(name.trim(), ours);
}

/// Our key file loads with `tpm2_load -r key.pem` and `tpm2_rsadecrypt -s
/// oaep` decrypts what we encrypted in software.
#[test]
fn tpm2_tools_load_and_rsadecrypt_our_key() {
    let sim = start();
    let blob = sim.open().create_key(KeyAlg::Rsa2048, None, None).unwrap();
    std::fs::write(sim.path("key.pem"), blob.to_pem()).unwrap();
    let secret = random32();
    std::fs::write(sim.path("ct.bin"), rsa_encrypt(&blob, &secret)).unwrap();
    sim.tool_ok(&["tpm2_load", "-r", "key.pem", "-c", "key.ctx"]);
    // Without a resource manager tpm2_load leaves the primary and key
    // loaded; the saved context is what the next tool uses.
    sim.tool_ok(&["tpm2_flushcontext", "-t"]);
    sim.tool_ok(&[
        "tpm2_rsadecrypt",
        "-c",
        "key.ctx",
        "-s",
        "oaep",
        "-o",
        "pt.bin",
        "ct.bin",
    ]);
    sim.tool_ok(&["tpm2_flushcontext", "-t"]);
    assert_eq!(std::fs::read(sim.path("pt.bin")).unwrap(), secret);
    // The two-blob route works as well: tpm2_load -C primary -u pub -r priv.
    std::fs::write(sim.path("key.pub"), &blob.public).unwrap();
    std::fs::write(sim.path("key.priv"), &blob.private).unwrap();
    sim.tools_srk("p.ctx");
    sim.tool_ok(&["tpm2_flushcontext", "-t"]);
    sim.tool_ok(&[
        "tpm2_load",
        "-C",
        "p.ctx",
        "-u",
        "key.pub",
        "-r",
        "key.priv",
        "-c",
        "k2.ctx",
    ]);
    sim.tool_ok(&["tpm2_flushcontext", "-t"]);
    sim.tool_ok(&[
        "tpm2_rsadecrypt",
        "-c",
        "k2.ctx",
        "-s",
        "oaep",
        "-o",
        "pt2.bin",
        "ct.bin",
    ]);
    sim.tool_ok(&["tpm2_flushcontext", "-t"]);
    assert_eq!(std::fs::read(sim.path("pt2.bin")).unwrap(), secret);
}

/// A key made entirely by tpm2-tools imports through our parser/keystore
/// and unbinds (without and with a PIN).
#[test]
fn tpm2_tools_key_imports_and_unbinds() {
    let sim = start();
    sim.tools_srk("p.ctx");
    sim.tool_ok(&["tpm2_flushcontext", "-t"]);
    sim.tool_ok(&[
        "tpm2_create",
        "-C",
        "p.ctx",
        "-G",
        "rsa2048:oaep",
        "-a",
        "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|decrypt",
        "-u",
        "k.pub",
        "-r",
        "k.priv",
    ]);
    sim.tool_ok(&["tpm2_flushcontext", "-t"]);
    sim.tool_ok(&[
        "tpm2_create",
        "-C",
        "p.ctx",
        "-G",
        "rsa2048:oaep",
        "-p",
        "1234",
        "-a",
        "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|decrypt",
        "-u",
        "kp.pub",
        "-r",
        "kp.priv",
    ]);
    sim.tool_ok(&["tpm2_flushcontext", "-t"]);
    sim.tool_ok(&[
        "tpm2_encodeobject",
        "-C",
        "p.ctx",
        "-u",
        "k.pub",
        "-r",
        "k.priv",
        "-o",
        "k.pem",
    ]);
    sim.tool_ok(&["tpm2_flushcontext", "-t"]);
    sim.tool_ok(&[
        "tpm2_encodeobject",
        "-C",
        "p.ctx",
        "-u",
        "kp.pub",
        "-r",
        "kp.priv",
        "-p",
        "-o",
        "kp.pem",
    ]);
    sim.tool_ok(&["tpm2_flushcontext", "-t"]);

    let store = Keystore::open(sim.path("store")).unwrap();
    let (blob, meta) = store
        .import("tools", &sim.path("k.pem"), Some(false))
        .unwrap();
    assert_eq!(meta.alg, "rsa2048");
    assert!(!meta.has_pin);
    let (pblob, _) = store
        .import("tools-pin", &sim.path("kp.pem"), Some(true))
        .unwrap();
    // tpm2-tools 5.4 writes the emptyAuth flag inverted; the raw file says:
    let raw = KeyBlob::from_pem(&std::fs::read_to_string(sim.path("kp.pem")).unwrap()).unwrap();
    eprintln!("tpm2_encodeobject -p wrote emptyAuth={}", raw.empty_auth);

    // tpm2-tools (without a resource manager) leaves sessions behind.
    sim.tool_ok(&["tpm2_flushcontext", "-l"]);
    let mut tpm = sim.open();
    assert_clean(&mut tpm);
    let secret = random32();
    let pt = tpm
        .rsa_decrypt(&blob, None, &rsa_encrypt(&blob, &secret))
        .unwrap();
    assert_eq!(&pt[..], &secret[..]);
    let pt = tpm
        .rsa_decrypt(&pblob, Some(b"1234"), &rsa_encrypt(&pblob, &secret))
        .unwrap();
    assert_eq!(&pt[..], &secret[..]);
    assert_clean(&mut tpm);
    let (again, _) = store.load("tools").unwrap();
    assert_eq!(again, blob);
}
