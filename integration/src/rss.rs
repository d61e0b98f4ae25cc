//! Peak memory of a child process: what the kernel counted as its largest
//! resident set (`ru_maxrss` from `wait4`), for the tests and the bench
//! that hold a command to a memory bound.

use std::io::{self, Read};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus, Stdio};

/// What [`run_measured`] saw of a command.
#[derive(Debug)]
pub struct Measured {
    /// How it ended.
    pub status: ExitStatus,
    /// Its standard output.
    pub stdout: Vec<u8>,
    /// Its standard error.
    pub stderr: Vec<u8>,
    /// Its peak resident set, in bytes (the largest of its own and of the
    /// children it waited for).
    pub peak_rss: u64,
}

/// Runs `cmd` to its end, its output captured, and measures its peak
/// resident set. Reaps the child itself (with `wait4`, which reports that
/// one child's usage, whatever else this process runs at the same time).
pub fn run_measured(cmd: &mut Command) -> io::Result<Measured> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut out = child.stdout.take();
    let mut err = child.stderr.take();
    let err_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(e) = err.as_mut() {
            let _ = e.read_to_end(&mut buf);
        }
        buf
    });
    let mut stdout = Vec::new();
    if let Some(o) = out.as_mut() {
        o.read_to_end(&mut stdout)?;
    }
    let stderr = err_reader.join().unwrap_or_default();
    let pid = i32::try_from(child.id()).map_err(io::Error::other)?;
    let (status, max_rss_kib) = wait4(pid)?;
    Ok(Measured {
        status: ExitStatus::from_raw(status),
        stdout,
        stderr,
        peak_rss: max_rss_kib.saturating_mul(1024),
    })
}

/// Waits for the child `pid`: its raw wait status and `ru_maxrss` (KiB).
#[allow(unsafe_code)] // wait4
fn wait4(pid: i32) -> io::Result<(i32, u64)> {
    let mut status = 0;
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    loop {
        // SAFETY: wait4 writes only the status and rusage it is given,
        // both valid for writes; a zeroed rusage is a valid one.
        let r = unsafe { libc::wait4(pid, &mut status, 0, usage.as_mut_ptr()) };
        if r == pid {
            break;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    // SAFETY: wait4 succeeded and filled it (and zeroed was valid already).
    let usage = unsafe { usage.assume_init() };
    Ok((status, u64::try_from(usage.ru_maxrss).unwrap_or(0)))
}
