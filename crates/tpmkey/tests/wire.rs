//! What crosses the "bus": with swtpm's command log we check that neither
//! the unwrapped secret nor the PIN ever travels in clear (salted sessions
//! with AES-CFB parameter encryption), while the public key does (positive
//! control proving the log captures the traffic); and, parsing the logged
//! commands, that every unbind (TPM2_RSA_Decrypt, TPM2_ECDH_ZGen) runs in a
//! session with TPMA_SESSION encrypt and decrypt set and gets an encrypted
//! response parameter back.

mod common;

use common::*;
use tpmcrypt_tpmkey::{KeyAlg, PcrSelection, Simulator, SimulatorOptions, Tpm};

/// A simulator in a fresh directory, logging every command and response
/// to `swtpm.log` there.
fn logged_simulator() -> (tempfile::TempDir, Simulator) {
    let dir = tempfile::tempdir().unwrap();
    let sim = Simulator::start_with(
        &dir.path().join("state"),
        &SimulatorOptions {
            log_file: Some(dir.path().join("swtpm.log")),
            ..Default::default()
        },
    )
    .unwrap();
    (dir, sim)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02X}")).collect()
}

/// All bytes logged by swtpm, as one upper-case hex string.
fn wire_hex(log: &std::path::Path) -> String {
    let text = std::fs::read_to_string(log).unwrap();
    text.lines()
        .filter(|l| !l.contains(':'))
        .flat_map(|l| l.split_whitespace())
        .filter(|t| t.len() == 2 && t.chars().all(|c| c.is_ascii_hexdigit()))
        .collect()
}

#[test]
fn secrets_and_pins_never_cross_the_wire_in_clear() {
    let (dir, sim) = logged_simulator();
    let log = dir.path().join("swtpm.log");
    let pin = b"pin-4f9a1c77e2";
    let sel = PcrSelection::parse("sha256:7").unwrap();
    let mut tpm = Tpm::open(&sim.tcti()).unwrap();
    let rsa = tpm.create_key(KeyAlg::Rsa2048, None, Some(pin)).unwrap();
    let ecc = tpm
        .create_key(KeyAlg::EccP256, Some(&sel), Some(pin))
        .unwrap();
    let secret = random32();
    let pt = tpm
        .rsa_decrypt(&rsa, Some(pin), &rsa_encrypt(&rsa, &secret))
        .unwrap();
    assert_eq!(&pt[..], &secret[..]);
    let (point, z) = ecdh_software(&ecc);
    let tz = tpm.ecdh_zgen(&ecc, Some(pin), &point).unwrap();
    assert_eq!(&tz[..], &z[..]);
    drop(tpm);
    drop(sim); // flushes the log

    let wire = wire_hex(&log);
    assert!(wire.len() > 10_000, "log too small: {}", wire.len());
    // positive control: the public key is visible on the wire
    let n = &rsa.public[rsa.public.len() - 64..];
    assert!(wire.contains(&hex(n)), "public key not in log?");
    assert!(
        !wire.contains(&hex(&secret)),
        "RSA-unwrapped secret visible on the wire"
    );
    assert!(!wire.contains(&hex(&z[..16])), "ECDH Z visible on the wire");
    assert!(!wire.contains(&hex(pin)), "PIN visible on the wire");
}

// ------------------------------------------------------------ command parsing

const TPM_ST_SESSIONS: u16 = 0x8002;
const TPM_CC_RSA_DECRYPT: u32 = 0x0000_0159;
const TPM_CC_ECDH_ZGEN: u32 = 0x0000_0154;
/// TPMA_SESSION bits.
const SESSION_DECRYPT: u8 = 0x20;
const SESSION_ENCRYPT: u8 = 0x40;
const TPM_RC_RETRY: u32 = 0x0000_0922;

/// One TPM command and the response swtpm sent back, as logged.
#[derive(Clone, Debug)]
struct Exchange {
    cmd: Vec<u8>,
    rsp: Vec<u8>,
}

