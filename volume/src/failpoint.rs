//! Named crash sites for the crash-safety tests.

/// Environment variable naming the failpoint at which to die.
pub const FAILPOINT_ENV: &str = "STARTOS_VOLUME_FAILPOINT";

/// With the `failpoints` feature, SIGKILLs the whole process when
/// `STARTOS_VOLUME_FAILPOINT` equals `name`, exactly as a crash or `kill -9`
/// would: no destructor, no unwinding, no flush. Without it, does nothing.
#[inline]
pub(crate) fn failpoint(name: &str) {
    #[cfg(all(feature = "failpoints", target_os = "linux"))]
    if std::env::var_os(FAILPOINT_ENV).is_some_and(|v| v == name) {
        let _ =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
        std::process::abort();
    }
    #[cfg(not(all(feature = "failpoints", target_os = "linux")))]
    let _ = name;
}
