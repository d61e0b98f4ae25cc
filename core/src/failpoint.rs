//! Named crash sites for the crash-safety tests, sharing volume's switch.

pub use volume::FAILPOINT_ENV;

/// With the `failpoints` feature, SIGKILLs the whole process when
/// [`FAILPOINT_ENV`] (`STARTOS_VOLUME_FAILPOINT`, the variable volume's own
/// failpoints read) equals `name`: no destructor, no unwinding, no flush, as a
/// crash or `kill -9`. Without the feature, does nothing.
#[inline]
pub(crate) fn failpoint(name: &str) {
    #[cfg(feature = "failpoints")]
    if std::env::var_os(FAILPOINT_ENV).is_some_and(|v| v == name) {
        let _ =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
        std::process::abort();
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}
