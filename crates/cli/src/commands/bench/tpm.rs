//! TPM costs: key creation and one unbind per algorithm, through the same
//! `tpmcrypt-tpmkey` calls the file commands use.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context as _};
use openssl::bn::BigNumContext;
use openssl::derive::Deriver;
use openssl::ec::{EcGroup, EcKey, PointConversionForm};
use openssl::encrypt::Encrypter;
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::PKey;
use openssl::rsa::Padding;
use serde::{Deserialize, Serialize};
use tpmcrypt_tpmkey::{KeyAlg, KeyBlob, Simulator, Tpm};

use super::stats::Summary;

/// Which TPM to measure.
#[derive(Debug, Clone)]
pub enum Source {
    /// Start a private swtpm.
    Simulator,
    /// A TCTI string given with `--tpm` or `TPMCRYPT_TCTI`.
    Tcti(String),
    /// Nothing given: the default device (`/dev/tpmrm0`).
    Default,
}

/// One timed TPM operation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Op {
    /// `create_rsa2048`, `create_ecc_p256`, `unbind_rsa2048`, `unbind_ecc_p256`,
    /// `unbind_ecc_p256_signed` (under a signed PCR policy on sha256:0,7).
    pub name: String,
    /// Timings.
    #[serde(flatten)]
    pub time: Summary,
}

/// The TPM part of the results.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct TpmResult {
    /// Whether a TPM was reached and measured.
    pub available: bool,
    /// Why not, when unavailable (or what failed midway).
    pub reason: Option<String>,
    /// `simulator`, `tcti` or `default`.
    pub source: String,
    /// The TCTI used.
    pub tcti: Option<String>,
    /// TPM_PT_MANUFACTURER, e.g. `IBM` (swtpm), `INTC`, `STM`, `NTC`.
    pub manufacturer: Option<String>,
    /// Vendor strings.
    pub vendor: Option<String>,
    /// Firmware version.
    pub firmware_version: Option<String>,
    /// Software TPM (no hardware protection; timings are not a chip's).
    pub is_simulator: Option<bool>,
    /// Timed operations.
    pub ops: Vec<Op>,
    /// Unbinds this benchmark performed (repeat × 3: RSA, P-256, P-256
    /// under a signed PCR policy).
    pub unbinds_performed: u64,
    /// Unbind commands the `Tpm` handle counted (`Tpm::unbind_count`).
    pub unbind_count: u64,
    /// Software time to prepare each unbind input (RSA-OAEP encryption,
    /// ephemeral ECDH), not included in the unbind times.
    pub software_prepare_ms: Option<f64>,
}

impl TpmResult {
    /// The median of an operation, if measured.
    pub fn median_ms(&self, name: &str) -> Option<f64> {
        self.ops
            .iter()
            .find(|o| o.name == name)
            .map(|o| o.time.median_ms)
    }
}

fn rsa_encrypt(blob: &KeyBlob, msg: &[u8]) -> anyhow::Result<Vec<u8>> {
    let pkey = blob.public_pkey()?;
    let mut enc = Encrypter::new(&pkey)?;
    enc.set_rsa_padding(Padding::PKCS1_OAEP)?;
    enc.set_rsa_oaep_md(MessageDigest::sha256())?;
    enc.set_rsa_mgf1_md(MessageDigest::sha256())?;
    let mut out = vec![0u8; enc.encrypt_len(msg)?];
    let n = enc.encrypt(msg, &mut out)?;
    out.truncate(n);
    Ok(out)
}

/// Ephemeral software ECDH against the key: (uncompressed point, Z).
fn ecdh_software(blob: &KeyBlob) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
    let peer = blob.public_pkey()?;
    let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1)?;
    let eph = EcKey::generate(&group)?;
    let mut ctx = BigNumContext::new()?;
    let point = eph
        .public_key()
        .to_bytes(&group, PointConversionForm::UNCOMPRESSED, &mut ctx)?;
    let eph = PKey::from_ec_key(eph)?;
    let mut d = Deriver::new(&eph)?;
    d.set_peer(&peer)?;
    Ok((point, d.derive_to_vec()?))
}

/// A P-256 key under a signed PCR policy (a signer made here, the
/// current values of sha256:0,7 signed and attached).
fn signed_key(tpm: &mut Tpm) -> anyhow::Result<KeyBlob> {
    let signer = tpmcrypt_tpmkey::signed::PcrSigner::generate()?;
    let mut blob = tpm.create_key_signed(KeyAlg::EccP256, &signer.public()?, None)?;
    let sel = tpmcrypt_tpmkey::PcrSelection::parse("sha256:0,7")?;
    let values = tpm.pcr_values(&sel)?;
    blob.add_signed_policy(&signer.sign(&sel, &values)?)?;
    Ok(blob)
}

