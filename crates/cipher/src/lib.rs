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

#![forbid(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod backend;
pub mod cbc_hmac;
pub mod error;
pub mod format;
pub mod io;
mod io_util;
pub mod recipient;
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
