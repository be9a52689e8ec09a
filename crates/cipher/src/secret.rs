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

/// The locked pages and how many live secrets lie on each. `mlock` and
/// `munlock` work on whole pages and do not count: unlocking one secret's
/// range would unlock another secret on the same page (an agent holding
/// many session keys let most of them become swappable as others expired).
/// So a page is unlocked only when the last secret on it goes.
static LOCKED_PAGES: std::sync::Mutex<std::collections::BTreeMap<usize, usize>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

fn page_size() -> usize {
    static SIZE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    // SAFETY: sysconf has no preconditions.
    *SIZE.get_or_init(|| match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as usize,
        _ => 4096,
    })
}

/// The start of each page `ptr..ptr+len` touches.
fn pages(ptr: *const u8, len: usize) -> impl Iterator<Item = usize> {
    let size = page_size();
    let first = ptr as usize / size * size;
    let last = (ptr as usize + len.max(1) - 1) / size * size;
    (first..=last).step_by(size)
}

/// Locks `ptr..ptr+len` in memory, where the process is allowed to, and
/// counts it on its pages; `false` if `mlock` refused. A range locked here
/// must be given back to [`unlock_memory`] before it is freed.
pub fn lock_memory(ptr: *const u8, len: usize) -> bool {
    let mut locked = LOCKED_PAGES.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: `ptr..ptr+len` is a live allocation owned by the caller;
    // mlock only changes paging behaviour and never touches the contents.
    if unsafe { libc::mlock(ptr.cast(), len) } != 0 {
        let cause = std::io::Error::last_os_error();
        drop(locked);
        refused(&cause);
        return false;
    }
    for page in pages(ptr, len) {
        *locked.entry(page).or_insert(0) += 1;
    }
    true
}

/// Whether `mlock` has refused a range in this process (the hook is
/// called at the first refusal only).
static REFUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Called at the first refusal (see [`on_first_lock_refusal`]).
static REFUSAL_HOOK: std::sync::OnceLock<fn(&std::io::Error)> = std::sync::OnceLock::new();

/// Has `hook` called, once per process, the first time `mlock` refuses to
/// lock a secret (typically `RLIMIT_MEMLOCK` reached: the secret then
/// lives in pages that may be swapped out, so the caller should say so).
/// The first hook set stays.
pub fn on_first_lock_refusal(hook: fn(&std::io::Error)) {
    let _ = REFUSAL_HOOK.set(hook);
}

fn refused(cause: &std::io::Error) {
    if !REFUSED.swap(true, std::sync::atomic::Ordering::SeqCst) {
        if let Some(hook) = REFUSAL_HOOK.get() {
            hook(cause);
        }
    }
}

/// Undoes [`lock_memory`]: each page of the range is unlocked once no
/// other locked range lies on it.
pub fn unlock_memory(ptr: *const u8, len: usize) {
    let mut locked = LOCKED_PAGES.lock().unwrap_or_else(|e| e.into_inner());
    for page in pages(ptr, len) {
        match locked.get_mut(&page) {
            Some(count) if *count > 1 => *count -= 1,
            _ => {
                locked.remove(&page);
                // SAFETY: the page holds the caller's live allocation;
                // munlock only changes paging behaviour.
                unsafe {
                    libc::munlock(page as *const libc::c_void, page_size());
                }
            }
        }
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

    /// Whether the page at `addr` is locked, from the kernel's own account
    /// (`/proc/self/smaps`: the mapping that holds it has the `lo` flag).
    fn page_is_locked(addr: usize) -> bool {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = range.split_once('-') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                {
                    inside = (a..b).contains(&addr);
                    continue;
                }
            }
            if inside && line.starts_with("VmFlags:") {
                return line.split_whitespace().any(|f| f == "lo");
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    /// Two keys on one page: dropping one leaves the other locked (the
    /// build before unlocked the whole page with the first drop).
    #[test]
    fn a_key_dropped_leaves_its_neighbours_locked() {
        let keys: Vec<SessionKey> = (0..64).map(|i| SessionKey::from_bytes(&[i; 32])).collect();
        assert!(keys.iter().all(SessionKey::is_locked), "mlock refused");
        let page = |k: &SessionKey| k.expose().as_ptr() as usize / page_size();
        let (i, j) = (0..keys.len())
            .flat_map(|i| (i + 1..keys.len()).map(move |j| (i, j)))
            .find(|&(i, j)| page(&keys[i]) == page(&keys[j]))
            .expect("two keys on one page");
        let survivor = keys[j].expose().as_ptr() as usize;
        let mut keys = keys;
        let gone = keys.remove(i);
        drop(gone);
        assert!(
            page_is_locked(survivor),
            "the page of a live key was unlocked"
        );
        drop(keys);
    }

    #[test]
    fn generated_keys_differ() {
        let mut rng = rand_core::OsRng;
        let a = SessionKey::generate(&mut rng);
        let b = SessionKey::generate(&mut rng);
        assert_ne!(a.expose(), b.expose());
    }
}