/// One timed ECDH unbind with `key` (software preparation timed apart).
fn timed_ecdh(
    tpm: &mut Tpm,
    key: &KeyBlob,
    prepare: &mut Vec<f64>,
    res: &mut TpmResult,
) -> anyhow::Result<f64> {
    let t = Instant::now();
    let (point, z) = ecdh_software(key)?;
    prepare.push(ms(t));
    res.unbinds_performed += 1;
    let t = Instant::now();
    let tz = tpm
        .ecdh_zgen(key, None, &point)
        .context("ECC unbind (TPM2_ECDH_ZGen)")?;
    let took = ms(t);
    if tz[..] != z[..] {
        bail!("the TPM's ECDH returned the wrong shared secret");
    }
    Ok(took)
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Measures `repeat` rounds of: create RSA-2048, create P-256, one unbind
/// with each. Never fails: problems end up in `reason`.
pub fn run(
    source: &Source,
    state_dir: &Path,
    repeat: u32,
    tick: &mut dyn FnMut(&str),
) -> TpmResult {
    let mut res = TpmResult {
        source: match source {
            Source::Simulator => "simulator",
            Source::Tcti(_) => "tcti",
            Source::Default => "default",
        }
        .to_string(),
        ..TpmResult::default()
    };
    // Keep the simulator alive until the handle is closed (field order).
    let mut sim: Option<Simulator> = None;
    let tcti = match source {
        Source::Simulator => match Simulator::start(state_dir) {
            Ok(s) => {
                let t = s.tcti();
                sim = Some(s);
                t
            }
            Err(e) => {
                res.reason = Some(format!("{e}"));
                return res;
            }
        },
        Source::Tcti(t) => t.clone(),
        Source::Default => tpmcrypt_tpmkey::tcti::DEFAULT_TCTI.to_string(),
    };
    res.tcti = Some(tcti.clone());
    let mut tpm = match Tpm::open(&tcti) {
        Ok(t) => t,
        Err(e) => {
            res.reason = Some(format!("{e}"));
            return res;
        }
    };
    if let Err(e) = measure(&mut tpm, repeat, &mut res, tick) {
        res.reason = Some(format!("{e:#}"));
    }
    res.unbind_count = tpm.unbind_count();
    drop(tpm);
    drop(sim);
    res
}

fn measure(
    tpm: &mut Tpm,
    repeat: u32,
    res: &mut TpmResult,
    tick: &mut dyn FnMut(&str),
) -> anyhow::Result<()> {
    let info = tpm.info().context("reading TPM properties")?;
    res.manufacturer = Some(info.manufacturer);
    res.vendor = Some(info.vendor);
    res.firmware_version = Some(info.firmware_version);
    res.is_simulator = Some(info.is_simulator);
    res.available = true;
    let names = [
        "create_rsa2048",
        "create_ecc_p256",
        "unbind_rsa2048",
        "unbind_ecc_p256",
        "unbind_ecc_p256_signed",
    ];
    let mut samples: [Vec<f64>; 5] = Default::default();
    let mut prepare = Vec::new();
    let signed = signed_key(tpm).context("a P-256 key under a signed PCR policy")?;
    for round in 0..repeat {
        let t = Instant::now();
        let rsa = tpm
            .create_key(KeyAlg::Rsa2048, None, None)
            .context("creating an RSA-2048 key")?;
        samples[0].push(ms(t));
        tick("TPM: RSA-2048 key");
        let t = Instant::now();
        let ecc = tpm
            .create_key(KeyAlg::EccP256, None, None)
            .context("creating a P-256 key")?;
        samples[1].push(ms(t));
        tick("TPM: P-256 key");

        let mut secret = [0u8; 32];
        openssl::rand::rand_bytes(&mut secret)?;
        let t = Instant::now();
        let ct = rsa_encrypt(&rsa, &secret)?;
        prepare.push(ms(t));
        res.unbinds_performed += 1;
        let t = Instant::now();
        let pt = tpm
            .rsa_decrypt(&rsa, None, &ct)
            .context("RSA unbind (TPM2_RSA_Decrypt)")?;
        samples[2].push(ms(t));
        if pt[..] != secret[..] {
            bail!("the TPM's RSA decryption returned the wrong secret");
        }
        tick("TPM: RSA unbind");

        // The plain and the signed-policy unbind alternate which goes first.
        let order = if round % 2 == 0 { [3, 4] } else { [4, 3] };
        for which in order {
            let key = if which == 3 { &ecc } else { &signed };
            samples[which].push(timed_ecdh(tpm, key, &mut prepare, res)?);
            tick(if which == 3 {
                "TPM: ECC unbind"
            } else {
                "TPM: ECC unbind, signed policy"
            });
        }
    }
    res.ops = names
        .iter()
        .zip(samples)
        .map(|(n, s)| Op {
            name: n.to_string(),
            time: Summary::of(s),
        })
        .collect();
    res.software_prepare_ms = Some(Summary::of(prepare).median_ms);
    Ok(())
}