/// The TPM commands and responses in swtpm's log (level 20): a line
/// `SWTPM_IO_Read: length N` (a command) or `SWTPM_IO_Write: length N` (its
/// response) followed by the N bytes in hex, 16 per line. Any other line
/// with a colon (control channel, messages) ends a message. Every message
/// must have exactly its announced length, and commands and responses
/// must alternate, or the test fails: a misread log cannot pass.
fn exchanges(log: &std::path::Path) -> Vec<Exchange> {
    let text = std::fs::read_to_string(log).unwrap();
    // (is_command, announced length, bytes)
    let mut msgs: Vec<(bool, usize, Vec<u8>)> = Vec::new();
    let mut open = false;
    for line in text.lines() {
        let t = line.trim();
        let header = t
            .strip_prefix("SWTPM_IO_Read: length ")
            .map(|n| (true, n))
            .or_else(|| {
                t.strip_prefix("SWTPM_IO_Write: length ")
                    .map(|n| (false, n))
            });
        if let Some((is_cmd, n)) = header {
            let n: usize = n
                .trim()
                .parse()
                .unwrap_or_else(|_| panic!("bad line {t:?}"));
            msgs.push((is_cmd, n, Vec::new()));
            open = true;
        } else if t.contains(':') || t.is_empty() {
            open = false;
        } else if open {
            let last = msgs.last_mut().expect("open message");
            for tok in t.split_whitespace() {
                let b = u8::from_str_radix(tok, 16)
                    .unwrap_or_else(|_| panic!("not a hex byte {tok:?} in {t:?}"));
                last.2.push(b);
            }
        }
    }
    for (is_cmd, n, bytes) in &msgs {
        assert_eq!(bytes.len(), *n, "logged length (command: {is_cmd})");
    }
    let mut out = Vec::new();
    let mut it = msgs.into_iter();
    while let Some((is_cmd, _, cmd)) = it.next() {
        assert!(is_cmd, "a response without a command in the log");
        let (is_cmd, _, rsp) = it.next().expect("a command without a response");
        assert!(!is_cmd, "two commands in a row in the log");
        out.push(Exchange { cmd, rsp });
    }
    out
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The command code of a command.
fn command_code(cmd: &[u8]) -> u32 {
    be32(cmd, 6)
}

/// The (handle, TPMA_SESSION) of each session in the authorization area of
/// a command with `handles` handles (TPM 2.0 Part 1, 18.6): tag, size,
/// code, handles, authorizationSize, then per session its handle, nonce
/// (TPM2B), attributes (one byte) and hmac (TPM2B).
fn sessions(cmd: &[u8], handles: usize) -> Result<Vec<(u32, u8)>, String> {
    if cmd.len() < 10 || be16(cmd, 0) != TPM_ST_SESSIONS {
        return Err("not a command with sessions (tag is not TPM_ST_SESSIONS)".into());
    }
    if be32(cmd, 2) as usize != cmd.len() {
        return Err("commandSize differs from the logged length".into());
    }
    let mut at = 10 + 4 * handles;
    let size = be32(cmd, at) as usize;
    at += 4;
    let end = at + size;
    if end > cmd.len() {
        return Err("authorization area runs past the command".into());
    }
    let mut out = Vec::new();
    while at < end {
        let handle = be32(cmd, at);
        at += 4;
        at += 2 + be16(cmd, at) as usize; // nonceCaller
        let attrs = cmd[at];
        at += 1;
        at += 2 + be16(cmd, at) as usize; // hmac
        out.push((handle, attrs));
    }
    if at != end {
        return Err("authorization area does not parse".into());
    }
    Ok(out)
}

/// The first response parameter of a successful response with sessions:
/// tag, size, responseCode 0, parameterSize, then the parameters. Returns
/// the contents of the first parameter (a TPM2B: its size stays in clear,
/// its contents are what parameter encryption covers).
fn first_response_parameter(rsp: &[u8]) -> Result<&[u8], String> {
    if rsp.len() < 16 || be16(rsp, 0) != TPM_ST_SESSIONS || be32(rsp, 6) != 0 {
        return Err(format!(
            "not a successful response with sessions: {:02x?}",
            &rsp[..rsp.len().min(16)]
        ));
    }
    let params = be32(rsp, 10) as usize;
    let size = be16(rsp, 14) as usize;
    if 2 + size > params || 14 + params > rsp.len() {
        return Err("response parameters do not parse".into());
    }
    Ok(&rsp[16..16 + size])
}

/// Checks one RSA_Decrypt or ECDH_ZGen exchange: a session of the command
/// asks for response parameter encryption (TPMA_SESSION encrypt) — and for
/// command parameter encryption (decrypt), which tpmcrypt also sets — and
/// the returned secret is not in the response in clear.
///
/// `secret` is the RSA plaintext, or the ECDH x coordinate (Z).
fn check_unbind(ex: &Exchange, secret: &[u8]) -> Result<(), String> {
    let cc = command_code(&ex.cmd);
    if cc != TPM_CC_RSA_DECRYPT && cc != TPM_CC_ECDH_ZGEN {
        return Err(format!("command 0x{cc:08x} is not an unbind"));
    }
    // Both commands have one handle (keyHandle).
    let sessions = sessions(&ex.cmd, 1)?;
    let want = SESSION_ENCRYPT | SESSION_DECRYPT;
    if !sessions.iter().any(|&(_, a)| a & want == want) {
        return Err(format!(
            "no session sets encrypt|decrypt (0x{want:02x}) on 0x{cc:08x}: {sessions:x?}"
        ));
    }
    let param = first_response_parameter(&ex.rsp)?;
    if cc == TPM_CC_RSA_DECRYPT {
        // TPM2B_PUBLIC_KEY_RSA message: exactly the plaintext's length.
        if param.len() != secret.len() {
            return Err(format!("message of {} bytes", param.len()));
        }
        if param == secret {
            return Err("RSA_Decrypt returned the plaintext in clear".into());
        }
    } else {
        // TPM2B_ECC_POINT: x (TPM2B) and y (TPM2B), 2 + 32 + 2 + 32 bytes.
        if param.len() != 68 {
            return Err(format!("outPoint of {} bytes", param.len()));
        }
        if &param[2..34] == secret || param.windows(secret.len()).any(|w| w == secret) {
            return Err("ECDH_ZGen returned Z in clear".into());
        }
    }
    Ok(())
}

/// Every TPM2_RSA_Decrypt and TPM2_ECDH_ZGen in swtpm's log is sent in a
/// session with TPMA_SESSION encrypt and decrypt set, and its response
/// parameter (the unwrapped secret, the shared point) is not the known
/// value: for HMAC sessions (keys without a PCR policy, with and without a
/// PIN) and policy sessions (PCR-bound keys). The checker is shown to
/// reject an exchange with the encrypt bit cleared and one whose response
/// carries the secret in clear.
#[test]
fn unbind_responses_are_parameter_encrypted() {
    let (dir, sim) = logged_simulator();
    let log = dir.path().join("swtpm.log");
    let pin = b"pin-77";
    let sel = PcrSelection::parse("sha256:7").unwrap();
    let mut tpm = Tpm::open(&sim.tcti()).unwrap();
    // (command code, the secret it returns), in the order they are sent.
    let mut expected: Vec<(u32, Vec<u8>)> = Vec::new();
    for (pcrs, pin) in [(None, Some(&pin[..])), (Some(&sel), None)] {
        let rsa = tpm.create_key(KeyAlg::Rsa2048, pcrs, pin).unwrap();
        let secret = random32();
        let pt = tpm
            .rsa_decrypt(&rsa, pin, &rsa_encrypt(&rsa, &secret))
            .unwrap();
        assert_eq!(&pt[..], &secret[..]);
        expected.push((TPM_CC_RSA_DECRYPT, secret.to_vec()));
    }
    for (pcrs, pin) in [(None, None), (Some(&sel), Some(&pin[..]))] {
        let ecc = tpm.create_key(KeyAlg::EccP256, pcrs, pin).unwrap();
        let (point, z) = ecdh_software(&ecc);
        let tz = tpm.ecdh_zgen(&ecc, pin, &point).unwrap();
        assert_eq!(&tz[..], &z[..]);
        expected.push((TPM_CC_ECDH_ZGEN, z));
    }
    drop(tpm);
    drop(sim); // flushes the log

    let all = exchanges(&log);
    assert!(all.len() > 20, "only {} commands logged", all.len());
    let unbinds: Vec<&Exchange> = all
        .iter()
        .filter(|e| [TPM_CC_RSA_DECRYPT, TPM_CC_ECDH_ZGEN].contains(&command_code(&e.cmd)))
        .collect();
    // Every unbind command asks for parameter encryption, including those
    // the TPM answered with an error (swtpm sometimes says TPM_RC_RETRY,
    // and ESYS resends).
    let want = SESSION_ENCRYPT | SESSION_DECRYPT;
    for ex in &unbinds {
        let s = sessions(&ex.cmd, 1).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            s.iter().any(|&(_, a)| a & want == want),
            "0x{:08x} without encrypt|decrypt: {s:x?}",
            command_code(&ex.cmd)
        );
    }
    let answered: Vec<&Exchange> = unbinds
        .iter()
        .copied()
        .filter(|e| be32(&e.rsp, 6) == 0)
        .collect();
    let refused: Vec<u32> = unbinds
        .iter()
        .map(|e| be32(&e.rsp, 6))
        .filter(|&rc| rc != 0)
        .collect();
    assert!(
        refused.iter().all(|&rc| rc == TPM_RC_RETRY),
        "unexpected response codes {refused:x?}"
    );
    let codes: Vec<u32> = answered.iter().map(|e| command_code(&e.cmd)).collect();
    let want_codes: Vec<u32> = expected.iter().map(|(c, _)| *c).collect();
    assert_eq!(codes, want_codes, "successful unbind commands in the log");
    for (ex, (cc, secret)) in answered.iter().zip(&expected) {
        check_unbind(ex, secret).unwrap_or_else(|e| panic!("0x{cc:08x}: {e}"));
        let s = sessions(&ex.cmd, 1).unwrap();
        println!(
            "0x{cc:08x}: session {:x?} (handle, TPMA_SESSION), response parameter of {} \
             bytes is not the secret",
            s,
            first_response_parameter(&ex.rsp).unwrap().len()
        );
    }
    println!(
        "{} unbind commands checked (of which {} were answered TPM_RC_RETRY, then resent)",
        unbinds.len(),
        refused.len()
    );

    // The checker can fail: the encrypt bit cleared in the command, or
    // the secret put into the response in clear.
    let (ex, (_, secret)) = (answered[0], &expected[0]);
    let mut no_encrypt = ex.clone();
    let at = 10 + 4 + 4 + 4; // tag size code handle authSize sessionHandle
    let nonce = be16(&no_encrypt.cmd, at) as usize;
    no_encrypt.cmd[at + 2 + nonce] &= !SESSION_ENCRYPT;
    assert!(
        check_unbind(&no_encrypt, secret).is_err(),
        "encrypt cleared"
    );
    let mut in_clear = ex.clone();
    in_clear.rsp[16..16 + secret.len()].copy_from_slice(secret);
    assert!(
        check_unbind(&in_clear, secret).is_err(),
        "plaintext response"
    );
    let (ex, (_, z)) = (answered[2], &expected[2]);
    let mut in_clear = ex.clone();
    in_clear.rsp[18..18 + z.len()].copy_from_slice(z);
    assert!(check_unbind(&in_clear, z).is_err(), "Z in clear");
}
