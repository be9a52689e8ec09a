//! Process hardening for anything that may hold key material: no core
//! dumps, no ptrace attach by other processes of the same user, and
//! session keys locked in memory where the system allows (said when not).

/// Disables core dumps (RLIMIT_CORE = 0) and marks the process
/// non-dumpable. Failures are ignored: both are best-effort defences.
pub fn disable_core_dumps() {
    let zero = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls with valid, fully initialised arguments.
    unsafe {
        libc::setrlimit(libc::RLIMIT_CORE, &zero);
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
    }
}

/// Raises the locked-memory limit (`RLIMIT_MEMLOCK`) to its hard maximum,
/// so that session keys are locked where the system allows, and has the
/// first key that cannot be locked named in a warning on standard error:
/// the key then lives in pages that may be written to swap.
pub fn lock_secrets_or_say_so() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid pointers to fully initialised rlimits.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim);
        }
    }
    tpmcrypt_cipher::secret::on_first_lock_refusal(say_a_key_is_not_locked);
}

/// The warning of [`lock_secrets_or_say_so`], one line.
fn say_a_key_is_not_locked(cause: &std::io::Error) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid out-pointer.
    let limit = match unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } {
        0 if lim.rlim_cur == libc::RLIM_INFINITY => "unlimited".to_string(),
        0 => format!("{} KiB", lim.rlim_cur / 1024),
        _ => "unknown".to_string(),
    };
    stderr_line!(
        "{} a session key could not be locked in memory ({}; locked-memory limit {limit}), so it \
         may be written to swap: raise the limit (`ulimit -l`, or LimitMEMLOCK= for a service) or \
         use encrypted swap",
        crate::ui::colour::warning(),
        crate::ui::printable(&cause.to_string())
    );
}

/// Has a wait for a lock that another process holds (the keystore's, the
/// simulator's state) said on standard error (once), rather than wait
/// without a word.
pub fn say_lock_waits() {
    tpmcrypt_tpmkey::trust::on_lock_wait(|lock, what| {
        stderr_line!(
            "tpmcrypt: waiting for {what} {}, which another process holds",
            crate::ui::shown(lock)
        )
    });
}

/// The current soft core-size limit.
#[cfg(test)]
fn core_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 1,
        rlim_max: 1,
    };
    // SAFETY: valid out-pointer.
    unsafe {
        libc::getrlimit(libc::RLIMIT_CORE, &mut lim);
    }
    lim.rlim_cur
}

#[cfg(test)]
mod tests {
    #[test]
    fn core_dumps_are_disabled() {
        super::disable_core_dumps();
        assert_eq!(super::core_limit(), 0);
        // SAFETY: plain syscall.
        let dumpable = unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) };
        assert_eq!(dumpable, 0);
    }
}
