//! `tpmcrypt doctor` as text: the JSON report, read back into lines a
//! person scans (one subject per line, problems last).

use serde_json::Value;

/// The report as text.
pub fn render(r: &Value) -> String {
    let mut out = String::new();
    tpm(&mut out, &r["tpm"]);
    keystore(&mut out, &r["keystore"]);
    cpu(&mut out, &r["cpu"], &r["backend"]);
    agent(&mut out, &r["agent"]);
    verdict(&mut out, r);
    // Strings from the environment, the TPM and file names: never a
    // control character to the terminal.
    out.lines()
        .map(|l| crate::ui::printable(l) + "\n")
        .collect()
}

fn s(v: &Value) -> &str {
    v.as_str().unwrap_or("?")
}

fn line(out: &mut String, label: &str, text: &str) {
    out.push_str(&format!("{label:<12} {text}\n"));
}

fn yes(v: &Value) -> &'static str {
    match v.as_bool() {
        Some(true) => "yes",
        Some(false) => "no",
        None => "unknown",
    }
}

fn tpm(out: &mut String, t: &Value) {
    let tcti = t["tcti"].as_str().unwrap_or("(none)");
    let by = t["chosen_by"].as_str().unwrap_or("?");
    line(out, "TPM", &format!("{tcti} (from {by})"));
    device(out, t);
    if t["reachable"].as_bool() != Some(true) {
        line(out, "  reachable", &format!("no: {}", s(&t["error"])));
        return;
    }
    chip(out, t);
}

