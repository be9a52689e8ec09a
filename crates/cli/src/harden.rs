//! Process hardening for anything that may hold key material: no core
//! dumps, and no ptrace attach by other processes of the same user.

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
