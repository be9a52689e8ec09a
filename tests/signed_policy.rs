//! End-to-end tests of signed PCR policies (PolicyAuthorize) on a real
//! swtpm: `pcr-signer create`, `key create --pcr-signer`, `pcr sign`,
//! `key add-policy`, decrypt under the policy that holds, the refusals
//! (exit 4), the TPM commands of one unbind, and tpm2-tools satisfying the
//! same policy by hand.

mod common;
use common::{lockout_counter, port_of, swtpm, Counter};

use std::fs;
use std::path::Path;

use common::{assert_ok, bytes, tpm2_tool, tpm_handles, tpmcrypt, Run};
use tpmcrypt_tpmkey::signed::{PcrSigner, SignedPolicy};
use tpmcrypt_tpmkey::{KeyBlob, Simulator};

const TPM: i32 = 4;
const PCRS: &str = "sha256:0,7";

fn tc(dir: &Path, tcti: &str, args: &[&str]) -> Run {
    tpmcrypt(dir)
        .arg("--tpm")
        .arg(tcti)
        .args(args)
        .output()
        .expect("spawn tpmcrypt")
        .into()
}

fn plain(dir: &Path, args: &[&str]) -> Run {
    common::run(dir, args)
}

fn key_file(dir: &Path, name: &str) -> std::path::PathBuf {
    dir.join(".tpmcrypt-home").join(format!("{name}.key.pem"))
}

fn load_key(dir: &Path, name: &str) -> KeyBlob {
    KeyBlob::from_pem(&fs::read_to_string(key_file(dir, name)).unwrap()).unwrap()
}

fn assert_no_handles(sim: &Simulator, dir: &Path, after: &str) {
    let h = tpm_handles(sim, dir);
    assert!(h.is_empty(), "after {after}: the TPM still holds {h:?}");
}

/// A signer in `dir/NAME.key` (its public key in `NAME.pub`).
fn signer(dir: &Path, name: &str) {
    let key = format!("{name}.key");
    let r = plain(dir, &["pcr-signer", "create", "--out", &key]);
    assert_ok(&r, "pcr-signer create");
    assert!(String::from_utf8_lossy(&r.stdout).starts_with("-----BEGIN PUBLIC KEY-----"));
    fs::write(dir.join(format!("{name}.pub")), &r.stdout).unwrap();
    assert_eq!(common::mode_of(&dir.join(&key)), 0o600);
}

/// The current value of sha256 PCR `i`, as tpm2_pcrread prints it.
fn pcr(sim: &Simulator, dir: &Path, i: u8) -> String {
    let out = tpm2_tool(sim, dir, &["tpm2_pcrread", &format!("sha256:{i}")]);
    out.lines()
        .find_map(|l| l.trim().strip_prefix(&format!("{i} : 0x")))
        .unwrap_or_else(|| panic!("no PCR {i} in {out}"))
        .to_ascii_lowercase()
}

fn extend7(sim: &Simulator, dir: &Path) {
    tpm2_tool(
        sim,
        dir,
        &[
            "tpm2_pcrextend",
            "7:sha256=00000000000000000000000000000000000000000000000000000000000000aa",
        ],
    );
}

fn sign_current(dir: &Path, t: &str, signer: &str, out: &str) {
    let key = format!("{signer}.key");
    let r = tc(
        dir,
        t,
        &[
            "pcr",
            "sign",
            "--signer",
            &key,
            "--pcrs",
            PCRS,
            "--current",
            "-o",
            out,
        ],
    );
    assert_ok(&r, "pcr sign --current");
    assert_eq!(common::mode_of(&dir.join(out)), 0o644, "a policy is public");
}

