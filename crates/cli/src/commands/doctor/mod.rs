//! `tpmcrypt doctor`: can this machine use tpmcrypt, and if not, why.
//!
//! The checks come from [`tpmcrypt_tpmkey::probe`] and
//! [`tpmcrypt_tpmkey::Tpm::health`]; this module gathers them into one
//! JSON document (stable field names, `docs/doctor.md`), renders it as
//! text, and turns what is missing into exit bits in the manner of
//! `systemd-creds has-tpm2`: each missing capability sets one bit, 0 means
//! all is well. Nothing here spends a dictionary-attack try or changes
//! TPM state.

mod text;

use std::path::Path;

use clap::Args;
use serde_json::{json, Value};
use tpmcrypt_tpmkey::identity::Target;
use tpmcrypt_tpmkey::probe::{self, KeyCheck, PersistentSrk, TpmHealth};
use tpmcrypt_tpmkey::{Keystore, Simulator, Tcti, Tpm};

use crate::ui::{stdout, Ui};

/// `tpmcrypt doctor`.
#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Print the report as JSON on stdout (field names in docs/doctor.md).
    #[arg(long)]
    pub json: bool,
    /// How long to wait for the TPM to answer before reporting it as
    /// unreachable (a TCTI that accepts connections and never answers).
    #[arg(long, default_value = "30s", value_name = "DURATION", value_parser = crate::args::value::duration)]
    pub timeout: std::time::Duration,
}

/// The exit bits. Bits 0 and 1 are left to the usual codes (1 error, 2
/// usage), so any status with one of them set is not a finding.
pub mod bits {
    /// No TPM reachable through the chosen TCTI.
    pub const TPM: i32 = 4;
    /// The TPM lacks an algorithm tpmcrypt needs.
    pub const ALGORITHMS: i32 = 8;
    /// The TPM is in dictionary-attack lockout (keys with a PIN refused).
    pub const LOCKOUT: i32 = 16;
    /// A keystore key cannot be used: unreadable, untrusted, or the TPM
    /// does not load it.
    pub const KEYS: i32 = 32;
    /// A key's PCR policy is not satisfied by the PCRs' current values.
    pub const PCR: i32 = 64;
    /// An agent socket is there but not trusted or not answering.
    pub const AGENT: i32 = 128;
}

/// What is missing: exit bits and one line per problem.
#[derive(Default)]
struct Problems {
    bits: i32,
    list: Vec<Value>,
    /// Worth knowing, but nothing is missing (a simulator, no AES-NI).
    warnings: Vec<String>,
    /// Others left objects or sessions loaded: a key that does not load
    /// may only have found the TPM full.
    leftovers: bool,
}

impl Problems {
    fn add(&mut self, bit: i32, check: &str, reason: String) {
        self.bits |= bit;
        self.list
            .push(json!({"check": check, "bit": bit, "reason": reason}));
    }
}

/// Runs `doctor`.
pub fn run(args: &DoctorArgs, ui: &Ui) -> anyhow::Result<i32> {
    if args.timeout.is_zero() {
        return Err(crate::ui::exit::usage("--timeout must be more than 0"));
    }
    let (tpm_json, keystore_json, mut problems) = tpm_and_keys_within(ui, args.timeout);
    let report = json!({
        "version": 1,
        "tpm": tpm_json,
        "keystore": keystore_json,
        "cpu": cpu(&mut problems),
        "backend": backend(),
        "agent": agent(&mut problems),
        "status": problems.bits,
        "problems": problems.list,
        "warnings": problems.warnings,
    });
    if args.json {
        let mut text = serde_json::to_string_pretty(&report)?;
        text.push('\n');
        stdout::write_all(text.as_bytes())?;
    } else {
        stdout::write_all(text::render(&report).as_bytes())?;
    }
    Ok(problems.bits)
}

