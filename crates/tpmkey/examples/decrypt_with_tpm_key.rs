//! Decrypts a tpmcrypt file with a TPM key, using the two libraries alone
//! (no command line tool involved).
//!
//! ```sh
//! cargo run -p tpmcrypt-tpmkey --example decrypt_with_tpm_key -- \
//!     KEY.key.pem TCTI < FILE.tpmc > FILE
//! ```
//!
//! KEY.key.pem is a `TSS2 PRIVATE KEY` file (as `tpmcrypt key create`
//! writes into the keystore, or tpm2-tools/openssl_tpm2_engine make), TCTI
//! names the TPM (`device:/dev/tpmrm0`, `swtpm:host=localhost,port=2321`).
//! A key with a PIN takes it from the environment variable `KEY_PIN`.

use std::io::Write;
use std::sync::Arc;

use tpmcrypt_cipher::{Decryptor, StreamOptions};
use tpmcrypt_tpmkey::identity::{self, NoPin, Pin, PinSource, Pins, Target, TpmAccess};
use tpmcrypt_tpmkey::{KeyBlob, Tcti};
use zeroize::Zeroizing;

/// The PIN from `KEY_PIN`, presented once (it would be wrong again).
struct PinFromEnv;

impl PinSource for PinFromEnv {
    fn pin(&self, name: &str, refused: u32) -> tpmcrypt_tpmkey::Result<Pin> {
        match std::env::var("KEY_PIN") {
            Ok(pin) => Ok(Pin {
                secret: Zeroizing::new(pin.into_bytes()),
                may_retry: false,
                origin: "KEY_PIN".into(),
            }),
            Err(_) => NoPin.pin(name, refused),
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, key_file, tcti] = args.as_slice() else {
        return Err("usage: decrypt_with_tpm_key KEY.key.pem TCTI < IN.tpmc > OUT".into());
    };
    // The key: its public half says which stanza is ours; its private half
    // is loaded into the TPM only when a stanza is addressed to it.
    let blob = KeyBlob::from_pem(&std::fs::read_to_string(key_file)?)?;
    let has_pin = !blob.empty_auth;
    let access = TpmAccess::new(Target::Tcti(tcti.parse::<Tcti>()?));
    let pins = Arc::new(Pins::new(Box::new(PinFromEnv)));
    let key = identity::identity("key", blob, has_pin, &access, &pins)?;

    // Streams in constant memory; every segment is authenticated before
    // it is written.
    let decryptor = Decryptor::new(vec![key]);
    let mut out = std::io::stdout();
    let n = decryptor.decrypt(std::io::stdin(), &mut out, &StreamOptions::sequential())?;
    out.flush()?;
    eprintln!(
        "decrypted {n} bytes with {} TPM unbind(s)",
        access.unbind_count()
    );
    Ok(())
}
