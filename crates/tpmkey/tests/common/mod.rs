//! Shared helpers for the integration tests: every test starts its own
//! swtpm (own state dir, own ports).  A missing swtpm makes tests fail.
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

use openssl::bn::BigNumContext;
use openssl::derive::Deriver;
use openssl::ec::{EcGroup, EcKey, PointConversionForm};
use openssl::encrypt::Encrypter;
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::PKey;
use openssl::rsa::Padding;
use tempfile::TempDir;
use tpmcrypt_tpmkey::{KeyBlob, Simulator, Tpm};

/// A running simulator plus its temp dir (dropped after the simulator).
pub struct Sim {
    pub sim: Simulator,
    pub dir: TempDir,
}

impl Sim {
    pub fn tcti(&self) -> String {
        self.sim.tcti()
    }

    pub fn open(&self) -> Tpm {
        Tpm::open(&self.sim.tcti()).expect("open swtpm")
    }

    /// Runs a tpm2-tools command against this simulator (no Tpm handle may
    /// be open: swtpm serves one connection at a time).
    pub fn tool(&self, args: &[&str]) -> std::process::Output {
        let out = Command::new(args[0])
            .args(&args[1..])
            .env("TPM2TOOLS_TCTI", self.tcti())
            .current_dir(self.dir.path())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {} (install tpm2-tools): {e}", args[0]));
        out
    }

    /// Like [`Sim::tool`] but asserts success.
    pub fn tool_ok(&self, args: &[&str]) -> String {
        let out = self.tool(args);
        assert!(
            out.status.success(),
            "{:?} failed: {}\n{}",
            args,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Creates the standard ECC storage root key with tpm2-tools
    /// (`tpm2_createprimary`, as tpm2-tools and tpm2-openssl do) and saves
    /// its context to `ctx` in the simulator's directory.
    pub fn tools_srk(&self, ctx: &str) {
        self.tool_ok(&[
            "tpm2_createprimary",
            "-C",
            "o",
            "-g",
            "sha256",
            "-G",
            "ecc",
            "-a",
            "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|noda|restricted|decrypt",
            "-c",
            ctx,
        ]);
    }

    pub fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }
}

pub fn start() -> Sim {
    let dir = tempfile::tempdir().expect("tempdir");
    let sim = Simulator::start(&dir.path().join("state")).expect("start swtpm");
    Sim { sim, dir }
}

pub fn start_in(state: &Path) -> Simulator {
    Simulator::start(state).expect("start swtpm")
}

pub fn random32() -> [u8; 32] {
    let mut b = [0u8; 32];
    openssl::rand::rand_bytes(&mut b).unwrap();
    b
}

/// Software RSA-OAEP-SHA256 encryption to the key's public half.
pub fn rsa_encrypt(blob: &KeyBlob, msg: &[u8]) -> Vec<u8> {
    let der = blob.public_key_der().unwrap();
    let pkey = PKey::public_key_from_der(&der).unwrap();
    let mut enc = Encrypter::new(&pkey).unwrap();
    enc.set_rsa_padding(Padding::PKCS1_OAEP).unwrap();
    enc.set_rsa_oaep_md(MessageDigest::sha256()).unwrap();
    enc.set_rsa_mgf1_md(MessageDigest::sha256()).unwrap();
    let mut out = vec![0u8; enc.encrypt_len(msg).unwrap()];
    let n = enc.encrypt(msg, &mut out).unwrap();
    out.truncate(n);
    out
}

/// Software ephemeral ECDH against the key's public half: returns
/// (ephemeral public point, uncompressed; shared secret Z).
pub fn ecdh_software(blob: &KeyBlob) -> (Vec<u8>, Vec<u8>) {
    let der = blob.public_key_der().unwrap();
    let peer = PKey::public_key_from_der(&der).unwrap();
    let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap();
    let eph = EcKey::generate(&group).unwrap();
    let mut ctx = BigNumContext::new().unwrap();
    let point = eph
        .public_key()
        .to_bytes(&group, PointConversionForm::UNCOMPRESSED, &mut ctx)
        .unwrap();
    let eph = PKey::from_ec_key(eph).unwrap();
    let mut d = Deriver::new(&eph).unwrap();
    d.set_peer(&peer).unwrap();
    (point, d.derive_to_vec().unwrap())
}

/// Asserts that the TPM holds no transient objects or sessions.
pub fn assert_clean(tpm: &mut Tpm) {
    let h = tpm.loaded_handles().unwrap();
    assert!(
        h.transient.is_empty(),
        "leaked transient objects: {:x?}",
        h.transient
    );
    assert!(h.sessions.is_empty(), "leaked sessions: {:x?}", h.sessions);
}