/// [`tpm_and_keys`] in a thread of its own, given up after `timeout`: a
/// TCTI that accepts a connection and never answers would block tpm2-tss
/// for ever. Given up, the TPM is reported unreachable and the keystore's
/// keys are read without a TPM; the thread ends with the process.
fn tpm_and_keys_within(ui: &Ui, timeout: std::time::Duration) -> (Value, Value, Problems) {
    let (tx, rx) = std::sync::mpsc::channel();
    let owned = ui.clone();
    std::thread::spawn(move || {
        let mut problems = Problems::default();
        let (tpm, keys) = tpm_and_keys(&owned, &mut problems);
        let _ = tx.send((tpm, keys, problems));
    });
    if let Ok(done) = rx.recv_timeout(timeout) {
        return done;
    }
    let mut problems = Problems::default();
    let mut tpm = json!({"reachable": false});
    if let Ok((target, by)) = crate::tpm::chosen(ui) {
        tpm["chosen_by"] = json!(by);
        if let Target::Tcti(t) = target {
            tpm["tcti"] = json!(t.to_string());
        }
    }
    let reason = format!(
        "TPM unreachable ({}): no answer within {}",
        tpm["tcti"].as_str().unwrap_or("?"),
        humantime::format_duration(timeout)
    );
    tpm["error"] = json!(reason);
    problems.add(bits::TPM, "tpm", reason);
    let keys = keystore(ui, None, &mut problems);
    (tpm, keys, problems)
}

/// The TPM section and the keystore section (whose keys are checked on
/// the TPM, in the same connection).
fn tpm_and_keys(ui: &Ui, problems: &mut Problems) -> (Value, Value) {
    let mut tpm = json!({});
    let chosen = crate::tpm::chosen(ui);
    let (target, by) = match chosen {
        Ok(c) => c,
        Err(e) => {
            let reason = crate::ui::one_line(&e);
            tpm["error"] = json!(reason);
            tpm["reachable"] = json!(false);
            problems.add(bits::TPM, "tpm", reason);
            return (tpm, keystore(ui, None, problems));
        }
    };
    tpm["chosen_by"] = json!(by);
    if let Target::Tcti(Tcti::Device { path }) = &target {
        tpm["device"] = device_json(path, problems);
    }
    tpm["device_nodes"] = json!(probe::device_nodes()
        .iter()
        .map(|p| crate::ui::shown(p))
        .collect::<Vec<_>>());
    tpm["tabrmd_running"] = json!(probe::tabrmd_running());
    let opened = open(&target);
    let (conn, _simulator) = match opened {
        Ok(o) => o,
        Err((tcti, e)) => {
            tpm["tcti"] = json!(tcti);
            let reason = crate::ui::printable(&e.to_string());
            tpm["reachable"] = json!(false);
            tpm["error"] = json!(reason);
            problems.add(bits::TPM, "tpm", reason);
            return (tpm, keystore(ui, None, problems));
        }
    };
    // Declared after the simulator: closed before it stops.
    let mut conn = conn;
    tpm["tcti"] = json!(conn.tcti().to_string());
    // Before doctor loads anything: what others left.
    if let Some(loaded) = leftovers(&mut conn, problems) {
        tpm["loaded"] = loaded;
    }
    match conn.health() {
        Ok(h) => {
            tpm["reachable"] = json!(true);
            health_json(&mut tpm, &h, problems);
        }
        Err(e) => {
            let reason = crate::ui::printable(&e.to_string());
            tpm["reachable"] = json!(false);
            tpm["error"] = json!(reason);
            problems.add(bits::TPM, "tpm", reason);
            return (tpm, keystore(ui, None, problems));
        }
    }
    let keys = keystore(ui, Some(&mut conn), problems);
    (tpm, keys)
}

/// Opens the TPM (starting the private simulator for `--simulator`).
fn open(target: &Target) -> Result<(Tpm, Option<Simulator>), (String, tpmcrypt_tpmkey::Error)> {
    match target {
        Target::Tcti(t) => Tpm::open_tcti(t)
            .map(|tpm| (tpm, None))
            .map_err(|e| (t.to_string(), e)),
        Target::Simulator(dir) => {
            let shown = format!("simulator ({})", crate::ui::shown(dir));
            let sim = Simulator::start(dir).map_err(|e| (shown.clone(), e))?;
            let tpm = Tpm::open(&sim.tcti()).map_err(|e| (shown, e))?;
            Ok((tpm, Some(sim)))
        }
    }
}

