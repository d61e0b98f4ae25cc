//! Injected system-call failures, for the I/O-error sweep.
//!
//! SQLite tests its I/O layer by making the k-th call fail, for every k, and
//! checking what each failure leaves; this module gives `sys` the same
//! seam. Every function of `sys` that enters the kernel passes through
//! `check` first, once per system call it makes. With the `failpoints`
//! feature and [`FAULT_ENV`] set to `K:ERRNO`, the K-th such call of the
//! process (counting every thread) fails with ERRNO instead of running;
//! with `K+:ERRNO`, that call and every later one fail, as on a filesystem
//! that went read-only or a disk that stopped answering. ERRNO is one of
//! `eio`, `enospc`, `erofs`, `eperm`, `emfile`, or a number.
//!
//! So that a sweep knows when K has passed the last call an operation
//! makes, the first injected failure appends `K NAME` (the call's name) to
//! the file [`FAULT_LOG_ENV`] names, if it is set: a run that leaves no
//! line made fewer than K calls. With `FAULT_ENV=trace`, nothing fails and
//! every call appends its line: how a sweep learns how many calls an
//! operation makes, and which is which.
//!
//! Without the feature, or without the `--cfg startos_failpoints` that
//! only this workspace's own builds set (see [`crate::failpoint`]), `check`
//! is an inline no-op: production builds carry no counter and read no
//! environment.

use std::io;

/// Environment variable: `K:ERRNO`, `K+:ERRNO` or `trace` (see the module
/// docs).
pub const FAULT_ENV: &str = "STARTOS_VOLUME_FAULT";
/// Environment variable: a file to which the first injected failure
/// appends `K NAME`.
pub const FAULT_LOG_ENV: &str = "STARTOS_VOLUME_FAULT_LOG";

/// The errno a fault spec names, from its name or number.
#[cfg(all(feature = "failpoints", startos_failpoints))]
pub(crate) fn parse_errno(name: &str) -> Option<i32> {
    Some(match name {
        "eio" => libc::EIO,
        "enospc" => libc::ENOSPC,
        "erofs" => libc::EROFS,
        "eperm" => libc::EPERM,
        "emfile" => libc::EMFILE,
        "eagain" => libc::EAGAIN,
        n => n.parse().ok()?,
    })
}

/// Counts one system call named `name` and, in a sweep, fails it if it is
/// the chosen one (see the module docs). Free without `failpoints`.
#[inline]
pub(crate) fn check(name: &'static str) -> io::Result<()> {
    #[cfg(all(feature = "failpoints", startos_failpoints))]
    {
        armed::check(name)
    }
    #[cfg(not(all(feature = "failpoints", startos_failpoints)))]
    {
        let _ = name;
        Ok(())
    }
}

#[cfg(all(feature = "failpoints", startos_failpoints))]
mod armed {
    use std::io::{self, Write};
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use super::{FAULT_ENV, FAULT_LOG_ENV, parse_errno};

    /// A parsed [`FAULT_ENV`].
    struct Spec {
        nth: u64,
        sticky: bool,
        errno: i32,
        trace: bool,
    }

    fn spec() -> Option<&'static Spec> {
        static SPEC: OnceLock<Option<Spec>> = OnceLock::new();
        SPEC.get_or_init(|| {
            let text = std::env::var(FAULT_ENV).ok()?;
            if text == "trace" {
                return Some(Spec {
                    nth: 0,
                    sticky: false,
                    errno: 0,
                    trace: true,
                });
            }
            let (at, errno) = text.split_once(':')?;
            let (at, sticky) = match at.strip_suffix('+') {
                Some(at) => (at, true),
                None => (at, false),
            };
            Some(Spec {
                nth: at.parse().ok()?,
                sticky,
                errno: parse_errno(errno)?,
                trace: false,
            })
        })
        .as_ref()
    }

    static CALLS: AtomicU64 = AtomicU64::new(0);
    static LOGGED: AtomicBool = AtomicBool::new(false);

    pub(super) fn check(name: &'static str) -> io::Result<()> {
        let Some(spec) = spec() else {
            return Ok(());
        };
        let n = CALLS.fetch_add(1, Ordering::Relaxed) + 1;
        if spec.trace {
            log(n, name);
            return Ok(());
        }
        let fire = n == spec.nth || (spec.sticky && n > spec.nth);
        if !fire {
            return Ok(());
        }
        if !LOGGED.swap(true, Ordering::Relaxed) {
            log(n, name);
        }
        Err(io::Error::from_raw_os_error(spec.errno))
    }

    /// Appends `N NAME` to [`FAULT_LOG_ENV`]'s file, if set: the sweep's
    /// bookkeeping, not the operation's, so its own failure changes
    /// nothing the operation sees.
    ///
    /// The line goes out in one `write` to a file opened `O_APPEND`, so a
    /// line of a thread working beside (a background cleanup) or of a
    /// child process lands whole before or after it: `writeln!` on the
    /// file itself writes the number, the space and the name separately,
    /// and a trace interleaved that way once lost the number of its line.
    fn log(n: u64, name: &str) {
        if let Some(log) = std::env::var_os(FAULT_LOG_ENV) {
            let line = format!("{n} {name}\n");
            let _ = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .and_then(|mut f| f.write_all(line.as_bytes()));
        }
    }
}

#[cfg(all(test, feature = "failpoints", startos_failpoints))]
mod tests {
    use super::*;

    #[test]
    fn errno_names_and_numbers_parse() {
        assert_eq!(parse_errno("erofs"), Some(libc::EROFS));
        assert_eq!(parse_errno("28"), Some(28));
        assert_eq!(parse_errno("nope"), None);
    }
}