/// What the TPM said of itself.
fn chip(out: &mut String, t: &Value) {
    let sim = if t["simulator"].as_bool() == Some(true) {
        " — a SIMULATOR: no hardware protection"
    } else {
        ""
    };
    line(
        out,
        "  chip",
        &format!(
            "{} ({}), firmware {}, TPM {}{sim}",
            s(&t["manufacturer"]),
            s(&t["vendor"]),
            s(&t["firmware"]),
            s(&t["family"])
        ),
    );
    let banks: Vec<String> = t["pcr_banks"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|b| {
                    format!(
                        "{} ({} PCRs)",
                        s(&b["bank"]),
                        b["pcrs"].as_array().map_or(0, |p| p.len())
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    line(out, "  PCR banks", &banks.join(", "));
    if let Some(l) = t.get("loaded").filter(|l| l.is_object()) {
        line(
            out,
            "  loaded",
            &format!(
                "{} transient objects, {} sessions left in the TPM",
                l["transient"].as_array().map_or(0, Vec::len),
                l["sessions"].as_array().map_or(0, Vec::len)
            ),
        );
    }
    let algs: Vec<String> = t["algorithms"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|x| {
                    let ok = if x["supported"].as_bool() == Some(true) {
                        "ok"
                    } else {
                        "MISSING"
                    };
                    format!("{} {ok}", s(&x["name"]))
                })
                .collect()
        })
        .unwrap_or_default();
    line(out, "  algorithms", &algs.join(", "));
    let l = &t["lockout"];
    let state = if l["in_lockout"].as_bool() == Some(true) {
        "IN LOCKOUT"
    } else {
        "not in lockout"
    };
    line(
        out,
        "  lockout",
        &format!(
            "{state}; {} failures counted, {} of {} tries left; one forgotten every {} s",
            l["counter"], l["remaining_tries"], l["max_tries"], l["interval_secs"]
        ),
    );
    let srk = &t["srk"];
    let srk_text = match (srk["present"].as_bool(), srk["alg"].as_str()) {
        (Some(true), Some(alg)) => format!("persistent at 0x81000001 ({alg})"),
        (Some(true), None) => format!("0x81000001 unusable: {}", s(&srk["error"])),
        _ => "none at 0x81000001 (keys use the owner primary of the standard template)".into(),
    };
    line(out, "  SRK", &srk_text);
}

/// The device node and the other TPM nodes.
fn device(out: &mut String, t: &Value) {
    if let Some(d) = t.get("device").filter(|d| d.is_object()) {
        let access = match d["open_error"].as_str() {
            None => "you can open it".to_string(),
            Some(e) => format!("you cannot open it: {e}"),
        };
        let kind = if d["resource_manager"].as_bool() == Some(true) {
            "resource manager"
        } else {
            "raw device, no resource manager"
        };
        let perms = match d["mode"].as_str() {
            Some(mode) => format!(
                "mode {mode}, uid {}, group {}",
                d["uid"],
                d["group"]
                    .as_str()
                    .map_or(d["gid"].to_string(), String::from)
            ),
            None => "does not exist".into(),
        };
        line(
            out,
            "  device",
            &format!("{}: {perms}; {kind}; {access}", s(&d["path"])),
        );
    }
    if let Some(nodes) = t["device_nodes"].as_array() {
        let names: Vec<&str> = nodes.iter().map(s).collect();
        let names = if names.is_empty() {
            "none".to_string()
        } else {
            names.join(", ")
        };
        let abrmd = if t["tabrmd_running"].as_bool() == Some(true) {
            "tpm2-abrmd running"
        } else {
            "tpm2-abrmd not running"
        };
        line(out, "  nodes", &format!("{names}; {abrmd}"));
    }
}

fn keystore(out: &mut String, k: &Value) {
    let dir = k["dir"].as_str().unwrap_or("(unknown)");
    if k["exists"].as_bool() == Some(false) {
        line(out, "keystore", &format!("{dir}: none yet"));
        return;
    }
    if let Some(e) = k["error"].as_str() {
        line(out, "keystore", &format!("{dir}: {e}"));
        return;
    }
    let keys = k["keys"].as_array().cloned().unwrap_or_default();
    line(out, "keystore", &format!("{dir} ({} keys)", keys.len()));
    for key in &keys {
        let name = format!("  {}", s(&key["name"]));
        if let Some(e) = key["error"].as_str() {
            line(out, &name, &format!("ERROR: {e}"));
            continue;
        }
        let mut parts = vec![s(&key["alg"]).to_string()];
        match key["loads"].as_bool() {
            Some(true) => parts.push("loads".into()),
            Some(false) => parts.push(format!("DOES NOT LOAD: {}", s(&key["load_error"]))),
            None => parts.push("not checked (no TPM)".into()),
        }
        if let Some(pcrs) = key["pcrs"].as_str() {
            let state = match key["pcr_policy_satisfied"].as_bool() {
                Some(true) => "satisfied".to_string(),
                Some(false) if key["signed_policy_error"].is_string() => {
                    "NOT SATISFIED (no signed policy holds)".to_string()
                }
                Some(false) => "NOT SATISFIED (PCRs changed)".to_string(),
                None => key["pcr_error"]
                    .as_str()
                    .unwrap_or("not checked")
                    .to_string(),
            };
            parts.push(format!("PCRs {pcrs} {state}"));
        }
        if key["pin"].as_bool() == Some(true) {
            parts.push("PIN needed".into());
        }
        line(out, &name, &parts.join("; "));
    }
}

fn cpu(out: &mut String, c: &Value, b: &Value) {
    line(
        out,
        "CPU",
        &format!(
            "{}: AES-NI {}, VAES {}, PCLMULQDQ {}, AVX-512 AES-GCM {}",
            s(&c["arch"]),
            yes(&c["aes_ni"]),
            yes(&c["vaes"]),
            yes(&c["pclmulqdq"]),
            yes(&c["avx512_aes_gcm"])
        ),
    );
    line(
        out,
        "backend",
        &match b["default_gcm_192"] == b["default_gcm"] {
            true => format!(
                "default {} (AES-GCM), {} (AES-CBC)",
                s(&b["default_gcm"]),
                s(&b["default_cbc"])
            ),
            false => format!(
                "default {} (AES-GCM-128/256), {} (AES-GCM-192), {} (AES-CBC)",
                s(&b["default_gcm"]),
                s(&b["default_gcm_192"]),
                s(&b["default_cbc"])
            ),
        },
    );
}

fn agent(out: &mut String, a: &Value) {
    let text = match (a["running"].as_bool(), a["error"].as_str()) {
        (_, Some(e)) => format!("{}: NOT USED: {e}", s(&a["socket"])),
        (Some(true), _) => match a["sessions_held"].as_u64() {
            Some(sessions) => format!(
                "running at {}, {} secrets and {sessions} encryption sessions held",
                s(&a["socket"]),
                a["secrets_held"]
            ),
            None => format!(
                "running at {}, {} secrets held",
                s(&a["socket"]),
                a["secrets_held"]
            ),
        },
        _ => format!("not running ({})", s(&a["socket"])),
    };
    line(out, "agent", &text);
}

fn verdict(out: &mut String, r: &Value) {
    for w in r["warnings"].as_array().into_iter().flatten() {
        out.push_str(&format!("warning: {}\n", s(w)));
    }
    let problems = r["problems"].as_array().cloned().unwrap_or_default();
    if problems.is_empty() {
        out.push_str("result: ready (exit 0)\n");
        return;
    }
    for p in &problems {
        out.push_str(&format!("problem [{}]: {}\n", p["bit"], s(&p["reason"])));
    }
    out.push_str(&format!(
        "result: {} problem(s) (exit {})\n",
        problems.len(),
        r["status"]
    ));
}