/// Handles others left loaded (a process killed mid-command on a TPM
/// without a resource manager), as JSON; a warning when there are any.
fn leftovers(conn: &mut Tpm, problems: &mut Problems) -> Option<Value> {
    let l = conn.loaded_handles().ok()?;
    let hex = |v: &[u32]| v.iter().map(|h| format!("0x{h:08x}")).collect::<Vec<_>>();
    if !l.transient.is_empty() || !l.sessions.is_empty() {
        problems.leftovers = true;
        problems.warnings.push(format!(
            "the TPM holds {} transient objects and {} sessions nobody flushed (a process \
             killed mid-command on a TPM without a resource manager); `tpm2_flushcontext \
             -t -s` frees them",
            l.transient.len(),
            l.sessions.len()
        ));
    }
    Some(json!({"transient": hex(&l.transient), "sessions": hex(&l.sessions)}))
}

/// The device node of a device TCTI, with warnings for a raw device and
/// for something that is no character device.
fn device_json(path: &str, problems: &mut Problems) -> Value {
    let node = probe::device_node(Path::new(path));
    if !node.resource_manager {
        problems.warnings.push(format!(
            "{path} is the raw device, without the kernel's resource manager: one process \
             at a time (use device:/dev/tpmrm0)"
        ));
    }
    if node.meta.as_ref().is_some_and(|m| !m.char_device) {
        problems
            .warnings
            .push(format!("{path} is not a character device: not a TPM"));
    }
    json!({
        "path": crate::ui::shown(&node.path),
        "exists": node.meta.is_some(),
        "mode": node.meta.as_ref().map(|m| format!("{:04o}", m.mode)),
        "uid": node.meta.as_ref().map(|m| m.uid),
        "gid": node.meta.as_ref().map(|m| m.gid),
        "group": node.meta.as_ref().and_then(|m| m.group.clone()),
        "char_device": node.meta.as_ref().map(|m| m.char_device),
        "resource_manager": node.resource_manager,
        "can_open": node.open_error.is_none(),
        "open_error": node.open_error,
    })
}

fn health_json(tpm: &mut Value, h: &TpmHealth, problems: &mut Problems) {
    tpm["manufacturer"] = json!(h.info.manufacturer);
    tpm["vendor"] = json!(h.info.vendor);
    tpm["firmware"] = json!(h.info.firmware_version);
    tpm["family"] = json!(h.family);
    tpm["simulator"] = json!(h.info.is_simulator);
    if h.info.is_simulator {
        problems
            .warnings
            .push("this TPM is a software simulator: keys have no hardware protection".into());
    }
    tpm["pcr_banks"] = json!(h
        .pcr_banks
        .iter()
        .map(|b| json!({"bank": b.bank, "pcrs": b.pcrs}))
        .collect::<Vec<_>>());
    let mut algorithms = Vec::new();
    for a in &h.algorithms {
        if let Some(why) = &a.refused {
            problems.add(
                bits::ALGORITHMS,
                "algorithms",
                format!("the TPM does not support {} ({}): {why}", a.name, a.purpose),
            );
        }
        algorithms.push(json!({
            "name": a.name,
            "purpose": a.purpose,
            "supported": a.refused.is_none(),
            "error": a.refused,
        }));
    }
    tpm["algorithms"] = json!(algorithms);
    let l = &h.lockout;
    tpm["lockout"] = json!({
        "in_lockout": l.in_lockout,
        "counter": l.counter,
        "max_tries": l.max_tries,
        "remaining_tries": l.remaining(),
        "interval_secs": l.interval_secs,
        "recovery_secs": l.recovery_secs,
    });
    if l.in_lockout {
        problems.add(
            bits::LOCKOUT,
            "lockout",
            format!(
                "the TPM is in dictionary-attack lockout: keys with a PIN are refused until a \
                 failure is forgotten (every {} s) or the lockout is cleared",
                l.interval_secs
            ),
        );
    }
    tpm["srk"] = match &h.srk {
        PersistentSrk::Absent => json!({"handle": "0x81000001", "present": false}),
        PersistentSrk::Present { rsa } => json!({
            "handle": "0x81000001", "present": true, "alg": if *rsa { "rsa" } else { "ecc" },
        }),
        PersistentSrk::Unusable(why) => json!({
            "handle": "0x81000001", "present": true, "error": crate::ui::printable(why),
        }),
    };
}

