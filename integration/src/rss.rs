//! Peak memory of a child process, for the tests and the bench that hold a
//! command to a memory bound.
//!
//! Measured by GNU time (`/usr/bin/time`, Debian's `time`, which `make
//! deps` installs), which reports its child's `ru_maxrss` from `wait4`. Not
//! by a `wait4` of this process's own: a child's `ru_maxrss` includes the
//! resident set of the process it was forked or vforked from, up to its
//! `exec` (the kernel keeps the larger), so every command measured from a
//! test or bench process of 11 MiB would show at least 11 MiB. GNU time is
//! a process of a megabyte or two: that is its floor.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// GNU time.
const TIME: &str = "/usr/bin/time";

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

/// Runs `cmd` (its program, arguments, environment and directory) to its
/// end under GNU time, its output captured, and measures its peak resident
/// set. GNU time's report goes to a file of its own in the temporary
/// directory, removed afterwards.
pub fn run_measured(cmd: &Command) -> io::Result<Measured> {
    if !Path::new(TIME).is_file() {
        return Err(io::Error::other(format!(
            "{TIME} is missing: install Debian's `time` package (make deps)"
        )));
    }
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let report: PathBuf = std::env::temp_dir().join(format!(
        "rss-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let mut timed = Command::new(TIME);
    timed
        .args(["-f", "%M", "-o"])
        .arg(&report)
        .arg(cmd.get_program())
        .args(cmd.get_args())
        .stdin(Stdio::null());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => timed.env(k, v),
            None => timed.env_remove(k),
        };
    }
    if let Some(dir) = cmd.get_current_dir() {
        timed.current_dir(dir);
    }
    let out = timed.output();
    let text = std::fs::read_to_string(&report);
    let _ = std::fs::remove_file(&report);
    let out = out?;
    // GNU time writes "Command exited with non-zero status N" before the
    // figure when the command fails: the figure is the last line.
    let kib: u64 = text?
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .ok_or_else(|| io::Error::other(format!("{TIME} reported no peak resident set")))?;
    Ok(Measured {
        status: out.status,
        stdout: out.stdout,
        stderr: out.stderr,
        peak_rss: kib.saturating_mul(1024),
    })
}
