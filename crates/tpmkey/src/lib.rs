//! TPM-bound keys for tpmcrypt.
//!
//! This crate is the TPM half of tpmcrypt: it creates decryption keys that live
//! under the TPM's storage root key (so the private half never leaves the TPM),
//! stores them in the interoperable `TSS2 PRIVATE KEY` format, and performs the
//! "unbind" operations (RSA-OAEP decryption, ECDH Z generation) that recover a
//! file key.  Everything goes through the real TPM software stack (tpm2-tss via
//! `tss-esapi`); tests run against a real `swtpm` process (see [`simulator`]).
//!
//! Which TPM and which PCRs are named as tpm2-tools users write them:
//!
//! ```
//! use tpmcrypt_tpmkey::{PcrSelection, Tcti};
//!
//! let tcti: Tcti = "swtpm:host=localhost,port=2321".parse()?;
//! assert_eq!(tcti, Tcti::Swtpm { host: "localhost".into(), port: 2321 });
//! let pcrs: PcrSelection = "sha256:0,7".parse()?;
//! assert_eq!(pcrs.to_string(), "sha256:0,7");
//! assert!("sha256:99".parse::<PcrSelection>().is_err());
//! # Ok::<(), tpmcrypt_tpmkey::Error>(())
//! ```
//!
//! A file addressed to a TPM key is decrypted with the cipher crate and
//! [`identity`] (see `examples/decrypt_with_tpm_key.rs`).
//!
//! Module map:
//! * [`tcti`]      – which TPM to talk to (tpm2-tools TCTI syntax).
//! * [`simulator`] – start/stop a private swtpm (tests and `--simulator`).
//! * [`tpm`]       – the [`Tpm`] handle: SRK, key creation, unbind.
//! * [`pcr`]       – PCR selections such as `sha256:0,7`.
//! * [`probe`]     – read-only diagnostics (`tpmcrypt doctor`) as plain data.
//! * [`signed`]    – signed PCR policies (PolicyAuthorize) and PCR signers.
//! * [`keyfile`]   – [`KeyBlob`] ⇄ `TSS2 PRIVATE KEY` PEM, public key export.
//! * [`keystore`]  – a directory of named keys.
//! * [`identity`]  – TPM keys as the cipher crate's identities and
//!   recipients: a lazily opened TPM, PINs through a callback.
//! * [`agent`]     – the session-key agent: protocol, client, server.
//! * [`trust`]     – ownership checks of the socket and keystore paths.
//! * [`stack`]     – the tpm2-tss library loaded at run time.
//! * [`error`]     – the [`Error`] type and its coarse classes.

#![warn(missing_docs)]

pub mod agent;
mod asn1;
pub mod error;
pub mod identity;
pub mod keyfile;
pub mod keystore;
pub mod operation;
pub mod pcr;
pub mod probe;
pub mod signed;
pub mod simulator;
pub mod stack;
pub mod tcti;
pub mod tpm;
pub mod trust;

pub use error::{Error, ExitClass, Result};
pub use keyfile::{KeyAlg, KeyBlob, PolicyCommand};
pub use keystore::{KeyMeta, Keystore};
pub use pcr::{PcrBank, PcrSelection};
pub use simulator::{Simulator, SimulatorOptions};
pub use tcti::{Tcti, TctiSource};
pub use tpm::{Tpm, TpmInfo};