/// The keystore section: each key read (trust checks included) and, with
/// a TPM, checked on it.
fn keystore(ui: &Ui, mut tpm: Option<&mut Tpm>, problems: &mut Problems) -> Value {
    let dir = match &ui.keystore {
        Some(d) => d.clone(),
        None => match Keystore::default_dir() {
            Ok(d) => d,
            Err(e) => return json!({"dir": null, "error": e.to_string(), "keys": []}),
        },
    };
    let shown = crate::ui::shown(&dir);
    // Never created here: doctor changes nothing. Only a missing one is
    // "none yet"; one that cannot be looked at, or no directory, is a problem.
    match std::fs::metadata(&dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return json!({"dir": shown, "exists": false, "keys": []});
        }
        Err(e) => {
            let reason = format!("{shown}: {}", crate::ui::printable(&e.to_string()));
            problems.add(bits::KEYS, "keystore", reason.clone());
            return json!({"dir": shown, "exists": null, "error": reason, "keys": []});
        }
        Ok(m) if !m.is_dir() => {
            let reason = format!("{shown}: not a directory");
            problems.add(bits::KEYS, "keystore", reason.clone());
            return json!({"dir": shown, "exists": true, "error": reason, "keys": []});
        }
        Ok(_) => {}
    }
    let store = match Keystore::open(&dir).and_then(|s| s.check_trusted().map(|()| s)) {
        Ok(s) => s,
        Err(e) => {
            let reason = crate::ui::printable(&e.to_string());
            problems.add(bits::KEYS, "keystore", reason.clone());
            return json!({"dir": shown, "exists": true, "trusted": false, "error": reason, "keys": []});
        }
    };
    let names = match store.list() {
        Ok(n) => n,
        Err(e) => {
            let reason = crate::ui::printable(&e.to_string());
            problems.add(bits::KEYS, "keystore", reason.clone());
            return json!({"dir": shown, "exists": true, "trusted": true, "error": reason, "keys": []});
        }
    };
    let keys: Vec<Value> = names
        .iter()
        .map(|name| key_json(&store, name, tpm.as_deref_mut(), problems))
        .collect();
    json!({"dir": shown, "exists": true, "trusted": true, "keys": keys})
}

fn key_json(store: &Keystore, name: &str, tpm: Option<&mut Tpm>, problems: &mut Problems) -> Value {
    let mut key = json!({"name": name});
    let (blob, meta) = match store.load(name) {
        Ok(k) => k,
        Err(e) => {
            let reason = crate::ui::printable(&e.to_string());
            problems.add(bits::KEYS, "keys", format!("key {name}: {reason}"));
            key["error"] = json!(reason);
            return key;
        }
    };
    key["alg"] = json!(meta.alg);
    key["pin"] = json!(!blob.empty_auth);
    let pcrs = blob.pcr_policy().ok().flatten().map(|(s, _)| s.to_string());
    // A key bound to a PCR signer records no PCR digest: its PCRs are
    // those of its signed policies (`key create --pcrs`).
    key["pcrs"] = json!(pcrs.or(meta.pcrs.clone()));
    let Some(tpm) = tpm else {
        return key;
    };
    match tpm.check_key(&blob) {
        Ok(check) => key_check_json(&mut key, name, &check, problems),
        Err(e) => {
            let reason = crate::ui::printable(&e.to_string());
            problems.add(bits::KEYS, "keys", format!("key {name}: {reason}"));
            key["error"] = json!(reason);
        }
    }
    key
}

