//! Secret key material that is locked in RAM and wiped when dropped.
//!
//! The session key is the one secret that unlocks every file of a session, so
//! it lives on the heap at a stable address, is `mlock`ed where the process is
//! allowed to (so it is never written to swap), and is zeroized on drop.

use rand_core::{CryptoRng, RngCore};
use zeroize::Zeroize;

/// Length of a session key in bytes (256 bits).
pub const SESSION_KEY_LEN: usize = 32;

/// A 256-bit session key: random per session, wrapped once per recipient.
pub struct SessionKey {
    bytes: Box<[u8; SESSION_KEY_LEN]>,
    locked: bool,
}

impl SessionKey {
    /// Draws a fresh session key from `rng`.
    pub fn generate<R: RngCore + CryptoRng + ?Sized>(rng: &mut R) -> Self {
        let mut key = Self::zeroed();
        rng.fill_bytes(&mut key.bytes[..]);
        key
    }

    /// Wraps existing bytes (e.g. just unwrapped from a stanza). The caller's
    /// copy should be a `Zeroizing` buffer.
    pub fn from_bytes(bytes: &[u8; SESSION_KEY_LEN]) -> Self {
        let mut key = Self::zeroed();
        key.bytes.copy_from_slice(bytes);
        key
    }

    fn zeroed() -> Self {
        let bytes = Box::new([0u8; SESSION_KEY_LEN]);
        let locked = lock_memory(bytes.as_ptr(), SESSION_KEY_LEN);
        SessionKey { bytes, locked }
    }

    /// The raw key bytes.
    pub fn expose(&self) -> &[u8; SESSION_KEY_LEN] {
        &self.bytes
    }

    /// Whether `mlock` succeeded for this key (it may be refused by
    /// RLIMIT_MEMLOCK; the key is still zeroized on drop).
    pub fn is_locked(&self) -> bool {
        self.locked
    }
}

impl Drop for SessionKey {
    fn drop(&mut self) {
        self.bytes.zeroize();
        if self.locked {
            unlock_memory(self.bytes.as_ptr(), SESSION_KEY_LEN);
        }
    }
}

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKey(<redacted>)")
    }
}

fn lock_memory(ptr: *const u8, len: usize) -> bool {
    // SAFETY: `ptr..ptr+len` is a live heap allocation owned by the caller;
    // mlock only changes paging behaviour and never touches the contents.
    unsafe { libc::mlock(ptr.cast(), len) == 0 }
}

fn unlock_memory(ptr: *const u8, len: usize) {
    // SAFETY: as for `lock_memory`; the allocation is still live here.
    unsafe {
        libc::munlock(ptr.cast(), len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_does_not_print_key() {
        let key = SessionKey::from_bytes(&[0xAB; 32]);
        let shown = format!("{key:?}");
        assert!(!shown.contains("ab") && !shown.contains("171"), "{shown}");
    }

    #[test]
    fn generated_keys_differ() {
        let mut rng = rand_core::OsRng;
        let a = SessionKey::generate(&mut rng);
        let b = SessionKey::generate(&mut rng);
        assert_ne!(a.expose(), b.expose());
    }
}
