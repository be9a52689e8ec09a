//! tpmcrypt-cipher: the tpmcrypt file format, the streaming AEAD and the AES
//! backends. It knows nothing of TPMs or of the command line: recipients and
//! identities are traits, and the TPM crate supplies one implementation.
//!
//! ```text
//! file    = header ‖ payload
//! header  = magic ‖ version ‖ mode ‖ key_len ‖ segment_size ‖ stanzas ‖ HMAC
//! payload = Tink AES-GCM-HKDF stream (gcm) or CBC-HMAC segments (cbc),
//!           with the whole header as associated data
//! ```
//! See `docs/format.md` for the byte-level description.
//!
//! The layers, each using only those above it:
//! [`segment`] (parameters, layout, per-file keys, nonces, sealing and
//! opening one segment, stateless), [`mod@format`] (the header), [`stream`]
//! (the one parallel pipeline engine over a segment source), [`io`]
//! (sequential `Read`/`Write` adapters) and [`session`] (session keys,
//! recipients, files).
//!
//! Encrypting to a recovery (P-256) recipient and decrypting, in memory:
//!
//! ```
//! use tpmcrypt_cipher::recovery::RecoveryKey;
//! use tpmcrypt_cipher::{Decryptor, Encryptor, Mode, Params, Recipient, StreamOptions};
//!
//! let key = RecoveryKey::generate(&mut rand_core::OsRng);
//! // The recipient string (`key.recipient_string()`) parses back into the
//! // same recipient with `recovery::parse_recipient`.
//! let recipient = tpmcrypt_cipher::recovery::parse_recipient(&key.recipient_string())?;
//! let to: Vec<Box<dyn Recipient>> = vec![Box::new(recipient)];
//! let encryptor = Encryptor::new(&to, Params::new(Mode::Gcm, 256)?)?;
//! let plain = vec![42u8; 3 << 20]; // three 1 MiB segments and a bit
//! let mut file = Vec::new();
//! encryptor.encrypt(&plain[..], &mut file, &StreamOptions::parallel(2))?;
//!
//! let decryptor = Decryptor::new(vec![Box::new(key.into_identity()?)]);
//! let mut out = Vec::new();
//! decryptor.decrypt(&file[..], &mut out, &StreamOptions::sequential())?;
//! assert_eq!(out, plain);
//!
//! // A changed byte is an integrity error, and nothing of that segment is
//! // written.
//! let last = file.len() - 1;
//! file[last] ^= 1;
//! let err = decryptor
//!     .decrypt(&file[..], &mut Vec::new(), &StreamOptions::sequential())
//!     .unwrap_err();
//! assert!(err.is_integrity());
//! # Ok::<(), tpmcrypt_cipher::Error>(())
//! ```

#![forbid(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod armor;
pub mod backend;
pub mod cbc_hmac;
pub mod error;
pub mod format;
pub mod io;
mod io_util;
pub mod recipient;
pub mod recipients_file;
pub mod recovery;
pub mod secret;
pub mod segment;
pub mod session;
pub mod stream;

pub use error::{Error, Result};
pub use format::{Header, Mode, Params, Stanza};
pub use io::{StreamReader, StreamWriter};
pub use recipient::{Identity, Recipient};
pub use secret::SessionKey;
pub use session::{Decryptor, Encryptor, SessionCache};
pub use stream::{StreamOptions, Timings, TimingsSnapshot};