fn key_check_json(key: &mut Value, name: &str, check: &KeyCheck, problems: &mut Problems) {
    key["loads"] = json!(check.load_error.is_none());
    key["load_error"] = json!(check.load_error.as_deref().map(crate::ui::printable));
    if let Some(why) = &check.load_error {
        let full = if problems.leftovers {
            " (the TPM holds objects nobody flushed: free them with `tpm2_flushcontext -t -s` \
             and check again)"
        } else {
            ""
        };
        problems.add(
            bits::KEYS,
            "keys",
            format!(
                "key {name} does not load on this TPM: {}{full}",
                crate::ui::printable(why)
            ),
        );
    }
    if let Some(pcr) = &check.pcr {
        match &pcr.satisfied {
            Ok(ok) => {
                key["pcr_policy_satisfied"] = json!(ok);
                if let (false, Some(why)) = (ok, &pcr.signed_refusal) {
                    key["signed_policy_error"] = json!(crate::ui::printable(why));
                    problems.add(
                        bits::PCR,
                        "pcr",
                        format!(
                            "key {name}: {} (decrypt would refuse it: sign the current or \
                             expected PCR values with `tpmcrypt pcr sign` and attach them with \
                             `tpmcrypt key add-policy`)",
                            crate::ui::printable(why)
                        ),
                    );
                } else if !ok {
                    problems.add(
                        bits::PCR,
                        "pcr",
                        format!(
                            "key {name}: PCRs {} changed since it was created; the TPM would \
                             refuse it (decrypt with a recovery key and create a new key)",
                            pcr.selection
                        ),
                    );
                }
            }
            Err(why) => {
                key["pcr_policy_satisfied"] = Value::Null;
                key["pcr_error"] = json!(crate::ui::printable(why));
                problems.add(
                    bits::PCR,
                    "pcr",
                    format!("key {name}: cannot read PCRs {}: {why}", pcr.selection),
                );
            }
        }
    }
}

/// AES-NI, VAES and PCLMULQDQ (null off x86-64).
fn cpu(problems: &mut Problems) -> Value {
    #[cfg(target_arch = "x86_64")]
    {
        if !std::arch::is_x86_feature_detected!("aes") {
            problems
                .warnings
                .push("no AES-NI: bulk AES runs in software, several times slower".into());
        }
        json!({
            "arch": std::env::consts::ARCH,
            "aes_ni": std::arch::is_x86_feature_detected!("aes"),
            "vaes": std::arch::is_x86_feature_detected!("vaes"),
            "pclmulqdq": std::arch::is_x86_feature_detected!("pclmulqdq"),
            // What makes aws-lc the AES-GCM default (docs/format.md).
            "avx512_aes_gcm": tpmcrypt_cipher::backend::aws_lc_gcm_is_wide(),
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = problems;
        json!({
            "arch": std::env::consts::ARCH,
            "aes_ni": null,
            "vaes": null,
            "pclmulqdq": null,
            "avx512_aes_gcm": null,
        })
    }
}

/// The backends compiled in and the default one for each mode.
fn backend() -> Value {
    use tpmcrypt_cipher::{Mode, Params};
    let default = |mode, bits| {
        Params::new(mode, bits)
            .ok()
            .map(|p| p.default_backend().name())
    };
    json!({
        "compiled": tpmcrypt_cipher::backend::all().iter().map(|b| b.name()).collect::<Vec<_>>(),
        "default_gcm": default(Mode::Gcm, 256),
        "default_gcm_192": default(Mode::Gcm, 192),
        "default_cbc": default(Mode::Cbc, 256),
    })
}

/// The agent at the default socket: running, trusted, secrets held.
fn agent(problems: &mut Problems) -> Value {
    use tpmcrypt_tpmkey::agent::{self, AgentClient};
    let path = agent::socket_path();
    let shown = crate::ui::shown(&path);
    match AgentClient::connect(&path) {
        Ok(None) => json!({"socket": shown, "running": false}),
        Ok(Some(client)) => match client.held() {
            Ok(held) => json!({
                "socket": shown,
                "running": true,
                "trusted": true,
                "secrets_held": held.secrets,
                "sessions_held": held.sessions,
            }),
            Err(e) => agent_problem(problems, shown, &e.to_string()),
        },
        Err(e) => agent_problem(problems, shown, &e.to_string()),
    }
}

fn agent_problem(problems: &mut Problems, socket: String, why: &str) -> Value {
    let reason = crate::ui::printable(why);
    problems.add(bits::AGENT, "agent", format!("agent at {socket}: {reason}"));
    json!({"socket": socket, "running": null, "trusted": false, "error": reason})
}