#[test]
fn a_signed_policy_survives_a_pcr_change_once_the_new_values_are_signed() {
    let dir = common::scratch("tpmcrypt-signed-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    signer(d, "signer");
    let rec = common::recovery(d, "recovery.key");
    for (name, alg) in [("k", "ecc-p256"), ("kr", "rsa2048")] {
        let r = tc(
            d,
            &t,
            &[
                "key",
                "create",
                name,
                "--alg",
                alg,
                "--pcr-signer",
                "signer.pub",
                "--pcrs",
                PCRS,
                "--recovery",
                &rec,
            ],
        );
        assert_ok(&r, "key create --pcr-signer");
        fs::write(d.join(name), bytes(5000, name.len() as u64)).unwrap();
        assert_ok(&plain(d, &["encrypt", "--key", name, name]), "encrypt");
    }
    let ct_before = fs::read(d.join("k.tpmc")).unwrap();

    // No policy signed yet: refused before any key authorization.
    let r = tc(d, &t, &["decrypt", "-o", "-", "k.tpmc"]);
    common::assert_error_line(&r, TPM, None, &["no signed PCR policy"], "no policy yet");
    assert!(r.stdout.is_empty());

    sign_current(d, &t, "signer", "now.policy");
    for name in ["k", "kr"] {
        let r = plain(d, &["key", "add-policy", name, "now.policy"]);
        assert_ok(&r, "key add-policy");
        let r = tc(
            d,
            &t,
            &["decrypt", "-v", "-o", "-", &format!("{name}.tpmc")],
        );
        assert_ok(&r, "decrypt under the signed policy");
        assert_eq!(r.stdout, bytes(5000, name.len() as u64));
        assert!(
            r.stderr.contains("signed policy 1 of 1 (sha256:0,7)"),
            "-v names the policy: {}",
            r.stderr
        );
    }
    assert_no_handles(&sim, d, "decrypts under a signed policy");

    // An "update": PCR 7 changes. The old policy no longer holds; the
    // refusal names PCR 7 (not 0) with its value now and the signed one.
    let old7 = pcr(&sim, d, 7);
    extend7(&sim, d);
    let new7 = pcr(&sim, d, 7);
    let r = tc(d, &t, &["decrypt", "-o", "-", "k.tpmc"]);
    common::assert_error_line(
        &r,
        TPM,
        Some("k.tpmc"),
        &[
            "no signed PCR policy",
            &format!("PCR 7 is {new7} (signed: {old7})"),
        ],
        "after the PCR change",
    );
    assert!(!r.stderr.contains("PCR 0 is"), "{}", r.stderr);
    assert_no_handles(&sim, d, "a refused decrypt");

    // The new values, as predicted before the update (tpm2_pcrread's text
    // and its binary -o), signed and attached beside the old policy.
    fs::write(
        d.join("next.txt"),
        tpm2_tool(&sim, d, &["tpm2_pcrread", PCRS]),
    )
    .unwrap();
    tpm2_tool(&sim, d, &["tpm2_pcrread", PCRS, "-o", "next.bin"]);
    for (values, out) in [("next.txt", "next.policy"), ("next.bin", "next2.policy")] {
        let r = plain(
            d,
            &[
                "pcr",
                "sign",
                "--signer",
                "signer.key",
                "--pcrs",
                PCRS,
                "--values",
                values,
                "-o",
                out,
            ],
        );
        assert_ok(&r, "pcr sign --values");
    }
    assert_ok(&plain(d, &["key", "add-policy", "k", "next.policy"]), "add");
    let r = plain(d, &["key", "add-policy", "k", "next2.policy"]);
    assert_ok(&r, "add the same values again");
    assert!(
        r.stderr.contains("holds this policy already"),
        "{}",
        r.stderr
    );
    assert_eq!(
        load_key(d, "k").auth_policies.len(),
        2,
        "old and new side by side"
    );
    let show = String::from_utf8(plain(d, &["key", "show", "k"]).stdout).unwrap();
    assert!(show.contains("(2 signed policies)"), "{show}");
    assert!(show.contains("pcrs:        sha256:0,7"), "{show}");
    let r = tc(d, &t, &["decrypt", "-v", "-o", "-", "k.tpmc"]);
    assert_ok(&r, "decrypt after the new values were signed");
    assert_eq!(r.stdout, bytes(5000, 1));
    assert!(r.stderr.contains("signed policy 2 of 2"), "{}", r.stderr);
    assert_eq!(
        fs::read(d.join("k.tpmc")).unwrap(),
        ct_before,
        "nothing re-encrypted"
    );
    // The recovery identity opens what the TPM key no longer does.
    let r = plain(d, &["decrypt", "-i", "recovery.key", "-o", "-", "kr.tpmc"]);
    assert_ok(&r, "recovery");
    assert_eq!(r.stdout, bytes(5000, 2));
    assert_no_handles(&sim, d, "the whole flow");
}

#[test]
fn policies_of_another_signer_or_with_a_bad_signature_are_refused() {
    let dir = common::scratch("tpmcrypt-signed-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    signer(d, "mine");
    signer(d, "theirs");
    let r = tc(
        d,
        &t,
        &[
            "key",
            "create",
            "k",
            "--pcr-signer",
            "mine.pub",
            "--pcrs",
            PCRS,
        ],
    );
    assert_ok(&r, "key create");
    fs::write(d.join("f"), b"secret").unwrap();
    assert_ok(&plain(d, &["encrypt", "--key", "k", "f"]), "encrypt");
    sign_current(d, &t, "theirs", "theirs.policy");
    let r = plain(d, &["key", "add-policy", "k", "theirs.policy"]);
    common::assert_error_line(&r, TPM, None, &["signer mismatch"], "another signer");

    // A valid policy whose signed values were changed afterwards.
    sign_current(d, &t, "mine", "mine.policy");
    let mut forged =
        SignedPolicy::from_pem(&fs::read_to_string(d.join("mine.policy")).unwrap()).unwrap();
    forged.pcr_digest = vec![0x55; 32];
    fs::write(d.join("forged.policy"), forged.to_pem().unwrap()).unwrap();
    let r = plain(d, &["key", "add-policy", "k", "forged.policy"]);
    common::assert_error_line(&r, TPM, None, &["signature", "invalid"], "forged");
    assert_eq!(load_key(d, "k").auth_policies.len(), 0, "nothing attached");

    // Planted straight into the key file (by someone who can write it):
    // decrypt refuses them in software, and the TPM is never asked.
    let mut blob = load_key(d, "k");
    let other = PcrSigner::from_pem(&fs::read(d.join("theirs.key")).unwrap()).unwrap();
    let planted = other
        .sign(
            &PCRS.parse().unwrap(),
            &[
                hex::decode(pcr(&sim, d, 0)).unwrap(),
                hex::decode(pcr(&sim, d, 7)).unwrap(),
            ],
        )
        .unwrap();
    blob.auth_policies
        .push(tpmcrypt_tpmkey::keyfile::AuthPolicy {
            name: Some(planted.label()),
            policy: planted.commands().unwrap(),
        });
    fs::write(key_file(d, "k"), blob.to_pem()).unwrap();
    let r = tc(d, &t, &["decrypt", "-o", "-", "f.tpmc"]);
    common::assert_error_line(&r, TPM, Some("f.tpmc"), &["signer mismatch"], "planted");
    assert!(r.stdout.is_empty());
    // Beside a good policy, the planted one is passed over.
    assert_ok(&plain(d, &["key", "add-policy", "k", "mine.policy"]), "add");
    let r = tc(d, &t, &["decrypt", "-v", "-o", "-", "f.tpmc"]);
    assert_ok(&r, "decrypt with the good policy");
    assert_eq!(r.stdout, b"secret");
    assert!(r.stderr.contains("signed policy 2 of 2"), "{}", r.stderr);
    assert_no_handles(&sim, d, "refusals");
}

#[test]
fn tpm_commands_of_one_unbind_are_counted() {
    let dir = common::scratch("tpmcrypt-signed-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    signer(d, "signer");
    let r = tc(
        d,
        &t,
        &[
            "key",
            "create",
            "signed",
            "--pcr-signer",
            "signer.pub",
            "--pcrs",
            PCRS,
        ],
    );
    assert_ok(&r, "key create --pcr-signer");
    assert_ok(&tc(d, &t, &["key", "create", "plain"]), "key create");
    sign_current(d, &t, "signer", "p.policy");
    assert_ok(
        &plain(d, &["key", "add-policy", "signed", "p.policy"]),
        "add",
    );
    let mut counts = Vec::new();
    for name in ["plain", "signed"] {
        fs::write(d.join(name), b"x").unwrap();
        assert_ok(&plain(d, &["encrypt", "--key", name, name]), "encrypt");
        let counter = Counter::start(port_of(&t));
        let proxied = format!("swtpm:host=127.0.0.1,port={}", counter.port);
        let r = tc(
            d,
            &proxied,
            &["decrypt", "-o", "-", &format!("{name}.tpmc")],
        );
        assert_ok(&r, &format!("decrypt {name} through the counter"));
        let codes = counter.codes.lock().unwrap().clone();
        eprintln!("{name}: {} TPM commands: {codes:x?}", codes.len());
        counts.push(codes);
    }
    let (plain_cmds, signed_cmds) = (&counts[0], &counts[1]);
    for (cc, what) in [
        (0x17F, "PolicyPCR"),
        (0x167, "LoadExternal"),
        (0x177, "VerifySignature"),
        (0x16A, "PolicyAuthorize"),
    ] {
        assert_eq!(
            signed_cmds.iter().filter(|c| **c == cc).count(),
            1,
            "one {what}"
        );
        assert!(!plain_cmds.contains(&cc), "no {what} for a plain key");
    }
    // PCR_Read: one per PCR of the selection, before the key is loaded.
    assert_eq!(signed_cmds.iter().filter(|c| **c == 0x17E).count(), 2);
    assert_eq!(
        signed_cmds.len(),
        plain_cmds.len() + 2 + 4 + 1,
        "2 PCR reads, 4 policy commands, 1 flush more: {signed_cmds:x?} vs {plain_cmds:x?}"
    );
}

/// tpm2-tools satisfy a tpmcrypt key's signed policy by hand, from the
/// key file alone: PolicyPCR, LoadExternal + VerifySignature,
/// PolicyAuthorize, then the key unbinds (TPM2_RSA_Decrypt) in that session.
#[test]
fn tpm2_tools_satisfy_the_signed_policy_by_hand() {
    let dir = common::scratch("tpmcrypt-signed-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    let tool = |args: &[&str]| tpm2_tool(&sim, d, args);
    let flush = || {
        tool(&["tpm2_flushcontext", "-t"]);
    };
    signer(d, "signer");
    let r = tc(
        d,
        &t,
        &[
            "key",
            "create",
            "k",
            "--alg",
            "rsa2048",
            "--pcr-signer",
            "signer.pub",
            "--pcrs",
            PCRS,
        ],
    );
    assert_ok(&r, "key create");
    sign_current(d, &t, "signer", "now.policy");
    assert_ok(&plain(d, &["key", "add-policy", "k", "now.policy"]), "add");

    // Everything below comes from the key file, as another implementation
    // of the format would read it.
    let blob = load_key(d, "k");
    fs::write(d.join("k.pub"), &blob.public).unwrap();
    fs::write(d.join("k.priv"), &blob.private).unwrap();
    let signer_pub = blob.signer().unwrap().expect("a signer");
    fs::write(d.join("signer.tpm2b"), signer_pub.to_tpm2b().unwrap()).unwrap();
    let policy = &blob.signed_policies().unwrap()[0];
    fs::write(d.join("approved.bin"), policy.approved_policy().unwrap()).unwrap();
    fs::write(d.join("ahash.bin"), policy.signed_digest().unwrap()).unwrap();
    // PolicyAuthorize's parameters: TPM2B_PUBLIC, TPM2B policyRef, TPMT_SIGNATURE.
    let body = &blob.auth_policies[0].policy[1].command_policy;
    let skip = |b: &[u8]| 2 + usize::from(u16::from_be_bytes([b[0], b[1]]));
    let after_pub = &body[skip(body)..];
    fs::write(d.join("sig.bin"), &after_pub[skip(after_pub)..]).unwrap();

    let srk_attrs = "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|noda|restricted|decrypt";
    tool(&[
        "tpm2_createprimary",
        "-C",
        "o",
        "-g",
        "sha256",
        "-G",
        "ecc",
        "-a",
        srk_attrs,
        "-c",
        "p.ctx",
    ]);
    flush();
    tool(&[
        "tpm2_load",
        "-C",
        "p.ctx",
        "-u",
        "k.pub",
        "-r",
        "k.priv",
        "-c",
        "k.ctx",
    ]);
    flush();
    tool(&[
        "tpm2_loadexternal",
        "-C",
        "o",
        "-u",
        "signer.tpm2b",
        "-c",
        "signer.ctx",
        "-n",
        "signer.name",
    ]);
    flush();
    tool(&[
        "tpm2_verifysignature",
        "-c",
        "signer.ctx",
        "-d",
        "ahash.bin",
        "-s",
        "sig.bin",
        "-t",
        "ticket.bin",
    ]);
    flush();
    tool(&["tpm2_startauthsession", "--policy-session", "-S", "s.ctx"]);
    tool(&["tpm2_policypcr", "-S", "s.ctx", "-l", PCRS]);
    tool(&[
        "tpm2_policyauthorize",
        "-S",
        "s.ctx",
        "-i",
        "approved.bin",
        "-n",
        "signer.name",
        "-t",
        "ticket.bin",
    ]);

    let secret = bytes(32, 77);
    fs::write(d.join("secret.bin"), &secret).unwrap();
    let pub_pem = d.join(".tpmcrypt-home/k.pub.pem");
    let out = std::process::Command::new("openssl")
        .args([
            "pkeyutl",
            "-encrypt",
            "-pubin",
            "-inkey",
            pub_pem.to_str().unwrap(),
        ])
        .args([
            "-pkeyopt",
            "rsa_padding_mode:oaep",
            "-pkeyopt",
            "rsa_oaep_md:sha256",
        ])
        .args([
            "-pkeyopt",
            "rsa_mgf1_md:sha256",
            "-in",
            "secret.bin",
            "-out",
            "ct.bin",
        ])
        .current_dir(d)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    tool(&[
        "tpm2_rsadecrypt",
        "-c",
        "k.ctx",
        "-p",
        "session:s.ctx",
        "-s",
        "oaep",
        "-o",
        "pt.bin",
        "ct.bin",
    ]);
    tool(&["tpm2_flushcontext", "s.ctx"]);
    flush();
    assert_eq!(
        fs::read(d.join("pt.bin")).unwrap(),
        secret,
        "unbound by hand"
    );

    // Without the signed policy (PolicyPCR alone) the key is refused.
    tool(&["tpm2_startauthsession", "--policy-session", "-S", "s2.ctx"]);
    tool(&["tpm2_policypcr", "-S", "s2.ctx", "-l", PCRS]);
    let out = common::tpm2_tool_output(
        &sim,
        d,
        &[
            "tpm2_rsadecrypt",
            "-c",
            "k.ctx",
            "-p",
            "session:s2.ctx",
            "-s",
            "oaep",
            "-o",
            "pt2.bin",
            "ct.bin",
        ],
    );
    assert!(
        !out.status.success(),
        "PolicyPCR alone does not authorize the key"
    );
    tool(&["tpm2_flushcontext", "s2.ctx"]);
    flush();
}

/// With a PIN: PolicyAuthValue follows PolicyAuthorize in the key's own
/// policy (no signer can drop it). A policy that does not hold is refused
/// before the PIN is presented: no dictionary-attack try is spent.
#[test]
fn a_pin_stays_required_and_a_mismatch_spends_no_try() {
    let dir = common::scratch("tpmcrypt-signed-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    let with_pin = |pin: &str, args: &[&str]| -> Run {
        tpmcrypt(d)
            .arg("--tpm")
            .arg(&t)
            .env("TPMCRYPT_PIN", pin)
            .args(args)
            .output()
            .expect("spawn")
            .into()
    };
    signer(d, "signer");
    let r = with_pin(
        "2468",
        &[
            "key",
            "create",
            "k",
            "--pin",
            "--pcr-signer",
            "signer.pub",
            "--pcrs",
            PCRS,
        ],
    );
    assert_ok(&r, "key create --pin --pcr-signer");
    fs::write(d.join("f"), b"pinned").unwrap();
    assert_ok(&plain(d, &["encrypt", "--key", "k", "f"]), "encrypt");
    sign_current(d, &t, "signer", "now.policy");
    assert_ok(&plain(d, &["key", "add-policy", "k", "now.policy"]), "add");
    let r = with_pin("2468", &["decrypt", "-o", "-", "f.tpmc"]);
    assert_ok(&r, "decrypt with the PIN");
    assert_eq!(r.stdout, b"pinned");
    let r = with_pin("1111", &["decrypt", "-o", "-", "f.tpmc"]);
    common::assert_error_line(&r, TPM, None, &["wrong PIN"], "wrong PIN");
    assert_eq!(lockout_counter(&sim, d), 1, "one wrong PIN, one try");
    extend7(&sim, d);
    let r = with_pin("1111", &["decrypt", "-o", "-", "f.tpmc"]);
    common::assert_error_line(
        &r,
        TPM,
        None,
        &["no signed PCR policy", "PCR 7 is"],
        "mismatch",
    );
    assert_eq!(
        lockout_counter(&sim, d),
        1,
        "a policy that does not hold costs no try"
    );
    assert_no_handles(&sim, d, "PIN tests");
}

/// A careless operator: `pcr sign -o` naming the signer itself (or any
/// file that is not a signed policy) never replaces it, not even with
/// --force; a signer key others can read is refused; bad value files and
/// non-policy files are usage errors.
#[test]
fn pcr_sign_never_overwrites_the_signer_and_refuses_careless_input() {
    let dir = common::scratch("tpmcrypt-signed-");
    let d = dir.path();
    signer(d, "s");
    let z = "00".repeat(32);
    fs::write(
        d.join("v.txt"),
        format!("sha256:\n  0 : 0x{z}\n  7 : 0x{z}\n"),
    )
    .unwrap();
    let key_before = fs::read(d.join("s.key")).unwrap();
    let sign = |out: &str, extra: &[&str]| {
        let mut args = vec!["pcr", "sign", "--signer", "s.key", "--pcrs", PCRS];
        args.extend_from_slice(&["--values", "v.txt", "-o", out]);
        args.extend_from_slice(extra);
        plain(d, &args)
    };
    for extra in [&[][..], &["--force"]] {
        let r = sign("s.key", extra);
        common::assert_error_line(&r, 1, Some("s.key"), &["not a signed policy"], "-o signer");
        assert_eq!(
            fs::read(d.join("s.key")).unwrap(),
            key_before,
            "signer intact"
        );
    }
    fs::write(d.join("notes.txt"), "keep me").unwrap();
    let r = sign("notes.txt", &["--force"]);
    common::assert_error_line(
        &r,
        1,
        Some("notes.txt"),
        &["not a signed policy"],
        "-o notes",
    );
    assert_eq!(fs::read_to_string(d.join("notes.txt")).unwrap(), "keep me");
    assert_ok(&sign("p.policy", &[]), "sign");
    assert_ok(
        &sign("p.policy", &["--force"]),
        "a policy is replaced with --force",
    );

    common::chmod(&d.join("s.key"), 0o644);
    let r = sign("q.policy", &[]);
    common::assert_error_line(&r, 1, Some("s.key"), &["readable by others"], "0644 signer");
    assert!(!d.join("q.policy").exists());
    common::chmod(&d.join("s.key"), 0o600);

    // A signer that is not there: named once.
    let r = plain(
        d,
        &[
            "pcr", "sign", "--signer", "none.key", "--pcrs", PCRS, "--values", "v.txt", "-o",
            "x.policy",
        ],
    );
    common::assert_error_line(&r, 1, Some("none.key"), &["no such file"], "missing signer");
    assert_eq!(r.stderr.matches("none.key").count(), 1, "{}", r.stderr);
    // The public key given where the private one goes: said as such.
    let r = plain(
        d,
        &[
            "pcr", "sign", "--signer", "s.pub", "--pcrs", PCRS, "--values", "v.txt", "-o",
            "x.policy",
        ],
    );
    common::assert_error_line(
        &r,
        2,
        Some("s.pub"),
        &["not a PEM private key"],
        "public key",
    );

    fs::write(d.join("empty"), "").unwrap();
    let r = plain(
        d,
        &[
            "pcr", "sign", "--signer", "s.key", "--pcrs", PCRS, "--values", "empty", "-o",
            "e.policy",
        ],
    );
    common::assert_error_line(&r, 2, Some("empty"), &["got 0 bytes"], "empty values");
    // A file that is no policy at all, given to key add-policy: usage.
    let r = plain(d, &["key", "add-policy", "nokey", "s.pub"]);
    assert_eq!(r.code, 2, "no such key: {}", r.stderr);
}

/// `key add-policy` run several times at once on one key (policies
/// attached by separate jobs) keeps every policy: each reads the key file,
/// adds its policy and writes it back, and without a lock a later write
/// replaced an earlier one's policy, which every run still reported as
/// added.
#[test]
fn concurrent_add_policy_loses_no_policy() {
    let dir = common::scratch("tpmcrypt-signed-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    signer(d, "signer");
    let r = tc(
        d,
        &t,
        &[
            "key",
            "create",
            "k",
            "--pcr-signer",
            "signer.pub",
            "--pcrs",
            PCRS,
        ],
    );
    assert_ok(&r, "key create --pcr-signer");
    drop(sim);
    let mut total = 0;
    for round in 0..2u8 {
        let (mut files, mut children) = (Vec::new(), Vec::new());
        for i in 0..8u8 {
            let n = round * 8 + i;
            let values = format!(
                "sha256:\n  0 : 0x{}\n  7 : 0x{}\n",
                format!("{n:02x}").repeat(32),
                "ab".repeat(32)
            );
            let (v, p) = (format!("v{n}.txt"), format!("p{n}.policy"));
            fs::write(d.join(&v), values).unwrap();
            let r = plain(
                d,
                &[
                    "pcr",
                    "sign",
                    "--signer",
                    "signer.key",
                    "--pcrs",
                    PCRS,
                    "--values",
                    &v,
                    "-o",
                    &p,
                ],
            );
            assert_ok(&r, "pcr sign --values");
            files.push(p);
        }
        // All at once.
        for p in &files {
            children.push(
                tpmcrypt(d)
                    .args(["key", "add-policy", "k", p])
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .expect("spawn"),
            );
        }
        for mut c in children {
            assert!(c.wait().unwrap().success(), "key add-policy");
        }
        total += 8;
        let held = load_key(d, "k").signed_policies().unwrap().len();
        assert_eq!(
            held, total,
            "round {round}: policies lost to a concurrent write"
        );
    }
}

/// A key with a PIN and a PCR signer whose signed policies do not hold
/// (none attached yet, or the PCRs moved on) is refused before anyone is
/// asked for its PIN: the askpass program was run, and a person typed a
/// PIN that could not be used.
#[test]
fn no_pin_is_asked_for_while_no_signed_policy_holds() {
    let dir = common::scratch("tpmcrypt-signed-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    signer(d, "signer");
    let r: Run = tpmcrypt(d)
        .args(["--tpm", &t, "key", "create", "k", "--pin"])
        .args(["--pcr-signer", "signer.pub", "--pcrs", PCRS])
        .env("TPMCRYPT_PIN", "2468")
        .output()
        .expect("spawn")
        .into();
    assert_ok(&r, "key create --pin --pcr-signer");
    fs::write(d.join("f"), b"pinned").unwrap();
    assert_ok(&plain(d, &["encrypt", "--key", "k", "f"]), "encrypt");
    let askpass = d.join("askpass.sh");
    fs::write(&askpass, "#!/bin/sh\necho asked >> \"$0.log\"\necho 2468\n").unwrap();
    common::chmod(&askpass, 0o700);
    // setsid: no controlling terminal, so the askpass program is the source.
    let decrypt = || -> Run {
        let mut cmd = common::wrapper(d, "setsid");
        cmd.arg(common::bin())
            .args(["--tpm", &t, "decrypt", "-o", "-", "f.tpmc"])
            .env("TPMCRYPT_ASKPASS", &askpass)
            .stdin(std::process::Stdio::null());
        cmd.output().expect("spawn").into()
    };
    let asked = || fs::read_to_string(d.join("askpass.sh.log")).unwrap_or_default();
    let r = decrypt();
    common::assert_error_line(&r, TPM, None, &["no signed PCR policy yet"], "none yet");
    assert_eq!(asked(), "", "asked for a PIN that could not be used");

    sign_current(d, &t, "signer", "now.policy");
    assert_ok(&plain(d, &["key", "add-policy", "k", "now.policy"]), "add");
    let r = decrypt();
    assert_ok(&r, "decrypt with the PIN from askpass");
    assert_eq!(r.stdout, b"pinned");
    assert_eq!(asked(), "asked\n", "asked once");

    extend7(&sim, d);
    let r = decrypt();
    common::assert_error_line(&r, TPM, None, &["PCR 7 is"], "PCRs moved on");
    assert_eq!(
        asked(),
        "asked\n",
        "not asked again for a policy that does not hold"
    );
    assert_no_handles(&sim, d, "refusals before the PIN");
}

/// Another user who can read the keystore directory (mode 0755 is
/// trusted: not writable by others) cannot make `key add-policy` wait for
/// ever by holding a lock on it: the lock is on a file only its owner
/// opens.
#[test]
fn another_user_cannot_block_add_policy() {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    const NOBODY: u32 = 65534;
    let dir = common::scratch("tpmcrypt-signed-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    signer(d, "signer");
    let r = tc(
        d,
        &t,
        &[
            "key",
            "create",
            "k",
            "--pcr-signer",
            "signer.pub",
            "--pcrs",
            PCRS,
        ],
    );
    assert_ok(&r, "key create --pcr-signer");
    sign_current(d, &t, "signer", "now.policy");
    drop(sim);
    let home = d.join(".tpmcrypt-home");
    common::chmod(d, 0o755);
    common::chmod(&home, 0o755);
    // nobody opens and locks whatever the keystore holds that it can open.
    let script = "import fcntl, os, sys, time\n\
        home = sys.argv[1]\n\
        held = []\n\
        for p in [home] + [os.path.join(home, n) for n in os.listdir(home)]:\n\
        \x20   try:\n\
        \x20       fd = os.open(p, os.O_RDONLY)\n\
        \x20       fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n\
        \x20       held.append(fd)\n\
        \x20   except OSError:\n\
        \x20       pass\n\
        print(len(held), flush=True)\n\
        time.sleep(60)\n";
    let mut locker = std::process::Command::new("/usr/bin/python3")
        .args(["-c", script])
        .arg(&home)
        .uid(NOBODY)
        .gid(NOBODY)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn python3 as nobody");
    let mut line = String::new();
    std::io::BufReader::new(locker.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(
        line.trim().parse::<u32>().unwrap() >= 1,
        "nobody holds locks: {line}"
    );
    let mut add = tpmcrypt(d)
        .args(["key", "add-policy", "k", "now.policy"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let mut done = None;
    for _ in 0..200 {
        if let Some(s) = add.try_wait().unwrap() {
            done = Some(s);
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = locker.kill();
    let _ = locker.wait();
    if done.is_none() {
        let _ = add.kill();
        let _ = add.wait();
    }
    assert!(
        done.is_some_and(|s| s.success()),
        "key add-policy waited on another user's lock: {done:?}"
    );
    assert_eq!(load_key(d, "k").signed_policies().unwrap().len(), 1);
}

/// A keystore write killed before its rename leaves `.NAME.json.tmpPID`;
/// a later run with the same PID (PIDs repeat: a service in its own PID
/// namespace is PID 1 every time) failed on it for ever with "NAME.json:
/// File exists". Run here as PID 1 of a new PID namespace.
#[test]
fn a_temporary_left_by_a_killed_run_does_not_block_the_keystore() {
    let dir = common::scratch("tpmcrypt-signed-");
    let d = dir.path();
    let sim = swtpm(d, "swtpm");
    let t = sim.tcti();
    signer(d, "signer");
    let r = tc(
        d,
        &t,
        &[
            "key",
            "create",
            "k",
            "--pcr-signer",
            "signer.pub",
            "--pcrs",
            PCRS,
        ],
    );
    assert_ok(&r, "key create --pcr-signer");
    sign_current(d, &t, "signer", "now.policy");
    drop(sim);
    let home = d.join(".tpmcrypt-home");
    for leftover in [".k.json.tmp1", ".k.pub.pem.tmp1", ".k.key.pem.tmp1"] {
        fs::write(home.join(leftover), b"half-written").unwrap();
        common::chmod(&home.join(leftover), 0o600);
    }
    let mut cmd = common::wrapper(d, "unshare");
    cmd.args(["--pid", "--fork"])
        .arg(common::bin())
        .args(["key", "add-policy", "k", "now.policy"]);
    let r: Run = cmd.output().expect("spawn unshare").into();
    assert_ok(&r, "key add-policy as PID 1 beside PID 1's leftovers");
    assert_eq!(load_key(d, "k").signed_policies().unwrap().len(), 1);
    // pcr sign -o and pcr-signer create --out write under temporaries too.
    fs::write(d.join("again.policy.new1"), b"half-written").unwrap();
    fs::write(d.join("s2.key.new1"), b"half-written").unwrap();
    let pid1 = |args: &[&str]| -> Run {
        let mut cmd = common::wrapper(d, "unshare");
        cmd.args(["--pid", "--fork"]).arg(common::bin()).args(args);
        cmd.output().expect("spawn unshare").into()
    };
    let values = format!(
        "sha256:\n  0 : 0x{}\n  7 : 0x{}\n",
        "01".repeat(32),
        "02".repeat(32)
    );
    fs::write(d.join("v.txt"), values).unwrap();
    let sign = [
        "pcr",
        "sign",
        "--signer",
        "signer.key",
        "--pcrs",
        PCRS,
        "--values",
        "v.txt",
        "-o",
        "again.policy",
    ];
    assert_ok(&pid1(&sign), "pcr sign as PID 1");
    assert_ok(
        &pid1(&["pcr-signer", "create", "--out", "s2.key"]),
        "pcr-signer create as PID 1",
    );
}
