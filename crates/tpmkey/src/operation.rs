//! One TPM operation at a time in a process, and a way to end the process
//! between two. Each operation ([`crate::identity::TpmAccess::with`])
//! flushes what it loaded before it ends; a process ended by a signal in
//! the middle of one would leave its objects and sessions in a TPM that
//! has no resource manager (swtpm, `/dev/tpm0`), where a few such
//! interrupts fill it. Touches nothing of tpm2-tss.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

static OPERATION: Mutex<()> = Mutex::new(());

/// Set once the process is ending by a signal ([`end_operations`]).
static ENDING: AtomicBool = AtomicBool::new(false);

/// Whether the process is ending by a signal: an operation that waits
/// (for another process's simulator) gives up rather than hold the end
/// for its whole wait.
pub(crate) fn ending() -> bool {
    ENDING.load(Ordering::SeqCst)
}

/// Held for the length of one TPM operation.
pub(crate) fn begin() -> MutexGuard<'static, ()> {
    OPERATION.lock().unwrap_or_else(|e| e.into_inner())
}

/// For a process about to end by a signal: waits up to `limit` for the
/// TPM operation under way, if any, to end, and lets no other begin
/// (the wait is never given back). False if one was still under way at
/// `limit`.
pub fn end_operations(limit: Duration) -> bool {
    ENDING.store(true, Ordering::SeqCst);
    let deadline = Instant::now() + limit;
    loop {
        match OPERATION.try_lock() {
            Ok(guard) => {
                std::mem::forget(guard);
                return true;
            }
            Err(TryLockError::Poisoned(p)) => {
                std::mem::forget(p.into_inner());
                return true;
            }
            Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(TryLockError::WouldBlock) => return false,
        }
    }
}
